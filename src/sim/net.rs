//! The consumer's network thread in the simulator: the real
//! `loader::net::Thread` (TCP data path, grant table, failover, heartbeat
//! and minimum-progress clocks, CRC32C checks, the source fallback) over
//! [`MemNet`], talking to 1–4 scripted node services under one seed and
//! virtual time, with a consumer that takes the samples in order and
//! releases them (so flow control turns over), two epochs long.
//!
//! The nodes speak the wire protocol with the real codec (`proto`,
//! [`FrameRx`]): they read GRANT frames and keepalives, answer with DATA
//! frames in grant order (a sample sometimes in two frames), heartbeats
//! when asked, and seeded faults: an ERROR for a grant (a named code), a
//! corrupted byte (the CRC32C check fails it over), a node shutting down
//! (a connection ERROR `ShuttingDown`, then it closes), a stall (no frame at
//! all for 0.3–4 s: the heartbeat clock fails its grants over), a dead node
//! (the connection reset), nodes dead from the start, a thread not run for
//! 1–3 s (all clocks jump), a submission queue too shallow for every
//! operation (pushes refused); the network buffers, partial sends and
//! held-back completions come from [`MemNetFaults`].
//! Some nodes break the protocol (DATA at the wrong offset, for a grant
//! they do not have, or longer than the grant): they must be dropped
//! before a byte lands. Some send node-down notices about seeded nodes
//! (another, themselves, one outside the list; alive, stalled or gone),
//! and every node answers a probe: a node never hurt keeps its connection
//! through them. Some seeds poison the errors lock.
//!
//! A third of the seeds run a node agent's shared thread
//! (`loader/net/hub.rs`): 2–3 lanes, each a rank's ring with its own
//! schedule and consumer, over the same connections, their grants in the
//! same GRANT frames; in half of those one lane's loader stops at a seeded
//! step and must leave (its grants over) within a bounded number of steps
//! while the others deliver everything, exactly.
//!
//! Not simulated: handshakes and reconnects (real sockets): the thread
//! starts with its connections made (`sim_connections`) and redial off.
//!
//! Why this file is over ~800 lines: the scripted node and the consumers
//! are one world checked after every step; splitting them would spread one
//! set of invariants over files.
//!
//! Checked after every step: every sample of the two epochs (of every lane
//! that did not stop) is published
//! exactly once, in the rank's order, byte-exact at its slot (checked when
//! first seen ready and again when taken), or fails with
//! `SampleUnavailable` only when no holder could serve it (each was gone,
//! failed that sample, or was demoted) and the source is gone too; a GRANT
//! names only samples its node holds, at aligned ranges inside the ring,
//! with the catalog's length, each grant id once; a node that breaks the
//! protocol is dropped; a node the simulation never hurt (no reset, stall,
//! goodbye or breach) is never dropped, pauses of the thread included; no
//! pool grows; at teardown nothing is in flight.

use crate::sim::Rng;
use std::collections::{HashSet, VecDeque};
use std::os::fd::RawFd;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use crate::dataset::{Catalog, Placement};
use crate::error::Error;
use crate::loader::net::{sim_connections, NetSetup, NetShared, SimRx, Thread};
use crate::loader::schedule::{Cursor, Geometry, Placed};
use crate::loader::{Shared, CODE_ERROR, CODE_OK};
use crate::ring::memnet::{MemNet, MemNetFaults};
use crate::ring::{Completion, FaultConfig, Faulty, IoBackend};
use crate::sampler::{Position, Sampler, SamplerConfig};
use crate::transport::proto::{self, Code, GrantEntry, Header, Hello, Kind};
use crate::transport::{rx::FrameRx, rx::Received, rx::RxError, Cluster};

/// The dataset every seed reads: files of seeded bytes, cataloged twice:
/// once over a source tree that stays (the fallback can read it), once
/// over a copy that is removed (the fallback fails, so a sample no node
/// serves is a named error).
struct Data {
    with_source: PathBuf,
    without_source: PathBuf,
    /// Each sample's bytes, by id.
    bytes: Vec<Vec<u8>>,
}

const FILES: u64 = 40;
const ALIGN: u64 = 512;

