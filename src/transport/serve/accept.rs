//! The acceptor: one thread takes connections and runs every handshake
//! (HELLO, the token check, WELCOME and, over RDMA, the queue-pair swap) as
//! a non-blocking state machine over `poll(2)`, so no peer gets a thread or
//! can hold up another one's handshake.
//!
//! Every bound here is fixed at start (docs/PROTOCOL.md, "Limits" and
//! "Admission and retry"):
//! - one deadline for the whole handshake (`handshake_timeout`), however
//!   the peer paces its bytes;
//! - at most `max_handshakes` handshakes *not yet admitted* (HELLO not
//!   read in full, or a wrong token waiting for its delayed answer). A
//!   connection accepted beyond that makes room: a delayed wrong-token
//!   answer is sent at once, else (when the new connection's address is
//!   over the wrong-token limit) the new connection is answered
//!   [`Code::RateLimited`], else the oldest handshake without a whole
//!   HELLO is answered [`Code::Busy`]. Both codes tell a consumer to retry;
//! - admission is decided at HELLO, before WELCOME: at most
//!   `max_conns_per_poller` consumers per poller, a HELLO beyond that is
//!   refused with [`Code::NodeFull`]. An admitted handshake (over RDMA,
//!   WELCOME sent, waiting for the consumer's endpoint) holds its place on
//!   a poller, is bounded by the consumer limit, and is never closed to make
//!   room: only its own deadline ends it. The hand-off to the poller never
//!   fails for capacity (its queue holds every consumer it can take);
//! - `accept` failing for lack of descriptors (EMFILE, ENFILE) or memory
//!   closes a handshake not yet admitted, as above, and backs off (10 ms
//!   doubling to 1 s); it is logged once, then summarized every
//!   [`LOG_WINDOW`];
//! - refusals are logged once per address per [`LOG_WINDOW`], the rest
//!   summarized; from an address that presented [`BAD_TOKEN_LIMIT`] wrong
//!   tokens within a window, each further wrong token is answered
//!   [`THROTTLE_DELAY`] late (a looping stale launcher slows down). A
//!   correct token is admitted whatever its address did;
//! - a refusal's ERROR is followed by a shutdown of our side and a drain
//!   of what the peer sent (at most [`DRAIN_BYTES`] within [`DRAIN_TIME`],
//!   at most `max_handshakes` such connections, in this same loop) before
//!   the close, so the peer sees the ERROR and a FIN, not a reset.
//!
//! Why this file is over ~800 lines: one handshake state machine (admission,
//! making room, wrong-token throttling and rate limits, draining refused
//! connections) whose limits interlock; the wrong-token log and the drain list
//! are the first parts to move out when the serve tree is split (issue 27).

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{Sender, TrySendError};

use super::{send_error, Accepted, Common};
use crate::transport::proto::{self, Code, Header, Hello, Kind, Welcome};

/// Window of the refusal and accept-error log summaries and of the
/// per-address wrong-token count.
pub(crate) const LOG_WINDOW: Duration = Duration::from_secs(10);

/// Wrong tokens one address may present within [`LOG_WINDOW`] and have
/// answered at once; later ones are answered [`THROTTLE_DELAY`] late.
pub(crate) const BAD_TOKEN_LIMIT: u32 = 16;

/// How late a wrong token is answered from an address over
/// [`BAD_TOKEN_LIMIT`].
pub(crate) const THROTTLE_DELAY: Duration = Duration::from_secs(1);

/// Addresses the refusal log tracks at once: a new one beyond it replaces
/// the one whose window started first (expired ones go first), so memory
/// stays bounded and every new address is still counted and throttled.
const MAX_TRACKED_ADDRS: usize = 4096;

/// After a refusal's ERROR (our side shut for writing), at most this many
/// bytes the peer sent are read and discarded, within [`DRAIN_TIME`], so
/// the close sends FIN rather than the reset that unread input causes
/// (a reset can discard the ERROR before the peer reads it).
const DRAIN_BYTES: usize = 64 * 1024;

/// How long a refused connection is drained at most (see [`DRAIN_BYTES`]).
const DRAIN_TIME: Duration = Duration::from_millis(500);

/// A handshake buffer holds the largest HELLO (header, fixed part, token).
const BUF_BYTES: usize = proto::HEADER_BYTES + proto::HELLO_FIXED_BYTES + proto::MAX_TOKEN_BYTES;

/// An admitted RDMA handshake reads only the consumer's endpoint frame, into
/// a buffer of its own (the HELLO buffer goes back to the spares).
#[cfg(feature = "rdma")]
const ENDPOINT_FRAME_BYTES: usize = proto::HEADER_BYTES + proto::RDMA_ENDPOINT_BYTES;

#[derive(Clone, Copy)]
enum Stage {
    /// Reading the HELLO header.
    Header,
    /// Reading the HELLO body (the header is in the buffer).
    Body(Header),
    /// A wrong token from an address over [`BAD_TOKEN_LIMIT`]: its BadToken
    /// answer waits for the handshake's deadline (set to the throttle's
    /// end). Nothing more is read from it.
    Throttled,
    /// RDMA: admitted (a place on `poller` reserved), WELCOME sent; reading
    /// the consumer's RDMA_ENDPOINT. Never closed to make room.
    #[cfg(feature = "rdma")]
    Endpoint { poller: usize },
}

