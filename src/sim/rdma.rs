//! The RDMA data path end to end (tests only): the real [`RdmaLink`] (a
//! node's send side) pushing samples into the real [`RdmaRx`] (the
//! consumer's receive side, memory windows included) over one in-memory
//! RC pair (`MemNic`), each end behind a `FaultyQueue`, under one seed.
//! The simulation plays the two loops around them as the real ones do:
//! the consumer's network thread (`loader/net`: open a window per grant,
//! bind the frame's windows before its GRANT frame goes, take the
//! completions, invalidate a grant's window once its bytes or its ERROR
//! arrived and only then finish it, publish in order, kill the connection
//! on a failure or a silent node) and the node's push loop
//! (`serve/push.rs`: post what the link takes, flush, give a staging slot
//! back at its `Done`). The GRANT frames go over a delayed in-order
//! control channel.
//!
//! Faults: `MemNic`'s (delays, chains refused part-way, failed
//! completions, a dying connection), each `FaultyQueue`'s (sends, binds,
//! invalidations and receives refused part-way or failing at the device),
//! a node that closes its link, and (windows mode) a misbehaving node: a
//! write one byte past its grant, or a stale write under the key of a
//! grant that is over, into the range of a later grant under the same
//! window.
//!
//! Checked after every step: every write that landed lies inside a grant
//! the consumer has open, under that grant's key, and came from no
//! misbehaving write (windows mode: the device refused those); nothing
//! lands once the consumer shut the QP; each grant's bytes arrive at most
//! once, in grant order; a sample is finished only after its window's
//! invalidation completed, and then byte-exact; samples are published in
//! order, each once, byte-exact, or failed with a named error (a node's
//! ERROR only for a sample the node failed). With no fault every sample is
//! published. No window is bound or invalidated while a write through its
//! key is still queued at the node (`MemStats::window_races`). At
//! teardown: nothing in flight on either end, every staging slot back, no
//! pool grown (the link's, the receive side's, the device's).
//!
//! Seeds: as the simulator's (`crate::sim::run_seeds`): `KSPEED_SIM_SEED=n`
//! replays one.
//!
//! (Why this file is over ~800 lines: one scenario; the two loops it plays,
//! the misbehaving node and the per-step checks share its state, and split
//! across files they would each need all of it.)

use std::cell::RefCell;
use std::collections::VecDeque;
use std::rc::Rc;
use std::time::Duration;

use crate::loader::net::cqs;
use crate::loader::net::rdma::{RdmaRx, RDMA_RECVS, RDMA_RECV_BYTES};
use crate::loader::net::{Event, Landed, NONE};
use crate::sim::Rng;
use crate::transport::proto::Code;
use crate::transport::rdma::memverbs::{MemFaults, MemNic, MemQp, MemStats};
use crate::transport::rdma::{
    FaultyQueue, QueueFaultStats, QueueFaults, RdmaLink, SendRegions, WorkCompletion,
    RDMA_ERROR_BYTES,
};
use crate::transport::{Done, Link};

const OWNER: usize = 0;
const CONSUMER: usize = 1;
/// Steps with grants outstanding and nothing received before the consumer
/// gives up on the node (the real thread's node timeout).
const SILENCE_STEPS: u64 = 3_000;

type Queue = FaultyQueue<MemQp>;

/// The byte at `j` of sample `i`'s payload (a misplaced byte shows).
fn byte(seed: u64, i: usize, j: usize) -> u8 {
    (crate::hash::mix64(seed ^ (i as u64) << 24 ^ j as u64 >> 3) >> (8 * (j & 7))) as u8
}

/// What a misbehaving node does wrong (windows mode).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Misbehave {
    /// Writes sample `i` one byte past the start of its grant, so its last
    /// byte falls outside the window.
    PastGrant(usize),
    /// Once the consumer is done with sample `i`, writes other bytes under
    /// its grant's key into the range of a later grant under the same
    /// window (or its own, when none comes).
    Stale(usize),
}

#[derive(Clone, Copy)]
struct Sample {
    len: usize,
    /// The node answers it with an ERROR.
    error: bool,
}

