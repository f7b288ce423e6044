//! The cache model behind docs/CACHE.md: hit rates of a cache holding a
//! fraction of the dataset, over the reads of one node's ranks under the
//! real sampler, for three policies side by side:
//!
//! - *static*: a fixed subset (the first ids), each member filled when the
//!   node first reads it and never evicted (today's memory tier,
//!   `src/loader/tier.rs`);
//! - *LRU*: what the page cache and the peers' `cache_limit` eviction do;
//! - *next use*: Belady's MIN driven by the sampler's computed future
//!   (`kspeed::cache::Belady` with `kspeed::sampler::NextUse`), which is
//!   the optimal policy for samples of one size.
//!
//! `cargo run --release --example cache_model [-- SAMPLES EPOCHS]`
//! (default 100,000 samples, 4 epochs) prints the Markdown table. The
//! "bound" column is the share of reads that read a sample the node read
//! before: what a cache of unlimited size would hit (no policy does more).

use kspeed::cache::{Belady, Decision, Lru};
use kspeed::sampler::{NextUse, Sampler, SamplerConfig};

/// (nodes, ranks per node): node 0's ranks' reads are the cache's.
const JOBS: &[(u32, u32)] = &[(1, 8), (8, 8), (64, 8)];
const FRACTIONS: &[f64] = &[0.1, 0.25, 0.5, 0.75];

fn main() {
    let args: Vec<u64> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("SAMPLES EPOCHS"))
        .collect();
    let samples = args.first().copied().unwrap_or(100_000);
    let epochs = args.get(1).copied().unwrap_or(4).max(2);
    println!(
        "{samples} samples of one size, seed 42, shuffled every epoch; hit rates of epochs 2-{epochs} \
         together (epoch 1 starts empty), node 0's reads"
    );
    println!();
    println!("| nodes x ranks | node reads per epoch | cache (of the dataset) | static | LRU | next use | bound | next use / LRU | next use / static |");
    println!("|---|---|---|---|---|---|---|---|---|");
    for &(nodes, per_node) in JOBS {
        let world = nodes * per_node;
        let sampler =
            Sampler::new(SamplerConfig::single(samples, 42).rank_world(0, world)).expect("sampler");
        let next = NextUse::new(&sampler, Some(0..per_node), Some(epochs)).expect("next use");
        let steps = sampler.per_rank() * world as u64;
        for &f in FRACTIONS {
            let capacity = ((samples as f64) * f) as u64;
            let mut belady = Belady::new(capacity, capacity as usize);
            let mut lru = Lru::new(capacity);
            let (mut reads, mut hits_static, mut hits_lru, mut hits_next) = (0u64, 0, 0, 0);
            let mut seen = vec![false; samples as usize];
            let mut rereads = 0u64;
            let mut per_epoch = 0u64;
            for e in 0..epochs {
                let order = sampler.epoch(e);
                for j in (0..steps).filter(|j| ((j % world as u64) as u32) < per_node) {
                    let id = order.global(j);
                    let t = next.time(e, j);
                    let counted = e > 0;
                    // Static: the first `capacity` ids, filled on first read.
                    let before = std::mem::replace(&mut seen[id as usize], true);
                    let hit_static = id < capacity && before;
                    let hit_lru = lru.read(id, 1);
                    let hit_next = belady.read(id, 1, next.after(id, t), |_| {}) == Decision::Hit;
                    if counted {
                        reads += 1;
                        hits_static += hit_static as u64;
                        hits_lru += hit_lru as u64;
                        hits_next += hit_next as u64;
                        rereads += before as u64;
                    } else {
                        per_epoch += 1;
                    }
                }
            }
            let rate = |h: u64| h as f64 / reads.max(1) as f64;
            println!(
                "| {nodes} x {per_node} | {per_epoch} | {:.0}% | {:.1}% | {:.1}% | {:.1}% | {:.1}% | {:.1}x | {:.2}x |",
                f * 100.0,
                rate(hits_static) * 100.0,
                rate(hits_lru) * 100.0,
                rate(hits_next) * 100.0,
                rate(rereads) * 100.0,
                rate(hits_next) / rate(hits_lru).max(1e-9),
                rate(hits_next) / rate(hits_static).max(1e-9),
            );
        }
    }
}
