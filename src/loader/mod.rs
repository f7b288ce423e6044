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
//! How it works: the schedule ([`schedule`]) gives every sample of the rank's
//! sequence a slot in the ring, computed alike by the consumer and by each
//! poller. Poller `p` reads samples `g` with `g mod P == p` once their slot is
//! free (behind the consumer's released mark) and publishes `g` in a ready
//! table; the consumer waits on that table (spin, then futex). Nothing per
//! sample crosses threads but that one atomic store.

pub mod schedule;
pub mod tier;

mod net;
mod poller;

use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;

use crate::dataset::{Catalog, SourceSpec, Space};
use crate::error::{Error, Result};
use crate::landing::{LandingInfo, LandingOptions, LandingRing};
use crate::ring::{FaultConfig, Faulty, IoBackend, Uring, UringOptions};
use crate::sampler::{Position, Sampler, SamplerConfig, POSITION_BYTES};
use schedule::{Cursor, Geometry, Placed};
use tier::Tier;

pub(crate) const CODE_OK: u64 = 0;
pub(crate) const CODE_ERROR: u64 = 1;

/// Where samples are read from.
pub(crate) enum Input {
    /// A preloaded space: packed, aligned extents (O_DIRECT).
    Space {
        space: Space,
        /// Open extent files (registered with every poller's ring).
        extents: Vec<std::fs::File>,
    },
    /// Source files directly, through the page cache.
    Source { catalog: Catalog, root: PathBuf },
}

impl Input {
    pub(crate) fn catalog(&self) -> &Catalog {
        match self {
            Input::Space { space, .. } => space.catalog(),
            Input::Source { catalog, .. } => catalog,
        }
    }
}

/// Per-poller counters.
pub(crate) struct PollerStats {
    pub(crate) disk_reads: AtomicU64,
    pub(crate) tier_hits: AtomicU64,
    pub(crate) retries: AtomicU64,
    pub(crate) latency: Mutex<Histogram<u64>>,
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
    pub(crate) pin: bool,
    pub(crate) verify_crc32c: bool,
    pub(crate) faults: Option<FaultConfig>,
}

/// State shared by the consumer and the pollers of one run (from a start
/// position until a restart or the end).
pub(crate) struct Shared {
    pub(crate) input: Input,
    pub(crate) ring: LandingRing,
    pub(crate) geo: Geometry,
    pub(crate) sampler: Sampler,
    /// Steps per epoch (see [`Loader::epoch_len`]).
    pub(crate) steps: u64,
    pub(crate) start: Position,
    pub(crate) cfg: PollerConfig,
    pub(crate) fixed_buffers: bool,
    pub(crate) fixed_files: bool,
    /// Indexed by g mod table length: ((g + 1) << 8) | code once g is ready.
    ready: Box<[AtomicU64]>,
    /// Per poller: (slot end, g) of the sample it parked waiting for, or
    /// (0, _) when it is not parked on flow control. A release wakes only
    /// the pollers whose sample it made writable.
    parked: Box<[(AtomicU64, AtomicU64)]>,
    pub(crate) released_v: AtomicU64,
    pub(crate) released_g: AtomicU64,
    pub(crate) stop: AtomicBool,
    /// Bumped by a poller that publishes the sample the consumer sleeps on;
    /// the consumer futex-waits on it (no lock, no thread handle, so the
    /// loader may move between threads).
    wake_seq: AtomicU32,
    waiting_for: AtomicU64,
    pub(crate) errors: Mutex<Vec<(u64, Error)>>,
    pub(crate) stats: Vec<PollerStats>,
    pub(crate) tier: Option<Tier>,
    /// Cluster mode: the network thread's side of things.
    pub(crate) net: Option<net::NetShared>,
    /// Set when a poller or the network thread died (a panic, or a ring
    /// that stopped working), so the consumer fails with this instead of
    /// waiting for samples that will never come.
    dead: Mutex<Option<Error>>,
}

/// Lives on a worker thread's stack: if the thread unwinds, it records the
/// crash and wakes the consumer.
struct CrashGuard {
    shared: Arc<Shared>,
    name: &'static str,
}

impl Drop for CrashGuard {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.shared
                .fail_run(Error::ThreadPanicked { thread: self.name });
        }
    }
}

impl Shared {
    /// Whether the local pollers read any sample at all.
    pub(crate) fn has_local(&self) -> bool {
        if self.net.is_none() {
            return true;
        }
        match &self.input {
            Input::Space { space, .. } => space.held_samples() > 0,
            Input::Source { .. } => false,
        }
    }