/// A grant the consumer has open: its ring slot holds sample `sample`.
#[derive(Clone, Copy)]
struct Grant {
    sample: usize,
    window: u32,
    rkey: u32,
    received: u32,
    /// Done with the node (all bytes, or its ERROR): waiting for the
    /// window's invalidation (`error`: it was an ERROR).
    over: bool,
    error: bool,
}

#[derive(Clone, PartialEq, Eq, Debug)]
enum Outcome {
    Pending,
    /// Finished byte-exact, not yet published.
    Landed,
    Published,
    /// A named error.
    Failed(String),
}

/// A GRANT entry on its way to the node.
#[derive(Clone, Copy)]
struct GrantMsg {
    sample: usize,
    offset: u64,
    len: u32,
    rkey: u32,
}

struct Run {
    seed: u64,
    rng: Rng,
    nic: Rc<RefCell<MemNic>>,
    // The node.
    link: RdmaLink<Queue>,
    link_caps: [usize; 6],
    chunk: usize,
    slab: Vec<u8>,
    /// What each staging slot is lent for: the sample, and whether it is a
    /// misbehaving write (None: free).
    lent: Vec<Option<(usize, bool)>>,
    free: Vec<u32>,
    /// GRANT entries sent and not yet taken by the node (in order).
    control: VecDeque<GrantMsg>,
    /// The node took this stale write's grant: (grant, posted).
    stale: Option<(GrantMsg, bool)>,
    /// The newest grant the node took under the stale write's window.
    rebound: Option<GrantMsg>,
    /// The stale write went into a window bound again.
    stale_into_rebound: bool,
    misbehave: Option<Misbehave>,
    closed: bool,
    close_at: Option<u64>,
    // The consumer.
    rx: RdmaRx<Queue>,
    /// Its completions are taken as a shared CQ's (by their tag).
    tagged: bool,
    rx_caps: [usize; 9],
    windows: bool,
    ring: Vec<u8>,
    ring_slots: usize,
    table: Vec<Option<Grant>>,
    max_grants: usize,
    outstanding: usize,
    next_grant: usize,
    next_publish: usize,
    /// Samples of the frame being filled, and of the one waiting for its
    /// binds.
    fill: Vec<usize>,
    flight: Vec<usize>,
    /// The last sample whose bytes or ERROR arrived (grant order).
    last_received: Option<usize>,
    last_progress: u64,
    dead: Option<String>,
    samples: Vec<Sample>,
    outcome: Vec<Outcome>,
    /// Any fault configured (without one every sample is published).
    faulty: bool,
}

