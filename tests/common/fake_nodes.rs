//! Thousands of node services in one process: the other nodes of a large
//! cluster as one consumer (a rank's, or an agent's network thread) sees
//! them, without the cluster (issue 28, "scale without hardware", the
//! consumer's side; `fake_peers.rs` is the node's side). Used by
//! `benches/fake_nodes.rs`.
//!
//! Each fake node listens on its own loopback port and speaks the wire
//! protocol as kspeed's node service does (docs/PROTOCOL.md): it checks the
//! HELLO's token and dataset, answers WELCOME as node `i` of the cluster
//! (one copy, the jump owner function, `max_grants` grants), beats a
//! connection it sent nothing to for a while once asked (every 5 s for a
//! consumer that allows slow idle heartbeats, else every 250 ms; each
//! beat says a 60 s idle timeout), and answers every GRANT entry with one
//! DATA frame of the sample's bytes, read once from the source at start.
//! It does not check that the sample is its own to serve. One io_uring
//! carries every listener and connection: an accept always posted per
//! listener, a receive per connection, at most one send in flight per
//! connection.

#![allow(dead_code)]

use std::net::TcpListener;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use io_uring::{opcode, types, IoUring};
use kspeed::transport::proto::{self, GrantEntry, Header, Hello, Kind, Welcome};

const UD_ACCEPT: u64 = 1 << 32;
const UD_RECV: u64 = 2 << 32;
const UD_SEND: u64 = 3 << 32;
const RX_BYTES: usize = 64 << 10;
/// Grants a consumer may have outstanding with each fake node (the real
/// node's automatic limit at 512 nodes and more).
pub const MAX_GRANTS: u64 = 256;
const IDLE_TIMEOUT: Duration = Duration::from_secs(60);
const BEAT_SLOW: Duration = Duration::from_secs(5);
/// How long the nodes wait, once stopped, for the closes of the links
/// still open.
const LINGER: Duration = Duration::from_secs(20);
const BEAT_FAST: Duration = Duration::from_millis(250);

/// What the fake nodes saw.
#[derive(Debug, Default, Clone)]
pub struct Seen {
    pub accepted: u64,
    pub welcomed: u64,
    pub refused: u64,
    /// Frames from consumers: keepalives and GRANTs (and their entries).
    pub keepalives: u64,
    pub grant_frames: u64,
    pub grants: u64,
    pub heartbeats: u64,
    pub closed: u64,
    /// Connections whose consumer asked for heartbeats.
    pub asked: u64,
    /// GRANT entries for a sample this node does not own.
    pub misrouted: u64,
}

struct Conn {
    fd: OwnedFd,
    node: u32,
    rx: Box<[u8]>,
    have: usize,
    welcomed: bool,
    /// Heartbeats asked for, and whether slowly while idle.
    beats: Option<Duration>,
    pending: Vec<u8>,
    sending: Vec<u8>,
    sent: usize,
    in_send: bool,
    in_recv: bool,
    last_tx: Instant,
    closed: bool,
}

/// The fake nodes: `listeners[i]` is node `first + i` of `nodes`.
pub struct FakeNodes {
    ring: IoUring,
    listeners: Vec<TcpListener>,
    first: u32,
    nodes: u32,
    token: Vec<u8>,
    dataset: u32,
    samples: Vec<Vec<u8>>,
    placement: kspeed::dataset::Placement,
    conns: Vec<Conn>,
    /// io_uring operations pushed and not yet completed.
    inflight: usize,
    pub seen: Seen,
}

