//! The memory tier: a fixed subset of the samples kept in memory, never
//! evicted. O_DIRECT bypasses the page cache, so without it a dataset that
//! fits in RAM would come from NVMe every epoch; and under a fresh random
//! order every epoch, LRU caching below 100 % thrashes, while a fixed subset
//! gives a hit rate equal to the fraction that fits.
//!
//! Membership for a rank alone: samples in id order until the budget is used
//! (a sample's slot is its length rounded up to 64 bytes). In cluster mode the samples this
//! node does not hold come first ([`Tier::preferring`]): a hit on one of them
//! saves a push from another node, a hit on a local one only a read of the
//! local NVMe. A rank of several reads a different share of the dataset each
//! epoch, so a fixed subset by id holds many samples it will not read again
//! for epochs: its tier is chosen by its known future instead
//! ([`Tier::by_reads`], [`future_reads`]: the samples it reads most often in
//! the coming epochs first; NoPFS's clairvoyant counts). So is a mixture's,
//! over the ids of its datasets side by side ([`TierSamples`]): its weights
//! draw some samples several times an epoch and others not at all. A member is filled
//! the first time a
//! poller reads it from disk or, in cluster mode, its owner pushes it (one
//! copy from the landing ring), and served by a copy into the ring ever
//! after: by a poller when this node holds it, else by the network thread
//! in place of a grant.
//!
//! The node agent shares one tier among the ranks it serves
//! ([`Tier::new_checked`]): a member is then filled from one rank's ring,
//! memory that rank can write, and served to the others. A CRC is no
//! defence against a rank that forges bytes on purpose (four bytes fix any
//! CRC32C), so the agent shares a tier only among ranks of one user, which
//! trust each other (`agent::node`); the CRC check catches a ring spoiled
//! by accident, and every copy between the tier and a ring goes through
//! the kernel ([`crate::sys::copy_faultable`]), so a ring page the rank
//! punched out of a hugetlb memfd fails that copy instead of killing the
//! agent with SIGBUS.

use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};

use crate::dataset::Catalog;
use crate::error::Result;
use crate::landing::{CudaMode, LandingOptions, LandingRing};

/// What a tier needs of the samples it may hold: how many ids there are,
/// and each one's length and CRC32C. One catalog, or a mixture's datasets
/// side by side in one id space (`shared::Input`).
pub(crate) trait TierSamples {
    /// Ids `0..ids()`.
    fn ids(&self) -> u64;
    /// Sample `id`'s length in bytes and its catalog CRC32C.
    fn len_crc(&self, id: u64) -> (u32, u32);
}

impl TierSamples for Catalog {
    fn ids(&self) -> u64 {
        self.len()
    }

    fn len_crc(&self, id: u64) -> (u32, u32) {
        let s = self.sample(id);
        (s.len, s.crc32c)
    }
}

const EMPTY: u8 = 0;
const FILLING: u8 = 1;
const FULL: u8 = 2;
const NOT_MEMBER: u64 = u64::MAX;

/// The tier's memory and membership.
pub struct Tier {
    /// None only while the agent's shared tier is between two memfds (its
    /// old memory dropped before the new is made: [`Tier::renew_memory`])
    /// and the new could not be had; such a tier is given to no loader.
    mem: Option<LandingRing>,
    /// Lock the memory (`mlock`): kept for fresh memory.
    mlock: bool,
    offsets: Vec<u64>,
    state: Vec<AtomicU8>,
    members: u64,
    member_bytes: u64,
    /// The slots' bytes at build (within the budget): what a
    /// [`Tier::relayout`] may use.
    capacity_bytes: u64,
    /// Per sample id, its catalog CRC32C (members only; others 0), when
    /// fills are checked and copies made through the kernel
    /// ([`Tier::new_checked`]): 4 bytes per sample of the catalog.
    crcs: Option<Vec<u32>>,
    /// Fills whose copy did not match the catalog's CRC (the member stays
    /// empty and a later read fills it).
    fills_refused: AtomicU64,
}

impl Tier {
    /// Chooses members of `catalog` for a budget of `budget_bytes`, and maps
    /// (and locks, if `mlock`) the memory.
    pub fn new(catalog: &Catalog, budget_bytes: u64, mlock: bool) -> Result<Option<Tier>> {
        Self::build(catalog, budget_bytes, mlock, false, &mut (0..catalog.len()))
    }

