#!/usr/bin/env bash
# The GPU check of KSpeedImageFolder's decode="cuda" (issue 32, part 2), for
# a machine with an NVIDIA GPU (the device tool's machine, or any other).
# Runs in under 3 minutes and prints its figures:
#
#   1. COUNT (default 2000) ImageNet-like JPEGs (500x375 and 375x500,
#      quality 90, smooth content plus noise) written with torchvision's
#      encoder, preloaded with kspeed.preload;
#   2. decode="cuda": 3 epochs (the first pays nvJPEG's start), images/s,
#      GPU memory, shape/dtype/device, every sample once;
#   3. the same epoch decoded on the CPU's threads (decode=True): images/s,
#      whether its batches are pinned, and the H2D rate of
#      images.cuda(non_blocking=True);
#   4. agreement: the same samples from both paths (same seed, so the same
#      crop boxes): mean absolute difference per image (nvJPEG's pixels
#      against libjpeg-turbo's, resize in float against uint8), must be
#      under 0.02 on the [0, 1] scale;
#   5. for reference, torchvision.io.decode_jpeg(list, device="cuda") alone
#      on the same bytes (nvJPEG's ceiling here).
#
#   scripts/gpu_decode_check.sh [COUNT=2000] [WORKDIR=/tmp/kspeed-gpu-decode]
#
# Needs a python ($PYTHON, default python3) with torch and torchvision built
# with CUDA. kspeed: the installed package, or a wheel (KSPEED_WHEEL=FILE,
# e.g. from scripts/build_python_wheel.sh, carried along: the device
# machine has no network), installed into WORKDIR/site with pip --no-deps.
# Exit status: 0 when every check passed, 1 when one failed, 2 when the
# machine lacks what the check needs (said on stderr).
set -euo pipefail
cd "$(dirname "$0")/.."
COUNT=${1:-2000}
W=${2:-/tmp/kspeed-gpu-decode}
PY=${PYTHON:-python3}
rm -rf "$W"
mkdir -p "$W"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader \
  || echo "nvidia-smi: not found"
if [ -n "${KSPEED_WHEEL:-}" ]; then
  "$PY" -m pip install -q --disable-pip-version-check --no-deps --target "$W/site" "$KSPEED_WHEEL"
  export PYTHONPATH="$W/site${PYTHONPATH:+:$PYTHONPATH}"
fi
# The ring is locked in memory: lift the limit where we may.
ulimit -l unlimited 2>/dev/null || true
exec timeout 170 "$PY" - "$COUNT" "$W" <<'EOF'
import os
import sys
import time

count, work = int(sys.argv[1]), sys.argv[2]
try:
    import torch
    import torchvision
    from torchvision.io import ImageReadMode, decode_jpeg, encode_jpeg

    import kspeed
    from kspeed.torch import KSpeedImageFolder
except ImportError as e:
    sys.exit(print(f"gpu_decode_check: cannot run: {e} (torch, torchvision and kspeed are needed; "
                   f"KSPEED_WHEEL=FILE installs a kspeed wheel)", file=sys.stderr) or 2)
if not torch.cuda.is_available():
    sys.exit(print(f"gpu_decode_check: cannot run: torch {torch.__version__} sees no CUDA device",
                   file=sys.stderr) or 2)
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), torchvision {torchvision.__version__}, "
      f"kspeed {kspeed.__version__}, {torch.cuda.get_device_name()}, {os.cpu_count()} CPUs")
failed = []


def check(ok, what):
    print(("ok: " if ok else "FAILED: ") + what)
    if not ok:
        failed.append(what)


# 1. The files, then the space.
t = time.perf_counter()
src = os.path.join(work, "src")
g = torch.Generator().manual_seed(1)
bases = {}
for shape in ((375, 500), (500, 375)):
    h, w = shape
    y = torch.linspace(0, 1, h).view(h, 1)
    x = torch.linspace(0, 1, w).view(1, w)
    bases[shape] = [(torch.stack([128 + 100 * torch.sin(6 * x * (c + 1) + 4 * y + k) for c in range(3)])
                     + torch.randn(3, h, w, generator=g) * 20).clamp(0, 255).to(torch.uint8) for k in range(4)]


def write(i):
    h, w = (375, 500) if i % 3 else (500, 375)
    # Each file its own content: one of the base images, shifted.
    img = torch.roll(bases[(h, w)][i % 4], shifts=((i * 37) % h, (i * 53) % w), dims=(1, 2))
    d = os.path.join(src, f"c{i % 10}")
    os.makedirs(d, exist_ok=True)
    data = encode_jpeg(img, quality=90)
    with open(os.path.join(d, f"{i:06d}.jpg"), "wb") as f:
        f.write(data.numpy().tobytes())
    return data.numel()


