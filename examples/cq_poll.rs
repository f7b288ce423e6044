//! What one network-thread tick's CQ polls cost at a node count, with a CQ
//! per link (as before 2026-12-06) against the CQs a thread's links share
//! (`src/loader/net/cqs.rs`, with the thread's shared receive queue,
//! `recvs.rs`: a link's send entries each, one link's spare and the SRQ's
//! depth, as many links on one CQ as the device's `max_cqe` allows). A
//! tick polls every CQ once at least; this times that round with the CQs
//! empty (the cost a tick pays whatever completed), sized as the code sizes
//! them (`kspeed::model`).
//!
//! ```sh
//! cargo run --release --example cq_poll -- [--device rxe0] [--links 64,512,1000]
//!     [--ticks 2000] [--runs 5]
//! ```
//!
//! Prints one row per link count: the median of `--runs` runs of
//! `--ticks` ticks each, in microseconds per tick, and their ratio.

use std::sync::Arc;
use std::time::Instant;

use kspeed::model::{CONSUMER_CQ_ENTRIES, LINK_SEND_CQ_ENTRIES, RDMA_RECVS, SRQ_RECVS_MAX};
use kspeed::transport::rdma::{CompChannel, Context, Cq, WorkCompletion};

fn arg(args: &[String], name: &str) -> Option<String> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

/// Microseconds per tick polling every CQ of `cqs` once, median of `runs`.
fn tick_us(cqs: &[Arc<Cq>], ticks: usize, runs: usize) -> f64 {
    let mut out = [WorkCompletion::default(); 32];
    let mut per_run: Vec<f64> = (0..runs)
        .map(|_| {
            let t0 = Instant::now();
            for _ in 0..ticks {
                for cq in cqs {
                    let n = cq.poll(&mut out).expect("poll CQ");
                    assert_eq!(n, 0, "a CQ nothing posts to completed something");
                }
            }
            t0.elapsed().as_secs_f64() * 1e6 / ticks as f64
        })
        .collect();
    per_run.sort_by(f64::total_cmp);
    per_run[runs / 2]
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let device = arg(&args, "--device");
    let links: Vec<usize> = arg(&args, "--links")
        .unwrap_or_else(|| "64,512,1000".into())
        .split(',')
        .map(|s| s.parse().expect("--links: comma-separated counts"))
        .collect();
    let ticks: usize = arg(&args, "--ticks").map_or(2000, |s| s.parse().expect("--ticks"));
    let runs: usize = arg(&args, "--runs").map_or(5, |s| s.parse().expect("--runs"));
    let ctx = Context::open(device.as_deref(), 1, None).unwrap_or_else(|e| {
        eprintln!("cq_poll: {e}");
        std::process::exit(2)
    });
    let ch = CompChannel::new(&ctx).expect("completion channel");
    let max_cqe = ctx.max_cqe().expect("the device's max_cqe");
    let max_srq_wr = ctx
        .max_srq_wr()
        .expect("a device with shared receive queues");
    println!(
        "device {} (max_cqe {max_cqe}, max_srq_wr {max_srq_wr}), {ticks} ticks x {runs} runs",
        ctx.name()
    );
    println!("links | CQ per link: CQs, us/tick | shared: CQs, us/tick | shared/per-link");
    for &n in &links {
        let own: Vec<Arc<Cq>> = (0..n)
            .map(|_| Cq::with_channel(&ctx, CONSUMER_CQ_ENTRIES as i32, &ch).expect("create CQ"))
            .collect();
        let own_us = tick_us(&own, ticks, runs);
        drop(own);
        let depth = (n * RDMA_RECVS).min(SRQ_RECVS_MAX).min(max_srq_wr);
        let per = LINK_SEND_CQ_ENTRIES;
        let per_cq = ((max_cqe - depth) / per).saturating_sub(1).max(1);
        let groups = n.div_ceil(per_cq);
        let shared: Vec<Arc<Cq>> = (0..groups)
            .map(|g| {
                let k = per_cq.min(n - g * per_cq);
                let entries = ((k + 1) * per + depth).min(max_cqe);
                Cq::with_channel(&ctx, entries as i32, &ch).expect("create CQ")
            })
            .collect();
        let shared_us = tick_us(&shared, ticks, runs);
        println!(
            "{n} | {n}, {own_us:.2} | {groups}, {shared_us:.3} | {:.4}",
            shared_us / own_us
        );
    }
}
