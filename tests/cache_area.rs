//! The NVMe cache area (`cache_dir`, issue 31): samples read from the
//! source kept on the local disk for their next read, by next use or LRU,
//! crash-safe.
//!
//! - four epochs of a source 3x the area, exact; the area never above its
//!   bound; its hits never above MIN's on the same order; what it holds
//!   (the journal, parsed as docs/CACHE.md describes it) is byte-exact;
//!   a second loader finds it and hits;
//! - a partial space's source samples are kept too;
//! - `kspeed read` killed (SIGKILL) while it writes the area: the journal
//!   names only whole, correct slots, and a rerun is exact and hits;
//! - slots rotted on disk: every sample still exact, the bad slots counted,
//!   emptied and journalled so;
//! - LRU on the same order hits less than next use's bound;
//! - three nodes in network namespaces serving partial spaces that hold a
//!   third of the dataset: the rank keeps the samples no node holds in its
//!   area (and only those), 4 epochs exact with no grant to a node without
//!   the sample; a node killed mid-epoch, the epoch still exact; a rerun
//!   finds the area intact and hits;
//! - two ranks given one cache_dir (as a launcher gives every rank the same
//!   options), alive at once: each its own area, exact, hitting next time;
//! - what is wrong is refused by name: another dataset's area, an area in
//!   use, no budget, nothing to keep, a source in cluster mode.

#[path = "common/cache_area.rs"]
mod area;
mod common;
#[path = "common/cache_loader.rs"]
mod loader;
#[path = "common/nodes.rs"]
mod nodes;

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use area::{check_held, meta, parse_journal};
use common::*;
use kspeed::cache::CachePolicy;
use kspeed::dataset::Catalog;
use kspeed::loader::LoaderBuilder;
use kspeed::sampler::{Sampler, SamplerConfig};
use kspeed::Error;

use loader::*;

/// tests/independent/cache_reader.py (written from docs/CACHE.md alone)
/// checks the area at `dir` against the source files under `src`; skips
/// (by name) without python3.
fn independent_reader(dir: &std::path::Path, src: &std::path::Path) {
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/independent/cache_reader.py"
    );
    // `timeout`: the read of its output has a deadline (300 s; it takes
    // seconds).
    let out = match Command::new("timeout")
        .args(["300", "python3", script, s(dir), s(src)])
        .output()
    {
        Ok(o) => o,
        Err(e) => {
            skip(&format!("python3 not runnable: {e}"));
            return;
        }
    };
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    if out.status.code() == Some(127) {
        skip("python3 is not installed");
        return;
    }
    assert!(
        out.status.success(),
        "the independent reader disagrees:\n{text}"
    );
}

#[test]
fn four_epochs_exact_within_the_bound_and_a_second_loader_hits() {
    let st = setup();
    let epochs = 4;
    let mut l = st.loader(CachePolicy::NextUse, 0, epochs);
    read_exact(&mut l, &st.cat, 0, epochs).unwrap();
    let stats = l.stats();
    drop(l); // the writer finishes what was queued
    let c = stats.cache;
    let dir = st.cache().join("rank0");
    let cl = meta(&dir);
    let slots = cl.slots();
    assert_eq!((c.slots, c.area_bytes), (slots, cl.area_bytes()));
    assert!(cl.area_bytes() <= st.third, "{cl:?}");
    assert!((2..N / 2).contains(&slots), "{slots} slots");
    // Every read is a hit or went to the source (read from its files:
    // `disk_reads` of a source loader).
    assert_eq!(c.hits + stats.disk_reads, N * epochs, "{stats:?}");
    assert_eq!(c.corrupt + c.write_errors, 0, "{c:?}");
    // Hits happen only where MIN has them (a write still queued or
    // skipped costs a hit, never adds one).
    let bound = min_hits(&st.cat, &cl, epochs);
    eprintln!(
        "{} hits of MIN's {bound} ({slots} slots); {} kept, {} not kept (writer behind)",
        c.hits, c.writes, c.skipped
    );
    assert!(c.hits <= bound, "{} hits, MIN {bound}", c.hits);
    assert!(bound > 0);
    let held = check_held(&dir, &st.cat);
    assert!(held as u64 <= slots && held > 0, "{held} held of {slots}");
    // A reader written from docs/CACHE.md alone agrees.
    independent_reader(&dir, &st.src);
    // Private, as a space is: its folder 0700, its files 0600.
    use std::os::unix::fs::PermissionsExt;
    let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&dir), 0o700, "{}", dir.display());
    for f in ["cache.meta", "cache.data", "cache.journal", "cache.lock"] {
        assert_eq!(mode(&dir.join(f)), 0o600, "{f}");
    }
    // A second loader (another process would do the same) finds what the
    // first kept, and reads exactly.
    let mut l = st.loader(CachePolicy::NextUse, epochs, epochs + 1);
    read_exact(&mut l, &st.cat, epochs, epochs + 1).unwrap();
    let c2 = l.stats().cache;
    assert!(c2.hits > 0, "{c2:?}");
    assert_eq!(c2.corrupt, 0, "{c2:?}");
    drop(l);
    check_held(&dir, &st.cat);
}

