//! One network thread for a node agent's attached ranks: one link to each
//! other node, whatever the number of ranks (issue 28). Each rank's loader,
//! built in the agent, joins it as a lane (`lanes.rs`) instead of
//! connecting to every node and running a network thread of its own; its
//! pollers still read the node's own samples.
//!
//! The thread is started, and connects to every other node, when the first
//! lane joins; it ends, closing its links, when its last lane has left and
//! none is joining (decided under the hub's lock, so a join either reaches
//! the running thread or starts a new one). The agent joins a lane of its
//! own at its start and keeps it until it stops (`agent/cluster.rs`,
//! `KeptLinks`), so its links are made at start and kept across jobs.
//! The HELLO announces a ring at [`super::lanes::SHARED_RING_BASE`] of
//! [`super::lanes::SHARED_RING_LEN`] bytes: over TCP a DATA frame is placed by its grant id, which carries
//! the lane; over RDMA each lane's ring is registered as it joins and each
//! grant's window is bound over it, the grant's offset placing it there
//! (docs/PROTOCOL.md, HELLO).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use crossbeam_channel::{Receiver, Sender, TrySendError};

use super::super::Shared;
use super::connect::{connect_shared, Connected};
use super::lanes::{LaneLeft, MAX_LANES, SHARED_LANE_SHIFT};
use super::tcp::TcpRx;
use super::{Lane, NetSetup, Receive, Thread};
use crate::error::{Error, Result};
use crate::ring::IoBackend;
use crate::sys::EventFd;

/// A lane joining: its loader's run, and what tells the loader it left.
type Join = (Arc<Shared>, LaneLeft);

/// The agent's shared network threads: `threads` of them, each started on
/// demand with its own links; a joining lane goes to the one with the
/// fewest lanes. One thread gives N−1 links per node; over TCP, where a
/// thread receives every byte, more threads read more at once, at
/// `threads` × (N−1) links.
pub(crate) struct NetHub {
    slots: Vec<Arc<HubSlot>>,
}

/// One shared network thread, started on demand.
pub(crate) struct HubSlot {
    /// Every lane's loader notifies it (releases, hand-overs, stops).
    wake: Arc<EventFd>,
    /// Where a joining lane goes while the thread runs.
    running: Mutex<Option<Sender<Join>>>,
    /// Lanes joined and not yet dropped.
    lanes: Arc<AtomicUsize>,
}

/// The thread's side of its hub slot.
pub(super) struct HubSide {
    slot: Arc<HubSlot>,
    joins: Receiver<Join>,
}

impl HubSide {
    /// A lane that joined, if any.
    pub(super) fn try_join(&self) -> Option<Join> {
        self.joins.try_recv().ok()
    }

    /// The last lane left: true (the thread stops) unless one is joining.
    pub(super) fn try_close(&self) -> bool {
        let mut running = self.slot.running.lock().unwrap_or_else(|p| p.into_inner());
        if !self.joins.is_empty() {
            return false;
        }
        *running = None;
        true
    }
}

impl NetHub {
    /// `threads` shared network threads (at least 1), none started yet.
    pub(crate) fn new(threads: usize) -> Result<Arc<Self>> {
        let slots = (0..threads.max(1))
            .map(|_| {
                let wake = EventFd::new().map_err(|e| Error::Serve(format!("eventfd: {e}")))?;
                Ok(Arc::new(HubSlot {
                    wake: Arc::new(wake),
                    running: Mutex::new(None),
                    lanes: Arc::new(AtomicUsize::new(0)),
                }))
            })
            .collect::<Result<_>>()?;
        Ok(Arc::new(NetHub { slots }))
    }

    /// How many shared threads there are.
    pub(crate) fn threads(&self) -> usize {
        self.slots.len()
    }

    /// Thread `k` (modulo the thread count).
    pub(crate) fn slot_at(&self, k: usize) -> Arc<HubSlot> {
        self.slots[k % self.slots.len()].clone()
    }

    /// The thread a new lane joins: the one with the fewest lanes.
    pub(crate) fn slot(&self) -> Arc<HubSlot> {
        self.slots
            .iter()
            .min_by_key(|s| s.lanes.load(Ordering::Acquire))
            .expect("at least one thread")
            .clone()
    }
}

impl HubSlot {
    /// The wake-up every lane's `NetShared` uses.
    pub(crate) fn wake(&self) -> Arc<EventFd> {
        self.wake.clone()
    }

