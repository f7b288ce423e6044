//! The landing ring's CUDA registration against stand-ins for the CUDA
//! driver and runtime (tests/c/fake_cuda.c), since no machine here has a GPU.
//! The stand-ins enforce the parts of CUDA's contract that the glue code can
//! get wrong (cuInit first, a current context for (un)registering, matching
//! unregistration) and log every call, so these tests show that `kspeed
//! read` registers the ring, unregisters exactly it, releases the context it
//! retained, and reads on (saying why) when registration fails. The real
//! libraries are tried only on machines that have them (scripts/gpu_check.sh).

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::*;

struct Run {
    stderr: String,
    log: String,
}

/// `kspeed read` of a small space with the stand-ins in `libdir` first on
/// the library path.
fn read_with(libdir: &Path, space: &Path, extra_env: &[(&str, &str)]) -> Run {
    let log = libdir.join("calls.log");
    let _ = std::fs::remove_file(&log);
    let mut cmd = Command::new(kspeed_bin());
    cmd.args([
        "read",
        "--space",
        s(space),
        "--progress=none",
        "--ring-bytes",
        "16MiB",
        "--no-mlock",
        "--epochs",
        "2",
    ])
    .env("LD_LIBRARY_PATH", libdir)
    .env("FAKE_CUDA_LOG", &log);
    for (k, v) in extra_env {
        cmd.env(k, v);
    }
    let o = cmd.output().expect("run kspeed");
    assert!(o.status.success(), "kspeed read failed:\n{}", text(&o));
    Run {
        stderr: String::from_utf8_lossy(&o.stderr).into_owned(),
        log: std::fs::read_to_string(&log).unwrap_or_default(),
    }
}

fn space(dir: &Path) -> PathBuf {
    gen("imagenet", 200, &dir.join("src"));
    let sp = dir.join("space");
    ok(&[
        "preload",
        "--source",
        s(&dir.join("src")),
        "--space",
        s(&sp),
    ]);
    sp
}

/// What the stand-in found undone when the process let go of it last (it
/// says so each time the library is unloaded; kspeed probes first, with a
/// handle it closes).
fn last_exit(log: &str) -> &str {
    log.lines().rfind(|l| l.starts_with("exit ")).unwrap_or("")
}

/// What `last_exit` says when nothing was left registered, retained or
/// allocated.
const CLEAN: &str = "exit registered=0 retained=0 allocated=0";

/// A library directory under `t` with the stand-ins built as `(define,
/// name)`; None (with a message) without gcc.
fn fakes(t: &Path, libs: &[(&str, &str)]) -> Option<PathBuf> {
    let dir = t.join("lib");
    std::fs::create_dir_all(&dir).unwrap();
    for (define, name) in libs {
        build_fake_cuda(&dir, define, name)?;
    }
    Some(dir)
}

/// The registered pointer and length from a "register PTR LEN FLAGS" line.
fn registered(log: &str) -> Vec<(String, u64)> {
    log.lines()
        .filter_map(|l| l.strip_prefix("register "))
        .map(|r| {
            let f: Vec<&str> = r.split(' ').collect();
            (f[0].to_string(), f[1].parse().unwrap())
        })
        .collect()
}

#[test]
fn driver_registration_covers_the_ring_and_is_undone() {
    let t = tempfile::tempdir().unwrap();
    let Some(libdir) = fakes(t.path(), &[("-DFAKE_DRIVER", "libcuda.so.1")]) else {
        return;
    };
    let sp = space(t.path());
    let r = read_with(&libdir, &sp, &[]);
    assert!(
        r.stderr.contains("registered with CUDA (libcuda.so.1)"),
        "{}\n{}",
        r.stderr,
        r.log
    );
    let regs = registered(&r.log);
    assert_eq!(regs.len(), 1, "one registration, the ring:\n{}", r.log);
    assert_eq!(regs[0].1, 16 << 20, "the ring's length:\n{}", r.log);
    let unreg: Vec<&str> = r
        .log
        .lines()
        .filter_map(|l| l.strip_prefix("unregister "))
        .collect();
    assert_eq!(
        unreg,
        [regs[0].0.as_str()],
        "the same pointer, once:\n{}",
        r.log
    );
    // Nothing left behind: every registration undone, every retained
    // context released.
    assert_eq!(last_exit(&r.log), CLEAN, "leaked:\n{}", r.log);
}

