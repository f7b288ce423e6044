//! Class names through the C ABI: label -> class folder name, like
//! torchvision's `ImageFolder.classes`.

use std::ffi::c_char;

use super::{guard, ksp_loader, ksp_status, null, Fail};

/// Classes in the loader's catalog (class folders of an ImageFolder source;
/// 0 for file lists and tar shards, whose labels are plain numbers), in `*out`.
/// Labels run from 0 to the count - 1.
///
/// Status: `KSP_OK`; `KSP_ERR_NULL_ARG`.
///
/// # Safety
/// `l` is a live loader; `out` writable.
#[no_mangle]
pub unsafe extern "C" fn ksp_loader_class_count(l: *const ksp_loader, out: *mut u64) -> ksp_status {
    guard(|| {
        null(l, "loader")?;
        null(out, "out")?;
        // SAFETY: live loader; out writable (contract).
        unsafe { *out = (*l).loader.catalog().class_count() };
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
        null(l, "loader")?;
        null(buf, "buf")?;
        null(out_len, "out_len")?;
        // SAFETY: live loader (contract).
        let cat = unsafe { &*l }.loader.catalog();
        if label >= cat.class_count() {
            return Err(Fail::Invalid(format!(
                "label {label} is not below the catalog's {} classes",
                cat.class_count()
            )));
        }
        let name = cat.class_name_bytes(label as u32);
        // SAFETY: out_len writable (contract).
        unsafe { *out_len = name.len() };
        if buf_len < name.len() + 1 {
            return Err(Fail::Small);
        }
        // SAFETY: buf has at least name.len() + 1 bytes (checked).
        unsafe {
            std::ptr::copy_nonoverlapping(name.as_ptr().cast::<c_char>(), buf, name.len());
            *buf.add(name.len()) = 0;
        }
        Ok(())
    })
}
