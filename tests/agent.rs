//! `kspeed agent` with real rank processes (`kspeed read --agent required`)
//! over one local space (issue 28, first slice): byte-exact, ordered
//! delivery against embedded reads of the same rank/world/seed; a rank
//! killed with SIGKILL leaves the others exact and the agent serving; an
//! agent killed with SIGKILL gives the ranks `AgentGone` within its
//! heartbeats. Every wait is on a condition with a deadline.

mod common;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use common::{gen, kspeed_bin, ok, s, text};

/// A space of `count` tiny samples (about 4.5 KiB each).
fn space(dir: &Path, count: u64) -> PathBuf {
    let src = dir.join("src");
    gen("tiny", count, &src);
    let sp = dir.join("space");
    ok(&["preload", "--source", s(&src), "--space", s(&sp)]);
    sp
}

/// Lines a child wrote to one stream, collected by a thread.
#[derive(Clone, Default)]
struct Lines(Arc<(Mutex<Vec<String>>, Condvar)>);

impl Lines {
    fn follow(stream: impl std::io::Read + Send + 'static) -> Lines {
        let l = Lines::default();
        let l2 = l.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stream).lines() {
                let Ok(line) = line else { break };
                let (m, cv) = &*l2.0;
                m.lock().unwrap().push(line);
                cv.notify_all();
            }
        });
        l
    }

    /// Waits for a line containing every one of `needles`.
    fn wait_for(&self, needles: &[&str], within: Duration) -> String {
        let deadline = Instant::now() + within;
        let (m, cv) = &*self.0;
        let mut g = m.lock().unwrap();
        loop {
            if let Some(l) = g.iter().find(|l| needles.iter().all(|n| l.contains(n))) {
                return l.clone();
            }
            let now = Instant::now();
            assert!(
                now < deadline,
                "no line with {needles:?} within {within:?}; got:\n{}",
                g.join("\n")
            );
            g = cv.wait_timeout(g, deadline - now).unwrap().0;
        }
    }

    fn all(&self) -> String {
        self.0 .0.lock().unwrap().join("\n")
    }
}

/// A running `kspeed agent`; killed with SIGKILL when dropped.
struct Agent {
    child: Child,
    log: Lines,
}

