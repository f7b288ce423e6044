//! The cluster data path with real processes and real sockets: `kspeed
//! serve` nodes on 127.0.0.x, consumers through the Loader API. Every sample
//! byte-identical and in sampler order on every rank; owners killed or
//! stalled mid-epoch fail over to replicas or the source, or fail with a
//! named error; hostile peers on either side are refused and never write
//! outside a granted range.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use kspeed::dataset::{Catalog, Space};
use kspeed::landing::{CudaMode, LandingOptions};
use kspeed::loader::{Loader, LoaderBuilder};
use kspeed::sampler::{Sampler, SamplerConfig};
use kspeed::transport::proto::{self, Code, GrantEntry, Header, Hello, Kind, Welcome};
use kspeed::transport::Cluster;
use kspeed::Error;

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
}

impl Serve {
    fn start(space: &Path, ip: &str, token_file: &Path, extra: &[&str]) -> Serve {
        let mut child = Command::new(kspeed_bin())
            .args(["serve", "--space", s(space), "--listen"])
            .arg(if ip.contains(':') {
                ip.to_string()
            } else {
                format!("{ip}:0")
            })
            .args(["--token-file", s(token_file), "--pollers", "1"])
            .args(extra)
            .args(if rdma_mode() { &["--rdma"][..] } else { &[] })
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("start kspeed serve");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let addr = line
            .trim()
            .rsplit(' ')
            .next()
            .unwrap_or_default()
            .to_string();
        assert!(addr.contains(':'), "serve printed {line:?}");
        Serve { child, addr }
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

fn ring(bytes: u64) -> LandingOptions {
    LandingOptions {
        ring_bytes: bytes,
        huge_pages: false,
        mlock: false,
        numa_node: None,
        gpu_pci: None,
        cuda: CudaMode::Off,
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
    let sampler = Sampler::new(SamplerConfig {
        len: cat.len(),
        seed: 3,
        shuffle: true,
        rank,
        world,
        drop_last: false,
    })
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
        .landing(ring(ring_bytes))
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
        .landing(ring(8 << 20))
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
            .landing(ring(1 << 20))
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
        .landing(ring(8 << 20))
        .build()
        .unwrap();
    let sampler = Sampler::new(SamplerConfig {
        len: cat.len(),
        seed: 3,
        shuffle: true,
        rank: 0,
        world: 1,
        drop_last: false,
    })
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

#[test]
fn stalled_owner_times_out_and_fails_over() {
    let (_st, r, took) = owner_trouble(2, false, false, Duration::from_millis(800));
    let stats = r.unwrap();
    assert!(stats.failovers > 0, "{stats:?}");
    assert!(took < Duration::from_secs(20), "took {took:?}");
}

// --- hostile consumers against a real node -------------------------------

fn hello_frame(cat: &Catalog, version: u32, token: &[u8], ring_len: u64) -> Vec<u8> {
    let mut out = Vec::new();
    Hello {
        catalog_identity: cat.identity(),
        rank: 0,
        world: 1,
        catalog_samples: cat.len(),
        seed: 0,
        ring_addr: 0,
        ring_len,
        rkey: 0,
        transport: proto::TRANSPORT_TCP,
    }
    .encode(token, &mut out);
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
        .landing(ring(1 << 20))
        .build()
        .err()
        .expect("refused");
    assert!(
        matches!(&e, Error::Refused { code, .. } if *code == "bad token"),
        "{e}"
    );

    // Wrong protocol version.
    let mut c = connect();
    c.write_all(&hello_frame(&cat, 99, TOKEN.as_bytes(), 1 << 20))
        .unwrap();
    let (code, msg) = read_error(&mut c);
    assert_eq!(code, Code::BadVersion, "{msg}");

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
        }],
    );
    let (code, msg) = read_error(&mut c);
    assert_eq!(code, Code::Violation);
    assert!(msg.contains("outside"), "{msg}");

    // A grant with the wrong length, one for a sample past the catalog,
    // and more grants than the WELCOME allowed.
    for entries in [
        vec![GrantEntry {
            grant: 1,
            len: s0.len + 1,
            sample: 0,
            offset: 0,
        }],
        vec![GrantEntry {
            grant: 1,
            len: 1,
            sample: 1 << 40,
            offset: 0,
        }],
        (0..65)
            .map(|i| GrantEntry {
                grant: i,
                len: s0.len,
                sample: 0,
                offset: 0,
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

// --- hostile nodes against a real consumer --------------------------------

#[derive(Clone, Copy, Debug)]
enum Misdeed {
    UnknownGrant,
    OffsetPastGrant,
    Overrun,
    TruncatedFrame,
    StallMidFrame,
    BadMagic,
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
            max_data_bytes: 1 << 20,
            max_grants: 4096,
            transport: proto::TRANSPORT_TCP,
        };
        c.write_all(&w.encode()).unwrap();
        let (_, body) = read_frame(&mut c).unwrap(); // the first GRANT
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

/// Network namespaces joined to this one by veth pairs; removed on drop.
struct Netns {
    names: Vec<String>,
}

impl Netns {
    /// Namespace i gets 10.77.<i>.2, reachable from here through 10.77.<i>.1.
    fn create(n: usize) -> Option<Netns> {
        let tag = std::process::id() % 100_000;
        let mut ns = Netns { names: Vec::new() };
        for i in 0..n {
            let name = format!("ksp{tag}n{i}");
            let host = format!("ksh{tag}{i}");
            let peer = format!("ksp{tag}{i}");
            let cmds: Vec<Vec<String>> = vec![
                vec!["netns".into(), "add".into(), name.clone()],
                vec!["link", "add", &host, "type", "veth", "peer", "name", &peer]
                    .into_iter()
                    .map(String::from)
                    .collect(),
                vec![
                    "link".into(),
                    "set".into(),
                    peer.clone(),
                    "netns".into(),
                    name.clone(),
                ],
                vec![
                    "addr".into(),
                    "add".into(),
                    format!("10.77.{i}.1/24"),
                    "dev".into(),
                    host.clone(),
                ],
                vec!["link".into(), "set".into(), host.clone(), "up".into()],
                vec![
                    "-n".into(),
                    name.clone(),
                    "addr".into(),
                    "add".into(),
                    format!("10.77.{i}.2/24"),
                    "dev".into(),
                    peer.clone(),
                ],
                vec![
                    "-n".into(),
                    name.clone(),
                    "link".into(),
                    "set".into(),
                    peer.clone(),
                    "up".into(),
                ],
                vec![
                    "-n".into(),
                    name.clone(),
                    "link".into(),
                    "set".into(),
                    "lo".into(),
                    "up".into(),
                ],
            ];
            for (k, c) in cmds.iter().enumerate() {
                let ok = Command::new("ip")
                    .args(c)
                    .status()
                    .map(|s| s.success())
                    .unwrap_or(false);
                if k == 0 && ok {
                    ns.names.push(name.clone());
                }
                if !ok {
                    skip(&format!("`ip {}` failed", c.join(" ")));
                    return None;
                }
            }
        }
        Some(ns)
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        for n in &self.names {
            // Deleting the namespace deletes its veth end and so the pair.
            let _ = Command::new("ip").args(["netns", "del", n]).status();
        }
    }
}

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
            Serve { child, addr }
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
                    .landing(ring(8 << 20))
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
    use kspeed::capi::*;
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
        let mut b: ksp_batch = std::mem::zeroed();
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
        let mut b: ksp_batch = std::mem::zeroed();
        assert_eq!(
            ksp_loader_next_batch(c, &mut b),
            net,
            "the first error's status, not KSP_ERR_STATE"
        );
        assert_eq!(ksp_loader_set_epoch(c, 5), net);
        let mut n = 0u64;
        assert_eq!(ksp_loader_catalog_len(c, &mut n), ksp_status::KSP_OK);
        assert_eq!(n, 300);
        let mut stats: ksp_stats = std::mem::zeroed();
        assert_eq!(ksp_loader_stats(c, &mut stats), ksp_status::KSP_OK);
        assert_eq!(stats.samples, 16);
        ksp_loader_free(c);
    }
}
