//! Resume at another world size through the real loader over a preloaded
//! space (issue 29 part 1): one epoch dealt by 8, then 5, then 12, then 1
//! ranks, each from the job position the world before left; every sample
//! byte-checked against the catalog and in the order the sampler gives,
//! the union of delivered ids the epoch exactly once (checked with counts,
//! independently of the digest), the digests audited by the library and by
//! `kspeed audit`, which also catches an edited digest (a skipped and a
//! repeated sample); restores of another job refused by name; the same
//! in cluster mode (every sample from two node services over TCP).

mod common;

use std::path::{Path, PathBuf};

use common::*;
use kspeed::dataset::{Catalog, Space};
use kspeed::loader::{Loader, LoaderBuilder};
use kspeed::sampler::{
    audit_positions, ElasticSampler, EpochDigest, JobPosition, Position, RankPosition, Sampler,
    SamplerConfig, SavedPosition,
};
use kspeed::Error;

const SEED: u64 = 17;
const BATCH: usize = 4;
const EPOCH: u64 = 2;

fn space(dir: &Path, count: u64) -> PathBuf {
    let src = dir.join("src");
    gen("tiny", count, &src);
    let sp = dir.join("space");
    ok(&["preload", "--source", s(&src), "--space", s(&sp)]);
    sp
}

fn loader(sp: &Path, rank: u32, world: u32, drop_last: bool) -> Loader {
    LoaderBuilder::space(sp)
        .batch_size(BATCH)
        .seed(SEED)
        .rank(rank, world)
        .drop_last(drop_last)
        .pollers(1)
        .pin(false)
        .landing(test_ring(1 << 20))
        .start_at(Position {
            epoch: EPOCH,
            index: 0,
        })
        .build()
        .unwrap()
}

/// Takes up to `batches` batches (all of the epoch: `None`), checking each
/// sample's bytes against the catalog and its id against `want(k)`;
/// returns the ids.
fn take(l: &mut Loader, cat: &Catalog, batches: Option<u64>, want: &ElasticSampler) -> Vec<u64> {
    let mut ids = Vec::new();
    let mut taken = 0;
    while batches.is_none_or(|b| taken < b) {
        let Some(b) = l.next_batch().unwrap() else {
            break;
        };
        taken += 1;
        for smp in b.iter() {
            let k = smp.position.index;
            assert_eq!(smp.position.epoch, EPOCH);
            assert_eq!(smp.id, want.sample(EPOCH, k), "step {k}: wrong sample");
            let c = cat.sample(smp.id);
            assert_eq!(smp.bytes.len(), c.len as usize);
            assert_eq!(
                crc32c::crc32c(smp.bytes),
                c.crc32c,
                "sample {} bytes",
                smp.id
            );
            assert_eq!(smp.label, c.label);
            ids.push(smp.id);
        }
    }
    ids
}

struct Run {
    /// Every rank's saved position at the end of its world, in order.
    files: Vec<PathBuf>,
    /// How often each id was delivered.
    seen: Vec<u32>,
    /// The job position after the last world.
    end: JobPosition,
    /// Samples the ranks got from node services, and read from the source.
    remote_samples: u64,
    source_reads: u64,
}

/// Deals epoch `EPOCH` through `worlds` (world size, batches per rank; the
/// last world to the end), each world's ranks one after another (lock-step
/// is each taking the same batches), resuming from the job position the
/// world before saved (alternately its KSPDJOB1 bytes and a rank's
/// KSPDPOS3 file).
fn run(dir: &Path, sp: &Path, worlds: &[(u32, u64)], drop_last: bool) -> Run {
    let space = Space::open(sp).unwrap();
    run_with(dir, space.catalog(), worlds, drop_last, &|rank, world| {
        loader(sp, rank, world, drop_last)
    })
}

