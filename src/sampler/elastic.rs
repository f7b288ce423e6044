//! Resume at another world size: job positions and the dealing of an
//! epoch's remainder.
//!
//! In lock-step every rank of a `W`-rank job has consumed the same number
//! of steps `b`, and rank `r`'s step `k` is global position `r + k*W` of the
//! epoch's cyclic order `g(j) = p(j mod N)` (see the module above), so the
//! job has consumed exactly the prefix `g(0..b*W)`. A [`JobPosition`] is that
//! prefix length `C` with the epoch: it names no rank and no world.
//!
//! Resuming with `W'` ranks deals the rest of the same order, `g(C..)`, with
//! `DistributedSampler` semantics over the `R = N - C` samples not yet
//! consumed: `ceil(R/W')` steps per rank with padding, `floor(R/W')` with
//! `drop_last`; rank `r'`'s step `k'` is `g(C + r' + k'*W')`. Padding takes
//! the entries of `g` past `N`, which repeat the start of the epoch's
//! permutation (as in an un-resumed epoch). After `b'` lock-step steps the
//! job has consumed `g(0..C + b'*W')`: again a prefix of the one order, so
//! any number of resumes compose with no history kept. `C` only passes `N`
//! (by fewer than `W'`) at the end of a padded epoch; `g(N..C)` are then the
//! padding duplicates, and a later resume owes nothing for them
//! (`R = N - min(C, N)`). Resuming at the world size the job had gives the
//! very sequence it would have had.
//!
//! Everything is O(1) memory: a position's sample is one lookup in the
//! keyed permutation, whatever the history of resumes.

use super::{Position, Sampler, SamplerConfig};
use crate::error::{Error, Result};
use crate::hash::mix64;

/// What a whole job has consumed of an epoch, valid for any world size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct JobPosition {
    /// Epoch.
    pub epoch: u64,
    /// Entries of the epoch's global order `g` consumed (delivered by some
    /// rank): the prefix `g(0..consumed)`. Above the dataset length only at
    /// the end of a padded epoch (the excess are padding duplicates).
    pub consumed: u64,
}

/// One rank's place in a (possibly resumed) epoch: all that a job position
/// is derived from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RankPosition {
    /// Epoch.
    pub epoch: u64,
    /// Entries of the epoch's global order consumed before this world
    /// started dealing (0 unless the job resumed inside this epoch).
    pub base: u64,
    /// Steps of this epoch this rank consumed since `base`.
    pub index: u64,
    /// This rank.
    pub rank: u32,
    /// World size of the dealing.
    pub world: u32,
}

impl RankPosition {
    /// The job position, if the job is in lock-step (every rank at this
    /// `index`): the first `base + index * world` entries are consumed.
    pub fn job_position(&self) -> JobPosition {
        JobPosition {
            epoch: self.epoch,
            consumed: self.base + self.index * self.world as u64,
        }
    }
}

const JOB_MAGIC: &[u8; 8] = b"KSPDJOB1";
/// Bytes of a serialized [`JobPosition`].
pub const JOB_POSITION_BYTES: usize = 40;

/// The sampler settings a job position depends on: N, seed, shuffle,
/// drop_last and the shuffle block, but not rank or world.
fn job_fingerprint(cfg: &SamplerConfig) -> u64 {
    let flags = cfg.order_flags();
    let mut h = mix64(cfg.len ^ 0x6b73_7065_6564_6a62); // "kspeedjb"
    for v in [cfg.seed, flags] {
        h = mix64(h ^ v);
    }
    h
}

