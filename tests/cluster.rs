//! The cluster data path with real processes and real sockets: `kspeed
//! serve` nodes on 127.0.0.x, consumers through the Loader API. Every sample
//! byte-identical and in sampler order on every rank; owners killed or
//! stalled mid-epoch fail over to replicas or the source, or fail with a
//! named error; hostile peers on either side are refused and never write
//! outside a granted range.
//!
//! Why this file is over ~800 lines: every failure mode of the cluster path
//! (owners killed, stalled, hostile; consumers hostile) shares the same
//! spaces, services and consumers; one binary builds them once per process.

mod common;
#[path = "common/fake_peers.rs"]
mod fake_peers;
#[path = "common/nodes.rs"]
mod nodes;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use kspeed::dataset::{Catalog, Space};
use kspeed::loader::{Loader, LoaderBuilder};
use kspeed::sampler::{Sampler, SamplerConfig};
use kspeed::transport::proto::{self, Code, GrantEntry, Header, Hello, Kind, Welcome};
use kspeed::transport::Cluster;
use kspeed::Error;
use nodes::Netns;

const TOKEN: &str = "job-42-token";

/// `KSPEED_TEST_RDMA=1` (set by scripts/test.sh inside the soft-RoCE VM,
/// which also puts 10.77.0.2 and .3 on the RDMA interface): the nodes offer
/// RDMA, the consumers use it, and node i listens on 10.77.0.(i+1).
fn rdma_mode() -> bool {
    std::env::var_os("KSPEED_TEST_RDMA").is_some()
}

/// The address node `i` listens on.
fn node_ip(i: usize) -> String {
    if rdma_mode() {
        format!("10.77.0.{}", i + 1)
    } else {
        format!("127.0.0.{}", i + 1)
    }
}

/// The consumer's transport option for this run.
fn transport() -> Option<kspeed::transport::RdmaOptions> {
    rdma_mode().then(Default::default)
}

/// A `kspeed serve` process; killed on drop.
struct Serve {
    child: Child,
    addr: String,
    /// What it printed before its "serving" line.
    before: Vec<String>,
}

impl Serve {
    fn start(space: &Path, ip: &str, token_file: &Path, extra: &[&str]) -> Serve {
        Serve::launch(space, ip, token_file, extra, None, None)
    }

    /// `start`, with the node's log (`-v`) in `log` and, with `nofile`, its
    /// descriptor limit lowered to that (`ulimit -n`).
    fn launch(
        space: &Path,
        ip: &str,
        token_file: &Path,
        extra: &[&str],
        log: Option<&Path>,
        nofile: Option<u32>,
    ) -> Serve {
        Serve::launch_env(space, ip, token_file, extra, log, nofile, &[])
    }

    /// `launch`, with `env` set in the node's environment.
    fn launch_env(
        space: &Path,
        ip: &str,
        token_file: &Path,
        extra: &[&str],
        log: Option<&Path>,
        nofile: Option<u32>,
        env: &[(&str, &str)],
    ) -> Serve {
        let mut cmd = match nofile {
            Some(n) => {
                let mut c = Command::new("sh");
                c.args(["-c", &format!("ulimit -n {n} && exec \"$0\" \"$@\"")])
                    .arg(kspeed_bin());
                c
            }
            None => Command::new(kspeed_bin()),
        };
        let mut child = cmd
            .args(["serve", "--space", s(space), "--listen"])
            .arg(if ip.contains(':') {
                ip.to_string()
            } else {
                format!("{ip}:0")
            })
            .args(["--token-file", s(token_file), "--pollers", "1"])
            .args(extra)
            .envs(env.iter().copied())
            .args(if rdma_mode() { &["--rdma"][..] } else { &[] })
            .args(if log.is_some() { &["-v"][..] } else { &[] })
            .stdout(Stdio::piped())
            .stderr(match log {
                Some(p) => Stdio::from(std::fs::File::create(p).unwrap()),
                None => Stdio::null(),
            })
            .spawn()
            .expect("start kspeed serve");
        // Lines before "serving" (the metrics address) are kept.
        let mut line = String::new();
        let mut before = Vec::new();
        let mut out = BufReader::new(child.stdout.take().unwrap());
        loop {
            line.clear();
            out.read_line(&mut line).unwrap();
            if line.is_empty() || line.starts_with("serving") {
                break;
            }
            before.push(line.trim().to_string());
        }
        let addr = line
            .trim()
            .rsplit(' ')
            .next()
            .unwrap_or_default()
            .to_string();
        assert!(addr.contains(':'), "serve printed {line:?}");
        Serve {
            child,
            addr,
            before,
        }
    }

    /// A node on a port that is free now, so it can be restarted there.
    fn start_on_free_port(space: &Path, ip: &str, token_file: &Path) -> Serve {
        let port = TcpListener::bind(format!("{ip}:0"))
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        Serve::start(space, &format!("{ip}:{port}"), token_file, &[])
    }

    fn signal(&self, sig: &str) {
        Command::new("kill")
            .args([sig, &self.child.id().to_string()])
            .status()
            .unwrap();
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A generated dataset preloaded onto `nodes` spaces with `replicas` copies.
struct Setup {
    _tmp: tempfile::TempDir,
    src: PathBuf,
    spaces: Vec<PathBuf>,
    token: PathBuf,
    catalog: PathBuf,
}

fn setup(profile: &str, count: u64, nodes: u32, replicas: u32) -> Setup {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    gen(profile, count, &src);
    let catalog = tmp.path().join("cat.ksc");
    ok(&["catalog", "--source", s(&src), "--out", s(&catalog)]);
    let mut spaces = Vec::new();
    for i in 0..nodes {
        let sp = tmp.path().join(format!("node{i}"));
        ok(&[
            "preload",
            "--source",
            s(&src),
            "--catalog",
            s(&catalog),
            "--space",
            s(&sp),
            "--nodes",
            &nodes.to_string(),
            "--node-index",
            &i.to_string(),
            "--replicas",
            &replicas.to_string(),
        ]);
        spaces.push(sp);
    }
    let token = tmp.path().join("token");
    std::fs::write(&token, format!("{TOKEN}\n")).unwrap();
    Setup {
        _tmp: tmp,
        src,
        spaces,
        token,
        catalog,
    }
}

fn cluster_of(addrs: &[&str]) -> Cluster {
    let text: String = addrs
        .iter()
        .enumerate()
        .map(|(i, a)| format!("{i} {a}\n"))
        .collect();
    Cluster::parse(&text, "test").unwrap()
}

/// Reads `epochs`, checking every sample's id (against an independent
/// sampler), bytes (CRC32C against the catalog) and that the padding between
/// samples in each batch's span is untouched (zero: nobody wrote outside a
/// granted range).
fn check(loader: &mut Loader, cat: &Catalog, rank: u32, world: u32, epochs: u64) -> u64 {
    // Padding is checked on the ring's first lap only: later laps reuse
    // memory where earlier samples' bytes legitimately remain.
    let ring_bytes = loader.landing_info().bytes as usize;
    let mut lap_bytes = 0usize;
    let sampler = Sampler::new(
        SamplerConfig::single(cat.len(), 3)
            .rank_world(rank, world)
            .shuffle(true)
            .drop_last(false),
    )
    .unwrap();
    let mut n = 0;
    for e in 0..epochs {
        loader.set_epoch(e).unwrap();
        let mut k = 0;
        while let Some(b) = loader.next_batch().unwrap() {
            let (span, wrap) = b.spans();
            let base = span.as_ptr() as usize;
            lap_bytes += span.len() + wrap.map_or(0, |w| w.len());
            let first_lap = wrap.is_none() && lap_bytes <= ring_bytes;
            let mut prev_end: Option<usize> = None;
            for smp in b.iter() {
                assert_eq!(
                    smp.id,
                    sampler.sample(e, k),
                    "rank {rank} epoch {e} step {k}"
                );
                let c = cat.sample(smp.id);
                assert_eq!(smp.bytes.len(), c.len as usize);
                assert_eq!(
                    crc32c::crc32c(smp.bytes),
                    c.crc32c,
                    "sample {} bytes",
                    smp.id
                );
                let start = smp.bytes.as_ptr() as usize;
                if let Some(end) = prev_end {
                    // Padding between two samples of the first span.
                    if first_lap && start >= end {
                        let pad = &span[end - base..start - base];
                        assert!(
                            pad.iter().all(|&x| x == 0),
                            "bytes written outside a grant before sample {}",
                            smp.id
                        );
                    }
                }
                prev_end = Some(start + smp.bytes.len());
                k += 1;
                n += 1;
            }
        }
        assert_eq!(k, sampler.per_rank(), "rank {rank} epoch {e}");
    }
    n
}

/// A consumer with nothing local: the catalog and (as the last resort) the
/// source, everything else from the nodes at `addrs`.
fn builder_remote(st: &Setup, addrs: &[&str], ring_bytes: u64) -> LoaderBuilder {
    LoaderBuilder::source(s(&st.src))
        .catalog(&st.catalog)
        .cluster(cluster_of(addrs))
        .token(TOKEN.as_bytes())
        .seed(3)
        .batch_size(16)
        .pollers(1)
        .pin(false)
        .landing(test_ring(ring_bytes))
        .rdma(transport())
}

fn builder_space(space: &Path, cluster: Cluster) -> LoaderBuilder {
    LoaderBuilder::space(space)
        .cluster(cluster)
        .token(TOKEN.as_bytes())
        .seed(3)
        .batch_size(16)
        .pollers(1)
        .pin(false)
        .landing(test_ring(8 << 20))
        .rdma(transport())
}

#[test]
fn consumer_dropped_mid_epoch_stops_cleanly() {
    let st = setup("tiny", 300, 2, 1);
    let serves: Vec<Serve> = (0..2)
        .map(|i| Serve::start(&st.spaces[i], &node_ip(i), &st.token, &[]))
        .collect();
    let addrs: Vec<&str> = serves.iter().map(|s| s.addr.as_str()).collect();
    for _ in 0..3 {
        let mut l = builder_space(&st.spaces[0], cluster_of(&addrs))
            .landing(test_ring(1 << 20))
            .build()
            .unwrap();
        let b = l.next_batch().unwrap().unwrap();
        assert_eq!(b.len(), 16);
        drop(b);
        let t0 = Instant::now();
        drop(l);
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "drop took {:?}",
            t0.elapsed()
        );
    }
}

#[test]
fn three_nodes_two_ranks_byte_exact_in_order() {
    let st = setup("imagenet", 300, 3, 2);
    // Small DATA frames, so most samples arrive in several.
    let serves: Vec<Serve> = (0..3)
        .map(|i| {
            Serve::start(
                &st.spaces[i],
                &node_ip(i),
                &st.token,
                // Node 2 sends straight from the page cache.
                if i == 2 {
                    &["--chunk-bytes", "64KiB", "--page-cache"][..]
                } else {
                    &["--chunk-bytes", "64KiB", "--staging-bytes", "1MiB"][..]
                },
            )
        })
        .collect();
    let addrs: Vec<&str> = serves.iter().map(|s| s.addr.as_str()).collect();
    let cluster = cluster_of(&addrs);
    let cat = Catalog::open(&st.catalog).unwrap();
    std::thread::scope(|sc| {
        for rank in 0..2u32 {
            let (cluster, st, cat) = (cluster.clone(), &st, &cat);
            sc.spawn(move || {
                // Rank r runs on node r: what node r holds is read locally.
                let mut l = builder_space(&st.spaces[rank as usize], cluster)
                    .rank(rank, 2)
                    .verify_crc32c(true)
                    .build()
                    .unwrap();
                let n = check(&mut l, cat, rank, 2, 3);
                let stats = l.finish();
                assert_eq!(n, 450);
                assert!(
                    stats.remote_samples > 0 && stats.disk_reads > 0,
                    "{stats:?}"
                );
                assert_eq!(stats.failovers, 0);
            });
        }
    });
}

/// A memory tier in cluster mode keeps what the owners pushed as well as
/// what the local disk gave: a rank reading the whole dataset (world 1) on
/// node 0 of 2 gets epoch 0 half from its disk and half pushed by node 1,
/// and epochs 1 and 2 from the tier (no grant, no read) but for samples
/// asked for again before their first copy landed, every sample byte-exact
/// and in order.
#[test]
fn a_tier_keeps_pushed_samples_for_later_epochs() {
    let st = setup("tiny", 300, 2, 1);
    let serves: Vec<Serve> = (0..2)
        .map(|i| Serve::start(&st.spaces[i], &node_ip(i), &st.token, &[]))
        .collect();
    let addrs: Vec<&str> = serves.iter().map(|s| s.addr.as_str()).collect();
    let cat = Catalog::open(&st.catalog).unwrap();
    // A ring of 256 KiB holds about 56 samples ahead: what epoch 1 needs
    // is asked for after epoch 0 pushed it.
    let mut l = builder_space(&st.spaces[0], cluster_of(&addrs))
        .landing(test_ring(256 << 10))
        .tier_bytes(8 << 20)
        .build()
        .unwrap();
    assert_eq!(check(&mut l, &cat, 0, 1, 3), 900);
    let stats = l.finish();
    // Epoch 0 reads each sample once; only a sample asked for again
    // within the ring's lookahead (about 56 samples) of its first copy,
    // before that copy landed, is read twice. Without the pushes in the
    // tier, epochs 1 and 2 would ask node 1 again: about 450 pushes.
    let lookahead = 56;
    assert!(
        stats.disk_reads + stats.remote_samples <= 300 + lookahead,
        "{stats:?}"
    );
    assert!(stats.remote_samples > 50, "{stats:?}");
    assert!(stats.tier_hits >= 600 - lookahead, "{stats:?}");
    assert_eq!(stats.failovers, 0, "{stats:?}");
}

/// Reads with node 1 SIGSTOPped after the first batch and then handled by
/// `then` (SIGKILL, or nothing: a stall), from node 0's space.
fn owner_trouble(
    replicas: u32,
    kill: bool,
    hide_source: bool,
    timeout: Duration,
) -> (Setup, Result<kspeed::loader::Stats, Error>, Duration) {
    let st = setup("imagenet", 240, 3, replicas);
    let serves: Vec<Serve> = (0..3)
        .map(|i| Serve::start(&st.spaces[i], &node_ip(i), &st.token, &[]))
        .collect();
    let addrs: Vec<&str> = serves.iter().map(|s| s.addr.as_str()).collect();
    let cat = Catalog::open(&st.catalog).unwrap();
    if hide_source {
        std::fs::rename(&st.src, st.src.with_extension("gone")).unwrap();
    }
    let mut l = builder_space(&st.spaces[0], cluster_of(&addrs))
        .node_timeout(timeout)
        .landing(test_ring(8 << 20))
        .build()
        .unwrap();
    let sampler = Sampler::new(
        SamplerConfig::single(cat.len(), 3)
            .rank_world(0, 1)
            .shuffle(true)
            .drop_last(false),
    )
    .unwrap();
    let t0 = Instant::now();
    let mut k = 0;
    let mut troubled = false;
    let res = (|| -> Result<(), Error> {
        for e in 0..2 {
            l.set_epoch(e)?;
            while let Some(b) = l.next_batch()? {
                for smp in b.iter() {
                    assert_eq!(smp.id, sampler.sample(e, k % 240));
                    assert_eq!(crc32c::crc32c(smp.bytes), cat.sample(smp.id).crc32c);
                    k += 1;
                }
                drop(b);
                if !troubled {
                    troubled = true;
                    serves[1].signal("-STOP");
                    if kill {
                        let pid = serves[1].child.id();
                        std::thread::spawn(move || {
                            std::thread::sleep(Duration::from_millis(300));
                            let _ = Command::new("kill")
                                .args(["-KILL", &pid.to_string()])
                                .status();
                        });
                    }
                }
            }
        }
        Ok(())
    })();
    let took = t0.elapsed();
    serves[1].signal("-CONT");
    let out = res.map(|()| {
        assert_eq!(k, 480, "every sample of both epochs");
        l.stats()
    });
    (st, out, took)
}

#[test]
fn owner_killed_mid_epoch_with_a_replica() {
    let (_st, r, _) = owner_trouble(2, true, false, Duration::from_secs(30));
    let stats = r.unwrap();
    assert!(stats.failovers > 0, "{stats:?}");
    assert_eq!(stats.source_reads, 0);
}

/// A dead node's samples fail over to their other copies in an order drawn
/// from each id (`Placement::try_copy`): at 3 copies each survivor serves
/// about half of them. (In copy order the next node served them all and
/// the third copy none: the busiest survivor pushed twice its load.)
#[test]
fn a_dead_owners_samples_spread_over_its_surviving_copies() {
    let st = setup("tiny", 1200, 4, 3);
    let serves: Vec<Serve> = (0..4)
        .map(|i| {
            let metrics = format!("{}:0", node_ip(i));
            Serve::start(
                &st.spaces[i],
                &node_ip(i),
                &st.token,
                &["--metrics", &metrics],
            )
        })
        .collect();
    let maddr: Vec<String> = serves
        .iter()
        .map(|n| {
            n.before
                .iter()
                .find_map(|l| l.strip_prefix("metrics on http://"))
                .and_then(|l| l.strip_suffix("/metrics"))
                .unwrap_or_else(|| panic!("no metrics line: {:?}", n.before))
                .to_string()
        })
        .collect();
    let addrs: Vec<&str> = serves.iter().map(|s| s.addr.as_str()).collect();
    let cat = Catalog::open(&st.catalog).unwrap();
    // Node 1 is killed before the consumer (on node 0, which holds every
    // sample but node 1's own) starts: all its samples fail over.
    let pid = serves[1].child.id();
    Command::new("kill")
        .args(["-KILL", &pid.to_string()])
        .status()
        .unwrap();
    let mut l = builder_space(&st.spaces[0], cluster_of(&addrs))
        .node_timeout(Duration::from_secs(5))
        .end_epoch(Some(1))
        .build()
        .unwrap();
    assert_eq!(check(&mut l, &cat, 0, 1, 1), 1200);
    let stats = l.stats();
    drop(l);
    let placement = kspeed::dataset::Placement::new(4, 3).unwrap();
    let node1: u64 = (0..1200).filter(|&i| placement.owner(i) == 1).count() as u64;
    assert_eq!(stats.remote_samples, node1, "{stats:?}");
    // What nodes 2 and 3 pushed (a node counts a push when it reaps its
    // completion, which can come after the consumer has the bytes: wait
    // for the sum, with a deadline).
    let pushed = |i: usize| {
        let (_, text) = http_get(&maddr[i], "/metrics");
        metric(&text, "kspeed_serve_samples_total ").unwrap_or(0.0) as u64
    };
    let t0 = Instant::now();
    let (two, three) = loop {
        let (two, three) = (pushed(2), pushed(3));
        if two + three >= node1 || t0.elapsed() > Duration::from_secs(20) {
            break (two, three);
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    // (More only if a grant failed over after its node had pushed it: a
    // heartbeat lost under load.)
    assert!(two + three >= node1, "nodes 2 and 3 pushed {two} + {three}");
    eprintln!("node 1's {node1} samples: node 2 served {two}, node 3 {three}");
    let all = two + three;
    for (n, got) in [(2, two), (3, three)] {
        assert!(
            got * 10 >= all * 3 && got * 10 <= all * 7,
            "node {n} served {got} of node 1's {node1} samples (2: {two}, 3: {three}): \
             the failover is not spread over the copies"
        );
    }
}

#[test]
fn owner_killed_without_replica_reads_the_source() {
    let (_st, r, _) = owner_trouble(1, true, false, Duration::from_secs(30));
    let stats = r.unwrap();
    assert!(stats.failovers > 0 && stats.source_reads > 0, "{stats:?}");
}

#[test]
fn owner_killed_without_replica_or_source_is_a_named_error() {
    let (_st, r, took) = owner_trouble(1, true, true, Duration::from_secs(30));
    match r {
        Err(Error::SampleUnavailable { tried, .. }) => {
            assert!(tried.contains("node 1"), "{tried}");
            assert!(tried.contains("source"), "{tried}");
        }
        other => panic!("expected SampleUnavailable, got {other:?}"),
    }
    assert!(took < Duration::from_secs(20), "took {took:?}");
}

/// The stall is charged to its cause: node 1, stopped, made the consumer
/// wait at least most of its timeout for a sample that then failed over,
/// so `failover` holds that wait, node 1 leads the slowest nodes, and the
/// causes add up to the whole stall.
#[test]
fn stalled_owner_times_out_and_fails_over() {
    let timeout = Duration::from_millis(800);
    let (_st, r, took) = owner_trouble(2, false, false, timeout);
    let stats = r.unwrap();
    assert!(stats.failovers > 0, "{stats:?}");
    assert!(took < Duration::from_secs(20), "took {took:?}");
    let c = stats.stall_causes;
    assert_eq!(
        c.disk + c.tier + c.source + c.peers + c.failover + c.agent,
        stats.stall,
        "{c:?}"
    );
    // The node is declared stalled after `timeout` without progress,
    // counted from its last progress, which can precede the wait: the
    // wait for it is charged to it first (`peers`), then, once it is
    // declared stalled, to the failover (under load in the RDMA VM: 97 ms
    // then 397 ms of an 800 ms timeout).
    assert!(c.failover > Duration::ZERO, "{c:?}");
    assert!(c.failover + c.peers >= timeout / 2, "{c:?}");
    assert_eq!(c.slowest_peers[0].node, 1, "{c:?}");
    assert_eq!(c.agent, Duration::ZERO);
}

// --- hostile consumers against a real node -------------------------------

fn hello_frame(cat: &Catalog, version: u32, token: &[u8], ring_len: u64) -> Vec<u8> {
    let mut out = fake_peers::hello_for(cat, token, ring_len);
    out[8..12].copy_from_slice(&version.to_le_bytes());
    out
}

/// Reads frames until an ERROR arrives; returns its code and message.
fn read_error(sock: &mut TcpStream) -> (Code, String) {
    sock.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    loop {
        let mut hb = [0u8; proto::HEADER_BYTES];
        sock.read_exact(&mut hb)
            .expect("an ERROR frame before the close");
        let h = Header::decode(&hb, proto::MAX_DATA_BYTES).unwrap();
        let mut body = vec![0u8; h.body_len as usize];
        sock.read_exact(&mut body).unwrap();
        if h.kind == Kind::Error {
            return (
                Code::from_u32(h.b),
                String::from_utf8_lossy(&body).into_owned(),
            );
        }
    }
}

#[test]
fn hostile_consumers_are_refused_and_others_unaffected() {
    let st = setup("tiny", 300, 1, 1);
    let node = Serve::start(
        &st.spaces[0],
        "127.0.0.1",
        &st.token,
        &["--max-grants", "64"],
    );
    let cat = Catalog::open(&st.catalog).unwrap();
    let connect = || TcpStream::connect(&node.addr).unwrap();

    // Wrong token, through the Loader: a named error at build.
    let e = LoaderBuilder::source(s(&st.src))
        .catalog(&st.catalog)
        .cluster(cluster_of(&[&node.addr]))
        .token(b"wrong")
        .landing(test_ring(1 << 20))
        .build()
        .err()
        .expect("refused");
    assert!(
        matches!(&e, Error::Refused { code, .. } if *code == "bad token"),
        "{e}"
    );

    // Wrong protocol version, and version 1 (24-byte GRANT entries
    // without a key): refused by name, saying which version is spoken.
    for version in [99, 1] {
        let mut c = connect();
        c.write_all(&hello_frame(&cat, version, TOKEN.as_bytes(), 1 << 20))
            .unwrap();
        let (code, msg) = read_error(&mut c);
        assert_eq!(code, Code::BadVersion, "{msg}");
        assert!(
            msg.contains(&format!(
                "protocol version {version} is not spoken here (this node speaks 2)"
            )),
            "{msg}"
        );
    }

    // Garbage instead of a HELLO.
    let mut c = connect();
    c.write_all(&[0xffu8; 64]).unwrap();
    assert_eq!(read_error(&mut c).0, Code::Violation);

    let welcome = |c: &mut TcpStream| {
        let mut w = [0u8; proto::HEADER_BYTES + proto::WELCOME_BYTES];
        c.read_exact(&mut w).unwrap();
        let mut hb = [0u8; proto::HEADER_BYTES];
        hb.copy_from_slice(&w[..proto::HEADER_BYTES]);
        let h = Header::decode(&hb, 0).unwrap();
        Welcome::decode(&h, &w[proto::HEADER_BYTES..]).unwrap()
    };
    let grant = |c: &mut TcpStream, entries: &[GrantEntry]| {
        let mut f = Header::grant(entries.len() as u32).encode().to_vec();
        for e in entries {
            let mut b = [0u8; proto::GRANT_ENTRY_BYTES];
            e.encode_into(&mut b);
            f.extend_from_slice(&b);
        }
        c.write_all(&f).unwrap();
    };
    let s0 = cat.sample(0);

    // A consumer past its HELLO, with a 1 MiB ring.
    let joined = || {
        let mut c = connect();
        c.write_all(&hello_frame(
            &cat,
            proto::VERSION,
            TOKEN.as_bytes(),
            1 << 20,
        ))
        .unwrap();
        let w = welcome(&mut c);
        (c, w)
    };

    // A grant outside the ring it declared.
    let (mut c, w) = joined();
    assert_eq!(w.max_grants, 64);
    grant(
        &mut c,
        &[GrantEntry {
            grant: 1,
            len: s0.len,
            sample: 0,
            offset: (1 << 20) - 1,
            rkey: 0,
        }],
    );
    let (code, msg) = read_error(&mut c);
    assert_eq!(code, Code::Violation);
    assert!(msg.contains("outside"), "{msg}");

    // A grant under the id an ERROR uses for the whole connection: an
    // answer to it could not be told from the end of the connection.
    let (mut c, _) = joined();
    grant(
        &mut c,
        &[GrantEntry {
            grant: proto::CONNECTION,
            len: s0.len,
            sample: 0,
            offset: 0,
            rkey: 0,
        }],
    );
    let (code, msg) = read_error(&mut c);
    assert_eq!(code, Code::Violation);
    assert!(msg.contains("reserved for the connection"), "{msg}");

    // A grant with the wrong length, one for a sample past the catalog,
    // and more grants than the WELCOME allowed.
    for entries in [
        vec![GrantEntry {
            grant: 1,
            len: s0.len + 1,
            sample: 0,
            offset: 0,
            rkey: 0,
        }],
        vec![GrantEntry {
            grant: 1,
            len: 1,
            sample: 1 << 40,
            offset: 0,
            rkey: 0,
        }],
        (0..65)
            .map(|i| GrantEntry {
                grant: i,
                len: s0.len,
                sample: 0,
                offset: 0,
                rkey: 0,
            })
            .collect(),
    ] {
        let (mut c, _) = joined();
        grant(&mut c, &entries);
        let (code, _) = read_error(&mut c);
        assert!(
            matches!(code, Code::Violation | Code::TooManyGrants),
            "{code:?}"
        );
    }

    // ERROR frames a consumer does not send (docs/PROTOCOL.md,
    // "Connection": only keepalives, code 0 for the connection with no
    // body): another code, a grant id, a body; and a DATA frame, named by
    // its type.
    let error = |a: u32, b: u32, body: &[u8]| {
        let mut f = Header {
            kind: proto::Kind::Error,
            body_len: body.len() as u32,
            a,
            b,
            c: 0,
        }
        .encode()
        .to_vec();
        f.extend_from_slice(body);
        f
    };
    for (frame, says) in [
        (
            error(proto::CONNECTION, Code::Violation as u32, b""),
            "unexpected ERROR frame from a consumer (code 6, grant id 0xffffffff, 0 body bytes)",
        ),
        (
            error(proto::CONNECTION, Code::NodeDown as u32, b""),
            "unexpected ERROR frame from a consumer (code 13,",
        ),
        (
            error(7, 0, b""),
            "unexpected ERROR frame from a consumer (code 0, grant id 0x7,",
        ),
        (
            error(proto::CONNECTION, 0, b"bye"),
            "unexpected ERROR frame from a consumer (code 0, grant id 0xffffffff, 3 body bytes)",
        ),
        (
            {
                let mut f = Header::data(1, 0, 4).encode().to_vec();
                f.extend_from_slice(b"abcd");
                f
            },
            "unexpected Data frame",
        ),
    ] {
        let (mut c, _) = joined();
        c.write_all(&frame).unwrap();
        let (code, msg) = read_error(&mut c);
        assert_eq!(code, Code::Violation, "{msg}");
        assert!(msg.contains(says), "{msg}");
    }
    // A keepalive is taken, and the grant after it served.
    let (mut c, _) = joined();
    c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    c.write_all(&error(proto::CONNECTION, 0, b"")).unwrap();
    grant(
        &mut c,
        &[GrantEntry {
            grant: 1,
            len: s0.len,
            sample: 0,
            offset: 0,
            rkey: 0,
        }],
    );
    // No heartbeats were asked for: the first frame is the grant's DATA.
    let mut hb = [0u8; proto::HEADER_BYTES];
    c.read_exact(&mut hb).unwrap();
    let h = Header::decode(&hb, 1 << 20).unwrap();
    assert!(h.kind == proto::Kind::Data && h.a == 1, "{h:?}");

    // A peer that stalls in its HELLO does not block others; a well-behaved
    // consumer reads everything meanwhile.
    let mut stalled = connect();
    stalled
        .write_all(&hello_frame(&cat, proto::VERSION, TOKEN.as_bytes(), 1 << 20)[..10])
        .unwrap();
    let mut l = builder_remote(&st, &[&node.addr], 1 << 20).build().unwrap();
    assert_eq!(check(&mut l, &cat, 0, 1, 2), 600);
    assert_eq!(l.stats().source_reads, 0);
    drop(stalled);
}

/// A grant id is the consumer's to use again once the grant it named is
/// finished, after an ERROR too (docs/PROTOCOL.md: unique among the
/// outstanding grants): a grant answered `NotHeld`, then a grant of the
/// same id for a sample the node holds, is served whole. The node used to
/// remember the failed grant by its id and drop every later frame of that
/// id on the connection, unsent.
#[test]
fn a_grant_id_used_again_after_its_error_is_served() {
    let st = setup("tiny", 200, 2, 1);
    let node = Serve::start(&st.spaces[0], "127.0.0.1", &st.token, &[]);
    let cat = Catalog::open(&st.catalog).unwrap();
    let space = Space::open(&st.spaces[0]).unwrap();
    let held = (0..cat.len())
        .find(|&i| space.location(i).is_some() && cat.sample(i).len > 0)
        .unwrap();
    let unheld = (0..cat.len())
        .find(|&i| space.location(i).is_none())
        .unwrap();
    let mut c = TcpStream::connect(&node.addr).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    c.write_all(&hello_frame(
        &cat,
        proto::VERSION,
        TOKEN.as_bytes(),
        1 << 20,
    ))
    .unwrap();
    let mut w = [0u8; proto::HEADER_BYTES + proto::WELCOME_BYTES];
    c.read_exact(&mut w).unwrap();
    let grant = |c: &mut TcpStream, sample: u64| {
        let e = GrantEntry {
            grant: 5,
            len: cat.sample(sample).len,
            sample,
            offset: 0,
            rkey: 0,
        };
        let mut f = Header::grant(1).encode().to_vec();
        let mut b = [0u8; proto::GRANT_ENTRY_BYTES];
        e.encode_into(&mut b);
        f.extend_from_slice(&b);
        c.write_all(&f).unwrap();
    };
    let frame = |c: &mut TcpStream| {
        let mut hb = [0u8; proto::HEADER_BYTES];
        c.read_exact(&mut hb).expect("a frame within 10 s");
        let h = Header::decode(&hb, proto::MAX_DATA_BYTES).unwrap();
        let mut body = vec![0u8; h.body_len as usize];
        c.read_exact(&mut body).unwrap();
        (h, body)
    };
    grant(&mut c, unheld);
    let (h, _) = frame(&mut c);
    assert_eq!(
        (h.kind, h.a, Code::from_u32(h.b)),
        (Kind::Error, 5, Code::NotHeld)
    );
    grant(&mut c, held);
    let want = cat.sample(held).len as usize;
    let mut got = Vec::new();
    while got.len() < want {
        let (h, body) = frame(&mut c);
        assert_eq!((h.kind, h.a), (Kind::Data, 5), "{h:?}");
        got.extend_from_slice(&body);
    }
    assert_eq!(crc32c::crc32c(&got), cat.sample(held).crc32c);
}

/// A TCP connection to `to` from the loopback address `from`: flooding
/// clients come from addresses of their own, so the node's per-address
/// limits never touch the real consumer (which connects from 127.0.0.1).
fn connect_from(from: [u8; 4], to: &str) -> std::io::Result<TcpStream> {
    use std::os::fd::FromRawFd;
    let to: std::net::SocketAddrV4 = to.parse().expect("an IPv4 address");
    let sa = |ip: [u8; 4], port: u16| libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: port.to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from_be_bytes(ip).to_be(),
        },
        sin_zero: [0; 8],
    };
    let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    // SAFETY: a fresh socket owned by the TcpStream from here on (closed on
    // every return); bind and connect read one live sockaddr_in each.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let sock = TcpStream::from_raw_fd(fd);
        let src = sa(from, 0);
        if libc::bind(fd, (&src as *const libc::sockaddr_in).cast(), len) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        let dst = sa(to.ip().octets(), to.port());
        if libc::connect(fd, (&dst as *const libc::sockaddr_in).cast(), len) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(sock)
    }
}

