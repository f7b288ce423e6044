//! `RdmaRx`: the RDMA data path. A node WRITE_WITH_IMMs each sample into
//! the landing ring, registered for remote write (immediate = grant id),
//! and SENDs a grant's ERROR on the same queue pair, so it cannot overtake
//! the grant's writes. Completions and ERROR messages come on the
//! connection's completion queue, which wakes the network thread through
//! one completion channel for all connections.
//!
//! Windows mode (the device has type 2B memory windows): the ring is
//! registered for local write and window binding only, so its own rkey
//! opens nothing remotely; each grant gets a window bound through the
//! owner's QP to exactly the granted range, its rkey goes in the GRANT
//! entry, and the window is invalidated once the grant is done (or failed)
//! and before the sample is published or granted again.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;

use super::{ConnectError, Event, Landed, Receive, NONE};
use crate::error::{Error, Result};
use crate::landing::LandingRing;
use crate::transport::proto::{self, Code, Header, Hello, Kind};
use crate::transport::rdma::{
    self, completion_error, next_rkey, Access, CompChannel, Context, Cq, Mr, Mw, Pd, Qp, RecvWr,
    VerbsQueue, WindowOp, WorkCompletion, WorkQueue,
};

/// How many receives an RDMA connection keeps posted: every WRITE_WITH_IMM
/// consumes one (too few only slows the owner down: it retries on RNR).
const RDMA_RECVS: usize = 1024;
/// Receive buffer size: an ERROR message (code + up to 128 bytes).
const RDMA_RECV_BYTES: usize = 4 + crate::transport::rdma::RDMA_ERROR_BYTES;
/// Memory windows per RDMA connection (windows mode): one per grant
/// outstanding with that node, so also the most grants it has outstanding.
/// Each window has at most one request (a bind or an invalidation) on the
/// QP's send queue at a time, so the send queue (`RDMA_RECVS` deep) never
/// fills.
const RDMA_WINDOWS: usize = 256;
/// Send-queue completions carry this bit in their wr_id (receives carry
/// their buffer slot, below `RDMA_RECVS`).
const WR_SEND: u64 = 1 << 63;
/// A bind chain's last request (the GRANT frame waits for it).
const WR_BIND: u64 = WR_SEND | 1 << 62;
/// An invalidation: the low 32 bits name the window.
const WR_INV: u64 = WR_SEND | 1 << 61;

/// A loader's verbs resources for one launch: the device, a protection
/// domain, the completion channel every connection's CQ wakes, and the
/// landing ring's registration.
///
/// Windows mode (the device has type 2B memory windows): the ring is
/// registered for local write and window binding only, so its own rkey opens
/// nothing remotely; each grant gets a window bound through the owner's QP to
/// exactly the granted range, its rkey goes in the GRANT entry, and the
/// window is invalidated once the grant is done (or failed) and before the
/// sample is published or granted again. Otherwise the whole ring is
/// registered for remote write (exactly its range) and every grant carries
/// that rkey: said once at WARN.
pub(crate) struct ConsumerRdma {
    opts: crate::transport::RdmaOptions,
    ring_mr: rdma::Mr,
    /// Per-grant memory windows (see above).
    windows: bool,
    /// A GPU ring's dma-buf, kept open while it is registered.
    _dmabuf: Option<std::os::fd::OwnedFd>,
    channel: Arc<rdma::CompChannel>,
    pd: Arc<rdma::Pd>,
    ctx: Arc<rdma::Context>,
}

impl ConsumerRdma {
    fn open(opts: &crate::transport::RdmaOptions, ring: &LandingRing) -> Result<Self> {
        let ctx = Context::open(opts.device.as_deref(), opts.port, opts.gid_index)?;
        let pd = Pd::new(&ctx)?;
        let channel = CompChannel::new(&ctx)?;
        let windows = match windows_usable(&ctx, &pd, ring) {
            Ok(()) => true,
            Err(why) => {
                log::warn!(
                    "RDMA: no per-grant memory windows ({why}); the whole landing ring is \
                     registered for remote write under one key, so a node holding the job \
                     token could write anywhere in it (docs/PROTOCOL.md, \"Over RDMA\")"
                );
                false
            }
        };
        let (ring_mr, dmabuf) = match ring.device() {
            // SAFETY: the ring outlives this registration (the network thread
            // owns it and drops it before its Arc of the ring); peers write it
            // only at granted ranges the consumer does not read until published
            // (in windows mode only through windows bound to those ranges).
            None => (
                unsafe {
                    Mr::register(
                        &pd,
                        ring.as_mut_ptr(),
                        ring.len(),
                        if windows {
                            Access::WindowsOnly
                        } else {
                            Access::RemoteWrite
                        },
                    )
                }?,
                None,
            ),
            Some(dev) => register_gpu_ring(&pd, dev)?,
        };
        Ok(ConsumerRdma {
            opts: opts.clone(),
            ring_mr,
            windows,
            _dmabuf: dmabuf,
            channel,
            pd,
            ctx,
        })
    }
}

