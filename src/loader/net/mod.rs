//! The consumer's network thread (cluster mode).
//!
//! It walks the same schedule as the pollers and takes the samples the local
//! space does not hold. For each, once flow control allows (its slot is
//! behind the released mark plus the ring size), it grants the sample's
//! first live holder the ring range `[phys, phys + len)`, batching grants per
//! node into GRANT frames. One io_uring carries every socket: per connection
//! one receive is always posted, either a 24-byte header or, once a DATA
//! header has been checked against its outstanding grant (id, node, offset,
//! length), the payload straight into the ring at the granted offset (a
//! payload of at most 64 KiB (`TCP_LOOKAHEAD_BYTES`) together with the next
//! frame's header, which is checked in turn before its payload). A frame
//! that matches no grant drops the connection with a named error before a
//! byte of its payload is read, so a peer writes only where it was granted.
//!
//! Heartbeats: the first frame to each node is a keepalive asking for
//! heartbeats, slow ones while idle; a node that sends them (an empty
//! connection ERROR, code 0, whenever it sent nothing for 250 ms while it
//! has grants of ours, and, a node that says its idle timeout in them, every
//! 5 s while it has none) and then goes silent for [`HEARTBEAT_SILENCE`]
//! with grants outstanding (`node_timeout` with none, at least
//! [`IDLE_SILENCE`] for a slow-beating node) is taken for dead, so a dead
//! host costs about 2 s, not `node_timeout`, and an idle node paused for a
//! few seconds keeps its connection. A dead
//! node is reconnected later over TCP (`redial.rs`). TCP_USER_TIMEOUT bounds
//! unacknowledged bytes on every control connection.
//!
//! Failover: a connection that closes, fails, breaks the protocol, misses
//! its heartbeats or stays silent for `node_timeout` with grants
//! outstanding is shut; once its last
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
//!
//! Over RDMA a node WRITE_WITH_IMMs into the registered ring instead of
//! sending DATA frames (see [`Receive`] and `rdma.rs`); the control
//! connection, grants and failover are the same.
//!
//! Files: this one is the thread (its loop, connection lifecycle and the
//! [`Receive`] seam); `grants.rs` the grant table (flow control, placement,
//! failover, publishing); `source.rs` the source fallback's reads (through
//! this thread's ring); `socket.rs` the control
//! connection (GRANT frames out, frames in through
//! [`crate::transport::rx::FrameRx`]); `sweep.rs` which connections a
//! sweep looks at for timeouts, keepalives and redials; `connect.rs` the handshakes;
//! `tcp.rs` and `rdma.rs` the two implementations of [`Receive`].
//!
//! Why this file is over ~800 lines: the thread's loop, each connection's
//! lifecycle (live, closing, dead, redialled) and the silence clocks that judge
//! it are one state; the grant table, socket, connect and redial code are
//! already apart.

use std::net::TcpStream;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::schedule::Placed;
use super::Shared;
use crate::dataset::Placement;
use crate::error::{errno_name, Error, Result};
use crate::landing::LandingRing;
use crate::ring::{Completion, IoBackend, Uring, UringOptions};
use crate::stall::{Phase, Stall};
use crate::sys::EventFd;
use crate::transport::proto::Hello;
use crate::transport::rx::FrameRx;
use crate::transport::Cluster;

mod connect;
#[cfg(feature = "rdma")]
pub(crate) mod cqs;
mod data_poll;
mod grants;
pub(crate) mod handshake;
mod hub;
pub(crate) mod lanes;
mod notice;
#[cfg(feature = "rdma")]
pub(crate) mod rdma;
#[cfg(feature = "rdma")]
mod recvs;
mod redial;
mod retry;
mod socket;
mod source;
#[cfg(feature = "s3")]
mod store_fetch;
mod sweep;
mod tcp;

#[cfg(test)]
pub(crate) use connect::connect_with_for_tests;
#[cfg(test)]
pub(crate) use connect::sim_connections;
pub(crate) use connect::{connect_all, Connected, Connections};
use grants::AfterInv;
pub(crate) use grants::NONE;
pub(crate) use hub::{HubSlot, NetHub};
use lanes::Lane;
#[cfg(feature = "rdma")]
pub(crate) use rdma::shared_links_usable;
pub(crate) use retry::ConnectError;
#[cfg(test)]
pub(crate) use tcp::TcpRx as SimRx;
use tcp::TcpRx;

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
/// closes only peers that are gone. Once the node's heartbeats say its
/// idle timeout, a quarter of it (at most [`KEEPALIVE_MAX`]) instead: a
/// node of a 4,096-node cluster then receives a few hundred keepalives a
/// second, not 4,095.
pub(crate) const KEEPALIVE: Duration = Duration::from_secs(1);
/// The longest keepalive interval (see [`KEEPALIVE`]): keepalives also
/// keep NAT and firewall state along the path, which may expire after
/// 30 s or more.
const KEEPALIVE_MAX: Duration = Duration::from_secs(15);
/// The shortest silence after which a slow-beating node (one whose
/// heartbeats say its idle timeout: it beats an idle connection only every
/// [`proto::IDLE_HEARTBEAT_INTERVAL`]) with nothing granted is taken for
/// dead (else `node_timeout`, when longer): three of its idle intervals, so
/// a live idle node is never lost to a short `node_timeout`. A node that
/// beats every 250 ms (an older build) keeps `node_timeout`.
const IDLE_SILENCE: Duration = Duration::from_secs(15);
/// A grant to a slow-beating node restarts the silence clock (its idle
/// silence says nothing), unless the node was already silent this long
/// (its idle interval, the node's once-a-second look at idle connections
/// and 2 s of margin): then the silence counts, and a node dead for long
/// is shut at the next check, as with a fast-beating one.
const SLOW_BEAT_STALE: Duration = Duration::from_secs(8);
/// A node that sends heartbeats (it answered the first keepalive, which
/// asks for them, with one) and sent nothing at all for this long is
/// taken for dead when grants are outstanding on it (idle: after
/// `node_timeout`: an idle node may be paused for a few seconds, and
/// losing it costs a reconnect, or over RDMA the run): eight heartbeat intervals, so
/// a live node's poller can miss several on a loaded machine. (Bounded by
/// `node_timeout` when that is shorter.) A node that does not send them
/// (an older build) is judged by `node_timeout` alone, as before.
pub(crate) const HEARTBEAT_SILENCE: Duration = Duration::from_secs(2);
/// The longest TCP_USER_TIMEOUT on a control connection (it is
/// `node_timeout`, at most this and at least [`USER_TIMEOUT_MIN`]): a
/// GRANT or keepalive that a dead host never acknowledges fails the
/// connection after it, also with a node that sends no heartbeats.
pub(crate) const USER_TIMEOUT_MAX: Duration = Duration::from_secs(5);
/// See [`USER_TIMEOUT_MAX`].
pub(crate) const USER_TIMEOUT_MIN: Duration = Duration::from_secs(1);
/// A gap this long between two looks at the clocks means the thread did
/// not run (the process was stopped, or starved): the silence clocks are
/// moved on by the gap, so nodes are not blamed for it.
const NOT_RUNNING: Duration = Duration::from_secs(1);
/// Over TCP, a DATA payload of at most this many bytes is received with
/// the next frame's header in one `recvmsg` (one io_uring round trip per
/// frame where it took two); larger ones keep one `MSG_WAITALL` receive,
/// which the kernel fills as the bytes come with no completion per piece.
/// 64 KiB: on tiny samples (4.5 KiB, 2 epochs of 200,000) the look-ahead
/// halves the network thread's system calls, while on imagenet-sized payloads (~127 KiB) a
/// 256 KiB limit cut completions by 40% but did not read faster, one
/// sender to one consumer (BENCHMARKS.md, "One receive per small DATA
/// frame").
/// `KSPEED_TCP_LOOKAHEAD_BYTES` in the consumer's environment sets another
/// limit (0: every payload alone, as before), for measuring it.
const TCP_LOOKAHEAD_BYTES: u32 = 64 << 10;

