//! Weighted mixing of datasets (issue 29 part 2): one epoch interleaves
//! several datasets in fixed proportions, as a pure function of (seed,
//! epoch, per-epoch counts, dataset lengths), O(D) memory and O(log D) per
//! position for D datasets, no per-epoch list.
//!
//! - **Counts.** The weights give each dataset `d` a count `c_d` of slots
//!   per epoch ([`epoch_counts`]): Mosaic-style `Proportion`s of an epoch
//!   size (largest remainder, exact sum), or absolute `Repeat`/`Choose`.
//! - **Interleave.** The epoch's `T = Σ c_d` positions are dealt by a
//!   binary tree over the datasets (in the order given; a node over `[a, b)`
//!   splits at `a + ceil((b-a)/2)`): a node whose sequence has `n` slots,
//!   `n_L` of them its left child's, gives its position `i` to the left
//!   child iff `floor((i+1)·n_L/n) > floor(i·n_L/n)` (Bresenham), so any
//!   window of `L` positions holds `floor(L·n_L/n)` or `ceil(L·n_L/n)` left
//!   slots. Both directions are closed forms per level: position → (dataset,
//!   its k-th slot) and (dataset, k) → position, and the slots of `d` in a
//!   prefix. Two datasets: every window of `L` holds `floor` or `ceil` of
//!   `L·c_d/T` slots of each; D datasets: `|count - L·c_d/T| <` the sum of
//!   `c_d/n` over the nodes `n` on `d`'s path below the root (under 2 up to
//!   four datasets; [`MixOrder::window_bound`]).
//! - **Streams.** Dataset `d`'s k-th slot of epoch `e` takes entry `s = k`
//!   of its stream: `P_d(e, s / N_d)(s mod N_d)`, a keyed permutation
//!   ([`super::Permutation`]) per pass, so a dataset drawn more than its
//!   length cycles through fresh permutations. Dataset 0 is keyed with the
//!   job's seed and pass 0 with the epoch itself: a one-dataset mixture
//!   with `Repeat(1.0)` is the plain sampler's order.
//! - **Ranks.** `DistributedSampler` semantics over the mixed order.
//! - **Resume, and new weights** ([`MixPosition`]): a position records the
//!   counts its order was made of, the stream entries each dataset had
//!   used before that order started, and the prefix of it consumed. With
//!   the same counts the order goes on where it stopped, at any world size.
//!   With other counts the rest of the epoch is a new order: dataset `d`
//!   has used `q_d` stream entries (counted in O(log D) from the prefix) and
//!   gets `max(c'_d - q_d, 0)` more, interleaved as above and taken from its
//!   stream from entry `q_d` on: no stream entry twice in the epoch (no
//!   sample twice while `max(q_d, c'_d) <= N_d`). Frozen, with check
//!   values, in docs/FORMAT.md.

use std::sync::Arc;

use super::mix_position::MixPosition;
use super::{Permutation, SamplerConfig};
use crate::error::{Error, Result};
use crate::hash::mix64;

/// The most datasets one mixture holds (a tree of depth 16).
pub const MAX_DATASETS: usize = 1 << 16;
const DATASET_SALT: u64 = 0x6b73_7065_6564_6473; // "kspeedds"
const PASS_SALT: u64 = 0x6b73_7065_6564_7073; // "kspeedps"
const MIXFP_SALT: u64 = 0x6b73_7065_6564_6d66; // "kspeedmf"
/// Fixed-point scale of a fractional weight: `round(w · 2^32)`.
const FIXED_ONE: f64 = 4_294_967_296.0;

/// How many samples an epoch takes from one dataset (Mosaic Streaming's
/// `proportion`, `repeat` and `choose`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Weight {
    /// This fraction of the epoch (every dataset of the mixture gives one,
    /// or none does). They need not add up to 1: they are normalised.
    Proportion(f64),
    /// This many passes over the dataset per epoch (`0.5`: half of it,
    /// `2.0`: each sample twice), `floor(N · round(r · 2^32) / 2^32)`.
    Repeat(f64),
    /// This many samples per epoch.
    Choose(u64),
}

