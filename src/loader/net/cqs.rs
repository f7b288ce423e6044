//! The completion queues a network thread's RDMA links share, so that a
//! tick polls its thread's CQs (one up to a few hundred links on a real
//! NIC), not every link's: the per-tick work follows the completions, not
//! the node count (docs/SCALE.md).
//!
//! Each completion names its link in its wr_id: a connection's data path
//! ORs a tag into every request it posts (the node index, and a generation
//! drawn when its queue pair is made), so the thread routes a completion to
//! its connection with an index, and drops one of a queue pair that is
//! gone (a link redialled: its new queue pair has another generation).
//!
//! Size: a CQ gets the entries of its links' own CQs of before
//! (`rdma.rs`'s `CONSUMER_CQ_ENTRIES` each: every posted receive and every
//! window's one request) and one link's more. The room is for a destroyed queue
//! pair's completions still in the CQ: a connection's queue pair is
//! destroyed once it is dead, and its replacement completes nothing before
//! its handshake is done and a GRANT frame sent, several ticks later, each
//! of which polls the CQs to empty. A device whose CQs cannot hold two
//! links' entries keeps a CQ per link.

use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::Arc;

use crate::error::Result;
use crate::transport::rdma::{CompChannel, Context, Cq, WorkCompletion};

/// wr_id layout: bits 61 to 63 the request's kind (`rdma.rs`), 45 to 60
/// the node index, 32 to 44 the generation, 0 to 31 the receive slot or
/// the window.
const TAG_NODE_SHIFT: u32 = 45;
const TAG_GEN_SHIFT: u32 = 32;
const TAG_GEN_BITS: u32 = 13;
/// The bits a tag occupies.
pub(crate) const TAG_MASK: u64 = ((1u64 << 29) - 1) << TAG_GEN_SHIFT;

/// The tag of node `node`'s data path of generation `gen`: never 0 (a
/// data path without a tag has 0), its generation field `gen` modulo
/// 8,191, plus 1.
pub(crate) fn tag(node: u32, gen: u32) -> u64 {
    assert!(node < 1 << 16, "node index {node} is over 16 bits");
    let g = u64::from(gen % ((1 << TAG_GEN_BITS) - 1)) + 1;
    (u64::from(node) << TAG_NODE_SHIFT) | (g << TAG_GEN_SHIFT)
}

/// The node index a tagged wr_id names.
pub(crate) fn tag_node(wr_id: u64) -> usize {
    ((wr_id >> TAG_NODE_SHIFT) & 0xffff) as usize
}

/// A thread's shared CQs: node `i`'s link completes on CQ
/// `i / links_per_cq`.
pub(crate) struct SharedCqs {
    cqs: Vec<Arc<Cq>>,
    links_per_cq: usize,
    /// Each node's next queue pair's generation (per node: two of one
    /// node's queue pairs get the same tag only 8,191 of its redials
    /// apart).
    next_gen: Vec<AtomicU32>,
    /// The CQ the next poll starts at (so none is starved by a busy one).
    next_cq: AtomicUsize,
}

impl SharedCqs {
    /// The CQs of links to `nodes` nodes (the local one's place included),
    /// `per_link` entries each and `extra` more each (the SRQ's receives,
    /// which may all complete on one CQ), on `ctx`, waking `channel`;
    /// `None` where the device's CQs are too
    /// small to share (each link then has its own) or
    /// `KSPEED_RDMA_SHARED_CQ=0` asks for a CQ per link (to measure one
    /// against the other).
    pub(crate) fn new(
        ctx: &Arc<Context>,
        channel: &Arc<CompChannel>,
        nodes: usize,
        per_link: usize,
        extra: usize,
    ) -> Result<Option<SharedCqs>> {
        if std::env::var_os("KSPEED_RDMA_SHARED_CQ").is_some_and(|v| v == "0") {
            log::info!("RDMA: a CQ per link (KSPEED_RDMA_SHARED_CQ=0)");
            return Ok(None);
        }
        let Some(max_cqe) = ctx.max_cqe() else {
            log::debug!("RDMA: the device's CQ size is unknown; a CQ per link");
            return Ok(None);
        };
        let Some(links_per_cq) = links_per_cq(max_cqe.saturating_sub(extra), per_link) else {
            log::info!(
                "RDMA: the device's CQs hold {max_cqe} entries, under two links' {} and {extra} \
                 shared receives; a CQ per link",
                2 * per_link
            );
            return Ok(None);
        };
        let links = nodes.max(1);
        let groups = links.div_ceil(links_per_cq);
        let mut cqs = Vec::with_capacity(groups);
        for g in 0..groups {
            let n = links_per_cq.min(links - g * links_per_cq);
            let entries = ((n + 1) * per_link + extra).min(max_cqe);
            cqs.push(Cq::with_channel(ctx, entries as i32, channel)?);
        }
        Ok(Some(SharedCqs {
            cqs,
            links_per_cq,
            next_gen: (0..links).map(|_| AtomicU32::new(0)).collect(),
            next_cq: AtomicUsize::new(0),
        }))
    }

