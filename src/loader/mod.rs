//! The consumer API: a [`Loader`] hands out batches of samples in sampler
//! order as zero-copy views into the landing ring, while pollers read ahead.
//!
//! ```no_run
//! use kspeed::loader::LoaderBuilder;
//! # fn main() -> kspeed::Result<()> {
//! let mut loader = LoaderBuilder::space("/nvme/kspeed/train").batch_size(256).seed(42).build()?;
//! for epoch in 0..3 {
//!     loader.set_epoch(epoch)?;
//!     while let Some(batch) = loader.next_batch()? {
//!         for s in batch.iter() {
//!             let _ = (s.id, s.label, s.bytes); // decode, augment...
//!         }
//!     } // dropping the batch returns its ring space
//! }
//! println!("{:?}", loader.stats());
//! # Ok(()) }
//! ```
//!
//! How it works: the schedule (`loader::schedule`) gives every sample of the rank's
//! sequence a slot in the ring, computed alike by the consumer and by each
//! poller. Poller `p` reads samples `g` with `g mod P == p` once their slot is
//! free (behind the consumer's released mark) and publishes `g` in a ready
//! table; the consumer waits on that table (spin, then futex). Nothing per
//! sample crosses threads but that one atomic store.
//!
//! Why this file is over ~800 lines: the Loader's run state,
//! `next_batch`/release, epoch handling and the exactly-once digest, which
//! share the flow-control invariants and the restart; about 200 lines are
//! documentation (saving and restoring positions is `positions.rs`).

pub(crate) mod schedule;
pub(crate) mod tier;

mod attached;
mod batch;
mod builder;
pub(crate) mod cache_node;
mod cache_plan;
mod cache_run;
mod fdcache;
mod input;
pub(crate) mod net;
pub(crate) mod node_pollers;
pub mod options;
pub(crate) mod page_cache;
mod registration;
mod ring_size;
mod shared;
mod stall_causes;
pub(crate) mod stall_totals;
mod stats;

mod poller;
mod positions;

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;

use crate::dataset::Catalog;
use crate::error::{Error, Result};
use crate::landing::{LandingInfo, LandingRing};
use crate::sampler::{EpochDigest, Position, RankPosition};
use registration::{PollerIo, RingRegistration};
use schedule::{Cursor, Deal, Geometry, Placed};

/// Fault injection for tests of the read path ([`LoaderBuilder::fault_injection`]).
pub use crate::ring::FaultConfig;
pub(crate) use attached::AgentInput;
pub use attached::{default_agent_socket, AgentMode};
use batch::Entry;
pub use batch::{Batch, BatchSample, DeviceSample};
pub use builder::*;
pub use input::parse_mix_entry;
pub use options::LoaderOptions;
pub use page_cache::PageCache;
pub(crate) use shared::*;
pub use stall_causes::{PeerStall, StallCauses, SLOWEST_PEERS};
pub(crate) use stats::ReadCounts;
use stats::{Counters, Totals};
pub use stats::{Latency, LeadTime, PlacementStats, Stats};
pub(crate) use tier::Tier;

/// A batch kept out by [`Loader::acquire_batch_keep`]: its first sample,
/// placed by run `run` (sequence numbers and ring offsets are per run).
#[derive(Debug, Clone, Copy)]
struct Kept {
    first: Placed,
    run: u64,
}

/// Resources kept across restarts (set_epoch to another epoch, resume).
struct Spare {
    input: Input,
    ring: LandingRing,
    tier: Option<Arc<Tier>>,
    backends: Vec<PollerIo>,
}

struct Run {
    shared: Arc<Shared>,
    threads: Vec<node_pollers::PollerThread>,
    net_thread: Option<JoinHandle<()>>,
    /// A lane of a shared network thread: its channel closes once the
    /// lane has left (its grants are over; `net/lanes.rs`).
    lane_left: Option<crossbeam_channel::Receiver<()>>,
    /// Backends of pollers already joined (by `finish`).
    joined: Vec<PollerIo>,
    /// Samples delivered before this run started (`counters.samples`).
    samples_at_start: u64,
    /// Attached mode: this run's attach to the node agent (no pollers).
    attach: Option<attached::RankAttach>,
}

impl Run {
    /// Stops the pollers and waits for them (and their in-flight reads).
    fn stop(&mut self) -> Option<Error> {
        self.shared.stop.store(true, Ordering::Release);
        for t in &self.threads {
            t.unpark();
        }
        if let Some(net) = &self.shared.net {
            net.wake.notify();
        }
        let mut failed = None;
        if let Some(left) = self.lane_left.take() {
            // Closed, never sent on: the lane dropped its run state. The
            // thread lets a stopped lane go once its grants are over (each
            // bounded by the node timeout), as a loader's own thread ends.
            let _ = left.recv();
        }
        if let Some(t) = self.net_thread.take() {
            if t.join().is_err() {
                failed = Some(Error::ThreadPanicked { thread: "network" });
            }
        }
        for t in self.threads.drain(..) {
            match t.join() {
                Some(b) => self.joined.push(b),
                None => failed = Some(Error::ThreadPanicked { thread: "poller" }),
            }
        }
        if failed.is_none() {
            // Every poller gave back the cache slots it was reading: one
            // left would never be rewritten (the area outlives the run;
            // other loaders may share it, so this run's own count).
            for (_, c) in self.shared.cache_levels() {
                assert_eq!(
                    c.open_reads(),
                    0,
                    "cache area readers left after the run's pollers stopped"
                );
            }
        }
        failed
    }
}

