//! What the catalog says beyond lengths and labels, through the C ABI: class
//! names (label -> class folder name, like torchvision's
//! `ImageFolder.classes`) and the members of multi-member tar samples.

use std::ffi::c_char;

use super::errors::{guard, ksp_status, Fail};
use super::ffi::{Handle, Out};
use super::loader::ksp_loader;

/// Classes in the loader's catalog (class folders of an ImageFolder source;
/// 0 for file lists and tar shards, whose labels are plain numbers), in `*out`.
/// Labels run from 0 to the count - 1.
///
/// Status: `KSP_OK`; `KSP_ERR_NULL_ARG`.
///
/// Thread safety: one call on `l` at a time, reads included (serialise
/// every call on one loader; a read must not overlap `ksp_loader_next_batch`
/// on another thread); other loaders may be used from other threads at once.
///
/// # Safety
/// `l` is a live loader; `out` writable.
#[no_mangle]
pub unsafe extern "C" fn ksp_loader_class_count(l: *const ksp_loader, out: *mut u64) -> ksp_status {
    guard(|| {
        // SAFETY: live loader; out writable (contract).
        let (h, out) = unsafe { (ksp_loader::try_ref(l)?, Out::new(out, "out")?) };
        out.set(h.loader.catalog().class_count());
        Ok(())
    })
}

/// The name of class `label` (its folder's name, byte for byte: not
/// necessarily UTF-8), NUL-terminated, into `buf`, and its length without the
/// NUL into `*out_len`. When `buf_len` is less than the length + 1, nothing
/// is written to `buf`, `*out_len` says the length and the call returns
/// `KSP_ERR_BUFFER_TOO_SMALL`, so a caller can size the buffer and call again.
///
/// Status: `KSP_OK`; `KSP_ERR_NULL_ARG`; `KSP_ERR_INVALID_ARG` (`label` is
/// not below [`ksp_loader_class_count`]); `KSP_ERR_BUFFER_TOO_SMALL`.
///
/// Thread safety: one call on `l` at a time, reads included (serialise
/// every call on one loader; a read must not overlap `ksp_loader_next_batch`
/// on another thread); other loaders may be used from other threads at once.
///
/// # Safety
/// `l` is a live loader; `buf` writable for `buf_len` bytes; `out_len` writable.
#[no_mangle]
pub unsafe extern "C" fn ksp_loader_class_name(
    l: *const ksp_loader,
    label: u64,
    buf: *mut c_char,
    buf_len: usize,
    out_len: *mut usize,
) -> ksp_status {
    guard(|| {
        // SAFETY: live loader (contract).
        let cat = unsafe { ksp_loader::try_ref(l)? }.loader.catalog();
        if buf.is_null() || out_len.is_null() {
            return Err(Fail::Null(if buf.is_null() { "buf" } else { "out_len" }));
        }
        if label >= cat.class_count() {
            return Err(Fail::Invalid(format!(
                "label {label} is not below the catalog's {} classes",
                cat.class_count()
            )));
        }
        // SAFETY: buf/out_len per this function's contract.
        unsafe { copy_name(cat.class_name_bytes(label as u32), buf, buf_len, out_len) }
    })
}

/// Copies `bytes` and a NUL into `buf` (`buf_len` bytes), its length into
/// `*out_len`; [`Fail::Small`] (nothing written to `buf`) when it does not fit.
///
/// # Safety
/// `buf` writable for `buf_len` bytes; `out_len` writable.
unsafe fn copy_name(
    bytes: &[u8],
    buf: *mut c_char,
    buf_len: usize,
    out_len: *mut usize,
) -> Result<(), Fail> {
    // SAFETY: out_len writable (contract).
    unsafe { *out_len = bytes.len() };
    if buf_len < bytes.len() + 1 {
        return Err(Fail::Small);
    }
    // SAFETY: buf has at least bytes.len() + 1 bytes (checked).
    unsafe {
        std::ptr::copy_nonoverlapping(bytes.as_ptr().cast::<c_char>(), buf, bytes.len());
        *buf.add(bytes.len()) = 0;
    }
    Ok(())
}