struct Pending {
    sock: TcpStream,
    peer: SocketAddr,
    deadline: Instant,
    /// The HELLO buffer (from the spares) while the HELLO is read.
    buf: Option<Box<[u8]>>,
    /// RDMA: the endpoint frame, once admitted.
    #[cfg(feature = "rdma")]
    ep: [u8; ENDPOINT_FRAME_BYTES],
    have: usize,
    stage: Stage,
    /// RDMA: the decoded HELLO while the endpoints are swapped.
    #[cfg(feature = "rdma")]
    hello: Option<Hello>,
}

impl Pending {
    /// Bytes the current stage needs in its buffer.
    fn want(&self) -> usize {
        match self.stage {
            Stage::Header => proto::HEADER_BYTES,
            Stage::Body(h) => proto::HEADER_BYTES + h.body_len as usize,
            Stage::Throttled => 0,
            #[cfg(feature = "rdma")]
            Stage::Endpoint { .. } => ENDPOINT_FRAME_BYTES,
        }
    }

    /// The buffer the current stage reads into.
    fn space(&self) -> &[u8] {
        #[cfg(feature = "rdma")]
        if let Stage::Endpoint { .. } = self.stage {
            return &self.ep;
        }
        self.buf.as_deref().unwrap_or(&[])
    }

    /// Reads what the socket has of the current stage's bytes.
    fn read_some(&mut self, want: usize) -> std::io::Result<usize> {
        let have = self.have;
        #[cfg(feature = "rdma")]
        if let Stage::Endpoint { .. } = self.stage {
            return self.sock.read(&mut self.ep[have..want]);
        }
        match self.buf.as_deref_mut() {
            Some(b) => self.sock.read(&mut b[have..want]),
            None => Ok(0),
        }
    }

    /// Not admitted yet: counts against `max_handshakes` and may be closed
    /// to make room.
    fn unadmitted(&self) -> bool {
        match self.stage {
            Stage::Header | Stage::Body(_) | Stage::Throttled => true,
            #[cfg(feature = "rdma")]
            Stage::Endpoint { .. } => false,
        }
    }
}

/// Why a handshake ended without a consumer.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Refusal {
    /// The token did not match.
    BadToken,
    /// The deadline passed, or it made room for a newer one.
    Timeout,
    /// The peer closed or reset before finishing.
    Closed,
    /// Anything else (bad frame, version, dataset, node full, setup).
    Other,
}

/// What one step of a handshake came to.
enum Step {
    /// Waiting for more bytes (or for a throttled answer's time).
    Wait,
    /// Done: hand the consumer (its HELLO, its RDMA end) to this poller.
    Ready(Box<Ready>),
    /// Refused (an ERROR frame was sent when `Code` is given).
    Refused(Refusal, Option<Code>, String),
}

/// A finished handshake, before its socket leaves `pending`.
struct Ready {
    hello: Hello,
    #[cfg(feature = "rdma")]
    rdma: Option<super::RdmaAccepted>,
    poller: usize,
}

/// Per-address refusal record of the current window.
struct AddrLog {
    since: Instant,
    refusals: u64,
    bad_tokens: u32,
    /// Wrong tokens answered late (over the limit).
    throttled: u64,
    /// Connections answered RateLimited unread.
    rate_limited: u64,
    last: String,
}

/// Refusals, logged once per address and window, the rest summarized.
struct RefusalLog {
    by_addr: HashMap<IpAddr, AddrLog>,
    /// Addresses forgotten early to make room for new ones.
    forgotten: u64,
    last_sweep: Instant,
}

/// A refused connection after its ERROR: our side shut for writing, what
/// the peer sent is read and discarded until it closes, [`DRAIN_BYTES`] or
/// [`DRAIN_TIME`].
struct Closing {
    sock: TcpStream,
    deadline: Instant,
    drained: usize,
}

impl RefusalLog {
    fn new() -> Self {
        RefusalLog {
            by_addr: HashMap::with_capacity(64),
            forgotten: 0,
            last_sweep: Instant::now(),
        }
    }

    fn summarize(ip: &IpAddr, r: &AddrLog) {
        let more = r.refusals.saturating_sub(1);
        if more > 0 {
            log::warn!(
                "refused {ip} {more} more time(s) in the last {} s ({} wrong token(s), {} of them answered {} ms late over the limit of {BAD_TOKEN_LIMIT}; {} connection(s) answered rate-limited); latest: {}",
                LOG_WINDOW.as_secs(),
                r.bad_tokens,
                r.throttled,
                THROTTLE_DELAY.as_millis(),
                r.rate_limited,
                r.last
            );
        }
    }

