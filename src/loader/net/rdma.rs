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
//!
//! A node agent's shared link (`hub.rs`, `lanes.rs`) carries several rank
//! rings: each is registered as its lane joins ([`Receive::register_ring`]),
//! its windows bind over that registration (the queue's region `lane + 1`),
//! and its grants' offsets are absolute (`lanes::SHARED_RING_BASE`).
//!
//! Why this file is over ~800 lines: the verbs resources of a launch, a
//! connection's setup and its data path (windows, receives, completions)
//! are one lifecycle, kept in order of teardown; the queue itself is in
//! `transport::rdma`.

use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;

use super::cqs::{SharedCqs, TAG_MASK};
use super::recvs::SharedRecvs;
use super::{ConnectError, Event, Landed, Receive, NONE};
use crate::error::{Error, Result};
use crate::landing::LandingRing;
use crate::transport::proto::{self, Code, Header, Hello, Kind};
use crate::transport::rdma::{
    self, completion_error, next_rkey, Access, CompChannel, Context, Cq, Mr, Mw, MwOp, MwWr, Pd,
    Qp, RecvWr, VerbsQueue, WorkCompletion, WorkQueue,
};

pub use super::recvs::{RDMA_RECVS, RDMA_RECV_BYTES, SRQ_RECVS_MAX};
/// Memory windows per RDMA connection (windows mode): one per grant
/// outstanding with that node, so also the most grants it has outstanding.
/// Each window has at most one request (a bind or an invalidation) on the
/// QP's send queue at a time, so the send queue (`RDMA_RECVS` deep) never
/// fills.
pub const RDMA_WINDOWS: usize = 256;
/// Entries of a connection's one CQ: a completion for every posted
/// receive and every window's one request, and room for SENDs.
pub const CONSUMER_CQ_ENTRIES: usize = RDMA_RECVS + RDMA_WINDOWS + 64;
/// A link's entries of a shared CQ where the receives are the thread's
/// SRQ's: its send queue's (a request per window) and some room.
pub const LINK_SEND_CQ_ENTRIES: usize = RDMA_WINDOWS + 64;
/// Send-queue completions carry this bit in their wr_id (receives carry
/// their buffer slot, below `RDMA_RECVS`).
const WR_SEND: u64 = 1 << 63;
/// A bind chain's last request (the GRANT frame waits for it).
const WR_BIND: u64 = WR_SEND | 1 << 62;
/// An invalidation: the low 32 bits name the window. They go in chains,
/// one per network-thread tick, only the last signalled (as the binds).
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
    /// Shared with each connection's queue, whose windows bind over it (a
    /// node agent's shared links: a page of `_placeholder`, over which
    /// nothing is bound; each rank's ring is registered as it joins).
    ring_mr: Arc<rdma::Mr>,
    /// The page a shared link's `ring_mr` registers (after it: freed
    /// after the registration).
    _placeholder: Option<Box<[u8]>>,
    /// Per-grant memory windows (see above).
    windows: bool,
    /// A GPU ring's dma-buf, kept open while it is registered.
    _dmabuf: Option<std::os::fd::OwnedFd>,
    channel: Arc<rdma::CompChannel>,
    /// The CQs the links share (`cqs.rs`); `None`: each link has its own.
    cqs: Option<SharedCqs>,
    /// The receives the links share (`recvs.rs`; only with shared CQs);
    /// `None`: each link posts its own.
    recvs: Option<SharedRecvs>,
    pd: Arc<rdma::Pd>,
    ctx: Arc<rdma::Context>,
}

impl ConsumerRdma {
    fn open(
        opts: &crate::transport::RdmaOptions,
        ring: &LandingRing,
        nodes: usize,
    ) -> Result<Self> {
        let ctx = Context::open(opts.device.as_deref(), opts.port, opts.gid_index)?;
        let pd = Pd::new(&ctx)?;
        let channel = CompChannel::new(&ctx)?;
        let (cqs, recvs) = shared_queues(&ctx, &pd, &channel, nodes)?;
        let windows = match windows_usable(&ctx, &pd, Some(ring)) {
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
            ring_mr: Arc::new(ring_mr),
            _placeholder: None,
            windows,
            _dmabuf: dmabuf,
            channel,
            cqs,
            recvs,
            pd,
            ctx,
        })
    }
}

