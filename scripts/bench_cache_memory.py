#!/usr/bin/env python3
"""The cache area in memory (`--cache-dir :memory:`) over a space that
holds every sample, against the memory tier of the same bytes (a fixed
subset chosen by the rank's reads over the coming epochs) and against no
cache at all (every sample from the NVMe with O_DIRECT): one rank of a
world (`--rank R --world W`, as a rank of a data-parallel job reads), many
epochs, `kspeed read --json` in a fresh process per run, the page cache
dropped before each (root), the contenders rotated run by run. Reports
per-epoch medians of samples/s and hits, and per-run paired ratios.

  scripts/bench_cache_memory.py --space /var/tmp/kspeed-mem/space \\
      --source /var/tmp/kspeed-partial/src --fraction 0.1 --rank 3 --world 8 \\
      --epochs 16 --runs 3 [--json FILE]

--source: an ImageFolder to preload into --space when it is missing
(`kspeed preload`). --fraction: the tier's and the area's bytes as a
fraction of the dataset's. The binary: target/release/kspeed (or
$KSPEED_BIN).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
K = os.environ.get("KSPEED_BIN", os.path.join(ROOT, "target", "release", "kspeed"))


def run(a, extra):
    subprocess.run("sync; echo 3 > /proc/sys/vm/drop_caches", shell=True, check=True)
    args = [K, "--progress", "none", "read", "--space", a.space, "--rank", str(a.rank), "--world",
            str(a.world), "--epochs", str(a.epochs), "--batch-size", str(a.batch_size), "--json", *extra]
    out = subprocess.run(args, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        sys.exit(f"{' '.join(args)} failed:\n{out.stderr[-2000:]}")
    j = json.loads(out.stdout)
    return [{"sps": e["samples_per_sec"], "hits": e["tier_hits"] + e["cache_hits"]} for e in j["per_epoch"]]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--space", required=True)
    ap.add_argument("--source", default=None)
    ap.add_argument("--fraction", type=float, default=0.1)
    ap.add_argument("--rank", type=int, default=3)
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--epochs", type=int, default=16)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if not os.path.isdir(a.space):
        if not a.source:
            sys.exit(f"{a.space} does not exist; give --source to preload it")
        subprocess.run([K, "--progress", "none", "preload", "--source", a.source, "--space", a.space],
                       check=True, stdout=subprocess.DEVNULL)
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(a.space) for f in fs
               if os.path.basename(d) == "extents")
    budget = str(int(size * a.fraction))
    contenders = {
        "disk": [],
        "tier": ["--tier-bytes", budget],
        "mem-next-use": ["--cache-dir", ":memory:", "--cache-bytes", budget],
        "mem-lru": ["--cache-dir", ":memory:", "--cache-bytes", budget, "--cache-policy", "lru"],
    }
    names = list(contenders)
    res = {n: [] for n in names}
    for r in range(a.runs):
        order = names[r % len(names):] + names[:r % len(names)]
        for n in order:
            res[n].append(run(a, contenders[n]))
            e = res[n][-1]
            print(f"run {r + 1} {n:13s} samples/s by epoch " + " ".join(f"{x['sps']:.0f}" for x in e)
                  + "; hits " + " ".join(str(x["hits"]) for x in e), file=sys.stderr, flush=True)
    med = statistics.median
    print(f"\nspace {a.space} ({size / 1e6:.0f} MB), rank {a.rank} of {a.world}, {a.epochs} epochs, "
          f"tier / area {int(budget) / 1e6:.0f} MB ({a.fraction:.0%}); cold page cache per run; median of {a.runs}")
    later = range(1, a.epochs)
    for n in names:
        sps = [med(run_[e]["sps"] for run_ in res[n]) for e in range(a.epochs)]
        hits = [med(run_[e]["hits"] for run_ in res[n]) for e in range(a.epochs)]
        tot = med(sum(x["hits"] for x in run_) for run_ in res[n])
        print(f"{n:13s} epoch 1 {sps[0]:8.0f}/s, epochs 2-{a.epochs} median {med(sps[e] for e in later):8.0f}/s; "
              f"hits over the run {tot:.0f} (per epoch median {' '.join(f'{h:.0f}' for h in hits)})")
    for mine, other in [("mem-next-use", "tier"), ("mem-next-use", "disk"), ("mem-next-use", "mem-lru"),
                        ("tier", "disk")]:
        # Per run: epochs 2.. as one rate (samples over seconds).
        def rate(run_):
            return med(run_[e]["sps"] for e in later)
        rr = [rate(x) / rate(y) for x, y in zip(res[mine], res[other])]
        hr = [sum(e["hits"] for e in x) / max(1, sum(e["hits"] for e in y)) for x, y in zip(res[mine], res[other])]
        print(f"{mine} / {other}: samples/s epochs 2-{a.epochs}, per run {' '.join(f'{x:.2f}' for x in rr)} "
              f"(median {med(rr):.2f}x); hits per run {' '.join(f'{x:.2f}' for x in hr)}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "size": size, "budget": int(budget), "runs": res}, f)


if __name__ == "__main__":
    main()
