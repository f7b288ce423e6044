//! [`LoaderOptions`]: the one table of the loader's options ([`OPTIONS`]:
//! name, type, unit, range, default, doc) and the one parser every front end
//! goes through: the C ABI's `ksp_config_set` (strings), the Python
//! extension's keyword arguments (typed values), the `kspeed read` flags
//! (their value parsers) and the DALI operator (through the C ABI). A bad
//! value is [`Error::InvalidOption`], an unknown key
//! [`Error::UnknownOption`], with one message whatever the front end.
//!
//! The README's option table and the `ksp_config_set` doc comment (so
//! `kspeed.h`) are generated from the table ([`markdown_table`];
//! `tests/options.rs` checks them for drift and rewrites them with
//! `KSPEED_UPDATE_DOCS=1`).
//!
//! (Why this file is over ~800 lines: it is the one table, one entry of
//! name, range, default and doc per option, plus the parser that applies
//! each; the point of the file is that both live in one place.)

use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::Duration;

use super::builder::{
    LoaderBuilder, DEFAULT_SUBMIT_BATCH, MAX_BATCH_SIZE, MAX_POLLERS, MAX_QUEUE_DEPTH,
};
use crate::error::{Error, Result};
use crate::landing::CudaMode;
use crate::transport::ClusterSpec;

/// An option's type and the values it takes.
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub enum OptionKind {
    /// `true`/`false` (strings: also `1`/`0`, `yes`/`no`, `on`/`off`).
    Bool,
    /// An integer from `min` to `max`.
    Int {
        /// Smallest value.
        min: u64,
        /// Largest value.
        max: u64,
    },
    /// A size in bytes from `min` to `max`: an integer, or a string with a
    /// unit (`4096`, `64KiB`, `256MiB`, `1GB`).
    Bytes {
        /// Smallest value.
        min: u64,
        /// Largest value.
        max: u64,
    },
    /// A number of seconds (fractions allowed) from `min_ms` to `max_ms`
    /// milliseconds.
    Seconds {
        /// Smallest value, in milliseconds.
        min_ms: u64,
        /// Largest value, in milliseconds.
        max_ms: u64,
    },
    /// `auto`, or a size in bytes from `min` to `max` (as [`Bytes`](Self::Bytes)).
    BytesOrAuto {
        /// Smallest value.
        min: u64,
        /// Largest value.
        max: u64,
    },
    /// `auto`, or an integer from `min` to `max`.
    IntOrAuto {
        /// Smallest value.
        min: u64,
        /// Largest value.
        max: u64,
    },
    /// One of these words.
    Choice(&'static [&'static str]),
    /// Any text.
    Text,
    /// A file system path.
    Path,
    /// A list of strings (as a string: comma-separated).
    List,
}

impl OptionKind {
    /// What the option takes, in words (the end of every error message).
    pub fn allowed(&self) -> String {
        let range = |min: u64, max: u64| {
            if max == u64::MAX {
                format!("at least {min}")
            } else {
                format!("from {min} to {max}")
            }
        };
        match *self {
            OptionKind::Bool => "true or false".into(),
            OptionKind::Int { min, max } => format!("an integer {}", range(min, max)),
            OptionKind::Bytes { min, max } => format!(
                "a size in bytes {} (e.g. 4096, 64KiB, 256MiB, 1GB)",
                range(min, max)
            ),
            OptionKind::BytesOrAuto { min, max } => format!(
                "auto or a size in bytes {} (e.g. 4096, 64KiB, 256MiB, 1GB)",
                range(min, max)
            ),
            OptionKind::Seconds { min_ms, max_ms } => format!(
                "a number of seconds from {} to {}",
                min_ms as f64 / 1000.0,
                max_ms as f64 / 1000.0
            ),
            OptionKind::IntOrAuto { min, max } => {
                format!("auto or an integer {}", range(min, max))
            }
            OptionKind::Choice(words) => format!("one of {}", words.join(", ")),
            OptionKind::Text => "text".into(),
            OptionKind::Path => "a path".into(),
            OptionKind::List => "a list (as a string: comma-separated)".into(),
        }
    }

    /// The type's name in the generated docs.
    pub fn type_name(&self) -> &'static str {
        match self {
            OptionKind::Bool => "bool",
            OptionKind::Int { .. } => "int",
            OptionKind::Bytes { .. } => "size",
            OptionKind::BytesOrAuto { .. } => "size or auto",
            OptionKind::Seconds { .. } => "seconds",
            OptionKind::IntOrAuto { .. } => "int or auto",
            OptionKind::Choice(_) => "choice",
            OptionKind::Text => "text",
            OptionKind::Path => "path",
            OptionKind::List => "list",
        }
    }

    /// The range's smallest and largest value, for the kinds that have one
    /// (seconds in milliseconds).
    pub fn range(&self) -> Option<(u64, u64)> {
        match *self {
            OptionKind::Int { min, max }
            | OptionKind::Bytes { min, max }
            | OptionKind::BytesOrAuto { min, max }
            | OptionKind::IntOrAuto { min, max } => Some((min, max)),
            OptionKind::Seconds { min_ms, max_ms } => Some((min_ms, max_ms)),
            _ => None,
        }
    }
}

