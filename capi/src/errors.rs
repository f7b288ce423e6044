//! Status codes, the mapping of every [`Error`] variant to one, the panic
//! boundary every export runs in, and the calling thread's last message.

use std::cell::RefCell;
use std::ffi::c_char;
use std::panic::{catch_unwind, AssertUnwindSafe};

use kspeed::error::{Error, ErrorClass};

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
    /// An I/O error on a named file (open, read, write, disk full, a space
    /// locked by another process).
    KSP_ERR_IO = 3,
    /// Wrong, corrupt or incompatible data: a catalog, manifest or sample
    /// checksum, a source with no samples, a source entry that cannot be a
    /// sample (not a regular file, a symlink loop or one leading outside
    /// the source), a catalog of another source.
    KSP_ERR_DATA = 4,
    /// A node refused, broke the protocol, or a sample could not be fetched;
    /// or the node agent (`agent` = required) is missing, refused the rank
    /// or is gone.
    KSP_ERR_NETWORK = 5,
    /// A system resource is missing or limited (memlock, io_uring, threads,
    /// NUMA, CUDA, RDMA verbs).
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
    /// The loader (or node service) was created by another process: this
    /// is a forked child (`fork()` copies its memory but none of its
    /// threads, and its ring and connections belong to the parent). Nothing
    /// was done or written; the message names both pids. Create a new one
    /// in the child (see `ksp_loader_new` and `ksp_node_service_start` on
    /// fork).
    KSP_ERR_FORKED = 12,
}

use ksp_status::*;

thread_local! {
    static LAST_ERROR: RefCell<String> = const { RefCell::new(String::new()) };
}

fn set_error(msg: String) {
    LAST_ERROR.with(|e| *e.borrow_mut() = msg);
}

/// The status of a kspeed error: its [`ErrorClass`] (the crate's one
/// mapping of every variant, shared with the Python binding). The match
/// has no wildcard: a new class does not compile until it has a status.
pub(super) fn status_of(e: &Error) -> ksp_status {
    match e.class() {
        ErrorClass::Io => KSP_ERR_IO,
        ErrorClass::Data => KSP_ERR_DATA,
        ErrorClass::Config => KSP_ERR_INVALID_ARG,
        ErrorClass::Network => KSP_ERR_NETWORK,
        ErrorClass::Resource => KSP_ERR_RESOURCE,
        ErrorClass::Bug => KSP_ERR_PANIC,
        // The node service could not start (bind, listen): documented as
        // KSP_ERR_OTHER on ksp_node_service_start.
        ErrorClass::Service => KSP_ERR_OTHER,
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
    /// A loader or node service used by another process than the one
    /// that created it.
    Forked {
        /// What it is ("loader", "node service").
        what: &'static str,
        /// The pid that created the loader.
        creator: u32,
        /// The pid of the caller (a forked child).
        caller: u32,
    },
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
        Ok(Err(Fail::Forked {
            what,
            creator,
            caller,
        })) => (
            KSP_ERR_FORKED,
            format!(
                "this {what} was created by pid {creator}; a forked child (pid {caller}) \
                 cannot use it (fork copies none of its threads, and its memory and connections \
                 are the parent's); create a new {what} after fork"
            ),
        ),
        Ok(Err(Fail::Kspeed(e))) => (status_of(&e), e.to_string()),
        Err(p) => {
            let what = kspeed::error::panic_text(&*p);
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
/// Thread safety: any thread. Each thread has its own message: the one of
/// its own last failed call.
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
