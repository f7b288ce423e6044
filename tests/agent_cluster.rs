//! `kspeed agent` in a cluster (issue 28): three nodes, each one agent
//! process that is both its node's consumer (for the ranks attached to it:
//! the node's own samples from its space, the rest pushed by the other
//! nodes) and its node service (`--listen`: the owner the other nodes ask).
//! Real processes on loopback: each node on its own 127.x.y.z address at
//! one port, so the node list is known before the agents start. In the
//! soft-RoCE VM (`KSPEED_TEST_RDMA`, scripts/vm_rdma_tests.sh) the nodes
//! are 10.77.0.1-3, each with its own RoCE GID, and samples move by RDMA
//! WRITE into the ranks' shared rings. Every wait is on a condition with a
//! deadline.
//!
//! Why this file is over ~800 lines: each test here needs the same three
//! agent processes on their own addresses (`Nodes`); one binary sets them
//! up once per test instead of every file repeating it.

mod agent_support;
mod common;
#[path = "common/nodes.rs"]
mod nodes;

use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::Duration;

use agent_support::*;
use common::{gen, ok, s, text};

/// One test's cluster: the spaces, the node list, the token.
struct Nodes {
    dir: tempfile::TempDir,
    spaces: Vec<PathBuf>,
    cluster: PathBuf,
    token: PathBuf,
    addrs: Vec<String>,
}

impl Nodes {
    /// `count` tiny samples preloaded for `nodes` nodes with `copies`
    /// copies; node `i` listens at 127.`a`.`b`.`i+1`:`port`, `a`, `b` and
    /// the port taken from this process's id and `tag` so concurrent test
    /// binaries and tests do not meet (over RDMA: 10.77.0.`i+1`).
    fn new(count: u64, nodes: usize, copies: u32, tag: u8) -> Nodes {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("src");
        gen("tiny", count, &src);
        let catalog = dir.path().join("catalog");
        ok(&["catalog", "--source", s(&src), "--out", s(&catalog)]);
        let pid = std::process::id();
        let (a, b) = (10 + (pid % 200) as u8, tag);
        // Over RDMA all on the same addresses: 16 ports per process
        // (tags 1-11), so two test processes started together (the VM runs
        // this binary in two shards at once) never take the same port.
        let port = 20_000 + (pid % 2_000) as u16 * 16;
        let addrs: Vec<String> = (0..nodes)
            .map(|i| {
                if rdma() {
                    format!("10.77.0.{}:{}", i + 1, port + tag as u16)
                } else {
                    format!("127.{a}.{b}.{}:{port}", i + 1)
                }
            })
            .collect();
        let cluster = dir.path().join("cluster");
        let text: String = addrs
            .iter()
            .enumerate()
            .map(|(i, a)| format!("{i} {a}\n"))
            .collect();
        std::fs::write(&cluster, text).unwrap();
        let token = dir.path().join("token");
        std::fs::write(&token, "agent-cluster-token\n").unwrap();
        let c = copies.to_string();
        let spaces = nodes::preload_nodes(&src, &catalog, dir.path(), nodes, &["--replicas", &c]);
        Nodes {
            dir,
            spaces,
            cluster,
            token,
            addrs,
        }
    }

    fn socket(&self, node: usize) -> PathBuf {
        self.dir.path().join(format!("agent{node}.sock"))
    }

    /// Node `node`'s agent: its space, its socket, the node list, and its
    /// node service at its address.
    fn agent(&self, node: usize) -> Agent {
        self.agent_with(node, &[])
    }

    /// [`Nodes::agent`] with `extra` arguments.
    fn agent_with(&self, node: usize, extra: &[&str]) -> Agent {
        let mut args = self.net_args(true);
        args.extend(["--listen", &self.addrs[node], "--node-timeout-ms", "2000"]);
        args.extend(extra);
        Agent::start(&self.spaces[node], &self.socket(node), &args)
    }

    /// The node list, the token (`with_token`), and `--rdma` in the
    /// soft-RoCE VM: what the agents and the ranks take.
    fn net_args(&self, with_token: bool) -> Vec<&str> {
        let mut v = vec!["--cluster", s(&self.cluster)];
        if with_token {
            v.extend(["--token-file", s(&self.token)]);
        }
        if rdma() {
            v.push("--rdma");
        }
        v
    }

    /// `kspeed read` of rank `rank` of `world` on node `node`, in cluster
    /// mode, two epochs from epoch 1, with `agent` (`required`, `auto` or
    /// `off`) and `extra`.
    fn read(&self, node: usize, rank: u32, world: u32, agent: &str, extra: &[&str]) -> Vec<String> {
        self.read_epochs(node, rank, world, agent, 2, extra)
    }