/// One loader option: a row of [`OPTIONS`].
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct OptionSpec {
    /// The key (`ksp_config_set`'s, Python's keyword).
    pub name: &'static str,
    /// Type and range.
    pub kind: OptionKind,
    /// Unit of the value (`bytes`, `ms`, `samples`...), or empty.
    pub unit: &'static str,
    /// The default, in words.
    pub default: &'static str,
    /// What it does.
    pub doc: &'static str,
    /// `Some(other)`: a documented alias of `other` (in another unit or an
    /// older name), kept so that old callers keep working.
    pub alias_of: Option<&'static str>,
    /// The `kspeed read` flag that sets it (without `--`), or empty.
    pub cli: &'static str,
}

const fn int(min: u64, max: u64) -> OptionKind {
    OptionKind::Int { min, max }
}

const U32: u64 = u32::MAX as u64;

macro_rules! opt {
    ($name:literal, $kind:expr, $unit:literal, $default:literal, $cli:literal, $doc:literal) => {
        OptionSpec {
            name: $name,
            kind: $kind,
            unit: $unit,
            default: $default,
            doc: $doc,
            alias_of: None,
            cli: $cli,
        }
    };
    ($name:literal, $kind:expr, $unit:literal, $default:literal, $cli:literal, $doc:literal, alias_of = $of:literal) => {
        OptionSpec {
            name: $name,
            kind: $kind,
            unit: $unit,
            default: $default,
            doc: $doc,
            alias_of: Some($of),
            cli: $cli,
        }
    };
}

