//! The node service under the simulator: 1 to 3 real serve pollers
//! (`ServePoller`, through `transport::serve::sim_node::SimNode`), sharing
//! one service state built from a tiny preloaded space, each on its own
//! port of one in-memory network ([`MemNet`], wrapped in [`Faulty`] for
//! read faults: EIO, short reads, EAGAIN, EINTR, delayed completions),
//! serving 1 to 4 scripted consumers. A consumer sends GRANT frames with
//! seeded samples and ring ranges and checks every frame it receives
//! (the real `proto` encoding and [`FrameRx`]); some misbehave: stop
//! reading for a while (long enough, sometimes, for the stall or idle
//! timeout), send garbage or a grant the node must refuse, close their
//! connection with grants outstanding, or lose it. The virtual clock moves a seeded amount each step, so the
//! node's timers fire as they would.
//!
//! Some seeds post node-down notices to the node's board (as an agent's
//! network threads do); consumers that asked for heartbeats ask for them
//! too, and some keepalives are probes; some consumers pause their grants
//! for a few seconds (idle: only heartbeats come).
//!
//! Checked every step: each DATA payload is byte-exact against the
//! extent image at its sample's location, for a granted sample, at the
//! next offset of the oldest grant not yet answered (grant order, each
//! byte once); an ERROR names that grant, with `NotHeld` only for a sample
//! this node does not hold and `ReadFailed` only for an injected EIO (a
//! transient failure must be retried, not answered); the pollers'
//! bookkeeping (`SimNode::check`: pools never grow, slots within the pool
//! and counted by their connection, no staging slot free, reused or read
//! into while the ring sends from it or reads into it). At the end: a
//! well-behaved consumer got every grant answered exactly once and was
//! never dropped; one that misbehaved was dropped (or survived its
//! stall); after the stop every connection is reaped, no slot is taken,
//! nothing is in flight and no completion was lost. A notice reaches only
//! a consumer that asked, in the order posted, each once; a probe is
//! answered (by any frame) within the consumer's 1.5 s while it reads.
//!
//! (Why this file is over ~800 lines: one scenario, whose consumer script, per-frame checks
//! and end-of-run checks share the same expectations and read together.)

use crate::sim::Rng;
use std::os::fd::RawFd;
use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Duration;

use super::run_seeds;
use crate::dataset::{Placement, PreloadOptions, SourceSpec, Space};
use crate::ring::memnet::{MemNet, MemNetFaults};
use crate::ring::{Completion, FaultConfig, Faulty, IoBackend, NetFaults};
use crate::transport::proto::{self, Code, GrantEntry, Header, Hello, Kind};
use crate::transport::rx::{FrameRx, Received, RxError};
use crate::transport::serve::sim_node::SimNode;
use crate::transport::ServeConfig;

/// The preloaded space every seed serves (built once per process): its
/// directory and its extents' bytes.
struct World {
    dir: PathBuf,
    extents: Vec<Vec<u8>>,
}

fn world() -> &'static World {
    static W: OnceLock<World> = OnceLock::new();
    W.get_or_init(|| {
        // Kept for the process (a static is never dropped): a few hundred KB.
        let tmp = Box::leak(Box::new(tempfile::tempdir().expect("tempdir")));
        let src = tmp.path().join("src");
        std::fs::create_dir_all(&src).unwrap();
        // Awkward sizes around the alignment and the chunks, some empty.
        let mut sizes = vec![0usize, 1, 511, 512, 513, 4095, 4096, 4097, 8191, 20_000];
        let mut x = 0x5eed_u64;
        for _ in 0..54 {
            x = crate::hash::mix64(x);
            sizes.push((x % 12_000) as usize);
        }
        for (i, &n) in sizes.iter().enumerate() {
            let bytes: Vec<u8> = (0..n)
                .map(|k| (crate::hash::mix64((i as u64) << 32 | k as u64) >> 17) as u8)
                .collect();
            std::fs::write(src.join(format!("s{i:03}.bin")), bytes).unwrap();
        }
        let dir = tmp.path().join("space");
        let spec = SourceSpec::parse(&format!("dir:{}", src.display())).unwrap();
        // Two nodes, one copy: this node (0) holds about half the samples,
        // so grants for the rest are answered NotHeld.
        let opts = PreloadOptions::default()
            .source(Some(spec))
            .placement(Placement::new(2, 1).unwrap())
            .node_index(0)
            .align_bytes(512)
            .extent_bytes(64 << 10)
            .threads(1)
            .check_free_space(false);
        crate::dataset::preload(&dir, &opts).expect("preload the simulator's space");
        let space = Space::open(&dir).unwrap();
        let extents = (0..space.extent_lens().len() as u32)
            .map(|i| std::fs::read(space.extent_path(i)).unwrap())
            .collect();
        World { dir, extents }
    })
}

