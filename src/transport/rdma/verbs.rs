//! The verbs resources the RDMA transport is built from, as RAII owners:
//! the device probe, device context, protection domain, memory region and
//! window. Completion channels and queues and the queue pair are in
//! `qp.rs`.
//!
//! Teardown mirrors rdma-core's cleanup order: each object holds an `Arc` of
//! what it was created from, so a memory region or queue pair is destroyed
//! before its protection domain and completion queues, and those before the
//! device context, whatever order the owner drops them in.
//!
//! This module owns verbs resources and is one of the few allowed `unsafe`.

use std::ffi::CStr;
use std::os::fd::RawFd;
use std::ptr;
use std::sync::Arc;

use rdma_sys::*;

use crate::error::{Error, Result};

/// Names of the RDMA devices libibverbs can see (`rxe0`, `mlx5_0`, ...).
/// Empty when there are none, or when the kernel has no RDMA support.
pub fn device_names() -> Vec<String> {
    let mut count: std::os::raw::c_int = 0;
    // SAFETY: ibv_get_device_list writes the count through a valid pointer and
    // returns a NULL-terminated array we own until ibv_free_device_list.
    let list = unsafe { ibv_get_device_list(&mut count) };
    if list.is_null() {
        return Vec::new();
    }
    let mut names = Vec::with_capacity(count.max(0) as usize);
    for i in 0..count.max(0) as usize {
        // SAFETY: i < count, so list[i] is a valid device pointer in the array.
        let dev = unsafe { *list.add(i) };
        if dev.is_null() {
            break;
        }
        // SAFETY: dev is a live device from the list; the returned name is a
        // NUL-terminated string owned by the device, copied before the free.
        let name = unsafe { ibv_get_device_name(dev) };
        if !name.is_null() {
            // SAFETY: name is non-null and NUL-terminated (see above).
            names.push(
                unsafe { CStr::from_ptr(name) }
                    .to_string_lossy()
                    .into_owned(),
            );
        }
    }
    // SAFETY: list came from ibv_get_device_list and is freed exactly once,
    // after the last use of its devices.
    unsafe { ibv_free_device_list(list) };
    names
}

pub(super) fn os_err(op: &'static str, what: impl std::fmt::Display) -> Error {
    let e = std::io::Error::last_os_error();
    Error::Rdma {
        op,
        detail: format!("{what}: {e}"),
    }
}

/// One port of a device, as [`Context::ports`] describes it.
#[derive(Debug, Clone)]
pub struct PortInfo {
    /// Port number (from 1).
    pub port: u8,
    /// Whether the port is ACTIVE.
    pub active: bool,
    /// Active MTU in bytes.
    pub mtu_bytes: u32,
    /// The non-zero GIDs: (index, address as text, type from sysfs, e.g.
    /// "RoCE v2"). An IPv4-mapped GID is shown as the IPv4 address.
    pub gids: Vec<(u8, String, String)>,
}

/// An open device, with the port and GID used for RoCE addressing.
pub struct Context {
    pub(super) ctx: *mut ibv_context,
    pub(super) name: String,
    pub(super) port: u8,
    pub(super) gid_index: u8,
    pub(super) gid: [u8; 16],
    gid_table_len: i32,
    pub(super) mtu: u32,
}

// SAFETY: verbs contexts are thread-safe (libibverbs serialises internally).
unsafe impl Send for Context {}
// SAFETY: as above.
unsafe impl Sync for Context {}

