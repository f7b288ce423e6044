//! Sources on a plain web server: `list:https://host/…/files.txt` (paths
//! relative to the list's folder, or URLs under it) cataloged, preloaded and
//! verified byte-exact against the served files; one tar shard at an
//! `https://` URL read directly by a loader, byte-exact, and a replaced
//! shard named; plain `http://` too; a folder URL (no listing on the web),
//! a missing file and an untrusted certificate refused by name. A real
//! nginx process on loopback (Debian's nginx-light, installed by
//! `scripts/setup.sh --test-tools`) with a self-signed certificate made by
//! openssl and trusted through `SSL_CERT_FILE`.
#![cfg(all(feature = "cli", feature = "s3"))]

mod common;
#[path = "common/s3.rs"]
mod s3h;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::*;
use kspeed::dataset::Space;
use kspeed::loader::LoaderBuilder;
use s3h::*;

const LIMIT: Duration = Duration::from_secs(240);

/// nginx serving `root` on an https and an http port of 127.0.0.1.
struct Nginx {
    child: Child,
    https: u16,
    http: u16,
    ca: PathBuf,
}

impl Drop for Nginx {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn nginx_bin() -> Option<PathBuf> {
    ["/usr/sbin/nginx", "/usr/bin/nginx"]
        .iter()
        .map(PathBuf::from)
        .find(|p| p.is_file())
}

impl Nginx {
    fn start(root: &Path, work: &Path) -> Option<Nginx> {
        let Some(bin) = nginx_bin() else {
            skip("nginx is not installed (scripts/setup.sh --test-tools installs nginx-light)");
            return None;
        };
        // A CA, and the server's certificate signed by it (a verifier
        // refuses a CA certificate used as the server's own).
        let (ca, ca_key) = (work.join("ca.pem"), work.join("ca-key.pem"));
        let (cert, key) = (work.join("cert.pem"), work.join("key.pem"));
        let openssl = |args: &[&str], paths: &[(&str, &Path)]| {
            let mut c = Command::new("openssl");
            c.args(args);
            for (flag, p) in paths {
                c.arg(flag).arg(p);
            }
            let o = c.output().expect("openssl");
            assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        };
        openssl(
            &[
                "req",
                "-x509",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-days",
                "2",
                "-subj",
                "/CN=kspeed test CA",
            ],
            &[("-keyout", &ca_key), ("-out", &ca)],
        );
        openssl(
            &[
                "req",
                "-x509",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-days",
                "2",
                "-subj",
                "/CN=127.0.0.1",
                "-addext",
                "subjectAltName=IP:127.0.0.1",
                "-addext",
                "basicConstraints=critical,CA:FALSE",
            ],
            &[
                ("-CA", &ca),
                ("-CAkey", &ca_key),
                ("-keyout", &key),
                ("-out", &cert),
            ],
        );
        // A port picked here may be taken by another test's server before
        // nginx binds it: nginx then exits, and is started again on others.
        // It writes its pid file once its sockets are bound.
        let pid_file = work.join("nginx.pid");
        for attempt in 0..5 {
            let https = free_port();
            let http = loop {
                let p = free_port();
                if p != https {
                    break p;
                }
            };
            let conf = work.join("nginx.conf");
            let _ = std::fs::remove_file(&pid_file);
            std::fs::write(
                &conf,
                format!(
                    "daemon off;\nmaster_process off;\nerror_log {err} warn;\npid {pid};\n\
                     events {{ worker_connections 1024; }}\n\
                     http {{\n  access_log off;\n  client_body_temp_path {tmp};\n\
                       server {{\n    listen 127.0.0.1:{https} ssl;\n    listen 127.0.0.1:{http};\n\
                         ssl_certificate {cert};\n    ssl_certificate_key {key};\n\
                         root {root};\n    autoindex off;\n  }}\n}}\n",
                    err = work.join("error.log").display(),
                    pid = pid_file.display(),
                    tmp = work.display(),
                    cert = cert.display(),
                    key = key.display(),
                    root = root.display(),
                ),
            )
            .unwrap();
            let child = Command::new(&bin)
                .arg("-p")
                .arg(work)
                .arg("-c")
                .arg(&conf)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("nginx starts");
            let mut n = Nginx {
                child,
                https,
                http,
                ca: ca.clone(),
            };
            let deadline = Instant::now() + Duration::from_secs(30);
            let bound = loop {
                if n.child.try_wait().unwrap().is_some() {
                    break false;
                }
                if pid_file.exists()
                    && std::net::TcpStream::connect(("127.0.0.1", https)).is_ok()
                    && std::net::TcpStream::connect(("127.0.0.1", http)).is_ok()
                {
                    break true;
                }
                assert!(
                    Instant::now() < deadline,
                    "nginx did not listen within 30 s: {}",
                    std::fs::read_to_string(work.join("error.log")).unwrap_or_default()
                );
                std::thread::sleep(Duration::from_millis(20));
            };
            if bound {
                return Some(n);
            }
            eprintln!(
                "nginx exited (attempt {attempt}): {}",
                std::fs::read_to_string(work.join("error.log")).unwrap_or_default()
            );
        }
        panic!("nginx did not start in 5 attempts (see above)");
    }

    fn https(&self, path: &str) -> String {
        format!("https://127.0.0.1:{}/{path}", self.https)
    }

    fn http(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}/{path}", self.http)
    }

    /// `kspeed ARGS` trusting the test's certificate (and no AWS setup).
    fn kspeed(&self, args: &[&str], dir: &Path) -> Output {
        let mut c = bare_kspeed_cmd(args, dir);
        c.env("SSL_CERT_FILE", &self.ca);
        run_for(c, LIMIT)
    }
}

