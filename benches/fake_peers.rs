//! One node service (a `kspeed agent --listen` or `kspeed serve`) against
//! thousands of consumer links from this one process (issue 28, "one agent
//! and 4,095 fake peers"): the node's CPU while the links are idle and
//! while they grant, and the handshake burst. The links speak the protocol as
//! kspeed's consumer does (`tests/common/fake_peers.rs`).
//!
//! ```text
//! cargo bench --bench fake_peers -- --addr 127.0.0.1:7400 --catalog CAT \
//!     --token-file TOKEN --links 4095 --pid AGENT_PID [--idle-secs 20] \
//!     [--grants-per-sec 24000] [--load-secs 10] [--metrics HOST:PORT] [--json]
//! ```
//!
//! `scripts/bench_fake_peers.py` starts the agents (two builds side by
//! side), runs this for several link counts and prints the table in
//! BENCHMARKS.md. The node's CPU is the sum over its threads of
//! /proc/PID/task/*/schedstat (ns) across each phase; with `--metrics`
//! (the node's `--metrics` address) its pollers' ticks and their busy
//! time too (`kspeed_serve_poller_ticks`, `..._busy_seconds`).

#[path = "../tests/common/fake_peers.rs"]
mod fake_peers;

use std::time::Duration;

fn main() {
    let mut addr = None;
    let mut catalog = None;
    let mut token_file = None;
    let mut links = 4095usize;
    let mut pid = None;
    let mut idle_secs = 20.0f64;
    let mut grants_per_sec = 24_000.0f64;
    let mut load_secs = 10.0f64;
    let mut json = false;
    let mut metrics: Option<String> = None;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut val = || args.next().unwrap_or_else(|| panic!("{a} needs a value"));
        match a.as_str() {
            "--addr" => addr = Some(val()),
            "--catalog" => catalog = Some(val()),
            "--token-file" => token_file = Some(val()),
            "--links" => links = val().parse().expect("--links N"),
            "--pid" => pid = Some(val().parse::<u32>().expect("--pid PID")),
            "--idle-secs" => idle_secs = val().parse().expect("--idle-secs S"),
            "--grants-per-sec" => grants_per_sec = val().parse().expect("--grants-per-sec R"),
            "--load-secs" => load_secs = val().parse().expect("--load-secs S"),
            "--json" => json = true,
            "--metrics" => metrics = Some(val()),
            // `cargo bench` passes --bench.
            "--bench" => {}
            other => panic!("unknown argument {other}"),
        }
    }
    let (Some(addr), Some(catalog), Some(token_file)) = (addr, catalog, token_file) else {
        eprintln!("usage: fake_peers --addr HOST:PORT --catalog FILE --token-file FILE [--links N] [--pid PID] [--idle-secs S] [--grants-per-sec R] [--load-secs S] [--metrics HOST:PORT] [--json]");
        std::process::exit(2);
    };
    let limit = fake_peers::raise_nofile();
    if limit < links as u64 + 64 {
        eprintln!("the open-file limit is {limit}: too low for {links} links (raise the hard limit: ulimit -Hn)");
        std::process::exit(1);
    }
    let cat = kspeed::dataset::Catalog::open(std::path::Path::new(&catalog))
        .unwrap_or_else(|e| panic!("{catalog}: {e}"));
    let token = std::fs::read_to_string(&token_file).expect("token file");
    let hello = fake_peers::hello(&cat, token.trim_end().as_bytes());
    let (peers, hs) = fake_peers::connect(&addr, &hello, &cat, links, Duration::from_secs(120));
    let Some(mut peers) = peers else {
        eprintln!("no link admitted: {hs:?}");
        std::process::exit(1);
    };
    // The first heartbeats and keepalives of every link (the burst's
    // answers) are not part of the idle figure.
    let m = metrics.as_deref();
    let _settle = peers.run(3.0, 0.0, None, None);
    let idle = peers.run(idle_secs, 0.0, pid, m);
    let load = if grants_per_sec > 0.0 && load_secs > 0.0 {
        let l = peers.run(load_secs, grants_per_sec, pid, m);
        let _drain = peers.run(1.0, 0.0, None, None);
        Some(l)
    } else {
        None
    };
    let pct = |p: &fake_peers::Phase| p.node_cpu_ns.map(|ns| ns as f64 / 1e7 / p.secs);
    if json {
        let phase = |p: &fake_peers::Phase| {
            format!(
                "{{\"secs\":{:.3},\"node_cpu_pct\":{},\"own_cpu_pct\":{:.3},\"heartbeats\":{},\"keepalives\":{},\"grants\":{},\"grants_done\":{},\"data_bytes\":{},\"errors\":{},\"violations\":{},\"closed\":{},\"longest_silence_ms\":{},\"node_ticks\":{},\"node_tick_busy_ns\":{}}}",
                p.secs,
                pct(p).map_or("null".into(), |v| format!("{v:.4}")),
                p.own_cpu_ns as f64 / 1e7 / p.secs,
                p.heartbeats,
                p.keepalives,
                p.grants,
                p.grants_done,
                p.data_bytes,
                p.errors.values().sum::<u64>(),
                p.violations,
                p.closed,
                p.longest_silence_ms,
                p.node_ticks.map_or("null".into(), |v| v.to_string()),
                p.node_tick_busy_ns.map_or("null".into(), |v| v.to_string())
            )
        };
        println!(
            "{{\"links\":{},\"welcomed\":{},\"refused\":{},\"handshake_secs\":{:.3},\"idle\":{},\"load\":{}}}",
            hs.links,
            hs.welcomed,
            hs.refused.values().sum::<usize>(),
            hs.secs,
            phase(&idle),
            load.as_ref().map_or("null".into(), phase)
        );
        return;
    }
    println!(
        "{} links: {} admitted in {:.2} s, refused {:?}",
        hs.links, hs.welcomed, hs.secs, hs.refused
    );
    println!(
        "idle {:.1} s: node CPU {} % of a core; {:.2} heartbeats and {:.2} keepalives per link per s; longest silence {} ms",
        idle.secs,
        pct(&idle).map_or("?".into(), |v| format!("{v:.3}")),
        idle.heartbeats as f64 / peers.len() as f64 / idle.secs,
        idle.keepalives as f64 / peers.len() as f64 / idle.secs,
        idle.longest_silence_ms
    );
    let ticks = |p: &fake_peers::Phase| match (p.node_ticks, p.node_tick_busy_ns) {
        (Some(t), Some(b)) if t > 0 => format!(
            "; {:.0} poller ticks/s, {:.1} us busy per tick",
            t as f64 / p.secs,
            b as f64 / 1e3 / t as f64
        ),
        _ => String::new(),
    };
    println!("idle ticks{}", ticks(&idle));
    if let Some(l) = &load {
        println!("load ticks{}", ticks(l));
    }
    if let Some(l) = load {
        let per_grant_us = l
            .node_cpu_ns
            .map(|ns| ns as f64 / 1e3 / l.grants_done.max(1) as f64);
        println!(
            "load {:.1} s: {:.0} grants/s answered, node CPU {} % of a core, {} us per grant; errors {:?}, violations {}",
            l.secs,
            l.grants_done as f64 / l.secs,
            pct(&l).map_or("?".into(), |v| format!("{v:.2}")),
            per_grant_us.map_or("?".into(), |v| format!("{v:.2}")),
            l.errors,
            l.violations
        );
    }
}