#[test]
fn runtime_registration_is_preferred_and_undone() {
    let t = tempfile::tempdir().unwrap();
    let libs = [
        ("-DFAKE_RUNTIME", "libcudart.so"),
        ("-DFAKE_DRIVER", "libcuda.so.1"),
    ];
    let Some(libdir) = fakes(t.path(), &libs) else {
        return;
    };
    let sp = space(t.path());
    let r = read_with(&libdir, &sp, &[]);
    assert!(
        r.stderr.contains("registered with CUDA (libcudart.so)"),
        "{}\n{}",
        r.stderr,
        r.log
    );
    assert_eq!(registered(&r.log).len(), 1, "{}", r.log);
    assert!(r.log.contains("unregister "), "{}", r.log);
    assert_eq!(last_exit(&r.log), CLEAN, "{}", r.log);
}

#[test]
fn a_failed_registration_is_reported_and_reading_goes_on() {
    let t = tempfile::tempdir().unwrap();
    let Some(libdir) = fakes(t.path(), &[("-DFAKE_DRIVER", "libcuda.so.1")]) else {
        return;
    };
    let sp = space(t.path());
    let r = read_with(&libdir, &sp, &[("FAKE_CUDA_FAIL_REGISTER", "1")]);
    assert!(
        r.stderr
            .contains("CUDA not used: libcuda.so.1: cuMemHostRegister failed with error 2"),
        "{}\n{}",
        r.stderr,
        r.log
    );
    assert_eq!(
        last_exit(&r.log),
        CLEAN,
        "the context retained for the attempt must be released:\n{}",
        r.log
    );
}

/// The body of `gpu_memory_alloc_copy_export_free`, run in a child process
/// started with the driver stand-in on its library path (the dynamic loader
/// reads LD_LIBRARY_PATH only at start).
fn gpu_memory_body() {
    use kspeed::landing::cuda::DeviceMemory;
    let m = DeviceMemory::alloc(0, 3 << 20).expect("alloc on the stand-in");
    assert_eq!(m.len(), 4 << 20, "rounded up to 2 MiB");
    assert_eq!(m.addr() % (2 << 20), 0);
    let data: Vec<u8> = (0..100_000u32).map(|i| (i * 7 + 3) as u8).collect();
    m.copy_from_host(12_345, &data).unwrap();
    let mut back = vec![0u8; data.len()];
    m.copy_to_host(12_345, &mut back).unwrap();
    assert_eq!(back, data, "bytes round-trip through GPU memory");
    let e = m.copy_from_host((4 << 20) - 10, &data).unwrap_err();
    assert!(e.contains("outside the 4194304-byte GPU allocation"), "{e}");
    let fd = m.export_dmabuf().expect("dma-buf export");
    let f = std::fs::File::from(fd);
    assert_eq!(
        f.metadata().unwrap().len(),
        4 << 20,
        "the export covers the allocation"
    );
    let e = DeviceMemory::alloc(5, 1 << 20)
        .err()
        .expect("device 5 does not exist");
    assert!(e.contains("no CUDA device 5"), "{e}");
    drop(m);
}

#[test]
fn gpu_memory_alloc_copy_export_free() {
    if std::env::var_os("KSPEED_FAKE_CUDA_CHILD").is_some() {
        gpu_memory_body();
        return;
    }
    // Without CUDA (this process has no stand-in), a named error.
    if let Err(e) = kspeed::landing::cuda::DeviceMemory::alloc(0, 1 << 20) {
        assert!(
            e.contains("GPU memory needs the CUDA driver library"),
            "{e}"
        );
    }
    let t = tempfile::tempdir().unwrap();
    if build_fake_cuda(t.path(), "-DFAKE_DRIVER", "libcuda.so.1").is_none() {
        return;
    }
    let log = t.path().join("calls.log");
    let o = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "gpu_memory_alloc_copy_export_free",
            "--nocapture",
        ])
        .env("KSPEED_FAKE_CUDA_CHILD", "1")
        .env("LD_LIBRARY_PATH", t.path())
        .env("FAKE_CUDA_LOG", &log)
        .output()
        .unwrap();
    let log = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(o.status.success(), "child failed:\n{}\n{log}", text(&o));
    assert!(
        log.contains("set attribute 6 = 1"),
        "SYNC_MEMOPS set:\n{log}"
    );
    assert!(log.contains("export "), "{log}");
    assert_eq!(last_exit(&log), CLEAN, "freed and released:\n{log}");
}
