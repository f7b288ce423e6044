//! [`LoaderBuilder`]: the loader's options, their defaults and limits, and
//! the build-time checks (the ring holds a whole batch, counts in range).
//!
//! Why this file is over ~800 lines: one builder whose ~35 documented setters
//! are the public API, and the build-time checks that read them all.

use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::schedule::{Deal, Geometry};
use super::stats::{Counters, Totals};
use super::tier::Tier;
use super::{input, net, ring_size, Input, Loader, PollerConfig, Spare};
use crate::dataset::Space;
use crate::error::{Error, Result};
use crate::landing::{LandingOptions, LandingRing};
use crate::ring::{FaultConfig, Faulty, IoBackend, Uring, UringOptions};
use crate::sampler::{
    epoch_counts, ElasticSampler, EpochDigest, JobPosition, MixSampler, Position, Sampler,
    SamplerConfig, Weight,
};

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
    shuffle_block: u64,
    rank: u32,
    world: u32,
    drop_last: bool,
    landing: LandingOptions,
    /// `None`: sized from the poller slice ([`crate::placement`]).
    pollers: Option<usize>,
    queue_depth: u32,
    submit_batch: u32,
    max_read_bytes: u64,
    lookahead: u64,
    /// `None`: [`default_spin`], or none when the slice is shared.
    spin: Option<Duration>,
    sqpoll_idle_ms: Option<u32>,
    pin: bool,
    local_rank: Option<u32>,
    local_world: Option<u32>,
    poller_numa_node: Option<u32>,
    sysfs_root: Option<PathBuf>,
    registered_buffers: bool,
    registered_files: bool,
    verify_crc32c: bool,
    tier_bytes: u64,
    tier_views: bool,
    cache_dir: Option<PathBuf>,
    cache_bytes: u64,
    cache_policy: crate::cache::CachePolicy,
    cache_memory_bytes: u64,
    coop_taskrun: bool,
    gpu_ring: Option<u32>,
    faults: Option<FaultConfig>,
    start: Option<Position>,
    end_epoch: Option<u64>,
    cluster: Option<crate::transport::Cluster>,
    token: Vec<u8>,
    node_timeout: Duration,
    rdma: Option<crate::transport::RdmaOptions>,
    local_node: Option<Option<u32>>,
    /// A mixture: each dataset (a space, a catalog or a source) and its
    /// weight ([`LoaderBuilder::mix`]); empty: `space` or `source` alone.
    mix: Vec<(String, Weight)>,
    /// The epoch size that mixture proportions divide.
    mix_epoch_size: Option<u64>,
    agent: super::AgentMode,
    page_cache: super::PageCache,
    agent_socket: Option<PathBuf>,
    agent_restart_wait: Duration,
    /// `s3_endpoint_url`, `s3_profile`.
    s3: (Option<String>, Option<String>),
    /// Inside the node agent: the space it opened once and the rank's ring.
    agent_input: Option<super::attached::AgentInput>,
    /// Inside the node agent: the job position the rank's world resumed at.
    job_deal: Option<crate::sampler::JobPosition>,
    /// Inside the node agent: where a rank's mixed order starts (an epoch
    /// resumed under other weights: what each dataset used before).
    mix_start: Option<crate::sampler::MixPosition>,
}

pub use crate::placement::{default_pollers, default_spin};

/// Default submission batch: a poller submits its queued reads every 8. On
/// this project's 2-core VM, with 4.5 KiB samples at queue depth 32, a
/// whole-queue batch (32) made the device complete all 32 together every
/// time and sit idle while the poller turned them around: 0.84x fio's IOPS.
/// Batches of 8 keep reads arriving while others complete: 0.97x, for 2 %
/// more CPU (BENCHMARKS.md, "Small samples").
pub const DEFAULT_SUBMIT_BATCH: u32 = 8;