/// Reads a rank's samples in sampler order. See the module docs.
pub struct Loader {
    run: Option<Run>,
    /// Inside the node agent: the node's poller threads, which take turns
    /// for this loader's pollers instead of a thread each.
    node_pollers: Option<Arc<node_pollers::NodePollers>>,
    spare: Option<Spare>,
    geo: Geometry,
    /// The rank's sequence: the sampler (resumed at a job position or not)
    /// and each epoch's steps.
    deal: Deal,
    cfg: PollerConfig,
    /// The pollers' registrations of the ring (registration.rs).
    registration: Arc<RingRegistration>,
    fixed_files: bool,
    batch_size: usize,
    /// Steps of an ordinary (not resumed) epoch for this rank (see
    /// [`Loader::epoch_len`]).
    steps: u64,
    /// The exactly-once digest of the ids delivered in `digest.epoch` (the
    /// epoch of the last sample delivered), and where in that epoch this
    /// rank stood when it took it (`index` steps since `base`).
    digest: EpochDigest,
    digest_at: RankPosition,
    /// A mixture's stream entries of each dataset used in `digest.epoch`
    /// before the order the digest was taken in, when restored from a rank
    /// position (`KSPDPOS4`) whose digest's epoch this loader no longer
    /// deals from that order; `None`: the sampler's for `digest.epoch`.
    digest_skip: Option<Vec<u64>>,
    /// The epoch the caller is in.
    epoch: u64,
    /// Nothing of this epoch or later is read ([`LoaderBuilder::end_epoch`]).
    end_epoch: Option<u64>,
    cursor: Option<Cursor>,
    /// A sample taken from the cursor but left for the next batch: the
    /// first of the next epoch, or the one after a released batch.
    peeked: Option<Placed>,
    entries: Vec<Entry>,
    /// Whether `entries` is a batch handed out and not yet released.
    held: bool,
    /// Sequence number of the last batch handed out (1, 2, ...; 0 before
    /// the first): a batch's identity, so a binding releases only its own.
    batch_seq: u64,
    /// Batches handed out by [`Loader::acquire_batch_keep`] and not yet
    /// released, oldest first: the first sample of each and the run that
    /// placed it (the released mark moves to the next one's when the
    /// oldest goes, within one run).
    kept: std::collections::VecDeque<Kept>,
    /// The first sample of the batch last handed out, as its run placed it.
    held_first: Option<Placed>,
    /// Launches so far: the number of the current run (kept batches of an
    /// earlier one live in a ring of `retired`).
    run_no: u64,
    /// Attached: rings of earlier attaches that batches kept out still
    /// point into, with their run's number; each goes when its last kept
    /// batch is released (a re-attach maps a fresh ring, and the caller's
    /// views into the old one must stay valid).
    /// ... with the node tier each mapped for views (`tier_views`).
    retired: Vec<(
        u64,
        LandingRing,
        Option<Arc<crate::agent::tier_map::TierMap>>,
    )>,
    /// Attached with tier views: the node tier as this attach mapped it
    /// read-only (None: every sample comes in the ring).
    attach_tier: Option<Arc<crate::agent::tier_map::TierMap>>,
    /// Whether a batch was asked for. A local loader's pollers start
    /// parked and read from the first batch on, not from the build: the
    /// usual resume builds and then restores, and reads begun at the
    /// epoch's start would be waited for and thrown away (a cold restore
    /// at 20,000 samples waited 8-16 ms for them). In cluster mode, in the
    /// agent and attached, a run reads at once (true from the build).
    asked: bool,
    /// The first error: every later call returns it (wrapped).
    failed: Option<Error>,
    counters: Counters,
    /// `counters.stall` charged to its causes.
    stall_ledger: stall_causes::StallLedger,
    /// How long before the caller asked for it each source sample was in
    /// the ring (0 for one it waited for).
    source_lead: stats::LeadTimes,
    /// Pollers' and network counters of earlier runs (before restarts).
    totals: Totals,
    started: Instant,
    /// Cluster mode settings (connections are made at every launch).
    net: Option<Arc<net::NetSetup>>,
    /// In an agent: the shared network thread this loader's runs join
    /// (`net/hub.rs`) instead of connecting and running their own.
    net_hub: Option<Arc<net::NetHub>>,
    /// The shared thread to join (None: the one with the fewest lanes).
    net_hub_slot: Option<usize>,
    /// The pollers' cores, and where the last launch pinned them.
    placement: crate::placement::PollerPlacement,
    /// Attached mode: what every launch sends the node agent (each launch
    /// attaches anew, with a fresh ring, at its start position).
    attach_settings: Option<attached::AttachSettings>,
    /// The NVMe cache area and its policy (`cache_dir`), kept across runs.
    cache: Option<cache_run::CacheSetup>,
    /// The memory level above it (`cache_memory_bytes`), kept across runs.
    cache_memory: Option<cache_run::CacheSetup>,
    /// Every sample comes one way (this node's disk): a consumer that
    /// catches up with the pollers sleeps until the batch's last sample is
    /// in, one wake-up per batch, instead of one per sample
    /// ([`Loader::wait_ready`]). Elsewhere (peers, a tier, a bucket) it
    /// waits sample by sample, so that each wait is charged to the path of
    /// the sample it waited for.
    wake_per_batch: bool,
    /// The global sequence number of the last sample of the batch being
    /// assembled (its epoch may end it early).
    batch_last_g: u64,
}

impl Loader {
    /// Starts a run at `start`. On error the loader keeps its resources
    /// (catalog, ring) and no thread of the run is left behind.
    fn launch(&mut self, start: Position) -> Result<()> {
        // Only a re-attach starts a run with batches out (in a ring it
        // retires); every other restart returns them first, since an
        // embedded run reuses the ring they live in.
        debug_assert!(
            self.attach_settings.is_some() || self.kept.is_empty(),
            "an embedded restart with batches kept out"
        );
        // Attached: a fresh ring per attach, so no read of an earlier
        // attach (still landing in the agent) can touch this one's bytes.
        let attach = match &self.attach_settings {
            Some(settings) => {
                let map =
                    crate::agent::shm::RingMap::create_on(self.geo.ring_bytes, settings.numa_node)?;
                // The agent deals the rest of an epoch resumed from a job
                // position as this loader's own schedule does.
                let job = Some(self.deal.sampler().start()).filter(|j| j.consumed > 0);
                // A mixture: its counts and where its order starts (the
                // rest of an epoch resumed under other weights included).
                let mix = self.deal.sampler().inner().mixture().map(|m| {
                    let p = m.job_position(m.start_epoch(), m.start_position().consumed);
                    crate::agent::msg::MixAttach {
                        counts: p.counts,
                        skip: p.skip,
                        start_epoch: p.epoch,
                        start_consumed: p.consumed,
                    }
                });
                let a = attached::RankAttach::connect(settings, &map, start, job, mix)?;
                let spare = self.spare.as_mut().expect("resources available");
                let old = std::mem::replace(&mut spare.ring, LandingRing::shared(map));
                let old_tier = std::mem::replace(&mut self.attach_tier, a.tier());
                // Batches still kept out point into the old ring (and the
                // old attach's tier): it stays mapped until the last of
                // them is released.
                if self.kept.iter().any(|k| k.run == self.run_no) {
                    self.retired.push((self.run_no, old, old_tier));
                }
                Some(a)
            }
            None => None,
        };
        // Connect first: a refusal leaves the loader as it was.
        let conns = match &mut self.net {
            Some(_) if self.net_hub.is_some() => None,
            Some(setup) => {
                let mut s = (**setup).clone();
                let ring = &self.spare.as_ref().expect("resources available").ring;
                let conns = net::connect_all(&mut s, ring)?;
                *setup = Arc::new(s);
                Some(conns)
            }
            None => None,
        };
        // In an agent: the shared network thread this run joins.
        let mut hub_slot = None;
        let net_shared = match (&conns, &self.net_hub) {
            (Some(_), _) => Some(net::NetShared::new(self.geo.table_len() as usize)?),
            (None, Some(_)) if self.net.is_some() => {
                let hub = self.net_hub.as_ref().expect("matched");
                let slot = match self.net_hub_slot {
                    Some(k) => hub.slot_at(k),
                    None => hub.slot(),
                };
                let net = net::NetShared::with_wake(self.geo.table_len() as usize, slot.wake());
                hub_slot = Some(slot);
                Some(net)
            }
            (None, _) => None,
        };
        let spare = self.spare.take().expect("resources available");
        let n = spare.backends.len();
        let table = self.geo.table_len() as usize;
        let shared = Arc::new(Shared {
            input: spare.input,
            ring: spare.ring,
            geo: self.geo,
            deal: self.deal.clone(),
            start,
            end_g: match self.end_epoch {
                // The sequence number of the end epoch's first sample: the
                // rest of the start epoch (which may be a resumed one's
                // remainder), then whole epochs.
                Some(end) if end > start.epoch => self
                    .deal
                    .steps(start.epoch)
                    .saturating_sub(start.index)
                    .saturating_add((end - start.epoch - 1).saturating_mul(self.steps)),
                Some(_) => 0,
                None => u64::MAX,
            },
            cfg: self.cfg.clone(),
            registration: self.registration.clone(),
            fixed_files: self.fixed_files,
            ready: (0..table).map(|_| AtomicU64::new(0)).collect(),
            via: (0..table)
                .map(|_| std::sync::atomic::AtomicU32::new(0))
                .collect(),
            split: (0..table)
                .map(|_| std::sync::atomic::AtomicU32::new(shared::SPLIT_NONE))
                .collect(),
            ready_us: (0..table).map(|_| AtomicU64::new(0)).collect(),
            clock0: Instant::now(),
            released_v: AtomicU64::new(0),
            released_g: AtomicU64::new(0),
            parked: (0..n)
                .map(|_| (AtomicU64::new(0), AtomicU64::new(0)))
                .collect(),
            stop: AtomicBool::new(false),
            go: AtomicBool::new(self.asked),
            wake_seq: AtomicU32::new(0),
            waiting_for: AtomicU64::new(0),
            errors: Mutex::new(Vec::new()),
            published_ok: AtomicU64::new(0),
            stats: (0..n)
                .map(|_| PollerStats {
                    disk_reads: AtomicU64::new(0),
                    source_reads: AtomicU64::new(0),
                    source_bytes: AtomicU64::new(0),
                    tier_hits: AtomicU64::new(0),
                    retries: AtomicU64::new(0),
                    loop_stalls: AtomicU64::new(0),
                    latency: Mutex::new(
                        Histogram::new_with_bounds(1, 60_000_000, 2).expect("valid bounds"),
                    ),
                    latency_buckets: Default::default(),
                })
                .collect(),
            tier: spare.tier,
            net: net_shared,
            partial: self.net.as_ref().and_then(|s| s.partial.clone()),
            cache: self
                .cache
                .as_ref()
                .map(|c| c.run(Cursor::with_deal(self.deal.clone(), self.geo, start), table)),
            cache_memory: self
                .cache_memory
                .as_ref()
                .map(|c| c.run(Cursor::with_deal(self.deal.clone(), self.geo, start), table)),
            dead: Mutex::new(None),
        });
        self.cursor = Some(Cursor::with_deal(self.deal.clone(), self.geo, start));
        self.peeked = None;
        self.run_no += 1;
        self.epoch = start.epoch;
        self.run = Some(Run {
            shared,
            threads: Vec::with_capacity(n),
            net_thread: None,
            lane_left: None,
            joined: Vec::new(),
            samples_at_start: self.counters.samples,
            attach,
        });
        if let Err(e) = self.spawn(spare.backends, conns, hub_slot) {
            // Stop what started and take the resources back.
            self.halt();
            return Err(e);
        }
        Ok(())
    }

