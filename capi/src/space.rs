//! Spaces through the C ABI: `ksp_preload` and `ksp_verify`.

use std::ffi::c_char;
use std::path::PathBuf;

use super::errors::{guard, ksp_status};
use super::ffi::{opt_str_arg, str_arg, OptOut};
use kspeed::dataset::{Placement, PreloadOptions, SourceSpec, Space};
use kspeed::progress::ProgressMode;

/// Preloads the samples node `node_index` of `nodes` holds (with `replicas`
/// copies) from `source` into the space `space` (idempotent, resumable).
/// `catalog` may be NULL (built from the source) or a prebuilt catalog;
/// `source` may be NULL when the space already has a catalog.
///
/// Status: `KSP_OK`; `KSP_ERR_NULL_ARG` (`space`); `KSP_ERR_INVALID_ARG`
/// (placement); `KSP_ERR_IO` (source, disk full, space locked by another
/// preload); `KSP_ERR_DATA` (source changed, corrupt catalog).
///
/// Thread safety: any thread; it blocks until the preload is done. Two
/// preloads of one space exclude each other (the space's lock:
/// `KSP_ERR_IO`, naming the holder).
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
        // SAFETY: strings NULL or NUL-terminated (contract).
        let (dir, source, catalog) = unsafe {
            (
                str_arg(space, "space")?,
                opt_str_arg(source, "source")?,
                opt_str_arg(catalog, "catalog")?,
            )
        };
        let source = source.map(SourceSpec::parse).transpose()?;
        let catalog = catalog.map(PathBuf::from);
        let opts = PreloadOptions::default()
            .source(source)
            .catalog(catalog)
            .placement(Placement::new(nodes, replicas)?)
            .node_index(node_index)
            .progress(ProgressMode::Quiet);
        kspeed::dataset::preload(dir.as_ref(), &opts)?;
        Ok(())
    })
}

/// Re-reads every sample the space holds and checks its CRC32C, and every
/// extent's length against the manifest. Writes the samples checked to
/// `*checked` and what was found wrong (bad samples plus extents of the
/// wrong length, as `kspeed verify` counts them) to `*bad` (either may be
/// NULL); anything bad is not an error status (`KSP_OK` with `*bad > 0`).
///
/// Status: `KSP_OK`; `KSP_ERR_NULL_ARG`; `KSP_ERR_IO` / `KSP_ERR_DATA` (the
/// space cannot be opened).
///
/// Thread safety: any thread; it blocks until every sample was read.
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
        // SAFETY: string per the contract; outputs NULL or writable.
        let (dir, checked, bad) = unsafe {
            (
                str_arg(space, "space")?,
                OptOut::new(checked),
                OptOut::new(bad),
            )
        };
        let sp = Space::open(dir.as_ref())?;
        let r = sp.verify(kspeed::dataset::default_threads(), ProgressMode::Quiet)?;
        checked.set(r.checked);
        bad.set(r.bad_count() as u64);
        Ok(())
    })
}