impl std::str::FromStr for Weight {
    type Err = Error;

    /// `0.7` (a proportion), `repeat=2`, `choose=1000`.
    fn from_str(s: &str) -> Result<Self> {
        let bad = |why: &str| Error::InvalidConfig(format!("weight {s:?}: {why}"));
        let num = |v: &str| -> Result<f64> {
            v.parse::<f64>()
                .map_err(|_| bad("not a number"))
                .and_then(|x| {
                    if x.is_finite() && x >= 0.0 {
                        Ok(x)
                    } else {
                        Err(bad("must be a finite number >= 0"))
                    }
                })
        };
        if let Some(v) = s.strip_prefix("repeat=") {
            Ok(Weight::Repeat(num(v)?))
        } else if let Some(v) = s.strip_prefix("choose=") {
            Ok(Weight::Choose(
                v.parse().map_err(|_| bad("choose takes a whole count"))?,
            ))
        } else {
            Ok(Weight::Proportion(num(s)?))
        }
    }
}

/// `round(v · 2^32)`, refusing what is not a finite number in `[0, 2^31)`.
fn fixed(v: f64) -> Result<u64> {
    if !(v.is_finite() && (0.0..2_147_483_648.0).contains(&v)) {
        return Err(Error::InvalidConfig(format!(
            "weight {v} is not a number in [0, 2^31)"
        )));
    }
    Ok((v * FIXED_ONE).round() as u64)
}

/// Each dataset's slots per epoch: for proportions, `epoch_size` (default:
/// the datasets' total length) split by largest remainder (each gets
/// `floor(E·w_d/W)`, the rest go one each to the largest remainders
/// `E·w_d mod W`, ties to the lower index; `w_d = round(p_d · 2^32)`,
/// `W = Σ w_d`); otherwise `Repeat(r)`: `floor(N_d · round(r · 2^32) / 2^32)`
/// and `Choose(n)`: `n` (no `epoch_size` then). The counts add up to at
/// least 1 and fit in u64.
pub fn epoch_counts(weights: &[Weight], lens: &[u64], epoch_size: Option<u64>) -> Result<Vec<u64>> {
    if weights.is_empty() || weights.len() != lens.len() || weights.len() > MAX_DATASETS {
        return Err(Error::InvalidConfig(format!(
            "{} weights for {} datasets (a mixture has 1 to {MAX_DATASETS})",
            weights.len(),
            lens.len()
        )));
    }
    if let Some(d) = lens.iter().position(|&n| n == 0) {
        return Err(Error::InvalidConfig(format!("dataset {d} has no samples")));
    }
    let props = weights
        .iter()
        .filter(|w| matches!(w, Weight::Proportion(_)))
        .count();
    let counts = if props == weights.len() {
        let total_len = lens
            .iter()
            .try_fold(0u64, |a, &n| a.checked_add(n))
            .ok_or_else(|| Error::InvalidConfig("the datasets' total length overflows".into()))?;
        let e = epoch_size.unwrap_or(total_len) as u128;
        let w: Vec<u128> = weights
            .iter()
            .map(|w| match *w {
                Weight::Proportion(p) => fixed(p).map(u128::from),
                _ => unreachable!("all proportions"),
            })
            .collect::<Result<_>>()?;
        let sum: u128 = w.iter().sum();
        if sum == 0 {
            return Err(Error::InvalidConfig("every proportion is 0".into()));
        }
        let mut c: Vec<u64> = w.iter().map(|&wd| (e * wd / sum) as u64).collect();
        let short = (e - c.iter().map(|&x| x as u128).sum::<u128>()) as usize;
        let mut order: Vec<usize> = (0..w.len()).collect();
        // Largest remainder first, then the lower index (a stable sort).
        order.sort_by_key(|&d| std::cmp::Reverse(e * w[d] % sum));
        for &d in order.iter().take(short) {
            c[d] += 1;
        }
        c
    } else if props == 0 {
        if epoch_size.is_some() {
            return Err(Error::InvalidConfig(
                "an epoch size goes with proportions, not with repeat/choose counts".into(),
            ));
        }
        weights
            .iter()
            .zip(lens)
            .map(|(w, &n)| match *w {
                Weight::Repeat(r) => Ok(((n as u128 * fixed(r)? as u128) >> 32) as u64),
                Weight::Choose(k) => Ok(k),
                Weight::Proportion(_) => unreachable!("no proportions"),
            })
            .collect::<Result<_>>()?
    } else {
        return Err(Error::InvalidConfig(
            "give every dataset a proportion, or none (repeat/choose counts)".into(),
        ));
    };
    match counts.iter().try_fold(0u64, |a, &c| a.checked_add(c)) {
        None => Err(Error::InvalidConfig("the epoch's total overflows".into())),
        Some(0) => Err(Error::InvalidConfig("the mixture's epoch is empty".into())),
        Some(_) => Ok(counts),
    }
}

