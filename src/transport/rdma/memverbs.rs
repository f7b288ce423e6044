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
//!   config's `rnr_retry` is 7, "retry for ever" (`qp.rs`). A remote access
//!   error moves the peer's QP to error too (the responder's class C
//!   error, as RC does): its receives flush.
//! - Type 2 memory windows ([`MemNic::alloc_windows`]) over a region
//!   registered without remote access, as the verbs spec has them: a bind
//!   ([`MwOp::Bind`]) is a send-queue request that executes in order and
//!   completes like one; it needs the window free and the range inside the
//!   region (else `IBV_WC_MW_BIND_ERR`), and gives the window the rkey it
//!   names (same index; the caller advances the low 8 bits). A write under
//!   a window's rkey lands only while the window is valid, with that very
//!   key, inside its range; anything else is `IBV_WC_REM_ACCESS_ERR` with
//!   the target memory untouched. An invalidation ([`MwOp::Invalidate`])
//!   names the current key (else `IBV_WC_LOC_QP_OP_ERR`) and frees the
//!   window. A bind or invalidation that executes while a write through
//!   that window's key is still on the peer's send queue is counted
//!   ([`MemStats::window_races`]): the protocol must never do it.
//! - Optionally ([`MemNic::log_writes`]) every write that lands is logged
//!   for the test to check against what it has open.
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
//!
//! (Why this file is over ~800 lines: one device model; the queue pairs,
//! regions, windows and their completion rules act on one shared state,
//! and about 240 lines are its own tests.)

use std::cell::RefCell;
use std::collections::VecDeque;
use std::rc::Rc;

use rdma_sys::{ibv_wc_opcode, ibv_wc_status};

use super::qp::WorkCompletion;
use super::wq::{MwOp, MwWr, PostError, RecvWr, SendOp, SendWr, WorkQueue};
use crate::error::Result;

/// Seeded fault and delay rates (parts per million).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct MemFaults {
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
pub(crate) struct MemStats {
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
    /// Window binds and invalidations executed.
    pub window_ops: u64,
    /// Of those, executed while a write under the window's key was still
    /// queued at the peer (see the module's documentation).
    pub window_races: u64,
    /// Window requests the device refused (`IBV_WC_MW_BIND_ERR`,
    /// `IBV_WC_LOC_QP_OP_ERR`).
    pub window_errors: u64,
    /// Invalidations posted unsignalled, in a chain whose last request
    /// is signalled (the consumer's per-tick chains).
    pub unsignalled_invalidations: u64,
}

