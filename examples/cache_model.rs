//! The cache model behind docs/CACHE.md: hit rates of a cache holding a
//! fraction of the dataset, over the reads of one node's ranks under the
//! real sampler, for three policies side by side:
//!
//! - *static*: a fixed subset (the first ids), each member filled when the
//!   node first reads it and never evicted (the memory tier of a rank
//!   alone, and the agent's node tier, `src/loader/tier.rs`);
//! - *by reads*: a fixed subset of the samples the node reads most often
//!   over the epochs modelled, filled and kept the same way (a rank of
//!   several's memory tier, `Tier::by_reads`);
//! - *LRU*: what the page cache and the peers' `cache_limit` eviction do;
//! - *next use*: Belady's MIN driven by the sampler's computed future
//!   (`kspeed::cache::Belady` with `kspeed::sampler::NextUse`), which is
//!   the optimal policy for samples of one size.
//!
//! `cargo run --release --example cache_model [-- SAMPLES EPOCHS]`
//! (default 100,000 samples, 4 epochs) prints the Markdown table. The
//! "bound" column is the share of reads that read a sample the node read
//! before: what a cache of unlimited size would hit (no policy does more).
//!
//! A second table weighs the writes (docs/CACHE.md, "Writes"): one rank's
//! cache area under MIN (`cache_policy=min`, `Belady::read`) and under
//! `next-use` (`Belady::read_weighing_writes` with
//! `NextUse::swap_horizon`), hits and writes over every epoch.

use kspeed::cache::{Belady, Decision, Lru};
use kspeed::sampler::{NextUse, Sampler, SamplerConfig};

/// (nodes, ranks per node): node 0's ranks' reads are the cache's.
const JOBS: &[(u32, u32)] = &[(1, 8), (8, 8), (64, 8), (4, 1), (8, 1)];
const FRACTIONS: &[f64] = &[0.1, 0.25, 0.5, 0.75];
/// World sizes of the writes table (one rank's reads are its cache's).
const WORLDS: &[u32] = &[1, 2, 4, 8];
const AREA_FRACTIONS: &[f64] = &[0.02, 0.1, 0.25, 0.6];

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
    println!("| nodes x ranks | node reads per epoch | cache (of the dataset) | static | by reads | LRU | next use | bound | next use / LRU | next use / static | by reads / static |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    for &(nodes, per_node) in JOBS {
        let world = nodes * per_node;
        let sampler =
            Sampler::new(SamplerConfig::single(samples, 42).rank_world(0, world)).expect("sampler");
        let next = NextUse::new(&sampler, Some(0..per_node), Some(epochs)).expect("next use");
        let steps = sampler.per_rank() * world as u64;
        // The node's reads of each sample over the epochs modelled.
        let mut counts = vec![0u32; samples as usize];
        for e in 0..epochs {
            let order = sampler.epoch(e);
            for j in (0..steps).filter(|j| ((j % world as u64) as u32) < per_node) {
                counts[order.global(j) as usize] += 1;
            }
        }
        let mut by_reads: Vec<u64> = (0..samples).collect();
        by_reads.sort_by_key(|&id| (std::cmp::Reverse(counts[id as usize]), id));
        for &f in FRACTIONS {
            let capacity = ((samples as f64) * f) as u64;
            let mut member = vec![false; samples as usize];
            for &id in &by_reads[..capacity as usize] {
                member[id as usize] = true;
            }
            let mut hits_reads = 0u64;
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
                    let hit_reads = member[id as usize] && before;
                    let hit_lru = lru.read(id, 1);
                    let hit_next = belady.read(id, 1, next.after(id, t), |_| {}) == Decision::Hit;
                    if counted {
                        reads += 1;
                        hits_static += hit_static as u64;
                        hits_reads += hit_reads as u64;
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
                "| {nodes} x {per_node} | {per_epoch} | {:.0}% | {:.1}% | {:.1}% | {:.1}% | {:.1}% | {:.1}% | {:.1}x | {:.2}x | {:.2}x |",
                f * 100.0,
                rate(hits_static) * 100.0,
                rate(hits_reads) * 100.0,
                rate(hits_lru) * 100.0,
                rate(hits_next) * 100.0,
                rate(rereads) * 100.0,
                rate(hits_next) / rate(hits_lru).max(1e-9),
                rate(hits_next) / rate(hits_static).max(1e-9),
                rate(hits_reads) / rate(hits_static).max(1e-9),
            );
        }
    }
    writes_table(samples, epochs);
}

/// MIN against `next-use` for one rank's cache area: hits and writes.
fn writes_table(samples: u64, epochs: u64) {
    println!();
    println!(
        "One rank's cache area, {samples} samples, {epochs} epochs, every epoch counted: MIN \
         (`min`) against MIN weighing its writes (`next-use`)"
    );
    println!();
    println!("| ranks | area (of the dataset) | MIN hits | next-use hits | hits next-use / MIN | MIN writes | next-use writes | writes next-use / MIN |");
    println!("|---|---|---|---|---|---|---|---|");
    for &world in WORLDS {
        let sampler =
            Sampler::new(SamplerConfig::single(samples, 42).rank_world(0, world)).expect("sampler");
        let next = NextUse::new(&sampler, Some(0..1), Some(epochs)).expect("next use");
        let horizon = next.swap_horizon();
        let steps = sampler.per_rank() * world as u64;
        for &f in AREA_FRACTIONS {
            let capacity = (((samples / world as u64) as f64) * f * world as f64) as u64;
            let mut min = Belady::new(capacity, capacity as usize);
            let mut weigh = Belady::new(capacity, capacity as usize);
            let (mut hits, mut writes) = ([0u64; 2], [0u64; 2]);
            for e in 0..epochs {
                let order = sampler.epoch(e);
                for j in (0..steps).step_by(world as usize) {
                    let id = order.global(j);
                    let n = next.after(id, next.time(e, j));
                    let decisions = [
                        min.read(id, 1, n, |_| {}),
                        weigh.read_weighing_writes(id, 1, n, || next.after(id, n), horizon, |_| {}),
                    ];
                    for (k, d) in decisions.into_iter().enumerate() {
                        hits[k] += (d == Decision::Hit) as u64;
                        writes[k] += (d == Decision::Admit) as u64;
                    }
                }
            }
            println!(
                "| {world} | {:.0}% | {} | {} | {:.3} | {} | {} | {:.2} |",
                f * 100.0,
                hits[0],
                hits[1],
                hits[1] as f64 / hits[0].max(1) as f64,
                writes[0],
                writes[1],
                writes[1] as f64 / writes[0].max(1) as f64,
            );
        }
    }
}
