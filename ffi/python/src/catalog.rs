//! The dataset functions: `_catalog`, `_preload`, `_verify`,
//! `_open_catalog`.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use crate::errors::Raise;
use crate::objects;
use crate::options::get;

/// Builds a catalog of a source (`kspeed catalog`): the scan and the
/// checksum pass through the crate, the file written with `file_mode`.
#[pyfunction]
#[pyo3(signature = (cfg))]
fn _catalog<'py>(py: Python<'py>, cfg: &Bound<'py, PyDict>) -> PyResult<Bound<'py, PyDict>> {
    use kspeed::dataset::{BuildOptions, ScanOptions, SourceSpec};
    use std::os::unix::fs::PermissionsExt;
    let source: String =
        get(cfg, "source")?.ok_or_else(|| PyValueError::new_err("source is required"))?;
    let out: String = get(cfg, "out")?.ok_or_else(|| PyValueError::new_err("out is required"))?;
    let spec = SourceSpec::parse(&source).raise(py)?;
    let mut scan = ScanOptions::default();
    scan.skip_special = get(cfg, "skip_special")?.unwrap_or(false);
    scan.follow_symlinks = get(cfg, "follow_symlinks")?.unwrap_or(false);
    scan.skip_bad_members = get(cfg, "skip_bad_members")?.unwrap_or(false);
    scan.members = get(cfg, "members")?.unwrap_or_default();
    let mut opts = BuildOptions::default().scan(scan);
    if let Some(t) = get(cfg, "threads")? {
        opts = opts.threads(t);
    }
    let mode: u32 = get(cfg, "file_mode")?.unwrap_or(0o600);
    let out_path = std::path::PathBuf::from(&out);
    let (cat, notes) = py
        .detach(|| {
            let (cat, notes) = kspeed::dataset::catalog::build_with_notes(&spec, &out_path, &opts)?;
            std::fs::set_permissions(&out_path, std::fs::Permissions::from_mode(mode))
                .map_err(|e| kspeed::Error::io("chmod", &out_path, e))?;
            Ok::<_, kspeed::Error>((cat, notes))
        })
        .raise(py)?;
    let d = PyDict::new(py);
    d.set_item("catalog", out)?;
    d.set_item("source", spec.to_source_string())?;
    d.set_item("samples", cat.len())?;
    d.set_item("bytes", cat.total_bytes())?;
    d.set_item("classes", cat.class_count())?;
    d.set_item("notes", notes.lines())?;
    Ok(d)
}

/// Preloads a source into a space (`kspeed preload`).
#[pyfunction]
#[pyo3(signature = (cfg))]
fn _preload<'py>(py: Python<'py>, cfg: &Bound<'py, PyDict>) -> PyResult<Bound<'py, PyDict>> {
    use kspeed::dataset::{Placement, PreloadOptions, SourceSpec};
    let space: String =
        get(cfg, "space")?.ok_or_else(|| PyValueError::new_err("space is required"))?;
    let mut o = PreloadOptions::default();
    if let Some(s) = get::<String>(cfg, "source")? {
        o.source = Some(SourceSpec::parse(&s).raise(py)?);
    }
    o.catalog = get::<String>(cfg, "catalog")?.map(Into::into);
    o.placement = Placement {
        nodes: get(cfg, "nodes")?.unwrap_or(1),
        replicas: get(cfg, "replicas")?.unwrap_or(1),
        // New spaces are placed by jump (docs/FORMAT.md, "Owner function").
        owner_fn: kspeed::dataset::OwnerFn::Jump,
    };
    o.node_index = get(cfg, "node_index")?.unwrap_or(0);
    if let Some(a) = get(cfg, "align_bytes")? {
        o.align_bytes = a;
    }
    if let Some(a) = get(cfg, "extent_bytes")? {
        o.extent_bytes = a;
    }
    if let Some(t) = get(cfg, "threads")? {
        o.threads = t;
    }
    o.refresh = get(cfg, "refresh")?.unwrap_or(false);
    o.max_bytes_per_sec = get(cfg, "max_bytes_per_sec")?;
    o.max_held_bytes = get(cfg, "max_held_bytes")?.unwrap_or(0);
    let r = py
        .detach(|| kspeed::dataset::preload(space.as_ref(), &o))
        .raise(py)?;
    let d = PyDict::new(py);
    d.set_item("up_to_date", r.up_to_date)?;
    d.set_item("catalog_built", r.catalog_built)?;
    d.set_item("resumed_at", r.resumed_at)?;
    d.set_item("copied_samples", r.copied_samples)?;
    d.set_item("copied_bytes", r.copied_bytes)?;
    d.set_item("held_samples", r.held_samples)?;
    d.set_item("held_bytes", r.held_bytes)?;
    d.set_item("catalog_s", r.catalog_time.as_secs_f64())?;
    d.set_item("copy_s", r.copy_time.as_secs_f64())?;
    Ok(d)
}

/// Re-reads every sample of a space and checks its CRC32C (`kspeed verify`).
#[pyfunction]
fn _verify<'py>(py: Python<'py>, space: String, threads: usize) -> PyResult<Bound<'py, PyDict>> {
    let r = py
        .detach(|| {
            let s = kspeed::dataset::Space::open(space.as_ref())?;
            s.verify(threads, kspeed::progress::ProgressMode::Quiet)
        })
        .raise(py)?;
    let d = PyDict::new(py);
    d.set_item("checked", r.checked)?;
    d.set_item("bytes", r.bytes)?;
    d.set_item("direct_io", r.direct_io)?;
    let bad = PyList::empty(py);
    for b in &r.bad {
        let e = PyDict::new(py);
        e.set_item("id", b.id)?;
        e.set_item("source", b.source.display().to_string())?;
        e.set_item("extent", b.extent.display().to_string())?;
        e.set_item("what", &b.what)?;
        bad.append(e)?;
    }
    d.set_item("bad", bad)?;
    let bad_extents = PyList::empty(py);
    for x in &r.bad_extents {
        let e = PyDict::new(py);
        e.set_item("index", x.index)?;
        e.set_item("path", x.path.display().to_string())?;
        e.set_item("actual_bytes", x.actual_bytes)?;
        e.set_item("manifest_bytes", x.manifest_bytes)?;
        bad_extents.append(e)?;
    }
    d.set_item("bad_extents", bad_extents)?;
    Ok(d)
}

/// The catalog of a space or a catalog file, as arrays.
#[pyfunction]
fn _open_catalog<'py>(py: Python<'py>, path: String) -> PyResult<Bound<'py, PyDict>> {
    let p = std::path::Path::new(&path);
    let cat = py
        .detach(|| {
            if p.is_dir() {
                kspeed::dataset::Space::open(p).map(|s| Catalog::Space(Box::new(s)))
            } else {
                kspeed::dataset::Catalog::open(p).map(Catalog::File)
            }
        })
        .raise(py)?;
    match &cat {
        Catalog::Space(s) => objects::catalog_dict(py, s.catalog()),
        Catalog::File(c) => objects::catalog_dict(py, c),
    }
}

enum Catalog {
    Space(Box<kspeed::dataset::Space>),
    File(kspeed::dataset::Catalog),
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(_preload, m)?)?;
    m.add_function(wrap_pyfunction!(_catalog, m)?)?;
    m.add_function(wrap_pyfunction!(_verify, m)?)?;
    m.add_function(wrap_pyfunction!(_open_catalog, m)?)
}
