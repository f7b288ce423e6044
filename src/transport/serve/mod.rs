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
//! consumer that exceeds it is dropped). Staging slots and connections are
//! fixed pools (`crate::pool::Pool`, a slab allocated whole when the poller
//! starts, checked every tick never to have grown). Running out of staging
//! slots is back-pressure: reads wait, grants stay queued.
//!
//! Files: `config` (settings and limits), `served` (the space, or
//! several side by side in one id space), `service` (start, stop,
//! signals), `accept` (the acceptor and the TCP handshake),
//! `owner_rdma` (verbs resources, the staging slab's registration, the
//! RDMA handshake and link; `no_rdma.rs` stands in for it without the
//! `rdma` feature), `staging` (`Staging`: the staging slab and the pool of
//! its slots, taken and freed only through it), `conn` (`SConn`, a
//! consumer's connection, and the ring's `user_data` encoding), `conns`
//! (`Conns`: a poller's connection table, its pool and live list), `link`
//! (a connection's send side, TCP or RDMA), `poller` (the serve poller's
//! loop: adopting, closing, heartbeats, completions), `push` (reads into
//! staging and sends in grant order), `rx` (receiving frames from a
//! consumer: whole frames out of each receive, `transport::stream_rx`), `warn_limit` (the WARN-line rate
//! limit), `metrics`. No two of them use each other
//! (`scripts/import_cycles.py`).

mod accept;
pub(crate) mod config;
mod conn;
mod conns;
mod link;
mod metrics;
mod notify;
#[cfg(feature = "rdma")]
pub(crate) mod owner_rdma;
#[cfg(not(feature = "rdma"))]
#[path = "no_rdma.rs"]
mod owner_rdma;
mod poller;
mod push;
mod rx;
mod served;
mod service;
#[cfg(test)]
pub(crate) mod sim_node;
mod staging;
mod warn_limit;

use std::net::{SocketAddr, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

pub use config::{ServeConfig, MIN_IDLE_TIMEOUT};
pub(crate) use metrics::{serve_http, MetricsListener, SeriesOnly};
pub use service::{serve_until_signal, NodeService};

use super::proto::{self, Code, Header, Hello};
use owner_rdma::OwnerRdma;
#[cfg(feature = "rdma")]
use owner_rdma::{rdma_handshake, RdmaAccepted};
use served::Served;

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
    /// Reads submitted again after a transient failure (EAGAIN, EINTR, a
    /// short read); one that fails `MAX_READ_ATTEMPTS` times is an ERROR.
    pub read_retries: AtomicU64,
    /// Consumers dropped for taking no data for `stall_timeout`.
    pub stalled: AtomicU64,
    /// RDMA queue pairs alive now (one per RDMA consumer, destroyed once
    /// its connection is closed and its last work request completed).
    pub rdma_qps: AtomicU64,
    /// Ticks of the pollers' and the acceptor's loops that took longer
    /// than the stall threshold (`KSPEED_STALL_MS`, default 50 ms; each is
    /// logged, at most once per 10 s per loop, with what the tick did).
    pub loop_stalls: AtomicU64,
    /// Ticks of the pollers' loops, and the time they spent busy (ns: from
    /// waking to the next wait; 0 with the stall detector off,
    /// `KSPEED_STALL_MS=0`): their ratio is the mean tick, which follows
    /// what completed, not how many consumers are connected.
    pub poller_ticks: AtomicU64,
    /// See [`ServeStats::poller_ticks`].
    pub poller_busy_ns: AtomicU64,
    /// Node-down notices sent to consumers (one per notice per consumer
    /// that asked for them; docs/PROTOCOL.md, "Node-down notices").
    pub node_notices_sent: AtomicU64,
    /// Probes received: keepalives asking for a heartbeat at once (a
    /// consumer told this node is down checks it), each answered at the
    /// next sweep.
    pub probes: AtomicU64,
}

impl std::fmt::Debug for Common {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Common")
            .field("space", &self.cfg.space)
            .finish_non_exhaustive()
    }
}

struct Common {
    /// The space, or the spaces side by side (`more_spaces`).
    space: Served,
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
    /// Set when a poller panicked: the service stops (`fail`).
    failure: std::sync::Mutex<Option<String>>,
    /// Under `serve_until_signal`: a failure sends the process SIGTERM so
    /// its signal wait ends.
    signal_on_failure: bool,
    /// Node-down notices for the consumers that ask for them: posted by
    /// the agent's own consumer side (`NodeService::notices`), sent by the
    /// pollers' sweeps (`notify.rs`). A node service alone posts none.
    notices: std::sync::Arc<crate::transport::notices::NodeNotices>,
}

impl Common {
    /// Consumers connected (or being handed to a poller) now.
    fn consumers(&self) -> usize {
        self.load.iter().map(|l| l.load(Ordering::Relaxed)).sum()
    }

    /// Stops the service for good because of `why` (a poller panicked):
    /// logged as an error, kept for `serve_until_signal` to return.
    fn fail(&self, why: String) {
        log::error!("node service: {why}; stopping the service");
        let mut f = self.failure.lock().unwrap_or_else(|e| e.into_inner());
        if f.is_none() {
            *f = Some(why);
        }
        drop(f);
        self.stop.store(true, Ordering::Release);
        if self.signal_on_failure {
            // SAFETY: kill with our own pid and a valid signal number has
            // no memory effects; every thread of `kspeed serve` blocks
            // SIGTERM, so it reaches serve_until_signal's sigwait.
            unsafe { libc::kill(libc::getpid(), libc::SIGTERM) };
        }
    }

    /// Whether RDMA links may send from the mapped extents (registered).
    fn rdma_maps(&self) -> bool {
        self.rdma.as_ref().is_some_and(|r| r.sends_from_maps())
    }
}

struct Accepted {
    /// The socket's descriptor: what the poller's ring sends and receives
    /// on.
    fd: RawFd,
    /// Owns the socket (closing it when the connection is dropped); None
    /// in the simulator, whose connections are in-memory endpoints.
    sock: Option<TcpStream>,
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
    let mut f = [0u8; ERROR_FRAME_MAX];
    let n = encode_error(&mut f, grant, code, msg);
    let _ = crate::sys::send_nonblocking(sock.as_raw_fd(), &f[..n]);
}

/// Largest ERROR frame (a header and the longest message).
const ERROR_FRAME_MAX: usize = proto::HEADER_BYTES + proto::MAX_MESSAGE_BYTES;

/// Writes an ERROR frame (the message cut to the protocol's limit) into
/// `f`; returns its length.
fn encode_error(f: &mut [u8; ERROR_FRAME_MAX], grant: u32, code: Code, msg: &str) -> usize {
    let m = &msg.as_bytes()[..msg.len().min(proto::MAX_MESSAGE_BYTES)];
    f[..proto::HEADER_BYTES].copy_from_slice(&Header::error(grant, code, m.len() as u32).encode());
    f[proto::HEADER_BYTES..proto::HEADER_BYTES + m.len()].copy_from_slice(m);
    proto::HEADER_BYTES + m.len()
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}
