//! `kspeed agent`: the node's one kspeed process (issue 28, docs/AGENT.md).
//! It opens and checks the space once, binds the attach socket and serves
//! every rank that attaches: per rank a loader's producer half (its pollers, io_uring,
//! schedule) reading into the rank's own ring, and a feeder thread that
//! takes the loader's batches and publishes them through the rank's
//! attach segment, honouring the rank's release marks. In a cluster
//! ([`AgentConfig::cluster`], `super::cluster`) each rank's loader reads
//! what this node does not hold from the other nodes, and the agent also
//! runs this node's node service for them ([`AgentConfig::serve`]).
//!
//! Why this file is over ~800 lines: it is the agent's one lifecycle, from
//! opening the space (or a mixture's spaces) to the last rank's end
//! (config, the main loop, a rank's loader built from its ATTACH, its
//! feeder); the attach socket, the messages, the segment, the node tier
//! and the cluster are their own files.
//!
//! Threads: the main loop (accepts, beats every rank's heartbeat, reaps
//! ranks that ended); the node's poller threads ([`AgentConfig::node_pollers`]),
//! which take turns for every rank's `pollers` pollers; per rank one
//! feeder.
//!
//! A rank is judged by its socket (the kernel's hang-up when it dies) and
//! its segment's state word (a clean detach), never by its heartbeat: a
//! rank in a long training step does not call into the loader.

use std::fs::File;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::attach::{AttachListener, Attached, Incoming, ListenerConfig};
use super::cluster::{AgentCluster, KeptLinks};
use super::metrics::AgentMetrics;
use super::msg::{RefuseCode, FLAG_DROP_LAST, FLAG_SHUFFLE, FLAG_TIER_VIEWS, FLAG_VERIFY_CRC32C};
use super::node_cache::NodeCache;
use super::node_tier::{NodeSamples, NodeTier, TierLayout};
use super::segment::{side_state, Liveness, Segment, Side};
use super::shm::RingMap;
use crate::dataset::Space;
use crate::error::{Error, Result};
use crate::landing::{CudaMode, LandingOptions};
use crate::loader::node_pollers::NodePollers;
use crate::loader::stall_totals::StallTotals;
use crate::loader::{Loader, LoaderBuilder, Tier};
use crate::sampler::{Position, Weight};

/// How the agent runs.
#[derive(Debug, Clone)]
pub struct AgentConfig {
    /// The node's space.
    pub space: PathBuf,
    /// Further spaces served after `space`, side by side in one id space:
    /// the agent then serves ranks reading a mixture of exactly these
    /// spaces in this order (`kspeed agent --space A --space B`; any
    /// weights), as `kspeed serve --space A --space B` serves them to
    /// other nodes. Empty by default (one space).
    pub more_spaces: Vec<PathBuf>,
    /// The attach socket.
    pub socket: PathBuf,
    /// Pollers per attached rank (each its own io_uring and share of the
    /// rank's schedule).
    pub pollers: usize,
    /// The node's poller threads, which take turns for every attached
    /// rank's pollers; 0: a thread per poller, as an embedded loader
    /// runs them (to compare).
    pub node_pollers: usize,
    /// Cores for the node's poller threads: thread k pinned to
    /// `node_poller_cores[k % len]` (empty: not pinned). Each must be in
    /// the agent's affinity mask.
    pub node_poller_cores: Vec<u32>,
    /// Reads in flight per poller.
    pub queue_depth: u32,
    /// Register each rank's ring with the pollers' io_urings.
    pub registered_buffers: bool,
    /// The agent's heartbeat period (ranks count it gone after 3).
    pub heartbeat: Duration,
    /// The socket's mode, uid policy and I/O deadlines.
    pub listener: ListenerConfig,
    /// The node's memory tier: one for every rank the agent serves, filled
    /// from any rank's reads and served to all (0: none).
    pub tier_bytes: u64,
    /// Lock the tier in memory (needs RLIMIT_MEMLOCK of `tier_bytes`).
    pub tier_mlock: bool,
    /// The NVMe cache area for what the attached ranks read from the
    /// source (None: none): the node's, shared by the ranks of one job
    /// (`dir/node`), or one per rank (`dir/rank<N>`), by its `scope`.
    pub cache: Option<AgentCache>,
    /// The largest ring a rank may attach: the agent's own memory grows
    /// with it (8 bytes of ready table per 4 KiB of ring, and the pages it
    /// touches), so a rank cannot make the agent run out for every rank.
    pub max_ring_bytes: u64,
    /// How the space is read for each rank (`--read-page-cache`): `auto` (the
    /// default) samples at each attach which of the space's pages are
    /// cached and reads through the page cache when nearly all are, else
    /// O_DIRECT, as an embedded loader's `page_cache` does; `off` always
    /// O_DIRECT; `on` always the page cache.
    pub page_cache: crate::loader::PageCache,
    /// The cluster: attached ranks read the samples this node's space
    /// does not hold from the other nodes (None: the space must hold
    /// every sample).
    pub cluster: Option<AgentCluster>,
    /// The node service for the other nodes' consumers, run inside the
    /// agent (None: none, or a separate `kspeed serve`).
    pub serve: Option<crate::transport::ServeConfig>,
    /// Prometheus metrics on this address (`HOST:PORT`, port 0 picks one):
    /// the agent's series (ranks, what its loaders waited for); with a
    /// node service, served by it next to the service's own, at its
    /// `serve.metrics` address if that is set, else at this one.
    pub metrics: Option<String>,
}

