//! What a naive loader does, as a baseline for `kspeed read`: read every
//! source file of a catalog in the sampler's order with plain `pread`, from
//! one thread (`loop`) or a pool of threads (`pool N`), and report samples/s,
//! GB/s and CPU seconds.
//!
//! cargo run --release --example naive_read -- CATALOG loop|pool N [SEED]

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use kspeed::dataset::Catalog;
use kspeed::progress::process_cpu_seconds;
use kspeed::sampler::{Sampler, SamplerConfig};

fn read_one(cat: &Catalog, id: u64, buf: &mut Vec<u8>) -> u64 {
    let s = cat.sample(id);
    buf.resize(s.len as usize, 0);
    let f = File::open(cat.file_path(s.file)).expect("open source file");
    f.read_exact_at(buf, s.offset).expect("read source file");
    s.len as u64
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 3 {
        eprintln!("usage: naive_read CATALOG loop|pool N [SEED]");
        std::process::exit(2);
    }
    let cat = Catalog::open(args[1].as_ref()).expect("open catalog");
    let threads: usize = if args[2] == "pool" {
        args[3].parse().expect("thread count")
    } else {
        1
    };
    let seed: u64 = args
        .get(if args[2] == "pool" { 4 } else { 3 })
        .map_or(0, |s| s.parse().expect("seed"));
    let sampler = Sampler::new(SamplerConfig::single(cat.len(), seed)).expect("sampler");
    let order = sampler.epoch(0);
    let n = sampler.per_rank();
    let cpu0 = process_cpu_seconds();
    let t0 = Instant::now();
    let next = AtomicU64::new(0);
    let bytes = AtomicU64::new(0);
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| {
                let mut buf = Vec::new();
                loop {
                    let k = next.fetch_add(1, Ordering::Relaxed);
                    if k >= n {
                        break;
                    }
                    bytes.fetch_add(read_one(&cat, order.sample(k), &mut buf), Ordering::Relaxed);
                }
            });
        }
    });
    let secs = t0.elapsed().as_secs_f64();
    let b = bytes.into_inner() as f64;
    println!(
        "naive {} ({} threads): {n} samples in {secs:.2} s: {:.0} samples/s, {:.3} GB/s, CPU {:.2} s ({:.2} s per GB)",
        args[2],
        threads,
        n as f64 / secs,
        b / secs / 1e9,
        process_cpu_seconds() - cpu0,
        (process_cpu_seconds() - cpu0) / (b / 1e9)
    );
}
