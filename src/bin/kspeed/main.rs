//! The `kspeed` command line.
//!
//! Exit status: 0 success, 1 error (the message names what and where; also
//! `verify` when samples could not be read: I/O errors), 2 usage error,
//! 3 `verify` found corrupt or missing samples, or `audit` found samples
//! not delivered exactly once.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use clap::{Args, Parser, Subcommand};
use indicatif::HumanBytes;
use kspeed::dataset::gen::{self, GenOptions, Profile};
use kspeed::dataset::{self, BuildOptions, Catalog, Placement, PreloadOptions, SourceSpec, Space};
use kspeed::progress::ProgressMode;

mod agent_cmd;
mod audit;
mod inspect;
mod ls;
mod node_args;
mod read;
mod read_json;
mod rebalance_cmd;
mod serve_args;
mod verify_cmd;

#[derive(Parser)]
#[command(name = "kspeed", version, about = "Feed GPU training jobs without I/O stalls", long_about = None)]
struct Cli {
    /// Progress display: auto (bar on a terminal, lines otherwise), bar, lines, none.
    #[arg(long, global = true, default_value = "auto")]
    progress: ProgressMode,
    /// More log output (-v info, -vv debug). RUST_LOG overrides.
    #[arg(short, long, global = true, action = clap::ArgAction::Count)]
    verbose: u8,
    /// Object-store sources (s3://): the endpoint of an S3-compatible store,
    /// e.g. http://127.0.0.1:9000 (else AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL,
    /// the profile's endpoint_url, else AWS itself).
    #[arg(long, global = true, value_name = "URL")]
    endpoint_url: Option<String>,
    /// Object-store sources (s3://): the profile of ~/.aws/credentials and
    /// ~/.aws/config to take credentials, region and endpoint from (else
    /// the AWS_* variables, AWS_PROFILE, default).
    #[arg(long, global = true, value_name = "NAME")]
    aws_profile: Option<String>,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Generate a synthetic ImageFolder dataset (for tests and benchmarks).
    Gen(GenArgs),
    /// Build a catalog of a source without preloading it.
    Catalog(CatalogArgs),
    /// Copy the samples this node holds into a space (idempotent, resumable).
    Preload(PreloadArgs),
    /// Change a space's node count, copying only the samples whose holder
    /// changed (stage beside a running serve; --commit when every node staged).
    Rebalance(rebalance_cmd::RebalanceArgs),
    /// Remove a space.
    Unload(SpaceArg),
    /// Summarise a space or a catalog.
    Inspect(InspectArgs),
    /// Re-read every sample of a space and check its CRC32C.
    Verify(VerifyArgs),
    /// List the samples of a space or catalog: id, label, class, length,
    /// CRC32C, holder nodes, source path (filters: --ids, --class, --path).
    Ls(ls::LsArgs),
    /// Write one sample's bytes from the space to stdout, checked against its CRC32C.
    Cat(ls::CatArgs),
    /// Drain epochs through the loader (io_uring pollers, landing ring) and report throughput.
    Read(Box<read::ReadArgs>),
    /// Serve this node's space to remote consumers (the cluster's node service).
    Serve(ServeArgs),
    /// Check from every rank's saved position that each sample of an epoch
    /// was delivered exactly once, across resumes at other world sizes (and
    /// a mixture's under other weights).
    Audit(audit::AuditArgs),
    /// Run the node agent: the node's ranks attach (`agent = required` or
    /// `auto`) and its pollers read their samples into their rings
    /// (docs/AGENT.md, docs/DEPLOY.md).
    Agent(Box<agent_cmd::AgentArgs>),
    /// Write the completion script for SHELL to stdout (for packagers:
    /// packaging/README.md).
    #[command(hide = true)]
    Completions {
        /// bash, zsh, fish, elvish or powershell.
        shell: clap_complete::Shell,
    },
    /// Write the man pages (kspeed.1 and kspeed-COMMAND.1) into DIR (for
    /// packagers: packaging/README.md).
    #[command(hide = true)]
    Man {
        /// Output directory (created if missing).
        dir: PathBuf,
    },
}

