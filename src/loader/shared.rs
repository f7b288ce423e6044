//! State shared by one run's consumer, pollers and network thread: the
//! input, the ready table and its wake protocol, flow control
//! ([`Shared::writable`]) and the crash guard.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;

use super::net;
use super::schedule::{Cursor, Deal, Geometry, Placed};
use super::tier::Tier;
use crate::dataset::{Catalog, Space};
use crate::error::Error;
use crate::landing::LandingRing;
use crate::ring::FaultConfig;
use crate::sampler::Position;
#[cfg(test)]
use crate::sampler::Sampler;

pub(crate) const CODE_OK: u64 = 0;
pub(crate) const CODE_ERROR: u64 = 1;
/// Ready, and its bytes are in the memory tier, not in the ring slot
/// (`tier_views`).
pub(crate) const CODE_TIER: u64 = 2;

/// How a published sample came (the `via` beside its ready word): what a
/// wait for it is charged to ([`super::StallCauses`]).
pub(crate) const VIA_DISK: u32 = 0;
/// From the memory tier.
pub(crate) const VIA_TIER: u32 = 1;
/// From the source (a partial space's sample, a bucket, or the last
/// resort in cluster mode).
pub(crate) const VIA_SOURCE: u32 = 2;
/// From peer node `n`, its first holder: `VIA_PEER + n`.
pub(crate) const VIA_PEER: u32 = 4;
/// With `VIA_PEER + n`: the sample failed over from node `n` (its first
/// holder, or this node when its own read failed) to another replica or
/// the source.
pub(crate) const VIA_FAILOVER: u32 = 1 << 31;

/// A sample's split word (beside `via`) when its node reported no times
/// (`stall_causes::phase_split` never makes it).
pub(crate) const SPLIT_NONE: u32 = u32::MAX;

/// `VIA_PEER + node`, with the failover bit when `failover`.
pub(crate) fn via_peer(node: u32, failover: bool) -> u32 {
    debug_assert!(node < VIA_FAILOVER - VIA_PEER, "node index {node}");
    (VIA_PEER + node) | if failover { VIA_FAILOVER } else { 0 }
}

/// Where samples are read from.
pub(crate) enum Input {
    /// A preloaded space: packed, aligned extents (O_DIRECT).
    Space {
        /// Shared: the node agent opens and checks its space once and
        /// hands it to every attached rank's loader.
        space: Arc<Space>,
        /// Open extent files (registered with every poller's ring; empty
        /// in an attached rank, which reads nothing itself).
        extents: Arc<[std::fs::File]>,
    },
    /// Source files directly, through the page cache.
    Source {
        catalog: Arc<Catalog>,
        root: PathBuf,
    },
    /// Several datasets side by side in one id space (a mixture, single
    /// node): dataset `d`'s sample `i` is id `offsets[d] + i`.
    Mix(Box<MixInput>),
}

/// The datasets of a mixture, each a space or a source.
pub(crate) struct MixInput {
    /// Each dataset's input (never a mixture itself).
    pub(crate) parts: Vec<Input>,
    /// Each dataset's first global id.
    pub(crate) offsets: Vec<u64>,
    /// Each space's first extent among the extents registered with the
    /// pollers' rings (all parts' extents, in part order).
    pub(crate) extent_base: Vec<u32>,
    /// Each source's first file key in a poller's descriptor cache.
    pub(crate) file_base: Vec<u32>,
    /// The mixture's identity: a hash of every catalog's.
    pub(crate) identity: u32,
}

/// A mixture's tier holds ids of its datasets side by side.
impl super::tier::TierSamples for Input {
    fn ids(&self) -> u64 {
        self.len()
    }

    fn len_crc(&self, id: u64) -> (u32, u32) {
        let s = self.sample(id);
        (s.len, s.crc32c)
    }
}

impl Input {
    /// The catalog (a mixture's first dataset's: per-id lookups go
    /// through [`Input::sample`]).
    pub(crate) fn catalog(&self) -> &Catalog {
        match self {
            Input::Space { space, .. } => space.catalog(),
            Input::Source { catalog, .. } => catalog,
            Input::Mix(m) => m.parts[0].catalog(),
        }
    }

    /// The dataset of global id `id`: its index, input and local id.
    pub(crate) fn part(&self, id: u64) -> (usize, &Input, u64) {
        match self {
            Input::Mix(m) => {
                let d = m.offsets.partition_point(|&o| o <= id) - 1;
                (d, &m.parts[d], id - m.offsets[d])
            }
            _ => (0, self, id),
        }
    }