/// How many tar members make each sample (`kspeed catalog/preload --members
/// jpg,json,txt`), in `*out`; 0 when a sample is a single member or file.
///
/// Status: `KSP_OK`; `KSP_ERR_NULL_ARG`.
///
/// Thread safety: one call on `l` at a time, reads included (serialise
/// every call on one loader; a read must not overlap `ksp_loader_next_batch`
/// on another thread); other loaders may be used from other threads at once.
///
/// # Safety
/// `l` is a live loader; `out` writable.
#[no_mangle]
pub unsafe extern "C" fn ksp_loader_member_count(
    l: *const ksp_loader,
    out: *mut u64,
) -> ksp_status {
    guard(|| {
        // SAFETY: live loader; out writable (contract).
        let (h, out) = unsafe { (ksp_loader::try_ref(l)?, Out::new(out, "out")?) };
        out.set(h.loader.catalog().members().len() as u64);
        Ok(())
    })
}

/// The extension of member `index` (e.g. `json`), NUL-terminated, into `buf`,
/// its length into `*out_len`; buffer rules as for [`ksp_loader_class_name`].
///
/// Status: `KSP_OK`; `KSP_ERR_NULL_ARG`; `KSP_ERR_INVALID_ARG` (`index` is
/// not below [`ksp_loader_member_count`]); `KSP_ERR_BUFFER_TOO_SMALL`.
///
/// Thread safety: one call on `l` at a time, reads included (serialise
/// every call on one loader; a read must not overlap `ksp_loader_next_batch`
/// on another thread); other loaders may be used from other threads at once.
///
/// # Safety
/// `l` is a live loader; `buf` writable for `buf_len` bytes; `out_len` writable.
#[no_mangle]
pub unsafe extern "C" fn ksp_loader_member_name(
    l: *const ksp_loader,
    index: u64,
    buf: *mut c_char,
    buf_len: usize,
    out_len: *mut usize,
) -> ksp_status {
    guard(|| {
        // SAFETY: live loader (contract).
        let members = unsafe { ksp_loader::try_ref(l)? }
            .loader
            .catalog()
            .members();
        if buf.is_null() || out_len.is_null() {
            return Err(Fail::Null(if buf.is_null() { "buf" } else { "out_len" }));
        }
        let Some(name) = members.get(index as usize) else {
            return Err(Fail::Invalid(format!(
                "member {index} is not below the catalog's {} members",
                members.len()
            )));
        };
        // SAFETY: buf/out_len per this function's contract.
        unsafe { copy_name(name.as_bytes(), buf, buf_len, out_len) }
    })
}

/// Where member `index` of sample `id` lies inside the sample's bytes (the
/// `data`/`len` a batch gives for it): offset into `*offset`, length into
/// `*len`.
///
/// Status: `KSP_OK`; `KSP_ERR_NULL_ARG`; `KSP_ERR_INVALID_ARG` (`id` past the
/// catalog, or `index` not below [`ksp_loader_member_count`]).
///
/// Thread safety: one call on `l` at a time, reads included (serialise
/// every call on one loader; a read must not overlap `ksp_loader_next_batch`
/// on another thread); other loaders may be used from other threads at once.
///
/// # Safety
/// `l` is a live loader; `offset` and `len` writable.
#[no_mangle]
pub unsafe extern "C" fn ksp_loader_sample_member(
    l: *const ksp_loader,
    id: u64,
    index: u64,
    offset: *mut u32,
    len: *mut u32,
) -> ksp_status {
    guard(|| {
        // SAFETY: live loader; offset and len writable (contract).
        let (h, offset, len) = unsafe {
            (
                ksp_loader::try_ref(l)?,
                Out::new(offset, "offset")?,
                Out::new(len, "len")?,
            )
        };
        let cat = h.loader.catalog();
        if id >= cat.len() {
            return Err(Fail::Invalid(format!(
                "sample {id} is past the catalog's {} samples",
                cat.len()
            )));
        }
        let Some((o, n)) = cat.sample_members(id).nth(index as usize) else {
            return Err(Fail::Invalid(format!(
                "member {index} is not below the catalog's {} members",
                cat.members().len()
            )));
        };
        offset.set(o);
        len.set(n);
        Ok(())
    })
}
