//! [`FaultyQueue`]: wraps any [`WorkQueue`] and injects seeded faults, as
//! [`crate::ring::Faulty`] does for `IoBackend`, so the RDMA paths' error
//! handling runs over the real verbs too, not only over the in-memory NIC:
//!
//! - a send chain refused part-way: the requests before a seeded index are
//!   posted to the inner queue (and complete like any other), that one and
//!   the rest are not, reported as `bad_wr` with ENOMEM (`posted` = the
//!   index);
//! - a receive chain refused part-way, likewise;
//! - a request that fails at the device: a seeded send (one that reads
//!   registered memory) is posted under a local key no region has, so the
//!   device itself completes it with `IBV_WC_LOC_PROT_ERR` and moves the
//!   QP to error, flushing what follows (`IBV_WC_WR_FLUSH_ERR`), as RC
//!   does. The device, not the wrapper, makes the error: a wrapper that
//!   only rewrote a completion's status would report requests failed that
//!   the device may still be reading (a poster that frees their memory on
//!   the error would be right on a real QP and wrong here).
//!
//! Nothing is allocated per operation.

use rdma_sys::ibv_wc_status;

use super::qp::WorkCompletion;
use super::wq::{PostError, RecvWr, SendWr, WorkQueue};
use crate::error::Result;

/// Fault rates in parts per million, and the seed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct QueueFaults {
    /// Seed of the fault sequence.
    pub seed: u64,
    /// Send chains refused at a seeded index (ENOMEM).
    pub send_refuse_ppm: u32,
    /// Receive chains refused at a seeded index (ENOMEM).
    pub recv_refuse_ppm: u32,
    /// Sends (those reading registered memory) made to fail at the device
    /// (then the QP errs).
    pub wc_error_ppm: u32,
}

setters!(QueueFaults {
    seed: u64,
    send_refuse_ppm: u32,
    recv_refuse_ppm: u32,
    wc_error_ppm: u32,
});

/// What the injected faults did (so a test can say they happened).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct QueueFaultStats {
    /// Send chains refused (at any index).
    pub sends_refused: u64,
    /// Receive chains refused (at any index).
    pub recvs_refused: u64,
    /// Of both, refused after posting at least one request.
    pub refused_part_way: u64,
    /// Sends made to fail at the device.
    pub wc_errors: u64,
    /// Flushed completions polled after one of those.
    pub flushed: u64,
}

/// Wraps a queue and injects [`QueueFaults`] into its posts and
/// completions.
pub struct FaultyQueue<Q> {
    inner: Q,
    cfg: QueueFaults,
    rng: u64,
    /// A send was made to fail: the flushes that follow are counted.
    failed: bool,
    stats: QueueFaultStats,
}

impl<Q: WorkQueue> FaultyQueue<Q> {
    /// `inner` with the faults of `cfg`.
    pub fn new(inner: Q, cfg: QueueFaults) -> Self {
        FaultyQueue {
            inner,
            cfg,
            rng: crate::hash::mix64(cfg.seed ^ 0x5157_4641_554c_5459),
            failed: false,
            stats: QueueFaultStats::default(),
        }
    }

    /// What the faults did so far.
    pub fn stats(&self) -> QueueFaultStats {
        self.stats
    }

    /// The wrapped queue.
    pub fn inner(&self) -> &Q {
        &self.inner
    }

    fn below(&mut self, n: u64) -> u64 {
        self.rng = self.rng.wrapping_add(0x9e37_79b9_7f4a_7c15);
        crate::hash::reduce(crate::hash::mix64(self.rng), n)
    }

    fn chance(&mut self, ppm: u32) -> bool {
        ppm > 0 && self.below(1_000_000) < ppm as u64
    }

    /// Where a chain of `n` requests is refused (None: it is not).
    fn refuse_at(&mut self, n: usize, ppm: u32) -> Option<usize> {
        if n == 0 || !self.chance(ppm) {
            return None;
        }
        let k = self.below(n as u64) as usize;
        if k > 0 {
            self.stats.refused_part_way += 1;
        }
        Some(k)
    }
}

fn enomem(posted: usize) -> PostError {
    PostError {
        posted,
        error: std::io::Error::from_raw_os_error(libc::ENOMEM),
    }
}

impl<Q: WorkQueue> WorkQueue for FaultyQueue<Q> {
    unsafe fn post_send(&mut self, chain: &[SendWr]) -> std::result::Result<(), PostError> {
        let refused = self.refuse_at(chain.len(), self.cfg.send_refuse_ppm);
        let k = refused.unwrap_or(chain.len());
        // The request to fail, among those posted that read registered
        // memory (a bad key fails nothing else).
        let j = if k > 0 && self.chance(self.cfg.wc_error_ppm) {
            let j = self.below(k as u64) as usize;
            (!chain[j].inline && chain[j].len > 0).then_some(j)
        } else {
            None
        };
        if let Some(j) = j {
            self.stats.wc_errors += 1;
            self.failed = true;
            let bad = SendWr {
                lkey: !chain[j].lkey,
                signaled: true,
                ..chain[j]
            };
            // SAFETY: the caller's contract, passed on (the bad request
            // reads nothing: its key opens no memory). Each part's own
            // refusal is counted from where it starts.
            unsafe {
                self.inner.post_send(&chain[..j])?;
                self.inner
                    .post_send(&[bad])
                    .map_err(|e| PostError { posted: j, ..e })?;
                self.inner
                    .post_send(&chain[j + 1..k])
                    .map_err(|e| PostError {
                        posted: j + 1 + e.posted,
                        ..e
                    })?;
            }
        } else {
            // SAFETY: the caller's contract, passed on; the inner queue's
            // own refusal (with its count) is the answer when it has one.
            unsafe { self.inner.post_send(&chain[..k]) }?;
        }
        if refused.is_some() {
            self.stats.sends_refused += 1;
            return Err(enomem(k));
        }
        Ok(())
    }

    unsafe fn post_recv(&mut self, chain: &[RecvWr]) -> std::result::Result<(), PostError> {
        let Some(k) = self.refuse_at(chain.len(), self.cfg.recv_refuse_ppm) else {
            // SAFETY: the caller's contract, passed on.
            return unsafe { self.inner.post_recv(chain) };
        };
        self.stats.recvs_refused += 1;
        // SAFETY: as above.
        unsafe { self.inner.post_recv(&chain[..k]) }?;
        Err(enomem(k))
    }

    fn poll(&mut self, out: &mut [WorkCompletion]) -> Result<usize> {
        let n = self.inner.poll(out)?;
        if self.failed {
            let flushed = out[..n]
                .iter()
                .filter(|c| c.status == ibv_wc_status::IBV_WC_WR_FLUSH_ERR)
                .count();
            self.stats.flushed += flushed as u64;
        }
        Ok(n)
    }

    fn arm(&self) -> Result<()> {
        self.inner.arm()
    }

    fn set_error(&mut self) -> Result<()> {
        self.inner.set_error()
    }
}
