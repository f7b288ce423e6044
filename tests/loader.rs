//! The local data path over real files: every delivered sample is
//! byte-identical to its source and in sampler order, across epochs, ranks,
//! batch sizes, ring sizes, lookaheads and poller counts; faults surface as
//! named errors or are retried; the memory tier serves what it holds.
//!
//! Why this file is over ~800 lines: one property (every sample exact and
//! in order) over many configurations, sharing the same fixtures.

mod common;

use std::path::Path;
use std::process::Command;

use common::*;
use kspeed::dataset::{Catalog, Space};
use kspeed::landing::{CudaMode, LandingOptions};
use kspeed::loader::FaultConfig;
use kspeed::loader::{Loader, LoaderBuilder};
use kspeed::sampler::{Position, Sampler, SamplerConfig};
use kspeed::Error;

fn small_ring(bytes: u64) -> LandingOptions {
    LandingOptions::default()
        .ring_bytes(bytes)
        .huge_pages(false)
        .mlock(true)
        .numa_node(None)
        .gpu_pci(None)
        .cuda(CudaMode::Off)
}

/// A preloaded space with awkward sizes (0, 1, 4095, 4096, 4097, 300000...)
/// plus some generated tiny samples.
/// A `tiny` source of `count` samples under `dir/src`, preloaded into
/// `dir/space`: (source, space).
fn tiny_space(dir: &Path, count: u64) -> (std::path::PathBuf, std::path::PathBuf) {
    let src = dir.join("src");
    gen("tiny", count, &src);
    let sp = dir.join("space");
    ok(&["preload", "--source", s(&src), "--space", s(&sp)]);
    (src, sp)
}

fn odd_space(dir: &Path) -> std::path::PathBuf {
    let src = dir.join("src");
    odd_tree(&src);
    for i in 0..40u64 {
        put(
            &src,
            &format!("fox/extra_{i:03}.bin"),
            &bytes_for(1000 + i, (i as usize * 7919) % 9000),
        );
    }
    let sp = dir.join("space");
    ok(&["preload", "--source", s(&src), "--space", s(&sp)]);
    sp
}

/// Reads `epochs` epochs and checks order, bytes and labels against the
/// catalog and an independent sampler. Returns samples read.
fn check_epochs(
    loader: &mut Loader,
    cat: &Catalog,
    sampler: &Sampler,
    epochs: std::ops::Range<u64>,
    batch: usize,
) -> u64 {
    let mut total = 0;
    let steps = loader.epoch_len();
    let want_steps = if sampler.config().drop_last {
        sampler.per_rank() / batch as u64 * batch as u64
    } else {
        sampler.per_rank()
    };
    assert_eq!(steps, want_steps, "steps per epoch");
    assert_eq!(loader.batches_per_epoch(), steps.div_ceil(batch as u64));
    for e in epochs {
        loader.set_epoch(e).unwrap();
        let mut k = 0u64;
        let mut batches = 0u64;
        while let Some(b) = loader.next_batch().unwrap() {
            // Lock-step: every batch is whole but an epoch's last.
            let left = steps - k;
            assert_eq!(
                b.len() as u64,
                left.min(batch as u64),
                "epoch {e} batch {batches}"
            );
            batches += 1;
            assert_eq!(b.epoch(), e);
            // With tier_views a batch may have samples in the tier: no span.
            let span_bytes = b.in_ring().then(|| {
                let (span, wrap) = b.spans();
                span.len() + wrap.map_or(0, |w| w.len())
            });
            let mut sum = 0usize;
            for smp in b.iter() {
                let want = sampler.sample(e, k);
                assert_eq!(smp.id, want, "epoch {e} step {k}: wrong sample");
                assert_eq!(smp.position, Position { epoch: e, index: k });
                let c = cat.sample(smp.id);
                assert_eq!(smp.bytes.len(), c.len as usize);
                assert_eq!(
                    crc32c::crc32c(smp.bytes),
                    c.crc32c,
                    "sample {} bytes differ",
                    smp.id
                );
                assert_eq!(smp.label, c.label);
                sum += smp.bytes.len();
                k += 1;
            }
            if let Some(span_bytes) = span_bytes {
                assert!(span_bytes >= sum, "the spans cover the samples");
            }
        }
        assert_eq!(k, steps, "epoch {e} delivered {k} samples");
        assert_eq!(batches, loader.batches_per_epoch(), "epoch {e} batches");
        total += k;
    }
    total
}

#[test]
fn ordered_and_byte_identical_across_configs() {
    let t = tempfile::tempdir().unwrap();
    let sp = odd_space(t.path());
    let space = Space::open(&sp).unwrap();
    let cat = space.catalog();
    // (batch, ring bytes, lookahead, pollers, rank, world, drop_last, queue
    // depth, submission batch)
    type Config = (usize, u64, u64, usize, u32, u32, bool, u32, u32);
    let configs: &[Config] = &[
        (1, 512 << 10, u64::MAX, 1, 0, 1, false, 1, 1),
        (7, 512 << 10, 3, 2, 0, 1, false, 4, 1),
        (64, 4 << 20, u64::MAX, 2, 1, 3, false, 32, 8),
        (5, 1 << 20, 1, 1, 2, 3, true, 8, 3),
        (16, 600 << 10, 50, 3, 0, 2, false, 2, 64),
    ];
    let mut refused = 0;
    for &(batch, ring, lookahead, pollers, rank, world, drop_last, qd, sb) in configs {
        let builder = LoaderBuilder::space(&sp)
            .batch_size(batch)
            .landing(small_ring(ring))
            .lookahead(lookahead)
            .pollers(pollers)
            .queue_depth(qd)
            .submit_batch(sb)
            .rank(rank, world)
            .drop_last(drop_last)
            .seed(11);
        // A ring too small for a whole batch is refused, naming the size
        // that is enough; that size must then work.
        let mut loader = match builder.clone().build() {
            Ok(l) => l,
            Err(Error::RingTooSmallForBatch { needed_bytes, .. }) => {
                assert!(needed_bytes > ring);
                refused += 1;
                builder
                    .landing(small_ring(needed_bytes))
                    .build()
                    .unwrap_or_else(|e| panic!("build {batch} {needed_bytes}: {e}"))
            }
            Err(e) => panic!("build {batch} {ring}: {e}"),
        };
        let sampler = Sampler::new(
            SamplerConfig::single(cat.len(), 11)
                .rank_world(rank, world)
                .shuffle(true)
                .drop_last(drop_last),
        )
        .unwrap();
        let n = check_epochs(&mut loader, cat, &sampler, 0..3, batch);
        assert_eq!(n, 3 * loader.epoch_len());
        let st = loader.finish();
        assert_eq!(st.samples, n);
        // Every delivered sample was read from disk, except empty ones
        // (at most every empty sample of the catalog once per epoch).
        let empty = (0..cat.len()).filter(|&i| cat.sample(i).len == 0).count() as u64;
        assert!(st.disk_reads + 3 * empty >= n, "{st:?}");
        assert!(
            st.read_latency.count > 0 && st.read_latency.p50_us > 0,
            "{st:?}"
        );
    }
    assert!(refused > 0, "some ring above is too small for its batch");
}

#[test]
fn zero_counts_are_named_config_errors() {
    let t = tempfile::tempdir().unwrap();
    let sp = odd_space(t.path());
    for (what, b) in [
        ("pollers", LoaderBuilder::space(&sp).pollers(0)),
        ("queue_depth", LoaderBuilder::space(&sp).queue_depth(0)),
        ("submit_batch", LoaderBuilder::space(&sp).submit_batch(0)),
    ] {
        match b.landing(small_ring(1 << 20)).build() {
            Err(Error::InvalidConfig(msg)) => assert!(msg.contains(what), "{what}: {msg}"),
            Err(e) => panic!("{what} = 0: wrong error: {e}"),
            Ok(_) => panic!("{what} = 0 built a loader"),
        }
    }
}

#[test]
fn a_gpu_ring_outside_rdma_cluster_mode_is_a_named_error() {
    // The CPU cannot read GPU memory and the pollers cannot read into it,
    // so only RDMA writes may fill a GPU ring; anything else is refused at
    // build, before CUDA is even looked for.
    let t = tempfile::tempdir().unwrap();
    let sp = odd_space(t.path());
    match LoaderBuilder::space(&sp).gpu_ring(Some(0)).build() {
        Err(Error::InvalidConfig(msg)) => {
            assert!(
                msg.contains("GPU memory (device 0) needs cluster mode over RDMA"),
                "{msg}"
            )
        }
        Err(e) => panic!("wrong error: {e}"),
        Ok(_) => panic!("a GPU ring without RDMA was built"),
    }
}

