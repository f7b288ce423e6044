//! A node's CPU topology as sysfs describes it: online CPUs, NUMA nodes,
//! hyperthread siblings and the cgroup's cpuset; the kernel's CPU list
//! format; this process's affinity mask.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

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

    pub(crate) fn core_key(&self, cpu: u32) -> u32 {
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
