//! The sampler: which sample a rank consumes at each step of each epoch.
//!
//! Semantics are PyTorch's `DistributedSampler`: per epoch a permutation `p`
//! of `0..N` (or the identity without shuffle) is extended cyclically to a
//! global order `g(j) = p(j mod N)`; with padding the epoch has
//! `T = ceil(N/W)*W` steps (the padding repeats samples from the start of the
//! permutation), with `drop_last` `T = floor(N/W)*W`; rank `r` takes
//! `g(r), g(r+W), g(r+2W), ...`, so its k-th sample is `g(r + k*W)`.
//!
//! The permutation is a keyed bijection, not an array: a Feistel network
//! over the smallest number of bits covering `N` (halves differing by at
//! most one bit when the count is odd), with cycle
//! walking (re-apply until the value falls below `N`). Computing any
//! position is O(1) memory and a few dozen multiplications, so a
//! billion-sample dataset costs nothing to shuffle. The exact construction is
//! frozen in docs/FORMAT.md: every node computes every rank's future alike.
//!
//! A job can resume an epoch at another world size ([`JobPosition`],
//! [`ElasticSampler`], in `elastic.rs`) and check that every sample was
//! delivered exactly once ([`EpochDigest`], [`audit()`], in `audit.rs`).
//!
//! Several datasets mix into one epoch in fixed proportions
//! ([`MixSampler`], [`Weight`], in `mix.rs`).
//!
//! The next read of any sample after any moment is computed, in O(1)
//! epochs' work ([`NextUse`], in `next_use.rs`): a cache evicts by it.

use crate::error::{Error, Result};
use crate::hash::mix64;

mod audit;
mod elastic;
#[cfg(test)]
mod elastic_tests;
mod mix;
mod mix_position;
mod next_use;
mod permutation;
mod saved;

pub use audit::{audit, audit_mix, AuditReport, EpochDigest};
pub use elastic::{ElasticSampler, JobPosition, RankPosition, RemainderOrder, JOB_POSITION_BYTES};
pub use mix::{
    dataset_seed, epoch_counts, pass_key, MixEpoch, MixOrder, MixSample, MixSampler, Weight,
    MAX_DATASETS,
};
pub use mix_position::{counts_hash, MixPosition};
pub use next_use::{NextUse, NEVER};
pub use permutation::{Permutation, MAX_SHUFFLE_BLOCK};
pub use saved::{audit_positions, SavedMix, SavedPosition, POSITION_BYTES};

/// What a rank's sequence depends on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct SamplerConfig {
    /// Dataset length N.
    pub len: u64,
    /// Shuffle seed (same on every rank).
    pub seed: u64,
    /// Shuffle per epoch, or take samples in id order.
    pub shuffle: bool,
    /// This rank.
    pub rank: u32,
    /// World size W.
    pub world: u32,
    /// Drop the tail that does not divide evenly instead of padding.
    pub drop_last: bool,
    /// Shuffle within blocks of this many consecutive ids ([`Permutation::blocked`]);
    /// 0 (the default) or 1: one permutation of the whole dataset.
    pub shuffle_block: u64,
}

impl SamplerConfig {
    /// A single rank reading everything, shuffled with `seed`.
    pub fn single(len: u64, seed: u64) -> Self {
        SamplerConfig {
            len,
            seed,
            shuffle: true,
            rank: 0,
            world: 1,
            drop_last: false,
            shuffle_block: 0,
        }
    }

    /// The block of a block-local shuffle, 0 when the order is one
    /// permutation of the whole dataset (or not shuffled).
    pub fn order_block(&self) -> u64 {
        if self.shuffle && self.shuffle_block > 1 {
            self.shuffle_block
        } else {
            0
        }
    }

    /// The order settings as one word, as positions hash and save them:
    /// bit 0 shuffle, bit 1 drop_last, bits 8.. the shuffle block (0, as
    /// before blocks existed, for a whole-dataset shuffle).
    pub(crate) fn order_flags(&self) -> u64 {
        (self.shuffle as u64) | ((self.drop_last as u64) << 1) | (self.order_block() << 8)
    }