    /// Starts the network thread (cluster mode) and one poller per backend
    /// for the run just set up.
    fn spawn(
        &mut self,
        backends: Vec<PollerIo>,
        conns: Option<net::Connected>,
        hub_slot: Option<Arc<net::HubSlot>>,
    ) -> Result<()> {
        let run = self.run.as_mut().expect("set up by launch");
        let shared = &run.shared;
        if let (Some(conns), Some(setup)) = (conns, &self.net) {
            let t = net::NetThread::new(shared.clone(), setup.clone(), conns)?;
            let guard = CrashGuard {
                shared: shared.clone(),
                name: "network",
            };
            let h = std::thread::Builder::new()
                .name("kspeed-net".into())
                .spawn(move || {
                    let _guard = guard;
                    t.run()
                })
                .map_err(|e| Error::ThreadSpawn {
                    thread: "network",
                    source: e.into(),
                })?;
            run.net_thread = Some(h);
        } else if let (Some(slot), Some(setup)) = (hub_slot, &self.net) {
            run.lane_left = Some(slot.join(setup, shared.clone())?);
        }
        let n = backends.len();
        // Each poller reports whether the kernel took its pinning before it
        // starts, so the placement is known when launch returns.
        let (pin_tx, pin_rx) = crossbeam_channel::bounded::<(usize, Option<u32>)>(n);
        let mut spawned = 0;
        for (i, backend) in backends.into_iter().enumerate() {
            let sh = shared.clone();
            if let Some(node) = &self.node_pollers {
                // The node agent: a turn on one of the node's threads
                // (node_pollers.rs), placed by the agent, not pinned here.
                run.threads.push(node.adopt(sh, i, n, backend)?);
                pin_tx.send((i, None)).expect("sized for every poller");
                spawned += 1;
                continue;
            }
            let core = if self.placement.pin {
                self.placement.plan.core_for(i)
            } else {
                None
            };
            let tx = pin_tx.clone();
            let h = std::thread::Builder::new()
                .name(format!("kspeed-poller-{i}"))
                .spawn(move || {
                    let pinned = core.filter(|&c| {
                        core_affinity::set_for_current(core_affinity::CoreId { id: c as usize })
                    });
                    if core.is_some() && pinned.is_none() {
                        log::warn!("poller {i}: the kernel refused pinning to core {core:?}");
                    }
                    let _ = tx.send((i, pinned));
                    drop(tx);
                    let _guard = CrashGuard {
                        shared: sh.clone(),
                        name: "poller",
                    };
                    poller::Poller::new(sh, i, n, backend).run()
                })
                .map_err(|e| Error::ThreadSpawn {
                    thread: "poller",
                    source: e.into(),
                })?;
            run.threads.push(node_pollers::PollerThread::Own(h));
            spawned += 1;
        }
        drop(pin_tx);
        self.placement.pinned = vec![None; n];
        // Every spawned thread sends once, first thing; a recv error means
        // all senders are gone (a thread died before sending).
        for _ in 0..spawned {
            match pin_rx.recv() {
                Ok((i, core)) => self.placement.pinned[i] = core,
                Err(_) => break,
            }
        }
        Ok(())
    }

    /// Starts a local loader's pollers now rather than at the first batch
    /// (they wait for it so that a restore right after the build throws
    /// no read away; docs/LOCAL_PATH.md, "Pollers"): for a caller that
    /// wants the ring filled while it does other work first, such as
    /// building its model. Restore first if it restores. A no-op once
    /// reading, and for cluster, agent and attached loaders, which read
    /// from the build.
    ///
    /// The first batch calls it too: the pollers, parked since the build
    /// (`Shared::go`), start reading; every later run starts at once.
    pub fn start_reading(&mut self) {
        if self.asked {
            return;
        }
        self.asked = true;
        if let Some(run) = &self.run {
            run.shared.go.store(true, Ordering::Release);
            for t in &run.threads {
                t.unpark();
            }
        }
    }

    /// The global sequence number of the next sample the consumer takes.
    fn next_g(&self) -> u64 {
        match (&self.peeked, &self.cursor) {
            (Some(p), _) => p.g,
            (None, Some(c)) => c.next_g(),
            (None, None) => 0,
        }
    }

    /// Stops the pollers (after their in-flight reads land), adds up their
    /// counters and takes the resources back.
    fn halt(&mut self) {
        let Some(mut run) = self.run.take() else {
            return;
        };
        if let Some(e) = run.stop() {
            self.failed.get_or_insert(e);
        }
        self.totals.add_run(&run.shared, self.next_g());
        match Arc::try_unwrap(run.shared) {
            Ok(shared) => {
                self.spare = Some(Spare {
                    input: shared.input,
                    ring: shared.ring,
                    tier: shared.tier,
                    backends: run.joined,
                });
            }
            Err(_) => unreachable!("every thread of the run has exited"),
        }
    }

    /// Stops the pollers and returns the final statistics (complete
    /// latency histograms: pollers publish theirs every 100 ms while running).
    pub fn finish(mut self) -> Stats {
        self.halt();
        self.stats()
    }

    fn shared(&self) -> &Shared {
        &self.run.as_ref().expect("running").shared
    }

    /// The input, ring and tier, running or not (a failed restart leaves
    /// them with the loader).
    fn parts(&self) -> (&Input, &LandingRing, Option<&Tier>) {
        match (&self.run, &self.spare) {
            (Some(r), _) => (&r.shared.input, &r.shared.ring, r.shared.tier.as_deref()),
            (None, Some(s)) => (&s.input, &s.ring, s.tier.as_deref()),
            (None, None) => unreachable!("a loader always holds its resources"),
        }
    }

    /// The error for a loader that failed earlier, if it did.
    fn check_failed(&self) -> Result<()> {
        match &self.failed {
            Some(e) => Err(Error::LoaderFailed(Box::new(e.clone()))),
            None => Ok(()),
        }
    }

    /// Records `e` as the loader's failure (the first one stays) and
    /// returns it.
    fn fail(&mut self, e: Error) -> Error {
        self.failed.get_or_insert_with(|| e.clone());
        e
    }

