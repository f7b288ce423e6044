//! What RC queue pairs sized as kspeed sizes them cost on this machine's
//! RDMA device: the host memory they pin and take, and how long creating
//! them takes with several threads creating at once. It checks the scale
//! model's per-connection figures (docs/SCALE.md, "Verbs memory per
//! connection", from mlx5's sizing formulas) against a real NIC;
//! scripts/hw_scale_check.sh runs it. On soft-RoCE (rxe) the queues live
//! in kernel memory, so the pinned figure is not the NIC's: the run checks
//! the program, not the model.
//!
//! ```sh
//! cargo run --release --example qp_scale -- [--device mlx5_0] [--qps 1000]
//!     [--threads 1,8] [--side link|shared-link|node] [--windows N]
//! ```
//!
//! `--side link`: a consumer's side of a link (a rank's connection, or an
//! agent's shared link): a CQ of `CONSUMER_CQ_ENTRIES`, a QP of
//! `RDMA_RECVS` work requests, `RDMA_RECVS` receive buffers of
//! `RDMA_RECV_BYTES` registered, and `RDMA_WINDOWS` memory windows (or
//! `--windows N`). `--side shared-link`: a link as a network thread makes
//! it now (`src/loader/net/cqs.rs`, `recvs.rs`): its QP on the thread's
//! shared receive queue (`SRQ_RECVS_MAX` receives at most, their buffers
//! registered once) and a shared CQ (`LINK_SEND_CQ_ENTRIES` a link plus
//! the SRQ's depth, as many links a CQ as `max_cqe` holds), made once per
//! run and counted in its figures, and its windows. `--side node`: the node service's side: a CQ of its
//! work requests plus `OWNER_CQ_SPARE`, a QP of 256 work requests (64 MiB
//! of staging in 256 KiB slots, within `OWNER_WRS`) with an inline ERROR.
//! Every constant comes from the code (`kspeed::model`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use kspeed::model;
use kspeed::transport::rdma::{Access, Context, Cq, Mr, Mw, Pd, Qp, Srq, RDMA_ERROR_BYTES};

/// One connection's verbs objects, kept alive until the figures are read.
struct Conn {
    _qp: Qp,
    _cq: Arc<Cq>,
    _mr: Option<Mr>,
    _bufs: Vec<u8>,
    _windows: Vec<Mw>,
}

#[derive(Clone, Copy, PartialEq)]
enum Side {
    Link,
    SharedLink,
    Node,
}

/// What a run's shared links share: the SRQ (its buffers registered, no
/// receive posted) and the CQs.
struct Shared {
    srq: Arc<Srq>,
    cqs: Vec<Arc<Cq>>,
    links_per_cq: usize,
    _mr: Mr,
    _bufs: Vec<u8>,
}

impl Shared {
    /// For `links` links, sized as the code sizes them.
    fn new(ctx: &Arc<Context>, pd: &Arc<Pd>, links: usize) -> Shared {
        let max_cqe = ctx.max_cqe().expect("the device's max_cqe");
        let max_srq_wr = ctx
            .max_srq_wr()
            .expect("a device with shared receive queues");
        let depth = (links * model::RDMA_RECVS)
            .min(model::SRQ_RECVS_MAX)
            .min(max_srq_wr);
        let srq = Srq::new(pd, depth as u32).expect("create SRQ");
        let per = model::LINK_SEND_CQ_ENTRIES;
        let links_per_cq = ((max_cqe - depth) / per - 1).max(1);
        let cqs = (0..links.div_ceil(links_per_cq))
            .map(|g| {
                let n = links_per_cq.min(links - g * links_per_cq);
                Cq::new(ctx, ((n + 1) * per + depth).min(max_cqe) as i32).expect("create CQ")
            })
            .collect();
        let mut bufs = vec![0u8; depth * model::RDMA_RECV_BYTES];
        // SAFETY: `bufs` lives in the same struct as the region, its heap
        // allocation does not move; no receive is ever posted.
        let mr = unsafe { Mr::register(pd, bufs.as_mut_ptr(), bufs.len(), Access::Local) }
            .expect("register the SRQ's buffers");
        Shared {
            srq,
            cqs,
            links_per_cq,
            _mr: mr,
            _bufs: bufs,
        }
    }
}

/// The node service's work requests per connection with its defaults
/// (`ServeConfig::new`: 64 MiB of staging in 256 KiB slots).
fn node_wrs() -> usize {
    let cfg = kspeed::transport::ServeConfig::new("/space", "0.0.0.0:7400", b"t");
    ((cfg.staging_bytes / cfg.chunk_bytes as u64) as usize)
        .clamp(model::OWNER_WRS.0, model::OWNER_WRS.1)
}

