//! `kspeed rebalance`: change a space's node count (or convert a space of
//! the scaled owner function to jump), copying only the samples whose
//! holder changed (`kspeed::dataset::rebalance`; docs/DEPLOY.md, "Resizing
//! a cluster").

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use indicatif::HumanBytes;
use kspeed::dataset::{self, Catalog, Fetch, OwnerFn, Placement, RebalanceOptions, Space};
use kspeed::progress::ProgressMode;
use kspeed::transport::{Cluster, PeerFetch};

#[derive(Args)]
pub(crate) struct RebalanceArgs {
    /// The space directory (a node new to the cluster: an empty directory,
    /// with --catalog).
    #[arg(long)]
    space: PathBuf,
    /// Nodes in the new layout.
    #[arg(long)]
    nodes: u32,
    /// This node's index (default: the space's; nodes keep their indices,
    /// new nodes take the next ones).
    #[arg(long)]
    node_index: Option<u32>,
    /// Copies of each sample in the new layout (default: the space's, or
    /// for a new node the old layout's, from its peers).
    #[arg(long)]
    replicas: Option<u32>,
    /// The old layout's node services, in node-index order
    /// (host:port,host:port,...), which serve the samples arriving here.
    #[arg(long, value_delimiter = ',')]
    peers: Vec<String>,
    /// The old layout's cluster file (one host:port per line), instead of --peers.
    #[arg(long, conflicts_with = "peers")]
    peers_file: Option<PathBuf>,
    /// The job token the node services check (needed with --peers).
    #[arg(long)]
    token_file: Option<PathBuf>,
    /// Read what no peer can serve from the catalog's source.
    #[arg(long)]
    from_source: bool,
    /// The cluster's catalog, copied into a space that has none (a new node).
    #[arg(long)]
    catalog: Option<PathBuf>,
    /// After staging, put the new layout in use and give back the blocks of
    /// the samples this node no longer holds. Run it only when every node
    /// has staged and the node service is stopped.
    #[arg(long)]
    commit: bool,
    /// Sync and record progress every this many bytes.
    #[arg(long, default_value = "64MiB", value_parser = crate::parse_bytes)]
    checkpoint_bytes: u64,
    /// Seconds to wait on a node service (connect, send, receive).
    #[arg(long, default_value_t = 30)]
    timeout: u64,
}