impl Run {
    fn new(seed: u64) -> Box<Run> {
        let mut rng = Rng(crate::hash::mix64(seed ^ 0x0052_4458));
        let slots = 1 + rng.below(24) as usize;
        let chunk = 1 + rng.below(if cfg!(miri) { 200 } else { 2000 }) as usize;
        let max_wr = 8 + rng.below(40) as usize;
        let nsamples = 1 + rng.below(if cfg!(miri) { 10 } else { 300 }) as usize;
        let ring_slots = 1 + rng.below(12) as usize;
        let windows = !rng.chance(8);
        let nwin = 1 + rng.below(16) as usize;
        let max_grants = 1 + rng.below(24) as usize;
        let quiet = rng.chance(3);
        let faults = if quiet {
            MemFaults {
                max_per_step: 1 + rng.below(12) as u32,
                ..MemFaults::default()
            }
        } else {
            MemFaults {
                post_refuse_ppm: rng.below(200_000) as u32,
                wc_error_ppm: if rng.chance(4) {
                    rng.below(20_000) as u32
                } else {
                    0
                },
                die_ppm: if rng.chance(4) {
                    rng.below(5_000) as u32
                } else {
                    0
                },
                max_per_step: 1 + rng.below(12) as u32,
            }
        };
        let queue_faults = |rng: &mut Rng, salt: u64| {
            if quiet || rng.chance(2) {
                QueueFaults::default()
            } else {
                QueueFaults::default()
                    .seed(seed ^ salt)
                    .send_refuse_ppm(rng.below(100_000) as u32)
                    .recv_refuse_ppm(rng.below(20_000) as u32)
                    .wc_error_ppm(if rng.chance(3) {
                        rng.below(20_000) as u32
                    } else {
                        0
                    })
            }
        };
        let owner_faults = queue_faults(&mut rng, 1);
        let consumer_faults = queue_faults(&mut rng, 2);
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
        let misbehave = (windows && !quiet && rng.chance(4)).then(|| {
            let i = rng.below(nsamples as u64) as usize;
            if rng.chance(2) {
                Misbehave::PastGrant(i)
            } else {
                Misbehave::Stale(i)
            }
        });
        let close_at = (!quiet && rng.chance(8)).then(|| rng.below(40 * nsamples as u64));
        let faulty = !quiet || close_at.is_some() || misbehave.is_some();
        // Both ends as the consumer's QP is made: RDMA_RECVS deep, its CQ
        // for the receives, the windows' requests and some more.
        let depth = RDMA_RECVS;
        let (nic, owner_qp, rx_qp) = MemNic::pair(
            seed,
            faults,
            depth,
            depth,
            depth + nwin + 64,
            4 + RDMA_ERROR_BYTES,
        );
        nic.borrow_mut().log_writes(depth);
        let mut slab = vec![0u8; slots * chunk];
        let mut ring = vec![0u8; ring_slots * chunk];
        let mut bufs = vec![0u8; RDMA_RECVS * RDMA_RECV_BYTES];
        let (slab_lkey, ring_rkey, bufs_lkey, rkeys) = {
            let mut n = nic.borrow_mut();
            // SAFETY: the three buffers live in the Run (heap memory does
            // not move): the NIC touches them only in `step`, which runs
            // while the Run does.
            unsafe {
                let (s, _) = n.register(OWNER, slab.as_mut_ptr(), slab.len(), false);
                let (r, rkey) = n.register(CONSUMER, ring.as_mut_ptr(), ring.len(), !windows);
                let (b, _) = n.register(CONSUMER, bufs.as_mut_ptr(), bufs.len(), false);
                let rkeys = if windows {
                    n.alloc_windows(CONSUMER, r, nwin)
                } else {
                    Vec::new()
                };
                (s, rkey.unwrap_or(0), b, rkeys)
            }
        };
        let regions =
            SendRegions::from_ranges(&[(slab.as_ptr() as u64, slab.len() as u64, slab_lkey)]);
        let link = RdmaLink::on(
            FaultyQueue::new(owner_qp, owner_faults),
            regions,
            ring.as_ptr() as u64,
            max_wr,
        );
        // Odd seeds tag the consumer's requests as a link on a shared CQ
        // does (`cqs.rs`), and take its completions by that route.
        let tagged = seed & 1 == 1;
        let tag = if tagged {
            cqs::tag((seed >> 1) as u32 & 0xffff, (seed >> 17) as u32)
        } else {
            0
        };
        let rx = RdmaRx::on(
            FaultyQueue::new(rx_qp, QueueFaults::default()),
            tag,
            bufs,
            bufs_lkey,
            ring.as_ptr() as u64,
            ring_rkey,
            &rkeys,
        );
        let mut rx = rx.unwrap_or_else(|e| panic!("connect: {e}"));
        if tagged {
            // A completion of the queue pair the link had before is not
            // this one's.
            let before = cqs::tag((seed >> 1) as u32 & 0xffff, (seed >> 17) as u32 ^ 1);
            let stale = WorkCompletion {
                wr_id: before | 3,
                ..WorkCompletion::default()
            };
            assert!(
                rx.take_tagged(&stale).is_none(),
                "a stale completion was taken"
            );
        }
        // The consumer's faults from the first completion on (a receive
        // chain refused at connect fails the connection before any grant:
        // tested over the real verbs).
        rx.queue_mut().set_faults(consumer_faults);
        let link_caps = link.capacities();
        let rx_caps = rx.capacities();
        Box::new(Run {
            seed,
            rng,
            nic,
            link,
            link_caps,
            chunk,
            slab,
            lent: vec![None; slots],
            free: (0..slots as u32).rev().collect(),
            control: VecDeque::with_capacity(nsamples),
            stale: None,
            rebound: None,
            stale_into_rebound: false,
            misbehave,
            closed: false,
            close_at,
            rx,
            tagged,
            rx_caps,
            windows,
            ring,
            ring_slots,
            table: vec![None; ring_slots],
            max_grants,
            outstanding: 0,
            next_grant: 0,
            next_publish: 0,
            fill: Vec::with_capacity(nsamples),
            flight: Vec::with_capacity(nsamples),
            last_received: None,
            last_progress: 0,
            dead: None,
            samples,
            outcome: vec![Outcome::Pending; nsamples],
            faulty,
        })
    }

