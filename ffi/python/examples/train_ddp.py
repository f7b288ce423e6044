"""DDP training fed by kspeed, with exact resume from checkpoints.

    torchrun --nproc-per-node=8 train_ddp.py /nvme/kspeed/train /ckpt 90 [MAX_STEPS]

SPACE is a preloaded space (`kspeed preload`), CKPT_DIR holds one checkpoint
per rank, EPOCHS sizes the LR schedule, and MAX_STEPS (optional) stops this
run after that many steps with a checkpoint (a job with a time limit): run
the same command again to go on exactly where it stopped.
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torchdata.stateful_dataloader import StatefulDataLoader

from kspeed.torch import KSpeedDataset

space, ckpt_dir, epochs = sys.argv[1], sys.argv[2], int(sys.argv[3])
max_steps = int(sys.argv[4]) if len(sys.argv) > 4 else None

cuda = torch.cuda.is_available()
dist.init_process_group("nccl" if cuda else "gloo")
rank = dist.get_rank()
device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")


def features(t):
    """Stands in for decoding and augmenting (e.g. torchvision.io.decode_jpeg
    and transforms.v2): here, the sample's first 256 bytes as floats. It
    gets a uint8 tensor over kspeed's ring and returns new memory."""
    x = torch.zeros(256)
    n = min(t.numel(), 256)
    x[:n] = t[:n].float() / 255
    return x


# rank and world come from torchrun; each DataLoader worker builds its own loader.
ds = KSpeedDataset(space, batch_size=64, seed=42, transform=features, ring_bytes="64MiB")
dl = StatefulDataLoader(ds, batch_size=32, num_workers=2, drop_last=True, pin_memory=cuda)
classes = len(ds.catalog.class_names)
model = DDP(torch.nn.Linear(256, classes).to(device), device_ids=[device.index] if cuda else None)
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
# len(dl) is exactly the batches one epoch yields (per rank, the same on every rank).
sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=len(dl) * epochs)

# One checkpoint per rank: the model is the same everywhere, the position in
# the data is each rank's own.
os.makedirs(ckpt_dir, exist_ok=True)
ckpt = os.path.join(ckpt_dir, f"rank{rank}.pt")
start_epoch, step = 0, 0
if os.path.exists(ckpt):
    state = torch.load(ckpt, weights_only=False)
    model.module.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    sched.load_state_dict(state["sched"])
    dl.load_state_dict(state["data"])
    start_epoch, step = state["epoch"], state["step"]
    print(f"rank {rank}: resumed at epoch {start_epoch}, step {step}", flush=True)


def save(epoch):
    state = {"model": model.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
             "data": dl.state_dict(), "epoch": epoch, "step": step}
    torch.save(state, ckpt + ".tmp")
    os.replace(ckpt + ".tmp", ckpt)


for epoch in range(start_epoch, epochs):
    ds.set_epoch(epoch)  # a resumed epoch goes on from the checkpoint's position
    for x, y in dl:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        step += 1
        if step % 100 == 0 or step == max_steps:
            save(epoch)
        if step == max_steps:
            print(f"rank {rank}: stopped at epoch {epoch}, step {step}", flush=True)
            dist.destroy_process_group()
            sys.exit(0)
print(f"rank {rank}: trained {step} steps of {len(dl) * epochs}", flush=True)
dist.destroy_process_group()
