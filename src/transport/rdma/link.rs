//! [`RdmaLink`], the owner side's [`Link`] over an RC queue pair, through
//! the [`WorkQueue`] interface (the real QP's by default; the tests run the
//! same code over the in-memory pair of `memverbs.rs`).
//!
//! Its `unsafe` is what the [`Link`] contract needs (the poster's memory
//! is referenced until completion); the verbs calls themselves go through
//! [`WorkQueue`].

use std::collections::VecDeque;
use std::sync::Arc;

use super::qp::{Cq, Qp, WorkCompletion};
use super::verbs::SendRegions;
use super::wq::{SendOp, SendWr, VerbsQueue, WorkQueue};
use crate::error::{Error, Result};
use crate::transport::{proto, Done, Link};

/// An [`RdmaLink`] asks for a completion at least every this many requests.
pub const SIGNAL_EVERY: usize = 8;

/// Largest ERROR message an [`RdmaLink`] sends (inline, after a 4-byte code).
pub const RDMA_ERROR_BYTES: usize = 128;

#[derive(Clone, Copy)]
struct RdmaWr {
    wr_id: u64,
    send: bool,
    src: u64,
    len: u32,
    lkey: u32,
    remote: u64,
    rkey: u32,
    imm: u32,
    inline_at: usize,
}

/// The verbs backend of [`Link`]: a posted write is an RDMA
/// WRITE_WITH_IMM from the poster's staging memory (registered local-only,
/// `lkey`) into the peer's ring under the grant's rkey (a memory window the
/// peer bound to that grant's range, or its whole ring's) with the grant id
/// as immediate; an ERROR is a SEND_WITH_IMM on the same QP, so it
/// cannot overtake the grant's writes (RC ordering), carrying a 4-byte code
/// and the message inline. `flush` posts everything queued as one chain (one
/// doorbell) signalling only its last request; `poll` turns the chain's
/// completion into a [`Done`] for each of its requests. A failed
/// completion (the QP is then in error) fails everything outstanding.
pub struct RdmaLink<Q: WorkQueue = VerbsQueue> {
    queue: Q,
    regions: SendRegions,
    remote_base: u64,
    max_wr: usize,
    queued: Vec<RdmaWr>,
    /// Requests posted, oldest first, and the signalled id ending each chain.
    posted: VecDeque<u64>,
    chain_ends: VecDeque<u64>,
    done: VecDeque<Done>,
    inline_buf: Vec<u8>,
    /// The chain `flush` posts (built from `queued`).
    chain: Vec<SendWr>,
    broken: Option<Error>,
    /// `close` could not post its flush marker (the queue refused it): it
    /// is posted at a later `poll`.
    marker_owed: bool,
}

impl RdmaLink {
    /// A link over the connected `qp` whose send completions go to `cq`
    /// (its own), writing from `regions` into the peer ring at `remote_base`
    /// (each write under its grant's rkey). At most `max_wr` requests
    /// outstanding (the QP's send queue size).
    pub fn new(qp: Qp, cq: Arc<Cq>, regions: SendRegions, remote_base: u64, max_wr: usize) -> Self {
        Self::on(
            VerbsQueue::new(qp, cq, max_wr),
            regions,
            remote_base,
            max_wr,
        )
    }
}

impl<Q: WorkQueue> RdmaLink<Q> {
    /// A link over `queue` (a connected QP's, at most `max_wr` deep),
    /// otherwise as [`RdmaLink::new`].
    pub fn on(queue: Q, regions: SendRegions, remote_base: u64, max_wr: usize) -> Self {
        RdmaLink {
            queue,
            regions,
            remote_base,
            max_wr,
            queued: Vec::with_capacity(max_wr),
            posted: VecDeque::with_capacity(max_wr),
            chain_ends: VecDeque::with_capacity(max_wr),
            done: VecDeque::with_capacity(max_wr),
            inline_buf: vec![0u8; max_wr * (4 + RDMA_ERROR_BYTES)],
            chain: Vec::with_capacity(max_wr),
            broken: None,
            marker_owed: false,
        }
    }

    /// The queue it posts to (a test reads a fault wrapper's counts).
    pub fn queue(&self) -> &Q {
        &self.queue
    }

