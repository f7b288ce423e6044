#!/usr/bin/env python3
"""fn.kspeed.reader against fn.readers.file in DALI pipelines (CPU,
device_id=None), batch 64, pad_last_batch=True, one epoch per run, medians of
--runs runs, same
files, alternating:

  cold  : page cache dropped before every run (root needed):
          kspeed (space on the same disk), readers.file (mmap, the default),
          readers.file dont_use_mmap=True; fio randread of the space's
          extents at 128 KiB, QD 32, O_DIRECT as the disk's own limit.
  warm  : the dataset in kspeed's memory tier (epoch 0 fills it, epoch 1 is
          timed) against readers.file over a warm page cache (epoch 1);
          kspeed both with tier_views (the default: copied from the tier
          straight into DALI's output) and without (through the ring).
  jpeg  : real JPEGs (made with Pillow), each reader followed by
          fn.decoders.image on the CPU, cold.

Run with the DALI virtual environment's python (ffi/dali/build_and_test.sh
makes one and builds the plugin). With MALLOC_MMAP_THRESHOLD_ and
MALLOC_TRIM_THRESHOLD_ set (ffi/dali/README.md, "Performance"), glibc keeps
DALI's per-iteration output buffers instead of mapping them afresh; the
header line says when they are set (they apply to every reader alike):

  target/dali-venv/bin/python scripts/bench_dali.py [--runs 3] [--work /var/tmp/kspeed-bench]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "ffi", "dali"))
import kspeed_dali  # noqa: E402

kspeed_dali.load(os.environ.get("KSPEED_DALI_PLUGIN", os.path.join(ROOT, "target/dali-build/libkspeed_dali.so")))
from nvidia.dali import fn, pipeline_def  # noqa: E402

K = os.environ.get("KSPEED_BIN", os.path.join(ROOT, "target/dali-prefix/bin/kspeed"))
BATCH = 64


def sh(*a):
    return subprocess.run(a, check=True, capture_output=True, text=True).stdout


def drop_caches():
    subprocess.run("sync", check=True)
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def pipe_kspeed(space, decode=False, tier="0", views=True):
    @pipeline_def(batch_size=BATCH, num_threads=2, device_id=None)
    def p():
        # tier_views only when off: a plugin older than that argument
        # (KSPEED_DALI_PLUGIN, for an A/B) still runs the other parts.
        extra = {} if views else {"tier_views": False}
        raw, label = fn.kspeed.reader(space=space, random_shuffle=True, seed=1, name="Reader", pad_last_batch=True,
                                      tier_bytes=tier, mlock=False, ring_bytes="256MiB", **extra)
        return (fn.decoders.image(raw, device="cpu") if decode else raw), label
    return p()


def pipe_file(src, decode=False, mmap=True):
    @pipeline_def(batch_size=BATCH, num_threads=2, device_id=None)
    def p():
        raw, label = fn.readers.file(file_root=src, random_shuffle=True, seed=1, name="Reader", pad_last_batch=True,
                                     dont_use_mmap=not mmap)
        return (fn.decoders.image(raw, device="cpu") if decode else raw), label
    return p()


def epoch_sps(make, cold, warm_epochs=0):
    pipe = make()
    pipe.build()
    n = pipe.epoch_size("Reader")
    iters = -(-n // BATCH)
    for _ in range(warm_epochs * iters):
        pipe.run()
    if cold:
        drop_caches()
    t0 = time.time()
    for _ in range(iters):
        out = pipe.run()
        out[0].at(0)  # touch: the batch is ready
    secs = time.time() - t0
    del pipe
    return iters * BATCH / secs


def fio_extents(space):
    ext = os.path.join(space, "extents")
    files = [os.path.join(ext, f) for f in sorted(os.listdir(ext))]
    drop_caches()
    out = sh("fio", "--name=ref", "--direct=1", "--ioengine=io_uring", "--readonly", "--rw=randread", "--bs=128k",
             "--iodepth=32", "--size=100%", "--io_size=2G", "--output-format=json", "--filename=" + ":".join(files))
    j = json.loads(out[out.index("{"):])["jobs"][0]["read"]
    return j["bw_bytes"] / 1e9


def make_jpegs(root, count):
    import numpy as np
    from PIL import Image
    if os.path.isdir(root) and sum(len(f) for _, _, f in os.walk(root)) >= count:
        return
    rng = np.random.default_rng(0)
    for i in range(count):
        d = os.path.join(root, f"class{i % 10:02d}")
        os.makedirs(d, exist_ok=True)
        h, w = int(rng.integers(300, 500)), int(rng.integers(300, 500))
        y, x = np.mgrid[0:h, 0:w]
        img = np.stack([x * 255 // w, y * 255 // h, (x + y) * 127 // (w + h)], -1)
        img = np.clip(img + rng.integers(0, 60, img.shape), 0, 255).astype(np.uint8)
        Image.fromarray(img).save(os.path.join(d, f"{i:06d}.jpg"), quality=90)


def row(name, vals, refs=None):
    """One table row; with the reference's runs (alternating with these), the
    ratio of the medians and the median of the per-run ratios."""
    m = statistics.median(vals)
    ratio = ""
    if refs:
        paired = statistics.median(v / r for v, r in zip(vals, refs))
        ratio = f"{m / statistics.median(refs):.2f}x (paired {paired:.2f}x)"
    print(f"| {name} | {m:,.0f} | {ratio} | {', '.join(f'{v:,.0f}' for v in vals)} |")
    return vals


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--work", default="/var/tmp/kspeed-bench")
    ap.add_argument("--count", type=int, default=20000)
    ap.add_argument("--jpegs", type=int, default=3000)
    ap.add_argument("--only", choices=["cold", "warm", "jpeg"], action="append",
                    help="run only these parts (repeatable; default all)")
    a = ap.parse_args()
    parts = set(a.only or ["cold", "warm", "jpeg"])
    src = os.path.join(a.work, f"src-imagenet-{a.count}")
    space = os.path.join(a.work, f"sp-imagenet-{a.count}")
    if not os.path.isdir(src):
        sh(K, "gen", "--profile", "imagenet", "--count", str(a.count), "--out", src)
    sh(K, "--progress", "none", "preload", "--source", src, "--space", space)
    tuning = " ".join(f"{k}={os.environ[k]}" for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
                      if k in os.environ)
    print(f"# DALI {__import__('nvidia.dali').dali.__version__}, {os.cpu_count()} cores, batch {BATCH}, "
          f"median of {a.runs}{', ' + tuning if tuning else ''}\n")

    if "cold" in parts:
        cold(a, src, space)
    if "warm" in parts:
        warm(a, src, space)
    if "jpeg" in parts:
        jpeg(a)


def cold(a, src, space):
    print(f"## cold page cache, imagenet profile, {a.count} samples\n")
    print("| reader | samples/s | vs readers.file (medians; paired per run) | runs |\n|---|---|---|---|")
    ks, fm, fn_ = [], [], []
    for _ in range(a.runs):
        ks.append(epoch_sps(lambda: pipe_kspeed(space), cold=True))
        fm.append(epoch_sps(lambda: pipe_file(src), cold=True))
        fn_.append(epoch_sps(lambda: pipe_file(src, mmap=False), cold=True))
    row("fn.readers.file (mmap)", fm)
    row("fn.readers.file (dont_use_mmap)", fn_, fm)
    row("fn.kspeed.reader", ks, fm)
    bw = statistics.median(fio_extents(space) for _ in range(a.runs))
    mean = os.path.getsize(os.path.join(space, "extents", sorted(os.listdir(os.path.join(space, "extents")))[0]))
    print(f"\nfio randread 128 KiB QD 32 O_DIRECT on the extents: {bw:.2f} GB/s "
          f"(= {bw * 1e9 / (2.6e9 / a.count):,.0f} samples/s at this profile's mean size)\n")


def warm(a, src, space):
    print("## warm: whole set in kspeed's memory tier vs readers.file over a warm page cache\n")
    print("| reader | samples/s | vs readers.file (medians; paired per run) | runs |\n|---|---|---|---|")
    ks, kr, fm = [], [], []
    for _ in range(a.runs):
        ks.append(epoch_sps(lambda: pipe_kspeed(space, tier="8GiB"), cold=False, warm_epochs=1))
        kr.append(epoch_sps(lambda: pipe_kspeed(space, tier="8GiB", views=False), cold=False, warm_epochs=1))
        fm.append(epoch_sps(lambda: pipe_file(src), cold=False, warm_epochs=1))
    row("fn.readers.file (mmap), warm", fm)
    row("fn.kspeed.reader, memory tier (tier_views, the default)", ks, fm)
    row("fn.kspeed.reader, memory tier, tier_views=False (through the ring)", kr, fm)


def jpeg(a):
    jroot = os.path.join(a.work, f"jpeg-{a.jpegs}")
    make_jpegs(jroot, a.jpegs)
    jspace = os.path.join(a.work, f"sp-jpeg-{a.jpegs}")
    sh(K, "--progress", "none", "preload", "--source", jroot, "--space", jspace)
    print(f"\n## real JPEGs ({a.jpegs}, ~300-500 px), reader + fn.decoders.image on the CPU, cold\n")
    print("| pipeline | samples/s | vs readers.file (medians; paired per run) | runs |\n|---|---|---|---|")
    ks, fm = [], []
    for _ in range(a.runs):
        ks.append(epoch_sps(lambda: pipe_kspeed(jspace, decode=True), cold=True))
        fm.append(epoch_sps(lambda: pipe_file(jroot, decode=True), cold=True))
    row("fn.readers.file + decoders.image", fm)
    row("fn.kspeed.reader + decoders.image", ks, fm)


if __name__ == "__main__":
    main()
