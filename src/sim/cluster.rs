//! The cluster under the simulator: 2–3 node services and 1–3 ranks in one
//! process, one seed, virtual time, on one in-memory network ([`MemNet`]).
//! Each node runs 1–2 real serve pollers (`SimNode`, as in `serve.rs`)
//! over its own part of one multi-node preloaded space (preloaded with
//! `nodes` = 2 or 3 and 1 to `nodes` copies, so replicas exist), its
//! extents loaded as that node's MemNet files (`with_file_base`), its reads
//! through [`Faulty`]; each rank runs the real consumer network thread
//! (`Thread::with_ring`, as in `net.rs`) over that space's catalog and
//! placement, connected to a poller of every node (the serve side's
//! `connect`, the net side's `sim_connections`), and an in-order consumer
//! that takes and releases its samples, two epochs long. Every step runs
//! the ranks' threads, the nodes' pollers and the consumers in a seeded
//! order; the clock moves a few ms a step.
//!
//! Faults (seeded): partial sends and held-back completions (MemNet),
//! sends cut short and delayed completions on every loop's ring
//! ([`Faulty`]'s socket faults); on
//! the nodes, read EIO (the node answers ERROR, the rank fails over to a
//! replica, else names the sample unavailable: the source tree is gone),
//! short reads, EAGAIN and EINTR (the node retries them), delayed reads;
//! the loss of one rank–node connection (`MemNet::reset`); a node stopping
//! mid-run (its service's stop flag: it closes every connection); a node
//! full for some ranks (refused at HELLO, dead from the start for them).
//!
//! Checked after every step: the nodes' bookkeeping (`SimNode::check`: no
//! pool grew, no staging slot freed, reused or read into under an
//! operation in flight, slots counted by their connection); the ranks'
//! pools never grow; every sample a rank publishes is byte-exact against
//! the source bytes (when first seen ready and when taken), taken in the
//! rank's order, exactly once per epoch (published OK = taken OK), or
//! fails with `SampleUnavailable` only when no holder could serve it (each
//! stopped, its connection lost, it refused the rank, or it injects EIO),
//! never naming `NotHeld` (a grant to a node that does not hold the
//! sample); a node without EIO answers no grant with ERROR (so no grant
//! reached it for a sample it does not hold, and a transient read failure
//! was retried); no node saw a rank break the protocol; a node never hurt
//! is never dropped by a rank. At teardown every rank's thread and
//! every poller finishes with nothing in flight, every connection reaped.

use crate::sim::Rng;
use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use super::run_seeds;
use crate::dataset::{Catalog, Placement, PreloadOptions, SourceSpec, Space};
use crate::error::Error;
use crate::loader::net::{sim_connections, NetSetup, NetShared, SimRx, Thread};
use crate::loader::schedule::{Cursor, Geometry, Placed};
use crate::loader::{Shared, CODE_ERROR, CODE_OK};
use crate::ring::memnet::{MemNet, MemNetFaults};
use crate::ring::NetFaults;
use crate::ring::{FaultConfig, Faulty, IoBackend};
use crate::sampler::{Position, Sampler, SamplerConfig};
use crate::transport::proto::{self, Hello};
use crate::transport::serve::sim_node::SimNode;
use crate::transport::{Cluster, ServeConfig};

const FILES: u64 = 48;
const ALIGN: u64 = 512;

/// One preloaded layout: `nodes` nodes, `copies` copies, each node's
/// space directory and extents' bytes.
struct Layout {
    nodes: u32,
    copies: u32,
    dirs: Vec<PathBuf>,
    extents: Vec<Vec<Vec<u8>>>,
}

/// Every layout, over one catalog, and each sample's source bytes (the
/// source tree itself is removed: a sample no node serves is a named
/// error).
struct World {
    layouts: Vec<Layout>,
    bytes: Vec<Vec<u8>>,
}

