//! Each side's view of an attach segment: the agent publishes and waits
//! for room ([`AgentSide`]), the rank takes, waits and releases
//! ([`RankSide`]); both sleep through the one wait loop here. A child of
//! `segment`, so it reaches the layout's private words without making
//! them public.

use std::cell::Cell;
use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::super::shm::{futex_wait, futex_wake_all};
use super::{
    decode_release, in_flight, is_ready, ready_word, release_mark, seg_err, side_state, BatchDesc,
    BatchExtras, BatchReads, BatchWaits, Generation, Segment, Side, EXTRAS_PER_SLOT,
};
use crate::error::{Error, Result};

/// How a side waits: how long one futex sleep lasts at most (it beats its
/// own heartbeat and checks the peer's between sleeps) and how long the
/// peer may be silent before it counts as gone.
#[derive(Debug, Clone, Copy)]
pub struct Liveness {
    /// One futex sleep at most (also the heartbeat period while waiting).
    pub slice: Duration,
    /// The peer is gone after this long without a heartbeat (3 of its
    /// heartbeat periods).
    pub silence_limit: Duration,
}

impl Default for Liveness {
    fn default() -> Self {
        Liveness {
            slice: Duration::from_millis(100),
            silence_limit: Duration::from_millis(300),
        }
    }
}

/// Spins before a side goes to sleep: a batch that is microseconds away
/// is taken without a system call.
const SPINS_BEFORE_SLEEP: u32 = 200;

