//! The C ABI: `libkspeed.so` / `libkspeed.a` and `include/kspeed.h`
//! (generated from this module by cbindgen; `scripts/gen_header.sh`).
//!
//! Conventions (after rustls-ffi):
//! - opaque handles with `_new`/`_free` pairs; `_free(NULL)` does nothing;
//! - every fallible call returns a [`ksp_status`]; outputs go through
//!   out-parameters, written only on success;
//! - the message of the last failure on the calling thread is available from
//!   [`ksp_last_error`];
//! - every export runs inside a panic boundary: a panic becomes
//!   `KSP_ERR_PANIC`, never an abort or unwinding into C;
//! - null pointers where a value is required give `KSP_ERR_NULL_ARG`.
//!
//! Thread safety: a handle is used by one thread at a time (the caller
//! serialises); different handles may be used from different threads.
//!
//! This module owns the C boundary and is one of the few allowed `unsafe`.

#![allow(non_camel_case_types)]

use std::cell::RefCell;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Duration;

use crate::dataset::{Placement, PreloadOptions, SourceSpec, Space};
use crate::error::Error;
use crate::landing::{CudaMode, LandingOptions};
use crate::loader::{Loader, LoaderBuilder};

mod classes;
use crate::progress::ProgressMode;
use crate::sampler::POSITION_BYTES;
use crate::transport::{ClusterSpec, NodeService, ServeConfig};
pub use classes::{
    ksp_loader_class_count, ksp_loader_class_name, ksp_loader_member_count, ksp_loader_member_name,
    ksp_loader_sample_member,
};

/// Version of the C ABI: bumped on any incompatible change to kspeed.h.
///
/// 2: `ksp_batch.seq` and `ksp_loader_release_batch(l, seq)` (a batch's
/// identity), `KSP_POSITION_BYTES` 40 (positions carry the catalog's
/// identity), `ksp_loader_batches_per_epoch`.
pub const KSP_ABI_VERSION: u32 = 2;

/// Bytes of a saved loader position.
pub const KSP_POSITION_BYTES: usize = POSITION_BYTES;

/// Status of every fallible call.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ksp_status {
    /// Success.
    KSP_OK = 0,
    /// A required pointer argument was NULL.
    KSP_ERR_NULL_ARG = 1,
    /// An argument or configuration value is invalid (the message says which).
    KSP_ERR_INVALID_ARG = 2,
    /// An I/O error on a named file (open, read, write, disk full).
    KSP_ERR_IO = 3,
    /// Corrupt or incompatible data (catalog, manifest, sample checksum).
    KSP_ERR_DATA = 4,
    /// A node refused, broke the protocol, or a sample could not be fetched.
    KSP_ERR_NETWORK = 5,
    /// A system resource is missing or limited (memlock, io_uring, NUMA, CUDA).
    KSP_ERR_RESOURCE = 6,
    /// The object is not in a state for this call (e.g. a loader that failed).
    KSP_ERR_STATE = 7,
    /// A caller's buffer is too small; the needed size is in the out-length.
    KSP_ERR_BUFFER_TOO_SMALL = 8,
    /// kspeed panicked inside this call (a bug); the handle should be freed.
    KSP_ERR_PANIC = 9,
    /// Any other error.
    KSP_ERR_OTHER = 10,
}

use ksp_status::*;

thread_local! {
    static LAST_ERROR: RefCell<String> = const { RefCell::new(String::new()) };
}

fn set_error(msg: String) {
    LAST_ERROR.with(|e| *e.borrow_mut() = msg);
}

fn status_of(e: &Error) -> ksp_status {
    match e {
        Error::Io { .. }
        | Error::DiskFull { .. }
        | Error::ReadFailed { .. }
        | Error::ShortRead { .. }
        | Error::SymlinkLoop { .. }
        | Error::NotRegularFile { .. }
        | Error::SymlinkOutsideSource { .. }
        | Error::EmptySource { .. }
        | Error::SpaceLocked { .. } => KSP_ERR_IO,
        Error::BadMagic { .. }
        | Error::UnsupportedVersion { .. }
        | Error::ChecksumMismatch { .. }
        | Error::Truncated { .. }
        | Error::Corrupt { .. }
        | Error::SampleCorrupt { .. }
        | Error::SourceChanged { .. }
        | Error::SourceMismatch { .. }
        | Error::CatalogOfAnotherSource { .. }
        | Error::NotASpace { .. }
        | Error::BadFileList { .. }
        | Error::BadTar { .. }
        | Error::SampleTooLarge { .. } => KSP_ERR_DATA,
        Error::InvalidConfig(_)
        | Error::BadPosition(_)
        | Error::BadCluster { .. }
        | Error::BadPlacement { .. }
        | Error::BadHostlist { .. }
        | Error::SampleLargerThanRing { .. }
        | Error::RingTooSmallForBatch { .. } => KSP_ERR_INVALID_ARG,
        Error::Refused { .. }
        | Error::ProtocolViolation { .. }
        | Error::SampleUnavailable { .. }
        | Error::RdmaCompletion { .. } => KSP_ERR_NETWORK,
        Error::Rdma { .. } => KSP_ERR_RESOURCE,
        Error::Memlock { .. } | Error::Numa { .. } | Error::Cuda(_) | Error::Uring { .. } => {
            KSP_ERR_RESOURCE
        }
        Error::ThreadSpawn { .. } => KSP_ERR_RESOURCE,
        Error::ThreadPanicked { .. } => KSP_ERR_PANIC,
        // A loader that failed keeps failing with its first error's status.
        Error::LoaderFailed(first) => status_of(first),
        _ => KSP_ERR_OTHER,
    }
}