    /// As [`Tier::new`] (`checked`: [`Tier::new_checked`]), the samples for
    /// which `first` is true chosen before the others (each group in id
    /// order): in cluster mode, those this node does not hold. Unless
    /// `KSPEED_TIER_MEMBERS=ids` asks for plain id order (for measuring the
    /// two side by side).
    pub(crate) fn preferring(
        catalog: &dyn TierSamples,
        budget_bytes: u64,
        mlock: bool,
        checked: bool,
        first: &dyn Fn(u64) -> bool,
    ) -> Result<Option<Tier>> {
        let n = catalog.ids();
        if members_env() == Members::Ids {
            return Self::build(catalog, budget_bytes, mlock, checked, &mut (0..n));
        }
        let mut order = (0..n)
            .filter(|&id| first(id))
            .chain((0..n).filter(|&id| !first(id)));
        Self::build(catalog, budget_bytes, mlock, checked, &mut order)
    }

    /// As [`Tier::preferring`] (`first`: None for none), members chosen by
    /// `reads` ([`future_reads`]: how often the ranks it serves read each
    /// sample in the coming epochs): the samples read most often first,
    /// among equals those `first` prefers, then by id; samples not read in
    /// those epochs only after every one that is. A member read `k` times
    /// gives `k - 1` hits (the first read fills it); a fixed subset by id
    /// gives a rank of `W` about `1/W` of its budget's worth each epoch.
    /// `KSPEED_TIER_MEMBERS=ids` or `remote-first` ignore `reads`, to
    /// measure side by side.
    pub(crate) fn by_reads(
        catalog: &dyn TierSamples,
        budget_bytes: u64,
        mlock: bool,
        reads: &[u16],
        first: Option<&dyn Fn(u64) -> bool>,
    ) -> Result<Option<Tier>> {
        let n = catalog.ids();
        assert_eq!(reads.len() as u64, n, "a count per sample");
        let prefer = |id: u64| first.is_some_and(|f| f(id));
        match members_env() {
            Members::Ids => return Self::build(catalog, budget_bytes, mlock, false, &mut (0..n)),
            Members::RemoteFirst => {
                return Self::preferring(catalog, budget_bytes, mlock, false, &prefer);
            }
            Members::Reads => {}
        }
        let mut order = reads_order(reads, &prefer);
        Self::build(catalog, budget_bytes, mlock, false, &mut order)
    }

    /// Chooses the members again, by `reads` as [`Tier::by_reads`] does,
    /// within the slots' bytes at build: every member is emptied first
    /// (`&mut`: no loader holds the tier). The agent's node tier, when the
    /// first rank of a job tells which ranks the node serves.
    pub(crate) fn relayout(
        &mut self,
        catalog: &dyn TierSamples,
        reads: &[u16],
        first: &dyn Fn(u64) -> bool,
    ) -> Result<()> {
        assert_eq!(reads.len(), self.offsets.len(), "a count per sample");
        // The agent's tier: fresh memory, since a rank of the previous job
        // may still hold views of the old (batches kept out across a
        // re-attach), which must never change under it.
        self.renew_memory()?;
        self.empty();
        self.offsets.fill(NOT_MEMBER);
        let mut order = reads_order(reads, first);
        let (_, members, member_bytes) =
            place(catalog, self.capacity_bytes, &mut order, &mut self.offsets);
        if let Some(crcs) = &mut self.crcs {
            member_crcs(catalog, &self.offsets, crcs);
        }
        self.members = members;
        self.member_bytes = member_bytes;
        Ok(())
    }

    /// As [`Tier::new`], for a tier shared by several ranks whose rings it
    /// is filled from and copied into: each fill is checked against the
    /// catalog's CRC32C before the member is published (4 bytes per sample
    /// of the catalog kept), and copies to and from rings go through the
    /// kernel ([`crate::sys::copy_faultable`]).
    pub(crate) fn new_checked(
        catalog: &dyn TierSamples,
        budget_bytes: u64,
        mlock: bool,
    ) -> Result<Option<Tier>> {
        Self::build(catalog, budget_bytes, mlock, true, &mut (0..catalog.ids()))
    }