/// Threads and open descriptors of process `pid` (from /proc). The
/// kernel's io_uring workers (`iou-wrk-*`, which a file system without
/// non-blocking O_DIRECT reads may start, a bounded pool per ring) are not
/// the service's threads and are left out.
fn proc_counts(pid: u32) -> (usize, usize) {
    let threads = std::fs::read_dir(format!("/proc/{pid}/task"))
        .map(|d| {
            d.flatten()
                .filter(|t| {
                    let comm = std::fs::read_to_string(t.path().join("comm")).unwrap_or_default();
                    !comm.starts_with("iou-")
                })
                .count()
        })
        .unwrap_or(0);
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0);
    (threads, fds)
}

/// Log lines of a node that contain `what`.
fn log_lines(log: &Path, what: &str) -> usize {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains(what))
        .count()
}

#[test]
fn hostile_flood_leaves_the_node_bounded_and_a_real_consumer_served() {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    let st = setup("tiny", 300, 1, 1);
    let log = st._tmp.path().join("node.log");
    let node = Serve::launch(
        &st.spaces[0],
        "127.0.0.1",
        &st.token,
        &["--max-handshakes", "16", "--handshake-timeout-ms", "1000"],
        Some(&log),
        None,
    );
    let pid = node.child.id();
    let cat = Catalog::open(&st.catalog).unwrap();
    let hello = hello_frame(&cat, proto::VERSION, TOKEN.as_bytes(), 1 << 20);
    let bad_hello = hello_frame(&cat, proto::VERSION, b"not-the-token", 1 << 20);
    let (base_threads, base_fds) = proc_counts(pid);

    let stop = AtomicBool::new(false);
    let flood_start = Instant::now();
    let slow_opened = AtomicUsize::new(0);
    let slow_closed = AtomicUsize::new(0);
    let bad_tries = AtomicUsize::new(0);
    let (mut max_threads, mut max_fds) = (0, 0);
    std::thread::scope(|sc| {
        // Slow clients: each keeps up to 48 connections that send one byte
        // of a HELLO every 50 ms (and never finish in time).
        for k in 0..2u8 {
            let (stop, opened, closed, hello, addr) =
                (&stop, &slow_opened, &slow_closed, &hello, &node.addr);
            sc.spawn(move || {
                let mut open: Vec<(TcpStream, usize)> = Vec::new();
                while !stop.load(Ordering::Relaxed) {
                    for _ in 0..8 {
                        if open.len() < 48 {
                            if let Ok(c) = connect_from([127, 0, 0, 9 + k], addr) {
                                opened.fetch_add(1, Ordering::Relaxed);
                                open.push((c, 0));
                            }
                        }
                    }
                    open.retain_mut(|(c, sent)| {
                        let ok =
                            *sent < hello.len() && c.write_all(&hello[*sent..*sent + 1]).is_ok();
                        *sent += 1;
                        if !ok {
                            closed.fetch_add(1, Ordering::Relaxed);
                        }
                        ok
                    });
                    std::thread::sleep(Duration::from_millis(50));
                }
            });
        }
        // A client that presents a wrong token over and over.
        {
            let (stop, tries, bad_hello, addr) = (&stop, &bad_tries, &bad_hello, &node.addr);
            sc.spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    if let Ok(mut c) = connect_from([127, 0, 0, 11], addr) {
                        tries.fetch_add(1, Ordering::Relaxed);
                        let _ = c.write_all(bad_hello);
                        c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
                        let mut sink = Vec::new();
                        let _ = c.read_to_end(&mut sink);
                    }
                    std::thread::sleep(Duration::from_millis(5));
                }
            });
        }
        // The flood is on once more slow clients came than handshakes may
        // be pending.
        let t0 = Instant::now();
        while slow_opened.load(Ordering::Relaxed) < 64 {
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "flood did not start"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        // Watch the node's threads and descriptors while a real consumer
        // connects and reads two epochs through the flood.
        let watcher = {
            let stop = &stop;
            sc.spawn(move || {
                let mut m = (0, 0);
                while !stop.load(Ordering::Relaxed) {
                    let (t, f) = proc_counts(pid);
                    m = (m.0.max(t), m.1.max(f));
                    std::thread::sleep(Duration::from_millis(5));
                }
                m
            })
        };
        let res = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let mut l = builder_remote(&st, &[&node.addr], 1 << 20).build().unwrap();
            assert_eq!(check(&mut l, &cat, 0, 1, 2), 600);
            let stats = l.stats();
            assert_eq!(stats.source_reads, 0, "{stats:?}");
            assert_eq!(stats.failovers, 0, "{stats:?}");
            // Let the flood go on past a couple of handshake deadlines.
            let t0 = Instant::now();
            while slow_closed.load(Ordering::Relaxed) < 64 || bad_tries.load(Ordering::Relaxed) < 40
            {
                assert!(t0.elapsed() < Duration::from_secs(60), "the flood stalled");
                std::thread::sleep(Duration::from_millis(10));
            }
        }));
        stop.store(true, Ordering::Relaxed);
        (max_threads, max_fds) = watcher.join().unwrap();
        if let Err(p) = res {
            std::panic::resume_unwind(p);
        }
    });
    let opened = slow_opened.load(Ordering::Relaxed);
    let tries = bad_tries.load(Ordering::Relaxed);
    eprintln!(
        "node before: {base_threads} threads, {base_fds} fds; during the flood at most {max_threads} threads, {max_fds} fds; {opened} slow clients, {tries} wrong tokens"
    );
    // One thread per connection made thousands; the handshakes run on the
    // acceptor (16 pending at most, 16 refused ones being closed at most,
    // one consumer).
    assert!(max_threads <= base_threads + 4, "{max_threads} threads");
    assert!(max_fds <= base_fds + 2 * 16 + 4, "{max_fds} descriptors");

    // One deadline for the whole handshake: a peer sending its HELLO one
    // byte every 100 ms (9 s in all) is closed after about a second, before
    // it is done.
    let mut c = connect_from([127, 0, 0, 12], &node.addr).unwrap();
    c.set_read_timeout(Some(Duration::from_millis(100)))
        .unwrap();
    let t0 = Instant::now();
    let mut sent = 0;
    let mut closed = false;
    while sent < hello.len() {
        if c.write_all(&hello[sent..sent + 1]).is_err() {
            closed = true;
            break;
        }
        sent += 1;
        let mut b = [0u8; 256];
        match c.read(&mut b) {
            Ok(0) => {
                closed = true;
                break;
            }
            Ok(_) => {} // the ERROR frame saying why
            Err(e)
                if e.kind() == std::io::ErrorKind::WouldBlock
                    || e.kind() == std::io::ErrorKind::TimedOut => {}
            Err(_) => {
                closed = true;
                break;
            }
        }
    }
    assert!(
        closed,
        "a {}-byte HELLO sent over {:?} was let through",
        hello.len(),
        t0.elapsed()
    );
    assert!(
        t0.elapsed() < Duration::from_secs(6),
        "closed after {:?}",
        t0.elapsed()
    );

    // Wrong tokens are logged once per address and window, then summarized.
    // (At most a first line and a summary per 10 s window.)
    let lines = log_lines(&log, "refused 127.0.0.11");
    let windows = flood_start.elapsed().as_secs() as usize / 10 + 1;
    assert!(
        tries >= 40 && lines <= 2 * windows,
        "{lines} log lines for {tries} wrong tokens"
    );
    assert!(
        log_lines(&log, "127.0.0.1:") >= 1,
        "the consumer's connect is logged"
    );
}

