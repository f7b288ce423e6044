//! Resume at other world sizes: every sample of the epoch exactly once,
//! checked with a bitmap (independently of the digest), and the digest's
//! audit catching a skip, a repeat and a swap with another epoch.

use super::*;
use proptest::prelude::*;

fn cfg(len: u64, seed: u64, shuffle: bool, drop_last: bool) -> SamplerConfig {
    SamplerConfig {
        len,
        seed,
        shuffle,
        rank: 0,
        world: 1,
        drop_last,
        shuffle_block: 0,
    }
}

/// What one world of a job delivered in an epoch from `start`, each rank
/// taking `steps` steps (`None`: to the end): per rank, the ids and digest.
struct Dealt {
    per_rank: Vec<Vec<u64>>,
    digests: Vec<EpochDigest>,
    end: JobPosition,
}

fn deal(c: SamplerConfig, world: u32, start: JobPosition, steps: Option<u64>) -> Dealt {
    let mut per_rank = Vec::new();
    let mut digests = Vec::new();
    let mut ranks = Vec::new();
    for rank in 0..world {
        let s = ElasticSampler::new(c.rank_world(rank, world), start).unwrap();
        let n = s.per_rank(start.epoch);
        let b = steps.map_or(n, |b| b.min(n));
        let order = s.epoch(start.epoch);
        let ids: Vec<u64> = (0..b).map(|k| order.sample(k)).collect();
        let mut d = EpochDigest::new(start.epoch);
        ids.iter().for_each(|&id| d.add(id));
        per_rank.push(ids);
        digests.push(d);
        ranks.push(s.rank_position(Position {
            epoch: start.epoch,
            index: b,
        }));
    }
    // Every rank the same count.
    assert!(per_rank.iter().all(|v| v.len() == per_rank[0].len()));
    // Any order of the ranks gives the job position.
    ranks.reverse();
    let end = JobPosition::from_ranks(&ranks).unwrap();
    Dealt {
        per_rank,
        digests,
        end,
    }
}

/// Runs an epoch through `worlds`, each (world, steps) and the last to the
/// end; checks the epoch was delivered exactly once (plus the padding
/// duplicates the rules allow) with a bitmap, and audits the digests.
fn run_epoch(c: SamplerConfig, epoch: u64, worlds: &[(u32, u64)]) -> Result<(), TestCaseError> {
    let n = c.len;
    let mut pos = JobPosition { epoch, consumed: 0 };
    let mut seen = vec![0u32; n as usize];
    let mut digests = Vec::new();
    let mut total = 0u64;
    for (i, &(world, steps)) in worlds.iter().enumerate() {
        let last = i + 1 == worlds.len();
        let d = deal(c, world, pos, (!last).then_some(steps));
        for ids in &d.per_rank {
            for &id in ids {
                prop_assert!(id < n);
                seen[id as usize] += 1;
                total += 1;
            }
        }
        prop_assert_eq!(
            d.end.consumed,
            pos.consumed + d.per_rank[0].len() as u64 * world as u64
        );
        digests.extend(d.digests);
        pos = d.end;
    }
    prop_assert_eq!(total, pos.consumed);
    let last_world = worlds.last().unwrap().0 as u64;
    if c.drop_last {
        // Nothing twice; at most a world's worth left undelivered.
        prop_assert!(seen.iter().all(|&s| s <= 1));
        prop_assert!(n - total < last_world, "n {n} delivered {total}");
    } else {
        // Everything at least once; the extra copies are the first
        // `total - n` of the epoch's order (the padding), fewer than a world.
        let max_world = worlds.iter().map(|w| w.0 as u64).max().unwrap();
        prop_assert!(total >= n && total - n < max_world);
        let order = Sampler::new(c).unwrap().epoch(epoch);
        let mut extra = vec![0u32; n as usize];
        for j in 0..total - n {
            extra[order.global(j) as usize] += 1;
        }
        for id in 0..n as usize {
            prop_assert_eq!(seen[id], 1 + extra[id], "id {}", id);
        }
    }
    let report = audit(&c, pos, &digests).unwrap();
    prop_assert_eq!(report.samples + report.padding, total);
    // The next epoch is ordinary again.
    let w = last_world as u32;
    let next = ElasticSampler::new(c.rank_world(w - 1, w), pos).unwrap();
    let plain = Sampler::new(c.rank_world(w - 1, w)).unwrap();
    prop_assert_eq!(next.per_rank(epoch + 1), plain.per_rank());
    for k in 0..plain.per_rank().min(50) {
        prop_assert_eq!(next.sample(epoch + 1, k), plain.sample(epoch + 1, k));
    }
    Ok(())
}

