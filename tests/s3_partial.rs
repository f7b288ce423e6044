//! A partial space over a bucket (issue 31): `kspeed preload --source
//! s3://… --max-bytes` holds a budget of the dataset on the NVMe, and the
//! loader reads the rest from the bucket by ranged GETs, in the rank's
//! order, ahead of need, in the same poller loop as its NVMe reads
//! (ring/split.rs). Real S3 server process (s3s-fs, tests/common/s3.rs).
//!
//! - four epochs, exact (order, bytes, CRC), the held samples from the
//!   NVMe and the others from the bucket, the bucket's bytes per epoch
//!   exactly the model's;
//! - the same under injected faults (short reads, delayed completions):
//!   the remainder of a short GET is asked for again;
//! - a memory tier over it keeps bucket samples too;
//! - `kspeed read` on it, from the command line;
//! - an object replaced or deleted after the preload: a named error that
//!   names the sample and the object's URL, and nothing delivered wrong;
//! - `kspeed read` killed (SIGKILL) while its GETs are out: the space
//!   verifies intact and a rerun reads the epoch exactly;
//! - three nodes (real `kspeed serve` processes) serving partial spaces
//!   preloaded from the bucket, together a third of it: a rank reads its
//!   node's samples from its space, the others' from them, and those no
//!   node holds from the bucket, exactly, with no failover; a node killed
//!   mid-epoch fails over to the bucket, and the epoch stays exact;
//! - a mixture holding it is refused by name.
#![cfg(all(feature = "cli", feature = "s3"))]

#[path = "agent_support/mod.rs"]
mod agent_support;
mod common;
#[path = "common/nodes.rs"]
mod nodes;
#[path = "common/s3.rs"]
mod s3h;

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use common::*;
use kspeed::dataset::{Catalog, Space};
use kspeed::loader::FaultConfig;
use kspeed::loader::{Loader, LoaderBuilder};
use kspeed::sampler::{Sampler, SamplerConfig, Weight};
use s3h::*;

const BUCKET: &str = "partial";
const SEED: u64 = 11;
const LIMIT: Duration = Duration::from_secs(240);

fn builder(space: &std::path::Path) -> LoaderBuilder {
    LoaderBuilder::space(space)
        .seed(SEED)
        .batch_size(8)
        .pollers(2)
        .queue_depth(16)
        .pin(false)
        .landing(small_landing())
}

/// Reads `epochs` epochs from the start, checking every sample against
/// the sampler and the bytes uploaded.
fn read_exact(
    l: &mut Loader,
    cat: &Catalog,
    src: &std::path::Path,
    epochs: u64,
) -> kspeed::Result<()> {
    let sampler = Sampler::new(SamplerConfig::single(cat.len(), SEED)).unwrap();
    for e in 0..epochs {
        l.set_epoch(e)?;
        let mut k = 0u64;
        while let Some(b) = l.next_batch()? {
            for smp in b.iter() {
                assert_eq!(smp.id, sampler.sample(e, k), "epoch {e} step {k}");
                let c = cat.sample(smp.id);
                let name = cat.file(c.file).name.to_string_lossy().into_owned();
                // Independently of kspeed's catalog: the file uploaded.
                let want = std::fs::read(src.join(&name)).unwrap();
                assert!(
                    smp.bytes == &want[..],
                    "bytes of {name} (sample {})",
                    smp.id
                );
                k += 1;
            }
        }
        assert_eq!(k, cat.len(), "every sample of epoch {e}, once");
    }
    Ok(())
}

