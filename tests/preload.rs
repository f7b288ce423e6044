//! End-to-end tests of sources, catalog, preload, inspect, verify and unload
//! over real files, through the real `kspeed` binary and the library API.
//!
//! Why this file is over ~800 lines: the end-to-end life of a space
//! (source, catalog, preload, inspect, verify, unload) reads in order.

mod common;

use std::fs;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use common::*;
use kspeed::dataset::{self, Catalog, Placement, PreloadOptions, SourceSpec, Space};
use kspeed::Error;

/// Reads sample `id` back from a space through its manifest.
fn read_from_space(space: &Space, id: u64) -> Vec<u8> {
    let loc = space.location(id).expect("held here");
    let len = space.catalog().sample(id).len as usize;
    let f = fs::File::open(space.extent_path(loc.extent)).unwrap();
    let mut buf = vec![0u8; len];
    f.read_exact_at(&mut buf, loc.offset).unwrap();
    buf
}

#[test]
fn image_folder_end_to_end() {
    let t = tempfile::tempdir().unwrap();
    let src = t.path().join("src");
    let files = odd_tree(&src);
    let space_dir = t.path().join("space");
    let out = ok(&["preload", "--source", s(&src), "--space", s(&space_dir)]);
    assert!(out.contains("preloaded 13 samples"), "{out}");

    let space = Space::open(&space_dir).unwrap();
    let cat = space.catalog();
    assert_eq!(cat.len(), 13);
    assert_eq!(cat.class_count(), 3);
    assert_eq!(
        (0..3).map(|i| cat.class_name(i)).collect::<Vec<_>>(),
        ["cat", "dog", "eel"]
    );
    // Every sample: label from its class folder, bytes and CRC identical.
    let mut seen = 0;
    for id in 0..cat.len() {
        let smp = cat.sample(id);
        let name = cat.file(smp.file).name.to_str().unwrap().to_string();
        let (_, want) = files
            .iter()
            .find(|(rel, _)| *rel == name)
            .expect("known file");
        let expect_label = match name.split('/').next().unwrap() {
            "cat" => Some(0),
            "dog" => Some(1),
            "eel" => Some(2),
            _ => None,
        };
        assert_eq!(smp.label, expect_label, "{name}");
        assert_eq!(smp.crc32c, crc32c::crc32c(want));
        assert_eq!(&read_from_space(&space, id), want, "{name}");
        let loc = space.location(id).unwrap();
        assert_eq!(loc.offset % 4096, 0, "alignment rule");
        seen += 1;
    }
    assert_eq!(seen, files.len());
    // Samples are ordered by path, component-wise.
    let names: Vec<String> = (0..cat.len())
        .map(|i| {
            cat.file(cat.sample(i).file)
                .name
                .to_str()
                .unwrap()
                .to_string()
        })
        .collect();
    let mut sorted = names.clone();
    sorted.sort_by(|a, b| Path::new(a).cmp(Path::new(b)));
    assert_eq!(names, sorted);
    for (i, len) in space.extent_lens().iter().enumerate() {
        assert_eq!(len % 4096, 0);
        assert_eq!(
            fs::metadata(space.extent_path(i as u32)).unwrap().len(),
            *len
        );
    }

    // Idempotent.
    let out = ok(&["preload", "--source", s(&src), "--space", s(&space_dir)]);
    assert!(out.contains("up to date: nothing copied"), "{out}");
    let out = ok(&["verify", "--space", s(&space_dir)]);
    assert!(
        out.contains("verified 13 samples") && out.contains("0 bad"),
        "{out}"
    );

    let out = ok(&["inspect", "--space", s(&space_dir)]);
    for want in [
        "samples:      13",
        "classes:      3",
        "1 unlabeled",
        "p50",
        "status:       complete",
    ] {
        assert!(out.contains(want), "missing {want:?} in\n{out}");
    }

    ok(&["unload", "--space", s(&space_dir)]);
    assert!(!space_dir.exists());
    let e = fails(&["unload", "--space", s(&space_dir)], 1);
    assert!(e.contains("not a complete kspeed space"), "{e}");
}

