//! A shared receive queue: one pool of posted receives for every queue pair
//! created on it ([`super::Qp::new_on_srq`]), instead of each QP's own. A
//! receive's completion comes on the CQ of the QP it completed for, and
//! its `qp_num` names that QP (the wr_id is the SRQ's own).
//!
//! This module owns the SRQ and is one of the few allowed `unsafe`.

use std::ptr;
use std::sync::Arc;

use rdma_sys::*;

use super::qp::{Cq, Qp};
use super::verbs::{os_err, Pd};
use super::wq::{PostError, RecvWr};
use crate::error::Result;

/// Receives one [`Srq::post`] takes at most (the request arrays it
/// builds them in are sized for this once).
pub const SRQ_CHAIN_MAX: usize = 64;

/// A shared receive queue and the request arrays its posts build (sized
/// once: a post allocates nothing).
pub struct Srq {
    pub(super) srq: *mut ibv_srq,
    scratch: std::sync::Mutex<(Vec<ibv_sge>, Vec<ibv_recv_wr>)>,
    _pd: Arc<Pd>,
}

// SAFETY: verbs SRQs may be used from any thread; the request arrays are
// behind a lock, and their pointers are rebuilt by every post.
unsafe impl Send for Srq {}
// SAFETY: as above.
unsafe impl Sync for Srq {}

impl Srq {
    /// Creates an SRQ of `max_wr` receives of one buffer each on `pd`.
    pub fn new(pd: &Arc<Pd>, max_wr: u32) -> Result<Arc<Srq>> {
        // SAFETY: plain data.
        let mut init: ibv_srq_init_attr = unsafe { std::mem::zeroed() };
        init.attr.max_wr = max_wr;
        init.attr.max_sge = 1;
        // SAFETY: live PD, valid attributes.
        let srq = unsafe { ibv_create_srq(pd.pd, &mut init) };
        if srq.is_null() {
            return Err(os_err("create SRQ", format!("{max_wr} receives")));
        }
        Ok(Arc::new(Srq {
            srq,
            scratch: std::sync::Mutex::new((
                Vec::with_capacity(SRQ_CHAIN_MAX),
                Vec::with_capacity(SRQ_CHAIN_MAX),
            )),
            _pd: pd.clone(),
        }))
    }

    /// Posts `chain` (at most [`SRQ_CHAIN_MAX`]) as one chain of
    /// receives; a refusal says how many were posted before it
    /// (`bad_wr`).
    ///
    /// # Safety
    /// Each buffer must stay valid, and be written only by the device,
    /// until its receive completes.
    pub unsafe fn post(&self, chain: &[RecvWr]) -> std::result::Result<(), PostError> {
        assert!(
            chain.len() <= SRQ_CHAIN_MAX,
            "{} receives in one chain",
            chain.len()
        );
        if chain.is_empty() {
            return Ok(());
        }
        let mut scratch = self.scratch.lock().unwrap_or_else(|p| p.into_inner());
        let (sges, wrs) = &mut *scratch;
        sges.clear();
        wrs.clear();
        sges.extend(chain.iter().map(|r| ibv_sge {
            addr: r.addr,
            length: r.len,
            lkey: r.lkey,
        }));
        for (i, r) in chain.iter().enumerate() {
            wrs.push(ibv_recv_wr {
                wr_id: r.wr_id,
                next: ptr::null_mut(),
                sg_list: &mut sges[i],
                num_sge: 1,
            });
        }
        for i in 0..wrs.len() - 1 {
            let next: *mut ibv_recv_wr = &mut wrs[i + 1];
            wrs[i].next = next;
        }
        let mut bad: *mut ibv_recv_wr = ptr::null_mut();
        // SAFETY: live SRQ; the chain and its SGEs live in the scratch
        // arrays (locked) for the call; the buffers per this function's
        // contract.
        let rc = unsafe { ibv_post_srq_recv(self.srq, wrs.as_mut_ptr(), &mut bad) };
        if rc != 0 {
            return Err(PostError {
                posted: super::qp::accepted_before(wrs, bad),
                error: std::io::Error::from_raw_os_error(rc),
            });
        }
        Ok(())
    }
}

impl Qp {
    /// Creates an RC QP (state RESET → INIT) that receives from `srq`
    /// (no receive queue of its own), completing on `cq`.
    pub fn new_on_srq(
        pd: &Arc<Pd>,
        cq: &Arc<Cq>,
        srq: &Arc<Srq>,
        max_send_wr: u32,
        max_inline: u32,
    ) -> Result<Qp> {
        let keep: Arc<dyn Send + Sync> = srq.clone();
        Qp::create(pd, cq, cq, Some((srq.srq, keep)), max_send_wr, max_inline)
    }
}

impl Drop for Srq {
    fn drop(&mut self) {
        // SAFETY: every QP on it holds an Arc of it, so they are gone.
        unsafe { ibv_destroy_srq(self.srq) };
    }
}
