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

use super::shared::{SPLIT_NONE, VIA_DISK, VIA_FAILOVER, VIA_PEER, VIA_SOURCE, VIA_TIER};

/// How many of the slowest peers [`StallCauses`] names.
pub const SLOWEST_PEERS: usize = 4;

/// The shares of a grant's time `total` (granted to arrived, the
/// consumer's clock) that its node spent reading (`read_us`) and sending
/// (the rest of `node_us`, its time at the node until its last frame was
/// posted), as 16-bit fractions in one word (read low, send high); the
/// rest of `total` is the link's (the GRANT's way there and the data's
/// back, socket buffers included). Node times are clamped to `total`:
/// the two clocks are different machines' and the node's round down.
pub(crate) fn phase_split(total: Duration, read_us: u64, node_us: u64) -> u32 {
    let total_us = total.as_micros() as u64;
    if total_us == 0 {
        return SPLIT_NONE;
    }
    let node = node_us.min(total_us);
    let read = read_us.min(node);
    let send = node - read;
    // Each share is at most 0xFFFF and the two together too: never
    // SPLIT_NONE.
    let rf = (read * 0xFFFF / total_us) as u32;
    let sf = (send * 0xFFFF / total_us) as u32;
    rf | (sf << 16)
}

/// A wait's shares (read, send, link) by its sample's split word.
fn shares(waited: Duration, split: u32) -> (Duration, Duration, Duration) {
    let read = waited.mul_f64((split & 0xFFFF) as f64 / 65535.0);
    let send = waited.mul_f64((split >> 16) as f64 / 65535.0);
    let link = waited.saturating_sub(read + send);
    (read, send, link)
}

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
    /// Waits charged to it (0: an empty entry): a sample waited for; for a
    /// rank attached to the node agent, a batch waited for in which the
    /// agent named this node.
    pub waits: u64,
    /// Its share of `stall` for samples it served as first holder, split
    /// by where each grant's time went, as [`StallCauses::peer_read`],
    /// `peer_send` and `peer_link` split `peers`.
    pub read: Duration,
    /// As `read`: at the node after the read.
    pub send: Duration,
    /// As `read`: the link.
    pub link: Duration,
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
    /// An attached rank: waits for batches the node agent had not
    /// published yet, beyond what the rank's loader inside the agent was
    /// itself waiting for (that part is charged to the causes above, from
    /// the batch slot's waits: docs/AGENT.md, "Batch slots"): the agent
    /// slow to publish, busy, or starved of CPU.
    pub agent: Duration,
    /// `peers` by where each waited-for sample's grant spent its time: the
    /// node reading it (queued for a staging slot or the disk), the node
    /// sending it (its read done, behind the connection's earlier frames),
    /// and the link (the grant's way there and the data's way back). Each
    /// wait is split in the proportions of its sample's grant. Only nodes
    /// that report their times in DATA frames (TCP; docs/PROTOCOL.md) are
    /// split: `peer_read + peer_send + peer_link <= peers`, the rest came
    /// over RDMA or from nodes that report none.
    pub peer_read: Duration,
    /// See `peer_read`: at the node after the read, behind the
    /// connection's earlier frames (a link slower than the node backs up
    /// into this and into `peer_read`; docs/PROTOCOL.md, "DATA").
    pub peer_send: Duration,
    /// See `peer_read`: the link.
    pub peer_link: Duration,
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
    per_node: Vec<PeerStall>,
    /// A loader inside the node agent: the agent's totals over every rank
    /// it serves, for its metrics (each wait added there too).
    totals: Option<std::sync::Arc<super::stall_totals::StallTotals>>,
    /// The nodes waited for since the last [`StallLedger::take_batch_peers`]
    /// (a loader inside the node agent sends them with each batch): at
    /// most [`BATCH_PEERS`] (node, time), a new node replacing the one
    /// waited for least when it waited longer.
    batch_peers: [(u32, Duration); BATCH_PEERS],
    /// Each `batch_peers` entry's wait split as `per_node`'s (read, send,
    /// link), and the batch's over every node (`causes`' `peer_read`,
    /// `peer_send`, `peer_link` since the last take).
    batch_splits: [[Duration; 3]; BATCH_PEERS],
    batch_split: [Duration; 3],
}

