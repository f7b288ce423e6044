//! The deterministic simulator (tests only): the transport code the node
//! service's poller and the consumer's network thread share, run over the
//! in-memory network ([`MemNet`]) under one seed, with invariant checks
//! after every step. Today it drives, on 1 to 4 connections sharing one
//! ring (as a serve poller's consumers do), a node's send side ([`TcpLink`]: DATA
//! and ERROR frames, batched `sendmsg`, partial sends resumed) against a
//! consumer's receive state machine ([`FrameRx`]: header, body, payload
//! straight into the landing memory), through partial sends, held-back
//! completions, reordering across operations, a consumer that stops
//! reading for a while (bounded buffers stall the sender), and the loss of
//! the connection. Checked: every frame posted completes exactly once;
//! the frames received are a prefix of those posted, in order, each
//! byte-exact and exactly once; without a loss all arrive; after one,
//! every failure is a named error (ECONNRESET, end of stream); the loop
//! always ends (no hang) with nothing in flight and no pool grown.
//!
//! Seeds: `KSPEED_SIM_SEED=n` replays one; `KSPEED_SIM_SEEDS=n` sets how
//! many run (from `KSPEED_SIM_BASE`, default 0), within a time budget
//! (`KSPEED_SIM_BUDGET_S`, default 60 s). A failure names its seed.
//!
//! `serve.rs` runs the node service's real pollers over [`MemNet`]
//! against scripted consumers; `net.rs` the consumer's whole network
//! thread against scripted node services (see each).

mod cluster;
#[cfg(feature = "rdma")]
mod rdma;
mod serve;

use std::time::{Duration, Instant};

mod net;

use crate::ring::memnet::{MemNet, MemNetFaults};
use crate::ring::{Completion, IoBackend};
use crate::transport::proto::{self, Code, Kind};
use crate::transport::rx::{FrameRx, Received, RxError};
use crate::transport::tcp::TcpLink;
use crate::transport::{Done, Link};

/// A simulation's own seeded sequence (splitmix64; the network's is
/// MemNet's), shared by every simulation.
pub(crate) struct Rng(pub(crate) u64);

impl Rng {
    /// A number below `n` (0 when `n` is 0).
    pub(crate) fn below(&mut self, n: u64) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        crate::hash::reduce(crate::hash::mix64(self.0), n.max(1))
    }

    /// True once in `one_in` draws.
    pub(crate) fn chance(&mut self, one_in: u64) -> bool {
        self.below(one_in) == 0
    }

    /// True `ppm` times in a million draws.
    pub(crate) fn ppm(&mut self, ppm: u64) -> bool {
        self.below(1_000_000) < ppm
    }
}

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|v| v.trim().parse().ok())
}

/// Runs `body` for each seed of this run (see the module's
/// documentation) until `budget` is spent; a failing seed is printed with
/// how to replay it, then the failure goes on. Returns the seeds run.
pub(crate) fn run_seeds(name: &str, default_count: u64, budget: Duration, body: fn(u64)) -> u64 {
    if let Some(seed) = env_u64("KSPEED_SIM_SEED") {
        eprintln!("{name}: replaying seed {seed}");
        body(seed);
        return 1;
    }
    let count = env_u64("KSPEED_SIM_SEEDS").unwrap_or(default_count);
    let budget = env_u64("KSPEED_SIM_BUDGET_S").map_or(budget, Duration::from_secs);
    let base = env_u64("KSPEED_SIM_BASE").unwrap_or(0);
    let t0 = Instant::now();
    let mut ran = 0;
    for seed in base..base + count {
        if t0.elapsed() > budget {
            break;
        }
        if let Err(p) = std::panic::catch_unwind(|| body(seed)) {
            eprintln!("{name}: FAILED at seed {seed}; replay with KSPEED_SIM_SEED={seed}");
            std::panic::resume_unwind(p);
        }
        ran += 1;
    }
    eprintln!(
        "{name}: {ran} seeds (from {base}) in {:.1} s",
        t0.elapsed().as_secs_f64()
    );
    ran
}

const UD_SEND: u64 = 1;
const UD_RECV: u64 = 2;

