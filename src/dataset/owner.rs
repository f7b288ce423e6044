//! The owner function: which nodes hold sample `i` of an `N`-node space with
//! `R` copies. It is part of the protocol (every node and every consumer must
//! agree without talking), so it is frozen and documented in docs/FORMAT.md.
//! Two functions exist; a space's manifest says which one placed it:
//!
//! ```text
//! scaled (manifest version 1, spaces preloaded before jump existed):
//!   owner(i) = floor(mix64(i XOR 0x6b73_7065_6564_6f77) * N / 2^64)
//! jump (manifest version 2, what preload writes now):
//!   owner(i) = jump(mix64(i XOR 0x6b73_7065_6564_6f77), N)
//! both:
//!   holder(i, r) = (owner(i) + r) mod N        for r in 0..R
//! ```
//!
//! `mix64` is the SplitMix64 finalizer (`crate::hash::mix64`); the salt is
//! ASCII "kspeedow". `r = 0` is the owner, `r >= 1` the replicas. Hashing
//! spreads consecutive ids (one class folder, one tar shard) over all nodes;
//! consecutive replicas keep the computation O(1) per sample.
//!
//! Why jump (Lamping & Veach 2014, "A Fast, Minimal Memory, Consistent Hash
//! Algorithm") rather than rendezvous hashing: nodes are numbered `0..N`
//! already (the cluster file's order), jump moves exactly the minimal
//! fraction when `N` grows or shrinks at the end (1/(N+1) of owners for
//! one more node), needs no table, and costs about ln(N) steps per sample,
//! where rendezvous costs N hash evaluations per sample: 512 per lookup on
//! the consumer's grant path and in every node's layout pass. What jump
//! cannot do, rendezvous could: remove a node from the middle without
//! renumbering. kspeed's nodes are replaced in place (same index, new
//! machine), so that case is a repair, not a resize. The scaled function
//! moves about half of the owners for one more node (floor(Nx) and
//! floor((N+1)x) agree on half of [0, 1)).
//!
//! Replicas stay consecutive (`owner + r mod N`), so a resize also moves
//! the wrapped copies of the last R-1 nodes' samples: about (R-1)/N of the
//! samples move one copy beyond the minimum (examples/scale_model.rs
//! measures it).

use crate::error::{Error, Result};
use crate::hash::{mix64, reduce};

const SALT: u64 = 0x6b73_7065_6564_6f77;
/// Salt of the failover order's hash (ASCII "kspfailo"): another salt than
/// the owner's, so the copy a sample fails over to does not correlate with
/// which node owns it.
const FAILOVER_SALT: u64 = 0x6b73_7066_6169_6c6f;

/// Most copies of a sample: the consumer marks the replicas it tried in a
/// 64-bit mask (bit r), so a 65th could not be told apart.
pub(crate) const MAX_REPLICAS: u32 = 64;

/// Which frozen function picks a sample's owner (docs/FORMAT.md, "Owner
/// function").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OwnerFn {
    /// `floor(mix64(i ^ salt) * N / 2^64)`: the function of every space
    /// preloaded before jump existed (manifest version 1). About half of
    /// the owners change when a node is added.
    Scaled,
    /// Jump consistent hash of `mix64(i ^ salt)` (manifest version 2, the
    /// default): only the samples that must move change owner.
    Jump,
}

impl OwnerFn {
    /// The number the manifest, journal and WELCOME carry (0 scaled, 1 jump).
    pub fn code(self) -> u32 {
        match self {
            OwnerFn::Scaled => 0,
            OwnerFn::Jump => 1,
        }
    }

    /// The function a code names, if any.
    pub fn from_code(code: u32) -> Option<OwnerFn> {
        match code {
            0 => Some(OwnerFn::Scaled),
            1 => Some(OwnerFn::Jump),
            _ => None,
        }
    }

    /// Its name in messages and `inspect`.
    pub fn name(self) -> &'static str {
        match self {
            OwnerFn::Scaled => "scaled",
            OwnerFn::Jump => "jump",
        }
    }
}

/// Jump consistent hash (Lamping & Veach 2014) in integer arithmetic:
/// the paper's `(b + 1) * (2^31 / ((key >> 33) + 1))` in doubles is here
/// `floor((b + 1) * 2^31 / ((key >> 33) + 1))` in integers, which every
/// language computes alike (the two differ in rare rounding cases, so the
/// integer form is the frozen one). `(b + 1) <= 2^32`, so the shifted value
/// fits in 64 bits. `n` must be non-zero.
#[inline]
pub const fn jump(mut key: u64, n: u32) -> u32 {
    let (mut b, mut j) = (0u64, 0u64);
    while j < n as u64 {
        b = j;
        key = key.wrapping_mul(2_862_933_555_777_941_757).wrapping_add(1);
        j = ((b + 1) << 31) / ((key >> 33) + 1);
    }
    b as u32
}