#[test]
fn lru_on_the_same_order_is_exact_and_hits_less_than_min() {
    let st = setup();
    let epochs = 3;
    let mut l = st.loader(CachePolicy::Lru, 0, epochs);
    read_exact(&mut l, &st.cat, 0, epochs).unwrap();
    let stats = l.stats();
    drop(l);
    let dir = st.cache().join("rank0");
    assert_eq!(stats.cache.hits + stats.disk_reads, N * epochs);
    check_held(&dir, &st.cat);
}

#[test]
fn a_partial_space_keeps_its_source_samples_in_the_area() {
    let st = setup();
    let space = st.tmp.path().join("space");
    ok(&[
        "preload",
        "--source",
        s(&st.src),
        "--space",
        s(&space),
        "--max-bytes",
        "8MiB",
    ]);
    let held_in_space = kspeed::dataset::Space::open(&space).unwrap().held_samples();
    let epochs = 3;
    let mk = || {
        LoaderBuilder::space(&space)
            .seed(SEED)
            .batch_size(8)
            .pollers(2)
            .pin(false)
            .landing(test_ring(8 << 20))
            .cache_dir(Some(st.cache()))
            .cache_bytes(st.third)
            .end_epoch(Some(epochs))
    };
    let mut l = mk().build().unwrap();
    read_exact(&mut l, &st.cat, 0, epochs).unwrap();
    let stats = l.stats();
    drop(l);
    assert_eq!(stats.disk_reads, held_in_space * epochs);
    assert_eq!(
        stats.source_reads + stats.cache.hits,
        (N - held_in_space) * epochs,
        "{stats:?}"
    );
    let dir = st.cache().join("rank0");
    let held = check_held(&dir, &st.cat);
    assert!(held > 0);
    // The area keeps only what the space does not hold.
    let sp = kspeed::dataset::Space::open(&space).unwrap();
    for (_, (id, _, _)) in parse_journal(&dir).0 {
        assert!(sp.location(id).is_none(), "sample {id} is in the space");
    }
}

