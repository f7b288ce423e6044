#!/usr/bin/env python3
"""The node agent's cache area: one area for the node's ranks
(`kspeed agent --cache-scope node`, the default) against an area per rank
(`--cache-scope rank`) of the same total budget.

Setup: a partial space holding a third of N tiny samples (the rest stays in
its source folder); an agent with `--cache-dir` and a budget of a third of
the dataset's bytes (per rank: a quarter of that); this node's 4 ranks of a
job of 8 (`--local-rank r --local-world-size 4`) read E epochs at once,
each holding every batch for `--compute-us` (a training step). Each
round runs both scopes (alternating which goes first), a fresh cache
folder and agent each. Reported per epoch: the hit rate of the reads
that go to the source (cache hits / (hits + source reads), the node's 4
ranks together), the node area's planned hits (its planner's MIN over the
node's merged order, from the agent's log) and the ratio node / rank,
paired per round.

    scripts/bench_node_cache.py --runs 3 [--samples 8000] [--epochs 5]
        [--compute-us 2000] [--json out.json]
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from agent_bench import KSPEED, ensure_built, run, stop_agents, wait_line  # noqa: E402

LOCAL, WORLD = 4, 8


def tree_bytes(p):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(p) for f in fs)


def make_space(base, samples):
    src, sp = os.path.join(base, "src"), os.path.join(base, "space")
    run([KSPEED, "gen", "--profile", "tiny", "--count", str(samples), "--out", src, "--seed", "7"])
    third = tree_bytes(src) // 3
    run([KSPEED, "preload", "--source", src, "--space", sp, "--max-bytes", str(third)])
    return sp, third


def one_scope(base, sp, budget, scope, args, tag):
    cache = os.path.join(base, f"cache-{tag}")
    sock = os.path.join(base, f"{tag}.sock")
    log = os.path.join(base, f"{tag}.log")
    per_rank = budget // LOCAL if scope == "rank" else budget
    with open(log, "w") as lf:
        agent = subprocess.Popen(
            [KSPEED, "agent", "--space", sp, "--socket", sock, "--cache-dir", cache,
             "--cache-bytes", str(per_rank), "--cache-scope", scope],
            stdout=subprocess.DEVNULL, stderr=lf, env=dict(os.environ, RUST_LOG="info"))
    try:
        if not wait_line(log, "agent: serving", time.monotonic() + 30):
            raise SystemExit(f"agent did not start: {open(log).read()}")
        ranks = []
        for r in range(LOCAL):
            ranks.append(subprocess.Popen(
                [KSPEED, "read", "--progress=none", "--json", "--space", sp, "--rank", str(r),
                 "--world", str(WORLD), "--seed", "11", "--batch-size", "16", "--epochs",
                 str(args.epochs), "--compute-us", str(args.compute_us), "--agent", "required",
                 "--agent-socket", sock, "--local-rank", str(r), "--local-world-size", str(LOCAL)],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE))
        hits = [0] * args.epochs
        source = [0] * args.epochs
        for p in ranks:
            out, err = p.communicate(timeout=600)
            if p.returncode != 0:
                raise SystemExit(f"rank failed: {err.decode()[-2000:]}")
            for e, ep in enumerate(json.loads(out)["per_epoch"]):
                hits[e] += ep["cache_hits"]
                source[e] += ep["source_reads"]
        planned = None
        if scope == "node":
            if wait_line(log, "no rank attached", time.monotonic() + 30):
                for line in open(log):
                    m = re.search(r"node cache area .*: (\d+) hits \((\d+) planned\)", line)
                    if m:
                        planned = int(m.group(2))
        return hits, source, planned
    finally:
        stop_agents([agent])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--samples", type=int, default=8000)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--compute-us", type=int, default=2000)
    ap.add_argument("--json")
    args = ap.parse_args()
    ensure_built()
    base = tempfile.mkdtemp(prefix="kspeed-bench-node-cache-")
    sp, budget = make_space(base, args.samples)
    rounds = []
    for i in range(args.runs):
        order = ["rank", "node"] if i % 2 == 0 else ["node", "rank"]
        got = {}
        for scope in order:
            got[scope] = one_scope(base, sp, budget, scope, args, f"{scope}{i}")
        rounds.append(got)
        rate = {s: sum(got[s][0][1:]) / max(1, sum(got[s][0][1:]) + sum(got[s][1][1:])) for s in got}
        print(f"round {i + 1}: hit rate from epoch 2, rank areas {rate['rank']:.3f}, node area "
              f"{rate['node']:.3f}; node planned {got['node'][2]}", flush=True)

    def rate(hits, source, e):
        return hits[e] / max(1, hits[e] + source[e])

    print(f"\n{args.samples} tiny samples, a third in the space, cache budget {budget} bytes "
          f"(per rank {budget // LOCAL}), {LOCAL} node ranks of {WORLD}, {args.epochs} epochs, "
          f"compute {args.compute_us} us per batch of 16, {args.runs} rounds (median, per round)\n")
    print("| epoch | rank areas: hit rate | node area: hit rate | node / rank (medians) | paired, per round |")
    print("|---:|---:|---:|---:|---|")
    table = []
    for e in range(args.epochs):
        r = [rate(*g["rank"][:2], e) for g in rounds]
        n = [rate(*g["node"][:2], e) for g in rounds]
        paired = [b / a if a > 0 else float("nan") for a, b in zip(r, n)]
        mr, mn = statistics.median(r), statistics.median(n)
        print(f"| {e + 1} | {mr:.3f} ({', '.join(f'{x:.3f}' for x in r)}) | {mn:.3f} "
              f"({', '.join(f'{x:.3f}' for x in n)}) | {mn / mr if mr else float('nan'):.2f}x | "
              f"{', '.join(f'{x:.2f}' for x in paired)} |")
        table.append({"epoch": e + 1, "rank": r, "node": n})
    tot = lambda g, s: (sum(g[s][0][1:]), sum(g[s][1][1:]))  # noqa: E731
    for g in rounds:
        h, src = tot(g, "node")
        print(f"node area, epochs 2-{args.epochs}: {h} hits, {src} source reads; planned hits over "
              f"all epochs {g['node'][2]}, realised {sum(g['node'][0])}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "budget": budget, "rounds": rounds, "table": table}, f, indent=1)


if __name__ == "__main__":
    main()