    /// Ends the windows that are over (with their summaries).
    fn sweep(&mut self, now: Instant) {
        if now.duration_since(self.last_sweep) < Duration::from_secs(1) {
            return;
        }
        self.last_sweep = now;
        self.by_addr.retain(|ip, r| {
            let live = now.duration_since(r.since) < LOG_WINDOW;
            if !live {
                Self::summarize(ip, r);
            }
            live
        });
        if self.forgotten > 0 {
            log::warn!(
                "refusals came from more than {MAX_TRACKED_ADDRS} addresses at once: {} address record(s) ended early to make room",
                self.forgotten
            );
            self.forgotten = 0;
        }
    }

    /// Makes room for one more address: the expired records go (with their
    /// summaries), else the one whose window started first.
    fn make_room(&mut self, now: Instant) {
        self.by_addr.retain(|ip, r| {
            let live = now.duration_since(r.since) < LOG_WINDOW;
            if !live {
                Self::summarize(ip, r);
            }
            live
        });
        if self.by_addr.len() < MAX_TRACKED_ADDRS {
            return;
        }
        let oldest = self
            .by_addr
            .iter()
            .min_by_key(|(_, r)| r.since)
            .map(|(ip, _)| *ip);
        if let Some(ip) = oldest {
            if let Some(r) = self.by_addr.remove(&ip) {
                Self::summarize(&ip, &r);
            }
            self.forgotten += 1;
        }
    }

    fn record(
        &mut self,
        now: Instant,
        peer: SocketAddr,
        why: Refusal,
        code: Option<Code>,
        msg: &str,
    ) {
        let ip = peer.ip();
        if !self.by_addr.contains_key(&ip) && self.by_addr.len() >= MAX_TRACKED_ADDRS {
            self.make_room(now);
        }
        let r = self.by_addr.entry(ip).or_insert_with(|| AddrLog {
            since: now,
            refusals: 0,
            bad_tokens: 0,
            throttled: 0,
            rate_limited: 0,
            last: String::new(),
        });
        r.refusals += 1;
        if why == Refusal::BadToken {
            r.bad_tokens += 1;
        }
        if code == Some(Code::RateLimited) {
            r.rate_limited += 1;
        }
        if r.refusals == 1 {
            if why == Refusal::Closed {
                log::info!("refused {peer}: {msg}");
            } else {
                log::warn!("refused {peer}: {msg}");
            }
        } else {
            r.last = format!("{peer}: {msg}");
        }
    }

    /// Wrong tokens `ip` presented in its current window.
    fn bad_tokens(&self, now: Instant, ip: IpAddr) -> u32 {
        match self.by_addr.get(&ip) {
            Some(r) if now.duration_since(r.since) < LOG_WINDOW => r.bad_tokens,
            _ => 0,
        }
    }

    /// Counts a wrong token of `ip` answered late.
    fn throttled(&mut self, ip: IpAddr) {
        if let Some(r) = self.by_addr.get_mut(&ip) {
            r.throttled += 1;
        }
    }
}

/// Accept failures for lack of resources, logged once and then summarized.
struct AcceptTrouble {
    /// Do not accept before this.
    until: Option<Instant>,
    backoff: Duration,
    count: u64,
    last_log: Option<Instant>,
}

pub(super) struct Acceptor {
    c: Arc<Common>,
    listener: TcpListener,
    senders: Vec<Sender<Accepted>>,
    /// Pending handshakes, oldest first: at most `max_handshakes` not yet
    /// admitted, and the admitted ones (bounded by the consumer limit).
    pending: Vec<Pending>,
    /// Refused connections being drained before their close, oldest first
    /// (at most `max_handshakes`; a newer one closes the oldest).
    closing: Vec<Closing>,
    /// Spare HELLO buffers (`max_handshakes` in all, made at start).
    spare: Vec<Box<[u8]>>,
    pollfds: Vec<libc::pollfd>,
    /// Ticks longer than the stall threshold (`crate::stall`).
    stall: crate::stall::Stall,
    refusals: RefusalLog,
    trouble: AcceptTrouble,
}

impl Acceptor {
    pub(super) fn new(
        c: Arc<Common>,
        listener: TcpListener,
        senders: Vec<Sender<Accepted>>,
    ) -> Self {
        let cap = c.cfg.max_handshakes;
        // Admitted handshakes are consumers: at most pollers x the limit.
        let admitted = c.cfg.pollers * c.cfg.max_conns_per_poller;
        Acceptor {
            listener,
            senders,
            pending: Vec::with_capacity(cap + admitted),
            closing: Vec::with_capacity(cap.max(1)),
            spare: (0..cap)
                .map(|_| vec![0u8; BUF_BYTES].into_boxed_slice())
                .collect(),
            pollfds: Vec::with_capacity(2 * cap + admitted + 2),
            stall: crate::stall::Stall::new("node service acceptor", 0),
            refusals: RefusalLog::new(),
            trouble: AcceptTrouble {
                until: None,
                backoff: Duration::from_millis(10),
                count: 0,
                last_log: None,
            },
            c,
        }
    }