    // ---- the node -------------------------------------------------------

    /// The node: takes the GRANT entries that arrived, stages and posts
    /// them (an ERROR for a sample it fails), then flushes; a failed flush
    /// closes the link (as `push.rs` does).
    fn owner(&mut self, step: u64) {
        if self.closed || self.link.error().is_some() {
            self.control.clear();
            return;
        }
        if self.close_at == Some(step) {
            self.link.close();
            self.closed = true;
            return;
        }
        // A stale write, once the consumer is done with the grant whose
        // key it uses (its window invalidated: the write must not land):
        // into the range of a later grant under the same window (bound
        // again, under a key with another tag), or, when none comes, its
        // own.
        if let Some((g, false)) = self.stale {
            let target = match self.rebound {
                Some(n) => Some(n),
                _ if self.next_publish == self.samples.len() => Some(g),
                _ => None,
            };
            if let Some(t) =
                target.filter(|_| self.outcome[g.sample] != Outcome::Pending && self.rng.chance(4))
            {
                let w = GrantMsg {
                    sample: g.sample,
                    rkey: g.rkey,
                    ..t
                };
                if self.post(w, true) {
                    self.stale = Some((g, true));
                    self.stale_into_rebound = self.rebound.is_some();
                }
            }
        }
        while !self.rng.chance(6) {
            let Some(&g) = self.control.front() else {
                break;
            };
            if !self.post(g, false) {
                break;
            }
            self.control.pop_front();
            // A later grant under the same window (its key's index, which
            // the node sees): where the stale write aims.
            if let Some((st, _)) = self.stale {
                if g.sample > st.sample && g.rkey >> 8 == st.rkey >> 8 && self.windows {
                    self.rebound = Some(g);
                }
            }
            if self.misbehave == Some(Misbehave::Stale(g.sample)) && !self.samples[g.sample].error {
                self.stale = Some((g, false));
            }
        }
        if self.rng.chance(3) {
            return; // the flush comes at a later tick
        }
        if self.link.flush(&mut ()).is_err() {
            self.link.close();
            self.closed = true;
        }
    }

    /// Stages grant `g`'s sample in a free slot and posts it (`bad`: the
    /// stale write, with other bytes); false when no slot or no room.
    fn post(&mut self, g: GrantMsg, bad: bool) -> bool {
        let Some(&slot) = self.free.last() else {
            return false;
        };
        let i = g.sample;
        let s = self.samples[i];
        let at = slot as usize * self.chunk;
        for j in 0..g.len as usize {
            self.slab[at + j] = if bad { 0xee } else { byte(self.seed, i, j) };
        }
        let src = self.slab[at..].as_ptr();
        let past = self.misbehave == Some(Misbehave::PastGrant(i));
        let offset = g.offset + past as u64;
        // SAFETY: the slot's bytes stay untouched until its Done is polled
        // (`reap` scribbles them only then); the slab outlives the link.
        let ok = unsafe {
            if s.error {
                let code = Code::ReadFailed;
                self.link
                    .post_error(slot as u64, i as u32, code, src, s.len as u32)
            } else {
                self.link
                    .post_write(slot as u64, src, g.len, offset, i as u32, g.rkey)
            }
        };
        if ok {
            self.free.pop();
            self.lent[slot as usize] = Some((i, bad || past));
        }
        ok
    }