    /// Whether the local pollers read sample `id` (else the network thread
    /// gets it from its owner).
    pub(crate) fn is_local(&self, id: u64) -> bool {
        if self.net.is_none() {
            return true;
        }
        match &self.input {
            Input::Space { space, .. } => space.location(id).is_some(),
            Input::Source { .. } => false,
        }
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
    fn dead(&self) -> Option<Error> {
        self.dead.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Flow control, the one predicate every writer of the ring (pollers,
    /// the network thread) obeys: sample `p`'s slot may be written once it
    /// lies within one ring length of the consumer's released mark, and
    /// within the lookahead. Sound because the consumer holds only samples
    /// at or past the released mark and a batch never spans more than the
    /// ring (`check_batch_fits`), so no byte of a slot that passes this
    /// belongs to a sample the consumer may still be reading.
    ///
    /// The loads are SeqCst: a writer that finds its sample not writable
    /// announces that it sleeps (a SeqCst store) and looks again, while the
    /// consumer stores the mark (SeqCst) and then looks for sleepers, so one
    /// of the two always sees the other (a store-buffer handshake).
    pub(crate) fn writable(&self, p: &Placed) -> bool {
        Self::fits(
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
    fn fits(v_end: u64, g: u64, released_v: u64, released_g: u64, ring: u64, ahead: u64) -> bool {
        v_end <= released_v + ring && g < released_g.saturating_add(ahead)
    }

    /// A poller blocked on flow control announces the sample it waits for
    /// before it parks (then checks [`Shared::writable`] once more).
    pub(crate) fn park_for(&self, poller: usize, p: Option<&Placed>) {
        let (v, g) = p.map_or((0, 0), |p| (p.v_end, p.g));
        self.parked[poller].1.store(g, Ordering::SeqCst);
        self.parked[poller].0.store(v, Ordering::SeqCst);
    }

    /// Marks sample `g` done with `code` and wakes the consumer if it sleeps
    /// on exactly that sample.
    pub(crate) fn publish(&self, g: u64, code: u64) {
        self.mark_ready(g, code);
        if self.waiting_for.load(Ordering::SeqCst) == g + 1 {
            self.wake();
        }
    }

    /// Marks sample `g` done with `code` without waking anyone: a poller
    /// that finishes several samples in one tick marks them all, starts its
    /// next reads, and then calls [`Shared::wake_if_ready`] once.
    pub(crate) fn mark_ready(&self, g: u64, code: u64) {
        let idx = (g % self.ready.len() as u64) as usize;
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
                v >> 8 > g && v & 0xff == CODE_OK
            })
            .count() as u64
    }

    /// Sample `g`'s code once it is ready. SeqCst: the consumer stores
    /// `waiting_for` and then loads this, a poller stores this and then
    /// loads `waiting_for` (a store-buffer handshake: with Acquire here a
    /// wake-up could be lost). On x86 a SeqCst load is a plain load.
    fn state(&self, g: u64) -> Option<u64> {
        let v = self.ready[(g % self.ready.len() as u64) as usize].load(Ordering::SeqCst);
        (v >> 8 == g + 1).then_some(v & 0xff)
    }
}

/// Most poller threads per loader.
pub const MAX_POLLERS: u64 = 1024;
/// Largest `queue_depth`: io_uring rings hold at most 32768 entries and a
/// poller's ring has two per read.
pub const MAX_QUEUE_DEPTH: u64 = 16384;
/// Largest `batch_size`.
pub const MAX_BATCH_SIZE: u64 = 1 << 20;

/// Builds a [`Loader`].
#[derive(Debug, Clone)]
pub struct LoaderBuilder {
    space: Option<PathBuf>,
    source: Option<String>,
    catalog: Option<PathBuf>,
    batch_size: usize,
    seed: u64,
    shuffle: bool,
    rank: u32,
    world: u32,
    drop_last: bool,
    landing: LandingOptions,
    pollers: usize,
    queue_depth: u32,
    submit_batch: u32,
    max_read_bytes: u64,
    lookahead: u64,
    spin: Duration,
    sqpoll_idle_ms: Option<u32>,
    pin: bool,
    registered_buffers: bool,
    registered_files: bool,
    verify_crc32c: bool,
    tier_bytes: u64,
    gpu_ring: Option<u32>,
    faults: Option<FaultConfig>,
    start: Option<Position>,
    cluster: Option<crate::transport::Cluster>,
    token: Vec<u8>,
    node_timeout: Duration,
    rdma: Option<crate::transport::RdmaOptions>,
    local_node: Option<Option<u32>>,
}

/// Default poller count: a quarter of the cores (at least 1, at most 8),
/// leaving the rest to the trainer's own preprocessing.
pub fn default_pollers() -> usize {
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    (cores / 4).clamp(1, 8)
}

/// Default submission batch: a poller submits its queued reads every 8. On
/// this project's 2-core VM, with 4.5 KiB samples at queue depth 32, a
/// whole-queue batch (32) made the device complete all 32 together every
/// time and sit idle while the poller turned them around: 0.84x fio's IOPS.
/// Batches of 8 keep reads arriving while others complete: 0.97x, for 2 %
/// more CPU (BENCHMARKS.md, "Small samples").
pub const DEFAULT_SUBMIT_BATCH: u32 = 8;

/// Default busy-poll time: none on machines with 4 cores or fewer, where a
/// spinning consumer or poller takes the core the other one needs (measured
/// on 2 cores: tiny samples, 59K/s at 20 µs against 68K/s at 0, and 40 %
/// less CPU per GB); 20 µs with more cores, to cut wake-up latency.
pub fn default_spin() -> Duration {
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    if cores <= 4 {
        Duration::ZERO
    } else {
        Duration::from_micros(20)
    }
}

impl LoaderBuilder {
    fn new() -> Self {
        LoaderBuilder {
            space: None,
            source: None,
            catalog: None,
            batch_size: 64,
            seed: 0,
            shuffle: true,
            rank: 0,
            world: 1,
            drop_last: false,
            landing: LandingOptions::default(),
            pollers: default_pollers(),
            queue_depth: 32,
            submit_batch: DEFAULT_SUBMIT_BATCH,
            max_read_bytes: 4 << 20,
            lookahead: u64::MAX,
            spin: default_spin(),
            sqpoll_idle_ms: None,
            pin: true,
            registered_buffers: true,
            registered_files: true,
            verify_crc32c: false,
            tier_bytes: 0,
            gpu_ring: None,
            faults: None,
            start: None,
            cluster: None,
            token: Vec::new(),
            node_timeout: Duration::from_secs(10),
            rdma: None,
            local_node: None,
        }
    }

    /// A builder with no input yet: give one with [`LoaderBuilder::set_space`]
    /// or [`LoaderBuilder::set_source`] (for bindings that set options one
    /// by one, like the C ABI).
    pub fn empty() -> Self {
        Self::new()
    }

    /// Reads this space (replacing any input set before).
    pub fn set_space(mut self, dir: impl AsRef<Path>) -> Self {
        self.space = Some(dir.as_ref().to_path_buf());
        self.source = None;
        self
    }

    /// Reads this source directly (replacing any input set before).
    pub fn set_source(mut self, spec: &str) -> Self {
        self.source = Some(spec.to_string());
        self.space = None;
        self
    }

    /// The rank and world size set so far.
    pub fn rank_world(&self) -> (u32, u32) {
        (self.rank, self.world)
    }

    /// The landing ring options set so far (to change one of them).
    pub fn landing_options(&self) -> &LandingOptions {
        &self.landing
    }

    /// Reads a preloaded space (the fast path).
    pub fn space(dir: impl AsRef<Path>) -> Self {
        LoaderBuilder {
            space: Some(dir.as_ref().to_path_buf()),
            ..Self::new()
        }
    }

    /// Reads a source directly (no preload), with a catalog built by
    /// `kspeed catalog` ([`LoaderBuilder::catalog`]) or built now into a
    /// temporary file.
    pub fn source(spec: &str) -> Self {
        LoaderBuilder {
            source: Some(spec.to_string()),
            ..Self::new()
        }
    }

    /// The catalog to use with [`LoaderBuilder::source`].
    pub fn catalog(mut self, path: impl AsRef<Path>) -> Self {
        self.catalog = Some(path.as_ref().to_path_buf());
        self
    }

    /// Samples per batch (default 64).
    pub fn batch_size(mut self, n: usize) -> Self {
        self.batch_size = n;
        self
    }

    /// Shuffle seed, the same on every rank (default 0).
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    /// Shuffle every epoch (default true).
    pub fn shuffle(mut self, on: bool) -> Self {
        self.shuffle = on;
        self
    }

    /// This rank and the world size (default 0 of 1).
    pub fn rank(mut self, rank: u32, world: u32) -> Self {
        self.rank = rank;
        self.world = world;
        self
    }

    /// Drop the tail instead of padding (DistributedSampler semantics).
    pub fn drop_last(mut self, on: bool) -> Self {
        self.drop_last = on;
        self
    }

    /// Landing ring size (default 256 MiB).
    pub fn ring_bytes(mut self, bytes: u64) -> Self {
        self.landing.ring_bytes = bytes;
        self
    }

    /// All landing ring options (huge pages, mlock, NUMA, CUDA).
    pub fn landing(mut self, opts: LandingOptions) -> Self {
        self.landing = opts;
        self
    }

    /// Poller threads (default [`default_pollers`]).
    pub fn pollers(mut self, n: usize) -> Self {
        self.pollers = n;
        self
    }

    /// Reads in flight per poller (default 32).
    pub fn queue_depth(mut self, n: u32) -> Self {
        self.queue_depth = n;
        self
    }

    /// Most reads a poller queues before it submits them (one
    /// `io_uring_enter` per batch; default [`DEFAULT_SUBMIT_BATCH`]). Small
    /// batches put the first reads on the device sooner after a burst of
    /// completions; large ones cost fewer system calls.
    pub fn submit_batch(mut self, n: u32) -> Self {
        self.submit_batch = n;
        self
    }

    /// Largest single read (default 4 MiB): bigger samples are read in
    /// parts, so large samples keep the queue busy too.
    pub fn max_read_bytes(mut self, bytes: u64) -> Self {
        self.max_read_bytes = bytes.max(4096);
        self
    }

    /// At most this many samples read ahead of the consumer's released
    /// mark (default: as many as the ring holds). Never less than one batch,
    /// which must be complete before it is handed out.
    pub fn lookahead(mut self, samples: u64) -> Self {
        self.lookahead = samples.max(1);
        self
    }

    /// How long pollers and the consumer busy-poll before parking (default
    /// [`default_spin`]).
    pub fn spin(mut self, d: Duration) -> Self {
        self.spin = d;
        self
    }

    /// Use an SQPOLL kernel thread per poller, idling after `idle_ms`.
    pub fn sqpoll(mut self, idle_ms: Option<u32>) -> Self {
        self.sqpoll_idle_ms = idle_ms;
        self
    }

    /// Pin pollers to cores (default true).
    pub fn pin(mut self, on: bool) -> Self {
        self.pin = on;
        self
    }

    /// Register the ring with io_uring as fixed buffers (default true).
    pub fn registered_buffers(mut self, on: bool) -> Self {
        self.registered_buffers = on;
        self
    }

    /// Register the extent files with io_uring (default true).
    pub fn registered_files(mut self, on: bool) -> Self {
        self.registered_files = on;
        self
    }

    /// Check every sample's CRC32C as it is read (costs one pass over the bytes).
    pub fn verify_crc32c(mut self, on: bool) -> Self {
        self.verify_crc32c = on;
        self
    }

    /// Memory tier budget in bytes (default 0: no tier).
    pub fn tier_bytes(mut self, bytes: u64) -> Self {
        self.tier_bytes = bytes;
        self
    }

    /// Put the landing ring in the memory of GPU `ordinal` (CUDA driver,
    /// loaded at run time) instead of host memory: the owners' RDMA writes
    /// land in the GPU (GPUDirect RDMA; the ring is registered as a dma-buf,
    /// or, where the NIC's driver lacks that, through a peer-memory module
    /// such as nvidia-peermem). Needs cluster mode over RDMA with a source
    /// (nothing read locally: the pollers cannot read into GPU memory), no
    /// memory tier and no `verify_crc32c` (the CPU cannot read the ring).
    /// Batches are then read with [`Loader::acquire_batch`] and
    /// [`Loader::held_device_sample`] / [`Loader::held_device_spans`].
    pub fn gpu_ring(mut self, ordinal: Option<u32>) -> Self {
        self.gpu_ring = ordinal;
        self
    }

    /// Inject seeded I/O faults (for tests of the error paths).
    pub fn fault_injection(mut self, cfg: FaultConfig) -> Self {
        self.faults = Some(cfg);
        self
    }

    /// Cluster mode: samples the local space holds are read locally, the
    /// others are pushed by their owners' node services (`kspeed serve`)
    /// listed in `cluster`. With [`LoaderBuilder::space`] the space may be
    /// this node's partition; with [`LoaderBuilder::source`] nothing is
    /// local and the source is the last resort when no holder can serve a
    /// sample.
    pub fn cluster(mut self, cluster: crate::transport::Cluster) -> Self {
        self.cluster = Some(cluster);
        self
    }

    /// The job token the node services expect (cluster mode).
    pub fn token(mut self, token: &[u8]) -> Self {
        self.token = token.to_vec();
        self
    }

    /// How long a node may stay silent with grants outstanding before its
    /// grants fail over (default 10 s).
    pub fn node_timeout(mut self, d: Duration) -> Self {
        self.node_timeout = d;
        self
    }

    /// Cluster mode: receive remote samples as RDMA writes into the landing
    /// ring (registered for remote write, exactly its range) through this
    /// device, instead of DATA frames on TCP (`None`, the default). Every
    /// node service must offer RDMA (`kspeed serve --rdma`); needs a build
    /// with the `rdma` feature.
    pub fn rdma(mut self, opts: Option<crate::transport::RdmaOptions>) -> Self {
        self.rdma = opts;
        self
    }

    /// The RDMA settings ([`LoaderBuilder::rdma`]), if RDMA is on.
    pub fn rdma_options(&self) -> Option<&crate::transport::RdmaOptions> {
        self.rdma.as_ref()
    }

    /// The cluster node this process runs on (default: the local space's
    /// node index; none with a source). Its samples are never requested over
    /// the network.
    pub fn local_node(mut self, node: Option<u32>) -> Self {
        self.local_node = Some(node);
        self
    }

    /// Start at a saved position instead of (epoch 0, step 0).
    pub fn start_at(mut self, pos: Position) -> Self {
        self.start = Some(pos);
        self
    }

    /// Opens the input, maps the ring, starts the pollers.
    pub fn build(self) -> Result<Loader> {
        // Every extent stays open (registered with io_uring): lift the
        // open-files soft limit to the hard one first, as servers do.
        crate::sys::raise_open_files_limit();
        // Ranges are checked here, before anything touches the kernel, so
        // the message names the setting instead of an errno from io_uring.
        for (what, n, max, why) in [
            ("pollers", self.pollers as u64, MAX_POLLERS, "threads"),
            (
                "queue_depth",
                self.queue_depth as u64,
                MAX_QUEUE_DEPTH,
                "io_uring holds at most 32768 entries, two per read",
            ),
            (
                "submit_batch",
                self.submit_batch as u64,
                MAX_QUEUE_DEPTH,
                "reads queued before a submission",
            ),
            (
                "batch_size",
                self.batch_size as u64,
                MAX_BATCH_SIZE,
                "samples",
            ),
        ] {
            if n == 0 {
                return Err(Error::InvalidConfig(format!(
                    "{what} must be at least 1, not 0"
                )));
            }
            if n > max {
                return Err(Error::InvalidConfig(format!(
                    "{what} must be 1 to {max} ({why}), not {n}"
                )));
            }
        }
        if self.landing.ring_bytes < 4096 {
            return Err(Error::InvalidConfig(format!(
                "ring_bytes must be at least 4096, not {}",
                self.landing.ring_bytes
            )));
        }
        let mut direct_io = self.space.is_some();
        let (input, align) = match (&self.space, &self.source) {
            (Some(dir), _) => {
                let space = Space::open(dir)?;
                space.check_extents()?;
                let p = space.params();
                if self.cluster.is_none() && space.held_samples() != space.catalog().len() {
                    return Err(Error::InvalidConfig(format!(
                        "space {} holds {} of {} samples (node {} of {}); reading a partial space needs the cluster transport",
                        dir.display(),
                        space.held_samples(),
                        space.catalog().len(),
                        p.node_index,
                        p.placement.nodes
                    )));
                }
                let align = p.align_bytes as u64;
                let mut extents = Vec::with_capacity(space.extent_lens().len());
                for i in 0..space.extent_lens().len() as u32 {
                    let path = space.extent_path(i);
                    let (f, direct) =
                        crate::sys::open_direct(&path).map_err(|e| Error::io("open", &path, e))?;
                    if !direct && direct_io {
                        // Not silent: every read then goes through (and
                        // evicts from) the page cache.
                        log::warn!(
                            "{}: the file system refuses O_DIRECT; reading through the page cache",
                            path.display()
                        );
                    }
                    direct_io &= direct;
                    extents.push(f);
                }
                (Input::Space { space, extents }, align)
            }
            (None, Some(src)) => {
                let spec = SourceSpec::parse(src)?;
                let catalog = match &self.catalog {
                    Some(c) => Catalog::open(c)?,
                    None => {
                        log::info!(
                            "no catalog given: building one of {src} (reads every file to checksum it)"
                        );
                        // Unique per process and build; removed once mapped.
                        static BUILDS: AtomicU64 = AtomicU64::new(0);
                        let tmp = std::env::temp_dir().join(format!(
                            "kspeed-{}-{}.ksc",
                            std::process::id(),
                            BUILDS.fetch_add(1, Ordering::Relaxed)
                        ));
                        let c = crate::dataset::catalog::build(&spec, &tmp, &Default::default())?;
                        let _ = std::fs::remove_file(&tmp);
                        c
                    }
                };
                let root = catalog.source_spec().root();
                (Input::Source { catalog, root }, 4096)
            }
            (None, None) => return Err(Error::InvalidConfig("give a space or a source".into())),
        };
        let catalog = input.catalog();
        let sampler = Sampler::new(SamplerConfig {
            len: catalog.len(),
            seed: self.seed,
            shuffle: self.shuffle,
            rank: self.rank,
            world: self.world,
            drop_last: self.drop_last,
        })?;
        // Lock-step: every rank delivers the same steps per epoch, in whole
        // batches with drop_last (the tail that cannot fill one is dropped).
        let steps = if self.drop_last {
            sampler.per_rank() / self.batch_size as u64 * self.batch_size as u64
        } else {
            sampler.per_rank()
        };
        if steps == 0 {
            return Err(Error::InvalidConfig(format!(
                "with drop_last, {} samples give rank {} of {} no whole batch of {}",
                catalog.len(),
                self.rank,
                self.world,
                self.batch_size
            )));
        }
        let mut landing = self.landing.clone();
        landing.ring_bytes = landing.ring_bytes.next_multiple_of(align.max(4096));
        let geo = Geometry {
            ring_bytes: landing.ring_bytes,
            align,
        };
        // A sample that cannot fit is an error now, not a hang later.
        let max_slot = geo.slot(catalog.max_sample_bytes() as u64);
        if max_slot > geo.segment() {
            let id = (0..catalog.len())
                .find(|&i| geo.slot(catalog.sample(i).len as u64) > geo.segment())
                .expect("the largest sample exists");
            return Err(Error::SampleLargerThanRing {
                sample: id,
                len: catalog.sample(id).len as u64,
                slot: max_slot,
                ring_bytes: geo.ring_bytes,
            });
        }
        check_batch_fits(catalog, &sampler, geo, self.batch_size)?;
        let ring = match self.gpu_ring {
            None => LandingRing::new(&landing)?,
            Some(ordinal) => {
                let why = if self.cluster.is_none() || self.rdma.is_none() {
                    Some("cluster mode over RDMA (nothing else can write GPU memory)")
                } else if self.space.is_some() {
                    Some("a source instead of a space (local pollers cannot read into GPU memory)")
                } else if self.tier_bytes > 0 {
                    Some("no memory tier")
                } else if self.verify_crc32c {
                    Some("verify_crc32c off (the CPU cannot read the ring)")
                } else {
                    None
                };
                if let Some(why) = why {
                    return Err(Error::InvalidConfig(format!(
                        "a landing ring in GPU memory (device {ordinal}) needs {why}"
                    )));
                }
                LandingRing::new_gpu(ordinal, landing.ring_bytes)?
            }
        };
        let tier = Tier::new(catalog, self.tier_bytes, landing.mlock)?;
        if let Some(t) = &tier {
            log::info!(
                "memory tier: {} samples, {} bytes",
                t.members(),
                t.member_bytes()
            );
        }
        let cfg = PollerConfig {
            pollers: self.pollers,
            queue_depth: self.queue_depth,
            submit_batch: self.submit_batch,
            max_read_bytes: self.max_read_bytes,
            lookahead: self.lookahead.max(self.batch_size as u64),
            spin: self.spin,
            sqpoll_idle_ms: self.sqpoll_idle_ms,
            pin: self.pin,
            verify_crc32c: self.verify_crc32c,
            faults: self.faults,
        };
        let start = match self.start {
            Some(p) if p.index > steps => {
                return Err(Error::BadPosition(format!(
                    "step {} is past the epoch's {steps} steps",
                    p.index
                )))
            }
            Some(p) => p,
            None => Position { epoch: 0, index: 0 },
        };
        let net = match self.cluster.clone() {
            None => None,
            Some(cluster) => {
                let (placement, space_node) = match &input {
                    Input::Space { space, .. } => (
                        Some(space.params().placement),
                        Some(space.params().node_index),
                    ),
                    Input::Source { .. } => (None, None),
                };
                let cat = input.catalog();
                Some(net::NetSetup {
                    cluster,
                    token: self.token.clone(),
                    node_timeout: self.node_timeout,
                    connect_timeout: self.node_timeout.min(Duration::from_secs(5)),
                    hello: crate::transport::proto::Hello {
                        catalog_identity: cat.identity(),
                        rank: self.rank,
                        world: self.world,
                        catalog_samples: cat.len(),
                        seed: self.seed,
                        ring_addr: 0,
                        ring_len: ring.len() as u64,
                        rkey: 0,
                        transport: crate::transport::proto::TRANSPORT_TCP,
                    },
                    placement,
                    local_node: self.local_node.unwrap_or(space_node),
                    rdma: self.rdma.clone(),
                })
            }
        };
        let mut backends: Vec<Uring> = Vec::with_capacity(cfg.pollers);
        let mut fixed_buffers = self.registered_buffers && ring.device().is_none();
        let mut io_how = if ring.device().is_some() {
            "GPU memory: written by the NIC only".to_string()
        } else if !self.registered_buffers {
            "not registered (registered_buffers off)".to_string()
        } else {
            String::new()
        };
        let mut shared_regs = 0;
        for _ in 0..cfg.pollers {
            let uring = Uring::new(UringOptions {
                entries: cfg.queue_depth * 2,
                sqpoll_idle_ms: cfg.sqpoll_idle_ms,
            })?;
            if let (Input::Space { extents, .. }, true) = (&input, self.registered_files) {
                let fds: Vec<i32> = extents.iter().map(|f| f.as_raw_fd()).collect();
                uring.register_files(&fds)?;
            }
            if fixed_buffers {
                // Once for all pollers where the kernel can share a ring's
                // buffer table (6.12+): the ring is then pinned and charged
                // to RLIMIT_MEMLOCK once, not once per poller.
                let cloned = match backends.first() {
                    Some(first) => match uring.register_buffers_from(first) {
                        Ok(()) => true,
                        Err(e) => {
                            log::info!("{e}; registering the ring per poller");
                            false
                        }
                    },
                    None => false,
                };
                shared_regs += cloned as usize;
                if !cloned {
                    let seg = geo.segment() as usize;
                    let regions: Vec<(*mut u8, usize)> = (0..ring.len())
                        .step_by(seg)
                        .map(|off| {
                            (
                                // SAFETY: off < ring.len(), inside the mapping.
                                unsafe { ring.as_mut_ptr().add(off) },
                                seg.min(ring.len() - off),
                            )
                        })
                        .collect();
                    // SAFETY: the ring outlives every backend: backends are
                    // dropped by the Loader before its Shared (and so the ring).
                    if let Err(e) = unsafe { uring.register_buffers(&regions) } {
                        // Not silent: reads then pin pages one by one.
                        log::warn!(
                            "the landing ring cannot be registered with io_uring ({e}); reading \
                             without fixed buffers. With {} pollers not sharing one registration \
                             the ring is pinned {} times against RLIMIT_MEMLOCK: raise the limit \
                             (ulimit -l) or use a kernel of 6.12 or later",
                            cfg.pollers,
                            cfg.pollers
                        );
                        io_how = format!("not registered: {e}");
                        fixed_buffers = false;
                    }
                }
            }
            backends.push(uring);
        }
        if fixed_buffers {
            io_how = if shared_regs + 1 == cfg.pollers && cfg.pollers > 1 {
                format!("registered once, shared by {} pollers", cfg.pollers)
            } else if cfg.pollers > 1 {
                format!("registered by each of {} pollers", cfg.pollers)
            } else {
                "registered (1 poller)".to_string()
            };
        }
        if !direct_io && matches!(input, Input::Space { .. }) {
            io_how.push_str("; page cache (no O_DIRECT)");
        }
        let mut ring = ring;
        ring.set_io_info(fixed_buffers, io_how, direct_io);
        let backends: Vec<Box<dyn IoBackend>> = backends
            .into_iter()
            .map(|uring| -> Box<dyn IoBackend> {
                match cfg.faults {
                    Some(f) => Box::new(Faulty::new(uring, f, cfg.queue_depth as usize)),
                    None => Box::new(uring),
                }
            })
            .collect();
        let batch_size = self.batch_size;
        let mut loader = Loader {
            run: None,
            spare: Some(Spare {
                input,
                ring,
                tier,
                backends,
            }),
            geo,
            sampler,
            cfg,
            fixed_buffers,
            fixed_files: self.registered_files,
            batch_size,
            steps,
            epoch: start.epoch,
            cursor: None,
            peeked: None,
            entries: Vec::with_capacity(batch_size),
            held: false,
            batch_seq: 0,
            kept: std::collections::VecDeque::new(),
            failed: None,
            counters: Counters::default(),
            totals: Totals::new(),
            started: Instant::now(),
            net: net.map(Arc::new),
        };
        loader.launch(start)?;
        log::info!(
            "loader: {} samples per epoch for rank {} of {}, batch {}, ring {} bytes, {} pollers{}",
            loader.steps,
            self.rank,
            self.world,
            batch_size,
            loader.geo.ring_bytes,
            loader.cfg.pollers,
            if loader.net.is_some() {
                ", cluster mode"
            } else {
                ""
            }
        );
        Ok(loader)
    }
}

/// Refuses a ring that some batch might not fit in whole
/// ([`Error::RingTooSmallForBatch`]): a batch is held whole while it is out,
/// so a batch larger than the ring could only be delivered cut short, and
/// where it is cut would depend on each rank's own sample sizes.
///
/// O(1) in the common case (from the catalog's largest sample); only when
/// `batch` times that does not fit does it find the catalog's `batch`
/// largest samples (one pass) before refusing.
fn check_batch_fits(
    catalog: &Catalog,
    sampler: &Sampler,
    geo: Geometry,
    batch: usize,
) -> Result<()> {
    let max_slot = geo.slot(catalog.max_sample_bytes() as u64);
    let quick = (batch as u64).saturating_mul(max_slot);
    if geo.span_bound(quick, max_slot) <= geo.ring_bytes {
        return Ok(());
    }
    // Within one epoch a rank's sequence repeats no sample unless the
    // padding to equal ranks is a whole dataset or more (j and j + len fall
    // on one rank only when len is a multiple of world, i.e. no padding),
    // so a batch holds distinct samples and the largest ones bound it.
    let cfg = sampler.config();
    let distinct = cfg.drop_last || sampler.per_rank() * (cfg.world as u64) < 2 * cfg.len;
    let slots = if distinct {
        largest_slots(catalog, geo, batch)
    } else {
        quick
    };
    if geo.span_bound(slots, max_slot) <= geo.ring_bytes {
        return Ok(());
    }
    let needed = schedule::ring_bytes_needed(geo.align, geo.align.max(4096), slots, max_slot);
    Err(Error::RingTooSmallForBatch {
        batch_size: batch,
        batch_bytes: geo.span_bound(slots, max_slot),
        align_bytes: geo.align,
        ring_bytes: geo.ring_bytes,
        needed_bytes: needed,
        needed_human: crate::progress::human_bytes(needed as f64),
    })
}

/// The sum of the `n` largest slots of the catalog (of all, if fewer).
fn largest_slots(catalog: &Catalog, geo: Geometry, n: usize) -> u64 {
    use std::cmp::Reverse;
    use std::collections::BinaryHeap;
    let n = n.min(catalog.len() as usize);
    let mut heap: BinaryHeap<Reverse<u64>> = BinaryHeap::with_capacity(n + 1);
    for id in 0..catalog.len() {
        let slot = geo.slot(catalog.sample(id).len as u64);
        if heap.len() < n {
            heap.push(Reverse(slot));
        } else if heap.peek().is_some_and(|Reverse(min)| slot > *min) {
            heap.pop();
            heap.push(Reverse(slot));
        }
    }
    heap.into_iter().map(|Reverse(s)| s).sum()
}

/// Resources kept across restarts (set_epoch to another epoch, resume).
struct Spare {
    input: Input,
    ring: LandingRing,
    tier: Option<Tier>,
    backends: Vec<Box<dyn IoBackend>>,
}

struct Run {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<Box<dyn IoBackend>>>,
    net_thread: Option<JoinHandle<()>>,
    /// Backends of pollers already joined (by `finish`).
    joined: Vec<Box<dyn IoBackend>>,
}

impl Run {
    /// Stops the pollers and waits for them (and their in-flight reads).
    fn stop(&mut self) -> Option<Error> {
        self.shared.stop.store(true, Ordering::Release);
        for t in &self.threads {
            t.thread().unpark();
        }
        if let Some(net) = &self.shared.net {
            net.wake.notify();
        }
        let mut failed = None;
        if let Some(t) = self.net_thread.take() {
            if t.join().is_err() {
                failed = Some(Error::ThreadPanicked { thread: "network" });
            }
        }
        for t in self.threads.drain(..) {
            match t.join() {
                Ok(b) => self.joined.push(b),
                Err(_) => failed = Some(Error::ThreadPanicked { thread: "poller" }),
            }
        }
        failed
    }
}

#[derive(Debug, Default, Clone, Copy)]
struct Counters {
    samples: u64,
    bytes: u64,
    stall: Duration,
}

/// What the pollers and the network thread counted, summed over runs.
#[derive(Clone)]
struct Totals {
    disk_reads: u64,
    tier_hits: u64,
    retries: u64,
    remote_samples: u64,
    failovers: u64,
    source_reads: u64,
    /// Samples read ahead that a restart or the end threw away.
    discarded: u64,
    latency: Histogram<u64>,
}

impl Totals {
    fn new() -> Self {
        Totals {
            disk_reads: 0,
            tier_hits: 0,
            retries: 0,
            remote_samples: 0,
            failovers: 0,
            source_reads: 0,
            discarded: 0,
            latency: Histogram::new_with_bounds(1, 60_000_000, 2).expect("valid bounds"),
        }
    }

    /// Adds what one run counted (`next_g`: the consumer's next sample).
    fn add_run(&mut self, sh: &Shared, next_g: u64) {
        for s in &sh.stats {
            self.disk_reads += s.disk_reads.load(Ordering::Relaxed);
            self.tier_hits += s.tier_hits.load(Ordering::Relaxed);
            self.retries += s.retries.load(Ordering::Relaxed);
            let _ = self
                .latency
                .add(&*s.latency.lock().unwrap_or_else(|e| e.into_inner()));
        }
        if let Some(n) = &sh.net {
            self.remote_samples += n.remote_samples.load(Ordering::Relaxed);
            self.failovers += n.failovers.load(Ordering::Relaxed);
            self.source_reads += n.source_reads.load(Ordering::Relaxed);
        }
        self.discarded += sh.ready_from(next_g);
    }
}

/// One sample of a batch.
#[derive(Debug, Clone, Copy)]
pub struct BatchSample<'a> {
    /// Sample id (catalog index).
    pub id: u64,
    /// Label, if the source has one.
    pub label: Option<u32>,
    /// The bytes, in the landing ring.
    pub bytes: &'a [u8],
    /// Its place in the rank's sequence.
    pub position: Position,
}

/// One sample of a batch held in a GPU ring ([`Loader::held_device_sample`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceSample {
    /// Sample id (catalog index).
    pub id: u64,
    /// Label, if the source has one.
    pub label: Option<u32>,
    /// Device address of its first byte.
    pub addr: u64,
    /// Its offset in the ring (for `DeviceMemory` copies).
    pub offset: u64,
    /// Its length in bytes.
    pub len: usize,
    /// Its place in the rank's sequence.
    pub position: Position,
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    id: u64,
    label: Option<u32>,
    phys: u64,
    len: u64,
    pos: Position,
}

/// A batch: consecutive samples of the rank's sequence, zero-copy in the
/// landing ring. Dropping it returns its ring space; only one batch is out
/// at a time (it borrows the loader), so batches are released in order.
pub struct Batch<'a> {
    loader: &'a mut Loader,
}

