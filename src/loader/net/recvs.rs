//! The receives a network thread's RDMA links share: one shared receive
//! queue (SRQ) with its buffers for every link of the thread, instead of
//! 1,024 posted receives and their buffers per link. A node's
//! WRITE_WITH_IMM (a sample landed) or ERROR takes one; its completion
//! comes on the link's (shared) CQ with the SRQ's slot as its wr_id and the
//! QP's number, which names the link ([`SharedRecvs::node_of`]). The thread
//! re-posts each slot once its completion was handled (an ERROR's message
//! read first).
//!
//! Depth: one link's 1,024 for each link, at most 8,192 (and the device's
//! limit). A node writes a receive only for a grant it was given (a
//! window each, 256 a link at most), so the receives run short only when
//! the thread's links have over 8,192 grants out at once; a node that
//! finds none answers RNR and its write is retried (0.64 ms later, for
//! ever: `qp.rs`), a delay, not a failure.
//!
//! This module owns the buffers the device writes and is one of the few
//! allowed `unsafe` in the loader.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::error::{Error, Result};
use crate::transport::rdma::{Access, Mr, Pd, RecvWr, Srq, SRQ_CHAIN_MAX};

/// How many receives an RDMA connection keeps posted, where it posts its
/// own: every WRITE_WITH_IMM consumes one (too few only slows the owner
/// down: it retries on RNR).
pub const RDMA_RECVS: usize = 1024;
/// Receive buffer size: an ERROR message (code + up to 128 bytes).
pub const RDMA_RECV_BYTES: usize = 4 + crate::transport::rdma::RDMA_ERROR_BYTES;

/// Most receives one SRQ holds.
pub const SRQ_RECVS_MAX: usize = 8192;

/// The receives of a thread's SRQ for links to `nodes` nodes on a device
/// whose SRQs hold `max_srq_wr`: a link's own for each, at most
/// [`SRQ_RECVS_MAX`].
pub(crate) fn srq_depth(nodes: usize, max_srq_wr: usize) -> usize {
    (nodes.max(1) * RDMA_RECVS)
        .min(SRQ_RECVS_MAX)
        .min(max_srq_wr)
        .max(1)
}

/// A thread's shared receive queue, its buffers and which link each queue
/// pair is.
pub(crate) struct SharedRecvs {
    /// Before the buffers' registration and the buffers: every QP on it
    /// is gone before the thread's common resources are dropped.
    srq: Arc<Srq>,
    mr: Mr,
    /// `slots` buffers of `RDMA_RECV_BYTES` (a Vec, not a Box: the device
    /// writes them through the addresses posted; never resized).
    bufs: Vec<u8>,
    slots: usize,
    /// Node index of each live queue pair's number.
    nodes: Mutex<HashMap<u32, u32>>,
    /// The chain a re-post builds (sized once).
    chain: Mutex<Vec<RecvWr>>,
}

impl SharedRecvs {
    /// `slots` receives on `pd` ([`srq_depth`]), every one posted.
    pub(crate) fn new(pd: &Arc<Pd>, slots: usize) -> Result<SharedRecvs> {
        let srq = Srq::new(pd, slots as u32)?;
        let mut bufs = vec![0u8; slots * RDMA_RECV_BYTES];
        // SAFETY: the buffers live in this struct, after (so freed after)
        // the registration and the SRQ; the device writes a buffer only
        // while its receive is posted, and it is read only after its
        // completion and before it is posted again.
        let mr = unsafe { Mr::register(pd, bufs.as_mut_ptr(), bufs.len(), Access::Local) }?;
        let r = SharedRecvs {
            srq,
            mr,
            bufs,
            slots,
            nodes: Mutex::new(HashMap::new()),
            chain: Mutex::new(Vec::with_capacity(SRQ_CHAIN_MAX)),
        };
        let mut first = 0;
        while first < slots {
            let n = SRQ_CHAIN_MAX.min(slots - first);
            r.post((first..first + n).map(|s| s as u64))?;
            first += n;
        }
        Ok(r)
    }

    /// The SRQ, for the links' queue pairs.
    pub(crate) fn srq(&self) -> &Arc<Srq> {
        &self.srq
    }

    /// Receives it holds.
    pub(crate) fn depth(&self) -> usize {
        self.slots
    }

    /// Queue pair `qpn` is node `node`'s link (from now until
    /// [`SharedRecvs::forget`]).
    pub(crate) fn name(&self, qpn: u32, node: u32) {
        self.lock_nodes().insert(qpn, node);
    }

    /// Queue pair `qpn` is gone.
    pub(crate) fn forget(&self, qpn: u32) {
        self.lock_nodes().remove(&qpn);
    }

    /// The node of each of `qpns` (`u32::MAX`: none), one lock for all.
    pub(crate) fn nodes_of(&self, qpns: impl Iterator<Item = u32>, out: &mut [u32]) {
        let nodes = self.lock_nodes();
        for (o, q) in out.iter_mut().zip(qpns) {
            *o = nodes.get(&q).copied().unwrap_or(u32::MAX);
        }
    }

    fn lock_nodes(&self) -> std::sync::MutexGuard<'_, HashMap<u32, u32>> {
        self.nodes.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The first `n` bytes (at most a buffer's) of slot `slot`'s buffer,
    /// into `out`: its receive completed and it is not posted again yet.
    pub(crate) fn read(&self, slot: u64, n: usize, out: &mut [u8; RDMA_RECV_BYTES]) -> usize {
        let slot = slot as usize;
        assert!(slot < self.slots, "receive slot {slot} of {}", self.slots);
        let n = n.min(RDMA_RECV_BYTES);
        // SAFETY: in bounds (checked); the device wrote this slot before
        // its completion and writes it again only once it is re-posted,
        // which the thread does after this read.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.bufs.as_ptr().add(slot * RDMA_RECV_BYTES),
                out.as_mut_ptr(),
                n,
            )
        };
        n
    }

    /// Posts the receives of `slots` (each a slot whose completion was
    /// handled) again, in chains of at most `SRQ_CHAIN_MAX`.
    pub(crate) fn post(&self, slots: impl Iterator<Item = u64>) -> Result<()> {
        let mut chain = self.chain.lock().unwrap_or_else(|p| p.into_inner());
        let base = self.bufs.as_ptr() as u64;
        let lkey = self.mr.lkey();
        let mut slots = slots.peekable();
        while slots.peek().is_some() {
            chain.clear();
            chain.extend(slots.by_ref().take(SRQ_CHAIN_MAX).map(|s| {
                assert!(
                    (s as usize) < self.slots,
                    "receive slot {s} of {}",
                    self.slots
                );
                RecvWr {
                    wr_id: s,
                    addr: base + s * RDMA_RECV_BYTES as u64,
                    len: RDMA_RECV_BYTES as u32,
                    lkey,
                }
            }));
            // SAFETY: the buffers live in this struct, after the SRQ (see
            // `new`), and are read only after their completion.
            unsafe { self.srq.post(&chain) }.map_err(|e| Error::Rdma {
                op: "post shared receives",
                detail: format!("{} of {} posted: {}", e.posted, chain.len(), e.error),
            })?;
        }
        Ok(())
    }
}
