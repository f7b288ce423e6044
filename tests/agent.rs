//! `kspeed agent` with real rank processes (`kspeed read --agent required`)
//! over one local space (issue 28, first slice): byte-exact, ordered
//! delivery against embedded reads of the same rank/world/seed; a rank
//! killed with SIGKILL leaves the others exact and the agent serving; an
//! agent killed with SIGKILL gives the ranks `AgentGone` within its
//! heartbeats. Every wait is on a condition with a deadline.

mod agent_support;
mod common;

use std::process::{Child, Command};
use std::time::{Duration, Instant};

use agent_support::*;
use common::{kspeed_bin, s, text};

/// 2, 4 and 8 rank processes at once through one agent deliver exactly
/// what each rank reads embedded: the same samples in the same order, byte
/// for byte (an order-sensitive digest of ids and bytes), over two epochs
/// (the second continues what the agent read ahead).
#[test]
fn attached_ranks_deliver_exactly_what_embedded_ranks_do() {
    let dir = tempfile::tempdir().unwrap();
    let sp = space(dir.path(), 1500);
    let sock = dir.path().join("agent.sock");
    let agent = Agent::start(&sp, &sock, &[]);
    for world in [2u32, 4, 8] {
        let ranks: Vec<Child> = (0..world)
            .map(|r| spawn_read(&attached_args(&sp, &sock, r, world, 2)))
            .collect();
        let got: Vec<(u64, String)> = ranks.into_iter().map(finish).collect();
        for (r, g) in got.iter().enumerate() {
            let want = embedded(&sp, r as u32, world, 2);
            assert_eq!(g, &want, "rank {r} of {world}");
            assert_eq!(g.0, 2 * 1500_u64.div_ceil(world as u64));
        }
    }
    // Every rank attached and ended cleanly.
    agent
        .log
        .wait_for(&["rank 7", "ended after"], Duration::from_secs(10));
    // No attach refused or failed (a stall warning under load is fine).
    let log = agent.log.all();
    assert!(
        !log.contains("attach refused") && !log.contains("attach failed"),
        "{log}"
    );
}

/// `agent = required` with no agent is a named error naming the socket.
#[test]
fn required_without_an_agent_is_a_named_error() {
    let dir = tempfile::tempdir().unwrap();
    let sp = space(dir.path(), 50);
    let sock = dir.path().join("none.sock");
    let o = Command::new(kspeed_bin())
        .args(attached_args(&sp, &sock, 0, 1, 1))
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("no kspeed agent at") && err.contains("none.sock"),
        "{err}"
    );
    // `auto` outside cluster mode never looks for one: embedded.
    let o = Command::new(kspeed_bin())
        .args(read_args(
            &sp,
            0,
            1,
            1,
            &["--agent", "auto", "--agent-socket", s(&sock)],
        ))
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
}

/// A rank killed with SIGKILL mid-epoch: the agent sees its socket hang
/// up, stops its pollers (their reads land) and unmaps its ring; the other
/// ranks finish exactly, and the agent still takes new ranks.
#[test]
fn a_killed_rank_leaves_the_others_exact() {
    let dir = tempfile::tempdir().unwrap();
    let sp = space(dir.path(), 1200);
    let sock = dir.path().join("agent.sock");
    let agent = Agent::start(&sp, &sock, &[]);
    let world = 3;
    // Rank 1 computes 20 ms per batch: its first epoch takes seconds.
    let mut slow = attached_args(&sp, &sock, 1, world, 2);
    slow.extend(["--compute-us".to_string(), "20000".to_string()]);
    let mut victim = spawn_read(&slow);
    let pid = victim.id().to_string();
    agent
        .log
        .wait_for(&["rank 1", &pid, "attached"], Duration::from_secs(30));
    let others: Vec<Child> = [0u32, 2]
        .iter()
        .map(|&r| spawn_read(&attached_args(&sp, &sock, r, world, 2)))
        .collect();
    victim.kill().unwrap();
    let _ = victim.wait();
    let t0 = Instant::now();
    let ended = agent
        .log
        .wait_for(&["rank 1", &pid, "ended"], Duration::from_secs(10));
    eprintln!(
        "agent released the killed rank in {} ms: {ended}",
        t0.elapsed().as_millis()
    );
    for (o, r) in others.into_iter().zip([0u32, 2]) {
        assert_eq!(finish(o), embedded(&sp, r, world, 2), "rank {r}");
    }
    // The agent goes on serving: rank 1 again, from the start.
    let again = spawn_read(&attached_args(&sp, &sock, 1, world, 2));
    assert_eq!(finish(again), embedded(&sp, 1, world, 2));
    assert!(!agent.log.all().contains("panicked"), "{}", agent.log.all());
}