    /// Sample `id`'s catalog entry (its `id` and `file` are its
    /// dataset's own).
    pub(crate) fn sample(&self, id: u64) -> crate::dataset::Sample {
        let (_, input, local) = self.part(id);
        input.catalog().sample(local)
    }

    /// Sample `id`'s dataset's catalog, its entry there, and its file's key
    /// among every dataset's files (a descriptor cache's key).
    pub(crate) fn source_sample(&self, id: u64) -> (&Catalog, crate::dataset::Sample, u32) {
        let (d, input, local) = self.part(id);
        let base = match self {
            Input::Mix(m) => m.file_base[d],
            _ => 0,
        };
        let cat = input.catalog();
        let s = cat.sample(local);
        (cat, s, base + s.file)
    }

    /// The id sample `id` has in its own dataset: what its holders are
    /// computed from (each space of a mixture was placed by its own ids).
    pub(crate) fn placed_id(&self, id: u64) -> u64 {
        self.part(id).2
    }

    /// Samples this node's spaces hold (every sample without a space:
    /// sources are read whole).
    pub(crate) fn held_samples(&self) -> u64 {
        match self {
            Input::Space { space, .. } => space.held_samples(),
            Input::Source { .. } => 0,
            Input::Mix(m) => m.parts.iter().map(|p| p.held_samples()).sum(),
        }
    }

    /// Samples in every dataset together.
    pub(crate) fn len(&self) -> u64 {
        match self {
            Input::Mix(m) => m.parts.iter().map(|p| p.len()).sum(),
            _ => self.catalog().len(),
        }
    }

    /// The largest sample of any dataset.
    pub(crate) fn max_sample_bytes(&self) -> u32 {
        match self {
            Input::Mix(m) => m
                .parts
                .iter()
                .map(|p| p.max_sample_bytes())
                .max()
                .unwrap_or(0),
            _ => self.catalog().max_sample_bytes(),
        }
    }

    /// What positions record: the catalog's identity, or the mixture's.
    pub(crate) fn identity(&self) -> u32 {
        match self {
            Input::Mix(m) => m.identity,
            _ => self.catalog().identity(),
        }
    }

    /// Whether any dataset is read from its source files (a partial
    /// space's samples it does not hold included).
    pub(crate) fn has_source(&self) -> bool {
        match self {
            Input::Space { space, .. } => space.params().is_partial(),
            Input::Source { .. } => true,
            Input::Mix(m) => m.parts.iter().any(|p| p.has_source()),
        }
    }

    /// Source files over every dataset (a poller's descriptor cache keys).
    pub(crate) fn file_count(&self) -> u64 {
        match self {
            Input::Mix(m) => m.parts.iter().map(|p| p.file_count()).sum(),
            _ => self.catalog().file_count(),
        }
    }
}

/// Per-poller counters.
pub(crate) struct PollerStats {
    pub(crate) disk_reads: AtomicU64,
    /// Samples a partial space does not hold, read from its source, and
    /// their bytes.
    pub(crate) source_reads: AtomicU64,
    pub(crate) source_bytes: AtomicU64,
    pub(crate) tier_hits: AtomicU64,
    pub(crate) retries: AtomicU64,
    /// Ticks longer than the stall threshold (`crate::stall`).
    pub(crate) loop_stalls: AtomicU64,
    pub(crate) latency: Mutex<Histogram<u64>>,
    /// The same reads by [`crate::agent::segment::latency_bucket`], counted
    /// as they complete: what the node agent's feeder sends an attached
    /// rank with each batch (`latency` is published only every 100 ms).
    pub(crate) latency_buckets: [AtomicU64; crate::agent::segment::LATENCY_BUCKETS],
}

#[derive(Debug, Clone)]
pub(crate) struct PollerConfig {
    pub(crate) pollers: usize,
    pub(crate) queue_depth: u32,
    pub(crate) submit_batch: u32,
    pub(crate) max_read_bytes: u64,
    pub(crate) lookahead: u64,
    pub(crate) spin: Duration,
    pub(crate) sqpoll_idle_ms: Option<u32>,
    pub(crate) verify_crc32c: bool,
    pub(crate) faults: Option<FaultConfig>,
    /// Tier members already filled are published as [`CODE_TIER`] without
    /// a copy; the consumer hands out a view into the tier.
    pub(crate) tier_views: bool,
}