impl Context {
    /// Opens `device` (or the first one), using `port` and, by default,
    /// `gid_index` (for RoCE v2 the index of the GID that maps the IP address
    /// to use; without one, index 0 until a queue pair picks another with
    /// [`Qp::use_gid`](super::Qp::use_gid), usually the one [`Context::gid_for_ip`] finds).
    pub fn open(device: Option<&str>, port: u8, gid_index: Option<u8>) -> Result<Arc<Context>> {
        let mut n = 0;
        // SAFETY: as in device_names.
        let list = unsafe { ibv_get_device_list(&mut n) };
        if list.is_null() || n == 0 {
            if !list.is_null() {
                // SAFETY: freed once.
                unsafe { ibv_free_device_list(list) };
            }
            return Err(Error::Rdma {
                op: "open device",
                detail: "no RDMA device (is rdma_rxe or a NIC driver loaded?)".into(),
            });
        }
        let mut chosen = ptr::null_mut();
        let mut chosen_name = String::new();
        for i in 0..n as usize {
            // SAFETY: i < n.
            let dev = unsafe { *list.add(i) };
            // SAFETY: dev is live; the name is NUL-terminated.
            let name = unsafe { CStr::from_ptr(ibv_get_device_name(dev)) }.to_string_lossy();
            if device.is_none_or(|d| d == name) {
                chosen = dev;
                chosen_name = name.into_owned();
                break;
            }
        }
        let ctx = if chosen.is_null() {
            ptr::null_mut()
        } else {
            // SAFETY: chosen is a live device of the list.
            unsafe { ibv_open_device(chosen) }
        };
        // SAFETY: the context keeps its own reference to the device.
        unsafe { ibv_free_device_list(list) };
        if ctx.is_null() {
            return Err(Error::Rdma {
                op: "open device",
                detail: format!(
                    "{}: not found or cannot be opened (devices: {:?})",
                    device.unwrap_or("first device"),
                    device_names()
                ),
            });
        }
        let mut c = Context {
            ctx,
            name: chosen_name,
            port,
            gid_index: gid_index.unwrap_or(0),
            gid: [0; 16],
            gid_table_len: 0,
            mtu: 0,
        };
        // SAFETY: ibv_port_attr is plain data; the call fills it.
        let mut attr: ibv_port_attr = unsafe { std::mem::zeroed() };
        // SAFETY: live context, valid out-pointer.
        if unsafe { ___ibv_query_port(ctx, port, &mut attr) } != 0 {
            return Err(os_err("query port", format!("port {port}")));
        }
        if attr.state != ibv_port_state::IBV_PORT_ACTIVE {
            return Err(Error::Rdma {
                op: "query port",
                detail: format!("port {port} is not active (state {})", attr.state),
            });
        }
        c.mtu = attr.active_mtu;
        c.gid_table_len = attr.gid_tbl_len;
        c.gid = c.gid_at(c.gid_index)?;
        Ok(Arc::new(c))
    }

    /// The device's name (`rxe0`, `mlx5_0`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Whether the device offers type 2B memory windows (bound through a
    /// queue pair, usable only by that QP's peer): its capability flags
    /// (`IBV_DEVICE_MEM_WINDOW_TYPE_2B`) and room for `windows` of them
    /// (`max_mw`). `Err` says why not, for the log.
    pub fn windows_supported(&self, windows: usize) -> std::result::Result<(), String> {
        // SAFETY: plain data; the call fills it.
        let mut dev: ibv_device_attr = unsafe { std::mem::zeroed() };
        // SAFETY: live context, valid out-pointer.
        let rc = unsafe { ibv_query_device(self.ctx, &mut dev) };
        if rc != 0 {
            return Err(format!(
                "ibv_query_device: {}",
                std::io::Error::from_raw_os_error(rc)
            ));
        }
        let type_2b = ibv_device_cap_flags::IBV_DEVICE_MEM_WINDOW_TYPE_2B.0;
        if dev.device_cap_flags & type_2b == 0 {
            return Err(format!(
                "device {} lacks IBV_DEVICE_MEM_WINDOW_TYPE_2B (capability flags {:#x})",
                self.name, dev.device_cap_flags
            ));
        }
        if (dev.max_mw.max(0) as usize) < windows {
            return Err(format!(
                "device {} allows {} memory windows, {windows} are needed",
                self.name, dev.max_mw
            ));
        }
        Ok(())
    }