#[test]
fn file_list_source() {
    let t = tempfile::tempdir().unwrap();
    let a = put(t.path(), "data/a.bin", &bytes_for(1, 3000));
    put(t.path(), "data/sub/b.bin", &bytes_for(2, 10));
    let list = t.path().join("train.txt");
    fs::write(
        &list,
        format!(
            "# comment\ndata/a.bin\t3\n\n{}\ndata/sub/b.bin\t0\r\n",
            a.display()
        ),
    )
    .unwrap();
    let cat_path = t.path().join("c.ksc");
    let out = ok(&[
        "catalog",
        "--source",
        &format!("list:{}", list.display()),
        "--out",
        s(&cat_path),
    ]);
    assert!(out.contains("3 samples"), "{out}");
    let cat = Catalog::open(&cat_path).unwrap();
    let labels: Vec<Option<u32>> = (0..3).map(|i| cat.sample(i).label).collect();
    assert_eq!(labels, [Some(3), None, Some(0)]);
    assert_eq!(cat.sample(1).crc32c, crc32c::crc32c(&bytes_for(1, 3000)));
    assert_eq!(cat.class_count(), 0);

    // Preload from the prebuilt catalog, then verify.
    let sp = t.path().join("space");
    ok(&["preload", "--catalog", s(&cat_path), "--space", s(&sp)]);
    ok(&["verify", "--space", s(&sp)]);

    // A bad label names the file and the line.
    fs::write(&list, "data/a.bin\t3\ndata/sub/b.bin\tseven\n").unwrap();
    let e = fails(
        &[
            "catalog",
            "--source",
            &format!("list:{}", list.display()),
            "--out",
            s(&cat_path),
        ],
        1,
    );
    assert!(
        e.contains("train.txt, line 2") && e.contains("seven"),
        "{e}"
    );
    // A missing file is named.
    fs::write(&list, "data/a.bin\nnope.bin\n").unwrap();
    let e = fails(
        &[
            "catalog",
            "--source",
            &format!("list:{}", list.display()),
            "--out",
            s(&cat_path),
        ],
        1,
    );
    assert!(e.contains("nope.bin"), "{e}");
}

fn write_shard(path: &Path, first: u64, count: u64, with_labels: bool) -> Vec<Vec<u8>> {
    let mut b = tar::Builder::new(fs::File::create(path).unwrap());
    let mut datas = Vec::new();
    for i in first..first + count {
        let data = bytes_for(i, (i as usize * 997) % 20_000);
        let mut h = tar::Header::new_gnu();
        h.set_size(data.len() as u64);
        h.set_mode(0o644);
        h.set_cksum();
        b.append_data(&mut h, format!("{i:05}.jpg"), &data[..])
            .unwrap();
        if with_labels {
            let label = format!("{}\n", i % 5);
            let mut h = tar::Header::new_gnu();
            h.set_size(label.len() as u64);
            h.set_mode(0o644);
            h.set_cksum();
            b.append_data(&mut h, format!("{i:05}.cls"), label.as_bytes())
                .unwrap();
        }
        // An extra member per key that is not the sample.
        let meta = b"{}";
        let mut h = tar::Header::new_gnu();
        h.set_size(2);
        h.set_mode(0o644);
        h.set_cksum();
        b.append_data(&mut h, format!("{i:05}.json"), &meta[..])
            .unwrap();
        datas.push(data);
    }
    b.finish().unwrap();
    datas
}

#[test]
fn tar_shards_are_indexed_in_place() {
    let t = tempfile::tempdir().unwrap();
    let shards = t.path().join("shards");
    fs::create_dir_all(&shards).unwrap();
    let mut all = write_shard(&shards.join("shard-000.tar"), 0, 7, true);
    all.extend(write_shard(&shards.join("shard-001.tar"), 7, 5, true));
    let sp = t.path().join("space");
    ok(&[
        "preload",
        "--source",
        &format!("tar:{}", shards.display()),
        "--space",
        s(&sp),
    ]);
    let space = Space::open(&sp).unwrap();
    let cat = space.catalog();
    assert_eq!(cat.len(), 12);
    assert_eq!(
        cat.file_count(),
        2,
        "one file entry per shard, nothing extracted"
    );
    for id in 0..12u64 {
        let smp = cat.sample(id);
        assert_eq!(smp.label, Some((id % 5) as u32));
        // The catalog's (shard, offset, len) points at the member's bytes.
        let shard = fs::File::open(cat.file_path(smp.file)).unwrap();
        let mut buf = vec![0u8; smp.len as usize];
        shard.read_exact_at(&mut buf, smp.offset).unwrap();
        assert_eq!(buf, all[id as usize]);
        assert_eq!(read_from_space(&space, id), all[id as usize]);
    }
    ok(&["verify", "--space", s(&sp)]);

    // A single shard as a bare .tar path; no labels.
    let one = t.path().join("one.tar");
    write_shard(&one, 100, 3, false);
    let cat_path = t.path().join("one.ksc");
    ok(&["catalog", "--source", s(&one), "--out", s(&cat_path)]);
    let cat = Catalog::open(&cat_path).unwrap();
    assert_eq!(cat.len(), 3);
    assert_eq!(cat.sample(0).label, None);

    // A truncated shard is a named error.
    let bytes = fs::read(shards.join("shard-001.tar")).unwrap();
    fs::write(shards.join("shard-001.tar"), &bytes[..bytes.len() / 2]).unwrap();
    let e = fails(
        &[
            "catalog",
            "--source",
            &format!("tar:{}", shards.display()),
            "--out",
            s(&cat_path),
        ],
        1,
    );
    assert!(e.contains("shard-001.tar"), "{e}");
}