impl Batch<'_> {
    /// Samples in the batch.
    pub fn len(&self) -> usize {
        self.loader.entries.len()
    }

    /// Whether the batch is empty (never: an epoch's end is `None`).
    pub fn is_empty(&self) -> bool {
        self.loader.entries.is_empty()
    }

    /// Sample `i`.
    pub fn get(&self, i: usize) -> BatchSample<'_> {
        self.loader.held_sample(i)
    }

    /// The samples in order.
    pub fn iter(&self) -> impl Iterator<Item = BatchSample<'_>> + '_ {
        (0..self.len()).map(|i| self.get(i))
    }

    /// The batch's bytes as one contiguous span of the ring, plus a second
    /// span when the batch wraps around the ring's end. Spans include the
    /// alignment padding between samples.
    pub fn spans(&self) -> (&[u8], Option<&[u8]>) {
        self.loader.held_spans()
    }

    /// The epoch this batch belongs to.
    pub fn epoch(&self) -> u64 {
        self.loader.entries[0].pos.epoch
    }
}

impl Drop for Batch<'_> {
    fn drop(&mut self) {
        self.loader.release_batch();
    }
}

/// Latency percentiles in microseconds.
#[derive(Debug, Clone, Copy, Default)]
pub struct Latency {
    /// Reads measured.
    pub count: u64,
    /// Median.
    pub p50_us: u64,
    /// 90th percentile.
    pub p90_us: u64,
    /// 99th percentile.
    pub p99_us: u64,
    /// 99.9th percentile.
    pub p999_us: u64,
    /// Largest.
    pub max_us: u64,
}

