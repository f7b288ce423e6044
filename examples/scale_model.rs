//! The scale model: what a kspeed cluster of 8 to 4,096 nodes (8 ranks
//! each) asks of every node, computed with the frozen functions the real
//! cluster runs: the sampler's epoch order (`Sampler::epoch`,
//! `EpochOrder::global`), the owner function (`Placement::owner`, `holds`,
//! `holder`), `kspeed gen`'s sample sizes (`gen::sample_size`) and the node
//! service's defaults (`ServeConfig::new`, `proto`).
//!
//! ```sh
//! cargo run --release --example scale_model              # the tables of docs/SCALE.md
//! cargo run --release --example scale_model -- --quick   # fewer sampled steps
//! cargo run --release --example scale_model -- --connections   # only the connection tables
//! cargo run --release --example scale_model -- --resize        # only the resize table
//! ```
//!
//! Traffic is not iterated over whole epochs (10^9 samples): a number of
//! training steps are drawn at random positions of the first epochs, and for
//! each of them every rank's whole batch is enumerated, so the per-node
//! figures of a step are exact and the max/mean is over nodes and the drawn
//! steps. What the loader does is modelled as it is coded today:
//!
//! - a rank reads a sample from its own node's space when that node holds a
//!   copy (owner or replica: `Space::location`), else it grants the owner
//!   (copy 0), which pushes it;
//! - when a node service fails, the rank grants the next live holder in the
//!   failover order (`Placement::try_copy`: the owner, then the replicas in
//!   an order drawn from the id) and with no copy left reads the source (the
//!   loader's `place`); the copy order the loader used before is modelled
//!   beside it.
//!
//! Connections, queue pairs and memory follow from the node service's code:
//! every remote rank holds one connection (one RC queue pair over RDMA) to
//! every node service; the service reserves `max_grants` queued grants for
//! each (a `GrantEntry` plus a `u64`), `staging_bytes` per poller, and at
//! most `max_conns_per_poller` consumers per poller.

use std::time::Instant;

use kspeed::dataset::gen::{sample_size, Profile};
use kspeed::dataset::{OwnerFn, Placement};
use kspeed::hash::mix64;
use kspeed::model;
use kspeed::sampler::{EpochOrder, Sampler, SamplerConfig};
use kspeed::transport::proto;
use kspeed::transport::ServeConfig;

/// Ranks (GPUs) per node.
const RANKS_PER_NODE: u32 = 8;
/// Samples per rank per training step (a common per-GPU ImageNet batch).
const BATCH: u64 = 256;
/// The target: samples per second each GPU consumes.
const TARGET_PER_GPU: f64 = 3000.0;
/// Cores of the modelled GPU node (two 64-core sockets).
const NODE_CORES: usize = 128;
/// Shuffle seed and `kspeed gen` seed (any: the figures are statistics).
const SEED: u64 = 7;
const NODE_COUNTS: [u32; 4] = [8, 64, 512, 4096];
const SAMPLE_COUNTS: [u64; 2] = [1_000_000, 1_000_000_000];
const MAX_REPLICAS: usize = 3;
/// The ceiling of `--max-handshakes`.
const MAX_HANDSHAKES: u64 = model::MAX_HANDSHAKES;
/// Handshakes a rank runs at once at start, all from one thread.
const HANDSHAKES_IN_FLIGHT: u64 = model::HANDSHAKES_IN_FLIGHT as u64;
/// mlx5's send-queue building block (`MLX5_SEND_WQE_BB`): a send WQE is a
/// whole number of them.
const WQE_BB_BYTES: u64 = 64;
/// What mlx5 reserves in every send WQE of an RC QP before its data
/// (`sq_overhead`: a 16-B control segment and the larger of atomic + remote
/// address, 32 B, or a memory-window bind, 48 + 64 + 64 B).
const RC_SQ_OVERHEAD_BYTES: u64 = 16 + 176;
/// A data (scatter/gather) segment, and an inline segment's header.
const DATA_SEG_BYTES: u64 = 16;
const INLINE_HDR_BYTES: u64 = 4;
/// A completion queue entry (64 B on ConnectX; 128-B CQEs exist too).
const CQE_BYTES: u64 = 64;
/// Inline bytes the node's QPs ask for (`4 + RDMA_ERROR_BYTES`: an ERROR
/// goes inline as a SEND).
const OWNER_INLINE_BYTES: u64 = RECV_BUF_BYTES;
/// Memory windows a rank keeps per RDMA connection (one per grant in
/// flight to that node).
const WINDOWS_PER_CONN: u64 = model::RDMA_WINDOWS as u64;
/// Receives a rank keeps posted on each RDMA connection (every
/// WRITE_WITH_IMM consumes one) and the bytes of each one's buffer (room
/// for an ERROR message).
const RECVS_PER_CONN: u64 = model::RDMA_RECVS as u64;
const RECV_BUF_BYTES: u64 = model::RDMA_RECV_BYTES as u64;
/// Entries a link takes of its network thread's shared CQ (its send
/// queue's: a request per window, and some room); the thread's CQ takes
/// the SRQ's depth once more.
const LINK_CQ_ENTRIES: u64 = model::LINK_SEND_CQ_ENTRIES as u64;
/// Receives a network thread's shared receive queue holds at most (1,024
/// a link up to this).
const SRQ_RECVS: u64 = model::SRQ_RECVS_MAX as u64;

