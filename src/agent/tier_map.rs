//! The rank's read-only mapping of the node tier (tier views through the
//! agent, docs/AGENT.md "Tier views"): the agent passes its tier's memfd
//! opened `O_RDONLY` with ATTACHED, and a batch's view words name where in
//! it each sample served from the tier lies. The rank reads those bytes in
//! place instead of the agent copying them into its ring.
//!
//! Why this is safe to hold as `&[u8]`: a member's bytes are written once,
//! when it is filled, and its view word is published only after that
//! (the batch's ready word, Release); and the agent never writes a filled
//! member again in the same memfd: a new job's members (`Tier::relayout`)
//! and another user's (`Tier::reset`) get a fresh memfd, so the bytes a
//! rank holds in this mapping do not change for as long as it is mapped,
//! attached or not (batches kept out across a re-attach included). Offsets are checked against
//! the mapping's size here, so a wrong view word is a named error, never
//! a read outside the mapping. The memfd is sealed against shrinking
//! (checked), so the agent cannot truncate it under the mapping.
//!
//! This module owns a raw mapping, so it is allowed `unsafe`.

use std::fs::File;
use std::os::fd::OwnedFd;

use memmap2::{MmapOptions, MmapRaw};

use super::shm::{check_sealed, io_err};
use crate::error::{Error, Result};

/// The node tier, mapped read-only in a rank.
pub struct TierMap {
    map: MmapRaw,
    _file: File,
}

impl std::fmt::Debug for TierMap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TierMap")
            .field("bytes", &self.map.len())
            .finish()
    }
}

impl TierMap {
    /// Maps the node tier's memfd an ATTACHED reply carried: a memfd sealed
    /// against shrinking of at least `bytes`, mapped `PROT_READ`,
    /// `MAP_SHARED`.
    pub fn open(fd: OwnedFd, bytes: u64) -> Result<TierMap> {
        let file = File::from(fd);
        check_sealed(&file, bytes, "node tier")?;
        let len = usize::try_from(bytes).map_err(|_| Error::AttachProtocol {
            what: format!("a node tier of {bytes} bytes"),
        })?;
        let map = MmapOptions::new()
            .len(len)
            .map_raw_read_only(&file)
            .map_err(|e| io_err("mmap PROT_READ", "node tier", e))?;
        Ok(TierMap { map, _file: file })
    }

    /// The mapped bytes.
    pub fn len(&self) -> u64 {
        self.map.len() as u64
    }

    /// Whether the mapping is empty (never: a tier has a member).
    pub fn is_empty(&self) -> bool {
        self.map.len() == 0
    }

    /// Whether `len` bytes at `offset` lie inside the mapping.
    pub fn holds(&self, offset: u64, len: u64) -> bool {
        offset.checked_add(len).is_some_and(|end| end <= self.len())
    }

    /// `len` bytes at `offset`: a sample a view word named, in a batch the
    /// rank holds.
    ///
    /// # Panics
    /// When the range is outside the mapping (check with
    /// [`TierMap::holds`] first: the loader turns that into a named error).
    pub fn slice(&self, offset: u64, len: usize) -> &[u8] {
        assert!(
            self.holds(offset, len as u64),
            "a tier view {offset}+{len} past the node tier's {} bytes",
            self.len()
        );
        // SAFETY: in bounds (checked); the agent never writes a member a
        // view word named again in this memfd (module docs); the mapping
        // lives as long as `&self`.
        unsafe { std::slice::from_raw_parts(self.map.as_ptr().add(offset as usize), len) }
    }
}