    pub(super) fn run(mut self) {
        self.stall.resume();
        while !self.c.stop.load(Ordering::Acquire) {
            let now = Instant::now();
            // Wake for the stop flag, the next deadline and the back-off.
            let mut wake = self.expire(now).min(now + Duration::from_millis(100));
            self.refusals.sweep(now);
            self.trouble_summary(now);
            let accepting = self.trouble.until.is_none_or(|t| now >= t);
            if accepting {
                self.trouble.until = None;
            }
            self.pollfds.clear();
            self.pollfds.push(libc::pollfd {
                fd: self.listener.as_raw_fd(),
                events: if accepting { libc::POLLIN } else { 0 },
                revents: 0,
            });
            for p in &self.pending {
                self.pollfds.push(libc::pollfd {
                    fd: p.sock.as_raw_fd(),
                    // A throttled one is only answered, at its time.
                    events: if matches!(p.stage, Stage::Throttled) {
                        0
                    } else {
                        libc::POLLIN
                    },
                    revents: 0,
                });
            }
            let polled_pending = self.pending.len();
            for cl in &self.closing {
                wake = wake.min(cl.deadline);
                self.pollfds.push(libc::pollfd {
                    fd: cl.sock.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                });
            }
            if let Some(t) = self.trouble.until {
                wake = wake.min(t);
            }
            let ms = wake.saturating_duration_since(now).as_millis() as i32 + 1;
            self.stall.lap(&self.c.stats.loop_stalls);
            let polled = crate::sys::poll_fds(&mut self.pollfds, ms);
            self.stall.resume();
            if let Err(e) = polled {
                log::error!("node service acceptor: poll: {e}");
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
            // Draining ones first, last to first (only they are removed
            // here, so the indices below stay valid).
            let first_closing = 1 + polled_pending;
            for k in (0..self.closing.len()).rev() {
                if self.pollfds[first_closing + k].revents != 0 && self.closing[k].drain() {
                    self.closing.remove(k);
                }
            }
            // Handshakes (in order, so indices stay valid: a finished one
            // is removed and its pollfd is skipped; a throttled one goes to
            // the end, past the polled ones), then new ones.
            let mut i = 0;
            let mut fd_i = 1;
            while i < self.pending.len() && fd_i < first_closing {
                let revents = self.pollfds[fd_i].revents;
                fd_i += 1;
                self.stall.phase(crate::stall::Phase::Handshake);
                if revents != 0 && self.step(i, revents) {
                    continue; // removed: the same index is the next one
                }
                i += 1;
            }
            if self.pollfds[0].revents != 0 {
                self.stall.phase(crate::stall::Phase::Accept);
                self.accept_some();
            }
            self.c
                .stats
                .handshakes_pending
                .store(self.pending.len() as u64, Ordering::Relaxed);
        }
        // Stopping: every handshake still pending is told why (a consumer
        // fails over at once rather than at its timeout), then closed with
        // what already arrived read, so the close is no reset.
        for p in std::mem::take(&mut self.pending) {
            #[cfg(feature = "rdma")]
            if let Stage::Endpoint { poller } = p.stage {
                self.c.load[poller].fetch_sub(1, Ordering::Relaxed);
            }
            send_error(
                &p.sock,
                proto::CONNECTION,
                Code::ShuttingDown,
                "the node service is stopping",
            );
            let _ = p.sock.shutdown(std::net::Shutdown::Write);
            discard_pending(&p.sock);
        }
        for cl in self.closing.drain(..) {
            discard_pending(&cl.sock);
        }
    }

    /// Closes a refused connection whose ERROR was sent: our side shuts for
    /// writing now (the peer sees the ERROR, then EOF), the socket closes
    /// once the peer closed or [`DRAIN_BYTES`] / [`DRAIN_TIME`] passed.
    fn close_after_error(&mut self, sock: TcpStream) {
        // A welcomed socket was made blocking for its poller: the drain
        // must never block this thread.
        if sock.set_nonblocking(true).is_err() {
            return;
        }
        let _ = sock.shutdown(std::net::Shutdown::Write);
        let mut cl = Closing {
            sock,
            deadline: Instant::now() + DRAIN_TIME,
            drained: 0,
        };
        if cl.drain() {
            return;
        }
        if self.closing.len() >= self.c.cfg.max_handshakes.max(1) {
            let old = self.closing.remove(0);
            discard_pending(&old.sock);
        }
        self.closing.push(cl);
    }

    /// Handshakes not yet admitted (the ones `max_handshakes` bounds).
    fn unadmitted(&self) -> usize {
        self.pending.iter().filter(|p| p.unadmitted()).count()
    }

    /// Makes room for one more handshake not yet admitted, for a new
    /// connection from `ip`: answers a throttled wrong token now, or else
    /// closes the oldest handshake without a whole HELLO (ERROR Busy).
    /// False when the new connection should be refused instead (its
    /// address is over the wrong-token limit and only others' HELLOs
    /// could make room).
    fn make_room(&mut self, now: Instant, ip: Option<IpAddr>, why: &str) -> bool {
        if let Some(k) = self
            .pending
            .iter()
            .position(|p| matches!(p.stage, Stage::Throttled))
        {
            let p = self.pending.remove(k);
            self.answer_throttled(p);
            return true;
        }
        if ip.is_some_and(|ip| self.refusals.bad_tokens(now, ip) >= BAD_TOKEN_LIMIT) {
            return false;
        }
        let Some(k) = self.pending.iter().position(|p| p.unadmitted()) else {
            return true;
        };
        let old = self.pending.remove(k);
        self.c.stats.evicted.fetch_add(1, Ordering::Relaxed);
        let m = format!("{why}; this handshake had not sent its whole HELLO: retry");
        self.finish(old, Refusal::Timeout, Some(Code::Busy), m);
        true
    }

    /// Accepts what is queued (up to a batch, so handshakes keep moving).
    fn accept_some(&mut self) {
        let batch = self.c.cfg.max_handshakes.clamp(1, 64);
        for _ in 0..batch {
            let (sock, peer) = match self.listener.accept() {
                Ok(x) => x,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return,
                Err(e) => {
                    self.accept_failed(e);
                    return;
                }
            };
            self.trouble.backoff = Duration::from_millis(10);
            // Tests of what an acceptor's panic does (tests/cluster.rs):
            // only in builds with the `test-panic` feature.
            #[cfg(feature = "test-panic")]
            if std::env::var_os("KSPEED_TEST_ACCEPTOR_PANIC").is_some() {
                panic!("KSPEED_TEST_ACCEPTOR_PANIC is set: the acceptor panics on a connection");
            }
            let now = Instant::now();
            if sock.set_nonblocking(true).is_err() {
                continue;
            }
            let _ = sock.set_nodelay(true);
            if self.unadmitted() >= self.c.cfg.max_handshakes {
                let why = format!(
                    "{} handshakes were pending (--max-handshakes)",
                    self.c.cfg.max_handshakes
                );
                if !self.make_room(now, Some(peer.ip()), &why) {
                    // Unread, but told why: a consumer retries.
                    let m = format!(
                        "{why} and {} presented {BAD_TOKEN_LIMIT} or more wrong tokens in the last {} s: retry",
                        peer.ip(),
                        LOG_WINDOW.as_secs()
                    );
                    send_error(&sock, proto::CONNECTION, Code::RateLimited, &m);
                    self.c.stats.refused.fetch_add(1, Ordering::Relaxed);
                    self.refusals
                        .record(now, peer, Refusal::Other, Some(Code::RateLimited), &m);
                    self.close_after_error(sock);
                    continue;
                }
            }
            let buf = self
                .spare
                .pop()
                .expect("a spare buffer per handshake not yet admitted");
            self.pending.push(Pending {
                sock,
                peer,
                deadline: now + self.c.cfg.handshake_timeout,
                buf: Some(buf),
                #[cfg(feature = "rdma")]
                ep: [0; ENDPOINT_FRAME_BYTES],
                have: 0,
                stage: Stage::Header,
                #[cfg(feature = "rdma")]
                hello: None,
            });
            // The HELLO usually came with the connection: try it now.
            let i = self.pending.len() - 1;
            self.step(i, libc::POLLIN);
        }
    }

    fn accept_failed(&mut self, e: std::io::Error) {
        let now = Instant::now();
        let scarce = matches!(
            e.raw_os_error(),
            Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM)
        );
        if !scarce {
            // ECONNABORTED and the like: that one connection is gone.
            log::debug!("accept: {e}");
            return;
        }
        self.c.stats.accept_errors.fetch_add(1, Ordering::Relaxed);
        // The descriptors the acceptor can free: a refused connection
        // being drained, and its handshakes not yet admitted: one of each
        // goes, so the queue moves on.
        if !self.closing.is_empty() {
            let old = self.closing.remove(0);
            discard_pending(&old.sock);
        }
        self.make_room(now, None, "the node is out of descriptors");
        self.trouble.until = Some(now + self.trouble.backoff);
        self.trouble.backoff = (self.trouble.backoff * 2).min(Duration::from_secs(1));
        if self.trouble.last_log.is_none() {
            log::warn!(
                "accept: {e}; backing off (up to 1 s) until descriptors free up ({} handshakes pending, {} consumers); further failures are summarized every {} s",
                self.pending.len(),
                self.c.consumers(),
                LOG_WINDOW.as_secs()
            );
            self.trouble.last_log = Some(now);
        } else {
            self.trouble.count += 1;
        }
    }

