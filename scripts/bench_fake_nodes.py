#!/usr/bin/env python3
"""One consumer against thousands of node services (issue 28, "one agent +
4,095 fake peers", the consumer's side), two builds side by side.

The consumer is the loader inside `benches/fake_nodes.rs` (its network
thread is the code an agent's shared thread runs), so a build here is that
bench binary: --a and --b name two of them (build each with `cargo bench
--bench fake_nodes --no-run` at the commits to compare, and copy the
binary it prints). Without --a/--b it builds the current tree's and runs
it alone. Per round, for each node count (--nodes, default 64 and 4096)
and each build (order rotated per round), it runs the bench: the fake
nodes in a child process, the loader's connect burst, --load-secs of
--rate samples/s, then --idle-secs with the consumer stopped (only
keepalives and heartbeats move). It prints each run, then per node count
and build the medians of idle CPU (% of a core, whole consumer process and
its network thread), CPU per sample under load (us) and the connect
burst's time, and the paired ratios b/a.

  scripts/bench_fake_nodes.py [--a OLD_BENCH --b NEW_BENCH] [--runs 3] [--nodes 64,4096] [--rate 24000] [--load-secs 10] [--idle-secs 20]

The dataset (20,000 tiny samples, its catalog) is made once under --dir
(default /var/tmp/kspeed-fake-nodes) with target/release/kspeed.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

from bench_fake_peers import bench_binary

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_catalog(d, count):
    cat = os.path.join(d, "catalog")
    if os.path.exists(cat):
        return cat
    subprocess.run(["cargo", "build", "--release", "--bin", "kspeed"], cwd=ROOT, check=True)
    kspeed = os.path.join(ROOT, "target", "release", "kspeed")
    src = os.path.join(d, "src")
    subprocess.run([kspeed, "gen", "--profile", "tiny", "--count", str(count), "--out", src], check=True,
                   stdout=subprocess.DEVNULL)
    subprocess.run([kspeed, "catalog", "--source", src, "--out", cat], check=True, stdout=subprocess.DEVNULL)
    return cat


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", help="the reference fake_nodes bench binary")
    ap.add_argument("--b", help="the fake_nodes bench binary measured against it")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--nodes", default="64,4096")
    ap.add_argument("--rate", type=float, default=24000)
    ap.add_argument("--load-secs", type=float, default=10)
    ap.add_argument("--idle-secs", type=float, default=20)
    ap.add_argument("--dir", default="/var/tmp/kspeed-fake-nodes")
    a = ap.parse_args()
    os.makedirs(a.dir, exist_ok=True)
    catalog = make_catalog(a.dir, 20000)
    if bool(a.a) != bool(a.b):
        sys.exit("give both --a and --b, or neither")
    builds = {"a": a.a, "b": a.b} if a.a else {"b": bench_binary("fake_nodes")}
    res = {}
    counts = [int(x) for x in a.nodes.split(",")]
    for r in range(a.runs):
        order = sorted(builds) if r % 2 == 0 else sorted(builds, reverse=True)
        for nodes in counts:
            for b in order:
                out = subprocess.run(
                    [builds[b], "--catalog", catalog, "--nodes", str(nodes), "--rate", str(a.rate),
                     "--load-secs", str(a.load_secs), "--idle-secs", str(a.idle_secs), "--json"],
                    check=True, capture_output=True, text=True, timeout=900).stdout
                run = json.loads(out.strip().splitlines()[-1])
                res.setdefault((nodes, b), []).append(run)
                print(f"round {r + 1} nodes {nodes} build {b}: connected in {run['build_s']:.2f} s; "
                      f"load {run['load_samples_per_s']:.0f} samples/s, {run['load_us_per_sample']:.2f} us/sample "
                      f"(network thread {run['load_net_us_per_sample']:.2f}); idle {run['idle_cpu_pct']:.3f} % "
                      f"(network thread {run['idle_net_cpu_pct']:.3f} %); failovers {run['failovers']}; {run['seen']}",
                      file=sys.stderr, flush=True)
    keys = [("idle_cpu_pct", "idle CPU, % of a core"), ("idle_net_cpu_pct", "idle: network thread, %"),
            ("load_us_per_sample", "CPU per sample under load, us"),
            ("load_net_us_per_sample", "network thread per sample, us"),
            ("load_samples_per_s", "samples/s"), ("build_s", "connect burst, s")]
    print("| nodes | build | " + " | ".join(k[1] for k in keys) + " |")
    print("|---:|---|" + "---:|" * len(keys))
    for nodes in counts:
        for b in sorted(builds):
            cells = []
            for k, _ in keys:
                vals = [x[k] for x in res[(nodes, b)]]
                cells.append(f"{statistics.median(vals):.3f} ({', '.join(f'{v:.3f}' for v in vals)})")
            print(f"| {nodes} | {b}: {builds[b]} | " + " | ".join(cells) + " |")
        if len(builds) == 2:
            pa, pb = res[(nodes, "a")], res[(nodes, "b")]
            ratios = [statistics.median(y[k] / x[k] if x[k] else float("nan") for x, y in zip(pa, pb))
                      for k, _ in keys]
            print(f"| {nodes} | b / a, paired median | " + " | ".join(f"{v:.3f}x" for v in ratios) + " |")


if __name__ == "__main__":
    main()
