"""A GPU ring seen from Python: DLPack reports the CUDA device and the
capsules describe the samples' device memory. No machine here has a GPU or
an RDMA NIC, so this runs vm_gpu_ring.py in the soft-RoCE VM
(../shared/rdma-vm/run-in-vm.sh, or $KSPEED_RDMA_VM) with the CUDA driver
stand-in (tests/c/fake_cuda.c, whose "device memory" is host memory reached
only through its copy calls); the node's RDMA writes, the ring's allocation
and registration, and the Python package are the real ones."""

import os
import shutil
import subprocess
import sys

import pytest

import kspeed
from conftest import REPO, cli, kspeed_bin, make_tree, must_run

VM = os.environ.get("KSPEED_RDMA_VM") or os.path.join(REPO, "..", "shared", "rdma-vm", "run-in-vm.sh")


# The VM boots and runs for up to 900 s (its own limit), above the suite's
# 600 s per test.
@pytest.mark.timeout(1500)
def test_gpu_ring_batches_through_dlpack_over_rdma_in_the_vm(tmp_path):
    if not kspeed.HAS_RDMA:
        must_run("this kspeed package was built without RDMA")
    if not os.path.exists(VM):
        must_run(f"no soft-RoCE VM runner at {VM}")
    if not shutil.which("gcc"):
        must_run("gcc is missing (it builds the CUDA stand-in)")
    lib = tmp_path / "lib"
    lib.mkdir()
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-Wall", "-Werror", "-DFAKE_DRIVER", "-o",
                    str(lib / "libcuda.so.1"), os.path.join(REPO, "tests", "c", "fake_cuda.c")], check=True,
                   timeout=300)
    src = make_tree(str(tmp_path / "src"), n=150, max_len=30000)
    space = str(tmp_path / "space")
    cli("preload", "--source", src, "--space", space)
    token = tmp_path / "token"
    token.write_text("gpu-ring-job\n")
    token.chmod(0o600)
    env = dict(os.environ, LD_LIBRARY_PATH=str(lib), FAKE_CUDA_LOG=str(tmp_path / "calls.log"))
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vm_gpu_ring.py")
    r = subprocess.run([VM, "--timeout", "900", "--share", str(tmp_path), "--", sys.executable, script, src, space,
                        str(token), kspeed_bin()], env=env, capture_output=True, text=True, timeout=1200)
    calls = (tmp_path / "calls.log").read_text() if (tmp_path / "calls.log").exists() else ""
    out = f"--- stdout\n{r.stdout}\n--- stderr\n{r.stderr[-6000:]}\n--- CUDA calls\n{calls[-3000:]}"
    assert r.returncode == 0, out
    assert "ok: 300 samples over RDMA into the GPU ring" in r.stdout, out
    assert "alloc " in calls and "export " in calls, out
    # The ring freed and every context released when the process ended.
    exits = [line for line in calls.splitlines() if line.startswith("exit ")]
    assert exits and exits[-1] == "exit registered=0 retained=0 allocated=0", out
