"""kspeed.launch_env() is the Rust crate's reading of the launcher's
environment (kspeed::launcher::Launcher): the same answer for every
launcher as the Rust loader's core placement and rank, and the same named
errors."""

import pytest

import kspeed

# Every launcher's variables as it sets them for rank 5 of 8 on 2 nodes of
# 4 (local rank 1, node 1); the same table as the Rust test
# transport::cluster::tests::every_launcher_gives_cluster_and_placement_the_same_answer.
LAUNCHERS = [
    ("torchrun", "LOCAL_RANK/LOCAL_WORLD_SIZE", {
        "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
        "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2"}),
    ("openmpi", "OMPI_COMM_WORLD_LOCAL_RANK/OMPI_COMM_WORLD_LOCAL_SIZE", {
        "OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}),
    ("mpich", "MPI_LOCALRANKID/MPI_LOCALNRANKS", {
        "PMI_RANK": "5", "PMI_SIZE": "8", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "4"}),
    ("slurm", "SLURM_LOCALID/SLURM_TASKS_PER_NODE", {
        "SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
        "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_NODEID": "1", "SLURM_NNODES": "2"}),
    # mpirun inside a SLURM allocation: Open MPI's variables win.
    ("openmpi", "OMPI_COMM_WORLD_LOCAL_RANK/OMPI_COMM_WORLD_LOCAL_SIZE", {
        "OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
        "SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_LOCALID": "0", "SLURM_NTASKS_PER_NODE": "1"}),
    # torchrun started by srun, one task per node.
    ("torchrun", "LOCAL_RANK/LOCAL_WORLD_SIZE", {
        "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
        "SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0",
        "SLURM_TASKS_PER_NODE": "1(x2)", "SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "gpu[1-2]"}),
]

ALL_VARS = sorted({k for _, _, env in LAUNCHERS for k in env} | {
    "KSPEED_LOCAL_RANK", "KSPEED_LOCAL_WORLD_SIZE", "SLURM_NODELIST", "SLURM_NTASKS_PER_NODE"})


@pytest.fixture
def clean_env(monkeypatch):
    for k in ALL_VARS:
        monkeypatch.delenv(k, raising=False)
    return monkeypatch


@pytest.mark.parametrize("name,local_from,env", LAUNCHERS)
def test_every_launcher(name, local_from, env, clean_env):
    e = kspeed.launch_env(env)
    assert (e.launcher, e.rank, e.world, e.local_rank, e.local_world_size, e.node, e.nodes) == (
        name, 5, 8, 1, 4, 1, 2), e
    assert e.local_rank_from == local_from
    assert e[:2] == (5, 8) and e.origin.startswith("environment variables ")
    # The process environment gives the same as the mapping.
    for k, v in env.items():
        clean_env.setenv(k, v)
    assert kspeed.launch_env() == e and vars(kspeed.launch_env()) == vars(e)


@pytest.mark.parametrize("name,local_from,env", LAUNCHERS)
def test_loader_reads_what_launch_env_reads(name, local_from, env, space, clean_env):
    """The Rust loader's rank and core placement agree with launch_env()
    under every launcher (before, Python read only torchrun and SLURM:
    under mpirun the loader was rank 0 of 1 while placement found local
    rank 1 of 4)."""
    for k, v in env.items():
        clean_env.setenv(k, v)
    e = kspeed.launch_env()
    with kspeed.Loader(space, batch_size=4, ring_bytes="256KiB") as loader:
        assert (loader.rank, loader.world) == (e.rank, e.world) == (5, 8)
        p = loader.stats()["placement"]
    assert (p["local_rank"], p["local_world_size"], p["local_rank_from"]) == (
        e.local_rank, e.local_world_size, e.local_rank_from), (p, e)


def test_no_launcher(clean_env):
    e = kspeed.launch_env({})
    assert tuple(e) == (0, 1, "defaults (no launcher's rank and world in the environment)")
    assert (e.launcher, e.local_rank, e.local_world_size, e.nodelist) == ("none", 0, 1, None)
    e = kspeed.launch_env({"KSPEED_LOCAL_RANK": "1", "KSPEED_LOCAL_WORLD_SIZE": "2"})
    assert (e.launcher, e.local_rank, e.local_world_size, e.local_rank_from) == (
        "none", 1, 2, "KSPEED_LOCAL_RANK/KSPEED_LOCAL_WORLD_SIZE")


def test_kspeed_local_rank_is_placement_only():
    """KSPEED_LOCAL_RANK=0 KSPEED_LOCAL_WORLD_SIZE=1 (the core-binding
    override) changes the local rank, not the node: node 1 of 2 under
    mpirun (before, node 5 of 8); `srun --mpi=pmi2` takes SLURM_NODEID over
    uneven tasks per node (before, 6 / 3 = node 2 of 3)."""
    e = kspeed.launch_env({
        "OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
        "KSPEED_LOCAL_RANK": "0", "KSPEED_LOCAL_WORLD_SIZE": "1"})
    assert (e.launcher, e.local_rank, e.local_world_size, e.node, e.nodes) == ("openmpi", 0, 1, 1, 2), e
    e = kspeed.launch_env({
        "PMI_RANK": "6", "PMI_SIZE": "7", "SLURM_PROCID": "6", "SLURM_NTASKS": "7",
        "SLURM_LOCALID": "2", "SLURM_TASKS_PER_NODE": "4,3", "SLURM_NODEID": "1", "SLURM_NNODES": "2"})
    assert (e.launcher, e.local_rank, e.local_world_size, e.node, e.nodes) == ("mpich", 2, 3, 1, 2), e
    assert (e.node_from, e.nodes_from) == ("SLURM_NODEID", "SLURM_NNODES")


@pytest.mark.parametrize("env,what", [
    ({"RANK": "1"}, "(RANK=1): WORLD_SIZE is not set while RANK is"),
    ({"RANK": "0", "WORLD_SIZE": "x"}, 'WORLD_SIZE="x"): not a number'),
    ({"OMPI_COMM_WORLD_RANK": "4", "OMPI_COMM_WORLD_SIZE": "4"}, "rank 4 is not below world size 4"),
    ({"MPI_LOCALRANKID": "2", "MPI_LOCALNRANKS": "2"}, "local rank 2 is not below local world size 2"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "4"},
     "local world size 4 is above the world size 2"),
])
def test_contradictions_are_named(env, what):
    with pytest.raises(kspeed.ConfigError) as e:
        kspeed.launch_env(env)
    assert e.value.kind == "BadLauncher"
    assert what in str(e.value), str(e.value)
