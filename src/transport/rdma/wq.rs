//! [`WorkQueue`]: the verbs-shaped interface the RDMA paths post and poll
//! work requests through — a chain of sends (RDMA WRITE / WRITE_WITH_IMM /
//! SEND, one doorbell) that may be refused part-way (`bad_wr`), a chain of
//! type 2 memory-window binds and invalidations (likewise), receives, and
//! the completion queue polled into a caller's fixed array — and
//! [`VerbsQueue`], its implementation over a real RC [`Qp`] and its [`Cq`]
//! (and the windows it was given).
//! The in-memory pair the tests run the same code over is `memverbs.rs`.
//!
//! The request types carry no verbs structures, so a backend that is not
//! the NIC can run them; the completions are the crate's own
//! [`WorkCompletion`] (status as `ibv_wc_status`, named by
//! [`super::wc_status_name`] and mapped to `Error::RdmaCompletion` by
//! [`WorkCompletion::check`]), whoever produced them.
//!
//! This module turns requests into `ibv_send_wr` chains and is one of the
//! few allowed `unsafe`.

use std::ptr;
use std::sync::Arc;

use rdma_sys::*;

use super::qp::{bind_mw_wr, local_inv_wr, Cq, Qp, WorkCompletion};
use super::verbs::{Mr, Mw};
use crate::error::Result;

/// What a send work request does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SendOp {
    /// RDMA WRITE: local bytes into the peer's memory; no receive consumed.
    Write,
    /// RDMA WRITE_WITH_IMM: as `Write`, and consumes one of the peer's
    /// receives, completing it with the immediate.
    WriteWithImm,
    /// SEND: into the buffer of the peer's next receive (a zero-length
    /// one references no memory: what a flush marker is).
    Send,
    /// SEND with an immediate.
    SendWithImm,
}

/// One send work request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SendWr {
    /// Returned in its completion.
    pub wr_id: u64,
    /// What it does.
    pub op: SendOp,
    /// Address of the local bytes.
    pub local_addr: u64,
    /// Bytes (0: none).
    pub len: u32,
    /// Local key of the region holding them (unused when `inline`).
    pub lkey: u32,
    /// Inline: the bytes are copied at post time, so the memory is free as
    /// soon as the post returns.
    pub inline: bool,
    /// Writes: where in the peer's memory.
    pub remote_addr: u64,
    /// Writes: the remote key the peer's memory is open under.
    pub rkey: u32,
    /// `*WithImm`: the immediate (host order).
    pub imm: u32,
    /// Whether it produces a completion when it succeeds (a failed or
    /// flushed request always does).
    pub signaled: bool,
}

impl SendWr {
    /// A request with every field zero: a zero-length, unsignalled SEND.
    pub const EMPTY: SendWr = SendWr {
        wr_id: 0,
        op: SendOp::Send,
        local_addr: 0,
        len: 0,
        lkey: 0,
        inline: false,
        remote_addr: 0,
        rkey: 0,
        imm: 0,
        signaled: false,
    };
}

/// What a memory-window request does. Windows are type 2: bound through
/// this QP, they open memory to this QP's peer only.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MwOp {
    /// Binds window `window` (an index among the windows the queue was
    /// given) to `len` bytes at `addr` of the region they bind over, for
    /// remote write, under `rkey`: the window's current key with its low 8
    /// bits advanced ([`super::next_rkey`]), so a key of an earlier bind
    /// opens nothing. The window must be free (new or invalidated): the
    /// device refuses to bind a valid type 2 window (`IBV_WC_MW_BIND_ERR`).
    Bind {
        /// The window.
        window: u32,
        /// The region it binds over: an index among the queue's regions
        /// (0: the one [`VerbsQueue::with_windows`] gave; others from
        /// [`VerbsQueue::set_region`]).
        region: u32,
        /// First byte.
        addr: u64,
        /// Bytes.
        len: u64,
        /// The key the peer will write under.
        rkey: u32,
    },
    /// Invalidates the window bound under `rkey`: once it completes, no
    /// write through that key lands.
    Invalidate {
        /// The key to revoke.
        rkey: u32,
    },
}

/// One memory-window request. It goes on the send queue and executes in
/// order with the sends posted before and after it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MwWr {
    /// Returned in its completion.
    pub wr_id: u64,
    /// What it does.
    pub op: MwOp,
    /// Whether it produces a completion when it succeeds (a failed or
    /// flushed request always does).
    pub signaled: bool,
}

