//! The default ring (`ring_bytes` 0, "auto") sized from the batch and the
//! dataset, on real spaces: its size, that every batch of an epoch fits
//! and arrives exact, and the front ends that set it (`kspeed read
//! --ring-bytes auto`, the options table).

mod common;

use std::path::{Path, PathBuf};

use common::*;
use kspeed::loader::options::LoaderOptions;
use kspeed::loader::LoaderBuilder;
use kspeed::Error;

const MIB: u64 = 1 << 20;

/// A space of `count` samples of `len` bytes each (`bytes_for(i, len)`).
fn space(dir: &Path, count: u64, len: usize) -> PathBuf {
    let src = dir.join("src");
    for i in 0..count {
        put(&src, &format!("c/s_{i:04}.bin"), &bytes_for(i, len));
    }
    let sp = dir.join("space");
    ok(&["preload", "--source", s(&src), "--space", s(&sp)]);
    sp
}

/// Reads one epoch and checks every sample's bytes against its source.
fn read_epoch_exact(sp: &Path, batch: usize, len: usize) -> (u64, u64) {
    let mut l = LoaderBuilder::space(sp)
        .batch_size(batch)
        .seed(3)
        .landing(test_ring(0))
        .pin(false)
        .build()
        .unwrap();
    let ring = l.landing_info().bytes;
    // Each sample's source index, from its file's name (`c/s_0007.bin`).
    let index: Vec<u64> = (0..l.catalog().len())
        .map(|id| {
            let cat = l.catalog();
            let name = cat.file(cat.sample(id).file).name.to_string_lossy();
            name.trim_start_matches("c/s_")
                .trim_end_matches(".bin")
                .parse()
                .unwrap()
        })
        .collect();
    let mut n = 0u64;
    while let Some(b) = l.next_batch().unwrap() {
        for smp in b.iter() {
            assert_eq!(
                smp.bytes,
                &bytes_for(index[smp.id as usize], len)[..],
                "sample {}",
                smp.id
            );
            n += 1;
        }
    }
    (ring, n)
}

#[test]
fn the_default_ring_is_six_batches_of_the_mean_sample_from_4_mib() {
    let t = tempfile::tempdir().unwrap();
    // 40 samples of 1 MiB, batches of 4: six batches are 24 MiB (twice
    // the dataset is 80 MiB).
    let sp = space(t.path(), 40, 1 << 20);
    let (ring, n) = read_epoch_exact(&sp, 4, 1 << 20);
    assert_eq!(ring, 24 * MIB);
    assert_eq!(n, 40);
    // 600 samples of 4,000 bytes (one 4 KiB slot each), batches of 8:
    // six batches are 192 KiB, so the 4 MiB floor (twice the dataset is
    // 4.7 MiB).
    let t = tempfile::tempdir().unwrap();
    let sp = space(t.path(), 600, 4_000);
    let (ring, n) = read_epoch_exact(&sp, 8, 4_000);
    assert_eq!(ring, 4 * MIB);
    assert_eq!(n, 600);
}

#[test]
fn the_default_ring_is_at_most_twice_a_small_dataset() {
    let t = tempfile::tempdir().unwrap();
    // 50 samples of 20,000 bytes (one 20,480-byte slot each): twice the
    // dataset is 2,048,000 bytes, rounded up to whole pages.
    let sp = space(t.path(), 50, 20_000);
    let (ring, n) = read_epoch_exact(&sp, 8, 20_000);
    assert_eq!(ring, (2 * 50 * 20_480u64).next_multiple_of(4096));
    assert_eq!(n, 50);
}

/// Six 4 MiB samples in one batch: twice the dataset (48 MiB) cannot hold
/// the batch and two more read ahead, so the default grows to hold them,
/// where a ring given by hand that cannot hold the batch is refused.
#[test]
fn the_default_ring_always_holds_a_batch_of_the_largest_samples() {
    let t = tempfile::tempdir().unwrap();
    let len = 4 << 20;
    let sp = space(t.path(), 6, len);
    let (ring, n) = read_epoch_exact(&sp, 6, len);
    assert!(ring >= 72 * MIB, "{ring}");
    assert_eq!(n, 6);
    match LoaderBuilder::space(&sp)
        .batch_size(6)
        .landing(test_ring(16 * MIB))
        .pin(false)
        .build()
    {
        Err(Error::RingTooSmallForBatch { needed_bytes, .. }) => {
            assert!(
                needed_bytes >= 24 * MIB && needed_bytes <= ring,
                "{needed_bytes}"
            )
        }
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("a 16 MiB ring cannot hold six 4 MiB samples, and was accepted"),
    }
}

#[test]
fn auto_is_the_default_in_every_front_end_and_zero_is_refused_as_a_size() {
    // The options table: "auto" and no value give the default (0 in Rust);
    // 0 as a size is below the minimum, named.
    let mut o = LoaderOptions::new();
    o.set("ring_bytes", "64MiB").unwrap();
    assert_eq!(o.builder_ref().landing_options().ring_bytes, 64 * MIB);
    o.set("ring_bytes", "auto").unwrap();
    assert_eq!(o.builder_ref().landing_options().ring_bytes, 0);
    assert_eq!(
        LoaderOptions::new()
            .builder_ref()
            .landing_options()
            .ring_bytes,
        0
    );
    let e = LoaderOptions::new().set("ring_bytes", "0").unwrap_err();
    assert!(
        e.to_string()
            .starts_with("option ring_bytes: 0 is below the minimum"),
        "{e}"
    );
    // A builder given 1..4095 bytes is refused, naming auto.
    let t = tempfile::tempdir().unwrap();
    let sp = space(t.path(), 10, 5000);
    let e = LoaderBuilder::space(&sp)
        .landing(test_ring(100))
        .build()
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("at least 4096 (or 0: sized from the batch)"),
        "{e}"
    );
    // `kspeed read`: auto by default and by name, the size said.
    for extra in [&[][..], &["--ring-bytes", "auto"][..]] {
        let mut args = vec![
            "read",
            "--space",
            s(&sp),
            "--batch-size",
            "2",
            "--no-mlock",
            "--no-pin",
            // A huge-page mapping is whole 2 MiB pages, whatever the size.
            "--no-huge-pages",
        ];
        args.extend_from_slice(extra);
        let out = kspeed(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{err}");
        // Twice the dataset: 10 slots of 8 KiB, twice, is 160 KiB.
        assert!(
            err.contains("landing ring: 160.00 KiB sized from the batch (--ring-bytes sets it)"),
            "{err}"
        );
    }
    let out = kspeed(&[
        "read",
        "--space",
        s(&sp),
        "--ring-bytes",
        "1MiB",
        "--no-mlock",
        "--no-pin",
        "--no-huge-pages",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("landing ring: 1.00 MiB ("), "{err}");
}