#[test]
fn sample_larger_than_the_ring_is_an_error_at_build() {
    let t = tempfile::tempdir().unwrap();
    let sp = odd_space(t.path());
    match LoaderBuilder::space(&sp)
        .landing(small_ring(256 << 10))
        .build()
    {
        Err(Error::SampleLargerThanRing { len, .. }) => assert_eq!(len, 300_000),
        Err(e) => panic!("wrong error: {e}"),
        Ok(_) => panic!("built a loader whose ring cannot hold a sample"),
    }
}

#[test]
fn without_shuffle_in_id_order_and_restart_at_any_epoch() {
    let t = tempfile::tempdir().unwrap();
    let sp = odd_space(t.path());
    let space = Space::open(&sp).unwrap();
    let mut loader = LoaderBuilder::space(&sp)
        .shuffle(false)
        .batch_size(10)
        .landing(small_ring(1 << 20))
        .build()
        .unwrap();
    let b = loader.next_batch().unwrap().unwrap();
    let ids: Vec<u64> = b.iter().map(|s| s.id).collect();
    assert_eq!(ids, (0..10).collect::<Vec<_>>());
    drop(b);
    // Jump to epoch 5 mid-epoch: restarts there.
    let sampler =
        Sampler::new(SamplerConfig::single(space.catalog().len(), 0).shuffle(false)).unwrap();
    check_epochs(&mut loader, space.catalog(), &sampler, 5..7, 10);
}

#[test]
fn save_and_resume_position() {
    let t = tempfile::tempdir().unwrap();
    let sp = odd_space(t.path());
    let space = Space::open(&sp).unwrap();
    let cat = space.catalog();
    let build = || {
        LoaderBuilder::space(&sp)
            .batch_size(6)
            .seed(3)
            .rank(1, 2)
            .landing(small_ring(1 << 20))
            .build()
            .unwrap()
    };
    let mut a = build();
    a.set_epoch(0).unwrap();
    while a.next_batch().unwrap().is_some() {}
    a.set_epoch(1).unwrap();
    for _ in 0..2 {
        a.next_batch().unwrap().unwrap();
    }
    let saved = a.save_position();
    assert_eq!(
        a.position(),
        Position {
            epoch: 1,
            index: 12
        }
    );
    let rest: Vec<u64> = std::iter::from_fn(|| {
        a.next_batch()
            .unwrap()
            .map(|b| b.iter().map(|s| s.id).collect::<Vec<_>>())
    })
    .flatten()
    .collect();
    drop(a);

    let mut b = build();
    b.restore_position(&saved).unwrap();
    assert_eq!(
        b.position(),
        Position {
            epoch: 1,
            index: 12
        }
    );
    let resumed: Vec<u64> = std::iter::from_fn(|| {
        b.next_batch()
            .unwrap()
            .map(|b| b.iter().map(|s| s.id).collect::<Vec<_>>())
    })
    .flatten()
    .collect();
    assert_eq!(rest, resumed);
    // And the next epoch continues normally.
    let sampler = Sampler::new(
        SamplerConfig::single(cat.len(), 3)
            .rank_world(1, 2)
            .shuffle(true)
            .drop_last(false),
    )
    .unwrap();
    check_epochs(&mut b, cat, &sampler, 2..3, 6);
    // A position from another configuration is refused.
    let mut other = LoaderBuilder::space(&sp)
        .seed(4)
        .landing(small_ring(1 << 20))
        .build()
        .unwrap();
    assert!(matches!(
        other.restore_position(&saved),
        Err(Error::BadPosition(_))
    ));
}

#[test]
fn injected_eio_is_a_named_error_after_correct_samples() {
    let t = tempfile::tempdir().unwrap();
    let sp = odd_space(t.path());
    let space = Space::open(&sp).unwrap();
    let cat = space.catalog();
    let sampler = Sampler::new(SamplerConfig::single(cat.len(), 1)).unwrap();
    let mut loader = LoaderBuilder::space(&sp)
        .seed(1)
        .batch_size(4)
        .pollers(2)
        .landing(small_ring(1 << 20))
        .fault_injection(
            FaultConfig::default()
                .seed(5)
                .eio_ppm(30_000)
                .short_ppm(0)
                .delay_ppm(0),
        )
        .build()
        .unwrap();
    let mut k = 0u64;
    let mut epoch = 0;
    let err = loop {
        let end_of_epoch = match loader.next_batch() {
            Ok(Some(b)) => {
                for smp in b.iter() {
                    assert_eq!(smp.id, sampler.sample(epoch, k));
                    assert_eq!(crc32c::crc32c(smp.bytes), cat.sample(smp.id).crc32c);
                    k += 1;
                }
                false
            }
            Ok(None) => true,
            Err(e) => break e,
        };
        if end_of_epoch {
            epoch += 1;
            assert!(epoch < 50, "no fault in 50 epochs");
            loader.set_epoch(epoch).unwrap();
            k = 0;
        }
    };
    match &err {
        Error::ReadFailed {
            sample,
            path,
            errno_name,
            ..
        } => {
            assert_eq!(errno_name.0, libc::EIO);
            // The failing sample is in the batch that was being assembled.
            let in_batch =
                (k..(k + 4).min(sampler.per_rank())).any(|j| sampler.sample(epoch, j) == *sample);
            assert!(
                in_batch,
                "sample {sample} is not among steps {k}.. of epoch {epoch}"
            );
            assert!(
                path.to_string_lossy().contains("extents/"),
                "{}",
                path.display()
            );
            let msg = err.to_string();
            assert!(
                msg.contains(&format!("sample {sample}"))
                    && msg.contains("errno 5 (Input/output error)"),
                "{msg}"
            );
        }
        e => panic!("expected ReadFailed, got {e}"),
    }
    // The loader stays failed, clearly.
    assert!(matches!(loader.next_batch(), Err(Error::LoaderFailed(_))));
}

#[test]
fn short_reads_are_retried_and_delays_keep_order() {
    let t = tempfile::tempdir().unwrap();
    let sp = odd_space(t.path());
    let space = Space::open(&sp).unwrap();
    let cat = space.catalog();
    let mut loader = LoaderBuilder::space(&sp)
        .seed(2)
        .batch_size(8)
        .pollers(2)
        .queue_depth(8)
        .landing(small_ring(1 << 20))
        .fault_injection(
            FaultConfig::default()
                .seed(9)
                .eio_ppm(0)
                .short_ppm(150_000)
                .delay_ppm(300_000),
        )
        .build()
        .unwrap();
    let sampler = Sampler::new(SamplerConfig::single(cat.len(), 2)).unwrap();
    check_epochs(&mut loader, cat, &sampler, 0..4, 8);
    assert!(loader.stats().retries > 0, "no short read was injected");
}

#[test]
fn extent_truncated_after_preload_is_detected() {
    let t = tempfile::tempdir().unwrap();
    let sp = odd_space(t.path());
    let space = Space::open(&sp).unwrap();
    let ext = space.extent_path(0);
    let len = std::fs::metadata(&ext).unwrap().len();
    // Truncated before the loader opens: refused at build, naming the extent.
    let f = std::fs::OpenOptions::new().write(true).open(&ext).unwrap();
    f.set_len(len / 2).unwrap();
    match LoaderBuilder::space(&sp)
        .landing(small_ring(1 << 20))
        .build()
    {
        Err(Error::Truncated { path, .. }) => assert_eq!(path, ext),
        Err(e) => panic!("wrong error {e}"),
        Ok(_) => panic!("opened a truncated space"),
    }
    f.set_len(len).unwrap();
    // Truncated while reading: the first sample past the end is a named error.
    // (Read-ahead is one sample, so the pollers, which are running once
    // build returns, cannot have read the second half before the truncation.)
    let mut loader = LoaderBuilder::space(&sp)
        .shuffle(false)
        .batch_size(1)
        .lookahead(1)
        .landing(small_ring(1 << 20))
        .build()
        .unwrap();
    f.set_len(len / 2).unwrap();
    let err = loop {
        match loader.next_batch() {
            Ok(Some(_)) => {}
            Ok(None) => panic!("read a whole epoch from a truncated extent"),
            Err(e) => break e,
        }
    };
    match err {
        Error::ShortRead { path, sample, .. } => {
            assert_eq!(path, ext);
            let loc = space.location(sample).unwrap();
            assert!(loc.offset + space.catalog().sample(sample).len as u64 > len / 2);
        }
        e => panic!("expected ShortRead, got {e}"),
    }
}

