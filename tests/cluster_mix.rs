//! A mixture of datasets in cluster mode (issue 29 part 2 over the
//! network), with real `kspeed serve` processes in network namespaces
//! (over TCP; in the soft-RoCE VM, `KSPEED_TEST_RDMA=1`, on the RDMA
//! interface's addresses over RDMA) serving two spaces side by side
//! (`--space A --space B`):
//!
//! - two ranks, one holding its node's share of both spaces, one holding
//!   nothing (catalogs only): every sample in the mixing function's order,
//!   labelled with its dataset and byte-exact, two epochs;
//! - a node killed mid-epoch with two copies: the epoch completes exactly;
//! - refusals by name: a node started with spaces placed unlike each
//!   other, and a consumer whose mixture lists the spaces in another order;
//! - `kspeed read --mix … --cluster` gives the order and counts the same
//!   mixture gives read from its sources alone.

mod common;
#[path = "common/nodes.rs"]
mod nodes;

use std::path::PathBuf;

use common::*;
use kspeed::dataset::Catalog;
use kspeed::loader::{Loader, LoaderBuilder};
use kspeed::sampler::{epoch_counts, MixSampler, SamplerConfig, Weight};
use kspeed::Error;
use nodes::{cluster_of, Netns, Serve};

const TOKEN: &str = "job-mix-token";
const SEED: u64 = 11;
const NODES: u32 = 3;

/// `KSPEED_TEST_RDMA=1` (scripts/vm_rdma_tests.sh in the soft-RoCE VM,
/// which puts 10.77.0.1-3 on the RDMA interface): node i listens on
/// 10.77.0.(i+1) outside any namespace, offers RDMA, and consumers use it.
fn rdma_mode() -> bool {
    std::env::var_os("KSPEED_TEST_RDMA").is_some()
}

/// Where the nodes run: namespaces (TCP), or none (RDMA in the VM; a fresh
/// namespace has no RDMA device). None: the test is skipped (said why).
fn nodes_net() -> Option<Option<Netns>> {
    if rdma_mode() {
        Some(None)
    } else {
        Netns::create(NODES as usize).map(Some)
    }
}

/// Two generated datasets, each with its catalog, preloaded onto `NODES`
/// spaces with `copies` copies.
struct Setup {
    tmp: tempfile::TempDir,
    catalogs: [PathBuf; 2],
    cats: Vec<Catalog>,
    token: PathBuf,
}

impl Setup {
    fn new(copies: u32) -> Setup {
        let tmp = tempfile::tempdir().unwrap();
        let mut catalogs = Vec::new();
        for (d, (profile, count)) in [("tiny", 400u64), ("imagenet", 90)].iter().enumerate() {
            let src = tmp.path().join(format!("src{d}"));
            gen(profile, *count, &src);
            let cat = tmp.path().join(format!("d{d}.ksc"));
            ok(&["catalog", "--source", s(&src), "--out", s(&cat)]);
            for i in 0..NODES {
                let sp = tmp.path().join(format!("d{d}-node{i}"));
                ok(&[
                    "preload",
                    "--source",
                    s(&src),
                    "--catalog",
                    s(&cat),
                    "--space",
                    s(&sp),
                    "--nodes",
                    &NODES.to_string(),
                    "--node-index",
                    &i.to_string(),
                    "--replicas",
                    &copies.to_string(),
                ]);
            }
            catalogs.push(cat);
        }
        let token = tmp.path().join("token");
        std::fs::write(&token, format!("{TOKEN}\n")).unwrap();
        let cats = catalogs.iter().map(|c| Catalog::open(c).unwrap()).collect();
        Setup {
            tmp,
            catalogs: [catalogs[0].clone(), catalogs[1].clone()],
            cats,
            token,
        }
    }

    fn space(&self, d: usize, i: u32) -> PathBuf {
        self.tmp.path().join(format!("d{d}-node{i}"))
    }

    /// Hides both sources: every sample must come from a node.
    fn hide_sources(&self) {
        for d in 0..2 {
            let src = self.tmp.path().join(format!("src{d}"));
            std::fs::rename(&src, src.with_extension("gone")).unwrap();
        }
    }

    /// Every node (in its namespace where there are namespaces), serving
    /// both spaces, dataset 0 first.
    fn serve(&self, ns: &Option<Netns>) -> Vec<Option<Serve>> {
        (0..NODES)
            .map(|i| {
                let (listen, netns) = match ns {
                    Some(ns) => (
                        format!("10.77.{i}.2:0"),
                        Some(ns.names[i as usize].as_str()),
                    ),
                    None => (format!("10.77.0.{}:0", i + 1), None),
                };
                Some(Serve::start_with(
                    &[&self.space(0, i), &self.space(1, i)],
                    &listen,
                    &self.token,
                    netns,
                    &[],
                ))
            })
            .collect()
    }

    /// The mixture's weights and the epoch size they divide.
    fn weights() -> [Weight; 2] {
        [Weight::Proportion(0.6), Weight::Proportion(0.4)]
    }

