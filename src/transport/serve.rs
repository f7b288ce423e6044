//! The node service: the owner side of the push protocol over TCP.
//!
//! An acceptor thread takes connections and runs every handshake as a
//! non-blocking state machine under one deadline (`accept`: no thread per
//! peer, a bounded number pending, so a peer that stalls or floods holds up
//! no one), then hands the connection to the least loaded poller. Each poller owns one io_uring that
//! carries everything: the socket receives (GRANT frames), the O_DIRECT
//! reads of granted samples from the extents into its registered staging
//! slab, and the DATA sends (`sendmsg` of header + staging slot, no copy).
//! Per connection, frames go out strictly in the order the grants came in;
//! one send is in flight at a time per socket (io_uring does not order two
//! sends on one stream socket).
//!
//! Pools are sized at start: staging slots (`staging_bytes / chunk_bytes`),
//! connections per poller, grants per connection (announced in WELCOME; a
//! consumer that exceeds it is dropped). Running out of staging slots is
//! back-pressure: reads wait, grants stay queued.

use std::collections::VecDeque;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

mod accept;
mod metrics;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam_channel::Receiver;

use super::proto::{self, Code, GrantEntry, Header, Hello, Kind};
use super::tcp::TcpLink;
use super::{Done, Link};
use crate::dataset::Space;
use crate::error::{errno_name, Error, Result};
use crate::ring::{Completion, IoBackend, ReadOp, Target, Uring, UringOptions};
use crate::sys::AlignedBuf;

/// Node service settings.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct ServeConfig {
    /// The preloaded space this node serves.
    pub space: PathBuf,
    /// Address to listen on (`host:port`; port 0 picks one).
    pub listen: String,
    /// Job token every consumer must present.
    pub token: Vec<u8>,
    /// Poller threads.
    pub pollers: usize,
    /// Staging memory per poller.
    pub staging_bytes: u64,
    /// Largest DATA frame or RDMA write, and the size of a staging slot
    /// (default 256 KiB). Staging holds `staging_bytes / chunk_bytes`
    /// slots, which bounds the reads and sends in flight: with 1 MiB slots
    /// an ImageNet-sized sample (~128 KB) left 7/8 of its slot empty and 64
    /// MiB of staging kept only 64 samples moving, and on soft-RoCE the
    /// node then waited on its reads (kspeed over RDMA 0.81x ib_write_bw
    /// with 1 MiB, 0.85-0.90x with 128-256 KiB; BENCHMARKS.md).
    pub chunk_bytes: u32,
    /// Grants one consumer may have outstanding.
    pub max_grants: u32,
    /// Consumers one poller serves at once (`--max-consumers-per-poller`);
    /// a HELLO beyond `pollers` times this is refused with
    /// [`Code::NodeFull`].
    pub max_conns_per_poller: usize,
    /// Time a peer has to complete its whole handshake (HELLO, and the
    /// RDMA endpoint swap), however it paces its bytes.
    pub handshake_timeout: Duration,
    /// Handshakes pending at once (`--max-handshakes`); a connection
    /// accepted beyond that closes the oldest pending one.
    pub max_handshakes: usize,
    /// A consumer connection that sends nothing (no GRANT, no keepalive)
    /// for this long while it has nothing queued or in flight is closed
    /// (`--idle-timeout-ms`; kspeed's consumer sends a keepalive every
    /// second it has nothing to grant). At least [`MIN_IDLE_TIMEOUT`].
    pub idle_timeout: Duration,
    /// Serve Prometheus metrics (`GET /metrics`) on this address
    /// (`--metrics`; port 0 picks one, see [`NodeService::metrics_addr`]).
    pub metrics: Option<String>,
    /// A consumer whose link finishes nothing for this long while the node
    /// has data in flight for it (a socket that takes no bytes, RDMA writes
    /// that do not complete) is dropped (`--stall-timeout-ms`); before that
    /// it holds at most its fair share of staging.
    pub stall_timeout: Duration,
    /// Send straight from a read-only mapping of the extents (the page
    /// cache) instead of reading each chunk into staging with O_DIRECT. For
    /// spaces on memory-backed file systems (tmpfs) or kept warm: it saves a
    /// copy per byte; on a cold NVMe space a page fault would stall the
    /// poller, so it is off by default.
    pub page_cache: bool,
    /// Offer the RDMA transport on this device (consumers that ask for it
    /// get their samples as RDMA writes; the others still get TCP). Needs a
    /// build with the `rdma` feature.
    pub rdma: Option<super::RdmaOptions>,
    /// With RDMA writes in flight, how long a poller keeps polling its
    /// completion queues after the last completion before it arms them and
    /// sleeps on its completion channel (default: the loader's
    /// [`crate::placement::default_spin`], none on small machines).
    pub rdma_spin: Duration,
}

impl ServeConfig {
    /// Defaults for a space and listen address.
    pub fn new(space: impl Into<PathBuf>, listen: &str, token: &[u8]) -> Self {
        ServeConfig {
            space: space.into(),
            listen: listen.to_string(),
            token: token.to_vec(),
            pollers: crate::placement::default_pollers(),
            staging_bytes: 64 << 20,
            chunk_bytes: 256 << 10,
            max_grants: 8192,
            max_conns_per_poller: 256,
            handshake_timeout: Duration::from_secs(5),
            max_handshakes: 64,
            stall_timeout: Duration::from_secs(10),
            metrics: None,
            idle_timeout: Duration::from_secs(60),
            page_cache: false,
            rdma: None,
            rdma_spin: crate::placement::default_spin(),
        }
    }

    /// Checks every limit against what the service can allocate and encode
    /// (each bound is documented in docs/PROTOCOL.md, "Limits").
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::InvalidConfig(m));
        if self.token.is_empty() || self.token.len() > proto::MAX_TOKEN_BYTES {
            return bad(format!(
                "the job token has {} bytes; it must have 1 to {} (the HELLO frame's limit)",
                self.token.len(),
                proto::MAX_TOKEN_BYTES
            ));
        }
        let ranges: [(&str, u64, u64, u64); 6] = [
            ("pollers", self.pollers as u64, 1, MAX_POLLERS),
            ("max grants", self.max_grants as u64, 1, MAX_GRANTS),
            (
                "max consumers per poller",
                self.max_conns_per_poller as u64,
                1,
                MAX_CONNS_PER_POLLER,
            ),
            (
                "max handshakes",
                self.max_handshakes as u64,
                1,
                MAX_HANDSHAKES,
            ),
            (
                "chunk bytes",
                self.chunk_bytes as u64,
                1,
                proto::MAX_DATA_BYTES as u64,
            ),
            ("staging bytes", self.staging_bytes, 1, MAX_STAGING_BYTES),
        ];
        for (what, v, lo, hi) in ranges {
            if v < lo || v > hi {
                return bad(format!("{what} is {v}; it must be {lo} to {hi}"));
            }
        }
        if self.handshake_timeout.is_zero() || self.stall_timeout.is_zero() {
            return bad("the handshake and stall timeouts must be more than 0".into());
        }
        if self.idle_timeout < MIN_IDLE_TIMEOUT {
            return bad(format!(
                "the idle timeout is {} ms; it must be at least {} ms (three consumer keepalives)",
                self.idle_timeout.as_millis(),
                MIN_IDLE_TIMEOUT.as_millis()
            ));
        }
        Ok(())
    }

    /// Staging slots per poller (and so the most RDMA writes in flight per
    /// connection).
    fn slots(&self) -> usize {
        (self.staging_bytes / self.chunk_bytes as u64).max(1) as usize
    }
}

