#!/usr/bin/env python3
"""One node, N rank processes over one local space: attached to one
`kspeed agent` against embedded (each rank its own pollers), side by side
in one run (issue 28's first benchmark row).

Per round, interleaved:
  embedded : N x `kspeed read --agent off` at once (rank r of N)
  attached : one `kspeed agent --pollers P`, N x `kspeed read --agent required`
Reported per mode: samples/s over the whole node (samples of every rank /
wall time of the slowest), CPU seconds per GB (ranks' own CPU from their
--json reports, plus the agent's from /proc in attached mode, and in a
cluster the node services' in embedded mode), and the
poller threads (embedded: the sum of each rank's pollers; attached: the
most poller threads seen in the agents at once, /proc/PID/task: the
node's poller threads, which take turns for every rank's pollers, or
with --node-pollers 0 a thread per poller; N feeder threads besides).
Every rank's order-sensitive digest is checked equal between the modes.

With --idle-s S (issue 28, "idle"): no throughput rows; per round the
agent with its node poller threads and then with a thread per poller
(--node-pollers 0), its ranks attached with `kspeed read --idle-ms`, each
ring filled and nothing consumed: the agent's CPU over 0.8 S seconds of
that, in % of a core, and its poller threads.

With --tier-bytes T (issue 28's second row), embedded ranks get a memory
tier of T/N each (every rank's tier holds the same first ids: a fixed
subset) and the agent one node tier of T shared by all its ranks; the
table adds each mode's tier hit rate and samples/s over epochs >= 2 (from
every rank's per-epoch --json figures), and the attached/embedded ratios,
per run and their median.

With --nodes M (> 1), a cluster on this machine: M spaces holding a share
each (`preload --nodes M --node-index i`), node i at HOSTS.(i+1):PORT
(--hosts, default 127.0.0; with --rdma every node service, agent and
rank moves samples over RDMA: in the soft-RoCE VM, --hosts 10.77.0 with
those addresses on the RDMA interface; RC queue pairs are then counted
with `rdma res show qp` as connections are with `ss`),
--ranks per node (world M x ranks, rank r on node r // ranks). Embedded:
M `kspeed serve` node services and every rank its own pollers and its own
connection to every other node; attached: M `kspeed agent --cluster ...
--listen ...` (each its node's node service too) and the ranks attached to
their node's agent. The tier figures are per node as above; the node tier
keeps what other nodes pushed as well as what the disk gave.
`--compare-env VAR=A,B` (with --nodes > 1) compares instead attached ranks
under agents started with VAR=A against agents started with VAR=B, and
counts the connections to the node services (`ss`): e.g.
KSPEED_AGENT_LINKS=per-rank,shared (a connection per rank against the
agents' shared links) or KSPEED_TIER_MEMBERS=ids,remote-first (the node
tier's members in id order against the samples other nodes hold first).
Per epoch it also gives the fraction of samples pushed by other nodes
(neither read from the local disk, nor the tier, nor the source).

The page cache is not dropped (that needs root); the extents are read with
O_DIRECT either way.

With --compare-tier-views (one node, --tier-bytes T): attached ranks
under an agent with a node tier of T, taking its samples as copies into
their rings against taking them as read-only views of the tier
(`kspeed read --tier-views`, docs/AGENT.md "Tier views"), a fresh agent
each, which one goes first alternating by round (use an even --runs);
CPU per GB counts the agent's and the ranks' CPU.

  scripts/bench_agent.py [--ranks 8] [--nodes 1] [--profile imagenet:2000] [--epochs 2] [--runs 1] [--agent-pollers 1] [--node-pollers K] [--idle-s 20] [--tier-bytes 1GiB] [--compare-env VAR=A,B] [--compare-tier-views]
"""

import argparse
import atexit
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
K = os.environ.get("KSPEED_BIN", os.path.join(ROOT, "target", "release", "kspeed"))


def sh(cmd):
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


def proc_cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    # utime, stime: fields 14 and 15 (1-based), here 11 and 12 after the name.
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class ConnCount:
    """The most TCP connections to the nodes' port seen at once (`ss`,
    every 0.2 s) while it runs: what the consumers hold toward the node
    services, counted once (the side whose peer is the port)."""

    def __init__(self, port):
        self.port, self.most, self.done = port, 0, threading.Event()
        self.t = threading.Thread(target=self.run, daemon=True)
        self.t.start()

    def run(self):
        while not self.done.wait(0.2):
            out = subprocess.run(["ss", "-Htn", "state", "established"], capture_output=True,
                                 text=True).stdout
            n = sum(1 for line in out.splitlines()
                    if line.split() and line.split()[-1].endswith(f":{self.port}"))
            self.most = max(self.most, n)

    def stop(self):
        self.done.set()
        self.t.join()
        return self.most


