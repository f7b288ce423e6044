//! A dataset larger than the node's space (issue 31): `kspeed preload
//! --max-bytes` holds a budget of it, and the loader reads the rest from
//! the source files, in the known order and ahead of need.
//!
//! - four epochs, exact: every sample in the sampler's order and
//!   byte-exact; the space's samples from disk, the others from the source,
//!   the source's bytes per epoch exactly the model's (the bytes the space
//!   does not hold);
//! - a memory tier over a partial space serves source samples too;
//! - a source file changed or removed after the preload is a named error
//!   naming the file and the sample;
//! - `kspeed read` killed mid-epoch (SIGKILL): the space verifies intact
//!   and a rerun reads the epoch exactly;
//! - three nodes in network namespaces serving partial spaces (the dataset
//!   3x what they hold together): a rank reads its node's samples from its
//!   space, the other nodes' from them, and those no node holds from the
//!   source, exactly, with no grant to a node that does not hold the
//!   sample; a node killed mid-epoch fails over to the source;
//! - what is not built yet is refused by name: rebalancing a partial space,
//!   a mixture of partial spaces in cluster mode; and `--max-bytes 0`.

mod common;
#[path = "common/nodes.rs"]
mod nodes;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use kspeed::dataset::partial::{cutoff, cutoffs};
use kspeed::dataset::space::{LayoutParams, Plan};
use kspeed::dataset::{Catalog, OwnerFn, PartialHolders, Placement, Space};
use kspeed::loader::{Loader, LoaderBuilder};
use kspeed::sampler::{Sampler, SamplerConfig};
use kspeed::Error;

const SEED: u64 = 7;

/// 240 `imagenet` samples preloaded into a space of about a third of them.
struct Setup {
    _tmp: tempfile::TempDir,
    src: PathBuf,
    space: PathBuf,
    cat: Catalog,
}

fn setup() -> Setup {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    gen("imagenet", 240, &src);
    let space = tmp.path().join("space");
    let out = ok(&[
        "preload",
        "--source",
        s(&src),
        "--space",
        s(&space),
        "--max-bytes",
        "10MiB",
    ]);
    assert!(out.contains("a partial space"), "{out}");
    let cat = Catalog::open(&space.join("catalog.ksc")).unwrap();
    Setup {
        _tmp: tmp,
        src,
        space,
        cat,
    }
}

fn builder(space: &Path) -> LoaderBuilder {
    LoaderBuilder::space(space)
        .seed(SEED)
        .batch_size(8)
        .pollers(2)
        .pin(false)
        .landing(test_ring(8 << 20))
}

/// Reads `epochs` epochs from the start and checks every sample against
/// the sampler and the catalog.
fn read_exact(l: &mut Loader, cat: &Catalog, epochs: u64) -> Result<(), Error> {
    let sampler = Sampler::new(SamplerConfig::single(cat.len(), SEED)).unwrap();
    for e in 0..epochs {
        l.set_epoch(e)?;
        let mut k = 0u64;
        while let Some(b) = l.next_batch()? {
            for smp in b.iter() {
                assert_eq!(smp.id, sampler.sample(e, k), "epoch {e} step {k}");
                let c = cat.sample(smp.id);
                assert_eq!(smp.bytes.len(), c.len as usize, "sample {}", smp.id);
                assert_eq!(crc32c::crc32c(smp.bytes), c.crc32c, "sample {}", smp.id);
                k += 1;
            }
        }
        assert_eq!(k, cat.len(), "every sample of epoch {e}, once");
    }
    Ok(())
}

