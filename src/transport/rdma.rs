//! RDMA verbs (rdma-sys): the device probe, and RAII owners of the verbs
//! resources the RDMA transport is built from — device context, protection
//! domain, completion queue, memory region, RC queue pair — with the
//! one-sided WRITE_WITH_IMM the push protocol uses (immediate = grant id).
//!
//! Teardown mirrors rdma-core's cleanup order: each object holds an `Arc` of
//! what it was created from, so a memory region or queue pair is destroyed
//! before its protection domain and completion queues, and those before the
//! device context, whatever order the owner drops them in.
//!
//! This module owns the verbs resources and is one of the few allowed `unsafe`.

use std::collections::VecDeque;
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

fn os_err(op: &'static str, what: impl std::fmt::Display) -> Error {
    let e = std::io::Error::last_os_error();
    Error::Rdma {
        op,
        detail: format!("{what}: {e}"),
    }
}

/// The name of a work completion status (`IBV_WC_REM_ACCESS_ERR`...).
pub fn wc_status_name(status: u32) -> &'static str {
    use ibv_wc_status::*;
    match status {
        IBV_WC_SUCCESS => "IBV_WC_SUCCESS",
        IBV_WC_LOC_LEN_ERR => "IBV_WC_LOC_LEN_ERR",
        IBV_WC_LOC_QP_OP_ERR => "IBV_WC_LOC_QP_OP_ERR",
        IBV_WC_LOC_EEC_OP_ERR => "IBV_WC_LOC_EEC_OP_ERR",
        IBV_WC_LOC_PROT_ERR => "IBV_WC_LOC_PROT_ERR",
        IBV_WC_WR_FLUSH_ERR => "IBV_WC_WR_FLUSH_ERR",
        IBV_WC_MW_BIND_ERR => "IBV_WC_MW_BIND_ERR",
        IBV_WC_BAD_RESP_ERR => "IBV_WC_BAD_RESP_ERR",
        IBV_WC_LOC_ACCESS_ERR => "IBV_WC_LOC_ACCESS_ERR",
        IBV_WC_REM_INV_REQ_ERR => "IBV_WC_REM_INV_REQ_ERR",
        IBV_WC_REM_ACCESS_ERR => "IBV_WC_REM_ACCESS_ERR",
        IBV_WC_REM_OP_ERR => "IBV_WC_REM_OP_ERR",
        IBV_WC_RETRY_EXC_ERR => "IBV_WC_RETRY_EXC_ERR",
        IBV_WC_RNR_RETRY_EXC_ERR => "IBV_WC_RNR_RETRY_EXC_ERR",
        IBV_WC_LOC_RDD_VIOL_ERR => "IBV_WC_LOC_RDD_VIOL_ERR",
        IBV_WC_REM_INV_RD_REQ_ERR => "IBV_WC_REM_INV_RD_REQ_ERR",
        IBV_WC_REM_ABORT_ERR => "IBV_WC_REM_ABORT_ERR",
        IBV_WC_INV_EECN_ERR => "IBV_WC_INV_EECN_ERR",
        IBV_WC_INV_EEC_STATE_ERR => "IBV_WC_INV_EEC_STATE_ERR",
        IBV_WC_FATAL_ERR => "IBV_WC_FATAL_ERR",
        IBV_WC_RESP_TIMEOUT_ERR => "IBV_WC_RESP_TIMEOUT_ERR",
        IBV_WC_GENERAL_ERR => "IBV_WC_GENERAL_ERR",
        _ => "IBV_WC_UNKNOWN",
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
    ctx: *mut ibv_context,
    name: String,
    port: u8,
    gid_index: u8,
    gid: [u8; 16],
    gid_table_len: i32,
    mtu: u32,
}

// SAFETY: verbs contexts are thread-safe (libibverbs serialises internally).
unsafe impl Send for Context {}
// SAFETY: as above.
unsafe impl Sync for Context {}

