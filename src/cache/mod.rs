//! Caching by the known future. Every rank's order is a pure function of
//! the sampler, so when each sample is read next is computed
//! ([`crate::sampler::NextUse`]), and a cache can keep what is read soonest
//! (Belady's MIN, [`Belady`]) where LRU ([`Lru`], the reference) keeps what
//! was read last, which under a fresh shuffle every epoch is about the
//! worst choice. docs/CACHE.md has the model and its figures.
//!
//! [`CacheArea`] is the NVMe cache area a loader keeps what it read from
//! the source in, deciding by either policy (`loader/cache_plan.rs`).

mod area;
mod belady;
mod classes;
mod lru;
mod slots;
mod writer;

pub use area::{
    is_memory_dir, AreaSpec, CacheArea, CachePolicy, CacheStats, DATA_FILE, JOURNAL_FILE,
    MEMORY_DIR, META_FILE,
};
pub use belady::{Belady, Decision};
pub use classes::{SlotClass, SlotClasses, MAX_SLOTS, SLOT_ALIGN};
pub use lru::Lru;
pub use slots::MAX_CACHED_ID;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampler::{NextUse, Sampler, SamplerConfig, NEVER};

    /// The reads of ranks `r0..r1` of a job over `epochs`, in time order.
    fn reads(s: &Sampler, ranks: std::ops::Range<u32>, epochs: u64) -> Vec<(u64, u64)> {
        let w = s.config().world as u64;
        let steps = s.per_rank() * w;
        let mut out = Vec::new();
        for e in 0..epochs {
            let order = s.epoch(e);
            for j in (0..steps).filter(|j| ranks.contains(&((j % w) as u32))) {
                out.push((e * steps + j, order.global(j)));
            }
        }
        out
    }

    /// Belady driven by the sampler's own next reads makes MIN's decisions
    /// (a brute force over the read sequence), and keeps several times
    /// LRU's hits on the same reads.
    #[test]
    fn next_use_belady_is_min_on_a_sampled_order_and_beats_lru() {
        for (len, world, ranks, capacity) in [
            (300u64, 1u32, 0..1u32, 60u64),
            (300, 4, 0..2, 40),
            (257, 8, 3..4, 30),
        ] {
            let epochs = 4;
            let s = Sampler::new(SamplerConfig::single(len, 17).rank_world(0, world)).unwrap();
            let nu = NextUse::new(&s, Some(ranks.clone()), Some(epochs)).unwrap();
            let seq = reads(&s, ranks.clone(), epochs);
            let mut c = Belady::new(capacity, capacity as usize);
            let mut lru = Lru::new(capacity);
            let (mut hits, mut lru_hits, mut evicted) = (0u64, 0u64, Vec::new());
            let mut brute_held: Vec<u64> = Vec::new();
            let mut brute_evicted = Vec::new();
            for (i, &(t, id)) in seq.iter().enumerate() {
                let next = nu.after(id, t);
                // The brute force: the next read found by scanning.
                let scan = |x: u64| {
                    seq[i + 1..]
                        .iter()
                        .find(|r| r.1 == x)
                        .map_or(NEVER, |r| r.0)
                };
                assert_eq!(next, scan(id), "len {len} W {world} read {i}");
                if c.read(id, 1, next, |e| evicted.push(e)) == Decision::Hit {
                    hits += 1;
                }
                lru_hits += lru.read(id, 1) as u64;
                if !brute_held.contains(&id) && next != NEVER {
                    if (brute_held.len() as u64) < capacity {
                        brute_held.push(id);
                    } else {
                        let (k, far) = brute_held
                            .iter()
                            .enumerate()
                            .map(|(k, &h)| (k, (scan(h), h)))
                            .max_by_key(|&(_, key)| key)
                            .unwrap();
                        if far > (next, id) {
                            brute_evicted.push(brute_held[k]);
                            brute_held[k] = id;
                        }
                    }
                }
            }
            assert_eq!(evicted, brute_evicted, "len {len} W {world}");
            assert!(
                hits >= 3 * lru_hits.max(1),
                "len {len} W {world}: next use {hits} hits, LRU {lru_hits}"
            );
        }
    }
}