#[derive(Args)]
struct ServeArgs {
    /// The preloaded space of this node. Give it again to serve several
    /// spaces side by side in one id space, for consumers reading them as
    /// a mixture (`kspeed read --mix A --mix B …` or the `mix` option, the
    /// same spaces in the same order; weights are the consumers' own): every
    /// space must be preloaded for the same nodes and copies.
    #[arg(long = "space", required = true)]
    spaces: Vec<PathBuf>,
    /// Address to listen on, host:port.
    #[arg(long, default_value = "0.0.0.0:7400")]
    listen: String,
    /// File holding the job token consumers must present (whitespace at the end is ignored).
    #[arg(long)]
    token_file: PathBuf,
    /// Poller threads (default: a quarter of the cores, at least 1, at most 8).
    #[arg(long)]
    pollers: Option<usize>,
    #[command(flatten)]
    service: serve_args::NodeServiceArgs,
    /// Serve Prometheus metrics (GET /metrics) on this address, host:port
    /// (port 0 picks one; the address is printed before the "serving" line).
    #[arg(long)]
    metrics: Option<String>,
    #[command(flatten)]
    rdma: read::RdmaArgs,
}

#[derive(Args)]
struct GenArgs {
    /// Size profile: imagenet, audio, volumes, tiny.
    #[arg(long)]
    profile: Profile,
    /// Number of samples.
    #[arg(long)]
    count: u64,
    /// Output directory.
    #[arg(long)]
    out: PathBuf,
    /// Seed (same seed, same tree).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Number of class folders (default: the profile's).
    #[arg(long)]
    classes: Option<u32>,
    /// Writer threads.
    #[arg(long, default_value_t = kspeed::dataset::default_threads())]
    threads: usize,
}

#[derive(Args)]
struct CatalogArgs {
    /// Source: DIR (ImageFolder), list:FILE, tar:SHARD.tar or tar:DIR.
    #[arg(long)]
    source: std::ffi::OsString,
    /// Catalog file to write.
    #[arg(long)]
    out: PathBuf,
    /// Reader threads.
    #[arg(long, default_value_t = kspeed::dataset::default_threads())]
    threads: usize,
    /// Object-store sources (s3://): requests in flight at once, one reader
    /// thread each (the store's latency, not the CPU, bounds a reader).
    #[arg(long, default_value_t = 64)]
    requests: usize,
    /// Permissions (octal) of the catalog file; default 0600 (chmod it, or
    /// give 0644, to share it with other users).
    #[arg(long, default_value = "0600", value_parser = parse_mode)]
    file_mode: u32,
    #[command(flatten)]
    scan: ScanArgs,
}

/// How a source scan treats what is not a plain sample.
#[derive(Args)]
struct ScanArgs {
    /// Skip FIFOs, devices, sockets and dangling symlinks in the source
    /// (reported with a count) instead of refusing them.
    #[arg(long)]
    skip_special: bool,
    /// Follow symbolic links that lead outside the source tree (refused by default).
    #[arg(long)]
    follow_symlinks: bool,
    /// Tar shards: skip a damaged member header to the next intact one,
    /// reporting each skip, instead of failing.
    #[arg(long)]
    skip_bad_members: bool,
    /// Tar shards: make each sample these members of its key, in this order
    /// (e.g. jpg,json,txt); their offsets inside the sample are in the
    /// catalog (kspeed ls --json shows them). Default: the first non-.cls member.
    #[arg(long, value_delimiter = ',')]
    members: Vec<String>,
}

impl ScanArgs {
    fn options(&self) -> dataset::ScanOptions {
        dataset::ScanOptions::default()
            .skip_special(self.skip_special)
            .follow_symlinks(self.follow_symlinks)
            .skip_bad_members(self.skip_bad_members)
            .members(self.members.clone())
    }
}

/// Prints what a scan noticed and did not turn into samples.
fn print_notes(notes: &dataset::ScanNotes) {
    for line in notes.lines() {
        eprintln!("kspeed: warning: {line}");
    }
}

fn parse_mode(s: &str) -> Result<u32, String> {
    let digits = s.trim_start_matches("0o");
    match u32::from_str_radix(digits, 8) {
        Ok(m) if m <= 0o777 && m & 0o600 == 0o600 => Ok(m),
        Ok(_) => Err(format!(
            "{s:?}: a file mode needs owner read and write (0600) and nothing above 0777"
        )),
        Err(_) => Err(format!("{s:?} is not an octal mode such as 0600")),
    }
}

#[derive(Args)]
struct PlacementArgs {
    /// Nodes in the cluster.
    #[arg(long, default_value_t = 1)]
    nodes: u32,
    /// This node's index (0-based).
    #[arg(long, default_value_t = 0)]
    node_index: u32,
    /// Copies of each sample across nodes (1 = no replica; at most the
    /// node count and 64).
    #[arg(long, default_value_t = 1)]
    replicas: u32,
}

