//! A cluster that changes size, and nodes that come back (issue 29 part 3),
//! with real `kspeed serve` and `kspeed rebalance` processes:
//!
//! - 3 -> 4 -> 2 nodes with 2 copies, the node services in network
//!   namespaces serving the old layout while every node stages from them;
//!   after each commit every sample is read back through the new layout
//!   (source hidden) and checked, and each node copied exactly the bytes
//!   the placement model says (the samples it holds now and did not);
//! - a staging killed mid-way resumes, and a rerun copies nothing;
//! - a node service killed and restarted twice in one epoch, with one copy
//!   and no source: the epoch completes exactly;
//! - a node that comes back with another layout or another token is
//!   refused by name.
//!
//! (Why this file is over ~800 lines: the scenarios share one harness of
//! namespaced node processes, spaces and read-back checks, which is half
//! the file; split, each part would need all of it.)

mod common;
#[path = "common/nodes.rs"]
mod nodes;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use kspeed::dataset::{
    self, Catalog, Fetch, OwnerFn, Placement, PreloadOptions, RebalanceOptions, SourceFetch, Space,
};
use kspeed::loader::{Loader, LoaderBuilder};
use kspeed::sampler::{Sampler, SamplerConfig};
use kspeed::Error;
use nodes::{cluster_of, Netns, Serve};

const TOKEN: &str = "job-29-token";

/// `KSPEED_TEST_RDMA=1` (scripts/vm_rdma_tests.sh in the soft-RoCE VM,
/// which puts 10.77.0.1-3 on the RDMA interface): the node services offer
/// RDMA, the consumers use it, and node i listens on 10.77.0.(i+1). Only
/// the tests that need no namespace use it.
fn rdma_mode() -> bool {
    std::env::var_os("KSPEED_TEST_RDMA").is_some()
}

/// The address node `i` listens on outside namespaces.
fn node_ip(i: usize) -> String {
    if rdma_mode() {
        format!("10.77.0.{}", i + 1)
    } else {
        format!("127.0.0.{}", i + 1)
    }
}

struct Setup {
    tmp: tempfile::TempDir,
    src: PathBuf,
    catalog: PathBuf,
    token: PathBuf,
}

impl Setup {
    fn space(&self, i: u32) -> PathBuf {
        self.tmp.path().join(format!("node{i}"))
    }

    /// Hides the source, so every sample must come from a node.
    fn hide_source(&self) {
        std::fs::rename(&self.src, self.src.with_extension("gone")).unwrap();
    }
}

/// `count` generated samples of `profile`, preloaded onto `nodes` spaces.
fn setup(profile: &str, count: u64, nodes: u32, replicas: u32) -> Setup {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    gen(profile, count, &src);
    let catalog = tmp.path().join("cat.ksc");
    ok(&["catalog", "--source", s(&src), "--out", s(&catalog)]);
    let token = tmp.path().join("token");
    std::fs::write(&token, format!("{TOKEN}\n")).unwrap();
    let st = Setup {
        tmp,
        src,
        catalog,
        token,
    };
    for i in 0..nodes {
        ok(&[
            "preload",
            "--source",
            s(&st.src),
            "--catalog",
            s(&st.catalog),
            "--space",
            s(&st.space(i)),
            "--nodes",
            &nodes.to_string(),
            "--node-index",
            &i.to_string(),
            "--replicas",
            &replicas.to_string(),
        ]);
    }
    st
}

fn consumer(space: &Path, addrs: &[String], ring_bytes: u64) -> Loader {
    LoaderBuilder::space(space)
        .cluster(cluster_of(addrs))
        .token(TOKEN.as_bytes())
        .seed(3)
        .batch_size(16)
        .pollers(1)
        .pin(false)
        .landing(test_ring(ring_bytes))
        .rdma(rdma_mode().then(Default::default))
        .build()
        .unwrap()
}