/// What a network thread's links share as built (2026-12-06): the SRQ
/// (receives, their WQEs and buffers) and the CQ (each link's send entries,
/// one link's spare and the SRQ's depth; one CQ on a ConnectX up to about
/// 13,000 links).
fn thread_shared_bytes(links: u64) -> u64 {
    let depth = (links * RECVS_PER_CONN).min(SRQ_RECVS);
    depth * RECV_BUF_BYTES
        + depth.next_power_of_two() * DATA_SEG_BYTES
        + mlx5_cq_bytes((links + 1) * LINK_CQ_ENTRIES + depth)
}

/// Host memory one connection's verbs objects pin.
struct Verbs {
    qp: u64,
    cq: u64,
    recv_bufs: u64,
    windows: u64,
}

impl Verbs {
    fn pinned(&self) -> u64 {
        self.qp + self.cq + self.recv_bufs
    }
}

/// Bytes of an RC QP's work queues as mlx5 allocates them
/// (`mlx5_calc_send_wqe`, `mlx5_calc_sq_size`, `mlx5_calc_rq_size`).
fn mlx5_rc_qp_bytes(send_wr: u64, recv_wr: u64, sge: u64, inline_bytes: u64) -> u64 {
    let data = RC_SQ_OVERHEAD_BYTES + sge * DATA_SEG_BYTES;
    let inline = if inline_bytes > 0 {
        RC_SQ_OVERHEAD_BYTES + (INLINE_HDR_BYTES + inline_bytes).div_ceil(16) * 16
    } else {
        0
    };
    let wqe = data.max(inline).div_ceil(WQE_BB_BYTES) * WQE_BB_BYTES;
    let sq = (send_wr * wqe).next_power_of_two();
    let rq = (recv_wr.next_power_of_two() * (sge * DATA_SEG_BYTES).next_power_of_two())
        .max(WQE_BB_BYTES);
    sq + rq
}

/// Bytes of a CQ of `entries` (mlx5 rounds `entries + 1` up to a power of
/// two).
fn mlx5_cq_bytes(entries: u64) -> u64 {
    (entries + 1).next_power_of_two() * CQE_BYTES
}

fn gib(b: f64) -> String {
    if b >= (1u64 << 30) as f64 {
        format!("{:.1} GiB", b / (1u64 << 30) as f64)
    } else if b >= (1u64 << 20) as f64 {
        format!("{:.0} MiB", b / (1u64 << 20) as f64)
    } else {
        format!("{:.0} KiB", b / 1024.0)
    }
}

/// The traffic of the sampled steps of one (profile, samples, nodes).
struct Traffic {
    /// Steps per epoch for a rank.
    steps_per_epoch: u64,
    steps_drawn: usize,
    /// Mean sample size over the enumerated samples.
    mean_sample_bytes: f64,
    /// Per replica count: per-node bytes pushed in one step, max and mean
    /// over (node, drawn step); samples likewise.
    push_max_bytes: [u64; MAX_REPLICAS],
    push_mean_bytes: [f64; MAX_REPLICAS],
    push_max_samples: [u64; MAX_REPLICAS],
    /// Node 0's service failed: the most any survivor pushes in a step
    /// with failover in copy order (the loader before 2026-12-05), and
    /// the bytes read from the source per step (no copy left).
    fail_max_bytes: [u64; MAX_REPLICAS],
    /// The same with the loader's failover order (`Placement::try_copy`),
    /// which spreads a failed owner's samples over all surviving copies.
    spread_max_bytes: [u64; MAX_REPLICAS],
    fail_source_bytes: [f64; MAX_REPLICAS],
    /// Fraction of consumed samples that cross the network.
    remote_fraction: [f64; MAX_REPLICAS],
}

