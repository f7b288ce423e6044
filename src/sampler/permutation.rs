//! The keyed permutation of an epoch: a Feistel network over the bits of
//! the dataset length, cycle-walked below it, and its block-local form
//! (`shuffle_block`). Frozen in docs/FORMAT.md ("Sampler").

use crate::hash::mix64;

const ROUNDS: usize = 6;
const PERM_SALT: u64 = 0x6b73_7065_6564_7065; // "kspeedpe"
const BLOCK_SALT: u64 = 0x6b73_7065_6564_626b; // "kspeedbk"
/// The largest `shuffle_block` (it is saved in 24 bits of a position's
/// flags).
pub const MAX_SHUFFLE_BLOCK: u64 = (1 << 24) - 1;

/// A Feistel network over `hi_bits + lo_bits` bits with its round keys.
#[derive(Debug, Clone)]
struct Feistel {
    /// Bits of the left and right halves (they differ by at most one).
    hi_bits: u32,
    lo_bits: u32,
    keys: [u64; ROUNDS],
}

const fn low_mask(bits: u32) -> u64 {
    (1u64 << bits) - 1
}

impl Feistel {
    /// The network covering `0..n` (at least 2 bits) keyed by `base`.
    fn new(n: u64, base: u64) -> Self {
        let bits = (64 - (n.max(1) - 1).leading_zeros()).max(2);
        let mut keys = [0u64; ROUNDS];
        for (i, k) in keys.iter_mut().enumerate() {
            *k = mix64(base.wrapping_add(i as u64 + 1));
        }
        Feistel {
            hi_bits: bits / 2,
            lo_bits: bits - bits / 2,
            keys,
        }
    }

    /// One pass of the (possibly unbalanced) Feistel network over
    /// `hi_bits + lo_bits` bits: each round maps (L, R) to (R, L ^ F(R)),
    /// the halves swapping widths, which is invertible whatever F is. An
    /// even number of rounds brings the widths back.
    fn pass(&self, x: u64) -> u64 {
        let (mut l_bits, mut r_bits) = (self.hi_bits, self.lo_bits);
        let (mut l, mut r) = (x >> r_bits, x & low_mask(r_bits));
        for k in &self.keys {
            let f = mix64(r ^ k) & low_mask(l_bits);
            (l, r) = (r, l ^ f);
            (l_bits, r_bits) = (r_bits, l_bits);
        }
        (l << r_bits) | r
    }

    /// The inverse of [`Feistel::pass`]: the rounds backwards. A forward
    /// round maps (L, R) to (R, L ^ F(R)) with F masked to L's width, so
    /// from (l, r) the round before had (r ^ F(l), l), F masked to r's
    /// width; after an even number of rounds the halves have their
    /// starting widths.
    fn unpass(&self, y: u64) -> u64 {
        let (mut l_bits, mut r_bits) = (self.hi_bits, self.lo_bits);
        let (mut l, mut r) = (y >> r_bits, y & low_mask(r_bits));
        for k in self.keys.iter().rev() {
            let f = mix64(l ^ k) & low_mask(r_bits);
            (l, r) = (r ^ f, l);
            (l_bits, r_bits) = (r_bits, l_bits);
        }
        (l << r_bits) | r
    }

    /// The preimage of `v < n` under [`Feistel::walk`]: cycle walking
    /// backwards (the values a forward walk skips are at or above `n`).
    fn unwalk(&self, v: u64, n: u64) -> u64 {
        let mut x = self.unpass(v);
        while x >= n {
            x = self.unpass(x);
        }
        x
    }

    /// The image of `i < n` in the permutation of `0..n`: passes until the
    /// value falls below `n` (cycle walking). The domain is less than 2n,
    /// so the expected walk is under 2 steps; it terminates because a
    /// permutation's cycle through i < n returns to a value below n.
    fn walk(&self, i: u64, n: u64) -> u64 {
        let mut x = self.pass(i);
        while x >= n {
            x = self.pass(x);
        }
        x
    }
}

/// A keyed pseudo-random permutation of `0..n`: over the whole range, or
/// block-local ([`Permutation::blocked`]).
#[derive(Debug, Clone)]
pub struct Permutation {
    n: u64,
    /// Over `0..n`, or over the blocks when `block > 0`.
    outer: Feistel,
    /// Samples per block (0: the whole range is one permutation).
    block: u64,
    /// Keys each block's own permutation of `0..block`.
    base: u64,
}

impl Permutation {
    /// The permutation of `0..n` for `(seed, epoch)`. `n` must be non-zero.
    pub fn new(n: u64, seed: u64, epoch: u64) -> Self {
        Self::blocked(n, seed, epoch, 0)
    }

    /// A block-local permutation (`block > 1`; 0 or 1 give [`Self::new`]'s):
    /// the ids are cut into blocks of `block` consecutive ids, the blocks
    /// are permuted, and each block's ids are permuted among themselves, so
    /// `block` consecutive positions hold the ids of one block. This is
    /// the shuffle of loaders that read shards whole (LitData, Mosaic's
    /// shuffle blocks): reads of neighbouring ids can become one request.
    pub fn blocked(n: u64, seed: u64, epoch: u64, block: u64) -> Self {
        assert!(n > 0, "permutation of an empty set");
        let base = mix64(mix64(seed ^ PERM_SALT) ^ epoch);
        let block = if block > 1 { block } else { 0 };
        let outer_n = if block == 0 { n } else { n.div_ceil(block) };
        Permutation {
            n,
            outer: Feistel::new(outer_n, base),
            block,
            base,
        }
    }