#[test]
fn hostile_flood_out_of_descriptors_backs_off_and_logs_once() {
    let st = setup("tiny", 300, 1, 1);
    let log = st._tmp.path().join("node.log");
    // More handshakes allowed than descriptors: accept runs out first.
    let node = Serve::launch(
        &st.spaces[0],
        "127.0.0.1",
        &st.token,
        &["--max-handshakes", "256", "--handshake-timeout-ms", "3000"],
        Some(&log),
        Some(40),
    );
    let cat = Catalog::open(&st.catalog).unwrap();
    let mut silent = Vec::new();
    for _ in 0..80 {
        silent.push(connect_from([127, 0, 0, 13], &node.addr).unwrap());
    }
    // Until the node has hit the limit and backed off a while.
    let t0 = Instant::now();
    while log_lines(&log, "accept:") == 0 {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "never ran out of descriptors"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    std::thread::sleep(Duration::from_millis(1500)); // lets it spin, if it would
    let mut l = builder_remote(&st, &[&node.addr], 1 << 20).build().unwrap();
    assert_eq!(check(&mut l, &cat, 0, 1, 1), 300);
    assert_eq!(l.stats().source_reads, 0);
    drop(silent);
    // One line, then at most a summary per 10 s window (the old code
    // logged about a hundred a second).
    let n = log_lines(&log, "] accept:") + log_lines(&log, "] accept failed");
    let windows = t0.elapsed().as_secs() as usize / 10 + 1;
    assert!(
        n <= 1 + windows,
        "{n} accept lines:\n{}",
        std::fs::read_to_string(&log).unwrap()
    );
}

/// A sample whose dozens of chunks all fail is answered with one ERROR
/// ReadFailed, not one per chunk (the node with its extent cut in half as
/// `cut_extent_frames` says).
#[test]
fn one_error_frame_per_grant_when_several_chunks_fail() {
    let (errors, _, _) = cut_extent_frames(&[]);
    assert_eq!(
        errors.len(),
        1,
        "ERROR frames for one failed grant: {errors:?}"
    );
    assert_eq!(errors[0].0, Code::ReadFailed, "{errors:?}");
}

#[test]
fn corrupt_sample_from_a_node_fails_over_to_the_replica() {
    let st = setup("tiny", 300, 2, 2);
    // Node 1's extent has a stretch of flipped bytes (after preload, so
    // nothing but the consumer's CRC32C check can notice).
    let ext = Space::open(&st.spaces[1]).unwrap().extent_path(0);
    let mut bytes = std::fs::read(&ext).unwrap();
    let n = bytes.len();
    for b in &mut bytes[n / 3..n / 3 + 8192] {
        *b ^= 0x5a;
    }
    std::fs::write(&ext, &bytes).unwrap();
    let n0 = Serve::start(&st.spaces[0], &node_ip(0), &st.token, &[]);
    let n1 = Serve::start(&st.spaces[1], &node_ip(1), &st.token, &[]);
    let cat = Catalog::open(&st.catalog).unwrap();
    let mut l = builder_remote(&st, &[&n0.addr, &n1.addr], 1 << 20)
        .verify_crc32c(true)
        .build()
        .unwrap();
    assert_eq!(check(&mut l, &cat, 0, 1, 2), 600);
    let stats = l.finish();
    assert!(stats.failovers > 0, "{stats:?}");
    assert_eq!(stats.source_reads, 0, "node 0 has every sample: {stats:?}");
}

#[test]
fn node_failing_every_grant_is_demoted_for_the_epoch() {
    let st = setup("tiny", 2000, 2, 2);
    let n0 = Serve::start(&st.spaces[0], &node_ip(0), &st.token, &[]);
    let n1 = Serve::start(&st.spaces[1], &node_ip(1), &st.token, &[]);
    // Node 1's extent is emptied once it serves: every grant it gets comes
    // back as ERROR.
    let ext = Space::open(&st.spaces[1]).unwrap().extent_path(0);
    std::fs::OpenOptions::new()
        .write(true)
        .open(&ext)
        .unwrap()
        .set_len(0)
        .unwrap();
    let cat = Catalog::open(&st.catalog).unwrap();
    let mut l = builder_remote(&st, &[&n0.addr, &n1.addr], 256 << 10)
        .build()
        .unwrap();
    assert_eq!(check(&mut l, &cat, 0, 1, 2), 4000);
    let stats = l.finish();
    eprintln!("{} failovers in 2 epochs", stats.failovers);
    // Node 1 is the first holder of about 1000 samples per epoch; demoted
    // after 16 failures, it fails only those granted before that.
    assert!(stats.failovers > 0 && stats.failovers < 800, "{stats:?}");
    assert_eq!(stats.source_reads, 0, "{stats:?}");
}

#[test]
fn stalled_nodes_cost_one_timeout_at_start_not_one_each() {
    let st = setup("tiny", 300, 4, 2);
    let n0 = Serve::start(&st.spaces[0], &node_ip(0), &st.token, &[]);
    // Nodes 1-3 accept connections (the kernel does, from the backlog) and
    // never answer a HELLO.
    let stalled: Vec<TcpListener> = (1..4)
        // (Two addresses: the RDMA VM has .2 and .3 besides node 0's.)
        .map(|i| TcpListener::bind(format!("{}:0", node_ip(1 + i % 2))).unwrap())
        .collect();
    let addrs: Vec<String> = stalled
        .iter()
        .map(|l| l.local_addr().unwrap().to_string())
        .collect();
    // What a build costs here when nodes 1-3 refuse at once (ring, RDMA
    // set-up...): a port nobody listens on.
    let closed = {
        let l = TcpListener::bind(format!("{}:0", node_ip(1))).unwrap();
        l.local_addr().unwrap().to_string()
    };
    let t0 = Instant::now();
    drop(
        builder_remote(&st, &[&n0.addr, &closed, &closed, &closed], 1 << 20)
            .node_timeout(Duration::from_secs(2))
            .build()
            .unwrap(),
    );
    let alone = t0.elapsed();
    let t0 = Instant::now();
    let l = builder_remote(&st, &[&n0.addr, &addrs[0], &addrs[1], &addrs[2]], 1 << 20)
        .node_timeout(Duration::from_secs(2))
        .build()
        .unwrap();
    let took = t0.elapsed();
    drop(l);
    // One after another they took 3 x 2 s more; at once, 2 s.
    assert!(
        took < alone + Duration::from_millis(3500),
        "build took {took:?}, {alone:?} with nodes 1-3 refusing"
    );
}

#[test]
fn stopped_consumer_does_not_starve_the_others() {
    let st = setup("imagenet", 600, 1, 1);
    let log = st._tmp.path().join("node.log");
    // A small staging pool (16 slots) that one consumer could hog. The
    // stall timeout is long: rank 1 must finish while the stopped rank 0
    // still holds its share, not once the node has dropped it.
    let node = Serve::launch(
        &st.spaces[0],
        &node_ip(0),
        &st.token,
        &[
            "--staging-bytes",
            "1MiB",
            "--chunk-bytes",
            "64KiB",
            "--stall-timeout-ms",
            "20000",
            "--metrics",
            &format!("{}:0", node_ip(0)),
        ],
        Some(&log),
        None,
    );
    let maddr = node
        .before
        .iter()
        .find_map(|l| l.strip_prefix("metrics on http://"))
        .and_then(|l| l.strip_suffix("/metrics"))
        .unwrap_or_else(|| panic!("no metrics line: {:?}", node.before))
        .to_string();
    let file = st.spaces[0].parent().unwrap().join("cluster.txt");
    std::fs::write(&file, format!("0 {}\n", node.addr)).unwrap();
    // Rank 0 grants a 48 MiB ring ahead, far more than the socket buffers
    // hold, and is stopped once it reads.
    let mut rank0 = Command::new(kspeed_bin())
        .args(["read", "--progress=none", "--source", s(&st.src)])
        .args(["--catalog", s(&st.catalog), "--cluster", s(&file)])
        .args(["--token-file", s(&st.token), "--rank", "0", "--world", "2"])
        .args(["--epochs", "1000", "--ring-bytes", "48MiB"])
        .args(if rdma_mode() { &["--rdma"][..] } else { &[] })
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // Stopped while the node holds staging slots for it.
    let t0 = Instant::now();
    while metric(
        &http_get(&maddr, "/metrics").1,
        "kspeed_consumer_staging_slots{",
    )
    .unwrap_or(0.0)
        < 1.0
    {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "rank 0 never held a staging slot"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let stop = |sig: &str| {
        Command::new("kill")
            .args([sig, &rank0.id().to_string()])
            .status()
            .unwrap()
    };
    stop("-STOP");
    let cat = Catalog::open(&st.catalog).unwrap();
    let res = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let mut l = builder_remote(&st, &[&node.addr], 8 << 20)
            .rank(1, 2)
            .node_timeout(Duration::from_secs(5))
            .build()
            .unwrap();
        let n = check(&mut l, &cat, 1, 2, 3);
        // Rank 1 never waited for the node to drop rank 0: it is done
        // while rank 0 is still there, stopped, holding its share.
        assert_eq!(
            log_lines(&log, "took no data"),
            0,
            "rank 1 finished only once the stopped rank 0 was dropped"
        );
        let stats = l.finish();
        // The node drops the stopped consumer. (Over RDMA the NIC keeps
        // landing its granted writes while it is stopped: nothing stalls
        // and nothing is dropped.)
        let t0 = Instant::now();
        while !rdma_mode() && log_lines(&log, "took no data for 20000 ms") == 0 {
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "the stopped consumer was not dropped"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        (n, stats)
    }));
    stop("-CONT");
    let _ = rank0.kill();
    let _ = rank0.wait();
    let (n, stats) = res.unwrap_or_else(|p| std::panic::resume_unwind(p));
    assert_eq!(n, 900);
    assert_eq!(stats.source_reads, 0, "{stats:?}");
    assert_eq!(stats.failovers, 0, "{stats:?}");
}