/// How a space's samples are spread over nodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Placement {
    /// Number of nodes.
    pub nodes: u32,
    /// Copies of each sample (1 = no replica), at most `nodes`.
    pub replicas: u32,
    /// The owner function.
    pub owner_fn: OwnerFn,
}

impl Placement {
    /// One node holding everything.
    pub const SINGLE: Placement = Placement {
        nodes: 1,
        replicas: 1,
        owner_fn: OwnerFn::Jump,
    };

    /// Checks the numbers; the owner function is [`OwnerFn::Jump`], the one
    /// new spaces get.
    pub fn new(nodes: u32, replicas: u32) -> Result<Self> {
        Placement::with_fn(OwnerFn::Jump, nodes, replicas)
    }

    /// Checks the numbers, with the given owner function.
    pub fn with_fn(owner_fn: OwnerFn, nodes: u32, replicas: u32) -> Result<Self> {
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
        Ok(Placement {
            nodes,
            replicas,
            owner_fn,
        })
    }

    /// The owner (copy 0) of sample `id`.
    #[inline]
    pub fn owner(&self, id: u64) -> u32 {
        let h = mix64(id ^ SALT);
        match self.owner_fn {
            OwnerFn::Scaled => reduce(h, self.nodes as u64) as u32,
            OwnerFn::Jump => jump(h, self.nodes),
        }
    }

    /// The node holding copy `r` of sample `id` (`r < replicas`).
    pub fn holder(&self, id: u64, r: u32) -> u32 {
        debug_assert!(r < self.replicas);
        ((self.owner(id) as u64 + r as u64) % self.nodes as u64) as u32
    }

    /// The copy a consumer tries `k`-th for sample `id` (`k < replicas`):
    /// the owner (copy 0) first, then the replicas in an order rotated by
    /// a hash of the id,
    ///
    /// ```text
    /// try_copy(i, 0) = 0
    /// try_copy(i, k) = 1 + (k - 1 + mix64(i XOR 0x6b73_7066_6169_6c6f) mod (R - 1)) mod (R - 1)
    /// ```
    ///
    /// so the samples of a node that failed spread evenly over their
    /// surviving copies: in copy order they all went to the next node,
    /// which then pushed 1.83-1.96x its normal load while the other copies
    /// idled (examples/scale_model.rs: the busiest survivor at 3 copies is
    /// 1.42-1.50x with this order). With two nodes down the rotation is
    /// not even (at 4 copies, owner and copy 1 down, copy 2 gets two
    /// thirds); one node down is the case it is for. It is the consumer's choice, not part
    /// of the placement: nodes never depend on it.
    #[inline]
    pub fn try_copy(&self, id: u64, k: u32) -> u32 {
        debug_assert!(k < self.replicas);
        if k == 0 || self.replicas <= 2 {
            return k;
        }
        let rest = self.replicas as u64 - 1;
        let turn = mix64(id ^ FAILOVER_SALT) % rest;
        1 + ((k as u64 - 1 + turn) % rest) as u32
    }

