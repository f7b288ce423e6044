//! The cache area's slot sizes: size classes, as a slab allocator has.
//! One slot size for every sample wastes most of the area on a dataset
//! whose sizes have a long tail (a JPEG set's 99th percentile is three
//! times its mean), so slots come in classes from 4 KiB up, each about a
//! quarter larger than the one below (rounded to 4 KiB), up to the
//! catalog's 99th percentile sample length; a sample takes a slot of the
//! smallest class that holds it, so a slot wastes under a fifth of itself,
//! and the 1 % larger samples are not kept.
//!
//! The budget is shared among the classes in proportion to the slot bytes
//! their samples would take (every sample kept with the same chance, as a
//! fixed subset by bytes would), and a class gets no more slots than it has
//! samples. The classes are a pure function of the catalog and the budget,
//! recorded in `cache.meta` (`classes 4096x12,8192x40,...`: slot bytes x
//! slot count, in order; slots are numbered across the classes in that
//! order, and laid out in `cache.data` one class after another).

use crate::dataset::Catalog;

/// Slot sizes are multiples of this (O_DIRECT's alignment on any device).
pub const SLOT_ALIGN: u64 = 4096;

/// Slots the area can number (the planner keeps two bits of a word for
/// the decision's kind).
pub const MAX_SLOTS: u64 = 1 << 30;

/// One size class.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotClass {
    /// Bytes per slot (a multiple of [`SLOT_ALIGN`]).
    pub slot_bytes: u64,
    /// Slots of this class.
    pub slots: u32,
    /// The number of its first slot.
    pub first: u32,
    /// Where its first slot starts in `cache.data`.
    pub base: u64,
}

/// The area's classes (module doc).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotClasses {
    classes: Vec<SlotClass>,
}

impl SlotClasses {
    /// The classes for `cat` within `budget_bytes` (module doc).
    pub fn for_catalog(cat: &Catalog, budget_bytes: u64) -> SlotClasses {
        let lens: Vec<u64> = (0..cat.len()).map(|id| cat.sample(id).len as u64).collect();
        Self::for_lengths(&lens, budget_bytes)
    }

    /// As [`SlotClasses::for_catalog`], from the samples' lengths.
    pub fn for_lengths(lens: &[u64], budget_bytes: u64) -> SlotClasses {
        if lens.is_empty() {
            return Self::from_counts(&[(SLOT_ALIGN, 0)]);
        }
        let (sizes, count) = Self::demand(lens);
        let demand: Vec<u64> = sizes.iter().zip(&count).map(|(s, n)| s * n).collect();
        let total: u128 = demand.iter().map(|&d| d as u128).sum();
        let counts: Vec<(u64, u64)> = sizes
            .iter()
            .zip(&demand)
            .zip(&count)
            .map(|((&size, &d), &n)| {
                let share = (budget_bytes as u128 * d as u128)
                    .checked_div(total)
                    .unwrap_or(0) as u64;
                (size, (share / size).min(n))
            })
            .collect();
        Self::from_counts(&counts)
    }

    /// The smallest budget for which [`SlotClasses::for_lengths`] makes a
    /// slot: a class's share of the budget is in proportion to its
    /// samples' slot bytes, so its first slot comes at the total of those
    /// bytes over its count of samples (0 for no samples).
    pub fn smallest_budget_bytes(lens: &[u64]) -> u64 {
        if lens.is_empty() {
            return 0;
        }
        let (sizes, count) = Self::demand(lens);
        let total: u128 = sizes
            .iter()
            .zip(&count)
            .map(|(&s, &n)| s as u128 * n as u128)
            .sum();
        match count.iter().max() {
            Some(&most) if most > 0 => total.div_ceil(most as u128) as u64,
            _ => 0,
        }
    }

    /// The slot sizes for `lens` (4 KiB up to the 99th percentile, each
    /// about 5/4 of the one before) and how many of `lens` each class
    /// takes (larger ones none). `lens` is not empty.
    fn demand(lens: &[u64]) -> (Vec<u64>, Vec<u64>) {
        let mut sorted = lens.to_vec();
        let k = ((sorted.len() as u64 * 99).div_ceil(100) as usize).clamp(1, sorted.len()) - 1;
        let (_, p99, _) = sorted.select_nth_unstable(k);
        let top = (*p99).max(1).next_multiple_of(SLOT_ALIGN);
        let mut sizes = vec![SLOT_ALIGN];
        while *sizes.last().expect("one") < top {
            let s = *sizes.last().expect("one");
            let next = (s + SLOT_ALIGN).max((s * 5 / 4).next_multiple_of(SLOT_ALIGN));
            sizes.push(next.min(top));
        }
        // Per class: its samples.
        let mut count = vec![0u64; sizes.len()];
        for &len in lens {
            if let Some(c) = class_index(&sizes, len) {
                count[c] += 1;
            }
        }
        (sizes, count)
    }

    /// One class of `slots` slots of `slot_bytes` (tests, models).
    pub fn uniform(slot_bytes: u64, slots: u32) -> SlotClasses {
        Self::from_counts(&[(slot_bytes, slots as u64)])
    }

    fn from_counts(counts: &[(u64, u64)]) -> SlotClasses {
        let (mut first, mut base) = (0u64, 0u64);
        let classes = counts
            .iter()
            .map(|&(slot_bytes, slots)| {
                let c = SlotClass {
                    slot_bytes,
                    slots: slots.min(u32::MAX as u64) as u32,
                    first: first.min(u32::MAX as u64) as u32,
                    base,
                };
                first += slots;
                base += slots * slot_bytes;
                c
            })
            .collect();
        SlotClasses { classes }
    }

