//! A job's place in a mixture of datasets (`KSPDMIX1`): the epoch, the
//! counts its order was made of, the stream entries each dataset had used
//! before that order, and how much of the order is consumed. Valid at any
//! world size and under other weights ([`super::MixSampler::resume`]); the
//! layout is frozen in docs/FORMAT.md ("Mixing datasets").

use crate::error::{Error, Result};
use crate::hash::mix64;

use super::MAX_DATASETS;

const MIX_MAGIC: &[u8; 8] = b"KSPDMIX1";
const MIX_HEADER_BYTES: usize = 44;
const COUNTS_SALT: u64 = 0x6b73_7065_6564_636e; // "kspeedcn"

/// The hash of a mixture's per-epoch counts, recorded in positions.
pub fn counts_hash(counts: &[u64]) -> u64 {
    let mut h = mix64(counts.len() as u64 ^ COUNTS_SALT);
    for &c in counts {
        h = mix64(h ^ c);
    }
    h
}

/// A job's place in a mixture, valid at any world size: which order the
/// epoch is in (the counts it was made of and the stream entries each
/// dataset had used before it) and how much of that order is consumed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MixPosition {
    /// Epoch.
    pub epoch: u64,
    /// Entries of the order consumed (by all ranks together, in lock-step:
    /// a rank's steps times the world, plus where this world started).
    pub consumed: u64,
    /// Each dataset's slots per epoch when the position was saved.
    pub counts: Vec<u64>,
    /// Stream entries of each dataset used in this epoch before the order
    /// (0 unless the weights changed within the epoch).
    pub skip: Vec<u64>,
}

impl MixPosition {
    /// Bytes of a saved position of `datasets` datasets.
    pub fn bytes_for(datasets: usize) -> usize {
        MIX_HEADER_BYTES + 16 * datasets + 4
    }

    /// Whether `bytes` claim to be a mixture position (by their magic).
    pub fn is_mix(bytes: &[u8]) -> bool {
        bytes.len() >= 8 && &bytes[0..8] == MIX_MAGIC
    }

    /// Serializes with the job's `fingerprint`
    /// ([`super::MixSampler::fingerprint`]).
    ///
    /// Layout (little-endian): magic `KSPDMIX1`, epoch u64, consumed u64,
    /// fingerprint u64, counts hash u64 ([`counts_hash`]), datasets D u32,
    /// then per dataset count u64 and skip u64, then CRC32C u32 of
    /// everything before it.
    pub fn encode(&self, fingerprint: u64) -> Vec<u8> {
        let mut b = Vec::with_capacity(Self::bytes_for(self.counts.len()));
        b.extend_from_slice(MIX_MAGIC);
        b.extend_from_slice(&self.epoch.to_le_bytes());
        b.extend_from_slice(&self.consumed.to_le_bytes());
        b.extend_from_slice(&fingerprint.to_le_bytes());
        b.extend_from_slice(&counts_hash(&self.counts).to_le_bytes());
        b.extend_from_slice(&(self.counts.len() as u32).to_le_bytes());
        for (c, q) in self.counts.iter().zip(&self.skip) {
            b.extend_from_slice(&c.to_le_bytes());
            b.extend_from_slice(&q.to_le_bytes());
        }
        let crc = crc32c::crc32c(&b);
        b.extend_from_slice(&crc.to_le_bytes());
        b
    }

    /// Decodes a position encoded by [`MixPosition::encode`] for a mixture
    /// of `datasets` datasets whose job has `fingerprint`.
    pub fn decode(bytes: &[u8], datasets: usize, fingerprint: u64) -> Result<Self> {
        let bad = |m: String| Err(Error::BadPosition(m));
        if bytes.len() < MIX_HEADER_BYTES + 4 || !Self::is_mix(bytes) {
            return bad("not a kspeed mixture position (magic KSPDMIX1)".into());
        }
        let u64_at = |o: usize| u64::from_le_bytes(bytes[o..o + 8].try_into().expect("8 bytes"));
        let d = u32::from_le_bytes(bytes[40..44].try_into().expect("4 bytes")) as usize;
        if d > MAX_DATASETS || bytes.len() != Self::bytes_for(d) {
            return bad(format!(
                "{} bytes for a mixture of {d} datasets",
                bytes.len()
            ));
        }
        let body = bytes.len() - 4;
        let crc = u32::from_le_bytes(bytes[body..].try_into().expect("4 bytes"));
        if crc != crc32c::crc32c(&bytes[..body]) {
            return bad("checksum mismatch (corrupt)".into());
        }
        if d != datasets {
            return bad(format!(
                "saved for a mixture of {d} datasets, this one has {datasets}"
            ));
        }
        if u64_at(24) != fingerprint {
            return bad(
                "saved on other datasets (lengths or catalogs) or with another seed, shuffle or drop_last"
                    .into(),
            );
        }
        let counts: Vec<u64> = (0..d).map(|i| u64_at(MIX_HEADER_BYTES + 16 * i)).collect();
        let skip: Vec<u64> = (0..d)
            .map(|i| u64_at(MIX_HEADER_BYTES + 16 * i + 8))
            .collect();
        if u64_at(32) != counts_hash(&counts) {
            return bad("the counts do not match their hash".into());
        }
        if counts
            .iter()
            .try_fold(0u64, |a, &c| a.checked_add(c))
            .is_none()
        {
            return bad("the saved counts overflow".into());
        }
        Ok(MixPosition {
            epoch: u64_at(8),
            consumed: u64_at(16),
            counts,
            skip,
        })
    }
}
