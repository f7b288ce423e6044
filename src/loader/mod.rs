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
    pub(crate) start: Position,
    pub(crate) cfg: PollerConfig,
    pub(crate) fixed_buffers: bool,
    pub(crate) fixed_files: bool,
    /// Indexed by g mod table length: ((g + 1) << 8) | code once g is ready.
    ready: Box<[AtomicU64]>,
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
    /// Set when a poller or the network thread died of a panic, so the
    /// consumer fails instead of waiting for samples that will never come.
    crashed: Mutex<Option<String>>,
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
            *self
                .shared
                .crashed
                .lock()
                .unwrap_or_else(|e| e.into_inner()) =
                Some(format!("the {} thread panicked", self.name));
            self.shared.wake();
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

    fn state(&self, g: u64) -> Option<u64> {
        let v = self.ready[(g % self.ready.len() as u64) as usize].load(Ordering::Acquire);
        (v >> 8 == g + 1).then_some(v & 0xff)
    }
}

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
        if self.batch_size == 0 {
            return Err(Error::InvalidConfig("batch_size must be at least 1".into()));
        }
        for (what, n) in [
            ("pollers", self.pollers as u64),
            ("queue_depth", self.queue_depth as u64),
            ("submit_batch", self.submit_batch as u64),
        ] {
            if n == 0 {
                return Err(Error::InvalidConfig(format!(
                    "{what} must be at least 1, not 0"
                )));
            }
        }
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
                    if !direct {
                        log::info!(
                            "{}: O_DIRECT not supported here, reading through the page cache",
                            path.display()
                        );
                    }
                    extents.push(f);
                }
                (Input::Space { space, extents }, align)
            }
            (None, Some(src)) => {
                let spec = SourceSpec::parse(src)?;
                let catalog = match &self.catalog {
                    Some(c) => Catalog::open(c)?,
                    None => {
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
        if sampler.per_rank() == 0 {
            return Err(Error::InvalidConfig(format!(
                "with drop_last, {} samples give rank {} of {} nothing to read",
                catalog.len(),
                self.rank,
                self.world
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
            Some(p) if p.index > sampler.per_rank() => {
                return Err(Error::BadPosition(format!(
                    "step {} is past the epoch's {} steps",
                    p.index,
                    sampler.per_rank()
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
        let mut backends = Vec::with_capacity(cfg.pollers);
        let mut fixed_buffers = self.registered_buffers && ring.device().is_none();
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
                let seg = geo.segment() as usize;
                let regions: Vec<(*mut u8, usize)> = (0..ring.len())
                    .step_by(seg)
                    // SAFETY: off < ring.len(), inside the mapping.
                    .map(|off| {
                        (
                            unsafe { ring.as_mut_ptr().add(off) },
                            seg.min(ring.len() - off),
                        )
                    })
                    .collect();
                // SAFETY: the ring outlives every backend: backends are
                // dropped by the Loader before its Shared (and so the ring).
                if let Err(e) = unsafe { uring.register_buffers(&regions) } {
                    log::info!("registered buffers unavailable ({e}); using plain reads");
                    fixed_buffers = false;
                }
            }
            let b: Box<dyn IoBackend> = match cfg.faults {
                Some(f) => Box::new(Faulty::new(uring, f, cfg.queue_depth as usize)),
                None => Box::new(uring),
            };
            backends.push(b);
        }
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
            epoch: start.epoch,
            cursor: None,
            peeked: None,
            entries: Vec::with_capacity(batch_size),
            held: false,
            kept: std::collections::VecDeque::new(),
            failed: None,
            counters: Counters::default(),
            started: Instant::now(),
            net: net.map(Arc::new),
        };
        loader.launch(start)?;
        log::info!(
            "loader: {} samples per epoch for rank {} of {}, batch {}, ring {} bytes, {} pollers{}",
            loader.sampler.per_rank(),
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
    fn stop(&mut self) -> Option<String> {
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
                failed = Some("the network thread panicked".to_string());
            }
        }
        for t in self.threads.drain(..) {
            match t.join() {
                Ok(b) => self.joined.push(b),
                Err(_) => failed = Some("a poller thread panicked".to_string()),
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

/// Loader statistics since it was built.
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
    /// The epoch the caller is in.
    epoch: u64,
    cursor: Option<Cursor>,
    /// A sample taken from the cursor but left for the next batch because
    /// the ring could not hold it together with the batch so far.
    peeked: Option<Placed>,
    entries: Vec<Entry>,
    /// Whether `entries` is a batch handed out and not yet released.
    held: bool,
    /// Batches handed out by [`Loader::acquire_batch_keep`] and not yet
    /// released, oldest first: the first sample of each (the released mark
    /// moves to the next one's when the oldest goes).
    kept: std::collections::VecDeque<Placed>,
    failed: Option<String>,
    counters: Counters,
    started: Instant,
    /// Cluster mode settings (connections are made at every launch).
    net: Option<Arc<net::NetSetup>>,
}

impl Loader {
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
        let spare = self.spare.take().expect("resources available");
        let n = spare.backends.len();
        let table = self.geo.table_len() as usize;
        let shared = Arc::new(Shared {
            input: spare.input,
            ring: spare.ring,
            geo: self.geo,
            sampler: self.sampler.clone(),
            start,
            cfg: self.cfg.clone(),
            fixed_buffers: self.fixed_buffers,
            fixed_files: self.fixed_files,
            ready: (0..table).map(|_| AtomicU64::new(0)).collect(),
            released_v: AtomicU64::new(0),
            released_g: AtomicU64::new(0),
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
            net: match conns {
                Some(_) => Some(net::NetShared::new()?),
                None => None,
            },
            crashed: Mutex::new(None),
        });
        let net_thread = match (conns, &self.net) {
            (Some(conns), Some(setup)) => {
                let t = net::NetThread::new(shared.clone(), setup.clone(), conns)?;
                let guard = CrashGuard {
                    shared: shared.clone(),
                    name: "network",
                };
                Some(
                    std::thread::Builder::new()
                        .name("kspeed-net".into())
                        .spawn(move || {
                            let _guard = guard;
                            t.run()
                        })
                        .expect("spawn network thread"),
                )
            }
            _ => None,
        };
        let cores = if self.cfg.pin {
            core_affinity::get_core_ids().unwrap_or_default()
        } else {
            Vec::new()
        };
        let mut threads = Vec::with_capacity(n);
        for (i, backend) in spare.backends.into_iter().enumerate() {
            let sh = shared.clone();
            let core = (!cores.is_empty())
                .then(|| cores[(cores.len() - 1 - i % cores.len()) % cores.len()]);
            let t = std::thread::Builder::new()
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
                .expect("spawn poller thread");
            threads.push(t);
        }
        self.cursor = Some(Cursor::new(self.sampler.clone(), self.geo, start));
        self.peeked = None;
        self.epoch = start.epoch;
        self.run = Some(Run {
            shared,
            threads,
            net_thread,
            joined: Vec::new(),
        });
        Ok(())
    }

    /// Stops the pollers (after their in-flight reads land) and takes the
    /// resources back.
    fn halt(&mut self) {
        let Some(mut run) = self.run.take() else {
            return;
        };
        if let Some(msg) = run.stop() {
            self.failed = Some(msg);
        }
        match Arc::try_unwrap(run.shared) {
            Ok(shared) => {
                self.spare = Some(Spare {
                    input: shared.input,
                    ring: shared.ring,
                    tier: shared.tier,
                    backends: run.joined,
                });
            }
            Err(_) => unreachable!("every poller thread has exited"),
        }
    }

    /// Stops the pollers and returns the final statistics (complete
    /// latency histograms: pollers publish theirs every 100 ms while running).
    pub fn finish(mut self) -> Stats {
        if let Some(run) = self.run.as_mut() {
            run.stop();
        }
        self.stats()
    }

    fn shared(&self) -> &Shared {
        &self.run.as_ref().expect("running").shared
    }

    /// The next batch of the current epoch, or `None` at its end (call
    /// [`Loader::set_epoch`] to go on). Blocks only while data is not there yet.
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
    /// [`Loader::release_batch`]. Returns its length (0 at the epoch's end).
    /// A batch still held is released first.
    pub fn acquire_batch(&mut self) -> Result<usize> {
        self.release_batch();
        if let Some(msg) = &self.failed {
            return Err(Error::LoaderFailed(msg.clone()));
        }
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
            // ring: cut it short rather than wait for space it holds itself.
            let v0 = *first_v.get_or_insert(p.v);
            if p.v_end - v0 > self.geo.ring_bytes {
                self.peeked = Some(p);
                break;
            }
            if let Err(e) = self.wait_ready(&p) {
                self.failed = Some(e.to_string());
                self.entries.clear();
                return Err(e);
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
        Ok(self.entries.len())
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
        self.run
            .as_ref()
            .map(|r| &r.shared.ring)
            .or(self.spare.as_ref().map(|s| &s.ring))
            .and_then(|r| r.device())
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
                        let crashed = sh.crashed.lock().unwrap_or_else(|e| e.into_inner()).clone();
                        if let Some(msg) = crashed {
                            sh.waiting_for.store(0, Ordering::SeqCst);
                            return Err(Error::LoaderFailed(msg));
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
        let mut errors = sh.errors.lock().expect("not poisoned");
        match errors.iter().position(|(g, _)| *g == p.g) {
            Some(i) => Err(errors.swap_remove(i).1),
            None => Err(Error::LoaderFailed(format!(
                "sample {} failed without a recorded error",
                p.id
            ))),
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
        if let Some(msg) = &self.failed {
            return Err(Error::LoaderFailed(msg.clone()));
        }
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
        let next = self.peek_next();
        self.mark_released(next);
    }

    /// Frees the ring before sample `next` and lets the pollers go on.
    fn mark_released(&self, next: Placed) {
        let sh = self.shared();
        sh.released_v.store(next.v, Ordering::Release);
        sh.released_g.store(next.g, Ordering::Release);
        for t in &self.run.as_ref().expect("running").threads {
            t.thread().unpark();
        }
        if let Some(net) = &self.shared().net {
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
        if let Some(msg) = &self.failed {
            return Err(Error::LoaderFailed(msg.clone()));
        }
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
        if let Err(e) = self.launch(pos) {
            self.failed = Some(e.to_string());
            return Err(e);
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

    /// The current position, serialized (36 bytes) for a checkpoint.
    pub fn save_position(&self) -> [u8; POSITION_BYTES] {
        self.sampler.save(self.position())
    }

    /// Continues from a position saved by [`Loader::save_position`] with the
    /// same dataset, seed, shuffle, rank, world and drop_last.
    pub fn restore_position(&mut self, bytes: &[u8]) -> Result<()> {
        self.release_batch();
        if let Some(msg) = &self.failed {
            return Err(Error::LoaderFailed(msg.clone()));
        }
        let pos = self.sampler.restore(bytes)?;
        self.restart(pos)
    }

    /// Samples per batch (the last of an epoch may have fewer).
    pub fn batch_size(&self) -> usize {
        self.batch_size
    }

    /// Samples per epoch for this rank.
    pub fn epoch_len(&self) -> u64 {
        self.sampler.per_rank()
    }

    /// The catalog being read.
    pub fn catalog(&self) -> &Catalog {
        self.shared().input.catalog()
    }

    /// What the landing ring got (huge pages, lock, NUMA node, CUDA).
    pub fn landing_info(&self) -> &LandingInfo {
        self.shared().ring.info()
    }

    /// Statistics so far.
    pub fn stats(&self) -> Stats {
        let Some(run) = self.run.as_ref() else {
            // Not running (a restart failed): what the consumer counted.
            return Stats {
                samples: self.counters.samples,
                bytes: self.counters.bytes,
                elapsed: self.started.elapsed(),
                stall: self.counters.stall,
                disk_reads: 0,
                tier_hits: 0,
                retries: 0,
                read_latency: Latency::default(),
                remote_samples: 0,
                failovers: 0,
                source_reads: 0,
            };
        };
        let sh = &run.shared;
        let mut hist: Histogram<u64> =
            Histogram::new_with_bounds(1, 60_000_000, 2).expect("valid bounds");
        let (mut disk, mut hits, mut retries) = (0, 0, 0);
        for s in &sh.stats {
            disk += s.disk_reads.load(Ordering::Relaxed);
            hits += s.tier_hits.load(Ordering::Relaxed);
            retries += s.retries.load(Ordering::Relaxed);
            let _ = hist.add(&*s.latency.lock().expect("not poisoned"));
        }
        let net_count = |f: fn(&net::NetShared) -> &AtomicU64| {
            sh.net.as_ref().map_or(0, |n| f(n).load(Ordering::Relaxed))
        };
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
            disk_reads: disk,
            tier_hits: hits,
            retries,
            read_latency: lat,
            remote_samples: net_count(|n| &n.remote_samples),
            failovers: net_count(|n| &n.failovers),
            source_reads: net_count(|n| &n.source_reads),
        }
    }

    /// The memory tier's size: (samples, bytes), if there is one.
    pub fn tier(&self) -> Option<(u64, u64)> {
        self.shared()
            .tier
            .as_ref()
            .map(|t| (t.members(), t.member_bytes()))
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