/// A group's cache level in memory above the area (`cache_memory_bytes`).
pub(crate) const CACHE_MEMORY: usize = 0;
/// A group's cache level of the area itself (`cache_dir`).
pub(crate) const CACHE_AREA: usize = 1;

/// State shared by the consumer and the pollers of one run (from a start
/// position until a restart or the end).
pub(crate) struct Shared {
    pub(crate) input: Input,
    pub(crate) ring: LandingRing,
    pub(crate) geo: Geometry,
    /// The rank's sequence and each epoch's steps.
    pub(crate) deal: Deal,
    pub(crate) start: Position,
    /// Sequence number of the first sample of the loader's end epoch
    /// ([`super::LoaderBuilder::end_epoch`]; `u64::MAX` without one): no
    /// sample from there on is writable, so the pollers and the network
    /// thread stop at the job's last sample instead of reading ahead into
    /// an epoch nobody asks for.
    pub(crate) end_g: u64,
    pub(crate) cfg: PollerConfig,
    /// The pollers' registrations of the ring (registration.rs).
    pub(crate) registration: Arc<super::registration::RingRegistration>,
    pub(crate) fixed_files: bool,
    /// Indexed by g mod table length: ((g + 1) << 8) | code once g is ready.
    pub(super) ready: Box<[AtomicU64]>,
    /// Beside `ready`: how the sample came (`VIA_*`), stored before its
    /// ready word, so a consumer that sees the word sees this too.
    pub(super) via: Box<[AtomicU32]>,
    /// Beside `ready`, for samples a peer served: the shares of its grant's
    /// time the node spent reading and sending, the rest the link's
    /// (`stall_causes::phase_split`; `SPLIT_NONE` when the node reported
    /// no times). Stored before the ready word, as `via`.
    pub(super) split: Box<[AtomicU32]>,
    /// Beside `ready`, for samples that came from the source only: when
    /// the sample was published, in microseconds since `clock0` (the
    /// consumer's prefetch lead time, [`super::Stats::source_lead`]).
    pub(super) ready_us: Box<[AtomicU64]>,
    /// The run's clock origin for `ready_us`.
    pub(super) clock0: Instant,
    /// Per poller: (slot end, g) of the sample it parked waiting for, or
    /// (0, _) when it is not parked on flow control. A release wakes only
    /// the pollers whose sample it made writable.
    pub(super) parked: Box<[(AtomicU64, AtomicU64)]>,
    pub(crate) released_v: AtomicU64,
    pub(crate) released_g: AtomicU64,
    pub(crate) stop: AtomicBool,
    /// Whether the pollers may read: false from a local loader's build
    /// until its first batch is asked for ([`super::Loader`]'s `asked`),
    /// so a restore right after the build moves where they start instead
    /// of waiting for reads begun at the old start; they wait parked.
    pub(crate) go: AtomicBool,
    /// Bumped by a poller that publishes the sample the consumer sleeps on;
    /// the consumer futex-waits on it (no lock, no thread handle, so the
    /// loader may move between threads).
    pub(super) wake_seq: AtomicU32,
    pub(super) waiting_for: AtomicU64,
    pub(crate) errors: Mutex<Vec<(u64, Error)>>,
    /// Samples marked ready without error in this run: with what the
    /// consumer took, the read-ahead now, without scanning `ready`.
    pub(crate) published_ok: AtomicU64,
    pub(crate) stats: Vec<PollerStats>,
    pub(crate) tier: Option<Arc<Tier>>,
    /// Cluster mode: the network thread's side of things.
    pub(crate) net: Option<net::NetShared>,
    /// Cluster mode over partial spaces: who holds what (`NetSetup::partial`).
    pub(crate) partial: Option<Arc<crate::dataset::PartialHolders>>,
    /// The NVMe cache area and this run's planner (`cache_dir`).
    pub(crate) cache: Option<super::cache_run::RunCache>,
    /// The memory level above it (`cache_memory_bytes`): an area in
    /// memory read before `cache`, with its own planner.
    pub(crate) cache_memory: Option<super::cache_run::RunCache>,
    /// Set when a poller or the network thread died (a panic, or a ring
    /// that stopped working), so the consumer fails with this instead of
    /// waiting for samples that will never come.
    pub(super) dead: Mutex<Option<Error>>,
}

