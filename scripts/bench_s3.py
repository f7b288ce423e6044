#!/usr/bin/env python3
"""Preload from an S3-compatible store on a cold page cache, side by side
with the AWS CLI and a threaded boto3 downloader.

Starts s3s-fs (a real S3 server over a local directory; scripts/setup.sh
--test-tools installs it and boto3/awscli into ~/.cache/kspeed/py-venv, whose
Python this script wants), uploads `kspeed gen --profile imagenet` files
through the S3 API (boto3, 32 threads), then alternates, each run dropping
the page cache (root needed) before every tool, so the server reads its
objects from disk:
  kspeed-full : kspeed preload --source s3://... into a fresh space (LIST,
                catalog with every object's CRC32C, copy, fsync)
  kspeed-copy : kspeed preload with a prebuilt catalog (copy + fsync only)
  aws s3 cp   : aws s3 cp --recursive s3://... DIR && sync (the CLI's
                default 10 requests in flight)
  boto3 x64   : ListObjectsV2 pages, then GetObject into files from a
                ThreadPoolExecutor of 64 workers, then sync
and prints the median MB/s of the runs (dataset bytes / wall time), the ratio
of the medians to `aws s3 cp`, and the median of the per-run (paired) ratios
against it and against boto3. Everything runs on this machine: the server
shares the CPUs with the client (2 cores here), so this compares clients'
costs, not a network. Usage:

  sudo ~/.cache/kspeed/py-venv/bin/python scripts/bench_s3.py [--count 20000] [--runs 3] [--work /var/tmp/kspeed-s3-bench]
"""

import argparse
import concurrent.futures
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
K = os.path.join(ROOT, "target", "release", "kspeed")
CACHE = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
S3S = os.environ.get("KSPEED_S3S_FS") or os.path.join(CACHE, "kspeed", "s3s", "bin", "s3s-fs")
AWS = os.path.join(os.path.dirname(sys.executable), "aws")
BUCKET = "bench"
ACCESS, SECRET = "KSPBENCHKEY", "kspeedBenchSecretKey"


def sh(cmd, **kw):
    return subprocess.run(cmd, shell=isinstance(cmd, str), check=True, **kw)


def drop_caches():
    sh("sync")
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except PermissionError:
        sys.exit("bench_s3: dropping the page cache needs root")