#[test]
fn four_epochs_exact_from_the_space_and_the_source() {
    let st = setup();
    let space = Space::open(&st.space).unwrap();
    let (held, n) = (space.held_samples(), st.cat.len());
    assert!(held > 0 && held < n / 2, "held {held} of {n}");
    assert!(space.params().is_partial());
    // The model: the source gives exactly the samples the space does not
    // hold, once per epoch.
    let source_bytes_per_epoch: u64 = (0..n)
        .filter(|&id| space.location(id).is_none())
        .map(|id| st.cat.sample(id).len as u64)
        .sum();
    let epochs = 4;
    let mut l = builder(&st.space).end_epoch(Some(epochs)).build().unwrap();
    read_exact(&mut l, &st.cat, epochs).unwrap();
    let stats = l.stats();
    assert_eq!(stats.disk_reads, held * epochs);
    assert_eq!(stats.source_reads, (n - held) * epochs);
    assert_eq!(stats.source_bytes, source_bytes_per_epoch * epochs);
    assert_eq!(stats.samples, n * epochs);
    // Every source sample's lead over the need is counted once, the late
    // ones (waited for) among them.
    let lead = stats.source_lead;
    assert_eq!(lead.count, (n - held) * epochs, "{lead:?}");
    assert!(lead.late <= lead.count && lead.p10 <= lead.p50, "{lead:?}");
    // `kspeed verify` checks what the space holds and passes.
    let out = ok(&["verify", "--space", s(&st.space)]);
    assert!(!out.to_lowercase().contains("corrupt"), "{out}");
}

#[test]
fn a_memory_tier_over_a_partial_space_keeps_source_samples_too() {
    let st = setup();
    let epochs = 3;
    let mut l = builder(&st.space)
        .tier_bytes(64 << 20)
        .end_epoch(Some(epochs))
        .build()
        .unwrap();
    read_exact(&mut l, &st.cat, epochs).unwrap();
    let stats = l.stats();
    let n = st.cat.len();
    let held = Space::open(&st.space).unwrap().held_samples();
    // Everything fits in the tier, filled as epoch 0 is read. Epoch 1's
    // first reads may run ahead of epoch 0's last fills (read ahead), but
    // by epoch 2 (the ring holds far less than an epoch) every sample is
    // filled: at least an epoch of hits, none of them from the source.
    assert_eq!(
        stats.tier_hits + stats.disk_reads + stats.source_reads,
        n * epochs
    );
    assert!(stats.tier_hits >= n, "{stats:?}");
    assert!(stats.source_reads >= n - held, "{stats:?}");
}

#[test]
fn a_changed_or_missing_source_file_is_a_named_error() {
    let st = setup();
    let space = Space::open(&st.space).unwrap();
    let outside = (0..st.cat.len())
        .find(|&id| space.location(id).is_none())
        .unwrap();
    let path = st.cat.file_path(st.cat.sample(outside).file);
    // Same length, other bytes: the catalog's CRC32C catches it, even
    // without verify_crc32c.
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[0] ^= 0xff;
    std::fs::write(&path, &bytes).unwrap();
    let mut l = builder(&st.space).end_epoch(Some(1)).build().unwrap();
    let e = read_exact(&mut l, &st.cat, 1).unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains(&outside.to_string()) && msg.contains(s(&path)),
        "{msg}"
    );
    assert!(
        matches!(&e, Error::SampleCorrupt { .. } | Error::LoaderFailed { .. }),
        "{e:?}"
    );
    // Removed: the open fails, naming the file.
    std::fs::remove_file(&path).unwrap();
    let mut l = builder(&st.space).end_epoch(Some(1)).build().unwrap();
    let msg = read_exact(&mut l, &st.cat, 1).unwrap_err().to_string();
    assert!(msg.contains(s(&path)), "{msg}");
    // The whole source gone: refused at build, naming it.
    std::fs::rename(&st.src, st.src.with_extension("gone")).unwrap();
    let msg = match builder(&st.space).build() {
        Ok(_) => panic!("a partial space without its source must be refused"),
        Err(e) => e.to_string(),
    };
    assert!(msg.contains(s(&st.src)), "{msg}");
}

