//! A loader's positions: a rank's (`KSPDPOS3`), the job's (`KSPDJOB1`; a
//! mixture's `KSPDMIX1`, which also resumes under new weights), and the
//! identity they record (docs/FORMAT.md, "Saved positions", "Job
//! positions", "Mixing datasets").
//!
//! A mixture's sampler carries where its epoch's order starts: an ordinary
//! epoch, or the rest of one resumed under other weights (each dataset's
//! stream entries already used, [`MixSampler::resume`]). The identity a
//! position records folds those in for such an epoch, so a rank position
//! taken there resumes only a loader dealing that same rest (one that
//! restored its job position), never an ordinary epoch by mistake.

use super::Loader;
use crate::error::{Error, Result};
use crate::hash::mix64;
use crate::sampler::{
    counts_hash, JobPosition, MixPosition, MixSampler, Position, RankPosition, Sampler, SavedMix,
    SavedPosition,
};

impl Loader {
    /// The current position, serialized
    /// ([`POSITION_BYTES`](crate::sampler::POSITION_BYTES) bytes,
    /// `KSPDPOS3`) for a checkpoint: where this rank resumes (its epoch,
    /// step, and where the world it belongs to started dealing the epoch),
    /// the exactly-once digest of what it delivered in the epoch
    /// ([`Loader::digest`]), the sampler's settings and the catalog's
    /// identity. [`Loader::restore_position`] resumes it on the same rank of
    /// the same world; [`Loader::restore_job_position`] on any rank of any
    /// world, when the job was in lock-step; `kspeed audit` checks every
    /// rank's file of a job for exactly-once delivery.
    ///
    /// A loader reading a mixture saves a `KSPDPOS4`
    /// ([`SavedPosition::mix_bytes`] of its datasets): the same fields, and
    /// the datasets' lengths, the weights' counts and the order of the
    /// digest's epoch, so that the audit covers mixtures from the files
    /// alone, across resumes under other weights.
    pub fn save_position(&self) -> Vec<u8> {
        self.saved_position().save()
    }

    /// What [`Loader::save_position`] saves, decoded.
    pub fn saved_position(&self) -> SavedPosition {
        let next = self.rank_position();
        let mix = self.mixture().map(|m| SavedMix {
            fingerprint: m.fingerprint(&self.dataset_identities()),
            lens: m.lens().to_vec(),
            counts: m.counts().to_vec(),
            skip: self
                .digest_skip
                .clone()
                .unwrap_or_else(|| m.job_position(self.digest.epoch, 0).skip),
        });
        SavedPosition {
            cfg: *self.deal.sampler().config(),
            catalog_identity: self.identity_of(self.deal.sampler().inner(), next.epoch),
            mixture: self.mixture().is_some(),
            mix,
            next,
            digest: self.digest,
            digest_at: self.digest_at,
        }
    }

    /// Continues from a position saved by [`Loader::save_position`] with the
    /// same dataset (catalog), seed, shuffle, rank, world and drop_last;
    /// anything else is an [`Error::BadPosition`] naming what differs. The
    /// exactly-once digest continues from the saved one. Positions of
    /// earlier versions (`KSPDPOS2`, `KSPDPOS1`) are accepted; they carry no
    /// digest, so the digest starts empty at their step.
    ///
    /// A mixture's position resumes the same weights. One taken in an
    /// epoch resumed under new weights needs to know what each dataset had
    /// used before, which its job position carries: restore that
    /// ([`Loader::restore_job_position`], `KSPDMIX1`) first, then this one.
    pub fn restore_position(&mut self, bytes: &[u8]) -> Result<()> {
        self.release_batch();
        self.check_failed()?;
        let cfg = *self.deal.sampler().config();
        let (inner, job, pos, digest) = if SavedPosition::is_rank_position(bytes) {
            let s = SavedPosition::decode(bytes)?;
            let inner = self.sampler_for(s.next.epoch, s.catalog_identity);
            s.check_job(&cfg, self.identity_of(&inner, s.next.epoch), true)?;
            let job = JobPosition {
                epoch: s.next.epoch,
                consumed: s.next.base,
            };
            let pos = Position {
                epoch: s.next.epoch,
                index: s.next.index,
            };
            // The order of the digest's epoch, when it is not the one this
            // loader now deals (a world that resumed under other weights
            // in an epoch it has since finished).
            let skip = s.mix.map(|m| m.skip);
            (inner, job, pos, Some((s.digest, s.digest_at, skip)))
        } else {
            // Older versions predate mixtures resumed under new weights.
            let inner = self.ordinary_sampler();
            let pos = Sampler::new(cfg)?.restore(bytes, self.identity_of(&inner, 0))?;
            let job = JobPosition {
                epoch: pos.epoch,
                consumed: 0,
            };
            (inner, job, pos, None)
        };
        let deal = self.deal.over(inner, job)?;
        if pos.index > deal.steps(pos.epoch) {
            return Err(Error::BadPosition(format!(
                "step {} is past the epoch's {} steps",
                pos.index,
                deal.steps(pos.epoch)
            )));
        }
        self.check_end(pos.epoch)?;
        self.check_attached_deal(&deal, pos.epoch)?;
        self.deal = deal;
        self.restart(pos)?;
        match digest {
            Some((d, at, skip)) => {
                (self.digest, self.digest_at) = (d, at);
                self.digest_skip = skip;
            }
            None => self.reset_digest(pos),
        }
        Ok(())
    }