    /// The capacities of the link's pools, which never grow.
    #[cfg(test)]
    pub(crate) fn capacities(&self) -> [usize; 6] {
        [
            self.queued.capacity(),
            self.posted.capacity(),
            self.chain_ends.capacity(),
            self.done.capacity(),
            self.inline_buf.capacity(),
            self.chain.capacity(),
        ]
    }

    /// Why the link stopped (a failed completion), if it did.
    pub fn error(&self) -> Option<&Error> {
        self.broken.as_ref()
    }

    /// Asks for an event on the CQ's completion channel at its next
    /// completion (the CQ must have been made with one).
    pub fn arm(&self) -> Result<()> {
        self.queue.arm()
    }

    /// Whether requests are posted and not yet completed.
    pub fn busy(&self) -> bool {
        !self.posted.is_empty()
    }

    /// Stops the link: the QP goes to the error state so the NIC touches
    /// none of the posted memory any more once their (flushed) completions
    /// are polled; what was queued and not posted fails now.
    pub fn close(&mut self) {
        if self.broken.is_none() {
            if let Err(e) = self.queue.set_error() {
                log::warn!("closing an RDMA link: {e}");
            }
            self.broken = Some(Error::Rdma {
                op: "link",
                detail: "closed".into(),
            });
        }
        fail_queued(&mut self.queued, &mut self.done);
        if self.posted.is_empty() {
            self.chain_ends.clear();
        } else if unsignalled_tail(&self.posted, &self.chain_ends) {
            // A chain refused part-way left posted requests that no
            // signalled completion covers: if they all succeed, nothing
            // would ever report them. A signalled request posted to the
            // QP in error is flushed with an error completion, which
            // (after every earlier one, in order) fails them all.
            self.marker_owed = true;
            self.post_marker();
        }
    }

    /// Posts the flush marker `close` owes. A refusal (a full send queue)
    /// is no sign that the device is done with the posted requests (a QP
    /// in error takes posts, and flushes them): they stay held, and the
    /// marker is retried at the next `poll`, once completions have freed
    /// room (every request still queued completes, flushed).
    fn post_marker(&mut self) {
        let marker = SendWr {
            wr_id: FLUSH_MARKER_WR,
            signaled: true,
            ..SendWr::EMPTY
        };
        // SAFETY: a zero-length SEND references no memory.
        match unsafe { self.queue.post_send(&[marker]) } {
            Ok(()) => self.marker_owed = false,
            Err(e) => log::debug!("RDMA link: the flush marker waits: {}", e.error),
        }
    }

    fn room(&self) -> bool {
        self.broken.is_none() && self.queued.len() + self.posted.len() < self.max_wr
    }

    fn fail_all(&mut self) {
        for id in self.posted.drain(..) {
            self.done.push_back(Done {
                wr_id: id,
                ok: false,
            });
        }
        self.chain_ends.clear();
        self.marker_owed = false;
        fail_queued(&mut self.queued, &mut self.done);
    }
}

/// The wr_id of the request `close` posts to learn that the send queue is
/// flushed; never a poster's id (those are staging slots).
const FLUSH_MARKER_WR: u64 = u64::MAX - 1;

/// Whether request `i` of a chain of `n` asks for a completion: the last,
/// and every SIGNAL_EVERY-th, so staging slots come back while a long
/// chain is still on the wire (one completion per chain would hold every
/// slot until its last write).
fn is_signalled(i: usize, n: usize) -> bool {
    i + 1 == n || (i + 1).is_multiple_of(SIGNAL_EVERY)
}

/// Moves the first `accepted` of `queued` (a chain built with
/// [`is_signalled`] over all of `queued`) to `posted`, and their signalled
/// ids to `chain_ends`; the rest stays queued.
fn commit_posted(
    queued: &mut Vec<RdmaWr>,
    accepted: usize,
    posted: &mut VecDeque<u64>,
    chain_ends: &mut VecDeque<u64>,
) {
    let n = queued.len();
    for (i, w) in queued.drain(..accepted.min(n)).enumerate() {
        posted.push_back(w.wr_id);
        if is_signalled(i, n) {
            chain_ends.push_back(w.wr_id);
        }
    }
}

