#!/usr/bin/env python3
"""kspeed's Python loader against PyTorch's DataLoader and DALI's
fn.readers.file, on the same files, batch 64, one epoch per run, medians of
--runs runs (alternating):

  cold : page cache dropped before every run (root needed). kspeed reads its
         space with its defaults (page_cache=auto: O_DIRECT, the space is
         not cached; on the same disk as the source tree); DataLoader
         reads the ImageFolder tree as raw bytes (a map-style Dataset that
         opens and reads each file, shuffled, list collate) with 0, 2, 4 and
         8 workers; DALI fn.readers.file (CPU pipeline, 2 threads) when
         nvidia-dali is installed.
  warm : over a warm page cache (the tree and the space read once, untimed):
         kspeed with its defaults (no tier; page_cache=auto sees the space
         cached and reads through the page cache), the same with
         page_cache="off" (O_DIRECT: what the default was before), and
         kspeed with the whole set in its memory tier (epoch 0 fills it,
         epoch 1 is timed) against the others; the tier twice:
         samples copied from the tier into the landing ring (the default;
         the loop takes the zero-copy array() of every batch), and with
         tier_views=True (samples handed out in place in the tier; the loop
         takes b.samples(), the per-sample zero-copy views, as the
         DataLoader rows take a list of bytes per batch).
  overhead : the same kspeed configuration (warm, memory tier) read by the
         Rust loader alone in the same process and build
         (kspeed._kspeed._bench_rust) and through the Python API
         (Loader iteration taking ids, labels, offsets, lengths and the
         zero-copy array() of every batch); the difference per batch is the
         Python layer's cost.

Every run reports samples/s and CPU seconds per GB read (the process's
user+system time, plus that of DataLoader workers).

  target/py-venv/bin/python scripts/bench_python.py [--count 10000] [--runs 3] [--work /var/tmp/kspeed-pybench]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import warnings

# DataLoader warns when asked for more workers than it thinks the machine has.
warnings.filterwarnings("ignore", message="This DataLoader will create")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BATCH = 64


def kspeed_bin():
    b = os.environ.get("KSPEED_BIN")
    if b:
        return b
    for prof in ("release", "debug"):
        p = os.path.join(ROOT, "target", prof, "kspeed")
        if os.path.exists(p):
            return p
    raise SystemExit("build the kspeed CLI first (cargo build --release) or set KSPEED_BIN")


def sh(*a):
    return subprocess.run(a, check=True, capture_output=True, text=True).stdout


def drop_caches():
    subprocess.run("sync", check=True)
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def cpu():
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


class Timer:
    def __enter__(self):
        self.w0, self.c0 = time.perf_counter(), cpu()
        return self

    def __exit__(self, *exc):
        self.wall = time.perf_counter() - self.w0
        self.cpu = cpu() - self.c0


def run_kspeed(space, tier_bytes=0, tier_views=False, timed_epochs=1, page_cache="auto"):
    """One loader: with a tier, epoch 0 fills it untimed; then `timed_epochs`
    epochs are timed. Returns (samples in the timed epochs, Timer)."""
    import kspeed

    loader = kspeed.Loader(space, batch_size=BATCH, seed=1, ring_bytes="256MiB", tier_bytes=tier_bytes,
                           tier_views=tier_views, batches_in_flight=2, page_cache=page_cache)

    def epoch(e):
        loader.set_epoch(e)
        n = 0
        if tier_views:
            # Per-sample views in place (a batch from the tier is not one
            # span: array() would copy it). No byte is read here.
            for b in loader:
                _ = (b.ids, b.labels, b.lengths, b.samples())
                n += len(b)
        else:
            for b in loader:
                _ = (b.ids, b.labels, b.offsets, b.lengths, b.array())
                n += len(b)
        return n

    first = 1 if tier_bytes else 0
    for e in range(first):
        epoch(e)
    n = 0
    with Timer() as t:
        for e in range(first, first + timed_epochs):
            n += epoch(e)
    loader.close()
    return n, t


class RawFiles:
    """A map-style Dataset: opens and reads each file of an ImageFolder tree."""

    def __init__(self, root):
        self.items = []
        classes = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
        for c, name in enumerate(classes):
            for f in sorted(os.listdir(os.path.join(root, name))):
                self.items.append((os.path.join(root, name, f), c))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        path, label = self.items[i]
        with open(path, "rb") as f:
            return f.read(), label


def as_list(batch):
    return batch


def run_dataloader(src, workers):
    import torch
    from torch.utils.data import DataLoader

    ds = RawFiles(src)
    g = torch.Generator()
    g.manual_seed(1)
    dl = DataLoader(ds, batch_size=BATCH, shuffle=True, num_workers=workers, collate_fn=as_list, generator=g,
                    multiprocessing_context="fork" if workers else None)
    n = 0
    with Timer() as t:
        for b in dl:
            n += len(b)
    return n, t


def run_dali(src):
    from nvidia.dali import fn, pipeline_def

    @pipeline_def(batch_size=BATCH, num_threads=2, device_id=None)
    def p():
        raw, label = fn.readers.file(file_root=src, random_shuffle=True, seed=1, name="Reader",
                                     pad_last_batch=True)
        return raw, label

    pipe = p()
    pipe.build()
    size = pipe.epoch_size("Reader")
    iters = -(-size // BATCH)
    n = 0
    with Timer() as t:
        for _ in range(iters):
            raw, _ = pipe.run()
            n += len(raw)
    return min(n, size), t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--count", type=int, default=10000)
    ap.add_argument("--profile", default="imagenet")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--workers", default="0,2,4,8")
    ap.add_argument("--overhead-rounds", type=int, default=5)
    ap.add_argument("--overhead-epochs", type=int, default=5,
                    help="epochs timed per overhead round (after the one that fills the tier)")
    ap.add_argument("--skip-warm", action="store_true", help="only the cold part (unless skipped) and the overhead")
    ap.add_argument("--work", default="/var/tmp/kspeed-pybench")
    ap.add_argument("--json", default=None)
    ap.add_argument("--skip-cold", action="store_true")
    a = ap.parse_args()

    import kspeed

    src = os.path.join(a.work, f"{a.profile}-{a.count}", "src")
    space = os.path.join(a.work, f"{a.profile}-{a.count}", "space")
    if not os.path.isdir(src):
        sh(kspeed_bin(), "--progress", "none", "gen", "--profile", a.profile, "--count", str(a.count), "--out", src,
           "--seed", "7")
    sh(kspeed_bin(), "--progress", "none", "preload", "--source", src, "--space", space)
    cat = kspeed.Catalog.open(space)
    gb = cat.total_bytes / 1e9
    tier = cat.total_bytes + (64 << 20)
    try:
        import nvidia.dali  # noqa: F401

        have_dali = True
    except ImportError:
        have_dali = False
    workers = [int(w) for w in a.workers.split(",")]
    readers = [("kspeed Python loader", lambda: run_kspeed(space))]
    readers += [(f"DataLoader, {w} workers", (lambda w=w: run_dataloader(src, w))) for w in workers]
    if have_dali:
        readers.append(("DALI fn.readers.file", lambda: run_dali(src)))
    results = {"count": a.count, "profile": a.profile, "gb": gb, "cold": {}, "warm": {}, "overhead": {}}

    def record(mode, name, n, t):
        assert n == a.count, f"{name} read {n} of {a.count}"
        results[mode].setdefault(name, []).append({"sps": n / t.wall, "cpu_per_gb": t.cpu / gb})
        print(f"  {mode} {name}: {n / t.wall:,.0f} samples/s, {t.cpu / gb:.2f} CPU s/GB", flush=True)

    if not a.skip_cold:
        for r in range(a.runs):
            for name, fn_ in readers:
                drop_caches()
                n, t = fn_()
                record("cold", name, n, t)
    # Warm: the page cache holds the tree and the space (one untimed pass
    # each; page_cache="on" reads the space through the cache), kspeed its
    # tier where it has one.
    run_dataloader(src, 2)
    run_kspeed(space, page_cache="on")
    warm = [
        ("kspeed Python loader, defaults (page_cache auto)", lambda: run_kspeed(space)),
        ("kspeed Python loader, page_cache off (O_DIRECT)", lambda: run_kspeed(space, page_cache="off")),
        ("kspeed Python loader, memory tier", lambda: run_kspeed(space, tier)),
        ("kspeed Python loader, memory tier, tier_views", lambda: run_kspeed(space, tier, tier_views=True)),
    ] + readers[1:]
    for r in range(0 if a.skip_warm else a.runs):
        for name, fn_ in warm:
            n, t = fn_()
            record("warm", name, n, t)
    # The Python layer against the Rust loader (same process and build).
    cfg = {"space": space, "batch_size": BATCH, "seed": 1, "ring_bytes": 256 << 20, "tier_bytes": tier,
           "rank": 0, "world": 1}
    for r in range(a.overhead_rounds):
        secs, n, batches = kspeed._kspeed._bench_rust(cfg, 1, a.overhead_epochs)
        results["overhead"].setdefault("rust", []).append(secs)
        n2, t = run_kspeed(space, tier, timed_epochs=a.overhead_epochs)
        assert n2 == n, f"the Python loop read {n2} samples, the Rust one {n}"
        results["overhead"].setdefault("python", []).append(t.wall)
        results["overhead"]["batches"] = batches
        print(f"  overhead round {r}: rust {n / secs:,.0f}/s, python {n2 / t.wall:,.0f}/s", flush=True)

    def med(mode, name, key):
        return statistics.median(x[key] for x in results[mode][name])

    print(f"\n{a.profile}: {a.count} samples, {gb:.2f} GB, batch {BATCH}, medians of {a.runs}\n")
    # Two ratios: the median against the best DataLoader's median, and the
    # median of per-round ratios against the best DataLoader of that round
    # (readers alternate within a round, so this one pairs like with like).
    print("| mode | reader | samples/s | CPU s/GB | vs best DataLoader (medians) | paired, per round |")
    print("|---|---|---:|---:|---:|---:|")
    for mode in ("cold", "warm"):
        if not results[mode]:
            continue
        loaders = [k for k in results[mode] if k.startswith("DataLoader")]
        best = max(med(mode, k, "sps") for k in loaders)
        best_per_round = [max(results[mode][k][r]["sps"] for k in loaders) for r in range(a.runs)]
        for name in results[mode]:
            sps = med(mode, name, "sps")
            runs = ", ".join(f"{x['sps']:,.0f}" for x in results[mode][name])
            paired = statistics.median(x["sps"] / b for x, b in zip(results[mode][name], best_per_round))
            print(f"| {mode} | {name} ({runs}) | {sps:,.0f} | {med(mode, name, 'cpu_per_gb'):.2f} | "
                  f"{sps / best:.2f}x | {paired:.2f}x |")
    ov = results["overhead"]
    rs, ps = statistics.median(ov["rust"]), statistics.median(ov["python"])
    per_batch_us = (ps - rs) / ov["batches"] * 1e6
    print(f"\nPython layer vs the Rust loader (memory tier, {a.overhead_rounds} rounds of {a.overhead_epochs} "
          f"epochs, medians): Rust {a.count * a.overhead_epochs / rs:,.0f} samples/s, "
          f"Python {a.count * a.overhead_epochs / ps:,.0f} samples/s: "
          f"{(ps / rs - 1) * 100:+.1f} % time, {per_batch_us:+.1f} us per batch "
          f"(rounds rust {', '.join(f'{x:.3f}' for x in ov['rust'])} s; "
          f"python {', '.join(f'{x:.3f}' for x in ov['python'])} s)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
