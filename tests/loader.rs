//! The local data path over real files: every delivered sample is
//! byte-identical to its source and in sampler order, across epochs, ranks,
//! batch sizes, ring sizes, lookaheads and poller counts; faults surface as
//! named errors or are retried; the memory tier serves what it holds.

mod common;

use std::path::Path;
use std::process::Command;

use common::*;
use kspeed::dataset::{Catalog, Space};
use kspeed::landing::{CudaMode, LandingOptions};
use kspeed::loader::{Loader, LoaderBuilder};
use kspeed::ring::FaultConfig;
use kspeed::sampler::{Position, Sampler, SamplerConfig};
use kspeed::Error;

fn small_ring(bytes: u64) -> LandingOptions {
    LandingOptions {
        ring_bytes: bytes,
        huge_pages: false,
        mlock: true,
        numa_node: None,
        gpu_pci: None,
        cuda: CudaMode::Off,
    }
}

/// A preloaded space with awkward sizes (0, 1, 4095, 4096, 4097, 300000...)
/// plus some generated tiny samples.
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
    for e in epochs {
        loader.set_epoch(e).unwrap();
        let mut k = 0u64;
        while let Some(b) = loader.next_batch().unwrap() {
            assert!(b.len() <= batch && !b.is_empty());
            assert_eq!(b.epoch(), e);
            let (span, wrap) = b.spans();
            let span_bytes = span.len() + wrap.map_or(0, |w| w.len());
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
            assert!(span_bytes >= sum, "the spans cover the samples");
        }
        assert_eq!(k, sampler.per_rank(), "epoch {e} delivered {k} samples");
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
    for &(batch, ring, lookahead, pollers, rank, world, drop_last, qd, sb) in configs {
        let mut loader = LoaderBuilder::space(&sp)
            .batch_size(batch)
            .landing(small_ring(ring))
            .lookahead(lookahead)
            .pollers(pollers)
            .queue_depth(qd)
            .submit_batch(sb)
            .rank(rank, world)
            .drop_last(drop_last)
            .seed(11)
            .build()
            .unwrap_or_else(|e| panic!("build {batch} {ring}: {e}"));
        let sampler = Sampler::new(SamplerConfig {
            len: cat.len(),
            seed: 11,
            shuffle: true,
            rank,
            world,
            drop_last,
        })
        .unwrap();
        let n = check_epochs(&mut loader, cat, &sampler, 0..3, batch);
        assert_eq!(n, 3 * sampler.per_rank());
        let st = loader.finish();
        assert_eq!(st.samples, n);
        assert!(st.disk_reads >= n.min(cat.len()), "{st:?}");
        assert!(
            st.read_latency.count > 0 && st.read_latency.p50_us > 0,
            "{st:?}"
        );
    }
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
    let sampler = Sampler::new(SamplerConfig {
        shuffle: false,
        ..SamplerConfig::single(space.catalog().len(), 0)
    })
    .unwrap();
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
    let sampler = Sampler::new(SamplerConfig {
        len: cat.len(),
        seed: 3,
        shuffle: true,
        rank: 1,
        world: 2,
        drop_last: false,
    })
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
        .fault_injection(FaultConfig {
            seed: 5,
            eio_ppm: 30_000,
            short_ppm: 0,
            delay_ppm: 0,
        })
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
            assert_eq!(*errno_name, "EIO");
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
                msg.contains(&format!("sample {sample}")) && msg.contains("EIO"),
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
        .fault_injection(FaultConfig {
            seed: 9,
            eio_ppm: 0,
            short_ppm: 150_000,
            delay_ppm: 300_000,
        })
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
    let mut loader = LoaderBuilder::space(&sp)
        .shuffle(false)
        .batch_size(1)
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
    let src = t.path().join("src");
    gen("tiny", 400, &src);
    let sp = t.path().join("space");
    ok(&["preload", "--source", s(&src), "--space", s(&sp)]);
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
            assert_eq!(errno_name, "ENOENT");
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

#[test]
fn memlock_limit_is_a_named_error() {
    if !is_root() || Command::new("prlimit").arg("--version").output().is_err() {
        eprintln!("skipping memlock_limit_is_a_named_error: needs root, setpriv and prlimit");
        return;
    }
    let t = tempfile::tempdir().unwrap();
    let sp = odd_space(t.path());
    for d in [t.path().to_path_buf(), sp.clone(), sp.join("extents")] {
        std::fs::set_permissions(&d, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    }
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
        .fault_injection(FaultConfig {
            seed: 2,
            eio_ppm: 0,
            short_ppm: 50_000,
            delay_ppm: 200_000,
        })
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
        .landing(LandingOptions {
            numa_node: numa,
            ..small_ring(1 << 20)
        })
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

/// Batches kept out with `acquire_batch_keep` (what the Python package does
/// while a caller still holds views) keep their bytes while later batches
/// are read, are released oldest first, and a batch the ring cannot hold
/// beside them is a named error, not a hang.
#[test]
fn kept_batches_stay_put_until_released_in_order() {
    let t = tempfile::tempdir().unwrap();
    let sp = odd_space(t.path());
    let space = Space::open(&sp).unwrap();
    let cat = space.catalog();
    let (batch, keep) = (4usize, 3usize);
    let mut loader = LoaderBuilder::space(&sp)
        .batch_size(batch)
        .landing(small_ring(512 << 10))
        .pollers(2)
        .seed(5)
        .build()
        .unwrap();
    let sampler = Sampler::new(SamplerConfig {
        len: cat.len(),
        seed: 5,
        shuffle: true,
        rank: 0,
        world: 1,
        drop_last: false,
    })
    .unwrap();
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
    // The 300000-byte sample with 3 batches of 4 out needs more than the
    // 512 KiB ring at times.
    assert!(refused > 0, "the ring never refused a batch");
}