/// Why a call failed before reaching kspeed proper.
enum Fail {
    Null(&'static str),
    Invalid(String),
    State(String),
    Small,
    Kspeed(Error),
}

impl From<Error> for Fail {
    fn from(e: Error) -> Self {
        Fail::Kspeed(e)
    }
}

/// Runs `f` inside the panic boundary and maps its outcome to a status,
/// recording the message for [`ksp_last_error`].
fn guard(f: impl FnOnce() -> Result<(), Fail>) -> ksp_status {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => KSP_OK,
        Ok(Err(Fail::Null(what))) => {
            set_error(format!("{what} is NULL"));
            KSP_ERR_NULL_ARG
        }
        Ok(Err(Fail::Invalid(m))) => {
            set_error(m);
            KSP_ERR_INVALID_ARG
        }
        Ok(Err(Fail::State(m))) => {
            set_error(m);
            KSP_ERR_STATE
        }
        Ok(Err(Fail::Small)) => {
            set_error("the buffer is too small".into());
            KSP_ERR_BUFFER_TOO_SMALL
        }
        Ok(Err(Fail::Kspeed(e))) => {
            let s = status_of(&e);
            set_error(e.to_string());
            s
        }
        Err(p) => {
            let what = p
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".into());
            set_error(format!("kspeed panicked (a bug; please report it): {what}"));
            KSP_ERR_PANIC
        }
    }
}

/// # Safety
/// `p` is NULL or a NUL-terminated string valid for the call.
unsafe fn str_arg<'a>(p: *const c_char, what: &'static str) -> Result<&'a str, Fail> {
    if p.is_null() {
        return Err(Fail::Null(what));
    }
    // SAFETY: per this function's contract.
    unsafe { CStr::from_ptr(p) }
        .to_str()
        .map_err(|_| Fail::Invalid(format!("{what} is not UTF-8")))
}

fn null<T>(p: *const T, what: &'static str) -> Result<(), Fail> {
    if p.is_null() {
        Err(Fail::Null(what))
    } else {
        Ok(())
    }
}

/// The kspeed version, a static NUL-terminated string (never freed).
#[no_mangle]
pub extern "C" fn ksp_version() -> *const c_char {
    concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr().cast()
}

/// The C ABI version ([`KSP_ABI_VERSION`] of the library actually loaded).
#[no_mangle]
pub extern "C" fn ksp_abi_version() -> u32 {
    KSP_ABI_VERSION
}

/// Copies the message of the calling thread's last failed call into `buf`
/// (NUL-terminated, truncated to `buf_len`) and its full length (without
/// the NUL) into `*out_len`. An empty message when nothing failed yet.
///
/// Returns `KSP_ERR_BUFFER_TOO_SMALL` when truncated (`*out_len` says the
/// size needed), `KSP_ERR_NULL_ARG` when `buf` or `out_len` is NULL.
///
/// # Safety
/// `buf` must be writable for `buf_len` bytes; `out_len` writable.
#[no_mangle]
pub unsafe extern "C" fn ksp_last_error(
    buf: *mut c_char,
    buf_len: usize,
    out_len: *mut usize,
) -> ksp_status {
    // Not through `guard`: reading the message must not overwrite it.
    if buf.is_null() || out_len.is_null() {
        return KSP_ERR_NULL_ARG;
    }
    let r = catch_unwind(|| {
        LAST_ERROR.with(|e| {
            let m = e.borrow();
            let n = m.len().min(buf_len.saturating_sub(1));
            // SAFETY: buf has buf_len bytes (contract); n + 1 <= buf_len.
            unsafe {
                if buf_len > 0 {
                    std::ptr::copy_nonoverlapping(m.as_ptr().cast(), buf, n);
                    *buf.add(n) = 0;
                }
                *out_len = m.len();
            }
            if n < m.len() {
                KSP_ERR_BUFFER_TOO_SMALL
            } else {
                KSP_OK
            }
        })
    });
    r.unwrap_or(KSP_ERR_PANIC)
}

// --- configuration ----------------------------------------------------------

/// Loader settings, built with [`ksp_config_set`]. Opaque.
pub struct ksp_config {
    /// The Rust builder itself: its defaults are the C ABI's.
    builder: LoaderBuilder,
    /// Cluster mode (resolved when the loader is created).
    cluster: ClusterSpec,
    token: Option<Vec<u8>>,
}

/// Creates a configuration with kspeed's defaults (batch 64, seed 0,
/// shuffle on, rank 0 of 1, 256 MiB ring...). Free it with
/// [`ksp_config_free`].
///
/// Status: `KSP_OK`; `KSP_ERR_NULL_ARG` (`out`). The caller owns `*out`.
///
/// # Safety
/// `out` must be writable.
#[no_mangle]
pub unsafe extern "C" fn ksp_config_new(out: *mut *mut ksp_config) -> ksp_status {
    guard(|| {
        null(out, "out")?;
        let landing = LandingOptions {
            cuda: CudaMode::Auto,
            ..Default::default()
        };
        let cfg = Box::new(ksp_config {
            builder: LoaderBuilder::empty().landing(landing),
            cluster: ClusterSpec::default(),
            token: None,
        });
        // SAFETY: out is writable (checked non-null; contract).
        unsafe { *out = Box::into_raw(cfg) };
        Ok(())
    })
}