/// The datasets of a mixture, shared by every order of a sampler.
#[derive(Debug)]
struct Datasets {
    lens: Vec<u64>,
    /// Global id of each dataset's sample 0: the lengths before it.
    offsets: Vec<u64>,
    /// Each dataset's permutation seed.
    seeds: Vec<u64>,
    shuffle: bool,
}

impl Datasets {
    fn new(lens: &[u64], seed: u64, shuffle: bool) -> Result<Self> {
        if lens.is_empty() || lens.len() > MAX_DATASETS || lens.contains(&0) {
            return Err(Error::InvalidConfig(format!(
                "a mixture has 1 to {MAX_DATASETS} datasets, none empty"
            )));
        }
        let mut offsets = Vec::with_capacity(lens.len());
        let mut at = 0u64;
        for &n in lens {
            offsets.push(at);
            at = at
                .checked_add(n)
                .ok_or_else(|| Error::InvalidConfig("the datasets' ids overflow u64".into()))?;
        }
        Ok(Datasets {
            lens: lens.to_vec(),
            offsets,
            seeds: (0..lens.len() as u64)
                .map(|d| dataset_seed(seed, d))
                .collect(),
            shuffle,
        })
    }

    /// Stream entry `s` of dataset `d` in `epoch`: a local id. `first` is
    /// the epoch's first-pass permutations, computed once per order.
    fn stream(&self, epoch: u64, first: &[Permutation], d: usize, s: u64) -> u64 {
        let n = self.lens[d];
        let (pass, i) = (s / n, s % n);
        if !self.shuffle {
            i
        } else if pass == 0 {
            first[d].apply(i)
        } else {
            Permutation::new(n, self.seeds[d], pass_key(epoch, pass)).apply(i)
        }
    }

    /// The first-pass permutation of every dataset in `epoch` (none
    /// without shuffle).
    fn first_pass(&self, epoch: u64) -> Arc<[Permutation]> {
        if !self.shuffle {
            return Arc::from(Vec::new());
        }
        self.lens
            .iter()
            .zip(&self.seeds)
            .map(|(&n, &seed)| Permutation::new(n, seed, pass_key(epoch, 0)))
            .collect()
    }
}

/// Dataset `d`'s permutation seed: the job's for dataset 0.
pub fn dataset_seed(seed: u64, d: u64) -> u64 {
    if d == 0 {
        seed
    } else {
        mix64(seed ^ mix64(d ^ DATASET_SALT))
    }
}

/// The permutation key of pass `pass` over a dataset in `epoch`: the epoch
/// itself for the first pass.
pub fn pass_key(epoch: u64, pass: u64) -> u64 {
    if pass == 0 {
        epoch
    } else {
        mix64(mix64(epoch ^ PASS_SALT) ^ pass)
    }
}

/// One sample of a mixed order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MixSample {
    /// Which dataset (its index in the mixture).
    pub dataset: u32,
    /// Its id within that dataset.
    pub local: u64,
    /// Its id in the loader's one id space: the dataset's offset (the
    /// lengths of the datasets before it) plus `local`.
    pub id: u64,
}