fn data() -> &'static Data {
    static DATA: OnceLock<Data> = OnceLock::new();
    DATA.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("kspeed-simnet-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let mut catalogs = Vec::new();
        for name in ["kept", "gone"] {
            let src = dir.join(name);
            std::fs::create_dir_all(&src).expect("sim: make the source tree");
            for i in 0..FILES {
                let len = 1 + crate::hash::mix64(i) % 2400;
                let bytes: Vec<u8> = (0..len)
                    .map(|k| crate::hash::mix64((i << 32) | k) as u8)
                    .collect();
                std::fs::write(src.join(format!("f{i:03}.bin")), bytes).expect("sim: write");
            }
            let out = dir.join(format!("{name}.ksc"));
            let spec = crate::dataset::SourceSpec::parse(src.to_str().expect("utf-8 temp dir"))
                .expect("sim: source spec");
            crate::dataset::catalog::build(&spec, &out, &Default::default())
                .expect("sim: build the catalog");
            catalogs.push(out);
        }
        let cat = Catalog::open(&catalogs[0]).expect("sim: open the catalog");
        let bytes = (0..cat.len())
            .map(|id| {
                let s = cat.sample(id);
                let f = std::fs::read(cat.file_path(s.file)).expect("sim: read a source file");
                f[s.offset as usize..s.offset as usize + s.len as usize].to_vec()
            })
            .collect();
        std::fs::remove_dir_all(dir.join("gone")).expect("sim: remove the second source");
        Data {
            with_source: catalogs[0].clone(),
            without_source: catalogs[1].clone(),
            bytes,
        }
    })
}

/// What all seeds of this process did (printed by the test, so a run
/// shows the faults were reached): steps, samples delivered, samples
/// failed, failovers, source reads, node-down notices sent by the nodes,
/// nodes shut on a notice.
static TOTALS: [std::sync::atomic::AtomicU64; 7] =
    [const { std::sync::atomic::AtomicU64::new(0) }; 7];

const UD_RECV: u64 = 1;
const UD_SEND: u64 = 2;
/// A node with nothing to send (no grant queued: it answers grants in
/// order, so with one queued it sends DATA) sends a heartbeat after this
/// long, as a real node does on an idle connection; its heartbeats say an
/// idle timeout of a minute, so the thread keeps alive every 15 s.
const HEARTBEAT_EVERY: Duration = proto::IDLE_HEARTBEAT_INTERVAL;
const IDLE_TIMEOUT: Duration = Duration::from_secs(60);

/// A scripted node service on its own port.
struct Node {
    index: u32,
    fd: RawFd,
    port: MemNet,
    rx: FrameRx<()>,
    asked: bool,
    queue: VecDeque<GrantEntry>,
    out: Vec<u8>,
    out_sent: usize,
    tx_inflight: bool,
    last_sent: Instant,
    /// Reset by the simulation, or it saw its consumer close.
    gone: bool,
    stall_until: Option<Instant>,
    error_ppm: u64,
    corrupt_ppm: u64,
    /// Grants it failed on purpose (ERROR or corrupt bytes).
    failed: u32,
    /// Frames that break the protocol (DATA at the wrong offset, for a
    /// grant it does not have, or longer than its grant), per million.
    rogue_ppm: u64,
    /// It sent one: the thread must drop it before a byte lands.
    rogue: bool,
    /// Shutting down gracefully: 1, a connection ERROR (`ShuttingDown`)
    /// goes after the frame being sent; 2, it went: the node closes.
    closing: u8,
    /// The consumer asked for node-down notices; this node sends one (about
    /// a seeded node: another, itself, or one outside the list, alive or
    /// not) with this chance per frame, per million.
    notices: bool,
    notice_ppm: u64,
    /// The consumer probed it: a heartbeat goes at its next idle frame.
    probed: bool,
    completions: [Completion; 8],
}

/// What the nodes must check against, and what they record.
struct World<'a> {
    seed: u64,
    placement: Placement,
    catalog: &'a Catalog,
    bytes: &'a [Vec<u8>],
    ring_bytes: u64,
    /// (node, sample) a node failed on purpose.
    faulted: HashSet<(u32, u64)>,
    /// Every node fails every grant but those for which it is the last
    /// replica (so each sample reaches its last replica).
    fail_all_but_last: bool,
}

