//! [`FaultyQueue`]: wraps any [`WorkQueue`] and injects seeded faults, as
//! [`crate::ring::Faulty`] does for `IoBackend`, so the RDMA paths' error
//! handling runs over the real verbs too, not only over the in-memory NIC:
//!
//! - a send chain refused part-way: the requests before a seeded index are
//!   posted to the inner queue (and complete like any other), that one and
//!   the rest are not, reported as `bad_wr` with ENOMEM (`posted` = the
//!   index);
//! - a chain of memory-window requests refused part-way, likewise (at the
//!   send rate);
//! - a receive chain refused part-way, likewise;
//! - a request that fails at the device: a seeded send (one that reads
//!   registered memory) is posted under a local key no region has, so the
//!   device itself completes it with an error (`IBV_WC_LOC_PROT_ERR`;
//!   soft-RoCE says `IBV_WC_LOC_QP_OP_ERR`) and moves the
//!   QP to error, flushing what follows (`IBV_WC_WR_FLUSH_ERR`), as RC
//!   does. The device, not the wrapper, makes the error: a wrapper that
//!   only rewrote a completion's status would report requests failed that
//!   the device may still be reading (a poster that frees their memory on
//!   the error would be right on a real QP and wrong here).
//!
//! Nothing is allocated per operation.

use rdma_sys::ibv_wc_status;