    /// This rank's place: the epoch and step of the next sample it
    /// delivers, where the world it belongs to started dealing that epoch
    /// (`base`: entries of the epoch's global order consumed before; 0
    /// unless the job resumed inside the epoch), its rank and world.
    pub fn rank_position(&self) -> RankPosition {
        self.deal.sampler().rank_position(self.position())
    }

    /// The job's position, from this rank's: `base + index * world` entries
    /// of the epoch's global order consumed, valid for any world size
    /// ([`JobPosition`]). It is the job's when the job is in lock-step:
    /// every rank at the same step, which DDP training is at a step
    /// boundary (every rank takes one batch per step; the batches of an
    /// epoch are equal on every rank). To check rather than assume, gather
    /// every rank's [`Loader::rank_position`] (or saved position) and call
    /// [`JobPosition::from_ranks`], which refuses ranks out of lock-step
    /// with [`Error::NotLockStep`] naming the first that differs.
    pub fn job_position(&self) -> JobPosition {
        self.rank_position().job_position()
    }

    /// The job position, serialized with the sampler's settings and the
    /// catalog's identity: [`JOB_POSITION_BYTES`](crate::sampler::JOB_POSITION_BYTES)
    /// bytes (`KSPDJOB1`), or for a mixture a [`MixPosition`] (`KSPDMIX1`,
    /// [`MixPosition::bytes_for`] its datasets), which also records the
    /// weights' counts and what each dataset used before the epoch's order,
    /// so that it resumes under other weights too.
    pub fn save_job_position(&self) -> Vec<u8> {
        self.encode_job_position(self.job_position())
    }

    /// `job` (a job position of this loader's job, such as the job's place
    /// in the middle of a batch) serialized as [`Loader::save_job_position`]
    /// does.
    pub fn encode_job_position(&self, job: JobPosition) -> Vec<u8> {
        match self.mixture() {
            Some(m) => m
                .job_position(job.epoch, job.consumed)
                .save(m, &self.dataset_identities()),
            None => job
                .save(
                    self.deal.sampler().config(),
                    self.identity_of(self.deal.sampler().inner(), job.epoch),
                )
                .to_vec(),
        }
    }

