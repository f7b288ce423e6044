//! Tests of the mixing function (`mix.rs`): counts, the interleave and its
//! inverse, window proportions over 10^7 positions, the ranks' cover,
//! frozen values, positions and resume with the same and new weights.

use super::*;
use crate::sampler::{counts_hash, Position, Sampler};
use proptest::prelude::*;

fn cfg(seed: u64, rank: u32, world: u32, drop_last: bool) -> SamplerConfig {
    SamplerConfig {
        len: 0,
        seed,
        shuffle: true,
        rank,
        world,
        drop_last,
        shuffle_block: 0,
    }
}

fn rank_seq(s: &MixSampler, epoch: u64) -> Vec<MixSample> {
    let e = s.epoch(epoch);
    (0..e.per_rank()).map(|k| e.sample(k)).collect()
}

#[test]
fn counts_from_weights() {
    use Weight::*;
    // Largest remainder: 10 · (0.5, 0.3, 0.2) exactly; 7 · thirds: 3, 2, 2.
    let c = epoch_counts(
        &[Proportion(0.5), Proportion(0.3), Proportion(0.2)],
        &[5, 5, 5],
        Some(10),
    );
    assert_eq!(c.unwrap(), vec![5, 3, 2]);
    let third = 1.0 / 3.0;
    let c = epoch_counts(&[Proportion(third); 3], &[1, 1, 1], Some(7)).unwrap();
    assert_eq!(c, vec![3, 2, 2]);
    // Not normalised; the epoch size defaults to the total length.
    let c = epoch_counts(&[Proportion(7.0), Proportion(3.0)], &[600, 400], None).unwrap();
    assert_eq!(c, vec![700, 300]);
    let c = epoch_counts(&[Repeat(2.0), Choose(5), Repeat(0.5)], &[10, 10, 11], None).unwrap();
    assert_eq!(c, vec![20, 5, 5]);
    for bad in [
        epoch_counts(&[Proportion(0.5), Choose(3)], &[4, 4], None),
        epoch_counts(&[Proportion(0.0), Proportion(0.0)], &[4, 4], None),
        epoch_counts(&[Choose(0), Choose(0)], &[4, 4], None),
        epoch_counts(&[Choose(1)], &[4], Some(3)),
        epoch_counts(&[Choose(1)], &[0], None),
        epoch_counts(&[Proportion(f64::NAN)], &[4], None),
        epoch_counts(&[Proportion(-1.0)], &[4], None),
        epoch_counts(&[Choose(1)], &[4, 4], None),
        epoch_counts(&[Choose(u64::MAX), Choose(1)], &[4, 4], None),
    ] {
        assert!(matches!(bad, Err(Error::InvalidConfig(_))), "{bad:?}");
    }
    assert_eq!("0.7".parse::<Weight>().unwrap(), Proportion(0.7));
    assert_eq!("repeat=2".parse::<Weight>().unwrap(), Repeat(2.0));
    assert_eq!("choose=9".parse::<Weight>().unwrap(), Choose(9));
    assert!("choose=1.5".parse::<Weight>().is_err());
    assert!("-2".parse::<Weight>().is_err());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    /// Every position has one (dataset, slot); slot and position are
    /// inverses; each dataset gets exactly its count; prefix counts agree
    /// with counting.
    #[test]
    fn interleave_is_a_bijection(counts in proptest::collection::vec(0u64..300, 1..9)) {
        prop_assume!(counts.iter().sum::<u64>() > 0);
        let lens = vec![1000; counts.len()];
        let s = MixSampler::new(cfg(1, 0, 1, false), &lens, &counts).unwrap();
        let o = s.order(0);
        let mut seen: Vec<u64> = vec![0; counts.len()];
        for j in 0..o.len() {
            let (d, k) = o.slot(j);
            prop_assert_eq!(k, seen[d], "slots of a dataset come in order");
            seen[d] += 1;
            prop_assert_eq!(o.position(d, k), j);
            for (e, &c) in seen.iter().enumerate() {
                prop_assert_eq!(o.count_before(e, j + 1), c);
            }
        }
        prop_assert_eq!(seen, counts);
    }

    /// Every window of any length holds floor/ceil of its share, within the
    /// bound the tree proves.
    #[test]
    fn windows_within_the_bound(counts in proptest::collection::vec(0u64..200, 1..7), len in 1u64..400) {
        prop_assume!(counts.iter().sum::<u64>() > 0);
        let lens = vec![1000; counts.len()];
        let s = MixSampler::new(cfg(1, 0, 1, false), &lens, &counts).unwrap();
        let o = s.order(0);
        let t = o.len();
        for (d, &count) in counts.iter().enumerate() {
            let share = len as f64 * count as f64 / t as f64;
            let bound = o.window_bound(d);
            // Windows that wrap around (padding): the order repeated.
            let at = |n: u64| (n / t) * count + o.count_before(d, n % t);
            for start in 0..t {
                let c = at(start + len) - at(start);
                prop_assert!((c as f64 - share).abs() < bound + 1e-9,
                    "dataset {} window at {}: {} vs {} (bound {})", d, start, c, share, bound);
            }
        }
    }
}