fn world() -> &'static World {
    static W: OnceLock<World> = OnceLock::new();
    W.get_or_init(|| {
        // Kept for the process (a static is never dropped): a few MB.
        let tmp = Box::leak(Box::new(tempfile::tempdir().expect("tempdir")));
        let src = tmp.path().join("src");
        std::fs::create_dir_all(&src).unwrap();
        for i in 0..FILES {
            // Around the alignment and the chunks; at least one byte (DATA
            // carries at least one).
            let n = match i {
                0 => 1,
                1 => 511,
                2 => 512,
                3 => 513,
                4 => 4097,
                _ => 1 + crate::hash::mix64(i ^ 0xc1) % 6000,
            };
            let bytes: Vec<u8> = (0..n)
                .map(|k| (crate::hash::mix64(i << 32 | k) >> 13) as u8)
                .collect();
            std::fs::write(src.join(format!("c{i:03}.bin")), bytes).unwrap();
        }
        let spec = SourceSpec::parse(&format!("dir:{}", src.display())).unwrap();
        let mut layouts = Vec::new();
        let mut catalog: Option<PathBuf> = None;
        for (nodes, copies) in [(2, 1), (2, 2), (3, 1), (3, 2), (3, 3)] {
            let mut dirs = Vec::new();
            let mut extents = Vec::new();
            for n in 0..nodes {
                let dir = tmp.path().join(format!("space-{nodes}x{copies}-{n}"));
                // One catalog for all (the first preload builds it).
                let opts = PreloadOptions::default()
                    .source(Some(spec.clone()))
                    .catalog(catalog.clone())
                    .placement(Placement::new(nodes, copies).unwrap())
                    .node_index(n)
                    .align_bytes(ALIGN as u32)
                    .extent_bytes(32 << 10)
                    .threads(1)
                    .check_free_space(false);
                crate::dataset::preload(&dir, &opts).expect("preload the cluster's space");
                let space = Space::open(&dir).unwrap();
                catalog.get_or_insert(dir.join(crate::dataset::space::files::CATALOG));
                extents.push(
                    (0..space.extent_lens().len() as u32)
                        .map(|i| std::fs::read(space.extent_path(i)).unwrap())
                        .collect(),
                );
                dirs.push(dir);
            }
            layouts.push(Layout {
                nodes,
                copies,
                dirs,
                extents,
            });
        }
        let cat = Catalog::open(catalog.as_ref().unwrap()).unwrap();
        let bytes = (0..cat.len())
            .map(|id| {
                let s = cat.sample(id);
                let f = std::fs::read(cat.file_path(s.file)).unwrap();
                f[s.offset as usize..s.offset as usize + s.len as usize].to_vec()
            })
            .collect();
        std::fs::remove_dir_all(&src).unwrap();
        World { layouts, bytes }
    })
}

/// What all seeds of this process did: steps, samples taken, samples
/// failed (named), failovers, node read retries, node ERRORs.
static TOTALS: [std::sync::atomic::AtomicU64; 6] =
    [const { std::sync::atomic::AtomicU64::new(0) }; 6];

type NodeRing = Faulty<MemNet>;

/// One rank: its real network thread, and the consumer's place.
struct Rank {
    sh: Arc<Shared>,
    thread: Thread<SimRx, Faulty<MemNet>>,
    pools: [usize; 5],
    geo: Geometry,
    end_g: u64,
    cursor: Cursor,
    next: Placed,
    taken_ok: u64,
    seen: HashSet<u64>,
    /// Per node: its connection's node-side descriptor (None: refused).
    node_fd: Vec<Option<i32>>,
    /// Per node: the simulation lost this rank's connection to it.
    reset: Vec<bool>,
    running: bool,
}

impl Rank {
    fn slot(&self, p: &Placed) -> &[u8] {
        // SAFETY: a published sample's slot is not written until the
        // consumer releases it (flow control), and the thread runs on this
        // thread between the consumer's looks: nothing writes it now.
        unsafe {
            std::slice::from_raw_parts(
                self.sh.ring.as_mut_ptr().add(p.phys(&self.geo) as usize),
                p.len as usize,
            )
        }
    }