/// Whether grants get memory windows: the device offers type 2B windows
/// (probed: capability flag, `max_mw`, and one allocated), the ring is host
/// memory (a GPU ring keeps the whole-ring key), and `KSPEED_RDMA_WINDOWS`
/// is not `0` (a switch to measure the windows' cost against the whole-ring
/// key; docs/PROTOCOL.md). `Err` says why not.
fn windows_usable(
    ctx: &rdma::Context,
    pd: &Arc<rdma::Pd>,
    ring: &LandingRing,
) -> std::result::Result<(), String> {
    if std::env::var_os("KSPEED_RDMA_WINDOWS").is_some_and(|v| v == "0") {
        return Err("KSPEED_RDMA_WINDOWS=0".into());
    }
    if ring.device().is_some() {
        return Err("the landing ring is GPU memory".into());
    }
    ctx.windows_supported(RDMA_WINDOWS)?;
    rdma::Mw::new(pd).map(drop).map_err(|e| e.to_string())
}

/// Registers a GPU ring for remote write: as a dma-buf where the NIC's
/// driver can register one (the fd is returned, to be kept open), else by
/// its device address, which a peer-memory module (nvidia-peermem) lets
/// ibv_reg_mr pin. Both failing is one error giving both reasons.
fn register_gpu_ring(
    pd: &Arc<rdma::Pd>,
    dev: &crate::landing::cuda::DeviceMemory,
) -> Result<(rdma::Mr, Option<std::os::fd::OwnedFd>)> {
    let as_dmabuf = dev.export_dmabuf().and_then(|fd| {
        // SAFETY: the dma-buf stays open (returned to the caller, who keeps
        // it) and the memory allocated for as long as the ring lives.
        let mr = unsafe {
            Mr::register_dmabuf(
                pd,
                fd.as_raw_fd(),
                0,
                dev.len(),
                dev.addr(),
                Access::RemoteWrite,
            )
        }
        .map_err(|e| e.to_string())?;
        Ok((mr, fd))
    });
    let first = match as_dmabuf {
        Ok((mr, fd)) => {
            log::info!("GPU ring registered for RDMA as a dma-buf");
            return Ok((mr, Some(fd)));
        }
        Err(e) => e,
    };
    // SAFETY: the address and length are the GPU allocation's, alive for as
    // long as the ring; a peer-memory client pins it, and peers write it only
    // at granted ranges.
    match unsafe { Mr::register(pd, dev.addr() as *mut u8, dev.len(), Access::RemoteWrite) } {
        Ok(mr) => {
            log::info!(
                "GPU ring registered for RDMA by address (peer memory); as a dma-buf it was not: {first}"
            );
            Ok((mr, None))
        }
        Err(second) => Err(Error::Rdma {
            op: "register the GPU ring",
            detail: format!(
                "as a dma-buf: {first}; by address (needs a peer-memory module such as \
                 nvidia-peermem): {second}"
            ),
        }),
    }
}

/// One connection's RDMA end: its QP and CQ, behind [`WorkQueue`] for the
/// receives and the completions (the memory-window binds and
/// invalidations go to the QP itself: the interface does not carry them),
/// and the receive buffers for ERROR messages (receives are posted in order
/// and complete in order, so the buffers are used round-robin and re-posted
/// in bulk).
pub(crate) struct RdmaRx {
    queue: VerbsQueue,
    bufs_mr: rdma::Mr,
    bufs: Box<[u8]>,
    /// Receives completed and not re-posted yet, and the slot of the first.
    consumed: usize,
    next_slot: usize,
    /// The receive chain `repost` builds (sized once).
    rwrs: Vec<RecvWr>,
    /// Windows mode: the windows, the rkey each was last bound under, the
    /// table entry each opens (`NONE` when free), the free ones.
    mws: Vec<rdma::Mw>,
    mw_rkey: Vec<u32>,
    mw_entry: Vec<u32>,
    free_mws: Vec<u32>,
    /// (window, ring offset, length) of the grants in the connection's
    /// `fill` frame: bound (one chain) before that frame is sent.
    binds: Vec<(u32, u64, u64)>,
    /// A bind chain is posted; the frame in `flight` waits for it.
    bind_pending: bool,
    /// Invalidations posted and not completed.
    invs_pending: usize,
    swrs: Vec<rdma_sys::ibv_send_wr>,
    /// The last poll's completions.
    wc: [WorkCompletion; 32],
    /// Last: the ring's registration outlives the windows bound to it.
    r: Arc<ConsumerRdma>,
}

