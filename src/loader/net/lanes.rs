//! A network thread's lanes: the rings it fills. A loader's own thread has
//! one, its run. A node agent's shared thread (`hub.rs`) has one per
//! attached rank's run, all over one set of connections: one link to each
//! other node whatever the number of ranks.
//!
//! The grant-table code works on the active lane, [`Thread::l`]; the others
//! wait in `Thread::lanes`. Whatever names a lane makes it active first: a
//! grant id carries its lane's index in its top bits (from
//! `Thread::lane_shift` up: 6 bits on a shared thread, none on a loader's
//! own), a DATA payload's receive and a source read carry it in their
//! tokens. Activating moves two lanes' state (a few pointers), so the code
//! that places, fails over and publishes grants needs no lane index
//! threaded through every call, and a lane costs nothing while idle.
//!
//! A lane leaves when its loader stops: it takes no new grant and drops
//! the ones not placed, and it stays until every grant it gave a node is
//! over (all bytes in, ERROR, or the connection gone) and its source reads
//! are back, since a node writes into its ring until then. Dropping it
//! drops the loader's run state, which the loader waits for.

use std::sync::Arc;
use std::time::Instant;

use super::super::schedule::{Cursor, Placed};
use super::super::Shared;
use super::grants::{GSlot, NONE};
use super::{source, Receive, Thread};
use crate::error::Error;
use crate::ring::IoBackend;

/// Lanes one shared thread fills at once: grant ids carry the index in 6
/// bits (`SHARED_LANE_SHIFT`), leaving 25 for the table index.
pub const MAX_LANES: usize = 64;
/// Where a shared thread's grant ids put the lane index.
pub const SHARED_LANE_SHIFT: u32 = 25;
/// The ring a shared link announces in its HELLO: at this address, this
/// long (the whole user address space above its first page, where no ring
/// can be). Over TCP a DATA frame is placed by its grant, the offset only
/// checked against the lane's; over RDMA a grant's offset is its ring's
/// address minus this plus the sample's place, and the window bound to
/// exactly that range is what opens it.
#[cfg_attr(not(feature = "rdma"), allow(dead_code))]
pub(crate) const SHARED_RING_BASE: u64 = 4096;
/// See [`SHARED_RING_BASE`].
pub(crate) const SHARED_RING_LEN: u64 = 1 << 57;

/// Held by a lane of a shared thread; dropped with it. The loader waits
/// for the channel to close; the hub counts the lanes.
pub(crate) struct LaneLeft {
    _left: crossbeam_channel::Sender<()>,
    lanes: Arc<std::sync::atomic::AtomicUsize>,
}

impl LaneLeft {
    /// Closes `left` and takes one from `lanes` when dropped.
    pub(super) fn new(
        left: crossbeam_channel::Sender<()>,
        lanes: Arc<std::sync::atomic::AtomicUsize>,
    ) -> Self {
        LaneLeft { _left: left, lanes }
    }
}

impl Drop for LaneLeft {
    fn drop(&mut self) {
        self.lanes.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
    }
}

/// One ring the network thread fills: a loader's run, with its schedule,
/// flow control, grant table and source reads.
pub(crate) struct Lane {
    pub(super) sh: Arc<Shared>,
    pub(super) cursor: Cursor,
    pub(super) pending: Option<Placed>,
    pub(super) table: Box<[GSlot]>,
    pub(super) mask: usize,
    /// Grants to place again (table indices), oldest first.
    pub(super) regrant: std::collections::VecDeque<usize>,
    /// The source fallback's reads (`source.rs`).
    pub(super) sources: source::SourceReads,
    /// Source files the fallback read from, kept open across samples.
    pub(super) source_fds: super::super::fdcache::FdCache,
    /// (g, why) of the handed-over local samples not yet served: why this
    /// node's own copy failed, for the error if no other copy can serve it.
    pub(super) local_errors: Vec<(u64, String)>,
    /// The epoch of the newest sample granted (demotions end with it).
    pub(super) epoch: Option<u64>,
    /// This node's own failed reads in the window that began at
    /// `local_errors_since` (demotion, as for a node).
    pub(super) local_error_count: u32,
    pub(super) local_errors_since: Instant,
    /// Its loader stopped: it waits for its grants to be over.
    pub(super) leaving: bool,
    /// A shared thread's lane: dropped with it, which the loader waits
    /// for (the receiver sees the channel close), and the hub's count.
    pub(super) left: Option<LaneLeft>,
}