impl ConsumerRdma {
    /// A node agent's shared links (`hub.rs`): the device, a protection
    /// domain and the completion channel, no ring yet (each joining rank's
    /// is registered as a lane, [`Receive::register_ring`]). Needs memory
    /// windows: one key per ring cannot open several rings to one link.
    fn open_shared(opts: &crate::transport::RdmaOptions, nodes: usize) -> Result<Self> {
        let ctx = Context::open(opts.device.as_deref(), opts.port, opts.gid_index)?;
        let pd = Pd::new(&ctx)?;
        let channel = CompChannel::new(&ctx)?;
        let (cqs, recvs) = shared_queues(&ctx, &pd, &channel, nodes)?;
        if let Err(why) = windows_usable(&ctx, &pd, None) {
            return Err(Error::Rdma {
                op: "share the agent's links",
                detail: format!(
                    "no memory windows ({why}); give each rank its own links \
                     (KSPEED_AGENT_LINKS=per-rank)"
                ),
            });
        }
        let mut page = vec![0u8; 4096].into_boxed_slice();
        // SAFETY: the page lives in this struct, freed after the
        // registration (field order); it is registered for binding only
        // and no window is ever bound over it.
        let ring_mr =
            unsafe { Mr::register(&pd, page.as_mut_ptr(), page.len(), Access::WindowsOnly) }?;
        Ok(ConsumerRdma {
            opts: opts.clone(),
            ring_mr: Arc::new(ring_mr),
            _placeholder: Some(page),
            windows: true,
            _dmabuf: None,
            channel,
            cqs,
            recvs,
            pd,
            ctx,
        })
    }
}

/// The CQs and receives a thread's links to `nodes` nodes share: CQs
/// unless the device's are too small or `KSPEED_RDMA_SHARED_CQ=0`
/// (`cqs.rs`), and with them one SRQ unless the device has none or
/// `KSPEED_RDMA_SRQ=0` (`recvs.rs`). With the SRQ a link's CQ entries are
/// its send queue's (a request per window, and some more) and the CQ
/// takes the SRQ's depth once, since any of its links may take every
/// receive.
fn shared_queues(
    ctx: &Arc<Context>,
    pd: &Arc<Pd>,
    channel: &Arc<CompChannel>,
    nodes: usize,
) -> Result<(Option<SharedCqs>, Option<SharedRecvs>)> {
    let srq_off = std::env::var_os("KSPEED_RDMA_SRQ").is_some_and(|v| v == "0");
    let depth = match ctx.max_srq_wr() {
        _ if srq_off => None,
        Some(max) => Some(super::recvs::srq_depth(nodes, max)),
        None => {
            log::info!("RDMA: the device has no shared receive queues; each link posts its own");
            None
        }
    };
    let per_link = if depth.is_some() {
        LINK_SEND_CQ_ENTRIES
    } else {
        CONSUMER_CQ_ENTRIES
    };
    let Some(cqs) = SharedCqs::new(ctx, channel, nodes, per_link, depth.unwrap_or(0))? else {
        // Each link's own CQ takes its own receives' completions.
        return Ok((None, None));
    };
    let recvs = match depth.map(|d| SharedRecvs::new(pd, d)).transpose() {
        Ok(r) => r,
        Err(e) => {
            // Each link posts its own, on CQs sized for them.
            log::warn!("RDMA: no shared receive queue ({e}); each link posts its own receives");
            let cqs = SharedCqs::new(ctx, channel, nodes, CONSUMER_CQ_ENTRIES, 0)?;
            return Ok((cqs, None));
        }
    };
    let (n, per) = cqs.shape();
    log::info!(
        "RDMA: the network thread's links to {nodes} nodes share {n} CQ(s) ({per} links a CQ) \
         and {}",
        recvs
            .as_ref()
            .map_or("post their own receives".to_string(), |r| format!(
                "one shared receive queue of {} receives",
                r.depth()
            ))
    );
    Ok((Some(cqs), recvs))
}

/// Whether a node agent can share its RDMA links among its ranks: the
/// device `opts` names has memory windows (`Err`: why not).
pub(crate) fn shared_links_usable(
    opts: &crate::transport::RdmaOptions,
) -> std::result::Result<(), String> {
    let ctx = Context::open(opts.device.as_deref(), opts.port, opts.gid_index)
        .map_err(|e| e.to_string())?;
    let pd = Pd::new(&ctx).map_err(|e| e.to_string())?;
    windows_usable(&ctx, &pd, None)
}

