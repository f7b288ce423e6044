//! Ingesting real files without losing a sample silently: additions to the
//! source, catalogs of another source, damaged and sparse tar shards, FIFOs
//! and devices, paths that are not UTF-8, symlinks leaving the tree,
//! permissions of the space, and the space lock. Real files throughout (GNU
//! tar makes the shards), through the `kspeed` binary.
//!
//! Why this file is over ~800 lines: each kind of damaged or unusual input
//! is a few tests over the same fixtures (sources, shards, spaces).

mod common;

use std::ffi::OsStr;
use std::fs;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::*;
use kspeed::dataset::{Catalog, Space};

/// Runs `kspeed ARGS`, failing the test (instead of hanging it) if the
/// command has not exited by the deadline.
fn kspeed_deadline(args: &[&OsStr], deadline: Duration) -> Output {
    let mut child = Command::new(kspeed_bin())
        .args(args)
        .arg("--progress=none")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    loop {
        if child.try_wait().unwrap().is_some() {
            return child.wait_with_output().unwrap();
        }
        if t0.elapsed() > deadline {
            child.kill().unwrap();
            let o = child.wait_with_output().unwrap();
            panic!(
                "kspeed {args:?} still running after {deadline:?}:\n{}",
                text(&o)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn mkfifo(p: &Path) {
    let st = Command::new("mkfifo").arg(p).status().unwrap();
    assert!(st.success());
}

/// Makes `count` sample files `NNNNN.jpg` (+ `.cls`, + `extra` extensions)
/// in `dir` and packs them with GNU tar into `shard`, in name order.
fn gnu_shard(dir: &Path, shard: &Path, count: u64, extra: &[&str]) -> Vec<Vec<u8>> {
    fs::create_dir_all(dir).unwrap();
    let mut names = Vec::new();
    let mut datas = Vec::new();
    for i in 0..count {
        let data = bytes_for(i, 700 + (i as usize * 331) % 5000);
        fs::write(dir.join(format!("{i:05}.jpg")), &data).unwrap();
        fs::write(dir.join(format!("{i:05}.cls")), format!("{}\n", i % 3)).unwrap();
        names.push(format!("{i:05}.cls"));
        names.push(format!("{i:05}.jpg"));
        for e in extra {
            fs::write(dir.join(format!("{i:05}.{e}")), format!("{e} of {i}")).unwrap();
            names.push(format!("{i:05}.{e}"));
        }
        datas.push(data);
    }
    let st = Command::new("tar")
        .arg("-cf")
        .arg(shard)
        .arg("-C")
        .arg(dir)
        .args(&names)
        .status()
        .unwrap();
    assert!(st.success());
    datas
}

/// Byte offsets of every member header of a shard, in order.
fn header_offsets(shard: &Path) -> Vec<(u64, String)> {
    let mut a = tar::Archive::new(fs::File::open(shard).unwrap());
    a.entries()
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            (
                e.raw_header_position(),
                e.path().unwrap().display().to_string(),
            )
        })
        .collect()
}

#[test]
fn additions_to_the_source_are_reported_until_refresh() {
    let t = tempfile::tempdir().unwrap();
    let src = t.path().join("src");
    odd_tree(&src);
    let sp = t.path().join("space");
    ok(&["preload", "--source", s(&src), "--space", s(&sp)]);
    let up = ok(&["preload", "--source", s(&src), "--space", s(&sp)]);
    assert!(up.contains("up to date"), "{up}");

    // A new file in an existing class.
    put(&src, "dog/new_1.bin", b"new sample");
    let e = fails(&["preload", "--source", s(&src), "--space", s(&sp)], 1);
    assert!(
        e.contains("dog/new_1.bin (added)") && e.contains("--refresh"),
        "{e}"
    );
    // Without --source (the catalog's source) too.
    let e = fails(&["preload", "--space", s(&sp)], 1);
    assert!(e.contains("new_1.bin (added)"), "{e}");

    // A new class folder sorting first shifts every label: said so.
    put(&src, "ant/a.bin", b"ant");
    let e = fails(&["preload", "--source", s(&src), "--space", s(&sp)], 1);
    assert!(
        e.contains("ant (new class folder; it shifts the labels of 3 later class(es): cat 0 -> 1"),
        "{e}"
    );
    // The old space is intact meanwhile.
    ok(&["verify", "--space", s(&sp)]);

    let out = ok(&[
        "preload",
        "--source",
        s(&src),
        "--space",
        s(&sp),
        "--refresh",
    ]);
    assert!(out.contains("preloaded 15 samples"), "{out}");
    let space = Space::open(&sp).unwrap();
    assert_eq!(space.catalog().class_count(), 4);
    let up = ok(&["preload", "--source", s(&src), "--space", s(&sp)]);
    assert!(up.contains("up to date"), "{up}");

    // A shard added to a tar directory.
    let shards = t.path().join("shards");
    fs::create_dir_all(&shards).unwrap();
    gnu_shard(&t.path().join("m0"), &shards.join("a-000.tar"), 4, &[]);
    let tsp = t.path().join("tspace");
    let tsrc = format!("tar:{}", shards.display());
    ok(&["preload", "--source", &tsrc, "--space", s(&tsp)]);
    gnu_shard(&t.path().join("m1"), &shards.join("a-001.tar"), 3, &[]);
    let e = fails(&["preload", "--source", &tsrc, "--space", s(&tsp)], 1);
    assert!(e.contains("a-001.tar (added)"), "{e}");

    // A line appended to a file list.
    let list = t.path().join("list.txt");
    fs::write(&list, "src/cat/img_000.bin\t0\n").unwrap();
    let lsp = t.path().join("lspace");
    let lsrc = format!("list:{}", list.display());
    ok(&["preload", "--source", &lsrc, "--space", s(&lsp)]);
    fs::write(&list, "src/cat/img_000.bin\t0\nsrc/dog/img_001.bin\t1\n").unwrap();
    let e = fails(&["preload", "--source", &lsrc, "--space", s(&lsp)], 1);
    assert!(e.contains("img_001.bin (added)"), "{e}");
}

#[test]
fn catalog_of_another_source_is_refused() {
    let t = tempfile::tempdir().unwrap();
    let a = t.path().join("a");
    let b = t.path().join("b");
    odd_tree(&a);
    put(&b, "c/x.bin", b"b's sample");
    let cat = t.path().join("a.ksc");
    ok(&["catalog", "--source", s(&a), "--out", s(&cat)]);
    let sp = t.path().join("space");
    let e = fails(
        &[
            "preload",
            "--source",
            s(&b),
            "--catalog",
            s(&cat),
            "--space",
            s(&sp),
        ],
        1,
    );
    assert!(
        e.contains(&format!("dir:{}", a.display()))
            && e.contains(&format!("dir:{}", b.display()))
            && e.contains("a.ksc"),
        "{e}"
    );
    assert!(!sp.join("catalog.ksc").exists());
    // The same source is accepted.
    ok(&[
        "preload",
        "--source",
        s(&a),
        "--catalog",
        s(&cat),
        "--space",
        s(&sp),
    ]);
}

#[test]
fn damaged_tar_header_is_named_with_shard_and_offset() {
    let t = tempfile::tempdir().unwrap();
    let shard = t.path().join("shard-000.tar");
    let datas = gnu_shard(&t.path().join("m"), &shard, 20, &[]);
    let heads = header_offsets(&shard);
    // Zero the header of sample 5's data member (its .cls comes first).
    let (at, name) = heads
        .iter()
        .find(|(_, n)| n == "00005.jpg")
        .cloned()
        .unwrap();
    let mut bytes = fs::read(&shard).unwrap();
    bytes[at as usize..at as usize + 512].fill(0);
    fs::write(&shard, &bytes).unwrap();
    let cat = t.path().join("c.ksc");
    let src = format!("tar:{}", shard.display());
    let e = fails(&["catalog", "--source", &src, "--out", s(&cat)], 1);
    assert!(
        e.contains("shard-000.tar")
            && e.contains(&format!("damaged member header at byte {at}"))
            && e.contains("--skip-bad-members"),
        "{name}: {e}"
    );
    assert!(!cat.exists());

    // A bit flip (bad checksum) in another header is named the same way.
    let mut flipped = fs::read(&shard).unwrap();
    let (at12, _) = heads
        .iter()
        .find(|(_, n)| n == "00012.cls")
        .cloned()
        .unwrap();
    flipped[at12 as usize + 3] ^= 0x20;
    let shard2 = t.path().join("shard-001.tar");
    fs::write(&shard2, &flipped).unwrap();
    let e = fails(
        &[
            "catalog",
            "--source",
            &format!("tar:{}", shard2.display()),
            "--out",
            s(&cat),
        ],
        1,
    );
    assert!(
        e.contains(&format!("damaged member header at byte {at}")),
        "{e}"
    );

    // --skip-bad-members: every other sample kept, each skip reported.
    let o = kspeed(&[
        "catalog",
        "--source",
        &src,
        "--out",
        s(&cat),
        "--skip-bad-members",
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains(&format!("damaged member header at byte {at}")) && err.contains("skipped to"),
        "{err}"
    );
    let c = Catalog::open(&cat).unwrap();
    // Sample 5's data member is gone with its header; its .cls alone is no sample.
    assert_eq!(c.len(), 19);
    let f = fs::File::open(&shard).unwrap();
    let mut want: Vec<&Vec<u8>> = datas.iter().collect();
    want.remove(5);
    for (id, w) in want.iter().enumerate() {
        let smp = c.sample(id as u64);
        let mut buf = vec![0u8; smp.len as usize];
        std::os::unix::fs::FileExt::read_exact_at(&f, &mut buf, smp.offset).unwrap();
        assert_eq!(&buf, *w, "sample {id}");
    }
}

#[test]
fn sparse_tar_members_are_refused_by_name() {
    let t = tempfile::tempdir().unwrap();
    let m = t.path().join("m");
    fs::create_dir_all(&m).unwrap();
    fs::write(m.join("00000.jpg"), b"dense").unwrap();
    // 64 MiB with 4 KiB of data: GNU tar stores only the data plus a map.
    let f = fs::File::create(m.join("00001.bin")).unwrap();
    f.set_len(64 << 20).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&f, &[7u8; 4096], 32 << 20).unwrap();
    drop(f);
    for (fmt, shard) in [("gnu", "gnu.tar"), ("pax", "pax.tar")] {
        let shard = t.path().join(shard);
        let st = Command::new("tar")
            .args(["--sparse", &format!("--format={fmt}"), "-cf"])
            .arg(&shard)
            .arg("-C")
            .arg(&m)
            .args(["00000.jpg", "00001.bin"])
            .status()
            .unwrap();
        assert!(st.success());
        let e = fails(
            &[
                "catalog",
                "--source",
                &format!("tar:{}", shard.display()),
                "--out",
                s(&t.path().join("c.ksc")),
            ],
            1,
        );
        assert!(
            e.contains("00001.bin") && e.contains("sparse") && e.contains(s(&shard)),
            "{fmt}: {e}"
        );
    }
}

#[test]
fn members_that_are_not_samples_are_reported() {
    let t = tempfile::tempdir().unwrap();
    let shard = t.path().join("s.tar");
    gnu_shard(&t.path().join("m"), &shard, 6, &["json", "txt"]);
    let o = kspeed(&[
        "preload",
        "--source",
        &format!("tar:{}", shard.display()),
        "--space",
        s(&t.path().join("sp")),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("12 tar member(s) are not part of any sample (.json: 6, .txt: 6)"),
        "{err}"
    );

    // A directory of shards given without tar: is warned about.
    let d = t.path().join("shards");
    fs::create_dir_all(&d).unwrap();
    fs::copy(&shard, d.join("s.tar")).unwrap();
    let o = kspeed(&[
        "catalog",
        "--source",
        s(&d),
        "--out",
        s(&t.path().join("c.ksc")),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("are .tar files") && err.contains("tar:"),
        "{err}"
    );
}

#[test]
fn fifos_and_devices_are_never_read() {
    let t = tempfile::tempdir().unwrap();
    let limit = Duration::from_secs(60);
    let out = t.path().join("c.ksc");
    let cat_args = |src: &str| -> Vec<PathBuf> {
        vec![
            "catalog".into(),
            "--source".into(),
            src.into(),
            "--out".into(),
            out.clone(),
        ]
    };
    let run = |args: Vec<PathBuf>| {
        let a: Vec<&OsStr> = args.iter().map(|p| p.as_os_str()).collect();
        kspeed_deadline(&a, limit)
    };

    // A FIFO inside an ImageFolder tree.
    let src = t.path().join("src");
    odd_tree(&src);
    mkfifo(&src.join("cat/pipe.bin"));
    let o = run(cat_args(s(&src)));
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(
        text(&o).contains("pipe.bin is a FIFO, not a regular file"),
        "{}",
        text(&o)
    );
    // Skipped with a count by option.
    let mut a = cat_args(s(&src));
    a.push("--skip-special".into());
    let o = run(a);
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        text(&o).contains("skipped") && text(&o).contains("pipe.bin"),
        "{}",
        text(&o)
    );
    assert_eq!(Catalog::open(&out).unwrap().len(), 13);
    fs::remove_file(src.join("cat/pipe.bin")).unwrap();

    // A character device reached through a symlink (with --follow-symlinks,
    // since /dev is outside the tree).
    std::os::unix::fs::symlink("/dev/zero", src.join("dog/zero.bin")).unwrap();
    let mut a = cat_args(s(&src));
    a.push("--follow-symlinks".into());
    let o = run(a);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(
        text(&o).contains("zero.bin is a character device"),
        "{}",
        text(&o)
    );
    fs::remove_file(src.join("dog/zero.bin")).unwrap();

    // A FIFO named *.tar in a shard directory.
    let shards = t.path().join("shards");
    fs::create_dir_all(&shards).unwrap();
    gnu_shard(&t.path().join("m"), &shards.join("a.tar"), 3, &[]);
    mkfifo(&shards.join("b.tar"));
    let o = run(cat_args(&format!("tar:{}", shards.display())));
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("b.tar is a FIFO"), "{}", text(&o));

    // A FIFO as the file list, and as a bare tar path.
    let list = t.path().join("list.txt");
    mkfifo(&list);
    let o = run(cat_args(&format!("list:{}", list.display())));
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("list.txt is a FIFO"), "{}", text(&o));
    let o = run(cat_args(&format!("tar:{}", shards.join("b.tar").display())));
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("b.tar is a FIFO"), "{}", text(&o));
}

