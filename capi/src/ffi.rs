//! Small helpers every export uses instead of hand-written pointer casts:
//! opaque handles ([`Handle`]), out-parameters ([`Out`]), C strings
//! ([`str_arg`]) and caller-sized structs ([`SizedOut`]). Modelled on
//! rustls-ffi's `Castable` helpers: one place turns a C pointer into a Rust
//! reference, checking it for NULL and naming the argument when it is.

use std::ffi::{c_char, CStr};
use std::mem::size_of;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr::NonNull;

use super::errors::Fail;

/// A Rust type handed to C as an opaque pointer to its own `Box`
/// (`ksp_config`, `ksp_loader`, `ksp_node_service`): created by a `_new`
/// (or `_start`) through [`Handle::give`], borrowed by every other call
/// through [`Handle::try_ref`] / [`Handle::try_mut`], and freed once by
/// [`Handle::free`].
/// [`Handle::check_process`] of a handle created by process `creator`:
/// [`Fail::Forked`] naming `what` when another process calls. One
/// `getpid` per call (glibc does not cache the pid): a few tens of
/// nanoseconds against a call's work.
pub(super) fn same_process(what: &'static str, creator: u32) -> Result<(), Fail> {
    let caller = std::process::id();
    if caller == creator {
        Ok(())
    } else {
        Err(Fail::Forked {
            what,
            creator,
            caller,
        })
    }
}

pub(super) trait Handle: Sized {
    /// The argument's name in a `KSP_ERR_NULL_ARG` message.
    const WHAT: &'static str;

    /// Borrows the handle behind `p`; [`Fail::Null`] when NULL.
    ///
    /// # Safety
    /// `p` is NULL or a live handle of this type from [`Handle::give`], not
    /// freed, and not mutated by another thread during `'a`.
    unsafe fn try_ref<'a>(p: *const Self) -> Result<&'a Self, Fail> {
        // SAFETY: a non-NULL p is a live, shared handle (contract).
        let h = unsafe { p.as_ref() }.ok_or(Fail::Null(Self::WHAT))?;
        h.check_process()?;
        Ok(h)
    }

    /// Borrows the handle behind `p` mutably; [`Fail::Null`] when NULL.
    ///
    /// # Safety
    /// `p` is NULL or a live handle of this type from [`Handle::give`], not
    /// freed, and used by no other thread during `'a` (the header's "one
    /// thread at a time").
    unsafe fn try_mut<'a>(p: *mut Self) -> Result<&'a mut Self, Fail> {
        // SAFETY: a non-NULL p is a live handle used by this thread only.
        let h = unsafe { p.as_mut() }.ok_or(Fail::Null(Self::WHAT))?;
        h.check_process()?;
        Ok(h)
    }

    /// Whether the calling process may use this handle. A handle that
    /// owns threads, a ring or connections (a loader, a node service) refuses a forked
    /// child with [`Fail::Forked`]: the child has a copy of its memory but
    /// none of its threads, so every call is refused before it reads or
    /// writes anything, and [`Handle::free`] leaks it there.
    fn check_process(&self) -> Result<(), Fail> {
        Ok(())
    }

    /// Moves `self` to the heap and hands its ownership to the caller
    /// through `out`.
    fn give(self, out: Out<*mut Self>) {
        out.set(Box::into_raw(Box::new(self)));
    }

    /// Takes the handle back and drops it; NULL does nothing, and a panic
    /// while dropping is contained (a `_free` has no status to return).
    /// A handle this process may not use ([`Handle::check_process`]: a
    /// loader or node service in a forked child) is leaked instead: dropping it would join
    /// threads the child does not have and stop the parent's pollers and
    /// connections through the descriptors they share.
    ///
    /// # Safety
    /// `p` is NULL or a handle from [`Handle::give`] that was not freed;
    /// nothing uses it afterwards.
    unsafe fn free(p: *mut Self) {
        if p.is_null() {
            return;
        }
        // SAFETY: the caller gives up its ownership (contract).
        let b = unsafe { Box::from_raw(p) };
        if b.check_process().is_err() {
            // The child's copy of the memory only; the parent's loader is
            // untouched.
            std::mem::forget(b);
            return;
        }
        let _ = catch_unwind(AssertUnwindSafe(|| drop(b)));
    }
}