/// [`run`] with loaders from `make(rank, world)` over catalog `cat`.
fn run_with(
    dir: &Path,
    cat: &Catalog,
    worlds: &[(u32, u64)],
    drop_last: bool,
    make: &dyn Fn(u32, u32) -> Loader,
) -> Run {
    let n = cat.len();
    let cfg = SamplerConfig::single(n, SEED).drop_last(drop_last);
    let mut seen = vec![0u32; n as usize];
    let mut files = Vec::new();
    let mut job = JobPosition {
        epoch: EPOCH,
        consumed: 0,
    };
    let mut resume_from: Option<Vec<u8>> = None;
    let (mut remote_samples, mut source_reads) = (0, 0);
    for (i, &(world, batches)) in worlds.iter().enumerate() {
        let last = i + 1 == worlds.len();
        let mut ranks = Vec::new();
        let mut next_from = None;
        for rank in 0..world {
            let mut l = make(rank, world);
            if let Some(b) = &resume_from {
                l.restore_job_position(b).unwrap();
            }
            assert_eq!(
                l.job_position(),
                job,
                "world {world} rank {rank} starts there"
            );
            let want = ElasticSampler::new(cfg.rank_world(rank, world), job).unwrap();
            let ids = take(&mut l, cat, (!last).then_some(batches), &want);
            for &id in &ids {
                seen[id as usize] += 1;
            }
            let (digest, _) = l.digest();
            assert_eq!(digest.count, ids.len() as u64);
            let st = l.stats();
            assert_eq!(st.digest, digest);
            remote_samples += st.remote_samples;
            source_reads += st.source_reads;
            let f = dir.join(format!("w{i}-{world}-r{rank}.pos"));
            std::fs::write(&f, l.save_position()).unwrap();
            files.push(f);
            ranks.push(l.rank_position());
            next_from.get_or_insert(if i % 2 == 0 {
                l.save_job_position().to_vec()
            } else {
                l.save_position().to_vec()
            });
        }
        if !last {
            job = JobPosition::from_ranks(&ranks).unwrap();
            assert_eq!(job.epoch, EPOCH);
        }
        resume_from = next_from;
    }
    Run {
        files,
        seen,
        end: job,
        remote_samples,
        source_reads,
    }
}

fn audit_cli(files: &[PathBuf]) -> std::process::Output {
    let args: Vec<&str> = files.iter().map(|f| s(f)).collect();
    kspeed(&[&["audit"], &args[..]].concat())
}

#[test]
fn eight_five_twelve_one_ranks_deliver_the_epoch_exactly_once() {
    let t = tempfile::tempdir().unwrap();
    let sp = space(t.path(), 997);
    // 8 x 10 x 4 = 320, + 5 x 12 x 4 = 240, + 12 x 6 x 4 = 288: 848; one
    // rank takes the last 149.
    let r = run(t.path(), &sp, &[(8, 10), (5, 12), (12, 6), (1, 0)], false);
    assert_eq!(r.end.consumed, 848);
    assert!(
        r.seen.iter().all(|&c| c == 1),
        "not exactly once: {:?}",
        r.seen
            .iter()
            .enumerate()
            .filter(|(_, &c)| c != 1)
            .take(5)
            .collect::<Vec<_>>()
    );
    // The library's audit of the 26 files, and the CLI's.
    let saved: Vec<SavedPosition> = r
        .files
        .iter()
        .map(|f| SavedPosition::decode(&std::fs::read(f).unwrap()).unwrap())
        .collect();
    let reports = audit_positions(&saved).unwrap();
    assert_eq!(reports.len(), 1);
    assert_eq!(
        reports[0].to_string(),
        "epoch 2: 997 samples, each exactly once"
    );
    let o = audit_cli(&r.files);
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(
        String::from_utf8_lossy(&o.stdout),
        "epoch 2: 997 samples, each exactly once\n"
    );
}

#[test]
fn with_drop_last_and_padding_the_rules_hold() {
    let t = tempfile::tempdir().unwrap();
    let sp = space(t.path(), 203);
    // drop_last: 8 x 2 x 4 = 64, + 5 x 3 x 4 = 60; the last 79 on 3 ranks:
    // 26 each, 24 in whole batches, 7 dropped, none twice.
    let r = run(t.path(), &sp, &[(8, 2), (5, 3), (3, 0)], true);
    assert!(r.seen.iter().all(|&c| c <= 1));
    assert_eq!(r.seen.iter().filter(|&&c| c == 1).count(), 64 + 60 + 72);
    let o = audit_cli(&r.files);
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(
        String::from_utf8_lossy(&o.stdout),
        "epoch 2: 196 samples, each exactly once\n"
    );
    // Padding: 64 + 60 consumed, 79 left on 6 ranks: 14 steps each, 84,
    // 5 padding duplicates (g(203..208) = the epoch's first 5, consumed by
    // the first world): not owed again, delivered as padding.
    let t = tempfile::tempdir().unwrap();
    let sp = space(t.path(), 203);
    let r = run(t.path(), &sp, &[(8, 2), (5, 3), (6, 0)], false);
    let order = Sampler::new(SamplerConfig::single(203, SEED))
        .unwrap()
        .epoch(EPOCH);
    for id in 0..203u64 {
        let pad = (0..5).any(|j| order.global(j) == id) as u32;
        assert_eq!(r.seen[id as usize], 1 + pad, "sample {id}");
    }
    let o = audit_cli(&r.files);
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(
        String::from_utf8_lossy(&o.stdout),
        "epoch 2: 203 samples, each exactly once, and 5 padding duplicates\n"
    );
}