/// What [`StallLedger::take_batch_peers`] hands the node agent's feeder
/// for one batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct BatchPeers {
    /// The nodes waited for longest, longest first: (node, wait); a zero
    /// wait is an empty entry.
    pub(crate) peers: [(u32, Duration); BATCH_PEERS],
    /// Each entry's wait split into (read, send, link), where its node
    /// reported its times.
    pub(crate) splits: [[Duration; 3]; BATCH_PEERS],
    /// The batch's waits for peers split the same way, over every node.
    pub(crate) split: [Duration; 3],
}

/// Node `node`'s entry of `per_node`, the table grown to hold it.
fn node_entry(per_node: &mut Vec<PeerStall>, node: usize) -> &mut PeerStall {
    if node >= per_node.len() {
        let n = per_node.len();
        per_node.extend((n..=node).map(|k| PeerStall {
            node: k as u32,
            ..PeerStall::default()
        }));
    }
    &mut per_node[node]
}

/// How many nodes a batch's peer waits name (the segment's
/// `PEER_WAITS_PER_SLOT`).
pub(crate) const BATCH_PEERS: usize = 4;
const _: () = assert!(BATCH_PEERS == crate::agent::segment::PEER_WAITS_PER_SLOT as usize);

impl StallLedger {
    /// Charges a wait of `waited` for a sample that came `via`, a peer's
    /// by its grant's `split` ([`phase_split`]).
    pub(super) fn charge(&mut self, via: u32, split: u32, waited: Duration) {
        let c = &mut self.causes;
        // The cause's index in `stall_totals::CAUSES`, and the node.
        let (cause, node) = match via & !VIA_FAILOVER {
            VIA_DISK => {
                c.disk += waited;
                (0, None)
            }
            VIA_TIER => {
                c.tier += waited;
                (1, None)
            }
            VIA_SOURCE => {
                c.source += waited;
                (2, None)
            }
            v if v >= VIA_PEER => {
                let node = (v - VIA_PEER) as usize;
                let e = node_entry(&mut self.per_node, node);
                e.stall += waited;
                e.waits += 1;
                if via & VIA_FAILOVER != 0 {
                    c.failover += waited;
                    self.note_batch_peer(node as u32, waited, [Duration::ZERO; 3]);
                    (4, Some(node))
                } else {
                    c.peers += waited;
                    let mut phases = [Duration::ZERO; 3];
                    if split != SPLIT_NONE {
                        let (r, s, l) = shares(waited, split);
                        (c.peer_read, c.peer_send, c.peer_link) =
                            (c.peer_read + r, c.peer_send + s, c.peer_link + l);
                        (e.read, e.send, e.link) = (e.read + r, e.send + s, e.link + l);
                        phases = [r, s, l];
                        for (t, p) in self.batch_split.iter_mut().zip(phases) {
                            *t += p;
                        }
                    }
                    self.note_batch_peer(node as u32, waited, phases);
                    (3, Some(node))
                }
            }
            v => unreachable!("via {v} is no path"),
        };
        if let Some(t) = &self.totals {
            t.add(cause, node, waited);
        }
    }

    /// Adds `waited` (`phases` of it split into read, send and link) for
    /// node `node` to the batch's peer waits: O(4).
    fn note_batch_peer(&mut self, node: u32, waited: Duration, phases: [Duration; 3]) {
        let w = &mut self.batch_peers;
        if let Some(i) = w.iter().position(|e| e.0 == node && !e.1.is_zero()) {
            w[i].1 += waited;
            for (t, p) in self.batch_splits[i].iter_mut().zip(phases) {
                *t += p;
            }
            return;
        }
        // An empty entry, else the least waited for if this wait is longer
        // (what it held stays in the causes, unnamed by node).
        let (i, least) = w
            .iter()
            .enumerate()
            .min_by_key(|(_, e)| e.1)
            .map(|(i, e)| (i, e.1))
            .expect("BATCH_PEERS > 0");
        if least < waited {
            w[i] = (node, waited);
            self.batch_splits[i] = phases;
        }
    }