    fn trouble_summary(&mut self, now: Instant) {
        let Some(t) = self.trouble.last_log else {
            return;
        };
        if now.duration_since(t) < LOG_WINDOW {
            return;
        }
        if self.trouble.count > 0 {
            log::warn!(
                "accept failed {} more time(s) for lack of descriptors or memory in the last {} s",
                self.trouble.count,
                LOG_WINDOW.as_secs()
            );
            self.trouble.count = 0;
            self.trouble.last_log = Some(now);
        } else {
            self.trouble.last_log = None;
        }
    }

    /// Ends the handshakes whose time came (throttled answers, deadlines);
    /// returns the next such time.
    fn expire(&mut self, now: Instant) -> Instant {
        let mut next = now + Duration::from_secs(3600);
        self.closing.retain(|cl| {
            let live = cl.deadline > now;
            if !live {
                discard_pending(&cl.sock);
            }
            live
        });
        let mut i = 0;
        while i < self.pending.len() {
            let d = self.pending[i].deadline;
            if d > now {
                next = next.min(d);
                i += 1;
                continue;
            }
            let p = self.pending.remove(i);
            if matches!(p.stage, Stage::Throttled) {
                self.answer_throttled(p);
                continue;
            }
            self.c
                .stats
                .handshake_timeouts
                .fetch_add(1, Ordering::Relaxed);
            let m = format!(
                "handshake not complete within {} ms",
                self.c.cfg.handshake_timeout.as_millis()
            );
            self.finish(p, Refusal::Timeout, Some(Code::Violation), m);
        }
        next
    }

