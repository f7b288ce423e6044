//! The cache area in memory (`cache_dir=":memory:"`, docs/CACHE.md "In
//! memory"): the same planner and slots in the loader's own memory.
//!
//! - over a source 3x the area, 4 epochs: exact, its hits within MIN's
//!   (all of them on a quiet machine), nothing on disk, its memory gone
//!   with the loader, empty for the next loader; LRU in memory beside it;
//! - over a space that holds every sample (rank 1 of 4, 8 epochs): the
//!   space's samples kept by next use, hits within MIN's, a memory tier
//!   of the same bytes beside it; on disk the same space is refused;
//! - two levels (`cache_memory_bytes` above an area on disk), 4 epochs over
//!   a source 3x the area: exact, each level's plan MIN's at its budget
//!   (what memory gives is not read from the disk), both serving; the
//!   memory level refused without a folder below it.

#[path = "common/cache_area.rs"]
mod area;
mod common;
#[path = "common/cache_loader.rs"]
mod loader;

use common::*;
use kspeed::cache::CachePolicy;
use kspeed::loader::{Loader, LoaderBuilder};
use kspeed::sampler::{Sampler, SamplerConfig};
use loader::*;

/// Held by the tests that make areas in memory while they count them
/// (the tests of this file run on threads of one process).
static MEMORY_AREAS: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// The memfds named `kspeed-cache` this process holds open.
fn memory_areas_open() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter(|l| l.to_string_lossy().starts_with("/memfd:kspeed-cache"))
        .count()
}

#[test]
fn an_area_in_memory_keeps_by_next_use_and_leaves_nothing_behind() {
    // `cache_dir=":memory:"`: the same planner and slots in this process's
    // memory; nothing on disk, nothing after the loader.
    let _counting = MEMORY_AREAS.lock().unwrap_or_else(|e| e.into_inner());
    let st = setup();
    let epochs = 4;
    let before = memory_areas_open();
    let mk = |from: u64, to: u64, policy| {
        st.builder(policy)
            .cache_dir(Some(kspeed::cache::MEMORY_DIR.into()))
            .start_at(kspeed::sampler::Position {
                epoch: from,
                index: 0,
            })
            .end_epoch(Some(to))
            .build()
            .unwrap()
    };
    let mut l = mk(0, epochs, CachePolicy::NextUse);
    assert_eq!(memory_areas_open(), before + 1);
    read_exact(&mut l, &st.cat, 0, epochs).unwrap();
    let stats = l.stats();
    drop(l);
    let c = stats.cache;
    let cl = kspeed::cache::SlotClasses::for_catalog(&st.cat, st.third);
    let classes = classes_of(&st.cat, st.third);
    assert_eq!((c.slots, c.area_bytes), (cl.slots(), cl.area_bytes()));
    assert!(c.area_bytes <= st.third);
    assert_eq!(c.hits + stats.disk_reads, N * epochs, "{stats:?}");
    assert_eq!(c.corrupt + c.write_errors, 0, "{c:?}");
    let bound = min_hits(&st.cat, &classes, epochs);
    eprintln!(
        "in memory: {} hits ({} planned) of MIN's {bound}; {} kept, {} not kept",
        c.hits, c.planned_hits, c.writes, c.skipped
    );
    assert!(
        c.hits <= bound && c.hits > 0,
        "{} hits, MIN {bound}",
        c.hits
    );
    assert!(c.planned_hits <= bound && c.hits <= c.planned_hits, "{c:?}");
    // Nothing on disk: no folder named after it here, none under the
    // test's folder, and the memory went with the loader.
    assert!(!std::path::Path::new(kspeed::cache::MEMORY_DIR).exists());
    assert!(!st.cache().exists());
    assert_eq!(memory_areas_open(), before);
    // A new loader starts empty: a rank alone reads each sample once an
    // epoch, so its first epoch has no hit.
    let mut l = mk(epochs, epochs + 1, CachePolicy::NextUse);
    read_exact(&mut l, &st.cat, epochs, epochs + 1).unwrap();
    assert_eq!(l.stats().cache.hits, 0);
    drop(l);
    // LRU in memory: exact, and no more hits than MIN.
    let mut l = mk(0, epochs, CachePolicy::Lru);
    read_exact(&mut l, &st.cat, 0, epochs).unwrap();
    let lru = l.stats();
    eprintln!("in memory, LRU: {} hits", lru.cache.hits);
    assert_eq!(lru.cache.hits + lru.disk_reads, N * epochs);
    assert!(lru.cache.hits <= bound);
}

