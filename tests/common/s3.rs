//! A real S3 server for the S3 source tests (tests/s3.rs): s3s-fs (the
//! s3s project's file-system backed S3 server, installed by
//! `scripts/setup.sh --test-tools` into ~/.cache/kspeed/s3s), started on
//! 127.0.0.1 with a free port, a temporary root and its own keys; a client
//! that uploads through the S3 API (never into the server's root); a
//! fault-injecting HTTP proxy (503 SlowDown, slow responses); and `kspeed`
//! runs with a deadline whose output is checked for the secrets; tar
//! shards made in memory and samples read back from a space.
//!
//! Uploads go through the object_store crate (the same crate kspeed's s3
//! feature depends on, so nothing new to build): it signs with SigV4, runs
//! 100,000 PUTs concurrently in under a minute, and needs no Python at `cargo test`
//! time (the venv with boto3 is made later in the test command). It is not an
//! independent client; ffi/python/tests/test_s3.py reads the same kind of
//! bucket with boto3 and checks what kspeed recorded.
//!
//! Included by tests/s3.rs with `#[path]`; it uses `crate::common`.

#![allow(dead_code)]

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use object_store::aws::{AmazonS3, AmazonS3Builder};
use object_store::path::Path as ObjPath;
use object_store::signer::{SignedUrlOptions, Signer};
use object_store::ObjectStoreExt;

pub const REGION: &str = "us-east-1";

/// The s3s-fs binary: $KSPEED_S3S_FS, else where scripts/setup.sh installs
/// it ($XDG_CACHE_HOME or ~/.cache, then kspeed/s3s/bin/s3s-fs), else PATH.
pub fn s3s_fs_bin() -> Option<PathBuf> {
    if let Ok(p) = std::env::var("KSPEED_S3S_FS") {
        return Some(PathBuf::from(p));
    }
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    let p = cache.join("kspeed/s3s/bin/s3s-fs");
    if p.is_file() {
        return Some(p);
    }
    std::env::var_os("PATH")?
        .to_str()?
        .split(':')
        .map(|d| Path::new(d).join("s3s-fs"))
        .find(|p| p.is_file())
}

fn unique() -> String {
    let n = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    static SEQ: AtomicU64 = AtomicU64::new(0);
    format!(
        "{:x}{:x}{}",
        std::process::id(),
        n,
        SEQ.fetch_add(1, Ordering::Relaxed)
    )
}

pub struct S3Server {
    child: Option<Child>,
    root: tempfile::TempDir,
    port: u16,
    pub access_key: String,
    pub secret_key: String,
    log: PathBuf,
    rt: tokio::runtime::Runtime,
    stores: Mutex<HashMap<String, Arc<AmazonS3>>>,
}

impl S3Server {
    /// Starts s3s-fs, or returns None after `skip()` when it is not
    /// installed (a failure under KSPEED_REQUIRE=all).
    pub fn start() -> Option<S3Server> {
        let Some(bin) = s3s_fs_bin() else {
            crate::common::skip(
                "s3s-fs is not installed (scripts/setup.sh --test-tools installs it into ~/.cache/kspeed/s3s)",
            );
            return None;
        };
        // The rustls provider object_store's HTTP client (reqwest) uses.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let root = tempfile::tempdir().unwrap();
        let log = root.path().join("s3s-fs.log");
        let data = root.path().join("data");
        std::fs::create_dir_all(&data).unwrap();
        let id = unique();
        let mut srv = S3Server {
            child: None,
            root,
            port: 0,
            access_key: format!("KSPTESTAK{}", &id[..8.min(id.len())]).to_uppercase(),
            secret_key: format!("kspeedSecret{id}XyZ"),
            log,
            rt: tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .unwrap(),
            stores: Mutex::new(HashMap::new()),
        };
        // A free port can be taken between our probe and the server's bind:
        // a few tries.
        let mut last = String::new();
        for _ in 0..5 {
            srv.port = free_port();
            match srv.spawn(&bin) {
                Ok(()) => return Some(srv),
                Err(e) => last = e,
            }
        }
        panic!("s3s-fs did not start: {last}");
    }

