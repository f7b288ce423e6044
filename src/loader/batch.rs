//! A held batch: [`Batch`] (the borrowing handle), its samples, spans and
//! device addresses.

use super::Loader;
use crate::sampler::Position;

/// One sample of a batch.
#[derive(Debug, Clone, Copy)]
pub struct BatchSample<'a> {
    /// Sample id (catalog index).
    pub id: u64,
    /// Label, if the source has one.
    pub label: Option<u32>,
    /// Which dataset of a mixture it came from (its index in the order
    /// the datasets were given; 0 without a mixture). Its id within that
    /// dataset is `id - Loader::dataset_offsets()[dataset]`.
    pub dataset: u32,
    /// The bytes: in the landing ring, or in the memory tier with
    /// [`LoaderBuilder::tier_views`](super::LoaderBuilder::tier_views).
    pub bytes: &'a [u8],
    /// Its place in the rank's sequence.
    pub position: Position,
    /// Whether `bytes` is a view into the memory tier rather than the
    /// landing ring (only with
    /// [`LoaderBuilder::tier_views`](super::LoaderBuilder::tier_views)).
    pub in_tier: bool,
}

/// One sample of a batch held in a GPU ring ([`Loader::held_device_sample`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceSample {
    /// Sample id (catalog index).
    pub id: u64,
    /// Label, if the source has one.
    pub label: Option<u32>,
    /// Which dataset of a mixture it came from (0 without one).
    pub dataset: u32,
    /// Device address of its first byte.
    pub addr: u64,
    /// Its offset in the ring (for `DeviceMemory` copies).
    pub offset: u64,
    /// Its length in bytes.
    pub len: usize,
    /// Its place in the rank's sequence.
    pub position: Position,
}

#[derive(Debug, Clone, Copy)]
pub(super) struct Entry {
    pub(super) id: u64,
    pub(super) label: Option<u32>,
    pub(super) dataset: u32,
    /// Its bytes are in the memory tier, not at `phys` in the ring
    /// (`tier_views`).
    pub(super) in_tier: bool,
    /// Attached with tier views: its offset in the node tier's mapping.
    pub(super) tier_off: u64,
    pub(super) phys: u64,
    pub(super) len: u64,
    pub(super) pos: Position,
}

/// A batch: consecutive samples of the rank's sequence, zero-copy in the
/// landing ring. Dropping it returns its ring space; only one batch is out
/// at a time (it borrows the loader), so batches are released in order.
pub struct Batch<'a> {
    pub(super) loader: &'a mut Loader,
}

impl Batch<'_> {
    /// Samples in the batch.
    pub fn len(&self) -> usize {
        self.loader.entries.len()
    }

    /// Whether the batch is empty (never: an epoch's end is `None`).
    pub fn is_empty(&self) -> bool {
        self.loader.entries.is_empty()
    }

    /// Sample `i`.
    pub fn get(&self, i: usize) -> BatchSample<'_> {
        self.loader.held_sample(i)
    }

    /// The samples in order.
    pub fn iter(&self) -> impl Iterator<Item = BatchSample<'_>> + '_ {
        (0..self.len()).map(|i| self.get(i))
    }

    /// The batch's bytes as one contiguous span of the ring, plus a second
    /// span when the batch wraps around the ring's end. Spans include the
    /// alignment padding between samples.
    ///
    /// # Panics
    /// When some of the batch's samples are views into the memory tier
    /// ([`LoaderBuilder::tier_views`](super::LoaderBuilder::tier_views);
    /// see [`Batch::in_ring`]).
    pub fn spans(&self) -> (&[u8], Option<&[u8]>) {
        self.loader.held_spans()
    }

    /// Whether every sample of the batch is in the landing ring, so that
    /// [`Batch::spans`] holds the whole batch. Always true unless
    /// [`LoaderBuilder::tier_views`](super::LoaderBuilder::tier_views) is on.
    pub fn in_ring(&self) -> bool {
        self.loader.held_in_ring()
    }

    /// The epoch this batch belongs to.
    pub fn epoch(&self) -> u64 {
        self.loader.entries[0].pos.epoch
    }
}

impl Drop for Batch<'_> {
    fn drop(&mut self) {
        self.loader.release_batch();
    }
}

impl Loader {
    /// The identity of the held batch (its sequence number: 1 for the
    /// loader's first batch, then 2, 3...), or `None` when none is held.
    pub fn held_seq(&self) -> Option<u64> {
        self.held.then_some(self.batch_seq)
    }

    /// Samples in the held batch (0 when none is held).
    pub fn held_len(&self) -> usize {
        if self.held {
            self.entries.len()
        } else {
            0
        }
    }