/// Reads epoch `e` and checks every sample's id (against an independent
/// sampler) and bytes (CRC32C against the catalog); `between(k)` runs after
/// batch `k`.
fn read_epoch(
    l: &mut Loader,
    cat: &Catalog,
    e: u64,
    mut between: impl FnMut(u64),
) -> Result<u64, Error> {
    let sampler = Sampler::new(
        SamplerConfig::single(cat.len(), 3)
            .rank_world(0, 1)
            .shuffle(true)
            .drop_last(false),
    )
    .unwrap();
    l.set_epoch(e)?;
    let (mut k, mut batches) = (0u64, 0u64);
    while let Some(b) = l.next_batch()? {
        for smp in b.iter() {
            assert_eq!(smp.id, sampler.sample(e, k), "epoch {e} step {k}");
            let c = cat.sample(smp.id);
            assert_eq!(smp.bytes.len(), c.len as usize, "sample {}", smp.id);
            assert_eq!(crc32c::crc32c(smp.bytes), c.crc32c, "sample {}", smp.id);
            k += 1;
        }
        drop(b);
        between(batches);
        batches += 1;
    }
    assert_eq!(k, sampler.per_rank(), "every sample of epoch {e}, once");
    Ok(k)
}

/// The model: the samples and bytes node `node` holds under `to` and did
/// not under `from` (what it must copy).
fn arriving(cat: &Catalog, from: Placement, to: Placement, node: u32) -> (u64, u64) {
    let (mut n, mut b) = (0, 0);
    for id in 0..cat.len() {
        if to.holds(node, id) && !(node < from.nodes && from.holds(node, id)) {
            n += 1;
            b += cat.sample(id).len as u64;
        }
    }
    (n, b)
}

