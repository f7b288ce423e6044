//! `page_cache` (auto, off, on): a loader over a cold space reads with
//! O_DIRECT, over a space whose pages are cached it reads through the page
//! cache, and says which and why; every mode delivers every sample
//! byte-exact, in order.

mod common;

use std::path::Path;

use common::*;
use kspeed::dataset::Space;
use kspeed::loader::{LoaderBuilder, PageCache};
use kspeed::sampler::{Sampler, SamplerConfig};

/// Drops the space's extents from the page cache (they were written with
/// O_DIRECT by the preload, so flushing is not needed; DONTNEED is advice
/// the kernel follows for clean, unmapped pages).
fn make_cold(sp: &Path) {
    let space = Space::open(sp).unwrap();
    for i in 0..space.extent_lens().len() as u32 {
        let f = std::fs::File::open(space.extent_path(i)).unwrap();
        f.sync_all().unwrap();
        use std::os::fd::AsRawFd;
        // SAFETY: posix_fadvise reads its integer arguments only.
        unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    }
}

/// Reads the space's extents through the page cache (as `cat` would).
fn make_warm(sp: &Path) {
    let space = Space::open(sp).unwrap();
    for i in 0..space.extent_lens().len() as u32 {
        std::fs::read(space.extent_path(i)).unwrap();
    }
}

/// Builds a loader with `mode`, reads one epoch and checks every sample's
/// id (against an independent sampler) and CRC32C (against the catalog).
/// Returns (reads bypassed the page cache, the loader's I/O description).
fn read_epoch(sp: &Path, mode: PageCache) -> (bool, String) {
    let mut loader = LoaderBuilder::space(sp)
        .batch_size(32)
        .seed(5)
        .landing(test_ring(1 << 20))
        .page_cache(mode)
        .build()
        .unwrap();
    let info = loader.landing_info();
    let (direct, io) = (info.direct_io, info.io.clone());
    let space = Space::open(sp).unwrap();
    let cat = space.catalog();
    let sampler = Sampler::new(SamplerConfig::single(cat.len(), 5)).unwrap();
    loader.set_epoch(0).unwrap();
    let mut k = 0u64;
    while let Some(b) = loader.next_batch().unwrap() {
        for smp in b.iter() {
            assert_eq!(smp.id, sampler.sample(0, k), "{mode:?}: step {k}");
            let c = cat.sample(smp.id);
            assert_eq!(
                crc32c::crc32c(smp.bytes),
                c.crc32c,
                "{mode:?}: sample {}",
                smp.id
            );
            k += 1;
        }
    }
    assert_eq!(k, cat.len(), "{mode:?}: one epoch");
    (direct, io)
}

#[test]
fn auto_reads_a_cached_space_through_the_page_cache_and_a_cold_one_direct() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src");
    gen("tiny", 3000, &src);
    let sp = dir.path().join("space");
    ok(&["preload", "--source", s(&src), "--space", s(&sp)]);

    let (direct, io) = read_epoch(&sp, PageCache::Off);
    if !direct {
        return skip(&format!(
            "the file system under {} refuses O_DIRECT: {io}",
            dir.path().display()
        ));
    }

    make_cold(&sp);
    let (direct, io) = read_epoch(&sp, PageCache::Auto);
    assert!(direct, "auto over a cold space: {io}");

    make_warm(&sp);
    let (direct, io) = read_epoch(&sp, PageCache::Auto);
    assert!(!direct, "auto over a cached space: {io}");
    assert!(
        io.contains("page_cache auto: 100% of") && io.contains("at least 90%"),
        "{io}"
    );

    // The explicit modes do as they say, whatever is cached.
    let (direct, io) = read_epoch(&sp, PageCache::Off);
    assert!(direct, "off over a cached space: {io}");
    make_cold(&sp);
    let (direct, io) = read_epoch(&sp, PageCache::On);
    assert!(!direct, "on over a cold space: {io}");
    assert!(io.contains("page_cache on"), "{io}");
}

/// `kspeed read --page-cache` takes the same three values and refuses
/// others by name.
#[test]
fn kspeed_read_takes_page_cache() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src");
    gen("tiny", 200, &src);
    let sp = dir.path().join("space");
    ok(&["preload", "--source", s(&src), "--space", s(&sp)]);
    for mode in ["auto", "off", "on"] {
        let o = kspeed(&[
            "read",
            "--space",
            s(&sp),
            "--page-cache",
            mode,
            "--ring-bytes",
            "1MiB",
        ]);
        assert!(o.status.success(), "--page-cache {mode}: {}", text(&o));
        // The I/O description names the mode that chose buffered reads.
        let err = String::from_utf8_lossy(&o.stderr);
        if mode == "on" {
            assert!(err.contains("no O_DIRECT: page_cache on"), "{err}");
        }
    }
    let err = fails(&["read", "--space", s(&sp), "--page-cache", "sometimes"], 2);
    assert!(
        err.contains("sometimes") && err.contains("page-cache"),
        "{err}"
    );
}