impl Shared {
    /// A cursor at the run's start: the schedule every thread of the run
    /// computes alike.
    pub(crate) fn cursor(&self) -> Cursor {
        Cursor::with_deal(self.deal.clone(), self.geo, self.start)
    }
}

/// Lives on a worker thread's stack: if the thread unwinds, it records the
/// crash and wakes the consumer.
pub(super) struct CrashGuard {
    pub(super) shared: Arc<Shared>,
    pub(super) name: &'static str,
}

impl Drop for CrashGuard {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.shared
                .fail_run(Error::ThreadPanicked { thread: self.name });
        }
    }
}

/// Records sample `g`'s error for the consumer. A poisoned lock (a thread
/// that panicked while holding it) is used anyway: the list is a plain
/// Vec, whole after any push, and the panic itself is reported through
/// `dead`; the pollers and the network thread must not panic in turn.
pub(crate) fn push_error(errors: &Mutex<Vec<(u64, Error)>>, g: u64, e: Error) {
    errors
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .push((g, e));
}

impl Shared {
    /// Whether the local pollers read any sample at all.
    pub(crate) fn has_local(&self) -> bool {
        if self.net.is_none() {
            return true;
        }
        self.input.held_samples() > 0
    }

    /// The cache levels, fastest first, each with its index in a group's
    /// `cache_admit` ([`CACHE_MEMORY`], [`CACHE_AREA`]).
    pub(crate) fn cache_levels(
        &self,
    ) -> impl Iterator<Item = (usize, &super::cache_run::RunCache)> {
        [
            (CACHE_MEMORY, &self.cache_memory),
            (CACHE_AREA, &self.cache),
        ]
        .into_iter()
        .filter_map(|(i, c)| Some((i, c.as_ref()?)))
    }

    /// Cache level `level` ([`CACHE_MEMORY`] or [`CACHE_AREA`]).
    pub(crate) fn cache_level(&self, level: usize) -> Option<&super::cache_run::RunCache> {
        match level {
            CACHE_MEMORY => self.cache_memory.as_ref(),
            _ => self.cache.as_ref(),
        }
    }

    /// Whether cache level `rc` plans for scheduled sample `p`: this
    /// process's pollers read it from the source (a source input, or a
    /// sample a partial space does not hold), not from the memory tier;
    /// or, for an area in memory, from the space too (memory is worth
    /// keeping the NVMe's samples in, by the same policy).
    pub(crate) fn cache_plans(
        &self,
        rc: &super::cache_run::RunCache,
        p: &super::schedule::Placed,
    ) -> bool {
        if p.len == 0
            || !self.is_local(p.id)
            || self.tier.as_ref().is_some_and(|t| t.is_member(p.id))
        {
            return false;
        }
        match &self.input {
            Input::Source { .. } => true,
            Input::Space { space, .. } => space.location(p.id).is_none() || rc.area.in_memory(),
            Input::Mix(_) => false,
        }
    }

    /// Whether the local pollers read sample `id` (else the network thread
    /// gets it from its owner).
    pub(crate) fn is_local(&self, id: u64) -> bool {
        if self.net.is_none() {
            return true;
        }
        match self.input.part(id) {
            (_, Input::Space { space, .. }, local) => {
                // A sample no node's partial space holds: this node's
                // pollers read it from the source.
                space.location(local).is_some()
                    || self.partial.as_ref().is_some_and(|p| !p.held_anywhere(id))
            }
            _ => false,
        }
    }

    /// The copies of `id` not to ask for: their nodes' partial spaces do
    /// not hold it (0 without partial spaces).
    pub(crate) fn unheld_copies(&self, id: u64) -> u64 {
        self.partial.as_ref().map_or(0, |p| p.unheld_copies(id))
    }

    /// Records that a thread of this run died with `e` (the first such
    /// error stays) and wakes the consumer, which then fails with it.
    pub(crate) fn fail_run(&self, e: Error) {
        self.dead
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_or_insert(e);
        self.wake();
    }

