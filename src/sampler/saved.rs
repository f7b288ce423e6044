//! A rank's saved position (`KSPDPOS3`; a mixture's `KSPDPOS4`, which adds
//! the mixture's datasets, counts and the order its digest was taken in):
//! where the rank resumes, the exactly-once digest of the epoch it last
//! delivered from, and the job's settings in clear, so that `kspeed audit`
//! checks a job from its ranks' files alone (no loader, no dataset) and a
//! restore names what differs.
//!
//! The layout is frozen in docs/FORMAT.md ("Saved positions").

use super::{
    audit, audit_mix, AuditReport, EpochDigest, JobPosition, MixPosition, MixSampler, RankPosition,
    SamplerConfig, MAX_DATASETS,
};
use crate::error::{Error, Result};

const MAGIC: &[u8; 8] = b"KSPDPOS3";
const MAGIC_MIX: &[u8; 8] = b"KSPDPOS4";
/// Bytes of a saved rank position ([`SavedPosition`], `KSPDPOS3`; a
/// mixture's `KSPDPOS4` is [`SavedPosition::mix_bytes`] long).
pub const POSITION_BYTES: usize = 108;
/// Bytes of a `KSPDPOS4` before its per-dataset entries.
const MIX_HEADER_BYTES: usize = 116;

/// What a mixture's rank position (`KSPDPOS4`) records besides a
/// `KSPDPOS3`'s fields, so that the audit rebuilds the mixed order of the
/// digest's epoch from the files alone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SavedMix {
    /// The mixture's fingerprint ([`MixSampler::fingerprint`]: the
    /// datasets' lengths and catalog identities, seed, shuffle, drop_last;
    /// not the weights), the same in every file of a job.
    pub fingerprint: u64,
    /// Each dataset's length.
    pub lens: Vec<u64>,
    /// Each dataset's slots per epoch under the weights of the world this
    /// rank belongs to.
    pub counts: Vec<u64>,
    /// Stream entries of each dataset used in the digest's epoch before
    /// the order this world dealt it from (0 unless the job resumed in that
    /// epoch under other weights): with `counts`, the order `digest_at.base`
    /// and `digest_at.index` count in.
    pub skip: Vec<u64>,
}

/// Everything a rank saves with its position.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SavedPosition {
    /// The job: dataset length, seed, shuffle, drop_last, this rank and the
    /// world size of the dealing it belongs to.
    pub cfg: SamplerConfig,
    /// The catalog's identity (its body's CRC32C; a mixture's: its
    /// catalogs' and per-epoch counts folded together).
    pub catalog_identity: u32,
    /// Saved by a loader reading a mixture of datasets (`cfg.len` is the
    /// mixed epoch's length).
    pub mixture: bool,
    /// The mixture's datasets and the order of the digest's epoch
    /// (`KSPDPOS4`); `None` in a `KSPDPOS3`, which a mixture's loader saved
    /// before kspeed recorded them: [`audit_positions`] refuses such a
    /// mixture's file by name (it lacks the lengths and counts).
    pub mix: Option<SavedMix>,
    /// The next step this rank delivers (`rank` and `world` equal `cfg`'s).
    pub next: RankPosition,
    /// The ids this rank delivered in `digest.epoch` (the epoch of the last
    /// sample it delivered, or `next.epoch` before any).
    pub digest: EpochDigest,
    /// Where this rank stood in `digest.epoch` when the digest was taken:
    /// `digest_at.index` steps since `digest_at.base`.
    pub digest_at: RankPosition,
}

