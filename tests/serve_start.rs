//! `NodeService::start` failing part-way leaves nothing running. Its own
//! test binary (one test, one process): it lowers the process's descriptor
//! limit, which would disturb other tests running beside it.

mod common;

use common::*;
use kspeed::transport::{NodeService, ServeConfig};

fn threads() -> usize {
    std::fs::read_dir("/proc/self/task").unwrap().count()
}

/// Sets the soft descriptor limit; returns the one it replaced.
fn set_nofile(n: u64) -> u64 {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit read and write one live rlimit each.
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim), 0);
        let old = lim.rlim_cur;
        lim.rlim_cur = n.min(lim.rlim_max);
        assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &lim), 0);
        old
    }
}

#[test]
fn start_failing_part_way_leaves_no_thread_behind() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    gen("tiny", 50, &src);
    let space = tmp.path().join("space");
    ok(&["preload", "--source", s(&src), "--space", s(&space)]);
    let cfg = |pollers| {
        let mut c = ServeConfig::new(&space, "127.0.0.1:0", b"token");
        c.pollers = pollers;
        c.staging_bytes = 1 << 20;
        c
    };
    // Warm up what the process keeps open after a first start (logging,
    // the allocator's arenas) so the counts below compare like with like.
    NodeService::start(cfg(1)).unwrap().stop();
    let base = threads();
    let open = std::fs::read_dir("/proc/self/fd").unwrap().count() as u64;
    // Every descriptor limit from "nothing to spare" up to enough for 4
    // pollers: each start fails somewhere along the way (the space, the
    // listener, the n-th poller's io_uring...) or succeeds; none may leave
    // a thread running.
    let mut failed = 0;
    let mut started = false;
    for extra in 0..64 {
        let normal = set_nofile(open + extra);
        let res = NodeService::start(cfg(4));
        set_nofile(normal);
        match res {
            Ok(svc) => {
                svc.stop();
                started = true;
            }
            Err(_) => failed += 1,
        }
        assert_eq!(
            threads(),
            base,
            "threads left behind by start with {extra} descriptors to spare"
        );
        if started {
            break;
        }
    }
    assert!(
        started && failed > 2,
        "{failed} failed starts, started: {started}"
    );
}