impl AgentConfig {
    /// Defaults: 1 poller per rank, the node's poller threads a quarter of
    /// the agent's cores (1 to 8, `placement::default_pollers`), queue
    /// depth 32, registered buffers, a 100 ms heartbeat, no memory tier.
    pub fn new(space: impl Into<PathBuf>, socket: impl Into<PathBuf>) -> Self {
        AgentConfig {
            space: space.into(),
            more_spaces: Vec::new(),
            socket: socket.into(),
            pollers: 1,
            node_pollers: crate::placement::default_pollers(),
            node_poller_cores: Vec::new(),
            queue_depth: 32,
            registered_buffers: true,
            heartbeat: Duration::from_millis(100),
            listener: ListenerConfig::default(),
            tier_bytes: 0,
            tier_mlock: true,
            cache: None,
            max_ring_bytes: 64 << 30,
            page_cache: crate::loader::PageCache::Auto,
            cluster: None,
            serve: None,
            metrics: None,
        }
    }
}

/// The cache area the agent keeps for its ranks (`kspeed agent
/// --cache-dir`): what an embedded loader's `cache_dir`, `cache_bytes` and
/// `cache_policy` give it.
#[derive(Debug, Clone)]
pub struct AgentCache {
    /// The folder: the node's area is `dir/node`, rank N's `dir/rank<N>`;
    /// [`MEMORY_DIR`](crate::cache::MEMORY_DIR): in the agent's memory.
    pub dir: PathBuf,
    /// The area's budget (each rank's, with [`CacheScope::Rank`]).
    pub bytes: u64,
    /// What the area keeps.
    pub policy: crate::cache::CachePolicy,
    /// One area for the node, or one per rank.
    pub scope: CacheScope,
}

/// Whose cache area a rank's source reads go to (`kspeed agent
/// --cache-scope`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheScope {
    /// One area for the node's ranks of one job, planned over all their
    /// reads: a sample one rank fetched is a hit for the others (the
    /// default).
    Node,
    /// An area per rank, each planned along its rank's reads alone (as an
    /// embedded loader's `cache_dir`).
    Rank,
}

impl CacheScope {
    /// Parses `node` or `rank`.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "node" => Some(CacheScope::Node),
            "rank" => Some(CacheScope::Rank),
            _ => None,
        }
    }
}

/// What a run of the agent did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AgentSummary {
    /// Ranks attached over the agent's life.
    pub attached: u64,
    /// Attaches refused (another dataset, a bad request...).
    pub refused: u64,
    /// Ranks that ended (detached, died or failed).
    pub ended: u64,
    /// Node tier fills refused because a rank's ring changed while the
    /// agent copied from it (see `Tier::new_checked`).
    pub tier_fills_refused: u64,
}

/// One space the agent serves, opened and checked once.
struct OpenPart {
    space: Arc<Space>,
    extents: Arc<[File]>,
    direct_io: bool,
    /// The extents opened without O_DIRECT, for ranks whose reads go
    /// through the page cache (`page_cache`; empty with `off`).
    buffered: Arc<[File]>,
}

/// The space (or a mixture's spaces), opened and checked once, shared by
/// every rank's loader.
struct OpenSpace {
    space: Arc<Space>,
    extents: Arc<[File]>,
    direct_io: bool,
    /// The extents opened without O_DIRECT, for ranks whose reads go
    /// through the page cache (`page_cache`; empty with `off`).
    buffered: Arc<[File]>,
    /// A mixture's spaces after the first (`AgentConfig::more_spaces`).
    more: Vec<OpenPart>,
    /// Whether the first space's extents are O_DIRECT (`direct_io` is
    /// every space's).
    first_direct_io: bool,
    /// The catalog's identity, or the mixture's.
    identity: u64,
    /// The node tier and the user whose ranks share it now.
    tier: Option<Mutex<NodeTier>>,
    /// The node's cache area (`--cache-scope node`) and the job whose
    /// ranks share it now.
    node_cache: Option<Mutex<NodeCache>>,
    /// In a cluster over TCP: the one network thread every rank's loader
    /// joins (one link per other node, started with the first rank).
    net_hub: Option<Arc<crate::loader::net::NetHub>>,
    /// The node's poller threads (None: a thread per poller).
    node_pollers: Option<Arc<NodePollers>>,
    /// With metrics (`--listen` and `--metrics`): what every rank's loader
    /// waited for, summed (`super::metrics`).
    stall_totals: Option<Arc<StallTotals>>,
    /// With a node service (`--listen`): where its consumer side posts the
    /// nodes it judges dead, for the service to tell the other nodes'
    /// consumers (docs/PROTOCOL.md, "Node-down notices").
    node_notices: Option<Arc<crate::transport::notices::NodeNotices>>,
}

impl OpenSpace {
    /// Every space served, in order (one without a mixture).
    fn parts(&self) -> impl Iterator<Item = OpenPartRef<'_>> {
        std::iter::once(OpenPartRef {
            space: &self.space,
            extents: &self.extents,
            buffered: &self.buffered,
            direct_io: self.first_direct_io,
        })
        .chain(self.more.iter().map(|p| OpenPartRef {
            space: &p.space,
            extents: &p.extents,
            buffered: &p.buffered,
            direct_io: p.direct_io,
        }))
    }

    /// A mixture's spaces with the extents a rank reads them by (through
    /// the page cache, or O_DIRECT); empty for one space.
    fn mix_parts(&self, buffered: bool) -> Vec<(Arc<Space>, Arc<[File]>)> {
        if self.more.is_empty() {
            return Vec::new();
        }
        self.parts()
            .map(|p| {
                let files = if buffered { p.buffered } else { p.extents };
                (p.space.clone(), files.clone())
            })
            .collect()
    }
}

/// One of [`OpenSpace::parts`].
struct OpenPartRef<'a> {
    space: &'a Arc<Space>,
    extents: &'a Arc<[File]>,
    buffered: &'a Arc<[File]>,
    direct_io: bool,
}

