//! The handshakes with the nodes, all on one thread: non-blocking sockets
//! stepped by `poll(2)`, at most [`HANDSHAKES_IN_FLIGHT`] at once (NCCL
//! connects its peers in rounds of 128 the same way), each under its own
//! deadline from when it starts. No thread per node: a start against
//! thousands of nodes costs one thread and a few round trips per node,
//! and stalled nodes cost the start one `node_timeout`, not one each.
//!
//! One handshake: TCP connect (at most `connect_timeout`), HELLO out, the
//! answer in (WELCOME or a refusal), the checks on WELCOME, then the data
//! path's own exchange if it has one ([`Receive::begin`]: over RDMA the
//! queue pairs' endpoints), then [`Receive::finish`]. A try that fails in
//! a way the node may get over by itself (refused at connect, reset before
//! the answer; or a refusal whose code asks for it: node full, busy,
//! rate-limited) is tried again after a back-off with jitter, until the
//! node's deadline.
//!
//! Names in addresses are resolved before the first try, on at most
//! [`RESOLVERS`] threads (`getaddrinfo` blocks); numeric addresses need
//! none.

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use socket2::{Domain, Protocol, SockAddr, Socket, Type};

use super::retry::{jitter, retry_backoff, retryable, ConnectError};
use super::{Conn, NetSetup, Receive};
use crate::error::Error;
use crate::transport::proto::{self, Code, Header, Kind, Welcome};

/// Handshakes in progress at once (counting those waiting out a back-off).
pub const HANDSHAKES_IN_FLIGHT: usize = 128;

/// Threads that resolve names in addresses, at most.
const RESOLVERS: usize = 16;

/// The longest single wait in `poll`: deadlines and back-offs are checked
/// at least this often.
const POLL_MAX: Duration = Duration::from_millis(100);

/// One node's connection and its WELCOME, or why there is none.
pub(crate) type Outcome<R> = Result<(Conn<R>, Welcome), ConnectError>;

/// Where a handshake is.
enum Phase<R: Receive> {
    /// Not started (no place among those in flight yet).
    Queued,
    /// Waiting out a back-off until the instant.
    Backoff(Instant),
    /// TCP connect in progress; given up at the instant.
    Connecting(Instant),
    /// HELLO going out.
    SendHello,
    /// The answer to HELLO coming in.
    ReadWelcome,
    /// The data path's message going out; then its answer.
    SendExchange(R::Pending),
    ReadExchange(R::Pending),
    /// Over (boxed: a live connection is large, the other phases small).
    Done(Box<Outcome<R>>),
}

struct Handshake<R: Receive> {
    node: u32,
    addr: String,
    resolved: Result<SocketAddr, String>,
    /// When it started, and by when it must be done.
    started: Instant,
    deadline: Instant,
    /// Tries that failed and were retried.
    attempt: u32,
    /// The last try's NODE_FULL refusal: a deadline passing during a later
    /// try still ends in it, not in "unreachable" (reads from the source).
    refused_full: Option<Error>,
    phase: Phase<R>,
    sock: Option<Socket>,
    /// Bytes going out and how many went.
    out: Vec<u8>,
    out_sent: usize,
    /// A frame coming in: its header once read, its bytes so far.
    header: Option<Header>,
    inb: Vec<u8>,
    in_got: usize,
    /// When the last message went (for "timed out after N ms").
    sent_at: Instant,
    welcome: Option<Welcome>,
}

