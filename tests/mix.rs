//! Weighted mixing of datasets through the Loader and `kspeed read --mix`
//! (issue 29 part 2): a space and a source side by side in one id space,
//! each sample byte-exact, labelled with its dataset, in the mixing
//! function's order with the weights' exact counts; positions resume the
//! same mixture and refuse other weights by name; the CLI's order is the
//! same in two processes; `kspeed audit` of the ranks' files alone proves a
//! mixture's epoch exactly once across new weights.

mod common;

use std::path::{Path, PathBuf};

use common::*;
use kspeed::dataset::Catalog;
use kspeed::landing::{CudaMode, LandingOptions};
use kspeed::loader::{Loader, LoaderBuilder};
use kspeed::sampler::{epoch_counts, MixSampler, SamplerConfig, Weight};
use kspeed::Error;

fn ring() -> LandingOptions {
    LandingOptions::default()
        .ring_bytes(8 << 20)
        .huge_pages(false)
        .mlock(false)
        .cuda(CudaMode::Off)
}

/// Dataset 0: a `tiny` space of 300 samples; dataset 1: an awkward tree
/// read from its source with a catalog. Returns (space, catalog of the
/// source, each dataset's catalog).
fn two_datasets(dir: &Path) -> (PathBuf, PathBuf, Vec<Catalog>) {
    let src = dir.join("src0");
    gen("tiny", 300, &src);
    let space = dir.join("space0");
    ok(&["preload", "--source", s(&src), "--space", s(&space)]);
    let src1 = dir.join("src1");
    odd_tree(&src1);
    let cat1 = dir.join("one.ksc");
    ok(&["catalog", "--source", s(&src1), "--out", s(&cat1)]);
    let cats = vec![
        Catalog::open(&space.join("catalog.ksc")).unwrap(),
        Catalog::open(&cat1).unwrap(),
    ];
    (space, cat1, cats)
}

fn builder(space: &Path, cat1: &Path, w: [Weight; 2]) -> LoaderBuilder {
    LoaderBuilder::mix([(s(space), w[0]), (s(cat1), w[1])])
        .mix_epoch_size(200)
        .batch_size(16)
        .seed(5)
        .landing(ring())
        .pollers(2)
}

/// Reads epoch `e` to its end (from wherever the loader is) and checks
/// every sample against its dataset's catalog; returns (dataset, id).
fn read_epoch(l: &mut Loader, e: u64, cats: &[Catalog]) -> Vec<(u32, u64)> {
    l.set_epoch(e).unwrap();
    let offsets = l.dataset_offsets().to_vec();
    let mut got = Vec::new();
    while let Some(b) = l.next_batch().unwrap() {
        for smp in b.iter() {
            let d = smp.dataset as usize;
            assert!(
                smp.id >= offsets[d],
                "id {} below dataset {d}'s offset",
                smp.id
            );
            let local = smp.id - offsets[d];
            let c = cats[d].sample(local);
            assert_eq!(
                smp.bytes.len(),
                c.len as usize,
                "dataset {d} sample {local}"
            );
            assert_eq!(
                crc32c::crc32c(smp.bytes),
                c.crc32c,
                "dataset {d} sample {local} bytes"
            );
            assert_eq!(smp.label, c.label);
            got.push((smp.dataset, smp.id));
        }
    }
    got
}

#[test]
fn a_space_and_a_source_mixed_in_order_and_byte_exact() {
    let t = tempfile::tempdir().unwrap();
    let (space, cat1, cats) = two_datasets(t.path());
    let lens = [cats[0].len(), cats[1].len()];
    let w = [Weight::Proportion(0.7), Weight::Proportion(0.3)];
    let counts = epoch_counts(&w, &lens, Some(200)).unwrap();
    assert_eq!(counts, vec![140, 60]);
    for (rank, world) in [(0, 1), (1, 3)] {
        let mut l = builder(&space, &cat1, w).rank(rank, world).build().unwrap();
        assert_eq!(l.dataset_offsets(), &[0, lens[0]]);
        assert_eq!(l.catalogs().len(), 2);
        let cfg = SamplerConfig::single(0, 5).rank_world(rank, world);
        let want = MixSampler::new(cfg, &lens, &counts).unwrap();
        for e in 0..2 {
            let got = read_epoch(&mut l, e, &cats);
            let order = want.epoch(e);
            assert_eq!(got.len() as u64, order.per_rank(), "epoch {e}");
            for (k, &(d, id)) in got.iter().enumerate() {
                let m = order.sample(k as u64);
                assert_eq!((d, id), (m.dataset, m.id), "rank {rank} epoch {e} step {k}");
            }
            if world == 1 {
                // The weights' exact counts; the odd tree (13 samples) is
                // drawn 60 times: each sample 4 or 5 times.
                let from1 = got.iter().filter(|g| g.0 == 1).count();
                assert_eq!((got.len() - from1, from1), (140, 60));
            }
        }
    }
}