#[test]
fn a_partial_space_over_a_bucket_reads_the_rest_from_it_exactly() {
    let Some(srv) = S3Server::start() else { return };
    srv.create_bucket(BUCKET);
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    gen("imagenet", 240, &src);
    srv.put_many(
        BUCKET,
        files_under(&src).into_iter().map(|p| {
            let rel = p.strip_prefix(&src).unwrap().to_string_lossy().into_owned();
            (format!("train/{rel}"), std::fs::read(&p).unwrap())
        }),
        16,
        LIMIT,
    );
    // The loader finds the store from the AWS variables, as a user's
    // would (one test in this binary: nothing else reads them).
    for (k, v) in srv.env() {
        std::env::set_var(k, v);
    }
    let url = format!("s3://{BUCKET}/train/");
    let space_dir = tmp.path().join("space");
    let out = srv.ok(
        &[
            "preload",
            "--source",
            &url,
            "--space",
            s(&space_dir),
            "--max-bytes",
            "10MiB",
        ],
        LIMIT,
    );
    assert!(out.contains("a partial space"), "{out}");
    let space = Space::open(&space_dir).unwrap();
    let cat = Catalog::open(&space_dir.join("catalog.ksc")).unwrap();
    let (held, n) = (space.held_samples(), cat.len());
    assert!(held > 0 && held < n / 2, "held {held} of {n}");
    // The model: the bucket gives exactly the samples the space does not
    // hold, once per epoch.
    let bucket_bytes_per_epoch: u64 = (0..n)
        .filter(|&id| space.location(id).is_none())
        .map(|id| cat.sample(id).len as u64)
        .sum();

    let epochs = 4;
    let mut l = builder(&space_dir).end_epoch(Some(epochs)).build().unwrap();
    read_exact(&mut l, &cat, &src, epochs).unwrap();
    let st = l.stats();
    assert_eq!(st.disk_reads, held * epochs, "{st:?}");
    assert_eq!(st.source_reads, (n - held) * epochs, "{st:?}");
    assert_eq!(st.source_bytes, bucket_bytes_per_epoch * epochs, "{st:?}");
    assert_eq!(st.source_lead.count, (n - held) * epochs, "{st:?}");
    drop(l);

    // Short reads and late completions on both sides of the split: a
    // short GET's remainder is asked for again, nothing is lost.
    let faults = FaultConfig::default()
        .seed(5)
        .short_ppm(100_000)
        .delay_ppm(100_000);
    let mut l = builder(&space_dir)
        .fault_injection(faults)
        .end_epoch(Some(2))
        .build()
        .unwrap();
    read_exact(&mut l, &cat, &src, 2).unwrap();
    assert_eq!(l.stats().source_reads, (n - held) * 2);
    drop(l);

    // A memory tier over it: by epoch 2 every sample is filled, bucket
    // samples included (at least an epoch of hits).
    let mut l = builder(&space_dir)
        .tier_bytes(64 << 20)
        .end_epoch(Some(3))
        .build()
        .unwrap();
    read_exact(&mut l, &cat, &src, 3).unwrap();
    let st = l.stats();
    assert_eq!(st.tier_hits + st.disk_reads + st.source_reads, n * 3);
    assert!(st.tier_hits >= n && st.source_reads >= n - held, "{st:?}");
    drop(l);

    // The command line says where the samples came from.
    let out = srv.ok(
        &[
            "read",
            "--space",
            s(&space_dir),
            "--epochs",
            "2",
            "--no-huge-pages",
            "--no-mlock",
        ],
        LIMIT,
    );
    assert!(
        out.contains("source samples ready before they were asked for"),
        "{out}"
    );
    assert!(
        out.contains(&format!("partial space: {} samples (", (n - held) * 2)),
        "{out}"
    );

    killed_mid_epoch_then_verified_and_rerun(&srv, &space_dir, &cat, &src);
    three_nodes_over_the_bucket(&srv, &url, &src, tmp.path());
    agent_over_the_bucket(&space_dir, tmp.path());

    // A mixture holding it is refused by name.
    let msg = match LoaderBuilder::mix([(s(&space_dir), Weight::Repeat(1.0))])
        .landing(small_landing())
        .build()
    {
        Ok(_) => panic!("a mixture of a partial space over a bucket"),
        Err(e) => e.to_string(),
    };
    assert!(msg.contains("partial space over a bucket"), "{msg}");

    // An object the space does not hold, replaced after the preload (same
    // length, other bytes): its GET is conditional on the catalog's ETag,
    // and the read fails naming the sample and the object.
    let outside = (0..n).find(|&id| space.location(id).is_none()).unwrap();
    let name = cat
        .file(cat.sample(outside).file)
        .name
        .to_string_lossy()
        .into_owned();
    let key = format!("train/{name}");
    let mut bytes = std::fs::read(src.join(&name)).unwrap();
    bytes[0] ^= 0xff;
    srv.put(BUCKET, &key, &bytes);
    let mut l = builder(&space_dir).end_epoch(Some(1)).build().unwrap();
    let e = read_exact(&mut l, &cat, &src, 1).unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains(&format!("sample {outside}")) && msg.contains(&name),
        "{msg}"
    );
    drop(l);
    // Deleted: named the same way.
    srv.delete(BUCKET, &key);
    let mut l = builder(&space_dir).end_epoch(Some(1)).build().unwrap();
    let msg = read_exact(&mut l, &cat, &src, 1).unwrap_err().to_string();
    assert!(
        msg.contains(&format!("sample {outside}")) && msg.contains(&name),
        "{msg}"
    );
}

