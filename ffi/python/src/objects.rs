//! Python objects that own or pin memory numpy arrays are made over:
//! [`Owned`] (an int64 vector: ids, labels, offsets) and [`View`] (a range of
//! a batch's bytes, holding the batch). numpy takes them through
//! `__array_interface__` and keeps the object as the array's `base`, so the
//! array keeps the memory alive; a `memoryview` of such an array keeps the
//! array. (The buffer protocol itself is not in the stable ABI before
//! Python 3.11, and this package is one abi3 wheel for 3.9 and later.)

use std::sync::atomic::Ordering;
use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyList, PyTuple};

use crate::{Batch, BatchFlags};

static ASARRAY: PyOnceLock<Py<PyAny>> = PyOnceLock::new();

fn asarray<'py>(py: Python<'py>, obj: Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
    let f = ASARRAY.get_or_try_init(py, || {
        py.import("numpy")?.getattr("asarray").map(Bound::unbind)
    })?;
    f.bind(py).call1((obj,))
}

fn interface<'py>(
    py: Python<'py>,
    addr: u64,
    len: u64,
    typestr: &str,
    itemsize: u64,
    read_only: bool,
) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("version", 3)?;
    d.set_item("typestr", typestr)?;
    d.set_item("shape", PyTuple::new(py, [len / itemsize])?)?;
    // numpy wants a non-null address even for an empty array.
    let addr = if addr == 0 { itemsize.max(1) } else { addr };
    d.set_item("data", (addr, read_only))?;
    Ok(d)
}

/// An int64 vector owned by Rust, seen by numpy without a copy.
#[pyclass(module = "kspeed._kspeed", frozen)]
pub(crate) struct Owned {
    v: Vec<i64>,
}

#[pymethods]
impl Owned {
    #[getter]
    fn __array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        interface(
            py,
            self.v.as_ptr() as u64,
            self.v.len() as u64 * 8,
            "<i8",
            8,
            false,
        )
    }
}

/// A numpy int64 array over `v` (moved, not copied).
pub(crate) fn int64_array(py: Python<'_>, v: Vec<i64>) -> PyResult<Bound<'_, PyAny>> {
    let o = Bound::new(py, Owned { v })?;
    asarray(py, o.into_any())
}

/// A range of a batch's bytes, read-only. While it exists the batch counts it as a
/// view: the batch cannot be released, and (through `batch`) neither the
/// batch nor the loader can go.
#[pyclass(module = "kspeed._kspeed", frozen)]
pub(crate) struct View {
    batch: Py<Batch>,
    flags: Arc<BatchFlags>,
    addr: u64,
    len: u64,
}

impl View {
    pub(crate) fn new(batch: &Bound<'_, Batch>, addr: u64, len: u64) -> View {
        let flags = batch.get().flags().clone();
        flags.exports.fetch_add(1, Ordering::AcqRel);
        View {
            batch: batch.clone().unbind(),
            flags,
            addr,
            len,
        }
    }
}

impl Drop for View {
    fn drop(&mut self) {
        self.flags.exports.fetch_sub(1, Ordering::AcqRel);
    }
}

#[pymethods]
impl View {
    #[getter]
    fn __array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        // Read-only: a ring sample's bytes belong to the loader until the
        // batch goes, and a memory tier sample (`tier_views`) is filled once
        // and served again every epoch, so a write through a view would
        // corrupt it for every later epoch (numpy: writeable=False).
        interface(py, self.addr, self.len, "|u1", 1, true)
    }

    fn __len__(&self) -> usize {
        self.len as usize
    }

    /// The batch this view belongs to.
    #[getter]
    fn batch(&self, py: Python<'_>) -> Py<Batch> {
        self.batch.clone_ref(py)
    }
}

/// A numpy uint8 array over `len` bytes at `addr` of `batch`.
pub(crate) fn view_array<'py>(
    batch: &Bound<'py, Batch>,
    addr: u64,
    len: u64,
) -> PyResult<Bound<'py, PyAny>> {
    let py = batch.py();
    let v = Bound::new(py, View::new(batch, addr, len))?;
    asarray(py, v.into_any())
}

/// The catalog's per-sample columns and names, for `kspeed.Catalog`.
pub(crate) fn catalog_dict<'py>(
    py: Python<'py>,
    cat: &kspeed::dataset::Catalog,
) -> PyResult<Bound<'py, PyDict>> {
    let n = cat.len();
    let (mut lens, mut crcs, mut labels, mut files, mut offs) = (
        Vec::with_capacity(n as usize),
        Vec::with_capacity(n as usize),
        Vec::with_capacity(n as usize),
        Vec::with_capacity(n as usize),
        Vec::with_capacity(n as usize),
    );
    for i in 0..n {
        let s = cat.sample(i);
        lens.push(s.len as i64);
        crcs.push(s.crc32c as i64);
        labels.push(s.label.map_or(-1, |l| l as i64));
        files.push(s.file as i64);
        offs.push(s.offset as i64);
    }
    let d = PyDict::new(py);
    d.set_item("lengths", int64_array(py, lens)?)?;
    d.set_item("crc32c", int64_array(py, crcs)?)?;
    d.set_item("labels", int64_array(py, labels)?)?;
    d.set_item("file_index", int64_array(py, files)?)?;
    d.set_item("file_offset", int64_array(py, offs)?)?;
    let paths = PyList::empty(py);
    for f in 0..cat.file_count() as u32 {
        paths.append(cat.file_path(f).display().to_string())?;
    }
    d.set_item("file_paths", paths)?;
    let classes = PyList::empty(py);
    for c in 0..cat.class_count() as u32 {
        classes.append(cat.class_name(c))?;
    }
    d.set_item("class_names", classes)?;
    d.set_item("source", cat.source())?;
    d.set_item("identity", cat.identity())?;
    d.set_item("total_bytes", cat.total_bytes())?;
    d.set_item("max_sample_bytes", cat.max_sample_bytes())?;
    Ok(d)
}