/// A memory tier over a mixture holds what the mixture reads again: the
/// 13-sample tree drawn 60 times an epoch is the tier (its members chosen
/// by the mixture's known reads, in its ids after the space's), so after
/// its first reads every one of its draws is a tier hit and only the space
/// is read from disk; byte-exact and in the mixing function's order, with
/// the tier's bytes copied into the ring and, with `tier_views`, handed out
/// in place. (Counted over the job, `end_epoch` 3: a read ahead into the
/// next epoch counts in the epoch it was read in.)
#[test]
fn a_memory_tier_keeps_what_a_mixture_draws_again() {
    let t = tempfile::tempdir().unwrap();
    let (space, cat1, cats) = two_datasets(t.path());
    let lens = [cats[0].len(), cats[1].len()];
    let w = [Weight::Proportion(0.7), Weight::Proportion(0.3)];
    let counts = epoch_counts(&w, &lens, Some(200)).unwrap();
    // Exactly the tree's slots (each length rounded up to 64 bytes).
    let tree_bytes: u64 = (0..lens[1])
        .map(|i| u64::from(cats[1].sample(i).len).next_multiple_of(64))
        .sum();
    let epochs = 3;
    for views in [false, true] {
        let mut l = builder(&space, &cat1, w)
            .tier_bytes(tree_bytes)
            .tier_views(views)
            .end_epoch(Some(epochs))
            .build()
            .unwrap();
        let want = MixSampler::new(SamplerConfig::single(0, 5), &lens, &counts).unwrap();
        // Draws of the tree's samples with bytes (an empty one is neither
        // read nor a hit), in epoch 0 and in all; draws of the space.
        let (mut tree_first, mut tree_all, mut space_all) = (0u64, 0u64, 0u64);
        for e in 0..epochs {
            let got = read_epoch(&mut l, e, &cats);
            let order = want.epoch(e);
            assert_eq!(got.len() as u64, order.per_rank(), "epoch {e}");
            for (k, &(d, id)) in got.iter().enumerate() {
                let m = order.sample(k as u64);
                assert_eq!(
                    (d, id),
                    (m.dataset, m.id),
                    "views {views} epoch {e} step {k}"
                );
            }
            let tree = got
                .iter()
                .filter(|&&(d, id)| d == 1 && cats[1].sample(id - lens[0]).len > 0)
                .count() as u64;
            tree_first += if e == 0 { tree } else { 0 };
            tree_all += tree;
            space_all += got.iter().filter(|g| g.0 == 0).count() as u64;
        }
        let st = l.stats();
        // A tree draw is a hit or a read (its first fills the member; a
        // draw read again before its fill landed is read too).
        let tree_reads = tree_all - st.tier_hits;
        assert_eq!(
            st.disk_reads,
            space_all + tree_reads,
            "views {views}: only the space's samples and the tree's misses read"
        );
        assert!(
            (12..=tree_first).contains(&tree_reads),
            "views {views}: {} tier hits of {tree_all} tree draws ({tree_first} in epoch 0)",
            st.tier_hits
        );
    }
}

#[test]
fn positions_resume_the_mixture_and_refuse_other_weights() {
    let t = tempfile::tempdir().unwrap();
    let (space, cat1, cats) = two_datasets(t.path());
    let w = [Weight::Proportion(0.7), Weight::Proportion(0.3)];
    let mut l = builder(&space, &cat1, w).build().unwrap();
    let full = read_epoch(&mut l, 1, &cats);
    // Stop after 3 batches of epoch 1, save, resume in a new loader.
    l.set_epoch(1).unwrap();
    for _ in 0..3 {
        l.next_batch().unwrap().unwrap();
    }
    let saved = l.save_position();
    drop(l);
    let mut again = builder(&space, &cat1, w).build().unwrap();
    again.restore_position(&saved).unwrap();
    let rest = read_epoch(&mut again, 1, &cats);
    assert_eq!(&full[48..], &rest[..]);
    // Other weights: refused by name (the loader's per-rank positions
    // resume one mixture; the sampler's KSPDMIX1 positions change weights).
    let mut other = builder(
        &space,
        &cat1,
        [Weight::Proportion(0.5), Weight::Proportion(0.5)],
    )
    .build()
    .unwrap();
    match other.restore_position(&saved) {
        Err(Error::BadPosition(m)) => assert!(m.contains("weights"), "{m}"),
        r => panic!("{r:?}"),
    }
}