#[test]
fn an_area_in_memory_over_a_whole_space_keeps_what_the_rank_reads_next() {
    // A space that holds every sample, rank 1 of 4, 8 epochs: an area in
    // memory keeps the space's samples by next use (hits within MIN's on
    // the rank's order), where a whole space on disk has nothing to keep;
    // a memory tier of the same bytes (a fixed subset chosen by the rank's
    // reads) beside it for the record.
    let _counting = MEMORY_AREAS.lock().unwrap_or_else(|e| e.into_inner());
    let st = setup();
    let space = st.tmp.path().join("space");
    ok(&["preload", "--source", s(&st.src), "--space", s(&space)]);
    let (rank, world, epochs) = (1u32, 4u32, 8u64);
    let sampler = {
        let mut cfg = SamplerConfig::single(N, SEED);
        (cfg.rank, cfg.world) = (rank, world);
        Sampler::new(cfg).unwrap()
    };
    let reads = sampler.per_rank() * epochs;
    let budget = st.third / 2;
    let mk = |b: LoaderBuilder| {
        b.rank(rank, world)
            .seed(SEED)
            .batch_size(2)
            .pollers(2)
            .pin(false)
            // A ring far smaller than the rank's epoch (about 20 samples
            // of its 60): a read ahead of the write that keeps its sample
            // finds it not yet there (a missed hit, read from disk), which
            // a dataset of realistic size makes rare.
            .landing(test_ring(2 << 20))
            .end_epoch(Some(epochs))
            .build()
            .unwrap()
    };
    let read = |mut l: Loader| {
        for e in 0..epochs {
            l.set_epoch(e).unwrap();
            let mut k = 0u64;
            while let Some(b) = l.next_batch().unwrap() {
                for smp in b.iter() {
                    assert_eq!(smp.id, sampler.sample(e, k), "epoch {e} step {k}");
                    let c = st.cat.sample(smp.id);
                    assert_eq!(crc32c::crc32c(smp.bytes), c.crc32c, "sample {}", smp.id);
                    k += 1;
                }
            }
            assert_eq!(k, sampler.per_rank(), "epoch {e}");
        }
        l.stats()
    };
    let stats = read(mk(LoaderBuilder::space(&space)
        .cache_dir(Some(kspeed::cache::MEMORY_DIR.into()))
        .cache_bytes(budget)));
    let c = stats.cache;
    assert_eq!(c.hits + stats.disk_reads, reads, "{stats:?}");
    assert_eq!(stats.source_reads, 0);
    assert_eq!(c.corrupt + c.write_errors, 0, "{c:?}");
    let classes = classes_of(&st.cat, budget);
    let bound = min_hits_of(&st.cat, &classes, epochs, rank, world);
    let tier = read(mk(LoaderBuilder::space(&space).tier_bytes(budget)));
    eprintln!(
        "rank {rank} of {world}, {epochs} epochs, {reads} reads: area in memory {} hits ({} \
         planned) of MIN's {bound}; a memory tier of the same bytes {} hits; {c:?}",
        c.hits, c.planned_hits, tier.tier_hits
    );
    assert!(
        c.hits <= c.planned_hits && c.planned_hits <= bound,
        "{c:?}, MIN {bound}"
    );
    // Most planned hits land (122-124 of 126 here on a quiet machine).
    assert!(2 * c.hits > c.planned_hits, "{c:?}");
    // On disk the same space is refused by name: nothing to keep.
    let e = LoaderBuilder::space(&space)
        .cache_dir(Some(st.cache()))
        .cache_bytes(budget)
        .build()
        .err()
        .expect("refused");
    assert!(e.to_string().contains(":memory:"), "{e}");
}

