//! `ksp_config`: loader settings set from strings, mirroring the Rust
//! [`LoaderBuilder`].

use std::ffi::c_char;
use std::time::Duration;

use super::errors::{guard, ksp_status, Fail};
use super::ffi::{str_arg, Handle, Out};
use kspeed::landing::{CudaMode, LandingOptions};
use kspeed::loader::LoaderBuilder;
use kspeed::transport::ClusterSpec;

/// Loader settings, built with [`ksp_config_set`]. Opaque.
pub struct ksp_config {
    /// The Rust builder itself: its defaults are the C ABI's.
    builder: LoaderBuilder,
    /// Cluster mode (resolved when the loader is created).
    cluster: ClusterSpec,
    token: Option<Vec<u8>>,
}

impl Handle for ksp_config {
    const WHAT: &'static str = "cfg";
}

impl ksp_config {
    /// The loader builder these settings describe, with the cluster
    /// resolved (cluster mode).
    pub(super) fn loader_builder(&self) -> Result<LoaderBuilder, Fail> {
        let mut b = self.builder.clone();
        if let Some((cluster, env)) = self.cluster.resolve()? {
            let token = self
                .token
                .as_ref()
                .ok_or_else(|| Fail::Invalid("cluster mode is set but token is not".into()))?;
            if let Some(env) = env {
                b = b.rank(env.rank, env.world);
            }
            b = b.cluster(cluster).token(token);
        }
        Ok(b)
    }
}

/// Creates a configuration with kspeed's defaults (batch 64, seed 0,
/// shuffle on, rank 0 of 1, 256 MiB ring...). Free it with
/// [`ksp_config_free`].
///
/// Status: `KSP_OK`; `KSP_ERR_NULL_ARG` (`out`). The caller owns `*out`.
///
/// Thread safety: any thread.
///
/// # Safety
/// `out` must be writable.
#[no_mangle]
pub unsafe extern "C" fn ksp_config_new(out: *mut *mut ksp_config) -> ksp_status {
    guard(|| {
        // SAFETY: out is NULL or writable (contract).
        let out = unsafe { Out::new(out, "out")? };
        let landing = LandingOptions::default().cuda(CudaMode::Auto);
        ksp_config {
            builder: LoaderBuilder::empty().landing(landing),
            cluster: ClusterSpec::default(),
            token: None,
        }
        .give(out);
        Ok(())
    })
}

/// Frees a configuration. NULL is a no-op. Using it afterwards is undefined
/// behaviour (as with `free`). Loaders created from it do not need it.
///
/// Thread safety: no other call on `cfg` may run or follow.
///
/// # Safety
/// `cfg` is NULL or came from [`ksp_config_new`] and was not freed.
#[no_mangle]
pub unsafe extern "C" fn ksp_config_free(cfg: *mut ksp_config) {
    // SAFETY: per the contract.
    unsafe { ksp_config::free(cfg) }
}

fn parse_num<T: std::str::FromStr>(key: &str, v: &str) -> Result<T, Fail> {
    v.trim()
        .parse()
        .map_err(|_| Fail::Invalid(format!("config {key}: {v:?} is not a valid number")))
}

fn parse_bytes(key: &str, v: &str) -> Result<u64, Fail> {
    kspeed::progress::parse_bytes(v).map_err(|e| Fail::Invalid(format!("config {key}: {e}")))
}

fn parse_bool(key: &str, v: &str) -> Result<bool, Fail> {
    match v.trim() {
        "1" | "true" | "yes" | "on" => Ok(true),
        "0" | "false" | "no" | "off" => Ok(false),
        _ => Err(Fail::Invalid(format!(
            "config {key}: {v:?} is not a boolean (true/false, 1/0)"
        ))),
    }
}