#[test]
fn mixture_options_are_checked_by_name() {
    let t = tempfile::tempdir().unwrap();
    let (space, cat1, _) = two_datasets(t.path());
    // A mixture of proportions and counts; an empty epoch.
    let r = LoaderBuilder::mix([
        (s(&space), Weight::Proportion(0.5)),
        (s(&cat1), Weight::Choose(3)),
    ])
    .landing(ring())
    .build();
    assert!(
        matches!(r, Err(Error::InvalidConfig(ref m)) if m.contains("proportion")),
        "{:?}",
        r.err()
    );
    let r = builder(&space, &cat1, [Weight::Repeat(1.0), Weight::Repeat(1.0)])
        .mix_epoch_size(5)
        .build();
    assert!(
        matches!(r, Err(Error::InvalidConfig(ref m)) if m.contains("epoch size")),
        "{:?}",
        r.err()
    );
    let r = builder(&space, &cat1, [Weight::Choose(0), Weight::Choose(0)]).build();
    assert!(r.is_err());
    let mut o = kspeed::loader::LoaderOptions::new();
    match o.set("mix", &format!("{}:0.5x", s(&space))) {
        Err(Error::InvalidOption { problem, .. }) => assert!(problem.contains("0.5x"), "{problem}"),
        r => panic!("{r:?}"),
    }
    o.set(
        "mix",
        &format!("{}:repeat=2,{}:choose=7", s(&space), s(&cat1)),
    )
    .unwrap();
    o.set("batch_size", "10").unwrap();
    o.set("mlock", "false").unwrap();
    o.set("ring_bytes", "8MiB").unwrap();
    let l = o.builder().unwrap().build().unwrap();
    assert_eq!(l.epoch_len(), 600 + 7);
}

/// `kspeed read --mix` in two processes: the same per-dataset counts and
/// the same order digest; another seed, another order; the flag once per
/// dataset is the comma list.
#[test]
fn cli_mixture_is_the_same_in_two_processes() {
    let t = tempfile::tempdir().unwrap();
    let (space, cat1, _) = two_datasets(t.path());
    let first = format!("{}:0.7", s(&space));
    let second = format!("{}:0.3", s(&cat1));
    let mix = format!("{first},{second}");
    let run_with = |mix_args: &[&str], seed: &str| -> Vec<String> {
        let mut args = vec!["read"];
        for m in mix_args {
            args.extend(["--mix", m]);
        }
        let out = ok(&[
            &args[..],
            &[
                "--mix-epoch-size",
                "200",
                "--epochs",
                "2",
                "--seed",
                seed,
                "--ring-bytes",
                "8MiB",
                "--no-mlock",
                "--no-huge-pages",
                "--batch-size",
                "16",
            ],
        ]
        .concat());
        out.lines()
            .filter(|l| l.contains("mixture"))
            .map(String::from)
            .collect()
    };
    let run = |seed: &str| run_with(&[&mix], seed);
    let a = run("3");
    assert_eq!(a.len(), 2, "{a:?}");
    assert!(
        a[0].contains("140 from dataset 0, 60 from dataset 1"),
        "{a:?}"
    );
    assert_eq!(a, run("3"));
    assert_ne!(a, run("4"));
    assert_eq!(a, run_with(&[&first, &second], "3"));
    // The order given is the mixture's: the other order is another one.
    assert_ne!(a, run_with(&[&second, &first], "3"));
    // A bad entry is refused by the options table's message.
    let err = fails(&["read", "--mix", &format!("{}:-1", s(&space))], 2);
    assert!(err.contains("mix"), "{err}");
}