impl Agent {
    fn start(space: &Path, socket: &Path, extra: &[&str]) -> Agent {
        let mut child = Command::new(kspeed_bin())
            .args(["agent", "-v", "--space", s(space), "--socket", s(socket)])
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn kspeed agent");
        let out = Lines::follow(child.stdout.take().unwrap());
        let log = Lines::follow(child.stderr.take().unwrap());
        out.wait_for(&["agent serving"], Duration::from_secs(30));
        Agent { child, log }
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `kspeed read` arguments for rank `rank` of `world`.
fn read_args(space: &Path, rank: u32, world: u32, epochs: u64, extra: &[&str]) -> Vec<String> {
    let mut v: Vec<String> = [
        "read",
        "--progress=none",
        "--json",
        "--digest",
        "--space",
        s(space),
        "--rank",
        &rank.to_string(),
        "--world",
        &world.to_string(),
        "--seed",
        "11",
        "--batch-size",
        "16",
        // A small ring: many wraps, and flow control through the agent.
        "--ring-bytes",
        "256KiB",
        "--epochs",
        &epochs.to_string(),
        "--start-epoch",
        "1",
    ]
    .iter()
    .map(|a| a.to_string())
    .collect();
    v.extend(extra.iter().map(|a| a.to_string()));
    v
}

fn spawn_read(args: &[String]) -> Child {
    Command::new(kspeed_bin())
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn kspeed read")
}

/// Waits for a child to exit, at most `within` (then kills it and fails).
fn wait_output(child: Child, within: Duration) -> std::process::Output {
    let pid = child.id();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(within) {
        Ok(o) => o.expect("wait for the child"),
        Err(_) => {
            let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
            panic!("pid {pid} did not exit within {within:?}");
        }
    }
}

/// Waits for a read and returns its (samples, digest) from `--json`.
fn finish(child: Child) -> (u64, String) {
    let o = wait_output(child, Duration::from_secs(120));
    assert!(o.status.success(), "kspeed read failed:\n{}", text(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("json report");
    (
        v["samples"].as_u64().expect("samples"),
        v["digest"].as_str().expect("digest").to_string(),
    )
}

fn embedded(space: &Path, rank: u32, world: u32, epochs: u64) -> (u64, String) {
    finish(spawn_read(&read_args(
        space,
        rank,
        world,
        epochs,
        &["--agent", "off"],
    )))
}

fn attached_args(space: &Path, sock: &Path, rank: u32, world: u32, epochs: u64) -> Vec<String> {
    read_args(
        space,
        rank,
        world,
        epochs,
        &["--agent", "required", "--agent-socket", s(sock)],
    )
}

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

/// A read's `--json` report: (samples, digest, disk reads, tier hits).
fn report(child: Child) -> (u64, String, u64, u64) {
    let o = wait_output(child, Duration::from_secs(120));
    assert!(o.status.success(), "kspeed read failed:\n{}", text(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("json report");
    let n = |k: &str| v[k].as_u64().unwrap_or_else(|| panic!("{k} in {v}"));
    (
        n("samples"),
        v["digest"].as_str().expect("digest").to_string(),
        n("disk_reads"),
        n("tier_hits"),
    )
}

/// Arguments for one epoch (`epoch`) of rank `rank` of `world`.
fn one_epoch(args: Vec<String>, epoch: u64) -> Vec<String> {
    let mut v = args;
    let at = v.iter().position(|a| a == "--start-epoch").expect("flag") + 1;
    v[at] = epoch.to_string();
    v
}

/// The agent's node tier is one for all its ranks: after rank 0 and rank
/// 1 of 2 each read their half in epoch 1 (filling the tier with the whole
/// dataset), rank 0's epoch 2, which holds samples rank 1 read, comes from
/// the tier alone (per-rank tiers would have read about half of it from
/// disk), byte-exact; and the agent's read counts reach the rank's stats.
#[test]
fn the_node_tier_serves_every_rank() {
    let dir = tempfile::tempdir().unwrap();
    let count = 600u64;
    let sp = space(dir.path(), count);
    let sock = dir.path().join("agent.sock");
    let agent = Agent::start(&sp, &sock, &["--tier-bytes", "64MiB", "--no-mlock"]);
    let share = count / 2;
    for rank in 0..2u32 {
        let args = one_epoch(attached_args(&sp, &sock, rank, 2, 1), 1);
        let child = spawn_read(&args);
        let pid = child.id();
        let (n, digest, disk, tier) = report(child);
        // One epoch asked (ATTACH's end_epoch): the agent published its
        // 19 batches (300 samples, 16 a batch) and read nothing past them.
        agent.log.wait_for(
            &[&format!("(pid {pid}) ended after 19 batches")],
            Duration::from_secs(10),
        );
        let want = embedded_epoch(&sp, rank, 2, 1);
        assert_eq!((n, digest), want, "rank {rank}, epoch 1");
        // Every delivered sample was read for it, from disk in the main:
        // no other rank had read any of this rank's epoch-1 samples.
        assert!(
            disk + tier >= share,
            "rank {rank}: {disk} disk reads, {tier} tier hits"
        );
        assert!(
            disk >= share / 2,
            "rank {rank}: {disk} disk reads in epoch 1"
        );
    }
    let args = one_epoch(attached_args(&sp, &sock, 0, 2, 1), 2);
    let (n, digest, disk, tier) = report(spawn_read(&args));
    assert_eq!((n, digest), embedded_epoch(&sp, 0, 2, 2), "rank 0, epoch 2");
    assert_eq!(
        disk, 0,
        "epoch 2 of rank 0 read from disk although the node tier holds every sample"
    );
    assert!(tier >= share, "{tier} tier hits for {share} samples");
}

/// The node tier is shared by the ranks of one user only (a CRC does not
/// stop a rank that forges the bytes it is filled from): after root's two
/// ranks filled it, a rank of another user (`nobody`) finds it emptied for
/// it and reads from disk; and a root rank that attaches while `nobody`'s
/// rank holds the tier reads without it. Both byte-exact. Root only (the
/// agent serves another uid only as root).
#[test]
fn the_node_tier_is_shared_by_one_user_at_a_time() {
    use std::os::unix::fs::PermissionsExt;
    use std::os::unix::process::CommandExt;
    if !common::is_root() {
        return common::skip("running a rank as another user needs root");
    }
    let dir = tempfile::tempdir().unwrap();
    // `nobody` reads the catalog: the test's directory must be open to it.
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let count = 600u64;
    let sp = space(dir.path(), count);
    // A space is private to its preloader; this one is open to `nobody`.
    let mut todo = vec![sp.clone()];
    while let Some(p) = todo.pop() {
        let dir = p.is_dir();
        let mode = if dir { 0o755 } else { 0o644 };
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).unwrap();
        if dir {
            todo.extend(std::fs::read_dir(&p).unwrap().map(|e| e.unwrap().path()));
        }
    }
    let sock = dir.path().join("agent.sock");
    let agent = Agent::start(
        &sp,
        &sock,
        &[
            "--tier-bytes",
            "64MiB",
            "--no-mlock",
            "--allow-other-uids",
            "--socket-mode",
            "666",
        ],
    );
    for rank in 0..2u32 {
        let args = one_epoch(attached_args(&sp, &sock, rank, 2, 1), 1);
        let child = spawn_read(&args);
        let pid = child.id();
        report(child);
        // Root's ranks hold the tier until the agent has seen them end.
        agent.log.wait_for(
            &[&format!("(pid {pid}) ended after")],
            Duration::from_secs(10),
        );
    }
    // nobody's rank 0, epoch 2: root's samples were dropped for it.
    let mut args = one_epoch(attached_args(&sp, &sock, 0, 2, 1), 2);
    args.extend(["--compute-us", "100000"].map(String::from));
    let nobody = Command::new(kspeed_bin())
        .args(&args)
        .uid(65534)
        .gid(65534)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn kspeed read as nobody");
    let nobody_pid = nobody.id().to_string();
    agent.log.wait_for(
        &["rank 0", &nobody_pid, "attached"],
        Duration::from_secs(30),
    );
    // Meanwhile root's rank 1, epoch 2: nobody's rank holds the tier.
    let args = one_epoch(attached_args(&sp, &sock, 1, 2, 1), 2);
    let root_rank = spawn_read(&args);
    let root_pid = root_rank.id().to_string();
    let (n, digest, disk, tier) = report(root_rank);
    assert_eq!(
        (n, digest),
        embedded_epoch(&sp, 1, 2, 2),
        "root's rank 1, epoch 2"
    );
    assert_eq!(
        tier, 0,
        "root's rank read from the tier nobody's rank holds"
    );
    assert!(disk >= count / 2, "{disk} disk reads");
    agent.log.wait_for(
        &[&root_pid, "uid 0", "reads without the node tier"],
        Duration::from_secs(10),
    );
    let (n, digest, disk, _) = report(nobody);
    assert_eq!(
        (n, digest),
        embedded_epoch(&sp, 0, 2, 2),
        "nobody's rank 0, epoch 2"
    );
    // Root's ranks had filled every sample; emptied for nobody, so its
    // epoch came from disk (the shared tier would have given 0 reads).
    assert!(
        disk >= count / 4,
        "nobody's rank read {disk} samples from disk"
    );
}

/// An embedded read of one epoch: (samples, digest).
fn embedded_epoch(space: &Path, rank: u32, world: u32, epoch: u64) -> (u64, String) {
    let args = one_epoch(read_args(space, rank, world, 1, &["--agent", "off"]), epoch);
    finish(spawn_read(&args))
}

/// Reserves `pages` more 2 MiB huge pages for the test's life (root
/// only): the count goes back to what it was when dropped.
struct HugePages {
    before: u64,
}

const NR_HUGEPAGES: &str = "/proc/sys/vm/nr_hugepages";

impl HugePages {
    fn reserve(pages: u64) -> Option<HugePages> {
        let before: u64 = std::fs::read_to_string(NR_HUGEPAGES)
            .ok()?
            .trim()
            .parse()
            .ok()?;
        std::fs::write(NR_HUGEPAGES, (before + pages).to_string()).ok()?;
        let now: u64 = std::fs::read_to_string(NR_HUGEPAGES)
            .ok()?
            .trim()
            .parse()
            .ok()?;
        let guard = HugePages { before };
        // The kernel may find fewer free 2 MiB blocks than asked.
        (now >= before + pages).then_some(guard)
    }
}

impl Drop for HugePages {
    fn drop(&mut self) {
        let _ = std::fs::write(NR_HUGEPAGES, self.before.to_string());
    }
}

/// With 2 MiB pages reserved, an attached rank's ring (a multiple of 2 MiB)
/// is a hugetlb memfd, which the agent maps and reads into, byte-exact
/// against an embedded read; the rank says which pages its ring got.
#[test]
fn an_attached_ring_in_huge_pages_is_exact() {
    if !common::is_root() {
        return common::skip("reserving huge pages needs root");
    }
    // 4 MiB rings: the rank's, and the one it replaces at a restart.
    let Some(_pages) = HugePages::reserve(8) else {
        return common::skip("the kernel could not reserve 8 more 2 MiB pages");
    };
    let dir = tempfile::tempdir().unwrap();
    let sp = space(dir.path(), 400);
    let sock = dir.path().join("agent.sock");
    let _agent = Agent::start(&sp, &sock, &[]);
    let big_ring = |mut v: Vec<String>| {
        let at = v.iter().position(|a| a == "--ring-bytes").expect("flag") + 1;
        v[at] = "4MiB".into();
        v
    };
    let mut args = big_ring(attached_args(&sp, &sock, 0, 1, 2));
    args.push("-v".into());
    let o = wait_output(spawn_read(&args), Duration::from_secs(120));
    assert!(o.status.success(), "{}", text(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("ring of 4194304 bytes in 2 MiB huge pages (hugetlb)"),
        "{err}"
    );
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("json report");
    let embedded_args = big_ring(read_args(&sp, 0, 1, 2, &["--agent", "off"]));
    assert_eq!(
        (
            v["samples"].as_u64().unwrap(),
            v["digest"].as_str().unwrap().to_string()
        ),
        finish(spawn_read(&embedded_args))
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

/// An attached rank resumes its own position (same world) as an embedded
/// one does, but an epoch dealt from another world's job position is
/// refused by name before anything changes (the agent deals ordinary
/// epochs only), and the loader goes on from where it was.
#[test]
fn attached_resume_at_another_world_is_refused_by_name() {
    use kspeed::loader::{AgentMode, LoaderBuilder};
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
    let mut two = build(AgentMode::Off, 0, 2);
    for _ in 0..3 {
        two.next_batch().unwrap().unwrap();
    }
    let job = two.save_job_position();
    let own = two.save_position();
    let mut three = build(AgentMode::Required, 0, 3);
    match three.restore_job_position(&job) {
        Err(kspeed::Error::InvalidConfig(m)) => assert!(m.contains("agent = off"), "{m}"),
        r => panic!("{r:?}"),
    }
    let first = three
        .next_batch()
        .unwrap()
        .unwrap()
        .iter()
        .map(|b| b.id)
        .collect::<Vec<_>>();
    let mut plain = build(AgentMode::Off, 0, 3);
    let want = plain
        .next_batch()
        .unwrap()
        .unwrap()
        .iter()
        .map(|b| b.id)
        .collect::<Vec<_>>();
    assert_eq!(first, want, "the refused restore changed nothing");
    // The same world resumes attached exactly as embedded.
    let mut again = build(AgentMode::Required, 0, 2);
    again.restore_position(&own).unwrap();
    let got = again
        .next_batch()
        .unwrap()
        .unwrap()
        .iter()
        .map(|b| b.id)
        .collect::<Vec<_>>();
    two.restore_position(&own).unwrap();
    let want = two
        .next_batch()
        .unwrap()
        .unwrap()
        .iter()
        .map(|b| b.id)
        .collect::<Vec<_>>();
    assert_eq!(got, want);
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
