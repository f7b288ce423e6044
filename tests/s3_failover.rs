//! Failover to an object store: a loader whose only node dies mid-epoch
//! reads the rest of the epoch from the bucket the space was preloaded
//! from, every sample exactly once, in order and byte-exact; with the
//! bucket's object replaced, the sample fails by name. Real `kspeed serve`
//! and a real S3 server process (s3s-fs, tests/common/s3.rs).
#![cfg(all(feature = "cli", feature = "s3"))]

mod common;
#[path = "common/s3.rs"]
mod s3h;

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::*;
use kspeed::dataset::Catalog;
use kspeed::landing::{CudaMode, LandingOptions};
use kspeed::loader::LoaderBuilder;
use kspeed::sampler::{Sampler, SamplerConfig};
use kspeed::transport::Cluster;
use kspeed::Error;
use s3h::*;

const BUCKET: &str = "failover";
const TOKEN: &str = "s3-failover-token";
const LIMIT: Duration = Duration::from_secs(240);

/// A `kspeed serve` child, killed on drop.
struct Serve {
    child: Child,
    addr: String,
}

impl Serve {
    fn start(space: &Path, token: &Path) -> Serve {
        let mut child = Command::new(kspeed_bin())
            .args(["serve", "--space", s(space), "--listen", "127.0.0.1:0"])
            .args(["--token-file", s(token), "--pollers", "1"])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("start kspeed serve");
        // Its "serving ADDR" line, read with a deadline.
        let out = child.stdout.take().unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines() {
                let Ok(line) = line else { break };
                if line.starts_with("serving") {
                    let _ = tx.send(line);
                    break;
                }
            }
        });
        let line = rx
            .recv_timeout(Duration::from_secs(60))
            .expect("kspeed serve printed its address within 60 s");
        let addr = line.trim().rsplit(' ').next().unwrap().to_string();
        Serve { child, addr }
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A bucket with an ImageFolder, a space preloaded from it, its node.
struct Setup {
    srv: S3Server,
    _tmp: tempfile::TempDir,
    space: std::path::PathBuf,
    token: std::path::PathBuf,
    node: Serve,
}

fn setup(count: u64) -> Option<Setup> {
    let srv = S3Server::start()?;
    srv.create_bucket(BUCKET);
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    gen("imagenet", count, &src);
    let mut objects = Vec::new();
    for e in files_under(&src) {
        let rel = e.strip_prefix(&src).unwrap().to_string_lossy().into_owned();
        objects.push((format!("train/{rel}"), std::fs::read(&e).unwrap()));
    }
    srv.put_many(BUCKET, objects, 16, LIMIT);
    let space = tmp.path().join("space");
    let url = format!("s3://{BUCKET}/train/");
    srv.ok(&["preload", "--source", &url, "--space", s(&space)], LIMIT);
    let token = tmp.path().join("token");
    std::fs::write(&token, format!("{TOKEN}\n")).unwrap();
    let node = Serve::start(&space, &token);
    // This process's loader finds the store as a user's would: from the
    // AWS variables (one test per binary: nothing else reads them).
    for (k, v) in srv.env() {
        std::env::set_var(k, v);
    }
    Some(Setup {
        srv,
        _tmp: tmp,
        space,
        token,
        node,
    })
}

fn loader(st: &Setup) -> kspeed::loader::Loader {
    let cluster = Cluster::parse(&format!("0 {}\n", st.node.addr), "test").unwrap();
    LoaderBuilder::source(&format!("s3://{BUCKET}/train/"))
        .catalog(st.space.join("catalog.ksc"))
        .cluster(cluster)
        .token(
            std::fs::read_to_string(&st.token)
                .unwrap()
                .trim()
                .as_bytes(),
        )
        .seed(5)
        .batch_size(8)
        .pollers(1)
        .pin(false)
        .node_timeout(Duration::from_secs(2))
        .landing(
            LandingOptions::default()
                .ring_bytes(4 << 20)
                .huge_pages(false)
                .mlock(false)
                .numa_node(None)
                .gpu_pci(None)
                .cuda(CudaMode::Off),
        )
        .build()
        .unwrap()
}

/// Reads epoch 0, killing the node after the first batch; checks every
/// sample against an independent sampler and the catalog's CRC32C.
fn read_with_the_node_killed(st: &mut Setup) -> (Result<u64, Error>, kspeed::loader::Stats) {
    let cat = Catalog::open(&st.space.join("catalog.ksc")).unwrap();
    let n = cat.len();
    let sampler = Sampler::new(SamplerConfig::single(n, 5).rank_world(0, 1).shuffle(true)).unwrap();
    let mut l = loader(st);
    let mut k = 0u64;
    let mut seen = vec![false; n as usize];
    let t0 = Instant::now();
    let res = (|| -> Result<u64, Error> {
        l.set_epoch(0)?;
        while let Some(b) = l.next_batch()? {
            for smp in b.iter() {
                assert_eq!(smp.id, sampler.sample(0, k), "sample {k} of the epoch");
                assert_eq!(
                    crc32c::crc32c(smp.bytes),
                    cat.sample(smp.id).crc32c,
                    "bytes of sample {}",
                    smp.id
                );
                assert!(!std::mem::replace(&mut seen[smp.id as usize], true));
                k += 1;
            }
            drop(b);
            if k == 8 {
                let _ = st.node.child.kill();
                let _ = st.node.child.wait();
            }
            assert!(t0.elapsed() < LIMIT, "the epoch took over {LIMIT:?}");
        }
        Ok(k)
    })();
    let stats = l.stats();
    (res, stats)
}

#[test]
fn the_only_node_dies_and_the_bucket_serves_the_rest_of_the_epoch() {
    let Some(mut st) = setup(300) else { return };
    let (res, stats) = read_with_the_node_killed(&mut st);
    assert_eq!(res.unwrap(), 300, "every sample of the epoch, once");
    assert!(
        stats.source_reads > 0 && stats.failovers > 0,
        "samples came from the bucket after the node died: {stats:?}"
    );

    // An object replaced in the bucket: its sample fails by name (the
    // GET is conditional on the cataloged ETag, and the bytes are checked
    // against the CRC32C), the others still come.
    let node = Serve::start(&st.space, &st.token);
    st.node = node;
    let cat = Catalog::open(&st.space.join("catalog.ksc")).unwrap();
    for f in 0..cat.file_count() as u32 {
        let key = format!("train/{}", cat.file(f).name.display());
        st.srv.put(BUCKET, &key, b"replaced bytes");
    }
    let (res, _) = read_with_the_node_killed(&mut st);
    match res {
        Err(Error::SampleUnavailable { tried, .. }) => {
            assert!(tried.contains(&format!("s3://{BUCKET}/train/")), "{tried}");
        }
        other => panic!("a replaced object must fail its sample by name: {other:?}"),
    }
}
