//! Class names through the C ABI: tests/c/classes_test.c, compiled against
//! include/kspeed.h and the freshly built libkspeed.so, over a real
//! ImageFolder space whose class folders include one that is not UTF-8.

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

#[test]
fn class_names_through_the_c_abi() {
    let t = tempfile::tempdir().unwrap();
    let src = t.path().join("src");
    odd_tree(&src); // classes cat, dog, eel
    let odd = src.join(OsStr::from_bytes(b"fish\xff"));
    std::fs::create_dir_all(&odd).unwrap();
    std::fs::write(odd.join("f.bin"), b"fish").unwrap();
    let sp = t.path().join("space");
    ok(&["preload", "--source", s(&src), "--space", s(&sp)]);

    let Some(bin) = compile(t.path()) else {
        return;
    };
    let o = Command::new(&bin)
        .arg(&sp)
        .args(["cat", "dog", "eel"])
        .arg(OsStr::from_bytes(b"fish\xff"))
        .output()
        .unwrap();
    assert!(
        o.status.success() && String::from_utf8_lossy(&o.stdout).contains("all checks passed"),
        "{}",
        text(&o)
    );
}

#[test]
fn sample_members_through_the_c_abi() {
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
    let Some(bin) = compile(t.path()) else {
        return;
    };
    let o = Command::new(&bin)
        .arg(&sp)
        .args(["--members", "jpg", "txt", "json"])
        .output()
        .unwrap();
    assert!(
        o.status.success() && String::from_utf8_lossy(&o.stdout).contains("all checks passed"),
        "{}",
        text(&o)
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
