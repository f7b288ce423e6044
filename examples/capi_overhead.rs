//! The per-batch cost of the C ABI against the Rust API: nanoseconds per
//! next_batch + release pair on an in-memory dataset (every sample in the
//! memory tier, read once to fill it), batch size 1 so the pair itself
//! dominates. Both loops run in this process, alternately, over the same
//! space; the C loop calls the exported `ksp_*` functions (the code C calls
//! through libkspeed.so, minus one PLT jump).
//!
//! ```text
//! cargo run --release --example capi_overhead -- SPACE [ROUNDS]
//! ```

use std::time::Instant;

use kspeed::landing::{CudaMode, LandingOptions};
use kspeed::loader::LoaderBuilder;
use kspeed_capi::*;

fn rust_round(space: &str) -> (f64, f64, u64) {
    let mut l = LoaderBuilder::space(space)
        .batch_size(1)
        .tier_bytes(1 << 30)
        .pin(false)
        .landing(
            LandingOptions::default()
                .ring_bytes(64 << 20)
                .huge_pages(true)
                .mlock(false)
                .numa_node(None)
                .gpu_pci(None)
                .cuda(CudaMode::Off),
        )
        .build()
        .expect("loader");
    // Epoch 0 fills the tier; epoch 1 is timed.
    while l.next_batch().expect("batch").is_some() {}
    l.set_epoch(1).expect("epoch");
    let stall0 = l.stats().stall;
    let t0 = Instant::now();
    let mut n = 0u64;
    while let Some(b) = l.next_batch().expect("batch") {
        std::hint::black_box(b.get(0).bytes.as_ptr());
        n += 1;
    }
    let secs = t0.elapsed().as_secs_f64();
    let stall = (l.stats().stall - stall0).as_secs_f64();
    (secs * 1e9 / n as f64, stall * 1e9 / n as f64, n)
}

fn c_round(space: &str) -> (f64, f64, u64) {
    let set = |c: *mut ksp_config, k: &str, v: &str| {
        let (k, v) = (
            std::ffi::CString::new(k).unwrap(),
            std::ffi::CString::new(v).unwrap(),
        );
        // SAFETY: live config, NUL-terminated strings.
        let st = unsafe { ksp_config_set(c, k.as_ptr(), v.as_ptr()) };
        assert_eq!(st, ksp_status::KSP_OK);
    };
    let mut cfg = std::ptr::null_mut();
    // SAFETY: cfg is a valid out-pointer; the handles are used by this
    // thread only and freed below.
    unsafe {
        assert_eq!(ksp_config_new(&mut cfg), ksp_status::KSP_OK);
        for (k, v) in [
            ("space", space),
            ("batch_size", "1"),
            ("tier_bytes", "1GiB"),
            ("pin", "false"),
            ("mlock", "false"),
            ("ring_bytes", "64MiB"),
        ] {
            set(cfg, k, v);
        }
        let mut l = std::ptr::null_mut();
        assert_eq!(ksp_loader_new(cfg, &mut l), ksp_status::KSP_OK);
        ksp_config_free(cfg);
        let mut b = ksp_batch::default();
        loop {
            assert_eq!(ksp_loader_next_batch(l, &mut b), ksp_status::KSP_OK);
            if b.count == 0 {
                break;
            }
            ksp_loader_release_batch(l, b.seq);
        }
        assert_eq!(ksp_loader_set_epoch(l, 1), ksp_status::KSP_OK);
        let mut st = ksp_stats::default();
        ksp_loader_stats(l, &mut st);
        let stall0 = st.stall_s;
        let t0 = Instant::now();
        let mut n = 0u64;
        loop {
            ksp_loader_next_batch(l, &mut b);
            if b.count == 0 {
                break;
            }
            std::hint::black_box((*b.samples).data);
            ksp_loader_release_batch(l, b.seq);
            n += 1;
        }
        let secs = t0.elapsed().as_secs_f64();
        ksp_loader_stats(l, &mut st);
        ksp_loader_free(l);
        (
            secs * 1e9 / n as f64,
            (st.stall_s - stall0) * 1e9 / n as f64,
            n,
        )
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let space = args.get(1).expect("usage: capi_overhead SPACE [ROUNDS]");
    let rounds: usize = args.get(2).map_or(5, |r| r.parse().expect("ROUNDS"));
    let (mut rust, mut c) = (Vec::new(), Vec::new());
    for r in 0..rounds {
        let a = rust_round(space);
        let b = c_round(space);
        println!(
            "round {r}: Rust {:.0} ns/pair (stall {:.0}), C ABI {:.0} ns/pair (stall {:.0}), {} batches",
            a.0, a.1, b.0, b.1, a.2
        );
        rust.push(a);
        c.push(b);
    }
    // Per round, the time not spent waiting for data: the calls' own cost.
    let med = |v: &[(f64, f64, u64)]| {
        let mut x: Vec<f64> = v.iter().map(|r| r.0 - r.1).collect();
        x.sort_by(f64::total_cmp);
        x[x.len() / 2]
    };
    let (r, cc) = (med(&rust), med(&c));
    println!(
        "median time in the calls (not waiting for data): Rust {r:.0} ns per next_batch+release, C ABI {cc:.0} ns: C ABI overhead {:.0} ns per pair",
        cc - r
    );
}
