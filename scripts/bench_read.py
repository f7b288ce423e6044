#!/usr/bin/env python3
"""kspeed read (the local data path) against the references, on a cold page
cache (dropped before every run; root needed), medians of --runs runs.

Per profile (imagenet 20,000 samples, tiny 200,000, volumes 30 by default):
  kspeed      : kspeed read --space, one epoch, default pollers and queue depth
  fio         : fio randread over the same extent files, io_uring, direct=1,
                block size near the mean sample size, the same queue depth,
                offsets aligned to the block size (the device's best case)
  fio 4k-align: the same with offsets aligned to 4 KiB, as samples are
  fio replay  : fio replaying kspeed's exact reads of the epoch (an iolog from
                examples/fio_iolog.rs), the same queue depth
  naive loop  : one thread, open + pread every source file in sampler order
  naive pool  : 8 threads doing the same
Then, on imagenet: 1 vs 2 pollers; the memory tier holding all / half of the
set (epochs 2+) against a warm page cache pread pool; idle CPU with the ring
full; peak RSS with a 256 MiB ring at two dataset sizes.

  scripts/bench_read.py [--runs 3] [--work /var/tmp/kspeed-bench] [--profiles imagenet:20000,tiny:200000,volumes:30]

A perf regression guard, under a minute once the datasets exist (the first
run generates and preloads them): the same tables on small imagenet and tiny
sets, kspeed against fio in the same run, without the extra imagenet section.
Run it before and after a change; compare the ratios, not the GB/s.

  scripts/bench_read.py --quick

Parts only (the issue-20 rows), each with its reference in the same run:

  scripts/bench_read.py --only tier [--runs 5]     # memory tier vs warm 8-thread pread pool
  scripts/bench_read.py --only tiny [--runs 5]     # tiny 200,000 vs fio 4 KiB randread, QD 32
  scripts/bench_read.py --only tiny --variant=--coop-taskrun   # plus a second kspeed run per round

`--only tier` runs, per round and interleaved, the 8-thread pread pool over
the source files on a warm page cache, then kspeed read with the tier
holding the whole imagenet set (epochs 2-3 timed) copying into the ring
(default) and handing out views (--tier-views), each also with --touch (the
consumer reads every byte); prints per-round ratios and their medians.
DALI warm (`fn.readers.file` over a warm page cache) is scripts/bench_dali.py.
`--only tiny` is the tiny profile's table alone (kspeed, fio bs-aligned,
fio 4 KiB-aligned, fio replay), with per-round ratios.
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# KSPEED_BIN: another build to measure (A/B against an older commit).
K = os.environ.get("KSPEED_BIN", os.path.join(ROOT, "target", "release", "kspeed"))
NAIVE = os.path.join(ROOT, "target", "release", "examples", "naive_read")
IOLOG = os.path.join(ROOT, "target", "release", "examples", "fio_iolog")


def sh(cmd, **kw):
    return subprocess.run(cmd, check=True, capture_output=True, text=True, **kw).stdout


def drop_caches():
    subprocess.run("sync", check=True)
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def kspeed_read(space, *extra, cold=True):
    if cold:
        drop_caches()
    out = sh([K, "read", "--space", space, "--progress=none", *extra])
    m = re.search(r"read (\d+) samples, .* in ([\d.]+) s: (\d+) samples/s, ([\d.]+) GB/s", out)
    cpu = float(re.search(r"CPU: ([\d.]+) s", out).group(1))  # while reading, setup excluded
    lat = re.search(r"p50 (\d+) us, p99 (\d+) us", out)
    hits = re.search(r"(\d+) disk reads, (\d+) tier hits", out)
    epochs = [float(x) for x in re.findall(r"epoch \d+: .* \((\d+) samples/s", out)]
    gb = int(m.group(1)) and float(m.group(4)) * float(m.group(2))
    return {
        "sps": float(m.group(3)), "gbs": float(m.group(4)), "cpu_per_gb": cpu / max(gb, 1e-9),
        "p50": int(lat.group(1)), "p99": int(lat.group(2)), "epoch_sps": epochs,
        "disk": int(hits.group(1)), "hits": int(hits.group(2)), "out": out,
        "cpu_s": cpu, "n": int(m.group(1)),
    }


def fio_run(args):
    drop_caches()
    out = sh(["fio", "--name=ref", "--direct=1", "--ioengine=io_uring", "--readonly", "--output-format=json", *args])
    j = json.loads(out[out.index("{"):])["jobs"][0]
    secs = j["read"]["runtime"] / 1000
    cpu = (j["usr_cpu"] + j["sys_cpu"]) / 100 * secs
    gb = j["read"]["io_bytes"] / 1e9
    return {"gbs": j["read"]["bw_bytes"] / 1e9, "iops": j["read"]["iops"], "cpu_per_gb": cpu / gb,
            "cpu_s": cpu, "ios": j["read"]["total_ios"]}


def fio_randread(files, bs, qd, total, align=None):
    extra = [f"--blockalign={align}"] if align else []
    return fio_run(["--filename=" + ":".join(files), "--rw=randread", f"--bs={bs}", f"--iodepth={qd}",
                    f"--io_size={total}", *extra])


def fio_replay(iolog, qd):
    return fio_run([f"--read_iolog={iolog}", f"--iodepth={qd}"])


def naive(catalog, mode, cold=True):
    if cold:
        drop_caches()
    args = [NAIVE, catalog] + (["loop"] if mode == "loop" else ["pool", "8"])
    out = sh(args)
    m = re.search(r"([\d.]+) samples/s, ([\d.]+) GB/s, CPU ([\d.]+) s \(([\d.]+) s per GB", out)
    return {"sps": float(m.group(1)), "gbs": float(m.group(2)), "cpu_per_gb": float(m.group(4))}


def med(rs, key):
    return statistics.median(r[key] for r in rs)


def prepare(work, profile, count):
    src = os.path.join(work, f"src-{profile}-{count}")
    space = os.path.join(work, f"sp-{profile}-{count}")
    sh([K, "gen", "--profile", profile, "--count", str(count), "--out", src, "--seed", "1", "--progress=none"])
    sh([K, "preload", "--source", src, "--space", space, "--progress=none"])
    return src, space


def peak_rss_mib(space, *extra):
    drop_caches()
    r = subprocess.run(["/usr/bin/time", "-v", K, "read", "--space", space, "--progress=none", *extra],
                       check=True, capture_output=True, text=True)
    return int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", r.stderr).group(1)) / 1024


def tier_only(a):
    """The memory-tier row: kspeed's tier (whole imagenet set, epochs 2-3)
    copying into the ring and handing out views, with and without touching
    the bytes, against an 8-thread pread pool over a warm page cache; all in
    each round, interleaved."""
    spec = a.profiles if a.profiles != "imagenet:20000,tiny:200000,volumes:30" else "imagenet:20000"
    profile, count = spec.split(",")[0].split(":")
    subprocess.run(["cargo", "build", "--release", "--quiet", "--example", "naive_read"], cwd=ROOT, check=True)
    subprocess.run(["cargo", "build", "--release", "--quiet"], cwd=ROOT, check=True)
    os.makedirs(a.work, exist_ok=True)
    src, space = prepare(a.work, profile, int(count))
    catalog = os.path.join(space, "catalog.ksc")
    e2 = lambda r: statistics.mean(r["epoch_sps"][1:])
    modes = {
        "tier, copy into the ring (default)": [],
        "tier, copy, --touch": [],
        "tier, views (--tier-views)": [],
        "tier, views, --touch": [],
    }
    flags = {
        "tier, copy into the ring (default)": [],
        "tier, copy, --touch": ["--touch"],
        "tier, views (--tier-views)": ["--tier-views"],
        "tier, views, --touch": ["--tier-views", "--touch"],
    }
    warm, loads = [], []
    for r in range(a.runs):
        naive(catalog, "pool")
        warm.append(naive(catalog, "pool", cold=False)["sps"])
        for name, rs in modes.items():
            rs.append(e2(kspeed_read(space, "--epochs", "3", "--tier-bytes", "8GiB", *flags[name])))
        loads.append(open("/proc/loadavg").read().split()[0])
        print(f"  round {r + 1}: warm pool {warm[-1]:.0f}; "
              + "; ".join(f"{n} {rs[-1]:.0f} ({rs[-1] / warm[-1]:.2f}x)" for n, rs in modes.items())
              + f"; load {loads[-1]}", file=sys.stderr, flush=True)
    print(f"### {profile} {count}: memory tier (whole set, epochs 2-3) vs warm 8-thread pread pool, "
          f"{a.runs} rounds, load average {', '.join(loads)}")
    print()
    print("| reader | samples/s (median) | per round | vs warm pool (median of per-round ratios) |")
    print("|---|---:|---|---:|")
    print(f"| pread pool, 8 threads, warm page cache | {statistics.median(warm):.0f} | "
          f"{', '.join(f'{x:.0f}' for x in warm)} | 1.00x |")
    for name, rs in modes.items():
        ratio = statistics.median(x / w for x, w in zip(rs, warm))
        print(f"| kspeed read, {name} | {statistics.median(rs):.0f} | {', '.join(f'{x:.0f}' for x in rs)} | {ratio:.2f}x |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--work", default="/var/tmp/kspeed-bench")
    ap.add_argument("--profiles", default="imagenet:20000,tiny:200000,volumes:30")
    ap.add_argument("--qd", type=int, default=32)
    ap.add_argument("--quick", action="store_true",
                    help="regression guard: imagenet:3000,tiny:30000, no scaling/tier/idle/RSS section")
    ap.add_argument("--variant", default="",
                    help="extra kspeed read flags (e.g. --coop-taskrun): a second kspeed run per round, "
                         "reported as variant / default per round")
    ap.add_argument("--only", choices=["tier", "tiny"],
                    help="run one part: the memory-tier comparison, or the tiny table")
    a = ap.parse_args()
    if a.quick and a.profiles == ap.get_default("profiles"):
        a.profiles = "imagenet:3000,tiny:30000"
    if a.only == "tiny" and a.profiles == ap.get_default("profiles"):
        a.profiles = "tiny:200000"
    if a.only == "tier":
        tier_only(a)
        return
    subprocess.run(["cargo", "build", "--release", "--quiet", "--example", "naive_read", "--example", "fio_iolog"], cwd=ROOT, check=True)
    subprocess.run(["cargo", "build", "--release", "--quiet"], cwd=ROOT, check=True)
    os.makedirs(a.work, exist_ok=True)
    report = []

    def say(line=""):
        print(line, flush=True)
        report.append(line)

    spaces = {}
    for spec in a.profiles.split(","):
        profile, count = spec.split(":")
        src, space = prepare(a.work, profile, int(count))
        spaces[profile] = (src, space)
        catalog = os.path.join(space, "catalog.ksc")
        info = sh([K, "inspect", "--space", space])
        total = sum(os.path.getsize(os.path.join(space, "extents", f)) for f in os.listdir(os.path.join(space, "extents")))
        mean = float(re.search(r"mean ([\d.]+) (\w+)", info).group(1))
        unit = re.search(r"mean ([\d.]+) (\w+)", info).group(2)
        mean_b = mean * {"B": 1, "KiB": 1024, "MiB": 1 << 20, "GiB": 1 << 30}[unit]
        bs = max(4096, min(int(mean_b) // 4096 * 4096, 16 << 20))
        files = sorted(os.path.join(space, "extents", f) for f in os.listdir(os.path.join(space, "extents")))
        iolog = os.path.join(a.work, f"{profile}.iolog")
        with open(iolog, "w") as f:
            subprocess.run([IOLOG, space], check=True, stdout=f)
        ks, kv, fs, fa, fr, nl, npool = [], [], [], [], [], [], []
        naive_too = a.only != "tiny"
        for r in range(a.runs):
            ring = ["--ring-bytes", "1GiB"] if profile == "volumes" else []
            ks.append(kspeed_read(space, "--queue-depth", str(a.qd), *ring))
            if a.variant:
                kv.append(kspeed_read(space, "--queue-depth", str(a.qd), *ring, *a.variant.split()))
                print(f"  {profile} run {r + 1}: variant {a.variant}: {kv[-1]['sps']:.0f} samples/s "
                      f"({kv[-1]['sps'] / ks[-1]['sps']:.2f}x the default)", file=sys.stderr, flush=True)
            fs.append(fio_randread(files, bs, a.qd, total))
            fa.append(fio_randread(files, bs, a.qd, total, align=4096))
            fr.append(fio_replay(iolog, a.qd))
            if naive_too:
                nl.append(naive(catalog, "loop"))
                npool.append(naive(catalog, "pool"))
            print(f"  {profile} run {r + 1}: kspeed {ks[-1]['sps']:.0f} samples/s, {ks[-1]['gbs']:.3f} GB/s; "
                  f"fio {fs[-1]['iops']:.0f} IOPS, fio-4k {fa[-1]['iops']:.0f}, replay {fr[-1]['iops']:.0f}; "
                  f"kspeed/fio-4k {ks[-1]['sps'] / fa[-1]['iops']:.2f}x, kspeed/replay {ks[-1]['sps'] / fr[-1]['iops']:.2f}x"
                  + (f"; loop {nl[-1]['gbs']:.3f} GB/s, pool {npool[-1]['gbs']:.3f}" if naive_too else ""),
                  file=sys.stderr, flush=True)
        n = int(count)
        say(f"### {profile}: {n} samples, mean {mean} {unit}, fio bs {bs}, queue depth {a.qd}, median of {a.runs}")
        say("")
        say("| reader | GB/s | samples/s (IOPS) | CPU s/GB | reader / kspeed |")
        say("|---|---:|---:|---:|---:|")
        kg = med(ks, "gbs")
        say(f"| kspeed read | {kg:.3f} | {med(ks, 'sps'):.0f} | {med(ks, 'cpu_per_gb'):.3f} | 1.00 |")
        for name, rs in (("fio randread, bs-aligned offsets", fs), ("fio randread, 4 KiB-aligned offsets", fa),
                         ("fio replaying kspeed's reads", fr)):
            g = med(rs, "gbs")
            say(f"| {name} | {g:.3f} | {med(rs, 'iops'):.0f} | {med(rs, 'cpu_per_gb'):.3f} | {g / kg:.2f} |")
        for name, rs in (("naive loop (1 thread)", nl), ("naive pread pool (8 threads)", npool)):
            if not rs:
                continue
            g = med(rs, "gbs")
            say(f"| {name} | {g:.3f} | {med(rs, 'sps'):.0f} | {med(rs, 'cpu_per_gb'):.3f} | {g / kg:.2f} |")
        say("")
        kc = med(ks, "cpu_per_gb")
        for name, rs in (("bs-aligned", fs), ("4k-aligned", fa), ("replay", fr)):
            say(f"- kspeed / fio {name}: {kg / med(rs, 'gbs'):.2f}x bandwidth, {med(ks, 'sps') / med(rs, 'iops'):.2f}x "
                f"samples per IOPS, CPU per GB {kc / max(med(rs, 'cpu_per_gb'), 1e-9):.2f}x")
        say(f"- kspeed read latency p50 {med(ks, 'p50'):.0f} us, p99 {med(ks, 'p99'):.0f} us")
        r4k = [k["sps"] / f["iops"] for k, f in zip(ks, fa)]
        rrep = [k["sps"] / f["iops"] for k, f in zip(ks, fr)]
        say(f"- per round, kspeed samples/s / fio 4 KiB-aligned IOPS: {', '.join(f'{x:.2f}' for x in r4k)} "
            f"(median {statistics.median(r4k):.2f}x); / fio replay IOPS: {', '.join(f'{x:.2f}' for x in rrep)} "
            f"(median {statistics.median(rrep):.2f}x)")
        say(f"- CPU per sample: kspeed {statistics.median(k['cpu_s'] / k['n'] for k in ks) * 1e6:.2f} us, "
            f"fio 4 KiB-aligned {statistics.median(f['cpu_s'] / f['ios'] for f in fa) * 1e6:.2f} us per I/O")
        if kv:
            rv = [v["sps"] / k["sps"] for v, k in zip(kv, ks)]
            say(f"- variant `{a.variant}` / default, per round: {', '.join(f'{x:.2f}' for x in rv)} "
                f"(median {statistics.median(rv):.2f}x); variant / fio 4 KiB-aligned IOPS median "
                f"{statistics.median(v['sps'] / f['iops'] for v, f in zip(kv, fa)):.2f}x")
        say(f"- load average while it ran: {open('/proc/loadavg').read().split()[0:3]}")
        say("")

    if "imagenet" in spaces and not a.quick:
        src, space = spaces["imagenet"]
        catalog = os.path.join(space, "catalog.ksc")
        say("### imagenet: scaling, memory tier, idle cost, memory")
        say("")
        one = [kspeed_read(space, "--pollers", "1")["gbs"] for _ in range(a.runs)]
        two = [kspeed_read(space, "--pollers", "2")["gbs"] for _ in range(a.runs)]
        say(f"- pollers: 1 -> {statistics.median(one):.3f} GB/s, 2 -> {statistics.median(two):.3f} GB/s (cold)")
        # Ring size: on this VM, reads into a large, cycling DMA target were
        # slower than into a small, reused one (fio reuses queue-depth buffers).
        iolog = os.path.join(a.work, "imagenet.iolog")
        small, big, rep = [], [], []
        for _ in range(a.runs):
            small.append(kspeed_read(space, "--ring-bytes", "48MiB")["gbs"])
            big.append(kspeed_read(space, "--ring-bytes", "256MiB")["gbs"])
            rep.append(fio_replay(iolog, a.qd)["gbs"])
        say(f"- ring size: 48 MiB (the smallest that holds a batch of the 64 largest samples) -> {statistics.median(small):.3f} GB/s, 256 MiB -> {statistics.median(big):.3f} GB/s; "
            f"fio replaying the same reads {statistics.median(rep):.3f} GB/s "
            f"(ratios {statistics.median(small) / statistics.median(rep):.2f}x, {statistics.median(big) / statistics.median(rep):.2f}x)")
        total = int(re.search(r"imagenet:(\d+)", a.profiles).group(1))
        full = [kspeed_read(space, "--epochs", "3", "--tier-bytes", "8GiB") for _ in range(a.runs)]
        half = [kspeed_read(space, "--epochs", "3", "--tier-bytes", "1300MB") for _ in range(a.runs)]
        warm = []
        for _ in range(a.runs):
            naive(catalog, "pool")
            warm.append(naive(catalog, "pool", cold=False))
        e2 = lambda rs: statistics.median(statistics.mean(r["epoch_sps"][1:]) for r in rs)
        hit = lambda rs: statistics.median(r["hits"] / max(r["hits"] + r["disk"] - total, 1) for r in rs)
        say(f"- tier holding the whole set: epochs 2-3 at {e2(full):.0f} samples/s (epoch 1, cold: {statistics.median(r['epoch_sps'][0] for r in full):.0f})")
        say(f"- tier holding half (1.3 GB): epochs 2-3 at {e2(half):.0f} samples/s, tier hit rate {hit(half):.2f}")
        say(f"- warm page cache, pread pool of 8 threads over the source files: {med(warm, 'sps'):.0f} samples/s "
            f"-> tier (whole) is {e2(full) / med(warm, 'sps'):.2f}x")
        idle = re.search(r"idle: ([\d.]+)%", kspeed_read(space, "--idle-ms", "3000")["out"]).group(1)
        say(f"- idle cost: {idle}% of one core with the ring full and nobody consuming (3 s)")
        small_src, small_space = prepare(a.work, "imagenet", 5000)
        r1 = peak_rss_mib(small_space, "--ring-bytes", "256MiB")
        r2 = peak_rss_mib(space, "--ring-bytes", "256MiB")
        say(f"- peak RSS, 256 MiB ring, no tier: {r1:.0f} MiB reading 5,000 samples (0.6 GB), {r2:.0f} MiB reading 20,000 (2.5 GB)")
        say("")

    out = os.path.join(a.work, "bench_read.md")
    with open(out, "w") as f:
        f.write("\n".join(report) + "\n")
    print(f"\nwritten to {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