/// Every loader option, in the order the docs list them.
pub static OPTIONS: &[OptionSpec] = &[
    opt!("space", OptionKind::Path, "", "none: `space` or `source` is required", "space",
        "a preloaded space directory (the fast path)"),
    opt!("source", OptionKind::Text, "", "none", "source",
        "a source read directly (DIR, list:FILE, tar:DIR)"),
    opt!("catalog", OptionKind::Path, "", "built from the source into a temporary file", "catalog",
        "the catalog for `source` (`kspeed catalog`)"),
    opt!("batch_size", int(1, MAX_BATCH_SIZE), "samples", "64", "batch-size",
        "samples per batch"),
    opt!("seed", int(0, u64::MAX), "", "0", "seed", "shuffle seed, the same on every rank"),
    opt!("shuffle", OptionKind::Bool, "", "true", "", "shuffle each epoch (`kspeed read --no-shuffle`)"),
    opt!("shuffle_block", int(0, crate::sampler::MAX_SHUFFLE_BLOCK), "samples", "0", "shuffle-block",
        "shuffle within blocks of this many consecutive ids (0: the whole dataset); with tar shards in a bucket, a block's samples share ranged GETs"),
    opt!("drop_last", OptionKind::Bool, "", "false", "drop-last",
        "drop each epoch's last, partial batch"),
    opt!("rank", int(0, U32), "", "0", "rank", "this rank"),
    opt!("world", int(1, U32), "ranks", "1", "world", "the world size"),
    opt!("ring_bytes", OptionKind::BytesOrAuto { min: 4096, max: u64::MAX }, "bytes",
        "auto: six batches of the mean sample, 4 to 256 MiB (a mixture: from 64 MiB; cluster mode: 256 MiB), at most twice the dataset (its samples rounded up to the 4 KiB alignment), and at least a batch of the largest samples plus two read ahead (up to 4 GiB; a batch needing more is refused)", "ring-bytes",
        "landing ring size (locked memory the reads land in); a size given is refused if it cannot hold a whole batch"),
    opt!("tier_bytes", OptionKind::Bytes { min: 0, max: u64::MAX }, "bytes", "0: no tier", "tier-bytes",
        "memory tier budget: samples read once are kept in memory and served from there"),
    opt!("cache_dir", OptionKind::Path, "", "none: no cache area", "cache-dir",
        "an NVMe cache area (docs/CACHE.md): samples read from the source (a source, or what a partial space does not hold) are kept here for their next read, by `cache_policy`, within `cache_bytes`; each rank uses `rank<N>` under this folder; what a run kept is used by the next; `:memory:` keeps the area in the loader's memory instead (the same policy, and a space's samples too; nothing on disk, gone with the loader)"),
    opt!("cache_bytes", OptionKind::Bytes { min: 0, max: u64::MAX }, "bytes", "0: no cache area", "cache-bytes",
        "the cache area's budget, shared among slot size classes from 4 KiB to the catalog's 99th percentile sample length (larger samples are not kept; docs/CACHE.md)"),
    opt!("cache_policy", OptionKind::Choice(&["next-use", "min", "lru"]), "", "next-use", "cache-policy",
        "what the cache area keeps: `next-use` what this rank reads soonest (Belady's MIN over the known order, replacing a kept sample only when the write gains a hit), `min` MIN itself (the fewest source reads, more writes), `lru` what it read last (the page cache's policy, for comparison)"),
    opt!("cache_memory_bytes", OptionKind::Bytes { min: 0, max: u64::MAX }, "bytes", "0: none", "cache-memory-bytes",
        "a memory level above the cache area on disk (docs/CACHE.md, \"Two levels\"): an area of this many bytes in the loader's memory, read before the one in `cache_dir` (a folder), with its own plan by the same `cache_policy` (next use: what the rank reads again soonest) over what comes from the area, the space or the source; nothing on disk, gone with the loader"),
    opt!("tier_views", OptionKind::Bool, "", "false", "tier-views",
        "a sample served from the memory tier (attached: the agent's node tier, mapped read-only) is handed out in place (no copy into the ring); a batch holding one is not one ring span"),
    opt!("pollers", int(1, MAX_POLLERS), "threads", "a quarter of this rank's core slice, 1 to 8 (twice that, at most the slice, when the space is read through the page cache)", "pollers",
        "poller threads"),
    opt!("queue_depth", int(1, MAX_QUEUE_DEPTH), "reads", "32", "queue-depth",
        "reads in flight per poller (io_uring holds at most 32768 entries, two per read)"),
    opt!("submit_batch", int(1, MAX_QUEUE_DEPTH), "reads", "8", "submit-batch",
        "reads a poller queues before it submits them (one system call per batch)"),
    opt!("max_read_bytes", OptionKind::Bytes { min: 4096, max: u64::MAX }, "bytes", "4MiB", "max-read-bytes",
        "largest single read: bigger samples are read in parts"),
    opt!("lookahead", int(1, u64::MAX), "samples", "as many as the ring holds", "lookahead",
        "most samples read ahead of the consumer (at least one batch)"),
    opt!("spin_us", int(0, 10_000_000), "us", "0 on up to 4 cores or on cores shared with other ranks, else 20", "spin-us",
        "how long pollers and the consumer busy-poll before parking"),
    opt!("sqpoll_idle_ms", int(0, U32), "ms", "none: no SQPOLL", "sqpoll-idle-ms",
        "use an SQPOLL kernel thread per poller, idling after this long"),
    opt!("coop_taskrun", OptionKind::Bool, "", "false", "coop-taskrun",
        "create the pollers' io_urings with IORING_SETUP_COOP_TASKRUN"),
    opt!("pin", OptionKind::Bool, "", "true", "", "pin the pollers to this rank's cores (`kspeed read --no-pin`)"),
    opt!("local_rank", int(0, U32), "", "from the environment (KSPEED_LOCAL_RANK, LOCAL_RANK, OMPI_COMM_WORLD_LOCAL_RANK, MPI_LOCALRANKID, SLURM_LOCALID), else 0", "local-rank",
        "this process's rank among the node's ranks (with `local_world_size`); each gets its own slice of cores"),
    opt!("local_world_size", int(1, U32), "ranks", "from the environment, else 1", "local-world-size",
        "the number of ranks on this node (with `local_rank`)"),
    opt!("poller_numa_node", int(0, 4095), "", "the ring's node", "poller-numa-node",
        "take the pollers' cores from this NUMA node"),
    opt!("sysfs_root", OptionKind::Path, "", "KSPEED_SYSFS_ROOT, else /sys", "",
        "read the CPU topology from this directory shaped like /sys"),
    opt!("registered_buffers", OptionKind::Bool, "", "true", "",
        "register the ring with io_uring as fixed buffers (`kspeed read --no-registered-buffers`)"),
    opt!("registered_files", OptionKind::Bool, "", "true", "",
        "register the extent files with io_uring (`kspeed read --no-registered-files`)"),
    opt!("verify_crc32c", OptionKind::Bool, "", "false", "verify",
        "check the CRC32C of every sample read from disk or pushed by another node against the catalog (a mismatch is a data error naming the sample and file, or in a cluster a failover to the next copy); attached to the node agent, the agent checks"),
    opt!("page_cache", OptionKind::Choice(&["auto", "off", "on"]), "", "auto", "page-cache",
        "how a preloaded space is read: `auto` through the page cache when at least 90% of a sample of its pages is cached as the loader is built (a warm machine; the loader's I/O description says which and why), else O_DIRECT; `off` always O_DIRECT; `on` always the page cache"),
    opt!("huge_pages", OptionKind::Bool, "", "true", "",
        "2 MiB pages for the ring when the system has them reserved (`kspeed read --no-huge-pages`)"),
    opt!("mlock", OptionKind::Bool, "", "true", "",
        "lock the ring in memory (needs RLIMIT_MEMLOCK of at least `ring_bytes`; `kspeed read --no-mlock`)"),
    opt!("numa_node", int(0, 4095), "", "not bound (the kernel's placement)", "numa-node",
        "bind the ring to this NUMA node"),
    opt!("gpu_pci", OptionKind::Text, "", "none", "gpu-pci",
        "bind the ring to the NUMA node of this GPU (PCI address, e.g. 0000:3b:00.0)"),
    opt!("cuda", OptionKind::Choice(&["auto", "off", "require"]), "", "auto", "",
        "register the ring with CUDA: when possible, never, or fail if not possible"),
    opt!("gpu_ring", int(0, 1023), "", "none: a host ring", "gpu-ring",
        "CUDA device ordinal: the ring lives in that GPU's memory and RDMA writes land there (cluster mode over RDMA with a `source`)"),
    opt!("mix", OptionKind::List, "", "none: one dataset (`space` or `source`)", "mix",
        "a mixture of datasets read side by side (in cluster mode the nodes serve the same spaces side by side: `kspeed serve --space A --space B`): `PATH:WEIGHT` entries, PATH a space directory, a catalog (`.ksc`) or a source, WEIGHT a proportion (`0.7`), `repeat=R` or `choose=N` (none: `repeat=1`); ids follow the order given"),
    opt!("mix_epoch_size", int(1, u64::MAX), "samples", "the datasets' total length", "mix-epoch-size",
        "samples per epoch that a mixture's proportions divide"),
    opt!("start_epoch", int(0, u64::MAX), "", "0", "start-epoch", "first epoch"),
    opt!("end_epoch", int(1, u64::MAX), "", "none: read-ahead runs on into the next epoch", "",
        "the job reads epochs below this one only: nothing is read ahead past its last sample (`kspeed read --epochs`)"),
    opt!("cluster_file", OptionKind::Path, "", "none: single-node", "cluster",
        "cluster mode: the node list (`<index> <host:port>` per line)"),
    opt!("cluster_nodes", OptionKind::List, "", "none", "",
        "cluster mode: the node services' `host:port` in node order (comma-separated)"),
    opt!("cluster_nodelist", OptionKind::Text, "", "none", "nodelist",
        "cluster mode: a SLURM hostlist (`gpu[01-04,07]`), each at `cluster_port`"),
    opt!("cluster_nodes_dns", OptionKind::Text, "", "none", "nodes-dns",
        "cluster mode: a name pattern with `{i}` (`kspeed-{i}.kspeed.ns.svc:7400`) for `cluster_node_count` nodes"),
    opt!("cluster_node_count", int(1, U32), "nodes", "none (with `cluster_env`: WORLD_SIZE / LOCAL_WORLD_SIZE)", "nodes",
        "the node count for `cluster_nodes_dns`"),
    opt!("cluster_port", int(1, 65535), "", "KSPEED_PORT, else 7400", "node-port",
        "port for `cluster_nodelist` and a pattern without one"),
    opt!("cluster_env", OptionKind::Bool, "", "false", "cluster-env",
        "rank, world and (unless a node list is given) the node list from the launcher's environment (docs/DEPLOY.md)"),
    opt!("token", OptionKind::Text, "", "none (required in cluster mode)", "",
        "cluster mode: the job token (`kspeed read --token-file`)"),
    opt!("node_timeout_ms", int(1, 86_400_000), "ms", "10000", "node-timeout-ms",
        "cluster mode: how long a node may stay silent with grants outstanding before they fail over"),
    opt!("node_timeout", OptionKind::Seconds { min_ms: 1, max_ms: 86_400_000 }, "s", "10", "",
        "`node_timeout_ms` in seconds (Python's name)", alias_of = "node_timeout_ms"),
    opt!("rdma", OptionKind::Bool, "", "false: TCP", "rdma",
        "cluster mode: receive over RDMA (every node serves with `--rdma`)"),
    opt!("rdma_device", OptionKind::Text, "", "the first device", "rdma-device",
        "RDMA device name; implies `rdma`"),
    opt!("rdma_port", int(1, 255), "", "1", "rdma-port", "RDMA port number; implies `rdma`"),
    opt!("rdma_gid_index", OptionKind::IntOrAuto { min: 0, max: 255 }, "", "auto", "rdma-gid-index",
        "GID index (`auto`: the RoCE v2 GID of the connection's address); implies `rdma`"),
    opt!("agent", OptionKind::Choice(&["auto", "off", "required"]), "", "auto", "agent",
        "read through the node's `kspeed agent` (docs/DEPLOY.md): `required` always (no agent is a `NoAgent` error), `auto` in cluster mode where the agent can serve this loader (its socket exists; no tier or GPU ring of its own, a mixture only of spaces, served by an agent given them: `kspeed agent --space A --space B`; a refusal falls back to embedded with a WARN), `off` never (this process's own pollers)"),
    opt!("agent_socket", OptionKind::Path, "", "KSPEED_AGENT_SOCKET, else /run/kspeed/agent.sock", "agent-socket",
        "the node agent's attach socket"),
    opt!("agent_restart_wait_ms", int(0, 86_400_000), "ms", "0: `AgentGone` at once", "agent-restart-wait-ms",
        "attached: when the agent goes (`AgentGone`), wait this long for an agent at the same socket and attach to it where this rank stood, every sample still delivered once; batches kept out stay valid (their ring stays mapped until they are released)"),
    opt!("s3_endpoint_url", OptionKind::Text, "", "AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL, the profile's, else AWS", "endpoint-url",
        "a source in an S3-compatible store (`s3://`): its endpoint, e.g. http://minio:9000 (path-style requests); read only when a sample is read from the bucket. Process-wide: the last loader built with it sets it"),
    opt!("s3_profile", OptionKind::Text, "", "AWS_PROFILE, else default", "aws-profile",
        "a source in an object store: the profile of ~/.aws/credentials and ~/.aws/config to take credentials, region and endpoint from. Process-wide, as `s3_endpoint_url`"),
    opt!("local_node", int(0, 65535), "", "the local space's node; none with a source", "",
        "cluster mode: the node this process runs on (its samples are never requested over the network)"),
];

