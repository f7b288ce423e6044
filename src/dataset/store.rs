//! Object-store sources: `s3://bucket/prefix/` and friends, read through the
//! `object_store` crate (SigV4, ListObjectsV2 pagination, ranged GETs,
//! retries with backoff and jitter on 5xx, SlowDown and dropped
//! connections).
//!
//! Configuration is what the AWS command line reads, in its order:
//! credentials from `AWS_ACCESS_KEY_ID`/`AWS_SECRET_ACCESS_KEY`
//! (+`AWS_SESSION_TOKEN`), else from the profile (`--profile`, else
//! `AWS_PROFILE`, else `default`) in the shared credentials file
//! (`AWS_SHARED_CREDENTIALS_FILE`, default `~/.aws/credentials`) or config
//! file (`AWS_CONFIG_FILE`, default `~/.aws/config`); the region from
//! `AWS_REGION`, `AWS_DEFAULT_REGION`, the profile, else `us-east-1`; the
//! endpoint of an S3-compatible store from `--endpoint-url`,
//! `AWS_ENDPOINT_URL_S3`, `AWS_ENDPOINT_URL` or the profile's
//! `endpoint_url`. With an endpoint, requests are path-style
//! (`endpoint/bucket/key`, what S3-compatible stores serve); without one,
//! virtual-hosted (`bucket.s3.region.amazonaws.com`). With credentials
//! found, no instance-metadata endpoint is ever asked (off the cloud it
//! does not answer); with none, the provider chain of the cloud (web
//! identity, container, instance metadata) is tried, as the AWS tools do.
//!
//! Everything here blocks: one process-wide runtime (two threads) drives
//! the requests of every caller thread, so a pool of N caller threads has N
//! requests in flight. Secrets never leave this module: errors name the
//! URL and the S3 error, not the request.

use std::collections::HashMap;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::StreamExt;
use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey};
use object_store::path::Path as ObjPath;
use object_store::{
    BackoffConfig, ClientOptions, GetOptions, GetRange, ObjectStore, ObjectStoreExt, RetryConfig,
};

use super::store_url::{base_url, is_http_origin};
pub use super::store_url::{StoreUrl, S3_SCHEME};
use crate::error::{Error, Result, SourceChange};

/// Settings given on a command line or to a loader that override the
/// environment's (`--endpoint-url`, `--profile`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct StoreOverrides {
    /// The endpoint of an S3-compatible store (`http://127.0.0.1:9000`).
    pub endpoint_url: Option<String>,
    /// The profile of the shared credentials and config files.
    pub profile: Option<String>,
}

setters!(StoreOverrides {
    endpoint_url: Option<String>,
    profile: Option<String>,
});

static OVERRIDES: Mutex<Option<StoreOverrides>> = Mutex::new(None);

/// Sets the process's overrides (the CLI's `--endpoint-url`/`--profile`, a
/// loader's `s3_endpoint_url`/`s3_profile`). Clients already made keep the
/// settings they were made with; later ones use these.
pub fn set_overrides(o: StoreOverrides) {
    let mut g = OVERRIDES.lock().expect("not poisoned");
    if g.as_ref() != Some(&o) {
        *CLIENTS.lock().expect("not poisoned") = None;
    }
    *g = Some(o);
}

/// The settings a client is made with, resolved from overrides, the
/// environment and the shared files. `Debug` leaves the secrets out.
#[derive(Clone, Default)]
struct Resolved {
    endpoint: Option<String>,
    region: String,
    key_id: Option<String>,
    secret: Option<String>,
    token: Option<String>,
    /// Where the credentials came from, for messages ("environment",
    /// "profile default in ~/.aws/credentials").
    cred_from: String,
}

impl std::fmt::Debug for Resolved {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Resolved")
            .field("endpoint", &self.endpoint)
            .field("region", &self.region)
            .field("cred_from", &self.cred_from)
            .finish_non_exhaustive()
    }
}

/// `[section]` → key → value of an AWS shared file (INI: `#`/`;` comments,
/// `key = value`, keys case-insensitive as the AWS tools read them).
fn parse_ini(text: &str) -> HashMap<String, HashMap<String, String>> {
    let mut out: HashMap<String, HashMap<String, String>> = HashMap::new();
    let mut section = String::new();
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') || line.starts_with(';') {
            continue;
        }
        if let Some(s) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            section = s.trim().to_string();
            continue;
        }
        if let Some((k, v)) = line.split_once('=') {
            out.entry(section.clone())
                .or_default()
                .insert(k.trim().to_ascii_lowercase(), v.trim().to_string());
        }
    }
    out
}

fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

fn home_file(var: &str, rel: &str) -> Option<PathBuf> {
    env(var)
        .map(PathBuf::from)
        .or_else(|| env("HOME").map(|h| Path::new(&h).join(rel)))
}

/// Reads a shared file; a missing one is empty, an unreadable one an error.
fn read_shared(path: &Option<PathBuf>) -> Result<HashMap<String, HashMap<String, String>>> {
    let Some(p) = path else {
        return Ok(HashMap::new());
    };
    match std::fs::read_to_string(p) {
        Ok(t) => Ok(parse_ini(&t)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(HashMap::new()),
        Err(e) => Err(Error::io("read", p, e)),
    }
}

fn resolve(o: &StoreOverrides) -> Result<Resolved> {
    let explicit_profile = o.profile.clone();
    let profile = explicit_profile
        .clone()
        .or_else(|| env("AWS_PROFILE"))
        .or_else(|| env("AWS_DEFAULT_PROFILE"));
    let creds_path = home_file("AWS_SHARED_CREDENTIALS_FILE", ".aws/credentials");
    let config_path = home_file("AWS_CONFIG_FILE", ".aws/config");
    let creds = read_shared(&creds_path)?;
    let config = read_shared(&config_path)?;
    let name = profile.clone().unwrap_or_else(|| "default".into());
    let cfg_section = if name == "default" {
        "default".to_string()
    } else {
        format!("profile {name}")
    };
    let from_creds = creds.get(&name);
    let from_config = config.get(&cfg_section);
    let get = |k: &str| {
        from_creds
            .and_then(|s| s.get(k))
            .or_else(|| from_config.and_then(|s| s.get(k)))
            .cloned()
    };
    if profile.is_some() && from_creds.is_none() && from_config.is_none() {
        return Err(Error::InvalidConfig(format!(
            "AWS profile {name:?} is in neither {} nor {}",
            creds_path
                .as_deref()
                .map(|p| p.display().to_string())
                .unwrap_or_else(|| "~/.aws/credentials".into()),
            config_path
                .as_deref()
                .map(|p| p.display().to_string())
                .unwrap_or_else(|| "~/.aws/config".into()),
        )));
    }
    let mut r = Resolved {
        endpoint: o
            .endpoint_url
            .clone()
            .or_else(|| env("AWS_ENDPOINT_URL_S3"))
            .or_else(|| env("AWS_ENDPOINT_URL"))
            .or_else(|| get("endpoint_url")),
        region: env("AWS_REGION")
            .or_else(|| env("AWS_DEFAULT_REGION"))
            .or_else(|| get("region"))
            .unwrap_or_else(|| "us-east-1".into()),
        ..Default::default()
    };
    // The AWS tools' order: an explicit --profile, then the environment's
    // keys, then the profile named by AWS_PROFILE (or default).
    let env_keys = (env("AWS_ACCESS_KEY_ID"), env("AWS_SECRET_ACCESS_KEY"));
    if let (None, (Some(id), Some(secret))) = (&explicit_profile, env_keys) {
        r.key_id = Some(id);
        r.secret = Some(secret);
        r.token = env("AWS_SESSION_TOKEN");
        r.cred_from = "the environment (AWS_ACCESS_KEY_ID)".into();
    } else if let (Some(id), Some(secret)) =
        (get("aws_access_key_id"), get("aws_secret_access_key"))
    {
        r.key_id = Some(id);
        r.secret = Some(secret);
        r.token = get("aws_session_token");
        r.cred_from = format!("profile {name:?}");
    } else {
        r.cred_from = "the cloud's provider chain (no keys in the environment or profile)".into();
    }
    if let Some(e) = &r.endpoint {
        if !(e.starts_with("http://") || e.starts_with("https://")) {
            return Err(Error::InvalidConfig(format!(
                "endpoint URL {e:?} must start with http:// or https://"
            )));
        }
    }
    Ok(r)
}

/// Retries with backoff and jitter: 0.1 s doubling to 5 s, about 25 s of
/// them, so a store restarting, or shedding load with 503 SlowDown, is
/// ridden out (the default gives up on a refused connection in 2 s).
fn retry_config() -> RetryConfig {
    RetryConfig {
        backoff: BackoffConfig {
            init_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(5),
            base: 2.0,
        },
        max_retries: 10,
        retry_timeout: Duration::from_secs(180),
    }
}

fn client_options() -> ClientOptions {
    ClientOptions::new()
        .with_connect_timeout(Duration::from_secs(10))
        .with_timeout(Duration::from_secs(120))
        .with_pool_max_idle_per_host(1024)
}

/// The runtime every request runs on: two threads drive the sockets of all
/// callers (the callers block; the work per request is small).
fn runtime() -> &'static tokio::runtime::Runtime {
    use std::sync::atomic::{AtomicPtr, AtomicU32, Ordering};
    // One per process: a forked child (a DataLoader worker building its
    // own loader) has none of its parent's runtime threads, so it makes its
    // own. The parent's is leaked there: dropping it would wait for threads
    // that do not exist in the child.
    static RT: AtomicPtr<tokio::runtime::Runtime> = AtomicPtr::new(std::ptr::null_mut());
    static PID: AtomicU32 = AtomicU32::new(0);
    static MAKING: Mutex<()> = Mutex::new(());
    let pid = std::process::id();
    if PID.load(Ordering::Acquire) != pid {
        let _g = MAKING.lock().unwrap_or_else(|e| e.into_inner());
        if PID.load(Ordering::Acquire) != pid {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .thread_name("kspeed-s3")
                .enable_all()
                .build()
                .expect("a tokio runtime (threads and an epoll instance) could be made");
            RT.store(Box::into_raw(Box::new(rt)), Ordering::Release);
            PID.store(pid, Ordering::Release);
        }
    }
    // SAFETY: RT was set (and never freed) before PID became this
    // process's id, which the Acquire loads above observed.
    unsafe { &*RT.load(Ordering::Acquire) }
}