impl JobPosition {
    /// The job position of a lock-step job from every rank's position
    /// (`ranks` holds each rank of one world exactly once, in any order).
    /// Refuses with [`Error::NotLockStep`] naming the first disagreement:
    /// a missing or repeated rank, or another world, epoch, base or step.
    pub fn from_ranks(ranks: &[RankPosition]) -> Result<JobPosition> {
        let first = ranks
            .first()
            .ok_or_else(|| Error::NotLockStep("no rank positions given".into()))?;
        let w = first.world;
        if ranks.len() != w as usize {
            return Err(Error::NotLockStep(format!(
                "{} rank positions for a world of {w} ({})",
                ranks.len(),
                if ranks.len() < w as usize {
                    "a rank's position is missing: give every rank's"
                } else {
                    "more than one per rank"
                }
            )));
        }
        let mut seen = vec![false; w as usize];
        for p in ranks {
            let what = if p.world != w {
                Some(format!("world {} (rank {} has {w})", p.world, first.rank))
            } else if p.rank >= w || seen[p.rank as usize] {
                Some(format!("rank {} is out of range or repeated", p.rank))
            } else if p.epoch != first.epoch {
                Some(format!(
                    "epoch {} (rank {} is in epoch {})",
                    p.epoch, first.rank, first.epoch
                ))
            } else if p.base != first.base {
                Some(format!(
                    "a dealing that started at {} (rank {}'s at {})",
                    p.base, first.rank, first.base
                ))
            } else if p.index != first.index {
                Some(format!(
                    "step {} of epoch {} (rank {} is at step {})",
                    p.index, p.epoch, first.rank, first.index
                ))
            } else {
                None
            };
            if let Some(what) = what {
                return Err(Error::NotLockStep(format!("rank {}: {what}", p.rank)));
            }
            seen[p.rank as usize] = true;
        }
        Ok(first.job_position())
    }

    /// Serializes this job position for the job of `cfg` (its rank and
    /// world are not recorded) over the catalog `catalog_identity`.
    ///
    /// Layout (little-endian): magic `KSPDJOB1`, epoch u64, consumed u64,
    /// job fingerprint u64, catalog identity u32, CRC32C u32 of the
    /// preceding 36 bytes.
    pub fn save(&self, cfg: &SamplerConfig, catalog_identity: u32) -> [u8; JOB_POSITION_BYTES] {
        let mut b = [0u8; JOB_POSITION_BYTES];
        b[0..8].copy_from_slice(JOB_MAGIC);
        b[8..16].copy_from_slice(&self.epoch.to_le_bytes());
        b[16..24].copy_from_slice(&self.consumed.to_le_bytes());
        b[24..32].copy_from_slice(&job_fingerprint(cfg).to_le_bytes());
        b[32..36].copy_from_slice(&catalog_identity.to_le_bytes());
        let crc = crc32c::crc32c(&b[..36]);
        b[36..40].copy_from_slice(&crc.to_le_bytes());
        b
    }

    /// The epoch and catalog identity a saved job position claims, before
    /// [`JobPosition::restore`] checks it (its size and magic only): which
    /// of a loader's samplers to check it against.
    pub fn claims(bytes: &[u8]) -> Result<(u64, u32)> {
        if bytes.len() != JOB_POSITION_BYTES || &bytes[0..8] != JOB_MAGIC {
            return Err(Error::BadPosition(format!(
                "not a kspeed job position ({} bytes; a {JOB_POSITION_BYTES}-byte KSPDJOB1, a \
                 rank's KSPDPOS3 or a mixture's KSPDMIX1 expected)",
                bytes.len()
            )));
        }
        let epoch = u64::from_le_bytes(bytes[8..16].try_into().expect("8 bytes"));
        let identity = u32::from_le_bytes(bytes[32..36].try_into().expect("4 bytes"));
        Ok((epoch, identity))
    }