#[test]
fn memory_tier_serves_what_it_holds() {
    let t = tempfile::tempdir().unwrap();
    let (_, sp) = tiny_space(t.path(), 400);
    let space = Space::open(&sp).unwrap();
    let cat = space.catalog();
    let total = cat.total_bytes();
    let sampler = Sampler::new(SamplerConfig::single(cat.len(), 8)).unwrap();

    // Everything fits: after epoch 0 fills the tier, later epochs read no
    // disk, but for epoch-1 samples prefetched while their epoch-0 read was
    // still in flight (at most pollers x queue depth = 8).
    let mut loader = LoaderBuilder::space(&sp)
        .pollers(1)
        .queue_depth(8)
        .seed(8)
        .tier_bytes(total * 2)
        .landing(small_ring(1 << 20))
        .build()
        .unwrap();
    assert_eq!(loader.tier().unwrap().0, 400);
    check_epochs(&mut loader, cat, &sampler, 0..1, 64);
    let after_first = loader.stats().disk_reads;
    check_epochs(&mut loader, cat, &sampler, 1..3, 64);
    let st = loader.stats();
    assert!(
        st.disk_reads - after_first <= 8,
        "epochs 1-2 read {} samples from disk",
        st.disk_reads - after_first
    );
    assert!(st.tier_hits >= 700);
    drop(loader);

    // Half fits: hit rate in later epochs equals the member fraction.
    let mut loader = LoaderBuilder::space(&sp)
        .seed(8)
        .tier_bytes(total / 2)
        .landing(small_ring(1 << 20))
        .build()
        .unwrap();
    let (members, _) = loader.tier().unwrap();
    check_epochs(&mut loader, cat, &sampler, 0..1, 64);
    let s1 = loader.stats();
    check_epochs(&mut loader, cat, &sampler, 1..4, 64);
    let s2 = loader.stats();
    let hits = (s2.tier_hits - s1.tier_hits) as f64;
    let reads = (s2.disk_reads - s1.disk_reads) as f64;
    let rate = hits / (hits + reads);
    let frac = members as f64 / 400.0;
    assert!(
        (rate - frac).abs() < 0.08,
        "hit rate {rate:.3}, member fraction {frac:.3}"
    );
}

/// A rank of several reads another share of the dataset each epoch: its
/// tier holds the samples it reads most often in the coming epochs (the
/// rule of docs/CACHE.md, "The memory tier", recomputed here from the
/// rank's own sampler), and hits what those counts promise, where a fixed
/// subset by id would hold many samples the rank does not read again.
#[test]
fn a_rank_of_several_keeps_in_its_tier_what_it_reads_most() {
    let t = tempfile::tempdir().unwrap();
    let (_, sp) = tiny_space(t.path(), 400);
    let space = Space::open(&sp).unwrap();
    let cat = space.catalog();
    let (rank, world, epochs) = (1u32, 4u32, 8u64);
    let budget = cat.total_bytes() / 4;
    let sampler =
        Sampler::new(SamplerConfig::single(cat.len(), 8).rank_world(rank, world)).unwrap();
    let mut reads = vec![0u64; cat.len() as usize];
    for e in 0..epochs {
        for k in 0..sampler.per_rank() {
            reads[sampler.sample(e, k) as usize] += 1;
        }
    }
    // Members as the rule says: most reads first, then by id, while they
    // fit (a slot is the length rounded up to 64 bytes); hits: a member
    // read k times hits k - 1 times.
    let fit = |order: &mut dyn Iterator<Item = u64>| {
        let (mut used, mut members, mut hits) = (0u64, 0u64, 0u64);
        for id in order {
            let slot = (cat.sample(id).len as u64).next_multiple_of(64);
            if used + slot <= budget {
                used += slot;
                members += 1;
                hits += reads[id as usize].saturating_sub(1);
            }
        }
        (members, hits)
    };
    let mut by_reads: Vec<u64> = (0..cat.len()).collect();
    by_reads.sort_by_key(|&id| (std::cmp::Reverse(reads[id as usize]), id));
    let (members, promised) = fit(&mut by_reads.into_iter());
    let (_, by_id) = fit(&mut (0..cat.len()));
    assert!(
        promised >= 2 * by_id,
        "the counts promise {promised} hits, id order {by_id}"
    );
    let mut loader = LoaderBuilder::space(&sp)
        .rank(rank, world)
        .seed(8)
        .end_epoch(Some(epochs))
        .tier_bytes(budget)
        .landing(small_ring(1 << 20))
        .build()
        .unwrap();
    assert_eq!(loader.tier().unwrap().0, members);
    check_epochs(&mut loader, cat, &sampler, 0..epochs, 64);
    let hits = loader.stats().tier_hits;
    // A member's first read fills it; a read planned while that fill was
    // still in flight (at most the ring's lookahead, across an epoch's
    // end) goes to disk instead.
    assert!(
        hits <= promised && hits * 10 >= promised * 9,
        "{hits} tier hits, the counts promise {promised} (id order: {by_id})"
    );
    eprintln!("{hits} tier hits of {promised} promised; id order would give {by_id}");
}

/// `tier_views`: samples in the tier are handed out in place (no copy into
/// the ring), in order and byte-identical over several epochs, while other
/// members are still being filled (rank 0 of 2 reads half the set each
/// epoch, so the tier fills over several epochs); a batch held while many
/// more are taken and released keeps its bytes (tier members are never
/// rewritten, however small the ring).
#[test]
fn tier_views_hand_out_tier_bytes_in_place() {
    let t = tempfile::tempdir().unwrap();
    let (_, sp) = tiny_space(t.path(), 400);
    let space = Space::open(&sp).unwrap();
    let cat = space.catalog();
    let total = cat.total_bytes();
    let cfg = SamplerConfig::single(cat.len(), 9).rank_world(0, 2);
    let sampler = Sampler::new(cfg).unwrap();
    let build = |views: bool| {
        LoaderBuilder::space(&sp)
            .rank(0, 2)
            .batch_size(8)
            .seed(9)
            .tier_bytes(total / 2)
            .tier_views(views)
            .landing(small_ring(256 << 10))
            .build()
            .unwrap()
    };
    let mut loader = build(true);
    check_epochs(&mut loader, cat, &sampler, 0..5, 8);
    let st = loader.stats();
    assert!(st.tier_hits > 200, "{st:?}");

    // Which batches had tier samples: their bytes are outside the ring.
    loader.set_epoch(5).unwrap();
    let mut out_of_ring = 0;
    while let Some(b) = loader.next_batch().unwrap() {
        assert_eq!(b.in_ring(), b.iter().all(|x| !x.in_tier));
        if !b.in_ring() {
            out_of_ring += 1;
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| b.spans().0.len()));
            assert!(r.is_err(), "spans() of a batch with tier views panics");
        }
    }
    assert!(out_of_ring > 0, "no batch had samples in the tier");

    // Hold one batch (views and ring samples) across many others.
    loader.set_epoch(6).unwrap();
    assert!(loader.acquire_batch_keep().unwrap() > 0);
    let held: Vec<(u64, *const u8, usize)> = (0..loader.held_len())
        .map(|i| {
            let smp = loader.held_sample(i);
            (smp.id, smp.bytes.as_ptr(), smp.bytes.len())
        })
        .collect();
    let mut more = 0;
    // More batches beside the held one, as far as the 256 KiB ring allows.
    for _ in 0..6 {
        match loader.acquire_batch_keep() {
            Ok(n) if n > 0 => more += 1,
            _ => break,
        }
    }
    assert!(more > 0, "took no batch beside the held one");
    for &(id, ptr, len) in &held {
        // SAFETY: the batch holding these samples is still out (kept), so
        // their bytes (ring slots behind the released mark, or tier views)
        // stay put.
        let bytes = unsafe { std::slice::from_raw_parts(ptr, len) };
        assert_eq!(crc32c::crc32c(bytes), cat.sample(id).crc32c, "sample {id}");
    }
    loader.release_batch();
    drop(loader);

    // The same run without views: every batch is one span of the ring.
    let mut loader = build(false);
    check_epochs(&mut loader, cat, &sampler, 0..3, 8);
    loader.set_epoch(3).unwrap();
    while let Some(b) = loader.next_batch().unwrap() {
        assert!(b.in_ring());
    }
}

/// Views of the tier stay valid and unchanged while the tier goes on
/// filling: a batch of tier views is held (pointers taken as a C caller
/// would) while the rest of the epoch is read with a tiny ring and other
/// members get filled, then checked.
#[test]
fn tier_views_stay_put_while_the_tier_fills() {
    let t = tempfile::tempdir().unwrap();
    let (_, sp) = tiny_space(t.path(), 600);
    let space = Space::open(&sp).unwrap();
    let cat = space.catalog();
    let mut loader = LoaderBuilder::space(&sp)
        .rank(0, 3)
        .batch_size(4)
        .seed(3)
        .tier_bytes(cat.total_bytes() / 3)
        .tier_views(true)
        .landing(small_ring(128 << 10))
        .build()
        .unwrap();
    let mut views: Vec<(u64, *const u8, usize)> = Vec::new();
    let mut checked = 0;
    for e in 0..8 {
        loader.set_epoch(e).unwrap();
        while loader.acquire_batch().unwrap() > 0 {
            for i in 0..loader.held_len() {
                let smp = loader.held_sample(i);
                if smp.in_tier {
                    assert!(
                        !loader.held_in_ring(),
                        "a tier view in a batch 'in the ring'"
                    );
                }
                if smp.in_tier && views.len() < 64 {
                    // Remember views handed out so far; the tier's memory
                    // is never written again for them, whatever comes next.
                    views.push((smp.id, smp.bytes.as_ptr(), smp.bytes.len()));
                }
            }
            for &(id, ptr, len) in &views {
                // SAFETY: tier views: filled members are never rewritten and
                // the tier lives as long as the loader (alive here); only
                // tier samples are in `views`.
                let bytes = unsafe { std::slice::from_raw_parts(ptr, len) };
                assert_eq!(crc32c::crc32c(bytes), cat.sample(id).crc32c, "sample {id}");
                checked += 1;
            }
        }
    }
    assert!(checked > 1000, "checked {checked} views");
}

