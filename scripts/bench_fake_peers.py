#!/usr/bin/env python3
"""One node service against thousands of consumer links from one process
(issue 28: "one agent + 4,095 fake peers: idle < 1 % of a core; per-tick
work flat in the peer count"), two builds side by side.

Per round, for each link count (--links, default 64 and 4095) and each
build (--a and --b: two `kspeed` binaries, order rotated per round), it
starts `BIN serve` (or `BIN agent --listen` with --agent, for a build
whose agent takes serve's flags) on a space of tiny samples, sized as a
4,096-node cluster's node service would be (--max-consumers-per-poller
4096 --max-handshakes 4096; --max-grants 64, so 4,095 grant queues fit in
memory), one poller, and runs `benches/fake_peers.rs` against it: the
links' handshake burst, 3 s to settle, --idle-secs of idle links
(keepalives only) and --load-secs of --grants-per-sec grants spread over
every link. The node's CPU is the sum of its threads' schedstat over each
phase; its pollers' ticks and their busy time come from its metrics
(`kspeed_serve_poller_ticks`, `kspeed_serve_poller_busy_seconds`; a build
without them shows nan). It prints each run, then per link count and build the medians of
idle CPU (% of a core), heartbeats and keepalives per link per second and
node CPU per grant (us), and the paired ratios b/a.

  scripts/bench_fake_peers.py --a OLD/kspeed --b target/release/kspeed [--runs 3] [--links 64,4095] [--idle-secs 20] [--grants-per-sec 24000] [--load-secs 10] [--agent]

The space is made once under --dir (default /var/tmp/kspeed-fake-peers)
with the --b binary. The bench binary is built with `cargo bench --bench
fake_peers --no-run` (release). With --agent the node service has
serve's default pollers (the agent's --pollers is per attached rank).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def bench_binary(name="fake_peers"):
    """Builds the bench target `name` (benches/NAME.rs) and returns its binary."""
    out = subprocess.run(
        ["cargo", "bench", "--bench", name, "--no-run", "--message-format=json"],
        cwd=ROOT, check=True, capture_output=True, text=True).stdout
    for line in out.splitlines():
        m = json.loads(line)
        if m.get("reason") == "compiler-artifact" and m["target"]["name"] == name and m.get("executable"):
            return m["executable"]
    sys.exit(f"cannot find the {name} bench binary")


def make_space(kspeed, d, count):
    sp = os.path.join(d, "space")
    if os.path.exists(os.path.join(sp, "manifest")) or os.path.exists(sp):
        return sp, os.path.join(d, "catalog")
    src = os.path.join(d, "src")
    subprocess.run([kspeed, "gen", "--profile", "tiny", "--count", str(count), "--out", src], check=True,
                   stdout=subprocess.DEVNULL)
    cat = os.path.join(d, "catalog")
    subprocess.run([kspeed, "catalog", "--source", src, "--out", cat], check=True, stdout=subprocess.DEVNULL)
    subprocess.run([kspeed, "preload", "--source", src, "--catalog", cat, "--space", sp, "--progress", "none"],
                   check=True, stdout=subprocess.DEVNULL)
    return sp, cat


def start_node(kspeed, space, token, agent, sock_dir):
    flags = ["--listen", "127.0.0.1:0", "--token-file", token, "--max-consumers-per-poller", "4096",
             "--max-handshakes", "4096", "--max-grants", "64", "--metrics", "127.0.0.1:0"]
    if agent:
        cmd = [kspeed, "agent", "--space", space, "--socket", os.path.join(sock_dir, "agent.sock")] + flags
        want = "node service on"
    else:
        cmd = [kspeed, "serve", "--space", space, "--pollers", "1"] + flags
        want = "serving"
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    found = {}

    def read():
        for line in p.stdout:
            if line.startswith("metrics on http://"):
                found["metrics"] = line.split("http://")[1].split("/")[0]
            if line.startswith(want) and "addr" not in found:
                found["addr"] = line.split()[-1]
    t = threading.Thread(target=read, daemon=True)
    t.start()
    deadline = time.time() + 30
    while "addr" not in found:
        if p.poll() is not None or time.time() > deadline:
            p.kill()
            sys.exit(f"{cmd[0]} did not start: {cmd}")
        time.sleep(0.05)
    return p, found["addr"], found.get("metrics")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", required=True, help="the reference kspeed binary")
    ap.add_argument("--b", required=True, help="the kspeed binary measured against it")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--links", default="64,4095")
    ap.add_argument("--idle-secs", type=float, default=20)
    ap.add_argument("--grants-per-sec", type=float, default=24000)
    ap.add_argument("--load-secs", type=float, default=10)
    ap.add_argument("--agent", action="store_true", help="start `agent --listen` instead of `serve`")
    ap.add_argument("--dir", default="/var/tmp/kspeed-fake-peers")
    a = ap.parse_args()
    os.makedirs(a.dir, exist_ok=True)
    space, catalog = make_space(a.b, a.dir, 20000)
    token = os.path.join(a.dir, "token")
    with open(token, "w") as f:
        f.write("fake-peers\n")
    exe = bench_binary()
    builds = {"a": a.a, "b": a.b}
    res = {}  # (links, build) -> list of run dicts
    for r in range(a.runs):
        order = ["a", "b"] if r % 2 == 0 else ["b", "a"]
        for links in [int(x) for x in a.links.split(",")]:
            for b in order:
                with tempfile.TemporaryDirectory() as sd:
                    p, addr, maddr = start_node(builds[b], space, token, a.agent, sd)
                    try:
                        out = subprocess.run(
                            [exe, "--addr", addr, "--catalog", catalog, "--token-file", token, "--links",
                             str(links), "--pid", str(p.pid), "--idle-secs", str(a.idle_secs),
                             "--grants-per-sec", str(a.grants_per_sec), "--load-secs", str(a.load_secs), "--json"]
                            + (["--metrics", maddr] if maddr else []),
                            check=True, capture_output=True, text=True, timeout=600).stdout
                    finally:
                        p.kill()
                        p.wait()
                run = json.loads(out.strip().splitlines()[-1])
                if run["load"] is None:
                    # --load-secs 0: an idle-only run.
                    run["load"] = {"secs": 1, "grants_done": 0, "node_cpu_pct": 0.0, "errors": 0, "violations": 0}
                res.setdefault((links, b), []).append(run)
                idle, load = run["idle"], run["load"]
                print(f"round {r + 1} links {links} build {b}: admitted {run['welcomed']}/{run['links']} "
                      f"refused {run['refused']} in {run['handshake_secs']:.2f} s; idle CPU {idle['node_cpu_pct']:.3f} %, "
                      f"beats/link/s {idle['heartbeats'] / run['welcomed'] / idle['secs']:.3f}, "
                      f"keepalives/link/s {idle['keepalives'] / run['welcomed'] / idle['secs']:.3f}; "
                      f"load {load['grants_done'] / load['secs']:.0f} grants/s, CPU {load['node_cpu_pct']:.1f} %, "
                      f"{load['node_cpu_pct'] * 1e4 * load['secs'] / max(load['grants_done'], 1):.2f} us/grant, "
                      f"errors {load['errors']} violations {load['violations']}", file=sys.stderr, flush=True)

    def fig(run):
        idle, load = run["idle"], run["load"]
        n = run["welcomed"]
        def tick_us(ph):
            t, b = ph.get("node_ticks"), ph.get("node_tick_busy_ns")
            return b / 1e3 / t if t else float("nan")
        return {
            "idle_ticks_per_sec": (idle.get("node_ticks") or float("nan")) / idle["secs"],
            "idle_tick_us": tick_us(idle),
            "load_ticks_per_sec": (load.get("node_ticks") or float("nan")) / load["secs"],
            "load_tick_us": tick_us(load),
            "idle_cpu_pct": idle["node_cpu_pct"],
            "beats": idle["heartbeats"] / n / idle["secs"],
            "keepalives": idle["keepalives"] / n / idle["secs"],
            "us_per_grant": load["node_cpu_pct"] * 1e4 * load["secs"] / max(load["grants_done"], 1),
            "grants_per_sec": load["grants_done"] / load["secs"],
        }

    print("| links | build | idle node CPU, % of a core | heartbeats per link per s | keepalives per link per s "
          "| grants/s answered | node CPU per grant, us | idle: ticks/s | idle: us per tick | load: ticks/s "
          "| load: us per tick |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    keys = ["idle_cpu_pct", "beats", "keepalives", "grants_per_sec", "us_per_grant", "idle_ticks_per_sec",
            "idle_tick_us", "load_ticks_per_sec", "load_tick_us"]
    for links in [int(x) for x in a.links.split(",")]:
        for b in ["a", "b"]:
            figs = [fig(x) for x in res[(links, b)]]
            cells = []
            for k in keys:
                vals = [f[k] for f in figs]
                cells.append(f"{statistics.median(vals):.3f} ({', '.join(f'{v:.3f}' for v in vals)})")
            print(f"| {links} | {b}: {builds[b]} | " + " | ".join(cells) + " |")
        pa = [fig(x) for x in res[(links, 'a')]]
        pb = [fig(x) for x in res[(links, 'b')]]
        ratios = {k: statistics.median(y[k] / x[k] if x[k] else float("nan") for x, y in zip(pa, pb)) for k in keys}
        print(f"| {links} | b / a, paired median | " + " | ".join(f"{ratios[k]:.3f}x" for k in keys) + " |")


if __name__ == "__main__":
    main()
