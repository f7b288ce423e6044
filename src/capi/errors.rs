//! Status codes, the mapping of every [`Error`] variant to one, the panic
//! boundary every export runs in, and the calling thread's last message.

use std::cell::RefCell;
use std::ffi::c_char;
use std::panic::{catch_unwind, AssertUnwindSafe};

use crate::error::Error;

/// Status of every fallible call.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ksp_status {
    /// Success.
    KSP_OK = 0,
    /// A required pointer argument was NULL.
    KSP_ERR_NULL_ARG = 1,
    /// An argument or configuration value is invalid (the message says which).
    KSP_ERR_INVALID_ARG = 2,
    /// An I/O error on a named file (open, read, write, disk full).
    KSP_ERR_IO = 3,
    /// Corrupt or incompatible data (catalog, manifest, sample checksum).
    KSP_ERR_DATA = 4,
    /// A node refused, broke the protocol, or a sample could not be fetched.
    KSP_ERR_NETWORK = 5,
    /// A system resource is missing or limited (memlock, io_uring, NUMA, CUDA).
    KSP_ERR_RESOURCE = 6,
    /// The object is not in a state for this call (e.g. a loader that failed).
    KSP_ERR_STATE = 7,
    /// A caller's buffer is too small; the needed size is in the out-length.
    KSP_ERR_BUFFER_TOO_SMALL = 8,
    /// kspeed panicked inside this call (a bug); the handle should be freed.
    KSP_ERR_PANIC = 9,
    /// Any other error (the node service could not start).
    KSP_ERR_OTHER = 10,
    /// A caller-sized struct's `struct_size` (or a batch's `sample_size`) is
    /// smaller than the struct's first layout, not a multiple of 8, or
    /// implausibly large (not set to `sizeof`). Nothing was written.
    KSP_ERR_STRUCT_SIZE = 11,
}

use ksp_status::*;

thread_local! {
    static LAST_ERROR: RefCell<String> = const { RefCell::new(String::new()) };
}

fn set_error(msg: String) {
    LAST_ERROR.with(|e| *e.borrow_mut() = msg);
}

/// The status of a kspeed error. Every variant is listed: a new one does
/// not compile until it is given its status here.
pub(super) fn status_of(e: &Error) -> ksp_status {
    match e {
        Error::Io { .. }
        | Error::DiskFull { .. }
        | Error::ReadFailed { .. }
        | Error::ShortRead { .. }
        | Error::SymlinkLoop { .. }
        | Error::DanglingSymlink { .. }
        | Error::NotRegularFile { .. }
        | Error::SymlinkOutsideSource { .. }
        | Error::EmptySource { .. }
        | Error::SpaceLocked { .. } => KSP_ERR_IO,
        Error::BadMagic { .. }
        | Error::UnsupportedVersion { .. }
        | Error::ChecksumMismatch { .. }
        | Error::Truncated { .. }
        | Error::ExtentSize { .. }
        | Error::Corrupt { .. }
        | Error::SampleCorrupt { .. }
        | Error::SourceChanged { .. }
        | Error::SourceMismatch { .. }
        | Error::CatalogOfAnotherSource { .. }
        | Error::NotASpace { .. }
        | Error::BadFileList { .. }
        | Error::BadTar { .. }
        | Error::SampleTooLarge { .. } => KSP_ERR_DATA,
        Error::InvalidConfig(_)
        | Error::BadPosition(_)
        | Error::BadCluster { .. }
        | Error::BadPlacement { .. }
        | Error::BadHostlist { .. }
        | Error::SampleLargerThanRing { .. }
        | Error::RingTooSmallForBatch { .. } => KSP_ERR_INVALID_ARG,
        Error::Refused { .. }
        | Error::ProtocolViolation { .. }
        | Error::SampleUnavailable { .. }
        | Error::RdmaCompletion { .. } => KSP_ERR_NETWORK,
        Error::Rdma { .. }
        | Error::Memlock { .. }
        | Error::Numa { .. }
        | Error::Cuda(_)
        | Error::Uring { .. }
        | Error::ThreadSpawn { .. } => KSP_ERR_RESOURCE,
        Error::ThreadPanicked { .. } => KSP_ERR_PANIC,
        // The node service could not start (bind, listen): documented as
        // KSP_ERR_OTHER on ksp_node_service_start.
        Error::Serve(_) => KSP_ERR_OTHER,
        // A loader that failed keeps failing with its first error's status.
        Error::LoaderFailed(first) => status_of(first),
    }
}

/// Why a call failed.
pub(super) enum Fail {
    /// A required pointer (named) was NULL.
    Null(&'static str),
    Invalid(String),
    State(String),
    Small,
    StructSize(String),
    Kspeed(Error),
}

impl From<Error> for Fail {
    fn from(e: Error) -> Self {
        Fail::Kspeed(e)
    }
}

/// Runs `f` inside the panic boundary and maps its outcome to a status,
/// recording the message for [`ksp_last_error`].
pub(super) fn guard(f: impl FnOnce() -> Result<(), Fail>) -> ksp_status {
    let (status, msg) = match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => return KSP_OK,
        Ok(Err(Fail::Null(what))) => (KSP_ERR_NULL_ARG, format!("{what} is NULL")),
        Ok(Err(Fail::Invalid(m))) => (KSP_ERR_INVALID_ARG, m),
        Ok(Err(Fail::State(m))) => (KSP_ERR_STATE, m),
        Ok(Err(Fail::Small)) => (KSP_ERR_BUFFER_TOO_SMALL, "the buffer is too small".into()),
        Ok(Err(Fail::StructSize(m))) => (KSP_ERR_STRUCT_SIZE, m),
        Ok(Err(Fail::Kspeed(e))) => (status_of(&e), e.to_string()),
        Err(p) => {
            let what = p
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".into());
            (
                KSP_ERR_PANIC,
                format!("kspeed panicked (a bug; please report it): {what}"),
            )
        }
    };
    set_error(msg);
    status
}

/// Copies the message of the calling thread's last failed call into `buf`
/// (NUL-terminated, truncated to `buf_len`) and its full length (without
/// the NUL) into `*out_len`. An empty message when nothing failed yet.
///
/// Returns `KSP_ERR_BUFFER_TOO_SMALL` when truncated (`*out_len` says the
/// size needed), `KSP_ERR_NULL_ARG` when `buf` or `out_len` is NULL.
///
/// # Safety
/// `buf` must be writable for `buf_len` bytes; `out_len` writable.
#[no_mangle]
pub unsafe extern "C" fn ksp_last_error(
    buf: *mut c_char,
    buf_len: usize,
    out_len: *mut usize,
) -> ksp_status {
    // Not through `guard`: reading the message must not overwrite it.
    if buf.is_null() || out_len.is_null() {
        return KSP_ERR_NULL_ARG;
    }
    let r = catch_unwind(|| {
        LAST_ERROR.with(|e| {
            let m = e.borrow();
            let n = m.len().min(buf_len.saturating_sub(1));
            // SAFETY: buf has buf_len bytes (contract); n + 1 <= buf_len.
            unsafe {
                if buf_len > 0 {
                    std::ptr::copy_nonoverlapping(m.as_ptr().cast(), buf, n);
                    *buf.add(n) = 0;
                }
                *out_len = m.len();
            }
            if n < m.len() {
                KSP_ERR_BUFFER_TOO_SMALL
            } else {
                KSP_OK
            }
        })
    });
    r.unwrap_or(KSP_ERR_PANIC)
}
