#!/usr/bin/env python3
"""Reading one epoch straight from an S3-compatible bucket, cold: kspeed
(`kspeed read --source s3://...`) against Mosaic StreamingDataset and LitData
streaming, each from the same s3s-fs server, each in its own format written
from the same files; then kspeed's failover to the bucket against the same
failover to a mounted (local) copy of the tree.

Setup (once, kept under --work): `kspeed gen --profile imagenet --count N`
(ImageFolder of .jpg files), an s3s-fs server on 127.0.0.1 over
WORK/s3root, the tree uploaded under s3://bench/train/ (boto3, 16 threads),
an MDS dataset (streaming.MDSWriter, columns data:bytes label:int, default
64 MiB shards, no compression) uploaded under s3://bench/mosaic/, a LitData
dataset (litdata.optimize, {"data": bytes, "label": int}, chunk_bytes 64MB,
no compression) uploaded under s3://bench/litdata/, WebDataset tar shards
(Python's tarfile, `<key>.jpg` + `<key>.cls` per sample, shards of 512
samples, about LitData's 64 MB chunks) uploaded under s3://bench/wds/, and
kspeed catalogs (of the bucket's objects, of its shards, of the local tree).

Timed contenders, each a fresh process, the page cache dropped before every
run (root needed; the server then reads its files from disk), the order
rotated run by run:

  kspeed        : kspeed read --source s3://bench/train/ --catalog s3.ksc
                  --epochs 1 --pollers 2 --queue-depth 32 --touch
                  (64 ranged GETs in flight; --touch reads every byte);
                  timed from process start to exit
  kspeed-tar    : kspeed read --source 's3://bench/wds/*.tar' --catalog
                  wds.ksc --shuffle-block 512 --pollers 1 --queue-depth 1024
                  (the shards' samples in blocks of 512 shuffled, then
                  shuffled within: LitData's shuffle of 64 MB chunks;
                  neighbouring members share one ranged GET)
  mosaic        : streaming.StreamingDataset(remote=s3://bench/mosaic,
                  local=<fresh dir>, shuffle=True, batch_size=64) in a torch
                  DataLoader(batch_size=64, num_workers=2); endpoint from
                  S3_ENDPOINT_URL; timed from the dataset's construction to
                  the epoch's last batch (imports not counted)
  mosaic-w0     : the same in the main process (num_workers=0)
  litdata       : litdata.StreamingDataset(s3://bench/litdata,
                  cache_dir=<fresh dir>, shuffle=True,
                  storage_options={"endpoint_url": ...}) in a
                  litdata.StreamingDataLoader(batch_size=64, num_workers=2);
                  timed likewise (the collate copies LitData's memoryviews
                  into bytes: memoryviews cannot cross the worker queue).
                  LitData fetches chunks with obstore, whose client options
                  it fixes without allow_http: the child adds it for the
                  plain-http endpoint. Cache dirs are deleted after every run.
  litdata-w0    : the same in the main process (num_workers=0)
  obstore-64    : the server's ceiling for these objects: a GET of every
                  object under train/ with 64 in flight (obstore, the Rust
                  object_store crate kspeed also builds on, from asyncio)
  boto3-64      : the same with boto3, 64 threads
  obstore-shards: a GET of every MDS shard, 8 in flight (the ceiling for
                  the sharded formats: few, large objects)

A contender's failed run (Mosaic with DataLoader workers fails now and then
here) is printed and left out of the medians; the ratios pair runs by index.

Every row also reports what the server read from its files during the run
(s3s-fs's /proc/PID/io rchar), which shows each loader really went to the
server, and the server's CPU seconds (it shares the machine's cores with the
client).

Failover (--failover, on by default): `kspeed read --source X --catalog C
--cluster DEAD --token-file T --node-timeout-ms 300 --epochs 1 --touch`
where DEAD lists one node at 127.0.0.1:9 (nobody listens), so every sample
is read from the source after the node is found unreachable; X =
s3://bench/train/ (catalog of the bucket) vs the same tree on local disk
(catalog of the local tree).

Requirements (a venv with torch and boto3; tested with):
  pip install mosaicml-streaming==0.13.0 litdata==0.2.76
  # torch 2.15.0, boto3 1.43.11, obstore 0.12.1 (a litdata dependency),
  # numpy 2.1.3; s3s-fs 0.14.1 (scripts/setup.sh installs it)

  python scripts/bench_s3_read.py [--count 5000] [--runs 3] [--work /var/tmp/kspeed-s3read]
"""

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
K = os.path.join(ROOT, "target", "release", "kspeed")
S3S = os.environ.get("S3S_FS", "/root/.cache/kspeed/s3s/bin/s3s-fs")
BUCKET = "bench"
AK, SK = "benchkey", "benchsecret0123"
BATCH = 64