/// A mixture's job resumes at another world size: 2 ranks read 3 batches
/// of epoch 1, the job position goes to 3 ranks, and the two worlds'
/// samples, put back at their places in the epoch's global order (rank r's
/// step k of a world of W from base b is index b + r + k·W), are the mixed
/// epoch exactly (the one-rank order), each place once; the resumed world's
/// places past the epoch's end are its padding. A mixture's saved position
/// is refused by the audit, by name (the file cannot give the mixed order).
#[test]
fn a_mixture_resumes_at_another_world_size_exactly_once() {
    let t = tempfile::tempdir().unwrap();
    let (space, cat1, cats) = two_datasets(t.path());
    let w = [Weight::Proportion(0.7), Weight::Proportion(0.3)];
    let mut one = builder(&space, &cat1, w).build().unwrap();
    let full = read_epoch(&mut one, 1, &cats);
    assert_eq!(full.len(), 200);
    let mut placed: Vec<Option<(u32, u64)>> = vec![None; full.len()];
    let mut put = |j: u64, got: (u32, u64)| {
        if (j as usize) < placed.len() {
            assert!(placed[j as usize].is_none(), "index {j} delivered twice");
            placed[j as usize] = Some(got);
        }
    };
    let (mut job, mut rank_file) = (None, None);
    let mut rank_files = Vec::new();
    for rank in 0..2 {
        let mut l = builder(&space, &cat1, w).rank(rank, 2).build().unwrap();
        l.set_epoch(1).unwrap();
        let mut k = 0u64;
        for _ in 0..3 {
            let b = l.next_batch().unwrap().unwrap();
            for smp in b.iter() {
                put(rank as u64 + 2 * k, (smp.dataset, smp.id));
                k += 1;
            }
        }
        l.release_batch();
        let saved = kspeed::sampler::SavedPosition::decode(&l.save_position()).unwrap();
        assert!(saved.mixture && saved.mix.is_some());
        rank_files.push(saved);
        job = Some(l.save_job_position());
        rank_file = Some(l.save_position());
    }
    let job = job.unwrap();
    let base = 96;
    for rank in 0..3u32 {
        let mut l = builder(&space, &cat1, w).rank(rank, 3).build().unwrap();
        l.restore_job_position(&job).unwrap();
        let got = read_epoch(&mut l, 1, &cats);
        assert_eq!(got.len(), 35, "rank {rank}: 104 left over 3 ranks, padded");
        rank_files.push(kspeed::sampler::SavedPosition::decode(&l.save_position()).unwrap());
        for (k, &g) in got.iter().enumerate() {
            put(base + rank as u64 + 3 * k as u64, g);
        }
    }
    let placed: Vec<(u32, u64)> = placed
        .into_iter()
        .map(|p| p.expect("every index"))
        .collect();
    assert_eq!(placed, full);
    // The 5 ranks' files alone audit the epoch (the same weights: the
    // second world goes on in the first world's order).
    let reports = kspeed::sampler::audit_positions(&rank_files).unwrap();
    assert_eq!(
        reports[0].to_string(),
        "epoch 1: 200 samples, each exactly once, and 1 padding duplicates"
    );
    assert!(kspeed::sampler::audit_positions(&rank_files[1..]).is_err());
    // A rank's file records the weights only as a hash: other weights
    // refuse it by name (the job position, KSPDMIX1, resumes them: below).
    let mut other = builder(
        &space,
        &cat1,
        [Weight::Proportion(0.5), Weight::Proportion(0.5)],
    )
    .build()
    .unwrap();
    match other.restore_job_position(&rank_file.unwrap()) {
        Err(Error::BadPosition(m)) => assert!(m.contains("weights"), "{m}"),
        r => panic!("{r:?}"),
    }
}

/// Choose-count weights (no epoch size): `n0` of the space's 300 samples
/// and `n1` of the odd tree's 13 per epoch, every count within its
/// dataset's length, so no sample comes twice in an epoch.
fn counts_builder(space: &Path, cat1: &Path, n0: u64, n1: u64) -> LoaderBuilder {
    LoaderBuilder::mix([
        (s(space), Weight::Choose(n0)),
        (s(cat1), Weight::Choose(n1)),
    ])
    .batch_size(16)
    .seed(5)
    .landing(ring())
    .pollers(2)
}

