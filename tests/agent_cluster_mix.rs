//! A mixture of datasets through `kspeed agent` in a cluster: three nodes,
//! each one agent process serving its share of two spaces side by side
//! (`--space A --space B`), as its node's consumer for the ranks attached
//! to it and as its node service for the other nodes (`--listen`). Real
//! processes on loopback (127.x.y.z, one address per node); in the
//! soft-RoCE VM (`KSPEED_TEST_RDMA`, scripts/vm_rdma_tests.sh) on
//! 10.77.0.1-3 over RDMA. Every wait is on a condition with a deadline.

mod agent_support;
mod common;
#[path = "common/nodes.rs"]
mod nodes;

use std::path::PathBuf;
use std::time::Duration;

use agent_support::*;
use common::{gen, ok, s};
use kspeed::dataset::Catalog;
use kspeed::loader::{AgentMode, Loader, LoaderBuilder};
use kspeed::sampler::Weight;

const NODES: usize = 3;
const TOKEN: &str = "agent-mix-token";

fn rdma() -> bool {
    std::env::var_os("KSPEED_TEST_RDMA").is_some()
}

/// Two datasets preloaded onto `NODES` nodes (one copy), the node list
/// and the token.
struct Setup {
    dir: tempfile::TempDir,
    cats: Vec<Catalog>,
    cluster: PathBuf,
    token: PathBuf,
    addrs: Vec<String>,
}

