//! The node service's settings and their limits.

use std::path::PathBuf;
use std::time::Duration;

use crate::error::{Error, Result};
use crate::transport::proto;

/// Node service settings.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct ServeConfig {
    /// The preloaded space this node serves.
    pub space: PathBuf,
    /// Further spaces served after `space`, side by side in one id space:
    /// the datasets of a mixture, in the order its consumers list them
    /// (`--space A --space B`; dataset d's sample i is id i plus the
    /// lengths of the datasets before it). Every one must be placed as
    /// `space` is (nodes, copies, this node's index). Empty by default.
    pub more_spaces: Vec<PathBuf>,
    /// Address to listen on (`host:port`; port 0 picks one).
    pub listen: String,
    /// Job token every consumer must present.
    pub token: Vec<u8>,
    /// Poller threads.
    pub pollers: usize,
    /// Staging memory per poller.
    pub staging_bytes: u64,
    /// Largest DATA frame or RDMA write, and the size of a staging slot
    /// (default 256 KiB; rounded up to a multiple of the space's
    /// alignment when the service starts). Staging holds `staging_bytes / chunk_bytes`
    /// slots, which bounds the reads and sends in flight: with 1 MiB slots
    /// an ImageNet-sized sample (~128 KB) left 7/8 of its slot empty and 64
    /// MiB of staging kept only 64 samples moving, and on soft-RoCE the
    /// node then waited on its reads (kspeed over RDMA 0.81x ib_write_bw
    /// with 1 MiB, 0.85-0.90x with 128-256 KiB; BENCHMARKS.md).
    pub chunk_bytes: u32,
    /// Grants one consumer may have outstanding (`--max-grants`, said in
    /// WELCOME). The node reserves each consumer's queue of this many
    /// grants, and a GRANT body buffer of up to this many entries, when
    /// the consumer connects. 0 (the default): sized from the space's
    /// placement when the service starts ([`ServeConfig::grants_per_consumer`]):
    /// 131,072 over the nodes, at least 256 and at most 8,192, so a node's
    /// grant queues stay the same size whatever the cluster's.
    pub max_grants: u32,
    /// Consumers one poller serves at once (`--max-consumers-per-poller`);
    /// a HELLO beyond `pollers` times this is refused with
    /// [`Code::NodeFull`](crate::transport::proto::Code::NodeFull). 0 (the
    /// default): sized from the space's placement when the service starts,
    /// 8 consumers per node of the cluster over the pollers, at least 256
    /// and at most 4,096 (connection tables and rings
    /// are sized from it at start).
    pub max_conns_per_poller: usize,
    /// Time a peer has to complete its whole handshake (HELLO, and the
    /// RDMA endpoint swap), however it paces its bytes.
    pub handshake_timeout: Duration,
    /// Handshakes not yet admitted (HELLO not read in full) pending at
    /// once (`--max-handshakes`); a connection accepted beyond that makes
    /// room (docs/PROTOCOL.md, "Admission and retry"). 0 (the default):
    /// 64 + 8 x (nodes - 1) of the space's placement, so the connections of
    /// a job's start fit. Admitted handshakes (over RDMA, waiting for the
    /// consumer's endpoint) are bounded by the consumer limit instead.
    pub max_handshakes: usize,
    /// A consumer connection that sends nothing (no GRANT, no keepalive)
    /// for this long while it has nothing queued or in flight is closed
    /// (`--idle-timeout-ms`; kspeed's consumer sends a keepalive every
    /// second it has nothing to grant). At least [`MIN_IDLE_TIMEOUT`].
    pub idle_timeout: Duration,
    /// Serve Prometheus metrics (`GET /metrics`) on this address
    /// (`--metrics`; port 0 picks one, see [`NodeService::metrics_addr`](super::NodeService::metrics_addr)).
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
    pub rdma: Option<crate::transport::RdmaOptions>,
    /// With RDMA writes in flight, how long a poller keeps polling its
    /// completion queues after the last completion before it arms them and
    /// sleeps on its completion channel (default: the loader's
    /// [`crate::placement::default_spin`], none on small machines).
    pub rdma_spin: Duration,
}

