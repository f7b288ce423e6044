//! Helpers shared by the integration tests: run the real `kspeed` binary and
//! make small datasets on disk.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// Reads one protocol frame (header and body) from a peer: what the tests'
/// hand-written nodes and consumers do.
pub fn read_frame(
    c: &mut impl std::io::Read,
) -> std::io::Result<(kspeed::transport::proto::Header, Vec<u8>)> {
    use kspeed::transport::proto::{Header, HEADER_BYTES};
    let mut hb = [0u8; HEADER_BYTES];
    c.read_exact(&mut hb)?;
    let h = Header::decode(&hb, u32::MAX)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e.to_string()))?;
    let mut body = vec![0u8; h.body_len as usize];
    c.read_exact(&mut body)?;
    Ok((h, body))
}

pub fn kspeed_bin() -> &'static str {
    env!("CARGO_BIN_EXE_kspeed")
}

/// Runs `kspeed ARGS` with plain progress lines and returns its output.
pub fn kspeed(args: &[&str]) -> Output {
    Command::new(kspeed_bin())
        .args(args)
        .arg("--progress=none")
        .output()
        .expect("run kspeed")
}

pub fn text(o: &Output) -> String {
    format!(
        "status {:?}\n--- stdout\n{}--- stderr\n{}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// Asserts success and returns stdout.
pub fn ok(args: &[&str]) -> String {
    let o = kspeed(args);
    assert!(o.status.success(), "kspeed {args:?} failed:\n{}", text(&o));
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// Asserts exit status `code` and returns stdout + stderr.
pub fn fails(args: &[&str], code: i32) -> String {
    let o = kspeed(args);
    assert_eq!(
        o.status.code(),
        Some(code),
        "kspeed {args:?}:\n{}",
        text(&o)
    );
    text(&o)
}

pub fn s(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

/// Writes `bytes` to `dir/rel`, creating parents.
pub fn put(dir: &Path, rel: &str, bytes: &[u8]) -> PathBuf {
    let p = dir.join(rel);
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    std::fs::write(&p, bytes).unwrap();
    p
}

/// Deterministic bytes of length `len` for sample `i`.
pub fn bytes_for(i: u64, len: usize) -> Vec<u8> {
    let mut x = i.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// An ImageFolder tree with awkward sizes: 0, 1, 4095, 4096, 4097 bytes and
/// some larger ones, three classes and one unlabeled file at the root.
pub fn odd_tree(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let sizes = [
        0usize, 1, 4095, 4096, 4097, 10_000, 65_536, 300_000, 7, 12_345, 8191, 2,
    ];
    let mut files = Vec::new();
    for (i, len) in sizes.iter().enumerate() {
        let class = ["cat", "dog", "eel"][i % 3];
        let rel = format!("{class}/img_{i:03}.bin");
        let b = bytes_for(i as u64, *len);
        put(dir, &rel, &b);
        files.push((rel, b));
    }
    let b = bytes_for(99, 5000);
    put(dir, "loose.bin", &b);
    files.push(("loose.bin".into(), b));
    files
}

/// Generates a dataset with `kspeed gen`.
pub fn gen(profile: &str, count: u64, out: &Path) {
    ok(&[
        "gen",
        "--profile",
        profile,
        "--count",
        &count.to_string(),
        "--out",
        s(out),
        "--seed",
        "7",
    ]);
}

pub fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

/// Builds the CUDA stand-in (tests/c/fake_cuda.c) with `define`
/// (`-DFAKE_DRIVER` or `-DFAKE_RUNTIME`) as `dir/name`; None (with a
/// message) without gcc.
pub fn build_fake_cuda(dir: &Path, define: &str, name: &str) -> Option<PathBuf> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/c/fake_cuda.c");
    let out = dir.join(name);
    match Command::new("gcc")
        .args(["-shared", "-fPIC", "-O1", "-Wall", "-Werror", define, "-o"])
        .arg(&out)
        .arg(&src)
        .output()
    {
        Ok(o) if o.status.success() => Some(out),
        Ok(o) => panic!("gcc failed:\n{}", String::from_utf8_lossy(&o.stderr)),
        Err(e) => {
            skip(&format!("gcc not available ({e})"));
            None
        }
    }
}

/// A test that cannot run on this machine (a tool, privilege or device is
/// missing) says so and passes, except under `KSPEED_REQUIRE=all` (set by
/// `.ci/run`), where a skip is a failure: CI must run everything.
pub fn skip(why: &str) {
    if std::env::var("KSPEED_REQUIRE").as_deref() == Ok("all") {
        panic!("KSPEED_REQUIRE=all: this test must run, but {why}");
    }
    eprintln!("skipping: {why}");
}

/// The freshly built C library: the kspeed-capi crate's cdylib, which
/// cargo names libkspeed_capi.so (scripts/install.sh installs it as
/// libkspeed.so.*). Test builds refresh target/<profile>/deps/ but not
/// always the copy one level up: the newer of the two.
pub fn built_library() -> PathBuf {
    let target = Path::new(kspeed_bin()).parent().unwrap().to_path_buf();
    [
        target.join("deps/libkspeed_capi.so"),
        target.join("libkspeed_capi.so"),
    ]
    .into_iter()
    .filter_map(|p| Some((std::fs::metadata(&p).ok()?.modified().ok()?, p)))
    .max()
    .map(|(_, p)| p)
    .expect("libkspeed_capi.so (kspeed-capi, a dev-dependency) is built with the tests")
}

/// Compiles `source` (relative to the crate) with `compiler` against
/// include/ (and ffi/cpp) and the built library, as `out`; None (with a
/// message) when the compiler is missing.
pub fn compile_with(
    compiler: &str,
    std_flag: &str,
    source: &str,
    out: &Path,
    extra: &[&str],
) -> Option<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let built = built_library();
    // Programs record the soname (libkspeed.so.ABI), which cargo does not
    // create; an install does (scripts/install.sh). Link through a
    // directory holding both names (-lkspeed finds libkspeed.so).
    let lib = out.parent().unwrap().join("lib");
    std::fs::create_dir_all(&lib).unwrap();
    for name in [
        "libkspeed.so",
        &format!("libkspeed.so.{}", kspeed_capi::KSP_ABI_VERSION),
    ] {
        let _ = std::fs::remove_file(lib.join(name));
        std::os::unix::fs::symlink(&built, lib.join(name)).unwrap();
    }
    let mut cmd = Command::new(compiler);
    cmd.args([std_flag, "-Wall", "-Wextra", "-Werror", "-g", "-O1"])
        .args(extra)
        .arg("-I")
        .arg(root.join("include"))
        .arg("-I")
        .arg(root.join("ffi/cpp"))
        .arg(root.join(source))
        .arg("-o")
        .arg(out)
        .arg("-L")
        .arg(&lib)
        .arg(format!("-Wl,-rpath,{}", lib.display()))
        .arg("-lkspeed");
    match cmd.output() {
        Ok(o) if o.status.success() => Some(out.to_path_buf()),
        Ok(o) => panic!("{compiler} failed:\n{}", String::from_utf8_lossy(&o.stderr)),
        Err(e) => {
            skip(&format!("{compiler} not available ({e})"));
            None
        }
    }
}

/// A landing ring of `bytes` for tests: no huge pages, no mlock, no NUMA
/// binding, no GPU, no CUDA (what any test machine can give).
pub fn test_ring(bytes: u64) -> kspeed::landing::LandingOptions {
    kspeed::landing::LandingOptions::default()
        .ring_bytes(bytes)
        .huge_pages(false)
        .mlock(false)
        .numa_node(None)
        .gpu_pci(None)
        .cuda(kspeed::landing::CudaMode::Off)
}
