//! `Batch`: a batch and its views (numpy arrays, memoryviews, DLPack).

use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock};

use pyo3::exceptions::{PyIndexError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyTuple};

use crate::errors::Fail;
use crate::objects::{int64_array, Owned};
use crate::shared::*;
use crate::{dlpack, objects};

/// A batch: consecutive samples of the rank's sequence, in the landing ring
/// (or, with `tier_views`, some of them in place in the memory tier).
#[pyclass(module = "kspeed._kspeed", frozen)]
pub(crate) struct Batch {
    pub(crate) shared: Arc<Shared>,
    pub(crate) d: BatchData,
    /// Each sample's offset in `array()`.
    pub(crate) offsets: Vec<i64>,
    /// The whole batch made contiguous on its first whole-batch use, when it
    /// is not one span of the ring (host memory only): a batch that wrapped
    /// around the ring's end, or one with samples in the memory tier
    /// (samples packed back to back).
    pub(crate) copy: OnceLock<Box<[u8]>>,
}

impl Batch {
    pub(crate) fn new(shared: Arc<Shared>, d: BatchData) -> Batch {
        let offsets = if d.in_ring {
            let (s0, l0) = d.span;
            d.addrs
                .iter()
                .map(|&a| match d.wrap {
                    // The second span starts at the ring's start, below the
                    // first span's start.
                    Some((w0, _)) if a < s0 => (l0 + (a - w0)) as i64,
                    _ => (a - s0) as i64,
                })
                .collect()
        } else {
            // Packed back to back in the copy `whole()` makes.
            d.lens
                .iter()
                .scan(0u64, |at, &l| {
                    let o = *at;
                    *at += l;
                    Some(o as i64)
                })
                .collect()
        };
        Batch {
            shared,
            d,
            offsets,
            copy: OnceLock::new(),
        }
    }

    pub(crate) fn flags(&self) -> &Arc<BatchFlags> {
        &self.d.flags
    }

    pub(crate) fn check(&self, py: Python<'_>) -> PyResult<()> {
        if self.shared.in_child() {
            // The ring and the tier are MADV_DONTFORK: nothing of this batch
            // is mapped in a forked child (views made before the fork must
            // not be read there either, README "Fork").
            return Err(Fail::named(
                "LoaderError",
                format!(
                    "this batch's loader was built in process {}; a forked child (a DataLoader \
                     worker, multiprocessing) has none of its memory and must build its own loader",
                    self.shared.pid
                ),
            )
            .into_py(py));
        }
        if self.d.flags.invalid.load(Ordering::Acquire) {
            return Err(Fail::named(
                "BatchReleasedError",
                "this batch was released (release(), its context manager, set_epoch, \
                 load_state_dict or close): its bytes are gone",
            )
            .into_py(py));
        }
        Ok(())
    }

    pub(crate) fn index(&self, i: isize) -> PyResult<usize> {
        let n = self.d.ids.len() as isize;
        let j = if i < 0 { i + n } else { i };
        if j < 0 || j >= n {
            return Err(PyIndexError::new_err(format!(
                "sample index {i} out of range for a batch of {n}"
            )));
        }
        Ok(j as usize)
    }

    /// (address, bytes) of the whole batch as one contiguous range: its span
    /// of the ring, or, for a batch that is not one span, a copy made here
    /// on first use (a wrapped batch's two spans end to end; a batch with
    /// samples in the memory tier, its samples back to back). Call after
    /// [`Batch::check`], with the GIL still held.
    pub(crate) fn whole(&self) -> PyResult<(u64, u64)> {
        match (self.d.in_ring, self.d.wrap, self.d.device) {
            (true, None, _) => return Ok(self.d.span),
            (true, Some(_), Some(_)) => {
                return Err(PyValueError::new_err(
                    "this batch wraps around the end of a GPU ring: take its samples one by one",
                ))
            }
            _ => {}
        }
        let c = self.copy.get_or_init(|| {
            let mut v = Vec::new();
            let mut append = |addr: u64, len: u64| {
                // SAFETY: (addr, len) is a span or a sample of this batch,
                // in host memory (GPU batches returned above): in the ring
                // or in the memory tier. The caller checked that the batch
                // is valid and holds the GIL, which release, reclaim,
                // restart and close need too, so the batch stays out (its
                // ring bytes stay put) and the Rust loader, which owns the
                // ring and the tier, stays alive (`shared`); tier members
                // are never written again.
                v.extend_from_slice(unsafe {
                    std::slice::from_raw_parts(addr as *const u8, len as usize)
                });
            };
            match self.d.wrap {
                Some(wrap) if self.d.in_ring => {
                    append(self.d.span.0, self.d.span.1);
                    append(wrap.0, wrap.1);
                }
                _ => {
                    for (&a, &l) in self.d.addrs.iter().zip(&self.d.lens) {
                        append(a, l);
                    }
                }
            }
            v.into_boxed_slice()
        });
        Ok((c.as_ptr() as u64, c.len() as u64))
    }