    /// The next batch of the current epoch, or `None` at its end (call
    /// [`Loader::set_epoch`] to go on). Blocks only while data is not there
    /// yet. Every batch but an epoch's last has exactly `batch_size`
    /// samples, on every rank alike (lock-step): a batch is never cut by
    /// ring space, since the build refuses a ring that cannot hold one.
    pub fn next_batch(&mut self) -> Result<Option<Batch<'_>>> {
        if self.landing_device().is_some() {
            return Err(Error::InvalidConfig(
                "the landing ring is in GPU memory: read batches with acquire_batch and \
                 held_device_sample / held_device_spans"
                    .into(),
            ));
        }
        if self.acquire_batch()? == 0 {
            return Ok(None);
        }
        Ok(Some(Batch { loader: self }))
    }

    /// The next batch without a borrow, for bindings that cannot hold one
    /// across calls (the C ABI): the loader keeps the batch, reachable with
    /// [`Loader::held_sample`] and [`Loader::held_spans`], until
    /// [`Loader::release_batch`] (or [`Loader::release_batch_seq`] with its
    /// [`Loader::held_seq`]). Returns its length (0 at the epoch's end).
    /// A batch still held is released first: its views must be gone.
    pub fn acquire_batch(&mut self) -> Result<usize> {
        self.release_batch();
        self.acquire_next()
    }

    /// The next batch, the batches out left as they are.
    fn acquire_next(&mut self) -> Result<usize> {
        self.check_failed()?;
        self.start_reading();
        self.entries.clear();
        let mut first_v = None;
        // The batch's first sample: where the position goes back to when
        // the batch fails part way (`unwind_batch`).
        let mut batch_first: Option<Placed> = None;
        let mut desc = None;
        // Attached: the source bytes the batch's extra words carry.
        let mut desc_source_bytes = 0u64;
        while self.entries.len() < self.batch_size {
            let p = match self.peeked.take() {
                Some(p) => p,
                None => {
                    let input = &self.run.as_ref().expect("running").shared.input;
                    let cursor = self.cursor.as_mut().expect("running");
                    cursor.next_with(|id| input.sample(id).len as u64)
                }
            };
            if p.pos.epoch != self.epoch {
                self.peeked = Some(p);
                break;
            }
            // A batch is held whole while it is out, so it must fit in the
            // ring; the build's check_batch_fits guarantees it does.
            let v0 = *first_v.get_or_insert(p.v);
            if p.v_end - v0 > self.geo.ring_bytes {
                self.unwind_batch(batch_first.unwrap_or(p));
                let e = Error::RingTooSmallForBatch {
                    batch_size: self.batch_size,
                    batch_bytes: p.v_end - v0,
                    align_bytes: self.geo.align,
                    ring_bytes: self.geo.ring_bytes,
                    needed_bytes: p.v_end - v0,
                    needed_human: crate::progress::human_bytes((p.v_end - v0) as f64),
                };
                debug_assert!(false, "check_batch_fits let through: {e}");
                return Err(self.fail(e));
            }
            if self.entries.is_empty() {
                batch_first = Some(p);
                self.batch_last_g = self.last_g_of_batch_from(&p);
                self.held_first = Some(p);
                if let Some(a) = self.run.as_mut().and_then(|r| r.attach.as_mut()) {
                    // Attached: the agent publishes whole batches; the
                    // one descriptor covers every sample of this one.
                    match a.take(p.g) {
                        Ok((d, waited)) => {
                            desc = Some(d);
                            let extras = a.extras();
                            desc_source_bytes = extras.source_bytes;
                            if !waited.is_zero() {
                                let peers = a.peer_waits();
                                self.counters.stall += waited;
                                self.counters.stall_waits += 1;
                                self.stall_ledger.charge_agent(
                                    waited,
                                    d.reads.waits.to_array(),
                                    peers,
                                    &extras,
                                );
                            }
                        }
                        Err(e) => {
                            self.peeked = Some(p);
                            if matches!(e, Error::AgentGone { .. }) && self.may_reattach() {
                                // The batch's first sample is the first one
                                // not delivered: attach again from there.
                                match self.reattach(p.pos, e) {
                                    Ok(()) => {
                                        // A new run: its batch starts
                                        // again from `p`.
                                        first_v = None;
                                        batch_first = None;
                                        continue;
                                    }
                                    Err(e) => return Err(self.fail(e)),
                                }
                            }
                            return Err(self.fail(e));
                        }
                    }
                }
            }
            let first = batch_first.expect("set at the batch's first sample");
            let mut in_tier = match self.wait_ready(&p) {
                Ok(code) => code == CODE_TIER,
                Err(e) => {
                    self.unwind_batch(first);
                    return Err(self.fail(e));
                }
            };
            // Attached with tier views: the agent's view word says whether
            // the sample is in the node tier, and where.
            let mut tier_off = 0;
            let word = self
                .run
                .as_ref()
                .and_then(|r| r.attach.as_ref())
                .map_or(0, |a| a.view(self.entries.len()));
            if word != 0 && crate::agent::segment::view_tier_offset(word).is_none() {
                self.unwind_batch(first);
                let e = Error::AttachProtocol {
                    what: format!(
                        "the agent's view word {word:#x} for sample {} is reserved (0: in the ring; bit 63: in the node tier)",
                        p.id
                    ),
                };
                return Err(self.fail(e));
            }
            if let Some(off) = crate::agent::segment::view_tier_offset(word) {
                if !self
                    .attach_tier
                    .as_ref()
                    .is_some_and(|t| t.holds(off, p.len))
                {
                    self.unwind_batch(first);
                    let e = Error::AttachProtocol {
                        what: format!(
                            "the agent handed out sample {} ({} bytes) at node tier offset {off}, {}",
                            p.id,
                            p.len,
                            match &self.attach_tier {
                                Some(t) => format!("past the tier's {} bytes", t.len()),
                                None => "but gave this rank no tier".into(),
                            }
                        ),
                    };
                    return Err(self.fail(e));
                }
                (in_tier, tier_off) = (true, off);
            }
            let input = &self.shared().input;
            let label = input.sample(p.id).label;
            let dataset = input.part(p.id).0 as u32;
            self.entries.push(Entry {
                id: p.id,
                label,
                dataset,
                in_tier,
                tier_off,
                phys: p.phys(&self.geo),
                len: p.len,
                pos: p.pos,
            });
        }
        if let Some(d) = desc {
            if let Err(e) = self.check_desc(&d) {
                self.unwind_batch(batch_first.expect("a descriptor comes with a first sample"));
                return Err(e);
            }
            // Attached: the agent's reads for this rank, as its pollers
            // would have counted them embedded.
            let t = &mut self.totals;
            t.disk_reads += u64::from(d.reads.disk_reads);
            t.tier_hits += u64::from(d.reads.tier_hits);
            t.remote_samples += u64::from(d.reads.remote_samples);
            t.source_reads += u64::from(d.reads.source_reads);
            // Statistics from another process: never a panic on a wild word.
            t.source_bytes = t.source_bytes.saturating_add(desc_source_bytes);
            t.failovers += u64::from(d.reads.failovers);
            t.agent_cache_hits += u64::from(d.reads.cache_hits);
            // Its disk reads' latencies, to the middle of their power of
            // two (all an attached rank has of them).
            for (k, &n) in d.reads.read_latency.iter().enumerate() {
                if n > 0 {
                    let v = crate::agent::segment::latency_of_bucket(k);
                    let _ = t.latency.record_n(v, u64::from(n));
                }
            }
        }
        // Delivered only now, the whole batch: a batch that failed part
        // way counts nothing, and its samples are read again by a resume
        // from this loader's position.
        for i in 0..self.entries.len() {
            let e = self.entries[i];
            self.fold(e.pos, e.id);
            self.counters.samples += 1;
            self.counters.bytes += e.len;
        }
        self.held = !self.entries.is_empty();
        if self.held {
            self.batch_seq += 1;
        }
        Ok(self.entries.len())
    }

    /// A batch that failed part way (the loader fails with it): none of it
    /// was delivered, so the position goes back to its first sample, where
    /// a resume from [`Loader::save_position`] reads it again. Nothing is
    /// read past it: a failed loader stays failed.
    fn unwind_batch(&mut self, first: Placed) {
        self.entries.clear();
        self.peeked = Some(first);
    }

    /// Attached mode: the agent's descriptor must be the batch this rank
    /// scheduled (same size, first slot and epoch), else the two disagree
    /// about the schedule and no byte can be trusted.
    fn check_desc(&mut self, d: &crate::agent::segment::BatchDesc) -> Result<()> {
        let first = self.entries[0];
        let n = self.entries.len();
        if d.samples != n as u64 || d.ring_offset != first.phys || d.epoch != first.pos.epoch {
            self.entries.clear();
            let e = Error::AttachProtocol {
                what: format!(
                    "the agent published a batch of {} samples at ring offset {} in epoch {}; \
                     this rank scheduled one of {} samples at offset {} in epoch {}",
                    d.samples, d.ring_offset, d.epoch, n, first.phys, first.pos.epoch
                ),
            };
            return Err(self.fail(e));
        }
        Ok(())
    }
}

