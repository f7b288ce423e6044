"""An independent cross-check of kspeed's S3 sources: a real S3 server
(s3s-fs, installed by `scripts/setup.sh --test-tools`), filled and read back
with boto3 (not the Rust client kspeed uses), against what kspeed's catalog
recorded (`kspeed ls --json`: keys, sizes, CRC32C, labels, ETags) and the
bytes it preloaded (`kspeed cat`)."""

import json
import os
import shutil
import socket
import subprocess
import time

import pytest

from conftest import CHILD_TIMEOUT_S, kspeed_bin, make_tree, must_run, require

BUCKET = "kspeed-py"
ACCESS = "KSPPYTESTKEY"
SECRET = f"kspeedPySecret{os.getpid()}Zq"


def s3s_fs():
    p = os.environ.get("KSPEED_S3S_FS")
    if p:
        return p
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    p = os.path.join(cache, "kspeed", "s3s", "bin", "s3s-fs")
    return p if os.path.exists(p) else shutil.which("s3s-fs")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    require("boto3")
    binary = s3s_fs()
    if not binary:
        must_run("s3s-fs is not installed (scripts/setup.sh --test-tools)")
    root = tmp_path_factory.mktemp("s3root")
    port = free_port()
    log = open(root / "s3s-fs.log", "wb")
    data = root / "data"
    data.mkdir()
    proc = subprocess.Popen([binary, "--host", "127.0.0.1", "--port", str(port), "--access-key", ACCESS,
                             "--secret-key", SECRET, str(data)], stdout=log, stderr=log,
                            stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while True:
        assert proc.poll() is None, f"s3s-fs exited: {(root / 's3s-fs.log').read_text()}"
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            assert time.monotonic() < deadline, "s3s-fs not accepting after 30 s"
            time.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    proc.kill()
    proc.wait(timeout=CHILD_TIMEOUT_S)
    log.close()


@pytest.fixture(scope="module")
def client(server):
    import boto3
    from botocore.config import Config
    c = boto3.client("s3", endpoint_url=server, aws_access_key_id=ACCESS, aws_secret_access_key=SECRET,
                     region_name="us-east-1",
                     config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 3},
                                   connect_timeout=10, read_timeout=60))
    c.create_bucket(Bucket=BUCKET)
    return c


def kspeed_s3(server, *args):
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_ACCESS_KEY_ID=ACCESS, AWS_SECRET_ACCESS_KEY=SECRET, AWS_REGION="us-east-1",
               AWS_ENDPOINT_URL=server, AWS_SHARED_CREDENTIALS_FILE="/nonexistent/credentials",
               AWS_CONFIG_FILE="/nonexistent/config")
    r = subprocess.run([kspeed_bin(), "--progress", "none", *map(str, args)], capture_output=True, env=env,
                       timeout=CHILD_TIMEOUT_S)
    out = r.stdout.decode(errors="replace") + r.stderr.decode(errors="replace")
    assert SECRET not in out, "the secret key appears in kspeed's output"
    assert r.returncode == 0, f"kspeed {' '.join(map(str, args))}: {out}"
    return r.stdout


_CRC_TABLE = []


def crc32c(data):
    """CRC32C (Castagnoli), table-driven: independent of kspeed's crate."""
    if not _CRC_TABLE:
        for i in range(256):
            c = i
            for _ in range(8):
                c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
            _CRC_TABLE.append(c)
    c = 0xFFFFFFFF
    t = _CRC_TABLE
    for b in data:
        c = t[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def test_crc32c_reference():
    assert crc32c(b"123456789") == 0xE3069283


def test_catalog_and_space_match_what_boto3_reads(server, client, tmp_path):
    src = make_tree(str(tmp_path / "src"), n=60)
    prefix = "py/train/"
    for dirpath, _, files in os.walk(src):
        for f in files:
            p = os.path.join(dirpath, f)
            client.upload_file(p, BUCKET, prefix + os.path.relpath(p, src))
    # Not samples: a name starting with '.', and a key beside the prefix.
    client.put_object(Bucket=BUCKET, Key=prefix + "ant/.hidden", Body=b"x")
    client.put_object(Bucket=BUCKET, Key="py/train-extra/ant/x.bin", Body=b"x")

    # What boto3 lists (pages of 1,000 keys through its paginator) and reads.
    objects = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix):
        for o in page.get("Contents", []):
            rel = o["Key"][len(prefix):]
            if any(part.startswith(".") for part in rel.split("/")):
                continue
            # s3s-fs lists no ETags: GetObject's.
            got = client.get_object(Bucket=BUCKET, Key=o["Key"])
            objects[rel] = (got["Body"].read(), got["ETag"].strip('"'), o["Size"])
    assert len(objects) == 60

    cat = tmp_path / "c.ksc"
    kspeed_s3(server, "catalog", "--source", f"s3://{BUCKET}/{prefix}", "--out", cat)
    rows = [json.loads(line) for line in kspeed_s3(server, "ls", "--catalog", cat, "--json").splitlines()]
    assert len(rows) == len(objects)
    classes = sorted({k.split("/")[0] for k in objects})
    seen = set()
    rel_of = {}
    for row in rows:
        path = row["path"]
        rel = next((k for k in objects if path in (k, prefix + k, f"s3://{BUCKET}/{prefix}{k}")), None)
        assert rel is not None, f"kspeed catalogued {path!r}, which boto3 did not list"
        assert rel not in seen
        seen.add(rel)
        rel_of[row["id"]] = rel
        body, etag, size = objects[rel]
        assert row["len"] == size == len(body), rel
        assert int(row["crc32c"], 16) == crc32c(body), rel
        assert row["label"] == classes.index(rel.split("/")[0]), rel
        if "etag" in row:
            assert row["etag"].strip('"') == etag, rel

    # The preloaded bytes are the bytes boto3 reads.
    sp = tmp_path / "space"
    kspeed_s3(server, "preload", "--catalog", cat, "--space", sp)
    for row in rows:
        got = kspeed_s3(server, "cat", "--space", sp, "--id", row["id"])
        assert got == objects[rel_of[row["id"]]][0], rel_of[row["id"]]
