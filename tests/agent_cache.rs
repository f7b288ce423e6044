//! The node agent's NVMe cache area for what its ranks read from the
//! source (`kspeed agent --cache-dir`), with real agent and rank
//! processes: one area for the node's ranks (`--cache-scope node`, the
//! default), planned over all their reads, against an area per rank
//! (`--cache-scope rank`); byte-exact against embedded reads, and the
//! node's area found again by a restarted agent; the node's area in the
//! agent's memory (`--cache-dir :memory:`). Every wait is on a
//! condition with a deadline.

mod agent_support;
mod common;

use std::path::Path;
use std::time::Duration;

use agent_support::*;
use common::s;

/// Ranks of a job of `WORLD` on this node.
const LOCAL: u32 = 4;
const WORLD: u32 = 8;

/// Node rank `r` of `WORLD` (`--local-rank r --local-world-size LOCAL`)
/// reading `epochs` epochs from `start` through the agent at `sock`.
fn rank_args(sp: &Path, sock: &Path, r: u32, start: u64, epochs: u64) -> Vec<String> {
    let mut a = one_epoch(attached_args(sp, sock, r, WORLD, epochs), start);
    let (local, n) = (r.to_string(), LOCAL.to_string());
    a.extend(["--local-rank", &local, "--local-world-size", &n].map(String::from));
    a
}

