//! One consumer against thousands of node services (issue 28, "one agent
//! and 4,095 fake peers", the consumer's side): a loader in cluster mode
//! whose network thread keeps a link to each of `--nodes` fake nodes
//! (`tests/common/fake_nodes.rs`, run in a child process so this process's
//! CPU is the consumer's alone). The network thread is the same code an
//! agent's shared thread runs for its ranks (one lane here).
//!
//! ```text
//! cargo bench --bench fake_nodes -- --catalog CAT [--nodes 4096] \
//!     [--rate 24000] [--load-secs 10] [--idle-secs 20] [--json]
//! ```
//!
//! Phases: the loader's build (a link to every node: the connect burst);
//! 3 s of warm-up, then `--load-secs` consuming `--rate` samples/s
//! (batches of 256, released at once); then the consumer stops (its ring
//! fills), 3 s to settle, and `--idle-secs` idle, where only keepalives
//! and heartbeats move. CPU is the sum over this process's threads of
//! /proc/self/task/*/schedstat across each phase (`kspeed-net`: the
//! network thread alone), so the fake nodes' work is not in it.
//! `scripts/bench_fake_nodes.py` runs it for several node counts.

#[path = "../tests/common/fake_nodes.rs"]
mod fake_nodes;
#[path = "../tests/common/fake_peers.rs"]
mod fake_peers;

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

const TOKEN: &[u8] = b"fake-nodes-token";
const BATCH: usize = 256;

/// CPU ns of this process's threads: all, and those named `kspeed-net*`.
fn cpu_ns() -> (u64, u64) {
    let (mut all, mut net) = (0, 0);
    for t in std::fs::read_dir("/proc/self/task").unwrap().flatten() {
        let p = t.path();
        let Ok(s) = std::fs::read_to_string(p.join("schedstat")) else {
            continue;
        };
        let ns: u64 = s
            .split_whitespace()
            .next()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        all += ns;
        let comm = std::fs::read_to_string(p.join("comm")).unwrap_or_default();
        if comm.starts_with("kspeed-net") {
            net += ns;
        }
    }
    (all, net)
}

fn child(catalog: &str, nodes: u32) {
    let cat = kspeed::dataset::Catalog::open(std::path::Path::new(catalog)).expect("catalog");
    let f = fake_nodes::FakeNodes::new(nodes as usize, 0, nodes, &cat, TOKEN);
    let mut out = std::io::stdout().lock();
    for a in f.addrs() {
        writeln!(out, "{a}").unwrap();
    }
    writeln!(out, "ready").unwrap();
    out.flush().unwrap();
    drop(out);
    let (stop, t) = fake_nodes::spawn(f);
    // Until the parent closes our stdin.
    let mut line = String::new();
    let _ = std::io::stdin().read_line(&mut line);
    stop.store(true, Ordering::Relaxed);
    let seen = t.join().unwrap();
    println!(
        "seen accepted={} welcomed={} refused={} keepalives={} grant_frames={} grants={} heartbeats={} closed={}",
        seen.accepted,
        seen.welcomed,
        seen.refused,
        seen.keepalives,
        seen.grant_frames,
        seen.grants,
        seen.heartbeats,
        seen.closed
    );
}

/// Descriptors this process has open.
fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count())
}

/// Consumes `rate` samples/s for `secs` (0: none); samples taken.
fn consume(l: &mut kspeed::loader::Loader, rate: f64, secs: f64, epoch: &mut u64) -> u64 {
    let t0 = Instant::now();
    let end = t0 + Duration::from_secs_f64(secs);
    let mut n = 0u64;
    while Instant::now() < end {
        if rate > 0.0 {
            let due = t0 + Duration::from_secs_f64(n as f64 / rate);
            let now = Instant::now();
            if due > now {
                std::thread::sleep((due - now).min(end.saturating_duration_since(now)));
                continue;
            }
            let got = l.next_batch().expect("next_batch").map(|b| b.len() as u64);
            match got {
                Some(k) => n += k,
                None => {
                    *epoch += 1;
                    l.set_epoch(*epoch).expect("set_epoch");
                }
            }
        } else {
            std::thread::sleep(end.saturating_duration_since(Instant::now()));
        }
    }
    n
}