#[test]
fn eight_five_twelve_one() {
    for (n, shuffle, drop_last) in [
        (1000, true, false),
        (1000, true, true),
        (997, false, false),
        (37, true, false),
    ] {
        let c = cfg(n, 7, shuffle, drop_last);
        run_epoch(c, 3, &[(8, 20), (5, 30), (12, 10), (1, 0)]).unwrap();
    }
}

#[test]
fn same_world_resume_is_no_resume() {
    for drop_last in [false, true] {
        let c = cfg(103, 5, true, drop_last).rank_world(2, 4);
        let plain = Sampler::new(c).unwrap();
        let at = plain.job_position(Position { epoch: 1, index: 9 });
        let resumed = ElasticSampler::new(c, at).unwrap();
        assert_eq!(resumed.per_rank(1), plain.per_rank() - 9);
        for k in 0..resumed.per_rank(1) {
            assert_eq!(resumed.sample(1, k), plain.sample(1, k + 9));
        }
    }
}

#[test]
fn check_values() {
    // docs/FORMAT.md: N = 10, seed 1, shuffle, epoch 0 (order 4 7 6 3 2 1 5
    // 0 8 9). Three ranks took 2 steps (consumed 6); resumed on two ranks.
    let c = cfg(10, 1, true, false);
    let at = JobPosition {
        epoch: 0,
        consumed: 6,
    };
    let r: Vec<Vec<u64>> = (0..2)
        .map(|rank| {
            let s = ElasticSampler::new(c.rank_world(rank, 2), at).unwrap();
            (0..s.per_rank(0)).map(|k| s.sample(0, k)).collect()
        })
        .collect();
    assert_eq!(r, vec![vec![5, 8], vec![0, 9]]);
    // Resumed on three ranks: 4 left, padded to 6 with the first 2 of the
    // order (4, 7), already consumed: not owed, delivered as padding.
    let r: Vec<Vec<u64>> = (0..3)
        .map(|rank| {
            let s = ElasticSampler::new(c.rank_world(rank, 3), at).unwrap();
            (0..s.per_rank(0)).map(|k| s.sample(0, k)).collect()
        })
        .collect();
    assert_eq!(r, vec![vec![5, 9], vec![0, 4], vec![8, 7]]);
    // With drop_last on three ranks: one step each, 9 dropped.
    let c = cfg(10, 1, true, true);
    let r: Vec<Vec<u64>> = (0..3)
        .map(|rank| {
            let s = ElasticSampler::new(c.rank_world(rank, 3), at).unwrap();
            (0..s.per_rank(0)).map(|k| s.sample(0, k)).collect()
        })
        .collect();
    assert_eq!(r, vec![vec![5], vec![0], vec![8]]);
    // Digest check values (also computed by a Python transcription of
    // docs/FORMAT.md): h(0, 0), h(3, 7), and the digest of 4 7 6 3 2 1.
    assert_eq!(EpochDigest::hash(0, 0), 0xfdbf_42a8_8ac5_0f27);
    assert_eq!(EpochDigest::hash(3, 7), 0x3a70_3a8b_ed0f_9cea);
    let d = EpochDigest::expected(&c, at).unwrap();
    assert_eq!((d.count, d.sum), (6, CHECK_DIGEST));
}

const CHECK_DIGEST: u64 = 0xe700_c72a_5615_265c;

#[test]
fn lock_step_is_checked() {
    let r = |rank, index| RankPosition {
        epoch: 2,
        base: 40,
        index,
        rank,
        world: 3,
    };
    assert_eq!(
        JobPosition::from_ranks(&[r(0, 5), r(2, 5), r(1, 5)]).unwrap(),
        JobPosition {
            epoch: 2,
            consumed: 55
        }
    );
    for bad in [
        vec![r(0, 5), r(1, 6), r(2, 5)],
        vec![r(0, 5), r(1, 5)],
        vec![r(0, 5), r(0, 5), r(2, 5)],
        vec![r(0, 5), RankPosition { base: 0, ..r(1, 5) }, r(2, 5)],
        vec![
            r(0, 5),
            RankPosition {
                epoch: 3,
                ..r(1, 5)
            },
            r(2, 5),
        ],
        vec![
            r(0, 5),
            RankPosition {
                world: 4,
                ..r(1, 5)
            },
            r(2, 5),
        ],
        vec![],
    ] {
        match JobPosition::from_ranks(&bad) {
            Err(Error::NotLockStep(m)) => assert!(!m.is_empty()),
            other => panic!("{bad:?}: {other:?}"),
        }
    }
}