/// Sets one setting from strings, mirroring the Rust `LoaderBuilder`.
/// Every key has the default shown until it is set:
///
/// | key | value | default |
/// |---|---|---|
/// | `space` | a preloaded space directory | none: `space` or `source` is required |
/// | `source` | a source read directly (DIR, list:FILE, tar:DIR) | none |
/// | `catalog` | the catalog for `source` | built from the source into a temporary file |
/// | `batch_size` | samples per batch | 64 |
/// | `seed` | shuffle seed | 0 |
/// | `shuffle` | true/false: shuffle each epoch | true |
/// | `drop_last` | true/false: drop each epoch's last, partial batch | false |
/// | `verify_crc32c` | true/false: check the CRC32C of every sample read from disk against the catalog (one pass over its bytes; a mismatch is `KSP_ERR_DATA` naming the sample and file). Off: bytes are delivered as read | false |
/// | `mlock` | true/false: lock the ring in memory (needs `RLIMIT_MEMLOCK` of at least `ring_bytes`) | true |
/// | `huge_pages` | true/false: 2 MiB pages for the ring when the system has them reserved (normal pages otherwise) | true |
/// | `pin` | true/false: pin the pollers to this rank's cores | true |
/// | `rank`, `world` | this rank, world size | 0, 1 |
/// | `ring_bytes` | landing ring size, e.g. `256MiB` (refused if it cannot hold a whole batch) | 256 MiB |
/// | `tier_bytes` | memory tier budget: samples read once are kept in memory and served from there | 0: no tier |
/// | `tier_views` | true: a sample served from the memory tier is handed out in place (its `ksp_sample.data` points into the tier, no copy into the ring); a batch holding such a sample has `span` NULL (see `ksp_batch`) | false |
/// | `pollers` | poller threads | a quarter of this rank's core slice, 1 to 8 |
/// | `queue_depth` | reads in flight per poller | 32 |
/// | `submit_batch` | reads a poller queues before it submits them | 8 |
/// | `lookahead` | most samples read ahead of the consumer (at least one batch) | as many as the ring holds |
/// | `numa_node` | NUMA node of the ring | not bound (the kernel's placement) |
/// | `local_rank`, `local_world_size` | this process's rank among the node's ranks and their number (both, or neither); each rank's pollers get their own slice of cores | from the environment: `KSPEED_LOCAL_RANK`/`KSPEED_LOCAL_WORLD_SIZE`, `LOCAL_RANK`/`LOCAL_WORLD_SIZE`, `OMPI_COMM_WORLD_LOCAL_RANK`/`OMPI_COMM_WORLD_LOCAL_SIZE` or `SLURM_LOCALID` with `SLURM_NTASKS_PER_NODE`/`SLURM_TASKS_PER_NODE`; else rank 0 of 1 |
/// | `poller_numa_node` | take the pollers' cores from this NUMA node | the ring's node |
/// | `gpu_ring` | CUDA device ordinal: the ring lives in that GPU's memory and RDMA writes land there (cluster mode over RDMA with a `source`; batch pointers are then device pointers) | none: a host ring |
/// | `start_epoch` | first epoch | 0 |
/// | `end_epoch` | the job reads epochs below this one only: nothing is read ahead past its last sample, and `ksp_loader_set_epoch` to it or later is `KSP_ERR_INVALID_ARG` | none: read-ahead runs on into the next epoch |
/// | `cluster_file` | cluster mode: the node list | none: single-node (no cluster) |
/// | `cluster_nodes` | cluster mode: the node services' `host:port`, comma-separated, in node order | none |
/// | `cluster_nodelist` | cluster mode: a SLURM hostlist (`gpu[01-04,07]`), at `cluster_port` | none |
/// | `cluster_nodes_dns`, `cluster_node_count` | cluster mode: a name pattern with `{i}` (`kspeed-{i}.kspeed.ns.svc:7400`) for that many nodes | none |
/// | `cluster_port` | port for `cluster_nodelist` and a pattern without one | `KSPEED_PORT`, else 7400 |
/// | `cluster_env` | true: rank, world and (unless one of the above is set) the node list from the launcher's environment, as `kspeed read --cluster-env` (docs/DEPLOY.md) | false |
/// | `token` | cluster mode: the job token | none (required in cluster mode) |
/// | `node_timeout_ms` | cluster mode: how long a node may stay silent with grants outstanding before they fail over | 10000 |
/// | `rdma` | cluster mode: true to receive over RDMA (every node serves with `--rdma`) | false: TCP |
/// | `rdma_device`, `rdma_port`, `rdma_gid_index` | RDMA device name, port, GID index (`auto`: the RoCE v2 GID of the connection's address); each implies `rdma=true` | the first device, port 1, `auto` |
///
/// Returns `KSP_ERR_INVALID_ARG` for an unknown key or a bad value (the
/// message names both; the configuration is left as it was),
/// `KSP_ERR_NULL_ARG` for NULL arguments.
///
/// Thread safety: one thread at a time per configuration (it is
/// modified), and not while [`super::ksp_loader_new`] reads it on another
/// thread.
///
/// # Safety
/// `cfg` is a live configuration; `key` and `value` NUL-terminated strings.
#[no_mangle]
pub unsafe extern "C" fn ksp_config_set(
    cfg: *mut ksp_config,
    key: *const c_char,
    value: *const c_char,
) -> ksp_status {
    guard(|| {
        // SAFETY: cfg is live and used by this thread only; key and value
        // are strings (contract).
        let (c, k, v) = unsafe {
            (
                ksp_config::try_mut(cfg)?,
                str_arg(key, "key")?,
                str_arg(value, "value")?,
            )
        };
        // Work on a copy: a bad value leaves the configuration as it was.
        let b = c.builder.clone();
        let mut landing = b.landing_options().clone();
        let b = match k {
            "space" => b.set_space(v),
            "source" => b.set_source(v),
            "catalog" => b.catalog(v),
            "batch_size" => b.batch_size(parse_num(k, v)?),
            "seed" => b.seed(parse_num(k, v)?),
            "shuffle" => b.shuffle(parse_bool(k, v)?),
            "rank" | "world" => {
                let (mut r, mut w) = b.rank_world();
                if k == "rank" {
                    r = parse_num(k, v)?;
                } else {
                    w = parse_num(k, v)?;
                }
                b.rank(r, w)
            }
            "drop_last" => b.drop_last(parse_bool(k, v)?),
            "ring_bytes" => b.ring_bytes(parse_bytes(k, v)?),
            "tier_bytes" => b.tier_bytes(parse_bytes(k, v)?),
            "tier_views" => b.tier_views(parse_bool(k, v)?),
            "gpu_ring" => b.gpu_ring(Some(parse_num(k, v)?)),
            "pollers" => b.pollers(parse_num(k, v)?),
            "queue_depth" => b.queue_depth(parse_num(k, v)?),
            "submit_batch" => b.submit_batch(parse_num(k, v)?),
            "lookahead" => b.lookahead(parse_num(k, v)?),
            "verify_crc32c" => b.verify_crc32c(parse_bool(k, v)?),
            "pin" => b.pin(parse_bool(k, v)?),
            "local_rank" => b.local_rank_part(Some(parse_num(k, v)?), None),
            "local_world_size" => b.local_rank_part(None, Some(parse_num(k, v)?)),
            "poller_numa_node" => b.poller_numa_node(Some(parse_num(k, v)?)),
            "mlock" | "huge_pages" | "numa_node" => {
                match k {
                    "mlock" => landing.mlock = parse_bool(k, v)?,
                    "huge_pages" => landing.huge_pages = parse_bool(k, v)?,
                    _ => landing.numa_node = Some(parse_num(k, v)?),
                }
                b.landing(landing)
            }
            "start_epoch" => b.start_at(kspeed::sampler::Position {
                epoch: parse_num(k, v)?,
                index: 0,
            }),
            "end_epoch" => b.end_epoch(Some(parse_num(k, v)?)),
            "node_timeout_ms" => b.node_timeout(Duration::from_millis(parse_num(k, v)?)),
            "cluster_file" => {
                c.cluster.file = Some(v.into());
                b
            }
            "cluster_nodes" => {
                c.cluster.addrs = Some(v.split(',').map(str::to_string).collect());
                b
            }
            "cluster_nodelist" => {
                c.cluster.hostlist = Some(v.into());
                b
            }
            "cluster_nodes_dns" => {
                c.cluster.dns = Some(v.into());
                b
            }
            "cluster_node_count" => {
                c.cluster.nodes = Some(parse_num(k, v)?);
                b
            }
            "cluster_port" => {
                c.cluster.port = Some(parse_num(k, v)?);
                b
            }
            "cluster_env" => {
                c.cluster.env = parse_bool(k, v)?;
                b
            }
            "token" => {
                c.token = Some(v.as_bytes().to_vec());
                b
            }
            "rdma" => {
                let on = parse_bool(k, v)?;
                let cur = b.rdma_options().cloned().unwrap_or_default();
                b.rdma(on.then_some(cur))
            }
            "rdma_device" | "rdma_port" | "rdma_gid_index" => {
                let mut o = b.rdma_options().cloned().unwrap_or_default();
                match k {
                    "rdma_device" => o.device = Some(v.to_string()),
                    "rdma_port" => o.port = parse_num(k, v)?,
                    _ if v.trim() == "auto" => o.gid_index = None,
                    _ => o.gid_index = Some(parse_num(k, v)?),
                }
                b.rdma(Some(o))
            }
            _ => {
                return Err(Fail::Invalid(format!(
                    "unknown config key {k:?} (set to {v:?}); the keys are listed at \
                     ksp_config_set in kspeed.h"
                )))
            }
        };
        c.builder = b;
        Ok(())
    })
}
