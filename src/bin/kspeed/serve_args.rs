//! The node service's tuning flags, shared by `kspeed serve` and `kspeed
//! agent --listen` (the same service in the agent's process): one list, so
//! an operator tunes an agent's service as they would a `serve`.
//!
//! Each flag is optional; what is not given keeps
//! [`kspeed::transport::ServeConfig::new`]'s default, which each flag's help
//! names.

use clap::Args;

#[derive(Args, Default)]
pub(crate) struct NodeServiceArgs {
    /// Staging memory per poller [default: 64MiB].
    #[arg(long, value_parser = crate::parse_bytes)]
    staging_bytes: Option<u64>,
    /// Largest DATA frame or RDMA write, and the size of a staging slot
    /// (bigger samples go in several; rounded up to a multiple of the
    /// space's alignment, 4 KiB by default); staging-bytes / chunk-bytes
    /// reads and sends are in flight per poller [default: 256KiB].
    #[arg(long, value_parser = crate::parse_bytes)]
    chunk_bytes: Option<u64>,
    /// Grants one consumer may have outstanding, each queue reserved when
    /// the consumer connects (0 to 1048576). 0 (the default): 131072 over
    /// the nodes of the space's placement, 256 to 8192.
    #[arg(long)]
    max_grants: Option<u32>,
    /// Consumers one poller serves; a HELLO beyond pollers x this is
    /// refused with the named error "node full" (0 to 4096). 0 (the
    /// default): 8 x nodes of the space's placement over the pollers, at
    /// least 256.
    #[arg(long)]
    max_consumers_per_poller: Option<usize>,
    /// Handshakes not yet past HELLO pending at once; a connection beyond
    /// that makes room (a late wrong-token answer is sent now, else the
    /// oldest unfinished HELLO is told "node busy" and retries). 0 (the
    /// default): 64 + 8 x (nodes - 1) of the space's placement (0 to 4096).
    #[arg(long)]
    max_handshakes: Option<usize>,
    /// Milliseconds a peer has for its whole handshake (HELLO and, over
    /// RDMA, the queue-pair swap), however it paces its bytes [default:
    /// 5000].
    #[arg(long)]
    handshake_timeout_ms: Option<u64>,
    /// Milliseconds a consumer may take no data (TCP) or complete no write
    /// (RDMA) while the node has some in flight for it before it is dropped
    /// (until then it holds at most its fair share of staging) [default:
    /// 10000].
    #[arg(long)]
    stall_timeout_ms: Option<u64>,
    /// Milliseconds a consumer connection may send nothing with nothing
    /// queued for it before it is closed (at least 3000; kspeed's
    /// consumer sends a keepalive every quarter of it, at most every 15 s,
    /// once it heard the node's heartbeats, else every second) [default:
    /// 60000].
    #[arg(long)]
    idle_timeout_ms: Option<u64>,
    /// Send straight from the page cache (a mapping of the extents) instead
    /// of O_DIRECT reads into staging: for spaces on tmpfs or kept warm.
    #[arg(long)]
    page_cache: bool,
    /// With RDMA writes in flight, microseconds a poller keeps polling after
    /// the last completion before it sleeps on its completion channel.
    #[arg(long, requires = "rdma")]
    rdma_spin_us: Option<u64>,
}

impl NodeServiceArgs {
    /// Sets in `cfg` what was given.
    pub(crate) fn apply(&self, cfg: &mut kspeed::transport::ServeConfig) {
        use std::time::Duration;
        if let Some(b) = self.staging_bytes {
            cfg.staging_bytes = b;
        }
        if let Some(b) = self.chunk_bytes {
            cfg.chunk_bytes = b.min(u32::MAX as u64) as u32;
        }
        if let Some(g) = self.max_grants {
            cfg.max_grants = g;
        }
        if let Some(n) = self.max_consumers_per_poller {
            cfg.max_conns_per_poller = n;
        }
        if let Some(n) = self.max_handshakes {
            cfg.max_handshakes = n;
        }
        if let Some(ms) = self.handshake_timeout_ms {
            cfg.handshake_timeout = Duration::from_millis(ms);
        }
        if let Some(ms) = self.stall_timeout_ms {
            cfg.stall_timeout = Duration::from_millis(ms);
        }
        if let Some(ms) = self.idle_timeout_ms {
            cfg.idle_timeout = Duration::from_millis(ms);
        }
        cfg.page_cache |= self.page_cache;
        if let Some(us) = self.rdma_spin_us {
            cfg.rdma_spin = Duration::from_micros(us);
        }
    }

    /// The first flag given, by name (`kspeed agent` takes them only with
    /// `--listen`).
    pub(crate) fn first_given(&self) -> Option<&'static str> {
        [
            (self.staging_bytes.is_some(), "--staging-bytes"),
            (self.chunk_bytes.is_some(), "--chunk-bytes"),
            (self.max_grants.is_some(), "--max-grants"),
            (
                self.max_consumers_per_poller.is_some(),
                "--max-consumers-per-poller",
            ),
            (self.max_handshakes.is_some(), "--max-handshakes"),
            (
                self.handshake_timeout_ms.is_some(),
                "--handshake-timeout-ms",
            ),
            (self.stall_timeout_ms.is_some(), "--stall-timeout-ms"),
            (self.idle_timeout_ms.is_some(), "--idle-timeout-ms"),
            (self.page_cache, "--page-cache"),
            (self.rdma_spin_us.is_some(), "--rdma-spin-us"),
        ]
        .into_iter()
        .find_map(|(given, name)| given.then_some(name))
    }
}