impl Drop for RdmaRx {
    fn drop(&mut self) {
        // Windows before their QP: soft-RoCE (Linux 6.1) took 50.6 s to
        // destroy a QP that 8 bound windows still referenced (measured in
        // the VM; 0.5 ms to free the windows first), and a dead node's QP is
        // destroyed on the network thread.
        self.mws.clear();
    }
}

// SAFETY: `swrs` is scratch space whose raw pointers are rebuilt on every
// post and never outlive it; the verbs objects may be used from any
// thread, and one thread at a time uses a connection.
unsafe impl Send for RdmaRx {}

impl RdmaRx {
    /// Re-posts the receives consumed so far (one or two chains). A chain
    /// refused part-way (`bad_wr`) still posted the receives before it:
    /// they count as re-posted, so no buffer is ever posted twice.
    fn repost(&mut self) -> Result<()> {
        while self.consumed > 0 {
            let first = (self.next_slot + RDMA_RECVS - self.consumed) % RDMA_RECVS;
            let n = self.consumed.min(RDMA_RECVS - first);
            let posted = post_recv_slots(
                &mut self.queue,
                &mut self.rwrs,
                first,
                n,
                self.bufs.as_ptr() as u64,
                self.bufs_mr.lkey(),
            );
            self.consumed -= posted.as_ref().map_or_else(|(k, _)| *k, |()| n);
            posted.map_err(|(_, error)| Error::Rdma {
                op: "post receives",
                detail: error.to_string(),
            })?;
        }
        Ok(())
    }
}

/// Posts receives for buffer slots `first..first + n` of the buffers at
/// `base` (`RDMA_RECV_BYTES` each, under `lkey`), each slot its wr_id, as
/// one chain built in `rwrs`; `Err` says how many were posted before the
/// queue refused one.
fn post_recv_slots<Q: WorkQueue>(
    queue: &mut Q,
    rwrs: &mut Vec<RecvWr>,
    first: usize,
    n: usize,
    base: u64,
    lkey: u32,
) -> std::result::Result<(), (usize, std::io::Error)> {
    rwrs.clear();
    rwrs.extend((first..first + n).map(|slot| RecvWr {
        wr_id: slot as u64,
        addr: base + (slot * RDMA_RECV_BYTES) as u64,
        len: RDMA_RECV_BYTES as u32,
        lkey,
    }));
    // SAFETY: the buffers live next to (and are dropped after) the queue
    // that receives into them, and are read only after their completion.
    unsafe { queue.post_recv(rwrs) }.map_err(|e| (e.posted, e.error))
}

impl RdmaRx {
    fn qp(&self) -> &Qp {
        self.queue.qp()
    }
}