    fn spawn(&mut self, bin: &Path) -> Result<(), String> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .unwrap();
        let mut child = Command::new(bin)
            .args(["--host", "127.0.0.1", "--port", &self.port.to_string()])
            .args(["--access-key", &self.access_key])
            .args(["--secret-key", &self.secret_key])
            .arg(self.root.path().join("data"))
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .map_err(|e| format!("spawn {}: {e}", bin.display()))?;
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(st) = child.try_wait().unwrap() {
                return Err(format!("s3s-fs exited ({st}): {}", self.log_text()));
            }
            if TcpStream::connect_timeout(&self.addr(), Duration::from_millis(200)).is_ok() {
                self.child = Some(child);
                return Ok(());
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!(
                    "s3s-fs not accepting on {} after 30 s: {}",
                    self.addr(),
                    self.log_text()
                ));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Stops the server (SIGKILL), keeping its port and root.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts it again on the same port and root.
    pub fn restart(&mut self) {
        self.kill();
        let bin = s3s_fs_bin().unwrap();
        // The old socket may linger for a moment: retry within a deadline.
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            match self.spawn(&bin) {
                Ok(()) => return,
                Err(e) if Instant::now() > deadline => panic!("restart: {e}"),
                Err(_) => std::thread::sleep(Duration::from_millis(100)),
            }
        }
    }

    /// The AWS variables a kspeed child gets: the keys, region, endpoint.
    pub fn env(&self) -> Vec<(String, String)> {
        vec![
            ("AWS_ACCESS_KEY_ID".into(), self.access_key.clone()),
            ("AWS_SECRET_ACCESS_KEY".into(), self.secret_key.clone()),
            ("AWS_REGION".into(), REGION.into()),
            ("AWS_ENDPOINT_URL".into(), self.endpoint()),
        ]
    }

    fn store(&self, bucket: &str) -> Arc<AmazonS3> {
        let mut m = self.stores.lock().unwrap();
        m.entry(bucket.to_string())
            .or_insert_with(|| {
                Arc::new(
                    AmazonS3Builder::new()
                        .with_endpoint(self.endpoint())
                        .with_allow_http(true)
                        .with_virtual_hosted_style_request(false)
                        .with_region(REGION)
                        .with_bucket_name(bucket)
                        .with_access_key_id(&self.access_key)
                        .with_secret_access_key(&self.secret_key)
                        .build()
                        .unwrap(),
                )
            })
            .clone()
    }

    /// CreateBucket (object_store has no call for it: a presigned PUT of
    /// the bucket's path).
    pub fn create_bucket(&self, bucket: &str) {
        let store = self.store(bucket);
        self.rt.block_on(async {
            let url = store
                .signed_url(
                    reqwest::Method::PUT,
                    &ObjPath::from(""),
                    Duration::from_secs(300),
                )
                .await
                .unwrap();
            let r = reqwest::Client::new()
                .put(url.as_str())
                .timeout(Duration::from_secs(30))
                .send()
                .await
                .unwrap();
            let st = r.status();
            let body = r.text().await.unwrap_or_default();
            assert!(st.is_success(), "CreateBucket {bucket}: {st} {body}");
        });
    }

    pub fn put(&self, bucket: &str, key: &str, bytes: &[u8]) {
        let store = self.store(bucket);
        self.rt.block_on(async {
            tokio::time::timeout(
                Duration::from_secs(60),
                store.put(&ObjPath::from(key), bytes.to_vec().into()),
            )
            .await
            .unwrap_or_else(|_| panic!("PUT {bucket}/{key}: no answer in 60 s"))
            .unwrap_or_else(|e| panic!("PUT {bucket}/{key}: {e}"));
        });
    }

    /// Uploads many objects, `concurrency` at a time, within `limit`.
    pub fn put_many(
        &self,
        bucket: &str,
        objects: impl IntoIterator<Item = (String, Vec<u8>)>,
        concurrency: usize,
        limit: Duration,
    ) {
        let store = self.store(bucket);
        let objects: Vec<(String, Vec<u8>)> = objects.into_iter().collect();
        self.rt.block_on(async {
            let work = futures_util::stream::iter(objects)
                .map(|(k, b)| {
                    let store = store.clone();
                    async move {
                        store
                            .put(&ObjPath::from(k.as_str()), b.into())
                            .await
                            .map_err(|e| format!("PUT {k}: {e}"))
                    }
                })
                .buffer_unordered(concurrency)
                .for_each(|r| {
                    r.unwrap();
                    std::future::ready(())
                });
            tokio::time::timeout(limit, work)
                .await
                .unwrap_or_else(|_| panic!("uploads to {bucket} took over {limit:?}"));
        });
    }

    /// How long the server takes to answer one ListObjectsV2 page (1,000
    /// keys) under `prefix`: the median of 3. s3s-fs walks and stats the
    /// whole bucket for every page, so a listing's cost is pages × this.
    pub fn list_page_time(&self, bucket: &str, prefix: &str) -> Duration {
        let store = self.store(bucket);
        self.rt.block_on(async {
            let opts = SignedUrlOptions::new().with_query([("list-type", "2"), ("prefix", prefix)]);
            let mut times = Vec::new();
            for _ in 0..3 {
                let url = store
                    .signed_url_opts(
                        reqwest::Method::GET,
                        &ObjPath::from(""),
                        Duration::from_secs(300),
                        &opts,
                    )
                    .await
                    .unwrap();
                let t0 = Instant::now();
                let r = reqwest::Client::new()
                    .get(url.as_str())
                    .timeout(Duration::from_secs(120))
                    .send()
                    .await
                    .unwrap();
                let st = r.status();
                let body = r.text().await.unwrap_or_default();
                assert!(
                    st.is_success() && body.contains("<Key>"),
                    "ListObjectsV2 {bucket}/{prefix}: {st} {body:.300}"
                );
                times.push(t0.elapsed());
            }
            times.sort();
            times[1]
        })
    }

    /// The object's ETag as the server gives it (HEAD), quotes removed.
    pub fn etag(&self, bucket: &str, key: &str) -> String {
        let store = self.store(bucket);
        self.rt.block_on(async {
            let m = store
                .head(&ObjPath::from(key))
                .await
                .unwrap_or_else(|e| panic!("HEAD {bucket}/{key}: {e}"));
            m.e_tag.unwrap_or_default().trim_matches('"').to_string()
        })
    }

    pub fn delete(&self, bucket: &str, key: &str) {
        let store = self.store(bucket);
        self.rt.block_on(async {
            store
                .delete(&ObjPath::from(key))
                .await
                .unwrap_or_else(|e| panic!("DELETE {bucket}/{key}: {e}"));
        });
    }

    /// A `kspeed` command with only this server's AWS settings (none of the
    /// caller's AWS_* variables, no ~/.aws files).
    pub fn kspeed_cmd(&self, args: &[&str]) -> Command {
        let mut c = bare_kspeed_cmd(args, self.root.path());
        c.envs(self.env());
        c
    }

    /// Runs `cmd` within `limit`; its stdout and stderr must not hold
    /// this server's secret key.
    pub fn run(&self, cmd: Command, limit: Duration) -> Output {
        let o = run_for(cmd, limit);
        self.assert_no_secret(&o);
        o
    }

    pub fn assert_no_secret(&self, o: &Output) {
        for (what, b) in [("stdout", &o.stdout), ("stderr", &o.stderr)] {
            let t = String::from_utf8_lossy(b);
            assert!(
                !t.contains(&self.secret_key),
                "the secret key appears in kspeed's {what}:\n{t}"
            );
        }
    }

    /// `kspeed ARGS` with this server's environment: success within
    /// `limit`, returns stdout.
    pub fn ok(&self, args: &[&str], limit: Duration) -> String {
        let o = self.run(self.kspeed_cmd(args), limit);
        assert!(
            o.status.success(),
            "kspeed {args:?} failed:\n{}",
            crate::common::text(&o)
        );
        String::from_utf8_lossy(&o.stdout).into_owned()
    }

    /// `kspeed ARGS` must fail (a non-zero exit status, not a signal);
    /// returns stdout and stderr.
    pub fn fails(&self, args: &[&str], limit: Duration) -> String {
        let o = self.run(self.kspeed_cmd(args), limit);
        assert_failed(args, &o)
    }
}