impl Node {
    fn step(&mut self, w: &mut World, rng: &mut Rng) {
        let now = self.port.now();
        self.port.submit(false).expect("MemNet submits");
        let n = self.port.drain(&mut self.completions);
        for k in 0..n {
            let c = self.completions[k];
            match c.user_data {
                UD_RECV => {
                    self.rx.returned();
                    self.received(c.result, w);
                }
                UD_SEND => {
                    self.tx_inflight = false;
                    if c.result < 0 {
                        self.gone = true;
                    } else {
                        self.out_sent += c.result as usize;
                        if self.out_sent == self.out.len() {
                            self.out.clear();
                            self.out_sent = 0;
                        }
                    }
                }
                u => panic!("seed {}: node {}: completion {u}", w.seed, self.index),
            }
        }
        if self.gone {
            return;
        }
        if !self.rx.inflight() {
            // SAFETY: the node's boxed buffers live until the simulation
            // ends (nodes are dropped after their port's last step); a
            // node receives no payloads.
            unsafe {
                self.rx.post(&mut self.port, UD_RECV, self.fd, |()| {
                    unreachable!("a node receives no payload")
                })
            };
        }
        if self.stall_until.is_some_and(|t| now < t) || self.tx_inflight {
            return;
        }
        if self.out.is_empty() {
            match self.closing {
                0 => self.next_frame(now, w, rng),
                1 => {
                    let msg = b"sim: the node service is shutting down";
                    let h = Header::error(proto::CONNECTION, Code::ShuttingDown, msg.len() as u32);
                    self.out.extend_from_slice(&h.encode());
                    self.out.extend_from_slice(msg);
                    self.closing = 2;
                }
                _ => {
                    self.port.shutdown(self.fd);
                    self.gone = true;
                    return;
                }
            }
        }
        if self.out_sent < self.out.len() {
            let rest = &self.out[self.out_sent..];
            // SAFETY: `out` is not touched until this send completes.
            if unsafe {
                self.port
                    .push_send(UD_SEND, self.fd, rest.as_ptr(), rest.len() as u32, false)
            } {
                self.tx_inflight = true;
                self.last_sent = now;
            }
        }
    }

    fn received(&mut self, res: i32, w: &mut World) {
        let (seed, i) = (w.seed, self.index);
        match self.rx.received(res, 0) {
            Ok(Received::Header(h)) if h.is_keepalive() => {
                if h.c & proto::ASK_HEARTBEATS != 0 {
                    self.asked = true;
                    self.notices |= h.c & proto::ASK_NODE_NOTICES != 0;
                    self.probed |= h.c & proto::PROBE != 0;
                }
            }
            Ok(Received::Header(h)) if h.kind == Kind::Grant => self.rx.expect_body(h),
            Ok(Received::Header(h)) => panic!("seed {seed}: node {i} got a {:?} frame", h.kind),
            Ok(Received::Body(h)) => {
                for k in 0..h.a as usize {
                    let e = GrantEntry::decode(self.rx.body(&h), k);
                    assert!(
                        w.placement.holds(i, e.sample),
                        "seed {seed}: node {i} granted sample {} it does not hold",
                        e.sample
                    );
                    assert!(
                        e.sample < w.catalog.len()
                            && e.len == w.catalog.sample(e.sample).len
                            && e.offset.is_multiple_of(ALIGN)
                            && e.offset + e.len as u64 <= w.ring_bytes,
                        "seed {seed}: node {i} got a grant outside the ring or the catalog: {e:?}"
                    );
                    assert!(
                        self.queue.iter().all(|q| q.grant != e.grant),
                        "seed {seed}: node {i} got grant {} twice",
                        e.grant
                    );
                    self.queue.push_back(e);
                }
            }
            Ok(Received::Payload { .. }) => unreachable!("a node receives no payload"),
            Err(RxError::BadHeader(e)) => {
                panic!("seed {seed}: node {i} got a frame it cannot decode: {e}")
            }
            // The consumer closed the connection, or it was reset.
            Err(_) => self.gone = true,
        }
    }

    /// The next frame: DATA (or a seeded ERROR or corruption) for the
    /// oldest grant, else a heartbeat when one is due.
    fn next_frame(&mut self, now: Instant, w: &mut World, rng: &mut Rng) {
        if self.notices && rng.ppm(self.notice_ppm) {
            let about = rng.below(w.placement.nodes as u64 + 2) as u32;
            let silent_ms = rng.below(20_000) as u32;
            self.out
                .extend_from_slice(&Header::node_down(about, silent_ms).encode());
            TOTALS[5].fetch_add(1, Ordering::Relaxed);
            return;
        }
        let Some(e) = self.queue.pop_front() else {
            let due = now.saturating_duration_since(self.last_sent) >= HEARTBEAT_EVERY;
            if self.asked && (due || self.probed) {
                self.probed = false;
                self.out
                    .extend_from_slice(&Header::heartbeat(IDLE_TIMEOUT).encode());
            }
            return;
        };
        if rng.ppm(self.rogue_ppm) {
            let (grant, offset, len) = match rng.below(3) {
                0 => (e.grant, e.offset + ALIGN, e.len),
                1 => (e.grant ^ 0x4000_0000, e.offset, e.len),
                _ => (e.grant, e.offset, e.len + 1),
            };
            self.out
                .extend_from_slice(&Header::data(grant, offset, len).encode());
            self.out.resize(self.out.len() + len as usize, 0xee);
            self.rogue = true;
            self.queue.push_front(e);
            return;
        }
        let bytes = &w.bytes[e.sample as usize];
        let last = w.placement.holder(e.sample, w.placement.replicas - 1);
        if rng.ppm(self.error_ppm) || (w.fail_all_but_last && last != self.index) {
            let code = [Code::ReadFailed, Code::NotHeld, Code::Busy][rng.below(3) as usize];
            let msg = format!("sim: node {} fails sample {}", self.index, e.sample);
            self.out
                .extend_from_slice(&Header::error(e.grant, code, msg.len() as u32).encode());
            self.out.extend_from_slice(msg.as_bytes());
            self.failed += 1;
            w.faulted.insert((self.index, e.sample));
            return;
        }
        let start = self.out.len();
        let cut = if e.len > 1 && rng.below(4) == 0 {
            1 + rng.below(e.len as u64 - 1) as u32
        } else {
            e.len
        };
        for (off, len) in [(0, cut), (cut, e.len - cut)] {
            if len == 0 {
                continue;
            }
            let h = Header::data(e.grant, e.offset + off as u64, len);
            self.out.extend_from_slice(&h.encode());
            self.out
                .extend_from_slice(&bytes[off as usize..(off + len) as usize]);
        }
        if rng.ppm(self.corrupt_ppm) {
            let at = start + proto::HEADER_BYTES + rng.below(cut as u64) as usize;
            self.out[at] ^= 0x5a;
            self.failed += 1;
            w.faulted.insert((self.index, e.sample));
        }
    }
}

