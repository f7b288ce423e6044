//! The agent in a cluster (issue 28, docs/AGENT.md "The agent in a
//! cluster"): the node's space holds its share of the dataset, the rest is
//! on the other nodes. Two roles, in the agent's one process:
//!
//! - **consumer** for the ranks attached to it: each rank's loader is built
//!   in cluster mode (`AgentCluster::apply`), so its pollers read what
//!   this node holds and its network thread asks the owners of the rest,
//!   which push it into the rank's ring (TCP frames or RDMA WRITE);
//! - **owner** for every other node's consumers (agents and embedded
//!   ranks alike): the node service (`kspeed serve`'s, `NodeService`),
//!   started by `super::node::run` when given an address to listen on.
//!
//! The ranks' loaders share the agent's network threads (`--net-threads`,
//! default 1), each with one link to each other node
//! (`crate::loader::net::NetHub`), over TCP, and over RDMA where the device
//! has memory windows (else each rank's loader opens its own connection and
//! queue pair to every other node, from the agent's process).

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use super::shm::RingMap;
use crate::error::{Error, Result};
use crate::landing::{CudaMode, LandingOptions};
use crate::loader::{AgentInput, Loader, LoaderBuilder};
use crate::transport::{Cluster, RdmaOptions};

/// The cluster an agent's attached ranks read from.
#[derive(Debug, Clone)]
pub struct AgentCluster {
    /// Every node's service address, by node index (this node's too).
    pub cluster: Cluster,
    /// The job token the node services check.
    pub token: Vec<u8>,
    /// How long a node may stay silent with grants outstanding before its
    /// samples fail over to another copy (or the source).
    pub node_timeout: Duration,
    /// Samples move by RDMA WRITE (every node must offer it), else TCP.
    pub rdma: Option<RdmaOptions>,
    /// Over TCP: network threads shared by the attached ranks, each with
    /// one link to every other node (a rank joins the one with the fewest
    /// ranks). 1: N−1 links per node; more read more at once over TCP,
    /// where a network thread receives every byte, at that many times the
    /// links.
    pub net_threads: usize,
}

impl AgentCluster {
    /// Whether the ranks share the agent's links (one per other node per
    /// network thread): unless `KSPEED_AGENT_LINKS=per-rank` asks for a
    /// connection per rank (for measuring the two side by side), or the
    /// RDMA device has no memory windows (one key per ring cannot open
    /// several rings to one link: said at WARN).
    pub(super) fn shared_links(&self) -> bool {
        match std::env::var("KSPEED_AGENT_LINKS").as_deref() {
            Ok("per-rank") => return false,
            Ok("shared" | "per-job") | Err(_) => {}
            Ok(other) => log::warn!(
                "KSPEED_AGENT_LINKS={other:?} is none of shared, per-job and per-rank; sharing links"
            ),
        }
        match &self.rdma {
            None => true,
            #[cfg(feature = "rdma")]
            Some(opts) => match crate::loader::net::shared_links_usable(opts) {
                Ok(()) => true,
                Err(why) => {
                    log::warn!(
                        "agent: each rank gets its own RDMA links (no memory windows: {why})"
                    );
                    false
                }
            },
            #[cfg(not(feature = "rdma"))]
            Some(_) => false,
        }
    }

    /// Whether shared links are made at the agent's start and kept across
    /// jobs ([`KeptLinks`]): unless `KSPEED_AGENT_LINKS=per-job` asks for
    /// a thread made with its first rank and closed after its last (for
    /// measuring the two side by side).
    pub(super) fn kept_links(&self) -> bool {
        std::env::var("KSPEED_AGENT_LINKS").as_deref() != Ok("per-job")
    }

    /// A rank's loader reads from the cluster: the local space's samples
    /// by its pollers, the rest from their owners.
    pub(super) fn apply(&self, b: LoaderBuilder) -> LoaderBuilder {
        b.cluster(self.cluster.clone())
            .token(&self.token)
            .node_timeout(self.node_timeout)
            .rdma(self.rdma.clone())
    }
}

/// The agent's links to the other nodes, set up at its start and kept
/// across jobs (issue 28): each shared network thread gets one lane of the
/// agent's own, a run with nothing to read, from the start until the agent
/// stops. A thread ends with its last lane, so with this one it outlives
/// every job: a job's ranks attach to links already up (no handshakes at
/// a job's start, no links closed at its end), and a node's service sees
/// one connection per other agent's thread for the agent's whole life.
///
/// The links are made on a thread of their own (a node not up yet costs
/// its handshake deadline, `--node-timeout-ms`): the agent takes ranks
/// meanwhile, and a rank's loader joining a thread that is still connecting
/// waits for it. A node that was not up is dialled again with the usual
/// back-off (1 s doubling to 30 s), and at once when a rank joins, taken
/// for a node that just went away: its samples come from the source where
/// there is one, else wait for it (docs/AGENT.md, "One link per pair of
/// nodes").
pub(super) struct KeptLinks {
    making: Option<JoinHandle<Vec<Loader>>>,
    /// Set when the agent stops: no more lanes made.
    stop: Arc<AtomicBool>,
}

