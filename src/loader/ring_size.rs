//! The landing ring's size: the default sized from the batch and the
//! dataset (`ring_bytes` left at 0, "auto"), and the build-time check that
//! a ring holds a whole batch ([`Error::RingTooSmallForBatch`]).
//!
//! Why a default from the batch and not one fixed size: the ring is locked
//! memory the first lap touches page by page, and a ring far larger than
//! the read-ahead needs costs that first lap (and the memory) for nothing.
//! On a warm machine, where one epoch of 20,000 ImageNet-sized samples
//! takes half a second, faulting in a 256 MiB ring made the whole epoch
//! 0.59x a plain DataLoader's where a 64 MiB one made it 1.61x
//! (BENCHMARKS.md, "The 20,000-file run"), with cold epochs equal. A fixed
//! size also refused batches of large samples that did not fit it; the
//! default now holds one of up to 4 GiB.
//!
//! Why the floor is small (4 MiB, it was 64 MiB): every read lands at
//! another place of the ring, and where the device's emulation pays per
//! page it writes to (this VM's virtio disk: a Firecracker guest under
//! nested virtualization), the ring's footprint sets the read latency.
//! 4.5 KiB samples read from a cold disk at 0.64x fio's 4 KiB IOPS into
//! a 64 MiB ring and faster the smaller the ring, down to about 2 MiB
//! (BENCHMARKS.md, "tiny: the ring's footprint"); fio reads into 32
//! buffers it reuses. On a host with its own NVMe the smaller ring costs
//! nothing either: the read-ahead is counted in batches (six), which is
//! what a training step's jitter needs, not in bytes.

use super::schedule::{self, Geometry};
use super::Input;
use crate::dataset::Catalog;
use crate::error::{Error, Result};
use crate::sampler::Sampler;

/// The default ring's floor on one node: six batches of 4 KiB samples
/// are 1.5 MiB, and more than a few MiB only spreads the reads (see the
/// module's comment); 4 MiB keeps sixteen batches of them and a queue of
/// reads in flight.
pub(super) const AUTO_RING_MIN_BYTES: u64 = 4 << 20;
/// The floor for a mixture of datasets: its mean sample is taken over the
/// ids, not weighted by how often each dataset is drawn, so a mixture of
/// many small samples drawn rarely and few large ones drawn often would get
/// a ring of a few batches of the small ones; the former floor keeps room.
pub(super) const AUTO_RING_MIX_MIN_BYTES: u64 = 64 << 20;
/// The default ring's size before the batch's own needs: six batches of
/// the dataset's mean sample are read ahead at most this far.
pub(super) const AUTO_RING_MAX_BYTES: u64 = 256 << 20;
/// The default ring in cluster mode: the ring is the window the nodes write
/// into, sized as it was measured with (no smaller default is measured
/// across nodes yet).
pub(super) const AUTO_RING_CLUSTER_BYTES: u64 = 256 << 20;
/// A default ring this large or larger is whole 2 MiB pages.
const HUGE_ROUND_FROM_BYTES: u64 = 8 << 20;
const HUGE_PAGE_BYTES: u64 = 2 << 20;
/// Batches of the mean sample the default ring holds: the batch being
/// filled, two a caller keeps out (Python's `batches_in_flight` default)
/// and three read ahead.
const AUTO_RING_BATCHES: u64 = 6;
/// The most the default ring grows to for a batch of the largest samples;
/// a batch that needs more is refused (`RingTooSmallForBatch`, naming the
/// size) rather than locking that much memory unasked.
pub(super) const AUTO_RING_LIMIT_BYTES: u64 = 4 << 30;
/// Samples read for the mean sample size (spread evenly over the ids).
const MEAN_PROBES: u64 = 65_536;

