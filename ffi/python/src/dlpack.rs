//! DLPack export: a 1-D uint8 tensor over part of a batch, as the
//! versioned `dltensor_versioned` capsule (DLPack 1.0, for consumers that
//! ask with `max_version >= (1, 0)`, as numpy >= 2.1 and PyTorch do) or the
//! legacy `dltensor` capsule (older consumers, `sample_dlpack`).
//!
//! Read-only: a versioned export of a view carries
//! `DLPACK_FLAG_BITMASK_READ_ONLY` (numpy honours it: the array is not
//! writeable). PyTorch ignores the flag, and the legacy capsule has none, so
//! a sample in the memory tier (`tier_views`), which is filled once and
//! served again every epoch, is exported as a copy from `sample_dlpack`
//! ([`Export::copy`]); ring bytes are refilled each epoch and exported in
//! place.
//!
//! The capsule's tensor holds a [`View`] of the batch, so the batch and its
//! bytes stay until the consumer (or, if never consumed, the capsule) calls
//! the deleter. The deleter may run on any thread, with or without the GIL
//! (PyTorch frees tensors from C++), so it takes the GIL to drop the view.

use std::ffi::{c_void, CStr};

use pyo3::exceptions::PyBufferError;
use pyo3::ffi;
use pyo3::prelude::*;

use crate::objects::View;
use crate::Batch;

const KDL_CPU: i32 = 1;
const KDL_CUDA: i32 = 2;
const KDL_UINT: u8 = 1;

#[repr(C)]
struct DLDevice {
    device_type: i32,
    device_id: i32,
}

#[repr(C)]
struct DLDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

#[repr(C)]
struct DLTensor {
    data: *mut c_void,
    device: DLDevice,
    ndim: i32,
    dtype: DLDataType,
    shape: *mut i64,
    strides: *mut i64,
    byte_offset: u64,
}

#[repr(C)]
struct DLPackVersion {
    major: u32,
    minor: u32,
}

/// DLPack 1.0's managed tensor (dlpack.h `DLManagedTensorVersioned`).
#[repr(C)]
struct DLManagedTensorVersioned {
    version: DLPackVersion,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensorVersioned)>,
    flags: u64,
    dl_tensor: DLTensor,
}

const DLPACK_FLAG_BITMASK_READ_ONLY: u64 = 1;
const DLPACK_FLAG_BITMASK_IS_COPIED: u64 = 1 << 1;