impl Lane {
    /// The lane of a loader's run `sh`, its clocks at `now`; `left`: a
    /// shared thread's.
    pub(super) fn new(sh: Arc<Shared>, now: Instant, left: Option<LaneLeft>) -> Self {
        let size = (sh.geo.table_len() as usize).next_power_of_two();
        // Grant ids keep the low 31 bits of a sequence number (grants::grant_id),
        // a shared thread's the low 25: the table index must fit in them.
        let bits = if left.is_some() {
            SHARED_LANE_SHIFT
        } else {
            31
        };
        assert!(size <= 1 << bits, "grant table of {size} entries");
        Lane {
            cursor: sh.cursor(),
            pending: None,
            table: vec![GSlot::FREE; size].into_boxed_slice(),
            mask: size - 1,
            regrant: std::collections::VecDeque::with_capacity(size),
            sources: source::SourceReads::new(sh.input.catalog().source_spec().is_remote()),
            source_fds: super::super::fdcache::FdCache::new(16),
            local_errors: Vec::new(),
            epoch: None,
            local_error_count: 0,
            local_errors_since: now,
            leaving: false,
            left,
            sh,
        }
    }

    /// Nothing of it is with a node or the source any more.
    fn drained(&self) -> bool {
        !self.sources.busy() && !self.table.iter().any(|s| s.live && s.node != NONE)
    }

    /// Its loader stopped: no new grant, and the entries not with a node
    /// (waiting to be placed again) are dropped.
    fn leave(&mut self) {
        self.leaving = true;
        self.pending = None;
        for idx in self.regrant.drain(..) {
            self.table[idx].live = false;
        }
        for (idx, s) in self.table.iter_mut().enumerate() {
            if s.live && s.node == NONE && !self.sources.reading(idx) {
                s.live = false;
            }
        }
    }
}

impl Drop for Lane {
    fn drop(&mut self) {
        // A shared thread that panics drops its lanes while unwinding: each
        // loader learns it here (a loader's own thread has its CrashGuard).
        if self.left.is_some() && std::thread::panicking() {
            self.sh
                .fail_run(Error::ThreadPanicked { thread: "network" });
        }
    }
}

/// Ring address of `entry` (lane and table index, [`Thread::entry`], the
/// lane from bit `lane_shift` up), `l` being the active lane `active` and
/// `lanes` the others: where the rest of a DATA payload for it is received.
pub(super) fn entry_ptr(
    l: &Lane,
    lanes: &[Option<Lane>],
    active: usize,
    lane_shift: u32,
    entry: usize,
) -> *mut u8 {
    let lane = entry >> lane_shift;
    let lane = if lane == active {
        l
    } else {
        lanes[lane]
            .as_ref()
            .expect("a payload for a lane that left")
    };
    let s = &lane.table[entry & ((1 << lane_shift) - 1)];
    super::ring_ptr(&lane.sh.ring, s.phys + s.received as u64)
}

impl<R: Receive, I: IoBackend> Thread<R, I> {
    /// Makes lane `k` the active one; false when there is no lane `k`.
    pub(super) fn activate(&mut self, k: usize) -> bool {
        if k == self.active {
            return true;
        }
        let Some(lane) = self.lanes.get_mut(k).and_then(Option::take) else {
            return false;
        };
        let was = std::mem::replace(&mut self.l, lane);
        self.lanes[self.active] = Some(was);
        self.active = k;
        true
    }

    /// Lane places to visit with [`Thread::activate`] (one on a loader's
    /// own thread).
    pub(super) fn lane_places(&self) -> usize {
        self.lanes.len().max(1)
    }

    /// The lane grant id `grant` names.
    pub(super) fn lane_of(&self, grant: u32) -> usize {
        (grant >> self.lane_shift) as usize
    }

    /// The GRANT id of the active lane's sample at sequence number `g`:
    /// the lane index above `lane_shift`, the sequence number's low bits
    /// below (`grants::grant_id` on a loader's own thread).
    pub(super) fn grant_id(&self, g: u64) -> u32 {
        if self.lane_shift >= 31 {
            return super::grants::grant_id(g);
        }
        let low = (1u32 << self.lane_shift) - 1;
        ((self.active as u32) << self.lane_shift) | (g as u32 & low)
    }

