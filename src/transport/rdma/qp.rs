//! Queues: completion channels, completion queues and the work completions
//! they return, and the RC queue pair (creation, connection INIT → RTR →
//! RTS, receives, memory-window operations and write chains).
//!
//! This module owns verbs resources and is one of the few allowed `unsafe`.

use std::ptr;
use std::sync::Arc;

use rdma_sys::*;

use super::verbs::{os_err, Context, Mr, Mw, Pd, WindowOp};
use crate::error::{Error, Result};

/// Local ACK timeout, as the verbs exponent: 4.096 µs × 2^14 = 67 ms per
/// try. With [`RETRY_CNT`] retries a write to a peer that answers nothing
/// (its host died, its port is gone) fails with `IBV_WC_RETRY_EXC_ERR`
/// after (7 + 1) × 67 ms ≈ 0.54 s (checked by this file's tests), so an owner frees
/// a dead consumer's staging in well under a second.
const ACK_TIMEOUT_EXP: u8 = 14;
/// Retransmissions before a write to a silent peer fails (the most verbs
/// allow).
const RETRY_CNT: u8 = 7;
/// Receiver-not-ready retries: 7 means "retry for ever". A peer that
/// answers RNR is alive but has no receive posted (a consumer that is
/// stopped or slow); that is the owner's stall timeout to judge, not a
/// failure of the link.
const RNR_RETRY_INFINITE: u8 = 7;
/// The RNR NAK delay this end asks of a sender (12: 0.64 ms).
const MIN_RNR_TIMER: u8 = 12;

/// What the other end of an RC connection needs: queue pair number, first
/// packet sequence number, GID — the content of an RDMA_ENDPOINT frame, so
/// an endpoint goes on the wire as it is.
/// The name of a work completion status (`IBV_WC_REM_ACCESS_ERR`...).
pub fn wc_status_name(status: u32) -> &'static str {
    use ibv_wc_status::*;
    match status {
        IBV_WC_SUCCESS => "IBV_WC_SUCCESS",
        IBV_WC_LOC_LEN_ERR => "IBV_WC_LOC_LEN_ERR",
        IBV_WC_LOC_QP_OP_ERR => "IBV_WC_LOC_QP_OP_ERR",
        IBV_WC_LOC_EEC_OP_ERR => "IBV_WC_LOC_EEC_OP_ERR",
        IBV_WC_LOC_PROT_ERR => "IBV_WC_LOC_PROT_ERR",
        IBV_WC_WR_FLUSH_ERR => "IBV_WC_WR_FLUSH_ERR",
        IBV_WC_MW_BIND_ERR => "IBV_WC_MW_BIND_ERR",
        IBV_WC_BAD_RESP_ERR => "IBV_WC_BAD_RESP_ERR",
        IBV_WC_LOC_ACCESS_ERR => "IBV_WC_LOC_ACCESS_ERR",
        IBV_WC_REM_INV_REQ_ERR => "IBV_WC_REM_INV_REQ_ERR",
        IBV_WC_REM_ACCESS_ERR => "IBV_WC_REM_ACCESS_ERR",
        IBV_WC_REM_OP_ERR => "IBV_WC_REM_OP_ERR",
        IBV_WC_RETRY_EXC_ERR => "IBV_WC_RETRY_EXC_ERR",
        IBV_WC_RNR_RETRY_EXC_ERR => "IBV_WC_RNR_RETRY_EXC_ERR",
        IBV_WC_LOC_RDD_VIOL_ERR => "IBV_WC_LOC_RDD_VIOL_ERR",
        IBV_WC_REM_INV_RD_REQ_ERR => "IBV_WC_REM_INV_RD_REQ_ERR",
        IBV_WC_REM_ABORT_ERR => "IBV_WC_REM_ABORT_ERR",
        IBV_WC_INV_EECN_ERR => "IBV_WC_INV_EECN_ERR",
        IBV_WC_INV_EEC_STATE_ERR => "IBV_WC_INV_EEC_STATE_ERR",
        IBV_WC_FATAL_ERR => "IBV_WC_FATAL_ERR",
        IBV_WC_RESP_TIMEOUT_ERR => "IBV_WC_RESP_TIMEOUT_ERR",
        IBV_WC_GENERAL_ERR => "IBV_WC_GENERAL_ERR",
        _ => "IBV_WC_UNKNOWN",
    }
}