impl LoaderBuilder {
    fn new() -> Self {
        LoaderBuilder {
            space: None,
            source: None,
            catalog: None,
            batch_size: 64,
            seed: 0,
            shuffle: true,
            shuffle_block: 0,
            rank: 0,
            world: 1,
            drop_last: false,
            landing: LandingOptions::default(),
            pollers: None,
            queue_depth: 32,
            submit_batch: DEFAULT_SUBMIT_BATCH,
            max_read_bytes: 4 << 20,
            lookahead: u64::MAX,
            spin: None,
            sqpoll_idle_ms: None,
            pin: true,
            local_rank: None,
            local_world: None,
            poller_numa_node: None,
            sysfs_root: None,
            registered_buffers: true,
            registered_files: true,
            verify_crc32c: false,
            tier_bytes: 0,
            tier_views: false,
            cache_dir: None,
            cache_bytes: 0,
            cache_policy: crate::cache::CachePolicy::NextUse,
            cache_memory_bytes: 0,
            coop_taskrun: false,
            gpu_ring: None,
            faults: None,
            start: None,
            end_epoch: None,
            cluster: None,
            token: Vec::new(),
            node_timeout: Duration::from_secs(10),
            rdma: None,
            local_node: None,
            mix: Vec::new(),
            mix_epoch_size: None,
            agent: super::AgentMode::Auto,
            page_cache: super::PageCache::Auto,
            agent_socket: None,
            agent_restart_wait: Duration::ZERO,
            s3: (None, None),
            agent_input: None,
            job_deal: None,
            mix_start: None,
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
        self.mix.clear();
        self
    }

    /// Reads this source directly (replacing any input set before).
    pub fn set_source(mut self, spec: &str) -> Self {
        self.source = Some(spec.to_string());
        self.space = None;
        self.mix.clear();
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

    /// Reads a mixture of datasets side by side in one id space: each a
    /// space directory, a catalog file (`.ksc`, read from
    /// the source it records) or a source (`DIR`, `list:FILE`, `tar:DIR`),
    /// with its [`Weight`]: every dataset a `Proportion` (of
    /// [`LoaderBuilder::mix_epoch_size`], default the datasets' total), or
    /// each a `Repeat`/`Choose` count. Dataset `d`'s sample `i` has id
    /// `offset_d + i` (the lengths of the datasets before it), and each
    /// sample says which dataset it came from
    /// ([`BatchSample::dataset`](super::BatchSample::dataset)). The order
    /// is docs/FORMAT.md's mixing function. With a
    /// [`cluster`](Self::cluster), a space may hold only this node's share
    /// and a catalog stands for a dataset this node holds none of; the
    /// nodes serve the same spaces in the same order (`kspeed serve
    /// --space A --space B`), each placed alike.
    pub fn mix<S: AsRef<str>>(datasets: impl IntoIterator<Item = (S, Weight)>) -> Self {
        Self::new().set_mix(datasets)
    }

    /// Reads this mixture ([`LoaderBuilder::mix`]), replacing any input set
    /// before.
    pub fn set_mix<S: AsRef<str>>(
        mut self,
        datasets: impl IntoIterator<Item = (S, Weight)>,
    ) -> Self {
        self.mix = datasets
            .into_iter()
            .map(|(d, w)| (d.as_ref().to_string(), w))
            .collect();
        self.space = None;
        self.source = None;
        self
    }

    /// Samples per epoch that mixture proportions divide (default: the
    /// datasets' total length).
    pub fn mix_epoch_size(mut self, samples: u64) -> Self {
        self.mix_epoch_size = Some(samples);
        self
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

    /// Shuffle within blocks of this many consecutive sample ids (default
    /// 0: one permutation of the whole dataset). The blocks are permuted
    /// and each block's ids among themselves, as LitData and Mosaic
    /// shuffle shards; reading a bucket's tar shards, neighbouring samples
    /// of a block then share one ranged GET (docs/FORMAT.md, "Sampler").
    pub fn shuffle_block(mut self, samples: u64) -> Self {
        self.shuffle_block = samples;
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

    /// Landing ring size; 0 (the default) sizes it from the batch and the
    /// dataset: six batches of the mean sample, 4 to 256 MiB (256 MiB in
    /// cluster mode), at most twice the dataset, and always enough for a
    /// batch of the largest samples plus two more read ahead, up to 4 GiB
    /// (the build logs the size chosen). A size given here, or a batch
    /// that needs more than 4 GiB by default, that cannot hold a whole
    /// batch is refused ([`Error::RingTooSmallForBatch`], naming the size).
    pub fn ring_bytes(mut self, bytes: u64) -> Self {
        self.landing.ring_bytes = bytes;
        self
    }

    /// All landing ring options (huge pages, mlock, NUMA, CUDA).
    pub fn landing(mut self, opts: LandingOptions) -> Self {
        self.landing = opts;
        self
    }

    /// Poller threads (default: a quarter of this rank's core slice, at
    /// least 1, at most 8; twice that, at most the slice, where a whole
    /// space is read through the page cache; see [`crate::placement`]).
    pub fn pollers(mut self, n: usize) -> Self {
        self.pollers = Some(n);
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
    /// [`default_spin`], and none when this rank shares its cores with
    /// other ranks).
    pub fn spin(mut self, d: Duration) -> Self {
        self.spin = Some(d);
        self
    }

    /// Create the pollers' io_urings with `IORING_SETUP_COOP_TASKRUN`
    /// (default false; ignored with SQPOLL): a completion is processed at
    /// the poller's next system call instead of interrupting it. Off by
    /// default until it measures better: on the tiny profile it made no
    /// difference that showed through a loaded machine (BENCHMARKS.md).
    pub fn coop_taskrun(mut self, on: bool) -> Self {
        self.coop_taskrun = on;
        self
    }

    /// Use an SQPOLL kernel thread per poller, idling after `idle_ms`.
    pub fn sqpoll(mut self, idle_ms: Option<u32>) -> Self {
        self.sqpoll_idle_ms = idle_ms;
        self
    }

    /// Pin pollers to the cores of this rank's slice (default true; see
    /// [`crate::placement`]).
    pub fn pin(mut self, on: bool) -> Self {
        self.pin = on;
        self
    }

    /// This process's rank among the node's ranks and their number, instead
    /// of the environment's (`KSPEED_LOCAL_RANK`/`KSPEED_LOCAL_WORLD_SIZE`,
    /// `LOCAL_RANK`/`LOCAL_WORLD_SIZE`,
    /// `OMPI_COMM_WORLD_LOCAL_RANK`/`OMPI_COMM_WORLD_LOCAL_SIZE`,
    /// `SLURM_LOCALID`/`SLURM_NTASKS_PER_NODE`). Each local rank's pollers
    /// get their own slice of the node's cores.
    pub fn local_rank(mut self, rank: u32, size: u32) -> Self {
        self.local_rank = Some(rank);
        self.local_world = Some(size);
        self
    }

    /// Sets the local rank or the local world size alone (for bindings
    /// that set options one by one, through `LoaderOptions`); both must be
    /// given by build time.
    pub(crate) fn local_rank_part(mut self, rank: Option<u32>, size: Option<u32>) -> Self {
        if rank.is_some() {
            self.local_rank = rank;
        }
        if size.is_some() {
            self.local_world = size;
        }
        self
    }

    /// Take the pollers' cores from this NUMA node (default: the node the
    /// landing ring is bound to, if any), for example the GPU's node when
    /// the ring is in GPU memory.
    pub fn poller_numa_node(mut self, node: Option<u32>) -> Self {
        self.poller_numa_node = node;
        self
    }

    /// Read the CPU topology from this directory shaped like `/sys`
    /// (default: `KSPEED_SYSFS_ROOT`, else `/sys`).
    pub fn sysfs_root(mut self, dir: impl AsRef<Path>) -> Self {
        self.sysfs_root = Some(dir.as_ref().to_path_buf());
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

    /// An NVMe cache area (docs/CACHE.md, "The cache area"): samples read
    /// from the source (a source, or those a partial space does not hold)
    /// are kept in `dir` (rank N's in `dir/rank<N>`) for their next read,
    /// by [`cache_policy`](Self::cache_policy), within
    /// [`cache_bytes`](Self::cache_bytes). What one run keeps, the next
    /// finds (checked against the catalog's CRC on every read). None: no
    /// cache area (the default).
    pub fn cache_dir(mut self, dir: Option<PathBuf>) -> Self {
        self.cache_dir = dir;
        self
    }

    /// The cache area's budget in bytes, shared among slot size classes
    /// from 4 KiB to the catalog's 99th percentile sample length (larger
    /// samples are not kept; docs/CACHE.md, "The cache area").
    pub fn cache_bytes(mut self, bytes: u64) -> Self {
        self.cache_bytes = bytes;
        self
    }

    /// What the cache area keeps (default: by next use).
    pub fn cache_policy(mut self, policy: crate::cache::CachePolicy) -> Self {
        self.cache_policy = policy;
        self
    }

    /// A memory level above the cache area on disk (docs/CACHE.md, "Two
    /// levels"): an area of `bytes` in this process's memory, read before
    /// the one in [`cache_dir`](Self::cache_dir), with its own planner by
    /// the same [`cache_policy`](Self::cache_policy), keeping what comes
    /// from the area, the space or the source when it is needed again
    /// soonest. 0: none (the default). Needs `cache_dir` to name a folder
    /// (for memory alone, `cache_dir` is `":memory:"`).
    pub fn cache_memory_bytes(mut self, bytes: u64) -> Self {
        self.cache_memory_bytes = bytes;
        self
    }

    /// Memory tier budget in bytes (default 0: no tier).
    pub fn tier_bytes(mut self, bytes: u64) -> Self {
        self.tier_bytes = bytes;
        self
    }

    /// Hand out samples that sit in the memory tier in place, without
    /// copying them into the landing ring (default false: every sample is
    /// copied into the ring, and a batch is one span of it).
    ///
    /// With this on, a sample served from the tier has its bytes
    /// ([`BatchSample::bytes`](super::BatchSample::bytes)) in the tier's
    /// memory, which is not the landing ring: such a batch is **not one
    /// contiguous span**. [`Batch::in_ring`](super::Batch::in_ring) (or
    /// [`Loader::held_in_ring`]) says whether the held batch is;
    /// [`Batch::spans`](super::Batch::spans) and [`Loader::held_spans`]
    /// panic when it is not. Whether a sample comes from the tier is decided
    /// per sample (a member is filled when first read from disk), so
    /// callers that copy a batch as one span (to a GPU, the C ABI's and
    /// Python's spans) should leave this off. The views stay valid while the
    /// batch is held (tier members are never evicted or rewritten).
    ///
    /// Attached to the node agent (no `tier_bytes` of its own), this asks
    /// the agent for views of its node tier: the agent passes the tier's
    /// memfd read-only with the attach, and names each sample it serves
    /// from the tier instead of copying it into the ring (docs/AGENT.md,
    /// "Tier views"). The views are read-only (the mapping cannot be made
    /// writable); an agent without a tier, or holding another user's
    /// samples, gives none, and every sample comes in the ring.
    pub fn tier_views(mut self, on: bool) -> Self {
        self.tier_views = on;
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

    /// How long a node that is alive (it sends heartbeats) may go without
    /// delivering while it has grants outstanding before its grants fail
    /// over (default 10 s). A node that sends nothing at all, heartbeats
    /// included, is taken for dead after 2 s (or this, if shorter); one
    /// that predates heartbeats after this.
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

    /// The job reads epochs below `end` only (`kspeed read --epochs N`
    /// sets the start epoch plus N): the pollers and the network thread
    /// read and request nothing of epoch `end` or later, so nothing is read
    /// ahead past the job's last sample, and [`Loader::set_epoch`] (or
    /// [`Loader::restore_position`]) to epoch `end` or later is an
    /// [`Error::InvalidConfig`]. `None` (the default): the read-ahead
    /// runs on into the next epoch, whatever the caller does next.
    pub fn end_epoch(mut self, end: Option<u64>) -> Self {
        self.end_epoch = end;
        self
    }

    /// How a preloaded space is read (default [`super::PageCache::Auto`]:
    /// through the page cache when nearly all of the space is cached when
    /// the loader is built, else O_DIRECT; `Off`: always O_DIRECT, `On`:
    /// always the page cache). Not for a loader attached to the agent,
    /// which reads for it.
    pub fn page_cache(mut self, mode: super::PageCache) -> Self {
        self.page_cache = mode;
        self
    }

    /// Reads through the node's `kspeed agent` ([`super::AgentMode`]):
    /// `Required` always, `Auto` (the default) in cluster mode where the
    /// agent can serve this loader (its socket exists and nothing the agent
    /// lacks is asked for; falling back to embedded pollers with a WARN
    /// when the attach fails or the agent refuses it), `Off` never.
    pub fn agent(mut self, mode: super::AgentMode) -> Self {
        self.agent = mode;
        self
    }

    /// The agent's socket (default [`super::default_agent_socket`]:
    /// `$KSPEED_AGENT_SOCKET`, else `/run/kspeed/agent.sock`).
    pub fn agent_socket(mut self, path: Option<PathBuf>) -> Self {
        self.agent_socket = path;
        self
    }

    /// Attached: how long to wait for a restarted agent at the same socket
    /// when the agent goes (default 0: [`Error::AgentGone`] at once). The
    /// loader re-attaches where the rank stood (the first sample it has not
    /// delivered), so every sample is still delivered exactly once.
    /// Batches kept out ([`Loader::acquire_batch_keep`]) stay valid: the
    /// old ring stays mapped until the last of them is released.
    pub fn agent_restart_wait(mut self, wait: Duration) -> Self {
        self.agent_restart_wait = wait;
        self
    }

    /// A source in an S3-compatible store: its endpoint (else the AWS
    /// variables' and the profile's). Process-wide: the store's settings
    /// are one per process (`dataset::store::set_overrides`), set by the
    /// last loader built with this or [`LoaderBuilder::s3_profile`].
    pub fn s3_endpoint_url(mut self, url: Option<String>) -> Self {
        self.s3.0 = url;
        self
    }

    /// A source in an object store: the profile of the AWS shared files to
    /// take credentials, region and endpoint from (else `AWS_PROFILE`,
    /// else `default`). Process-wide, as [`LoaderBuilder::s3_endpoint_url`].
    pub fn s3_profile(mut self, profile: Option<String>) -> Self {
        self.s3.1 = profile;
        self
    }

    /// Inside the agent: deal the rest of `job.epoch` from the job position
    /// the rank's world resumed at (the rank's `restore_job_position`),
    /// then ordinary epochs, as the rank's own schedule does.
    pub(crate) fn job_deal(mut self, job: Option<crate::sampler::JobPosition>) -> Self {
        self.job_deal = job;
        self
    }

    /// Inside the agent: a rank's mixed order starts here (its ATTACH's
    /// counts are the mixture's weights, `Weight::Choose`).
    pub(crate) fn mix_start(mut self, start: Option<crate::sampler::MixPosition>) -> Self {
        self.mix_start = start;
        self
    }

    /// Inside the agent: read `input.space` (opened and checked by the
    /// agent) into the rank's ring `input.ring`.
    pub(crate) fn agent_input(mut self, input: super::attached::AgentInput) -> Self {
        self.agent_input = Some(input);
        self
    }

    /// Opens the input, maps the ring, starts the pollers. A local
    /// loader's pollers wait until the first batch is asked for, so a
    /// [`Loader::restore_position`] right after the build costs no reads
    /// (docs/LOCAL_PATH.md, "Pollers"); in cluster mode and attached to
    /// the node agent they read at once.
    pub fn build(self) -> Result<Loader> {
        if self.s3.0.is_some() || self.s3.1.is_some() {
            #[cfg(feature = "s3")]
            crate::dataset::store::set_overrides(
                crate::dataset::store::StoreOverrides::default()
                    .endpoint_url(self.s3.0.clone())
                    .profile(self.s3.1.clone()),
            );
            #[cfg(not(feature = "s3"))]
            return Err(Error::InvalidConfig(
                "s3_endpoint_url/s3_profile: this build of kspeed has no object-store support (the s3 cargo feature)".into(),
            ));
        }
        let socket = self
            .agent_socket
            .clone()
            .unwrap_or_else(super::default_agent_socket);
        let attach = self.agent_input.is_none()
            && match self.agent {
                super::AgentMode::Off => false,
                super::AgentMode::Required => true,
                super::AgentMode::Auto => self.cluster.is_some() && self.agent_serves(&socket),
            };
        if !attach {
            return self.build_with(None);
        }
        let fallback = (self.agent == super::AgentMode::Auto).then(|| self.clone());
        match self.build_with(Some(socket)) {
            Err(e @ Error::NoAgent { .. }) => match fallback {
                Some(b) => {
                    log::warn!("{e}; reading with this process's own pollers (agent = auto)");
                    b.agent(super::AgentMode::Off).build_with(None)
                }
                None => Err(e),
            },
            r => r,
        }
    }

    /// What this loader needs that the node agent cannot give yet, if
    /// anything (attached mode refuses it; `auto` stays embedded).
    fn agent_refusal(&self) -> Option<&'static str> {
        let not_a_space = |(what, _): &(String, Weight)| {
            !Path::new(what)
                .join(crate::dataset::space::files::MANIFEST)
                .is_file()
        };
        if self.mix.iter().any(not_a_space) {
            Some("a mixture of spaces (a catalog or a source in a mixture is read embedded)")
        } else if self.mix.len() > crate::agent::msg::MAX_ATTACH_DATASETS {
            Some("a mixture of at most 1,024 datasets")
        } else if self.space.is_none() && self.mix.is_empty() {
            Some("a space (the agent reads its node's space, not a source)")
        } else if self.tier_bytes > 0 {
            Some("no memory tier of its own (the node's memory is the agent's: `kspeed agent --tier-bytes`)")
        } else if self.cache_dir.is_some() || self.cache_memory_bytes > 0 {
            Some("no cache area of its own, on disk or in memory (cache_dir, cache_memory_bytes: the agent keeps the node's, or one per rank: `kspeed agent --cache-dir`)")
        } else if self.gpu_ring.is_some() {
            Some("a host ring (GPU rings through the agent are not built yet)")
        } else if self.faults.is_some() {
            Some("no fault injection")
        } else {
            None
        }
    }

    /// `agent = auto` in cluster mode: whether the agent at `socket` can
    /// serve this loader. It can when one listens there (the socket
    /// exists) and the loader needs nothing it lacks; whether it holds the
    /// dataset and knows the cluster is its to say (a refusal falls back
    /// to this process's own pollers with a WARN). A "no" here is logged
    /// at info with its reason.
    fn agent_serves(&self, socket: &Path) -> bool {
        if !socket.exists() {
            return false;
        }
        match self.agent_refusal() {
            None => true,
            Some(why) => {
                log::info!(
                    "agent = auto: not attaching to the node agent at {}: it needs {why}; reading with this process's own pollers",
                    socket.display()
                );
                false
            }
        }
    }

    /// The build, attached to the agent at `attach` or embedded.
    /// The cache area, if one is asked for and this loader reads from a
    /// source (refused by name where it would have nothing to keep or is
    /// not supported yet).
    fn open_cache(
        &self,
        input: &Input,
        sampler: &Sampler,
        attached: bool,
    ) -> Result<Option<super::cache_run::CacheSetup>> {
        // Inside the node agent, the node's area and planner, shared by
        // the node's ranks (`kspeed agent --cache-scope node`).
        if let Some(lease) = self.agent_input.as_ref().and_then(|a| a.node_cache.clone()) {
            return Ok(Some(super::cache_run::CacheSetup {
                area: lease.area,
                planning: super::cache_run::Planning::Node {
                    plan: lease.plan,
                    lane: lease.lane,
                },
                hits: Default::default(),
            }));
        }
        let Some(dir) = &self.cache_dir else {
            if self.cache_bytes > 0 {
                return Err(Error::InvalidConfig(
                    "cache_bytes is set but cache_dir is not".into(),
                ));
            }
            return Ok(None);
        };
        let refuse = |why: &str| Err(Error::InvalidConfig(format!("cache_dir: {why}")));
        if self.cache_bytes == 0 {
            return refuse("cache_bytes must be set too (the area's budget)");
        }
        // In memory, the area keeps the space's samples too
        // (`Shared::cache_plans`): memory is faster than the NVMe.
        let in_memory = crate::cache::is_memory_dir(dir);
        match input {
            Input::Mix(_) => return refuse("a mixture of datasets has no cache area yet"),
            Input::Space { space, .. } if !space.params().is_partial() && !in_memory => {
                return refuse(if self.cache_memory_bytes > 0 {
                    "this space holds every sample, so nothing comes from the source for an \
                     area on disk to keep; for a memory level alone, set cache_dir=\":memory:\" \
                     and give cache_bytes the memory budget (no cache_memory_bytes)"
                } else {
                    "this space holds every sample, so nothing comes from the source to keep \
                     (an area in memory, \":memory:\", keeps the space's samples too)"
                })
            }
            _ => {}
        }
        if self.cluster.is_some() && !matches!(input, Input::Space { .. }) {
            // Every sample then comes from the nodes: nothing from the
            // source to keep.
            return refuse(
                "in cluster mode a cache area keeps the samples no node's partial space holds; \
                 give the rank its node's space (space=), not a source",
            );
        }
        if attached {
            return refuse("a rank attached to the node agent has no cache area of its own");
        }
        // In memory, the area is this loader's alone: no folder per rank.
        let rank_dir = if in_memory {
            dir.clone()
        } else {
            dir.join(format!("rank{}", self.rank))
        };
        let area = crate::cache::CacheArea::open(&crate::cache::AreaSpec {
            dir: &rank_dir,
            catalog: input.catalog(),
            cache_bytes: self.cache_bytes,
            budget_setting: "cache_bytes",
        })?;
        let next = match self.cache_policy {
            crate::cache::CachePolicy::NextUse | crate::cache::CachePolicy::Min => {
                Some(crate::sampler::NextUse::new(
                    sampler,
                    Some(self.rank..self.rank + 1),
                    self.end_epoch,
                )?)
            }
            crate::cache::CachePolicy::Lru => None,
        };
        log::info!(
            "cache area {}: {} slots in {} size classes, {} bytes, {} held, policy {}{}",
            area.dir().display(),
            area.slots(),
            area.classes().classes().len(),
            area.classes().area_bytes(),
            area.held().len(),
            self.cache_policy.name(),
            if area.direct() || in_memory {
                ""
            } else {
                " (no O_DIRECT on this file system)"
            }
        );
        Ok(Some(super::cache_run::CacheSetup {
            area: Arc::new(area),
            planning: super::cache_run::Planning::Own {
                policy: self.cache_policy,
                next,
                rank: self.rank as u64,
                world: self.world as u64,
            },
            hits: Default::default(),
        }))
    }

    /// The memory level above the cache area (`cache_memory_bytes`), with
    /// the area's policy and its own planner along the same order; the
    /// area (`below`, opened by [`open_cache`](Self::open_cache)) checked
    /// the rest.
    fn open_cache_memory(
        &self,
        input: &Input,
        below: Option<&super::cache_run::CacheSetup>,
    ) -> Result<Option<super::cache_run::CacheSetup>> {
        if self.cache_memory_bytes == 0 {
            return Ok(None);
        }
        let refuse = |why: &str| {
            Err(Error::InvalidConfig(format!(
                "cache_memory_bytes ({} bytes): {why}",
                self.cache_memory_bytes
            )))
        };
        let below =
            match (below, &self.cache_dir) {
                (Some(b), Some(dir)) if !crate::cache::is_memory_dir(dir) => b,
                (_, Some(_)) if self.agent_input.is_some() => {
                    return refuse("the node agent's ranks have no memory level above its area yet")
                }
                (_, Some(_)) => return refuse(
                    "the memory level goes above a cache area on disk (cache_dir a folder), and \
                 cache_dir is \":memory:\" already (one area in memory: give it all of the \
                 budget, cache_bytes)",
                ),
                (_, None) => return refuse(
                    "the memory level goes above a cache area on disk: set cache_dir to a folder \
                     (or, for an area in memory alone, cache_dir=\":memory:\" and cache_bytes)",
                ),
            };
        let area = crate::cache::CacheArea::open(&crate::cache::AreaSpec {
            dir: std::path::Path::new(crate::cache::MEMORY_DIR),
            catalog: input.catalog(),
            cache_bytes: self.cache_memory_bytes,
            budget_setting: "cache_memory_bytes",
        })?;
        if self.cache_memory_bytes >= self.cache_bytes {
            log::warn!(
                "cache_memory_bytes ({}) is not below cache_bytes ({}): within a run the area \
                 on disk gives no hit the memory level above it would not (it keeps what it \
                 planned for the next run, whose memory level starts empty)",
                self.cache_memory_bytes,
                self.cache_bytes
            );
        }
        log::info!(
            "cache area in memory above {}: {} slots in {} size classes, {} bytes, policy {}",
            below.area.dir().display(),
            area.slots(),
            area.classes().classes().len(),
            area.classes().area_bytes(),
            self.cache_policy.name(),
        );
        if matches!(below.planning, super::cache_run::Planning::Node { .. }) {
            return refuse("the node agent's ranks have no memory level above its area yet");
        }
        // The same policy and order as the area's, a planner of its own.
        let planning = below.planning.clone();
        Ok(Some(super::cache_run::CacheSetup {
            area: Arc::new(area),
            planning,
            hits: Default::default(),
        }))
    }

    fn build_with(self, attach: Option<PathBuf>) -> Result<Loader> {
        if attach.is_some() {
            if let Some(why) = self.agent_refusal() {
                return Err(Error::InvalidConfig(format!(
                    "reading through the node agent (agent = required) needs {why}"
                )));
            }
        }
        // Every extent stays open (registered with io_uring): lift the
        // open-files soft limit to the hard one first, as servers do.
        crate::sys::raise_open_files_limit();
        // Ranges are checked here, before anything touches the kernel, so
        // the message names the setting instead of an errno from io_uring.
        for (what, n, max, why) in [
            (
                "pollers",
                self.pollers.unwrap_or(1) as u64,
                MAX_POLLERS,
                "threads",
            ),
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
        let local = match (self.local_rank, self.local_world) {
            (Some(r), Some(w)) => crate::placement::LocalRank::explicit(r, w)?,
            (None, None) => crate::placement::LocalRank::from_env()?,
            (r, _) => {
                return Err(Error::BadPlacement {
                    origin: "local rank option".into(),
                    reason: if r.is_some() {
                        "local_rank given without local_world_size".into()
                    } else {
                        "local_world_size given without local_rank".into()
                    },
                })
            }
        };
        let topology = crate::placement::Topology::read(
            &self
                .sysfs_root
                .clone()
                .unwrap_or_else(crate::placement::sysfs_root),
        )?;
        if (1..4096).contains(&self.landing.ring_bytes) {
            return Err(Error::InvalidConfig(format!(
                "ring_bytes must be at least 4096 (or 0: sized from the batch), not {}",
                self.landing.ring_bytes
            )));
        }
        let mut space_io = super::page_cache::SpaceIo {
            mode: self.page_cache,
            direct_io: self.space.is_some() || !self.mix.is_empty(),
            why: None,
        };
        let (input, align) = if let Some(a) = self.agent_input.clone() {
            space_io.direct_io = a.direct_io;
            if a.mix_parts.is_empty() {
                let align = a.space.params().align_bytes as u64;
                (
                    Input::Space {
                        space: a.space,
                        extents: a.extents,
                    },
                    align,
                )
            } else {
                let align = a
                    .mix_parts
                    .iter()
                    .map(|(sp, _)| sp.params().align_bytes as u64)
                    .fold(4096, u64::max);
                let parts = a
                    .mix_parts
                    .into_iter()
                    .map(|(space, extents)| Input::Space { space, extents })
                    .collect();
                (input::assemble_mix(parts)?, align)
            }
        } else if let (false, true) = (self.mix.is_empty(), attach.is_some()) {
            // Attached to an agent serving a mixture's spaces: their
            // catalogs for the schedule and the labels (the agent checked
            // the extents and reads them).
            let mut align = 4096u64;
            let parts = self
                .mix
                .iter()
                .map(|(dir, _)| {
                    let space = Space::open(Path::new(dir))?;
                    align = align.max(space.params().align_bytes as u64);
                    Ok(Input::Space {
                        space: Arc::new(space),
                        extents: Arc::new([]),
                    })
                })
                .collect::<Result<Vec<_>>>()?;
            (input::assemble_mix(parts)?, align)
        } else if let (Some(dir), true) = (&self.space, attach.is_some()) {
            // Attached: the catalog for the schedule and the labels; the
            // agent checked the extents and reads them.
            let space = Space::open(dir)?;
            let align = space.params().align_bytes as u64;
            (
                Input::Space {
                    space: Arc::new(space),
                    extents: Arc::new([]),
                },
                align,
            )
        } else if self.mix.is_empty() {
            input::open_input(
                self.space.as_ref(),
                self.source.as_ref(),
                self.catalog.as_ref(),
                self.cluster.is_some(),
                &mut space_io,
            )?
        } else {
            input::open_mix(&self.mix, self.cluster.is_some(), &mut space_io)?
        };
        let direct_io = space_io.direct_io;
        let sampler_cfg = SamplerConfig {
            len: input.len(),
            seed: self.seed,
            shuffle: self.shuffle,
            rank: self.rank,
            world: self.world,
            drop_last: self.drop_last,
            shuffle_block: self.shuffle_block,
        };
        let sampler = match &input {
            Input::Mix(_) if sampler_cfg.order_block() > 0 => {
                return Err(Error::InvalidConfig(
                    "shuffle_block: a mixture shuffles each dataset whole; block shuffles are for one dataset"
                        .into(),
                ))
            }
            Input::Mix(m) => {
                let lens: Vec<u64> = m.parts.iter().map(|p| p.len()).collect();
                let weights: Vec<Weight> = self.mix.iter().map(|(_, w)| *w).collect();
                let counts = epoch_counts(&weights, &lens, self.mix_epoch_size)?;
                let m = MixSampler::new(sampler_cfg, &lens, &counts)?;
                match &self.mix_start {
                    Some(start) => Sampler::mixed(m.resume(start)?)?,
                    None => Sampler::mixed(m)?,
                }
            }
            _ => Sampler::new(sampler_cfg)?,
        };
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
                sampler.config().len,
                self.rank,
                self.world,
                self.batch_size
            )));
        }
        let mut landing = self.landing.clone();
        let ring_auto = landing.ring_bytes == 0;
        if ring_auto {
            landing.ring_bytes = ring_size::auto_ring_bytes(
                &input,
                &sampler,
                align,
                self.batch_size,
                self.cluster.is_some(),
            );
        }
        landing.ring_bytes = landing.ring_bytes.next_multiple_of(align.max(4096));
        let geo = Geometry {
            ring_bytes: landing.ring_bytes,
            align,
        };
        // A sample that cannot fit is an error now, not a hang later.
        let max_slot = geo.slot(input.max_sample_bytes() as u64);
        if max_slot > geo.segment() {
            let id = (0..input.len())
                .find(|&i| geo.slot(input.sample(i).len as u64) > geo.segment())
                .expect("the largest sample exists");
            // The message names this sample: give its own size and slot
            // (not the largest sample's).
            let len = input.sample(id).len as u64;
            return Err(Error::SampleLargerThanRing {
                sample: id,
                len,
                slot: geo.slot(len),
                ring_bytes: geo.ring_bytes,
            });
        }
        ring_size::check_batch_fits(&input, &sampler, geo, self.batch_size)?;
        let ring = match self.gpu_ring {
            None if self.agent_input.is_some() => {
                let a = self.agent_input.as_ref().expect("checked");
                let map = a
                    .ring
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .take()
                    .ok_or_else(|| Error::InvalidConfig("the rank's ring was taken".into()))?;
                if map.len() != landing.ring_bytes {
                    return Err(Error::InvalidConfig(format!(
                        "the rank's ring is {} bytes; its geometry needs {} (a multiple of the \
                         space's {align}-byte alignment)",
                        map.len(),
                        landing.ring_bytes
                    )));
                }
                LandingRing::shared(map)
            }
            // Attached: each launch maps a fresh ring and attaches it; this
            // one page only stands in until the first launch.
            None if attach.is_some() => {
                LandingRing::shared(crate::agent::shm::RingMap::create(4096)?)
            }
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
        let tier = match &input {
            // The agent's node tier, one for all the ranks it serves.
            _ if self.agent_input.as_ref().is_some_and(|a| a.tier.is_some()) => {
                self.agent_input.as_ref().and_then(|a| a.tier.clone())
            }
            _ if self.tier_bytes == 0 => None,
            // A rank of several, or a mixture: the samples it reads most in
            // the coming epochs (tier.rs); in cluster mode, among equals,
            // those other nodes hold. A mixture's tier holds ids of its
            // datasets side by side.
            _ => {
                let from = self.start.map_or(0, |p| p.epoch);
                let remote = |id| match input.part(id) {
                    (_, Input::Space { space, .. }, local) if self.cluster.is_some() => {
                        space.location(local).is_none()
                    }
                    _ => false,
                };
                let (budget, mlock) = (self.tier_bytes, landing.mlock);
                let me = self.rank..self.rank + 1;
                match super::tier::future_reads(&sampler, me, from, self.end_epoch) {
                    Some(reads) => Tier::by_reads(&input, budget, mlock, &reads, Some(&remote))?,
                    None if self.cluster.is_some() => {
                        Tier::preferring(&input, budget, mlock, false, &remote)?
                    }
                    // One dataset (a mixture is always counted).
                    None => Tier::new(input.catalog(), budget, mlock)?,
                }
                .map(Arc::new)
            }
        };
        if let Some(t) = tier.as_ref().filter(|_| self.agent_input.is_none()) {
            log::info!(
                "memory tier: {} samples, {} bytes",
                t.members(),
                t.member_bytes()
            );
        }
        let cache = self.open_cache(&input, &sampler, attach.is_some())?;
        let cache_memory = self.open_cache_memory(&input, cache.as_ref())?;
        let mask = crate::placement::affinity();
        let plan = crate::placement::plan(
            &topology,
            &mask,
            self.poller_numa_node.or(ring.info().numa_node),
            &local,
        );
        for w in &plan.warnings {
            log::warn!("poller placement: {w}");
        }
        // A whole space read through the page cache (`page_cache` found it
        // cached, or on) is copied by the pollers, not waited for: twice
        // the pollers (BENCHMARKS.md, "Warm reads: the pollers copy"). Not
        // a partial space (each poller also keeps its GETs in flight to
        // the source) nor a mixture (its inputs may be sources nobody
        // found cached).
        let page_cache_reads = !direct_io
            && matches!(&input, Input::Space { space, .. } if !space.params().is_partial());
        let pollers = if attach.is_some() {
            0 // the agent's pollers read for this rank
        } else {
            self.pollers.unwrap_or_else(|| {
                if page_cache_reads {
                    plan.copying_pollers(mask.len())
                } else {
                    plan.default_pollers(mask.len())
                }
            })
        };
        let spin = self.spin.unwrap_or_else(|| {
            if plan.shared {
                // Spinning on a core other ranks' pollers share takes it
                // from them.
                Duration::ZERO
            } else {
                default_spin()
            }
        });
        if self.tier_views && tier.is_none() && attach.is_none() && self.agent_input.is_none() {
            // Not refused: the same settings attached to an agent with a
            // node tier do hand out views (`agent = auto` may attach).
            log::warn!(
                "tier_views: this loader has no memory tier (tier_bytes is 0), so there is \
                 nothing to hand out in place; every sample comes in the ring"
            );
        }
        let cfg = PollerConfig {
            pollers,
            queue_depth: self.queue_depth,
            submit_batch: self.submit_batch,
            max_read_bytes: self.max_read_bytes,
            lookahead: self.lookahead.max(self.batch_size as u64),
            spin,
            sqpoll_idle_ms: self.sqpoll_idle_ms,
            verify_crc32c: self.verify_crc32c,
            faults: self.faults,
            tier_views: self.tier_views && tier.is_some(),
        };
        // Ordinary epochs, or (inside the agent) the rest of an epoch a
        // rank's world resumed from a job position, then ordinary ones.
        let deal = Deal::new(
            ElasticSampler::over(
                sampler.clone(),
                self.job_deal.unwrap_or(JobPosition {
                    epoch: 0,
                    consumed: 0,
                }),
            )?,
            if self.drop_last {
                self.batch_size as u64
            } else {
                1
            },
        );
        let start = match self.start {
            Some(p) if p.index > deal.steps(p.epoch) => {
                return Err(Error::BadPosition(format!(
                    "step {} is past the epoch's {} steps",
                    p.index,
                    deal.steps(p.epoch)
                )))
            }
            Some(p) => p,
            None => Position { epoch: 0, index: 0 },
        };
        let links_only = self.agent_input.as_ref().is_some_and(|a| a.links_only);
        if let Some(end) = self
            .end_epoch
            .filter(|&end| start.epoch >= end && !links_only)
        {
            return Err(Error::InvalidConfig(format!(
                "end_epoch {end} is not after the start epoch {}: there is nothing to read",
                start.epoch
            )));
        }
        let digest_at = deal.sampler().rank_position(start);
        let net = match self.cluster.clone() {
            None => None,
            Some(cluster) => {
                let (placement, space_node) = input::cluster_placement(&input, &self.mix)?;
                let partial = match &input {
                    Input::Space { space, .. } if space.params().is_partial() => {
                        let p = space.params();
                        Some(Arc::new(crate::dataset::PartialHolders::new(
                            space.catalog(),
                            p.placement,
                            p.align_bytes,
                            p.max_held_bytes,
                        )))
                    }
                    _ => None,
                };
                Some(net::NetSetup {
                    cluster,
                    token: self.token.clone(),
                    node_timeout: self.node_timeout,
                    connect_timeout: self.node_timeout.min(Duration::from_secs(5)),
                    hello: crate::transport::proto::Hello {
                        // A mixture's: the nodes serve its spaces side by
                        // side (`kspeed serve --space A --space B`).
                        catalog_identity: input.identity(),
                        rank: self.rank,
                        world: self.world,
                        catalog_samples: input.len(),
                        seed: self.seed,
                        ring_addr: 0,
                        ring_len: ring.len() as u64,
                        rkey: 0,
                        transport: crate::transport::proto::TRANSPORT_TCP,
                    },
                    placement,
                    local_node: self.local_node.unwrap_or(space_node),
                    rdma: self.rdma.clone(),
                    partial,
                    notices: self
                        .agent_input
                        .as_ref()
                        .and_then(|a| a.node_notices.clone()),
                })
            }
        };
        // A source in an object store is read by GETs (ring/store.rs), one
        // backend per poller with `queue_depth` of them in flight.
        let remote = match &input {
            Input::Source { catalog, .. } if catalog.source_spec().is_remote() => {
                Some(catalog.clone())
            }
            _ => None,
        };
        let mut backends: Vec<Uring> = Vec::with_capacity(cfg.pollers);
        // The pollers register the ring once they have written it all
        // (registration.rs), so building costs no faults of the whole ring.
        // Attached: the agent reads (and registers); this process has no
        // pollers.
        let fixed_buffers = self.registered_buffers
            && ring.device().is_none()
            && remote.is_none()
            && attach.is_none()
            && cfg.pollers > 0;
        let mut io_how = if ring.device().is_some() {
            "GPU memory: written by the NIC only".to_string()
        } else if !self.registered_buffers {
            "not registered (registered_buffers off)".to_string()
        } else {
            String::new()
        };
        // A bucket is read by GETs alone, unless a cache area's slots are
        // read too (ring/split.rs pairs the two).
        for _ in 0..if remote.is_some() && cache.is_none() {
            0
        } else {
            cfg.pollers
        } {
            let opts = UringOptions {
                entries: cfg.queue_depth * 2,
                sqpoll_idle_ms: cfg.sqpoll_idle_ms,
            };
            // A poller enters the kernel every tick, so completions need not
            // interrupt it (COOP_TASKRUN), when asked for.
            let uring = if self.coop_taskrun {
                Uring::new_cooperative(opts)?
            } else {
                Uring::new(opts)?
            };
            if self.registered_files {
                // A mixture's spaces' extents, in the order of its parts
                // (MixInput::extent_base).
                let parts = match &input {
                    Input::Mix(m) => m.parts.iter().collect(),
                    input => vec![input],
                };
                let fds: Vec<i32> = parts
                    .iter()
                    .filter_map(|p| match p {
                        Input::Space { extents, .. } => Some(extents.iter()),
                        _ => None,
                    })
                    .flatten()
                    .map(|f| f.as_raw_fd())
                    .collect();
                if !fds.is_empty() {
                    uring.register_files(&fds)?;
                }
            }
            backends.push(uring);
        }
        if !direct_io && matches!(input, Input::Space { .. } | Input::Mix(_)) {
            match &space_io.why {
                Some(why) => io_how.push_str(&format!("; page cache (no O_DIRECT: {why})")),
                None => io_how.push_str("; page cache (no O_DIRECT)"),
            }
        }
        let mut ring = ring;
        if remote.is_some() {
            io_how = format!(
                "object store: {} reads in flight per poller into the ring",
                cfg.queue_depth
            );
        }
        ring.set_io_info(io_how, direct_io);
        let registration = Arc::new(super::registration::RingRegistration::new(
            fixed_buffers,
            cfg.pollers,
        ));
        // A partial space over a bucket: what the space holds from the
        // NVMe, the rest by GETs, one loop per poller (ring/split.rs).
        let partial_bucket = match &input {
            Input::Space { space, .. }
                if space.params().is_partial() && space.catalog().source_spec().is_remote() =>
            {
                Some(space.clone())
            }
            _ => None,
        };
        // Neighbouring samples of one object merge into one GET where the
        // order visits them together: several samples per object (tar
        // shards) read in id order or with a block shuffle.
        let merge = |cat: &crate::dataset::Catalog| {
            cat.len() > cat.file_count() && (!self.shuffle || sampler.config().order_block() > 0)
        };
        let merge = match (&remote, &partial_bucket) {
            (Some(cat), _) => merge(cat),
            (None, Some(space)) => merge(space.catalog()),
            (None, None) => false,
        };
        let backends = poller_backends(backends, remote, partial_bucket, &cfg, merge)?
            .into_iter()
            .map(super::registration::PollerIo::new)
            .collect();
        let batch_size = self.batch_size;
        let attach_numa_node = match attach {
            Some(_) => self.landing.bind_node()?,
            None => None,
        };
        // A view word per sample of a batch: at most 65,536 (larger
        // batches take every sample in the ring).
        let max_views = crate::agent::segment::MAX_VIEWS_PER_SLOT;
        let attach_views =
            self.tier_views && attach.is_some() && batch_size as u64 <= u64::from(max_views);
        if self.tier_views && attach.is_some() && !attach_views {
            log::warn!(
                "tier_views: batches of {batch_size} samples are over the {max_views} an attach can name; every sample comes in the ring"
            );
        }
        let attach_settings = attach.map(|socket| super::attached::AttachSettings {
            socket,
            dataset_id: u64::from(input.identity()),
            seed: self.seed,
            rank: self.rank,
            world: self.world,
            batch_size: batch_size as u32,
            shuffle: self.shuffle,
            shuffle_block: self.shuffle_block,
            drop_last: self.drop_last,
            verify_crc32c: self.verify_crc32c,
            tier_views: attach_views,
            // The nodes the agent waited for, with each batch (falls back
            // to none with an agent from before).
            peer_waits: true,
            // And the extra words (likewise).
            slot_extras: true,
            numa_node: attach_numa_node,
            slots: super::attached::slots_for(geo.table_len(), batch_size),
            end_epoch: self.end_epoch,
            restart_wait: self.agent_restart_wait,
            // Known when a launcher or the options said, and only a hint:
            // not sent when it cannot describe this rank's place (a
            // data-parallel rank of a smaller world than the launcher's,
            // under tensor parallelism), nor for a node of more than
            // 65,535 ranks.
            local: (local.origin != crate::launcher::NO_LAUNCHER
                && local.rank <= self.rank
                && local.size <= self.world)
                .then(|| {
                    Some((
                        u16::try_from(local.rank).ok()?,
                        u16::try_from(local.size).ok()?,
                    ))
                })
                .flatten(),
        });
        // Attached: the agent reads every sample; this process connects
        // to no node.
        let net = if attach_settings.is_some() { None } else { net };
        // Every sample read from this node's disk, one way: the consumer
        // may sleep until a batch's last sample instead of each one (the
        // stall is charged to the same path either way).
        let wake_per_batch = net.is_none()
            && tier.is_none()
            && matches!(input, Input::Space { .. })
            && input.held_samples() == input.len();
        // A local loader's pollers wait for the first batch (Loader's
        // `asked`); a cluster, agent or attached run reads at once (its
        // connections, grants and the agent's feeder start with it).
        let asked = net.is_some() || attach_settings.is_some() || self.agent_input.is_some();
        let mut loader = Loader {
            run: None,
            node_pollers: self
                .agent_input
                .as_ref()
                .and_then(|a| a.node_pollers.clone()),
            asked,
            spare: Some(Spare {
                input,
                ring,
                tier,
                backends,
            }),
            geo,
            deal,
            cfg,
            registration,
            fixed_files: self.registered_files,
            batch_size,
            steps,
            digest: EpochDigest::new(start.epoch),
            digest_at,
            digest_skip: None,
            epoch: start.epoch,
            end_epoch: self.end_epoch,
            cursor: None,
            peeked: None,
            entries: Vec::with_capacity(batch_size),
            held: false,
            batch_seq: 0,
            kept: std::collections::VecDeque::new(),
            held_first: None,
            run_no: 0,
            retired: Vec::new(),
            attach_tier: None,
            failed: None,
            counters: Counters::default(),
            stall_ledger: super::stall_causes::StallLedger::with_totals(
                self.agent_input
                    .as_ref()
                    .and_then(|a| a.stall_totals.clone()),
            ),
            source_lead: Default::default(),
            totals: Totals::new(),
            started: Instant::now(),
            net: net.map(Arc::new),
            net_hub: self.agent_input.as_ref().and_then(|a| a.net_hub.clone()),
            net_hub_slot: self.agent_input.as_ref().and_then(|a| a.net_hub_slot),
            placement: crate::placement::PollerPlacement {
                pin: self.pin,
                pollers,
                pinned: vec![None; pollers],
                plan,
            },
            attach_settings,
            wake_per_batch,
            batch_last_g: 0,
            cache,
            cache_memory,
        };
        loader.launch(start)?;
        // The agent's own lane (agent/cluster.rs) reads nothing: its
        // settings would only mislead in the agent's log.
        let level = if links_only {
            log::Level::Debug
        } else {
            log::Level::Info
        };
        // Inside the agent the placement is the node's (`--node-pollers`),
        // not this loader's local rank, which the agent sets to 0 of 1.
        let placement_level = if self.agent_input.is_some() {
            log::Level::Debug
        } else {
            level
        };
        log::log!(
            placement_level,
            "poller placement: {}",
            loader.placement.describe()
        );
        log::log!(
            level,
            "loader: {} samples per epoch for rank {} of {}, batch {}, ring {} bytes{}, {} pollers{}",
            loader.steps,
            self.rank,
            self.world,
            batch_size,
            loader.geo.ring_bytes,
            if ring_auto {
                " (auto: sized from the batch)"
            } else {
                ""
            },
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

/// `backend`, wrapped in the fault injector when one is asked for.
fn faulty<B: IoBackend + 'static>(
    backend: B,
    cfg: &super::shared::PollerConfig,
) -> Box<dyn IoBackend> {
    match cfg.faults {
        Some(f) => Box::new(Faulty::new(backend, f, cfg.queue_depth as usize)),
        None => Box::new(backend),
    }
}

/// The pollers' backends: `urings` (a space, a source on files); one
/// object-store backend per poller for a source in a bucket (`remote`:
/// ring/store.rs, `queue_depth` GETs in flight); for a partial space over a
/// bucket (`partial_bucket`), or a bucket with a cache area (`urings` not
/// empty), each io_uring paired with one (ring/split.rs). With `merge`, neighbouring reads of an object share a
/// GET.
#[cfg(feature = "s3")]
fn poller_backends(
    urings: Vec<Uring>,
    remote: Option<std::sync::Arc<crate::dataset::Catalog>>,
    partial_bucket: Option<std::sync::Arc<crate::dataset::Space>>,
    cfg: &super::shared::PollerConfig,
    merge: bool,
) -> Result<Vec<Box<dyn IoBackend>>> {
    use crate::ring::{Split, StoreRing};
    let depth = cfg.queue_depth as usize;
    Ok(match (remote, partial_bucket) {
        // A bucket with a cache area: its slots through the io_uring.
        (Some(cat), _) if !urings.is_empty() => urings
            .into_iter()
            .zip(store_backends(cat, cfg.pollers, depth, merge)?)
            .map(|(uring, store): (Uring, StoreRing)| faulty(Split::new(uring, store), cfg))
            .collect(),
        (Some(cat), _) => store_backends(cat, cfg.pollers, depth, merge)?
            .into_iter()
            .map(|store| faulty(store, cfg))
            .collect(),
        (None, Some(space)) => urings
            .into_iter()
            .zip(store_backends(space, cfg.pollers, depth, merge)?)
            .map(|(uring, store): (Uring, StoreRing)| faulty(Split::new(uring, store), cfg))
            .collect(),
        (None, None) => urings.into_iter().map(|uring| faulty(uring, cfg)).collect(),
    })
}

/// Without the s3 feature no source is remote (parsing refuses `s3://`).
#[cfg(not(feature = "s3"))]
fn poller_backends(
    urings: Vec<Uring>,
    _: Option<std::sync::Arc<crate::dataset::Catalog>>,
    _: Option<std::sync::Arc<crate::dataset::Space>>,
    cfg: &super::shared::PollerConfig,
    _: bool,
) -> Result<Vec<Box<dyn IoBackend>>> {
    Ok(urings.into_iter().map(|uring| faulty(uring, cfg)).collect())
}

/// One object-store backend per poller reading the bucket that `cat`'s
/// source is in (`ring/store.rs`), `depth` reads in flight each.
#[cfg(feature = "s3")]
fn store_backends<C: AsRef<crate::dataset::Catalog> + Send + Sync + 'static>(
    cat: std::sync::Arc<C>,
    pollers: usize,
    depth: usize,
    merge: bool,
) -> Result<Vec<crate::ring::StoreRing>> {
    let spec = (*cat).as_ref().source_spec();
    let url = spec.store_url().expect("a remote source has a URL");
    let prefix = url.dir_prefix_or_parent();
    let objects: std::sync::Arc<crate::ring::ObjectOf> = std::sync::Arc::new(move |i: u32| {
        let f = (*cat).as_ref().file(i);
        (
            format!("{prefix}{}", f.name.to_string_lossy()),
            String::from_utf8_lossy(f.etag).into_owned(),
        )
    });
    (0..pollers)
        .map(|_| crate::ring::StoreRing::new(&url.bucket, objects.clone(), depth, merge))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dataset::{Placement, PreloadOptions, SourceSpec};
    use crate::sampler::Weight;

    /// `agent = auto` in cluster mode attaches only where the agent can
    /// serve the loader: a socket there and nothing the agent lacks; a
    /// node holding part of the space attaches too (the agent reads the
    /// rest from the other nodes).
    #[test]
    fn auto_attaches_only_where_the_agent_can_serve() {
        let t = tempfile::tempdir().unwrap();
        let src = t.path().join("src");
        std::fs::create_dir_all(&src).unwrap();
        for i in 0..16u64 {
            std::fs::write(
                src.join(format!("f{i:02}.bin")),
                vec![i as u8; 100 + i as usize],
            )
            .unwrap();
        }
        let spec = SourceSpec::parse(&format!("dir:{}", src.display())).unwrap();
        let space = |nodes: u32| {
            let dir = t.path().join(format!("space-of-{nodes}"));
            let opts = PreloadOptions::default()
                .source(Some(spec.clone()))
                .placement(Placement::new(nodes, 1).unwrap())
                .node_index(0)
                .threads(1)
                .check_free_space(false);
            crate::dataset::preload(&dir, &opts).unwrap();
            dir
        };
        let (whole, part) = (space(1), space(2));
        let socket = t.path().join("agent.sock");
        let cluster =
            crate::transport::Cluster::from_addrs(&["127.0.0.1:1", "127.0.0.1:2"], "test").unwrap();
        let b = |dir: &Path| LoaderBuilder::space(dir).cluster(cluster.clone());
        // No socket: embedded.
        assert!(!b(&whole).agent_serves(&socket));
        std::fs::write(&socket, b"").unwrap();
        assert!(b(&whole).agent_serves(&socket));
        // Part of the space here: the agent reads the rest from the other
        // nodes.
        assert!(b(&part).agent_serves(&socket));
        // Something the agent lacks.
        assert!(!b(&whole).tier_bytes(1 << 20).agent_serves(&socket));
        // A cache area of its own: the agent keeps the node's instead.
        let cached = b(&whole)
            .cache_dir(Some(t.path().join("c")))
            .cache_bytes(1 << 20);
        assert!(!cached.agent_serves(&socket));
        assert!(cached.agent_refusal().unwrap().contains("--cache-dir"));
        // A mixture of spaces: served (by an agent serving those spaces,
        // `kspeed agent --space A --space B`); with a catalog: not.
        let mix = LoaderBuilder::mix([
            (whole.to_str().unwrap(), Weight::Repeat(1.0)),
            (part.to_str().unwrap(), Weight::Repeat(1.0)),
        ])
        .cluster(cluster.clone());
        assert!(mix.agent_serves(&socket));
        let catalog = whole.join(crate::dataset::space::files::CATALOG);
        let with_catalog = LoaderBuilder::mix([
            (whole.to_str().unwrap(), Weight::Repeat(1.0)),
            (catalog.to_str().unwrap(), Weight::Repeat(1.0)),
        ])
        .cluster(cluster.clone());
        assert!(!with_catalog.agent_serves(&socket));
        assert!(with_catalog
            .agent_refusal()
            .unwrap()
            .contains("a mixture of spaces"));
    }
}