#[test]
fn a_read_killed_mid_epoch_leaves_the_space_intact_and_a_rerun_exact() {
    let st = setup();
    let mut child = Command::new(kspeed_bin())
        .args(["read", "--space", s(&st.space), "--epochs", "1000"])
        .args(["--no-huge-pages", "--no-mlock", "--progress", "none"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // Killed once it has read from the source: its open descriptors show
    // a source file (deadline: 60 s).
    let deadline = Instant::now() + Duration::from_secs(60);
    let fd_dir = format!("/proc/{}/fd", child.id());
    loop {
        let reading_source = std::fs::read_dir(&fd_dir).is_ok_and(|d| {
            d.flatten()
                .any(|f| std::fs::read_link(f.path()).is_ok_and(|t| t.starts_with(&st.src)))
        });
        if reading_source {
            break;
        }
        assert!(
            child.try_wait().unwrap().is_none(),
            "kspeed read ended before it was killed"
        );
        assert!(Instant::now() < deadline, "no source read within 60 s");
        std::thread::yield_now();
    }
    child.kill().unwrap();
    child.wait().unwrap();
    ok(&["verify", "--space", s(&st.space)]);
    let mut l = builder(&st.space).end_epoch(Some(1)).build().unwrap();
    read_exact(&mut l, &st.cat, 1).unwrap();
}

#[test]
fn what_is_not_built_yet_is_refused_by_name() {
    let st = setup();
    let tmp = tempfile::tempdir().unwrap();
    let cluster = kspeed::transport::Cluster::parse("0 127.0.0.1:1\n", "test").unwrap();
    let msg = match LoaderBuilder::mix([(s(&st.space), kspeed::sampler::Weight::Repeat(1.0))])
        .cluster(cluster)
        .token(b"t")
        .landing(test_ring(8 << 20))
        .build()
    {
        Ok(_) => panic!("a mixture of partial spaces in cluster mode"),
        Err(e) => e.to_string(),
    };
    assert!(
        msg.contains("partial space") && msg.contains("mixture"),
        "{msg}"
    );
    let out = fails(
        &[
            "preload",
            "--source",
            s(&st.src),
            "--space",
            s(&tmp.path().join("zero")),
            "--max-bytes",
            "0",
        ],
        1,
    );
    assert!(out.contains("--max-bytes 0"), "{out}");
    let out = fails(
        &[
            "rebalance",
            "--space",
            s(&st.space),
            "--nodes",
            "2",
            "--node-index",
            "0",
            "--from-source",
        ],
        1,
    );
    assert!(out.contains("partial space"), "{out}");
}

#[test]
fn three_nodes_of_partial_spaces_in_network_namespaces() {
    const NODES: u32 = 3;
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    gen("imagenet", 300, &src);
    let catalog = tmp.path().join("cat.ksc");
    ok(&["catalog", "--source", s(&src), "--out", s(&catalog)]);
    let cat = Catalog::open(&catalog).unwrap();
    // Two copies: each node's share is two thirds of the dataset, and it
    // holds a ninth of the dataset (the start of its share, by id): the
    // three hold a third of the dataset at most, some samples twice, so
    // the dataset is at least 3x what they hold. A sample's second copy
    // may be held where its first is not (near the nodes' cutoffs): a copy
    // is asked for only where held, so no grant fails.
    let budget = (cat.total_bytes() / 9).to_string();
    let spaces = nodes::preload_nodes(
        &src,
        &catalog,
        tmp.path(),
        NODES as usize,
        &["--replicas", "2", "--max-bytes", &budget],
    );
    // The model, from the manifests alone: who holds what.
    let opened: Vec<Space> = spaces.iter().map(|p| Space::open(p).unwrap()).collect();
    let holders = |id: u64| -> Vec<usize> {
        (0..NODES as usize)
            .filter(|&n| opened[n].location(id).is_some())
            .collect()
    };
    let held_total: u64 = opened.iter().map(|sp| sp.held_bytes()).sum();
    assert!(
        held_total * 2 < cat.total_bytes(),
        "the nodes hold {held_total} of {} bytes",
        cat.total_bytes()
    );
    let (mut local, mut remote, mut nobody) = (0u64, 0u64, 0u64);
    for id in 0..cat.len() {
        let h = holders(id);
        match h.as_slice() {
            [] => nobody += 1,
            h if h.contains(&0) => local += 1,
            _ => remote += 1,
        }
    }
    assert!(local > 0 && remote > 0 && nobody > 0);
    let Some(ns) = nodes::Netns::create(NODES as usize) else {
        return;
    };
    let token = tmp.path().join("token");
    std::fs::write(&token, "partial-token\n").unwrap();
    let (mut serves, addrs) = nodes::serve_in_namespaces(&spaces, &ns, &token);
    let cluster = nodes::cluster_of(&addrs);
    let rank = |epochs: u64| {
        builder(&spaces[0])
            .cluster(cluster.clone())
            .token(b"partial-token")
            .end_epoch(Some(epochs))
            .build()
            .unwrap()
    };
    let mut l = rank(2);
    read_exact(&mut l, &cat, 2).unwrap();
    let stats = l.stats();
    assert_eq!(
        stats.failovers, 0,
        "a grant went to a node without the sample"
    );
    assert_eq!(stats.disk_reads, local * 2, "{stats:?}");
    assert_eq!(stats.remote_samples, remote * 2, "{stats:?}");
    assert_eq!(stats.source_reads, nobody * 2, "{stats:?}");
    // Node 1 killed mid-epoch: what it held goes to node 2 where node 2
    // holds it, else to the source (the network thread's reads), and the
    // epoch is exact.
    let sampler = Sampler::new(SamplerConfig::single(cat.len(), SEED)).unwrap();
    let mut l = rank(1);
    l.set_epoch(0).unwrap();
    let (mut k, mut batches) = (0u64, 0u64);
    while let Some(b) = l.next_batch().unwrap() {
        for smp in b.iter() {
            assert_eq!(smp.id, sampler.sample(0, k), "step {k}");
            let c = cat.sample(smp.id);
            assert_eq!(crc32c::crc32c(smp.bytes), c.crc32c, "sample {}", smp.id);
            k += 1;
        }
        drop(b);
        batches += 1;
        if batches == 3 {
            serves[1].take().unwrap().kill9();
        }
    }
    assert_eq!(k, cat.len());
    assert!(serves[1].is_none(), "node 1 was killed mid-epoch");
    // How much node 1 still had to serve when it died depends on how far
    // the ring had read ahead: only the exact epoch is certain.
    assert!(l.stats().source_reads >= nobody);
}

/// The layout (`Plan::compute`) and the consumers' view
/// (`PartialHolders`, `cutoffs`) agree on every node of every placement.
#[test]
fn every_node_s_layout_holds_exactly_what_the_cutoffs_say() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src");
    std::fs::create_dir(&src).unwrap();
    for i in 0..300u64 {
        let len = 1 + kspeed::hash::mix64(i) % 20_000;
        std::fs::write(
            src.join(format!("s{i:03}.bin")),
            vec![i as u8; len as usize],
        )
        .unwrap();
    }
    let spec = kspeed::dataset::SourceSpec::parse(&format!("dir:{}", src.display())).unwrap();
    let cat =
        kspeed::dataset::catalog::build(&spec, &dir.path().join("c.ksc"), &Default::default())
            .unwrap();
    for (nodes, replicas) in [(1u32, 1u32), (3, 1), (3, 2), (5, 3)] {
        let placement = Placement::with_fn(OwnerFn::Jump, nodes, replicas).unwrap();
        for budget in [1u64, 4096, 64 << 10, 600 << 10, u64::MAX / 2] {
            let holders = PartialHolders::new(&cat, placement, 4096, budget);
            for node in 0..nodes {
                let params = LayoutParams {
                    catalog_identity: cat.identity(),
                    catalog_samples: cat.len(),
                    placement,
                    node_index: node,
                    align_bytes: 4096,
                    extent_bytes: 1 << 30,
                    max_held_bytes: budget,
                };
                let plan = Plan::compute(&cat, &params);
                let mut held_bytes = 0;
                for id in 0..cat.len() {
                    assert_eq!(
                        plan.location(id).is_some(),
                        holders.holds(node, id),
                        "{nodes} nodes x {replicas}, budget {budget}, node {node}, id {id}"
                    );
                    if holders.holds(node, id) {
                        held_bytes += (cat.sample(id).len as u64).next_multiple_of(4096);
                    }
                }
                assert!(held_bytes <= budget);
                assert_eq!(
                    cutoff(&cat, placement, node, 4096, budget),
                    cutoffs(&cat, placement, 4096, budget)[node as usize]
                );
            }
            for id in 0..cat.len() {
                let any = (0..nodes).any(|n| holders.holds(n, id));
                assert_eq!(holders.held_anywhere(id), any);
                for r in 0..replicas {
                    let node = placement.holder(id, r);
                    assert_eq!(
                        holders.unheld_copies(id) & (1 << r) != 0,
                        !holders.holds(node, id),
                        "copy {r} of {id}"
                    );
                }
            }
        }
    }
}