/// [`TCP_LOOKAHEAD_BYTES`], or the environment's setting.
fn tcp_lookahead_bytes() -> u32 {
    static BYTES: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
    *BYTES.get_or_init(|| {
        let v = std::env::var("KSPEED_TCP_LOOKAHEAD_BYTES").ok();
        match v.as_deref().map(str::parse::<u32>) {
            None => TCP_LOOKAHEAD_BYTES,
            Some(Ok(n)) => n,
            Some(Err(_)) => {
                log::warn!(
                    "KSPEED_TCP_LOOKAHEAD_BYTES={:?} is not a byte count; using {TCP_LOOKAHEAD_BYTES}",
                    v.unwrap_or_default()
                );
                TCP_LOOKAHEAD_BYTES
            }
        }
    })
}

/// A silence clock `t` moved on by a gap of `gap` in which the thread did
/// not run, but never past `now`: frames drained right after the pause set
/// the clock to about `now`, and adding the gap to that would put it in
/// the future and so excuse a later silence for as long as the pause was.
fn shift_for_pause(t: Instant, gap: Duration, now: Instant) -> Instant {
    (t + gap).min(now)
}

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
    /// The nodes' spaces are partial (this node's is, and every node has
    /// its budget): who holds what, so that a sample goes only to a node
    /// that holds it and one no node holds is read from the source by this
    /// node's pollers.
    pub(crate) partial: Option<Arc<crate::dataset::PartialHolders>>,
    /// In an agent with a node service: where a node judged dead by this
    /// thread's own clocks is posted, for the service to tell the other
    /// nodes' consumers (`notice.rs`).
    pub(crate) notices: Option<Arc<crate::transport::notices::NodeNotices>>,
}

/// What the consumer thread and the network thread share.
pub(crate) struct NetShared {
    /// The network thread's wake-up (one for every lane of a shared
    /// thread, `hub.rs`).
    pub(crate) wake: Arc<EventFd>,
    /// Set by the network thread while flow control holds it back; the
    /// consumer's release clears it and wakes the thread.
    pub(crate) sleeping: AtomicBool,
    pub(crate) remote_samples: AtomicU64,
    /// Remote samples served from the memory tier (filled by an earlier
    /// push) instead of a grant.
    pub(crate) tier_hits: AtomicU64,
    pub(crate) failovers: AtomicU64,
    pub(crate) source_reads: AtomicU64,
    pub(crate) source_bytes: AtomicU64,
    /// Ticks longer than the stall threshold (`crate::stall`).
    pub(crate) loop_stalls: AtomicU64,
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
    /// The lowest and highest epochs in which this node's own copies are
    /// demoted (`u64::MAX` and 0: none): its local samples are handed over
    /// without a read, like a demoted node's samples go to the next holder.
    /// Set by the network thread after [`DEMOTE_AFTER_ERRORS`] local
    /// failures within [`DEMOTE_WINDOW`]; each demotion is for its epoch
    /// only. A sample outside the range costs two atomic loads; inside it,
    /// `local_demoted_set` says which epochs are demoted: read-ahead
    /// failures that demote epoch E+1 leave E demoted while its samples
    /// are still read.
    local_demoted_from: AtomicU64,
    local_demoted_to: AtomicU64,
    /// Which epochs are demoted, and why (the latest local failure), for
    /// the samples' error if no other copy can serve them. Written before
    /// the range.
    local_demoted_set: std::sync::Mutex<DemotedEpochs>,
}

/// The epochs in which this node's own copies are demoted: the latest 64
/// at most (epochs `base..base + 64`, one bit each; an older one is long
/// read when a demotion 64 epochs later comes), and why.
#[derive(Default)]
struct DemotedEpochs {
    base: u64,
    bits: u64,
    why: Option<Error>,
}

impl DemotedEpochs {
    fn insert(&mut self, epoch: u64, why: Error) {
        if self.bits == 0 {
            self.base = epoch;
        } else if epoch < self.base {
            let shift = self.base - epoch;
            self.bits = if shift >= 64 { 0 } else { self.bits << shift };
            self.base = epoch;
        } else if epoch - self.base >= 64 {
            let shift = epoch - self.base - 63;
            self.bits = if shift >= 64 { 0 } else { self.bits >> shift };
            self.base += shift;
        }
        self.bits |= 1 << (epoch - self.base);
        self.why = Some(why);
    }

    fn get(&self, epoch: u64) -> Option<Error> {
        let off = epoch.checked_sub(self.base)?;
        if off >= 64 || self.bits & (1 << off) == 0 {
            return None;
        }
        self.why.clone()
    }

    /// The lowest and highest demoted epoch (`u64::MAX`, 0 when none).
    fn range(&self) -> (u64, u64) {
        if self.bits == 0 {
            return (u64::MAX, 0);
        }
        (
            self.base + self.bits.trailing_zeros() as u64,
            self.base + 63 - self.bits.leading_zeros() as u64,
        )
    }
}

/// A local sample whose read failed, and why.
type HandedOver = (Placed, Error);

impl NetShared {
    /// `window_samples`: the most samples the ring holds at once (the
    /// ready table's length).
    pub(crate) fn new(window_samples: usize) -> Result<Self> {
        let wake = EventFd::new().map_err(|e| Error::Serve(format!("eventfd: {e}")))?;
        Ok(Self::with_wake(window_samples, Arc::new(wake)))
    }

