//! Class names through the C ABI: tests/c/classes_test.c, compiled against
//! include/kspeed.h and the freshly built libkspeed.so, over a real
//! ImageFolder space whose class folders include one that is not UTF-8.

mod common;

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use common::*;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
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

    let target = Path::new(kspeed_bin()).parent().unwrap().to_path_buf();
    let built = [
        target.join("deps/libkspeed.so"),
        target.join("libkspeed.so"),
    ]
    .into_iter()
    .filter_map(|p| Some((std::fs::metadata(&p).ok()?.modified().ok()?, p)))
    .max()
    .map(|(_, p)| p)
    .expect("libkspeed.so is built with the tests");
    let lib = t.path().join("lib");
    std::fs::create_dir_all(&lib).unwrap();
    for name in ["libkspeed.so", "libkspeed.so.1"] {
        std::os::unix::fs::symlink(&built, lib.join(name)).unwrap();
    }
    let bin = t.path().join("classes_test");
    let o = match Command::new("gcc")
        .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-g"])
        .arg("-I")
        .arg(root().join("include"))
        .arg(root().join("tests/c/classes_test.c"))
        .arg("-o")
        .arg(&bin)
        .arg("-L")
        .arg(&lib)
        .arg(format!("-Wl,-rpath,{}", lib.display()))
        .arg("-lkspeed")
        .output()
    {
        Ok(o) => o,
        Err(e) => {
            eprintln!("skipping class_names_through_the_c_abi: gcc not available ({e})");
            return;
        }
    };
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
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