/// A job reads part of epoch 1 on 2 ranks with weights A (120 + 8 samples),
/// and resumes its job position (`KSPDMIX1`) on 3 ranks with weights B
/// (200 + 12): the rest of the epoch follows B. Checked independently of
/// the loader's interleave: each dataset's ids over both worlds are the
/// first `max(c_B, used under A)` entries of its stream (its keyed
/// permutation, docs/FORMAT.md), each exactly once; the second world
/// delivers B's counts less what A had used. `audit_mix` of every rank's
/// digest of both worlds passes (and fails without the first world's). A
/// rank position taken after the change is refused by a fresh loader of B
/// until the job position is restored, then resumes exactly; and a B
/// position of an ordinary epoch still resumes in a loader that had
/// changed weights.
#[test]
fn a_mixture_resumes_under_new_weights_exactly_once() {
    use kspeed::sampler::{audit_mix, dataset_seed, pass_key, MixPosition, Permutation};
    let t = tempfile::tempdir().unwrap();
    let (space, cat1, cats) = two_datasets(t.path());
    let ids: Vec<u32> = cats.iter().map(|c| c.identity()).collect();
    let (epoch, lens) = (1u64, [300u64, 13]);
    // The stream entries of dataset d in epoch 1, as ids.
    let stream = |d: usize, n: u64| -> Vec<u64> {
        let p = Permutation::new(lens[d], dataset_seed(5, d as u64), pass_key(epoch, 0));
        let offset = if d == 0 { 0 } else { lens[0] };
        (0..n).map(|e| offset + p.apply(e)).collect()
    };
    let mut delivered: Vec<(u32, u64)> = Vec::new();
    let mut digests = Vec::new();
    // World 1: 2 ranks, weights A, 2 batches each (64 of 128 entries).
    let mut job = None;
    for rank in 0..2 {
        let mut l = counts_builder(&space, &cat1, 120, 8)
            .rank(rank, 2)
            .build()
            .unwrap();
        l.set_epoch(epoch).unwrap();
        for _ in 0..2 {
            let b = l.next_batch().unwrap().unwrap();
            delivered.extend(b.iter().map(|smp| (smp.dataset, smp.id)));
        }
        l.release_batch();
        digests.push(l.digest().0);
        job = Some(l.save_job_position());
    }
    let job = job.unwrap();
    assert_eq!(job.len(), MixPosition::bytes_for(2), "a KSPDMIX1 position");
    let used_a = [0u32, 1].map(|d| delivered.iter().filter(|x| x.0 == d).count() as u64);
    assert_eq!(used_a.iter().sum::<u64>(), 64);
    // World 2: 3 ranks, weights B.
    let (b0, b1) = (200u64, 12u64);
    let mut second: Vec<(u32, u64)> = Vec::new();
    let mut end = None;
    let mut mid_rank0 = None;
    for rank in 0..3u32 {
        let mut l = counts_builder(&space, &cat1, b0, b1)
            .rank(rank, 3)
            .build()
            .unwrap();
        l.restore_job_position(&job).unwrap();
        let rest = (b0 - used_a[0]) + (b1 - used_a[1]);
        let steps = l.epoch_steps(epoch);
        assert_eq!(steps, rest.div_ceil(3), "the rest under B, padded");
        let got = read_epoch(&mut l, epoch, &cats);
        assert_eq!(got.len() as u64, steps);
        for (k, &g) in got.iter().enumerate() {
            // Rank r's step k is entry r + 3k of the rest; past it: padding.
            if (rank as u64 + 3 * k as u64) < rest {
                second.push(g);
            }
        }
        digests.push(l.digest().0);
        let at_end = kspeed::sampler::JobPosition {
            epoch,
            consumed: 3 * steps,
        };
        end = Some((l.encode_job_position(at_end), l.mixture().unwrap().clone()));
        if rank == 0 {
            // A rank position one batch into the rest under B.
            l.restore_job_position(&job).unwrap();
            next_ids(&mut l);
            let after = next_ids(&mut l);
            l.restore_job_position(&job).unwrap();
            next_ids(&mut l);
            mid_rank0 = Some((l.save_position(), after));
        }
    }
    // The rest follows B: B's counts less what A had used.
    for (d, want) in [(0u32, b0 - used_a[0]), (1, b1 - used_a[1])] {
        assert_eq!(
            second.iter().filter(|x| x.0 == d).count() as u64,
            want,
            "dataset {d} after the change"
        );
    }
    // Both worlds: each dataset's first c_B stream entries, each once.
    delivered.extend(&second);
    for (d, n) in [(0u32, b0), (1, b1)] {
        let mut got: Vec<u64> = delivered.iter().filter(|x| x.0 == d).map(|x| x.1).collect();
        got.sort_unstable();
        let mut want = stream(d as usize, n);
        want.sort_unstable();
        assert_eq!(got, want, "dataset {d}: its stream's first {n}, once each");
    }
    // The audit, from the digests of both worlds and the last position.
    let (end, mix) = end.unwrap();
    let end = MixPosition::restore(&end, &mix, &ids).unwrap();
    let report = audit_mix(&mix, &end, &digests).unwrap();
    assert_eq!(report.samples, b0 + b1);
    assert!(audit_mix(&mix, &end, &digests[2..]).is_err());
    // A rank position of the rest needs its job position first.
    let (mid, after) = mid_rank0.unwrap();
    let mut fresh = counts_builder(&space, &cat1, b0, b1)
        .rank(0, 3)
        .build()
        .unwrap();
    match fresh.restore_position(&mid) {
        Err(Error::BadPosition(m)) => assert!(m.contains("KSPDMIX1"), "{m}"),
        r => panic!("{r:?}"),
    }
    fresh.restore_job_position(&job).unwrap();
    fresh.restore_position(&mid).unwrap();
    assert_eq!(next_ids(&mut fresh), after);
    // An ordinary epoch-1 position of B, in that loader (which had changed
    // weights): B's own order goes on.
    let mut plain = counts_builder(&space, &cat1, b0, b1)
        .rank(0, 3)
        .build()
        .unwrap();
    plain.set_epoch(epoch).unwrap();
    next_ids(&mut plain);
    let ordinary = plain.save_position();
    let want = next_ids(&mut plain);
    fresh.restore_position(&ordinary).unwrap();
    assert_eq!(next_ids(&mut fresh), want);
}