/// The row of `key` (an alias has its own row).
pub fn spec(key: &str) -> Option<&'static OptionSpec> {
    OPTIONS.iter().find(|s| s.name == key)
}

/// A value for [`LoaderOptions::set_value`], as a front end has it.
#[derive(Debug, Clone, Copy)]
pub enum OptionValue<'a> {
    /// A string: parsed as `ksp_config_set` parses it for the kinds that
    /// take strings (sizes, choices, text); a wrong type for integers,
    /// booleans and seconds.
    Str(&'a str),
    /// An integer.
    Int(i128),
    /// A floating-point number.
    Float(f64),
    /// A boolean.
    Bool(bool),
    /// A list of strings.
    List(&'a [String]),
    /// Nothing given (Python's `None`): the default for options that have
    /// no value by default, a wrong type for booleans.
    None,
    /// A value of a type no option takes, as the front end shows it
    /// (Python's `repr`): always a wrong type.
    Other(&'a str),
}

impl std::fmt::Display for OptionValue<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            OptionValue::Str(s) => write!(f, "{s:?}"),
            OptionValue::Int(n) => write!(f, "{n}"),
            OptionValue::Float(x) => write!(f, "{x:?}"),
            OptionValue::Bool(b) => write!(f, "{b}"),
            OptionValue::List(l) => write!(f, "{l:?}"),
            OptionValue::None => write!(f, "None"),
            OptionValue::Other(r) => write!(f, "{r}"),
        }
    }
}