    /// The same, woken through `wake` (a shared network thread's, which
    /// every lane's releases and hand-overs notify).
    pub(crate) fn with_wake(window_samples: usize, wake: Arc<EventFd>) -> Self {
        NetShared {
            wake,
            sleeping: AtomicBool::new(false),
            remote_samples: AtomicU64::new(0),
            tier_hits: AtomicU64::new(0),
            failovers: AtomicU64::new(0),
            source_reads: AtomicU64::new(0),
            source_bytes: AtomicU64::new(0),
            loop_stalls: AtomicU64::new(0),
            local_failed: crossbeam_channel::bounded(window_samples.max(1)),
            local_demoted_from: AtomicU64::new(u64::MAX),
            local_demoted_to: AtomicU64::new(0),
            local_demoted_set: std::sync::Mutex::new(DemotedEpochs::default()),
        }
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

    /// Whether this node's own copies are demoted in `epoch` (a poller
    /// then hands its local samples over unread), and why. One atomic load
    /// per local sample while they are not.
    pub(crate) fn local_demoted(&self, epoch: u64) -> Option<Error> {
        if epoch < self.local_demoted_from.load(Ordering::Acquire)
            || epoch > self.local_demoted_to.load(Ordering::Acquire)
        {
            return None;
        }
        self.local_demoted_set
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(epoch)
    }

    /// Demotes this node's own copies for `epoch` (see `local_demoted`),
    /// leaving the epochs demoted before demoted.
    fn demote_local(&self, epoch: u64, why: Error) {
        let mut set = self
            .local_demoted_set
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        set.insert(epoch, why);
        let (from, to) = set.range();
        // Widened only while the set is held: a reader that sees the new
        // range finds the epoch in the set.
        self.local_demoted_from.store(from, Ordering::Release);
        self.local_demoted_to.store(to, Ordering::Release);
    }

    /// Called after the consumer moved the released mark.
    pub(crate) fn released(&self) {
        if self.sleeping.swap(false, Ordering::SeqCst) {
            self.wake.notify();
        }
    }
}

/// The consumer side of one connection's data path: how a node's writes
/// land in the ring and how this thread learns of them. It mirrors the owner
/// side's [`Link`](crate::transport::Link): where a link *posts* writes
/// into granted ranges and *polls* their completions, a `Receive` *opens*
/// a ring range for each grant (and closes it when the grant is over),
/// *flushes* what it opened before the GRANT frame naming those ranges
/// goes out, and is *polled* for what landed.
///
/// - [`TcpRx`]: a node's bytes come as DATA frames on the control
///   connection itself, each header checked against its grant before its
///   payload is received into the ring (`socket.rs`); nothing to open,
///   flush or poll.
/// - `rdma::RdmaRx` (the `rdma` feature): WRITE_WITH_IMM into the
///   registered ring, under a memory window bound to exactly the granted
///   range where the device has them; completions and ERROR messages come
///   on the connection's completion queue.
///
/// The network thread is generic over it (static dispatch, one
/// monomorphised loop per transport); nothing it calls allocates.
pub(crate) trait Receive: Sized + Send + 'static {
    /// What the connections of one launch share (RDMA: the device, the
    /// completion channel, the ring's registration); the thread drops it
    /// after them.
    type Common: Send + Sync + 'static;

    /// Whether a node's bytes and grant ERRORs arrive as frames on the
    /// control connection (TCP), not as completions [`Receive::poll`]
    /// returns (a DATA frame, or an ERROR for a grant, on an RDMA link's
    /// control connection is a protocol violation: it could overtake the
    /// writes it follows).
    const FRAMED: bool;

    /// After WELCOME on `sock`: sets up this connection's data path with
    /// node `node` at `addr`.
    /// What a reconnect thread needs to set up a connection again (a
    /// clone of `common`); `None` (the default): this data path is not set
    /// up again, and a dead node stays dead.
    fn redial_common(_common: &Self::Common) -> Option<Self::Common> {
        None
    }

    /// What a connection's setup holds between [`Receive::begin`] and
    /// [`Receive::finish`] (RDMA: its queue pair, not yet connected).
    type Pending: Send;

    /// The name of the message the data path exchanges after WELCOME, for
    /// errors ("no RDMA_ENDPOINT: …").
    const EXCHANGE: &'static str;

    /// After WELCOME from node `node` at `addr`, over a control
    /// connection leaving from `local`: starts this connection's data
    /// path, and gives the message to send the node, if any (its answer
    /// goes to [`Receive::finish`]). Must not block.
    fn begin(
        common: &Self::Common,
        local: std::net::IpAddr,
        node: u32,
        addr: &str,
    ) -> Result<(Self::Pending, Option<Vec<u8>>), ConnectError>;

    /// Completes the data path with the node's answer (a frame's header
    /// and body; None when [`Receive::begin`] sent nothing). Must not
    /// block.
    fn finish(
        common: &Self::Common,
        pending: Self::Pending,
        answer: Option<(&crate::transport::proto::Header, &[u8])>,
        node: u32,
        addr: &str,
    ) -> Result<Self, ConnectError>;

    /// The descriptor that becomes readable when an armed connection has a
    /// completion; `None`: nothing to wait for besides the sockets.
    fn wake_fd(common: &Self::Common) -> Option<RawFd>;

    /// [`Receive::wake_fd`] became readable: takes its events.
    fn woke(common: &Self::Common);

    /// Opens ring range `[phys, phys + len)` of lane `lane`'s ring for
    /// grant-table entry `entry`: the remote key its GRANT entry carries
    /// and the window it holds (`NONE`: none). `None`: no room now (all
    /// windows in use).
    fn open(&mut self, entry: usize, lane: usize, phys: u64, len: u32) -> Option<(u32, u32)>;

    /// What a shared thread (`hub.rs`) keeps of each lane's ring for its
    /// links (RDMA: its registration, which windows bind over).
    type RingReg: Send;

    /// Registers a joining lane's `ring` with the thread's `common`.
    fn register_ring(common: &Self::Common, ring: &LandingRing) -> Result<Self::RingReg>;

    /// The GRANT entry offset of `phys` in the ring of `reg`, on a shared
    /// link: where the owner writes is the HELLO's ring address plus it.
    fn wire_offset(reg: &Self::RingReg, phys: u64) -> u64;

    /// Gives this connection lane `lane`'s ring (`None`: takes it back,
    /// once no window of its is bound).
    fn set_ring(&mut self, lane: usize, reg: Option<&Self::RingReg>);

    /// Makes the ranges opened since the last call usable before their
    /// GRANT frame goes out: true when the frame must wait for
    /// [`Event::Flushed`].
    fn flush(&mut self) -> Result<bool>;

    /// A flush is in progress (the GRANT frame waits).
    fn flushing(&self) -> bool;

    /// Closes `window` of a grant that is over (queued until the next
    /// [`Receive::flush_closes`]); [`Event::Closed`] follows.
    fn close(&mut self, window: u32) -> Result<()>;

    /// Starts the closes queued since the last call (RDMA: one chain of
    /// invalidations per tick, only its last request signalled). Called
    /// every tick before the thread may sleep.
    fn flush_closes(&mut self) -> Result<()>;

    /// After [`Event::Closed`]: the windows it closed, oldest first, each
    /// with the grant-table entry it opened (`NONE` if none).
    fn take_closed(&mut self) -> Option<(u32, u32)>;

    /// The connection is being shut: accept nothing more from the node.
    fn shut(&mut self) -> Result<()>;

    /// No flush or close is in progress.
    fn idle(&self) -> bool;

    /// Asks for an event on [`Receive::wake_fd`] at the next completion.
    fn arm(&self) -> Result<()>;

    /// Takes a batch of completions; returns how many, to be read with
    /// [`Receive::take`] in order (a connection whose completions are its
    /// own: [`Receive::poll_shared`] gave `None`).
    fn poll(&mut self) -> Result<usize>;

    /// A completion of the CQs a thread's connections share.
    type Wc: Copy + Default;

