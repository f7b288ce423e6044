//! `kspeed agent`: the node agent's arguments and its run.

use std::path::PathBuf;

use clap::Args;

#[derive(Args)]
pub(crate) struct AgentArgs {
    /// The node's preloaded space. Given more than once (`--space A
    /// --space B`): a mixture's spaces, served side by side in one id space
    /// in this order to ranks that mix exactly these datasets (any weights),
    /// as `kspeed serve --space A --space B` serves them to other nodes.
    #[arg(long, required = true)]
    space: Vec<PathBuf>,
    /// The attach socket (default: $KSPEED_AGENT_SOCKET, else
    /// /run/kspeed/agent.sock).
    #[arg(long)]
    socket: Option<PathBuf>,
    /// Pollers per attached rank (each its own io_uring and share of the
    /// rank's schedule), run by the node's poller threads.
    #[arg(long, default_value_t = 1, value_parser = crate::opt::<usize>("pollers"))]
    pollers: usize,
    /// The node's poller threads, which take turns for every attached
    /// rank's pollers (default: a quarter of the agent's cores, 1 to 8;
    /// 0 to 64); 0: a thread per poller, as embedded loaders run them.
    #[arg(long, value_parser = clap::value_parser!(u8).range(0..=64))]
    node_pollers: Option<u8>,
    /// Pin the node's poller threads to these cores (a CPU list such as
    /// 0-3 or 0,2, 1 to 64 distinct cores: thread k to the k-th, round
    /// robin; with no --node-pollers, one thread per distinct core listed).
    /// Each must be one the agent may run on. Default: not pinned.
    #[arg(long, value_parser = parse_cores, allow_hyphen_values = true)]
    node_poller_cores: Option<CoreList>,
    /// Reads in flight per poller.
    #[arg(long, default_value_t = 32, value_parser = crate::opt::<u32>("queue_depth"))]
    queue_depth: u32,
    /// Plain reads instead of reads into io_uring registered buffers.
    #[arg(long)]
    no_registered_buffers: bool,
    /// Heartbeat period in ms (a rank counts the agent gone after 3).
    #[arg(long, default_value_t = 100)]
    heartbeat_ms: u64,
    /// A root agent also serves other users' ranks (a system service;
    /// give the socket a mode they can connect with, e.g. --socket-mode 666).
    #[arg(long)]
    allow_other_uids: bool,
    /// The socket file's mode, octal (default 660: the agent's user and group).
    #[arg(long, default_value = "660", value_parser = parse_octal_mode)]
    socket_mode: u32,
    /// The node's memory tier (e.g. 8GiB): one for every attached rank,
    /// filled from any rank's reads and served to all; 0: none.
    #[arg(long, default_value = "0", value_parser = crate::opt::<u64>("tier_bytes"))]
    tier_bytes: u64,
    /// Do not lock the node tier in memory (locking it needs
    /// RLIMIT_MEMLOCK of at least --tier-bytes).
    #[arg(long)]
    no_mlock: bool,
    /// An NVMe cache area for what the attached ranks read from the
    /// source (a partial space's others, in a cluster those no node holds),
    /// kept across agent restarts (docs/CACHE.md, "The cache area";
    /// docs/AGENT.md, "The node's cache area"). With --cache-scope node
    /// (the default) one area, DIR/node, for the node's ranks of one job:
    /// what one rank fetched is a hit for the others. `:memory:` keeps the
    /// area(s) in the agent's memory instead (the same policy, a space's
    /// samples too; nothing on disk; the node's gone when the agent stops,
    /// a rank's with --cache-scope rank when that rank detaches). Needs
    /// --cache-bytes.
    #[arg(long, requires = "cache_bytes")]
    cache_dir: Option<PathBuf>,
    /// The cache area's budget (e.g. 400GiB; each rank's with
    /// --cache-scope rank).
    #[arg(long, requires = "cache_dir", value_parser = crate::opt::<u64>("cache_bytes"))]
    cache_bytes: Option<u64>,
    /// What the cache area keeps: next-use (what is read soonest, each
    /// write weighed), min (Belady's MIN: the fewest source reads) or lru.
    #[arg(long, default_value = "next-use", value_parser = ["next-use", "min", "lru"])]
    cache_policy: String,
    /// node: one cache area for the node's ranks, planned over all their
    /// reads (the default); rank: one per rank under DIR/rank<N>, each
    /// planned along its rank's reads, as an embedded loader's.
    #[arg(long, default_value = "node", requires = "cache_dir", value_parser = ["node", "rank"])]
    cache_scope: String,
    /// The largest ring a rank may attach (the agent's memory grows with
    /// it); a larger one is refused by name.
    #[arg(long, default_value = "64GiB", value_parser = crate::parse_bytes)]
    max_ring_bytes: u64,
    /// How the space is read for the attached ranks: auto (through the
    /// page cache when nearly all of it is cached as a rank attaches, else
    /// O_DIRECT), off (always O_DIRECT), on (always the page cache), as a
    /// loader's `page_cache`. (`--page-cache`, a node service flag, is how
    /// the agent sends to other nodes' consumers.)
    #[arg(long, default_value = "auto", value_parser = ["auto", "off", "on"])]
    read_page_cache: String,
    /// In a cluster (the space holds this node's share): the node list.
    /// Attached ranks then read the rest from the other nodes.
    #[command(flatten)]
    nodes: crate::node_args::NodeListArgs,
    /// Job token file for the node services (needed with a node list, and
    /// with --listen).
    #[arg(long)]
    token_file: Option<PathBuf>,
    /// How long a node may stay silent with grants outstanding before its
    /// samples fail over, in ms.
    #[arg(long, default_value_t = 10_000, value_parser = crate::opt::<u64>("node_timeout_ms"))]
    node_timeout_ms: u64,
    /// In a cluster over TCP: network threads shared by the attached
    /// ranks, each with one connection to every other node (a rank joins
    /// the one with the fewest). Raise it when one thread cannot receive
    /// what the node's ranks read (it receives every byte over TCP).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=64))]
    net_threads: u16,
    /// Also serve this node's space to the other nodes' consumers, as
    /// `kspeed serve --listen` would, from this process (host:port; the
    /// node list's address of this node). The service's tuning flags below
    /// (--staging-bytes ... --rdma-spin-us) are serve's and need --listen.
    #[arg(long)]
    listen: Option<String>,
    /// Prometheus metrics on this address (host:port, port 0 picks one;
    /// printed as `metrics on http://ADDR/metrics`): the agent's ranks and
    /// what its loaders waited for (by cause, and in a cluster the 4 peer
    /// nodes waited for longest); with --listen, the node service's too.
    #[arg(long)]
    metrics: Option<String>,
    #[command(flatten)]
    service: crate::serve_args::NodeServiceArgs,
    #[command(flatten)]
    rdma: crate::read::RdmaArgs,
}

