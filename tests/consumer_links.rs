//! One consumer against a thousand node services from one process (issue
//! 28, "scale without hardware", the consumer's side): the other nodes of
//! a large cluster as one rank, or one agent's shared network thread, sees
//! them. A real loader in cluster mode and `tests/common/fake_nodes.rs`,
//! which speaks the wire protocol as kspeed's node service does over one
//! io_uring. What is checked is counted: every node welcomed the consumer
//! and was asked for heartbeats, an epoch comes in the sampler's order
//! with every sample's bytes matching the catalog's CRC32C, no node is
//! failed over, and every sample was granted. The CPU this costs is
//! measured by `benches/fake_nodes.rs` (BENCHMARKS.md). Every wait has a
//! deadline.

mod common;
#[path = "common/fake_nodes.rs"]
mod fake_nodes;
#[path = "common/fake_peers.rs"]
mod fake_peers;

use std::sync::atomic::Ordering;
use std::time::Duration;

use common::{gen, ok, s, skip, test_ring};
use kspeed::dataset::Catalog;
use kspeed::loader::LoaderBuilder;
use kspeed::sampler::{Sampler, SamplerConfig};

const NODES: usize = 1000;
const TOKEN: &[u8] = b"consumer-links";

#[test]
fn a_consumer_reads_an_epoch_from_a_thousand_nodes_byte_exact() {
    // 1,000 listeners, their 1,000 accepted links and the consumer's 1,000.
    if fake_peers::raise_nofile() < 3 * NODES as u64 + 256 {
        skip("the open-file limit is below 3,256: cannot hold 1,000 nodes and their links");
        return;
    }
    // The loader's calls block; a consumer that stopped judging its nodes
    // would hang here, so a watchdog ends the process instead.
    let (done_tx, done_rx) = crossbeam_channel::bounded::<()>(1);
    std::thread::spawn(move || {
        if done_rx.recv_timeout(Duration::from_secs(300)).is_err() {
            eprintln!("a_consumer_reads_an_epoch_from_a_thousand_nodes: no end within 300 s");
            std::process::abort();
        }
    });
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src");
    gen("tiny", 3000, &src);
    let catalog = dir.path().join("cat.ksc");
    ok(&["catalog", "--source", s(&src), "--out", s(&catalog)]);
    let cat = Catalog::open(&catalog).unwrap();
    let nodes = fake_nodes::FakeNodes::new(NODES, 0, NODES as u32, &cat, TOKEN);
    let text: String = nodes
        .addrs()
        .iter()
        .enumerate()
        .map(|(i, a)| format!("{i} {a}\n"))
        .collect();
    let (stop, served) = fake_nodes::spawn(nodes);
    let cluster = kspeed::transport::Cluster::parse(&text, "fake nodes").unwrap();
    let mut loader = LoaderBuilder::source(s(&src))
        .catalog(&catalog)
        .cluster(cluster)
        .token(TOKEN)
        .seed(3)
        .batch_size(32)
        .pollers(1)
        .pin(false)
        .landing(test_ring(8 << 20))
        .verify_crc32c(true)
        .node_timeout(Duration::from_secs(20))
        .end_epoch(Some(1))
        .build()
        .expect("a loader against 1,000 fake nodes");
    let sampler = Sampler::new(
        SamplerConfig::single(cat.len(), 3)
            .shuffle(true)
            .drop_last(false),
    )
    .unwrap();
    loader.set_epoch(0).unwrap();
    let mut k = 0u64;
    while let Some(b) = loader.next_batch().unwrap() {
        for smp in b.iter() {
            assert_eq!(smp.id, sampler.sample(0, k), "step {k}");
            let c = cat.sample(smp.id);
            assert_eq!(
                crc32c::crc32c(smp.bytes),
                c.crc32c,
                "sample {} at step {k}",
                smp.id
            );
            k += 1;
        }
    }
    assert_eq!(k, cat.len(), "one whole epoch");
    let st = loader.stats();
    assert_eq!(st.failovers, 0, "{st:?}");
    assert_eq!(st.source_reads, 0, "{st:?}");
    assert_eq!(st.remote_samples, cat.len(), "{st:?}");
    drop(loader);
    stop.store(true, Ordering::Relaxed);
    let seen = served.join().unwrap();
    assert_eq!(seen.accepted, NODES as u64, "{seen:?}");
    assert_eq!(seen.welcomed, NODES as u64, "{seen:?}");
    assert_eq!(seen.refused, 0, "{seen:?}");
    // Each link's first frame asks for heartbeats; every grant went to
    // the sample's owner.
    assert_eq!(seen.asked, NODES as u64, "{seen:?}");
    assert_eq!(seen.misrouted, 0, "{seen:?}");
    // A dropped loader closes every link.
    assert_eq!(seen.closed, NODES as u64, "{seen:?}");
    assert_eq!(
        seen.grants,
        cat.len(),
        "every sample granted once: {seen:?}"
    );
    done_tx.send(()).unwrap();
}