/// The `rebalance:` line's `key=value` fields.
fn fields(out: &str) -> std::collections::HashMap<String, String> {
    let line = out
        .lines()
        .find(|l| l.starts_with("rebalance: "))
        .unwrap_or_else(|| panic!("no rebalance line in {out}"));
    line["rebalance: ".len()..]
        .split(' ')
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn num(f: &std::collections::HashMap<String, String>, k: &str) -> u64 {
    f[k].parse().unwrap()
}

/// Checks that node `i`'s space holds exactly its share under `p` and that
/// every held sample reads back intact.
fn check_space(dir: &Path, p: Placement, i: u32) {
    let space = Space::open(dir).unwrap();
    assert_eq!(space.params().placement, p);
    let cat = space.catalog();
    for id in 0..cat.len() {
        assert_eq!(
            space.location(id).is_some(),
            p.holds(i, id),
            "node {i} sample {id}"
        );
    }
    space.check_extents().unwrap();
    let v = space
        .verify(1, kspeed::progress::ProgressMode::Quiet)
        .unwrap();
    assert_eq!(v.bad_count(), 0, "node {i}: {:?}", v.bad);
    assert_eq!(v.checked, space.held_samples());
}

/// Stages node `i` to `nodes` nodes from `peers`; returns the fields.
fn stage(st: &Setup, i: u32, nodes: u32, peers: &[String], new: bool) -> (String, u64, u64) {
    let space = st.space(i);
    let mut args = vec![
        "rebalance".to_string(),
        "--space".into(),
        s(&space).into(),
        "--nodes".into(),
        nodes.to_string(),
        "--peers".into(),
        peers.join(","),
        "--token-file".into(),
        s(&st.token).into(),
    ];
    if new {
        args.extend([
            "--catalog".into(),
            s(&st.catalog).into(),
            "--node-index".into(),
            i.to_string(),
        ]);
    }
    let a: Vec<&str> = args.iter().map(|x| x.as_str()).collect();
    let out = ok(&a);
    let f = fields(&out);
    assert_eq!(f["staged"], "true", "{out}");
    assert_eq!(f["committed"], "false", "{out}");
    (out, num(&f, "copied_samples"), num(&f, "copied_bytes"))
}

/// Commits node `i`; returns (samples copied, bytes punched out).
fn commit(st: &Setup, i: u32, nodes: u32) -> (u64, u64) {
    let out = ok(&[
        "rebalance",
        "--space",
        s(&st.space(i)),
        "--nodes",
        &nodes.to_string(),
        "--commit",
    ]);
    let f = fields(&out);
    assert_eq!(f["committed"], "true", "{out}");
    (num(&f, "copied_samples"), num(&f, "reclaimed_bytes"))
}

#[test]
fn three_to_four_to_two_nodes_with_replicas_in_network_namespaces() {
    if !is_root() || Command::new("ip").arg("-V").output().is_err() {
        skip("needs root and iproute2 to create network namespaces");
        return;
    }
    let st = setup("tiny", 3000, 3, 2);
    let cat = Catalog::open(&st.catalog).unwrap();
    st.hide_source();
    let Some(ns) = Netns::create(4) else {
        return;
    };
    let serve = |i: u32| {
        Serve::start(
            &st.space(i),
            &format!("10.77.{i}.2:0"),
            &st.token,
            Some(&ns.names[i as usize]),
        )
    };
    let total_copies: u64 = cat.total_bytes() * 2;
    let mut moved = Vec::new();
    for (from, to) in [(3u32, 4u32), (4, 2)] {
        let (pf, pt) = (
            Placement::new(from, 2).unwrap(),
            Placement::new(to, 2).unwrap(),
        );
        // The old layout serves while every node of the new one stages.
        let serves: Vec<Serve> = (0..from).map(serve).collect();
        let addrs: Vec<String> = serves.iter().map(|s| s.addr.clone()).collect();
        let t0 = Instant::now();
        let mut bytes = 0;
        for i in 0..to {
            let (out, n, b) = stage(&st, i, to, &addrs, i >= from);
            assert!(out.contains("2 copies"), "{out}");
            let (want_n, want_b) = arriving(&cat, pf, pt, i);
            assert_eq!((n, b), (want_n, want_b), "node {i} {from}->{to}: {out}");
            bytes += b;
            // Staged: a rerun copies nothing.
            let (out, n, _) = stage(&st, i, to, &addrs, i >= from);
            assert_eq!(n, 0, "{out}");
            assert!(out.contains("already staged"), "{out}");
        }
        let staged_s = t0.elapsed().as_secs_f64();
        // Every node staged: stop, commit, serve the new layout.
        drop(serves);
        for i in 0..to {
            let dropped = (0..cat.len()).any(|id| pf.holds(i, id) && !pt.holds(i, id));
            let (copied, punched) = commit(&st, i, to);
            assert_eq!(copied, 0);
            // What the node gave up is punched out (and the ranges an
            // earlier resize left, again); what it kept reads back intact
            // (check_space verifies every held sample).
            assert!(punched > 0 || !dropped, "node {i} {from}->{to}");
            check_space(&st.space(i), pt, i);
        }
        for i in to..from {
            ok(&["unload", "--space", s(&st.space(i))]);
        }
        let min = total_copies as f64 * from.abs_diff(to) as f64 / from.max(to) as f64;
        eprintln!(
            "{from} -> {to} nodes: moved {bytes} of {total_copies} bytes ({:.2}%; the minimum {:.2}%), staged in {staged_s:.2} s",
            100.0 * bytes as f64 / total_copies as f64,
            100.0 * min / total_copies as f64
        );
        // Consecutive replicas cost at most one more wrapped copy per sample.
        assert!(
            (bytes as f64) < min * 1.75,
            "{from}->{to}: {bytes} vs {min}"
        );
        moved.push(bytes);
        let serves: Vec<Serve> = (0..to).map(serve).collect();
        let addrs: Vec<String> = serves.iter().map(|s| s.addr.clone()).collect();
        let mut l = consumer(&st.space(0), &addrs, 4 << 20);
        assert_eq!(read_epoch(&mut l, &cat, 0, |_| {}).unwrap(), cat.len());
        let stats = l.finish();
        assert_eq!(stats.source_reads, 0, "{stats:?}");
        drop(serves);
    }
    // A rerun after the commit finds the layout in place.
    let out = ok(&["rebalance", "--space", s(&st.space(0)), "--nodes", "2"]);
    assert!(out.contains("nothing copied"), "{out}");
    eprintln!("moved bytes per resize: {moved:?}");
}

/// A fetch from the source that fails (as a crash would stop it) after
/// `left` samples.
struct Crashing {
    inner: SourceFetch,
    left: u64,
}

impl Fetch for Crashing {
    fn fetch(
        &mut self,
        want: &[(u64, u32)],
        put: &mut dyn FnMut(u64, &[u8]) -> kspeed::Result<()>,
    ) -> kspeed::Result<()> {
        let mut buf = Vec::new();
        for &(id, _) in want {
            if self.left == 0 {
                return Err(Error::InvalidConfig("crashed".into()));
            }
            self.left -= 1;
            self.inner.read(id, &mut buf)?;
            put(id, &buf)?;
        }
        Ok(())
    }
}

#[test]
fn staging_stopped_mid_way_resumes_and_a_rerun_copies_nothing() {
    // Node 0 of 3 going to 2 nodes takes half of node 2's samples.
    let st = setup("tiny", 4000, 3, 1);
    let cat = Catalog::open(&st.catalog).unwrap();
    let (from, to) = (Placement::new(3, 1).unwrap(), Placement::new(2, 1).unwrap());
    let (want_n, want_b) = arriving(&cat, from, to, 0);
    assert!(want_n > 600, "{want_n}");
    let opts = RebalanceOptions::new(to, 0).checkpoint_bytes(4096);
    let mut crash = Crashing {
        inner: SourceFetch::new(&cat).unwrap(),
        left: 300,
    };
    let e = dataset::rebalance(&st.space(0), &opts, &mut crash).unwrap_err();
    assert!(e.to_string().contains("crashed"), "{e}");
    // The old layout is untouched and still complete.
    check_space(&st.space(0), from, 0);
    let mut src = SourceFetch::new(&cat).unwrap();
    let r = dataset::rebalance(&st.space(0), &opts, &mut src).unwrap();
    let at = r.resumed_at.expect("resumed");
    assert!(at > 0, "{r:?}");
    assert!(r.copied_samples < want_n, "{r:?}");
    assert_eq!(r.arriving_samples, want_n);
    assert_eq!(r.arriving_bytes, want_b);
    assert!(r.staged && !r.committed);
    let r = dataset::rebalance(&st.space(0), &opts.clone().commit(true), &mut src).unwrap();
    assert!(
        r.already_staged && r.committed && r.copied_samples == 0,
        "{r:?}"
    );
    check_space(&st.space(0), to, 0);
    // The punched ranges are the samples node 0 gave up.
    let dropped: u64 = (0..cat.len())
        .filter(|&id| from.holds(0, id) && !to.holds(0, id))
        .count() as u64;
    assert_eq!(r.dropped_samples, dropped);
    assert!(r.reclaimed_bytes >= r.dropped_bytes, "{r:?}");
    let r = dataset::rebalance(&st.space(0), &opts, &mut src).unwrap();
    assert!(r.up_to_date && r.copied_samples == 0, "{r:?}");
}

/// Node 1 listens on 127.0.0.2 at `addr`'s port again.
fn restart(addr: &str, space: &Path, token: &Path) -> Serve {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        // The port is free once the killed process is reaped; a bind
        // that races its teardown is tried again.
        let s = std::panic::catch_unwind(|| Serve::start(space, addr, token, None));
        match s {
            Ok(s) => return s,
            Err(_) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) => std::panic::resume_unwind(e),
        }
    }
}

