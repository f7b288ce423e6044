#!/usr/bin/env python3
"""What node-down notices save a rank that needs a node after another node
saw it die (issue 28, docs/PROTOCOL.md "Node-down notices"), side by side
on this machine: notices on (the default) against KSPEED_NODE_NOTICES=off
(the agents' consumers do not ask for them).

Three `kspeed agent --listen` processes on loopback (127.79.0.1-3, one
port), each holding a third of a tiny dataset whose source files stay (a
sample whose node is gone is read from them). Per round and per mode (the
order alternates by round):

  1. a rank attached to node 0's agent reads two epochs slowly
     (--compute-us), so node 0 has grants outstanding on node 2;
  2. node 2's agent is stopped (SIGSTOP: a host that dies sends nothing);
     node 0 judges it dead after 2 s of silence (its log says so) and,
     with notices, tells node 1, whose link to node 2 was idle;
  3. 2 s after node 0's judgment, a rank attached to node 1's agent reads
     one epoch: a third of its samples were node 2's. Its wall time and
     stall (`--json` stall_seconds) are recorded: with notices node 1 has
     already shut its link and reads those samples from the source at
     once; without, its first grants to node 2 wait out 2 s of silence.

It prints each round, then per mode the medians and the paired ratios.

  scripts/bench_node_down.py [--runs 3] [--count 6000]

The dataset is made once under --dir (default /var/tmp/kspeed-bench-down)
with target/release/kspeed (built if missing).
"""

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time

from agent_bench import KSPEED, ensure_built, make_spaces as make_node_spaces, stop_agents, wait_line

PORT = 29_411
NODES = 3


def make_spaces(d, count):
    """Spaces for 3 nodes of `count` tiny samples, the cluster file and
    the token; made once per count."""
    return make_node_spaces(os.path.join(d, f"c{count}"), NODES, count, "127.79.0.{}", PORT, "bench-node-down")


def start_agents(base, notices, logs):
    env = dict(os.environ)
    if not notices:
        env["KSPEED_NODE_NOTICES"] = "off"
    agents = []
    for i in range(NODES):
        out, err = os.path.join(logs, f"agent{i}.out"), os.path.join(logs, f"agent{i}.log")
        p = subprocess.Popen(
            [KSPEED, "agent", "-v", "--space", os.path.join(base, f"space{i}"),
             "--socket", os.path.join(logs, f"agent{i}.sock"), "--cluster", os.path.join(base, "cluster"),
             "--token-file", os.path.join(base, "token"), "--listen", f"127.79.0.{i + 1}:{PORT}",
             "--node-timeout-ms", "2000", "--node-pollers", "1"],
            env=env, stdout=open(out, "w"), stderr=open(err, "w"))
        agents.append(p)
    deadline = time.monotonic() + 60
    for i in range(NODES):
        ok = wait_line(os.path.join(logs, f"agent{i}.out"), ["agent serving"], deadline) and wait_line(
            os.path.join(logs, f"agent{i}.log"), ["links kept while the agent runs"], deadline)
        if not ok:
            stop_agents(agents)
            sys.exit(f"agent {i} did not start or made no links: see {logs}/agent{i}.log")
    # Each node service took a link from each other agent.
    time.sleep(0.5)
    return agents


def read_args(base, logs, node, epochs, extra):
    return [KSPEED, "read", "--progress=none", "--space", os.path.join(base, f"space{node}"),
            "--cluster", os.path.join(base, "cluster"), "--agent", "required",
            "--agent-socket", os.path.join(logs, f"agent{node}.sock"), "--rank", "0", "--world", "1",
            "--epochs", str(epochs), "--batch-size", "16", "--ring-bytes", "256KiB"] + extra


def one_round(base, logs, notices):
    agents = start_agents(base, notices, logs)
    try:
        a = subprocess.Popen(read_args(base, logs, 0, 2, ["--compute-us", "20000"]),
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        if not wait_line(os.path.join(logs, "agent0.log"), ["rank 0 ", "attached"], deadline):
            sys.exit("the rank on node 0 did not attach")
        time.sleep(0.3)
        agents[2].send_signal(signal.SIGSTOP)
        if not wait_line(os.path.join(logs, "agent0.log"), ["node 2 (", "is gone"], time.monotonic() + 60):
            sys.exit("node 0 did not judge node 2 gone")
        # The scenario's timing: node 1's rank starts 2 s after node 0's
        # judgment (with notices, node 1 shut its link 1.5 s after it).
        time.sleep(2.0)
        t0 = time.monotonic()
        r = subprocess.run(read_args(base, logs, 1, 1, ["--json"]), stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, timeout=120)
        wall = time.monotonic() - t0
        if r.returncode != 0:
            sys.exit(f"the rank on node 1 failed: {r.stderr.decode()[-2000:]}")
        v = json.loads(r.stdout)
        a.wait(timeout=120)
        told = wait_line(os.path.join(logs, "agent1.log"), ["node 2 (", "node 0 reported it down"],
                         time.monotonic() + 1)
        return wall, v["stall_seconds"], told
    finally:
        stop_agents(agents)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--count", type=int, default=6000)
    ap.add_argument("--dir", default="/var/tmp/kspeed-bench-down")
    a = ap.parse_args()
    ensure_built()
    base = make_spaces(a.dir, a.count)
    logs = os.path.join(a.dir, "logs")
    os.makedirs(logs, exist_ok=True)
    modes = [True, False]
    got = {m: [] for m in modes}
    for r in range(a.runs):
        for m in (modes if r % 2 == 0 else modes[::-1]):
            wall, stall, told = one_round(base, logs, m)
            got[m].append((wall, stall))
            label = "notices" if m else "off"
            print(f"round {r} {label:7s}: node 1's rank {wall * 1e3:.0f} ms, stalled {stall * 1e3:.0f} ms; "
                  f"node 1 told by node 0: {told}", flush=True)
    print(f"\n3 nodes, {a.count} samples, {a.runs} rounds")
    for m in modes:
        label = "notices on" if m else "notices off"
        w = statistics.median(x[0] for x in got[m])
        s = statistics.median(x[1] for x in got[m])
        print(f"  {label:11s}: median wall {w * 1e3:.0f} ms, median stall {s * 1e3:.0f} ms")
    ratios = [off[0] / on[0] for on, off in zip(got[True], got[False])]
    print("  wall off / on, paired by round: " + " ".join(f"{x:.2f}" for x in ratios)
          + f" (median {statistics.median(ratios):.2f})")


if __name__ == "__main__":
    main()