#[test]
fn paths_that_are_not_utf8_are_kept_exactly() {
    let t = tempfile::tempdir().unwrap();
    // The source root, two class folders differing only in a non-UTF-8 byte,
    // and a file name, all not UTF-8.
    let root = t.path().join(OsStr::from_bytes(b"data\xff"));
    let c1 = root.join(OsStr::from_bytes(b"cl\xfe"));
    let c2 = root.join(OsStr::from_bytes(b"cl\xff"));
    fs::create_dir_all(&c1).unwrap();
    fs::create_dir_all(&c2).unwrap();
    fs::write(c1.join(OsStr::from_bytes(b"a\xe9.bin")), b"first").unwrap();
    fs::write(c2.join("b.bin"), b"second").unwrap();
    let sp = t.path().join("space");
    let args = |extra: &[&str]| -> Vec<std::ffi::OsString> {
        let mut v: Vec<std::ffi::OsString> = vec![
            "preload".into(),
            "--source".into(),
            root.clone().into_os_string(),
            "--space".into(),
            sp.clone().into_os_string(),
        ];
        v.extend(extra.iter().map(|e| e.into()));
        v
    };
    let run = |v: Vec<std::ffi::OsString>| {
        let a: Vec<&OsStr> = v.iter().map(|x| x.as_os_str()).collect();
        kspeed_deadline(&a, Duration::from_secs(60))
    };
    let o = run(args(&[]));
    assert!(o.status.success(), "{}", text(&o));
    let space = Space::open(&sp).unwrap();
    let cat = space.catalog();
    assert_eq!(cat.class_count(), 2, "two classes, not merged");
    assert_eq!(cat.class_name_bytes(0), b"cl\xfe");
    assert_eq!(cat.class_name_bytes(1), b"cl\xff");
    assert_eq!(cat.sample(0).label, Some(0));
    assert_eq!(cat.sample(1).label, Some(1));
    assert_eq!(cat.source_spec().path, root);
    assert_eq!(
        cat.file(cat.sample(0).file).name.as_os_str().as_bytes(),
        b"cl\xfe/a\xe9.bin"
    );
    // Nothing "vanished": the second run is up to date.
    let o = run(args(&[]));
    assert!(
        o.status.success() && String::from_utf8_lossy(&o.stdout).contains("up to date"),
        "{}",
        text(&o)
    );
    let o = run(args(&["--refresh"]));
    assert!(o.status.success(), "{}", text(&o));
    ok(&["verify", "--space", s(&sp)]);

    // ls --json and inspect --json: the display name is lossy, the exact
    // bytes are beside it in base64; a UTF-8 name has no such field.
    let sp_arg = sp.as_os_str();
    let o = Command::new(kspeed_bin())
        .args([
            OsStr::new("ls"),
            OsStr::new("--space"),
            sp_arg,
            OsStr::new("--json"),
        ])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let rows: Vec<serde_json::Value> = String::from_utf8(o.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows[0]["class"], "cl\u{fffd}");
    assert_eq!(b64(&rows[0]["class_b64"]), b"cl\xfe");
    assert_eq!(b64(&rows[1]["class_b64"]), b"cl\xff");
    assert_eq!(
        b64(&rows[0]["path_b64"]),
        root.join(OsStr::from_bytes(b"cl\xfe/a\xe9.bin"))
            .as_os_str()
            .as_bytes()
    );
    let o = Command::new(kspeed_bin())
        .args([
            OsStr::new("inspect"),
            OsStr::new("--space"),
            sp_arg,
            OsStr::new("--json"),
        ])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(b64(&v["catalog"]["classes"][0]["name_b64"]), b"cl\xfe");
    assert_eq!(b64(&v["catalog"]["classes"][1]["name_b64"]), b"cl\xff");
}

