//! A poller's staging: the slab its reads land in and its sends go out
//! from, cut into chunk-sized slots, and the pool of slots taken (what
//! each chunk holds now). `Staging` owns both: a slot is taken and freed
//! only through it, and its key is its chunk of the slab.

use std::ops::{Index, IndexMut};

use super::owner_rdma::StagingMr;
use super::Common;
use crate::error::Result;
use crate::pool::Pool;
use crate::sys::AlignedBuf;
use crate::transport::proto::Code;

/// A poller's staging slab (registered for RDMA when the service offers
/// it) and its slots.
pub(super) struct Staging {
    /// Its registration (read by the RDMA links only). Declared before
    /// `buf` so that it is dropped first: the memory is deregistered before
    /// it is freed (verbs teardown in reverse order of creation).
    mr: StagingMr,
    buf: AlignedBuf,
    /// Bytes per slot.
    chunk_bytes: usize,
    /// The slots taken (at most `staging_bytes / chunk_bytes`, allocated
    /// at start and never grown: a full pool is back-pressure).
    slots: Pool<Slot>,
}

impl Staging {
    pub(super) fn new(c: &Common) -> Result<Staging> {
        let n = c.cfg.slots();
        let chunk_bytes = c.cfg.chunk_bytes as usize;
        let mut buf = AlignedBuf::new(n * chunk_bytes, 4096);
        let mr = StagingMr::register(c, &mut buf)?;
        Ok(Staging {
            mr,
            buf,
            chunk_bytes,
            slots: Pool::with_limit(n),
        })
    }

    /// The slab's registration, which RDMA links send from.
    pub(super) fn mr(&self) -> &StagingMr {
        &self.mr
    }

    /// The whole slab (start, bytes): what the ring registers as a fixed
    /// buffer, and what the simulator checks operations against.
    pub(super) fn slab(&self) -> (*mut u8, usize) {
        (self.buf.as_mut_ptr(), self.buf.len())
    }

    /// Bytes per slot.
    #[cfg(test)]
    pub(super) fn chunk_bytes(&self) -> usize {
        self.chunk_bytes
    }

    /// Where slot `slot`'s chunk of the slab starts.
    pub(super) fn ptr(&self, slot: u32) -> *mut u8 {
        assert!(
            (slot as usize) < self.slots.limit(),
            "staging slot {slot} out of range"
        );
        // SAFETY: slot < limit, and the slab holds `limit` chunks, so the
        // offset is inside it.
        unsafe { self.buf.as_mut_ptr().add(slot as usize * self.chunk_bytes) }
    }

    /// Slots there are.
    pub(super) fn limit(&self) -> usize {
        self.slots.limit()
    }

    /// Slots taken now.
    pub(super) fn len(&self) -> usize {
        self.slots.len()
    }

    /// Whether every slot is taken (reads wait: back-pressure).
    pub(super) fn is_full(&self) -> bool {
        self.slots.is_full()
    }

    /// The slot the next [`Staging::take`] takes, unless every one is
    /// taken (a read is pushed into it before it is taken).
    pub(super) fn vacant(&self) -> Option<u32> {
        self.slots.vacant_key().map(|k| k as u32)
    }

    /// Takes slot `slot` (the [`Staging::vacant`] one), described by `s`.
    pub(super) fn take(&mut self, slot: u32, s: Slot) {
        let taken = self.slots.insert(s);
        debug_assert!(
            matches!(taken, Ok(k) if k == slot as usize),
            "Staging::take: the vacant slot"
        );
    }

    /// Gives slot `slot` back; returns what it described. Panics if it
    /// was not taken (a slot freed twice).
    pub(super) fn free(&mut self, slot: u32) -> Slot {
        self.slots.remove(slot as usize)
    }

    /// Slot `slot`, if it is taken.
    #[cfg(test)]
    pub(super) fn get(&self, slot: usize) -> Option<&Slot> {
        self.slots.get(slot)
    }