#[derive(Clone, Copy)]
struct Frame {
    error: bool,
    /// DATA: offset in the source (and in the landing memory); ERROR: of
    /// its message in the source.
    off: usize,
    len: usize,
}

/// One connection: a node streams `frames` (cut from `src`) to a consumer
/// that lands DATA payloads in `land` at their frames' offsets.
struct Stream {
    conn: u64,
    a: i32,
    b: i32,
    frames: Vec<Frame>,
    src: Vec<u8>,
    land: Vec<u8>,
    link: TcpLink,
    rx: FrameRx<u32>,
    loss_at: Option<u64>,
    stall: Option<std::ops::Range<u64>>,
    posted: usize,
    done_seen: Vec<Option<bool>>,
    next_done: usize,
    received: usize,
    rx_dead: Option<String>,
    lost: bool,
    shut: bool,
    closed: bool,
}

impl Stream {
    fn new(conn: u64, net: &mut MemNet, seed: u64, buffer: usize) -> Stream {
        let (a, b) = net.pair();
        // Under Miri (interpreted, ~1000x slower) a seed is a few small
        // frames: the point there is the memory model, not coverage.
        let nframes = 1 + net.below(if cfg!(miri) { 6 } else { 200 }) as usize;
        let mut frames = Vec::with_capacity(nframes);
        let mut at = 0;
        for _ in 0..nframes {
            let error = net.below(10) == 0;
            // DATA carries at least one byte (the protocol's rule).
            let len = if error {
                let most = if cfg!(miri) {
                    64
                } else {
                    proto::MAX_MESSAGE_BYTES
                };
                net.below(most as u64 + 1) as usize
            } else {
                1 + net.below(if cfg!(miri) { 256 } else { 8192 }) as usize
            };
            frames.push(Frame {
                error,
                off: at,
                len,
            });
            at += len;
        }
        // Every byte's value depends on its position, its connection and
        // the seed, so a misplaced byte shows.
        let salt = crate::hash::mix64(seed ^ conn << 40);
        let src: Vec<u8> = (0..at)
            .map(|i| ((i as u64).wrapping_mul(0x9e37_79b9) ^ salt ^ (i as u64 >> 11)) as u8)
            .collect();
        let steps_hint = 40 * nframes as u64 + 8 * (at as u64 / buffer as u64 + 1);
        let loss_at = (net.below(3) == 0).then(|| net.below(steps_hint));
        let stall = (net.below(4) == 0).then(|| {
            let from = net.below(steps_hint);
            from..from + net.below(200)
        });
        let capacity = 1 + net.below(32) as usize;
        Stream {
            conn,
            a,
            b,
            link: TcpLink::new(a, capacity, UD_SEND | conn << 8),
            rx: FrameRx::new(proto::MAX_MESSAGE_BYTES),
            done_seen: vec![None; nframes],
            land: vec![0u8; at],
            frames,
            src,
            loss_at,
            stall,
            posted: 0,
            next_done: 0,
            received: 0,
            rx_dead: None,
            lost: false,
            shut: false,
            closed: false,
        }
    }

    /// The node's part of a step, and the consumer's receive.
    fn step(&mut self, net: &mut MemNet, step: u64) {
        let nframes = self.frames.len();
        if self.loss_at == Some(step) {
            net.reset(self.a);
            self.lost = true;
        }
        // The node: post what the link takes, then flush.
        while self.posted < nframes {
            let (i, f) = (self.posted, self.frames[self.posted]);
            // SAFETY: `src` outlives every send (a stream is dropped after
            // the run, which ends with nothing in flight).
            let ok = unsafe {
                let p = self.src.as_ptr().add(f.off);
                let (id, len) = (i as u64, f.len as u32);
                if f.error {
                    self.link.post_error(id, i as u32, Code::ReadFailed, p, len)
                } else {
                    self.link.post_write(id, p, len, f.off as u64, i as u32, 0)
                }
            };
            if !ok {
                break;
            }
            self.posted += 1;
        }
        let _ = self.link.flush_on(net);
        if self.next_done == nframes && !self.link.busy() && !self.shut {
            net.shutdown_write(self.a);
            self.shut = true;
        }
        // The consumer: one receive at a time, unless it stalls.
        let stalled = self.stall.as_ref().is_some_and(|s| s.contains(&step));
        if self.rx_dead.is_none() && !self.rx.inflight() && !stalled {
            let land = self.land.as_mut_ptr();
            let frames = &self.frames;
            // SAFETY: `land` outlives the receive (as `src` above); a
            // payload lands in its frame's own range, nothing else uses it.
            unsafe {
                self.rx.post(net, UD_RECV | self.conn << 8, self.b, |i| {
                    land.add(frames[i as usize].off)
                })
            };
        }
    }