    fn fingerprint(&self) -> u64 {
        let flags = self.order_flags();
        let mut h = mix64(self.len ^ 0x6b73_7065_6564_6670);
        for v in [self.seed, flags, self.rank as u64, self.world as u64] {
            h = mix64(h ^ v);
        }
        h
    }
}

setters!(SamplerConfig {
    len: u64,
    seed: u64,
    shuffle: bool,
    drop_last: bool,
    shuffle_block: u64,
});

impl SamplerConfig {
    /// Sets this rank and the world size (builder style).
    #[must_use]
    pub fn rank_world(mut self, rank: u32, world: u32) -> Self {
        self.rank = rank;
        self.world = world;
        self
    }
}

/// A saved place in a rank's sequence: the next step to consume.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Position {
    /// Epoch.
    pub epoch: u64,
    /// Steps of this epoch already consumed by this rank.
    pub index: u64,
}

const POS_MAGIC: &[u8; 8] = b"KSPDPOS2";
const POS_MAGIC_V1: &[u8; 8] = b"KSPDPOS1";
/// Bytes of a [`Position`] serialized by [`Sampler::save`] (`KSPDPOS2`; a
/// loader saves the longer [`SavedPosition`], `KSPDPOS3`).
pub const POSITION_V2_BYTES: usize = 40;
/// Bytes of a position saved by kspeed 0.1 (no catalog identity).
const POSITION_V1_BYTES: usize = 36;

/// A rank's view of the epoch sequence.
#[derive(Debug, Clone)]
pub struct Sampler {
    cfg: SamplerConfig,
    per_rank: u64,
    /// A mixture of datasets ([`Sampler::mixed`]): its order replaces the
    /// permutation (`cfg.len` is then the mixed epoch's length).
    mix: Option<MixSampler>,
}

impl Sampler {
    /// Checks the configuration.
    pub fn new(cfg: SamplerConfig) -> Result<Self> {
        if cfg.len == 0 {
            return Err(Error::InvalidConfig("the dataset has no samples".into()));
        }
        if cfg.world == 0 || cfg.rank >= cfg.world {
            return Err(Error::InvalidConfig(format!(
                "rank {} is not below world size {}",
                cfg.rank, cfg.world
            )));
        }
        if cfg.shuffle_block > MAX_SHUFFLE_BLOCK {
            return Err(Error::InvalidConfig(format!(
                "shuffle_block {} is above the largest, {MAX_SHUFFLE_BLOCK}",
                cfg.shuffle_block
            )));
        }
        let w = cfg.world as u64;
        let per_rank = if cfg.drop_last {
            cfg.len / w
        } else {
            cfg.len.div_ceil(w)
        };
        Ok(Sampler {
            cfg,
            per_rank,
            mix: None,
        })
    }

    /// The sampler of a mixture of datasets (the loader's). Its per-rank
    /// positions record the mixture's counts: restoring one with other
    /// weights is refused; a [`MixPosition`] resumes under new weights
    /// ([`MixSampler::resume`]), and the epoch it resumed in then has
    /// [`Sampler::order_len`] entries, not `cfg.len`.
    pub fn mixed(mix: MixSampler) -> Result<Self> {
        Ok(Sampler {
            mix: Some(mix.clone()),
            ..Sampler::new(*mix.config())?
        })
    }

    /// The mixture, for a sampler made by [`Sampler::mixed`].
    pub fn mixture(&self) -> Option<&MixSampler> {
        self.mix.as_ref()
    }

    /// What a position checks: the configuration and, for a mixture, its
    /// datasets' lengths and per-epoch counts.
    fn fingerprint(&self) -> u64 {
        match &self.mix {
            None => self.cfg.fingerprint(),
            Some(m) => {
                mix64(self.cfg.fingerprint() ^ mix64(m.fingerprint(&[]) ^ counts_hash(m.counts())))
            }
        }
    }