#[test]
fn a_read_killed_while_writing_leaves_whole_slots_and_a_rerun_exact() {
    let st = setup();
    let dir = st.cache().join("rank0");
    let mut child = Command::new(kspeed_bin())
        .args(["read", "--source", s(&st.src), "--catalog", s(&st.catalog)])
        .args(["--seed", &SEED.to_string(), "--epochs", "100000"])
        .args(["--cache-dir", s(&st.cache())])
        .args(["--cache-bytes", &st.third.to_string()])
        .args(["--no-huge-pages", "--no-mlock", "--progress", "none"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // Killed once the writer has journalled a few dozen records (deadline
    // 60 s): it is writing all the time (next use rewrites slots every
    // epoch).
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if parse_journal(&dir).1 >= 40 {
            break;
        }
        assert!(
            child.try_wait().unwrap().is_none(),
            "kspeed read ended before it was killed"
        );
        assert!(Instant::now() < deadline, "no journal records within 60 s");
        std::thread::yield_now();
    }
    child.kill().unwrap();
    child.wait().unwrap();
    let held = check_held(&dir, &st.cat);
    assert!(held > 0);
    let mut l = st.loader(CachePolicy::NextUse, 0, 2);
    read_exact(&mut l, &st.cat, 0, 2).unwrap();
    let c = l.stats().cache;
    assert!(c.hits > 0 && c.corrupt == 0, "{c:?}");
    drop(l);
    check_held(&dir, &st.cat);
}

#[test]
fn rotten_slots_are_read_from_the_source_and_emptied() {
    let st = setup();
    let mut l = st.loader(CachePolicy::NextUse, 0, 2);
    read_exact(&mut l, &st.cat, 0, 2).unwrap();
    drop(l);
    let dir = st.cache().join("rank0");
    let cl = meta(&dir);
    let (held, _) = parse_journal(&dir);
    assert!(!held.is_empty());
    // One byte of every held sample flipped, as a disk that rots would.
    let mut data = std::fs::read(dir.join("cache.data")).unwrap();
    for &slot in held.keys() {
        data[cl.slot(slot as u64).0 as usize] ^= 0x5a;
    }
    std::fs::write(dir.join("cache.data"), &data).unwrap();
    let mut l = st.loader(CachePolicy::NextUse, 2, 3);
    read_exact(&mut l, &st.cat, 2, 3).unwrap();
    let c = l.stats().cache;
    drop(l);
    assert!(c.corrupt >= 1, "{c:?}");
    // What the journal holds now is whole again: the rotten slots were
    // journalled empty (or rewritten with good bytes).
    check_held(&dir, &st.cat);
}

#[test]
fn what_is_wrong_is_refused_by_name() {
    let st = setup();
    // No budget.
    let e = st
        .builder(CachePolicy::NextUse)
        .cache_bytes(0)
        .build()
        .err()
        .unwrap();
    assert!(e.to_string().contains("cache_bytes"), "{e}");
    // A budget smaller than one slot.
    let e = st
        .builder(CachePolicy::NextUse)
        .cache_bytes(4096)
        .build()
        .err()
        .unwrap();
    assert!(e.to_string().contains("holds no slot"), "{e}");
    // In use by another loader of the same rank.
    let l = st.builder(CachePolicy::NextUse).build().unwrap();
    let e = st.builder(CachePolicy::NextUse).build().err().unwrap();
    assert!(matches!(e, Error::CacheArea { .. }), "{e:?}");
    assert!(e.to_string().contains("in use"), "{e}");
    drop(l);
    // Another dataset's area.
    let other = st.tmp.path().join("other");
    gen("tiny", 50, &other);
    let e = LoaderBuilder::source(s(&other))
        .pin(false)
        .landing(test_ring(8 << 20))
        .cache_dir(Some(st.cache()))
        .cache_bytes(1 << 20)
        .build()
        .err()
        .unwrap();
    assert!(matches!(e, Error::CacheArea { .. }), "{e:?}");
    let msg = e.to_string();
    assert!(
        msg.contains("another dataset") && msg.contains(s(&st.cache())),
        "{msg}"
    );
    // The command line says the same and exits non-zero.
    let out = fails(
        &[
            "read",
            "--source",
            s(&other),
            "--cache-dir",
            s(&st.cache()),
            "--cache-bytes",
            "1MiB",
            "--no-huge-pages",
            "--no-mlock",
        ],
        1,
    );
    assert!(out.contains("another dataset"), "{out}");
    // A space that holds everything has nothing to keep.
    let space = st.tmp.path().join("whole");
    ok(&["preload", "--source", s(&st.src), "--space", s(&space)]);
    let e = LoaderBuilder::space(&space)
        .batch_size(8)
        .pin(false)
        .landing(test_ring(8 << 20))
        .cache_dir(Some(st.tmp.path().join("c2")))
        .cache_bytes(1 << 30)
        .build()
        .err()
        .unwrap();
    assert!(
        e.to_string().contains("nothing comes from the source"),
        "{e}"
    );
}

#[test]
fn three_nodes_of_partial_spaces_and_the_rank_s_cache_area() {
    const NODES: usize = 3;
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    gen("imagenet", 300, &src);
    let catalog = tmp.path().join("cat.ksc");
    ok(&["catalog", "--source", s(&src), "--out", s(&catalog)]);
    let cat = Catalog::open(&catalog).unwrap();
    // Two copies, each node holding a ninth of the dataset: the three hold
    // a third at most; the rest is read from the source by the rank.
    let budget = (cat.total_bytes() / 9).to_string();
    let spaces = nodes::preload_nodes(
        &src,
        &catalog,
        tmp.path(),
        NODES,
        &["--replicas", "2", "--max-bytes", &budget],
    );
    let opened: Vec<kspeed::dataset::Space> = spaces
        .iter()
        .map(|p| kspeed::dataset::Space::open(p).unwrap())
        .collect();
    let held_by = |id: u64| {
        (0..NODES)
            .filter(|&n| opened[n].location(id).is_some())
            .collect::<Vec<_>>()
    };
    let (mut local, mut remote, mut nobody) = (0u64, 0u64, Vec::new());
    for id in 0..cat.len() {
        match held_by(id).as_slice() {
            [] => nobody.push(id),
            h if h.contains(&0) => local += 1,
            _ => remote += 1,
        }
    }
    assert!(local > 0 && remote > 0 && nobody.len() > 30);
    let nobody_bytes: u64 = nobody.iter().map(|&id| cat.sample(id).len as u64).sum();
    let Some(ns) = nodes::Netns::create(NODES) else {
        return;
    };
    let token = tmp.path().join("token");
    std::fs::write(&token, "cache-token\n").unwrap();
    let (mut serves, addrs) = nodes::serve_in_namespaces(&spaces, &ns, &token);
    let cluster = nodes::cluster_of(&addrs);
    let area = tmp.path().join("cache");
    let rank = |from: u64, to: u64| {
        LoaderBuilder::space(&spaces[0])
            .seed(SEED)
            .batch_size(8)
            .pollers(2)
            .pin(false)
            .landing(test_ring(8 << 20))
            .cluster(cluster.clone())
            .token(b"cache-token")
            .cache_dir(Some(area.clone()))
            .cache_bytes(nobody_bytes / 3)
            .start_at(kspeed::sampler::Position {
                epoch: from,
                index: 0,
            })
            .end_epoch(Some(to))
            .build()
            .unwrap()
    };
    let epochs = 4;
    let mut l = rank(0, epochs);
    read_exact(&mut l, &cat, 0, epochs).unwrap();
    let st = l.stats();
    drop(l);
    assert_eq!(st.failovers, 0, "a grant went to a node without the sample");
    assert_eq!(st.disk_reads, local * epochs, "{st:?}");
    assert_eq!(st.remote_samples, remote * epochs, "{st:?}");
    // The samples no node holds: from the source or the area, once each
    // per epoch.
    assert_eq!(
        st.source_reads + st.cache.hits,
        nobody.len() as u64 * epochs,
        "{st:?}"
    );
    let dir = area.join("rank0");
    assert!(meta(&dir).area_bytes() <= nobody_bytes / 3);
    let held = check_held(&dir, &cat);
    assert!(held > 0);
    for (_, (id, _, _)) in parse_journal(&dir).0 {
        assert!(
            nobody.contains(&id),
            "sample {id} is held by a node, not the area's to keep"
        );
    }
    // Node 1 killed mid-epoch: the epoch is still exact (its samples from
    // node 2 or the source), and the area stays whole.
    let sampler = Sampler::new(SamplerConfig::single(cat.len(), SEED)).unwrap();
    let mut l = rank(epochs, epochs + 1);
    l.set_epoch(epochs).unwrap();
    let (mut k, mut batches) = (0u64, 0u64);
    while let Some(b) = l.next_batch().unwrap() {
        for smp in b.iter() {
            assert_eq!(smp.id, sampler.sample(epochs, k), "step {k}");
            assert_eq!(
                crc32c::crc32c(smp.bytes),
                cat.sample(smp.id).crc32c,
                "sample {}",
                smp.id
            );
            k += 1;
        }
        drop(b);
        batches += 1;
        if batches == 3 {
            serves[1].take().unwrap().kill9();
        }
    }
    assert_eq!(k, cat.len());
    let c = l.stats().cache;
    drop(l);
    assert!(c.hits > 0 && c.corrupt == 0, "{c:?}");
    check_held(&dir, &cat);
    // A source in cluster mode: every sample comes from the nodes, so a
    // cache area is refused by name.
    let e = LoaderBuilder::source(s(&src))
        .catalog(&catalog)
        .batch_size(8)
        .pin(false)
        .landing(test_ring(8 << 20))
        .cluster(cluster.clone())
        .token(b"cache-token")
        .cache_dir(Some(tmp.path().join("c3")))
        .cache_bytes(1 << 30)
        .build()
        .err()
        .unwrap();
    assert!(
        e.to_string().contains("no node's partial space holds"),
        "{e}"
    );
}

#[test]
fn restarts_mid_epoch_with_reads_of_the_area_in_flight_give_every_slot_back() {
    // A first loader fills the area; a second restarts (set_epoch) again
    // and again a few batches into epochs that hit the area, with slot
    // reads in flight. Each restart checks every slot read was given back
    // (the run's stop asserts it); then the area still takes new samples
    // (a slot left with a reader would never be rewritten) and reads
    // exactly.
    let st = setup();
    let mut l = st.loader(CachePolicy::NextUse, 0, 2);
    read_exact(&mut l, &st.cat, 0, 2).unwrap();
    drop(l);
    // Reads of 8 KiB, two in flight per poller: a sample is many parts,
    // so a stop mostly finds one half issued.
    let mut l = st
        .builder(CachePolicy::NextUse)
        .queue_depth(2)
        .max_read_bytes(8192)
        .build()
        .unwrap();
    for round in 0..6u64 {
        l.set_epoch(2 + round % 3).unwrap();
        for _ in 0..3 {
            let b = l.next_batch().unwrap().expect("a batch");
            for smp in b.iter() {
                assert_eq!(crc32c::crc32c(smp.bytes), st.cat.sample(smp.id).crc32c);
            }
        }
    }
    read_exact(&mut l, &st.cat, 5, 7).unwrap();
    let c = l.stats().cache;
    drop(l);
    assert!(c.hits > 0 && c.corrupt == 0 && c.write_errors == 0, "{c:?}");
    check_held(&st.cache().join("rank0"), &st.cat);
}

/// Unmounts on drop.
struct Mount(PathBuf);

impl Drop for Mount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}