    /// A rank reading the mixture: from node 0's spaces (`local`) or from
    /// the catalogs alone.
    fn consumer(&self, serves: &[Option<Serve>], local: bool, rank: u32, world: u32) -> Loader {
        self.consumer_with_tier(serves, local, rank, world, 0, None)
    }

    /// [`Setup::consumer`] with a memory tier of `tier_bytes`, reading
    /// epochs below `end_epoch`.
    fn consumer_with_tier(
        &self,
        serves: &[Option<Serve>],
        local: bool,
        rank: u32,
        world: u32,
        tier_bytes: u64,
        end_epoch: Option<u64>,
    ) -> Loader {
        let parts: Vec<PathBuf> = if local {
            vec![self.space(0, 0), self.space(1, 0)]
        } else {
            self.catalogs.to_vec()
        };
        let w = Self::weights();
        let addrs: Vec<String> = serves
            .iter()
            .map(|s| s.as_ref().expect("every node up at start").addr.clone())
            .collect();
        LoaderBuilder::mix([(s(&parts[0]), w[0]), (s(&parts[1]), w[1])])
            .mix_epoch_size(300)
            .cluster(cluster_of(&addrs))
            .token(TOKEN.as_bytes())
            .seed(SEED)
            .rank(rank, world)
            .batch_size(8)
            .pollers(1)
            .pin(false)
            .landing(test_ring(8 << 20))
            .rdma(rdma_mode().then(Default::default))
            .tier_bytes(tier_bytes)
            .end_epoch(end_epoch)
            .build()
            .unwrap()
    }

    /// The order every rank must see, from the sampler alone.
    fn order(&self, rank: u32, world: u32) -> MixSampler {
        let lens = [self.cats[0].len(), self.cats[1].len()];
        let counts = epoch_counts(&Self::weights(), &lens, Some(300)).unwrap();
        MixSampler::new(
            SamplerConfig::single(0, SEED).rank_world(rank, world),
            &lens,
            &counts,
        )
        .unwrap()
    }
}

/// Reads epoch `e` and checks every sample against the mixing function's
/// order and its dataset's catalog; `between(k)` runs after batch `k`.
/// Returns the samples read.
fn read_epoch(
    l: &mut Loader,
    st: &Setup,
    want: &MixSampler,
    e: u64,
    mut between: impl FnMut(u64),
) -> Result<u64, Error> {
    l.set_epoch(e)?;
    let offsets = l.dataset_offsets().to_vec();
    let order = want.epoch(e);
    let (mut k, mut batches) = (0u64, 0u64);
    while let Some(b) = l.next_batch()? {
        for smp in b.iter() {
            let m = order.sample(k);
            assert_eq!(
                (smp.dataset, smp.id),
                (m.dataset, m.id),
                "epoch {e} step {k}"
            );
            let d = smp.dataset as usize;
            let c = st.cats[d].sample(smp.id - offsets[d]);
            assert_eq!(
                smp.bytes.len(),
                c.len as usize,
                "dataset {d} sample {}",
                c.id
            );
            assert_eq!(
                crc32c::crc32c(smp.bytes),
                c.crc32c,
                "dataset {d} sample {}",
                c.id
            );
            assert_eq!(smp.label, c.label);
            k += 1;
        }
        drop(b);
        between(batches);
        batches += 1;
    }
    assert_eq!(k, order.per_rank(), "every sample of epoch {e}, once");
    Ok(k)
}

#[test]
fn two_ranks_read_a_mixture_from_nodes_serving_two_spaces() {
    let st = Setup::new(1);
    let Some(ns) = nodes_net() else {
        return;
    };
    st.hide_sources();
    let serves = st.serve(&ns);
    for (rank, local) in [(0, true), (1, false)] {
        let mut l = st.consumer(&serves, local, rank, 2);
        let want = st.order(rank, 2);
        for e in 0..2 {
            read_epoch(&mut l, &st, &want, e, |_| {}).unwrap();
        }
        let stats = l.stats();
        assert_eq!(stats.failovers, 0, "rank {rank}");
        if local {
            // Node 0's share of both datasets came from its own spaces.
            assert!(stats.disk_reads > 0, "rank 0 read nothing locally");
        } else {
            assert_eq!(stats.disk_reads, 0, "rank 1 holds nothing");
        }
    }
    // With a memory tier over the mixture that holds both datasets, a
    // sample read or pushed once is served from memory when it is drawn
    // again: pushed samples in place of a grant (the network thread),
    // local ones in place of a read; byte-exact, in order.
    let mut l = st.consumer_with_tier(&serves, true, 0, 2, 64 << 20, Some(3));
    let want = st.order(0, 2);
    let mut seen = std::collections::HashSet::new();
    let mut again = 0u64;
    for e in 0..3 {
        read_epoch(&mut l, &st, &want, e, |_| {}).unwrap();
        let order = want.epoch(e);
        for k in 0..order.per_rank() {
            again += u64::from(!seen.insert(order.sample(k).id));
        }
    }
    let stats = l.stats();
    assert_eq!(stats.failovers, 0);
    // A draw read or granted ahead before its first copy landed is read
    // (or pushed) again: 81-87 % of them were hits here. Node 0 holds a
    // third of the samples, so local fills alone would give about that.
    assert!(
        stats.tier_hits <= again && stats.tier_hits >= again / 2,
        "{} tier hits of {again} draws of a sample drawn before",
        stats.tier_hits
    );
}

