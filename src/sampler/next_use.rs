//! When each sample is read next. The order of every epoch is a pure
//! function of the sampler ("Sampler" in docs/FORMAT.md) and the keyed
//! permutation inverts in O(1) ([`Permutation::invert`]), so the next read
//! of any sample after any moment is computed, not looked up in a list:
//! what a cache needs to evict by next use (Belady's MIN, `crate::cache`)
//! with memory bounded by what it holds, not by the dataset.
//!
//! Time is the global step: epoch `e`'s global position `j` (all ranks
//! interleaved, `DistributedSampler`'s order, padding included) is time
//! `e·P + j`, `P` the global steps of an epoch (`per_rank · W`). Ranks in
//! lock-step read in that order; rank `r` reads only its positions
//! (`j ≡ r mod W`), and a node's ranks `r0..r1` those with `j mod W` in
//! that range.

use super::{Permutation, Sampler};
use crate::error::{Error, Result};

/// "Not read again" (before the end epoch, or within the search horizon).
pub const NEVER: u64 = u64::MAX;

/// Epochs searched past the current one for a sample's next read: R of W
/// ranks read a given sample in an epoch with probability about R/W, so a
/// horizon of several W/R epochs finds almost every next read; beyond it a
/// sample counts as never read again (evicted first, which is right for a
/// read that far away).
const HORIZON_PER_SHARE: u64 = 4;
const MIN_HORIZON_EPOCHS: u64 = 8;

/// The next read of any sample after any time, by some ranks (one rank's
/// cache, a node's ranks' shared cache) or by every rank.
#[derive(Debug, Clone)]
pub struct NextUse {
    len: u64,
    seed: u64,
    shuffle: bool,
    block: u64,
    world: u64,
    /// Global steps per epoch (`P`).
    steps: u64,
    /// Only these ranks' reads count; None: every rank's.
    ranks: Option<std::ops::Range<u64>>,
    /// Reads stop before this epoch.
    end_epoch: Option<u64>,
    horizon: u64,
}

impl NextUse {
    /// The reads of `ranks` (None: of every rank) under `sampler`'s order,
    /// stopping before `end_epoch` (None: never). A mixture is refused:
    /// its order is not one permutation (named).
    pub fn new(
        sampler: &Sampler,
        ranks: Option<std::ops::Range<u32>>,
        end_epoch: Option<u64>,
    ) -> Result<Self> {
        if sampler.mixture().is_some() {
            return Err(Error::InvalidConfig(
                "eviction by next use reads one dataset's order, not a mixture's".into(),
            ));
        }
        let cfg = sampler.config();
        let world = cfg.world as u64;
        if let Some(r) = ranks.as_ref().filter(|r| r.is_empty() || r.end > cfg.world) {
            return Err(Error::InvalidConfig(format!(
                "ranks {r:?} are not some of world size {world}'s"
            )));
        }
        let share = ranks.as_ref().map_or(1, |r| world.div_ceil(r.len() as u64));
        Ok(NextUse {
            len: cfg.len,
            seed: cfg.seed,
            shuffle: cfg.shuffle,
            block: cfg.order_block(),
            world,
            steps: sampler.per_rank() * world,
            ranks: ranks.map(|r| r.start as u64..r.end as u64),
            end_epoch,
            horizon: (HORIZON_PER_SHARE * share).max(MIN_HORIZON_EPOCHS),
        })
    }

    /// Global steps per epoch (`P`): epoch `e` spans times `e·P..(e+1)·P`.
    pub fn steps_per_epoch(&self) -> u64 {
        self.steps
    }

    /// Reads per epoch by the ranks counted (all of `P` for every rank).
    pub fn reads_per_epoch(&self) -> u64 {
        match &self.ranks {
            Some(r) => self.steps / self.world * (r.end - r.start),
            None => self.steps,
        }
    }