/// Runs the handshakes with `nodes` (index, address) and returns each
/// one's outcome, in the same order.
pub(crate) fn handshake_all<R: Receive>(
    setup: &NetSetup,
    common: &R::Common,
    nodes: &[(u32, String)],
) -> Vec<Outcome<R>> {
    let now = Instant::now();
    let resolved = resolve_all(nodes);
    let mut hs: Vec<Handshake<R>> = nodes
        .iter()
        .zip(resolved)
        .map(|((node, addr), resolved)| Handshake {
            node: *node,
            addr: addr.clone(),
            resolved,
            started: now,
            deadline: now,
            attempt: 0,
            refused_full: None,
            phase: Phase::Queued,
            sock: None,
            out: Vec::new(),
            out_sent: 0,
            header: None,
            inb: Vec::new(),
            in_got: 0,
            sent_at: now,
            welcome: None,
        })
        .collect();
    let mut next = 0; // the first handshake not started
    let mut active = 0;
    let mut fds: Vec<libc::pollfd> = Vec::with_capacity(HANDSHAKES_IN_FLIGHT);
    let mut who: Vec<usize> = Vec::with_capacity(HANDSHAKES_IN_FLIGHT);
    loop {
        let now = Instant::now();
        while active < HANDSHAKES_IN_FLIGHT && next < hs.len() {
            let h = &mut hs[next];
            h.started = now;
            h.deadline = now + setup.node_timeout;
            h.phase = Phase::Backoff(now);
            active += 1;
            next += 1;
        }
        // Timers: back-offs that ran out start a try; deadlines end one.
        fds.clear();
        who.clear();
        let mut wake = now + POLL_MAX;
        for (i, h) in hs.iter_mut().enumerate() {
            let events = match &h.phase {
                Phase::Queued | Phase::Done(_) => continue,
                Phase::Backoff(at) if *at <= now => {
                    h.start_try(setup);
                    match h.phase {
                        Phase::Done(_) => {
                            active -= 1;
                            continue;
                        }
                        Phase::Backoff(at) => {
                            // Failed at once (refused), and waits again.
                            wake = wake.min(at);
                            continue;
                        }
                        _ => libc::POLLOUT,
                    }
                }
                Phase::Backoff(at) => {
                    wake = wake.min(*at);
                    continue;
                }
                Phase::Connecting(by) if *by <= now => {
                    let waited = setup.connect_timeout.min(h.deadline - h.started);
                    h.failed_try(ConnectError::Unreachable(format!(
                        "connect: timed out after {} ms",
                        waited.as_millis()
                    )));
                    if let Phase::Done(_) = h.phase {
                        active -= 1;
                    }
                    continue;
                }
                Phase::Connecting(by) => {
                    wake = wake.min(*by);
                    libc::POLLOUT
                }
                Phase::SendHello | Phase::SendExchange(_) => libc::POLLOUT,
                Phase::ReadWelcome | Phase::ReadExchange(_) => libc::POLLIN,
            };
            if h.deadline <= now {
                h.timed_out();
                active -= 1;
                continue;
            }
            wake = wake.min(h.deadline);
            fds.push(libc::pollfd {
                fd: h.sock.as_ref().expect("a socket in this phase").as_raw_fd(),
                events,
                revents: 0,
            });
            who.push(i);
        }
        if active == 0 && next == hs.len() {
            break;
        }
        let wait = wake.saturating_duration_since(Instant::now());
        // Rounded up: a wait cut to 0 ms would spin until the instant.
        let ms = wait.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32;
        if let Err(e) = crate::sys::poll_fds(&mut fds, ms) {
            // Not expected (EINVAL, ENOMEM): every handshake in progress
            // fails with it rather than spinning.
            for &i in &who {
                hs[i].finish(Err(ConnectError::Unreachable(format!("poll: {e}"))));
                active -= 1;
            }
            continue;
        }
        for (k, &i) in who.iter().enumerate() {
            if fds[k].revents == 0 {
                continue;
            }
            let h = &mut hs[i];
            h.step(setup, common);
            if let Phase::Done(_) = h.phase {
                active -= 1;
            }
        }
    }
    hs.into_iter()
        .map(|h| match h.phase {
            Phase::Done(o) => *o,
            _ => unreachable!("the loop ends when every handshake is done"),
        })
        .collect()
}

