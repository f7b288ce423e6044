//! Stall time charged to its cause: every wait of a caller in
//! `next_batch` (and its kin) is charged to the sample it waited for and
//! the path that sample came by (local disk, the memory tier, the source,
//! which peer node, a failover and the holder that failed), or to the node
//! agent for an attached rank.
//!
//! Only the consumer writes the ledger (one branch and an add per wait,
//! nothing per sample that was ready); the path comes from the `via` word
//! the publisher stored beside the sample's ready word.

use std::time::Duration;

use super::shared::{VIA_DISK, VIA_FAILOVER, VIA_PEER, VIA_SOURCE, VIA_TIER};

/// How many of the slowest peers [`StallCauses`] names.
pub const SLOWEST_PEERS: usize = 4;

/// One node's share of the stall: samples it served as their first holder,
/// and samples that failed over from it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct PeerStall {
    /// The node's index in the cluster.
    pub node: u32,
    /// Time the caller waited for samples this node served, or that
    /// failed over from it.
    pub stall: Duration,
    /// Waits charged to it (a sample waited for; 0: an empty entry).
    pub waits: u64,
}

/// Where the time the caller waited ([`super::Stats::stall`]) went, each
/// wait charged to the sample waited for and how it came. The causes are
/// disjoint: `disk + tier + source + peers + failover + agent` is the
/// whole stall.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct StallCauses {
    /// Samples read from this node's disk (the space's extents, or source
    /// files read directly).
    pub disk: Duration,
    /// Samples copied from the memory tier (or handed out in place).
    pub tier: Duration,
    /// Samples whose path is the source: a partial space's that no node
    /// holds, or every sample of a bucket read directly.
    pub source: Duration,
    /// Samples other nodes served as their first holder, all together
    /// ([`StallCauses::slowest_peers`] and [`super::Loader::stall_by_peer`]
    /// split it by node).
    pub peers: Duration,
    /// Samples that failed over: their first holder (or this node's own
    /// disk) failed, was gone, stopped or was demoted, and another replica
    /// or the source served them. Charged by node to the holder that
    /// failed, in `slowest_peers` and `stall_by_peer` too.
    pub failover: Duration,
    /// An attached rank: batches the node agent had not published yet.
    pub agent: Duration,
    /// The nodes with the most stall (`peers` and `failover` by node), most
    /// first; entries with `waits == 0` are empty.
    pub slowest_peers: [PeerStall; SLOWEST_PEERS],
}

/// The consumer's ledger: the causes and each peer's share.
#[derive(Debug, Clone, Default)]
pub(super) struct StallLedger {
    causes: StallCauses,
    /// Indexed by node: grown once the first time a node is charged
    /// (bounded by the cluster's node count), never per wait after that.
    per_node: Vec<(Duration, u64)>,
}

impl StallLedger {
    /// Charges a wait of `waited` for a sample that came `via`.
    pub(super) fn charge(&mut self, via: u32, waited: Duration) {
        let c = &mut self.causes;
        match via & !VIA_FAILOVER {
            VIA_DISK => c.disk += waited,
            VIA_TIER => c.tier += waited,
            VIA_SOURCE => c.source += waited,
            v if v >= VIA_PEER => {
                if via & VIA_FAILOVER != 0 {
                    c.failover += waited;
                } else {
                    c.peers += waited;
                }
                let node = (v - VIA_PEER) as usize;
                if node >= self.per_node.len() {
                    self.per_node.resize(node + 1, (Duration::ZERO, 0));
                }
                let e = &mut self.per_node[node];
                e.0 += waited;
                e.1 += 1;
            }
            v => unreachable!("via {v} is no path"),
        }
    }

    /// Charges a wait for the node agent's next batch.
    pub(super) fn charge_agent(&mut self, waited: Duration) {
        self.causes.agent += waited;
    }

    /// The causes, with the slowest peers filled in (O(nodes): for
    /// `stats()`, not per batch).
    pub(super) fn causes(&self) -> StallCauses {
        let mut c = self.causes;
        for (node, &(stall, waits)) in self.per_node.iter().enumerate() {
            if waits == 0 {
                continue;
            }
            let e = PeerStall {
                node: node as u32,
                stall,
                waits,
            };
            // Insertion into a sorted array of SLOWEST_PEERS.
            if let Some(at) = c
                .slowest_peers
                .iter()
                .position(|s| s.waits == 0 || s.stall < e.stall)
            {
                c.slowest_peers.copy_within(at..SLOWEST_PEERS - 1, at + 1);
                c.slowest_peers[at] = e;
            }
        }
        c
    }

    /// Every peer charged, by node index.
    pub(super) fn by_peer(&self) -> Vec<PeerStall> {
        self.per_node
            .iter()
            .enumerate()
            .filter(|(_, e)| e.1 > 0)
            .map(|(node, &(stall, waits))| PeerStall {
                node: node as u32,
                stall,
                waits,
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::loader::shared::via_peer;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn every_wait_lands_in_one_cause_and_the_slowest_peers_are_sorted() {
        let mut l = StallLedger::default();
        l.charge(VIA_DISK, 3 * MS);
        l.charge(VIA_TIER, MS);
        l.charge(VIA_SOURCE, 5 * MS);
        for (node, ms) in [(7u32, 2u32), (2, 9), (7, 4), (11, 1), (3, 6), (5, 5)] {
            l.charge(via_peer(node, node == 3), ms * MS);
        }
        l.charge_agent(2 * MS);
        let c = l.causes();
        assert_eq!(
            (c.disk, c.tier, c.source, c.agent),
            (3 * MS, MS, 5 * MS, 2 * MS)
        );
        assert_eq!(c.peers, 21 * MS);
        assert_eq!(c.failover, 6 * MS, "node 3's");
        let top: Vec<(u32, Duration, u64)> = c
            .slowest_peers
            .iter()
            .map(|p| (p.node, p.stall, p.waits))
            .collect();
        assert_eq!(
            top,
            // Ties in node order.
            [
                (2, 9 * MS, 1),
                (3, 6 * MS, 1),
                (7, 6 * MS, 2),
                (5, 5 * MS, 1)
            ]
        );
        assert_eq!(l.by_peer().len(), 5);
        assert_eq!(
            l.by_peer().iter().map(|p| p.stall).sum::<Duration>(),
            c.peers + c.failover
        );
    }

    #[test]
    fn fewer_peers_than_slots_leave_empty_entries() {
        let mut l = StallLedger::default();
        l.charge(via_peer(1, false), MS);
        let c = l.causes();
        assert_eq!(c.slowest_peers[0].node, 1);
        assert!(c.slowest_peers[1..].iter().all(|p| p.waits == 0));
    }
}