#[test]
fn a_full_disk_under_the_journal_loses_nothing_and_leaves_it_whole() {
    // The area on a tmpfs with room for its slots and a few pages more:
    // the journal runs out of space mid-run. Every sample is still
    // delivered exactly (from the source), the failed writes are counted,
    // the journal is cut back to whole records each time, and a rerun
    // finds it whole and hits.
    if !is_root() {
        skip("mounting a tmpfs needs root");
        return;
    }
    let st = setup();
    let area_bytes = kspeed::cache::SlotClasses::for_catalog(&st.cat, st.third).area_bytes();
    let mnt = st.cache();
    std::fs::create_dir_all(&mnt).unwrap();
    let size = format!("size={}", area_bytes + 4 * 4096);
    let ok_mount = Command::new("mount")
        .args(["-t", "tmpfs", "-o", &size, "kspeed-cache-test", s(&mnt)])
        .status()
        .is_ok_and(|st| st.success());
    if !ok_mount {
        skip("could not mount a tmpfs");
        return;
    }
    let _m = Mount(mnt.clone());
    let epochs = 4;
    let mut l = st.loader(CachePolicy::Min, 0, epochs);
    read_exact(&mut l, &st.cat, 0, epochs).unwrap();
    let c = l.stats().cache;
    drop(l);
    assert!(
        c.write_errors > 0,
        "the journal never ran out of space: {c:?}"
    );
    let dir = mnt.join("rank0");
    assert_eq!(
        std::fs::metadata(dir.join("cache.journal")).unwrap().len() % 32,
        0,
        "the journal holds whole records only"
    );
    let held = check_held(&dir, &st.cat);
    assert!(held > 0);
    let mut l = st.loader(CachePolicy::NextUse, epochs, epochs + 1);
    read_exact(&mut l, &st.cat, epochs, epochs + 1).unwrap();
    assert!(l.stats().cache.hits > 0);
    drop(l);
    check_held(&dir, &st.cat);
}