    /// The `classes` line's value in `cache.meta` (module doc).
    pub fn to_meta(&self) -> String {
        self.classes
            .iter()
            .map(|c| format!("{}x{}", c.slot_bytes, c.slots))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// Parses [`SlotClasses::to_meta`]'s form.
    pub fn parse(s: &str) -> Option<SlotClasses> {
        let counts: Option<Vec<(u64, u64)>> = s
            .split(',')
            .map(|c| {
                let (b, n) = c.split_once('x')?;
                let (b, n) = (b.parse::<u64>().ok()?, n.parse::<u64>().ok()?);
                (b > 0 && b % SLOT_ALIGN == 0).then_some((b, n))
            })
            .collect();
        let counts = counts?;
        (!counts.is_empty()).then(|| Self::from_counts(&counts))
    }

    /// The classes, smallest first.
    pub fn classes(&self) -> &[SlotClass] {
        &self.classes
    }

    /// Slots in all.
    pub fn slots(&self) -> u64 {
        self.classes.iter().map(|c| c.slots as u64).sum()
    }

    /// Bytes of `cache.data`.
    pub fn area_bytes(&self) -> u64 {
        self.classes
            .iter()
            .map(|c| c.slots as u64 * c.slot_bytes)
            .sum()
    }

    /// The largest slot.
    pub fn largest(&self) -> u64 {
        self.classes.iter().map(|c| c.slot_bytes).max().unwrap_or(0)
    }

    /// The class a sample of `len` bytes takes a slot of, if any (one
    /// larger than every class is not kept).
    pub fn class_for(&self, len: u64) -> Option<usize> {
        let i = self.classes.partition_point(|c| c.slot_bytes < len.max(1));
        (i < self.classes.len()).then_some(i)
    }

    /// The class slot `slot` is of.
    pub fn class_of_slot(&self, slot: u32) -> usize {
        self.classes
            .partition_point(|c| c.first as u64 + c.slots as u64 <= slot as u64)
    }

    /// Where slot `slot` starts in `cache.data`, and its bytes.
    pub fn slot(&self, slot: u32) -> (u64, u64) {
        let c = &self.classes[self.class_of_slot(slot)];
        (
            c.base + (slot - c.first) as u64 * c.slot_bytes,
            c.slot_bytes,
        )
    }
}

fn class_index(sizes: &[u64], len: u64) -> Option<usize> {
    let i = sizes.partition_point(|&s| s < len.max(1));
    (i < sizes.len()).then_some(i)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_cover_the_lengths_within_the_budget() {
        // A long tail: most samples 100-150 KB, a few up to 2 MB.
        let lens: Vec<u64> = (0..1000u64)
            .map(|i| {
                if i % 100 == 0 {
                    2_000_000
                } else {
                    100_000 + (i * 7919) % 50_000
                }
            })
            .collect();
        let budget = 40_000_000;
        let cl = SlotClasses::for_lengths(&lens, budget);
        assert!(cl.area_bytes() <= budget);
        // Far more slots than one slot size of the largest kept sample
        // would give (those at the 99th percentile are 150 KB, the 2 MB
        // ones are past it and not kept).
        assert!(cl.slots() > budget / 160_000, "{cl:?}");
        assert_eq!(cl.class_for(2_000_000), None);
        for &len in lens.iter().filter(|&&l| l < 2_000_000) {
            let c = cl.classes()[cl.class_for(len).unwrap()];
            assert!(c.slot_bytes >= len && c.slot_bytes < len * 5 / 4 + 2 * SLOT_ALIGN);
        }
        // Slots are numbered across classes and laid out one class after
        // another, without overlap.
        let mut end = 0;
        for s in 0..cl.slots() as u32 {
            let (at, bytes) = cl.slot(s);
            assert_eq!(at, end, "slot {s}");
            end = at + bytes;
        }
        assert_eq!(end, cl.area_bytes());
        assert_eq!(SlotClasses::parse(&cl.to_meta()), Some(cl));
        assert_eq!(SlotClasses::parse("4097x3"), None);
        assert_eq!(SlotClasses::parse(""), None);
    }

    #[test]
    fn a_budget_over_the_dataset_keeps_every_sample_once() {
        let lens = [5000u64, 9000, 9000, 20_000];
        let cl = SlotClasses::for_lengths(&lens, 1 << 30);
        for &len in &lens {
            assert!(cl.class_for(len).is_some());
        }
        assert_eq!(cl.slots(), 4, "{cl:?}");
    }

    #[test]
    fn the_smallest_budget_is_where_the_first_slot_comes() {
        for lens in [
            vec![5000u64, 9000, 9000, 20_000],
            vec![30_000; 7],
            (1..=300u64).map(|i| i * 977 % 150_000 + 1).collect(),
            vec![1],
        ] {
            let b = SlotClasses::smallest_budget_bytes(&lens);
            assert!(b > 0);
            assert_eq!(
                SlotClasses::for_lengths(&lens, b - 1).slots(),
                0,
                "{lens:?}"
            );
            assert!(SlotClasses::for_lengths(&lens, b).slots() > 0, "{lens:?}");
        }
        assert_eq!(SlotClasses::smallest_budget_bytes(&[]), 0);
    }
}