    /// The node's `reap_link`: each slot whose Done is polled is free (and
    /// scribbled, as the next sample's staging would).
    fn reap(&mut self) {
        let mut out = [Done::default(); 8];
        loop {
            let n = self.link.poll(&mut out);
            if n == 0 {
                return;
            }
            for d in &out[..n] {
                let slot = d.wr_id as usize;
                assert!(
                    self.lent.get(slot).copied().flatten().is_some(),
                    "slot {slot} given back but not lent (twice?)"
                );
                assert!(
                    !self.nic.borrow().may_read(OWNER, d.wr_id),
                    "slot {slot} given back while a request reading it may still be at \
                     the device; the node's QP: {}",
                    self.nic.borrow().describe(OWNER)
                );
                let at = slot * self.chunk;
                self.slab[at..at + self.chunk].fill(0xa5);
                self.lent[slot] = None;
                self.free.push(slot as u32);
            }
        }
    }

    fn owner_idle(&self) -> bool {
        let stopped = self.closed || self.link.error().is_some();
        !self.link.busy()
            && self.free.len() == self.lent.len()
            && (stopped || (self.control.is_empty() && !matches!(self.stale, Some((_, false)))))
    }

    // ---- the consumer ---------------------------------------------------

    /// The consumer's network thread: takes the completions, publishes what
    /// is finished in order, grants what the ring and the windows allow,
    /// and sends (binds first) a frame.
    fn consumer(&mut self, step: u64) {
        self.poll(step);
        self.publish();
        if self.dead.is_some() {
            return;
        }
        if self.outstanding > 0 && step - self.last_progress > SILENCE_STEPS {
            self.kill(format!("no data for {SILENCE_STEPS} steps"));
            return;
        }
        while self.next_grant < self.samples.len()
            && self.outstanding < self.max_grants
            && !self.rng.chance(8)
        {
            let i = self.next_grant;
            let slot = i % self.ring_slots;
            if self.table[slot].is_some() {
                break; // flow control: its place in the ring is not free yet
            }
            let len = self.samples[i].len as u32;
            let phys = (slot * self.chunk) as u64;
            let Some((rkey, window)) = self.rx.open_range(slot, 0, phys, len) else {
                break; // every window in use
            };
            assert_eq!(window == NONE, !self.windows);
            self.table[slot] = Some(Grant {
                sample: i,
                window,
                rkey,
                received: 0,
                over: false,
                error: false,
            });
            if self.outstanding == 0 {
                self.last_progress = step;
            }
            self.outstanding += 1;
            self.fill.push(i);
            self.next_grant += 1;
        }
        // The frame goes when none waits for its binds (as the network
        // thread's flush_one).
        if !self.rx.flushing() && self.flight.is_empty() && !self.fill.is_empty() {
            std::mem::swap(&mut self.fill, &mut self.flight);
            match self.rx.flush() {
                Ok(true) => {}
                Ok(false) => self.send_frame(),
                Err(e) => self.kill(e.to_string()),
            }
        }
    }

    /// The frame in flight goes to the node.
    fn send_frame(&mut self) {
        for &i in &self.flight {
            let slot = i % self.ring_slots;
            let g = self.table[slot].expect("granted");
            self.control.push_back(GrantMsg {
                sample: i,
                offset: (slot * self.chunk) as u64,
                len: self.samples[i].len as u32,
                rkey: g.rkey,
            });
        }
        self.flight.clear();
    }