#[test]
fn node_killed_and_restarted_twice_in_one_epoch_with_one_copy_and_no_source() {
    let st = setup("tiny", 1500, 3, 1);
    let cat = Catalog::open(&st.catalog).unwrap();
    st.hide_source();
    let mut serves: Vec<Option<Serve>> = (0..3)
        .map(|i| {
            Some(Serve::start(
                &st.space(i),
                &format!("{}:0", node_ip(i as usize)),
                &st.token,
                None,
            ))
        })
        .collect();
    let addrs: Vec<String> = serves
        .iter()
        .map(|s| s.as_ref().unwrap().addr.clone())
        .collect();
    // A small ring: little is read ahead, so node 1 is needed after each kill.
    let mut l = consumer(&st.space(0), &addrs, 256 << 10);
    let mut restarts = 0;
    let t0 = Instant::now();
    let n = read_epoch(&mut l, &cat, 0, |k| {
        if k == 10 || k == 50 {
            serves[1].take().unwrap().kill9();
            serves[1] = Some(restart(&addrs[1], &st.space(1), &st.token));
            restarts += 1;
        }
    })
    .unwrap();
    assert_eq!(n, cat.len());
    assert_eq!(restarts, 2);
    // Node 1 alone holds samples well past each restart (beyond what the
    // 256 KiB ring had read ahead): they came from the restarted service.
    let sampler = Sampler::new(
        SamplerConfig::single(cat.len(), 3)
            .rank_world(0, 1)
            .shuffle(true)
            .drop_last(false),
    )
    .unwrap();
    let p = Placement::new(3, 1).unwrap();
    let only_node1 = |steps: std::ops::Range<u64>| {
        steps
            .filter(|&k| p.owner(sampler.sample(0, k)) == 1)
            .count()
    };
    assert!(only_node1(11 * 16 + 200..51 * 16) > 50);
    assert!(only_node1(51 * 16 + 200..cat.len()) > 50);
    let stats = l.finish();
    eprintln!(
        "epoch with two restarts in {:.2} s: {stats:?}",
        t0.elapsed().as_secs_f64()
    );
    assert_eq!(stats.source_reads, 0, "{stats:?}");
}