/// After WELCOME over RDMA: creates this connection's QP (on the GID of the
/// address the control connection leaves from, unless one is configured),
/// swaps endpoints with the owner, connects, and posts the receives.
fn connect(
    r: &Arc<ConsumerRdma>,
    sock: &mut TcpStream,
    node: u32,
    addr: &str,
) -> Result<RdmaRx, ConnectError> {
    let failed = |e: Error| ConnectError::Refused(e);
    let violation = |what: String| {
        ConnectError::Refused(Error::ProtocolViolation {
            node,
            addr: addr.to_string(),
            what,
        })
    };
    let cq = Cq::with_channel(&r.ctx, (RDMA_RECVS + RDMA_WINDOWS + 64) as i32, &r.channel)
        .map_err(failed)?;
    let mut qp = Qp::new(&r.pd, &cq, &cq, RDMA_RECVS as u32, 0).map_err(failed)?;
    let ip = sock
        .local_addr()
        .map_err(|e| ConnectError::Unreachable(format!("local address: {e}")))?
        .ip();
    let (index, gid) = r.ctx.choose_gid(r.opts.gid_index, ip).map_err(failed)?;
    qp.use_gid(index, gid);
    sock.write_all(&qp.endpoint().encode())
        .map_err(|e| ConnectError::Unreachable(format!("send RDMA_ENDPOINT: {e}")))?;
    let mut hb = [0u8; proto::HEADER_BYTES];
    sock.read_exact(&mut hb)
        .map_err(|e| ConnectError::Unreachable(format!("no RDMA_ENDPOINT: {e}")))?;
    let h = Header::decode(&hb, 0).map_err(|e| violation(e.to_string()))?;
    let mut body = vec![0u8; h.body_len as usize];
    sock.read_exact(&mut body)
        .map_err(|e| ConnectError::Unreachable(format!("truncated answer: {e}")))?;
    if h.kind == Kind::Error {
        return Err(ConnectError::Refused(Error::Refused {
            node,
            addr: addr.to_string(),
            code: Code::from_u32(h.b).name(),
            message: String::from_utf8_lossy(&body).into_owned(),
        }));
    }
    let theirs = proto::RdmaEndpoint::decode(&h, &body).map_err(|e| violation(e.to_string()))?;
    qp.connect(&theirs).map_err(failed)?;
    let mut bufs = vec![0u8; RDMA_RECVS * RDMA_RECV_BYTES].into_boxed_slice();
    // SAFETY: the buffers live in the RdmaConn next to (and dropped after)
    // the QP that receives into them.
    let bufs_mr = unsafe { Mr::register(&r.pd, bufs.as_mut_ptr(), bufs.len(), Access::Local) }
        .map_err(failed)?;
    let mut c = RdmaRx {
        queue: VerbsQueue::new(qp, cq, RDMA_RECVS),
        bufs_mr,
        bufs,
        consumed: RDMA_RECVS,
        next_slot: 0,
        rwrs: Vec::with_capacity(RDMA_RECVS),
        mws: Vec::new(),
        mw_rkey: Vec::new(),
        mw_entry: Vec::new(),
        free_mws: Vec::new(),
        binds: Vec::new(),
        bind_pending: false,
        invs_pending: 0,
        swrs: Vec::with_capacity(proto::MAX_GRANT_ENTRIES.min(RDMA_WINDOWS)),
        wc: [WorkCompletion::default(); 32],
        r: r.clone(),
    };
    if r.windows {
        for m in 0..RDMA_WINDOWS {
            let mw = Mw::new(&r.pd).map_err(failed)?;
            c.mw_rkey.push(mw.rkey());
            c.mws.push(mw);
            c.mw_entry.push(NONE);
            c.free_mws.push((RDMA_WINDOWS - 1 - m) as u32);
        }
        c.binds.reserve_exact(RDMA_WINDOWS);
    }
    c.repost().map_err(failed)?;
    c.queue.arm().map_err(failed)?;
    Ok(c)
}

impl RdmaRx {
    /// Opens the verbs resources of a launch (see [`ConsumerRdma`]) and
    /// puts the ring's address, key (none in windows mode: each GRANT entry
    /// carries its window's) and the RDMA transport in `hello`.
    pub(super) fn open(
        opts: &crate::transport::RdmaOptions,
        ring: &LandingRing,
        hello: &mut Hello,
    ) -> Result<Arc<ConsumerRdma>> {
        let r = Arc::new(ConsumerRdma::open(opts, ring)?);
        hello.ring_addr = r.ring_mr.addr();
        // Windows mode: no key for the whole ring; each GRANT entry
        // carries its window's.
        hello.rkey = if r.windows { 0 } else { r.ring_mr.rkey() };
        hello.transport = proto::TRANSPORT_RDMA;
        Ok(r)
    }

    /// What receive completion `w` carried: an RDMA write into a granted
    /// range (immediate = grant id), or an ERROR sent on the QP.
    fn landed(&self, w: &WorkCompletion) -> Landed {
        use rdma_sys::ibv_wc_opcode::{IBV_WC_RECV, IBV_WC_RECV_RDMA_WITH_IMM};
        let Some(grant) = w.imm else {
            return Landed::Violation("an RDMA completion without immediate data".into());
        };
        match w.opcode {
            IBV_WC_RECV_RDMA_WITH_IMM => Landed::Wrote {
                grant,
                bytes: w.byte_len,
            },
            IBV_WC_RECV => {
                let at = w.wr_id as usize * RDMA_RECV_BYTES;
                let n = (w.byte_len as usize).min(RDMA_RECV_BYTES);
                if n < 4 || at + n > self.bufs.len() {
                    return Landed::Violation(format!("an RDMA ERROR message of {n} bytes"));
                }
                let b = &self.bufs[at..at + n];
                let code = u32::from_le_bytes(b[..4].try_into().expect("4 bytes"));
                let msg = String::from_utf8_lossy(&b[4..]).into_owned();
                Landed::Error { grant, code, msg }
            }
            op => Landed::Violation(format!("unexpected RDMA completion opcode {op}")),
        }
    }
}

impl Receive for RdmaRx {
    type Common = Arc<ConsumerRdma>;
    const FRAMED: bool = false;

