//! Stall charged to its cause on one node: a loader reading its space
//! charges every wait to the disk, one serving from its memory tier to the
//! tier, and the causes always add up to the whole stall; `kspeed read
//! --json` reports them; over 3 nodes in network namespaces, the node
//! behind a slow link is charged the rank's waits. (A stopped peer's
//! share: tests/cluster.rs, `stalled_owner_times_out_and_fails_over`; the
//! agent's: tests/agent.rs.)

mod agent_support;
mod common;
#[path = "common/nodes.rs"]
mod nodes;

use std::path::PathBuf;
use std::time::Duration;

use common::*;
use kspeed::loader::{FaultConfig, LoaderBuilder, Stats};

fn sum(st: &Stats) -> Duration {
    let c = st.stall_causes;
    c.disk + c.tier + c.source + c.peers + c.failover + c.agent
}

#[test]
fn a_local_loader_charges_its_waits_to_the_disk_then_the_tier() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src");
    gen("tiny", 2000, &src);
    let sp = dir.path().join("space");
    ok(&["preload", "--source", s(&src), "--space", s(&sp)]);
    let mut loader = LoaderBuilder::space(&sp)
        .batch_size(16)
        .seed(3)
        .landing(test_ring(1 << 20))
        .page_cache(kspeed::loader::PageCache::Off)
        .tier_bytes(64 << 20)
        // Completions held back now and then: waits on the disk.
        .fault_injection(FaultConfig::default().seed(9).delay_ppm(200_000))
        .build()
        .unwrap();
    // Epoch 0 reads every sample from disk (and fills the tier).
    loader.set_epoch(0).unwrap();
    while loader.next_batch().unwrap().is_some() {}
    let st = loader.stats();
    let c = st.stall_causes;
    assert_eq!(sum(&st), st.stall, "{c:?}");
    assert_eq!(c.disk, st.stall, "epoch 0 reads only from disk: {c:?}");
    // Epoch 1 comes from the tier alone: whatever it waits is the tier's.
    loader.set_epoch(1).unwrap();
    while loader.next_batch().unwrap().is_some() {}
    let st1 = loader.stats();
    let c1 = st1.stall_causes;
    assert_eq!(sum(&st1), st1.stall, "{c1:?}");
    // A member whose fill by epoch 0's read-ahead was still in flight at
    // the restart is read from disk again (rarely): only then may epoch 1
    // charge the disk.
    let new_reads = st1.disk_reads - st.disk_reads;
    assert!(new_reads < 20, "{new_reads} disk reads in epoch 1: {st1:?}");
    if new_reads == 0 {
        assert_eq!(c1.disk, c.disk, "epoch 1 read nothing from disk: {c1:?}");
        assert_eq!(c1.tier, st1.stall - st.stall, "{c1:?}");
    }
    assert!(st1.tier_hits >= 1900, "{st1:?}");
    assert!(c1.slowest_peers.iter().all(|p| p.waits == 0));
    assert!(loader.stall_by_peer().is_empty());
}

/// `kspeed read --json` has the causes, in seconds, adding up to
/// `stall_seconds`; with `--compute-us 0` on a cold space a rank waits.
#[test]
fn kspeed_read_json_reports_the_causes() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src");
    gen("tiny", 1000, &src);
    let sp = dir.path().join("space");
    ok(&["preload", "--source", s(&src), "--space", s(&sp)]);
    let out = ok(&[
        "read",
        "--json",
        "--space",
        s(&sp),
        "--ring-bytes",
        "1MiB",
        "--page-cache",
        "off",
    ]);
    let v: serde_json::Value = serde_json::from_str(&out).expect("json");
    let c = &v["stall_causes"];
    let f = |k: &str| c[k].as_f64().unwrap_or_else(|| panic!("{k} in {c}"));
    let total: f64 = [
        "disk_seconds",
        "tier_seconds",
        "source_seconds",
        "peers_seconds",
        "failover_seconds",
        "agent_seconds",
    ]
    .iter()
    .map(|k| f(k))
    .sum();
    let stall = v["stall_seconds"].as_f64().unwrap();
    assert!((total - stall).abs() < 1e-6, "{c} against {stall}");
    assert!((f("disk_seconds") - stall).abs() < 1e-6, "{c}");
    assert_eq!(c["slowest_peers"].as_array().unwrap().len(), 0, "{c}");
}

const NODES: usize = 3;

/// `samples` tiny samples, their catalog, and the spaces of `NODES` nodes
/// that hold one copy of each.
fn three_spaces(tmp: &std::path::Path, samples: u64) -> (PathBuf, Vec<PathBuf>) {
    let src = tmp.join("src");
    gen("tiny", samples, &src);
    let catalog = tmp.join("cat.ksc");
    ok(&["catalog", "--source", s(&src), "--out", s(&catalog)]);
    let spaces = (0..NODES)
        .map(|i| {
            let sp = tmp.join(format!("node{i}"));
            let i = i.to_string();
            ok(&[
                "preload",
                "--source",
                s(&src),
                "--catalog",
                s(&catalog),
                "--space",
                s(&sp),
                "--nodes",
                "3",
                "--node-index",
                &i,
            ]);
            sp
        })
        .collect();
    (catalog, spaces)
}