/// Most poller threads.
pub const MAX_POLLERS: u64 = 256;
/// Most grants one consumer may have outstanding (each queued grant costs
/// the node 32 bytes, reserved when the consumer connects).
pub const MAX_GRANTS: u64 = 1 << 20;
/// Most consumers per poller.
pub const MAX_CONNS_PER_POLLER: u64 = 4096;
/// Most handshakes pending at once (each holds a descriptor and a 1 KiB
/// buffer).
pub const MAX_HANDSHAKES: u64 = 4096;
/// Most staging memory per poller.
pub const MAX_STAGING_BYTES: u64 = 1 << 30;
/// Shortest idle timeout: three of the consumer's one-second keepalives.
pub const MIN_IDLE_TIMEOUT: Duration = Duration::from_secs(3);

/// Counters of a running service.
#[derive(Debug, Default)]
#[non_exhaustive]
pub struct ServeStats {
    /// Connections accepted past HELLO.
    pub connections: AtomicU64,
    /// Connections refused or closed before their handshake completed.
    pub refused: AtomicU64,
    /// Handshakes pending now.
    pub handshakes_pending: AtomicU64,
    /// Handshakes closed at their deadline.
    pub handshake_timeouts: AtomicU64,
    /// Pending handshakes closed to make room for newer connections.
    pub evicted: AtomicU64,
    /// `accept` failures for lack of descriptors or memory (each one backs
    /// the acceptor off).
    pub accept_errors: AtomicU64,
    /// Connections dropped for breaking the protocol.
    pub violations: AtomicU64,
    /// Samples pushed whole.
    pub samples: AtomicU64,
    /// Payload bytes pushed.
    pub bytes: AtomicU64,
    /// Grants answered with an ERROR frame.
    pub errors: AtomicU64,
    /// Consumers dropped for taking no data for `stall_timeout`.
    pub stalled: AtomicU64,
    /// RDMA queue pairs alive now (one per RDMA consumer, destroyed once
    /// its connection is closed and its last work request completed).
    pub rdma_qps: AtomicU64,
}

impl std::fmt::Debug for Common {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Common")
            .field("space", &self.cfg.space)
            .finish_non_exhaustive()
    }
}

/// The verbs resources of a node service: one device context and protection
/// domain; the staging slabs and (page-cache mode) the mapped extents are
/// registered in it, local access only.
#[cfg(feature = "rdma")]
struct OwnerRdma {
    opts: super::RdmaOptions,
    ctx: Arc<super::rdma::Context>,
    pd: Arc<super::rdma::Pd>,
    /// Page-cache mode: the mapped extents, registered read-only.
    map_mrs: Vec<super::rdma::Mr>,
    /// Per poller: the completion channel its connections' CQs wake, so
    /// a poller waiting for its writes sleeps instead of spinning.
    channels: Vec<Arc<super::rdma::CompChannel>>,
}

#[cfg(not(feature = "rdma"))]
struct OwnerRdma;

struct Common {
    space: Space,
    extents: Vec<std::fs::File>,
    /// With `page_cache`: the extents mapped read-only.
    maps: Vec<crate::sys::ReadOnlyMap>,
    cfg: ServeConfig,
    stop: AtomicBool,
    stats: ServeStats,
    rdma: Option<OwnerRdma>,
    /// Consumers per poller (reserved at HELLO by the acceptor, given back
    /// by the poller when the connection is gone).
    load: Box<[AtomicUsize]>,
    metrics: metrics::Metrics,
}

impl Common {
    /// Consumers connected (or being handed to a poller) now.
    fn consumers(&self) -> usize {
        self.load.iter().map(|l| l.load(Ordering::Relaxed)).sum()
    }

    /// Whether RDMA links may send from the mapped extents (registered).
    fn rdma_maps(&self) -> bool {
        #[cfg(feature = "rdma")]
        return self.rdma.as_ref().is_some_and(|r| !r.map_mrs.is_empty());
        #[cfg(not(feature = "rdma"))]
        false
    }
}

/// A running node service. Dropping it stops it.
pub struct NodeService {
    addr: SocketAddr,
    metrics_addr: Option<SocketAddr>,
    common: Arc<Common>,
    threads: Vec<JoinHandle<()>>,
    /// Held shared while serving: unload and preload --refresh refuse, naming this pid.
    _space_lock: crate::dataset::preload::SpaceLock,
}

impl NodeService {
    /// Opens the space, binds, and starts the acceptor and the pollers.
    pub fn start(cfg: ServeConfig) -> Result<NodeService> {
        cfg.validate()?;
        crate::sys::raise_open_files_limit();
        let space_lock = crate::dataset::preload::SpaceLock::shared(&cfg.space)?;
        let space = Space::open(&cfg.space)?;
        space.check_extents()?;
        let align = space.params().align_bytes;
        let chunk = cfg
            .chunk_bytes
            .clamp(align, proto::MAX_DATA_BYTES)
            .next_multiple_of(align);
        let mut cfg = cfg;
        cfg.chunk_bytes = chunk;
        if cfg.staging_bytes < chunk as u64 {
            return Err(Error::InvalidConfig(format!(
                "staging bytes {} hold no whole {chunk}-byte chunk (chunk bytes rounded up to the space's {align}-byte alignment)",
                cfg.staging_bytes
            )));
        }
        let mut extents = Vec::new();
        let mut warned = false;
        for i in 0..space.extent_lens().len() as u32 {
            let path = space.extent_path(i);
            let (f, direct) =
                crate::sys::open_direct(&path).map_err(|e| Error::io("open", &path, e))?;
            if !direct && !cfg.page_cache && !std::mem::replace(&mut warned, true) {
                // Not silent: every read then goes through the page cache.
                log::warn!(
                    "{}: the file system refuses O_DIRECT; the node service reads through the page cache",
                    path.display()
                );
            }
            extents.push(f);
        }
        let mut maps = Vec::new();
        if cfg.page_cache {
            for i in 0..space.extent_lens().len() as u32 {
                let path = space.extent_path(i);
                let f = std::fs::File::open(&path).map_err(|e| Error::io("open", &path, e))?;
                maps.push(
                    crate::sys::ReadOnlyMap::new(&f).map_err(|e| Error::io("mmap", &path, e))?,
                );
            }
        }
        let rdma = match &cfg.rdma {
            None => None,
            Some(opts) => Some(open_owner_rdma(opts, &maps, cfg.pollers)?),
        };
        let listener = TcpListener::bind(&cfg.listen)
            .map_err(|e| Error::Serve(format!("cannot listen on {}: {e}", cfg.listen)))?;
        let addr = listener
            .local_addr()
            .map_err(|e| Error::Serve(format!("local address: {e}")))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| Error::Serve(format!("listener: {e}")))?;
        let common = Arc::new(Common {
            space,
            extents,
            maps,
            stop: AtomicBool::new(false),
            stats: ServeStats::default(),
            rdma,
            load: (0..cfg.pollers).map(|_| AtomicUsize::new(0)).collect(),
            metrics: metrics::Metrics::new(cfg.pollers, cfg.slots() as u64),
            cfg,
        });
        let metrics_server = match &common.cfg.metrics {
            None => None,
            Some(a) => Some(
                tiny_http::Server::http(a.as_str())
                    .map_err(|e| Error::Serve(format!("cannot serve metrics on {a}: {e}")))?,
            ),
        };
        let metrics_addr = metrics_server
            .as_ref()
            .and_then(|s| s.server_addr().to_ip());
        // Everything that can fail is made before the first thread starts;
        // should spawning fail anyway, the threads already running are
        // stopped and joined (none is left behind).
        let mut parts = Vec::with_capacity(common.cfg.pollers);
        for _ in 0..common.cfg.pollers {
            let ring = Uring::new(UringOptions {
                entries: 1024,
                sqpoll_idle_ms: None,
            })?;
            let fds: Vec<i32> = common.extents.iter().map(|f| f.as_raw_fd()).collect();
            if !fds.is_empty() {
                ring.register_files(&fds)?;
            }
            parts.push((ring, Staging::new(&common)?));
        }
        let mut svc = NodeService {
            addr,
            metrics_addr,
            common: common.clone(),
            threads: Vec::new(),
            _space_lock: space_lock,
        };
        let mut senders = Vec::new();
        for (i, (ring, staging)) in parts.into_iter().enumerate() {
            let (tx, rx) = crossbeam_channel::bounded::<Accepted>(64);
            senders.push(tx);
            let c = common.clone();
            let t = std::thread::Builder::new()
                .name(format!("kspeed-serve-{i}"))
                .spawn(move || ServePoller::new(c, i, ring, staging, rx).run())
                .map_err(|e| Error::Serve(format!("spawn poller {i}: {e}")))?;
            svc.threads.push(t);
        }
        let c = common.clone();
        let t = std::thread::Builder::new()
            .name("kspeed-accept".into())
            .spawn(move || accept::Acceptor::new(c, listener, senders).run())
            .map_err(|e| Error::Serve(format!("spawn acceptor: {e}")))?;
        svc.threads.push(t);
        if let Some(server) = metrics_server {
            let c = common.clone();
            let t = std::thread::Builder::new()
                .name("kspeed-metrics".into())
                .spawn(move || metrics::serve_http(c, server))
                .map_err(|e| Error::Serve(format!("spawn metrics server: {e}")))?;
            svc.threads.push(t);
        }
        log::info!(
            "serving {} ({} of {} samples, node {} of {}) on {addr}",
            common.cfg.space.display(),
            common.space.held_samples(),
            common.space.catalog().len(),
            common.space.params().node_index,
            common.space.params().placement.nodes
        );
        Ok(svc)
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Counters.
    pub fn stats(&self) -> &ServeStats {
        &self.common.stats
    }