/// A parsed value.
#[derive(Debug, Clone, PartialEq)]
enum Parsed {
    Bool(bool),
    Num(u64),
    Dur(Duration),
    Auto,
    Text(String),
    List(Vec<String>),
    Unset,
}

fn bad(spec: &OptionSpec, value: &dyn std::fmt::Display, problem: &str, wrong_type: bool) -> Error {
    Error::InvalidOption {
        key: spec.name.to_string(),
        value: value.to_string(),
        problem: problem.to_string(),
        allowed: spec.kind.allowed(),
        wrong_type,
    }
}

/// A range error shows the number (not the string it came as), so that
/// every front end gives the same message.
fn in_range(spec: &OptionSpec, n: i128, min: u64, max: u64) -> Result<u64> {
    if n < min as i128 {
        Err(bad(spec, &n, "below the minimum", false))
    } else if n > max as i128 {
        Err(bad(spec, &n, "above the maximum", false))
    } else {
        Ok(n as u64)
    }
}

fn parse_bool(s: &str) -> Option<bool> {
    match s.trim() {
        "1" | "true" | "yes" | "on" => Some(true),
        "0" | "false" | "no" | "off" => Some(false),
        _ => None,
    }
}

impl OptionSpec {
    /// Checks `value` against this option's type and range; `Ok(())` if
    /// [`LoaderOptions::set_value`] would take it.
    pub fn check(&self, value: OptionValue<'_>) -> Result<()> {
        self.parse(value, false).map(drop)
    }

    /// Checks a string value, as `ksp_config_set` gets it.
    pub fn check_str(&self, value: &str) -> Result<()> {
        self.parse(OptionValue::Str(value), true).map(drop)
    }

    /// Parses a string (as `kspeed read` gets a flag's value) into an
    /// integer of this option's range (sizes included).
    pub fn parse_u64(&self, value: &str) -> Result<u64> {
        match self.parse(OptionValue::Str(value), true)? {
            Parsed::Num(n) => Ok(n),
            Parsed::Dur(d) => Ok(d.as_millis() as u64),
            _ => Err(bad(self, &OptionValue::Str(value), "not an integer", true)),
        }
    }