/// (dataset, id) of the next batch's samples (the loader holds the batch
/// until its next call).
fn next_ids(l: &mut Loader) -> Vec<(u32, u64)> {
    let b = l.next_batch().unwrap().expect("a batch");
    b.iter().map(|x| (x.dataset, x.id)).collect()
}

/// Runs ranks `0..world` of `b` from job position `job` to the end of
/// epoch 1 and writes each rank's saved position (`KSPDPOS4`) to
/// `dir/<name>.<rank>.pos`; returns the files.
fn finish_epoch(
    b: impl Fn() -> LoaderBuilder,
    world: u32,
    job: &[u8],
    cats: &[Catalog],
    dir: &Path,
    name: &str,
) -> Vec<PathBuf> {
    (0..world)
        .map(|rank| {
            let mut l = b().rank(rank, world).build().unwrap();
            l.restore_job_position(job).unwrap();
            assert!(!read_epoch(&mut l, 1, cats).is_empty());
            let f = dir.join(format!("{name}.{rank}.pos"));
            std::fs::write(&f, l.save_position()).unwrap();
            f
        })
        .collect()
}

fn audit_cli(files: &[PathBuf]) -> std::process::Output {
    let args: Vec<&str> = files.iter().map(|f| s(f)).collect();
    kspeed(&[&["audit"], &args[..]].concat())
}