    /// Where the Prometheus metrics are served, with `metrics` set.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics_addr
    }

    /// The metrics as Prometheus text (what `GET /metrics` returns).
    pub fn metrics_text(&self) -> String {
        metrics::render(&self.common)
    }

    /// Logs the statistics (what SIGUSR1 does to `kspeed serve`).
    pub fn log_stats(&self, why: &str) {
        metrics::log_stats(&self.common, why)
    }

    /// Stops accepting, closes every connection, and waits for the threads.
    pub fn stop(mut self) {
        self.shutdown();
    }

    /// [`NodeService::stop`], then logs the totals.
    pub fn stop_with_stats(mut self) {
        self.shutdown();
        self.log_stats("exit");
    }

    fn shutdown(&mut self) {
        self.common.stop.store(true, Ordering::Release);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

impl Drop for NodeService {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Runs `start` with SIGINT and SIGTERM blocked (so every service thread
/// inherits the mask), then waits for one of them and stops the service:
/// what `kspeed serve` does. `on_start` sees the running service (to print
/// its address).
pub fn serve_until_signal(cfg: ServeConfig, on_start: impl FnOnce(&NodeService)) -> Result<()> {
    let signals = crate::sys::TermSignals::block_with_usr1();
    let svc = NodeService::start(cfg)?;
    on_start(&svc);
    loop {
        let sig = signals.wait();
        if sig == libc::SIGUSR1 {
            svc.log_stats("SIGUSR1");
            continue;
        }
        log::info!("signal {sig}: stopping");
        break;
    }
    svc.stop_with_stats();
    Ok(())
}

#[cfg(feature = "rdma")]
fn open_owner_rdma(
    opts: &super::RdmaOptions,
    maps: &[crate::sys::ReadOnlyMap],
    pollers: usize,
) -> Result<OwnerRdma> {
    use super::rdma::{Access, CompChannel, Context, Mr, Pd};
    let ctx = Context::open(opts.device.as_deref(), opts.port, opts.gid_index)?;
    let pd = Pd::new(&ctx)?;
    let mut map_mrs = Vec::with_capacity(maps.len());
    for m in maps {
        let b = m.as_slice();
        if b.is_empty() {
            continue;
        }
        // SAFETY: the mapping lives in Common, which outlives every link
        // (pollers hold an Arc of it); the NIC only reads it.
        match unsafe { Mr::register(&pd, b.as_ptr() as *mut u8, b.len(), Access::ReadOnly) } {
            Ok(mr) => map_mrs.push(mr),
            Err(e) => {
                // Some drivers (soft-RoCE among them) refuse to pin a
                // read-only file mapping. RDMA consumers then get their
                // samples through staging (O_DIRECT reads); TCP ones still
                // from the page cache.
                log::warn!(
                    "page-cache mode: the mapped extents cannot be registered for RDMA ({e}); \
                     RDMA consumers are served through staging"
                );
                map_mrs.clear();
                break;
            }
        }
    }
    log::info!(
        "RDMA transport on {} port {} (GID index {})",
        ctx.name(),
        opts.port,
        opts.gid_index.map_or(
            "per connection: the RoCE v2 GID of its address".to_string(),
            |i| i.to_string()
        )
    );
    let channels = (0..pollers)
        .map(|_| CompChannel::new(&ctx))
        .collect::<Result<Vec<_>>>()?;
    Ok(OwnerRdma {
        opts: opts.clone(),
        ctx,
        pd,
        map_mrs,
        channels,
    })
}

#[cfg(not(feature = "rdma"))]
fn open_owner_rdma(
    _: &super::RdmaOptions,
    _: &[crate::sys::ReadOnlyMap],
    _: usize,
) -> Result<OwnerRdma> {
    Err(Error::InvalidConfig(
        "this kspeed was built without the `rdma` feature: no RDMA transport".into(),
    ))
}

/// A poller's staging slab, registered for RDMA when the service offers it.
struct Staging {
    buf: AlignedBuf,
    #[cfg(feature = "rdma")]
    regions: super::rdma::SendRegions,
    #[cfg(feature = "rdma")]
    _mr: Option<super::rdma::Mr>,
}

impl Staging {
    fn new(c: &Common) -> Result<Staging> {
        let n = c.cfg.slots();
        let buf = AlignedBuf::new(n * c.cfg.chunk_bytes as usize, 4096);
        #[cfg(feature = "rdma")]
        {
            let mut st = Staging {
                buf,
                regions: Default::default(),
                _mr: None,
            };
            if let Some(r) = &c.rdma {
                let p = st.buf.as_mut_ptr();
                // SAFETY: the slab lives in the poller, which drops every
                // link (QP) before the slab; the NIC only reads it.
                let mr = unsafe {
                    super::rdma::Mr::register(&r.pd, p, st.buf.len(), super::rdma::Access::ReadOnly)
                }?;
                let mut all: Vec<&super::rdma::Mr> = r.map_mrs.iter().collect();
                all.push(&mr);
                st.regions = super::rdma::SendRegions::new(&all);
                st._mr = Some(mr);
            }
            Ok(st)
        }
        #[cfg(not(feature = "rdma"))]
        Ok(Staging { buf })
    }
}

/// The owner's end of an RDMA connection, set up during the handshake.
#[cfg(feature = "rdma")]
struct RdmaAccepted {
    qp: super::rdma::Qp,
    cq: Arc<super::rdma::Cq>,
}

struct Accepted {
    sock: TcpStream,
    peer: SocketAddr,
    hello: Hello,
    #[cfg(feature = "rdma")]
    rdma: Option<RdmaAccepted>,
}

/// Sends an ERROR frame, best effort and never blocking: the peer may be
/// gone or not reading, and the caller (the acceptor, a data-path poller)
/// must not wait on it. What the socket buffer does not take is dropped;
/// the connection is closed right after either way.
fn send_error(sock: &TcpStream, grant: u32, code: Code, msg: &str) {
    let m = &msg.as_bytes()[..msg.len().min(proto::MAX_MESSAGE_BYTES)];
    let mut f = [0u8; proto::HEADER_BYTES + proto::MAX_MESSAGE_BYTES];
    f[..proto::HEADER_BYTES].copy_from_slice(&Header::error(grant, code, m.len() as u32).encode());
    f[proto::HEADER_BYTES..proto::HEADER_BYTES + m.len()].copy_from_slice(m);
    let _ = crate::sys::send_nonblocking(sock.as_raw_fd(), &f[..proto::HEADER_BYTES + m.len()]);
}

/// After WELCOME on an RDMA connection, with the consumer's RDMA_ENDPOINT
/// frame (`hb`, `body`) read by the acceptor: creates and connects this
/// end's queue pair (on the GID of the address the consumer reached, unless
/// one is configured), and answers with it (40 bytes into a socket that has
/// sent only WELCOME: the send buffer takes them whole without blocking).
#[cfg(feature = "rdma")]
fn rdma_handshake(
    c: &Common,
    sock: &mut TcpStream,
    hb: &[u8; proto::HEADER_BYTES],
    body: &[u8],
    poller: usize,
) -> Result<RdmaAccepted, (Code, String)> {
    use super::rdma::{Cq, Qp, RDMA_ERROR_BYTES};
    use std::io::Write;
    let r = c.rdma.as_ref().expect("checked by the caller");
    let violation = |m: String| (Code::Violation, m);
    let failed = |e: Error| (Code::TransportFailed, format!("node RDMA setup: {e}"));
    let h = Header::decode(hb, 0).map_err(|e| violation(e.to_string()))?;
    if h.kind != Kind::RdmaEndpoint {
        return Err(violation(format!(
            "expected RDMA_ENDPOINT, got {:?}",
            h.kind
        )));
    }
    let theirs = proto::RdmaEndpoint::decode(&h, body).map_err(|e| violation(e.to_string()))?;
    let max_wr = c.cfg.slots().clamp(16, 4096) as u32;
    let cq = Cq::with_channel(&r.ctx, max_wr as i32 + 16, &r.channels[poller]).map_err(failed)?;
    let mut qp = Qp::new(&r.pd, &cq, &cq, max_wr, (4 + RDMA_ERROR_BYTES) as u32).map_err(failed)?;
    let ip = sock
        .local_addr()
        .map_err(|e| failed(Error::Serve(format!("local address: {e}"))))?
        .ip();
    let (index, gid) = r.ctx.choose_gid(r.opts.gid_index, ip).map_err(failed)?;
    qp.use_gid(index, gid);
    qp.connect(&theirs).map_err(failed)?;
    sock.write_all(&qp.endpoint().encode())
        .map_err(|e| violation(format!("sending RDMA_ENDPOINT: {e}")))?;
    c.stats.rdma_qps.fetch_add(1, Ordering::Relaxed);
    Ok(RdmaAccepted { qp, cq })
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

// user_data: kind in the top byte, connection index, slot index.
const UD_RECV: u64 = 1 << 56;
const UD_SEND: u64 = 2 << 56;
const UD_READ: u64 = 3 << 56;
const UD_CHAN: u64 = 4 << 56;
const UD_KIND: u64 = 0xff << 56;

fn ud(kind: u64, conn: u32, slot: u32) -> u64 {
    kind | ((conn as u64) << 32) | slot as u64
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Rx {
    Header,
    Body(Header),
}

/// A granted sample being pushed: the next chunk's offset within it.
#[derive(Clone, Copy)]
struct Work {
    e: GrantEntry,
    next: u64,
}

/// A connection's send side: DATA frames on its socket, or RDMA writes on
/// its queue pair.
enum ConnLink {
    Tcp(TcpLink),
    #[cfg(feature = "rdma")]
    Rdma(Box<super::rdma::RdmaLink>),
}

impl ConnLink {
    /// # Safety
    /// As for [`Link::post_write`].
    unsafe fn post_write(
        &mut self,
        id: u64,
        src: *const u8,
        len: u32,
        off: u64,
        g: u32,
        rkey: u32,
    ) -> bool {
        // SAFETY: forwarded contract.
        unsafe {
            match self {
                ConnLink::Tcp(l) => l.post_write(id, src, len, off, g, rkey),
                #[cfg(feature = "rdma")]
                ConnLink::Rdma(l) => l.post_write(id, src, len, off, g, rkey),
            }
        }
    }

    /// # Safety
    /// As for [`Link::post_error`].
    unsafe fn post_error(&mut self, id: u64, g: u32, code: Code, msg: *const u8, len: u32) -> bool {
        // SAFETY: forwarded contract.
        unsafe {
            match self {
                ConnLink::Tcp(l) => l.post_error(id, g, code, msg, len),
                #[cfg(feature = "rdma")]
                ConnLink::Rdma(l) => l.post_error(id, g, code, msg, len),
            }
        }
    }

    fn flush(&mut self, ring: &mut Uring) -> std::io::Result<()> {
        match self {
            ConnLink::Tcp(l) => l.flush(ring),
            #[cfg(feature = "rdma")]
            ConnLink::Rdma(l) => l.flush(&mut ()),
        }
    }

    fn poll(&mut self, out: &mut [Done]) -> usize {
        match self {
            ConnLink::Tcp(l) => l.poll(out),
            #[cfg(feature = "rdma")]
            ConnLink::Rdma(l) => l.poll(out),
        }
    }

    fn busy(&self) -> bool {
        match self {
            ConnLink::Tcp(l) => l.busy(),
            #[cfg(feature = "rdma")]
            ConnLink::Rdma(l) => l.busy(),
        }
    }

    fn close(&mut self) {
        match self {
            ConnLink::Tcp(l) => l.close(),
            #[cfg(feature = "rdma")]
            ConnLink::Rdma(l) => l.close(),
        }
    }

    fn is_rdma(&self) -> bool {
        !matches!(self, ConnLink::Tcp(_))
    }

    /// RDMA: arms the CQ (see [`super::rdma::RdmaLink::arm`]).
    fn arm(&self) -> std::result::Result<(), String> {
        match self {
            ConnLink::Tcp(_) => Ok(()),
            #[cfg(feature = "rdma")]
            ConnLink::Rdma(l) => l.arm().map_err(|e| e.to_string()),
        }
    }

    /// Why an RDMA link broke (a failed completion), if it did.
    fn failure(&self) -> Option<String> {
        match self {
            ConnLink::Tcp(_) => None,
            #[cfg(feature = "rdma")]
            ConnLink::Rdma(l) => l.error().map(|e| e.to_string()),
        }
    }
}

struct SConn {
    sock: TcpStream,
    peer: SocketAddr,
    hello: Hello,
    hdr: Box<[u8; proto::HEADER_BYTES]>,
    body: Box<[u8]>,
    rx: Rx,
    rx_inflight: bool,
    grants: VecDeque<Work>,
    /// Staging slots in send order.
    sendq: VecDeque<u32>,
    /// The send side: frames posted in order, one `sendmsg` in flight; or
    /// RDMA writes in chains.
    link: ConnLink,
    ops: u32,
    closing: bool,
    /// The last grant answered with ERROR: its later chunks are dropped.
    failed_grant: Option<u32>,
    /// Staging slots it holds (reading, queued, posted or being sent).
    held: u32,
    /// Last time its link finished a frame (socket bytes taken, RDMA writes
    /// completed) or became busy: a consumer whose sends make no progress
    /// for `stall_timeout` is dropped.
    last_drained: std::time::Instant,
    /// Its counters (also in `Common::metrics` while it lives).
    metrics: Arc<metrics::ConnMetrics>,
    /// When it last sent a frame (idle timeout).
    last_rx: std::time::Instant,
}

struct Slot {
    conn: u32,
    grant: u32,
    /// Ring offset of the payload's first byte (DATA).
    offset: u64,
    /// The grant's remote key (RDMA).
    rkey: u32,
    /// ERROR frames: the code.
    code: Code,
    payload: u32,
    /// The chunk that completes its sample.
    last: bool,
    /// Where the payload is sent from: null for the slot's staging memory,
    /// else a place in a mapped extent (page-cache mode).
    src: *const u8,
    ready: bool,
    error: bool,
    /// When its read was submitted (read-latency histogram).
    issued: std::time::Instant,
}

/// Takes the free slot on top for connection `ci` (a function of the two
/// fields, so callers may hold other borrows of the poller).
fn take_slot(free_slots: &mut Vec<u32>, conns: &mut [Option<SConn>], ci: u32) {
    free_slots.pop();
    if let Some(c) = conns[ci as usize].as_mut() {
        c.held += 1;
        c.metrics
            .staging_slots
            .store(c.held as u64, Ordering::Relaxed);
    }
}

struct ServePoller {
    c: Arc<Common>,
    ring: Uring,
    incoming: Receiver<Accepted>,
    conns: Vec<Option<SConn>>,
    /// After `conns`: links (queue pairs) go before the memory they send from.
    staging: Staging,
    fixed_staging: bool,
    chunk: u64,
    slots: Box<[Slot]>,
    free_slots: Vec<u32>,
    completions: Vec<Completion>,
    /// Round-robin start for reads, so one busy consumer cannot starve others.
    rr: usize,
    /// Indices of the occupied `conns` entries (a reaped one leaves at the
    /// next tick's start): every per-tick loop walks this, not every slot.
    live: Vec<u32>,
    /// Free `conns` indices.
    free_ci: Vec<u32>,
    /// Staging slots one connection may hold now (fair share).
    quota: usize,
    /// When the stalled-consumer check last ran.
    last_stall_check: std::time::Instant,
    /// This poller's number (its entry in `Common::load`).
    index: usize,
    /// RDMA: this poller's completion channel, whether a poll of it is in
    /// the ring, and since when the poller has spun without a completion.
    #[cfg(feature = "rdma")]
    channel: Option<Arc<super::rdma::CompChannel>>,
    chan_inflight: bool,
    spin_since: Option<std::time::Instant>,
}

impl ServePoller {
    fn new(
        c: Arc<Common>,
        index: usize,
        ring: Uring,
        staging: Staging,
        incoming: Receiver<Accepted>,
    ) -> Self {
        let chunk = c.cfg.chunk_bytes as u64;
        let n = c.cfg.slots();
        // SAFETY: the staging slab lives in this struct, dropped after the
        // ring is done with it (run() drains every op before returning).
        let fixed_staging = match unsafe {
            ring.register_buffers(&[(staging.buf.as_mut_ptr(), staging.buf.len())])
        } {
            Ok(()) => true,
            Err(e) => {
                // Not silent: reads then pin their pages one by one.
                log::warn!(
                    "node service poller {index}: staging cannot be registered with io_uring \
                         ({e}); reading without fixed buffers (raise RLIMIT_MEMLOCK: each poller \
                         pins --staging-bytes)"
                );
                false
            }
        };
        let slots = (0..n)
            .map(|_| Slot {
                conn: 0,
                grant: 0,
                offset: 0,
                rkey: 0,
                code: Code::Unknown,
                payload: 0,
                last: false,
                src: std::ptr::null(),
                ready: false,
                error: false,
                issued: std::time::Instant::now(),
            })
            .collect();
        let conns = (0..c.cfg.max_conns_per_poller).map(|_| None).collect();
        ServePoller {
            ring,
            incoming,
            staging,
            fixed_staging,
            chunk,
            slots,
            free_slots: (0..n as u32).rev().collect(),
            conns,
            completions: vec![Completion::default(); 1024],
            rr: 0,
            live: Vec::with_capacity(c.cfg.max_conns_per_poller),
            free_ci: (0..c.cfg.max_conns_per_poller as u32).rev().collect(),
            quota: n,
            last_stall_check: std::time::Instant::now(),
            index,
            #[cfg(feature = "rdma")]
            channel: c.rdma.as_ref().map(|r| r.channels[index].clone()),
            chan_inflight: false,
            spin_since: None,
            c,
        }
    }

    /// The descriptor of this poller's RDMA completion channel, when the
    /// service offers RDMA.
    fn channel_fd(&self) -> Option<i32> {
        #[cfg(feature = "rdma")]
        return self.channel.as_ref().map(|ch| ch.fd());
        #[cfg(not(feature = "rdma"))]
        None
    }

    fn staging_ptr(&self, slot: u32) -> *mut u8 {
        // SAFETY: slot < n, so the offset is inside the slab.
        unsafe {
            self.staging
                .buf
                .as_mut_ptr()
                .add(slot as usize * self.chunk as usize)
        }
    }

    fn run(mut self) {
        loop {
            // Drop the reaped from the dense list before anyone is adopted
            // (a reaped index may be reused right after).
            let conns = &self.conns;
            self.live.retain(|&ci| conns[ci as usize].is_some());
            let stopping = self.c.stop.load(Ordering::Acquire);
            if stopping {
                for k in 0..self.live.len() {
                    let ci = self.live[k] as usize;
                    if self.conns[ci].as_ref().is_some_and(|c| !c.closing) {
                        self.close(ci as u32, None);
                    }
                }
                if self
                    .live
                    .iter()
                    .all(|&ci| self.conns[ci as usize].is_none())
                {
                    break;
                }
            } else {
                while let Ok(acc) = self.incoming.try_recv() {
                    self.adopt(acc);
                }
            }
            self.post_recvs();
            self.drop_stalled();
            self.issue_reads();
            // Start the reads before posting sends: posting RDMA writes can
            // take a while (soft-RoCE does the whole transfer inside the
            // post), and the disk should be busy meanwhile.
            if let Err(e) = self.ring.submit_pending() {
                log::warn!("node service poller: io_uring: {e}");
            }
            self.issue_sends();
            // RDMA completions arrive on the links' CQs, not the ring: while
            // writes are in flight, poll instead of sleeping.
            // (Polling without a system call: io_uring completions are
            // read from the shared ring either way.)
            let res = if self.rdma_should_spin() {
                self.ring.submit_pending()
            } else {
                self.ring.submit_wait_timeout(Duration::from_millis(50))
            };
            if let Err(e) = res {
                log::error!("node service poller: io_uring: {e}");
                std::thread::sleep(Duration::from_millis(10));
            }
            let n = self.ring.drain(&mut self.completions);
            for i in 0..n {
                let c = self.completions[i];
                self.complete(c);
            }
        }
    }

    fn adopt(&mut self, acc: Accepted) {
        let Some(ci) = self.free_ci.pop().map(|i| i as usize) else {
            // Not reached: the acceptor reserved a place on this poller at
            // HELLO (`Common::load`); kept as a refusal, not a panic.
            self.c.load[self.index].fetch_sub(1, Ordering::Relaxed);
            #[cfg(feature = "rdma")]
            if acc.rdma.is_some() {
                self.c.stats.rdma_qps.fetch_sub(1, Ordering::Relaxed);
            }
            send_error(
                &acc.sock,
                proto::CONNECTION,
                Code::NodeFull,
                "this poller serves as many consumers as it was configured for",
            );
            return;
        };
        let max = self.c.cfg.max_grants as usize;
        let fd = acc.sock.as_raw_fd();
        let link = ConnLink::Tcp(TcpLink::new(
            fd,
            self.slots.len(),
            ud(UD_SEND, ci as u32, 0),
        ));
        #[cfg(feature = "rdma")]
        let link = match acc.rdma {
            Some(r) => ConnLink::Rdma(Box::new(super::rdma::RdmaLink::new(
                r.qp,
                r.cq,
                self.staging.regions.clone(),
                acc.hello.ring_addr,
                self.c.cfg.slots().clamp(16, 4096),
            ))),
            None => link,
        };
        let m = Arc::new(metrics::ConnMetrics::new(
            acc.peer.to_string(),
            acc.hello.rank,
            acc.hello.world,
            if link.is_rdma() { "rdma" } else { "tcp" },
        ));
        self.c.metrics.add(m.clone());
        self.live.push(ci as u32);
        self.conns[ci] = Some(SConn {
            sock: acc.sock,
            peer: acc.peer,
            hello: acc.hello,
            hdr: Box::new([0; proto::HEADER_BYTES]),
            body: vec![0u8; proto::MAX_GRANT_ENTRIES * proto::GRANT_ENTRY_BYTES].into_boxed_slice(),
            rx: Rx::Header,
            rx_inflight: false,
            grants: VecDeque::with_capacity(max),
            sendq: VecDeque::with_capacity(self.slots.len()),
            link,
            ops: 0,
            closing: false,
            failed_grant: None,
            held: 0,
            last_drained: std::time::Instant::now(),
            metrics: m,
            last_rx: std::time::Instant::now(),
        });
    }

    fn post_recvs(&mut self) {
        for k in 0..self.live.len() {
            let ci = self.live[k] as usize;
            let Some(c) = self.conns[ci].as_mut() else {
                continue;
            };
            if c.closing || c.rx_inflight {
                continue;
            }
            let (buf, len) = match c.rx {
                Rx::Header => (c.hdr.as_mut_ptr(), proto::HEADER_BYTES as u32),
                Rx::Body(h) => (c.body.as_mut_ptr(), h.body_len),
            };
            let fd = c.sock.as_raw_fd();
            // SAFETY: hdr/body are boxed in the connection, which is kept
            // until its last op completes (ops counter).
            if unsafe { self.ring.push_recv(ud(UD_RECV, ci as u32, 0), fd, buf, len) } {
                c.rx_inflight = true;
                c.ops += 1;
            }
        }
    }

    fn issue_reads(&mut self) {
        // Fair shares among the connections with work (grants queued or
        // slots held), rounded up; and never more than 3/4 of the slots, so
        // a consumer that arrives while another has stopped reading still
        // finds some (slots held in a send cannot be taken back).
        let busy = self
            .live
            .iter()
            .filter_map(|&ci| self.conns[ci as usize].as_ref())
            .filter(|c| !c.closing && (c.held > 0 || !c.grants.is_empty()))
            .count()
            .max(1);
        let n = self.slots.len();
        self.quota = n.div_ceil(busy).min(n - n / 4).max(1);
        let n = self.live.len();
        let mut idle_rounds = 0;
        while !self.free_slots.is_empty() && idle_rounds < n {
            let ci = self.live[self.rr % n];
            self.rr = self.rr.wrapping_add(1);
            let progressed = self.issue_one(ci);
            idle_rounds = if progressed { 0 } else { idle_rounds + 1 };
        }
    }

    /// Starts the next chunk of connection `ci`'s oldest grant.
    fn issue_one(&mut self, ci: u32) -> bool {
        let Some(c) = self.conns[ci as usize].as_mut() else {
            return false;
        };
        // Its share of staging: a consumer that does not drain keeps at
        // most this many slots (read, queued or being sent), the rest stay
        // with the others.
        if c.closing || c.held as usize >= self.quota {
            return false;
        }
        let Some(w) = c.grants.front().copied() else {
            return false;
        };
        let Some(&slot) = self.free_slots.last() else {
            return false;
        };
        let e = w.e;
        let space = &self.c.space;
        let loc = space.location(e.sample);
        let s = &mut self.slots[slot as usize];
        s.conn = ci;
        s.grant = e.grant;
        s.ready = false;
        s.error = false;
        s.src = std::ptr::null();
        let Some(loc) = loc else {
            // Not held here: an ERROR frame for this grant.
            c.grants.pop_front();
            take_slot(&mut self.free_slots, &mut self.conns, ci);
            let msg = format!(
                "node {} does not hold sample {}",
                space.params().node_index,
                e.sample
            );
            self.fill_error(slot, e.grant, Code::NotHeld, &msg);
            let c = self.conns[ci as usize].as_mut().expect("live");
            c.sendq.push_back(slot);
            return true;
        };
        let align = space.params().align_bytes as u64;
        let slot_len = (e.len as u64).next_multiple_of(align);
        let off = w.next;
        let payload = self.chunk.min(e.len as u64 - off) as u32;
        let read_len = self.chunk.min(slot_len - off) as u32;
        let from_maps = !c.link.is_rdma() || self.c.rdma_maps();
        if let Some(map) = self.c.maps.get(loc.extent as usize).filter(|_| from_maps) {
            // Page-cache mode: no read; the frame points into the mapping.
            let bytes = map.as_slice();
            let at = (loc.offset + off) as usize;
            if at + payload as usize > bytes.len() {
                take_slot(&mut self.free_slots, &mut self.conns, ci);
                let msg = format!(
                    "node {}: extent {} is shorter than its manifest says (sample {})",
                    space.params().node_index,
                    loc.extent,
                    e.sample
                );
                let c = self.conns[ci as usize].as_mut().expect("live");
                c.grants.pop_front();
                self.fill_error(slot, e.grant, Code::ReadFailed, &msg);
                self.conns[ci as usize]
                    .as_mut()
                    .expect("live")
                    .sendq
                    .push_back(slot);
                return true;
            }
            take_slot(&mut self.free_slots, &mut self.conns, ci);
            self.queue_chunk(ci, slot, &e, off, payload, Some(bytes[at..].as_ptr()));
            return true;
        }
        let op = ReadOp {
            user_data: ud(UD_READ, ci, slot),
            target: Target::Fixed(loc.extent),
            buf: self.staging_ptr(slot),
            len: read_len,
            offset: loc.offset + off,
            buf_index: self.fixed_staging.then_some(0),
        };
        // SAFETY: the staging slot is ours (taken from the free list below)
        // until its send completes.
        if !unsafe { self.ring.push(&op) } {
            return false;
        }
        self.slots[slot as usize].issued = std::time::Instant::now();
        take_slot(&mut self.free_slots, &mut self.conns, ci);
        self.conns[ci as usize].as_mut().expect("live").ops += 1;
        self.queue_chunk(ci, slot, &e, off, payload, None);
        true
    }

    /// Drops the consumers whose link finished nothing for `stall_timeout`
    /// while a send was in flight (over TCP a socket that takes no bytes;
    /// over RDMA writes that do not complete, e.g. a stopped consumer that
    /// reposts no receives for its WRITE_WITH_IMMs): their staging slots go
    /// back to the others. Until then their fair share bounds what they
    /// hold.
    fn drop_stalled(&mut self) {
        let now = std::time::Instant::now();
        if now.duration_since(self.last_stall_check) < Duration::from_millis(100) {
            return;
        }
        self.last_stall_check = now;
        let limit = self.c.cfg.stall_timeout;
        for k in 0..self.live.len() {
            let ci = self.live[k] as usize;
            let Some(c) = self.conns[ci].as_ref() else {
                continue;
            };
            if c.closing {
                continue;
            }
            let idle = self.c.cfg.idle_timeout;
            if !c.link.busy() {
                if c.grants.is_empty() && c.held == 0 && now.duration_since(c.last_rx) > idle {
                    let m = format!(
                        "idle: no frame for {} ms with nothing to send (--idle-timeout-ms)",
                        idle.as_millis()
                    );
                    self.close(ci as u32, Some((Code::ShuttingDown, m)));
                }
                continue;
            }
            if now.duration_since(c.last_drained) > limit {
                let m = format!(
                    "took no data for {} ms with {} staging slots held (--stall-timeout-ms)",
                    limit.as_millis(),
                    c.held
                );
                self.c.stats.stalled.fetch_add(1, Ordering::Relaxed);
                self.close(ci as u32, Some((Code::Violation, m)));
            }
        }
    }

    /// Gives a slot back (its connection holds one less).
    fn free_slot(&mut self, slot: u32) {
        let ci = self.slots[slot as usize].conn as usize;
        if let Some(c) = self.conns[ci].as_mut() {
            c.held = c.held.saturating_sub(1);
            c.metrics
                .staging_slots
                .store(c.held as u64, Ordering::Relaxed);
        }
        self.free_slots.push(slot);
    }

    /// Describes chunk `off..off+payload` of grant `e` in `slot` (sent from
    /// `src` when the bytes are already there, else from the slot's staging
    /// once its read completes), queues it for sending in order, and moves
    /// the grant on.
    fn queue_chunk(
        &mut self,
        ci: u32,
        slot: u32,
        e: &GrantEntry,
        off: u64,
        payload: u32,
        src: Option<*const u8>,
    ) {
        let s = &mut self.slots[slot as usize];
        s.offset = e.offset + off;
        s.rkey = e.rkey;
        s.payload = payload;
        s.last = off + payload as u64 >= e.len as u64;
        s.src = src.unwrap_or(std::ptr::null());
        s.ready = src.is_some();
        let c = self.conns[ci as usize].as_mut().expect("live");
        c.sendq.push_back(slot);
        let front = c.grants.front_mut().expect("non-empty");
        front.next += payload as u64;
        if front.next >= e.len as u64 {
            c.grants.pop_front();
        }
    }

    fn fill_error(&mut self, slot: u32, grant: u32, code: Code, msg: &str) {
        let m = &msg.as_bytes()[..msg.len().min(proto::MAX_MESSAGE_BYTES)];
        let dst = self.staging_ptr(slot);
        let n = m.len().min(self.chunk as usize);
        // SAFETY: the slot is ours and at least `chunk` bytes; n <= chunk.
        unsafe { std::ptr::copy_nonoverlapping(m.as_ptr(), dst, n) };
        let s = &mut self.slots[slot as usize];
        s.code = code;
        s.payload = n as u32;
        s.grant = grant;
        s.error = true;
        s.ready = true;
        s.src = std::ptr::null();
        let ci = s.conn as usize;
        self.c.stats.errors.fetch_add(1, Ordering::Relaxed);
        if let Some(c) = self.conns[ci].as_ref() {
            c.metrics.errors.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Per connection: posts the ready frames at the front of its queue, in
    /// order, to its link, then flushes the link (one `sendmsg` for many).
    fn issue_sends(&mut self) {
        let base = self.staging.buf.as_slice().as_ptr();
        for k in 0..self.live.len() {
            let ci = self.live[k] as usize;
            let Some(c) = self.conns[ci].as_mut() else {
                continue;
            };
            if c.closing {
                continue;
            }
            while let Some(&slot) = c.sendq.front() {
                let s = &self.slots[slot as usize];
                if !s.ready {
                    break;
                }
                if c.failed_grant == Some(s.grant) {
                    // A later chunk of a grant already answered with ERROR:
                    // its data, or its own read error, is not sent (one
                    // ERROR per grant; a second would be a protocol
                    // violation for the consumer).
                    c.sendq.pop_front();
                    c.held -= 1;
                    self.free_slots.push(slot);
                    continue;
                }
                let src = if s.src.is_null() {
                    base.wrapping_add(slot as usize * self.chunk as usize)
                } else {
                    s.src
                };
                // SAFETY: the slot's bytes (staging or mapped extent) stay
                // untouched until the link reports this wr_id done.
                let posted = unsafe {
                    if s.error {
                        c.link
                            .post_error(slot as u64, s.grant, s.code, src, s.payload)
                    } else {
                        c.link
                            .post_write(slot as u64, src, s.payload, s.offset, s.grant, s.rkey)
                    }
                };
                if !posted {
                    break;
                }
                if s.error {
                    c.failed_grant = Some(s.grant);
                }
                c.sendq.pop_front();
            }
            let was_busy = c.link.busy();
            if let Err(e) = c.link.flush(&mut self.ring) {
                if c.link.is_rdma() {
                    let m = format!("posting RDMA writes: {e}");
                    self.close(ci as u32, Some((Code::TransportFailed, m)));
                    continue;
                }
                return; // submission queue full: next tick
            }
            if !was_busy && c.link.busy() {
                c.last_drained = std::time::Instant::now();
                // A TCP link's sendmsg in flight is an op of the ring.
                if !c.link.is_rdma() {
                    c.ops += 1;
                }
            }
        }
    }

    /// Frees the slots whose frames the link finished.
    fn reap_link(&mut self, ci: u32) {
        let mut done = [Done::default(); 32];
        loop {
            let Some(c) = self.conns[ci as usize].as_mut() else {
                return;
            };
            let n = c.link.poll(&mut done);
            if n == 0 {
                return;
            }
            let (mut bytes, mut samples) = (0, 0);
            for d in &done[..n] {
                let s = &self.slots[d.wr_id as usize];
                if d.ok && !s.error {
                    bytes += s.payload as u64;
                    samples += s.last as u64;
                }
                self.free_slot(d.wr_id as u32);
            }
            let c = self.conns[ci as usize].as_mut().expect("live");
            c.last_drained = std::time::Instant::now();
            let st = &self.c.stats;
            st.bytes.fetch_add(bytes, Ordering::Relaxed);
            st.samples.fetch_add(samples, Ordering::Relaxed);
            c.metrics.bytes.fetch_add(bytes, Ordering::Relaxed);
            c.metrics.samples.fetch_add(samples, Ordering::Relaxed);
        }
    }

    /// With RDMA writes in flight: true to poll again at once (a completion
    /// came, or the poller has spun less than `rdma_spin`); false to sleep
    /// in the ring, after arming the busy links' CQs and queueing a poll of
    /// the completion channel so the next completion wakes the poller.
    fn rdma_should_spin(&mut self) -> bool {
        let free = self.free_slots.len();
        let busy = self.reap_rdma();
        if !busy {
            self.spin_since = None;
            return false;
        }
        if self.free_slots.len() != free {
            self.spin_since = None;
            return true;
        }
        let since = *self.spin_since.get_or_insert_with(std::time::Instant::now);
        if since.elapsed() < self.c.cfg.rdma_spin {
            return true;
        }
        let Some(fd) = self.channel_fd() else {
            return true;
        };
        for k in 0..self.live.len() {
            let ci = self.live[k] as usize;
            let Some(c) = self.conns[ci].as_ref() else {
                continue;
            };
            if c.link.is_rdma() && c.link.busy() {
                if let Err(e) = c.link.arm() {
                    log::warn!("{}: {e}", c.peer);
                    return true;
                }
            }
        }
        // A completion that came in before arming raises no event.
        if self.reap_rdma() && self.free_slots.len() != free {
            self.spin_since = None;
            return true;
        }
        if !self.chan_inflight && self.ring.push_poll_in(UD_CHAN, fd) {
            self.chan_inflight = true;
        }
        self.spin_since = None;
        false
    }

    /// Polls every RDMA link's completions; closes a link whose QP failed.
    /// True while any has writes in flight.
    fn reap_rdma(&mut self) -> bool {
        let mut busy = false;
        for k in 0..self.live.len() {
            let ci = self.live[k] as usize;
            let Some(c) = self.conns[ci].as_ref() else {
                continue;
            };
            if !c.link.is_rdma() {
                continue;
            }
            self.reap_link(ci as u32);
            let c = self.conns[ci].as_ref().expect("live");
            if !c.closing {
                if let Some(why) = c.link.failure() {
                    // Its QP is in error: nothing more can reach the consumer.
                    log::warn!("{}: RDMA link failed: {why}", c.peer);
                    self.close(ci as u32, Some((Code::TransportFailed, why)));
                }
            }
            self.maybe_reap(ci as u32);
            busy |= self.conns[ci].as_ref().is_some_and(|c| c.link.busy());
        }
        busy
    }

    fn complete(&mut self, comp: Completion) {
        let kind = comp.user_data & UD_KIND;
        if kind == UD_CHAN {
            self.chan_inflight = false;
            #[cfg(feature = "rdma")]
            if let Some(ch) = &self.channel {
                ch.drain();
            }
            return;
        }
        let ci = ((comp.user_data >> 32) & 0xff_ffff) as u32;
        let slot = comp.user_data as u32;
        let Some(c) = self.conns[ci as usize].as_mut() else {
            log::error!("node service: completion for a closed connection");
            return;
        };
        c.ops -= 1;
        match kind {
            UD_RECV => {
                c.rx_inflight = false;
                self.on_recv(ci, comp.result);
            }
            UD_READ => self.on_read(ci, slot, comp.result),
            UD_SEND => {
                #[allow(irrefutable_let_patterns)] // without the rdma feature
                if let ConnLink::Tcp(l) = &mut c.link {
                    l.on_send(comp.result);
                }
                if comp.result > 0 {
                    c.last_drained = std::time::Instant::now();
                }
                if comp.result <= 0 && !c.closing {
                    log::debug!("{}: send failed: {}", c.peer, errno_name(-comp.result));
                    self.close(ci, None);
                }
                self.reap_link(ci);
            }
            _ => log::error!("node service: unknown completion {:#x}", comp.user_data),
        }
        self.maybe_reap(ci);
    }

    fn on_recv(&mut self, ci: u32, res: i32) {
        let c = self.conns[ci as usize].as_mut().expect("live");
        if c.closing {
            return;
        }
        let want = match c.rx {
            Rx::Header => proto::HEADER_BYTES as i32,
            Rx::Body(h) => h.body_len as i32,
        };
        if res <= 0 || res < want {
            let why = if res == 0 || (res > 0 && res < want) {
                "consumer closed the connection".to_string()
            } else {
                format!("receive failed: {}", errno_name(-res))
            };
            log::info!("{}: {why}", c.peer);
            self.close(ci, None);
            return;
        }
        c.last_rx = std::time::Instant::now();
        match c.rx {
            Rx::Header => match Header::decode(&c.hdr, 0) {
                Ok(h) if h.kind == Kind::Grant => c.rx = Rx::Body(h),
                Ok(h) if h.kind == Kind::Error && h.body_len == 0 => {}
                Ok(h) => {
                    let m = format!("unexpected {:?} frame from a consumer", h.kind);
                    self.close(ci, Some((Code::Violation, m)));
                }
                Err(e) => self.close(ci, Some((Code::Violation, e.to_string()))),
            },
            Rx::Body(h) => {
                c.rx = Rx::Header;
                let n = h.a as usize;
                c.metrics.grants.fetch_add(n as u64, Ordering::Relaxed);
                log::debug!(
                    "{}: GRANT with {n} entries ({} queued)",
                    c.peer,
                    c.grants.len()
                );
                if c.grants.len() + n > self.c.cfg.max_grants as usize {
                    let m = format!(
                        "{} grants outstanding, more than the {} allowed",
                        c.grants.len() + n,
                        self.c.cfg.max_grants
                    );
                    self.close(ci, Some((Code::TooManyGrants, m)));
                    return;
                }
                let cat = self.c.space.catalog();
                for i in 0..n {
                    let e = GrantEntry::decode(&c.body, i);
                    let bad = if e.sample >= cat.len() {
                        Some(format!(
                            "grant {} names sample {}, past the catalog's {}",
                            e.grant,
                            e.sample,
                            cat.len()
                        ))
                    } else if cat.sample(e.sample).len != e.len {
                        Some(format!(
                            "grant {} says sample {} has {} bytes; the catalog says {}",
                            e.grant,
                            e.sample,
                            e.len,
                            cat.sample(e.sample).len
                        ))
                    } else if e.offset.saturating_add(e.len as u64) > c.hello.ring_len {
                        Some(format!(
                            "grant {} range {}+{} is outside the {}-byte ring",
                            e.grant, e.offset, e.len, c.hello.ring_len
                        ))
                    } else {
                        None
                    };
                    if let Some(m) = bad {
                        self.close(ci, Some((Code::Violation, m)));
                        return;
                    }
                    if e.len > 0 {
                        c.grants.push_back(Work { e, next: 0 });
                    }
                }
            }
        }
    }

    fn on_read(&mut self, ci: u32, slot: u32, res: i32) {
        let closing = self.conns[ci as usize].as_ref().expect("live").closing;
        if closing {
            self.drop_slot(ci, slot);
            return;
        }
        let s = &self.slots[slot as usize];
        self.c.metrics.read_latency[self.index].record(s.issued.elapsed());
        if res < 0 || (res as u32) < s.payload {
            let (ring_offset, grant) = (s.offset, s.grant);
            let msg = if res < 0 {
                format!(
                    "node {}: reading ring offset {ring_offset} of grant {grant}: {}",
                    self.c.space.params().node_index,
                    errno_name(-res),
                )
            } else {
                format!(
                    "node {}: short read of grant {grant}: {res} of {} bytes (extent truncated?)",
                    self.c.space.params().node_index,
                    s.payload
                )
            };
            log::warn!("{msg}");
            self.fill_error(slot, grant, Code::ReadFailed, &msg);
            return;
        }
        self.slots[slot as usize].ready = true;
    }

    /// Frees a slot of a closing connection (its read or send completed).
    fn drop_slot(&mut self, ci: u32, slot: u32) {
        let c = self.conns[ci as usize].as_mut().expect("live");
        if let Some(i) = c.sendq.iter().position(|&s| s == slot) {
            c.sendq.remove(i);
        }
        self.free_slot(slot);
    }

    /// Closes a connection: optionally tells the peer why, shuts the socket
    /// (so in-flight receives and sends end), frees what is not in flight.
    fn close(&mut self, ci: u32, why: Option<(Code, String)>) {
        let c = self.conns[ci as usize].as_mut().expect("live");
        if c.closing {
            return;
        }
        if let Some((code, msg)) = why {
            log::warn!("dropping consumer {}: {}: {msg}", c.peer, code.name());
            self.c.stats.violations.fetch_add(1, Ordering::Relaxed);
            // Only between frames: a send in flight would interleave (an
            // RDMA connection's socket carries no frames from here).
            if c.link.is_rdma() || !c.link.busy() {
                send_error(&c.sock, proto::CONNECTION, code, &msg);
            }
        }
        c.closing = true;
        let _ = c.sock.shutdown(std::net::Shutdown::Both);
        c.grants.clear();
        // Frames posted but not in flight fail now (their slots come back
        // through reap_link), those in flight when their send returns; of
        // the frames not posted, those whose read is done are free now and
        // the others come back through their read completions.
        c.link.close();
        let mut keep = VecDeque::new();
        std::mem::swap(&mut keep, &mut c.sendq);
        for slot in keep.drain(..) {
            let s = &self.slots[slot as usize];
            if !s.ready {
                c.sendq.push_back(slot);
            } else {
                c.held -= 1;
                self.free_slots.push(slot);
            }
        }
        self.reap_link(ci);
        self.maybe_reap(ci);
    }

    fn maybe_reap(&mut self, ci: u32) {
        self.reap_link(ci);
        if self.conns[ci as usize]
            .as_ref()
            .is_some_and(|c| c.closing && c.ops == 0 && !c.link.busy())
        {
            let c = self.conns[ci as usize].take().expect("live");
            // Out of `live` at the next tick's start; free for reuse then.
            self.free_ci.push(ci);
            self.c.load[self.index].fetch_sub(1, Ordering::Relaxed);
            self.c.metrics.remove(&c.metrics);
            log::info!(
                "consumer {} (rank {} of {}) disconnected: {}",
                c.peer,
                c.hello.rank,
                c.hello.world,
                c.metrics.totals()
            );
            for &slot in &c.sendq {
                self.free_slots.push(slot);
            }
            if c.link.is_rdma() {
                // Dropping the link destroys its QP, then its CQ.
                drop(c);
                self.c.stats.rdma_qps.fetch_sub(1, Ordering::Relaxed);
            }
        }
    }
}