    /// Members: the samples of `order` (each id once) that fit, in that
    /// order.
    fn build(
        catalog: &dyn TierSamples,
        budget_bytes: u64,
        mlock: bool,
        checked: bool,
        order: &mut dyn Iterator<Item = u64>,
    ) -> Result<Option<Tier>> {
        if budget_bytes == 0 {
            return Ok(None);
        }
        let mut offsets = vec![NOT_MEMBER; catalog.ids() as usize];
        let (used, members, member_bytes) = place(catalog, budget_bytes, order, &mut offsets);
        if used == 0 {
            return Ok(None);
        }
        let mem = if checked {
            // The agent's node tier: shared, so a rank asking for tier
            // views can map it read-only (`agent::tier_map`).
            Self::shared_memory(used, mlock)?
        } else {
            LandingRing::new(&LandingOptions {
                ring_bytes: used,
                huge_pages: true,
                mlock,
                numa_node: None,
                gpu_pci: None,
                cuda: CudaMode::Off,
            })?
        };
        let state = (0..catalog.ids()).map(|_| AtomicU8::new(EMPTY)).collect();
        let crcs = checked.then(|| {
            let mut c = vec![0; catalog.ids() as usize];
            member_crcs(catalog, &offsets, &mut c);
            c
        });
        Ok(Some(Tier {
            mem: Some(mem),
            mlock,
            offsets,
            state,
            members,
            member_bytes,
            capacity_bytes: used,
            crcs,
            fills_refused: AtomicU64::new(0),
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

    /// Fills refused because the copy did not match the catalog's CRC32C
    /// or the ring's page could not be read (a checked tier only; see
    /// [`Tier::new_checked`]).
    pub fn fills_refused(&self) -> u64 {
        self.fills_refused.load(Ordering::Relaxed)
    }

    /// The agent's node tier memory: a sealed memfd mapping.
    fn shared_memory(bytes: u64, mlock: bool) -> Result<LandingRing> {
        LandingRing::shared_tier(crate::agent::shm::RingMap::create_node_tier(bytes)?, mlock)
    }

    /// Empties every member (for a new owner of a shared tier; `&mut`: no
    /// loader holds the tier meanwhile). A tier in shared memory (the
    /// agent's) gets fresh memory: a rank of the previous owner may still
    /// map the old memfd (tier views), and must never read the new
    /// owner's samples through it.
    pub fn reset(&mut self) -> Result<()> {
        self.renew_memory()?;
        self.empty();
        Ok(())
    }

    /// The agent's shared tier gets a fresh memfd (others keep theirs):
    /// the old is dropped first, so its huge pages and locked bytes are
    /// free for the new one. On failure the tier has no memory and must
    /// not be given to a loader ([`Tier::has_memory`]) until a later call
    /// succeeds.
    fn renew_memory(&mut self) -> Result<()> {
        // A checked tier is the agent's, in a shared memfd (`build`).
        if self.crcs.is_none() {
            return Ok(());
        }
        drop(self.mem.take());
        self.mem = Some(Self::shared_memory(self.capacity_bytes, self.mlock)?);
        Ok(())
    }

    /// Whether the tier has its memory (always, but for an agent's shared
    /// tier whose fresh memory could not be had: [`Tier::reset`]).
    pub(crate) fn has_memory(&self) -> bool {
        self.mem.is_some()
    }

    fn mem(&self) -> &LandingRing {
        self.mem
            .as_ref()
            .expect("a tier without memory is given to no loader")
    }

    fn empty(&mut self) {
        for st in &mut self.state {
            *st.get_mut() = EMPTY;
        }
    }

    /// The tier's shared memory, where it is the agent's node tier: what a
    /// rank asking for tier views maps read-only.
    pub(crate) fn shared_memory_map(&self) -> Option<&crate::agent::shm::RingMap> {
        self.mem.as_ref().and_then(|m| m.shared_map())
    }

    /// Where member `id`'s bytes lie in the tier's memory, if it is filled
    /// (a view word for an attached rank; `Tier::view` in this process).
    pub(crate) fn view_offset(&self, id: u64) -> Option<u64> {
        self.is_filled(id).then(|| self.offsets[id as usize])
    }

    /// Counts a refused fill; logs the first only (a rank that keeps
    /// spoiling its ring must not flood the agent's log).
    fn refuse_fill(&self, id: u64, why: &str) {
        if self.fills_refused.fetch_add(1, Ordering::Relaxed) == 0 {
            log::warn!(
                "memory tier: sample {id} not kept: {why} (later refusals are counted, not logged)"
            );
        }
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
            off + len <= self.mem().len(),
            "a tier view lies inside the tier"
        );
        // SAFETY: the range is inside the mapping (checked above); the
        // member is FULL (Acquire in is_filled), so its bytes were written
        // before and are never written again.
        Some(unsafe { self.mem().slice(off, len) })
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
        // SAFETY: inside the mapping (the member's offset).
        let src = unsafe { self.mem().as_mut_ptr().add(off as usize) };
        if self.crcs.is_some() {
            // A rank's ring: through the kernel, so a page the rank took
            // away fails this copy (the poller then reads from disk, where
            // the same fault is that rank's error) instead of the agent.
            // SAFETY: the member's bytes were written before FULL was
            // published (Acquire above) and are never written again; dst
            // per this function's contract.
            return unsafe { crate::sys::copy_faultable(dst, src, len) };
        }
        // SAFETY: as above; dst per the contract.
        unsafe { std::ptr::copy_nonoverlapping(src, dst, len) };
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
            // SAFETY: inside the mapping (the member's offset).
            let dst = unsafe { self.mem().as_mut_ptr().add(off as usize) };
            if self.crcs.is_some() {
                // From a rank's ring: through the kernel (see copy_out).
                // SAFETY: FILLING gives this thread exclusive write access
                // to the member's bytes; src per this function's contract.
                if !unsafe { crate::sys::copy_faultable(dst, src, len) } {
                    self.refuse_fill(id, "its page in the rank's ring could not be read");
                    st.store(EMPTY, Ordering::Release);
                    return;
                }
            } else {
                // SAFETY: FILLING gives this thread exclusive write access
                // to the member's bytes; readers wait for FULL.
                unsafe { std::ptr::copy_nonoverlapping(src, dst, len) };
            }
            if let Some(crcs) = &self.crcs {
                // SAFETY: the member's bytes, just written by this thread
                // (FILLING), inside the mapping.
                let copy = unsafe { self.mem().slice(off as usize, len) };
                if crc32c::crc32c(copy) != crcs[id as usize] {
                    self.refuse_fill(
                        id,
                        "its bytes in the rank's ring differ from the catalog's CRC32C (the ring was written while the agent copied, or the read returned corrupt bytes: run kspeed verify)",
                    );
                    st.store(EMPTY, Ordering::Release);
                    return;
                }
            }
            st.store(FULL, Ordering::Release);
        }
    }
}

/// Gives the samples of `order` (each id once) that fit in `budget_bytes`
/// their offsets, in that order (a slot is the length rounded up to 64
/// bytes): (bytes used, members, their bytes).
fn place(
    catalog: &dyn TierSamples,
    budget_bytes: u64,
    order: &mut dyn Iterator<Item = u64>,
    offsets: &mut [u64],
) -> (u64, u64, u64) {
    let (mut used, mut members, mut member_bytes) = (0u64, 0u64, 0u64);
    for id in order {
        let len = u64::from(catalog.len_crc(id).0);
        let slot = len.next_multiple_of(64);
        if used + slot > budget_bytes {
            continue;
        }
        debug_assert_eq!(
            offsets[id as usize], NOT_MEMBER,
            "sample {id} offered twice"
        );
        offsets[id as usize] = used;
        used += slot;
        members += 1;
        member_bytes += len;
    }
    (used, members, member_bytes)
}

/// Each member's catalog CRC32C, 0 for the others.
fn member_crcs(catalog: &dyn TierSamples, offsets: &[u64], crcs: &mut [u32]) {
    for (id, c) in crcs.iter_mut().enumerate() {
        *c = if offsets[id] == NOT_MEMBER {
            0
        } else {
            catalog.len_crc(id as u64).1
        };
    }
}

/// Ids by `reads`: most read first, among equals those `prefer` picks,
/// then by id; the samples not read after all of those (preferred first).
/// A counting sort of the ids read (at most [`READS_COUNTED`]) into one
/// array: O(n), 8 bytes per id read (a sort of 10^7 ids took 0.3 s); the
/// ids not read are walked, not stored.
fn reads_order<'a>(
    reads: &'a [u16],
    prefer: &'a dyn Fn(u64) -> bool,
) -> impl Iterator<Item = u64> + 'a {
    let most = reads.iter().copied().max().unwrap_or(0) as usize;
    // Key 2 (most - c) + (not preferred) for c >= 1: count `most`
    // preferred first.
    let key = |id: usize, c: u16| 2 * (most - c as usize) + usize::from(!prefer(id as u64));
    let mut at = vec![0usize; 2 * most + 1];
    for (id, &c) in reads.iter().enumerate().filter(|(_, &c)| c > 0) {
        at[key(id, c) + 1] += 1;
    }
    for k in 1..at.len() {
        at[k] += at[k - 1];
    }
    let mut read = vec![0u64; at[at.len() - 1]];
    for (id, &c) in reads.iter().enumerate().filter(|(_, &c)| c > 0) {
        let k = key(id, c);
        read[at[k]] = id as u64;
        at[k] += 1;
    }
    let n = reads.len() as u64;
    let unread =
        move |want: bool| (0..n).filter(move |&id| reads[id as usize] == 0 && prefer(id) == want);
    read.into_iter().chain(unread(true)).chain(unread(false))
}