/// The agent killed with SIGKILL: a rank waiting for its next batch gets
/// `AgentGone` naming the socket, within 3 heartbeats (plus the machine's
/// scheduling slack).
#[test]
fn a_killed_agent_gives_agent_gone_in_time() {
    let dir = tempfile::tempdir().unwrap();
    let sp = space(dir.path(), 600);
    let sock = dir.path().join("agent.sock");
    let mut agent = Agent::start(&sp, &sock, &["--heartbeat-ms", "100"]);
    // Many epochs: the rank is still reading when the agent dies.
    let args = attached_args(&sp, &sock, 0, 1, 1_000_000);
    let rank = spawn_read(&args);
    let pid = rank.id().to_string();
    agent
        .log
        .wait_for(&["rank 0", &pid, "attached"], Duration::from_secs(30));
    let t0 = Instant::now();
    agent.child.kill().unwrap();
    let _ = agent.child.wait();
    let o = wait_output(rank, Duration::from_secs(30));
    let took = t0.elapsed();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(
        err.contains("kspeed agent at") && err.contains("is gone") && err.contains("agent.sock"),
        "{err}"
    );
    assert!(err.contains(&format!("pid {}", agent.pid())), "{err}");
    eprintln!("AgentGone after {} ms: {err}", took.as_millis());
    assert!(
        took < Duration::from_millis(300 + 1200),
        "AgentGone took {took:?}"
    );
}

