//! Tar shards in a bucket read directly with a block shuffle: neighbouring
//! samples of a shard share one ranged GET (ring/store.rs, "merged reads").
//! Every sample of the epoch in the sampler's order, byte for byte the
//! member that was packed; the GETs the store saw, counted by a proxy in
//! front of it, are a fraction of the samples, while the same epoch with
//! a whole-dataset shuffle (nothing to merge) costs about one GET per
//! sample; an object replaced after the catalog fails its merged GET by
//! name (s3s-fs ignores If-Match, as some S3-compatible servers do: the
//! client checks the ETag the answer names; without that check the reads
//! of the replaced shard's ranges returned its new bytes silently). Real S3 server process (s3s-fs, tests/common/s3.rs).
#![cfg(all(feature = "cli", feature = "s3"))]

mod common;
#[path = "common/s3.rs"]
mod s3h;

use std::sync::atomic::Ordering;
use std::time::Duration;

use common::*;
use kspeed::dataset::Catalog;
use kspeed::loader::LoaderBuilder;
use kspeed::sampler::{Sampler, SamplerConfig};
use s3h::*;

const BUCKET: &str = "merge";
const LIMIT: Duration = Duration::from_secs(240);
const SHARDS: u64 = 4;
const PER_SHARD: u64 = 100;

/// One epoch of rank `rank` of `world` with `block`; checks order and
/// bytes and returns the GETs the proxy counted.
fn epoch(
    url: &str,
    cat: &Catalog,
    cat_path: &std::path::Path,
    datas: &[Vec<u8>],
    proxy: &FaultProxy,
    (rank, world): (u32, u32),
    block: u64,
) -> u64 {
    let mut l = LoaderBuilder::source(url)
        .catalog(cat_path)
        .seed(5)
        .shuffle_block(block)
        .rank(rank, world)
        .batch_size(16)
        .pollers(2)
        .queue_depth(64)
        .pin(false)
        .landing(small_landing())
        .build()
        .unwrap();
    let sampler = Sampler::new(
        SamplerConfig::single(cat.len(), 5)
            .shuffle_block(block)
            .rank_world(rank, world),
    )
    .unwrap();
    let before = proxy.requests.load(Ordering::Relaxed);
    l.set_epoch(1).unwrap();
    let mut k = 0u64;
    while let Some(b) = l.next_batch().unwrap() {
        for smp in b.iter() {
            assert_eq!(smp.id, sampler.sample(1, k), "block {block}: step {k}");
            assert_eq!(
                smp.bytes,
                &datas[smp.id as usize][..],
                "block {block}: bytes of sample {}",
                smp.id
            );
            k += 1;
        }
    }
    assert_eq!(k, sampler.per_rank(), "block {block}: a whole epoch");
    proxy.requests.load(Ordering::Relaxed) - before
}

#[test]
fn a_block_shuffle_merges_neighbouring_tar_members_into_one_get() {
    let Some(srv) = S3Server::start() else { return };
    srv.create_bucket(BUCKET);
    let mut datas = Vec::new();
    for s in 0..SHARDS {
        let (tar, d) = shard(s * PER_SHARD, PER_SHARD, true);
        srv.put(BUCKET, &format!("shards/{s:03}.tar"), &tar);
        datas.extend(d);
    }
    // Every request through a counting proxy (no faults injected).
    let proxy = FaultProxy::start(srv.addr(), 0, 0, Duration::ZERO);
    for (k, v) in srv.env() {
        std::env::set_var(k, v);
    }
    std::env::set_var("AWS_ENDPOINT_URL", proxy.endpoint());
    let url = format!("s3://{BUCKET}/shards/*.tar");
    let tmp = tempfile::tempdir().unwrap();
    let cat_path = tmp.path().join("cat.ksc");
    let mut cmd = bare_kspeed_cmd(
        &["catalog", "--source", &url, "--out", s(&cat_path)],
        tmp.path(),
    );
    for (k, v) in srv.env() {
        cmd.env(k, v);
    }
    let o = run_for(cmd, LIMIT);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let cat = Catalog::open(&cat_path).unwrap();
    assert_eq!(cat.len(), SHARDS * PER_SHARD);
    // Samples of zero bytes are never read.
    let nonempty = datas.iter().filter(|d| !d.is_empty()).count() as u64;

    let merged = epoch(&url, &cat, &cat_path, &datas, &proxy, (0, 1), 50);
    let whole = epoch(&url, &cat, &cat_path, &datas, &proxy, (0, 1), 0);
    assert!(
        whole >= nonempty * 9 / 10,
        "a whole-dataset shuffle merges (almost) nothing: {whole} GETs for {nonempty} samples"
    );
    // (The proxy answers one request per connection, and the client
    // retries a request sent on a pooled connection the proxy closed: the
    // counts are connections, up to about two per GET, alike in both.
    // Quiet, blocks of 50 take about a twelfth of the whole shuffle's;
    // with both cores busy a quarter: a GET leaves before it is full
    // while fewer than half the allowed GETs are out.)
    assert!(
        merged * 3 <= whole,
        "blocks of 50: {merged} GETs for {nonempty} samples (whole shuffle: {whole})"
    );
    // A rank of a world takes every other sample of a block: its reads
    // are a tar member apart and still merge.
    let rank1 = epoch(&url, &cat, &cat_path, &datas, &proxy, (1, 2), 50);
    assert!(
        rank1 * 2 <= whole / 2,
        "rank 1 of 2: {rank1} GETs (whole shuffle, all ranks: {whole})"
    );
    // No shuffle: id order, the same merging.
    let mut l = LoaderBuilder::source(&url)
        .catalog(&cat_path)
        .shuffle(false)
        .batch_size(16)
        .pollers(1)
        .queue_depth(64)
        .pin(false)
        .landing(small_landing())
        .build()
        .unwrap();
    let before = proxy.requests.load(Ordering::Relaxed);
    l.set_epoch(0).unwrap();
    let mut next = 0u64;
    while let Some(b) = l.next_batch().unwrap() {
        for smp in b.iter() {
            assert_eq!((smp.id, smp.bytes), (next, &datas[next as usize][..]));
            next += 1;
        }
    }
    let in_order = proxy.requests.load(Ordering::Relaxed) - before;
    assert!(in_order * 3 <= whole, "in id order: {in_order} GETs");
    drop(l);

    // A shard replaced after the catalog: the merged GET fails, and the
    // loader names the object.
    let (tar, _) = shard(1000, PER_SHARD, true);
    srv.put(BUCKET, "shards/002.tar", &tar);
    let mut l = LoaderBuilder::source(&url)
        .catalog(&cat_path)
        .shuffle_block(50)
        .batch_size(16)
        .pollers(1)
        .pin(false)
        .landing(small_landing())
        .build()
        .unwrap();
    let text = epoch_error(&mut l, "a replaced shard must fail its reads");
    assert!(
        text.contains(&format!("s3://{BUCKET}/shards/002.tar")),
        "{text}"
    );
}
