//! The acceptor: one thread takes connections and runs every handshake
//! (HELLO, the token check, WELCOME and, over RDMA, the queue-pair swap) as
//! a non-blocking state machine over `poll(2)`, so no peer gets a thread or
//! can hold up another one's handshake.
//!
//! Every bound here is fixed at start (docs/PROTOCOL.md, "Limits"):
//! - one deadline for the whole handshake (`handshake_timeout`), however
//!   the peer paces its bytes;
//! - at most `max_handshakes` handshakes pending; a connection accepted
//!   beyond that closes the oldest pending one (a real consumer sends its
//!   HELLO in one write right after connecting, so the oldest is the one
//!   most likely stalled);
//! - at most `max_conns_per_poller` consumers per poller: a HELLO beyond
//!   that is refused with [`Code::NodeFull`];
//! - `accept` failing for lack of descriptors (EMFILE, ENFILE) or memory
//!   closes the oldest pending handshake and backs off (10 ms doubling to
//!   1 s); it is logged once, then summarized every [`LOG_WINDOW`];
//! - refusals are logged once per address per [`LOG_WINDOW`], the rest
//!   summarized; an address that presents [`BAD_TOKEN_LIMIT`] wrong tokens
//!   within a window has its further connections closed unread until the
//!   window ends.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::Sender;

use super::{send_error, Accepted, Common};
use crate::transport::proto::{self, Code, Header, Hello, Kind, Welcome};

/// Window of the refusal and accept-error log summaries and of the
/// per-address bad-token limit.
pub(crate) const LOG_WINDOW: Duration = Duration::from_secs(10);

/// Wrong tokens one address may present within [`LOG_WINDOW`] before its
/// connections are closed unread for the rest of the window.
pub(crate) const BAD_TOKEN_LIMIT: u32 = 16;

/// Addresses the refusal log tracks at once (beyond it, refusals are only
/// counted).
const MAX_TRACKED_ADDRS: usize = 4096;

/// A handshake buffer holds the largest HELLO (header, fixed part, token).
const BUF_BYTES: usize = proto::HEADER_BYTES + proto::HELLO_FIXED_BYTES + proto::MAX_TOKEN_BYTES;

#[derive(Clone, Copy)]
enum Stage {
    /// Reading the HELLO header.
    Header,
    /// Reading the HELLO body (the header is in the buffer).
    Body(Header),
    /// RDMA: WELCOME sent; reading the consumer's RDMA_ENDPOINT. The poller
    /// whose load this connection already counts in.
    #[cfg(feature = "rdma")]
    Endpoint { poller: usize },
}

struct Pending {
    sock: TcpStream,
    peer: SocketAddr,
    deadline: Instant,
    buf: Box<[u8]>,
    have: usize,
    stage: Stage,
    /// RDMA: the decoded HELLO while the endpoints are swapped.
    #[cfg(feature = "rdma")]
    hello: Option<Hello>,
}

impl Pending {
    /// Bytes the current stage needs in the buffer.
    fn want(&self) -> usize {
        match self.stage {
            Stage::Header => proto::HEADER_BYTES,
            Stage::Body(h) => proto::HEADER_BYTES + h.body_len as usize,
            #[cfg(feature = "rdma")]
            Stage::Endpoint { .. } => proto::HEADER_BYTES + proto::RDMA_ENDPOINT_BYTES,
        }
    }
}

/// Why a handshake ended without a consumer.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Refusal {
    /// The token did not match.
    BadToken,
    /// The deadline passed.
    Timeout,
    /// The peer closed or reset before finishing.
    Closed,
    /// Anything else (bad frame, version, dataset, node full, setup).
    Other,
}

/// What one step of a handshake came to.
enum Step {
    /// Waiting for more bytes.
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
    /// Closed unread (over the bad-token limit).
    blocked: u64,
    last: String,
}

/// Refusals, logged once per address and window, the rest summarized.
struct RefusalLog {
    by_addr: HashMap<IpAddr, AddrLog>,
    /// Refusals of addresses the map had no room for.
    untracked: u64,
    last_sweep: Instant,
}

impl RefusalLog {
    fn new() -> Self {
        RefusalLog {
            by_addr: HashMap::with_capacity(64),
            untracked: 0,
            last_sweep: Instant::now(),
        }
    }