impl SavedPosition {
    /// Serializes (layout in docs/FORMAT.md): a `KSPDPOS3` of
    /// [`POSITION_BYTES`], or with [`SavedPosition::mix`] a `KSPDPOS4` of
    /// [`SavedPosition::mix_bytes`].
    pub fn save(&self) -> Vec<u8> {
        let mut b = vec![0u8; POSITION_BYTES];
        // Bits 8..32: the shuffle block (below 2^24, checked by the sampler).
        let flags = (self.cfg.shuffle as u32)
            | ((self.cfg.drop_last as u32) << 1)
            | ((self.mixture as u32) << 2)
            | ((self.cfg.order_block() as u32) << 8);
        b[0..8].copy_from_slice(MAGIC);
        b[8..16].copy_from_slice(&self.cfg.len.to_le_bytes());
        b[16..24].copy_from_slice(&self.cfg.seed.to_le_bytes());
        b[24..28].copy_from_slice(&flags.to_le_bytes());
        b[28..32].copy_from_slice(&self.catalog_identity.to_le_bytes());
        b[32..36].copy_from_slice(&self.cfg.rank.to_le_bytes());
        b[36..40].copy_from_slice(&self.cfg.world.to_le_bytes());
        let words = [
            self.next.epoch,
            self.next.base,
            self.next.index,
            self.digest.epoch,
            self.digest_at.base,
            self.digest_at.index,
            self.digest.count,
            self.digest.sum,
        ];
        for (i, w) in words.iter().enumerate() {
            b[40 + 8 * i..48 + 8 * i].copy_from_slice(&w.to_le_bytes());
        }
        let Some(m) = &self.mix else {
            let crc = crc32c::crc32c(&b[..104]);
            b[104..108].copy_from_slice(&crc.to_le_bytes());
            return b;
        };
        b[0..8].copy_from_slice(MAGIC_MIX);
        b.truncate(104);
        b.reserve(Self::mix_bytes(m.lens.len()) - 104);
        b.extend_from_slice(&m.fingerprint.to_le_bytes());
        b.extend_from_slice(&(m.lens.len() as u32).to_le_bytes());
        for d in 0..m.lens.len() {
            for v in [m.lens[d], m.counts[d], m.skip[d]] {
                b.extend_from_slice(&v.to_le_bytes());
            }
        }
        let crc = crc32c::crc32c(&b);
        b.extend_from_slice(&crc.to_le_bytes());
        b
    }

    /// Bytes of a mixture's rank position (`KSPDPOS4`) of `datasets`
    /// datasets: `120 + 24·D`.
    pub fn mix_bytes(datasets: usize) -> usize {
        MIX_HEADER_BYTES + 24 * datasets + 4
    }

    /// Whether `bytes` claim to be a loader's rank position (by their
    /// magic): a `KSPDPOS3`, or a mixture's `KSPDPOS4`.
    pub fn is_rank_position(bytes: &[u8]) -> bool {
        bytes.len() >= 8 && (&bytes[0..8] == MAGIC || &bytes[0..8] == MAGIC_MIX)
    }

