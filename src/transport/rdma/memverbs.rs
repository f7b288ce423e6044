//! `MemNic` (tests only): two connected RC queue pairs in memory behind
//! [`WorkQueue`], so the RDMA post/complete paths run in a seeded,
//! single-threaded test with the semantics the real code relies on:
//!
//! - A WRITE copies the local bytes (checked against the lkey's region)
//!   into the peer's memory under an rkey it registered, bounds checked: a
//!   bad key or range completes with `IBV_WC_REM_ACCESS_ERR` and moves the
//!   requester's QP to error. WRITE_WITH_IMM and SEND also consume the
//!   peer's oldest receive (completing it with the immediate; a SEND's
//!   bytes go into its buffer). With no receive posted the request waits
//!   at the head of the send queue, blocking those behind it: the real
//!   config's `rnr_retry` is 7, "retry for ever" (`qp.rs`).
//! - Requests execute in order, a seeded number per QP per [`MemNic::step`]
//!   (the delay); a successful one completes only when signalled. A QP in
//!   error executes nothing more: each request left (signalled or not) and
//!   each receive completes with `IBV_WC_WR_FLUSH_ERR`, in order; posting to
//!   it is allowed (flushed likewise), as on the real device. Moved to
//!   error by software, it still runs a seeded few requests first (those
//!   the device had fetched): a QP's error state says the device will
//!   stop, its flush completions that it has.
//! - A send-queue slot is taken at post and given back when a completion
//!   at or after it is polled (as a provider does under selective
//!   signalling); a post past the queue's depth is refused there with
//!   ENOMEM, the requests before it posted (`bad_wr`).
//! - Inline data is copied at post time into a per-slot pool.
//! - Seeded faults: a chain refused part-way (ENOMEM at a seeded index), a
//!   request completing with an error status (`IBV_WC_REM_OP_ERR`), the
//!   connection dying (both QPs in error; the requester's head request
//!   fails with `IBV_WC_RETRY_EXC_ERR`, a peer that answers nothing).
//!
//! Every queue is sized at construction; nothing is allocated per request
//! ([`MemNic::check_pools`]). The device reads local memory only while a
//! request is on its send queue and the QP has reported no error
//! ([`MemNic::may_read`]): what the tests check a staging slot against
//! before it may be reused. Its `unsafe` is the device's access to the
//! memory registered with it.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::rc::Rc;

use rdma_sys::{ibv_wc_opcode, ibv_wc_status};

use super::qp::WorkCompletion;
use super::wq::{PostError, RecvWr, SendOp, SendWr, WorkQueue};
use crate::error::Result;

/// Seeded fault and delay rates (parts per million).
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct MemFaults {
    /// Per chain posted: refused at a seeded index with ENOMEM.
    pub post_refuse_ppm: u32,
    /// Per request executed: completes with `IBV_WC_REM_OP_ERR`.
    pub wc_error_ppm: u32,
    /// Per step: the connection dies.
    pub die_ppm: u32,
    /// Most requests a QP executes per step (seeded, 0 to this).
    pub max_per_step: u32,
}

/// What the faults did (so a test can say they were exercised).
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct MemStats {
    /// Requests executed (read and written).
    pub executed: u64,
    /// Chains refused by the fault (at any index).
    pub refused: u64,
    /// Of those, refused after posting at least one request.
    pub refused_part_way: u64,
    pub wc_errors: u64,
    pub deaths: u64,
    pub remote_access_errors: u64,
    pub rnr_waits: u64,
}

impl MemStats {
    /// Adds `o` to these.
    pub(super) fn add(&mut self, o: &MemStats) {
        self.executed += o.executed;
        self.refused += o.refused;
        self.refused_part_way += o.refused_part_way;
        self.wc_errors += o.wc_errors;
        self.deaths += o.deaths;
        self.remote_access_errors += o.remote_access_errors;
        self.rnr_waits += o.rnr_waits;
    }
}

#[derive(Clone, Copy)]
struct Region {
    addr: u64,
    len: u64,
    lkey: u32,
    rkey: Option<u32>,
    side: usize,
}

#[derive(Clone, Copy)]
struct Pending {
    wr: SendWr,
    seq: u64,
}