    /// Decodes a job position saved by [`JobPosition::save`] for a job with
    /// the same N, seed, shuffle, drop_last and catalog (any rank, any
    /// world); anything else is [`Error::BadPosition`] saying what differs.
    pub fn restore(bytes: &[u8], cfg: &SamplerConfig, catalog_identity: u32) -> Result<Self> {
        if bytes.len() != JOB_POSITION_BYTES {
            return Err(Error::BadPosition(format!(
                "{} bytes, expected a {JOB_POSITION_BYTES}-byte job position",
                bytes.len()
            )));
        }
        if &bytes[0..8] != JOB_MAGIC {
            return Err(Error::BadPosition(
                "wrong magic (not a kspeed job position)".into(),
            ));
        }
        let u64_at = |o: usize| u64::from_le_bytes(bytes[o..o + 8].try_into().expect("8 bytes"));
        let crc = u32::from_le_bytes(bytes[36..40].try_into().expect("4 bytes"));
        if crc != crc32c::crc32c(&bytes[..36]) {
            return Err(Error::BadPosition("checksum mismatch (corrupt)".into()));
        }
        let saved = u32::from_le_bytes(bytes[32..36].try_into().expect("4 bytes"));
        if saved != catalog_identity {
            return Err(Error::BadPosition(format!(
                "saved on another dataset (catalog identity {saved:08x}, this job reads {catalog_identity:08x})"
            )));
        }
        let fp = u64_at(24);
        if fp != job_fingerprint(cfg) {
            // The fingerprint hides the settings; the two flags can be
            // named by trying them.
            let flipped = |shuffle: bool, drop_last: bool| SamplerConfig {
                shuffle: cfg.shuffle ^ shuffle,
                drop_last: cfg.drop_last ^ drop_last,
                ..*cfg
            };
            let what = if fp == job_fingerprint(&flipped(true, false)) {
                format!("shuffle {} (this job has {})", !cfg.shuffle, cfg.shuffle)
            } else if fp == job_fingerprint(&flipped(false, true)) {
                format!(
                    "drop_last {} (this job has {})",
                    !cfg.drop_last, cfg.drop_last
                )
            } else if fp == job_fingerprint(&flipped(true, true)) {
                format!(
                    "shuffle {} and drop_last {} (this job has {} and {})",
                    !cfg.shuffle, !cfg.drop_last, cfg.shuffle, cfg.drop_last
                )
            } else if cfg.shuffle
                && fp
                    == job_fingerprint(&SamplerConfig {
                        shuffle_block: 0,
                        ..*cfg
                    })
            {
                format!(
                    "a whole-dataset shuffle (this job has shuffle_block {})",
                    cfg.shuffle_block
                )
            } else {
                "another seed (or dataset length, or block size)".into()
            };
            return Err(Error::BadPosition(format!("saved by a job with {what}")));
        }
        let pos = JobPosition {
            epoch: u64_at(8),
            consumed: u64_at(16),
        };
        // Padding passes N by less than the largest world size.
        if pos.consumed > cfg.len + u32::MAX as u64 {
            return Err(Error::BadPosition(format!(
                "{} entries consumed of an epoch of {}",
                pos.consumed, cfg.len
            )));
        }
        Ok(pos)
    }
}

/// A rank's view of a job that started (or resumed) at a job position: the
/// start epoch deals the remainder, later epochs are ordinary.
#[derive(Debug, Clone)]
pub struct ElasticSampler {
    inner: Sampler,
    start: JobPosition,
}

impl ElasticSampler {
    /// The sampler of rank `cfg.rank` of `cfg.world` resuming at `start`
    /// (`JobPosition { epoch, consumed: 0 }` starts an ordinary job).
    pub fn new(cfg: SamplerConfig, start: JobPosition) -> Result<Self> {
        Self::over(Sampler::new(cfg)?, start)
    }

    /// [`ElasticSampler::new`] over a sampler already made: a mixture's
    /// ([`Sampler::mixed`]) deals the rest of its mixed epoch order.
    pub fn over(inner: Sampler, start: JobPosition) -> Result<Self> {
        let len = inner.order_len(start.epoch);
        if start.consumed > len + u32::MAX as u64 {
            return Err(Error::BadPosition(format!(
                "{} entries consumed of an epoch of {len}",
                start.consumed
            )));
        }
        Ok(ElasticSampler { inner, start })
    }

    /// The configuration.
    pub fn config(&self) -> &SamplerConfig {
        self.inner.config()
    }

    /// The sampler of an ordinary epoch (a mixture's, if it is one).
    pub fn inner(&self) -> &Sampler {
        &self.inner
    }

