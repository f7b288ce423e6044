//! How often the consumer sleeps: where every sample comes from this
//! node's disk, a consumer that catches up with the pollers waits once for
//! the rest of its batch, not once per sample (`Stats::stall_waits`), and
//! still gets every sample exact and in order.

mod common;

use common::*;
use std::time::Duration;

use kspeed::loader::{LoaderBuilder, PageCache};

/// Reads one epoch with O_DIRECT (the disk, not the page cache, paces the
/// pollers, so the consumer catches up) and returns (samples, batches,
/// stall_waits), checking every sample against the catalog's CRC32C.
fn read_direct(
    sp: &std::path::Path,
    pollers: usize,
    queue_depth: u32,
    spin_us: u64,
) -> (u64, u64, u64) {
    let mut l = LoaderBuilder::space(sp)
        .batch_size(64)
        .seed(5)
        .pollers(pollers)
        .queue_depth(queue_depth)
        .spin(Duration::from_micros(spin_us))
        .page_cache(PageCache::Off)
        .landing(test_ring(8 << 20))
        .pin(false)
        .build()
        .unwrap();
    let (mut samples, mut batches) = (0u64, 0u64);
    let crcs: Vec<u32> = (0..l.catalog().len())
        .map(|id| l.catalog().sample(id).crc32c)
        .collect();
    while let Some(b) = l.next_batch().unwrap() {
        for smp in b.iter() {
            assert_eq!(
                crc32c::crc32c(smp.bytes),
                crcs[smp.id as usize],
                "sample {}",
                smp.id
            );
            samples += 1;
        }
        batches += 1;
    }
    (samples, batches, l.stats().stall_waits)
}

#[test]
fn a_consumer_reading_from_disk_sleeps_about_once_per_batch() {
    let t = tempfile::tempdir().unwrap();
    let src = t.path().join("src");
    gen("tiny", 3000, &src);
    let sp = t.path().join("space");
    ok(&["preload", "--source", s(&src), "--space", s(&sp)]);
    // Asleep at once (spin 0, the default on up to 4 cores), and spinning
    // first (20 us, the default on more): a wait spins for the batch too.
    for (pollers, depth, spin_us) in [(1, 1, 0), (1, 4, 0), (2, 2, 0), (1, 4, 20), (2, 2, 200)] {
        let (samples, batches, waits) = read_direct(&sp, pollers, depth, spin_us);
        assert_eq!(samples, 3000);
        // O_DIRECT reads of a few KiB at a time are far slower than
        // handing a sample out, so the consumer does wait; one wait per
        // sample would be ~3,000.
        let what = format!("pollers {pollers} depth {depth} spin {spin_us} us");
        assert!(waits >= 1, "{what}: the consumer never waited");
        assert!(
            waits <= 3 * batches,
            "{what}: {waits} waits for {batches} batches"
        );
    }
}