/// Windows of 1,000 over 10^7 positions, sliding: two datasets within
/// floor/ceil of the share (±1), three and four within one more (what the
/// construction proves: under 2 away from the exact share).
#[test]
#[cfg_attr(miri, ignore)]
fn proportions_over_ten_million() {
    const T: u64 = 10_000_000;
    const L: u64 = 1_000;
    let sqrt2 = std::f64::consts::SQRT_2;
    let third = 1.0 / 3.0;
    // Shares of a 1,000-window that are whole numbers (0.7 / 0.3) and
    // that are not (the others).
    for props in [
        &[0.7, 0.3][..],
        &[sqrt2 - 1.0, 2.0 - sqrt2],
        &[0.5, 0.3, 0.2],
        &[third, third, third],
        &[
            0.5,
            std::f64::consts::FRAC_1_PI,
            0.5 - std::f64::consts::FRAC_1_PI,
        ],
        &[0.4, 0.3, 1.0 / 7.0, 0.3 - 1.0 / 7.0],
    ] {
        let weights: Vec<Weight> = props.iter().map(|&p| Weight::Proportion(p)).collect();
        let lens = vec![T; props.len()];
        let counts = epoch_counts(&weights, &lens, Some(T)).unwrap();
        let s = MixSampler::new(cfg(7, 0, 1, false), &lens, &counts).unwrap();
        let o = s.order(3);
        assert_eq!(o.len(), T);
        let mut which = vec![0u8; T as usize];
        for j in 0..T {
            which[j as usize] = o.slot(j).0 as u8;
        }
        let mut count = vec![0i64; props.len()];
        let mut worst = 0f64;
        for j in 0..T as usize {
            count[which[j] as usize] += 1;
            if j >= L as usize {
                count[which[j - L as usize] as usize] -= 1;
            }
            if j + 1 >= L as usize {
                for (d, &c) in count.iter().enumerate() {
                    let share = L as f64 * counts[d] as f64 / T as f64;
                    let off = (c as f64 - share).abs();
                    worst = worst.max(off);
                    let slack = if props.len() == 2 { 0.0 } else { 1.0 };
                    assert!(
                        c as f64 >= share.floor() - slack && c as f64 <= share.ceil() + slack,
                        "{props:?}: dataset {d} has {c} of the window ending at {j} (share {share})"
                    );
                }
            }
        }
        eprintln!("{props:?}: worst |count - share| over 1,000-windows: {worst:.3}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(100))]

    /// A one-dataset mixture that takes the dataset once per epoch is the
    /// plain sampler's sequence, for every rank.
    #[test]
    fn one_dataset_is_the_plain_sampler(
        n in 1u64..500, seed in any::<u64>(), epoch in 0u64..100,
        world in 1u32..6, drop_last in any::<bool>(), shuffle in any::<bool>(),
    ) {
        let counts = epoch_counts(&[Weight::Repeat(1.0)], &[n], None).unwrap();
        prop_assert_eq!(&counts, &vec![n]);
        for rank in 0..world {
            let c = SamplerConfig { shuffle, ..cfg(seed, rank, world, drop_last) };
            let m = MixSampler::new(c, &[n], &counts).unwrap();
            let p = Sampler::new(SamplerConfig { len: n, ..c }).unwrap();
            let mixed: Vec<u64> = rank_seq(&m, epoch).iter().map(|s| s.id).collect();
            let plain: Vec<u64> = p.iter_from(Position { epoch, index: 0 }).collect();
            prop_assert_eq!(mixed, plain);
        }
    }

    /// The ranks together take every slot of the epoch once (plus the
    /// padding, the order's start), every rank the same number of steps;
    /// a dataset drawn at most its length gives distinct samples, one drawn
    /// more cycles (each sample floor or ceil of count/length times).
    #[test]
    fn ranks_cover_the_mixed_epoch(
        lens in proptest::collection::vec(1u64..60, 1..5),
        counts_seed in any::<u64>(),
        world in 1u32..7, drop_last in any::<bool>(), seed in any::<u64>(), epoch in 0u64..50,
    ) {
        let counts: Vec<u64> = lens.iter().enumerate()
            .map(|(d, &n)| mix64(counts_seed ^ d as u64) % (2 * n + 1)).collect();
        let t: u64 = counts.iter().sum();
        prop_assume!(t > 0);
        let mut got: Vec<Vec<u64>> = lens.iter().map(|&n| vec![0; n as usize]).collect();
        let mut steps = None;
        let mut total = 0;
        for rank in 0..world {
            let s = MixSampler::new(cfg(seed, rank, world, drop_last), &lens, &counts).unwrap();
            let seq = rank_seq(&s, epoch);
            prop_assert_eq!(*steps.get_or_insert(seq.len()), seq.len());
            for m in seq {
                prop_assert_eq!(m.id, s.offsets()[m.dataset as usize] + m.local);
                prop_assert_eq!(s.dataset_of(m.id), m.dataset);
                got[m.dataset as usize][m.local as usize] += 1;
                total += 1;
            }
        }
        let w = world as u64;
        let expect_total = if drop_last { t / w * w } else { t.div_ceil(w) * w };
        prop_assert_eq!(total, expect_total);
        if !drop_last {
            // Without padding duplicates (the first total - t positions of
            // the order), each dataset has its count, spread by passes.
            let s = MixSampler::new(cfg(seed, 0, 1, false), &lens, &counts).unwrap();
            let o = s.order(epoch);
            for j in 0..total - t {
                let m = o.sample(j % t);
                got[m.dataset as usize][m.local as usize] -= 1;
            }
            for (d, g) in got.iter().enumerate() {
                let (c, n) = (counts[d], lens[d]);
                prop_assert_eq!(g.iter().sum::<u64>(), c);
                for &x in g {
                    prop_assert!(x == c / n || x == c.div_ceil(n), "dataset {d}: {x} of {c}/{n}");
                }
            }
        }
    }
}

#[test]
fn frozen_mixed_sequence() {
    // The mixed order is part of the contract (docs/FORMAT.md, "Mixing
    // datasets"); a change here reorders every mixed job.
    let lens = [10u64, 6, 4];
    let counts = epoch_counts(
        &[
            Weight::Proportion(0.5),
            Weight::Proportion(0.3),
            Weight::Proportion(0.2),
        ],
        &lens,
        None,
    )
    .unwrap();
    assert_eq!(counts, vec![10, 6, 4]);
    let s = MixSampler::new(cfg(1, 0, 1, false), &lens, &counts).unwrap();
    let o = s.order(0);
    let which: Vec<u32> = (0..20).map(|j| o.sample(j).dataset).collect();
    let ids: Vec<u64> = (0..20).map(|j| o.sample(j).id).collect();
    assert_eq!(
        which,
        [2, 1, 0, 1, 0, 2, 0, 1, 0, 0, 2, 1, 0, 1, 0, 2, 0, 1, 0, 0]
    );
    assert_eq!(
        ids,
        [16, 12, 4, 11, 7, 19, 6, 10, 3, 2, 18, 13, 1, 15, 5, 17, 0, 14, 8, 9]
    );
    // Dataset 0 is keyed with the job's seed: its slots are the plain
    // sampler's order of 10 (docs/FORMAT.md): 4 7 6 3 2 1 5 0 8 9.
    let zero: Vec<u64> = (0..20).filter(|&j| which[j] == 0).map(|j| ids[j]).collect();
    assert_eq!(zero, [4, 7, 6, 3, 2, 1, 5, 0, 8, 9]);
    assert_eq!(counts_hash(&counts), 0x89e0_8085_e547_c159);
    // A dataset of 4 drawn twice (seed 1, epoch 2): two passes, the
    // second under pass key 1.
    let twice = epoch_counts(&[Weight::Repeat(2.0)], &[4], None).unwrap();
    let s = MixSampler::new(cfg(1, 0, 1, false), &[4], &twice).unwrap();
    let o = s.order(2);
    let ids: Vec<u64> = (0..8).map(|j| o.sample(j).id).collect();
    assert_eq!(ids, [3, 2, 1, 0, 0, 3, 1, 2]);
}

#[test]
fn positions_round_trip_and_refuse_other_jobs() {
    let lens = [100u64, 50];
    let s = MixSampler::new(cfg(9, 1, 4, false), &lens, &[70, 30]).unwrap();
    let pos = s.position(2, 11);
    assert_eq!(pos.consumed, 44);
    let bytes = pos.save(&s, &[0xa, 0xb]);
    assert_eq!(bytes.len(), MixPosition::bytes_for(2));
    assert_eq!(MixPosition::restore(&bytes, &s, &[0xa, 0xb]).unwrap(), pos);
    // Another world and other weights read it too (the datasets are the same).
    let other_w = MixSampler::new(cfg(9, 0, 3, false), &lens, &[50, 50]).unwrap();
    assert_eq!(
        MixPosition::restore(&bytes, &other_w, &[0xa, 0xb]).unwrap(),
        pos
    );
    let refused = [
        MixPosition::restore(&bytes, &s, &[0xa, 0xc]),
        MixPosition::restore(
            &bytes,
            &MixSampler::new(cfg(8, 1, 4, false), &lens, &[70, 30]).unwrap(),
            &[0xa, 0xb],
        ),
        MixPosition::restore(
            &bytes,
            &MixSampler::new(cfg(9, 1, 4, false), &[100, 51], &[70, 30]).unwrap(),
            &[0xa, 0xb],
        ),
        MixPosition::restore(
            &bytes,
            &MixSampler::new(cfg(9, 1, 4, false), &[100, 50, 1], &[70, 30, 1]).unwrap(),
            &[0xa, 0xb, 0],
        ),
        MixPosition::restore(&bytes[..40], &s, &[0xa, 0xb]),
    ];
    for r in refused {
        assert!(matches!(r, Err(Error::BadPosition(_))), "{r:?}");
    }
    let mut bad = bytes.clone();
    bad[50] ^= 1;
    match MixPosition::restore(&bad, &s, &[0xa, 0xb]) {
        Err(Error::BadPosition(m)) => assert!(m.contains("checksum"), "{m}"),
        r => panic!("{r:?}"),
    }
}

/// Runs `world` lock-step ranks of `s` for `steps` steps of `epoch` (all
/// of the epoch if `None`); returns the samples delivered that are not
/// padding, and how many padding duplicates were delivered besides.
fn run_job(s: &MixSampler, world: u32, epoch: u64, steps: Option<u64>) -> (Vec<MixSample>, u64) {
    let mut out = Vec::new();
    let mut padding = 0;
    for rank in 0..world {
        let mut c = *s.config();
        c.rank = rank;
        c.world = world;
        let r = MixSampler {
            cfg: c,
            ..s.clone()
        };
        let e = r.epoch(epoch);
        for k in 0..steps.unwrap_or(e.per_rank()).min(e.per_rank()) {
            if e.global_index(k) < e.order().len() {
                out.push(e.sample(k));
            } else {
                padding += 1;
            }
        }
    }
    (out, padding)
}

fn sorted_ids(v: &[MixSample]) -> Vec<u64> {
    let mut ids: Vec<u64> = v.iter().map(|m| m.id).collect();
    ids.sort_unstable();
    ids
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    /// Saving mid-epoch and resuming with the same weights at another
    /// world size delivers the rest of the same order: together, the
    /// epoch's order exactly once besides the padding.
    #[test]
    fn resume_same_weights_any_world(
        lens in proptest::collection::vec(20u64..80, 2..4),
        w1 in 1u32..9, w2 in 1u32..9, cut in 0u64..40, seed in any::<u64>(),
    ) {
        let counts: Vec<u64> = lens.iter().map(|&n| n / 2 + 3).collect();
        let s = MixSampler::new(cfg(seed, 0, w1, false), &lens, &counts).unwrap();
        let steps = cut.min(s.per_rank(5));
        let (mut got, _) = run_job(&s, w1, 5, Some(steps));
        let bytes = s.position(5, steps).save(&s, &[]);
        let s2 = MixSampler::new(cfg(seed, 0, w2, false), &lens, &counts).unwrap();
        let s2 = s2.resume(&MixPosition::restore(&bytes, &s2, &[]).unwrap()).unwrap();
        got.extend(run_job(&s2, w2, 5, None).0);
        let o = s.order(5);
        let want: Vec<MixSample> = (0..o.len()).map(|j| o.sample(j)).collect();
        prop_assert_eq!(sorted_ids(&got), sorted_ids(&want));
        // The next epoch is ordinary again, at the new world.
        prop_assert_eq!(s2.per_rank(6), o.len().div_ceil(w2 as u64));
        prop_assert_eq!(s2.epoch(6).sample(0), MixSampler { cfg: *s2.config(), ..s.clone() }.epoch(6).sample(0));
    }

    /// Resuming with new weights (any number of times, at any world): no
    /// stream entry twice in the epoch (no sample twice, the counts being
    /// below the lengths), and each dataset ends the epoch with its last
    /// count, or what it had used before the last change if more (what it
    /// had used when a world consumed the order to its end: that ends the
    /// epoch, whatever the weights after).
    #[test]
    fn resume_new_weights_no_repeats(
        cuts in proptest::collection::vec((0u64..30, 1u32..6, any::<u64>()), 1..4),
        seed in any::<u64>(),
    ) {
        let lens = [120u64, 90, 60];
        let mut counts = vec![40u64, 30, 20];
        let mut s = MixSampler::new(cfg(seed, 0, 2, false), &lens, &counts).unwrap();
        let mut world = 2;
        let mut got: Vec<MixSample> = Vec::new();
        let mut finished = None;
        for (steps, w_next, wseed) in cuts {
            let steps = steps.min(s.per_rank(1));
            got.extend(run_job(&s, world, 1, Some(steps)).0);
            let pos = s.position(1, steps);
            if finished.is_none() && pos.consumed >= s.order(1).len() {
                // The order consumed to its end: the epoch is over, and
                // the resumes after it are in the next one.
                finished = Some(s.used(&pos));
            }
            let new_counts: Vec<u64> = (0..3).map(|d| 10 + mix64(wseed ^ d) % 50).collect();
            let next = MixSampler::new(cfg(seed, 0, w_next, false), &lens, &new_counts).unwrap();
            let bytes = pos.save(&s, &[1, 2, 3]);
            s = next.resume(&MixPosition::restore(&bytes, &next, &[1, 2, 3]).unwrap()).unwrap();
            counts = new_counts;
            world = w_next;
        }
        got.extend(run_job(&s, world, 1, None).0);
        let ids = sorted_ids(&got);
        let mut dedup = ids.clone();
        dedup.dedup();
        prop_assert_eq!(dedup.len(), ids.len(), "a sample twice in the epoch");
        let mut used = [0u64; 3];
        for m in &got {
            used[m.dataset as usize] += 1;
        }
        for d in 0..3 {
            let want = match &finished {
                Some(u) => u[d],
                None => counts[d].max(s.start.skip[d]),
            };
            prop_assert_eq!(used[d], want, "dataset {}", d);
        }
        // The next epoch is the new weights' ordinary epoch.
        prop_assert_eq!(s.order(2).len(), counts.iter().sum::<u64>());
    }
}
#[test]
fn resume_new_weights_follows_them() {
    // 300 + 300 at 50/50, saved after 200 positions (100 each); the rest
    // at 90/10 of 600: dataset 0 gets 540 - 100 = 440 more, dataset 1
    // 60 - 100 < 0: none.
    let lens = [1000u64, 1000];
    let s = MixSampler::new(cfg(3, 0, 1, false), &lens, &[300, 300]).unwrap();
    let pos = s.position(0, 200);
    let next = MixSampler::new(cfg(3, 0, 1, false), &lens, &[540, 60]).unwrap();
    let r = next.resume(&pos).unwrap();
    let e = r.epoch(0);
    assert_eq!(e.per_rank(), 440);
    let before: Vec<MixSample> = (0..200).map(|j| s.order(0).sample(j)).collect();
    let after: Vec<MixSample> = (0..440).map(|k| e.sample(k)).collect();
    assert!(after.iter().all(|m| m.dataset == 0));
    let mut ids: Vec<u64> = before.iter().chain(&after).map(|m| m.id).collect();
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len(), 640, "no sample twice in the epoch");
    // The same weights again: the very order, after the prefix.
    let same = s.resume(&pos).unwrap();
    let e = same.epoch(0);
    assert_eq!(e.per_rank(), 400);
    for k in 0..400 {
        assert_eq!(e.sample(k), s.order(0).sample(200 + k));
    }
}

/// Cost per position (run in release: `cargo test --release --lib
/// mix_cost -- --ignored --nocapture`): the plain sampler against
/// mixtures of 1, 3 and 16 datasets.
#[test]
#[ignore]
fn mix_cost_per_position() {
    const T: u64 = 10_000_000;
    let time = |what: &str, f: &dyn Fn(u64) -> u64| {
        let t0 = std::time::Instant::now();
        let mut acc = 0u64;
        for k in 0..T {
            acc = acc.wrapping_add(f(k));
        }
        let ns = t0.elapsed().as_nanos() as f64 / T as f64;
        eprintln!("{what}: {ns:.1} ns/position ({acc})");
    };
    let plain = Sampler::new(SamplerConfig::single(T, 1)).unwrap();
    let e = plain.epoch(0);
    time("plain sampler", &|k| e.sample(k));
    for d in [1usize, 3, 16] {
        let lens = vec![T / d as u64; d];
        let s = MixSampler::new(cfg(1, 0, 1, false), &lens, &lens).unwrap();
        let e = s.epoch(0);
        time(&format!("mixture of {d}"), &|k| e.sample(k).id);
    }
}

/// Stream entry `s` of dataset `d` (first pass, shuffled) from the
/// permutation alone, as docs/FORMAT.md states it: a check of the sampler
/// independent of the interleave.
fn stream_id(lens: &[u64], seed: u64, epoch: u64, d: usize, s: u64) -> u64 {
    assert!(s < lens[d], "one pass");
    let offset: u64 = lens[..d].iter().sum();
    offset + Permutation::new(lens[d], dataset_seed(seed, d as u64), pass_key(epoch, 0)).apply(s)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    /// The loader's path (an `ElasticSampler` over `Sampler::mixed`)
    /// through resumes under new weights at other worlds, with or without
    /// drop_last: every rank's step is the mixture's own dealing; what the
    /// ranks delivered (padding aside) is, for each dataset d, its stream
    /// entries `0..u_d` exactly once (checked from the permutation alone),
    /// `u_d` being what the last position says it used; `audit_mix` of
    /// every rank's digest passes, and fails on a skipped, a repeated and
    /// a foreign sample. The ranks' saved positions (`KSPDPOS4`, as the
    /// loader saves them) audit the same from the files alone
    /// (`audit_positions`: worlds chained across new weights), and fail
    /// with a rank's file missing or a sample skipped.
    #[test]
    fn new_weights_through_the_elastic_sampler_audit_exactly_once(
        cuts in proptest::collection::vec((0u64..30, 1u32..6, any::<u64>()), 1..4),
        seed in any::<u64>(),
        drop_last in any::<bool>(),
        first_world in 1u32..6,
    ) {
        use crate::sampler::{
            audit_mix, audit_positions, ElasticSampler, EpochDigest, JobPosition, SavedMix,
            SavedPosition,
        };
        let mut files: Vec<SavedPosition> = Vec::new();
        let (lens, ids) = ([120u64, 90, 60], [4u32, 5, 6]);
        let epoch = 1;
        let mut s = MixSampler::new(cfg(seed, 0, first_world, drop_last), &lens, &[40, 30, 20]).unwrap();
        let mut job = JobPosition { epoch, consumed: 0 };
        let mut digests = Vec::new();
        let mut delivered = Vec::new();
        let mut rank_ids: Vec<Vec<u64>> = Vec::new();
        let mut padding = 0u64;
        let mut at = None;
        let last = cuts.len();
        for (i, &(cut, w_next, wseed)) in cuts.iter().chain([(u64::MAX, 1, 0)].iter()).enumerate() {
            let world = s.config().world;
            let mut steps = 0;
            for rank in 0..world {
                let c = s.config().rank_world(rank, world);
                let own = MixSampler { cfg: c, ..s.clone() };
                let es = ElasticSampler::over(Sampler::mixed(own.clone()).unwrap(), job).unwrap();
                let (order, mine) = (es.epoch(epoch), own.epoch(epoch));
                prop_assert_eq!(es.per_rank(epoch), mine.per_rank());
                steps = cut.min(es.per_rank(epoch));
                let mut dg = EpochDigest::new(epoch);
                let mut own_ids = Vec::new();
                for k in 0..steps {
                    let id = order.sample(k);
                    prop_assert_eq!(id, mine.sample(k).id, "rank {} step {}", rank, k);
                    dg.add(id);
                    if order.global_index(k) < s.order_len(epoch) {
                        delivered.push(id);
                        own_ids.push(id);
                    } else {
                        padding += 1;
                    }
                }
                if job.epoch <= epoch {
                    // This rank's file, as the loader saves it.
                    let at = es.rank_position(Position { epoch, index: steps });
                    let saved = SavedPosition {
                        cfg: *es.config(),
                        catalog_identity: 0,
                        mixture: true,
                        mix: Some(SavedMix {
                            fingerprint: own.fingerprint(&ids),
                            lens: lens.to_vec(),
                            counts: s.counts().to_vec(),
                            skip: s.job_position(epoch, 0).skip,
                        }),
                        next: at,
                        digest: dg,
                        digest_at: at,
                    };
                    prop_assert_eq!(&SavedPosition::decode(&saved.save()).unwrap(), &saved);
                    files.push(saved);
                }
                digests.push(dg);
                rank_ids.push(own_ids);
            }
            let pos = if job.epoch <= epoch {
                // This world dealt the epoch: the audit's position so far.
                let pos = s.job_position(epoch, job.consumed + steps * world as u64);
                at = Some((s.clone(), pos.clone()));
                pos
            } else {
                // An earlier world finished it: this one is in the next.
                s.job_position(job.epoch, job.consumed)
            };
            if i == last {
                let (s, pos) = at.take().unwrap();
                // The end: what the job used, from the sampler, against
                // what it delivered, from the permutation.
                let used = s.used(&pos);
                let mut want: Vec<u64> = (0..3)
                    .flat_map(|d| (0..used[d]).map(move |e| stream_id(&lens, seed, epoch, d, e)))
                    .collect();
                want.sort_unstable();
                let mut got = delivered.clone();
                got.sort_unstable();
                prop_assert_eq!(&got, &want);
                let report = audit_mix(&s, &pos, &digests).unwrap();
                prop_assert_eq!(report.samples, want.len() as u64);
                prop_assert_eq!(report.padding, padding);
                prop_assert_eq!(audit_positions(&files).unwrap(), vec![report]);
                if let Some(i) = (0..files.len()).find(|&i| files[i].cfg.world > 1) {
                    let mut short = files.clone();
                    short.remove(i);
                    prop_assert!(audit_positions(&short).is_err());
                }
                // A skipped sample, a repeated one, a foreign one (the
                // next entry of dataset 0's stream, not delivered).
                let Some(first) = rank_ids.iter().position(|v| !v.is_empty()) else {
                    return Ok(());
                };
                let mut skipped = digests.clone();
                let one = rank_ids[first][0];
                skipped[first].count -= 1;
                skipped[first].sum = skipped[first].sum.wrapping_sub(EpochDigest::hash(epoch, one));
                prop_assert!(audit_mix(&s, &pos, &skipped).is_err());
                let mut skipped_file = files.clone();
                let f = skipped_file.iter().position(|f| f.digest.count > 0).unwrap();
                skipped_file[f].digest.count -= 1;
                prop_assert!(matches!(
                    audit_positions(&skipped_file),
                    Err(Error::AuditMismatch(m)) if m.contains("skipped")
                ));
                let mut repeated = skipped.clone();
                repeated[first].add(delivered[delivered.len() - 1]);
                prop_assert!(audit_mix(&s, &pos, &repeated).is_err());
                let mut foreign = skipped.clone();
                foreign[first].add(stream_id(&lens, seed, epoch, 0, used[0]));
                prop_assert!(audit_mix(&s, &pos, &foreign).is_err());
            } else {
                let new_counts: Vec<u64> = (0..3).map(|d| 10 + mix64(wseed ^ d) % 50).collect();
                let next = MixSampler::new(cfg(seed, 0, w_next, drop_last), &lens, &new_counts).unwrap();
                let bytes = pos.save(&s, &ids);
                s = next.resume(&MixPosition::restore(&bytes, &next, &ids).unwrap()).unwrap();
                // The next epoch's start if this world finished the order.
                job = s.start_position();
            }
        }
    }
}