/// Decodes a JSON string of standard base64 (the `*_b64` fields).
fn b64(v: &serde_json::Value) -> Vec<u8> {
    let s = v.as_str().unwrap_or_else(|| panic!("not a string: {v}"));
    let val = |c: u8| match c {
        b'A'..=b'Z' => c - b'A',
        b'a'..=b'z' => c - b'a' + 26,
        b'0'..=b'9' => c - b'0' + 52,
        b'+' => 62,
        b'/' => 63,
        _ => panic!("not base64: {s}"),
    } as u32;
    let mut out = Vec::new();
    for q in s.as_bytes().chunks(4) {
        let pad = q.iter().filter(|&&c| c == b'=').count();
        let n = q
            .iter()
            .take(4 - pad)
            .enumerate()
            .fold(0u32, |n, (i, &c)| n | val(c) << (18 - 6 * i));
        out.extend_from_slice(&n.to_be_bytes()[1..4 - pad]);
    }
    out
}

#[test]
fn symlinks_leaving_the_tree_are_refused_and_the_space_is_private() {
    let t = tempfile::tempdir().unwrap();
    let src = t.path().join("src");
    odd_tree(&src);
    let outside = t.path().join("secret.txt");
    fs::write(&outside, b"not for everyone").unwrap();
    std::os::unix::fs::symlink(&outside, src.join("cat/link.bin")).unwrap();
    // A link that stays inside the tree is fine.
    std::os::unix::fs::symlink(src.join("dog/img_001.bin"), src.join("eel/inside.bin")).unwrap();
    let sp = t.path().join("space");
    let e = fails(&["preload", "--source", s(&src), "--space", s(&sp)], 1);
    assert!(
        e.contains("cat/link.bin leads outside the source tree")
            && e.contains("secret.txt")
            && e.contains("--follow-symlinks"),
        "{e}"
    );
    let out = ok(&[
        "preload",
        "--source",
        s(&src),
        "--space",
        s(&sp),
        "--follow-symlinks",
    ]);
    assert!(out.contains("preloaded 15 samples"), "{out}");

    let mode = |p: &Path| fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&sp), 0o700);
    assert_eq!(mode(&sp.join("extents")), 0o700);
    for f in ["catalog.ksc", "manifest.ksm", "extents/00000000.kse"] {
        assert_eq!(mode(&sp.join(f)), 0o600, "{f}");
    }
    // Wider on request.
    let sp2 = t.path().join("space2");
    ok(&[
        "preload",
        "--source",
        s(&src),
        "--space",
        s(&sp2),
        "--follow-symlinks",
        "--file-mode",
        "0640",
    ]);
    assert_eq!(mode(&sp2), 0o750);
    for f in ["catalog.ksc", "manifest.ksm", "extents/00000000.kse"] {
        assert_eq!(mode(&sp2.join(f)), 0o640, "{f}");
    }
    let e = fails(
        &[
            "preload",
            "--source",
            s(&src),
            "--space",
            s(&sp2),
            "--file-mode",
            "0044",
        ],
        2,
    );
    assert!(e.contains("owner read and write"), "{e}");
    // A catalog built on its own is private too, unless asked otherwise.
    let c = t.path().join("c.ksc");
    ok(&[
        "catalog",
        "--source",
        s(&src),
        "--out",
        s(&c),
        "--follow-symlinks",
    ]);
    assert_eq!(mode(&c), 0o600);
    ok(&[
        "catalog",
        "--source",
        s(&src),
        "--out",
        s(&c),
        "--follow-symlinks",
        "--file-mode",
        "0644",
    ]);
    assert_eq!(mode(&c), 0o644);
}

