//! The source fallback on the network thread: a sample that no node can
//! serve (every holder dead, demoted or failed) is read from the source
//! files through the thread's own ring, like everything else it does, so a
//! slow or stalled source file system delays that sample and no other
//! connection's receives, grants or timers.
//!
//! At most [`SOURCE_READS`] samples are read at once ([`STORE_READS`] from
//! a bucket, by GET workers: `store_fetch.rs`), each in a slot fixed
//! at start (its grant-table index, its descriptor lease, how far it got);
//! the slot index is the read's `user_data`. With every slot busy a sample
//! waits in the re-grant queue (`place` answers "no room now"), the same
//! back-pressure a node without credit gives. A read that comes back short,
//! or with EAGAIN/EINTR, continues where it stopped, [`MAX_ATTEMPTS`] times
//! at most, as the local pollers do. The bytes are checked against the
//! catalog's CRC32C whatever `verify_crc32c` says (the source may have
//! changed since the catalog was built), then published; any failure fails
//! the sample with `SampleUnavailable`, naming every place tried.
//!
//! Descriptors come from the thread's `FdCache`: a file is opened once
//! (the one blocking call left, once per file and run) and a lease keeps it
//! open while its read is in the ring.

use std::sync::atomic::Ordering;

use super::{IoBackend, Receive, Thread, UD_SOURCE};
use crate::error::{errno_name, Error};
use crate::loader::fdcache::Lease;
use crate::loader::shared::{push_error, VIA_SOURCE};
use crate::loader::{CODE_ERROR, CODE_OK};
use crate::ring::{ReadOp, Target};

/// Source reads in flight at once on one network thread. Failover to the
/// source is the last resort (every copy lost); this bounds what a dead
/// node's grants, all falling back at once, put on the source's file
/// system, and the GPU-ring bounce buffers (one per slot).
pub(super) const SOURCE_READS: usize = 8;

/// Samples read at once from a source in an object store: a GET waits on
/// the store's latency, not on a disk, so it takes many in flight to keep
/// up (8 gave 212 samples/s against a local store answering in ~40 ms,
/// BENCHMARKS.md); each slot has its GET worker (`store_fetch.rs`).
pub(super) const STORE_READS: usize = 64;

/// Attempts for a read that came back short or was interrupted.
const MAX_ATTEMPTS: u32 = 4;

/// One sample being read from the source.
#[derive(Default)]
pub(super) struct SourceRead {
    /// Its grant-table index; None: the slot is free.
    idx: Option<usize>,
    /// The file's descriptor, held while a read of it is in the ring.
    lease: Option<Lease>,
    /// Bytes of the sample read so far.
    done_bytes: u32,
    /// Reads issued for it.
    attempts: u32,
    /// A read is in the ring (its buffer is the kernel's).
    in_ring: bool,
    /// Waiting to be pushed: the submission queue was full.
    queued: bool,
    /// A GPU ring's host buffer (grows to the largest sample this slot
    /// read; the bytes are checked here, then copied to the device).
    bounce: Vec<u8>,
    /// Why every holder could not serve it (for the error, if the source
    /// cannot either).
    tried: String,
}

/// The fixed pool of source reads (see the module comment).
pub(super) struct SourceReads {
    slots: Box<[SourceRead]>,
    /// Slots whose read is in the ring (or, for a source in an object
    /// store, with a worker of `store`).
    in_ring: usize,
    /// The catalog's source is in an object store (`s3://`): samples are
    /// read by `store`'s workers, not through the ring.
    remote: bool,
    /// Samples read from the source after their holders failed: the first
    /// is logged at INFO with why, the rest at debug (a dead node's share
    /// is thousands of them; `Stats::failovers` counts them all).
    failovers_logged: u64,
    /// The GET workers, started on the first sample read from the store.
    #[cfg(feature = "s3")]
    store: Option<super::store_fetch::StorePool>,
}

impl SourceReads {
    pub(super) fn new(remote: bool) -> Self {
        SourceReads {
            slots: (0..if remote { STORE_READS } else { SOURCE_READS })
                .map(|_| SourceRead::default())
                .collect(),
            in_ring: 0,
            remote,
            failovers_logged: 0,
            #[cfg(feature = "s3")]
            store: None,
        }
    }

    /// A free slot, if any.
    pub(super) fn free_slot(&self) -> Option<usize> {
        self.slots.iter().position(|s| s.idx.is_none())
    }

    /// Whether a read references this thread's memory (the ring's or a
    /// bounce buffer).
    pub(super) fn busy(&self) -> bool {
        self.in_ring > 0
    }