fn ok(o: &Output) -> String {
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn failed(o: &Output) -> String {
    assert!(!o.status.success(), "should have failed");
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn lists_and_shards_on_a_web_server() {
    if Command::new("openssl").arg("version").output().is_err() {
        skip("openssl is not installed");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("www");
    let work = tmp.path().join("nginx");
    std::fs::create_dir_all(&work).unwrap();
    gen("imagenet", 40, &root.join("data"));
    let Some(web) = Nginx::start(&root, &work) else {
        return;
    };
    // The list: paths relative to its folder, one as a URL under it, with
    // labels.
    let files: Vec<PathBuf> = files_under(&root.join("data"));
    let mut list = String::new();
    for (i, p) in files.iter().enumerate() {
        let rel = p
            .strip_prefix(root.join("data"))
            .unwrap()
            .to_string_lossy()
            .into_owned();
        let name = if i == 3 {
            web.https(&format!("data/{rel}"))
        } else {
            rel
        };
        list.push_str(&format!("{name}\t{}\n", i % 7));
    }
    std::fs::write(root.join("data/files.txt"), &list).unwrap();

    let src = format!("list:{}", web.https("data/files.txt"));
    let cat = tmp.path().join("cat.ksc");
    ok(&web.kspeed(&["catalog", "--source", &src, "--out", s(&cat)], tmp.path()));
    let sp = tmp.path().join("space");
    ok(&web.kspeed(
        &["preload", "--catalog", s(&cat), "--space", s(&sp)],
        tmp.path(),
    ));
    ok(&web.kspeed(&["verify", "--space", s(&sp)], tmp.path()));
    let space = Space::open(&sp).unwrap();
    assert_eq!(space.catalog().len(), files.len() as u64);
    for (id, p) in files.iter().enumerate() {
        assert_eq!(
            read_sample(&space, id as u64),
            std::fs::read(p).unwrap(),
            "{}",
            p.display()
        );
        assert_eq!(
            space.catalog().sample(id as u64).label,
            Some((id % 7) as u32)
        );
    }
    // inspect shows the URL.
    let out = ok(&web.kspeed(&["inspect", "--catalog", s(&cat)], tmp.path()));
    assert!(out.contains(&web.https("data/files.txt")), "{out}");

    // A shard at an https:// URL and at an http:// one, read directly.
    let (tar, datas) = shard(0, 50, true);
    std::fs::create_dir_all(root.join("shards")).unwrap();
    std::fs::write(root.join("shards/000.tar"), &tar).unwrap();
    std::env::set_var("SSL_CERT_FILE", &web.ca);
    for url in [web.https("shards/000.tar"), web.http("shards/000.tar")] {
        let mut l = LoaderBuilder::source(&url)
            .shuffle(false)
            .batch_size(8)
            .pollers(1)
            .pin(false)
            .landing(small_landing())
            .build()
            .unwrap();
        l.set_epoch(0).unwrap();
        let mut n = 0u64;
        while let Some(b) = l.next_batch().unwrap() {
            for smp in b.iter() {
                assert_eq!((smp.id, smp.bytes), (n, &datas[n as usize][..]), "{url}");
                n += 1;
            }
        }
        assert_eq!(n, 50, "{url}");
    }
    // The shard replaced after its catalog: named.
    let shard_cat = tmp.path().join("shard.ksc");
    ok(&web.kspeed(
        &[
            "catalog",
            "--source",
            &web.https("shards/000.tar"),
            "--out",
            s(&shard_cat),
        ],
        tmp.path(),
    ));
    std::fs::write(root.join("shards/000.tar"), shard(100, 50, true).0).unwrap();
    let mut l = LoaderBuilder::source(&web.https("shards/000.tar"))
        .catalog(&shard_cat)
        .batch_size(8)
        .pollers(1)
        .pin(false)
        .landing(small_landing())
        .build()
        .unwrap();
    let text = epoch_error(&mut l, "a replaced shard must fail its reads");
    assert!(text.contains(&web.https("shards/000.tar")), "{text}");

    // Refused by name: a folder (a web server lists nothing), a missing
    // file in a list (its line), an untrusted certificate.
    let e = failed(&web.kspeed(
        &[
            "catalog",
            "--source",
            &web.https("data/"),
            "--out",
            s(&tmp.path().join("x.ksc")),
        ],
        tmp.path(),
    ));
    assert!(e.contains("cannot be listed"), "{e}");
    std::fs::write(
        root.join("data/bad.txt"),
        format!(
            "{}\nmissing.jpg\n",
            files[0].strip_prefix(root.join("data")).unwrap().display()
        ),
    )
    .unwrap();
    let e = failed(&web.kspeed(
        &[
            "catalog",
            "--source",
            &format!("list:{}", web.https("data/bad.txt")),
            "--out",
            s(&tmp.path().join("y.ksc")),
        ],
        tmp.path(),
    ));
    assert!(e.contains("line 2") && e.contains("missing.jpg"), "{e}");
    let mut c = bare_kspeed_cmd(
        &[
            "catalog",
            "--source",
            &src,
            "--out",
            s(&tmp.path().join("z.ksc")),
        ],
        tmp.path(),
    );
    c.env("SSL_CERT_FILE", tmp.path().join("no-such-ca.pem"));
    let e = failed(&run_for(c, LIMIT));
    assert!(e.to_lowercase().contains("certificate"), "{e}");
}