    /// Moves up to `out.len()` completions of the CQs `common`'s
    /// connections share into `out`: how many (`cqs.rs`). `None`: each
    /// connection polls its own ([`Receive::poll`]).
    fn poll_shared(common: &Self::Common, out: &mut [Self::Wc]) -> Option<Result<usize>>;

    /// The node whose connection each shared completion of `ws` is of,
    /// into `nodes` (`u32::MAX`: none now).
    fn route_shared(common: &Self::Common, ws: &[Self::Wc], nodes: &mut [u32]);

    /// After shared completions `ws` were handled: re-posts the shared
    /// receives they used (RDMA: the thread's SRQ's, `recvs.rs`).
    fn refill_shared(common: &Self::Common, ws: &[Self::Wc]) -> Result<()>;

    /// Shared completion `w`, if it is this data path's (`None`: a data
    /// path's this connection had before, gone since).
    fn take_shared(&mut self, w: &Self::Wc) -> Option<Event>;

    /// Arms the shared CQs (false: there are none, each connection arms
    /// its own with [`Receive::arm`]).
    fn arm_shared(common: &Self::Common) -> Result<bool>;

    /// A dead connection's data path must outlive its completions still
    /// in the shared CQs (RDMA with the thread's SRQ: destroying its QP
    /// would let a driver drop them, and the receives they used with
    /// them, never to be posted again).
    fn retire_when_dead(common: &Self::Common) -> bool;

    /// The `k`-th completion of the last poll.
    fn take(&mut self, k: usize) -> Event;

    /// After a poll's completions were handled (the connection is live):
    /// re-posts what they used up.
    fn refill(&mut self) -> Result<()>;
}

/// A completion of a [`Receive`] (only the RDMA data path has any).
#[cfg_attr(not(feature = "rdma"), allow(dead_code))]
pub(crate) enum Event {
    /// A request failed (the connection is broken): why.
    Failed(String),
    /// The last flush is in force: its GRANT frame can go.
    Flushed,
    /// Windows are closed: read them with [`Receive::take_closed`].
    Closed,
    /// A receive completed (the node is alive), carrying this.
    Received(Landed),
}

/// What a node sent on the data path (RDMA; over TCP it comes in frames).
#[cfg_attr(not(feature = "rdma"), allow(dead_code))]
pub(crate) enum Landed {
    /// `bytes` landed for grant `grant`.
    Wrote {
        /// Grant id.
        grant: u32,
        /// Bytes written.
        bytes: u32,
    },
    /// Grant `grant` cannot be served: the node's code and message.
    Error {
        /// Grant id.
        grant: u32,
        /// `proto::Code` as sent.
        code: u32,
        /// Its message.
        msg: String,
    },
    /// Something the protocol does not allow: what.
    Violation(String),
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum State {
    Live,
    /// Shut down; waiting for its in-flight receive and send to return.
    Closing,
    Dead,
}

/// One connection to a node.
pub(crate) struct Conn<R> {
    node: u32,
    addr: String,
    /// The control socket's descriptor (-1 once dead): what the ring's
    /// operations name. `sock` owns it in production; the simulator's
    /// connections are MemNet endpoints that nothing owns.
    fd: RawFd,
    sock: Option<TcpStream>,
    state: State,
    /// Why it is dead (for messages).
    reason: String,
    /// The last ERROR a grant got from it.
    last_error: String,
    /// The control connection's receive: headers, ERROR messages and (TCP)
    /// DATA payloads, which name their grant-table entry.
    rx: FrameRx<usize>,
    /// GRANT frame being filled (header space first) and the one in flight.
    fill: Vec<u8>,
    fill_entries: u32,
    /// Entries one GRANT frame holds (the node's limit): the frame is full
    /// at this count, whatever capacity its Vec was given (an allocator
    /// may give more than asked).
    fill_max_entries: u32,
    flight: Vec<u8>,
    flight_sent: usize,
    tx_inflight: bool,
    /// Closes are queued on its data path and it is in the thread's
    /// `closing` list.
    closing: bool,
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
    /// Its data path; dropped (an RDMA QP destroyed) once it is dead.
    data: Option<R>,
}

impl<R: Receive> Conn<R> {
    /// Its GRANT frame waits for its data path's flush.
    fn flushing(&self) -> bool {
        self.data.as_ref().is_some_and(|d| d.flushing())
    }

    /// The control socket of a live connection.
    fn fd(&self) -> RawFd {
        debug_assert!(self.fd >= 0, "a connection without a socket");
        self.fd
    }

    /// A live connection on control socket `fd` (owned by `sock`; None in
    /// the simulator), its handshake done with WELCOME's `max_grants` and
    /// `max_data`; its GRANT frame buffers sized for them, its clocks at
    /// `now`.
    #[allow(clippy::too_many_arguments)]
    fn live(
        node: u32,
        addr: String,
        fd: RawFd,
        sock: Option<TcpStream>,
        max_grants: u64,
        max_data: u32,
        data: R,
        now: Instant,
    ) -> Self {
        let entries = crate::transport::proto::MAX_GRANT_ENTRIES.min(max_grants.max(1) as usize);
        let frame = crate::transport::proto::HEADER_BYTES
            + entries * crate::transport::proto::GRANT_ENTRY_BYTES;
        let mut fill = Vec::with_capacity(frame);
        fill.resize(crate::transport::proto::HEADER_BYTES, 0);
        Conn {
            node,
            addr,
            fd,
            sock,
            state: State::Live,
            reason: String::new(),
            last_error: String::new(),
            rx: FrameRx::new(crate::transport::proto::MAX_MESSAGE_BYTES)
                .with_lookahead(tcp_lookahead_bytes()),
            fill,
            fill_entries: 0,
            fill_max_entries: entries as u32,
            flight: Vec::with_capacity(frame),
            flight_sent: 0,
            tx_inflight: false,
            closing: false,
            outstanding: 0,
            max_grants: max_grants.max(1),
            max_data: max_data.min(crate::transport::proto::MAX_DATA_BYTES),
            last_rx: now,
            last_done: now,
            errors: 0,
            errors_since: now,
            demoted: false,
            last_tx: now,
            data: Some(data),
        }
    }

    fn dead(node: u32, addr: String, reason: String) -> Self {
        Conn {
            node,
            addr,
            fd: -1,
            sock: None,
            state: State::Dead,
            reason,
            last_error: String::new(),
            rx: FrameRx::new(0),
            fill: Vec::new(),
            fill_entries: 0,
            fill_max_entries: 0,
            flight: Vec::new(),
            flight_sent: 0,
            tx_inflight: false,
            closing: false,
            outstanding: 0,
            max_grants: 0,
            max_data: 0,
            last_rx: Instant::now(),
            last_done: Instant::now(),
            errors: 0,
            errors_since: Instant::now(),
            demoted: false,
            last_tx: Instant::now(),
            data: None,
        }
    }
}

const UD_RECV: u64 = 1 << 56;
const UD_SEND: u64 = 2 << 56;
const UD_WAKE: u64 = 3 << 56;
const UD_CHAN: u64 = 4 << 56;
/// A source read; the low bits are its slot (`source.rs`).
const UD_SOURCE: u64 = 5 << 56;
const UD_KIND: u64 = 0xff << 56;

/// The network thread of a launch, over the transport its connections use.
pub(crate) enum NetThread {
    Tcp(Thread<TcpRx>),
    #[cfg(feature = "rdma")]
    Rdma(Thread<rdma::RdmaRx>),
}

impl NetThread {
    pub(crate) fn new(sh: Arc<Shared>, setup: Arc<NetSetup>, connected: Connected) -> Result<Self> {
        Ok(match connected {
            Connected::Tcp(c) => NetThread::Tcp(Thread::new(sh, setup, c)?),
            #[cfg(feature = "rdma")]
            Connected::Rdma(c) => NetThread::Rdma(Thread::new(sh, setup, c)?),
        })
    }