    /// The receives one shared receive queue may hold on this device
    /// (`max_srq_wr`), or `None` where it has none (`max_srq` 0) or the
    /// query fails.
    pub fn max_srq_wr(&self) -> Option<usize> {
        // SAFETY: plain data; the call fills it.
        let mut dev: ibv_device_attr = unsafe { std::mem::zeroed() };
        // SAFETY: live context, valid out-pointer.
        let rc = unsafe { ibv_query_device(self.ctx, &mut dev) };
        (rc == 0 && dev.max_srq > 0 && dev.max_srq_wr > 0).then_some(dev.max_srq_wr as usize)
    }

    /// The most entries one completion queue may have on this device
    /// (`max_cqe`), or `None` where the query fails.
    pub fn max_cqe(&self) -> Option<usize> {
        // SAFETY: plain data; the call fills it.
        let mut dev: ibv_device_attr = unsafe { std::mem::zeroed() };
        // SAFETY: live context, valid out-pointer.
        let rc = unsafe { ibv_query_device(self.ctx, &mut dev) };
        (rc == 0 && dev.max_cqe > 0).then_some(dev.max_cqe as usize)
    }

    /// Every port of the device with its state, MTU and GID table: what a
    /// user needs to choose `--listen` and `--rdma-gid-index`.
    pub fn ports(&self) -> Vec<PortInfo> {
        // SAFETY: plain data; the call fills it.
        let mut dev: ibv_device_attr = unsafe { std::mem::zeroed() };
        // SAFETY: live context, valid out-pointer.
        if unsafe { ibv_query_device(self.ctx, &mut dev) } != 0 {
            return Vec::new();
        }
        let mut out = Vec::new();
        for port in 1..=dev.phys_port_cnt {
            // SAFETY: plain data; the call fills it.
            let mut attr: ibv_port_attr = unsafe { std::mem::zeroed() };
            // SAFETY: live context, valid out-pointer.
            if unsafe { ___ibv_query_port(self.ctx, port, &mut attr) } != 0 {
                continue;
            }
            let mut gids = Vec::new();
            for i in 0..attr.gid_tbl_len.clamp(0, 256) {
                // SAFETY: plain data; the call fills it.
                let mut g: ibv_gid = unsafe { std::mem::zeroed() };
                // SAFETY: live context, valid out-pointer.
                if unsafe { ibv_query_gid(self.ctx, port, i, &mut g) } != 0 {
                    continue;
                }
                // SAFETY: reading the raw bytes of a filled union.
                let raw = unsafe { g.raw };
                if raw == [0; 16] {
                    continue;
                }
                let v6 = std::net::Ipv6Addr::from(raw);
                let text = match v6.to_ipv4_mapped() {
                    Some(v4) => v4.to_string(),
                    None => v6.to_string(),
                };
                let kind = std::fs::read_to_string(format!(
                    "/sys/class/infiniband/{}/ports/{port}/gid_attrs/types/{i}",
                    self.name
                ))
                .map(|t| t.trim().to_string())
                .unwrap_or_else(|_| "?".into());
                gids.push((i as u8, text, kind));
            }
            out.push(PortInfo {
                port,
                active: attr.state == ibv_port_state::IBV_PORT_ACTIVE,
                mtu_bytes: 128u32 << attr.active_mtu.min(5),
                gids,
            });
        }
        out
    }

    /// The GID (16 bytes) of the chosen port and default index.
    pub fn gid(&self) -> [u8; 16] {
        self.gid
    }

    /// The GID at `index` of the port's table.
    pub fn gid_at(&self, index: u8) -> Result<[u8; 16]> {
        // SAFETY: ibv_gid is plain data; the call fills it.
        let mut gid: ibv_gid = unsafe { std::mem::zeroed() };
        // SAFETY: live context, valid out-pointer.
        if unsafe { ibv_query_gid(self.ctx, self.port, index as i32, &mut gid) } != 0 {
            return Err(os_err(
                "query GID",
                format!("{} port {} index {index}", self.name, self.port),
            ));
        }
        // SAFETY: reading the raw bytes of a filled union.
        Ok(unsafe { gid.raw })
    }

