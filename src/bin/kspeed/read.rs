//! `kspeed read`: drain epochs through the Loader and report throughput.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use clap::Args;
use indicatif::HumanBytes;
use kspeed::landing::{CudaMode, LandingOptions};
use kspeed::loader::LoaderBuilder;
use kspeed::progress::{process_cpu_seconds, Progress, ProgressMode};

#[derive(Args)]
pub(crate) struct ReadArgs {
    /// A preloaded space (the fast path).
    #[arg(long, required_unless_present_any = ["source", "mix"])]
    space: Option<PathBuf>,
    /// Or a mixture of datasets read side by side: PATH:WEIGHT,... (PATH a
    /// space, a catalog .ksc or a source; WEIGHT a proportion 0.7,
    /// repeat=R or choose=N), or the flag once per dataset (--mix A:0.7
    /// --mix B:0.3), in the order given. Each epoch's line then counts the
    /// samples of each dataset and gives a digest of the order delivered.
    #[arg(long, conflicts_with_all = ["space", "source"], value_parser = crate::opt_list("mix"))]
    mix: Vec<String>,
    /// Samples per epoch that the mixture's proportions divide.
    #[arg(long, value_parser = crate::opt::<u64>("mix_epoch_size"))]
    mix_epoch_size: Option<u64>,
    /// Or a source read directly: DIR, list:FILE, tar:DIR.
    #[arg(long, conflicts_with = "space")]
    source: Option<String>,
    /// Catalog for --source (otherwise one is built first).
    #[arg(long, requires = "source")]
    catalog: Option<PathBuf>,
    /// Epochs to read.
    #[arg(long, default_value_t = 1)]
    epochs: u64,
    /// First epoch.
    #[arg(long, default_value_t = 0, value_parser = crate::opt::<u64>("start_epoch"))]
    start_epoch: u64,
    /// Samples per batch.
    #[arg(long, default_value_t = 64, value_parser = crate::opt::<usize>("batch_size"))]
    batch_size: usize,
    /// This rank.
    #[arg(long, default_value_t = 0, value_parser = crate::opt::<u32>("rank"))]
    rank: u32,
    /// World size.
    #[arg(long, default_value_t = 1, value_parser = crate::opt::<u32>("world"))]
    world: u32,
    /// Shuffle seed.
    #[arg(long, default_value_t = 0, value_parser = crate::opt::<u64>("seed"))]
    seed: u64,
    /// Read in id order.
    #[arg(long)]
    no_shuffle: bool,
    /// Shuffle within blocks of this many consecutive ids (0: the whole
    /// dataset); reading tar shards in a bucket, a block's samples share
    /// ranged GETs.
    #[arg(long, default_value_t = 0, value_parser = crate::opt::<u64>("shuffle_block"))]
    shuffle_block: u64,
    /// Drop the tail instead of padding.
    #[arg(long)]
    drop_last: bool,
    /// Landing ring size, or auto: six batches of the mean sample, 4 to
    /// 256 MiB (64 MiB up for a mixture, 256 MiB with --cluster), at most
    /// twice the dataset, at least what a batch of the largest samples
    /// needs.
    #[arg(long, default_value = "auto", value_parser = crate::opt_or_auto::<u64>("ring_bytes"))]
    ring_bytes: crate::OrAuto<u64>,
    /// Poller threads (default: a quarter of this rank's slice of cores, at
    /// least 1, at most 8; twice that, at most the slice, where a whole
    /// space is read through the page cache).
    #[arg(long, value_parser = crate::opt::<usize>("pollers"))]
    pollers: Option<usize>,
    /// Reads in flight per poller.
    #[arg(long, default_value_t = 32, value_parser = crate::opt::<u32>("queue_depth"))]
    queue_depth: u32,
    /// Most reads a poller queues before submitting them (one system call per batch).
    #[arg(long, default_value_t = kspeed::loader::DEFAULT_SUBMIT_BATCH, value_parser = crate::opt::<u32>("submit_batch"))]
    submit_batch: u32,
    /// Largest single read; bigger samples are read in parts.
    #[arg(long, default_value = "4MiB", value_parser = crate::opt::<u64>("max_read_bytes"))]
    max_read_bytes: u64,
    /// Most samples read ahead of the consumer (default: what the ring holds).
    #[arg(long, value_parser = crate::opt::<u64>("lookahead"))]
    lookahead: Option<u64>,
    /// Use SQPOLL kernel threads (idle timeout in ms; also --sqpoll-ms).
    #[arg(long, alias = "sqpoll-ms", value_parser = crate::opt::<u32>("sqpoll_idle_ms"))]
    sqpoll_idle_ms: Option<u32>,
    /// Put the landing ring in the memory of this GPU (CUDA device ordinal):
    /// RDMA writes land there directly. Needs --rdma, a cluster and --source;
    /// with --verify every sample is copied back to check its CRC32C.
    #[arg(long, value_parser = crate::opt::<u32>("gpu_ring"))]
    gpu_ring: Option<u32>,
    /// Memory tier budget (e.g. 8GiB); samples in it are served from RAM.
    #[arg(long, default_value = "0", value_parser = crate::opt::<u64>("tier_bytes"))]
    tier_bytes: u64,
    /// An NVMe cache area: samples read from the source are kept in this
    /// folder (rank N's in `rank<N>`) for their next read (docs/CACHE.md).
    /// `:memory:` keeps it in this process's memory instead (the same
    /// policy; nothing on disk, gone at exit).
    #[arg(long)]
    cache_dir: Option<PathBuf>,
    /// The cache area's budget (e.g. 400GiB).
    #[arg(long, default_value = "0", value_parser = crate::opt::<u64>("cache_bytes"))]
    cache_bytes: u64,
    /// What the cache area keeps: next-use (what is read soonest, each
    /// write weighed), min (Belady's MIN: the fewest source reads) or lru.
    #[arg(long, default_value = "next-use", value_parser = ["next-use", "min", "lru"])]
    cache_policy: String,
    /// A memory level above the cache area on disk (`--cache-dir` a
    /// folder): an area of this many bytes in this process's memory, read
    /// first, by the same policy (docs/CACHE.md, "Two levels").
    #[arg(long, default_value = "0", value_parser = crate::opt::<u64>("cache_memory_bytes"))]
    cache_memory_bytes: u64,
    /// Hand out samples that sit in the memory tier in place instead of
    /// copying them into the landing ring (a batch is then not one span);
    /// attached to an agent with a node tier (`--agent`), read-only views
    /// of that tier. `--json` counts them (`tier_views`).
    #[arg(long)]
    tier_views: bool,
    /// Read every byte of every sample (fold them into a checksum) as a
    /// consumer that looks at its data would; without it only lengths are
    /// taken.
    #[arg(long)]
    touch: bool,
    /// Create the pollers' io_urings with IORING_SETUP_COOP_TASKRUN
    /// (completions wait for the poller's next system call instead of
    /// interrupting it; for comparisons).
    #[arg(long)]
    coop_taskrun: bool,
    /// Check every sample's CRC32C while reading.
    #[arg(long)]
    verify: bool,
    /// Bind the ring to this NUMA node.
    #[arg(long, value_parser = crate::opt::<u32>("numa_node"))]
    numa_node: Option<u32>,
    /// Bind the ring to the NUMA node of this GPU (PCI address, e.g. 0000:3b:00.0).
    #[arg(long)]
    gpu_pci: Option<String>,
    /// Plain reads instead of reads into io_uring registered buffers.
    #[arg(long)]
    no_registered_buffers: bool,
    /// Plain descriptors instead of io_uring registered files.
    #[arg(long)]
    no_registered_files: bool,
    /// How the space is read: auto (through the page cache when nearly all
    /// of it is cached, else O_DIRECT), off (always O_DIRECT), on (always
    /// the page cache).
    #[arg(long, default_value = "auto", value_parser = ["auto", "off", "on"])]
    page_cache: String,
    /// Normal pages only (no huge pages, no THP advice).
    #[arg(long)]
    no_huge_pages: bool,
    /// Do not pin pollers to cores.
    #[arg(long)]
    no_pin: bool,
    /// This process's rank among the node's ranks (default:
    /// KSPEED_LOCAL_RANK, LOCAL_RANK, OMPI_COMM_WORLD_LOCAL_RANK,
    /// MPI_LOCALRANKID or SLURM_LOCALID); each local rank's pollers get
    /// their own slice of the node's cores.
    #[arg(long, requires = "local_world_size", value_parser = crate::opt::<u32>("local_rank"))]
    local_rank: Option<u32>,
    /// Ranks on this node (default: KSPEED_LOCAL_WORLD_SIZE,
    /// LOCAL_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_SIZE, MPI_LOCALNRANKS or
    /// SLURM_NTASKS_PER_NODE, else this node's SLURM_TASKS_PER_NODE).
    #[arg(long, requires = "local_rank", value_parser = crate::opt::<u32>("local_world_size"))]
    local_world_size: Option<u32>,
    /// Take the pollers' cores from this NUMA node (default: the ring's,
    /// from --numa-node or --gpu-pci).
    #[arg(long, value_parser = crate::opt::<u32>("poller_numa_node"))]
    poller_numa_node: Option<u32>,
    /// Do not mlock the ring.
    #[arg(long)]
    no_mlock: bool,
    /// Busy-poll time before parking, in microseconds (default: 0 on up to
    /// 4 cores or on cores shared with other local ranks, 20 above).
    #[arg(long, value_parser = crate::opt::<u64>("spin_us"))]
    spin_us: Option<u64>,
    /// Before reading, let the pollers fill the ring, then measure the CPU
    /// they use over this many ms while nobody consumes (idle cost).
    #[arg(long, default_value_t = 0)]
    idle_ms: u64,
    /// Simulated compute per batch, in microseconds (to see stalls).
    #[arg(long, default_value_t = 0)]
    compute_us: u64,
    #[command(flatten)]
    pub(crate) nodes: crate::node_args::NodeListArgs,
    /// Cluster mode from the launcher's environment: rank and world from
    /// torchrun (RANK, WORLD_SIZE, LOCAL_WORLD_SIZE), Open MPI
    /// (OMPI_COMM_WORLD_RANK, ...), MPICH (PMI_RANK, ...) or srun
    /// (SLURM_PROCID, SLURM_NTASKS, ...), innermost first, which also set
    /// --rank and --world; the node list,
    /// unless given by --cluster/--nodelist/--nodes-dns, from KSPEED_NODES,
    /// else KSPEED_NODES_DNS (+ KSPEED_NODE_COUNT), else SLURM_JOB_NODELIST,
    /// else MASTER_ADDR (one node). docs/DEPLOY.md.
    #[arg(long)]
    cluster_env: bool,
    /// Job token file for the node services (not needed with --agent
    /// required: the node agent holds it).
    #[arg(long)]
    token_file: Option<PathBuf>,
    /// How long a node may stay silent with grants outstanding before its
    /// samples fail over, in ms.
    #[arg(long, default_value_t = 10_000, value_parser = crate::opt::<u64>("node_timeout_ms"))]
    node_timeout_ms: u64,
    #[command(flatten)]
    rdma: RdmaArgs,
    /// Print the final report as one JSON object instead of text.
    #[arg(long)]
    json: bool,
    /// Read through the node's `kspeed agent`: required, auto (cluster
    /// mode, where the agent can serve this read) or off.
    #[arg(long, default_value = "auto", value_parser = ["auto", "off", "required"])]
    agent: String,
    /// The agent's socket (default: $KSPEED_AGENT_SOCKET, else
    /// /run/kspeed/agent.sock).
    #[arg(long)]
    agent_socket: Option<PathBuf>,
    /// Attached: when the agent goes, wait this long (ms) for an agent at
    /// the same socket and continue where this rank stood (0: fail).
    #[arg(long, default_value_t = 0, value_parser = crate::opt::<u64>("agent_restart_wait_ms"))]
    agent_restart_wait_ms: u64,
    /// Report an order-sensitive digest of every sample's id and bytes
    /// (CRC32C chained in delivery order) to compare two runs exactly.
    #[arg(long)]
    digest: bool,
}