    pub(crate) fn run(self) {
        match self {
            NetThread::Tcp(t) => t.run(),
            #[cfg(feature = "rdma")]
            NetThread::Rdma(t) => t.run(),
        }
    }
}

/// The network thread over data path `R` and I/O backend `I` (`Uring` in
/// production, monomorphised).
pub(crate) struct Thread<R: Receive, I: IoBackend = Uring> {
    setup: Arc<NetSetup>,
    placement: Placement,
    ring: I,
    /// Before `common` and `sh`: the QPs go before the registrations and
    /// the ring memory they write.
    conns: Vec<Conn<R>>,
    /// Dead connections' data paths kept until their completions are out
    /// of the shared CQs, each with when it died (`data_poll.rs`).
    retired: Vec<(R, Instant)>,
    common: R::Common,
    /// A poll on the data path's wake descriptor is in the ring.
    chan_inflight: bool,
    /// A poll of the shared CQs (`data_poll.rs`), sized once, and each
    /// one's node.
    shared_wc: Vec<R::Wc>,
    shared_nodes: Vec<u32>,
    /// The connections whose receives that poll used (to re-post).
    refills: Vec<usize>,
    /// A shared thread's lanes' rings as its links know them (RDMA: their
    /// registrations), by lane index: dropped before the lanes and their
    /// rings, after the connections.
    lane_regs: Vec<Option<R::RingReg>>,
    /// The lane being worked on (a loader's run: its schedule, flow
    /// control and grant table); a shared thread's others wait in `lanes`
    /// (`lanes.rs`).
    l: Lane,
    /// A shared thread's lanes by index, the active one's place empty;
    /// empty for a loader's own thread.
    lanes: Vec<Option<Lane>>,
    /// `l`'s index.
    active: usize,
    /// Grant ids carry the lane index from this bit up (31: one lane).
    lane_shift: u32,
    /// A shared thread's link to its hub (new lanes come from it).
    hub: Option<hub::HubSide>,
    wake_buf: Box<u64>,
    wake_inflight: bool,
    completions: Vec<Completion>,
    /// Connections with closes queued since the last `flush_closes`
    /// (sized for every connection once), so a tick's flush costs what was
    /// closed, not one look per node.
    closing: Vec<usize>,
    /// Connections with something to do next tick (a GRANT frame filled,
    /// a send or a receive to post again, a keepalive due), each once
    /// (`queued`); sized for every connection once, so marking never
    /// allocates. A tick looks at these, not at every node.
    ready: Vec<usize>,
    /// `ready` as a tick works through it (the two are swapped).
    ready_now: Vec<usize>,
    /// Per connection: in `ready`.
    queued: Vec<bool>,
    /// Which connections each sweep looks at (`sweep.rs`).
    sweep: sweep::Sweep,
    /// Connections looked at by `service_ready` (tests: the per-tick work).
    #[cfg(test)]
    pub(crate) conn_visits: u64,
    /// The minimum-progress allowance per grant beyond `node_timeout`.
    progress_slack: Duration,
    /// Per connection (same index): heartbeats asked for, and heard.
    beats: Vec<Beats>,
    /// Per connection (same index): when a dead one is tried again.
    redials: redial::Redials<R>,
    /// When `check_timeouts` last ran (see [`NOT_RUNNING`]).
    last_check: Instant,
    /// Ticks longer than the stall threshold (`crate::stall`).
    stall: Stall,
    /// The loader stopped: live connections are shut, and the thread ends
    /// once nothing of its memory is in flight.
    stopping: bool,
}

/// A connection's heartbeat state (kept beside `conns`).
#[derive(Clone, Copy)]
struct Beats {
    /// The keepalive that asks for heartbeats went (or is in flight).
    asked: bool,
    /// A heartbeat came: the node sends them, so its silence is judged by
    /// [`HEARTBEAT_SILENCE`].
    heard: bool,
    /// When anything last came from the node, or (the heartbeat clock
    /// restarted) when a grant went to it with none outstanding: a node
    /// with nothing granted may beat only every
    /// [`proto::IDLE_HEARTBEAT_INTERVAL`]. Unlike `Conn::last_rx`, not
    /// reset by later grants.
    last_heard: Instant,
    /// This connection's keepalive interval: [`KEEPALIVE`], or a quarter
    /// of the idle timeout the node's heartbeats say (at most
    /// [`KEEPALIVE_MAX`]).
    keepalive: Duration,
    /// The node's heartbeats say its idle timeout: it beats this
    /// connection only every 5 s while it has nothing of ours.
    slow: bool,
    /// When a frame last came from the node (unlike `last_heard`, never
    /// moved by a grant): what answers a probe.
    last_frame: Instant,
    /// Another node reported this one down and this thread's own clocks
    /// did not confirm it at once: when (a probe asks the node for a
    /// heartbeat; nothing from it within [`proto::PROBE_SILENCE`] confirms
    /// the notice), with the reporter and its silence (`notice.rs`).
    probed: Option<(Instant, u32, u32)>,
    /// The probe is still to be sent (`socket.rs`, `flush_one`).
    probe_due: bool,
}

impl Beats {
    fn new(now: Instant) -> Beats {
        Beats {
            asked: false,
            heard: false,
            last_heard: now,
            keepalive: KEEPALIVE,
            slow: false,
            last_frame: now,
            probed: None,
            probe_due: false,
        }
    }

    /// A frame came from the node at `at`.
    fn heard_at(&mut self, at: Instant) {
        self.last_heard = at;
        self.last_frame = at;
    }

    /// A heartbeat came, saying the node's idle timeout or not.
    fn heartbeat(&mut self, idle_timeout: Option<Duration>) {
        self.heard = true;
        if let Some(t) = idle_timeout {
            self.slow = true;
            self.keepalive = (t / 4).clamp(KEEPALIVE, KEEPALIVE_MAX);
        }
    }

    /// A grant went to the node with none outstanding, at `now`: a
    /// slow-beating node's silence counts from here, unless it was already
    /// silent for [`SLOW_BEAT_STALE`].
    fn granted_after_idle(&mut self, now: Instant) {
        if self.slow && now.saturating_duration_since(self.last_heard) <= SLOW_BEAT_STALE {
            self.last_heard = now;
        }
    }