/// Loader statistics since it was built, cumulative over its life
/// (restarts by `set_epoch` or `restore_position` included). `samples` and
/// `bytes` count what was delivered; the read counters (`disk_reads`,
/// `tier_hits`, `remote_samples`) also count samples read ahead, which are
/// either still waiting (`read_ahead`) or were thrown away
/// (`read_ahead_discarded`).
#[derive(Debug, Clone, Copy)]
pub struct Stats {
    /// Samples delivered.
    pub samples: u64,
    /// Bytes delivered.
    pub bytes: u64,
    /// Time since the loader was built.
    pub elapsed: Duration,
    /// Time the caller waited inside `next_batch`.
    pub stall: Duration,
    /// Samples read from disk (or source files).
    pub disk_reads: u64,
    /// Samples served from the memory tier.
    pub tier_hits: u64,
    /// Reads retried (short or interrupted).
    pub retries: u64,
    /// Per-sample read latency (submission to completion) of disk reads.
    pub read_latency: Latency,
    /// Samples pushed by other nodes (cluster mode).
    pub remote_samples: u64,
    /// Grants moved to another holder or the source after a node failed.
    pub failovers: u64,
    /// Samples read from the source because no holder could serve them.
    pub source_reads: u64,
    /// Samples read ahead of the consumer and waiting in the ring now
    /// (counted in `disk_reads`, `tier_hits` or `remote_samples`, not yet
    /// in `samples`).
    pub read_ahead: u64,
    /// Samples read ahead and then thrown away unconsumed: by a
    /// `set_epoch` to another epoch, a `restore_position`, or the end (for
    /// example the next epoch's first samples when the job stops).
    pub read_ahead_discarded: u64,
}