impl Loader {
    /// Waits until sample `p` is ready; returns its code ([`CODE_OK`] or
    /// [`CODE_TIER`]) or its error.
    fn wait_ready(&mut self, p: &Placed) -> Result<u64> {
        let spin = self.cfg.spin;
        let run = self.run.as_ref().expect("running");
        if run.attach.is_some() {
            // The batch's descriptor was taken: every sample of it is in.
            return Ok(CODE_OK);
        }
        let sh = &run.shared;
        let mut state = sh.state(p.g);
        if state.is_none() {
            let t0 = Instant::now();
            // One wait per batch where every sample comes one way: wait
            // until the batch's last sample not yet in is in (pollers
            // finish their shares of the batch at their own pace: each
            // further wait is for a slower poller's part), spinning first
            // as for one sample, then asleep. Elsewhere the target is
            // this sample.
            let (per_batch, last) = (self.wake_per_batch, self.batch_last_g);
            let target_of = |sh: &Shared| {
                if per_batch {
                    (p.g + 1..=last)
                        .rev()
                        .find(|&g| sh.state(g).is_none())
                        .unwrap_or(p.g)
                } else {
                    p.g
                }
            };
            // Once a sleep has ended with this sample in, it is handed on
            // whatever the target: a target that cannot come (which would
            // be a bug) costs one timeout, never a hang.
            let mut slept = false;
            loop {
                let target = target_of(sh);
                state = sh.state(p.g);
                if state.is_some() && (target == p.g || slept) {
                    break;
                }
                if sh.state(target).is_some() {
                    continue; // it just came in: the next one not in
                }
                if t0.elapsed() < spin {
                    std::hint::spin_loop();
                    continue;
                }
                let seq = sh.wake_seq.load(Ordering::SeqCst);
                sh.waiting_for.store(target + 1, Ordering::SeqCst);
                // The target's word is loaded after the store: a poller
                // that marked it before seeing `waiting_for` does not wake
                // us, so we must see its mark here (Shared::state).
                if sh.state(target).is_none() {
                    crate::sys::futex_wait(&sh.wake_seq, seq, Duration::from_millis(10));
                    slept = true;
                    if sh.state(p.g).is_none() {
                        if let Some(e) = sh.dead() {
                            sh.waiting_for.store(0, Ordering::SeqCst);
                            return Err(e);
                        }
                    }
                }
            }
            sh.waiting_for.store(0, Ordering::SeqCst);
            let waited = t0.elapsed();
            self.counters.stall += waited;
            self.counters.stall_waits += 1;
            let via = sh.via(p.g);
            self.stall_ledger.charge(via, sh.split(p.g), waited);
            if via & !shared::VIA_FAILOVER == shared::VIA_SOURCE {
                // Late: no lead at all.
                self.source_lead.record(Duration::ZERO);
            }
        } else if sh.via(p.g) & !shared::VIA_FAILOVER == shared::VIA_SOURCE {
            self.source_lead.record(sh.published_ago(p.g));
        }
        match state {
            Some(CODE_OK) => return Ok(CODE_OK),
            Some(CODE_TIER) => return Ok(CODE_TIER),
            _ => {}
        }
        // A poisoned lock only means a thread panicked while recording an
        // error; the list itself is still whole.
        let mut errors = sh.errors.lock().unwrap_or_else(|e| e.into_inner());
        match errors.iter().position(|(g, _)| *g == p.g) {
            Some(i) => Err(errors.swap_remove(i).1),
            None => Err(sh
                .dead()
                .unwrap_or(Error::ThreadPanicked { thread: "poller" })),
        }
    }

    /// Returns the held batch's ring space (nothing when none is held), and
    /// that of every batch kept out by [`Loader::acquire_batch_keep`].
    pub fn release_batch(&mut self) {
        let kept = !self.kept.is_empty();
        self.kept.clear();
        self.retired.clear();
        if std::mem::take(&mut self.held) || kept {
            self.release();
        }
    }

    /// Releases batch `seq` ([`Loader::held_seq`]) if it is the one held:
    /// `Ok(true)`. A batch released already (explicitly, or by the next
    /// batch, `set_epoch` or `restore_position`) is left alone: `Ok(false)`,
    /// so a binding's late release never frees a newer batch. A `seq` never
    /// handed out is an [`Error::UnknownBatch`].
    pub fn release_batch_seq(&mut self, seq: u64) -> Result<bool> {
        if seq == 0 || seq > self.batch_seq {
            return Err(Error::UnknownBatch {
                seq,
                last: self.batch_seq,
            });
        }
        if self.held && seq == self.batch_seq {
            self.release_batch();
            return Ok(true);
        }
        Ok(false)
    }

    /// Like [`Loader::acquire_batch`], but the batches already out stay out:
    /// their bytes stay put until [`Loader::release_oldest_batch`] returns
    /// them, oldest first (or [`Loader::release_batch`] returns them all).
    /// For bindings whose callers hold several batches at once (the Python
    /// package). The new batch is the held one ([`Loader::held_sample`]).
    ///
    /// Fails with [`Error::InvalidConfig`], keeping everything as it was,
    /// when the ring cannot hold the whole new batch beside the batches out,
    /// or `lookahead` does not let the pollers read that far past the
    /// oldest of them: waiting would never end, since their space comes
    /// back only when the caller releases them.
    pub fn acquire_batch_keep(&mut self) -> Result<usize> {
        self.check_failed()?;
        if let Some(need) = self.keep_bytes_needed() {
            return Err(Error::InvalidConfig(format!(
                "the {}-byte landing ring cannot hold another batch beside the {} \
                 still out ({need} bytes needed); release one first or raise ring_bytes",
                self.geo.ring_bytes,
                self.kept.len(),
            )));
        }
        if let Some(need) = self.keep_lookahead_needed() {
            return Err(Error::InvalidConfig(format!(
                "lookahead {}: the pollers read no further than that many samples past \
                 the oldest of the {} batches still out, and another batch needs {need}; \
                 release one first or raise lookahead",
                self.cfg.lookahead,
                self.kept.len(),
            )));
        }
        // The held batch (if any) stays out: it is already in `kept`.
        self.held = false;
        let n = self.acquire_next()?;
        if n > 0 {
            // Its first sample as the run that delivered it placed it: a
            // re-attach inside acquire_next starts a run of its own.
            let first = self.held_first.expect("a batch was handed out");
            self.kept.push_back(Kept {
                first,
                run: self.run_no,
            });
        }
        Ok(n)
    }