/// The RDMA transport's options, shared by `read` and `serve`.
#[derive(clap::Args, Debug, Clone)]
pub(crate) struct RdmaArgs {
    /// Move sample bytes with RDMA WRITE (serve: offer it; read: use it,
    /// every node must offer it) instead of TCP frames.
    #[arg(long)]
    pub(crate) rdma: bool,
    /// RDMA device (default: the first one, as `ibv_devices` lists them).
    #[arg(long, requires = "rdma")]
    pub(crate) rdma_device: Option<String>,
    /// RDMA port number.
    #[arg(long, default_value_t = 1, requires = "rdma", value_parser = crate::opt::<u8>("rdma_port"))]
    pub(crate) rdma_port: u8,
    /// GID index, or `auto` (the default): the RoCE v2 GID of the address
    /// the TCP control connection uses.
    #[arg(long, requires = "rdma", value_parser = crate::opt_or_auto::<u8>("rdma_gid_index"))]
    pub(crate) rdma_gid_index: Option<crate::OrAuto<u8>>,
}

impl RdmaArgs {
    pub(crate) fn options(&self) -> Option<kspeed::transport::RdmaOptions> {
        self.rdma.then(|| {
            kspeed::transport::RdmaOptions::default()
                .device(self.rdma_device.clone())
                .port(self.rdma_port)
                .gid_index(self.rdma_gid_index.and_then(|g| g.0))
        })
    }
}

