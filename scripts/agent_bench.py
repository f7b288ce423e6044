"""Helpers the node-agent benchmark scripts share (bench_kept_links.py,
bench_node_down.py): a tiny dataset preloaded for N nodes on loopback
addresses, waiting for a log line, stopping agents."""

import os
import signal
import subprocess
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KSPEED = os.path.join(ROOT, "target", "release", "kspeed")


def run(args):
    subprocess.run(args, check=True, stdout=subprocess.DEVNULL)


def ensure_built():
    if not os.path.exists(KSPEED):
        subprocess.run(["cargo", "build", "--release", "--bin", "kspeed"], cwd=ROOT, check=True)


def make_spaces(base, nodes, count, addr, port, token_text):
    """Spaces for `nodes` nodes of `count` tiny samples under `base`
    (`space0`...), the cluster file (node i at `addr.format(i + 1)`:`port`)
    and the token; made once per `base`."""
    cluster = os.path.join(base, "cluster")
    if os.path.exists(cluster):
        return base
    os.makedirs(base, exist_ok=True)
    src, cat = os.path.join(base, "src"), os.path.join(base, "catalog")
    run([KSPEED, "gen", "--profile", "tiny", "--count", str(count), "--out", src, "--seed", "7"])
    run([KSPEED, "catalog", "--source", src, "--out", cat])
    for i in range(nodes):
        run([KSPEED, "preload", "--source", src, "--catalog", cat, "--space", os.path.join(base, f"space{i}"),
             "--nodes", str(nodes), "--node-index", str(i)])
    token = os.path.join(base, "token")
    with open(token, "w") as f:
        f.write(token_text + "\n")
    os.chmod(token, 0o600)
    with open(cluster + ".tmp", "w") as f:
        for i in range(nodes):
            f.write(f"{i} {addr.format(i + 1)}:{port}\n")
    os.rename(cluster + ".tmp", cluster)
    return base


def wait_line(path, needles, deadline):
    """Waits (polling the log file, until `deadline`) for a line holding
    every one of `needles` (a string: that one)."""
    if isinstance(needles, str):
        needles = [needles]
    while time.monotonic() < deadline:
        try:
            with open(path) as f:
                if any(all(n in line for n in needles) for line in f):
                    return True
        except FileNotFoundError:
            pass
        time.sleep(0.01)
    return False


def stop_agents(agents):
    """SIGTERM (after a SIGCONT, for one that was stopped) and a wait;
    SIGKILL after 30 s."""
    for p in agents:
        p.send_signal(signal.SIGCONT)
        p.send_signal(signal.SIGTERM)
    for p in agents:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