def du_bytes(path):
    total = 0
    for d, _, files in os.walk(path):
        for f in files:
            total += os.path.getsize(os.path.join(d, f))
    return total


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(root):
    port = free_port()
    log = open(os.path.join(os.path.dirname(root), "s3s-fs.log"), "ab")
    proc = subprocess.Popen([S3S, "--host", "127.0.0.1", "--port", str(port), "--access-key", ACCESS,
                             "--secret-key", SECRET, root], stdout=log, stderr=log, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while True:
        if proc.poll() is not None:
            sys.exit(f"bench_s3: s3s-fs exited ({proc.returncode}); see {log.name}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc, f"http://127.0.0.1:{port}"
        except OSError:
            if time.monotonic() > deadline:
                proc.kill()
                sys.exit("bench_s3: s3s-fs not accepting after 30 s")
            time.sleep(0.05)


def client(endpoint, pool=64):
    import boto3
    from botocore.config import Config
    return boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=ACCESS, aws_secret_access_key=SECRET,
                        region_name="us-east-1",
                        config=Config(s3={"addressing_style": "path"}, max_pool_connections=pool,
                                      retries={"max_attempts": 5}))


def upload(endpoint, src, prefix):
    c = client(endpoint, 32)
    c.create_bucket(Bucket=BUCKET)
    files = []
    for d, _, names in os.walk(src):
        files += [os.path.join(d, n) for n in names]
    with concurrent.futures.ThreadPoolExecutor(32) as ex:
        list(ex.map(lambda p: c.upload_file(p, BUCKET, prefix + os.path.relpath(p, src)), files))
    return len(files)


def boto3_download(endpoint, prefix, dst):
    c = client(endpoint, 64)
    keys = []
    for page in c.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix):
        keys += [o["Key"] for o in page.get("Contents", [])]

    def get(key):
        path = os.path.join(dst, key[len(prefix):])
        os.makedirs(os.path.dirname(path), exist_ok=True)
        body = c.get_object(Bucket=BUCKET, Key=key)["Body"].read()
        with open(path, "wb") as f:
            f.write(body)

    with concurrent.futures.ThreadPoolExecutor(64) as ex:
        list(ex.map(get, keys))
    sh("sync")
    return len(keys)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--count", type=int, default=20000)
    ap.add_argument("--profile", default="imagenet")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--requests", type=int, default=0, help="kspeed --requests (0 = its default)")
    ap.add_argument("--work", default="/var/tmp/kspeed-s3-bench")
    a = ap.parse_args()
    try:
        import boto3  # noqa: F401
    except ImportError:
        sys.exit("bench_s3: run it with the venv's Python (scripts/setup.sh --test-tools): "
                 "~/.cache/kspeed/py-venv/bin/python scripts/bench_s3.py")
    if not os.path.exists(S3S) or not os.path.exists(AWS):
        sys.exit(f"bench_s3: needs {S3S} and {AWS} (scripts/setup.sh --test-tools)")

    sh(["cargo", "build", "--release", "--quiet", "--bin", "kspeed"], cwd=ROOT)
    shutil.rmtree(a.work, ignore_errors=True)
    os.makedirs(a.work)
    src = os.path.join(a.work, "src")
    sh([K, "gen", "--profile", a.profile, "--count", str(a.count), "--out", src, "--seed", "1", "--progress=none"],
       stdout=subprocess.DEVNULL)
    size = du_bytes(src)
    root = os.path.join(a.work, "s3root")
    os.makedirs(root)
    proc, endpoint = start_server(root)
    try:
        prefix = f"{a.profile}/train/"
        t0 = time.monotonic()
        n = upload(endpoint, src, prefix)
        print(f"uploaded {n} objects, {size / 1e6:.0f} MB in {time.monotonic() - t0:.1f} s", file=sys.stderr)
        shutil.rmtree(src)
        url = f"s3://{BUCKET}/{prefix}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        env.update(AWS_ACCESS_KEY_ID=ACCESS, AWS_SECRET_ACCESS_KEY=SECRET, AWS_REGION="us-east-1",
                   AWS_ENDPOINT_URL=endpoint)
        req = ["--requests", str(a.requests)] if a.requests else []
        cat = os.path.join(a.work, "prebuilt.ksc")
        sh([K, "catalog", "--source", url, "--out", cat, "--progress=none"] + req, env=env, stdout=subprocess.DEVNULL)

        tools = {
            "kspeed-full": lambda d: sh([K, "preload", "--source", url, "--space", d, "--progress=none"] + req,
                                        env=env, stdout=subprocess.DEVNULL),
            "kspeed-copy": lambda d: sh([K, "preload", "--catalog", cat, "--space", d, "--progress=none"] + req,
                                        env=env, stdout=subprocess.DEVNULL),
            "aws s3 cp": lambda d: (sh([AWS, "--endpoint-url", endpoint, "s3", "cp", "--recursive",
                                        "--only-show-errors", url, d], env=env), sh("sync")),
            "boto3 x64": lambda d: boto3_download(endpoint, prefix, d),
        }
        times = {t: [] for t in tools}
        for run in range(a.runs):
            for name, go in tools.items():
                dst = os.path.join(a.work, "dst")
                shutil.rmtree(dst, ignore_errors=True)
                drop_caches()
                t0 = time.monotonic()
                go(dst)
                times[name].append(time.monotonic() - t0)
                got = du_bytes(dst) if not name.startswith("kspeed") else None
                shutil.rmtree(dst, ignore_errors=True)
                if got is not None and got != size:
                    sys.exit(f"bench_s3: {name} wrote {got} bytes, the dataset has {size}")
                print(f"run {run + 1}: {name:12s} {times[name][-1]:7.2f} s", file=sys.stderr)
    finally:
        proc.kill()
        proc.wait()

    print(f"\n{a.profile}, {a.count} objects, {size / 1e6:.0f} MB, s3s-fs on 127.0.0.1, cold page cache, "
          f"median of {a.runs} runs, {os.cpu_count()} CPUs shared by server and client")
    print(f"{'tool':13s} {'median s':>9s} {'MB/s':>8s} {'vs aws':>7s} {'paired':>7s} {'vs boto3':>9s}   runs (s)")
    aws, b3 = times["aws s3 cp"], times["boto3 x64"]
    for name, ts in times.items():
        m = statistics.median(ts)
        paired = statistics.median(r / t for r, t in zip(aws, ts))
        vs_b3 = statistics.median(r / t for r, t in zip(b3, ts))
        print(f"{name:13s} {m:9.2f} {size / m / 1e6:8.1f} {statistics.median(aws) / m:6.2f}x {paired:6.2f}x "
              f"{vs_b3:8.2f}x   {' '.join(f'{t:.2f}' for t in ts)}")
    print("(vs aws: ratio of the medians; paired: median of the per-run ratios, aws time / tool time; "
          "vs boto3: the same against the boto3 downloader)")
    shutil.rmtree(a.work, ignore_errors=True)


if __name__ == "__main__":
    main()