    /// Adds run `sh` (a loader in cluster mode over TCP, its `NetShared`
    /// woken by [`HubSlot::wake`]) as a lane of this shared thread,
    /// starting it (and connecting to every other node with `setup`) if it
    /// does not run. The receiver's channel closes once the lane has left,
    /// after its loader stopped (`sh.stop`) and its grants are over.
    pub(crate) fn join(
        self: &Arc<Self>,
        setup: &NetSetup,
        sh: Arc<Shared>,
    ) -> Result<Receiver<()>> {
        let table = (sh.geo.table_len() as usize).next_power_of_two();
        if table > 1 << SHARED_LANE_SHIFT {
            return Err(Error::InvalidConfig(format!(
                "a ring of {} bytes holds up to {} samples; an agent's shared network \
                 thread takes rings of at most {} (a smaller ring_bytes, or \
                 KSPEED_AGENT_LINKS=per-rank on the agent)",
                sh.geo.ring_bytes,
                sh.geo.table_len(),
                1u64 << SHARED_LANE_SHIFT
            )));
        }
        let (tx, rx) = crossbeam_channel::bounded(1);
        // Counted before the check, so two joins cannot both pass it.
        let n = self.lanes.fetch_add(1, Ordering::AcqRel);
        let left = LaneLeft::new(tx, self.lanes.clone());
        if n >= MAX_LANES {
            return Err(Error::InvalidConfig(format!(
                "an agent's network thread fills at most {MAX_LANES} rank rings at once \
                 (kspeed agent --net-threads adds threads)"
            )));
        }
        let mut running = self.running.lock().unwrap_or_else(|p| p.into_inner());
        let (sh, left) = match running.as_ref() {
            None => (sh, left),
            Some(joins) => match joins.try_send((sh, left)) {
                Ok(()) => {
                    self.wake.notify();
                    return Ok(rx);
                }
                // Full cannot happen (at most MAX_LANES lanes exist);
                // disconnected: the thread ended without closing (a panic).
                Err(TrySendError::Full(j) | TrySendError::Disconnected(j)) => j,
            },
        };
        *running = None;
        let mut s = setup.clone();
        let connected = connect_shared(&mut s)?;
        let peers = s.cluster.nodes.len().saturating_sub(1);
        let s = Arc::new(s);
        let (run, jtx): (Box<dyn FnOnce() + Send>, _) = match connected {
            Connected::Tcp(c) => {
                let mut t = Thread::<TcpRx>::new(sh, s, c)?;
                let jtx = self.share(&mut t, left)?;
                (Box::new(move || t.run()), jtx)
            }
            #[cfg(feature = "rdma")]
            Connected::Rdma(c) => {
                let mut t = Thread::<super::rdma::RdmaRx>::new(sh, s, c)?;
                let jtx = self.share(&mut t, left)?;
                (Box::new(move || t.run()), jtx)
            }
        };
        std::thread::Builder::new()
            .name("kspeed-net-agent".into())
            .spawn(run)
            .map_err(|e| Error::ThreadSpawn {
                thread: "network",
                source: e.into(),
            })?;
        log::info!(
            "agent: a network thread with one link to each of the other {peers} nodes, shared by its attached ranks"
        );
        *running = Some(jtx);
        Ok(rx)
    }

    /// Makes `t` (a thread over its first lane, whose `left` this is) this
    /// slot's shared thread; where later lanes are to be sent.
    fn share<R: Receive, I: IoBackend>(
        self: &Arc<Self>,
        t: &mut Thread<R, I>,
        left: LaneLeft,
    ) -> Result<Sender<Join>> {
        assert!(
            t.l.table.len() <= 1 << SHARED_LANE_SHIFT,
            "grant table of {} entries on a shared thread",
            t.l.table.len()
        );
        let (jtx, jrx) = crossbeam_channel::bounded(MAX_LANES);
        t.l.left = Some(left);
        t.lanes = (0..MAX_LANES).map(|_| None::<Lane>).collect();
        t.lane_shift = SHARED_LANE_SHIFT;
        t.hub = Some(HubSide {
            slot: self.clone(),
            joins: jrx,
        });
        t.lane_regs = (0..MAX_LANES).map(|_| None).collect();
        t.admit_ring()?;
        Ok(jtx)
    }

    /// The simulator's shared thread: `t`, built over its first lane by
    /// `Thread::with_ring`, becomes this slot's running thread (as a
    /// connecting [`HubSlot::join`] makes it); the receiver closes once
    /// that lane has left. Later lanes [`HubSlot::join`] it.
    #[cfg(test)]
    pub(crate) fn sim_adopt<R: Receive, I: IoBackend>(
        self: &Arc<Self>,
        t: &mut Thread<R, I>,
    ) -> Receiver<()> {
        let (tx, rx) = crossbeam_channel::bounded(1);
        self.lanes.fetch_add(1, Ordering::AcqRel);
        let left = LaneLeft::new(tx, self.lanes.clone());
        let jtx = self
            .share(t, left)
            .expect("sim: a TCP lane needs no registration");
        *self.running.lock().unwrap_or_else(|p| p.into_inner()) = Some(jtx);
        rx
    }
}
