//! Each rank's slice of the node's cores, and where a running loader's
//! pollers are.

use std::collections::BTreeMap;

use super::topology::{format_cpulist, Topology};
use super::{pollers_for, LocalRank};

/// The cores one loader's pollers use, as planned from the topology.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CorePlan {
    /// This loader's local rank.
    pub local: LocalRank,
    /// The NUMA node whose cores the slice was taken from; `None` when no
    /// node was asked for, or when it had none of the usable cores.
    pub numa_node: Option<u32>,
    /// The cores the ranks' slices were cut from (ascending).
    pub pool: Vec<u32>,
    /// This rank's cores, in the order pollers take them (distinct
    /// physical cores first). Empty: pollers are not pinned.
    pub slice: Vec<u32>,
    /// More ranks than cores in the pool: the slice is shared with other
    /// ranks (rank `r` gets core `r mod n`).
    pub shared: bool,
    /// Why the plan is not what was asked (NUMA fallback, no usable core);
    /// each is logged once as a WARN when the loader starts.
    pub warnings: Vec<String>,
}

impl CorePlan {
    /// Pollers to start by default: [`pollers_for`] the slice, one per
    /// rank when the slice is shared, and without a slice the usable cores
    /// divided among the ranks.
    pub fn default_pollers(&self, usable_cores: usize) -> usize {
        if self.shared {
            1
        } else {
            pollers_for(self.cores(usable_cores))
        }
    }

    /// Pollers to start by default where they copy from the page cache
    /// rather than wait for a device: twice [`CorePlan::default_pollers`],
    /// at most one per core of the slice (of the rank's share of the usable
    /// cores without one), and one when the slice is shared. A copy keeps
    /// its core busy for as long as it runs, so one poller on two cores
    /// read a cached ImageNet-sized epoch at 38-59 K samples/s where two
    /// read it at 113-117 K (BENCHMARKS.md); they sleep when the ring is
    /// full, so the second costs the trainer nothing while it is ahead.
    pub fn copying_pollers(&self, usable_cores: usize) -> usize {
        if self.shared {
            1
        } else {
            (2 * pollers_for(self.cores(usable_cores))).min(self.cores(usable_cores).max(1))
        }
    }

    /// The cores the rank's pollers size from: its slice, or without one
    /// its share of the usable cores.
    fn cores(&self, usable_cores: usize) -> usize {
        if self.slice.is_empty() {
            usable_cores / self.local.size.max(1) as usize
        } else {
            self.slice.len()
        }
    }

    /// The core poller `i` is pinned to (slice order, wrapping), if any.
    pub fn core_for(&self, i: usize) -> Option<u32> {
        (!self.slice.is_empty()).then(|| self.slice[i % self.slice.len()])
    }
}

/// Plans the slice of `local` among the usable cores: `mask` (the affinity
/// mask) ∩ the topology's online CPUs ∩ its cgroup cpuset, narrowed to
/// `numa_node`'s cores when it has any. A pure function: every rank of a
/// node computes the same pool and takes its own part.
pub fn plan(topo: &Topology, mask: &[u32], numa_node: Option<u32>, local: &LocalRank) -> CorePlan {
    let mut warnings = Vec::new();
    let mut usable: Vec<u32> = mask.to_vec();
    usable.sort_unstable();
    usable.dedup();
    if let Some(online) = &topo.online {
        usable.retain(|c| online.binary_search(c).is_ok());
    }
    if let Some(cg) = &topo.cgroup_cpus {
        usable.retain(|c| cg.binary_search(c).is_ok());
    }
    let mut node_used = None;
    let pool: Vec<u32> = match numa_node {
        None => usable.clone(),
        Some(n) => {
            let in_node: Vec<u32> = match topo.nodes.get(&n) {
                Some(cpus) => usable
                    .iter()
                    .copied()
                    .filter(|c| cpus.binary_search(c).is_ok())
                    .collect(),
                None => Vec::new(),
            };
            if in_node.is_empty() && !usable.is_empty() {
                warnings.push(format!(
                    "NUMA node {n} has none of this process's cores ({}){}; using all of them",
                    format_cpulist(&usable),
                    if topo.nodes.contains_key(&n) {
                        ""
                    } else {
                        " (the topology does not list the node)"
                    }
                ));
                usable.clone()
            } else {
                node_used = Some(n);
                in_node
            }
        }
    };
    if pool.is_empty() {
        warnings.push(format!(
            "no usable core (affinity mask {}, online {}, cgroup cpuset {}): pollers not pinned",
            format_cpulist(mask),
            topo.online
                .as_deref()
                .map_or_else(|| "unknown".into(), format_cpulist),
            topo.cgroup_cpus
                .as_deref()
                .map_or_else(|| "none".into(), format_cpulist),
        ));
        return CorePlan {
            local: local.clone(),
            numa_node: node_used,
            pool,
            slice: Vec::new(),
            shared: false,
            warnings,
        };
    }
    // Physical cores (hyperthread siblings together), by lowest CPU.
    let mut units: BTreeMap<u32, Vec<u32>> = BTreeMap::new();
    for &c in &pool {
        units.entry(topo.core_key(c)).or_default().push(c);
    }
    let units: Vec<Vec<u32>> = units.into_values().collect();
    let (w, r) = (local.size as usize, local.rank as usize);
    let (mine, shared): (Vec<Vec<u32>>, bool) = if units.len() >= w {
        let (a, b) = (r * units.len() / w, (r + 1) * units.len() / w);
        (units[a..b].to_vec(), false)
    } else {
        // Fewer physical cores than ranks: split the CPUs themselves
        // (siblings go to different ranks), or share when even that is
        // not enough.
        let flat: Vec<u32> = units.iter().flatten().copied().collect();
        if flat.len() >= w {
            let (a, b) = (r * flat.len() / w, (r + 1) * flat.len() / w);
            (flat[a..b].iter().map(|&c| vec![c]).collect(), false)
        } else {
            (vec![vec![flat[r % flat.len()]]], true)
        }
    };
    // Spread: the first CPU of every physical core, then the second...
    let mut slice = Vec::new();
    let depth = mine.iter().map(Vec::len).max().unwrap_or(0);
    for k in 0..depth {
        for u in &mine {
            if let Some(&c) = u.get(k) {
                slice.push(c);
            }
        }
    }
    CorePlan {
        local: local.clone(),
        numa_node: node_used,
        pool,
        slice,
        shared,
        warnings,
    }
}

