//! The cache area's writer thread: puts the samples the planner keeps into
//! their slots, durably, off the pollers' loops.
//!
//! A poller that read a sample the planner admits copies its bytes from the
//! ring into one of a fixed set of write buffers (allocated at start; none
//! free means the sample is not kept this time: back-pressure, never an
//! allocation) and queues it. The writer takes what is queued as a batch:
//!
//! 1. claims each slot (its word goes to WRITING, so no poller starts a
//!    read of it; a poller still reading the old sample is waited for);
//! 2. journals the claimed slots that held a sample as empty, and syncs;
//! 3. writes the new bytes (O_DIRECT where the file system allows) and
//!    syncs the data file;
//! 4. journals the slots as full (id, length, CRC) and syncs;
//! 5. marks the words FULL, so pollers read them from now on.
//!
//! A crash anywhere leaves each slot either journalled empty or holding
//! the bytes its last record names (area.rs, "crash safety"). Three syncs
//! per batch, not per sample; the source's reads set the pace anyway.

use std::fs::File;
use std::io::Write;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};

use super::slots::{
    write_journal, AreaShared, Record, SlotWord, RECORD_BYTES, REC_EMPTY, REC_FULL, S_EMPTY,
    S_FULL, S_WRITING,
};
use super::SLOT_ALIGN;
use crate::error::{errno_name, IoContext, Result};
use crate::sys::AlignedBuf;

/// Write buffers: as many as fit in this many bytes (at least 2, at most
/// [`MAX_BUFFERS`]). 256 small slots: a node's area takes the admits of
/// all its ranks (with 64, four ranks of 4 KiB samples skipped a third of
/// their writes for want of a buffer: BENCHMARKS.md, "The node's cache
/// area").
const BUFFER_BUDGET_BYTES: u64 = 64 << 20;
/// An area in memory writes with a copy and no sync, so a batch is
/// written in a moment and fewer buffers keep up; they are memory faulted
/// in as they are first used (the free list cycles through them all).
const MEMORY_BUFFER_BUDGET_BYTES: u64 = 16 << 20;
const MAX_BUFFERS: u64 = 256;
/// Samples written per batch at most: half of [`MAX_BUFFERS`], so with
/// small slots the pollers find buffers free while a batch is written and
/// synced (with fewer, larger buffers a batch may take them all).
const BATCH: usize = 128;
/// How long the writer waits for a poller to finish reading a slot's old
/// sample before it gives the new one up (a read takes milliseconds).
const CLAIM_WAIT: Duration = Duration::from_secs(5);
/// Evictions queued at most (module doc of `Writer::start`).
const EVICTS_QUEUED: usize = 1024;
/// The journal is rewritten with only live records once it holds more
/// than this many records per slot.
const COMPACT_RECORDS_PER_SLOT: u64 = 4;

enum Job {
    Admit {
        slot: u32,
        id: u64,
        len: u32,
        crc: u32,
        buf: u32,
    },
    Evict {
        slot: u32,
        id: u64,
    },
    /// Answer once every job queued before is done (`Writer::flush`).
    Flush(Sender<()>),
}

/// The writer thread and its buffers (module doc).
pub(crate) struct Writer {
    jobs: Option<Sender<Job>>,
    free: Receiver<u32>,
    /// Where a buffer whose copy faulted goes back (the writer thread
    /// returns the others).
    unused: Sender<u32>,
    bufs: Arc<AlignedBuf>,
    slot_bytes: u64,
    shared: Arc<AreaShared>,
    thread: Option<JoinHandle<()>>,
}