    fn poll(&mut self, step: u64) {
        loop {
            let n = match self.rx.poll() {
                Ok(n) => n,
                Err(e) => {
                    self.kill(e.to_string());
                    return;
                }
            };
            if n == 0 {
                // The invalidations queued while handling this poll's
                // completions go as one chain (the network thread's tick).
                if self.dead.is_none() {
                    if let Err(e) = self.rx.flush_closes() {
                        self.kill(e.to_string());
                    }
                }
                return;
            }
            for k in 0..n {
                if self.dead.is_some() {
                    break; // flushed requests of a connection being shut
                }
                let event = if self.tagged {
                    self.rx.take_polled_as_shared(k).unwrap_or_else(|| {
                        panic!(
                            "completion {:?} is not of this data path's tag",
                            self.rx.polled(k)
                        )
                    })
                } else {
                    self.rx.take(k)
                };
                match event {
                    Event::Failed(why) => self.kill(why),
                    Event::Flushed => self.send_frame(),
                    Event::Closed => {
                        while let Some((window, entry)) = self.rx.take_closed() {
                            self.closed_window(window, entry);
                        }
                    }
                    Event::Received(what) => {
                        self.last_progress = step;
                        self.landed(what);
                    }
                }
            }
            if self.dead.is_none() {
                if let Err(e) = self.rx.refill() {
                    self.kill(format!("re-posting receives: {e}"));
                }
            }
        }
    }

    /// What a receive carried (as `on_landed`).
    fn landed(&mut self, what: Landed) {
        let (grant, bytes, error) = match what {
            Landed::Violation(why) => return self.violation(why),
            Landed::Wrote { grant, bytes } => (grant as usize, bytes, None),
            Landed::Error { grant, code, msg } => (grant as usize, 0, Some((code, msg))),
        };
        let slot = grant % self.ring_slots;
        let Some(g) = self.table[slot].filter(|g| g.sample == grant && !g.over) else {
            return self.violation(format!("grant {grant} is not outstanding"));
        };
        if let Some(last) = self.last_received {
            assert!(grant > last, "grant {grant} arrived after grant {last}");
        }
        let len = self.samples[grant].len as u32;
        if let Some((code, msg)) = &error {
            assert!(
                self.samples[grant].error,
                "sample {grant}: an ERROR the node never sent ({code}: {msg})"
            );
            assert_eq!(*code, Code::ReadFailed as u32);
        } else if bytes > len - g.received {
            return self.violation(format!("grant {grant}: {bytes} bytes overrun it"));
        }
        self.last_received = Some(grant);
        let g = self.table[slot].as_mut().expect("checked");
        g.received += bytes;
        if error.is_none() && g.received < len {
            return;
        }
        g.over = true;
        g.error = error.is_some();
        let window = g.window;
        if window == NONE {
            return self.finish(slot);
        }
        if let Err(e) = self.rx.close(window) {
            self.kill(e.to_string());
        }
    }

    /// Window `window`, which opened ring slot `entry`, is invalidated.
    fn closed_window(&mut self, window: u32, entry: u32) {
        let slot = entry as usize;
        let g = self
            .table
            .get(slot)
            .copied()
            .flatten()
            .unwrap_or_else(|| panic!("window {window} closed for a free entry {entry}"));
        assert_eq!(g.window, window, "window {window} closed for entry {entry}");
        assert!(g.over, "window {window} closed before its grant was over");
        self.finish(slot);
    }

    /// The grant in `slot` is over and nothing more can land in it: its
    /// sample is finished (byte-exact) or failed with the node's ERROR.
    fn finish(&mut self, slot: usize) {
        let g = self.table[slot].expect("granted");
        let i = g.sample;
        assert_eq!(
            self.outcome[i],
            Outcome::Pending,
            "sample {i} finished twice"
        );
        self.outstanding -= 1;
        if g.error {
            self.outcome[i] = Outcome::Failed("the node's ERROR: ReadFailed".into());
            return;
        }
        self.check_bytes(i, "finished");
        self.outcome[i] = Outcome::Landed;
    }

    fn check_bytes(&self, i: usize, when: &str) {
        let at = (i % self.ring_slots) * self.chunk;
        for j in 0..self.samples[i].len {
            assert_eq!(
                self.ring[at + j],
                byte(self.seed, i, j),
                "sample {i} {when}: byte {j} in the ring is not the sample's"
            );
        }
    }

