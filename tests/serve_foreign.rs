//! A consumer of the push protocol written from docs/PROTOCOL.md and
//! docs/FORMAT.md alone (tests/foreign/serve_consumer.py, standard-library
//! Python, by a reader who never saw src/) against real `kspeed serve`
//! nodes over TCP: two nodes, each holding part of the space (the jump
//! placement), rank 1 of 2's sequence for one seed and epoch, every sample
//! checked by its catalog CRC32C and against its source file. Its sampler
//! is checked against kspeed's own here (the same ids, so the same bytes in
//! all). Every read from the child has a deadline.

mod agent_support;
mod common;
#[path = "common/nodes.rs"]
mod nodes;

use std::path::Path;
use std::time::Duration;

use agent_support::wait_output;
use common::*;
use kspeed::dataset::Catalog;
use kspeed::sampler::{Sampler, SamplerConfig};
use nodes::{preload_nodes, Serve};

const SEED: u64 = 7;
const EPOCH: u64 = 3;

#[test]
fn a_consumer_written_from_the_docs_alone_reads_exactly() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    gen("tiny", 600, &src);
    let catalog = tmp.path().join("cat.ksc");
    ok(&["catalog", "--source", s(&src), "--out", s(&catalog)]);
    let spaces = preload_nodes(&src, &catalog, tmp.path(), 2, &[]);
    let token = tmp.path().join("token");
    std::fs::write(&token, "from-the-docs-token\n").unwrap();
    // Small DATA frames: a sample of several frames too.
    let nodes: Vec<Serve> = ["127.0.0.1:0", "127.0.0.2:0"]
        .iter()
        .zip(&spaces)
        .map(|(listen, sp)| {
            Serve::start_with(&[sp], listen, &token, None, &["--chunk-bytes", "4096"])
        })
        .collect();
    if std::process::Command::new("python3")
        .arg("--version")
        .output()
        .is_err()
    {
        skip("python3 is not installed (the consumer written from the docs is Python)");
        return;
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/foreign/serve_consumer.py");
    let mut cmd = std::process::Command::new("python3");
    cmd.arg(&script)
        .args(["--catalog", s(&catalog), "--token-file", s(&token)]);
    for (n, sp) in nodes.iter().zip(&spaces) {
        cmd.args(["--node", &n.addr])
            .args(["--manifest", s(&sp.join("manifest.ksm"))]);
    }
    let child = cmd
        .args(["--seed", &SEED.to_string(), "--epoch", &EPOCH.to_string()])
        .args(["--rank", "1", "--world", "2", "--ring-bytes", "65536"])
        .arg("--check-source")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn python3");
    let o = wait_output(child, Duration::from_secs(120));
    let out = String::from_utf8_lossy(&o.stdout);
    let last = out.lines().last().unwrap_or_default();
    let r: serde_json::Value =
        serde_json::from_str(last).unwrap_or_else(|e| panic!("{e}: {}", text(&o)));
    assert!(o.status.success(), "{r}\n{}", text(&o));
    assert!(
        r["self_test"]
            .as_object()
            .is_some_and(|t| t.values().all(|v| v == true)),
        "the docs' check values: {r}"
    );
    let res = &r["result"];
    assert_eq!(res["errors"], serde_json::json!([]), "{r}");
    assert_eq!(res["all_crcs_ok"], true, "{r}");
    assert_eq!(res["source_bytes_ok"], true, "{r}");
    // kspeed's own sampler: rank 1 of 2's sequence, its lengths summed.
    let cat = Catalog::open(&catalog).unwrap();
    let sampler = Sampler::new(SamplerConfig::single(cat.len(), SEED).rank_world(1, 2)).unwrap();
    let ids: Vec<u64> = (0..sampler.per_rank())
        .map(|k| sampler.sample(EPOCH, k))
        .collect();
    let bytes: u64 = ids.iter().map(|&i| cat.sample(i).len as u64).sum();
    assert_eq!(res["samples_received"], ids.len() as u64, "{r}");
    assert_eq!(res["bytes"], bytes, "{r}");
}