    fn on_send(&mut self, res: i32) {
        if res < 0 {
            assert!(self.lost, "send failed without a loss: {res}");
            assert_eq!(res, -libc::ECONNRESET);
        }
        self.link.on_send(res);
    }

    fn on_recv(&mut self, res: i32) {
        self.rx.returned();
        let received = self.received;
        match self.rx.received(res, 8192) {
            Ok(Received::Header(h)) => {
                assert!(received < self.posted, "a frame that was never posted");
                let f = self.frames[received];
                assert_eq!(h.a, received as u32, "frames out of order");
                assert_eq!(h.body_len as usize, f.len);
                if f.error {
                    assert_eq!(h.kind, Kind::Error);
                    assert_eq!(h.b, Code::ReadFailed as u32);
                    self.rx.expect_body(h);
                } else {
                    assert_eq!(h.kind, Kind::Data);
                    assert_eq!(h.c, f.off as u64);
                    self.rx.expect_payload(received as u32, f.len as u32);
                }
            }
            Ok(Received::Body(h)) => {
                let f = self.frames[received];
                assert_eq!(self.rx.body(&h), &self.src[f.off..f.off + f.len]);
                self.received += 1;
            }
            Ok(Received::Payload { to, len }) => {
                let f = self.frames[to as usize];
                assert_eq!(to as usize, received);
                assert_eq!(len as usize, f.len);
                assert!(
                    self.land[f.off..f.off + f.len] == self.src[f.off..f.off + f.len],
                    "frame {to}: payload not byte-exact"
                );
                self.received += 1;
            }
            Err(RxError::Closed) => {
                assert_eq!(
                    received,
                    self.frames.len(),
                    "end of stream before the last frame"
                );
                self.rx_dead = Some("closed".into());
            }
            Err(e) => {
                assert!(self.lost, "receive failed without a loss: {e:?}");
                self.rx_dead = Some(format!("{e:?}"));
            }
        }
    }

    /// The link's finished frames; after a loss, the node drops the
    /// connection once no send is in flight (the link then fails what it
    /// holds at once, and what was never posted is failed too).
    fn reap(&mut self) {
        if self.lost && !self.closed && !self.link.busy() {
            self.link.close();
            self.closed = true;
        }
        let mut dones = [Done {
            wr_id: 0,
            ok: false,
        }; 8];
        loop {
            let k = self.link.poll(&mut dones);
            if k == 0 {
                break;
            }
            for d in &dones[..k] {
                let i = d.wr_id as usize;
                assert_eq!(i, self.next_done, "frames complete in post order");
                assert!(self.done_seen[i].is_none(), "frame {i} completed twice");
                assert!(d.ok || self.lost, "frame {i} failed without a loss");
                self.done_seen[i] = Some(d.ok);
                self.next_done += 1;
            }
        }
        if self.closed && self.next_done == self.posted {
            while self.posted < self.frames.len() {
                self.done_seen[self.posted] = Some(false);
                self.posted += 1;
                self.next_done += 1;
            }
        }
    }

    fn finished(&self) -> bool {
        self.next_done == self.frames.len()
            && !self.link.busy()
            && self.rx_dead.is_some()
            && !self.rx.inflight()
    }

