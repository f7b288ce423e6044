//! Thousands of consumer links to one node service from one process: the
//! other agents of a large cluster as one node sees them, without the
//! cluster (issue 28, "scale without hardware"). Used by
//! `tests/agent_links.rs` (correctness: every handshake of a burst
//! admitted, heartbeats by the rules, every grant answered byte-exact) and
//! `benches/fake_peers.rs` (the agent's CPU when idle and under grants).
//!
//! Each link speaks the wire protocol as kspeed's consumer does
//! (docs/PROTOCOL.md): HELLO, WELCOME, a first keepalive that asks for
//! heartbeats, then a keepalive whenever it sent nothing for its interval
//! (a second, or a quarter of the idle timeout the node's heartbeats say,
//! at most 15 s), and GRANT frames of one entry when asked for load. One
//! io_uring carries every link: a receive always posted per link, at most
//! one send in flight per link.

#![allow(dead_code)]

use std::collections::{BTreeMap, VecDeque};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use io_uring::{opcode, types, IoUring};
use kspeed::transport::proto::{self, Code, GrantEntry, Header, Hello, Kind, Welcome};

const RX_BYTES: usize = 64 << 10;
const UD_RECV: u64 = 1 << 32;
const UD_SEND: u64 = 2 << 32;
/// The landing ring each fake link announces (TCP: only its length
/// matters to the node, which checks every granted range against it).
const RING_BYTES: u64 = 1 << 30;
/// Grants a link keeps outstanding at most.
const MAX_OUTSTANDING: usize = 8;
const KEEPALIVE: Duration = Duration::from_secs(1);
const KEEPALIVE_MAX: Duration = Duration::from_secs(15);

/// What a handshake burst did.
#[derive(Debug, Default)]
pub struct Handshakes {
    pub links: usize,
    pub welcomed: usize,
    /// Refusals by the ERROR code's name (`node busy` is an eviction).
    pub refused: BTreeMap<String, usize>,
    pub secs: f64,
}

/// What one phase did.
#[derive(Debug, Default, Clone)]
pub struct Phase {
    pub secs: f64,
    pub heartbeats: u64,
    /// The idle timeouts the heartbeats said (ms; 0: none said).
    pub beat_idle_timeouts_ms: BTreeMap<u64, u64>,
    /// The longest time any link went without a frame from the node in
    /// the phase (from its start, between frames, to its end).
    pub longest_silence_ms: u64,
    /// The fewest heartbeats any open link heard in the phase.
    pub min_heartbeats_per_link: u64,
    pub keepalives: u64,
    pub grants: u64,
    pub grants_done: u64,
    pub data_bytes: u64,
    pub errors: BTreeMap<String, u64>,
    /// Frames that matched no outstanding grant, or a DATA longer than it.
    pub violations: u64,
    pub closed: u64,
    /// Node CPU time over the phase (ns, every thread), when a pid was given.
    pub node_cpu_ns: Option<u64>,
    /// This process's CPU time over the phase.
    pub own_cpu_ns: u64,
    /// The node's poller ticks and their busy time (ns) over the phase,
    /// from its Prometheus metrics when their address was given.
    pub node_ticks: Option<u64>,
    pub node_tick_busy_ns: Option<u64>,
}

/// The node's poller ticks and busy nanoseconds from `GET /metrics` at
/// `addr` (host:port).
pub fn scrape_ticks(addr: &str) -> Option<(u64, u64)> {
    let mut s = TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(s, "GET /metrics HTTP/1.0\r\nHost: {addr}\r\n\r\n").ok()?;
    let mut body = String::new();
    s.read_to_string(&mut body).ok()?;
    let value = |name: &str| {
        body.lines()
            .find(|l| l.starts_with(name) && l[name.len()..].starts_with(' '))
            .and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
    };
    let ticks = value("kspeed_serve_poller_ticks_total")?;
    let busy = value("kspeed_serve_poller_busy_seconds_total")?;
    Some((ticks as u64, (busy * 1e9) as u64))
}

struct Out {
    grant: u32,
    len: u32,
    got: u32,
    /// The granted ring offset: each DATA frame must land at `offset + got`.
    offset: u64,
}