    /// Whether table entry `idx` is being read from the source.
    pub(super) fn reading(&self, idx: usize) -> bool {
        self.slots.iter().any(|r| r.idx == Some(idx))
    }

    /// Samples being read (tests).
    #[cfg(test)]
    pub(super) fn in_use(&self) -> usize {
        self.slots.iter().filter(|s| s.idx.is_some()).count()
    }
}

impl<R: Receive, I: IoBackend> Thread<R, I> {
    /// Starts reading table entry `idx` from the source in free slot
    /// `slot`; `tried` says why no node served it. False: the source
    /// failed at once (it cannot be opened) while a holder that went away
    /// is being dialled again: the entry waits for it (the caller leaves
    /// it in line; its next try comes on a later tick, not in this one).
    pub(super) fn start_source_read(&mut self, slot: usize, idx: usize, tried: String) -> bool {
        let s = self.l.table[idx];
        debug_assert!(
            s.live && s.mw == super::NONE,
            "source read of a granted entry"
        );
        // No connection's failover may touch it now.
        self.l.table[idx].node = super::NONE;
        let (cat, sample, key) = self.l.sh.input.source_sample(s.id);
        if self.l.sources.remote {
            return self.start_store_read(slot, idx, tried);
        }
        // Opening is the one blocking call left (once per file and run).
        self.stall.phase(crate::stall::Phase::Open);
        let lease = self
            .l
            .source_fds
            .acquire(key, || std::fs::File::open(cat.file_path(sample.file)));
        let r = &mut self.l.sources.slots[slot];
        debug_assert!(r.idx.is_none() && !r.in_ring, "source slot {slot} taken");
        r.idx = Some(idx);
        r.done_bytes = 0;
        r.attempts = 0;
        r.tried = tried;
        match lease {
            Ok(l) => {
                r.lease = Some(l);
                if self.l.sh.ring.device().is_some() {
                    r.bounce.resize(s.len as usize, 0);
                }
                self.push_source(slot);
                true
            }
            Err(e) => {
                let why = match e.raw_os_error() {
                    Some(n) => errno_name(n).to_string(),
                    None => e.to_string(),
                };
                !self.finish_source(slot, Err(why))
            }
        }
    }

    /// [`Self::start_source_read`] for a source in an object store: the
    /// sample goes to a GET worker (`store_fetch.rs`).
    fn start_store_read(&mut self, slot: usize, idx: usize, tried: String) -> bool {
        let s = self.l.table[idx];
        let r = &mut self.l.sources.slots[slot];
        debug_assert!(r.idx.is_none() && !r.in_ring, "source slot {slot} taken");
        r.idx = Some(idx);
        r.done_bytes = 0;
        r.attempts = 1;
        r.tried = tried;
        if self.l.sh.ring.device().is_some() {
            r.bounce.resize(s.len as usize, 0);
        }
        #[cfg(feature = "s3")]
        {
            if self.l.sources.store.is_none() {
                // Once per loader: threads for the rare last resort.
                self.stall.phase(crate::stall::Phase::Open);
                match super::store_fetch::StorePool::start(&self.l.sh, STORE_READS) {
                    Ok(p) => self.l.sources.store = Some(p),
                    Err(e) => {
                        return !self.finish_source(slot, Err(format!("starting GET workers: {e}")))
                    }
                }
            }
            let dst = if self.l.sh.ring.device().is_some() {
                self.l.sources.slots[slot].bounce.as_mut_ptr()
            } else {
                self.ring_ptr(s.phys)
            };
            self.l.sources.slots[slot].in_ring = true;
            self.l.sources.in_ring += 1;
            self.l
                .sources
                .store
                .as_ref()
                .expect("started")
                .send(super::store_fetch::Fetch {
                    slot,
                    id: s.id,
                    dst: dst as usize,
                    len: s.len,
                });
            true
        }
        #[cfg(not(feature = "s3"))]
        {
            !self.finish_source(
                slot,
                Err("the source is in an object store and this build has no s3 feature".into()),
            )
        }
    }

    /// Takes the GET workers' answers (object-store sources) of every lane.
    pub(super) fn drain_store_reads(&mut self) {
        for k in 0..self.lane_places() {
            if self.activate(k) {
                self.drain_lane_store_reads();
            }
        }
    }

