//! The seeded simulation of the owner side's RDMA path (tests only): the
//! real [`RdmaLink`] posting a node's samples from a staging slab into a
//! consumer's ring over the in-memory queue pairs (`memverbs.rs`), driven
//! the way the serve poller drives it (`serve/push.rs`: post what the link
//! takes, flush, a failed flush closes the connection; `reap_link` gives a
//! slot back when its [`Done`] is polled, after which the slot is reused),
//! through delays, receiver-not-ready waits, chains refused part-way
//! (`bad_wr`), failed completions, a connection that dies, a write under a
//! revoked key, and an owner that closes the link.
//!
//! Checked after every step: no staging slot is given back while a request
//! reading it may still be at the device; a slot is given back once per
//! loan; a write reported done landed byte-exact at its place; the consumer
//! receives each sample at most once, byte-exact (and all of them, in
//! order, when no fault broke the connection). At teardown: nothing in
//! flight on either end, every slot back, no pool grown (the link's and
//! the device's).
//!
//! Seeds: as the simulator's (`crate::sim::run_seeds`): `KSPEED_SIM_SEED=n`
//! replays one.

use crate::sim::Rng;
use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;

use rdma_sys::{ibv_wc_opcode, ibv_wc_status};

use super::faulty::{FaultyQueue, QueueFaultStats, QueueFaults};
use super::link::{RdmaLink, RDMA_ERROR_BYTES};
use super::memverbs::{MemFaults, MemNic, MemQp, MemStats};
use super::qp::WorkCompletion;
use super::verbs::SendRegions;
use super::wq::{RecvWr, WorkQueue};
use crate::transport::proto::Code;
use crate::transport::{Done, Link};

const OWNER: usize = 0;
const CONSUMER: usize = 1;
/// A consumer receive buffer: an ERROR's code and message.
const RECV_BYTES: usize = 4 + RDMA_ERROR_BYTES;

/// The byte at `j` of sample `i`'s payload (a misplaced byte shows).
fn byte(seed: u64, i: usize, j: usize) -> u8 {
    (crate::hash::mix64(seed ^ (i as u64) << 24 ^ j as u64 >> 3) >> (8 * (j & 7))) as u8
}

#[derive(Clone, Copy)]
struct Sample {
    len: usize,
    error: bool,
}

struct Run {
    seed: u64,
    rng: Rng,
    nic: Rc<RefCell<MemNic>>,
    /// Over the fault wrapper (no faults in some seeds), so its faults and
    /// the in-memory NIC's are both exercised.
    link: RdmaLink<FaultyQueue<MemQp>>,
    link_caps: [usize; 6],
    rx: MemQp,
    chunk: usize,
    slab: Vec<u8>,
    /// The sample each staging slot is lent for (None: free).
    lent: Vec<Option<usize>>,
    free: Vec<u32>,
    samples: Vec<Sample>,
    /// A write of this sample goes outside the consumer's ring (its
    /// window was revoked): the device refuses it.
    bad_sample: Option<usize>,
    posted: usize,
    done: usize,
    ring: Vec<u8>,
    ring_rkey: u32,
    bufs: Vec<u8>,
    bufs_lkey: u32,
    recv_depth: usize,
    recvs_posted: u64,
    recvs_done: u64,
    received: Vec<u8>,
    next_received: usize,
    closed: bool,
    close_at: Option<u64>,
}

