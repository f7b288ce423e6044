//! The node agent's waits, summed over every rank it serves, for its
//! Prometheus metrics (docs/AGENT.md, "Metrics"): each rank's loader inside
//! the agent charges its ledger (`stall_causes.rs`) and, with one relaxed
//! add per wait, these totals, which a scrape reads from another thread.
//! No lock and no allocation per wait (a few relaxed adds): the per-node
//! table is sized from the cluster when the agent starts.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Causes in the order of [`super::StallCauses`]' first five fields and of
/// the batch slot's waits: disk, tier, source, peers, failover.
pub(crate) const CAUSES: [&str; 5] = ["disk", "tier", "source", "peers", "failover"];

/// One node's share: what the agent's loaders waited for samples it served
/// as first holder or that failed over from it.
#[derive(Debug, Default)]
struct NodeTotals {
    stall_ns: AtomicU64,
    waits: AtomicU64,
}

/// One node's figures as a scrape reads them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct NodeWait {
    pub(crate) node: u32,
    pub(crate) stall: Duration,
    pub(crate) waits: u64,
}

/// Waits by cause and by node, added by every rank's loader in the agent
/// (relaxed atomics: each figure is a sum, read whole by a scrape).
#[derive(Debug)]
pub(crate) struct StallTotals {
    causes_ns: [AtomicU64; 5],
    waits: [AtomicU64; 5],
    /// By node index: `nodes` entries (the cluster's size at start).
    nodes: Box<[NodeTotals]>,
    /// A wait for a node beyond `nodes` was logged.
    beyond_said: std::sync::atomic::AtomicBool,
}

impl StallTotals {
    /// Totals for a cluster of `nodes` nodes (0: no per-node table).
    pub(crate) fn new(nodes: usize) -> Self {
        StallTotals {
            causes_ns: Default::default(),
            waits: Default::default(),
            nodes: (0..nodes).map(|_| NodeTotals::default()).collect(),
            beyond_said: Default::default(),
        }
    }

    /// Adds one wait of `waited` charged to cause `cause` (an index of
    /// [`CAUSES`]) and, for a peer's sample or a failover from one, to
    /// node `node`.
    pub(crate) fn add(&self, cause: usize, node: Option<usize>, waited: Duration) {
        let ns = u64::try_from(waited.as_nanos()).unwrap_or(u64::MAX);
        self.causes_ns[cause].fetch_add(ns, Ordering::Relaxed);
        self.waits[cause].fetch_add(1, Ordering::Relaxed);
        if let Some(n) = node {
            match self.nodes.get(n) {
                Some(e) => {
                    e.stall_ns.fetch_add(ns, Ordering::Relaxed);
                    e.waits.fetch_add(1, Ordering::Relaxed);
                }
                // A space laid out for more nodes than the node list names
                // (a layout from before a resize): its samples of the
                // nodes not listed come from the source, charged to a node
                // the table has no row for. Counted by cause above; said
                // once, not per wait.
                None => {
                    if !self.beyond_said.swap(true, Ordering::Relaxed) {
                        log::warn!(
                            "agent metrics: waits for node {n}, which the node list of {} nodes does not name (is the space laid out for another cluster?); counted by cause, not by node",
                            self.nodes.len()
                        );
                    }
                }
            }
        }
    }

    /// Per cause of [`CAUSES`]: (time waited, waits).
    pub(crate) fn causes(&self) -> [(Duration, u64); 5] {
        std::array::from_fn(|i| {
            (
                Duration::from_nanos(self.causes_ns[i].load(Ordering::Relaxed)),
                self.waits[i].load(Ordering::Relaxed),
            )
        })
    }

    /// The `k` nodes waited for longest, longest first (ties by node
    /// index); nodes never waited for are left out. O(nodes): for a scrape.
    pub(crate) fn slowest(&self, k: usize) -> Vec<NodeWait> {
        let mut all: Vec<NodeWait> = self
            .nodes
            .iter()
            .enumerate()
            .filter_map(|(i, e)| {
                let waits = e.waits.load(Ordering::Relaxed);
                (waits > 0).then(|| NodeWait {
                    node: i as u32,
                    stall: Duration::from_nanos(e.stall_ns.load(Ordering::Relaxed)),
                    waits,
                })
            })
            .collect();
        all.sort_by(|a, b| b.stall.cmp(&a.stall).then(a.node.cmp(&b.node)));
        all.truncate(k);
        all
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waits_sum_by_cause_and_the_slowest_nodes_come_first() {
        let t = StallTotals::new(4);
        let ms = Duration::from_millis;
        t.add(0, None, ms(3));
        t.add(3, Some(2), ms(50));
        t.add(3, Some(1), ms(10));
        t.add(4, Some(1), ms(45));
        t.add(3, Some(2), ms(1));
        let c = t.causes();
        assert_eq!(c[0], (ms(3), 1));
        assert_eq!(c[3], (ms(61), 3));
        assert_eq!(c[4], (ms(45), 1));
        let s = t.slowest(4);
        assert_eq!(
            s,
            vec![
                NodeWait {
                    node: 1,
                    stall: ms(55),
                    waits: 2
                },
                NodeWait {
                    node: 2,
                    stall: ms(51),
                    waits: 2
                },
            ]
        );
        assert_eq!(t.slowest(1).len(), 1);
    }

    #[test]
    fn a_node_beyond_the_node_list_counts_by_cause_only() {
        let t = StallTotals::new(2);
        t.add(4, Some(2), Duration::from_millis(1));
        t.add(4, Some(7), Duration::from_millis(1));
        assert_eq!(t.causes()[4], (Duration::from_millis(2), 2));
        assert!(t.slowest(4).is_empty());
    }
}