    /// Decodes a position saved by [`SavedPosition::save`] (`KSPDPOS3` or
    /// `KSPDPOS4`), checking its size, magic and checksum only
    /// ([`SavedPosition::check_job`] checks that it belongs to a job).
    pub fn decode(bytes: &[u8]) -> Result<Self> {
        if !Self::is_rank_position(bytes) {
            return Err(Error::BadPosition(
                "wrong magic (not a kspeed position)".into(),
            ));
        }
        let mixed = &bytes[0..8] == MAGIC_MIX;
        let u64_at = |o: usize| u64::from_le_bytes(bytes[o..o + 8].try_into().expect("8 bytes"));
        let u32_at = |o: usize| u32::from_le_bytes(bytes[o..o + 4].try_into().expect("4 bytes"));
        let body = if mixed {
            let d = if bytes.len() >= MIX_HEADER_BYTES {
                u32_at(112) as usize
            } else {
                0
            };
            if bytes.len() < MIX_HEADER_BYTES + 4
                || d > MAX_DATASETS
                || bytes.len() != Self::mix_bytes(d)
            {
                return Err(Error::BadPosition(format!(
                    "{} bytes, not a KSPDPOS4 position (120 + 24 bytes per dataset)",
                    bytes.len()
                )));
            }
            bytes.len() - 4
        } else {
            if bytes.len() != POSITION_BYTES {
                return Err(Error::BadPosition(format!(
                    "{} bytes, expected a {POSITION_BYTES}-byte KSPDPOS3 position",
                    bytes.len()
                )));
            }
            104
        };
        let crc = u32_at(body);
        if crc != crc32c::crc32c(&bytes[..body]) {
            return Err(Error::BadPosition("checksum mismatch (corrupt)".into()));
        }
        let flags = u32_at(24);
        if flags & 0xf8 != 0 {
            return Err(Error::BadPosition(format!("unknown flags {flags:#x}")));
        }
        if mixed && flags & 4 == 0 {
            return Err(Error::BadPosition(
                "a KSPDPOS4 position without the mixture flag".into(),
            ));
        }
        let mix = mixed.then(|| {
            let d = u32_at(112) as usize;
            let at = |i: usize, k: usize| u64_at(MIX_HEADER_BYTES + 24 * i + 8 * k);
            SavedMix {
                fingerprint: u64_at(104),
                lens: (0..d).map(|i| at(i, 0)).collect(),
                counts: (0..d).map(|i| at(i, 1)).collect(),
                skip: (0..d).map(|i| at(i, 2)).collect(),
            }
        });
        let (rank, world) = (u32_at(32), u32_at(36));
        if world == 0 || rank >= world {
            return Err(Error::BadPosition(format!(
                "rank {rank} is not below world size {world}"
            )));
        }
        let cfg = SamplerConfig {
            len: u64_at(8),
            seed: u64_at(16),
            shuffle: flags & 1 != 0,
            rank,
            world,
            drop_last: flags & 2 != 0,
            shuffle_block: u64::from(flags >> 8),
        };
        let at = |epoch, base, index| RankPosition {
            epoch,
            base,
            index,
            rank,
            world,
        };
        let digest = EpochDigest {
            epoch: u64_at(64),
            count: u64_at(88),
            sum: u64_at(96),
        };
        Ok(SavedPosition {
            cfg,
            catalog_identity: u32_at(28),
            mixture: flags & 4 != 0,
            mix,
            next: at(u64_at(40), u64_at(48), u64_at(56)),
            digest,
            digest_at: at(digest.epoch, u64_at(72), u64_at(80)),
        })
    }

    /// Refuses a position of another job than `cfg` over
    /// `catalog_identity`, naming the first setting that differs; `rank`
    /// and `world` are compared only when `same_rank` (a rank position
    /// resumes only its own rank; a job position any).
    pub fn check_job(
        &self,
        cfg: &SamplerConfig,
        catalog_identity: u32,
        same_rank: bool,
    ) -> Result<()> {
        let mine = &self.cfg;
        let differs = |what: &str, saved: String, here: String| {
            Err(Error::BadPosition(format!(
                "saved with {what} {saved}, this loader has {here}"
            )))
        };
        if self.catalog_identity != catalog_identity {
            let what = if self.mixture {
                "another mixture of datasets or other weights (or in an epoch resumed under other \
                 weights: restore the job's KSPDMIX1 position first)"
            } else {
                "another dataset"
            };
            return Err(Error::BadPosition(format!(
                "saved on {what} (catalog identity {:08x}, this loader reads {catalog_identity:08x})",
                self.catalog_identity
            )));
        }
        if mine.len != cfg.len {
            return differs("dataset length", mine.len.to_string(), cfg.len.to_string());
        }
        if mine.seed != cfg.seed {
            return differs("seed", mine.seed.to_string(), cfg.seed.to_string());
        }
        if mine.shuffle != cfg.shuffle {
            return differs("shuffle", mine.shuffle.to_string(), cfg.shuffle.to_string());
        }
        if mine.order_block() != cfg.order_block() {
            return differs(
                "shuffle_block",
                mine.order_block().to_string(),
                cfg.order_block().to_string(),
            );
        }
        if mine.drop_last != cfg.drop_last {
            return differs(
                "drop_last",
                mine.drop_last.to_string(),
                cfg.drop_last.to_string(),
            );
        }
        if same_rank && (mine.rank, mine.world) != (cfg.rank, cfg.world) {
            return differs(
                "rank/world",
                format!("{}/{}", mine.rank, mine.world),
                format!(
                    "{}/{} (resume at another world size with the job position)",
                    cfg.rank, cfg.world
                ),
            );
        }
        Ok(())
    }