impl Run {
    fn new(seed: u64) -> Box<Run> {
        let mut rng = Rng(crate::hash::mix64(seed));
        let slots = 1 + rng.below(48) as usize;
        let chunk = 1 + rng.below(if cfg!(miri) { 300 } else { 3000 }) as usize;
        let max_wr = 16 + rng.below(48) as usize;
        // Under Miri (interpreted) a seed is a few samples.
        let nsamples = 1 + rng.below(if cfg!(miri) { 12 } else { 400 }) as usize;
        let faults = MemFaults {
            post_refuse_ppm: if rng.chance(3) {
                0
            } else {
                rng.below(300_000) as u32
            },
            wc_error_ppm: if rng.chance(4) {
                rng.below(20_000) as u32
            } else {
                0
            },
            die_ppm: if rng.chance(4) {
                rng.below(10_000) as u32
            } else {
                0
            },
            max_per_step: 1 + rng.below(12) as u32,
        };
        // The wrapper's faults, in half the seeds: chains refused
        // part-way before the NIC sees them, completions that succeeded
        // turned into errors (the QP then flushes the rest).
        let queue_faults = if rng.chance(2) {
            QueueFaults::default()
        } else {
            QueueFaults::default()
                .seed(seed)
                .send_refuse_ppm(rng.below(200_000) as u32)
                .wc_error_ppm(if rng.chance(3) {
                    rng.below(20_000) as u32
                } else {
                    0
                })
        };
        let recv_depth = 1 + rng.below(64) as usize;
        // The real CQ: the QP's depth + 16 (serve/owner_rdma.rs).
        let (nic, owner_qp, rx) = MemNic::pair(
            seed,
            faults,
            max_wr,
            recv_depth,
            max_wr.max(recv_depth) + 16,
            RECV_BYTES,
        );
        let samples: Vec<Sample> = (0..nsamples)
            .map(|_| {
                let error = rng.chance(16);
                let most = if error { RDMA_ERROR_BYTES + 40 } else { chunk };
                Sample {
                    len: 1 + rng.below(most.min(chunk) as u64) as usize,
                    error,
                }
            })
            .collect();
        let bad_sample = rng.chance(8).then(|| rng.below(nsamples as u64) as usize);
        let close_at = rng.chance(6).then(|| rng.below(40 * nsamples as u64));
        let mut slab = vec![0u8; slots * chunk];
        let mut ring = vec![0u8; nsamples * chunk];
        let mut bufs = vec![0u8; recv_depth * RECV_BYTES];
        let (slab_lkey, ring_rkey, bufs_lkey) = {
            let mut n = nic.borrow_mut();
            // SAFETY: the three buffers are moved into the Run (heap memory
            // does not move), which owns the NIC's only other handles
            // and drops the buffers after them (field order: nic, link, rx
            // are declared before slab, ring, bufs).
            unsafe {
                let (s, _) = n.register(OWNER, slab.as_mut_ptr(), slab.len(), false);
                let (_, r) = n.register(CONSUMER, ring.as_mut_ptr(), ring.len(), true);
                let (b, _) = n.register(CONSUMER, bufs.as_mut_ptr(), bufs.len(), false);
                (s, r.expect("remote"), b)
            }
        };
        let regions =
            SendRegions::from_ranges(&[(slab.as_ptr() as u64, slab.len() as u64, slab_lkey)]);
        let link = RdmaLink::on(
            FaultyQueue::new(owner_qp, queue_faults),
            regions,
            ring.as_ptr() as u64,
            max_wr,
        );
        let link_caps = link.capacities();
        Box::new(Run {
            seed,
            rng,
            nic,
            link,
            link_caps,
            rx,
            chunk,
            slab,
            lent: vec![None; slots],
            free: (0..slots as u32).rev().collect(),
            samples,
            bad_sample,
            posted: 0,
            done: 0,
            ring,
            ring_rkey,
            bufs,
            bufs_lkey,
            recv_depth,
            recvs_posted: 0,
            recvs_done: 0,
            received: vec![0; nsamples],
            next_received: 0,
            closed: false,
            close_at,
        })
    }

    /// The node: lends free slots to the next samples and posts them, then
    /// flushes; a failed flush closes the connection (as `push.rs` does).
    fn owner(&mut self, step: u64) {
        if self.closed {
            return;
        }
        if self.close_at == Some(step) {
            self.link.close();
            self.closed = true;
            return;
        }
        while self.posted < self.samples.len() && !self.rng.chance(6) {
            let Some(&slot) = self.free.last() else {
                break;
            };
            let i = self.posted;
            let s = self.samples[i];
            let at = slot as usize * self.chunk;
            for j in 0..s.len {
                self.slab[at + j] = byte(self.seed, i, j);
            }
            let src = self.slab[at..].as_ptr();
            let off = if self.bad_sample == Some(i) {
                self.ring.len() as u64
            } else {
                (i * self.chunk) as u64
            };
            // SAFETY: the slot's bytes stay untouched until its Done is
            // polled (`reap` scribbles them only then); the slab outlives
            // the link.
            let ok = unsafe {
                if s.error {
                    let code = Code::ReadFailed;
                    self.link
                        .post_error(slot as u64, i as u32, code, src, s.len as u32)
                } else {
                    let (len, rkey) = (s.len as u32, self.ring_rkey);
                    self.link
                        .post_write(slot as u64, src, len, off, i as u32, rkey)
                }
            };
            if !ok {
                break;
            }
            self.free.pop();
            self.lent[slot as usize] = Some(i);
            self.posted += 1;
        }
        if self.rng.chance(3) {
            return; // the flush comes at a later tick
        }
        if self.link.flush(&mut ()).is_err() {
            self.link.close();
            self.closed = true;
        }
    }

