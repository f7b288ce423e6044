//! A loader over a small source with a cache area, the exact read of its
//! epochs and MIN's hits on its order: what the cache area's tests
//! (tests/cache_area.rs, tests/cache_memory.rs) share.

#![allow(dead_code)]

use std::path::PathBuf;

use crate::area;
use crate::common::*;
use kspeed::cache::{Belady, CachePolicy, Decision};
use kspeed::dataset::Catalog;
use kspeed::loader::{Loader, LoaderBuilder};
use kspeed::sampler::{NextUse, Sampler, SamplerConfig};
use kspeed::Error;

pub const SEED: u64 = 11;
pub const N: u64 = 240;

pub struct Setup {
    pub tmp: tempfile::TempDir,
    pub src: PathBuf,
    pub catalog: PathBuf,
    pub cat: Catalog,
    /// A third of the dataset's bytes.
    pub third: u64,
}

pub fn setup() -> Setup {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    gen("imagenet", N, &src);
    let catalog = tmp.path().join("src.ksc");
    ok(&["catalog", "--source", s(&src), "--out", s(&catalog)]);
    let cat = Catalog::open(&catalog).unwrap();
    let total: u64 = (0..cat.len()).map(|i| cat.sample(i).len as u64).sum();
    Setup {
        tmp,
        src,
        catalog,
        cat,
        third: total / 3,
    }
}

impl Setup {
    pub fn cache(&self) -> PathBuf {
        self.tmp.path().join("cache")
    }

    pub fn builder(&self, policy: CachePolicy) -> LoaderBuilder {
        LoaderBuilder::source(s(&self.src))
            .catalog(&self.catalog)
            .seed(SEED)
            .batch_size(8)
            .pollers(2)
            .pin(false)
            .landing(test_ring(8 << 20))
            .cache_dir(Some(self.cache()))
            .cache_bytes(self.third)
            .cache_policy(policy)
    }

    /// A loader reading epochs `from..to` by `policy`.
    pub fn loader(&self, policy: CachePolicy, from: u64, to: u64) -> Loader {
        self.builder(policy)
            .start_at(kspeed::sampler::Position {
                epoch: from,
                index: 0,
            })
            .end_epoch(Some(to))
            .build()
            .unwrap()
    }
}

/// Reads epochs `from..to`, checking order and bytes.
pub fn read_exact(l: &mut Loader, cat: &Catalog, from: u64, to: u64) -> Result<(), Error> {
    let sampler = Sampler::new(SamplerConfig::single(cat.len(), SEED)).unwrap();
    for e in from..to {
        l.set_epoch(e)?;
        let mut k = 0u64;
        while let Some(b) = l.next_batch()? {
            for smp in b.iter() {
                assert_eq!(smp.id, sampler.sample(e, k), "epoch {e} step {k}");
                let c = cat.sample(smp.id);
                assert_eq!(smp.bytes.len(), c.len as usize, "sample {}", smp.id);
                assert_eq!(crc32c::crc32c(smp.bytes), c.crc32c, "sample {}", smp.id);
                k += 1;
            }
        }
        assert_eq!(k, cat.len(), "every sample of epoch {e}, once");
    }
    Ok(())
}

/// The slot classes of an area of `bytes` over `cat`, as the area makes
/// them.
pub fn classes_of(cat: &Catalog, bytes: u64) -> area::Classes {
    let cl = kspeed::cache::SlotClasses::for_catalog(cat, bytes);
    area::Classes(
        cl.classes()
            .iter()
            .map(|k| (k.slot_bytes, k.slots as u64))
            .collect(),
    )
}

/// MIN's hits (Belady with bypass over the rank's whole order, one MIN
/// per slot class as the area's planner runs them, those larger than every
/// slot never kept), epochs `0..epochs`.
pub fn min_hits(cat: &Catalog, cl: &area::Classes, epochs: u64) -> u64 {
    min_hits_of(cat, cl, epochs, 0, 1)
}

/// [`min_hits`] for rank `rank` of `world`.
pub fn min_hits_of(cat: &Catalog, cl: &area::Classes, epochs: u64, rank: u32, world: u32) -> u64 {
    let sampler = {
        let mut cfg = SamplerConfig::single(cat.len(), SEED);
        (cfg.rank, cfg.world) = (rank, world);
        Sampler::new(cfg).unwrap()
    };
    let next = NextUse::new(&sampler, Some(rank..rank + 1), Some(epochs)).unwrap();
    let mut mins: Vec<Belady> =
        cl.0.iter()
            .map(|&(_, n)| Belady::new(n, n as usize))
            .collect();
    let mut hits = 0;
    for e in 0..epochs {
        for k in 0..sampler.per_rank() {
            let id = sampler.sample(e, k);
            let Some(c) = cl.class_for(cat.sample(id).len as u64) else {
                continue;
            };
            let j = k * world as u64 + rank as u64;
            let n = next.after(id, next.time(e, j));
            if mins[c].read(id, 1, n, |_| {}) == Decision::Hit {
                hits += 1;
            }
        }
    }
    hits
}
