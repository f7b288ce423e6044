//! The NVMe cache area: samples that came from the source, kept on this
//! node's disk for their next read, in a folder of three files:
//!
//! - `cache.meta`: what the area holds (the dataset's identity, the slot
//!   classes), text, written once (new classes start it empty);
//! - `cache.data`: fixed slots in size classes from 4 KiB to the catalog's
//!   99th percentile sample length (classes.rs; larger samples are not
//!   kept), preallocated, read and written with `O_DIRECT`;
//! - `cache.journal`: 32-byte records, each with its own CRC32C: slot `s`
//!   holds sample `id` (its length and CRC from the catalog), or slot `s` is
//!   empty. The last record of a slot says what it holds.
//!
//! Crash safety: a slot is journalled empty (and the journal synced) before
//! its bytes are overwritten, and journalled full only after its new bytes
//! are synced; so after a `kill -9` or a power cut every slot the journal
//! calls full holds the bytes it names. Replay stops at the first torn
//! record and drops it. Every read from the area is still checked against
//! the catalog's CRC (a disk can rot), and a slot that fails is emptied.
//!
//! Who holds what at run time is one atomic word per slot ([`SlotWord`]),
//! which the pollers read before they read a slot and the writer thread
//! (`writer.rs`) changes; the decision of what to keep is the planner's
//! (`loader/cache_plan.rs`), made along the rank's known order. The planner and the words
//! can disagree (a write not yet landed, a write skipped for want of a
//! buffer): a poller then reads the source, never wrong bytes.

use std::fs::File;
use std::io::Read;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::slots::{
    AreaShared, Counters, Record, SlotWord, MAX_CACHED_ID, READER_ONE, RECORD_BYTES, REC_FULL,
    S_EMPTY, S_FULL,
};
use super::{SlotClasses, MAX_SLOTS};
use crate::dataset::Catalog;
use crate::error::{Error, IoContext, Result};
use crate::format::sync_parent;

/// The metadata file's name.
pub const META_FILE: &str = "cache.meta";
/// The slots' file.
pub const DATA_FILE: &str = "cache.data";
/// The journal's file.
pub const JOURNAL_FILE: &str = "cache.journal";
const LOCK_FILE: &str = "cache.lock";
/// The `cache_dir` that keeps the area in this process's memory instead
/// of a folder (SQLite's name for its in-memory database): evicted by the
/// same policy, gone when the loader is.
pub const MEMORY_DIR: &str = ":memory:";

/// Whether `dir` is [`MEMORY_DIR`] (not `./:memory:`, which names a
/// folder: `Path` keeps the leading `.`).
pub fn is_memory_dir(dir: &Path) -> bool {
    dir == Path::new(MEMORY_DIR)
}
const META_VERSION: &str = "kspeed-cache 1";
/// How long an area held by someone else is waited for before it is
/// refused as in use (area.rs, `CacheArea::open`).
const LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(3);

/// Which samples the area keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CachePolicy {
    /// Keep what this rank reads soonest, weighing each write: Belady's MIN
    /// with bypass over the known order, except that a sample replaces a
    /// held one only if that gains a hit for its write (it is read again
    /// before the held one's next read, or the held one's next read is
    /// never, or later than its own by more than an epoch times the share
    /// of the dataset the rank reads in one: `NextUse::swap_horizon`). Under a reshuffle every epoch
    /// it hits as MIN does and writes only to fill the area; MIN replaces a
    /// third or more of the area every epoch for no hit. The default.
    NextUse,
    /// Belady's MIN with bypass: the fewest source reads, whatever they
    /// cost in writes to the area.
    Min,
    /// Keep what was read last, admitting every sample (the page cache's
    /// and the peers' policy), for comparison.
    Lru,
}

impl CachePolicy {
    /// Parses `next-use`, `min` or `lru`.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "next-use" | "next_use" => Some(CachePolicy::NextUse),
            "min" => Some(CachePolicy::Min),
            "lru" => Some(CachePolicy::Lru),
            _ => None,
        }
    }

    /// The name [`CachePolicy::parse`] takes.
    pub fn name(self) -> &'static str {
        match self {
            CachePolicy::NextUse => "next-use",
            CachePolicy::Min => "min",
            CachePolicy::Lru => "lru",
        }
    }
}