impl FakeNodes {
    /// Listens on `count` loopback ports as nodes `first..first + count`
    /// of `nodes`, serving catalog `cat`'s samples (read from its source
    /// now) to consumers presenting `token`.
    pub fn new(
        count: usize,
        first: u32,
        nodes: u32,
        cat: &kspeed::dataset::Catalog,
        token: &[u8],
    ) -> FakeNodes {
        let listeners: Vec<TcpListener> = (0..count)
            .map(|i| {
                TcpListener::bind("127.0.0.1:0")
                    .unwrap_or_else(|e| panic!("fake node {i}: bind: {e}"))
            })
            .collect();
        let samples = (0..cat.len())
            .map(|id| {
                use std::os::unix::fs::FileExt;
                let s = cat.sample(id);
                let f = std::fs::File::open(cat.file_path(s.file)).expect("source file");
                assert!(
                    s.len <= proto::MAX_DATA_BYTES,
                    "sample {id}: {} bytes; a fake node sends a sample as one DATA frame",
                    s.len
                );
                let mut b = vec![0u8; s.len as usize];
                f.read_exact_at(&mut b, s.offset).expect("sample bytes");
                b
            })
            .collect();
        // The completion queue (4x) within the kernel's 65,536.
        let entries = (4 * count).next_power_of_two().clamp(64, 16384) as u32;
        let ring = IoUring::builder()
            .setup_cqsize(4 * entries)
            .build(entries)
            .expect("io_uring");
        let mut f = FakeNodes {
            ring,
            listeners,
            first,
            nodes,
            token: token.to_vec(),
            dataset: cat.identity(),
            samples,
            placement: kspeed::dataset::Placement::new(nodes, 1).expect("placement"),
            conns: Vec::with_capacity(count),
            inflight: 0,
            seen: Seen::default(),
        };
        for i in 0..f.listeners.len() {
            f.post_accept(i);
        }
        f
    }

    /// Each fake node's `host:port`, in node order.
    pub fn addrs(&self) -> Vec<String> {
        self.listeners
            .iter()
            .map(|l| l.local_addr().unwrap().to_string())
            .collect()
    }

    fn push(&mut self, e: io_uring::squeue::Entry) {
        self.inflight += 1;
        loop {
            // SAFETY: every buffer an entry names lives in `self.conns`
            // (a boxed slice, or a Vec not touched while its send is in
            // flight) until its completion is reaped.
            if unsafe { self.ring.submission().push(&e) }.is_ok() {
                break;
            }
            self.ring.submit().expect("submit");
        }
    }

    fn post_accept(&mut self, i: usize) {
        let fd = self.listeners[i].as_raw_fd();
        let e = opcode::Accept::new(types::Fd(fd), std::ptr::null_mut(), std::ptr::null_mut())
            .build()
            .user_data(UD_ACCEPT | i as u64);
        self.push(e);
    }

    fn post_recv(&mut self, c: usize) {
        let conn = &mut self.conns[c];
        if conn.closed || conn.in_recv {
            return;
        }
        conn.in_recv = true;
        let room = conn.rx.len() - conn.have;
        let e = opcode::Recv::new(
            types::Fd(conn.fd.as_raw_fd()),
            conn.rx[conn.have..].as_mut_ptr(),
            room as u32,
        )
        .build()
        .user_data(UD_RECV | c as u64);
        self.push(e);
    }

    fn flush(&mut self, c: usize) {
        let conn = &mut self.conns[c];
        if conn.closed || conn.in_send || conn.pending.is_empty() {
            return;
        }
        std::mem::swap(&mut conn.pending, &mut conn.sending);
        conn.pending.clear();
        conn.sent = 0;
        conn.in_send = true;
        conn.last_tx = Instant::now();
        let e = opcode::Send::new(
            types::Fd(conn.fd.as_raw_fd()),
            conn.sending.as_ptr(),
            conn.sending.len() as u32,
        )
        .build()
        .user_data(UD_SEND | c as u64);
        self.push(e);
    }

    fn resend(&mut self, c: usize) {
        let conn = &mut self.conns[c];
        let e = opcode::Send::new(
            types::Fd(conn.fd.as_raw_fd()),
            conn.sending[conn.sent..].as_ptr(),
            (conn.sending.len() - conn.sent) as u32,
        )
        .build()
        .user_data(UD_SEND | c as u64);
        self.push(e);
    }

    fn close(&mut self, c: usize) {
        let conn = &mut self.conns[c];
        if !conn.closed {
            conn.closed = true;
            self.seen.closed += 1;
            // SAFETY: a socket this process owns.
            unsafe { libc::shutdown(conn.fd.as_raw_fd(), libc::SHUT_RDWR) };
        }
    }