fn open_space(cfg: &AgentConfig) -> Result<OpenSpace> {
    if !cfg.more_spaces.is_empty() {
        // Not built for a mixture yet: say so at the start, not at every
        // rank's attach.
        if cfg.cache.is_some() {
            return Err(Error::InvalidConfig(
                "--cache-dir: an agent serving a mixture's spaces (several --space) keeps no cache area yet".into(),
            ));
        }
        let spaces = cfg.more_spaces.len() + 1;
        if spaces > super::msg::MAX_ATTACH_DATASETS {
            return Err(Error::InvalidConfig(format!(
                "{spaces} spaces: an agent serves a mixture of at most {} (--space)",
                super::msg::MAX_ATTACH_DATASETS
            )));
        }
    }
    let first = open_part(cfg, &cfg.space)?;
    let more = cfg
        .more_spaces
        .iter()
        .map(|dir| open_part(cfg, dir))
        .collect::<Result<Vec<_>>>()?;
    if !more.is_empty() {
        // A mixture of partial spaces is read on one node only, embedded
        // (`loader/input.rs`); the agent's loaders read a mixture's
        // spaces as held whole or shared by the nodes.
        if let Some(p) = std::iter::once(&first)
            .chain(&more)
            .find(|p| p.space.params().is_partial())
        {
            return Err(Error::InvalidConfig(format!(
                "--space {}: a partial space (kspeed preload --max-bytes) in a mixture is not served by the agent (read that mixture embedded: agent = off)",
                p.space.dir().display()
            )));
        }
    }
    let identity = if more.is_empty() {
        u64::from(first.space.catalog().identity())
    } else {
        let ids: Vec<u32> = std::iter::once(&first)
            .chain(&more)
            .map(|p| p.space.catalog().identity())
            .collect();
        u64::from(crate::dataset::mixture_identity(&ids))
    };
    // Checked fills: a member is copied from one rank's ring (memory that
    // rank can write) and served to every other rank. In a cluster,
    // members this node does not hold are filled when their owners push
    // them (the network thread) and then served from memory.
    // In a cluster the samples other nodes hold come first: a hit on one
    // saves a push, a hit on a local one only an NVMe read. A mixture's
    // spaces are one id space, as its ranks' loaders number them.
    let samples = NodeSamples::new(std::iter::once(&first).chain(&more).map(|p| &*p.space));
    let tier = if cfg.cluster.is_some() {
        Tier::preferring(&samples, cfg.tier_bytes, cfg.tier_mlock, true, &|id| {
            samples.remote(id)
        })?
    } else {
        Tier::new_checked(&samples, cfg.tier_bytes, cfg.tier_mlock)?
    };
    if let Some(t) = &tier {
        log::info!(
            "agent: node memory tier of {} samples, {} bytes in {}, shared by the ranks of one user at a time (read-only to those that ask for tier views)",
            t.members(),
            t.member_bytes(),
            t.shared_memory_map()
                .map_or("private memory", |m| m.pages().describe())
        );
    }
    let tier = tier.map(|t| {
        Mutex::new(NodeTier {
            tier: Arc::new(t),
            uid: None,
            ranks: 0,
            layout: None,
        })
    });
    let node_cache = match &cfg.cache {
        Some(c) if c.scope == CacheScope::Node => Some(Mutex::new(NodeCache::open(
            &c.dir,
            c.bytes,
            c.policy,
            first.space.catalog(),
        )?)),
        _ => None,
    };
    Ok(OpenSpace {
        node_cache,
        space: first.space,
        extents: first.extents,
        // One setting for a mixture's reads: O_DIRECT only where every
        // space takes it.
        direct_io: first.direct_io && more.iter().all(|p| p.direct_io),
        first_direct_io: first.direct_io,
        buffered: first.buffered,
        more,
        identity,
        tier,
        net_hub: match &cfg.cluster {
            Some(c) if c.shared_links() => Some(crate::loader::net::NetHub::new(c.net_threads)?),
            _ => None,
        },
        node_pollers: NodePollers::for_agent(cfg.node_pollers, &cfg.node_poller_cores)?,
        stall_totals: (cfg.metrics.is_some()
            || cfg.serve.as_ref().is_some_and(|s| s.metrics.is_some()))
        .then(|| {
            Arc::new(StallTotals::new(
                cfg.cluster.as_ref().map_or(0, |c| c.cluster.nodes.len()),
            ))
        }),
        // Set by `run` once the node service is up.
        node_notices: None,
    })
}

/// Opens and checks one of the agent's spaces: its extents with O_DIRECT
/// where the file system allows, and again without for reads through the
/// page cache.
fn open_part(cfg: &AgentConfig, dir: &Path) -> Result<OpenPart> {
    let space = Space::open(dir)?;
    space.check_extents()?;
    let in_memory = cfg
        .cache
        .as_ref()
        .is_some_and(|c| crate::cache::is_memory_dir(&c.dir));
    if cfg.cache.is_some() && !space.params().is_partial() && !in_memory {
        // Every rank's loader would refuse it at attach: say it once, here.
        return Err(Error::InvalidConfig(format!(
            "--cache-dir: space {} holds every sample of its share, so nothing comes from a \
             source to keep (a partial space, `kspeed preload --max-bytes`, reads the rest from \
             its source; an area in memory, `--cache-dir :memory:`, keeps a space's samples too)",
            dir.display()
        )));
    }
    // A node's share of a cluster needs the cluster; a partial space reads
    // the rest from its source.
    if space.held_samples() != space.catalog().len()
        && cfg.cluster.is_none()
        && !space.params().is_partial()
    {
        return Err(Error::InvalidConfig(format!(
            "space {} holds {} of {} samples: give the agent the cluster (--cluster, --nodelist or \
             --nodes-dns, with --token-file) so its ranks read the rest from the other nodes",
            dir.display(),
            space.held_samples(),
            space.catalog().len()
        )));
    }
    let mut direct_io = true;
    let mut extents = Vec::with_capacity(space.extent_lens().len());
    for i in 0..space.extent_lens().len() as u32 {
        let path = space.extent_path(i);
        let (f, direct) =
            crate::sys::open_direct(&path).map_err(|e| Error::io("open", &path, e))?;
        direct_io &= direct;
        extents.push(f);
    }
    if !direct_io {
        log::warn!(
            "{}: the file system refuses O_DIRECT; reading through the page cache",
            dir.display()
        );
    }
    let buffered = if cfg.page_cache == crate::loader::PageCache::Off || !direct_io {
        Vec::new()
    } else {
        (0..space.extent_lens().len() as u32)
            .map(|i| {
                let path = space.extent_path(i);
                File::open(&path).map_err(|e| Error::io("open", &path, e))
            })
            .collect::<Result<Vec<File>>>()?
    };
    Ok(OpenPart {
        space: Arc::new(space),
        extents: extents.into(),
        direct_io,
        buffered: buffered.into(),
    })
}

