//! The launcher's environment: which launcher started this process, and
//! this process's place in the job (rank, world size, local rank, local
//! world size, node index, node count, the job's node list).
//!
//! One parser for every user: the cluster path
//! ([`crate::transport::Cluster::from_env`]), the core placement
//! ([`crate::placement::LocalRank::from_env`]) and the Python package's
//! `kspeed.launch_env()` all read [`Launcher::from_env`], so they cannot
//! disagree about a job.
//!
//! (Why this file is over ~800 lines: about 300 are the tests, every launcher's variables
//! and their contradictions, kept next to the one parser they pin.)
//!
//! # Variables and precedence
//!
//! Launchers, innermost first (torchrun started by `srun`, or `mpirun`
//! inside a SLURM allocation, also sees SLURM's variables; the innermost
//! launcher is the one that started this process):
//!
//! | launcher | rank / world | local rank / local world | node / node count |
//! |---|---|---|---|
//! | torchrun (torch elastic) | `RANK` / `WORLD_SIZE` | `LOCAL_RANK` / `LOCAL_WORLD_SIZE` | `GROUP_RANK` / `GROUP_WORLD_SIZE` |
//! | Open MPI (`mpirun`) | `OMPI_COMM_WORLD_RANK` / `OMPI_COMM_WORLD_SIZE` | `OMPI_COMM_WORLD_LOCAL_RANK` / `OMPI_COMM_WORLD_LOCAL_SIZE` | — |
//! | MPICH, Intel MPI (Hydra, PMI) | `PMI_RANK` / `PMI_SIZE` | `MPI_LOCALRANKID` / `MPI_LOCALNRANKS` | — |
//! | SLURM (`srun`) | `SLURM_PROCID` / `SLURM_NTASKS` | `SLURM_LOCALID` / `SLURM_NTASKS_PER_NODE`, else this node's entry of `SLURM_TASKS_PER_NODE` (`4(x2),3`) | `SLURM_NODEID` / `SLURM_NNODES` |
//!
//! - The rank and world come from the first launcher in that order that
//!   sets them; the local rank and local world from the first that sets
//!   those (so `srun --mpi=pmi2`, which sets `PMI_RANK` but no
//!   `MPI_LOCALRANKID`, takes its local rank from `SLURM_LOCALID`).
//!   kspeed's own `KSPEED_LOCAL_RANK` and `KSPEED_LOCAL_WORLD_SIZE` come
//!   before every launcher's local rank (for a launcher kspeed does not
//!   know, or to override one); they decide the core placement only, never
//!   the node index or count.
//! - The node index and count: the node variables (`GROUP_RANK` /
//!   `GROUP_WORLD_SIZE`, `SLURM_NODEID` / `SLURM_NNODES`) of the rank's
//!   launcher, else of a launcher with the same rank and world (`srun
//!   --mpi=pmi2`: SLURM's tasks are PMI's ranks, so `SLURM_NODEID`, right
//!   with uneven `SLURM_TASKS_PER_NODE` too); else `rank / local world`
//!   and `world / local world` rounded up, with the local world of the
//!   rank's launcher itself (or of that same-rank launcher); else one rank
//!   per node. An outer launcher's variables (the batch step's
//!   `SLURM_NODEID` under `mpirun`) are not this process's and are not
//!   read for it.
//! - The job's node list: `SLURM_JOB_NODELIST`, else `SLURM_NODELIST` (a
//!   SLURM hostlist), whichever launcher gave the ranks (torchrun inside an
//!   allocation runs on its nodes).
//! - Nothing set: rank 0 of 1, local rank 0 of 1, node 0 of 1
//!   ([`LauncherKind::None`]).
//!
//! A Kubernetes Indexed Job's `JOB_COMPLETION_INDEX` is not read: it goes to
//! torchrun as `--node-rank` (packaging/k8s/training-job.yaml), which sets
//! `GROUP_RANK`.
//!
//! # Errors
//!
//! Every malformed or contradictory set of variables is an
//! [`Error::BadLauncher`] naming the variables and their values: a value
//! that is not a number, one of a pair set without the other (`RANK`
//! without `WORLD_SIZE`), a zero size, a rank not below its size, a local
//! world larger than the world, a node index not below the node count.
//! The core placement reads only the local variables
//! ([`crate::placement::LocalRank::from_env`]): a one-node loader does not
//! fail on a rank, world or node variable it does not use.