    /// Publishes the finished samples in order (freeing their ring slots).
    fn publish(&mut self) {
        while self.next_publish < self.samples.len() {
            let i = self.next_publish;
            match self.outcome[i] {
                Outcome::Pending => return,
                Outcome::Landed => {
                    self.check_bytes(i, "published");
                    self.outcome[i] = Outcome::Published;
                }
                Outcome::Failed(_) => {}
                Outcome::Published => unreachable!("published twice"),
            }
            let slot = i % self.ring_slots;
            if self.table[slot].is_some_and(|g| g.sample == i) {
                self.table[slot] = None;
            }
            self.next_publish += 1;
        }
    }

    fn violation(&mut self, why: String) {
        assert!(
            self.misbehave.is_some(),
            "a protocol violation from a well-behaved node: {why}"
        );
        self.kill(format!("protocol violation: {why}"));
    }

    /// The connection goes: the QP accepts nothing more; every sample not
    /// finished fails with `why`.
    fn kill(&mut self, why: String) {
        if self.dead.is_some() {
            return;
        }
        if let Err(e) = self.rx.shut() {
            panic!("shutting the in-memory QP: {e}");
        }
        for o in &mut self.outcome {
            if *o == Outcome::Pending {
                *o = Outcome::Failed(why.clone());
            }
        }
        self.outstanding = 0;
        self.dead = Some(why);
    }

    // ---- the checks -----------------------------------------------------

    /// Every write that landed since the last check: inside a grant the
    /// consumer has open, under its key, from a well-behaved request, and
    /// not after the QP was shut.
    fn check_landed(&mut self) {
        let base = self.ring.as_ptr() as u64;
        let (chunk, ring_slots) = (self.chunk, self.ring_slots);
        let (table, lent, dead) = (&self.table, &self.lent, &self.dead);
        let samples = &self.samples;
        let windows = self.windows;
        self.nic.borrow_mut().take_landed(|l| {
            assert_eq!(l.side, OWNER, "the consumer wrote");
            assert!(
                dead.is_none(),
                "a write landed after the QP was shut: {l:?}"
            );
            let (i, bad) = lent[l.wr_id as usize].expect("a write from a lent slot");
            assert!(
                !(bad && windows),
                "a misbehaving write (sample {i}: past its grant, or under the key of a grant \
                 that is over) landed: {l:?}"
            );
            let off = l.addr - base;
            let slot = off as usize / chunk;
            assert!(slot < ring_slots, "a write past the ring: {l:?}");
            let g = table[slot].unwrap_or_else(|| panic!("a write into a free entry: {l:?}"));
            let start = (slot * chunk) as u64;
            let end = start + samples[g.sample].len as u64;
            assert!(
                g.sample == i && !g.over && g.rkey == l.rkey && off + l.len as u64 <= end,
                "a write outside the grant it names (sample {i}, entry holds {}, over {}): {l:?}",
                g.sample,
                g.over
            );
        });
    }

    fn finished(&self) -> bool {
        self.next_publish == self.samples.len()
            && self.owner_idle()
            && (self.dead.is_some() || self.rx.idle())
    }
}