/// Per-thread tallies of one step, indexed `[replicas-1][node]`.
struct Tally {
    push: Vec<Vec<u64>>,
    push_n: Vec<Vec<u64>>,
    fail: Vec<Vec<u64>>,
    spread: Vec<Vec<u64>>,
    source: [u64; MAX_REPLICAS],
    remote: [u64; MAX_REPLICAS],
    bytes: u64,
    samples: u64,
}

impl Tally {
    fn new(nodes: usize) -> Self {
        Tally {
            push: vec![vec![0; nodes]; MAX_REPLICAS],
            push_n: vec![vec![0; nodes]; MAX_REPLICAS],
            fail: vec![vec![0; nodes]; MAX_REPLICAS],
            spread: vec![vec![0; nodes]; MAX_REPLICAS],
            source: [0; MAX_REPLICAS],
            remote: [0; MAX_REPLICAS],
            bytes: 0,
            samples: 0,
        }
    }

    fn add(&mut self, o: &Tally) {
        for r in 0..MAX_REPLICAS {
            for (a, b) in self.push[r].iter_mut().zip(&o.push[r]) {
                *a += b;
            }
            for (a, b) in self.push_n[r].iter_mut().zip(&o.push_n[r]) {
                *a += b;
            }
            for (a, b) in self.fail[r].iter_mut().zip(&o.fail[r]) {
                *a += b;
            }
            for (a, b) in self.spread[r].iter_mut().zip(&o.spread[r]) {
                *a += b;
            }
            self.source[r] += o.source[r];
            self.remote[r] += o.remote[r];
        }
        self.bytes += o.bytes;
        self.samples += o.samples;
    }
}

/// Enumerates one training step (position `step * BATCH` of every rank's
/// sequence, epochs following each other) for ranks `ranks`.
fn tally_step(
    profile: Profile,
    sampler: &Sampler,
    nodes: u32,
    step: u64,
    ranks: std::ops::Range<u32>,
) -> Tally {
    let n = nodes as usize;
    let world = sampler.config().world as u64;
    let per_rank = sampler.per_rank();
    let placements: Vec<Placement> = (1..=MAX_REPLICAS as u32)
        .map(|r| Placement::new(nodes, r.min(nodes)).expect("valid placement"))
        .collect();
    let failed = 0u32;
    let mut t = Tally::new(n);
    let mut order: Option<(u64, EpochOrder)> = None;
    for k in 0..BATCH {
        let pos = step * BATCH + k;
        let (epoch, idx) = (pos / per_rank, pos % per_rank);
        if order.as_ref().map(|o| o.0) != Some(epoch) {
            order = Some((epoch, sampler.epoch(epoch)));
        }
        let ord = &order.as_ref().expect("set above").1;
        for rank in ranks.clone() {
            // The rank's step `idx` of `epoch` (EpochOrder::sample for
            // this rank, without building a sampler per rank).
            let id = ord.global(rank as u64 + idx * world);
            let consumer = rank / RANKS_PER_NODE;
            let len = sample_size(profile, SEED, id);
            t.bytes += len;
            t.samples += 1;
            for (ri, p) in placements.iter().enumerate() {
                if p.holds(consumer, id) {
                    continue;
                }
                let owner = p.owner(id) as usize;
                t.remote[ri] += 1;
                t.push[ri][owner] += len;
                t.push_n[ri][owner] += 1;
                // Node `failed`'s service is down: before, the next live
                // holder in copy order, else the source.
                let server = (0..p.replicas)
                    .map(|r| p.holder(id, r))
                    .find(|&h| h != failed);
                match server {
                    Some(h) => t.fail[ri][h as usize] += len,
                    None => t.source[ri] += len,
                }
                // The loader now: the next live holder in the failover
                // order (`Placement::try_copy`: the owner, then the
                // replicas in an order drawn from the id).
                let spread = (0..p.replicas)
                    .map(|k| p.holder(id, p.try_copy(id, k)))
                    .find(|&h| h != failed);
                if let Some(h) = spread {
                    t.spread[ri][h as usize] += len;
                }
            }
        }
    }
    t
}

/// Samples of the resize table (imagenet sizes: about 128 GB).
const RESIZE_SAMPLES: u64 = 1_000_000;