    /// The job position this rank's file gives, valid when the job was in
    /// lock-step (every rank at this step).
    pub fn job_position(&self) -> JobPosition {
        self.next.job_position()
    }

    /// This position after the rank delivered `ids` too, the next
    /// `ids.len()` steps of its epoch, folded into the digest as a loader
    /// folds what it hands out: for a checkpoint in the middle of a batch
    /// (a PyTorch dataset hands a batch's samples out one at a time, and
    /// saves the batch's start and how many it handed out). The ids are
    /// the caller's; [`audit_positions`] checks them as it checks any
    /// digest. A position whose digest is of an earlier epoch (saved at an
    /// epoch's start, before its first batch) starts the epoch's digest
    /// first; it must be an epoch dealt from its start (base 0), else
    /// [`Error::BadPosition`]; so is one advanced past the end of the
    /// rank's steps in its epoch.
    pub fn advanced(&self, ids: &[u64]) -> Result<SavedPosition> {
        let mut s = self.clone();
        if ids.is_empty() {
            return Ok(s);
        }
        // `cfg.len` is the epoch's length (a mixture's: the mixed epoch's).
        let steps = super::elastic::remainder_per_rank(&s.cfg, s.cfg.len, s.next.base);
        if s.next.index.saturating_add(ids.len() as u64) > steps {
            return Err(Error::BadPosition(format!(
                "{} ids after step {} of epoch {} go past the rank's {steps} steps of that epoch \
                 (rank {} of {}, dealt from entry {} on): a position advances within its epoch",
                ids.len(),
                s.next.index,
                s.next.epoch,
                s.next.rank,
                s.next.world,
                s.next.base
            )));
        }
        if s.digest.epoch != s.next.epoch {
            if s.next.base != 0 {
                return Err(Error::BadPosition(format!(
                    "a position at step {} of epoch {}, dealt from entry {} on, has a digest of epoch {}: \
                     not one a loader saves",
                    s.next.index, s.next.epoch, s.next.base, s.digest.epoch
                )));
            }
            s.digest = EpochDigest::new(s.next.epoch);
            s.digest_at = s.next;
            // An ordinary epoch: its order starts with every dataset's
            // stream unused.
            if let Some(m) = &mut s.mix {
                m.skip.iter_mut().for_each(|k| *k = 0);
            }
        }
        for &id in ids {
            s.digest.add(id);
        }
        s.next.index += ids.len() as u64;
        s.digest_at.index = s.next.index;
        Ok(s)
    }
}