    /// Why this run's threads died, if they did.
    pub(super) fn dead(&self) -> Option<Error> {
        self.dead.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Flow control, the one predicate every writer of the ring (pollers,
    /// the network thread) obeys: sample `p`'s slot may be written once it
    /// lies within one ring length of the consumer's released mark, and
    /// within the lookahead (and before the end epoch, `end_g`). Sound because the consumer holds only samples
    /// at or past the released mark and a batch never spans more than the
    /// ring (`check_batch_fits`), so no byte of a slot that passes this
    /// belongs to a sample the consumer may still be reading.
    ///
    /// The loads are SeqCst: a writer that finds its sample not writable
    /// announces that it sleeps (a SeqCst store) and looks again, while the
    /// consumer stores the mark (SeqCst) and then looks for sleepers, so one
    /// of the two always sees the other (a store-buffer handshake).
    pub(crate) fn writable(&self, p: &Placed) -> bool {
        p.g < self.end_g
            && Self::fits(
                p.v_end,
                p.g,
                self.released_v.load(Ordering::SeqCst),
                self.released_g.load(Ordering::SeqCst),
                self.geo.ring_bytes,
                self.cfg.lookahead,
            )
    }

    /// The predicate itself: a slot ending at `v_end` for sample `g` may be
    /// written when the released mark is at (`released_v`, `released_g`).
    pub(super) fn fits(
        v_end: u64,
        g: u64,
        released_v: u64,
        released_g: u64,
        ring: u64,
        ahead: u64,
    ) -> bool {
        v_end <= released_v + ring && g < released_g.saturating_add(ahead)
    }

    /// A poller blocked on flow control announces the sample it waits for
    /// before it parks (then checks [`Shared::writable`] once more).
    pub(crate) fn park_for(&self, poller: usize, p: Option<&Placed>) {
        let (v, g) = p.map_or((0, 0), |p| (p.v_end, p.g));
        self.parked[poller].1.store(g, Ordering::SeqCst);
        self.parked[poller].0.store(v, Ordering::SeqCst);
    }

    /// Marks sample `g` done with `code`, having come `via` (`VIA_*`), and
    /// wakes the consumer if it sleeps on exactly that sample.
    pub(crate) fn publish(&self, g: u64, code: u64, via: u32) {
        self.mark_ready(g, code, via);
        if self.waiting_for.load(Ordering::SeqCst) == g + 1 {
            self.wake();
        }
    }

    /// Marks sample `g` done with `code` without waking anyone: a poller
    /// that finishes several samples in one tick marks them all, starts its
    /// next reads, and then calls [`Shared::wake_if_ready`] once.
    pub(crate) fn mark_ready(&self, g: u64, code: u64, via: u32) {
        let idx = (g % self.ready.len() as u64) as usize;
        if code != super::CODE_ERROR {
            self.published_ok.fetch_add(1, Ordering::Relaxed);
        }
        // Relaxed: the SeqCst store of the ready word below orders it
        // before, for a consumer that loads that word.
        self.via[idx].store(via, Ordering::Relaxed);
        if via & !VIA_FAILOVER == VIA_SOURCE {
            // One clock read per source sample: its lead over the need.
            let us = self.clock0.elapsed().as_micros() as u64;
            self.ready_us[idx].store(us, Ordering::Relaxed);
        }
        self.ready[idx].store(((g + 1) << 8) | code, Ordering::SeqCst);
    }

    /// Wakes the consumer if the sample it sleeps on is done. Race-free with
    /// the consumer's wait: it stores `waiting_for` before checking the
    /// sample's word, and a marker stores the word before loading
    /// `waiting_for` (all SeqCst), so one of the two sees the other.
    pub(crate) fn wake_if_ready(&self) {
        let w = self.waiting_for.load(Ordering::SeqCst);
        if w != 0 && self.state(w - 1).is_some() {
            self.wake();
        }
    }

    /// Bumps the wake counter and wakes the consumer sleeping on it.
    fn wake(&self) {
        self.wake_seq.fetch_add(1, Ordering::SeqCst);
        crate::sys::futex_wake(&self.wake_seq);
    }

    /// Samples at or after `g` that are ready: read ahead of a consumer
    /// whose next sample is `g`.
    pub(crate) fn ready_from(&self, g: u64) -> u64 {
        self.ready
            .iter()
            .filter(|w| {
                let v = w.load(Ordering::Acquire);
                v >> 8 > g && v & 0xff != CODE_ERROR
            })
            .count() as u64
    }

    /// Sample `g`'s code once it is ready. SeqCst: the consumer stores
    /// `waiting_for` and then loads this, a poller stores this and then
    /// loads `waiting_for` (a store-buffer handshake: with Acquire here a
    /// wake-up could be lost). On x86 a SeqCst load is a plain load.
    pub(super) fn state(&self, g: u64) -> Option<u64> {
        let v = self.ready[(g % self.ready.len() as u64) as usize].load(Ordering::SeqCst);
        (v >> 8 == g + 1).then_some(v & 0xff)
    }

    /// Sets sample `g`'s grant's split (before it is published).
    pub(crate) fn set_split(&self, g: u64, split: u32) {
        self.split[(g % self.split.len() as u64) as usize].store(split, Ordering::Relaxed);
    }

    /// Sample `g`'s grant's split, as [`Shared::via`].
    pub(super) fn split(&self, g: u64) -> u32 {
        self.split[(g % self.split.len() as u64) as usize].load(Ordering::Relaxed)
    }

    /// How sample `g` came (`VIA_*`); meaningful once [`Shared::state`]
    /// returned its code (the table entry is g's until the consumer
    /// releases it).
    pub(super) fn via(&self, g: u64) -> u32 {
        self.via[(g % self.via.len() as u64) as usize].load(Ordering::Relaxed)
    }

    /// How long ago source sample `g` was published (meaningful once
    /// [`Shared::state`] returned its code and [`Shared::via`] says the
    /// source).
    pub(super) fn published_ago(&self, g: u64) -> Duration {
        let at = self.ready_us[(g % self.ready_us.len() as u64) as usize].load(Ordering::Relaxed);
        let now = self.clock0.elapsed().as_micros() as u64;
        Duration::from_micros(now.saturating_sub(at))
    }
}

/// The simulator's view (tests only): a run's shared state built without a
/// loader, and the ready table read as the consumer reads it.
#[cfg(test)]
impl Shared {
    /// One run's state over `input` and `ring` from the start of epoch 0,
    /// up to (not including) sequence number `end_g`, with no pollers and
    /// cluster state `net`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn for_sim(
        input: Input,
        ring: LandingRing,
        geo: Geometry,
        sampler: Sampler,
        steps: u64,
        end_g: u64,
        cfg: PollerConfig,
        net: Option<net::NetShared>,
    ) -> Self {
        let table = geo.table_len() as usize;
        Shared {
            input,
            ring,
            geo,
            deal: Deal::plain(sampler, steps),
            start: Position { epoch: 0, index: 0 },
            end_g,
            cfg,
            registration: Arc::new(super::registration::RingRegistration::new(false, 1)),
            fixed_files: false,
            ready: (0..table).map(|_| AtomicU64::new(0)).collect(),
            via: (0..table).map(|_| AtomicU32::new(0)).collect(),
            split: (0..table).map(|_| AtomicU32::new(SPLIT_NONE)).collect(),
            ready_us: (0..table).map(|_| AtomicU64::new(0)).collect(),
            clock0: Instant::now(),
            parked: Box::new([]),
            released_v: AtomicU64::new(0),
            released_g: AtomicU64::new(0),
            stop: AtomicBool::new(false),
            go: AtomicBool::new(true),
            wake_seq: AtomicU32::new(0),
            waiting_for: AtomicU64::new(0),
            errors: Mutex::new(Vec::new()),
            published_ok: AtomicU64::new(0),
            stats: Vec::new(),
            tier: None,
            net,
            partial: None,
            cache: None,
            cache_memory: None,
            dead: Mutex::new(None),
        }
    }

    /// Sample `g`'s code once it is published (see `state`).
    pub(crate) fn sim_state(&self, g: u64) -> Option<u64> {
        self.state(g)
    }
}

#[cfg(test)]
mod poison_tests {
    use super::*;

    /// A poisoned errors lock still takes the error (the network thread
    /// used to panic on it with "not poisoned").
    #[test]
    fn push_error_tolerates_a_poisoned_lock() {
        let errors = std::sync::Arc::new(Mutex::new(Vec::new()));
        let e2 = errors.clone();
        let _ = std::thread::spawn(move || {
            let _g = e2.lock().unwrap();
            panic!("poison the errors lock");
        })
        .join();
        assert!(errors.is_poisoned());
        push_error(
            &errors,
            7,
            Error::SampleUnavailable {
                sample: 7,
                tried: "test".into(),
            },
        );
        let v = errors.lock().unwrap_or_else(|p| p.into_inner());
        assert_eq!(v.len(), 1);
        assert_eq!(v[0].0, 7);
    }
}