use crate::error::{Error, Result};

/// kspeed's own local rank variable (before every launcher's).
pub const KSPEED_LOCAL_RANK: &str = "KSPEED_LOCAL_RANK";
/// kspeed's own local world size variable (with [`KSPEED_LOCAL_RANK`]).
pub const KSPEED_LOCAL_WORLD_SIZE: &str = "KSPEED_LOCAL_WORLD_SIZE";

/// Which launcher gave this process its rank and world.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum LauncherKind {
    /// torchrun / torch elastic (`RANK`, `WORLD_SIZE`, ...).
    Torchrun,
    /// Open MPI's `mpirun` (`OMPI_COMM_WORLD_*`).
    OpenMpi,
    /// MPICH or Intel MPI through Hydra or PMI (`PMI_RANK`, `PMI_SIZE`, ...).
    Mpich,
    /// SLURM's `srun` (`SLURM_PROCID`, ...).
    Slurm,
    /// No launcher variables: rank 0 of 1.
    None,
}

impl LauncherKind {
    /// The launchers in precedence order (innermost first).
    pub const ALL: [LauncherKind; 4] = [
        LauncherKind::Torchrun,
        LauncherKind::OpenMpi,
        LauncherKind::Mpich,
        LauncherKind::Slurm,
    ];

    /// A short lowercase name (`torchrun`, `openmpi`, `mpich`, `slurm`,
    /// `none`), as Python's `launch_env().launcher` gives it.
    pub fn name(self) -> &'static str {
        match self {
            LauncherKind::Torchrun => "torchrun",
            LauncherKind::OpenMpi => "openmpi",
            LauncherKind::Mpich => "mpich",
            LauncherKind::Slurm => "slurm",
            LauncherKind::None => "none",
        }
    }

    fn vars(self) -> Vars {
        match self {
            LauncherKind::Torchrun => Vars {
                rank: "RANK",
                world: "WORLD_SIZE",
                local_rank: "LOCAL_RANK",
                local_world: "LOCAL_WORLD_SIZE",
                node: Some("GROUP_RANK"),
                nodes: Some("GROUP_WORLD_SIZE"),
            },
            LauncherKind::OpenMpi => Vars {
                rank: "OMPI_COMM_WORLD_RANK",
                world: "OMPI_COMM_WORLD_SIZE",
                local_rank: "OMPI_COMM_WORLD_LOCAL_RANK",
                local_world: "OMPI_COMM_WORLD_LOCAL_SIZE",
                node: None,
                nodes: None,
            },
            LauncherKind::Mpich => Vars {
                rank: "PMI_RANK",
                world: "PMI_SIZE",
                local_rank: "MPI_LOCALRANKID",
                local_world: "MPI_LOCALNRANKS",
                node: None,
                nodes: None,
            },
            LauncherKind::Slurm => Vars {
                rank: "SLURM_PROCID",
                world: "SLURM_NTASKS",
                local_rank: "SLURM_LOCALID",
                local_world: "SLURM_NTASKS_PER_NODE",
                node: Some("SLURM_NODEID"),
                nodes: Some("SLURM_NNODES"),
            },
            // Only the launchers of `ALL` are looked up.
            LauncherKind::None => unreachable!("no launcher has no variables"),
        }
    }
}

/// One launcher's variable names.
struct Vars {
    rank: &'static str,
    world: &'static str,
    local_rank: &'static str,
    local_world: &'static str,
    node: Option<&'static str>,
    nodes: Option<&'static str>,
}