    /// Takes every whole frame connection `c` has received.
    fn frames(&mut self, c: usize) {
        let mut at = 0;
        loop {
            let conn = &self.conns[c];
            if conn.closed || conn.have - at < proto::HEADER_BYTES {
                break;
            }
            let mut hb = [0u8; proto::HEADER_BYTES];
            hb.copy_from_slice(&conn.rx[at..at + proto::HEADER_BYTES]);
            let Ok(h) = Header::decode(&hb, 0) else {
                self.close(c);
                return;
            };
            let len = proto::HEADER_BYTES + h.body_len as usize;
            if len > conn.rx.len() {
                self.close(c);
                return;
            }
            if conn.have - at < len {
                break;
            }
            let body = at + proto::HEADER_BYTES..at + len;
            at += len;
            match h.kind {
                Kind::Hello if !conn.welcomed => {
                    let ok = match Hello::decode(&conn.rx[body]) {
                        Ok((hello, token)) => {
                            token == self.token.as_slice() && hello.catalog_identity == self.dataset
                        }
                        Err(_) => false,
                    };
                    if !ok {
                        self.seen.refused += 1;
                        self.close(c);
                        return;
                    }
                    let w = Welcome {
                        node_index: self.first + self.conns[c].node,
                        nodes: self.nodes,
                        replicas: 1,
                        owner_fn: 1,
                        max_data_bytes: proto::MAX_DATA_BYTES,
                        max_grants: MAX_GRANTS,
                        transport: proto::TRANSPORT_TCP,
                    };
                    let conn = &mut self.conns[c];
                    conn.welcomed = true;
                    conn.pending.extend_from_slice(&w.encode());
                    self.seen.welcomed += 1;
                }
                Kind::Error if conn.welcomed && h.body_len == 0 => {
                    self.seen.keepalives += 1;
                    if h.c & 1 != 0 && conn.beats.is_none() {
                        self.seen.asked += 1;
                        let slow = h.c & 2 != 0;
                        self.conns[c].beats = Some(if slow { BEAT_SLOW } else { BEAT_FAST });
                    }
                }
                Kind::Grant if conn.welcomed => {
                    self.seen.grant_frames += 1;
                    for i in 0..h.a as usize {
                        let e = GrantEntry::decode(&self.conns[c].rx[body.clone()], i);
                        self.seen.grants += 1;
                        let node = self.first + self.conns[c].node;
                        if self.placement.owner(e.sample) != node {
                            self.seen.misrouted += 1;
                        }
                        let bytes = &self.samples[e.sample as usize];
                        let conn = &mut self.conns[c];
                        conn.pending
                            .extend_from_slice(&Header::data(e.grant, e.offset, e.len).encode());
                        conn.pending.extend_from_slice(bytes);
                    }
                }
                _ => {
                    self.close(c);
                    return;
                }
            }
        }
        let conn = &mut self.conns[c];
        conn.rx.copy_within(at..conn.have, 0);
        conn.have -= at;
    }