    /// Continues a job from a job position, at this loader's rank and world
    /// (any world size): the rest of the epoch, each sample not yet
    /// consumed exactly once across the ranks (docs/FORMAT.md, "Job
    /// positions"), then ordinary epochs. `bytes` is a saved job position
    /// ([`Loader::save_job_position`]) or any rank's saved position
    /// ([`Loader::save_position`], whose job position it takes). A position
    /// of another dataset, seed, shuffle or drop_last is an
    /// [`Error::BadPosition`] naming it. The digest starts empty.
    ///
    /// A mixture's job position (`KSPDMIX1`) may come from other weights:
    /// the rest of the epoch then follows this loader's weights, each
    /// dataset going on from the first entry of its stream the job had not
    /// used, so nothing already delivered in the epoch comes again while
    /// no dataset is drawn past its length (docs/FORMAT.md, "Mixing
    /// datasets"); the next epoch is this loader's ordinary one.
    pub fn restore_job_position(&mut self, bytes: &[u8]) -> Result<()> {
        self.release_batch();
        self.check_failed()?;
        let cfg = *self.deal.sampler().config();
        let (inner, job) = if MixPosition::is_mix(bytes) {
            let m = self.mixture().ok_or_else(|| {
                Error::BadPosition(
                    "a mixture's job position (KSPDMIX1), and this loader reads one dataset".into(),
                )
            })?;
            let pos = MixPosition::restore(bytes, m, &self.dataset_identities())?;
            let resumed = m.resume(&pos)?;
            let job = resumed.start_position();
            (Sampler::mixed(resumed)?, job)
        } else if SavedPosition::is_rank_position(bytes) {
            let s = SavedPosition::decode(bytes)?;
            let inner = self.sampler_for(s.next.epoch, s.catalog_identity);
            s.check_job(&cfg, self.identity_of(&inner, s.next.epoch), false)?;
            (inner, s.job_position())
        } else {
            let (epoch, identity) = JobPosition::claims(bytes)?;
            let inner = self.sampler_for(epoch, identity);
            let job = JobPosition::restore(bytes, &cfg, self.identity_of(&inner, epoch))?;
            (inner, job)
        };
        self.check_end(job.epoch)?;
        let deal = self.deal.over(inner, job)?;
        self.check_attached_deal(&deal, job.epoch)?;
        self.deal = deal;
        let start = Position {
            epoch: job.epoch,
            index: 0,
        };
        self.restart(start)?;
        self.reset_digest(start);
        Ok(())
    }

    /// Each dataset's catalog identity, in the mixture's order.
    fn dataset_identities(&self) -> Vec<u32> {
        self.catalogs().iter().map(|c| c.identity()).collect()
    }

    /// This loader's sampler dealing ordinary epochs only: a mixture
    /// resumed under other weights goes back to its weights' own order.
    fn ordinary_sampler(&self) -> Sampler {
        let inner = self.deal.sampler().inner();
        match inner.mixture() {
            Some(m) => Sampler::mixed(ordinary(m)).expect("a sampler already checked"),
            None => inner.clone(),
        }
    }

    /// The sampler that dealt a position saved with `identity` in `epoch`:
    /// this loader's, or (a mixture's position of an ordinary epoch, this
    /// loader being in the rest of one resumed under other weights) its
    /// ordinary one. This loader's when neither matches: the position's
    /// check then names what differs.
    fn sampler_for(&self, epoch: u64, identity: u32) -> Sampler {
        let current = self.deal.sampler().inner();
        if self.identity_of(current, epoch) != identity {
            let plain = self.ordinary_sampler();
            if self.identity_of(&plain, epoch) == identity {
                return plain;
            }
        }
        current.clone()
    }

    /// The identity positions of `epoch` dealt by `sampler` record: the
    /// catalog's; for a mixture, its catalogs' and its per-epoch counts
    /// folded in (a position of another mixture or other weights is
    /// refused as another dataset), and in an epoch resumed under other
    /// weights what each dataset had used before its order.
    fn identity_of(&self, sampler: &Sampler, epoch: u64) -> u32 {
        let id = self.parts().0.identity();
        match sampler.mixture() {
            None => id,
            Some(m) => {
                let mut h = mix64(id as u64 ^ counts_hash(m.counts()));
                let skip = m.job_position(epoch, 0).skip;
                if skip.iter().any(|&q| q != 0) {
                    h = mix64(h ^ counts_hash(&skip));
                }
                (h ^ (h >> 32)) as u32
            }
        }
    }
}

/// `m` dealing its own weights' ordinary epochs (nothing resumed).
fn ordinary(m: &MixSampler) -> MixSampler {
    let start = MixPosition {
        epoch: 0,
        consumed: 0,
        counts: m.counts().to_vec(),
        skip: vec![0; m.counts().len()],
    };
    m.resume(&start).expect("its own counts")
}
