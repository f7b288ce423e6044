//! `NodeService::start` failing part-way leaves nothing running. Its own
//! test binary (one test, one process): it lowers the process's descriptor
//! limit, which would disturb other tests running beside it.

mod common;

use common::*;
use kspeed::transport::{NodeService, ServeConfig};

fn threads() -> usize {
    std::fs::read_dir("/proc/self/task").unwrap().count()
}

/// Sets the descriptor limit, soft and hard: the service lifts its soft
/// limit to the hard one at start, so both must be low. A hard limit cannot
/// always be raised again, so each start runs in a child process.
fn set_nofile(n: u64) {
    let lim = libc::rlimit {
        rlim_cur: n,
        rlim_max: n,
    };
    // SAFETY: setrlimit reads one live rlimit.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) }, 0);
}

const CHILD: &str = "KSPEED_SERVE_START_EXTRA";

/// In a child process: one start of 4 pollers with `extra` descriptors to
/// spare; prints the outcome and fails if a thread is left behind.
fn one_start(space: &std::path::Path, extra: u64) {
    let cfg = |pollers| {
        let mut c = ServeConfig::new(space, "127.0.0.1:0", b"token");
        c.pollers = pollers;
        c.staging_bytes = 1 << 20;
        c
    };
    // Warm up what the process keeps open after a first start (logging,
    // the allocator's arenas) so the counts below compare like with like.
    NodeService::start(cfg(1)).unwrap().stop();
    let base = threads();
    let open = std::fs::read_dir("/proc/self/fd").unwrap().count() as u64;
    set_nofile(open + extra);
    let outcome = match NodeService::start(cfg(4)) {
        Ok(svc) => {
            svc.stop();
            "started"
        }
        Err(_) => "failed",
    };
    assert_eq!(
        threads(),
        base,
        "threads left behind by start with {extra} descriptors to spare"
    );
    println!("outcome: {outcome}");
}

#[test]
fn start_failing_part_way_leaves_no_thread_behind() {
    if let Ok(extra) = std::env::var(CHILD) {
        let space = std::env::var("KSPEED_SERVE_START_SPACE").unwrap();
        return one_start(space.as_ref(), extra.parse().unwrap());
    }
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    gen("tiny", 50, &src);
    let space = tmp.path().join("space");
    ok(&["preload", "--source", s(&src), "--space", s(&space)]);
    // Every descriptor limit from "nothing to spare" up to enough for 4
    // pollers: each start fails somewhere along the way (the space, the
    // listener, the n-th poller's io_uring...) or succeeds; none may leave
    // a thread running.
    let mut failed = 0;
    let mut started = false;
    for extra in 0..64 {
        let o = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "start_failing_part_way_leaves_no_thread_behind",
                "--nocapture",
            ])
            .env(CHILD, extra.to_string())
            .env("KSPEED_SERVE_START_SPACE", &space)
            .output()
            .unwrap();
        let out =
            String::from_utf8_lossy(&o.stdout).into_owned() + &String::from_utf8_lossy(&o.stderr);
        assert!(
            o.status.success(),
            "with {extra} descriptors to spare:\n{out}"
        );
        if out.contains("outcome: started") {
            started = true;
            break;
        }
        assert!(out.contains("outcome: failed"), "{out}");
        failed += 1;
    }
    assert!(
        started && failed > 2,
        "{failed} failed starts, started: {started}"
    );
    eprintln!("{failed} starts failed part-way before one had enough descriptors");
}