    /// The node's `reap_link`: each slot whose Done is polled is free (and
    /// is scribbled, as the next sample's read would).
    fn reap(&mut self) {
        let mut out = [Done::default(); 8];
        loop {
            let n = self.link.poll(&mut out);
            if n == 0 {
                return;
            }
            for d in &out[..n] {
                let slot = d.wr_id as usize;
                let Some(i) = self.lent.get(slot).copied().flatten() else {
                    panic!("slot {slot} given back but not lent (twice?)");
                };
                assert!(
                    !self.nic.borrow().may_read(OWNER, d.wr_id),
                    "slot {slot} (sample {i}) given back while a request reading it may \
                     still be at the device (posted, not completed): the link freed \
                     posted work (bad_wr ignored?); the owner's QP: {}",
                    self.nic.borrow().describe(OWNER)
                );
                let s = self.samples[i];
                if d.ok && !s.error {
                    let at = i * self.chunk;
                    assert!(
                        (0..s.len).all(|j| self.ring[at + j] == byte(self.seed, i, j)),
                        "sample {i}: reported written but not byte-exact in the ring"
                    );
                }
                let at = slot * self.chunk;
                self.slab[at..at + self.chunk].fill(0xa5);
                self.lent[slot] = None;
                self.free.push(slot as u32);
                self.done += 1;
            }
        }
    }

    /// The consumer: takes its completions (checking each sample), and
    /// keeps receives posted (not always at once: the owner then waits,
    /// receiver not ready).
    fn consumer(&mut self) {
        let mut wc = [WorkCompletion::default(); 8];
        loop {
            let n = self.rx.poll(&mut wc).expect("in-memory poll");
            if n == 0 {
                break;
            }
            for c in &wc[..n] {
                self.recvs_done += 1;
                if c.status != ibv_wc_status::IBV_WC_SUCCESS {
                    assert_eq!(c.status, ibv_wc_status::IBV_WC_WR_FLUSH_ERR, "{c:?}");
                    assert!(self.nic.borrow().in_error(CONSUMER));
                    continue;
                }
                self.received(c);
            }
        }
        if !self.nic.borrow().in_error(CONSUMER) && !self.rng.chance(4) {
            let mut wrs = [RecvWr::default(); 16];
            let room = self.recv_depth - (self.recvs_posted - self.recvs_done) as usize;
            let k = room.min(wrs.len());
            for (w, id) in wrs.iter_mut().zip(self.recvs_posted..) {
                // Receives complete in order: the buffers go round.
                let b = (id % self.recv_depth as u64) as usize * RECV_BYTES;
                *w = RecvWr {
                    wr_id: id,
                    addr: self.bufs[b..].as_ptr() as u64,
                    len: RECV_BYTES as u32,
                    lkey: self.bufs_lkey,
                };
            }
            // SAFETY: the buffers outlive the NIC's use (see Run::new).
            unsafe { self.rx.post_recv(&wrs[..k]) }.expect("within the receive queue");
            self.recvs_posted += k as u64;
        }
    }

    fn received(&mut self, c: &WorkCompletion) {
        let i = c.imm.expect("an immediate") as usize;
        assert!(i < self.posted, "sample {i} received, never posted");
        assert_eq!(self.received[i], 0, "sample {i} received twice");
        assert_eq!(i, self.next_received, "samples out of order");
        self.received[i] = 1;
        self.next_received += 1;
        let s = self.samples[i];
        if s.error {
            assert_eq!(c.opcode, ibv_wc_opcode::IBV_WC_RECV);
            let n = s.len.min(RDMA_ERROR_BYTES);
            assert_eq!(c.byte_len as usize, 4 + n);
            let b = (c.wr_id % self.recv_depth as u64) as usize * RECV_BYTES;
            let code = u32::from_le_bytes(self.bufs[b..b + 4].try_into().unwrap());
            assert_eq!(code, Code::ReadFailed as u32);
            assert!(
                (0..n).all(|j| self.bufs[b + 4 + j] == byte(self.seed, i, j)),
                "sample {i}: ERROR message not byte-exact"
            );
        } else {
            assert_eq!(c.opcode, ibv_wc_opcode::IBV_WC_RECV_RDMA_WITH_IMM);
            assert_eq!(c.byte_len as usize, s.len);
            self.check_landed(i);
        }
    }