/// The node agent over the partial space (the AWS variables set above):
/// its one node poller thread reads the held samples from the NVMe and the
/// others from the bucket for two attached ranks (a split backend, whose
/// GETs end the thread's `poll(2)` through a read of their eventfd queued on
/// the ring), exactly what the same ranks read embedded, over two epochs.
fn agent_over_the_bucket(space: &Path, tmp: &Path) {
    use agent_support::{finish, read_args, spawn_read, Agent};
    let sock = tmp.join("agent.sock");
    let agent = Agent::start(space, &sock, &["--node-pollers", "1", "--no-mlock"]);
    // Rings that hold the largest imagenet-profile sample.
    let args = |r: u32, mode: &[&str]| {
        let mut a = read_args(space, r, 2, 2, mode);
        let at = a.iter().position(|x| x == "--ring-bytes").expect("flag") + 1;
        a[at] = "16MiB".into();
        a.push("--no-mlock".into());
        a
    };
    let ranks: Vec<_> = (0..2)
        .map(|r| {
            spawn_read(&args(
                r,
                &["--agent", "required", "--agent-socket", s(&sock)],
            ))
        })
        .collect();
    for (r, child) in ranks.into_iter().enumerate() {
        let want = finish(spawn_read(&args(r as u32, &["--agent", "off"])));
        assert_eq!(finish(child), want, "rank {r} attached");
    }
    assert!(!agent.log.all().contains("panicked"), "{}", agent.log.all());
}