/// An out-parameter checked for NULL up front (so a call fails before
/// doing any work) and written once, on success.
pub(super) struct Out<T>(NonNull<T>);

impl<T> Out<T> {
    /// [`Fail::Null`] naming `what` when `p` is NULL.
    ///
    /// # Safety
    /// `p` is NULL or valid for writing a `T` (alignment included) for as
    /// long as the returned value lives.
    pub(super) unsafe fn new(p: *mut T, what: &'static str) -> Result<Self, Fail> {
        NonNull::new(p).map(Out).ok_or(Fail::Null(what))
    }

    /// Writes the output (without reading or dropping what was there: the
    /// caller's memory may be uninitialised).
    pub(super) fn set(self, v: T) {
        // SAFETY: writable for a T (Out::new's contract).
        unsafe { self.0.as_ptr().write(v) }
    }
}

/// A caller's byte buffer and the out-parameter for the length written (a
/// saved position, say), both checked for NULL up front.
pub(super) struct OutBytes {
    buf: NonNull<u8>,
    buf_len: usize,
    out_len: Out<usize>,
}

impl OutBytes {
    /// [`Fail::Null`] naming `out_len` or `buf` when either is NULL.
    ///
    /// # Safety
    /// `buf` is NULL or writable for `buf_len` bytes, and `out_len` NULL or
    /// writable, for as long as the returned value lives.
    pub(super) unsafe fn new(
        buf: *mut u8,
        buf_len: usize,
        out_len: *mut usize,
    ) -> Result<Self, Fail> {
        // SAFETY: NULL or writable (this function's contract).
        let out_len = unsafe { Out::new(out_len, "out_len")? };
        let buf = NonNull::new(buf).ok_or(Fail::Null("buf"))?;
        Ok(OutBytes {
            buf,
            buf_len,
            out_len,
        })
    }

    /// Writes `bytes` and sets the length to theirs; [`Fail::Small`], with
    /// the length set and nothing written, when the buffer is shorter.
    pub(super) fn write(self, bytes: &[u8]) -> Result<(), Fail> {
        self.out_len.set(bytes.len());
        if self.buf_len < bytes.len() {
            return Err(Fail::Small);
        }
        // SAFETY: the buffer is writable for buf_len >= bytes.len() bytes
        // (OutBytes::new's contract, checked above), and a caller's buffer
        // does not overlap our own bytes.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.buf.as_ptr(), bytes.len()) };
        Ok(())
    }
}

/// An optional out-parameter: NULL means the caller does not want it.
pub(super) struct OptOut<T>(Option<Out<T>>);

impl<T> OptOut<T> {
    /// # Safety
    /// As [`Out::new`]; NULL is allowed.
    pub(super) unsafe fn new(p: *mut T) -> Self {
        OptOut(NonNull::new(p).map(Out))
    }

    /// Writes the output if the caller asked for it.
    pub(super) fn set(self, v: T) {
        if let Some(o) = self.0 {
            o.set(v)
        }
    }
}

/// A NUL-terminated UTF-8 argument; [`Fail::Null`] / [`Fail::Invalid`]
/// naming `what`.
///
/// # Safety
/// `p` is NULL or a NUL-terminated string valid for `'a`.
pub(super) unsafe fn str_arg<'a>(p: *const c_char, what: &'static str) -> Result<&'a str, Fail> {
    if p.is_null() {
        return Err(Fail::Null(what));
    }
    // SAFETY: per this function's contract.
    unsafe { CStr::from_ptr(p) }
        .to_str()
        .map_err(|_| Fail::Invalid(format!("{what} is not UTF-8")))
}