def sh(cmd, **kw):
    return subprocess.run(cmd, check=True, **kw)


def drop_caches():
    sh(["sync"])
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except PermissionError:
        sys.exit("bench_s3_read: dropping the page cache needs root")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_secs(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rchar(pid):
    with open(f"/proc/{pid}/io") as f:
        for line in f:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    return 0


# ---------------------------------------------------------------- children
# Each timed Python contender runs as `bench_s3_read.py --child NAME ...` in a
# fresh process and prints one JSON line: samples, bytes, seconds.


def as_list(b):
    return b


def as_bytes_list(b):
    # LitData hands out its bytes fields as memoryviews of the chunk, which
    # cannot cross the DataLoader's worker queue: copy them into bytes, as
    # the worker of a training job would (decoding them) before batching.
    return [{"data": bytes(s["data"]), "label": s["label"]} for s in b]


def child_mosaic(a):
    from streaming import StreamingDataset
    from streaming.base.util import clean_stale_shared_memory
    from torch.utils.data import DataLoader

    clean_stale_shared_memory()
    t0 = time.perf_counter()
    ds = StreamingDataset(remote=f"s3://{BUCKET}/mosaic", local=a.cache, shuffle=True, shuffle_seed=1,
                          batch_size=BATCH)
    dl = DataLoader(ds, batch_size=BATCH, num_workers=a.workers, collate_fn=as_list)
    n = nb = 0
    for b in dl:
        n += len(b)
        nb += sum(len(s["data"]) for s in b)
    return n, nb, time.perf_counter() - t0


def child_litdata(a):
    from litdata import StreamingDataLoader, StreamingDataset
    from litdata.streaming import downloader

    # LitData fetches chunks with obstore and gives it no way to allow a
    # plain-http endpoint (s3s-fs here): add allow_http to its client options
    # (an https endpoint needs nothing).
    downloader._OBSTORE_CLIENT_OPTIONS["allow_http"] = "true"
    t0 = time.perf_counter()
    ds = StreamingDataset(f"s3://{BUCKET}/litdata", cache_dir=a.cache, shuffle=True, seed=1,
                          storage_options={"endpoint_url": os.environ["AWS_ENDPOINT_URL"]})
    dl = StreamingDataLoader(ds, batch_size=BATCH, num_workers=a.workers, collate_fn=as_bytes_list)
    n = nb = 0
    for b in dl:
        n += len(b)
        nb += sum(len(s["data"]) for s in b)
        if os.environ.get("BENCH_S3_DEBUG"):
            print(n, time.perf_counter() - t0, file=sys.stderr, flush=True)
    return n, nb, time.perf_counter() - t0


def obstore_store():
    from obstore.store import S3Store

    return S3Store(BUCKET, endpoint=os.environ["AWS_ENDPOINT_URL"], region="us-east-1",
                   virtual_hosted_style_request=False, access_key_id=AK, secret_access_key=SK,
                   client_options={"allow_http": True})


def child_obstore(a):
    import asyncio

    import obstore as obs

    store = obstore_store()
    keys = [m["path"] for page in obs.list(store, prefix=a.prefix) for m in page]

    async def run():
        sem = asyncio.Semaphore(a.workers)

        async def one(k):
            async with sem:
                r = await obs.get_async(store, k)
                return len(await r.bytes_async())

        return sum(await asyncio.gather(*(one(k) for k in keys)))

    t0 = time.perf_counter()
    nb = asyncio.run(run())
    return len(keys), nb, time.perf_counter() - t0


def child_boto3(a):
    from concurrent.futures import ThreadPoolExecutor

    import boto3
    import botocore

    s3 = boto3.client("s3", config=botocore.config.Config(max_pool_connections=a.workers))
    keys = [o["Key"] for p in s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=a.prefix)
            for o in p.get("Contents", [])]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(a.workers) as ex:
        nb = sum(ex.map(lambda k: len(s3.get_object(Bucket=BUCKET, Key=k)["Body"].read()), keys))
    return len(keys), nb, time.perf_counter() - t0