    /// Sample `i` of the held batch.
    ///
    /// # Panics
    /// When no batch is held or `i` is out of range.
    pub fn held_sample(&self, i: usize) -> BatchSample<'_> {
        assert!(self.held, "no batch is held");
        let e = self.entries[i];
        let shared = &self.run.as_ref().expect("running").shared;
        if e.in_tier {
            let bytes = match &self.attach_tier {
                // Attached: the node tier the agent shared, read-only (the
                // view word was checked against its size).
                Some(t) => t.slice(e.tier_off, e.len as usize),
                // A filled member is never written again and the tier
                // lives as long as the loader this batch borrows.
                None => shared
                    .tier
                    .as_ref()
                    .expect("CODE_TIER comes with a tier")
                    .view(e.id, e.len as usize)
                    .expect("a sample published as CODE_TIER is filled"),
            };
            return BatchSample {
                id: e.id,
                label: e.label,
                dataset: e.dataset,
                bytes,
                position: e.pos,
                in_tier: true,
            };
        }
        let ring = &shared.ring;
        debug_assert!(
            e.phys + e.len <= self.geo.ring_bytes,
            "a held slot lies inside the ring"
        );
        BatchSample {
            id: e.id,
            label: e.label,
            dataset: e.dataset,
            // SAFETY: the sample is ready (published by its poller) and its
            // slot lies behind the released mark's window, so no poller
            // writes it until the batch is released.
            bytes: unsafe { ring.slice(e.phys as usize, e.len as usize) },
            position: e.pos,
            in_tier: false,
        }
    }

    /// The GPU memory holding the ring, when it is there
    /// ([`LoaderBuilder::gpu_ring`](super::LoaderBuilder::gpu_ring)).
    pub fn landing_device(&self) -> Option<&crate::landing::cuda::DeviceMemory> {
        self.parts().1.device()
    }

    /// Sample `i` of the held batch in a GPU ring: its device address.
    ///
    /// # Panics
    /// When no batch is held, `i` is out of range, or the ring is host memory.
    pub fn held_device_sample(&self, i: usize) -> DeviceSample {
        assert!(self.held, "no batch is held");
        let ring = &self.run.as_ref().expect("running").shared.ring;
        let dev = ring.device().expect("the landing ring is host memory");
        let e = self.entries[i];
        DeviceSample {
            id: e.id,
            label: e.label,
            dataset: e.dataset,
            addr: dev.addr() + e.phys,
            offset: e.phys,
            len: e.len as usize,
            position: e.pos,
        }
    }

    /// The held batch in a GPU ring as (device address, bytes) spans: one,
    /// or two if it wraps, alignment padding included.
    ///
    /// # Panics
    /// When no batch is held or the ring is host memory.
    pub fn held_device_spans(&self) -> ((u64, usize), Option<(u64, usize)>) {
        let ring = &self.run.as_ref().expect("running").shared.ring;
        let base = ring
            .device()
            .expect("the landing ring is host memory")
            .addr();
        let ((off, len), wrap) = self.held_span_ranges();
        ((base + off, len), wrap.map(|(o, l)| (base + o, l)))
    }

    /// The held batch's span(s) as (ring offset, bytes): from its first
    /// sample's start to its last sample's end, split at the ring's end.
    ///
    /// # Panics
    /// When no batch is held.
    pub(super) fn held_span_ranges(&self) -> ((u64, usize), Option<(u64, usize)>) {
        assert!(self.held, "no batch is held");
        assert!(
            self.held_in_ring(),
            "the held batch has samples in the memory tier (tier_views): it has no span"
        );
        self.held_reserved_ranges()
    }

    /// The ring range(s) the held batch's schedule reserves, as
    /// [`Loader::held_span_ranges`], samples handed out in the tier
    /// included (their slots stay unwritten): what the agent publishes.
    pub(super) fn held_reserved_ranges(&self) -> ((u64, usize), Option<(u64, usize)>) {
        assert!(self.held, "no batch is held");
        let first = self.entries[0];
        let last = *self.entries.last().expect("non-empty");
        let end = last.phys + last.len;
        if end >= first.phys {
            ((first.phys, (end - first.phys) as usize), None)
        } else {
            let wrap = self.geo.ring_bytes;
            (
                (first.phys, (wrap - first.phys) as usize),
                Some((0, end as usize)),
            )
        }
    }

    /// Whether every sample of the held batch is in the landing ring (so
    /// [`Loader::held_spans`] holds it all): false only when
    /// [`LoaderBuilder::tier_views`](super::LoaderBuilder::tier_views)
    /// handed out some of them in place in the memory tier.
    pub fn held_in_ring(&self) -> bool {
        self.entries.iter().all(|e| !e.in_tier)
    }

    /// The held batch as one contiguous span of the ring (two if it wraps),
    /// alignment padding included.
    ///
    /// # Panics
    /// When no batch is held, or when some of its samples are in the memory
    /// tier ([`Loader::held_in_ring`] is false).
    pub fn held_spans(&self) -> (&[u8], Option<&[u8]>) {
        let ring = &self.run.as_ref().expect("running").shared.ring;
        let ((off, len), wrap) = self.held_span_ranges();
        // SAFETY: as in `held_sample`: every byte of these spans belongs to
        // ready samples of this batch or to padding between them, which no
        // poller writes; the ranges lie inside the ring.
        unsafe {
            (
                ring.slice(off as usize, len),
                wrap.map(|(o, l)| ring.slice(o as usize, l)),
            )
        }
    }
}