/// Rewrites a saved position's digest (count and sum) and its checksum.
fn edit_digest(f: &Path, count_delta: i64, sum_delta: u64, add: bool) {
    let mut b = std::fs::read(f).unwrap();
    let count = u64::from_le_bytes(b[88..96].try_into().unwrap());
    let sum = u64::from_le_bytes(b[96..104].try_into().unwrap());
    let sum = if add {
        sum.wrapping_add(sum_delta)
    } else {
        sum.wrapping_sub(sum_delta)
    };
    b[88..96].copy_from_slice(&count.wrapping_add(count_delta as u64).to_le_bytes());
    b[96..104].copy_from_slice(&sum.to_le_bytes());
    let crc = crc32c::crc32c(&b[..104]);
    b[104..108].copy_from_slice(&crc.to_le_bytes());
    std::fs::write(f, b).unwrap();
}

#[test]
fn kspeed_audit_catches_a_skipped_and_a_repeated_sample() {
    let t = tempfile::tempdir().unwrap();
    let sp = space(t.path(), 301);
    let r = run(t.path(), &sp, &[(4, 5), (3, 0)], false);
    let o = audit_cli(&r.files);
    assert!(o.status.success(), "{}", text(&o));
    // Rank 1 of the first world "skipped" its step 3: its digest without it.
    let cfg = SamplerConfig::single(301, SEED).rank_world(1, 4);
    let first = ElasticSampler::new(
        cfg,
        JobPosition {
            epoch: EPOCH,
            consumed: 0,
        },
    )
    .unwrap();
    let id = first.sample(EPOCH, 3);
    let h = EpochDigest::hash(EPOCH, id);
    let f = &r.files[1];
    let good = std::fs::read(f).unwrap();
    edit_digest(f, -1, h, false);
    let o = audit_cli(&r.files);
    assert_eq!(o.status.code(), Some(3), "{}", text(&o));
    assert!(text(&o).contains("some skipped"), "{}", text(&o));
    // Rank 1 delivered a sample of rank 2 as well (repeated).
    std::fs::write(f, &good).unwrap();
    let other = ElasticSampler::new(cfg.rank_world(2, 4), first.start())
        .unwrap()
        .sample(EPOCH, 0);
    edit_digest(f, 1, EpochDigest::hash(EPOCH, other), true);
    let o = audit_cli(&r.files);
    assert_eq!(o.status.code(), Some(3), "{}", text(&o));
    assert!(text(&o).contains("delivered twice"), "{}", text(&o));
    // A repeat in place of another: same count, other sum.
    std::fs::write(f, &good).unwrap();
    edit_digest(f, 0, EpochDigest::hash(EPOCH, other).wrapping_sub(h), true);
    let o = audit_cli(&r.files);
    assert_eq!(o.status.code(), Some(3), "{}", text(&o));
    assert!(text(&o).contains("not the expected ones"), "{}", text(&o));
    // A world's files missing: named, not a digest mismatch.
    std::fs::write(f, &good).unwrap();
    let o = audit_cli(&r.files[4..]);
    assert_eq!(o.status.code(), Some(3), "{}", text(&o));
    assert!(text(&o).contains("stop at 0"), "{}", text(&o));
    // Not a position: exit 1, the file named.
    let junk = t.path().join("junk.pos");
    std::fs::write(&junk, b"not a position").unwrap();
    let o = audit_cli(&[junk]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("junk.pos"), "{}", text(&o));
}

