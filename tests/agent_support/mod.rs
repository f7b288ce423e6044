//! What the `kspeed agent` tests share: a space, a running agent, `kspeed
//! read` rank processes and their `--json` reports. Every wait is on a
//! condition with a deadline.
#![allow(dead_code)] // each test file uses its own part

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::common::{gen, kspeed_bin, ok, s, text};

/// A space of `count` tiny samples (about 4.5 KiB each).
pub fn space(dir: &Path, count: u64) -> PathBuf {
    let src = dir.join("src");
    gen("tiny", count, &src);
    let sp = dir.join("space");
    ok(&["preload", "--source", s(&src), "--space", s(&sp)]);
    sp
}

/// Lines a child wrote to one stream, collected by a thread.
#[derive(Clone, Default)]
pub struct Lines(pub Arc<(Mutex<Vec<String>>, Condvar)>);

impl Lines {
    pub fn follow(stream: impl std::io::Read + Send + 'static) -> Lines {
        let l = Lines::default();
        let l2 = l.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stream).lines() {
                let Ok(line) = line else { break };
                let (m, cv) = &*l2.0;
                m.lock().unwrap().push(line);
                cv.notify_all();
            }
        });
        l
    }

    /// Waits for a line containing every one of `needles`.
    pub fn wait_for(&self, needles: &[&str], within: Duration) -> String {
        let deadline = Instant::now() + within;
        let (m, cv) = &*self.0;
        let mut g = m.lock().unwrap();
        loop {
            if let Some(l) = g.iter().find(|l| needles.iter().all(|n| l.contains(n))) {
                return l.clone();
            }
            let now = Instant::now();
            assert!(
                now < deadline,
                "no line with {needles:?} within {within:?}; got:\n{}",
                g.join("\n")
            );
            g = cv.wait_timeout(g, deadline - now).unwrap().0;
        }
    }

    /// Waits until `cond` holds for the lines so far (`what` names it in
    /// the failure).
    pub fn wait_until(&self, what: &str, within: Duration, cond: impl Fn(&[String]) -> bool) {
        let deadline = Instant::now() + within;
        let (m, cv) = &*self.0;
        let mut g = m.lock().unwrap();
        while !cond(&g) {
            let now = Instant::now();
            if now >= deadline {
                let all = g.join("\n");
                drop(g);
                panic!("not {what} within {within:?}; got:\n{all}");
            }
            g = cv.wait_timeout(g, deadline - now).unwrap().0;
        }
    }

    /// Waits until exactly `n` lines contain `needle` (fails on more, or
    /// on fewer at the deadline).
    pub fn wait_count(&self, needle: &str, n: usize, within: Duration) {
        let count = |lines: &[String]| lines.iter().filter(|l| l.contains(needle)).count();
        self.wait_until(&format!("{n} lines with {needle:?}"), within, |l| {
            count(l) >= n
        });
        let got = count(&self.0 .0.lock().unwrap_or_else(|p| p.into_inner()));
        assert_eq!(got, n, "lines with {needle:?}:\n{}", self.all());
    }

    pub fn all(&self) -> String {
        // A failed wait panics holding the lock: the log is still wanted.
        let g = self.0 .0.lock().unwrap_or_else(|p| p.into_inner());
        g.join("\n")
    }
}

/// A running `kspeed agent`; killed with SIGKILL when dropped.
pub struct Agent {
    pub child: Child,
    /// Its stdout (the "node service on ADDR" and "agent serving" lines).
    pub out: Lines,
    pub log: Lines,
}

impl Agent {
    pub fn start(space: &Path, socket: &Path, extra: &[&str]) -> Agent {
        Self::start_env(space, socket, extra, &[])
    }

    /// As [`Agent::start`], with `env` set in the agent's environment.
    pub fn start_env(space: &Path, socket: &Path, extra: &[&str], env: &[(&str, &str)]) -> Agent {
        let mut child = Command::new(kspeed_bin())
            .args(["agent", "-v", "--space", s(space), "--socket", s(socket)])
            .args(extra)
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn kspeed agent");
        let out = Lines::follow(child.stdout.take().unwrap());
        let log = Lines::follow(child.stderr.take().unwrap());
        out.wait_for(&["agent serving"], Duration::from_secs(30));
        Agent { child, out, log }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            // The test failed: what the agent said is part of why.
            eprintln!(
                "--- kspeed agent {} log (last 40 lines)\n{}",
                self.child.id(),
                self.log
                    .all()
                    .lines()
                    .rev()
                    .take(40)
                    .collect::<Vec<_>>()
                    .into_iter()
                    .rev()
                    .collect::<Vec<_>>()
                    .join("\n")
            );
        }
    }
}

/// `kspeed read` arguments for rank `rank` of `world`.
pub fn read_args(space: &Path, rank: u32, world: u32, epochs: u64, extra: &[&str]) -> Vec<String> {
    let mut v: Vec<String> = [
        "read",
        "--progress=none",
        "--json",
        "--digest",
        "--space",
        s(space),
        "--rank",
        &rank.to_string(),
        "--world",
        &world.to_string(),
        "--seed",
        "11",
        "--batch-size",
        "16",
        // A small ring: many wraps, and flow control through the agent.
        "--ring-bytes",
        "256KiB",
        "--epochs",
        &epochs.to_string(),
        "--start-epoch",
        "1",
    ]
    .iter()
    .map(|a| a.to_string())
    .collect();
    v.extend(extra.iter().map(|a| a.to_string()));
    v
}