#[test]
fn job_positions_round_trip() {
    let c = cfg(1000, 9, true, false).rank_world(3, 8);
    let p = JobPosition {
        epoch: 4,
        consumed: 517,
    };
    let b = p.save(&c, 0xfeed);
    // Any rank, any world.
    assert_eq!(
        JobPosition::restore(&b, &c.rank_world(0, 5), 0xfeed).unwrap(),
        p
    );
    for (bytes, c2, id) in [
        (b, cfg(1000, 10, true, false), 0xfeed),
        (b, c, 0xbeef),
        (
            {
                let mut x = b;
                x[9] ^= 1;
                x
            },
            c,
            0xfeed,
        ),
    ] {
        assert!(matches!(
            JobPosition::restore(&bytes, &c2, id),
            Err(Error::BadPosition(_))
        ));
    }
    assert!(JobPosition::restore(&b[..39], &c, 0xfeed).is_err());
    // docs/FORMAT.md check value (Python transcription): the fingerprint of
    // N = 10, seed 1, shuffle, no drop_last.
    let b = p.save(&cfg(10, 1, true, false), 0);
    assert_eq!(b[24..32], 0xedfa_456b_6a8d_3bccu64.to_le_bytes());
}

#[test]
fn digest_catches_skip_repeat_and_swap() {
    let c = cfg(500, 11, true, false);
    let pos = JobPosition {
        epoch: 2,
        consumed: 300,
    };
    let next = JobPosition {
        epoch: 3,
        consumed: 300,
    };
    let d = deal(
        c,
        4,
        JobPosition {
            epoch: 2,
            consumed: 0,
        },
        Some(75),
    );
    let d3 = deal(
        c,
        4,
        JobPosition {
            epoch: 3,
            consumed: 0,
        },
        Some(75),
    );
    assert_eq!(d.end, pos);
    audit(&c, pos, &d.digests).unwrap();
    audit(&c, next, &d3.digests).unwrap();
    let fold = |e, ids: &[Vec<u64>]| -> Vec<EpochDigest> {
        ids.iter()
            .map(|v| {
                let mut x = EpochDigest::new(e);
                v.iter().for_each(|&id| x.add(id));
                x
            })
            .collect()
    };
    let expect_err = |p, ids: &[Vec<u64>], what: &str| match audit(&c, p, &fold(p.epoch, ids)) {
        Err(Error::AuditMismatch(m)) => assert!(m.contains(what), "{m}"),
        r => panic!("{r:?}"),
    };
    // Skipped.
    let mut ids = d.per_rank.clone();
    ids[1].remove(10);
    expect_err(pos, &ids, "some skipped");
    // Repeated (on top).
    let mut ids = d.per_rank.clone();
    let x = ids[2][3];
    ids[0].push(x);
    expect_err(pos, &ids, "delivered twice");
    // Repeated in place of another (same count).
    let mut ids = d.per_rank.clone();
    ids[1][7] = ids[3][20];
    expect_err(pos, &ids, "not the expected ones");
    // Swapped with the next epoch: rank 0's step 5 of epochs 2 and 3.
    let (mut a, mut b) = (d.per_rank.clone(), d3.per_rank.clone());
    let k = (0..75).find(|&k| a[0][k] != b[0][k]).unwrap();
    std::mem::swap(&mut a[0][k], &mut b[0][k]);
    expect_err(pos, &a, "not the expected ones");
    expect_err(next, &b, "not the expected ones");
    // A digest of another epoch in the pile.
    let mut mixed = d.digests.clone();
    mixed.push(d3.digests[0]);
    assert!(matches!(
        audit(&c, pos, &mixed),
        Err(Error::AuditMismatch(_))
    ));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    /// 200 random histories: up to four worlds in one epoch, each stopping
    /// at a random step, datasets from 1 sample (smaller than the world).
    #[test]
    fn random_resumes_deliver_the_epoch_once(
        n in prop_oneof![1u64..20, 20u64..3000],
        seed in any::<u64>(),
        epoch in 0u64..1000,
        shuffle in any::<bool>(),
        drop_last in any::<bool>(),
        worlds in proptest::collection::vec((1u32..17, 0u64..400), 1..5),
    ) {
        run_epoch(cfg(n, seed, shuffle, drop_last), epoch, &worlds)?;
    }
}
