//! `ksp_node_service`: the node service (`kspeed serve`) embedded in a C
//! program.

use std::ffi::c_char;

use super::errors::{guard, ksp_status, Fail};
use super::ffi::{str_arg, Handle, Out};
use kspeed::transport::{NodeService, ServeConfig};

/// A running node service. Opaque.
pub struct ksp_node_service {
    svc: NodeService,
    /// The process that started the service. A forked child has a copy of
    /// this struct but none of the service's threads (joining them would
    /// hang) and shares its sockets: every call from another pid is
    /// refused (`KSP_ERR_FORKED`) and `ksp_node_service_stop` leaks it
    /// there.
    pid: u32,
}

impl Handle for ksp_node_service {
    const WHAT: &'static str = "service";

    fn check_process(&self) -> Result<(), Fail> {
        super::ffi::same_process("node service", self.pid)
    }
}

/// Starts a node service serving `space` on `listen` (`host:port`, port 0
/// picks one) for consumers presenting `token`. Stop and free it with
/// [`ksp_node_service_stop`].
///
/// Status: `KSP_OK`; `KSP_ERR_NULL_ARG`; `KSP_ERR_IO` / `KSP_ERR_DATA` (the
/// space); `KSP_ERR_OTHER` (cannot listen). The caller owns `*out`; the
/// service's threads run until [`ksp_node_service_stop`].
///
/// Thread safety: any thread. The service runs on its own threads.
///
/// Fork: the service belongs to the process that started it. A `fork()`ed
/// child gets a copy of the handle but none of the service's threads, so
/// every call on the handle in the child returns `KSP_ERR_FORKED` ("this
/// node service was created by pid X; a forked child (pid Y) cannot use
/// it...") without doing or writing anything, and
/// [`ksp_node_service_stop`] there leaks the child's copy rather than wait
/// for threads the child does not have. The parent's service is
/// unaffected (its listening and consumer sockets are shared with the
/// child until the child closes them or execs).
///
/// # Safety
/// Strings NUL-terminated; `out` writable.
#[no_mangle]
pub unsafe extern "C" fn ksp_node_service_start(
    space: *const c_char,
    listen: *const c_char,
    token: *const c_char,
    out: *mut *mut ksp_node_service,
) -> ksp_status {
    guard(|| {
        // SAFETY: out writable; strings per the contract.
        let (out, sp, addr, tok) = unsafe {
            (
                Out::new(out, "out")?,
                str_arg(space, "space")?,
                str_arg(listen, "listen")?,
                str_arg(token, "token")?,
            )
        };
        let svc = NodeService::start(ServeConfig::new(sp, addr, tok.as_bytes()))?;
        ksp_node_service {
            svc,
            pid: std::process::id(),
        }
        .give(out);
        Ok(())
    })
}

/// The TCP port the service listens on, in `*out`.
///
/// Status: `KSP_OK`; `KSP_ERR_NULL_ARG`; `KSP_ERR_FORKED` (a forked
/// child; nothing written).
///
/// Thread safety: any thread, but not overlapping [`ksp_node_service_stop`].
///
/// # Safety
/// `s` is a live service; `out` writable.
#[no_mangle]
pub unsafe extern "C" fn ksp_node_service_port(
    s: *const ksp_node_service,
    out: *mut u16,
) -> ksp_status {
    guard(|| {
        // SAFETY: live service; out writable (contract).
        let (s, out) = unsafe { (ksp_node_service::try_ref(s)?, Out::new(out, "out")?) };
        out.set(s.svc.local_addr().port());
        Ok(())
    })
}

/// Stops the service (closing every connection) and frees it. NULL is a no-op.
/// In a forked child (a process other than the one that started it) it
/// stops and frees nothing: the child's copy of the handle is leaked and
/// the parent's service is left alone (see [`ksp_node_service_start`] on
/// fork).
///
/// Thread safety: no other call on `s` may run or follow.
///
/// # Safety
/// `s` is NULL or came from [`ksp_node_service_start`] and was not stopped.
#[no_mangle]
pub unsafe extern "C" fn ksp_node_service_stop(s: *mut ksp_node_service) {
    // SAFETY: per the contract; dropping the service stops it.
    unsafe { ksp_node_service::free(s) }
}