/// The clients by bucket, of the process that made them (a forked child
/// does not use its parent's connections).
static CLIENTS: Mutex<Option<(u32, Clients)>> = Mutex::new(None);

/// Clients by bucket name.
type Clients = HashMap<String, Arc<Store>>;

/// A client of one bucket.
pub struct Store {
    bucket: String,
    /// S3's client, or a plain HTTP one for a web server's origin.
    s3: Arc<dyn ObjectStore>,
    /// For messages: where the credentials came from and the endpoint.
    describe: String,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("bucket", &self.bucket)
            .field("describe", &self.describe)
            .finish_non_exhaustive()
    }
}

/// One object of a listing.
#[derive(Debug, Clone)]
pub struct Object {
    /// The key relative to the listed prefix.
    pub name: String,
    /// Size in bytes.
    pub size: u64,
    /// Last-modified time (ns since the epoch).
    pub modified_ns: i64,
    /// The ETag as the store gave it (quotes included).
    pub etag: String,
}

impl Store {
    /// The shared client of `bucket` (made on first use with the settings
    /// in force then).
    pub fn of(bucket: &str) -> Result<Arc<Store>> {
        let mut g = CLIENTS.lock().expect("not poisoned");
        let pid = std::process::id();
        if g.as_ref().is_some_and(|(p, _)| *p != pid) {
            // Forked: the parent's clients (and their pooled connections,
            // tasks of the parent's runtime) are not this process's. Left
            // alone, not dropped: dropping them could touch that runtime.
            std::mem::forget(g.take());
        }
        let map = &mut g.get_or_insert_with(|| (pid, HashMap::new())).1;
        if let Some(s) = map.get(bucket) {
            return Ok(s.clone());
        }
        let s = Arc::new(Store::new(bucket)?);
        map.insert(bucket.to_string(), s.clone());
        Ok(s)
    }