/// [`str_arg`] where NULL means "not given".
///
/// # Safety
/// As [`str_arg`].
pub(super) unsafe fn opt_str_arg<'a>(
    p: *const c_char,
    what: &'static str,
) -> Result<Option<&'a str>, Fail> {
    if p.is_null() {
        Ok(None)
    } else {
        // SAFETY: per this function's contract.
        unsafe { str_arg(p, what) }.map(Some)
    }
}

/// The largest `struct_size` / `sample_size` accepted: far beyond any
/// layout kspeed will define, small enough that an uninitialised size is
/// refused rather than trusted (the library zeroes up to it).
pub const KSP_MAX_STRUCT_SIZE: usize = 1024;

/// Checks a caller-given size of a struct of type `T`: at least `min` (the
/// first layout of `T`), at most [`KSP_MAX_STRUCT_SIZE`], a multiple of
/// `T`'s alignment (every field of kspeed's sized structs is 8 bytes, so a
/// size on that boundary always ends between fields).
pub(super) fn check_size<T>(size: usize, min: usize, what: &str) -> Result<(), Fail> {
    let align = std::mem::align_of::<T>();
    if size < min {
        return Err(Fail::StructSize(format!(
            "{what} is {size}, smaller than the smallest layout ({min} bytes): set it to sizeof"
        )));
    }
    if size > KSP_MAX_STRUCT_SIZE || !size.is_multiple_of(align) {
        return Err(Fail::StructSize(format!(
            "{what} is {size}: not a struct size (a multiple of {align} up to \
             {KSP_MAX_STRUCT_SIZE}); was it set to sizeof?"
        )));
    }
    Ok(())
}

/// A caller-sized output struct: `T` starts with `size_t struct_size`,
/// which the caller sets to `sizeof` of the layout it was compiled with.
/// The library writes the fields it and the caller both know (the first
/// `min(struct_size, size_of::<T>())` bytes, `struct_size` itself left
/// alone) and zeroes the tail of a newer, larger layout, so a field the
/// library does not know reads as 0.
pub(super) struct SizedOut<T> {
    p: NonNull<T>,
    size: usize,
}

impl<T: Copy> SizedOut<T> {
    /// Reads and checks `p->struct_size` against `min` (see [`check_size`]).
    ///
    /// # Safety
    /// `p` is NULL or points to a `usize` `struct_size` followed by at least
    /// `struct_size - 8` writable bytes, aligned for `T`.
    pub(super) unsafe fn new(p: *mut T, what: &'static str, min: usize) -> Result<Self, Fail> {
        let p = NonNull::new(p).ok_or(Fail::Null(what))?;
        // SAFETY: the first field is the caller-set struct_size (contract).
        let size = unsafe { p.cast::<usize>().as_ptr().read() };
        check_size::<T>(size, min, &format!("{what}->struct_size"))?;
        Ok(SizedOut { p, size })
    }

    /// The caller's struct, for reading its inputs (fields of its first
    /// layout only: later ones may lie past `struct_size`).
    pub(super) fn ptr(&self) -> *const T {
        self.p.as_ptr()
    }

    /// Writes `v` as described on the type.
    pub(super) fn set(self, v: T) {
        let head = size_of::<usize>();
        let n = self.size.min(size_of::<T>());
        let dst = self.p.as_ptr().cast::<u8>();
        // SAFETY: the caller's struct has self.size >= n writable bytes
        // (SizedOut::new's contract); v is a plain #[repr(C)] value of
        // 8-byte fields without padding, readable as n <= size_of::<T>()
        // bytes; the regions do not overlap (v is a local).
        unsafe {
            std::ptr::copy_nonoverlapping(
                (&v as *const T).cast::<u8>().add(head),
                dst.add(head),
                n - head,
            );
            if self.size > n {
                std::ptr::write_bytes(dst.add(n), 0, self.size - n);
            }
        }
    }
}