pub(crate) fn run(a: ReadArgs, progress: ProgressMode) -> kspeed::Result<()> {
    let mut b = match (&a.space, &a.source) {
        _ if !a.mix.is_empty() => {
            let entries = a.mix.iter().flat_map(|m| m.split(','));
            let b = LoaderBuilder::mix(
                entries
                    .map(kspeed::loader::parse_mix_entry)
                    .collect::<kspeed::Result<Vec<_>>>()?,
            );
            match a.mix_epoch_size {
                Some(n) => b.mix_epoch_size(n),
                None => b,
            }
        }
        (Some(s), _) => LoaderBuilder::space(s),
        (None, Some(src)) => {
            let b = LoaderBuilder::source(src);
            match &a.catalog {
                Some(c) => b.catalog(c),
                None => {
                    // Not silent: on a large source this takes a while.
                    eprintln!(
                        "no --catalog: building a catalog of {src} first (reads every file to \
                         checksum it); `kspeed catalog --source {src} --out FILE` once, then \
                         --catalog FILE, skips this"
                    );
                    b
                }
            }
        }
        (None, None) => unreachable!("clap requires one"),
    };
    b = b
        .batch_size(a.batch_size)
        .rank(a.rank, a.world)
        .seed(a.seed)
        .shuffle(!a.no_shuffle)
        .shuffle_block(a.shuffle_block)
        .drop_last(a.drop_last)
        .landing(
            LandingOptions::default()
                .ring_bytes(a.ring_bytes.0.unwrap_or(0))
                .huge_pages(!a.no_huge_pages)
                .mlock(!a.no_mlock)
                .numa_node(a.numa_node)
                .gpu_pci(a.gpu_pci.clone())
                .cuda(CudaMode::Auto),
        )
        .queue_depth(a.queue_depth)
        .submit_batch(a.submit_batch)
        .max_read_bytes(a.max_read_bytes)
        .sqpoll(a.sqpoll_idle_ms)
        .tier_bytes(a.tier_bytes)
        .tier_views(a.tier_views)
        .cache_dir(a.cache_dir.clone())
        .cache_bytes(a.cache_bytes)
        .cache_policy(kspeed::cache::CachePolicy::parse(&a.cache_policy).expect("clap checked it"))
        .cache_memory_bytes(a.cache_memory_bytes)
        .coop_taskrun(a.coop_taskrun)
        // A GPU ring cannot be read by the CPU: --verify copies back below.
        .verify_crc32c(a.verify && a.gpu_ring.is_none())
        .gpu_ring(a.gpu_ring)
        .registered_buffers(!a.no_registered_buffers)
        .registered_files(!a.no_registered_files)
        .page_cache(kspeed::loader::PageCache::parse(&a.page_cache).expect("clap checked it"))
        .pin(!a.no_pin)
        .poller_numa_node(a.poller_numa_node)
        .start_at(kspeed::sampler::Position {
            epoch: a.start_epoch,
            index: 0,
        })
        // Nothing is read ahead past the last epoch asked for.
        .end_epoch(a.start_epoch.checked_add(a.epochs).filter(|_| a.epochs > 0))
        .agent(kspeed::loader::AgentMode::parse(&a.agent).expect("clap checked it"))
        .agent_socket(a.agent_socket.clone())
        .agent_restart_wait(Duration::from_millis(a.agent_restart_wait_ms));
    if let Some(p) = a.pollers {
        b = b.pollers(p);
    }
    if let Some(us) = a.spin_us {
        b = b.spin(Duration::from_micros(us));
    }
    if let (Some(r), Some(w)) = (a.local_rank, a.local_world_size) {
        b = b.local_rank(r, w);
    }
    let spec = a.nodes.spec(a.cluster_env);
    let cluster_mode = spec.is_set();
    let cluster = match spec.resolve()? {
        Some((c, env)) => {
            if let Some(env) = env {
                b = b.rank(env.rank, env.world);
            }
            Some(c)
        }
        None => None,
    };
    if let Some(c) = cluster {
        let token = match &a.token_file {
            Some(f) => crate::read_token(f)?,
            // Attached, the rank connects to no node: the agent holds the
            // token, which then need not be readable by the job at all.
            None if a.agent == "required" => Vec::new(),
            None => {
                return Err(kspeed::Error::InvalidConfig(
                    "cluster mode needs --token-file (or --agent required: the node agent then holds it)"
                        .into(),
                ))
            }
        };
        b = b
            .cluster(c)
            .token(&token)
            .node_timeout(Duration::from_millis(a.node_timeout_ms))
            .rdma(a.rdma.options());
    } else if a.rdma.rdma {
        return Err(kspeed::Error::InvalidConfig(
            "--rdma is for cluster mode (--cluster, --nodelist, --nodes-dns or --cluster-env)"
                .into(),
        ));
    }
    if let Some(l) = a.lookahead {
        b = b.lookahead(l);
    }
    let setup0 = process_cpu_seconds();
    let mut loader = b.build()?;
    let cpu0 = process_cpu_seconds();
    let setup_cpu = cpu0 - setup0;
    let info = loader.landing_info();
    eprintln!(
        "landing ring: {}{} ({}, {}locked{}); {}; io_uring: {}",
        HumanBytes(info.bytes),
        if a.ring_bytes.0.is_none() {
            " sized from the batch (--ring-bytes sets it)"
        } else {
            ""
        },
        if info.huge_pages {
            "2 MiB huge pages"
        } else {
            "normal pages, transparent huge pages requested"
        },
        if info.locked { "" } else { "not " },
        info.numa_node
            .map(|n| format!(", NUMA node {n}"))
            .unwrap_or_default(),
        info.cuda,
        info.io
    );
    eprintln!("pollers: {}", loader.placement().describe());
    if let Some((n, bytes)) = loader.tier() {
        eprintln!("memory tier: {n} samples, {}", HumanBytes(bytes));
    }
    let per_epoch: u64 = {
        let cat = loader.catalog();
        (cat.total_bytes() as f64 * loader.epoch_len() as f64 / cat.len() as f64) as u64
    };
    let mut idle_core_fraction = None;
    if a.idle_ms > 0 {
        // Fill: the pollers (which otherwise wait for the first batch)
        // read ahead until the ring is full.
        loader.start_reading();
        std::thread::sleep(Duration::from_millis(a.idle_ms / 2 + 500));
        let (c0, w0) = (process_cpu_seconds(), Instant::now());
        std::thread::sleep(Duration::from_millis(a.idle_ms));
        let used = process_cpu_seconds() - c0;
        idle_core_fraction = Some(used / w0.elapsed().as_secs_f64());
        if !a.json {
            println!(
                "idle: {:.2}% of one core over {:.1} s with the ring full and nobody consuming",
                100.0 * used / w0.elapsed().as_secs_f64(),
                w0.elapsed().as_secs_f64()
            );
        }
    }
    let cpu0 = if a.idle_ms > 0 {
        process_cpu_seconds()
    } else {
        cpu0
    };
    let t0 = Instant::now();
    let mut epoch_lines = Vec::new();
    let mut epoch_reports = Vec::with_capacity(a.epochs.min(1 << 16) as usize);
    let mut host = Vec::new();
    let mut touched = 0u64;
    let mut digest = 0u32;
    // Samples handed out in place in the memory tier (`--tier-views`).
    let mut views = 0u64;
    for e in a.start_epoch..a.start_epoch + a.epochs {
        loader.set_epoch(e)?;
        let bar = Progress::new(&format!("epoch {e}"), per_epoch, progress);
        let (te, at_start) = (Instant::now(), loader.stats());
        let (s0, b0) = (at_start.samples, at_start.bytes);
        let gpu = loader.landing_device().is_some();
        let mut per_dataset = vec![0u64; loader.dataset_offsets().len()];
        let mut order_digest = 0u64;
        while loader.acquire_batch()? > 0 {
            let mut bytes = 0;
            for i in 0..loader.held_len() {
                if !a.mix.is_empty() {
                    // The order, not just the set: each id folded after
                    // the ones before it.
                    let s = loader.held_sample(i);
                    per_dataset[s.dataset as usize] += 1;
                    order_digest = kspeed::hash::mix64(order_digest.rotate_left(7) ^ s.id);
                }
                if gpu {
                    // The batch is device addresses; --verify copies each
                    // sample back and checks it against the catalog.
                    let s = loader.held_device_sample(i);
                    bytes += s.len;
                    if a.verify {
                        check_gpu_sample(&loader, &s, &mut host)?;
                    }
                } else {
                    let sample = loader.held_sample(i);
                    let s = sample.bytes;
                    bytes += s.len();
                    views += u64::from(sample.in_tier);
                    if a.digest {
                        digest = crc32c::crc32c_append(digest, &sample.id.to_le_bytes());
                        digest = crc32c::crc32c_append(digest, s);
                    }
                    if a.touch {
                        touched ^= fold(s);
                    }
                }
            }
            bar.add(bytes as u64);
            // The batch stays held while the simulated step computes, as a
            // trainer holds it.
            if a.compute_us > 0 {
                let until = Instant::now() + Duration::from_micros(a.compute_us);
                while Instant::now() < until {
                    std::hint::spin_loop();
                }
            }
            loader.release_batch();
        }
        bar.finish();
        let st = loader.stats();
        let secs = te.elapsed().as_secs_f64();
        epoch_reports.push(crate::read_json::EpochReport::between(
            e, &at_start, &st, secs,
        ));
        epoch_lines.push(format!(
            "epoch {e}: {} samples, {} in {:.2} s ({:.0} samples/s, {}/s)",
            st.samples - s0,
            HumanBytes(st.bytes - b0),
            secs,
            (st.samples - s0) as f64 / secs,
            HumanBytes(((st.bytes - b0) as f64 / secs) as u64)
        ));
        if !a.mix.is_empty() {
            let counts: Vec<String> = per_dataset
                .iter()
                .enumerate()
                .map(|(d, n)| format!("{n} from dataset {d}"))
                .collect();
            epoch_lines.push(format!(
                "epoch {e} mixture: {}; order digest {order_digest:016x}",
                counts.join(", ")
            ));
        }
    }
    let wall = t0.elapsed().as_secs_f64();
    std::hint::black_box(touched);
    let placement = loader.placement().clone();
    // The pollers register the ring once they have written it all: say
    // how they read into it by the end.
    let io_at_end = loader.landing_info().io;
    let attached = loader.attached();
    let st = loader.finish();
    let cpu = process_cpu_seconds() - cpu0;
    if a.json {
        let cluster = cluster_mode.then_some(if a.rdma.rdma { "rdma" } else { "tcp" });
        crate::read_json::print(
            &st,
            &placement,
            &crate::read_json::Run {
                epochs: a.epochs,
                wall_secs: wall,
                cpu_secs: cpu,
                setup_cpu_secs: setup_cpu,
                idle_core_fraction,
                cluster,
                digest: a.digest.then_some(digest),
                tier_views: a.tier_views.then_some(views),
                per_epoch: epoch_reports,
            },
        );
        return Ok(());
    }
    eprintln!("landing ring at the end: io_uring: {io_at_end}");
    for l in epoch_lines {
        println!("{l}");
    }
    if a.digest {
        println!("digest: {digest:08x}");
    }
    if a.tier_views {
        println!("tier views: {views} samples handed out in place in the memory tier");
    }
    println!(
        "read {} samples, {} in {:.2} s: {:.0} samples/s, {:.3} GB/s",
        st.samples,
        HumanBytes(st.bytes),
        wall,
        st.samples as f64 / wall,
        st.bytes as f64 / wall / 1e9
    );
    println!(
        "read latency{}: p50 {} us, p99 {} us, max {} us ({} disk reads, {} tier hits, {} retries, {} loop stalls)",
        if attached {
            " (the node agent's reads, to a power of two)"
        } else {
            ""
        },
        st.read_latency.p50_us,
        st.read_latency.p99_us,
        st.read_latency.max_us,
        st.disk_reads,
        st.tier_hits,
        st.retries,
        st.loop_stalls
    );
    println!(
        "delivered {} samples; read ahead and not consumed: {}",
        st.samples, st.read_ahead_discarded
    );
    if !cluster_mode && st.source_reads > 0 {
        println!(
            "partial space: {} samples ({}) read from the source",
            st.source_reads,
            HumanBytes(st.source_bytes)
        );
    }
    if st.cache.slots == 0 && st.cache.hits > 0 {
        // Attached: the agent's area (its other counters stay the
        // agent's, logged there).
        println!(
            "cache area (the node agent's): {} hits for this rank",
            st.cache.hits
        );
    }
    for (what, c) in [
        ("cache area in memory above it", &st.cache_memory),
        ("cache area", &st.cache),
    ] {
        if c.slots == 0 {
            continue;
        }
        println!(
            "{what}: {} hits ({}; the policy planned {}), {} samples kept ({}), {} not kept (writer behind), {} corrupt, {} write errors; holds {} of {} slots",
            c.hits,
            HumanBytes(c.hit_bytes),
            c.planned_hits,
            c.writes,
            HumanBytes(c.write_bytes),
            c.skipped,
            c.corrupt,
            c.write_errors,
            c.held,
            c.slots
        );
    }
    let lead = st.source_lead;
    if lead.count > 0 {
        println!(
            "source samples ready before they were asked for: p10 {:.1} ms, median {:.1} ms ahead; {} of {} late (waited for)",
            lead.p10.as_secs_f64() * 1e3,
            lead.p50.as_secs_f64() * 1e3,
            lead.late,
            lead.count
        );
    }
    if cluster_mode {
        println!(
            "cluster ({}): {} samples pushed by other nodes, {} failed over, {} read from the source",
            if a.rdma.rdma { "RDMA" } else { "TCP" },
            st.remote_samples, st.failovers, st.source_reads
        );
    }
    println!(
        "stall: {:.1}% ({:.2} s waiting in next_batch); CPU: {:.2} s ({:.2} s per GB) reading, plus {:.2} s to open (catalog, ring, pollers)",
        100.0 * st.stall.as_secs_f64() / wall,
        st.stall.as_secs_f64(),
        cpu,
        cpu / (st.bytes as f64 / 1e9).max(1e-9),
        setup_cpu
    );
    let c = &st.stall_causes;
    if !st.stall.is_zero() {
        let mut line = format!(
            "stall by cause: disk {:.2} s, tier {:.2} s, source {:.2} s, peers {:.2} s, agent {:.2} s (failover {:.2} s)",
            c.disk.as_secs_f64(),
            c.tier.as_secs_f64(),
            c.source.as_secs_f64(),
            c.peers.as_secs_f64(),
            c.agent.as_secs_f64(),
            c.failover.as_secs_f64()
        );
        for p in c.slowest_peers.iter().filter(|p| p.waits > 0) {
            line.push_str(&format!(
                "; node {}: {:.2} s over {} waits",
                p.node,
                p.stall.as_secs_f64(),
                p.waits
            ));
            if !(p.read + p.send + p.link).is_zero() {
                line.push_str(&format!(
                    " (at the node reading {:.2} s, sending {:.2} s; link {:.2} s)",
                    p.read.as_secs_f64(),
                    p.send.as_secs_f64(),
                    p.link.as_secs_f64()
                ));
            }
        }
        println!("{line}");
    }
    Ok(())
}