    fn summarize(ip: &IpAddr, r: &AddrLog) {
        let more = r.refusals.saturating_sub(1);
        if more > 0 || r.blocked > 0 {
            log::warn!(
                "refused {ip} {more} more time(s) in the last {} s ({} wrong token(s), {} connection(s) closed unread over the limit of {BAD_TOKEN_LIMIT} wrong tokens); latest: {}",
                LOG_WINDOW.as_secs(),
                r.bad_tokens,
                r.blocked,
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
        if self.untracked > 0 {
            log::warn!(
                "refused {} more connection(s) from addresses past the {MAX_TRACKED_ADDRS} tracked",
                self.untracked
            );
            self.untracked = 0;
        }
    }

    fn record(&mut self, now: Instant, peer: SocketAddr, why: Refusal, msg: &str) {
        let ip = peer.ip();
        if !self.by_addr.contains_key(&ip) && self.by_addr.len() >= MAX_TRACKED_ADDRS {
            self.untracked += 1;
            return;
        }
        let r = self.by_addr.entry(ip).or_insert_with(|| AddrLog {
            since: now,
            refusals: 0,
            bad_tokens: 0,
            blocked: 0,
            last: String::new(),
        });
        r.refusals += 1;
        if why == Refusal::BadToken {
            r.bad_tokens += 1;
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

    /// True when `ip` is over the bad-token limit in its window (the
    /// connection is then closed unread and counted).
    fn blocked(&mut self, now: Instant, ip: IpAddr) -> bool {
        match self.by_addr.get_mut(&ip) {
            Some(r)
                if r.bad_tokens >= BAD_TOKEN_LIMIT && now.duration_since(r.since) < LOG_WINDOW =>
            {
                r.blocked += 1;
                true
            }
            _ => false,
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
    /// Pending handshakes, oldest first (at most `max_handshakes`).
    pending: Vec<Pending>,
    /// Spare handshake buffers (`max_handshakes` in all, made at start).
    spare: Vec<Box<[u8]>>,
    pollfds: Vec<libc::pollfd>,
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
        Acceptor {
            listener,
            senders,
            pending: Vec::with_capacity(cap),
            spare: (0..cap)
                .map(|_| vec![0u8; BUF_BYTES].into_boxed_slice())
                .collect(),
            pollfds: Vec::with_capacity(cap + 1),
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
        while !self.c.stop.load(Ordering::Acquire) {
            let now = Instant::now();
            self.expire(now);
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
                    events: libc::POLLIN,
                    revents: 0,
                });
            }
            // Wake for the stop flag, the next deadline and the back-off.
            let mut wake = now + Duration::from_millis(100);
            if let Some(p) = self.pending.first() {
                wake = wake.min(p.deadline);
            }
            if let Some(t) = self.trouble.until {
                wake = wake.min(t);
            }
            let ms = wake.saturating_duration_since(now).as_millis() as i32 + 1;
            if let Err(e) = crate::sys::poll_fds(&mut self.pollfds, ms) {
                log::error!("node service acceptor: poll: {e}");
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
            // Handshakes first (in order, so indices stay valid: a finished
            // one is removed and its pollfd is skipped), then new ones.
            let mut i = 0;
            let mut fd_i = 1;
            while i < self.pending.len() {
                let ready = self.pollfds[fd_i].revents != 0;
                fd_i += 1;
                if ready && self.step(i) {
                    continue; // removed: the same index is the next one
                }
                i += 1;
            }
            if self.pollfds[0].revents != 0 {
                self.accept_some();
            }
            self.c
                .stats
                .handshakes_pending
                .store(self.pending.len() as u64, Ordering::Relaxed);
        }
        for p in self.pending.drain(..) {
            drop(p.sock);
        }
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
            let now = Instant::now();
            if self.refusals.blocked(now, peer.ip()) {
                self.c.stats.refused.fetch_add(1, Ordering::Relaxed);
                drop(sock);
                continue;
            }
            if sock.set_nonblocking(true).is_err() {
                continue;
            }
            let _ = sock.set_nodelay(true);
            if self.pending.len() >= self.c.cfg.max_handshakes {
                // Full: the oldest pending handshake makes room.
                let old = self.pending.remove(0);
                self.c.stats.evicted.fetch_add(1, Ordering::Relaxed);
                self.finish(
                    old,
                    Refusal::Timeout,
                    Some(Code::Violation),
                    format!(
                        "handshake not complete while {} newer connections waited (--max-handshakes)",
                        self.c.cfg.max_handshakes
                    ),
                );
            }
            let buf = self
                .spare
                .pop()
                .expect("a spare buffer per pending handshake");
            self.pending.push(Pending {
                sock,
                peer,
                deadline: now + self.c.cfg.handshake_timeout,
                buf,
                have: 0,
                stage: Stage::Header,
                #[cfg(feature = "rdma")]
                hello: None,
            });
            // The HELLO usually came with the connection: try it now.
            let i = self.pending.len() - 1;
            self.step(i);
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
        if !self.pending.is_empty() {
            // The only descriptors the acceptor can free are its pending
            // handshakes': the oldest goes, so the queue moves on.
            let old = self.pending.remove(0);
            self.c.stats.evicted.fetch_add(1, Ordering::Relaxed);
            self.finish(
                old,
                Refusal::Timeout,
                Some(Code::Violation),
                "handshake closed: the node is out of descriptors".into(),
            );
        }
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

    /// Closes the handshakes past their deadline.
    fn expire(&mut self, now: Instant) {
        while self.pending.first().is_some_and(|p| p.deadline <= now) {
            let p = self.pending.remove(0);
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
    }

    /// Ends a handshake without a consumer: the ERROR frame (never
    /// blocking), the count, the log.
    fn finish(&mut self, p: Pending, why: Refusal, code: Option<Code>, msg: String) {
        #[cfg(feature = "rdma")]
        if let Stage::Endpoint { poller } = p.stage {
            self.c.load[poller].fetch_sub(1, Ordering::Relaxed);
        }
        if let Some(code) = code {
            send_error(&p.sock, proto::CONNECTION, code, &msg);
        }
        self.c.stats.refused.fetch_add(1, Ordering::Relaxed);
        self.refusals.record(Instant::now(), p.peer, why, &msg);
        self.spare.push(p.buf);
    }

    /// Moves handshake `i` on with what its socket has. True when it ended
    /// (and was removed from `pending`).
    fn step(&mut self, i: usize) -> bool {
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
                let p = self.pending.remove(i);
                self.spare.push(p.buf);
                let acc = Accepted {
                    sock: p.sock,
                    peer: p.peer,
                    hello,
                    #[cfg(feature = "rdma")]
                    rdma,
                };
                if acc.sock.set_nonblocking(false).is_err() {
                    self.c.load[poller].fetch_sub(1, Ordering::Relaxed);
                    return true;
                }
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
                if let Err(e) = self.senders[poller].try_send(acc) {
                    // The poller is gone (stopping) or its queue is full.
                    self.c.load[poller].fetch_sub(1, Ordering::Relaxed);
                    let acc = e.into_inner();
                    #[cfg(feature = "rdma")]
                    if acc.rdma.is_some() {
                        self.c.stats.rdma_qps.fetch_sub(1, Ordering::Relaxed);
                    }
                    send_error(
                        &acc.sock,
                        proto::CONNECTION,
                        Code::NodeFull,
                        "the node's pollers are not taking consumers now",
                    );
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
                match p.sock.read(&mut p.buf[p.have..want]) {
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
            let mut hb = [0u8; proto::HEADER_BYTES];
            hb.copy_from_slice(&p.buf[..proto::HEADER_BYTES]);
            match p.stage {
                Stage::Header => match Header::decode(&hb, 0) {
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
                },
                Stage::Body(_) => return self.hello_done(i),
                #[cfg(feature = "rdma")]
                Stage::Endpoint { poller } => return self.endpoint_done(i, poller),
            }
        }
    }

    /// The whole HELLO is in: checks it, picks a poller, sends WELCOME.
    fn hello_done(&mut self, i: usize) -> Step {
        let c = self.c.clone();
        let p = &mut self.pending[i];
        let Stage::Body(h) = p.stage else {
            unreachable!("called on a complete HELLO")
        };
        let body = &p.buf[proto::HEADER_BYTES..proto::HEADER_BYTES + h.body_len as usize];
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
        let cat = c.space.catalog();
        if hello.catalog_identity != cat.identity() || hello.catalog_samples != cat.len() {
            let m = format!(
                "consumer's catalog (identity {:08x}, {} samples) is not this node's ({:08x}, {} samples)",
                hello.catalog_identity,
                hello.catalog_samples,
                cat.identity(),
                cat.len()
            );
            return Step::Refused(Refusal::Other, Some(Code::WrongDataset), m);
        }
        // The least loaded poller with room, reserved now.
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
        let rdma = hello.transport == proto::TRANSPORT_RDMA && c.rdma.is_some();
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
            if hello.rkey == 0 && hello.ring_addr == 0 {
                c.load[poller].fetch_sub(1, Ordering::Relaxed);
                let m = "RDMA HELLO without a registered ring".to_string();
                return Step::Refused(Refusal::Other, Some(Code::Violation), m);
            }
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
        hb.copy_from_slice(&p.buf[..proto::HEADER_BYTES]);
        let body = &p.buf[proto::HEADER_BYTES..proto::HEADER_BYTES + proto::RDMA_ENDPOINT_BYTES];
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
