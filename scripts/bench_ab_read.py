#!/usr/bin/env python3
"""A/B of two kspeed builds on one space: `kspeed read` of one epoch each,
cold page cache before every run (root: drop_caches), the two builds
alternating (A B, B A, ...), reported as medians and paired per-round
ratios B/A of samples/s and CPU seconds.

  scripts/bench_ab_read.py --a /tmp/old/kspeed --b target/release/kspeed \\
      --space /var/tmp/tz/space --runs 5 [-- extra kspeed read flags]

Build the "before" binary from a worktree of the older commit
(`git worktree add /tmp/old REV && cd /tmp/old && cargo build --release`).
"""
import argparse
import json
import statistics
import subprocess
import sys


def run(binary, space, batch, extra):
    subprocess.run("sync; echo 3 > /proc/sys/vm/drop_caches", shell=True, check=True)
    out = subprocess.run([binary, "read", "--space", space, "--batch-size", str(batch), "--json", *extra],
                         capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        sys.exit(f"{binary} failed:\n{out.stderr[-2000:]}")
    j = json.loads(out.stdout)
    return {"sps": j["samples_per_sec"], "cpu": j["cpu_seconds"], "waits": j.get("stall_waits"),
            "stall": j["stall_seconds"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", required=True, help="the reference build's kspeed binary")
    ap.add_argument("--b", required=True, help="the build measured against it")
    ap.add_argument("--space", required=True)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("extra", nargs="*", help="more kspeed read flags (after --)")
    a = ap.parse_args()
    res = {"a": [], "b": []}
    for r in range(a.runs):
        for k in (("a", "b") if r % 2 == 0 else ("b", "a")):
            res[k].append(run(getattr(a, k), a.space, a.batch_size, a.extra))
            x = res[k][-1]
            print(f"round {r} {k}: {x['sps']:,.0f} samples/s, CPU {x['cpu']:.3f} s, "
                  f"stall {x['stall']:.3f} s, waits {x['waits']}", flush=True)
    for k in ("a", "b"):
        print(f"{k}: median {statistics.median(x['sps'] for x in res[k]):,.0f} samples/s, "
              f"CPU {statistics.median(x['cpu'] for x in res[k]):.3f} s")
    for field in ("sps", "cpu"):
        ratios = [b[field] / a_[field] for a_, b in zip(res["a"], res["b"])]
        print(f"paired b/a {field}: {', '.join(f'{x:.3f}' for x in ratios)}; "
              f"median {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
