//! A bucket read directly (`--source s3://…`) with an NVMe cache area
//! (issue 31): the objects' samples kept on the local disk for their next
//! read, the slots read through the same poller loop as the GETs
//! (ring/split.rs). Real S3 server process (s3s-fs, tests/common/s3.rs),
//! `kspeed read` from the command line as a user runs it:
//!
//! - three epochs, every sample checked against the catalog (`--verify`),
//!   the area within its bound and whole (the journal, parsed as
//!   docs/CACHE.md describes it);
//! - a second run finds the area and hits, taking fewer samples from the
//!   bucket; LRU over the same area is exact too.
#![cfg(all(feature = "cli", feature = "s3"))]

#[path = "common/cache_area.rs"]
mod area;
mod common;
#[path = "common/s3.rs"]
mod s3h;

use std::time::Duration;

use common::*;
use kspeed::dataset::Catalog;
use s3h::{files_under, S3Server};

const BUCKET: &str = "cached";
const LIMIT: Duration = Duration::from_secs(300);

fn json(out: &str) -> serde_json::Value {
    let line = out
        .lines()
        .rev()
        .find(|l| l.starts_with('{'))
        .expect("a JSON report");
    serde_json::from_str(line).unwrap()
}

#[test]
fn a_bucket_read_directly_keeps_its_samples_in_the_cache_area() {
    let Some(srv) = S3Server::start() else { return };
    srv.create_bucket(BUCKET);
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    gen("imagenet", 200, &src);
    srv.put_many(
        BUCKET,
        files_under(&src).into_iter().map(|p| {
            let rel = p.strip_prefix(&src).unwrap().to_string_lossy().into_owned();
            (format!("train/{rel}"), std::fs::read(&p).unwrap())
        }),
        16,
        LIMIT,
    );
    let url = format!("s3://{BUCKET}/train/");
    let catalog = tmp.path().join("bucket.ksc");
    srv.ok(&["catalog", "--source", &url, "--out", s(&catalog)], LIMIT);
    let cat = Catalog::open(&catalog).unwrap();
    let third = cat.total_bytes() / 3;
    let cache = tmp.path().join("cache");
    let read = |policy: &str| {
        json(&srv.ok(
            &[
                "read",
                "--source",
                &url,
                "--catalog",
                s(&catalog),
                "--epochs",
                "3",
                "--verify",
                "--json",
                "--cache-dir",
                s(&cache),
                "--cache-bytes",
                &third.to_string(),
                "--cache-policy",
                policy,
                "--no-huge-pages",
                "--no-mlock",
            ],
            LIMIT,
        ))
    };
    let first = read("next-use");
    let n = cat.len();
    assert_eq!(first["samples"], 3 * n);
    let c = &first["cache"];
    let (hits, slots, area_bytes) = (
        c["hits"].as_u64().unwrap(),
        c["slots"].as_u64().unwrap(),
        c["area_bytes"].as_u64().unwrap(),
    );
    // Every read is a GET or a hit.
    assert_eq!(
        first["disk_reads"].as_u64().unwrap() + hits,
        3 * n,
        "{first}"
    );
    assert!(area_bytes <= third && slots > 0, "{c}");
    assert_eq!(c["corrupt"], 0, "{c}");
    let dir = cache.join("rank0");
    assert!(area::check_held(&dir, &cat) > 0);
    // A second run starts with what the first kept.
    let second = read("next-use");
    let c2 = &second["cache"];
    assert!(c2["hits"].as_u64().unwrap() > 0, "{c2}");
    assert!(
        second["per_epoch"][0]["cache_hits"].as_u64().unwrap() > 0,
        "{second}"
    );
    assert_eq!(
        second["disk_reads"].as_u64().unwrap() + c2["hits"].as_u64().unwrap(),
        3 * n
    );
    area::check_held(&dir, &cat);
    // LRU on the same area (it starts from what next use kept): exact too.
    let lru = read("lru");
    assert_eq!(lru["samples"], 3 * n);
    area::check_held(&dir, &cat);
}