#[test]
fn reads_sources_directly() {
    let t = tempfile::tempdir().unwrap();
    let src = t.path().join("src");
    odd_tree(&src);
    let cat_path = t.path().join("c.ksc");
    ok(&["catalog", "--source", s(&src), "--out", s(&cat_path)]);
    let cat = Catalog::open(&cat_path).unwrap();
    let sampler = Sampler::new(SamplerConfig::single(cat.len(), 4)).unwrap();
    let mut loader = LoaderBuilder::source(s(&src))
        .catalog(&cat_path)
        .seed(4)
        .batch_size(3)
        .landing(small_ring(1 << 20))
        .build()
        .unwrap();
    check_epochs(&mut loader, &cat, &sampler, 0..2, 3);
    drop(loader);
    // Without a catalog: one is built on the fly.
    let mut loader = LoaderBuilder::source(s(&src))
        .seed(4)
        .batch_size(3)
        .landing(small_ring(1 << 20))
        .build()
        .unwrap();
    check_epochs(&mut loader, &cat, &sampler, 0..1, 3);
    drop(loader);
    // A source file removed after the catalog was built: named error.
    std::fs::remove_file(src.join("dog/img_004.bin")).unwrap();
    let mut loader = LoaderBuilder::source(s(&src))
        .catalog(&cat_path)
        .seed(4)
        .landing(small_ring(1 << 20))
        .build()
        .unwrap();
    let r = loader.next_batch().map(|b| b.map(|b| b.len()));
    match r {
        Err(Error::ReadFailed {
            path, errno_name, ..
        }) => {
            assert!(path.ends_with("dog/img_004.bin"));
            assert_eq!(errno_name.0, libc::ENOENT);
        }
        Err(e) => panic!("wrong error {e}"),
        Ok(_) => panic!("read a batch with a missing file"),
    }
}

#[test]
fn read_command_reports_throughput() {
    let t = tempfile::tempdir().unwrap();
    let sp = odd_space(t.path());
    let out = ok(&[
        "read",
        "--space",
        s(&sp),
        "--epochs",
        "2",
        "--batch-size",
        "8",
        "--ring-bytes",
        "2MiB",
        "--verify",
    ]);
    for want in [
        "epoch 0: 53 samples",
        "epoch 1: 53 samples",
        "samples/s",
        "GB/s",
        "p50",
        "p99",
        "stall:",
        "CPU:",
    ] {
        assert!(out.contains(want), "missing {want:?} in\n{out}");
    }
    let e = fails(&["read", "--space", s(&sp), "--ring-bytes", "128KiB"], 1);
    assert!(
        e.contains("does not fit in the") && e.contains("ring"),
        "{e}"
    );
}

/// A space an unprivileged user can read (its files are private, 0600, by
/// default), for tests that run kspeed as another user under prlimit;
/// None (a skip) without root, prlimit or setpriv.
fn space_for_nobody(test: &str) -> Option<(tempfile::TempDir, std::path::PathBuf)> {
    if !is_root() || Command::new("prlimit").arg("--version").output().is_err() {
        skip(&format!("{test} needs root, setpriv and prlimit"));
        return None;
    }
    let t = tempfile::tempdir().unwrap();
    let sp = odd_space(t.path());
    for d in [t.path().to_path_buf(), sp.clone(), sp.join("extents")] {
        std::fs::set_permissions(&d, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    }
    for d in [sp.clone(), sp.join("extents")] {
        for f in std::fs::read_dir(&d).unwrap() {
            let p = f.unwrap().path();
            if p.is_file() {
                std::fs::set_permissions(&p, std::os::unix::fs::PermissionsExt::from_mode(0o644))
                    .unwrap();
            }
        }
    }
    Some((t, sp))
}

#[test]
fn memlock_limit_is_a_named_error() {
    let Some((_t, sp)) = space_for_nobody("memlock_limit_is_a_named_error") else {
        return;
    };
    let o = Command::new("prlimit")
        .args([
            "--memlock=65536:65536",
            "setpriv",
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            kspeed_bin(),
        ])
        .args([
            "read",
            "--space",
            s(&sp),
            "--ring-bytes",
            "8MiB",
            "--progress=none",
        ])
        .output()
        .unwrap();
    let e = text(&o);
    assert_eq!(o.status.code(), Some(1), "{e}");
    assert!(
        e.contains("RLIMIT_MEMLOCK is 65536 bytes") && e.contains("cannot mlock"),
        "{e}"
    );
}

#[test]
fn large_samples_are_read_in_parts() {
    let t = tempfile::tempdir().unwrap();
    let sp = odd_space(t.path());
    let space = Space::open(&sp).unwrap();
    let cat = space.catalog();
    let sampler = Sampler::new(SamplerConfig::single(cat.len(), 6)).unwrap();
    // 4 KiB parts and 3 reads in flight: the 300,000-byte sample takes 74
    // parts issued a few at a time; with short reads and delays injected.
    let mut loader = LoaderBuilder::space(&sp)
        .seed(6)
        .batch_size(5)
        .queue_depth(3)
        .max_read_bytes(4096)
        .landing(small_ring(1 << 20))
        .fault_injection(
            FaultConfig::default()
                .seed(2)
                .eio_ppm(0)
                .short_ppm(50_000)
                .delay_ppm(200_000),
        )
        .build()
        .unwrap();
    check_epochs(&mut loader, cat, &sampler, 0..2, 5);
    let st = loader.finish();
    assert!(st.retries > 0);
}

#[test]
fn sqpoll_and_numa_binding() {
    let t = tempfile::tempdir().unwrap();
    let sp = odd_space(t.path());
    let space = Space::open(&sp).unwrap();
    let cat = space.catalog();
    let sampler = Sampler::new(SamplerConfig::single(cat.len(), 12)).unwrap();
    let numa = Path::new("/sys/devices/system/node/node0")
        .exists()
        .then_some(0);
    if numa.is_none() {
        eprintln!("no NUMA node 0 in sysfs: testing SQPOLL without binding");
    }
    let mut loader = LoaderBuilder::space(&sp)
        .seed(12)
        .sqpoll(Some(50))
        .landing(small_ring(1 << 20).numa_node(numa))
        .build()
        .unwrap();
    assert_eq!(loader.landing_info().numa_node, numa);
    check_epochs(&mut loader, cat, &sampler, 0..2, 64);
}

#[test]
fn verify_crc32c_catches_a_corrupt_extent_and_spans_hold_the_batch() {
    let t = tempfile::tempdir().unwrap();
    let sp = odd_space(t.path());
    let space = Space::open(&sp).unwrap();
    // Every sample's bytes lie inside the batch's spans, in order.
    let mut loader = LoaderBuilder::space(&sp)
        .batch_size(9)
        .landing(small_ring(1 << 20))
        .build()
        .unwrap();
    while let Some(b) = loader.next_batch().unwrap() {
        let (a, w) = b.spans();
        let within = |x: &[u8]| {
            let (p, e) = (x.as_ptr() as usize, x.as_ptr() as usize + x.len());
            let inside = |s: &[u8]| p >= s.as_ptr() as usize && e <= s.as_ptr() as usize + s.len();
            inside(a) || w.is_some_and(inside)
        };
        assert!(b.iter().all(|s| within(s.bytes)));
    }
    drop(loader);
    // Flip one byte of a sample on disk: with CRC checking on, reading it
    // is a named error naming the sample and the extent.
    let victim = (0..space.catalog().len())
        .find(|&i| space.catalog().sample(i).len > 100)
        .unwrap();
    let loc = space.location(victim).unwrap();
    let ext = space.extent_path(loc.extent);
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&ext)
        .unwrap();
    let mut b = [0u8; 1];
    std::os::unix::fs::FileExt::read_exact_at(&f, &mut b, loc.offset + 50).unwrap();
    b[0] ^= 0x10;
    std::os::unix::fs::FileExt::write_all_at(&f, &b, loc.offset + 50).unwrap();
    f.sync_all().unwrap();
    let mut loader = LoaderBuilder::space(&sp)
        .verify_crc32c(true)
        .landing(small_ring(1 << 20))
        .build()
        .unwrap();
    let err = loop {
        match loader.next_batch().map(|b| b.is_some()) {
            Ok(true) => {}
            Ok(false) => panic!("read the epoch without noticing the corrupt sample"),
            Err(e) => break e,
        }
    };
    match err {
        Error::SampleCorrupt { sample, path, .. } => {
            assert_eq!(sample, victim);
            assert_eq!(path, ext);
        }
        e => panic!("expected SampleCorrupt, got {e}"),
    }
}