/// This process's place in the job, from the launcher's environment (see
/// the [module documentation](self) for the variables and their order).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Launcher {
    /// The launcher that gave the rank and world ([`LauncherKind::None`]:
    /// none did, rank 0 of 1).
    pub kind: LauncherKind,
    /// Global rank, `0..world`.
    pub rank: u32,
    /// Ranks in the job.
    pub world: u32,
    /// Rank on this node, `0..local_world`.
    pub local_rank: u32,
    /// Ranks on this node.
    pub local_world: u32,
    /// This node's index, `0..nodes`.
    pub node: u32,
    /// Nodes in the job.
    pub nodes: u32,
    /// The job's node list as the launcher wrote it (a SLURM hostlist).
    pub nodelist: Option<String>,
    /// The variables the rank and world came from (`"RANK/WORLD_SIZE"`),
    /// or `"no launcher variables"`.
    pub rank_from: String,
    /// The variables the local rank came from
    /// (`"LOCAL_RANK/LOCAL_WORLD_SIZE"`,
    /// `"SLURM_LOCALID/SLURM_TASKS_PER_NODE"`...), or `"no launcher variables"`.
    pub local_from: String,
    /// Where the node index came from (`"GROUP_RANK"`,
    /// `"RANK / LOCAL_WORLD_SIZE"`...).
    pub node_from: String,
    /// Where the node count came from (`"GROUP_WORLD_SIZE"`,
    /// `"WORLD_SIZE / LOCAL_WORLD_SIZE"`...).
    pub nodes_from: String,
}

/// What [`Launcher::rank_from`] and [`Launcher::local_from`] say when no
/// variable was set.
pub const NO_LAUNCHER: &str = "no launcher variables";

fn bad(vars: String, reason: impl Into<String>) -> Error {
    Error::BadLauncher {
        vars,
        reason: reason.into(),
    }
}

/// A variable as a number; `N(xM)` reads as `N` where `repeat` (SLURM's
/// per-node counts).
fn num(
    var: &impl Fn(&str) -> Option<String>,
    k: &str,
    repeat: bool,
) -> Result<Option<(u32, String)>> {
    let Some(v) = var(k) else {
        return Ok(None);
    };
    let t = v.trim();
    let digits = if repeat {
        t.split('(').next().unwrap_or("")
    } else {
        t
    };
    match digits.parse::<u32>() {
        Ok(n) => Ok(Some((n, format!("{k}={t}")))),
        Err(_) => Err(bad(format!("{k}={v:?}"), "not a number")),
    }
}

/// Both variables of a pair, or neither.
fn pair(
    var: &impl Fn(&str) -> Option<String>,
    a: &str,
    b: &str,
    repeat_b: bool,
) -> Result<Option<(u32, u32, String)>> {
    match (num(var, a, false)?, num(var, b, repeat_b)?) {
        (None, None) => Ok(None),
        (Some((x, dx)), Some((y, dy))) => Ok(Some((x, y, format!("{dx}, {dy}")))),
        (Some((_, d)), None) => Err(bad(d, format!("{b} is not set while {a} is"))),
        (None, Some((_, d))) => Err(bad(d, format!("{a} is not set while {b} is"))),
    }
}

