//! `ksp_node_service`: the node service (`kspeed serve`) embedded in a C
//! program.

use std::ffi::c_char;

use super::errors::{guard, ksp_status};
use super::ffi::{str_arg, Handle, Out};
use crate::transport::{NodeService, ServeConfig};

/// A running node service. Opaque.
pub struct ksp_node_service {
    svc: NodeService,
}

impl Handle for ksp_node_service {
    const WHAT: &'static str = "service";
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
        ksp_node_service { svc }.give(out);
        Ok(())
    })
}

/// The TCP port the service listens on, in `*out`.
///
/// Status: `KSP_OK`; `KSP_ERR_NULL_ARG`.
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