    /// The GID a queue pair uses: the one at `index` when configured, else
    /// the one carrying `local_ip`, the address this end of the control
    /// connection uses ([`Context::gid_for_ip`]).
    pub fn choose_gid(
        &self,
        index: Option<u8>,
        local_ip: std::net::IpAddr,
    ) -> Result<(u8, [u8; 16])> {
        match index {
            Some(i) => Ok((i, self.gid_at(i)?)),
            None => self.gid_for_ip(local_ip),
        }
    }

    /// The index and value of the GID that carries `ip` (IPv4 as the
    /// IPv4-mapped address), preferring a RoCE v2 entry (routable, what the
    /// node service's address means) over a RoCE v1 one.
    pub fn gid_for_ip(&self, ip: std::net::IpAddr) -> Result<(u8, [u8; 16])> {
        let want = match ip {
            std::net::IpAddr::V4(v4) => v4.to_ipv6_mapped().octets(),
            std::net::IpAddr::V6(v6) => v6.octets(),
        };
        let mut found = None;
        for i in 0..self.gid_table_len.clamp(0, 256) {
            let Ok(g) = self.gid_at(i as u8) else {
                continue;
            };
            if g != want {
                continue;
            }
            let kind = std::fs::read_to_string(format!(
                "/sys/class/infiniband/{}/ports/{}/gid_attrs/types/{i}",
                self.name, self.port
            ))
            .unwrap_or_default();
            if kind.trim().eq_ignore_ascii_case("RoCE v2") {
                return Ok((i as u8, g));
            }
            found.get_or_insert((i as u8, g));
        }
        found.ok_or_else(|| Error::Rdma {
            op: "choose GID",
            detail: format!(
                "no GID of {} port {} carries the address {ip} (is that address on the RDMA interface? \
                 otherwise name a GID index)",
                self.name, self.port
            ),
        })
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: last owner (Arc); every PD/CQ holding an Arc is gone.
        unsafe { ibv_close_device(self.ctx) };
    }
}

/// A protection domain.
pub struct Pd {
    pub(super) pd: *mut ibv_pd,
    pub(super) ctx: Arc<Context>,
}

// SAFETY: verbs objects may be used from any thread.
unsafe impl Send for Pd {}
// SAFETY: as above.
unsafe impl Sync for Pd {}

impl Pd {
    /// Allocates a protection domain.
    pub fn new(ctx: &Arc<Context>) -> Result<Arc<Pd>> {
        // SAFETY: live context.
        let pd = unsafe { ibv_alloc_pd(ctx.ctx) };
        if pd.is_null() {
            return Err(os_err("alloc PD", "ibv_alloc_pd"));
        }
        Ok(Arc::new(Pd {
            pd,
            ctx: ctx.clone(),
        }))
    }
}

impl Drop for Pd {
    fn drop(&mut self) {
        // SAFETY: every MR and QP of this PD holds an Arc to it, so they are gone.
        unsafe { ibv_dealloc_pd(self.pd) };
    }
}

/// Access a memory region is registered with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Local read and write (receive buffers, or staging the NIC only reads).
    Local,
    /// Local read only: memory the NIC only sends from, which may be a
    /// read-only mapping (page-cache mode's extents).
    ReadOnly,
    /// Local write + memory-window binding, and *no* remote access through
    /// the region's own rkey: a landing ring whose remote writes are only
    /// allowed through windows bound for one grant at a time ([`Mw`]).
    WindowsOnly,
    /// Local write + remote write (a landing ring). Never remote read.
    RemoteWrite,
}

impl Access {
    fn flags(self) -> ibv_access_flags {
        match self {
            Access::Local => ibv_access_flags::IBV_ACCESS_LOCAL_WRITE,
            Access::ReadOnly => ibv_access_flags(0),
            Access::WindowsOnly => {
                ibv_access_flags::IBV_ACCESS_LOCAL_WRITE | ibv_access_flags::IBV_ACCESS_MW_BIND
            }
            Access::RemoteWrite => {
                ibv_access_flags::IBV_ACCESS_LOCAL_WRITE | ibv_access_flags::IBV_ACCESS_REMOTE_WRITE
            }
        }
    }
}