    fn check_bytes(&self, seed: u64, r: usize, p: &Placed, bytes: &[Vec<u8>], when: &str) {
        let got = self.slot(p);
        let want = &bytes[p.id as usize];
        if let Some(k) = (0..want.len()).find(|&k| got[k] != want[k]) {
            panic!(
                "seed {seed}: rank {r}: sample g={} (id {}, {} bytes) {when}: byte {k} is {:#04x}, expected {:#04x}",
                p.g, p.id, p.len, got[k], want[k]
            );
        }
    }
}

#[derive(Clone, Copy)]
enum Actor {
    Rank(usize),
    Consumer(usize),
    Poller(usize, usize),
}

/// One seed: see the module's documentation.
pub(crate) fn cluster(seed: u64) {
    let w = world();
    let mut rng = Rng(crate::hash::mix64(seed ^ 0xc105_7e55));
    let lay = &w.layouts[rng.below(w.layouts.len() as u64) as usize];
    let nnodes = lay.nodes as usize;
    let nranks = 1 + rng.below(3) as usize;
    let placement = Placement::new(lay.nodes, lay.copies).unwrap();
    let faults = MemNetFaults {
        partial_send_ppm: rng.below(400_000) as u32,
        delay_ppm: rng.below(300_000) as u32,
    };
    // At least 512 bytes a step: every node beats the ranks' minimum
    // progress (below which a rank drops a node by design).
    let buffer = 512usize << rng.below(6);
    let mut net = MemNet::new(seed, 2 * nranks * nnodes, buffer, 1, faults);
    // Sends cut short (a send returns part of its length), on both
    // sides, and the consumers' look-ahead receives (a `recvmsg` without
    // MSG_WAITALL may return any count). (Not the MSG_WAITALL receives,
    // which io_uring completes short only at the end of the stream or an
    // error, as a short one is taken; nor EAGAIN/EINTR, which io_uring
    // retries itself for a socket operation.)
    let net_faults = NetFaults {
        short_send_ppm: rng.below(300_000) as u32,
        short_recvmsg_ppm: rng.below(300_000) as u32,
        ..Default::default()
    };

    // The nodes: one service each, 1-2 pollers, one settings draw for all
    // (the ranks' connections take one WELCOME's limits).
    let chunk = [512u32, 1024, 1536, 4096, 8192][rng.below(5) as usize];
    let max_grants = 1 + rng.below(16) as u32;
    let staging_chunks = 1 + rng.below(8);
    let stall_ms = 1500 + rng.below(2000);
    let mut nodes = Vec::new();
    let mut eio = Vec::new();
    for (n, dir) in lay.dirs.iter().enumerate() {
        let mut cfg = ServeConfig::new(dir, &format!("sim:{n}"), b"token");
        cfg.chunk_bytes = chunk;
        cfg.staging_bytes = chunk as u64 * staging_chunks;
        cfg.max_grants = max_grants;
        // Mostly room for every rank; else a rank may find the node full
        // (refused at HELLO: dead from the start for that rank).
        cfg.max_conns_per_poller = if rng.chance(4) {
            1 + rng.below(nranks as u64) as usize
        } else {
            nranks
        };
        cfg.stall_timeout = Duration::from_millis(stall_ms);
        cfg.idle_timeout = Duration::from_millis(6000 + rng.below(4000));
        let (_, cq, _) = cfg.ring_entries();
        let base = {
            let mut first = None;
            for e in &lay.extents[n] {
                let i = net.add_file(e.clone());
                first.get_or_insert(i);
            }
            first.unwrap_or(0)
        };
        let eio_ppm = if rng.chance(3) {
            rng.below(40_000) as u32
        } else {
            0
        };
        eio.push(eio_ppm);
        let short_ppm = rng.below(150_000) as u32;
        let transient_ppm = rng.below(150_000) as u32;
        let delay_ppm = rng.below(200_000) as u32;
        let slots = cfg.slots();
        let pollers = 1 + rng.below(2) as usize;
        let depth = slots + 2 * cfg.max_conns_per_poller + 8;
        let rings: Vec<NodeRing> = (0..pollers)
            .map(|p| {
                let fc = FaultConfig {
                    seed: seed ^ (n as u64) << 40 ^ (p as u64) << 48,
                    eio_ppm,
                    short_ppm,
                    delay_ppm,
                    ..Default::default()
                };
                let port = net
                    .port(depth)
                    .with_cq_limit(cq as usize)
                    .with_file_base(base);
                Faulty::new(port, fc, depth)
                    .with_transient_read_faults(transient_ppm)
                    .with_net_faults(net_faults)
            })
            .collect();
        nodes.push((SimNode::new(Space::open(dir).unwrap(), cfg, rings), pollers));
    }

    // The ranks: the real network thread each, connected to a poller of
    // every node.
    let catalog_path = lay.dirs[0].join(crate::dataset::space::files::CATALOG);
    let identity = Catalog::open(&catalog_path).unwrap().identity();
    let sampler_seed = rng.below(1 << 20);
    let ring_bytes = 8192 * (1 + rng.below(6));
    let node_timeout = Duration::from_millis(2000 + rng.below(3000));
    let mut ranks = Vec::new();
    for r in 0..nranks {
        let catalog = Catalog::open(&catalog_path).unwrap();
        let samples = catalog.len();
        let sampler = Sampler::new(
            SamplerConfig::single(samples, sampler_seed).rank_world(r as u32, nranks as u32),
        )
        .expect("sim: sampler");
        let steps = sampler.per_rank();
        let end_g = 2 * steps;
        let geo = Geometry {
            ring_bytes,
            align: ALIGN,
        };
        let netsh = NetShared::new(geo.table_len() as usize).expect("sim: eventfd");
        let sh = super::net_consumer(Arc::new(catalog), geo, sampler.clone(), steps, end_g, netsh);
        let hello = Hello {
            catalog_identity: identity,
            rank: r as u32,
            world: nranks as u32,
            catalog_samples: samples,
            seed: 0,
            ring_addr: 0,
            ring_len: ring_bytes,
            rkey: 0,
            transport: proto::TRANSPORT_TCP,
        };
        let mut fds = Vec::new();
        let mut node_fd = Vec::new();
        for (node, pollers) in &nodes {
            let (a, b) = net.pair();
            // The least loaded poller with room, as the acceptor picks.
            let p = (0..*pollers).min_by_key(|&p| node.load(p)).unwrap();
            let ok = node.connect(p, a, hello);
            fds.push(ok.then_some(b));
            node_fd.push(ok.then_some(a));
        }
        let setup = NetSetup {
            cluster: Cluster { nodes: Vec::new() },
            token: vec![1],
            node_timeout,
            connect_timeout: Duration::from_secs(1),
            hello,
            placement: Some(placement),
            local_node: None,
            rdma: None,
            partial: None,
            notices: None,
        };
        let conns = sim_connections(&fds, placement, max_grants, chunk, net.now());
        let depth = (nnodes * 2 + 8).next_power_of_two();
        let fc = FaultConfig {
            seed: seed ^ 0x7a4c ^ (r as u64) << 40,
            delay_ppm: rng.below(200_000) as u32,
            ..Default::default()
        };
        let port = Faulty::new(net.port(depth), fc, depth).with_net_faults(net_faults);
        let thread = Thread::with_ring(sh.clone(), Arc::new(setup), conns, port, false);
        let pools = thread.sim_view().2;
        let mut cursor = Cursor::new(sampler, geo, Position { epoch: 0, index: 0 }, steps);
        let next = cursor.next(sh.input.catalog());
        ranks.push(Rank {
            sh,
            thread,
            pools,
            geo,
            end_g,
            cursor,
            next,
            taken_ok: 0,
            seen: HashSet::new(),
            node_fd,
            reset: vec![false; nnodes],
            running: true,
        });
    }

    // Seeded faults at seeded steps: a rank's connection to a node lost, a
    // node stopped.
    let reset_at = rng.chance(3).then(|| {
        (
            rng.below(nranks as u64) as usize,
            rng.below(nnodes as u64) as usize,
            rng.below(400),
        )
    });
    // A node stops mid-run, or (a sixth of those) at the first step, before
    // its pollers adopted the consumers handed over to them.
    let stop_at = rng.chance(4).then(|| {
        let n = rng.below(nnodes as u64) as usize;
        (n, if rng.chance(6) { 1 } else { rng.below(400) })
    });
    let mut stopped = vec![false; nnodes];

    let mut order: Vec<Actor> = Vec::new();
    for r in 0..nranks {
        order.push(Actor::Rank(r));
        order.push(Actor::Consumer(r));
    }
    for (n, (_, pollers)) in nodes.iter().enumerate() {
        for p in 0..*pollers {
            order.push(Actor::Poller(n, p));
        }
    }
    const MAX_STEPS: u64 = 300_000;
    let mut step = 0u64;
    while ranks.iter().any(|k| k.next.g < k.end_g) {
        step += 1;
        assert!(
            step < MAX_STEPS,
            "seed {seed}: no progress after {step} steps: ranks at {:?}; {}",
            ranks
                .iter()
                .map(|k| (k.next.g, k.end_g))
                .collect::<Vec<_>>(),
            nodes
                .iter()
                .map(|(n, pollers)| (0..*pollers)
                    .map(|p| n.describe(p))
                    .collect::<Vec<_>>()
                    .join(" | "))
                .collect::<Vec<_>>()
                .join(" || ")
        );
        if let Some((r, n, at)) = reset_at {
            if at == step {
                if let Some(fd) = ranks[r].node_fd[n] {
                    net.reset(fd);
                    ranks[r].reset[n] = true;
                }
            }
        }
        if let Some((n, at)) = stop_at {
            if at == step {
                nodes[n].0.stop();
                stopped[n] = true;
            }
        }
        for k in (1..order.len()).rev() {
            order.swap(k, rng.below(k as u64 + 1) as usize);
        }
        for &a in &order {
            match a {
                Actor::Rank(r) => {
                    let k = &mut ranks[r];
                    assert!(
                        k.thread.tick(),
                        "seed {seed}: rank {r}'s thread ended unasked"
                    );
                    let (ring, _, pools) = k.thread.sim_view();
                    ring.inner().check_pools();
                    assert_eq!(pools, k.pools, "seed {seed}: rank {r}: a pool grew");
                }
                Actor::Poller(n, p) => {
                    let node = &mut nodes[n].0;
                    node.tick(p);
                    node.check(p, |f| node.ring(p).inner().each_pending_buffer(f));
                }
                Actor::Consumer(r) => {
                    if rng.below(4) != 0 {
                        consume(seed, r, &mut ranks[r], w, &stopped, &eio, placement);
                    }
                }
            }
        }
        // Every sample published in a rank's window is already byte-exact.
        for (r, k) in ranks.iter_mut().enumerate() {
            let mut look = k.cursor.clone();
            let mut p = k.next;
            let cat = k.sh.input.catalog();
            while p.g < k.end_g && p.v_end <= k.next.v + ring_bytes {
                if !k.seen.contains(&p.g) && k.sh.sim_state(p.g) == Some(CODE_OK) {
                    k.check_bytes(seed, r, &p, &w.bytes, "when published");
                    k.seen.insert(p.g);
                }
                p = look.next(cat);
            }
        }
        net.advance(Duration::from_millis(rng.below(12)));
    }

    // Every rank took its two epochs; what each node and rank saw.
    for (r, k) in ranks.iter().enumerate() {
        assert_eq!(
            k.sh.published_ok.load(Ordering::Relaxed),
            k.taken_ok,
            "seed {seed}: rank {r}: samples published OK that were not taken (twice, or past the end)"
        );
        for (n, &node_stopped) in stopped.iter().enumerate() {
            let hurt = node_stopped || k.reset[n] || k.node_fd[n].is_none();
            let dropped = k.thread.sim_dropped(n);
            assert!(
                hurt || dropped.is_none(),
                "seed {seed}: rank {r} dropped node {n}, which never failed: {}",
                dropped.unwrap_or_default()
            );
        }
    }
    for (n, (node, _)) in nodes.iter().enumerate() {
        let violations = node.stats().violations.load(Ordering::Relaxed);
        assert_eq!(
            violations, 0,
            "seed {seed}: node {n} dropped a rank for breaking the protocol"
        );
        let errors = node.stats().errors.load(Ordering::Relaxed);
        assert!(
            eio[n] > 0 || errors == 0,
            "seed {seed}: node {n} answered {errors} grants with ERROR without a read failure \
             (a grant for a sample it does not hold?)"
        );
    }

    // Teardown: the ranks stop (their threads close every connection),
    // then the nodes; everything ends with nothing in flight.
    for k in &ranks {
        k.sh.stop.store(true, Ordering::Release);
    }
    let mut left = 20_000;
    while ranks.iter().any(|k| k.running) {
        for k in ranks.iter_mut().filter(|k| k.running) {
            k.running = k.thread.tick();
        }
        for (node, pollers) in nodes.iter_mut() {
            for p in 0..*pollers {
                node.tick(p);
                node.check(p, |f| node.ring(p).inner().each_pending_buffer(f));
            }
        }
        net.advance(Duration::from_millis(5));
        left -= 1;
        assert!(
            left > 0,
            "seed {seed}: a rank's thread does not end when stopped"
        );
    }
    for (node, _) in &nodes {
        node.stop();
    }
    let mut left = 20_000;
    loop {
        let mut all = true;
        for (node, pollers) in nodes.iter_mut() {
            for p in 0..*pollers {
                all &= node.tick(p);
                node.check(p, |f| node.ring(p).inner().each_pending_buffer(f));
            }
        }
        if all {
            break;
        }
        net.advance(Duration::from_millis(5));
        left -= 1;
        assert!(left > 0, "seed {seed}: a node does not finish when stopped");
    }
    for (node, _) in &nodes {
        node.check_teardown();
    }
    let mut failed_all = 0;
    for (r, k) in ranks.iter().enumerate() {
        let failed = k.sh.errors.lock().unwrap_or_else(|e| e.into_inner()).len() as u64;
        assert_eq!(
            failed,
            k.end_g - k.taken_ok,
            "seed {seed}: rank {r}: errors recorded for samples not failed"
        );
        failed_all += failed;
        let (ring, busy, _) = k.thread.sim_view();
        assert!(
            !busy,
            "seed {seed}: rank {r} ended with its memory in flight"
        );
        assert_eq!(
            ring.in_flight(),
            0,
            "seed {seed}: rank {r}: operations in flight"
        );
        ring.inner().check_pools();
    }
    let net_sum = |f: fn(&NetShared) -> u64| -> u64 {
        ranks
            .iter()
            .map(|k| f(k.sh.net.as_ref().expect("cluster")))
            .sum()
    };
    let node_sum = |f: fn(&crate::transport::ServeStats) -> u64| -> u64 {
        nodes.iter().map(|(n, _)| f(n.stats())).sum()
    };
    let totals = [
        step,
        ranks.iter().map(|k| k.taken_ok).sum(),
        failed_all,
        net_sum(|n| n.failovers.load(Ordering::Relaxed)),
        node_sum(|s| s.read_retries.load(Ordering::Relaxed)),
        node_sum(|s| s.errors.load(Ordering::Relaxed)),
    ];
    if std::env::var_os("KSPEED_SIM_VERBOSE").is_some() {
        eprintln!(
            "seed {seed}: {nnodes} nodes x {} copies, {nranks} ranks, reset {reset_at:?}, stop {stop_at:?}, eio {eio:?}: \
             steps, taken, failed, failovers, read retries, node errors = {totals:?}",
            lay.copies
        );
    }
    for (t, v) in TOTALS.iter().zip(totals) {
        t.fetch_add(v, Ordering::Relaxed);
    }
}

