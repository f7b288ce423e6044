//! kspeed's consumer against an owner it was not built with:
//! tests/independent/owner.py, a node service written in Python from
//! docs/PROTOCOL.md and docs/FORMAT.md alone. It serves every sample of a
//! catalog from the source files, reports its times in DATA headers (the
//! header's `b`), and delays each grant where asked: before the bytes are
//! ready (a slow disk) or after the frame's times were taken (a slow
//! link). `kspeed read --cluster --json` must get every sample, byte-exact
//! (`--verify`), and charge the stall to the node's reading in the first
//! case and to the link in the second.

mod common;

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use common::*;

/// A child's output: the first line of stderr that satisfies `want`, read
/// on a thread so the wait has a deadline.
fn line_of(child: &mut Child, want: fn(&str) -> bool, deadline: Duration) -> String {
    let err = child.stderr.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        // Reads to the end, so the child never blocks on a full pipe.
        for line in BufReader::new(err).lines().map_while(Result::ok) {
            if want(&line) {
                let _ = tx.send(line);
            }
        }
    });
    rx.recv_timeout(deadline).unwrap_or_else(|_| {
        let _ = child.kill();
        panic!("no such line from the owner within {deadline:?}")
    })
}

/// Runs `kspeed ARGS` and returns its stdout, killing it past `deadline`.
fn kspeed_within(args: &[&str], deadline: Duration) -> String {
    let mut child = Command::new(kspeed_bin())
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = child.stdout.take().unwrap();
    let mut err = child.stderr.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let (mut o, mut e) = (String::new(), String::new());
        let _ = out.read_to_string(&mut o);
        let _ = err.read_to_string(&mut e);
        let _ = tx.send((o, e));
    });
    let Ok((o, e)) = rx.recv_timeout(deadline) else {
        let _ = child.kill();
        panic!("kspeed {args:?} did not finish within {deadline:?}");
    };
    let st = child.wait().unwrap();
    assert!(st.success(), "kspeed {args:?}: {st}\n{e}");
    o
}

struct Owner(Child);

impl Drop for Owner {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts the owner with `extra` arguments; returns it and its address.
fn owner(cat: &std::path::Path, token: &std::path::Path, extra: &[&str]) -> (Owner, String) {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/independent/owner.py");
    let mut c = Command::new("python3")
        .args([script, "--catalog", s(cat), "--token-file", s(token)])
        .args(["--listen", "127.0.0.1:0"])
        .args(extra)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("python3");
    let line = line_of(
        &mut c,
        |l| l.contains("listening on "),
        Duration::from_secs(60),
    );
    // "listening on HOST:PORT: catalog …"
    let addr = line
        .split("listening on ")
        .nth(1)
        .and_then(|r| r.split(": ").next())
        .unwrap()
        .to_string();
    (Owner(c), addr)
}

fn secs(v: &serde_json::Value, k: &str) -> f64 {
    v[k].as_f64().unwrap_or_else(|| panic!("no {k} in {v}"))
}

#[test]
fn the_consumer_splits_an_independent_owners_times() {
    if Command::new("python3").arg("--version").output().is_err() {
        skip("python3 is not installed");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    gen("tiny", 200, &src);
    let cat = tmp.path().join("cat.ksc");
    ok(&["catalog", "--source", s(&src), "--out", s(&cat)]);
    let token = tmp.path().join("token");
    std::fs::write(&token, "independent-owner\n").unwrap();
    // (owner's delay, which share must dominate)
    for (extra, dominant) in [
        (
            ["--ready-delay-ms", "20", "--hold-ms", "0"],
            "peer_read_seconds",
        ),
        (
            ["--ready-delay-ms", "0", "--hold-ms", "20"],
            "peer_link_seconds",
        ),
    ] {
        let (_owner, addr) = owner(&cat, &token, &extra);
        let cluster = tmp.path().join("cluster.txt");
        std::fs::write(&cluster, format!("0 {addr}\n")).unwrap();
        // One sample at a time, so each grant's delay is a wait.
        let out = kspeed_within(
            &[
                "read",
                "--source",
                s(&src),
                "--catalog",
                s(&cat),
                "--cluster",
                s(&cluster),
                "--token-file",
                s(&token),
                "--json",
                "--progress",
                "none",
                "--verify",
                "--lookahead",
                "1",
                "--batch-size",
                "1",
            ],
            Duration::from_secs(120),
        );
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(v["samples"], 200, "{v}");
        assert_eq!(v["cluster"]["remote_samples"], 200, "{v}");
        let c = &v["stall_causes"];
        let (read, send, link) = (
            secs(c, "peer_read_seconds"),
            secs(c, "peer_send_seconds"),
            secs(c, "peer_link_seconds"),
        );
        // 200 waits of about 20 ms each.
        assert!(secs(c, "peers_seconds") > 2.0, "{extra:?}: {c}");
        let top = secs(c, dominant);
        assert!(
            top > 0.8 * (read + send + link),
            "{extra:?}: {dominant} should lead: {c}"
        );
        let p = &c["slowest_peers"][0];
        assert_eq!(p["node"], 0, "{c}");
        let per_node = dominant.replace("peer_", "");
        assert!(
            (secs(p, &per_node) - top).abs() < 1e-6,
            "the node's share is the whole: {c}"
        );
    }
}