/// A `kspeed serve` per space, each in its node's namespace.
fn serve_all(tmp: &std::path::Path, spaces: &[PathBuf], ns: &nodes::Netns) -> Vec<nodes::Serve> {
    serve_nodes(tmp, spaces, ns, 0..NODES)
}

/// A `kspeed serve` for each node of `which`, in its node's namespace;
/// the token in `tmp/token`.
fn serve_nodes(
    tmp: &std::path::Path,
    spaces: &[PathBuf],
    ns: &nodes::Netns,
    which: std::ops::Range<usize>,
) -> Vec<nodes::Serve> {
    let token = tmp.join("token");
    std::fs::write(&token, "stall-token\n").unwrap();
    which
        .map(|i| {
            nodes::Serve::start(
                &spaces[i],
                &format!("10.77.{i}.2:0"),
                &token,
                Some(&ns.names[i]),
            )
        })
        .collect()
}

/// 900 tiny samples on [`NODES`] nodes in network namespaces, node 2's
/// link throttled to 4 Mbit/s (a token bucket): (catalog, spaces, the
/// namespaces), or None with a skip.
fn behind_a_slow_link(tmp: &std::path::Path) -> Option<(PathBuf, Vec<PathBuf>, nodes::Netns)> {
    let (catalog, spaces) = three_spaces(tmp, 900);
    let ns = nodes::Netns::create(NODES)?;
    ns.throttle(2, "4mbit").then_some((catalog, spaces, ns))
}

/// Rank 0 of 1 on node 0 (holding `space`), its epoch 0 alone.
fn rank_on_node_0(space: &std::path::Path, addrs: &[String]) -> kspeed::loader::Loader {
    LoaderBuilder::space(space)
        .cluster(nodes::cluster_of(addrs))
        .token(b"stall-token")
        .seed(4)
        .batch_size(8)
        .landing(test_ring(1 << 20))
        .end_epoch(Some(1))
        .build()
        .unwrap()
}

/// Three nodes in network namespaces, one copy of each sample; node 2's
/// link is throttled (a token bucket, 4 Mbit/s). A rank on node 0 waits
/// mostly for node 2's samples: node 2 leads the slowest peers with more
/// stall than node 1, `peers` holds it, nothing fails over, and the
/// causes add up to the whole stall. Every sample arrives, byte-exact.
#[test]
fn the_node_behind_a_slow_link_is_charged_the_wait() {
    let tmp = tempfile::tempdir().unwrap();
    let Some((catalog, spaces, ns)) = behind_a_slow_link(tmp.path()) else {
        return;
    };
    let serves = serve_all(tmp.path(), &spaces, &ns);
    let addrs: Vec<String> = serves.iter().map(|sv| sv.addr.clone()).collect();
    let cat = kspeed::dataset::Catalog::open(&catalog).unwrap();
    let mut l = rank_on_node_0(&spaces[0], &addrs);
    let sampler =
        kspeed::sampler::Sampler::new(kspeed::sampler::SamplerConfig::single(cat.len(), 4))
            .unwrap();
    l.set_epoch(0).unwrap();
    let mut k = 0u64;
    while let Some(b) = l.next_batch().unwrap() {
        for smp in b.iter() {
            assert_eq!(smp.id, sampler.sample(0, k), "step {k}");
            assert_eq!(crc32c::crc32c(smp.bytes), cat.sample(smp.id).crc32c);
            k += 1;
        }
    }
    assert_eq!(k, cat.len());
    let st = l.stats();
    let c = st.stall_causes;
    assert_eq!(sum(&st), st.stall, "{c:?}");
    assert_eq!(st.failovers, 0, "{st:?}");
    assert_eq!(c.failover, Duration::ZERO, "{c:?}");
    let by = l.stall_by_peer();
    let of = |n: u32| {
        by.iter()
            .find(|p| p.node == n)
            .map_or(Duration::ZERO, |p| p.stall)
    };
    eprintln!("stall {:?}: {c:?}; by peer {by:?}", st.stall);
    assert_eq!(c.slowest_peers[0].node, 2, "{c:?}");
    assert!(of(2) > 2 * of(1), "node 2 {:?}, node 1 {:?}", of(2), of(1));
    // Node 2 serves about 300 samples of ~4.5 KiB at 4 Mbit/s: over 2 s.
    assert!(of(2) > Duration::from_secs(1), "{c:?}");
    assert_eq!(of(2) + of(1), c.peers, "{by:?}");
    // Its DATA frames carry its times (TCP): the wait is split, and most
    // of it is the link's, not its disk's or its sending.
    let p2 = by.iter().find(|p| p.node == 2).unwrap();
    assert!(p2.link > 2 * (p2.read + p2.send), "{p2:?}");
    assert!(
        p2.read + p2.send + p2.link > p2.stall * 9 / 10,
        "split: {p2:?}"
    );
    assert_eq!(c.peer_link + c.peer_read + c.peer_send, split_sum(&by));
}