    /// `from_str`: the value came as a string from a front end that has
    /// only strings (the C ABI, the command line), so every kind parses it.
    fn parse(&self, v: OptionValue<'_>, from_str: bool) -> Result<Parsed> {
        use OptionValue as V;
        let wrong = |what: &str| Err(bad(self, &v, what, true));
        match (self.kind, v) {
            (OptionKind::Bool, V::Bool(b)) => Ok(Parsed::Bool(b)),
            (OptionKind::Bool, V::Str(s)) if from_str => match parse_bool(s) {
                Some(b) => Ok(Parsed::Bool(b)),
                None => wrong("not true or false"),
            },
            (OptionKind::Bool, _) => wrong("not true or false"),
            (_, V::None) => Ok(Parsed::Unset),
            (_, V::Other(_)) => wrong("of a type it does not take"),
            (OptionKind::Int { min, max }, V::Int(n)) => {
                in_range(self, n, min, max).map(Parsed::Num)
            }
            (OptionKind::Int { min, max }, V::Str(s)) if from_str => match s.trim().parse::<i128>()
            {
                Ok(n) => in_range(self, n, min, max).map(Parsed::Num),
                Err(_) => wrong("not an integer"),
            },
            (OptionKind::Int { .. }, _) => wrong("not an integer"),
            (OptionKind::IntOrAuto { min, max }, V::Int(n)) => {
                in_range(self, n, min, max).map(Parsed::Num)
            }
            (OptionKind::IntOrAuto { min, max }, V::Str(s)) => {
                if s.trim() == "auto" {
                    Ok(Parsed::Auto)
                } else {
                    match s.trim().parse::<i128>() {
                        Ok(n) => in_range(self, n, min, max).map(Parsed::Num),
                        Err(_) => wrong("not an integer or auto"),
                    }
                }
            }
            (OptionKind::IntOrAuto { .. }, _) => wrong("not an integer or auto"),
            (OptionKind::Bytes { min, max }, V::Int(n)) => {
                in_range(self, n, min, max).map(Parsed::Num)
            }
            (OptionKind::Bytes { min, max }, V::Str(s)) => match crate::progress::parse_bytes(s) {
                Ok(n) => in_range(self, n as i128, min, max).map(Parsed::Num),
                // Strings are this kind's own form: a bad one is a bad
                // value, not a wrong type.
                Err(_) => Err(bad(self, &v, "not a size", false)),
            },
            (OptionKind::Bytes { .. }, _) => wrong("not a size"),
            (OptionKind::BytesOrAuto { min, max }, V::Int(n)) => {
                in_range(self, n, min, max).map(Parsed::Num)
            }
            (OptionKind::BytesOrAuto { min, max }, V::Str(s)) => {
                if s.trim() == "auto" {
                    Ok(Parsed::Auto)
                } else {
                    match crate::progress::parse_bytes(s) {
                        Ok(n) => in_range(self, n as i128, min, max).map(Parsed::Num),
                        Err(_) => Err(bad(self, &v, "not a size or auto", false)),
                    }
                }
            }
            (OptionKind::BytesOrAuto { .. }, _) => wrong("not a size or auto"),
            (OptionKind::Seconds { min_ms, max_ms }, V::Int(_) | V::Float(_) | V::Str(_)) => {
                let secs = match v {
                    V::Int(n) => n as f64,
                    V::Float(x) => x,
                    V::Str(s) if from_str => match s.trim().parse::<f64>() {
                        Ok(x) => x,
                        Err(_) => return wrong("not a number of seconds"),
                    },
                    _ => return wrong("not a number of seconds"),
                };
                if !secs.is_finite() {
                    return wrong("not a number of seconds");
                }
                if secs * 1000.0 < min_ms as f64 {
                    Err(bad(self, &secs, "below the minimum", false))
                } else if secs * 1000.0 > max_ms as f64 {
                    Err(bad(self, &secs, "above the maximum", false))
                } else {
                    Ok(Parsed::Dur(Duration::from_secs_f64(secs)))
                }
            }
            (OptionKind::Seconds { .. }, _) => wrong("not a number of seconds"),
            (OptionKind::Choice(words), V::Str(s)) => {
                if words.contains(&s.trim()) {
                    Ok(Parsed::Text(s.trim().to_string()))
                } else {
                    Err(bad(self, &v, "not one of the choices", false))
                }
            }
            (OptionKind::Choice(_), _) => wrong("not a string"),
            (OptionKind::Text | OptionKind::Path, V::Str(s)) => Ok(Parsed::Text(s.to_string())),
            (OptionKind::Text | OptionKind::Path, _) => wrong("not a string"),
            (OptionKind::List, V::List(l)) => self.check_list(l.to_vec(), &v),
            (OptionKind::List, V::Str(s)) => {
                self.check_list(s.split(',').map(|a| a.trim().to_string()).collect(), &v)
            }
            (OptionKind::List, _) => wrong("not a list"),
        }
    }

    /// A list option's entries, checked where the option has a form
    /// (`mix`: `PATH:WEIGHT`).
    fn check_list(&self, l: Vec<String>, v: &OptionValue<'_>) -> Result<Parsed> {
        if self.name == "mix" {
            if l.iter().all(|e| e.is_empty()) {
                return Err(bad(self, v, "no dataset given", false));
            }
            for e in &l {
                if let Err(err) = super::input::parse_mix_entry(e) {
                    return Err(bad(self, v, &format!("entry {e:?}: {err}"), false));
                }
            }
        }
        Ok(Parsed::List(l))
    }
}

/// The loader's options set one by one by key (the C ABI's
/// `ksp_config`, the Python extension's keyword arguments): a
/// [`LoaderBuilder`] with the cluster described by keys and resolved at
/// [`LoaderOptions::builder`].
#[derive(Debug, Clone)]
pub struct LoaderOptions {
    builder: LoaderBuilder,
    cluster: ClusterSpec,
    token: Option<Vec<u8>>,
}

impl Default for LoaderOptions {
    fn default() -> Self {
        Self::new()
    }
}

impl LoaderOptions {
    /// Every option at its default (no input yet).
    pub fn new() -> Self {
        LoaderOptions {
            builder: LoaderBuilder::empty(),
            cluster: ClusterSpec::default(),
            token: None,
        }
    }

    /// Sets `key` from a string, as `ksp_config_set` does. On an error
    /// the options are left as they were.
    pub fn set(&mut self, key: &str, value: &str) -> Result<()> {
        let spec = spec(key).ok_or_else(|| Error::UnknownOption {
            key: key.to_string(),
            value: format!("{value:?}"),
        })?;
        let parsed = spec.parse(OptionValue::Str(value), true)?;
        self.apply(spec, parsed);
        Ok(())
    }

    /// Sets `key` from a typed value, as the Python extension does
    /// (strings are taken only where the kind's own form is a string:
    /// sizes, choices, text). On an error the options are left as they were.
    pub fn set_value(&mut self, key: &str, value: OptionValue<'_>) -> Result<()> {
        let spec = spec(key).ok_or_else(|| Error::UnknownOption {
            key: key.to_string(),
            value: value.to_string(),
        })?;
        let parsed = spec.parse(value, false)?;
        self.apply(spec, parsed);
        Ok(())
    }