/// Where a running loader's pollers are: the plan and what pinning did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PollerPlacement {
    /// The plan the pollers follow.
    pub plan: CorePlan,
    /// Whether pinning was asked for.
    pub pin: bool,
    /// Poller count.
    pub pollers: usize,
    /// Per poller, the core it is pinned to (`None`: not pinned, because
    /// pinning is off, the slice is empty or the kernel refused).
    pub pinned: Vec<Option<u32>>,
}

impl PollerPlacement {
    /// One line for logs and `kspeed read`.
    pub fn describe(&self) -> String {
        let p = &self.plan;
        let mut cores: Vec<u32> = self.pinned.iter().flatten().copied().collect();
        cores.sort_unstable();
        cores.dedup();
        let n_pinned = self.pinned.iter().flatten().count();
        format!(
            "local rank {} of {} ({}), {}, slice {}{}; {} poller{}, {}",
            p.local.rank,
            p.local.size,
            p.local.origin,
            p.numa_node
                .map_or_else(|| "no NUMA node".to_string(), |n| format!("NUMA node {n}")),
            if p.slice.is_empty() {
                "empty".to_string()
            } else {
                format!("cores {}", format_cpulist(&p.slice))
            },
            if p.shared {
                " (shared: more ranks than cores)"
            } else {
                ""
            },
            self.pollers,
            if self.pollers == 1 { "" } else { "s" },
            if self.pollers == 0 {
                // Attached to the node agent: its pollers read for this rank.
                "none in this process (the node agent reads)".to_string()
            } else if n_pinned == 0 {
                format!(
                    "not pinned ({})",
                    if !self.pin {
                        "pinning off"
                    } else if p.slice.is_empty() {
                        "no usable core"
                    } else {
                        "the kernel refused"
                    }
                )
            } else {
                format!(
                    "{}pinned to core{} {}",
                    if n_pinned == self.pollers {
                        String::new()
                    } else {
                        format!("{n_pinned} ")
                    },
                    if cores.len() == 1 { "" } else { "s" },
                    format_cpulist(&cores)
                )
            }
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::placement::parse_cpulist;

    /// Two sockets, 16 cores each with 2 hyperthreads: node 0 is CPUs
    /// 0-15 and 32-47, node 1 is 16-31 and 48-63 (CPU c's sibling is
    /// c ± 32), as Intel servers number them.
    fn two_socket() -> Topology {
        let mut t = Topology {
            online: Some((0..64).collect()),
            ..Default::default()
        };
        t.nodes.insert(0, parse_cpulist("0-15,32-47").unwrap());
        t.nodes.insert(1, parse_cpulist("16-31,48-63").unwrap());
        for c in 0..64 {
            t.core_of.insert(c, c % 32);
        }
        t
    }

    fn lr(rank: u32, size: u32) -> LocalRank {
        LocalRank::explicit(rank, size).unwrap()
    }

    fn check_disjoint(plans: &[CorePlan], mask: &[u32]) {
        let mut seen = std::collections::BTreeSet::new();
        for p in plans {
            assert!(!p.shared && !p.slice.is_empty(), "{p:?}");
            for c in &p.slice {
                assert!(mask.contains(c), "core {c} outside the mask: {p:?}");
                assert!(seen.insert(*c), "core {c} in two slices");
            }
        }
    }

    #[test]
    fn eight_ranks_on_one_socket_get_disjoint_spread_slices() {
        let t = two_socket();
        let mask: Vec<u32> = (0..64).collect();
        let plans: Vec<CorePlan> = (0..8)
            .map(|r| plan(&t, &mask, Some(1), &lr(r, 8)))
            .collect();
        check_disjoint(&plans, &mask);
        for (r, p) in plans.iter().enumerate() {
            assert!(p.warnings.is_empty());
            assert_eq!(p.numa_node, Some(1));
            // 16 physical cores of node 1 / 8 ranks: 2 cores, 4 CPUs each,
            // the two distinct cores first.
            let base = 16 + 2 * r as u32;
            assert_eq!(p.slice, [base, base + 1, base + 32, base + 33]);
            assert_eq!(p.default_pollers(64), 1);
            // Copying from the page cache: two of its four CPUs.
            assert_eq!(p.copying_pollers(64), 2);
        }
        let total: usize = plans.iter().map(|p| p.default_pollers(64)).sum();
        assert!(total <= 32);
    }

    #[test]
    fn no_numa_node_splits_the_whole_mask_by_physical_core() {
        let t = two_socket();
        let mask: Vec<u32> = (0..64).collect();
        let plans: Vec<CorePlan> = (0..8).map(|r| plan(&t, &mask, None, &lr(r, 8))).collect();
        check_disjoint(&plans, &mask);
        // Rank 0: physical cores 0-3 and their siblings; one socket each
        // for ranks 0-3 and 4-7.
        assert_eq!(plans[0].slice, [0, 1, 2, 3, 32, 33, 34, 35]);
        assert_eq!(plans[7].slice, [28, 29, 30, 31, 60, 61, 62, 63]);
        assert_eq!(plans[0].default_pollers(64), 2);
        assert_eq!(plans[0].copying_pollers(64), 4);
    }

    #[test]
    fn restricted_mask_and_cgroup() {
        let mut t = two_socket();
        // taskset -c 0-11,32-43 and a cgroup that also drops 40-43.
        let mask = parse_cpulist("0-11,32-43").unwrap();
        t.cgroup_cpus = Some(parse_cpulist("0-39").unwrap());
        let plans: Vec<CorePlan> = (0..8)
            .map(|r| plan(&t, &mask, Some(0), &lr(r, 8)))
            .collect();
        check_disjoint(&plans, &parse_cpulist("0-11,32-39").unwrap());
        let all: usize = plans.iter().map(|p| p.slice.len()).sum();
        assert_eq!(all, 20, "every usable core goes to some rank");
        let total: usize = plans.iter().map(|p| p.default_pollers(20)).sum();
        assert!(total <= 20);
    }

    #[test]
    fn fewer_physical_cores_than_ranks_splits_siblings_then_shares() {
        let t = two_socket();
        // 4 physical cores with siblings: 8 CPUs for 8 ranks.
        let mask = parse_cpulist("0-3,32-35").unwrap();
        let plans: Vec<CorePlan> = (0..8)
            .map(|r| plan(&t, &mask, Some(0), &lr(r, 8)))
            .collect();
        check_disjoint(&plans, &mask);
        // 2 CPUs for 8 ranks: shared, evenly.
        let mask = [0, 1];
        let plans: Vec<CorePlan> = (0..8).map(|r| plan(&t, &mask, None, &lr(r, 8))).collect();
        for (r, p) in plans.iter().enumerate() {
            assert!(p.shared);
            assert_eq!(p.slice, [r as u32 % 2]);
            assert_eq!(p.default_pollers(2), 1);
            assert_eq!(p.copying_pollers(2), 1);
        }
        // One rank on 2 CPUs (this project's CI machine): one poller
        // waiting for the disk, two copying from the page cache.
        let p = plan(&t, &mask, None, &lr(0, 1));
        assert_eq!(p.slice.len(), 2);
        assert_eq!((p.default_pollers(2), p.copying_pollers(2)), (1, 2));
    }

    #[test]
    fn numa_node_without_usable_cores_falls_back_with_a_warning() {
        let t = two_socket();
        let mask = parse_cpulist("0-7").unwrap();
        let p = plan(&t, &mask, Some(1), &lr(0, 1));
        assert_eq!(p.numa_node, None);
        assert_eq!(p.pool, mask);
        assert_eq!(p.warnings.len(), 1, "{:?}", p.warnings);
        assert!(
            p.warnings[0].contains("NUMA node 1 has none"),
            "{:?}",
            p.warnings
        );
        let p = plan(&t, &mask, Some(7), &lr(0, 1));
        assert!(
            p.warnings[0].contains("does not list the node"),
            "{:?}",
            p.warnings
        );
        // No usable core at all: empty slice, not pinned.
        let p = plan(&t, &[100], Some(0), &lr(0, 1));
        assert!(p.slice.is_empty() && p.core_for(0).is_none());
        assert!(p.warnings.iter().any(|w| w.contains("not pinned")));
    }
}