/// One seed: see the module's documentation.
pub(crate) fn network_thread(seed: u64) {
    run(seed, Shape::Seeded);
}

/// What a run looks like.
#[derive(Clone, Copy, PartialEq)]
enum Shape {
    /// Everything drawn from the seed, faults included.
    Seeded,
    /// A placement of that many nodes and copies, where every node fails
    /// every sample but those it holds the last copy of (so each sample
    /// goes to its last replica), the source gone.
    ReplicasPast64(u32),
    /// That many nodes, one copy, one lane, no faults: the per-tick work
    /// of a wide cluster.
    Wide(u32),
}

/// Runs one seed; returns the steps it took and the connections the
/// thread looked at in them (`Thread::conn_visits`).
fn run(seed: u64, shape: Shape) -> (u64, u64) {
    let replicas_past_64 = match shape {
        Shape::ReplicasPast64(n) => Some(n),
        _ => None,
    };
    let mut rng = Rng(crate::hash::mix64(seed ^ 0x6e65_7477));
    let d = data();
    let source_kept = rng.below(2) == 0 && shape == Shape::Seeded;
    let catalog = Catalog::open(if source_kept {
        &d.with_source
    } else {
        &d.without_source
    })
    .expect("sim: open the catalog");
    let samples = catalog.len();
    let (nodes, replicas) = match shape {
        Shape::ReplicasPast64(n) => (n, n),
        Shape::Wide(n) => (n, 1),
        Shape::Seeded => {
            let n = 1 + rng.below(4) as u32;
            (n, 1 + rng.below(n as u64) as u32)
        }
    };
    let placement = match Placement::new(nodes, replicas) {
        Ok(p) => p,
        Err(e) => {
            assert!(
                replicas_past_64.is_some(),
                "seed {seed}: placement {nodes} x {replicas}: {e}"
            );
            // Refused with a named error: the tried mask cannot overflow.
            assert!(matches!(e, Error::InvalidConfig(_)), "{e}");
            return (0, 0);
        }
    };
    let world_size = 1 + rng.below(3) as u32;
    let rank = rng.below(world_size as u64) as u32;
    let ring_bytes = 4096 * (1 + rng.below(7));
    let geo = Geometry {
        ring_bytes,
        align: ALIGN,
    };
    // Some seeds run a node agent's shared thread (`loader/net/hub.rs`):
    // 2-3 lanes (rank rings) over the same connections, one of which may
    // stop mid-run and must leave while the others go on.
    let lanes_n = if shape == Shape::Seeded && rng.below(3) == 0 {
        2 + rng.below(2) as usize
    } else {
        1
    };
    let slot = (lanes_n > 1).then(|| {
        crate::loader::net::NetHub::new(1)
            .expect("sim: eventfd")
            .slot()
    });
    let catalog = Arc::new(catalog);
    let shuffle_seed = rng.below(1 << 20);
    let make_lane = |k: usize| {
        let sampler = Sampler::new(
            SamplerConfig::single(samples, shuffle_seed + k as u64)
                .rank_world((rank + k as u32) % world_size, world_size),
        )
        .expect("sim: sampler");
        let steps = sampler.per_rank();
        let end_g = 2 * steps;
        let net = match &slot {
            Some(slot) => NetShared::with_wake(geo.table_len() as usize, slot.wake()),
            None => NetShared::new(geo.table_len() as usize).expect("sim: eventfd"),
        };
        let sh = super::net_consumer(catalog.clone(), geo, sampler.clone(), steps, end_g, net);
        (sh, sampler, steps, end_g)
    };
    let built: Vec<_> = (0..lanes_n).map(make_lane).collect();
    let sh = built[0].0.clone();
    let faults = MemNetFaults {
        partial_send_ppm: rng.below(300_000) as u32,
        delay_ppm: rng.below(300_000) as u32,
    };
    // At least 256 bytes a step (20 ms on average): a node always beats
    // the minimum progress (node_timeout plus 1 s per MiB per grant),
    // below which the thread drops it by design.
    let buffer = 256 << rng.below(7);
    // As deep as the thread's io_uring (its submission queue never fills
    // there), or for some seeds shallower, so pushes are refused: room for
    // every connection's receive and the wake-up read at least (fewer
    // starve a connection's receive for good, as with any ring that small).
    let depth = if rng.below(4) == 0 {
        nodes as usize + 2 + rng.below(nodes as u64) as usize
    } else {
        (nodes as usize * 2 + 8).next_power_of_two()
    };
    let mut mem = MemNet::new(seed, 2 * nodes as usize, buffer as usize, depth, faults);
    let mut ctl = mem.port(1);
    let now = mem.now();
    let mut fds = Vec::new();
    let mut scripted = Vec::new();
    let faults_on = shape == Shape::Seeded;
    for i in 0..nodes {
        let (a, b) = mem.pair();
        let dead_at_start = faults_on && rng.below(8) == 0;
        fds.push((!dead_at_start).then_some(a));
        let (error_ppm, corrupt_ppm) = match rng.below(4) {
            _ if !faults_on => (0, 0),
            0 => (0, 0),
            1 => (rng.below(100_000), 0),
            2 => (0, rng.below(100_000)),
            _ => (rng.below(50_000), rng.below(50_000)),
        };
        scripted.push(Node {
            index: i,
            fd: b,
            port: mem.port(8),
            rx: FrameRx::new(proto::MAX_GRANT_ENTRIES * proto::GRANT_ENTRY_BYTES),
            asked: false,
            queue: VecDeque::new(),
            out: Vec::new(),
            out_sent: 0,
            tx_inflight: false,
            last_sent: now,
            gone: dead_at_start,
            stall_until: None,
            error_ppm,
            corrupt_ppm,
            failed: 0,
            rogue_ppm: if faults_on && rng.below(4) == 0 {
                rng.below(20_000)
            } else {
                0
            },
            rogue: false,
            closing: 0,
            notices: false,
            notice_ppm: if faults_on && rng.below(4) == 0 {
                rng.below(20_000)
            } else {
                0
            },
            probed: false,
            completions: [Completion::default(); 8],
        });
    }
    let max_grants = 1 + rng.below(8) as u32;
    let setup = NetSetup {
        cluster: Cluster { nodes: Vec::new() },
        token: vec![1],
        node_timeout: Duration::from_millis(1000 + rng.below(3000)),
        connect_timeout: Duration::from_secs(1),
        hello: Hello {
            catalog_identity: 0,
            rank,
            world: world_size,
            catalog_samples: samples,
            seed: 0,
            ring_addr: 0,
            ring_len: ring_bytes,
            rkey: 0,
            transport: proto::TRANSPORT_TCP,
        },
        placement: Some(placement),
        local_node: None,
        rdma: None,
        partial: None,
        notices: None,
    };
    let conns = sim_connections(&fds, placement, max_grants, 1 << 20, now);
    // Faults on the thread's own reads (the source fallback): short reads
    // (the bytes past the count scribbled over), EAGAIN/EINTR, held-back
    // completions; each transient, so the fallback must retry them.
    let read_faults = FaultConfig {
        seed: seed ^ 0x50c3,
        short_ppm: rng.below(300_000) as u32,
        delay_ppm: rng.below(200_000) as u32,
        ..Default::default()
    };
    let ring = Faulty::new(mem, read_faults, depth + 8)
        .with_transient_read_faults(rng.below(300_000) as u32);
    let setup = Arc::new(setup);
    let mut thread: Thread<SimRx, Faulty<MemNet>> =
        Thread::with_ring(sh.clone(), setup.clone(), conns, ring, false);
    // The shared thread's lanes: each one's channel closes once it left.
    let mut lefts: Vec<Option<crossbeam_channel::Receiver<()>>> = vec![None; lanes_n];
    if let Some(slot) = &slot {
        lefts[0] = Some(slot.sim_adopt(&mut thread));
        for k in 1..lanes_n {
            let left = slot.join(&setup, built[k].0.clone());
            lefts[k] = Some(left.expect("sim: a lane joins the running thread"));
        }
    }
    let pools = thread.sim_view().2;
    // One lane (not the only one) stops at a seeded step: it must leave
    // (its grants over) within a bounded number of steps, the others
    // unaffected.
    let lane_stop_at = (lanes_n > 1 && rng.below(2) == 0)
        .then(|| (rng.below(lanes_n as u64) as usize, rng.below(3000)));
    // Seeded faults at seeded steps: a node reset, a node stalled, the
    // errors lock poisoned.
    let kill_at = (faults_on && rng.below(3) == 0).then(|| {
        (
            rng.below(nodes as u64) as u32,
            rng.below(3000),
            rng.below(2) == 0,
        )
    });
    let stall_at = (faults_on && rng.below(3) == 0).then(|| {
        (
            rng.below(nodes as u64) as u32,
            rng.below(3000),
            Duration::from_millis(300 + rng.below(3700)),
        )
    });
    let poison_at = (faults_on && rng.below(16) == 0).then(|| rng.below(2000));

    let mut w = World {
        seed,
        placement,
        catalog: sh.input.catalog(),
        bytes: &d.bytes,
        ring_bytes,
        faulted: HashSet::new(),
        fail_all_but_last: replicas_past_64.is_some(),
    };
    // Each lane's consumer: its cursor, the next sample it takes, what it
    // took, what it saw published; `stopped`: the step its loader stopped.
    struct Consumer {
        sh: Arc<Shared>,
        cursor: Cursor,
        next: Placed,
        end_g: u64,
        taken_ok: u64,
        seen: HashSet<u64>,
        stopped: Option<u64>,
    }
    let mut consumers: Vec<Consumer> = built
        .iter()
        .map(|(sh, sampler, steps, end_g)| {
            let mut cursor = Cursor::new(
                sampler.clone(),
                geo,
                Position { epoch: 0, index: 0 },
                *steps,
            );
            let next = cursor.next(w.catalog);
            Consumer {
                sh: sh.clone(),
                cursor,
                next,
                end_g: *end_g,
                taken_ok: 0,
                seen: HashSet::new(),
                stopped: None,
            }
        })
        .collect();
    drop(built);
    let check_bytes = |sh: &Shared, p: &Placed, when: &str| {
        // SAFETY: a published sample's slot is not written until the
        // consumer releases it (flow control), and the simulation runs
        // the thread on this thread: nothing writes it now.
        let got = unsafe {
            std::slice::from_raw_parts(
                sh.ring.as_mut_ptr().add(p.phys(&geo) as usize),
                p.len as usize,
            )
        };
        let want = &d.bytes[p.id as usize];
        if let Some(k) = (0..want.len()).find(|&k| got[k] != want[k]) {
            panic!(
                "seed {seed}: sample g={} (id {}, {} bytes) {when}: byte {k} is {:#04x}, expected {:#04x}",
                p.g, p.id, p.len, got[k], want[k]
            );
        }
    };
    // A stopped lane leaves once its grants are over: the node timeout
    // (at most 4 s) and a stall (at most 4 s) at 20 ms a step on average.
    const LEAVE_STEPS: u64 = 2_000;
    const MAX_STEPS: u64 = 200_000;
    let mut step = 0u64;
    while consumers
        .iter()
        .any(|c| c.stopped.is_none() && c.next.g < c.end_g)
    {
        step += 1;
        let waiting = consumers
            .iter()
            .find(|c| c.stopped.is_none() && c.next.g < c.end_g)
            .expect("one is waiting");
        assert!(
            step < MAX_STEPS,
            "seed {seed}: no progress after {MAX_STEPS} steps: a consumer waits for g={} (sample {}) of {}",
            waiting.next.g,
            waiting.next.id,
            waiting.end_g
        );
        assert!(thread.tick(), "seed {seed}: the thread ended unasked");
        for n in scripted.iter_mut() {
            n.step(&mut w, &mut rng);
        }
        if let Some((i, at, graceful)) = kill_at {
            let n = &mut scripted[i as usize];
            if at == step && !n.gone {
                if graceful {
                    n.closing = 1;
                } else {
                    ctl.reset(n.fd);
                    n.gone = true;
                }
            }
        }
        if let Some((i, at, len)) = stall_at {
            if at == step {
                scripted[i as usize].stall_until = Some(ctl.now() + len);
            }
        }
        if poison_at == Some(step) {
            let sh2 = sh.clone();
            let _ = std::thread::spawn(move || {
                let _held = sh2.errors.lock();
                panic!("sim: a poller panics holding the errors lock (seeded)");
            })
            .join();
        }
        if let Some((k, at)) = lane_stop_at {
            if at == step {
                // As `Run::stop` does: the flag, then the thread's wake-up.
                let c = &mut consumers[k];
                c.sh.stop.store(true, Ordering::Release);
                c.sh.net.as_ref().expect("cluster").wake.notify();
                c.stopped = Some(step);
            }
        }
        for (k, c) in consumers.iter_mut().enumerate() {
            if let Some(at) = c.stopped {
                let left = lefts[k].as_ref().expect("a shared thread's lane");
                let gone = matches!(
                    left.try_recv(),
                    Err(crossbeam_channel::TryRecvError::Disconnected)
                );
                assert!(
                    gone || step - at < LEAVE_STEPS,
                    "seed {seed}: lane {k} stopped at step {at} and has not left after {LEAVE_STEPS} steps"
                );
                continue;
            }
            // Every sample published in the window is already byte-exact.
            let mut look = c.cursor.clone();
            let mut p = c.next;
            while p.g < c.end_g && p.v_end <= c.next.v + ring_bytes {
                if !c.seen.contains(&p.g) && c.sh.sim_state(p.g) == Some(CODE_OK) {
                    check_bytes(&c.sh, &p, "when published");
                    c.seen.insert(p.g);
                }
                p = look.next(w.catalog);
            }
            // The consumer.
            if c.next.g < c.end_g && rng.below(4) != 0 {
                if let Some(code) = c.sh.sim_state(c.next.g) {
                    match code {
                        CODE_OK => {
                            check_bytes(&c.sh, &c.next, "when taken");
                            c.taken_ok += 1;
                        }
                        CODE_ERROR => check_failed(&w, &c.sh, &c.next, &scripted, source_kept),
                        code => panic!(
                            "seed {seed}: sample g={} published with code {code}",
                            c.next.g
                        ),
                    }
                    c.seen.remove(&c.next.g);
                    c.next = c.cursor.next(w.catalog);
                    c.sh.released_v.store(c.next.v, Ordering::SeqCst);
                    c.sh.released_g.store(c.next.g, Ordering::SeqCst);
                    c.sh.net.as_ref().expect("cluster").released();
                }
            }
        }
        let (ring, _, now_pools) = thread.sim_view();
        ring.inner().check_pools();
        assert_eq!(now_pools, pools, "seed {seed}: a pool of the thread grew");
        // Now and then the thread is not run for 1-3 s (descheduled, the
        // process stopped): its silence clocks must not blame the nodes.
        let pause = if rng.below(2000) == 0 {
            1001 + rng.below(2000)
        } else {
            0
        };
        ctl.advance(Duration::from_millis(rng.below(40) + pause));
    }
    for c in consumers.iter().filter(|c| c.stopped.is_none()) {
        let net = c.sh.net.as_ref().expect("cluster");
        for (t, v) in TOTALS.iter().zip([
            step,
            c.taken_ok,
            c.end_g - c.taken_ok,
            net.failovers.load(Ordering::Relaxed),
            net.source_reads.load(Ordering::Relaxed),
        ]) {
            t.fetch_add(v, Ordering::Relaxed);
        }
        assert_eq!(
            c.sh.published_ok.load(Ordering::Relaxed),
            c.taken_ok,
            "seed {seed}: samples published OK that the consumer did not take (published twice, or past the end)"
        );
    }
    for (n, fd) in scripted.iter().zip(&fds) {
        let dropped = thread.sim_dropped(n.index as usize);
        if dropped.is_some_and(|d| d.contains("reported it down")) {
            TOTALS[6].fetch_add(1, Ordering::Relaxed);
        }
        assert!(
            !n.rogue || dropped.is_some(),
            "seed {seed}: node {} broke the protocol and is still connected",
            n.index
        );
        // A node the simulation never hurt (no reset, stall, goodbye or
        // protocol breach; failed grants only demote) keeps its connection
        // through everything else, pauses of the thread included.
        let hurt = fd.is_none()
            || n.rogue
            || n.closing > 0
            || n.stall_until.is_some()
            || kill_at.is_some_and(|(i, at, _)| i == n.index && at <= step);
        assert!(
            hurt || dropped.is_none(),
            "seed {seed}: node {} was dropped by the thread though it never failed: {}",
            n.index,
            dropped.unwrap_or_default()
        );
    }
    // Teardown: stop (a shared thread ends once its last lane left), and
    // the thread ends with nothing in flight.
    for c in &consumers {
        c.sh.stop.store(true, Ordering::Release);
        c.sh.net.as_ref().expect("cluster").wake.notify();
    }
    let mut steps_left = 10_000;
    while thread.tick() {
        for n in scripted.iter_mut() {
            n.step(&mut w, &mut rng);
        }
        ctl.advance(Duration::from_millis(5));
        steps_left -= 1;
        assert!(
            steps_left > 0,
            "seed {seed}: the thread does not end when stopped"
        );
    }
    for c in consumers.iter().filter(|c| c.stopped.is_none()) {
        let failed = c.sh.errors.lock().unwrap_or_else(|e| e.into_inner()).len() as u64;
        assert_eq!(
            failed,
            c.end_g - c.taken_ok,
            "seed {seed}: errors recorded for samples not failed"
        );
    }
    let visits = thread.conn_visits;
    let (ring, busy, _) = thread.sim_view();
    assert!(
        !busy,
        "seed {seed}: the thread ended with its memory in flight"
    );
    assert_eq!(
        thread.sim_source_reads(),
        0,
        "seed {seed}: the thread ended with source reads unfinished"
    );
    assert_eq!(
        ring.in_flight(),
        0,
        "seed {seed}: operations in flight at teardown"
    );
    // Every lane of a shared thread is let go with the thread at last.
    drop(thread);
    for (k, left) in lefts.iter().enumerate() {
        if let Some(left) = left {
            assert!(
                matches!(
                    left.try_recv(),
                    Err(crossbeam_channel::TryRecvError::Disconnected)
                ),
                "seed {seed}: lane {k} still held after the thread ended"
            );
        }
    }
    (step, visits)
}