impl Context {
    /// Opens `device` (or the first one), using `port` and, by default,
    /// `gid_index` (for RoCE v2 the index of the GID that maps the IP address
    /// to use; without one, index 0 until a queue pair picks another with
    /// [`Qp::use_gid`], usually the one [`Context::gid_for_ip`] finds).
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
    pd: *mut ibv_pd,
    ctx: Arc<Context>,
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

/// A completion channel: one file descriptor that becomes readable when an
/// armed completion queue attached to it gets a completion, so a thread can
/// sleep in its io_uring instead of spinning on the CQs.
pub struct CompChannel {
    ch: *mut ibv_comp_channel,
    _ctx: Arc<Context>,
}

// SAFETY: verbs objects may be used from any thread (callers serialise).
unsafe impl Send for CompChannel {}
// SAFETY: as above.
unsafe impl Sync for CompChannel {}

impl CompChannel {
    /// Creates a channel whose descriptor is non-blocking.
    pub fn new(ctx: &Arc<Context>) -> Result<Arc<CompChannel>> {
        // SAFETY: live context.
        let ch = unsafe { ibv_create_comp_channel(ctx.ctx) };
        if ch.is_null() {
            return Err(os_err("create completion channel", ctx.name.as_str()));
        }
        let c = CompChannel {
            ch,
            _ctx: ctx.clone(),
        };
        let fd = c.fd();
        // SAFETY: fcntl on a descriptor the channel owns.
        let ok = unsafe {
            let fl = libc::fcntl(fd, libc::F_GETFL);
            fl >= 0 && libc::fcntl(fd, libc::F_SETFL, fl | libc::O_NONBLOCK) == 0
        };
        if !ok {
            return Err(os_err("completion channel", "O_NONBLOCK"));
        }
        Ok(Arc::new(c))
    }

    /// The descriptor to poll for readability.
    pub fn fd(&self) -> i32 {
        // SAFETY: live channel.
        unsafe { (*self.ch).fd }
    }

    /// Takes and acknowledges every pending event; returns how many. The CQs
    /// that had one must be re-armed ([`Cq::arm`]) before sleeping again.
    pub fn drain(&self) -> usize {
        let mut n = 0;
        loop {
            let mut cq = ptr::null_mut();
            let mut user = ptr::null_mut();
            // SAFETY: live channel, valid out-pointers; non-blocking fd.
            if unsafe { ibv_get_cq_event(self.ch, &mut cq, &mut user) } != 0 {
                return n;
            }
            // SAFETY: cq was returned by the event and is live (a CQ is
            // destroyed only after its events are acknowledged, here).
            unsafe { ibv_ack_cq_events(cq, 1) };
            n += 1;
        }
    }
}

impl Drop for CompChannel {
    fn drop(&mut self) {
        // SAFETY: every CQ attached holds an Arc to this channel, so they
        // are destroyed already.
        unsafe { ibv_destroy_comp_channel(self.ch) };
    }
}

/// A completion queue.
pub struct Cq {
    cq: *mut ibv_cq,
    _channel: Option<Arc<CompChannel>>,
    _ctx: Arc<Context>,
}

// SAFETY: verbs objects may be used from any thread (callers serialise polls).
unsafe impl Send for Cq {}
// SAFETY: as above.
unsafe impl Sync for Cq {}

impl Cq {
    /// Creates a completion queue of `entries`.
    pub fn new(ctx: &Arc<Context>, entries: i32) -> Result<Arc<Cq>> {
        Self::create(ctx, entries, None)
    }

    /// Creates a completion queue of `entries` whose completions, once
    /// armed, wake `channel`.
    pub fn with_channel(
        ctx: &Arc<Context>,
        entries: i32,
        channel: &Arc<CompChannel>,
    ) -> Result<Arc<Cq>> {
        Self::create(ctx, entries, Some(channel))
    }

    fn create(
        ctx: &Arc<Context>,
        entries: i32,
        channel: Option<&Arc<CompChannel>>,
    ) -> Result<Arc<Cq>> {
        let ch = channel.map_or(ptr::null_mut(), |c| c.ch);
        // SAFETY: live context; the channel, if any, is live and kept alive
        // by the Arc stored below; no context pointer.
        let cq = unsafe { ibv_create_cq(ctx.ctx, entries, ptr::null_mut(), ch, 0) };
        if cq.is_null() {
            return Err(os_err("create CQ", format!("{entries} entries")));
        }
        Ok(Arc::new(Cq {
            cq,
            _channel: channel.cloned(),
            _ctx: ctx.clone(),
        }))
    }

    /// Asks for one event on the channel at the next completion. Poll once
    /// more after arming: a completion that came in before it raises none.
    pub fn arm(&self) -> Result<()> {
        // SAFETY: live CQ.
        let rc = unsafe { ibv_req_notify_cq(self.cq, 0) };
        if rc != 0 {
            return Err(Error::Rdma {
                op: "arm CQ",
                detail: std::io::Error::from_raw_os_error(rc).to_string(),
            });
        }
        Ok(())
    }