    fn new(bucket: &str) -> Result<Store> {
        // rustls needs one crypto provider in the process; ring's is the
        // one this crate builds (a second install is refused, harmlessly).
        let _ = rustls::crypto::ring::default_provider().install_default();
        if is_http_origin(bucket) {
            return Self::web(bucket);
        }
        let o = OVERRIDES
            .lock()
            .expect("not poisoned")
            .clone()
            .unwrap_or_default();
        let r = resolve(&o)?;
        let mut b = AmazonS3Builder::new()
            .with_bucket_name(bucket)
            .with_region(&r.region)
            .with_retry(retry_config())
            .with_client_options(client_options());
        if let Some(e) = &r.endpoint {
            b = b
                .with_endpoint(e)
                .with_allow_http(e.starts_with("http://"))
                .with_virtual_hosted_style_request(false);
        } else {
            b = b.with_virtual_hosted_style_request(true);
        }
        if let (Some(id), Some(secret)) = (&r.key_id, &r.secret) {
            b = b.with_access_key_id(id).with_secret_access_key(secret);
            if let Some(t) = &r.token {
                b = b.with_token(t);
            }
        } else {
            // No keys: the cloud's chain (web identity, container, instance
            // metadata), configured from the environment as the SDKs are.
            for k in [
                "AWS_WEB_IDENTITY_TOKEN_FILE",
                "AWS_ROLE_ARN",
                "AWS_ROLE_SESSION_NAME",
                "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
                "AWS_CONTAINER_CREDENTIALS_FULL_URI",
                "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE",
            ] {
                if let (Some(v), Ok(key)) =
                    (env(k), k.to_ascii_lowercase().parse::<AmazonS3ConfigKey>())
                {
                    b = b.with_config(key, v);
                }
            }
        }
        let describe = format!(
            "endpoint {}, region {}, credentials from {}",
            r.endpoint.as_deref().unwrap_or("AWS"),
            r.region,
            r.cred_from
        );
        let s3 = b.build().map_err(|e| {
            Error::InvalidConfig(format!("S3 client for bucket {bucket:?} ({describe}): {e}"))
        })?;
        log::debug!("s3 client for bucket {bucket}: {describe}");
        Ok(Store {
            bucket: bucket.to_string(),
            s3: Arc::new(s3),
            describe,
        })
    }

    /// The client of a web server's origin (`https://host[:port]`): plain
    /// ranged GETs and HEADs, no credentials, no listing. Certificates are
    /// checked against the system's roots (`SSL_CERT_FILE` or
    /// `SSL_CERT_DIR`, when set, are used instead).
    fn web(origin: &str) -> Result<Store> {
        let http = object_store::http::HttpBuilder::new()
            .with_url(origin)
            .with_retry(retry_config())
            .with_client_options(client_options().with_allow_http(origin.starts_with("http://")))
            .build()
            .map_err(|e| Error::InvalidConfig(format!("HTTP client for {origin}: {e}")))?;
        Ok(Store {
            bucket: origin.to_string(),
            s3: Arc::new(http),
            describe: format!("{origin}, no credentials"),
        })
    }

    fn url(&self, key: &str) -> String {
        format!("{}/{key}", base_url(&self.bucket))
    }

    /// Maps a client error on `key` to a named error.
    fn error(&self, key: &str, e: object_store::Error) -> Error {
        let url = self.url(key);
        let chain = error_chain(&e);
        match &e {
            object_store::Error::NotFound { .. } => {
                if chain.contains("NoSuchBucket") {
                    Error::StoreNotFound {
                        url: format!("{S3_SCHEME}{}/", self.bucket),
                        what: "bucket",
                        detail: short(&chain),
                    }
                } else {
                    Error::StoreNotFound {
                        url,
                        what: "key",
                        detail: short(&chain),
                    }
                }
            }
            object_store::Error::PermissionDenied { .. }
            | object_store::Error::Unauthenticated { .. } => Error::StoreAccessDenied {
                url,
                detail: format!("{} ({})", short(&chain), self.describe),
            },
            object_store::Error::Precondition { .. } => Error::SourceChanged {
                changes: vec![SourceChange {
                    path: PathBuf::from(url),
                    what: "object replaced since the catalog was built (ETag differs)".into(),
                }],
            },
            _ => classify_text(&url, &self.bucket, &chain, &self.describe),
        }
    }

    /// Lists every object under `prefix` (ending in `/`, or empty), in key
    /// order, page by page (the store's pages: 1,000 keys each on S3), to
    /// `each` with the key made relative to the prefix.
    pub fn list(&self, prefix: &str, mut each: impl FnMut(Object) -> Result<()>) -> Result<()> {
        if is_http_origin(&self.bucket) {
            return Err(Error::InvalidConfig(format!(
                "{}: a web server's paths cannot be listed; name its objects in a list \
                 (list:{}/files.txt) or give one .tar",
                self.url(prefix),
                self.bucket
            )));
        }
        let p = if prefix.is_empty() {
            None
        } else {
            Some(obj_path(prefix.trim_end_matches('/')))
        };
        let mut stream = self.s3.list(p.as_ref());
        let base = p.as_ref().map(|p| p.as_ref().len() + 1).unwrap_or(0);
        loop {
            let next = runtime().block_on(stream.next());
            let Some(m) = next else { break };
            let m = m.map_err(|e| self.error(prefix, e))?;
            let full = m.location.as_ref();
            let name = full.get(base..).unwrap_or(full).to_string();
            each(Object {
                name,
                size: m.size,
                modified_ns: m.last_modified.timestamp_nanos_opt().unwrap_or(0),
                etag: m.e_tag.unwrap_or_default(),
            })?;
        }
        Ok(())
    }

