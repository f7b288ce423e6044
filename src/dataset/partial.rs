//! Which samples a partial space holds (`kspeed preload --max-bytes B`):
//! of the samples its placement gives a node, those in id order while the
//! budget lasts (each slot is the sample's length rounded up to the
//! alignment); the first that does not fit ends the node's held prefix.
//! So what node `n` holds is `holds(n, id) && id < cutoff[n]`: one number
//! per node, which a consumer computes for every node of the cluster from
//! the catalog alone, once, and the layout computes for its own node
//! (`space::Plan::compute`), so the two can never disagree.

use super::{Catalog, Placement};

/// The cutoffs of every node of `placement` for budget `budget_bytes`
/// (0: no budget, every node holds its whole share). O(samples × copies).
pub fn cutoffs(
    catalog: &Catalog,
    placement: Placement,
    align_bytes: u32,
    budget_bytes: u64,
) -> Vec<u64> {
    let n = catalog.len();
    let nodes = placement.nodes as usize;
    let mut cut = vec![n; nodes];
    if budget_bytes == 0 {
        return cut;
    }
    let mut used = vec![0u64; nodes];
    let mut open = nodes;
    for id in 0..n {
        if open == 0 {
            break;
        }
        let slot = (catalog.sample(id).len as u64).next_multiple_of(align_bytes as u64);
        for r in 0..placement.replicas {
            let node = placement.holder(id, r) as usize;
            if cut[node] < n {
                continue;
            }
            used[node] += slot;
            if used[node] > budget_bytes {
                cut[node] = id;
                open -= 1;
            }
        }
    }
    cut
}

/// The cutoff of one node (what its layout holds): [`cutoffs`]'s entry
/// for `node`, in O(samples × copies) without the others' bookkeeping.
pub fn cutoff(
    catalog: &Catalog,
    placement: Placement,
    node: u32,
    align_bytes: u32,
    budget_bytes: u64,
) -> u64 {
    let n = catalog.len();
    if budget_bytes == 0 {
        return n;
    }
    let mut used = 0u64;
    for id in 0..n {
        if !placement.holds(node, id) {
            continue;
        }
        used += (catalog.sample(id).len as u64).next_multiple_of(align_bytes as u64);
        if used > budget_bytes {
            return id;
        }
    }
    n
}

/// Who holds what in a cluster of partial spaces, every node with the same
/// budget: what a consumer needs to grant a sample only to a node that
/// holds it, and to read one no node holds from the source itself.
#[derive(Debug, Clone)]
pub struct PartialHolders {
    placement: Placement,
    cutoffs: Box<[u64]>,
}

impl PartialHolders {
    /// For `catalog` placed by `placement`, every node holding `budget_bytes`
    /// at `align_bytes`.
    pub fn new(
        catalog: &Catalog,
        placement: Placement,
        align_bytes: u32,
        budget_bytes: u64,
    ) -> Self {
        PartialHolders {
            placement,
            cutoffs: cutoffs(catalog, placement, align_bytes, budget_bytes).into(),
        }
    }

    /// Whether node `node` holds sample `id`.
    pub fn holds(&self, node: u32, id: u64) -> bool {
        self.placement.holds(node, id) && id < self.cutoffs[node as usize]
    }

    /// A bit per copy `r` whose holder does not hold `id` (its budget ran
    /// out before it): copies not to ask for it.
    pub fn unheld_copies(&self, id: u64) -> u64 {
        (0..self.placement.replicas)
            .filter(|&r| id >= self.cutoffs[self.placement.holder(id, r) as usize])
            .fold(0, |m, r| m | 1 << r)
    }

    /// Whether some node holds `id`.
    pub fn held_anywhere(&self, id: u64) -> bool {
        self.unheld_copies(id) != (1u64 << self.placement.replicas) - 1
    }
}
