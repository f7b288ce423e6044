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

use std::time::Duration;

use crate::loader::LoaderBuilder;
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
            Ok("shared") | Err(_) => {}
            Ok(other) => log::warn!(
                "KSPEED_AGENT_LINKS={other:?} is neither shared nor per-rank; sharing links"
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

    /// A rank's loader reads from the cluster: the local space's samples
    /// by its pollers, the rest from their owners.
    pub(super) fn apply(&self, b: LoaderBuilder) -> LoaderBuilder {
        b.cluster(self.cluster.clone())
            .token(&self.token)
            .node_timeout(self.node_timeout)
            .rdma(self.rdma.clone())
    }
}