impl Drop for S3Server {
    fn drop(&mut self) {
        self.kill();
    }
}

pub fn assert_failed(args: &[&str], o: &Output) -> String {
    let t = crate::common::text(o);
    assert!(
        matches!(o.status.code(), Some(c) if c != 0),
        "kspeed {args:?} should fail with a non-zero exit status:\n{t}"
    );
    assert!(
        !t.contains("panicked"),
        "kspeed {args:?} panicked instead of a named error:\n{t}"
    );
    t
}

/// `kspeed ARGS --progress=none` with every AWS_* variable of this process
/// removed and the shared files pointed into `dir` (absent there), so
/// nothing of the machine's AWS setup leaks in.
pub fn bare_kspeed_cmd(args: &[&str], dir: &Path) -> Command {
    let mut c = Command::new(crate::common::kspeed_bin());
    c.args(args).arg("--progress=none");
    for (k, _) in std::env::vars_os() {
        if k.to_str().is_some_and(|k| k.starts_with("AWS_")) {
            c.env_remove(&k);
        }
    }
    c.env("AWS_SHARED_CREDENTIALS_FILE", dir.join("no-credentials"))
        .env("AWS_CONFIG_FILE", dir.join("no-config"))
        .env("AWS_EC2_METADATA_DISABLED", "true");
    c
}