/// One epoch's mixed order (or the rest of one after new weights): the
/// interleave of each dataset's slots and where in its stream it starts.
/// Cloning shares everything (no allocation).
#[derive(Debug, Clone)]
pub struct MixOrder {
    epoch: u64,
    ds: Arc<Datasets>,
    /// Prefix sums of each dataset's slots in this order (D + 1 entries).
    cum: Arc<[u64]>,
    /// Stream entries of each dataset used before this order started.
    skip: Arc<[u64]>,
    /// Each dataset's first-pass permutation in this epoch.
    first: Arc<[Permutation]>,
}

/// The left child of the tree node over datasets `[a, b)` ends here.
fn split(a: usize, b: usize) -> usize {
    a + (b - a).div_ceil(2)
}

impl MixOrder {
    fn new(epoch: u64, ds: Arc<Datasets>, slots: &[u64], skip: Arc<[u64]>) -> Self {
        let mut cum = Vec::with_capacity(slots.len() + 1);
        let mut at = 0u64;
        cum.push(0);
        for &c in slots {
            at = at.checked_add(c).expect("counts checked to fit u64");
            cum.push(at);
        }
        MixOrder {
            epoch,
            first: ds.first_pass(epoch),
            ds,
            cum: cum.into(),
            skip,
        }
    }

    /// Positions in this order.
    pub fn len(&self) -> u64 {
        self.cum[self.cum.len() - 1]
    }

    /// Whether the order is empty (a rest with nothing left).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn datasets(&self) -> usize {
        self.cum.len() - 1
    }

    /// Slots of datasets `[a, b)`.
    fn total(&self, a: usize, b: usize) -> u64 {
        self.cum[b] - self.cum[a]
    }

    /// The dataset of position `j` (`j < len()`) and which of its slots in
    /// this order it is.
    pub fn slot(&self, j: u64) -> (usize, u64) {
        debug_assert!(j < self.len(), "position {j} past the order");
        let (mut a, mut b, mut i) = (0, self.datasets(), j);
        while b - a > 1 {
            let m = split(a, b);
            let (n, nl) = (self.total(a, b) as u128, self.total(a, m) as u128);
            let left_through = ((i as u128 + 1) * nl / n) as u64;
            let left_before = (i as u128 * nl / n) as u64;
            if left_through > left_before {
                (b, i) = (m, left_before);
            } else {
                (a, i) = (m, i - left_before);
            }
        }
        (a, i)
    }

    /// The position of dataset `d`'s slot `k` (`k` below its slots here):
    /// the inverse of [`MixOrder::slot`].
    pub fn position(&self, d: usize, k: u64) -> u64 {
        debug_assert!(
            k < self.total(d, d + 1),
            "slot {k} of dataset {d} past the order"
        );
        // The path from the root down to d, then the inverse up it.
        let mut path = [(0usize, 0usize, false); 20];
        let mut depth = 0;
        let (mut a, mut b) = (0, self.datasets());
        while b - a > 1 {
            let m = split(a, b);
            let left = d < m;
            path[depth] = (a, b, left);
            depth += 1;
            if left {
                b = m;
            } else {
                a = m;
            }
        }
        let mut i = k as u128;
        for &(a, b, left) in path[..depth].iter().rev() {
            let m = split(a, b);
            let n = self.total(a, b) as u128;
            i = if left {
                // The smallest i with floor((i+1)·n_L/n) >= k+1.
                let nl = self.total(a, m) as u128;
                ((i + 1) * n).div_ceil(nl) - 1
            } else {
                // The smallest i with (i+1) - floor((i+1)·n_L/n) >= k+1,
                // that is ceil((i+1)·n_R/n) >= k+1.
                let nr = self.total(m, b) as u128;
                i * n / nr
            };
        }
        i as u64
    }

    /// Slots of dataset `d` among the first `n` positions (`n <= len()`).
    pub fn count_before(&self, d: usize, n: u64) -> u64 {
        debug_assert!(n <= self.len());
        let (mut a, mut b, mut n) = (0, self.datasets(), n);
        // A subtree with no slots has none in any prefix (and no ratio).
        while b - a > 1 && n > 0 {
            let m = split(a, b);
            let left = (n as u128 * self.total(a, m) as u128 / self.total(a, b) as u128) as u64;
            if d < m {
                (b, n) = (m, left);
            } else {
                (a, n) = (m, n - left);
            }
        }
        n
    }

    /// The sample at position `j` (`j < len()`).
    pub fn sample(&self, j: u64) -> MixSample {
        let (d, k) = self.slot(j);
        let local = self.ds.stream(self.epoch, &self.first, d, self.skip[d] + k);
        MixSample {
            dataset: d as u32,
            local,
            id: self.ds.offsets[d] + local,
        }
    }

    /// The bound this construction proves on `|count - L·c_d/T|` for
    /// dataset `d` in any window of `L` positions (`c_d` its slots, `T`
    /// the order's): the sum of `c_d/n` over the tree nodes below the
    /// root on `d`'s path, each of `n` slots (the leaf's term is 1).
    pub fn window_bound(&self, d: usize) -> f64 {
        let c = self.total(d, d + 1) as f64;
        let (mut a, mut b) = (0, self.datasets());
        let mut bound = 0.0;
        while b - a > 1 {
            let m = split(a, b);
            if d < m {
                b = m;
            } else {
                a = m;
            }
            bound += c / self.total(a, b).max(1) as f64;
        }
        bound
    }
}