/// A finished read's (samples, digest) and its cache hits per epoch.
fn read_report(c: std::process::Child) -> ((u64, String), Vec<u64>) {
    let o = wait_output(c, Duration::from_secs(120));
    assert!(o.status.success(), "{}", common::text(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("json report");
    let hits = v["per_epoch"]
        .as_array()
        .expect("per_epoch")
        .iter()
        .map(|e| e["cache_hits"].as_u64().expect("cache_hits"))
        .collect();
    (
        (
            v["samples"].as_u64().unwrap(),
            v["digest"].as_str().unwrap().to_string(),
        ),
        hits,
    )
}

/// An embedded read of rank `r` of `WORLD`: `epochs` from `start`.
fn embedded_from(sp: &Path, r: u32, start: u64, epochs: u64) -> (u64, String) {
    let args = one_epoch(read_args(sp, r, WORLD, epochs, &["--agent", "off"]), start);
    finish(spawn_read(&args))
}

fn agent_args<'a>(cache: &'a Path, budget: &'a str, scope: &'a str) -> [&'a str; 6] {
    [
        "--cache-dir",
        s(cache),
        "--cache-bytes",
        budget,
        "--cache-scope",
        scope,
    ]
}

/// Node rank 0 reads epochs 1 and 2; then node rank 1 of the same job
/// reads epoch 2 alone. With one area for the node, rank 1's plan hits
/// the samples rank 0 fetched from the source and kept for it (rank 1
/// never read before: every hit is rank 0's fetch); with an area per rank
/// it has none. Both byte-exact.
#[test]
fn one_rank_s_source_reads_are_hits_for_another_rank_of_the_node() {
    let dir = tempfile::tempdir().unwrap();
    let (sp, third) = partial_space(dir.path());
    let want0 = embedded_from(&sp, 0, 1, 2);
    let want1 = embedded_from(&sp, 1, 2, 1);
    let budget = third.to_string();
    let mut hits1 = Vec::new();
    for scope in ["rank", "node"] {
        let cache = dir.path().join(format!("cache-{scope}"));
        let sock = dir.path().join(format!("{scope}.sock"));
        let agent = Agent::start(&sp, &sock, &agent_args(&cache, &budget, scope));
        let rank0 = spawn_read(&rank_args(&sp, &sock, 0, 1, 2));
        let pid0 = rank0.id();
        let (got0, h0) = read_report(rank0);
        assert_eq!(got0, want0, "rank 0, cache scope {scope}: exact");
        // Rank 1 comes after the agent saw rank 0 end: a job's next run.
        agent.log.wait_for(
            &[&format!("(pid {pid0}) ended after")],
            Duration::from_secs(10),
        );
        let (got1, h1) = read_report(spawn_read(&rank_args(&sp, &sock, 1, 2, 1)));
        assert_eq!(got1, want1, "rank 1, cache scope {scope}: exact");
        eprintln!("scope {scope}: rank 0 cache hits per epoch {h0:?}, then rank 1 {h1:?}");
        hits1.push(h1.iter().sum::<u64>());
        if scope == "node" {
            assert!(
                h1.iter().sum::<u64>() > 0,
                "rank 1 found none of rank 0's fetches in the node's area"
            );
            assert!(cache.join("node").join("cache.journal").is_file());
            assert!(!cache.join("rank0").exists());
            agent.log.wait_for(
                &["node cache area planned for node ranks 0-3 of 8 from epoch 1 step 0"],
                Duration::from_secs(5),
            );
        } else {
            assert!(cache.join("rank1").join("cache.journal").is_file());
        }
    }
    assert_eq!(hits1[0], 0, "rank 1's own area held nothing for it");
}

/// `--cache-dir :memory:`: the node's area in the agent's memory, over a
/// partial space (its source samples) and over a space that holds every
/// sample (its NVMe samples: an area on disk is refused there). Node rank
/// 0 reads epochs 1 and 2, then node rank 1 epoch 2: its hits are rank
/// 0's reads, both byte-exact, and nothing is written to disk.
#[test]
fn the_node_s_area_in_the_agent_s_memory_is_shared_by_its_ranks() {
    let dir = tempfile::tempdir().unwrap();
    let (partial, third) = partial_space(dir.path());
    let whole_dir = dir.path().join("whole");
    std::fs::create_dir(&whole_dir).unwrap();
    let whole = space(&whole_dir, 600);
    let budget = third.to_string();
    let memory = Path::new(kspeed::cache::MEMORY_DIR);
    for (what, sp) in [("partial", &partial), ("whole", &whole)] {
        let sock = dir.path().join(format!("mem-{what}.sock"));
        let agent = Agent::start(sp, &sock, &agent_args(memory, &budget, "node"));
        let rank0 = spawn_read(&rank_args(sp, &sock, 0, 1, 2));
        let pid0 = rank0.id();
        let (got0, h0) = read_report(rank0);
        assert_eq!(
            got0,
            embedded_from(sp, 0, 1, 2),
            "{what} space, rank 0: exact"
        );
        agent.log.wait_for(
            &[&format!("(pid {pid0}) ended after")],
            Duration::from_secs(10),
        );
        let (got1, h1) = read_report(spawn_read(&rank_args(sp, &sock, 1, 2, 1)));
        assert_eq!(
            got1,
            embedded_from(sp, 1, 2, 1),
            "{what} space, rank 1: exact"
        );
        eprintln!(
            "{what} space, in memory: rank 0 cache hits per epoch {h0:?}, then rank 1 {h1:?}"
        );
        assert!(
            h1.iter().sum::<u64>() > 0,
            "{what} space: rank 1 found none of rank 0's reads in the node's area in memory"
        );
        agent.log.wait_for(
            &["node cache area :memory:", "slots", "policy next-use"],
            Duration::from_secs(5),
        );
    }
    assert!(
        !memory.exists(),
        "a folder named {} was made",
        memory.display()
    );
    // On disk, the whole space is refused: nothing comes from a source.
    let o = common::kspeed(&[
        "agent",
        "--space",
        s(&whole),
        "--socket",
        s(&dir.path().join("refused.sock")),
        "--cache-dir",
        s(&dir.path().join("disk")),
        "--cache-bytes",
        &budget,
    ]);
    assert!(!o.status.success());
    assert!(
        common::text(&o).contains("holds every sample"),
        "{}",
        common::text(&o)
    );
}

/// The node's four ranks at once, 3 epochs: byte-exact, one area for all.
/// The agent is then killed (SIGKILL); a new one finds the node's area
/// and its samples: hits from a rank's first epoch.
#[test]
fn four_ranks_share_the_node_s_area_and_a_restarted_agent_finds_it() {
    let dir = tempfile::tempdir().unwrap();
    let (sp, third) = partial_space(dir.path());
    let budget = third.to_string();
    let cache = dir.path().join("cache");
    let sock = dir.path().join("agent.sock");
    let agent = Agent::start(&sp, &sock, &agent_args(&cache, &budget, "node"));
    let ranks: Vec<_> = (0..LOCAL)
        .map(|r| spawn_read(&rank_args(&sp, &sock, r, 1, 3)))
        .collect();
    let got: Vec<_> = ranks.into_iter().map(read_report).collect();
    for (r, (g, h)) in got.iter().enumerate() {
        assert_eq!(g, &embedded_from(&sp, r as u32, 1, 3), "rank {r}: exact");
        eprintln!("rank {r} cache hits per epoch {h:?}");
    }
    let end = agent
        .log
        .wait_for(&["no rank attached"], Duration::from_secs(10));
    eprintln!("{end}");
    drop(agent);
    let sock = dir.path().join("again.sock");
    let _agent = Agent::start(&sp, &sock, &agent_args(&cache, &budget, "node"));
    let (g, h) = read_report(spawn_read(&rank_args(&sp, &sock, 2, 1, 1)));
    assert_eq!(g, embedded_from(&sp, 2, 1, 1), "rank 2 again: exact");
    assert!(
        h[0] > 0,
        "a restarted agent found nothing in the node's area: {h:?}"
    );
}

/// The node's area holds one user's samples (filled from their ranks'
/// rings): another user's first rank finds it emptied, and so does the
/// first user's next rank after that; `DIR/node.uid` names the user.
#[test]
fn another_user_s_first_rank_finds_the_node_s_area_emptied() {
    use std::os::unix::fs::PermissionsExt;
    use std::os::unix::process::CommandExt;
    if !common::is_root() {
        return common::skip("running a rank as another user needs root");
    }
    let dir = tempfile::tempdir().unwrap();
    let (sp, third) = partial_space(dir.path());
    // `nobody` reads the space's catalog: the test's tree is open to it.
    let mut todo = vec![dir.path().to_path_buf()];
    while let Some(p) = todo.pop() {
        let is_dir = p.is_dir();
        let mode = if is_dir { 0o755 } else { 0o644 };
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).unwrap();
        if is_dir {
            todo.extend(std::fs::read_dir(&p).unwrap().map(|e| e.unwrap().path()));
        }
    }
    let cache = dir.path().join("cache");
    let sock = dir.path().join("agent.sock");
    let budget = third.to_string();
    let mut args: Vec<&str> = agent_args(&cache, &budget, "node").to_vec();
    args.extend(["--allow-other-uids", "--socket-mode", "666"]);
    let agent = Agent::start(&sp, &sock, &args);
    // Each read waits for the agent to see its rank end (the area is
    // held until then).
    let read = |args: Vec<String>, uid: Option<u32>| {
        let mut c = std::process::Command::new(common::kspeed_bin());
        c.args(&args)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        if let Some(u) = uid {
            c.uid(u).gid(u);
        }
        let child = c.spawn().expect("spawn kspeed read");
        let pid = child.id();
        let (got, hits) = read_report(child);
        agent.log.wait_for(
            &[&format!("(pid {pid}) ended after")],
            Duration::from_secs(10),
        );
        (got, hits)
    };
    let owner = || std::fs::read_to_string(cache.join("node.uid")).unwrap();
    let epoch2 = embedded_from(&sp, 0, 2, 1);
    read(rank_args(&sp, &sock, 0, 1, 2), None);
    let (got, hits) = read(rank_args(&sp, &sock, 0, 2, 1), None);
    assert_eq!(got, epoch2);
    assert!(hits[0] > 0, "root's area held nothing for root: {hits:?}");
    assert_eq!(owner().trim(), "0");
    let (got, hits) = read(rank_args(&sp, &sock, 0, 2, 1), Some(65534));
    assert_eq!(got, epoch2, "nobody's rank: exact");
    assert_eq!(hits, [0], "nobody's rank was served root's samples");
    assert_eq!(owner().trim(), "65534");
    let (got, hits) = read(rank_args(&sp, &sock, 0, 2, 1), None);
    assert_eq!(got, epoch2);
    assert_eq!(hits, [0], "root's rank was served nobody's samples");
    assert_eq!(owner().trim(), "0");
}