/// A completion channel: one file descriptor that becomes readable when an
/// armed completion queue attached to it gets a completion, so a thread can
/// sleep in its io_uring instead of spinning on the CQs.
pub struct CompChannel {
    ch: *mut ibv_comp_channel,
    _ctx: Arc<Context>,
}

// SAFETY: verbs objects may be used from any thread (callers serialise).
unsafe impl Send for CompChannel {}
// SAFETY: as above.
unsafe impl Sync for CompChannel {}

impl CompChannel {
    /// Creates a channel whose descriptor is non-blocking.
    pub fn new(ctx: &Arc<Context>) -> Result<Arc<CompChannel>> {
        // SAFETY: live context.
        let ch = unsafe { ibv_create_comp_channel(ctx.ctx) };
        if ch.is_null() {
            return Err(os_err("create completion channel", ctx.name.as_str()));
        }
        let c = CompChannel {
            ch,
            _ctx: ctx.clone(),
        };
        let fd = c.fd();
        // SAFETY: fcntl on a descriptor the channel owns.
        let ok = unsafe {
            let fl = libc::fcntl(fd, libc::F_GETFL);
            fl >= 0 && libc::fcntl(fd, libc::F_SETFL, fl | libc::O_NONBLOCK) == 0
        };
        if !ok {
            return Err(os_err("completion channel", "O_NONBLOCK"));
        }
        Ok(Arc::new(c))
    }

    /// The descriptor to poll for readability.
    pub fn fd(&self) -> i32 {
        // SAFETY: live channel.
        unsafe { (*self.ch).fd }
    }

    /// Takes and acknowledges every pending event; returns how many. The CQs
    /// that had one must be re-armed ([`Cq::arm`]) before sleeping again.
    pub fn drain(&self) -> usize {
        let mut n = 0;
        loop {
            let mut cq = ptr::null_mut();
            let mut user = ptr::null_mut();
            // SAFETY: live channel, valid out-pointers; non-blocking fd.
            if unsafe { ibv_get_cq_event(self.ch, &mut cq, &mut user) } != 0 {
                return n;
            }
            // SAFETY: cq was returned by the event and is live (a CQ is
            // destroyed only after its events are acknowledged, here).
            unsafe { ibv_ack_cq_events(cq, 1) };
            n += 1;
        }
    }
}

impl Drop for CompChannel {
    fn drop(&mut self) {
        // SAFETY: every CQ attached holds an Arc to this channel, so they
        // are destroyed already.
        unsafe { ibv_destroy_comp_channel(self.ch) };
    }
}

/// A completion queue.
pub struct Cq {
    pub(super) cq: *mut ibv_cq,
    _channel: Option<Arc<CompChannel>>,
    _ctx: Arc<Context>,
}

// SAFETY: verbs objects may be used from any thread (callers serialise polls).
unsafe impl Send for Cq {}
// SAFETY: as above.
unsafe impl Sync for Cq {}

impl Cq {
    /// Creates a completion queue of `entries`.
    pub fn new(ctx: &Arc<Context>, entries: i32) -> Result<Arc<Cq>> {
        Self::create(ctx, entries, None)
    }

    /// Creates a completion queue of `entries` whose completions, once
    /// armed, wake `channel`.
    pub fn with_channel(
        ctx: &Arc<Context>,
        entries: i32,
        channel: &Arc<CompChannel>,
    ) -> Result<Arc<Cq>> {
        Self::create(ctx, entries, Some(channel))
    }

    fn create(
        ctx: &Arc<Context>,
        entries: i32,
        channel: Option<&Arc<CompChannel>>,
    ) -> Result<Arc<Cq>> {
        let ch = channel.map_or(ptr::null_mut(), |c| c.ch);
        // SAFETY: live context; the channel, if any, is live and kept alive
        // by the Arc stored below; no context pointer.
        let cq = unsafe { ibv_create_cq(ctx.ctx, entries, ptr::null_mut(), ch, 0) };
        if cq.is_null() {
            return Err(os_err("create CQ", format!("{entries} entries")));
        }
        Ok(Arc::new(Cq {
            cq,
            _channel: channel.cloned(),
            _ctx: ctx.clone(),
        }))
    }

    /// Asks for one event on the channel at the next completion. Poll once
    /// more after arming: a completion that came in before it raises none.
    pub fn arm(&self) -> Result<()> {
        // SAFETY: live CQ.
        let rc = unsafe { ibv_req_notify_cq(self.cq, 0) };
        if rc != 0 {
            return Err(Error::Rdma {
                op: "arm CQ",
                detail: std::io::Error::from_raw_os_error(rc).to_string(),
            });
        }
        Ok(())
    }

