//! Time to compute sampler positions: 10 million consecutive steps of one
//! rank's sequence (across epochs where needed), for a 1.28M-sample
//! (ImageNet) and a 1-billion-sample dataset, shuffled, rank 3 of 8. Prints the median of 5 runs.
//!
//! cargo bench --bench sampler

use std::hint::black_box;
use std::time::Instant;

use kspeed::sampler::{Position, Sampler, SamplerConfig};

fn run(len: u64, steps: u64) -> f64 {
    let s = Sampler::new(
        SamplerConfig::single(len, 42)
            .rank_world(3, 8)
            .shuffle(true)
            .drop_last(false),
    )
    .unwrap();
    let t0 = Instant::now();
    let mut acc = 0u64;
    let (mut done, mut epoch) = (0u64, 0u64);
    // Consecutive steps, crossing epochs where the rank's epoch is shorter.
    while done < steps {
        let n = (steps - done).min(s.per_rank());
        for id in s.iter_from(Position { epoch, index: 0 }).take(n as usize) {
            acc = acc.wrapping_add(id);
        }
        done += n;
        epoch += 1;
    }
    black_box(acc);
    t0.elapsed().as_secs_f64()
}

fn main() {
    const STEPS: u64 = 10_000_000;
    for len in [1_281_167u64, 1_000_000_000] {
        let mut times: Vec<f64> = (0..5).map(|_| run(len, STEPS)).collect();
        times.sort_by(|a, b| a.partial_cmp(b).unwrap());
        let med = times[2];
        println!(
            "sampler: dataset {len} samples, {STEPS} positions: median {:.3} s ({:.1} ns/position, runs {:?})",
            med,
            med * 1e9 / STEPS as f64,
            times.iter().map(|t| format!("{t:.3}")).collect::<Vec<_>>()
        );
    }
}