/// Frees a configuration. NULL is a no-op. Using it afterwards is undefined
/// behaviour (as with `free`).
///
/// # Safety
/// `cfg` is NULL or came from [`ksp_config_new`] and was not freed.
#[no_mangle]
pub unsafe extern "C" fn ksp_config_free(cfg: *mut ksp_config) {
    if !cfg.is_null() {
        // SAFETY: per the contract, we own it now.
        let _ = catch_unwind(AssertUnwindSafe(|| drop(unsafe { Box::from_raw(cfg) })));
    }
}

fn parse_num<T: std::str::FromStr>(key: &str, v: &str) -> Result<T, Fail> {
    v.trim()
        .parse()
        .map_err(|_| Fail::Invalid(format!("config {key}: {v:?} is not a valid number")))
}

fn parse_bytes(key: &str, v: &str) -> Result<u64, Fail> {
    crate::progress::parse_bytes(v).map_err(|e| Fail::Invalid(format!("config {key}: {e}")))
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

/// Sets one setting from strings, mirroring the Rust `LoaderBuilder`:
///
/// | key | value |
/// |---|---|
/// | `space` | a preloaded space directory |
/// | `source` | a source read directly (DIR, list:FILE, tar:DIR) |
/// | `catalog` | the catalog for `source` |
/// | `batch_size` | samples per batch |
/// | `seed` | shuffle seed |
/// | `shuffle`, `drop_last`, `verify_crc32c`, `mlock`, `huge_pages`, `pin` | true/false |
/// | `rank`, `world` | this rank, world size |
/// | `ring_bytes`, `tier_bytes` | sizes, e.g. `256MiB` |
/// | `pollers`, `queue_depth`, `submit_batch`, `lookahead` | counts |
/// | `numa_node` | NUMA node of the ring |
/// | `local_rank`, `local_world_size` | this process's rank among the node's ranks and their number (both, or neither: then `LOCAL_RANK`/`LOCAL_WORLD_SIZE`, `OMPI_COMM_WORLD_LOCAL_RANK`/`OMPI_COMM_WORLD_LOCAL_SIZE` or `SLURM_LOCALID`/`SLURM_NTASKS_PER_NODE`); each rank's pollers get their own slice of cores |
/// | `poller_numa_node` | take the pollers' cores from this NUMA node (default: the ring's) |
/// | `gpu_ring` | CUDA device ordinal: the ring lives in that GPU's memory and RDMA writes land there (cluster mode over RDMA with a `source`; batch pointers are then device pointers) |
/// | `start_epoch` | first epoch |
/// | `cluster_file` | cluster mode: the node list |
/// | `cluster_nodes` | cluster mode: the node services' `host:port`, comma-separated, in node order |
/// | `cluster_nodelist` | cluster mode: a SLURM hostlist (`gpu[01-04,07]`), at `cluster_port` |
/// | `cluster_nodes_dns`, `cluster_node_count` | cluster mode: a name pattern with `{i}` (`kspeed-{i}.kspeed.ns.svc:7400`) for that many nodes |
/// | `cluster_port` | port for `cluster_nodelist` and a pattern without one (default: `KSPEED_PORT`, else 7400) |
/// | `cluster_env` | true: rank, world and (unless one of the above is set) the node list from the launcher's environment, as `kspeed read --cluster-env` (docs/DEPLOY.md) |
/// | `token` | cluster mode: the job token |
/// | `node_timeout_ms` | cluster mode: failover timeout |
/// | `rdma` | cluster mode: true to receive over RDMA (every node serves with `--rdma`) |
/// | `rdma_device`, `rdma_port`, `rdma_gid_index` | RDMA device name, port, GID index (`auto`: the RoCE v2 GID of the connection's address); each implies `rdma=true` |
///
/// Returns `KSP_ERR_INVALID_ARG` for an unknown key or a bad value (the
/// message names both), `KSP_ERR_NULL_ARG` for NULL arguments.
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
        null(cfg, "cfg")?;
        // SAFETY: strings per the contract.
        let (k, v) = unsafe { (str_arg(key, "key")?, str_arg(value, "value")?) };
        // SAFETY: cfg is live and used by this thread only (contract).
        let c = unsafe { &mut *cfg };
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
            "start_epoch" => b.start_at(crate::sampler::Position {
                epoch: parse_num(k, v)?,
                index: 0,
            }),
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
            _ => return Err(Fail::Invalid(format!("unknown config key {k:?}"))),
        };
        c.builder = b;
        Ok(())
    })
}

// --- loader -----------------------------------------------------------------

/// One sample of a batch. `data` points into the landing ring: host memory,
/// or, with the `gpu_ring` config key, a CUDA device pointer (a
/// `CUdeviceptr` value) the CPU must not dereference.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ksp_sample {
    /// The sample's bytes (valid until the batch is released).
    pub data: *const u8,
    /// Its length in bytes.
    pub len: usize,
    /// Sample id (catalog index).
    pub id: u64,
    /// Label, or -1 when the source has none.
    pub label: i64,
}