    /// Polls up to `out.len()` (at most 32 per call) completions; returns
    /// how many.
    pub fn poll(&self, out: &mut [WorkCompletion]) -> Result<usize> {
        // SAFETY: ibv_wc is plain data.
        let mut wc: [ibv_wc; 32] = unsafe { std::mem::zeroed() };
        let want = out.len().min(wc.len()) as i32;
        // SAFETY: live CQ; wc has `want` entries.
        let n = unsafe { ibv_poll_cq(self.cq, want, wc.as_mut_ptr()) };
        if n < 0 {
            return Err(os_err("poll CQ", "ibv_poll_cq"));
        }
        for (o, w) in out.iter_mut().zip(&wc[..n as usize]) {
            let with_imm = w.wc_flags & ibv_wc_flags::IBV_WC_WITH_IMM.0 != 0;
            *o = WorkCompletion {
                wr_id: w.wr_id,
                status: w.status,
                opcode: w.opcode,
                byte_len: w.byte_len,
                // SAFETY: with IBV_WC_WITH_IMM the union holds imm_data.
                imm: with_imm
                    .then(|| u32::from_be(unsafe { w.imm_data_invalidated_rkey_union.imm_data })),
                vendor_err: w.vendor_err,
                qp_num: w.qp_num,
            };
        }
        Ok(n as usize)
    }
}

impl Drop for Cq {
    fn drop(&mut self) {
        // SAFETY: every QP using this CQ holds an Arc to it, so they are gone.
        unsafe { ibv_destroy_cq(self.cq) };
    }
}

pub use crate::transport::proto::RdmaEndpoint as Endpoint;

/// An RC queue pair.
pub struct Qp {
    qp: *mut ibv_qp,
    ctx: Arc<Context>,
    _pd: Arc<Pd>,
    _send_cq: Arc<Cq>,
    _recv_cq: Arc<Cq>,
    /// The shared receive queue it receives from, if any (kept alive:
    /// `srq.rs`, which makes such QPs).
    _srq: Option<Arc<dyn Send + Sync>>,
    psn: u32,
    sgid_index: u8,
    sgid: [u8; 16],
}

// SAFETY: verbs QPs may be used from any thread (callers serialise posts).
unsafe impl Send for Qp {}

impl Qp {
    /// Creates an RC QP (state RESET → INIT).
    pub fn new(
        pd: &Arc<Pd>,
        send_cq: &Arc<Cq>,
        recv_cq: &Arc<Cq>,
        max_wr: u32,
        max_inline: u32,
    ) -> Result<Qp> {
        Self::create(pd, send_cq, recv_cq, None, max_wr, max_inline)
    }

    /// Creates an RC QP (state RESET → INIT); with `srq` (the SRQ and
    /// what keeps it alive as long as the QP) it has no receive queue of
    /// its own.
    pub(super) fn create(
        pd: &Arc<Pd>,
        send_cq: &Arc<Cq>,
        recv_cq: &Arc<Cq>,
        srq: Option<(*mut ibv_srq, Arc<dyn Send + Sync>)>,
        max_wr: u32,
        max_inline: u32,
    ) -> Result<Qp> {
        // SAFETY: plain data.
        let mut init: ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        init.send_cq = send_cq.cq;
        init.recv_cq = recv_cq.cq;
        init.srq = srq.as_ref().map_or(ptr::null_mut(), |s| s.0);
        init.qp_type = ibv_qp_type::IBV_QPT_RC;
        init.sq_sig_all = 0;
        init.cap.max_send_wr = max_wr;
        init.cap.max_recv_wr = if srq.is_some() { 0 } else { max_wr };
        let keep_srq = srq.map(|s| s.1);
        init.cap.max_send_sge = 1;
        init.cap.max_recv_sge = 1;
        init.cap.max_inline_data = max_inline;
        // SAFETY: live PD, valid attributes.
        let qp = unsafe { ibv_create_qp(pd.pd, &mut init) };
        if qp.is_null() {
            return Err(os_err("create QP", format!("{max_wr} work requests")));
        }
        let q = Qp {
            qp,
            ctx: pd.ctx.clone(),
            _pd: pd.clone(),
            _send_cq: send_cq.clone(),
            _recv_cq: recv_cq.clone(),
            _srq: keep_srq,
            // SAFETY: qp is live. Any 24-bit value is a valid PSN.
            psn: (unsafe { (*qp).qp_num }).wrapping_mul(2_654_435_761) & 0xff_ffff,
            sgid_index: pd.ctx.gid_index,
            sgid: pd.ctx.gid,
        };
        // SAFETY: plain data.
        let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ibv_qp_state::IBV_QPS_INIT;
        a.pkey_index = 0;
        a.port_num = q.ctx.port;
        a.qp_access_flags = ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0;
        q.modify(
            &mut a,
            ibv_qp_attr_mask::IBV_QP_STATE
                | ibv_qp_attr_mask::IBV_QP_PKEY_INDEX
                | ibv_qp_attr_mask::IBV_QP_PORT
                | ibv_qp_attr_mask::IBV_QP_ACCESS_FLAGS,
            "INIT",
        )?;
        Ok(q)
    }