/// A batch that fails part way (a corrupt sample in its middle, CRC
/// checking on) is not delivered: the failed loader's position stays at
/// the batch's first sample, its stats and digest count only the batches
/// handed out, and a new loader restored from its saved position (after
/// the space is repaired) reads the failed batch whole: every sample of
/// the epoch exactly once across the two.
#[test]
fn a_batch_that_fails_part_way_is_not_delivered_and_a_resume_reads_it() {
    let t = tempfile::tempdir().unwrap();
    let sp = odd_space(t.path());
    let space = Space::open(&sp).unwrap();
    let batch = 9usize;
    let builder = || {
        LoaderBuilder::space(&sp)
            .batch_size(batch)
            .seed(5)
            .verify_crc32c(true)
            .end_epoch(Some(1))
            .landing(small_ring(1 << 20))
    };
    // The epoch's order, read clean.
    let mut order = Vec::new();
    let mut l = builder().build().unwrap();
    while let Some(b) = l.next_batch().unwrap() {
        order.extend(b.iter().map(|x| x.id));
    }
    drop(l);
    // A victim in the middle of a batch past the first.
    let k = (batch..order.len())
        .find(|&k| k % batch >= 3 && space.catalog().sample(order[k]).len > 100)
        .expect("a sample in the middle of a batch");
    let victim = order[k];
    let loc = space.location(victim).unwrap();
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(space.extent_path(loc.extent))
        .unwrap();
    let flip = |f: &std::fs::File| {
        let mut b = [0u8; 1];
        std::os::unix::fs::FileExt::read_exact_at(f, &mut b, loc.offset + 50).unwrap();
        b[0] ^= 0x10;
        std::os::unix::fs::FileExt::write_all_at(f, &b, loc.offset + 50).unwrap();
        f.sync_all().unwrap();
    };
    flip(&f);
    let mut l = builder().build().unwrap();
    let mut got = Vec::new();
    let err = loop {
        match l.next_batch() {
            Ok(Some(b)) => got.extend(b.iter().map(|x| x.id)),
            Ok(None) => panic!("read the epoch without noticing the corrupt sample"),
            Err(e) => break e,
        }
    };
    assert!(
        matches!(err, Error::SampleCorrupt { sample, .. } if sample == victim),
        "{err}"
    );
    let first = k - k % batch;
    assert_eq!(got, order[..first], "the batches handed out");
    assert_eq!(
        l.position().index,
        first as u64,
        "back at the failed batch's start"
    );
    let st = l.stats();
    assert_eq!(
        st.samples, first as u64,
        "samples counts only delivered batches"
    );
    assert_eq!(l.digest().0.count, first as u64, "the digest likewise");
    let saved = l.save_position();
    drop(l);
    // Repaired, resumed from the failed loader's position: the rest of
    // the epoch, the failed batch first and whole.
    flip(&f);
    let mut l = builder().build().unwrap();
    l.restore_position(&saved).unwrap();
    while let Some(b) = l.next_batch().unwrap() {
        got.extend(b.iter().map(|x| x.id));
    }
    assert_eq!(got, order, "every sample of the epoch once, in order");
    let (digest, _) = l.digest();
    assert_eq!(digest.count, order.len() as u64);
}

/// DDP lock-step: every rank of a job gets the same number of batches per
/// epoch, each whole but the last, whatever its own sample sizes; a ring
/// that could only deliver some batch cut short is refused at build.
#[test]
fn every_rank_gets_the_same_whole_batches() {
    let t = tempfile::tempdir().unwrap();
    let src = t.path().join("src");
    gen("imagenet", 200, &src);
    let sp = t.path().join("space");
    ok(&["preload", "--source", s(&src), "--space", s(&sp)]);
    let batch = 16usize;
    // The case that used to give ranks 15 vs 13 batches: refused now,
    // naming the ring size that is enough.
    let needed = match LoaderBuilder::space(&sp)
        .batch_size(batch)
        .rank(0, 2)
        .landing(small_ring(1 << 20))
        .build()
    {
        Err(Error::RingTooSmallForBatch {
            needed_bytes,
            ring_bytes,
            batch_size,
            ..
        }) => {
            assert_eq!((ring_bytes, batch_size), (1 << 20, batch));
            assert!(needed_bytes > 1 << 20);
            needed_bytes
        }
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("a 1 MiB ring cannot hold 16 imagenet samples, and was accepted"),
    };
    let msg = LoaderBuilder::space(&sp)
        .batch_size(batch)
        .landing(small_ring(1 << 20))
        .build()
        .err()
        .unwrap()
        .to_string();
    assert!(msg.contains(&needed.to_string()), "{msg}");
    for seed in 0..12u64 {
        for world in [2u32, 3, 5] {
            for drop_last in [false, true] {
                // The smallest ring allowed, and a little more (other wraps).
                let ring = needed + (seed % 3) * 4096;
                let mut counts = Vec::new();
                for rank in 0..world {
                    let mut l = LoaderBuilder::space(&sp)
                        .batch_size(batch)
                        .seed(seed)
                        .rank(rank, world)
                        .drop_last(drop_last)
                        .landing(small_ring(ring))
                        .build()
                        .unwrap();
                    let steps = l.epoch_len();
                    let mut sizes = Vec::new();
                    while let Some(b) = l.next_batch().unwrap() {
                        sizes.push(b.len());
                    }
                    let n = sizes.len();
                    assert_eq!(n as u64, l.batches_per_epoch());
                    assert!(
                        sizes[..n - 1].iter().all(|&x| x == batch),
                        "seed {seed} world {world} rank {rank}: {sizes:?}"
                    );
                    assert_eq!(sizes.iter().sum::<usize>() as u64, steps);
                    if drop_last {
                        assert_eq!(sizes[n - 1], batch, "drop_last: whole batches only");
                    }
                    counts.push(n);
                }
                let per_rank = if drop_last {
                    200 / world as usize
                } else {
                    200usize.div_ceil(world as usize)
                };
                let want = if drop_last {
                    per_rank / batch
                } else {
                    per_rank.div_ceil(batch)
                };
                assert!(
                    counts.iter().all(|&c| c == want),
                    "seed {seed} world {world} drop_last {drop_last}: batches per rank {counts:?}, want {want}"
                );
            }
        }
    }
}

/// A saved position carries the catalog's identity: it does not resume on
/// another dataset, even one with the same sample count.
#[test]
fn a_position_does_not_resume_on_another_dataset_of_the_same_length() {
    let t = tempfile::tempdir().unwrap();
    let mut spaces = Vec::new();
    for seed in ["1", "2"] {
        let src = t.path().join(format!("src{seed}"));
        ok(&[
            "gen",
            "--profile",
            "tiny",
            "--count",
            "120",
            "--seed",
            seed,
            "--out",
            s(&src),
        ]);
        let sp = t.path().join(format!("space{seed}"));
        ok(&["preload", "--source", s(&src), "--space", s(&sp)]);
        spaces.push(sp);
    }
    let build = |sp: &Path| {
        LoaderBuilder::space(sp)
            .batch_size(8)
            .seed(3)
            .landing(small_ring(1 << 20))
            .build()
            .unwrap()
    };
    let mut a = build(&spaces[0]);
    a.next_batch().unwrap().unwrap();
    let saved = a.save_position();
    assert_eq!(saved.len(), kspeed::sampler::POSITION_BYTES);
    let mut b = build(&spaces[1]);
    assert_eq!(a.catalog().len(), b.catalog().len());
    match b.restore_position(&saved) {
        Err(Error::BadPosition(m)) => assert!(m.contains("another dataset"), "{m}"),
        r => panic!("restored a position of another dataset: {r:?}"),
    }
    // Refusing it leaves b working where it was.
    assert_eq!(b.position(), Position { epoch: 0, index: 0 });
    assert_eq!(b.next_batch().unwrap().unwrap().len(), 8);
    // The same dataset resumes.
    let mut c = build(&spaces[0]);
    c.restore_position(&saved).unwrap();
    assert_eq!(c.position(), Position { epoch: 0, index: 8 });
}