/// A batch: `count` samples in order, plus the contiguous span(s) of the
/// ring holding them (alignment padding included). Everything it points to
/// is owned by the loader and valid until this batch is released: by
/// [`ksp_loader_release_batch`] with its `seq`, by the next
/// [`ksp_loader_next_batch`] (a loader holds one batch at a time), by
/// [`ksp_loader_set_epoch`] / [`ksp_loader_restore_position`], or by
/// [`ksp_loader_free`]. With `gpu_ring`, `span`, `wrap` and every sample's
/// `data` are CUDA device pointers (copy or use them on the GPU; `samples`
/// itself is host memory).
///
/// Every batch but an epoch's last has exactly `batch_size` samples, and
/// every rank of a job gets the same number of batches per epoch
/// ([`ksp_loader_batches_per_epoch`]): a batch is never cut short by ring
/// space, because [`ksp_loader_new`] refuses a `ring_bytes` that cannot
/// hold the largest possible batch (`KSP_ERR_INVALID_ARG`, naming the size
/// needed).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ksp_batch {
    /// Samples in the batch; 0 at the end of the epoch.
    pub count: usize,
    /// `count` samples.
    pub samples: *const ksp_sample,
    /// The batch's bytes from its first sample's start.
    pub span: *const u8,
    /// Length of `span`.
    pub span_len: usize,
    /// The rest when the batch wraps around the ring's end (else NULL).
    pub wrap: *const u8,
    /// Length of `wrap` (0 when it does not wrap).
    pub wrap_len: usize,
    /// The epoch this batch belongs to.
    pub epoch: u64,
    /// The batch's identity: 1 for the loader's first batch, then 2, 3...
    /// (0 when `count` is 0). Pass it to [`ksp_loader_release_batch`].
    pub seq: u64,
}

/// Loader statistics, cumulative over the loader's life (restarts by
/// set_epoch or restore_position included). `samples` and `bytes` count
/// what was delivered; the read counters also count read-ahead.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct ksp_stats {
    /// Samples delivered.
    pub samples: u64,
    /// Bytes delivered.
    pub bytes: u64,
    /// Seconds since the loader was created.
    pub elapsed_s: f64,
    /// Seconds the caller waited inside next_batch.
    pub stall_s: f64,
    /// Samples read from disk or source files.
    pub disk_reads: u64,
    /// Samples served from the memory tier.
    pub tier_hits: u64,
    /// Reads retried.
    pub retries: u64,
    /// Read latency percentiles in microseconds.
    pub p50_us: u64,
    /// 99th percentile.
    pub p99_us: u64,
    /// Samples pushed by other nodes (cluster mode).
    pub remote_samples: u64,
    /// Grants moved to another node or the source.
    pub failovers: u64,
    /// Samples read from the source because no node could serve them.
    pub source_reads: u64,
    /// Samples read ahead and waiting in the ring (counted in the read
    /// counters above, not yet in `samples`).
    pub read_ahead: u64,
    /// Samples read ahead and thrown away unconsumed (a jump to another
    /// epoch, a restored position, the end).
    pub read_ahead_discarded: u64,
}

/// A loader. Opaque; one thread at a time.
pub struct ksp_loader {
    loader: Loader,
    samples: Vec<ksp_sample>,
}

/// Creates a loader from `cfg` (which stays owned by the caller and may be
/// freed right after). Opens the space, maps and locks the ring, starts the
/// pollers (and connects to the cluster's nodes in cluster mode). Free it
/// with [`ksp_loader_free`].
///
/// Status: `KSP_OK`; `KSP_ERR_NULL_ARG`; `KSP_ERR_INVALID_ARG` (settings,
/// a sample larger than the ring); `KSP_ERR_IO` / `KSP_ERR_DATA` (the space
/// or source); `KSP_ERR_RESOURCE` (memlock limit, io_uring); `KSP_ERR_NETWORK`
/// (a node refused). The caller owns `*out`.
///
/// # Safety
/// `cfg` is a live configuration; `out` writable.
#[no_mangle]
pub unsafe extern "C" fn ksp_loader_new(
    cfg: *const ksp_config,
    out: *mut *mut ksp_loader,
) -> ksp_status {
    guard(|| {
        null(cfg, "cfg")?;
        null(out, "out")?;
        // SAFETY: live configuration (contract).
        let c = unsafe { &*cfg };
        let mut b = c.builder.clone();
        if let Some((cluster, env)) = c.cluster.resolve()? {
            let token = c
                .token
                .as_ref()
                .ok_or_else(|| Fail::Invalid("cluster mode is set but token is not".into()))?;
            if let Some(env) = env {
                b = b.rank(env.rank, env.world);
            }
            b = b.cluster(cluster).token(token);
        }
        let loader = b.build()?;
        let h = Box::new(ksp_loader {
            samples: Vec::with_capacity(loader.batch_size()),
            loader,
        });
        // SAFETY: out is writable (contract).
        unsafe { *out = Box::into_raw(h) };
        Ok(())
    })
}

/// Stops the loader's threads and frees it and its ring. NULL is a no-op;
/// every pointer from its batches dies with it.
///
/// # Safety
/// `l` is NULL or came from [`ksp_loader_new`] and was not freed.
#[no_mangle]
pub unsafe extern "C" fn ksp_loader_free(l: *mut ksp_loader) {
    if !l.is_null() {
        // SAFETY: per the contract, we own it now.
        let _ = catch_unwind(AssertUnwindSafe(|| drop(unsafe { Box::from_raw(l) })));
    }
}