    /// Answers a throttled wrong token (already counted as a refusal).
    fn answer_throttled(&mut self, p: Pending) {
        let m = format!(
            "job token does not match this node's (answered late: {} presented {BAD_TOKEN_LIMIT} or more wrong tokens in the last {} s)",
            p.peer.ip(),
            LOG_WINDOW.as_secs()
        );
        send_error(&p.sock, proto::CONNECTION, Code::BadToken, &m);
        self.close_after_error(p.sock);
    }

    /// Ends a handshake without a consumer: the ERROR frame (never
    /// blocking), the count, the log.
    fn finish(&mut self, mut p: Pending, why: Refusal, code: Option<Code>, msg: String) {
        #[cfg(feature = "rdma")]
        if let Stage::Endpoint { poller } = p.stage {
            self.c.load[poller].fetch_sub(1, Ordering::Relaxed);
        }
        if let Some(buf) = p.buf.take() {
            self.spare.push(buf);
        }
        self.c.stats.refused.fetch_add(1, Ordering::Relaxed);
        let now = Instant::now();
        if why == Refusal::BadToken && self.refusals.bad_tokens(now, p.peer.ip()) >= BAD_TOKEN_LIMIT
        {
            // Over the limit: answered at the throttle's end, unread from
            // here (its buffer is back with the spares).
            self.refusals.record(now, p.peer, why, code, &msg);
            self.refusals.throttled(p.peer.ip());
            p.stage = Stage::Throttled;
            p.deadline = now + THROTTLE_DELAY;
            self.pending.push(p);
            return;
        }
        self.refusals.record(now, p.peer, why, code, &msg);
        if let Some(code) = code {
            send_error(&p.sock, proto::CONNECTION, code, &msg);
            self.close_after_error(p.sock);
        }
    }

    /// Moves handshake `i` on with what its socket has (`revents` from
    /// poll). True when it left its place in `pending` (ended, or throttled
    /// to the end).
    fn step(&mut self, i: usize, revents: i16) -> bool {
        if matches!(self.pending[i].stage, Stage::Throttled) {
            // Nothing is read from it, but poll reports a hang-up or error
            // whatever the events: the peer is gone, so its late answer
            // cannot arrive. Dropped now (it was counted as a refusal when
            // throttled), else poll would return at once until its time.
            if revents & (libc::POLLHUP | libc::POLLERR | libc::POLLNVAL) != 0 {
                self.pending.remove(i);
                return true;
            }
            return false;
        }
        let step = self.advance(i);
        match step {
            Step::Wait => false,
            Step::Ready(r) => {
                let Ready {
                    hello,
                    #[cfg(feature = "rdma")]
                    rdma,
                    poller,
                } = *r;
                let mut p = self.pending.remove(i);
                if let Some(buf) = p.buf.take() {
                    self.spare.push(buf);
                }
                if p.sock.set_nonblocking(false).is_err() {
                    self.c.load[poller].fetch_sub(1, Ordering::Relaxed);
                    return true;
                }
                let acc = Accepted {
                    fd: p.sock.as_raw_fd(),
                    sock: Some(p.sock),
                    peer: p.peer,
                    hello,
                    #[cfg(feature = "rdma")]
                    rdma,
                };
                log::info!(
                    "consumer {} (rank {} of {}) connected{} (poller {poller}, {} consumers)",
                    acc.peer,
                    acc.hello.rank,
                    acc.hello.world,
                    if acc.hello.transport == proto::TRANSPORT_RDMA && self.c.rdma.is_some() {
                        " over RDMA"
                    } else {
                        ""
                    },
                    self.c.consumers()
                );
                self.c.stats.connections.fetch_add(1, Ordering::Relaxed);
                // The queue holds every consumer the poller may have (its
                // place was reserved at HELLO), so only a poller that is
                // gone (the service stopping or failed) refuses it.
                if let Err(e) = self.senders[poller].try_send(acc) {
                    self.c.load[poller].fetch_sub(1, Ordering::Relaxed);
                    let full = matches!(e, TrySendError::Full(_));
                    let acc = e.into_inner();
                    #[cfg(feature = "rdma")]
                    if acc.rdma.is_some() {
                        self.c.stats.rdma_qps.fetch_sub(1, Ordering::Relaxed);
                    }
                    debug_assert!(!full, "a poller's queue holds all its consumers");
                    let sock = acc
                        .sock
                        .expect("the acceptor's connections own their socket");
                    send_error(
                        &sock,
                        proto::CONNECTION,
                        Code::ShuttingDown,
                        &format!("the node service is stopping (poller {poller} is gone)"),
                    );
                    self.close_after_error(sock);
                }
                true
            }
            Step::Refused(why, code, msg) => {
                let p = self.pending.remove(i);
                self.finish(p, why, code, msg);
                true
            }
        }
    }

