//! The GPU check of the local data path: batches copied from the landing
//! ring (pinned by kspeed with CUDA) to GPU memory, against copying the same
//! number of bytes from ordinary pageable memory, in the same process. A
//! batch is one contiguous span of the ring (two when it wraps), so each is
//! one `cuMemcpyHtoD` (or two).
//!
//! ```text
//! cargo run --release --example gpu_copy -- SPACE [EPOCHS=3] [BATCH=256]
//! ```
//!
//! CUDA is loaded at run time (`libcuda.so.1`); without it, or without a
//! device, the check says so and exits 0. `scripts/gpu_check.sh` runs it on
//! a machine with a GPU.

use std::ffi::{c_int, c_uint, c_void};
use std::time::Instant;

use kspeed::landing::LandingOptions;
use kspeed::loader::LoaderBuilder;
use libloading::Library;

type CuInit = unsafe extern "C" fn(c_uint) -> c_int;
type CuDeviceGet = unsafe extern "C" fn(*mut c_int, c_int) -> c_int;
type CuCtxRetain = unsafe extern "C" fn(*mut *mut c_void, c_int) -> c_int;
type CuCtxSetCurrent = unsafe extern "C" fn(*mut c_void) -> c_int;
type CuCtxRelease = unsafe extern "C" fn(c_int) -> c_int;
type CuMemAlloc = unsafe extern "C" fn(*mut u64, usize) -> c_int;
type CuMemFree = unsafe extern "C" fn(u64) -> c_int;
type CuMemcpyHtoD = unsafe extern "C" fn(u64, *const c_void, usize) -> c_int;

/// The few driver calls the check needs, from `libcuda.so.1`.
struct Cuda {
    _lib: Library,
    release: CuCtxRelease,
    alloc: CuMemAlloc,
    free: CuMemFree,
    htod: CuMemcpyHtoD,
}

fn check(what: &str, rc: c_int) -> Result<(), String> {
    if rc == 0 {
        Ok(())
    } else {
        Err(format!("{what} failed with CUDA error {rc}"))
    }
}

impl Cuda {
    /// Loads the driver and makes device 0's primary context current.
    fn open() -> Result<Cuda, String> {
        // SAFETY: loading the CUDA driver runs its initialisers, as any CUDA
        // program does; the name is the driver's fixed soname.
        let lib = unsafe { Library::new("libcuda.so.1") }
            .map_err(|e| format!("libcuda.so.1 could not be loaded: {e}"))?;
        // SAFETY: each symbol type matches the driver API's C signature
        // (CUdevice = int, CUdeviceptr = unsigned long long, CUresult = int).
        unsafe {
            let init: CuInit = *lib.get(b"cuInit\0").map_err(|e| e.to_string())?;
            let get: CuDeviceGet = *lib.get(b"cuDeviceGet\0").map_err(|e| e.to_string())?;
            let retain: CuCtxRetain = *lib
                .get(b"cuDevicePrimaryCtxRetain\0")
                .map_err(|e| e.to_string())?;
            let set: CuCtxSetCurrent = *lib.get(b"cuCtxSetCurrent\0").map_err(|e| e.to_string())?;
            let cuda = Cuda {
                release: *lib
                    .get(b"cuDevicePrimaryCtxRelease_v2\0")
                    .map_err(|e| e.to_string())?,
                alloc: *lib.get(b"cuMemAlloc_v2\0").map_err(|e| e.to_string())?,
                free: *lib.get(b"cuMemFree_v2\0").map_err(|e| e.to_string())?,
                htod: *lib.get(b"cuMemcpyHtoD_v2\0").map_err(|e| e.to_string())?,
                _lib: lib,
            };
            check("cuInit", init(0))?;
            let mut dev = 0;
            check("cuDeviceGet(0)", get(&mut dev, 0))?;
            let mut ctx = std::ptr::null_mut();
            check("cuDevicePrimaryCtxRetain", retain(&mut ctx, dev))?;
            check("cuCtxSetCurrent", set(ctx))?;
            Ok(cuda)
        }
    }
}