/// What a consumer does besides granting and reading.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Act {
    /// Grants, reads everything, keeps the connection alive, then leaves.
    Good,
    /// Stops reading (and with `silent`, sending keepalives) for `steps`
    /// from step `at`: the node may drop it (stall or idle timeout).
    Stall { at: u64, steps: u64, silent: bool },
    /// Sends 24 bytes that are no frame header at step `at`.
    Garbage { at: u64 },
    /// Sends a grant the node must refuse at step `at` (`how` picks which).
    BadGrant { at: u64, how: u64 },
    /// Loses its connection at step `at`.
    Reset { at: u64 },
    /// Closes its connection at step `at`, grants outstanding or not.
    Leave { at: u64 },
}

#[derive(Debug, Clone, Copy)]
struct Granted {
    grant: u32,
    sample: u64,
    len: u32,
    offset: u64,
}

struct Consumer {
    id: usize,
    /// Grants as many as the node allows at once (else up to 8 a frame).
    bulk: bool,
    fd: RawFd,
    port: MemNet,
    act: Act,
    ring_len: u64,
    land: Vec<u8>,
    rx: FrameRx<u32>,
    out: Vec<u8>,
    granted: Vec<Granted>,
    /// The oldest grant not answered, and its bytes received so far.
    cursor: usize,
    got: u64,
    answered: Vec<u8>,
    next_grant: u32,
    ring_at: u64,
    batches_left: u32,
    last_sent_ms: u64,
    heartbeats: bool,
    /// It broke the protocol or lost its connection: the node must end it.
    must_end: bool,
    /// It may be dropped (a stall, a loss).
    may_drop: bool,
    /// Its stream ended (EOF or an error), and why.
    ended: Option<String>,
    /// It shut its side after its last grant was answered.
    left: bool,
    /// ERRORs about the connection it received.
    conn_errors: Vec<String>,
    /// Node-down notices received (node, silence), in order.
    notices: Vec<(u32, u32)>,
    /// When it sent a probe not answered yet (any frame answers it).
    probe_sent_ms: Option<u64>,
    /// It grants nothing before this (an idle pause).
    idle_until_ms: u64,
    probes_answered: u64,
}

const UD_RECV: u64 = 1;

impl Consumer {
    fn outstanding(&self) -> usize {
        self.granted.len() - self.cursor
    }

    fn stalled(&self, step: u64) -> bool {
        matches!(self.act, Act::Stall { at, steps, .. } if (at..at + steps).contains(&step))
    }

    fn silent(&self, step: u64) -> bool {
        matches!(self.act, Act::Stall { at, steps, silent: true } if (at..at + steps).contains(&step))
    }

    fn grant_frame(&mut self, entries: &[GrantEntry]) {
        self.out
            .extend_from_slice(&Header::grant(entries.len() as u32).encode());
        for e in entries {
            let mut b = [0u8; proto::GRANT_ENTRY_BYTES];
            e.encode_into(&mut b);
            self.out.extend_from_slice(&b);
        }
    }

