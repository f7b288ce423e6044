//! Where a loader's pollers run on a node: the node's CPU topology, this
//! process's local rank among the node's ranks, and the slice of cores that
//! rank's pollers are pinned to. Also the default poller count and busy-poll
//! time, which the loader and the node service (`kspeed serve`) both size
//! from the cores they may use.
//!
//! A GPU node runs one loader per rank (8 under torchrun on an 8-GPU node).
//! Each loader plans alone, from the same inputs, so the slices come out
//! disjoint without any coordination:
//!
//! 1. the cores this process may use: its affinity mask (`sched_getaffinity`,
//!    which already reflects a cgroup cpuset) intersected with the cgroup's
//!    `cpuset.cpus.effective` where present and with the online CPUs;
//! 2. of those, the cores of the NUMA node of the landing ring (or of
//!    [`crate::loader::LoaderBuilder::poller_numa_node`]); when that node has
//!    none of them, the whole set, with a WARN;
//! 3. that set split among the local ranks in contiguous blocks of physical
//!    cores (hyperthread siblings stay together), rank `r` taking block `r`;
//!    with fewer CPUs than ranks, rank `r` shares CPU `r mod n` (the ranks
//!    spread evenly instead of piling onto one core);
//! 4. within a slice, pollers go to distinct physical cores first, then to
//!    their siblings (glommio's `MaxSpread`, inside one node).
//!
//! The local rank comes from the launcher: torchrun (`LOCAL_RANK`,
//! `LOCAL_WORLD_SIZE`), Open MPI (`OMPI_COMM_WORLD_LOCAL_RANK`,
//! `OMPI_COMM_WORLD_LOCAL_SIZE`) or SLURM (`SLURM_LOCALID` with
//! `SLURM_NTASKS_PER_NODE`, or this node's entry of `SLURM_TASKS_PER_NODE`),
//! checked in that order (the innermost launcher first: torchrun started by
//! srun sees SLURM's variables too), or from explicit options or
//! `KSPEED_LOCAL_RANK` and `KSPEED_LOCAL_WORLD_SIZE`, which come first.
//!
//! The topology is read from a directory shaped like sysfs (`/sys`, or
//! `KSPEED_SYSFS_ROOT`): `devices/system/cpu/online`,
//! `devices/system/node/nodeN/cpulist`,
//! `devices/system/cpu/cpuN/topology/thread_siblings_list` and
//! `fs/cgroup/.../cpuset.cpus.effective`.
//!
//! Why this file is over ~800 lines: about 280 of them are unit tests of
//! topology, cgroup and launcher parsing on fake trees.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::error::{Error, Result};

/// Environment variable naming a directory shaped like `/sys` to read the
/// topology from instead (for tests and containers with a masked `/sys`).
pub const SYSFS_ROOT_ENV: &str = "KSPEED_SYSFS_ROOT";

/// The sysfs root: `KSPEED_SYSFS_ROOT` if set, else `/sys`.
pub fn sysfs_root() -> PathBuf {
    std::env::var_os(SYSFS_ROOT_ENV)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/sys"))
}

/// The CPUs this process may run on (`sched_getaffinity`), ascending.
pub fn affinity() -> Vec<u32> {
    let mut v: Vec<u32> = core_affinity::get_core_ids()
        .unwrap_or_default()
        .into_iter()
        .map(|c| c.id as u32)
        .collect();
    v.sort_unstable();
    v.dedup();
    v
}

/// Pollers for `cores` usable cores: a quarter of them (at least 1, at most
/// 8), leaving the rest to the trainer's own preprocessing.
pub fn pollers_for(cores: usize) -> usize {
    (cores / 4).clamp(1, 8)
}

/// Default poller count for a process that owns all the cores it may run
/// on (the node service): [`pollers_for`] the affinity mask. A loader sizes
/// its pollers from its slice instead ([`CorePlan::default_pollers`]).
pub fn default_pollers() -> usize {
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    pollers_for(cores)
}