    /// The nodes waited for since the last call, longest first (time 0:
    /// empty), with the splits of their waits and of the batch's, and
    /// starts over.
    pub(super) fn take_batch_peers(&mut self) -> BatchPeers {
        let peers = std::mem::take(&mut self.batch_peers);
        let splits = std::mem::take(&mut self.batch_splits);
        let mut order: [usize; BATCH_PEERS] = std::array::from_fn(|i| i);
        order.sort_by_key(|&i| std::cmp::Reverse(peers[i].1));
        BatchPeers {
            peers: order.map(|i| peers[i]),
            splits: order.map(|i| splits[i]),
            split: std::mem::take(&mut self.batch_split),
        }
    }

    /// Adds every later wait to `totals` too (the node agent's metrics).
    pub(super) fn with_totals(
        totals: Option<std::sync::Arc<super::stall_totals::StallTotals>>,
    ) -> Self {
        StallLedger {
            totals,
            ..StallLedger::default()
        }
    }

    /// Charges a wait for the node agent's next batch to what the rank's
    /// loader inside the agent waited for while it made that batch
    /// (`agent`: its waits by cause since the previous batch, from the
    /// batch slot): each cause its share, scaled down when the agent
    /// waited longer than the rank did; what the agent did not wait for
    /// (it was slow to publish, or busy) is the agent's.
    ///
    /// `peers`: the nodes the agent's loader waited for longest while it
    /// made the batch, (node, µs) with 0 µs for an empty entry (layout
    /// version 7; all empty before): the share charged to `peers` and
    /// `failover` is split over them in proportion, into the slowest peers
    /// (what the agent's waits name no node for stays unsplit).
    ///
    /// `extras` (layout version 8; all zero before): where the agent's
    /// waits for peers went, in all and per entry of `peers`; the rank's
    /// share of `peers`, and each named node's, is split into
    /// `peer_read`/`peer_send`/`peer_link` in those proportions.
    pub(super) fn charge_agent(
        &mut self,
        waited: Duration,
        agent: [u32; 5],
        peers: [(u32, u32); BATCH_PEERS],
        extras: &crate::agent::segment::BatchExtras,
    ) {
        let total_us: u64 = agent.iter().map(|&w| u64::from(w)).sum();
        let waited_us = waited.as_micros().min(u128::from(u64::MAX)) as u64;
        let c = &mut self.causes;
        if total_us == 0 {
            c.agent += waited;
            return;
        }
        // Shares of the rank's wait: at most the agent's own waits.
        let charged_us = total_us.min(waited_us);
        let mut given = Duration::ZERO;
        let causes = [
            &mut c.disk,
            &mut c.tier,
            &mut c.source,
            &mut c.peers,
            &mut c.failover,
        ];
        let mut shares = [Duration::ZERO; 5];
        for ((cause, &w), share) in causes.into_iter().zip(&agent).zip(&mut shares) {
            *share = Duration::from_micros(
                (u128::from(w) * u128::from(charged_us) / u128::from(total_us)) as u64,
            );
            *cause += *share;
            given += *share;
        }
        c.agent += waited.saturating_sub(given);
        // The peers' share by phase, in the agent's proportions (over the
        // larger of its peers' wait and the split's sum: the parts never
        // sum past the share).
        let phases = |share: Duration, whole_us: u64, p: crate::agent::segment::PeerSplit| {
            let us = [p.read_us, p.send_us, p.link_us].map(u64::from);
            let over = whole_us.max(us.iter().sum());
            if share.is_zero() || over == 0 {
                return [Duration::ZERO; 3];
            }
            us.map(|u| share.mul_f64(u as f64 / over as f64))
        };
        let [r, s, l] = phases(shares[3], u64::from(agent[3]), extras.split);
        (c.peer_read, c.peer_send, c.peer_link) =
            (c.peer_read + r, c.peer_send + s, c.peer_link + l);
        // The peers' and failovers' share, by node: each named node its
        // part of what the agent waited for the two together.
        let by_node = shares[3] + shares[4];
        // Over the larger of the two: the parts never sum past the share
        // (µs rounding, or an agent whose words say more than its waits).
        let named_us: u64 = peers.iter().map(|e| u64::from(e.1)).sum();
        let agent_us = (u64::from(agent[3]) + u64::from(agent[4])).max(named_us);
        if by_node.is_zero() || agent_us == 0 {
            return;
        }
        for (&(node, us), &split) in peers.iter().zip(&extras.peers).filter(|e| e.0 .1 > 0) {
            let part = by_node.mul_f64(u64::from(us) as f64 / agent_us as f64);
            let e = node_entry(&mut self.per_node, node as usize);
            e.stall += part;
            e.waits += 1;
            let [r, s, l] = phases(part, u64::from(us), split);
            (e.read, e.send, e.link) = (e.read + r, e.send + s, e.link + l);
        }
    }