    pub(crate) fn host_only(&self) -> PyResult<()> {
        if let Some(dev) = self.d.device {
            return Err(PyValueError::new_err(format!(
                "the batch is in GPU memory (CUDA device {dev}): use __dlpack__ \
                 (torch.from_dlpack) instead of numpy views"
            )));
        }
        Ok(())
    }
}

impl Drop for Batch {
    fn drop(&mut self) {
        // Views hold the batch, so none is alive now.
        self.d.flags.invalid.store(true, Ordering::Release);
        self.shared.batch_done(&self.d.flags);
    }
}

#[pymethods]
impl Batch {
    pub(crate) fn __len__(&self) -> usize {
        self.d.ids.len()
    }

    /// Sample ids (catalog indices), numpy int64.
    #[getter]
    pub(crate) fn ids<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        int64_array(py, self.d.ids.clone())
    }

    /// Labels, numpy int64 (-1 for a sample without one).
    #[getter]
    pub(crate) fn labels<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        int64_array(py, self.d.labels.clone())
    }

    /// Each sample's dataset in a mixture (the `mix` option): its index in
    /// the order the datasets were given, numpy int64 (all 0 without one).
    #[getter]
    pub(crate) fn dataset<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        int64_array(py, self.d.datasets.clone())
    }

    /// Each sample's byte length, numpy int64.
    #[getter]
    pub(crate) fn lengths<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        int64_array(py, self.d.lens.iter().map(|&l| l as i64).collect())
    }

    /// Each sample's offset in `array()`, numpy int64 (alignment padding
    /// lies between samples in the ring; none in the copy made for a batch
    /// that is not `in_ring`).
    #[getter]
    pub(crate) fn offsets<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        int64_array(py, self.offsets.clone())
    }

    /// The epoch of the batch.
    #[getter]
    pub(crate) fn epoch(&self) -> u64 {
        self.d.epoch
    }

    /// The rank's step of the batch's first sample within its epoch.
    #[getter]
    pub(crate) fn first_index(&self) -> u64 {
        self.d.first_index
    }

    /// Whether `array()` is the ring itself (False: the batch wrapped around
    /// the ring's end or is not `in_ring`, and `array()` is a copy made on
    /// first use). Per-sample views are never copies.
    #[getter]
    pub(crate) fn is_zero_copy(&self) -> bool {
        self.d.in_ring && self.d.wrap.is_none()
    }

    /// Whether every sample is in the landing ring (so the batch is one
    /// span of it, two if it wraps). False only with `tier_views=True`, for
    /// a batch with samples served in place from the memory tier.
    #[getter]
    pub(crate) fn in_ring(&self) -> bool {
        self.d.in_ring
    }

    #[getter]
    pub(crate) fn released(&self) -> bool {
        self.d.flags.invalid.load(Ordering::Acquire)
    }

    /// Views alive (numpy arrays, memoryviews, DLPack capsules, tensors).
    #[getter]
    pub(crate) fn views(&self) -> usize {
        self.d.flags.exports.load(Ordering::Acquire)
    }

    /// Sample `i` as a numpy uint8 array over the ring, or over the memory
    /// tier for a sample served from it with `tier_views` (no copy).
    pub(crate) fn sample<'py>(slf: &Bound<'py, Self>, i: isize) -> PyResult<Bound<'py, PyAny>> {
        let b = slf.get();
        b.check(slf.py())?;
        b.host_only()?;
        let j = b.index(i)?;
        objects::view_array(slf, b.d.addrs[j], b.d.lens[j])
    }

    pub(crate) fn __getitem__<'py>(
        slf: &Bound<'py, Self>,
        i: isize,
    ) -> PyResult<Bound<'py, PyAny>> {
        Self::sample(slf, i)
    }

    /// Every sample as a numpy uint8 array over the ring or the memory tier
    /// (no copy).
    pub(crate) fn samples<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyList>> {
        let b = slf.get();
        b.check(slf.py())?;
        b.host_only()?;
        let list = PyList::empty(slf.py());
        for j in 0..b.d.ids.len() {
            list.append(objects::view_array(slf, b.d.addrs[j], b.d.lens[j])?)?;
        }
        Ok(list)
    }

    /// Sample `i` as a memoryview (over the numpy view; no copy).
    pub(crate) fn memoryview<'py>(slf: &Bound<'py, Self>, i: isize) -> PyResult<Bound<'py, PyAny>> {
        let arr = Self::sample(slf, i)?;
        let mv = slf.py().import("builtins")?.getattr("memoryview")?;
        mv.call1((arr,))
    }

    /// The whole batch as one numpy uint8 array (the ring span from the first
    /// sample's start to the last one's end; for a batch that wrapped around
    /// the ring's end, its two spans end to end, and for one that is not
    /// `in_ring`, its samples back to back: one copy, made on first use and
    /// shared by later calls and `__dlpack__`). Sample `i` is
    /// `array()[offsets[i]:offsets[i] + lengths[i]]`.
    pub(crate) fn array<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        let b = slf.get();
        b.check(slf.py())?;
        b.host_only()?;
        let (addr, len) = b.whole()?;
        objects::view_array(slf, addr, len)
    }

    /// Sample `i`'s bytes, copied.
    pub(crate) fn tobytes<'py>(&self, py: Python<'py>, i: isize) -> PyResult<Bound<'py, PyBytes>> {
        self.check(py)?;
        self.host_only()?;
        let j = self.index(i)?;
        // SAFETY: the batch is valid (checked), so its bytes stay put while
        // this call holds the GIL (release and drop need it too).
        let s = unsafe {
            std::slice::from_raw_parts(self.d.addrs[j] as *const u8, self.d.lens[j] as usize)
        };
        Ok(PyBytes::new(py, s))
    }

    /// DLPack export of the whole batch (1-D uint8, see `array()`): a
    /// versioned capsule marked read-only for consumers that ask with
    /// `max_version >= (1, 0)` (numpy then gives a read-only array), else a
    /// legacy one; `copy=True`: a private copy (host batches).
    #[pyo3(signature = (*, stream=None, max_version=None, dl_device=None, copy=None))]
    pub(crate) fn __dlpack__<'py>(
        slf: &Bound<'py, Self>,
        stream: Option<Bound<'py, PyAny>>,
        max_version: Option<Bound<'py, PyAny>>,
        dl_device: Option<Bound<'py, PyAny>>,
        copy: Option<bool>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let _ = stream;
        let b = slf.get();
        b.check(slf.py())?;
        let how = dlpack::Export::from_args(max_version.as_ref(), copy)?;
        let (addr, len) = b.whole()?;
        dlpack::export(slf, addr, len, b.d.device, dl_device, how)
    }

    pub(crate) fn __dlpack_device__(&self) -> (i32, i32) {
        dlpack::device_tuple(self.d.device)
    }

    /// A DLPack capsule of sample `i` alone (for `torch.from_dlpack`): the
    /// ring bytes in place, or, for a sample in the memory tier
    /// (`tier_views`), a copy (PyTorch ignores DLPack's read-only flag, and
    /// the tier is served again every epoch). `max_version` as in
    /// `__dlpack__`.
    #[pyo3(signature = (i, *, max_version=None))]
    pub(crate) fn sample_dlpack<'py>(
        slf: &Bound<'py, Self>,
        i: isize,
        max_version: Option<Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let b = slf.get();
        b.check(slf.py())?;
        let j = b.index(i)?;
        let how = dlpack::Export::from_args(max_version.as_ref(), Some(b.d.in_tier[j]))?;
        dlpack::export(slf, b.d.addrs[j], b.d.lens[j], b.d.device, None, how)
    }

    /// Whether sample `i` is served in place from the memory tier
    /// (`tier_views`) rather than from the landing ring.
    pub(crate) fn sample_in_tier(&self, py: Python<'_>, i: isize) -> PyResult<bool> {
        self.check(py)?;
        Ok(self.d.in_tier[self.index(i)?])
    }

    /// Returns the batch's ring space now. Refused (BatchInUseError) while
    /// views of it are alive; afterwards every method raises.
    pub(crate) fn release(&self, py: Python<'_>) -> PyResult<()> {
        let n = self.d.flags.exports.load(Ordering::Acquire);
        if n > 0 {
            return Err(Fail::named(
                "BatchInUseError",
                format!(
                    "release(): {n} view(s) of this batch are alive (numpy arrays, memoryviews, \
                     DLPack capsules or tensors); drop them or copy what you keep first"
                ),
            )
            .into_py(py));
        }
        self.d.flags.invalid.store(true, Ordering::Release);
        self.shared.batch_done(&self.d.flags);
        Ok(())
    }

    pub(crate) fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    pub(crate) fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, PyTuple>) -> PyResult<bool> {
        self.release(py)?;
        Ok(false)
    }

    pub(crate) fn __repr__(&self) -> String {
        format!(
            "<kspeed.Batch epoch={} first_index={} samples={}{}>",
            self.d.epoch,
            self.d.first_index,
            self.d.ids.len(),
            if self.released() { " released" } else { "" }
        )
    }
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Batch>()?;
    m.add_class::<Owned>()?;
    m.add_class::<crate::objects::View>()
}