/// Waits for the next batch of the current epoch and describes it in
/// `*out`; `out->count == 0` at the epoch's end (call
/// [`ksp_loader_set_epoch`] to go on). A batch still held is released
/// first (its pointers die). Returns a loader error as its status
/// (`KSP_ERR_IO` naming the sample and file...); after one, the loader
/// stays failed: every later call returns that first error's status again,
/// with a message that starts "the loader stopped after an earlier error".
///
/// # Safety
/// `l` is a live loader; `out` writable.
#[no_mangle]
pub unsafe extern "C" fn ksp_loader_next_batch(
    l: *mut ksp_loader,
    out: *mut ksp_batch,
) -> ksp_status {
    guard(|| {
        null(l, "loader")?;
        null(out, "out")?;
        // SAFETY: live loader, one thread at a time (contract).
        let h = unsafe { &mut *l };
        let n = h.loader.acquire_batch()?;
        h.samples.clear();
        let mut batch = ksp_batch {
            count: n,
            samples: std::ptr::null(),
            span: std::ptr::null(),
            span_len: 0,
            wrap: std::ptr::null(),
            wrap_len: 0,
            epoch: h.loader.position().epoch,
            seq: h.loader.held_seq().unwrap_or(0),
        };
        if n > 0 {
            // With a GPU ring every pointer is a device address, never
            // dereferenced here.
            let gpu = h.loader.landing_device().is_some();
            for i in 0..n {
                let (data, len, id, label, epoch) = if gpu {
                    let s = h.loader.held_device_sample(i);
                    (s.addr as *const u8, s.len, s.id, s.label, s.position.epoch)
                } else {
                    let s = h.loader.held_sample(i);
                    let (p, l) = (s.bytes.as_ptr(), s.bytes.len());
                    (p, l, s.id, s.label, s.position.epoch)
                };
                if i == 0 {
                    batch.epoch = epoch;
                }
                h.samples.push(ksp_sample {
                    data,
                    len,
                    id,
                    label: label.map_or(-1, |x| x as i64),
                });
            }
            let ((span, span_len), wrap) = if gpu {
                let ((a, l), w) = h.loader.held_device_spans();
                ((a as *const u8, l), w.map(|(a, l)| (a as *const u8, l)))
            } else {
                let (sp, w) = h.loader.held_spans();
                ((sp.as_ptr(), sp.len()), w.map(|w| (w.as_ptr(), w.len())))
            };
            batch.samples = h.samples.as_ptr();
            batch.span = span;
            batch.span_len = span_len;
            if let Some((w, wl)) = wrap {
                batch.wrap = w;
                batch.wrap_len = wl;
            }
        }
        // SAFETY: out is writable (contract).
        unsafe { *out = batch };
        Ok(())
    })
}

/// Releases batch `seq` (its `ksp_batch.seq`): returns its ring space;
/// its pointers are invalid afterwards. A batch that was released already
/// (by an earlier call, the next [`ksp_loader_next_batch`],
/// [`ksp_loader_set_epoch`] or [`ksp_loader_restore_position`]) is left
/// alone and the call does nothing, so a late release never frees a newer
/// batch: a wrapper that releases its batch in a destructor is safe in
/// any order.
///
/// Status: `KSP_OK` (released, or already released); `KSP_ERR_NULL_ARG`;
/// `KSP_ERR_INVALID_ARG` (`seq` was never handed out by this loader).
///
/// # Safety
/// `l` is a live loader.
#[no_mangle]
pub unsafe extern "C" fn ksp_loader_release_batch(l: *mut ksp_loader, seq: u64) -> ksp_status {
    guard(|| {
        null(l, "loader")?;
        // SAFETY: live loader (contract).
        let h = unsafe { &mut *l };
        if h.loader.release_batch_seq(seq)? {
            h.samples.clear();
        }
        Ok(())
    })
}

/// Moves to `epoch` (like PyTorch's `sampler.set_epoch`); releases a held batch.
///
/// Status: `KSP_OK`; `KSP_ERR_NULL_ARG`; `KSP_ERR_NETWORK` (cluster mode:
/// reconnecting failed); a loader that failed earlier returns its first
/// error's status. After a failure here the loader stays failed, but its
/// catalog, statistics and position can still be read.
///
/// # Safety
/// `l` is a live loader.
#[no_mangle]
pub unsafe extern "C" fn ksp_loader_set_epoch(l: *mut ksp_loader, epoch: u64) -> ksp_status {
    guard(|| {
        null(l, "loader")?;
        // SAFETY: live loader (contract).
        let h = unsafe { &mut *l };
        h.samples.clear();
        h.loader.set_epoch(epoch)?;
        Ok(())
    })
}

/// Samples per epoch for this rank, in `*out` (the same on every rank;
/// with `drop_last`, whole batches only).
///
/// Status: `KSP_OK`; `KSP_ERR_NULL_ARG`.
///
/// # Safety
/// `l` is a live loader; `out` writable.
#[no_mangle]
pub unsafe extern "C" fn ksp_loader_epoch_len(l: *const ksp_loader, out: *mut u64) -> ksp_status {
    guard(|| {
        null(l, "loader")?;
        null(out, "out")?;
        // SAFETY: live loader; out writable (contract).
        unsafe { *out = (*l).loader.epoch_len() };
        Ok(())
    })
}