/// The ring size `ring_bytes = 0` ("auto") stands for:
/// - six batches of the dataset's mean sample, from
///   [`AUTO_RING_MIN_BYTES`] (cluster mode: [`AUTO_RING_CLUSTER_BYTES`]) to
///   [`AUTO_RING_MAX_BYTES`], and no more than twice the whole dataset;
/// - and never less than the batch of the largest samples needs plus two
///   batches of the mean sample read ahead, so the default never refuses a
///   batch (a ring set by hand still may: it is what the caller asked for)
///   unless that is more than [`AUTO_RING_LIMIT_BYTES`]: then the limit, which
///   the build refuses with the size needed.
///
/// A multiple of the space's alignment and of 4096 bytes; from 8 MiB up,
/// of 2 MiB too (hugetlb pages).
pub(super) fn auto_ring_bytes(
    input: &Input,
    sampler: &Sampler,
    align: u64,
    batch: usize,
    cluster: bool,
) -> u64 {
    let geo = Geometry {
        ring_bytes: align.max(4096),
        align,
    };
    let stride = input.len().div_ceil(MEAN_PROBES).max(1);
    let (mut sum, mut n) = (0u64, 0u64);
    for id in (0..input.len()).step_by(stride as usize) {
        sum += geo.slot(input.sample(id).len as u64);
        n += 1;
    }
    let sizes = Sizes {
        align,
        len: input.len(),
        mean_slot: sum.checked_div(n).unwrap_or(align).max(align),
        max_slot: geo.slot(input.max_sample_bytes() as u64),
        batch: batch as u64,
        cluster,
        mix: matches!(input, Input::Mix(_)),
    };
    sizes.ring_bytes(|| batch_slots(input, sampler, geo, batch))
}

/// What the default ring is sized from.
#[derive(Debug, Clone, Copy)]
struct Sizes {
    align: u64,
    /// Samples in the dataset.
    len: u64,
    mean_slot: u64,
    max_slot: u64,
    batch: u64,
    cluster: bool,
    /// A mixture of datasets ([`AUTO_RING_MIX_MIN_BYTES`]).
    mix: bool,
}

impl Sizes {
    /// `batch_slots`: the slot bytes a batch can take at most, asked only
    /// when a batch of the largest sample does not fit the size wanted.
    fn ring_bytes(&self, batch_slots: impl FnOnce() -> u64) -> u64 {
        let unit = self.align.max(4096);
        let batch_mean = self.batch.saturating_mul(self.mean_slot);
        let floor = if self.cluster {
            AUTO_RING_CLUSTER_BYTES
        } else if self.mix {
            AUTO_RING_MIX_MIN_BYTES
        } else {
            AUTO_RING_MIN_BYTES
        };
        let want = AUTO_RING_BATCHES
            .saturating_mul(batch_mean)
            .clamp(floor, AUTO_RING_MAX_BYTES.max(floor))
            .min(
                self.len
                    .max(1)
                    .saturating_mul(self.mean_slot)
                    .saturating_mul(2),
            )
            .next_multiple_of(unit);
        let ahead = batch_mean.saturating_mul(2);
        let needed = |slots: u64| {
            schedule::ring_bytes_needed(
                self.align,
                unit,
                slots.saturating_add(ahead),
                self.max_slot,
            )
        };
        // O(1) first: a batch of the largest sample fits.
        let ring = if needed(self.batch.saturating_mul(self.max_slot)) <= want {
            want
        } else {
            want.max(needed(batch_slots()))
        };
        // Whole 2 MiB pages (hugetlb takes only those), but a ring for a
        // few small samples stays small.
        let ring = if ring >= HUGE_ROUND_FROM_BYTES {
            ring.next_multiple_of(HUGE_PAGE_BYTES)
                .next_multiple_of(unit)
        } else {
            ring
        };
        ring.min(AUTO_RING_LIMIT_BYTES.max(unit))
    }
}

