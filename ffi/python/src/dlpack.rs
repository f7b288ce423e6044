//! DLPack export (the legacy `dltensor` capsule, which numpy and PyTorch
//! both take): a 1-D uint8 tensor over part of a batch.
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
struct DLManagedTensor {
    dl_tensor: DLTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

/// What a managed tensor owns: the view (and so the batch) and the shape.
struct Ctx {
    view: Option<Py<View>>,
    shape: [i64; 1],
}

const NAME: &CStr = c"dltensor";
const USED: &CStr = c"used_dltensor";

/// (device type, device id) of `__dlpack_device__`.
pub(crate) fn device_tuple(device: Option<i32>) -> (i32, i32) {
    match device {
        Some(d) => (KDL_CUDA, d),
        None => (KDL_CPU, 0),
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
    let mut ctx = unsafe { Box::from_raw(m.manager_ctx as *mut Ctx) };
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
/// Called by Python with a capsule made by [`export`].
unsafe extern "C" fn capsule_destructor(capsule: *mut ffi::PyObject) {
    // SAFETY: the capsule is alive (this is its destructor); a consumer that
    // took the tensor renamed it to "used_dltensor" and owns the deleter call.
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

/// A `dltensor` capsule over `len` bytes at `addr` of `batch`.
pub(crate) fn export<'py>(
    batch: &Bound<'py, Batch>,
    addr: u64,
    len: u64,
    device: Option<i32>,
    dl_device: Option<Bound<'py, PyAny>>,
    copy: Option<bool>,
) -> PyResult<Bound<'py, PyAny>> {
    let py = batch.py();
    if copy == Some(true) {
        return Err(PyBufferError::new_err(
            "kspeed exports its batches without a copy (copy=True is not supported); copy the result",
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
    let view = Py::new(py, View::new(batch, addr, len))?;
    let mut ctx = Box::new(Ctx {
        view: Some(view),
        shape: [len as i64],
    });
    let (device_type, device_id) = device_tuple(device);
    let shape = ctx.shape.as_mut_ptr();
    let m = Box::new(DLManagedTensor {
        dl_tensor: DLTensor {
            data: addr as *mut c_void,
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
            shape,
            strides: std::ptr::null_mut(),
            byte_offset: 0,
        },
        manager_ctx: Box::into_raw(ctx) as *mut c_void,
        deleter: Some(deleter),
    });
    let m = Box::into_raw(m);
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

#[allow(dead_code)]
const _USED_NAME: &CStr = USED;