    fn modify(&self, a: &mut ibv_qp_attr, mask: ibv_qp_attr_mask, to: &str) -> Result<()> {
        // SAFETY: live QP, valid attributes for the mask.
        let rc = unsafe { ibv_modify_qp(self.qp, a, mask.0 as i32) };
        if rc != 0 {
            return Err(Error::Rdma {
                op: "modify QP",
                detail: format!("to {to}: {}", std::io::Error::from_raw_os_error(rc)),
            });
        }
        Ok(())
    }

    /// Uses the GID at `index` (value `gid`) as this end's address instead
    /// of the context's default; before [`Qp::endpoint`] and [`Qp::connect`].
    pub fn use_gid(&mut self, index: u8, gid: [u8; 16]) {
        self.sgid_index = index;
        self.sgid = gid;
    }

    /// Its number (what its completions' `qp_num` says).
    pub fn qp_num(&self) -> u32 {
        // SAFETY: live QP.
        unsafe { (*self.qp).qp_num }
    }

    /// This end, to send to the peer.
    pub fn endpoint(&self) -> Endpoint {
        Endpoint {
            // SAFETY: live QP.
            qpn: unsafe { (*self.qp).qp_num },
            psn: self.psn,
            gid: self.sgid,
        }
    }

    /// Moves the QP to the error state: nothing more is sent or accepted
    /// from the peer, and every posted request completes with
    /// `IBV_WC_WR_FLUSH_ERR`.
    pub fn set_error(&self) -> Result<()> {
        // SAFETY: plain data.
        let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ibv_qp_state::IBV_QPS_ERR;
        self.modify(&mut a, ibv_qp_attr_mask::IBV_QP_STATE, "ERR")
    }

    /// Connects to `remote`: INIT → RTR → RTS.
    pub fn connect(&self, remote: &Endpoint) -> Result<()> {
        // SAFETY: plain data.
        let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ibv_qp_state::IBV_QPS_RTR;
        a.path_mtu = self.ctx.mtu;
        a.dest_qp_num = remote.qpn;
        a.rq_psn = remote.psn;
        a.max_dest_rd_atomic = 1;
        a.min_rnr_timer = MIN_RNR_TIMER;
        a.ah_attr.is_global = 1;
        a.ah_attr.port_num = self.ctx.port;
        a.ah_attr.grh.dgid.raw = remote.gid;
        a.ah_attr.grh.sgid_index = self.sgid_index;
        a.ah_attr.grh.hop_limit = 64;
        self.modify(
            &mut a,
            ibv_qp_attr_mask::IBV_QP_STATE
                | ibv_qp_attr_mask::IBV_QP_AV
                | ibv_qp_attr_mask::IBV_QP_PATH_MTU
                | ibv_qp_attr_mask::IBV_QP_DEST_QPN
                | ibv_qp_attr_mask::IBV_QP_RQ_PSN
                | ibv_qp_attr_mask::IBV_QP_MAX_DEST_RD_ATOMIC
                | ibv_qp_attr_mask::IBV_QP_MIN_RNR_TIMER,
            "RTR",
        )?;
        // SAFETY: plain data.
        let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ibv_qp_state::IBV_QPS_RTS;
        a.timeout = ACK_TIMEOUT_EXP;
        a.retry_cnt = RETRY_CNT;
        a.rnr_retry = RNR_RETRY_INFINITE;
        a.sq_psn = self.psn;
        a.max_rd_atomic = 1;
        self.modify(
            &mut a,
            ibv_qp_attr_mask::IBV_QP_STATE
                | ibv_qp_attr_mask::IBV_QP_TIMEOUT
                | ibv_qp_attr_mask::IBV_QP_RETRY_CNT
                | ibv_qp_attr_mask::IBV_QP_RNR_RETRY
                | ibv_qp_attr_mask::IBV_QP_SQ_PSN
                | ibv_qp_attr_mask::IBV_QP_MAX_QP_RD_ATOMIC,
            "RTS",
        )
    }

