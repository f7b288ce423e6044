//! The C ABI: `libkspeed.so` / `libkspeed.a` and `include/kspeed.h`
//! (generated from this crate by cbindgen; `scripts/gen_header.sh`).
//!
//! Conventions (after rustls-ffi):
//! - opaque handles with `_new`/`_free` pairs; `_free(NULL)` does nothing;
//! - every fallible call returns a [`ksp_status`]; outputs go through
//!   out-parameters, written only on success;
//! - the message of the last failure on the calling thread is available from
//!   [`ksp_last_error`];
//! - every export runs inside a panic boundary: a panic becomes
//!   `KSP_ERR_PANIC`, never an abort or unwinding into C;
//! - null pointers where a value is required give `KSP_ERR_NULL_ARG`;
//! - structs the library fills that may grow (`ksp_batch`, its
//!   `ksp_sample`s, `ksp_stats`) carry their size, set by the caller to the
//!   `sizeof` it was compiled with, so new fields are appended without
//!   breaking programs built against an older header (see [`ksp_stats`]).
//!
//! Thread safety: a handle is used by one thread at a time (the caller
//! serialises); different handles may be used from different threads.
//! Each function's documentation says what it allows ("Thread safety").
//!
//! Fork: a loader belongs to the process that created it; in a forked
//! child every call on it returns `KSP_ERR_FORKED` and writes nothing, and
//! `ksp_loader_free` leaks the child's copy (see `ksp_loader_new`).
//!
//! One file per API noun: errors (statuses, the panic boundary,
//! `ksp_last_error`), config, loader, batch, position (job positions and
//! the audit), classes (the catalog's class and member names), space
//! (preload, verify), service, log; `ffi` holds
//! the pointer helpers they share. This crate owns the C boundary and is
//! one of the few allowed `unsafe`.

#![allow(non_camel_case_types)]

use std::ffi::c_char;

mod batch;
mod classes;
mod config;
mod errors;
mod ffi;
mod loader;
mod log;
mod position;
mod service;
mod space;

pub use batch::{
    ksp_batch, ksp_loader_next_batch, ksp_loader_release_batch, ksp_sample, KSP_BATCH_MIN_SIZE,
    KSP_SAMPLE_MIN_SIZE,
};
pub use classes::{
    ksp_loader_class_count, ksp_loader_class_name, ksp_loader_member_count, ksp_loader_member_name,
    ksp_loader_sample_member,
};
pub use config::{ksp_config, ksp_config_free, ksp_config_new, ksp_config_set};
pub use errors::{ksp_last_error, ksp_status};
pub use ffi::KSP_MAX_STRUCT_SIZE;
pub use loader::{
    ksp_catalog_sample, ksp_loader, ksp_loader_batches_per_epoch, ksp_loader_catalog_len,
    ksp_loader_catalog_sample, ksp_loader_epoch_len, ksp_loader_free, ksp_loader_new,
    ksp_loader_position, ksp_loader_restore_position, ksp_loader_save_position,
    ksp_loader_set_epoch, ksp_loader_stats, ksp_stats, KSP_CATALOG_SAMPLE_MIN_SIZE,
    KSP_STATS_MIN_SIZE,
};
pub use log::{ksp_log_callback, ksp_set_log_callback};
pub use position::{
    ksp_audit, ksp_loader_job_position, ksp_loader_job_position_at, ksp_loader_restore_job_position,
};
pub use service::{
    ksp_node_service, ksp_node_service_port, ksp_node_service_start, ksp_node_service_stop,
};
pub use space::{ksp_preload, ksp_verify};

use kspeed::sampler::{JOB_POSITION_BYTES, POSITION_BYTES};

/// Version of the C ABI: bumped on any incompatible change to kspeed.h.
///
/// 2: `ksp_batch.seq` and `ksp_loader_release_batch(l, seq)` (a batch's
/// identity), `KSP_POSITION_BYTES` 40 (positions carry the catalog's
/// identity), `ksp_loader_batches_per_epoch`.
///
/// 3: `ksp_batch` and `ksp_stats` start with a caller-set `struct_size`,
/// `ksp_batch.sample_size` gives the stride of its `ksp_sample` array (so
/// all three can grow by appending fields without another bump);
/// `ksp_stats` gains `p90_us`, `p999_us`, `max_us`, `latency_reads`;
/// `KSP_ERR_STRUCT_SIZE`; `ksp_test_panic` only in builds with the
/// `test-panic` feature.
///
/// 4: `ksp_catalog_sample` starts with a caller-set `struct_size` too
/// (`KSP_CATALOG_SAMPLE_INIT`, `KSP_CATALOG_SAMPLE_MIN_SIZE`), and its
/// padding after `crc32c` is the named field `reserved`.
///
/// 5: `KSP_POSITION_BYTES` 108 (`KSPDPOS3`: a rank's position carries
/// where its world started dealing the epoch and the exactly-once digest);
/// job positions (`KSP_JOB_POSITION_BYTES`, `ksp_loader_job_position`,
/// `ksp_loader_restore_job_position`), `ksp_audit`; `ksp_stats` gains the
/// digest fields (appended).
pub const KSP_ABI_VERSION: u32 = 5;

/// Bytes of a saved loader position (`KSPDPOS3`; a mixture's `KSPDPOS4` is
/// `120 + 24·D` bytes for D datasets).
pub const KSP_POSITION_BYTES: usize = POSITION_BYTES;

/// Bytes of a saved job position (`KSPDJOB1`; a mixture's `KSPDMIX1` is
/// `48 + 16·D` bytes for D datasets).
pub const KSP_JOB_POSITION_BYTES: usize = JOB_POSITION_BYTES;

/// The kspeed version, a static NUL-terminated string (never freed).
///
/// Thread safety: any thread.
#[no_mangle]
pub extern "C" fn ksp_version() -> *const c_char {
    concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr().cast()
}

/// The C ABI version ([`KSP_ABI_VERSION`] of the library actually loaded).
///
/// Thread safety: any thread.
#[no_mangle]
pub extern "C" fn ksp_abi_version() -> u32 {
    KSP_ABI_VERSION
}

/// For tests of the panic boundary: panics inside kspeed and returns
/// `KSP_ERR_PANIC` with the message "kspeed panicked…". Only in a library
/// built with the `test-panic` cargo feature (the header declares it when
/// `KSP_TEST_PANIC` is defined).
#[cfg(feature = "test-panic")]
#[no_mangle]
pub extern "C" fn ksp_test_panic() -> ksp_status {
    errors::guard(|| panic!("ksp_test_panic was called"))
}