/// The cache area's counters, for [`Stats`](crate::loader::Stats).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct CacheStats {
    /// Samples read from the area instead of the source.
    pub hits: u64,
    /// Their bytes.
    pub hit_bytes: u64,
    /// Reads the policy planned as hits (with `min`, Belady's MIN's hits on
    /// this rank's order; with `next-use`, those of MIN weighing writes): `hits` falls short of it where a write
    /// had not landed by the read (or was skipped), or a slot failed its
    /// check.
    pub planned_hits: u64,
    /// Samples written into the area (durable and journalled).
    pub writes: u64,
    /// Their bytes.
    pub write_bytes: u64,
    /// Samples the policy chose to keep but that were not written: no
    /// write buffer was free (the writer behind), or the slot's old
    /// contents were still being read. Back-pressure, not an error.
    pub skipped: u64,
    /// Reads from the area whose bytes did not match the catalog's CRC:
    /// the slot is emptied and the sample read from the source.
    pub corrupt: u64,
    /// Writes that failed (logged with the errno): the slot stays empty.
    pub write_errors: u64,
    /// Samples held now, or being written (a slot taken by a write still
    /// in flight counts; `writes` only once it is durable).
    pub held: u64,
    /// Slots in the area (of every size class).
    pub slots: u64,
    /// The area's bytes (`cache.data`, within `cache_bytes`).
    pub area_bytes: u64,
}

/// An open cache area (module doc). One process at a time (a lock file);
/// a loader's several ranks each have their own (`rank<N>` under the
/// folder the user names).
pub struct CacheArea {
    pub(crate) shared: Arc<AreaShared>,
    pub(crate) writer: super::writer::Writer,
    /// The lock file, held (flock) while the area is open (none for an
    /// area in memory).
    _lock: Option<File>,
}

/// The facts a cache area is opened with.
pub struct AreaSpec<'a> {
    /// The folder (created if missing).
    pub dir: &'a Path,
    /// The catalog whose samples it holds.
    pub catalog: &'a Catalog,
    /// Its budget (classes.rs shares it among the slot sizes).
    pub cache_bytes: u64,
    /// The setting that gave `cache_bytes`, as the area's refusals name
    /// it (`"cache_bytes"`, or `"cache_memory_bytes"` for the memory level
    /// above an area on disk).
    pub budget_setting: &'a str,
}