/// Default busy-poll time: none on machines with 4 cores or fewer, where a
/// spinning consumer or poller takes the core the other one needs (measured
/// on 2 cores: tiny samples, 59K/s at 20 µs against 68K/s at 0, and 40 %
/// less CPU per GB); 20 µs with more cores, to cut wake-up latency.
pub fn default_spin() -> Duration {
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    if cores <= 4 {
        Duration::ZERO
    } else {
        Duration::from_micros(20)
    }
}

/// Parses the kernel's CPU list format (`0-3,8,10-15`, also the stride form
/// `0-15:2/4`: the first 2 of every 4) into ascending CPU numbers. An empty
/// list (only whitespace) is the empty set.
pub fn parse_cpulist(text: &str) -> std::result::Result<Vec<u32>, String> {
    let mut out = Vec::new();
    let text = text.trim();
    if text.is_empty() {
        return Ok(out);
    }
    let num = |s: &str| -> std::result::Result<u32, String> {
        s.trim()
            .parse::<u32>()
            .map_err(|_| format!("{s:?} is not a CPU number"))
    };
    for item in text.split(',') {
        let item = item.trim();
        if item.is_empty() {
            return Err(format!("empty item in {text:?}"));
        }
        let (range, stride) = match item.split_once(':') {
            Some((r, s)) => (r, Some(s)),
            None => (item, None),
        };
        let (lo, hi) = match range.split_once('-') {
            Some((a, b)) => (num(a)?, num(b)?),
            None => {
                if stride.is_some() {
                    return Err(format!("{item:?}: a stride needs a range"));
                }
                let n = num(range)?;
                (n, n)
            }
        };
        if hi < lo {
            return Err(format!("{item:?}: range ends before it starts"));
        }
        // Bound the work a hostile or corrupt file can cause.
        if hi >= 1 << 20 {
            return Err(format!("{item:?}: CPU number out of range"));
        }
        let (used, group) = match stride {
            None => (1, 1),
            Some(s) => {
                let (u, g) = s
                    .split_once('/')
                    .ok_or_else(|| format!("{item:?}: stride must be USED/GROUP"))?;
                let (u, g) = (num(u)?, num(g)?);
                if g == 0 || u == 0 || u > g {
                    return Err(format!("{item:?}: bad stride {u}/{g}"));
                }
                (u, g)
            }
        };
        for c in lo..=hi {
            if (c - lo) % group < used {
                out.push(c);
            }
        }
    }
    out.sort_unstable();
    out.dedup();
    Ok(out)
}

/// Formats CPUs as a kernel CPU list (`0-3,8`).
pub fn format_cpulist(cpus: &[u32]) -> String {
    let mut v = cpus.to_vec();
    v.sort_unstable();
    v.dedup();
    let mut out = String::new();
    let mut i = 0;
    while i < v.len() {
        let mut j = i;
        while j + 1 < v.len() && v[j + 1] == v[j] + 1 {
            j += 1;
        }
        if !out.is_empty() {
            out.push(',');
        }
        if j == i {
            out.push_str(&v[i].to_string());
        } else {
            out.push_str(&format!("{}-{}", v[i], v[j]));
        }
        i = j + 1;
    }
    out
}

/// A node's CPU topology as sysfs describes it.
#[derive(Debug, Clone, Default)]
pub struct Topology {
    /// Online CPUs; `None` when sysfs does not say (no filtering then).
    pub online: Option<Vec<u32>>,
    /// NUMA node → its CPUs (empty when sysfs has no NUMA information).
    pub nodes: BTreeMap<u32, Vec<u32>>,
    /// CPU → its physical core's key (the lowest CPU among its hyperthread
    /// siblings); a CPU not listed is a core of its own.
    pub core_of: BTreeMap<u32, u32>,
    /// The cgroup's effective cpuset, if one is readable.
    pub cgroup_cpus: Option<Vec<u32>>,
}