pub(crate) fn parse_bytes(s: &str) -> Result<u64, String> {
    kspeed::progress::parse_bytes(s)
}

/// The value parser of a `kspeed read` flag that sets the loader option
/// `key`: the options table's type, range and message
/// (`kspeed::loader::options`), as in the C ABI and Python.
pub(crate) fn opt<T: TryFrom<u64>>(
    key: &'static str,
) -> impl Fn(&str) -> Result<T, String> + Clone + Send + Sync + 'static {
    let spec = kspeed::loader::options::spec(key).expect("a key of the options table");
    move |s: &str| {
        let n = spec.parse_u64(s).map_err(|e| e.to_string())?;
        T::try_from(n).map_err(|_| format!("option {key}: {n} does not fit"))
    }
}

/// A list flag's value (comma-separated), checked against the options
/// table (`mix`: each entry's form and weight), kept as given.
pub(crate) fn opt_list(
    key: &'static str,
) -> impl Fn(&str) -> Result<String, String> + Clone + Send + Sync + 'static {
    let spec = kspeed::loader::options::spec(key).expect("a key of the options table");
    move |s: &str| {
        spec.check_str(s).map_err(|e| e.to_string())?;
        Ok(s.to_string())
    }
}

/// A flag's value that is a number or `auto` (`None`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct OrAuto<T>(pub(crate) Option<T>);

/// [`opt`] for an option that also takes `auto` (the table's `int or
/// auto`): checked and worded by the table, `auto` as `OrAuto(None)`.
pub(crate) fn opt_or_auto<T: TryFrom<u64>>(
    key: &'static str,
) -> impl Fn(&str) -> Result<OrAuto<T>, String> + Clone + Send + Sync + 'static {
    let spec = kspeed::loader::options::spec(key).expect("a key of the options table");
    let number = opt::<T>(key);
    move |s: &str| {
        spec.check_str(s).map_err(|e| e.to_string())?;
        if s.trim() == "auto" {
            return Ok(OrAuto(None));
        }
        number(s).map(|n| OrAuto(Some(n)))
    }
}

#[derive(Args)]
struct PreloadArgs {
    /// Source: DIR (ImageFolder), list:FILE, tar:SHARD.tar or tar:DIR.
    /// Optional when the space already has a catalog.
    #[arg(long)]
    source: Option<std::ffi::OsString>,
    /// The space directory (created if missing).
    #[arg(long)]
    space: PathBuf,
    /// Use this prebuilt catalog (from `kspeed catalog`) instead of building one.
    #[arg(long, conflicts_with = "refresh")]
    catalog: Option<PathBuf>,
    #[command(flatten)]
    placement: PlacementArgs,
    /// Sample alignment in extent files (power of two, >= 512).
    #[arg(long, default_value = "4096", value_parser = parse_bytes)]
    align_bytes: u64,
    /// Extent file size cap.
    #[arg(long, default_value = "1GiB", value_parser = parse_bytes)]
    extent_bytes: u64,
    /// A partial space: hold at most this many bytes of this node's share
    /// (e.g. 500GiB; the start of the share by id, while it lasts), leaving
    /// the rest in the source, from where the loader reads it ahead of need
    /// (a dataset larger than the node's NVMe; each sample counted at its length rounded up to --align-bytes; docs/LOCAL_PATH.md "partial spaces", docs/CACHE.md). Every node
    /// of a cluster gives the same value. Default: the whole share.
    #[arg(long, value_parser = parse_bytes)]
    max_bytes: Option<u64>,
    /// Copy threads.
    #[arg(long, default_value_t = kspeed::dataset::default_threads())]
    threads: usize,
    /// Object-store sources (s3://): ranged GETs in flight at once, one
    /// copy thread each (64 keep a 25 Gb/s link busy at 10 ms per request
    /// and 4 MiB; more for faster links or slower stores).
    #[arg(long, default_value_t = 64)]
    requests: usize,
    /// Rebuild the catalog from the source and copy everything again.
    #[arg(long)]
    refresh: bool,
    /// Sync and record progress every this many bytes.
    #[arg(long, default_value = "64MiB", value_parser = parse_bytes)]
    checkpoint_bytes: u64,
    /// Limit copy bandwidth, e.g. 200MB (per second).
    #[arg(long, value_parser = parse_bytes)]
    max_bytes_per_sec: Option<u64>,
    /// Permissions (octal) of the files written into the space; directories
    /// get x where r is set. Default 0600: a private cache.
    #[arg(long, default_value = "0600", value_parser = parse_mode)]
    file_mode: u32,
    #[command(flatten)]
    scan: ScanArgs,
}