impl Writer {
    /// Starts the thread over the journal at `journal_path`, whose replay
    /// gave `held` (per slot); None for an area in memory, which keeps no
    /// journal (nothing of it outlives the process).
    pub(crate) fn start(
        shared: Arc<AreaShared>,
        journal_path: Option<&Path>,
        held: Vec<Option<Record>>,
    ) -> Result<Writer> {
        // Every buffer holds the largest slot.
        let slot_bytes = shared.classes.largest();
        let budget = if shared.in_memory {
            MEMORY_BUFFER_BUDGET_BYTES
        } else {
            BUFFER_BUDGET_BYTES
        };
        let n = (budget / slot_bytes).clamp(2, MAX_BUFFERS);
        let bufs = Arc::new(AlignedBuf::new(
            (n * slot_bytes) as usize,
            SLOT_ALIGN as usize,
        ));
        let (free_tx, free) = crossbeam_channel::bounded(n as usize);
        for i in 0..n as u32 {
            free_tx.send(i).expect("sized for every buffer");
        }
        // Admits are bounded by the buffers; evictions are queued only while
        // fewer than EVICTS_QUEUED jobs wait (one that is not is dropped:
        // the word is already empty, and a later read checks the CRC
        // again): room for every admit is always left.
        let (jobs, rx) = crossbeam_channel::bounded(n as usize + 2 * EVICTS_QUEUED);
        let (journal, records) = match journal_path {
            Some(path) => {
                let f = std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .mode(0o600)
                    .open(path)
                    .ctx("open", path)?;
                let records = f.metadata().ctx("stat", path)?.len() / RECORD_BYTES as u64;
                (Some((f, path.to_path_buf())), records)
            }
            None => (None, 0),
        };
        let mut state = WriterState {
            shared: shared.clone(),
            bufs: bufs.clone(),
            free: free_tx.clone(),
            journal,
            records,
            slot_of_id: held.iter().flatten().map(|r| (r.id, r.slot)).collect(),
            durable: held,
            warned: false,
            broken: false,
        };
        state.compact_if_long();
        let thread = std::thread::Builder::new()
            .name("kspeed-cache-w".into())
            .spawn(move || state.run(rx))
            .map_err(|e| crate::Error::ThreadSpawn {
                thread: "cache writer",
                source: Arc::new(e),
            })?;
        Ok(Writer {
            jobs: Some(jobs),
            free,
            unused: free_tx,
            bufs,
            slot_bytes,
            shared,
            thread: Some(thread),
        })
    }