#[test]
fn unload_and_refresh_refuse_while_the_space_is_held_shared() {
    let t = tempfile::tempdir().unwrap();
    let src = t.path().join("src");
    odd_tree(&src);
    let sp = t.path().join("space");
    ok(&["preload", "--source", s(&src), "--space", s(&sp)]);
    // What `kspeed serve` holds while it serves the space.
    let lock = kspeed::dataset::preload::SpaceLock::shared(&sp).unwrap();
    let pid = std::process::id();
    for args in [
        vec!["unload", "--space", s(&sp)],
        vec![
            "preload",
            "--source",
            s(&src),
            "--space",
            s(&sp),
            "--refresh",
        ],
    ] {
        let e = fails(&args, 1);
        assert!(
            e.contains("is locked") && e.contains(&format!("pid {pid} (shared")),
            "{args:?}: {e}"
        );
    }
    ok(&["verify", "--space", s(&sp)]);
    drop(lock);

    // A live `kspeed serve` holds it: unload is refused naming serve's pid.
    let token = t.path().join("token");
    fs::write(&token, "tok\n").unwrap();
    let mut serve = Command::new(kspeed_bin())
        .args(["serve", "--space", s(&sp), "--listen", "127.0.0.1:0"])
        .args(["--token-file", s(&token), "--pollers", "1"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    // Blocks until serve has started (or exited: EOF, an empty line).
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(serve.stdout.take().unwrap()),
        &mut line,
    )
    .unwrap();
    assert!(line.starts_with("serving"), "serve printed {line:?}");
    let e = fails(&["unload", "--space", s(&sp)], 1);
    let spid = serve.id();
    // A plain preload of an up-to-date space beside it just says so; a
    // refresh, which would rewrite the extents under it, is refused.
    let up = ok(&["preload", "--source", s(&src), "--space", s(&sp)]);
    assert!(up.contains("up to date"), "{up}");
    let e2 = fails(
        &[
            "preload",
            "--source",
            s(&src),
            "--space",
            s(&sp),
            "--refresh",
        ],
        1,
    );
    assert!(e2.contains(&format!("pid {spid} (shared")), "{e2}");
    serve.kill().unwrap();
    serve.wait().unwrap();
    assert!(e.contains(&format!("pid {spid} (shared")), "{e}");
    ok(&["unload", "--space", s(&sp)]);
    assert!(!sp.exists());
}

/// Runs `kspeed ARGS` under `prlimit --nofile=SOFT:HARD`.
fn kspeed_nofile(soft: u64, hard: u64, args: &[&str]) -> Output {
    Command::new("prlimit")
        .arg(format!("--nofile={soft}:{hard}"))
        .arg(kspeed_bin())
        .args(args)
        .arg("--progress=none")
        .output()
        .unwrap()
}

#[test]
fn many_extents_under_a_low_open_files_limit() {
    if Command::new("prlimit").arg("--version").output().is_err() {
        skip("many_extents_under_a_low_open_files_limit: no prlimit");
        return;
    }
    let t = tempfile::tempdir().unwrap();
    let src = t.path().join("src");
    gen("imagenet", 80, &src);
    let sp = t.path().join("space");
    // 4 KiB extents: every sample gets extents of its own, 80+ in all.
    let pre = [
        "preload",
        "--source",
        s(&src),
        "--space",
        s(&sp),
        "--extent-bytes",
        "4KiB",
        "--threads",
        "2",
    ];
    // A hard limit of 32 descriptors: preload and verify keep one extent
    // open per thread, not all of them.
    let o = kspeed_nofile(32, 32, &pre);
    assert!(o.status.success(), "{}", text(&o));
    let extents = fs::read_dir(sp.join("extents")).unwrap().count();
    assert!(extents > 64, "{extents} extents");
    let o = kspeed_nofile(32, 32, &["verify", "--space", s(&sp), "--threads", "2"]);
    assert!(o.status.success(), "{}", text(&o));
    // Reading keeps every extent open (registered with io_uring): a soft
    // limit of 32 under a hard one of 4096 is raised at start.
    let o = kspeed_nofile(
        32,
        4096,
        &[
            "read",
            "--space",
            s(&sp),
            "--epochs",
            "1",
            "--batch-size",
            "8",
        ],
    );
    assert!(o.status.success(), "{}", text(&o));
}

#[test]
fn verify_reports_io_errors_as_such() {
    let t = tempfile::tempdir().unwrap();
    let src = t.path().join("src");
    gen("imagenet", 30, &src);
    let sp = t.path().join("space");
    // Readable by others, so a second user can open catalog and manifest.
    ok(&[
        "preload",
        "--source",
        s(&src),
        "--space",
        s(&sp),
        "--extent-bytes",
        "64KiB",
        "--file-mode",
        "0644",
    ]);
    let ext = sp.join("extents/00000001.kse");
    fs::set_permissions(&ext, fs::Permissions::from_mode(0o000)).unwrap();
    let o = if is_root() {
        fs::set_permissions(t.path(), fs::Permissions::from_mode(0o755)).unwrap();
        Command::new("setpriv")
            .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
            .arg(kspeed_bin())
            .args(["verify", "--space", s(&sp), "--progress=none"])
            .output()
            .unwrap()
    } else {
        kspeed(&["verify", "--space", s(&sp)])
    };
    let out = text(&o);
    assert_eq!(o.status.code(), Some(1), "{out}");
    assert!(
        out.contains("I/O error (open extent: errno 13 (Permission denied))")
            && out.contains("00000001.kse")
            && out.contains("could not be read because of I/O errors")
            && !out.contains("--refresh"),
        "{out}"
    );
    // A missing extent is damage: exit 3 and the advice to copy again.
    fs::set_permissions(&ext, fs::Permissions::from_mode(0o644)).unwrap();
    fs::remove_file(&ext).unwrap();
    let out = fails(&["verify", "--space", s(&sp)], 3);
    assert!(
        out.contains("missing") && out.contains("--refresh"),
        "{out}"
    );
}

#[test]
fn verify_repair_copies_exactly_the_bad_samples() {
    let t = tempfile::tempdir().unwrap();
    let src = t.path().join("src");
    gen("imagenet", 40, &src);
    let sp = t.path().join("space");
    ok(&[
        "preload",
        "--source",
        s(&src),
        "--space",
        s(&sp),
        "--extent-bytes",
        "256KiB",
    ]);
    let space = Space::open(&sp).unwrap();
    let n_ext = space.extent_lens().len() as u32;
    assert!(n_ext > 3, "{n_ext} extents");
    // Flip a byte in sample 3, remove the last extent.
    let loc = space.location(3).unwrap();
    let p = space.extent_path(loc.extent);
    let f = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&p)
        .unwrap();
    let mut b = [0u8; 1];
    std::os::unix::fs::FileExt::read_exact_at(&f, &mut b, loc.offset + 10).unwrap();
    b[0] ^= 1;
    std::os::unix::fs::FileExt::write_all_at(&f, &b, loc.offset + 10).unwrap();
    drop(f);
    let last = n_ext - 1;
    let in_last: Vec<u64> = (0..space.catalog().len())
        .filter(|&id| space.location(id).unwrap().extent == last)
        .collect();
    fs::remove_file(space.extent_path(last)).unwrap();
    // Other extents' mtimes must not change: nothing else is rewritten.
    let untouched = space.extent_path(last - 1);
    let before = fs::metadata(&untouched).unwrap().modified().unwrap();
    let bad = 1 + in_last.len();
    drop(space);

    let out = fails(&["verify", "--space", s(&sp)], 3);
    assert!(
        out.contains(&format!("{bad} bad")) && out.contains("--repair"),
        "{out}"
    );
    let out = ok(&["verify", "--space", s(&sp), "--repair"]);
    assert!(
        out.contains(&format!("repaired {bad} sample(s)"))
            && out.contains("1 extent file(s) recreated")
            && out.contains("ids 3, ")
            && out.contains("verified 40 samples again: 0 bad"),
        "{out}"
    );
    assert_eq!(
        fs::metadata(&untouched).unwrap().modified().unwrap(),
        before
    );
    ok(&["verify", "--space", s(&sp)]);

    // A source that changed since the catalog cannot repair: named.
    let space = Space::open(&sp).unwrap();
    let loc = space.location(7).unwrap();
    let p = space.extent_path(loc.extent);
    let srcf = space.catalog().file_path(space.catalog().sample(7).file);
    drop(space);
    let f = fs::OpenOptions::new().write(true).open(&p).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&f, b"XX", loc.offset).unwrap();
    drop(f);
    let mut body = fs::read(&srcf).unwrap();
    body[0] ^= 0xff;
    let md = fs::metadata(&srcf).unwrap();
    fs::write(&srcf, &body).unwrap();
    filetime::set_file_mtime(&srcf, filetime::FileTime::from_last_modification_time(&md)).unwrap();
    let out = fails(&["verify", "--space", s(&sp), "--repair"], 1);
    assert!(
        out.contains("content of sample 7 changed") && out.contains("cannot be repaired"),
        "{out}"
    );
}