#[derive(Args)]
struct SpaceArg {
    /// The space directory.
    #[arg(long)]
    space: PathBuf,
}

#[derive(Args)]
struct InspectArgs {
    /// A space directory.
    #[arg(long, required_unless_present_any = ["catalog", "devices"])]
    space: Option<PathBuf>,
    /// A catalog file.
    #[arg(long, conflicts_with = "space")]
    catalog: Option<PathBuf>,
    /// Show how samples would spread over this many nodes (default: the space's).
    #[arg(long)]
    nodes: Option<u32>,
    /// Copies per sample for --nodes.
    #[arg(long)]
    replicas: Option<u32>,
    /// List the RDMA devices, their ports and GIDs (the addresses
    /// `kspeed serve --rdma` can listen on); alone, or with a space/catalog.
    #[arg(long)]
    devices: bool,
    /// Print the summary as one JSON object.
    #[arg(long, conflicts_with = "devices")]
    json: bool,
}

#[derive(Args)]
pub(crate) struct VerifyArgs {
    /// The space directory.
    #[arg(long)]
    space: PathBuf,
    /// Reader threads.
    #[arg(long, default_value_t = kspeed::dataset::default_threads())]
    threads: usize,
    /// Copy the corrupt or missing samples found again from the source
    /// (each checked against the catalog's CRC32C), then verify again.
    #[arg(long)]
    repair: bool,
    /// Print the report as one JSON object (the exit status is the same).
    #[arg(long)]
    json: bool,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if !matches!(cli.cmd, Cmd::Serve(_)) {
        // `kspeed inspect | head`: end quietly when the reader goes away.
        // The node service keeps ignoring SIGPIPE (it must outlive a
        // closed stdout).
        kspeed::progress::default_sigpipe();
    }
    // A space keeps a descriptor per extent open while served or read.
    kspeed::dataset::raise_open_files_limit();
    let level = match cli.verbose {
        0 => "warn",
        1 => "info",
        _ => "debug",
    };
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or(level))
        .format_timestamp_millis()
        .init();
    match run(cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("kspeed: error: {e}");
            ExitCode::from(1)
        }
    }
}