    /// Serves until `stop` is set and then until every connection it
    /// accepted has been closed (the consumer is dropped before `stop`
    /// is set, so its closes are on their way), at most `LINGER` more:
    /// `Seen::closed` counts the links the consumer closed.
    pub fn run(&mut self, stop: &AtomicBool) {
        let mut next_sweep = Instant::now();
        let idle_ms = IDLE_TIMEOUT.as_millis() as u64;
        let mut linger_until = None;
        loop {
            let now = Instant::now();
            if stop.load(Ordering::Relaxed) {
                let until = *linger_until.get_or_insert(now + LINGER);
                if self.seen.closed == self.seen.accepted || now >= until {
                    break;
                }
            }
            if now >= next_sweep {
                next_sweep = now + Duration::from_millis(50);
                for c in 0..self.conns.len() {
                    let conn = &mut self.conns[c];
                    let Some(every) = conn.beats else { continue };
                    if conn.closed || conn.in_send || now.duration_since(conn.last_tx) < every {
                        continue;
                    }
                    let h = Header {
                        kind: Kind::Error,
                        body_len: 0,
                        a: proto::CONNECTION,
                        b: 0,
                        c: idle_ms << 32,
                    };
                    conn.pending.extend_from_slice(&h.encode());
                    self.seen.heartbeats += 1;
                    self.flush(c);
                }
            }
            let ts = types::Timespec::new().nsec(10_000_000);
            let args = types::SubmitArgs::new().timespec(&ts);
            match self.ring.submitter().submit_with_args(1, &args) {
                Ok(_) => {}
                Err(e) if matches!(e.raw_os_error(), Some(libc::ETIME | libc::EINTR)) => {}
                Err(e) => panic!("fake nodes: submit: {e}"),
            }
            let done: Vec<(u64, i32)> = self
                .ring
                .completion()
                .map(|e| (e.user_data(), e.result()))
                .collect();
            for (ud, res) in done {
                self.inflight -= 1;
                let i = (ud & 0xffff_ffff) as usize;
                match ud & !0xffff_ffff {
                    UD_ACCEPT => {
                        if res >= 0 {
                            // SAFETY: the accepted descriptor is ours.
                            let fd = unsafe { OwnedFd::from_raw_fd(res) };
                            let one: libc::c_int = 1;
                            // SAFETY: a valid socket and option.
                            unsafe {
                                libc::setsockopt(
                                    fd.as_raw_fd(),
                                    libc::IPPROTO_TCP,
                                    libc::TCP_NODELAY,
                                    (&one as *const libc::c_int).cast(),
                                    std::mem::size_of::<libc::c_int>() as u32,
                                )
                            };
                            self.seen.accepted += 1;
                            self.conns.push(Conn {
                                fd,
                                node: i as u32,
                                rx: vec![0u8; RX_BYTES].into_boxed_slice(),
                                have: 0,
                                welcomed: false,
                                beats: None,
                                pending: Vec::new(),
                                sending: Vec::new(),
                                sent: 0,
                                in_send: false,
                                in_recv: false,
                                last_tx: Instant::now(),
                                closed: false,
                            });
                            self.post_recv(self.conns.len() - 1);
                        }
                        self.post_accept(i);
                    }
                    UD_RECV => {
                        self.conns[i].in_recv = false;
                        if res <= 0 {
                            self.close(i);
                            continue;
                        }
                        self.conns[i].have += res as usize;
                        self.frames(i);
                        self.post_recv(i);
                        self.flush(i);
                    }
                    UD_SEND => {
                        if res <= 0 {
                            self.conns[i].in_send = false;
                            self.close(i);
                            continue;
                        }
                        let conn = &mut self.conns[i];
                        conn.sent += res as usize;
                        if conn.sent < conn.sending.len() {
                            self.resend(i);
                        } else {
                            conn.in_send = false;
                            self.flush(i);
                        }
                    }
                    _ => unreachable!("user_data {ud:#x}"),
                }
            }
        }
        self.drain();
    }

    /// Ends every operation in flight (the kernel writes into this
    /// struct's buffers until they complete): shuts every socket and
    /// listener, then reaps completions until none is in flight (10 s at
    /// most; what is left then is leaked, never freed under the kernel).
    fn drain(&mut self) {
        for c in &self.conns {
            // SAFETY: sockets this process owns.
            unsafe { libc::shutdown(c.fd.as_raw_fd(), libc::SHUT_RDWR) };
        }
        for l in &self.listeners {
            // SAFETY: as above; a shut listener fails its accept.
            unsafe { libc::shutdown(l.as_raw_fd(), libc::SHUT_RDWR) };
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.inflight > 0 && Instant::now() < deadline {
            let ts = types::Timespec::new().nsec(10_000_000);
            let args = types::SubmitArgs::new().timespec(&ts);
            let _ = self.ring.submitter().submit_with_args(1, &args);
            let n = self.ring.completion().count();
            self.inflight -= n;
        }
        if self.inflight > 0 {
            std::mem::forget(std::mem::take(&mut self.conns));
        }
    }
}

/// Runs `nodes` in a thread until the returned flag is set; the thread
/// returns what they saw.
pub fn spawn(mut nodes: FakeNodes) -> (Arc<AtomicBool>, std::thread::JoinHandle<Seen>) {
    let stop = Arc::new(AtomicBool::new(false));
    let s = stop.clone();
    let t = std::thread::Builder::new()
        .name("fake-nodes".into())
        .spawn(move || {
            nodes.run(&s);
            nodes.seen.clone()
        })
        .unwrap();
    (stop, t)
}