/// A registered memory region.
pub struct Mr {
    pub(super) mr: *mut ibv_mr,
    _pd: Arc<Pd>,
}

// SAFETY: an MR is an immutable registration handle.
unsafe impl Send for Mr {}
// SAFETY: as above.
unsafe impl Sync for Mr {}

impl Mr {
    /// Registers `len` bytes at `addr`.
    ///
    /// # Safety
    /// The memory must stay mapped until the region is dropped, and with
    /// `RemoteWrite` the peer may write it at any time while registered.
    pub unsafe fn register(pd: &Arc<Pd>, addr: *mut u8, len: usize, access: Access) -> Result<Mr> {
        let flags = access.flags();
        // SAFETY: per this function's contract.
        let mr = unsafe { __ibv_reg_mr(pd.pd, addr.cast(), len, flags.0, 1) };
        if mr.is_null() {
            return Err(os_err(
                "register MR",
                format!("{len} bytes (RLIMIT_MEMLOCK may be too low)"),
            ));
        }
        Ok(Mr {
            mr,
            _pd: pd.clone(),
        })
    }

    /// Registers `len` bytes of the dma-buf `fd` from `offset`, addressed
    /// by peers as `iova..iova + len`: memory the CPU may not be able to
    /// touch, such as a GPU allocation exported as a dma-buf (GPUDirect
    /// RDMA without a peer-memory kernel module). The NIC's driver must
    /// support it; one that does not is a named error saying so.
    ///
    /// # Safety
    /// The dma-buf must stay alive until the region is dropped, and with
    /// `RemoteWrite` the peer may write it at any time while registered.
    pub unsafe fn register_dmabuf(
        pd: &Arc<Pd>,
        fd: RawFd,
        offset: u64,
        len: usize,
        iova: u64,
        access: Access,
    ) -> Result<Mr> {
        let flags = access.flags();
        // SAFETY: per this function's contract; the call only reads its
        // arguments.
        let mr = unsafe { ibv_reg_dmabuf_mr(pd.pd, offset, len, iova, fd, flags.0 as i32) };
        if mr.is_null() {
            let e = std::io::Error::last_os_error();
            let detail = if e.raw_os_error() == Some(libc::EOPNOTSUPP) {
                format!(
                    "{len} bytes of dma-buf fd {fd}: device {} cannot register dma-buf memory \
                     (its driver lacks it; GPUDirect RDMA through dma-buf needs a NIC whose \
                     driver implements it): {e}",
                    pd.ctx.name()
                )
            } else {
                format!("{len} bytes of dma-buf fd {fd} at offset {offset}: {e}")
            };
            return Err(Error::Rdma {
                op: "register dma-buf MR",
                detail,
            });
        }
        Ok(Mr {
            mr,
            _pd: pd.clone(),
        })
    }

    /// Local key.
    pub fn lkey(&self) -> u32 {
        // SAFETY: live MR.
        unsafe { (*self.mr).lkey }
    }

    /// Remote key.
    pub fn rkey(&self) -> u32 {
        // SAFETY: live MR.
        unsafe { (*self.mr).rkey }
    }

    /// Registered address.
    pub fn addr(&self) -> u64 {
        // SAFETY: live MR.
        unsafe { (*self.mr).addr as u64 }
    }

    /// Registered length in bytes.
    pub fn len_bytes(&self) -> u64 {
        // SAFETY: live MR.
        unsafe { (*self.mr).length as u64 }
    }
}

/// The registered memory a link may send from: (address, length, lkey) per
/// region, sorted by address, so a write finds its local key by address
/// (one staging slab, plus the mapped extents in page-cache mode).
#[derive(Clone, Default)]
pub struct SendRegions(Arc<[(u64, u64, u32)]>);

impl SendRegions {
    /// The regions of `mrs`.
    pub fn new(mrs: &[&Mr]) -> Self {
        let mut v: Vec<(u64, u64, u32)> = mrs
            .iter()
            .map(|m| (m.addr(), m.len_bytes(), m.lkey()))
            .collect();
        v.sort_unstable();
        SendRegions(v.into())
    }

