//! Class names and sample members through the C ABI and the C++ wrapper:
//! tests/c/classes_test.c and tests/c/classes_cpp.cpp, compiled against
//! include/kspeed.h (ffi/cpp/kspeed.hpp) and the freshly built
//! libkspeed.so, over a real ImageFolder space whose class folders include
//! one that is not UTF-8, and tar shards of three members a sample.

mod agent_support;
mod common;

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use common::*;

/// Compiles tests/c/classes_test.c into `dir`; None (with a message) without gcc.
fn compile(dir: &Path) -> Option<PathBuf> {
    compile_with(
        "gcc",
        "-std=c11",
        "tests/c/classes_test.c",
        &dir.join("classes_test"),
        &[],
    )
}

/// Compiles tests/c/classes_cpp.cpp (the same checks through the C++
/// wrapper) into `dir`; None (with a message) without g++.
fn compile_cpp(dir: &Path) -> Option<PathBuf> {
    compile_with(
        "g++",
        "-std=c++17",
        "tests/c/classes_cpp.cpp",
        &dir.join("classes_cpp"),
        &[],
    )
}

/// Runs each of `bins` with `args` and checks it passed (each within
/// 60 s).
fn passes(bins: &[PathBuf], args: &[&OsStr]) {
    for bin in bins {
        let child = Command::new(bin)
            .args(args)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let o = agent_support::wait_output(child, std::time::Duration::from_secs(60));
        assert!(
            o.status.success() && String::from_utf8_lossy(&o.stdout).contains("all checks passed"),
            "{}: {}",
            bin.display(),
            text(&o)
        );
    }
}

#[test]
fn class_names_through_the_c_abi_and_the_cpp_wrapper() {
    let t = tempfile::tempdir().unwrap();
    let src = t.path().join("src");
    odd_tree(&src); // classes cat, dog, eel
    let odd = src.join(OsStr::from_bytes(b"fish\xff"));
    std::fs::create_dir_all(&odd).unwrap();
    std::fs::write(odd.join("f.bin"), b"fish").unwrap();
    let sp = t.path().join("space");
    ok(&["preload", "--source", s(&src), "--space", s(&sp)]);

    let (Some(c), Some(cpp)) = (compile(t.path()), compile_cpp(t.path())) else {
        return;
    };
    // A name longer than the C++ wrapper's first buffer (64 bytes) too.
    let long = "l".repeat(100);
    std::fs::create_dir_all(src.join(&long)).unwrap();
    std::fs::write(src.join(&long).join("l.bin"), b"long").unwrap();
    let sp2 = t.path().join("space2");
    ok(&["preload", "--source", s(&src), "--space", s(&sp2)]);
    let fish = OsStr::from_bytes(b"fish\xff");
    let names = ["cat", "dog", "eel"].map(OsStr::new);
    passes(
        &[c.clone(), cpp.clone()],
        &[&[sp.as_os_str()], &names[..], &[fish]].concat(),
    );
    passes(
        &[c, cpp],
        &[&[sp2.as_os_str()], &names[..], &[fish, OsStr::new(&long)]].concat(),
    );
}

#[test]
fn sample_members_through_the_c_abi_and_the_cpp_wrapper() {
    let t = tempfile::tempdir().unwrap();
    let m = t.path().join("m");
    std::fs::create_dir_all(&m).unwrap();
    let mut names = Vec::new();
    for i in 0..9u64 {
        let jpg = bytes_for(i, 500 + i as usize * 97);
        std::fs::write(m.join(format!("{i:05}.jpg")), &jpg).unwrap();
        names.push(format!("{i:05}.jpg"));
        for e in ["json", "txt"] {
            // The sample id is the key's index (one shard, keys in order).
            std::fs::write(m.join(format!("{i:05}.{e}")), format!("{e} of {i}")).unwrap();
            names.push(format!("{i:05}.{e}"));
        }
    }
    let shard = t.path().join("s.tar");
    let st = Command::new("tar")
        .arg("-cf")
        .arg(&shard)
        .arg("-C")
        .arg(&m)
        .args(&names)
        .status()
        .unwrap();
    assert!(st.success());
    let sp = t.path().join("space");
    ok(&[
        "preload",
        "--source",
        &format!("tar:{}", shard.display()),
        "--space",
        s(&sp),
        "--members",
        "jpg,txt,json",
    ]);
    let (Some(c), Some(cpp)) = (compile(t.path()), compile_cpp(t.path())) else {
        return;
    };
    passes(
        &[c, cpp],
        &[sp.as_os_str()]
            .into_iter()
            .chain(["--members", "jpg", "txt", "json"].map(OsStr::new))
            .collect::<Vec<_>>(),
    );
}

#[test]
fn a_loader_from_c_lifts_the_open_files_limit() {
    if Command::new("prlimit").arg("--version").output().is_err() {
        skip("no prlimit");
        return;
    }
    let t = tempfile::tempdir().unwrap();
    let src = t.path().join("src");
    ok(&[
        "gen",
        "--profile",
        "imagenet",
        "--count",
        "80",
        "--classes",
        "2",
        "--out",
        s(&src),
    ]);
    let sp = t.path().join("space");
    // 4 KiB extents: 80+ extent files, all opened by the loader.
    ok(&[
        "preload",
        "--source",
        s(&src),
        "--space",
        s(&sp),
        "--extent-bytes",
        "4KiB",
    ]);
    let Some(bin) = compile(t.path()) else {
        return;
    };
    let o = Command::new("prlimit")
        .arg("--nofile=32:4096")
        .arg(&bin)
        .arg(&sp)
        .args(["class_000", "class_001"])
        .output()
        .unwrap();
    assert!(
        o.status.success() && String::from_utf8_lossy(&o.stdout).contains("all checks passed"),
        "{}",
        text(&o)
    );
}
