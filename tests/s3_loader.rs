//! A loader reading a bucket directly (`source = "s3://…"`, no nodes): the
//! pollers' reads are ranged GETs in the rank's order (ring/store.rs).
//! Every sample of two epochs, in the sampler's order, byte for byte the
//! file that was uploaded; ranks of a world split the epoch; an object
//! replaced after the catalog fails its read by name. Real S3 server
//! process (s3s-fs, tests/common/s3.rs).
#![cfg(all(feature = "cli", feature = "s3"))]

mod common;
#[path = "common/s3.rs"]
mod s3h;

use std::collections::HashMap;
use std::time::Duration;

use common::*;
use kspeed::dataset::Catalog;
use kspeed::loader::LoaderBuilder;
use kspeed::sampler::{Sampler, SamplerConfig};
use kspeed::Error;
use s3h::*;

const BUCKET: &str = "direct";
const LIMIT: Duration = Duration::from_secs(240);

#[test]
fn a_loader_reads_a_bucket_directly_in_order_and_byte_exact() {
    let Some(srv) = S3Server::start() else { return };
    srv.create_bucket(BUCKET);
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    gen("imagenet", 200, &src);
    // The uploaded bytes by key, to check what the loader hands out
    // independently of kspeed's catalog.
    let mut uploaded: HashMap<String, Vec<u8>> = HashMap::new();
    for p in files_under(&src) {
        let rel = p.strip_prefix(&src).unwrap().to_string_lossy().into_owned();
        uploaded.insert(rel, std::fs::read(&p).unwrap());
    }
    srv.put_many(
        BUCKET,
        uploaded
            .iter()
            .map(|(k, v)| (format!("train/{k}"), v.clone())),
        16,
        LIMIT,
    );
    // The loader finds the store from the AWS variables, as a user's
    // would (one test in this binary: nothing else reads them).
    for (k, v) in srv.env() {
        std::env::set_var(k, v);
    }
    let url = format!("s3://{BUCKET}/train/");
    let cat_path = tmp.path().join("cat.ksc");
    srv.ok(&["catalog", "--source", &url, "--out", s(&cat_path)], LIMIT);
    let cat = Catalog::open(&cat_path).unwrap();
    assert_eq!(cat.len(), 200);

    for (rank, world) in [(0u32, 1u32), (1, 3)] {
        let mut l = LoaderBuilder::source(&url)
            .catalog(&cat_path)
            .seed(9)
            .rank(rank, world)
            .batch_size(8)
            .pollers(2)
            .queue_depth(16)
            .pin(false)
            .landing(small_landing())
            .build()
            .unwrap();
        let sampler = Sampler::new(
            SamplerConfig::single(cat.len(), 9)
                .rank_world(rank, world)
                .shuffle(true),
        )
        .unwrap();
        for e in 0..2 {
            l.set_epoch(e).unwrap();
            let mut k = 0u64;
            while let Some(b) = l.next_batch().unwrap() {
                for smp in b.iter() {
                    assert_eq!(
                        smp.id,
                        sampler.sample(e, k),
                        "rank {rank}: sample {k} of epoch {e}"
                    );
                    let name = cat
                        .file(cat.sample(smp.id).file)
                        .name
                        .to_string_lossy()
                        .into_owned();
                    assert_eq!(smp.bytes, &uploaded[&name][..], "bytes of {name}");
                    k += 1;
                }
            }
            assert_eq!(k, sampler.per_rank(), "rank {rank}: a whole epoch {e}");
        }
        let stats = l.stats();
        assert!(stats.disk_reads >= 2 * sampler.per_rank(), "{stats:?}");
    }

    // A forked child (a DataLoader worker) builds its own loader on the
    // bucket: it must get its own client and runtime, not wait forever on
    // the parent's, whose threads it does not have.
    // SAFETY: the child only builds a loader, reads and _exits.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork");
    if pid == 0 {
        let ok = (|| -> Result<u64, Error> {
            let mut l = LoaderBuilder::source(&url)
                .catalog(&cat_path)
                .batch_size(8)
                .pollers(1)
                .pin(false)
                .landing(small_landing())
                .build()?;
            l.set_epoch(0)?;
            let mut n = 0;
            while let Some(b) = l.next_batch()? {
                n += b.iter().count() as u64;
            }
            Ok(n)
        })();
        // SAFETY: _exit ends the child without running the parent's atexit
        // handlers or the test harness.
        unsafe { libc::_exit(if matches!(ok, Ok(200)) { 0 } else { 1 }) };
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    let status = loop {
        let mut st = 0;
        // SAFETY: waits for our own child without blocking.
        let r = unsafe { libc::waitpid(pid, &mut st, libc::WNOHANG) };
        if r == pid {
            break st;
        }
        if std::time::Instant::now() > deadline {
            // SAFETY: our own child.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            panic!("a forked child reading the bucket did not finish in 120 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "the forked child's epoch failed (status {status:#x})"
    );

    // An object replaced after the catalog: its read fails, named.
    let victim = cat
        .file(cat.sample(0).file)
        .name
        .to_string_lossy()
        .into_owned();
    srv.put(BUCKET, &format!("train/{victim}"), b"other bytes");
    let mut l = LoaderBuilder::source(&url)
        .catalog(&cat_path)
        .batch_size(8)
        .pollers(1)
        .pin(false)
        .landing(small_landing())
        .build()
        .unwrap();
    let text = epoch_error(&mut l, "a replaced object must fail its read");
    assert!(
        text.contains(&format!("s3://{BUCKET}/train/{victim}")),
        "{text}"
    );
}