#[test]
fn bad_sources_are_named_errors() {
    let t = tempfile::tempdir().unwrap();
    let sp = t.path().join("space");

    let empty = t.path().join("empty");
    fs::create_dir_all(empty.join("class_a")).unwrap();
    let e = fails(&["preload", "--source", s(&empty), "--space", s(&sp)], 1);
    assert!(e.contains("has no samples") && e.contains("empty"), "{e}");

    let e = fails(
        &[
            "preload",
            "--source",
            s(&t.path().join("nowhere")),
            "--space",
            s(&sp),
        ],
        1,
    );
    assert!(e.contains("nowhere"), "{e}");

    let looped = t.path().join("looped");
    put(&looped, "a/x.bin", b"x");
    std::os::unix::fs::symlink(&looped, looped.join("a/back")).unwrap();
    let e = fails(&["preload", "--source", s(&looped), "--space", s(&sp)], 1);
    assert!(e.contains("symlink loop") && e.contains("back"), "{e}");

    // Nothing half-written is visible: the space is not a space.
    assert!(matches!(Space::open(&sp), Err(Error::NotASpace { .. })));
}

#[test]
fn unreadable_file_is_named() {
    let t = tempfile::tempdir().unwrap();
    let src = t.path().join("src");
    put(&src, "c/a.bin", b"aaaa");
    let secret = put(&src, "c/b.bin", b"bbbb");
    fs::set_permissions(&secret, std::os::unix::fs::PermissionsExt::from_mode(0o000)).unwrap();
    let sp = t.path().join("space");
    let o = if is_root() {
        // Root reads anything: run as nobody so the permission bites.
        if Command::new("setpriv").arg("--version").output().is_err() {
            skip("unreadable_file_is_named: root without setpriv");
            return;
        }
        for d in [t.path(), &src, &src.join("c")] {
            fs::set_permissions(d, std::os::unix::fs::PermissionsExt::from_mode(0o777)).unwrap();
        }
        fs::set_permissions(
            src.join("c/a.bin"),
            std::os::unix::fs::PermissionsExt::from_mode(0o644),
        )
        .unwrap();
        Command::new("setpriv")
            .args([
                "--reuid=65534",
                "--regid=65534",
                "--clear-groups",
                kspeed_bin(),
            ])
            .args([
                "preload",
                "--source",
                s(&src),
                "--space",
                s(&sp),
                "--progress=none",
            ])
            .output()
            .unwrap()
    } else {
        kspeed(&["preload", "--source", s(&src), "--space", s(&sp)])
    };
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let e = text(&o);
    assert!(e.contains("b.bin") && e.contains("ermission denied"), "{e}");
}

