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
//! The local rank comes from explicit options, else from the launcher's
//! environment as [`crate::launcher::Launcher`] reads it for every path
//! (the cluster path and Python's `kspeed.launch_env()` too):
//! `KSPEED_LOCAL_RANK` and `KSPEED_LOCAL_WORLD_SIZE` first, then torchrun
//! (`LOCAL_RANK`, `LOCAL_WORLD_SIZE`), Open MPI
//! (`OMPI_COMM_WORLD_LOCAL_RANK`, `OMPI_COMM_WORLD_LOCAL_SIZE`), MPICH/PMI
//! (`MPI_LOCALRANKID`, `MPI_LOCALNRANKS`) and SLURM (`SLURM_LOCALID` with
//! `SLURM_NTASKS_PER_NODE`, or this node's entry of `SLURM_TASKS_PER_NODE`),
//! in that order (the innermost launcher first: torchrun started by srun
//! sees SLURM's variables too).
//!
//! The topology is read from a directory shaped like sysfs (`/sys`, or
//! `KSPEED_SYSFS_ROOT`): `devices/system/cpu/online`,
//! `devices/system/node/nodeN/cpulist`,
//! `devices/system/cpu/cpuN/topology/thread_siblings_list` and
//! `fs/cgroup/.../cpuset.cpus.effective`.
//!
//! The module is in three files, whose items are all here: `topology.rs`
//! (sysfs, cpusets, the CPU list format), `launcher.rs` (the local rank,
//! from [`crate::launcher::Launcher`]) and `plan.rs` (the slices and the
//! pollers' cores).

use std::time::Duration;

mod launcher;
mod plan;
mod topology;

pub use launcher::LocalRank;
pub use plan::{plan, CorePlan, PollerPlacement};
pub use topology::{affinity, format_cpulist, parse_cpulist, sysfs_root, Topology, SYSFS_ROOT_ENV};

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
