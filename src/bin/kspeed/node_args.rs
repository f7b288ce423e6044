//! The node list's flags, shared by `kspeed read` (cluster mode) and
//! `kspeed agent` (the cluster its attached ranks read from).

use std::path::PathBuf;

use clap::Args;

#[derive(Args)]
pub(crate) struct NodeListArgs {
    /// Cluster mode: a file listing the node services (`<index> <host:port>` per line).
    #[arg(long, conflicts_with_all = ["nodelist", "nodes_dns"])]
    pub(crate) cluster: Option<PathBuf>,
    /// Cluster mode: the node services' hosts as a SLURM hostlist
    /// (`gpu[01-04,07]`), node i = the i-th host, each at --node-port.
    #[arg(long, conflicts_with = "nodes_dns")]
    pub(crate) nodelist: Option<String>,
    /// Cluster mode: the node services' names, `{i}` standing for the node
    /// index 0..N-1 (a Kubernetes headless service:
    /// `kspeed-{i}.kspeed.ns.svc:7400`); N from --nodes (or, for `read`
    /// with --cluster-env, WORLD_SIZE / LOCAL_WORLD_SIZE).
    #[arg(long)]
    pub(crate) nodes_dns: Option<String>,
    /// Node count for --nodes-dns.
    #[arg(long, requires = "nodes_dns", value_parser = crate::opt::<u32>("cluster_node_count"))]
    pub(crate) nodes: Option<u32>,
    /// Port of the node services for --nodelist and a --nodes-dns pattern
    /// without one (default: KSPEED_PORT, else 7400).
    #[arg(long, value_parser = crate::opt::<u16>("cluster_port"))]
    pub(crate) node_port: Option<u16>,
}

impl NodeListArgs {
    /// The cluster these flags name (with `env`, the launcher's
    /// environment fills what they leave out).
    pub(crate) fn spec(&self, env: bool) -> kspeed::transport::ClusterSpec {
        kspeed::transport::ClusterSpec {
            file: self.cluster.clone(),
            addrs: None,
            hostlist: self.nodelist.clone(),
            dns: self.nodes_dns.clone(),
            nodes: self.nodes,
            port: self.node_port,
            env,
        }
    }
}