/// Resolves every address: numeric ones here, names on up to
/// [`RESOLVERS`] threads.
fn resolve_all(nodes: &[(u32, String)]) -> Vec<Result<SocketAddr, String>> {
    let mut out: Vec<Option<Result<SocketAddr, String>>> = nodes
        .iter()
        .map(|(_, a)| a.parse::<SocketAddr>().ok().map(Ok))
        .collect();
    let names: Vec<usize> = (0..nodes.len()).filter(|&i| out[i].is_none()).collect();
    if names.is_empty() {
        return out.into_iter().map(|o| o.expect("numeric")).collect();
    }
    let per = names.len().div_ceil(RESOLVERS);
    let results: Vec<(usize, Result<SocketAddr, String>)> = std::thread::scope(|sc| {
        let handles: Vec<_> = names
            .chunks(per)
            .map(|chunk| {
                sc.spawn(move || {
                    chunk
                        .iter()
                        .map(|&i| (i, resolve(nodes[i].0, &nodes[i].1)))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap_or_default())
            .collect()
    });
    for (i, r) in results {
        out[i] = Some(r);
    }
    out.into_iter()
        .map(|o| o.unwrap_or_else(|| Err("resolve: the resolver thread panicked".into())))
        .collect()
}

fn resolve(node: u32, addr: &str) -> Result<SocketAddr, String> {
    crate::transport::Node {
        index: node,
        addr: addr.to_string(),
    }
    .resolve()
    .map_err(|e| format!("resolve: {e}"))
}

/// Whether a failed connect, send or read of the handshake is one the
/// node may get over by itself (see [`ConnectError::Transient`]).
pub(crate) fn transient(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        ErrorKind::ConnectionRefused
            | ErrorKind::ConnectionReset
            | ErrorKind::ConnectionAborted
            | ErrorKind::BrokenPipe
            | ErrorKind::UnexpectedEof
    )
}

fn io_failure(what: &str, e: &std::io::Error) -> ConnectError {
    if transient(e) {
        ConnectError::Transient(format!("{what}: {e}"))
    } else {
        ConnectError::Unreachable(format!("{what}: {e}"))
    }
}

impl<R: Receive> Handshake<R> {
    fn violation(&self, what: String) -> ConnectError {
        ConnectError::Refused(Error::ProtocolViolation {
            node: self.node,
            addr: self.addr.clone(),
            what,
        })
    }

    fn finish(&mut self, o: Outcome<R>) {
        self.sock = None;
        self.phase = Phase::Done(Box::new(o));
    }

    /// Starts a try: a non-blocking TCP connect.
    fn start_try(&mut self, setup: &NetSetup) {
        let sa = match &self.resolved {
            Ok(sa) => *sa,
            Err(why) => return self.finish(Err(ConnectError::Unreachable(why.clone()))),
        };
        let sock = match Socket::new(Domain::for_address(sa), Type::STREAM, Some(Protocol::TCP)) {
            Ok(s) => s,
            Err(e) => return self.finish(Err(io_failure("socket", &e))),
        };
        if let Err(e) = sock.set_nonblocking(true) {
            return self.finish(Err(io_failure("socket", &e)));
        }
        let _ = sock.set_tcp_nodelay(true);
        let now = Instant::now();
        match sock.connect(&SockAddr::from(sa)) {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(libc::EINPROGRESS) => {}
            Err(e) => return self.failed_try(io_failure("connect", &e)),
        }
        self.sock = Some(sock);
        let by = (now + setup.connect_timeout).min(self.deadline);
        self.phase = Phase::Connecting(by);
    }

    /// A try failed with `e`: again after a back-off when the node may get
    /// over it and the deadline allows, else the handshake's outcome.
    fn failed_try(&mut self, e: ConnectError) {
        self.sock = None;
        let (retry, why, full) = match &e {
            ConnectError::Transient(why) => (true, why.clone(), false),
            ConnectError::Refused(Error::Refused { code, message, .. }) if retryable(code) => (
                true,
                format!("{code}: {message}"),
                *code == Code::NodeFull.name(),
            ),
            _ => (false, String::new(), false),
        };
        if !retry {
            return self.finish(Err(e));
        }
        self.refused_full = match &e {
            ConnectError::Refused(r) if full => Some(r.clone()),
            _ => None,
        };
        let wait = retry_backoff(self.attempt, jitter(self.node, self.attempt));
        self.attempt += 1;
        let now = Instant::now();
        if now + wait < self.deadline {
            log::debug!(
                "node {} ({}): {why}; trying again in {} ms",
                self.node,
                self.addr,
                wait.as_millis()
            );
            self.phase = Phase::Backoff(now + wait);
            return;
        }
        let still = self.still();
        let out = match e {
            // More consumers than the nodes are configured for: the job
            // is misconfigured.
            ConnectError::Refused(Error::Refused {
                node,
                addr,
                code,
                message,
            }) if full => ConnectError::Refused(Error::Refused {
                node,
                addr,
                code,
                message: format!("{message} {still}"),
            }),
            _ => ConnectError::Unreachable(format!("{why} {still}")),
        };
        self.finish(Err(out));
    }

    /// "(still so after N tries over M ms, the node timeout)".
    fn still(&self) -> String {
        let ms = self.started.elapsed().as_millis();
        format!(
            "(still so after {} tries over {ms} ms, the node timeout)",
            self.attempt
        )
    }

    /// The node's deadline passed during a try.
    fn timed_out(&mut self) {
        // Full at the last answer: misconfigured, however the last try went.
        if let Some(mut e) = self.refused_full.take() {
            if let Error::Refused { message, .. } = &mut e {
                *message = format!("{message} {}", self.still());
            }
            return self.finish(Err(ConnectError::Refused(e)));
        }
        let waited = self.sent_at.elapsed().as_millis();
        let why = match self.phase {
            Phase::ReadWelcome if self.header.is_none() => {
                format!("no answer to HELLO: timed out after {waited} ms")
            }
            Phase::ReadWelcome => format!("truncated answer to HELLO: timed out after {waited} ms"),
            Phase::SendHello => format!("send HELLO: timed out after {waited} ms"),
            Phase::SendExchange(_) => {
                format!("send {}: timed out after {waited} ms", R::EXCHANGE)
            }
            Phase::ReadExchange(_) => format!("no {}: timed out after {waited} ms", R::EXCHANGE),
            _ => format!(
                "connect: timed out after {} ms",
                self.started.elapsed().as_millis()
            ),
        };
        self.finish(Err(ConnectError::Unreachable(why)));
    }

    /// The socket is ready: moves the handshake on as far as it goes
    /// without blocking.
    fn step(&mut self, setup: &NetSetup, common: &R::Common) {
        loop {
            match self.phase {
                Phase::Connecting(_) => {
                    let sock = self.sock.as_ref().expect("connecting socket");
                    match sock.take_error() {
                        Ok(None) => {}
                        Ok(Some(e)) | Err(e) => return self.failed_try(io_failure("connect", &e)),
                    }
                    // Still in progress (a spurious wake-up): wait on.
                    if sock.peer_addr().is_err() {
                        return;
                    }
                    self.out.clear();
                    setup.hello.encode(&setup.token, &mut self.out);
                    self.out_sent = 0;
                    self.sent_at = Instant::now();
                    self.phase = Phase::SendHello;
                }
                Phase::SendHello | Phase::SendExchange(_) => {
                    let what = match self.phase {
                        Phase::SendHello => "send HELLO".to_string(),
                        _ => format!("send {}", R::EXCHANGE),
                    };
                    match self.send() {
                        Ok(false) => return,
                        Ok(true) => {}
                        Err(e) => {
                            return if matches!(self.phase, Phase::SendHello) {
                                self.failed_try(io_failure(&what, &e))
                            } else {
                                self.finish(Err(ConnectError::Unreachable(format!("{what}: {e}"))))
                            }
                        }
                    }
                    self.header = None;
                    self.inb.clear();
                    self.inb.resize(proto::HEADER_BYTES, 0);
                    self.in_got = 0;
                    self.sent_at = Instant::now();
                    self.phase = match std::mem::replace(&mut self.phase, Phase::Queued) {
                        Phase::SendHello => Phase::ReadWelcome,
                        Phase::SendExchange(p) => Phase::ReadExchange(p),
                        _ => unreachable!("a sending phase"),
                    };
                }
                Phase::ReadWelcome | Phase::ReadExchange(_) => {
                    let hello = matches!(self.phase, Phase::ReadWelcome);
                    match self.receive() {
                        Ok(false) => return,
                        Ok(true) => {}
                        Err(Ok(e)) => {
                            let what = match (hello, self.header.is_some()) {
                                (true, false) => "no answer to HELLO".to_string(),
                                (true, true) => "truncated answer to HELLO".to_string(),
                                (false, false) => format!("no {}", R::EXCHANGE),
                                (false, true) => "truncated answer".to_string(),
                            };
                            return if hello {
                                self.failed_try(io_failure(&what, &e))
                            } else {
                                self.finish(Err(ConnectError::Unreachable(format!("{what}: {e}"))))
                            };
                        }
                        Err(Err(v)) => return self.finish(Err(v)),
                    }
                    if hello {
                        match self.on_welcome(setup, common) {
                            Ok(()) => {}
                            Err(e) => return self.failed_try(e),
                        }
                    } else {
                        let Phase::ReadExchange(p) =
                            std::mem::replace(&mut self.phase, Phase::Queued)
                        else {
                            unreachable!("reading the exchange")
                        };
                        let h = self.header.expect("a whole frame");
                        let res =
                            R::finish(common, p, Some((&h, &self.inb[..])), self.node, &self.addr);
                        return match res {
                            Ok(data) => self.connected(data),
                            Err(e) => self.finish(Err(e)),
                        };
                    }
                }
                Phase::Queued | Phase::Backoff(_) | Phase::Done(_) => return,
            }
        }
    }

    /// Sends what is left of `out`: true when all of it went, false when
    /// the socket is full.
    fn send(&mut self) -> std::io::Result<bool> {
        let mut sock = self.sock.as_ref().expect("socket");
        while self.out_sent < self.out.len() {
            match sock.write(&self.out[self.out_sent..]) {
                Ok(0) => return Err(ErrorKind::WriteZero.into()),
                Ok(n) => self.out_sent += n,
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(false),
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(true)
    }

    /// Reads the frame coming in: true when it is whole (`header` and its
    /// body in `inb`), false when the socket has no more now. `Err(Ok)`:
    /// the socket failed or closed; `Err(Err)`: the header breaks the
    /// protocol.
    fn receive(&mut self) -> Result<bool, Result<std::io::Error, ConnectError>> {
        loop {
            if self.in_got == self.inb.len() {
                if self.header.is_some() {
                    return Ok(true);
                }
                let mut hb = [0u8; proto::HEADER_BYTES];
                hb.copy_from_slice(&self.inb);
                let h = Header::decode(&hb, 0).map_err(|e| Err(self.violation(e.to_string())))?;
                self.header = Some(h);
                self.inb.clear();
                self.inb.resize(h.body_len as usize, 0);
                self.in_got = 0;
                continue;
            }
            let mut sock = self.sock.as_ref().expect("socket");
            match sock.read(&mut self.inb[self.in_got..]) {
                Ok(0) => {
                    return Err(Ok(std::io::Error::new(
                        ErrorKind::UnexpectedEof,
                        "failed to fill whole buffer",
                    )))
                }
                Ok(n) => self.in_got += n,
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(false),
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(Ok(e)),
            }
        }
    }

    /// The answer to HELLO is in: checks it, then starts the data path's
    /// exchange (or finishes). Err: this try's failure.
    fn on_welcome(&mut self, setup: &NetSetup, common: &R::Common) -> Result<(), ConnectError> {
        let h = self.header.expect("a whole frame");
        let (node, addr) = (self.node, self.addr.clone());
        match h.kind {
            Kind::Welcome => {}
            Kind::Error => {
                return Err(ConnectError::Refused(Error::Refused {
                    node,
                    addr,
                    code: Code::from_u32(h.b).name(),
                    message: String::from_utf8_lossy(&self.inb).into_owned(),
                }))
            }
            k => return Err(self.violation(format!("answered HELLO with {k:?}"))),
        }
        let w = Welcome::decode(&h, &self.inb).map_err(|e| self.violation(e.to_string()))?;
        if h.a != proto::VERSION {
            return Err(self.violation(format!("WELCOME with version {}", h.a)));
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
        self.welcome = Some(w);
        let local = self
            .sock
            .as_ref()
            .expect("socket")
            .local_addr()
            .ok()
            .and_then(|a| a.as_socket())
            .map(|a| a.ip())
            .ok_or_else(|| ConnectError::Unreachable("local address: unknown".into()))?;
        let (pending, message) = R::begin(common, local, node, &addr)?;
        match message {
            Some(m) => {
                self.out = m;
                self.out_sent = 0;
                self.sent_at = Instant::now();
                self.phase = Phase::SendExchange(pending);
            }
            None => match R::finish(common, pending, None, node, &addr) {
                Ok(data) => self.connected(data),
                Err(e) => self.finish(Err(e)),
            },
        }
        Ok(())
    }

    /// The data path is set up: the connection, live.
    fn connected(&mut self, data: R) {
        let w = self.welcome.take().expect("welcomed");
        let sock: TcpStream = self.sock.take().expect("socket").into();
        // The network thread's io_uring takes it from here, as a blocking
        // socket (as it always was).
        if let Err(e) = sock.set_nonblocking(false) {
            return self.finish(Err(io_failure("socket", &e)));
        }
        let fd = sock.as_raw_fd();
        let conn = Conn::live(
            self.node,
            self.addr.clone(),
            fd,
            Some(sock),
            w.max_grants,
            w.max_data_bytes,
            data,
            Instant::now(),
        );
        self.phase = Phase::Done(Box::new(Ok((conn, w))));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::loader::net::tcp::TcpRx;
    use crate::transport::proto::Hello;
    use crate::transport::{Cluster, Node};
    use std::net::TcpListener;

    fn setup(nodes: &[String], node_timeout: Duration) -> NetSetup {
        NetSetup {
            cluster: Cluster {
                nodes: nodes
                    .iter()
                    .enumerate()
                    .map(|(i, a)| Node {
                        index: i as u32,
                        addr: a.clone(),
                    })
                    .collect(),
            },
            token: vec![7; 8],
            node_timeout,
            connect_timeout: Duration::from_secs(5),
            hello: Hello {
                catalog_identity: 0,
                rank: 0,
                world: 1,
                catalog_samples: 1,
                seed: 0,
                ring_addr: 0,
                ring_len: 1 << 20,
                rkey: 0,
                transport: proto::TRANSPORT_TCP,
            },
            placement: None,
            local_node: None,
            rdma: None,
            partial: None,
            notices: None,
        }
    }

    fn threads() -> usize {
        std::fs::read_dir("/proc/self/task").map_or(0, |d| d.count())
    }

    /// 200 nodes that accept (the kernel's backlog) but never answer
    /// HELLO: their handshakes run at once from the caller's thread (the
    /// process gains no thread per node; it used to spawn one each), and
    /// each ends as unreachable, named, after its own node timeout.
    #[test]
    fn handshakes_run_at_once_from_one_thread_and_silent_nodes_time_out() {
        let listeners: Vec<TcpListener> = (0..200)
            .map(|_| TcpListener::bind("127.0.0.1:0").expect("listen on loopback"))
            .collect();
        let addrs: Vec<String> = listeners
            .iter()
            .map(|l| l.local_addr().unwrap().to_string())
            .collect();
        let before = threads();
        // The watcher: waits (poll, with a deadline) until at least 100
        // listeners have a connection waiting, then counts the threads.
        let watched: Vec<i32> = listeners.iter().map(|l| l.as_raw_fd()).collect();
        let watcher = std::thread::spawn(move || {
            let deadline = Instant::now() + Duration::from_secs(20);
            let mut fds: Vec<libc::pollfd> = watched
                .iter()
                .map(|&fd| libc::pollfd {
                    fd,
                    events: libc::POLLIN,
                    revents: 0,
                })
                .collect();
            loop {
                let ready = crate::sys::poll_fds(&mut fds, 50).expect("poll");
                if ready >= 100 {
                    return Some((ready, threads()));
                }
                if Instant::now() > deadline {
                    return None;
                }
            }
        });
        let mut s = setup(&addrs, Duration::from_millis(1500));
        let started = Instant::now();
        let made = crate::loader::net::connect_with_for_tests::<TcpRx>(&mut s, ())
            .unwrap_or_else(|e| panic!("connect: {e}"));
        let took = started.elapsed();
        let (ready, during) = watcher
            .join()
            .unwrap()
            .expect("100 handshakes in progress at once within 20 s");
        assert!(
            during <= before + 2,
            "{ready} handshakes in progress: {during} threads, {before} before (the watcher is one)"
        );
        assert_eq!(made.conns.len(), 200);
        for (i, c) in made.conns.iter().enumerate() {
            assert!(
                c.reason.starts_with("no answer to HELLO: timed out after "),
                "node {i}: {}",
                c.reason
            );
        }
        // Two rounds of 128 at most, each one node timeout (1.5 s): not
        // one timeout per node.
        assert!(took < Duration::from_secs(60), "took {took:?}");
    }

    /// A port nobody listens on refuses at connect: tried again with
    /// back-off until the node timeout, then unreachable, saying so.
    #[test]
    fn a_refused_connect_is_retried_until_the_node_timeout() {
        // Bound, not listening: refused, and no concurrent test's server
        // can take the port (and accept, never answering HELLO).
        let held =
            socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
        held.bind(&std::net::SocketAddr::from(([127, 0, 0, 1], 0)).into())
            .unwrap();
        let free = held.local_addr().unwrap().as_socket().unwrap();
        let addrs = vec![free.to_string()];
        let s = setup(&addrs, Duration::from_millis(600));
        let out = handshake_all::<TcpRx>(&s, &(), &[(0, free.to_string())]);
        match &out[0] {
            Err(ConnectError::Unreachable(why)) => {
                assert!(why.starts_with("connect: "), "{why}");
                assert!(why.contains("tries over"), "{why}");
            }
            _ => panic!("not unreachable"),
        }
    }

    #[test]
    fn numeric_addresses_resolve_without_threads_and_names_are_named() {
        let nodes = vec![
            (0, "127.0.0.1:7000".to_string()),
            (1, "[::1]:7001".to_string()),
            (2, "no-such-host.invalid:7002".to_string()),
        ];
        let r = resolve_all(&nodes);
        assert_eq!(r[0].as_ref().unwrap().port(), 7000);
        assert_eq!(r[1].as_ref().unwrap().port(), 7001);
        let e = r[2].as_ref().unwrap_err();
        assert!(e.starts_with("resolve: "), "{e}");
    }
}