impl Topology {
    /// Reads the topology under `root` (shaped like `/sys`). Missing files
    /// mean "not known" (containers often mask parts of sysfs); a file that
    /// is there but malformed is an [`Error::BadPlacement`].
    pub fn read(root: &Path) -> Result<Topology> {
        let list = |p: PathBuf| -> Result<Option<Vec<u32>>> {
            match std::fs::read_to_string(&p) {
                Ok(t) => parse_cpulist(&t)
                    .map(Some)
                    .map_err(|reason| Error::BadPlacement {
                        origin: p.display().to_string(),
                        reason,
                    }),
                Err(_) => Ok(None),
            }
        };
        let mut t = Topology {
            online: list(root.join("devices/system/cpu/online"))?,
            ..Default::default()
        };
        if let Ok(dir) = std::fs::read_dir(root.join("devices/system/node")) {
            for e in dir.flatten() {
                let name = e.file_name();
                let Some(n) = name
                    .to_str()
                    .and_then(|s| s.strip_prefix("node"))
                    .and_then(|s| s.parse::<u32>().ok())
                else {
                    continue;
                };
                if let Some(cpus) = list(e.path().join("cpulist"))? {
                    t.nodes.insert(n, cpus);
                }
            }
        }
        let cpus: Vec<u32> = match &t.online {
            Some(o) => o.clone(),
            None => t.nodes.values().flatten().copied().collect(),
        };
        for c in cpus {
            let p = root.join(format!(
                "devices/system/cpu/cpu{c}/topology/thread_siblings_list"
            ));
            if let Some(sib) = list(p)? {
                if let Some(&first) = sib.first() {
                    t.core_of.insert(c, first);
                }
            }
        }
        t.cgroup_cpus = cgroup_cpus(root, &list)?;
        Ok(t)
    }

    fn core_key(&self, cpu: u32) -> u32 {
        self.core_of.get(&cpu).copied().unwrap_or(cpu)
    }
}

/// The effective cpuset of this process's cgroup: v2
/// (`fs/cgroup/PATH/cpuset.cpus.effective`, PATH from `/proc/self/cgroup`,
/// then the root's file) or v1 (`fs/cgroup/cpuset/PATH/cpuset.effective_cpus`).
fn cgroup_cpus(
    root: &Path,
    list: &dyn Fn(PathBuf) -> Result<Option<Vec<u32>>>,
) -> Result<Option<Vec<u32>>> {
    let proc_cgroup = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
    let mut v2_path = None;
    let mut v1_path = None;
    for line in proc_cgroup.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(id), Some(ctrl), Some(path)) = (parts.next(), parts.next(), parts.next()) else {
            continue;
        };
        let rel = path.trim_start_matches('/').to_string();
        if id == "0" && ctrl.is_empty() {
            v2_path = Some(rel);
        } else if ctrl.split(',').any(|c| c == "cpuset") {
            v1_path = Some(rel);
        }
    }
    let cg = root.join("fs/cgroup");
    let mut candidates = Vec::new();
    if let Some(p) = &v2_path {
        candidates.push(cg.join(p).join("cpuset.cpus.effective"));
    }
    candidates.push(cg.join("cpuset.cpus.effective"));
    if let Some(p) = &v1_path {
        candidates.push(cg.join("cpuset").join(p).join("cpuset.effective_cpus"));
    }
    candidates.push(cg.join("cpuset/cpuset.effective_cpus"));
    for c in candidates {
        if let Some(cpus) = list(c)? {
            // An empty effective set means "inherits the parent's" for a
            // v2 cgroup without the cpuset controller: not a restriction.
            if !cpus.is_empty() {
                return Ok(Some(cpus));
            }
        }
    }
    Ok(None)
}