    /// Posts receives (for WRITE_WITH_IMM completions: no buffer needed),
    /// one chain of `n` with ids `first_id..`.
    pub fn post_recvs(&self, first_id: u64, n: usize, wrs: &mut Vec<ibv_recv_wr>) -> Result<()> {
        let mut sges = Vec::new();
        self.post_recvs_into(first_id, n, None, &mut sges, wrs)
    }

    /// Posts `n` receives, each with a `slot`-byte buffer from `buf` (slot i
    /// at `base + i * slot`) when given: what SENDs (ERROR messages) need.
    pub fn post_recvs_into(
        &self,
        first_id: u64,
        n: usize,
        buf: Option<(&Mr, u64, u32)>,
        sges: &mut Vec<ibv_sge>,
        wrs: &mut Vec<ibv_recv_wr>,
    ) -> Result<()> {
        wrs.clear();
        sges.clear();
        if let Some((mr, base, slot)) = buf {
            for i in 0..n {
                sges.push(ibv_sge {
                    addr: base + i as u64 * slot as u64,
                    length: slot,
                    lkey: mr.lkey(),
                });
            }
        }
        for i in 0..n {
            let (sg, num) = match sges.get_mut(i) {
                Some(s) => (s as *mut ibv_sge, 1),
                None => (ptr::null_mut(), 0),
            };
            wrs.push(ibv_recv_wr {
                wr_id: first_id + i as u64,
                next: ptr::null_mut(),
                sg_list: sg,
                num_sge: num,
            });
        }
        for i in 0..n.saturating_sub(1) {
            let next: *mut ibv_recv_wr = &mut wrs[i + 1];
            wrs[i].next = next;
        }
        if n == 0 {
            return Ok(());
        }
        let mut bad = ptr::null_mut();
        // SAFETY: live QP; a well-formed chain that outlives the call.
        let rc = unsafe { ibv_post_recv(self.qp, wrs.as_mut_ptr(), &mut bad) };
        if rc != 0 {
            return Err(Error::Rdma {
                op: "post receives",
                detail: std::io::Error::from_raw_os_error(rc).to_string(),
            });
        }
        Ok(())
    }