struct End {
    error: bool,
    /// The status of the next completion after an error that was not a
    /// completion's (the connection died).
    first_status: Option<u32>,
    /// An error completion was generated: the device touches none of the
    /// send queue's memory any more.
    reported: bool,
    /// Requests the device had already fetched when software moved the QP
    /// to error: they still execute (read and write memory) before the
    /// flush begins.
    draining: u64,
    /// The first sequence number posted after the QP entered error (never
    /// executed).
    error_seq: u64,
    sq: VecDeque<Pending>,
    sq_depth: u64,
    next_seq: u64,
    /// Send-queue slots before this sequence number are free again.
    retired: u64,
    inline: Vec<u8>,
    rq: VecDeque<RecvWr>,
    rq_depth: usize,
    /// Completions, with the send-queue sequence number of a send's.
    cq: VecDeque<(WorkCompletion, Option<u64>)>,
    cq_depth: usize,
    caps: [usize; 4],
}

impl End {
    fn new(sq_depth: usize, rq_depth: usize, cq_depth: usize, max_inline: usize) -> End {
        let mut e = End {
            error: false,
            first_status: None,
            reported: false,
            draining: 0,
            error_seq: 0,
            sq: VecDeque::with_capacity(sq_depth),
            sq_depth: sq_depth as u64,
            next_seq: 0,
            retired: 0,
            inline: vec![0; sq_depth * max_inline],
            rq: VecDeque::with_capacity(rq_depth),
            rq_depth,
            cq: VecDeque::with_capacity(cq_depth),
            cq_depth,
            caps: [0; 4],
        };
        e.caps = e.capacities();
        e
    }

    fn capacities(&self) -> [usize; 4] {
        [
            self.sq.capacity(),
            self.inline.capacity(),
            self.rq.capacity(),
            self.cq.capacity(),
        ]
    }

    fn push_cq(&mut self, wc: WorkCompletion, seq: Option<u64>) {
        // A real CQ that overflows raises a fatal asynchronous error: the
        // user sized it wrong, a bug.
        assert!(
            self.cq.len() < self.cq_depth,
            "CQ overflow ({} entries)",
            self.cq_depth
        );
        self.cq.push_back((wc, seq));
    }
}

/// The two ends of one connection (0 and 1), and the memory registered
/// with them.
pub(super) struct MemNic {
    ends: [End; 2],
    regions: Vec<Region>,
    max_inline: usize,
    faults: MemFaults,
    rng: u64,
    next_key: u32,
    pub(super) stats: MemStats,
}

/// One end's queues, as [`WorkQueue`].
pub(super) struct MemQp {
    nic: Rc<RefCell<MemNic>>,
    side: usize,
}

fn wc(wr_id: u64, status: u32, opcode: u32, byte_len: u32, imm: Option<u32>) -> WorkCompletion {
    WorkCompletion {
        wr_id,
        status,
        opcode,
        byte_len,
        imm,
        vendor_err: 0,
    }
}

fn send_opcode(op: SendOp) -> u32 {
    match op {
        SendOp::Write | SendOp::WriteWithImm => ibv_wc_opcode::IBV_WC_RDMA_WRITE,
        SendOp::Send | SendOp::SendWithImm => ibv_wc_opcode::IBV_WC_SEND,
    }
}

impl MemNic {
    /// A connected pair: each end's send queue `sq_depth` deep, receive
    /// queue `rq_depth`, CQ `cq_depth`, inline data up to `max_inline`.
    pub(super) fn pair(
        seed: u64,
        faults: MemFaults,
        sq_depth: usize,
        rq_depth: usize,
        cq_depth: usize,
        max_inline: usize,
    ) -> (Rc<RefCell<MemNic>>, MemQp, MemQp) {
        let nic = Rc::new(RefCell::new(MemNic {
            ends: [
                End::new(sq_depth, rq_depth, cq_depth, max_inline),
                End::new(sq_depth, rq_depth, cq_depth, max_inline),
            ],
            regions: Vec::with_capacity(8),
            max_inline,
            faults,
            rng: crate::hash::mix64(seed ^ 0x05ee_d0f7_e1b5),
            next_key: 0x100,
            stats: MemStats::default(),
        }));
        let a = MemQp {
            nic: nic.clone(),
            side: 0,
        };
        let b = MemQp {
            nic: nic.clone(),
            side: 1,
        };
        (nic, a, b)
    }

    fn next(&mut self) -> u64 {
        self.rng = self.rng.wrapping_add(0x9e37_79b9_7f4a_7c15);
        crate::hash::mix64(self.rng)
    }

    fn below(&mut self, n: u64) -> u64 {
        crate::hash::reduce(self.next(), n)
    }

