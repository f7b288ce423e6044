//! `ksp_config`: loader settings set from strings, through the loader's
//! one options table ([`crate::loader::options`]).

use std::ffi::c_char;

use super::errors::{guard, ksp_status, Fail};
use super::ffi::{str_arg, Handle, Out};
use crate::loader::{LoaderBuilder, LoaderOptions};

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
/// `rdma_gid_index` each imply `rdma=true`.
///
/// <!-- options:begin -->
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