impl Setup {
    fn new() -> Setup {
        let dir = tempfile::tempdir().unwrap();
        let mut cats = Vec::new();
        for (d, (profile, count)) in [("tiny", 400u64), ("imagenet", 90)].iter().enumerate() {
            let src = dir.path().join(format!("src{d}"));
            gen(profile, *count, &src);
            let cat = dir.path().join(format!("d{d}.ksc"));
            ok(&["catalog", "--source", s(&src), "--out", s(&cat)]);
            let spaces = nodes::preload_nodes(
                &src,
                &cat,
                &dir.path().join(format!("d{d}")),
                NODES,
                &["--replicas", "1"],
            );
            assert_eq!(spaces.len(), NODES);
            cats.push(Catalog::open(&cat).unwrap());
        }
        let pid = std::process::id();
        let (a, b) = (10 + (pid % 200) as u8, 77u8);
        let port = 20_000 + (pid % 20_000) as u16;
        let addrs: Vec<String> = (0..NODES)
            .map(|i| {
                if rdma() {
                    format!("10.77.0.{}:{}", i + 1, port + 7)
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
        std::fs::write(&token, format!("{TOKEN}\n")).unwrap();
        Setup {
            dir,
            cats,
            cluster,
            token,
            addrs,
        }
    }

    /// Node `node`'s share of dataset `d`.
    fn space(&self, d: usize, node: usize) -> PathBuf {
        self.dir
            .path()
            .join(format!("d{d}"))
            .join(format!("node{node}"))
    }

    fn socket(&self, node: usize) -> PathBuf {
        self.dir.path().join(format!("agent{node}.sock"))
    }

    /// Node `node`'s agent, serving both its spaces, dataset 0 first.
    fn agent(&self, node: usize) -> Agent {
        let second = self.space(1, node);
        let mut args = vec!["--space", s(&second)];
        args.extend([
            "--cluster",
            s(&self.cluster),
            "--token-file",
            s(&self.token),
        ]);
        args.extend(["--listen", &self.addrs[node], "--node-timeout-ms", "2000"]);
        // A node tier over both spaces that holds them whole.
        args.extend(["--tier-bytes", "32MiB", "--no-mlock"]);
        if rdma() {
            args.push("--rdma");
        }
        Agent::start(&self.space(0, node), &self.socket(node), &args)
    }

    /// Rank `rank` of `world` on node `node`, attached to its agent or
    /// embedded (its own links to the three node services).
    ///
    /// An attached node's second rank (odd) asks for tier views: the node
    /// tier's samples, pushed or read, come as read-only views of it.
    fn rank(&self, node: usize, rank: u32, world: u32, attached: bool) -> Loader {
        let b = LoaderBuilder::mix([
            (s(&self.space(0, node)), Weight::Proportion(0.6)),
            (s(&self.space(1, node)), Weight::Proportion(0.4)),
        ])
        .mix_epoch_size(300)
        .cluster(kspeed::transport::Cluster::from_file(&self.cluster).unwrap())
        .seed(11)
        .rank(rank, world)
        .batch_size(8)
        .landing(common::test_ring(8 << 20));
        let b = if attached {
            b.agent(AgentMode::Required)
                .agent_socket(Some(self.socket(node)))
                .tier_views(rank % 2 == 1)
        } else {
            b.agent(AgentMode::Off)
                .token(TOKEN.as_bytes())
                .rdma(rdma().then(Default::default))
        };
        b.build().unwrap()
    }
}

/// (dataset, id) of epochs `from..from + n`, every sample checked byte for
/// byte against its dataset's catalog; and how many were tier views.
fn epochs(l: &mut Loader, from: u64, n: u64, cats: &[Catalog]) -> (Vec<(u32, u64)>, u64) {
    let offsets = l.dataset_offsets().to_vec();
    let mut got = Vec::new();
    let mut views = 0;
    for e in from..from + n {
        l.set_epoch(e).unwrap();
        while let Some(b) = l.next_batch().unwrap() {
            for smp in b.iter() {
                let d = smp.dataset as usize;
                let c = cats[d].sample(smp.id - offsets[d]);
                assert_eq!(
                    crc32c::crc32c(smp.bytes),
                    c.crc32c,
                    "epoch {e}: dataset {d} id {}",
                    smp.id
                );
                got.push((smp.dataset, smp.id));
                views += u64::from(smp.in_tier);
            }
        }
    }
    (got, views)
}

/// Two ranks on each of three nodes read a mixture of two spaces through
/// their node's agent: each rank's two epochs are, in order and byte for
/// byte, what the same rank reads embedded from the same three node
/// services, with samples of both datasets from every node; the node
/// tier over both spaces keeps what the node's first rank read or was
/// pushed, so its second rank's draws of those (the 90-sample dataset is
/// drawn 120 times an epoch) are tier hits, which that rank, asking for
/// tier views, takes as views of the node tier.
#[test]
fn attached_ranks_read_a_mixture_across_the_cluster() {
    let st = Setup::new();
    let agents: Vec<Agent> = (0..NODES).map(|i| st.agent(i)).collect();
    for a in &agents {
        a.log.wait_count(
            "links kept while the agent runs",
            1,
            Duration::from_secs(60),
        );
    }
    let world = 2 * NODES as u32;
    for r in 0..world {
        let node = (r / 2) as usize;
        let mut attached = st.rank(node, r, world, true);
        assert!(attached.attached());
        let (got, views) = epochs(&mut attached, 1, 2, &st.cats);
        let tier_hits = attached.stats().tier_hits;
        drop(attached);
        if r % 2 == 1 {
            // 103-115 here (with what is read ahead past epoch 2); from
            // the node's own third of the samples alone, about a third.
            assert!(
                tier_hits >= got.len() as u64 / 2,
                "rank {r}: {tier_hits} tier hits for {} samples after rank {}",
                got.len(),
                r - 1
            );
            // This rank asked for tier views: its tier hits, read from the
            // node's disk or pushed by another node, come as views.
            assert!(
                views >= got.len() as u64 / 3,
                "rank {r}: {views} tier views, {tier_hits} tier hits for {} samples",
                got.len()
            );
        } else {
            assert_eq!(views, 0, "rank {r} did not ask for tier views");
        }
        let mut embedded = st.rank(node, r, world, false);
        let (want, _) = epochs(&mut embedded, 1, 2, &st.cats);
        assert_eq!(got, want, "rank {r}");
        assert_eq!(got.len(), 2 * 300 / world as usize, "rank {r}");
        assert!(
            got.iter().any(|x| x.0 == 0) && got.iter().any(|x| x.0 == 1),
            "rank {r}"
        );
    }
    for (i, a) in agents.iter().enumerate() {
        let log = a.log.all();
        assert!(!log.contains("refused"), "agent {i} refused a rank:\n{log}");
    }
}