    /// Streams bytes `range` of `key` to `sink`; with `etag`, only from
    /// that version of the object (a replaced object is
    /// [`Error::SourceChanged`], named by key). Returns the ETag of the
    /// version read (empty if the store sent none, or nothing was read):
    /// a catalog records it where the listing gave none.
    pub fn read(
        &self,
        key: &str,
        etag: Option<&str>,
        range: Range<u64>,
        sink: impl FnMut(&[u8]) -> Result<()>,
    ) -> Result<String> {
        self.read_within(key, etag, range, Duration::MAX, sink)
    }

    /// [`Store::read`] given up after `timeout` (retries included) as
    /// [`Error::StoreFailed`].
    pub fn read_within(
        &self,
        key: &str,
        etag: Option<&str>,
        range: Range<u64>,
        timeout: Duration,
        mut sink: impl FnMut(&[u8]) -> Result<()>,
    ) -> Result<String> {
        if range.is_empty() {
            return Ok(String::new());
        }
        let want = range.end - range.start;
        let opts = GetOptions {
            if_match: etag.filter(|e| !e.is_empty()).map(str::to_string),
            range: Some(GetRange::Bounded(range.clone())),
            ..Default::default()
        };
        let path = obj_path(key);
        let mut got = 0u64;
        let work = async {
            let r = self
                .s3
                .get_opts(&path, opts)
                .await
                .map_err(|e| self.error(key, e))?;
            let seen = r.meta.e_tag.clone().unwrap_or_default();
            // The If-Match asked the store to refuse another version; a
            // store that ignores it (some S3-compatible servers do) still
            // names the version it sent: check that too.
            if let Some(want) = etag.filter(|e| !e.is_empty() && !seen.is_empty()) {
                if want != seen {
                    return Err(Error::SourceChanged {
                        changes: vec![SourceChange {
                            path: PathBuf::from(self.url(key)),
                            what: format!(
                                "its ETag is {seen}, the catalog's {want} (the object was replaced since the catalog)"
                            ),
                        }],
                    });
                }
            }
            let mut body = r.into_stream();
            while let Some(chunk) = body.next().await {
                let chunk = chunk.map_err(|e| self.error(key, e))?;
                got += chunk.len() as u64;
                if got > want {
                    break;
                }
                sink(&chunk)?;
            }
            Ok::<String, Error>(seen)
        };
        let seen = runtime().block_on(async {
            if timeout == Duration::MAX {
                return work.await;
            }
            match tokio::time::timeout(timeout, work).await {
                Ok(r) => r,
                Err(_) => Err(Error::StoreFailed {
                    url: self.url(key),
                    detail: format!(
                        "no answer within {} s ({})",
                        timeout.as_secs(),
                        self.describe
                    ),
                }),
            }
        })?;
        if got != want {
            return Err(Error::SourceChanged {
                changes: vec![SourceChange {
                    path: PathBuf::from(self.url(key)),
                    what: format!(
                        "bytes {}..{} asked, {} came back (the object changed since the catalog)",
                        range.start, range.end, got
                    ),
                }],
            });
        }
        Ok(seen)
    }

    /// [`Store::read_within`] of `offset..offset + dst.len()` into `dst`
    /// (a sample's slot: the loaders' reads).
    pub fn read_into(
        &self,
        key: &str,
        etag: Option<&str>,
        offset: u64,
        timeout: Duration,
        dst: &mut [u8],
    ) -> Result<String> {
        let mut at = 0usize;
        let range = offset..offset + dst.len() as u64;
        self.read_within(key, etag, range, timeout, |piece| {
            // read_within stops at the range's end: pieces fit. Through
            // the kernel: `dst` may be a rank's ring in the node agent,
            // whose hugetlb page the rank may take away.
            if !crate::sys::copy_slice_faultable(&mut dst[at..at + piece.len()], piece) {
                return Err(Error::io(
                    "copy a GET's body into",
                    "<the ring>",
                    std::io::Error::from_raw_os_error(libc::EFAULT),
                ));
            }
            at += piece.len();
            Ok(())
        })
    }