    /// The end-of-run invariants.
    fn check_end(&self) {
        let nframes = self.frames.len();
        assert!(self.done_seen.iter().all(|d| d.is_some()));
        if !self.lost {
            assert_eq!(self.received, nframes);
            assert!(self.done_seen.iter().all(|d| *d == Some(true)));
        } else {
            // Every frame received was handed to the socket whole first.
            for (i, d) in self.done_seen.iter().enumerate().take(self.received) {
                assert_eq!(*d, Some(true), "frame {i} received but failed");
            }
        }
    }
}

/// One seed: 1 to 4 connections on one ring (as a serve poller holds
/// several consumers), each a node streaming frames to a consumer.
fn streams(seed: u64) {
    let mut shape = MemNet::new(seed, 0, 0, 1, MemNetFaults::default());
    let conns = 1 + shape.below(4) as usize;
    let buffer = 64 + shape.below(64 << 10) as usize;
    let faults = MemNetFaults {
        partial_send_ppm: shape.below(600_000) as u32,
        delay_ppm: shape.below(400_000) as u32,
    };
    let mut net = MemNet::new(seed, 2 * conns, buffer, 2 * conns + 2, faults);
    let mut ss: Vec<Stream> = (0..conns)
        .map(|i| Stream::new(i as u64, &mut net, seed, buffer))
        .collect();
    let mut out = [Completion::default(); 8];
    const MAX_STEPS: u64 = 2_000_000;
    let mut step = 0u64;
    loop {
        step += 1;
        assert!(
            step < MAX_STEPS,
            "no progress: {:?}, {} in flight",
            ss.iter()
                .map(|s| (s.posted, s.next_done, s.received, s.frames.len()))
                .collect::<Vec<_>>(),
            net.in_flight()
        );
        for s in &mut ss {
            s.step(&mut net, step);
        }
        net.submit(false).unwrap();
        let n = net.drain(&mut out);
        for c in &out[..n] {
            let s = &mut ss[(c.user_data >> 8) as usize];
            match c.user_data & 0xff {
                UD_SEND => s.on_send(c.result),
                UD_RECV => s.on_recv(c.result),
                ud => panic!("unknown completion {ud}"),
            }
        }
        for s in &mut ss {
            s.reap();
        }
        if ss.iter().all(Stream::finished) && net.in_flight() == 0 {
            break;
        }
    }
    // Teardown: nothing in flight, every frame accounted for, no pool grew.
    assert_eq!(net.in_flight(), 0);
    for s in &ss {
        s.check_end();
    }
    net.check_pools();
}

/// A simulated consumer's run: `catalog` read from its source files, a host
/// ring of `geo`, no pollers (its network thread fills the ring), every
/// sample's CRC32C checked, `net` its network side.
pub(crate) fn net_consumer(
    catalog: std::sync::Arc<crate::dataset::Catalog>,
    geo: crate::loader::schedule::Geometry,
    sampler: crate::sampler::Sampler,
    steps: u64,
    end_g: u64,
    net: crate::loader::net::NetShared,
) -> std::sync::Arc<crate::loader::Shared> {
    let ring = crate::landing::LandingRing::new(&crate::landing::LandingOptions {
        ring_bytes: geo.ring_bytes,
        huge_pages: false,
        mlock: false,
        numa_node: None,
        gpu_pci: None,
        cuda: crate::landing::CudaMode::Off,
    })
    .expect("sim: landing ring");
    let cfg = crate::loader::PollerConfig {
        pollers: 0,
        queue_depth: 1,
        submit_batch: 1,
        max_read_bytes: 1 << 20,
        lookahead: u64::MAX,
        spin: std::time::Duration::ZERO,
        sqpoll_idle_ms: None,
        verify_crc32c: true,
        faults: None,
        tier_views: false,
    };
    std::sync::Arc::new(crate::loader::Shared::for_sim(
        crate::loader::Input::Source {
            catalog,
            root: std::path::PathBuf::new(),
        },
        ring,
        geo,
        sampler,
        steps,
        end_g,
        cfg,
        Some(net),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The transport simulation over many seeds (bounded in time; see the
    /// module's documentation for replaying one).
    #[test]
    fn sim_transport_streams_over_the_memory_network() {
        let ran = run_seeds("sim_transport", 300, Duration::from_secs(60), streams);
        assert!(ran > 0);
    }
}