    fn chance(&mut self, ppm: u32) -> bool {
        ppm > 0 && self.below(1_000_000) < ppm as u64
    }

    /// Registers `len` bytes at `addr` with end `side`; returns its lkey,
    /// and its rkey when `remote` (the peer may write it).
    ///
    /// # Safety
    /// The memory must stay valid for as long as this NIC lives; the NIC
    /// reads and writes it (as a device would) during [`MemNic::step`].
    pub(super) unsafe fn register(
        &mut self,
        side: usize,
        addr: *mut u8,
        len: usize,
        remote: bool,
    ) -> (u32, Option<u32>) {
        assert!(self.regions.len() < self.regions.capacity(), "regions full");
        let lkey = self.next_key;
        let rkey = remote.then_some(lkey + 1);
        self.next_key += 2;
        self.regions.push(Region {
            addr: addr as u64,
            len: len as u64,
            lkey,
            rkey,
            side,
        });
        (lkey, rkey)
    }

    fn local_ok(&self, side: usize, addr: u64, len: u32, lkey: u32) -> bool {
        self.regions.iter().any(|r| {
            r.side == side
                && r.lkey == lkey
                && addr >= r.addr
                && addr + len as u64 <= r.addr + r.len
        })
    }

    fn remote_ok(&self, side: usize, addr: u64, len: u32, rkey: u32) -> bool {
        self.regions.iter().any(|r| {
            r.side == side
                && r.rkey == Some(rkey)
                && addr >= r.addr
                && addr + len as u64 <= r.addr + r.len
        })
    }

    /// Whether the device may still read the memory of request `wr_id`
    /// posted on end `side`: it is on the send queue (not executed, not
    /// flushed) and the QP has reported no error.
    pub(super) fn may_read(&self, side: usize, wr_id: u64) -> bool {
        let e = &self.ends[side];
        !e.reported && e.sq.iter().any(|p| p.wr.wr_id == wr_id && !p.wr.inline)
    }

    /// End `side`'s state, for a failure's message: the QP's error state
    /// and its send queue as (wr_id, sequence number, signalled).
    pub(super) fn describe(&self, side: usize) -> String {
        let e = &self.ends[side];
        let sq: Vec<(u64, u64, bool)> =
            e.sq.iter()
                .map(|p| (p.wr.wr_id, p.seq, p.wr.signaled))
                .collect();
        format!(
            "in error {}, error reported {}, slots retired to {}, next {}, send queue {sq:?}",
            e.error, e.reported, e.retired, e.next_seq
        )
    }

    /// Requests and receives posted on end `side` and not completed.
    pub(super) fn in_flight(&self, side: usize) -> usize {
        self.ends[side].sq.len() + self.ends[side].rq.len()
    }

    /// Whether end `side`'s QP is in the error state.
    pub(super) fn in_error(&self, side: usize) -> bool {
        self.ends[side].error
    }

    /// Panics if any queue or pool grew past its size at construction.
    pub(super) fn check_pools(&self) {
        for (i, e) in self.ends.iter().enumerate() {
            assert_eq!(e.capacities(), e.caps, "end {i}: a pool grew");
        }
        assert!(self.regions.len() <= 8);
    }

    fn enter_error(&mut self, side: usize, first_status: Option<u32>) {
        if self.ends[side].error {
            return;
        }
        // Moved by software (first_status None): what the device had
        // fetched may still run (a seeded few requests).
        let draining = match first_status {
            None => self.below(self.faults.max_per_step as u64 + 1),
            Some(_) => 0,
        };
        let e = &mut self.ends[side];
        e.error = true;
        e.first_status = first_status;
        e.draining = draining;
        e.error_seq = e.next_seq;
    }

    /// One step of the device: perhaps the connection dies; each end
    /// executes (or flushes) a seeded number of its requests, and a QP in
    /// error flushes its receives.
    pub(super) fn step(&mut self) {
        if !(self.ends[0].error && self.ends[1].error) && self.chance(self.faults.die_ppm) {
            self.stats.deaths += 1;
            let status = Some(ibv_wc_status::IBV_WC_RETRY_EXC_ERR);
            self.enter_error(0, status);
            self.enter_error(1, status);
        }
        for side in 0..2 {
            let k = self.below(self.faults.max_per_step as u64 + 1);
            for _ in 0..k {
                if !self.exec_head(side) {
                    break;
                }
            }
            if self.ends[side].error {
                while let Some(r) = self.ends[side].rq.pop_front() {
                    let c = wc(
                        r.wr_id,
                        ibv_wc_status::IBV_WC_WR_FLUSH_ERR,
                        ibv_wc_opcode::IBV_WC_RECV,
                        0,
                        None,
                    );
                    self.ends[side].push_cq(c, None);
                }
            }
        }
    }