/// Audits a job from its ranks' saved positions, across resumes at other
/// world sizes: per epoch (the epoch of each file's digest), the files of
/// each world that dealt it must be one lock-step world
/// ([`JobPosition::from_ranks`] on where each digest was taken), and the
/// worlds must follow each other (each starting where the one before
/// stopped, the first at the epoch's start). Then [`audit()`] checks the
/// sum of all their digests against the sampler's prefix. One report per
/// epoch, in epoch order; the first difference found is the error.
pub fn audit_positions(saved: &[SavedPosition]) -> Result<Vec<AuditReport>> {
    let first = saved
        .first()
        .ok_or_else(|| Error::AuditMismatch("no positions given".into()))?;
    if first.mixture {
        return audit_mixture(saved);
    }
    if let Some(i) = saved.iter().position(|s| s.mixture) {
        return Err(Error::AuditMismatch(format!(
            "position {i} was saved by a loader reading a mixture of datasets, position 0 by one \
             reading one dataset: they are of other jobs"
        )));
    }
    for (i, s) in saved.iter().enumerate() {
        let job = first.cfg.rank_world(s.cfg.rank, s.cfg.world);
        s.check_job(&job, first.catalog_identity, false)
            .map_err(|e| Error::AuditMismatch(format!("position {i} is of another job: {e}")))?;
    }
    let mut epochs: Vec<u64> = saved.iter().map(|s| s.digest.epoch).collect();
    epochs.sort_unstable();
    epochs.dedup();
    let mut reports = Vec::with_capacity(epochs.len());
    for epoch in epochs {
        let of_epoch: Vec<&SavedPosition> =
            saved.iter().filter(|s| s.digest.epoch == epoch).collect();
        // The worlds that dealt this epoch: (base, world) of each dealing.
        let mut worlds: Vec<(u64, u32)> = of_epoch
            .iter()
            .map(|s| (s.digest_at.base, s.cfg.world))
            .collect();
        worlds.sort_unstable();
        worlds.dedup();
        let mut consumed = 0u64;
        for (base, world) in worlds {
            if base != consumed {
                return Err(Error::AuditMismatch(format!(
                    "epoch {epoch}: a world of {world} ranks started at entry {base} of the epoch's \
                     order, but the positions before it stop at {consumed}: {}",
                    if base > consumed {
                        "a world's positions are missing, or samples were skipped"
                    } else {
                        "two worlds dealt the same entries"
                    }
                )));
            }
            let ranks: Vec<RankPosition> = of_epoch
                .iter()
                .filter(|s| (s.digest_at.base, s.cfg.world) == (base, world))
                .map(|s| s.digest_at)
                .collect();
            consumed = JobPosition::from_ranks(&ranks)
                .map_err(|e| Error::AuditMismatch(format!("epoch {epoch}: {e}")))?
                .consumed;
        }
        let digests: Vec<EpochDigest> = of_epoch.iter().map(|s| s.digest).collect();
        reports.push(audit(
            &first.cfg,
            JobPosition { epoch, consumed },
            &digests,
        )?);
    }
    Ok(reports)
}

/// One world's dealing of an epoch in a mixture job: the order it dealt
/// (the counts and what each dataset had used before it), where it started
/// in that order and where it stopped.
struct MixWorld<'a> {
    mix: &'a SavedMix,
    world: u32,
    base: u64,
    end: u64,
}