/// Whether grants get memory windows: the device offers type 2B windows
/// (probed: capability flag, `max_mw`, and one allocated), the ring is host
/// memory (a GPU ring keeps the whole-ring key), and `KSPEED_RDMA_WINDOWS`
/// is not `0` (a switch to measure the windows' cost against the whole-ring
/// key; docs/PROTOCOL.md). `Err` says why not.
fn windows_usable(
    ctx: &rdma::Context,
    pd: &Arc<rdma::Pd>,
    ring: Option<&LandingRing>,
) -> std::result::Result<(), String> {
    if std::env::var_os("KSPEED_RDMA_WINDOWS").is_some_and(|v| v == "0") {
        return Err("KSPEED_RDMA_WINDOWS=0".into());
    }
    if ring.is_some_and(|r| r.device().is_some()) {
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

/// One connection's RDMA end: its queues behind [`WorkQueue`] (the real
/// QP's, [`VerbsQueue`], with the connection's memory windows; the
/// simulation's, `crate::sim::rdma`, in memory), and the receive buffers
/// for ERROR messages (receives are posted in order and complete in order,
/// so the buffers are used round-robin and re-posted in bulk).
///
/// Windows mode: each window has at most one request (a bind or an
/// invalidation) on the send queue at a time, so the send queue
/// (`RDMA_RECVS` deep) never fills; a window is bound (advancing its key)
/// only once its invalidation completed, and the GRANT frame naming it
/// goes only once its bind completed.
pub(crate) struct RdmaRx<Q: WorkQueue = VerbsQueue> {
    /// First: the QP is destroyed before the memory it receives into.
    queue: Q,
    /// ORed into the wr_id of every request it posts (0: its queue has a
    /// CQ of its own): its link on a CQ the thread's links share
    /// (`cqs.rs`).
    tag: u64,
    /// Its QP's number where it receives from the thread's SRQ (whose
    /// completions name it: `recvs.rs`; no buffers of its own then); 0:
    /// it posts its own receives.
    qpn: u32,
    /// Receives completed and not re-posted yet, and the slot of the first.
    consumed: usize,
    next_slot: usize,
    /// The receive chain `repost` builds (sized once).
    rwrs: Vec<RecvWr>,
    /// The ring's address, and the key every grant carries when there are
    /// no windows.
    ring_addr: u64,
    ring_rkey: u32,
    /// A node agent's shared link: each lane's ring address by lane index
    /// (0: none), its windows bound over region `lane + 1` of the queue
    /// ([`Receive::set_ring`]); empty on a loader's own link.
    lane_addrs: Vec<u64>,
    /// Windows mode: the rkey each window was last bound under, the table
    /// entry each opens (`NONE` when free), the free ones. Empty: no
    /// windows.
    mw_rkey: Vec<u32>,
    mw_entry: Vec<u32>,
    free_mws: Vec<u32>,
    /// The binds of the grants in the connection's `fill` frame: posted
    /// (one chain) before that frame is sent.
    binds: Vec<MwWr>,
    /// A bind chain is posted; the frame in `flight` waits for it.
    bind_pending: bool,
    /// Invalidations queued or posted, not completed.
    invs_pending: usize,
    /// Invalidations queued by `close` since the last `flush_closes`.
    invs: Vec<MwWr>,
    /// Windows of the invalidation chains posted, oldest first, and each
    /// chain's length: the send queue runs them in order, so a chain's
    /// (signalled) last completion closes its whole chain.
    inv_posted: std::collections::VecDeque<u32>,
    inv_chains: std::collections::VecDeque<u32>,
    /// Windows of the chain that completed last, with the entries they
    /// opened: read by `take_closed` after [`Event::Closed`].
    closed: Vec<(u32, u32)>,
    /// The last poll's completions.
    wc: [WorkCompletion; 32],
    /// The real queue's: the buffers' registration and the launch's verbs
    /// resources, dropped after the queue and before the buffers (None in
    /// the simulation, whose device registers the buffers itself).
    _verbs: Option<(Option<rdma::Mr>, Arc<ConsumerRdma>)>,
    /// The receive buffers and their key (a Vec, not a Box: the device
    /// writes them through the addresses posted, and a Box is retagged as
    /// unique whenever it moves, which Miri counts against those writes).
    bufs: Vec<u8>,
    bufs_lkey: u32,
}

impl<Q: WorkQueue> RdmaRx<Q> {
    /// The data path over `queue` (connected): `bufs` (`RDMA_RECVS` ×
    /// `RDMA_RECV_BYTES`, registered under `bufs_lkey`) receive ERROR
    /// messages; the ring is at `ring_addr`. Windows mode when
    /// `window_rkeys` holds the current keys of the queue's windows (at
    /// most `RDMA_WINDOWS`); else every grant carries `ring_rkey`. `tag`
    /// goes in every request's wr_id (0: none; `cqs.rs`). Posts the
    /// receives.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn on(
        queue: Q,
        tag: u64,
        bufs: Vec<u8>,
        bufs_lkey: u32,
        ring_addr: u64,
        ring_rkey: u32,
        window_rkeys: &[u32],
    ) -> Result<Self> {
        assert_eq!(tag & !TAG_MASK, 0, "tag {tag:#x}");
        // No buffers: it receives from the thread's SRQ (`recvs.rs`).
        assert!(
            bufs.is_empty() || bufs.len() == RDMA_RECVS * RDMA_RECV_BYTES,
            "receive buffers"
        );
        let own_recvs = if bufs.is_empty() { 0 } else { RDMA_RECVS };
        let n = window_rkeys.len();
        assert!(n <= RDMA_WINDOWS, "{n} windows");
        let mut c = RdmaRx {
            queue,
            tag,
            qpn: 0,
            consumed: own_recvs,
            next_slot: 0,
            rwrs: Vec::with_capacity(RDMA_RECVS),
            ring_addr,
            ring_rkey,
            lane_addrs: Vec::new(),
            mw_rkey: window_rkeys.to_vec(),
            mw_entry: vec![NONE; n],
            free_mws: (0..n as u32).rev().collect(),
            binds: Vec::with_capacity(n),
            bind_pending: false,
            invs_pending: 0,
            invs: Vec::with_capacity(n),
            inv_posted: std::collections::VecDeque::with_capacity(n),
            inv_chains: std::collections::VecDeque::with_capacity(n),
            closed: Vec::with_capacity(n),
            wc: [WorkCompletion::default(); 32],
            _verbs: None,
            bufs,
            bufs_lkey,
        };
        c.repost()?;
        Ok(c)
    }

    /// The queue (the simulation reads its fault counts).
    #[cfg(test)]
    pub(crate) fn queue(&self) -> &Q {
        &self.queue
    }

    /// The queue, to change its faults.
    #[cfg(test)]
    pub(crate) fn queue_mut(&mut self) -> &mut Q {
        &mut self.queue
    }

    /// The capacities of its pools, which never grow.
    #[cfg(test)]
    pub(crate) fn capacities(&self) -> [usize; 9] {
        [
            self.rwrs.capacity(),
            self.mw_rkey.capacity(),
            self.mw_entry.capacity(),
            self.free_mws.capacity(),
            self.binds.capacity(),
            self.invs.capacity(),
            self.inv_posted.capacity(),
            self.inv_chains.capacity(),
            self.closed.capacity(),
        ]
    }

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
                self.bufs_lkey,
                self.tag,
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
/// `base` (`RDMA_RECV_BYTES` each, under `lkey`), each slot (with `tag`)
/// its wr_id, as one chain built in `rwrs`; `Err` says how many were
/// posted before the queue refused one.
fn post_recv_slots<Q: WorkQueue>(
    queue: &mut Q,
    rwrs: &mut Vec<RecvWr>,
    first: usize,
    n: usize,
    base: u64,
    lkey: u32,
    tag: u64,
) -> std::result::Result<(), (usize, std::io::Error)> {
    rwrs.clear();
    rwrs.extend((first..first + n).map(|slot| RecvWr {
        wr_id: tag | slot as u64,
        addr: base + (slot * RDMA_RECV_BYTES) as u64,
        len: RDMA_RECV_BYTES as u32,
        lkey,
    }));
    // SAFETY: the buffers live next to (and are dropped after) the queue
    // that receives into them, and are read only after their completion.
    unsafe { queue.post_recv(rwrs) }.map_err(|e| (e.posted, e.error))
}

/// A connection's verbs resources between the two halves of its setup:
/// its CQ and its QP, not yet connected.
pub(crate) struct PendingQp {
    cq: Arc<Cq>,
    qp: Qp,
    /// What its QP may receive into (the thread's SRQ buffers) lives as
    /// long as it.
    _common: Arc<ConsumerRdma>,
}

/// After WELCOME over RDMA: creates this connection's QP (on the GID of the
/// address the control connection leaves from, `local`, unless one is
/// configured) and gives the RDMA_ENDPOINT message to send the owner.
fn begin(
    r: &Arc<ConsumerRdma>,
    local: std::net::IpAddr,
    node: u32,
) -> Result<(PendingQp, Option<Vec<u8>>), ConnectError> {
    let failed = |e: Error| ConnectError::Refused(e);
    let cq = match &r.cqs {
        Some(cqs) => cqs.for_node(node).clone(),
        None => Cq::with_channel(&r.ctx, CONSUMER_CQ_ENTRIES as i32, &r.channel).map_err(failed)?,
    };
    let mut qp = match &r.recvs {
        Some(recvs) => Qp::new_on_srq(&r.pd, &cq, recvs.srq(), RDMA_RECVS as u32, 0),
        None => Qp::new(&r.pd, &cq, &cq, RDMA_RECVS as u32, 0),
    }
    .map_err(failed)?;
    let (index, gid) = r.ctx.choose_gid(r.opts.gid_index, local).map_err(failed)?;
    qp.use_gid(index, gid);
    let message = qp.endpoint().encode().to_vec();
    Ok((
        PendingQp {
            cq,
            qp,
            _common: r.clone(),
        },
        Some(message),
    ))
}

/// The owner's answer to RDMA_ENDPOINT is in: connects the QP to its
/// endpoint and posts the receives.
fn finish(
    r: &Arc<ConsumerRdma>,
    pending: PendingQp,
    answer: Option<(&Header, &[u8])>,
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
    let Some((h, body)) = answer else {
        return Err(violation("no answer to RDMA_ENDPOINT".into()));
    };
    if h.kind == Kind::Error {
        return Err(ConnectError::Refused(Error::Refused {
            node,
            addr: addr.to_string(),
            code: Code::from_u32(h.b).name(),
            message: String::from_utf8_lossy(body).into_owned(),
        }));
    }
    let theirs = proto::RdmaEndpoint::decode(h, body).map_err(|e| violation(e.to_string()))?;
    let PendingQp { cq, qp, .. } = pending;
    qp.connect(&theirs).map_err(failed)?;
    let qpn = qp.qp_num();
    let (bufs, bufs_mr) = if r.recvs.is_some() {
        (Vec::new(), None)
    } else {
        let mut bufs = vec![0u8; RDMA_RECVS * RDMA_RECV_BYTES];
        // SAFETY: the buffers live in the RdmaRx next to (and are freed
        // after) the QP that receives into them and this registration.
        let mr = unsafe { Mr::register(&r.pd, bufs.as_mut_ptr(), bufs.len(), Access::Local) }
            .map_err(failed)?;
        (bufs, Some(mr))
    };
    let mut queue = VerbsQueue::new(qp, cq, RDMA_RECVS);
    let mut rkeys = Vec::new();
    if r.windows {
        let mut mws = Vec::with_capacity(RDMA_WINDOWS);
        for _ in 0..RDMA_WINDOWS {
            let mw = Mw::new(&r.pd).map_err(failed)?;
            rkeys.push(mw.rkey());
            mws.push(mw);
        }
        queue = queue.with_windows(r.ring_mr.clone(), mws);
    }
    let bufs_lkey = bufs_mr.as_ref().map_or(0, |m| m.lkey());
    let tag = r.cqs.as_ref().map_or(0, |cqs| cqs.next_tag(node));
    // Shared CQs: armed by the thread (`data_poll.rs`), which polls them.
    let mut c = RdmaRx::on(
        queue,
        tag,
        bufs,
        bufs_lkey,
        r.ring_mr.addr(),
        r.ring_mr.rkey(),
        &rkeys,
    )
    .map_err(failed)?;
    c._verbs = Some((bufs_mr, r.clone()));
    if let Some(recvs) = &r.recvs {
        recvs.name(qpn, node);
        c.qpn = qpn;
    }
    if r.cqs.is_none() {
        c.queue.arm().map_err(failed)?;
    }
    Ok(c)
}

impl RdmaRx {
    /// Opens the verbs resources of a launch (see [`ConsumerRdma`]) and
    /// puts the ring's address, key (none in windows mode: each GRANT entry
    /// carries its window's) and the RDMA transport in `hello`.
    /// A node agent's shared links (see [`ConsumerRdma::open_shared`]):
    /// `hello` announces a ring at [`super::lanes::SHARED_RING_BASE`] as long
    /// as the address space, each grant's offset placing it in its rank's
    /// ring, whose window is what opens it.
    pub(super) fn open_shared(
        opts: &crate::transport::RdmaOptions,
        hello: &mut Hello,
        nodes: usize,
    ) -> Result<Arc<ConsumerRdma>> {
        let r = Arc::new(ConsumerRdma::open_shared(opts, nodes)?);
        hello.ring_addr = super::lanes::SHARED_RING_BASE;
        hello.ring_len = super::lanes::SHARED_RING_LEN;
        hello.rkey = 0;
        hello.transport = proto::TRANSPORT_RDMA;
        Ok(r)
    }

    pub(super) fn open(
        opts: &crate::transport::RdmaOptions,
        ring: &LandingRing,
        hello: &mut Hello,
        nodes: usize,
    ) -> Result<Arc<ConsumerRdma>> {
        let r = Arc::new(ConsumerRdma::open(opts, ring, nodes)?);
        hello.ring_addr = r.ring_mr.addr();
        // Windows mode: no key for the whole ring; each GRANT entry
        // carries its window's.
        hello.rkey = if r.windows { 0 } else { r.ring_mr.rkey() };
        hello.transport = proto::TRANSPORT_RDMA;
        Ok(r)
    }
}

impl<Q: WorkQueue> Drop for RdmaRx<Q> {
    /// Its QP's number no longer names it on the thread's SRQ.
    fn drop(&mut self) {
        if self.qpn != 0 {
            if let Some(recvs) = self._verbs.as_ref().and_then(|(_, c)| c.recvs.as_ref()) {
                recvs.forget(self.qpn);
            }
        }
    }
}

/// The data path, over any [`WorkQueue`]: what [`Receive`] calls (the
/// implementation below forwards), and what the simulation drives.
impl<Q: WorkQueue> RdmaRx<Q> {
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
                let n = (w.byte_len as usize).min(RDMA_RECV_BYTES);
                let mut copy = [0u8; RDMA_RECV_BYTES];
                let b = if self.qpn != 0 {
                    // The thread's SRQ's buffer (re-posted after this).
                    let recvs = self._verbs.as_ref().and_then(|(_, c)| c.recvs.as_ref());
                    let recvs = recvs.expect("a data path on the SRQ has its thread's receives");
                    let got = recvs.read(w.wr_id, n, &mut copy);
                    &copy[..got]
                } else {
                    let at = w.wr_id as usize * RDMA_RECV_BYTES;
                    &self.bufs[at.min(self.bufs.len())..(at + n).min(self.bufs.len())]
                };
                if n < 4 || b.len() < n {
                    return Landed::Violation(format!("an RDMA ERROR message of {n} bytes"));
                }
                let code = u32::from_le_bytes(b[..4].try_into().expect("4 bytes"));
                let msg = String::from_utf8_lossy(&b[4..]).into_owned();
                Landed::Error { grant, code, msg }
            }
            op => Landed::Violation(format!("unexpected RDMA completion opcode {op}")),
        }
    }

    /// [`Receive::open`].
    pub(crate) fn open_range(
        &mut self,
        entry: usize,
        lane: usize,
        phys: u64,
        len: u32,
    ) -> Option<(u32, u32)> {
        if self.mw_rkey.is_empty() {
            return Some((self.ring_rkey, NONE));
        }
        let (region, base) = if self.lane_addrs.is_empty() {
            (0, self.ring_addr)
        } else {
            let base = self.lane_addrs.get(lane).copied().unwrap_or(0);
            debug_assert!(base != 0, "a grant of lane {lane}, which has no ring here");
            if base == 0 {
                return None;
            }
            (lane as u32 + 1, base)
        };
        // A window for exactly this range, bound (with the rest of the
        // frame's) before the frame goes out, under a key no earlier grant
        // had (the window is free: its invalidation completed).
        let m = self.free_mws.pop()?;
        let k = next_rkey(self.mw_rkey[m as usize]);
        self.mw_rkey[m as usize] = k;
        self.mw_entry[m as usize] = entry as u32;
        self.binds.push(MwWr {
            wr_id: self.tag | WR_BIND,
            op: MwOp::Bind {
                window: m,
                region,
                addr: base + phys,
                len: len as u64,
                rkey: k,
            },
            signaled: false,
        });
        Some((k, m))
    }

    /// [`Receive::flush`]: binds the windows of the GRANT frame about to
    /// go, as one chain (every request carries `WR_BIND`, so a failed one
    /// is recognised; only the last is signalled: the send queue runs them
    /// in order, so its completion means every bind is in force); the
    /// frame goes once the chain completes ([`Event::Flushed`]), so no
    /// write can arrive before its window.
    pub(crate) fn flush(&mut self) -> Result<bool> {
        let Some(last) = self.binds.last_mut() else {
            return Ok(false);
        };
        last.signaled = true;
        let res = self.queue.post_mw(&self.binds);
        self.binds.clear();
        res.map_err(|e| Error::Rdma {
            op: "post memory-window binds",
            detail: format!("{} posted: {}", e.posted, e.error),
        })?;
        self.bind_pending = true;
        Ok(true)
    }

    /// [`Receive::flushing`].
    pub(crate) fn flushing(&self) -> bool {
        self.bind_pending
    }

    /// [`Receive::close`]: queues the invalidation of window `m` (posted
    /// by the next [`RdmaRx::flush_closes`]); [`Event::Closed`] once done
    /// (only then is it free to bind again).
    pub(crate) fn close(&mut self, m: u32) -> Result<()> {
        // Each window has at most one request queued or on the send queue.
        assert!(
            self.invs.len() + self.inv_posted.len() < self.mw_rkey.len(),
            "more invalidations of window {m} and others than windows"
        );
        self.invs.push(MwWr {
            wr_id: self.tag | WR_INV | m as u64,
            op: MwOp::Invalidate {
                rkey: self.mw_rkey[m as usize],
            },
            signaled: false,
        });
        self.invs_pending += 1;
        Ok(())
    }

    /// [`Receive::flush_closes`]: posts the invalidations queued since the
    /// last call as one chain, only its last request signalled (every
    /// request carries `WR_INV` and its window, so a failed one is named).
    pub(crate) fn flush_closes(&mut self) -> Result<()> {
        let Some(last) = self.invs.last_mut() else {
            return Ok(());
        };
        last.signaled = true;
        let res = self.queue.post_mw(&self.invs);
        let n = self.invs.len();
        self.inv_posted
            .extend(self.invs.iter().map(|w| (w.wr_id & 0xffff_ffff) as u32));
        self.inv_chains.push_back(n as u32);
        self.invs.clear();
        res.map_err(|e| Error::Rdma {
            op: "post memory-window invalidations",
            detail: format!("{} of {n} posted: {}", e.posted, e.error),
        })
    }

    /// [`Receive::take_closed`].
    pub(crate) fn take_closed(&mut self) -> Option<(u32, u32)> {
        self.closed.pop()
    }

    /// [`Receive::shut`]: the QP goes to the error state: it accepts no
    /// write from now on.
    pub(crate) fn shut(&mut self) -> Result<()> {
        self.queue.set_error()
    }

    /// [`Receive::idle`].
    pub(crate) fn idle(&self) -> bool {
        !self.bind_pending && self.invs_pending == 0
    }

    /// [`Receive::poll`] (a queue with a CQ of its own).
    pub(crate) fn poll(&mut self) -> Result<usize> {
        self.queue.poll(&mut self.wc)
    }

    /// [`Receive::take`].
    pub(crate) fn take(&mut self, k: usize) -> Event {
        self.take_wc(self.wc[k])
    }

    /// [`Receive::take_shared`]: completion `w` of a shared CQ, if it is
    /// this data path's (its tag; `None`: a queue pair's before this one).
    pub(crate) fn take_tagged(&mut self, w: &WorkCompletion) -> Option<Event> {
        let mine = if w.wr_id & TAG_MASK != 0 {
            self.tag != 0 && w.wr_id & TAG_MASK == self.tag
        } else {
            // A receive from the thread's SRQ: its QP names it.
            self.qpn != 0 && w.qp_num == self.qpn && w.wr_id & WR_SEND == 0
        };
        mine.then(|| self.take_wc(*w))
    }

    /// The `k`-th completion of the last poll, taken as a shared CQ's
    /// (the simulation runs both routes).
    #[cfg(test)]
    pub(crate) fn take_polled_as_shared(&mut self, k: usize) -> Option<Event> {
        let w = self.wc[k];
        self.take_tagged(&w)
    }

    /// The `k`-th completion of the last poll.
    #[cfg(test)]
    pub(crate) fn polled(&self, k: usize) -> WorkCompletion {
        self.wc[k]
    }

    /// What completion `w` (this data path's) means; a receive's slot is
    /// counted as used, to be re-posted by [`RdmaRx::refill`] (receives
    /// complete in the order they were posted).
    fn take_wc(&mut self, mut w: WorkCompletion) -> Event {
        w.wr_id &= !TAG_MASK;
        if w.wr_id & WR_SEND == 0 && self.qpn == 0 {
            self.consumed += 1;
            self.next_slot = (self.next_slot + 1) % RDMA_RECVS;
        }
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
            // The signalled last of a chain: every window of it is free.
            let n = self
                .inv_chains
                .pop_front()
                .expect("an invalidation chain was posted");
            self.closed.clear();
            for _ in 0..n {
                let m = self.inv_posted.pop_front().expect("chain windows") as usize;
                let entry = std::mem::replace(&mut self.mw_entry[m], NONE);
                self.free_mws.push(m as u32);
                self.closed.push((m as u32, entry));
            }
            assert_eq!(
                self.closed.last().map(|c| c.0 as u64),
                Some(w.wr_id & 0xffff_ffff),
                "an invalidation chain completed out of order"
            );
            self.invs_pending -= n as usize;
            // Oldest first for take_closed (it pops from the end).
            self.closed.reverse();
            return Event::Closed;
        }
        Event::Received(self.landed(&w))
    }

    /// [`Receive::refill`].
    pub(crate) fn refill(&mut self) -> Result<()> {
        if self.consumed >= RDMA_RECVS / 8 {
            self.repost()?;
        }
        Ok(())
    }
}