use super::qp::WorkCompletion;
use super::wq::{MwOp, MwWr, PostError, RecvWr, SendWr, WorkQueue};
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
    /// Sends (those reading registered memory) and memory-window requests
    /// made to fail at the device (then the QP errs).
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
    /// Memory-window chains refused (at any index).
    pub mws_refused: u64,
    /// Memory-window requests made to fail at the device.
    pub mw_errors: u64,
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
            rng: seeded(cfg.seed),
            failed: false,
            stats: QueueFaultStats::default(),
        }
    }

    /// What the faults did so far.
    pub fn stats(&self) -> QueueFaultStats {
        self.stats
    }

    /// Changes the faults from now on: their rates, and the sequence
    /// restarts from `cfg.seed`.
    pub fn set_faults(&mut self, cfg: QueueFaults) {
        self.cfg = cfg;
        self.rng = seeded(cfg.seed);
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

fn seeded(seed: u64) -> u64 {
    crate::hash::mix64(seed ^ 0x5157_4641_554c_5459)
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

    fn post_mw(&mut self, chain: &[MwWr]) -> std::result::Result<(), PostError> {
        let refused = self.refuse_at(chain.len(), self.cfg.send_refuse_ppm);
        let k = refused.unwrap_or(chain.len());
        let j =
            (k > 0 && self.chance(self.cfg.wc_error_ppm)).then(|| self.below(k as u64) as usize);
        if let Some(j) = j {
            self.stats.mw_errors += 1;
            self.failed = true;
            let op = match chain[j].op {
                // Longer than any region: the device refuses the bind.
                MwOp::Bind {
                    window,
                    region,
                    addr,
                    rkey,
                    ..
                } => MwOp::Bind {
                    window,
                    region,
                    addr,
                    len: 1 << 62,
                    rkey,
                },
                // Another tag: no window is bound under it.
                MwOp::Invalidate { rkey } => MwOp::Invalidate { rkey: rkey ^ 0x80 },
            };
            let bad = MwWr {
                op,
                signaled: true,
                ..chain[j]
            };
            self.inner.post_mw(&chain[..j])?;
            self.inner
                .post_mw(&[bad])
                .map_err(|e| PostError { posted: j, ..e })?;
            self.inner
                .post_mw(&chain[j + 1..k])
                .map_err(|e| PostError {
                    posted: j + 1 + e.posted,
                    ..e
                })?;
        } else {
            self.inner.post_mw(&chain[..k])?;
        }
        if refused.is_some() {
            self.stats.mws_refused += 1;
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

#[cfg(test)]
mod tests {
    use super::super::memverbs::{MemFaults, MemNic};
    use super::super::wq::SendOp;
    use super::*;

    /// Over the in-memory pair, seeds 0..16: a chain of 8 refused at `k`
    /// completes exactly its first `k` writes (they landed, the rest did
    /// not), and a send made to fail at the device completes with an error
    /// after which the rest of its chain is flushed. Returns, over the
    /// seeds, whether a refusal came after posting some and whether a
    /// failure left requests to flush (so both cases were tested).
    #[test]
    fn refusals_post_their_prefix_and_a_failed_send_flushes_the_rest() {
        let (mut part_way, mut flushed) = (false, false);
        for seed in 0..16 {
            let mut src: Vec<u8> = (1..=128).collect();
            let mut dst = vec![0u8; 256];
            let faults = MemFaults {
                max_per_step: 4,
                ..MemFaults::default()
            };
            let (nic, a, _b) = MemNic::pair(seed, faults, 16, 16, 64, 16);
            // SAFETY: both buffers outlive the NIC (declared before it).
            let (lkey, rkey) = unsafe {
                let (l, _) = nic.borrow_mut().register(0, src.as_mut_ptr(), 128, false);
                let (_, r) = nic.borrow_mut().register(1, dst.as_mut_ptr(), 256, true);
                (l, r.unwrap())
            };
            let write = |i: u64| SendWr {
                wr_id: i,
                op: SendOp::Write,
                local_addr: src.as_ptr() as u64 + (i % 8) * 16,
                len: 16,
                lkey,
                remote_addr: dst.as_ptr() as u64 + i * 16,
                rkey,
                signaled: true,
                ..SendWr::EMPTY
            };
            let drain = |q: &mut FaultyQueue<_>| {
                let mut got = Vec::new();
                let mut out = [WorkCompletion::default(); 16];
                for _ in 0..64 {
                    nic.borrow_mut().step();
                    let n = WorkQueue::poll(q, &mut out).unwrap();
                    got.extend_from_slice(&out[..n]);
                }
                got
            };
            let cfg = QueueFaults::default().seed(seed).send_refuse_ppm(1_000_000);
            let mut q = FaultyQueue::new(a, cfg);
            let chain: Vec<SendWr> = (0..8).map(write).collect();
            // SAFETY: src outlives the requests (drained below).
            let e = unsafe { q.post_send(&chain) }.unwrap_err();
            let k = e.posted;
            assert_eq!(e.error.raw_os_error(), Some(libc::ENOMEM));
            let got = drain(&mut q);
            let ids: Vec<u64> = got.iter().map(|c| c.wr_id).collect();
            assert_eq!(ids, (0..k as u64).collect::<Vec<_>>(), "seed {seed}");
            assert!(got.iter().all(|c| c.status == 0));
            for i in 0..8 {
                let landed = &dst[i * 16..i * 16 + 16];
                assert_eq!(landed == &src[i * 16..i * 16 + 16], i < k, "seed {seed}");
            }
            part_way |= k > 0;

            q.set_faults(QueueFaults::default().seed(seed).wc_error_ppm(1_000_000));
            let chain: Vec<SendWr> = (8..16).map(write).collect();
            // SAFETY: as above.
            unsafe { q.post_send(&chain) }.unwrap();
            let got = drain(&mut q);
            assert_eq!(got.len(), 8, "seed {seed}: {got:?}");
            let j = got.iter().position(|c| c.status != 0).expect("a failure");
            assert_eq!(got[j].status, ibv_wc_status::IBV_WC_LOC_PROT_ERR);
            assert!(got[..j].iter().all(|c| c.status == 0));
            assert!(got[j + 1..]
                .iter()
                .all(|c| c.status == ibv_wc_status::IBV_WC_WR_FLUSH_ERR));
            assert_eq!(q.stats().flushed, (7 - j) as u64);
            assert!(nic.borrow().in_error(0));
            flushed |= j < 7;
            eprintln!("seed {seed}: refused at {k}, request {j} of 8 failed");
        }
        assert!(part_way && flushed);
    }
}
