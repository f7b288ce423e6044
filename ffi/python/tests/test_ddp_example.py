"""The README's DDP training loop (examples/train_ddp.py, shown verbatim in
README.md) run as written: torchrun with 2 CPU ranks (gloo), a
StatefulDataLoader with 2 workers, OneCycleLR sized with len(dl) * epochs,
stopped mid-epoch with a checkpoint and resumed to the end."""

import os
import re
import subprocess
import sys

import pytest

from conftest import cli, make_tree, require

require("torch")
require("torchdata")

from kspeed.torch import KSpeedDataset  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE = os.path.join(HERE, "..", "examples", "train_ddp.py")
README = os.path.join(HERE, "..", "README.md")


def test_readme_shows_the_example_verbatim():
    with open(EXAMPLE) as f:
        code = f.read()
    with open(README) as f:
        readme = f.read()
    blocks = re.findall(r"```python\n(.*?)```", readme, re.S)
    assert code in blocks, "README.md's DDP loop differs from examples/train_ddp.py"


def torchrun(*args):
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                        EXAMPLE, *map(str, args)], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


# Two torchrun jobs of up to 600 s each (on a quiet machine, ~20 s in all).
@pytest.mark.timeout(1500)
def test_the_readme_ddp_loop_trains_and_resumes(tmp_path):
    src = make_tree(str(tmp_path / "src"), n=1000, max_len=3000)
    space = tmp_path / "space"
    cli("preload", "--source", src, "--space", space)
    # What one epoch is per rank: the DataLoader batches of 32 (drop_last)
    # that 2 workers make of the rank's 500 samples.
    per_epoch = KSpeedDataset(str(space), rank=0, world=2).batches_per_epoch(32, 2, drop_last=True)
    assert per_epoch == 2 * (250 // 32)
    epochs, stop = 3, per_epoch + per_epoch // 2 + 1
    ckpt = tmp_path / "ckpt"
    out = torchrun(space, ckpt, epochs, stop)
    for rank in (0, 1):
        assert f"rank {rank}: stopped at epoch 1, step {stop}" in out, out
    assert sorted(os.listdir(ckpt)) == ["rank0.pt", "rank1.pt"]
    out = torchrun(space, ckpt, epochs)
    for rank in (0, 1):
        assert f"rank {rank}: resumed at epoch 1, step {stop}" in out, out
        # Exactly len(dl) * epochs steps: OneCycleLR raises past its total.
        assert f"rank {rank}: trained {epochs * per_epoch} steps of {epochs * per_epoch}" in out, out
