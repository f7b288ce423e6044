//! The memory tier: a fixed subset of the samples kept in memory, never
//! evicted. O_DIRECT bypasses the page cache, so without it a dataset that
//! fits in RAM would come from NVMe every epoch; and under a fresh random
//! order every epoch, LRU caching below 100 % thrashes, while a fixed subset
//! gives a hit rate equal to the fraction that fits.
//!
//! Membership: samples in id order until the budget is used (a sample's slot
//! is its length rounded up to 64 bytes). A member is filled the first time a
//! poller reads it from disk (one copy from the landing ring), and served by
//! a copy into the ring ever after.

use std::sync::atomic::{AtomicU8, Ordering};

use crate::dataset::Catalog;
use crate::error::Result;
use crate::landing::{CudaMode, LandingOptions, LandingRing};

const EMPTY: u8 = 0;
const FILLING: u8 = 1;
const FULL: u8 = 2;
const NOT_MEMBER: u64 = u64::MAX;

/// The tier's memory and membership.
pub struct Tier {
    mem: LandingRing,
    offsets: Vec<u64>,
    state: Vec<AtomicU8>,
    members: u64,
    member_bytes: u64,
}

impl Tier {
    /// Chooses members of `catalog` for a budget of `budget_bytes`, and maps
    /// (and locks, if `mlock`) the memory.
    pub fn new(catalog: &Catalog, budget_bytes: u64, mlock: bool) -> Result<Option<Tier>> {
        if budget_bytes == 0 {
            return Ok(None);
        }
        let mut offsets = vec![NOT_MEMBER; catalog.len() as usize];
        let (mut used, mut members, mut member_bytes) = (0u64, 0u64, 0u64);
        for id in 0..catalog.len() {
            let len = catalog.sample(id).len as u64;
            let slot = len.next_multiple_of(64);
            if used + slot > budget_bytes {
                continue;
            }
            offsets[id as usize] = used;
            used += slot;
            members += 1;
            member_bytes += len;
        }
        if used == 0 {
            return Ok(None);
        }
        let mem = LandingRing::new(&LandingOptions {
            ring_bytes: used,
            huge_pages: true,
            mlock,
            numa_node: None,
            gpu_pci: None,
            cuda: CudaMode::Off,
        })?;
        let state = (0..catalog.len()).map(|_| AtomicU8::new(EMPTY)).collect();
        Ok(Some(Tier {
            mem,
            offsets,
            state,
            members,
            member_bytes,
        }))
    }

    /// Samples in the tier.
    pub fn members(&self) -> u64 {
        self.members
    }

    /// Their bytes.
    pub fn member_bytes(&self) -> u64 {
        self.member_bytes
    }

    /// Whether `id` is a member.
    pub fn is_member(&self, id: u64) -> bool {
        self.offsets[id as usize] != NOT_MEMBER
    }

    /// Whether member `id` is filled (its bytes are final). Acquire: a
    /// thread that sees `true` sees the bytes.
    pub fn is_filled(&self, id: u64) -> bool {
        self.offsets[id as usize] != NOT_MEMBER
            && self.state[id as usize].load(Ordering::Acquire) == FULL
    }

    /// The first `len` bytes of member `id` in place, if it is filled.
    /// Filled bytes are never written again (a member is filled once and
    /// never evicted), so the view stays valid as long as the tier.
    ///
    /// # Panics
    /// When `len` reaches past the tier's memory (a length that is not the
    /// member's).
    pub fn view(&self, id: u64, len: usize) -> Option<&[u8]> {
        if !self.is_filled(id) {
            return None;
        }
        let off = self.offsets[id as usize] as usize;
        assert!(
            off + len <= self.mem.len(),
            "a tier view lies inside the tier"
        );
        // SAFETY: the range is inside the mapping (checked above); the
        // member is FULL (Acquire in is_filled), so its bytes were written
        // before and are never written again.
        Some(unsafe { self.mem.slice(off, len) })
    }

    /// Copies member `id` (`len` bytes) into `dst` if it is filled.
    ///
    /// # Safety
    /// `dst..dst+len` must be writable and not accessed by anyone else.
    pub unsafe fn copy_out(&self, id: u64, len: usize, dst: *mut u8) -> bool {
        let off = self.offsets[id as usize];
        if off == NOT_MEMBER || self.state[id as usize].load(Ordering::Acquire) != FULL {
            return false;
        }
        // SAFETY: the member's bytes were written before FULL was published
        // (Acquire above) and are never written again; dst per the contract.
        unsafe { std::ptr::copy_nonoverlapping(self.mem.as_mut_ptr().add(off as usize), dst, len) };
        true
    }

    /// Fills member `id` from `src` unless another poller already did or is doing it.
    ///
    /// # Safety
    /// `src..src+len` must be readable and hold the sample's bytes.
    pub unsafe fn fill(&self, id: u64, len: usize, src: *const u8) {
        let off = self.offsets[id as usize];
        if off == NOT_MEMBER {
            return;
        }
        let st = &self.state[id as usize];
        if st
            .compare_exchange(EMPTY, FILLING, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
        {
            // SAFETY: FILLING gives this thread exclusive write access to the
            // member's bytes; readers wait for FULL.
            unsafe {
                std::ptr::copy_nonoverlapping(src, self.mem.as_mut_ptr().add(off as usize), len)
            };
            st.store(FULL, Ordering::Release);
        }
    }
}