from concurrent.futures import ThreadPoolExecutor

with ThreadPoolExecutor(min(16, os.cpu_count() or 1)) as ex:
    nbytes = sum(ex.map(write, range(count)))
space = os.path.join(work, "space")
kspeed.preload(src, space)
print(f"{count} JPEGs ({nbytes / count / 1e3:.0f} KB mean) written and preloaded in {time.perf_counter() - t:.1f} s")


def epoch(ds, keep=None):
    torch.cuda.synchronize()
    t = time.perf_counter()
    ids, first = [], None
    for images, labels, b in ds:
        ids += b.tolist()
        if first is None:
            first = (images, b)
        if keep is not None:
            keep(images)
    torch.cuda.synchronize()
    return time.perf_counter() - t, ids, first


# 2. decode="cuda".
kw = dict(random_resized_crop=224, batch_size=256, seed=7, return_id=True, ring_bytes="256MiB")
gpu = KSpeedImageFolder(space, decode="cuda", **kw)
shapes = set()
torch.cuda.reset_peak_memory_stats()
rates = []
for e in range(3):
    gpu.set_epoch(e)
    secs, ids, first = epoch(gpu, lambda im: shapes.add((tuple(im.shape[1:]), im.dtype, im.device.type)))
    rates.append(count / secs)
    check(sorted(ids) == list(range(count)), f"decode='cuda' epoch {e}: every sample once ({len(ids)} delivered)")
    if e == 0:
        gpu_first = first
print("decode='cuda': " + ", ".join(f"epoch {e}: {r:,.0f} images/s" for e, r in enumerate(rates))
      + f"; peak GPU memory {torch.cuda.max_memory_allocated() / 2**20:,.0f} MiB")
check(shapes == {((3, 224, 224), torch.float32, "cuda")}, f"decode='cuda' batches are {shapes}")

# 3. The CPU's threads, pinned batches.
cpu = KSpeedImageFolder(space, decode=True, **kw)
pinned, h2d = [], [0, 0.0]


def to_gpu(im):
    pinned.append(im.is_pinned())
    t = time.perf_counter()
    im.cuda(non_blocking=True)
    torch.cuda.synchronize()
    h2d[0] += im.numel() * im.element_size()
    h2d[1] += time.perf_counter() - t


secs, ids, cpu_first = epoch(cpu, to_gpu)
print(f"decode=True (CPU, {len(os.sched_getaffinity(0))} threads): {count / secs:,.0f} images/s, "
      f"H2D of the batches {h2d[0] / h2d[1] / 1e9:.1f} GB/s")
check(sorted(ids) == list(range(count)), "decode=True: every sample once")
check(all(pinned), "decode=True batches are pinned (ready for .cuda(non_blocking=True))")

# 4. Agreement on the first batch of epoch 0 (the same ids: same order).
(gi, gids), (ci, cids) = gpu_first, cpu_first
check(gids.tolist() == cids.tolist(), "both paths deliver the same sample order")
diff = (gi.cpu() - ci).abs().flatten(1).mean(1)
print(f"agreement, nvJPEG vs CPU, first batch: mean |difference| per image median {diff.median():.4f}, "
      f"max {diff.max():.4f} (pixels in [0, 1])")
check(float(diff.max()) < 0.02, "nvJPEG's batches match the CPU's crops (max mean difference < 0.02)")

# 5. nvJPEG alone on the same bytes, batches of 256.
files = sorted(os.path.join(d, f) for d, _, fs in os.walk(src) for f in fs)
datas = [torch.frombuffer(bytearray(open(p, "rb").read()), dtype=torch.uint8) for p in files]
decode_jpeg(datas[:256], mode=ImageReadMode.RGB, device="cuda")
torch.cuda.synchronize()
t = time.perf_counter()
for i in range(0, count, 256):
    decode_jpeg(datas[i:i + 256], mode=ImageReadMode.RGB, device="cuda")
torch.cuda.synchronize()
print(f"torchvision.io.decode_jpeg(list, device='cuda') alone: {count / (time.perf_counter() - t):,.0f} images/s")
print("gpu_decode_check: " + ("every check passed" if not failed else f"{len(failed)} check(s) FAILED"))
sys.exit(1 if failed else 0)
EOF