#[test]
fn changed_source_is_reported_not_copied() {
    let t = tempfile::tempdir().unwrap();
    let src = t.path().join("src");
    odd_tree(&src);
    let sp = t.path().join("space");
    ok(&["preload", "--source", s(&src), "--space", s(&sp)]);

    // Size change: reported, nothing copied, non-zero exit.
    let f = src.join("dog/img_001.bin");
    fs::write(&f, b"different length").unwrap();
    let e = fails(&["preload", "--source", s(&src), "--space", s(&sp)], 1);
    assert!(
        e.contains("img_001.bin") && e.contains("size 1 -> 16 bytes") && e.contains("--refresh"),
        "{e}"
    );
    // The old space is still complete and correct.
    ok(&["verify", "--space", s(&sp)]);

    // mtime only.
    fs::write(&f, b"1").unwrap();
    let e = fails(&["preload", "--source", s(&src), "--space", s(&sp)], 1);
    assert!(e.contains("modification time changed"), "{e}");

    // Vanished.
    fs::remove_file(src.join("eel/img_002.bin")).unwrap();
    let e = fails(&["preload", "--source", s(&src), "--space", s(&sp)], 1);
    assert!(e.contains("img_002.bin (vanished)"), "{e}");

    // --refresh rebuilds and copies what is there now.
    let out = ok(&[
        "preload",
        "--source",
        s(&src),
        "--space",
        s(&sp),
        "--refresh",
    ]);
    assert!(out.contains("preloaded 12 samples"), "{out}");
    ok(&["verify", "--space", s(&sp)]);

    // Another source into the same space is refused.
    let other = t.path().join("other");
    put(&other, "c/x.bin", b"x");
    let e = fails(&["preload", "--source", s(&other), "--space", s(&sp)], 1);
    assert!(e.contains("holds a catalog of"), "{e}");
}

#[test]
fn content_change_with_same_size_and_mtime_is_caught_while_copying() {
    let t = tempfile::tempdir().unwrap();
    let src = t.path().join("src");
    odd_tree(&src);
    let cat = t.path().join("cat.ksc");
    ok(&["catalog", "--source", s(&src), "--out", s(&cat)]);
    let f = src.join("cat/img_003.bin");
    let md = fs::metadata(&f).unwrap();
    let mut b = fs::read(&f).unwrap();
    b[100] ^= 0xff;
    fs::write(&f, &b).unwrap();
    filetime::set_file_mtime(&f, filetime::FileTime::from_last_modification_time(&md)).unwrap();
    let sp = t.path().join("space");
    let e = fails(&["preload", "--catalog", s(&cat), "--space", s(&sp)], 1);
    assert!(
        e.contains("img_003.bin") && e.contains("content of sample"),
        "{e}"
    );
    assert!(matches!(Space::open(&sp), Err(Error::NotASpace { .. })));
}