    /// The gap past which replacing a kept sample by one read sooner is
    /// taken to gain a hit ([`Belady::read_weighing_writes`]): an epoch
    /// times the share of the dataset the counted ranks read in one (one
    /// epoch for a rank that reads every sample each epoch, `1/W` of one
    /// for a rank of `W`). Chosen by simulation (docs/CACHE.md, "Writes";
    /// `examples/cache_model.rs`): a whole epoch for a rank of 2 or more
    /// lost up to 2 % of MIN's hits, this gap at most 1.6 %.
    ///
    /// [`Belady::read_weighing_writes`]: crate::cache::Belady::read_weighing_writes
    pub fn swap_horizon(&self) -> u64 {
        let p = self.steps as u128;
        (p * self.reads_per_epoch() as u128 / self.len.max(1) as u128).min(p) as u64
    }

    /// The time of global position `j` of `epoch`.
    pub fn time(&self, epoch: u64, j: u64) -> u64 {
        epoch * self.steps + j
    }

    /// The first time after `t` at which sample `id` is read (by the rank,
    /// or by any rank), or [`NEVER`].
    pub fn after(&self, id: u64, t: u64) -> u64 {
        debug_assert!(id < self.len);
        if self.steps == 0 {
            return NEVER;
        }
        let first = t / self.steps;
        for e in first..=first.saturating_add(self.horizon) {
            if self.end_epoch.is_some_and(|end| e >= end) {
                return NEVER;
            }
            let j0 = if self.shuffle {
                Permutation::blocked(self.len, self.seed, e, self.block).invert(id)
            } else {
                id
            };
            // Global positions of id in the epoch: j0, then j0 + len, ...
            // in the padding (which repeats the order's start).
            let mut j = j0;
            while j < self.steps {
                let time = self.time(e, j);
                let mine = self
                    .ranks
                    .as_ref()
                    .is_none_or(|r| r.contains(&(j % self.world)));
                if mine && time > t {
                    return time;
                }
                j += self.len;
            }
        }
        NEVER
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampler::SamplerConfig;

    /// Every read of every sample over `epochs`, from the sampler itself.
    fn reads(s: &Sampler, ranks: Option<std::ops::Range<u32>>, epochs: u64) -> Vec<(u64, u64)> {
        let cfg = s.config();
        let mut out = Vec::new();
        for e in 0..epochs {
            let order = s.epoch(e);
            let steps = s.per_rank() * cfg.world as u64;
            for j in 0..steps {
                if ranks
                    .as_ref()
                    .is_none_or(|r| r.contains(&((j % cfg.world as u64) as u32)))
                {
                    out.push((e * steps + j, order.global(j)));
                }
            }
        }
        out
    }

    #[test]
    fn next_reads_match_a_scan_of_the_order() {
        for (len, world, drop_last, block, shuffle) in [
            (10u64, 1u32, false, 0u64, true),
            (10, 3, false, 0, true),
            (10, 3, true, 0, true),
            (97, 4, false, 8, true),
            (64, 2, false, 0, false),
            (7, 8, false, 0, true),
        ] {
            let epochs = 5;
            for ranks in [
                None,
                Some(0..1),
                Some(world - 1..world),
                Some(0..world.div_ceil(2)),
            ] {
                let s = Sampler::new(
                    SamplerConfig::single(len, 9)
                        .rank_world(0, world)
                        .shuffle(shuffle)
                        .drop_last(drop_last)
                        .shuffle_block(block),
                )
                .unwrap();
                let nu = NextUse::new(&s, ranks.clone(), Some(epochs)).unwrap();
                let all = reads(&s, ranks.clone(), epochs);
                for id in 0..len {
                    let times: Vec<u64> = all.iter().filter(|r| r.1 == id).map(|r| r.0).collect();
                    // From before the first read, and from every read.
                    let mut from = vec![0u64];
                    from.extend(times.iter().copied());
                    for &t in &from {
                        let want = times.iter().copied().find(|&x| x > t).unwrap_or(NEVER);
                        assert_eq!(
                            nu.after(id, t),
                            want,
                            "len={len} W={world} drop_last={drop_last} block={block} ranks={ranks:?} id={id} t={t}"
                        );
                    }
                }
            }
        }
    }
}