/// The agent stopped (SIGSTOP: a process paused or starved of CPU) with
/// its socket open: a waiting rank does not fail with `AgentGone` after 3
/// heartbeats but waits (a WARN says so) and finishes, the same bytes as
/// an embedded read, once the agent runs again. Stopped for good, the rank
/// is `AgentGone` after 10 s. (Before, a 2-vCPU VM running 4 agents and 16
/// ranks lost a rank to a 424 ms pause of its agent.)
#[test]
fn a_stopped_agent_is_waited_for_then_gone() {
    let dir = tempfile::tempdir().unwrap();
    let sp = space(dir.path(), 600);
    let sock = dir.path().join("agent.sock");
    let agent = Agent::start(&sp, &sock, &["--heartbeat-ms", "100"]);
    let signal = |sig: &str| {
        let ok = Command::new("kill")
            .args([sig, &agent.pid().to_string()])
            .status()
            .unwrap();
        assert!(ok.success());
    };
    let start_rank = || {
        // 5 ms per batch: the rank is still reading when the agent stops.
        let mut args = attached_args(&sp, &sock, 0, 1, 2);
        args.extend(["--compute-us", "5000"].map(String::from));
        let mut rank = spawn_read(&args);
        let err = Lines::follow(rank.stderr.take().unwrap());
        let pid = rank.id().to_string();
        agent
            .log
            .wait_for(&["rank 0", &pid, "attached"], Duration::from_secs(30));
        (rank, err)
    };
    let (rank, err) = start_rank();
    signal("-STOP");
    err.wait_for(
        &["heartbeat has been silent", "socket is open"],
        Duration::from_secs(20),
    );
    signal("-CONT");
    let o = wait_output(rank, Duration::from_secs(120));
    assert!(o.status.success(), "{}", text(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("json report");
    assert_eq!(
        (
            v["samples"].as_u64().unwrap(),
            v["digest"].as_str().unwrap().to_string()
        ),
        embedded(&sp, 0, 1, 2)
    );
    // Stopped for good: AgentGone once the 10 s are over.
    let (rank, err) = start_rank();
    signal("-STOP");
    err.wait_for(&["heartbeat has been silent"], Duration::from_secs(20));
    let t0 = Instant::now();
    let o = wait_output(rank, Duration::from_secs(60));
    let took = t0.elapsed();
    signal("-CONT");
    let all = err.all();
    assert_eq!(o.status.code(), Some(1), "{all}");
    assert!(
        all.contains("is gone") && all.contains("heartbeat stopped"),
        "{all}"
    );
    assert!(
        took > Duration::from_secs(8) && took < Duration::from_secs(30),
        "AgentGone {took:?} after the WARN"
    );
}

/// With `--agent-restart-wait-ms`, a rank whose agent is killed (SIGKILL)
/// mid-read waits for a new agent at the same socket, attaches to it where
/// it stood and finishes: the same samples in the same order, byte for
/// byte, as an embedded read (each delivered exactly once).
#[test]
fn a_restarted_agent_takes_the_rank_back_exactly_once() {
    let dir = tempfile::tempdir().unwrap();
    let sp = space(dir.path(), 600);
    let sock = dir.path().join("agent.sock");
    let mut agent = Agent::start(&sp, &sock, &[]);
    // 3 epochs of 38 batches with 5 ms of "training" per batch: the rank
    // needs the agent for far longer than the 256 KiB ring it reads ahead.
    let mut args = attached_args(&sp, &sock, 0, 1, 3);
    args.extend(["--agent-restart-wait-ms", "60000", "--compute-us", "5000"].map(String::from));
    let rank = spawn_read(&args);
    let pid = rank.id().to_string();
    agent
        .log
        .wait_for(&["rank 0", &pid, "attached"], Duration::from_secs(30));
    agent.child.kill().unwrap();
    let _ = agent.child.wait();
    // A new agent on the same socket (the dead one's file is replaced).
    let again = Agent::start(&sp, &sock, &[]);
    let o = wait_output(rank, Duration::from_secs(120));
    assert!(o.status.success(), "{}", text(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("is gone") && err.contains("attached again after"),
        "{err}"
    );
    again
        .log
        .wait_for(&["rank 0", &pid, "attached"], Duration::from_secs(10));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("json report");
    let got = (
        v["samples"].as_u64().unwrap(),
        v["digest"].as_str().unwrap().to_string(),
    );
    let mut emb = read_args(&sp, 0, 1, 3, &["--agent", "off"]);
    emb.extend(["--compute-us", "0"].map(String::from));
    assert_eq!(got, finish(spawn_read(&emb)));
    assert_eq!(got.0, 3 * 600);
}

/// No agent back within `--agent-restart-wait-ms`: `AgentGone`, saying so.
#[test]
fn no_agent_back_in_time_is_agent_gone() {
    let dir = tempfile::tempdir().unwrap();
    let sp = space(dir.path(), 600);
    let sock = dir.path().join("agent.sock");
    let mut agent = Agent::start(&sp, &sock, &[]);
    let mut args = attached_args(&sp, &sock, 0, 1, 1_000_000);
    args.extend(["--agent-restart-wait-ms", "300"].map(String::from));
    let rank = spawn_read(&args);
    let pid = rank.id().to_string();
    agent
        .log
        .wait_for(&["rank 0", &pid, "attached"], Duration::from_secs(30));
    agent.child.kill().unwrap();
    let _ = agent.child.wait();
    let o = wait_output(rank, Duration::from_secs(30));
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("is gone")
            && err.contains("no agent took the rank back within agent_restart_wait_ms (300 ms"),
        "{err}"
    );
}

/// What a loader delivers through a script of calls that restarts it
/// (another epoch, a restored position) and keeps batches out: every
/// sample's (id, bytes) in order.
fn script(mut l: kspeed::loader::Loader) -> Vec<(u64, Vec<u8>)> {
    fn take(l: &mut kspeed::loader::Loader, n: usize, got: &mut Vec<(u64, Vec<u8>)>) {
        for _ in 0..n {
            let b = l.next_batch().unwrap().expect("a batch");
            got.extend(b.iter().map(|s| (s.id, s.bytes.to_vec())));
        }
    }
    let mut got = Vec::new();
    take(&mut l, 3, &mut got);
    let saved = l.save_position();
    take(&mut l, 2, &mut got);
    // Another epoch: a restart, so a fresh attach.
    l.set_epoch(4).unwrap();
    take(&mut l, 2, &mut got);
    l.restore_position(&saved).unwrap();
    take(&mut l, 2, &mut got);
    // Two batches out at once (the Python package's way), released
    // oldest first.
    for _ in 0..2 {
        assert!(l.acquire_batch_keep().unwrap() > 0);
        got.extend((0..l.held_len()).map(|i| {
            let s = l.held_sample(i);
            (s.id, s.bytes.to_vec())
        }));
    }
    assert!(l.release_oldest_batch());
    assert!(l.release_oldest_batch());
    take(&mut l, 1, &mut got);
    got
}

/// In one process, through the library: restarts (`set_epoch` to another
/// epoch, `restore_position`) attach anew and deliver what an embedded
/// loader does, as do batches kept out together.
#[test]
fn restarts_and_kept_batches_match_embedded() {
    use kspeed::loader::{AgentMode, LoaderBuilder};
    let dir = tempfile::tempdir().unwrap();
    let sp = space(dir.path(), 400);
    let sock = dir.path().join("agent.sock");
    let _agent = Agent::start(&sp, &sock, &[]);
    let build = |mode| {
        LoaderBuilder::space(&sp)
            .batch_size(8)
            .seed(3)
            .rank(1, 2)
            .ring_bytes(256 << 10)
            .pin(false)
            .agent(mode)
            .agent_socket(Some(sock.clone()))
            .build()
            .unwrap()
    };
    let want = script(build(AgentMode::Off));
    let got = script(build(AgentMode::Required));
    assert_eq!(got.len(), want.len());
    assert!(got == want, "attached and embedded differ");
}

/// A job resumed inside an epoch at another world size reads through the
/// agent exactly as embedded: world 2 takes 3 batches, its job position is
/// restored by 3 attached ranks and by 3 embedded ones, and each attached
/// rank delivers the rest of that epoch and the next, sample for sample
/// and byte for byte, what its embedded twin does (the agent deals the
/// epoch from the job position ATTACH carries). A position an attached
/// rank saves inside that epoch resumes attached exactly too.
#[test]
fn an_attached_world_resumes_inside_an_epoch_at_another_size() {
    use kspeed::loader::{AgentMode, Loader, LoaderBuilder};
    let dir = tempfile::tempdir().unwrap();
    let sp = space(dir.path(), 400);
    let sock = dir.path().join("agent.sock");
    let _agent = Agent::start(&sp, &sock, &[]);
    let build = |mode, rank, world| {
        LoaderBuilder::space(&sp)
            .batch_size(8)
            .seed(3)
            .rank(rank, world)
            .ring_bytes(256 << 10)
            .pin(false)
            .agent(mode)
            .agent_socket(Some(sock.clone()))
            .build()
            .unwrap()
    };
    // (id, CRC32C of the bytes) of `batches` batches, or of the rest of
    // the epoch and then the next one when `batches` is None.
    let take = |l: &mut Loader, batches: Option<usize>| {
        let mut out = Vec::new();
        let mut epochs = 0;
        loop {
            let got = l.next_batch().unwrap().map(|b| {
                b.iter()
                    .map(|s| (s.id, crc32c::crc32c(s.bytes)))
                    .collect::<Vec<_>>()
            });
            match got {
                Some(b) => out.extend(b),
                None => {
                    epochs += 1;
                    if epochs == 2 {
                        break;
                    }
                    let next = l.position().epoch;
                    l.set_epoch(next).unwrap();
                    continue;
                }
            }
            if batches.is_some_and(|n| out.len() >= n * 8) {
                break;
            }
        }
        out
    };
    let mut two = build(AgentMode::Off, 0, 2);
    take(&mut two, Some(3));
    let job = two.save_job_position();
    let mut saved = Vec::new();
    for r in 0..3 {
        let mut attached = build(AgentMode::Required, r, 3);
        attached.restore_job_position(&job).unwrap();
        let mut embedded = build(AgentMode::Off, r, 3);
        embedded.restore_job_position(&job).unwrap();
        let head = take(&mut attached, Some(2));
        assert_eq!(head, take(&mut embedded, Some(2)), "rank {r} of 3");
        saved.push(attached.save_position());
        let rest = take(&mut attached, None);
        assert!(!rest.is_empty());
        assert_eq!(rest, take(&mut embedded, None), "rank {r} of 3");
    }
    // Rank 1's own position inside the resumed epoch, restored attached.
    let mut again = build(AgentMode::Required, 1, 3);
    again.restore_position(&saved[1]).unwrap();
    let mut twin = build(AgentMode::Off, 1, 3);
    twin.restore_position(&saved[1]).unwrap();
    assert_eq!(take(&mut again, None), take(&mut twin, None));
}

/// A peer that connects and never sends its ATTACH holds the agent's
/// accept for the ATTACH deadline (5 s): the agent's heartbeat must not
/// stop meanwhile, or a rank waiting for data counts it gone. (The first
/// version beat from the accept loop and failed this with `AgentGone`.)
#[test]
fn a_silent_connection_does_not_silence_the_heartbeat() {
    let dir = tempfile::tempdir().unwrap();
    let sp = space(dir.path(), 1500);
    let sock = dir.path().join("agent.sock");
    // One read in flight: the rank mostly waits for data and the feeder
    // for reads (not for room, where it would beat itself).
    let agent = Agent::start(&sp, &sock, &["--queue-depth", "1"]);
    // Enough epochs that the rank reads (and waits for the disk) well
    // past the silent peer's arrival.
    let rank = spawn_read(&attached_args(&sp, &sock, 0, 2, 15));
    let pid = rank.id().to_string();
    agent
        .log
        .wait_for(&["rank 0", &pid, "attached"], Duration::from_secs(30));
    let silent = kspeed::agent::attach::AttachConn::connect(&sock, Duration::from_secs(5)).unwrap();
    assert_eq!(finish(rank), embedded(&sp, 0, 2, 15));
    drop(silent);
}

/// An attached rank waits for the agent's batches: each wait is charged to
/// what the rank's loader inside the agent waited for while it made the
/// batch (here a local space: its disk), the rest to the agent; the causes
/// sum to the whole stall, and no peer, source or failover is charged on a
/// node alone.
#[test]
fn an_attached_rank_s_stall_is_split_by_what_the_agent_waited_for() {
    let dir = tempfile::tempdir().unwrap();
    let sp = space(dir.path(), 800);
    let sock = dir.path().join("agent.sock");
    let _agent = Agent::start(&sp, &sock, &[]);
    let o = wait_output(
        spawn_read(&attached_args(&sp, &sock, 0, 1, 2)),
        Duration::from_secs(120),
    );
    assert!(o.status.success(), "{}", text(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("json report");
    let c = &v["stall_causes"];
    let stall = v["stall_seconds"].as_f64().expect("stall_seconds");
    let secs = |k: &str| c[k].as_f64().unwrap_or_else(|| panic!("{k} in {c}"));
    let sum: f64 = ["disk", "tier", "source", "peers", "failover", "agent"]
        .iter()
        .map(|k| secs(&format!("{k}_seconds")))
        .sum();
    // Each cause rounds to whole µs on the way.
    assert!((sum - stall).abs() < 1e-5, "{c} against {stall}");
    for k in ["source_seconds", "peers_seconds", "failover_seconds"] {
        assert_eq!(c[k].as_f64(), Some(0.0), "{k}: {c}");
    }
}

/// A single-node agent (no node list, no node service) serves its own
/// metrics with `--metrics`: the ranks it served and what its loaders
/// waited for, by cause, as OpenMetrics text; none of a node service's
/// series.
#[test]
fn a_single_node_agent_serves_its_metrics() {
    let dir = tempfile::tempdir().unwrap();
    let sp = space(dir.path(), 400);
    let sock = dir.path().join("agent.sock");
    let agent = Agent::start(&sp, &sock, &["--metrics", "127.0.0.1:0"]);
    let addr = metrics_addr_of(&agent);
    let before = http_get(&addr);
    assert!(before.contains("kspeed_agent_ranks 0"), "{before}");
    let (n, _) = finish(spawn_read(&attached_args(&sp, &sock, 0, 1, 1)));
    assert_eq!(n, 400);
    // The rank has exited: the agent counts it ended once its loop reaps
    // the feeder (within a heartbeat); scrape until then, with a deadline.
    let deadline = Instant::now() + Duration::from_secs(20);
    let text = loop {
        let text = http_get(&addr);
        if sample_value(&text, "kspeed_agent_ranks_ended_total") == 1.0 {
            break text;
        }
        assert!(
            Instant::now() < deadline,
            "the rank is not counted ended:\n{text}"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(sample_value(&text, "kspeed_agent_ranks"), 0.0, "{text}");
    assert_eq!(
        sample_value(&text, "kspeed_agent_attaches_refused_total"),
        0.0,
        "{text}"
    );
    for cause in ["disk", "tier", "source", "peers", "failover"] {
        let w = sample_value(
            &text,
            &format!("kspeed_agent_wait_seconds_total{{cause=\"{cause}\"}}"),
        );
        assert!(w >= 0.0, "{cause}: {text}");
    }
    assert_eq!(
        sample_value(&text, "kspeed_agent_wait_seconds_total{cause=\"peers\"}"),
        0.0,
        "no peers on one node: {text}"
    );
    assert!(
        !text.contains("kspeed_serve_"),
        "no node service here: {text}"
    );
    assert!(text.trim_end().ends_with("# EOF"), "{text}");
}

/// Batches kept out (`acquire_batch_keep`, the Python binding's way) across
/// an agent killed with SIGKILL and a new one on the same socket: the
/// loader re-attaches inside `acquire_batch_keep` with two batches out,
/// those batches' bytes stay where they were until released (the dead
/// attach's ring is retired, not unmapped, and their releases move no mark
/// of the new attach), and the epoch is what an embedded read delivers.
#[test]
fn kept_batches_survive_a_restarted_agent() {
    use kspeed::loader::{AgentMode, Loader, LoaderBuilder};
    let dir = tempfile::tempdir().unwrap();
    let sp = space(dir.path(), 400);
    let sock = dir.path().join("agent.sock");
    let mut agent = Agent::start(&sp, &sock, &["--heartbeat-ms", "100"]);
    // A 256 KiB ring holds about 7 batches of 8 tiny samples: the agent
    // cannot have read the epoch's 50 batches ahead when it is killed.
    let build = |mode| {
        LoaderBuilder::space(&sp)
            .batch_size(8)
            .seed(11)
            .ring_bytes(256 << 10)
            .pin(false)
            .agent(mode)
            .agent_socket(Some(sock.clone()))
            .agent_restart_wait(Duration::from_secs(60))
            .build()
            .unwrap()
    };
    /// A kept batch: what it held when handed out, and where its bytes are.
    struct Out {
        samples: Vec<(u64, Vec<u8>)>,
        at: Vec<(usize, usize)>,
    }
    fn acquire(l: &mut Loader) -> Option<Out> {
        if l.acquire_batch_keep().unwrap() == 0 {
            return None;
        }
        let n = l.held_len();
        Some(Out {
            samples: (0..n)
                .map(|i| (l.held_sample(i).id, l.held_sample(i).bytes.to_vec()))
                .collect(),
            at: (0..n)
                .map(|i| {
                    let b = l.held_sample(i).bytes;
                    (b.as_ptr() as usize, b.len())
                })
                .collect(),
        })
    }
    /// Releases the oldest batch out after checking its bytes are still
    /// the ones handed out.
    fn release(
        l: &mut Loader,
        out: &mut std::collections::VecDeque<Out>,
        got: &mut Vec<(u64, Vec<u8>)>,
    ) {
        let b = out.pop_front().unwrap();
        for ((id, want), &(ptr, len)) in b.samples.iter().zip(&b.at) {
            // SAFETY: the batch is kept out (not released yet), and the
            // loader keeps a kept batch's bytes mapped and unchanged until
            // it is released: the contract this test checks.
            let now = unsafe { std::slice::from_raw_parts(ptr as *const u8, len) };
            assert!(
                now == &want[..],
                "sample {id} of a kept batch changed while out"
            );
        }
        got.extend(b.samples);
        assert!(l.release_oldest_batch());
    }
    let mut l = build(AgentMode::Required);
    let mut out = std::collections::VecDeque::new();
    let mut got = Vec::new();
    let mut batches = 0;
    let mut again = None;
    while let Some(b) = acquire(&mut l) {
        out.push_back(b);
        batches += 1;
        if out.len() > 2 {
            release(&mut l, &mut out, &mut got);
        }
        if batches == 3 {
            // Two batches out from here on, across the restart.
            agent.child.kill().unwrap();
            let _ = agent.child.wait();
            again = Some(Agent::start(&sp, &sock, &["--heartbeat-ms", "100"]));
        }
    }
    while !out.is_empty() {
        release(&mut l, &mut out, &mut got);
    }
    let again = again.expect("the agent was restarted");
    again.log.wait_for(
        &["rank 0", &std::process::id().to_string(), "attached"],
        Duration::from_secs(10),
    );
    assert_eq!(l.batches_out(), 0);
    drop(l);
    let mut want = Vec::new();
    let mut e = build(AgentMode::Off);
    while let Some(b) = e.next_batch().unwrap() {
        want.extend(b.iter().map(|s| (s.id, s.bytes.to_vec())));
    }
    assert_eq!(got.len(), 400);
    assert_eq!(
        got.iter().map(|(id, _)| *id).collect::<Vec<_>>(),
        want.iter().map(|(id, _)| *id).collect::<Vec<_>>()
    );
    assert!(got == want, "bytes differ from an embedded read");
}

/// The agent over a partial space (a third held, the rest read from its
/// source) with an NVMe cache area for its ranks (`--cache-dir`): an
/// attached rank's three epochs are exactly what an embedded read of the
/// same space delivers; from the second epoch part of what the first read
/// from the source comes from the rank's area in the agent, and the rank's
/// stats count those hits (the batch slots carry them) and fewer source
/// reads; the area is the rank's own folder under the agent's.
#[test]
fn an_agent_over_a_partial_space_keeps_its_ranks_source_reads_in_a_cache_area() {
    let dir = tempfile::tempdir().unwrap();
    let (sp, third) = partial_space(dir.path());
    let third = third.to_string();
    let sock = dir.path().join("agent.sock");
    let cache = dir.path().join("cache");
    let _agent = Agent::start(
        &sp,
        &sock,
        &[
            "--cache-dir",
            s(&cache),
            "--cache-bytes",
            &third,
            "--cache-scope",
            "rank",
        ],
    );
    let o = wait_output(
        spawn_read(&attached_args(&sp, &sock, 0, 1, 3)),
        Duration::from_secs(120),
    );
    assert!(o.status.success(), "{}", text(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("json report");
    assert_eq!(
        (
            v["samples"].as_u64().unwrap(),
            v["digest"].as_str().unwrap().to_string()
        ),
        embedded(&sp, 0, 1, 3),
        "attached over a partial space and a cache area: exact"
    );
    let epochs = v["per_epoch"].as_array().expect("per_epoch");
    let n = |e: usize, k: &str| {
        epochs[e][k]
            .as_u64()
            .unwrap_or_else(|| panic!("{k} in {v}"))
    };
    let hits: u64 = (0..3).map(|e| n(e, "cache_hits")).sum();
    eprintln!(
        "source reads per epoch {:?}, cache hits {:?}",
        (0..3).map(|e| n(e, "source_reads")).collect::<Vec<_>>(),
        (0..3).map(|e| n(e, "cache_hits")).collect::<Vec<_>>()
    );
    assert!(hits > 0, "no cache hit counted: {v}");
    assert!(n(1, "source_reads") < n(0, "source_reads"), "{v}");
    // The bytes read from the source cross too (the batch slots' extra
    // words, layout 8): each source read's bytes within the files' sizes.
    let (reads, bytes) = (
        v["source_reads"].as_u64().unwrap(),
        v["source_bytes"].as_u64().unwrap(),
    );
    let sizes: Vec<u64> = std::fs::read_dir(dir.path().join("src"))
        .unwrap()
        .flat_map(|class| std::fs::read_dir(class.unwrap().path()).unwrap())
        .map(|e| e.unwrap().metadata().unwrap().len())
        .collect();
    let (least, most) = (*sizes.iter().min().unwrap(), *sizes.iter().max().unwrap());
    assert!(
        reads > 0 && (reads * least..=reads * most).contains(&bytes),
        "{reads} source reads of {bytes} bytes; files of {least} to {most} bytes"
    );
    assert!(cache.join("rank0").join("cache.journal").is_file());
    // Over a space that holds every sample nothing comes from a source:
    // refused at start, by name, not rank by rank at attach.
    let whole = space(&dir.path().join("whole"), 50);
    let refused = Command::new(kspeed_bin())
        .args([
            "agent",
            "--space",
            s(&whole),
            "--socket",
            s(&dir.path().join("b.sock")),
            "--cache-dir",
            s(&cache),
            "--cache-bytes",
            "1MB",
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // A deadline: an agent that took the flags would serve until killed.
    let o = wait_output(refused, Duration::from_secs(30));
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let e = text(&o);
    assert!(
        e.contains("--cache-dir") && e.contains("holds every sample"),
        "{e}"
    );
}
