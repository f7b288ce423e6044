//! The stall detector (`src/stall.rs`) on the real loops: a tick forced to
//! block (the `test-panic` feature's `KSPEED_TEST_STALL_MS` hook: a loop's
//! first tick sleeps that long) is counted in the loader's and the node
//! service's statistics and logged once; a normal run counts none.

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::*;
use kspeed::transport::{NodeService, ServeConfig};

/// `kspeed read --json` over `src` (source mode) with `env`; returns the
/// report's `loop_stalls` and stderr.
fn read(src: &std::path::Path, env: &[(&str, &str)]) -> (u64, String) {
    let o = Command::new(kspeed_bin())
        .args(["read", "--progress=none", "--json", "--pollers", "2"])
        .args(["--source", s(src), "--epochs", "2"])
        .env_remove("KSPEED_TEST_STALL_MS")
        .env_remove("KSPEED_STALL_MS")
        .envs(env.iter().copied())
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    let n = out
        .split("\"loop_stalls\":")
        .nth(1)
        .and_then(|r| {
            r.trim_start()
                .split(|c: char| !c.is_ascii_digit())
                .next()?
                .parse()
                .ok()
        })
        .unwrap_or_else(|| panic!("no loop_stalls in {out}"));
    (n, String::from_utf8_lossy(&o.stderr).into_owned())
}

#[test]
fn a_blocked_poller_tick_is_counted_and_logged_once_and_a_normal_run_has_none() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    gen("tiny", 300, &src);
    // Each poller's first tick blocks for 150 ms: one stall each, one line
    // each (the two pollers, no network thread alone).
    let (n, err) = read(&src, &[("KSPEED_TEST_STALL_MS", "150")]);
    assert!(n >= 2, "{n} stalls: {err}");
    for p in 0..2 {
        let line = format!("loader poller {p}: a tick took");
        assert_eq!(err.matches(&line).count(), 1, "{line:?} in {err}");
    }
    // The same run without the hook counts none. (The threshold is raised
    // here: on a loaded test machine a poller can be preempted for 50 ms
    // mid-tick; the idle service below checks that waits are not counted.)
    let (n, err) = read(&src, &[("KSPEED_STALL_MS", "2000")]);
    assert_eq!(n, 0, "{err}");
    assert!(!err.contains("a tick took"), "{err}");
}

fn service(space: &std::path::Path) -> NodeService {
    let mut cfg = ServeConfig::new(space, "127.0.0.1:0", b"token");
    cfg.pollers = 2;
    cfg.staging_bytes = 1 << 20;
    NodeService::start(cfg).unwrap()
}

fn stalls(svc: &NodeService) -> u64 {
    svc.stats()
        .loop_stalls
        .load(std::sync::atomic::Ordering::Relaxed)
}

/// One test: it sets the environment of this process, which the services
/// it starts read (the `kspeed read` children above clear it).
#[test]
fn an_idle_service_counts_no_stalls_and_a_blocked_tick_is_counted() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    gen("tiny", 20, &src);
    let space = tmp.path().join("space");
    ok(&["preload", "--source", s(&src), "--space", s(&space)]);
    // Idle: the pollers wait 50 ms per tick and the acceptor up to 100 ms;
    // with a 25 ms threshold, counting a wait would show within 400 ms.
    std::env::set_var("KSPEED_STALL_MS", "25");
    let svc = service(&space);
    // Waits counted as work would be a stall per tick: 8 or more per poller
    // in 400 ms. A few are allowed: on a loaded 2-core machine a loop can be
    // preempted for 25 ms mid-tick, which is a real stall. (This thread
    // sleeps rather than spinning, so as not to take a core from them.)
    std::thread::sleep(Duration::from_millis(400));
    let idle = stalls(&svc);
    assert!(idle <= 3, "an idle service counted {idle} stalls in 400 ms");
    svc.stop();
    // The acceptor's and both pollers' first ticks block for 120 ms.
    std::env::set_var("KSPEED_TEST_STALL_MS", "120");
    std::env::set_var("KSPEED_STALL_MS", "50");
    let svc = service(&space);
    let t0 = Instant::now();
    while stalls(&svc) < 3 {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "{} stalls counted",
            stalls(&svc)
        );
        std::thread::yield_now();
    }
    svc.stop();
}