impl MemStats {
    /// Adds `o` to these.
    pub(crate) fn add(&mut self, o: &MemStats) {
        self.executed += o.executed;
        self.refused += o.refused;
        self.refused_part_way += o.refused_part_way;
        self.wc_errors += o.wc_errors;
        self.deaths += o.deaths;
        self.remote_access_errors += o.remote_access_errors;
        self.rnr_waits += o.rnr_waits;
        self.window_ops += o.window_ops;
        self.window_races += o.window_races;
        self.window_errors += o.window_errors;
        self.unsignalled_invalidations += o.unsignalled_invalidations;
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
    /// A send; for a window request, its id and signalling (no memory).
    wr: SendWr,
    /// A window request: what it does.
    mw: Option<MwOp>,
    seq: u64,
}

/// A type 2 memory window.
#[derive(Clone, Copy)]
struct Window {
    rkey: u32,
    valid: bool,
    addr: u64,
    len: u64,
}

/// A write that landed (see [`MemNic::log_writes`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Landed {
    /// The side that posted it, and its request's id.
    pub side: usize,
    pub wr_id: u64,
    pub addr: u64,
    pub len: u32,
    pub rkey: u32,
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
    /// Its windows, and the lkey of the region they bind over.
    windows: Vec<Window>,
    window_region: u32,
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
            windows: Vec::new(),
            window_region: 0,
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
pub(crate) struct MemNic {
    ends: [End; 2],
    regions: Vec<Region>,
    max_inline: usize,
    faults: MemFaults,
    rng: u64,
    next_key: u32,
    /// Writes that landed, when logging (fixed capacity: drained by the
    /// test every step).
    landed: Option<Vec<Landed>>,
    pub(crate) stats: MemStats,
}

/// One end's queues, as [`WorkQueue`].
pub(crate) struct MemQp {
    nic: Rc<RefCell<MemNic>>,
    side: usize,
}

fn wc(wr_id: u64, status: u32, opcode: u32, byte_len: u32, imm: Option<u32>) -> WorkCompletion {
    WorkCompletion {
        qp_num: 0,
        wr_id,
        status,
        opcode,
        byte_len,
        imm,
        vendor_err: 0,
    }
}

/// The rkey of window `j` of side `side` with tag 0: an index no region's
/// key has.
fn window_rkey(side: usize, j: usize) -> u32 {
    (0x40_0000 | (side as u32) << 16 | j as u32) << 8
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
    pub(crate) fn pair(
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
            landed: None,
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
    pub(crate) unsafe fn register(
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

    /// Allocates `n` type 2 windows on end `side` that bind over the region
    /// of `lkey` (registered by `side`); returns their current rkeys,
    /// window `j` at index `j` (what [`MwOp::Bind`] names). Once per end.
    pub(crate) fn alloc_windows(&mut self, side: usize, lkey: u32, n: usize) -> Vec<u32> {
        let e = &mut self.ends[side];
        assert!(e.windows.is_empty(), "windows allocated twice");
        e.window_region = lkey;
        e.windows = (0..n)
            .map(|j| Window {
                rkey: window_rkey(side, j),
                valid: false,
                addr: 0,
                len: 0,
            })
            .collect();
        e.windows.iter().map(|w| w.rkey).collect()
    }

    /// Logs every write that lands from now on, up to `capacity` between
    /// two [`MemNic::take_landed`] calls.
    pub(crate) fn log_writes(&mut self, capacity: usize) {
        self.landed = Some(Vec::with_capacity(capacity));
    }

    /// Hands each logged write to `f`, oldest first, and forgets them.
    pub(crate) fn take_landed(&mut self, mut f: impl FnMut(&Landed)) {
        if let Some(log) = &mut self.landed {
            for l in log.drain(..) {
                f(&l);
            }
        }
    }

    /// The window of `side` whose index `rkey` names (any tag).
    fn window_of(&self, side: usize, rkey: u32) -> Option<usize> {
        let ws = &self.ends[side].windows;
        let first = ws.first()?.rkey >> 8;
        let j = (rkey >> 8).checked_sub(first)? as usize;
        (j < ws.len()).then_some(j)
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
        if let Some(j) = self.window_of(side, rkey) {
            let w = self.ends[side].windows[j];
            return w.valid
                && w.rkey == rkey
                && addr >= w.addr
                && addr + len as u64 <= w.addr + w.len;
        }
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
    pub(crate) fn may_read(&self, side: usize, wr_id: u64) -> bool {
        let e = &self.ends[side];
        !e.reported
            && e.sq
                .iter()
                .any(|p| p.wr.wr_id == wr_id && !p.wr.inline && p.mw.is_none())
    }

    /// End `side`'s state, for a failure's message: the QP's error state
    /// and its send queue as (wr_id, sequence number, signalled).
    pub(crate) fn describe(&self, side: usize) -> String {
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
    pub(crate) fn in_flight(&self, side: usize) -> usize {
        self.ends[side].sq.len() + self.ends[side].rq.len()
    }

    /// Whether end `side`'s QP is in the error state.
    pub(crate) fn in_error(&self, side: usize) -> bool {
        self.ends[side].error
    }

    /// Panics if any queue or pool grew past its size at construction.
    pub(crate) fn check_pools(&self) {
        for (i, e) in self.ends.iter().enumerate() {
            assert_eq!(e.capacities(), e.caps, "end {i}: a pool grew");
        }
        if let Some(log) = &self.landed {
            assert!(log.len() <= log.capacity(), "the write log grew");
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
    pub(crate) fn step(&mut self) {
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
            let opcode = match p.mw {
                Some(MwOp::Bind { .. }) => ibv_wc_opcode::IBV_WC_BIND_MW,
                Some(MwOp::Invalidate { .. }) => ibv_wc_opcode::IBV_WC_LOCAL_INV,
                None => send_opcode(p.wr.op),
            };
            let c = wc(p.wr.wr_id, status, opcode, p.wr.len, None);
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
        let consumes_recv = p.mw.is_none() && !matches!(w.op, SendOp::Write);
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
        if let Some(op) = p.mw {
            let status = self.exec_window(side, op);
            self.complete_head(side, status);
            return true;
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
            // The responder's class C error: its QP goes to error too.
            self.enter_error(peer, Some(ibv_wc_status::IBV_WC_WR_FLUSH_ERR));
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

    /// Executes window request `op` on end `side`; returns its status.
    fn exec_window(&mut self, side: usize, op: MwOp) -> u32 {
        self.stats.window_ops += 1;
        let (j, ok) = match op {
            MwOp::Bind {
                window,
                region: index,
                addr,
                len,
                rkey,
            } => {
                let e = &self.ends[side];
                let j = window as usize;
                let region = e.window_region;
                // One region per end here (the windows' own).
                let ok = index == 0
                    && j < e.windows.len()
                    && !e.windows[j].valid
                    && rkey >> 8 == e.windows[j].rkey >> 8
                    && len <= u32::MAX as u64
                    && self.local_ok(side, addr, len as u32, region);
                (j, ok)
            }
            MwOp::Invalidate { rkey } => match self.window_of(side, rkey) {
                Some(j) => (j, self.ends[side].windows[j].rkey == rkey),
                None => (usize::MAX, false),
            },
        };
        if !ok {
            self.stats.window_errors += 1;
            return match op {
                MwOp::Bind { .. } => ibv_wc_status::IBV_WC_MW_BIND_ERR,
                MwOp::Invalidate { .. } => ibv_wc_status::IBV_WC_LOC_QP_OP_ERR,
            };
        }
        // A write through the window's key still queued at the peer would
        // land or fail depending on which runs first.
        let key = self.ends[side].windows[j].rkey;
        let racing = self.ends[1 - side].sq.iter().any(|p| {
            p.mw.is_none()
                && matches!(p.wr.op, SendOp::Write | SendOp::WriteWithImm)
                && p.wr.rkey == key
        });
        if racing && self.ends[side].windows[j].valid {
            self.stats.window_races += 1;
        }
        let w = &mut self.ends[side].windows[j];
        match op {
            MwOp::Bind {
                addr, len, rkey, ..
            } => {
                *w = Window {
                    rkey,
                    valid: true,
                    addr,
                    len,
                };
            }
            MwOp::Invalidate { .. } => w.valid = false,
        }
        ibv_wc_status::IBV_WC_SUCCESS
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
        if let (Some(log), SendOp::Write | SendOp::WriteWithImm) = (&mut self.landed, w.op) {
            assert!(log.len() < log.capacity(), "write log full: drain it");
            log.push(Landed {
                side,
                wr_id: w.wr_id,
                addr: w.remote_addr,
                len: w.len,
                rkey: w.rkey,
            });
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
                mw: None,
                seq: e.next_seq,
            });
            e.next_seq += 1;
        }
        Ok(())
    }

    fn post_mw(&mut self, side: usize, chain: &[MwWr]) -> std::result::Result<(), PostError> {
        let e = &mut self.ends[side];
        for (i, w) in chain.iter().enumerate() {
            if !w.signaled && matches!(w.op, MwOp::Invalidate { .. }) {
                self.stats.unsignalled_invalidations += 1;
            }
            if e.next_seq - e.retired >= e.sq_depth {
                return Err(PostError {
                    posted: i,
                    error: std::io::Error::from_raw_os_error(libc::ENOMEM),
                });
            }
            e.sq.push_back(Pending {
                wr: SendWr {
                    wr_id: w.wr_id,
                    signaled: w.signaled,
                    ..SendWr::EMPTY
                },
                mw: Some(w.op),
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

    fn post_mw(&mut self, chain: &[MwWr]) -> std::result::Result<(), PostError> {
        self.nic.borrow_mut().post_mw(self.side, chain)
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

    /// Type 2 windows: a bind completes on the CQ and opens exactly its
    /// range under the key it names; a write inside lands; one past the
    /// range, or under the key after the window is invalidated, fails with
    /// a remote access error, puts both QPs in error and leaves the memory
    /// untouched; binding a valid window, or invalidating under a stale
    /// key, is refused by the device.
    #[test]
    fn type_2_windows_open_only_their_range_while_valid() {
        let faults = MemFaults {
            max_per_step: 3,
            ..MemFaults::default()
        };
        let mut src = vec![7u8; 32];
        let mut dst = vec![0u8; 64];
        let setup = |src: &mut Vec<u8>, dst: &mut Vec<u8>, seed| {
            let (nic, a, b) = MemNic::pair(seed, faults, 8, 8, 16, 16);
            // SAFETY: both buffers outlive the NIC (declared before it).
            let (lkey, region) = unsafe {
                let (l, _) = nic.borrow_mut().register(0, src.as_mut_ptr(), 32, false);
                let (r, rkey) = nic.borrow_mut().register(1, dst.as_mut_ptr(), 64, false);
                assert!(rkey.is_none(), "windows only: the region opens nothing");
                (l, r)
            };
            let keys = nic.borrow_mut().alloc_windows(1, region, 2);
            nic.borrow_mut().log_writes(8);
            (nic, a, b, lkey, keys)
        };
        let base = dst.as_ptr() as u64;
        let bind = |wr_id, window, addr, len, rkey| MwWr {
            wr_id,
            op: MwOp::Bind {
                window,
                region: 0,
                addr,
                len,
                rkey,
            },
            signaled: true,
        };
        let recv = RecvWr {
            wr_id: 40,
            ..RecvWr::default()
        };
        let (nic, mut a, mut b, lkey, keys) = setup(&mut src, &mut dst, 1);
        let k = super::super::next_rkey(keys[0]);
        b.post_mw(&[bind(9, 0, base + 16, 16, k)]).unwrap();
        let c = drain(&nic, &mut b);
        assert_eq!((c[0].wr_id, c[0].status), (9, 0));
        assert_eq!(c[0].opcode, ibv_wc_opcode::IBV_WC_BIND_MW);
        // SAFETY: src outlives the requests (this test).
        unsafe {
            b.post_recv(&[recv, recv]).unwrap();
            a.post_send(&[write(1, &src[..16], lkey, base + 16, k, true)])
                .unwrap();
        }
        assert_eq!(drain(&nic, &mut a)[0].status, 0);
        assert_eq!(&dst[16..32], &[7u8; 16][..]);
        let mut landed = 0;
        nic.borrow_mut().take_landed(|l| {
            assert_eq!((l.addr, l.len, l.rkey), (base + 16, 16, k));
            landed += 1;
        });
        assert_eq!(landed, 1);
        // Binding it again while valid: the device refuses.
        let k2 = super::super::next_rkey(k);
        b.post_mw(&[bind(10, 0, base, 16, k2)]).unwrap();
        let c = drain(&nic, &mut b);
        let e = c
            .iter()
            .find(|w| w.wr_id == 10)
            .expect("the bind's completion");
        assert_eq!(e.status, ibv_wc_status::IBV_WC_MW_BIND_ERR);
        assert!(nic.borrow().in_error(1));

        // One byte past the window: refused, both QPs in error, nothing
        // written.
        dst.fill(0);
        let (nic, mut a, mut b, lkey, keys) = setup(&mut src, &mut dst, 2);
        let k = super::super::next_rkey(keys[1]);
        b.post_mw(&[bind(9, 1, base, 16, k)]).unwrap();
        drain(&nic, &mut b);
        // SAFETY: as above.
        unsafe {
            b.post_recv(&[recv]).unwrap();
            a.post_send(&[write(1, &src[..16], lkey, base + 1, k, true)])
                .unwrap();
        }
        let c = drain(&nic, &mut a);
        assert_eq!(c[0].status, ibv_wc_status::IBV_WC_REM_ACCESS_ERR);
        assert!(nic.borrow().in_error(0) && nic.borrow().in_error(1));
        assert!(
            dst.iter().all(|&x| x == 0),
            "the target memory is untouched"
        );
        let c = drain(&nic, &mut b);
        assert_eq!(c[0].status, ibv_wc_status::IBV_WC_WR_FLUSH_ERR);

        // Invalidated: its key opens nothing; a stale key cannot
        // invalidate.
        let (nic, mut a, mut b, lkey, keys) = setup(&mut src, &mut dst, 3);
        let k = super::super::next_rkey(keys[0]);
        let inv = |wr_id, rkey| MwWr {
            wr_id,
            op: MwOp::Invalidate { rkey },
            signaled: true,
        };
        b.post_mw(&[bind(9, 0, base, 64, k), inv(11, k)]).unwrap();
        let c = drain(&nic, &mut b);
        assert_eq!(c.len(), 2);
        assert_eq!(c[1].opcode, ibv_wc_opcode::IBV_WC_LOCAL_INV);
        // SAFETY: as above.
        unsafe {
            b.post_recv(&[recv]).unwrap();
            a.post_send(&[write(1, &src[..16], lkey, base, k, true)])
                .unwrap();
        }
        assert_eq!(
            drain(&nic, &mut a)[0].status,
            ibv_wc_status::IBV_WC_REM_ACCESS_ERR
        );
        assert!(dst.iter().all(|&x| x == 0));
        let (nic, _a, mut b, _lkey, keys) = setup(&mut src, &mut dst, 4);
        b.post_mw(&[inv(12, keys[0] ^ 0x80)]).unwrap();
        assert_eq!(
            drain(&nic, &mut b)[0].status,
            ibv_wc_status::IBV_WC_LOC_QP_OP_ERR
        );
        assert_eq!(nic.borrow().stats.window_races, 0);
        nic.borrow().check_pools();
    }
}