    /// The same job resumed at `start` (any world: `start` is a job
    /// position).
    pub fn resumed(&self, start: JobPosition) -> Result<Self> {
        Self::over(self.inner.clone(), start)
    }

    /// The job position this sampler resumed at.
    pub fn start(&self) -> JobPosition {
        self.start
    }

    /// Entries of `epoch`'s global order consumed before this world: the
    /// start's for the start epoch, 0 for later ones, the whole epoch
    /// (nothing left) for earlier ones.
    pub fn base(&self, epoch: u64) -> u64 {
        use std::cmp::Ordering::*;
        match epoch.cmp(&self.start.epoch) {
            Less => self.inner.order_len(epoch),
            Equal => self.start.consumed,
            Greater => 0,
        }
    }

    /// Steps of `epoch` for this rank (the same on every rank): the
    /// remainder `R = N - min(base, N)` over the world, rounded up with
    /// padding, down with drop_last (`N`: the epoch's order's length,
    /// [`Sampler::order_len`]).
    pub fn per_rank(&self, epoch: u64) -> u64 {
        remainder_per_rank(self.config(), self.inner.order_len(epoch), self.base(epoch))
    }

    /// The order of `epoch` for this rank, to look up many steps.
    pub fn epoch(&self, epoch: u64) -> RemainderOrder {
        let cfg = self.config();
        RemainderOrder {
            order: self.inner.epoch(epoch),
            base: self.base(epoch),
            rank: cfg.rank as u64,
            world: cfg.world as u64,
            per_rank: self.per_rank(epoch),
        }
    }

    /// The sample id of step `k` of `epoch` (`k < per_rank(epoch)`).
    pub fn sample(&self, epoch: u64, k: u64) -> u64 {
        self.epoch(epoch).sample(k)
    }

    /// This rank's position before step `pos.index` of `pos.epoch`.
    pub fn rank_position(&self, pos: Position) -> RankPosition {
        let cfg = self.config();
        RankPosition {
            epoch: pos.epoch,
            base: self.base(pos.epoch),
            index: pos.index,
            rank: cfg.rank,
            world: cfg.world,
        }
    }

    /// The job position at the end of `epoch` under this world: what the
    /// audit of a finished epoch checks against.
    pub fn epoch_end(&self, epoch: u64) -> JobPosition {
        self.rank_position(Position {
            epoch,
            index: self.per_rank(epoch),
        })
        .job_position()
    }
}

impl Sampler {
    /// The job position of a lock-step job one of whose ranks (this
    /// sampler's, never resumed at another world) is at `pos`: the first
    /// `pos.index * world` entries of the epoch's order are consumed.
    pub fn job_position(&self, pos: Position) -> JobPosition {
        JobPosition {
            epoch: pos.epoch,
            consumed: pos.index * self.config().world as u64,
        }
    }
}

/// Steps per rank when `base` of the epoch's `len` entries are consumed.
pub(super) fn remainder_per_rank(cfg: &SamplerConfig, len: u64, base: u64) -> u64 {
    let rest = len - base.min(len);
    let w = cfg.world as u64;
    if cfg.drop_last {
        rest / w
    } else {
        rest.div_ceil(w)
    }
}

/// One epoch's remainder as dealt to one rank.
#[derive(Debug, Clone)]
pub struct RemainderOrder {
    order: super::EpochOrder,
    base: u64,
    rank: u64,
    world: u64,
    per_rank: u64,
}

impl RemainderOrder {
    /// Steps of this epoch for this rank.
    pub fn per_rank(&self) -> u64 {
        self.per_rank
    }

    /// The index into the epoch's global order of this rank's step `k`.
    pub fn global_index(&self, k: u64) -> u64 {
        debug_assert!(k < self.per_rank, "step {k} past the epoch");
        self.base + self.rank + k * self.world
    }

    /// Sample id of this rank's step `k`.
    pub fn sample(&self, k: u64) -> u64 {
        self.order.global(self.global_index(k))
    }
}
