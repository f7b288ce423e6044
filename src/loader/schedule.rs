//! Where each sample of a rank's sequence lands in the ring. A pure function
//! of (sampler, catalog lengths, ring geometry, start position), computed
//! independently and identically by the consumer and by every poller, so no
//! per-sample metadata crosses threads.
//!
//! Samples get consecutive *virtual* offsets; the physical offset is the
//! virtual one modulo the ring size. A slot is the sample's length rounded up
//! to the alignment (at least one alignment unit, so the number of samples in
//! the ring is bounded by `ring_bytes / align`). A slot never straddles a
//! segment boundary (the ring's end, and every 1 GiB, the largest buffer
//! io_uring registers): it moves to the boundary instead, leaving padding.

use crate::dataset::Catalog;
use crate::sampler::{EpochOrder, Position, Sampler};

/// Largest registered-buffer segment (io_uring limits one buffer to 1 GiB).
pub const SEGMENT_BYTES: u64 = 1 << 30;

/// Ring geometry.
#[derive(Debug, Clone, Copy)]
pub struct Geometry {
    /// Ring size.
    pub ring_bytes: u64,
    /// Slot alignment (and O_DIRECT alignment).
    pub align: u64,
}

impl Geometry {
    /// Slot bytes of a sample of `len` bytes.
    pub fn slot(&self, len: u64) -> u64 {
        len.next_multiple_of(self.align).max(self.align)
    }

    /// Segment size: min(ring, 1 GiB).
    pub fn segment(&self) -> u64 {
        self.ring_bytes.min(SEGMENT_BYTES)
    }

    /// Ready-table entries: the most samples the ring can hold at once.
    pub fn table_len(&self) -> u64 {
        self.ring_bytes / self.align
    }
}

/// One scheduled sample.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Placed {
    /// Global sequence number since the loader (re)started.
    pub g: u64,
    /// Epoch and step within it.
    pub pos: Position,
    /// Sample id.
    pub id: u64,
    /// Length in bytes.
    pub len: u64,
    /// Virtual offset of its slot.
    pub v: u64,
    /// Virtual end of its slot.
    pub v_end: u64,
}

impl Placed {
    /// Physical offset in the ring.
    pub fn phys(&self, geo: &Geometry) -> u64 {
        self.v % geo.ring_bytes
    }
}

/// Walks the schedule forward. Cloning is cheap (no allocation): a clone
/// walks ahead without moving the original.
#[derive(Clone)]
pub struct Cursor {
    sampler: Sampler,
    geo: Geometry,
    order: EpochOrder,
    pos: Position,
    g: u64,
    v: u64,
}

impl Cursor {
    /// Starts at `start` (the next step to deliver).
    pub fn new(sampler: Sampler, geo: Geometry, start: Position) -> Self {
        let order = sampler.epoch(start.epoch);
        Cursor {
            sampler,
            geo,
            order,
            pos: start,
            g: 0,
            v: 0,
        }
    }

    /// The position of the next sample [`Cursor::next`] returns.
    pub fn position(&self) -> Position {
        if self.pos.index >= self.sampler.per_rank() {
            Position {
                epoch: self.pos.epoch + 1,
                index: 0,
            }
        } else {
            self.pos
        }
    }

    /// Whether the next sample starts a new epoch (the current one is used up).
    pub fn at_epoch_end(&self) -> bool {
        self.pos.index >= self.sampler.per_rank()
    }

    /// Schedules the next sample.
    pub fn next(&mut self, catalog: &Catalog) -> Placed {
        if self.pos.index >= self.sampler.per_rank() {
            self.pos = Position {
                epoch: self.pos.epoch + 1,
                index: 0,
            };
            self.order = self.sampler.epoch(self.pos.epoch);
        }
        let id = self.order.sample(self.pos.index);
        let len = catalog.sample(id).len as u64;
        let slot = self.geo.slot(len);
        let seg = self.geo.segment();
        let in_seg = (self.v % self.geo.ring_bytes) % seg;
        if in_seg + slot > seg || (self.v % self.geo.ring_bytes) + slot > self.geo.ring_bytes {
            // Move to the next segment boundary (which may be the ring's end).
            let phys = self.v % self.geo.ring_bytes;
            let next_boundary = ((phys / seg) + 1) * seg;
            self.v += next_boundary.min(self.geo.ring_bytes) - phys;
        }
        let placed = Placed {
            g: self.g,
            pos: self.pos,
            id,
            len,
            v: self.v,
            v_end: self.v + slot,
        };
        self.v += slot;
        self.g += 1;
        self.pos.index += 1;
        placed
    }
}