    /// The image of `i` (`i < n`).
    pub fn apply(&self, i: u64) -> u64 {
        debug_assert!(i < self.n);
        if self.block == 0 {
            return self.outer.walk(i, self.n);
        }
        // A bijection of 0..blocks*block (blocks permuted, then the ids
        // within the target block), walked back below n like the Feistel
        // passes: the last block may be short.
        let mut x = self.in_blocks(i);
        while x >= self.n {
            x = self.in_blocks(x);
        }
        x
    }

    /// The `i` whose image is `v` (`v < n`): where sample `v` stands in the
    /// order. O(1) like [`Self::apply`], so a sample's next use is known
    /// without a list of the epoch (the cache's eviction by next use,
    /// `crate::cache`).
    pub fn invert(&self, v: u64) -> u64 {
        debug_assert!(v < self.n);
        if self.block == 0 {
            return self.outer.unwalk(v, self.n);
        }
        let mut x = self.out_of_blocks(v);
        while x >= self.n {
            x = self.out_of_blocks(x);
        }
        x
    }

    /// The inverse of [`Self::in_blocks`]: the target block's own
    /// permutation backwards, then the blocks'.
    fn out_of_blocks(&self, y: u64) -> u64 {
        let blocks = self.n.div_ceil(self.block);
        let b = y / self.block;
        let inner = Feistel::new(self.block, mix64(self.base ^ mix64(b ^ BLOCK_SALT)));
        self.outer.unwalk(b, blocks) * self.block + inner.unwalk(y % self.block, self.block)
    }

    /// Position `x` of the padded range: its block to a permuted block, its
    /// place within the block by that block's own permutation.
    fn in_blocks(&self, x: u64) -> u64 {
        let blocks = self.n.div_ceil(self.block);
        let b = self.outer.walk(x / self.block, blocks);
        let inner = Feistel::new(self.block, mix64(self.base ^ mix64(b ^ BLOCK_SALT)));
        b * self.block + inner.walk(x % self.block, self.block)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn permutation_is_a_bijection() {
        for n in [1u64, 2, 3, 4, 5, 7, 8, 9, 100, 1000, 4097, 65_536, 65_537] {
            let p = Permutation::new(n, 42, 3);
            let mut seen = vec![false; n as usize];
            for i in 0..n {
                let v = p.apply(i);
                assert!(v < n);
                assert!(!seen[v as usize], "n={n}: {v} twice");
                seen[v as usize] = true;
            }
        }
    }

    #[test]
    fn invert_undoes_apply() {
        for n in [1u64, 2, 3, 5, 8, 9, 100, 1000, 4097] {
            for block in [0u64, 2, 3, 7, 64, 5000] {
                let p = Permutation::blocked(n, 42, 3, block);
                for i in 0..n {
                    assert_eq!(p.invert(p.apply(i)), i, "n={n} block={block} i={i}");
                }
            }
        }
    }

    #[test]
    fn blocked_permutation_is_a_block_local_bijection() {
        for (n, block) in [
            (1u64, 2u64),
            (5, 2),
            (10, 3),
            (100, 7),
            (1000, 64),
            (4097, 256),
            (300, 1000),
        ] {
            let p = Permutation::blocked(n, 42, 3, block);
            let mut seen = vec![false; n as usize];
            let order: Vec<u64> = (0..n).map(|i| p.apply(i)).collect();
            for &v in &order {
                assert!(v < n);
                assert!(!seen[v as usize], "n={n} block={block}: {v} twice");
                seen[v as usize] = true;
            }
            // Every full block of positions holds the ids of one block,
            // except where the short last block's walk lands (it moves at
            // most block - 1 ids).
            let whole = (n / block) as usize;
            let mixed = order
                .chunks(block as usize)
                .take(whole)
                .filter(|c| c.iter().any(|&v| v / block != c[0] / block))
                .count();
            assert!(
                mixed <= 2,
                "n={n} block={block}: {mixed} blocks of positions mix blocks"
            );
            if n >= 8 * block {
                // Shuffled inside the blocks, and the blocks themselves.
                assert!(order
                    .chunks(block as usize)
                    .any(|c| c.windows(2).any(|w| w[1] != w[0] + 1)));
                let blocks: Vec<u64> = order.chunks(block as usize).map(|c| c[0] / block).collect();
                assert!(
                    blocks.windows(2).any(|w| w[1] < w[0]),
                    "n={n} block={block}: blocks in order"
                );
            }
        }
        // 0 and 1 are the whole-dataset permutation.
        for block in [0, 1] {
            let (a, b) = (
                Permutation::new(1000, 5, 2),
                Permutation::blocked(1000, 5, 2, block),
            );
            assert!((0..1000).all(|i| a.apply(i) == b.apply(i)));
        }
    }

    #[test]
    // Statistics over 100,000 draws of safe arithmetic: nothing for Miri
    // to check that the other tests do not, at hours of interpretation.
    #[cfg_attr(miri, ignore)]
    fn shuffles_well_enough() {
        // Displacement of a shuffled order should look uniform: the mean of
        // |p(i) - i| for a random permutation of n is about n/3.
        let n = 100_000u64;
        let p = Permutation::new(n, 7, 0);
        let mean: f64 = (0..n)
            .map(|i| (p.apply(i) as f64 - i as f64).abs())
            .sum::<f64>()
            / n as f64;
        assert!(
            (mean / n as f64 - 1.0 / 3.0).abs() < 0.01,
            "mean displacement {mean}"
        );
        // Fixed points: about 1 expected.
        let fixed = (0..n).filter(|&i| p.apply(i) == i).count();
        assert!(fixed < 10, "{fixed} fixed points");
    }
}