/// The ring of the agent's own lane: it never takes a sample, but the
/// build checks that a ring holds a batch (one of the largest samples).
fn anchor_ring_bytes(max_sample_bytes: u64) -> u64 {
    (2 * (max_sample_bytes + 4096)).next_multiple_of(4096)
}

impl KeptLinks {
    /// Starts making `threads` lanes of the agent's own (one per shared
    /// network thread) from `input` (the space and the hub), in the
    /// cluster `c`.
    pub(super) fn start(
        c: &AgentCluster,
        space_dir: &Path,
        input: AgentInput,
        threads: usize,
    ) -> Result<KeptLinks> {
        let (c, dir) = (c.clone(), space_dir.to_path_buf());
        let stop = Arc::new(AtomicBool::new(false));
        let stopping = stop.clone();
        let making = std::thread::Builder::new()
            .name("kspeed-links".into())
            .spawn(move || {
                let mut kept = Vec::with_capacity(threads);
                for k in 0..threads {
                    // The agent stopping while a node's handshake waits out
                    // its deadline: the other threads' links are not made.
                    if stopping.load(Ordering::Acquire) {
                        break;
                    }
                    // Thread k's own: not the one with the fewest lanes, which
                    // a rank attaching meanwhile may have taken.
                    let input = AgentInput {
                        net_hub_slot: Some(k),
                        ..input.clone()
                    };
                    match anchor(&c, &dir, &input) {
                        Ok(l) => {
                            log::info!(
                                "agent: network thread {k}'s links kept while the agent runs, across jobs"
                            );
                            kept.push(l)
                        }
                        // The thread starts with the first rank instead
                        // (and ends with its last), as without this.
                        Err(e) => log::warn!(
                            "agent: links to the other nodes not made at start (network thread {k}): {e}; they are made when a rank attaches"
                        ),
                    }
                }
                kept
            })
            .map_err(|e| Error::ThreadSpawn {
                thread: "agent links",
                source: e.into(),
            })?;
        Ok(KeptLinks {
            making: Some(making),
            stop,
        })
    }

    /// Closes the links (once the lanes' threads have no rank left).
    pub(super) fn close(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(h) = self.making.take() {
            // A panic there left no lane: nothing to drop.
            drop(h.join().unwrap_or_default());
        }
    }
}

impl Drop for KeptLinks {
    fn drop(&mut self) {
        self.close();
    }
}

/// One lane of the agent's own: a loader in cluster mode over the agent's
/// space whose run ends where it starts (epoch 0 of 0), so its pollers
/// read nothing and its lane grants nothing. Its HELLO names this node as
/// the consumer's rank (node index of the node count).
fn anchor(c: &AgentCluster, dir: &Path, input: &AgentInput) -> Result<Loader> {
    let p = input.space.params();
    let max_sample_bytes = input
        .mix_parts
        .iter()
        .map(|(sp, _)| sp.catalog().max_sample_bytes())
        .fold(input.space.catalog().max_sample_bytes(), u32::max);
    let ring_bytes = anchor_ring_bytes(u64::from(max_sample_bytes));
    let ring = RingMap::create_untouched(ring_bytes)?;
    // An agent serving a mixture's spaces links as a consumer of that
    // mixture (the other nodes serve the same spaces side by side); the
    // weights do not matter to a run that reads nothing.
    let b = if input.mix_parts.is_empty() {
        LoaderBuilder::space(dir)
    } else {
        LoaderBuilder::mix(input.mix_parts.iter().map(|(sp, _)| {
            (
                sp.dir().display().to_string(),
                crate::sampler::Weight::Repeat(1.0),
            )
        }))
    };
    let b = c.apply(b).agent_input(AgentInput {
        ring: Arc::new(Mutex::new(Some(ring))),
        tier: None,
        links_only: true,
        ..input.clone()
    });
    b.batch_size(1)
        .seed(0)
        .shuffle(false)
        .rank(p.node_index, p.placement.nodes.max(1))
        .landing(
            LandingOptions::default()
                .ring_bytes(ring_bytes)
                .huge_pages(false)
                .mlock(false)
                .cuda(CudaMode::Off),
        )
        .pollers(1)
        // Its ring is never read into: not pinned for the poller's io_uring.
        .registered_buffers(false)
        .pin(false)
        .local_rank(0, 1)
        .end_epoch(Some(0))
        .build()
}