/// Where an epoch's order starts: a resumed epoch's rest, or an ordinary
/// epoch (`skip` all 0, `consumed` 0).
#[derive(Debug, Clone)]
struct Start {
    epoch: u64,
    /// Stream entries of each dataset used before this order.
    skip: Arc<[u64]>,
    /// Entries of this order the job consumed before this world dealt it.
    consumed: u64,
}

/// A rank's view of a mixture: [`super::Sampler`]'s `DistributedSampler`
/// semantics over the mixed order of every epoch.
#[derive(Debug, Clone)]
pub struct MixSampler {
    cfg: SamplerConfig,
    ds: Arc<Datasets>,
    counts: Arc<[u64]>,
    start: Start,
}

impl MixSampler {
    /// Rank `cfg.rank` of `cfg.world` over datasets of `lens` mixed with
    /// `counts` slots each per epoch ([`epoch_counts`]), from epoch 0
    /// (`cfg.len` is ignored: an epoch has `Σ counts` positions).
    pub fn new(cfg: SamplerConfig, lens: &[u64], counts: &[u64]) -> Result<Self> {
        let ds = Arc::new(Datasets::new(lens, cfg.seed, cfg.shuffle)?);
        if counts.len() != lens.len() {
            return Err(Error::InvalidConfig(format!(
                "{} counts for {} datasets",
                counts.len(),
                lens.len()
            )));
        }
        let total = counts
            .iter()
            .try_fold(0u64, |a, &c| a.checked_add(c))
            .filter(|&t| t > 0)
            .ok_or_else(|| {
                Error::InvalidConfig("the mixture's epoch is empty or overflows".into())
            })?;
        let cfg = SamplerConfig { len: total, ..cfg };
        // Checks rank and world as the plain sampler does.
        super::Sampler::new(cfg)?;
        Ok(MixSampler {
            cfg,
            start: Start {
                epoch: 0,
                skip: vec![0; lens.len()].into(),
                consumed: 0,
            },
            ds,
            counts: counts.into(),
        })
    }

    /// The configuration (`len`: positions of an ordinary epoch).
    pub fn config(&self) -> &SamplerConfig {
        &self.cfg
    }

    /// Each dataset's slots per ordinary epoch.
    pub fn counts(&self) -> &[u64] {
        &self.counts
    }

    /// The datasets' lengths.
    pub fn lens(&self) -> &[u64] {
        &self.ds.lens
    }

    /// Each dataset's first global id.
    pub fn offsets(&self) -> &[u64] {
        &self.ds.offsets
    }

    /// The dataset a global id belongs to (O(log D)).
    pub fn dataset_of(&self, id: u64) -> u32 {
        (self.ds.offsets.partition_point(|&o| o <= id) - 1) as u32
    }

    /// The epoch the sampler started in (resumed, or 0).
    pub fn start_epoch(&self) -> u64 {
        self.start.epoch
    }