pub fn spawn_read(args: &[String]) -> Child {
    Command::new(kspeed_bin())
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn kspeed read")
}

/// Waits for a child to exit, at most `within` (then kills it and fails).
pub fn wait_output(child: Child, within: Duration) -> std::process::Output {
    let pid = child.id();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(within) {
        Ok(o) => o.expect("wait for the child"),
        Err(_) => {
            let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
            panic!("pid {pid} did not exit within {within:?}");
        }
    }
}

/// Waits for a read and returns its (samples, digest) from `--json`.
pub fn finish(child: Child) -> (u64, String) {
    let o = wait_output(child, Duration::from_secs(120));
    assert!(o.status.success(), "kspeed read failed:\n{}", text(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("json report");
    (
        v["samples"].as_u64().expect("samples"),
        v["digest"].as_str().expect("digest").to_string(),
    )
}

pub fn embedded(space: &Path, rank: u32, world: u32, epochs: u64) -> (u64, String) {
    finish(spawn_read(&read_args(
        space,
        rank,
        world,
        epochs,
        &["--agent", "off"],
    )))
}

pub fn attached_args(space: &Path, sock: &Path, rank: u32, world: u32, epochs: u64) -> Vec<String> {
    read_args(
        space,
        rank,
        world,
        epochs,
        &["--agent", "required", "--agent-socket", s(sock)],
    )
}

/// A read's `--json` report: (samples, digest, disk reads, tier hits).
pub fn report(child: Child) -> (u64, String, u64, u64) {
    let o = wait_output(child, Duration::from_secs(120));
    assert!(o.status.success(), "kspeed read failed:\n{}", text(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("json report");
    let n = |k: &str| v[k].as_u64().unwrap_or_else(|| panic!("{k} in {v}"));
    (
        n("samples"),
        v["digest"].as_str().expect("digest").to_string(),
        n("disk_reads"),
        n("tier_hits"),
    )
}

/// Arguments for one epoch (`epoch`) of rank `rank` of `world`.
pub fn one_epoch(args: Vec<String>, epoch: u64) -> Vec<String> {
    let mut v = args;
    let at = v.iter().position(|a| a == "--start-epoch").expect("flag") + 1;
    v[at] = epoch.to_string();
    v
}
/// An embedded read of one epoch: (samples, digest).
pub fn embedded_epoch(space: &Path, rank: u32, world: u32, epoch: u64) -> (u64, String) {
    let args = one_epoch(read_args(space, rank, world, 1, &["--agent", "off"]), epoch);
    finish(spawn_read(&args))
}

/// The body of `GET /metrics` from `addr` (a deadline on every read),
/// after checking the answer is 200 with OpenMetrics text.
pub fn http_get(addr: &str) -> String {
    use std::io::{Read, Write};
    let mut c = std::net::TcpStream::connect(addr).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(c, "GET /metrics HTTP/1.0\r\nHost: {addr}\r\n\r\n").unwrap();
    let mut all = String::new();
    c.read_to_string(&mut all).unwrap();
    let (head, body) = all.split_once("\r\n\r\n").unwrap_or((&all, ""));
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    body.to_string()
}

/// The address an agent started with `--metrics` prints.
pub fn metrics_addr_of(a: &Agent) -> String {
    a.out
        .wait_for(&["metrics on http://"], Duration::from_secs(5))
        .trim()
        .strip_prefix("metrics on http://")
        .and_then(|l| l.strip_suffix("/metrics"))
        .expect("the agent prints its metrics address")
        .to_string()
}

/// The value of the sample `name` (its labels included, if any) in a
/// scrape.
pub fn sample_value(text: &str, name: &str) -> f64 {
    text.lines()
        .find(|l| l.rsplit_once(' ').is_some_and(|(n, _)| n == name))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse::<f64>().ok())
        .unwrap_or_else(|| panic!("no {name} in:\n{text}"))
}

/// The bytes of every file under `p`.
pub fn tree_bytes(p: &Path) -> u64 {
    std::fs::read_dir(p)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            match e.file_type().unwrap().is_dir() {
                true => tree_bytes(&e.path()),
                false => e.metadata().unwrap().len(),
            }
        })
        .sum()
}

/// A partial space under `dir` holding a third of 600 tiny samples'
/// bytes (the rest stays in its source, `dir/src`), and that third.
pub fn partial_space(dir: &Path) -> (PathBuf, u64) {
    let src = dir.join("src");
    gen("tiny", 600, &src);
    let third = tree_bytes(&src) / 3;
    let sp = dir.join("space");
    ok(&[
        "preload",
        "--source",
        s(&src),
        "--space",
        s(&sp),
        "--max-bytes",
        &third.to_string(),
    ]);
    (sp, third)
}