    /// Posts memory-window binds and invalidations as one chain (one
    /// doorbell), in order; each is (wr_id, signalled, op). The send queue
    /// executes them in order with anything posted before or after.
    pub fn post_window_ops(
        &self,
        ops: &[(u64, bool, WindowOp<'_>)],
        wrs: &mut Vec<ibv_send_wr>,
    ) -> Result<()> {
        wrs.clear();
        for (id, signaled, op) in ops {
            let mut wr = match op {
                WindowOp::Bind {
                    mw,
                    mr,
                    addr,
                    len,
                    rkey,
                } => bind_mw_wr(*id, mw, mr, *addr, *len, *rkey),
                WindowOp::Invalidate { rkey } => local_inv_wr(*id, *rkey),
            };
            if *signaled {
                wr.send_flags = ibv_send_flags::IBV_SEND_SIGNALED.0;
            }
            wrs.push(wr);
        }
        // SAFETY: the windows and region are live (borrowed for the call,
        // and the caller keeps them alive while bound); nothing else is
        // referenced.
        unsafe { self.post_chain(wrs) }.map_err(|e| Error::Rdma {
            op: "post window operations",
            detail: e.to_string(),
        })
    }

    /// Posts a chain of RDMA WRITE_WITH_IMM work requests (one doorbell),
    /// signalling only the last. Each is (wr_id, local address, length,
    /// remote address, immediate).
    ///
    /// # Safety
    /// Each local range must lie in `mr` and stay valid until the chain's
    /// completion; the remote ranges are the peer's to police (its MR).
    pub unsafe fn post_writes(
        &self,
        mr: &Mr,
        rkey: u32,
        writes: &[(u64, *const u8, u32, u64, u32)],
        sges: &mut Vec<ibv_sge>,
        wrs: &mut Vec<ibv_send_wr>,
    ) -> Result<()> {
        sges.clear();
        wrs.clear();
        for &(_, addr, len, _, _) in writes {
            sges.push(ibv_sge {
                addr: addr as u64,
                length: len,
                lkey: mr.lkey(),
            });
        }
        for (i, &(id, _, _, remote, imm)) in writes.iter().enumerate() {
            // SAFETY: plain data.
            let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
            wr.wr_id = id;
            wr.sg_list = &mut sges[i];
            wr.num_sge = 1;
            wr.opcode = ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM;
            wr.send_flags = if i + 1 == writes.len() {
                ibv_send_flags::IBV_SEND_SIGNALED.0
            } else {
                0
            };
            wr.imm_data_invalidated_rkey_union.imm_data = imm.to_be();
            wr.wr.rdma.remote_addr = remote;
            wr.wr.rdma.rkey = rkey;
            wrs.push(wr);
        }
        // SAFETY: the SGEs (in `sges`) outlive the call; the local memory
        // per this function's contract.
        unsafe { self.post_chain(wrs) }.map_err(|e| Error::Rdma {
            op: "post writes",
            detail: e.to_string(),
        })
    }

    /// Links `wrs` into one chain and posts it (one doorbell); nothing when
    /// empty. Returns the provider's errno on failure.
    ///
    /// # Safety
    /// As for [`Qp::post_chain_counted`].
    pub(super) unsafe fn post_chain(&self, wrs: &mut [ibv_send_wr]) -> std::io::Result<()> {
        // SAFETY: forwarded contract.
        unsafe { self.post_chain_counted(wrs) }.map_err(|(_, e)| e)
    }

    /// As [`Qp::post_chain`], but a failure also says how many requests of
    /// the chain the provider accepted before the one it refused (its
    /// `bad_wr`): those are on the send queue and complete like any other,
    /// so what they reference must stay valid until then.
    ///
    /// # Safety
    /// Every request must be well formed, and whatever it references (SGEs,
    /// local memory, windows, regions) valid for the call and, for memory
    /// the device reads or writes, until the request completes.
    pub(super) unsafe fn post_chain_counted(
        &self,
        wrs: &mut [ibv_send_wr],
    ) -> std::result::Result<(), (usize, std::io::Error)> {
        if wrs.is_empty() {
            return Ok(());
        }
        for i in 0..wrs.len() - 1 {
            let next: *mut ibv_send_wr = &mut wrs[i + 1];
            wrs[i].next = next;
        }
        let mut bad: *mut ibv_send_wr = ptr::null_mut();
        // SAFETY: live QP (owned by self); the chain lives in `wrs` for the
        // call; what the requests reference, per this function's contract.
        let rc = unsafe { ibv_post_send(self.qp, wrs.as_mut_ptr(), &mut bad) };
        if rc != 0 {
            return Err((
                accepted_before(wrs, bad),
                std::io::Error::from_raw_os_error(rc),
            ));
        }
        Ok(())
    }
    /// Links `wrs` into one chain of receives and posts it; a failure says
    /// how many were posted before the one refused (`bad_wr`).
    ///
    /// # Safety
    /// Each buffer must stay valid, and be written only by the device,
    /// until its receive completes.
    pub(super) unsafe fn post_recv_chain_counted(
        &self,
        wrs: &mut [ibv_recv_wr],
    ) -> std::result::Result<(), (usize, std::io::Error)> {
        if wrs.is_empty() {
            return Ok(());
        }
        for i in 0..wrs.len() - 1 {
            let next: *mut ibv_recv_wr = &mut wrs[i + 1];
            wrs[i].next = next;
        }
        let mut bad: *mut ibv_recv_wr = ptr::null_mut();
        // SAFETY: live QP; the chain lives in `wrs` for the call; the
        // buffers per this function's contract.
        let rc = unsafe { ibv_post_recv(self.qp, wrs.as_mut_ptr(), &mut bad) };
        if rc != 0 {
            return Err((
                accepted_before(wrs, bad),
                std::io::Error::from_raw_os_error(rc),
            ));
        }
        Ok(())
    }
}

/// An unsignalled request binding type 2 window `mw` to `len` bytes at
/// `addr` of `mr` for remote write by the QP's peer, under `rkey`.
pub(super) fn bind_mw_wr(
    wr_id: u64,
    mw: &Mw,
    mr: &Mr,
    addr: u64,
    len: u64,
    rkey: u32,
) -> ibv_send_wr {
    // SAFETY: plain data.
    let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
    wr.wr_id = wr_id;
    wr.opcode = ibv_wr_opcode::IBV_WR_BIND_MW;
    wr.bind_mw_tso_union.bind_mw = bind_mw_t {
        mw: mw.mw,
        rkey,
        bind_info: ibv_mw_bind_info {
            mr: mr.mr,
            addr,
            length: len,
            mw_access_flags: ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0,
        },
    };
    wr
}

/// An unsignalled request invalidating the window bound under `rkey`.
pub(super) fn local_inv_wr(wr_id: u64, rkey: u32) -> ibv_send_wr {
    // SAFETY: plain data.
    let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
    wr.wr_id = wr_id;
    wr.opcode = ibv_wr_opcode::IBV_WR_LOCAL_INV;
    wr.imm_data_invalidated_rkey_union.invalidated_rkey = rkey;
    wr
}

/// How many requests of the chain `wrs` precede `bad` (the one the provider
/// refused): those were posted. A `bad` that is null or outside the chain
/// (a provider that does not set it) counts as the whole chain posted: the
/// safe side, since memory wrongly thought posted is only held longer.
pub(super) fn accepted_before<T>(wrs: &[T], bad: *const T) -> usize {
    let base = wrs.as_ptr() as usize;
    let at = bad as usize;
    let size = std::mem::size_of::<T>();
    if at < base || at >= base + std::mem::size_of_val(wrs) || !(at - base).is_multiple_of(size) {
        return wrs.len();
    }
    (at - base) / size
}

impl Drop for Qp {
    fn drop(&mut self) {
        // SAFETY: created once, destroyed once, before its PD and CQs (which
        // this QP keeps alive through its Arcs).
        unsafe { ibv_destroy_qp(self.qp) };
    }
}

/// One work completion, copied out of the CQ.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WorkCompletion {
    /// The work request id.
    pub wr_id: u64,
    /// Status (0 = success; [`wc_status_name`] names the others).
    pub status: u32,
    /// Opcode (`ibv_wc_opcode`).
    pub opcode: u32,
    /// Bytes (for receives, those written by the peer's WRITE_WITH_IMM).
    pub byte_len: u32,
    /// The immediate data, host order (the grant id), when present.
    pub imm: Option<u32>,
    /// Vendor error code.
    pub vendor_err: u32,
    /// The queue pair it completed for (what names the link of a receive
    /// from a shared receive queue).
    pub qp_num: u32,
}

impl WorkCompletion {
    /// Ok, or the named error for a failed completion.
    pub fn check(&self) -> Result<()> {
        if self.status == ibv_wc_status::IBV_WC_SUCCESS {
            Ok(())
        } else {
            Err(completion_error(self))
        }
    }
}

/// The named error for a failed work completion.
pub fn completion_error(wc: &WorkCompletion) -> Error {
    Error::RdmaCompletion {
        wr_id: wc.wr_id,
        status: wc_status_name(wc.status),
        vendor_err: wc.vendor_err,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A write to a dead peer fails within a second: (retries + 1) ×
    /// 4.096 µs × 2^timeout, from the attributes `connect` sets.
    #[test]
    fn a_dead_peer_is_reported_within_a_second() {
        let per_try_ns = 4096u64 << ACK_TIMEOUT_EXP;
        let bound = std::time::Duration::from_nanos(per_try_ns * (RETRY_CNT as u64 + 1));
        assert!(bound < std::time::Duration::from_secs(1), "{bound:?}");
    }

    /// `bad_wr` at index k means k requests were posted; an unknown
    /// `bad_wr` counts all of them (held, never freed early).
    #[test]
    fn bad_wr_position_counts_what_was_posted() {
        // SAFETY: plain data.
        let wrs: Vec<ibv_send_wr> = (0..5).map(|_| unsafe { std::mem::zeroed() }).collect();
        assert_eq!(accepted_before(&wrs, &wrs[0]), 0);
        assert_eq!(accepted_before(&wrs, &wrs[3]), 3);
        assert_eq!(accepted_before(&wrs, ptr::null()), 5);
        // SAFETY: plain data.
        let outside: ibv_send_wr = unsafe { std::mem::zeroed() };
        assert_eq!(accepted_before(&wrs, &outside), 5);
    }
}