    /// How long the node may be silent before it is taken for dead, with
    /// or without grants outstanding on it.
    fn silence_limit(&self, outstanding: bool, node_timeout: Duration) -> Duration {
        if outstanding {
            HEARTBEAT_SILENCE.min(node_timeout)
        } else if self.slow {
            node_timeout.max(IDLE_SILENCE)
        } else {
            node_timeout
        }
    }
}

/// Whether a connection's clocks are short (grants outstanding, not live,
/// a keepalive interval under `short`): the sweep's busy list, looked at
/// every 100 ms (`sweep.rs`).
fn needs_busy<R>(c: &Conn<R>, b: &Beats, short: Duration) -> bool {
    c.state != State::Live || c.outstanding > 0 || b.keepalive < short || b.probed.is_some()
}

/// Address of ring offset `phys`.
fn ring_ptr(ring: &LandingRing, phys: u64) -> *mut u8 {
    // SAFETY: phys < ring length (schedule construction).
    unsafe { ring.as_mut_ptr().add(phys as usize) }
}

impl<R: Receive> Thread<R> {
    pub(crate) fn new(
        sh: Arc<Shared>,
        setup: Arc<NetSetup>,
        connected: Connections<R>,
    ) -> Result<Self> {
        let ring = Uring::new(UringOptions {
            // A receive and a send per connection, the wake read, the
            // channel poll, and the source reads.
            entries: (connected.conns.len() as u32 * 2 + 8 + source::SOURCE_READS as u32)
                .next_power_of_two(),
            sqpoll_idle_ms: None,
        })?;
        Ok(Self::with_ring(sh, setup, connected, ring, true))
    }
}

impl<R: Receive, I: IoBackend> Thread<R, I> {
    /// The thread over `ring` (`Uring` in production; the simulator's
    /// `MemNet`), its connections made. `redial`: dead nodes are
    /// reconnected (the simulator has no TCP to reconnect over).
    pub(crate) fn with_ring(
        sh: Arc<Shared>,
        setup: Arc<NetSetup>,
        connected: Connections<R>,
        mut ring: I,
        redial: bool,
    ) -> Self {
        let conns = connected.conns;
        let conns_len = conns.len();
        let user_timeout = setup.node_timeout.clamp(USER_TIMEOUT_MIN, USER_TIMEOUT_MAX);
        for c in &conns {
            if c.state == State::Live {
                if let Err(e) = ring.set_user_timeout(c.fd(), user_timeout) {
                    log::debug!("node {}: TCP_USER_TIMEOUT: {e}", c.node);
                }
            }
        }
        let now = ring.now();
        let beats = vec![Beats::new(now); conns.len()];
        let mut redials = redial::Redials::new(conns.len(), redial);
        let redial = redial && R::redial_common(&connected.common).is_some();
        let mut sweep = sweep::Sweep::new(conns.len(), now, setup.node_timeout);
        for (i, (c, r)) in conns.iter().zip(&mut redials.state).enumerate() {
            // Unreachable at start: tried again like one that died later
            // (not the local node's place).
            if redial && c.state == State::Dead && Some(c.node) != setup.local_node {
                r.schedule_first(c.node, now);
            }
            if needs_busy(c, &beats[i], sweep.short_keepalive()) {
                sweep.mark_busy(i);
            }
        }
        Thread {
            redials,
            placement: connected.placement,
            ring,
            conns,
            common: connected.common,
            chan_inflight: false,
            shared_wc: vec![R::Wc::default(); 32],
            shared_nodes: vec![u32::MAX; 32],
            refills: Vec::with_capacity(32),
            progress_slack: Duration::from_secs_f64(
                sh.input.max_sample_bytes() as f64 / MIN_PROGRESS_BYTES_PER_SEC as f64,
            ),
            lane_regs: Vec::new(),
            l: Lane::new(sh, now, None),
            lanes: Vec::new(),
            active: 0,
            lane_shift: 31,
            hub: None,
            wake_buf: Box::new(0),
            wake_inflight: false,
            completions: vec![Completion::default(); 256],
            closing: Vec::with_capacity(conns_len),
            retired: Vec::with_capacity(conns_len),
            // Every connection starts ready: its first frame asks for
            // heartbeats, and its receive is posted.
            ready: (0..conns_len).collect(),
            ready_now: Vec::with_capacity(conns_len),
            queued: vec![true; conns_len],
            sweep,
            #[cfg(test)]
            conn_visits: 0,
            beats,
            last_check: now,
            stall: Stall::new("network thread", 0),
            stopping: false,
            setup,
        }
    }

    fn net(&self) -> &NetShared {
        self.l.sh.net.as_ref().expect("cluster mode")
    }

    pub(crate) fn run(mut self) {
        self.stall.resume();
        while self.tick() {}
    }

    /// One iteration of the loop: false once the thread is done (stopped,
    /// with nothing of its memory in flight). The simulator steps it.
    pub(crate) fn tick(&mut self) -> bool {
        #[cfg(test)]
        self.check_ready();
        {
            // A loader's own thread stops with its loader; a shared one
            // once its last lane left (`lanes.rs`).
            let stop = if self.hub.is_some() {
                self.lanes_tick()
            } else {
                self.lane_stopped()
            };
            if !self.stopping && stop {
                self.stopping = true;
                for i in 0..self.conns.len() {
                    if self.conns[i].state == State::Live {
                        self.kill(i, "loader stopped".into());
                    }
                }
            }
            let stopping = self.stopping;
            if stopping && !self.busy() {
                return false;
            }
            // RDMA writes complete on the connections' CQs, not the ring.
            let progressed = self.poll_data();
            self.push_queued_sources();
            self.drain_store_reads();
            if !stopping {
                self.stall.phase(Phase::Submit);
                self.fill();
                let now = self.ring.now();
                if let Some(looks) = self.sweep.due(now) {
                    self.stall.phase(Phase::Timers);
                    self.check_timeouts(&looks);
                    self.keepalives_due(now, &looks);
                    self.stall.phase(Phase::Connect);
                    self.redial(&looks);
                    self.stall.phase(Phase::Submit);
                    let (conns, beats) = (&self.conns, &self.beats);
                    let short = self.sweep.short_keepalive();
                    self.sweep
                        .done(looks, |i| needs_busy(&conns[i], &beats[i], short));
                }
                self.service_ready();
            }
            // Closes queued this tick go before any sleep (a close queued
            // later in it leaves the tick with progress, so no sleep).
            self.flush_closes();
            // About to sleep: arm the CQs, then look once more (a
            // completion that came in before arming raises no event).
            let progressed = progressed || (self.arm_data() && self.poll_data());
            if !self.wake_inflight {
                let fd = self.net().wake.raw();
                let buf: *mut u64 = &mut *self.wake_buf;
                // SAFETY: the boxed u64 lives as long as this thread's state,
                // and run() waits for this read before returning (busy()).
                if unsafe { self.ring.push_eventfd_read(UD_WAKE, fd, buf) } {
                    self.wake_inflight = true;
                }
            }
            self.stall
                .lap(&self.l.sh.net.as_ref().expect("cluster mode").loop_stalls);
            let res = if progressed && !stopping {
                // RDMA work came in: look again at once, no system call
                // unless something is queued.
                self.ring.submit_pending()
            } else {
                let wait = if stopping { 5 } else { 50 };
                let r = self.ring.submit_wait_timeout(Duration::from_millis(wait));
                self.stall.resume();
                r
            };
            if let Err(e) = res {
                log::error!("network thread: io_uring: {e}");
                std::thread::sleep(Duration::from_millis(5));
            }
            let n = self.ring.drain(&mut self.completions);
            self.stall.phase(Phase::Reap);
            for i in 0..n {
                let c = self.completions[i];
                self.complete(c);
            }
            if stopping && self.wake_inflight {
                // Complete our own eventfd read so the thread can exit.
                self.net().wake.notify();
            }
        }
        true
    }