struct Link {
    sock: TcpStream,
    rx: Box<[u8]>,
    have: usize,
    /// Payload bytes of the current frame still to come, and for which
    /// grant (None: an ERROR message).
    skip: u32,
    skip_grant: Option<u32>,
    out: VecDeque<Out>,
    next_grant: u32,
    cursor: u64,
    tx: [u8; proto::HEADER_BYTES + proto::GRANT_ENTRY_BYTES],
    tx_len: usize,
    tx_sent: usize,
    sending: bool,
    asked: bool,
    last_tx: Instant,
    last_rx: Instant,
    keepalive: Duration,
    closed: bool,
    /// Heartbeats heard in the current phase.
    beats: u64,
}

/// The links, once admitted. Dropped, it shuts every socket and waits for
/// its receives and sends to come back before their buffers go.
pub struct Peers {
    ring: IoUring,
    links: Vec<Link>,
    lens: Vec<u32>,
    /// Operations in the ring not yet completed.
    inflight: usize,
    /// `c` of each link's first keepalive: 3 (heartbeats, slow ones while
    /// idle) as kspeed's consumer asks, or 1 as builds before 2026-12-05.
    pub ask_bits: u64,
}

impl Drop for Peers {
    fn drop(&mut self) {
        for l in &self.links {
            // SAFETY: shutting a socket this struct owns.
            unsafe { libc::shutdown(l.sock.as_raw_fd(), libc::SHUT_RDWR) };
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.inflight > 0 && Instant::now() < deadline {
            let ts = types::Timespec::new().nsec(10_000_000);
            let args = types::SubmitArgs::new().timespec(&ts);
            let _ = self.ring.submitter().submit_with_args(1, &args);
            self.inflight -= self.ring.completion().count().min(self.inflight);
        }
        if self.inflight > 0 {
            // Never free memory the kernel may still write into.
            std::mem::forget(std::mem::take(&mut self.links));
        }
    }
}

/// A HELLO for catalog `cat` (rank 0 of 1, TCP) with a ring of 1 GiB.
pub fn hello(cat: &kspeed::dataset::Catalog, token: &[u8]) -> Vec<u8> {
    hello_for(cat, token, RING_BYTES)
}

/// A HELLO for catalog `cat` (rank 0 of 1, TCP, seed 0) announcing a ring
/// of `ring_len` bytes: what the tests' hand-written consumers send.
pub fn hello_for(cat: &kspeed::dataset::Catalog, token: &[u8], ring_len: u64) -> Vec<u8> {
    let mut out = Vec::new();
    hello_fields(cat, ring_len).encode(token, &mut out);
    out
}

/// The fields of [`hello_for`]'s HELLO.
pub fn hello_fields(cat: &kspeed::dataset::Catalog, ring_len: u64) -> Hello {
    Hello {
        catalog_identity: cat.identity(),
        rank: 0,
        world: 1,
        catalog_samples: cat.len(),
        seed: 0,
        ring_addr: 0,
        ring_len,
        rkey: 0,
        transport: proto::TRANSPORT_TCP,
    }
}

/// Raises this process's open-file limit to its hard limit; returns it.
pub fn raise_nofile() -> u64 {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `lim` is a valid rlimit for the calls to read and write.
    unsafe {
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim);
        lim.rlim_cur = lim.rlim_max;
        libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim);
    }
    lim.rlim_cur
}

/// CPU time of every thread of `pid` (ns), from /proc/PID/task/*/schedstat.
pub fn cpu_ns(pid: u32) -> u64 {
    let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return 0;
    };
    dir.flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .sum()
}

fn own_cpu_ns() -> u64 {
    // SAFETY: `ru` is a valid rusage for getrusage to fill.
    let ru = unsafe {
        let mut ru: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_SELF, &mut ru);
        ru
    };
    let us = |t: libc::timeval| t.tv_sec as u64 * 1_000_000 + t.tv_usec as u64;
    (us(ru.ru_utime) + us(ru.ru_stime)) * 1000
}