/// How members are chosen, for measuring side by side
/// (`KSPEED_TIER_MEMBERS`): by id, remote first then by id, or (the
/// default) by the known future where there is one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Members {
    Ids,
    RemoteFirst,
    Reads,
}

/// Whether members may be chosen by reads (`KSPEED_TIER_MEMBERS` unset or
/// `reads`): the agent's node tier asks before [`Tier::relayout`].
pub(crate) fn by_reads_allowed() -> bool {
    members_env() == Members::Reads
}

fn members_env() -> Members {
    match std::env::var("KSPEED_TIER_MEMBERS").as_deref() {
        Ok("ids") => Members::Ids,
        Ok("remote-first") => Members::RemoteFirst,
        Ok("reads") | Err(_) => Members::Reads,
        Ok(other) => {
            log::warn!(
                "KSPEED_TIER_MEMBERS={other:?} is none of ids, remote-first, reads; using reads"
            );
            Members::Reads
        }
    }
}

/// Epochs [`future_reads`] looks ahead at most.
const READS_EPOCHS: u64 = 16;
/// Reads it counts at most (about a second of sampler lookups at build).
const READS_COUNTED: u64 = 1 << 24;

/// How often `ranks` of `sampler`'s world read each sample in the epochs
/// from `from` to `end` (at most [`READS_EPOCHS`] of them, and no more
/// whole epochs than [`READS_COUNTED`] reads allow; at least one): what
/// [`Tier::by_reads`] chooses members by (one rank's tier: its own rank;
/// the agent's node tier: the node's ranks), a count per id (a mixture's:
/// per id of its datasets side by side). None where counting tells
/// nothing: ranks that are the whole world of one dataset read every
/// sample once an epoch, so every count is the same and id order is as
/// good (and free). A mixture is counted even then: its weights read some
/// samples several times an epoch (`repeat`, a proportion above the
/// dataset's share) and others not at all (`choose`). A job resumed inside an epoch on
/// another number of ranks deals that epoch's rest differently
/// (`ElasticSampler`); the counts read the plain order, so for that epoch
/// they are an estimate: members chosen a little worse, never a wrong
/// byte.
pub(crate) fn future_reads(
    sampler: &crate::sampler::Sampler,
    ranks: std::ops::Range<u32>,
    from: u64,
    end: Option<u64>,
) -> Option<Vec<u16>> {
    let cfg = sampler.config();
    let ranks = ranks.start.min(cfg.world)..ranks.end.min(cfg.world);
    if let Some(m) = sampler.mixture() {
        return (!ranks.is_empty()).then(|| mixture_reads(m, ranks, from, end));
    }
    if ranks.len() as u32 >= cfg.world || ranks.is_empty() {
        return None;
    }
    let epochs = epochs_counted(sampler.per_rank() * ranks.len() as u64, from, end);
    let world = u64::from(cfg.world);
    let mut reads = vec![0u16; cfg.len as usize];
    for e in from..from.saturating_add(epochs) {
        let order = sampler.epoch(e);
        for k in 0..sampler.per_rank() {
            for r in ranks.clone() {
                let c = &mut reads[order.global(k * world + u64::from(r)) as usize];
                *c = c.saturating_add(1);
            }
        }
    }
    Some(reads)
}