/// Sample `p` was published as failed: it must carry `SampleUnavailable`,
/// and no holder could have served it (each is gone, failed this sample on
/// purpose, or failed so often it may be demoted), nor the source.
fn check_failed(w: &World, sh: &Shared, p: &Placed, nodes: &[Node], source_kept: bool) {
    let seed = w.seed;
    let errors = sh.errors.lock().unwrap_or_else(|e| e.into_inner());
    let e = errors
        .iter()
        .find(|(g, _)| *g == p.g)
        .map(|(_, e)| e)
        .unwrap_or_else(|| panic!("seed {seed}: sample g={} failed without an error", p.g));
    assert!(
        matches!(e, Error::SampleUnavailable { sample, .. } if *sample == p.id),
        "seed {seed}: sample g={} (id {}) failed with {e}",
        p.g,
        p.id
    );
    assert!(
        !source_kept,
        "seed {seed}: sample {} failed while its source is there: {e}",
        p.id
    );
    for r in 0..w.placement.replicas {
        let h = w.placement.holder(p.id, r);
        let n = &nodes[h as usize];
        let excused = n.gone
            || w.faulted.contains(&(h, p.id))
            || n.failed >= crate::loader::net::DEMOTE_AFTER_ERRORS
            || n.stall_until.is_some()
            || n.rogue
            || n.closing > 0;
        assert!(
            excused,
            "seed {seed}: sample {} failed while node {h}, a live holder that never failed it, could serve it: {e}",
            p.id
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The network thread over many seeds (bounded in time; see
    /// `sim/mod.rs` for replaying one).
    #[test]
    fn sim_network_thread_against_scripted_nodes() {
        let ran = super::super::run_seeds(
            "sim_network_thread",
            1000,
            Duration::from_secs(60),
            network_thread,
        );
        let t: Vec<u64> = TOTALS.iter().map(|t| t.load(Ordering::Relaxed)).collect();
        eprintln!(
            "sim_network_thread: {} steps, {} samples delivered, {} failed (named), {} failovers, {} read from the source, {} node-down notices ({} nodes shut on one)",
            t[0], t[1], t[2], t[3], t[4], t[5], t[6]
        );
        assert!(ran > 0);
    }

    /// 65 nodes holding every sample, all but the last dead from the start:
    /// each sample must reach its 65th replica. The tried mask is a u64
    /// (bit r), so the placement refuses more than 64 replicas with a
    /// named error; without that cap the mask's `1 << 64` overflows.
    #[test]
    fn sim_network_thread_with_65_replicas() {
        run(1, Shape::ReplicasPast64(65));
        // At the cap, every sample goes through 63 failovers to its last
        // copy (bit 63 of the mask).
        run(2, Shape::ReplicasPast64(64));
    }

    /// A tick looks at the connections that have something to do, not at
    /// every node. Seed 3 (deterministic): 1.1 connections looked at per
    /// step at 4 nodes, 14.9 at 192 (12.6 before the two-speed sweep,
    /// whose busy list is walked besides the window), which is the frames that came and
    /// went (each idle node's heartbeat every 5 s and the thread's
    /// keepalive every 15 s; with heartbeats every 250 ms and keepalives
    /// every second it was 27.2, and 15.3 before the sweep looked at a
    /// window of the connections instead of all); a look at every node each
    /// tick made it at least 192.
    #[test]
    fn sim_network_thread_tick_work_follows_the_frames_not_the_node_count() {
        let per_step = |nodes: u32| {
            let (steps, visits) = run(3, Shape::Wide(nodes));
            assert!(steps > 0);
            visits as f64 / steps as f64
        };
        let (few, many) = (per_step(4), per_step(192));
        eprintln!("connections looked at per step: {few:.1} at 4 nodes, {many:.1} at 192");
        assert!(
            many < 48.0,
            "{many:.1} connections a step at 192 nodes ({few:.1} at 4)"
        );
    }
}