impl Receive for RdmaRx {
    type Common = Arc<ConsumerRdma>;
    const FRAMED: bool = false;

    type Pending = PendingQp;
    const EXCHANGE: &'static str = "RDMA_ENDPOINT";

    /// A reconnect sets up a new queue pair on the same device, protection
    /// domain, ring registration and completion channel, as the start's
    /// handshakes do.
    fn redial_common(common: &Arc<ConsumerRdma>) -> Option<Arc<ConsumerRdma>> {
        Some(common.clone())
    }

    fn begin(
        common: &Arc<ConsumerRdma>,
        local: std::net::IpAddr,
        node: u32,
        _addr: &str,
    ) -> Result<(PendingQp, Option<Vec<u8>>), ConnectError> {
        begin(common, local, node)
    }

    fn finish(
        common: &Arc<ConsumerRdma>,
        pending: PendingQp,
        answer: Option<(&Header, &[u8])>,
        node: u32,
        addr: &str,
    ) -> Result<Self, ConnectError> {
        finish(common, pending, answer, node, addr)
    }

    fn wake_fd(common: &Arc<ConsumerRdma>) -> Option<RawFd> {
        Some(common.channel.fd())
    }

    type Wc = WorkCompletion;

    fn poll_shared(
        common: &Arc<ConsumerRdma>,
        out: &mut [WorkCompletion],
    ) -> Option<Result<usize>> {
        common.cqs.as_ref().map(|c| c.poll(out))
    }