impl ServeConfig {
    /// Every space served, `space` first.
    pub fn spaces(&self) -> Vec<PathBuf> {
        std::iter::once(self.space.clone())
            .chain(self.more_spaces.iter().cloned())
            .collect()
    }

    /// Defaults for a space and listen address.
    pub fn new(space: impl Into<PathBuf>, listen: &str, token: &[u8]) -> Self {
        ServeConfig {
            space: space.into(),
            more_spaces: Vec::new(),
            listen: listen.to_string(),
            token: token.to_vec(),
            pollers: crate::placement::default_pollers(),
            staging_bytes: 64 << 20,
            chunk_bytes: 256 << 10,
            max_grants: 0,
            max_conns_per_poller: 0,
            handshake_timeout: Duration::from_secs(5),
            max_handshakes: 0,
            stall_timeout: Duration::from_secs(10),
            metrics: None,
            idle_timeout: Duration::from_secs(60),
            page_cache: false,
            rdma: None,
            rdma_spin: crate::placement::default_spin(),
        }
    }

    /// The consumers one poller admits for a space placed over `nodes`
    /// nodes: `max_conns_per_poller` when set, else (0) every rank of
    /// every node (8 ranks a node, the common case, its own node's
    /// included for margin) spread over the pollers, at least 256 (the
    /// fixed default before, which small clusters keep) and at most
    /// 4,096 (`MAX_CONNS_PER_POLLER`). The service resolves it once at start.
    pub fn consumers_per_poller(&self, nodes: u32) -> usize {
        if self.max_conns_per_poller > 0 {
            return self.max_conns_per_poller;
        }
        let consumers = 8 * nodes.max(1) as u64;
        consumers
            .div_ceil(self.pollers.max(1) as u64)
            .clamp(256, MAX_CONNS_PER_POLLER) as usize
    }

    /// The grants one consumer may have outstanding for a space placed
    /// over `nodes` nodes: `max_grants` when set, else (0) 131,072 over
    /// the nodes, at least 256 and at most 8,192. A consumer
    /// spreads its lookahead over every node, so it asks one node for about
    /// a `nodes`-th of it; the node's grant memory (one queue per consumer,
    /// about 8 consumers per node of the cluster) then stays near
    /// `8 x AUTO_GRANTS_PER_NODE` entries up to 512 nodes and grows with
    /// the floor past it (704 MiB per node at 4,096 nodes of 8 ranks, 88
    /// MiB with one agent link per node), where a fixed 8,192 reserved 18
    /// GiB at 4,096 nodes. The limit also bounds what one consumer has in
    /// flight towards all nodes at about 131,072 samples (a consumer that
    /// meets a node's limit waits there), seconds of data at any rate a
    /// rank consumes. The service resolves it once at start.
    pub fn grants_per_consumer(&self, nodes: u32) -> u32 {
        if self.max_grants > 0 {
            return self.max_grants;
        }
        (AUTO_GRANTS_PER_NODE / nodes.max(1) as u64).clamp(AUTO_MIN_GRANTS, AUTO_MAX_GRANTS) as u32
    }