/// The slot bytes a batch can take at most: `batch` times the largest
/// sample, or, where a batch holds distinct samples, the catalog's `batch`
/// largest (one pass).
fn batch_slots(input: &Input, sampler: &Sampler, geo: Geometry, batch: usize) -> u64 {
    let max_slot = geo.slot(input.max_sample_bytes() as u64);
    let quick = (batch as u64).saturating_mul(max_slot);
    // Within one epoch a rank's sequence repeats no sample unless the
    // padding to equal ranks is a whole dataset or more (j and j + len fall
    // on one rank only when len is a multiple of world, i.e. no padding),
    // so a batch holds distinct samples and the largest ones bound it.
    let cfg = sampler.config();
    // A mixture may take a dataset more than once per epoch.
    let distinct = sampler.mixture().is_none()
        && (cfg.drop_last || sampler.per_rank() * (cfg.world as u64) < 2 * cfg.len);
    if distinct {
        largest_slots(input.catalog(), geo, batch)
    } else {
        quick
    }
}

/// Refuses a ring that some batch might not fit in whole
/// ([`Error::RingTooSmallForBatch`]): a batch is held whole while it is out,
/// so a batch larger than the ring could only be delivered cut short, and
/// where it is cut would depend on each rank's own sample sizes.
///
/// O(1) in the common case (from the catalog's largest sample); only when
/// `batch` times that does not fit does it find the catalog's `batch`
/// largest samples (one pass) before refusing.
pub(super) fn check_batch_fits(
    input: &Input,
    sampler: &Sampler,
    geo: Geometry,
    batch: usize,
) -> Result<()> {
    let max_slot = geo.slot(input.max_sample_bytes() as u64);
    let quick = (batch as u64).saturating_mul(max_slot);
    if geo.span_bound(quick, max_slot) <= geo.ring_bytes {
        return Ok(());
    }
    let slots = batch_slots(input, sampler, geo, batch);
    if geo.span_bound(slots, max_slot) <= geo.ring_bytes {
        return Ok(());
    }
    let needed = schedule::ring_bytes_needed(geo.align, geo.align.max(4096), slots, max_slot);
    Err(Error::RingTooSmallForBatch {
        batch_size: batch,
        batch_bytes: geo.span_bound(slots, max_slot),
        align_bytes: geo.align,
        ring_bytes: geo.ring_bytes,
        needed_bytes: needed,
        needed_human: crate::progress::human_bytes(needed as f64),
    })
}