    fn check_landed(&self, i: usize) {
        let at = i * self.chunk;
        for j in 0..self.samples[i].len {
            assert_eq!(
                self.ring[at + j],
                byte(self.seed, i, j),
                "sample {i}: byte {j} in the ring is not the sample's (a reused slot?)"
            );
        }
    }

    /// Whether the node is finished: every sample given back, or the
    /// connection closed or broken and nothing lent.
    fn finished(&self) -> bool {
        let stopped = self.closed || self.link.error().is_some();
        !self.link.busy()
            && self.free.len() == self.lent.len()
            && (self.done == self.samples.len() || stopped)
    }
}

fn one_seed(seed: u64) {
    run_seed(seed);
}

/// One seed's run, its invariants checked; returns what the device and the
/// fault wrapper did.
fn run_seed(seed: u64) -> (MemStats, QueueFaultStats) {
    let mut r = Run::new(seed);
    const MAX_STEPS: u64 = 200_000;
    let mut step = 0u64;
    while !r.finished() {
        step += 1;
        assert!(
            step < MAX_STEPS,
            "no progress: {} of {} posted, {} given back, link busy {}, {} in flight",
            r.posted,
            r.samples.len(),
            r.done,
            r.link.busy(),
            r.nic.borrow().in_flight(OWNER)
        );
        r.owner(step);
        r.reap();
        r.nic.borrow_mut().step();
        r.consumer();
        r.reap();
    }
    // No fault: every sample arrived, once, in order.
    let faulted = r.closed || r.link.error().is_some();
    if !faulted {
        assert_eq!(r.next_received, r.samples.len(), "samples missing");
    }
    // Teardown: the consumer stops too; both ends drain.
    r.rx.set_error().unwrap();
    let mut drained = false;
    for _ in 0..100_000 {
        r.nic.borrow_mut().step();
        r.consumer();
        r.reap();
        let nic = r.nic.borrow();
        if nic.in_flight(OWNER) == 0 && nic.in_flight(CONSUMER) == 0 {
            drained = true;
            break;
        }
    }
    assert!(drained, "requests still in flight at teardown");
    r.consumer();
    r.reap();
    assert!(!r.link.busy(), "the link holds requests at teardown");
    assert_eq!(r.free.len(), r.lent.len(), "slots not given back");
    assert_eq!(r.recvs_posted, r.recvs_done, "receives not completed");
    // What arrived is still intact (no late or stray write).
    for i in 0..r.samples.len() {
        if r.received[i] == 1 && !r.samples[i].error {
            r.check_landed(i);
        }
    }
    assert_eq!(r.link.capacities(), r.link_caps, "a link pool grew");
    r.nic.borrow().check_pools();
    let stats = r.nic.borrow().stats;
    (stats, r.link.queue().stats())
}

/// The owner's RDMA link over the in-memory verbs, many seeds (bounded in
/// time; `KSPEED_SIM_SEED=n` replays one).
#[test]
fn sim_rdma_link_over_memory_verbs() {
    let ran = crate::sim::run_seeds("sim_rdma_link", 2000, Duration::from_secs(60), one_seed);
    assert!(ran > 0);
}

/// The faults the simulation injects do happen (so its invariants were
/// tested against them): over the first 200 seeds, chains refused
/// part-way after posting some, failed completions, deaths, remote access
/// errors and receiver-not-ready waits.
#[test]
fn sim_rdma_link_faults_are_exercised() {
    let mut total = MemStats::default();
    let mut wrapper = QueueFaultStats::default();
    for seed in 0..200 {
        let (nic, w) = run_seed(seed);
        total.add(&nic);
        wrapper.sends_refused += w.sends_refused;
        wrapper.refused_part_way += w.refused_part_way;
        wrapper.wc_errors += w.wc_errors;
        wrapper.flushed += w.flushed;
    }
    eprintln!("sim_rdma_link, seeds 0..200: {total:?}, the fault wrapper: {wrapper:?}");
    assert!(wrapper.refused_part_way > 0 && wrapper.wc_errors > 0 && wrapper.flushed > 0);
    assert!(total.refused_part_way > 0);
    assert!(total.wc_errors > 0 && total.deaths > 0);
    assert!(total.remote_access_errors > 0 && total.rnr_waits > 0);
}