/// Runs `cmd` with piped output; kills it and panics (with what it printed)
/// when it runs past `limit`.
pub fn run_for(mut cmd: Command, limit: Duration) -> Output {
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn kspeed");
    let (out_t, err_t) = drain(&mut child);
    let deadline = Instant::now() + limit;
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            let o = String::from_utf8_lossy(&out_t.join().unwrap()).into_owned();
            let e = String::from_utf8_lossy(&err_t.join().unwrap()).into_owned();
            panic!("{cmd:?} ran past {limit:?}:\n--- stdout\n{o}--- stderr\n{e}");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    Output {
        status,
        stdout: out_t.join().unwrap(),
        stderr: err_t.join().unwrap(),
    }
}

type Reader = std::thread::JoinHandle<Vec<u8>>;

/// Threads reading a child's stdout and stderr to their ends.
pub fn drain(child: &mut Child) -> (Reader, Reader) {
    let mut so = child.stdout.take().unwrap();
    let mut se = child.stderr.take().unwrap();
    (
        std::thread::spawn(move || {
            let mut b = Vec::new();
            let _ = so.read_to_end(&mut b);
            b
        }),
        std::thread::spawn(move || {
            let mut b = Vec::new();
            let _ = se.read_to_end(&mut b);
            b
        }),
    )
}

/// Waits for `child` within `limit` (killing it past that) and collects what
/// the `drain` threads read.
pub fn wait_for(mut child: Child, readers: (Reader, Reader), limit: Duration) -> Output {
    let deadline = Instant::now() + limit;
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break Some(st);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let o = Output {
        status: status.unwrap_or_else(|| child.wait().unwrap()),
        stdout: readers.0.join().unwrap(),
        stderr: readers.1.join().unwrap(),
    };
    assert!(
        status.is_some(),
        "the child ran past {limit:?}:\n{}",
        crate::common::text(&o)
    );
    o
}

pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A fault-injecting HTTP proxy in front of the server: one request per
/// client connection (it answers `Connection: close`), every `fail_every`th
/// request answered `503 Slow Down` with an S3 XML error body without
/// reaching the server, every `slow_every`th response held for `delay`
/// half-way through (after its head). 0 turns either off.
pub struct FaultProxy {
    port: u16,
    stop: Arc<AtomicBool>,
    pub requests: Arc<AtomicU64>,
    pub failed: Arc<AtomicU64>,
    pub slowed: Arc<AtomicU64>,
}

impl FaultProxy {
    pub fn start(upstream: SocketAddr, fail_every: u64, slow_every: u64, delay: Duration) -> Self {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        l.set_nonblocking(true).unwrap();
        let p = FaultProxy {
            port,
            stop: Arc::new(AtomicBool::new(false)),
            requests: Arc::default(),
            failed: Arc::default(),
            slowed: Arc::default(),
        };
        let (stop, requests, failed, slowed) = (
            p.stop.clone(),
            p.requests.clone(),
            p.failed.clone(),
            p.slowed.clone(),
        );
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                match l.accept() {
                    Ok((c, _)) => {
                        let n = requests.fetch_add(1, Ordering::Relaxed) + 1;
                        let fail = fail_every > 0 && n % fail_every == 0;
                        let slow = !fail && slow_every > 0 && n % slow_every == 0;
                        if fail {
                            failed.fetch_add(1, Ordering::Relaxed);
                        }
                        if slow {
                            slowed.fetch_add(1, Ordering::Relaxed);
                        }
                        std::thread::spawn(move || {
                            let _ = proxy_one(c, upstream, fail, slow.then_some(delay));
                        });
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        std::thread::sleep(Duration::from_millis(2))
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(10)),
                }
            }
        });
        p
    }

    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// Reads up to the end of an HTTP head (`\r\n\r\n`); returns the head and
/// whatever came after it.
fn read_head(s: &mut TcpStream) -> std::io::Result<(String, Vec<u8>)> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 8192];
    loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let rest = buf.split_off(i + 4);
            return Ok((String::from_utf8_lossy(&buf).into_owned(), rest));
        }
        let n = s.read(&mut chunk)?;
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        buf.extend_from_slice(&chunk[..n]);
        if buf.len() > 1 << 20 {
            return Err(std::io::ErrorKind::InvalidData.into());
        }
    }
}

/// The head with its Connection header replaced by `Connection: close`.
fn close_head(head: &str) -> String {
    let mut out = String::new();
    for line in head.trim_end_matches("\r\n").split("\r\n") {
        if line.to_ascii_lowercase().starts_with("connection:") {
            continue;
        }
        out.push_str(line);
        out.push_str("\r\n");
    }
    out.push_str("Connection: close\r\n\r\n");
    out
}

