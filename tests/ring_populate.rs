//! The landing ring is faulted in by the reads into it, not when the
//! loader is built, and registered with io_uring after the pollers' first
//! lap. One test in its own binary: it measures the residency of the ring's
//! mapping, which another test's ring in the same process could share (the
//! kernel merges neighbouring mappings of the same kind).

mod common;

use common::*;
use kspeed::dataset::Space;
use kspeed::loader::{Loader, LoaderBuilder};

/// Resident bytes of the mapping that holds `addr` (/proc/self/smaps).
fn resident_bytes_of_mapping(addr: usize) -> u64 {
    let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
    let mut inside = false;
    for line in smaps.lines() {
        let range = line.split_whitespace().next().unwrap_or("");
        if let Some((lo, hi)) = range.split_once('-') {
            if let (Ok(lo), Ok(hi)) = (usize::from_str_radix(lo, 16), usize::from_str_radix(hi, 16))
            {
                inside = (lo..hi).contains(&addr);
                continue;
            }
        }
        if inside {
            if let Some(kb) = line.strip_prefix("Rss:") {
                let kb: u64 = kb.trim().trim_end_matches("kB").trim().parse().unwrap();
                return kb << 10;
            }
        }
    }
    panic!("no mapping holds {addr:#x}")
}

/// The ring's pages are faulted in by the reads into them, not when the
/// loader is built: a start or a resume costs what its first batches
/// touch, not the whole ring (0.02-0.6 s for 256 MiB before). The ring is
/// locked where allowed (root in CI), so locking is checked to fault
/// nothing in too. The pollers register the ring with io_uring once they
/// have written all of it, and `landing_info` says which it is.
#[test]
fn ring_is_populated_by_its_reads_and_registered_after_its_first_lap() {
    let t = tempfile::tempdir().unwrap();
    // 1,000 tiny samples in 4-8 KiB slots: at most 8 MiB of ring an epoch.
    let src = t.path().join("src");
    gen("tiny", 1000, &src);
    let sp = t.path().join("space");
    ok(&["preload", "--source", s(&src), "--space", s(&sp)]);
    let build = |ring_bytes: u64, end_epoch: u64| -> Loader {
        let b = |mlock: bool| {
            LoaderBuilder::space(&sp)
                .batch_size(8)
                .seed(3)
                .pollers(1)
                .end_epoch(Some(end_epoch))
                .landing(test_ring(ring_bytes).mlock(mlock))
                .build()
        };
        b(true).or_else(|_| b(false)).unwrap()
    };
    // One epoch into a 64 MiB ring: an eighth of it is ever written.
    let ring_bytes: u64 = 64 << 20;
    let mut l = build(ring_bytes, 1);
    let info = l.landing_info();
    assert!(!info.io_registered, "{}", info.io);
    assert!(
        info.io
            .starts_with("plain reads until the pollers have written the whole ring once"),
        "{}",
        info.io
    );
    let mut addr = 0;
    let mut n = 0;
    while let Some(b) = l.next_batch().unwrap() {
        addr = b.iter().next().unwrap().bytes.as_ptr() as usize;
        n += b.len();
    }
    assert_eq!(n, 1000);
    let resident = resident_bytes_of_mapping(addr);
    // What the epoch wrote, in the pollers' 2 MiB steps, and huge pages
    // where the kernel gives them; the whole ring before.
    assert!(
        resident <= 16 << 20,
        "{resident} bytes of the {ring_bytes}-byte ring are resident after one epoch of at most 8 MiB"
    );
    assert!(!l.landing_info().io_registered, "{}", l.landing_info().io);
    drop(l);
    // Three epochs into a 4 MiB ring: registered after the first lap,
    // and every sample still whole.
    let mut l = build(4 << 20, 3);
    let space = Space::open(&sp).unwrap();
    let cat = space.catalog();
    let mut n = 0;
    for epoch in 0..3 {
        l.set_epoch(epoch).unwrap();
        while let Some(b) = l.next_batch().unwrap() {
            for smp in b.iter() {
                assert_eq!(crc32c::crc32c(smp.bytes), cat.sample(smp.id).crc32c);
                n += 1;
            }
        }
    }
    assert_eq!(n, 3000);
    let info = l.landing_info();
    assert!(info.io_registered, "{}", info.io);
    assert!(info.io.starts_with("registered (1 poller)"), "{}", info.io);
}