/// Rank `r`'s consumer: takes its next sample if it is published (checks
/// it), releases it.
fn consume(
    seed: u64,
    r: usize,
    k: &mut Rank,
    w: &World,
    stopped: &[bool],
    eio: &[u32],
    placement: Placement,
) {
    if k.next.g >= k.end_g {
        return;
    }
    let Some(code) = k.sh.sim_state(k.next.g) else {
        return;
    };
    let p = k.next;
    match code {
        CODE_OK => {
            k.check_bytes(seed, r, &p, &w.bytes, "when taken");
            k.taken_ok += 1;
        }
        CODE_ERROR => {
            let errors = k.sh.errors.lock().unwrap_or_else(|e| e.into_inner());
            let e = errors
                .iter()
                .find(|(g, _)| *g == p.g)
                .map(|(_, e)| e)
                .unwrap_or_else(|| {
                    panic!(
                        "seed {seed}: rank {r}: sample g={} failed without an error",
                        p.g
                    )
                });
            assert!(
                matches!(e, Error::SampleUnavailable { sample, .. } if *sample == p.id),
                "seed {seed}: rank {r}: sample g={} (id {}) failed with {e}",
                p.g,
                p.id
            );
            let text = e.to_string();
            assert!(
                !text.contains("NotHeld"),
                "seed {seed}: rank {r}: a node was granted a sample it does not hold: {text}"
            );
            for c in 0..placement.replicas {
                let h = placement.holder(p.id, c) as usize;
                let excused = stopped[h] || k.reset[h] || k.node_fd[h].is_none() || eio[h] > 0;
                assert!(
                    excused,
                    "seed {seed}: rank {r}: sample {} failed while node {h}, a live holder \
                     without read faults, could serve it: {text}",
                    p.id
                );
            }
        }
        c => panic!(
            "seed {seed}: rank {r}: sample g={} published with code {c}",
            p.g
        ),
    }
    k.seen.remove(&p.g);
    k.next = k.cursor.next(k.sh.input.catalog());
    k.sh.released_v.store(k.next.v, Ordering::SeqCst);
    k.sh.released_g.store(k.next.g, Ordering::SeqCst);
    k.sh.net.as_ref().expect("cluster").released();
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The cluster simulation over many seeds (bounded in time; see
    /// `sim/mod.rs` for replaying one).
    #[test]
    fn sim_cluster_nodes_and_ranks_over_the_memory_network() {
        let ran = run_seeds("sim_cluster", 200, Duration::from_secs(60), cluster);
        assert!(ran > 0);
        let t: Vec<u64> = TOTALS.iter().map(|t| t.load(Ordering::Relaxed)).collect();
        eprintln!(
            "sim_cluster totals: {} steps, {} samples taken, {} failed (named), {} failovers, \
             {} node read retries, {} node ERRORs",
            t[0], t[1], t[2], t[3], t[4], t[5]
        );
        if ran >= 100 && std::env::var_os("KSPEED_SIM_SEED").is_none() {
            // A simulation that stopped exercising the cluster would pass
            // vacuously: each path ran.
            assert!(t.iter().all(|&v| v > 0), "a path never ran: {t:?}");
        }
    }
}
