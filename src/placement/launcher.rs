//! This process's local rank among the node's ranks, for the core plan:
//! explicit options, or the launcher's environment as
//! [`crate::launcher::Launcher`] reads it (the same reading the cluster
//! path and Python's `kspeed.launch_env()` use).

use crate::error::{Error, Result};
use crate::launcher::{Launcher, NO_LAUNCHER};

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
            origin: NO_LAUNCHER.into(),
        }
    }

    /// Explicit values, checked.
    pub fn explicit(rank: u32, size: u32) -> Result<LocalRank> {
        if size == 0 {
            return Err(Error::BadPlacement {
                origin: "local rank option".into(),
                reason: "local world size 0".into(),
            });
        }
        if rank >= size {
            return Err(Error::BadPlacement {
                origin: "local rank option".into(),
                reason: format!("local rank {rank} is not below local world size {size}"),
            });
        }
        Ok(LocalRank {
            rank,
            size,
            origin: "option".into(),
        })
    }

    /// The launcher's local rank and local world ([`Launcher::local_rank`],
    /// [`Launcher::local_world`]).
    pub fn of(launcher: &Launcher) -> LocalRank {
        LocalRank {
            rank: launcher.local_rank,
            size: launcher.local_world,
            origin: launcher.local_from.clone(),
        }
    }

    /// From the environment: kspeed's own `KSPEED_LOCAL_RANK` and
    /// `KSPEED_LOCAL_WORLD_SIZE` (to override a launcher's, in any
    /// binding), then torchrun, Open MPI, MPICH/PMI and SLURM, as
    /// [`Launcher::from_env`] reads them; rank 0 of 1 when none is set.
    /// Only the local variables are read: a one-node loader does not fail
    /// on a launcher's rank, world or node variables it does not use.
    /// Malformed or contradictory local variables are an
    /// [`Error::BadLauncher`] naming them.
    pub fn from_env() -> Result<LocalRank> {
        Self::from_vars(|k| std::env::var(k).ok())
    }

    /// [`LocalRank::from_env`] over any variable lookup (for tests).
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<LocalRank> {
        let (rank, size, origin) = Launcher::local_from_vars(&var)?;
        Ok(LocalRank { rank, size, origin })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
            (
                vars(&[("LOCAL_RANK", "1")]),
                "LOCAL_WORLD_SIZE is not set while LOCAL_RANK is",
            ),
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
            assert!(matches!(e, Error::BadLauncher { .. }), "{e}");
            assert!(e.to_string().contains(what), "{e}");
        }
        assert!(LocalRank::explicit(2, 2).is_err());
    }

    /// Placement reads only the local variables: a launcher's rank, world
    /// or node variables it does not use, malformed, do not fail a one-node
    /// loader (before, the whole launcher parse ran and they did).
    #[test]
    fn global_variables_do_not_fail_placement() {
        let vars = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                pairs
                    .iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| v.to_string())
            }
        };
        for (env, want) in [
            (
                &[
                    ("RANK", "1"),
                    ("LOCAL_RANK", "1"),
                    ("LOCAL_WORLD_SIZE", "2"),
                ][..],
                (1, 2),
            ),
            (&[("RANK", "1")][..], (0, 1)),
            (&[("WORLD_SIZE", "x")][..], (0, 1)),
            // sbatch without -n: SLURM_PROCID but no SLURM_NTASKS.
            (
                &[
                    ("SLURM_PROCID", "0"),
                    ("SLURM_LOCALID", "1"),
                    ("SLURM_TASKS_PER_NODE", "2"),
                    ("SLURM_NODEID", "0"),
                    ("SLURM_NNODES", "1"),
                ][..],
                (1, 2),
            ),
            (
                &[
                    ("RANK", "1"),
                    ("WORLD_SIZE", "2"),
                    ("LOCAL_RANK", "1"),
                    ("LOCAL_WORLD_SIZE", "2"),
                    ("GROUP_RANK", "x"),
                ][..],
                (1, 2),
            ),
            (
                &[
                    ("OMPI_COMM_WORLD_RANK", "9"),
                    ("OMPI_COMM_WORLD_SIZE", "8"),
                    ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
                    ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
                ][..],
                (1, 2),
            ),
            (&[("PMI_SIZE", "4"), ("SLURM_NNODES", "0")][..], (0, 1)),
        ] {
            let l = LocalRank::from_vars(vars(env)).unwrap_or_else(|e| panic!("{env:?}: {e}"));
            assert_eq!((l.rank, l.size), want, "{env:?}");
        }
    }
}