/// One seed's run, its invariants checked; returns what the device and
/// the two fault wrappers did.
fn run_seed(seed: u64) -> (MemStats, QueueFaultStats, QueueFaultStats, bool) {
    let mut r = Run::new(seed);
    const MAX_STEPS: u64 = 400_000;
    let mut step = 0u64;
    while !r.finished() {
        step += 1;
        assert!(
            step < MAX_STEPS,
            "no progress: {} of {} published, {} outstanding, dead {:?}, link busy {}; \
             node: {}; consumer: {}",
            r.next_publish,
            r.samples.len(),
            r.outstanding,
            r.dead,
            r.link.busy(),
            r.nic.borrow().describe(OWNER),
            r.nic.borrow().describe(CONSUMER)
        );
        r.owner(step);
        r.reap();
        r.nic.borrow_mut().step();
        r.check_landed();
        r.consumer(step);
        r.reap();
    }
    let stats = r.nic.borrow().stats;
    if !r.faulty {
        assert!(
            r.dead.is_none(),
            "a connection failed without a fault: {:?}",
            r.dead
        );
        for (i, o) in r.outcome.iter().enumerate() {
            let want = if r.samples[i].error {
                Outcome::Failed("the node's ERROR: ReadFailed".into())
            } else {
                Outcome::Published
            };
            assert_eq!(*o, want, "sample {i}");
        }
    }
    if r.misbehave.is_none() {
        assert_eq!(
            stats.window_races, 0,
            "a window bound or invalidated with a write through its key still queued"
        );
    }
    for (i, o) in r.outcome.iter().enumerate() {
        assert!(
            matches!(o, Outcome::Published | Outcome::Failed(_)),
            "sample {i}: {o:?}"
        );
    }
    // Teardown: both ends stop and drain.
    r.link.close();
    if r.dead.is_none() {
        r.kill("teardown".into());
    }
    let mut drained = false;
    for _ in 0..100_000 {
        r.nic.borrow_mut().step();
        r.check_landed();
        while r.rx.poll().expect("in-memory poll") > 0 {}
        r.reap();
        let nic = r.nic.borrow();
        if nic.in_flight(OWNER) == 0 && nic.in_flight(CONSUMER) == 0 {
            drained = true;
            break;
        }
    }
    assert!(drained, "requests still in flight at teardown");
    while r.rx.poll().expect("in-memory poll") > 0 {}
    r.reap();
    assert!(!r.link.busy(), "the link holds requests at teardown");
    assert_eq!(r.free.len(), r.lent.len(), "staging slots not given back");
    assert_eq!(r.link.capacities(), r.link_caps, "a link pool grew");
    assert_eq!(r.rx.capacities(), r.rx_caps, "a receive-side pool grew");
    r.nic.borrow().check_pools();
    let rebound = r.stale_into_rebound;
    (stats, r.link.queue().stats(), r.rx.queue().stats(), rebound)
}

fn one_seed(seed: u64) {
    run_seed(seed);
}

/// The node's RDMA link into the consumer's RDMA receive side, memory
/// windows and all, over the in-memory verbs, many seeds (bounded in time;
/// `KSPEED_SIM_SEED=n` replays one).
#[test]
fn sim_rdma_rx_over_memory_verbs() {
    let ran = crate::sim::run_seeds("sim_rdma_rx", 1000, Duration::from_secs(60), one_seed);
    assert!(ran > 0);
}

/// The faults the simulation injects do happen (so its invariants were
/// tested against them): over the first 200 seeds, window binds and
/// invalidations, refused and failing window requests, remote access
/// errors (the misbehaving node's writes refused), deaths, and stale
/// writes aimed at a window bound again.
#[test]
fn sim_rdma_rx_faults_are_exercised() {
    let mut total = MemStats::default();
    let (mut node, mut consumer) = (QueueFaultStats::default(), QueueFaultStats::default());
    let mut stale_into_rebound = 0;
    for seed in 0..200 {
        let (nic, o, c, rebound) = run_seed(seed);
        stale_into_rebound += rebound as u32;
        total.add(&nic);
        node.sends_refused += o.sends_refused;
        node.wc_errors += o.wc_errors;
        consumer.mws_refused += c.mws_refused;
        consumer.mw_errors += c.mw_errors;
        consumer.recvs_refused += c.recvs_refused;
    }
    eprintln!(
        "sim_rdma_rx, seeds 0..200: {total:?}; the node's fault wrapper: {node:?}; \
         the consumer's: {consumer:?}; stale writes into a window bound again: \
         {stale_into_rebound}"
    );
    assert!(stale_into_rebound > 0);
    assert!(total.window_ops > 0 && total.window_errors > 0);
    // Invalidations went in chains of more than one.
    assert!(total.unsignalled_invalidations > 0);
    assert!(total.remote_access_errors > 0 && total.deaths > 0);
    assert!(node.sends_refused > 0 && node.wc_errors > 0);
    assert!(consumer.mws_refused > 0 && consumer.mw_errors > 0);
}