    fn drain_lane_store_reads(&mut self) {
        #[cfg(feature = "s3")]
        while let Some(f) = self.l.sources.store.as_ref().and_then(|p| p.try_done()) {
            let r = &mut self.l.sources.slots[f.slot];
            assert!(
                r.in_ring,
                "network thread: GET answer for idle slot {}",
                f.slot
            );
            r.in_ring = false;
            self.l.sources.in_ring = self
                .l
                .sources
                .in_ring
                .checked_sub(1)
                .expect("source reads in flight undercounted");
            self.source_done(f.slot, f.res);
        }
    }

    /// Puts slot `slot`'s next read (the rest of its sample) in the ring,
    /// or marks it queued when the ring has no room.
    fn push_source(&mut self, slot: usize) {
        let r = &self.l.sources.slots[slot];
        let idx = r.idx.expect("busy source slot");
        let s = self.l.table[idx];
        let sample = self.l.sh.input.sample(s.id);
        let done = r.done_bytes as usize;
        let base = if self.l.sh.ring.device().is_some() {
            r.bounce.as_ptr() as *mut u8
        } else {
            self.ring_ptr(s.phys)
        };
        let op = ReadOp {
            user_data: UD_SOURCE | ((self.active as u64) << 16) | slot as u64,
            target: Target::Fd(self.l.source_fds.fd(r.lease.as_ref().expect("leased"))),
            // SAFETY: done < len, and base..base+len is the sample's slot of
            // the ring (unpublished, written by no connection: every holder
            // was tried and none has a grant for it) or this slot's bounce
            // buffer of len bytes.
            buf: unsafe { base.add(done) },
            len: s.len - r.done_bytes,
            offset: sample.offset + done as u64,
            buf_index: None,
        };
        // SAFETY: the buffer stays ours until the completion is drained:
        // the entry stays live (nothing re-grants or publishes it) and the
        // bounce buffer is not resized while `in_ring` (busy() keeps the
        // thread, and so both, alive until then).
        let pushed = unsafe { self.ring.push(&op) };
        let r = &mut self.l.sources.slots[slot];
        if pushed {
            r.attempts += 1;
            r.in_ring = true;
            r.queued = false;
            self.l.sources.in_ring += 1;
        } else {
            r.queued = true;
        }
    }

    /// Pushes the reads the ring had no room for (at most
    /// [`SOURCE_READS`] or [`STORE_READS`] slots to look at); while
    /// stopping, gives them up.
    pub(super) fn push_queued_sources(&mut self) {
        for k in 0..self.lane_places() {
            if self.activate(k) {
                self.push_lane_queued_sources();
            }
        }
    }

    fn push_lane_queued_sources(&mut self) {
        for slot in 0..self.l.sources.slots.len() {
            if !self.l.sources.slots[slot].queued {
                continue;
            }
            if self.stopping || self.l.leaving {
                self.l.sources.slots[slot].queued = false;
                let waits = self.finish_source(slot, Err("the loader stopped".into()));
                debug_assert!(!waits, "a stopping thread put a source read back in line");
            } else {
                self.push_source(slot);
            }
        }
    }

    /// A read of slot `slot` completed with `result` (bytes, or -errno).
    pub(super) fn source_completed(&mut self, slot: usize, result: i32) {
        let Some(r) = self.l.sources.slots.get_mut(slot).filter(|r| r.in_ring) else {
            // The ring and this thread disagree about what the kernel
            // writes: stop rather than guess (as the pollers do).
            panic!("network thread: source completion for idle slot {slot}");
        };
        r.in_ring = false;
        if result > 0 {
            r.done_bytes += result as u32;
        }
        let (idx, done, attempts) = (r.idx.expect("busy source slot"), r.done_bytes, r.attempts);
        self.l.sources.in_ring = self
            .l
            .sources
            .in_ring
            .checked_sub(1)
            .expect("source reads in the ring undercounted");
        let len = self.l.table[idx].len;
        assert!(done <= len, "read past the sample's {len} bytes");
        let retry = attempts < MAX_ATTEMPTS && !self.stopping;
        let errno = -result;
        if result < 0 && retry && (errno == libc::EAGAIN || errno == libc::EINTR) {
            return self.push_source(slot);
        }
        let res = if result < 0 {
            Err(errno_name(errno).to_string())
        } else if result == 0 {
            Err(format!(
                "the file ends {done} bytes into the sample's {len} (shorter than the catalog says)"
            ))
        } else if done == len {
            Ok(())
        } else if retry {
            return self.push_source(slot);
        } else {
            Err(format!(
                "short read: {done} of {len} bytes after {attempts} attempts"
            ))
        };
        self.source_done(slot, res);
    }