impl Stats {
    /// Samples per second.
    pub fn samples_per_sec(&self) -> f64 {
        self.samples as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }

    /// Bytes per second.
    pub fn bytes_per_sec(&self) -> f64 {
        self.bytes as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }

    /// Fraction of the time spent waiting for data.
    pub fn stall_fraction(&self) -> f64 {
        self.stall.as_secs_f64() / self.elapsed.as_secs_f64().max(1e-9)
    }
}

/// Reads a rank's samples in sampler order. See the module docs.
pub struct Loader {
    run: Option<Run>,
    spare: Option<Spare>,
    geo: Geometry,
    sampler: Sampler,
    cfg: PollerConfig,
    fixed_buffers: bool,
    fixed_files: bool,
    batch_size: usize,
    /// Steps per epoch for this rank (see [`Loader::epoch_len`]).
    steps: u64,
    /// The epoch the caller is in.
    epoch: u64,
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
    /// released, oldest first: the first sample of each (the released mark
    /// moves to the next one's when the oldest goes).
    kept: std::collections::VecDeque<Placed>,
    /// The first error: every later call returns it (wrapped).
    failed: Option<Error>,
    counters: Counters,
    /// Pollers' and network counters of earlier runs (before restarts).
    totals: Totals,
    started: Instant,
    /// Cluster mode settings (connections are made at every launch).
    net: Option<Arc<net::NetSetup>>,
}