    /// The consumer's part of a step: misbehave, grant, keep alive, send,
    /// receive.
    fn step(&mut self, net: &mut MemNet, rng: &mut Rng, step: u64, now_ms: u64, node: &Shape) {
        if self.ended.is_some() {
            return;
        }
        match self.act {
            Act::Garbage { at } if at == step => {
                let mut g = [0u8; proto::HEADER_BYTES];
                for b in g.iter_mut() {
                    *b = rng.below(256) as u8;
                }
                g[0] = !(proto::MAGIC as u8); // never a header's magic
                self.out.extend_from_slice(&g);
                self.must_end = true;
            }
            Act::BadGrant { at, how } if at == step => {
                let cat_len = node.samples.len() as u64;
                let s = rng.below(cat_len);
                let len = node.samples[s as usize];
                let mut e = GrantEntry {
                    grant: self.next_grant,
                    len,
                    sample: s,
                    offset: 0,
                    rkey: 0,
                };
                match how % 5 {
                    0 => e.sample = cat_len + rng.below(1000),
                    1 => e.len = len + 1 + rng.below(100) as u32,
                    2 => e.offset = self.ring_len + 1 - e.len as u64 / 2,
                    3 => e.grant = proto::CONNECTION,
                    _ => {
                        // More outstanding than the node allows.
                        let n = node.max_grants as usize + 1;
                        let es: Vec<GrantEntry> = (0..n)
                            .map(|k| GrantEntry {
                                grant: self.next_grant + k as u32,
                                len: 0,
                                sample: s,
                                offset: 0,
                                rkey: 0,
                            })
                            .collect();
                        self.grant_frame(&es);
                        self.must_end = true;
                        return self.io(step, now_ms);
                    }
                }
                self.grant_frame(&[e]);
                self.must_end = true;
            }
            Act::Reset { at } if at == step => {
                net.reset(self.fd);
                self.must_end = true;
                self.may_drop = true;
            }
            Act::Leave { at } if at == step && !self.left => {
                net.shutdown(self.fd);
                self.left = true;
                self.must_end = true;
                self.may_drop = true;
            }
            _ => {}
        }
        self.skip_empty();
        // Grants while the script lasts (not after breaking the protocol).
        // Now and then, with nothing outstanding, it pauses its grants for
        // 2-6 s (a trainer between epochs): the node has nothing for it,
        // so only heartbeats (every 5 s) and probes' answers come.
        if self.outstanding() == 0 && now_ms >= self.idle_until_ms && rng.chance(40) {
            self.idle_until_ms = now_ms + 2000 + rng.below(4000);
        }
        if !self.must_end
            && self.batches_left > 0
            && !self.silent(step)
            && now_ms >= self.idle_until_ms
            && rng.chance(3)
        {
            let room = node.max_grants as usize - self.outstanding();
            if room > 0 {
                let n = if self.bulk {
                    room.min(proto::MAX_GRANT_ENTRIES)
                } else {
                    1 + rng.below(room.min(8) as u64) as usize
                };
                let mut es = Vec::with_capacity(n);
                for _ in 0..n {
                    // Mostly samples this node holds (the rest: NotHeld).
                    let mut s = rng.below(node.samples.len() as u64);
                    for _ in 0..2 {
                        if node.locations[s as usize].is_none() {
                            s = rng.below(node.samples.len() as u64);
                        }
                    }
                    let len = node.samples[s as usize];
                    if self.ring_at + len as u64 > self.ring_len {
                        self.ring_at = 0;
                    }
                    let e = GrantEntry {
                        grant: self.next_grant,
                        len,
                        sample: s,
                        offset: self.ring_at,
                        rkey: 0,
                    };
                    self.ring_at += len as u64;
                    self.next_grant += 1;
                    self.granted.push(Granted {
                        grant: e.grant,
                        sample: s,
                        len,
                        offset: e.offset,
                    });
                    self.answered.push(0);
                    es.push(e);
                }
                self.grant_frame(&es);
                self.batches_left -= 1;
            }
        }
        // Done: every grant answered; leave (the node sees EOF).
        if !self.must_end
            && !self.left
            && self.batches_left == 0
            && self.outstanding() == 0
            && self.out.is_empty()
        {
            self.skip_empty();
            if self.outstanding() == 0 {
                net.shutdown(self.fd);
                self.left = true;
            }
        }
        // A keepalive each second with nothing sent (as the real consumer);
        // some are probes (as after a node-down notice about this node).
        if !self.left
            && !self.silent(step)
            && now_ms >= self.last_sent_ms + 1000
            && self.out.is_empty()
        {
            let ask = self.heartbeats;
            let h = if ask && self.probe_sent_ms.is_none() && rng.chance(3) {
                self.probe_sent_ms = Some(now_ms);
                Header::probe()
            } else {
                Header::keepalive(ask)
            };
            self.out.extend_from_slice(&h.encode());
        }
        self.io(step, now_ms)
    }