pub(crate) fn run(a: RebalanceArgs, progress: ProgressMode) -> kspeed::Result<()> {
    let cpath = a.space.join("catalog.ksc");
    if let Some(c) = &a.catalog {
        if cpath.exists() {
            let (have, given) = (Catalog::open(&cpath)?, Catalog::open(c)?);
            if have.identity() != given.identity() {
                return Err(kspeed::Error::InvalidConfig(format!(
                    "{} is another catalog than the space's (identity {:#010x}, the space's {:#010x})",
                    c.display(),
                    given.identity(),
                    have.identity()
                )));
            }
        } else {
            std::fs::create_dir_all(&a.space)
                .map_err(|e| kspeed::Error::io("create", &a.space, e))?;
            let tmp = a.space.join("catalog.ksc.tmp");
            std::fs::copy(c, &tmp).map_err(|e| kspeed::Error::io("copy", c, e))?;
            std::fs::rename(&tmp, &cpath).map_err(|e| kspeed::Error::io("rename", &tmp, e))?;
        }
    }
    // The space's layout, else a staged one's (a new node committing).
    let old_params = Space::open(&a.space)
        .ok()
        .map(|s| *s.params())
        .or_else(|| dataset::rebalance::staged_params(&a.space));
    let node_index = match (a.node_index, old_params) {
        (Some(i), _) => i,
        (None, Some(p)) => p.node_index,
        (None, None) => {
            return Err(kspeed::Error::InvalidConfig(
                "--node-index is needed for a space with no layout yet (a new node)".into(),
            ))
        }
    };
    let catalog = Catalog::open(&cpath)?;
    let peers = match (&a.peers_file, a.peers.is_empty()) {
        (Some(f), _) => Some(Cluster::from_file(f)?),
        (None, false) => Some(Cluster::from_addrs(&a.peers, "--peers")?),
        (None, true) => None,
    };
    let source = if a.from_source {
        Some(dataset::SourceFetch::new(&catalog)?)
    } else {
        None
    };
    let mut old_replicas = old_params.map(|p| p.placement.replicas);
    let mut fetch: Box<dyn Fetch> = match (peers, source) {
        (Some(cluster), source) => {
            let token = match &a.token_file {
                Some(t) => crate::read_token(t)?,
                None => {
                    return Err(kspeed::Error::InvalidConfig(
                        "--peers needs --token-file (the node services check the job token)".into(),
                    ))
                }
            };
            let mut pf = PeerFetch::new(
                &cluster,
                &token,
                &catalog,
                source,
                Duration::from_secs(a.timeout.max(1)),
            );
            if a.replicas.is_none() && old_replicas.is_none() {
                old_replicas = Some(pf.placement()?.replicas);
            }
            Box::new(pf)
        }
        (None, Some(source)) => Box::new(source),
        (None, None) => Box::new(NoFetch),
    };
    let replicas = match (a.replicas, old_replicas) {
        (Some(r), _) | (None, Some(r)) => r,
        (None, None) => {
            return Err(kspeed::Error::InvalidConfig(
                "--replicas is needed for a space with no layout yet and no --peers".into(),
            ))
        }
    };
    let placement = Placement::with_fn(OwnerFn::Jump, a.nodes, replicas)?;
    let opts = RebalanceOptions::new(placement, node_index)
        .commit(a.commit)
        .checkpoint_bytes(a.checkpoint_bytes)
        .progress(progress);
    let r = dataset::rebalance(&a.space, &opts, fetch.as_mut())?;
    if r.up_to_date {
        println!(
            "space {} already has the layout of {} nodes x {} copies: nothing copied",
            a.space.display(),
            placement.nodes,
            placement.replicas
        );
    } else if r.already_staged {
        println!("the new layout was already staged: nothing copied");
    } else {
        if let Some(at) = r.resumed_at {
            println!("resumed an interrupted rebalance at sample {at}");
        }
        println!(
            "staged node {node_index} of {} ({} copies): kept {} samples ({}) in place, copied {} samples ({}) of {} arriving ({}), {} from peers, {} from the source, in {:.2} s; {} samples ({}) no longer held",
            placement.nodes,
            placement.replicas,
            r.kept_samples,
            HumanBytes(r.kept_bytes),
            r.copied_samples,
            HumanBytes(r.copied_bytes),
            r.arriving_samples,
            HumanBytes(r.arriving_bytes),
            r.from_peers.0,
            r.from_source.0,
            r.stage_time.as_secs_f64(),
            r.dropped_samples,
            HumanBytes(r.dropped_bytes),
        );
    }
    if r.committed && !r.up_to_date {
        println!(
            "committed: the new layout is in use; {} given back",
            HumanBytes(r.reclaimed_bytes)
        );
    } else if !a.commit {
        println!("not committed: when every node has staged, stop the node service and rerun with --commit");
    }
    // One machine-readable line (tests and scripts).
    println!(
        "rebalance: arriving_samples={} arriving_bytes={} copied_samples={} copied_bytes={} kept_samples={} dropped_samples={} dropped_bytes={} staged={} committed={} reclaimed_bytes={}",
        r.arriving_samples,
        r.arriving_bytes,
        r.copied_samples,
        r.copied_bytes,
        r.kept_samples,
        r.dropped_samples,
        r.dropped_bytes,
        r.staged || r.up_to_date,
        r.committed,
        r.reclaimed_bytes
    );
    Ok(())
}

/// No peers and no source: only a layout that needs nothing copied works.
struct NoFetch;

impl Fetch for NoFetch {
    fn fetch(
        &mut self,
        want: &[(u64, u32)],
        _put: &mut dyn FnMut(u64, &[u8]) -> kspeed::Result<()>,
    ) -> kspeed::Result<()> {
        Err(kspeed::Error::SampleUnavailable {
            sample: want.first().map_or(0, |w| w.0),
            tried: "neither --peers nor --from-source was given".into(),
        })
    }
}