/// Fails what was queued and never posted (its memory is free now).
fn fail_queued(queued: &mut Vec<RdmaWr>, done: &mut VecDeque<Done>) {
    for w in queued.drain(..) {
        done.push_back(Done {
            wr_id: w.wr_id,
            ok: false,
        });
    }
}

/// Whether the newest posted requests have no signalled completion coming.
fn unsignalled_tail(posted: &VecDeque<u64>, chain_ends: &VecDeque<u64>) -> bool {
    posted.back().is_some() && chain_ends.back() != posted.back()
}

// SAFETY: the raw addresses are memory the poster keeps valid until
// completion (Link's contract); one thread uses a link at a time.
unsafe impl<Q: WorkQueue + Send> Send for RdmaLink<Q> {}

impl<Q: WorkQueue> Link for RdmaLink<Q> {
    type Driver = ();

    /// # Safety
    /// As for [`Link::post_write`].
    unsafe fn post_write(
        &mut self,
        wr_id: u64,
        src: *const u8,
        len: u32,
        remote_offset: u64,
        grant: u32,
        rkey: u32,
    ) -> bool {
        if !self.room() {
            return false;
        }
        let Some(lkey) = self.regions.lkey(src as u64, len) else {
            // A caller bug, not a peer's doing: fail this request loudly.
            log::error!("RDMA write from unregistered memory {src:?}+{len}");
            self.done.push_back(Done { wr_id, ok: false });
            return true;
        };
        self.queued.push(RdmaWr {
            wr_id,
            send: false,
            src: src as u64,
            len,
            lkey,
            remote: self.remote_base + remote_offset,
            rkey,
            imm: grant,
            inline_at: 0,
        });
        true
    }

    /// # Safety
    /// As for [`Link::post_error`].
    unsafe fn post_error(
        &mut self,
        wr_id: u64,
        grant: u32,
        code: proto::Code,
        msg: *const u8,
        len: u32,
    ) -> bool {
        if !self.room() {
            return false;
        }
        // The code and the (truncated) message go inline, so neither needs
        // registered memory; the slot in inline_buf is this request's until
        // the flush copies it (inline data is copied at post time).
        let slot = self.queued.len();
        let at = slot * (4 + RDMA_ERROR_BYTES);
        let n = (len as usize).min(RDMA_ERROR_BYTES);
        self.inline_buf[at..at + 4].copy_from_slice(&(code as u32).to_le_bytes());
        // SAFETY: msg is readable for len bytes (Link's contract); n <= len.
        let m = unsafe { std::slice::from_raw_parts(msg, n) };
        self.inline_buf[at + 4..at + 4 + n].copy_from_slice(m);
        self.queued.push(RdmaWr {
            wr_id,
            send: true,
            src: 0,
            len: 4 + n as u32,
            lkey: 0,
            remote: 0,
            rkey: 0,
            imm: grant,
            inline_at: at,
        });
        true
    }

    fn flush(&mut self, _: &mut ()) -> std::io::Result<()> {
        if self.queued.is_empty() || self.broken.is_some() {
            return Ok(());
        }
        self.chain.clear();
        let n = self.queued.len();
        for (i, w) in self.queued.iter().enumerate() {
            // Selective signalling: the last of the chain and every
            // SIGNAL_EVERY-th (see is_signalled).
            let signaled = is_signalled(i, n);
            self.chain.push(if w.send {
                // The code and message go inline (copied at post time).
                SendWr {
                    wr_id: w.wr_id,
                    op: SendOp::SendWithImm,
                    local_addr: self.inline_buf[w.inline_at..].as_ptr() as u64,
                    len: w.len,
                    inline: true,
                    imm: w.imm,
                    signaled,
                    ..SendWr::EMPTY
                }
            } else {
                SendWr {
                    wr_id: w.wr_id,
                    op: SendOp::WriteWithImm,
                    local_addr: w.src,
                    len: w.len,
                    lkey: w.lkey,
                    inline: false,
                    remote_addr: w.remote,
                    rkey: w.rkey,
                    imm: w.imm,
                    signaled,
                }
            });
        }
        // SAFETY: inline data is copied during the call; the written
        // memory is valid until completion per Link's contract.
        let (accepted, result) = match unsafe { self.queue.post_send(&self.chain) } {
            Ok(()) => (n, Ok(())),
            Err(e) => (e.posted, Err(e.error)),
        };
        // What the provider accepted (all, or those before its bad_wr) is
        // on the send queue: held until its completion (or the flush of
        // the QP's error state); the rest stays queued, never posted.
        commit_posted(
            &mut self.queued,
            accepted,
            &mut self.posted,
            &mut self.chain_ends,
        );
        result
    }

