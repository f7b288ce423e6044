#!/usr/bin/env python3
"""Preload throughput on a cold page cache, side by side with cp -r and tar.

Each run drops the page cache (root needed) before every tool, then times:
  kspeed-full  : kspeed preload from scratch (catalog checksum pass + copy + fsync)
  kspeed-copy  : kspeed preload with a prebuilt catalog (copy + fsync only)
  cp -r        : cp -r SRC DST && sync
  tar | tar    : tar -C SRC -cf - . | tar -C DST -xf - && sync
and reports the median MB/s of the runs (dataset bytes / wall time) and the
ratio to cp -r. For the disk's own limit it also runs fio (io_uring, O_DIRECT,
1 MiB blocks, queue depth 32) sequential read and write of a 1 GiB file in the
same directory: a copy on one disk can at best reach 1/(1/read + 1/write).
Usage:

  scripts/bench_preload.py [--count 20000] [--profile imagenet] [--runs 3] [--work /var/tmp/kspeed-bench]
"""

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
K = os.path.join(ROOT, "target", "release", "kspeed")


def sh(cmd, **kw):
    return subprocess.run(cmd, shell=isinstance(cmd, str), check=True, **kw)


def drop_caches():
    sh("sync")
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except PermissionError:
        sys.exit("bench_preload: dropping the page cache needs root")


def du_bytes(path):
    total = 0
    for d, _, files in os.walk(path):
        for f in files:
            total += os.path.getsize(os.path.join(d, f))
    return total


def timed(cmd):
    drop_caches()
    t0 = time.monotonic()
    sh(cmd, stdout=subprocess.DEVNULL)
    return time.monotonic() - t0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--count", type=int, default=20000)
    ap.add_argument("--profile", default="imagenet")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="kspeed threads (0 = default)")
    ap.add_argument("--work", default="/var/tmp/kspeed-bench")
    a = ap.parse_args()

    sh(["cargo", "build", "--release", "--quiet"], cwd=ROOT)
    os.makedirs(a.work, exist_ok=True)
    src = os.path.join(a.work, f"src-{a.profile}-{a.count}")
    sh([K, "gen", "--profile", a.profile, "--count", str(a.count), "--out", src, "--seed", "1", "--progress=none"])
    size = du_bytes(src)
    cat = os.path.join(a.work, "prebuilt.ksc")
    sh([K, "catalog", "--source", src, "--out", cat, "--progress=none"], stdout=subprocess.DEVNULL)
    threads = ["--threads", str(a.threads)] if a.threads else []

    tools = {
        "kspeed-full": lambda d: [K, "preload", "--source", src, "--space", d, "--progress=none"] + threads,
        "kspeed-copy": lambda d: [K, "preload", "--catalog", cat, "--space", d, "--progress=none"] + threads,
        "cp -r": lambda d: f"cp -r '{src}' '{d}' && sync",
        "tar | tar": lambda d: f"mkdir -p '{d}' && tar -C '{src}' -cf - . | tar -C '{d}' -xf - && sync",
    }
    fio_file = os.path.join(a.work, "fio.dat")
    fio = {"read": [], "write": []}
    for run in range(a.runs):
        for rw in ("write", "read"):
            drop_caches()
            out = subprocess.run(
                ["fio", "--name=ref", f"--filename={fio_file}", f"--rw={rw}", "--bs=1M", "--direct=1",
                 "--ioengine=io_uring", "--iodepth=32", "--size=1G", "--output-format=terse", "--terse-version=3"],
                check=True, capture_output=True, text=True).stdout
            f = out.strip().split(";")
            kib_s = int(f[6]) if rw == "read" else int(f[47])
            fio[rw].append(kib_s * 1024 / 1e6)
    os.remove(fio_file)
    times = {t: [] for t in tools}
    for run in range(a.runs):
        for name, mk in tools.items():
            dst = os.path.join(a.work, "dst")
            shutil.rmtree(dst, ignore_errors=True)
            times[name].append(timed(mk(dst)))
            shutil.rmtree(dst, ignore_errors=True)
            print(f"run {run + 1}: {name:12s} {times[name][-1]:7.2f} s", file=sys.stderr)

    print(f"\n{a.profile}, {a.count} samples, {size / 1e6:.0f} MB, cold page cache, median of {a.runs} runs")
    print(f"{'tool':14s} {'median s':>9s} {'MB/s':>8s} {'vs cp -r':>9s}   runs (s)")
    base = statistics.median(times["cp -r"])
    r, w = statistics.median(fio["read"]), statistics.median(fio["write"])
    print(f"fio: read {r:.0f} MB/s, write {w:.0f} MB/s; copy limit 1/(1/r+1/w) = {1 / (1 / r + 1 / w):.0f} MB/s")
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f"{name:14s} {m:9.2f} {size / m / 1e6:8.1f} {base / m:8.2f}x   {' '.join(f'{t:.2f}' for t in ts)}")


if __name__ == "__main__":
    main()
