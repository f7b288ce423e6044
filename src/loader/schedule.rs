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

#[cfg(test)]
use crate::dataset::Catalog;
use crate::sampler::{ElasticSampler, JobPosition, Position, RemainderOrder, Sampler};

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

/// A rank's sequence over the epochs: the sampler (resumed at a job
/// position or not) and how many of each epoch's steps are delivered.
#[derive(Debug, Clone)]
pub struct Deal {
    sampler: ElasticSampler,
    /// Steps of an epoch are delivered in multiples of this: the batch
    /// size with drop_last (whole batches, every rank alike), else 1.
    whole: u64,
}

impl Deal {
    /// `sampler`'s sequence, each epoch cut to a multiple of `whole` steps.
    pub fn new(sampler: ElasticSampler, whole: u64) -> Self {
        assert!(whole > 0, "steps in multiples of 0");
        Deal { sampler, whole }
    }

    /// Tests only (the simulators): an ordinary job (never resumed at
    /// another world) delivering `steps`
    /// of each epoch: the sampler's `per_rank`, or that rounded down to
    /// whole batches (then `per_rank < 2 * steps`, so cutting to multiples
    /// of `steps` gives `steps`).
    #[cfg(test)]
    pub fn plain(sampler: Sampler, steps: u64) -> Self {
        let whole = if steps == sampler.per_rank() {
            1
        } else {
            steps
        };
        assert!(steps > 0 && sampler.per_rank() / whole * whole == steps);
        let sampler = ElasticSampler::over(
            sampler,
            JobPosition {
                epoch: 0,
                consumed: 0,
            },
        )
        .expect("a valid sampler");
        Deal { sampler, whole }
    }

    /// The job of `inner` (this deal's sampler, or its mixture resumed
    /// under other weights) resumed at `start` (a job position: any world).
    pub fn over(&self, inner: Sampler, start: JobPosition) -> crate::Result<Deal> {
        Ok(Deal {
            sampler: ElasticSampler::over(inner, start)?,
            whole: self.whole,
        })
    }

    /// The sampler.
    pub fn sampler(&self) -> &ElasticSampler {
        &self.sampler
    }

    /// Steps of `epoch` this rank delivers (the same on every rank).
    pub fn steps(&self, epoch: u64) -> u64 {
        self.sampler.per_rank(epoch) / self.whole * self.whole
    }
}

/// Walks the schedule forward. Cloning is cheap (no allocation): a clone
/// walks ahead without moving the original.
#[derive(Clone)]
pub struct Cursor {
    deal: Deal,
    geo: Geometry,
    /// Steps delivered in `pos.epoch` ([`Deal::steps`]).
    steps: u64,
    order: RemainderOrder,
    pos: Position,
    g: u64,
    v: u64,
}

impl Cursor {
    /// Tests only: starts at `start` (the next step to deliver) of an
    /// ordinary job; an epoch is its first `steps` steps (see
    /// [`Deal::plain`]).
    #[cfg(test)]
    pub fn new(sampler: Sampler, geo: Geometry, start: Position, steps: u64) -> Self {
        Self::with_deal(Deal::plain(sampler, steps), geo, start)
    }

    /// Starts at `start` (the next step to deliver) of `deal`.
    pub fn with_deal(deal: Deal, geo: Geometry, start: Position) -> Self {
        let order = deal.sampler.epoch(start.epoch);
        let steps = deal.steps(start.epoch);
        debug_assert!(start.index <= steps);
        Cursor {
            deal,
            geo,
            steps,
            order,
            pos: start,
            g: 0,
            v: 0,
        }
    }

    /// The position of the next sample [`Cursor::next`] returns.
    pub fn position(&self) -> Position {
        if self.pos.index >= self.steps {
            Position {
                epoch: self.pos.epoch + 1,
                index: 0,
            }
        } else {
            self.pos
        }
    }

    /// The global sequence number of the next sample [`Cursor::next`] returns.
    pub fn next_g(&self) -> u64 {
        self.g
    }

    /// Schedules the next sample.
    #[cfg(test)]
    pub fn next(&mut self, catalog: &Catalog) -> Placed {
        self.next_with(|id| catalog.sample(id).len as u64)
    }