#[test]
fn a_node_that_comes_back_changed_is_refused_by_name() {
    let st = setup("tiny", 1500, 3, 1);
    let cat = Catalog::open(&st.catalog).unwrap();
    // Node 1 of another layout (2 nodes) of the same catalog.
    let other = st.tmp.path().join("other");
    ok(&[
        "preload",
        "--source",
        s(&st.src),
        "--catalog",
        s(&st.catalog),
        "--space",
        s(&other),
        "--nodes",
        "2",
        "--node-index",
        "1",
    ]);
    let other_token = st.tmp.path().join("other-token");
    std::fs::write(&other_token, "another-job\n").unwrap();
    st.hide_source();
    for (space, token, want) in [
        (&other, &st.token, "NodeChanged"),
        (&st.space(1), &other_token, "Refused"),
    ] {
        let mut serves: Vec<Option<Serve>> = (0..3)
            .map(|i| {
                Some(Serve::start(
                    &st.space(i),
                    &format!("{}:0", node_ip(i as usize)),
                    &st.token,
                    None,
                ))
            })
            .collect();
        let addrs: Vec<String> = serves
            .iter()
            .map(|s| s.as_ref().unwrap().addr.clone())
            .collect();
        let mut l = consumer(&st.space(0), &addrs, 256 << 10);
        let t0 = Instant::now();
        let e = read_epoch(&mut l, &cat, 0, |k| {
            if k == 10 {
                serves[1].take().unwrap().kill9();
                serves[1] = Some(restart(&addrs[1], space, token));
            }
        })
        .unwrap_err();
        assert_eq!(e.root().kind_name(), want, "{e}");
        assert!(e.to_string().contains("node 1"), "{e}");
        eprintln!("{want} after {:.2} s: {e}", t0.elapsed().as_secs_f64());
    }
}

/// A space preloaded with the scaled owner function (manifest version 1,
/// what builds before jump wrote) keeps it: it opens, serves and is read
/// through a cluster, preload leaves it as it is, and rebalance converts
/// it to jump copying only what jump moves.
#[test]
fn scaled_spaces_keep_working_and_rebalance_converts_them() {
    let st = setup("tiny", 1200, 0, 1);
    let cat = Catalog::open(&st.catalog).unwrap();
    let scaled = Placement::with_fn(OwnerFn::Scaled, 2, 1).unwrap();
    for i in 0..2 {
        let opts = PreloadOptions::default()
            .source(Some(
                dataset::SourceSpec::parse_os(st.src.as_os_str()).unwrap(),
            ))
            .catalog(Some(st.catalog.clone()))
            .placement(scaled)
            .node_index(i);
        dataset::preload(&st.space(i), &opts).unwrap();
        let m = std::fs::read(st.space(i).join("manifest.ksm")).unwrap();
        assert_eq!(u32::from_le_bytes(m[8..12].try_into().unwrap()), 1);
        check_space(&st.space(i), scaled, i);
        // The old preload command (now jump by default) keeps the space.
        let out = ok(&[
            "preload",
            "--space",
            s(&st.space(i)),
            "--nodes",
            "2",
            "--node-index",
            &i.to_string(),
        ]);
        assert!(out.contains("up to date"), "{out}");
    }
    let serves: Vec<Serve> = (0..2)
        .map(|i| {
            Serve::start(
                &st.space(i),
                &format!("{}:0", node_ip(i as usize)),
                &st.token,
                None,
            )
        })
        .collect();
    let addrs: Vec<String> = serves.iter().map(|s| s.addr.clone()).collect();
    let mut l = consumer(&st.space(0), &addrs, 1 << 20);
    assert_eq!(read_epoch(&mut l, &cat, 0, |_| {}).unwrap(), cat.len());
    drop(l);
    let jump = Placement::new(2, 1).unwrap();
    for i in 0..2 {
        let (out, n, b) = stage(&st, i, 2, &addrs, false);
        assert_eq!((n, b), arriving(&cat, scaled, jump, i), "{out}");
    }
    drop(serves);
    for i in 0..2 {
        commit(&st, i, 2);
        check_space(&st.space(i), jump, i);
        let m = std::fs::read(st.space(i).join("manifest.ksm")).unwrap();
        assert_eq!(u32::from_le_bytes(m[8..12].try_into().unwrap()), 2);
    }
}