CHILDREN = {"mosaic": child_mosaic, "litdata": child_litdata, "obstore": child_obstore, "boto3": child_boto3}


# ---------------------------------------------------------------- setup


def upload_tree(local, prefix, threads=16):
    from concurrent.futures import ThreadPoolExecutor

    import boto3
    import botocore

    s3 = boto3.client("s3", config=botocore.config.Config(max_pool_connections=threads))
    files = sorted(os.path.join(d, f) for d, _, fs in os.walk(local) for f in fs)
    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(lambda p: s3.upload_file(p, BUCKET, prefix + os.path.relpath(p, local)), files))
    return len(files)


def image_folder(src):
    items = []
    classes = sorted(d for d in os.listdir(src) if os.path.isdir(os.path.join(src, d)))
    for c, name in enumerate(classes):
        for f in sorted(os.listdir(os.path.join(src, name))):
            items.append((os.path.join(src, name, f), c))
    return items


def litdata_item(item):
    path, label = item
    with open(path, "rb") as f:
        return {"data": f.read(), "label": label}


def prepare(a, src, s3root):
    stamp = os.path.join(a.work, "prepared")
    if os.path.exists(stamp):
        return
    items = image_folder(src)
    t = time.monotonic()
    os.makedirs(os.path.join(s3root, BUCKET), exist_ok=True)
    n = upload_tree(src, "train/")
    print(f"uploaded {n} objects under train/ in {time.monotonic() - t:.1f} s", file=sys.stderr)

    from streaming import MDSWriter

    mds = os.path.join(a.work, "mds")
    shutil.rmtree(mds, ignore_errors=True)
    with MDSWriter(out=mds, columns={"data": "bytes", "label": "int"}) as w:
        for path, label in items:
            with open(path, "rb") as f:
                w.write({"data": f.read(), "label": label})
    upload_tree(mds, "mosaic/")

    import litdata

    lit = os.path.join(a.work, "litdata")
    shutil.rmtree(lit, ignore_errors=True)
    litdata.optimize(fn=litdata_item, inputs=items, output_dir=lit, chunk_bytes="64MB", num_workers=2,
                     verbose=False)
    upload_tree(lit, "litdata/")
    print(f"MDS: {len(os.listdir(mds)) - 1} shards, LitData: {len(os.listdir(lit)) - 1} chunks",
          file=sys.stderr)
    with open(stamp, "w") as f:
        f.write("ok\n")