/// What resizing a cluster from `from` to `to` nodes copies: every copy a
/// node holds under the new placement and did not hold under the old one
/// is copied to it (`kspeed rebalance` fetches exactly these), in bytes
/// (imagenet sizes, `RESIZE_SAMPLES` samples), for the owner function `f`.
/// The minimum is what any placement must copy: the new nodes' share of
/// every copy when growing, the removed nodes' copies when shrinking.
fn resize_moved(f: OwnerFn, from: u32, to: u32, replicas: u32, threads: usize) -> (u64, u64) {
    let (a, b) = (
        Placement::with_fn(f, from, replicas).expect("valid placement"),
        Placement::with_fn(f, to, replicas).expect("valid placement"),
    );
    let per = RESIZE_SAMPLES.div_ceil(threads as u64);
    std::thread::scope(|sc| {
        let hs: Vec<_> = (0..threads as u64)
            .map(|t| {
                sc.spawn(move || {
                    let (mut moved, mut total) = (0u64, 0u64);
                    for id in t * per..((t + 1) * per).min(RESIZE_SAMPLES) {
                        let len = sample_size(Profile::Imagenet, SEED, id);
                        total += len * replicas as u64;
                        for r in 0..replicas {
                            if !a.holds(b.holder(id, r), id) {
                                moved += len;
                            }
                        }
                    }
                    (moved, total)
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().expect("no panic"))
            .fold((0, 0), |x, y| (x.0 + y.0, x.1 + y.1))
    })
}

/// The resize table: bytes copied for 64 -> 65 and 512 -> 448 nodes, the
/// scaled owner function (manifest version 1) against jump (version 2).
fn print_resize(threads: usize) {
    println!(
        "\n## Resizing the cluster: bytes `kspeed rebalance` copies\n\n\
         {RESIZE_SAMPLES:.0e} imagenet-sized samples (seed {SEED}); a copy moves when a node holds it \
         under the new placement and did not under the old. The minimum: growing, the new nodes' \
         share of every copy; shrinking, the removed nodes' copies.\n"
    );
    println!(
        "| nodes | R | stored | minimum | scaled (v1) moves | jump (v2) moves | jump / minimum |"
    );
    println!("|---|---|---|---|---|---|---|");
    for (from, to) in [(64u32, 65u32), (512, 448)] {
        for r in 1..=MAX_REPLICAS as u32 {
            let (scaled, total) = resize_moved(OwnerFn::Scaled, from, to, r, threads);
            let (jump, _) = resize_moved(OwnerFn::Jump, from, to, r, threads);
            let min = if to > from {
                total as f64 * (to - from) as f64 / to as f64
            } else {
                total as f64 * (from - to) as f64 / from as f64
            };
            println!(
                "| {from} → {to} | {r} | {:.1} GB | {:.2} GB ({:.2}%) | {:.2} GB ({:.1}%) | {:.2} GB ({:.2}%) | {:.2} |",
                total as f64 / 1e9,
                min / 1e9,
                100.0 * min / total as f64,
                scaled as f64 / 1e9,
                100.0 * scaled as f64 / total as f64,
                jump as f64 / 1e9,
                100.0 * jump as f64 / total as f64,
                jump as f64 / min,
            );
        }
    }
}

fn traffic(profile: Profile, samples: u64, nodes: u32, steps: usize, threads: usize) -> Traffic {
    let world = nodes * RANKS_PER_NODE;
    let sampler = Sampler::new(
        SamplerConfig::single(samples, SEED)
            .rank_world(0, world)
            .shuffle(true)
            .drop_last(false),
    )
    .expect("valid sampler");
    let per_rank = sampler.per_rank();
    // Steps in the first 4 epochs, drawn without a pattern.
    let span = (4 * per_rank).div_ceil(BATCH).max(1);
    let drawn: Vec<u64> = (0..steps as u64)
        .map(|i| mix64(SEED ^ (i + 1) ^ ((nodes as u64) << 32) ^ samples) % span)
        .collect();
    let n = nodes as usize;
    let mut push_max_bytes = [0u64; MAX_REPLICAS];
    let mut push_sum = [0f64; MAX_REPLICAS];
    let mut push_max_samples = [0u64; MAX_REPLICAS];
    let mut fail_max_bytes = [0u64; MAX_REPLICAS];
    let mut spread_max_bytes = [0u64; MAX_REPLICAS];
    let mut fail_source = [0f64; MAX_REPLICAS];
    let mut remote = [0u64; MAX_REPLICAS];
    let (mut bytes, mut count) = (0u64, 0u64);
    for &step in &drawn {
        let chunk = world.div_ceil(threads as u32);
        let total = std::thread::scope(|sc| {
            let hs: Vec<_> = (0..threads as u32)
                .map(|i| {
                    let lo = (i * chunk).min(world);
                    let hi = ((i + 1) * chunk).min(world);
                    let s = &sampler;
                    sc.spawn(move || tally_step(profile, s, nodes, step, lo..hi))
                })
                .collect();
            let mut total = Tally::new(n);
            for h in hs {
                total.add(&h.join().expect("model thread"));
            }
            total
        });
        for r in 0..MAX_REPLICAS {
            push_max_bytes[r] = push_max_bytes[r].max(*total.push[r].iter().max().unwrap_or(&0));
            push_max_samples[r] =
                push_max_samples[r].max(*total.push_n[r].iter().max().unwrap_or(&0));
            push_sum[r] += total.push[r].iter().sum::<u64>() as f64;
            // Survivors only (node 0 is the failed one).
            fail_max_bytes[r] =
                fail_max_bytes[r].max(*total.fail[r][1..].iter().max().unwrap_or(&0));
            spread_max_bytes[r] =
                spread_max_bytes[r].max(*total.spread[r][1..].iter().max().unwrap_or(&0));
            fail_source[r] += total.source[r] as f64;
            remote[r] += total.remote[r];
        }
        bytes += total.bytes;
        count += total.samples;
    }
    let node_steps = (n * drawn.len()) as f64;
    Traffic {
        steps_per_epoch: per_rank.div_ceil(BATCH),
        steps_drawn: drawn.len(),
        mean_sample_bytes: bytes as f64 / count as f64,
        push_max_bytes,
        push_mean_bytes: push_sum.map(|s| s / node_steps),
        push_max_samples,
        fail_max_bytes,
        spread_max_bytes,
        fail_source_bytes: fail_source.map(|s| s / drawn.len() as f64),
        remote_fraction: remote.map(|r| r as f64 / count as f64),
    }
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    // Only the tables of connections and memory (no traffic sampling).
    let connections_only = std::env::args().any(|a| a == "--connections");
    // Only the resize table.
    if std::env::args().any(|a| a == "--resize") {
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        print_resize(threads.min(8));
        return;
    }
    let threads = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
        .min(8);
    let t0 = Instant::now();
    let step_s = BATCH as f64 / TARGET_PER_GPU;
    println!(
        "# kspeed scale model\n\n{RANKS_PER_NODE} ranks per node, batch {BATCH} samples per rank per step, \
         target {TARGET_PER_GPU} samples/s per GPU (one step every {:.1} ms); \
         sizes from `kspeed gen` profiles (seed {SEED}); node 0's service fails in the failure columns.\n",
        step_s * 1e3
    );

    println!("## Traffic per node per training step\n");
    println!(
        "| profile | samples | nodes | steps/epoch | R | remote | push/step mean | push/step max | max/mean | samples/step max | push rate needed | one node down: busiest survivor, copies in order (before) | same, failover order by id (the loader) | from the source |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    let profiles: &[Profile] = if connections_only {
        &[]
    } else {
        &[Profile::Imagenet, Profile::Tiny]
    };
    for &profile in profiles {
        let pname = match profile {
            Profile::Imagenet => "imagenet",
            _ => "tiny",
        };
        for samples in SAMPLE_COUNTS {
            for nodes in NODE_COUNTS {
                let steps = match (quick, nodes) {
                    (true, _) => 2,
                    (false, 4096) => 3,
                    (false, 512) => 6,
                    (false, 64) => 12,
                    _ => 16,
                };
                let t = traffic(profile, samples, nodes, steps, threads);
                for r in 0..MAX_REPLICAS {
                    if r as u32 + 1 > nodes {
                        continue;
                    }
                    let mean = t.push_mean_bytes[r];
                    let max = t.push_max_bytes[r] as f64;
                    let rate = max / step_s;
                    let fail = t.fail_max_bytes[r] as f64;
                    println!(
                        "| {pname} | {samples:.0e} | {nodes} | {} | {} | {:.1}% | {:.1} MiB | {:.1} MiB | {:.2} | {} | {:.2} GB/s | {:.2} GB/s ({:.2}x) | {:.2} GB/s ({:.2}x) | {:.2} GB/s |",
                        t.steps_per_epoch,
                        r + 1,
                        100.0 * t.remote_fraction[r],
                        mean / (1 << 20) as f64,
                        max / (1 << 20) as f64,
                        max / mean.max(1.0),
                        t.push_max_samples[r],
                        rate / 1e9,
                        fail / step_s / 1e9,
                        fail / max.max(1.0),
                        t.spread_max_bytes[r] as f64 / step_s / 1e9,
                        t.spread_max_bytes[r] as f64 / max.max(1.0),
                        t.fail_source_bytes[r] / step_s / 1e9,
                    );
                }
                eprintln!(
                    "  {pname} {samples:.0e} samples, {nodes} nodes: {} steps drawn, mean sample {:.0} B ({:.0} s so far)",
                    t.steps_drawn,
                    t.mean_sample_bytes,
                    t0.elapsed().as_secs_f64()
                );
            }
        }
    }

    if !connections_only {
        print_resize(threads);
    }

    print!("\n{}", connection_tables());
    eprintln!("model done in {:.1} s", t0.elapsed().as_secs_f64());
}

/// The tables of connections, queue pairs and memory per node (independent
/// of sample sizes: no sampling), as docs/SCALE.md shows them; the test
/// below checks that the doc holds exactly this text.
fn connection_tables() -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let cfg = ServeConfig::new("/space", "0.0.0.0:7400", b"t");
    // loader::default_pollers() on the modelled node: a quarter of its
    // cores, at most 8 (the formula of src/loader/mod.rs, evaluated for
    // NODE_CORES rather than for the machine running the model).
    let pollers = (NODE_CORES / 4).clamp(1, 8) as u64;
    // One queued grant, as the service stores it: what a consumer allowed
    // one grant reserves, less its one-entry GRANT buffer.
    let grant_bytes = {
        let mut one = cfg.clone();
        one.max_grants = 1;
        one.grant_bytes_per_consumer(1) - proto::GRANT_ENTRY_BYTES as u64
    };
    // What the service reserves per consumer at connect (its grant queue
    // and GRANT body buffer), with `max_grants` resolved from the
    // placement as the service does at start.
    let per_consumer_grants = |nodes: u32| cfg.grant_bytes_per_consumer(nodes);
    let staging = pollers * cfg.staging_bytes;
    // The service's limit (`ServeConfig::consumers_per_poller`, resolved
    // at start from the placement), evaluated for the modelled node's
    // pollers.
    let mut cfg_on_node = cfg.clone();
    cfg_on_node.pollers = pollers as usize;
    let max_consumers = |nodes: u32| pollers * cfg_on_node.consumers_per_poller(nodes) as u64;
    // The verbs objects of one connection, as the code creates them
    // (src/transport/serve/owner_rdma.rs and src/loader/net/rdma.rs), in
    // the host memory mlx5 pins for them.
    let owner_wr = (cfg.staging_bytes / cfg.chunk_bytes as u64)
        .clamp(model::OWNER_WRS.0 as u64, model::OWNER_WRS.1 as u64);
    let owner = Verbs {
        qp: mlx5_rc_qp_bytes(owner_wr, owner_wr, 1, OWNER_INLINE_BYTES),
        cq: mlx5_cq_bytes(owner_wr + model::OWNER_CQ_SPARE as u64),
        recv_bufs: 0,
        windows: 0,
    };
    // A link's own: its QP's send queue (its receives are its thread's
    // SRQ's, its completions on its thread's CQ: `thread_shared_bytes`).
    let rank = Verbs {
        qp: mlx5_rc_qp_bytes(RECVS_PER_CONN, 0, 1, 0),
        cq: 0,
        recv_bufs: 0,
        windows: WINDOWS_PER_CONN,
    };
    writeln!(
        out,
        "### Connections, queue pairs and memory per node (today: every rank connects to every node service)\n\n\
         Node service defaults (`ServeConfig::new`): {pollers} pollers on a {NODE_CORES}-core node, \
         staging {} per poller ({} per node, {}-KiB slots), max_grants per consumer sized from \
         the cluster (131,072 over the nodes, {} to {}: {} reserved per consumer up to 16 nodes, \
         {} from 512, its grant queue and GRANT buffer), consumers per poller sized from \
         the cluster (8 x nodes over the pollers, {} to {}).\n\n\
         Verbs memory per connection, as mlx5 sizes it (send WQE: 16 B control + 176 B reserved \
         for a memory-window bind + data or inline, in 64-B blocks; queues rounded up to powers \
         of two; 64-B CQEs): the node's side {} (QP {} with {owner_wr} WRs and {OWNER_INLINE_BYTES} B \
         inline, CQ {}), a rank's side {} (QP {} with {RECVS_PER_CONN} send WRs and no receive \
         queue) and {WINDOWS_PER_CONN} memory windows (NIC memory keys, not host memory), and \
         once per rank (its network thread) a shared receive queue of 1,024 receives a link, at \
         most {SRQ_RECVS}, of {RECV_BUF_BYTES} B, and a CQ shared by its links \
         ({LINK_CQ_ENTRIES} entries a link and the SRQ's depth): {} at 512 nodes.\n",
        gib(cfg.staging_bytes as f64),
        gib(staging as f64),
        cfg.chunk_bytes / 1024,
        cfg.grants_per_consumer(u32::MAX),
        cfg.grants_per_consumer(1),
        gib(per_consumer_grants(1) as f64),
        gib(per_consumer_grants(512) as f64),
        cfg_on_node.consumers_per_poller(1),
        cfg_on_node.consumers_per_poller(u32::MAX),
        gib(owner.pinned() as f64),
        gib(owner.qp as f64),
        gib(owner.cq as f64),
        gib(rank.pinned() as f64),
        gib(rank.qp as f64),
        gib(thread_shared_bytes(511) as f64),
    ).unwrap();
    writeln!(
        out,
        "| nodes | consumers served per node | RC QPs per node (serve + ranks) | memory windows per node | pinned verbs memory per node | grant tables per node | node full? | per (node, rank) pair rate | at start: HELLOs per service | pending-handshake limit (`--max-handshakes` auto) | a rank's handshakes in flight at start (one thread) |"
    ).unwrap();
    writeln!(out, "|---|---|---|---|---|---|---|---|---|---|---|").unwrap();
    for nodes in NODE_COUNTS {
        let consumers = (nodes as u64 - 1) * RANKS_PER_NODE as u64;
        let outbound = consumers; // 8 local ranks x (nodes-1) services
        let qps = consumers + outbound;
        writeln!(
        out,
            "| {nodes} | {consumers} | {qps} | {} | {} | {} | {} | {:.2} samples/s | {consumers} | {} | {} |",
            outbound * rank.windows,
            gib((consumers * owner.pinned()
                + outbound * rank.pinned()
                + RANKS_PER_NODE as u64 * thread_shared_bytes(nodes as u64 - 1)) as f64),
            gib((consumers * per_consumer_grants(nodes)) as f64),
            if consumers > max_consumers(nodes) {
                format!("yes: {} refused", consumers - max_consumers(nodes))
            } else {
                "no".into()
            },
            TARGET_PER_GPU / nodes as f64,
            if cfg.max_handshakes == 0 {
                // The service's default (`auto_max_handshakes` in
                // src/transport/serve/service.rs): room for every rank of the
                // other nodes at once, within MAX_HANDSHAKES.
                (64 + RANKS_PER_NODE as u64 * (nodes as u64 - 1)).min(MAX_HANDSHAKES)
            } else {
                cfg.max_handshakes as u64
            },
            (nodes as u64 - 1).min(HANDSHAKES_IN_FLIGHT),
        ).unwrap();
    }
    writeln!(
        out,
        "\n### The same with a node's ranks aggregated behind its node service\n\n\
         One connection (one RC QP, or one DC initiator shared by all) between each pair of node \
         services; the local ranks' landing rings are shared memory the node service registers; \
         grants are batched per peer node, so a peer's queue holds 8 ranks' worth.\n"
    )
    .unwrap();
    // The grants a node must hold are what its peers' ranks have granted it
    // and not yet received: their lookahead, not a reservation per peer.
    let lookahead = 2 * BATCH;
    writeln!(
        out,
        "| nodes | connections per node | RC QPs per node | with DC transport (16 DCIs + 1 DCT) | grant pool per node (8 ranks x {lookahead} samples lookahead) | per (node, node) pair rate | posted receives with one SRQ ({SRQ_RECVS}) |"
    ).unwrap();
    writeln!(out, "|---|---|---|---|---|---|---|").unwrap();
    for nodes in NODE_COUNTS {
        let peers = nodes as u64 - 1;
        writeln!(
            out,
            "| {nodes} | {} | {} | 17 | {:.0} KiB | {:.0} samples/s | {} |",
            2 * peers,
            2 * peers,
            (RANKS_PER_NODE as u64 * lookahead * grant_bytes) as f64 / 1024.0,
            RANKS_PER_NODE as f64 * TARGET_PER_GPU / nodes as f64,
            gib((SRQ_RECVS * RECV_BUF_BYTES) as f64),
        )
        .unwrap();
    }
    agent_table(&mut out, &cfg, pollers, owner_wr, &owner, &rank);
    out
}

/// The agent as built: one network thread per agent (`--net-threads 1`)
/// with one link to each other node's service, and that service serving
/// the other agents' links; then, on paper, the same with a window pool
/// sized per node and the node's side sharing a CQ per poller, and with DC
/// transport.
fn agent_table(
    out: &mut String,
    cfg: &ServeConfig,
    pollers: u64,
    owner_wr: u64,
    owner: &Verbs,
    rank: &Verbs,
) {
    use std::fmt::Write;
    // On paper: a window per grant the node's ranks have in flight (their
    // lookahead) instead of 256 a link, and the node's side sharing one CQ
    // per poller.
    let window_pool = RANKS_PER_NODE as u64 * 2 * BATCH;
    writeln!(
        out,
        "\n### The agent as built: one link per pair of nodes\n\n\
         One `kspeed agent` per node (AGENT.md, \"One link per pair of nodes\"): its network thread \
         keeps one link (one RC QP) to each other node's service, and its own node service serves \
         the other agents' links, so a node holds 2 x (nodes - 1) connections whatever its rank \
         count. Each link is a consumer to the service (its grant queue sized from the cluster as a rank's), \
         each link's consumer side has its QP (no receive queue) and {WINDOWS_PER_CONN} windows as \
         a rank's connection has, its receives from the thread's shared receive queue (at most \
         {SRQ_RECVS} of {RECV_BUF_BYTES} B) and its completions on the thread's shared CQ, and a \
         thread takes at most {} ranks (lanes) with grant tables of at most 2^{} entries. \
         `--net-threads K` multiplies the links by K. Not built (on paper): a pool of \
         {window_pool} windows per node (the node's ranks' lookahead) instead of \
         {WINDOWS_PER_CONN} a link, the node's side sharing one CQ per poller; and DC transport \
         (16 DCIs + 1 DCT per node).\n",
        model::MAX_LANES,
        model::SHARED_LANE_SHIFT,
    )
    .unwrap();
    writeln!(
        out,
        "| nodes | connections (RC QPs) per node | consumers each service serves | memory windows per node | pinned verbs memory per node | grant queues per node | per link rate | with a window pool and the node's CQs shared: windows | same: pinned verbs memory | with DC: QP contexts |"
    )
    .unwrap();
    writeln!(out, "|---|---|---|---|---|---|---|---|---|---|").unwrap();
    for nodes in NODE_COUNTS {
        let peers = nodes as u64 - 1;
        let shared_cqs = pollers
            * mlx5_cq_bytes(peers.div_ceil(pollers) * owner_wr + model::OWNER_CQ_SPARE as u64);
        writeln!(
            out,
            "| {nodes} | {} | {peers} | {} | {} | {} | {:.0} samples/s | {window_pool} | {} | 17 |",
            2 * peers,
            peers * rank.windows,
            gib((peers * (owner.pinned() + rank.pinned()) + thread_shared_bytes(peers)) as f64),
            gib((peers * cfg.grant_bytes_per_consumer(nodes)) as f64),
            RANKS_PER_NODE as f64 * TARGET_PER_GPU / nodes as f64,
            gib((peers * (owner.qp + rank.qp) + shared_cqs + thread_shared_bytes(peers)) as f64),
        )
        .unwrap();
    }
}

#[cfg(test)]
mod tests {
    /// docs/SCALE.md holds the connection tables exactly as the model
    /// prints them from the code's constants (`kspeed::model`): a constant
    /// changed without regenerating the doc fails here.
    #[test]
    fn scale_md_holds_the_models_connection_tables() {
        let doc = include_str!("../docs/SCALE.md");
        let tables = super::connection_tables();
        assert!(
            doc.contains(&tables),
            "docs/SCALE.md's connection tables differ from what examples/scale_model.rs computes \
             from the code's constants now; regenerate them (cargo run --release --example \
             scale_model -- --connections) and replace the section from \"### Connections\" \
             to the end of \"### The agent as built\". The model prints:\n{tables}"
        );
    }
}
