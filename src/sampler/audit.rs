//! The exactly-once audit: a commutative digest of the ids each rank
//! delivers per epoch, checked against the sampler's consumed prefix.
//!
//! A rank folds `h(epoch, id) = mix64(mix64(epoch ^ 0x6b73706565646467) ^ id)`
//! into a wrapping sum and counts the ids. Sums commute, so the digests of
//! all ranks of all worlds that dealt an epoch add up to the digest of the
//! multiset the job delivered, whatever the order and the resumes; the
//! sampler alone gives the digest of the prefix `g(0..consumed)` it should
//! be (the padding duplicates included, as they are delivered). For a given
//! epoch `h` is a bijection of the id, so a skipped, repeated or foreign id
//! changes the sum except with probability about 2^-64.

use super::{JobPosition, MixPosition, MixSampler, Sampler, SamplerConfig};
use crate::error::{Error, Result};
use crate::hash::mix64;
use std::fmt;

const DIGEST_SALT: u64 = 0x6b73_7065_6564_6467; // "kspeeddg"

/// The ids delivered in one epoch, folded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EpochDigest {
    /// Epoch.
    pub epoch: u64,
    /// Ids folded.
    pub count: u64,
    /// Wrapping sum of `h(epoch, id)`.
    pub sum: u64,
}

impl EpochDigest {
    /// The digest of nothing delivered in `epoch`.
    pub fn new(epoch: u64) -> Self {
        EpochDigest {
            epoch,
            count: 0,
            sum: 0,
        }
    }

    /// The keyed hash of `id` in `epoch`.
    pub fn hash(epoch: u64, id: u64) -> u64 {
        mix64(mix64(epoch ^ DIGEST_SALT) ^ id)
    }

    /// Folds in one delivered id.
    pub fn add(&mut self, id: u64) {
        self.count = self.count.checked_add(1).expect("digest count overflow");
        self.sum = self.sum.wrapping_add(Self::hash(self.epoch, id));
    }

    /// The digest of both (of the same epoch).
    pub fn merge(&self, other: &EpochDigest) -> Result<EpochDigest> {
        if other.epoch != self.epoch {
            return Err(Error::AuditMismatch(format!(
                "a digest of epoch {} merged into one of epoch {}",
                other.epoch, self.epoch
            )));
        }
        Ok(EpochDigest {
            epoch: self.epoch,
            count: self.count + other.count,
            sum: self.sum.wrapping_add(other.sum),
        })
    }

    /// What a job of `cfg` (any rank and world) delivered when it stood at
    /// `pos`: the digest of `g(0..pos.consumed)` of `pos.epoch`, computed
    /// from the sampler alone (O(consumed) time, O(1) memory).
    pub fn expected(cfg: &SamplerConfig, pos: JobPosition) -> Result<EpochDigest> {
        let s = Sampler::new(cfg.rank_world(0, 1))?;
        let order = s.epoch(pos.epoch);
        let mut d = EpochDigest::new(pos.epoch);
        for j in 0..pos.consumed {
            d.add(order.global(j));
        }
        Ok(d)
    }
}

/// An audit that passed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AuditReport {
    /// Epoch.
    pub epoch: u64,
    /// Distinct samples delivered, each exactly once.
    pub samples: u64,
    /// Padding duplicates delivered besides (the first of the epoch's order
    /// again).
    pub padding: u64,
}

impl fmt::Display for AuditReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "epoch {}: {} samples, each exactly once",
            self.epoch,
            grouped(self.samples)
        )?;
        if self.padding > 0 {
            write!(f, ", and {} padding duplicates", grouped(self.padding))?;
        }
        Ok(())
    }
}