fn run(cli: Cli) -> kspeed::Result<ExitCode> {
    let progress = cli.progress;
    #[cfg(feature = "s3")]
    if cli.endpoint_url.is_some() || cli.aws_profile.is_some() {
        kspeed::dataset::store::set_overrides(
            kspeed::dataset::store::StoreOverrides::default()
                .endpoint_url(cli.endpoint_url.clone())
                .profile(cli.aws_profile.clone()),
        );
    }
    #[cfg(not(feature = "s3"))]
    if cli.endpoint_url.is_some() || cli.aws_profile.is_some() {
        return Err(kspeed::Error::InvalidConfig(
            "--endpoint-url and --profile are for s3:// sources; this build has no s3 feature"
                .into(),
        ));
    }
    match cli.cmd {
        Cmd::Gen(a) => {
            let t0 = Instant::now();
            let r = gen::generate(&GenOptions {
                profile: a.profile,
                count: a.count,
                out: a.out.clone(),
                seed: a.seed,
                classes: a.classes,
                threads: a.threads,
                progress,
            })?;
            println!(
                "generated {} samples, {} in {} ({} already present) in {:.2} s",
                r.samples,
                HumanBytes(r.bytes),
                a.out.display(),
                r.kept,
                t0.elapsed().as_secs_f64()
            );
        }
        Cmd::Catalog(a) => {
            let spec = SourceSpec::parse_os(&a.source)?;
            let t0 = Instant::now();
            let (cat, notes) = dataset::catalog::build_with_notes(
                &spec,
                &a.out,
                &BuildOptions::default()
                    .threads(a.threads)
                    .requests(a.requests)
                    .progress(progress)
                    .scan(a.scan.options()),
            )?;
            print_notes(&notes);
            {
                use std::os::unix::fs::PermissionsExt;
                std::fs::set_permissions(&a.out, std::fs::Permissions::from_mode(a.file_mode))
                    .map_err(|e| kspeed::Error::io("chmod", &a.out, e))?;
            }
            println!(
                "catalog {}: {} samples, {}, {:.1} catalog bytes per sample, built in {:.2} s",
                a.out.display(),
                cat.len(),
                HumanBytes(cat.total_bytes()),
                cat.bytes_per_sample(),
                t0.elapsed().as_secs_f64()
            );
        }
        Cmd::Preload(a) => {
            if a.max_bytes == Some(0) {
                return Err(kspeed::Error::InvalidConfig(
                    "--max-bytes 0 would hold nothing: give a budget, or leave it out to hold the whole share".into(),
                ));
            }
            let placement = Placement::new(a.placement.nodes, a.placement.replicas)?;
            let align_bytes = u32::try_from(a.align_bytes)
                .map_err(|_| kspeed::Error::InvalidConfig("--align-bytes is too large".into()))?;
            let opts = PreloadOptions::default()
                .source(a.source.as_deref().map(SourceSpec::parse_os).transpose()?)
                .catalog(a.catalog)
                .placement(placement)
                .node_index(a.placement.node_index)
                .align_bytes(align_bytes)
                .extent_bytes(a.extent_bytes)
                .max_held_bytes(a.max_bytes.unwrap_or(0))
                .threads(a.threads)
                .requests(a.requests)
                .progress(progress)
                .refresh(a.refresh)
                .checkpoint_bytes(a.checkpoint_bytes)
                .max_bytes_per_sec(a.max_bytes_per_sec)
                .check_free_space(true)
                .scan(a.scan.options())
                .file_mode(a.file_mode);
            let t0 = Instant::now();
            let r = dataset::preload(&a.space, &opts)?;
            print_notes(&r.notes);
            let partial = match a.max_bytes {
                Some(b) => format!(
                    " (a partial space: at most {} held, the rest read from the source)",
                    HumanBytes(b)
                ),
                None => String::new(),
            };
            if r.up_to_date {
                println!(
                    "space {} is up to date: nothing copied ({} samples, {} held by node {}){partial}",
                    a.space.display(),
                    r.held_samples,
                    HumanBytes(r.held_bytes),
                    a.placement.node_index
                );
            } else {
                let secs = r.copy_time.as_secs_f64().max(1e-9);
                if let Some(at) = r.resumed_at {
                    println!("resumed an interrupted preload at sample {at}");
                }
                if r.catalog_built {
                    println!("catalog built in {:.2} s", r.catalog_time.as_secs_f64());
                }
                println!(
                    "preloaded {} samples, {} into {} in {:.2} s ({}/s copy, {:.2} s total); node {} of {} holds {} samples{partial}",
                    r.copied_samples,
                    HumanBytes(r.copied_bytes),
                    a.space.display(),
                    secs,
                    HumanBytes((r.copied_bytes as f64 / secs) as u64),
                    t0.elapsed().as_secs_f64(),
                    a.placement.node_index,
                    a.placement.nodes,
                    r.held_samples
                );
            }
        }
        Cmd::Unload(a) => {
            dataset::unload(&a.space)?;
            println!("removed space {}", a.space.display());
        }
        Cmd::Read(a) => read::run(*a, progress)?,
        Cmd::Rebalance(a) => rebalance_cmd::run(a, progress)?,
        Cmd::Serve(a) => {
            let token = read_token(&a.token_file)?;
            let mut cfg = kspeed::transport::ServeConfig::new(&a.spaces[0], &a.listen, &token);
            cfg.more_spaces = a.spaces[1..].to_vec();
            if let Some(p) = a.pollers {
                cfg.pollers = p;
            }
            a.service.apply(&mut cfg);
            cfg.metrics = a.metrics.clone();
            cfg.rdma = a.rdma.options();
            if let Ok(mut addrs) = std::net::ToSocketAddrs::to_socket_addrs(&a.listen) {
                if addrs.any(|sa| sa.ip().is_unspecified()) {
                    log::warn!(
                        "listening on every interface ({}): the job token and the samples travel in clear text; \
                         serve on the cluster's trusted fabric only (docs/PROTOCOL.md, threat model)",
                        a.listen
                    );
                }
            }
            kspeed::transport::serve_until_signal(cfg, |svc| {
                if let Some(m) = svc.metrics_addr() {
                    println!("metrics on http://{m}/metrics");
                }
                // Scripts wait for this line (and read the port from it).
                let spaces: Vec<String> =
                    a.spaces.iter().map(|s| s.display().to_string()).collect();
                println!("serving {} on {}", spaces.join(" + "), svc.local_addr());
                use std::io::Write;
                let _ = std::io::stdout().flush();
            })?;
        }
        Cmd::Agent(a) => agent_cmd::run_agent(*a)?,
        Cmd::Ls(a) => ls::ls(a)?,
        Cmd::Cat(a) => ls::cat(a)?,
        Cmd::Inspect(a) => {
            inspect::run(&a.space, &a.catalog, a.nodes, a.replicas, a.devices, a.json)?
        }
        Cmd::Verify(a) => return verify_cmd::run(a, progress),
        Cmd::Audit(a) => return audit::run(a),
        Cmd::Completions { shell } => {
            use clap::CommandFactory;
            clap_complete::generate(shell, &mut Cli::command(), "kspeed", &mut std::io::stdout());
        }
        Cmd::Man { dir } => {
            use clap::CommandFactory;
            std::fs::create_dir_all(&dir).map_err(|e| kspeed::Error::io("create", &dir, e))?;
            clap_mangen::generate_to(Cli::command(), &dir)
                .map_err(|e| kspeed::Error::io("write man pages into", &dir, e))?;
            println!("wrote man pages into {}", dir.display());
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// Reads a job token file (trailing whitespace dropped; empty or longer
/// than the HELLO frame allows is an error; readable by every user is a
/// warning).
pub(crate) fn read_token(path: &std::path::Path) -> kspeed::Result<Vec<u8>> {
    use kspeed::transport::proto::MAX_TOKEN_BYTES;
    use std::io::Read;
    use std::os::unix::fs::PermissionsExt;
    // The largest token a HELLO carries plus a line ending (CRLF). One byte
    // more is read to tell a file that is too long, so `/dev/zero` or a
    // huge file is refused after reading that much rather than read until
    // memory runs out.
    let file_limit_bytes = MAX_TOKEN_BYTES + 2;
    let mut raw = Vec::with_capacity(file_limit_bytes + 1);
    std::fs::File::open(path)
        .and_then(|f| f.take(file_limit_bytes as u64 + 1).read_to_end(&mut raw))
        .map_err(|e| kspeed::Error::io("read token file", path, e))?;
    if raw.len() > file_limit_bytes {
        return Err(kspeed::Error::InvalidConfig(format!(
            "token file {} holds more than {file_limit_bytes} bytes; a token is at most {MAX_TOKEN_BYTES} bytes (what a HELLO frame carries), plus a line ending",
            path.display()
        )));
    }
    if let Ok(md) = std::fs::metadata(path) {
        let mode = md.permissions().mode();
        if mode & 0o004 != 0 {
            log::warn!(
                "token file {} is readable by every user (mode {:o}); chmod 600 it",
                path.display(),
                mode & 0o777
            );
        }
    }
    let end = raw
        .iter()
        .rposition(|b| !b.is_ascii_whitespace())
        .map_or(0, |i| i + 1);
    if end == 0 {
        return Err(kspeed::Error::InvalidConfig(format!(
            "token file {} is empty",
            path.display()
        )));
    }
    if end > MAX_TOKEN_BYTES {
        return Err(kspeed::Error::InvalidConfig(format!(
            "token file {} holds a {end}-byte token; the most a HELLO frame carries is {MAX_TOKEN_BYTES} bytes",
            path.display(),
        )));
    }
    Ok(raw[..end].to_vec())
}

/// Opens what `inspect` was pointed at.
pub(crate) fn open_target(
    space: &Option<PathBuf>,
    catalog: &Option<PathBuf>,
) -> kspeed::Result<(Catalog, Option<Space>)> {
    match (space, catalog) {
        (_, Some(c)) => Ok((Catalog::open(c)?, None)),
        (Some(s), None) => match Space::open(s) {
            Ok(space) => Ok((Catalog::open(space.catalog().path())?, Some(space))),
            Err(kspeed::Error::NotASpace { .. })
                if s.join(dataset::space::files::CATALOG).exists() =>
            {
                Ok((
                    Catalog::open(&s.join(dataset::space::files::CATALOG))?,
                    None,
                ))
            }
            Err(e) => Err(e),
        },
        (None, None) => Err(kspeed::Error::InvalidConfig(
            "give --space or --catalog".into(),
        )),
    }
}
