//! A consumer's connection on a serve poller (`SConn`): its socket, its
//! receive side, its queued grants and staging slots in send order, its
//! send side; and how a ring operation names it (the `user_data`
//! encoding: kind, connection, staging slot).

use std::collections::VecDeque;
use std::net::{SocketAddr, TcpStream};
use std::os::fd::RawFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::link::ConnLink;
use super::metrics;
use crate::transport::proto::{GrantEntry, Hello};
use crate::transport::stream_rx::StreamRx;

// user_data: kind in the top byte, connection index, slot index.
pub(super) const UD_RECV: u64 = 1 << 56;
pub(super) const UD_SEND: u64 = 2 << 56;
pub(super) const UD_READ: u64 = 3 << 56;
pub(super) const UD_CHAN: u64 = 4 << 56;
pub(super) const UD_KIND: u64 = 0xff << 56;

/// Work-request id of a heartbeat in a TCP link's queue (staging slots
/// are numbered from 0, far below it): its completion frees no slot.
pub(super) const HEARTBEAT_WR: u64 = u64::MAX;

/// The `user_data` of an operation of kind `kind` (`UD_*`) for connection
/// `conn`, on staging slot `slot` (0 when it uses none).
pub(super) fn ud(kind: u64, conn: u32, slot: u32) -> u64 {
    kind | ((conn as u64) << 32) | slot as u64
}

/// The connection an operation's `user_data` names.
pub(super) fn ud_conn(user_data: u64) -> u32 {
    ((user_data >> 32) & 0xff_ffff) as u32
}

/// The staging slot an operation's `user_data` names.
pub(super) fn ud_slot(user_data: u64) -> u32 {
    user_data as u32
}

/// A granted sample being pushed: the next chunk's offset within it.
#[derive(Clone, Copy)]
pub(super) struct Work {
    pub(super) e: GrantEntry,
    /// Bytes of it taken up so far (a sample's length is a u32).
    pub(super) next: u32,
    /// When its GRANT frame was read.
    pub(super) at: std::time::Instant,
    /// The connection's count of grants before it, wrapping: what tells
    /// two grants of one id apart (a consumer may use an id again once the
    /// grant it named is finished, after an ERROR too). 32 bits keep a
    /// queued grant at 64 bytes; two grants 2^32 apart are never both in
    /// the send queue.
    pub(super) serial: u32,
}

pub(super) struct SConn {
    /// Its socket's descriptor (every operation goes through the ring).
    pub(super) fd: RawFd,
    /// Owns the socket: closed when the connection is dropped, after its
    /// last operation (None in the simulator).
    pub(super) _sock: Option<TcpStream>,
    pub(super) peer: SocketAddr,
    pub(super) hello: Hello,
    /// The receive side: whatever arrived, taken as whole frames (GRANTs
    /// and keepalives; consumers send no DATA).
    pub(super) rx: StreamRx,
    pub(super) grants: VecDeque<Work>,
    /// Staging slots in send order.
    pub(super) sendq: VecDeque<u32>,
    /// The send side: frames posted in order, one `sendmsg` in flight; or
    /// RDMA writes in chains.
    pub(super) link: ConnLink,
    pub(super) ops: u32,
    pub(super) closing: bool,
    /// The last grant answered with ERROR (its serial): its later chunks
    /// are dropped.
    pub(super) failed_grant: Option<u32>,
    /// Grants read so far, wrapping (the next one's `Work::serial`).
    pub(super) grants_read: u32,
    /// Staging slots it holds (reading, queued, posted or being sent);
    /// changed only through [`SConn::hold`] and [`SConn::release`].
    pub(super) held: u32,
    /// Last time its link finished a frame (socket bytes taken, RDMA writes
    /// completed) or became busy: a consumer whose sends make no progress
    /// for `stall_timeout` is dropped.
    pub(super) last_drained: std::time::Instant,
    /// Its counters (also in `Common::metrics` while it lives).
    pub(super) metrics: Arc<metrics::ConnMetrics>,
    /// When it last sent a frame (idle timeout).
    pub(super) last_rx: std::time::Instant,
    /// It asked for heartbeats (a keepalive with `proto::ASK_HEARTBEATS`).
    pub(super) heartbeats: bool,
    /// It may be beaten slowly while idle (`proto::SLOW_IDLE_HEARTBEATS`).
    pub(super) slow_idle: bool,
    /// When this poller last sent it a heartbeat (None: never, or it
    /// probed: one goes at the next sweep).
    pub(super) last_beat: Option<std::time::Instant>,
    /// It asked for node-down notices (`proto::ASK_NODE_NOTICES`): the
    /// sequence number of the next one it is to be sent (`notify.rs`).
    pub(super) notices_from: Option<u64>,
    /// The last grant whose read error was logged (one line per grant).
    pub(super) warned_grant: Option<u32>,
    /// It is in the poller's work list ([`super::conns::Conns::mark`]).
    pub(super) in_work: bool,
}

impl SConn {
    /// Whether the node has nothing for it: no grant queued, no staging
    /// slot held, no send in flight (its idle timeout runs, and a consumer
    /// that asked for slow idle heartbeats is beaten every 5 s).
    pub(super) fn nothing_queued(&self) -> bool {
        self.grants.is_empty() && self.held == 0 && !self.link.busy()
    }

    /// Whether a tick has something to do for it: a receive to post,
    /// grants to read, slots held (reads, frames to send or in flight), or
    /// frames queued on its link. A connection that is none of these is
    /// left out of the per-tick loops until an event (a completion, a
    /// heartbeat queued) marks it again. A closing one stays while its
    /// link has frames or writes in flight: RDMA completions are polled
    /// from the work list, not delivered by the ring. So does a consumer
    /// that asked for heartbeats without `SLOW_IDLE_HEARTBEATS` (an older
    /// build): it is beaten every 250 ms idle or not, so every sweep looks
    /// at it.
    pub(super) fn active(&self) -> bool {
        if self.closing {
            return self.link.pending();
        }
        !self.rx.inflight()
            || !self.grants.is_empty()
            || self.held > 0
            || self.link.pending()
            || (self.heartbeats && !self.slow_idle)
    }

    /// It took one more staging slot.
    pub(super) fn hold(&mut self) {
        self.held += 1;
        self.metrics
            .staging_slots
            .store(self.held as u64, Ordering::Relaxed);
    }

    /// One of its staging slots was given back.
    pub(super) fn release(&mut self) {
        // `held` counts the slots `hold` gave this connection; a release
        // with none held is a double free.
        self.held = self
            .held
            .checked_sub(1)
            .expect("a connection's held count would go below zero (a staging slot freed twice)");
        self.metrics
            .staging_slots
            .store(self.held as u64, Ordering::Relaxed);
    }
}