    fn route_shared(common: &Arc<ConsumerRdma>, ws: &[WorkCompletion], nodes: &mut [u32]) {
        assert!(
            ws.len() <= 32 && nodes.len() >= ws.len(),
            "a batch of {}",
            ws.len()
        );
        for (n, w) in nodes.iter_mut().zip(ws) {
            *n = if w.wr_id & TAG_MASK != 0 {
                super::cqs::tag_node(w.wr_id) as u32
            } else {
                u32::MAX
            };
        }
        if let Some(recvs) = &common.recvs {
            // The SRQ's receives: their QP names the link (one lock).
            let srq = |w: &WorkCompletion| w.wr_id & (TAG_MASK | WR_SEND) == 0;
            if ws.iter().any(srq) {
                let mut k = 0;
                let mut found = [u32::MAX; 32];
                recvs.nodes_of(ws.iter().filter(|w| srq(w)).map(|w| w.qp_num), &mut found);
                for (n, w) in nodes.iter_mut().zip(ws) {
                    if srq(w) {
                        *n = found.get(k).copied().unwrap_or(u32::MAX);
                        k += 1;
                    }
                }
            }
        }
    }

    fn refill_shared(common: &Arc<ConsumerRdma>, ws: &[WorkCompletion]) -> Result<()> {
        let Some(recvs) = &common.recvs else {
            return Ok(());
        };
        recvs.post(
            ws.iter()
                .filter(|w| w.wr_id & (TAG_MASK | WR_SEND) == 0)
                .map(|w| w.wr_id),
        )
    }