    fn advance(&mut self, i: usize) -> Step {
        loop {
            let p = &mut self.pending[i];
            let want = p.want();
            while p.have < want {
                match p.read_some(want) {
                    Ok(0) => {
                        return Step::Refused(
                            Refusal::Closed,
                            None,
                            format!("closed after {} bytes of its handshake", p.have),
                        )
                    }
                    Ok(n) => p.have += n,
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Step::Wait,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(e) => {
                        return Step::Refused(Refusal::Closed, None, format!("handshake: {e}"))
                    }
                }
            }
            match p.stage {
                Stage::Header => {
                    let mut hb = [0u8; proto::HEADER_BYTES];
                    hb.copy_from_slice(&p.space()[..proto::HEADER_BYTES]);
                    match Header::decode(&hb, 0) {
                        Ok(h) if h.kind != Kind::Hello => {
                            let m = format!("expected HELLO, got {:?}", h.kind);
                            return Step::Refused(Refusal::Other, Some(Code::Violation), m);
                        }
                        Ok(h) if h.a != proto::VERSION => {
                            let m = format!(
                                "protocol version {} is not spoken here (this node speaks {})",
                                h.a,
                                proto::VERSION
                            );
                            return Step::Refused(Refusal::Other, Some(Code::BadVersion), m);
                        }
                        Ok(h) => p.stage = Stage::Body(h),
                        Err(e) => {
                            let m = format!("bad HELLO header: {e}");
                            return Step::Refused(Refusal::Other, Some(Code::Violation), m);
                        }
                    }
                }
                Stage::Body(_) => return self.hello_done(i),
                Stage::Throttled => return Step::Wait,
                #[cfg(feature = "rdma")]
                Stage::Endpoint { poller } => return self.endpoint_done(i, poller),
            }
        }
    }

    /// The whole HELLO is in: checks it, admits it (a poller with room,
    /// reserved), sends WELCOME.
    fn hello_done(&mut self, i: usize) -> Step {
        let c = self.c.clone();
        let p = &mut self.pending[i];
        let Stage::Body(h) = p.stage else {
            unreachable!("called on a complete HELLO")
        };
        let buf = p.buf.as_deref().expect("a HELLO buffer while reading it");
        let body = &buf[proto::HEADER_BYTES..proto::HEADER_BYTES + h.body_len as usize];
        let (hello, token) = match Hello::decode(body) {
            Ok(x) => x,
            Err(e) => {
                let m = format!("bad HELLO body: {e}");
                return Step::Refused(Refusal::Other, Some(Code::Violation), m);
            }
        };
        if !super::constant_time_eq(token, &c.cfg.token) {
            let m = "job token does not match this node's".to_string();
            return Step::Refused(Refusal::BadToken, Some(Code::BadToken), m);
        }
        if let Err(m) = hello.check() {
            return Step::Refused(Refusal::Other, Some(Code::Violation), m);
        }
        if !c.space.accepts(hello.catalog_identity) || hello.catalog_samples != c.space.len() {
            let m = format!(
                "consumer's catalog (identity {:08x}, {} samples) is not this node's ({:08x}, {} samples{})",
                hello.catalog_identity,
                hello.catalog_samples,
                c.space.identity(),
                c.space.len(),
                if c.cfg.more_spaces.is_empty() {
                    String::new()
                } else {
                    format!(
                        "; the mixture of {} spaces, in this order",
                        1 + c.cfg.more_spaces.len()
                    )
                }
            );
            return Step::Refused(Refusal::Other, Some(Code::WrongDataset), m);
        }
        let rdma = hello.transport == proto::TRANSPORT_RDMA && c.rdma.is_some();
        #[cfg(feature = "rdma")]
        if rdma && hello.rkey == 0 && hello.ring_addr == 0 {
            let m = "RDMA HELLO without a registered ring".to_string();
            return Step::Refused(Refusal::Other, Some(Code::Violation), m);
        }
        // Admission, before WELCOME: the least loaded poller with room,
        // reserved now (given back when the connection is gone).
        let max = c.cfg.max_conns_per_poller;
        let Some(poller) = (0..c.load.len())
            .filter(|&k| c.load[k].load(Ordering::Relaxed) < max)
            .min_by_key(|&k| c.load[k].load(Ordering::Relaxed))
        else {
            let m = format!(
                "this node serves {} consumers already ({} poller(s) x --max-consumers-per-poller {max})",
                c.consumers(),
                c.load.len()
            );
            return Step::Refused(Refusal::Other, Some(Code::NodeFull), m);
        };
        c.load[poller].fetch_add(1, Ordering::Relaxed);
        let pr = c.space.params();
        if hello.transport == proto::TRANSPORT_RDMA && !rdma {
            log::info!(
                "consumer {} asks for RDMA; this node serves it over TCP (no --rdma)",
                p.peer
            );
        }
        let w = Welcome {
            node_index: pr.node_index,
            nodes: pr.placement.nodes,
            replicas: pr.placement.replicas,
            owner_fn: pr.placement.owner_fn.code(),
            max_data_bytes: c.cfg.chunk_bytes,
            max_grants: c.cfg.max_grants as u64,
            transport: if rdma {
                proto::TRANSPORT_RDMA
            } else {
                proto::TRANSPORT_TCP
            },
        };
        // A fresh socket's send buffer takes these 40 bytes whole.
        if let Err(e) = p.sock.write_all(&w.encode()) {
            c.load[poller].fetch_sub(1, Ordering::Relaxed);
            return Step::Refused(Refusal::Closed, None, format!("sending WELCOME: {e}"));
        }
        #[cfg(feature = "rdma")]
        if rdma {
            // Admitted: the HELLO buffer goes back, the endpoint is read
            // into the handshake's own small one.
            if let Some(buf) = p.buf.take() {
                self.spare.push(buf);
            }
            let p = &mut self.pending[i];
            p.hello = Some(hello);
            p.stage = Stage::Endpoint { poller };
            p.have = 0;
            return self.advance(i);
        }
        Step::Ready(Box::new(Ready {
            hello,
            #[cfg(feature = "rdma")]
            rdma: None,
            poller,
        }))
    }