#[test]
fn a_memory_level_above_the_area_on_disk_gives_min_s_hits_at_each_budget() {
    // `cache_memory_bytes` above `cache_dir` (a folder), policy `min`, a
    // rank alone over a source 3x the area on disk, the memory level half
    // of that. MIN is a stack algorithm: what it keeps in a smaller cache
    // it keeps in a larger one on the same order (per slot class, where
    // the larger has at least as many slots in each), so the memory
    // level's hits are among the disk's planned ones, and every read the
    // disk's plan calls a hit is served by one of the two: what memory
    // began to read plus what the disk planned is MIN's at the disk's
    // budget, whatever the timing (plus at most one a skipped write: a
    // write the writer could not take leaves the slot's old sample, which
    // a later admit of that same sample then reads, a hit no plan called
    // one).
    let _counting = MEMORY_AREAS.lock().unwrap_or_else(|e| e.into_inner());
    let st = setup();
    let epochs = 4;
    let memory_bytes = st.third / 2;
    let (disk_cl, mem_cl) = (
        classes_of(&st.cat, st.third),
        classes_of(&st.cat, memory_bytes),
    );
    assert!(
        disk_cl.0.len() == mem_cl.0.len()
            && disk_cl
                .0
                .iter()
                .zip(&mem_cl.0)
                .all(|(d, m)| d.0 == m.0 && d.1 >= m.1),
        "the test needs the memory level's classes within the disk's: {:?} {:?}",
        disk_cl.0,
        mem_cl.0
    );
    let before = memory_areas_open();
    let mut l = st
        .builder(CachePolicy::Min)
        .cache_memory_bytes(memory_bytes)
        .end_epoch(Some(epochs))
        .build()
        .unwrap();
    assert_eq!(memory_areas_open(), before + 1);
    read_exact(&mut l, &st.cat, 0, epochs).unwrap();
    let stats = l.stats();
    drop(l);
    assert_eq!(memory_areas_open(), before);
    let (mem, disk) = (stats.cache_memory, stats.cache);
    let (mem_min, disk_min) = (
        min_hits(&st.cat, &mem_cl, epochs),
        min_hits(&st.cat, &disk_cl, epochs),
    );
    eprintln!(
        "two levels, {epochs} epochs of {N}: memory {} hits ({} planned) of MIN's {mem_min} at \
         its {memory_bytes} bytes; disk {} hits ({} planned), MIN's at its {} bytes \
         {disk_min}; {} from the source",
        mem.hits, mem.planned_hits, disk.hits, disk.planned_hits, st.third, stats.disk_reads
    );
    assert_eq!(
        mem.hits + disk.hits + stats.disk_reads,
        N * epochs,
        "{stats:?}"
    );
    assert_eq!(
        mem.corrupt + mem.write_errors + disk.corrupt + disk.write_errors,
        0,
        "{stats:?}"
    );
    assert!(mem.area_bytes <= memory_bytes && disk.area_bytes <= st.third);
    assert_eq!(mem.planned_hits, mem_min, "{mem:?}");
    let served = mem.hits + mem.corrupt + disk.planned_hits;
    assert!(
        disk_min <= served && served <= disk_min + mem.skipped,
        "memory began {} reads and the disk planned {}: MIN's {disk_min} at the disk's budget; \
         {stats:?}",
        mem.hits + mem.corrupt,
        disk.planned_hits
    );
    assert!(
        mem.hits > 0 && disk.hits > 0,
        "both levels serve: {stats:?}"
    );
    assert!(mem.hits <= mem.planned_hits + mem.skipped, "{mem:?}");
    assert!(disk.hits <= disk.planned_hits + disk.skipped, "{disk:?}");
    // The area on disk is kept for the next run; the memory level is not.
    assert!(st
        .cache()
        .join("rank0")
        .join(kspeed::cache::DATA_FILE)
        .exists());

    // Refused by name: no folder below it, or an area in memory already.
    for (dir, bytes) in [
        (None, 0),
        (Some(kspeed::cache::MEMORY_DIR.into()), st.third),
    ] {
        let e = st
            .builder(CachePolicy::Min)
            .cache_dir(dir)
            .cache_bytes(bytes)
            .cache_memory_bytes(memory_bytes)
            .build()
            .err()
            .expect("refused");
        let msg = e.to_string();
        assert!(
            msg.contains("cache_memory_bytes") && msg.contains("folder"),
            "{msg}"
        );
    }
    // A memory budget too small for one slot names its own setting and
    // the smallest budget that makes one, which is accepted.
    let e = st
        .builder(CachePolicy::Min)
        .cache_memory_bytes(4096)
        .build()
        .err()
        .expect("refused");
    let msg = e.to_string();
    assert!(
        msg.contains("cache_memory_bytes 4096 holds no slot"),
        "{msg}"
    );
    let smallest: u64 = msg
        .rsplit("is ")
        .next()
        .and_then(|t| t.strip_suffix(" bytes"))
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no smallest budget in: {msg}"));
    let l = st
        .builder(CachePolicy::Min)
        .cache_memory_bytes(smallest)
        .build()
        .unwrap();
    assert!(l.stats().cache_memory.slots > 0);
}