/// A node 2 of 3 that serves the first GRANT with the real bytes and then
/// answers nothing more (holding the connection): a staging that fetches
/// from it makes progress, then hangs where a kill -9 can find it.
fn node_serving_one_batch(cat: &Catalog) -> String {
    use kspeed::transport::proto::{self, GrantEntry, Header, Kind, Welcome};
    use std::io::Write;
    let l = std::net::TcpListener::bind("127.0.0.3:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let mut src = SourceFetch::new(cat).unwrap();
    std::thread::spawn(move || {
        let (mut c, _) = l.accept().unwrap();
        read_frame(&mut c).unwrap(); // HELLO
        let w = Welcome {
            node_index: 2,
            nodes: 3,
            replicas: 1,
            owner_fn: 1,
            max_data_bytes: 1 << 20,
            max_grants: 4096,
            transport: proto::TRANSPORT_TCP,
        };
        c.write_all(&w.encode()).unwrap();
        let (h, body) = read_frame(&mut c).unwrap();
        assert_eq!(h.kind, Kind::Grant);
        let mut buf = Vec::new();
        for k in 0..h.a as usize {
            let e = GrantEntry::decode(&body, k);
            src.read(e.sample, &mut buf).unwrap();
            c.write_all(&Header::data(e.grant, e.offset, e.len).encode())
                .unwrap();
            c.write_all(&buf).unwrap();
        }
        // The next GRANT is never answered; the connection stays open
        // until the staging process is killed.
        let _ = read_frame(&mut c);
        let _ = read_frame(&mut c);
    });
    addr
}

#[test]
fn staging_killed_mid_way_resumes_from_its_journal() {
    // Node 0 of 3 going to 2 nodes takes half of node 2's samples.
    let st = setup("tiny", 4000, 3, 1);
    let cat = Catalog::open(&st.catalog).unwrap();
    let (from, to) = (Placement::new(3, 1).unwrap(), Placement::new(2, 1).unwrap());
    let (want_n, want_b) = arriving(&cat, from, to, 0);
    assert!(want_n > 300, "{want_n}");
    let node2 = node_serving_one_batch(&cat);
    // Nodes 0 and 1 do not answer (nothing listens there).
    let peers = format!("127.0.0.1:1,127.0.0.2:1,{node2}");
    let mut child = Command::new(kspeed_bin())
        .args(["rebalance", "--space", s(&st.space(0)), "--nodes", "2"])
        .args(["--peers", &peers, "--token-file", s(&st.token)])
        .args(["--checkpoint-bytes", "4096", "--progress", "none"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // The first batch is synced and journaled; the second never comes.
    let journal = st.space(0).join("rebalance.journal");
    let deadline = Instant::now() + Duration::from_secs(60);
    while !journal.exists() {
        assert!(Instant::now() < deadline, "no journal");
        assert!(child.try_wait().unwrap().is_none(), "staging ended");
        std::thread::sleep(Duration::from_millis(5));
    }
    Command::new("kill")
        .args(["-KILL", &child.id().to_string()])
        .status()
        .unwrap();
    child.wait().unwrap();
    assert!(!st.space(0).join("rebalance.ksm").exists());
    check_space(&st.space(0), from, 0);
    // The rerun (from the source now) resumes at the journal's watermark.
    let out = ok(&[
        "rebalance",
        "--space",
        s(&st.space(0)),
        "--nodes",
        "2",
        "--from-source",
        "--commit",
    ]);
    assert!(
        out.contains("resumed an interrupted rebalance at sample"),
        "{out}"
    );
    let f = fields(&out);
    assert_eq!(num(&f, "arriving_samples"), want_n);
    assert_eq!(num(&f, "arriving_bytes"), want_b);
    assert!(num(&f, "copied_samples") < want_n, "{out}");
    assert_eq!(f["committed"], "true");
    check_space(&st.space(0), to, 0);
}