#[test]
fn restores_of_another_job_are_refused_by_name() {
    let t = tempfile::tempdir().unwrap();
    let sp = space(t.path(), 120);
    let mut a = loader(&sp, 1, 4, false);
    a.next_batch().unwrap();
    let job = a.save_job_position();
    let pos = a.save_position();
    let build = |seed: u64, shuffle: bool, drop_last: bool| {
        LoaderBuilder::space(&sp)
            .batch_size(BATCH)
            .seed(seed)
            .shuffle(shuffle)
            .drop_last(drop_last)
            .rank(0, 3)
            .pollers(1)
            .pin(false)
            .landing(test_ring(1 << 20))
            .build()
            .unwrap()
    };
    for (l, what) in [
        (build(SEED + 1, true, false), "seed"),
        (build(SEED, false, false), "shuffle"),
        (build(SEED, true, true), "drop_last"),
    ] {
        let mut l = l;
        for bytes in [&job[..], &pos[..]] {
            match l.restore_job_position(bytes) {
                Err(Error::BadPosition(m)) => {
                    // Named alone: not a list of what might differ.
                    assert!(m.contains(what), "{what}: {m}");
                    for other in ["seed", "shuffle", "drop_last"] {
                        assert!(other == what || !m.contains(other), "{what}: {m}");
                    }
                }
                r => panic!("{what}: {r:?}"),
            }
        }
        // Refused: the loader goes on where it was.
        assert_eq!(l.position(), Position { epoch: 0, index: 0 });
    }
    // A rank position resumes its own rank and world only.
    let mut b = build(SEED, true, false);
    match b.restore_position(&pos) {
        Err(Error::BadPosition(m)) => assert!(m.contains("rank/world"), "{m}"),
        r => panic!("{r:?}"),
    }
    // Another dataset.
    let t2 = tempfile::tempdir().unwrap();
    let sp2 = space(t2.path(), 121);
    let mut c = LoaderBuilder::space(&sp2)
        .batch_size(BATCH)
        .seed(SEED)
        .pollers(1)
        .pin(false)
        .landing(test_ring(1 << 20))
        .build()
        .unwrap();
    match c.restore_job_position(&job) {
        Err(Error::BadPosition(m)) => assert!(m.contains("another dataset"), "{m}"),
        r => panic!("{r:?}"),
    }
}

/// A rank's own position (KSPDPOS3) resumes that rank with its digest, so
/// a job stopped and resumed at the same world audits whole; after a
/// resumed epoch the next is ordinary.
#[test]
fn same_world_resume_keeps_the_digest_and_the_next_epoch_is_ordinary() {
    let t = tempfile::tempdir().unwrap();
    let sp = space(t.path(), 150);
    let space = Space::open(&sp).unwrap();
    let cat = space.catalog();
    let cfg = SamplerConfig::single(150, SEED);
    // 4 ranks take 3 batches; 3 ranks resume and take 2 batches, save,
    // stop; each resumes from its own position and finishes.
    let mut job_files = Vec::new();
    let mut job = None;
    for rank in 0..4 {
        let mut l = loader(&sp, rank, 4, false);
        let want = ElasticSampler::new(cfg.rank_world(rank, 4), l.job_position()).unwrap();
        take(&mut l, cat, Some(3), &want);
        job_files.push(l.save_position());
        job = Some(l.save_job_position());
    }
    let mut mids = Vec::new();
    let start = JobPosition {
        epoch: EPOCH,
        consumed: 48,
    };
    for rank in 0..3 {
        let mut l = loader(&sp, rank, 3, false);
        l.restore_job_position(job.as_ref().unwrap()).unwrap();
        let want = ElasticSampler::new(cfg.rank_world(rank, 3), start).unwrap();
        take(&mut l, cat, Some(2), &want);
        mids.push(l.save_position());
    }
    let mut ends = Vec::new();
    for rank in 0..3 {
        let mut l = loader(&sp, rank, 3, false);
        l.restore_position(&mids[rank as usize]).unwrap();
        assert_eq!(
            l.rank_position(),
            RankPosition {
                epoch: EPOCH,
                base: 48,
                index: 8,
                rank,
                world: 3
            }
        );
        let want = ElasticSampler::new(cfg.rank_world(rank, 3), start).unwrap();
        let rest = take(&mut l, cat, None, &want);
        assert_eq!(rest.len(), 34 - 8);
        assert_eq!(l.digest().0.count, 34);
        ends.push(l.save_position());
        // The next epoch: the plain sampler's sequence.
        l.set_epoch(EPOCH + 1).unwrap();
        let plain = Sampler::new(cfg.rank_world(rank, 3)).unwrap();
        let b = l.next_batch().unwrap().unwrap();
        for (k, smp) in b.iter().enumerate() {
            assert_eq!(smp.id, plain.sample(EPOCH + 1, k as u64));
        }
    }
    let saved: Vec<SavedPosition> = job_files
        .iter()
        .chain(&ends)
        .map(|b| SavedPosition::decode(b).unwrap())
        .collect();
    let r = audit_positions(&saved).unwrap();
    assert_eq!(r[0].to_string(), "epoch 2: 150 samples, each exactly once");
    // The middle files as well as the ends: rank repeated.
    let mut with_mids = saved.clone();
    with_mids.push(SavedPosition::decode(&mids[0]).unwrap());
    match audit_positions(&with_mids) {
        Err(Error::AuditMismatch(m)) => assert!(m.contains("rank"), "{m}"),
        r => panic!("{r:?}"),
    }
}