    /// The configuration.
    pub fn config(&self) -> &SamplerConfig {
        &self.cfg
    }

    /// Entries of `epoch`'s global order: `cfg.len`, or a mixture's order
    /// (the rest of it in an epoch resumed under new weights).
    pub fn order_len(&self, epoch: u64) -> u64 {
        match &self.mix {
            Some(m) => m.order_len(epoch),
            None => self.cfg.len,
        }
    }

    /// Steps per ordinary epoch for this rank (the same on every rank).
    pub fn per_rank(&self) -> u64 {
        self.per_rank
    }

    /// The order of `epoch`, to look up many positions of it.
    pub fn epoch(&self, epoch: u64) -> EpochOrder {
        EpochOrder {
            perm: (self.cfg.shuffle && self.mix.is_none()).then(|| {
                Permutation::blocked(self.cfg.len, self.cfg.seed, epoch, self.cfg.shuffle_block)
            }),
            cfg: self.cfg,
            per_rank: self.per_rank,
            mix: self.mix.as_ref().map(|m| m.epoch(epoch)),
        }
    }

    /// The sample id of step `k` of `epoch` for this rank (`k < per_rank()`).
    pub fn sample(&self, epoch: u64, k: u64) -> u64 {
        self.epoch(epoch).sample(k)
    }

    /// Serializes a position with this sampler's fingerprint and the
    /// catalog's identity, so it cannot be resumed by a sampler over other
    /// data (even of the same length), seed, rank or world.
    ///
    /// Layout (little-endian): magic `KSPDPOS2`, epoch u64, index u64,
    /// sampler fingerprint u64, catalog identity u32, CRC32C u32 of the
    /// preceding 36 bytes.
    pub fn save(&self, pos: Position, catalog_identity: u32) -> [u8; POSITION_V2_BYTES] {
        let mut b = [0u8; POSITION_V2_BYTES];
        b[0..8].copy_from_slice(POS_MAGIC);
        b[8..16].copy_from_slice(&pos.epoch.to_le_bytes());
        b[16..24].copy_from_slice(&pos.index.to_le_bytes());
        b[24..32].copy_from_slice(&self.fingerprint().to_le_bytes());
        b[32..36].copy_from_slice(&catalog_identity.to_le_bytes());
        let crc = crc32c::crc32c(&b[..36]);
        b[36..40].copy_from_slice(&crc.to_le_bytes());
        b
    }

