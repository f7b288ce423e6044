//! The owner function: which nodes hold sample `i` of an `N`-node space with
//! `R` copies. It is part of the protocol (every node and every consumer must
//! agree without talking), so it is frozen and documented in docs/FORMAT.md:
//!
//! ```text
//! primary(i) = floor(mix64(i XOR 0x6b73_7065_6564_6f77) * N / 2^64)
//! holder(i, r) = (primary(i) + r) mod N        for r in 0..R
//! ```
//!
//! `mix64` is the SplitMix64 finalizer (`crate::hash::mix64`); the salt is
//! ASCII "kspeedow". `r = 0` is the owner, `r >= 1` the replicas. Hashing
//! spreads consecutive ids (one class folder, one tar shard) over all nodes;
//! consecutive replicas keep the computation O(1) per sample.

use crate::error::{Error, Result};
use crate::hash::{mix64, reduce};

const SALT: u64 = 0x6b73_7065_6564_6f77;

/// Most copies of a sample: the consumer marks the replicas it tried in a
/// 64-bit mask (bit r), so a 65th could not be told apart.
pub(crate) const MAX_REPLICAS: u32 = 64;

/// How a space's samples are spread over nodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Placement {
    /// Number of nodes.
    pub nodes: u32,
    /// Copies of each sample (1 = no replica), at most `nodes`.
    pub replicas: u32,
}

impl Placement {
    /// One node holding everything.
    pub const SINGLE: Placement = Placement {
        nodes: 1,
        replicas: 1,
    };

    /// Checks the numbers.
    pub fn new(nodes: u32, replicas: u32) -> Result<Self> {
        if nodes == 0 {
            return Err(Error::InvalidConfig("nodes must be at least 1".into()));
        }
        if replicas == 0 || replicas > nodes {
            return Err(Error::InvalidConfig(format!(
                "replicas must be between 1 and the number of nodes ({nodes}), not {replicas}"
            )));
        }
        if replicas > MAX_REPLICAS {
            return Err(Error::InvalidConfig(format!(
                "replicas must be at most {MAX_REPLICAS} (a consumer tracks the copies it tried in a 64-bit mask), not {replicas}"
            )));
        }
        Ok(Placement { nodes, replicas })
    }

    /// The owner (copy 0) of sample `id`.
    pub fn owner(&self, id: u64) -> u32 {
        reduce(mix64(id ^ SALT), self.nodes as u64) as u32
    }

    /// The node holding copy `r` of sample `id` (`r < replicas`).
    pub fn holder(&self, id: u64, r: u32) -> u32 {
        debug_assert!(r < self.replicas);
        ((self.owner(id) as u64 + r as u64) % self.nodes as u64) as u32
    }

    /// Whether `node` holds a copy of sample `id`.
    pub fn holds(&self, node: u32, id: u64) -> bool {
        let d = (node as u64 + self.nodes as u64 - self.owner(id) as u64) % self.nodes as u64;
        d < self.replicas as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frozen_values() {
        // If these change, every existing multi-node space is misplaced.
        let p = Placement::new(7, 1).unwrap();
        let owners: Vec<u32> = (0..10).map(|i| p.owner(i)).collect();
        assert_eq!(owners, vec![1, 2, 1, 4, 0, 1, 0, 6, 4, 3]);
    }

    #[test]
    fn each_sample_has_exactly_r_holders_and_load_is_balanced() {
        for (n, r) in [(1, 1), (3, 1), (3, 2), (5, 3), (4, 4)] {
            let p = Placement::new(n, r).unwrap();
            let mut per_node = vec![0u64; n as usize];
            for id in 0..30_000u64 {
                let holders: Vec<u32> = (0..n).filter(|&node| p.holds(node, id)).collect();
                assert_eq!(holders.len() as u32, r);
                assert!(holders.contains(&p.owner(id)));
                for c in 0..r {
                    assert!(holders.contains(&p.holder(id, c)));
                }
                per_node[p.owner(id) as usize] += 1;
            }
            let expect = 30_000.0 / n as f64;
            for c in per_node {
                assert!(
                    (c as f64 - expect).abs() < expect * 0.05,
                    "{n} nodes: {c} vs {expect}"
                );
            }
        }
    }

    #[test]
    fn bad_placements() {
        assert!(Placement::new(0, 1).is_err());
        assert!(Placement::new(3, 0).is_err());
        assert!(Placement::new(3, 4).is_err());
    }

    /// Past 64 copies the consumer's tried mask (`1 << r` in a u64) would
    /// overflow: refused with a message naming the limit.
    #[test]
    fn replicas_are_capped_at_64() {
        assert!(Placement::new(100, 64).is_ok());
        let e = Placement::new(100, 65).unwrap_err();
        assert!(matches!(e, Error::InvalidConfig(_)), "{e:?}");
        assert!(e.to_string().contains("at most 64"), "{e}");
    }
}