    /// Completes the head request of `side` with `status` (an error moves
    /// the QP to error).
    fn complete_head(&mut self, side: usize, status: u32) {
        let e = &mut self.ends[side];
        let p = e.sq.pop_front().expect("a head request");
        let ok = status == ibv_wc_status::IBV_WC_SUCCESS;
        if !ok {
            e.error = true;
            e.reported = true;
        }
        if !ok || p.wr.signaled {
            let c = wc(p.wr.wr_id, status, send_opcode(p.wr.op), p.wr.len, None);
            e.push_cq(c, Some(p.seq));
        }
    }

    /// Executes (or flushes) the head request of `side`; false when there
    /// is none or it waits for a receive.
    fn exec_head(&mut self, side: usize) -> bool {
        let Some(p) = self.ends[side].sq.front().copied() else {
            return false;
        };
        let peer = 1 - side;
        let w = p.wr;
        let consumes_recv = !matches!(w.op, SendOp::Write);
        if self.ends[side].error {
            let e = &mut self.ends[side];
            let fetched = e.draining > 0
                && p.seq < e.error_seq
                && !e.reported
                && !self.ends[peer].error
                && !(consumes_recv && self.ends[peer].rq.is_empty());
            if !fetched {
                let status = self.ends[side].first_status.take();
                self.complete_head(side, status.unwrap_or(ibv_wc_status::IBV_WC_WR_FLUSH_ERR));
                return true;
            }
            // Already at the device: it runs as if the QP were not in error.
            self.ends[side].draining -= 1;
        }
        if self.chance(self.faults.wc_error_ppm) {
            self.stats.wc_errors += 1;
            self.complete_head(side, ibv_wc_status::IBV_WC_REM_OP_ERR);
            return true;
        }
        let status = if !w.inline && w.len > 0 && !self.local_ok(side, w.local_addr, w.len, w.lkey)
        {
            ibv_wc_status::IBV_WC_LOC_PROT_ERR
        } else if self.ends[peer].error {
            // The peer answers nothing: the retries run out.
            ibv_wc_status::IBV_WC_RETRY_EXC_ERR
        } else if matches!(w.op, SendOp::Write | SendOp::WriteWithImm)
            && !self.remote_ok(peer, w.remote_addr, w.len, w.rkey)
        {
            self.stats.remote_access_errors += 1;
            ibv_wc_status::IBV_WC_REM_ACCESS_ERR
        } else if consumes_recv && self.ends[peer].rq.is_empty() {
            // Receiver not ready: retried for ever (rnr_retry 7).
            self.stats.rnr_waits += 1;
            return false;
        } else {
            self.execute(side, p);
            ibv_wc_status::IBV_WC_SUCCESS
        };
        self.complete_head(side, status);
        true
    }

    /// Moves the bytes of the (checked) request `p` of `side` and completes
    /// the peer's receive it consumes.
    fn execute(&mut self, side: usize, p: Pending) {
        self.stats.executed += 1;
        let peer = 1 - side;
        let w = p.wr;
        let src: *const u8 = if w.inline {
            let slot = (p.seq % self.ends[side].sq_depth) as usize;
            self.ends[side].inline[slot * self.max_inline..].as_ptr()
        } else {
            w.local_addr as *const u8
        };
        let (dst, imm, opcode) = match w.op {
            SendOp::Write | SendOp::WriteWithImm => (
                w.remote_addr as *mut u8,
                (w.op == SendOp::WriteWithImm).then_some(w.imm),
                ibv_wc_opcode::IBV_WC_RECV_RDMA_WITH_IMM,
            ),
            SendOp::Send | SendOp::SendWithImm => {
                let r = self.ends[peer].rq.front().expect("checked");
                assert!(
                    w.len <= r.len && self.local_ok(peer, r.addr, r.len, r.lkey),
                    "a SEND of {} bytes into a receive of {} (or outside its region)",
                    w.len,
                    r.len
                );
                (
                    r.addr as *mut u8,
                    (w.op == SendOp::SendWithImm).then_some(w.imm),
                    ibv_wc_opcode::IBV_WC_RECV,
                )
            }
        };
        if w.len > 0 {
            // SAFETY: the source is the request's own inline slot or lies in
            // a region registered by `side` (checked); the destination lies
            // in a region the peer registered (checked: rkey and bounds, or
            // its receive's buffer); registered memory outlives the NIC
            // (register's contract). `copy` allows overlap.
            unsafe { std::ptr::copy(src, dst, w.len as usize) };
        }
        if w.op != SendOp::Write {
            let r = self.ends[peer].rq.pop_front().expect("checked");
            let c = wc(r.wr_id, ibv_wc_status::IBV_WC_SUCCESS, opcode, w.len, imm);
            self.ends[peer].push_cq(c, None);
        }
    }