fn proxy_one(
    mut c: TcpStream,
    upstream: SocketAddr,
    fail: bool,
    delay: Option<Duration>,
) -> std::io::Result<()> {
    c.set_nonblocking(false)?;
    c.set_read_timeout(Some(Duration::from_secs(60)))?;
    let (head, mut body) = read_head(&mut c)?;
    let len: usize = head
        .split("\r\n")
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("content-length")
                .then(|| v.trim().parse().ok())?
        })
        .unwrap_or(0);
    while body.len() < len {
        let mut chunk = vec![0u8; len - body.len()];
        let n = c.read(&mut chunk)?;
        if n == 0 {
            return Ok(());
        }
        body.extend_from_slice(&chunk[..n]);
    }
    if fail {
        let xml = "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>SlowDown</Code>\
                   <Message>Please reduce your request rate.</Message>\
                   <RequestId>kspeed-fault-proxy</RequestId></Error>";
        write!(
            c,
            "HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nContent-Length: {}\r\n\
             Retry-After: 0\r\nConnection: close\r\n\r\n{xml}",
            xml.len()
        )?;
        let _ = c.shutdown(Shutdown::Write);
        return Ok(());
    }
    let mut u = TcpStream::connect_timeout(&upstream, Duration::from_secs(10))?;
    u.set_read_timeout(Some(Duration::from_secs(60)))?;
    u.write_all(close_head(&head).as_bytes())?;
    u.write_all(&body)?;
    let (rhead, rest) = read_head(&mut u)?;
    c.write_all(close_head(&rhead).as_bytes())?;
    if let Some(d) = delay {
        // Half the first piece of the body, then the pause.
        let half = rest.len() / 2;
        c.write_all(&rest[..half])?;
        c.flush()?;
        std::thread::sleep(d);
        c.write_all(&rest[half..])?;
    } else {
        c.write_all(&rest)?;
    }
    let mut chunk = [0u8; 65536];
    loop {
        let n = u.read(&mut chunk)?;
        if n == 0 {
            break;
        }
        c.write_all(&chunk[..n])?;
    }
    let _ = c.shutdown(Shutdown::Write);
    Ok(())
}

/// A WebDataset shard in memory: per key a .jpg (the sample), optionally a
/// .cls label, and a .json that is not the sample.
pub fn shard(first: u64, count: u64, labels: bool) -> (Vec<u8>, Vec<Vec<u8>>) {
    let mut b = tar::Builder::new(Vec::new());
    let mut datas = Vec::new();
    let add = |b: &mut tar::Builder<Vec<u8>>, name: String, data: &[u8]| {
        let mut h = tar::Header::new_gnu();
        h.set_size(data.len() as u64);
        h.set_mode(0o644);
        h.set_cksum();
        b.append_data(&mut h, name, data).unwrap();
    };
    for i in first..first + count {
        let data = crate::common::bytes_for(i, (i as usize * 997) % 20_000);
        add(&mut b, format!("{i:05}.jpg"), &data);
        if labels {
            add(
                &mut b,
                format!("{i:05}.cls"),
                format!("{}\n", i % 5).as_bytes(),
            );
        }
        add(&mut b, format!("{i:05}.json"), b"{}");
        datas.push(data);
    }
    (b.into_inner().unwrap(), datas)
}

/// Sample `id`'s bytes read back from the space's extents.
pub fn read_sample(space: &kspeed::dataset::Space, id: u64) -> Vec<u8> {
    use std::os::unix::fs::FileExt;
    let loc = space.location(id).expect("held here");
    let len = space.catalog().sample(id).len as usize;
    let f = std::fs::File::open(space.extent_path(loc.extent)).unwrap();
    let mut buf = vec![0u8; len];
    f.read_exact_at(&mut buf, loc.offset).unwrap();
    buf
}

/// Every file under `dir`, sorted (what a test uploads as objects).
pub fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut v = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            v.extend(files_under(&p));
        } else {
            v.push(p);
        }
    }
    v.sort();
    v
}

/// A small host ring (8 MiB, no huge pages, no mlock, no GPU) for loaders
/// reading a bucket or a web server in these tests.
pub fn small_landing() -> kspeed::landing::LandingOptions {
    kspeed::landing::LandingOptions::default()
        .ring_bytes(8 << 20)
        .huge_pages(false)
        .mlock(false)
        .numa_node(None)
        .gpu_pci(None)
        .cuda(kspeed::landing::CudaMode::Off)
}

/// Reads epoch 0 of `l` to its end, which must be an error (`why` says
/// which one, for the panic): its text.
pub fn epoch_error(l: &mut kspeed::loader::Loader, why: &str) -> String {
    (|| -> kspeed::Result<()> {
        l.set_epoch(0)?;
        while l.next_batch()?.is_some() {}
        Ok(())
    })()
    .expect_err(why)
    .to_string()
}