#[repr(C)]
struct DLManagedTensor {
    dl_tensor: DLTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

/// What a managed tensor owns: the view (and so the batch), the shape, and
/// the bytes when the export is a copy.
struct Ctx {
    view: Option<Py<View>>,
    shape: [i64; 1],
    #[allow(dead_code)] // owns the bytes the tensor points at
    owned: Option<Box<[u8]>>,
}

const NAME: &CStr = c"dltensor";
const NAME_VERSIONED: &CStr = c"dltensor_versioned";

/// (device type, device id) of `__dlpack_device__`.
pub(crate) fn device_tuple(device: Option<i32>) -> (i32, i32) {
    match device {
        Some(d) => (KDL_CUDA, d),
        None => (KDL_CPU, 0),
    }
}

/// Drops a [`Ctx`] leaked by [`export`]: the view under the GIL.
///
/// # Safety
/// `ctx` is the `Box<Ctx>` leaked in [`export`], dropped once.
unsafe fn drop_ctx(ctx: *mut c_void) {
    // SAFETY: see the function's contract.
    let mut ctx = unsafe { Box::from_raw(ctx as *mut Ctx) };
    if let Some(v) = ctx.view.take() {
        // SAFETY: Py_IsInitialized only reads interpreter state.
        if unsafe { ffi::Py_IsInitialized() } != 0 {
            Python::attach(|_| drop(v));
        } else {
            // The interpreter is gone, and the batch's memory with it.
            std::mem::forget(v);
        }
    }
}

/// # Safety
/// `m` is a `DLManagedTensor` made by [`export`], and this is the only call
/// of its deleter (the DLPack contract).
unsafe extern "C" fn deleter(m: *mut DLManagedTensor) {
    if m.is_null() {
        return;
    }
    // SAFETY: made by Box::into_raw in `export`; called once.
    let m = unsafe { Box::from_raw(m) };
    // SAFETY: manager_ctx is the Box<Ctx> leaked in `export`.
    unsafe { drop_ctx(m.manager_ctx) };
}

/// # Safety
/// As [`deleter`], for a `DLManagedTensorVersioned`.
unsafe extern "C" fn deleter_versioned(m: *mut DLManagedTensorVersioned) {
    if m.is_null() {
        return;
    }
    // SAFETY: made by Box::into_raw in `export`; called once.
    let m = unsafe { Box::from_raw(m) };
    // SAFETY: manager_ctx is the Box<Ctx> leaked in `export`.
    unsafe { drop_ctx(m.manager_ctx) };
}

/// # Safety
/// Called by Python with a capsule made by [`export`].
unsafe extern "C" fn capsule_destructor(capsule: *mut ffi::PyObject) {
    // SAFETY: the capsule is alive (this is its destructor); a consumer that
    // took the tensor renamed it ("used_dltensor") and owns the deleter call.
    unsafe {
        if ffi::PyCapsule_IsValid(capsule, NAME.as_ptr()) == 1 {
            let m = ffi::PyCapsule_GetPointer(capsule, NAME.as_ptr()) as *mut DLManagedTensor;
            if let Some(d) = m.as_ref().and_then(|m| m.deleter) {
                d(m);
            }
        } else {
            // Not ours to free; clear any error IsValid may have set.
            ffi::PyErr_Clear();
        }
    }
}

/// # Safety
/// Called by Python with a versioned capsule made by [`export`].
unsafe extern "C" fn capsule_destructor_versioned(capsule: *mut ffi::PyObject) {
    // SAFETY: as in `capsule_destructor` ("used_dltensor_versioned").
    unsafe {
        if ffi::PyCapsule_IsValid(capsule, NAME_VERSIONED.as_ptr()) == 1 {
            let m = ffi::PyCapsule_GetPointer(capsule, NAME_VERSIONED.as_ptr())
                as *mut DLManagedTensorVersioned;
            if let Some(d) = m.as_ref().and_then(|m| m.deleter) {
                d(m);
            }
        } else {
            ffi::PyErr_Clear();
        }
    }
}

/// How [`export`] hands the bytes over.
pub(crate) struct Export {
    /// The consumer takes DLPack 1.0 (`max_version >= (1, 0)`): a versioned
    /// capsule.
    pub(crate) versioned: bool,
    /// A private copy instead of the batch's memory (host only).
    pub(crate) copy: bool,
}

impl Export {
    /// From `__dlpack__`'s `max_version` and `copy` arguments.
    pub(crate) fn from_args(
        max_version: Option<&Bound<'_, PyAny>>,
        copy: Option<bool>,
    ) -> PyResult<Export> {
        let versioned = match max_version {
            Some(v) if !v.is_none() => v.extract::<(u32, u32)>()?.0 >= 1,
            _ => false,
        };
        Ok(Export {
            versioned,
            copy: copy == Some(true),
        })
    }
}

/// A DLPack capsule over `len` bytes at `addr` of `batch` (read-only when
/// versioned and not a copy), or over a copy of them.
pub(crate) fn export<'py>(
    batch: &Bound<'py, Batch>,
    addr: u64,
    len: u64,
    device: Option<i32>,
    dl_device: Option<Bound<'py, PyAny>>,
    how: Export,
) -> PyResult<Bound<'py, PyAny>> {
    let py = batch.py();
    if how.copy && device.is_some() {
        return Err(PyBufferError::new_err(
            "kspeed exports GPU batches without a copy (copy=True is for host batches); copy the result",
        ));
    }
    if let Some(want) = dl_device {
        let want: (i32, i32) = want.extract()?;
        if want != device_tuple(device) {
            return Err(PyBufferError::new_err(format!(
                "the batch is on DLPack device {:?}, not {want:?}",
                device_tuple(device)
            )));
        }
    }
    let (view, owned) = if how.copy {
        // SAFETY: (addr, len) is a host range of `batch`, which the caller
        // checked is valid; the GIL is held, which release, reclaim and
        // close need too, so the bytes stay put during the copy.
        let bytes = unsafe { std::slice::from_raw_parts(addr as *const u8, len as usize) };
        (None, Some(Box::<[u8]>::from(bytes)))
    } else {
        (Some(Py::new(py, View::new(batch, addr, len))?), None)
    };
    let data = owned.as_ref().map_or(addr as *mut c_void, |b| {
        // Non-null even when empty (as for numpy).
        if b.is_empty() {
            std::ptr::NonNull::<u8>::dangling().as_ptr() as *mut c_void
        } else {
            b.as_ptr() as *mut c_void
        }
    });
    let mut ctx = Box::new(Ctx {
        view,
        shape: [len as i64],
        owned,
    });
    let (device_type, device_id) = device_tuple(device);
    let dl_tensor = DLTensor {
        data,
        device: DLDevice {
            device_type,
            device_id,
        },
        ndim: 1,
        dtype: DLDataType {
            code: KDL_UINT,
            bits: 8,
            lanes: 1,
        },
        shape: ctx.shape.as_mut_ptr(),
        strides: std::ptr::null_mut(),
        byte_offset: 0,
    };
    let manager_ctx = Box::into_raw(ctx) as *mut c_void;
    if how.versioned {
        let flags = if how.copy {
            DLPACK_FLAG_BITMASK_IS_COPIED
        } else {
            DLPACK_FLAG_BITMASK_READ_ONLY
        };
        let m = Box::into_raw(Box::new(DLManagedTensorVersioned {
            version: DLPackVersion { major: 1, minor: 0 },
            manager_ctx,
            deleter: Some(deleter_versioned),
            flags,
            dl_tensor,
        }));
        // SAFETY: m is a valid DLManagedTensorVersioned; the capsule's
        // destructor frees it unless a consumer renames the capsule and
        // calls the deleter.
        let cap = unsafe {
            ffi::PyCapsule_New(
                m as *mut c_void,
                NAME_VERSIONED.as_ptr(),
                Some(capsule_destructor_versioned),
            )
        };
        if cap.is_null() {
            // SAFETY: not handed to anyone; free it here.
            unsafe { deleter_versioned(m) };
            return Err(PyErr::fetch(py));
        }
        // SAFETY: cap is a new reference.
        return Ok(unsafe { Bound::from_owned_ptr(py, cap) });
    }
    let m = Box::into_raw(Box::new(DLManagedTensor {
        dl_tensor,
        manager_ctx,
        deleter: Some(deleter),
    }));
    // SAFETY: m is a valid DLManagedTensor; the capsule's destructor frees
    // it unless a consumer renames the capsule and calls the deleter.
    let cap =
        unsafe { ffi::PyCapsule_New(m as *mut c_void, NAME.as_ptr(), Some(capsule_destructor)) };
    if cap.is_null() {
        // SAFETY: not handed to anyone; free it here.
        unsafe { deleter(m) };
        return Err(PyErr::fetch(py));
    }
    // SAFETY: cap is a new reference.
    Ok(unsafe { Bound::from_owned_ptr(py, cap) })
}