/// Batches per epoch for this rank, in `*out`: the same on every rank of
/// the job (`ceil(epoch_len / batch_size)`; with `drop_last` every batch is
/// whole and the tail is dropped), so DDP ranks stay in lock-step.
///
/// Status: `KSP_OK`; `KSP_ERR_NULL_ARG`.
///
/// # Safety
/// `l` is a live loader; `out` writable.
#[no_mangle]
pub unsafe extern "C" fn ksp_loader_batches_per_epoch(
    l: *const ksp_loader,
    out: *mut u64,
) -> ksp_status {
    guard(|| {
        null(l, "loader")?;
        null(out, "out")?;
        // SAFETY: live loader; out writable (contract).
        unsafe { *out = (*l).loader.batches_per_epoch() };
        Ok(())
    })
}

/// The position of the next sample `ksp_loader_next_batch` delivers: its
/// epoch and its step within the epoch.
///
/// Status: `KSP_OK`; `KSP_ERR_NULL_ARG`.
///
/// # Safety
/// `l` is a live loader; `epoch` and `index` writable.
#[no_mangle]
pub unsafe extern "C" fn ksp_loader_position(
    l: *const ksp_loader,
    epoch: *mut u64,
    index: *mut u64,
) -> ksp_status {
    guard(|| {
        null(l, "loader")?;
        null(epoch, "epoch")?;
        null(index, "index")?;
        // SAFETY: live loader; outputs writable (contract).
        unsafe {
            let p = (*l).loader.position();
            *epoch = p.epoch;
            *index = p.index;
        }
        Ok(())
    })
}

/// Writes the current position (`KSP_POSITION_BYTES` bytes) to `buf` and
/// its length to `*out_len`. `KSP_ERR_BUFFER_TOO_SMALL` (with `*out_len`
/// set) when `buf_len` is less.
///
/// Status: `KSP_OK`; `KSP_ERR_NULL_ARG`; `KSP_ERR_BUFFER_TOO_SMALL`.
///
/// # Safety
/// `l` is a live loader; `buf` writable for `buf_len` bytes; `out_len` writable.
#[no_mangle]
pub unsafe extern "C" fn ksp_loader_save_position(
    l: *const ksp_loader,
    buf: *mut u8,
    buf_len: usize,
    out_len: *mut usize,
) -> ksp_status {
    guard(|| {
        null(l, "loader")?;
        null(buf, "buf")?;
        null(out_len, "out_len")?;
        // SAFETY: live loader (contract).
        let pos = unsafe { &*l }.loader.save_position();
        // SAFETY: out_len writable (contract).
        unsafe { *out_len = pos.len() };
        if buf_len < pos.len() {
            return Err(Fail::Small);
        }
        // SAFETY: buf has at least pos.len() bytes (checked).
        unsafe { std::ptr::copy_nonoverlapping(pos.as_ptr(), buf, pos.len()) };
        Ok(())
    })
}

/// Continues from a position saved by [`ksp_loader_save_position`] with
/// the same dataset (the position records the catalog's identity), seed,
/// shuffle, rank, world and drop_last (`KSP_ERR_INVALID_ARG` otherwise,
/// naming what differs). Releases a held batch.
///
/// Status: `KSP_OK`; `KSP_ERR_NULL_ARG`; `KSP_ERR_INVALID_ARG` (not a
/// position of this loader's job or dataset); a loader that failed earlier
/// returns its first error's status.
///
/// # Safety
/// `l` is a live loader; `buf` readable for `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn ksp_loader_restore_position(
    l: *mut ksp_loader,
    buf: *const u8,
    len: usize,
) -> ksp_status {
    guard(|| {
        null(l, "loader")?;
        null(buf, "buf")?;
        // SAFETY: live loader; buf readable for len bytes (contract).
        let (h, bytes) = unsafe { (&mut *l, std::slice::from_raw_parts(buf, len)) };
        h.samples.clear();
        h.loader.restore_position(bytes)?;
        Ok(())
    })
}

/// Statistics so far, in `*out`.
///
/// Status: `KSP_OK`; `KSP_ERR_NULL_ARG`.
///
/// # Safety
/// `l` is a live loader; `out` writable.
#[no_mangle]
pub unsafe extern "C" fn ksp_loader_stats(l: *const ksp_loader, out: *mut ksp_stats) -> ksp_status {
    guard(|| {
        null(l, "loader")?;
        null(out, "out")?;
        // SAFETY: live loader (contract).
        let s = unsafe { &*l }.loader.stats();
        let st = ksp_stats {
            samples: s.samples,
            bytes: s.bytes,
            elapsed_s: s.elapsed.as_secs_f64(),
            stall_s: s.stall.as_secs_f64(),
            disk_reads: s.disk_reads,
            tier_hits: s.tier_hits,
            retries: s.retries,
            p50_us: s.read_latency.p50_us,
            p99_us: s.read_latency.p99_us,
            remote_samples: s.remote_samples,
            failovers: s.failovers,
            source_reads: s.source_reads,
            read_ahead: s.read_ahead,
            read_ahead_discarded: s.read_ahead_discarded,
        };
        // SAFETY: out writable (contract).
        unsafe { *out = st };
        Ok(())
    })
}

/// What the catalog says about one sample.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct ksp_catalog_sample {
    /// Length in bytes.
    pub len: u64,
    /// CRC32C of its bytes.
    pub crc32c: u32,
    /// Label, or -1 when the source has none.
    pub label: i64,
}