/// Starts a throttled preload in the background and waits for its journal.
fn start_slow_preload(src: &Path, sp: &Path) -> std::process::Child {
    let child = Command::new(kspeed_bin())
        .args([
            "preload",
            "--source",
            s(src),
            "--space",
            s(sp),
            "--progress=none",
        ])
        .args([
            "--max-bytes-per-sec",
            "3MB",
            "--checkpoint-bytes",
            "256KiB",
            "--threads",
            "2",
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    while !sp.join("preload.journal").exists() {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "no journal after 60 s"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    child
}

#[test]
fn sigkill_half_way_then_resume() {
    let t = tempfile::tempdir().unwrap();
    let src = t.path().join("src");
    gen("imagenet", 80, &src);
    let sp = t.path().join("space");
    let mut child = start_slow_preload(&src, &sp);
    std::thread::sleep(Duration::from_millis(300));
    child.kill().unwrap(); // SIGKILL
    let status = child.wait().unwrap();
    assert!(!status.success());
    match Space::open(&sp) {
        Err(Error::NotASpace { reason, .. }) => {
            assert!(reason.contains("not finished"), "{reason}")
        }
        other => panic!("expected an unfinished space, got {:?}", other.map(|_| ())),
    }
    let out = ok(&["preload", "--source", s(&src), "--space", s(&sp)]);
    assert!(
        out.contains("resumed an interrupted preload at sample"),
        "{out}"
    );
    let copied: u64 = out
        .split("preloaded ")
        .nth(1)
        .and_then(|r| r.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap();
    assert!(copied < 80, "resume copied everything again: {out}");
    let out = ok(&["verify", "--space", s(&sp)]);
    assert!(
        out.contains("verified 80 samples") && out.contains("0 bad"),
        "{out}"
    );
    assert!(!sp.join("preload.journal").exists());
}

#[test]
fn file_vanishing_during_preload_is_named() {
    let t = tempfile::tempdir().unwrap();
    let src = t.path().join("src");
    gen("imagenet", 80, &src);
    let sp = t.path().join("space");
    let child = start_slow_preload(&src, &sp);
    // The last sample in id order: class folders sort, so it is the last
    // file of the last class.
    let victim = src.join("class_079/00000079.jpg");
    fs::remove_file(&victim).unwrap();
    let o = child.wait_with_output().unwrap();
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let e = text(&o);
    assert!(
        e.contains("00000079.jpg") && e.contains("vanished during preload"),
        "{e}"
    );
    assert!(matches!(Space::open(&sp), Err(Error::NotASpace { .. })));
}

#[test]
fn corrupt_and_missing_extents_are_named_by_verify() {
    let t = tempfile::tempdir().unwrap();
    let src = t.path().join("src");
    odd_tree(&src);
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
    assert!(space.extent_lens().len() > 2, "several extents");
    // Flip a byte inside sample 5.
    let id = 5u64;
    let loc = space.location(id).unwrap();
    let p = space.extent_path(loc.extent);
    let f = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&p)
        .unwrap();
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, loc.offset).unwrap();
    b[0] ^= 0x40;
    f.write_all_at(&b, loc.offset).unwrap();
    drop(f);
    let src_name = space
        .catalog()
        .file(space.catalog().sample(id).file)
        .name
        .to_str()
        .unwrap()
        .to_string();
    let out = fails(&["verify", "--space", s(&sp)], 3);
    assert!(
        out.contains(&format!("sample {id} ("))
            && out.contains("corrupt")
            && out.contains(&src_name),
        "{out}"
    );
    assert!(out.contains("1 bad"), "{out}");

    // Remove the last extent: its samples are reported missing.
    let last = space.extent_lens().len() as u32 - 1;
    fs::remove_file(space.extent_path(last)).unwrap();
    let out = fails(&["verify", "--space", s(&sp)], 3);
    assert!(out.contains("missing"), "{out}");
    let out = ok(&["inspect", "--space", s(&sp)]);
    assert!(out.contains("DAMAGED"), "{out}");
    // Preload notices and repairs (layout unchanged, extents incomplete).
    ok(&[
        "preload",
        "--source",
        s(&src),
        "--space",
        s(&sp),
        "--extent-bytes",
        "64KiB",
    ]);
    ok(&["verify", "--space", s(&sp)]);
}

fn header_crc(h: &[u8]) -> u32 {
    let c = crc32c::crc32c(&h[..28]);
    let c = crc32c::crc32c_append(c, &[0; 4]);
    crc32c::crc32c_append(c, &h[32..])
}

#[test]
fn damaged_catalog_and_manifest_are_named_errors() {
    let t = tempfile::tempdir().unwrap();
    let src = t.path().join("src");
    odd_tree(&src);
    let sp = t.path().join("space");
    ok(&["preload", "--source", s(&src), "--space", s(&sp)]);
    let cat = sp.join("catalog.ksc");
    let good = fs::read(&cat).unwrap();
    let header_len = u32::from_le_bytes(good[12..16].try_into().unwrap()) as usize;
    let case = |name: &str, bytes: Vec<u8>, want: &str| {
        fs::write(&cat, &bytes).unwrap();
        for args in [
            vec!["inspect", "--space", s(&sp)],
            vec!["verify", "--space", s(&sp)],
            vec!["preload", "--source", s(&src), "--space", s(&sp)],
        ] {
            let e = fails(&args, 1);
            assert!(
                e.contains(want) && e.contains("catalog.ksc"),
                "{name}: {args:?}: {e}"
            );
        }
    };
    let mut b = good.clone();
    b[header_len + 30] ^= 4;
    case("body bit flip", b, "body checksum mismatch");
    let mut b = good.clone();
    b[40] ^= 1;
    case("header bit flip", b, "header checksum mismatch");
    case("truncated", good[..good.len() - 3].to_vec(), "truncated");
    case("tiny", good[..12].to_vec(), "truncated");
    let mut b = good.clone();
    b[..8].copy_from_slice(b"NOTKSPD!");
    case("magic", b, "not a kspeed catalog file");
    let with_version = |v: u32| {
        let mut b = good.clone();
        b[8..12].copy_from_slice(&v.to_le_bytes());
        let crc = header_crc(&b[..header_len]);
        b[28..32].copy_from_slice(&crc.to_le_bytes());
        b
    };
    case(
        "version",
        with_version(4),
        "catalog format version 4 is not supported",
    );
    // A catalog of files is written as version 2 (readable by older
    // builds); version 3 (an object's ETag after its name) with no ETags
    // reads the same.
    assert_eq!(good[8], 2, "this build writes version 2 for files");
    fs::write(&cat, with_version(3)).unwrap();
    assert!(ok(&["inspect", "--space", s(&sp)]).contains("(format v3)"));
    // Version 1 (UTF-8 names; same layout) is still read.
    fs::write(&cat, with_version(1)).unwrap();
    let out = ok(&["inspect", "--space", s(&sp)]);
    assert!(out.contains("(format v1)"), "{out}");
    ok(&["verify", "--space", s(&sp)]);
    fs::write(&cat, &good).unwrap();
    ok(&["verify", "--space", s(&sp)]);

    let man = sp.join("manifest.ksm");
    let good = fs::read(&man).unwrap();
    let mut b = good.clone();
    let last = b.len() - 1;
    b[last] ^= 1;
    fs::write(&man, &b).unwrap();
    let e = fails(&["verify", "--space", s(&sp)], 1);
    assert!(
        e.contains("manifest.ksm") && e.contains("body checksum mismatch"),
        "{e}"
    );
    // Preload replaces an unusable manifest.
    ok(&["preload", "--source", s(&src), "--space", s(&sp)]);
    ok(&["verify", "--space", s(&sp)]);
}

#[test]
fn multi_node_placement_with_replicas() {
    let t = tempfile::tempdir().unwrap();
    let src = t.path().join("src");
    gen("tiny", 300, &src);
    let cat_path = t.path().join("cat.ksc");
    ok(&["catalog", "--source", s(&src), "--out", s(&cat_path)]);
    let mut holders = vec![0u32; 300];
    for node in 0..3 {
        let sp = t.path().join(format!("node{node}"));
        ok(&[
            "preload",
            "--catalog",
            s(&cat_path),
            "--space",
            s(&sp),
            "--nodes",
            "3",
            "--node-index",
            &node.to_string(),
            "--replicas",
            "2",
        ]);
        ok(&["verify", "--space", s(&sp)]);
        let space = Space::open(&sp).unwrap();
        let p = Placement::new(3, 2).unwrap();
        for id in 0..300u64 {
            let here = space.location(id).is_some();
            assert_eq!(here, p.holds(node, id));
            if here {
                holders[id as usize] += 1;
            }
        }
        let out = ok(&["inspect", "--space", s(&sp)]);
        assert!(out.contains("3 nodes, 2 copies per sample"), "{out}");
    }
    assert!(
        holders.iter().all(|&h| h == 2),
        "every sample on exactly 2 nodes"
    );
    let e = fails(
        &[
            "preload",
            "--catalog",
            s(&cat_path),
            "--space",
            s(&t.path().join("x")),
            "--nodes",
            "2",
            "--replicas",
            "3",
        ],
        1,
    );
    assert!(
        e.contains("replicas must be between 1 and the number of nodes (2)"),
        "{e}"
    );
    let e = fails(
        &[
            "preload",
            "--catalog",
            s(&cat_path),
            "--space",
            s(&t.path().join("x")),
            "--nodes",
            "2",
            "--node-index",
            "2",
        ],
        1,
    );
    assert!(
        e.contains("node index 2 is not below the node count 2"),
        "{e}"
    );
}

#[test]
fn concurrent_preloads_are_refused() {
    let t = tempfile::tempdir().unwrap();
    let src = t.path().join("src");
    gen("imagenet", 80, &src);
    let sp = t.path().join("space");
    let mut child = start_slow_preload(&src, &sp);
    let e = fails(&["preload", "--source", s(&src), "--space", s(&sp)], 1);
    assert!(e.contains("locked by another kspeed process"), "{e}");
    child.kill().unwrap();
    child.wait().unwrap();
}

/// Mounts a small tmpfs, or says why not.
struct Tmpfs(std::path::PathBuf);

impl Tmpfs {
    fn mount(dir: &Path, size: &str) -> Option<Tmpfs> {
        fs::create_dir_all(dir).unwrap();
        let o = Command::new("mount")
            .args([
                "-t",
                "tmpfs",
                "-o",
                &format!("size={size}"),
                "tmpfs",
                s(dir),
            ])
            .output()
            .ok()?;
        if !o.status.success() {
            skip(&format!(
                "cannot mount tmpfs ({})",
                String::from_utf8_lossy(&o.stderr).trim()
            ));
            return None;
        }
        Some(Tmpfs(dir.to_path_buf()))
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}

#[test]
fn full_disk_is_a_named_error() {
    let t = tempfile::tempdir().unwrap();
    let src = t.path().join("src");
    gen("imagenet", 40, &src); // about 5 MB
    let Some(mnt) = Tmpfs::mount(&t.path().join("mnt"), "2m") else {
        skip("full_disk_is_a_named_error needs root to mount a tmpfs");
        return;
    };
    let sp = mnt.0.join("space");
    // The free-space check refuses before writing.
    let e = fails(&["preload", "--source", s(&src), "--space", s(&sp)], 1);
    assert!(
        e.contains("not enough space on") && e.contains("needed"),
        "{e}"
    );
    // Without it, the write that hits ENOSPC is reported as a full disk.
    let opts = PreloadOptions::default()
        .source(Some(SourceSpec::parse(s(&src)).unwrap()))
        .check_free_space(false);
    match dataset::preload(&sp, &opts) {
        Err(Error::DiskFull { path, needed, .. }) => {
            assert!(path.starts_with(&mnt.0), "{}", path.display());
            assert!(needed > 0);
        }
        other => panic!("expected DiskFull, got {other:?}"),
    }
    assert!(matches!(Space::open(&sp), Err(Error::NotASpace { .. })));

    // A disk too full for the catalog itself: the bytes it needs are named
    // (not "0 bytes needed") and no catalog.ksc.tmp is left behind.
    ok(&["unload", "--space", s(&sp)]);
    let sp = mnt.0.join("space2");
    fs::create_dir_all(&sp).unwrap();
    {
        use std::io::Write;
        let mut fill = fs::File::create(mnt.0.join("filler")).unwrap();
        let chunk = vec![0xa5u8; 64 << 10];
        while fill.write_all(&chunk).is_ok() {}
        let mut small = vec![0u8; 512];
        while fill.write_all(&small).is_ok() {}
        small.truncate(1);
        while fill.write_all(&small).is_ok() {}
    }
    let e = fails(&["preload", "--source", s(&src), "--space", s(&sp)], 1);
    assert!(
        e.contains("not enough space on")
            && e.contains("catalog.ksc")
            && !e.contains(": 0 bytes needed"),
        "{e}"
    );
    assert!(!sp.join("catalog.ksc.tmp").exists(), "{e}");
    assert!(!sp.join("catalog.ksc").exists(), "{e}");
}

#[test]
fn progress_lines_when_not_a_terminal() {
    let t = tempfile::tempdir().unwrap();
    let src = t.path().join("src");
    gen("imagenet", 20, &src);
    let o = Command::new(kspeed_bin())
        .args([
            "preload",
            "--source",
            s(&src),
            "--space",
            s(&t.path().join("sp")),
        ])
        .args(["--max-bytes-per-sec", "4MB", "--progress", "auto"])
        .env("KSPEED_PROGRESS_INTERVAL_MS", "100")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    let line = err
        .lines()
        .find(|l| l.starts_with("preload: "))
        .unwrap_or_else(|| panic!("no progress line in {err}"));
    assert!(line.contains("/s, ETA ") && line.contains('%'), "{line}");
    // Samples counted next to bytes ("…, 7 / 20 samples, …").
    assert!(line.contains(" / 20 samples, "), "{line}");
}

/// `kspeed inspect` shows the catalog identity that a consumer's HELLO
/// carries and a node compares with its own (docs/PROTOCOL.md), as text and
/// in --json, the same value the Rust API gives.
#[test]
fn inspect_shows_the_catalog_identity() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    gen("tiny", 20, &src);
    let sp = tmp.path().join("space");
    ok(&["preload", "--source", s(&src), "--space", s(&sp)]);
    let want = format!("{:08x}", Space::open(&sp).unwrap().catalog().identity());
    let out = ok(&["inspect", "--space", s(&sp)]);
    assert!(
        out.contains(&format!("identity:     {want} ")),
        "no identity {want} in\n{out}"
    );
    let v: serde_json::Value =
        serde_json::from_str(&ok(&["inspect", "--space", s(&sp), "--json"])).unwrap();
    assert_eq!(v["catalog"]["identity"], want.as_str(), "{v}");
}