    /// Polls up to `out.len()` (at most 32 per call) completions; returns
    /// how many.
    pub fn poll(&self, out: &mut [WorkCompletion]) -> Result<usize> {
        // SAFETY: ibv_wc is plain data.
        let mut wc: [ibv_wc; 32] = unsafe { std::mem::zeroed() };
        let want = out.len().min(wc.len()) as i32;
        // SAFETY: live CQ; wc has `want` entries.
        let n = unsafe { ibv_poll_cq(self.cq, want, wc.as_mut_ptr()) };
        if n < 0 {
            return Err(os_err("poll CQ", "ibv_poll_cq"));
        }
        for (o, w) in out.iter_mut().zip(&wc[..n as usize]) {
            let with_imm = w.wc_flags & ibv_wc_flags::IBV_WC_WITH_IMM.0 != 0;
            *o = WorkCompletion {
                wr_id: w.wr_id,
                status: w.status,
                opcode: w.opcode,
                byte_len: w.byte_len,
                // SAFETY: with IBV_WC_WITH_IMM the union holds imm_data.
                imm: with_imm
                    .then(|| u32::from_be(unsafe { w.imm_data_invalidated_rkey_union.imm_data })),
                vendor_err: w.vendor_err,
            };
        }
        Ok(n as usize)
    }
}

impl Drop for Cq {
    fn drop(&mut self) {
        // SAFETY: every QP using this CQ holds an Arc to it, so they are gone.
        unsafe { ibv_destroy_cq(self.cq) };
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
    mr: *mut ibv_mr,
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
    mw: *mut ibv_mw,
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

/// What the other end of an RC connection needs: queue pair number, first
/// packet sequence number, GID — the content of an RDMA_ENDPOINT frame, so
/// an endpoint goes on the wire as it is.
pub use super::proto::RdmaEndpoint as Endpoint;

/// An RC queue pair.
pub struct Qp {
    qp: *mut ibv_qp,
    ctx: Arc<Context>,
    _pd: Arc<Pd>,
    _send_cq: Arc<Cq>,
    _recv_cq: Arc<Cq>,
    psn: u32,
    sgid_index: u8,
    sgid: [u8; 16],
}

// SAFETY: verbs QPs may be used from any thread (callers serialise posts).
unsafe impl Send for Qp {}

impl Qp {
    /// Creates an RC QP (state RESET → INIT).
    pub fn new(
        pd: &Arc<Pd>,
        send_cq: &Arc<Cq>,
        recv_cq: &Arc<Cq>,
        max_wr: u32,
        max_inline: u32,
    ) -> Result<Qp> {
        // SAFETY: plain data.
        let mut init: ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        init.send_cq = send_cq.cq;
        init.recv_cq = recv_cq.cq;
        init.qp_type = ibv_qp_type::IBV_QPT_RC;
        init.sq_sig_all = 0;
        init.cap.max_send_wr = max_wr;
        init.cap.max_recv_wr = max_wr;
        init.cap.max_send_sge = 1;
        init.cap.max_recv_sge = 1;
        init.cap.max_inline_data = max_inline;
        // SAFETY: live PD, valid attributes.
        let qp = unsafe { ibv_create_qp(pd.pd, &mut init) };
        if qp.is_null() {
            return Err(os_err("create QP", format!("{max_wr} work requests")));
        }
        let q = Qp {
            qp,
            ctx: pd.ctx.clone(),
            _pd: pd.clone(),
            _send_cq: send_cq.clone(),
            _recv_cq: recv_cq.clone(),
            // SAFETY: qp is live. Any 24-bit value is a valid PSN.
            psn: (unsafe { (*qp).qp_num }).wrapping_mul(2_654_435_761) & 0xff_ffff,
            sgid_index: pd.ctx.gid_index,
            sgid: pd.ctx.gid,
        };
        // SAFETY: plain data.
        let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ibv_qp_state::IBV_QPS_INIT;
        a.pkey_index = 0;
        a.port_num = q.ctx.port;
        a.qp_access_flags = ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0;
        q.modify(
            &mut a,
            ibv_qp_attr_mask::IBV_QP_STATE
                | ibv_qp_attr_mask::IBV_QP_PKEY_INDEX
                | ibv_qp_attr_mask::IBV_QP_PORT
                | ibv_qp_attr_mask::IBV_QP_ACCESS_FLAGS,
            "INIT",
        )?;
        Ok(q)
    }

    fn modify(&self, a: &mut ibv_qp_attr, mask: ibv_qp_attr_mask, to: &str) -> Result<()> {
        // SAFETY: live QP, valid attributes for the mask.
        let rc = unsafe { ibv_modify_qp(self.qp, a, mask.0 as i32) };
        if rc != 0 {
            return Err(Error::Rdma {
                op: "modify QP",
                detail: format!("to {to}: {}", std::io::Error::from_raw_os_error(rc)),
            });
        }
        Ok(())
    }

    /// Uses the GID at `index` (value `gid`) as this end's address instead
    /// of the context's default; before [`Qp::endpoint`] and [`Qp::connect`].
    pub fn use_gid(&mut self, index: u8, gid: [u8; 16]) {
        self.sgid_index = index;
        self.sgid = gid;
    }

    /// This end, to send to the peer.
    pub fn endpoint(&self) -> Endpoint {
        Endpoint {
            // SAFETY: live QP.
            qpn: unsafe { (*self.qp).qp_num },
            psn: self.psn,
            gid: self.sgid,
        }
    }

    /// Moves the QP to the error state: nothing more is sent or accepted
    /// from the peer, and every posted request completes with
    /// `IBV_WC_WR_FLUSH_ERR`.
    pub fn set_error(&self) -> Result<()> {
        // SAFETY: plain data.
        let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ibv_qp_state::IBV_QPS_ERR;
        self.modify(&mut a, ibv_qp_attr_mask::IBV_QP_STATE, "ERR")
    }

    /// Connects to `remote`: INIT → RTR → RTS.
    pub fn connect(&self, remote: &Endpoint) -> Result<()> {
        // SAFETY: plain data.
        let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ibv_qp_state::IBV_QPS_RTR;
        a.path_mtu = self.ctx.mtu;
        a.dest_qp_num = remote.qpn;
        a.rq_psn = remote.psn;
        a.max_dest_rd_atomic = 1;
        a.min_rnr_timer = 12;
        a.ah_attr.is_global = 1;
        a.ah_attr.port_num = self.ctx.port;
        a.ah_attr.grh.dgid.raw = remote.gid;
        a.ah_attr.grh.sgid_index = self.sgid_index;
        a.ah_attr.grh.hop_limit = 64;
        self.modify(
            &mut a,
            ibv_qp_attr_mask::IBV_QP_STATE
                | ibv_qp_attr_mask::IBV_QP_AV
                | ibv_qp_attr_mask::IBV_QP_PATH_MTU
                | ibv_qp_attr_mask::IBV_QP_DEST_QPN
                | ibv_qp_attr_mask::IBV_QP_RQ_PSN
                | ibv_qp_attr_mask::IBV_QP_MAX_DEST_RD_ATOMIC
                | ibv_qp_attr_mask::IBV_QP_MIN_RNR_TIMER,
            "RTR",
        )?;
        // SAFETY: plain data.
        let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ibv_qp_state::IBV_QPS_RTS;
        a.timeout = 14;
        a.retry_cnt = 7;
        a.rnr_retry = 7;
        a.sq_psn = self.psn;
        a.max_rd_atomic = 1;
        self.modify(
            &mut a,
            ibv_qp_attr_mask::IBV_QP_STATE
                | ibv_qp_attr_mask::IBV_QP_TIMEOUT
                | ibv_qp_attr_mask::IBV_QP_RETRY_CNT
                | ibv_qp_attr_mask::IBV_QP_RNR_RETRY
                | ibv_qp_attr_mask::IBV_QP_SQ_PSN
                | ibv_qp_attr_mask::IBV_QP_MAX_QP_RD_ATOMIC,
            "RTS",
        )
    }

    /// Posts receives (for WRITE_WITH_IMM completions: no buffer needed),
    /// one chain of `n` with ids `first_id..`.
    pub fn post_recvs(&self, first_id: u64, n: usize, wrs: &mut Vec<ibv_recv_wr>) -> Result<()> {
        let mut sges = Vec::new();
        self.post_recvs_into(first_id, n, None, &mut sges, wrs)
    }

    /// Posts `n` receives, each with a `slot`-byte buffer from `buf` (slot i
    /// at `base + i * slot`) when given: what SENDs (ERROR messages) need.
    pub fn post_recvs_into(
        &self,
        first_id: u64,
        n: usize,
        buf: Option<(&Mr, u64, u32)>,
        sges: &mut Vec<ibv_sge>,
        wrs: &mut Vec<ibv_recv_wr>,
    ) -> Result<()> {
        wrs.clear();
        sges.clear();
        if let Some((mr, base, slot)) = buf {
            for i in 0..n {
                sges.push(ibv_sge {
                    addr: base + i as u64 * slot as u64,
                    length: slot,
                    lkey: mr.lkey(),
                });
            }
        }
        for i in 0..n {
            let (sg, num) = match sges.get_mut(i) {
                Some(s) => (s as *mut ibv_sge, 1),
                None => (ptr::null_mut(), 0),
            };
            wrs.push(ibv_recv_wr {
                wr_id: first_id + i as u64,
                next: ptr::null_mut(),
                sg_list: sg,
                num_sge: num,
            });
        }
        for i in 0..n.saturating_sub(1) {
            let next: *mut ibv_recv_wr = &mut wrs[i + 1];
            wrs[i].next = next;
        }
        if n == 0 {
            return Ok(());
        }
        let mut bad = ptr::null_mut();
        // SAFETY: live QP; a well-formed chain that outlives the call.
        let rc = unsafe { ibv_post_recv(self.qp, wrs.as_mut_ptr(), &mut bad) };
        if rc != 0 {
            return Err(Error::Rdma {
                op: "post receives",
                detail: std::io::Error::from_raw_os_error(rc).to_string(),
            });
        }
        Ok(())
    }

    /// Posts memory-window binds and invalidations as one chain (one
    /// doorbell), in order; each is (wr_id, signalled, op). The send queue
    /// executes them in order with anything posted before or after.
    pub fn post_window_ops(
        &self,
        ops: &[(u64, bool, WindowOp<'_>)],
        wrs: &mut Vec<ibv_send_wr>,
    ) -> Result<()> {
        wrs.clear();
        for (id, signaled, op) in ops {
            // SAFETY: plain data.
            let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
            wr.wr_id = *id;
            wr.send_flags = if *signaled {
                ibv_send_flags::IBV_SEND_SIGNALED.0
            } else {
                0
            };
            match op {
                WindowOp::Bind {
                    mw,
                    mr,
                    addr,
                    len,
                    rkey,
                } => {
                    wr.opcode = ibv_wr_opcode::IBV_WR_BIND_MW;
                    wr.bind_mw_tso_union.bind_mw = bind_mw_t {
                        mw: mw.mw,
                        rkey: *rkey,
                        bind_info: ibv_mw_bind_info {
                            mr: mr.mr,
                            addr: *addr,
                            length: *len,
                            mw_access_flags: ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0,
                        },
                    };
                }
                WindowOp::Invalidate { rkey } => {
                    wr.opcode = ibv_wr_opcode::IBV_WR_LOCAL_INV;
                    wr.imm_data_invalidated_rkey_union.invalidated_rkey = *rkey;
                }
            }
            wrs.push(wr);
        }
        // SAFETY: the windows and region are live (borrowed for the call,
        // and the caller keeps them alive while bound); nothing else is
        // referenced.
        unsafe { self.post_chain(wrs) }.map_err(|e| Error::Rdma {
            op: "post window operations",
            detail: e.to_string(),
        })
    }

    /// Posts type 2 window binds as one chain (one doorbell): each
    /// (window, address, length, rkey) opens `length` bytes at `address` of
    /// `mr` for remote write by this QP's peer, under `rkey`. Only the last
    /// is signalled, with `last_id` (the send queue runs them in order, so
    /// its completion means every bind of the chain is in force); every
    /// request carries `last_id`, so a failed one is recognised too.
    pub fn post_binds<'a>(
        &self,
        mr: &Mr,
        binds: impl Iterator<Item = (&'a Mw, u64, u64, u32)>,
        last_id: u64,
        wrs: &mut Vec<ibv_send_wr>,
    ) -> Result<()> {
        wrs.clear();
        for (mw, addr, len, rkey) in binds {
            // SAFETY: plain data.
            let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
            wr.wr_id = last_id;
            wr.opcode = ibv_wr_opcode::IBV_WR_BIND_MW;
            wr.bind_mw_tso_union.bind_mw = bind_mw_t {
                mw: mw.mw,
                rkey,
                bind_info: ibv_mw_bind_info {
                    mr: mr.mr,
                    addr,
                    length: len,
                    mw_access_flags: ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0,
                },
            };
            wrs.push(wr);
        }
        if let Some(last) = wrs.last_mut() {
            last.send_flags = ibv_send_flags::IBV_SEND_SIGNALED.0;
        }
        // SAFETY: the windows and the region are live (the caller keeps
        // them alive while bound: they are dropped with or after the QP).
        unsafe { self.post_chain(wrs) }.map_err(|e| Error::Rdma {
            op: "post memory-window binds",
            detail: e.to_string(),
        })
    }

    /// Posts a chain of RDMA WRITE_WITH_IMM work requests (one doorbell),
    /// signalling only the last. Each is (wr_id, local address, length,
    /// remote address, immediate).
    ///
    /// # Safety
    /// Each local range must lie in `mr` and stay valid until the chain's
    /// completion; the remote ranges are the peer's to police (its MR).
    pub unsafe fn post_writes(
        &self,
        mr: &Mr,
        rkey: u32,
        writes: &[(u64, *const u8, u32, u64, u32)],
        sges: &mut Vec<ibv_sge>,
        wrs: &mut Vec<ibv_send_wr>,
    ) -> Result<()> {
        sges.clear();
        wrs.clear();
        for &(_, addr, len, _, _) in writes {
            sges.push(ibv_sge {
                addr: addr as u64,
                length: len,
                lkey: mr.lkey(),
            });
        }
        for (i, &(id, _, _, remote, imm)) in writes.iter().enumerate() {
            // SAFETY: plain data.
            let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
            wr.wr_id = id;
            wr.sg_list = &mut sges[i];
            wr.num_sge = 1;
            wr.opcode = ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM;
            wr.send_flags = if i + 1 == writes.len() {
                ibv_send_flags::IBV_SEND_SIGNALED.0
            } else {
                0
            };
            wr.imm_data_invalidated_rkey_union.imm_data = imm.to_be();
            wr.wr.rdma.remote_addr = remote;
            wr.wr.rdma.rkey = rkey;
            wrs.push(wr);
        }
        // SAFETY: the SGEs (in `sges`) outlive the call; the local memory
        // per this function's contract.
        unsafe { self.post_chain(wrs) }.map_err(|e| Error::Rdma {
            op: "post writes",
            detail: e.to_string(),
        })
    }

    /// Links `wrs` into one chain and posts it (one doorbell); nothing when
    /// empty. Returns the provider's errno on failure.
    ///
    /// # Safety
    /// Every request must be well formed, and whatever it references (SGEs,
    /// local memory, windows, regions) valid for the call and, for memory
    /// the device reads or writes, until the request completes.
    unsafe fn post_chain(&self, wrs: &mut [ibv_send_wr]) -> std::io::Result<()> {
        if wrs.is_empty() {
            return Ok(());
        }
        for i in 0..wrs.len() - 1 {
            let next: *mut ibv_send_wr = &mut wrs[i + 1];
            wrs[i].next = next;
        }
        let mut bad = ptr::null_mut();
        // SAFETY: live QP (owned by self); the chain lives in `wrs` for the
        // call; what the requests reference, per this function's contract.
        let rc = unsafe { ibv_post_send(self.qp, wrs.as_mut_ptr(), &mut bad) };
        if rc != 0 {
            return Err(std::io::Error::from_raw_os_error(rc));
        }
        Ok(())
    }
}

impl Drop for Qp {
    fn drop(&mut self) {
        // SAFETY: created once, destroyed once, before its PD and CQs (which
        // this QP keeps alive through its Arcs).
        unsafe { ibv_destroy_qp(self.qp) };
    }
}

/// One work completion, copied out of the CQ.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WorkCompletion {
    /// The work request id.
    pub wr_id: u64,
    /// Status (0 = success; [`wc_status_name`] names the others).
    pub status: u32,
    /// Opcode (`ibv_wc_opcode`).
    pub opcode: u32,
    /// Bytes (for receives, those written by the peer's WRITE_WITH_IMM).
    pub byte_len: u32,
    /// The immediate data, host order (the grant id), when present.
    pub imm: Option<u32>,
    /// Vendor error code.
    pub vendor_err: u32,
}

impl WorkCompletion {
    /// Ok, or the named error for a failed completion.
    pub fn check(&self) -> Result<()> {
        if self.status == ibv_wc_status::IBV_WC_SUCCESS {
            Ok(())
        } else {
            Err(completion_error(self))
        }
    }
}

/// The named error for a failed work completion.
pub fn completion_error(wc: &WorkCompletion) -> Error {
    Error::RdmaCompletion {
        wr_id: wc.wr_id,
        status: wc_status_name(wc.status),
        vendor_err: wc.vendor_err,
    }
}

/// An [`RdmaLink`] asks for a completion at least every this many requests.
pub const SIGNAL_EVERY: usize = 8;

/// Largest ERROR message an [`RdmaLink`] sends (inline, after a 4-byte code).
pub const RDMA_ERROR_BYTES: usize = 128;

#[derive(Clone, Copy)]
struct RdmaWr {
    wr_id: u64,
    send: bool,
    src: *const u8,
    len: u32,
    lkey: u32,
    remote: u64,
    rkey: u32,
    imm: u32,
    inline_at: usize,
}

/// The verbs backend of [`super::Link`]: a posted write is an RDMA
/// WRITE_WITH_IMM from the poster's staging memory (registered local-only,
/// `lkey`) into the peer's ring under the grant's rkey (a memory window the
/// peer bound to that grant's range, or its whole ring's) with the grant id
/// as immediate; an ERROR is a SEND_WITH_IMM on the same QP, so it
/// cannot overtake the grant's writes (RC ordering), carrying a 4-byte code
/// and the message inline. `flush` posts everything queued as one chain (one
/// doorbell) signalling only its last request; `poll` turns the chain's
/// completion into a [`super::Done`] for each of its requests. A failed
/// completion (the QP is then in error) fails everything outstanding.
pub struct RdmaLink {
    qp: Qp,
    cq: Arc<Cq>,
    regions: SendRegions,
    remote_base: u64,
    max_wr: usize,
    queued: Vec<RdmaWr>,
    /// Requests posted, oldest first, and the signalled id ending each chain.
    posted: VecDeque<u64>,
    chain_ends: VecDeque<u64>,
    /// The signalled ids of the chain being built.
    signal_ids: Vec<u64>,
    done: VecDeque<super::Done>,
    inline_buf: Vec<u8>,
    sges: Vec<ibv_sge>,
    wrs: Vec<ibv_send_wr>,
    broken: Option<Error>,
}

// SAFETY: the raw pointers are addresses the poster keeps valid until
// completion (Link's contract); one thread uses a link at a time.
unsafe impl Send for RdmaLink {}

impl RdmaLink {
    /// A link over the connected `qp` whose send completions go to `cq`
    /// (its own), writing from `regions` into the peer ring at `remote_base`
    /// (each write under its grant's rkey). At most `max_wr` requests
    /// outstanding (the QP's send queue size).
    pub fn new(qp: Qp, cq: Arc<Cq>, regions: SendRegions, remote_base: u64, max_wr: usize) -> Self {
        RdmaLink {
            qp,
            cq,
            regions,
            remote_base,
            max_wr,
            queued: Vec::with_capacity(max_wr),
            posted: VecDeque::with_capacity(max_wr),
            chain_ends: VecDeque::with_capacity(max_wr),
            signal_ids: Vec::with_capacity(max_wr),
            done: VecDeque::with_capacity(max_wr),
            inline_buf: vec![0u8; max_wr * (4 + RDMA_ERROR_BYTES)],
            sges: Vec::with_capacity(max_wr),
            wrs: Vec::with_capacity(max_wr),
            broken: None,
        }
    }

    /// Why the link stopped (a failed completion), if it did.
    pub fn error(&self) -> Option<&Error> {
        self.broken.as_ref()
    }

    /// Asks for an event on the CQ's completion channel at its next
    /// completion (the CQ must have been made with one).
    pub fn arm(&self) -> Result<()> {
        self.cq.arm()
    }

    /// Whether requests are posted and not yet completed.
    pub fn busy(&self) -> bool {
        !self.posted.is_empty()
    }

    /// Stops the link: the QP goes to the error state so the NIC touches
    /// none of the posted memory any more once their (flushed) completions
    /// are polled; what was queued and not posted fails now.
    pub fn close(&mut self) {
        if self.broken.is_none() {
            if let Err(e) = self.qp.set_error() {
                log::warn!("closing an RDMA link: {e}");
            }
            self.broken = Some(Error::Rdma {
                op: "link",
                detail: "closed".into(),
            });
        }
        for w in self.queued.drain(..) {
            self.done.push_back(super::Done {
                wr_id: w.wr_id,
                ok: false,
            });
        }
        if self.posted.is_empty() {
            self.chain_ends.clear();
        }
    }

    fn room(&self) -> bool {
        self.broken.is_none() && self.queued.len() + self.posted.len() < self.max_wr
    }

    fn fail_all(&mut self) {
        for id in self.posted.drain(..) {
            self.done.push_back(super::Done {
                wr_id: id,
                ok: false,
            });
        }
        self.chain_ends.clear();
        for w in self.queued.drain(..) {
            self.done.push_back(super::Done {
                wr_id: w.wr_id,
                ok: false,
            });
        }
    }
}

impl super::Link for RdmaLink {
    type Driver = ();

    /// # Safety
    /// As for [`super::Link::post_write`].
    unsafe fn post_write(
        &mut self,
        wr_id: u64,
        src: *const u8,
        len: u32,
        remote_offset: u64,
        grant: u32,
        rkey: u32,
    ) -> bool {
        if !self.room() {
            return false;
        }
        let Some(lkey) = self.regions.lkey(src as u64, len) else {
            // A caller bug, not a peer's doing: fail this request loudly.
            log::error!("RDMA write from unregistered memory {src:?}+{len}");
            self.done.push_back(super::Done { wr_id, ok: false });
            return true;
        };
        self.queued.push(RdmaWr {
            wr_id,
            send: false,
            src,
            len,
            lkey,
            remote: self.remote_base + remote_offset,
            rkey,
            imm: grant,
            inline_at: 0,
        });
        true
    }

    /// # Safety
    /// As for [`super::Link::post_error`].
    unsafe fn post_error(
        &mut self,
        wr_id: u64,
        grant: u32,
        code: super::proto::Code,
        msg: *const u8,
        len: u32,
    ) -> bool {
        if !self.room() {
            return false;
        }
        // The code and the (truncated) message go inline, so neither needs
        // registered memory; the slot in inline_buf is this request's until
        // the flush copies it (inline data is copied at post time).
        let slot = self.queued.len();
        let at = slot * (4 + RDMA_ERROR_BYTES);
        let n = (len as usize).min(RDMA_ERROR_BYTES);
        self.inline_buf[at..at + 4].copy_from_slice(&(code as u32).to_le_bytes());
        // SAFETY: msg is readable for len bytes (Link's contract); n <= len.
        let m = unsafe { std::slice::from_raw_parts(msg, n) };
        self.inline_buf[at + 4..at + 4 + n].copy_from_slice(m);
        self.queued.push(RdmaWr {
            wr_id,
            send: true,
            src: ptr::null(),
            len: 4 + n as u32,
            lkey: 0,
            remote: 0,
            rkey: 0,
            imm: grant,
            inline_at: at,
        });
        true
    }

    fn flush(&mut self, _: &mut ()) -> std::io::Result<()> {
        if self.queued.is_empty() || self.broken.is_some() {
            return Ok(());
        }
        self.sges.clear();
        self.wrs.clear();
        self.signal_ids.clear();
        for w in &self.queued {
            let addr = if w.send {
                self.inline_buf[w.inline_at..].as_ptr() as u64
            } else {
                w.src as u64
            };
            self.sges.push(ibv_sge {
                addr,
                length: w.len,
                lkey: w.lkey,
            });
        }
        let last = self.queued.len() - 1;
        for (i, w) in self.queued.iter().enumerate() {
            // SAFETY: plain data.
            let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
            wr.wr_id = w.wr_id;
            wr.sg_list = &mut self.sges[i];
            wr.num_sge = 1;
            wr.imm_data_invalidated_rkey_union.imm_data = w.imm.to_be();
            // Selective signalling: the last of the chain and every
            // SIGNAL_EVERY-th, so staging slots come back while a long
            // chain is still on the wire (one completion per chain would
            // hold every slot until its last write).
            let signal = i == last || (i + 1) % SIGNAL_EVERY == 0;
            if signal {
                self.signal_ids.push(w.wr_id);
            }
            let mut flags = if signal {
                ibv_send_flags::IBV_SEND_SIGNALED.0
            } else {
                0
            };
            if w.send {
                wr.opcode = ibv_wr_opcode::IBV_WR_SEND_WITH_IMM;
                flags |= ibv_send_flags::IBV_SEND_INLINE.0;
            } else {
                wr.opcode = ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM;
                wr.wr.rdma.remote_addr = w.remote;
                wr.wr.rdma.rkey = w.rkey;
            }
            wr.send_flags = flags;
            self.wrs.push(wr);
        }
        // SAFETY: the SGEs outlive the call; inline data is copied during
        // it; the written memory is valid until completion per Link's
        // contract.
        unsafe { self.qp.post_chain(&mut self.wrs) }?;
        for w in self.queued.drain(..) {
            self.posted.push_back(w.wr_id);
        }
        self.chain_ends.extend(self.signal_ids.drain(..));
        Ok(())
    }

    fn poll(&mut self, out: &mut [super::Done]) -> usize {
        let mut wc = [WorkCompletion::default(); 16];
        while let Ok(n) = self.cq.poll(&mut wc) {
            if n == 0 {
                break;
            }
            for c in &wc[..n] {
                if let Err(e) = c.check() {
                    // The QP is in error: whatever is still posted was not
                    // (or not wholly) sent and the NIC is done with it.
                    if self.broken.is_none() {
                        log::warn!("RDMA link failed: {e}");
                        self.broken = Some(e);
                    }
                    self.fail_all();
                    continue;
                }
                // A signalled completion finishes every request up to it
                // (a QP completes its send queue in order).
                if self.chain_ends.front() == Some(&c.wr_id) {
                    self.chain_ends.pop_front();
                    while let Some(id) = self.posted.pop_front() {
                        self.done.push_back(super::Done {
                            wr_id: id,
                            ok: true,
                        });
                        if id == c.wr_id {
                            break;
                        }
                    }
                }
            }
        }
        let n = out.len().min(self.done.len());
        for slot in out.iter_mut().take(n) {
            *slot = self.done.pop_front().expect("counted");
        }
        n
    }
}