/// One receive work request: a buffer for a SEND (`len` 0: none, enough
/// for a WRITE_WITH_IMM, which only consumes the receive).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RecvWr {
    /// Returned in its completion.
    pub wr_id: u64,
    /// The buffer's address.
    pub addr: u64,
    /// The buffer's bytes (0: no buffer).
    pub len: u32,
    /// Local key of the region holding the buffer.
    pub lkey: u32,
}

/// A post the provider refused at request `posted` of its chain (its
/// `bad_wr`): the requests before it are on the queue and complete like
/// any other (so what they reference must stay valid until then); that one
/// and the rest were not posted.
#[derive(Debug)]
pub struct PostError {
    /// How many requests of the chain were posted.
    pub posted: usize,
    /// The provider's errno (ENOMEM: the queue is full).
    pub error: std::io::Error,
}

/// A queue pair's send and receive queues and the completion queue they
/// complete to, as verbs shape them: posts are chains (one doorbell) that
/// may be taken in part, completions are polled into the caller's array.
/// Implementations allocate nothing per request.
pub trait WorkQueue {
    /// Posts `chain` in order.
    ///
    /// # Safety
    /// Memory a non-inline request references must stay valid (and, for a
    /// write's source, unchanged) until that request completes or a later
    /// request's completion covers it (the send queue completes in order),
    /// including when the QP is in error (then until its flush).
    unsafe fn post_send(&mut self, chain: &[SendWr]) -> std::result::Result<(), PostError>;

    /// Posts memory-window requests in order, as one chain that may be
    /// refused part-way like a send chain. They reference no local memory;
    /// the memory a bind opens was registered for it (its registration's
    /// contract covers the peer's writes there).
    fn post_mw(&mut self, chain: &[MwWr]) -> std::result::Result<(), PostError>;

    /// Posts receives in order.
    ///
    /// # Safety
    /// Each buffer must stay valid and be written only by the device until
    /// its receive completes.
    unsafe fn post_recv(&mut self, chain: &[RecvWr]) -> std::result::Result<(), PostError>;

    /// Moves up to `out.len()` completions into `out`, oldest first;
    /// returns how many.
    fn poll(&mut self, out: &mut [WorkCompletion]) -> Result<usize>;

    /// Asks for an event on the completion channel at the next completion
    /// (poll once more after: an earlier completion raises none).
    fn arm(&self) -> Result<()>;

    /// Moves the QP to the error state: nothing more is executed, and every
    /// request still queued completes (flushed, `IBV_WC_WR_FLUSH_ERR`).
    fn set_error(&mut self) -> Result<()>;
}

/// [`WorkQueue`] over a real RC queue pair and its (send and receive)
/// completion queue, and the memory windows it binds (if it was given any:
/// [`VerbsQueue::with_windows`]). The verbs request arrays are sized at
/// construction (`max_wr`, the QP's queue depth), so a post allocates
/// nothing.
pub struct VerbsQueue {
    /// The windows, declared before the QP so they are freed first:
    /// soft-RoCE (Linux 6.1) took 50.6 s to destroy a QP that 8 bound
    /// windows still referenced (measured in the VM; 0.5 ms to free the
    /// windows first), and a dead node's QP is destroyed on the network
    /// thread.
    mws: Vec<Mw>,
    /// The region the windows bind over (kept registered while they live).
    mw_regions: Vec<Option<Arc<Mr>>>,
    qp: Qp,
    cq: Arc<Cq>,
    sges: Vec<ibv_sge>,
    wrs: Vec<ibv_send_wr>,
    rwrs: Vec<ibv_recv_wr>,
}

// SAFETY: the verbs structures in the scratch arrays point only into those
// arrays or at the windows and region this queue owns (rebuilt on every
// post); the QP, CQ, windows and region are Send.
unsafe impl Send for VerbsQueue {}

impl VerbsQueue {
    /// The queues of `qp`, whose completions go to `cq`; at most `max_wr`
    /// requests per chain.
    pub fn new(qp: Qp, cq: Arc<Cq>, max_wr: usize) -> Self {
        VerbsQueue {
            mws: Vec::new(),
            mw_regions: Vec::new(),
            qp,
            cq,
            sges: Vec::with_capacity(max_wr),
            wrs: Vec::with_capacity(max_wr),
            rwrs: Vec::with_capacity(max_wr),
        }
    }