fn make(
    pd: &Arc<Pd>,
    ctx: &Arc<Context>,
    side: Side,
    windows: usize,
    shared: Option<(&Shared, usize)>,
) -> Result<(Conn, Duration), String> {
    let t0 = Instant::now();
    let (entries, wrs, inline) = match side {
        Side::Link | Side::SharedLink => (model::CONSUMER_CQ_ENTRIES, model::RDMA_RECVS, 0),
        Side::Node => (
            node_wrs() + model::OWNER_CQ_SPARE,
            node_wrs(),
            4 + RDMA_ERROR_BYTES,
        ),
    };
    let (cq, qp) = match shared {
        Some((s, i)) => {
            let cq = s.cqs[(i / s.links_per_cq).min(s.cqs.len() - 1)].clone();
            let qp = Qp::new_on_srq(pd, &cq, &s.srq, wrs as u32, 0).map_err(|e| e.to_string())?;
            (cq, qp)
        }
        None => {
            let cq = Cq::new(ctx, entries as i32).map_err(|e| e.to_string())?;
            let qp = Qp::new(pd, &cq, &cq, wrs as u32, inline as u32).map_err(|e| e.to_string())?;
            (cq, qp)
        }
    };
    let took = t0.elapsed();
    let (mut bufs, mut mr) = (Vec::new(), None);
    if side == Side::Link {
        bufs = vec![0u8; model::RDMA_RECVS * model::RDMA_RECV_BYTES];
        // SAFETY: `bufs` is moved into the same `Conn` as the region and
        // its heap allocation does not move with it; nothing writes it
        // (local write only, no receive is ever posted).
        let registered = unsafe { Mr::register(pd, bufs.as_mut_ptr(), bufs.len(), Access::Local) };
        mr = Some(registered.map_err(|e| e.to_string())?);
    }
    let windows = (0..windows)
        .map(|_| Mw::new(pd).map_err(|e| e.to_string()))
        .collect::<Result<Vec<_>, _>>()?;
    Ok((
        Conn {
            _qp: qp,
            _cq: cq,
            _mr: mr,
            _bufs: bufs,
            _windows: windows,
        },
        took,
    ))
}

/// `VmRSS`, `VmPin` and `VmLck` of this process, in KiB.
fn vm() -> [u64; 3] {
    let text = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    [field("VmRSS:"), field("VmPin:"), field("VmLck:")]
}

fn mem_available_kib() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

fn pct(sorted: &[Duration], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i].as_secs_f64() * 1e6
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let arg = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let device = arg("--device");
    let qps: usize = arg("--qps").map_or(1000, |v| v.parse().expect("--qps N"));
    let threads: Vec<usize> = arg("--threads")
        .unwrap_or_else(|| "1,8".into())
        .split(',')
        .map(|v| v.parse().expect("--threads N[,N...]"))
        .collect();
    let side = match arg("--side").as_deref() {
        None | Some("link") => Side::Link,
        Some("shared-link") => Side::SharedLink,
        Some("node") => Side::Node,
        Some(other) => panic!("--side link|shared-link|node, not {other}"),
    };
    let windows = match side {
        Side::Link | Side::SharedLink => {
            arg("--windows").map_or(model::RDMA_WINDOWS, |v| v.parse().expect("--windows N"))
        }
        Side::Node => 0,
    };
    let ctx = match Context::open(device.as_deref(), 1, None) {
        Ok(c) => c,
        Err(e) => {
            println!("qp_scale: skipped: no RDMA device ({e})");
            return;
        }
    };
    let pd = Pd::new(&ctx).expect("protection domain");
    let side_name = match side {
        Side::Link => "link (consumer side, a CQ and receives per link)",
        Side::SharedLink => "shared link (consumer side, one SRQ and shared CQs)",
        Side::Node => "node side",
    };
    println!(
        "qp_scale: device {}, {qps} RC QPs per run, {side_name}, {windows} windows each",
        ctx.name()
    );
    for &t in &threads {
        let (before, avail) = (vm(), mem_available_kib());
        let t0 = Instant::now();
        // Made in the run, and dropped after its links (end of the loop).
        let shared_made = (side == Side::SharedLink).then(|| Shared::new(&ctx, &pd, qps));
        let shared = shared_made.as_ref();
        let per = qps.div_ceil(t);
        let made: Vec<Result<Vec<(Conn, Duration)>, String>> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..t)
                .map(|k| {
                    let (pd, ctx) = (pd.clone(), ctx.clone());
                    s.spawn(move || {
                        let n = per.min(qps.saturating_sub(k * per));
                        (0..n)
                            .map(|i| {
                                make(&pd, &ctx, side, windows, shared.map(|s| (s, k * per + i)))
                            })
                            .collect()
                    })
                })
                .collect();
            hs.into_iter()
                .map(|h| h.join().expect("a creating thread"))
                .collect()
        });
        let wall = t0.elapsed();
        let mut conns = Vec::new();
        for m in made {
            match m {
                Ok(v) => conns.extend(v),
                Err(e) => {
                    println!(
                        "qp_scale: {t} threads: stopped after {} QPs: {e}",
                        conns.len()
                    );
                    break;
                }
            }
        }
        let n = conns.len().max(1) as u64;
        let after = vm();
        let used = avail.saturating_sub(mem_available_kib());
        let mut lat: Vec<Duration> = conns.iter().map(|c| c.1).collect();
        lat.sort_unstable();
        if lat.is_empty() {
            continue;
        }
        println!(
            "{t:>3} threads: {} QPs in {:.1} ms; create (CQ + QP) p50 {:.0} us, p99 {:.0} us, max {:.0} us; \
             per QP: RSS {:.0} KiB, pinned (VmPin) {:.0} KiB, locked (VmLck) {:.0} KiB, \
             MemAvailable {:.0} KiB",
            conns.len(),
            wall.as_secs_f64() * 1e3,
            pct(&lat, 0.5),
            pct(&lat, 0.99),
            pct(&lat, 1.0),
            after[0].saturating_sub(before[0]) as f64 / n as f64,
            after[1].saturating_sub(before[1]) as f64 / n as f64,
            after[2].saturating_sub(before[2]) as f64 / n as f64,
            used as f64 / n as f64,
        );
        drop(conns);
    }
}