/// This process's place among the node's ranks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalRank {
    /// Rank on this node, `0..size`.
    pub rank: u32,
    /// Ranks on this node.
    pub size: u32,
    /// Where it came from (`"LOCAL_RANK/LOCAL_WORLD_SIZE"`, `"option"`,
    /// `"no launcher variables"`...).
    pub origin: String,
}

impl LocalRank {
    /// Rank 0 of 1 (no launcher).
    pub fn single() -> LocalRank {
        LocalRank {
            rank: 0,
            size: 1,
            origin: "no launcher variables".into(),
        }
    }

    /// Explicit values, checked.
    pub fn explicit(rank: u32, size: u32) -> Result<LocalRank> {
        check(rank, size, "local rank option")?;
        Ok(LocalRank {
            rank,
            size,
            origin: "option".into(),
        })
    }

    /// From the environment: kspeed's own `KSPEED_LOCAL_RANK` and
    /// `KSPEED_LOCAL_WORLD_SIZE` (to override a launcher's, in any binding),
    /// then torchrun, Open MPI and SLURM; rank 0 of 1 when none is set. A variable that is set but not
    /// a number, a rank without its size, or a rank not below its size is
    /// an [`Error::BadPlacement`] naming the variables.
    pub fn from_env() -> Result<LocalRank> {
        Self::from_vars(|k| std::env::var(k).ok())
    }