impl Drop for Cuda {
    fn drop(&mut self) {
        // SAFETY: releases the primary context retained in open().
        unsafe { (self.release)(0) };
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let Some(space) = args.get(1) else {
        eprintln!("usage: gpu_copy SPACE [EPOCHS=3] [BATCH=256]");
        std::process::exit(2);
    };
    let epochs: u64 = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(3);
    let batch: usize = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(256);
    if let Err(e) = run(space, epochs, batch) {
        eprintln!("gpu_copy: {e}");
        std::process::exit(1);
    }
}

fn run(space: &str, epochs: u64, batch: usize) -> Result<(), String> {
    let ring_bytes: u64 = 256 << 20;
    let mut loader = LoaderBuilder::space(space)
        .batch_size(batch)
        // Every sample in memory after the first epoch, so the copies, not
        // the disk, are what the later epochs wait for.
        .tier_bytes(8 << 30)
        .landing(LandingOptions::default().ring_bytes(ring_bytes))
        .build()
        .map_err(|e| e.to_string())?;
    let cuda_state = loader.landing_info().cuda.clone();
    println!("landing ring: {ring_bytes} bytes; {cuda_state}");
    if !cuda_state.starts_with("registered") {
        println!("GPU check skipped: the ring is not registered with CUDA ({cuda_state})");
        return Ok(());
    }
    let cuda = Cuda::open()?;
    let mut dev = 0u64;
    // SAFETY: valid out pointer; the context is current.
    check("cuMemAlloc", unsafe {
        (cuda.alloc)(&mut dev, ring_bytes as usize)
    })?;
    // Pageable reference: ordinary heap memory, touched, as large as the ring.
    let pageable = vec![1u8; ring_bytes as usize];
    let (mut pinned_s, mut pageable_s, mut bytes, mut copies) = (0f64, 0f64, 0u64, 0u64);
    let mut per_epoch = Vec::new();
    for e in 0..epochs {
        loader.set_epoch(e).map_err(|e| e.to_string())?;
        let (p0, q0, b0) = (pinned_s, pageable_s, bytes);
        while let Some(b) = loader.next_batch().map_err(|e| e.to_string())? {
            let (first, wrap) = b.spans();
            let mut at = 0u64;
            for span in std::iter::once(first).chain(wrap) {
                let t = Instant::now();
                // SAFETY: the span lies in the loader's ring (held by `b`);
                // dev + at + len stays inside the allocation (a batch is at
                // most the ring).
                check("cuMemcpyHtoD (ring)", unsafe {
                    (cuda.htod)(dev + at, span.as_ptr().cast(), span.len())
                })?;
                pinned_s += t.elapsed().as_secs_f64();
                let t = Instant::now();
                // SAFETY: the same length from the pageable buffer, which is
                // as large as the ring.
                check("cuMemcpyHtoD (pageable)", unsafe {
                    (cuda.htod)(dev + at, pageable.as_ptr().cast(), span.len())
                })?;
                pageable_s += t.elapsed().as_secs_f64();
                at += span.len() as u64;
                bytes += span.len() as u64;
                copies += 1;
            }
        }
        let gb = (bytes - b0) as f64 / 1e9;
        per_epoch.push((gb / (pinned_s - p0), gb / (pageable_s - q0)));
        println!(
            "epoch {e}: {:.3} GB copied; from the pinned ring {:.2} GB/s, from pageable memory {:.2} GB/s",
            gb,
            per_epoch[e as usize].0,
            per_epoch[e as usize].1
        );
    }
    // SAFETY: allocated above, freed once.
    unsafe { (cuda.free)(dev) };
    let gb = bytes as f64 / 1e9;
    println!(
        "all epochs: {copies} copies, {gb:.3} GB; pinned ring {:.2} GB/s, pageable {:.2} GB/s: {:.2}x",
        gb / pinned_s,
        gb / pageable_s,
        pageable_s / pinned_s
    );
    gpu_ring_memory()
}

/// The GPU-ring side (the RDMA issue's GPU check): kspeed's own device
/// allocation, a round trip through it, and its dma-buf export, which is
/// what a NIC registers for GPUDirect RDMA.
fn gpu_ring_memory() -> Result<(), String> {
    use kspeed::landing::cuda::DeviceMemory;
    let m = DeviceMemory::alloc(0, 64 << 20)?;
    let data: Vec<u8> = (0..(8u32 << 20)).map(|i| (i % 251) as u8).collect();
    m.copy_from_host(4096, &data)?;
    let mut back = vec![0u8; data.len()];
    m.copy_to_host(4096, &mut back)?;
    if back != data {
        return Err("GPU ring memory: bytes differ after a round trip".into());
    }
    match m.export_dmabuf() {
        Ok(fd) => {
            let size = std::fs::File::from(fd).metadata().map(|md| md.len());
            println!(
                "GPU ring memory: {} bytes at {:#x}, round trip exact, dma-buf export ok ({size:?} bytes)",
                m.len(),
                m.addr()
            );
        }
        Err(e) => println!(
            "GPU ring memory: {} bytes at {:#x}, round trip exact; dma-buf export failed: {e}",
            m.len(),
            m.addr()
        ),
    }
    Ok(())
}