    /// The CQ node `node`'s link completes on.
    pub(crate) fn for_node(&self, node: u32) -> &Arc<Cq> {
        let g = (node as usize / self.links_per_cq).min(self.cqs.len() - 1);
        &self.cqs[g]
    }

    /// How many CQs, and links a CQ.
    pub(crate) fn shape(&self) -> (usize, usize) {
        (self.cqs.len(), self.links_per_cq)
    }

    /// A tag for a new data path of node `node`.
    pub(crate) fn next_tag(&self, node: u32) -> u64 {
        let gen = self
            .next_gen
            .get(node as usize)
            .map_or(0, |g| g.fetch_add(1, Ordering::Relaxed));
        tag(node, gen)
    }

    /// Moves up to `out.len()` completions of any of the CQs into `out`;
    /// returns how many.
    pub(crate) fn poll(&self, out: &mut [WorkCompletion]) -> Result<usize> {
        let k = self.cqs.len();
        let first = self.next_cq.fetch_add(1, Ordering::Relaxed) % k;
        let mut n = 0;
        for j in 0..k {
            if n == out.len() {
                break;
            }
            n += self.cqs[(first + j) % k].poll(&mut out[n..])?;
        }
        Ok(n)
    }

    /// Arms every CQ (poll once more after).
    pub(crate) fn arm(&self) -> Result<()> {
        self.cqs.iter().try_for_each(|c| c.arm())
    }
}

/// Links one CQ of a device whose CQs hold `max_cqe` entries takes, each
/// link needing `per_link`, one link's room spare; `None` when fewer than
/// two links' fit.
fn links_per_cq(max_cqe: usize, per_link: usize) -> Option<usize> {
    (max_cqe / per_link).checked_sub(1).filter(|&n| n >= 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tag_names_its_node_and_leaves_the_kind_and_slot_bits_alone() {
        for node in [0u32, 1, 4095, 65535] {
            for gen in [0u32, 1, 8191, 8192, u32::MAX] {
                let t = tag(node, gen);
                assert_eq!(t & !TAG_MASK, 0, "tag {t:#x} outside its bits");
                assert_ne!(t, 0, "node {node} generation {gen}");
                assert_eq!(tag_node(t | (7 << 61) | 0xffff_ffff), node as usize);
            }
        }
        // Generations 8,191 apart are the same tag; consecutive ones differ.
        assert_eq!(tag(3, 5), tag(3, 5 + 8191));
        assert_ne!(tag(0, 8190), tag(0, 8191));
        assert_ne!(tag(3, 5), tag(3, 6));
        assert_ne!(tag(3, 5), tag(4, 5));
    }

    #[test]
    fn a_cq_takes_the_links_its_device_allows_with_one_spare() {
        // A link's entries (`rdma.rs`'s CONSUMER_CQ_ENTRIES).
        let per = 1024 + 256 + 64;
        assert_eq!(links_per_cq(per, per), None);
        assert_eq!(links_per_cq(2 * per - 1, per), None);
        assert_eq!(links_per_cq(2 * per, per), Some(1));
        // mlx5's 4,194,303 entries: 3,119 links a CQ, so 4,096 nodes
        // poll 2 CQs a tick.
        assert_eq!(links_per_cq(4_194_303, per), Some(4_194_303 / per - 1));
        assert_eq!(4096usize.div_ceil(links_per_cq(4_194_303, per).unwrap()), 2);
    }
}