    /// Slot `slot`'s read ended with `res`: [`Self::finish_source`], and
    /// back in the re-grant line when it is to wait for a holder.
    fn source_done(&mut self, slot: usize, res: Result<(), String>) {
        let idx = self.l.sources.slots[slot].idx.expect("busy source slot");
        if self.finish_source(slot, res) {
            let g = self.l.table[idx].g;
            let table = &self.l.table;
            let at = self.l.regrant.partition_point(|&i| table[i].g < g);
            self.l.regrant.insert(at, idx);
        }
    }

    /// Slot `slot`'s sample is read (`Ok`) or cannot be (`Err(why)`):
    /// checks it, publishes or fails it, and frees the slot. True: it
    /// failed while a holder that went away is being dialled again, so it
    /// is neither published nor failed: the entry (live, that holder's
    /// copy marked untried) is to wait for it in the re-grant line.
    fn finish_source(&mut self, slot: usize, res: Result<(), String>) -> bool {
        let r = &mut self.l.sources.slots[slot];
        debug_assert!(!r.in_ring, "finishing a source read still in the ring");
        let idx = r.idx.take().expect("busy source slot");
        r.queued = false;
        if let Some(l) = r.lease.take() {
            self.l.source_fds.release(l);
        }
        let s = self.l.table[idx];
        let (cat, sample, _) = self.l.sh.input.source_sample(s.id);
        let device = self.l.sh.ring.device();
        let res = res.and_then(|()| {
            let r = &self.l.sources.slots[slot];
            let got = if device.is_some() {
                crc32c::crc32c(&r.bounce[..s.len as usize])
            } else {
                // SAFETY: every byte of the sample's unpublished slot was
                // read and no read of it is in the ring any more.
                unsafe { self.l.sh.ring.crc32c(s.phys as usize, s.len as usize) }.ok_or_else(|| {
                    "its ring bytes fault when read (the rank took their pages away)".to_string()
                })?
            };
            if got != sample.crc32c {
                return Err(format!(
                    "CRC32C {got:08x}, the catalog says {:08x} (changed since the catalog was built)",
                    sample.crc32c
                ));
            }
            match device {
                Some(d) => d
                    .copy_from_host(s.phys as usize, &r.bounce[..s.len as usize])
                    .map_err(|e| format!("copying it into the GPU ring: {e}")),
                None => Ok(()),
            }
        });
        self.l.table[idx].live = false;
        let r = &mut self.l.sources.slots[slot];
        let tried = std::mem::take(&mut r.tried);
        match res {
            Ok(()) => {
                self.net().source_reads.fetch_add(1, Ordering::Relaxed);
                self.net()
                    .source_bytes
                    .fetch_add(s.len as u64, Ordering::Relaxed);
                // A failover unless no node holds it (a partial space's).
                let via = self.via_of(&s, None);
                if via != VIA_SOURCE {
                    let tried = tried.trim_end_matches("; ");
                    let n = &mut self.l.sources.failovers_logged;
                    *n += 1;
                    if *n == 1 {
                        log::info!(
                            "sample {} read from the source after its holders failed ({tried}); later ones are counted in the failovers (logged at debug)",
                            s.id
                        );
                    } else {
                        log::debug!("sample {} read from the source ({tried})", s.id);
                    }
                }
                self.l.sh.publish(s.g, CODE_OK, via);
                false
            }
            Err(why) => {
                let path = cat.file_path(sample.file);
                // A holder that went away and is being dialled again gets
                // the sample back: the entry waits for it in the re-grant
                // line (its copy marked untried). Otherwise the sample fails
                // with the error that holder left, or SampleUnavailable.
                let placement = self.placement;
                let mut back = 0u64;
                let mut refused = None;
                let placed = self.l.sh.input.placed_id(s.id);
                for r in 0..placement.replicas {
                    let node = placement.holder(placed, r) as usize;
                    if !self.stopping && self.coming_back(node) {
                        back |= 1 << r;
                    } else if refused.is_none() {
                        refused = self.refused(node).cloned();
                    }
                }
                if back != 0 {
                    let t = &mut self.l.table[idx];
                    t.live = true;
                    t.tried &= !back;
                    return true;
                }
                let e = refused.unwrap_or(Error::SampleUnavailable {
                    sample: s.id,
                    tried: format!("{tried}source {}: {why}", path.display()),
                });
                push_error(&self.l.sh.errors, s.g, e);
                self.l.sh.publish(s.g, CODE_ERROR, VIA_SOURCE);
                false
            }
        }
    }
}