/// Opens `n` links to `addr` at once (every connect and HELLO first, then
/// the answers): the burst a node sees when a large job starts. Each
/// answer is awaited until `deadline`.
pub fn connect(
    addr: &str,
    hello: &[u8],
    cat: &kspeed::dataset::Catalog,
    n: usize,
    deadline: Duration,
) -> (Option<Peers>, Handshakes) {
    let t0 = Instant::now();
    let mut socks = Vec::with_capacity(n);
    let mut rep = Handshakes {
        links: n,
        ..Default::default()
    };
    for i in 0..n {
        let mut s = TcpStream::connect(addr).unwrap_or_else(|e| panic!("link {i}: connect: {e}"));
        s.set_nodelay(true).unwrap();
        s.write_all(hello)
            .unwrap_or_else(|e| panic!("link {i}: HELLO: {e}"));
        socks.push(s);
    }
    let mut links = Vec::with_capacity(n);
    for (i, mut s) in socks.into_iter().enumerate() {
        let left = deadline
            .saturating_sub(t0.elapsed())
            .max(Duration::from_millis(1));
        s.set_read_timeout(Some(left)).unwrap();
        let mut hb = [0u8; proto::HEADER_BYTES];
        if let Err(e) = s.read_exact(&mut hb) {
            *rep.refused.entry(format!("no answer: {e}")).or_default() += 1;
            continue;
        }
        let h = Header::decode(&hb, proto::MAX_DATA_BYTES)
            .unwrap_or_else(|e| panic!("link {i}: answer: {e}"));
        let mut body = vec![0u8; h.body_len as usize];
        s.read_exact(&mut body).unwrap();
        match h.kind {
            Kind::Welcome => {
                let w = Welcome::decode(&h, &body).unwrap();
                assert_eq!(w.transport, proto::TRANSPORT_TCP);
                rep.welcomed += 1;
                s.set_read_timeout(None).unwrap();
                s.set_nonblocking(true).unwrap();
                let now = Instant::now();
                links.push(Link {
                    sock: s,
                    rx: vec![0u8; RX_BYTES].into_boxed_slice(),
                    have: 0,
                    skip: 0,
                    skip_grant: None,
                    out: VecDeque::new(),
                    next_grant: 0,
                    cursor: 0,
                    tx: [0; proto::HEADER_BYTES + proto::GRANT_ENTRY_BYTES],
                    tx_len: 0,
                    tx_sent: 0,
                    sending: false,
                    asked: false,
                    last_tx: now,
                    last_rx: now,
                    keepalive: KEEPALIVE,
                    closed: false,
                    beats: 0,
                });
            }
            Kind::Error => {
                *rep.refused
                    .entry(Code::from_u32(h.b).name().to_string())
                    .or_default() += 1;
            }
            k => panic!("link {i}: {k:?} instead of WELCOME"),
        }
    }
    rep.secs = t0.elapsed().as_secs_f64();
    if links.is_empty() {
        return (None, rep);
    }
    let entries = (2 * links.len()).next_power_of_two().max(8) as u32;
    let ring = IoUring::new(entries).expect("io_uring");
    let lens = (0..cat.len()).map(|id| cat.sample(id).len).collect();
    let mut p = Peers {
        ring,
        links,
        lens,
        inflight: 0,
        ask_bits: 3,
    };
    for i in 0..p.links.len() {
        p.post_recv(i);
    }
    (Some(p), rep)
}

impl Peers {
    pub fn len(&self) -> usize {
        self.links.len()
    }

    fn post_recv(&mut self, i: usize) {
        let l = &mut self.links[i];
        let e = opcode::Recv::new(
            types::Fd(l.sock.as_raw_fd()),
            // SAFETY: in bounds (have < RX_BYTES after every parse).
            unsafe { l.rx.as_mut_ptr().add(l.have) },
            (RX_BYTES - l.have) as u32,
        )
        .build()
        .user_data(UD_RECV | i as u64);
        // SAFETY: the buffer lives in `links` as long as `self` (whose
        // drop waits for it), and one receive at a time is posted per link.
        while unsafe { self.ring.submission().push(&e) }.is_err() {
            self.ring.submit().expect("submit");
        }
        self.inflight += 1;
    }

    fn post_send(&mut self, i: usize) {
        let l = &mut self.links[i];
        let rest = &l.tx[l.tx_sent..l.tx_len];
        let e = opcode::Send::new(
            types::Fd(l.sock.as_raw_fd()),
            rest.as_ptr(),
            rest.len() as u32,
        )
        .build()
        .user_data(UD_SEND | i as u64);
        l.sending = true;
        // SAFETY: `tx` is not touched until this send completes (and the
        // drop waits for it).
        while unsafe { self.ring.submission().push(&e) }.is_err() {
            self.ring.submit().expect("submit");
        }
        self.inflight += 1;
    }

