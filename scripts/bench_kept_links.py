#!/usr/bin/env python3
"""A job's start on node agents whose links are kept across jobs against
agents that connect with each job's first rank (issue 28: "set up at agent
start and kept across jobs"), side by side on this machine.

N `kspeed agent` processes on loopback (127.78.0.1..N, one port), each
node holding 1/N of a tiny dataset. Per round and per mode (the order
alternates by round), the agents are started with
`KSPEED_AGENT_LINKS=shared` (kept: the default) or `per-job`, and --jobs
jobs are run one after another, each one rank attached to node 0's agent
reading one epoch (`kspeed read --agent required`). For each job it takes
the rank process's wall time from spawn to exit (attach, the agent's
loader joining its network thread, which per job first connects to the
N-1 other nodes, and the epoch), then stops the agents. It prints each
job, then per mode the medians over all jobs, the median per round, and
the paired per-round ratios kept / per-job.

  scripts/bench_kept_links.py [--nodes 8] [--runs 3] [--jobs 5] [--count 8000]

The dataset is made once under --dir (default /var/tmp/kspeed-bench-links)
with target/release/kspeed (built if missing).
"""

import argparse
import os
import statistics
import subprocess
import sys
import time

from agent_bench import KSPEED, ensure_built, make_spaces as make_node_spaces, stop_agents, wait_line

PORT = 29_311


def make_spaces(d, nodes, count):
    """Spaces for `nodes` nodes of `count` tiny samples, the cluster file
    and the token; made once per (nodes, count)."""
    return make_node_spaces(os.path.join(d, f"n{nodes}-c{count}"), nodes, count, "127.78.0.{}", PORT,
                            "bench-kept-links")


def start_agents(base, nodes, mode, logs):
    env = dict(os.environ, KSPEED_AGENT_LINKS=mode)
    agents = []
    for i in range(nodes):
        out, err = os.path.join(logs, f"agent{i}.out"), os.path.join(logs, f"agent{i}.log")
        p = subprocess.Popen(
            [KSPEED, "agent", "-v", "--space", os.path.join(base, f"space{i}"),
             "--socket", os.path.join(logs, f"agent{i}.sock"), "--cluster", os.path.join(base, "cluster"),
             "--token-file", os.path.join(base, "token"), "--listen", f"127.78.0.{i + 1}:{PORT}",
             "--node-timeout-ms", "2000", "--node-pollers", "1"],
            env=env, stdout=open(out, "w"), stderr=open(err, "w"))
        agents.append(p)
    deadline = time.monotonic() + 60
    for i in range(nodes):
        if not wait_line(os.path.join(logs, f"agent{i}.out"), "agent serving", deadline):
            sys.exit(f"agent {i} did not start: see {logs}/agent{i}.log")
    if mode == "shared":
        # Every agent's links made (each other agent's node service took one).
        for i in range(nodes):
            if not wait_line(os.path.join(logs, f"agent{i}.log"), "links kept while the agent runs", deadline):
                sys.exit(f"agent {i} made no links: see {logs}/agent{i}.log")
    return agents


def job(base, nodes, logs):
    args = [KSPEED, "read", "--progress=none", "--space", os.path.join(base, "space0"),
            "--cluster", os.path.join(base, "cluster"), "--agent", "required",
            "--agent-socket", os.path.join(logs, "agent0.sock"), "--rank", "0", "--world", str(nodes),
            "--epochs", "1", "--batch-size", "16"]
    t0 = time.monotonic()
    r = subprocess.run(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=120)
    wall = time.monotonic() - t0
    if r.returncode != 0:
        sys.exit(f"kspeed read failed: {r.stderr.decode()[-2000:]}")
    return wall


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--jobs", type=int, default=5)
    ap.add_argument("--count", type=int, default=8000)
    ap.add_argument("--dir", default="/var/tmp/kspeed-bench-links")
    a = ap.parse_args()
    ensure_built()
    base = make_spaces(a.dir, a.nodes, a.count)
    logs = os.path.join(a.dir, "logs")
    os.makedirs(logs, exist_ok=True)
    modes = ["shared", "per-job"]
    walls = {m: [] for m in modes}
    per_round = {m: [] for m in modes}
    for r in range(a.runs):
        for m in (modes if r % 2 == 0 else modes[::-1]):
            agents = start_agents(base, a.nodes, m, logs)
            try:
                w = [job(base, a.nodes, logs) for _ in range(a.jobs)]
            finally:
                stop_agents(agents)
            walls[m] += w
            per_round[m].append(statistics.median(w))
            print(f"round {r} {m:8s} job wall ms: " + " ".join(f"{x * 1e3:.1f}" for x in w), flush=True)
    print(f"\n{a.nodes} nodes, {a.count} samples, {a.runs} rounds x {a.jobs} jobs")
    for m in modes:
        label = "kept (shared)" if m == "shared" else "per job"
        print(f"  {label:14s} median job {statistics.median(walls[m]) * 1e3:.1f} ms; per round "
              + " ".join(f"{x * 1e3:.1f}" for x in per_round[m]))
    ratios = [k / p for k, p in zip(per_round["shared"], per_round["per-job"])]
    print("  kept / per job, paired by round: " + " ".join(f"{x:.2f}" for x in ratios)
          + f" (median {statistics.median(ratios):.2f})")


if __name__ == "__main__":
    main()