    /// Gives the queue `windows` (allocated on the QP's protection domain)
    /// to bind over `region` (registered [`super::Access::WindowsOnly`]):
    /// [`MwOp::Bind`] names them by their index here. Their current keys
    /// are [`Mw::rkey`].
    pub fn with_windows(mut self, region: Arc<Mr>, windows: Vec<Mw>) -> Self {
        self.mws = windows;
        self.mw_regions = vec![Some(region)];
        self
    }

    /// Sets region `k` that binds name ([`MwOp::Bind`]'s `region`), or
    /// clears it (`None`) once no window is bound over it: a node agent's
    /// shared link binds its windows over each attached rank's ring.
    pub fn set_region(&mut self, k: u32, region: Option<Arc<Mr>>) {
        let k = k as usize;
        if self.mw_regions.len() <= k {
            self.mw_regions.resize(k + 1, None);
        }
        self.mw_regions[k] = region;
    }
}

/// The verbs form of `w`, its bytes described by `sge` (unused when it
/// has none); `next` is left for the chain to link.
fn send_wr(w: &SendWr, sge: *mut ibv_sge) -> ibv_send_wr {
    // SAFETY: plain data.
    let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
    wr.wr_id = w.wr_id;
    if w.len > 0 {
        wr.sg_list = sge;
        wr.num_sge = 1;
    }
    let mut flags = if w.signaled {
        ibv_send_flags::IBV_SEND_SIGNALED.0
    } else {
        0
    };
    if w.inline {
        flags |= ibv_send_flags::IBV_SEND_INLINE.0;
    }
    wr.send_flags = flags;
    wr.opcode = match w.op {
        SendOp::Write => ibv_wr_opcode::IBV_WR_RDMA_WRITE,
        SendOp::WriteWithImm => ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM,
        SendOp::Send => ibv_wr_opcode::IBV_WR_SEND,
        SendOp::SendWithImm => ibv_wr_opcode::IBV_WR_SEND_WITH_IMM,
    };
    if matches!(w.op, SendOp::WriteWithImm | SendOp::SendWithImm) {
        wr.imm_data_invalidated_rkey_union.imm_data = w.imm.to_be();
    }
    if matches!(w.op, SendOp::Write | SendOp::WriteWithImm) {
        wr.wr.rdma.remote_addr = w.remote_addr;
        wr.wr.rdma.rkey = w.rkey;
    }
    wr
}

impl WorkQueue for VerbsQueue {
    unsafe fn post_send(&mut self, chain: &[SendWr]) -> std::result::Result<(), PostError> {
        self.sges.clear();
        self.wrs.clear();
        // Every SGE first, so none moves once a request points at it.
        for w in chain {
            self.sges.push(ibv_sge {
                addr: w.local_addr,
                length: w.len,
                lkey: w.lkey,
            });
        }
        for (i, w) in chain.iter().enumerate() {
            let sge: *mut ibv_sge = &mut self.sges[i];
            self.wrs.push(send_wr(w, sge));
        }
        // SAFETY: the SGEs outlive the call; inline data is copied during
        // it; the rest per this function's contract.
        unsafe { self.qp.post_chain_counted(&mut self.wrs) }
            .map_err(|(posted, error)| PostError { posted, error })
    }

    fn post_mw(&mut self, chain: &[MwWr]) -> std::result::Result<(), PostError> {
        self.wrs.clear();
        for w in chain {
            let mut wr = match w.op {
                MwOp::Bind {
                    window,
                    region,
                    addr,
                    len,
                    rkey,
                } => {
                    let region = self
                        .mw_regions
                        .get(region as usize)
                        .and_then(Option::as_ref);
                    let (Some(mw), Some(mr)) = (self.mws.get(window as usize), region) else {
                        // A caller bug: nothing of the chain is posted.
                        return Err(PostError {
                            posted: 0,
                            error: std::io::Error::from_raw_os_error(libc::EINVAL),
                        });
                    };
                    bind_mw_wr(w.wr_id, mw, mr, addr, len, rkey)
                }
                MwOp::Invalidate { rkey } => local_inv_wr(w.wr_id, rkey),
            };
            if w.signaled {
                wr.send_flags = ibv_send_flags::IBV_SEND_SIGNALED.0;
            }
            self.wrs.push(wr);
        }
        // SAFETY: the windows and their region live in this queue, freed
        // after the QP is done with them (field order); binds reference no
        // other memory, and the memory they open was registered for it.
        let res = unsafe { self.qp.post_chain_counted(&mut self.wrs) };
        let posted = res.as_ref().map_or_else(|(k, _)| *k, |()| chain.len());
        // A bind posted names the window by the key it gets: the next
        // request on that window must name it so (see Mw::set_rkey).
        for w in &chain[..posted] {
            if let MwOp::Bind { window, rkey, .. } = w.op {
                self.mws[window as usize].set_rkey(rkey);
            }
        }
        res.map_err(|(posted, error)| PostError { posted, error })
    }