    /// The ring bytes the next batch would need beside the batches kept
    /// out, when the ring cannot hold it ([`Loader::acquire_batch_keep`]
    /// would refuse); `None` when it fits.
    pub(crate) fn keep_bytes_needed(&mut self) -> Option<u64> {
        let first = self.peek_next();
        // Only this run's batches share its ring (an earlier attach's are
        // in a retired ring of their own).
        let oldest = self.kept.iter().find(|k| k.run == self.run_no)?.first;
        if first.pos.epoch != self.epoch {
            return None;
        }
        // Walk the new batch's schedule on a copy of the cursor: where
        // its last sample ends, as acquire_batch will place it.
        let input = &self.run.as_ref().expect("running").shared.input;
        let mut cursor = self.cursor.clone().expect("running");
        let mut end = first.v_end;
        for _ in 1..self.batch_size {
            let p = cursor.next_with(|id| input.sample(id).len as u64);
            if p.pos.epoch != self.epoch || p.v_end - first.v > self.geo.ring_bytes {
                break;
            }
            end = p.v_end;
        }
        (end - oldest.v > self.geo.ring_bytes).then_some(end - oldest.v)
    }

    /// Samples from the oldest batch kept out to the end of the next batch,
    /// when that is more than `lookahead` (the pollers read no sample that
    /// far past the released mark, which the oldest batch out holds back,
    /// so [`Loader::acquire_batch_keep`] would wait forever and refuses);
    /// `None` when it is within it. Attached, the agent reads: `None`.
    pub(crate) fn keep_lookahead_needed(&mut self) -> Option<u64> {
        if self.run.as_ref().is_some_and(|r| r.attach.is_some()) {
            return None;
        }
        let first = self.peek_next();
        let oldest = self.kept.iter().find(|k| k.run == self.run_no)?.first;
        if first.pos.epoch != self.epoch {
            return None;
        }
        let need = self.last_g_of_batch_from(&first) + 1 - oldest.g;
        (need > self.cfg.lookahead).then_some(need)
    }

    /// The global sequence number of the last sample of the batch whose
    /// first sample is `first` (its epoch's end may cut it short).
    fn last_g_of_batch_from(&self, first: &Placed) -> u64 {
        let left_in_epoch = self
            .deal
            .steps(first.pos.epoch)
            .saturating_sub(first.pos.index);
        first.g + (self.batch_size as u64).min(left_in_epoch).max(1) - 1
    }

    /// The held batch as the agent publishes it: its first byte's ring
    /// offset, its span's bytes (padding included, both parts if it
    /// wraps), its epoch and sample count; `None` when none is held.
    pub(crate) fn held_desc(&self) -> Option<crate::agent::segment::BatchDesc> {
        if !self.held {
            return None;
        }
        let ((off, len), wrap) = self.held_reserved_ranges();
        let first = self.entries[0];
        Some(crate::agent::segment::BatchDesc {
            ring_offset: off,
            bytes: (len + wrap.map_or(0, |(_, l)| l)) as u64,
            epoch: first.pos.epoch,
            batch_in_epoch: first.pos.index / self.batch_size as u64,
            samples: self.entries.len() as u64,
            // The feeder fills in what was read since its last publish.
            reads: Default::default(),
        })
    }

    /// Inside the agent, for a rank that takes tier views: the held
    /// batch's view words into `out` (a sample handed out in place in the
    /// node tier: [`view_word`](crate::agent::segment::view_word) of its
    /// offset there; one in the ring: 0). Returns the samples written.
    pub(crate) fn held_view_words(&self, out: &mut [u64]) -> usize {
        if !self.held {
            return 0;
        }
        let tier = self.parts().2;
        for (w, e) in out.iter_mut().zip(&self.entries) {
            *w = if e.in_tier {
                let off = tier
                    .and_then(|t| t.view_offset(e.id))
                    .expect("a sample published as CODE_TIER is a filled member");
                crate::agent::segment::view_word(off)
            } else {
                0
            };
        }
        assert!(
            self.entries.len() <= out.len(),
            "a batch of {} samples for {} view words",
            self.entries.len(),
            out.len()
        );
        self.entries.len()
    }

    /// Returns the ring space of the oldest batch kept out by
    /// [`Loader::acquire_batch_keep`]; false when none is out.
    pub fn release_oldest_batch(&mut self) -> bool {
        let Some(gone) = self.kept.pop_front() else {
            return false;
        };
        match self.kept.front() {
            Some(&next) if next.run == self.run_no => self.mark_released(next.first),
            // The next one out is an earlier run's too: this run's ring
            // holds nothing released yet.
            Some(_) => {}
            None => {
                self.held = false;
                self.release();
            }
        }
        if gone.run != self.run_no && !self.kept.iter().any(|k| k.run == gone.run) {
            self.retired.retain(|(run, ..)| *run != gone.run);
        }
        true
    }

    /// Batches out through [`Loader::acquire_batch_keep`] and not released.
    pub fn batches_out(&self) -> usize {
        self.kept.len()
    }

    /// The next sample to deliver, taken from the cursor (and kept as
    /// `peeked`) if need be.
    fn peek_next(&mut self) -> Placed {
        match self.peeked {
            Some(p) => p,
            None => {
                let input = &self.run.as_ref().expect("running").shared.input;
                let cursor = self.cursor.as_mut().expect("running");
                let p = cursor.next_with(|id| input.sample(id).len as u64);
                self.peeked = Some(p);
                p
            }
        }
    }

    /// Returns the batch's ring space. The released mark is the *next*
    /// sample's slot start, not the batch's end: padding skipped before that
    /// slot (at the ring's end or a segment boundary) is free too, and
    /// counting it as held could leave a large next sample waiting forever.
    fn release(&mut self) {
        if self.run.is_none() {
            return; // not running (a failed restart): nothing to tell
        }
        let next = self.peek_next();
        self.mark_released(next);
    }

    /// Frees the ring before sample `next` and lets the writers go on.
    fn mark_released(&mut self, next: Placed) {
        if let Some(a) = self.run.as_mut().and_then(|r| r.attach.as_mut()) {
            // Attached: one release mark for the agent, no local writer.
            a.release_before(next.g);
            return;
        }
        let Some(run) = self.run.as_ref() else {
            return;
        };
        let sh = &run.shared;
        sh.released_v.store(next.v, Ordering::SeqCst);
        sh.released_g.store(next.g, Ordering::SeqCst);
        // Wake only the pollers parked on a sample this release made
        // writable (SeqCst loads after the SeqCst stores above: see
        // Shared::writable).
        for (t, (v, g)) in run.threads.iter().zip(sh.parked.iter()) {
            let v = v.load(Ordering::SeqCst);
            if v != 0
                && Shared::fits(
                    v,
                    g.load(Ordering::SeqCst),
                    next.v,
                    next.g,
                    sh.geo.ring_bytes,
                    sh.cfg.lookahead,
                )
            {
                t.unpark();
            }
        }
        if let Some(net) = &sh.net {
            net.released();
        }
    }

    /// Moves to `epoch` (PyTorch's `sampler.set_epoch`). Going to the next
    /// epoch after finishing one keeps what the pollers already read ahead;
    /// any other epoch restarts the pipeline there.
    ///
    /// Batches kept out by [`Loader::acquire_batch_keep`] stay valid when
    /// the pipeline goes on ([`Loader::epoch_continues`]); a restart returns
    /// them, like the held batch.
    pub fn set_epoch(&mut self, epoch: u64) -> Result<()> {
        self.check_end(epoch)?;
        if self.failed.is_none() && !self.kept.is_empty() && self.epoch_continues(epoch) {
            self.held = false;
            self.epoch = epoch;
            return Ok(());
        }
        self.release_batch();
        self.check_failed()?;
        if self.epoch_continues(epoch) {
            self.epoch = epoch;
            return Ok(());
        }
        let start = Position { epoch, index: 0 };
        self.restart(start)?;
        self.reset_digest(start);
        Ok(())
    }