/// The common wait loop: returns when `ready()` holds; sleeps on `futex`
/// with `waiters` counted; between sleeps beats `me`, runs `check` and
/// checks the peer.
#[allow(clippy::too_many_arguments)]
fn wait_until(
    seg: &Segment,
    me: Side,
    futex: &AtomicU32,
    waiters: &AtomicU32,
    sleeps: &AtomicU64,
    timeouts: &Cell<u64>,
    live: &Liveness,
    deadline: Option<Instant>,
    check: &mut dyn FnMut() -> Result<()>,
    ready: &mut dyn FnMut() -> bool,
) -> Result<()> {
    let started = Instant::now();
    for _ in 0..SPINS_BEFORE_SLEEP {
        if ready() {
            return Ok(());
        }
        std::hint::spin_loop();
    }
    let peer = match me {
        Side::Agent => Side::Rank,
        Side::Rank => Side::Agent,
    };
    loop {
        seg.beat(me);
        let (state, pid, silent_ns) = seg.peer(peer);
        // A failure or a close ends the wait even when data is ahead of
        // it: the peer's error is the answer.
        if state == side_state::FAILED {
            let posted = seg.posted_errors().into_iter().find(|e| e.side == peer);
            let (kind, message) = posted.map_or((String::from("unknown"), String::new()), |e| {
                (e.kind, e.message)
            });
            return Err(Error::AttachPeerError {
                peer: peer.name(),
                kind,
                message,
            });
        }
        if ready() {
            return Ok(());
        }
        if state == side_state::CLOSED {
            return Err(Error::AttachPeerGone {
                peer: peer.name(),
                pid,
                silent_ms: 0,
                closed: true,
            });
        }
        if silent_ns > live.silence_limit.as_nanos() as u64 {
            return Err(Error::AttachPeerGone {
                peer: peer.name(),
                pid,
                silent_ms: silent_ns / 1_000_000,
                closed: false,
            });
        }
        check()?;
        let mut slice = live.slice;
        if let Some(d) = deadline {
            let now = Instant::now();
            if now >= d {
                return Err(Error::AttachTimeout {
                    what: match me {
                        Side::Rank => "ready batch",
                        Side::Agent => "room in the ring",
                    },
                    waited_ms: started.elapsed().as_millis() as u64,
                });
            }
            slice = slice.min(d - now);
        }
        // Dekker with the publisher: count ourselves as a waiter, read
        // the futex word, then (after a SeqCst fence, paired with the
        // publisher's fence between its store and its load of `waiters`)
        // re-check. Either the publisher sees us waiting and bumps the
        // word (so the futex wait returns), or we see its store.
        waiters.fetch_add(1, Ordering::SeqCst);
        let seen = futex.load(Ordering::SeqCst);
        fence(Ordering::SeqCst);
        if ready() {
            waiters.fetch_sub(1, Ordering::SeqCst);
            return Ok(());
        }
        sleeps.store(sleeps.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
        if futex_wait(futex, seen, slice) {
            timeouts.set(timeouts.get() + 1);
        }
        waiters.fetch_sub(1, Ordering::SeqCst);
        if ready() {
            return Ok(());
        }
    }
}

/// The agent's view of one attached rank's segment.
#[derive(Debug)]
pub struct AgentSide {
    seg: Segment,
    gen: Generation,
    /// Batches published (mod 2^48 on the wire; a u64 here).
    published: u64,
    /// Sleeps that lasted their whole slice (no wake came).
    sleep_timeouts: Cell<u64>,
}

impl AgentSide {
    /// Starts publishing into `seg` in generation `gen` (from the ATTACH
    /// message; refused when the header says otherwise).
    pub fn new(seg: Segment, gen: Generation) -> Result<AgentSide> {
        if seg.generation() != Some(gen) {
            return Err(seg_err(format!(
                "the header's generation is {:?}, the ATTACH message says {}",
                seg.generation().map(|g| g.get()),
                gen.get()
            )));
        }
        let a = seg.agent();
        a.published.store(0, Ordering::Relaxed);
        a.published_bytes.store(0, Ordering::Relaxed);
        a.pid.store(std::process::id(), Ordering::Relaxed);
        seg.beat(Side::Agent);
        a.state.store(side_state::RUNNING, Ordering::Release);
        Ok(AgentSide {
            seg,
            gen,
            published: 0,
            sleep_timeouts: Cell::new(0),
        })
    }

    /// The segment.
    pub fn segment(&self) -> &Segment {
        &self.seg
    }

    /// The next sequence to publish.
    pub fn published(&self) -> u64 {
        self.published
    }

    /// Sleeps of this side that lasted their whole slice: no wake came
    /// (the peer was slower than a slice, or a wake was lost).
    pub fn sleep_timeouts(&self) -> u64 {
        self.sleep_timeouts.get()
    }

    /// Batches the rank has released, checked: a mark of this generation
    /// that is not past what was published.
    pub fn released(&self) -> Result<u64> {
        let mark = self.seg.rank().release.load(Ordering::Acquire);
        let Some(rel) = decode_release(mark, self.gen) else {
            // A mark of an earlier generation: nothing released in this one.
            return Ok(0);
        };
        let flight = in_flight(self.published, rel);
        if flight > u64::from(self.seg.slots) {
            return Err(seg_err(format!(
                "the rank's release mark {rel} is not within the {} slots below the {} batches published",
                self.seg.slots, self.published
            )));
        }
        Ok(self.published - flight)
    }

    /// Whether the slot for the next batch is free (no system call).
    pub fn has_room(&self) -> Result<bool> {
        Ok(self.published - self.released()? < u64::from(self.seg.slots))
    }

    /// Waits until the next batch's slot is free: spins, then sleeps on
    /// the room futex; between sleeps beats and checks the rank's
    /// heartbeat and runs `check` (e.g. the socket's hang-up).
    pub fn wait_room(
        &self,
        live: &Liveness,
        deadline: Option<Instant>,
        check: &mut dyn FnMut() -> Result<()>,
    ) -> Result<()> {
        let mut err = None;
        let mut ready = || match self.has_room() {
            Ok(r) => r,
            Err(e) => {
                err = Some(e);
                true
            }
        };
        let r = self.seg.rank();
        let a = self.seg.agent();
        wait_until(
            &self.seg,
            Side::Agent,
            &r.room_futex,
            &a.room_waiters,
            &a.sleeps,
            &self.sleep_timeouts,
            live,
            deadline,
            check,
            &mut ready,
        )?;
        err.map_or(Ok(()), Err)
    }

    /// Waits until the rank has released more than `above` batches (the
    /// agent's pollers wait for ring space, not only for a slot): as
    /// [`AgentSide::wait_room`], on the same futex.
    pub fn wait_released(
        &self,
        above: u64,
        live: &Liveness,
        deadline: Option<Instant>,
        check: &mut dyn FnMut() -> Result<()>,
    ) -> Result<()> {
        let mut err = None;
        let mut ready = || match self.released() {
            Ok(r) => r > above,
            Err(e) => {
                err = Some(e);
                true
            }
        };
        let r = self.seg.rank();
        let a = self.seg.agent();
        wait_until(
            &self.seg,
            Side::Agent,
            &r.room_futex,
            &a.room_waiters,
            &a.sleeps,
            &self.sleep_timeouts,
            live,
            deadline,
            check,
            &mut ready,
        )?;
        err.map_or(Ok(()), Err)
    }

    /// Writes the view words of the next batch to publish (one per
    /// sample, [`super::view_word`] or 0 for a sample in the ring) into its
    /// slot's row; the publish's Release store makes them visible with
    /// it. Call before [`AgentSide::publish`], with room for the batch.
    ///
    /// # Panics
    /// When the segment has no view table or `words` is longer than a row.
    pub fn set_views(&self, words: &[u64]) {
        let row = self.seg.views(self.published);
        assert!(
            words.len() <= row.len(),
            "{} view words for a row of {}",
            words.len(),
            row.len()
        );
        for (w, &v) in row.iter().zip(words) {
            w.store(v, Ordering::Relaxed);
        }
    }

    /// Writes the peer-wait words of the batch about to be published
    /// ([`super::peer_wait_word`], 0 for an empty entry; a shorter `words`
    /// leaves the rest 0). Does nothing where the segment has no
    /// peer-wait table. Call before [`AgentSide::publish`], with room for
    /// the batch.
    pub fn set_peer_waits(&self, words: &[u64]) {
        let row = self.seg.peer_waits(self.published);
        for (i, w) in row.iter().enumerate() {
            w.store(words.get(i).copied().unwrap_or(0), Ordering::Relaxed);
        }
    }

    /// Writes the extra words of the batch about to be published. Does
    /// nothing where the segment has no extras table (layout version 8).
    /// Call before [`AgentSide::publish`], with room for the batch.
    pub fn set_extras(&self, extras: &BatchExtras) {
        let row = self.seg.extras(self.published);
        for (w, v) in row.iter().zip(extras.words()) {
            w.store(v, Ordering::Relaxed);
        }
    }

    /// Publishes the next batch: its descriptor (Relaxed), then its ready
    /// word (Release: the ring bytes and the descriptor are visible to a
    /// rank that Acquires the word), then wakes the rank if it sleeps.
    /// The slot must be free ([`AgentSide::has_room`]); publishing over an
    /// unreleased batch is a bug and panics.
    pub fn publish(&mut self, desc: &BatchDesc) -> Result<u64> {
        assert!(self.has_room()?, "publish without room: a bug in the agent");
        let seq = self.published;
        let s = self.seg.slot(seq);
        s.ring_offset.store(desc.ring_offset, Ordering::Relaxed);
        s.bytes.store(desc.bytes, Ordering::Relaxed);
        s.epoch.store(desc.epoch, Ordering::Relaxed);
        s.batch_in_epoch
            .store(desc.batch_in_epoch, Ordering::Relaxed);
        // A batch holds at most MAX_BATCH_SIZE samples (a u32 in the slot).
        let samples = u32::try_from(desc.samples).expect("a batch's sample count fits a u32");
        s.samples.store(samples, Ordering::Relaxed);
        s.failovers.store(desc.reads.failovers, Ordering::Relaxed);
        s.disk_reads.store(desc.reads.disk_reads, Ordering::Relaxed);
        s.tier_hits.store(desc.reads.tier_hits, Ordering::Relaxed);
        s.remote_samples
            .store(desc.reads.remote_samples, Ordering::Relaxed);
        s.source_reads
            .store(desc.reads.source_reads, Ordering::Relaxed);
        s.cache_hits.store(desc.reads.cache_hits, Ordering::Relaxed);
        for (w, &v) in s.read_latency.iter().zip(&desc.reads.read_latency) {
            w.store(v, Ordering::Relaxed);
        }
        for (w, v) in s.waits_us.iter().zip(desc.reads.waits.to_array()) {
            w.store(v, Ordering::Relaxed);
        }
        s.ready.store(ready_word(self.gen, seq), Ordering::Release);
        self.published = seq + 1;
        let a = self.seg.agent();
        a.published.store(self.published, Ordering::Relaxed);
        a.published_bytes.store(
            a.published_bytes.load(Ordering::Relaxed) + desc.bytes,
            Ordering::Relaxed,
        );
        // The store-load half of the Dekker pair (see wait_until).
        fence(Ordering::SeqCst);
        if self.seg.rank().ready_waiters.load(Ordering::Relaxed) > 0 {
            a.ready_futex.fetch_add(1, Ordering::SeqCst);
            futex_wake_all(&a.ready_futex);
            a.wakes
                .store(a.wakes.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
        }
        Ok(seq)
    }

    /// Records the agent's heartbeat (CLOCK_MONOTONIC ns).
    pub fn beat(&self) {
        self.seg.beat(Side::Agent);
    }

    /// Marks the agent's side closed (a clean detach): the rank's waits
    /// end with [`Error::AttachPeerGone`] `closed: true`.
    pub fn close(&self) {
        self.seg.close(Side::Agent);
    }
}

/// The rank's view of its own segment.
#[derive(Debug)]
pub struct RankSide {
    seg: Segment,
    gen: Generation,
    /// The next batch to take.
    taken: u64,
    /// Batches released.
    released: u64,
    /// Sleeps that lasted their whole slice (no wake came).
    sleep_timeouts: Cell<u64>,
}

impl RankSide {
    /// Starts taking batches from `seg` in its current generation, from
    /// sequence 0.
    pub fn new(seg: Segment) -> Result<RankSide> {
        let gen = seg
            .generation()
            .ok_or_else(|| seg_err("generation 0 in the header"))?;
        let r = seg.rank();
        r.release.store(release_mark(gen, 0), Ordering::Release);
        r.taken.store(0, Ordering::Relaxed);
        r.pid.store(std::process::id(), Ordering::Relaxed);
        seg.beat(Side::Rank);
        r.state.store(side_state::RUNNING, Ordering::Release);
        Ok(RankSide {
            seg,
            gen,
            taken: 0,
            released: 0,
            sleep_timeouts: Cell::new(0),
        })
    }

    /// The segment.
    pub fn segment(&self) -> &Segment {
        &self.seg
    }

    /// The generation.
    pub fn generation(&self) -> Generation {
        self.gen
    }

    /// Batches taken so far (the next one's sequence).
    pub fn taken(&self) -> u64 {
        self.taken
    }

    /// Sleeps of this side that lasted their whole slice: no wake came
    /// (the peer was slower than a slice, or a wake was lost).
    pub fn sleep_timeouts(&self) -> u64 {
        self.sleep_timeouts.get()
    }

    /// View word `i` of the batch taken last (0 where the segment has no
    /// view table): stable until that batch is released, since the agent
    /// rewrites a slot's row only for a batch published into it after.
    pub fn taken_view(&self, i: usize) -> u64 {
        let row = self.seg.views(self.taken.wrapping_sub(1));
        row.get(i).map_or(0, |w| w.load(Ordering::Relaxed))
    }

    /// Peer-wait word `i` of the batch taken last (0 where the segment
    /// has no peer-wait table), stable as [`RankSide::taken_view`]'s.
    pub fn taken_peer_wait(&self, i: usize) -> u64 {
        let row = self.seg.peer_waits(self.taken.wrapping_sub(1));
        row.get(i).map_or(0, |w| w.load(Ordering::Relaxed))
    }

    /// The extra words of the batch taken last, decoded (all zero where
    /// the segment has no extras table), stable as
    /// [`RankSide::taken_view`]'s; an error names a word out of its range.
    pub fn taken_extras(&self) -> std::result::Result<BatchExtras, String> {
        let row = self.seg.extras(self.taken.wrapping_sub(1));
        if row.is_empty() {
            return Ok(BatchExtras::default());
        }
        let words: [u64; EXTRAS_PER_SLOT as usize] =
            std::array::from_fn(|i| row.get(i).map_or(0, |w| w.load(Ordering::Relaxed)));
        BatchExtras::from_words(&words)
    }

    /// The next batch's descriptor if it is ready (one Acquire load; no
    /// system call); it is then taken.
    pub fn try_take(&mut self) -> Option<BatchDesc> {
        let s = self.seg.slot(self.taken);
        if !is_ready(s.ready.load(Ordering::Acquire), self.gen, self.taken) {
            return None;
        }
        let d = BatchDesc {
            ring_offset: s.ring_offset.load(Ordering::Relaxed),
            bytes: s.bytes.load(Ordering::Relaxed),
            epoch: s.epoch.load(Ordering::Relaxed),
            batch_in_epoch: s.batch_in_epoch.load(Ordering::Relaxed),
            samples: u64::from(s.samples.load(Ordering::Relaxed)),
            reads: BatchReads {
                failovers: s.failovers.load(Ordering::Relaxed),
                disk_reads: s.disk_reads.load(Ordering::Relaxed),
                tier_hits: s.tier_hits.load(Ordering::Relaxed),
                remote_samples: s.remote_samples.load(Ordering::Relaxed),
                source_reads: s.source_reads.load(Ordering::Relaxed),
                cache_hits: s.cache_hits.load(Ordering::Relaxed),
                read_latency: std::array::from_fn(|i| s.read_latency[i].load(Ordering::Relaxed)),
                waits: BatchWaits::from_array(std::array::from_fn(|i| {
                    s.waits_us[i].load(Ordering::Relaxed)
                })),
            },
        };
        self.taken += 1;
        let r = self.seg.rank();
        r.taken.store(self.taken, Ordering::Relaxed);
        Some(d)
    }

    /// Waits for the next batch: spins, then sleeps on the ready futex;
    /// between sleeps beats, checks the agent's heartbeat and state, and
    /// runs `check`.
    pub fn wait_take(
        &mut self,
        live: &Liveness,
        deadline: Option<Instant>,
        check: &mut dyn FnMut() -> Result<()>,
    ) -> Result<BatchDesc> {
        if let Some(d) = self.try_take() {
            return Ok(d);
        }
        let (gen, seq) = (self.gen, self.taken);
        let slot = self.seg.slot(seq);
        let mut ready = || is_ready(slot.ready.load(Ordering::Acquire), gen, seq);
        let (a, r) = (self.seg.agent(), self.seg.rank());
        wait_until(
            &self.seg,
            Side::Rank,
            &a.ready_futex,
            &r.ready_waiters,
            &r.sleeps,
            &self.sleep_timeouts,
            live,
            deadline,
            check,
            &mut ready,
        )?;
        Ok(self
            .try_take()
            .expect("a ready word seen stays until released"))
    }

    /// Releases every batch below `count` (taken ones only, in order):
    /// one Release store of the mark, then wakes the agent if it sleeps.
    pub fn release(&mut self, count: u64) {
        assert!(
            count >= self.released && count <= self.taken,
            "release {count}: released {} taken {} (a bug in the loader)",
            self.released,
            self.taken
        );
        self.released = count;
        let r = self.seg.rank();
        r.release
            .store(release_mark(self.gen, count), Ordering::Release);
        fence(Ordering::SeqCst);
        if self.seg.agent().room_waiters.load(Ordering::Relaxed) > 0 {
            r.room_futex.fetch_add(1, Ordering::SeqCst);
            futex_wake_all(&r.room_futex);
            r.wakes
                .store(r.wakes.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
        }
    }

    /// Records the rank's heartbeat (CLOCK_MONOTONIC ns).
    pub fn beat(&self) {
        self.seg.beat(Side::Rank);
    }

    /// Marks the rank's side closed (a clean detach).
    pub fn close(&self) {
        self.seg.close(Side::Rank);
    }

    /// Gives the segment back (to begin a new generation and re-attach).
    pub fn into_segment(self) -> Segment {
        self.seg
    }
}