    /// The waits charged so far to disk, tier, source, peers and failover
    /// (O(1): the node agent's feeder reads it at every publish).
    pub(super) fn by_cause(&self) -> [Duration; 5] {
        let c = &self.causes;
        [c.disk, c.tier, c.source, c.peers, c.failover]
    }

    /// The causes, with the slowest peers filled in (O(nodes): for
    /// `stats()`, not per batch).
    pub(super) fn causes(&self) -> StallCauses {
        let mut c = self.causes;
        for &e in &self.per_node {
            if e.waits == 0 {
                continue;
            }
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
            .filter(|e| e.waits > 0)
            .copied()
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::loader::shared::via_peer;

    const MS: Duration = Duration::from_millis(1);
    const NO_PEERS: [(u32, u32); BATCH_PEERS] = [(0, 0); BATCH_PEERS];

    #[test]
    fn every_wait_lands_in_one_cause_and_the_slowest_peers_are_sorted() {
        let mut l = StallLedger::default();
        l.charge(VIA_DISK, SPLIT_NONE, 3 * MS);
        l.charge(VIA_TIER, SPLIT_NONE, MS);
        l.charge(VIA_SOURCE, SPLIT_NONE, 5 * MS);
        for (node, ms) in [(7u32, 2u32), (2, 9), (7, 4), (11, 1), (3, 6), (5, 5)] {
            l.charge(via_peer(node, node == 3), SPLIT_NONE, ms * MS);
        }
        l.charge_agent(2 * MS, [0; 5], NO_PEERS, &Default::default());
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

    /// An attached rank's wait goes to what the agent's loader waited for
    /// while it made the batch (scaled down to the rank's wait), the rest
    /// to the agent.
    #[test]
    fn an_attached_wait_is_charged_to_what_the_agent_waited_for() {
        let mut l = StallLedger::default();
        // The agent waited 6 ms on peers and 2 on disk; the rank 10 ms.
        l.charge_agent(
            10 * MS,
            [2_000, 0, 0, 6_000, 0],
            NO_PEERS,
            &Default::default(),
        );
        let c = l.causes();
        assert_eq!((c.disk, c.peers, c.agent), (2 * MS, 6 * MS, 2 * MS));
        // The agent waited longer than the rank (it was ahead): the rank's
        // 4 ms split in the same proportions, none to the agent.
        let mut l = StallLedger::default();
        l.charge_agent(
            4 * MS,
            [0, 0, 3_000, 0, 9_000],
            NO_PEERS,
            &Default::default(),
        );
        let c = l.causes();
        assert_eq!(
            (c.source, c.failover, c.agent),
            (MS, 3 * MS, Duration::ZERO)
        );
        // Nothing waited for inside the agent: all the agent's.
        l.charge_agent(5 * MS, [0; 5], NO_PEERS, &Default::default());
        assert_eq!(l.causes().agent, 5 * MS);
        assert_eq!(l.by_cause()[4], 3 * MS);
    }

    #[test]
    fn a_peer_wait_is_split_as_its_grant_spent_its_time() {
        // 100 ms granted to arrived: 60 reading, 10 more at the node, the
        // rest (30) on the link.
        let split = phase_split(100 * MS, 60_000, 70_000);
        let mut l = StallLedger::default();
        l.charge(via_peer(2, false), split, 20 * MS);
        // A node that reports nothing: in `peers`, not split.
        l.charge(via_peer(2, false), SPLIT_NONE, 5 * MS);
        // A failover is not a peer's phase.
        l.charge(via_peer(2, true), split, 7 * MS);
        let c = l.causes();
        let near = |d: Duration, ms: f64| (d.as_secs_f64() * 1e3 - ms).abs() < 0.01;
        assert!(near(c.peer_read, 12.0), "{c:?}");
        assert!(near(c.peer_send, 2.0), "{c:?}");
        assert!(near(c.peer_link, 6.0), "{c:?}");
        assert_eq!(c.peer_read + c.peer_send + c.peer_link, 20 * MS);
        assert_eq!((c.peers, c.failover), (25 * MS, 7 * MS));
        let p = c.slowest_peers[0];
        assert_eq!((p.node, p.stall, p.waits), (2, 32 * MS, 3));
        assert_eq!(
            (p.read, p.send, p.link),
            (c.peer_read, c.peer_send, c.peer_link)
        );
        // Node times past the consumer's (another clock) are clamped: the
        // whole wait is the node's, the link gets none.
        let (r, s, k) = shares(10 * MS, phase_split(MS, 5_000, 9_000));
        assert!(
            r + s <= 10 * MS && k < Duration::from_micros(2),
            "{r:?} {s:?} {k:?}"
        );
        assert_eq!(phase_split(Duration::ZERO, 1, 1), SPLIT_NONE);
        assert_ne!(phase_split(MS, 1000, 1000), SPLIT_NONE);
    }

    /// The nodes a batch's waits name: the 4 waited for longest, longest
    /// first; the rank splits its peers' share over them.
    #[test]
    fn a_batch_names_the_nodes_waited_for_longest_and_the_rank_splits_by_them() {
        let mut a = StallLedger::default();
        for (node, ms) in [
            (5u32, 1u32),
            (2, 9),
            (7, 3),
            (5, 2),
            (9, 4),
            (11, 1),
            (4, 8),
        ] {
            a.charge(via_peer(node, node == 9), SPLIT_NONE, ms * MS);
        }
        a.charge(VIA_DISK, SPLIT_NONE, 50 * MS);
        let w = a.take_batch_peers().peers;
        // Full at 5, 2, 7, 9: 11 (1 ms) waited less than any, so stays out;
        // 4 (8 ms) replaces the first of the least (5 and 7, 3 ms each).
        assert_eq!(w, [(2, 9 * MS), (4, 8 * MS), (9, 4 * MS), (7, 3 * MS)]);
        assert_eq!(a.take_batch_peers(), BatchPeers::default(), "taken");

        // The rank waited 12 ms; the agent 24 ms on peers and failovers
        // together and 0 elsewhere: the rank's 12 ms split 9:8:4:3 over
        // those nodes (the agent's 3 ms for 7 and 11 unnamed).
        let mut r = StallLedger::default();
        let peers = [(2, 9_000), (4, 8_000), (9, 4_000), (5, 3_000)];
        r.charge_agent(
            12 * MS,
            [0, 0, 0, 20_000, 4_000],
            peers,
            &Default::default(),
        );
        let c = r.causes();
        assert_eq!(
            (c.peers, c.failover, c.agent),
            (10 * MS, 2 * MS, Duration::ZERO)
        );
        let top: Vec<(u32, u64)> = c
            .slowest_peers
            .iter()
            .map(|p| (p.node, p.stall.as_micros() as u64))
            .collect();
        assert_eq!(top, [(2, 4_500), (4, 4_000), (9, 2_000), (5, 1_500)]);
        assert!(c.slowest_peers.iter().all(|p| p.waits == 1));
    }

    /// The phases cross the agent's boundary: a batch's take carries the
    /// split of its peers' waits, in all and per named node, and the rank
    /// charges its share of `peers` in the same proportions (failovers
    /// unsplit), never past that share.
    #[test]
    fn a_batch_carries_its_peer_phases_and_the_rank_splits_by_them() {
        let mut a = StallLedger::default();
        // Node 2: 4 ms read, 2 ms send, 2 ms link of an 8 ms wait; node 4:
        // 2 ms unsplit (RDMA) and 2 ms failed over.
        a.charge(
            via_peer(2, false),
            phase_split(8 * MS, 4_000, 6_000),
            8 * MS,
        );
        a.charge(via_peer(4, false), SPLIT_NONE, 2 * MS);
        a.charge(via_peer(4, true), SPLIT_NONE, 2 * MS);
        let b = a.take_batch_peers();
        assert_eq!(b.peers[..2], [(2, 8 * MS), (4, 4 * MS)]);
        let near = |d: Duration, ms: u32| d.abs_diff(ms * MS) < Duration::from_micros(300);
        let [r, s, l] = b.split;
        assert!(near(r, 4) && near(s, 2) && near(l, 2), "{b:?}");
        assert_eq!(b.splits[0], b.split, "node 2 is the whole split");
        assert_eq!(b.splits[1], [Duration::ZERO; 3]);
        assert_eq!(a.take_batch_peers(), BatchPeers::default(), "taken");

        // The rank waited 6 ms of the agent's 12 (10 peers, 2 failover):
        // peers 5 ms, split 4:2:2 of the agent's 10 ms (the rest unsplit).
        use crate::agent::segment::{BatchExtras, PeerSplit};
        let ps = |r, s, l| PeerSplit {
            read_us: r,
            send_us: s,
            link_us: l,
        };
        let extras = BatchExtras {
            split: ps(4_000, 2_000, 2_000),
            peers: [
                ps(4_000, 2_000, 2_000),
                ps(0, 0, 0),
                ps(0, 0, 0),
                ps(0, 0, 0),
            ],
            ..Default::default()
        };
        let mut r = StallLedger::default();
        let peers = [(2, 8_000), (4, 4_000), (0, 0), (0, 0)];
        r.charge_agent(6 * MS, [0, 0, 0, 10_000, 2_000], peers, &extras);
        let c = r.causes();
        assert_eq!((c.peers, c.failover), (5 * MS, MS));
        assert_eq!((c.peer_read, c.peer_send, c.peer_link), (2 * MS, MS, MS));
        // Node 2 gets 8/12 of the 6 ms, split 4:2:2 of its 8; node 4 none.
        let p2 = c.slowest_peers.iter().find(|p| p.node == 2).unwrap();
        assert_eq!(
            (p2.stall, p2.read, p2.send, p2.link),
            (4 * MS, 2 * MS, MS, MS)
        );
        let p4 = c.slowest_peers.iter().find(|p| p.node == 4).unwrap();
        assert_eq!(
            (p4.stall, p4.read + p4.send + p4.link),
            (2 * MS, Duration::ZERO)
        );
        // An agent whose split says more than its waits: capped at the share.
        let mut r = StallLedger::default();
        let big = BatchExtras {
            split: ps(u32::MAX, u32::MAX, u32::MAX),
            ..Default::default()
        };
        r.charge_agent(6 * MS, [0, 0, 0, 10_000, 0], [(0, 0); BATCH_PEERS], &big);
        let c = r.causes();
        assert!(c.peer_read + c.peer_send + c.peer_link <= c.peers, "{c:?}");
    }

    #[test]
    fn fewer_peers_than_slots_leave_empty_entries() {
        let mut l = StallLedger::default();
        l.charge(via_peer(1, false), SPLIT_NONE, MS);
        let c = l.causes();
        assert_eq!(c.slowest_peers[0].node, 1);
        assert!(c.slowest_peers[1..].iter().all(|p| p.waits == 0));
    }
}