/// Copies sample `s` out of the GPU ring into `host` and checks its CRC32C
/// against the catalog.
fn check_gpu_sample(
    loader: &kspeed::loader::Loader,
    s: &kspeed::loader::DeviceSample,
    host: &mut Vec<u8>,
) -> kspeed::Result<()> {
    let dev = loader.landing_device().expect("a GPU ring");
    host.resize(s.len, 0);
    dev.copy_to_host(s.offset as usize, host)
        .map_err(|e| kspeed::Error::Cuda(format!("copying sample {} to the host: {e}", s.id)))?;
    let want = loader.catalog().sample(s.id).crc32c;
    let got = crc32c::crc32c(host);
    if got != want {
        return Err(kspeed::Error::SampleCorrupt {
            sample: s.id,
            path: "the GPU landing ring".into(),
            expected: want,
            computed: got,
        });
    }
    Ok(())
}

/// XOR of the sample's bytes in 8-byte words (the tail zero-padded): reads
/// every byte, for `--touch`.
fn fold(bytes: &[u8]) -> u64 {
    let mut chunks = bytes.chunks_exact(8);
    let mut x = 0u64;
    for c in &mut chunks {
        x ^= u64::from_le_bytes(c.try_into().expect("8 bytes"));
    }
    let mut tail = [0u8; 8];
    tail[..chunks.remainder().len()].copy_from_slice(chunks.remainder());
    x ^ u64::from_le_bytes(tail)
}