    /// The whole object `key` (a file list), with its size bound.
    pub fn read_all(&self, key: &str, max_bytes: u64) -> Result<Vec<u8>> {
        let path = obj_path(key);
        let bytes = runtime().block_on(async {
            let r = self.s3.get_opts(&path, GetOptions::default()).await?;
            if r.meta.size > max_bytes {
                return Ok(Err(r.meta.size));
            }
            r.bytes().await.map(Ok)
        });
        match bytes.map_err(|e| self.error(key, e))? {
            Ok(b) => Ok(b.to_vec()),
            Err(size) => Err(Error::InvalidConfig(format!(
                "{} is {size} bytes; a file list is read whole and may be at most {max_bytes}",
                self.url(key)
            ))),
        }
    }

    /// Size, last-modified and ETag of `key`.
    pub fn head(&self, key: &str) -> Result<Object> {
        let path = obj_path(key);
        let m = runtime()
            .block_on(self.s3.head(&path))
            .map_err(|e| self.error(key, e))?;
        Ok(Object {
            name: key.to_string(),
            size: m.size,
            modified_ns: m.last_modified.timestamp_nanos_opt().unwrap_or(0),
            etag: m.e_tag.unwrap_or_default(),
        })
    }
}

/// The client's path of `key`, as the key is: `Path::from` would
/// percent-encode what it finds unusual (non-ASCII, `%`), and the request
/// would then name another key. Only a key `parse` refuses (an empty
/// segment, `.` or `..`) takes `from`'s encoding.
fn obj_path(key: &str) -> ObjPath {
    ObjPath::parse(key).unwrap_or_else(|_| ObjPath::from(key))
}

/// The error and its causes, joined.
fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        let t = c.to_string();
        if !s.contains(&t) {
            s.push_str(": ");
            s.push_str(&t);
        }
        cur = c.source();
    }
    s
}

/// At most 400 characters of a message (a server's HTML error page can be long).
fn short(s: &str) -> String {
    match s.char_indices().nth(400) {
        Some((i, _)) => format!("{}...", &s[..i]),
        None => s.to_string(),
    }
}

/// Names an error the client did not classify by the S3 error codes in its
/// text (the codes are the S3 API's, the same on every server).
fn classify_text(url: &str, bucket: &str, chain: &str, describe: &str) -> Error {
    const DENIED: [&str; 6] = [
        "AccessDenied",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "ExpiredToken",
        "InvalidToken",
        "403 Forbidden",
    ];
    if chain.contains("NoSuchBucket") {
        Error::StoreNotFound {
            url: format!("{S3_SCHEME}{bucket}/"),
            what: "bucket",
            detail: short(chain),
        }
    } else if chain.contains("NoSuchKey") || chain.contains("404 Not Found") {
        Error::StoreNotFound {
            url: url.to_string(),
            what: "key",
            detail: short(chain),
        }
    } else if DENIED.iter().any(|d| chain.contains(d)) {
        Error::StoreAccessDenied {
            url: url.to_string(),
            detail: format!("{} ({describe})", short(chain)),
        }
    } else {
        Error::StoreFailed {
            url: url.to_string(),
            detail: format!("{} ({describe})", short(chain)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_files_parse_as_the_aws_tools_read_them() {
        let t = "# c\n[default]\naws_access_key_id = A\n; x\n[profile p]\nRegion= eu-west-1 \n";
        let m = parse_ini(t);
        assert_eq!(m["default"]["aws_access_key_id"], "A");
        assert_eq!(m["profile p"]["region"], "eu-west-1");
    }

    #[test]
    fn errors_are_named_by_the_s3_codes() {
        let e = classify_text("s3://b/k", "b", "... <Code>NoSuchBucket</Code>", "d");
        assert!(matches!(e, Error::StoreNotFound { what: "bucket", .. }));
        let e = classify_text("s3://b/k", "b", "<Code>InvalidAccessKeyId</Code>", "d");
        assert!(matches!(e, Error::StoreAccessDenied { .. }));
        let e = classify_text("s3://b/k", "b", "connection reset", "d");
        assert!(matches!(e, Error::StoreFailed { .. }));
    }

    #[test]
    fn debug_leaves_secrets_out() {
        let r = Resolved {
            secret: Some("SECRETVALUE".into()),
            key_id: Some("KEYID".into()),
            ..Default::default()
        };
        let s = format!("{r:?}");
        assert!(!s.contains("SECRETVALUE") && !s.contains("KEYID"), "{s}");
    }
}