    /// Decodes a position saved by [`Sampler::save`] with the same
    /// configuration and catalog. A 36-byte position of kspeed 0.1
    /// (`KSPDPOS1`, no catalog identity) is still accepted, with a warning:
    /// it cannot tell two datasets of the same length apart.
    pub fn restore(&self, bytes: &[u8], catalog_identity: u32) -> Result<Position> {
        let (body, crc_at) = match bytes.len() {
            POSITION_V2_BYTES if &bytes[0..8] == POS_MAGIC => (36, 36),
            POSITION_V1_BYTES if &bytes[0..8] == POS_MAGIC_V1 => (32, 32),
            POSITION_V2_BYTES | POSITION_V1_BYTES => {
                return Err(Error::BadPosition(
                    "wrong magic (not a kspeed position)".into(),
                ))
            }
            n => {
                // Name what it is not before what its length is not: a
                // blob of another length may still be a kspeed position.
                let magic = bytes.get(..8).unwrap_or(bytes);
                return Err(Error::BadPosition(if magic.starts_with(b"KSPD") {
                    format!(
                        "{n} bytes of {}, not a {POSITION_V2_BYTES}-byte KSPDPOS2 sampler position",
                        String::from_utf8_lossy(magic)
                    )
                } else {
                    format!("wrong magic (not a kspeed position; {n} bytes)")
                }));
            }
        };
        let crc = u32::from_le_bytes(bytes[crc_at..crc_at + 4].try_into().expect("4 bytes"));
        if crc != crc32c::crc32c(&bytes[..body]) {
            return Err(Error::BadPosition("checksum mismatch (corrupt)".into()));
        }
        let fp = u64::from_le_bytes(bytes[24..32].try_into().expect("8 bytes"));
        if fp != self.fingerprint() {
            return Err(Error::BadPosition(
                "saved by a sampler with another dataset length, seed, shuffle, rank, world or drop_last, \
                 or another mixture of datasets or weights"
                    .into(),
            ));
        }
        if body == 36 {
            let saved = u32::from_le_bytes(bytes[32..36].try_into().expect("4 bytes"));
            if saved != catalog_identity {
                return Err(Error::BadPosition(format!(
                    "saved on another dataset (catalog identity {saved:08x}, this loader reads {catalog_identity:08x})"
                )));
            }
        } else {
            log::warn!(
                "resuming a position saved by kspeed 0.1, which does not record the dataset: \
                 make sure it is the same catalog"
            );
        }
        let pos = Position {
            epoch: u64::from_le_bytes(bytes[8..16].try_into().expect("8 bytes")),
            index: u64::from_le_bytes(bytes[16..24].try_into().expect("8 bytes")),
        };
        if pos.index > self.per_rank {
            return Err(Error::BadPosition(format!(
                "index {} is past the epoch's {} steps",
                pos.index, self.per_rank
            )));
        }
        Ok(pos)
    }

    /// Iterates this rank's sample ids from `pos` to the end of its epoch.
    pub fn iter_from(&self, pos: Position) -> impl Iterator<Item = u64> + '_ {
        let order = self.epoch(pos.epoch);
        (pos.index..self.per_rank).map(move |k| order.sample(k))
    }
}

/// One epoch's order, with the permutation keys computed once.
#[derive(Debug, Clone)]
pub struct EpochOrder {
    perm: Option<Permutation>,
    cfg: SamplerConfig,
    per_rank: u64,
    mix: Option<MixEpoch>,
}

impl EpochOrder {
    /// Sample id of this rank's step `k`.
    pub fn sample(&self, k: u64) -> u64 {
        debug_assert!(k < self.per_rank, "step {k} past the epoch");
        if let Some(m) = &self.mix {
            return m.sample(k).id;
        }
        let j = (self.cfg.rank as u64 + k * self.cfg.world as u64) % self.cfg.len;
        match &self.perm {
            Some(p) => p.apply(j),
            None => j,
        }
    }