    /// Table index `idx` of the active lane as an entry naming its lane
    /// (the lane from bit `lane_shift` up, as in grant ids: below 2^31, so
    /// it fits the u32 an RDMA window keeps).
    pub(super) fn entry(&self, idx: usize) -> usize {
        (self.active << self.lane_shift) | idx
    }

    /// Makes `entry`'s lane active; its table index.
    pub(super) fn activate_entry(&mut self, entry: usize) -> usize {
        let ok = self.activate(entry >> self.lane_shift);
        debug_assert!(ok, "an entry of a lane that left");
        entry & ((1 << self.lane_shift) - 1)
    }

    /// A shared thread: takes the lanes that joined and lets go of those
    /// whose loader stopped once their grants are over. True when the
    /// thread is to stop (no lane left and none joining).
    pub(super) fn lanes_tick(&mut self) -> bool {
        let now = self.ring.now();
        if self.hub.is_none() {
            return false;
        }
        let mut joined = false;
        while let Some((sh, left)) = self.hub.as_ref().and_then(|h| h.try_join()) {
            joined = true;
            let free = (0..self.lanes.len()).find(|&k| k != self.active && self.lanes[k].is_none());
            let free = free.expect("the hub admits at most MAX_LANES lanes");
            self.lanes[free] = Some(Lane::new(sh, now, Some(left)));
            let ok = self.activate(free);
            debug_assert!(ok, "the lane just placed");
            if let Err(e) = self.admit_ring() {
                // Its loader fails with why; the lane leaves at once (it
                // granted nothing) below.
                log::error!("agent network thread: a rank's ring cannot join: {e}");
                self.l.sh.fail_run(e);
                self.l.leave();
            }
        }
        if joined {
            self.dial_dead_now();
        }
        for k in 0..self.lanes.len() {
            if !self.activate(k) {
                continue;
            }
            if !self.l.leaving && self.l.sh.stop.load(std::sync::atomic::Ordering::Acquire) {
                self.l.leave();
            }
            if !self.l.leaving || !self.l.drained() {
                continue;
            }
            // Drop it (its ring's registration first: no window of its is
            // bound any more): swap another lane in, or stop with none left.
            self.release_ring(k);
            match (0..self.lanes.len()).find(|&j| self.lanes[j].is_some()) {
                Some(j) => {
                    let next = self.lanes[j].take().expect("found");
                    drop(std::mem::replace(&mut self.l, next));
                    self.active = j;
                }
                None => {
                    let hub = self.hub.as_ref().expect("a shared thread");
                    if hub.try_close() {
                        return true;
                    }
                }
            }
        }
        false
    }

    /// A shared thread: gives every connection the active lane's ring
    /// (RDMA: registers it, for windows to bind over).
    pub(super) fn admit_ring(&mut self) -> crate::error::Result<()> {
        let reg = R::register_ring(&self.common, &self.l.sh.ring)?;
        for c in &mut self.conns {
            if let Some(d) = c.data.as_mut() {
                d.set_ring(self.active, Some(&reg));
            }
        }
        self.lane_regs[self.active] = Some(reg);
        Ok(())
    }

    /// Takes lane `k`'s ring back from every connection and drops its
    /// registration (no window of it is bound: its grants are over).
    fn release_ring(&mut self, k: usize) {
        for c in &mut self.conns {
            if let Some(d) = c.data.as_mut() {
                d.set_ring(k, None);
            }
        }
        if let Some(r) = self.lane_regs.get_mut(k) {
            *r = None;
        }
    }

    /// A new connection (redialled) gets every lane's ring.
    pub(super) fn give_rings(&mut self, i: usize) {
        let Some(d) = self.conns[i].data.as_mut() else {
            return;
        };
        for (k, reg) in self.lane_regs.iter().enumerate() {
            if let Some(reg) = reg {
                d.set_ring(k, Some(reg));
            }
        }
    }

    /// Whether the active lane's loader stopped (a loader's own thread
    /// then stops).
    pub(super) fn lane_stopped(&self) -> bool {
        self.l.sh.stop.load(std::sync::atomic::Ordering::Acquire)
    }
}