    /// The mixed order of `epoch` (the rest of it for a resumed epoch).
    pub fn order(&self, epoch: u64) -> MixOrder {
        if epoch == self.start.epoch {
            let slots: Vec<u64> = self
                .counts
                .iter()
                .zip(self.start.skip.iter())
                .map(|(&c, &q)| c.saturating_sub(q))
                .collect();
            MixOrder::new(epoch, self.ds.clone(), &slots, self.start.skip.clone())
        } else {
            let zero: Arc<[u64]> = vec![0; self.counts.len()].into();
            MixOrder::new(epoch, self.ds.clone(), &self.counts, zero)
        }
    }

    /// Entries of `epoch`'s order consumed before this world dealt it.
    fn base(&self, epoch: u64, order_len: u64) -> u64 {
        use std::cmp::Ordering::*;
        match epoch.cmp(&self.start.epoch) {
            Less => order_len,
            Equal => self.start.consumed,
            Greater => 0,
        }
    }

    /// This rank's view of `epoch`.
    pub fn epoch(&self, epoch: u64) -> MixEpoch {
        let order = self.order(epoch);
        let base = self.base(epoch, order.len());
        let rest = order.len() - base.min(order.len());
        let w = self.cfg.world as u64;
        let per_rank = if self.cfg.drop_last {
            rest / w
        } else {
            rest.div_ceil(w)
        };
        MixEpoch {
            order,
            base,
            rank: self.cfg.rank as u64,
            world: w,
            per_rank,
        }
    }

    /// Steps of `epoch` for this rank (the same on every rank).
    pub fn per_rank(&self, epoch: u64) -> u64 {
        self.epoch(epoch).per_rank
    }

    /// The job's position when this rank (in lock-step with the others)
    /// has consumed `index` steps of `epoch`.
    pub fn position(&self, epoch: u64, index: u64) -> MixPosition {
        let e = self.epoch(epoch);
        self.job_position(epoch, e.base + index * e.world)
    }

    /// The sampler of this configuration resuming the job at `pos` (saved
    /// at any world size): with the same counts the epoch's order goes on
    /// after its consumed prefix; with other counts the rest of the epoch
    /// is a new order over what each dataset has left of its new count,
    /// unless the order was consumed to its end (`consumed >= ` its
    /// length): that epoch is over, and the sampler starts the next.
    pub fn resume(&self, pos: &MixPosition) -> Result<MixSampler> {
        if pos.counts.len() != self.counts.len() || pos.skip.len() != self.counts.len() {
            return Err(Error::BadPosition(format!(
                "saved for a mixture of {} datasets, this one has {}",
                pos.counts.len(),
                self.counts.len()
            )));
        }
        let start = if *pos.counts == *self.counts {
            Start {
                epoch: pos.epoch,
                skip: pos.skip.clone().into(),
                consumed: pos.consumed,
            }
        } else if pos.consumed >= self.order_of(pos).len() {
            // The epoch's order was consumed to its end (padding
            // included): the epoch is over, whatever the weights.
            Start {
                epoch: pos.epoch.saturating_add(1),
                skip: vec![0; self.counts.len()].into(),
                consumed: 0,
            }
        } else {
            Start {
                epoch: pos.epoch,
                skip: self.used(pos).into(),
                consumed: 0,
            }
        };
        Ok(MixSampler {
            start,
            ..self.clone()
        })
    }

    /// The order `pos` is in: the interleave of what each dataset has
    /// left of `pos.counts` after `pos.skip`, from stream entry `skip` on.
    pub fn order_of(&self, pos: &MixPosition) -> MixOrder {
        let slots: Vec<u64> = pos
            .counts
            .iter()
            .zip(&pos.skip)
            .map(|(&c, &q)| c.saturating_sub(q))
            .collect();
        MixOrder::new(pos.epoch, self.ds.clone(), &slots, pos.skip.clone().into())
    }

    /// Stream entries each dataset has used in `pos.epoch` through `pos`:
    /// before its order (`skip`), and in the order's consumed prefix (the
    /// whole order when `consumed` is past its end: the rest is padding).
    /// `pos` must have this mixture's number of datasets.
    pub fn used(&self, pos: &MixPosition) -> Vec<u64> {
        let old = self.order_of(pos);
        let n = pos.consumed.min(old.len());
        (0..pos.skip.len())
            .map(|d| pos.skip[d] + old.count_before(d, n))
            .collect()
    }