/// A CPU list as one argument (clap would take a `Vec` for many).
#[derive(Clone, Debug)]
struct CoreList(Vec<u32>);

fn parse_cores(s: &str) -> Result<CoreList, String> {
    if s.trim_start().starts_with('-') {
        return Err(format!("{s:?}: core numbers are 0 or more (e.g. 0-3)"));
    }
    let cores = kspeed::placement::parse_cpulist(s)?;
    if cores.is_empty() || cores.len() > 64 {
        return Err(format!(
            "{s:?} lists {} cores: give 1 to 64 distinct cores the agent may run on (e.g. 0-3)",
            cores.len()
        ));
    }
    Ok(CoreList(cores))
}

fn parse_octal_mode(s: &str) -> Result<u32, String> {
    u32::from_str_radix(s, 8)
        .ok()
        .filter(|m| *m <= 0o777)
        .ok_or_else(|| format!("{s:?} is not an octal file mode (e.g. 660)"))
}

/// `kspeed agent`: serves until SIGINT or SIGTERM.
pub(crate) fn run_agent(a: AgentArgs) -> kspeed::Result<()> {
    let mut cfg = kspeed::agent::node::AgentConfig::new(
        &a.space[0],
        a.socket
            .clone()
            .unwrap_or_else(kspeed::loader::default_agent_socket),
    );
    cfg.more_spaces = a.space[1..].to_vec();
    cfg.pollers = a.pollers;
    if let Some(CoreList(cores)) = &a.node_poller_cores {
        cfg.node_pollers = cores.len();
        cfg.node_poller_cores = cores.clone();
    }
    if let Some(n) = a.node_pollers {
        cfg.node_pollers = usize::from(n);
    }
    cfg.queue_depth = a.queue_depth;
    cfg.registered_buffers = !a.no_registered_buffers;
    cfg.heartbeat = std::time::Duration::from_millis(a.heartbeat_ms.max(1));
    cfg.listener.allow_other_uids = a.allow_other_uids;
    cfg.listener.mode = a.socket_mode;
    cfg.tier_bytes = a.tier_bytes;
    cfg.tier_mlock = !a.no_mlock;
    cfg.max_ring_bytes = a.max_ring_bytes;
    cfg.page_cache = kspeed::loader::PageCache::parse(&a.read_page_cache).expect("clap checked it");
    cfg.cache = a
        .cache_dir
        .clone()
        .map(|dir| kspeed::agent::node::AgentCache {
            dir,
            bytes: a.cache_bytes.expect("clap requires it"),
            policy: kspeed::cache::CachePolicy::parse(&a.cache_policy).expect("clap checked it"),
            scope: kspeed::agent::node::CacheScope::parse(&a.cache_scope).expect("clap checked it"),
        });
    let spec = a.nodes.spec(false);
    let token = match (&a.token_file, spec.is_set() || a.listen.is_some()) {
        (Some(f), _) => Some(crate::read_token(f)?),
        (None, true) => return Err(kspeed::Error::InvalidConfig(
            "a node list or --listen needs --token-file (the job token the node services check)"
                .into(),
        )),
        (None, false) => None,
    };
    if let Some((cluster, _)) = spec.resolve()? {
        cfg.cluster = Some(kspeed::agent::cluster::AgentCluster {
            cluster,
            token: token.clone().expect("checked above"),
            node_timeout: std::time::Duration::from_millis(a.node_timeout_ms),
            rdma: a.rdma.options(),
            net_threads: a.net_threads.into(),
        });
    } else if a.rdma.rdma && a.listen.is_none() {
        return Err(kspeed::Error::InvalidConfig(
            "--rdma is for a cluster (a node list) or the node service (--listen)".into(),
        ));
    }
    if let (None, Some(flag)) = (&a.listen, a.service.first_given()) {
        return Err(kspeed::Error::InvalidConfig(format!(
            "{flag} tunes the node service, which the agent runs only with --listen"
        )));
    }
    if let Some(listen) = &a.listen {
        let mut serve = kspeed::transport::ServeConfig::new(
            &a.space[0],
            listen,
            token.as_deref().expect("checked above"),
        );
        serve.more_spaces = a.space[1..].to_vec();
        a.service.apply(&mut serve);
        serve.rdma = a.rdma.options();
        cfg.serve = Some(serve);
    }
    cfg.metrics = a.metrics.clone();
    let space = a
        .space
        .iter()
        .map(|p| p.display().to_string())
        .collect::<Vec<_>>()
        .join(", ");
    let summary =
        kspeed::agent::node::run_until_signal(&cfg, move |sock, node_service, metrics| {
            if let Some(addr) = node_service {
                println!("node service on {addr}");
            }
            if let Some(m) = metrics {
                println!("metrics on http://{m}/metrics");
            }
            // Scripts and tests wait for this line.
            println!("agent serving {space} on {}", sock.display());
            use std::io::Write;
            let _ = std::io::stdout().flush();
        })?;
    eprintln!(
        "agent stopped: {} ranks attached, {} refused, {} ended",
        summary.attached, summary.refused, summary.ended
    );
    if summary.tier_fills_refused > 0 {
        eprintln!(
            "agent: {} node tier fills refused (a rank's ring changed while the agent copied from it)",
            summary.tier_fills_refused
        );
    }
    Ok(())
}
