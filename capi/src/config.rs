//! `ksp_config`: loader settings set from strings, through the loader's
//! one options table ([`kspeed::loader::options`]).

use std::ffi::c_char;

use super::errors::{guard, ksp_status, Fail};
use super::ffi::{str_arg, Handle, Out};
use kspeed::loader::{LoaderBuilder, LoaderOptions};

/// Loader settings, built with [`ksp_config_set`]. Opaque.
pub struct ksp_config {
    /// The options, parsed by the table every front end shares: its
    /// defaults are the C ABI's.
    options: LoaderOptions,
}

impl Handle for ksp_config {
    const WHAT: &'static str = "cfg";
}

impl ksp_config {
    /// The loader builder these settings describe, with the cluster
    /// resolved (cluster mode).
    pub(super) fn loader_builder(&self) -> Result<LoaderBuilder, Fail> {
        Ok(self.options.builder()?)
    }
}

/// Creates a configuration with kspeed's defaults (batch 64, seed 0,
/// shuffle on, rank 0 of 1, ring sized from the batch...). Free it with
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
        ksp_config {
            options: LoaderOptions::new(),
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

/// Sets one setting from strings, through the loader's one options table
/// (`kspeed::loader::options`, shared with Python, the `kspeed read` flags
/// and the DALI operator). Every key has the default shown until it is set;
/// booleans take `true`/`false`, `1`/`0`, `yes`/`no`, `on`/`off`; sizes
/// take bytes or a unit (`256MiB`); `node_timeout` is a documented alias
/// of `node_timeout_ms` in seconds. `local_rank` and `local_world_size`
/// go together (both, or neither); `rdma_device`, `rdma_port` and
/// `rdma_gid_index` each imply `rdma=true`. In C terms: a CRC32C mismatch
/// (`verify_crc32c`) is `KSP_ERR_DATA` naming the sample and file; a batch
/// holding a tier sample (`tier_views`) has `span` NULL (see `ksp_batch`);
/// with `gpu_ring` batch pointers are device pointers; with `end_epoch`,
/// `ksp_loader_set_epoch` to it or later is `KSP_ERR_INVALID_ARG`.
///
/// <!-- options:begin -->
/// | key | type | range | unit | default | what it does |
/// |---|---|---|---|---|---|
/// | `space` | path |  |  | none: `space` or `source` is required | a preloaded space directory (the fast path) |
/// | `source` | text |  |  | none | a source read directly (DIR, list:FILE, tar:DIR) |
/// | `catalog` | path |  |  | built from the source into a temporary file | the catalog for `source` (`kspeed catalog`) |
/// | `batch_size` | int | 1 to 1048576 | samples | 64 | samples per batch |
/// | `seed` | int | 0 and up |  | 0 | shuffle seed, the same on every rank |
/// | `shuffle` | bool |  |  | true | shuffle each epoch (`kspeed read --no-shuffle`) |
/// | `shuffle_block` | int | 0 to 16777215 | samples | 0 | shuffle within blocks of this many consecutive ids (0: the whole dataset); with tar shards in a bucket, a block's samples share ranged GETs |
/// | `drop_last` | bool |  |  | false | drop each epoch's last, partial batch |
/// | `rank` | int | 0 to 4294967295 |  | 0 | this rank |
/// | `world` | int | 1 to 4294967295 | ranks | 1 | the world size |
/// | `ring_bytes` | size or auto | 4096 and up | bytes | auto: six batches of the mean sample, 4 to 256 MiB (a mixture: from 64 MiB; cluster mode: 256 MiB), at most twice the dataset (its samples rounded up to the 4 KiB alignment), and at least a batch of the largest samples plus two read ahead (up to 4 GiB; a batch needing more is refused) | landing ring size (locked memory the reads land in); a size given is refused if it cannot hold a whole batch |
/// | `tier_bytes` | size | 0 and up | bytes | 0: no tier | memory tier budget: samples read once are kept in memory and served from there |
/// | `cache_dir` | path |  |  | none: no cache area | an NVMe cache area (docs/CACHE.md): samples read from the source (a source, or what a partial space does not hold) are kept here for their next read, by `cache_policy`, within `cache_bytes`; each rank uses `rank<N>` under this folder; what a run kept is used by the next; `:memory:` keeps the area in the loader's memory instead (the same policy, and a space's samples too; nothing on disk, gone with the loader) |
/// | `cache_bytes` | size | 0 and up | bytes | 0: no cache area | the cache area's budget, shared among slot size classes from 4 KiB to the catalog's 99th percentile sample length (larger samples are not kept; docs/CACHE.md) |
/// | `cache_policy` | choice | next-use, min, lru |  | next-use | what the cache area keeps: `next-use` what this rank reads soonest (Belady's MIN over the known order, replacing a kept sample only when the write gains a hit), `min` MIN itself (the fewest source reads, more writes), `lru` what it read last (the page cache's policy, for comparison) |
/// | `cache_memory_bytes` | size | 0 and up | bytes | 0: none | a memory level above the cache area on disk (docs/CACHE.md, "Two levels"): an area of this many bytes in the loader's memory, read before the one in `cache_dir` (a folder), with its own plan by the same `cache_policy` (next use: what the rank reads again soonest) over what comes from the area, the space or the source; nothing on disk, gone with the loader |
/// | `tier_views` | bool |  |  | false | a sample served from the memory tier (attached: the agent's node tier, mapped read-only) is handed out in place (no copy into the ring); a batch holding one is not one ring span |
/// | `pollers` | int | 1 to 1024 | threads | a quarter of this rank's core slice, 1 to 8 (twice that, at most the slice, when the space is read through the page cache) | poller threads |
/// | `queue_depth` | int | 1 to 16384 | reads | 32 | reads in flight per poller (io_uring holds at most 32768 entries, two per read) |
/// | `submit_batch` | int | 1 to 16384 | reads | 8 | reads a poller queues before it submits them (one system call per batch) |
/// | `max_read_bytes` | size | 4096 and up | bytes | 4MiB | largest single read: bigger samples are read in parts |
/// | `lookahead` | int | 1 and up | samples | as many as the ring holds | most samples read ahead of the consumer (at least one batch) |
/// | `spin_us` | int | 0 to 10000000 | us | 0 on up to 4 cores or on cores shared with other ranks, else 20 | how long pollers and the consumer busy-poll before parking |
/// | `sqpoll_idle_ms` | int | 0 to 4294967295 | ms | none: no SQPOLL | use an SQPOLL kernel thread per poller, idling after this long |
/// | `coop_taskrun` | bool |  |  | false | create the pollers' io_urings with IORING_SETUP_COOP_TASKRUN |
/// | `pin` | bool |  |  | true | pin the pollers to this rank's cores (`kspeed read --no-pin`) |
/// | `local_rank` | int | 0 to 4294967295 |  | from the environment (KSPEED_LOCAL_RANK, LOCAL_RANK, OMPI_COMM_WORLD_LOCAL_RANK, MPI_LOCALRANKID, SLURM_LOCALID), else 0 | this process's rank among the node's ranks (with `local_world_size`); each gets its own slice of cores |
/// | `local_world_size` | int | 1 to 4294967295 | ranks | from the environment, else 1 | the number of ranks on this node (with `local_rank`) |
/// | `poller_numa_node` | int | 0 to 4095 |  | the ring's node | take the pollers' cores from this NUMA node |
/// | `sysfs_root` | path |  |  | KSPEED_SYSFS_ROOT, else /sys | read the CPU topology from this directory shaped like /sys |
/// | `registered_buffers` | bool |  |  | true | register the ring with io_uring as fixed buffers (`kspeed read --no-registered-buffers`) |
/// | `registered_files` | bool |  |  | true | register the extent files with io_uring (`kspeed read --no-registered-files`) |
/// | `verify_crc32c` | bool |  |  | false | check the CRC32C of every sample read from disk or pushed by another node against the catalog (a mismatch is a data error naming the sample and file, or in a cluster a failover to the next copy); attached to the node agent, the agent checks |
/// | `page_cache` | choice | auto, off, on |  | auto | how a preloaded space is read: `auto` through the page cache when at least 90% of a sample of its pages is cached as the loader is built (a warm machine; the loader's I/O description says which and why), else O_DIRECT; `off` always O_DIRECT; `on` always the page cache |
/// | `huge_pages` | bool |  |  | true | 2 MiB pages for the ring when the system has them reserved (`kspeed read --no-huge-pages`) |
/// | `mlock` | bool |  |  | true | lock the ring in memory (needs RLIMIT_MEMLOCK of at least `ring_bytes`; `kspeed read --no-mlock`) |
/// | `numa_node` | int | 0 to 4095 |  | not bound (the kernel's placement) | bind the ring to this NUMA node |
/// | `gpu_pci` | text |  |  | none | bind the ring to the NUMA node of this GPU (PCI address, e.g. 0000:3b:00.0) |
/// | `cuda` | choice | auto, off, require |  | auto | register the ring with CUDA: when possible, never, or fail if not possible |
/// | `gpu_ring` | int | 0 to 1023 |  | none: a host ring | CUDA device ordinal: the ring lives in that GPU's memory and RDMA writes land there (cluster mode over RDMA with a `source`) |
/// | `mix` | list |  |  | none: one dataset (`space` or `source`) | a mixture of datasets read side by side (in cluster mode the nodes serve the same spaces side by side: `kspeed serve --space A --space B`): `PATH:WEIGHT` entries, PATH a space directory, a catalog (`.ksc`) or a source, WEIGHT a proportion (`0.7`), `repeat=R` or `choose=N` (none: `repeat=1`); ids follow the order given |
/// | `mix_epoch_size` | int | 1 and up | samples | the datasets' total length | samples per epoch that a mixture's proportions divide |
/// | `start_epoch` | int | 0 and up |  | 0 | first epoch |
/// | `end_epoch` | int | 1 and up |  | none: read-ahead runs on into the next epoch | the job reads epochs below this one only: nothing is read ahead past its last sample (`kspeed read --epochs`) |
/// | `cluster_file` | path |  |  | none: single-node | cluster mode: the node list (`<index> <host:port>` per line) |
/// | `cluster_nodes` | list |  |  | none | cluster mode: the node services' `host:port` in node order (comma-separated) |
/// | `cluster_nodelist` | text |  |  | none | cluster mode: a SLURM hostlist (`gpu[01-04,07]`), each at `cluster_port` |
/// | `cluster_nodes_dns` | text |  |  | none | cluster mode: a name pattern with `{i}` (`kspeed-{i}.kspeed.ns.svc:7400`) for `cluster_node_count` nodes |
/// | `cluster_node_count` | int | 1 to 4294967295 | nodes | none (with `cluster_env`: WORLD_SIZE / LOCAL_WORLD_SIZE) | the node count for `cluster_nodes_dns` |
/// | `cluster_port` | int | 1 to 65535 |  | KSPEED_PORT, else 7400 | port for `cluster_nodelist` and a pattern without one |
/// | `cluster_env` | bool |  |  | false | rank, world and (unless a node list is given) the node list from the launcher's environment (docs/DEPLOY.md) |
/// | `token` | text |  |  | none (required in cluster mode) | cluster mode: the job token (`kspeed read --token-file`) |
/// | `node_timeout_ms` | int | 1 to 86400000 | ms | 10000 | cluster mode: how long a node may stay silent with grants outstanding before they fail over |
/// | `node_timeout` | seconds | 0.001 to 86400 | s | 10 | alias of `node_timeout_ms`: `node_timeout_ms` in seconds (Python's name) |
/// | `rdma` | bool |  |  | false: TCP | cluster mode: receive over RDMA (every node serves with `--rdma`) |
/// | `rdma_device` | text |  |  | the first device | RDMA device name; implies `rdma` |
/// | `rdma_port` | int | 1 to 255 |  | 1 | RDMA port number; implies `rdma` |
/// | `rdma_gid_index` | int or auto | 0 to 255 |  | auto | GID index (`auto`: the RoCE v2 GID of the connection's address); implies `rdma` |
/// | `agent` | choice | auto, off, required |  | auto | read through the node's `kspeed agent` (docs/DEPLOY.md): `required` always (no agent is a `NoAgent` error), `auto` in cluster mode where the agent can serve this loader (its socket exists; no tier or GPU ring of its own, a mixture only of spaces, served by an agent given them: `kspeed agent --space A --space B`; a refusal falls back to embedded with a WARN), `off` never (this process's own pollers) |
/// | `agent_socket` | path |  |  | KSPEED_AGENT_SOCKET, else /run/kspeed/agent.sock | the node agent's attach socket |
/// | `agent_restart_wait_ms` | int | 0 to 86400000 | ms | 0: `AgentGone` at once | attached: when the agent goes (`AgentGone`), wait this long for an agent at the same socket and attach to it where this rank stood, every sample still delivered once; batches kept out stay valid (their ring stays mapped until they are released) |
/// | `s3_endpoint_url` | text |  |  | AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL, the profile's, else AWS | a source in an S3-compatible store (`s3://`): its endpoint, e.g. http://minio:9000 (path-style requests); read only when a sample is read from the bucket. Process-wide: the last loader built with it sets it |
/// | `s3_profile` | text |  |  | AWS_PROFILE, else default | a source in an object store: the profile of ~/.aws/credentials and ~/.aws/config to take credentials, region and endpoint from. Process-wide, as `s3_endpoint_url` |
/// | `local_node` | int | 0 to 65535 |  | the local space's node; none with a source | cluster mode: the node this process runs on (its samples are never requested over the network) |
/// <!-- options:end -->
///
/// Returns `KSP_ERR_INVALID_ARG` for an unknown key or a bad value (the
/// message names the key, the value and what the key takes, in the words
/// of every front end; the configuration is left as it was),
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
        // A bad value leaves the configuration as it was.
        c.options.set(k, v)?;
        Ok(())
    })
}