fn main() {
    let mut catalog = None;
    let mut nodes = 4096u32;
    let mut rate = 24_000.0f64;
    let mut load_secs = 10.0f64;
    let mut idle_secs = 20.0f64;
    let mut json = false;
    let mut is_child = false;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut val = || args.next().unwrap_or_else(|| panic!("{a} needs a value"));
        match a.as_str() {
            "--catalog" => catalog = Some(val()),
            "--nodes" => nodes = val().parse().expect("--nodes N"),
            "--rate" => rate = val().parse().expect("--rate R"),
            "--load-secs" => load_secs = val().parse().expect("--load-secs S"),
            "--idle-secs" => idle_secs = val().parse().expect("--idle-secs S"),
            "--json" => json = true,
            "--child" => is_child = true,
            "--bench" => {}
            other => panic!("unknown argument {other}"),
        }
    }
    let Some(catalog) = catalog else {
        eprintln!("usage: fake_nodes --catalog FILE [--nodes N] [--rate R] [--load-secs S] [--idle-secs S] [--json]");
        std::process::exit(2);
    };
    let limit = fake_peers::raise_nofile();
    if limit < 2 * nodes as u64 + 256 {
        eprintln!("open files limit {limit}: too low for {nodes} nodes");
        std::process::exit(1);
    }
    if is_child {
        child(&catalog, nodes);
        return;
    }
    let mut kid = Command::new(std::env::current_exe().unwrap())
        .args([
            "--child",
            "--catalog",
            &catalog,
            "--nodes",
            &nodes.to_string(),
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("fake nodes' process");
    // Every read from the child has a deadline (a reader thread and a
    // channel).
    let (tx, rx) = crossbeam_channel::unbounded::<String>();
    let stdout = kid.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let mut addrs = Vec::new();
    loop {
        let line = rx
            .recv_timeout(Duration::from_secs(120))
            .expect("the fake nodes' addresses within 120 s");
        if line == "ready" {
            break;
        }
        addrs.push(line);
    }
    let cluster_text: String = addrs
        .iter()
        .enumerate()
        .map(|(i, a)| format!("{i} {a}\n"))
        .collect();
    let cluster = kspeed::transport::Cluster::parse(&cluster_text, "fake nodes").unwrap();
    let cat = kspeed::dataset::Catalog::open(std::path::Path::new(&catalog)).unwrap();
    let src = cat.source().into_owned();
    let t0 = Instant::now();
    let mut loader = kspeed::loader::LoaderBuilder::source(&src)
        .catalog(&catalog)
        .cluster(cluster)
        .token(TOKEN)
        .seed(1)
        .batch_size(BATCH)
        .ring_bytes(64 << 20)
        .pin(false)
        .build()
        .expect("the loader against the fake nodes");
    let build_s = t0.elapsed().as_secs_f64();
    let mut epoch = 0;
    consume(&mut loader, rate, 3.0, &mut epoch);
    let (a0, n0) = cpu_ns();
    let t = Instant::now();
    let taken = consume(&mut loader, rate, load_secs, &mut epoch);
    let load_wall = t.elapsed().as_secs_f64();
    let (a1, n1) = cpu_ns();
    consume(&mut loader, 0.0, 3.0, &mut epoch);
    let (a2, n2) = cpu_ns();
    let t = Instant::now();
    consume(&mut loader, 0.0, idle_secs, &mut epoch);
    let idle_wall = t.elapsed().as_secs_f64();
    let (a3, n3) = cpu_ns();
    let stats = loader.stats();
    let fds_before_drop = open_fds();
    drop(loader);
    // The loader's sockets are closed once it is dropped.
    let fds_after_drop = open_fds();
    drop(kid.stdin.take());
    let mut seen = String::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    while let Ok(line) = rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
        if line.starts_with("seen ") {
            seen = line;
            break;
        }
    }
    let _ = kid.kill();
    let _ = kid.wait();
    let pct = |ns: u64, wall: f64| ns as f64 / 1e9 / wall * 100.0;
    let load_rate = taken as f64 / load_wall;
    let r = serde_json::json!({
        "nodes": nodes,
        "build_s": build_s,
        "load_samples_per_s": load_rate,
        "load_cpu_pct": pct(a1 - a0, load_wall),
        "load_net_cpu_pct": pct(n1 - n0, load_wall),
        "load_us_per_sample": (a1 - a0) as f64 / 1e3 / taken.max(1) as f64,
        "load_net_us_per_sample": (n1 - n0) as f64 / 1e3 / taken.max(1) as f64,
        "idle_cpu_pct": pct(a3 - a2, idle_wall),
        "idle_net_cpu_pct": pct(n3 - n2, idle_wall),
        "failovers": stats.failovers,
        "fds_before_drop": fds_before_drop,
        "fds_after_drop": fds_after_drop,
        "seen": seen,
    });
    if json {
        println!("{r}");
    } else {
        println!("{}", serde_json::to_string_pretty(&r).unwrap());
    }
}