    fn poll(&mut self, out: &mut [Done]) -> usize {
        if self.marker_owed {
            self.post_marker();
        }
        let mut wc = [WorkCompletion::default(); 16];
        while let Ok(n) = self.queue.poll(&mut wc) {
            if n == 0 {
                break;
            }
            for c in &wc[..n] {
                if let Err(e) = c.check() {
                    // The QP is in error: whatever is still posted was not
                    // (or not wholly) sent and the NIC is done with it.
                    if self.broken.is_none() {
                        log::warn!("RDMA link failed: {e}");
                        self.broken = Some(e);
                    }
                    self.fail_all();
                    continue;
                }
                // A signalled completion finishes every request up to it
                // (a QP completes its send queue in order).
                if self.chain_ends.front() == Some(&c.wr_id) {
                    self.chain_ends.pop_front();
                    while let Some(id) = self.posted.pop_front() {
                        self.done.push_back(Done {
                            wr_id: id,
                            ok: true,
                        });
                        if id == c.wr_id {
                            break;
                        }
                    }
                }
            }
        }
        let n = out.len().min(self.done.len());
        for slot in out.iter_mut().take(n) {
            *slot = self.done.pop_front().expect("counted");
        }
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wr(id: u64) -> RdmaWr {
        RdmaWr {
            wr_id: id,
            send: false,
            src: 0,
            len: 1,
            lkey: 0,
            remote: 0,
            rkey: 0,
            imm: 0,
            inline_at: 0,
        }
    }

    /// A chain of 10 refused at its 6th request (bad_wr = 5): the first 5
    /// are on the send queue and are not freed when the link closes (only
    /// the 5 never posted are); no signalled request is among them, so
    /// `close` must ask for a flush completion.
    #[test]
    fn a_chain_refused_part_way_frees_only_what_was_not_posted() {
        let mut queued: Vec<RdmaWr> = (0..10).map(wr).collect();
        let (mut posted, mut ends, mut done) = (VecDeque::new(), VecDeque::new(), VecDeque::new());
        commit_posted(&mut queued, 5, &mut posted, &mut ends);
        assert_eq!(posted, (0..5).collect::<VecDeque<u64>>());
        assert!(
            ends.is_empty(),
            "requests 7 and 9 are signalled, not posted"
        );
        assert!(unsignalled_tail(&posted, &ends));
        fail_queued(&mut queued, &mut done);
        let freed: Vec<u64> = done.iter().map(|d| d.wr_id).collect();
        assert_eq!(freed, (5..10).collect::<Vec<u64>>());

        // Refused at request 9: 0..9 posted, request 7 signalled, 8 not.
        let mut queued: Vec<RdmaWr> = (0..10).map(wr).collect();
        let (mut posted, mut ends) = (VecDeque::new(), VecDeque::new());
        commit_posted(&mut queued, 9, &mut posted, &mut ends);
        assert_eq!(ends, VecDeque::from([7]));
        assert!(unsignalled_tail(&posted, &ends));
        assert_eq!(queued.len(), 1);

        // All accepted: the last is signalled, nothing left queued.
        let mut queued: Vec<RdmaWr> = (0..10).map(wr).collect();
        let (mut posted, mut ends) = (VecDeque::new(), VecDeque::new());
        commit_posted(&mut queued, 10, &mut posted, &mut ends);
        assert_eq!(ends, VecDeque::from([7, 9]));
        assert!(!unsignalled_tail(&posted, &ends));
        assert!(queued.is_empty());
    }
}