# ---------------------------------------------------------------- main


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--count", type=int, default=5000)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--work", default="/var/tmp/kspeed-s3read")
    ap.add_argument("--pollers", type=int, default=2)
    ap.add_argument("--queue-depth", type=int, default=32)
    ap.add_argument("--workers", type=int, default=2, help="DataLoader workers for Mosaic and LitData")
    ap.add_argument("--no-failover", action="store_true")
    ap.add_argument("--shuffle-block", type=int, default=SHARD_SAMPLES, help="kspeed-tar's --shuffle-block")
    ap.add_argument("--tar-queue-depth", type=int, default=1024, help="kspeed-tar's --queue-depth")
    ap.add_argument("--only", default=None, help="comma-separated contenders to run (default: all)")
    ap.add_argument("--no-build", action="store_true")
    ap.add_argument("--json", default=None, help="write every run's numbers here")
    ap.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    ap.add_argument("--cache", help=argparse.SUPPRESS)
    ap.add_argument("--prefix", help=argparse.SUPPRESS)
    a = ap.parse_args()

    if a.child:
        n, nb, secs = CHILDREN[a.child](a)
        print(json.dumps({"samples": n, "bytes": nb, "seconds": secs}), flush=True)
        if a.child == "obstore":
            # obstore's tokio runtime has been seen to abort at interpreter exit.
            os._exit(0)
        return

    if not a.no_build:
        sh(["cargo", "build", "--release", "--quiet", "--bin", "kspeed"], cwd=ROOT)
    os.makedirs(a.work, exist_ok=True)
    src = os.path.join(a.work, "src")
    s3root = os.path.join(a.work, "s3root")
    if not os.path.isdir(src):
        sh([K, "--progress", "none", "gen", "--profile", "imagenet", "--count", str(a.count), "--out", src,
            "--seed", "1"], stdout=subprocess.DEVNULL)

    port = free_port()
    ep = f"http://127.0.0.1:{port}"
    env = dict(os.environ, AWS_ACCESS_KEY_ID=AK, AWS_SECRET_ACCESS_KEY=SK, AWS_REGION="us-east-1",
               AWS_DEFAULT_REGION="us-east-1", AWS_ENDPOINT_URL=ep, S3_ENDPOINT_URL=ep)
    os.environ.update(env)
    os.makedirs(s3root, exist_ok=True)
    log = open(os.path.join(a.work, "s3s-fs.log"), "w")
    server = subprocess.Popen([S3S, "--host", "127.0.0.1", "--port", str(port), "--access-key", AK,
                               "--secret-key", SK, s3root], stdout=log, stderr=log,
                              env=dict(env, RUST_LOG="warn"))
    try:
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
                break
            except OSError:
                time.sleep(0.05)
        prepare(a, src, s3root)
        prepare_tar(a, src)
        run_bench(a, env, src, server.pid)
    finally:
        server.terminate()
        server.wait()


class ChildFailed(Exception):
    pass


def run_child(a, env, name, workers, cache=None, prefix=None):
    cmd = [sys.executable, os.path.abspath(__file__), "--work", a.work, "--child", name, "--workers", str(workers)]
    if cache:
        cmd += ["--cache", cache]
    if prefix:
        cmd += ["--prefix", prefix]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        # Recorded as a failed run (left out of the medians), not fatal:
        # Mosaic with DataLoader workers fails now and then here (an
        # IndexError decoding an empty field of an MDS sample).
        err = [line for line in p.stderr.strip().splitlines() if line and not line.startswith(" ")]
        raise ChildFailed(f"exit {p.returncode}: {err[-1] if err else ''}")
    r = json.loads(p.stdout.strip().splitlines()[-1])
    return r["samples"], r["bytes"], r["seconds"], None


def run_kspeed(env, args):
    t0 = time.monotonic()
    p = subprocess.run([K, "--progress", "none", "read"] + args + ["--epochs", "1", "--touch", "--json"],
                       check=True, capture_output=True, text=True, env=env)
    wall = time.monotonic() - t0
    j = json.loads(p.stdout.strip().splitlines()[-1])
    return j["samples"], j["bytes"], wall, j


SHARD_SAMPLES = 512


def prepare_tar(a, src):
    """WebDataset shards of the same files under s3://bench/wds/."""
    stamp = os.path.join(a.work, "prepared-tar")
    if os.path.exists(stamp):
        return
    import io
    import tarfile

    out = os.path.join(a.work, "wds")
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    items = image_folder(src)
    for s in range(0, len(items), SHARD_SAMPLES):
        with tarfile.open(os.path.join(out, f"{s // SHARD_SAMPLES:05d}.tar"), "w") as t:
            for i, (path, label) in enumerate(items[s:s + SHARD_SAMPLES]):
                key = f"{s + i:07d}"
                t.add(path, arcname=f"{key}.jpg")
                cls = f"{label}\n".encode()
                info = tarfile.TarInfo(f"{key}.cls")
                info.size = len(cls)
                t.addfile(info, io.BytesIO(cls))
    upload_tree(out, "wds/")
    with open(stamp, "w") as f:
        f.write("ok\n")