/// `stats()` counts the read-ahead from running totals (no scan of the
/// ready table): once the pollers have read the whole (last) epoch, what
/// waits is exactly what was read and not delivered, at every point of it.
#[test]
fn stats_read_ahead_is_what_was_read_and_not_delivered() {
    let t = tempfile::tempdir().unwrap();
    let (_, sp) = tiny_space(t.path(), 300);
    let mut l = LoaderBuilder::space(&sp)
        .batch_size(10)
        .end_epoch(Some(1))
        .landing(small_ring(64 << 20))
        .build()
        .unwrap();
    for k in 1..=30u64 {
        l.next_batch().unwrap().unwrap();
        let t0 = std::time::Instant::now();
        let st = loop {
            let st = l.stats();
            if st.disk_reads == 300 || t0.elapsed() > std::time::Duration::from_secs(30) {
                break st;
            }
            std::thread::yield_now();
        };
        assert_eq!(st.disk_reads, 300, "the pollers read the epoch: {st:?}");
        assert_eq!(st.samples, 10 * k);
        assert_eq!(st.read_ahead, 300 - 10 * k, "{st:?}");
        assert_eq!(st.read_ahead_discarded, 0, "{st:?}");
    }
    assert!(l.next_batch().unwrap().is_none());
    assert_eq!(l.stats().read_ahead, 0);
}

/// A loader restored right after its build reads nothing for the old
/// start: its pollers wait for the first batch (docs/LOCAL_PATH.md,
/// "Pollers"), so the restore throws no read away and waits for none.
/// Exact counts: the disk reads of the rest of the epoch, each once.
/// Pollers that began at the build would have read from step 0 until the
/// restore stopped them, and those reads would be in `disk_reads` too.
#[test]
fn a_restore_right_after_the_build_reads_only_from_the_restored_step() {
    let t = tempfile::tempdir().unwrap();
    let (_, sp) = tiny_space(t.path(), 300);
    let build = || {
        LoaderBuilder::space(&sp)
            .batch_size(10)
            .end_epoch(Some(1))
            .landing(small_ring(64 << 20))
            .build()
            .unwrap()
    };
    let saved = {
        let mut a = build();
        for _ in 0..12 {
            a.next_batch().unwrap().unwrap();
        }
        a.save_position()
    };
    let mut l = build();
    l.restore_position(&saved).unwrap();
    assert_eq!(l.stats().disk_reads, 0, "{:?}", l.stats());
    let mut delivered = 0u64;
    while let Some(b) = l.next_batch().unwrap() {
        delivered += b.len() as u64;
    }
    assert_eq!(delivered, 300 - 120);
    let st = l.finish();
    assert_eq!(st.disk_reads, 300 - 120, "{st:?}");
    assert_eq!(st.read_ahead_discarded, 0, "{st:?}");
}

/// Statistics add up over the loader's life: restarts do not reset them,
/// and what was read ahead is counted apart from what was delivered.
#[test]
fn statistics_are_cumulative_and_count_read_ahead_apart() {
    let t = tempfile::tempdir().unwrap();
    let (_, sp) = tiny_space(t.path(), 300);
    let mut l = LoaderBuilder::space(&sp)
        .batch_size(10)
        .landing(small_ring(1 << 20))
        .build()
        .unwrap();
    while l.next_batch().unwrap().is_some() {}
    let s0 = l.stats();
    assert_eq!(s0.samples, 300);
    // A jump to another epoch restarts the pollers: nothing goes down.
    l.set_epoch(7).unwrap();
    for _ in 0..5 {
        l.next_batch().unwrap().unwrap();
    }
    let s1 = l.stats();
    assert_eq!(s1.samples, 350);
    assert!(s1.disk_reads >= s0.disk_reads + 50, "{s0:?}\n{s1:?}");
    assert!(
        s1.read_latency.count >= s0.read_latency.count,
        "{s0:?}\n{s1:?}"
    );
    let st = l.finish();
    // Every disk read was either delivered or read ahead and thrown away
    // (tiny samples are never empty; no tier, no faults).
    assert_eq!(st.samples, 350);
    assert_eq!(st.read_ahead, 0, "nothing is waiting after finish");
    assert_eq!(
        st.disk_reads,
        st.samples + st.read_ahead_discarded,
        "{st:?}"
    );
    assert!(st.read_ahead_discarded > 0, "the pollers ran ahead: {st:?}");
    // kspeed read reports the two apart.
    let out = ok(&["read", "--space", s(&sp), "--ring-bytes", "1MiB"]);
    assert!(
        out.contains("delivered 300 samples; read ahead and not consumed:"),
        "{out}"
    );
}

/// A trainer forks after building a loader (data-loader workers): the
/// child does not get the ring or the io_uring mappings, it runs and exits,
/// and the parent reads on exactly.
#[test]
fn fork_after_build_keeps_the_ring_out_of_the_child() {
    let t = tempfile::tempdir().unwrap();
    let (_, sp) = tiny_space(t.path(), 400);
    let mut l = LoaderBuilder::space(&sp)
        .batch_size(16)
        .seed(5)
        .landing(small_ring(1 << 20))
        .tier_bytes(256 << 10)
        .build()
        .unwrap();
    let space = Space::open(&sp).unwrap();
    let cat = space.catalog();
    // Mid-epoch, pollers busy: hold a batch across the forks.
    let b = l.next_batch().unwrap().unwrap();
    let ring_addr = b.spans().0.as_ptr() as usize;
    let maps_of = |pid: i32| std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();
    let holds = |maps: &str, addr: usize| {
        maps.lines().any(|line| {
            let range = line.split_whitespace().next().unwrap_or("");
            let (a, b) = range.split_once('-').unwrap_or(("0", "0"));
            let a = usize::from_str_radix(a, 16).unwrap_or(0);
            let b = usize::from_str_radix(b, 16).unwrap_or(0);
            a <= addr && addr < b
        })
    };
    let me = maps_of(std::process::id() as i32);
    assert!(holds(&me, ring_addr), "the parent maps its ring");
    assert!(me.contains("io_uring"), "the parent maps its io_urings");

    // SAFETY: the child only calls async-signal-safe functions (pause,
    // _exit) before it is killed or exits.
    let child = unsafe { libc::fork() };
    assert!(child >= 0, "fork failed");
    if child == 0 {
        loop {
            // SAFETY: async-signal-safe; waits for the parent's SIGKILL.
            unsafe { libc::pause() };
        }
    }
    let maps = maps_of(child);
    // SAFETY: a child of ours; reaped right after.
    unsafe {
        libc::kill(child, libc::SIGKILL);
        libc::waitpid(child, std::ptr::null_mut(), 0);
    }
    assert!(
        !holds(&maps, ring_addr),
        "the child got a copy of the landing ring"
    );
    assert!(
        !maps.contains("io_uring"),
        "the child got the io_uring mappings:\n{maps}"
    );

    // A child that runs and exits on its own.
    // SAFETY: as above (the child computes on its stack, then _exit).
    let child = unsafe { libc::fork() };
    assert!(child >= 0, "fork failed");
    if child == 0 {
        let mut x = 0u64;
        for i in 0..1_000_000u64 {
            x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(i));
        }
        // SAFETY: async-signal-safe exit without running the parent's
        // destructors in the child.
        unsafe { libc::_exit(if x == 1 { 1 } else { 7 }) };
    }
    let mut status = 0;
    // SAFETY: a child of ours.
    unsafe { libc::waitpid(child, &mut status, 0) };
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 7,
        "child status {status}"
    );

    // The batch held across the forks is intact, and the parent goes on
    // exactly: the rest of epoch 0, then two more.
    let sampler = Sampler::new(SamplerConfig::single(cat.len(), 5)).unwrap();
    for (k, smp) in b.iter().enumerate() {
        assert_eq!(smp.id, sampler.sample(0, k as u64));
        assert_eq!(crc32c::crc32c(smp.bytes), cat.sample(smp.id).crc32c);
    }
    drop(b);
    let mut k = 16u64;
    while let Some(b) = l.next_batch().unwrap() {
        for smp in b.iter() {
            assert_eq!(smp.id, sampler.sample(0, k));
            assert_eq!(crc32c::crc32c(smp.bytes), cat.sample(smp.id).crc32c);
            k += 1;
        }
    }
    assert_eq!(k, 400);
    check_epochs(&mut l, cat, &sampler, 1..3, 16);
}

