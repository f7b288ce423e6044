//! The consumer's network thread (cluster mode, TCP transport).
//!
//! It walks the same schedule as the pollers and takes the samples the local
//! space does not hold. For each, once flow control allows (its slot is
//! behind the released mark plus the ring size), it grants the sample's
//! first live holder the ring range `[phys, phys + len)`, batching grants per
//! node into GRANT frames. One io_uring carries every socket: per connection
//! one receive is always posted, either a 24-byte header or, once a DATA
//! header has been checked against its outstanding grant (id, node, offset,
//! length), the payload straight into the ring at the granted offset. A frame
//! that matches no grant drops the connection with a named error before a
//! byte of its payload is read, so a peer writes only where it was granted.
//!
//! Failover: a connection that closes, fails, breaks the protocol or stays
//! silent for `node_timeout` with grants outstanding is shut; once its last
//! receive has returned (so nothing more lands from it), each of its
//! outstanding grants goes to the sample's next live replica, else is read
//! from the source, else fails with [`Error::SampleUnavailable`] naming every
//! place tried. A grant answered with ERROR, or whose bytes fail the CRC32C
//! check (`verify_crc32c`), fails over the same way, and so does a sample
//! of this node's own space whose local read failed (I/O error, short read,
//! CRC32C mismatch): the poller hands it over through a channel bounded at
//! start ([`NetShared::hand_over`]) instead of failing the loader.
//!
//! Minimum progress: with grants outstanding, a connection must finish one
//! (whole, or answered with ERROR) within `node_timeout` plus one second per
//! MiB of the catalog's largest sample ([`MIN_PROGRESS_BYTES_PER_SEC`]) of
//! the previous one; a node that trickles its bytes is dropped like a
//! silent one. Demotion: a node whose grants fail [`DEMOTE_AFTER_ERRORS`]
//! times within [`DEMOTE_WINDOW`] gets no more grants until the next epoch
//! (its outstanding ones finish or fail over), said once in the log.
//!
//! Pools are fixed at start: the grant table (one entry per sample the ring
//! can hold), per-connection header/message buffers and grant frame buffers.

use std::collections::VecDeque;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::schedule::{Cursor, Placed};
use super::{Shared, CODE_ERROR, CODE_OK};
use crate::dataset::Placement;
use crate::error::{errno_name, Error, Result};
use crate::landing::LandingRing;
use crate::ring::{Completion, IoBackend, Uring, UringOptions};
use crate::sys::EventFd;
use crate::transport::proto::{self, Code, GrantEntry, Header, Hello, Kind, Welcome};
use crate::transport::Cluster;

/// The slowest a node may deliver a grant (see the module's "minimum
/// progress").
pub(crate) const MIN_PROGRESS_BYTES_PER_SEC: u64 = 1 << 20;
/// Failed grants (ERROR, CRC mismatch) within [`DEMOTE_WINDOW`] that demote
/// a node for the rest of the epoch.
pub(crate) const DEMOTE_AFTER_ERRORS: u32 = 16;
/// See [`DEMOTE_AFTER_ERRORS`].
pub(crate) const DEMOTE_WINDOW: Duration = Duration::from_secs(10);
/// A connection that sent nothing for this long sends a keepalive (an
/// empty ERROR frame for the connection, which a node ignores), so the
/// node's idle timeout (`kspeed serve --idle-timeout-ms`, at least 3 s)
/// closes only peers that are gone.
pub(crate) const KEEPALIVE: Duration = Duration::from_secs(1);

/// Cluster settings of a loader.
#[derive(Debug, Clone)]
pub(crate) struct NetSetup {
    pub(crate) cluster: Cluster,
    pub(crate) token: Vec<u8>,
    pub(crate) node_timeout: Duration,
    pub(crate) connect_timeout: Duration,
    pub(crate) hello: Hello,
    /// From the local space, or else from the first node's WELCOME.
    pub(crate) placement: Option<Placement>,
    /// The node this process runs on (its samples are read locally).
    pub(crate) local_node: Option<u32>,
    /// Data over RDMA (WRITE_WITH_IMM into the registered ring) on this
    /// device, instead of DATA frames on TCP.
    pub(crate) rdma: Option<crate::transport::RdmaOptions>,
}

/// How many receives an RDMA connection keeps posted: every WRITE_WITH_IMM
/// consumes one (too few only slows the owner down: it retries on RNR).
#[cfg(feature = "rdma")]
const RDMA_RECVS: usize = 1024;
/// Receive buffer size: an ERROR message (code + up to 128 bytes).
#[cfg(feature = "rdma")]
const RDMA_RECV_BYTES: usize = 4 + crate::transport::rdma::RDMA_ERROR_BYTES;
/// Memory windows per RDMA connection (windows mode): one per grant
/// outstanding with that node, so also the most grants it has outstanding.
/// Each window has at most one request (a bind or an invalidation) on the
/// QP's send queue at a time, so the send queue (`RDMA_RECVS` deep) never
/// fills.
#[cfg(feature = "rdma")]
const RDMA_WINDOWS: usize = 256;
/// Send-queue completions carry this bit in their wr_id (receives carry
/// their buffer slot, below `RDMA_RECVS`).
#[cfg(feature = "rdma")]
const WR_SEND: u64 = 1 << 63;
/// A bind chain's last request (the GRANT frame waits for it).
#[cfg(feature = "rdma")]
const WR_BIND: u64 = WR_SEND | 1 << 62;
/// An invalidation: the low 32 bits name the window.
#[cfg(feature = "rdma")]
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
#[cfg(feature = "rdma")]
pub(crate) struct ConsumerRdma {
    opts: crate::transport::RdmaOptions,
    ring_mr: crate::transport::rdma::Mr,
    /// Per-grant memory windows (see above).
    windows: bool,
    /// A GPU ring's dma-buf, kept open while it is registered.
    _dmabuf: Option<std::os::fd::OwnedFd>,
    channel: Arc<crate::transport::rdma::CompChannel>,
    pd: Arc<crate::transport::rdma::Pd>,
    ctx: Arc<crate::transport::rdma::Context>,
}