/// A checkpoint in the middle of a batch (`KSpeedDataset` hands a batch's
/// samples out one at a time): the batch's start position advanced by the
/// samples handed out is the position a loader saves after exactly those
/// samples (one of batch size 1), and the audit of a job that changed
/// world size there, from those positions, finds every sample once.
#[test]
fn a_position_advanced_inside_a_batch_is_the_one_a_loader_saves_there() {
    let t = tempfile::tempdir().unwrap();
    let sp = space(t.path(), 150);
    let space = Space::open(&sp).unwrap();
    let cat = space.catalog();
    let cfg = SamplerConfig::single(150, SEED);
    let handed = 3; // of the third batch, per rank
    let mut advanced = Vec::new();
    let mut at_batch_files = Vec::new();
    let mut job = None;
    for rank in 0..2 {
        let mut l = loader(&sp, rank, 2, false);
        let want = ElasticSampler::new(cfg.rank_world(rank, 2), l.job_position()).unwrap();
        take(&mut l, cat, Some(2), &want);
        at_batch_files.push(l.save_position());
        let at_batch = SavedPosition::decode(&at_batch_files[rank as usize]).unwrap();
        let ids: Vec<u64> = l
            .next_batch()
            .unwrap()
            .unwrap()
            .iter()
            .map(|x| x.id)
            .collect();
        let a = at_batch.advanced(&ids[..handed]).unwrap();
        // One sample at a time, to the same sample.
        let mut one = LoaderBuilder::space(&sp)
            .batch_size(1)
            .seed(SEED)
            .rank(rank, 2)
            .pollers(1)
            .pin(false)
            .landing(test_ring(1 << 20))
            .start_at(Position {
                epoch: EPOCH,
                index: 0,
            })
            .build()
            .unwrap();
        take(&mut one, cat, Some((2 * BATCH + handed) as u64), &want);
        assert_eq!(a, SavedPosition::decode(&one.save_position()).unwrap());
        assert_eq!(at_batch.advanced(&[]).unwrap(), at_batch);
        // Past the rank's 75 steps of the epoch: refused by name.
        let left = 75 - 2 * BATCH;
        assert!(at_batch.advanced(&vec![0; left]).is_ok());
        match at_batch.advanced(&vec![0; left + 1]) {
            Err(kspeed::Error::BadPosition(m)) => assert!(m.contains("75 steps"), "{m}"),
            other => panic!("advanced past the epoch: {other:?}"),
        }
        advanced.push(a);
        job = Some(one.save_job_position());
    }
    // Three ranks go on from there and finish the epoch.
    let start = JobPosition {
        epoch: EPOCH,
        consumed: 2 * (2 * BATCH + handed) as u64,
    };
    let mut saved = advanced.clone();
    for rank in 0..3 {
        let mut l = loader(&sp, rank, 3, false);
        l.restore_job_position(job.as_ref().unwrap()).unwrap();
        let want = ElasticSampler::new(cfg.rank_world(rank, 3), start).unwrap();
        take(&mut l, cat, None, &want);
        saved.push(SavedPosition::decode(&l.save_position()).unwrap());
    }
    let r = audit_positions(&saved).unwrap();
    // 128 left for 3 ranks: 1 padding step.
    assert_eq!(
        r[0].to_string(),
        "epoch 2: 150 samples, each exactly once, and 1 padding duplicates"
    );
    // The batch's start alone (what the checkpoint restores from) misses
    // the samples handed out: the audit says so.
    let mut at_start = saved.clone();
    for rank in 0..2 {
        at_start[rank] = SavedPosition::decode(&at_batch_files[rank]).unwrap();
    }
    match audit_positions(&at_start) {
        Err(Error::AuditMismatch(m)) => assert!(m.contains("stop at"), "{m}"),
        r => panic!("{r:?}"),
    }
}