    /// A reconnect sets up a new queue pair on the same device, protection
    /// domain, ring registration and completion channel, as the start's
    /// connect threads do.
    fn redial_common(common: &Arc<ConsumerRdma>) -> Option<Arc<ConsumerRdma>> {
        Some(common.clone())
    }

    fn connect(
        common: &Arc<ConsumerRdma>,
        sock: &mut TcpStream,
        node: u32,
        addr: &str,
    ) -> Result<Self, ConnectError> {
        connect(common, sock, node, addr)
    }

    fn wake_fd(common: &Arc<ConsumerRdma>) -> Option<RawFd> {
        Some(common.channel.fd())
    }

    fn woke(common: &Arc<ConsumerRdma>) {
        common.channel.drain();
    }

    fn open(&mut self, entry: usize, phys: u64, len: u32) -> Option<(u32, u32)> {
        if !self.r.windows {
            return Some((self.r.ring_mr.rkey(), NONE));
        }
        // A window for exactly this range, bound (with the rest of the
        // frame's) before the frame goes out.
        let m = self.free_mws.pop()?;
        let k = next_rkey(self.mw_rkey[m as usize]);
        self.mw_rkey[m as usize] = k;
        self.mw_entry[m as usize] = entry as u32;
        self.binds.push((m, phys, len as u64));
        Some((k, m))
    }

    /// Binds the windows of the GRANT frame about to go, as one chain; the
    /// frame goes once the chain completes ([`Event::Flushed`]), so no
    /// write can arrive before its window.
    fn flush(&mut self) -> Result<bool> {
        if self.binds.is_empty() {
            return Ok(false);
        }
        let base = self.r.ring_mr.addr();
        let (mws, mw_rkey) = (&self.mws, &self.mw_rkey);
        let binds = self
            .binds
            .iter()
            .map(|&(m, off, len)| (&mws[m as usize], base + off, len, mw_rkey[m as usize]));
        let res = self
            .queue
            .qp()
            .post_binds(&self.r.ring_mr, binds, WR_BIND, &mut self.swrs);
        for &(m, _, _) in &self.binds {
            self.mws[m as usize].set_rkey(self.mw_rkey[m as usize]);
        }
        self.binds.clear();
        res?;
        self.bind_pending = true;
        Ok(true)
    }

    fn flushing(&self) -> bool {
        self.bind_pending
    }

    /// Invalidates window `m`: [`Event::Closed`] once done.
    fn close(&mut self, m: u32) -> Result<()> {
        let rkey = self.mw_rkey[m as usize];
        let op = WindowOp::Invalidate { rkey };
        self.queue
            .qp()
            .post_window_ops(&[(WR_INV | m as u64, true, op)], &mut self.swrs)?;
        self.invs_pending += 1;
        Ok(())
    }

    /// The QP goes to the error state: it accepts no write from now on.
    fn shut(&self) -> Result<()> {
        self.qp().set_error()
    }

    fn idle(&self) -> bool {
        !self.bind_pending && self.invs_pending == 0
    }

    fn arm(&self) -> Result<()> {
        self.queue.arm()
    }

    fn poll(&mut self) -> Result<usize> {
        let n = self.queue.poll(&mut self.wc)?;
        let recvs = self.wc[..n]
            .iter()
            .filter(|w| w.wr_id & WR_SEND == 0)
            .count();
        self.consumed += recvs;
        self.next_slot = (self.next_slot + recvs) % RDMA_RECVS;
        Ok(n)
    }

    fn take(&mut self, k: usize) -> Event {
        let w = self.wc[k];
        if w.status != 0 {
            let e = completion_error(&w);
            let what = match w.wr_id {
                WR_BIND => "binding memory windows failed",
                id if id & WR_INV == WR_INV => "invalidating a memory window failed",
                _ => "RDMA queue pair failed",
            };
            return Event::Failed(format!("{what}: {e}"));
        }
        if w.wr_id & WR_SEND != 0 {
            // The bind chain is in force (send the GRANT frame waiting for
            // it), or a window is invalidated (free it, and finish its
            // grant).
            if w.wr_id == WR_BIND {
                self.bind_pending = false;
                return Event::Flushed;
            }
            let m = (w.wr_id & 0xffff_ffff) as usize;
            let entry = std::mem::replace(&mut self.mw_entry[m], NONE);
            self.free_mws.push(m as u32);
            self.invs_pending -= 1;
            return Event::Closed {
                window: m as u32,
                entry,
            };
        }
        Event::Received(self.landed(&w))
    }

    fn refill(&mut self) -> Result<()> {
        if self.consumed >= RDMA_RECVS / 8 {
            self.repost()?;
        }
        Ok(())
    }
}
