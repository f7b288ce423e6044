//! The node agent's poller threads (`kspeed agent --node-pollers`,
//! `--node-poller-cores`; docs/AGENT.md, "The node's poller threads"): every
//! attached rank's pollers run on the node's threads, none of a rank's own,
//! byte-exact against embedded ranks; the threads are pinned where asked.
//! Real `kspeed agent` and `kspeed read` processes; every wait has a
//! deadline.

mod agent_support;
mod common;

use std::process::{Child, Command};
use std::time::Duration;

use agent_support::*;
use common::{kspeed_bin, s, text};

/// The agent's threads named `prefix` (their comm, which the kernel cuts
/// at 15 bytes).
fn agent_threads(pid: u32, prefix: &str) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .filter(|c| c.trim_end().starts_with(prefix))
        .count()
}

/// The node's poller threads take turns for every attached rank's pollers
/// (`--node-pollers`): 4 ranks of 2 pollers each are served by 2 threads,
/// no thread of a rank's own, and deliver exactly what embedded ranks do;
/// `--node-pollers 0` runs a thread per poller instead, as exactly.
#[test]
fn the_node_s_poller_threads_serve_every_rank() {
    let dir = tempfile::tempdir().unwrap();
    let sp = space(dir.path(), 1200);
    let world = 4u32;
    let want: Vec<_> = (0..world).map(|r| embedded(&sp, r, world, 2)).collect();
    for (node_pollers, shared_threads, own_threads) in [("2", 2, 0), ("0", 0, 8)] {
        let sock = dir.path().join(format!("agent{node_pollers}.sock"));
        let agent = Agent::start(
            &sp,
            &sock,
            &["--pollers", "2", "--node-pollers", node_pollers],
        );
        // Counted with every rank attached: each reads 100 epochs at 100
        // ms a batch (minutes) and is stopped (SIGSTOP) as soon as it is
        // attached, so none ends and takes its own pollers' threads with it.
        let mut held = Vec::new();
        for r in 0..world {
            let mut a = attached_args(&sp, &sock, r, world, 100);
            a.extend(["--compute-us".to_string(), "100000".to_string()]);
            let child = spawn_read(&a);
            let pid = child.id().to_string();
            agent.log.wait_for(
                &[&format!("rank {r} "), &pid, "attached"],
                Duration::from_secs(30),
            );
            assert!(Command::new("kill")
                .args(["-STOP", &pid])
                .status()
                .unwrap()
                .success());
            held.push(child);
        }
        let (shared, own) = (
            agent_threads(agent.pid(), "kspeed-npoll-"),
            agent_threads(agent.pid(), "kspeed-poller-"),
        );
        assert_eq!(
            (shared, own),
            (shared_threads, own_threads),
            "node poller threads and a rank's own poller threads, --node-pollers {node_pollers}"
        );
        for mut child in held {
            let pid = child.id().to_string();
            child.kill().unwrap();
            let _ = child.wait();
            agent
                .log
                .wait_for(&[&pid, "ended"], Duration::from_secs(30));
        }
        // The same agent, fresh ranks at full speed: exact.
        let ranks: Vec<Child> = (0..world)
            .map(|r| spawn_read(&attached_args(&sp, &sock, r, world, 2)))
            .collect();
        for (r, child) in ranks.into_iter().enumerate() {
            assert_eq!(
                finish(child),
                want[r],
                "rank {r}, --node-pollers {node_pollers}"
            );
        }
        assert!(!agent.log.all().contains("panicked"), "{}", agent.log.all());
    }
}

/// `--node-poller-cores` pins the node's poller threads (one per core
/// listed) where asked, each to its own core; a core the agent may not run
/// on is refused by name.
#[test]
fn node_poller_threads_are_pinned_where_asked() {
    let dir = tempfile::tempdir().unwrap();
    let sp = space(dir.path(), 50);
    let sock = dir.path().join("agent.sock");
    let allowed = kspeed::placement::affinity();
    let cores: Vec<u32> = allowed.iter().copied().take(2).collect();
    let list = cores
        .iter()
        .map(|c| c.to_string())
        .collect::<Vec<_>>()
        .join(",");
    let agent = Agent::start(&sp, &sock, &["--node-poller-cores", &list]);
    let mut pinned: Vec<String> = std::fs::read_dir(format!("/proc/{}/task", agent.pid()))
        .unwrap()
        .filter_map(|t| {
            let t = t.ok()?.path();
            let comm = std::fs::read_to_string(t.join("comm")).ok()?;
            if !comm.starts_with("kspeed-npoll-") {
                return None;
            }
            let status = std::fs::read_to_string(t.join("status")).ok()?;
            status
                .lines()
                .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
                .map(|v| v.trim().to_string())
        })
        .collect();
    pinned.sort();
    let mut want: Vec<String> = cores.iter().map(|c| c.to_string()).collect();
    want.sort();
    assert_eq!(pinned, want, "the node poller threads' cores");
    drop(agent);
    // A core outside the agent's mask: refused, naming it.
    let o = Command::new(kspeed_bin())
        .args(["agent", "--space", s(&sp), "--socket", s(&sock)])
        .args(["--node-poller-cores", "4095"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("--node-poller-cores: core 4095 is not one this agent may run on"),
        "{err}"
    );
    // With --node-pollers 0 there is no node thread to pin: refused.
    let o = Command::new(kspeed_bin())
        .args(["agent", "--space", s(&sp), "--socket", s(&sock)])
        .args(["--node-pollers", "0", "--node-poller-cores", &list])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("--node-pollers 0 runs none"), "{err}");
}