/// Samples in the loader's catalog (the whole dataset), in `*out`.
///
/// Status: `KSP_OK`; `KSP_ERR_NULL_ARG`.
///
/// # Safety
/// `l` is a live loader; `out` writable.
#[no_mangle]
pub unsafe extern "C" fn ksp_loader_catalog_len(l: *const ksp_loader, out: *mut u64) -> ksp_status {
    guard(|| {
        null(l, "loader")?;
        null(out, "out")?;
        // SAFETY: live loader; out writable (contract).
        unsafe { *out = (*l).loader.catalog().len() };
        Ok(())
    })
}

/// The catalog's record of sample `id` (length, CRC32C, label), in `*out`;
/// `KSP_ERR_INVALID_ARG` when `id` is past the catalog.
///
/// Status: `KSP_OK`; `KSP_ERR_NULL_ARG`; `KSP_ERR_INVALID_ARG`.
///
/// # Safety
/// `l` is a live loader; `out` writable.
#[no_mangle]
pub unsafe extern "C" fn ksp_loader_catalog_sample(
    l: *const ksp_loader,
    id: u64,
    out: *mut ksp_catalog_sample,
) -> ksp_status {
    guard(|| {
        null(l, "loader")?;
        null(out, "out")?;
        // SAFETY: live loader (contract).
        let cat = unsafe { &*l }.loader.catalog();
        if id >= cat.len() {
            return Err(Fail::Invalid(format!(
                "sample {id} is past the catalog's {} samples",
                cat.len()
            )));
        }
        let s = cat.sample(id);
        let v = ksp_catalog_sample {
            len: s.len as u64,
            crc32c: s.crc32c,
            label: s.label.map_or(-1, |x| x as i64),
        };
        // SAFETY: out writable (contract).
        unsafe { *out = v };
        Ok(())
    })
}

// --- spaces -----------------------------------------------------------------

/// Preloads the samples node `node_index` of `nodes` holds (with `replicas`
/// copies) from `source` into the space `space` (idempotent, resumable).
/// `catalog` may be NULL (built from the source) or a prebuilt catalog;
/// `source` may be NULL when the space already has a catalog.
///
/// Status: `KSP_OK`; `KSP_ERR_NULL_ARG` (`space`); `KSP_ERR_INVALID_ARG`
/// (placement); `KSP_ERR_IO` (source, disk full, space locked by another
/// preload); `KSP_ERR_DATA` (source changed, corrupt catalog).
///
/// # Safety
/// String arguments are NULL or NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn ksp_preload(
    source: *const c_char,
    space: *const c_char,
    catalog: *const c_char,
    nodes: u32,
    node_index: u32,
    replicas: u32,
) -> ksp_status {
    guard(|| {
        // SAFETY: strings per the contract.
        let dir = unsafe { str_arg(space, "space")? };
        let source = if source.is_null() {
            None
        } else {
            // SAFETY: as above.
            Some(SourceSpec::parse(unsafe { str_arg(source, "source")? })?)
        };
        let catalog = if catalog.is_null() {
            None
        } else {
            // SAFETY: as above.
            Some(PathBuf::from(unsafe { str_arg(catalog, "catalog")? }))
        };
        let opts = PreloadOptions {
            source,
            catalog,
            placement: Placement::new(nodes, replicas)?,
            node_index,
            progress: ProgressMode::Quiet,
            ..Default::default()
        };
        crate::dataset::preload(dir.as_ref(), &opts)?;
        Ok(())
    })
}

/// Re-reads every sample the space holds and checks its CRC32C. Writes the
/// samples checked and the bad ones to `*checked` and `*bad` (either may be
/// NULL); bad samples are not an error status (`KSP_OK` with `*bad > 0`).
///
/// Status: `KSP_OK`; `KSP_ERR_NULL_ARG`; `KSP_ERR_IO` / `KSP_ERR_DATA` (the
/// space cannot be opened).
///
/// # Safety
/// `space` NUL-terminated; `checked`, `bad` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn ksp_verify(
    space: *const c_char,
    checked: *mut u64,
    bad: *mut u64,
) -> ksp_status {
    guard(|| {
        // SAFETY: string per the contract.
        let dir = unsafe { str_arg(space, "space")? };
        let sp = Space::open(dir.as_ref())?;
        let r = sp.verify(crate::par::default_threads(), ProgressMode::Quiet)?;
        // SAFETY: NULL or writable (contract).
        unsafe {
            if !checked.is_null() {
                *checked = r.checked;
            }
            if !bad.is_null() {
                *bad = r.bad.len() as u64;
            }
        }
        Ok(())
    })
}

// --- node service -----------------------------------------------------------

/// A running node service. Opaque.
pub struct ksp_node_service {
    svc: NodeService,
}

/// Starts a node service serving `space` on `listen` (`host:port`, port 0
/// picks one) for consumers presenting `token`. Stop and free it with
/// [`ksp_node_service_stop`].
///
/// Status: `KSP_OK`; `KSP_ERR_NULL_ARG`; `KSP_ERR_IO` / `KSP_ERR_DATA` (the
/// space); `KSP_ERR_OTHER` (cannot listen). The caller owns `*out`; the
/// service's threads run until [`ksp_node_service_stop`].
///
/// # Safety
/// Strings NUL-terminated; `out` writable.
#[no_mangle]
pub unsafe extern "C" fn ksp_node_service_start(
    space: *const c_char,
    listen: *const c_char,
    token: *const c_char,
    out: *mut *mut ksp_node_service,
) -> ksp_status {
    guard(|| {
        null(out, "out")?;
        // SAFETY: strings per the contract.
        let (sp, addr, tok) = unsafe {
            (
                str_arg(space, "space")?,
                str_arg(listen, "listen")?,
                str_arg(token, "token")?,
            )
        };
        let svc = NodeService::start(ServeConfig::new(sp, addr, tok.as_bytes()))?;
        // SAFETY: out writable (contract).
        unsafe { *out = Box::into_raw(Box::new(ksp_node_service { svc })) };
        Ok(())
    })
}