    /// Regions given as (address, bytes, lkey): what the in-memory verbs
    /// of the tests register.
    #[cfg(test)]
    pub(crate) fn from_ranges(ranges: &[(u64, u64, u32)]) -> Self {
        let mut v = ranges.to_vec();
        v.sort_unstable();
        SendRegions(v.into())
    }

    /// The local key of the region holding `addr..addr+len`.
    pub fn lkey(&self, addr: u64, len: u32) -> Option<u32> {
        let i = self.0.partition_point(|r| r.0 <= addr).checked_sub(1)?;
        let (start, n, key) = self.0[i];
        (addr + len as u64 <= start + n).then_some(key)
    }
}

impl Drop for Mr {
    fn drop(&mut self) {
        // SAFETY: registered once, deregistered once.
        unsafe { ibv_dereg_mr(self.mr) };
    }
}

/// A type 2 memory window: bound through a queue pair to a range of a
/// [`Access::WindowsOnly`] region, it gives the peer of *that* QP remote
/// write access to exactly that range under a fresh rkey, until it is
/// invalidated. The consumer binds one per grant, so the NIC refuses a
/// write anywhere but the granted range.
pub struct Mw {
    pub(super) mw: *mut ibv_mw,
    _pd: Arc<Pd>,
}

// SAFETY: a window handle may be used from any thread (callers serialise).
unsafe impl Send for Mw {}

impl Mw {
    /// Allocates a type 2 window.
    pub fn new(pd: &Arc<Pd>) -> Result<Mw> {
        // SAFETY: live PD.
        let mw = unsafe { ibv_alloc_mw(pd.pd, ibv_mw_type::IBV_MW_TYPE_2) };
        match mw {
            Some(p) if !p.is_null() => Ok(Mw {
                mw: p,
                _pd: pd.clone(),
            }),
            _ => Err(os_err("allocate memory window", "type 2")),
        }
    }

    /// The rkey it holds now (its low 8 bits change at every bind).
    pub fn rkey(&self) -> u32 {
        // SAFETY: live window.
        unsafe { (*self.mw).rkey }
    }

    /// Records `rkey` as the window's current key once a bind to it has
    /// been posted (the verbs library does this for type 1 binds, not for
    /// type 2 ones posted on a QP). The next bind names the window by its
    /// current key: the provider copies this field into the request, and
    /// the device refuses a bind naming a stale one (soft-RoCE:
    /// `IBV_WC_MW_BIND_ERR`), so without this only a window's first bind
    /// works.
    pub fn set_rkey(&self, rkey: u32) {
        // SAFETY: live window; the field is plain data that only the
        // provider's post path reads, on the thread that owns this window
        // (Mw is Send, not Sync).
        unsafe { (*self.mw).rkey = rkey };
    }
}

impl Drop for Mw {
    fn drop(&mut self) {
        // SAFETY: allocated once, freed once, before its PD (Arc).
        unsafe { ibv_dealloc_mw(self.mw) };
    }
}

/// A memory-window operation posted on a QP's send queue.
pub enum WindowOp<'a> {
    /// Bind `mw` to `len` bytes at `addr` of `mr` for remote write, under
    /// `rkey` (the window's current rkey with a new low byte).
    Bind {
        /// The window.
        mw: &'a Mw,
        /// The region it opens part of.
        mr: &'a Mr,
        /// First byte.
        addr: u64,
        /// Bytes.
        len: u64,
        /// The rkey the peer will use.
        rkey: u32,
    },
    /// Invalidate the window bound under `rkey` (no remote access after).
    Invalidate {
        /// The rkey to revoke.
        rkey: u32,
    },
}

/// The next rkey for a window: same index, the next 8-bit tag.
pub fn next_rkey(rkey: u32) -> u32 {
    (rkey & !0xff) | (rkey.wrapping_add(1) & 0xff)
}