    /// Tests: every connection with grants outstanding or not live is in
    /// the sweep's busy list; every live connection that is not in `ready` has nothing
    /// waiting on it: its receive is posted and, unless a send is out or
    /// its windows are being bound (both mark it when done), nothing is
    /// unsent, no grant is filled and its first frame went. A missed mark
    /// would otherwise only delay a frame to the next keepalive, which no
    /// other check notices. `ready` holds each index once, within its
    /// capacity.
    #[cfg(test)]
    fn check_ready(&self) {
        let n = self.conns.len();
        assert!(self.ready.len() <= n && self.ready_now.is_empty());
        let mut seen = vec![false; n];
        for &i in &self.ready {
            assert!(
                !seen[i] && self.queued[i],
                "connection {i} in ready twice or unflagged"
            );
            seen[i] = true;
        }
        for (i, c) in self.conns.iter().enumerate() {
            // Short clocks are looked at every 100 ms (`sweep.rs`).
            assert!(
                self.sweep.is_busy(i)
                    || !needs_busy(c, &self.beats[i], self.sweep.short_keepalive()),
                "connection {i} ({:?}, {} outstanding, keepalive {:?}) is not in the sweep's busy list",
                c.state,
                c.outstanding,
                self.beats[i].keepalive
            );
            if c.state != State::Live || self.queued[i] {
                continue;
            }
            assert!(
                c.rx.inflight(),
                "live connection {i} without a receive, not ready"
            );
            if c.tx_inflight || c.flushing() {
                continue;
            }
            assert!(
                c.flight_sent >= c.flight.len() && c.fill_entries == 0 && self.beats[i].asked,
                "live connection {i} with a frame to send ({} of {} sent, {} grants filled, asked {}), not ready",
                c.flight_sent,
                c.flight.len(),
                c.fill_entries,
                self.beats[i].asked
            );
        }
    }

    /// Why connection `i` was shut (tests only), if it was.
    #[cfg(test)]
    pub(crate) fn sim_dropped(&self, i: usize) -> Option<&str> {
        let c = &self.conns[i];
        (c.state != State::Live).then_some(c.reason.as_str())
    }

    /// The simulator's view (tests only): its ring, whether anything of
    /// its memory is in flight, and the sizes of its pools (which must
    /// never change).
    #[cfg(test)]
    pub(crate) fn sim_view(&self) -> (&I, bool, [usize; 5]) {
        let fill: usize = self.conns.iter().map(|c| c.fill.capacity()).sum();
        let flight: usize = self.conns.iter().map(|c| c.flight.capacity()).sum();
        (
            &self.ring,
            self.busy(),
            [
                self.l.table.len(),
                self.l.regrant.capacity(),
                self.completions.len(),
                fill,
                flight,
            ],
        )
    }

    /// Samples the source fallback is reading (tests only): none once the
    /// thread has ended.
    #[cfg(test)]
    pub(crate) fn sim_source_reads(&self) -> usize {
        self.l.sources.in_use()
    }

    /// Whether ring operations that reference this thread's memory are in
    /// flight (the completion channel's poll references none: the ring is
    /// dropped before the channel).
    fn busy(&self) -> bool {
        self.wake_inflight
            || self.l.sources.busy()
            || self.lanes.iter().flatten().any(|l| l.sources.busy())
            || self.conns.iter().any(|c| c.rx.inflight() || c.tx_inflight)
    }

    /// Posts the queued closes (RDMA invalidations) of the connections
    /// that have any.
    fn flush_closes(&mut self) {
        let mut closing = std::mem::take(&mut self.closing);
        for &i in &closing {
            let c = &mut self.conns[i];
            if !std::mem::take(&mut c.closing) || c.state != State::Live {
                continue;
            }
            if let Some(Err(e)) = c.data.as_mut().map(|d| d.flush_closes()) {
                self.kill(i, e.to_string());
            }
        }
        closing.clear();
        self.closing = closing;
    }

    fn ring_ptr(&self, phys: u64) -> *mut u8 {
        ring_ptr(&self.l.sh.ring, phys)
    }