    unsafe fn post_recv(&mut self, chain: &[RecvWr]) -> std::result::Result<(), PostError> {
        self.sges.clear();
        self.rwrs.clear();
        for r in chain {
            self.sges.push(ibv_sge {
                addr: r.addr,
                length: r.len,
                lkey: r.lkey,
            });
        }
        for (i, r) in chain.iter().enumerate() {
            let (sg, num) = if r.len > 0 {
                (&mut self.sges[i] as *mut ibv_sge, 1)
            } else {
                (ptr::null_mut(), 0)
            };
            self.rwrs.push(ibv_recv_wr {
                wr_id: r.wr_id,
                next: ptr::null_mut(),
                sg_list: sg,
                num_sge: num,
            });
        }
        // SAFETY: the SGEs outlive the call; the buffers per this
        // function's contract.
        unsafe { self.qp.post_recv_chain_counted(&mut self.rwrs) }
            .map_err(|(posted, error)| PostError { posted, error })
    }

    fn poll(&mut self, out: &mut [WorkCompletion]) -> Result<usize> {
        self.cq.poll(out)
    }

    fn arm(&self) -> Result<()> {
        self.cq.arm()
    }

    fn set_error(&mut self) -> Result<()> {
        self.qp.set_error()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The requests RdmaLink posts become the verbs requests it built
    /// before this interface: a WRITE_WITH_IMM (remote address and key,
    /// big-endian immediate, one SGE), an inline SEND_WITH_IMM, and the
    /// flush marker (a signalled SEND with no SGE).
    #[test]
    fn send_requests_map_to_the_verbs_requests() {
        let mut sge = ibv_sge {
            addr: 0,
            length: 0,
            lkey: 0,
        };
        let p: *mut ibv_sge = &mut sge;
        let write = SendWr {
            wr_id: 7,
            op: SendOp::WriteWithImm,
            local_addr: 0x1000,
            len: 64,
            lkey: 3,
            inline: false,
            remote_addr: 0x9000,
            rkey: 0x55,
            imm: 0x0102_0304,
            signaled: true,
        };
        let wr = send_wr(&write, p);
        assert_eq!(wr.wr_id, 7);
        assert_eq!(wr.opcode, ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM);
        assert_eq!((wr.sg_list, wr.num_sge), (p, 1));
        assert_eq!(wr.send_flags, ibv_send_flags::IBV_SEND_SIGNALED.0);
        // SAFETY: the fields this opcode uses.
        unsafe {
            assert_eq!(wr.imm_data_invalidated_rkey_union.imm_data, 0x0403_0201);
            assert_eq!((wr.wr.rdma.remote_addr, wr.wr.rdma.rkey), (0x9000, 0x55));
        }
        assert!(wr.next.is_null());

        let error = SendWr {
            op: SendOp::SendWithImm,
            inline: true,
            signaled: false,
            ..write
        };
        let wr = send_wr(&error, p);
        assert_eq!(wr.opcode, ibv_wr_opcode::IBV_WR_SEND_WITH_IMM);
        assert_eq!(wr.send_flags, ibv_send_flags::IBV_SEND_INLINE.0);
        assert_eq!(wr.num_sge, 1);

        let marker = SendWr {
            wr_id: u64::MAX - 1,
            signaled: true,
            ..SendWr::EMPTY
        };
        let wr = send_wr(&marker, p);
        assert_eq!(wr.opcode, ibv_wr_opcode::IBV_WR_SEND);
        assert_eq!((wr.sg_list, wr.num_sge), (std::ptr::null_mut(), 0));
        assert_eq!(wr.send_flags, ibv_send_flags::IBV_SEND_SIGNALED.0);
    }
}