/// Three nodes serving partial spaces from the bucket (two copies, each
/// node a ninth of the dataset): the module doc's cluster case.
fn three_nodes_over_the_bucket(srv: &S3Server, url: &str, src: &Path, tmp: &Path) {
    const NODES: usize = 3;
    let catalog = tmp.join("cluster-cat.ksc");
    srv.ok(&["catalog", "--source", url, "--out", s(&catalog)], LIMIT);
    let cat = Catalog::open(&catalog).unwrap();
    let budget = (cat.total_bytes() / 9).to_string();
    let spaces: Vec<PathBuf> = (0..NODES)
        .map(|i| {
            let sp = tmp.join(format!("node{i}"));
            srv.ok(
                &[
                    "preload",
                    "--source",
                    url,
                    "--catalog",
                    s(&catalog),
                    "--space",
                    s(&sp),
                    "--nodes",
                    "3",
                    "--node-index",
                    &i.to_string(),
                    "--replicas",
                    "2",
                    "--max-bytes",
                    &budget,
                ],
                LIMIT,
            );
            sp
        })
        .collect();
    // The model, from the manifests alone: who holds what.
    let opened: Vec<Space> = spaces.iter().map(|p| Space::open(p).unwrap()).collect();
    let (mut local, mut remote, mut nobody) = (0u64, 0u64, 0u64);
    for id in 0..cat.len() {
        let h: Vec<usize> = (0..NODES)
            .filter(|&n| opened[n].location(id).is_some())
            .collect();
        match h.as_slice() {
            [] => nobody += 1,
            h if h.contains(&0) => local += 1,
            _ => remote += 1,
        }
    }
    assert!(local > 0 && remote > 0 && nobody > 0);
    let token = tmp.join("token");
    std::fs::write(&token, "s3-partial-token\n").unwrap();
    let mut serves: Vec<Option<nodes::Serve>> = spaces
        .iter()
        .map(|sp| Some(nodes::Serve::start(sp, "127.0.0.1:0", &token, None)))
        .collect();
    let addrs: Vec<String> = serves
        .iter()
        .map(|sv| sv.as_ref().unwrap().addr.clone())
        .collect();
    let cluster = nodes::cluster_of(&addrs);
    let rank = |epochs: u64| {
        builder(&spaces[0])
            .cluster(cluster.clone())
            .token(b"s3-partial-token")
            .node_timeout(Duration::from_secs(2))
            .end_epoch(Some(epochs))
            .build()
            .unwrap()
    };
    let mut l = rank(2);
    read_exact(&mut l, &cat, src, 2).unwrap();
    let st = l.stats();
    assert_eq!(st.failovers, 0, "a grant went to a node without the sample");
    assert_eq!(st.disk_reads, local * 2, "{st:?}");
    assert_eq!(st.remote_samples, remote * 2, "{st:?}");
    assert_eq!(st.source_reads, nobody * 2, "{st:?}");
    drop(l);
    // Node 1 killed after the third batch: what it held comes from node 2
    // where node 2 holds it, else from the bucket; the epoch is exact.
    let sampler = Sampler::new(SamplerConfig::single(cat.len(), SEED)).unwrap();
    let mut l = rank(1);
    l.set_epoch(0).unwrap();
    let (mut k, mut batches) = (0u64, 0u64);
    while let Some(b) = l.next_batch().unwrap() {
        for smp in b.iter() {
            assert_eq!(smp.id, sampler.sample(0, k), "step {k}");
            let c = cat.sample(smp.id);
            assert_eq!(crc32c::crc32c(smp.bytes), c.crc32c, "sample {}", smp.id);
            k += 1;
        }
        drop(b);
        batches += 1;
        if batches == 3 {
            serves[1].take().unwrap().kill9();
        }
    }
    assert_eq!(k, cat.len());
    assert!(serves[1].is_none(), "node 1 was killed mid-epoch");
    assert!(l.stats().source_reads >= nobody);
}

/// `kspeed read` on the partial space, SIGKILLed once it talks to the
/// bucket (a socket among its descriptors: the GETs have started); then
/// `kspeed verify` passes and a rerun reads an epoch exactly.
fn killed_mid_epoch_then_verified_and_rerun(
    srv: &S3Server,
    space: &Path,
    cat: &Catalog,
    src: &Path,
) {
    let mut cmd = srv.kspeed_cmd(&["read", "--space", s(space), "--epochs", "1000"]);
    cmd.args(["--no-huge-pages", "--no-mlock"])
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    let mut child = cmd.spawn().unwrap();
    let fd_dir = format!("/proc/{}/fd", child.id());
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let talking = std::fs::read_dir(&fd_dir).is_ok_and(|d| {
            d.flatten().any(|f| {
                std::fs::read_link(f.path())
                    .is_ok_and(|t| t.to_string_lossy().starts_with("socket:"))
            })
        });
        if talking {
            break;
        }
        assert!(
            child.try_wait().unwrap().is_none(),
            "kspeed read ended before it was killed"
        );
        assert!(Instant::now() < deadline, "no GET within 60 s");
        std::thread::yield_now();
    }
    child.kill().unwrap();
    child.wait().unwrap();
    srv.ok(&["verify", "--space", s(space)], LIMIT);
    let mut l = builder(space).end_epoch(Some(1)).build().unwrap();
    read_exact(&mut l, cat, src, 1).unwrap();
}