/// The command line: a closed stdout ends `inspect` quietly (no panic);
/// bad numbers name the flag and the accepted range before anything
/// touches the kernel; `read --source` without `--catalog` says it builds
/// one.
#[test]
fn command_line_errors_name_the_flag_and_a_closed_pipe_is_quiet() {
    use std::os::fd::{FromRawFd, OwnedFd};
    let t = tempfile::tempdir().unwrap();
    let (src, sp) = tiny_space(t.path(), 50);
    // stdout is a pipe nobody reads: the first write fails with EPIPE.
    let mut fds = [0; 2];
    // SAFETY: pipe writes two new descriptors into fds.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    // SAFETY: both descriptors are ours and owned from here on.
    let (read_end, write_end) =
        unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    drop(read_end);
    let o = Command::new(kspeed_bin())
        .args(["inspect", "--space", s(&sp)])
        .stdout(std::process::Stdio::from(write_end))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!err.contains("panicked"), "{err}");
    assert_ne!(o.status.code(), Some(101), "{err}");
    assert!(err.is_empty(), "quiet on a closed pipe: {err}");

    let e = fails(&["read", "--space", s(&sp), "--queue-depth", "100000"], 2);
    // The options table's range and message (kspeed::loader::options).
    assert!(
        e.contains("--queue-depth") && e.contains("an integer from 1 to 16384"),
        "{e}"
    );
    let e = fails(&["read", "--space", s(&sp), "--ring-bytes", "12XB"], 2);
    assert!(
        e.contains("--ring-bytes") && e.contains("e.g. 4096, 64KiB"),
        "{e}"
    );
    let e = fails(&["read", "--space", s(&sp), "--pollers", "0"], 2);
    assert!(
        e.contains("--pollers") && e.contains("an integer from 1 to 1024"),
        "{e}"
    );
    // The same ranges through the library (and so the C ABI and bindings):
    // named before io_uring sees them.
    match LoaderBuilder::space(&sp).queue_depth(100_000).build() {
        Err(Error::InvalidConfig(m)) => {
            assert!(m.contains("queue_depth must be 1 to 16384"), "{m}")
        }
        r => panic!("{:?}", r.err()),
    }
    let o = kspeed(&["read", "--source", s(&src), "--ring-bytes", "1MiB"]);
    let out = text(&o);
    assert!(o.status.success(), "{out}");
    assert!(out.contains("no --catalog: building a catalog of"), "{out}");
}

/// Reads `epochs` epochs from `loader` and returns the first error, if any
/// (every sample delivered before it is checked against the catalog).
fn read_until_error(loader: &mut Loader, cat: &Catalog, epochs: u64) -> Option<Error> {
    for e in 0..epochs {
        if let Err(err) = loader.set_epoch(e) {
            return Some(err);
        }
        loop {
            match loader.next_batch() {
                Ok(Some(b)) => {
                    for smp in b.iter() {
                        assert_eq!(crc32c::crc32c(smp.bytes), cat.sample(smp.id).crc32c);
                    }
                }
                Ok(None) => break,
                Err(err) => return Some(err),
            }
        }
    }
    None
}

/// The I/O error paths of the pollers, with the fault-injecting ring: a
/// ring that stops accepting submissions mid-epoch, transient EAGAIN from
/// io_uring_enter, and a panic with reads in flight. Each ends in a named
/// error (or, for EAGAIN, in exact epochs), and no poller hands back a
/// ring with reads in flight (the poller asserts it; in debug builds it
/// also checks its pools every tick).
#[test]
fn submit_failures_eagain_and_panics_reap_their_reads() {
    let t = tempfile::tempdir().unwrap();
    let (_, sp) = tiny_space(t.path(), 600);
    let space = Space::open(&sp).unwrap();
    let cat = space.catalog();
    let build = |f: FaultConfig| {
        LoaderBuilder::space(&sp)
            .batch_size(8)
            .pollers(2)
            .queue_depth(16)
            .landing(small_ring(1 << 20))
            .fault_injection(f)
            .build()
            .unwrap()
    };
    // A ring that fails for good at its 20th submission.
    let mut l = build(
        FaultConfig::default()
            .seed(1)
            .submit_fail_after(20)
            .submit_errno(libc::ENOMEM),
    );
    let e = read_until_error(&mut l, cat, 3).expect("the failed ring is an error");
    match e.root() {
        Error::Uring { what, source } => {
            assert_eq!(*what, "submit reads");
            assert_eq!(source.raw_os_error(), Some(libc::ENOMEM), "{e}");
        }
        other => panic!("{other}"),
    }
    // Every later call says the same.
    let again = l.next_batch().err().unwrap();
    assert!(matches!(again.root(), Error::Uring { .. }), "{again}");
    drop(l);

    // Transient EAGAIN on a third of the submissions: retried, nothing lost.
    let mut l = build(FaultConfig::default().seed(2).eagain_ppm(300_000));
    assert!(read_until_error(&mut l, cat, 3).is_none());
    assert_eq!(l.stats().samples, 1800);
    drop(l);

    // A poller panics with reads in flight: the unwinding drop cancels and
    // reaps them before the ring goes; the consumer gets a named error.
    let mut l = build(FaultConfig::default().seed(3).panic_after_completions(100));
    let e = read_until_error(&mut l, cat, 3).expect("the panic is an error");
    assert!(
        matches!(e.root(), Error::ThreadPanicked { thread: "poller" }),
        "{e}"
    );
    drop(l);
}

/// The ring is registered with io_uring once for all pollers (the kernel
/// shares one buffer table), so 3 pollers fit a memlock limit that holds
/// the ring once; a limit below the ring is a WARN and shows in the
/// output, not a silent fallback. The pollers register once they have
/// written the whole ring, so the run reads several rings' worth. Run as
/// an unprivileged user (root is not charged for pinned memory).
#[test]
fn ring_registration_is_shared_and_its_loss_is_not_silent() {
    let Some((_t, sp)) = space_for_nobody("ring_registration_is_shared_and_its_loss_is_not_silent")
    else {
        return;
    };
    // A uid of its own per run: RLIMIT_MEMLOCK charges are per user,
    // another test runs as nobody at the same time, and a process's
    // io_uring charges are released after it exits, not before.
    let read_as_nobody = |memlock: &str, uid: u32| {
        let o = Command::new("prlimit")
            .arg(format!("--memlock={memlock}:{memlock}"))
            .arg("setpriv")
            .arg(format!("--reuid={uid}"))
            .arg(format!("--regid={uid}"))
            .arg("--clear-groups")
            .arg(kspeed_bin())
            // No WARN but the registration's is asserted below; a poller
            // preempted for 50 ms on a loaded machine would log a stall.
            .env("KSPEED_STALL_MS", "0")
            .args([
                "read",
                "--space",
                s(&sp),
                "--ring-bytes",
                "4MiB",
                "--no-mlock",
            ])
            .args(["--pollers", "3", "--progress=none", "--batch-size", "8"])
            // About 0.3 MiB an epoch: the ring laps three times.
            .args(["--epochs", "40"])
            .output()
            .unwrap();
        let e = text(&o);
        assert!(o.status.success(), "{e}");
        e
    };
    // 4 MiB ring, 6 MiB limit: three separate registrations would need 12.
    let e = read_as_nobody("6291456", 61234);
    assert!(
        e.contains("io_uring: plain reads until the pollers have written the whole ring once"),
        "{e}"
    );
    assert!(
        e.contains("at the end: io_uring: registered once, shared by 3 pollers"),
        "{e}"
    );
    assert!(!e.contains("WARN"), "{e}");
    // 2 MiB limit: the ring cannot be registered; said, and still read.
    let e = read_as_nobody("2097152", 61235);
    assert!(
        e.contains("WARN") && e.contains("cannot be registered with io_uring"),
        "{e}"
    );
    assert!(e.contains("at the end: io_uring: not registered"), "{e}");
    assert!(e.contains("samples/s"), "{e}");
}

