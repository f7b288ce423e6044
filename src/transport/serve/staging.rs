//! A poller's staging: the slab its reads land in and its sends go out
//! from, and the slots that describe what each chunk of it holds.

use std::sync::atomic::Ordering;

use super::owner_rdma::StagingMr;
use super::poller::SConn;
use super::Common;
use crate::error::Result;
use crate::pool::Pool;
use crate::sys::AlignedBuf;
use crate::transport::proto::Code;

/// A poller's staging slab, registered for RDMA when the service offers it.
pub(super) struct Staging {
    /// Its registration (read by the RDMA links only). Declared before
    /// `buf` so that it is dropped first: the memory is deregistered before
    /// it is freed (verbs teardown in reverse order of creation).
    #[cfg_attr(not(feature = "rdma"), allow(dead_code))]
    pub(super) rdma: StagingMr,
    pub(super) buf: AlignedBuf,
}

impl Staging {
    pub(super) fn new(c: &Common) -> Result<Staging> {
        let n = c.cfg.slots();
        let mut buf = AlignedBuf::new(n * c.cfg.chunk_bytes as usize, 4096);
        let rdma = StagingMr::register(c, &mut buf)?;
        Ok(Staging { rdma, buf })
    }
}

pub(super) struct Slot {
    pub(super) conn: u32,
    pub(super) grant: u32,
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
    /// When its read was submitted (read-latency histogram).
    pub(super) issued: std::time::Instant,
    /// Its read (extent, file offset, length), kept so that a transient
    /// failure (EAGAIN, EINTR, a short read) is retried as it was issued.
    pub(super) read_extent: u32,
    pub(super) read_offset: u64,
    pub(super) read_len: u32,
    /// Reads of it submitted so far (at most `MAX_READ_ATTEMPTS`).
    pub(super) attempts: u32,
}

impl Slot {
    /// A slot taken for a chunk of connection `conn`'s grant `grant`;
    /// `queue_chunk` or `fill_error` says what it holds.
    pub(super) fn new(conn: u32, grant: u32, issued: std::time::Instant) -> Slot {
        Slot {
            conn,
            grant,
            offset: 0,
            rkey: 0,
            code: Code::Unknown,
            payload: 0,
            last: false,
            src: std::ptr::null(),
            ready: false,
            error: false,
            issued,
            read_extent: 0,
            read_offset: 0,
            read_len: 0,
            attempts: 0,
        }
    }
}

/// Takes staging slot `slot` (the pool's vacant key) for connection `ci`,
/// described by `s` (a function of the two fields, so callers may hold
/// other borrows of the poller).
pub(super) fn take_slot(
    slots: &mut Pool<Slot>,
    conns: &mut Pool<SConn>,
    ci: u32,
    slot: u32,
    s: Slot,
) {
    let taken = slots.insert(s);
    debug_assert!(
        matches!(taken, Ok(k) if k == slot as usize),
        "take_slot: the vacant key"
    );
    if let Some(c) = conns.get_mut(ci as usize) {
        c.held += 1;
        c.metrics
            .staging_slots
            .store(c.held as u64, Ordering::Relaxed);
    }
}