#[cfg(feature = "rdma")]
impl ConsumerRdma {
    fn open(opts: &crate::transport::RdmaOptions, ring: &LandingRing) -> Result<Self> {
        use crate::transport::rdma::{Access, CompChannel, Context, Mr, Pd};
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
#[cfg(feature = "rdma")]
fn windows_usable(
    ctx: &crate::transport::rdma::Context,
    pd: &Arc<crate::transport::rdma::Pd>,
    ring: &LandingRing,
) -> std::result::Result<(), String> {
    if std::env::var_os("KSPEED_RDMA_WINDOWS").is_some_and(|v| v == "0") {
        return Err("KSPEED_RDMA_WINDOWS=0".into());
    }
    if ring.device().is_some() {
        return Err("the landing ring is GPU memory".into());
    }
    ctx.windows_supported(RDMA_WINDOWS)?;
    crate::transport::rdma::Mw::new(pd)
        .map(drop)
        .map_err(|e| e.to_string())
}

/// Registers a GPU ring for remote write: as a dma-buf where the NIC's
/// driver can register one (the fd is returned, to be kept open), else by
/// its device address, which a peer-memory module (nvidia-peermem) lets
/// ibv_reg_mr pin. Both failing is one error giving both reasons.
#[cfg(feature = "rdma")]
fn register_gpu_ring(
    pd: &Arc<crate::transport::rdma::Pd>,
    dev: &crate::landing::cuda::DeviceMemory,
) -> Result<(crate::transport::rdma::Mr, Option<std::os::fd::OwnedFd>)> {
    use crate::transport::rdma::{Access, Mr};
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

/// One connection's RDMA end: its QP and CQ, and the receive buffers for
/// ERROR messages (receives are posted in order and complete in order, so
/// the buffers are used round-robin and re-posted in bulk).
#[cfg(feature = "rdma")]
struct RdmaConn {
    qp: crate::transport::rdma::Qp,
    cq: Arc<crate::transport::rdma::Cq>,
    bufs_mr: crate::transport::rdma::Mr,
    bufs: Box<[u8]>,
    /// Receives completed and not re-posted yet, and the slot of the first.
    consumed: usize,
    next_slot: usize,
    sges: Vec<rdma_sys::ibv_sge>,
    wrs: Vec<rdma_sys::ibv_recv_wr>,
    /// Windows mode: the windows, the rkey each was last bound under, the
    /// table entry each opens (`NONE` when free), the free ones.
    mws: Vec<crate::transport::rdma::Mw>,
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
}

#[cfg(feature = "rdma")]
impl Drop for RdmaConn {
    fn drop(&mut self) {
        // Windows before their QP: soft-RoCE (Linux 6.1) took 50.6 s to
        // destroy a QP that 8 bound windows still referenced (measured in
        // the VM; 0.5 ms to free the windows first), and a dead node's QP is
        // destroyed on the network thread.
        self.mws.clear();
    }
}

// SAFETY: `sges`/`wrs` are scratch space whose raw pointers are rebuilt on
// every post and never outlive it; the verbs objects may be used from any
// thread, and one thread at a time uses a connection.
#[cfg(feature = "rdma")]
unsafe impl Send for RdmaConn {}

#[cfg(feature = "rdma")]
impl RdmaConn {
    /// Re-posts the receives consumed so far (one or two chains).
    fn repost(&mut self) -> Result<()> {
        while self.consumed > 0 {
            let first = (self.next_slot + RDMA_RECVS - self.consumed) % RDMA_RECVS;
            let n = self.consumed.min(RDMA_RECVS - first);
            let base = self.bufs.as_ptr() as u64 + (first * RDMA_RECV_BYTES) as u64;
            self.qp.post_recvs_into(
                first as u64,
                n,
                Some((&self.bufs_mr, base, RDMA_RECV_BYTES as u32)),
                &mut self.sges,
                &mut self.wrs,
            )?;
            self.consumed -= n;
        }
        Ok(())
    }
}

/// What the consumer thread and the network thread share.
pub(crate) struct NetShared {
    pub(crate) wake: EventFd,
    /// Set by the network thread while flow control holds it back; the
    /// consumer's release clears it and wakes the thread.
    pub(crate) sleeping: AtomicBool,
    pub(crate) remote_samples: AtomicU64,
    pub(crate) failovers: AtomicU64,
    pub(crate) source_reads: AtomicU64,
    /// Local samples the pollers could not read (read error, short read,
    /// CRC32C mismatch), handed to this thread to serve from the next
    /// holder or the source. Bounded at start by the ready table's length:
    /// a sample is handed over at most once and only while it lies inside
    /// the flow-control window, which never holds more samples than that,
    /// so a send never finds it full (and never allocates).
    local_failed: (
        crossbeam_channel::Sender<HandedOver>,
        crossbeam_channel::Receiver<HandedOver>,
    ),
}

/// A local sample whose read failed, and why.
type HandedOver = (Placed, Error);

impl NetShared {
    /// `window_samples`: the most samples the ring holds at once (the
    /// ready table's length).
    pub(crate) fn new(window_samples: usize) -> Result<Self> {
        Ok(NetShared {
            wake: EventFd::new().map_err(|e| Error::Serve(format!("eventfd: {e}")))?,
            sleeping: AtomicBool::new(false),
            remote_samples: AtomicU64::new(0),
            failovers: AtomicU64::new(0),
            source_reads: AtomicU64::new(0),
            local_failed: crossbeam_channel::bounded(window_samples.max(1)),
        })
    }

    /// A poller hands over local sample `p`, whose read failed with `e`:
    /// the network thread serves it from its next holder (a replica on
    /// another node) or the source, like a grant a node failed, and reports
    /// `e` among the places tried if none can. The poller has no read in
    /// flight into its slot any more; the slot stays unpublished, so the
    /// consumer cannot release past it and flow control still covers it.
    /// Gives `e` back when it cannot be handed over (the channel is full or
    /// closed: not expected, see `local_failed`); the sample then fails.
    pub(crate) fn hand_over(&self, p: Placed, e: Error) -> Result<(), Error> {
        self.local_failed.0.try_send((p, e)).map_err(|err| {
            let (_, e) = err.into_inner();
            e
        })?;
        self.wake.notify();
        Ok(())
    }

    /// Called after the consumer moved the released mark.
    pub(crate) fn released(&self) {
        if self.sleeping.swap(false, Ordering::SeqCst) {
            self.wake.notify();
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum State {
    Live,
    /// Shut down; waiting for its in-flight receive and send to return.
    Closing,
    Dead,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Rx {
    Header,
    Payload { idx: usize, len: u32 },
    Message(Header),
}

/// One connection to a node.
pub(crate) struct Conn {
    node: u32,
    addr: String,
    sock: Option<TcpStream>,
    state: State,
    /// Why it is dead (for messages).
    reason: String,
    /// The last ERROR a grant got from it.
    last_error: String,
    hdr: Box<[u8; proto::HEADER_BYTES]>,
    msg: Box<[u8]>,
    rx: Rx,
    rx_inflight: bool,
    /// GRANT frame being filled (header space first) and the one in flight.
    fill: Vec<u8>,
    fill_entries: u32,
    flight: Vec<u8>,
    flight_sent: usize,
    tx_inflight: bool,
    outstanding: u64,
    max_grants: u64,
    max_data: u32,
    last_rx: Instant,
    /// When its last grant finished (or its first was given, from none):
    /// the minimum-progress clock.
    last_done: Instant,
    /// Failed grants in the window that began at `errors_since`.
    errors: u32,
    errors_since: Instant,
    /// No new grants until the next epoch.
    demoted: bool,
    /// When it last sent a frame (GRANT or keepalive).
    last_tx: Instant,
    #[cfg(feature = "rdma")]
    rdma: Option<RdmaConn>,
}

impl Conn {
    /// Its GRANT frame waits for its windows' binds.
    fn bind_pending(&self) -> bool {
        #[cfg(feature = "rdma")]
        return self.rdma.as_ref().is_some_and(|r| r.bind_pending);
        #[cfg(not(feature = "rdma"))]
        false
    }

    fn is_rdma(&self) -> bool {
        #[cfg(feature = "rdma")]
        return self.rdma.is_some();
        #[cfg(not(feature = "rdma"))]
        false
    }

    fn dead(node: u32, addr: String, reason: String) -> Conn {
        Conn {
            node,
            addr,
            sock: None,
            state: State::Dead,
            reason,
            last_error: String::new(),
            hdr: Box::new([0; proto::HEADER_BYTES]),
            msg: Box::new([]),
            rx: Rx::Header,
            rx_inflight: false,
            fill: Vec::new(),
            fill_entries: 0,
            flight: Vec::new(),
            flight_sent: 0,
            tx_inflight: false,
            outstanding: 0,
            max_grants: 0,
            max_data: 0,
            last_rx: Instant::now(),
            last_done: Instant::now(),
            errors: 0,
            errors_since: Instant::now(),
            demoted: false,
            last_tx: Instant::now(),
            #[cfg(feature = "rdma")]
            rdma: None,
        }
    }
}

/// What [`connect_all`] made: a connection per node (dead ones included)
/// and, over RDMA, the verbs resources they share.
pub(crate) struct Connected {
    pub(crate) conns: Vec<Conn>,
    #[cfg(feature = "rdma")]
    pub(crate) rdma: Option<Arc<ConsumerRdma>>,
}

/// Connects to every node but the local one. A node that cannot be reached
/// is dead from the start (its samples fail over); a node that refuses the
/// HELLO (token, version, dataset) is an error: the job is misconfigured.
///
/// Over RDMA the landing ring `ring` (address, length) is registered for
/// remote write first, and every connection gets its queue pair.
pub(crate) fn connect_all(setup: &mut NetSetup, ring: &LandingRing) -> Result<Connected> {
    if setup.token.is_empty() || setup.token.len() > proto::MAX_TOKEN_BYTES {
        return Err(Error::InvalidConfig(format!(
            "the job token has {} bytes; it must have 1 to {} (the HELLO frame's limit)",
            setup.token.len(),
            proto::MAX_TOKEN_BYTES
        )));
    }
    let mut out = Vec::with_capacity(setup.cluster.nodes.len());
    #[cfg(feature = "rdma")]
    let rdma = match &setup.rdma {
        Some(opts) => {
            let r = Arc::new(ConsumerRdma::open(opts, ring)?);
            setup.hello.ring_addr = r.ring_mr.addr();
            // Windows mode: no key for the whole ring; each GRANT entry
            // carries its window's.
            setup.hello.rkey = if r.windows { 0 } else { r.ring_mr.rkey() };
            setup.hello.transport = proto::TRANSPORT_RDMA;
            Some(r)
        }
        None => None,
    };
    #[cfg(not(feature = "rdma"))]
    {
        let _ = ring;
        if setup.rdma.is_some() {
            return Err(Error::InvalidConfig(
                "this kspeed was built without the `rdma` feature: no RDMA transport".into(),
            ));
        }
    }
    // Every node at once, under one deadline (`node_timeout`, the connect
    // included): stalled nodes cost the start one timeout, not one each.
    let deadline = Instant::now() + setup.node_timeout;
    let shared: &NetSetup = setup;
    #[cfg(feature = "rdma")]
    let r = rdma.as_deref();
    let one = |n: &crate::transport::Node| {
        #[cfg(feature = "rdma")]
        return connect(shared, n.index, &n.addr, deadline, r);
        #[cfg(not(feature = "rdma"))]
        connect(shared, n.index, &n.addr, deadline)
    };
    let results: Vec<Option<Result<(Conn, Welcome), ConnectError>>> = std::thread::scope(|sc| {
        let handles: Vec<_> = shared
            .cluster
            .nodes
            .iter()
            .map(|n| {
                if Some(n.index) == shared.local_node {
                    return None;
                }
                let one = &one;
                Some(
                    std::thread::Builder::new()
                        .name("kspeed-connect".into())
                        .stack_size(256 << 10)
                        .spawn_scoped(sc, move || one(n))
                        .map_err(|_| n),
                )
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.map(|h| match h {
                    Ok(t) => t.join().unwrap_or_else(|_| {
                        Err(ConnectError::Unreachable("connect thread panicked".into()))
                    }),
                    // No thread to spare: connect from here.
                    Err(n) => one(n),
                })
            })
            .collect()
    });
    for (n, res) in setup.cluster.nodes.iter().zip(results) {
        let Some(res) = res else {
            out.push(Conn::dead(n.index, n.addr.clone(), "local node".into()));
            continue;
        };
        match res {
            Ok((c, w)) => {
                let theirs =
                    Placement::new(w.nodes, w.replicas).map_err(|e| Error::BadCluster {
                        origin: format!("node {} ({})", n.index, n.addr),
                        reason: e.to_string(),
                    })?;
                let ours = *setup.placement.get_or_insert(theirs);
                if theirs != ours || ours.nodes as usize != setup.cluster.nodes.len() {
                    return Err(Error::BadCluster {
                        origin: format!("node {} ({})", n.index, n.addr),
                        reason: format!(
                            "its space is placed over {} nodes × {} copies; this loader expects {} × {} and the cluster lists {} nodes",
                            theirs.nodes,
                            theirs.replicas,
                            ours.nodes,
                            ours.replicas,
                            setup.cluster.nodes.len()
                        ),
                    });
                }
                out.push(c)
            }
            Err(ConnectError::Refused(e)) => return Err(e),
            Err(ConnectError::Unreachable(why)) => {
                log::warn!("node {} ({}) is unreachable: {why}", n.index, n.addr);
                out.push(Conn::dead(n.index, n.addr.clone(), why));
            }
        }
    }
    Ok(Connected {
        conns: out,
        #[cfg(feature = "rdma")]
        rdma,
    })
}

enum ConnectError {
    Refused(Error),
    Unreachable(String),
}

fn connect(
    setup: &NetSetup,
    node: u32,
    addr: &str,
    deadline: Instant,
    #[cfg(feature = "rdma")] rdma: Option<&ConsumerRdma>,
) -> Result<(Conn, Welcome), ConnectError> {
    // What is left of the start's deadline (never zero: a zero timeout
    // means "none" to the socket calls).
    let left = || {
        deadline
            .saturating_duration_since(Instant::now())
            .max(Duration::from_millis(1))
    };
    let unreachable =
        |what: &str, e: &dyn std::fmt::Display| ConnectError::Unreachable(format!("{what}: {e}"));
    let sa = crate::transport::Node {
        index: node,
        addr: addr.to_string(),
    }
    .resolve()
    .map_err(|e| unreachable("resolve", &e))?;
    let mut sock = TcpStream::connect_timeout(&sa, setup.connect_timeout.min(left()))
        .map_err(|e| unreachable("connect", &e))?;
    let _ = sock.set_nodelay(true);
    let _ = sock.set_read_timeout(Some(left()));
    let mut hello = Vec::new();
    setup.hello.encode(&setup.token, &mut hello);
    sock.write_all(&hello)
        .map_err(|e| unreachable("send HELLO", &e))?;
    let mut hb = [0u8; proto::HEADER_BYTES];
    sock.read_exact(&mut hb)
        .map_err(|e| unreachable("no answer to HELLO", &e))?;
    let violation = |what: String| {
        ConnectError::Refused(Error::ProtocolViolation {
            node,
            addr: addr.to_string(),
            what,
        })
    };
    let h = Header::decode(&hb, 0).map_err(|e| violation(e.to_string()))?;
    let mut body = vec![0u8; h.body_len as usize];
    let _ = sock.set_read_timeout(Some(left()));
    sock.read_exact(&mut body)
        .map_err(|e| unreachable("truncated answer to HELLO", &e))?;
    match h.kind {
        Kind::Welcome => {}
        Kind::Error => {
            return Err(ConnectError::Refused(Error::Refused {
                node,
                addr: addr.to_string(),
                code: Code::from_u32(h.b).name(),
                message: String::from_utf8_lossy(&body).into_owned(),
            }))
        }
        k => return Err(violation(format!("answered HELLO with {k:?}"))),
    }
    let w = Welcome::decode(&h, &body).map_err(|e| violation(e.to_string()))?;
    if h.a != proto::VERSION {
        return Err(violation(format!("WELCOME with version {}", h.a)));
    }
    if w.node_index != node {
        return Err(ConnectError::Refused(Error::BadCluster {
            origin: format!("node {node} ({addr})"),
            reason: format!("the service there is node {}", w.node_index),
        }));
    }
    if w.transport != setup.hello.transport {
        return Err(ConnectError::Refused(Error::BadCluster {
            origin: format!("node {node} ({addr})"),
            reason: if setup.hello.transport == proto::TRANSPORT_RDMA {
                "it does not serve over RDMA (start `kspeed serve` with --rdma, or read over TCP)"
                    .into()
            } else {
                format!("it answered with transport {}", w.transport)
            },
        }));
    }
    #[cfg(feature = "rdma")]
    let rdma_conn = match rdma {
        Some(r) => Some(rdma_connect(r, &mut sock, node, addr)?),
        None => None,
    };
    let _ = sock.set_read_timeout(None);
    let entries = proto::MAX_GRANT_ENTRIES.min(w.max_grants.max(1) as usize);
    let frame = proto::HEADER_BYTES + entries * proto::GRANT_ENTRY_BYTES;
    let mut fill = Vec::with_capacity(frame);
    fill.resize(proto::HEADER_BYTES, 0);
    Ok((
        Conn {
            node,
            addr: addr.to_string(),
            sock: Some(sock),
            state: State::Live,
            reason: String::new(),
            last_error: String::new(),
            hdr: Box::new([0; proto::HEADER_BYTES]),
            msg: vec![0u8; proto::MAX_MESSAGE_BYTES].into_boxed_slice(),
            rx: Rx::Header,
            rx_inflight: false,
            fill,
            fill_entries: 0,
            flight: Vec::with_capacity(frame),
            flight_sent: 0,
            tx_inflight: false,
            outstanding: 0,
            max_grants: w.max_grants.max(1),
            max_data: w.max_data_bytes.min(proto::MAX_DATA_BYTES),
            last_rx: Instant::now(),
            last_done: Instant::now(),
            errors: 0,
            errors_since: Instant::now(),
            demoted: false,
            last_tx: Instant::now(),
            #[cfg(feature = "rdma")]
            rdma: rdma_conn,
        },
        w,
    ))
}

/// After WELCOME over RDMA: creates this connection's QP (on the GID of the
/// address the control connection leaves from, unless one is configured),
/// swaps endpoints with the owner, connects, and posts the receives.
#[cfg(feature = "rdma")]
fn rdma_connect(
    r: &ConsumerRdma,
    sock: &mut TcpStream,
    node: u32,
    addr: &str,
) -> Result<RdmaConn, ConnectError> {
    use crate::transport::rdma::{Access, Cq, Mr, Qp};
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
    let mut c = RdmaConn {
        qp,
        cq,
        bufs_mr,
        bufs,
        consumed: RDMA_RECVS,
        next_slot: 0,
        sges: Vec::with_capacity(RDMA_RECVS),
        wrs: Vec::with_capacity(RDMA_RECVS),
        mws: Vec::new(),
        mw_rkey: Vec::new(),
        mw_entry: Vec::new(),
        free_mws: Vec::new(),
        binds: Vec::new(),
        bind_pending: false,
        invs_pending: 0,
        swrs: Vec::with_capacity(proto::MAX_GRANT_ENTRIES.min(RDMA_WINDOWS)),
    };
    if r.windows {
        for m in 0..RDMA_WINDOWS {
            let mw = crate::transport::rdma::Mw::new(&r.pd).map_err(failed)?;
            c.mw_rkey.push(mw.rkey());
            c.mws.push(mw);
            c.mw_entry.push(NONE);
            c.free_mws.push((RDMA_WINDOWS - 1 - m) as u32);
        }
        c.binds.reserve_exact(RDMA_WINDOWS);
    }
    c.repost().map_err(failed)?;
    c.cq.arm().map_err(failed)?;
    Ok(c)
}

const NONE: u32 = u32::MAX;

/// One outstanding remote sample.
#[derive(Clone, Copy)]
struct GSlot {
    live: bool,
    g: u64,
    id: u64,
    len: u32,
    phys: u64,
    node: u32,
    received: u32,
    /// Replica indices tried (bit r).
    tried: u64,
    /// The local pollers failed to read it (handed over); the error is in
    /// `NetThread::local_errors`.
    local: bool,
    /// RDMA windows mode: the memory window of its node's connection that
    /// opens its range, `NONE` when none is bound.
    mw: u32,
    /// Done with its node (all bytes in, or ERROR): waiting for its window's
    /// invalidation before it is published (or checked) or failed over.
    after_inv: AfterInv,
}

impl GSlot {
    /// A live entry for sample `p`, not yet given to a node: `tried` marks
    /// the replicas already out of the question, `local` a sample the
    /// local pollers handed over.
    fn open(p: &Placed, geo: &super::schedule::Geometry, tried: u64, local: bool) -> Self {
        GSlot {
            live: true,
            g: p.g,
            id: p.id,
            len: p.len as u32,
            phys: p.phys(geo),
            node: NONE,
            received: 0,
            tried,
            local,
            mw: NONE,
            after_inv: AfterInv::Nothing,
        }
    }

    /// Whether it is grant `grant`, outstanding with `node`: live, given to
    /// that node, and not over (a grant waiting for its window's
    /// invalidation takes nothing more from the node).
    fn outstanding_with(&self, grant: u32, node: u32) -> bool {
        self.live
            && self.g as u32 == grant
            && self.node == node
            && self.after_inv == AfterInv::Nothing
    }
}

/// What a grant does once its window is invalidated.
#[derive(Clone, Copy, PartialEq, Eq)]
enum AfterInv {
    Nothing,
    /// All its bytes arrived: check (CRC32C) and publish.
    Done,
    /// Its node answered ERROR: fail over.
    FailOver,
}

const UD_RECV: u64 = 1 << 56;
const UD_SEND: u64 = 2 << 56;
const UD_WAKE: u64 = 3 << 56;
const UD_CHAN: u64 = 4 << 56;
const UD_KIND: u64 = 0xff << 56;

pub(crate) struct NetThread {
    setup: Arc<NetSetup>,
    placement: Placement,
    ring: Uring,
    /// Before `rdma` and `sh`: the QPs go before the registrations and the
    /// ring memory they write.
    conns: Vec<Conn>,
    #[cfg(feature = "rdma")]
    rdma: Option<Arc<ConsumerRdma>>,
    /// A poll on the RDMA completion channel is in the ring.
    chan_inflight: bool,
    cursor: Cursor,
    pending: Option<Placed>,
    table: Box<[GSlot]>,
    mask: usize,
    /// Grants to place again (table indices), oldest first.
    regrant: VecDeque<usize>,
    wake_buf: Box<u64>,
    wake_inflight: bool,
    completions: Vec<Completion>,
    /// Host buffer for samples read from the source into a GPU ring.
    bounce: Vec<u8>,
    /// (g, why) of the handed-over local samples not yet served: why this
    /// node's own copy failed, for the error if no other copy can serve it.
    local_errors: Vec<(u64, String)>,
    /// The epoch of the newest sample granted (demotions end with it).
    epoch: Option<u64>,
    /// The minimum-progress allowance per grant beyond `node_timeout`.
    progress_slack: Duration,
    sh: Arc<Shared>,
}

impl NetThread {
    pub(crate) fn new(sh: Arc<Shared>, setup: Arc<NetSetup>, connected: Connected) -> Result<Self> {
        let conns = connected.conns;
        let ring = Uring::new(UringOptions {
            entries: (conns.len() as u32 * 2 + 8).next_power_of_two(),
            sqpoll_idle_ms: None,
        })?;
        let size = (sh.geo.table_len() as usize).next_power_of_two();
        let cursor = Cursor::new(sh.sampler.clone(), sh.geo, sh.start, sh.steps);
        let placement = setup.placement.ok_or_else(|| Error::BadCluster {
            origin: "cluster".into(),
            reason:
                "no node could be reached and there is no local space to learn the placement from"
                    .into(),
        })?;
        Ok(NetThread {
            placement,
            ring,
            conns,
            #[cfg(feature = "rdma")]
            rdma: connected.rdma,
            chan_inflight: false,
            bounce: Vec::new(),
            local_errors: Vec::new(),
            epoch: None,
            progress_slack: Duration::from_secs_f64(
                sh.input.catalog().max_sample_bytes() as f64 / MIN_PROGRESS_BYTES_PER_SEC as f64,
            ),
            cursor,
            pending: None,
            table: vec![
                GSlot {
                    live: false,
                    g: 0,
                    id: 0,
                    len: 0,
                    phys: 0,
                    node: NONE,
                    received: 0,
                    tried: 0,
                    local: false,
                    mw: NONE,
                    after_inv: AfterInv::Nothing,
                };
                size
            ]
            .into_boxed_slice(),
            mask: size - 1,
            regrant: VecDeque::with_capacity(size),
            wake_buf: Box::new(0),
            wake_inflight: false,
            completions: vec![Completion::default(); 256],
            sh,
            setup,
        })
    }

    fn net(&self) -> &NetShared {
        self.sh.net.as_ref().expect("cluster mode")
    }

    pub(crate) fn run(mut self) {
        let mut stopping = false;
        loop {
            if !stopping && self.sh.stop.load(Ordering::Acquire) {
                stopping = true;
                for i in 0..self.conns.len() {
                    if self.conns[i].state == State::Live {
                        self.kill(i, "loader stopped".into());
                    }
                }
            }
            if stopping && !self.busy() {
                break;
            }
            // RDMA writes complete on the connections' CQs, not the ring.
            let progressed = self.poll_rdma();
            if !stopping {
                self.fill();
                self.flush_grants();
                self.post_recvs();
                self.check_timeouts();
            }
            // About to sleep: arm the CQs, then look once more (a
            // completion that came in before arming raises no event).
            let progressed = progressed || (self.arm_rdma() && self.poll_rdma());
            if !self.wake_inflight {
                let fd = self.net().wake.raw();
                let buf: *mut u64 = &mut *self.wake_buf;
                // SAFETY: the boxed u64 lives as long as this thread's state,
                // and run() waits for this read before returning (busy()).
                if unsafe { self.ring.push_eventfd_read(UD_WAKE, fd, buf) } {
                    self.wake_inflight = true;
                }
            }
            let res = if progressed && !stopping {
                // RDMA work came in: look again at once, no system call
                // unless something is queued.
                self.ring.submit_pending()
            } else if stopping {
                self.ring.submit_wait_timeout(Duration::from_millis(5))
            } else {
                self.ring.submit_wait_timeout(Duration::from_millis(50))
            };
            if let Err(e) = res {
                log::error!("network thread: io_uring: {e}");
                std::thread::sleep(Duration::from_millis(5));
            }
            let n = self.ring.drain(&mut self.completions);
            for i in 0..n {
                let c = self.completions[i];
                self.complete(c);
            }
            if stopping && self.wake_inflight {
                // Complete our own eventfd read so the thread can exit.
                self.net().wake.notify();
            }
        }
    }

    /// Whether ring operations that reference this thread's memory are in
    /// flight (the completion channel's poll references none: the ring is
    /// dropped before the channel).
    fn busy(&self) -> bool {
        self.wake_inflight || self.conns.iter().any(|c| c.rx_inflight || c.tx_inflight)
    }

    /// Polls every RDMA connection's CQ and acts on what completed; re-posts
    /// the receives used. True when anything completed.
    #[cfg(feature = "rdma")]
    fn poll_rdma(&mut self) -> bool {
        use crate::transport::rdma::{completion_error, WorkCompletion};
        if self.rdma.is_none() {
            return false;
        }
        let mut any = false;
        let mut wc = [WorkCompletion::default(); 32];
        for i in 0..self.conns.len() {
            while let Some(r) = self.conns[i].rdma.as_mut() {
                let n = match r.cq.poll(&mut wc) {
                    Ok(n) => n,
                    Err(e) => {
                        self.kill(i, e.to_string());
                        break;
                    }
                };
                if n == 0 {
                    break;
                }
                any = true;
                let recvs = wc[..n].iter().filter(|w| w.wr_id & WR_SEND == 0).count();
                r.consumed += recvs;
                r.next_slot = (r.next_slot + recvs) % RDMA_RECVS;
                for w in &wc[..n] {
                    if self.conns[i].state != State::Live {
                        break; // flushed requests of a connection being shut
                    }
                    if w.status != 0 {
                        let e = completion_error(w);
                        let what = match w.wr_id {
                            WR_BIND => "binding memory windows failed",
                            id if id & WR_INV == WR_INV => "invalidating a memory window failed",
                            _ => "RDMA queue pair failed",
                        };
                        self.kill(i, format!("{what}: {e}"));
                        break;
                    }
                    if w.wr_id & WR_SEND != 0 {
                        self.on_window_completion(i, w.wr_id);
                        continue;
                    }
                    self.conns[i].last_rx = Instant::now();
                    self.on_rdma_completion(i, w);
                }
                if self.conns[i].state == State::Live {
                    let r = self.conns[i].rdma.as_mut().expect("live");
                    if r.consumed >= RDMA_RECVS / 8 {
                        if let Err(e) = r.repost() {
                            self.kill(i, format!("re-posting receives: {e}"));
                        }
                    }
                }
            }
        }
        any
    }

    #[cfg(not(feature = "rdma"))]
    fn poll_rdma(&mut self) -> bool {
        false
    }

    /// Before sleeping with RDMA grants outstanding: arms the CQs and puts a
    /// poll of the completion channel in the ring, so the first completion
    /// wakes the thread. True when anything was armed.
    #[cfg(feature = "rdma")]
    fn arm_rdma(&mut self) -> bool {
        let Some(r) = self.rdma.clone() else {
            return false;
        };
        let mut armed = false;
        for i in 0..self.conns.len() {
            let c = &self.conns[i];
            let Some(rc) = c.rdma.as_ref() else { continue };
            if c.state != State::Live
                || (c.outstanding == 0 && !rc.bind_pending && rc.invs_pending == 0)
            {
                continue;
            }
            if let Err(e) = rc.cq.arm() {
                self.kill(i, e.to_string());
                continue;
            }
            armed = true;
        }
        if !armed {
            return false;
        }
        if !self.chan_inflight && self.ring.push_poll_in(UD_CHAN, r.channel.fd()) {
            self.chan_inflight = true;
        }
        true
    }

    #[cfg(not(feature = "rdma"))]
    fn arm_rdma(&mut self) -> bool {
        false
    }

    /// A send-queue completion of connection `i`: its bind chain is in
    /// force (send the GRANT frame waiting for it), or a window is
    /// invalidated (free it, and finish its grant).
    #[cfg(feature = "rdma")]
    fn on_window_completion(&mut self, i: usize, wr_id: u64) {
        let c = &mut self.conns[i];
        let rc = c.rdma.as_mut().expect("rdma");
        if wr_id == WR_BIND {
            rc.bind_pending = false;
            Self::post_send(&mut self.ring, c);
            return;
        }
        let m = (wr_id & 0xffff_ffff) as usize;
        let idx = std::mem::replace(&mut rc.mw_entry[m], NONE);
        rc.free_mws.push(m as u32);
        rc.invs_pending -= 1;
        let node = c.node;
        let Some(s) = self.table.get(idx as usize).copied() else {
            return;
        };
        if !s.live || s.mw != m as u32 || s.node != node {
            return;
        }
        let idx = idx as usize;
        self.table[idx].mw = NONE;
        let then = std::mem::replace(&mut self.table[idx].after_inv, AfterInv::Nothing);
        self.grant_closed(i, idx, then);
    }

    /// Grant `idx` of connection `i` is over (`then` says how): with a
    /// window, invalidate it first and act once that completes (nothing the
    /// node writes after can land); else act now.
    fn grant_over(&mut self, i: usize, idx: usize, then: AfterInv) {
        #[cfg(feature = "rdma")]
        if self.table[idx].mw != NONE {
            let m = self.table[idx].mw;
            let rc = self.conns[i].rdma.as_mut().expect("a window means RDMA");
            let rkey = rc.mw_rkey[m as usize];
            let op = crate::transport::rdma::WindowOp::Invalidate { rkey };
            match rc
                .qp
                .post_window_ops(&[(WR_INV | m as u64, true, op)], &mut rc.swrs)
            {
                Ok(()) => {
                    rc.invs_pending += 1;
                    self.table[idx].after_inv = then;
                }
                // The connection goes; its grants (this one too) fail over
                // once its QP is gone.
                Err(e) => self.kill(i, e.to_string()),
            }
            return;
        }
        self.grant_closed(i, idx, then);
    }

    /// Grant `idx` no longer counts against connection `i` (its window, if
    /// any, is invalidated): publish it or fail it over. Only now does the
    /// node get credit for another grant, so a GRANT frame sent after this
    /// tells it that the grant's key opens nothing any more.
    fn grant_closed(&mut self, i: usize, idx: usize, then: AfterInv) {
        self.conns[i].outstanding -= 1;
        match then {
            AfterInv::Done => self.finish_sample(i, idx),
            AfterInv::FailOver => self.fail_over(i, idx),
            AfterInv::Nothing => {}
        }
    }

    /// One receive completion of connection `i`: an RDMA write into a
    /// granted range (immediate = grant id), or an ERROR sent on the QP.
    #[cfg(feature = "rdma")]
    fn on_rdma_completion(&mut self, i: usize, w: &crate::transport::rdma::WorkCompletion) {
        use rdma_sys::ibv_wc_opcode::{IBV_WC_RECV, IBV_WC_RECV_RDMA_WITH_IMM};
        let Some(grant) = w.imm else {
            return self.violation(i, "an RDMA completion without immediate data".into());
        };
        match w.opcode {
            IBV_WC_RECV_RDMA_WITH_IMM => {
                let idx = grant as usize & self.mask;
                let s = self.table[idx];
                if !s.outstanding_with(grant, self.conns[i].node) {
                    return self.violation(
                        i,
                        format!(
                            "RDMA write for grant {grant} that is not outstanding with this node"
                        ),
                    );
                }
                if w.byte_len > s.len - s.received {
                    return self.violation(
                        i,
                        format!(
                            "RDMA write of {} bytes for grant {grant} overruns it ({} of {} bytes left)",
                            w.byte_len,
                            s.len - s.received,
                            s.len
                        ),
                    );
                }
                self.table[idx].received += w.byte_len;
                if self.table[idx].received == s.len {
                    self.sample_done(i, idx);
                }
            }
            IBV_WC_RECV => {
                let r = self.conns[i].rdma.as_ref().expect("rdma");
                let at = w.wr_id as usize * RDMA_RECV_BYTES;
                let n = (w.byte_len as usize).min(RDMA_RECV_BYTES);
                if n < 4 || at + n > r.bufs.len() {
                    return self.violation(i, format!("an RDMA ERROR message of {n} bytes"));
                }
                let b = &r.bufs[at..at + n];
                let code = u32::from_le_bytes(b[..4].try_into().expect("4 bytes"));
                let msg = String::from_utf8_lossy(&b[4..]).into_owned();
                let h = Header::error(grant, Code::from_u32(code), 0);
                self.on_error(i, h, &msg);
            }
            op => self.violation(i, format!("unexpected RDMA completion opcode {op}")),
        }
    }

    /// Takes the local samples the pollers handed over (their reads
    /// failed): each becomes an outstanding entry with this node's copy
    /// marked tried, queued (in sequence order) for its next holder or the
    /// source. Its table entry is free: the sample is inside the
    /// flow-control window and unpublished, and the window never holds two
    /// samples with the same entry (see `NetShared::local_failed`).
    fn take_local_failures(&mut self) {
        let local = self.setup.local_node;
        let placement = self.placement;
        while let Ok((p, e)) = self.net().local_failed.1.try_recv() {
            let idx = p.g as usize & self.mask;
            debug_assert!(!self.table[idx].live, "local failover onto a live entry");
            let mut tried = 0u64;
            for r in 0..placement.replicas {
                if Some(placement.holder(p.id, r)) == local {
                    tried |= 1 << r;
                }
            }
            self.table[idx] = GSlot::open(&p, &self.sh.geo, tried, true);
            log::warn!(
                "this node's copy of sample {} failed ({e}); it fails over to a replica or the source",
                p.id
            );
            self.local_errors
                .push((p.g, format!("this node's own copy: {e}")));
            self.net().failovers.fetch_add(1, Ordering::Relaxed);
            let table = &self.table;
            let at = self.regrant.partition_point(|&i| table[i].g < p.g);
            self.regrant.insert(at, idx);
        }
    }

    /// Forgets the local error of entry `idx` once it is served or failed.
    fn local_done(&mut self, idx: usize) -> Option<String> {
        let s = &mut self.table[idx];
        if !s.local {
            return None;
        }
        s.local = false;
        let g = s.g;
        let at = self.local_errors.iter().position(|e| e.0 == g)?;
        Some(self.local_errors.swap_remove(at).1)
    }

    /// Grants what flow control allows: re-grants first, then new samples.
    fn fill(&mut self) {
        self.take_local_failures();
        while let Some(&idx) = self.regrant.front() {
            if !self.place(idx) {
                return;
            }
            self.regrant.pop_front();
        }
        loop {
            let p = match self.pending.take() {
                Some(p) => p,
                None => {
                    let p = self.cursor.next(self.sh.input.catalog());
                    self.new_epoch(p.pos.epoch);
                    p
                }
            };
            // Flow control bounds the walk over local samples too: with
            // every sample local (one node, replicas = nodes) the thread
            // must sleep here, not walk the endless schedule.
            if !self.sh.writable(&p) {
                self.pending = Some(p);
                let net = self.net();
                net.sleeping.store(true, Ordering::SeqCst);
                // Re-check after announcing: a release in between would
                // otherwise find `sleeping` unset and not wake us.
                if self.sh.writable(&p) {
                    net.sleeping.store(false, Ordering::SeqCst);
                    continue;
                }
                return;
            }
            if self.sh.is_local(p.id) {
                continue; // the local pollers read it
            }
            if p.len == 0 {
                self.sh.publish(p.g, CODE_OK);
                continue;
            }
            let idx = p.g as usize & self.mask;
            debug_assert!(!self.table[idx].live, "grant table entry reused while live");
            self.table[idx] = GSlot::open(&p, &self.sh.geo, 0, false);
            if !self.place(idx) {
                // The chosen node has no credit or frame space now.
                self.table[idx].live = false;
                self.pending = Some(p);
                return;
            }
        }
    }

    /// A new epoch's first sample: demoted nodes get grants again.
    fn new_epoch(&mut self, epoch: u64) {
        if self.epoch == Some(epoch) {
            return;
        }
        self.epoch = Some(epoch);
        for c in &mut self.conns {
            if c.demoted {
                c.demoted = false;
                c.errors = 0;
                log::info!(
                    "node {} ({}) gets grants again in epoch {epoch}",
                    c.node,
                    c.addr
                );
            }
        }
    }

    /// A grant of connection `i` failed (ERROR, CRC mismatch): counts it
    /// and demotes the node after [`DEMOTE_AFTER_ERRORS`] in a window.
    fn grant_failed(&mut self, i: usize) {
        let epoch = self.epoch;
        let c = &mut self.conns[i];
        c.last_done = Instant::now();
        if c.errors_since.elapsed() > DEMOTE_WINDOW {
            c.errors = 0;
            c.errors_since = Instant::now();
        }
        c.errors += 1;
        if c.errors >= DEMOTE_AFTER_ERRORS && !c.demoted {
            c.demoted = true;
            log::warn!(
                "node {} ({}): {} failed grants within {} s (latest: {}); no more grants to it in epoch {}, its samples go to replicas or the source",
                c.node,
                c.addr,
                c.errors,
                DEMOTE_WINDOW.as_secs(),
                c.last_error,
                epoch.unwrap_or(0)
            );
        }
    }

    /// Gives table entry `idx` to its next untried live holder, or reads it
    /// from the source, or fails it. False: the holder has no room now.
    fn place(&mut self, idx: usize) -> bool {
        let s = self.table[idx];
        let placement = self.placement;
        for r in 0..placement.replicas {
            if s.tried & (1 << r) != 0 {
                continue;
            }
            let node = placement.holder(s.id, r) as usize;
            let Some(c) = self.conns.get_mut(node) else {
                continue;
            };
            if c.state != State::Live || c.demoted {
                continue;
            }
            if c.outstanding >= c.max_grants || c.fill.len() == c.fill.capacity() {
                return false;
            }
            #[cfg(not(feature = "rdma"))]
            let rkey = 0;
            #[cfg(feature = "rdma")]
            let mut rkey = 0;
            #[cfg(feature = "rdma")]
            if let (Some(rc), Some(r)) = (c.rdma.as_mut(), self.rdma.as_ref()) {
                if r.windows {
                    // A window for exactly this range, bound (with the rest
                    // of the frame's) before the frame goes out.
                    let Some(m) = rc.free_mws.pop() else {
                        return false;
                    };
                    let k = crate::transport::rdma::next_rkey(rc.mw_rkey[m as usize]);
                    rc.mw_rkey[m as usize] = k;
                    rc.mw_entry[m as usize] = idx as u32;
                    rc.binds.push((m, s.phys, s.len as u64));
                    self.table[idx].mw = m;
                    rkey = k;
                } else {
                    rkey = r.ring_mr.rkey();
                }
            }
            let mut e = [0u8; proto::GRANT_ENTRY_BYTES];
            GrantEntry {
                grant: s.g as u32,
                len: s.len,
                sample: s.id,
                offset: s.phys,
                rkey,
            }
            .encode_into(&mut e);
            c.fill.extend_from_slice(&e);
            c.fill_entries += 1;
            if c.outstanding == 0 {
                c.last_rx = Instant::now();
                c.last_done = c.last_rx;
            }
            c.outstanding += 1;
            let t = &mut self.table[idx];
            t.node = node as u32;
            t.tried |= 1 << r;
            t.received = 0;
            return true;
        }
        self.read_from_source(idx);
        true
    }

    /// Last resort: read the sample from the source files.
    fn read_from_source(&mut self, idx: usize) {
        let s = self.table[idx];
        let placement = self.placement;
        let mut tried = String::new();
        let local_error = self.local_done(idx);
        for r in 0..placement.replicas {
            let node = placement.holder(s.id, r) as usize;
            if let Some(c) = self.conns.get(node) {
                let why = if let Some(e) = local_error
                    .as_deref()
                    .filter(|_| Some(node as u32) == self.setup.local_node)
                {
                    e
                } else if s.tried & (1 << r) != 0
                    && !c.last_error.is_empty()
                    && c.state == State::Live
                {
                    c.last_error.as_str()
                } else if c.reason.is_empty() {
                    "no answer"
                } else {
                    c.reason.as_str()
                };
                tried.push_str(&format!("node {node} ({}): {why}; ", c.addr));
            }
        }
        let cat = self.sh.input.catalog();
        let sample = cat.sample(s.id);
        let path = cat.file_path(sample.file);
        let device = self.sh.ring.device();
        let buf: &mut [u8] = if device.is_some() {
            // A GPU ring: read and check on the host, then copy it in. The
            // buffer grows to the largest sample this fallback has read.
            self.bounce.resize(s.len as usize, 0);
            &mut self.bounce[..]
        } else {
            let dst = self.ring_ptr(s.phys);
            // SAFETY: the sample's slot [phys, phys+len) is ours (outstanding,
            // not published) and no connection writes it any more: every holder
            // was tried and its receive has returned.
            unsafe { std::slice::from_raw_parts_mut(dst, s.len as usize) }
        };
        let res = std::fs::File::open(&path)
            .and_then(|f| f.read_exact_at(buf, sample.offset))
            .map_err(|e| {
                match e.raw_os_error() {
                    Some(n) => format!("source {}: {}", path.display(), errno_name(n)),
                    None => format!("source {}: {e}", path.display()),
                }
            })
            .and_then(|()| {
                let got = crc32c::crc32c(buf);
                if got == sample.crc32c {
                    Ok(())
                } else {
                    Err(format!(
                        "source {}: CRC32C {got:08x}, the catalog says {:08x} (changed since the catalog was built)",
                        path.display(),
                        sample.crc32c
                    ))
                }
            })
            .and_then(|()| match device {
                Some(d) => d
                    .copy_from_host(s.phys as usize, buf)
                    .map_err(|e| format!("copying it into the GPU ring: {e}")),
                None => Ok(()),
            });
        self.table[idx].live = false;
        match res {
            Ok(()) => {
                self.net().source_reads.fetch_add(1, Ordering::Relaxed);
                log::info!("sample {} read from the source ({tried})", s.id);
                self.sh.publish(s.g, CODE_OK);
            }
            Err(why) => {
                tried.push_str(&why);
                let e = Error::SampleUnavailable {
                    sample: s.id,
                    tried,
                };
                self.sh.errors.lock().expect("not poisoned").push((s.g, e));
                self.sh.publish(s.g, CODE_ERROR);
            }
        }
    }

    fn ring_ptr(&self, phys: u64) -> *mut u8 {
        // SAFETY: phys < ring length (schedule construction).
        unsafe { self.sh.ring.as_mut_ptr().add(phys as usize) }
    }

    fn flush_grants(&mut self) {
        for i in 0..self.conns.len() {
            let c = &mut self.conns[i];
            if c.state != State::Live || c.tx_inflight || c.bind_pending() {
                continue;
            }
            if c.fill_entries == 0 {
                if c.last_tx.elapsed() >= KEEPALIVE {
                    let h = Header::error(proto::CONNECTION, Code::Unknown, 0).encode();
                    c.flight.clear();
                    c.flight.extend_from_slice(&h);
                    c.flight_sent = 0;
                    c.last_tx = Instant::now();
                    Self::post_send(&mut self.ring, c);
                }
                continue;
            }
            c.last_tx = Instant::now();
            let h = Header::grant(c.fill_entries).encode();
            c.fill[..proto::HEADER_BYTES].copy_from_slice(&h);
            std::mem::swap(&mut c.fill, &mut c.flight);
            c.fill.clear();
            c.fill.resize(proto::HEADER_BYTES, 0);
            c.fill_entries = 0;
            c.flight_sent = 0;
            #[cfg(feature = "rdma")]
            if let Some(rc) = c.rdma.as_mut().filter(|rc| !rc.binds.is_empty()) {
                // The frame goes once its windows are bound (their chain's
                // completion), so no write can arrive before its window.
                let r = self.rdma.as_ref().expect("rdma connection");
                let base = r.ring_mr.addr();
                let binds = rc.binds.iter().map(|&(m, off, len)| {
                    (&rc.mws[m as usize], base + off, len, rc.mw_rkey[m as usize])
                });
                let res = rc.qp.post_binds(&r.ring_mr, binds, WR_BIND, &mut rc.swrs);
                for &(m, _, _) in &rc.binds {
                    rc.mws[m as usize].set_rkey(rc.mw_rkey[m as usize]);
                }
                rc.binds.clear();
                match res {
                    Ok(()) => rc.bind_pending = true,
                    Err(e) => self.kill(i, e.to_string()),
                }
                continue;
            }
            Self::post_send(&mut self.ring, c);
        }
    }

    fn post_send(ring: &mut Uring, c: &mut Conn) {
        let fd = c.sock.as_ref().expect("live").as_raw_fd();
        let rest = &c.flight[c.flight_sent..];
        // SAFETY: `flight` is not touched until this send completes.
        if unsafe {
            ring.push_send(
                UD_SEND | c.node as u64,
                fd,
                rest.as_ptr(),
                rest.len() as u32,
                false,
            )
        } {
            c.tx_inflight = true;
        }
    }

    fn post_recvs(&mut self) {
        for i in 0..self.conns.len() {
            let c = &self.conns[i];
            if c.state != State::Live || c.rx_inflight {
                continue;
            }
            let (buf, len) = match c.rx {
                Rx::Header => (c.hdr.as_ptr() as *mut u8, proto::HEADER_BYTES as u32),
                Rx::Payload { idx, len } => {
                    let s = &self.table[idx];
                    (self.ring_ptr(s.phys + s.received as u64), len)
                }
                Rx::Message(h) => (c.msg.as_ptr() as *mut u8, h.body_len),
            };
            let fd = c.sock.as_ref().expect("live").as_raw_fd();
            // SAFETY: header/message buffers are boxed in the connection; a
            // payload goes to the granted, unpublished part of a sample's
            // slot, checked against the grant before this receive is posted.
            if unsafe { self.ring.push_recv(UD_RECV | i as u64, fd, buf, len) } {
                self.conns[i].rx_inflight = true;
            }
        }
    }

    fn check_timeouts(&mut self) {
        let t = self.setup.node_timeout;
        let progress = t + self.progress_slack;
        for i in 0..self.conns.len() {
            let c = &self.conns[i];
            if c.state != State::Live || c.outstanding == 0 {
                continue;
            }
            let why = if c.last_rx.elapsed() > t {
                format!(
                    "no data for {} ms with {} grants outstanding",
                    t.as_millis(),
                    c.outstanding
                )
            } else if c.last_done.elapsed() > progress {
                format!(
                    "no grant finished within {} ms with {} outstanding (minimum progress: the node timeout plus 1 s per MiB of the largest sample)",
                    progress.as_millis(),
                    c.outstanding
                )
            } else {
                continue;
            };
            log::warn!("node {} ({}): {why}", c.node, c.addr);
            self.kill(i, why);
        }
    }

    /// Shuts a connection; its grants fail over once its receive is back.
    fn kill(&mut self, i: usize, reason: String) {
        let c = &mut self.conns[i];
        if c.state != State::Live {
            return;
        }
        c.reason = reason;
        c.state = State::Closing;
        if let Some(s) = &c.sock {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
        #[cfg(feature = "rdma")]
        if let Some(r) = &c.rdma {
            // From now on the QP accepts no write; it is destroyed (and so
            // done with the ring) before its grants move elsewhere.
            if let Err(e) = r.qp.set_error() {
                log::warn!("node {}: {e}", c.node);
            }
        }
        self.maybe_dead(i);
    }

    fn maybe_dead(&mut self, i: usize) {
        let c = &mut self.conns[i];
        if c.state != State::Closing || c.rx_inflight || c.tx_inflight {
            return;
        }
        c.state = State::Dead;
        c.sock = None;
        c.outstanding = 0;
        #[cfg(feature = "rdma")]
        {
            c.rdma = None; // destroys the QP, then its CQ
        }
        let node = c.node;
        if self.sh.stop.load(Ordering::Acquire) {
            return;
        }
        let mut moved = 0;
        for idx in 0..self.table.len() {
            let s = &mut self.table[idx];
            if s.live && s.node == node {
                s.node = NONE;
                s.received = 0;
                // Its window went with the QP.
                s.mw = NONE;
                s.after_inv = AfterInv::Nothing;
                self.regrant.push_back(idx);
                moved += 1;
            }
        }
        // Keep sequence order: the consumer waits on the oldest first.
        let table = &self.table;
        self.regrant.make_contiguous().sort_by_key(|&i| table[i].g);
        self.net().failovers.fetch_add(moved, Ordering::Relaxed);
        log::warn!(
            "node {node} ({}) is gone ({}): {moved} outstanding grants fail over; its later samples go to replicas",
            self.conns[i].addr,
            self.conns[i].reason
        );
    }

    fn complete(&mut self, comp: Completion) {
        let i = (comp.user_data & 0xffff_ffff) as usize;
        match comp.user_data & UD_KIND {
            UD_WAKE => self.wake_inflight = false,
            UD_CHAN => {
                self.chan_inflight = false;
                #[cfg(feature = "rdma")]
                if let Some(r) = &self.rdma {
                    r.channel.drain();
                }
            }
            UD_SEND => {
                let c = &mut self.conns[i];
                c.tx_inflight = false;
                if c.state == State::Live {
                    if comp.result <= 0 {
                        let why = format!("send failed: {}", errno_name(-comp.result));
                        self.kill(i, why);
                    } else {
                        c.flight_sent += comp.result as usize;
                        if c.flight_sent < c.flight.len() {
                            Self::post_send(&mut self.ring, c);
                        }
                    }
                }
                self.maybe_dead(i);
            }
            UD_RECV => {
                self.conns[i].rx_inflight = false;
                if self.conns[i].state == State::Live {
                    self.on_recv(i, comp.result);
                }
                self.maybe_dead(i);
            }
            _ => log::error!("network thread: unknown completion {:#x}", comp.user_data),
        }
    }

    fn violation(&mut self, i: usize, what: String) {
        let c = &self.conns[i];
        let e = Error::ProtocolViolation {
            node: c.node,
            addr: c.addr.clone(),
            what,
        };
        log::error!("{e}; dropping the connection");
        self.kill(i, e.to_string());
    }

    fn on_recv(&mut self, i: usize, res: i32) {
        let c = &mut self.conns[i];
        let want = match c.rx {
            Rx::Header => proto::HEADER_BYTES as u32,
            Rx::Payload { len, .. } => len,
            Rx::Message(h) => h.body_len,
        };
        if res < 0 {
            let why = format!(
                "receive failed: {} ({})",
                errno_name(-res),
                std::io::Error::from_raw_os_error(-res)
            );
            self.kill(i, why);
            return;
        }
        if (res as u32) < want {
            let why = if res == 0 && c.rx == Rx::Header {
                "closed the connection".to_string()
            } else {
                format!("connection ended in the middle of a frame ({res} of {want} bytes)")
            };
            self.kill(i, why);
            return;
        }
        c.last_rx = Instant::now();
        match c.rx {
            Rx::Header => {
                let h = match Header::decode(&c.hdr, c.max_data) {
                    Ok(h) => h,
                    Err(e) => return self.violation(i, e.to_string()),
                };
                if self.conns[i].is_rdma()
                    && (h.kind == Kind::Data || (h.kind == Kind::Error && h.a != proto::CONNECTION))
                {
                    // Over RDMA data and grant errors come on the QP, in
                    // order with the writes; on TCP they could overtake them.
                    return self.violation(
                        i,
                        format!(
                            "{:?} frame on the control connection of an RDMA link",
                            h.kind
                        ),
                    );
                }
                match h.kind {
                    Kind::Data => self.on_data_header(i, h),
                    Kind::Error if h.body_len > 0 => self.conns[i].rx = Rx::Message(h),
                    Kind::Error => self.on_error(i, h, ""),
                    k => self.violation(i, format!("unexpected {k:?} frame")),
                }
            }
            Rx::Payload { idx, len } => {
                c.rx = Rx::Header;
                let s = &mut self.table[idx];
                s.received += len;
                if s.received == s.len {
                    self.sample_done(i, idx);
                }
            }
            Rx::Message(h) => {
                c.rx = Rx::Header;
                let msg = String::from_utf8_lossy(&c.msg[..h.body_len as usize]).into_owned();
                self.on_error(i, h, &msg);
            }
        }
    }

    /// Checks a DATA header against the outstanding grant before any of its
    /// payload is read.
    fn on_data_header(&mut self, i: usize, h: Header) {
        let idx = h.a as usize & self.mask;
        let s = self.table[idx];
        let node = self.conns[i].node;
        if !s.outstanding_with(h.a, node) {
            return self.violation(
                i,
                format!(
                    "DATA for grant {} that is not outstanding with this node",
                    h.a
                ),
            );
        }
        let expect = s.phys + s.received as u64;
        if h.c != expect {
            return self.violation(
                i,
                format!(
                    "DATA for grant {} at ring offset {}, expected {} (grant covers {}+{})",
                    h.a, h.c, expect, s.phys, s.len
                ),
            );
        }
        if h.body_len > s.len - s.received {
            return self.violation(
                i,
                format!(
                    "DATA for grant {} of {} bytes overruns the grant ({} of {} bytes left)",
                    h.a,
                    h.body_len,
                    s.len - s.received,
                    s.len
                ),
            );
        }
        self.conns[i].rx = Rx::Payload {
            idx,
            len: h.body_len,
        };
    }

    fn on_error(&mut self, i: usize, h: Header, msg: &str) {
        let code = Code::from_u32(h.b);
        if h.a == proto::CONNECTION {
            let why = format!("{}: {msg}", code.name());
            return self.kill(i, why);
        }
        let idx = h.a as usize & self.mask;
        let s = self.table[idx];
        if !s.outstanding_with(h.a, self.conns[i].node) {
            return self.violation(
                i,
                format!(
                    "ERROR for grant {} that is not outstanding with this node",
                    h.a
                ),
            );
        }
        let c = &mut self.conns[i];
        c.last_error = format!("{}: {msg}", code.name());
        log::warn!(
            "node {} ({}) cannot serve sample {}: {}",
            c.node,
            c.addr,
            s.id,
            c.last_error
        );
        self.grant_over(i, idx, AfterInv::FailOver);
    }

    /// Grant `idx` failed on connection `i`: it goes back in line for its
    /// next holder (or the source), and the node's failure is counted.
    fn fail_over(&mut self, i: usize, idx: usize) {
        self.net().failovers.fetch_add(1, Ordering::Relaxed);
        let t = &mut self.table[idx];
        t.node = NONE;
        t.received = 0;
        self.regrant.push_back(idx);
        self.grant_failed(i);
    }

    fn sample_done(&mut self, i: usize, idx: usize) {
        self.conns[i].last_done = Instant::now();
        self.grant_over(i, idx, AfterInv::Done);
    }

    /// All of grant `idx`'s bytes are in and nothing more can land there:
    /// checks them (`verify_crc32c`) and publishes the sample.
    fn finish_sample(&mut self, i: usize, idx: usize) {
        let s = self.table[idx];
        if self.sh.cfg.verify_crc32c {
            let want = self.sh.input.catalog().sample(s.id).crc32c;
            // SAFETY: every byte of the slot was received and it is unpublished.
            let got = crc32c::crc32c(unsafe {
                std::slice::from_raw_parts(self.ring_ptr(s.phys), s.len as usize)
            });
            if got != want {
                // Like an ERROR for the grant: the next holder, then the
                // source (which is checked too) serve it again in full.
                let c = &mut self.conns[i];
                c.last_error = format!(
                    "sample {} arrived with CRC32C {got:08x}, the catalog says {want:08x}",
                    s.id
                );
                log::warn!("node {} ({}): {}", c.node, c.addr, c.last_error);
                self.fail_over(i, idx);
                return;
            }
        }
        self.table[idx].live = false;
        self.local_done(idx);
        self.conns[i].last_done = Instant::now();
        self.net().remote_samples.fetch_add(1, Ordering::Relaxed);
        self.sh.publish(s.g, CODE_OK);
    }
}