    fn io(&mut self, step: u64, now_ms: u64) {
        if !self.out.is_empty() && !self.left {
            match self.port.send_now(self.fd, &self.out) {
                Ok(n) => {
                    self.out.drain(..n);
                    self.last_sent_ms = now_ms;
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(_) => self.out.clear(),
            }
        }
        if !self.rx.inflight() && !self.stalled(step) {
            let land = self.land.as_mut_ptr();
            let granted = &self.granted;
            let got = self.got;
            // SAFETY: `land` lives as long as the consumer, which is
            // dropped after its port has nothing in flight; a payload
            // lands in its grant's own range.
            unsafe {
                self.rx.post(&mut self.port, UD_RECV, self.fd, |i| {
                    land.add((granted[i as usize].offset + got) as usize)
                })
            };
        }
        self.port.submit(false).unwrap();
        let mut out = [Completion::default(); 4];
        let n = self.port.drain(&mut out);
        for c in &out[..n] {
            assert_eq!(c.user_data, UD_RECV);
            self.rx.returned();
            self.on_recv(c.result);
        }
    }

    /// Entries of 0 bytes are never answered (nothing to send).
    fn skip_empty(&mut self) {
        while self.cursor < self.granted.len() && self.granted[self.cursor].len == 0 {
            self.answered[self.cursor] += 1;
            self.cursor += 1;
        }
    }

    fn on_recv(&mut self, res: i32) {
        let who = format!("consumer {}", self.id);
        let got = match self.rx.received(res, proto::MAX_DATA_BYTES) {
            Ok(g) => g,
            Err(RxError::Closed) => {
                self.ended = Some("closed".into());
                return;
            }
            Err(e) => {
                assert!(
                    self.may_drop || self.must_end || !self.conn_errors.is_empty(),
                    "{who}: receive failed without a loss or a drop: {e:?}"
                );
                self.ended = Some(format!("{e:?}"));
                return;
            }
        };
        self.skip_empty();
        let shape = SHAPE.with(|s| s.get()).expect("shape");
        // Any frame from the node answers a probe.
        if self.probe_sent_ms.take().is_some() {
            self.probes_answered += 1;
        }
        match got {
            Received::Header(h) if h.is_keepalive() => {}
            Received::Header(h) if h.node_down_notice().is_some() => {
                assert!(
                    self.heartbeats,
                    "{who}: a node-down notice, though it never asked for them"
                );
                self.notices.push(h.node_down_notice().expect("a notice"));
            }
            Received::Header(h) if h.kind == Kind::Data => {
                assert!(
                    self.cursor < self.granted.len(),
                    "{who}: DATA for grant {} with no grant outstanding",
                    h.a
                );
                let g = self.granted[self.cursor];
                assert_eq!(
                    h.a, g.grant,
                    "{who}: DATA for grant {} while grant {} is the oldest unanswered (grant order)",
                    h.a, g.grant
                );
                assert_eq!(
                    h.c,
                    g.offset + self.got,
                    "{who}: grant {}: DATA at ring offset {} (expected {}: each byte once, in order)",
                    g.grant,
                    h.c,
                    g.offset + self.got
                );
                assert!(
                    h.body_len > 0 && self.got + h.body_len as u64 <= g.len as u64,
                    "{who}: grant {}: {} bytes past the sample's {} (at {})",
                    g.grant,
                    h.body_len,
                    g.len,
                    self.got
                );
                assert!(h.body_len <= shape.chunk, "{who}: DATA larger than a chunk");
                self.rx.expect_payload(self.cursor as u32, h.body_len);
            }
            Received::Header(h) if h.kind == Kind::Error => self.rx.expect_body(h),
            Received::Header(h) => panic!("{who}: unexpected {:?} frame", h.kind),
            Received::Payload { to, len } => {
                let g = self.granted[to as usize];
                let w = world();
                let loc = held_at(g.sample).unwrap_or_else(|| {
                    panic!(
                        "{who}: DATA for sample {}, which this node does not hold",
                        g.sample
                    )
                });
                let src = &w.extents[loc.0 as usize];
                let at = (loc.1 + self.got) as usize;
                let dst = (g.offset + self.got) as usize;
                assert!(
                    self.land[dst..dst + len as usize] == src[at..at + len as usize],
                    "{who}: grant {} (sample {}): bytes {}..{} are not the sample's",
                    g.grant,
                    g.sample,
                    self.got,
                    self.got + len as u64
                );
                self.got += len as u64;
                if self.got == g.len as u64 {
                    self.answered[self.cursor] += 1;
                    self.cursor += 1;
                    self.got = 0;
                }
            }
            Received::Body(h) => {
                let msg = String::from_utf8_lossy(self.rx.body(&h)).into_owned();
                let code = Code::from_u32(h.b);
                if h.a == proto::CONNECTION {
                    assert!(
                        self.must_end || self.may_drop || self.silent_ever(),
                        "{who}: the node dropped a consumer that kept the protocol: {}: {msg}",
                        code.name()
                    );
                    self.conn_errors.push(format!("{}: {msg}", code.name()));
                    return;
                }
                assert!(
                    self.cursor < self.granted.len() && self.granted[self.cursor].grant == h.a,
                    "{who}: ERROR for grant {}, not the oldest unanswered: {msg}",
                    h.a
                );
                let g = self.granted[self.cursor];
                match code {
                    Code::NotHeld => {
                        assert!(
                            held_at(g.sample).is_none(),
                            "{who}: NotHeld for sample {}, which this node holds",
                            g.sample
                        );
                        assert_eq!(self.got, 0, "{who}: NotHeld after DATA");
                    }
                    Code::ReadFailed => assert!(
                        msg.contains("errno 5 "),
                        "{who}: grant {}: a transient read failure (EAGAIN, EINTR or a short \
                         read) was answered with an ERROR; the node must retry it: {msg}",
                        g.grant
                    ),
                    c => panic!(
                        "{who}: grant {}: unexpected ERROR {}: {msg}",
                        g.grant,
                        c.name()
                    ),
                }
                self.answered[self.cursor] += 1;
                self.cursor += 1;
                self.got = 0;
            }
        }
    }

    fn silent_ever(&self) -> bool {
        matches!(self.act, Act::Stall { .. })
    }
}

/// What the consumers know of the node's space (set per seed).
#[derive(Clone, Copy)]
struct Shape {
    chunk: u32,
    max_grants: u32,
    samples: &'static [u32],
    locations: &'static [Held],
}

thread_local! {
    static SHAPE: std::cell::Cell<Option<Shape>> = const { std::cell::Cell::new(None) };
}

fn held_at(sample: u64) -> Held {
    SHAPE.with(|s| s.get().expect("shape").locations[sample as usize])
}

/// The catalog's lengths and this node's locations (built once).
/// Where this node holds a sample: (extent, offset), None when it does not.
type Held = Option<(u32, u64)>;

fn catalog() -> (&'static [u32], &'static [Held]) {
    static C: OnceLock<(Vec<u32>, Vec<Held>)> = OnceLock::new();
    let c = C.get_or_init(|| {
        let space = Space::open(&world().dir).unwrap();
        let cat = space.catalog();
        let lens = (0..cat.len()).map(|i| cat.sample(i).len).collect();
        let locs = (0..cat.len())
            .map(|i| space.location(i).map(|l| (l.extent, l.offset)))
            .collect();
        (lens, locs)
    });
    (&c.0, &c.1)
}

type Ring = Faulty<MemNet>;

/// Totals over the seeds run (what the test checks was exercised).
static TOTALS: [std::sync::atomic::AtomicU64; 5] =
    [const { std::sync::atomic::AtomicU64::new(0) }; 5];

/// One seed: see the module's documentation.
pub(crate) fn serve(seed: u64) {
    serve_shape(seed, false)
}

/// One seed of a poller with thousands of staging slots and a consumer
/// that grants in bulk: more reads in flight at once than a fixed
/// 1,024-entry ring's 2,048 completions, so a ring not sized from the
/// slots (`ServeConfig::ring_entries`) loses completions, which the
/// poller's overflow check turns into a named failure.
pub(crate) fn serve_many_slots(seed: u64) {
    serve_shape(seed, true)
}

fn serve_shape(seed: u64, many_slots: bool) {
    let w = world();
    let (samples, locations) = catalog();
    let mut rng = Rng(crate::hash::mix64(seed ^ 0x5e7e));
    let npollers = if many_slots {
        1
    } else {
        1 + rng.below(3) as usize
    };
    let nconsumers = if many_slots {
        1
    } else {
        1 + rng.below(4) as usize
    };
    let mut cfg = ServeConfig::new(&w.dir, "sim:0", b"token");
    cfg.chunk_bytes = [512, 1024, 1536, 4096, 8192][rng.below(5) as usize];
    cfg.staging_bytes = cfg.chunk_bytes as u64 * (1 + rng.below(12));
    cfg.max_grants = 1 + rng.below(48) as u32;
    cfg.max_conns_per_poller = 1 + rng.below(4) as usize;
    if many_slots {
        cfg.chunk_bytes = 512;
        cfg.staging_bytes = 4096 * 512;
        cfg.max_grants = 1024;
    }
    let stall_ms = 500 + rng.below(2000);
    cfg.stall_timeout = Duration::from_millis(stall_ms);
    cfg.idle_timeout = Duration::from_millis(3000 + rng.below(3000));
    let (_, cq, _) = cfg.ring_entries();
    let buffer = if many_slots {
        256 << 10
    } else {
        64 + rng.below(24 << 10) as usize
    };
    let faults = MemNetFaults {
        partial_send_ppm: rng.below(500_000) as u32,
        delay_ppm: rng.below(300_000) as u32,
    };
    let mut net = MemNet::new(seed, 2 * nconsumers, buffer, 4, faults);
    for e in &w.extents {
        net.add_file(e.clone());
    }
    let eio_ppm = if rng.chance(3) {
        rng.below(30_000) as u32
    } else {
        0
    };
    let short_ppm = rng.below(150_000) as u32;
    let transient_ppm = rng.below(150_000) as u32;
    let read_delay_ppm = rng.below(200_000) as u32;
    // The node's receives (a `recvmsg` of whatever arrived) cut short
    // too, so frames also split where no send split them.
    let net_faults = NetFaults {
        short_recvmsg_ppm: rng.below(300_000) as u32,
        ..Default::default()
    };
    let slots = cfg.slots();
    let rings: Vec<Ring> = (0..npollers)
        .map(|p| {
            let fc = FaultConfig {
                seed: seed ^ (p as u64) << 48,
                eio_ppm,
                short_ppm,
                delay_ppm: read_delay_ppm,
                ..Default::default()
            };
            // Room for all a poller may have in flight (a read per slot, a
            // receive and a send per connection); its completion queue is
            // the one `ring_entries` sizes.
            let depth = slots + 2 * cfg.max_conns_per_poller + 8;
            let port = net.port(depth).with_cq_limit(cq as usize);
            Faulty::new(port, fc, slots + 2 * cfg.max_conns_per_poller + 8)
                .with_transient_read_faults(transient_ppm)
                .with_net_faults(net_faults)
        })
        .collect();
    let mut node = SimNode::new(Space::open(&w.dir).unwrap(), cfg, rings);
    let shape = Shape {
        chunk: node.cfg().chunk_bytes,
        max_grants: node.cfg().max_grants,
        samples,
        locations,
    };
    SHAPE.with(|s| s.set(Some(shape)));
    let identity = Space::open(&w.dir).unwrap().catalog().identity();
    let mut consumers = Vec::new();
    for id in 0..nconsumers {
        let (node_fd, fd) = net.pair();
        // A batch goes every third step or so: misbehaviour falls within
        // the script.
        let batches = if many_slots {
            2
        } else {
            1 + rng.below(120) as u32
        };
        let steps_hint = 4 * batches as u64 + 20;
        let long = rng.chance(2);
        let act = match if many_slots { 9 } else { rng.below(10) } {
            0 => Act::Stall {
                at: rng.below(steps_hint),
                steps: rng.below(if long { 600 } else { 60 }),
                silent: rng.chance(2),
            },
            1 => Act::Garbage {
                at: rng.below(steps_hint),
            },
            2 => Act::BadGrant {
                at: rng.below(steps_hint),
                how: rng.below(5),
            },
            3 => Act::Reset {
                at: rng.below(steps_hint),
            },
            4 => Act::Leave {
                at: rng.below(steps_hint),
            },
            _ => Act::Good,
        };
        let ring_len = 32_768 + rng.below(1 << 16);
        let hello = Hello {
            catalog_identity: identity,
            rank: id as u32,
            world: nconsumers as u32,
            catalog_samples: samples.len() as u64,
            seed: 0,
            ring_addr: 0,
            ring_len,
            rkey: 0,
            transport: proto::TRANSPORT_TCP,
        };
        // The least loaded poller with room, as the acceptor picks.
        let p = (0..npollers).min_by_key(|&p| node.load(p)).unwrap();
        if !node.connect(p, node_fd, hello) {
            continue; // the acceptor would refuse it NodeFull at HELLO
        }
        consumers.push(Consumer {
            id,
            bulk: many_slots,
            fd,
            port: net.port(4),
            act,
            ring_len,
            land: vec![0u8; ring_len as usize],
            rx: FrameRx::new(proto::MAX_MESSAGE_BYTES),
            out: Vec::new(),
            granted: Vec::new(),
            cursor: 0,
            got: 0,
            answered: Vec::new(),
            next_grant: 0,
            ring_at: 0,
            batches_left: batches,
            last_sent_ms: 0,
            heartbeats: rng.chance(2),
            must_end: false,
            may_drop: matches!(act, Act::Stall { .. }),
            ended: None,
            left: false,
            conn_errors: Vec::new(),
            notices: Vec::new(),
            probe_sent_ms: None,
            idle_until_ms: 0,
            probes_answered: 0,
        });
    }
    // Node-down notices posted to the node's board (as an agent's network
    // threads post them), in order: a third of the seeds post some.
    let notice_chance = if rng.chance(3) { 1 + rng.below(300) } else { 0 };
    let mut posted: Vec<(u32, u32)> = Vec::new();
    let mut now_ms = 0u64;
    let mut step = 0u64;
    const MAX_STEPS: u64 = 200_000;
    let mut stopping = false;
    // A quarter of the seeds stop the service in the middle of the run:
    // reads, receives and partly sent frames in flight at the stop.
    let stop_at = rng.chance(4).then(|| 1 + rng.below(400));
    let mut order: Vec<usize> = (0..npollers).collect();
    loop {
        step += 1;
        // Mostly a few ms; now and then a jump (at most a quarter of the
        // stall timeout, so a consumer that reads is never taken for
        // stalled while a completion is held back).
        let dt = if rng.chance(100) {
            rng.below(stall_ms / 4)
        } else {
            rng.below(12)
        };
        net.advance(Duration::from_millis(dt));
        now_ms += dt;
        if notice_chance > 0 && rng.chance(notice_chance) {
            let n = (rng.below(64) as u32, rng.below(20_000) as u32);
            node.notices().post(n.0, n.1, net.now());
            // A node posted again within 2 s is not (the board's rule).
            if node.notices().posted() as usize > posted.len() {
                posted.push(n);
            }
        }
        for c in &mut consumers {
            // A probe is answered within the consumer's 1.5 s (its
            // `PROBE_SILENCE`) while it reads and the node runs: a jump of
            // the clock (the consumer's own pause, which its real clocks
            // shift away) or a stall restarts the count.
            if let Some(t) = c.probe_sent_ms {
                if dt >= 100 || c.stalled(step) || stopping || c.ended.is_some() {
                    c.probe_sent_ms = Some(now_ms);
                } else {
                    assert!(
                        now_ms - t <= proto::PROBE_SILENCE.as_millis() as u64
                            || c.must_end
                            || c.may_drop,
                        "seed {seed}: consumer {}: a probe sent at {t} ms unanswered at {now_ms} ms",
                        c.id
                    );
                }
            }
            c.step(&mut net, &mut rng, step, now_ms, &shape);
        }
        // The pollers run in a seeded order each step.
        for k in (1..order.len()).rev() {
            order.swap(k, rng.below(k as u64 + 1) as usize);
        }
        for &p in &order {
            node.tick(p);
            node.check(p, |f| node.ring(p).inner().each_pending_buffer(f));
        }
        let all_ended = consumers.iter().all(|c| c.ended.is_some());
        if !stopping && (all_ended || stop_at == Some(step)) {
            node.stop();
            stopping = true;
            for c in &mut consumers {
                // Closed without an ERROR (the service stops); its grants
                // may stay unanswered.
                c.may_drop = true;
                c.batches_left = 0;
            }
        }
        // The end: every poller finished, every consumer has read to the
        // end of its stream (the stop shut every connection).
        if stopping
            && (0..npollers).all(|p| node.tick(p))
            && consumers.iter().all(|c| c.ended.is_some())
        {
            break;
        }
        assert!(
            step < MAX_STEPS,
            "no progress after {step} steps: consumers {:?}; {}",
            consumers
                .iter()
                .map(|c| (
                    c.act,
                    c.cursor,
                    c.granted.get(c.cursor).copied(),
                    c.got,
                    c.granted.len(),
                    c.batches_left,
                    c.ended.clone()
                ))
                .collect::<Vec<_>>(),
            (0..npollers)
                .map(|p| node.describe(p))
                .collect::<Vec<_>>()
                .join(" | ")
        );
    }
    node.check_teardown();
    let st = node.stats();
    let r = |a: &std::sync::atomic::AtomicU64| a.load(std::sync::atomic::Ordering::Relaxed);
    for (t, v) in TOTALS.iter().zip([
        r(&st.samples),
        r(&st.errors),
        r(&st.read_retries),
        r(&st.stalled),
        r(&st.violations),
    ]) {
        t.fetch_add(v, std::sync::atomic::Ordering::Relaxed);
    }
    if std::env::var_os("KSPEED_SIM_VERBOSE").is_some() {
        eprintln!(
            "seed {seed}: {npollers} pollers, {} consumers {:?}, {step} steps, {} ms; \
             samples {}, errors {}, read retries {}, stalled {}, violations {}",
            consumers.len(),
            consumers.iter().map(|c| c.act).collect::<Vec<_>>(),
            now_ms,
            r(&st.samples),
            r(&st.errors),
            r(&st.read_retries),
            r(&st.stalled),
            r(&st.violations)
        );
    }
    for c in &consumers {
        let who = format!("consumer {} ({:?})", c.id, c.act);
        assert_eq!(
            c.port.in_flight(),
            0,
            "{who}: receives in flight at the end"
        );
        c.port.check_pools();
        for (i, &n) in c.answered.iter().enumerate() {
            assert!(
                n <= 1,
                "{who}: grant {} answered {n} times",
                c.granted[i].grant
            );
        }
        if !c.must_end && !c.may_drop && c.conn_errors.is_empty() {
            assert!(c.left, "{who}: ended before its script: {:?}", c.ended);
            assert_eq!(c.cursor, c.granted.len(), "{who}: grants unanswered");
            assert!(
                c.answered.iter().all(|&n| n == 1),
                "{who}: a grant not answered"
            );
        }
        if c.must_end {
            assert!(c.ended.is_some(), "{who}: the node did not end it");
        }
        // The notices it got are posted ones, in order, each once: a
        // subsequence of `posted` (it asked after some, may have left
        // before the last, and skips the oldest when it falls more than
        // the board keeps behind).
        let got = &c.notices;
        let mut rest = posted.iter();
        assert!(
            got.iter().all(|g| rest.any(|p| p == g)),
            "{who}: notices {got:?} are not in the order posted {posted:?}"
        );
        NOTICE_TOTALS[0].fetch_add(got.len() as u64, std::sync::atomic::Ordering::Relaxed);
        NOTICE_TOTALS[1].fetch_add(c.probes_answered, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Node-down notices received and probes answered, over every seed.
static NOTICE_TOTALS: [std::sync::atomic::AtomicU64; 2] =
    [const { std::sync::atomic::AtomicU64::new(0) }; 2];

#[cfg(test)]
mod tests {
    use super::*;

    /// The node service simulation over many seeds (bounded in time; see
    /// `sim`'s documentation for replaying one).
    #[test]
    fn sim_serve_pollers_over_the_memory_network() {
        let ran = run_seeds("sim_serve", 300, Duration::from_secs(60), serve);
        assert!(ran > 0);
        let t: Vec<u64> = TOTALS
            .iter()
            .map(|t| t.load(std::sync::atomic::Ordering::Relaxed))
            .collect();
        eprintln!(
            "sim_serve totals: samples {}, errors {}, read retries {}, stalled drops {}, violations {}",
            t[0], t[1], t[2], t[3], t[4]
        );
        let n: Vec<u64> = NOTICE_TOTALS
            .iter()
            .map(|t| t.load(std::sync::atomic::Ordering::Relaxed))
            .collect();
        eprintln!(
            "sim_serve totals: node-down notices received {}, probes answered {}",
            n[0], n[1]
        );
        if ran >= 100 && std::env::var_os("KSPEED_SIM_SEED").is_none() {
            // A simulation that stopped exercising the node would pass
            // vacuously: each path ran.
            assert!(t.iter().all(|&v| v > 0), "a path never ran: {t:?}");
            assert!(
                n.iter().all(|&v| v > 0),
                "notices or probes never ran: {n:?}"
            );
        }
    }

    /// The ring holds every completion with thousands of staging slots
    /// (a few seeds: each moves megabytes through the simulated sockets).
    #[test]
    fn sim_serve_ring_holds_every_completion() {
        let budget = Duration::from_secs(60);
        let ran = run_seeds("sim_serve_many_slots", 3, budget, serve_many_slots);
        assert!(ran > 0);
    }
}