/// The same slow link, the rank attached to its node's agent: node 0 is
/// a `kspeed agent` (its consumer side only), nodes 1 and 2 `kspeed
/// serve` in namespaces, node 2's link throttled to 4 Mbit/s. The rank's
/// epoch is the embedded rank's byte for byte, and its stall is split as
/// an embedded rank's is: charged to node 2 by name, and, from the times
/// node 2 reports in its DATA headers (which the agent's loader splits and
/// sends with each batch: segment layout 8's extra words), mostly to the
/// link; the phases never sum past the peers' share.
#[test]
fn an_attached_rank_behind_a_slow_link_charges_the_link() {
    let tmp = tempfile::tempdir().unwrap();
    let Some((_catalog, spaces, ns)) = behind_a_slow_link(tmp.path()) else {
        return;
    };
    let serves = serve_nodes(tmp.path(), &spaces, &ns, 1..NODES);
    let token = tmp.path().join("token");
    // Node 0 is the agent, which listens nowhere: nobody dials it.
    let mut addrs = vec!["127.0.0.1:9".to_string()];
    addrs.extend(serves.iter().map(|sv| sv.addr.clone()));
    let cluster = tmp.path().join("cluster");
    std::fs::write(&cluster, nodes::cluster_text(&addrs)).unwrap();
    let sock = tmp.path().join("agent.sock");
    let _agent = agent_support::Agent::start(
        &spaces[0],
        &sock,
        &["--cluster", s(&cluster), "--token-file", s(&token)],
    );
    let read = |more: &[&str]| {
        let mut args = vec![
            "read",
            "--json",
            "--digest",
            "--progress=none",
            "--space",
            s(&spaces[0]),
            "--seed",
            "4",
            "--batch-size",
            "8",
            "--ring-bytes",
            "1MiB",
            "--epochs",
            "1",
            "--cluster",
            s(&cluster),
        ];
        args.extend(more);
        let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        let o =
            agent_support::wait_output(agent_support::spawn_read(&args), Duration::from_secs(120));
        assert!(o.status.success(), "{}", text(&o));
        serde_json::from_slice::<serde_json::Value>(&o.stdout).expect("json report")
    };
    let v = read(&["--agent", "required", "--agent-socket", s(&sock)]);
    let embedded = read(&["--agent", "off", "--token-file", s(&token)]);
    assert_eq!(v["samples"], 900, "{v}");
    assert_eq!(v["digest"], embedded["digest"], "attached against embedded");
    let c = &v["stall_causes"];
    let secs =
        |o: &serde_json::Value, k: &str| o[k].as_f64().unwrap_or_else(|| panic!("{k} in {o}"));
    eprintln!("attached rank: {c}");
    let top = &c["slowest_peers"][0];
    assert_eq!(top["node"], 2, "{c}");
    let (stall, read_s, send_s, link_s) = (
        secs(top, "seconds"),
        secs(top, "read_seconds"),
        secs(top, "send_seconds"),
        secs(top, "link_seconds"),
    );
    // About 300 samples of ~4.5 KiB at 4 Mbit/s: over 2 s from node 2.
    assert!(stall > 1.0, "{c}");
    assert!(link_s > 2.0 * (read_s + send_s), "node 2: {top}");
    assert!(
        read_s + send_s + link_s > 0.8 * stall,
        "node 2 split: {top}"
    );
    let phases =
        secs(c, "peer_read_seconds") + secs(c, "peer_send_seconds") + secs(c, "peer_link_seconds");
    assert!(
        phases >= read_s + send_s + link_s - 1e-3 && phases <= secs(c, "peers_seconds") + 1e-6,
        "the phases within the peers' share: {c}"
    );
}

fn split_sum(by: &[kspeed::loader::PeerStall]) -> Duration {
    by.iter().map(|p| p.read + p.send + p.link).sum()
}

/// A blkio/io cgroup that throttles reads of one block device to `iops`,
/// removed on drop. None (and a skip) where the device or the controller
/// is not there.
struct Throttle {
    dir: std::path::PathBuf,
}