/// The TCP port the service listens on, in `*out`.
///
/// Status: `KSP_OK`; `KSP_ERR_NULL_ARG`.
///
/// # Safety
/// `s` is a live service; `out` writable.
#[no_mangle]
pub unsafe extern "C" fn ksp_node_service_port(
    s: *const ksp_node_service,
    out: *mut u16,
) -> ksp_status {
    guard(|| {
        null(s, "service")?;
        null(out, "out")?;
        // SAFETY: live service; out writable (contract).
        unsafe { *out = (*s).svc.local_addr().port() };
        Ok(())
    })
}

/// Stops the service (closing every connection) and frees it. NULL is a no-op.
///
/// # Safety
/// `s` is NULL or came from [`ksp_node_service_start`] and was not stopped.
#[no_mangle]
pub unsafe extern "C" fn ksp_node_service_stop(s: *mut ksp_node_service) {
    if !s.is_null() {
        // SAFETY: per the contract, we own it now.
        let _ = catch_unwind(AssertUnwindSafe(|| unsafe { Box::from_raw(s) }.svc.stop()));
    }
}

// --- logging ----------------------------------------------------------------

/// Receives kspeed's log records: `level` 1 error, 2 warn, 3 info, 4 debug,
/// 5 trace; `target` the module; `message` the text. Both strings are valid
/// only during the call. Called from kspeed's threads, concurrently.
pub type ksp_log_callback = Option<
    unsafe extern "C" fn(
        userdata: *mut c_void,
        level: c_int,
        target: *const c_char,
        message: *const c_char,
    ),
>;

struct CallbackLogger;

struct Sink {
    cb: ksp_log_callback,
    userdata: usize,
    max: log::LevelFilter,
}

static SINK: Mutex<Sink> = Mutex::new(Sink {
    cb: None,
    userdata: 0,
    max: log::LevelFilter::Off,
});

impl log::Log for CallbackLogger {
    fn enabled(&self, m: &log::Metadata<'_>) -> bool {
        m.level() <= SINK.lock().map(|s| s.max).unwrap_or(log::LevelFilter::Off)
    }

    fn log(&self, r: &log::Record<'_>) {
        let (cb, ud) = match SINK.lock() {
            Ok(s) if r.level() <= s.max => (s.cb, s.userdata),
            _ => return,
        };
        let Some(cb) = cb else { return };
        let target = std::ffi::CString::new(r.target().replace('\0', " ")).unwrap_or_default();
        let msg =
            std::ffi::CString::new(r.args().to_string().replace('\0', " ")).unwrap_or_default();
        // SAFETY: the host registered this function for exactly this call
        // shape; the strings live until it returns.
        let _ = catch_unwind(AssertUnwindSafe(|| unsafe {
            cb(
                ud as *mut c_void,
                r.level() as c_int,
                target.as_ptr(),
                msg.as_ptr(),
            )
        }));
    }

    fn flush(&self) {}
}

static LOGGER: CallbackLogger = CallbackLogger;

/// Sends kspeed's log records at `max_level` (1 error … 5 trace; 0 off) and
/// above to `cb` with `userdata`. Replaces any earlier callback; NULL `cb`
/// stops delivery. Fails with `KSP_ERR_STATE` if the process already has
/// another Rust logger installed.
///
/// Status: `KSP_OK`; `KSP_ERR_INVALID_ARG` (level); `KSP_ERR_STATE`.
///
/// # Safety
/// `cb` must be callable from any thread until replaced; `userdata` is
/// passed through untouched.
#[no_mangle]
pub unsafe extern "C" fn ksp_set_log_callback(
    cb: ksp_log_callback,
    userdata: *mut c_void,
    max_level: c_int,
) -> ksp_status {
    guard(|| {
        let max = match max_level {
            0 => log::LevelFilter::Off,
            1 => log::LevelFilter::Error,
            2 => log::LevelFilter::Warn,
            3 => log::LevelFilter::Info,
            4 => log::LevelFilter::Debug,
            5 => log::LevelFilter::Trace,
            x => return Err(Fail::Invalid(format!("log level {x} is not 0..5"))),
        };
        {
            let mut s = SINK
                .lock()
                .map_err(|_| Fail::State("log sink poisoned".into()))?;
            s.cb = cb;
            s.userdata = userdata as usize;
            s.max = if cb.is_some() {
                max
            } else {
                log::LevelFilter::Off
            };
        }
        static INSTALLED: std::sync::Once = std::sync::Once::new();
        let mut result = Ok(());
        INSTALLED.call_once(|| {
            result = log::set_logger(&LOGGER).map_err(|_| {
                Fail::State("another logger is already installed in this process".into())
            });
        });
        result?;
        log::set_max_level(max);
        Ok(())
    })
}

/// For tests of the panic boundary: panics inside kspeed and returns
/// `KSP_ERR_PANIC` with the message "kspeed panicked…".
#[no_mangle]
pub extern "C" fn ksp_test_panic() -> ksp_status {
    guard(|| panic!("ksp_test_panic was called"))
}
