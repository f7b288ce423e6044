//! Consumers that connect around a poller's panic (a bug) are answered or
//! closed, never stranded. Its own test binary (one test, one process): it
//! sets `KSPEED_TEST_POLLER_PANIC` (the `test-panic` feature's hook), which
//! would make every other in-process service's poller panic.

mod common;
#[path = "common/fake_peers.rs"]
mod fake_peers;

use std::io::Write;
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::*;
use kspeed::dataset::Catalog;
use kspeed::transport::proto::Kind;
use kspeed::transport::{NodeService, ServeConfig};

#[test]
fn consumers_connecting_around_a_poller_panic_are_answered_not_stranded() {
    std::env::set_var("KSPEED_TEST_POLLER_PANIC", "1");
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    gen("tiny", 50, &src);
    let space = tmp.path().join("space");
    ok(&["preload", "--source", s(&src), "--space", s(&space)]);
    let cat = Catalog::open(&space.join("catalog.ksc")).unwrap();
    let hello = fake_peers::hello_for(&cat, b"token", 1 << 20);
    let mut cfg = ServeConfig::new(&space, "127.0.0.1:0", b"token");
    cfg.pollers = 1;
    cfg.staging_bytes = 1 << 20;
    let svc = NodeService::start(cfg).unwrap();
    let addr = svc.local_addr();
    // Consumers connect back to back: the first one's poller panics, the
    // service fails, and it stops listening. Those that got in meanwhile
    // were welcomed or queued around the panic.
    let mut socks = Vec::new();
    let t0 = Instant::now();
    while let Ok(mut c) = TcpStream::connect(addr) {
        if c.write_all(&hello).is_ok() {
            socks.push(c);
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60) && socks.len() < 20_000,
            "the service still listens after its poller panicked ({} consumers)",
            socks.len()
        );
    }
    // Each is told (ERROR) or closed: the old poller leaked its hand-off
    // queue, so a consumer welcomed after the panic sat in it, its socket
    // open, until the consumer's own timeout.
    let n = socks.len();
    for (k, mut c) in socks.into_iter().enumerate() {
        c.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        loop {
            match read_frame(&mut c) {
                Ok((h, _)) if h.kind == Kind::Welcome => continue,
                Ok((h, body)) => {
                    assert_eq!(
                        h.kind,
                        Kind::Error,
                        "consumer {k}: {}",
                        String::from_utf8_lossy(&body)
                    );
                    break;
                }
                Err(e) => {
                    assert!(
                        !matches!(
                            e.kind(),
                            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                        ),
                        "consumer {k} of {n}: neither answered nor closed within 20 s"
                    );
                    break;
                }
            }
        }
    }
    svc.stop();
}