    /// Schedules the next sample, its length from `len_of(id)`.
    pub fn next_with(&mut self, len_of: impl FnOnce(u64) -> u64) -> Placed {
        // A loop: a resumed epoch may have no steps left (only the start
        // epoch; the ones after are whole).
        while self.pos.index >= self.steps {
            self.pos = Position {
                epoch: self.pos.epoch + 1,
                index: 0,
            };
            self.order = self.deal.sampler.epoch(self.pos.epoch);
            self.steps = self.deal.steps(self.pos.epoch);
        }
        let id = self.order.sample(self.pos.index);
        let len = len_of(id);
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

impl Geometry {
    /// The most ring bytes a run of samples can span from its first slot's
    /// start to its last slot's end, when their slots add up to at most
    /// `slots_bytes` and the largest is `max_slot`: the slots plus the
    /// padding [`Cursor::next`] leaves before a segment boundary or the
    /// ring's end, which is less than one slot (so at most `max_slot -
    /// align`) per boundary a ring-long span can cross.
    pub fn span_bound(&self, slots_bytes: u64, max_slot: u64) -> u64 {
        let boundaries = self.ring_bytes.div_ceil(self.segment());
        slots_bytes + boundaries * max_slot.saturating_sub(self.align)
    }
}

/// The smallest ring size (a multiple of `unit`, itself a multiple of
/// `align`) in which a run of samples whose slots add up to `slots_bytes`,
/// the largest `max_slot`, always fits ([`Geometry::span_bound`]).
pub fn ring_bytes_needed(align: u64, unit: u64, slots_bytes: u64, max_slot: u64) -> u64 {
    let mut ring = slots_bytes.max(max_slot).next_multiple_of(unit);
    loop {
        let geo = Geometry {
            ring_bytes: ring,
            align,
        };
        let need = geo.span_bound(slots_bytes, max_slot).next_multiple_of(unit);
        if need <= ring {
            return ring;
        }
        ring = need;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampler::SamplerConfig;
    use proptest::prelude::*;

    proptest! {
        /// Any `batch` consecutive samples of the schedule span no more than
        /// the bound computed from the catalog's `batch` largest slots, in
        /// any ring at least `ring_bytes_needed` of that.
        #[test]
        fn batch_spans_stay_within_the_bound(
            lens in proptest::collection::vec(0u32..70_000, 1..200),
            batch in 1usize..12,
            seed in 0u64..1000,
            extra in 0u64..8,
        ) {
            let align = 4096;
            let mut slots: Vec<u64> = lens.iter().map(|&l| (l as u64).next_multiple_of(align).max(align)).collect();
            slots.sort_unstable_by(|a, b| b.cmp(a));
            let top: u64 = slots.iter().take(batch).sum();
            let max_slot = slots[0];
            let ring = ring_bytes_needed(align, 4096, top, max_slot) + extra * 4096;
            let geo = Geometry { ring_bytes: ring, align };
            prop_assert!(geo.span_bound(top, max_slot) <= ring);
            let sampler = Sampler::new(SamplerConfig::single(lens.len() as u64, seed)).unwrap();
            let steps = sampler.per_rank();
            let mut c = Cursor::new(sampler, geo, Position { epoch: 0, index: 0 }, steps);
            let placed: Vec<Placed> = (0..3 * steps).map(|_| c.next_with(|id| lens[id as usize] as u64)).collect();
            // Batches never cross an epoch: any `batch` consecutive samples
            // of one epoch.
            for epoch in placed.chunks(steps as usize) {
                for w in epoch.windows(batch.min(epoch.len())) {
                    let span = w.last().unwrap().v_end - w[0].v;
                    prop_assert!(span <= ring, "span {} > ring {}", span, ring);
                }
            }
            for p in &placed {
                // A slot never straddles the ring's end, nor a segment.
                prop_assert!(p.phys(&geo) + (p.v_end - p.v) <= ring);
                let seg = geo.segment();
                prop_assert!(p.phys(&geo) % seg + (p.v_end - p.v) <= seg);
                prop_assert_eq!(p.v_end - p.v, geo.slot(p.len));
            }
            for w in placed.windows(2) {
                // Virtual offsets and sequence numbers only go forward.
                prop_assert!(w[1].v >= w[0].v_end);
                prop_assert_eq!(w[1].g, w[0].g + 1);
            }
        }
    }
}