/// Batches kept out with `acquire_batch_keep` (what the Python package does
/// while a caller still holds views) keep their bytes while later batches
/// are read, are released oldest first, and a batch the ring cannot hold
/// beside them is a named error, not a hang.
#[test]
fn kept_batches_stay_put_until_released_in_order() {
    let t = tempfile::tempdir().unwrap();
    let (_, sp) = tiny_space(t.path(), 300);
    let space = Space::open(&sp).unwrap();
    let cat = space.catalog();
    // Tiny samples take 4 or 8 KiB slots: 16 batches of 4 out do not
    // always leave room for another in a 192 KiB ring.
    let (batch, keep) = (4usize, 16usize);
    let mut loader = LoaderBuilder::space(&sp)
        .batch_size(batch)
        .landing(small_ring(192 << 10))
        .pollers(2)
        .seed(5)
        .build()
        .unwrap();
    let sampler = Sampler::new(SamplerConfig::single(cat.len(), 5)).unwrap();
    // (id, address, len) of every sample of the batches out, oldest first.
    type Out = Vec<(u64, usize, usize)>;
    let check = |out: &std::collections::VecDeque<Out>| {
        for b in out {
            for &(id, addr, len) in b {
                // SAFETY: the batch is kept out, so its bytes stay mapped and
                // unwritten until released (what this test checks).
                let bytes = unsafe { std::slice::from_raw_parts(addr as *const u8, len) };
                assert_eq!(crc32c::crc32c(bytes), cat.sample(id).crc32c, "sample {id}");
            }
        }
    };
    let (mut refused, mut k) = (0, 0u64);
    for e in 0..2 {
        loader.set_epoch(e).unwrap();
        let mut out: std::collections::VecDeque<Out> = Default::default();
        loop {
            if out.len() == keep {
                loader.release_oldest_batch();
                out.pop_front();
            }
            let n = match loader.acquire_batch_keep() {
                Ok(n) => n,
                Err(Error::InvalidConfig(msg)) => {
                    assert!(msg.contains("still out"), "{msg}");
                    assert!(!out.is_empty());
                    refused += 1;
                    assert!(loader.release_oldest_batch());
                    out.pop_front();
                    continue;
                }
                Err(e) => panic!("{e}"),
            };
            if n == 0 {
                break;
            }
            let b: Out = (0..n)
                .map(|i| {
                    let s = loader.held_sample(i);
                    assert_eq!(s.id, sampler.sample(e, k % sampler.per_rank()));
                    k += 1;
                    (s.id, s.bytes.as_ptr() as usize, s.bytes.len())
                })
                .collect();
            out.push_back(b);
            assert_eq!(loader.batches_out(), out.len());
            check(&out);
        }
        // The next epoch goes on without a restart: batches out stay valid.
        assert!(loader.epoch_continues(e + 1));
        loader.set_epoch(e + 1).unwrap();
        assert_eq!(loader.batches_out(), out.len());
        check(&out);
        loader.set_epoch(e).unwrap_or_else(|err| panic!("{err}"));
        assert_eq!(loader.batches_out(), 0, "a restart returns every batch");
    }
    assert_eq!(k, 2 * sampler.per_rank());
    assert!(refused > 0, "the ring never refused a batch");
}

/// Eight ranks of one job in one process (as a test harness or a
/// single-process DDP launcher would have them), each a loader at the
/// smallest ring allowed with one poller, stepped in lock-step: every rank
/// takes batch k before any takes k+1. Every rank must see every batch of
/// every epoch, in order, without stalling.
#[test]
fn eight_ranks_in_one_process_step_in_lock_step() {
    let t = tempfile::tempdir().unwrap();
    let src = t.path().join("src");
    gen("imagenet", 200, &src);
    let sp = t.path().join("space");
    ok(&["preload", "--source", s(&src), "--space", s(&sp)]);
    let cat = Catalog::open(&sp.join("catalog.ksc")).unwrap();
    let batch = 16usize;
    let world = 8u32;
    const SEEDS: u64 = 12;
    let needed = match LoaderBuilder::space(&sp)
        .batch_size(batch)
        .rank(0, world)
        .landing(small_ring(1 << 20))
        .build()
    {
        Err(Error::RingTooSmallForBatch { needed_bytes, .. }) => needed_bytes,
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("1 MiB was enough"),
    };
    let (done_tx, done_rx) = std::sync::mpsc::channel::<Result<u64, String>>();
    let sp2 = sp.clone();
    let (progress_tx, progress_rx) = std::sync::mpsc::channel::<String>();
    std::thread::spawn(move || {
        let run = || -> Result<u64, String> {
            let mut samples = 0u64;
            for seed in 0..SEEDS {
                let drop_last = seed % 2 == 1;
                let mut loaders: Vec<Loader> = (0..world)
                    .map(|r| {
                        LoaderBuilder::space(&sp2)
                            .batch_size(batch)
                            .seed(seed)
                            .rank(r, world)
                            .drop_last(drop_last)
                            .pollers(1)
                            .pin(false)
                            .landing(small_ring(needed + (seed % 3) * 4096))
                            .build()
                            .map_err(|e| e.to_string())
                    })
                    .collect::<Result<_, _>>()?;
                for epoch in 0..4u64 {
                    for l in loaders.iter_mut() {
                        l.set_epoch(epoch).map_err(|e| e.to_string())?;
                    }
                    let steps = loaders[0].batches_per_epoch();
                    for step in 0..steps {
                        for (r, l) in loaders.iter_mut().enumerate() {
                            let b = l
                                .next_batch()
                                .map_err(|e| format!("rank {r}: {e}"))?
                                .ok_or_else(|| format!("rank {r} ended early at step {step}"))?;
                            for smp in b.iter() {
                                let want = cat.sample(smp.id).crc32c;
                                if crc32c::crc32c(smp.bytes) != want {
                                    return Err(format!("rank {r} sample {} corrupt", smp.id));
                                }
                            }
                            samples += b.len() as u64;
                            let _ = progress_tx
                                .send(format!("seed {seed} epoch {epoch} step {step} rank {r}"));
                        }
                    }
                    for (r, l) in loaders.iter_mut().enumerate() {
                        if l.next_batch().map_err(|e| e.to_string())?.is_some() {
                            return Err(format!("rank {r} has more batches than rank 0"));
                        }
                    }
                }
            }
            Ok(samples)
        };
        let _ = done_tx.send(run());
    });
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    let mut last = String::from("nothing");
    loop {
        while let Ok(p) = progress_rx.try_recv() {
            last = p;
        }
        match done_rx.recv_timeout(std::time::Duration::from_millis(200)) {
            Ok(Ok(n)) => {
                // drop_last (odd seeds): 200 / 8 = 25 samples a rank, one
                // whole batch of 16; otherwise every sample (some padded).
                assert_eq!(n, SEEDS / 2 * 4 * (200 + 8 * 16));
                return;
            }
            Ok(Err(e)) => panic!("{e}"),
            Err(_) if std::time::Instant::now() > deadline => {
                panic!("stalled: last batch taken was {last}")
            }
            Err(_) => {}
        }
    }
}

/// Source mode keeps a tar shard open for the run (`src/loader/fdcache.rs`):
/// one `open` for all its members, not one per sample. Shown by removing
/// the shard once the first batch is in: the rest of the epoch is still
/// read from the open shard (before the cache every member reopened it, and
/// the first member read after the removal failed with ENOENT).
#[test]
fn a_tar_shard_is_opened_once_per_run_not_per_member() {
    let t = tempfile::tempdir().unwrap();
    let shard = t.path().join("one.tar");
    let mut b = tar::Builder::new(std::fs::File::create(&shard).unwrap());
    for i in 0..200u64 {
        let data = bytes_for(i, 4096);
        let mut h = tar::Header::new_gnu();
        h.set_size(data.len() as u64);
        h.set_mode(0o644);
        h.set_cksum();
        b.append_data(&mut h, format!("{i:05}.bin"), &data[..])
            .unwrap();
    }
    b.into_inner().unwrap();
    let spec = format!("tar:{}", shard.display());
    let cat = t.path().join("shard.ksc");
    ok(&["catalog", "--source", &spec, "--out", s(&cat)]);
    // A ring of 16 samples: most of the epoch is read after the removal.
    let mut l = LoaderBuilder::source(&spec)
        .catalog(&cat)
        .batch_size(4)
        .pollers(1)
        .end_epoch(Some(1))
        .landing(small_ring(64 << 10))
        .build()
        .unwrap();
    let mut n = l.next_batch().unwrap().unwrap().len();
    std::fs::remove_file(&shard).unwrap();
    while let Some(b) = l.next_batch().unwrap() {
        n += b.len();
    }
    assert_eq!(n, 200);
    assert_eq!(l.stats().disk_reads, 200);
}

/// A batch that `lookahead` cannot reach beside the batches kept out (the
/// pollers read no further than `lookahead` samples past the oldest of
/// them) is a named error, not a wait that never ends; released, it comes.
#[test]
fn a_kept_batch_beyond_the_lookahead_is_refused_not_waited_for() {
    let t = tempfile::tempdir().unwrap();
    let (_, sp) = tiny_space(t.path(), 300);
    let mut loader = LoaderBuilder::space(&sp)
        .batch_size(4)
        .lookahead(6)
        .landing(small_ring(8 << 20))
        .seed(2)
        .build()
        .unwrap();
    // On a thread, with a deadline: a regression would wait forever.
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let first = loader.acquire_batch_keep();
        // Samples 0-3 are out; 4-7 would need a lookahead of 8.
        let second = loader.acquire_batch_keep();
        let after_release = loader
            .release_oldest_batch()
            .then(|| loader.acquire_batch_keep());
        tx.send((first, second, after_release)).unwrap();
    });
    let (first, second, after_release) = rx
        .recv_timeout(std::time::Duration::from_secs(60))
        .expect("acquire_batch_keep answered within 60 s");
    assert_eq!(first.unwrap(), 4);
    match second {
        Err(Error::InvalidConfig(m)) => assert!(
            m.contains("lookahead 6") && m.contains("another batch needs 8"),
            "{m}"
        ),
        other => panic!("a batch beyond the lookahead was not refused: {other:?}"),
    }
    assert_eq!(after_release.expect("the oldest batch was out").unwrap(), 4);
}