    /// Refuses `epoch` at or past [`LoaderBuilder::end_epoch`]: nothing of
    /// it is read, so waiting for it would never end.
    fn check_end(&self, epoch: u64) -> Result<()> {
        match self.end_epoch {
            Some(end) if epoch >= end => Err(Error::InvalidConfig(format!(
                "epoch {epoch} is past the loader's last epoch {} (end_epoch {end}: nothing of \
                 epoch {end} or later is read)",
                end - 1
            ))),
            _ => Ok(()),
        }
    }

    /// Whether [`Loader::set_epoch`]`(epoch)` goes on with what the pollers
    /// read ahead (the next epoch after finishing one, or the current one)
    /// instead of restarting them.
    pub fn epoch_continues(&self, epoch: u64) -> bool {
        let pos = self.position();
        pos.epoch == epoch && (pos.index == 0 || epoch == self.epoch)
    }

    /// Attached mode: the agent deals a rank's epochs from (seed, rank,
    /// world, start) as an ordinary job; an epoch resumed from another
    /// world's job position is not something it can deal yet. Refused
    /// before anything changes, so the loader goes on where it was.
    fn check_attached_deal(&self, deal: &schedule::Deal, epoch: u64) -> Result<()> {
        let job = deal.sampler().start();
        if self.attach_settings.is_some() && job.consumed > 0 && epoch < job.epoch {
            // The agent is told the job position with a start at or after
            // its epoch (ATTACH); an epoch before the one resumed has
            // nothing left to deal anyway.
            return Err(Error::InvalidConfig(format!(
                "epoch {epoch} is before epoch {} this job resumed inside: nothing of it is left to read",
                job.epoch
            )));
        }
        Ok(())
    }

    fn restart(&mut self, pos: Position) -> Result<()> {
        self.halt();
        self.check_failed()?;
        if let Err(e) = self.launch(pos) {
            return Err(self.fail(e));
        }
        Ok(())
    }

    /// Whether an agent that went may be waited for: `agent_restart_wait`
    /// set. Batches kept out stay valid across it (their ring is retired,
    /// not unmapped).
    fn may_reattach(&self) -> bool {
        self.attach_settings
            .as_ref()
            .is_some_and(|s| !s.restart_wait.is_zero())
    }