    fn post_send(&mut self, side: usize, chain: &[SendWr]) -> std::result::Result<(), PostError> {
        // Only chains: a single request (the link's flush marker) is
        // refused only by a full queue (see the report on the marker).
        let refuse_at = (chain.len() > 1 && self.chance(self.faults.post_refuse_ppm))
            .then(|| self.below(chain.len() as u64) as usize);
        let max_inline = self.max_inline;
        let e = &mut self.ends[side];
        for (i, w) in chain.iter().enumerate() {
            let full = e.next_seq - e.retired >= e.sq_depth;
            if full || refuse_at == Some(i) {
                if !full {
                    self.stats.refused += 1;
                    self.stats.refused_part_way += (i > 0) as u64;
                }
                return Err(PostError {
                    posted: i,
                    error: std::io::Error::from_raw_os_error(libc::ENOMEM),
                });
            }
            if w.inline {
                if w.len as usize > max_inline {
                    return Err(PostError {
                        posted: i,
                        error: std::io::Error::from_raw_os_error(libc::EINVAL),
                    });
                }
                let at = (e.next_seq % e.sq_depth) as usize * max_inline;
                // SAFETY: inline data is readable for len bytes at post
                // time (the post's contract); copied now.
                let data = unsafe {
                    std::slice::from_raw_parts(w.local_addr as *const u8, w.len as usize)
                };
                e.inline[at..at + data.len()].copy_from_slice(data);
            }
            e.sq.push_back(Pending {
                wr: *w,
                seq: e.next_seq,
            });
            e.next_seq += 1;
        }
        Ok(())
    }

    fn post_recv(&mut self, side: usize, chain: &[RecvWr]) -> std::result::Result<(), PostError> {
        let e = &mut self.ends[side];
        for (i, r) in chain.iter().enumerate() {
            if e.rq.len() >= e.rq_depth {
                return Err(PostError {
                    posted: i,
                    error: std::io::Error::from_raw_os_error(libc::ENOMEM),
                });
            }
            e.rq.push_back(*r);
        }
        Ok(())
    }

    fn poll(&mut self, side: usize, out: &mut [WorkCompletion]) -> usize {
        let e = &mut self.ends[side];
        let mut n = 0;
        while n < out.len() {
            let Some((c, seq)) = e.cq.pop_front() else {
                break;
            };
            if let Some(s) = seq {
                // Its slot, and every earlier one, are free again.
                e.retired = e.retired.max(s + 1);
            }
            out[n] = c;
            n += 1;
        }
        n
    }
}

impl WorkQueue for MemQp {
    unsafe fn post_send(&mut self, chain: &[SendWr]) -> std::result::Result<(), PostError> {
        self.nic.borrow_mut().post_send(self.side, chain)
    }

    unsafe fn post_recv(&mut self, chain: &[RecvWr]) -> std::result::Result<(), PostError> {
        self.nic.borrow_mut().post_recv(self.side, chain)
    }

    fn poll(&mut self, out: &mut [WorkCompletion]) -> Result<usize> {
        Ok(self.nic.borrow_mut().poll(self.side, out))
    }

    fn arm(&self) -> Result<()> {
        Ok(())
    }