impl Loader {
    /// Starts a run at `start`. On error the loader keeps its resources
    /// (catalog, ring) and no thread of the run is left behind.
    fn launch(&mut self, start: Position) -> Result<()> {
        // Connect first: a refusal leaves the loader as it was.
        let conns = match &mut self.net {
            Some(setup) => {
                let mut s = (**setup).clone();
                let ring = &self.spare.as_ref().expect("resources available").ring;
                let conns = net::connect_all(&mut s, ring)?;
                *setup = Arc::new(s);
                Some(conns)
            }
            None => None,
        };
        let net_shared = match conns {
            Some(_) => Some(net::NetShared::new(self.geo.table_len() as usize)?),
            None => None,
        };
        let spare = self.spare.take().expect("resources available");
        let n = spare.backends.len();
        let table = self.geo.table_len() as usize;
        let shared = Arc::new(Shared {
            input: spare.input,
            ring: spare.ring,
            geo: self.geo,
            sampler: self.sampler.clone(),
            steps: self.steps,
            start,
            cfg: self.cfg.clone(),
            fixed_buffers: self.fixed_buffers,
            fixed_files: self.fixed_files,
            ready: (0..table).map(|_| AtomicU64::new(0)).collect(),
            released_v: AtomicU64::new(0),
            released_g: AtomicU64::new(0),
            parked: (0..n)
                .map(|_| (AtomicU64::new(0), AtomicU64::new(0)))
                .collect(),
            stop: AtomicBool::new(false),
            wake_seq: AtomicU32::new(0),
            waiting_for: AtomicU64::new(0),
            errors: Mutex::new(Vec::new()),
            stats: (0..n)
                .map(|_| PollerStats {
                    disk_reads: AtomicU64::new(0),
                    tier_hits: AtomicU64::new(0),
                    retries: AtomicU64::new(0),
                    latency: Mutex::new(
                        Histogram::new_with_bounds(1, 60_000_000, 2).expect("valid bounds"),
                    ),
                })
                .collect(),
            tier: spare.tier,
            net: net_shared,
            dead: Mutex::new(None),
        });
        self.cursor = Some(Cursor::new(
            self.sampler.clone(),
            self.geo,
            start,
            self.steps,
        ));
        self.peeked = None;
        self.epoch = start.epoch;
        self.run = Some(Run {
            shared,
            threads: Vec::with_capacity(n),
            net_thread: None,
            joined: Vec::new(),
        });
        if let Err(e) = self.spawn(spare.backends, conns) {
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
        backends: Vec<Box<dyn IoBackend>>,
        conns: Option<net::Connected>,
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
        }
        let cores = if self.cfg.pin {
            core_affinity::get_core_ids().unwrap_or_default()
        } else {
            Vec::new()
        };
        let n = backends.len();
        for (i, backend) in backends.into_iter().enumerate() {
            let sh = shared.clone();
            let core = (!cores.is_empty())
                .then(|| cores[(cores.len() - 1 - i % cores.len()) % cores.len()]);
            let h = std::thread::Builder::new()
                .name(format!("kspeed-poller-{i}"))
                .spawn(move || {
                    if let Some(c) = core {
                        core_affinity::set_for_current(c);
                    }
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
            run.threads.push(h);
        }
        Ok(())
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
            (Some(r), _) => (&r.shared.input, &r.shared.ring, r.shared.tier.as_ref()),
            (None, Some(s)) => (&s.input, &s.ring, s.tier.as_ref()),
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
        self.check_failed()?;
        self.entries.clear();
        let mut first_v = None;
        while self.entries.len() < self.batch_size {
            let p = match self.peeked.take() {
                Some(p) => p,
                None => self
                    .cursor
                    .as_mut()
                    .expect("running")
                    .next(self.run.as_ref().expect("running").shared.input.catalog()),
            };
            if p.pos.epoch != self.epoch {
                self.peeked = Some(p);
                break;
            }
            // A batch is held whole while it is out, so it must fit in the
            // ring; the build's check_batch_fits guarantees it does.
            let v0 = *first_v.get_or_insert(p.v);
            if p.v_end - v0 > self.geo.ring_bytes {
                self.peeked = Some(p);
                self.entries.clear();
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
            if let Err(e) = self.wait_ready(&p) {
                self.entries.clear();
                return Err(self.fail(e));
            }
            let label = self.shared().input.catalog().sample(p.id).label;
            self.entries.push(Entry {
                id: p.id,
                label,
                phys: p.phys(&self.geo),
                len: p.len,
                pos: p.pos,
            });
            self.counters.samples += 1;
            self.counters.bytes += p.len;
        }
        self.held = !self.entries.is_empty();
        if self.held {
            self.batch_seq += 1;
        }
        Ok(self.entries.len())
    }

    /// The identity of the held batch (its sequence number: 1 for the
    /// loader's first batch, then 2, 3...), or `None` when none is held.
    pub fn held_seq(&self) -> Option<u64> {
        self.held.then_some(self.batch_seq)
    }

    /// Samples in the held batch (0 when none is held).
    pub fn held_len(&self) -> usize {
        if self.held {
            self.entries.len()
        } else {
            0
        }
    }

    /// Sample `i` of the held batch.
    ///
    /// # Panics
    /// When no batch is held or `i` is out of range.
    pub fn held_sample(&self, i: usize) -> BatchSample<'_> {
        assert!(self.held, "no batch is held");
        let e = self.entries[i];
        let ring = &self.run.as_ref().expect("running").shared.ring;
        debug_assert!(
            e.phys + e.len <= self.geo.ring_bytes,
            "a held slot lies inside the ring"
        );
        BatchSample {
            id: e.id,
            label: e.label,
            // SAFETY: the sample is ready (published by its poller) and its
            // slot lies behind the released mark's window, so no poller
            // writes it until the batch is released.
            bytes: unsafe { ring.slice(e.phys as usize, e.len as usize) },
            position: e.pos,
        }
    }

    /// The GPU memory holding the ring, when it is there
    /// ([`LoaderBuilder::gpu_ring`]).
    pub fn landing_device(&self) -> Option<&crate::landing::cuda::DeviceMemory> {
        self.parts().1.device()
    }

    /// Sample `i` of the held batch in a GPU ring: its device address.
    ///
    /// # Panics
    /// When no batch is held, `i` is out of range, or the ring is host memory.
    pub fn held_device_sample(&self, i: usize) -> DeviceSample {
        assert!(self.held, "no batch is held");
        let ring = &self.run.as_ref().expect("running").shared.ring;
        let dev = ring.device().expect("the landing ring is host memory");
        let e = self.entries[i];
        DeviceSample {
            id: e.id,
            label: e.label,
            addr: dev.addr() + e.phys,
            offset: e.phys,
            len: e.len as usize,
            position: e.pos,
        }
    }

    /// The held batch in a GPU ring as (device address, bytes) spans: one,
    /// or two if it wraps, alignment padding included.
    ///
    /// # Panics
    /// When no batch is held or the ring is host memory.
    pub fn held_device_spans(&self) -> ((u64, usize), Option<(u64, usize)>) {
        let ring = &self.run.as_ref().expect("running").shared.ring;
        let base = ring
            .device()
            .expect("the landing ring is host memory")
            .addr();
        let ((off, len), wrap) = self.held_span_ranges();
        ((base + off, len), wrap.map(|(o, l)| (base + o, l)))
    }

    /// The held batch's span(s) as (ring offset, bytes): from its first
    /// sample's start to its last sample's end, split at the ring's end.
    ///
    /// # Panics
    /// When no batch is held.
    fn held_span_ranges(&self) -> ((u64, usize), Option<(u64, usize)>) {
        assert!(self.held, "no batch is held");
        let first = self.entries[0];
        let last = *self.entries.last().expect("non-empty");
        let end = last.phys + last.len;
        if end >= first.phys {
            ((first.phys, (end - first.phys) as usize), None)
        } else {
            let wrap = self.geo.ring_bytes;
            (
                (first.phys, (wrap - first.phys) as usize),
                Some((0, end as usize)),
            )
        }
    }

    /// The held batch as one contiguous span of the ring (two if it wraps),
    /// alignment padding included.
    ///
    /// # Panics
    /// When no batch is held.
    pub fn held_spans(&self) -> (&[u8], Option<&[u8]>) {
        let ring = &self.run.as_ref().expect("running").shared.ring;
        let ((off, len), wrap) = self.held_span_ranges();
        // SAFETY: as in `held_sample`: every byte of these spans belongs to
        // ready samples of this batch or to padding between them, which no
        // poller writes; the ranges lie inside the ring.
        unsafe {
            (
                ring.slice(off as usize, len),
                wrap.map(|(o, l)| ring.slice(o as usize, l)),
            )
        }
    }

    fn wait_ready(&mut self, p: &Placed) -> Result<()> {
        let spin = self.cfg.spin;
        let sh = &self.run.as_ref().expect("running").shared;
        let mut state = sh.state(p.g);
        if state.is_none() {
            let t0 = Instant::now();
            while state.is_none() && t0.elapsed() < spin {
                std::hint::spin_loop();
                state = sh.state(p.g);
            }
            while state.is_none() {
                let seq = sh.wake_seq.load(Ordering::SeqCst);
                sh.waiting_for.store(p.g + 1, Ordering::SeqCst);
                state = sh.state(p.g);
                if state.is_none() {
                    crate::sys::futex_wait(&sh.wake_seq, seq, Duration::from_millis(10));
                    state = sh.state(p.g);
                    if state.is_none() {
                        if let Some(e) = sh.dead() {
                            sh.waiting_for.store(0, Ordering::SeqCst);
                            return Err(e);
                        }
                    }
                }
            }
            sh.waiting_for.store(0, Ordering::SeqCst);
            self.counters.stall += t0.elapsed();
        }
        if state == Some(CODE_OK) {
            return Ok(());
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
        if std::mem::take(&mut self.held) || kept {
            self.release();
        }
    }

    /// Releases batch `seq` ([`Loader::held_seq`]) if it is the one held:
    /// `Ok(true)`. A batch released already (explicitly, or by the next
    /// batch, `set_epoch` or `restore_position`) is left alone: `Ok(false)`,
    /// so a binding's late release never frees a newer batch. A `seq` never
    /// handed out is an [`Error::InvalidConfig`].
    pub fn release_batch_seq(&mut self, seq: u64) -> Result<bool> {
        if seq == 0 || seq > self.batch_seq {
            return Err(Error::InvalidConfig(format!(
                "batch {seq} was never handed out (the last batch is {})",
                self.batch_seq
            )));
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
    /// when the ring cannot hold the whole new batch beside the batches out:
    /// waiting would never end, since their space comes back only when the
    /// caller releases them.
    pub fn acquire_batch_keep(&mut self) -> Result<usize> {
        self.check_failed()?;
        let first = self.peek_next();
        if let Some(oldest) = self.kept.front() {
            if first.pos.epoch == self.epoch {
                // Walk the new batch's schedule on a copy of the cursor: where
                // its last sample ends, as acquire_batch will place it.
                let catalog = self.run.as_ref().expect("running").shared.input.catalog();
                let mut cursor = self.cursor.clone().expect("running");
                let mut end = first.v_end;
                for _ in 1..self.batch_size {
                    let p = cursor.next(catalog);
                    if p.pos.epoch != self.epoch || p.v_end - first.v > self.geo.ring_bytes {
                        break;
                    }
                    end = p.v_end;
                }
                if end - oldest.v > self.geo.ring_bytes {
                    return Err(Error::InvalidConfig(format!(
                        "the {}-byte landing ring cannot hold another batch beside the {} \
                         still out ({} bytes needed); release one first or raise ring_bytes",
                        self.geo.ring_bytes,
                        self.kept.len(),
                        end - oldest.v
                    )));
                }
            }
        }
        // The held batch (if any) stays out: it is already in `kept`.
        self.held = false;
        let kept = std::mem::take(&mut self.kept);
        let n = self.acquire_batch();
        self.kept = kept;
        if let Ok(n) = n {
            if n > 0 {
                self.kept.push_back(first);
            }
        }
        n
    }

    /// Returns the ring space of the oldest batch kept out by
    /// [`Loader::acquire_batch_keep`]; false when none is out.
    pub fn release_oldest_batch(&mut self) -> bool {
        if self.kept.pop_front().is_none() {
            return false;
        }
        match self.kept.front() {
            Some(&next) => self.mark_released(next),
            None => {
                self.held = false;
                self.release();
            }
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
                let p = self
                    .cursor
                    .as_mut()
                    .expect("running")
                    .next(self.run.as_ref().expect("running").shared.input.catalog());
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
    fn mark_released(&self, next: Placed) {
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
                t.thread().unpark();
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
        self.restart(Position { epoch, index: 0 })
    }

    /// Whether [`Loader::set_epoch`]`(epoch)` goes on with what the pollers
    /// read ahead (the next epoch after finishing one, or the current one)
    /// instead of restarting them.
    pub fn epoch_continues(&self, epoch: u64) -> bool {
        let pos = self.position();
        pos.epoch == epoch && (pos.index == 0 || epoch == self.epoch)
    }

    fn restart(&mut self, pos: Position) -> Result<()> {
        self.halt();
        self.check_failed()?;
        if let Err(e) = self.launch(pos) {
            return Err(self.fail(e));
        }
        Ok(())
    }

    /// The position of the next sample `next_batch` will deliver.
    pub fn position(&self) -> Position {
        match &self.peeked {
            Some(p) => p.pos,
            None => self.cursor.as_ref().expect("running").position(),
        }
    }

    /// The current position, serialized ([`POSITION_BYTES`] bytes) for a
    /// checkpoint. It carries the sampler's settings and the catalog's
    /// identity, so it resumes only the same job on the same dataset.
    pub fn save_position(&self) -> [u8; POSITION_BYTES] {
        self.sampler
            .save(self.position(), self.parts().0.catalog().identity())
    }

    /// Continues from a position saved by [`Loader::save_position`] with the
    /// same dataset (catalog), seed, shuffle, rank, world and drop_last;
    /// anything else is an [`Error::BadPosition`] saying what differs.
    pub fn restore_position(&mut self, bytes: &[u8]) -> Result<()> {
        self.release_batch();
        self.check_failed()?;
        let pos = self
            .sampler
            .restore(bytes, self.parts().0.catalog().identity())?;
        if pos.index > self.steps {
            return Err(Error::BadPosition(format!(
                "step {} is past the epoch's {} steps",
                pos.index, self.steps
            )));
        }
        self.restart(pos)
    }

    /// Samples per batch (the last of an epoch may have fewer).
    pub fn batch_size(&self) -> usize {
        self.batch_size
    }

    /// Samples per epoch for this rank, the same on every rank: the
    /// sampler's share (padded to equal ranks), or with drop_last that
    /// rounded down to whole batches.
    pub fn epoch_len(&self) -> u64 {
        self.steps
    }

    /// Batches per epoch, the same on every rank: `ceil(epoch_len /
    /// batch_size)` (with drop_last every batch is whole).
    pub fn batches_per_epoch(&self) -> u64 {
        self.steps.div_ceil(self.batch_size as u64)
    }

    /// The catalog being read.
    pub fn catalog(&self) -> &Catalog {
        self.parts().0.catalog()
    }

    /// What the landing ring got (huge pages, lock, NUMA node, CUDA).
    pub fn landing_info(&self) -> &LandingInfo {
        self.parts().1.info()
    }

    /// Statistics over the loader's life so far (cumulative across
    /// `set_epoch` and `restore_position` restarts).
    pub fn stats(&self) -> Stats {
        let mut t = self.totals.clone();
        let mut ahead = 0;
        if let Some(run) = &self.run {
            // The live run: its read-ahead is not thrown away (yet).
            let discarded = t.discarded;
            t.add_run(&run.shared, self.next_g());
            ahead = t.discarded - discarded;
            t.discarded = discarded;
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
            disk_reads: t.disk_reads,
            tier_hits: t.tier_hits,
            retries: t.retries,
            read_latency: lat,
            remote_samples: t.remote_samples,
            failovers: t.failovers,
            source_reads: t.source_reads,
            read_ahead: ahead,
            read_ahead_discarded: t.discarded,
        }
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
            drop(spare.tier);
            drop(spare.ring);
            drop(spare.input);
        }
    }
}