    /// [`LocalRank::from_env`] over any variable lookup (for tests).
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<LocalRank> {
        let num = |k: &str| -> Result<Option<u32>> {
            match var(k) {
                None => Ok(None),
                Some(v) => v
                    .trim()
                    .parse::<u32>()
                    .map(Some)
                    .map_err(|_| Error::BadPlacement {
                        origin: format!("environment variable {k}"),
                        reason: format!("{v:?} is not a number"),
                    }),
            }
        };
        for (rk, sk) in [
            ("KSPEED_LOCAL_RANK", "KSPEED_LOCAL_WORLD_SIZE"),
            ("LOCAL_RANK", "LOCAL_WORLD_SIZE"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
        ] {
            match (num(rk)?, num(sk)?) {
                (None, None) => continue,
                (Some(r), Some(s)) => {
                    let origin = format!("{rk}/{sk}");
                    check(r, s, &origin)?;
                    return Ok(LocalRank {
                        rank: r,
                        size: s,
                        origin,
                    });
                }
                (Some(_), None) => {
                    return Err(Error::BadPlacement {
                        origin: format!("environment variable {rk}"),
                        reason: format!("set without {sk}"),
                    })
                }
                (None, Some(_)) => {
                    return Err(Error::BadPlacement {
                        origin: format!("environment variable {sk}"),
                        reason: format!("set without {rk}"),
                    })
                }
            }
        }
        if let Some(r) = num("SLURM_LOCALID")? {
            let (size, origin) = match num("SLURM_NTASKS_PER_NODE")? {
                Some(s) => (s, "SLURM_LOCALID/SLURM_NTASKS_PER_NODE".to_string()),
                None => {
                    let list = var("SLURM_TASKS_PER_NODE").ok_or_else(|| Error::BadPlacement {
                        origin: "environment variable SLURM_LOCALID".into(),
                        reason: "set without SLURM_NTASKS_PER_NODE or SLURM_TASKS_PER_NODE".into(),
                    })?;
                    let node = num("SLURM_NODEID")?.unwrap_or(0);
                    let s =
                        slurm_tasks_on_node(&list, node).map_err(|reason| Error::BadPlacement {
                            origin: "environment variable SLURM_TASKS_PER_NODE".into(),
                            reason,
                        })?;
                    (s, "SLURM_LOCALID/SLURM_TASKS_PER_NODE".to_string())
                }
            };
            check(r, size, &origin)?;
            return Ok(LocalRank {
                rank: r,
                size,
                origin,
            });
        }
        Ok(Self::single())
    }
}

fn check(rank: u32, size: u32, origin: &str) -> Result<()> {
    if size == 0 {
        return Err(Error::BadPlacement {
            origin: origin.to_string(),
            reason: "local world size 0".into(),
        });
    }
    if rank >= size {
        return Err(Error::BadPlacement {
            origin: origin.to_string(),
            reason: format!("local rank {rank} is not below local world size {size}"),
        });
    }
    Ok(())
}

/// Entry `node` of SLURM's compressed tasks-per-node list (`2(x3),1` is
/// 2, 2, 2, 1).
fn slurm_tasks_on_node(list: &str, node: u32) -> std::result::Result<u32, String> {
    let mut seen = 0u64;
    for item in list.trim().split(',') {
        let item = item.trim();
        let (n, reps) = match item.split_once("(x") {
            Some((n, r)) => (
                n,
                r.strip_suffix(')')
                    .and_then(|r| r.parse::<u64>().ok())
                    .ok_or_else(|| format!("{item:?} is not N or N(xM)"))?,
            ),
            None => (item, 1),
        };
        let n: u32 = n
            .parse()
            .map_err(|_| format!("{item:?} is not N or N(xM)"))?;
        seen += reps;
        if (node as u64) < seen {
            return Ok(n);
        }
    }
    Err(format!(
        "{list:?} has no entry for node {node} (SLURM_NODEID)"
    ))
}

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
        } else if self.slice.is_empty() {
            pollers_for(usable_cores / self.local.size.max(1) as usize)
        } else {
            pollers_for(self.slice.len())
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
            if n_pinned == 0 {
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

    #[test]
    fn cpulist_grammar() {
        assert_eq!(
            parse_cpulist("0-3,8,10-11\n").unwrap(),
            [0, 1, 2, 3, 8, 10, 11]
        );
        assert_eq!(parse_cpulist("5").unwrap(), [5]);
        assert_eq!(parse_cpulist("").unwrap(), Vec::<u32>::new());
        assert_eq!(parse_cpulist("\n").unwrap(), Vec::<u32>::new());
        assert_eq!(parse_cpulist("3,1,2-3").unwrap(), [1, 2, 3]);
        assert_eq!(parse_cpulist("0-7:2/4").unwrap(), [0, 1, 4, 5]);
        for bad in [
            "a",
            "1-",
            "-1",
            "3-1",
            "1,,2",
            "0-7:2",
            "0-7:0/4",
            "0-7:5/4",
            "4:1/2",
            "0-99999999",
        ] {
            assert!(parse_cpulist(bad).is_err(), "{bad:?} parsed");
        }
        assert_eq!(format_cpulist(&[0, 1, 2, 3, 8, 10, 11]), "0-3,8,10-11");
        assert_eq!(format_cpulist(&[]), "");
    }

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
        }
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

    #[test]
    fn local_rank_from_launchers() {
        let vars = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                pairs
                    .iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| v.to_string())
            }
        };
        assert_eq!(
            LocalRank::from_vars(vars(&[])).unwrap(),
            LocalRank::single()
        );
        let l =
            LocalRank::from_vars(vars(&[("LOCAL_RANK", "3"), ("LOCAL_WORLD_SIZE", "8")])).unwrap();
        assert_eq!((l.rank, l.size), (3, 8));
        // torchrun inside srun: torchrun's values win.
        let l = LocalRank::from_vars(vars(&[
            ("LOCAL_RANK", "5"),
            ("LOCAL_WORLD_SIZE", "8"),
            ("SLURM_LOCALID", "0"),
            ("SLURM_NTASKS_PER_NODE", "1"),
        ]))
        .unwrap();
        assert_eq!((l.rank, l.size), (5, 8));
        // kspeed's own variables override the launcher's.
        let l = LocalRank::from_vars(vars(&[
            ("LOCAL_RANK", "5"),
            ("LOCAL_WORLD_SIZE", "8"),
            ("KSPEED_LOCAL_RANK", "0"),
            ("KSPEED_LOCAL_WORLD_SIZE", "1"),
        ]))
        .unwrap();
        assert_eq!(
            (l.rank, l.size, l.origin.as_str()),
            (0, 1, "KSPEED_LOCAL_RANK/KSPEED_LOCAL_WORLD_SIZE")
        );
        let l = LocalRank::from_vars(vars(&[
            ("OMPI_COMM_WORLD_LOCAL_RANK", "2"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "4"),
        ]))
        .unwrap();
        assert_eq!((l.rank, l.size), (2, 4));
        let l = LocalRank::from_vars(vars(&[
            ("SLURM_LOCALID", "1"),
            ("SLURM_NTASKS_PER_NODE", "2"),
        ]))
        .unwrap();
        assert_eq!((l.rank, l.size), (1, 2));
        let l = LocalRank::from_vars(vars(&[
            ("SLURM_LOCALID", "2"),
            ("SLURM_TASKS_PER_NODE", "4(x2),3"),
            ("SLURM_NODEID", "2"),
        ]))
        .unwrap();
        assert_eq!((l.rank, l.size), (2, 3));
        for (bad, what) in [
            (
                vars(&[("LOCAL_RANK", "8"), ("LOCAL_WORLD_SIZE", "8")]),
                "not below",
            ),
            (
                vars(&[("LOCAL_RANK", "x"), ("LOCAL_WORLD_SIZE", "8")]),
                "LOCAL_RANK",
            ),
            (vars(&[("LOCAL_RANK", "1")]), "set without LOCAL_WORLD_SIZE"),
            (
                vars(&[("LOCAL_WORLD_SIZE", "0"), ("LOCAL_RANK", "0")]),
                "size 0",
            ),
            (vars(&[("SLURM_LOCALID", "1")]), "SLURM_NTASKS_PER_NODE"),
            (
                vars(&[
                    ("SLURM_LOCALID", "0"),
                    ("SLURM_TASKS_PER_NODE", "2(x1)"),
                    ("SLURM_NODEID", "1"),
                ]),
                "no entry for node 1",
            ),
        ] {
            let e = LocalRank::from_vars(bad).unwrap_err();
            assert!(matches!(e, Error::BadPlacement { .. }), "{e}");
            assert!(e.to_string().contains(what), "{e}");
        }
        assert!(LocalRank::explicit(2, 2).is_err());
    }

    #[test]
    fn topology_from_a_fake_sysfs() {
        let d = tempfile::tempdir().unwrap();
        let w = |rel: &str, text: &str| {
            let p = d.path().join(rel);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, text).unwrap();
        };
        w("devices/system/cpu/online", "0-63\n");
        w("devices/system/node/node0/cpulist", "0-15,32-47\n");
        w("devices/system/node/node1/cpulist", "16-31,48-63\n");
        w("devices/system/node/possible", "0-1\n");
        w(
            "devices/system/cpu/cpu3/topology/thread_siblings_list",
            "3,35\n",
        );
        w(
            "devices/system/cpu/cpu35/topology/thread_siblings_list",
            "3,35\n",
        );
        w("fs/cgroup/cpuset.cpus.effective", "0-47\n");
        let t = Topology::read(d.path()).unwrap();
        assert_eq!(t.online.as_deref().unwrap().len(), 64);
        assert_eq!(t.nodes.len(), 2);
        assert_eq!(t.nodes[&1][0], 16);
        assert_eq!(t.core_key(35), 3);
        assert_eq!(t.core_key(4), 4);
        assert_eq!(t.cgroup_cpus.as_deref().unwrap().len(), 48);
        w("devices/system/node/node1/cpulist", "16-x\n");
        let e = Topology::read(d.path()).unwrap_err();
        assert!(e.to_string().contains("node1/cpulist"), "{e}");
        // Nothing there: nothing known, no error.
        let t = Topology::read(&d.path().join("missing")).unwrap();
        assert!(t.online.is_none() && t.nodes.is_empty());
    }
}
