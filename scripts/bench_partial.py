#!/usr/bin/env python3
"""A dataset twice the space, its source a bucket (issue 31's first
benchmark row): kspeed's partial space (`kspeed preload --max-bytes` from
the bucket, the rest read from the bucket ahead of need every epoch)
against Mosaic StreamingDataset with `cache_limit` set to the same bytes
(its shards downloaded into a local cache, the least recently used evicted),
against kspeed reading the bucket with no space at all, and against
kspeed's NVMe cache area written during training (no preload), by next
use and by LRU (`--cache-dir`, a fresh one per run, of the same bytes; `kspeed-cache-mem`
and `kspeed-cache-mem-lru`: the same area in memory, `--cache-dir :memory:`;
`kspeed-cache-2level`: the area on disk with a memory level of a quarter
of its bytes above it, `--cache-memory-bytes`). Epochs 1-3 in
one process per run, samples/s per epoch, and the bytes each read from the
server per epoch (s3s-fs's /proc/PID/io rchar at the epoch boundaries).

Setup (once, kept under --work): `kspeed gen --profile imagenet --count N`
(ImageFolder of .jpg files, seed 1), an s3s-fs server on 127.0.0.1 over
WORK/s3root, the tree uploaded under s3://bench/train/ (boto3, 16
threads), an MDS dataset (streaming.MDSWriter, columns data:bytes
label:int, default 64 MiB shards, no compression) under s3://bench/mosaic/,
a kspeed catalog of the bucket, and the partial space: `kspeed preload
--source s3://bench/train/ --max-bytes HALF` (HALF: --fraction of the
dataset's bytes; its time is printed, not a contender).

Timed contenders, each a fresh process per run, the page cache dropped
before every run (root needed), the order rotated run by run:

  kspeed-partial : kspeed read --space SPACE --epochs 3 --pollers 2
                   --queue-depth 32 --touch --json (the held samples from
                   the NVMe with O_DIRECT, the others by ranged GETs,
                   64 in flight); per-epoch times from its per_epoch report
  kspeed-bucket  : kspeed read --source s3://bench/train/ --catalog
                   s3.ksc --epochs 3 (the same GETs for every sample: no
                   space, the reference for "no cache")
  mosaic-cache   : StreamingDataset(remote=s3://bench/mosaic, local=<fresh
                   dir>, cache_limit=HALF, shuffle=True, batch_size=64) in a
                   DataLoader(batch_size=64, num_workers=2); epochs timed
                   from the dataset's construction (epoch 1) and from the
                   previous epoch's end
  mosaic-cache-w0: the same in the main process (num_workers=0)
  mosaic-py1s    : mosaic-cache with shuffle_algo="py1s" and
                   num_canonical_nodes=1 (the shards in a shuffled order,
                   one at a time, the samples shuffled within each; by
                   default 64 canonical nodes interleave spans of every
                   shard): what a user tunes to make a cache smaller than
                   the dataset work, at the cost of a weaker shuffle
  mosaic-py1s-w0 : the same in the main process

A Mosaic run that takes over --deadline seconds (default 300) is cut there
and its rate reported over what it read, with the bytes it had fetched.

Mosaic's default shuffle (py1e) spreads each shard's samples over a block
of shuffle_block_size samples (262,144 by default: the whole of a small
dataset), so with a cache smaller than the dataset a sample's shard is
often gone and is downloaded again (64 MiB for a 131 KB sample); kspeed
shuffles the whole dataset every epoch and reads samples, not shards. Run with the project's venv plus mosaicml-streaming (the same
venv as scripts/bench_s3_read.py):
  python -m venv ~/.cache/kspeed/s3bench-venv  (+ a .pth to the project's
  site-packages), pip install mosaicml-streaming==0.13.0 boto3
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_s3_read as b3  # noqa: E402  (helpers: server, caches, uploads)

K = b3.K
BUCKET = b3.BUCKET
EPOCHS = 3


def child_mosaic(a):
    from streaming import StreamingDataset
    from streaming.base.util import clean_stale_shared_memory
    from torch.utils.data import DataLoader

    clean_stale_shared_memory()
    t0 = time.perf_counter()
    # Tuned: the shards in a shuffled order, one canonical node (so one
    # shard at a time, not 64 interleaved spans across every shard).
    kw = {"shuffle_algo": a.shuffle_algo, "num_canonical_nodes": 1} if a.shuffle_algo else {}
    ds = StreamingDataset(remote=f"s3://{BUCKET}/mosaic", local=a.cache, shuffle=True, shuffle_seed=1,
                          batch_size=b3.BATCH, cache_limit=a.cache_limit, **kw)
    dl = DataLoader(ds, batch_size=b3.BATCH, num_workers=a.workers, collate_fn=b3.as_list)
    epochs = []
    r0 = b3.rchar(a.server_pid)
    start = t0
    for e in range(EPOCHS):
        n = nb = 0
        cut = False
        for b in dl:
            n += len(b)
            nb += sum(len(s["data"]) for s in b)
            if time.perf_counter() - start > a.deadline:
                cut = True
                break
        t1, r1 = time.perf_counter(), b3.rchar(a.server_pid)
        epochs.append({"samples": n, "bytes": nb, "seconds": t1 - t0, "served_bytes": r1 - r0, "cut": cut})
        t0, r0 = t1, r1
        if cut:
            break
    return epochs


def prepare(a, src):
    stamp = os.path.join(a.work, "prepared")
    if os.path.exists(stamp):
        return
    items = b3.image_folder(src)
    n = b3.upload_tree(src, "train/")
    print(f"uploaded {n} objects under train/", file=sys.stderr)
    from streaming import MDSWriter

    mds = os.path.join(a.work, "mds")
    shutil.rmtree(mds, ignore_errors=True)
    with MDSWriter(out=mds, columns={"data": "bytes", "label": "int"}) as w:
        for path, label in items:
            with open(path, "rb") as f:
                w.write({"data": f.read(), "label": label})
    b3.upload_tree(mds, "mosaic/")
    print(f"MDS: {len(os.listdir(mds)) - 1} shards", file=sys.stderr)
    with open(stamp, "w") as f:
        f.write("ok\n")


def run_kspeed(env, args, server_pid):
    r0 = b3.rchar(server_pid)
    p = subprocess.run([K, "--progress", "none", "read"] + args + ["--epochs", str(EPOCHS), "--touch", "--json"],
                       check=True, capture_output=True, text=True, env=env)
    j = json.loads(p.stdout.strip().splitlines()[-1])
    epochs = [{"samples": e["samples"], "bytes": e["bytes"], "seconds": e["seconds"],
               "source_bytes": e.get("source_bytes", 0), "cache_hits": e.get("cache_hits", 0),
               "cache_planned_hits": e.get("cache_planned_hits", 0),
               "cache_writes": e.get("cache_writes", 0),
               "cache_memory_hits": e.get("cache_memory_hits", 0)} for e in j["per_epoch"]]
    if "cache" in j:
        epochs[-1]["cache"] = j["cache"]
    # The server's bytes for the whole run (kspeed reads the same samples
    # from the bucket every epoch: source_bytes per epoch says which).
    epochs[-1]["run_served_bytes"] = b3.rchar(server_pid) - r0
    return epochs


def run_mosaic(a, env, workers, cache, server_pid, shuffle_algo=None):
    cmd = [sys.executable, os.path.abspath(__file__), "--work", a.work, "--child", "--workers", str(workers),
           "--cache", cache, "--cache-limit", str(a.half_bytes), "--server-pid", str(server_pid),
           "--deadline", str(a.deadline)]
    if shuffle_algo:
        cmd += ["--shuffle-algo", shuffle_algo]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        err = [line for line in p.stderr.strip().splitlines() if line and not line.startswith(" ")]
        raise b3.ChildFailed(f"exit {p.returncode}: {err[-1] if err else ''}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--count", type=int, default=5000)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--fraction", type=float, default=0.5, help="the space (and Mosaic's cache_limit) as a fraction "
                    "of the dataset's bytes")
    ap.add_argument("--work", default="/var/tmp/kspeed-partial")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--only", default=None)
    ap.add_argument("--no-build", action="store_true")
    ap.add_argument("--throttle-mbit", type=int, default=0,
                    help="hold loopback (the S3 server's replies) to this rate with a tbf qdisc on lo, as a remote "
                    "bucket would be (root; removed at the end)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--cache", help=argparse.SUPPRESS)
    ap.add_argument("--cache-limit", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--server-pid", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--shuffle-algo", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, default=300, help="seconds a Mosaic run may take for its 3 epochs; "
                    "one that takes longer is cut there and its rate reported over what it read")
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child_mosaic(a)), flush=True)
        return

    if not a.no_build:
        b3.sh(["cargo", "build", "--release", "--quiet", "--bin", "kspeed"], cwd=b3.ROOT)
    os.makedirs(a.work, exist_ok=True)
    src = os.path.join(a.work, "src")
    s3root = os.path.join(a.work, "s3root")
    if not os.path.isdir(src):
        b3.sh([K, "--progress", "none", "gen", "--profile", "imagenet", "--count", str(a.count), "--out", src,
               "--seed", "1"], stdout=subprocess.DEVNULL)
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(src) for f in fs)
    a.half_bytes = int(size * a.fraction)
    port = b3.free_port()
    ep = f"http://127.0.0.1:{port}"
    env = dict(os.environ, AWS_ACCESS_KEY_ID=b3.AK, AWS_SECRET_ACCESS_KEY=b3.SK, AWS_REGION="us-east-1",
               AWS_DEFAULT_REGION="us-east-1", AWS_ENDPOINT_URL=ep, S3_ENDPOINT_URL=ep)
    os.environ.update(env)
    os.makedirs(os.path.join(s3root, BUCKET), exist_ok=True)
    log = open(os.path.join(a.work, "s3s-fs.log"), "w")
    server = subprocess.Popen([b3.S3S, "--host", "127.0.0.1", "--port", str(port), "--access-key", b3.AK,
                               "--secret-key", b3.SK, s3root], stdout=log, stderr=log,
                              env=dict(env, RUST_LOG="warn"))
    try:
        import socket

        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
                break
            except OSError:
                time.sleep(0.05)
        prepare(a, src)
        if a.throttle_mbit:
            b3.sh(["tc", "qdisc", "replace", "dev", "lo", "root", "tbf", "rate", f"{a.throttle_mbit}mbit",
                   "burst", "256kb", "latency", "200ms"])
            print(f"loopback held to {a.throttle_mbit} Mbit/s (tbf)", file=sys.stderr)
        bench(a, env, size, server.pid)
    finally:
        if a.throttle_mbit:
            subprocess.run(["tc", "qdisc", "del", "dev", "lo", "root"], check=False)
        server.terminate()
        server.wait()


def bench(a, env, size, server_pid):
    s3cat = os.path.join(a.work, "s3.ksc")
    if not os.path.exists(s3cat):
        b3.sh([K, "--progress", "none", "catalog", "--source", f"s3://{BUCKET}/train/", "--out", s3cat], env=env,
              stdout=subprocess.DEVNULL)
    space = os.path.join(a.work, f"space-{a.fraction}")
    b3.drop_caches()
    t = time.monotonic()
    b3.sh([K, "--progress", "none", "preload", "--source", f"s3://{BUCKET}/train/", "--catalog", s3cat,
           "--space", space, "--max-bytes", str(a.half_bytes)], env=env, stdout=subprocess.DEVNULL)
    print(f"preload of the partial space ({a.half_bytes / 1e6:.0f} MB of {size / 1e6:.0f} MB): "
          f"{time.monotonic() - t:.1f} s (0 if it was there)", file=sys.stderr)
    kq = ["--pollers", "2", "--queue-depth", "32"]
    cache = [None]
    contenders = {
        "kspeed-partial": lambda: run_kspeed(env, ["--space", space] + kq, server_pid),
        "kspeed-bucket": lambda: run_kspeed(env, ["--source", f"s3://{BUCKET}/train/", "--catalog", s3cat] + kq,
                                            server_pid),
        # The NVMe cache area written during training (no preload): a fresh
        # one per run, of the same bytes, by next use or by LRU.
        "kspeed-cache-next": lambda: run_kspeed(
            env, ["--source", f"s3://{BUCKET}/train/", "--catalog", s3cat, "--cache-dir", cache[0],
                  "--cache-bytes", str(a.half_bytes), "--cache-policy", "next-use"] + kq, server_pid),
        "kspeed-cache-min": lambda: run_kspeed(
            env, ["--source", f"s3://{BUCKET}/train/", "--catalog", s3cat, "--cache-dir", cache[0],
                  "--cache-bytes", str(a.half_bytes), "--cache-policy", "min"] + kq, server_pid),
        "kspeed-cache-lru": lambda: run_kspeed(
            env, ["--source", f"s3://{BUCKET}/train/", "--catalog", s3cat, "--cache-dir", cache[0],
                  "--cache-bytes", str(a.half_bytes), "--cache-policy", "lru"] + kq, server_pid),
        # The same area in the process's memory (`--cache-dir :memory:`).
        "kspeed-cache-mem": lambda: run_kspeed(
            env, ["--source", f"s3://{BUCKET}/train/", "--catalog", s3cat, "--cache-dir", ":memory:",
                  "--cache-bytes", str(a.half_bytes), "--cache-policy", "next-use"] + kq, server_pid),
        "kspeed-cache-mem-lru": lambda: run_kspeed(
            env, ["--source", f"s3://{BUCKET}/train/", "--catalog", s3cat, "--cache-dir", ":memory:",
                  "--cache-bytes", str(a.half_bytes), "--cache-policy", "lru"] + kq, server_pid),
        # Two levels: the area on disk as kspeed-cache-next, and above it
        # an area in memory of a quarter of its bytes, by the same policy.
        "kspeed-cache-2level": lambda: run_kspeed(
            env, ["--source", f"s3://{BUCKET}/train/", "--catalog", s3cat, "--cache-dir", cache[0],
                  "--cache-bytes", str(a.half_bytes), "--cache-memory-bytes", str(a.half_bytes // 4),
                  "--cache-policy", "next-use"] + kq, server_pid),
        "mosaic-cache": lambda: run_mosaic(a, env, a.workers, cache[0], server_pid),
        "mosaic-cache-w0": lambda: run_mosaic(a, env, 0, cache[0], server_pid),
        "mosaic-py1s": lambda: run_mosaic(a, env, a.workers, cache[0], server_pid, "py1s"),
        "mosaic-py1s-w0": lambda: run_mosaic(a, env, 0, cache[0], server_pid, "py1s"),
    }
    if a.only:
        keep = a.only.split(",")
        contenders = {n: f for n, f in contenders.items() if n in keep}
    names = list(contenders)
    res = {n: [] for n in names}
    for run in range(a.runs):
        order = names[run % len(names):] + names[:run % len(names)]
        for name in order:
            cache[0] = os.path.join(a.work, f"cache-{run}-{name}")
            shutil.rmtree(cache[0], ignore_errors=True)
            b3.drop_caches()
            load = os.getloadavg()[0]
            try:
                epochs = contenders[name]()
            except b3.ChildFailed as e:
                res[name].append(None)
                print(f"run {run + 1}: {name:16s} FAILED {e}", file=sys.stderr)
                continue
            finally:
                shutil.rmtree(cache[0], ignore_errors=True)
            res[name].append(epochs)
            line = "  ".join(f"e{i + 1} {e['samples'] / e['seconds']:6.0f}/s"
                             + (f" ({e['cache_hits']} hits)" if name.startswith("kspeed-cache") else "")
                             + (f" (cut after {e['samples']} samples, {e['served_bytes'] / 1e9:.1f} GB served)"
                                if e.get("cut") else "") for i, e in enumerate(epochs))
            print(f"run {run + 1}: {name:16s} {line}  load {load:.1f}", file=sys.stderr)

    def sps(name, e):
        # A run cut by the deadline counts over what it read; the epochs it
        # never reached are missing (None).
        return [r[e]["samples"] / r[e]["seconds"] if r and e < len(r) else None for r in res[name]]

    def med(xs):
        xs = [x for x in xs if x is not None]
        return statistics.median(xs) if xs else float("nan")

    def fmt(xs, f="{:.0f}"):
        return " ".join("FAIL" if x is None else f.format(x) for x in xs)

    print(f"\nimagenet, {a.count} samples, {size / 1e6:.0f} MB; space / cache_limit {a.half_bytes / 1e6:.0f} MB "
          f"({a.fraction:.0%}); s3s-fs on 127.0.0.1; cold page cache at each run's start; median of {a.runs} runs")
    print(f"{'contender':16s} " + " ".join(f"{'epoch ' + str(e + 1):>10s}" for e in range(EPOCHS))
          + "   from the server per epoch (MB)")
    for name in names:
        served = []
        for e in range(EPOCHS):
            if name.startswith("mosaic"):
                served.append(med([r[e]["served_bytes"] if r and e < len(r) else None for r in res[name]]) / 1e6)
            elif name == "kspeed-partial":
                served.append(med([r[e]["source_bytes"] if r else None for r in res[name]]) / 1e6)
            elif name.startswith("kspeed-cache"):
                # A cache area's GETs per epoch are not counted apart: the
                # server's bytes over the run, spread evenly.
                served.append(med([r[-1]["run_served_bytes"] if r else None for r in res[name]]) / EPOCHS / 1e6)
            else:
                served.append(size / 1e6)
        print(f"{name:16s} " + " ".join(f"{med(sps(name, e)):10.0f}" for e in range(EPOCHS))
              + "   " + " ".join(f"{x:.0f}" for x in served))
    for name in [n for n in names if n.startswith("kspeed-cache")]:
        hits = [med([r[e]["cache_hits"] if r else None for r in res[name]]) for e in range(EPOCHS)]
        planned = [med([r[e]["cache_planned_hits"] if r else None for r in res[name]]) for e in range(EPOCHS)]
        tot = [sum(e["cache_hits"] for e in r) / max(1, sum(e["cache_planned_hits"] for e in r))
               for r in res[name] if r]
        writes = [med([r[e]["cache_writes"] if r else None for r in res[name]]) for e in range(EPOCHS)]
        mem = [med([r[e]["cache_memory_hits"] if r else None for r in res[name]]) for e in range(EPOCHS)]
        print(f"{name}: cache hits per epoch (median) " + " ".join(f"{h:.0f}" for h in hits)
              + ("; the memory level's hits above it " + " ".join(f"{h:.0f}" for h in mem) if any(mem) else "")
              + "; planned (the policy's own) " + " ".join(f"{h:.0f}" for h in planned)
              + f"; hits / planned over the run, per run: {fmt(tot, '{:.3f}')}"
              + "; writes per epoch (median) " + " ".join(f"{w:.0f}" for w in writes))
    if "kspeed-cache-next" in res and "kspeed-cache-min" in res:
        # The planned hits are a pure function of the order: MIN's are
        # Belady's optimum for this rank's order and slots.
        tot = lambda name: [sum(e["cache_planned_hits"] for e in r) if r else None for r in res[name]]
        rr = [x / y if x and y else None for x, y in zip(tot("kspeed-cache-next"), tot("kspeed-cache-min"))]
        print(f"kspeed-cache-next planned hits / MIN's over the run, per run: {fmt(rr, '{:.3f}')}")
    for mine, other in [("kspeed-cache-next", "kspeed-cache-lru"), ("kspeed-cache-min", "kspeed-cache-lru"),
                        ("kspeed-cache-next", "kspeed-cache-min"), ("kspeed-cache-mem", "kspeed-cache-mem-lru"),
                        ("kspeed-cache-mem", "kspeed-cache-next"), ("kspeed-cache-2level", "kspeed-cache-next")]:
        if mine not in res or other not in res:
            continue
        for e in range(EPOCHS):
            rr = [x / y if x and y else None for x, y in zip(sps(mine, e), sps(other, e))]
            print(f"{mine} / {other}, epoch {e + 1}, per run: {fmt(rr, '{:.2f}')}"
                  f"  (median {med(rr):.2f}x)")
    if "kspeed-cache-next" in res:
        for other in [n for n in names if n.startswith("mosaic")]:
            for e in range(EPOCHS):
                rr = [x / y if x and y else None for x, y in zip(sps("kspeed-cache-next", e), sps(other, e))]
                print(f"kspeed-cache-next / {other}, epoch {e + 1}, per run: {fmt(rr, '{:.2f}')}"
                      f"  (median {med(rr):.2f}x)")
    mine = "kspeed-partial"
    if mine in res:
        for other in [n for n in names if n != mine]:
            for e in range(EPOCHS):
                rr = [x / y if x and y else None for x, y in zip(sps(mine, e), sps(other, e))]
                print(f"{mine} / {other}, epoch {e + 1}, per run: {fmt(rr, '{:.2f}')}  (median {med(rr):.2f}x)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