    /// Queues sample `id` (`bytes`, CRC `crc`) for `slot`; false when no
    /// write buffer is free.
    /// With `faultable`, `bytes` is another process's memory (a rank's
    /// hugetlb ring, in the node agent) and is copied through the kernel.
    pub(crate) fn admit(
        &self,
        slot: u32,
        id: u64,
        crc: u32,
        bytes: &[u8],
        faultable: bool,
    ) -> bool {
        assert!(
            bytes.len() as u64 <= self.shared.classes.slot(slot).1,
            "a sample larger than its cache area slot"
        );
        let Ok(buf) = self.free.try_recv() else {
            return false;
        };
        let at = buf as usize * self.slot_bytes as usize;
        // SAFETY: buffer `buf` came off the free list, so no other thread
        // uses its `slot_bytes` at `at` (inside the mapping: `buf` < the
        // buffer count) until the writer hands it back; `bytes` is the
        // caller's memory, which does not overlap our mapping. Through
        // the kernel where `bytes` is a rank's hugetlb ring whose page the
        // rank may have taken away (a fault there keeps nothing instead of
        // killing the agent with SIGBUS).
        let dst = unsafe { self.bufs.as_mut_ptr().add(at) };
        let copied = if faultable {
            // SAFETY: as above.
            unsafe { crate::sys::copy_faultable(dst, bytes.as_ptr(), bytes.len()) }
        } else {
            // SAFETY: as above.
            unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), dst, bytes.len()) };
            true
        };
        if !copied {
            self.unused
                .try_send(buf)
                .expect("the free list has room for every buffer");
            return false;
        }
        let job = Job::Admit {
            slot,
            id,
            len: bytes.len() as u32,
            crc,
            buf,
        };
        let sent = self.jobs.as_ref().is_some_and(|j| j.try_send(job).is_ok());
        assert!(sent, "the cache writer's queue holds every buffer's job");
        true
    }

    /// Waits, at most `within`, until every sample queued before is
    /// written (or given up): whether it was. Once per job's end in the
    /// node agent, not per sample (the one allocation is the answer's
    /// channel).
    pub(crate) fn flush(&self, within: Duration) -> bool {
        // One deadline for the queueing and the answer together.
        let deadline = Instant::now() + within;
        let (tx, rx) = crossbeam_channel::bounded(1);
        let sent = self
            .jobs
            .as_ref()
            .is_some_and(|j| j.send_deadline(Job::Flush(tx), deadline).is_ok());
        sent && rx.recv_deadline(deadline).is_ok()
    }

    /// Slot `slot`'s bytes (sample `id`'s) were found corrupt: no poller
    /// starts a read of it from now on, and the writer journals it empty
    /// (unless it was given to another sample since). The caller still
    /// counts as a reader, so the slot cannot have been claimed meanwhile.
    pub(crate) fn evict(&self, slot: u32, id: u64) {
        let w = &self.shared.words[slot as usize];
        // The state bits to EMPTY, readers and id kept.
        w.fetch_and(!(3u64 << 40), Ordering::AcqRel);
        if let Some(j) = self.jobs.as_ref().filter(|j| j.len() < EVICTS_QUEUED) {
            let _ = j.try_send(Job::Evict { slot, id });
        }
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        // Closing the queue ends the thread once it has written what was
        // queued: what a run kept is durable when its loader is gone.
        self.jobs = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

struct WriterState {
    shared: Arc<AreaShared>,
    bufs: Arc<AlignedBuf>,
    free: Sender<u32>,
    /// The journal and its path; None for an area in memory.
    journal: Option<(File, PathBuf)>,
    records: u64,
    /// What each slot holds as far as the journal on disk says, and the
    /// slot of each sample held (changed only through `set_durable`).
    durable: Vec<Option<Record>>,
    slot_of_id: std::collections::HashMap<u64, u32>,
    /// The journal could not be written nor cut back to its last whole
    /// record: nothing more is written to the area (every admit is given
    /// up), so the journal never names bytes it does not hold.
    broken: bool,
    warned: bool,
}

struct Claimed {
    slot: u32,
    id: u64,
    len: u32,
    crc: u32,
    buf: u32,
}

impl WriterState {
    fn run(mut self, rx: Receiver<Job>) {
        let mut batch = Vec::with_capacity(BATCH);
        while let Ok(first) = rx.recv() {
            let mut next = Some(first);
            while let Some(job) = next.take() {
                match job {
                    Job::Evict { slot, id } => self.evicted(slot, id),
                    Job::Flush(done) => {
                        self.write_batch(&mut batch);
                        // The caller may have given up waiting.
                        let _ = done.try_send(());
                    }
                    Job::Admit {
                        slot,
                        id,
                        len,
                        crc,
                        buf,
                    } => batch.push(Claimed {
                        slot,
                        id,
                        len,
                        crc,
                        buf,
                    }),
                }
                if batch.len() < BATCH {
                    next = rx.try_recv().ok();
                }
            }
            self.write_batch(&mut batch);
        }
    }

    /// A corrupt slot: journal it empty (its word is already empty), if
    /// the journal still says it holds that sample.
    fn evicted(&mut self, slot: u32, id: u64) {
        if self.broken || self.durable[slot as usize].is_none_or(|r| r.id != id) {
            return;
        }
        let rec = Record {
            kind: REC_EMPTY,
            slot,
            id: 0,
            len: 0,
            crc: 0,
        };
        if self.append(&[rec]) {
            self.set_durable(slot, None);
        }
    }

    fn write_batch(&mut self, batch: &mut Vec<Claimed>) {
        if batch.is_empty() {
            return;
        }
        let shared = self.shared.clone();
        let c = &shared.counters;
        if self.broken {
            for job in batch.iter() {
                self.give_up(job);
            }
            batch.clear();
            return;
        }
        // A slot named twice keeps the later sample (the planner moved
        // on), and so does a sample named twice (evicted from one slot and
        // admitted to another): one sample is never written to two slots.
        let mut keep = Vec::with_capacity(batch.len());
        for (i, job) in batch.iter().enumerate() {
            if batch[i + 1..]
                .iter()
                .any(|j| j.slot == job.slot || j.id == job.id)
            {
                c.skipped.fetch_add(1, Ordering::Relaxed);
                let _ = self.free.send(job.buf);
            } else {
                keep.push(i);
            }
        }
        // 1. Claim.
        let mut claimed = Vec::with_capacity(keep.len());
        for i in keep {
            let job = &batch[i];
            if self.claim(job.slot, job.id) {
                claimed.push(i);
            } else {
                c.skipped.fetch_add(1, Ordering::Relaxed);
                let _ = self.free.send(job.buf);
            }
        }
        // 2. Journal the old contents gone: the claimed slots' samples,
        // and another slot still holding a sample now written anew (the
        // planner evicted it from there and admits it here: one sample is
        // never in two slots).
        let mut gone: Vec<u32> = Vec::with_capacity(claimed.len());
        for &i in &claimed {
            let job = &batch[i];
            if self.durable[job.slot as usize].is_some() {
                gone.push(job.slot);
            }
            if let Some(&other) = self.slot_of_id.get(&job.id).filter(|&&o| o != job.slot) {
                if !gone.contains(&other) {
                    gone.push(other);
                }
                // No poller starts a read of the old copy from now on.
                let w = &self.shared.words[other as usize];
                let _ = w.fetch_update(Ordering::AcqRel, Ordering::Acquire, |cur| {
                    (SlotWord::id(cur) == Some(job.id) && SlotWord::state(cur) == S_FULL)
                        .then_some(cur & !(3u64 << 40))
                });
            }
        }
        let empties: Vec<Record> = gone
            .iter()
            .map(|&slot| Record {
                kind: REC_EMPTY,
                slot,
                id: 0,
                len: 0,
                crc: 0,
            })
            .collect();
        if !empties.is_empty() && !self.append(&empties) {
            for &i in &claimed {
                self.give_up(&batch[i]);
            }
            batch.clear();
            return;
        }
        for r in &empties {
            self.set_durable(r.slot, None);
        }
        // 3. Write the bytes.
        let mut written = Vec::with_capacity(claimed.len());
        for &i in &claimed {
            let job = &batch[i];
            match self.write_slot(job) {
                Ok(()) => written.push(i),
                Err(e) => {
                    self.warn_write(job.slot, &e);
                    self.give_up(job);
                }
            }
        }
        if !written.is_empty() {
            if let Err(e) = self.shared.data.sync_data() {
                self.warn_write(u32::MAX, &e);
                for &i in &written {
                    self.give_up(&batch[i]);
                }
                batch.clear();
                return;
            }
        }
        // 4. Journal them full.
        let fulls: Vec<Record> = written
            .iter()
            .map(|&i| {
                let j = &batch[i];
                Record {
                    kind: REC_FULL,
                    slot: j.slot,
                    id: j.id,
                    len: j.len,
                    crc: j.crc,
                }
            })
            .collect();
        if !self.append(&fulls) {
            for &i in &written {
                self.give_up(&batch[i]);
            }
            batch.clear();
            return;
        }
        // 5. Publish.
        for (&i, r) in written.iter().zip(&fulls) {
            let j = &batch[i];
            self.set_durable(j.slot, Some(*r));
            self.shared.words[j.slot as usize]
                .store(SlotWord::pack(Some(j.id), S_FULL), Ordering::Release);
            c.writes.fetch_add(1, Ordering::Relaxed);
            c.write_bytes.fetch_add(j.len as u64, Ordering::Relaxed);
            let _ = self.free.send(j.buf);
        }
        batch.clear();
        self.compact_if_long();
    }

    /// Records what the journal now says `slot` holds.
    fn set_durable(&mut self, slot: u32, rec: Option<Record>) {
        if let Some(old) = self.durable[slot as usize].take() {
            if self.slot_of_id.get(&old.id) == Some(&slot) {
                self.slot_of_id.remove(&old.id);
            }
        }
        if let Some(r) = rec {
            self.slot_of_id.insert(r.id, slot);
        }
        self.durable[slot as usize] = rec;
    }

    /// Takes `slot` for sample `id` once no poller reads it.
    fn claim(&self, slot: u32, id: u64) -> bool {
        let w = &self.shared.words[slot as usize];
        let deadline = Instant::now() + CLAIM_WAIT;
        let mut cur = w.load(Ordering::Acquire);
        loop {
            if SlotWord::readers(cur) == 0 {
                match w.compare_exchange(
                    cur,
                    SlotWord::pack(Some(id), S_WRITING),
                    Ordering::AcqRel,
                    Ordering::Acquire,
                ) {
                    Ok(_) => return true,
                    Err(now) => {
                        cur = now;
                        continue;
                    }
                }
            }
            if Instant::now() >= deadline {
                log::warn!(
                    "cache area {}: slot {slot} still being read after {CLAIM_WAIT:?}; \
                     sample {id} not kept",
                    self.shared.dir.display()
                );
                return false;
            }
            // A poller's read of the slot's old sample takes a disk read's
            // time: yield rather than spin on a core the pollers need.
            std::thread::sleep(Duration::from_micros(200));
            cur = w.load(Ordering::Acquire);
        }
    }

    /// A claimed slot that could not be written: empty, buffer back.
    fn give_up(&self, job: &Claimed) {
        self.shared.words[job.slot as usize]
            .store(SlotWord::pack(None, S_EMPTY), Ordering::Release);
        self.shared
            .counters
            .write_errors
            .fetch_add(1, Ordering::Relaxed);
        let _ = self.free.send(job.buf);
    }

    fn write_slot(&self, job: &Claimed) -> std::io::Result<()> {
        let at = job.buf as usize * self.shared.classes.largest() as usize;
        let (slot_at, slot_bytes) = self.shared.classes.slot(job.slot);
        let n = (job.len as u64)
            .next_multiple_of(SLOT_ALIGN)
            .clamp(SLOT_ALIGN, slot_bytes) as usize;
        // The tail past the sample is zeroed: the slot's padding is not
        // another sample's leftovers.
        // SAFETY: this thread owns buffer `job.buf` until it sends the
        // index back; bytes len..n of it belong to no one else either.
        unsafe {
            std::ptr::write_bytes(
                self.bufs.as_mut_ptr().add(at + job.len as usize),
                0,
                n - job.len as usize,
            )
        };
        let buf = &self.bufs.as_slice()[at..at + n];
        // For an area in memory this is the only check of what is kept
        // (the poller leaves it to this copy, which no rank can write).
        let got = crc32c::crc32c(&buf[..job.len as usize]);
        if got != job.crc {
            // The copy into the buffer is not the catalog's bytes: the
            // ring was written while it was copied (the agent's ranks
            // own their rings), a bad read an area in memory took on
            // trust, or a bug; not to be kept.
            return Err(std::io::Error::other(format!(
                "the copy to keep has CRC32C {got:08x}, the catalog's is {:08x}",
                job.crc
            )));
        }
        self.shared.data.write_all_at(buf, slot_at)
    }

    /// Appends records and syncs the journal; false (logged) on failure.
    fn append(&mut self, recs: &[Record]) -> bool {
        let Some((journal, _)) = &mut self.journal else {
            // In memory: the slot words are the whole truth.
            return true;
        };
        let mut bytes = Vec::with_capacity(recs.len() * RECORD_BYTES);
        for r in recs {
            bytes.extend_from_slice(&r.encode());
        }
        let r = journal.write_all(&bytes).and_then(|()| journal.sync_data());
        match r {
            Ok(()) => {
                self.records += recs.len() as u64;
                true
            }
            Err(e) => {
                self.warn_write(u32::MAX, &e);
                // Cut back to the last whole record this writer knows is
                // there: a record written in part (a full disk) would end
                // the replay early and drop every later record, and one
                // written whole but not synced must not outlive what
                // `durable` says.
                let good = self.records * RECORD_BYTES as u64;
                let (journal, _) = self.journal.as_mut().expect("checked above");
                let cut = journal.set_len(good).and_then(|()| journal.sync_data());
                if let Err(e2) = cut {
                    log::warn!(
                        "cache area {}: the journal could not be cut back after a failed write \
                         ({e2}); nothing more is kept in the area this run",
                        self.shared.dir.display()
                    );
                    self.broken = true;
                }
                false
            }
        }
    }

    fn warn_write(&mut self, slot: u32, e: &std::io::Error) {
        if self.warned {
            return;
        }
        self.warned = true;
        let what = if slot == u32::MAX {
            String::new()
        } else {
            format!(" slot {slot}:")
        };
        log::warn!(
            "cache area {}:{what} write failed: {} ({e}); the samples are still delivered, but \
             not kept (further failures are counted, not logged)",
            self.shared.dir.display(),
            errno_name(e.raw_os_error().unwrap_or(0)),
        );
    }

    /// Rewrites the journal with one record per held slot when it has
    /// grown long (temporary file, sync, rename: a crash keeps one whole).
    fn compact_if_long(&mut self) {
        let slots = self.durable.len() as u64;
        let Some((journal, path)) = &mut self.journal else {
            return;
        };
        if self.records <= COMPACT_RECORDS_PER_SLOT * slots + 1024 {
            return;
        }
        let recs: Vec<Record> = self.durable.iter().flatten().copied().collect();
        let r = match write_journal(path, &recs) {
            Ok(f) => {
                // The renamed file is the journal now, whatever the
                // folder's sync says (a crash before it keeps the old
                // journal, also whole).
                *journal = f;
                self.records = recs.len() as u64;
                crate::format::sync_parent(path)
            }
            Err(e) => Err(e),
        };
        if let Err(e) = r {
            log::warn!("cache area journal not compacted: {e}");
        }
    }
}
