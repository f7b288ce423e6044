//! Stall charged to its cause on one node: a loader reading its space
//! charges every wait to the disk, one serving from its memory tier to the
//! tier, and the causes always add up to the whole stall; `kspeed read
//! --json` reports them. (A stopped peer's share: tests/cluster.rs,
//! `stalled_owner_times_out_and_fails_over`; the agent's: tests/agent.rs.)

mod common;

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
    assert_eq!(c1.disk, c.disk, "epoch 1 read nothing from disk: {c1:?}");
    assert_eq!(st1.disk_reads, st.disk_reads, "{st1:?}");
    assert_eq!(c1.tier, st1.stall - st.stall, "{c1:?}");
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