#[test]
fn ls_cat_and_json_reports() {
    let t = tempfile::tempdir().unwrap();
    let src = t.path().join("src");
    let files = odd_tree(&src);
    let sp = t.path().join("space");
    ok(&["preload", "--source", s(&src), "--space", s(&sp)]);
    let space = Space::open(&sp).unwrap();
    let cat = space.catalog();

    // ls --json: one object per sample, as the catalog says.
    let out = ok(&["ls", "--space", s(&sp), "--json"]);
    let rows: Vec<serde_json::Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len() as u64, cat.len());
    for (id, row) in rows.iter().enumerate() {
        let smp = cat.sample(id as u64);
        assert_eq!(row["id"], id as u64);
        assert_eq!(row["len"], smp.len as u64);
        assert_eq!(row["crc32c"], format!("{:#010x}", smp.crc32c));
        assert_eq!(
            row["path"],
            cat.file_path(smp.file).to_string_lossy().as_ref()
        );
        match smp.label {
            Some(l) => {
                assert_eq!(row["label"], l as u64);
                assert_eq!(row["class"], cat.class_name(l).as_ref());
            }
            None => assert!(row["label"].is_null() && row["class"].is_null()),
        }
        assert_eq!(row["holders"], serde_json::json!([0]));
    }
    // Filters: class, path glob, id range.
    let dogs = ok(&["ls", "--space", s(&sp), "--class", "dog", "--json"]);
    let by_glob = ok(&["ls", "--space", s(&sp), "--path", "dog/*", "--json"]);
    assert_eq!(dogs.lines().count(), 4, "{dogs}");
    assert_eq!(dogs, by_glob);
    let out = ok(&["ls", "--space", s(&sp), "--ids", "2..5"]);
    assert_eq!(out.lines().count(), 1 + 3, "header + 3 rows: {out}");
    let e = fails(&["ls", "--space", s(&sp), "--class", "yak"], 1);
    assert!(e.contains("no such class"), "{e}");
    // Holders for a placement over 4 nodes with 2 copies.
    let out = ok(&[
        "ls",
        "--catalog",
        s(&sp.join("catalog.ksc")),
        "--nodes",
        "4",
        "--replicas",
        "2",
        "--json",
    ]);
    for l in out.lines() {
        let v: serde_json::Value = serde_json::from_str(l).unwrap();
        assert_eq!(v["holders"].as_array().unwrap().len(), 2);
    }

    // cat: every sample's bytes, identical to the source file.
    for id in 0..cat.len() {
        let o = kspeed(&["cat", "--space", s(&sp), "--id", &id.to_string()]);
        assert!(o.status.success(), "{}", text(&o));
        let name = cat
            .file(cat.sample(id).file)
            .name
            .to_str()
            .unwrap()
            .to_string();
        let want = &files.iter().find(|(n, _)| *n == name).unwrap().1;
        assert_eq!(&o.stdout, want, "sample {id}");
    }

    // inspect --json and verify --json.
    let v: serde_json::Value =
        serde_json::from_str(&ok(&["inspect", "--space", s(&sp), "--json"])).unwrap();
    assert_eq!(v["catalog"]["samples"], 13);
    assert_eq!(v["catalog"]["format_version"], 2);
    assert_eq!(v["catalog"]["classes"][1]["name"], "dog");
    assert_eq!(v["catalog"]["unlabeled"], 1);
    assert_eq!(v["space"]["held_samples"], 13);
    assert_eq!(v["space"]["status"]["complete"], true);
    let v: serde_json::Value =
        serde_json::from_str(&ok(&["verify", "--space", s(&sp), "--json"])).unwrap();
    assert_eq!(v["checked"], 13);
    assert_eq!(v["bad"], serde_json::json!([]));

    // A corrupt sample: cat refuses (nothing on stdout), verify --json names it.
    let loc = space.location(4).unwrap();
    let p = space.extent_path(loc.extent);
    let f = fs::OpenOptions::new().write(true).open(&p).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&f, b"\xff\xfe", loc.offset).unwrap();
    drop(f);
    let o = kspeed(&["cat", "--space", s(&sp), "--id", "4"]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(o.stdout.is_empty());
    assert!(text(&o).contains("sample 4"), "{}", text(&o));
    let o = kspeed(&["verify", "--space", s(&sp), "--json"]);
    assert_eq!(o.status.code(), Some(3), "{}", text(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["bad"][0]["id"], 4);
    assert_eq!(v["bad"][0]["kind"], "corrupt");
}

#[test]
fn members_make_multi_member_samples() {
    let t = tempfile::tempdir().unwrap();
    let shard = t.path().join("s.tar");
    let datas = gnu_shard(&t.path().join("m"), &shard, 6, &["json", "txt"]);
    let src = format!("tar:{}", shard.display());
    let cat_path = t.path().join("c.ksc");
    // In the listed order, whatever the order in the shard.
    let o = kspeed(&[
        "catalog",
        "--source",
        &src,
        "--out",
        s(&cat_path),
        "--members",
        "txt,jpg,json",
    ]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(!text(&o).contains("not part of any sample"), "{}", text(&o));
    let cat = Catalog::open(&cat_path).unwrap();
    assert_eq!(cat.len(), 6);
    assert_eq!(cat.members(), ["txt", "jpg", "json"]);
    let f = fs::File::open(&shard).unwrap();
    for id in 0..6u64 {
        let smp = cat.sample(id);
        assert_eq!(smp.label, Some((id % 3) as u32));
        let mut bytes = vec![0u8; smp.len as usize];
        std::os::unix::fs::FileExt::read_exact_at(&f, &mut bytes, smp.offset).unwrap();
        let parts: Vec<&[u8]> = cat
            .sample_members(id)
            .map(|(o, l)| &bytes[o as usize..(o + l) as usize])
            .collect();
        assert_eq!(parts[0], format!("txt of {id}").as_bytes());
        assert_eq!(parts[1], &datas[id as usize][..]);
        assert_eq!(parts[2], format!("json of {id}").as_bytes());
    }

    // Through a space: the same boundaries apply to the bytes `cat` gives.
    let sp = t.path().join("space");
    let o = kspeed(&[
        "preload",
        "--source",
        &src,
        "--space",
        s(&sp),
        "--members",
        "jpg,json",
    ]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        text(&o).contains(
            "6 tar member(s) are not part of any sample (.txt: 6): a sample is its key's .jpg, .json members (--members)"
        ),
        "{}",
        text(&o)
    );
    let space = Space::open(&sp).unwrap();
    let rows = ok(&["ls", "--space", s(&sp), "--json", "--ids", "4"]);
    let row: serde_json::Value = serde_json::from_str(rows.trim()).unwrap();
    assert_eq!(row["members"][1]["ext"], "json");
    let o = kspeed(&["cat", "--space", s(&sp), "--id", "4"]);
    assert!(o.status.success(), "{}", text(&o));
    let parts: Vec<(u32, u32)> = space.catalog().sample_members(4).collect();
    assert_eq!(row["members"][1]["offset"], parts[1].0);
    let (jo, jl) = parts[1];
    assert_eq!(&o.stdout[jo as usize..(jo + jl) as usize], b"json of 4");
    let (po, pl) = parts[0];
    assert_eq!(&o.stdout[po as usize..(po + pl) as usize], &datas[4][..]);
    ok(&["verify", "--space", s(&sp)]);
    // The space's catalog was built with jpg,json: asking for others is refused.
    let e = fails(
        &[
            "preload",
            "--source",
            &src,
            "--space",
            s(&sp),
            "--members",
            "jpg",
        ],
        1,
    );
    assert!(
        e.contains("makes samples of members [jpg,json]") && e.contains("--refresh"),
        "{e}"
    );

    // A key without a listed member is named; --members needs tar shards.
    let e = fails(
        &[
            "catalog",
            "--source",
            &src,
            "--out",
            s(&cat_path),
            "--members",
            "jpg,xml",
        ],
        1,
    );
    assert!(
        e.contains("key 00000 has no .xml member") && e.contains("s.tar"),
        "{e}"
    );
    let d = t.path().join("tree");
    put(&d, "c/a.bin", b"a");
    let e = fails(
        &[
            "catalog",
            "--source",
            s(&d),
            "--out",
            s(&cat_path),
            "--members",
            "jpg",
        ],
        1,
    );
    assert!(e.contains("--members applies to tar shards"), "{e}");
}

#[test]
fn read_report_as_json() {
    let t = tempfile::tempdir().unwrap();
    let src = t.path().join("src");
    gen("tiny", 50, &src);
    let sp = t.path().join("space");
    ok(&["preload", "--source", s(&src), "--space", s(&sp)]);
    let out = ok(&[
        "read",
        "--space",
        s(&sp),
        "--epochs",
        "2",
        "--batch-size",
        "8",
        "--json",
    ]);
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(v["epochs"], 2);
    assert_eq!(v["samples"], 100);
    let bytes: u64 = {
        let space = Space::open(&sp).unwrap();
        space.catalog().total_bytes() * 2
    };
    assert_eq!(v["bytes"], bytes);
    assert!(v["read_latency_us"]["p50"].is_u64());
    assert!(v.get("cluster").is_none());
    // With --idle-ms the idle measurement is in the object, not a text line.
    let out = ok(&[
        "read",
        "--space",
        s(&sp),
        "--epochs",
        "1",
        "--json",
        "--idle-ms",
        "100",
    ]);
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert!(v["idle_core_fraction"].is_f64(), "{out}");
}

#[test]
fn member_table_fields_are_validated() {
    let t = tempfile::tempdir().unwrap();
    let shard = t.path().join("s.tar");
    gnu_shard(&t.path().join("m"), &shard, 4, &["json"]);
    let cat = t.path().join("c.ksc");
    ok(&[
        "catalog",
        "--source",
        &format!("tar:{}", shard.display()),
        "--out",
        s(&cat),
        "--members",
        "jpg,json",
    ]);
    let good = fs::read(&cat).unwrap();
    let header_len = u32::from_le_bytes(good[12..16].try_into().unwrap()) as usize;
    // Header fields start at 32; the member fields are at 112..144.
    let with_field = |off: usize, v: u64| {
        let mut b = good.clone();
        b[32 + off..32 + off + 8].copy_from_slice(&v.to_le_bytes());
        b[28..32].fill(0);
        let crc = crc32c::crc32c(&b[..header_len]);
        b[28..32].copy_from_slice(&crc.to_le_bytes());
        b
    };
    for (what, off, v) in [
        ("member count overflows", 112, u64::MAX),
        ("member count disagrees with the list", 112, 3),
        ("list outside the strings", 120, u64::MAX / 2),
        ("parts table outside the body", 136, 1 << 40),
    ] {
        let p = t.path().join("bad.ksc");
        fs::write(&p, with_field(off, v)).unwrap();
        match Catalog::open(&p) {
            Err(kspeed::Error::Corrupt { .. }) => {}
            Err(e) => panic!("{what}: {e}"),
            Ok(_) => panic!("{what}: opened"),
        }
    }
    assert_eq!(Catalog::open(&cat).unwrap().members(), ["jpg", "json"]);
}

#[test]
fn a_source_file_replaced_by_a_fifo_is_never_opened_for_reading() {
    let t = tempfile::tempdir().unwrap();
    let src = t.path().join("src");
    odd_tree(&src);
    let sp = t.path().join("space");
    ok(&["preload", "--source", s(&src), "--space", s(&sp)]);
    let space = Space::open(&sp).unwrap();
    let loc = space.location(2).unwrap();
    let p = space.extent_path(loc.extent);
    let srcf = space.catalog().file_path(space.catalog().sample(2).file);
    drop(space);
    let f = fs::OpenOptions::new().write(true).open(&p).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&f, b"\x00\x01", loc.offset).unwrap();
    drop(f);
    // Repair reads the bad sample straight from its source file, which is a
    // FIFO now: a named error, not a wait for a writer that never comes.
    fs::remove_file(&srcf).unwrap();
    mkfifo(&srcf);
    let args = [
        OsStr::new("verify"),
        OsStr::new("--space"),
        sp.as_os_str(),
        OsStr::new("--repair"),
    ];
    let o = kspeed_deadline(&args, Duration::from_secs(60));
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(
        text(&o).contains("is a FIFO, not a regular file"),
        "{}",
        text(&o)
    );
}

#[test]
fn file_list_lines_lose_bom_and_trailing_whitespace_and_name_their_line() {
    let t = tempfile::tempdir().unwrap();
    let src = t.path().join("src");
    odd_tree(&src);
    let list = t.path().join("list.txt");
    let out = t.path().join("c.ksc");
    let catalog = |list: &Path| {
        kspeed(&[
            "catalog",
            "--source",
            &format!("list:{}", list.display()),
            "--out",
            s(&out),
        ])
    };
    // A BOM before the first path (Notepad), CRLF line ends, trailing
    // spaces and tabs after a path and after a label, spaces before the
    // label's tab, and a line of blanks only.
    let mut body = b"\xef\xbb\xbfsrc/cat/img_000.bin\r\n".to_vec();
    body.extend_from_slice(b"src/dog/img_001.bin   \r\n");
    body.extend_from_slice(b"src/eel/img_002.bin\t2 \t\r\n");
    body.extend_from_slice(b"   \t\r\n");
    body.extend_from_slice(b"src/cat/img_003.bin  \t0\n");
    fs::write(&list, &body).unwrap();
    let o = catalog(&list);
    assert!(o.status.success(), "{}", text(&o));
    let cat = Catalog::open(&out).unwrap();
    assert_eq!(cat.len(), 4);
    let names: Vec<Vec<u8>> = (0..4)
        .map(|i| {
            cat.file(cat.sample(i).file)
                .name
                .as_os_str()
                .as_bytes()
                .to_vec()
        })
        .collect();
    assert_eq!(
        names,
        [
            &b"src/cat/img_000.bin"[..],
            b"src/dog/img_001.bin",
            b"src/eel/img_002.bin",
            b"src/cat/img_003.bin"
        ]
    );
    assert_eq!(cat.sample(2).label, Some(2));
    assert_eq!(cat.sample(3).label, Some(0));

    // A path that does not exist: the list and the line are named, and
    // the path as resolved.
    fs::write(
        &list,
        "# comment\nsrc/cat/img_000.bin\nsrc/cat/nope.bin\t1\n",
    )
    .unwrap();
    let o = catalog(&list);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let e = text(&o);
    assert!(
        e.contains(&format!("file list {}, line 3:", list.display()))
            && e.contains("src/cat/nope.bin")
            && e.contains("No such file"),
        "{e}"
    );
    // A dangling symlink named by a list line: its line and its target.
    std::os::unix::fs::symlink(t.path().join("gone.bin"), src.join("dangling.bin")).unwrap();
    fs::write(&list, "src/cat/img_000.bin\nsrc/dangling.bin\n").unwrap();
    let o = catalog(&list);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let e = text(&o);
    assert!(
        e.contains("line 2:") && e.contains("dangling.bin is dangling") && e.contains("gone.bin"),
        "{e}"
    );
}

#[test]
fn dangling_symlinks_are_skipped_with_skip_special_and_named_otherwise() {
    let t = tempfile::tempdir().unwrap();
    let src = t.path().join("src");
    odd_tree(&src);
    let gone = t.path().join("gone.bin");
    std::os::unix::fs::symlink(&gone, src.join("dog/dangling.bin")).unwrap();
    let out = t.path().join("c.ksc");
    let catalog = |src: &str, extra: &[&str]| {
        let mut a = vec!["catalog", "--source", src, "--out", s(&out)];
        a.extend(extra);
        kspeed(&a)
    };
    // Named with its target, with and without --follow-symlinks.
    for extra in [&[][..], &["--follow-symlinks"]] {
        let o = catalog(s(&src), extra);
        assert_eq!(o.status.code(), Some(1), "{extra:?}: {}", text(&o));
        let e = text(&o);
        assert!(
            e.contains("dog/dangling.bin is dangling")
                && e.contains(&gone.display().to_string())
                && e.contains("--skip-special"),
            "{extra:?}: {e}"
        );
    }
    // Skipped, named and counted like a FIFO with --skip-special; the
    // other 13 samples are all there.
    for extra in [
        &["--skip-special"][..],
        &["--skip-special", "--follow-symlinks"],
    ] {
        let o = catalog(s(&src), extra);
        assert!(o.status.success(), "{extra:?}: {}", text(&o));
        let e = String::from_utf8_lossy(&o.stderr);
        assert!(
            e.contains("warning: skipped")
                && e.contains("dog/dangling.bin")
                && e.contains("dangling symlink"),
            "{extra:?}: {e}"
        );
        assert_eq!(Catalog::open(&out).unwrap().len(), 13);
    }
    // The same in a directory of tar shards.
    let shards = t.path().join("shards");
    fs::create_dir_all(&shards).unwrap();
    gnu_shard(&t.path().join("m"), &shards.join("a.tar"), 3, &[]);
    std::os::unix::fs::symlink(&gone, shards.join("b.tar")).unwrap();
    let tar_src = format!("tar:{}", shards.display());
    let o = catalog(&tar_src, &[]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("b.tar is dangling"), "{}", text(&o));
    let o = catalog(&tar_src, &["--skip-special"]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("skipped"), "{}", text(&o));
    assert_eq!(Catalog::open(&out).unwrap().len(), 3);
}

#[test]
fn an_extent_that_grew_is_a_size_mismatch_for_read_and_bad_for_verify() {
    let t = tempfile::tempdir().unwrap();
    let src = t.path().join("src");
    gen("tiny", 60, &src);
    let sp = t.path().join("space");
    ok(&[
        "preload",
        "--source",
        s(&src),
        "--space",
        s(&sp),
        "--extent-bytes",
        "64KiB",
    ]);
    let space = Space::open(&sp).unwrap();
    assert!(space.extent_lens().len() > 2);
    let ext = space.extent_path(1);
    let planned = space.extent_lens()[1];
    drop(space);
    // Something appends to an extent: every sample still reads back intact.
    let grown = planned + 4096;
    fs::OpenOptions::new()
        .write(true)
        .open(&ext)
        .unwrap()
        .set_len(grown)
        .unwrap();
    let what = format!(
        "extent {} is {grown} bytes, manifest says {planned}",
        ext.display()
    );
    let e = fails(&["read", "--space", s(&sp), "--epochs", "1"], 1);
    assert!(e.contains(&what) && !e.contains("truncated"), "{e}");
    let e = fails(&["verify", "--space", s(&sp)], 3);
    assert!(
        e.contains(&what)
            && e.contains("0 bad (and 1 extent of the wrong length)")
            && e.contains("--repair"),
        "{e}"
    );
    let o = kspeed(&["verify", "--space", s(&sp), "--json"]);
    assert_eq!(o.status.code(), Some(3), "{}", text(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["bad_extents"][0]["index"], 1);
    assert_eq!(v["bad_extents"][0]["bytes"], grown);
    assert_eq!(v["bad_extents"][0]["manifest_bytes"], planned);
    // Repair gives it its planned length back; read and verify agree again.
    let out = ok(&["verify", "--space", s(&sp), "--repair"]);
    assert!(
        out.contains("1 extent file(s) given their planned length") && out.contains("again: 0 bad"),
        "{out}"
    );
    assert_eq!(fs::metadata(&ext).unwrap().len(), planned);
    ok(&["verify", "--space", s(&sp)]);
    ok(&["read", "--space", s(&sp), "--epochs", "1"]);

    // Cut short by its alignment padding only: no sample lost, but the
    // loader refuses it (truncated), so verify must say so too.
    let space = Space::open(&sp).unwrap();
    let last = space.extent_lens().len() as u32 - 1;
    let ext = space.extent_path(last);
    let planned = space.extent_lens()[last as usize];
    let data_end = (0..space.catalog().len())
        .filter_map(|id| {
            space
                .location(id)
                .filter(|l| l.extent == last)
                .map(|l| l.offset + space.catalog().sample(id).len as u64)
        })
        .max()
        .unwrap();
    drop(space);
    assert!(data_end < planned, "{data_end} {planned}");
    {
        fs::OpenOptions::new()
            .write(true)
            .open(&ext)
            .unwrap()
            .set_len(data_end)
            .unwrap();
        let e = fails(&["read", "--space", s(&sp), "--epochs", "1"], 1);
        assert!(e.contains("truncated"), "{e}");
        let e = fails(&["verify", "--space", s(&sp)], 3);
        assert!(
            e.contains(&format!(
                "extent {} is {data_end} bytes, manifest says {planned}",
                ext.display()
            )),
            "{e}"
        );
        ok(&["verify", "--space", s(&sp), "--repair"]);
        ok(&["read", "--space", s(&sp), "--epochs", "1"]);
    }
}