    /// Every slot taken, with its key (walks the whole pool: not for
    /// per-tick loops).
    #[cfg(test)]
    pub(super) fn iter(&self) -> impl Iterator<Item = (usize, &Slot)> + '_ {
        self.slots.iter()
    }

    /// Checks (debug builds) that the slot pool has not grown since start.
    pub(super) fn check(&self) {
        self.slots.check();
        debug_assert!(self.slots.len() <= self.slots.limit());
    }
}

/// A taken slot (panics if it is not taken).
impl Index<u32> for Staging {
    type Output = Slot;
    fn index(&self, slot: u32) -> &Slot {
        &self.slots[slot as usize]
    }
}

impl IndexMut<u32> for Staging {
    fn index_mut(&mut self, slot: u32) -> &mut Slot {
        &mut self.slots[slot as usize]
    }
}

pub(super) struct Slot {
    pub(super) conn: u32,
    pub(super) grant: u32,
    /// Its grant's serial on the connection (`Work::serial`): a consumer
    /// may use an id again once the grant it named is finished.
    pub(super) serial: u32,
    /// Ring offset of the payload's first byte (DATA).
    pub(super) offset: u64,
    /// The grant's remote key (RDMA).
    pub(super) rkey: u32,
    /// ERROR frames: the code.
    pub(super) code: Code,
    pub(super) payload: u32,
    /// The chunk that completes its sample.
    pub(super) last: bool,
    /// Where the payload is sent from: null for the slot's staging memory,
    /// else a place in a mapped extent (page-cache mode).
    pub(super) src: *const u8,
    pub(super) ready: bool,
    pub(super) error: bool,
    /// When its read was submitted (read-latency histogram), or when the
    /// slot was taken for a chunk that needs no read.
    pub(super) issued: std::time::Instant,
    /// When its grant's GRANT frame was read (`Work::at`).
    pub(super) granted_at: std::time::Instant,
    /// When its bytes were there to send (its read completed; `issued`
    /// for a chunk that needs no read).
    pub(super) ready_at: std::time::Instant,
    /// When it was posted to the link (the node's send histograms).
    pub(super) posted_at: std::time::Instant,
    /// Its read (extent, file offset, length), kept so that a transient
    /// failure (EAGAIN, EINTR, a short read) is retried as it was issued.
    pub(super) read_extent: u32,
    pub(super) read_offset: u64,
    pub(super) read_len: u32,
    /// Reads of it submitted so far (at most `MAX_READ_ATTEMPTS`).
    pub(super) attempts: u32,
}

// SAFETY: `src` is null or points into one of the mapped extents, which
// `Common` owns (read-only, shared by every thread through an `Arc` that
// outlives each poller); nothing writes through it. The raw pointer is
// the only field that is not `Send`. (A `Staging` is made before its
// poller's thread starts, with no slot taken, and moved into it.)
unsafe impl Send for Slot {}

impl Slot {
    /// With its grant's GRANT frame read at `at`, the connection's
    /// grant number `serial`.
    pub(super) fn granted(mut self, at: std::time::Instant, serial: u32) -> Slot {
        self.granted_at = at;
        self.serial = serial;
        self
    }

    /// A slot taken for a chunk of connection `conn`'s grant `grant`;
    /// `queue_chunk` or `fill_error` says what it holds.
    pub(super) fn new(conn: u32, grant: u32, issued: std::time::Instant) -> Slot {
        Slot {
            conn,
            grant,
            serial: 0,
            offset: 0,
            rkey: 0,
            code: Code::Unknown,
            payload: 0,
            last: false,
            src: std::ptr::null(),
            ready: false,
            error: false,
            issued,
            granted_at: issued,
            ready_at: issued,
            posted_at: issued,
            read_extent: 0,
            read_offset: 0,
            read_len: 0,
            attempts: 0,
        }
    }
}