    fn set_error(&mut self) -> Result<()> {
        self.nic.borrow_mut().enter_error(self.side, None);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(wr_id: u64, src: &[u8], lkey: u32, dst: u64, rkey: u32, signaled: bool) -> SendWr {
        SendWr {
            wr_id,
            op: SendOp::WriteWithImm,
            local_addr: src.as_ptr() as u64,
            len: src.len() as u32,
            lkey,
            inline: false,
            remote_addr: dst,
            rkey,
            imm: wr_id as u32,
            signaled,
        }
    }

    fn drain(nic: &Rc<RefCell<MemNic>>, q: &mut MemQp) -> Vec<WorkCompletion> {
        for _ in 0..64 {
            nic.borrow_mut().step();
        }
        let mut out = [WorkCompletion::default(); 16];
        let n = q.poll(&mut out).unwrap();
        out[..n].to_vec()
    }

    /// The model's RC semantics, without random faults: a WRITE_WITH_IMM
    /// waits for a receive (RNR, retried for ever) and then lands; one out
    /// of the peer's region fails with a remote access error and the
    /// requests behind it are flushed, signalled or not; a post past the
    /// send queue's depth is refused where it overflows, and the slots come
    /// back only when a completion is polled.
    #[test]
    fn the_in_memory_pair_behaves_as_rc() {
        let faults = MemFaults {
            max_per_step: 3,
            ..MemFaults::default()
        };
        // Declared first, so dropped after the NICs.
        let mut src = vec![7u8; 32];
        let mut dst = vec![0u8; 64];
        let (nic, mut a, mut b) = MemNic::pair(1, faults, 4, 4, 16, 16);
        // SAFETY: both buffers outlive the NIC (declared before it).
        let (lkey, rkey) = unsafe {
            let (l, _) = nic.borrow_mut().register(0, src.as_mut_ptr(), 32, false);
            let (_, r) = nic.borrow_mut().register(1, dst.as_mut_ptr(), 64, true);
            (l, r.unwrap())
        };
        let base = dst.as_ptr() as u64;
        // SAFETY: src stays valid until the completions (this test).
        unsafe { a.post_send(&[write(1, &src, lkey, base + 8, rkey, true)]) }.unwrap();
        assert!(drain(&nic, &mut a).is_empty(), "no receive: it waits");
        assert!(nic.borrow().may_read(0, 1));
        let r = RecvWr {
            wr_id: 40,
            ..RecvWr::default()
        };
        // SAFETY: no buffer.
        unsafe { b.post_recv(&[r]) }.unwrap();
        let c = drain(&nic, &mut a);
        assert_eq!((c.len(), c[0].wr_id, c[0].status), (1, 1, 0));
        assert!(!nic.borrow().may_read(0, 1));
        assert_eq!(&dst[8..40], &[7u8; 32][..]);
        assert_eq!(dst[7], 0);
        let c = drain(&nic, &mut b);
        assert_eq!((c[0].wr_id, c[0].imm, c[0].byte_len), (40, Some(1), 32));

        // Out of the region: remote access error, the rest flushed.
        // SAFETY: as above.
        unsafe {
            b.post_recv(&[r, r]).unwrap();
            let chain = [
                write(2, &src, lkey, base + 40, rkey, false),
                write(3, &src, lkey, base, rkey, false),
            ];
            a.post_send(&chain).unwrap();
        }
        let c = drain(&nic, &mut a);
        let got: Vec<(u64, u32)> = c.iter().map(|w| (w.wr_id, w.status)).collect();
        assert_eq!(
            got,
            [
                (2, ibv_wc_status::IBV_WC_REM_ACCESS_ERR),
                (3, ibv_wc_status::IBV_WC_WR_FLUSH_ERR)
            ]
        );
        assert_eq!(dst[0], 0, "nothing written after the error");

        // Depth 4: a chain of 5 is refused at its fifth.
        let (nic, mut a, _b) = MemNic::pair(2, faults, 4, 4, 16, 16);
        // SAFETY: as above.
        let lkey = unsafe { nic.borrow_mut().register(0, src.as_mut_ptr(), 32, false).0 };
        let chain: Vec<SendWr> = (0..5).map(|i| write(i, &src, lkey, 0, 0, i == 3)).collect();
        // SAFETY: as above.
        let e = unsafe { a.post_send(&chain) }.unwrap_err();
        assert_eq!((e.posted, e.error.raw_os_error()), (4, Some(libc::ENOMEM)));
        a.set_error().unwrap();
        // Posted to a QP in error: accepted only once a completion is
        // polled (its slot and the ones before it free).
        // SAFETY: as above.
        assert!(unsafe { a.post_send(&chain[4..]) }.is_err());
        let c = drain(&nic, &mut a);
        assert_eq!(c.len(), 4, "every request flushed");
        // SAFETY: as above.
        unsafe { a.post_send(&chain[4..]) }.unwrap();
        nic.borrow().check_pools();
    }
}