    /// The timeouts of the connections a sweep looks at.
    fn check_timeouts(&mut self, looks: &[usize]) {
        let t = self.setup.node_timeout;
        let progress = t + self.progress_slack;
        let now = self.ring.now();
        let gap = now.duration_since(self.last_check);
        self.last_check = now;
        if gap > NOT_RUNNING {
            // This thread did not run: nothing was received meanwhile
            // because nothing was looked at.
            for (c, b) in self.conns.iter_mut().zip(&mut self.beats) {
                c.last_rx = shift_for_pause(c.last_rx, gap, now);
                c.last_done = shift_for_pause(c.last_done, gap, now);
                b.last_heard = shift_for_pause(b.last_heard, gap, now);
                b.last_frame = shift_for_pause(b.last_frame, gap, now);
                if let Some((at, ..)) = &mut b.probed {
                    *at = shift_for_pause(*at, gap, now);
                }
            }
        }
        for &i in looks {
            if self.conns[i].state != State::Live || self.probe_unanswered(i, now) {
                continue;
            }
            let c = &self.conns[i];
            let b = &self.beats[i];
            // The short silence rule holds only while grants wait on the
            // node: an idle node paused for a few seconds (cgroup
            // throttling, a VM pause) keeps its connection (a reconnect
            // costs a handshake, over RDMA a new queue pair). An idle one
            // gets the node timeout.
            let limit = b.silence_limit(c.outstanding > 0, t);
            if b.heard && now.saturating_duration_since(b.last_heard) > limit {
                let why = format!(
                    "no heartbeat for {} ms ({} grants outstanding)",
                    limit.as_millis(),
                    c.outstanding
                );
                log::warn!("node {} ({}): {why}", c.node, c.addr);
                self.post_node_down(i, now.saturating_duration_since(b.last_heard));
                self.kill(i, why);
                continue;
            }
            if c.outstanding == 0 {
                continue;
            }
            let why = if now.saturating_duration_since(c.last_rx) > t {
                self.post_node_down(i, now.saturating_duration_since(c.last_rx));
                format!(
                    "no data for {} ms with {} grants outstanding",
                    t.as_millis(),
                    c.outstanding
                )
            } else if now.saturating_duration_since(c.last_done) > progress {
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
        // Looked at every 100 ms while not live (its redial's time).
        self.sweep.mark_busy(i);
        let c = &mut self.conns[i];
        // The socket stays open (owned by `sock`) until the connection
        // is dead: its receive and send in flight name its descriptor.
        self.ring.shutdown(c.fd());
        if let Some(d) = &mut c.data {
            // From now on the QP accepts no write; it is destroyed (and so
            // done with the ring) before its grants move elsewhere.
            if let Err(e) = d.shut() {
                log::warn!("node {}: {e}", c.node);
            }
        }
        self.maybe_dead(i);
    }

    fn maybe_dead(&mut self, i: usize) {
        let c = &mut self.conns[i];
        if c.state != State::Closing || c.rx.inflight() || c.tx_inflight {
            return;
        }
        c.state = State::Dead;
        c.sock = None;
        c.fd = -1;
        c.outstanding = 0;
        // RDMA: destroys the QP (in the error state since `kill`: it
        // accepts no write), then its CQ; a QP on the thread's SRQ is
        // kept a while (`data_poll.rs`, `retire`).
        let node = c.node;
        if let Some(d) = c.data.take() {
            self.retire(d);
        }
        if self.stopping || (self.hub.is_none() && self.lane_stopped()) {
            return;
        }
        self.went_dead(i);
        let mut moved = 0;
        for k in 0..self.lane_places() {
            if self.activate(k) {
                moved += self.fail_over_lane(node);
            }
        }
        log::warn!(
            "node {node} ({}) is gone ({}): {moved} outstanding grants fail over; its later samples go to their other copies, else the source, where there are any",
            self.conns[i].addr,
            self.conns[i].reason
        );
    }

    /// The active lane's grants with `node`, which is gone: placed again
    /// (a lane leaving drops them); how many.
    fn fail_over_lane(&mut self, node: u32) -> u64 {
        let leaving = self.l.leaving || self.lane_stopped();
        let mut moved = 0;
        for idx in 0..self.l.table.len() {
            let s = &mut self.l.table[idx];
            if s.live && s.node == node {
                s.node = NONE;
                s.received = 0;
                // Its window went with the QP.
                s.mw = NONE;
                s.after_inv = AfterInv::Nothing;
                if leaving {
                    s.live = false;
                    continue;
                }
                self.l.regrant.push_back(idx);
                moved += 1;
            }
        }
        // Keep sequence order: the consumer waits on the oldest first.
        let table = &self.l.table;
        self.l
            .regrant
            .make_contiguous()
            .sort_by_key(|&i| table[i].g);
        self.net().failovers.fetch_add(moved, Ordering::Relaxed);
        moved
    }

    fn complete(&mut self, comp: Completion) {
        let i = (comp.user_data & 0xffff_ffff) as usize;
        match comp.user_data & UD_KIND {
            UD_WAKE => self.wake_inflight = false,
            UD_CHAN => {
                self.chan_inflight = false;
                R::woke(&self.common);
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
                // Grants filled while it was out go next.
                if self.conns[i].state == State::Live {
                    self.mark_ready(i);
                }
                self.maybe_dead(i);
            }
            UD_RECV => {
                self.conns[i].rx.returned();
                if self.conns[i].state == State::Live {
                    self.on_recv(i, comp.result);
                    // Its next receive is posted this tick.
                    self.mark_ready(i);
                }
                self.maybe_dead(i);
            }
            UD_SOURCE => {
                // The lane above bit 16, the slot below (`source.rs`).
                let ok = self.activate(i >> 16);
                assert!(ok, "network thread: source read of a lane that left");
                self.source_completed(i & 0xffff, comp.result)
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
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn demoting_a_later_epoch_keeps_the_earlier_one_demoted() {
        let net = NetShared::new(4).unwrap();
        let why = || Error::InvalidConfig("test".into());
        assert!(net.local_demoted(5).is_none());
        net.demote_local(5, why());
        // Read-ahead failures demote epoch 6 while 5 is still read.
        net.demote_local(6, why());
        assert!(net.local_demoted(5).is_some(), "epoch 5 un-demoted");
        assert!(net.local_demoted(6).is_some());
        for e in [0, 4, 7, 100, u64::MAX] {
            assert!(net.local_demoted(e).is_none(), "epoch {e}");
        }
        net.demote_local(9, why());
        assert!(net.local_demoted(7).is_none() && net.local_demoted(8).is_none());
        assert!(net.local_demoted(9).is_some() && net.local_demoted(5).is_some());
        // 64 epochs later the oldest are dropped, the newest kept.
        net.demote_local(70, why());
        assert!(net.local_demoted(5).is_none() && net.local_demoted(6).is_none());
        assert!(net.local_demoted(9).is_some() && net.local_demoted(70).is_some());
    }

    #[test]
    fn a_pause_never_moves_a_silence_clock_past_now() {
        let now = Instant::now() + Duration::from_secs(100);
        let gap = Duration::from_secs(10);
        // Heard just now (frames drained after the pause): stays at now.
        assert_eq!(shift_for_pause(now, gap, now), now);
        assert_eq!(shift_for_pause(now - Duration::from_secs(1), gap, now), now);
        // Heard before the pause: moved on by the whole gap.
        let before = now - Duration::from_secs(30);
        assert_eq!(shift_for_pause(before, gap, now), before + gap);
    }

    /// A node that says its idle timeout beats slowly: it gets keepalives
    /// every quarter of it (1-15 s), at least 15 s of idle silence, and a
    /// grant after an idle silence restarts its clock, unless the silence
    /// was already long; a node that does not (an older build, beating
    /// every 250 ms) keeps the node timeout and the silence before a grant.
    #[test]
    fn a_slow_beating_node_is_judged_by_its_idle_interval() {
        let t0 = Instant::now();
        let node_timeout = Duration::from_secs(3);
        let mut old = Beats::new(t0);
        old.heartbeat(None);
        assert_eq!(old.keepalive, KEEPALIVE);
        assert_eq!(old.silence_limit(false, node_timeout), node_timeout);
        assert_eq!(old.silence_limit(true, node_timeout), HEARTBEAT_SILENCE);
        old.granted_after_idle(t0 + Duration::from_secs(4));
        assert_eq!(
            old.last_heard, t0,
            "an old node's silence before a grant counts"
        );

        let mut new = Beats::new(t0);
        new.heartbeat(Some(Duration::from_secs(60)));
        assert_eq!(new.keepalive, KEEPALIVE_MAX);
        new.heartbeat(Some(Duration::from_secs(3)));
        assert_eq!(new.keepalive, KEEPALIVE, "a quarter of 3 s, raised to 1 s");
        new.heartbeat(Some(Duration::from_secs(20)));
        assert_eq!(new.keepalive, Duration::from_secs(5));
        assert_eq!(new.silence_limit(false, node_timeout), IDLE_SILENCE);
        assert_eq!(
            new.silence_limit(false, Duration::from_secs(30)),
            Duration::from_secs(30)
        );
        assert_eq!(new.silence_limit(true, node_timeout), HEARTBEAT_SILENCE);
        let granted = t0 + Duration::from_secs(6);
        new.granted_after_idle(granted);
        assert_eq!(
            new.last_heard, granted,
            "6 s of idle silence: the clock restarts"
        );
        let later = granted + SLOW_BEAT_STALE + Duration::from_millis(1);
        new.granted_after_idle(later);
        assert_eq!(
            new.last_heard, granted,
            "silent past the stale bound: it counts"
        );
    }
}