/// `n` with a comma every three digits (1,281,167), as people read counts.
fn grouped(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// Checks the digests of every rank (of every world) that dealt
/// `pos.epoch` against what the sampler says the job consumed at `pos`.
/// Names the first difference: a digest of another epoch, a count
/// mismatch (samples skipped or delivered twice), or a digest mismatch
/// (the same count but other samples: a repeat in place of a skip, a
/// sample of another epoch).
pub fn audit(
    cfg: &SamplerConfig,
    pos: JobPosition,
    digests: &[EpochDigest],
) -> Result<AuditReport> {
    compare(&EpochDigest::expected(cfg, pos)?, digests)?;
    Ok(AuditReport {
        epoch: pos.epoch,
        samples: pos.consumed.min(cfg.len),
        padding: pos.consumed.saturating_sub(cfg.len),
    })
}

/// [`audit`] of a mixture, across resumes under new weights: the digests
/// of every rank of every world that dealt `pos.epoch` (under any weights)
/// against what `mix` says the job consumed when it stood at `pos` (a
/// [`MixPosition`] of `mix`'s datasets: the last world's, any weights).
///
/// Whatever the weights were, dataset `d`'s slots in an epoch take its
/// stream's entries in order, each once, and a resume under new weights
/// goes on from the first entry not used ([`MixSampler::resume`]). So the
/// job delivered exactly stream entries `0..u_d` of every dataset, `u_d`
/// being [`MixSampler::used`] at `pos` (the consumed prefix under the old
/// weights and the rest under the new ones together), plus the padding of
/// the last order (its entries past its end, which repeat its start). The
/// report counts those entries (distinct samples while `u_d <= N_d`).
/// Padding of an order that a resume under new weights then went on from
/// is not counted (a loader never saves such a position: at an epoch's
/// end its position is the next epoch's start).
pub fn audit_mix(
    mix: &MixSampler,
    pos: &MixPosition,
    digests: &[EpochDigest],
) -> Result<AuditReport> {
    let d = mix.counts().len();
    if pos.counts.len() != d || pos.skip.len() != d {
        return Err(Error::AuditMismatch(format!(
            "a position of a mixture of {} datasets audited against one of {d}",
            pos.counts.len()
        )));
    }
    let used = mix.used(pos);
    // An order whose dataset d has u_d slots from stream entry 0: every
    // entry the epoch used, once.
    let prefix = mix.order_of(&MixPosition {
        epoch: pos.epoch,
        consumed: 0,
        counts: used.clone(),
        skip: vec![0; d],
    });
    let last = mix.order_of(pos);
    let padding = pos.consumed.saturating_sub(last.len());
    let mut want = EpochDigest::new(pos.epoch);
    for j in 0..prefix.len() {
        want.add(prefix.sample(j).id);
    }
    for j in 0..padding {
        want.add(last.sample(j % last.len()).id);
    }
    compare(&want, digests)?;
    Ok(AuditReport {
        epoch: pos.epoch,
        samples: prefix.len(),
        padding,
    })
}

/// Checks the sum of `digests` against `want`, naming the first difference.
fn compare(want: &EpochDigest, digests: &[EpochDigest]) -> Result<()> {
    let pos = want;
    let mut got = EpochDigest::new(pos.epoch);
    for (i, d) in digests.iter().enumerate() {
        if d.epoch != pos.epoch {
            return Err(Error::AuditMismatch(format!(
                "digest {i} is of epoch {}, the audit is of epoch {}",
                d.epoch, pos.epoch
            )));
        }
        got = got.merge(d)?;
    }
    if got.count != want.count {
        return Err(Error::AuditMismatch(format!(
            "epoch {}: the ranks delivered {} samples, the sampler consumed {} ({})",
            pos.epoch,
            got.count,
            want.count,
            if got.count < want.count {
                "some skipped"
            } else {
                "some delivered twice"
            }
        )));
    }
    if got.sum != want.sum {
        return Err(Error::AuditMismatch(format!(
            "epoch {}: {} samples delivered as expected, but not the expected ones \
             (digest {:016x}, the sampler's {:016x}): a sample repeated in place of another \
             or one of another epoch",
            pos.epoch, got.count, got.sum, want.sum
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_read_as_people_count() {
        let r = AuditReport {
            epoch: 3,
            samples: 1_281_167,
            padding: 0,
        };
        assert_eq!(
            r.to_string(),
            "epoch 3: 1,281,167 samples, each exactly once"
        );
        let r = AuditReport {
            epoch: 0,
            samples: 999,
            padding: 1000,
        };
        assert_eq!(
            r.to_string(),
            "epoch 0: 999 samples, each exactly once, and 1,000 padding duplicates"
        );
    }
}