    /// Runs for `secs`, granting `grants_per_sec` in all (0: idle), and
    /// measures `node_pid`'s CPU when given, and its ticks from its
    /// metrics at `metrics` (host:port) when given.
    pub fn run(
        &mut self,
        secs: f64,
        grants_per_sec: f64,
        node_pid: Option<u32>,
        metrics: Option<&str>,
    ) -> Phase {
        let mut ph = Phase::default();
        let ticks0 = metrics.and_then(scrape_ticks);
        let t0 = Instant::now();
        let cpu0 = node_pid.map(cpu_ns);
        let own0 = own_cpu_ns();
        let end = t0 + Duration::from_secs_f64(secs);
        let mut credit = 0.0f64;
        let mut last = t0;
        let mut rr = 0usize;
        let mut next_sweep = t0;
        for l in &mut self.links {
            l.last_rx = t0;
            l.beats = 0;
        }
        loop {
            let now = Instant::now();
            if now >= end {
                break;
            }
            if now >= next_sweep {
                next_sweep = now + Duration::from_millis(10);
                for i in 0..self.links.len() {
                    let l = &mut self.links[i];
                    if l.closed || l.sending {
                        continue;
                    }
                    if !l.asked || now.duration_since(l.last_tx) >= l.keepalive {
                        // The first asks for heartbeats (and with bit 1,
                        // slow ones while idle, as kspeed's consumer does).
                        let c = if l.asked { 0 } else { self.ask_bits };
                        l.asked = true;
                        let h = Header {
                            kind: Kind::Error,
                            body_len: 0,
                            a: proto::CONNECTION,
                            b: 0,
                            c,
                        };
                        l.tx[..proto::HEADER_BYTES].copy_from_slice(&h.encode());
                        l.tx_len = proto::HEADER_BYTES;
                        l.tx_sent = 0;
                        l.last_tx = now;
                        ph.keepalives += 1;
                        self.post_send(i);
                    }
                }
            }
            if grants_per_sec > 0.0 {
                credit += grants_per_sec * now.duration_since(last).as_secs_f64();
                credit = credit.min(grants_per_sec * 0.05 + 1.0);
                let mut tried = 0;
                while credit >= 1.0 && tried < self.links.len() {
                    rr = (rr + 1) % self.links.len();
                    tried += 1;
                    let l = &mut self.links[rr];
                    if l.closed || l.sending || !l.asked || l.out.len() >= MAX_OUTSTANDING {
                        continue;
                    }
                    let sample = (ph.grants.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 17)
                        % self.lens.len() as u64;
                    let len = self.lens[sample as usize];
                    if l.cursor + len as u64 > RING_BYTES {
                        l.cursor = 0;
                    }
                    let grant = l.next_grant;
                    l.next_grant = l.next_grant.wrapping_add(1) & 0x3fff_ffff;
                    l.tx[..proto::HEADER_BYTES].copy_from_slice(&Header::grant(1).encode());
                    GrantEntry {
                        grant,
                        len,
                        sample,
                        offset: l.cursor,
                        rkey: 0,
                    }
                    .encode_into(&mut l.tx[proto::HEADER_BYTES..]);
                    l.cursor += len as u64;
                    l.tx_len = l.tx.len();
                    l.tx_sent = 0;
                    l.last_tx = now;
                    l.out.push_back(Out {
                        grant,
                        len,
                        got: 0,
                        offset: l.cursor - len as u64,
                    });
                    ph.grants += 1;
                    credit -= 1.0;
                    self.post_send(rr);
                }
            }
            last = now;
            let ts = types::Timespec::new().nsec(1_000_000);
            let args = types::SubmitArgs::new().timespec(&ts);
            match self.ring.submitter().submit_with_args(1, &args) {
                Ok(_) => {}
                Err(e) if e.raw_os_error() == Some(libc::ETIME) => {}
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => {}
                Err(e) => panic!("io_uring wait: {e}"),
            }
            let done: Vec<(u64, i32)> = self
                .ring
                .completion()
                .map(|c| (c.user_data(), c.result()))
                .collect();
            self.inflight -= done.len();
            for (ud, res) in done {
                let i = (ud & 0xffff_ffff) as usize;
                if ud & UD_SEND != 0 {
                    let l = &mut self.links[i];
                    l.sending = false;
                    if res <= 0 {
                        if res != -libc::EAGAIN && res != -libc::EINTR {
                            if !l.closed {
                                l.closed = true;
                                ph.closed += 1;
                            }
                            continue;
                        }
                    } else {
                        l.tx_sent += res as usize;
                    }
                    if l.tx_sent < l.tx_len {
                        self.post_send(i);
                    }
                    continue;
                }
                if self.links[i].closed {
                    continue;
                }
                if res == -libc::EAGAIN || res == -libc::EINTR {
                    self.post_recv(i);
                    continue;
                }
                if res <= 0 {
                    if !self.links[i].closed {
                        self.links[i].closed = true;
                        ph.closed += 1;
                    }
                    continue;
                }
                let now = Instant::now();
                let l = &mut self.links[i];
                let gap = now.duration_since(l.last_rx).as_millis() as u64;
                ph.longest_silence_ms = ph.longest_silence_ms.max(gap);
                l.last_rx = now;
                l.have += res as usize;
                parse(l, &mut ph);
                if l.closed {
                    ph.closed += 1;
                } else {
                    self.post_recv(i);
                }
            }
        }
        let now = Instant::now();
        ph.min_heartbeats_per_link = u64::MAX;
        for l in self.links.iter().filter(|l| !l.closed) {
            let gap = now.duration_since(l.last_rx).as_millis() as u64;
            ph.longest_silence_ms = ph.longest_silence_ms.max(gap);
            ph.min_heartbeats_per_link = ph.min_heartbeats_per_link.min(l.beats);
        }
        ph.secs = t0.elapsed().as_secs_f64();
        ph.node_cpu_ns = node_pid
            .zip(cpu0)
            .map(|(p, c0)| cpu_ns(p).saturating_sub(c0));
        ph.own_cpu_ns = own_cpu_ns().saturating_sub(own0);
        if let (Some((t0, b0)), Some((t1, b1))) = (ticks0, metrics.and_then(scrape_ticks)) {
            ph.node_ticks = Some(t1.saturating_sub(t0));
            ph.node_tick_busy_ns = Some(b1.saturating_sub(b0));
        }
        ph
    }
}