    /// The agent went (`gone`): waits up to `agent_restart_wait` for an
    /// agent at the same socket and attaches to it at `pos` with a fresh
    /// ring and segment. No agent in time gives `gone` with the wait in
    /// its reason.
    fn reattach(&mut self, pos: Position, gone: Error) -> Result<()> {
        /// Between two tries at a socket no agent answers yet: doubling
        /// from the first to the last (each try maps and populates a ring).
        const FIRST_RETRY: Duration = Duration::from_millis(50);
        const LAST_RETRY: Duration = Duration::from_secs(1);
        let wait = self
            .attach_settings
            .as_ref()
            .expect("attached")
            .restart_wait;
        let started = Instant::now();
        log::warn!(
            "{gone}; waiting up to {} ms for an agent to attach to again at epoch {} sample {}",
            wait.as_millis(),
            pos.epoch,
            pos.index
        );
        self.halt();
        self.check_failed()?;
        let mut pause = FIRST_RETRY;
        loop {
            match self.launch(pos) {
                Ok(()) => {
                    log::warn!(
                        "attached again after {} ms; continuing at epoch {} sample {}",
                        started.elapsed().as_millis(),
                        pos.epoch,
                        pos.index
                    );
                    return Ok(());
                }
                Err(Error::NoAgent { reason, .. }) => {
                    if started.elapsed() >= wait {
                        return Err(match gone {
                            Error::AgentGone {
                                socket,
                                pid,
                                last_heartbeat_ms,
                                why,
                            } => Error::AgentGone {
                                socket,
                                pid,
                                last_heartbeat_ms,
                                why: format!(
                                    "{why}; no agent took the rank back within agent_restart_wait_ms ({} ms; last try: {reason})",
                                    wait.as_millis()
                                ),
                            },
                            other => other,
                        });
                    }
                    // A retry interval, not a wait for a condition this
                    // process could be told of: the new agent is another
                    // process that may not exist yet.
                    std::thread::sleep(pause.min(wait.saturating_sub(started.elapsed())));
                    pause = (pause * 2).min(LAST_RETRY);
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// The loader's end epoch ([`LoaderBuilder::end_epoch`]).
    pub(crate) fn end_epoch(&self) -> Option<u64> {
        self.end_epoch
    }

    /// The position of the next sample `next_batch` will deliver.
    pub fn position(&self) -> Position {
        match &self.peeked {
            Some(p) => p.pos,
            None => self.cursor.as_ref().expect("running").position(),
        }
    }

    /// The exactly-once digest of the ids this rank delivered in the epoch
    /// of its last delivered sample, and where in that epoch it stood: the
    /// digest `kspeed audit` adds up over every rank (docs/FORMAT.md,
    /// "Exactly-once digest"). Also in [`Stats`] and the saved position.
    pub fn digest(&self) -> (EpochDigest, RankPosition) {
        (self.digest, self.digest_at)
    }

    /// Folds a delivered sample into the digest: O(1), no allocation.
    fn fold(&mut self, pos: Position, id: u64) {
        if pos.epoch != self.digest.epoch {
            self.reset_digest(pos);
        }
        self.digest.add(id);
        self.digest_at.index = pos.index + 1;
    }

    /// An empty digest of `pos.epoch`, taken at `pos`.
    fn reset_digest(&mut self, pos: Position) {
        self.digest = EpochDigest::new(pos.epoch);
        self.digest_at = self.deal.sampler().rank_position(pos);
        self.digest_skip = None;
    }

    /// Whether the node agent reads for this loader (attached mode,
    /// `agent = required`, or `auto` that found an agent): its
    /// [`Stats`]' read counts and latencies are then the agent's reads for
    /// it, the latencies to the middle of their power of two of µs.
    pub fn attached(&self) -> bool {
        self.attach_settings.is_some()
    }

    /// Samples per batch (the last of an epoch may have fewer).
    pub fn batch_size(&self) -> usize {
        self.batch_size
    }

    /// Samples per epoch for this rank, the same on every rank: the
    /// sampler's share (padded to equal ranks), or with drop_last that
    /// rounded down to whole batches. An epoch resumed at a job position
    /// ([`Loader::restore_job_position`]) has fewer: [`Loader::epoch_steps`].
    pub fn epoch_len(&self) -> u64 {
        self.steps
    }

    /// Samples this rank delivers in `epoch`: [`Loader::epoch_len`], or the
    /// rank's share of the remainder in the epoch the job resumed in.
    pub fn epoch_steps(&self, epoch: u64) -> u64 {
        self.deal.steps(epoch)
    }

    /// Batches per epoch, the same on every rank: `ceil(epoch_len /
    /// batch_size)` (with drop_last every batch is whole).
    pub fn batches_per_epoch(&self) -> u64 {
        self.steps.div_ceil(self.batch_size as u64)
    }

    /// The catalog being read (a mixture's first dataset's: see
    /// [`Loader::catalogs`]).
    pub fn catalog(&self) -> &Catalog {
        self.parts().0.catalog()
    }

    /// Every dataset's catalog, in the order the mixture gives them (one
    /// without a mixture). Dataset `d`'s sample `i` has id
    /// `offsets[d] + i`, `offsets` being [`Loader::dataset_offsets`].
    pub fn catalogs(&self) -> Vec<&Catalog> {
        match self.parts().0 {
            Input::Mix(m) => m.parts.iter().map(|p| p.catalog()).collect(),
            input => vec![input.catalog()],
        }
    }

    /// Each dataset's first id (`[0]` without a mixture).
    pub fn dataset_offsets(&self) -> &[u64] {
        match self.parts().0 {
            Input::Mix(m) => &m.offsets,
            _ => &[0],
        }
    }

    /// The mixture's sampler, if this loader reads several datasets
    /// ([`LoaderBuilder::mix`]).
    pub fn mixture(&self) -> Option<&crate::sampler::MixSampler> {
        self.deal.sampler().inner().mixture()
    }

    /// What the landing ring got (huge pages, lock, NUMA node, CUDA).
    ///
    /// `io` and `io_registered` say how the pollers read into the ring
    /// now: they register it with io_uring once they have written all of
    /// it (plain reads until then), so a loader that has not read a
    /// ring's worth yet reports it not yet registered.
    pub fn landing_info(&self) -> LandingInfo {
        let mut info = self.parts().1.info().clone();
        if self.registration.wanted() {
            info.io = format!("{}{}", self.registration.describe(), info.io);
            info.io_registered = self.registration.any();
        }
        info
    }

    /// Every peer node the caller waited for, with its share of the stall
    /// ([`StallCauses::slowest_peers`] holds the first few of them), by
    /// node index; empty outside cluster mode.
    pub fn stall_by_peer(&self) -> Vec<PeerStall> {
        self.stall_ledger.by_peer()
    }

    /// Statistics over the loader's life so far (cumulative across
    /// `set_epoch` and `restore_position` restarts).
    pub fn stats(&self) -> Stats {
        let mut t = self.totals.clone();
        let mut ahead = 0;
        if let Some(run) = &self.run {
            // The live run: its counters (O(pollers)), and its read-ahead
            // (not thrown away yet) from running totals: every sample
            // marked ready is either delivered or waiting, so no scan of
            // the ready table.
            t.add_counters(&run.shared);
            let published = run.shared.published_ok.load(Ordering::Relaxed);
            let taken = self.counters.samples - run.samples_at_start;
            ahead = published.saturating_sub(taken);
        }
        let hist = &t.latency;
        let lat = if hist.is_empty() {
            Latency::default()
        } else {
            Latency {
                count: hist.len(),
                p50_us: hist.value_at_quantile(0.5),
                p90_us: hist.value_at_quantile(0.9),
                p99_us: hist.value_at_quantile(0.99),
                p999_us: hist.value_at_quantile(0.999),
                max_us: hist.max(),
            }
        };
        Stats {
            samples: self.counters.samples,
            bytes: self.counters.bytes,
            elapsed: self.started.elapsed(),
            stall: self.counters.stall,
            stall_waits: self.counters.stall_waits,
            stall_causes: self.stall_ledger.causes(),
            source_lead: self.source_lead.summary(),
            disk_reads: t.disk_reads,
            tier_hits: t.tier_hits,
            retries: t.retries,
            loop_stalls: t.loop_stalls,
            read_latency: lat,
            remote_samples: t.remote_samples,
            failovers: t.failovers,
            source_reads: t.source_reads,
            source_bytes: t.source_bytes,
            // Attached: the agent's area's hits for this rank, from the
            // batch slots (its other counters stay the agent's).
            cache: self.cache.as_ref().map(|c| c.area.stats()).unwrap_or(
                crate::cache::CacheStats {
                    hits: t.agent_cache_hits,
                    ..Default::default()
                },
            ),
            cache_memory: self
                .cache_memory
                .as_ref()
                .map(|c| c.area.stats())
                .unwrap_or_default(),
            read_ahead: ahead,
            read_ahead_discarded: t.discarded,
            placement: PlacementStats {
                local_rank: self.placement.plan.local.rank,
                local_world: self.placement.plan.local.size,
                numa_node: self.placement.plan.numa_node,
                slice_cores: self.placement.plan.slice.len() as u32,
                shared: self.placement.plan.shared,
                pollers: self.placement.pollers as u32,
                pinned_pollers: self.placement.pinned.iter().flatten().count() as u32,
            },
            digest: self.digest,
            digest_at: self.digest_at,
        }
    }

    /// Where this loader's samples came from so far (O(pollers), no lock
    /// or allocation, unlike [`Loader::stats`]): the node agent's feeder
    /// reads it at every publish.
    pub(crate) fn read_counts(&self) -> stats::ReadCounts {
        let t = &self.totals;
        let mut c = stats::ReadCounts {
            disk_reads: t.disk_reads,
            tier_hits: t.tier_hits,
            remote_samples: t.remote_samples,
            source_reads: t.source_reads,
            source_bytes: t.source_bytes,
            failovers: t.failovers,
            cache_hits: [&self.cache, &self.cache_memory]
                .into_iter()
                .flatten()
                .map(|c| c.hits.load(std::sync::atomic::Ordering::Relaxed))
                .sum(),
            read_latency: t.latency_buckets,
        };
        if let Some(run) = &self.run {
            c.add_run(&run.shared);
        }
        c
    }

    /// The waits charged so far to disk, tier, source, peers and failover
    /// (O(1)): the node agent's feeder sends their growth with every batch
    /// it publishes.
    pub(crate) fn waits_by_cause(&self) -> [Duration; 5] {
        self.stall_ledger.by_cause()
    }

    /// The nodes this loader waited for longest since the last call,
    /// longest first, as peer-wait words ([`crate::agent::segment::peer_wait_word`];
    /// 0: an empty entry), and the extra words' split of those waits and
    /// of all its waits for peers (its `source_bytes` left 0): what the
    /// node agent's feeder sends with each batch.
    pub(crate) fn take_peer_wait_words(
        &mut self,
    ) -> (
        [u64; stall_causes::BATCH_PEERS],
        crate::agent::segment::BatchExtras,
    ) {
        use crate::agent::segment::{peer_wait_word, PeerSplit, MAX_PEER_WAIT_NODE};
        let us = |d: Duration| u32::try_from(d.as_micros()).unwrap_or(u32::MAX);
        let split = |p: [Duration; 3]| PeerSplit {
            read_us: us(p[0]),
            send_us: us(p[1]),
            link_us: us(p[2]),
        };
        let b = self.stall_ledger.take_batch_peers();
        let named = |node: u32, d: Duration| !d.is_zero() && node <= MAX_PEER_WAIT_NODE;
        let words = b.peers.map(|(node, d)| {
            if named(node, d) {
                peer_wait_word(node, d.as_micros() as u64)
            } else {
                0
            }
        });
        let mut extras = crate::agent::segment::BatchExtras {
            split: split(b.split),
            ..Default::default()
        };
        for ((e, &(node, d)), &p) in extras.peers.iter_mut().zip(&b.peers).zip(&b.splits) {
            if named(node, d) {
                *e = split(p);
            }
        }
        (words, extras)
    }

    /// Where the pollers run: the local rank, the slice of cores planned
    /// for it and the core each poller is pinned to ([`crate::placement`]).
    pub fn placement(&self) -> &crate::placement::PollerPlacement {
        &self.placement
    }

    /// The memory tier's size: (samples, bytes), if there is one.
    pub fn tier(&self) -> Option<(u64, u64)> {
        self.parts().2.map(|t| (t.members(), t.member_bytes()))
    }
}

impl Drop for Loader {
    fn drop(&mut self) {
        // Pollers first (their in-flight reads target the ring), then the
        // backends (io_uring instances), then the ring and the input.
        self.halt();
        if let Some(spare) = self.spare.take() {
            drop(spare.backends);
            self.registration.release();
            drop(spare.tier);
            drop(spare.ring);
            drop(spare.input);
        }
    }
}