/// [`audit_positions`] of a mixture's files (`KSPDPOS4`): per epoch, each
/// world's files name the order it dealt; a world of the same order goes
/// on where the one before stopped, a world of another order (a resume
/// under other weights) starts that order at 0 with what the job had used
/// of each dataset's stream. Then [`audit_mix`] checks every digest of the
/// epoch against the last world's end.
fn audit_mixture(saved: &[SavedPosition]) -> Result<Vec<AuditReport>> {
    let mixes = saved
        .iter()
        .enumerate()
        .map(|(i, s)| match (&s.mix, s.mixture) {
            (Some(m), true) => Ok(m),
            (None, true) => Err(Error::BadPosition(format!(
                "position {i} is a mixture's KSPDPOS3, saved before kspeed recorded the mixture \
                 in rank positions (KSPDPOS4): it lacks the datasets' lengths and weights, so \
                 the audit cannot rebuild the mixed order; save the positions again with this \
                 version (restore_position reads it), or audit in Rust with audit_mix"
            ))),
            (_, false) => Err(Error::AuditMismatch(format!(
                "position {i} was saved by a loader reading one dataset, position 0 by one \
                 reading a mixture: they are of other jobs"
            ))),
        })
        .collect::<Result<Vec<&SavedMix>>>()?;
    let (first, m0) = (&saved[0], mixes[0]);
    for (i, (s, m)) in saved.iter().zip(&mixes).enumerate() {
        let other = |what: String| {
            Err(Error::AuditMismatch(format!(
                "position {i} is of another job: {what}"
            )))
        };
        if m.lens != m0.lens {
            return other(format!(
                "a mixture of datasets of lengths {:?}, position 0's {:?}",
                m.lens, m0.lens
            ));
        }
        let (a, b) = (&s.cfg, &first.cfg);
        for (what, x, y) in [
            ("seed", a.seed, b.seed),
            ("shuffle", a.shuffle as u64, b.shuffle as u64),
            ("drop_last", a.drop_last as u64, b.drop_last as u64),
            ("shuffle_block", a.order_block(), b.order_block()),
        ] {
            if x != y {
                return other(format!("{what} {x}, position 0's {y}"));
            }
        }
        if m.fingerprint != m0.fingerprint {
            return other("another mixture's datasets (catalogs)".into());
        }
    }
    // Any counts: the audit reads each order from its position.
    let sampler = MixSampler::new(first.cfg.rank_world(0, 1), &m0.lens, &m0.counts)
        .map_err(|e| Error::BadPosition(format!("position 0: {e}")))?;
    let mut epochs: Vec<u64> = saved.iter().map(|s| s.digest.epoch).collect();
    epochs.sort_unstable();
    epochs.dedup();
    let mut reports = Vec::with_capacity(epochs.len());
    for epoch in epochs {
        let of_epoch: Vec<usize> = (0..saved.len())
            .filter(|&i| saved[i].digest.epoch == epoch)
            .collect();
        // The worlds that dealt this epoch: (order, base, world) of each.
        let mut worlds: Vec<MixWorld> = Vec::new();
        for &i in &of_epoch {
            let s = &saved[i];
            let w = s.cfg.world;
            if !worlds
                .iter()
                .any(|x| x.mix == mixes[i] && (x.base, x.world) == (s.digest_at.base, w))
            {
                let ranks: Vec<RankPosition> = of_epoch
                    .iter()
                    .filter(|&&j| {
                        mixes[j] == mixes[i]
                            && (saved[j].digest_at.base, saved[j].cfg.world)
                                == (s.digest_at.base, w)
                    })
                    .map(|&j| saved[j].digest_at)
                    .collect();
                let end = JobPosition::from_ranks(&ranks)
                    .map_err(|e| Error::AuditMismatch(format!("epoch {epoch}: {e}")))?
                    .consumed;
                worlds.push(MixWorld {
                    mix: mixes[i],
                    world: w,
                    base: s.digest_at.base,
                    end,
                });
            }
        }
        // Resumes use stream entries up: an order's skip only grows, and
        // within one order the worlds follow each other.
        worlds.sort_by_key(|x| (x.mix.skip.iter().sum::<u64>(), x.base, x.end));
        let mut last: Option<MixPosition> = None;
        for x in &worlds {
            let here = |consumed| MixPosition {
                epoch,
                consumed,
                counts: x.mix.counts.clone(),
                skip: x.mix.skip.clone(),
            };
            let want = match &last {
                // The epoch's first order: nothing used before it.
                None => MixPosition {
                    skip: vec![0; x.mix.skip.len()],
                    ..here(0)
                },
                Some(p) if (&p.counts, &p.skip) == (&x.mix.counts, &x.mix.skip) => p.clone(),
                // Other weights: their order starts at its 0, after what
                // the job had used.
                Some(p) => MixPosition {
                    skip: sampler.used(p),
                    ..here(0)
                },
            };
            if want.skip != x.mix.skip {
                let (had, used) = (
                    x.mix.skip.iter().sum::<u64>(),
                    want.skip.iter().sum::<u64>(),
                );
                return Err(Error::AuditMismatch(format!(
                    "epoch {epoch}: a world of {} ranks dealt an order after stream entries {:?} \
                     of each dataset, but the positions before it had used {:?}: {}",
                    x.world,
                    x.mix.skip,
                    want.skip,
                    if last.is_none() {
                        "the positions of the world that began the epoch are missing"
                    } else if had > used {
                        "a world's positions are missing, or samples were skipped"
                    } else if had < used {
                        "some delivered twice (resumed from an earlier job position)"
                    } else {
                        "resumed from another job position"
                    }
                )));
            }
            if x.base != want.consumed {
                return Err(Error::AuditMismatch(format!(
                    "epoch {epoch}: a world of {} ranks started at entry {} of its order, but \
                     the positions before it stop at {}: {}",
                    x.world,
                    x.base,
                    want.consumed,
                    if x.base > want.consumed {
                        "a world's positions are missing, or samples were skipped"
                    } else {
                        "two worlds dealt the same entries"
                    }
                )));
            }
            last = Some(here(x.end));
        }
        let digests: Vec<EpochDigest> = of_epoch.iter().map(|&i| saved[i].digest).collect();
        let end = last.expect("an epoch has a world");
        reports.push(audit_mix(&sampler, &end, &digests)?);
    }
    Ok(reports)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampler::{ElasticSampler, Position};

    fn cfg() -> SamplerConfig {
        SamplerConfig::single(10, 1).rank_world(1, 2)
    }

    fn example() -> SavedPosition {
        let at = RankPosition {
            epoch: 0,
            base: 6,
            index: 1,
            rank: 1,
            world: 2,
        };
        SavedPosition {
            cfg: cfg(),
            catalog_identity: 0,
            mixture: false,
            mix: None,
            next: at,
            digest: EpochDigest {
                epoch: 0,
                count: 1,
                sum: EpochDigest::hash(0, 0),
            },
            digest_at: at,
        }
    }

    #[test]
    fn round_trip_and_check_value() {
        let s = example();
        let b = s.save();
        assert_eq!(SavedPosition::decode(&b).unwrap(), s);
        assert_eq!(
            s.job_position(),
            JobPosition {
                epoch: 0,
                consumed: 8
            }
        );
        // docs/FORMAT.md's check value.
        assert_eq!(
            u32::from_le_bytes(b[104..108].try_into().unwrap()),
            CHECK_CRC,
            "{:#010x}",
            u32::from_le_bytes(b[104..108].try_into().unwrap())
        );
        let mut bad = b.clone();
        bad[50] ^= 1;
        assert!(
            matches!(SavedPosition::decode(&bad), Err(Error::BadPosition(m)) if m.contains("checksum"))
        );
        assert!(SavedPosition::decode(&b[..100]).is_err());
    }

    const CHECK_CRC: u32 = 0xaf8b_839d;

    /// A mixture's position (`KSPDPOS4`): the example's fields, flag bit
    /// 2, and two datasets (lengths 6 and 4, counts 6 and 4, skip 0 and 1,
    /// fingerprint 7): docs/FORMAT.md's check value; the older `KSPDPOS3`
    /// of a mixture still decodes, and the audit refuses it by name.
    #[test]
    fn a_mixture_round_trips_with_its_check_value() {
        let s = SavedPosition {
            mixture: true,
            mix: Some(SavedMix {
                fingerprint: 7,
                lens: vec![6, 4],
                counts: vec![6, 4],
                skip: vec![0, 1],
            }),
            ..example()
        };
        let b = s.save();
        assert_eq!(b.len(), SavedPosition::mix_bytes(2));
        assert_eq!(b.len(), 120 + 48);
        assert_eq!(&b[0..8], b"KSPDPOS4");
        assert_eq!(SavedPosition::decode(&b).unwrap(), s);
        let crc = u32::from_le_bytes(b[164..168].try_into().unwrap());
        assert_eq!(crc, MIX_CHECK_CRC, "{crc:#010x}");
        for bad in [&b[..167], &b[..120]] {
            assert!(SavedPosition::decode(bad).is_err());
        }
        let mut flipped = b.clone();
        flipped[130] ^= 1;
        assert!(
            matches!(SavedPosition::decode(&flipped), Err(Error::BadPosition(m)) if m.contains("checksum"))
        );
        let old = SavedPosition { mix: None, ..s };
        let back = SavedPosition::decode(&old.save()).unwrap();
        assert!(back.mixture && back.mix.is_none());
        match audit_positions(&[back]) {
            Err(Error::BadPosition(m)) => assert!(m.contains("KSPDPOS4"), "{m}"),
            r => panic!("{r:?}"),
        }
    }

    const MIX_CHECK_CRC: u32 = 0x8fae_b446;

    #[test]
    fn another_job_is_named() {
        let s = example();
        let c = cfg();
        s.check_job(&c, 0, true).unwrap();
        for (other, id, what) in [
            (c.seed(2), 0, "seed"),
            (c.shuffle(false), 0, "shuffle"),
            (c.drop_last(true), 0, "drop_last"),
            (c.shuffle_block(4), 0, "shuffle_block"),
            (c.len(11), 0, "length"),
            (c, 7, "another dataset"),
            (c.rank_world(0, 3), 0, "rank/world"),
        ] {
            match s.check_job(&other, id, true) {
                Err(Error::BadPosition(m)) => assert!(m.contains(what), "{what}: {m}"),
                r => panic!("{what}: {r:?}"),
            }
        }
        // A job position resumes any rank and world.
        s.check_job(&c.rank_world(4, 5), 0, false).unwrap();
        // The shuffle block is saved (flag bits 8..32) and checked.
        let blocked = SavedPosition {
            cfg: c.shuffle_block(300),
            ..s.clone()
        };
        let back = SavedPosition::decode(&blocked.save()).unwrap();
        assert_eq!(back.cfg.shuffle_block, 300);
        back.check_job(&c.shuffle_block(300), 0, true).unwrap();
        match back.check_job(&c, 0, true) {
            Err(Error::BadPosition(m)) => assert!(m.contains("shuffle_block 300"), "{m}"),
            r => panic!("{r:?}"),
        }
    }

    /// Positions saved as the loader saves them: 3 ranks take 4 steps of
    /// epoch 1, 2 ranks the rest.
    fn job() -> Vec<SavedPosition> {
        let c = SamplerConfig::single(25, 3);
        let mut out = Vec::new();
        let mut start = JobPosition {
            epoch: 1,
            consumed: 0,
        };
        for (world, steps) in [(3u32, Some(4u64)), (2, None)] {
            for rank in 0..world {
                let s = ElasticSampler::new(c.rank_world(rank, world), start).unwrap();
                let n = steps.unwrap_or(s.per_rank(1));
                let mut d = EpochDigest::new(1);
                (0..n).for_each(|k| d.add(s.sample(1, k)));
                let at = s.rank_position(Position { epoch: 1, index: n });
                out.push(SavedPosition {
                    cfg: c.rank_world(rank, world),
                    catalog_identity: 5,
                    mixture: false,
                    mix: None,
                    next: at,
                    digest: d,
                    digest_at: at,
                });
            }
            start = out.last().unwrap().job_position();
        }
        out
    }

    #[test]
    fn audits_across_worlds_and_names_what_is_wrong() {
        let all = job();
        let r = audit_positions(&all).unwrap();
        assert_eq!(r.len(), 1);
        assert_eq!(
            r[0].to_string(),
            "epoch 1: 25 samples, each exactly once, and 1 padding duplicates"
        );
        let err = |v: &[SavedPosition]| match audit_positions(v) {
            Err(Error::AuditMismatch(m)) => m,
            r => panic!("{r:?}"),
        };
        // The first world missing.
        assert!(err(&all[3..]).contains("stop at 0"));
        // A rank of the second world missing.
        assert!(err(&all[..4]).contains("1 rank positions for a world of 2"));
        // Another job's file.
        let mut other = all.clone();
        other[1].cfg.seed = 4;
        assert!(err(&other).contains("seed"));
        // A rank out of lock-step.
        let mut ahead = all.clone();
        ahead[0].digest_at.index += 1;
        assert!(err(&ahead).contains("step"));
        assert!(err(&[]).contains("no positions"));
    }
}