/// Every attached rank's segment (a second mapping of it), beaten by the
/// heartbeat thread: the agent's heartbeat never waits on an accept, a
/// loader build or a feeder busy in a read.
type Beats = Arc<Mutex<Vec<(u64, Arc<Segment>)>>>;

/// One rank as the main loop sees it, from its ATTACH on.
struct Rank {
    id: u64,
    pid: u32,
    rank: u32,
    feeder: JoinHandle<Outcome>,
    /// It was given the node tier (given back when it ends).
    has_tier: bool,
    /// It was given a lane of the node's cache area (likewise).
    has_cache: bool,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// How a rank's feeder thread ended.
enum Outcome {
    /// Its loader could not be built (or ATTACHED not sent): refused.
    Refused(Error),
    /// It was served; the batches published, or why it stopped.
    Served(Result<u64>),
}

/// Runs the agent until `stop` is set: starts the node service (with
/// [`AgentConfig::serve`]), binds the socket, calls `on_ready(socket,
/// node service address, metrics address)` once it accepts, then serves
/// ranks. On return
/// every rank's pollers have stopped (their reads landed) and its ring is
/// unmapped. A node service that stops by itself (a poller panicked) stops
/// the agent with the reason.
///
/// Threads: this loop (accepts; reaps ranks that ended), one heartbeat
/// thread, per rank a feeder (which builds the rank's loader, answers,
/// then feeds), its loader's pollers and, in a cluster, its network
/// thread; the node service's threads.
pub fn run(
    cfg: &AgentConfig,
    stop: &AtomicBool,
    on_ready: impl FnOnce(&Path, Option<std::net::SocketAddr>, Option<std::net::SocketAddr>),
) -> Result<AgentSummary> {
    crate::sys::raise_open_files_limit();
    let mut open = open_space(cfg)?;
    // The node service first: a port that is taken fails the start before
    // the socket invites ranks.
    let owner = cfg
        .serve
        .clone()
        .map(|mut s| {
            if s.metrics.is_none() {
                s.metrics = cfg.metrics.clone();
            }
            crate::transport::NodeService::start(s)
        })
        .transpose()?;
    open.node_notices = owner.as_ref().map(|s| s.notices());
    let open = Arc::new(open);
    if let Some(svc) = &owner {
        log::info!(
            "agent: node service for the other nodes on {}",
            svc.local_addr()
        );
    }
    // The agent's own series, in the node service's scrape, or on a port
    // of their own without a node service.
    let series = open.stall_totals.as_ref().map(|totals| {
        Arc::new(AgentMetrics::new(
            totals.clone(),
            cfg.cluster.as_ref().map_or_else(Vec::new, |c| {
                c.cluster.nodes.iter().map(|n| n.addr.clone()).collect()
            }),
        ))
    });
    let mut own_metrics = None;
    if let Some(m) = &series {
        match (&owner, &cfg.metrics) {
            (Some(svc), _) => svc.add_metrics(m.clone()),
            (None, Some(addr)) => own_metrics = Some(OwnMetrics::start(addr, m.clone())?),
            (None, None) => {}
        }
    }
    let metrics = series;
    let listener = AttachListener::bind(&cfg.socket, cfg.listener)?;
    log::info!(
        "agent: serving {} on {}",
        open.parts()
            .map(|p| format!(
                "{} ({} samples)",
                p.space.dir().display(),
                p.space.catalog().len()
            ))
            .collect::<Vec<_>>()
            .join(", "),
        cfg.socket.display()
    );
    // In a cluster over shared links: made now, kept until the agent stops.
    let mut kept_links = match (&cfg.cluster, &open.net_hub) {
        (Some(c), Some(hub)) if c.kept_links() => {
            let input = crate::loader::AgentInput {
                space: open.space.clone(),
                extents: open.extents.clone(),
                direct_io: open.direct_io,
                ring: Arc::new(Mutex::new(None)),
                tier: None,
                net_hub: Some(hub.clone()),
                node_pollers: open.node_pollers.clone(),
                links_only: true,
                net_hub_slot: None,
                mix_parts: open.mix_parts(false),
                stall_totals: None,
                node_notices: open.node_notices.clone(),
                node_cache: None,
            };
            Some(KeptLinks::start(c, &cfg.space, input, hub.threads())?)
        }
        _ => None,
    };
    let halt = Arc::new(AtomicBool::new(false));
    let beats: Beats = Arc::new(Mutex::new(Vec::new()));
    let beat_stop = Arc::new(AtomicBool::new(false));
    let beater = {
        let (beats, beat_stop, period) = (beats.clone(), beat_stop.clone(), cfg.heartbeat / 2);
        std::thread::Builder::new()
            .name("kspeed-agent-beat".into())
            .spawn(move || {
                while !beat_stop.load(Ordering::Acquire) {
                    for (_, seg) in beats.lock().unwrap_or_else(|p| p.into_inner()).iter() {
                        seg.beat_for(Side::Agent);
                    }
                    // A period, not a wait for a condition: the timeout is
                    // the point (unparked only to stop).
                    std::thread::park_timeout(period);
                }
            })
            .map_err(|e| Error::ThreadSpawn {
                thread: "agent heartbeat",
                source: e.into(),
            })?
    };
    on_ready(
        listener.path(),
        owner.as_ref().map(|svc| svc.local_addr()),
        owner
            .as_ref()
            .and_then(|svc| svc.metrics_addr())
            .or(own_metrics.as_ref().map(|m| m.addr)),
    );
    let mut ranks: Vec<Rank> = Vec::new();
    let mut summary = AgentSummary::default();
    let mut next_id = 0u64;
    let mut failed = None;
    while !stop.load(Ordering::Acquire) {
        if let Some(why) = owner.as_ref().and_then(|svc| svc.failure()) {
            // The other nodes' samples would fail over for the rest of the
            // job without a word: stop, naming why.
            failed = Some(Error::InvalidConfig(format!(
                "the agent's node service stopped: {why}"
            )));
            break;
        }
        match listener.accept_attach(cfg.heartbeat) {
            Ok(Some(incoming)) => {
                next_id += 1;
                match start_rank(cfg, &open, incoming, next_id, &halt, &beats) {
                    Ok(r) => ranks.push(r),
                    Err(e) => {
                        summary.refused += 1;
                        log::warn!("agent: attach refused: {e}");
                    }
                }
            }
            Ok(None) => {}
            // One bad peer (a wrong request, a timeout) never stops the agent.
            Err(e) => {
                summary.refused += 1;
                log::warn!("agent: attach failed: {e}");
            }
        }
        let mut i = 0;
        while i < ranks.len() {
            if ranks[i].feeder.is_finished() {
                let r = ranks.swap_remove(i);
                end_rank(r, &open, &beats, &mut summary);
            } else {
                i += 1;
            }
        }
        if let Some(m) = &metrics {
            m.set(ranks.len(), summary.ended, summary.refused);
        }
    }
    halt.store(true, Ordering::Release);
    for r in ranks.drain(..) {
        end_rank(r, &open, &beats, &mut summary);
    }
    beat_stop.store(true, Ordering::Release);
    beater.thread().unpark();
    let _ = beater.join();
    summary.tier_fills_refused = open
        .tier
        .as_ref()
        .map_or(0, |t| lock(t).tier.fills_refused());
    if let Some(k) = kept_links.as_mut() {
        k.close();
    }
    // Its totals are in its metrics (`--metrics`) while it runs.
    if let Some(svc) = owner {
        svc.stop();
    }
    drop(own_metrics);
    match failed {
        Some(e) => Err(e),
        None => Ok(summary),
    }
}

/// The agent's metrics port without a node service: its series alone, on
/// a thread of its own, stopped and joined when dropped (also when the
/// agent's start fails after it).
struct OwnMetrics {
    addr: std::net::SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl OwnMetrics {
    fn start(addr: &str, series: Arc<AgentMetrics>) -> Result<OwnMetrics> {
        let server = crate::transport::serve::MetricsListener::bind(addr)?;
        let addr = server.local_addr();
        let stop = Arc::new(AtomicBool::new(false));
        let source = crate::transport::serve::SeriesOnly {
            series,
            stop: stop.clone(),
        };
        let thread = std::thread::Builder::new()
            .name("kspeed-metrics".into())
            .spawn(move || crate::transport::serve::serve_http(source, server))
            .map_err(|e| Error::ThreadSpawn {
                thread: "metrics",
                source: e.into(),
            })?;
        Ok(OwnMetrics {
            addr,
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for OwnMetrics {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// [`run`] until SIGINT or SIGTERM (`kspeed agent`): the signals are
/// blocked in every thread and taken here; then every rank's pollers stop
/// (their reads land) and the socket is removed. A failure to start (the
/// space, the socket) ends the wait at once.
pub fn run_until_signal(
    cfg: &AgentConfig,
    on_ready: impl FnOnce(&Path, Option<std::net::SocketAddr>, Option<std::net::SocketAddr>)
        + Send
        + 'static,
) -> Result<AgentSummary> {
    let signals = crate::sys::TermSignals::block();
    let stop = Arc::new(AtomicBool::new(false));
    let (s2, cfg2) = (stop.clone(), cfg.clone());
    let agent = std::thread::Builder::new()
        .name("kspeed-agent".into())
        .spawn(move || {
            let r = run(&cfg2, &s2, on_ready);
            if !s2.load(Ordering::Acquire) {
                // SAFETY: kill with our own pid and a valid signal number
                // has no memory effects; every thread blocks SIGTERM, so it
                // reaches the sigwait below.
                unsafe { libc::kill(libc::getpid(), libc::SIGTERM) };
            }
            r
        })
        .map_err(|e| Error::ThreadSpawn {
            thread: "agent",
            source: e.into(),
        })?;
    signals.wait();
    stop.store(true, Ordering::Release);
    agent
        .join()
        .map_err(|_| Error::ThreadPanicked { thread: "agent" })?
}

/// Joins a rank's feeder (its pollers stopped and its reads landed when
/// it returns, and its loader, with its hold on the node tier, is gone)
/// and stops beating its segment.
fn end_rank(r: Rank, open: &OpenSpace, beats: &Beats, summary: &mut AgentSummary) {
    let outcome = r.feeder.join();
    if r.has_tier {
        if let Some(t) = &open.tier {
            lock(t).give_back();
        }
    }
    if r.has_cache {
        if let Some(c) = &open.node_cache {
            lock(c).give_back();
        }
    }
    beats
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .retain(|(id, _)| *id != r.id);
    match outcome {
        Ok(Outcome::Refused(e)) => {
            summary.refused += 1;
            log::warn!(
                "agent: attach of rank {} (pid {}) refused: {e}",
                r.rank,
                r.pid
            );
        }
        Ok(Outcome::Served(result)) => {
            summary.attached += 1;
            summary.ended += 1;
            match result {
                Ok(batches) => log::info!(
                    "agent: rank {} (pid {}) ended after {batches} batches; its pollers stopped and its ring is unmapped",
                    r.rank,
                    r.pid
                ),
                Err(e) => log::warn!("agent: rank {} (pid {}) ended: {e}", r.rank, r.pid),
            }
        }
        Err(_) => {
            // The rank sees the agent fail its batches: it ended too.
            summary.ended += 1;
            log::error!("agent: the feeder of rank {} panicked", r.rank)
        }
    }
}

/// Checks an incoming rank's dataset, registers its segment with the
/// heartbeat thread and starts its feeder thread, which builds the rank's
/// loader over the shared space and the rank's ring, answers ATTACHED
/// (or REFUSED with the reason) and feeds it.
fn start_rank(
    cfg: &AgentConfig,
    open: &Arc<OpenSpace>,
    incoming: Incoming,
    id: u64,
    halt: &Arc<AtomicBool>,
    beats: &Beats,
) -> Result<Rank> {
    let req = incoming.request.clone();
    let refuse = |incoming: &Incoming, e: Error| {
        incoming.conn.refuse(RefuseCode::Agent, &e.to_string());
        e
    };
    if req.ring_bytes > cfg.max_ring_bytes {
        let e = Error::InvalidConfig(format!(
            "the rank's ring of {} bytes is larger than this agent's limit of {} bytes (kspeed agent --max-ring-bytes)",
            req.ring_bytes, cfg.max_ring_bytes
        ));
        return Err(refuse(&incoming, e));
    }
    if req.dataset_id != open.identity {
        let served = if open.more.is_empty() {
            cfg.space.display().to_string()
        } else {
            format!(
                "a mixture of {} spaces in this order: {}",
                open.more.len() + 1,
                open.parts()
                    .map(|p| p.space.dir().display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        };
        let e = Error::InvalidConfig(format!(
            "the rank reads dataset {:#x}; this agent serves {served} (dataset {:#x})",
            req.dataset_id, open.identity
        ));
        return Err(refuse(&incoming, e));
    }
    let beat = incoming
        .segment
        .fd()
        .try_clone_to_owned()
        .map_err(|e| Error::io("dup", "attach segment", e))
        .and_then(|fd| Segment::open(fd, req.ring_bytes));
    let beat = match beat {
        Ok(b) => Arc::new(b),
        Err(e) => return Err(refuse(&incoming, e)),
    };
    beats
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .push((id, beat));
    let (pid, uid) = (incoming.conn.peer().pid, incoming.conn.peer().uid);
    let tier = open.tier.as_ref().and_then(|t| {
        let mut t = lock(t);
        let in_cluster = cfg.cluster.is_some();
        let samples = NodeSamples::new(open.parts().map(|p| &**p.space));
        let got = t.take(uid, TierLayout::of(&req), &samples, in_cluster);
        if got.is_none() {
            log::info!(
                "agent: rank {} (pid {pid}, uid {uid}) reads without the node tier: it holds samples read for uid {}'s ranks, {} still attached (ranks of one user share the tier)",
                req.rank,
                t.uid.map_or_else(|| "?".into(), |u| u.to_string()),
                t.ranks
            );
        }
        got
    });
    let has_tier = tier.is_some();
    let node_cache = open.node_cache.as_ref().and_then(|c| {
        match lock(c).take(uid, &req, open.space.catalog()) {
            Ok(lease) => Some(lease),
            Err(why) => {
                // A rank that did not say its node's ranks is most likely
                // a launcher without LOCAL_RANK / LOCAL_WORLD_SIZE: worth
                // a warning, the rest is the area being busy.
                let level = if req.local.is_none() {
                    log::Level::Warn
                } else {
                    log::Level::Info
                };
                log::log!(
                    level,
                    "agent: rank {} (pid {pid}, uid {uid}) reads from the source without the node's cache area: {why}",
                    req.rank
                );
                None
            }
        }
    });
    let has_cache = node_cache.is_some();
    // Tier views: the rank asked, and it shares the tier; it gets the
    // tier's memfd read-only with ATTACHED.
    let share = tier
        .as_ref()
        .filter(|_| req.flags & FLAG_TIER_VIEWS != 0)
        .and_then(|t| t.shared_memory_map())
        .and_then(|m| match m.read_only_fd() {
            Ok(fd) => Some((fd, m.len())),
            Err(e) => {
                log::warn!(
                    "agent: rank {} asked for tier views; the tier's memory cannot be shared ({e}): its tier samples are copied into its ring",
                    req.rank
                );
                None
            }
        });
    if req.flags & FLAG_TIER_VIEWS != 0 && share.is_none() && tier.is_none() {
        log::info!(
            "agent: rank {} asked for tier views; it reads without the node tier, so every sample comes in its ring",
            req.rank
        );
    }
    let (cfg, space, halt) = (cfg.clone(), open.clone(), halt.clone());
    let feeder = std::thread::Builder::new()
        .name(format!("kspeed-feed-{}", req.rank))
        .spawn(move || {
            let views = share.is_some();
            let loader = match build_loader(&cfg, &space, &incoming, tier, views, node_cache) {
                Ok(l) => l,
                Err(e) => return Outcome::Refused(refuse(&incoming, e)),
            };
            let heartbeat_ms = cfg.heartbeat.as_millis().clamp(1, u32::MAX as u128) as u32;
            let attached = match incoming
                .accept(heartbeat_ms, share.as_ref().map(|(fd, b)| (fd.as_fd(), *b)))
            {
                Ok(a) => a,
                Err(e) => return Outcome::Refused(e),
            };
            // The rank holds its own descriptor now.
            drop(share);
            log::info!("agent: rank {} (pid {pid}) attached", req.rank);
            Outcome::Served(feed(attached, loader, &halt, cfg.heartbeat))
        })
        .map_err(|e| Error::ThreadSpawn {
            thread: "agent feeder",
            source: e.into(),
        });
    match feeder {
        Ok(feeder) => Ok(Rank {
            id,
            pid,
            rank: req.rank,
            feeder,
            has_tier,
            has_cache,
        }),
        Err(e) => {
            if has_tier {
                if let Some(t) = &open.tier {
                    lock(t).give_back();
                }
            }
            if has_cache {
                if let Some(c) = &open.node_cache {
                    lock(c).give_back();
                }
            }
            beats
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .retain(|(i, _)| *i != id);
            Err(e)
        }
    }
}

/// The rank's loader: the agent's space (opened once), the rank's ring
/// (mapped a second time: the attach keeps its own mapping, and each is
/// unmapped by its owner), the rank's sampler and start position.
///
/// `views`: the rank takes tier samples in place (tier views through the
/// agent): its loader here leaves them out of the ring, and the feeder
/// names them in the batch's view words.
fn build_loader(
    cfg: &AgentConfig,
    open: &OpenSpace,
    incoming: &Incoming,
    tier: Option<Arc<Tier>>,
    views: bool,
    node_cache: Option<crate::loader::cache_node::NodeCacheLease>,
) -> Result<Loader> {
    let req = &incoming.request;
    let ring = incoming
        .ring
        .fd()
        .try_clone_to_owned()
        .map_err(|e| Error::io("dup", "attach ring", e))
        .and_then(|fd| RingMap::open(fd, req.ring_bytes))?;
    // A mixture's rank mixes exactly the spaces this agent serves (its
    // dataset id, checked before, is their mixture's identity).
    if let Some(m) = &req.mix {
        if m.counts.len() != open.more.len() + 1 {
            return Err(Error::InvalidConfig(format!(
                "the rank mixes {} datasets; this agent serves {} spaces",
                m.counts.len(),
                open.more.len() + 1
            )));
        }
    } else if !open.more.is_empty() {
        return Err(Error::InvalidConfig(format!(
            "the rank reads one dataset; this agent serves a mixture of {} spaces",
            open.more.len() + 1
        )));
    }
    // Through the page cache where the space is cached now (a warm node:
    // O_DIRECT would read from the device what sits in memory), as an
    // embedded loader decides at its build; a mixture's spaces only when
    // every one is.
    let mut buffered = true;
    let mut why = Vec::new();
    for p in open.parts() {
        let choice = crate::loader::page_cache::decide(
            cfg.page_cache,
            p.extents,
            p.space.extent_lens(),
            |i| p.space.extent_path(i as u32),
        )?;
        // A part on a file system that refuses O_DIRECT is read through
        // the page cache whatever is chosen (its extents are buffered).
        buffered &= choice.buffered && (!p.buffered.is_empty() || !p.direct_io);
        why.push(choice.why);
    }
    log::info!(
        "agent: rank {} reads {} ({})",
        req.rank,
        if buffered {
            "through the page cache"
        } else {
            "with O_DIRECT"
        },
        why.join("; ")
    );
    let b = match &req.mix {
        None => LoaderBuilder::space(&cfg.space),
        // The rank's weights as their counts: `Choose` gives each exactly.
        Some(m) => LoaderBuilder::mix(
            open.parts()
                .zip(&m.counts)
                .map(|(p, &c)| (p.space.dir().display().to_string(), Weight::Choose(c))),
        )
        .mix_start(Some(m.start())),
    };
    let b = match &cfg.cluster {
        Some(c) => c.apply(b),
        None => b,
    };
    let b = b
        .agent_input(crate::loader::AgentInput {
            space: open.space.clone(),
            extents: if buffered {
                open.buffered.clone()
            } else {
                open.extents.clone()
            },
            direct_io: open.direct_io && !buffered,
            ring: Arc::new(Mutex::new(Some(ring))),
            tier,
            net_hub: open.net_hub.clone(),
            node_pollers: open.node_pollers.clone(),
            links_only: false,
            net_hub_slot: None,
            mix_parts: open.mix_parts(buffered),
            stall_totals: open.stall_totals.clone(),
            node_notices: open.node_notices.clone(),
            node_cache,
        })
        .batch_size(req.batch_size as usize)
        .seed(req.seed)
        .shuffle(req.flags & FLAG_SHUFFLE != 0)
        .shuffle_block(req.shuffle_block)
        .drop_last(req.flags & FLAG_DROP_LAST != 0)
        .verify_crc32c(req.flags & FLAG_VERIFY_CRC32C != 0)
        .tier_views(views)
        .rank(req.rank, req.world)
        .landing(
            LandingOptions::default()
                .ring_bytes(req.ring_bytes)
                .huge_pages(false)
                .mlock(false)
                .cuda(CudaMode::Off),
        )
        .pollers(cfg.pollers)
        .queue_depth(cfg.queue_depth)
        .registered_buffers(cfg.registered_buffers)
        .pin(false)
        .local_rank(0, 1)
        .start_at(Position {
            epoch: req.start_epoch,
            index: req.start_index,
        })
        .end_epoch(req.end_epoch)
        // The rank's deal: its job position; without one, a mixture's
        // starts with the epoch its mixed order starts in (epochs before
        // it have nothing left, as on the rank).
        .job_deal(req.job.or_else(|| {
            req.mix.as_ref().map(|m| crate::sampler::JobPosition {
                epoch: m.start_epoch,
                consumed: 0,
            })
        }));
    let b = match cfg.cache.as_ref().filter(|c| c.scope == CacheScope::Rank) {
        Some(c) => b
            .cache_dir(Some(c.dir.clone()))
            .cache_bytes(c.bytes)
            .cache_policy(c.policy),
        None => b,
    };
    b.build()
}

/// Moves one rank's batches from its loader to its segment until the
/// rank goes (socket hang-up or a clean detach) or the agent stops.
/// Returns the batches published. Dropping the loader at the end stops its
/// pollers after their in-flight reads land; then the ring is unmapped.
fn feed(
    mut att: Attached,
    mut loader: Loader,
    halt: &AtomicBool,
    heartbeat: Duration,
) -> Result<u64> {
    // Judged by its socket and state word, not by its heartbeat.
    let live = Liveness {
        slice: heartbeat,
        silence_limit: Duration::from_secs(u32::MAX as u64),
    };
    let mut released = 0u64;
    // The loader's read counters at the previous publish: each batch
    // carries what was read since (its stats reach the rank that way).
    // Zero at first: the pollers started reading when the loader was built.
    let mut counted = crate::loader::ReadCounts::default();
    // Likewise the loader's waits by cause (sent with each batch, so the
    // rank can charge its own waits to them rather than to the agent).
    let mut waited = [Duration::ZERO; 5];
    // The rank's last epoch is dealt (its ATTACH's end_epoch): nothing more
    // to publish; wait for the rank to leave.
    let mut dealt = false;
    // Tier views: a view word per sample of each batch (allocated once).
    let mut views = vec![0u64; att.side.segment().views_per_slot() as usize];
    // Peer waits: the rank's segment has a table for them (layout 7), and
    // extra words (layout 8): source bytes and the peers' phases.
    let peer_waits = att.side.segment().peer_waits_per_slot() > 0;
    let extras = att.side.segment().extras_per_slot() > 0;
    let result = loop {
        if halt.load(Ordering::Acquire)
            || att.conn.peer_closed()
            || att.side.segment().side_status(Side::Rank).0 != side_state::RUNNING
        {
            break Ok(());
        }
        // The rank's releases free the loader's oldest batches.
        match att.side.released() {
            Ok(r) => {
                while released < r {
                    assert!(
                        loader.release_oldest_batch(),
                        "the rank released a batch the agent never published"
                    );
                    released += 1;
                }
            }
            Err(e) => break Err(e),
        }
        let room = match att.side.has_room() {
            Ok(room) => {
                room && !dealt
                    && loader.keep_bytes_needed().is_none()
                    && loader.keep_lookahead_needed().is_none()
            }
            Err(e) => break Err(e),
        };
        if !room {
            let conn = &att.conn;
            let mut check = || {
                if conn.peer_closed() {
                    return Err(Error::AttachPeerGone {
                        peer: "rank",
                        pid: conn.peer().pid,
                        silent_ms: 0,
                        closed: true,
                    });
                }
                Ok(())
            };
            let deadline = Some(Instant::now() + heartbeat);
            match att
                .side
                .wait_released(released, &live, deadline, &mut check)
            {
                Ok(()) | Err(Error::AttachTimeout { .. }) => continue,
                Err(Error::AttachPeerGone { .. }) => break Ok(()),
                Err(e) => break Err(e),
            }
        }
        match loader.acquire_batch_keep() {
            Ok(0) => {
                // The epoch's end: go on into the next, as the rank does,
                // unless that is the rank's end epoch.
                let next = loader.position().epoch;
                if loader.end_epoch().is_some_and(|end| next >= end) {
                    dealt = true;
                } else if let Err(e) = loader.set_epoch(next) {
                    break Err(e);
                }
            }
            Ok(_) => {
                let mut desc = loader.held_desc().expect("a batch is held");
                let now = loader.read_counts();
                let source_bytes = now.source_bytes.saturating_sub(counted.source_bytes);
                desc.reads = now.since(&mut counted);
                let waits = loader.waits_by_cause();
                desc.reads.waits =
                    crate::agent::segment::BatchWaits::from_array(std::array::from_fn(|i| {
                        let us = waits[i].saturating_sub(waited[i]).as_micros();
                        u32::try_from(us).unwrap_or(u32::MAX)
                    }));
                waited = waits;
                if !views.is_empty() {
                    let n = loader.held_view_words(&mut views);
                    att.side.set_views(&views[..n]);
                }
                if peer_waits {
                    // The nodes waited for while this batch was made, for
                    // the rank's stall by node (and by phase).
                    let (words, mut more) = loader.take_peer_wait_words();
                    att.side.set_peer_waits(&words);
                    if extras {
                        more.source_bytes = source_bytes;
                        att.side.set_extras(&more);
                    }
                }
                if let Err(e) = att.side.publish(&desc) {
                    break Err(e);
                }
            }
            Err(e) => break Err(e),
        }
    };
    let published = att.side.published();
    if let Err(e) = &result {
        // The rank's wait ends with this error at once.
        att.side.segment().post_error(Side::Agent, e);
    } else {
        att.side.close();
    }
    // Pollers stop and their reads land before the ring's mapping goes.
    drop(loader);
    drop(att);
    result.map(|()| published)
}