impl CacheArea {
    /// Opens (or creates) the area in `spec.dir` for `spec.catalog`,
    /// replaying its journal: what a previous run kept is kept, checked
    /// against the catalog. A folder that holds another dataset's area is
    /// refused by name; a new budget starts the area empty.
    pub fn open(spec: &AreaSpec<'_>) -> Result<CacheArea> {
        if is_memory_dir(spec.dir) {
            return Self::open_in_memory(spec);
        }
        let dir = spec.dir;
        let cat = spec.catalog;
        // Private, as a space is: its folder 0700, its files 0600 (the
        // samples are the dataset's). Folders above it (a cache_dir shared
        // by several jobs) get the usual mode.
        if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent).ctx("create", parent)?;
        }
        match std::fs::DirBuilder::new().mode(0o700).create(dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && dir.is_dir() => {}
            Err(e) => return Err(Error::io("create", dir, e)),
        }
        let lock_path = dir.join(LOCK_FILE);
        let lock = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .mode(0o600)
            .open(&lock_path)
            .ctx("open", &lock_path)?;
        // A flock belongs to the open file, which a process forked from
        // ours shares until it execs: a lock another thread's child holds
        // for that moment (or one a loader of this process is just
        // releasing) is waited out, up to LOCK_WAIT, before the area is
        // called in use.
        let deadline = std::time::Instant::now() + LOCK_WAIT;
        loop {
            match lock.try_lock() {
                Ok(()) => break,
                Err(std::fs::TryLockError::WouldBlock) if std::time::Instant::now() < deadline => {
                    std::thread::sleep(std::time::Duration::from_millis(10));
                }
                Err(std::fs::TryLockError::WouldBlock) => {
                    return Err(Error::CacheArea {
                        path: dir.to_path_buf(),
                        reason: "in use by another process (each rank needs its own cache \
                                 area: kspeed puts rank N's under `rank<N>` of cache_dir)"
                            .into(),
                    })
                }
                Err(std::fs::TryLockError::Error(e)) => {
                    return Err(Error::io("lock", &lock_path, e))
                }
            }
        }
        let (classes, slots) = Self::slot_classes_for(spec)?;
        let identity = u64::from(cat.identity());
        let meta = format!(
            "{META_VERSION}\ndataset {identity:08x}\nclasses {}\nslots {slots}\n",
            classes.to_meta()
        );
        let meta_path = dir.join(META_FILE);
        let fresh = match std::fs::read_to_string(&meta_path) {
            Ok(old) if old == meta => false,
            Ok(old) => {
                let mut lines = old.lines();
                if lines.next() != Some(META_VERSION) {
                    return Err(Error::CacheArea {
                        path: dir.to_path_buf(),
                        reason: format!(
                            "{META_FILE} is not a kspeed cache area of this version \
                             (first line {:?}, expected {META_VERSION:?}); remove the folder \
                             or name another cache_dir",
                            old.lines().next().unwrap_or("")
                        ),
                    });
                }
                let theirs = lines.next().unwrap_or("");
                if theirs != format!("dataset {identity:08x}") {
                    return Err(Error::CacheArea {
                        path: dir.to_path_buf(),
                        reason: format!(
                            "it holds another dataset ({theirs}; this loader reads dataset \
                             {identity:08x}): remove the folder or name another cache_dir"
                        ),
                    });
                }
                log::info!(
                    "cache area {}: new slot classes ({slots} slots, {} bytes); starting empty",
                    dir.display(),
                    classes.area_bytes()
                );
                true
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => true,
            Err(e) => return Err(Error::io("read", &meta_path, e)),
        };
        let data_path = dir.join(DATA_FILE);
        let journal_path = dir.join(JOURNAL_FILE);
        let (data, direct) = crate::sys::open_direct_rw(&data_path).ctx("open", &data_path)?;
        let data_bytes = classes.area_bytes();
        let mut fresh = fresh;
        if !fresh {
            let len = data.metadata().ctx("stat", &data_path)?.len();
            if len < data_bytes {
                // A crash while an area was being made (its data file cut,
                // its metadata not yet rewritten): make it again.
                log::warn!(
                    "cache area {}: {DATA_FILE} is {len} bytes, its metadata says {data_bytes} \
                     (an area left half made); starting empty",
                    dir.display()
                );
                fresh = true;
            }
        }
        if fresh {
            // The journal first: a crash between these steps leaves an
            // area with no journal (empty), never records over new slots.
            match std::fs::remove_file(&journal_path) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(Error::io("remove", &journal_path, e)),
            }
            sync_parent(&journal_path)?;
            data.set_len(0).ctx("truncate", &data_path)?;
            match crate::sys::allocate(&data, data_bytes) {
                Ok(()) => {}
                Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => {
                    data.set_len(data_bytes).ctx("truncate", &data_path)?
                }
                Err(e) => {
                    let _ = data.set_len(0);
                    return Err(Error::io("preallocate", &data_path, e));
                }
            }
            data.sync_all().ctx("fsync", &data_path)?;
            // Synced, and its directory too.
            crate::format::write_file_atomic_mode(&meta_path, meta.as_bytes(), 0o600)?;
        }
        let (held, dropped) = replay(&journal_path, cat, &classes)?;
        if dropped {
            // The journal named slots that are not held (a record that
            // does not match the catalog or its slot, a sample in two
            // slots): rewritten with what is, so that the writer's view of
            // the journal (what a slot must be journalled empty from
            // before it is overwritten) is the journal's own.
            let recs: Vec<Record> = held.iter().flatten().copied().collect();
            drop(super::slots::write_journal(&journal_path, &recs)?);
            sync_parent(&journal_path)?;
        }
        let words: Box<[AtomicU64]> = (0..slots).map(|_| AtomicU64::new(0)).collect();
        for (slot, rec) in held.iter().enumerate() {
            if let Some(r) = rec {
                words[slot].store(SlotWord::pack(Some(r.id), S_FULL), Ordering::Relaxed);
            }
        }
        let shared = Arc::new(AreaShared {
            dir: dir.to_path_buf(),
            data,
            direct,
            in_memory: false,
            classes,
            words,
            counters: Counters::default(),
        });
        let writer = super::writer::Writer::start(shared.clone(), Some(&journal_path), held)?;
        Ok(CacheArea {
            shared,
            writer,
            _lock: Some(lock),
        })
    }

    /// The area's slot classes for `spec` and their slots, or why the
    /// budget or the catalog cannot make an area.
    fn slot_classes_for(spec: &AreaSpec<'_>) -> Result<(SlotClasses, u64)> {
        let cat = spec.catalog;
        let classes = SlotClasses::for_catalog(cat, spec.cache_bytes);
        let slots = classes.slots();
        if slots == 0 {
            return Err(Error::InvalidConfig(format!(
                "{} {} holds no slot: the budget is shared among the slot size classes in \
                 proportion to their samples' bytes, and the smallest that gives one a slot \
                 over this catalog is {} bytes",
                spec.budget_setting,
                spec.cache_bytes,
                SlotClasses::smallest_budget_bytes(
                    &(0..cat.len())
                        .map(|id| cat.sample(id).len as u64)
                        .collect::<Vec<_>>()
                )
            )));
        }
        if slots >= MAX_SLOTS {
            return Err(Error::InvalidConfig(format!(
                "{} {} makes {slots} slots, more than the area can index",
                spec.budget_setting, spec.cache_bytes
            )));
        }
        if cat.len() > MAX_CACHED_ID {
            return Err(Error::InvalidConfig(format!(
                "a cache area names samples by 40 bits; the catalog has {}",
                cat.len()
            )));
        }
        Ok((classes, slots))
    }

    /// The area kept in this process's memory (`spec.dir` is
    /// [`MEMORY_DIR`]): its slots in an anonymous memory file, no journal
    /// and no lock (nothing outlives the process, and no other process
    /// can name it), empty at the start; planned, read and written as an
    /// area on disk is, so a hit is a copy from memory by the kernel and
    /// the same policy decides what stays.
    fn open_in_memory(spec: &AreaSpec<'_>) -> Result<CacheArea> {
        let (classes, slots) = Self::slot_classes_for(spec)?;
        // The memory file reserves nothing until written: a budget meant
        // for a disk would fill the memory mid-run and be killed for it.
        if let Some((limit, what)) = memory_limit().filter(|&(l, _)| classes.area_bytes() > l) {
            return Err(Error::InvalidConfig(format!(
                "an area in memory: {} {} makes an area of {} bytes, more than {what} \
                 ({limit} bytes); lower {}",
                spec.budget_setting,
                spec.cache_bytes,
                classes.area_bytes(),
                spec.budget_setting
            )));
        }
        let data = crate::sys::memfd(c"kspeed-cache", classes.area_bytes()).map_err(|e| {
            Error::CacheArea {
                path: spec.dir.to_path_buf(),
                reason: format!(
                    "its {} bytes of memory could not be had ({e}); lower {}",
                    classes.area_bytes(),
                    spec.budget_setting
                ),
            }
        })?;
        let words: Box<[AtomicU64]> = (0..slots).map(|_| AtomicU64::new(0)).collect();
        let shared = Arc::new(AreaShared {
            dir: spec.dir.to_path_buf(),
            data,
            direct: false,
            in_memory: true,
            classes,
            words,
            counters: Counters::default(),
        });
        let writer =
            super::writer::Writer::start(shared.clone(), None, vec![None; slots as usize])?;
        Ok(CacheArea {
            shared,
            writer,
            _lock: None,
        })
    }

    /// The folder.
    pub fn dir(&self) -> &Path {
        &self.shared.dir
    }

    /// The slot size classes.
    pub fn classes(&self) -> &SlotClasses {
        &self.shared.classes
    }

    /// Where slot `slot` starts in `cache.data`, and its bytes.
    pub fn slot(&self, slot: u32) -> (u64, u64) {
        self.shared.classes.slot(slot)
    }

    /// Slots.
    pub fn slots(&self) -> u32 {
        self.shared.words.len() as u32
    }

    /// Whether the slots are read and written with O_DIRECT.
    pub fn direct(&self) -> bool {
        self.shared.direct
    }

    /// Whether the area is in memory ([`MEMORY_DIR`]), not in a folder.
    pub fn in_memory(&self) -> bool {
        self.shared.in_memory
    }

    /// The slots' descriptor (pollers read slots through it).
    pub(crate) fn data_fd(&self) -> RawFd {
        self.shared.data.as_raw_fd()
    }

    /// (slot, sample) of every slot held now.
    pub(crate) fn held(&self) -> Vec<(u32, u64)> {
        self.shared
            .words
            .iter()
            .enumerate()
            .filter_map(|(s, w)| {
                let w = w.load(Ordering::Acquire);
                (SlotWord::state(w) != S_EMPTY)
                    .then(|| SlotWord::id(w).map(|id| (s as u32, id)))
                    .flatten()
            })
            .collect()
    }

    /// The planner decided a read of a sample is a hit (counted whether or
    /// not the slot has it by then).
    pub(crate) fn planned_hit(&self) {
        self.shared
            .counters
            .planned_hits
            .fetch_add(1, Ordering::Relaxed);
    }

    /// Whether `slot` holds nothing and is not being written.
    pub(crate) fn slot_empty(&self, slot: u32) -> bool {
        SlotWord::state(self.shared.words[slot as usize].load(Ordering::Acquire)) == S_EMPTY
    }

    /// A poller is about to read `slot` for sample `id`: whether the slot
    /// holds it, durably; if so the slot is not rewritten until
    /// [`CacheArea::end_read`].
    pub(crate) fn begin_read(&self, slot: u32, id: u64) -> bool {
        let w = &self.shared.words[slot as usize];
        let mut cur = w.load(Ordering::Acquire);
        loop {
            if SlotWord::state(cur) != S_FULL || SlotWord::id(cur) != Some(id) {
                return false;
            }
            assert!(
                SlotWord::readers(cur) < (1 << 21),
                "cache slot {slot}: reader count out of range (a begin_read without end_read)"
            );
            match w.compare_exchange_weak(
                cur,
                cur + READER_ONE,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return true,
                Err(now) => cur = now,
            }
        }
    }

    /// Reads of slots in progress, over every slot (O(slots): for checks
    /// when no poller runs).
    pub(crate) fn readers(&self) -> u64 {
        self.shared
            .words
            .iter()
            .map(|w| SlotWord::readers(w.load(Ordering::Acquire)))
            .sum()
    }

    /// A read [`CacheArea::begin_read`] allowed was never finished (its
    /// poller failed or stopped with it open): the reader goes, nothing is
    /// counted.
    pub(crate) fn abandon_read(&self, slot: u32) {
        let before = self.shared.words[slot as usize].fetch_sub(READER_ONE, Ordering::AcqRel);
        assert!(
            SlotWord::readers(before) > 0,
            "cache slot {slot}: abandon_read without begin_read"
        );
    }

    /// The read [`CacheArea::begin_read`] allowed is over. With `corrupt`,
    /// its bytes did not match the catalog: the slot is emptied (the writer
    /// journals it) and counted.
    pub(crate) fn end_read(&self, slot: u32, len: u64, corrupt: bool) {
        let w = &self.shared.words[slot as usize];
        if corrupt {
            // Before this reader goes: the slot cannot be claimed for
            // another sample in between.
            if let Some(id) = SlotWord::id(w.load(Ordering::Acquire)) {
                self.writer.evict(slot, id);
            }
        }
        let before = w.fetch_sub(READER_ONE, Ordering::AcqRel);
        assert!(
            SlotWord::readers(before) > 0,
            "cache slot {slot}: end_read without begin_read"
        );
        let c = &self.shared.counters;
        if corrupt {
            c.corrupt.fetch_add(1, Ordering::Relaxed);
        } else {
            c.hits.fetch_add(1, Ordering::Relaxed);
            c.hit_bytes.fetch_add(len, Ordering::Relaxed);
        }
    }

    /// Sample `id`, whose bytes (`bytes`, checked against the catalog's
    /// CRC `crc` by the caller) are in the ring now, should be kept in
    /// `slot`: copies them to a write buffer for the writer thread (through
    /// the kernel with `faultable`: `bytes` is then a rank's hugetlb ring
    /// in the node agent, `Writer::admit`). False (counted as skipped) when
    /// no buffer is free or the copy faulted.
    pub(crate) fn admit(
        &self,
        slot: u32,
        id: u64,
        crc: u32,
        bytes: &[u8],
        faultable: bool,
    ) -> bool {
        let ok = self.writer.admit(slot, id, crc, bytes, faultable);
        if !ok {
            self.shared.counters.skipped.fetch_add(1, Ordering::Relaxed);
        }
        ok
    }

    /// Waits, at most `within`, until every sample admitted before is
    /// written (durable and published) or given up: whether it was.
    pub(crate) fn flush(&self, within: std::time::Duration) -> bool {
        self.writer.flush(within)
    }

    /// Samples read from the area so far (O(1), unlike [`stats`](Self::stats)).
    pub fn hits(&self) -> u64 {
        self.shared.counters.hits.load(Ordering::Relaxed)
    }

    /// The counters.
    pub fn stats(&self) -> CacheStats {
        let c = &self.shared.counters;
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        CacheStats {
            hits: l(&c.hits),
            hit_bytes: l(&c.hit_bytes),
            planned_hits: l(&c.planned_hits),
            writes: l(&c.writes),
            write_bytes: l(&c.write_bytes),
            skipped: l(&c.skipped),
            corrupt: l(&c.corrupt),
            write_errors: l(&c.write_errors),
            held: self
                .shared
                .words
                .iter()
                .filter(|w| SlotWord::state(w.load(Ordering::Relaxed)) != S_EMPTY)
                .count() as u64,
            slots: self.slots() as u64,
            area_bytes: self.shared.classes.area_bytes(),
        }
    }
}

