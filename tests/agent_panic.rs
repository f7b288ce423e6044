//! A poller that panics on one of the agent's node poller threads (a bug;
//! the `test-panic` feature's `KSPEED_TEST_NODE_POLLER_PANIC` hook) fails
//! its own rank with a named error; the other rank on the same thread reads
//! on exactly, and the agent goes on serving. Every wait has a deadline.

mod agent_support;
mod common;

use std::process::Child;
use std::time::Duration;

use agent_support::*;

#[test]
fn a_panicking_poller_fails_its_own_rank_only() {
    let dir = tempfile::tempdir().unwrap();
    let sp = space(dir.path(), 1200);
    let sock = dir.path().join("agent.sock");
    let world = 2u32;
    let want: Vec<_> = (0..world).map(|r| embedded(&sp, r, world, 2)).collect();
    // One node thread for every poller; the second poller it takes panics.
    let agent = Agent::start_env(
        &sp,
        &sock,
        &["--node-pollers", "1", "--pollers", "1"],
        &[("KSPEED_TEST_NODE_POLLER_PANIC", "2")],
    );
    // Rank 0 computes 50 ms a batch (about 2 s in all): reading on while
    // rank 1's poller panics. Rank 1's is the second poller the thread
    // takes whenever it attaches.
    let mut slow = attached_args(&sp, &sock, 0, world, 2);
    slow.extend(["--compute-us".to_string(), "50000".to_string()]);
    let first: Child = spawn_read(&slow);
    let pid = first.id().to_string();
    agent
        .log
        .wait_for(&["rank 0 ", &pid, "attached"], Duration::from_secs(30));
    let victim = spawn_read(&attached_args(&sp, &sock, 1, world, 2));
    let o = wait_output(victim, Duration::from_secs(120));
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "rank 1: {err}");
    assert!(
        err.contains("poller") && err.contains("panicked"),
        "rank 1: {err}"
    );
    agent
        .log
        .wait_for(&["kspeed-npoll-0", "panicked at"], Duration::from_secs(10));
    // The rank on the same thread: exact.
    assert_eq!(finish(first), want[0], "rank 0");
    // The agent still serves, on the same thread: rank 1 again, exact.
    let again = spawn_read(&attached_args(&sp, &sock, 1, world, 2));
    assert_eq!(finish(again), want[1], "rank 1 again");
}