#[test]
fn a_node_killed_mid_epoch_fails_over_within_the_mixture() {
    let st = Setup::new(2);
    let Some(ns) = nodes_net() else {
        return;
    };
    st.hide_sources();
    let mut serves = st.serve(&ns);
    let mut l = st.consumer(&serves, false, 0, 1);
    let want = st.order(0, 1);
    read_epoch(&mut l, &st, &want, 0, |k| {
        if k == 3 {
            serves[1].take().unwrap().kill9();
        }
    })
    .unwrap();
    assert!(serves[1].is_none(), "the node was killed mid-epoch");
    // The next epoch, without node 1, completes too.
    read_epoch(&mut l, &st, &want, 1, |_| {}).unwrap();
}

#[test]
fn spaces_placed_unlike_and_another_order_are_refused_and_the_cli_reads_the_mixture() {
    let st = Setup::new(1);
    // A third dataset placed for 2 nodes: a node will not serve it next to
    // a space placed for 3.
    let other = st.tmp.path().join("other");
    ok(&[
        "preload",
        "--source",
        s(&st.tmp.path().join("src1")),
        "--catalog",
        s(&st.catalogs[1]),
        "--space",
        s(&other),
        "--nodes",
        "2",
        "--node-index",
        "0",
    ]);
    let out = fails(
        &[
            "serve",
            "--space",
            s(&st.space(0, 0)),
            "--space",
            s(&other),
            "--listen",
            "127.0.0.1:0",
            "--token-file",
            s(&st.token),
        ],
        1,
    );
    assert!(
        out.contains("placed alike") && out.contains(s(&other)),
        "{out}"
    );
    // A consumer listing the spaces in another order: another mixture,
    // refused at HELLO by every node.
    let serves: Vec<Option<Serve>> = (0..NODES)
        .map(|i| {
            Some(Serve::start_with(
                &[&st.space(0, i), &st.space(1, i)],
                &format!("127.0.0.{}:0", i + 1),
                &st.token,
                None,
                &[],
            ))
        })
        .collect();
    let addrs: Vec<String> = serves
        .iter()
        .map(|s| s.as_ref().unwrap().addr.clone())
        .collect();
    let w = Setup::weights();
    let r = LoaderBuilder::mix([(s(&st.catalogs[1]), w[0]), (s(&st.catalogs[0]), w[1])])
        .cluster(cluster_of(&addrs))
        .token(TOKEN.as_bytes())
        .node_timeout(std::time::Duration::from_secs(5))
        .batch_size(8)
        .pollers(1)
        .pin(false)
        .landing(test_ring(8 << 20))
        .build();
    let e = match r {
        Ok(mut l) => {
            l.set_epoch(0).unwrap();
            let mut e = None;
            loop {
                match l.next_batch() {
                    Ok(Some(_)) => {}
                    Ok(None) => break,
                    Err(x) => {
                        e = Some(x);
                        break;
                    }
                }
            }
            e.expect("a mixture in another order must not be served")
        }
        Err(e) => e,
    };
    let msg = e.to_string();
    assert!(msg.contains("mixture of 2 spaces"), "{msg}");
    // The README's command: `kspeed read --mix` in cluster mode orders and
    // labels the epoch as the same mixture read from the sources alone.
    let nodes_file = st.tmp.path().join("nodes.txt");
    std::fs::write(&nodes_file, nodes::cluster_text(&addrs)).unwrap();
    let mix = format!("{}:0.6,{}:0.4", s(&st.catalogs[0]), s(&st.catalogs[1]));
    let common_args = [
        "read",
        "--mix",
        &mix,
        "--mix-epoch-size",
        "300",
        "--seed",
        "11",
        "--batch-size",
        "8",
        "--pollers",
        "1",
        "--verify",
        "--no-huge-pages",
        "--no-mlock",
    ];
    let mixture_line = |out: &str| -> String {
        out.lines()
            .find(|l| l.contains("epoch 0 mixture:"))
            .unwrap_or_else(|| panic!("no mixture line in {out}"))
            .trim()
            .to_string()
    };
    let alone = ok(&common_args);
    let mut cluster_args = common_args.to_vec();
    cluster_args.extend(["--cluster", s(&nodes_file), "--token-file", s(&st.token)]);
    let over_nodes = ok(&cluster_args);
    assert_eq!(mixture_line(&over_nodes), mixture_line(&alone));
}