    /// RDMA: the consumer's endpoint is in: makes this end's queue pair and
    /// answers with it.
    #[cfg(feature = "rdma")]
    fn endpoint_done(&mut self, i: usize, poller: usize) -> Step {
        let c = self.c.clone();
        let p = &mut self.pending[i];
        let mut hb = [0u8; proto::HEADER_BYTES];
        hb.copy_from_slice(&p.ep[..proto::HEADER_BYTES]);
        let body = &p.ep[proto::HEADER_BYTES..];
        let res = super::rdma_handshake(&c, &mut p.sock, &hb, body, poller);
        match res {
            Ok(r) => {
                let hello = p.hello.take().expect("set with the Endpoint stage");
                Step::Ready(Box::new(Ready {
                    hello,
                    rdma: Some(r),
                    poller,
                }))
            }
            Err((code, m)) => {
                // finish() gives the poller's reservation back.
                Step::Refused(Refusal::Other, Some(code), m)
            }
        }
    }
}

impl Closing {
    /// Reads and discards what the peer sent; true when done (the peer
    /// closed, failed, or sent [`DRAIN_BYTES`]).
    fn drain(&mut self) -> bool {
        let mut sink = [0u8; 4096];
        loop {
            match (&self.sock).read(&mut sink) {
                Ok(0) => return true,
                Ok(n) => {
                    self.drained += n;
                    if self.drained >= DRAIN_BYTES {
                        return true;
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return false,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(_) => return true,
            }
        }
    }
}

/// Reads and discards what already arrived on a non-blocking socket about
/// to close (at most [`DRAIN_BYTES`]), so its close is no reset when the
/// peer sent nothing more.
fn discard_pending(sock: &TcpStream) {
    let mut sink = [0u8; 4096];
    let mut total = 0;
    while total < DRAIN_BYTES {
        match (&*sock).read(&mut sink) {
            Ok(0) => return,
            Ok(n) => total += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_new_address_is_tracked_and_throttled_past_the_tracked_limit() {
        let mut log = RefusalLog::new();
        let now = Instant::now();
        for k in 0..MAX_TRACKED_ADDRS as u32 {
            let peer = SocketAddr::new(IpAddr::from((0x0a00_0000u32 + k).to_be_bytes()), 1);
            log.record(now, peer, Refusal::BadToken, Some(Code::BadToken), "x");
        }
        assert_eq!(log.by_addr.len(), MAX_TRACKED_ADDRS);
        let new = SocketAddr::new(IpAddr::from([192, 0, 2, 1]), 1);
        for _ in 0..BAD_TOKEN_LIMIT {
            log.record(now, new, Refusal::BadToken, Some(Code::BadToken), "x");
        }
        assert_eq!(log.bad_tokens(now, new.ip()), BAD_TOKEN_LIMIT);
        assert_eq!(log.by_addr.len(), MAX_TRACKED_ADDRS, "memory stays bounded");
        // Expired records go first, however many there are.
        let later = now + LOG_WINDOW + Duration::from_secs(1);
        let other = SocketAddr::new(IpAddr::from([192, 0, 2, 2]), 1);
        log.record(later, other, Refusal::BadToken, Some(Code::BadToken), "x");
        assert_eq!(log.by_addr.len(), 1);
        assert_eq!(log.bad_tokens(later, other.ip()), 1);
    }
}