    /// Sample id of global step `j` (all ranks interleaved).
    pub fn global(&self, j: u64) -> u64 {
        if let Some(m) = &self.mix {
            return m.order().sample(j % m.order().len()).id;
        }
        let j = j % self.cfg.len;
        match &self.perm {
            Some(p) => p.apply(j),
            None => j,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn seq(s: &Sampler, epoch: u64) -> Vec<u64> {
        s.iter_from(Position { epoch, index: 0 }).collect()
    }

    #[test]
    fn blocked_jobs_resume_at_another_world_exactly_once() {
        // 7 ranks take 5 steps of a blocked epoch, then 3 ranks deal the rest.
        let n = 1000u64;
        let cfg = SamplerConfig {
            shuffle_block: 64,
            ..SamplerConfig::single(n, 3)
        };
        let mut seen = vec![0u32; n as usize];
        for rank in 0..7 {
            let s = Sampler::new(cfg.rank_world(rank, 7)).unwrap();
            for k in 0..5 {
                seen[s.sample(2, k) as usize] += 1;
            }
        }
        let start = JobPosition {
            epoch: 2,
            consumed: 35,
        };
        let saved = start.save(&cfg, 9);
        assert!(JobPosition::restore(&saved, &cfg.rank_world(1, 3), 9).is_ok());
        let whole = SamplerConfig {
            shuffle_block: 0,
            ..cfg
        };
        match JobPosition::restore(&saved, &whole, 9) {
            Err(Error::BadPosition(m)) => assert!(m.contains("block size"), "{m}"),
            r => panic!("{r:?}"),
        }
        // Saved by a whole-dataset shuffle, restored with blocks: named.
        match JobPosition::restore(&start.save(&whole, 9), &cfg, 9) {
            Err(Error::BadPosition(m)) => assert!(m.contains("shuffle_block 64"), "{m}"),
            r => panic!("{r:?}"),
        }
        for rank in 0..3 {
            let e = ElasticSampler::new(cfg.rank_world(rank, 3), start).unwrap();
            for k in 0..e.per_rank(2) {
                seen[e.sample(2, k) as usize] += 1;
            }
        }
        // Padding repeats at most the epoch's first two entries.
        let twice = seen.iter().filter(|&&c| c == 2).count();
        assert!(seen.iter().all(|&c| c >= 1) && twice <= 2, "{twice} twice");
    }

    #[test]
    fn frozen_blocked_sequence() {
        // docs/FORMAT.md's check value: N = 10, seed 1, epoch 0, blocks of 4.
        let s = Sampler::new(SamplerConfig {
            shuffle_block: 4,
            ..SamplerConfig::single(10, 1)
        })
        .unwrap();
        assert_eq!(seq(&s, 0), vec![5, 7, 6, 4, 1, 8, 9, 2, 0, 3]);
    }

    #[test]
    fn frozen_sequence() {
        // The order is part of the protocol; a change here reshuffles every job.
        let s = Sampler::new(SamplerConfig::single(10, 1)).unwrap();
        assert_eq!(seq(&s, 0), vec![4, 7, 6, 3, 2, 1, 5, 0, 8, 9]);
        // An odd bit count (100 < 2^7): the unbalanced network.
        let s = Sampler::new(SamplerConfig::single(100, 1)).unwrap();
        assert_eq!(seq(&s, 3)[..10], [21, 55, 38, 56, 62, 63, 78, 32, 9, 89]);
    }

    #[test]
    fn pytorch_semantics_without_shuffle() {
        // DistributedSampler(shuffle=False), N=10, W=3: padded order
        // 0..10 + [0, 1]; rank 1 takes 1, 4, 7, 0.
        let cfg = SamplerConfig {
            len: 10,
            seed: 0,
            shuffle: false,
            rank: 1,
            world: 3,
            drop_last: false,
            shuffle_block: 0,
        };
        assert_eq!(seq(&Sampler::new(cfg).unwrap(), 5), vec![1, 4, 7, 0]);
        let s = Sampler::new(SamplerConfig { rank: 2, ..cfg }).unwrap();
        assert_eq!(seq(&s, 0), vec![2, 5, 8, 1]);
        let s = Sampler::new(SamplerConfig {
            drop_last: true,
            ..cfg
        })
        .unwrap();
        assert_eq!(seq(&s, 0), vec![1, 4, 7]);
    }

    #[test]
    fn positions_round_trip_and_resume() {
        let cfg = SamplerConfig {
            len: 1000,
            seed: 9,
            shuffle: true,
            rank: 1,
            world: 4,
            drop_last: false,
            shuffle_block: 0,
        };
        let s = Sampler::new(cfg).unwrap();
        let pos = Position {
            epoch: 3,
            index: 117,
        };
        let bytes = s.save(pos, 0xfeed);
        assert_eq!(s.restore(&bytes, 0xfeed).unwrap(), pos);
        let full = seq(&s, 3);
        let resumed: Vec<u64> = s.iter_from(s.restore(&bytes, 0xfeed).unwrap()).collect();
        assert_eq!(&full[117..], &resumed[..]);

        let other = Sampler::new(SamplerConfig { seed: 10, ..cfg }).unwrap();
        assert!(matches!(
            other.restore(&bytes, 0xfeed),
            Err(Error::BadPosition(_))
        ));
        // Same sampler, another dataset of the same length.
        match s.restore(&bytes, 0xbeef) {
            Err(Error::BadPosition(m)) => assert!(m.contains("another dataset"), "{m}"),
            r => panic!("{r:?}"),
        }
        let mut bad = bytes;
        bad[10] ^= 1;
        assert!(matches!(
            s.restore(&bad, 0xfeed),
            Err(Error::BadPosition(_))
        ));
        assert!(matches!(
            s.restore(&bytes[..20], 0xfeed),
            Err(Error::BadPosition(_))
        ));
        // A version-1 position (36 bytes, no catalog identity) still resumes.
        let mut v1 = [0u8; 36];
        v1[0..8].copy_from_slice(b"KSPDPOS1");
        v1[8..16].copy_from_slice(&3u64.to_le_bytes());
        v1[16..24].copy_from_slice(&117u64.to_le_bytes());
        v1[24..32].copy_from_slice(&cfg.fingerprint().to_le_bytes());
        let crc = crc32c::crc32c(&v1[..32]);
        v1[32..36].copy_from_slice(&crc.to_le_bytes());
        assert_eq!(s.restore(&v1, 0xbeef).unwrap(), pos);
    }

    #[test]
    fn bad_configs() {
        assert!(Sampler::new(SamplerConfig::single(0, 1)).is_err());
        let cfg = SamplerConfig {
            rank: 2,
            world: 2,
            ..SamplerConfig::single(5, 1)
        };
        assert!(Sampler::new(cfg).is_err());
        let cfg = SamplerConfig {
            rank: 0,
            world: 0,
            ..SamplerConfig::single(5, 1)
        };
        assert!(Sampler::new(cfg).is_err());
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(200))]

        #[test]
        fn ranks_cover_the_epoch(
            n in 1u64..3000,
            world in 1u32..9,
            seed in any::<u64>(),
            epoch in 0u64..1000,
            shuffle in any::<bool>(),
            drop_last in any::<bool>(),
            shuffle_block in prop_oneof![Just(0u64), 2u64..300],
        ) {
            let mut counts = vec![0u32; n as usize];
            let mut total = 0u64;
            let mut first: Option<Sampler> = None;
            for rank in 0..world {
                let s = Sampler::new(SamplerConfig {
                    len: n, seed, shuffle, rank, world, drop_last, shuffle_block,
                }).unwrap();
                if let Some(f) = &first {
                    prop_assert_eq!(s.per_rank(), f.per_rank());
                }
                for id in seq(&s, epoch) {
                    counts[id as usize] += 1;
                    total += 1;
                }
                first.get_or_insert(s);
            }
            let w = world as u64;
            if drop_last {
                prop_assert_eq!(total, n / w * w);
                prop_assert!(counts.iter().all(|&c| c <= 1));
            } else {
                prop_assert_eq!(total, n.div_ceil(w) * w);
                prop_assert!(counts.iter().all(|&c| c >= 1));
                // Padding repeats the start of the epoch's global order.
                let order = first.unwrap().epoch(epoch);
                let pad = total - n;
                let mut extra = vec![0u32; n as usize];
                for j in 0..pad {
                    extra[order.global(j) as usize] += 1;
                }
                for i in 0..n as usize {
                    prop_assert_eq!(counts[i], 1 + extra[i]);
                }
            }
        }

        #[test]
        fn deterministic_and_epochs_differ(n in 50u64..5000, seed in any::<u64>(), epoch in 0u64..1_000_000) {
            let s = Sampler::new(SamplerConfig::single(n, seed)).unwrap();
            let a = seq(&s, epoch);
            prop_assert_eq!(&a, &seq(&Sampler::new(SamplerConfig::single(n, seed)).unwrap(), epoch));
            prop_assert_ne!(&a, &seq(&s, epoch + 1));
            prop_assert_ne!(&a, &seq(&Sampler::new(SamplerConfig::single(n, seed ^ 1)).unwrap(), epoch));
        }
    }
}