    /// Sets the job token from bytes (a token need not be UTF-8; the
    /// `token` key takes text).
    pub fn set_token(&mut self, token: &[u8]) {
        self.token = Some(token.to_vec());
    }

    /// The builder as set so far, without the cluster (to read a setting).
    pub fn builder_ref(&self) -> &LoaderBuilder {
        &self.builder
    }

    /// The builder these options describe, with the cluster resolved
    /// (cluster mode; with `cluster_env` the rank and world come from the
    /// launcher's environment).
    pub fn builder(&self) -> Result<LoaderBuilder> {
        let mut b = self.builder.clone();
        if let Some((cluster, env)) = self.cluster.resolve()? {
            let token = self.token.as_ref().ok_or_else(|| {
                Error::InvalidConfig("cluster mode is set but token is not".into())
            })?;
            if let Some(env) = env {
                b = b.rank(env.rank, env.world);
            }
            b = b.cluster(cluster).token(token);
        }
        Ok(b)
    }

    fn apply(&mut self, spec: &OptionSpec, p: Parsed) {
        let b = std::mem::replace(&mut self.builder, LoaderBuilder::empty());
        let num = |p: &Parsed| match p {
            Parsed::Num(n) => Some(*n),
            _ => None,
        };
        let n = num(&p);
        let n32 = n.map(|n| n as u32);
        let on = matches!(p, Parsed::Bool(true));
        let text = match &p {
            Parsed::Text(t) => Some(t.clone()),
            _ => None,
        };
        let unset = p == Parsed::Unset;
        let mut landing = b.landing_options().clone();
        self.builder = match spec.name {
            _ if unset => b,
            "space" => b.set_space(PathBuf::from(text.unwrap_or_default())),
            "source" => b.set_source(&text.unwrap_or_default()),
            "catalog" => b.catalog(text.unwrap_or_default()),
            "batch_size" => b.batch_size(n.unwrap_or(64) as usize),
            "seed" => b.seed(n.unwrap_or(0)),
            "shuffle" => b.shuffle(on),
            "shuffle_block" => b.shuffle_block(n.unwrap_or(0)),
            "drop_last" => b.drop_last(on),
            "rank" | "world" => {
                let (mut r, mut w) = b.rank_world();
                if spec.name == "rank" {
                    r = n32.unwrap_or(0);
                } else {
                    w = n32.unwrap_or(1);
                }
                b.rank(r, w)
            }
            // Auto is 0: the build sizes the ring from the batch.
            "ring_bytes" => b.ring_bytes(n.unwrap_or(0)),
            "tier_bytes" => b.tier_bytes(n.unwrap_or(0)),
            "cache_dir" => b.cache_dir(text.map(PathBuf::from)),
            "cache_bytes" => b.cache_bytes(n.unwrap_or(0)),
            "cache_policy" => b.cache_policy(
                text.as_deref()
                    .and_then(crate::cache::CachePolicy::parse)
                    .unwrap_or(crate::cache::CachePolicy::NextUse),
            ),
            "cache_memory_bytes" => b.cache_memory_bytes(n.unwrap_or(0)),
            "tier_views" => b.tier_views(on),
            "pollers" => b.pollers(n.unwrap_or(1) as usize),
            "queue_depth" => b.queue_depth(n32.unwrap_or(32)),
            "submit_batch" => b.submit_batch(n32.unwrap_or(DEFAULT_SUBMIT_BATCH)),
            "max_read_bytes" => b.max_read_bytes(n.unwrap_or(4 << 20)),
            "lookahead" => b.lookahead(n.unwrap_or(u64::MAX)),
            "spin_us" => b.spin(Duration::from_micros(n.unwrap_or(0))),
            "sqpoll_idle_ms" => b.sqpoll(n32),
            "coop_taskrun" => b.coop_taskrun(on),
            "pin" => b.pin(on),
            "local_rank" => b.local_rank_part(n32, None),
            "local_world_size" => b.local_rank_part(None, n32),
            "poller_numa_node" => b.poller_numa_node(n32),
            "sysfs_root" => b.sysfs_root(text.unwrap_or_default()),
            "registered_buffers" => b.registered_buffers(on),
            "registered_files" => b.registered_files(on),
            "verify_crc32c" => b.verify_crc32c(on),
            "page_cache" => b.page_cache(
                text.as_deref()
                    .and_then(super::PageCache::parse)
                    .unwrap_or_default(),
            ),
            "huge_pages" | "mlock" | "numa_node" | "gpu_pci" | "cuda" => {
                match spec.name {
                    "huge_pages" => landing.huge_pages = on,
                    "mlock" => landing.mlock = on,
                    "numa_node" => landing.numa_node = n32,
                    "gpu_pci" => landing.gpu_pci = text,
                    _ => {
                        landing.cuda = match text.as_deref() {
                            Some("off") => CudaMode::Off,
                            Some("require") => CudaMode::Require,
                            _ => CudaMode::Auto,
                        }
                    }
                }
                b.landing(landing)
            }
            "gpu_ring" => b.gpu_ring(n32),
            "mix" => match p {
                Parsed::List(l) => b.set_mix(
                    l.iter()
                        .map(|e| super::input::parse_mix_entry(e).expect("checked at parse")),
                ),
                _ => b,
            },
            "mix_epoch_size" => match n {
                Some(n) => b.mix_epoch_size(n),
                None => b,
            },
            "start_epoch" => b.start_at(crate::sampler::Position {
                epoch: n.unwrap_or(0),
                index: 0,
            }),
            "end_epoch" => b.end_epoch(n),
            "node_timeout_ms" => b.node_timeout(Duration::from_millis(n.unwrap_or(10_000))),
            "node_timeout" => match p {
                Parsed::Dur(d) => b.node_timeout(d),
                _ => b,
            },
            "rdma" => {
                let cur = b.rdma_options().cloned().unwrap_or_default();
                b.rdma(on.then_some(cur))
            }
            "rdma_device" | "rdma_port" | "rdma_gid_index" => {
                let mut o = b.rdma_options().cloned().unwrap_or_default();
                match spec.name {
                    "rdma_device" => o.device = text,
                    "rdma_port" => o.port = n.unwrap_or(1) as u8,
                    _ => o.gid_index = n.map(|g| g as u8),
                }
                b.rdma(Some(o))
            }
            "local_node" => b.local_node(n32),
            "agent" => b.agent(
                text.as_deref()
                    .and_then(super::AgentMode::parse)
                    .unwrap_or_default(),
            ),
            "agent_socket" => b.agent_socket(text.map(PathBuf::from)),
            "agent_restart_wait_ms" => b.agent_restart_wait(Duration::from_millis(n.unwrap_or(0))),
            "s3_endpoint_url" => b.s3_endpoint_url(text),
            "s3_profile" => b.s3_profile(text),
            "cluster_file" => {
                self.cluster.file = text.map(PathBuf::from);
                b
            }
            "cluster_nodes" => {
                if let Parsed::List(l) = p {
                    self.cluster.addrs = Some(l);
                }
                b
            }
            "cluster_nodelist" => {
                self.cluster.hostlist = text;
                b
            }
            "cluster_nodes_dns" => {
                self.cluster.dns = text;
                b
            }
            "cluster_node_count" => {
                self.cluster.nodes = n32;
                b
            }
            "cluster_port" => {
                self.cluster.port = n.map(|p| p as u16);
                b
            }
            "cluster_env" => {
                self.cluster.env = on;
                b
            }
            "token" => {
                self.token = text.map(String::into_bytes);
                b
            }
            other => unreachable!("option {other} is in the table but not applied"),
        };
    }
}