    /// Whether `node` holds a copy of sample `id` (never for a node past
    /// the last: a resize asks about nodes of another layout).
    pub fn holds(&self, node: u32, id: u64) -> bool {
        if node >= self.nodes {
            return false;
        }
        let d = (node as u64 + self.nodes as u64 - self.owner(id) as u64) % self.nodes as u64;
        d < self.replicas as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn try_copy_starts_with_the_owner_and_spreads_the_rest() {
        for replicas in 1..=5u32 {
            let p = Placement::new(9, replicas).unwrap();
            // Tries per (k, copy) over many ids.
            let mut seen = vec![vec![0u64; replicas as usize]; replicas as usize];
            for id in 0..6000u64 {
                let order: Vec<u32> = (0..replicas).map(|k| p.try_copy(id, k)).collect();
                assert_eq!(order[0], 0, "the owner first");
                let mut sorted = order.clone();
                sorted.sort_unstable();
                assert_eq!(sorted, (0..replicas).collect::<Vec<_>>(), "each copy once");
                for (k, &r) in order.iter().enumerate() {
                    seen[k][r as usize] += 1;
                }
            }
            // The second try is each replica for about 1/(R-1) of the ids.
            if replicas >= 2 {
                let even = 6000 / (replicas as u64 - 1);
                for r in 1..replicas as usize {
                    let n = seen[1][r];
                    assert!(
                        n * 10 > even * 9 && n * 10 < even * 11,
                        "R={replicas}: {:?}",
                        seen[1]
                    );
                }
            }
        }
        // Documented in docs/PROTOCOL.md ("Failover order"); a Python port
        // of the formula there gave the same values.
        let p = Placement::new(7, 3).unwrap();
        let second: Vec<u32> = (0..10).map(|i| p.try_copy(i, 1)).collect();
        assert_eq!(second, vec![2, 2, 1, 2, 1, 2, 1, 1, 2, 2]);
    }

    #[test]
    fn frozen_values() {
        // If these change, every existing multi-node space is misplaced
        // (docs/FORMAT.md gives the same values; a Python port of both
        // functions computed them independently).
        let p = Placement::with_fn(OwnerFn::Scaled, 7, 1).unwrap();
        let owners: Vec<u32> = (0..10).map(|i| p.owner(i)).collect();
        assert_eq!(owners, vec![1, 2, 1, 4, 0, 1, 0, 6, 4, 3]);
        let p = Placement::new(7, 1).unwrap();
        let owners: Vec<u32> = (0..10).map(|i| p.owner(i)).collect();
        assert_eq!(owners, vec![4, 2, 0, 1, 0, 3, 2, 5, 6, 0]);
        let p = Placement::new(1000, 1).unwrap();
        let owners: Vec<u32> = (0..10).map(|i| p.owner(i)).collect();
        assert_eq!(
            owners,
            vec![299, 368, 125, 154, 538, 411, 299, 874, 522, 989]
        );
        // The widest node count: (b + 1) << 31 must not overflow.
        let raw: Vec<u32> = (0..5).map(|k| jump(k, u32::MAX)).collect();
        assert_eq!(
            raw,
            vec![2147483648, 3094789146, 2616496271, 1315363102, 1713570006]
        );
    }

    #[test]
    fn codes_round_trip() {
        for f in [OwnerFn::Scaled, OwnerFn::Jump] {
            assert_eq!(OwnerFn::from_code(f.code()), Some(f));
        }
        assert_eq!(OwnerFn::from_code(2), None);
    }

    #[test]
    fn each_sample_has_exactly_r_holders_and_load_is_balanced() {
        for f in [OwnerFn::Scaled, OwnerFn::Jump] {
            for (n, r) in [(1, 1), (3, 1), (3, 2), (5, 3), (4, 4)] {
                let p = Placement::with_fn(f, n, r).unwrap();
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
                        "{f:?} {n} nodes: {c} vs {expect}"
                    );
                }
            }
        }
    }

    /// Jump moves only what must move: growing from n to m > n nodes, an
    /// owner changes only to one of the new nodes, about (m - n) / m of
    /// them; shrinking, only the samples of the removed nodes move. The
    /// scaled function moves about half when n grows by one.
    #[test]
    fn jump_moves_only_the_minimum_and_scaled_moves_about_half() {
        const IDS: u64 = 200_000;
        for (n, m) in [(3u32, 4u32), (4, 2), (64, 65), (512, 448), (1, 2)] {
            let (a, b) = (Placement::new(n, 1).unwrap(), Placement::new(m, 1).unwrap());
            let mut moved = 0u64;
            for id in 0..IDS {
                let (o, p) = (a.owner(id), b.owner(id));
                if o != p {
                    moved += 1;
                    if m > n {
                        assert!(p >= n, "{n}->{m}: sample {id} moved {o}->{p}");
                    } else {
                        assert!(o >= m, "{n}->{m}: sample {id} moved {o}->{p}");
                    }
                }
            }
            let want = (m.abs_diff(n) as f64 / m.max(n) as f64) * IDS as f64;
            assert!(
                (moved as f64 - want).abs() < want * 0.1 + 50.0,
                "{n}->{m}: moved {moved}, expected about {want}"
            );
        }
        let (a, b) = (
            Placement::with_fn(OwnerFn::Scaled, 64, 1).unwrap(),
            Placement::with_fn(OwnerFn::Scaled, 65, 1).unwrap(),
        );
        let moved = (0..IDS).filter(|&id| a.owner(id) != b.owner(id)).count();
        // floor(64x) = floor(65x) on half of [0, 1): sum of (64 - k) / 4160.
        let half = IDS as f64 / 2.0;
        assert!(
            (moved as f64 - half).abs() < half * 0.05,
            "scaled 64->65 moved {moved}"
        );
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