/// `kspeed audit` of a mixture's rank files alone (`KSPDPOS4`), through
/// the real binary: 2 ranks of weights A take 2 batches of epoch 1, then 3
/// ranks of weights B resume the job position and finish the epoch (the
/// rest follows B: 212 - 64 entries over 3 ranks, 2 padding duplicates).
/// The 5 files pass; the failures exit 3 naming the first difference: the
/// first world's files missing, the second world resumed from a job
/// position after the first world's files (samples skipped) or before
/// them (delivered twice), a rank's digest missing a sample or holding one
/// twice, a rank's file missing; a mixture's older `KSPDPOS3` (no lengths
/// or weights) exits 1 naming KSPDPOS4. A second-world file restored in a
/// fresh loader saves the same bytes (the order of its digest's epoch kept).
#[test]
fn cli_audits_a_mixture_across_new_weights() {
    use kspeed::sampler::{EpochDigest, SavedPosition};
    let t = tempfile::tempdir().unwrap();
    let (space, cat1, cats) = two_datasets(t.path());
    let dir = t.path();
    let a = || counts_builder(&space, &cat1, 120, 8);
    let b = || counts_builder(&space, &cat1, 200, 12);
    // World 1: each rank's file and the job position after 1 and 2 batches.
    let (mut after1, mut after2) = (Vec::new(), Vec::new());
    let (mut job1, mut job2) = (Vec::new(), Vec::new());
    let mut first_ids = Vec::new();
    for rank in 0..2 {
        let mut l = a().rank(rank, 2).build().unwrap();
        l.set_epoch(1).unwrap();
        first_ids.push(next_ids(&mut l));
        l.release_batch();
        let f = dir.join(format!("a1.{rank}.pos"));
        std::fs::write(&f, l.save_position()).unwrap();
        after1.push(f);
        job1 = l.save_job_position();
        next_ids(&mut l);
        l.release_batch();
        let f = dir.join(format!("a2.{rank}.pos"));
        std::fs::write(&f, l.save_position()).unwrap();
        after2.push(f);
        job2 = l.save_job_position();
    }
    let bytes = std::fs::read(&after2[0]).unwrap();
    assert_eq!(&bytes[..8], b"KSPDPOS4");
    assert_eq!(bytes.len(), SavedPosition::mix_bytes(2));
    let second = finish_epoch(b, 3, &job2, &cats, dir, "b");
    let good: Vec<PathBuf> = after2.iter().chain(&second).cloned().collect();
    let o = audit_cli(&good);
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(
        String::from_utf8_lossy(&o.stdout),
        "epoch 1: 212 samples, each exactly once, and 2 padding duplicates\n"
    );
    // A second-world file restored in a fresh loader of B (its next
    // sample is epoch 2's, an ordinary epoch) saves the same bytes: the
    // order of its digest's epoch (what A had used) is kept from the file.
    let end = std::fs::read(&second[0]).unwrap();
    let saved_end = SavedPosition::decode(&end).unwrap();
    assert_eq!((saved_end.next.epoch, saved_end.digest.epoch), (2, 1));
    assert!(saved_end.mix.as_ref().unwrap().skip.iter().sum::<u64>() == 64);
    let mut fresh = b().rank(0, 3).build().unwrap();
    fresh.restore_position(&end).unwrap();
    assert_eq!(fresh.save_position(), end);
    drop(fresh);
    let fails = |files: &[PathBuf], what: &str| {
        let o = audit_cli(files);
        assert_eq!(o.status.code(), Some(3), "{what}: {}", text(&o));
        assert!(text(&o).contains(what), "{what}: {}", text(&o));
    };
    // The first world's files missing.
    fails(&second, "the world that began the epoch are missing");
    // The second world resumed from a job position past the first world's
    // files: the first world's second batches were never delivered.
    let skipped: Vec<PathBuf> = after1.iter().chain(&second).cloned().collect();
    fails(&skipped, "samples were skipped");
    // ... or from one before them: their samples came again.
    let again = finish_epoch(b, 3, &job1, &cats, dir, "again");
    let twice: Vec<PathBuf> = after2.iter().chain(&again).cloned().collect();
    fails(&twice, "delivered twice");
    // A rank's file missing.
    fails(&good[1..], "1 rank positions for a world of 2");
    // A rank's digest without one of its samples, or with one twice.
    let f = &good[0];
    let saved = SavedPosition::decode(&std::fs::read(f).unwrap()).unwrap();
    let edit = |count: i64, id: u64| {
        let mut e = saved.clone();
        e.digest.count = e.digest.count.wrapping_add_signed(count);
        let h = EpochDigest::hash(1, id);
        e.digest.sum = if count < 0 {
            e.digest.sum.wrapping_sub(h)
        } else {
            e.digest.sum.wrapping_add(h)
        };
        std::fs::write(f, e.save()).unwrap();
    };
    edit(-1, first_ids[0][3].1);
    fails(&good, "some skipped");
    edit(1, first_ids[1][0].1);
    fails(&good, "some delivered twice");
    std::fs::write(f, saved.save()).unwrap();
    let o = audit_cli(&good);
    assert!(o.status.success(), "{}", text(&o));
    // A mixture's KSPDPOS3 (saved before positions recorded the mixture).
    let old = dir.join("old.pos");
    let legacy = SavedPosition { mix: None, ..saved };
    std::fs::write(&old, legacy.save()).unwrap();
    assert_eq!(std::fs::metadata(&old).unwrap().len(), 108);
    let o = audit_cli(&[old]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("KSPDPOS4"), "{}", text(&o));
}