/// The options table in Markdown (the README's and `ksp_config_set`'s).
pub fn markdown_table() -> String {
    let mut s = String::from(
        "| key | type | range | unit | default | what it does |\n|---|---|---|---|---|---|\n",
    );
    for o in OPTIONS {
        let range = match o.kind {
            OptionKind::Choice(w) => w.join(", "),
            OptionKind::Seconds { min_ms, max_ms } => {
                format!("{} to {}", min_ms as f64 / 1000.0, max_ms as f64 / 1000.0)
            }
            k => match k.range() {
                Some((min, u64::MAX)) => format!("{min} and up"),
                Some((min, max)) => format!("{min} to {max}"),
                None => String::new(),
            },
        };
        let doc = match o.alias_of {
            Some(of) => format!("alias of `{of}`: {}", o.doc),
            None => o.doc.to_string(),
        };
        let _ = writeln!(
            s,
            "| `{}` | {} | {} | {} | {} | {} |",
            o.name,
            o.kind.type_name(),
            range,
            o.unit,
            o.default,
            doc
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_option_is_applied_and_names_are_unique() {
        let mut seen = std::collections::HashSet::new();
        for o in OPTIONS {
            assert!(seen.insert(o.name), "{} twice", o.name);
            if let Some(of) = o.alias_of {
                assert!(spec(of).is_some(), "{} is an alias of unknown {of}", o.name);
            }
            // Any accepted value reaches apply() without hitting its
            // unreachable!() arm.
            let v = match o.kind {
                OptionKind::Bool => "true".to_string(),
                OptionKind::Choice(w) => w[0].to_string(),
                OptionKind::Seconds { .. } => "1".to_string(),
                k => match k.range() {
                    Some((min, _)) => min.to_string(),
                    None => "x:1".to_string(),
                },
            };
            LoaderOptions::new().set(o.name, &v).unwrap();
        }
    }

    #[test]
    fn one_message_for_every_front_end() {
        let mut o = LoaderOptions::new();
        let e = o.set("queue_depth", "16385").unwrap_err().to_string();
        assert_eq!(
            e,
            "option queue_depth: 16385 is above the maximum; it takes an integer from 1 to 16384"
        );
        let e2 = o
            .set_value("queue_depth", OptionValue::Int(16385))
            .unwrap_err()
            .to_string();
        assert_eq!(
            e2,
            "option queue_depth: 16385 is above the maximum; it takes an integer from 1 to 16384"
        );
        assert!(matches!(
            o.set("nope", "1"),
            Err(Error::UnknownOption { .. })
        ));
    }
}