    fn take_shared(&mut self, w: &WorkCompletion) -> Option<Event> {
        self.take_tagged(w)
    }

    fn retire_when_dead(common: &Arc<ConsumerRdma>) -> bool {
        common.recvs.is_some()
    }

    fn arm_shared(common: &Arc<ConsumerRdma>) -> Result<bool> {
        match &common.cqs {
            Some(c) => c.arm().map(|()| true),
            None => Ok(false),
        }
    }

    fn woke(common: &Arc<ConsumerRdma>) {
        common.channel.drain();
    }

    fn open(&mut self, entry: usize, lane: usize, phys: u64, len: u32) -> Option<(u32, u32)> {
        self.open_range(entry, lane, phys, len)
    }

    type RingReg = Arc<rdma::Mr>;

    fn register_ring(common: &Arc<ConsumerRdma>, ring: &LandingRing) -> Result<Arc<rdma::Mr>> {
        if !common.windows || ring.device().is_some() {
            return Err(Error::InvalidConfig(
                "a shared RDMA link fills host rings through memory windows only".into(),
            ));
        }
        // SAFETY: the ring outlives this registration: the thread drops a
        // lane's registration (and every queue's reference to it, once no
        // window is bound over it) before the lane and its ring; peers
        // write it only through windows bound to granted ranges.
        let mr = unsafe {
            Mr::register(
                &common.pd,
                ring.as_mut_ptr(),
                ring.len(),
                Access::WindowsOnly,
            )
        }?;
        Ok(Arc::new(mr))
    }