    /// Bytes the node reserves for each consumer's grants when it
    /// connects, for a space placed over `nodes` nodes: its queue of
    /// [`ServeConfig::grants_per_consumer`] grants and its GRANT body
    /// buffer (a frame holds at most that many entries, and at most
    /// [`proto::MAX_GRANT_ENTRIES`]). docs/SCALE.md's grant columns are
    /// this times the consumers.
    pub fn grant_bytes_per_consumer(&self, nodes: u32) -> u64 {
        let grants = self.grants_per_consumer(nodes);
        grants as u64 * std::mem::size_of::<super::conn::Work>() as u64
            + grant_body_bytes(grants) as u64
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
            ("max grants", self.max_grants as u64, 0, MAX_GRANTS),
            (
                "max consumers per poller",
                self.max_conns_per_poller as u64,
                0,
                MAX_CONNS_PER_POLLER,
            ),
            (
                "max handshakes",
                self.max_handshakes as u64,
                0,
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

    /// A poller's io_uring: (submission entries, completion entries, most
    /// operations it keeps in flight). Each poller has at most a read per
    /// staging slot, and per connection a receive and a send, plus its
    /// completion channel's poll: `slots + 2 × connections + 1`. The
    /// completion queue holds twice the submission queue and at least all
    /// of that, up to the kernel's 65,536; past that the reads in flight
    /// are held below it (back-pressure), so a completion can never be
    /// dropped (which would leak its slot and hang shutdown).
    pub(crate) fn ring_entries(&self) -> (u32, u32, usize) {
        let reserve = 2 * self.max_conns_per_poller + 1;
        let need = self.slots().saturating_add(reserve);
        let sq = (need.min(MAX_RING_SQ) as u32).next_power_of_two().max(1024);
        let cq = (need.min(MAX_RING_CQ) as u32)
            .next_power_of_two()
            .max(2 * sq);
        (sq, cq, cq as usize)
    }

    /// Staging slots per poller (and so the most RDMA writes in flight per
    /// connection).
    pub(crate) fn slots(&self) -> usize {
        (self.staging_bytes / self.chunk_bytes as u64).max(1) as usize
    }
}

/// The largest GRANT body a consumer allowed `max_grants` grants may send
/// (a frame of more is refused at its header): the node's receive buffer
/// beyond one header.
pub(crate) fn grant_body_bytes(max_grants: u32) -> usize {
    (max_grants as usize).min(proto::MAX_GRANT_ENTRIES) * proto::GRANT_ENTRY_BYTES
}

/// Largest io_uring submission queue (the kernel's IORING_MAX_ENTRIES).
const MAX_RING_SQ: usize = 32768;
/// Largest io_uring completion queue (the kernel's IORING_MAX_CQ_ENTRIES).
const MAX_RING_CQ: usize = 2 * MAX_RING_SQ;

/// Most poller threads.
pub const MAX_POLLERS: u64 = 256;

/// Most grants one consumer may have outstanding (the node reserves each
/// consumer's queue when it connects:
/// [`ServeConfig::grant_bytes_per_consumer`]).
pub const MAX_GRANTS: u64 = 1 << 20;

/// Grants per consumer a node's automatic limit spreads over the cluster's
/// nodes ([`ServeConfig::grants_per_consumer`]): 131,072 samples of
/// lookahead per consumer, a ring of 16 GiB of 128-KiB samples.
const AUTO_GRANTS_PER_NODE: u64 = 1 << 17;

/// Least grants per consumer of the automatic limit: the memory windows a
/// consumer keeps per RDMA connection (the most grants it has in flight to
/// one node over RDMA), so a large cluster never holds a consumer below
/// what its RDMA path allows.
const AUTO_MIN_GRANTS: u64 = 256;

/// Most grants per consumer of the automatic limit (the fixed default
/// before it, which clusters of up to 16 nodes keep).
const AUTO_MAX_GRANTS: u64 = 8192;

/// Most consumers per poller.
pub const MAX_CONNS_PER_POLLER: u64 = 4096;

/// Most handshakes pending at once (each holds a descriptor and a 1 KiB
/// buffer).
pub const MAX_HANDSHAKES: u64 = 4096;

/// Most staging memory per poller.
pub const MAX_STAGING_BYTES: u64 = 1 << 30;

/// Shortest idle timeout: three of the consumer's one-second keepalives.
pub const MIN_IDLE_TIMEOUT: Duration = Duration::from_secs(3);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_consumer_limit_is_sized_from_the_cluster() {
        let limit = |nodes: u32, pollers: usize| {
            ServeConfig {
                pollers,
                ..ServeConfig::new("/x", "127.0.0.1:0", b"t")
            }
            .consumers_per_poller(nodes)
        };
        // Small clusters keep the old fixed 256.
        assert_eq!(limit(1, 8), 256);
        assert_eq!(limit(257, 8), 257);
        // 512 nodes of 8 ranks on 8 pollers: every rank of the other
        // nodes admitted (the fixed 256 refused 2,040 of them).
        assert_eq!(limit(512, 8), 512);
        assert!(limit(512, 8) * 8 >= 8 * 511);
        // 4,096 nodes: 32,768 on 8 pollers; fewer pollers reach the
        // ceiling sooner.
        assert_eq!(limit(4096, 8), 4096);
        assert_eq!(limit(4096, 2), MAX_CONNS_PER_POLLER as usize);
        assert_eq!(limit(0, 1), 256);
        // A number given is kept.
        let fixed = ServeConfig {
            max_conns_per_poller: 3,
            ..ServeConfig::new("/x", "127.0.0.1:0", b"t")
        };
        assert_eq!(fixed.consumers_per_poller(4096), 3);
    }

    #[test]
    fn the_grant_limit_is_sized_from_the_cluster() {
        let cfg = ServeConfig::new("/x", "127.0.0.1:0", b"t");
        let grants = |nodes: u32| cfg.grants_per_consumer(nodes);
        // Up to 16 nodes keep the fixed 8,192 of before.
        for n in [0, 1, 2, 16] {
            assert_eq!(grants(n), 8192, "{n} nodes");
        }
        assert_eq!(grants(64), 2048);
        // Large clusters stop at the windows a consumer keeps per RDMA
        // connection, the most it has in flight to one node over RDMA.
        assert_eq!(grants(512), 256);
        assert_eq!(grants(4096), 256);
        #[cfg(feature = "rdma")]
        assert_eq!(
            AUTO_MIN_GRANTS,
            crate::loader::net::rdma::RDMA_WINDOWS as u64
        );
        // What a node reserves for its consumers' grants stays bounded:
        // with a consumer per rank (8 ranks a node) under 1 GiB at any
        // size, with one agent link per node under 128 MiB; the fixed
        // 8,192 reserved 18 GiB at 4,096 nodes.
        for n in [8u32, 64, 512, 4096] {
            let ranks = 8 * n as u64 * cfg.grant_bytes_per_consumer(n);
            assert!(ranks < 1 << 30, "{n} nodes: {ranks} bytes");
            let links = (n as u64 - 1) * cfg.grant_bytes_per_consumer(n);
            assert!(links < 128 << 20, "{n} nodes: {links} bytes");
        }
        let fixed = ServeConfig {
            max_grants: 8192,
            ..cfg.clone()
        };
        assert_eq!(fixed.grants_per_consumer(4096), 8192);
        assert!(8 * 4096 * fixed.grant_bytes_per_consumer(4096) > 17 << 30);
        // A given limit is kept, and the body buffer never exceeds one
        // frame's largest.
        let one = ServeConfig {
            max_grants: 1,
            ..cfg.clone()
        };
        assert_eq!(one.grants_per_consumer(4096), 1);
        let big = ServeConfig {
            max_grants: MAX_GRANTS as u32,
            ..cfg
        };
        assert!(
            big.grant_bytes_per_consumer(1)
                < MAX_GRANTS * 64 + (proto::MAX_GRANT_ENTRIES * proto::GRANT_ENTRY_BYTES) as u64
        );
    }

    /// The ring holds every operation a poller may have in flight: a read
    /// per slot, a receive and a send per connection, the channel's poll.
    /// (It was 1,024 entries, 2,048 completions, whatever the config.)
    #[test]
    fn the_serve_ring_holds_every_operation_in_flight() {
        for (staging_bytes, chunk_bytes, conns) in [
            (8u64 << 20, 256u32 << 10, 256usize),
            (64 << 20, 16 << 10, 256),
            (256 << 20, 64 << 10, 4096),
            (1 << 30, 4096, 4096),
        ] {
            let cfg = ServeConfig {
                staging_bytes,
                chunk_bytes,
                max_conns_per_poller: conns,
                ..ServeConfig::new("/x", "127.0.0.1:0", b"t")
            };
            let (sq, cq, max_ops) = cfg.ring_entries();
            let need = cfg.slots() + 2 * conns + 1;
            assert!(sq.is_power_of_two() && cq.is_power_of_two() && cq >= sq);
            assert!(cq as usize <= MAX_RING_CQ && sq as usize <= MAX_RING_SQ);
            assert!(max_ops <= cq as usize);
            if need <= MAX_RING_CQ {
                assert!(
                    cq as usize >= need,
                    "{staging_bytes}/{chunk_bytes}, {conns}: {cq} < {need}"
                );
            }
        }
    }
}