class PollerThreads(ConnCount):
    """The most poller threads alive at once in the processes `pids`
    (their /proc/PID/task/*/comm, every 0.2 s): a rank's own pollers
    (`kspeed-poller-N`) and the node's (`kspeed-npoll-N`)."""

    def __init__(self, pids):
        self.pids = pids
        super().__init__(0)

    def run(self):
        while not self.done.wait(0.2):
            n = 0
            for pid in self.pids:
                try:
                    for t in os.listdir(f"/proc/{pid}/task"):
                        with open(f"/proc/{pid}/task/{t}/comm") as f:
                            n += f.read().startswith(("kspeed-poller-", "kspeed-npoll-"))
                except OSError:
                    pass
            self.most = max(self.most, n)


class QpCount(ConnCount):
    """The most RC queue pairs alive at once (`rdma res show qp`)."""

    def __init__(self):
        super().__init__(0)

    def run(self):
        while not self.done.wait(0.2):
            out = subprocess.run(["rdma", "res", "show", "qp"], capture_output=True,
                                 text=True).stdout
            self.most = max(self.most, sum(1 for line in out.splitlines() if "type RC" in line))


def ranks(spaces, n, epochs, extra, node_extra=lambda node: []):
    """`n` ranks per node of `spaces` (world len(spaces) x n), rank r on
    node r // n, with `extra` and `node_extra(node)` arguments."""
    world = n * len(spaces)
    procs = [
        subprocess.Popen(
            [K, "read", "--progress=none", "--json", "--digest", "--space", spaces[r // n],
             "--rank", str(r), "--world", str(world), "--epochs", str(epochs),
             "--local-rank", str(r % n), "--local-world-size", str(n)]
            + extra + node_extra(r // n),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for r in range(world)
    ]
    t0 = time.monotonic()
    out = []
    for p in procs:
        o, e = p.communicate(timeout=600)
        if p.returncode != 0:
            show_logs()
            sys.exit(f"kspeed read failed: {e}")
        out.append(json.loads(o))
    return time.monotonic() - t0, out


# Node processes still running: killed at exit, whatever ends the script.
STARTED = []
atexit.register(lambda: [p.kill() for p in STARTED if p.poll() is None])
# Where node processes' stderr goes (the work folder; set in main), one
# file per process started, so a failed run says why.
LOGS = {"dir": None, "files": []}


def show_logs(lines=30):
    """The last lines of every node process's log, and how it ended."""
    for p, path in zip(STARTED, LOGS["files"]):
        rc = p.poll()
        with open(path, errors="replace") as f:
            tail = f.readlines()[-lines:]
        print(f"--- {path} ({'running' if rc is None else f'exit {rc}'}):", file=sys.stderr)
        sys.stderr.writelines(tail)


def start(cmd, ready):
    """A node process, returned once it printed a line containing `ready`;
    its stderr in a log file of the work folder."""
    path = os.path.join(LOGS["dir"] or tempfile.gettempdir(),
                        f"{cmd[1]}-{len(LOGS['files'])}.log")
    log = open(path, "w")
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True)
    log.close()
    STARTED.append(p)
    LOGS["files"].append(path)
    for line in p.stdout:
        if ready in line:
            return p
    show_logs()
    sys.exit(f"{cmd[1]} did not start")


def stop(procs):
    for p in procs:
        p.terminate()
    for p in procs:
        p.wait(timeout=60)


def later_epochs(reports):
    """(samples/s, tier hit rate) over epochs >= 2 of every rank: the node's
    samples over the slowest rank's time for those epochs."""
    later = [[e for e in r["per_epoch"][1:]] for r in reports]
    samples = sum(e["samples"] for es in later for e in es)
    if samples == 0:
        return None, None, None
    slowest = max(sum(e["seconds"] for e in es) for es in later)
    hits = sum(e["tier_hits"] for es in later for e in es)
    return samples / slowest, hits / samples, pushed_fraction([e for es in later for e in es])


def pushed_fraction(epochs):
    """The fraction of the samples of `epochs` (per-epoch reports) that
    other nodes pushed: neither disk reads, tier hits nor source reads."""
    samples = sum(e["samples"] for e in epochs)
    local = sum(e["disk_reads"] + e["tier_hits"] + e["source_reads"] for e in epochs)
    return max(samples - local, 0) / max(samples, 1)


def by_epoch(reports):
    """Per epoch index: (node samples/s over the slowest rank's epoch time,
    tier hit rate)."""
    out = []
    for i in range(len(reports[0]["per_epoch"])):
        es = [r["per_epoch"][i] for r in reports]
        samples = sum(e["samples"] for e in es)
        out.append((samples / max(e["seconds"] for e in es),
                    sum(e["tier_hits"] for e in es) / max(samples, 1), pushed_fraction(es)))
    return out


def summarise(name, wall, reports, extra_cpu, pollers, threads_note):
    later_rate, later_hits, later_pushed = later_epochs(reports)
    samples = sum(r["samples"] for r in reports)
    gb = sum(r["bytes"] for r in reports) / 1e9
    cpu = sum(r["cpu_seconds"] + r["setup_cpu_seconds"] for r in reports) + extra_cpu
    setup = sum(r["setup_cpu_seconds"] for r in reports)
    read_s = max(r["seconds"] for r in reports)
    return {
        "mode": name, "wall_s": wall, "read_s": read_s, "samples_per_s": samples / wall,
        "read_samples_per_s": samples / read_s, "setup_cpu_s": setup,
        "gb_per_s": gb / wall, "cpu_s_per_gb": cpu / gb, "cpu_s": cpu,
        "poller_threads": pollers, "note": threads_note,
        "digests": [r["digest"] for r in reports],
        "later_samples_per_s": later_rate, "later_tier_hit_rate": later_hits,
        "later_pushed": later_pushed,
        "by_epoch": by_epoch(reports),
    }


def idle_rows(a, space, sock, runs):
    """The agent's CPU while its ranks read nothing: `a.ranks` ranks
    attached with `kspeed read --idle-ms` fill their rings, then consume
    nothing; the agent's CPU time (/proc/PID/stat) over most of that idle
    window, with the node's poller threads (--node-pollers as given, or
    the agent's default) against a thread per poller (--node-pollers 0),
    alternating. Returns the rows printed."""
    idle_s = a.idle_s
    rows = []
    settings = [([] if a.node_pollers is None else ["--node-pollers", str(a.node_pollers)],
                  "node poller threads" + ("" if a.node_pollers is None else f" ({a.node_pollers})")),
                (["--node-pollers", "0"], "a thread per poller")]
    for run in range(runs):
        for extra, name in settings:
            agent = start([K, "agent", "--space", space, "--socket", sock, "--no-mlock",
                           "--pollers", str(a.agent_pollers), "--progress=none"] + extra,
                          "agent serving")
            procs = [subprocess.Popen(
                [K, "read", "--progress=none", "--space", space, "--rank", str(r),
                 "--world", str(a.ranks), "--epochs", "1", "--ring-bytes", a.ring_bytes,
                 "--agent", "required", "--agent-socket", sock, "--idle-ms", str(int(idle_s * 1000))],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for r in range(a.ranks)]
            # kspeed read fills its ring for idle/2 + 0.5 s, then idles for
            # idle seconds: measured from a second into the idle part.
            time.sleep(idle_s / 2 + 1.5)
            c0, t0 = proc_cpu_seconds(agent.pid), time.monotonic()
            threads = PollerThreads([agent.pid])
            time.sleep(idle_s * 0.8)
            n = threads.stop()
            c1, t1 = proc_cpu_seconds(agent.pid), time.monotonic()
            for p in procs:
                p.kill()
                p.wait()
            stop([agent])
            rows.append((run, name, 100 * (c1 - c0) / (t1 - t0), n))
            print(f"round {run + 1}: {name}: agent {rows[-1][2]:.2f} % of a core idle with "
                  f"{a.ranks} full rings, {n} poller threads", flush=True)
    return rows


def parse_bytes(text):
    units = {"": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20,
             "g": 1 << 30, "gib": 1 << 30}
    t = text.strip().lower()
    num = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    return int(float(num) * units[t[len(num):]])


def median(xs):
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=8, help="ranks per node")
    ap.add_argument("--nodes", type=int, default=1, help="> 1: a cluster on loopback")
    ap.add_argument("--port", type=int, default=7471, help="the nodes' port (--nodes > 1)")
    ap.add_argument("--profile", default="imagenet:2000")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--agent-pollers", type=int, default=1, help="the agents' --pollers (per rank)")
    ap.add_argument("--node-pollers", type=int, default=None,
                    help="the agents' --node-pollers (default: the agent's own; 0: a thread per poller)")
    ap.add_argument("--net-threads", type=int, default=1, help="the agents' --net-threads (cluster)")
    ap.add_argument("--work", default=None)
    ap.add_argument("--ring-bytes", default="64MiB", help="every rank's ring, both modes")
    ap.add_argument("--hosts", default="127.0.0", help="node i at HOSTS.(i+1) (--nodes > 1)")
    ap.add_argument("--rdma", action="store_true", help="samples over RDMA (--nodes > 1)")
    ap.add_argument("--compare-env", default=None, metavar="VAR=A,B",
                    help="cluster: attached ranks under agents with VAR=A against VAR=B, "
                         "in place of embedded against attached")
    ap.add_argument("--idle-s", type=float, default=None,
                    help="instead: the agent's CPU over about this many seconds while its "
                         "ranks' rings are full (node poller threads against a thread per poller)")
    ap.add_argument("--tier-bytes", default=None,
                    help="memory for tiers on the node: T/N per embedded rank, T for the agent's node tier")
    ap.add_argument("--compare-tier-views", action="store_true",
                    help="one node with --tier-bytes: attached ranks that take the node tier's samples "
                         "as copies into their rings against ranks that take them as views (--tier-views), "
                         "in place of embedded against attached")
    ap.add_argument("--touch", action="store_true",
                    help="every rank reads every byte of its samples (kspeed read --touch), as a "
                         "consumer that looks at its data")
    a = ap.parse_args()
    if a.compare_tier_views and (a.nodes > 1 or not a.tier_bytes):
        sys.exit("--compare-tier-views: one node (--nodes 1) with --tier-bytes")
    tier_total = parse_bytes(a.tier_bytes) if a.tier_bytes else 0
    rank_tier = ["--tier-bytes", str(tier_total // a.ranks)] if tier_total else []
    agent_tier = ["--tier-bytes", str(tier_total), "--no-mlock"] if tier_total else []
    work = a.work or tempfile.mkdtemp(prefix="kspeed-bench-agent-")
    LOGS["dir"] = work
    prof, count = a.profile.split(":")
    src = os.path.join(work, f"{prof}-{count}")
    if not os.path.exists(src):
        sh([K, "gen", "--profile", prof, "--count", count, "--out", src, "--progress", "none"])
    m = a.nodes
    catalog = os.path.join(work, f"catalog-{prof}-{count}")
    if m > 1 and not os.path.exists(catalog):
        sh([K, "catalog", "--source", src, "--out", catalog, "--progress", "none"])
    spaces = []
    for i in range(m):
        space = os.path.join(work, f"space-{prof}-{count}" + (f"-node{i}-of-{m}" if m > 1 else ""))
        if not os.path.exists(space):
            share = ["--catalog", catalog, "--nodes", str(m), "--node-index", str(i)] if m > 1 else []
            sh([K, "preload", "--source", src, "--space", space, "--progress", "none"] + share)
        spaces.append(space)
    socks = [os.path.join(work, f"agent{i}.sock") for i in range(m)]
    if a.idle_s:
        if m > 1:
            sys.exit("--idle-s measures one node")
        idle_rows(a, spaces[0], socks[0], a.runs)
        return
    addrs = [f"{a.hosts}.{i + 1}:{a.port}" for i in range(m)]
    net = []
    if m > 1:
        cluster, token = os.path.join(work, "cluster"), os.path.join(work, "token")
        with open(cluster, "w") as f:
            f.writelines(f"{i} {addr}\n" for i, addr in enumerate(addrs))
        with open(token, "w") as f:
            f.write("bench-agent-token\n")
        os.chmod(token, 0o600)
        net = ["--cluster", cluster, "--token-file", token] + (["--rdma"] if a.rdma else [])
    node_pollers = [] if a.node_pollers is None else ["--node-pollers", str(a.node_pollers)]
    rows = []
    for run in range(a.runs):
        ring = ["--ring-bytes", a.ring_bytes] + (["--touch"] if a.touch else [])
        if a.compare_env:
            var, values = a.compare_env.split("=", 1)
            for value in values.split(","):
                os.environ[var] = value
                agents = [start([K, "agent", "--space", spaces[i], "--socket", socks[i],
                                 "--pollers", str(a.agent_pollers), "--progress=none"] + agent_tier
                                + net + ["--listen", addrs[i], "--net-threads", str(a.net_threads)],
                                "agent serving") for i in range(m)]
                c0 = sum(proc_cpu_seconds(p.pid) for p in agents)
                conns = ConnCount(a.port)
                qps = QpCount() if a.rdma else None
                wall, rep = ranks(spaces, a.ranks, a.epochs, ["--agent", "required"] + ring + net,
                                  lambda node: ["--agent-socket", socks[node]])
                most = conns.stop()
                if qps:
                    most = f"{most} (RC QPs: {qps.stop()})"
                agent_cpu = sum(proc_cpu_seconds(p.pid) for p in agents) - c0
                stop(agents)
                rows.append(summarise(value, wall, rep, agent_cpu, a.agent_pollers * a.ranks * m,
                                      f"{most} connections to node services at most ({m} nodes)"))
            del os.environ[var]
            if rows[-1]["digests"] != rows[-2]["digests"]:
                sys.exit(f"{var}={values} delivered different bytes")
            continue
        if a.compare_tier_views:
            # The order alternates by round (the first of a pair ran slower
            # here whatever it was: 1.4-2.4x with the same binary and mode
            # twice); the rows stay (copies, views) for the pairing.
            modes = [("copies", []), ("views", ["--tier-views"])]
            pair = {}
            for name, views in (modes if run % 2 == 0 else modes[::-1]):
                agent = start([K, "agent", "--space", spaces[0], "--socket", socks[0],
                               "--pollers", str(a.agent_pollers), "--progress=none"] + agent_tier
                              + node_pollers, "agent serving")
                c0 = proc_cpu_seconds(agent.pid)
                wall, rep = ranks(spaces, a.ranks, a.epochs,
                                  ["--agent", "required", "--agent-socket", socks[0]] + ring + views)
                agent_cpu = proc_cpu_seconds(agent.pid) - c0
                stop([agent])
                handed = sum(r.get("tier_views", 0) for r in rep)
                pair[name] = summarise(name, wall, rep, agent_cpu, a.agent_pollers * a.ranks,
                                       f"agent and ranks' CPU; {handed} samples handed out as views"
                                       f" ({'first' if len(pair) == 0 else 'second'} of the round)")
            rows += [pair["copies"], pair["views"]]
            if rows[-1]["digests"] != rows[-2]["digests"]:
                sys.exit("copies and views delivered different bytes")
            continue
        serves = [start([K, "serve", "--space", spaces[i], "--listen", addrs[i], "--token-file",
                         token, "--progress=none"] + (["--rdma"] if a.rdma else []), "serving")
                  for i in range(m)] if m > 1 else []
        s0 = sum(proc_cpu_seconds(p.pid) for p in serves)
        wall, rep = ranks(spaces, a.ranks, a.epochs, ["--agent", "off"] + ring + rank_tier + net)
        # The node services' CPU counts, as the agents' (which serve too) does.
        serve_cpu = sum(proc_cpu_seconds(p.pid) for p in serves) - s0
        stop(serves)
        pollers = sum(r["placement"]["pollers"] for r in rep)
        rows.append(summarise("embedded", wall, rep, serve_cpu, pollers,
                              f"{a.ranks} ranks' own pollers per node"
                              + (f" and {m - 1} connections each" if m > 1 else "")))
        agents = [start([K, "agent", "--space", spaces[i], "--socket", socks[i],
                         "--pollers", str(a.agent_pollers), "--progress=none"] + agent_tier
                        + node_pollers
                        + (net + ["--listen", addrs[i], "--net-threads", str(a.net_threads)]
                           if m > 1 else []), "agent serving")
                  for i in range(m)]
        c0 = sum(proc_cpu_seconds(p.pid) for p in agents)
        counted = PollerThreads([p.pid for p in agents])
        wall, rep = ranks(spaces, a.ranks, a.epochs, ["--agent", "required"] + ring + net,
                          lambda node: ["--agent-socket", socks[node]])
        threads = counted.stop()
        agent_cpu = sum(proc_cpu_seconds(p.pid) for p in agents) - c0
        stop(agents)
        rows.append(summarise("attached", wall, rep, agent_cpu, threads,
                              f"agent: {a.agent_pollers} poller(s) per rank on the poller threads "
                              f"counted, 1 feeder per rank; ranks: 0"))
        if rows[-1]["digests"] != rows[-2]["digests"]:
            sys.exit("attached and embedded ranks delivered different bytes")
    print(f"{m} node(s) x {a.ranks} ranks, {a.profile}, {a.epochs} epochs, {a.runs} run(s); digests equal"
          + (f"; tiers: {tier_total // a.ranks} B per embedded rank, {tier_total} B node tier"
             if tier_total else ""))
    print("samples/s: whole node over the wall time from spawn to the last exit; "
          "read: over the slowest rank's read loop; CPU includes setup (ring, catalog)")
    print(f"{'mode':10} {'samples/s':>10} {'read s/s':>9} {'GB/s':>7} {'CPU s/GB':>9} "
          f"{'setup CPU':>9} {'pollers':>8}  note")
    for r in rows:
        print(f"{r['mode']:10} {r['samples_per_s']:10.0f} {r['read_samples_per_s']:9.0f} "
              f"{r['gb_per_s']:7.3f} {r['cpu_s_per_gb']:9.2f} {r['setup_cpu_s']:9.2f} "
              f"{r['poller_threads']:8d}  {r['note']}")
    if a.epochs >= 2:
        print("epochs >= 2 (per-epoch --json figures of every rank):")
        print(f"{'mode':10} {'samples/s':>10} {'tier hit rate':>14} {'pushed':>7}")
        for r in rows:
            print(f"{r['mode']:10} {r['later_samples_per_s']:10.0f} {r['later_tier_hit_rate']:14.3f} "
                  f"{r['later_pushed']:7.3f}")
        print("per epoch, median over runs: samples/s (tier hit rate, pushed)")
        modes = (rows[0]["mode"], rows[1]["mode"])
        print(f"{'epoch':>5} {modes[0]:>24} {modes[1]:>24} {'speed ratio':>12}")
        for i in range(a.epochs):
            cell = {}
            for mode in modes:
                rs = [r["by_epoch"][i] for r in rows if r["mode"] == mode]
                cell[mode] = tuple(median([x[k] for x in rs]) for k in range(3))
            ratio = median([att["by_epoch"][i][0] / emb["by_epoch"][i][0]
                            for emb, att in zip(rows[0::2], rows[1::2])])
            print(f"{i + 1:>5} {cell[modes[0]][0]:10.0f} ({cell[modes[0]][1]:.3f}, {cell[modes[0]][2]:.3f}) "
                  f"{cell[modes[1]][0]:10.0f} ({cell[modes[1]][1]:.3f}, {cell[modes[1]][2]:.3f}) {ratio:12.2f}")
        pairs = [(rows[i], rows[i + 1]) for i in range(0, len(rows), 2)]
        speed = [att["later_samples_per_s"] / emb["later_samples_per_s"] for emb, att in pairs]
        print(f"{modes[1]} / {modes[0]}, epochs >= 2, samples/s per run: "
              + " ".join(f"{x:.2f}" for x in speed) + f"; median {median(speed):.2f}")
        cpu = [att["cpu_s_per_gb"] / emb["cpu_s_per_gb"] for emb, att in pairs]
        print(f"{modes[1]} / {modes[0]}, CPU s/GB (every epoch) per run: "
              + " ".join(f"{x:.2f}" for x in cpu) + f"; median {median(cpu):.2f}")
        pushed = [(emb["later_pushed"], att["later_pushed"]) for emb, att in pairs]
        print(f"pushed by other nodes, epochs >= 2, {modes[0]} -> {modes[1]} per run: "
              + " ".join(f"{x:.3f}->{y:.3f}" for x, y in pushed))
        if tier_total:
            hits = [att["later_tier_hit_rate"] / max(emb["later_tier_hit_rate"], 1e-9)
                    for emb, att in pairs]
            print(f"{modes[1]} / {modes[0]}, epochs >= 2, tier hit rate per run: "
                  + " ".join(f"{x:.2f}" for x in hits) + f"; median {median(hits):.2f}")
    print(json.dumps([{k: v for k, v in r.items() if k != "digests"} for r in rows]))


if __name__ == "__main__":
    main()