/// `GET path` over HTTP/1.0 with a plain socket: (status line, body).
fn http_get(addr: &str, path: &str) -> (String, String) {
    let mut c = TcpStream::connect(addr).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(c, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").unwrap();
    let mut all = String::new();
    c.read_to_string(&mut all).unwrap();
    let (head, body) = all.split_once("\r\n\r\n").unwrap_or((&all, ""));
    (
        head.lines().next().unwrap_or("").to_string(),
        body.to_string(),
    )
}

/// The value of the metric line that starts with `prefix` (name and
/// labels), if there is one.
fn metric(text: &str, prefix: &str) -> Option<f64> {
    text.lines()
        .find(|l| l.starts_with(prefix))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

#[test]
fn metrics_endpoint_counts_a_consumer_and_sigusr1_logs_statistics() {
    let st = setup("tiny", 300, 1, 1);
    let log = st._tmp.path().join("node.log");
    let node = Serve::launch(
        &st.spaces[0],
        &node_ip(0),
        &st.token,
        &["--metrics", &format!("{}:0", node_ip(0))],
        Some(&log),
        None,
    );
    let maddr = node
        .before
        .iter()
        .find_map(|l| l.strip_prefix("metrics on http://"))
        .and_then(|l| l.strip_suffix("/metrics"))
        .unwrap_or_else(|| panic!("no metrics line: {:?}", node.before))
        .to_string();
    let cat = Catalog::open(&st.catalog).unwrap();
    let total: u64 = (0..cat.len()).map(|i| cat.sample(i).len as u64).sum();
    let mut l = builder_remote(&st, &[&node.addr], 1 << 20).build().unwrap();
    // While the consumer reads: its series is there.
    l.set_epoch(0).unwrap();
    let b = l.next_batch().unwrap().unwrap();
    let me = "kspeed_consumer_bytes_total{peer=\"";
    // The node counts a send when it reaps its completion, which can come
    // after the consumer has the bytes (under load, a while after): wait
    // for the count, with a deadline, rather than read it once.
    let t0 = Instant::now();
    let (status, text) = loop {
        let (status, text) = http_get(&maddr, "/metrics");
        if metric(&text, me).unwrap_or(0.0) > 0.0 || t0.elapsed() > Duration::from_secs(20) {
            break (status, text);
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.contains("200"), "{status}");
    assert!(metric(&text, me).unwrap_or(0.0) > 0.0, "{text}");
    assert!(text.contains("rank=\"0\""), "{text}");
    assert!(text.contains("kspeed_consumer_staging_slots{"), "{text}");
    drop(b);
    while let Some(b) = l.next_batch().unwrap() {
        drop(b);
    }
    // After one whole epoch (the loader grants ahead into the next): at
    // least every byte of it, the node's total being this consumer's. (The
    // node counts a write when it reaps its completion, which over RDMA can
    // come after the consumer has the bytes: wait for it.)
    // The loader also grants ahead into the next epoch, so the node may
    // still be sending: wait until a scrape shows every byte and agrees
    // with itself (per-consumer and node totals are separate counters).
    let t0 = Instant::now();
    let text = loop {
        let (_, text) = http_get(&maddr, "/metrics");
        let bytes = metric(&text, me).unwrap_or(0.0);
        let settled = bytes >= total as f64
            && Some(bytes) == metric(&text, "kspeed_serve_bytes_total ")
            && metric(&text, "kspeed_consumer_samples_total{")
                == metric(&text, "kspeed_serve_samples_total ")
            && metric(
                &text,
                "kspeed_serve_read_latency_seconds_count{poller=\"0\"}",
            ) == metric(
                &text,
                "kspeed_serve_read_latency_seconds_bucket{le=\"+Inf\",poller=\"0\"}",
            );
        if settled || t0.elapsed() > Duration::from_secs(20) {
            break text;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let bytes = metric(&text, me).unwrap_or(0.0);
    assert!(bytes >= total as f64, "{bytes} < {total}: {text}");
    assert_eq!(Some(bytes), metric(&text, "kspeed_serve_bytes_total "));
    let samples = metric(&text, "kspeed_consumer_samples_total{").unwrap_or(0.0);
    assert!(samples >= cat.len() as f64, "{text}");
    assert_eq!(Some(samples), metric(&text, "kspeed_serve_samples_total "));
    assert_eq!(metric(&text, "kspeed_consumer_errors_total{"), Some(0.0));
    // The pollers ticked and were busy for some of it (the mean tick:
    // their ratio).
    let ticks = metric(&text, "kspeed_serve_poller_ticks_total ").unwrap_or(0.0);
    let busy = metric(&text, "kspeed_serve_poller_busy_seconds_total ").unwrap_or(0.0);
    assert!(
        ticks > 0.0 && busy > 0.0,
        "ticks {ticks}, busy {busy} s: {text}"
    );
    let reads = metric(
        &text,
        "kspeed_serve_read_latency_seconds_count{poller=\"0\"}",
    )
    .unwrap_or(0.0);
    assert!(reads >= cat.len() as f64, "{text}");
    let inf = metric(
        &text,
        "kspeed_serve_read_latency_seconds_bucket{le=\"+Inf\",poller=\"0\"}",
    );
    assert_eq!(inf, Some(reads), "{text}");
    assert!(
        text.contains("kspeed_serve_read_latency_seconds_bucket{le=\"0.001\",poller=\"0\"}")
            || text.contains("kspeed_serve_read_latency_seconds_bucket{poller=\"0\",le=\"0.001\"}"),
        "{text}"
    );
    assert_eq!(metric(&text, "kspeed_serve_consumers "), Some(1.0));
    // A grant's other phases at the node, one observation per chunk sent
    // (one chunk per tiny sample), and its link among the slowest.
    for phase in ["grant_wait", "send_wait", "send"] {
        let n = metric(
            &text,
            &format!("kspeed_serve_{phase}_seconds_count{{poller=\"0\"}}"),
        )
        .unwrap_or(0.0);
        assert!(n >= cat.len() as f64, "{phase}: {n}: {text}");
    }
    let slow = metric(&text, "kspeed_serve_slowest_consumer_send_seconds{")
        .unwrap_or_else(|| panic!("no slowest consumer: {text}"));
    // A mean of whole microseconds: sends faster than that read 0.
    assert!((0.0..10.0).contains(&slow), "{slow}");
    assert!(
        text.lines().any(
            |l| l.starts_with("kspeed_serve_slowest_consumer_send_seconds{")
                && l.contains("rank=\"0\"")
        ),
        "{text}"
    );
    assert!(http_get(&maddr, "/nothing").0.contains("404"));
    // SIGUSR1: the statistics in the log, the node still serving.
    node.signal("-USR1");
    let t0 = Instant::now();
    while log_lines(&log, "statistics (SIGUSR1)") < 2 {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "no statistics on SIGUSR1"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(l);
    // The disconnect, with its totals.
    let t0 = Instant::now();
    while log_lines(&log, "disconnected: ") == 0 {
        assert!(t0.elapsed() < Duration::from_secs(20), "no disconnect line");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(log_lines(&log, "(poller 0, ") >= 1, "no connect line");
}

/// The metrics port costs one thread however many connections arrive: a
/// thousand idle connections (tiny_http gave each its own thread, for as
/// long as the client kept it open) leave the node's thread count where it
/// was, a scrape still answers, and an idle connection is closed at its
/// deadline.
#[test]
fn metrics_port_threads_are_bounded_and_idle_connections_time_out() {
    let st = setup("tiny", 50, 1, 1);
    let node = Serve::start(
        &st.spaces[0],
        &node_ip(0),
        &st.token,
        &["--metrics", &format!("{}:0", node_ip(0))],
    );
    let maddr = node
        .before
        .iter()
        .find_map(|l| l.strip_prefix("metrics on http://"))
        .and_then(|l| l.strip_suffix("/metrics"))
        .unwrap_or_else(|| panic!("no metrics line: {:?}", node.before))
        .to_string();
    let task_dir = format!("/proc/{}/task", node.child.id());
    let threads = || std::fs::read_dir(&task_dir).unwrap().count();
    // One scrape first, so whatever the first answer starts is counted.
    assert!(http_get(&maddr, "/metrics").0.contains("200"));
    let base = threads();
    kspeed::dataset::raise_open_files_limit();
    let sock_addr: std::net::SocketAddr = maddr.parse().unwrap();
    let idle: Vec<TcpStream> = (0..1000)
        .map(|i| {
            TcpStream::connect_timeout(&sock_addr, Duration::from_secs(30))
                .unwrap_or_else(|e| panic!("connection {i}: {e}"))
        })
        .collect();
    // A real scrape answers while they are open (it is the newest
    // connection, and the node has taken every older one by then).
    let (status, text) = http_get(&maddr, "/metrics");
    assert!(status.contains("200"), "{status}");
    assert!(text.contains("kspeed_serve_connections_total"), "{text}");
    let during = threads();
    assert!(
        during <= base + 1,
        "{during} threads with 1000 metrics connections open, {base} before"
    );
    drop(idle);
    // An idle connection alone is closed at its deadline (5 s), not kept.
    let mut c = TcpStream::connect(&maddr).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let mut b = [0u8; 16];
    match c.read(&mut b) {
        Ok(0) => {}
        Ok(n) => panic!("{n} bytes on a connection that sent nothing"),
        Err(e) => panic!("idle metrics connection not closed: {e}"),
    }
    assert!(http_get(&maddr, "/metrics").0.contains("200"));
    assert!(http_get(&maddr, "/nothing").0.contains("404"));
}

/// Runs `kspeed ARGS`, killed after `limit`: (exit code, output).
fn run_for(args: &[&str], limit: Duration) -> (Option<i32>, String) {
    let mut child = Command::new(kspeed_bin())
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if t0.elapsed() > limit {
            let _ = child.kill();
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let o = child.wait_with_output().unwrap();
    (o.status.code(), text(&o))
}

/// [`run_for`] with the address space limited to `as_bytes` (`prlimit`), so
/// a command that reads without bound fails fast instead of exhausting the
/// machine's memory.
fn run_for_limited(args: &[&str], limit: Duration, as_bytes: u64) -> (Option<i32>, String) {
    let mut child = Command::new("prlimit")
        .arg(format!("--as={as_bytes}"))
        .arg("--")
        .arg(kspeed_bin())
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if t0.elapsed() > limit {
            let _ = child.kill();
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let o = child.wait_with_output().unwrap();
    (o.status.code(), text(&o))
}

#[test]
fn serve_and_read_check_the_token_and_every_limit_at_start() {
    use std::os::unix::fs::PermissionsExt;
    let st = setup("tiny", 50, 1, 1);
    let dir = st._tmp.path();
    let long = dir.join("long.token");
    std::fs::write(&long, "x".repeat(1025)).unwrap();
    // The longest token, with a CRLF: accepted.
    let longest = dir.join("longest.token");
    std::fs::write(&longest, "x".repeat(1024) + "\r\n").unwrap();
    std::fs::set_permissions(&longest, std::fs::Permissions::from_mode(0o600)).unwrap();
    let loose = dir.join("loose.token");
    std::fs::write(&loose, TOKEN).unwrap();
    std::fs::set_permissions(&loose, std::fs::Permissions::from_mode(0o644)).unwrap();
    let space = s(&st.spaces[0]);
    let serve = |token: &Path, listen: &str, extra: &[&str]| {
        let mut a = vec!["serve", "--space", space, "--listen", listen];
        a.extend(["--token-file", s(token)]);
        a.extend(extra);
        run_for(&a, Duration::from_secs(20))
    };
    // A token longer than a HELLO carries: refused by serve and read.
    let (code, out) = serve(&long, "127.0.0.1:0", &[]);
    assert_eq!(code, Some(1), "{out}");
    assert!(
        out.contains("1025-byte token") && out.contains("1024"),
        "{out}"
    );
    // A token file without end (or a huge one) is refused after reading
    // 1027 bytes, by serve and read, naming the limit: not read until
    // memory runs out (the old code did; 1 GiB of address space stops it).
    let one_node = dir.join("one-node.txt");
    std::fs::write(&one_node, "0 127.0.0.1:9\n").unwrap();
    for cmd in ["serve", "read"] {
        let mut a = vec![cmd, "--space", space, "--token-file", "/dev/zero"];
        if cmd == "serve" {
            a.extend(["--listen", "127.0.0.1:0"]);
        } else {
            a.extend(["--cluster", s(&one_node)]);
        }
        let (code, out) = run_for_limited(&a, Duration::from_secs(20), 1 << 30);
        assert_eq!(code, Some(1), "{cmd}: {out}");
        assert!(
            out.contains("token file /dev/zero holds more than 1026 bytes")
                && out.contains("at most 1024 bytes"),
            "{cmd}: {out}"
        );
    }
    let (code, out) = serve(&longest, "127.0.0.1:0", &["--max-grants", "1048577"]);
    assert_eq!(code, Some(1), "{out}");
    assert!(!out.contains("token"), "the token is fine: {out}");
    let file = dir.join("cluster.txt");
    std::fs::write(&file, "0 127.0.0.1:9\n").unwrap();
    let (code, out) = run_for(
        &[
            "read",
            "--space",
            space,
            "--cluster",
            s(&file),
            "--token-file",
            s(&long),
        ],
        Duration::from_secs(20),
    );
    assert_eq!(code, Some(1), "{out}");
    assert!(out.contains("1025-byte token"), "{out}");
    // Every size flag against what the service can allocate.
    for (flag, value, what) in [
        ("--max-grants", "4294967295", "max grants is 4294967295"),
        (
            "--max-consumers-per-poller",
            "4097",
            "max consumers per poller is 4097",
        ),
        ("--max-handshakes", "100000", "max handshakes is 100000"),
        ("--staging-bytes", "64GiB", "staging bytes is"),
        ("--chunk-bytes", "1GiB", "chunk bytes is"),
        (
            "--handshake-timeout-ms",
            "0",
            "timeouts must be more than 0",
        ),
    ] {
        let (code, out) = serve(&st.token, "127.0.0.1:0", &[flag, value]);
        assert_eq!(code, Some(1), "{flag} {value}: {out}");
        assert!(out.contains(what), "{flag} {value}: {out}");
        assert!(!out.contains("serving"), "{out}");
    }
    // A world-readable token file and every interface: warnings (this
    // one then stops at its bad limit).
    let (code, out) = serve(&loose, "0.0.0.0:0", &["--max-grants", "1048577"]);
    assert_eq!(code, Some(1), "{out}");
    assert!(out.contains("readable by every user"), "{out}");
    assert!(out.contains("listening on every interface"), "{out}");
}

/// A node of a 64-node placement says 131,072 / 64 = 2,048 grants per
/// consumer in its WELCOME (the default, `--max-grants` 0: its grant
/// queues stay the same size whatever the cluster's), and refuses a GRANT
/// frame of more at its header, before any of its body is sent.
#[test]
fn a_node_sizes_its_grant_limit_from_the_placement() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    gen("tiny", 200, &src);
    let catalog = tmp.path().join("cat.ksc");
    ok(&["catalog", "--source", s(&src), "--out", s(&catalog)]);
    let space = tmp.path().join("node0");
    ok(&[
        "preload",
        "--source",
        s(&src),
        "--catalog",
        s(&catalog),
        "--space",
        s(&space),
        "--nodes",
        "64",
        "--node-index",
        "0",
    ]);
    let token = tmp.path().join("token");
    std::fs::write(&token, format!("{TOKEN}\n")).unwrap();
    let node = Serve::start(&space, "127.0.0.1", &token, &[]);
    let cat = Catalog::open(&catalog).unwrap();
    let mut c = TcpStream::connect(&node.addr).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    c.write_all(&hello_frame(
        &cat,
        proto::VERSION,
        TOKEN.as_bytes(),
        1 << 20,
    ))
    .unwrap();
    let mut w = [0u8; proto::HEADER_BYTES + proto::WELCOME_BYTES];
    c.read_exact(&mut w).unwrap();
    let mut hb = [0u8; proto::HEADER_BYTES];
    hb.copy_from_slice(&w[..proto::HEADER_BYTES]);
    let h = Header::decode(&hb, 0).unwrap();
    let welcome = Welcome::decode(&h, &w[proto::HEADER_BYTES..]).unwrap();
    assert_eq!(welcome.max_grants, 2048);
    // The header of a 2,049-entry GRANT, and no body: the node answers
    // without waiting for it.
    c.write_all(&Header::grant(2049).encode()).unwrap();
    let (code, msg) = read_error(&mut c);
    assert_eq!(code, Code::TooManyGrants, "{msg}");
    assert!(
        msg.contains("2049 grants outstanding, more than the 2048 allowed"),
        "{msg}"
    );
}

#[test]
fn a_full_node_refuses_at_hello_with_a_named_error() {
    let st = setup("tiny", 100, 1, 1);
    let node = Serve::start(
        &st.spaces[0],
        &node_ip(0),
        &st.token,
        &["--max-consumers-per-poller", "1"],
    );
    let cat = Catalog::open(&st.catalog).unwrap();
    let mut first = builder_remote(&st, &[&node.addr], 1 << 20).build().unwrap();
    // The second consumer is told why at HELLO, not welcomed then dropped;
    // it tries again within its node timeout, then gives up by name.
    let e = builder_remote(&st, &[&node.addr], 1 << 20)
        .node_timeout(Duration::from_secs(2))
        .build()
        .err()
        .expect("refused");
    assert!(
        matches!(&e, Error::Refused { code, .. } if *code == "node full"),
        "{e}"
    );
    assert!(e.to_string().contains("max-consumers-per-poller"), "{e}");
    // The first is unaffected; once it is gone there is room again.
    assert_eq!(check(&mut first, &cat, 0, 1, 1), 100);
    drop(first);
    let t0 = Instant::now();
    let mut again = loop {
        match builder_remote(&st, &[&node.addr], 1 << 20).build() {
            Ok(l) => break l,
            Err(Error::Refused {
                code: "node full", ..
            }) => {
                assert!(t0.elapsed() < Duration::from_secs(20), "never room again");
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) => panic!("{e}"),
        }
    };
    assert_eq!(check(&mut again, &cat, 0, 1, 1), 100);
}

#[test]
fn idle_connections_are_closed_and_keepalives_keep_live_consumers() {
    let st = setup("tiny", 300, 1, 1);
    let node = Serve::start(
        &st.spaces[0],
        &node_ip(0),
        &st.token,
        &["--idle-timeout-ms", "3000"],
    );
    let cat = Catalog::open(&st.catalog).unwrap();
    // A consumer that holds its first batch: its ring fills, it grants
    // nothing more and is idle but for its keepalives.
    let mut l = builder_remote(&st, &[&node.addr], 1 << 20).build().unwrap();
    l.set_epoch(0).unwrap();
    let first: Vec<(u64, u32)> = {
        let b = l.next_batch().unwrap().unwrap();
        b.iter().map(|x| (x.id, crc32c::crc32c(x.bytes))).collect()
    };
    // Two peers past HELLO that send nothing, one after the other: each is
    // closed for being idle, so the consumer has been idle two timeouts.
    for _ in 0..2 {
        let t0 = Instant::now();
        let mut c = TcpStream::connect(&node.addr).unwrap();
        c.write_all(&hello_frame(
            &cat,
            proto::VERSION,
            TOKEN.as_bytes(),
            1 << 20,
        ))
        .unwrap();
        let (h, _) = read_frame(&mut c).unwrap();
        assert_eq!(h.kind, Kind::Welcome);
        c.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        let (code, msg) = read_error(&mut c);
        assert_eq!(code, Code::ShuttingDown, "{msg}");
        assert!(msg.contains("idle"), "{msg}");
        assert!(
            t0.elapsed() >= Duration::from_millis(2900),
            "{:?}",
            t0.elapsed()
        );
    }
    for (id, crc) in first {
        assert_eq!(crc, cat.sample(id).crc32c);
    }
    // The consumer's connection is still there: the rest arrives from the
    // node, nothing from the source.
    let mut n = 16;
    while let Some(b) = l.next_batch().unwrap() {
        for x in b.iter() {
            assert_eq!(crc32c::crc32c(x.bytes), cat.sample(x.id).crc32c);
            n += 1;
        }
    }
    assert_eq!(n, 300);
    let stats = l.finish();
    assert_eq!(stats.failovers, 0, "{stats:?}");
    assert_eq!(stats.source_reads, 0, "{stats:?}");
}

// --- hostile nodes against a real consumer --------------------------------

#[derive(Clone, Copy, Debug)]
enum Misdeed {
    UnknownGrant,
    OffsetPastGrant,
    Overrun,
    TruncatedFrame,
    StallMidFrame,
    BadMagic,
    /// One-byte DATA frames every 50 ms (each well within the node
    /// timeout), for up to 30 s.
    Trickle,
}

/// A fake node 1 (of 2, 2 copies) that answers HELLO properly and then
/// misbehaves on the first grant it gets.
fn fake_node(misdeed: Misdeed) -> (String, std::thread::JoinHandle<()>) {
    let l = TcpListener::bind("127.0.0.2:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let h = std::thread::spawn(move || {
        let (mut c, _) = l.accept().unwrap();
        read_frame(&mut c).unwrap(); // HELLO
        let w = Welcome {
            node_index: 1,
            nodes: 2,
            replicas: 2,
            owner_fn: 1,
            max_data_bytes: 1 << 20,
            max_grants: 4096,
            transport: proto::TRANSPORT_TCP,
        };
        c.write_all(&w.encode()).unwrap();
        // The first GRANT (after the keepalive that asks for heartbeats,
        // which this fake node, like an older one, ignores).
        let body = loop {
            let (h, body) = read_frame(&mut c).unwrap();
            if h.kind == Kind::Grant {
                break body;
            }
        };
        let e = GrantEntry::decode(&body, 0);
        let junk = |n: usize| vec![0xaau8; n];
        let frame = |grant: u32, off: u64, len: u32| {
            let mut f = Header::data(grant, off, len).encode().to_vec();
            f.extend_from_slice(&junk(len as usize));
            f
        };
        let _ = match misdeed {
            Misdeed::UnknownGrant => c.write_all(&frame(e.grant.wrapping_add(7777), e.offset, 8)),
            Misdeed::OffsetPastGrant => c.write_all(&frame(e.grant, e.offset + e.len as u64, 8)),
            Misdeed::Overrun => c.write_all(&frame(e.grant, e.offset, e.len + 64)),
            Misdeed::TruncatedFrame => {
                let f = frame(e.grant, e.offset, e.len);
                c.write_all(&f[..proto::HEADER_BYTES + e.len as usize / 2])
            }
            Misdeed::StallMidFrame => {
                let f = frame(e.grant, e.offset, e.len);
                let _ = c.write_all(&f[..proto::HEADER_BYTES + e.len as usize / 2]);
                std::thread::sleep(Duration::from_secs(4));
                Ok(())
            }
            Misdeed::BadMagic => c.write_all(&[0x55u8; 24]),
            Misdeed::Trickle => {
                let t0 = Instant::now();
                let mut off = 0;
                while off < e.len as u64 && t0.elapsed() < Duration::from_secs(30) {
                    if c.write_all(&frame(e.grant, e.offset + off, 1)).is_err() {
                        break;
                    }
                    off += 1;
                    std::thread::sleep(Duration::from_millis(50));
                }
                Ok(())
            }
        };
        // Hold the socket a little, then go.
        std::thread::sleep(Duration::from_millis(200));
    });
    (addr, h)
}

#[test]
fn hostile_nodes_are_dropped_and_nothing_lands_outside_grants() {
    let st = setup("tiny", 400, 2, 2);
    let node0 = Serve::start(&st.spaces[0], "127.0.0.1", &st.token, &[]);
    let cat = Catalog::open(&st.catalog).unwrap();
    for m in [
        Misdeed::UnknownGrant,
        Misdeed::OffsetPastGrant,
        Misdeed::Overrun,
        Misdeed::TruncatedFrame,
        Misdeed::StallMidFrame,
        Misdeed::BadMagic,
        Misdeed::Trickle,
    ] {
        let (addr, fake) = fake_node(m);
        let t0 = Instant::now();
        // No local space: everything comes over the network, so the ring's
        // padding is written by nobody and must stay zero.
        let mut l = builder_remote(&st, &[&node0.addr, &addr], 1 << 20)
            .node_timeout(Duration::from_millis(700))
            .build()
            .unwrap();
        assert_eq!(check(&mut l, &cat, 0, 1, 2), 800, "{m:?}");
        let stats = l.finish();
        assert!(stats.failovers > 0, "{m:?}: {stats:?}");
        assert_eq!(stats.source_reads, 0, "{m:?}: node 0 holds every sample");
        assert!(
            t0.elapsed() < Duration::from_secs(15),
            "{m:?} took {:?}",
            t0.elapsed()
        );
        fake.join().unwrap();
    }
    // The real node's space is intact for later users.
    assert_eq!(Space::open(&st.spaces[0]).unwrap().held_samples(), 400);
}

// --- across network namespaces -------------------------------------------

#[test]
fn three_nodes_in_network_namespaces() {
    if !is_root() || Command::new("ip").arg("-V").output().is_err() {
        skip("needs root and iproute2 to create network namespaces");
        return;
    }
    let st = setup("imagenet", 200, 3, 2);
    let Some(ns) = Netns::create(3) else {
        return;
    };
    let serves: Vec<Serve> = (0..3)
        .map(|i| {
            let mut child = Command::new("ip")
                .args([
                    "netns",
                    "exec",
                    &ns.names[i],
                    kspeed_bin(),
                    "serve",
                    "--space",
                ])
                .arg(&st.spaces[i])
                .args(["--listen", &format!("10.77.{i}.2:0"), "--token-file"])
                .arg(&st.token)
                .args(["--pollers", "1"])
                .stdout(Stdio::piped())
                .stderr(Stdio::null())
                .spawn()
                .unwrap();
            let mut line = String::new();
            BufReader::new(child.stdout.take().unwrap())
                .read_line(&mut line)
                .unwrap();
            let addr = line.trim().rsplit(' ').next().unwrap().to_string();
            assert!(addr.starts_with(&format!("10.77.{i}.2:")), "{line}");
            Serve {
                child,
                addr,
                before: Vec::new(),
            }
        })
        .collect();
    let addrs: Vec<&str> = serves.iter().map(|s| s.addr.as_str()).collect();
    let cat = Catalog::open(&st.catalog).unwrap();
    std::thread::scope(|sc| {
        for rank in 0..2u32 {
            let (cluster, st, cat) = (cluster_of(&addrs), &st, &cat);
            sc.spawn(move || {
                // Consumers outside the namespaces, with no local samples:
                // everything crosses a veth pair.
                let mut l = LoaderBuilder::source(s(&st.src))
                    .catalog(&st.catalog)
                    .cluster(cluster)
                    .token(TOKEN.as_bytes())
                    .seed(3)
                    .batch_size(16)
                    .pollers(1)
                    .pin(false)
                    .rank(rank, 2)
                    .landing(test_ring(8 << 20))
                    .build()
                    .unwrap();
                assert_eq!(check(&mut l, cat, rank, 2, 2), 200);
                let stats = l.finish();
                // (Read-ahead into the next epoch counts too.)
                assert!(
                    stats.remote_samples >= 200 && stats.disk_reads == 0,
                    "{stats:?}"
                );
            });
        }
    });
    drop(serves);
}

#[test]
fn read_error_on_a_node_fails_over_to_the_replica() {
    let st = setup("tiny", 400, 2, 2);
    let n0 = Serve::start(&st.spaces[0], &node_ip(0), &st.token, &[]);
    let n1 = Serve::start(&st.spaces[1], &node_ip(1), &st.token, &[]);
    // Node 1's extent loses its second half after the service started:
    // its reads come back short and it answers those grants with ERROR.
    let ext = st.spaces[1].join("extents").join("00000000.kse");
    let len = std::fs::metadata(&ext).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&ext)
        .unwrap()
        .set_len(len / 2)
        .unwrap();
    let cat = Catalog::open(&st.catalog).unwrap();
    let mut l = builder_remote(&st, &[&n0.addr, &n1.addr], 1 << 20)
        .build()
        .unwrap();
    assert_eq!(check(&mut l, &cat, 0, 1, 2), 800);
    let stats = l.finish();
    assert!(stats.failovers > 0, "{stats:?}");
    assert_eq!(stats.source_reads, 0, "node 0 has every sample: {stats:?}");
}

/// A consumer on node 0 of a two-node cluster, reading its own copies from
/// its space through the seeded fault-injecting ring (`eio_ppm` of the reads
/// fail with EIO) and, when `corrupt`, from an extent with flipped bytes
/// (with `verify_crc32c`). The source is hidden: only node 1 can stand in.
fn local_trouble(
    replicas: u32,
    eio_ppm: u32,
    corrupt: bool,
) -> (Setup, Vec<Serve>, Catalog, Loader) {
    let st = setup("tiny", 400, 2, replicas);
    if corrupt {
        // After preload, so only the consumer's CRC32C check can notice.
        let ext = Space::open(&st.spaces[0]).unwrap().extent_path(0);
        let mut bytes = std::fs::read(&ext).unwrap();
        let n = bytes.len();
        for b in &mut bytes[n / 3..n / 3 + 8192] {
            *b ^= 0x5a;
        }
        std::fs::write(&ext, &bytes).unwrap();
    }
    let serves: Vec<Serve> = (0..2)
        .map(|i| Serve::start(&st.spaces[i], &node_ip(i), &st.token, &[]))
        .collect();
    std::fs::rename(&st.src, st.src.with_extension("gone")).unwrap();
    let addrs: Vec<&str> = serves.iter().map(|s| s.addr.as_str()).collect();
    let cat = Catalog::open(&st.catalog).unwrap();
    let mut b = builder_space(&st.spaces[0], cluster_of(&addrs))
        .landing(test_ring(1 << 20))
        .verify_crc32c(corrupt);
    if eio_ppm > 0 {
        b = b.fault_injection(
            kspeed::loader::FaultConfig::default()
                .seed(11)
                .eio_ppm(eio_ppm),
        );
    }
    (st, serves, cat, b.build().unwrap())
}

#[test]
fn local_read_error_fails_over_to_the_replica() {
    let (_st, _serves, cat, mut l) = local_trouble(2, 50_000, false);
    assert_eq!(check(&mut l, &cat, 0, 1, 2), 800);
    let stats = l.finish();
    assert!(stats.failovers > 0, "no local read failed: {stats:?}");
    assert_eq!(stats.source_reads, 0, "the source is hidden: {stats:?}");
    assert!(stats.remote_samples > 0, "node 1 served none: {stats:?}");
}

#[test]
fn local_crc_mismatch_fails_over_to_the_replica() {
    let (_st, _serves, cat, mut l) = local_trouble(2, 0, true);
    // Not `check`: its padding test assumes the extents' padding is zero,
    // and the flipped stretch covers some of it (the pollers read whole
    // aligned slots, padding included).
    let sampler = Sampler::new(
        SamplerConfig::single(cat.len(), 3)
            .rank_world(0, 1)
            .shuffle(true)
            .drop_last(false),
    )
    .unwrap();
    let mut n = 0;
    for e in 0..2 {
        l.set_epoch(e).unwrap();
        let mut k = 0;
        while let Some(b) = l.next_batch().unwrap() {
            for smp in b.iter() {
                assert_eq!(smp.id, sampler.sample(e, k), "epoch {e} step {k}");
                let c = cat.sample(smp.id);
                assert_eq!(smp.bytes.len(), c.len as usize);
                assert_eq!(crc32c::crc32c(smp.bytes), c.crc32c, "sample {}", smp.id);
                k += 1;
                n += 1;
            }
        }
        assert_eq!(k, sampler.per_rank());
    }
    assert_eq!(n, 800);
    let stats = l.finish();
    assert!(
        stats.failovers > 0,
        "no local sample was corrupt: {stats:?}"
    );
    assert_eq!(stats.source_reads, 0, "the source is hidden: {stats:?}");
}

#[test]
fn local_read_error_without_another_copy_is_a_named_error() {
    let (st, _serves, _cat, mut l) = local_trouble(1, 50_000, false);
    let err = (|| -> Result<(), Error> {
        for e in 0..50 {
            l.set_epoch(e)?;
            while l.next_batch()?.is_some() {}
        }
        Ok(())
    })()
    .expect_err("no injected EIO in 50 epochs");
    eprintln!("{err}");
    let extents = st.spaces[0].join("extents");
    match &err {
        Error::SampleUnavailable { tried, .. } => {
            // This node's copy: the extent file, the offset and the errno.
            assert!(tried.contains(s(&extents)), "{tried}");
            assert!(tried.contains("at offset"), "{tried}");
            assert!(tried.contains("errno 5 (Input/output error)"), "{tried}");
            // And the source, which is gone.
            assert!(tried.contains("source"), "{tried}");
        }
        e => panic!("expected SampleUnavailable, got {e}"),
    }
}

#[test]
fn node_service_embedded_in_process() {
    use kspeed::transport::{NodeService, ServeConfig};
    use std::sync::atomic::Ordering;
    let st = setup("tiny", 300, 1, 1);
    let mut cfg = ServeConfig::new(
        &st.spaces[0],
        &format!("{}:0", node_ip(0)),
        TOKEN.as_bytes(),
    );
    cfg.pollers = 2;
    cfg.rdma = transport();
    let svc = NodeService::start(cfg).unwrap();
    let addr = svc.local_addr().to_string();
    let cat = Catalog::open(&st.catalog).unwrap();
    let mut l = builder_remote(&st, &[&addr], 1 << 20).build().unwrap();
    assert_eq!(check(&mut l, &cat, 0, 1, 2), 600);
    drop(l);
    let st_ = svc.stats();
    assert_eq!(st_.connections.load(Ordering::Relaxed), 1);
    // The service counts a sample when its send completes, which can be
    // after the consumer has it: wait for the count (with a deadline)
    // instead of reading it once (that flaked under load).
    let t0 = Instant::now();
    while st_.samples.load(Ordering::Relaxed) < 600 && t0.elapsed() < Duration::from_secs(30) {
        std::thread::park_timeout(Duration::from_millis(10));
    }
    assert!(st_.samples.load(Ordering::Relaxed) >= 600);
    assert_eq!(st_.violations.load(Ordering::Relaxed), 0);
    // The consumer is gone: so is its queue pair (RDMA).
    let t0 = Instant::now();
    while st_.rdma_qps.load(Ordering::Relaxed) > 0 && t0.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(st_.rdma_qps.load(Ordering::Relaxed), 0);
    let t0 = Instant::now();
    svc.stop();
    assert!(t0.elapsed() < Duration::from_secs(2));
    // Stopped means closed: nobody listens any more.
    assert!(TcpStream::connect(&addr).is_err());
}

#[test]
fn read_command_in_cluster_mode_from_a_file_and_from_the_environment() {
    let st = setup("tiny", 300, 2, 1);
    let n0 = Serve::start(&st.spaces[0], &node_ip(0), &st.token, &[]);
    let n1 = Serve::start(&st.spaces[1], &node_ip(1), &st.token, &[]);
    let file = st.spaces[0].parent().unwrap().join("cluster.txt");
    std::fs::write(
        &file,
        format!("# two nodes\n0 {}\n1 {}\n", n0.addr, n1.addr),
    )
    .unwrap();
    let mut args = vec![
        "read",
        "--space",
        s(&st.spaces[0]),
        "--cluster",
        s(&file),
        "--token-file",
        s(&st.token),
        "--epochs",
        "2",
        "--verify",
        "--ring-bytes",
        "1MiB",
    ];
    if rdma_mode() {
        args.push("--rdma");
    }
    let out = ok(&args);
    assert!(out.contains("read 600 samples"), "{out}");
    let mode = if rdma_mode() { "RDMA" } else { "TCP" };
    assert!(out.contains(&format!("cluster ({mode})")), "{out}");
    let pushed: u64 = out
        .split(" samples pushed")
        .next()
        .and_then(|t| t.rsplit(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{out}"));
    assert!(pushed > 0, "{out}");
    // torchrun's variables plus KSPEED_NODES: rank 1 of 2 on node 1.
    let o = Command::new(kspeed_bin())
        .args([
            "read",
            "--progress=none",
            "--space",
            s(&st.spaces[1]),
            "--cluster-env",
        ])
        .args(["--token-file", s(&st.token), "--ring-bytes", "1MiB"])
        .args(if rdma_mode() { &["--rdma"][..] } else { &[] })
        .env("RANK", "1")
        .env("WORLD_SIZE", "2")
        .env("LOCAL_RANK", "0")
        .env("LOCAL_WORLD_SIZE", "1")
        .env("KSPEED_NODES", format!("{},{}", n0.addr, n1.addr))
        .output()
        .unwrap();
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    assert!(t.contains("read 150 samples"), "{t}");
    // Without a token file, a clear usage error.
    let e = fails(
        &["read", "--space", s(&st.spaces[0]), "--cluster", s(&file)],
        1,
    );
    assert!(e.contains("--token-file"), "{e}");
}

#[test]
fn rdma_without_a_device_is_a_named_error() {
    if std::path::Path::new("/dev/infiniband/uverbs0").exists() {
        eprintln!("skipping: this machine has an RDMA device");
        return;
    }
    let st = setup("tiny", 20, 1, 1);
    let want = if kspeed::transport::RDMA_BUILT {
        "no RDMA device"
    } else {
        "without the `rdma` feature"
    };
    // The node service refuses to start...
    let e = fails(
        &[
            "serve",
            "--space",
            s(&st.spaces[0]),
            "--listen",
            "127.0.0.1:0",
            "--token-file",
            s(&st.token),
            "--rdma",
        ],
        1,
    );
    assert!(e.contains(want), "{e}");
    // ...and so does a consumer asking for RDMA, before connecting anywhere.
    let n0 = Serve::start(&st.spaces[0], "127.0.0.1", &st.token, &[]);
    let mut cl = builder_remote(&st, &[&n0.addr], 1 << 20);
    cl = cl.rdma(Some(Default::default()));
    match cl.build() {
        Err(e) => assert!(e.to_string().contains(want), "{e}"),
        Ok(_) => panic!("an RDMA loader started without a device"),
    }
}

/// CPU seconds used so far by this process's threads named `name`.
fn thread_cpu_secs(name: &str) -> f64 {
    let tick = 100.0; // USER_HZ on Linux
    let mut total = 0.0;
    for t in std::fs::read_dir("/proc/self/task").unwrap().flatten() {
        let comm = std::fs::read_to_string(t.path().join("comm")).unwrap_or_default();
        if comm.trim() != name {
            continue;
        }
        let stat = std::fs::read_to_string(t.path().join("stat")).unwrap_or_default();
        // Fields after the ")" that ends the command: state is field 3,
        // utime 14 and stime 15.
        let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
        let f: Vec<&str> = rest.split_whitespace().collect();
        if f.len() > 13 {
            total += (f[11].parse::<f64>().unwrap() + f[12].parse::<f64>().unwrap()) / tick;
        }
    }
    total
}

/// Runs `f` on a thread and fails (instead of hanging the suite) if it has
/// not finished by `deadline`.
fn within<T: Send + 'static>(
    what: &str,
    deadline: Duration,
    f: impl FnOnce() -> T + Send + 'static,
) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    match rx.recv_timeout(deadline) {
        Ok(v) => v,
        Err(_) => panic!("{what} did not finish within {deadline:?}"),
    }
}

#[test]
fn cluster_mode_with_every_sample_local_idles_and_ends() {
    // Layouts where nothing is remote for the consumer on node 0: one node;
    // two nodes that each hold every sample (replicas = nodes).
    for (nodes, replicas) in [(1u32, 1u32), (2, 2)] {
        let st = setup("tiny", 300, nodes, replicas);
        let serves: Vec<Serve> = (0..nodes as usize)
            .map(|i| Serve::start(&st.spaces[i], &node_ip(i), &st.token, &[]))
            .collect();
        let addrs: Vec<String> = serves.iter().map(|s| s.addr.clone()).collect();
        let cat = Catalog::open(&st.catalog).unwrap();
        let space = st.spaces[0].clone();
        let (idle_cpu, n) = within(
            "a cluster loader with nothing remote",
            Duration::from_secs(120),
            move || {
                let a: Vec<&str> = addrs.iter().map(|s| s.as_str()).collect();
                let mut l = builder_space(&space, cluster_of(&a)).build().unwrap();
                let n = check(&mut l, &cat, 0, 1, 2);
                // Everything is delivered; the network thread has nothing to
                // do and must sleep, not walk the endless schedule.
                let c0 = thread_cpu_secs("kspeed-net");
                let t0 = Instant::now();
                while t0.elapsed() < Duration::from_secs(1) {
                    std::thread::park_timeout(Duration::from_millis(100));
                }
                let idle_cpu = thread_cpu_secs("kspeed-net") - c0;
                drop(l); // joins the network thread: hangs if it never looks up
                (idle_cpu, n)
            },
        );
        assert_eq!(n, 600, "nodes {nodes} replicas {replicas}");
        assert!(
            idle_cpu < 0.25,
            "nodes {nodes} replicas {replicas}: the idle network thread used {idle_cpu:.2} s of CPU in 1 s"
        );
        // The command line ends too (the README's one-node torchrun set-up).
        let file = st.spaces[0].parent().unwrap().join("cluster.txt");
        let list: String = serves
            .iter()
            .enumerate()
            .map(|(i, s)| format!("{i} {}\n", s.addr))
            .collect();
        std::fs::write(&file, list).unwrap();
        let mut child = Command::new(kspeed_bin())
            .args(["read", "--progress=none", "--space", s(&st.spaces[0])])
            .args(["--cluster", s(&file), "--token-file", s(&st.token)])
            .args(["--epochs", "2", "--ring-bytes", "1MiB"])
            .args(if rdma_mode() { &["--rdma"][..] } else { &[] })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let t0 = Instant::now();
        let status = loop {
            if let Some(st) = child.try_wait().unwrap() {
                break st;
            }
            if t0.elapsed() > Duration::from_secs(120) {
                let _ = child.kill();
                let _ = child.wait();
                panic!("kspeed read --cluster with every sample local never ended");
            }
            std::thread::park_timeout(Duration::from_millis(50));
        };
        let mut out = String::new();
        child
            .stdout
            .take()
            .unwrap()
            .read_to_string(&mut out)
            .unwrap();
        assert!(status.success(), "{out}");
        assert!(out.contains("read 600 samples"), "{out}");
    }
}

/// After a restart fails (the node now refuses the token), the loader
/// answers every call: the failing calls with the first error (its kind,
/// and its status through the C ABI), the rest (catalog, ring, tier,
/// statistics, position) as before; nothing panics.
#[test]
fn a_failed_restart_keeps_its_first_error_and_answers_every_call() {
    use kspeed_capi::*;
    let st = setup("tiny", 300, 1, 1);
    let node = Serve::start_on_free_port(&st.spaces[0], &node_ip(0), &st.token);
    let addr = node.addr.clone();
    let mut l = builder_remote(&st, &[&addr], 1 << 20).build().unwrap();
    assert_eq!(l.next_batch().unwrap().unwrap().len(), 16);
    // The same through the C ABI.
    let cluster_file = st.spaces[0].parent().unwrap().join("cluster.txt");
    std::fs::write(&cluster_file, format!("0 {addr}\n")).unwrap();
    let cstr = |x: &str| std::ffi::CString::new(x).unwrap();
    let mut c: *mut ksp_loader = std::ptr::null_mut();
    // SAFETY: the C ABI used as documented: live handles, NUL-terminated
    // strings, writable out-parameters.
    unsafe {
        let mut cfg = std::ptr::null_mut();
        assert_eq!(ksp_config_new(&mut cfg), ksp_status::KSP_OK);
        let mut pairs = vec![
            ("source", s(&st.src).to_string()),
            ("catalog", s(&st.catalog).to_string()),
            ("cluster_file", s(&cluster_file).to_string()),
            ("token", TOKEN.to_string()),
            ("batch_size", "16".into()),
            ("seed", "3".into()),
            ("ring_bytes", "1MiB".into()),
            ("pollers", "1".into()),
            ("pin", "false".into()),
        ];
        if rdma_mode() {
            pairs.push(("rdma", "true".into()));
        }
        for (k, v) in pairs {
            assert_eq!(
                ksp_config_set(cfg, cstr(k).as_ptr(), cstr(&v).as_ptr()),
                ksp_status::KSP_OK,
                "{k}"
            );
        }
        assert_eq!(ksp_loader_new(cfg, &mut c), ksp_status::KSP_OK);
        ksp_config_free(cfg);
        let mut b = ksp_batch::default();
        assert_eq!(ksp_loader_next_batch(c, &mut b), ksp_status::KSP_OK);
        assert_eq!(b.count, 16);
    }
    // The node comes back on the same address with another job's token.
    drop(node);
    let other = st.spaces[0].parent().unwrap().join("other-token");
    std::fs::write(&other, "another-job\n").unwrap();
    let _node = Serve::start(&st.spaces[0], &addr, &other, &[]);
    let e = l.set_epoch(4).unwrap_err();
    assert!(matches!(e, Error::Refused { .. }), "{e}");
    for _ in 0..2 {
        let again = l.next_batch().err().expect("the loader failed");
        assert!(matches!(again.root(), Error::Refused { .. }), "{again}");
        assert!(again.to_string().contains("refused"), "{again}");
        let e = l.set_epoch(5).unwrap_err();
        assert!(matches!(e.root(), Error::Refused { .. }), "{e}");
        let e = l.restore_position(&l.save_position()).unwrap_err();
        assert!(matches!(e.root(), Error::Refused { .. }), "{e}");
    }
    assert_eq!(l.catalog().len(), 300);
    assert_eq!(l.landing_info().bytes, 1 << 20);
    assert!(l.tier().is_none());
    assert_eq!(l.stats().samples, 16);
    assert_eq!(l.batch_size(), 16);
    let _ = l.position();
    drop(l);
    // SAFETY: as above.
    unsafe {
        let net = ksp_status::KSP_ERR_NETWORK;
        assert_eq!(ksp_loader_set_epoch(c, 4), net);
        let mut b = ksp_batch::default();
        assert_eq!(
            ksp_loader_next_batch(c, &mut b),
            net,
            "the first error's status, not KSP_ERR_STATE"
        );
        assert_eq!(ksp_loader_set_epoch(c, 5), net);
        let mut n = 0u64;
        assert_eq!(ksp_loader_catalog_len(c, &mut n), ksp_status::KSP_OK);
        assert_eq!(n, 300);
        let mut stats = ksp_stats::default();
        assert_eq!(ksp_loader_stats(c, &mut stats), ksp_status::KSP_OK);
        assert_eq!(stats.samples, 16);
        ksp_loader_free(c);
    }
}

/// The node list from the launcher, by name: SLURM's `SLURM_JOB_NODELIST`
/// (`gpu[01-02]` + `KSPEED_PORT`) and a Kubernetes headless-service pattern
/// (`kspeed-{i}.kspeed.ns.svc:7400`), with the names resolved through an
/// /etc/hosts of the test's own. The test runs itself again inside a fresh
/// network and mount namespace (`unshare -n -m`, root only) where it brings
/// up lo with 127.0.0.2 and .3 and bind-mounts its hosts file over
/// /etc/hosts; every node service listens on the same port 7400 of its own
/// address, as in a real cluster.
#[test]
fn launcher_node_lists_resolve_through_hosts_file() {
    const INNER: &str = "KSPEED_TEST_NETNS_MARKER";
    let name = "launcher_node_lists_resolve_through_hosts_file";
    let Some(marker) = std::env::var_os(INNER) else {
        // Outside: probe, then run this test again in the namespaces.
        let probe = Command::new("unshare")
            .args(["-n", "-m", "--", "sh", "-c"])
            .arg("ip link set lo up && mount --bind /etc/hostname /etc/hostname")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        if !probe.is_ok_and(|s| s.success()) {
            skip("unshare -n -m with ip and mount (root) is not available here");
            return;
        }
        let tmp = tempfile::tempdir().unwrap();
        let marker = tmp.path().join("ran");
        let out = Command::new("unshare")
            .args(["-n", "-m", "--"])
            .arg(std::env::current_exe().unwrap())
            .args(["--exact", name, "--nocapture", "--test-threads=1"])
            .env(INNER, &marker)
            .output()
            .unwrap();
        let t = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "inside the namespaces:\n{t}");
        // libtest exits 0 when the filter matches nothing: the inner run
        // leaves its mark after its last check.
        assert_eq!(
            std::fs::read_to_string(&marker).ok().as_deref(),
            Some("done"),
            "the test did not run inside the namespaces:\n{t}"
        );
        return;
    };
    // Inside: the namespaces are ours alone.
    let sh = |cmd: &str| {
        let o = Command::new("sh").args(["-c", cmd]).output().unwrap();
        assert!(o.status.success(), "{cmd}: {}", text(&o));
    };
    sh("ip link set lo up && ip addr add 127.0.0.2/8 dev lo && ip addr add 127.0.0.3/8 dev lo");
    let st = setup("tiny", 300, 2, 1);
    let hosts = st.spaces[0].parent().unwrap().join("hosts");
    std::fs::write(
        &hosts,
        "127.0.0.1 localhost\n\
         127.0.0.2 gpu01 kspeed-0.kspeed.ns.svc\n\
         127.0.0.3 gpu02 kspeed-1.kspeed.ns.svc\n",
    )
    .unwrap();
    sh(&format!("mount --bind {} /etc/hosts", s(&hosts)));
    // The services listen by name too (resolved through the same file).
    let serves: Vec<Serve> = (0..2)
        .map(|i| {
            Serve::start(
                &st.spaces[i],
                &format!("gpu0{}:7400", i + 1),
                &st.token,
                &[],
            )
        })
        .collect();
    assert_eq!(serves[0].addr, "127.0.0.2:7400");
    assert_eq!(serves[1].addr, "127.0.0.3:7400");
    let cat = Catalog::open(&st.catalog).unwrap();

    // SLURM (plain srun, one task per node): each rank reads its whole
    // sequence, every sample pushed by a node (none from the source).
    for rank in 0..2u32 {
        let env = [
            ("SLURM_PROCID", rank.to_string()),
            ("SLURM_NTASKS", "2".into()),
            ("SLURM_NODEID", rank.to_string()),
            ("SLURM_JOB_NODELIST", "gpu[01-02]".into()),
            ("KSPEED_PORT", "7400".into()),
        ];
        let (cluster, launch) =
            Cluster::from_vars(|k| env.iter().find(|(n, _)| *n == k).map(|(_, v)| v.clone()))
                .unwrap();
        assert_eq!(cluster.nodes[1].addr, "gpu02:7400");
        assert_eq!((launch.rank, launch.world, launch.node), (rank, 2, rank));
        let mut l = builder_remote(&st, &["unused:1"], 1 << 20)
            .cluster(cluster)
            .rank(rank, 2)
            .build()
            .unwrap();
        assert_eq!(check(&mut l, &cat, rank, 2, 2), 300, "rank {rank}");
        assert_eq!(l.stats().source_reads, 0);
    }

    // Kubernetes: the CLI with --nodes-dns / --nodes, and the same through
    // the environment (KSPEED_NODES_DNS, count from WORLD_SIZE).
    let read = |extra: &[&str], env: &[(&str, &str)]| {
        let o = Command::new(kspeed_bin())
            .args(["read", "--progress=none", "--source", s(&st.src)])
            .args(["--catalog", s(&st.catalog), "--seed", "3", "--verify"])
            .args([
                "--token-file",
                s(&st.token),
                "--ring-bytes",
                "1MiB",
                "--no-pin",
            ])
            .args(extra)
            .envs(env.iter().copied())
            .output()
            .unwrap();
        let t = text(&o);
        assert!(o.status.success(), "{t}");
        t
    };
    let t = read(
        &[
            "--nodes-dns",
            "kspeed-{i}.kspeed.ns.svc:7400",
            "--nodes",
            "2",
        ],
        &[],
    );
    assert!(
        t.contains("read 300 samples") && t.contains("cluster (TCP)"),
        "{t}"
    );
    assert!(t.contains(" 0 failed over, 0 read from the source"), "{t}");
    let t = read(
        &["--cluster-env"],
        &[
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("KSPEED_NODES_DNS", "kspeed-{i}.kspeed.ns.svc"),
            ("KSPEED_PORT", "7400"),
        ],
    );
    assert!(t.contains("read 150 samples"), "{t}");
    // A hostlist naming more nodes than the space was placed over, and
    // one that breaks the grammar: named errors, exit status 1.
    let fail = |extra: &[&str]| {
        let o = Command::new(kspeed_bin())
            .args(["read", "--progress=none", "--source", s(&st.src)])
            .args(["--catalog", s(&st.catalog), "--token-file", s(&st.token)])
            .args(extra)
            .output()
            .unwrap();
        assert_eq!(o.status.code(), Some(1), "{}", text(&o));
        text(&o)
    };
    let t = fail(&["--nodelist", "gpu[01-03]", "--node-port", "7400"]);
    assert!(t.contains("the cluster lists 3 nodes"), "{t}");
    let t = fail(&["--nodelist", "gpu[01-02"]);
    assert!(
        t.contains("hostlist \"gpu[01-02\" at byte 3: `[` is never closed"),
        "{t}"
    );
    std::fs::write(marker, "done").unwrap();
}

/// The C ABI's cluster keys: a SLURM hostlist with `cluster_port`, a name
/// pattern with `cluster_node_count`, and `cluster_env` (rank and world
/// from the launcher's variables) reach real node services; bad values are
/// `KSP_ERR_INVALID_ARG` at `ksp_loader_new` with the named error.
#[test]
fn capi_cluster_keys_from_hostlist_pattern_and_environment() {
    use kspeed_capi::*;
    let st = setup("tiny", 300, 2, 1);
    let cat = Catalog::open(&st.catalog).unwrap();
    // Both services on one port of their own addresses, as in a cluster.
    let n0 = Serve::start_on_free_port(&st.spaces[0], &node_ip(0), &st.token);
    let port = n0.addr.rsplit(':').next().unwrap().to_string();
    let _n1 = Serve::start(
        &st.spaces[1],
        &format!("{}:{port}", node_ip(1)),
        &st.token,
        &[],
    );
    let prefix = node_ip(0).rsplit_once('.').unwrap().0.to_string();
    let cstr = |x: &str| std::ffi::CString::new(x).unwrap();
    // Builds a loader from `keys`, drains one epoch and returns the ids, or
    // the failing status and message.
    let run = |keys: &[(&str, String)]| -> Result<Vec<u64>, (ksp_status, String)> {
        // SAFETY: the C ABI used as documented: live handles,
        // NUL-terminated strings, writable out-parameters.
        unsafe {
            let mut cfg = std::ptr::null_mut();
            assert_eq!(ksp_config_new(&mut cfg), ksp_status::KSP_OK);
            let mut pairs = vec![
                ("source", s(&st.src).to_string()),
                ("catalog", s(&st.catalog).to_string()),
                ("token", TOKEN.to_string()),
                ("batch_size", "16".into()),
                ("seed", "3".into()),
                ("ring_bytes", "1MiB".into()),
                ("pollers", "1".into()),
                ("pin", "false".into()),
            ];
            if rdma_mode() {
                pairs.push(("rdma", "true".into()));
            }
            pairs.extend(keys.iter().map(|(k, v)| (*k, v.clone())));
            for (k, v) in pairs {
                assert_eq!(
                    ksp_config_set(cfg, cstr(k).as_ptr(), cstr(&v).as_ptr()),
                    ksp_status::KSP_OK,
                    "{k}"
                );
            }
            let mut l: *mut ksp_loader = std::ptr::null_mut();
            let st_new = ksp_loader_new(cfg, &mut l);
            ksp_config_free(cfg);
            if st_new != ksp_status::KSP_OK {
                let mut buf = vec![0 as std::ffi::c_char; 1024];
                let mut len = 0usize;
                ksp_last_error(buf.as_mut_ptr(), buf.len(), &mut len);
                let msg = std::ffi::CStr::from_ptr(buf.as_ptr())
                    .to_string_lossy()
                    .into_owned();
                return Err((st_new, msg));
            }
            let mut ids = Vec::new();
            loop {
                let mut b = ksp_batch::default();
                assert_eq!(ksp_loader_next_batch(l, &mut b), ksp_status::KSP_OK);
                if b.count == 0 {
                    break;
                }
                for smp in std::slice::from_raw_parts(b.samples, b.count) {
                    let bytes = std::slice::from_raw_parts(smp.data, smp.len);
                    assert_eq!(crc32c::crc32c(bytes), cat.sample(smp.id).crc32c);
                    ids.push(smp.id);
                }
                ksp_loader_release_batch(l, b.seq);
            }
            ksp_loader_free(l);
            Ok(ids)
        }
    };
    let order = |rank: u32, world: u32| -> Vec<u64> {
        let sm = Sampler::new(
            SamplerConfig::single(300, 3)
                .rank_world(rank, world)
                .shuffle(true)
                .drop_last(false),
        )
        .unwrap();
        (0..sm.per_rank()).map(|k| sm.sample(0, k)).collect()
    };
    let ids = run(&[
        ("cluster_nodelist", format!("{prefix}.[1-2]")),
        ("cluster_port", port.clone()),
    ])
    .unwrap();
    assert_eq!(ids, order(0, 1));
    // A pattern: 127.0.0.10 and .11 serve nothing, so the loader (reading
    // a source, no local space) reads every sample from its source.
    let ids = run(&[
        ("cluster_nodes_dns", format!("{prefix}.1{{i}}")),
        ("cluster_port", port.clone()),
        ("cluster_node_count", "2".into()),
    ])
    .unwrap();
    assert_eq!(ids, order(0, 1));
    // The environment gives rank and world (and, with no explicit list,
    // the nodes); the explicit list wins over KSPEED_NODES. (The C ABI
    // reads the process's environment: nextest runs each test in its own
    // process, the VM script with one thread; children spawned meanwhile
    // by other tests pass --cluster-env only with these set explicitly.)
    std::env::set_var("RANK", "1");
    std::env::set_var("WORLD_SIZE", "2");
    std::env::set_var("LOCAL_RANK", "0");
    std::env::set_var("LOCAL_WORLD_SIZE", "1");
    std::env::set_var("KSPEED_NODES", "nowhere.invalid:1,nowhere.invalid:2");
    let ids = run(&[
        ("cluster_env", "true".into()),
        (
            "cluster_nodes",
            format!("{prefix}.1:{port},{prefix}.2:{port}"),
        ),
    ])
    .unwrap();
    assert_eq!(ids, order(1, 2));
    std::env::set_var(
        "KSPEED_NODES",
        format!("{prefix}.1:{port},{prefix}.2:{port}"),
    );
    assert_eq!(run(&[("cluster_env", "true".into())]).unwrap(), order(1, 2));
    for k in [
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "KSPEED_NODES",
    ] {
        std::env::remove_var(k);
    }
    // Bad values: named errors at ksp_loader_new.
    let (code, msg) = run(&[("cluster_nodelist", "gpu[1-".into())]).unwrap_err();
    assert_eq!(code, ksp_status::KSP_ERR_INVALID_ARG);
    assert!(msg.contains("hostlist \"gpu[1-\" at byte 3"), "{msg}");
    let (code, msg) = run(&[("cluster_nodes_dns", "k-{i}:1".into())]).unwrap_err();
    assert_eq!(code, ksp_status::KSP_ERR_INVALID_ARG);
    assert!(msg.contains("needs a node count"), "{msg}");
}

// --- admission, retry and rate limits (docs/PROTOCOL.md) -----------------

/// Reads one frame with a deadline of 20 s (per read).
fn frame_within(c: &mut TcpStream) -> (Header, Vec<u8>) {
    c.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    read_frame(c).expect("a frame within 20 s")
}

#[test]
fn a_burst_of_handshakes_is_served_to_the_limit_and_refused_only_at_hello() {
    let st = setup("tiny", 100, 1, 1);
    // One poller (as every test node), room for 200 consumers.
    let node = Serve::start(
        &st.spaces[0],
        &node_ip(0),
        &st.token,
        &["--max-consumers-per-poller", "200"],
    );
    let cat = Catalog::open(&st.catalog).unwrap();
    let hello = hello_frame(&cat, proto::VERSION, TOKEN.as_bytes(), 1 << 20);
    // 250 handshakes back to back: each connects and sends its HELLO
    // before any answer is read.
    let mut socks = Vec::new();
    for _ in 0..250 {
        let mut c = TcpStream::connect(&node.addr).unwrap();
        c.write_all(&hello).unwrap();
        socks.push(c);
    }
    let (id, s) = (0..cat.len())
        .map(|i| (i, cat.sample(i)))
        .find(|(_, s)| s.len > 0)
        .unwrap();
    let (mut served, mut full) = (0, 0);
    let mut kept = Vec::new();
    for (k, mut c) in socks.into_iter().enumerate() {
        let (h, body) = frame_within(&mut c);
        match h.kind {
            Kind::Welcome => {
                // Welcomed means served: a grant gets its bytes, never a
                // refusal after WELCOME.
                let mut f = Header::grant(1).encode().to_vec();
                let mut e = [0u8; proto::GRANT_ENTRY_BYTES];
                GrantEntry {
                    grant: 7,
                    len: s.len,
                    sample: id,
                    offset: 0,
                    rkey: 0,
                }
                .encode_into(&mut e);
                f.extend_from_slice(&e);
                c.write_all(&f).unwrap();
                let mut got = 0u64;
                while got < s.len as u64 {
                    let (h, body) = frame_within(&mut c);
                    assert_eq!(
                        h.kind,
                        Kind::Data,
                        "handshake {k}: {:?} {} after WELCOME ({served} served before it)",
                        Code::from_u32(h.b),
                        String::from_utf8_lossy(&body)
                    );
                    got += body.len() as u64;
                }
                served += 1;
                kept.push(c); // stays connected: it holds its place
            }
            Kind::Error => {
                let msg = String::from_utf8_lossy(&body);
                assert_eq!(Code::from_u32(h.b), Code::NodeFull, "handshake {k}: {msg}");
                assert!(msg.contains("max-consumers-per-poller"), "{msg}");
                full += 1;
            }
            other => panic!("handshake {k}: {other:?} in answer to HELLO"),
        }
    }
    assert_eq!((served, full), (200, 50));
}

#[test]
fn wrong_tokens_from_an_address_do_not_lock_out_a_real_consumer_there() {
    let st = setup("tiny", 200, 1, 1);
    let node = Serve::start(&st.spaces[0], &node_ip(0), &st.token, &[]);
    let cat = Catalog::open(&st.catalog).unwrap();
    let bad = hello_frame(&cat, proto::VERSION, b"a-stale-launcher", 1 << 20);
    // A burst of wrong tokens from the address the real consumer uses
    // (more than the 16 a window answers at once), all in flight together.
    let mut socks = Vec::new();
    for _ in 0..40 {
        let mut c = TcpStream::connect(&node.addr).unwrap();
        c.write_all(&bad).unwrap();
        socks.push(c);
    }
    // Every one is answered with an ERROR naming the reason (the old code
    // closed them unread past the 16th).
    let mut late = 0;
    for (k, mut c) in socks.into_iter().enumerate() {
        c.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        let (h, body) = read_frame(&mut c)
            .unwrap_or_else(|e| panic!("wrong token {k}: closed without an ERROR ({e})"));
        let msg = String::from_utf8_lossy(&body);
        assert_eq!(h.kind, Kind::Error, "wrong token {k}");
        let code = Code::from_u32(h.b);
        assert!(
            matches!(code, Code::BadToken | Code::RateLimited),
            "wrong token {k}: {code:?} {msg}"
        );
        late += msg.contains("answered late") as u32;
    }
    assert!(late > 0, "no wrong token was throttled");
    // Right after, within the same window, a real loader at that address
    // gets in and reads everything from the node.
    let mut l = builder_remote(&st, &[&node.addr], 1 << 20).build().unwrap();
    assert_eq!(check(&mut l, &cat, 0, 1, 1), 200);
    let stats = l.stats();
    assert_eq!(stats.source_reads, 0, "{stats:?}");
}

#[test]
fn hello_with_impossible_fields_is_refused_naming_the_field() {
    let st = setup("tiny", 50, 1, 1);
    let node = Serve::start(&st.spaces[0], &node_ip(0), &st.token, &[]);
    let cat = Catalog::open(&st.catalog).unwrap();
    let base = fake_peers::hello_fields(&cat, 1 << 20);
    let cases: [(Hello, &str); 4] = [
        (Hello { world: 0, ..base }, "field world is 0"),
        (
            Hello {
                rank: 2,
                world: 2,
                ..base
            },
            "field rank is 2",
        ),
        (
            Hello {
                ring_len: 0,
                ..base
            },
            "field ring_len is 0",
        ),
        (
            Hello {
                transport: 7,
                ..base
            },
            "field transport is 7",
        ),
    ];
    for (hello, what) in cases {
        let mut f = Vec::new();
        hello.encode(TOKEN.as_bytes(), &mut f);
        let mut c = TcpStream::connect(&node.addr).unwrap();
        c.write_all(&f).unwrap();
        let (h, body) = frame_within(&mut c);
        let msg = String::from_utf8_lossy(&body);
        assert_eq!(h.kind, Kind::Error, "{what}: welcomed");
        assert_eq!(Code::from_u32(h.b), Code::Violation, "{what}: {msg}");
        assert!(msg.contains(what), "{what}: {msg}");
    }
}

#[test]
fn all_nodes_silent_at_start_time_out_and_a_source_serves_everything() {
    let st = setup("tiny", 100, 2, 1);
    // Two nodes whose kernel accepts connections (the backlog) and that
    // never answer a HELLO: stopped processes.
    let silent: Vec<TcpListener> = (0..2)
        .map(|i| TcpListener::bind(format!("{}:0", node_ip(i))).unwrap())
        .collect();
    let addrs: Vec<String> = silent
        .iter()
        .map(|l| l.local_addr().unwrap().to_string())
        .collect();
    let cat = Catalog::open(&st.catalog).unwrap();
    // The loader reads the source it was given instead of failing its build.
    let mut l = builder_remote(&st, &[&addrs[0], &addrs[1]], 1 << 20)
        .node_timeout(Duration::from_secs(1))
        .build()
        .unwrap();
    assert_eq!(check(&mut l, &cat, 0, 1, 1), 100);
    let stats = l.stats();
    assert!(
        stats.source_reads >= 100 && stats.remote_samples == 0,
        "{stats:?}"
    );
    drop(l);
    // `kspeed read` says the nodes timed out, once each.
    let file = st._tmp.path().join("cluster.txt");
    std::fs::write(&file, format!("0 {}\n1 {}\n", addrs[0], addrs[1])).unwrap();
    let (code, out) = run_for(
        &[
            "read",
            "--progress=none",
            "--source",
            s(&st.src),
            "--catalog",
            s(&st.catalog),
            "--cluster",
            s(&file),
            "--token-file",
            s(&st.token),
            "--node-timeout-ms",
            "1000",
            "--ring-bytes",
            "1MiB",
        ],
        Duration::from_secs(60),
    );
    assert_eq!(code, Some(0), "{out}");
    assert!(out.contains("read 100 samples"), "{out}");
    assert_eq!(
        out.matches("is unreachable: no answer to HELLO: timed out after")
            .count(),
        2,
        "{out}"
    );
    assert!(!out.contains("temporarily unavailable"), "{out}");
    drop(silent);
}

#[cfg(feature = "test-panic")]
#[test]
fn a_poller_that_panics_fails_the_service_with_a_named_error() {
    let st = setup("tiny", 50, 1, 1);
    let log = st._tmp.path().join("node.log");
    let mut child = Command::new(kspeed_bin())
        .args(["serve", "--space", s(&st.spaces[0]), "--listen"])
        .arg(format!("{}:0", node_ip(0)))
        .args(["--token-file", s(&st.token), "--pollers", "1"])
        .env("KSPEED_TEST_POLLER_PANIC", "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::from(std::fs::File::create(&log).unwrap()))
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    let addr = line.trim().rsplit(' ').next().unwrap().to_string();
    assert!(line.starts_with("serving"), "{line}");
    // A consumer is welcomed, then its poller panics on taking it.
    let cat = Catalog::open(&st.catalog).unwrap();
    let mut c = TcpStream::connect(&addr).unwrap();
    c.write_all(&hello_frame(
        &cat,
        proto::VERSION,
        TOKEN.as_bytes(),
        1 << 20,
    ))
    .unwrap();
    assert_eq!(frame_within(&mut c).0.kind, Kind::Welcome);
    // The service stops by itself, with an error naming the poller.
    let t0 = Instant::now();
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        if t0.elapsed() > Duration::from_secs(30) {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "kspeed serve still runs 30 s after its poller panicked:\n{}",
                std::fs::read_to_string(&log).unwrap()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let err = std::fs::read_to_string(&log).unwrap();
    assert!(!status.success(), "{err}");
    assert!(
        err.contains("the node service failed: poller 0 panicked"),
        "{err}"
    );
    // The consumer's connection is closed, not left hanging.
    c.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let mut sink = Vec::new();
    let _ = c.read_to_end(&mut sink);
}

/// Transient read failures on the node (EAGAIN, EINTR, short reads, here
/// injected: 60 of them) are retried there: no ERROR, no failover, no read
/// from the source, every byte exact, and the retries counted.
#[cfg(feature = "test-panic")]
#[test]
fn transient_read_failures_on_a_node_are_retried_not_failed_over() {
    let st = setup("tiny", 300, 1, 1);
    let node = Serve::launch_env(
        &st.spaces[0],
        &node_ip(0),
        &st.token,
        &["--metrics", &format!("{}:0", node_ip(0))],
        None,
        None,
        &[("KSPEED_TEST_SERVE_READ_FAULTS", "60")],
    );
    let maddr = node
        .before
        .iter()
        .find_map(|l| l.strip_prefix("metrics on http://"))
        .and_then(|l| l.strip_suffix("/metrics"))
        .unwrap_or_else(|| panic!("no metrics line: {:?}", node.before))
        .to_string();
    let cat = Catalog::open(&st.catalog).unwrap();
    let mut l = builder_remote(&st, &[&node.addr], 1 << 20).build().unwrap();
    assert_eq!(check(&mut l, &cat, 0, 1, 2), 600);
    let stats = l.finish();
    assert_eq!(stats.failovers, 0, "{stats:?}");
    assert_eq!(stats.source_reads, 0, "{stats:?}");
    let (_, text) = http_get(&maddr, "/metrics");
    assert_eq!(
        metric(&text, "kspeed_serve_errors_total "),
        Some(0.0),
        "{text}"
    );
    assert_eq!(
        metric(&text, "kspeed_serve_read_retries_total "),
        Some(60.0),
        "{text}"
    );
}

/// A stand-in in front of node `to`: its first connections are answered at
/// HELLO with the ERROR codes `refusals` (one each, in order), the later
/// ones are forwarded to the node byte for byte. Returns its address and a
/// count of the connections it took.
fn refusing_proxy(
    to: String,
    refusals: Vec<Code>,
) -> (String, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let l = TcpListener::bind(format!("{}:0", node_ip(0))).unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let taken = std::sync::Arc::new(AtomicUsize::new(0));
    let count = taken.clone();
    std::thread::spawn(move || {
        for c in l.incoming() {
            let Ok(mut c) = c else { return };
            let k = count.fetch_add(1, Ordering::Relaxed);
            if let Some(&code) = refusals.get(k) {
                let _ = read_frame(&mut c);
                let msg = format!("try {k}: {}", code.name());
                let mut f = Header::error(proto::CONNECTION, code, msg.len() as u32)
                    .encode()
                    .to_vec();
                f.extend_from_slice(msg.as_bytes());
                let _ = c.write_all(&f);
                continue;
            }
            let Ok(n) = TcpStream::connect(&to) else {
                return;
            };
            let (mut c2, mut n2) = (c.try_clone().unwrap(), n.try_clone().unwrap());
            std::thread::spawn(move || {
                let _ = std::io::copy(&mut c2, &mut n2);
                let _ = n2.shutdown(std::net::Shutdown::Write);
            });
            std::thread::spawn(move || {
                let (mut n, mut c) = (n, c);
                let _ = std::io::copy(&mut n, &mut c);
                let _ = c.shutdown(std::net::Shutdown::Write);
            });
        }
    });
    (addr, taken)
}

#[test]
fn a_node_that_answers_busy_rate_limited_or_full_is_tried_again() {
    use std::sync::atomic::Ordering;
    let st = setup("tiny", 200, 1, 1);
    let node = Serve::start(&st.spaces[0], &node_ip(0), &st.token, &[]);
    let cat = Catalog::open(&st.catalog).unwrap();
    let (proxy, taken) = refusing_proxy(
        node.addr.clone(),
        vec![Code::Busy, Code::RateLimited, Code::NodeFull],
    );
    // TCP only: the stand-in forwards the control connection.
    let mut l = builder_remote(&st, &[&proxy], 1 << 20)
        .rdma(None)
        .node_timeout(Duration::from_secs(20))
        .build()
        .unwrap();
    assert_eq!(taken.load(Ordering::Relaxed), 4, "three refusals, then in");
    assert_eq!(check(&mut l, &cat, 0, 1, 1), 200);
    assert_eq!(l.stats().source_reads, 0, "{:?}", l.stats());
    drop(l);
    // Refused for longer than the node timeout: a busy node is dead from
    // the start (its samples come from the source), a full one is a named
    // error.
    let (proxy, _) = refusing_proxy(node.addr.clone(), vec![Code::Busy; 1000]);
    let mut l = builder_remote(&st, &[&proxy], 1 << 20)
        .rdma(None)
        .node_timeout(Duration::from_millis(500))
        .build()
        .unwrap();
    assert_eq!(check(&mut l, &cat, 0, 1, 1), 200);
    assert!(l.stats().source_reads >= 200, "{:?}", l.stats());
    drop(l);
    let (proxy, _) = refusing_proxy(node.addr.clone(), vec![Code::NodeFull; 1000]);
    let e = builder_remote(&st, &[&proxy], 1 << 20)
        .rdma(None)
        .node_timeout(Duration::from_millis(500))
        .build()
        .err()
        .expect("refused");
    assert!(
        matches!(&e, Error::Refused { code, .. } if *code == "node full"),
        "{e}"
    );
    assert!(e.to_string().contains("tries over"), "{e}");
}

#[test]
fn hostile_wrong_tokens_and_a_full_handshake_table_rate_limit_then_admit() {
    let st = setup("tiny", 200, 1, 1);
    let node = Serve::start(
        &st.spaces[0],
        "127.0.0.1",
        &st.token,
        &["--max-handshakes", "2", "--handshake-timeout-ms", "3000"],
    );
    let cat = Catalog::open(&st.catalog).unwrap();
    let bad = hello_frame(&cat, proto::VERSION, b"a-stale-launcher", 1 << 20);
    // 127.0.0.1 reaches the wrong-token limit (each answered at once)...
    for k in 0..16 {
        let mut c = TcpStream::connect(&node.addr).unwrap();
        c.write_all(&bad).unwrap();
        let (h, body) = frame_within(&mut c);
        assert_eq!(
            (h.kind, Code::from_u32(h.b)),
            (Kind::Error, Code::BadToken),
            "wrong token {k}: {}",
            String::from_utf8_lossy(&body)
        );
    }
    // ...and two silent peers elsewhere fill the handshake table.
    let silent: Vec<TcpStream> = (0..2)
        .map(|_| connect_from([127, 0, 0, 20], &node.addr).unwrap())
        .collect();
    // A connection from 127.0.0.1 then displaces nobody: it is told why,
    // unread (the old code closed it without a word).
    let mut c = TcpStream::connect(&node.addr).unwrap();
    c.write_all(&hello_frame(
        &cat,
        proto::VERSION,
        TOKEN.as_bytes(),
        1 << 20,
    ))
    .unwrap();
    let (h, body) = frame_within(&mut c);
    let msg = String::from_utf8_lossy(&body);
    assert_eq!(
        (h.kind, Code::from_u32(h.b)),
        (Kind::Error, Code::RateLimited),
        "{msg}"
    );
    assert!(
        msg.contains("wrong tokens") && msg.contains("retry"),
        "{msg}"
    );
    // A real loader there retries until the silent peers' deadline frees
    // room, and reads everything from the node.
    let mut l = builder_remote(&st, &[&node.addr], 1 << 20)
        .node_timeout(Duration::from_secs(20))
        .build()
        .unwrap();
    assert_eq!(check(&mut l, &cat, 0, 1, 1), 200);
    assert_eq!(l.stats().source_reads, 0, "{:?}", l.stats());
    drop(silent);
}

// --- failure detection, read-ahead and failing extents (issue 26) --------

/// `kspeed serve -v` for space `space` inside namespace `ns`, on
/// 10.77.`i`.2, logging to `log`.
fn serve_in_netns(ns: &Netns, i: usize, space: &Path, token: &Path, log: &Path) -> Serve {
    let mut child = Command::new("ip")
        .args(["netns", "exec", &ns.names[i], kspeed_bin(), "serve"])
        .arg("--space")
        .arg(space)
        .args(["--listen", &format!("10.77.{i}.2:0"), "--token-file"])
        .arg(token)
        .args(["--pollers", "1", "-v"])
        .stdout(Stdio::piped())
        .stderr(Stdio::from(std::fs::File::create(log).unwrap()))
        .spawn()
        .unwrap();
    let out = child.stdout.take().unwrap();
    // Killed on drop from here on, whatever fails next.
    let mut serve = Serve {
        child,
        addr: String::new(),
        before: Vec::new(),
    };
    let line = within("serve's first line", Duration::from_secs(60), move || {
        let mut line = String::new();
        BufReader::new(out).read_line(&mut line).unwrap();
        line
    });
    serve.addr = line.trim().rsplit(' ').next().unwrap().to_string();
    assert!(serve.addr.starts_with(&format!("10.77.{i}.2:")), "{line}");
    // Reachable from here before a consumer counts on it (a fresh veth
    // pair can drop the first packets).
    let sa: std::net::SocketAddr = serve.addr.parse().unwrap();
    let t0 = Instant::now();
    while TcpStream::connect_timeout(&sa, Duration::from_secs(1)).is_err() {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "{} unreachable (another 10.77.{i}.0/24 route on this host?)",
            serve.addr
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    serve
}

/// An owner whose host dies (its network cut, then the process killed
/// with SIGKILL, so no FIN or RST ever reaches the consumer) is found dead
/// by its missing heartbeats: the consumer fails over to the replica and
/// finishes two epochs long before its 60 s `node_timeout`, which is all
/// that found it before heartbeats (the old code stalls 60 s here).
#[test]
fn dead_owner_host_is_found_by_its_missing_heartbeats() {
    if !is_root() || Command::new("ip").arg("-V").output().is_err() {
        skip("needs root and iproute2 to create network namespaces");
        return;
    }
    let st = setup("imagenet", 480, 2, 2);
    let Some(ns) = Netns::create(2) else {
        return;
    };
    let logs: Vec<PathBuf> = (0..2)
        .map(|i| st._tmp.path().join(format!("node{i}.log")))
        .collect();
    let serves: Vec<Serve> = (0..2)
        .map(|i| serve_in_netns(&ns, i, &st.spaces[i], &st.token, &logs[i]))
        .collect();
    let addrs: Vec<String> = serves.iter().map(|s| s.addr.clone()).collect();
    let victim = serves[1].child.id();
    let (src, catalog) = (st.src.clone(), st.catalog.clone());
    let cat = Catalog::open(&st.catalog).unwrap();
    let (killed_tx, killed_rx) = std::sync::mpsc::channel::<()>();
    let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
    // The reader: a batch, then it waits for the kill, then the rest.
    let reader = std::thread::spawn(move || {
        let a: Vec<&str> = addrs.iter().map(|s| s.as_str()).collect();
        let mut l = LoaderBuilder::source(s(&src))
            .catalog(&catalog)
            .cluster(cluster_of(&a))
            .token(TOKEN.as_bytes())
            .seed(3)
            .batch_size(4)
            .pollers(1)
            .pin(false)
            .node_timeout(Duration::from_secs(60))
            .landing(test_ring(3 << 20))
            .build()
            .unwrap();
        let sampler = Sampler::new(
            SamplerConfig::single(cat.len(), 3)
                .rank_world(0, 1)
                .shuffle(true)
                .drop_last(false),
        )
        .unwrap();
        let mut k = 0u64;
        let mut killed_at: Option<Instant> = None;
        // The longest wait for a batch after the kill: the trainer's stall.
        let mut stall = Duration::ZERO;
        for e in 0..2 {
            l.set_epoch(e).unwrap();
            loop {
                let t = Instant::now();
                let Some(b) = l.next_batch().unwrap() else {
                    break;
                };
                if killed_at.is_some() {
                    stall = stall.max(t.elapsed());
                }
                for smp in b.iter() {
                    assert_eq!(smp.id, sampler.sample(e, k % 480));
                    assert_eq!(crc32c::crc32c(smp.bytes), cat.sample(smp.id).crc32c);
                    k += 1;
                }
                drop(b);
                if killed_at.is_none() {
                    killed_tx.send(()).unwrap();
                    // The test thread answers once the owner is dead.
                    go_rx.recv().unwrap();
                    killed_at = Some(Instant::now());
                }
            }
        }
        let took = killed_at.unwrap().elapsed();
        (k, l.finish(), stall, took)
    });
    killed_rx
        .recv_timeout(Duration::from_secs(120))
        .expect("the first batch");
    // The consumer is being served by the node about to die.
    let t0 = Instant::now();
    while log_lines(&logs[1], "connected") == 0 {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "node 1 has no consumer: {}",
            std::fs::read_to_string(&logs[1]).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    ns.cut(1);
    Command::new("kill")
        .args(["-KILL", &victim.to_string()])
        .status()
        .unwrap();
    go_tx.send(()).unwrap();
    // The deadline the old code (60 s node timeout) cannot meet.
    let t0 = Instant::now();
    while !reader.is_finished() {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "two epochs not done 30 s after the owner's host died (node_timeout 60 s)"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let (k, stats, stall, took) = reader.join().unwrap();
    eprintln!("owner killed: longest wait for a batch {stall:?}; the rest of both epochs {took:?}");
    assert_eq!(k, 960);
    assert_eq!(stats.source_reads, 0, "{stats:?}");
    drop(serves);
}

/// With the job's last epoch known (`end_epoch`, `kspeed read --epochs`)
/// the pollers and the network thread stop at its last sample: with a ring
/// that holds several epochs, every count is exactly what was delivered,
/// nothing read ahead is thrown away, and going past the end is a named
/// error instead of a wait that never ends.
#[test]
fn read_ahead_stops_at_the_last_epoch_with_exact_counts() {
    let st = setup("tiny", 600, 2, 1);
    let n0 = Serve::start(&st.spaces[0], &node_ip(0), &st.token, &[]);
    let n1 = Serve::start(&st.spaces[1], &node_ip(1), &st.token, &[]);
    let cat = Catalog::open(&st.catalog).unwrap();
    // Rank 0 on node 0: its half local, the other half from node 1. The
    // 16 MiB ring holds about six epochs of these samples.
    let mut l = builder_space(&st.spaces[0], cluster_of(&[&n0.addr, &n1.addr]))
        .landing(test_ring(16 << 20))
        .end_epoch(Some(3))
        .build()
        .unwrap();
    assert_eq!(check(&mut l, &cat, 0, 1, 3), 1800);
    match l.set_epoch(3) {
        Err(Error::InvalidConfig(m)) => {
            assert!(m.contains("past the loader's last epoch 2"), "{m}")
        }
        other => panic!("set_epoch past the end: {other:?}"),
    }
    let stats = l.finish();
    assert!(
        stats.disk_reads > 0 && stats.remote_samples > 0,
        "{stats:?}"
    );
    assert_eq!(stats.disk_reads + stats.remote_samples, 1800, "{stats:?}");
    assert_eq!(stats.source_reads, 0, "{stats:?}");
    assert_eq!(
        stats.read_ahead + stats.read_ahead_discarded,
        0,
        "{stats:?}"
    );

    // Nothing local and node 1 gone from the start: its samples come from
    // the source, each exactly once.
    drop(n1);
    let gone = TcpListener::bind(format!("{}:0", node_ip(1))).unwrap();
    let gone_addr = gone.local_addr().unwrap().to_string();
    drop(gone);
    let mut l = builder_remote(&st, &[&n0.addr, &gone_addr], 16 << 20)
        .node_timeout(Duration::from_secs(5))
        .end_epoch(Some(3))
        .build()
        .unwrap();
    assert_eq!(check(&mut l, &cat, 0, 1, 3), 1800);
    let stats = l.finish();
    assert!(
        stats.source_reads > 0 && stats.remote_samples > 0,
        "{stats:?}"
    );
    assert_eq!(stats.remote_samples + stats.source_reads, 1800, "{stats:?}");
    assert_eq!(stats.disk_reads, 0, "{stats:?}");
    assert_eq!(
        stats.read_ahead + stats.read_ahead_discarded,
        0,
        "{stats:?}"
    );
}

/// This node's own copies that keep failing are demoted for the epoch, as
/// a node is: after 16 failed reads the pollers hand their samples to the
/// replica unread (no read, no WARN, no failover each), and try again in
/// the next epoch. Without demotion every one of the 3,000 samples is read,
/// fails and fails over.
#[test]
fn failing_local_copies_are_demoted_for_the_epoch() {
    let st = setup("tiny", 1500, 2, 2);
    let serves: Vec<Serve> = (0..2)
        .map(|i| Serve::start(&st.spaces[i], &node_ip(i), &st.token, &[]))
        .collect();
    std::fs::rename(&st.src, st.src.with_extension("gone")).unwrap();
    let addrs: Vec<&str> = serves.iter().map(|s| s.addr.as_str()).collect();
    let cat = Catalog::open(&st.catalog).unwrap();
    let ring_bytes = 1u64 << 20;
    let mut l = builder_space(&st.spaces[0], cluster_of(&addrs))
        .landing(test_ring(ring_bytes))
        .end_epoch(Some(2))
        // Every local read fails.
        .fault_injection(
            kspeed::loader::FaultConfig::default()
                .seed(11)
                .eio_ppm(1_000_000),
        )
        .build()
        .unwrap();
    assert_eq!(check(&mut l, &cat, 0, 1, 2), 3000);
    let stats = l.finish();
    // Node 1 served every sample; the failed reads per epoch are at most
    // the 16 that demote plus what the ring's window held when they did
    // (a slot is at least 4 KiB).
    assert_eq!(stats.remote_samples, 3000, "{stats:?}");
    assert_eq!(stats.source_reads, 0, "{stats:?}");
    let bound = 2 * (16 + ring_bytes / 4096);
    assert!(
        stats.failovers >= 32 && stats.failovers <= bound,
        "{} failovers (demotion allows 32 to {bound}): {stats:?}",
        stats.failovers
    );
}

/// A node (with `extra` flags, 4 KiB chunks) whose extent loses its second
/// half after it started; a consumer grants a many-chunk sample past the
/// cut (grant 1) and one before it (grant 2) and reads until grant 2 is
/// whole. Returns the ERROR frames for grant 1 with their messages, the
/// sample past the cut, and the node's log.
fn cut_extent_frames(extra: &[&str]) -> (Vec<(Code, String)>, u64, String) {
    let st = setup("imagenet", 40, 1, 1);
    let space = Space::open(&st.spaces[0]).unwrap();
    let cat = Catalog::open(&st.catalog).unwrap();
    let log = st._tmp.path().join("node.log");
    let mut flags = vec!["--chunk-bytes", "4KiB"];
    flags.extend_from_slice(extra);
    let node = Serve::launch(
        &st.spaces[0],
        "127.0.0.1",
        &st.token,
        &flags,
        Some(&log),
        None,
    );
    let ext = space.extent_path(0);
    let half = std::fs::metadata(&ext).unwrap().len() / 2;
    std::fs::OpenOptions::new()
        .write(true)
        .open(&ext)
        .unwrap()
        .set_len(half)
        .unwrap();
    let lost = (0..cat.len())
        .find(|&i| space.location(i).unwrap().offset >= half && cat.sample(i).len > 16 << 10)
        .expect("a multi-chunk sample past the cut");
    let kept = (0..cat.len())
        .find(|&i| space.location(i).unwrap().offset + (cat.sample(i).len as u64) < half)
        .expect("a sample before the cut");
    let mut c = TcpStream::connect(&node.addr).unwrap();
    c.write_all(&hello_frame(
        &cat,
        proto::VERSION,
        TOKEN.as_bytes(),
        1 << 20,
    ))
    .unwrap();
    let (h, _) = read_frame(&mut c).unwrap();
    assert_eq!(h.kind, Kind::Welcome);
    let mut f = Header::grant(2).encode().to_vec();
    for (grant, sample, offset) in [(1, lost, 0), (2, kept, 512 << 10)] {
        let mut b = [0u8; proto::GRANT_ENTRY_BYTES];
        GrantEntry {
            grant,
            len: cat.sample(sample).len,
            sample,
            offset,
            rkey: 0,
        }
        .encode_into(&mut b);
        f.extend_from_slice(&b);
    }
    c.write_all(&f).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let (mut errors, mut got2) = (Vec::new(), 0u64);
    while got2 < cat.sample(kept).len as u64 {
        let (h, body) = read_frame(&mut c).unwrap_or_else(|e| {
            panic!(
                "frames until grant 2 is whole: {e}; node log:\n{}",
                std::fs::read_to_string(&log).unwrap_or_default()
            )
        });
        match (h.kind, h.a) {
            (Kind::Error, 1) => errors.push((
                Code::from_u32(h.b),
                String::from_utf8_lossy(&body).into_owned(),
            )),
            (Kind::Data, 1) => {}
            (Kind::Data, 2) => got2 += body.len() as u64,
            other => panic!(
                "unexpected frame {other:?}: {}",
                String::from_utf8_lossy(&body)
            ),
        }
    }
    drop(c);
    (errors, lost, std::fs::read_to_string(&log).unwrap())
}

/// `--page-cache`: a grant of a sample the extent no longer holds is
/// answered with ERROR ReadFailed naming the sample, and the connection
/// goes on (the old code sent from the mapping, got EFAULT in the middle of
/// a DATA frame and dropped the consumer without a word).
#[test]
fn page_cache_answers_a_truncated_extent_with_an_error_naming_the_sample() {
    let (errors, lost, log) = cut_extent_frames(&["--page-cache"]);
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert_eq!(errors[0].0, Code::ReadFailed, "{errors:?}");
    assert!(
        errors[0].1.contains(&format!("sample {lost}")),
        "{errors:?}"
    );
    assert_eq!(
        log_lines_in(&log, &format!("sample {lost} needs")),
        1,
        "{log}"
    );
}

/// A sample whose dozens of chunks all fail logs one WARN line, not one
/// per chunk.
#[test]
fn read_errors_log_one_warn_per_grant() {
    let (errors, _, log) = cut_extent_frames(&[]);
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert_eq!(log_lines_in(&log, "of grant 1"), 1, "{log}");
}

/// Lines of `text` that contain `what`.
fn log_lines_in(text: &str, what: &str) -> usize {
    text.lines().filter(|l| l.contains(what)).count()
}

// --- refusals close cleanly, and cost the node nothing while they wait ---

/// The metrics address a node started with `--metrics` printed.
fn metrics_addr_of(node: &Serve) -> String {
    node.before
        .iter()
        .find_map(|l| l.strip_prefix("metrics on http://"))
        .and_then(|l| l.strip_suffix("/metrics"))
        .unwrap_or_else(|| panic!("no metrics line: {:?}", node.before))
        .to_string()
}

/// Waits (deadline 30 s) until the node's metric `name` satisfies `ok`.
fn wait_metric(maddr: &str, name: &str, ok: impl Fn(f64) -> bool) -> f64 {
    let t0 = Instant::now();
    loop {
        let v = metric(&http_get(maddr, "/metrics").1, name).unwrap_or(-1.0);
        if ok(v) {
            return v;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "{name} is still {v} after 30 s"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// CPU time (clock ticks) the thread named `comm` of process `pid` used.
fn thread_ticks(pid: u32, comm: &str) -> u64 {
    for t in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap() {
        let dir = t.unwrap().path();
        let name = std::fs::read_to_string(dir.join("comm")).unwrap_or_default();
        if name.trim() != comm {
            continue;
        }
        let stat = std::fs::read_to_string(dir.join("stat")).unwrap();
        let rest = &stat[stat.rfind(')').unwrap() + 2..];
        let f: Vec<&str> = rest.split(' ').collect();
        // utime and stime: fields 14 and 15 of stat (state is field 3).
        return f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap();
    }
    panic!("no thread {comm} in process {pid}");
}

/// Closes `c` with a reset (SO_LINGER 0), as a peer that crashes does.
fn reset(c: TcpStream) {
    use std::os::fd::AsRawFd;
    let l = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    // SAFETY: a valid socket and a linger struct of the size given.
    let rc = unsafe {
        libc::setsockopt(
            c.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            &l as *const libc::linger as *const libc::c_void,
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        )
    };
    assert_eq!(rc, 0);
    drop(c);
}

#[test]
fn a_throttled_peer_that_resets_does_not_make_the_acceptor_spin() {
    let st = setup("tiny", 50, 1, 1);
    let node = Serve::start(
        &st.spaces[0],
        &node_ip(0),
        &st.token,
        &["--metrics", &format!("{}:0", node_ip(0))],
    );
    let maddr = metrics_addr_of(&node);
    let cat = Catalog::open(&st.catalog).unwrap();
    let bad = hello_frame(&cat, proto::VERSION, b"a-stale-launcher", 1 << 20);
    // The limit of wrong tokens answered at once, used up.
    for k in 0..16 {
        let mut c = TcpStream::connect(&node.addr).unwrap();
        c.write_all(&bad).unwrap();
        let (h, body) = frame_within(&mut c);
        assert_eq!(h.kind, Kind::Error, "wrong token {k}");
        assert!(!String::from_utf8_lossy(&body).contains("answered late"));
    }
    let pid = node.child.id();
    let before = thread_ticks(pid, "kspeed-accept");
    // Throttled wrong tokens whose peers reset while they wait for their
    // late answer: each one ends at once (the old acceptor kept polling
    // the reset socket, which poll reports ready whatever it is asked, at
    // full speed until the throttle's end).
    for _ in 0..5 {
        let refused = wait_metric(&maddr, "kspeed_serve_refused_total", |v| v >= 0.0);
        let mut c = TcpStream::connect(&node.addr).unwrap();
        c.write_all(&bad).unwrap();
        // Read and throttled (counted as refused), not answered yet.
        wait_metric(&maddr, "kspeed_serve_refused_total", |v| v > refused);
        reset(c);
        wait_metric(&maddr, "kspeed_serve_handshakes_pending", |v| v == 0.0);
    }
    let spent = thread_ticks(pid, "kspeed-accept") - before;
    // SAFETY: sysconf has no memory effects.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as u64;
    // The acceptor sleeps in poll throughout: a spinning one used a core
    // for about 5 s (at least seconds of CPU even on a loaded machine).
    assert!(
        spent < hz / 2,
        "the acceptor used {spent} ticks ({hz}/s) of CPU for 5 reset peers"
    );
}

#[test]
fn a_refused_connection_with_unread_input_gets_its_error_then_eof_not_a_reset() {
    let st = setup("tiny", 50, 1, 1);
    let node = Serve::start(&st.spaces[0], &node_ip(0), &st.token, &[]);
    let cat = Catalog::open(&st.catalog).unwrap();
    // A HELLO of a version the node does not speak is refused after its
    // header: its body and whatever followed are unread then.
    let mut frame = hello_frame(&cat, proto::VERSION + 1, TOKEN.as_bytes(), 1 << 20);
    frame.extend_from_slice(&[7u8; 4096]);
    for k in 0..300 {
        let mut c = TcpStream::connect(&node.addr).unwrap();
        c.write_all(&frame).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        let (h, body) =
            read_frame(&mut c).unwrap_or_else(|e| panic!("connection {k}: no whole ERROR ({e})"));
        assert_eq!(h.kind, Kind::Error, "connection {k}");
        assert_eq!(
            Code::from_u32(h.b),
            Code::BadVersion,
            "connection {k}: {}",
            String::from_utf8_lossy(&body)
        );
        let mut rest = [0u8; 64];
        match c.read(&mut rest) {
            Ok(0) => {}
            other => panic!("connection {k}: after the ERROR, {other:?} instead of EOF"),
        }
    }
}

#[cfg(feature = "test-panic")]
#[test]
fn a_handshake_pending_when_the_service_fails_is_told_it_is_stopping() {
    let st = setup("tiny", 50, 1, 1);
    let log = st._tmp.path().join("node.log");
    let mut child = Command::new(kspeed_bin())
        .args(["serve", "--space", s(&st.spaces[0]), "--listen"])
        .arg(format!("{}:0", node_ip(0)))
        .args(["--token-file", s(&st.token), "--pollers", "1"])
        .env("KSPEED_TEST_POLLER_PANIC", "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::from(std::fs::File::create(&log).unwrap()))
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    let addr = line.trim().rsplit(' ').next().unwrap().to_string();
    let cat = Catalog::open(&st.catalog).unwrap();
    let hello = hello_frame(&cat, proto::VERSION, TOKEN.as_bytes(), 1 << 20);
    // A handshake half sent, pending in the acceptor.
    let mut half = TcpStream::connect(&addr).unwrap();
    half.write_all(&hello[..10]).unwrap();
    // A consumer whose poller panics on taking it: the service fails.
    let mut c = TcpStream::connect(&addr).unwrap();
    c.write_all(&hello).unwrap();
    assert_eq!(frame_within(&mut c).0.kind, Kind::Welcome);
    // The half-sent handshake is told why it ends (it fails over at once),
    // not closed bare.
    let (h, body) = frame_within(&mut half);
    assert_eq!(h.kind, Kind::Error);
    assert_eq!(
        Code::from_u32(h.b),
        Code::ShuttingDown,
        "{}",
        String::from_utf8_lossy(&body)
    );
    let _ = child.kill();
    let _ = child.wait();
}

#[cfg(feature = "test-panic")]
#[test]
fn an_acceptor_that_panics_fails_the_service_with_a_named_error() {
    let st = setup("tiny", 50, 1, 1);
    let log = st._tmp.path().join("node.log");
    let mut child = Command::new(kspeed_bin())
        .args(["serve", "--space", s(&st.spaces[0]), "--listen"])
        .arg(format!("{}:0", node_ip(0)))
        .args(["--token-file", s(&st.token), "--pollers", "1"])
        .env("KSPEED_TEST_ACCEPTOR_PANIC", "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::from(std::fs::File::create(&log).unwrap()))
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    let addr = line.trim().rsplit(' ').next().unwrap().to_string();
    let _c = TcpStream::connect(&addr).unwrap();
    // The service stops by itself (the old one kept running without its
    // acceptor), with an error naming the acceptor.
    let t0 = Instant::now();
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        if t0.elapsed() > Duration::from_secs(30) {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "kspeed serve still runs 30 s after its acceptor panicked:\n{}",
                std::fs::read_to_string(&log).unwrap()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let err = std::fs::read_to_string(&log).unwrap();
    assert!(!status.success(), "{err}");
    assert!(err.contains("the acceptor panicked"), "{err}");
}

/// Sends `req` on a new connection to `addr` and reads the whole answer
/// (deadline 20 s): its status line, headers, and body bytes.
fn http_raw(addr: &str, req: &str) -> (String, String, Vec<u8>) {
    let mut c = TcpStream::connect(addr).unwrap();
    c.write_all(req.as_bytes()).unwrap();
    http_read(c)
}

fn http_read(mut c: TcpStream) -> (String, String, Vec<u8>) {
    c.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let mut all = Vec::new();
    c.read_to_end(&mut all)
        .unwrap_or_else(|e| panic!("reading the answer: {e} after {all:?}"));
    let end = all
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or_else(|| panic!("no header end in {:?}", String::from_utf8_lossy(&all)));
    let head = String::from_utf8_lossy(&all[..end]).to_string();
    let status = head.lines().next().unwrap_or("").to_string();
    (status, head, all[end + 4..].to_vec())
}

fn header<'a>(head: &'a str, name: &str) -> Option<&'a str> {
    head.lines()
        .find_map(|l| {
            l.split_once(": ")
                .filter(|(k, _)| k.eq_ignore_ascii_case(name))
        })
        .map(|(_, v)| v)
}

#[test]
fn metrics_head_gets_the_get_headers_and_no_body() {
    let st = setup("tiny", 50, 1, 1);
    let node = Serve::start(
        &st.spaces[0],
        &node_ip(0),
        &st.token,
        &["--metrics", &format!("{}:0", node_ip(0))],
    );
    let maddr = metrics_addr_of(&node);
    let (status, head, body) = http_raw(&maddr, "HEAD /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
    assert!(status.contains("200"), "{head}");
    assert!(body.is_empty(), "HEAD answered with a body: {body:?}");
    let (_, get_head, get_body) = http_raw(&maddr, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
    assert_eq!(
        header(&head, "Content-Type"),
        header(&get_head, "Content-Type")
    );
    // The body is OpenMetrics text (prometheus-client's), ending in `# EOF`,
    // and says so.
    assert_eq!(
        header(&get_head, "Content-Type"),
        Some("application/openmetrics-text; version=1.0.0; charset=utf-8")
    );
    assert!(
        String::from_utf8_lossy(&get_body)
            .trim_end()
            .ends_with("# EOF"),
        "{}",
        String::from_utf8_lossy(&get_body)
    );
    let len: usize = header(&head, "Content-Length").unwrap().parse().unwrap();
    // The text changes between scrapes only in values: the same order of
    // size as GET's body.
    assert!(len > 0 && len / 2 < get_body.len(), "{head}");
    let (status, head, body) = http_raw(&maddr, "HEAD /nope HTTP/1.1\r\nHost: x\r\n\r\n");
    assert!(status.contains("404"), "{head}");
    assert!(body.is_empty(), "HEAD answered with a body: {body:?}");
}

#[test]
fn a_metrics_flood_does_not_abort_a_scrape_in_progress() {
    let st = setup("tiny", 50, 1, 1);
    let node = Serve::start(
        &st.spaces[0],
        &node_ip(0),
        &st.token,
        &["--metrics", &format!("{}:0", node_ip(0))],
    );
    let maddr = metrics_addr_of(&node);
    // A scraper that has sent the first part of its request...
    let mut scrape = TcpStream::connect(&maddr).unwrap();
    scrape.write_all(b"GET /metrics HTTP/1.1\r\n").unwrap();
    // ... then more connections than the port serves at once, silent.
    let flood: Vec<TcpStream> = (0..40)
        .map(|_| TcpStream::connect(&maddr).unwrap())
        .collect();
    // Once the port has taken them all (the first silent one is closed to
    // make room), the scraper finishes its request. The old port closed
    // the oldest (the scraper) to make room.
    let mut first = &flood[0];
    first
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let mut one = [0u8; 1];
    match first.read(&mut one) {
        Ok(0) => {}
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
        other => panic!("the first silent connection: {other:?}, not closed within 20 s"),
    }
    scrape.write_all(b"Host: x\r\n\r\n").unwrap();
    let (status, head, body) = http_read(scrape);
    assert!(status.contains("200"), "{head}");
    assert!(
        String::from_utf8_lossy(&body).contains("kspeed_serve_connections"),
        "{body:?}"
    );
    drop(flood);
}

#[test]
fn a_full_metrics_port_delays_a_new_scrape_until_a_slot_frees() {
    let st = setup("tiny", 50, 1, 1);
    let node = Serve::start(
        &st.spaces[0],
        &node_ip(0),
        &st.token,
        &["--metrics", &format!("{}:0", node_ip(0))],
    );
    let maddr = metrics_addr_of(&node);
    // Every slot holds a connection that sent part of its request.
    let partial: Vec<TcpStream> = (0..16)
        .map(|_| {
            let mut c = TcpStream::connect(&maddr).unwrap();
            c.write_all(b"GET /metrics HTTP/1.1\r\n").unwrap();
            c
        })
        .collect();
    // A new scrape waits in the backlog; when the others close, it is
    // served.
    let mut scrape = TcpStream::connect(&maddr).unwrap();
    scrape
        .write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    drop(partial);
    let (status, head, _) = http_read(scrape);
    assert!(status.contains("200"), "{head}");
}

/// A node whose `kspeed serve` starts after the trainer: its connect is
/// refused (nothing listens yet) and is tried again with the back-off, like
/// a busy node, until the node timeout, so the node serves the whole run
/// instead of being dead from the start (every sample from the source).
#[test]
fn a_node_that_starts_after_the_loader_is_connected_when_it_listens() {
    let st = setup("tiny", 600, 1, 1);
    let port = TcpListener::bind(format!("{}:0", node_ip(0)))
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr = format!("{}:{port}", node_ip(0));
    let (space, token, at) = (st.spaces[0].clone(), st.token.clone(), addr.clone());
    // The node comes up about a second after the loader starts connecting
    // (the delay is the scenario, not a wait for something).
    let late = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_secs(1));
        Serve::start(&space, &at, &token, &[])
    });
    let cat = Catalog::open(&st.catalog).unwrap();
    let mut l = builder_remote(&st, &[&addr], 16 << 20)
        .node_timeout(Duration::from_secs(20))
        .end_epoch(Some(1))
        .build()
        .unwrap();
    let node = late.join().unwrap();
    assert_eq!(check(&mut l, &cat, 0, 1, 1), 600);
    let stats = l.finish();
    assert_eq!(stats.source_reads, 0, "{stats:?}");
    assert_eq!(stats.remote_samples, 600, "{stats:?}");
    drop(node);
}

/// A node paused for 3 s (cgroup throttling, a VM pause, a debugger) while
/// no grant waits on it is not taken for dead: the 2 s heartbeat silence
/// applies only with grants outstanding (an idle link gets `node_timeout`),
/// so the connection survives the pause and the node keeps serving this
/// consumer (no reconnect needed; over RDMA there is none).
#[test]
fn an_idle_node_paused_for_three_seconds_keeps_its_consumer() {
    let st = setup("tiny", 600, 1, 1);
    let log = st._tmp.path().join("node0.log");
    let node = Serve::launch(&st.spaces[0], &node_ip(0), &st.token, &[], Some(&log), None);
    let cat = Catalog::open(&st.catalog).unwrap();
    // The 16 MiB ring holds about six epochs: all three land.
    let mut a = builder_remote(&st, &[&node.addr], 16 << 20)
        .end_epoch(Some(3))
        .build()
        .unwrap();
    let sampler = Sampler::new(
        SamplerConfig::single(cat.len(), 3)
            .rank_world(0, 1)
            .shuffle(true)
            .drop_last(false),
    )
    .unwrap();
    let read_epoch = |l: &mut Loader, e: u64| {
        l.set_epoch(e).unwrap();
        let mut k = 0;
        while let Some(b) = l.next_batch().unwrap() {
            for smp in b.iter() {
                assert_eq!(smp.id, sampler.sample(e, k), "epoch {e} step {k}");
                assert_eq!(crc32c::crc32c(smp.bytes), cat.sample(smp.id).crc32c);
                k += 1;
            }
        }
        assert_eq!(k, 600, "epoch {e}");
    };
    read_epoch(&mut a, 0);
    // Every sample of the three epochs has landed: no grant is outstanding
    // now or later, and the node has sent heartbeats.
    let t0 = Instant::now();
    while a.stats().remote_samples < 1800 {
        assert!(t0.elapsed() < Duration::from_secs(60), "{:?}", a.stats());
        std::thread::sleep(Duration::from_millis(10));
    }
    node.signal("-STOP");
    std::thread::sleep(Duration::from_secs(3));
    node.signal("-CONT");
    read_epoch(&mut a, 1);
    read_epoch(&mut a, 2);
    // A second consumer served in full by the node's only poller: by then
    // that poller has taken in whatever consumer A did during the pause
    // (a shut connection would be logged "disconnected").
    let mut b = builder_remote(&st, &[&node.addr], 16 << 20)
        .end_epoch(Some(1))
        .build()
        .unwrap();
    read_epoch(&mut b, 0);
    let text = std::fs::read_to_string(&log).unwrap();
    assert_eq!(
        log_lines(&log, "disconnected"),
        0,
        "a consumer was dropped during the pause: {text}"
    );
    let stats = a.finish();
    assert_eq!(stats.remote_samples, 1800, "{stats:?}");
    assert_eq!(stats.source_reads + stats.failovers, 0, "{stats:?}");
    drop(b);
    drop(node);
}

/// A node paused for 3 s mid-epoch, grants waiting on it: its consumer
/// takes it for dead after 2 s of silence and fails its grants over (the
/// epoch completes exactly, the rest from the source), then reconnects once
/// the node runs again, and the node serves again: later epochs read
/// nothing from the source. Without the reconnect the node is lost to the
/// consumer for the rest of the run.
#[test]
fn a_node_paused_mid_epoch_is_reconnected_and_serves_again() {
    let st = setup("tiny", 600, 1, 1);
    let node = Serve::start(&st.spaces[0], &node_ip(0), &st.token, &[]);
    let cat = Catalog::open(&st.catalog).unwrap();
    // A 1 MiB ring holds about a third of an epoch: grants wait on the
    // node while it is stopped.
    let mut l = builder_remote(&st, &[&node.addr], 1 << 20).build().unwrap();
    let sampler = Sampler::new(
        SamplerConfig::single(cat.len(), 3)
            .rank_world(0, 1)
            .shuffle(true)
            .drop_last(false),
    )
    .unwrap();
    let pid = node.child.id();
    let read_epoch = |l: &mut Loader, e: u64, pause: bool| {
        l.set_epoch(e).unwrap();
        let mut k = 0;
        let mut cont = None;
        while let Some(b) = l.next_batch().unwrap() {
            for smp in b.iter() {
                assert_eq!(smp.id, sampler.sample(e, k), "epoch {e} step {k}");
                assert_eq!(crc32c::crc32c(smp.bytes), cat.sample(smp.id).crc32c);
                k += 1;
            }
            drop(b);
            if pause && cont.is_none() {
                node.signal("-STOP");
                // The pause is the scenario (not a wait for something).
                cont = Some(std::thread::spawn(move || {
                    std::thread::sleep(Duration::from_secs(3));
                    Command::new("kill")
                        .args(["-CONT", &pid.to_string()])
                        .status()
                        .unwrap();
                }));
            }
        }
        assert_eq!(k, 600, "epoch {e}");
        if let Some(t) = cont {
            t.join().unwrap();
        }
    };
    read_epoch(&mut l, 0, true);
    let after_pause = l.stats();
    assert!(after_pause.source_reads > 0, "{after_pause:?}");
    // Epochs go on (from the source while the node is away) until one is
    // served by the node alone.
    let t0 = Instant::now();
    let mut e = 1;
    loop {
        let before = l.stats();
        read_epoch(&mut l, e, false);
        let now = l.stats();
        if now.source_reads == before.source_reads {
            // (Part of this epoch may have been read ahead, from the
            // source, during the one before.)
            assert!(now.remote_samples > before.remote_samples, "{now:?}");
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "node never served again after its pause ({e} epochs): {now:?}"
        );
        e += 1;
    }
    let stats = l.finish();
    assert_eq!(stats.samples, 600 * (e + 1), "{stats:?}");
    drop(node);
}