/// Cluster mode: every sample comes from two in-process node services over
/// TCP (the consumer has only the catalog; the network thread's schedule
/// deals the remainder too): 4 ranks, then 3 from the job position.
#[test]
fn cluster_mode_resumes_at_another_world_size() {
    use kspeed::transport::{Cluster, NodeService, ServeConfig};
    let t = tempfile::tempdir().unwrap();
    let src = t.path().join("src");
    gen("tiny", 250, &src);
    let catalog = t.path().join("cat.ksc");
    ok(&["catalog", "--source", s(&src), "--out", s(&catalog)]);
    let mut services = Vec::new();
    let mut addrs = String::new();
    for i in 0..2 {
        let sp = t.path().join(format!("node{i}"));
        let idx = i.to_string();
        ok(&[
            "preload",
            "--source",
            s(&src),
            "--catalog",
            s(&catalog),
            "--space",
            s(&sp),
            "--nodes",
            "2",
            "--node-index",
            &idx,
        ]);
        let mut cfg = ServeConfig::new(&sp, "127.0.0.1:0", b"elastic-token");
        cfg.pollers = 1;
        cfg.staging_bytes = 1 << 20;
        let svc = NodeService::start(cfg).unwrap();
        addrs.push_str(&format!("{i} {}\n", svc.local_addr()));
        services.push(svc);
    }
    let cluster = Cluster::parse(&addrs, "test").unwrap();
    let cat = Catalog::open(&catalog).unwrap();
    let make = |rank, world| {
        LoaderBuilder::source(s(&src))
            .catalog(&catalog)
            .cluster(cluster.clone())
            .token(b"elastic-token")
            .batch_size(BATCH)
            .seed(SEED)
            .rank(rank, world)
            .pollers(1)
            .pin(false)
            .landing(test_ring(1 << 20))
            .start_at(Position {
                epoch: EPOCH,
                index: 0,
            })
            .build()
            .unwrap()
    };
    let r = run_with(t.path(), &cat, &[(4, 5), (3, 0)], false, &make);
    // 80 consumed, 170 left on 3 ranks: 57 each, 1 padding duplicate.
    assert_eq!(r.seen.iter().filter(|&&c| c == 2).count(), 1);
    // Everything from the nodes (read-ahead included), nothing from the
    // source.
    assert!(r.remote_samples >= 251, "{}", r.remote_samples);
    assert_eq!(r.source_reads, 0);
    assert!(r.seen.iter().all(|&c| c == 1 || c == 2));
    let o = audit_cli(&r.files);
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(
        String::from_utf8_lossy(&o.stdout),
        "epoch 2: 250 samples, each exactly once, and 1 padding duplicates\n"
    );
    for svc in services {
        svc.stop();
    }
}

/// With `end_epoch`, a loader resumed inside the last epoch reads exactly
/// the remainder: nothing past it is read ahead (the end is counted from
/// the resumed epoch's own length, not an ordinary epoch's).
#[test]
fn a_resumed_last_epoch_reads_nothing_past_its_end() {
    let t = tempfile::tempdir().unwrap();
    let sp = space(t.path(), 160);
    let build = |rank, world| {
        LoaderBuilder::space(&sp)
            .batch_size(BATCH)
            .seed(SEED)
            .rank(rank, world)
            .pollers(1)
            .pin(false)
            .landing(test_ring(1 << 20))
            .start_at(Position {
                epoch: EPOCH,
                index: 0,
            })
            .end_epoch(Some(EPOCH + 1))
            .build()
            .unwrap()
    };
    let mut first = build(0, 2);
    for _ in 0..5 {
        first.next_batch().unwrap().unwrap();
    }
    let job = first.save_job_position();
    drop(first);
    // 40 consumed; 120 left on 4 ranks: 30 each.
    let mut l = build(1, 4);
    l.restore_job_position(&job).unwrap();
    assert_eq!(l.epoch_steps(EPOCH), 30);
    // What the run before the restore read ahead (thrown away by it, and
    // counted when it stopped).
    let discarded = l.stats().read_ahead_discarded;
    let mut n = 0;
    while let Some(b) = l.next_batch().unwrap() {
        n += b.len();
    }
    assert_eq!(n, 30);
    let st = l.finish();
    assert_eq!(st.samples, 30);
    assert_eq!(
        (st.read_ahead, st.read_ahead_discarded - discarded),
        (0, 0),
        "read past the end epoch's start"
    );
    assert_eq!(
        st.disk_reads + st.tier_hits,
        st.samples + st.read_ahead_discarded
    );
}