impl Throttle {
    fn reads(of: &std::path::Path, iops: u32) -> Option<Throttle> {
        use std::os::unix::fs::MetadataExt;
        let dev = std::fs::metadata(of).unwrap().dev();
        let (maj, min) = (libc::major(dev), libc::minor(dev));
        let sys = std::path::PathBuf::from(format!("/sys/dev/block/{maj}:{min}"));
        if !sys.exists() {
            skip(&format!(
                "{} is on device {maj}:{min}, not a block device: no disk to throttle",
                of.display()
            ));
            return None;
        }
        // Throttling applies to whole disks: a partition's parent.
        let disk = if sys.join("partition").exists() {
            std::fs::read_to_string(sys.join("../dev"))
                .unwrap()
                .trim()
                .to_string()
        } else {
            format!("{maj}:{min}")
        };
        let name = format!("kspeed-test-{}", std::process::id());
        let v1 = std::path::Path::new("/sys/fs/cgroup/blkio");
        let v2 = std::path::Path::new("/sys/fs/cgroup");
        let (dir, file, rule) = if v1.join("blkio.throttle.read_iops_device").exists() {
            (
                v1.join(&name),
                "blkio.throttle.read_iops_device",
                format!("{disk} {iops}"),
            )
        } else if std::fs::read_to_string(v2.join("cgroup.controllers"))
            .is_ok_and(|c| c.split_whitespace().any(|w| w == "io"))
        {
            let _ = std::fs::write(v2.join("cgroup.subtree_control"), "+io");
            (v2.join(&name), "io.max", format!("{disk} riops={iops}"))
        } else {
            skip("no blkio (cgroup v1) or io (cgroup v2) controller to throttle a disk with");
            return None;
        };
        if let Err(e) = std::fs::create_dir(&dir) {
            skip(&format!("creating cgroup {}: {e}", dir.display()));
            return None;
        }
        let t = Throttle { dir };
        if let Err(e) = std::fs::write(t.dir.join(file), &rule) {
            skip(&format!("{} < {rule}: {e}", t.dir.join(file).display()));
            return None;
        }
        Some(t)
    }

    /// Moves process `pid`, every thread of it, into the cgroup.
    fn add(&self, pid: u32) {
        std::fs::write(self.dir.join("cgroup.procs"), pid.to_string()).unwrap();
    }
}

impl Drop for Throttle {
    fn drop(&mut self) {
        // Its processes have exited (or are killed) by now; a cgroup with
        // none left is removed with rmdir, retried while the last exits.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while std::fs::remove_dir(&self.dir).is_err() && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// Three nodes in network namespaces, one copy of each sample; node 2's
/// disk is throttled to 100 reads a second (a blkio cgroup around its
/// `kspeed serve`, a real throttle in the kernel's block layer). The
/// rank on node 0 charges node 2 the most stall, and node 2's DATA frames
/// say it went to reading: its share is mostly `read`, not its link.
#[test]
fn the_node_with_a_slow_disk_is_charged_for_reading() {
    let tmp = tempfile::tempdir().unwrap();
    let (catalog, spaces) = three_spaces(tmp.path(), 600);
    let Some(ns) = nodes::Netns::create(NODES) else {
        return;
    };
    let Some(throttle) = Throttle::reads(&spaces[2], 100) else {
        return;
    };
    // The node reads into staging with O_DIRECT (no `--page-cache`):
    // every read goes to the throttled disk.
    let serves = serve_all(tmp.path(), &spaces, &ns);
    throttle.add(serves[2].child.id());
    let addrs: Vec<String> = serves.iter().map(|sv| sv.addr.clone()).collect();
    let cat = kspeed::dataset::Catalog::open(&catalog).unwrap();
    let mut l = rank_on_node_0(&spaces[0], &addrs);
    l.set_epoch(0).unwrap();
    let mut k = 0u64;
    while let Some(b) = l.next_batch().unwrap() {
        for smp in b.iter() {
            assert_eq!(crc32c::crc32c(smp.bytes), cat.sample(smp.id).crc32c);
            k += 1;
        }
    }
    assert_eq!(k, cat.len());
    let st = l.stats();
    let c = st.stall_causes;
    let by = l.stall_by_peer();
    eprintln!("stall {:?}: {c:?}; by peer {by:?}", st.stall);
    assert_eq!(sum(&st), st.stall, "{c:?}");
    assert_eq!(st.failovers, 0, "{st:?}");
    assert_eq!(c.slowest_peers[0].node, 2, "{c:?}");
    let p2 = by.iter().find(|p| p.node == 2).unwrap();
    // About 200 reads at 100 a second: well over a second, nearly all of
    // it reading.
    assert!(p2.stall > Duration::from_secs(1), "{p2:?}");
    assert!(p2.read > 2 * (p2.send + p2.link), "{p2:?}");
    assert!(
        p2.read + p2.send + p2.link > p2.stall * 9 / 10,
        "split: {p2:?}"
    );
    assert_eq!(c.peer_link + c.peer_read + c.peer_send, split_sum(&by));
}