    /// [`Nodes::read`] of `epochs` epochs.
    fn read_epochs(
        &self,
        node: usize,
        rank: u32,
        world: u32,
        agent: &str,
        epochs: u64,
        extra: &[&str],
    ) -> Vec<String> {
        let sock = self.socket(node);
        // A rank attached with `required` connects to no node: it is not
        // given the token (the agents hold it).
        let mut more = self.net_args(agent != "required");
        more.extend(["--agent", agent, "--agent-socket", s(&sock)]);
        more.extend(extra);
        read_args(&self.spaces[node], rank, world, epochs, &more)
    }
}

/// In the soft-RoCE VM: every node offers RDMA and every consumer uses it.
fn rdma() -> bool {
    std::env::var_os("KSPEED_TEST_RDMA").is_some()
}

/// The `--json` report of a read: (samples, digest, remote samples, failovers).
fn cluster_report(child: Child) -> (u64, String, u64, u64) {
    let o = wait_output(child, Duration::from_secs(120));
    assert!(o.status.success(), "kspeed read failed:\n{}", text(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("json report");
    let n = |x: &serde_json::Value, k: &str| x[k].as_u64().unwrap_or_else(|| panic!("{k} in {v}"));
    (
        n(&v, "samples"),
        v["digest"].as_str().expect("digest").to_string(),
        n(&v["cluster"], "remote_samples"),
        n(&v["cluster"], "failovers"),
    )
}

/// Connections a node service's log shows open now: each "(rank r of w)
/// connected" not yet followed by its "disconnected" (a handshake a
/// consumer gave up on after the service took it, as a link made while
/// its node was still starting can be, logs both).
fn open_links(lines: &[String]) -> usize {
    let n = |what: &str| lines.iter().filter(|l| l.contains(what)).count();
    n(") connected").saturating_sub(n(") disconnected"))
}

/// Waits until `a`'s node service has `n` connections open.
fn wait_open_links(a: &Agent, n: usize) {
    a.log.wait_until(
        &format!("{n} connections open"),
        Duration::from_secs(60),
        |l| open_links(l) == n,
    );
}

/// Three nodes holding a third each, two ranks per node attached to their
/// node's agent (one `required`, one `auto`): each rank's two epochs are
/// byte for byte and in order what the same rank reads embedded from the
/// same three node services, two thirds of its samples pushed by the other
/// nodes' agents; every rank attached, none fell back.
#[test]
fn attached_ranks_in_a_cluster_deliver_what_embedded_ranks_do() {
    let nodes = Nodes::new(1200, 3, 1, 1);
    // Node 0's agent runs two shared network threads (its two ranks go
    // one to each), the others one (their ranks share it).
    let agents: Vec<Agent> = (0..3)
        .map(|i| match i {
            0 => nodes.agent_with(0, &["--net-threads", "2"]),
            _ => nodes.agent(i),
        })
        .collect();
    // Every thread's links made before a rank attaches: a rank attaching
    // earlier may start a thread whose agent lane is not made yet, and that
    // thread closes after the rank if the lane is still not there (a thread
    // more, and its links made twice, while an agent is starting).
    for (i, a) in agents.iter().enumerate() {
        let threads = if i == 0 { 2 } else { 1 };
        a.log.wait_count(
            "links kept while the agent runs",
            threads,
            Duration::from_secs(60),
        );
    }
    if rdma() {
        // Over RDMA each network thread's links share its CQ and one SRQ
        // (soft-RoCE has SRQs): a link's 1,024 receives for each of the 3
        // nodes' places.
        for (i, a) in agents.iter().enumerate() {
            let threads = if i == 0 { 2 } else { 1 };
            a.log.wait_count(
                "links to 3 nodes share 1 CQ(s) (",
                threads,
                Duration::from_secs(10),
            );
            let srq = "and one shared receive queue of 3072 receives";
            assert_eq!(a.log.all().matches(srq).count(), threads, "agent {i}");
        }
    }
    let world = 6u32;
    let node_of = |r: u32| (r / 2) as usize;
    let attached: Vec<Child> = (0..world)
        .map(|r| {
            let mode = if r % 2 == 0 { "required" } else { "auto" };
            // Ranks 1 and 4 have the agent check every sample's CRC32C,
            // the other nodes' pushes into their rings included.
            let verify: &[&str] = if r % 3 == 1 { &["--verify"] } else { &[] };
            spawn_read(&nodes.read(node_of(r), r, world, mode, verify))
        })
        .collect();
    let attached: Vec<_> = attached.into_iter().map(cluster_report).collect();
    {
        // An agent's ranks share its network threads (over TCP, and over
        // RDMA with memory windows, as soft-RoCE has), each of which
        // connects once to each other node: every connection a node
        // service took came from another agent's thread starting, none
        // from a rank.
        let count = |a: &Agent, what: &str| a.log.all().matches(what).count();
        let starts: Vec<usize> = agents
            .iter()
            .map(|a| {
                count(
                    a,
                    "agent: a network thread with one link to each of the other 2 nodes",
                )
            })
            .collect();
        for (j, a) in agents.iter().enumerate() {
            let others: usize = (0..3).filter(|&i| i != j).map(|i| starts[i]).sum();
            assert!(starts[j] >= 1, "agent {j} started no network thread");
            assert!(
                starts[j] <= 2,
                "agent {j} started {} network threads",
                starts[j]
            );
            // Open ones: a handshake made while a node was still starting
            // may have been given up and made again.
            wait_open_links(a, others);
            let _ = j;
        }
    }
    for r in 0..world {
        let node = node_of(r);
        let embedded = cluster_report(spawn_read(&nodes.read(node, r, world, "off", &[])));
        let got = &attached[r as usize];
        assert_eq!(
            (got.0, &got.1),
            (embedded.0, &embedded.1),
            "rank {r} on node {node}: attached against embedded"
        );
        assert_eq!(got.0, 2 * 1200 / world as u64);
        // About two thirds come from the other nodes (the placement is a
        // hash: well inside a third to nine tenths).
        assert!(
            got.2 * 3 > got.0 && got.2 * 10 < got.0 * 9,
            "rank {r}: {} of {} samples pushed by other nodes",
            got.2,
            got.0
        );
        assert_eq!(got.3, 0, "rank {r}: no failover with every node up");
        agents[node].log.wait_for(
            &[&format!("rank {r} "), "attached"],
            Duration::from_secs(10),
        );
    }
    for a in &agents {
        let log = a.log.all();
        assert!(
            !log.contains("attach refused") && !log.contains("panicked"),
            "{log}"
        );
    }
}

/// Two copies of every sample. Node 2's agent hangs (SIGSTOP) and is then
/// killed (SIGKILL) while ranks on nodes 0 and 1 are mid-epoch: their
/// agents' loaders fail the samples node 2 owed over to the other copy,
/// count those failovers into the ranks' stats, and the ranks finish,
/// byte for byte what they read with every node up; the rank attached to
/// node 2 fails with `AgentGone` (its agent is gone: no restart wait asked
/// for).
#[test]
fn a_killed_node_s_samples_fail_over_and_its_rank_is_told() {
    let nodes = Nodes::new(1200, 3, 2, 2);
    let world = 3u32;
    let mut agents: Vec<Option<Agent>> = (0..3).map(|i| Some(nodes.agent(i))).collect();
    let want: Vec<(u64, String, u64, u64)> = (0..world)
        .map(|r| cluster_report(spawn_read(&nodes.read(r as usize, r, world, "off", &[]))))
        .collect();
    // 50 ms per batch of 16: each epoch of 400 samples takes 1.25 s or
    // more, so node 2 stops while every rank still needs samples from it.
    let slow = ["--compute-us", "50000"];
    let ranks: Vec<Child> = (0..world)
        .map(|r| spawn_read(&nodes.read(r as usize, r, world, "required", &slow)))
        .collect();
    for (r, a) in agents.iter().enumerate() {
        a.as_ref().unwrap().log.wait_for(
            &[&format!("rank {r} "), "attached"],
            Duration::from_secs(30),
        );
    }
    // Node 2 first goes silent (SIGSTOP: a host that hangs), so the
    // grants the other agents' loaders send it stay unanswered until they
    // judge it gone (no frame for 2 s with grants outstanding) and move
    // those grants to the other copy; then it dies for good (SIGKILL,
    // reaped when dropped).
    signal(agents[2].as_ref().unwrap(), "-STOP");
    // Which of nodes 0 and 1 asks node 2 first depends on the placement
    // (the other holds those samples itself): wait until one judged it.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !agents[..2].iter().any(|a| {
        let log = a.as_ref().unwrap().log.all();
        log.lines()
            .any(|l| l.contains("node 2") && l.contains("is gone"))
    }) {
        assert!(
            std::time::Instant::now() < deadline,
            "neither agent judged node 2 gone within 30 s"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    drop(agents[2].take());
    let mut ranks = ranks.into_iter();
    let mut failovers = 0;
    for r in 0..2u32 {
        let got = cluster_report(ranks.next().unwrap());
        assert_eq!(
            (got.0, &got.1),
            (want[r as usize].0, &want[r as usize].1),
            "rank {r}: exact after node 2 died"
        );
        failovers += got.3;
    }
    // The agents' failovers reach their ranks' stats (the batch slots'
    // counts), as an embedded rank's would count them.
    eprintln!("ranks 0 and 1 counted {failovers} failovers");
    assert!(failovers > 0, "no failover counted by ranks 0 and 1");
    let o = wait_output(ranks.next().unwrap(), Duration::from_secs(60));
    assert_eq!(o.status.code(), Some(1), "rank 2:\n{}", text(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("agent") && err.contains(s(&nodes.socket(2))),
        "rank 2 names its agent's socket: {err}"
    );
}

/// The node tier in a cluster keeps what the other nodes pushed as well as
/// what the node's disk gave: two ranks attached to node 0's agent (with a
/// tier for the whole dataset) read epoch 1, two thirds of it pushed by
/// nodes 1 and 2; their epoch 2 (other samples for each rank: a fresh
/// shuffle) comes wholly from the tier, no disk read and no push, byte for
/// byte what the same ranks read embedded.
#[test]
fn the_node_tier_keeps_what_other_nodes_pushed() {
    let nodes = Nodes::new(600, 3, 1, 4);
    let _agents: Vec<Agent> = (0..3)
        .map(|i| nodes.agent_with(i, &["--tier-bytes", "64MiB", "--no-mlock"]))
        .collect();
    let world = 2u32;
    let epoch = |e: u64, agent: &str| -> Vec<Child> {
        (0..world)
            .map(|r| spawn_read(&one_epoch(nodes.read_epochs(0, r, world, agent, 1, &[]), e)))
            .collect()
    };
    let first: Vec<_> = epoch(1, "required").into_iter().map(full_report).collect();
    for (r, v) in first.iter().enumerate() {
        let remote = v["cluster"]["remote_samples"].as_u64().unwrap();
        assert!(remote > 100, "rank {r}, epoch 1: {remote} pushed: {v}");
    }
    let second: Vec<_> = epoch(2, "required").into_iter().map(full_report).collect();
    let embedded: Vec<_> = epoch(2, "off").into_iter().map(full_report).collect();
    for r in 0..world as usize {
        let (got, want) = (&second[r], &embedded[r]);
        assert_eq!(got["digest"], want["digest"], "rank {r}, epoch 2");
        assert_eq!(got["samples"], 300);
        assert_eq!(
            got["tier_hits"], 300,
            "rank {r}, epoch 2 from the tier: {got}"
        );
        assert_eq!(got["disk_reads"], 0, "{got}");
        assert_eq!(got["cluster"]["remote_samples"], 0, "{got}");
    }
}

/// The node tier of a node whose ranks are a third of the job's (ranks 0
/// and 1 of 6, `--local-rank`/`--local-world-size` as torchrun's
/// variables would give) holds the samples those ranks read most in the
/// job's epochs, chosen when the first of them attaches: the node's tier
/// hits reach what those counts promise (recomputed here from the sampler,
/// as docs/CACHE.md states the rule), where the members chosen at start
/// (other nodes' samples first, by id) would promise far fewer. Byte-exact
/// against the same ranks embedded.
#[test]
fn the_node_tier_holds_what_the_node_s_ranks_read_most() {
    use kspeed::sampler::{Sampler, SamplerConfig};
    let nodes = Nodes::new(600, 3, 1, 6);
    let space = kspeed::dataset::Space::open(&nodes.spaces[0]).unwrap();
    let cat = space.catalog();
    let slot = |id: u64| (cat.sample(id).len as u64).next_multiple_of(64);
    let budget = (0..cat.len()).map(slot).sum::<u64>() / 4;
    let (world, epochs, from) = (6u32, 5u64, 1u64);
    let mut reads = vec![0u64; cat.len() as usize];
    for r in 0..2 {
        let s = Sampler::new(SamplerConfig::single(cat.len(), 11).rank_world(r, world)).unwrap();
        for e in from..from + epochs {
            for k in 0..s.per_rank() {
                reads[s.sample(e, k) as usize] += 1;
            }
        }
    }
    let remote = |id: u64| space.location(id).is_none();
    // Fills `order` into `bytes`: (bytes used, hits promised).
    let fit = |order: &mut dyn Iterator<Item = u64>, bytes: u64| {
        let (mut used, mut hits) = (0u64, 0u64);
        for id in order {
            if used + slot(id) <= bytes {
                used += slot(id);
                hits += reads[id as usize].saturating_sub(1);
            }
        }
        (used, hits)
    };
    let mut at_start = (0..cat.len())
        .filter(|&id| remote(id))
        .chain((0..cat.len()).filter(|&id| !remote(id)));
    let (capacity, by_id) = fit(&mut at_start, budget);
    let mut by_reads: Vec<u64> = (0..cat.len()).collect();
    by_reads.sort_by_key(|&id| (std::cmp::Reverse(reads[id as usize]), !remote(id), id));
    let (_, promised) = fit(&mut by_reads.into_iter(), capacity);
    assert!(
        promised >= 2 * by_id,
        "reads promise {promised}, the start's members {by_id}"
    );
    let tier = budget.to_string();
    let _agents: Vec<Agent> = (0..3)
        .map(|i| nodes.agent_with(i, &["--tier-bytes", &tier, "--no-mlock"]))
        .collect();
    let run = |agent: &str| -> Vec<serde_json::Value> {
        let kids: Vec<Child> = (0..2u32)
            .map(|r| {
                let rs = r.to_string();
                let local = ["--local-rank", rs.as_str(), "--local-world-size", "2"];
                spawn_read(&nodes.read_epochs(0, r, world, agent, epochs, &local))
            })
            .collect();
        kids.into_iter().map(full_report).collect()
    };
    let attached = run("required");
    let embedded = run("off");
    let mut hits = 0;
    for r in 0..2 {
        assert_eq!(attached[r]["digest"], embedded[r]["digest"], "rank {r}");
        hits += attached[r]["tier_hits"].as_u64().unwrap();
    }
    eprintln!("node tier: {hits} hits of {promised} promised; the start's members {by_id}");
    // Two ranks fill it at once: a read planned while the other's fill of
    // that sample is in flight goes to disk or its owner instead.
    assert!(
        hits <= promised && hits * 10 >= promised * 8,
        "{hits} node tier hits, the counts promise {promised} (the start's members {by_id})"
    );
}

/// An attached rank's waits are charged to what its loader inside the
/// agent waited for, not all to the agent: node 2's agent stopped for a
/// second (SIGSTOP, shorter than the 2 s node timeout: no failover) while
/// node 0's rank reads, and the rank's stall lands in `peers` (node 0's
/// agent waited for node 2's samples), far above `agent`.
#[test]
fn an_attached_rank_s_wait_for_a_stopped_node_is_charged_to_peers() {
    let nodes = Nodes::new(1200, 3, 1, 7);
    // Node 0's agent serves its metrics too: its waits for node 2 show there.
    let agents: Vec<Agent> = (0..3)
        .map(|i| match i {
            0 => nodes.agent_with(0, &["--metrics", "127.0.0.1:0"]),
            _ => nodes.agent(i),
        })
        .collect();
    let metrics_addr = metrics_addr_of(&agents[0]);
    // 20 ms per batch of 16: two epochs take 3 s or more, and the small
    // ring keeps the agent only a few batches ahead of the rank.
    let slow = ["--compute-us", "20000"];
    let rank = spawn_read(&nodes.read_epochs(0, 0, 1, "required", 2, &slow));
    agents[0]
        .log
        .wait_for(&["rank 0 ", "attached"], Duration::from_secs(30));
    signal(&agents[2], "-STOP");
    // The fault's length, not a wait for a condition: node 2 silent for
    // 1 s, then back before the other nodes would judge it gone.
    std::thread::sleep(Duration::from_secs(1));
    signal(&agents[2], "-CONT");
    let v = full_report(rank);
    assert_eq!(v["samples"], 2400, "{v}");
    let c = &v["stall_causes"];
    let secs = |k: &str| c[k].as_f64().unwrap();
    let (peers, agent) = (
        secs("peers_seconds") + secs("failover_seconds"),
        secs("agent_seconds"),
    );
    eprintln!(
        "rank 0 stalled {} s: peers {peers:.3} s, agent {agent:.3} s ({c})",
        v["stall_seconds"]
    );
    assert!(
        peers >= 0.5 && peers > 2.0 * agent,
        "the wait for node 2 is charged to peers: {c}"
    );
    // And to node 2 by name: the agent names, with each batch, the nodes
    // it waited for (segment layout 7), and the rank splits its own wait
    // over them.
    let slowest = &c["slowest_peers"][0];
    assert_eq!(slowest["node"], 2, "{c}");
    assert!(
        slowest["seconds"].as_f64().unwrap() >= 0.5 * peers,
        "node 2 holds most of the rank's wait for peers: {c}"
    );
    // The node's view (its Prometheus metrics): node 2 is the node its
    // agent waited for longest, for about the time it was stopped, with
    // node 2's address as the cluster file gives it; the waits by cause
    // hold it too.
    // The rank has exited: the agent counts it ended once its loop reaps
    // the feeder (within a heartbeat); scrape until then, with a deadline.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let text = loop {
        let text = http_get(&metrics_addr);
        if text.contains("kspeed_agent_ranks_ended_total 1")
            && text.lines().any(|l| l == "kspeed_agent_ranks 0")
        {
            break text;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the rank is not counted ended within 20 s:\n{text}"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let value = |prefix: &str| {
        text.lines()
            .find(|l| l.starts_with(prefix))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or_else(|| panic!("no {prefix} in:\n{text}"))
    };
    let slowest = text
        .lines()
        .find(|l| l.starts_with("kspeed_agent_slowest_node_wait_seconds{"))
        .unwrap_or_else(|| panic!("no slowest node in:\n{text}"));
    let node2 = format!("node=\"2\",addr=\"{}\"", nodes.addrs[2]);
    assert!(slowest.contains(&node2), "{slowest}");
    let node2_s = value(&format!(
        "kspeed_agent_slowest_node_wait_seconds{{{node2}}}"
    ));
    let peers_s = value("kspeed_agent_wait_seconds_total{cause=\"peers\"}")
        + value("kspeed_agent_wait_seconds_total{cause=\"failover\"}");
    eprintln!("node 0's agent waited {node2_s:.3} s for node 2, {peers_s:.3} s for peers");
    for l in text.lines().filter(|l| l.starts_with("kspeed_agent_")) {
        eprintln!("  {l}");
    }
    assert!(
        node2_s >= 0.5 && peers_s >= node2_s * 0.99,
        "node 2 is the node waited for: {text}"
    );
}

/// Three agents (node `metrics_on`'s with `--metrics`) with their links
/// made, a slow rank on node 0 attached and reading two epochs, and node
/// 2's agent then stopped (SIGSTOP): the start of the node-down tests.
struct StoppedNode {
    agents: Vec<Agent>,
    metrics_addr: String,
    /// What the rank reads embedded with every node up.
    want: (u64, String, u64, u64),
    rank: Child,
}

impl StoppedNode {
    fn start(nodes: &Nodes, metrics_on: usize) -> StoppedNode {
        let agents: Vec<Agent> = (0..3)
            .map(|i| {
                if i == metrics_on {
                    nodes.agent_with(i, &["--metrics", "127.0.0.1:0"])
                } else {
                    nodes.agent(i)
                }
            })
            .collect();
        let metrics_addr = metrics_addr_of(&agents[metrics_on]);
        // Every link (node 1's to node 2 too) made before node 2 stops:
        // the agents make them at start.
        for a in &agents {
            wait_open_links(a, 2);
        }
        let want = cluster_report(spawn_read(&nodes.read(0, 0, 1, "off", &[])));
        let slow = ["--compute-us", "20000"];
        let rank = spawn_read(&nodes.read(0, 0, 1, "required", &slow));
        agents[0]
            .log
            .wait_for(&["rank 0 ", "attached"], Duration::from_secs(30));
        signal(&agents[2], "-STOP");
        StoppedNode {
            agents,
            metrics_addr,
            want,
            rank,
        }
    }
}

/// Sends `sig` (`-STOP`, `-CONT`) to agent `a`.
fn signal(a: &Agent, sig: &str) {
    let ok = std::process::Command::new("kill")
        .args([sig, &a.pid().to_string()])
        .status()
        .unwrap();
    assert!(ok.success(), "kill {sig}");
}

/// A node that dies is announced: node 2's agent hangs (SIGSTOP: a host
/// that dies sends nothing) while a rank on node 0 reads from it, so node
/// 0's agent judges it dead by its own clock (2 s of silence with grants
/// outstanding) and its node service sends a node-down notice to the
/// consumers connected to it. Node 1's agent, whose link to node 2 is idle
/// (no rank attached to it: it hears from node 2 only every 5 s, and would
/// judge it dead by its own clock only after 15 s of silence), probes node
/// 2 on the notice and shuts the link when no answer comes; its log names
/// the notice. Node 0's metrics count the notices sent. The rank reads
/// every sample (one copy: node 2's are read from the source files).
#[test]
fn a_node_judged_dead_is_announced_to_the_other_agents() {
    let nodes = Nodes::new(1200, 3, 1, 10);
    let s = StoppedNode::start(&nodes, 0);
    let (agents, metrics_addr, want, rank) = (&s.agents, &s.metrics_addr, &s.want, s.rank);
    let judged = agents[0]
        .log
        .wait_for(&["node 2 (", "is gone (no "], Duration::from_secs(30));
    let told = agents[1].log.wait_for(
        &["node 2 (", "is gone (node 0 reported it down"],
        Duration::from_secs(30),
    );
    eprintln!("node 0: {judged}\nnode 1: {told}");
    let got = cluster_report(rank);
    assert_eq!(
        (got.0, &got.1),
        (want.0, &want.1),
        "rank 0: exact after node 2 stopped"
    );
    let text = http_get(metrics_addr);
    assert!(
        sample_value(&text, "kspeed_serve_node_notices_sent_total") >= 1.0,
        "node 0 sent no notice:\n{text}"
    );
}

/// A notice is a hint, not a verdict: node 2 hangs long enough for node
/// 0, which has grants outstanding on it, to judge it dead and tell node
/// 1, then comes back (SIGCONT) as soon as node 1 has probed it. Node 1's
/// idle link to node 2 hears the answer and stays up; node 1 never shuts
/// it; node 2's metrics count the probe. The rank on node 0 reads every
/// sample.
#[test]
fn a_node_reported_down_that_answers_keeps_its_links() {
    let nodes = Nodes::new(1200, 3, 1, 11);
    let s = StoppedNode::start(&nodes, 2);
    let (agents, metrics_addr, want, rank) = (&s.agents, &s.metrics_addr, &s.want, s.rank);
    agents[1].log.wait_for(
        &[
            "node 2 (",
            "node 0 reported it down",
            "asking it for a heartbeat",
        ],
        Duration::from_secs(30),
    );
    signal(&agents[2], "-CONT");
    let kept = agents[1].log.wait_for(
        &["node 2 (", "answered after node 0's notice; kept"],
        Duration::from_secs(30),
    );
    eprintln!("node 1: {kept}");
    let got = cluster_report(rank);
    assert_eq!(
        (got.0, &got.1),
        (want.0, &want.1),
        "rank 0: exact after node 2 came back"
    );
    let log = agents[1].log.all();
    assert!(
        !log.lines()
            .any(|l| l.contains("node 2 (") && l.contains("is gone")),
        "node 1 kept its link to node 2:\n{log}"
    );
    // Node 2 was asked (and, its link kept, answered): not merely heard
    // beating by chance within the probe's 1.5 s.
    let text = http_get(metrics_addr);
    assert!(
        sample_value(&text, "kspeed_serve_probes_total") >= 1.0,
        "node 2 got no probe:\n{text}"
    );
}

/// A read's whole `--json` report.
fn full_report(child: Child) -> serde_json::Value {
    let o = wait_output(child, Duration::from_secs(120));
    assert!(o.status.success(), "kspeed read failed:\n{}", text(&o));
    serde_json::from_slice(&o.stdout).expect("json report")
}

/// What an agent cannot do is refused at start, by name: a space holding
/// part of the dataset with no node list to read the rest from; a node
/// list or a node service with no token.
#[test]
fn an_agent_without_what_it_needs_is_refused_by_name() {
    let nodes = Nodes::new(60, 2, 1, 3);
    let sock = nodes.socket(0);
    // An agent that started would serve until killed: each run has a
    // deadline.
    let refused = |args: &[&str]| {
        let child = std::process::Command::new(common::kspeed_bin())
            .args(args)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let o = wait_output(child, Duration::from_secs(30));
        assert_eq!(o.status.code(), Some(1), "kspeed {args:?}:\n{}", text(&o));
        text(&o)
    };
    let agent = [
        "agent",
        "--space",
        s(&nodes.spaces[0]),
        "--socket",
        s(&sock),
    ];
    let err = refused(&agent);
    assert!(
        err.contains("holds") && err.contains("--cluster") && err.contains("node0"),
        "{err}"
    );
    let err = refused(&[&agent[..], &["--cluster", s(&nodes.cluster)]].concat());
    assert!(err.contains("--token-file"), "{err}");
    assert!(!Path::new(&sock).exists(), "no socket left behind");
}

/// Over TCP the ranks of a node share its agent's network thread and links
/// (`loader/net/hub.rs`): a rank killed mid-epoch leaves its lane (its
/// grants already given finish into its ring, which the agent still maps)
/// while the other rank of its node reads on over the same links, exact;
/// a rank attaching afterwards joins again and reads exact too.
#[test]
fn a_killed_rank_leaves_the_shared_links_to_the_others() {
    let nodes = Nodes::new(1200, 3, 1, 5);
    let agents: Vec<Agent> = (0..3).map(|i| nodes.agent(i)).collect();
    let world = 6u32;
    let node_of = |r: u32| (r / 2) as usize;
    // Rank 0 computes 100 ms per batch: its 26 batches take seconds.
    let mut victim = spawn_read(&nodes.read(0, 0, world, "required", &["--compute-us", "100000"]));
    let pid = victim.id().to_string();
    agents[0]
        .log
        .wait_for(&["rank 0", &pid, "attached"], Duration::from_secs(30));
    let others: Vec<(u32, Child)> = (1..world)
        .map(|r| {
            (
                r,
                spawn_read(&nodes.read(node_of(r), r, world, "required", &[])),
            )
        })
        .collect();
    victim.kill().unwrap();
    let status = victim.wait().unwrap();
    assert_eq!(status.code(), None, "rank 0 ended before it was killed");
    agents[0]
        .log
        .wait_for(&["rank 0", &pid, "ended"], Duration::from_secs(30));
    let embedded =
        |r: u32| cluster_report(spawn_read(&nodes.read(node_of(r), r, world, "off", &[])));
    for (r, child) in others {
        let got = cluster_report(child);
        let want = embedded(r);
        assert_eq!((got.0, &got.1), (want.0, &want.1), "rank {r}");
        assert_eq!(got.3, 0, "rank {r}: no failover");
    }
    // Node 0's agent serves rank 0 again, exact.
    let again = cluster_report(spawn_read(&nodes.read(0, 0, world, "required", &[])));
    let want = embedded(0);
    assert_eq!((again.0, &again.1), (want.0, &want.1), "rank 0 again");
    for a in &agents {
        let log = a.log.all();
        assert!(
            !log.contains("panicked") && !log.contains("attach refused"),
            "{log}"
        );
    }
}

/// The agents' links are made when they start and kept across jobs: each
/// agent's node service takes one connection from each other agent before
/// any rank attaches, and none more through two jobs (another seed, another
/// world) whose ranks read exactly what embedded ones do. With
/// `KSPEED_AGENT_LINKS=per-job` (a thread per job, as before) the counts
/// grow with each job and this fails.
#[test]
fn the_agents_links_are_made_at_start_and_kept_across_jobs() {
    let nodes = Nodes::new(600, 3, 1, 8);
    let agents: Vec<Agent> = (0..3).map(|i| nodes.agent(i)).collect();
    let made = |a: &Agent| a.log.all().matches(") connected").count();
    let links = |a: &Agent| {
        // One connection open from each other agent's network thread, and
        // its own thread started once.
        wait_open_links(a, 2);
        a.log.wait_count(
            "agent: a network thread with one link to each of the other 2 nodes",
            1,
            Duration::from_secs(60),
        );
    };
    // The connections each node service took before any rank attached
    // (2, or more where a handshake made while a node was still starting
    // was given up and made again).
    let mut at_start = Vec::new();
    for a in &agents {
        links(a);
        assert!(
            !a.log.all().contains(") attached"),
            "no rank attached yet:\n{}",
            a.log.all()
        );
        at_start.push(made(a));
    }
    // Job 1: a rank per node, two epochs; job 2: two ranks per node, one.
    let jobs: [(u32, u64); 2] = [(3, 2), (6, 1)];
    let mut results = Vec::new();
    let mut ended = 0;
    for (world, epochs) in jobs {
        let per_node = world / 3;
        let node_of = |r: u32| (r / per_node) as usize;
        let ranks: Vec<Child> = (0..world)
            .map(|r| spawn_read(&nodes.read_epochs(node_of(r), r, world, "required", epochs, &[])))
            .collect();
        let got: Vec<_> = ranks.into_iter().map(cluster_report).collect();
        // Its ranks left their lanes: without kept links, their threads
        // would close and the next job connect again.
        ended += per_node as usize;
        for (a, &before) in agents.iter().zip(&at_start) {
            a.log.wait_count(") ended", ended, Duration::from_secs(30));
            links(a);
            assert_eq!(made(a), before, "no new connection:\n{}", a.log.all());
        }
        results.push((world, epochs, got));
    }
    // Embedded ranks (connecting to the node services themselves) last.
    for (world, epochs, got) in results {
        let node_of = |r: u32| (r / (world / 3)) as usize;
        for r in 0..world {
            let off = nodes.read_epochs(node_of(r), r, world, "off", epochs, &[]);
            let want = cluster_report(spawn_read(&off));
            let got = &got[r as usize];
            assert_eq!((got.0, &got.1), (want.0, &want.1), "rank {r} of {world}");
            assert_eq!(got.3, 0, "rank {r} of {world}: no failover");
        }
    }
}

/// An agent whose links were made while the other nodes were not up yet
/// (each such link dead from its start, dialled again with a back-off of
/// up to 30 s) dials them again at once when a rank attaches, and the
/// rank's samples that only those nodes hold (no source to read them from)
/// wait for them: a rank attached while they are down reads, once they
/// start, exactly what an embedded one does, with no failover. Without the
/// redial at the join, those samples fail at once (`SampleUnavailable`).
#[test]
fn links_down_at_the_agent_s_start_are_dialled_when_a_rank_attaches() {
    let nodes = Nodes::new(600, 3, 1, 9);
    // No source to read a sample from instead: one whose holder is taken
    // for gone fails (SampleUnavailable) unless the rank waits for it.
    let src = nodes.dir.path().join("src");
    std::fs::rename(&src, src.with_extension("gone")).unwrap();
    let first = nodes.agent(0);
    // Its links are made (the other two refused, dead) before they start.
    first.log.wait_count(
        "agent: network thread 0's links kept while the agent runs",
        1,
        Duration::from_secs(60),
    );
    assert!(!first.log.all().contains(") connected"));
    // The rank attaches with nodes 1 and 2 still down; they start after.
    let rank = spawn_read(&nodes.read(0, 0, 3, "required", &[]));
    let pid = rank.id().to_string();
    first
        .log
        .wait_for(&["rank 0", &pid, "attached"], Duration::from_secs(30));
    let _others: Vec<Agent> = (1..3).map(|i| nodes.agent(i)).collect();
    let got = full_report(rank);
    let want = full_report(spawn_read(&nodes.read(0, 0, 3, "off", &[])));
    assert_eq!(
        (&got["samples"], &got["digest"]),
        (&want["samples"], &want["digest"])
    );
    let c = &got["cluster"];
    assert!(c["remote_samples"].as_u64().unwrap() > 0, "{got}");
    assert_eq!(c["source_reads"].as_u64(), Some(0), "{got}");
    assert_eq!(c["failovers"].as_u64(), Some(0), "{got}");
}