/// A rank below its size, and a size above 0.
fn check_rank(rank: u32, size: u32, vars: &str, what: &str) -> Result<()> {
    if size == 0 {
        return Err(bad(vars.to_string(), format!("{what} size 0")));
    }
    if rank >= size {
        return Err(bad(
            vars.to_string(),
            format!(
                "{} {rank} is not below {what} size {size}",
                what.replace("world", "rank")
            ),
        ));
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

/// A launcher's local rank and size: `(rank, size, values, origin)`.
type Local = (u32, u32, String, String);

/// `kind`'s local rank and local world, if it sets them.
fn local_of(var: &impl Fn(&str) -> Option<String>, kind: LauncherKind) -> Result<Option<Local>> {
    let v = kind.vars();
    if kind != LauncherKind::Slurm {
        return Ok(pair(var, v.local_rank, v.local_world, false)?
            .map(|(r, s, d)| (r, s, d, format!("{}/{}", v.local_rank, v.local_world))));
    }
    // SLURM: SLURM_LOCALID with SLURM_NTASKS_PER_NODE, else this node's
    // entry of SLURM_TASKS_PER_NODE.
    let Some((r, dr)) = num(var, "SLURM_LOCALID", false)? else {
        return Ok(None);
    };
    if let Some((s, ds)) = num(var, "SLURM_NTASKS_PER_NODE", true)? {
        return Ok(Some((
            r,
            s,
            format!("{dr}, {ds}"),
            "SLURM_LOCALID/SLURM_NTASKS_PER_NODE".into(),
        )));
    }
    let Some(list) = var("SLURM_TASKS_PER_NODE") else {
        return Err(bad(
            dr,
            "SLURM_NTASKS_PER_NODE and SLURM_TASKS_PER_NODE are not set while SLURM_LOCALID is",
        ));
    };
    let (node, dn) = num(var, "SLURM_NODEID", false)?.unwrap_or((0, String::new()));
    let s = slurm_tasks_on_node(&list, node).map_err(|reason| {
        let mut vars = format!("SLURM_TASKS_PER_NODE={:?}", list.trim());
        if !dn.is_empty() {
            vars.push_str(&format!(", {dn}"));
        }
        bad(vars, reason)
    })?;
    Ok(Some((
        r,
        s,
        format!("{dr}, SLURM_TASKS_PER_NODE={}", list.trim()),
        "SLURM_LOCALID/SLURM_TASKS_PER_NODE".into(),
    )))
}

impl Launcher {
    /// From the process environment (see the [module documentation](self)).
    pub fn from_env() -> Result<Launcher> {
        Self::from_vars(|k| std::env::var(k).ok())
    }

    /// [`Launcher::from_env`] over any variable lookup (for tests and
    /// bindings that pass their own environment).
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Launcher> {
        // Rank and world: the innermost launcher that sets them.
        let mut global = None;
        for kind in LauncherKind::ALL {
            let v = kind.vars();
            if let Some((r, w, d)) = pair(&var, v.rank, v.world, false)? {
                check_rank(r, w, &d, "world")?;
                global = Some((kind, r, w, d));
                break;
            }
        }
        let (local_rank, local_world, local_from) = Self::local_from_vars(&var)?;
        let nodelist = var("SLURM_JOB_NODELIST").or_else(|| var("SLURM_NODELIST"));
        let Some((kind, rank, world, rank_vals)) = global else {
            return Ok(Launcher {
                kind: LauncherKind::None,
                rank: 0,
                world: 1,
                local_rank,
                local_world,
                node: 0,
                nodes: 1,
                nodelist,
                rank_from: NO_LAUNCHER.into(),
                local_from,
                node_from: NO_LAUNCHER.into(),
                nodes_from: NO_LAUNCHER.into(),
            });
        };
        let v = kind.vars();
        // The launchers that started this very process: the rank's, then
        // any other whose rank and world are the same ones (`srun
        // --mpi=pmi2`: PMI's ranks are SLURM's tasks). An outer launcher's
        // variables (the batch step's SLURM_NODEID under mpirun) describe
        // another process and are not read; a malformed one is not this
        // process's error.
        let mut same = vec![kind];
        for k in LauncherKind::ALL {
            let kv = k.vars();
            if k != kind
                && matches!(pair(&var, kv.rank, kv.world, false),
                            Ok(Some((r, w, _))) if (r, w) == (rank, world))
            {
                same.push(k);
            }
        }
        // The local world the node index and count are derived from where
        // no node variable is set: these launchers' own, never kspeed's
        // KSPEED_LOCAL_* (that only decides the core placement: `0 of 1`
        // under a core-binding launcher is not one rank per node).
        let mut div: Option<Local> = None;
        for &k in &same {
            if let Some(l) = local_of(&var, k)? {
                check_rank(l.0, l.1, &l.2, "local world")?;
                if l.1 > world {
                    return Err(bad(
                        format!("{rank_vals}, {}", l.2),
                        format!("local world size {} is above the world size {world}", l.1),
                    ));
                }
                div = Some(l);
                break;
            }
        }
        // A node variable: the first of these launchers that sets it.
        let node_var =
            |pick: fn(&Vars) -> Option<&'static str>| -> Result<Option<(u32, String, String)>> {
                for &k in &same {
                    if let Some(name) = pick(&k.vars()) {
                        if let Some((n, d)) = num(&var, name, false)? {
                            return Ok(Some((n, d, name.to_string())));
                        }
                    }
                }
                Ok(None)
            };
        let derived = |x: u32, x_var: &str, round_up: bool| {
            let (n, what) = match &div {
                Some((_, s, _, from)) => {
                    let s_var = from.split('/').nth(1).unwrap_or("local world size");
                    let n = if round_up { x.div_ceil(*s) } else { x / s };
                    (n, format!("{x_var} / {s_var}"))
                }
                None => (
                    x,
                    format!("{x_var} (no local world size: one rank per node)"),
                ),
            };
            (n, format!("{what} = {n}"), what)
        };
        let (nodes, nodes_vals, nodes_from) = match node_var(|v| v.nodes)? {
            Some(n) => n,
            None => derived(world, v.world, true),
        };
        if nodes == 0 || nodes > world {
            return Err(bad(
                format!("{rank_vals}, {nodes_vals}"),
                format!("node count {nodes} is not 1 to the world size {world}"),
            ));
        }
        let (node, node_vals, node_from) = match node_var(|v| v.node)? {
            Some(n) => n,
            None => derived(rank, v.rank, false),
        };
        if node >= nodes {
            return Err(bad(
                format!("{rank_vals}, {node_vals}, {nodes_vals}"),
                format!("node index {node} is not below the node count {nodes}"),
            ));
        }
        Ok(Launcher {
            kind,
            rank,
            world,
            local_rank,
            local_world,
            node,
            nodes,
            nodelist,
            rank_from: format!("{}/{}", v.rank, v.world),
            local_from,
            node_from,
            nodes_from,
        })
    }

    /// The local rank, local world and where they came from (as
    /// [`Launcher::local_from`] says it): kspeed's own `KSPEED_LOCAL_*`,
    /// else the innermost launcher that sets a local pair, else 0 of 1.
    /// Reads only the local variables (and `SLURM_NODEID` for this node's
    /// entry of `SLURM_TASKS_PER_NODE`): the core placement of a one-node
    /// loader must not fail on a global variable it does not use (`RANK`
    /// without `WORLD_SIZE`, `SLURM_PROCID` without `SLURM_NTASKS` in an
    /// `sbatch` script without `-n`).
    pub(crate) fn local_from_vars(
        var: &impl Fn(&str) -> Option<String>,
    ) -> Result<(u32, u32, String)> {
        let mut local: Option<Local> =
            pair(var, KSPEED_LOCAL_RANK, KSPEED_LOCAL_WORLD_SIZE, false)?.map(|(r, s, d)| {
                (
                    r,
                    s,
                    d,
                    format!("{KSPEED_LOCAL_RANK}/{KSPEED_LOCAL_WORLD_SIZE}"),
                )
            });
        if local.is_none() {
            for kind in LauncherKind::ALL {
                if let Some(l) = local_of(var, kind)? {
                    local = Some(l);
                    break;
                }
            }
        }
        Ok(match local {
            Some((r, s, d, from)) => {
                check_rank(r, s, &d, "local world")?;
                (r, s, from)
            }
            None => (0, 1, NO_LAUNCHER.to_string()),
        })
    }

    /// Whether a launcher gave the rank and world (not rank 0 of 1 by
    /// default).
    pub fn is_launched(&self) -> bool {
        self.kind != LauncherKind::None
    }

    /// Nodes the job runs on ([`Launcher::nodes`]).
    pub fn node_count(&self) -> u32 {
        self.nodes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn lookup(list: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let owned: Vec<(String, String)> = list
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k: &str| owned.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone())
    }

    fn get(list: &[(&str, &str)]) -> Launcher {
        Launcher::from_vars(lookup(list)).unwrap()
    }

    /// (kind, rank, world, local rank, local world, node, nodes).
    fn key(l: &Launcher) -> (LauncherKind, u32, u32, u32, u32, u32, u32) {
        (
            l.kind,
            l.rank,
            l.world,
            l.local_rank,
            l.local_world,
            l.node,
            l.nodes,
        )
    }

    #[test]
    fn each_launcher() {
        use LauncherKind::*;
        let none = get(&[]);
        assert_eq!(key(&none), (None, 0, 1, 0, 1, 0, 1));
        assert_eq!(none.rank_from, NO_LAUNCHER);
        assert!(!none.is_launched());
        let t = get(&[
            ("RANK", "13"),
            ("WORLD_SIZE", "16"),
            ("LOCAL_RANK", "5"),
            ("LOCAL_WORLD_SIZE", "8"),
            ("GROUP_RANK", "1"),
            ("GROUP_WORLD_SIZE", "2"),
        ]);
        assert_eq!(key(&t), (Torchrun, 13, 16, 5, 8, 1, 2));
        assert_eq!(
            (t.rank_from.as_str(), t.local_from.as_str()),
            ("RANK/WORLD_SIZE", "LOCAL_RANK/LOCAL_WORLD_SIZE")
        );
        let o = get(&[
            ("OMPI_COMM_WORLD_RANK", "6"),
            ("OMPI_COMM_WORLD_SIZE", "8"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "2"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "4"),
        ]);
        assert_eq!(key(&o), (OpenMpi, 6, 8, 2, 4, 1, 2));
        assert_eq!(
            o.node_from,
            "OMPI_COMM_WORLD_RANK / OMPI_COMM_WORLD_LOCAL_SIZE"
        );
        let m = get(&[
            ("PMI_RANK", "3"),
            ("PMI_SIZE", "4"),
            ("MPI_LOCALRANKID", "1"),
            ("MPI_LOCALNRANKS", "2"),
        ]);
        assert_eq!(key(&m), (Mpich, 3, 4, 1, 2, 1, 2));
        let s = get(&[
            ("SLURM_PROCID", "10"),
            ("SLURM_NTASKS", "11"),
            ("SLURM_LOCALID", "2"),
            ("SLURM_TASKS_PER_NODE", "4(x2),3"),
            ("SLURM_NODEID", "2"),
            ("SLURM_NNODES", "3"),
            ("SLURM_JOB_NODELIST", "gpu[1-3]"),
        ]);
        assert_eq!(key(&s), (Slurm, 10, 11, 2, 3, 2, 3));
        assert_eq!(s.nodelist.as_deref(), Some("gpu[1-3]"));
        assert_eq!(s.local_from, "SLURM_LOCALID/SLURM_TASKS_PER_NODE");
    }

    #[test]
    fn innermost_first_and_kspeed_overrides() {
        use LauncherKind::*;
        // torchrun inside srun (one task per node): torchrun's ranks,
        // SLURM's node list.
        let l = get(&[
            ("RANK", "9"),
            ("WORLD_SIZE", "16"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "8"),
            ("SLURM_PROCID", "1"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_LOCALID", "0"),
            ("SLURM_NTASKS_PER_NODE", "1"),
            ("SLURM_NODEID", "1"),
            ("SLURM_NODELIST", "a[1-2]"),
        ]);
        assert_eq!(key(&l), (Torchrun, 9, 16, 1, 8, 1, 2));
        assert_eq!(l.nodelist.as_deref(), Some("a[1-2]"));
        // mpirun inside an allocation: Open MPI's, not the batch step's.
        let l = get(&[
            ("OMPI_COMM_WORLD_RANK", "5"),
            ("OMPI_COMM_WORLD_SIZE", "8"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "4"),
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_LOCALID", "0"),
            ("SLURM_NTASKS_PER_NODE", "1"),
        ]);
        assert_eq!(key(&l), (OpenMpi, 5, 8, 1, 4, 1, 2));
        // srun --mpi=pmi2: PMI's ranks, SLURM's local rank.
        let l = get(&[
            ("PMI_RANK", "3"),
            ("PMI_SIZE", "4"),
            ("SLURM_PROCID", "3"),
            ("SLURM_NTASKS", "4"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_NTASKS_PER_NODE", "2"),
        ]);
        assert_eq!(key(&l), (Mpich, 3, 4, 1, 2, 1, 2));
        assert_eq!(l.local_from, "SLURM_LOCALID/SLURM_NTASKS_PER_NODE");
        // kspeed's own local rank wins for placement, not for the node
        // count (still the launcher's local world).
        let l = get(&[
            ("RANK", "5"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "5"),
            ("LOCAL_WORLD_SIZE", "8"),
            ("KSPEED_LOCAL_RANK", "1"),
            ("KSPEED_LOCAL_WORLD_SIZE", "2"),
        ]);
        assert_eq!(key(&l), (Torchrun, 5, 8, 1, 2, 0, 1));
        assert_eq!(l.nodes_from, "WORLD_SIZE / LOCAL_WORLD_SIZE");
        // A local rank without a global one (placement only).
        let l = get(&[("LOCAL_RANK", "1"), ("LOCAL_WORLD_SIZE", "2")]);
        assert_eq!(key(&l), (None, 0, 1, 1, 2, 0, 1));
        // SLURM_NTASKS_PER_NODE in the repeated form reads as its count.
        let l = get(&[
            ("SLURM_PROCID", "6"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_LOCALID", "2"),
            ("SLURM_NTASKS_PER_NODE", "4(x2)"),
        ]);
        assert_eq!(key(&l), (Slurm, 6, 8, 2, 4, 1, 2));
    }

    /// The node index and count come from node variables or the rank
    /// launcher's own local world, never from KSPEED_LOCAL_* (which only
    /// decides the core placement). Before, they were divided by whatever
    /// local pair won: KSPEED_LOCAL_WORLD_SIZE=1 under mpirun made every
    /// rank its own node, and `srun --mpi=pmi2` divided PMI_RANK by
    /// SLURM's local size, wrong with uneven SLURM_TASKS_PER_NODE.
    #[test]
    fn node_comes_from_node_variables_or_the_rank_launcher_s_own_local_world() {
        use LauncherKind::*;
        // mpirun with the core-binding override of docs/LOCAL_PATH.md.
        let l = get(&[
            ("OMPI_COMM_WORLD_RANK", "5"),
            ("OMPI_COMM_WORLD_SIZE", "8"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "4"),
            ("KSPEED_LOCAL_RANK", "0"),
            ("KSPEED_LOCAL_WORLD_SIZE", "1"),
        ]);
        assert_eq!(key(&l), (OpenMpi, 5, 8, 0, 1, 1, 2));
        assert_eq!(
            (l.node_from.as_str(), l.nodes_from.as_str()),
            (
                "OMPI_COMM_WORLD_RANK / OMPI_COMM_WORLD_LOCAL_SIZE",
                "OMPI_COMM_WORLD_SIZE / OMPI_COMM_WORLD_LOCAL_SIZE"
            )
        );
        // The same with MPICH's Hydra.
        let l = get(&[
            ("PMI_RANK", "5"),
            ("PMI_SIZE", "8"),
            ("MPI_LOCALRANKID", "1"),
            ("MPI_LOCALNRANKS", "4"),
            ("KSPEED_LOCAL_RANK", "0"),
            ("KSPEED_LOCAL_WORLD_SIZE", "1"),
        ]);
        assert_eq!(key(&l), (Mpich, 5, 8, 0, 1, 1, 2));
        // srun --mpi=pmi2 over 4 + 3 tasks: the last task of node 1 is
        // node 1 of 2 (SLURM's), not 6 / 3 = node 2 of 3.
        for tasks in ["4,3", "4(x1),3"] {
            let l = get(&[
                ("PMI_RANK", "6"),
                ("PMI_SIZE", "7"),
                ("SLURM_PROCID", "6"),
                ("SLURM_NTASKS", "7"),
                ("SLURM_LOCALID", "2"),
                ("SLURM_TASKS_PER_NODE", tasks),
                ("SLURM_NODEID", "1"),
                ("SLURM_NNODES", "2"),
                ("SLURM_JOB_NODELIST", "n[1-2]"),
            ]);
            assert_eq!(key(&l), (Mpich, 6, 7, 2, 3, 1, 2), "{tasks}");
            assert_eq!(
                (l.node_from.as_str(), l.nodes_from.as_str()),
                ("SLURM_NODEID", "SLURM_NNODES")
            );
        }
        // mpirun inside an sbatch script: the batch step's SLURM_NODEID
        // and SLURM_NNODES are another process's, and its SLURM_PROCID
        // without SLURM_NTASKS (sbatch without -n) is no error here.
        let l = get(&[
            ("OMPI_COMM_WORLD_RANK", "5"),
            ("OMPI_COMM_WORLD_SIZE", "8"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "4"),
            ("SLURM_PROCID", "0"),
            ("SLURM_LOCALID", "0"),
            ("SLURM_TASKS_PER_NODE", "1(x2)"),
            ("SLURM_NODEID", "0"),
            ("SLURM_NNODES", "2"),
        ]);
        assert_eq!(key(&l), (OpenMpi, 5, 8, 1, 4, 1, 2));
        // No local world at all: one rank per node.
        let l = get(&[("RANK", "3"), ("WORLD_SIZE", "4")]);
        assert_eq!(key(&l), (Torchrun, 3, 4, 0, 1, 3, 4));
        assert_eq!(
            l.nodes_from,
            "WORLD_SIZE (no local world size: one rank per node)"
        );
    }

    #[test]
    fn contradictions_are_named() {
        for (vars, what) in [
            (
                &[("RANK", "1")][..],
                "RANK=1): WORLD_SIZE is not set while RANK is",
            ),
            (
                &[("WORLD_SIZE", "x"), ("RANK", "0")],
                "WORLD_SIZE=\"x\"): not a number",
            ),
            (
                &[("RANK", "8"), ("WORLD_SIZE", "8")],
                "RANK=8, WORLD_SIZE=8): rank 8 is not below world size 8",
            ),
            (&[("PMI_RANK", "0"), ("PMI_SIZE", "0")], "world size 0"),
            (
                &[("LOCAL_RANK", "2"), ("LOCAL_WORLD_SIZE", "2")],
                "local rank 2 is not below local world size 2",
            ),
            (
                &[("OMPI_COMM_WORLD_LOCAL_RANK", "0")],
                "OMPI_COMM_WORLD_LOCAL_SIZE is not set",
            ),
            (
                &[
                    ("RANK", "0"),
                    ("WORLD_SIZE", "4"),
                    ("LOCAL_RANK", "0"),
                    ("LOCAL_WORLD_SIZE", "8"),
                ],
                "local world size 8 is above the world size 4",
            ),
            (
                &[
                    ("RANK", "0"),
                    ("WORLD_SIZE", "4"),
                    ("GROUP_RANK", "2"),
                    ("GROUP_WORLD_SIZE", "2"),
                ],
                "GROUP_RANK=2, GROUP_WORLD_SIZE=2): node index 2 is not below the node count 2",
            ),
            (
                &[
                    ("SLURM_PROCID", "0"),
                    ("SLURM_NTASKS", "2"),
                    ("SLURM_NNODES", "3"),
                ],
                "node count 3 is not 1 to the world size 2",
            ),
            (
                &[("SLURM_LOCALID", "1")],
                "SLURM_TASKS_PER_NODE are not set",
            ),
            (
                &[
                    ("SLURM_LOCALID", "0"),
                    ("SLURM_TASKS_PER_NODE", "2(x1)"),
                    ("SLURM_NODEID", "1"),
                ],
                "no entry for node 1",
            ),
            (
                &[("KSPEED_LOCAL_RANK", "3"), ("KSPEED_LOCAL_WORLD_SIZE", "2")],
                "KSPEED_LOCAL_RANK=3, KSPEED_LOCAL_WORLD_SIZE=2): local rank 3",
            ),
        ] {
            let e = Launcher::from_vars(lookup(vars)).unwrap_err();
            assert!(matches!(e, Error::BadLauncher { .. }), "{vars:?}: {e}");
            assert!(e.to_string().contains(what), "{vars:?}: {e}");
        }
    }
}