/// The memory this process may use at most, and what says so: the
/// machine's (`MemTotal`), or its cgroup's limit where that is lower
/// (cgroup v2's `memory.max` at the root of its namespace, as a container
/// sees it); None when neither can be read.
fn memory_limit() -> Option<(u64, &'static str)> {
    let total = std::fs::read_to_string("/proc/meminfo").ok().and_then(|t| {
        t.lines()
            .find_map(|l| l.strip_prefix("MemTotal:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .map(|kib| (kib * 1024, "this machine's memory (MemTotal)"))
    });
    let cgroup = std::fs::read_to_string("/sys/fs/cgroup/memory.max")
        .ok()
        .and_then(|t| t.trim().parse::<u64>().ok())
        .map(|b| (b, "this cgroup's memory limit (memory.max)"));
    match (total, cgroup) {
        (Some(t), Some(c)) => Some(if c.0 < t.0 { c } else { t }),
        (t, c) => t.or(c),
    }
}

/// What each slot holds after replaying the journal at `path` (records that
/// do not match the catalog or their slot are dropped; a torn tail is cut
/// off).
fn replay(
    path: &Path,
    cat: &Catalog,
    classes: &SlotClasses,
) -> Result<(Vec<Option<Record>>, bool)> {
    let slots = classes.slots() as u32;
    let mut held: Vec<Option<Record>> = vec![None; slots as usize];
    let mut buf = Vec::new();
    match File::open(path) {
        Ok(mut f) => {
            f.read_to_end(&mut buf).ctx("read", path)?;
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok((held, false)),
        Err(e) => return Err(Error::io("open", path, e)),
    }
    let mut good = 0;
    // Per slot, the index of its last record: of two slots naming one
    // sample, the later record wins.
    let mut last = vec![0usize; slots as usize];
    for (k, chunk) in buf.chunks(RECORD_BYTES).enumerate() {
        let Some(r) = Record::decode(chunk) else {
            break;
        };
        good += RECORD_BYTES;
        if r.slot >= slots {
            continue;
        }
        held[r.slot as usize] = (r.kind == REC_FULL).then_some(r);
        last[r.slot as usize] = k;
    }
    if good < buf.len() {
        log::warn!(
            "cache area journal {}: {} bytes after the last whole record dropped (a write \
             cut short)",
            path.display(),
            buf.len() - good
        );
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(path)
            .ctx("open", path)?;
        f.set_len(good as u64).ctx("truncate", path)?;
        f.sync_all().ctx("fsync", path)?;
    }
    // A record that does not match the catalog, or a sample named by two
    // slots (the later record wins; the writer journals the older copy
    // empty, but a crash may come between), is not held.
    let mut seen = std::collections::HashMap::new();
    let mut dropped = false;
    for slot in 0..slots as usize {
        let Some(r) = held[slot] else { continue };
        // The sample's own class (a slot of another class would put it in
        // two classes' policies).
        let ok = r.id < cat.len()
            && classes.class_for(r.len as u64) == Some(classes.class_of_slot(r.slot))
            && {
                let s = cat.sample(r.id);
                s.len == r.len && s.crc32c == r.crc
            };
        if !ok {
            held[slot] = None;
            dropped = true;
            continue;
        }
        if let Some(&other) = seen.get(&r.id) {
            let (older, newer) = if last[other] < last[slot] {
                (other, slot)
            } else {
                (slot, other)
            };
            held[older] = None;
            dropped = true;
            seen.insert(r.id, newer);
        } else {
            seen.insert(r.id, slot);
        }
    }
    Ok((held, dropped))
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_memory_limit_is_read_and_at_most_the_machine_s() {
        let (limit, what) = super::memory_limit().expect("/proc/meminfo is readable on Linux");
        let total = std::fs::read_to_string("/proc/meminfo").unwrap();
        let kib: u64 = total
            .lines()
            .find_map(|l| l.strip_prefix("MemTotal:"))
            .unwrap()
            .split_whitespace()
            .next()
            .unwrap()
            .parse()
            .unwrap();
        assert!(
            limit > 0 && limit <= kib * 1024,
            "{limit} ({what}), MemTotal {kib} KiB"
        );
    }
}