/// Takes every whole frame (and payload piece) out of a link's buffer.
fn parse(l: &mut Link, ph: &mut Phase) {
    let mut at = 0;
    loop {
        if l.skip > 0 {
            let n = (l.skip as usize).min(l.have - at);
            if n == 0 {
                break;
            }
            at += n;
            l.skip -= n as u32;
            if let Some(g) = l.skip_grant {
                ph.data_bytes += n as u64;
                match l.out.iter_mut().position(|o| o.grant == g) {
                    Some(k) => {
                        l.out[k].got += n as u32;
                        if l.out[k].got == l.out[k].len {
                            l.out.remove(k);
                            ph.grants_done += 1;
                        }
                    }
                    None => ph.violations += 1,
                }
            }
            continue;
        }
        if l.have - at < proto::HEADER_BYTES {
            break;
        }
        let mut hb = [0u8; proto::HEADER_BYTES];
        hb.copy_from_slice(&l.rx[at..at + proto::HEADER_BYTES]);
        at += proto::HEADER_BYTES;
        let h = match Header::decode(&hb, proto::MAX_DATA_BYTES) {
            Ok(h) => h,
            Err(_) => {
                ph.violations += 1;
                l.closed = true;
                break;
            }
        };
        match h.kind {
            Kind::Error if h.a == proto::CONNECTION && h.b == 0 && h.body_len == 0 => {
                ph.heartbeats += 1;
                l.beats += 1;
                let ms = h.c >> 32;
                *ph.beat_idle_timeouts_ms.entry(ms).or_default() += 1;
                if ms > 0 {
                    l.keepalive = (Duration::from_millis(ms) / 4).clamp(KEEPALIVE, KEEPALIVE_MAX);
                }
            }
            Kind::Data => {
                // DATA's `c` is the ring offset its bytes go to: the
                // grant's, past what came already.
                let fits =
                    l.out.iter().find(|o| o.grant == h.a).is_some_and(|o| {
                        o.got + h.body_len <= o.len && h.c == o.offset + o.got as u64
                    });
                if !fits {
                    ph.violations += 1;
                }
                l.skip = h.body_len;
                l.skip_grant = fits.then_some(h.a);
            }
            Kind::Error => {
                *ph.errors
                    .entry(Code::from_u32(h.b).name().to_string())
                    .or_default() += 1;
                if let Some(k) = l.out.iter().position(|o| o.grant == h.a) {
                    l.out.remove(k);
                }
                l.skip = h.body_len;
                l.skip_grant = None;
            }
            _ => ph.violations += 1,
        }
    }
    l.rx.copy_within(at..l.have, 0);
    l.have -= at;
}