#[test]
fn ranks_of_a_node_given_one_cache_dir_each_keep_their_own_area() {
    // torchrun gives every rank the same options: ranks 0 and 1 of 2, alive
    // at once with one cache_dir, each get `rank<N>` and read exactly; a
    // second pair finds both areas and hits.
    let st = setup();
    let rank = |r: u32| {
        st.builder(CachePolicy::NextUse)
            .rank(r, 2)
            .end_epoch(Some(2))
            .build()
            .unwrap()
    };
    for pass in 0..2 {
        let mut ls = [rank(0), rank(1)];
        for e in 0..2u64 {
            let mut ids = Vec::new();
            for l in ls.iter_mut() {
                l.set_epoch(e).unwrap();
                while let Some(b) = l.next_batch().unwrap() {
                    for smp in b.iter() {
                        assert_eq!(crc32c::crc32c(smp.bytes), st.cat.sample(smp.id).crc32c);
                        ids.push(smp.id);
                    }
                }
            }
            ids.sort_unstable();
            assert_eq!(ids, (0..N).collect::<Vec<_>>(), "pass {pass} epoch {e}");
        }
        let hits: Vec<u64> = ls.iter().map(|l| l.stats().cache.hits).collect();
        drop(ls);
        if pass == 1 {
            assert!(hits.iter().all(|&h| h > 0), "{hits:?}");
        }
    }
    for r in 0..2 {
        assert!(check_held(&st.cache().join(format!("rank{r}")), &st.cat) > 0);
    }
}
