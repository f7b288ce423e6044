#!/usr/bin/env python3
"""The cluster data path over TCP against a raw socket copy, same endpoints,
same run, medians of --runs runs.

Warm page cache: the owners' spaces are copied to /dev/shm (memory-backed,
so storage is out of the picture and what is measured is the protocol and
the network path). Per profile (imagenet 20,000 samples and volumes 30 by
default, taken from --work as bench_read.py leaves them):

  1 -> 1  : one `kspeed serve --page-cache` (1 poller; --staging: reads into
            staging as on NVMe) on 127.0.0.1 pushing every sample
            to one consumer (`kspeed read --source ... --cluster`, nothing
            local), 2 epochs; bytes/s from the consumer, CPU s/GB for each
            side (the service's from /proc).
  raw     : examples/socket_copy.rs moving the same bytes between the same
            addresses (write_all of 1 MiB / read into a 256 MiB ring).
  3 -> 2  : three services on 127.0.0.1-3 (a 3-node space, 1 copy) and two
            consumers (ranks 0 and 1 of 2) at once: aggregate bytes/s, against
            two raw socket copies at once.
  raw, DRAM source (page-cache mode only): the same socket copies, but each
            sender walks a buffer as large as its share of the dataset instead
            of rewriting one 1 MiB buffer that never leaves the CPU's cache:
            kspeed's page-cache sender copies every byte from DRAM, so this is
            the like-for-like reference (both are printed).

  scripts/bench_net.py [--runs 3] [--work /var/tmp/kspeed-bench] [--profiles imagenet:20000,volumes:30] [--staging]

--ab OLD_KSPEED: A/B against another build (e.g. the commit before a change):
each run measures kspeed 1 -> 1 and 3 -> 2 with this build and with OLD_KSPEED
(alternating which goes first), plus the raw copies; prints both builds' GB/s,
the ratio this/old paired per run (median), and each against raw.

A perf regression guard, under a minute: `scripts/bench_net.py --quick`
(imagenet 3,000 samples; add --staging for the NVMe path). Compare the
ratios against the raw socket before and after a change.

--disk: the NVMe path as deployed. The spaces live under --work on the disk
(not /dev/shm), the services read into staging with O_DIRECT (a DMA, no CPU
copy; on /dev/shm the "read" into staging is a second memcpy that an NVMe
node does not pay), and the page cache is dropped before each run. The
reference in the same run is the slower of the raw socket copy and fio
reading the same extent files (O_DIRECT, 256 KiB blocks = the staging chunk,
QD 32): the pipeline cannot beat its slower stage.
"""

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# KSPEED_BIN: another build to measure (A/B against an older commit).
K = os.environ.get("KSPEED_BIN", os.path.join(ROOT, "target", "release", "kspeed"))
COPY = os.path.join(ROOT, "target", "release", "examples", "socket_copy")
SHM = "/dev/shm/kspeed-bench-net"


DISK = False


def drop_caches():
    subprocess.run("sync", check=True)
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def fio_extents(spaces):
    """fio reading every extent file of `spaces` once, one job per space at once (as one service per space
    reads), O_DIRECT, 256 KiB (the staging chunk), QD 32: aggregate GB/s."""
    import json
    args = ["fio", "--direct=1", "--ioengine=io_uring", "--readonly", "--output-format=json", "--rw=read",
            "--bs=256k", "--iodepth=32", "--group_reporting"]
    for i, sp in enumerate(spaces):
        d = os.path.join(sp, "extents")
        files = sorted(os.path.join(d, f) for f in os.listdir(d))
        total = sum(os.path.getsize(f) for f in files)
        args += [f"--name=space{i}", "--filename=" + ":".join(files), f"--size={total // (1 << 20) << 20}"]
    drop_caches()
    out = sh(args)
    j = json.loads(out[out.index("{"):])["jobs"][0]
    return j["read"]["bw_bytes"] / 1e9


def sh(cmd, **kw):
    return subprocess.run(cmd, check=True, capture_output=True, text=True, **kw).stdout