def run_bench(a, env, src, server_pid):
    s3cat = os.path.join(a.work, "s3.ksc")
    localcat = os.path.join(a.work, "local.ksc")
    if not os.path.exists(s3cat):
        sh([K, "--progress", "none", "catalog", "--source", f"s3://{BUCKET}/train/", "--out", s3cat], env=env,
           stdout=subprocess.DEVNULL)
    wdscat = os.path.join(a.work, "wds.ksc")
    if not os.path.exists(wdscat):
        sh([K, "--progress", "none", "catalog", "--source", f"s3://{BUCKET}/wds/*.tar", "--out", wdscat],
           env=env, stdout=subprocess.DEVNULL)
    if not os.path.exists(localcat):
        sh([K, "--progress", "none", "catalog", "--source", src, "--out", localcat], stdout=subprocess.DEVNULL)
    dead = os.path.join(a.work, "dead.txt")
    with open(dead, "w") as f:
        f.write("0 127.0.0.1:9\n")
    token = os.path.join(a.work, "token")
    with open(token, "w") as f:
        f.write(os.urandom(32).hex() + "\n")
    os.chmod(token, 0o600)
    # A fresh cache directory per run and contender: Mosaic keeps a shard's
    # state in shared memory keyed by its local path, and reusing a path whose
    # files were deleted can hand out empty samples or stall.
    cache_dir = [None]
    kq = ["--pollers", str(a.pollers), "--queue-depth", str(a.queue_depth)]
    contenders = {
        "kspeed": lambda: run_kspeed(env, ["--source", f"s3://{BUCKET}/train/", "--catalog", s3cat] + kq),
        "kspeed-tar": lambda: run_kspeed(env, ["--source", f"s3://{BUCKET}/wds/*.tar", "--catalog", wdscat,
                                               "--shuffle-block", str(a.shuffle_block), "--pollers", "1",
                                               "--queue-depth", str(a.tar_queue_depth)]),
        "mosaic": lambda: run_child(a, env, "mosaic", a.workers, cache=cache_dir[0]),
        "mosaic-w0": lambda: run_child(a, env, "mosaic", 0, cache=cache_dir[0]),
        "litdata": lambda: run_child(a, env, "litdata", a.workers, cache=cache_dir[0]),
        "litdata-w0": lambda: run_child(a, env, "litdata", 0, cache=cache_dir[0]),
        "obstore-64": lambda: run_child(a, env, "obstore", 64, prefix="train/"),
        "boto3-64": lambda: run_child(a, env, "boto3", 64, prefix="train/"),
        "obstore-shards": lambda: run_child(a, env, "obstore", 8, prefix="mosaic/"),
    }
    fo = ["--cluster", dead, "--token-file", token, "--node-timeout-ms", "300"]
    if not a.no_failover:
        contenders["failover-s3"] = lambda: run_kspeed(
            env, ["--source", f"s3://{BUCKET}/train/", "--catalog", s3cat] + fo)
        contenders["failover-local"] = lambda: run_kspeed(env, ["--source", src, "--catalog", localcat] + fo)

    if a.only:
        keep = a.only.split(",")
        contenders = {n: f for n, f in contenders.items() if n in keep}
    names = list(contenders)
    res = {n: [] for n in names}
    for run in range(a.runs):
        order = names[run % len(names):] + names[:run % len(names)]
        for name in order:
            cache_dir[0] = os.path.join(a.work, f"cache-{run}-{name}")
            shutil.rmtree(cache_dir[0], ignore_errors=True)
            drop_caches()
            load = os.getloadavg()[0]
            r0, c0 = rchar(server_pid), cpu_secs(server_pid)
            try:
                n, nb, secs, j = contenders[name]()
            except ChildFailed as e:
                shutil.rmtree(cache_dir[0], ignore_errors=True)
                res[name].append({"failed": str(e), "load1": load})
                print(f"run {run + 1}: {name:15s} FAILED {e}", file=sys.stderr)
                continue
            served = rchar(server_pid) - r0
            server_cpu = cpu_secs(server_pid) - c0
            shutil.rmtree(cache_dir[0], ignore_errors=True)
            if name == "obstore-shards":
                n = a.count  # the shards hold the whole dataset: report samples' worth
            row = {"samples": n, "bytes": nb, "seconds": secs, "served_bytes": served, "server_cpu": server_cpu,
                   "load1": load}
            if j is not None:
                row["cpu_seconds"] = j["cpu_seconds"]
                row["own_samples_per_sec"] = j["samples_per_sec"]
                row["p50_us"] = j["read_latency_us"]["p50"]
                if "cluster" in j:
                    row["source_reads"] = j["cluster"]["source_reads"]
            res[name].append(row)
            extra = f"  (own {j['samples_per_sec']:.0f}/s)" if j else ""
            print(f"run {run + 1}: {name:15s} {n:6d} samples {secs:6.2f} s {n / secs:8.0f} samples/s"
                  f"  server read {served / 1e6:4.0f} MB, CPU {server_cpu:5.2f} s  load {load:.1f}{extra}", file=sys.stderr)

    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(src) for f in fs)
    print(f"\nimagenet, {a.count} samples, {size / 1e6:.0f} MB, s3s-fs on 127.0.0.1, cold page cache, "
          f"median of {a.runs} runs (alternating, order rotated)")
    print(f"{'contender':16s} {'samples/s':>10s} {'MB/s':>7s} {'server MB':>10s} {'server CPU s':>12s}"
          "   runs (samples/s)")

    def ok(name):
        return [r for r in res[name] if "failed" not in r]

    def sps(name):
        # Per run, None where the run failed (pairs stay aligned by run).
        return [r["samples"] / r["seconds"] if "failed" not in r else None for r in res[name]]

    def med(xs):
        xs = [x for x in xs if x is not None]
        return statistics.median(xs) if xs else float("nan")

    def fmt(xs, f="{:.0f}"):
        return " ".join("FAIL" if x is None else f.format(x) for x in xs)

    def ratio(xs, ys):
        return [x / y if x is not None and y is not None else None for x, y in zip(xs, ys)]

    for name in names:
        v = sps(name)
        good = ok(name)
        mb = med([r["bytes"] / r["seconds"] / 1e6 for r in good])
        srv = med([r["served_bytes"] for r in good]) / 1e6
        scpu = med([r["server_cpu"] for r in good])
        print(f"{name:16s} {med(v):10.0f} {mb:7.0f} {srv:10.0f} {scpu:12.2f}   " + fmt(v))

    def runs(name):
        return sps(name) if name in res else [None] * a.runs

    peers = [n for n in ("mosaic", "mosaic-w0", "litdata", "litdata-w0") if n in res]
    best = [max((x for x in v if x is not None), default=None) for v in zip(*[runs(n) for n in peers])]
    for mine in ("kspeed", "kspeed-tar"):
        if mine not in res or not peers:
            continue
        k = runs(mine)
        rr = ratio(k, best)
        print(f"\n{mine} / fastest of the Mosaic and LitData rows, per run: {fmt(rr, '{:.2f}')}"
              f"  (median {med(rr):.2f}x; goal >= 1.5x)")
        for other in peers + ["obstore-64"]:
            if other in res:
                rr = ratio(k, runs(other))
                print(f"{mine} / {other}, per run: {fmt(rr, '{:.2f}')}  (median {med(rr):.2f}x)")
    if not a.no_failover and "failover-s3" in res and "failover-local" in res:
        rr = ratio(sps("failover-s3"), sps("failover-local"))
        print(f"failover from the bucket / from the local tree, per run: {fmt(rr, '{:.3f}')}"
              f"  (median {med(rr):.3f}x)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