/// The sum of the `n` largest slots of the catalog (of all, if fewer).
fn largest_slots(catalog: &Catalog, geo: Geometry, n: usize) -> u64 {
    use std::cmp::Reverse;
    use std::collections::BinaryHeap;
    let n = n.min(catalog.len() as usize);
    let mut heap: BinaryHeap<Reverse<u64>> = BinaryHeap::with_capacity(n + 1);
    for id in 0..catalog.len() {
        let slot = geo.slot(catalog.sample(id).len as u64);
        if heap.len() < n {
            heap.push(Reverse(slot));
        } else if heap.peek().is_some_and(|Reverse(min)| slot > *min) {
            heap.pop();
            heap.push(Reverse(slot));
        }
    }
    heap.into_iter().map(|Reverse(s)| s).sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn sizes(len: u64, mean_slot: u64, max_slot: u64, batch: u64) -> Sizes {
        Sizes {
            align: 4096,
            len,
            mean_slot,
            max_slot,
            batch,
            cluster: false,
            mix: false,
        }
    }

    fn never() -> u64 {
        panic!("the batch's largest samples are not needed here")
    }

    #[test]
    fn six_batches_of_the_mean_from_4_to_256_mib() {
        // 64 ImageNet-sized samples: six batches, 42 MiB.
        let s = sizes(1_281_167, 112 << 10, 400 << 10, 64);
        assert_eq!(s.ring_bytes(never), 42 * MIB);
        // 64 samples of 4 KiB: six batches are 1.5 MiB, so the floor.
        let s = sizes(200_000, 4 << 10, 8 << 10, 64);
        assert_eq!(s.ring_bytes(never), 4 * MIB);
        // 256 of them: six batches, 168 MiB.
        let s = sizes(1_281_167, 112 << 10, 200 << 10, 256);
        assert_eq!(s.ring_bytes(never), 168 * MIB);
        // Unless the batch's largest 256 (plus two batches of the mean)
        // need more.
        let s = sizes(1_281_167, 112 << 10, 400 << 10, 256);
        let r = s.ring_bytes(|| 256 * (300 << 10));
        assert!(r >= 256 * (300 << 10) + 2 * 256 * (112 << 10), "{r}");
        // 1024 of them: capped at 256 MiB (a batch of the largest is 400 MiB
        // with two more read ahead: that wins).
        let s = sizes(1_281_167, 112 << 10, 400 << 10, 1024);
        let r = s.ring_bytes(|| 1024 * (400 << 10));
        assert!(r >= 1024 * (400 << 10) + 2 * 1024 * (112 << 10), "{r}");
        // 512 of 112 KiB: six batches are 336 MiB, capped at 256 MiB,
        // which holds the batch (56 MiB) and two read ahead.
        let s = sizes(1_281_167, 112 << 10, 112 << 10, 512);
        assert_eq!(s.ring_bytes(never), 256 * MIB);
        // A batch of 256 samples of up to 200 MiB (a mixture's, not known
        // to be distinct): not 50 GiB of locked memory, the limit (which
        // the build's check then refuses, naming the size needed).
        let s = sizes(1_281_167, 112 << 10, 200 * MIB, 256);
        assert_eq!(s.ring_bytes(|| 256 * 200 * MIB), AUTO_RING_LIMIT_BYTES);
        // A mixture keeps the 64 MiB floor.
        let s = Sizes {
            mix: true,
            ..sizes(200_000, 4 << 10, 8 << 10, 64)
        };
        assert_eq!(s.ring_bytes(never), 64 * MIB);
        // Cluster mode keeps 256 MiB.
        let s = Sizes {
            cluster: true,
            ..sizes(1_281_167, 112 << 10, 400 << 10, 64)
        };
        assert_eq!(s.ring_bytes(never), 256 * MIB);
    }

    #[test]
    fn never_more_than_twice_a_small_dataset_and_always_a_whole_batch() {
        // 100 samples of 8 KiB: 1.6 MiB, twice the dataset.
        let s = sizes(100, 8 << 10, 8 << 10, 4);
        assert_eq!(s.ring_bytes(never), 1600 << 10);
        // From 8 MiB up, whole 2 MiB pages: six batches of 16 x 100 KiB
        // are 9.4 MiB (twice the dataset, 11.7 MiB).
        let s = sizes(60, 100 << 10, 100 << 10, 16);
        assert_eq!(s.ring_bytes(never), 10 * MIB);
        // Under 8 MiB, whole 4 KiB pages: batches of 4 of them take the
        // 4 MiB floor.
        let s = sizes(60, 100 << 10, 100 << 10, 4);
        assert_eq!(s.ring_bytes(never), 4 * MIB);
        // Six 4 MiB samples in batches of six: twice the dataset (48 MiB)
        // is less than the batch (24 MiB) and two read ahead (48 MiB).
        let s = sizes(6, 4 * MIB, 4 * MIB, 6);
        let r = s.ring_bytes(|| 6 * 4 * MIB);
        assert!(r >= 72 * MIB, "{r}");
        let geo = Geometry {
            ring_bytes: r,
            align: 4096,
        };
        assert!(geo.span_bound(24 * MIB, 4 * MIB) <= r);
        // The batch's own largest samples are asked for only when the
        // largest sample's batch does not fit: here it is 10 x 8 MiB.
        let s = sizes(1_000_000, 100 << 10, 8 * MIB, 10);
        let mut asked = false;
        let r = s.ring_bytes(|| {
            asked = true;
            10 * (200 << 10)
        });
        assert!(asked);
        // Sized for those: 2 MiB of them, two batches of the mean read
        // ahead and the padding an 8 MiB slot may leave at the ring's end
        // (12 MiB, more than six batches of the mean, 5.9 MiB), not for
        // ten of the largest (80 MiB).
        assert_eq!(r, 12 * MIB);
        let geo = Geometry {
            ring_bytes: r,
            align: 4096,
        };
        assert!(geo.span_bound(10 * (200 << 10), 8 * MIB) <= r);
    }
}