    /// Positions in `epoch`'s order (the rest's, for the epoch the
    /// sampler resumed in with other weights): O(D), no allocation.
    pub fn order_len(&self, epoch: u64) -> u64 {
        if epoch == self.start.epoch {
            self.counts
                .iter()
                .zip(self.start.skip.iter())
                .map(|(&c, &q)| c.saturating_sub(q))
                .sum()
        } else {
            self.counts.iter().sum()
        }
    }

    /// Where this sampler resumed the job: the epoch, and the entries of
    /// its order consumed (0 after new weights: their order starts there;
    /// the next epoch's start after an order consumed to its end).
    pub fn start_position(&self) -> super::JobPosition {
        super::JobPosition {
            epoch: self.start.epoch,
            consumed: self.start.consumed,
        }
    }

    /// The job's position when it has consumed `consumed` entries of
    /// `epoch`'s order (the rest's, in the epoch resumed with other
    /// weights), by all its ranks together: valid at any world size.
    pub fn job_position(&self, epoch: u64, consumed: u64) -> MixPosition {
        let skip = if epoch == self.start.epoch {
            self.start.skip.to_vec()
        } else {
            vec![0; self.counts.len()]
        };
        MixPosition {
            epoch,
            consumed,
            counts: self.counts.to_vec(),
            skip,
        }
    }

    /// The fingerprint a position checks: the datasets (lengths and each
    /// catalog's identity), seed, shuffle and drop_last, not the counts,
    /// rank or world.
    pub fn fingerprint(&self, identities: &[u32]) -> u64 {
        let flags = (self.cfg.shuffle as u64) | ((self.cfg.drop_last as u64) << 1);
        let mut h = mix64(self.ds.lens.len() as u64 ^ MIXFP_SALT);
        h = mix64(h ^ self.cfg.seed);
        h = mix64(h ^ flags);
        for (d, &n) in self.ds.lens.iter().enumerate() {
            h = mix64(h ^ n);
            h = mix64(h ^ identities.get(d).copied().unwrap_or(0) as u64);
        }
        h
    }
}

/// One epoch as dealt to one rank.
#[derive(Debug, Clone)]
pub struct MixEpoch {
    order: MixOrder,
    base: u64,
    rank: u64,
    world: u64,
    per_rank: u64,
}

impl MixEpoch {
    /// Steps of this epoch for this rank.
    pub fn per_rank(&self) -> u64 {
        self.per_rank
    }

    /// The order dealt.
    pub fn order(&self) -> &MixOrder {
        &self.order
    }

    /// The order's position where rank 0's step 0 is (after the entries
    /// consumed before a resume in this epoch).
    pub(crate) fn base(&self) -> u64 {
        self.base
    }

    /// The order's position of this rank's step `k` (before wrapping: past
    /// the order's end is padding, which repeats its start).
    pub fn global_index(&self, k: u64) -> u64 {
        debug_assert!(k < self.per_rank, "step {k} past the epoch");
        self.base + self.rank + k * self.world
    }

    /// This rank's step `k`.
    pub fn sample(&self, k: u64) -> MixSample {
        self.order.sample(self.global_index(k) % self.order.len())
    }
}

impl MixPosition {
    /// Serializes for the job of `sampler` over catalogs `identities`
    /// (layout: [`MixPosition::encode`], the fingerprint
    /// [`MixSampler::fingerprint`]).
    pub fn save(&self, sampler: &MixSampler, identities: &[u32]) -> Vec<u8> {
        self.encode(sampler.fingerprint(identities))
    }

    /// Decodes a position saved by [`MixPosition::save`] for the same
    /// datasets, seed, shuffle and drop_last (any weights, rank, world).
    pub fn restore(bytes: &[u8], sampler: &MixSampler, identities: &[u32]) -> Result<Self> {
        Self::decode(bytes, sampler.counts.len(), sampler.fingerprint(identities))
    }
}

#[cfg(test)]
#[path = "mix_tests.rs"]
mod tests;