def proc_cpu(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


PAGE_CACHE = []


def start_serve(space, addr, token, port=0):
    p = subprocess.Popen([K, "serve", "--space", space, "--listen", f"{addr}:{port}", "--token-file", token,
                          "--pollers", "1", *PAGE_CACHE], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                         text=True)
    line = p.stdout.readline()
    return p, line.strip().rsplit(" ", 1)[1]


def parse_read(out):
    m = re.search(r"read (\d+) samples, .* in ([\d.]+) s: (\d+) samples/s, ([\d.]+) GB/s", out)
    cpu = float(re.search(r"CPU: ([\d.]+) s", out).group(1))
    secs, gbs = float(m.group(2)), float(m.group(4))
    return {"secs": secs, "gbs": gbs, "bytes": gbs * secs * 1e9, "cpu": cpu}


def consumer_cmd(src, catalog, cluster, token, rank=0, world=1, epochs=2):
    # A batch of 64 volumes (up to 3.6 GB) does not fit the 256 MiB ring,
    # which the loader refuses by name: volumes are read one per batch.
    batch = ["--batch-size", "1"] if os.path.basename(src).startswith("src-volumes") else []
    return [K, "read", "--progress=none", "--source", src, "--catalog", catalog, "--cluster", cluster,
            "--token-file", token, "--epochs", str(epochs), "--pollers", "1", "--rank", str(rank),
            "--world", str(world), *batch]


def kspeed_1to1(space, src, token, work):
    if DISK:
        drop_caches()
    serve, addr = start_serve(space, "127.0.0.1", token)
    cluster = os.path.join(work, "cluster-1")
    with open(cluster, "w") as f:
        f.write(f"0 {addr}\n")
    c0 = proc_cpu(serve.pid)
    r = parse_read(sh(consumer_cmd(src, os.path.join(space, "catalog.ksc"), cluster, token)))
    r["serve_cpu"] = proc_cpu(serve.pid) - c0
    serve.terminate()
    serve.wait()
    gb = r["bytes"] / 1e9
    return {"gbs": r["gbs"], "bytes": r["bytes"], "cons_cpu_gb": r["cpu"] / gb, "serve_cpu_gb": r["serve_cpu"] / gb}


def raw_copy(nbytes, pairs=1, source=0):
    """`pairs` socket copies at once; aggregate GB/s and CPU s/GB per side.
    source > 0: each sender walks a buffer of that many bytes (DRAM source)."""
    recvs, port0 = [], 7600
    for i in range(pairs):
        p = subprocess.Popen([COPY, "recv", f"127.0.0.1:{port0 + i}", str(int(nbytes))], stdout=subprocess.PIPE,
                             text=True)
        assert p.stdout.readline().strip() == "listening"
        recvs.append(p)
    extra = [str(int(source))] if source else []
    sends = [subprocess.Popen([COPY, "send", f"127.0.0.1:{port0 + i}", str(int(nbytes)), *extra],
                              stdout=subprocess.PIPE, text=True) for i in range(pairs)]
    outs = [s.communicate()[0] for s in sends] + [r.communicate()[0] for r in recvs]
    # Timed by the receivers, from the first connection to the last byte: a
    # sender with a large source fills it before connecting, and that is not
    # part of the copy.
    windows = [tuple(map(float, re.search(r"window ([\d.]+) ([\d.]+)", o).groups())) for o in outs
               if o.startswith("recv")]
    secs = max(e for _, e in windows) - min(s for s, _ in windows)
    cpu = lambda side: sum(float(re.search(r"CPU ([\d.]+) s", o).group(1)) for o in outs if o.startswith(side))
    gb = nbytes * pairs / 1e9
    return {"gbs": gb / secs, "send_cpu_gb": cpu("send") / gb, "recv_cpu_gb": cpu("recv") / gb}


def kspeed_3to2(spaces, src, token, work):
    if DISK:
        drop_caches()
    serves = [start_serve(sp, f"127.0.0.{i + 1}", token) for i, sp in enumerate(spaces)]
    cluster = os.path.join(work, "cluster-3")
    with open(cluster, "w") as f:
        for i, (_, a) in enumerate(serves):
            f.write(f"{i} {a}\n")
    cat = os.path.join(spaces[0], "catalog.ksc")
    t0 = time.time()
    procs = [subprocess.Popen(consumer_cmd(src, cat, cluster, token, rank=r, world=2), stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True) for r in range(2)]
    outs = [p.communicate()[0] for p in procs]
    wall = time.time() - t0
    for p, _ in serves:
        p.terminate()
        p.wait()
    rs = [parse_read(o) for o in outs]
    total = sum(r["bytes"] for r in rs)
    return {"gbs": total / 1e9 / max(r["secs"] for r in rs), "wall_gbs": total / 1e9 / wall, "bytes": total}


def prepare(work, profile, count):
    """Spaces on /dev/shm: one holding everything, and a 3-node split."""
    src = os.path.join(work, f"src-{profile}-{count}")
    if not os.path.isdir(src):
        sh([K, "gen", "--profile", profile, "--count", str(count), "--out", src])
    base = os.path.join(work if DISK else SHM, f"net-{profile}-{count}" if DISK else f"{profile}-{count}")
    os.makedirs(base, exist_ok=True)
    cat = os.path.join(base, "cat.ksc")
    if not os.path.exists(cat):
        sh([K, "catalog", "--source", src, "--out", cat])
    one = os.path.join(base, "one")
    if DISK and os.path.isdir(one) and all(os.path.isdir(os.path.join(base, f"n{i}")) for i in range(3)):
        return src, one, [os.path.join(base, f"n{i}") for i in range(3)]
    sh([K, "preload", "--progress=none", "--source", src, "--catalog", cat, "--space", one])
    three = []
    for i in range(3):
        sp = os.path.join(base, f"n{i}")
        sh([K, "preload", "--progress=none", "--source", src, "--catalog", cat, "--space", sp, "--nodes", "3",
            "--node-index", str(i)])
        three.append(sp)
    return src, one, three


def ab(a, token):
    """--ab: this build against another, paired per run."""
    global K
    new, old = K, os.path.abspath(a.ab)
    print(f"A/B: this build {new} against {old}\n")
    for spec in a.profiles.split(","):
        profile, count = spec.split(":")
        src, one, three = prepare(a.work, profile, int(count))
        rows = {"new": ([], []), "old": ([], [])}
        raw, raw2 = [], []
        for run in range(a.runs):
            order = ["new", "old"] if run % 2 == 0 else ["old", "new"]
            for which in order:
                K = new if which == "new" else old
                rows[which][0].append(kspeed_1to1(one, src, token, a.work))
                rows[which][1].append(kspeed_3to2(three, src, token, a.work))
            K = new
            raw.append(raw_copy(rows["new"][0][-1]["bytes"]))
            raw2.append(raw_copy(rows["new"][1][-1]["bytes"] / 2, pairs=2))
        print(f"## {profile}: {count} samples, 2 epochs, {a.runs} runs\n")
        print("| run | this build GB/s | old build GB/s | this/old (paired, median) | this vs raw | old vs raw |")
        print("|---|---|---|---|---|---|")
        for i, (name, refs) in enumerate([("1 owner -> 1 consumer", raw), ("3 owners -> 2 consumers", raw2)]):
            n, o = rows["new"][i], rows["old"][i]
            paired = statistics.median(x["gbs"] / y["gbs"] for x, y in zip(n, o))
            vn = statistics.median(x["gbs"] / r["gbs"] for x, r in zip(n, refs))
            vo = statistics.median(y["gbs"] / r["gbs"] for y, r in zip(o, refs))
            print(f"| {name} | {med(n, 'gbs'):.3f} | {med(o, 'gbs'):.3f} | {paired:.3f}x | {vn:.2f}x | {vo:.2f}x |")
            print(f"|  per run (this/old GB/s) | " + ", ".join(f"{x['gbs']:.3f}/{y['gbs']:.3f}" for x, y in zip(n, o))
                  + " | | | | |")
        print()
        sys.stdout.flush()


def med(rows, key):
    return statistics.median(r[key] for r in rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--work", default="/var/tmp/kspeed-bench")
    ap.add_argument("--profiles", default="imagenet:20000,volumes:30")
    ap.add_argument("--keep", action="store_true", help="keep the /dev/shm copies")
    ap.add_argument("--quick", action="store_true",
                    help="regression guard (under a minute): imagenet:3000 only, ratios against raw sockets")
    ap.add_argument("--staging", action="store_true",
                    help="services read into staging (O_DIRECT path) instead of sending from the page cache")
    ap.add_argument("--ab", metavar="OLD_KSPEED",
                    help="also measure this other kspeed binary in every run, alternating, and print this/old")
    ap.add_argument("--disk", action="store_true",
                    help="spaces on the disk under --work, cold cache, staging with O_DIRECT; reference = "
                         "min(raw socket, fio over the extents)")
    a = ap.parse_args()
    global DISK
    DISK = a.disk
    if a.disk:
        a.staging = True
        if os.geteuid() != 0:
            sys.exit("--disk drops the page cache before each run: run as root")
    if a.quick and a.profiles == ap.get_default("profiles"):
        a.profiles = "imagenet:3000"
    if not a.staging:
        PAGE_CACHE.append("--page-cache")
    sh(["cargo", "build", "--release", "--quiet", "--bin", "kspeed", "--example", "socket_copy"], cwd=ROOT)
    os.makedirs(a.work, exist_ok=True)
    token = os.path.join(a.work, "bench-token")
    with open(token, "w") as f:
        f.write("bench\n")
    mode = "reads into staging" if a.staging else "--page-cache"
    if a.disk:
        mode = "O_DIRECT reads from the disk into staging, cold cache"
    print(f"# network benchmark, {os.cpu_count()} cores, median of {a.runs}, services with {mode}\n")
    try:
        if a.ab:
            return ab(a, token)
        for spec in a.profiles.split(","):
            profile, count = spec.split(":")
            src, one, three = prepare(a.work, profile, int(count))
            ks, raw, ks3, raw2, fio1, fio3, rawd, raw2d = [], [], [], [], [], [], [], []
            ext = os.path.join(one, "extents")
            data_bytes = sum(os.path.getsize(os.path.join(ext, f)) for f in os.listdir(ext))
            for _ in range(a.runs):
                k = kspeed_1to1(one, src, token, a.work)
                ks.append(k)
                raw.append(raw_copy(k["bytes"]))
                k3 = kspeed_3to2(three, src, token, a.work)
                ks3.append(k3)
                raw2.append(raw_copy(k3["bytes"] / 2, pairs=2))
                if not a.staging:
                    rawd.append(raw_copy(k["bytes"], source=data_bytes))
                    raw2d.append(raw_copy(k3["bytes"] / 2, pairs=2, source=data_bytes / 2))
                if DISK:
                    # The pipeline's other stage: the disk. The reference is the slower stage.
                    fio1.append(fio_extents([one]))
                    fio3.append(fio_extents(three))
                    raw[-1]["socket_gbs"], raw2[-1]["socket_gbs"] = raw[-1]["gbs"], raw2[-1]["gbs"]
                    raw[-1]["gbs"] = min(raw[-1]["gbs"], fio1[-1])
                    raw2[-1]["gbs"] = min(raw2[-1]["gbs"], fio3[-1])
            ratio = statistics.median(k["gbs"] / r["gbs"] for k, r in zip(ks, raw))
            ratio3 = statistics.median(k["gbs"] / r["gbs"] for k, r in zip(ks3, raw2))
            print(f"## {profile}: {count} samples, 2 epochs\n")
            print("| run | GB/s | vs raw | CPU s/GB sender | CPU s/GB receiver |")
            print("|---|---|---|---|---|")
            print(f"| kspeed 1 owner -> 1 consumer | {med(ks, 'gbs'):.3f} | {ratio:.2f}x | "
                  f"{med(ks, 'serve_cpu_gb'):.2f} | {med(ks, 'cons_cpu_gb'):.2f} |")
            print(f"| raw socket copy, 1 stream | {med(raw, 'gbs'):.3f} | 1.00x | "
                  f"{med(raw, 'send_cpu_gb'):.2f} | {med(raw, 'recv_cpu_gb'):.2f} |")
            print(f"| kspeed 3 owners -> 2 consumers (aggregate) | {med(ks3, 'gbs'):.3f} | {ratio3:.2f}x | | |")
            print(f"| raw socket copy, 2 streams (aggregate) | {med(raw2, 'gbs'):.3f} | 1.00x | "
                  f"{med(raw2, 'send_cpu_gb'):.2f} | {med(raw2, 'recv_cpu_gb'):.2f} |")
            if rawd:
                ratio_d = statistics.median(k["gbs"] / r["gbs"] for k, r in zip(ks, rawd))
                ratio3_d = statistics.median(k["gbs"] / r["gbs"] for k, r in zip(ks3, raw2d))
                print(f"| raw socket copy, 1 stream, DRAM source ({data_bytes / 1e9:.2f} GB) | "
                      f"{med(rawd, 'gbs'):.3f} | kspeed {ratio_d:.2f}x | {med(rawd, 'send_cpu_gb'):.2f} | "
                      f"{med(rawd, 'recv_cpu_gb'):.2f} |")
                print(f"| raw socket copy, 2 streams, DRAM source (aggregate) | {med(raw2d, 'gbs'):.3f} | "
                      f"kspeed {ratio3_d:.2f}x | {med(raw2d, 'send_cpu_gb'):.2f} | {med(raw2d, 'recv_cpu_gb'):.2f} |")
            if DISK:
                print(f"\nreference = min(raw socket, fio over the extents): raw socket {med(raw, 'socket_gbs'):.3f} "
                      f"/ {med(raw2, 'socket_gbs'):.3f} GB/s (1 / 2 streams), fio O_DIRECT 256 KiB QD 32 "
                      f"{statistics.median(fio1):.3f} / {statistics.median(fio3):.3f} GB/s (1 space / 3 spaces)")
            print("\nper run (kspeed 1->1 / raw GB/s):",
                  ", ".join(f"{k['gbs']:.3f}/{r['gbs']:.3f}" for k, r in zip(ks, raw)))
            print("per run (kspeed 3->2 / raw x2 GB/s):",
                  ", ".join(f"{k['gbs']:.3f}/{r['gbs']:.3f}" for k, r in zip(ks3, raw2)), "\n")
            sys.stdout.flush()
    finally:
        if not a.keep:
            shutil.rmtree(SHM, ignore_errors=True)


if __name__ == "__main__":
    main()