    fn wire_offset(reg: &Arc<rdma::Mr>, phys: u64) -> u64 {
        reg.addr() - super::lanes::SHARED_RING_BASE + phys
    }

    fn set_ring(&mut self, lane: usize, reg: Option<&Arc<rdma::Mr>>) {
        if self.lane_addrs.len() <= lane {
            self.lane_addrs.resize(lane + 1, 0);
        }
        self.lane_addrs[lane] = reg.map_or(0, |r| r.addr());
        self.queue.set_region(lane as u32 + 1, reg.cloned());
    }

    fn flush(&mut self) -> Result<bool> {
        RdmaRx::flush(self)
    }

    fn flushing(&self) -> bool {
        RdmaRx::flushing(self)
    }

    fn close(&mut self, m: u32) -> Result<()> {
        RdmaRx::close(self, m)
    }

    fn flush_closes(&mut self) -> Result<()> {
        RdmaRx::flush_closes(self)
    }

    fn take_closed(&mut self) -> Option<(u32, u32)> {
        RdmaRx::take_closed(self)
    }

    fn shut(&mut self) -> Result<()> {
        RdmaRx::shut(self)
    }

    fn idle(&self) -> bool {
        RdmaRx::idle(self)
    }

    fn arm(&self) -> Result<()> {
        self.queue.arm()
    }

    fn poll(&mut self) -> Result<usize> {
        RdmaRx::poll(self)
    }

    fn take(&mut self, k: usize) -> Event {
        RdmaRx::take(self, k)
    }

    fn refill(&mut self) -> Result<()> {
        RdmaRx::refill(self)
    }
}