/// Epochs [`future_reads`] counts from `from`: to `end`, at most
/// [`READS_EPOCHS`], and no more whole epochs of `per_epoch` reads than
/// [`READS_COUNTED`] allows; at least one.
fn epochs_counted(per_epoch: u64, from: u64, end: Option<u64>) -> u64 {
    end.map_or(READS_EPOCHS, |e| e.saturating_sub(from))
        .min(READS_EPOCHS)
        .min(READS_COUNTED / per_epoch.max(1))
        .max(1)
}

/// [`future_reads`] of a mixture: rank `r`'s step `k` of an epoch is the
/// mixed order's entry `base + r + k·world` (wrapped: padding repeats the
/// order's start).
fn mixture_reads(
    m: &crate::sampler::MixSampler,
    ranks: std::ops::Range<u32>,
    from: u64,
    end: Option<u64>,
) -> Vec<u16> {
    let world = u64::from(m.config().world);
    // An ordinary epoch's (the one `from` resumed in may be nearly over,
    // and epochs before the mixed order's start deal nothing).
    let ordinary = from.max(m.start_epoch()).saturating_add(1);
    let epochs = epochs_counted(m.per_rank(ordinary) * ranks.len() as u64, from, end);
    let mut reads = vec![0u16; m.lens().iter().sum::<u64>() as usize];
    for e in from..from.saturating_add(epochs) {
        let epoch = m.epoch(e);
        let order = epoch.order();
        if order.is_empty() {
            continue;
        }
        for k in 0..epoch.per_rank() {
            for r in ranks.clone() {
                let j = (epoch.base() + u64::from(r) + k * world) % order.len();
                let c = &mut reads[order.sample(j).id as usize];
                *c = c.saturating_add(1);
            }
        }
    }
    reads
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dataset::catalog::{build, BuildOptions};
    use crate::dataset::SourceSpec;

    /// 8 files of distinct bytes and their catalog.
    fn catalog(dir: &std::path::Path) -> (Catalog, Vec<Vec<u8>>) {
        let src = dir.join("src");
        std::fs::create_dir_all(&src).unwrap();
        let files: Vec<Vec<u8>> = (0..8u8).map(|i| vec![i; 100 + i as usize]).collect();
        for (i, f) in files.iter().enumerate() {
            std::fs::write(src.join(format!("f{i}.bin")), f).unwrap();
        }
        let spec = SourceSpec::parse(&format!("dir:{}", src.display())).unwrap();
        let cat = build(&spec, &dir.join("catalog"), &BuildOptions::default()).unwrap();
        // The catalog's ids follow the sorted file names.
        (cat, files)
    }

    /// Most read first, the preferred first among equals, then by id; the
    /// unread last, preferred first.
    #[test]
    fn reads_order_is_by_count_then_preference_then_id() {
        let reads = [0u16, 2, 1, 2, 0, 3, 1, 0];
        let prefer = |id: u64| id.is_multiple_of(2);
        let got: Vec<u64> = reads_order(&reads, &prefer).collect();
        assert_eq!(got, vec![5, 1, 3, 2, 6, 0, 4, 7]);
        let none: Vec<u64> = reads_order(&[0, 0, 0], &prefer).collect();
        assert_eq!(none, vec![0, 2, 1]);
    }

    /// The counts: every read of the ranks counted once, over the epochs
    /// from the start to the end (at most 16); none for the whole world.
    #[test]
    fn future_reads_count_the_ranks_reads() {
        use crate::sampler::{Sampler, SamplerConfig};
        let s = Sampler::new(SamplerConfig::single(100, 3).rank_world(0, 4)).unwrap();
        assert!(future_reads(&s, 0..4, 0, None).is_none(), "the whole world");
        let two = future_reads(&s, 1..3, 2, Some(5)).unwrap();
        let total: u64 = two.iter().map(|&c| c as u64).sum();
        assert_eq!(total, 3 * 2 * s.per_rank());
        // By the sampler's own ranks.
        let mut want = vec![0u16; 100];
        for r in 1..3 {
            let sr = Sampler::new(SamplerConfig::single(100, 3).rank_world(r, 4)).unwrap();
            for e in 2..5 {
                for k in 0..sr.per_rank() {
                    want[sr.sample(e, k) as usize] += 1;
                }
            }
        }
        assert_eq!(two, want);
        let open = future_reads(&s, 0..1, 7, None).unwrap();
        let total: u64 = open.iter().map(|&c| c as u64).sum();
        assert_eq!(
            total,
            READS_EPOCHS * s.per_rank(),
            "16 epochs without an end"
        );
    }

    /// A mixture's counts are each rank's own draws, per id of its datasets
    /// side by side (repeats included), for the whole world too, and for a
    /// job resumed inside an epoch (its order's entries after those
    /// consumed).
    #[test]
    fn future_reads_count_a_mixture_s_draws() {
        use crate::sampler::{MixSampler, Sampler, SamplerConfig};
        let (lens, counts) = ([50u64, 7], [40u64, 21]);
        let mix = |r: u32| {
            let m = MixSampler::new(SamplerConfig::single(0, 9).rank_world(r, 3), &lens, &counts);
            m.unwrap()
        };
        let resumed = |r: u32| mix(r).resume(&mix(0).job_position(1, 17)).unwrap();
        for (name, make) in [
            ("from the start", &mix as &dyn Fn(u32) -> MixSampler),
            ("resumed", &resumed),
        ] {
            let s = Sampler::mixed(make(0)).unwrap();
            for ranks in [0..3, 1..3] {
                let got = future_reads(&s, ranks.clone(), 1, Some(4)).unwrap();
                let mut want = vec![0u16; 57];
                for r in ranks.clone() {
                    let sr = Sampler::mixed(make(r)).unwrap();
                    for e in 1..4 {
                        let order = sr.epoch(e);
                        for k in 0..sr.mixture().unwrap().per_rank(e) {
                            want[order.sample(k) as usize] += 1;
                        }
                    }
                }
                assert_eq!(got, want, "{name}, ranks {ranks:?}");
                // The 7-sample dataset is drawn 3 times an epoch each (and
                // again where the padding repeats the order's start).
                if ranks.len() == 3 && name == "from the start" {
                    assert!(got[50..].iter().all(|&c| c >= 9), "{got:?}");
                }
            }
        }
    }

    /// In cluster mode the samples this node does not hold are members
    /// first: with room for three of the eight, the three are the first of
    /// those `first` picks, whatever comes before them in id order.
    #[test]
    fn members_the_node_does_not_hold_come_first() {
        let t = tempfile::tempdir().unwrap();
        let (cat, _) = catalog(t.path());
        // Slots of 128 bytes (100-107 rounded up to 64): 3 fit in 384.
        let remote = |id: u64| !id.is_multiple_of(3);
        let tier = Tier::preferring(&cat, 384, false, true, &remote)
            .unwrap()
            .unwrap();
        let members: Vec<u64> = (0..8).filter(|&id| tier.is_member(id)).collect();
        assert_eq!(members, vec![1, 2, 4]);
        // With room for all, the others follow.
        let all = Tier::preferring(&cat, 1 << 20, false, true, &remote)
            .unwrap()
            .unwrap();
        assert_eq!(all.members(), 8);
        // Plain id order picks 0, 1, 2.
        let plain = Tier::new_checked(&cat, 384, false).unwrap().unwrap();
        let members: Vec<u64> = (0..8).filter(|&id| plain.is_member(id)).collect();
        assert_eq!(members, vec![0, 1, 2]);
    }

    /// A checked tier (the agent's, filled from rings ranks can write)
    /// keeps a fill only when its copy matches the catalog's CRC32C; a
    /// spoiled one stays empty, is counted, and a later good fill is kept.
    #[test]
    fn a_checked_tier_refuses_a_fill_that_is_not_the_sample() {
        let t = tempfile::tempdir().unwrap();
        let (cat, files) = catalog(t.path());
        let tier = Tier::new_checked(&cat, 1 << 20, false).unwrap().unwrap();
        assert_eq!(tier.members(), 8);
        let mut spoiled = files[3].clone();
        spoiled[7] ^= 0x40;
        // SAFETY: the source buffers are live and as long as the sample.
        unsafe { tier.fill(3, spoiled.len(), spoiled.as_ptr()) };
        assert!(!tier.is_filled(3));
        assert_eq!(tier.fills_refused(), 1);
        // SAFETY: as above.
        unsafe { tier.fill(3, files[3].len(), files[3].as_ptr()) };
        assert_eq!(tier.view(3, files[3].len()), Some(files[3].as_slice()));
        assert_eq!(tier.fills_refused(), 1);
        // An unchecked tier keeps what it is given (its fills come from its
        // own process's ring).
        let plain = Tier::new(&cat, 1 << 20, false).unwrap().unwrap();
        // SAFETY: as above.
        unsafe { plain.fill(3, spoiled.len(), spoiled.as_ptr()) };
        assert!(plain.is_filled(3));
    }
}
