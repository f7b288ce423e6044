#!/usr/bin/env python3
"""kspeed side by side with the loaders users would pick instead (issue 32,
part 1): Mosaic Streaming, LitData, WebDataset, FFCV, torchdata's
StatefulDataLoader and a plain PyTorch DataLoader, on the same JPEG files,
each peer in its own format written by its own writer.

  scripts/bench_peers.py --setup          # once: the venv with every peer and this checkout's kspeed
  scripts/bench_peers.py                  # root (drop_caches): the whole benchmark, Markdown tables
  scripts/bench_peers.py --images 1000 --runs 1   # a smoke run
  scripts/bench_peers.py --report FILE    # the tables again from a --json FILE

Why this file is over ~800 lines: one self-contained script (it re-runs
itself per measurement with --one) that must hold every peer's writer and
reader next to the harness that times and checks them alike; split, each
part would need all of the harness.

Data (cached under --data, made only when missing): an ImageFolder of
--images real JPEG files written by Pillow (quality 90, 360-500 x 300-450 px,
~110 KB mean: gradients, octaves of smooth noise, shapes, per-pixel noise;
100 classes, file name = sample id), then each peer's format from those files:

  mosaic  : streaming.MDSWriter(columns jpg:bytes cls:int id:int), default 64 MiB shards
  litdata : litdata.optimize(fn -> {"jpg": bytes, "cls": int, "id": int}, chunk_bytes 64MB,
            num_workers = cores)
  wds     : webdataset.ShardWriter(maxsize 64 MB), <id>.jpg + <id>.cls per sample
  ffcv    : ffcv DatasetWriter, one file with the JPEG bytes (BytesField + size/label/id
            IntFields, bytes rows) and one with RGBImageField(write_mode="jpg", jpeg_quality 90)
            (decoded rows: FFCV's own JPEG decode + crop), num_workers = cores
  kspeed  : kspeed.preload(jpeg folder, space) (the `kspeed preload` of the crate)
  dataloader / torchdata read the ImageFolder itself (no conversion).

Every converter writes raw JPEG bytes (no re-encoding; FFCV's image field
excepted), and its time includes a final sync() (the data on disk).

Rows (--rows, all by default), each for --cache cold (page cache dropped
before every run; root) and warm (the loader's files read into the page
cache before every run), --runs repetitions with the loaders' order rotated
in each, one fresh process per run (this script re-invoked with --one):

  convert : conversion / preload time of the --images files (a fresh output
            directory per run, removed after; the first kept).
  bytes   : one epoch of raw sample bytes into the training process, single
            rank, batch 64, shuffled: samples/s, GB/s, CPU s/GB (getrusage of
            the child: the timed section, the DataLoader workers it reaped
            included), time to the first batch. Each peer with each count of
            --workers (DataLoader workers; FFCV's threads); kspeed.Loader in
            process (its pollers are its workers). Warm also adds "kspeed,
            memory tier": tier_bytes = the dataset, the second epoch of the
            process timed (the first fills the tier).
  bytes2  : the same with 2 ranks on the node (2 processes, torch.distributed
            gloo for the peers that shard by it, RANK/WORLD_SIZE/LOCAL_RANK as
            torchrun sets them); the epoch is from the later rank's start to
            the later rank's end, CPU summed.
  decoded : one epoch through decode + RandomResizedCrop(224) + horizontal
            flip + to float tensor (torchvision transforms v2), batches of 64
            stacked tensors: images/s, CPU ms per image. Decoder (--decode):
            torchvision.io.decode_jpeg (default) or PIL, the same for every
            loader but FFCV (its own decoder and crop, as its users run it);
            the process's torch uses --torch-threads intra-op threads
            (default 1, as DataLoader workers do).
            kspeed: kspeed.torch.KSpeedImageFolder(decode=True,
            random_resized_crop=224) iterated in the process (its decode
            threads, one per core, simplejpeg's reduced-size decode; the
            same transform, see ffi/python/python/kspeed/_decode.py), and
            for reference the same with decoder="torchvision" (kspeed-tv,
            the peers' decoder in kspeed's threads) and the per-sample path
            (kspeed-samples: decode=True + the peers' function as transform,
            in a DataLoader with each --workers count). "per core": images/s
            divided by the CPUs the machine has.
  resume  : time to the first batch after restoring a mid-epoch state (at
            --resume-at of the epoch), bytes, in process (--resume-workers):
            Mosaic StreamingDataLoader.state_dict, LitData
            StreamingDataLoader.state_dict, torchdata StatefulDataLoader,
            kspeed.Loader.state_dict. One process consumes up to the position
            and saves the state, a fresh one restores it (timed from the
            loader's construction to its first batch) and drains the epoch;
            the two together must deliver every sample exactly once.
            WebDataset, FFCV and the plain DataLoader have no state to resume
            from (printed as such).

Exactly once: every epoch's sample count is checked in every run, and before
the timed runs one untimed pass per loader and configuration checks the bytes
(count, sum of sizes, and sum and sum of squares of each sample's CRC32
against the files'); decoded runs check the ids (count, sum, sum of squares)
in every run. A mismatch stops the benchmark naming the loader. A run that
fails (a crash) is printed and left out of the medians, as FAIL.

Ratios: medians, and the median of per-run ratios against the best peer of
the same run (paired), as scripts/bench_s3_read.py and BENCHMARKS.md do.
Goals (issue 32): bytes >= 1.5x the best peer, decoded >= 1.0x, preload
>= 2x the fastest converter, resume <= 10 ms.

--setup makes (or updates) the venv (--venv, default
~/.cache/kspeed/peers-venv) with the peers' PyPI packages, pinned
(PEER_PINS), and this checkout's kspeed (`pip install ./ffi/python`, or
--wheel FILE). It is layered on the project's Python venv
(scripts/test_python.sh: torch, torchvision, torchdata; --base-venv) when
that exists, through a .pth file, so torch is not installed a second time;
otherwise torch, torchvision and torchdata come from PyPI. FFCV is tried
(`pip install ffcv`); it builds from source against the system's OpenCV 4
and libjpeg-turbo (pkg-config), so where those are missing it does not
install and its rows print "not installable: <the error>" (--ffcv-system-deps
installs libopencv-dev, libturbojpeg0-dev and pkg-config with apt-get first).
Run without --setup, the script re-executes itself with the venv's python
when the one it was started with lacks the peers.
"""

import argparse
import io
import json
import os
import pickle
import shutil
import socket
import statistics
import subprocess
import sys
import time
import warnings
import zlib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kspeed")
DEFAULT_VENV = os.path.join(CACHE, "peers-venv")
DEFAULT_BASE = os.environ.get("KSPEED_PY_VENV") or os.path.join(CACHE, "py-venv")
BATCH = 64
SHARD_BYTES = 64 << 20
# Pinned so that reruns compare the same peers; torch/torchvision/torchdata
# are the project's (scripts/test_python.sh) when the venv is layered on it.
PEER_PINS = ["mosaicml-streaming==0.13.0", "litdata==0.2.76", "webdataset==1.0.2"]
TORCH_PKGS = ["torch", "torchvision", "torchdata"]
FFCV_PIN = "ffcv==1.0.2"
PEERS = ["mosaic", "litdata", "wds", "ffcv", "torchdata", "dataloader"]
LOADERS = PEERS + ["kspeed"]
LABEL = {
    "mosaic": "Mosaic StreamingDataset",
    "litdata": "LitData StreamingDataset",
    "wds": "WebDataset",
    "ffcv": "FFCV",
    "torchdata": "torchdata StatefulDataLoader",
    "dataloader": "PyTorch DataLoader",
    "kspeed": "kspeed",
    "kspeed-tier": "kspeed, memory tier",
    "kspeed-tv": "kspeed",
    "kspeed-samples": "kspeed",
}
# kspeed's decoded rows (the first is "kspeed" itself): the batched decode,
# the same with the peers' decoder, the per-sample path in DataLoader workers.
KSPEED_DECODED = ["kspeed", "kspeed-tv", "kspeed-samples"]
CONVERTERS = ["mosaic", "litdata", "wds", "ffcv", "kspeed"]
STATEFUL = ["mosaic", "litdata", "torchdata", "kspeed"]

warnings.filterwarnings("ignore", message="This DataLoader will create")
warnings.filterwarnings("ignore", message="The given buffer is not writable")


# ------------------------------------------------------------------ helpers


def drop_caches():
    subprocess.run(["sync"], check=True)
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except PermissionError:
        sys.exit("bench_peers: --cache cold drops the page cache, which needs root (or use --cache warm)")


def tree_files(path):
    if os.path.isfile(path):
        return [path]
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs)


def tree_bytes(path):
    return sum(os.path.getsize(p) for p in tree_files(path))


def warm_files(paths):
    """Reads every file under paths into the page cache."""
    buf = bytearray(8 << 20)
    for root in paths:
        for p in tree_files(root):
            with open(p, "rb", buffering=0) as f:
                while f.readinto(buf):
                    pass


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_now():
    import resource

    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


def label_of(i, n, classes):
    return i * classes // n


def n_classes(n):
    return max(1, min(100, n // 10))


class Sums:
    """Order-independent digest of an epoch: count, bytes, and the sum and
    sum of squares (mod 2**64) of each sample's CRC32 (bytes) or id."""

    M = (1 << 64) - 1

    def __init__(self):
        self.count = self.nbytes = self.s1 = self.s2 = 0

    def add_bytes(self, b):
        c = zlib.crc32(b)
        self.count += 1
        self.nbytes += len(b)
        self.s1 = (self.s1 + c) & self.M
        self.s2 = (self.s2 + c * c) & self.M

    def add_ids(self, ids):
        for i in ids:
            i = int(i)
            self.count += 1
            self.s1 = (self.s1 + i) & self.M
            self.s2 = (self.s2 + i * i) & self.M

    def as_dict(self):
        return {"count": self.count, "bytes": self.nbytes, "s1": self.s1, "s2": self.s2}


def merge_sums(ds):
    out = {"count": 0, "bytes": 0, "s1": 0, "s2": 0}
    for d in ds:
        out["count"] += d["count"]
        out["bytes"] += d["bytes"]
        out["s1"] = (out["s1"] + d["s1"]) & Sums.M
        out["s2"] = (out["s2"] + d["s2"]) & Sums.M
    return out


# ------------------------------------------------------------------ data


def gen_image(args):
    """One JPEG: a gradient, three octaves of smooth noise, shapes and
    per-pixel noise (seeded by the id), quality 90."""
    i, seed = args
    import numpy as np
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(seed * 1_000_003 + i)
    w, h = int(rng.integers(360, 501)), int(rng.integers(300, 451))
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    c0, c1 = rng.uniform(0, 255, 3).astype(np.float32), rng.uniform(0, 255, 3).astype(np.float32)
    ang = rng.uniform(0, np.pi)
    t = ((xx * np.cos(ang) + yy * np.sin(ang)) / (w + h) + 0.5)[..., None]
    img = c0 * (1 - t) + c1 * t
    for s, a in ((4, 60), (16, 35), (160, 30)):
        small = rng.normal(0, a, (s, s, 3)).astype(np.float32)
        img += np.stack([np.asarray(Image.fromarray(small[..., k]).resize((w, h), Image.BICUBIC)) for k in range(3)],
                        -1)
    im = Image.fromarray(np.clip(img, 0, 255).astype(np.uint8))
    d = ImageDraw.Draw(im)
    for _ in range(int(rng.integers(5, 25))):
        x0, y0 = int(rng.integers(0, w)), int(rng.integers(0, h))
        x1, y1 = x0 + int(rng.integers(10, w // 2)), y0 + int(rng.integers(10, h // 2))
        col = tuple(int(v) for v in rng.integers(0, 256, 3))
        k = int(rng.integers(0, 3))
        if k == 0:
            d.ellipse([x0, y0, x1, y1], fill=col)
        elif k == 1:
            d.rectangle([x0, y0, x1, y1], fill=col)
        else:
            d.line([x0, y0, x1, y1], fill=col, width=int(rng.integers(1, 8)))
    a = np.asarray(im, np.float32) + rng.normal(0, rng.uniform(25, 45), (h, w, 3)).astype(np.float32)
    out = io.BytesIO()
    Image.fromarray(np.clip(a, 0, 255).astype(np.uint8)).save(out, "JPEG", quality=90)
    return out.getvalue()


class Layout:
    def __init__(self, data, n):
        self.n = n
        self.classes = n_classes(n)
        self.dir = os.path.join(data, f"n{n}")
        self.jpeg = os.path.join(self.dir, "jpeg")
        self.meta = os.path.join(self.dir, "meta.json")

    def path(self, i):
        return os.path.join(self.jpeg, f"c{label_of(i, self.n, self.classes):03d}", f"{i:08d}.jpg")

    def out(self, peer):
        return os.path.join(self.dir, {"mosaic": "mds", "litdata": "litdata", "wds": "wds", "ffcv": "ffcv",
                                       "kspeed": "space"}[peer])

    def files_of(self, loader):
        """What a loader reads (for the warm variant)."""
        if loader in ("dataloader", "torchdata"):
            return [self.jpeg]
        if loader.startswith("kspeed"):
            loader = "kspeed"
        return [self.out(loader)]


def make_images(a, lay):
    if os.path.exists(lay.meta):
        with open(lay.meta) as f:
            meta = json.load(f)
        if meta.get("n") == lay.n:
            return meta
    from multiprocessing import Pool

    shutil.rmtree(lay.jpeg, ignore_errors=True)
    for c in range(lay.classes):
        os.makedirs(os.path.join(lay.jpeg, f"c{c:03d}"), exist_ok=True)
    t = time.monotonic()
    sums = Sums()
    with Pool(os.cpu_count()) as pool:
        for i, data in enumerate(pool.imap(gen_image, ((i, 1) for i in range(lay.n)), chunksize=16)):
            with open(lay.path(i), "wb") as f:
                f.write(data)
            sums.add_bytes(data)
            if (i + 1) % 2000 == 0:
                log(f"generated {i + 1}/{lay.n} JPEGs")
    ids = Sums()
    ids.add_ids(range(lay.n))
    meta = {"n": lay.n, "classes": lay.classes, "bytes_sums": sums.as_dict(), "id_sums": ids.as_dict()}
    with open(lay.meta + ".tmp", "w") as f:
        json.dump(meta, f)
    os.replace(lay.meta + ".tmp", lay.meta)
    log(f"generated {lay.n} JPEGs ({sums.nbytes / 1e6:.0f} MB, mean {sums.nbytes / lay.n / 1e3:.0f} KB) "
        f"in {time.monotonic() - t:.0f} s under {lay.jpeg}")
    return meta


def log(msg):
    print(msg, file=sys.stderr, flush=True)


# ------------------------------------------------------------------ converters (children)


def items(lay):
    return [(lay.path(i), label_of(i, lay.n, lay.classes), i) for i in range(lay.n)]


def read(p):
    with open(p, "rb") as f:
        return f.read()


def _litdata_item(item):
    path, label, i = item
    return {"jpg": read(path), "cls": label, "id": i}


class _FfcvBytes:
    def __init__(self, its):
        self.its = its

    def __len__(self):
        return len(self.its)

    def __getitem__(self, k):
        import numpy as np

        path, label, i = self.its[k]
        b = np.frombuffer(read(path), dtype=np.uint8)
        return b, len(b), label, i


class _FfcvImages(_FfcvBytes):
    def __getitem__(self, k):
        from PIL import Image

        path, label, i = self.its[k]
        return Image.open(path).convert("RGB"), label, i


def convert(peer, lay, out):
    its = items(lay)
    cores = os.cpu_count()
    if peer == "mosaic":
        from streaming import MDSWriter

        with MDSWriter(out=out, columns={"jpg": "bytes", "cls": "int", "id": "int"}) as w:
            for path, label, i in its:
                w.write({"jpg": read(path), "cls": label, "id": i})
    elif peer == "litdata":
        import litdata

        litdata.optimize(fn=_litdata_item, inputs=its, output_dir=out, chunk_bytes="64MB", num_workers=cores,
                         verbose=False)
    elif peer == "wds":
        import webdataset as wds

        os.makedirs(out)
        with wds.ShardWriter(os.path.join(out, "shard-%06d.tar"), maxsize=SHARD_BYTES, maxcount=1 << 30,
                             verbose=0) as w:
            for path, label, i in its:
                w.write({"__key__": f"{i:08d}", "jpg": read(path), "cls": str(label).encode()})
    elif peer == "ffcv":
        from ffcv.fields import BytesField, IntField, RGBImageField
        from ffcv.writer import DatasetWriter

        os.makedirs(out)
        DatasetWriter(os.path.join(out, "bytes.beton"),
                      {"jpg": BytesField(), "size": IntField(), "cls": IntField(), "id": IntField()},
                      num_workers=cores).from_indexed_dataset(_FfcvBytes(its))
        DatasetWriter(os.path.join(out, "images.beton"),
                      {"image": RGBImageField(write_mode="jpg", jpeg_quality=90), "cls": IntField(),
                       "id": IntField()}, num_workers=cores).from_indexed_dataset(_FfcvImages(its))
    elif peer == "kspeed":
        import kspeed

        kspeed.preload(lay.jpeg, out)
    else:
        raise ValueError(peer)
    os.sync()


# ------------------------------------------------------------------ loaders (children)


def columns(b):
    """Collate for bytes: (samples' bytes, labels, ids), each a tuple. (Mosaic's
    StreamingDataLoader counts a batch's samples as len(batch[0]).)"""
    return tuple(zip(*b))


def litdata_bytes_collate(b):
    # LitData hands out bytes fields as memoryviews of its chunk, which cannot
    # cross the DataLoader's worker queue: copy them (as bench_s3_read.py).
    return columns([(bytes(s["jpg"]), s["cls"], s["id"]) for s in b])


class RawFiles:
    """Map-style: opens and reads each file of the ImageFolder; with a
    transform, returns (transform(bytes), label, id)."""

    def __init__(self, lay, transform=None):
        self.its = items(lay)
        self.transform = transform

    def __len__(self):
        return len(self.its)

    def __getitem__(self, k):
        path, label, i = self.its[k]
        b = read(path)
        return (self.transform(b) if self.transform else b), label, i


def make_decode(kind):
    """bytes-like -> float tensor 3x224x224 (decode, RandomResizedCrop(224),
    horizontal flip, to float in [0, 1])."""
    import torch
    from torchvision.transforms import v2

    crop = v2.Compose([v2.RandomResizedCrop(224, antialias=True), v2.RandomHorizontalFlip()])
    if kind == "torchvision":
        from torchvision.io import ImageReadMode, decode_jpeg

        def decode(b):
            t = b if isinstance(b, torch.Tensor) else torch.frombuffer(b, dtype=torch.uint8)
            img = decode_jpeg(t, mode=ImageReadMode.RGB)
            return v2.functional.to_dtype(crop(img), torch.float32, scale=True)
    else:
        from PIL import Image

        def decode(b):
            if isinstance(b, torch.Tensor):
                b = b.numpy().tobytes()
            img = Image.open(io.BytesIO(b)).convert("RGB")
            return v2.functional.to_dtype(v2.functional.pil_to_tensor(crop(img)), torch.float32, scale=True)
    return decode


class Epoch:
    """Times one pass: construction to the last batch; the first batch's time too."""

    def __init__(self):
        self.t0 = time.perf_counter()
        self.wall0 = time.time()
        self.c0 = cpu_now()
        self.first = None
        self.samples = 0
        self.nbytes = 0

    def batch(self, n, nbytes=0):
        if self.first is None:
            self.first = time.perf_counter() - self.t0
        self.samples += n
        self.nbytes += nbytes

    def done(self):
        return {"seconds": time.perf_counter() - self.t0, "cpu": cpu_now() - self.c0, "samples": self.samples,
                "bytes": self.nbytes, "first_batch_s": self.first, "t0": self.wall0, "t1": time.time()}


def dist_info():
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def build_loader(o, lay, mode, decode=None, seed=1):
    """Returns (iterable of batches, unpack) where unpack(batch) gives a list
    of (bytes-like or tensor, label, id) for bytes mode, or
    (images tensor, labels, ids) for decoded mode."""
    loader, w = o["loader"], o["workers"]
    rank, world = dist_info()
    if loader == "mosaic":
        from streaming import StreamingDataLoader, StreamingDataset
        from streaming.base.util import clean_stale_shared_memory

        clean_stale_shared_memory()

        class DS(StreamingDataset):
            def __getitem__(self, idx):
                s = super().__getitem__(idx)
                if decode:
                    return decode(s["jpg"]), s["cls"], s["id"]
                return s["jpg"], s["cls"], s["id"]

        ds = DS(local=lay.out("mosaic"), shuffle=True, shuffle_seed=seed, batch_size=BATCH)
        dl = StreamingDataLoader(ds, batch_size=BATCH, num_workers=w, collate_fn=None if decode else columns)
        return dl
    if loader == "litdata":
        from litdata import StreamingDataLoader, StreamingDataset

        ds = StreamingDataset(lay.out("litdata"), shuffle=True, seed=seed, drop_last=False,
                              transform=(lambda s: (decode(s["jpg"]), s["cls"], s["id"])) if decode else None)
        return StreamingDataLoader(ds, batch_size=BATCH, num_workers=w,
                                   collate_fn=None if decode else litdata_bytes_collate)
    if loader == "wds":
        import webdataset as wds

        shards = tree_files(lay.out("wds"))
        ds = wds.WebDataset(shards, shardshuffle=len(shards), seed=seed, empty_check=False,
                            nodesplitter=wds.split_by_node if world > 1 else wds.single_node_only)
        ds = ds.shuffle(1000).to_tuple("jpg", "cls", "__key__")
        if decode:
            ds = ds.map(lambda s: (decode(s[0]), int(s[1]), int(s[2])))
            return wds.WebLoader(ds.batched(BATCH), batch_size=None, num_workers=w)
        ds = ds.map(lambda s: (s[0], int(s[1]), int(s[2])))
        return wds.WebLoader(ds.batched(BATCH, collation_fn=columns), batch_size=None, num_workers=w)
    if loader in ("dataloader", "torchdata"):
        import torch
        from torch.utils.data import DataLoader, DistributedSampler

        ds = RawFiles(lay, decode)
        cls = DataLoader
        if loader == "torchdata":
            from torchdata.stateful_dataloader import StatefulDataLoader as cls
        g = torch.Generator()
        g.manual_seed(seed)
        kw = {"sampler": DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=seed)} \
            if world > 1 else {"shuffle": True, "generator": g}
        return cls(ds, batch_size=BATCH, num_workers=w, collate_fn=None if decode else columns, **kw)
    if loader == "ffcv":
        from ffcv.fields.basics import IntDecoder
        from ffcv.loader import Loader, OrderOption

        kw = {"batch_size": BATCH, "num_workers": max(w, 1), "order": OrderOption.RANDOM, "seed": seed,
              "drop_last": False, "distributed": world > 1}
        # FFCV decodes with its own pipeline: one_epoch passes it no decode
        # function, so the mode says which file to read.
        if mode == "decoded":
            import torch
            from ffcv.fields.rgb_image import RandomResizedCropRGBImageDecoder
            from ffcv.transforms import Convert, RandomHorizontalFlip, ToTensor, ToTorchImage

            pipes = {"image": [RandomResizedCropRGBImageDecoder((224, 224)), RandomHorizontalFlip(), ToTensor(),
                               ToTorchImage(), Convert(torch.float32)],
                     "cls": [IntDecoder()], "id": [IntDecoder()]}
            return Loader(os.path.join(lay.out("ffcv"), "images.beton"), pipelines=pipes, **kw)
        from ffcv.fields.bytes import BytesDecoder

        pipes = {"jpg": [BytesDecoder()], "size": [IntDecoder()], "cls": [IntDecoder()], "id": [IntDecoder()]}
        return Loader(os.path.join(lay.out("ffcv"), "bytes.beton"), pipelines=pipes, **kw)
    if loader.startswith("kspeed"):
        import kspeed

        if decode and loader in ("kspeed", "kspeed-tv"):
            from kspeed.torch import KSpeedImageFolder

            # The batched decode: whole decoded batches from the process's
            # decode threads (no DataLoader workers, nothing pickled).
            kw = dict(o.get("kspeed_opts", {}))
            if loader == "kspeed-tv":
                kw["decoder"] = "torchvision"
            elif o.get("decode_kind") == "pil":
                kw["decoder"] = "pil"
            return KSpeedImageFolder(lay.out("kspeed"), decode=True, random_resized_crop=224, return_id=True,
                                     batch_size=BATCH, seed=seed, rank=rank, world=world, **kw)
        if decode:
            from torch.utils.data import DataLoader

            from kspeed.torch import KSpeedImageFolder

            kw = dict(o.get("kspeed_opts", {}))
            if o.get("decode_kind") == "torchvision":
                ds = KSpeedImageFolder(lay.out("kspeed"), decode=True, transform=decode.crop_only, return_id=True,
                                       batch_size=BATCH, seed=seed, rank=rank, world=world, **kw)
            else:
                ds = KSpeedImageFolder(lay.out("kspeed"), transform=decode, return_id=True, batch_size=BATCH,
                                       seed=seed, rank=rank, world=world, **kw)
            return DataLoader(ds, batch_size=BATCH, num_workers=w)
        tier = tree_bytes(lay.out("kspeed")) + (64 << 20) if loader == "kspeed-tier" else 0
        # kspeed's defaults, as a user gets them (the ring sized from the
        # batch); --kspeed-opts adds to or overrides them.
        kw = dict(o.get("kspeed_opts", {}))
        return kspeed.Loader(lay.out("kspeed"), batch_size=BATCH, seed=seed, tier_bytes=tier, rank=rank, world=world,
                             **kw)
    raise ValueError(loader)


def bytes_batches(o, dl):
    """Yields (count, nbytes, samples-or-None) per batch in bytes mode;
    samples is a list of bytes-likes, only when o["verify"]."""
    loader, verify = o["loader"], o.get("verify")
    if loader.startswith("kspeed"):
        for b in dl:
            arr = b.array()  # the whole batch, zero-copy over the ring
            ln = b.lengths
            smp = None
            if verify:
                off = b.offsets
                smp = [arr[int(off[i]):int(off[i]) + int(ln[i])] for i in range(len(b))]
            yield len(b), int(ln.sum()), smp
    elif loader == "ffcv":
        for jpg, size, _cls, _id in dl:
            size = size.reshape(-1)
            n = len(size)
            smp = [bytes(memoryview(jpg[i, :int(size[i])])) for i in range(n)] if verify else None
            yield n, int(size.sum()), smp
    else:
        for b in dl:
            jpgs = b[0]
            yield len(jpgs), sum(map(len, jpgs)), (list(jpgs) if verify else None)


def decoded_batches(o, dl):
    """Yields (count, ids) per batch of decoded images."""
    for b in dl:
        if o["loader"] == "ffcv":
            img, _cls, ids = b
            img = img.div_(255)  # FFCV's Convert gives 0..255 floats; the others' to_dtype scales
        else:
            img, _cls, ids = b[0], b[1], b[2]
        assert img.shape[-2:] == (224, 224), img.shape
        yield img.shape[0], ids.reshape(-1).tolist() if hasattr(ids, "reshape") else list(ids)


def one_epoch(o, lay):
    loader, mode = o["loader"], o["mode"]
    decode = None
    if mode == "decoded" and loader != "ffcv":
        decode = make_decode(o["decode_kind"])
        if loader.startswith("kspeed"):
            import torch
            from torchvision.transforms import v2

            crop = v2.Compose([v2.RandomResizedCrop(224, antialias=True), v2.RandomHorizontalFlip()])
            decode.crop_only = lambda img: v2.functional.to_dtype(crop(img), torch.float32, scale=True)
    if loader == "kspeed-tier":
        # The first epoch fills the memory tier, untimed; the second is timed.
        dl = build_loader(o, lay, mode, decode, seed=o["seed"])
        for _ in bytes_batches(dict(o, verify=False), dl):
            pass
        ep = Epoch()
    else:
        ep = Epoch()
        dl = build_loader(o, lay, mode, decode, seed=o["seed"])
    sums = Sums()
    if mode == "bytes":
        for n, nb, smp in bytes_batches(o, dl):
            ep.batch(n, nb)
            if smp is not None:
                for s in smp:
                    sums.add_bytes(s)
    else:
        for n, ids in decoded_batches(o, dl):
            ep.batch(n)
            sums.add_ids(ids)
    r = ep.done()
    r["sums"] = sums.as_dict()
    if loader.startswith("kspeed") and mode == "bytes":
        dl.close()
    return r


def resume_child(o, lay):
    """phase save: consume up to o["at"] of the epoch, pickle the state;
    phase restore: build, load the state, time to the first batch, drain."""
    state_file = o["state_file"]
    if o["phase"] == "save":
        dl = build_loader(o, lay, "bytes", seed=o["seed"])
        want = int(o["at"] * lay.n)
        sums = Sums()
        for _n, _nb, smp in bytes_batches(dict(o, verify=True), dl):
            for s in smp:
                sums.add_bytes(s)
            if sums.count >= want:
                break
        # Taken from the loader the batches came from, mid-iteration, as a
        # training loop's checkpoint does.
        state = dl.state_dict()
        with open(state_file, "wb") as f:
            pickle.dump(state, f)
        return {"sums": sums.as_dict(), "state_bytes": len(pickle.dumps(state))}
    with open(state_file, "rb") as f:
        state = pickle.load(f)
    ep = Epoch()
    dl = build_loader(o, lay, "bytes", seed=o["seed"])
    built = time.perf_counter() - ep.t0
    dl.load_state_dict(state)
    loaded = time.perf_counter() - ep.t0
    sums = Sums()
    for n, nb, smp in bytes_batches(dict(o, verify=True), dl):
        ep.batch(n, nb)
        for s in smp:
            sums.add_bytes(s)
    r = ep.done()
    r["sums"] = sums.as_dict()
    r["built_s"], r["loaded_s"] = built, loaded
    return r


def preimport(loader, mode):
    """Imports what a loader uses before anything is timed."""
    import numpy  # noqa: F401
    import torch  # noqa: F401
    import torch.utils.data  # noqa: F401

    if mode == "decoded":
        import torchvision.io  # noqa: F401
        import torchvision.transforms.v2  # noqa: F401
        from PIL import Image  # noqa: F401
    if loader == "mosaic":
        import streaming  # noqa: F401
    elif loader == "litdata":
        import litdata  # noqa: F401
    elif loader == "wds":
        import webdataset  # noqa: F401
    elif loader == "torchdata":
        import torchdata.stateful_dataloader  # noqa: F401
    elif loader == "ffcv":
        import ffcv.loader  # noqa: F401
    elif loader.startswith("kspeed"):
        import kspeed  # noqa: F401
        import kspeed.torch  # noqa: F401


def child_main(o):
    lay = Layout(o["data"], o["n"])
    if o["kind"] != "convert":
        preimport(o["loader"], o.get("mode", "bytes"))
        if o.get("torch_threads"):
            # The process's own intra-op threads (the transforms' resize):
            # one, as in DataLoader workers; more spin on a loaded machine.
            import torch

            torch.set_num_threads(o["torch_threads"])
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and o.get("dist"):
        import torch.distributed as dist

        dist.init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=world)
        dist.barrier()
    kind = o["kind"]
    if kind == "convert":
        c0 = cpu_now()
        t0 = time.perf_counter()
        convert(o["loader"], lay, o["out"])
        r = {"seconds": time.perf_counter() - t0, "cpu": cpu_now() - c0, "out_bytes": tree_bytes(o["out"])}
    elif kind == "epoch":
        r = one_epoch(o, lay)
    elif kind == "resume":
        r = resume_child(o, lay)
    else:
        raise ValueError(kind)
    print("RESULT " + json.dumps(r), flush=True)
    sys.stdout.flush()
    # Some peers' threads (obstore, numba) have been seen to hang at exit.
    os._exit(0)


# ------------------------------------------------------------------ parent


class RunFailed(Exception):
    pass


class NotExactlyOnce(Exception):
    pass


def run_children(a, opts, world=1):
    """Runs world children (ranks) with opts; returns their results."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if world > 1:
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(world),
                   LOCAL_WORLD_SIZE=str(world))
    procs = []
    for r in range(world):
        e = dict(env)
        if world > 1:
            e.update(RANK=str(r), LOCAL_RANK=str(r))
        cmd = [sys.executable, os.path.abspath(__file__), "--one", json.dumps(opts)]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=e))
    out = []
    errs = []
    for p in procs:
        try:
            so, se = p.communicate(timeout=a.timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise RunFailed(f"timed out after {a.timeout} s")
        res = [ln for ln in so.splitlines() if ln.startswith("RESULT ")]
        if p.returncode != 0 or not res:
            tail = [ln for ln in se.strip().splitlines() if ln.strip()]
            errs.append(f"exit {p.returncode}: {' | '.join(tail[-3:]) if tail else so[-300:]}")
            continue
        out.append(json.loads(res[-1][7:]))
    if errs:
        raise RunFailed("; ".join(errs))
    return out


def prepare_cache(a, lay, cache, loader):
    if cache == "cold":
        drop_caches()
    else:
        warm_files(lay.files_of(loader))


def check_sums(what, got, want, keys):
    bad = [k for k in keys if got[k] != want[k]]
    if bad:
        raise NotExactlyOnce(f"{what} did not deliver every sample exactly once: "
                         + ", ".join(f"{k} {got[k]} != {want[k]}" for k in bad))


def ffcv_reason(a):
    try:
        import ffcv  # noqa: F401

        return None
    except Exception as e:  # noqa: BLE001
        f = os.path.join(os.path.dirname(os.path.dirname(sys.executable)), "ffcv-not-installable.txt")
        if os.path.exists(f):
            with open(f) as fh:
                return fh.read().strip()
        return f"import ffcv: {type(e).__name__}: {e}"


def main_bench(a):
    lay = Layout(a.data, a.images)
    os.makedirs(lay.dir, exist_ok=True)
    meta = make_images(a, lay)
    dataset_bytes = meta["bytes_sums"]["bytes"]
    loaders = [x for x in a.loaders.split(",") if x]
    unavailable = {}
    if "ffcv" in loaders:
        reason = ffcv_reason(a)
        if reason:
            unavailable["ffcv"] = f"not installable: {reason}"
            loaders.remove("ffcv")
    workers = [int(w) for w in a.workers.split(",")]
    # --workers-of mosaic=2,litdata=0: those loaders with those counts only
    # (e.g. each peer's best count from an earlier run).
    workers_of = {k: [int(x) for x in v.split("+")] for k, v in
                  (kv.split("=") for kv in a.workers_of.split(",") if kv)}
    caches = [c for c in a.cache.split(",") if c]
    rows = [r for r in a.rows.split(",") if r]
    base = {"data": a.data, "n": a.images, "decode_kind": a.decode, "kspeed_opts": json.loads(a.kspeed_opts),
            "torch_threads": a.torch_threads}
    results = {"images": a.images, "dataset_bytes": dataset_bytes, "unavailable": unavailable, "runs": a.runs,
               "decode": a.decode, "resume_at": a.resume_at, "resume_workers": a.resume_workers,
               "rows": {}, "host": {"cpus": os.cpu_count(), "load": os.getloadavg()}}

    results["versions"] = versions()
    results["commit"] = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                                       text=True).stdout.strip()
    # Every peer's own format, once (kept), before anything is timed.
    for p in CONVERTERS:
        if p in loaders and not os.path.exists(lay.out(p)):
            tmp = lay.out(p) + ".tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            log(f"converting for {p} ...")
            r = run_children(a, dict(base, kind="convert", loader=p, out=tmp))[0]
            os.rename(tmp, lay.out(p))
            log(f"  {p}: {r['seconds']:.1f} s, {r['out_bytes'] / 1e6:.0f} MB")

    def configs(mode):
        out = []
        for ld in loaders:
            if ld == "kspeed" and mode != "decoded":
                out.append((ld, 0))
            elif ld == "kspeed":
                for k in a.kspeed_decoded.split(","):
                    out += [(k, w) for w in workers_of.get(k, workers)] if k == "kspeed-samples" else [(k, 0)]
            elif ld == "ffcv":
                out += [(ld, max(w, 1)) for w in sorted({max(w, 1) for w in workers})]
            else:
                out += [(ld, w) for w in workers_of.get(ld, workers)]
        return out

    def record(row, cache, key, run, val):
        results["rows"].setdefault(row, {}).setdefault(cache, {}).setdefault(key, [None] * a.runs)[run] = val

    verified = {}
    errors = results["errors"] = []

    def verify(mode, ld, w, world):
        """An untimed pass checking bytes (count, size, CRC32 sums) or ids;
        returns None, or why the configuration is left out."""
        k = (mode, ld, w, world)
        if k in verified or a.no_verify:
            return verified.get(k)
        o = dict(base, kind="epoch", mode=mode, loader=ld, workers=w, seed=1, verify=True, dist=world > 1)
        try:
            rs = run_children(a, o, world)
            got = merge_sums([r["sums"] for r in rs])
            if mode == "bytes":
                check_sums(f"{LABEL[ld]} ({w} workers, {world} rank(s), bytes)", got, meta["bytes_sums"],
                           ["count", "bytes", "s1", "s2"])
            else:
                check_sums(f"{LABEL[ld]} ({w} workers, {world} rank(s), decoded)", got, meta["id_sums"],
                           ["count", "s1", "s2"])
        except RunFailed as e:
            log(f"verify {mode} {ld} w{w} x{world}: FAILED {e} (its timed runs are tried anyway)")
            return None
        except NotExactlyOnce as e:
            log(f"ERROR: {e}; left out of the timed runs")
            errors.append(str(e))
            verified[k] = f"ERROR: not exactly once ({e})"
            return verified[k]
        log(f"verified: {ld} ({w} workers, {world} rank(s), {mode}): {got['count']} samples, each once")
        verified[k] = None
        return None

    for cache in caches:
        for row in rows:
            if row == "convert":
                cfgs = [(p, 0) for p in CONVERTERS if p in loaders]
            elif row == "resume":
                cfgs = [(ld, a.resume_workers) for ld in STATEFUL if ld in loaders]
            else:
                cfgs = configs("decoded" if row == "decoded" else "bytes")
                if row == "bytes" and cache == "warm" and "kspeed" in loaders:
                    cfgs.append(("kspeed-tier", 0))
            world = 2 if row == "bytes2" else 1
            mode = "decoded" if row == "decoded" else "bytes"
            if row in ("bytes", "bytes2", "decoded"):
                keep = []
                for ld, w in cfgs:
                    why = verify(mode, ld, w, world)
                    if why:
                        results.setdefault("excluded", {}).setdefault(row, {}).setdefault(cache, {})[
                            f"{ld}:{w}"] = why
                    else:
                        keep.append((ld, w))
                cfgs = keep
            if not cfgs:
                continue
            for run in range(a.runs):
                k = run % len(cfgs)
                for ld, w in cfgs[k:] + cfgs[:k]:
                    key = f"{ld}:{w}"
                    load = os.getloadavg()[0]
                    try:
                        if row == "convert":
                            tmp = lay.out(ld) + f".run{run}"
                            shutil.rmtree(tmp, ignore_errors=True)
                            if cache == "cold":
                                drop_caches()
                            else:
                                warm_files([lay.jpeg])
                            r = run_children(a, dict(base, kind="convert", loader=ld, out=tmp))[0]
                            shutil.rmtree(tmp, ignore_errors=True)
                            val = {"seconds": r["seconds"], "cpu": r["cpu"], "out_bytes": r["out_bytes"]}
                            msg = f"{r['seconds']:7.2f} s  CPU {r['cpu']:6.1f} s  {r['out_bytes'] / 1e6:.0f} MB"
                        elif row == "resume":
                            sf = os.path.join(lay.dir, f"state-{ld}.pkl")
                            o = dict(base, kind="resume", loader=ld, workers=w, seed=run + 1, at=a.resume_at,
                                     state_file=sf)
                            s = run_children(a, dict(o, phase="save"))[0]
                            prepare_cache(a, lay, cache, ld)
                            r = run_children(a, dict(o, phase="restore"))[0]
                            both = merge_sums([s["sums"], r["sums"]])
                            check_sums(f"{LABEL[ld]} (saved at {a.resume_at:.0%}, then restored)", both,
                                       meta["bytes_sums"], ["count", "bytes", "s1", "s2"])
                            val = {"first_batch_s": r["first_batch_s"], "state_bytes": s["state_bytes"],
                                   "saved_at": s["sums"]["count"], "seconds": r["seconds"], "built_s": r["built_s"],
                                   "loaded_s": r["loaded_s"]}
                            msg = (f"first batch after restore {r['first_batch_s'] * 1e3:8.1f} ms  (built "
                                   f"{r['built_s'] * 1e3:.1f} ms, state loaded {r['loaded_s'] * 1e3:.1f} ms)  "
                                   f"(state at sample {s['sums']['count']}, {s['state_bytes']} B)")
                        else:
                            prepare_cache(a, lay, cache, ld)
                            o = dict(base, kind="epoch", mode=mode, loader=ld, workers=w, seed=run + 1,
                                     verify=False, dist=world > 1)
                            rs = run_children(a, o, world)
                            n = sum(r["samples"] for r in rs)
                            if n != a.images:
                                raise NotExactlyOnce(f"{LABEL[ld]} ({w} workers, {row}) delivered {n} "
                                                 f"samples, not {a.images}")
                            if mode == "decoded":
                                check_sums(f"{LABEL[ld]} ({w} workers, decoded)",
                                           merge_sums([r["sums"] for r in rs]), meta["id_sums"],
                                           ["count", "s1", "s2"])
                            nb = sum(r["bytes"] for r in rs)
                            if mode == "bytes" and nb != dataset_bytes:
                                raise NotExactlyOnce(f"{LABEL[ld]} ({w} workers, {row}) delivered {nb} "
                                                 f"bytes, not {dataset_bytes}")
                            secs = max(r["t1"] for r in rs) - min(r["t0"] for r in rs) if world > 1 \
                                else rs[0]["seconds"]
                            cpu = sum(r["cpu"] for r in rs)
                            val = {"seconds": secs, "cpu": cpu, "samples": n,
                                   "first_batch_s": max(r["first_batch_s"] or 0 for r in rs)}
                            msg = (f"{n / secs:9.0f} samples/s  CPU {cpu:6.2f} s  first batch "
                                   f"{val['first_batch_s'] * 1e3:7.1f} ms")
                        val["load1"] = load
                        record(row, cache, key, run, val)
                        log(f"{cache} {row:8s} run {run + 1}: {ld:12s} w{w}  {msg}  load {load:.1f}")
                    except RunFailed as e:
                        record(row, cache, key, run, {"failed": str(e), "load1": load})
                        log(f"{cache} {row:8s} run {run + 1}: {ld:12s} w{w}  FAILED {e}")
                    except NotExactlyOnce as e:
                        errors.append(str(e))
                        record(row, cache, key, run, {"failed": f"not exactly once: {e}", "load1": load})
                        log(f"{cache} {row:8s} run {run + 1}: {ld:12s} w{w}  ERROR {e}")
    report(results)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    if errors:
        print("\nERRORS (a loader that did not deliver every sample exactly once):")
        for e in errors:
            print(f"- {e}")
        return 1
    return 0


def versions():
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for p in ("kspeed", "mosaicml-streaming", "litdata", "webdataset", "ffcv", "torch", "torchvision", "torchdata",
              "simplejpeg", "numpy", "pillow"):
        try:
            out[p] = version(p)
        except PackageNotFoundError:
            pass
    return out


def report(res):
    """Prints the Markdown tables of a run's results (also --report FILE)."""
    n = res["images"]
    gb = res["dataset_bytes"] / 1e9
    runs_n = res["runs"]
    print(f"\n{n:,} JPEG files, {res['dataset_bytes'] / 1e6:,.0f} MB (mean {res['dataset_bytes'] / n / 1e3:.0f} KB), "
          f"batch {BATCH}, {runs_n} run(s) per row, one process per run, loaders rotated in each run; "
          f"{res['host']['cpus']} CPUs, load average {res['host']['load'][0]:.1f} at the start; "
          f"decoder {res['decode']}. Ratios: kspeed's (or a peer's) figure against the best peer's, "
          f"> 1 when it is better (faster, or less time); paired: the median of per-run ratios against "
          f"the best peer of the same run.")
    if res.get("versions"):
        print("Versions: " + ", ".join(f"{k} {v}" for k, v in res["versions"].items())
              + (f"; kspeed from commit {res['commit']}" if res.get("commit") else "") + ".")
    print()

    def med(xs):
        xs = [x for x in xs if x is not None]
        return statistics.median(xs) if xs else None

    def fmt(x, f="{:,.0f}"):
        return "FAIL" if x is None else f.format(x)

    def name(key, row):
        ld, w = key.split(":")
        if row == "convert":
            return {"mosaic": "Mosaic `MDSWriter`", "litdata": "LitData `optimize` (a worker per core)",
                    "wds": "WebDataset `ShardWriter`", "ffcv": "FFCV `DatasetWriter` (bytes and image files)",
                    "kspeed": "**kspeed preload**"}[ld]
        if ld == "kspeed-tier":
            return ("**kspeed, memory tier** (`tier_bytes` = the dataset; 2nd epoch of the process, which the "
                    "ring may partly hold already: a hand-out rate)")
        if ld.startswith("kspeed") and row != "decoded":
            return f"**{LABEL[ld]}**" + (" (`Loader`, in process)" if ld == "kspeed" else "")
        if ld in ("kspeed", "kspeed-tv"):
            dec = "the peers' torchvision decode" if ld == "kspeed-tv" else "simplejpeg"
            return (f"**{LABEL[ld]}** (`KSpeedImageFolder(decode=True, random_resized_crop=224)`: batches from "
                    f"its decode threads, {dec})")
        if ld.startswith("kspeed"):
            return f"kspeed, per sample (`KSpeedImageFolder(decode=True)` + the peers' crop, {w} DataLoader workers)"
        unit = "threads" if ld == "ffcv" else "workers"
        return f"{LABEL[ld]}, {w} {unit}"

    def table(row, title, metric, unit, higher_better, cols):
        rr = res["rows"].get(row)
        if not rr:
            return
        print(f"### {title}\n")
        print(f"| cache | {'converter' if row == 'convert' else 'loader'} | {unit}: median (runs) | "
              + " | ".join(c[0] for c in cols) + " | vs best peer (medians) | paired, per run |")
        print("|---|---|---:|" + "---:|" * len(cols) + "---:|---:|")
        for cache, keys in rr.items():
            per = {k: [metric(v) if v and "failed" not in v else None for v in vs] for k, vs in keys.items()}
            peers = [k for k in per if not k.startswith("kspeed")]

            def best_of(vals):
                vals = [v for v in vals if v is not None]
                if not vals:
                    return None
                return max(vals) if higher_better else min(vals)

            best_med = best_of([med(per[k]) for k in peers])
            best_run = [best_of([per[k][r] for k in peers]) for r in range(runs_n)]
            for k, vs in per.items():
                m = med(vs)
                good = [v for v in keys[k] if v and "failed" not in v]
                extra = [c[1](good) for c in cols]
                if m is None or best_med is None:
                    ratio = paired = "–"
                else:
                    ratio = f"{m / best_med if higher_better else best_med / m:.2f}×"
                    pr = [(v / b if higher_better else b / v) for v, b in zip(vs, best_run)
                          if v is not None and b is not None]
                    paired = f"{statistics.median(pr):.2f}×" if pr else "–"
                runs = ", ".join(fmt(v, "{:,.0f}" if abs(v or 0) >= 100 else "{:,.2f}") for v in vs)
                mm = fmt(m, "{:,.0f}" if m is not None and abs(m) >= 100 else "{:,.2f}")
                print(f"| {cache} | {name(k, row)} | {mm} ({runs}) | " + " | ".join(extra) + f" | {ratio} | {paired} |")
            for k, why in res.get("excluded", {}).get(row, {}).get(cache, {}).items():
                print(f"| {cache} | {name(k, row)} | {why} |" + " |" * (len(cols) + 2))
        for ld, why in res["unavailable"].items():
            print(f"| – | {LABEL[ld]} | {why} |" + " |" * (len(cols) + 2))
        print()

    def mean_of(key, f="{:.2f}", scale=1.0):
        def g(good):
            xs = [v[key] * scale for v in good if v.get(key) is not None]
            return f.format(statistics.median(xs)) if xs else "–"
        return g

    def cpu_per_gb(good):
        xs = [v["cpu"] / gb for v in good]
        return f"{statistics.median(xs):.2f}" if xs else "–"

    def gbps(good):
        xs = [res["dataset_bytes"] / v["seconds"] / 1e9 for v in good]
        return f"{statistics.median(xs):.2f}" if xs else "–"

    def cpu_ms_per_image(good):
        xs = [v["cpu"] / n * 1e3 for v in good]
        return f"{statistics.median(xs):.2f}" if xs else "–"

    table("convert", f"Conversion / preload of the {n:,} files (seconds, lower is better; includes a final sync)",
          lambda v: v["seconds"], "seconds", False,
          [("files/s", lambda g: f"{statistics.median([n / v['seconds'] for v in g]):,.0f}" if g else "–"),
           ("CPU s", mean_of("cpu")), ("MB written", mean_of("out_bytes", "{:,.0f}", 1e-6))])
    table("bytes", "Bytes only, one epoch, single rank (samples/s)", lambda v: n / v["seconds"], "samples/s", True,
          [("GB/s", gbps), ("CPU s/GB", cpu_per_gb), ("first batch ms", mean_of("first_batch_s", "{:.0f}", 1e3))])
    table("bytes2", "Bytes only, one epoch, 2 ranks on the node (samples/s, both ranks)", lambda v: n / v["seconds"],
          "samples/s", True, [("GB/s", gbps), ("CPU s/GB", cpu_per_gb)])
    cpus = res["host"]["cpus"]
    table("decoded", f"Decoded: decode ({res['decode']}) + RandomResizedCrop 224 + flip + float tensor (images/s)",
          lambda v: n / v["seconds"], "images/s", True,
          [("images/s per core", lambda g: f"{statistics.median([n / v['seconds'] / cpus for v in g]):,.0f}"
            if g else "–"), ("CPU ms/image", cpu_ms_per_image)])
    table("resume", f"Resume: time to the first batch after restoring a state saved at {res['resume_at']:.0%} of the "
          f"epoch, from the loader's construction ({res['resume_workers']} workers; ms, lower is better)", lambda v: v["first_batch_s"] * 1e3, "ms", False,
          [("loader built, ms", mean_of("built_s", "{:.1f}", 1e3)),
           ("state loaded, ms", mean_of("loaded_s", "{:.1f}", 1e3)), ("state bytes", mean_of("state_bytes", "{:,.0f}"))])
    if "resume" in res["rows"]:
        print("WebDataset, FFCV and the plain DataLoader: no state to resume from (not measured).\n")
    print("Goals (issue 32): bytes >= 1.5x the best peer, decoded >= 1.0x, preload >= 2x the fastest converter "
          "(the convert table's ratio), resume <= 10 ms.")


# ------------------------------------------------------------------ setup


def pip(py, *args):
    subprocess.run([py, "-m", "pip", "install", "-q", "--disable-pip-version-check", *args], check=True)


def setup(a):
    venv = a.venv
    py = os.path.join(venv, "bin", "python")
    base_py = os.path.join(a.base_venv, "bin", "python") if a.base_venv else None
    layered = bool(base_py and os.path.exists(base_py) and subprocess.run(
        [base_py, "-c", "import torch, torchvision, torchdata"], capture_output=True).returncode == 0)
    if not os.path.exists(py):
        interp = sys.executable
        if layered:
            # The base venv's own interpreter, so the .pth below matches its version.
            interp = subprocess.run([base_py, "-c", "import sys; print(sys._base_executable)"], check=True,
                                    capture_output=True, text=True).stdout.strip()
        log(f"setup: creating {venv} with {interp}")
        subprocess.run([interp, "-m", "venv", venv], check=True)
    site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], check=True,
                          capture_output=True, text=True).stdout.strip()
    pth = os.path.join(site, "_kspeed_base_venv.pth")
    if layered:
        base_site = subprocess.run([base_py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                   check=True, capture_output=True, text=True).stdout.strip()
        # Layered: torch and friends come from the project's venv (a .pth
        # line appends its site-packages after this venv's own, so what is
        # installed here wins, e.g. the numpy the peers pin).
        with open(pth, "w") as f:
            f.write(base_site + "\n")
        log(f"setup: layered on {a.base_venv} (torch, torchvision, torchdata from there)")
    else:
        log("setup: no base venv with torch: installing torch, torchvision, torchdata from PyPI (large)")
        pip(py, *TORCH_PKGS)
    # simplejpeg: kspeed's decoder for KSpeedImageFolder(random_resized_crop=)
    # (the torch extra's; kspeed itself is installed below without deps).
    pip(py, *PEER_PINS, "pillow", "simplejpeg")
    # FFCV: an sdist that compiles against the system's OpenCV 4 and
    # libjpeg-turbo (found with pkg-config).
    note = os.path.join(venv, "ffcv-not-installable.txt")
    if a.ffcv_system_deps:
        subprocess.run(["apt-get", "install", "-y", "-qq", "libopencv-dev", "libturbojpeg0-dev", "pkg-config"],
                       check=True)
    p = subprocess.run([py, "-m", "pip", "install", "--disable-pip-version-check", FFCV_PIN], capture_output=True,
                       text=True)
    if p.returncode == 0:
        log("setup: ffcv installed")
        if os.path.exists(note):
            os.remove(note)
    else:
        lines = (p.stdout + p.stderr).splitlines()
        errs = [ln.strip() for ln in lines if "Error" in ln and ln.strip()]
        why = errs[0] if errs else lines[-1] if lines else "failed"
        if "opencv" in why.lower() or "turbojpeg" in why.lower() or "pkg-config" in why.lower():
            reason = (f"`pip install {FFCV_PIN}` fails: FFCV ships only a source archive, whose setup.py needs the "
                      f"system's OpenCV 4 and libjpeg-turbo through pkg-config: {why}"
                      " (`--setup --ffcv-system-deps` installs them with apt-get)")
        else:
            reason = f"`pip install {FFCV_PIN}` fails: {why} (the whole output: {venv}/ffcv-install.log)"
        with open(note, "w") as f:
            f.write(reason + "\n")
        with open(os.path.join(venv, "ffcv-install.log"), "w") as f:
            f.write(p.stdout + p.stderr)
        log(f"setup: FFCV not installable: {reason}")
    if a.wheel:
        pip(py, "--force-reinstall", "--no-deps", a.wheel)
    else:
        pip(py, "maturin>=1.5,<2")
        # maturin's command may be the base venv's (layered: pip found it there).
        bins = [os.path.join(venv, "bin")] + ([os.path.join(a.base_venv, "bin")] if layered else [])
        env = dict(os.environ, PATH=os.pathsep.join(bins + [os.environ.get("PATH", "")]))
        subprocess.run([py, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-build-isolation",
                        "--force-reinstall", "--no-deps", os.path.join(ROOT, "ffi", "python")], check=True, env=env)
    subprocess.run([py, "-c", "import kspeed, streaming, litdata, webdataset, torch, torchvision, torchdata;"
                    "print('setup: kspeed', kspeed.__version__, '| mosaicml-streaming', streaming.__version__,"
                    "'| litdata', litdata.__version__, '| webdataset', webdataset.__version__, '| torch',"
                    "torch.__version__, '| torchvision', torchvision.__version__)"], check=True)
    log(f"setup: done; run {py} {os.path.relpath(__file__)} (or the script directly: it re-executes with that python)")


def have_peers():
    try:
        import kspeed  # noqa: F401
        import litdata  # noqa: F401
        import streaming  # noqa: F401
        import torchdata  # noqa: F401
        import webdataset  # noqa: F401

        return True
    except ImportError:
        return False


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=20000, help="JPEG files in the dataset (default 20,000)")
    ap.add_argument("--data", default="/var/tmp/kspeed-peers", help="where the files and every format are kept")
    ap.add_argument("--runs", type=int, default=5, help="repetitions of every row (default 5)")
    ap.add_argument("--cache", default="cold,warm", help="cold, warm or both (default cold,warm)")
    ap.add_argument("--rows", default="convert,bytes,bytes2,decoded,resume",
                    help="default: convert,bytes,bytes2,decoded,resume")
    ap.add_argument("--loaders", default=",".join(LOADERS), help="default: " + ",".join(LOADERS))
    ap.add_argument("--workers", default="0,2", help="worker counts tried for each peer (default 0,2)")
    ap.add_argument("--workers-of", default="", metavar="LOADER=N[+N],...",
                    help="worker counts of some loaders instead of --workers, e.g. mosaic=2,litdata=0+2")
    ap.add_argument("--kspeed-decoded", default="kspeed,kspeed-tv,kspeed-samples",
                    help="kspeed's decoded rows (default: kspeed,kspeed-tv,kspeed-samples)")
    ap.add_argument("--decode", choices=["torchvision", "pil"], default="torchvision")
    ap.add_argument("--torch-threads", type=int, default=1,
                    help="torch intra-op threads of each run's process (0: torch's default; workers use 1)")
    ap.add_argument("--resume-at", type=float, default=0.5, help="fraction of the epoch where the state is saved")
    ap.add_argument("--resume-workers", type=int, default=0)
    ap.add_argument("--kspeed-opts", default="{}",
                    help='extra kspeed.Loader/KSpeedImageFolder arguments as JSON, e.g. \'{"mlock": false}\' '
                         '(default: none: kspeed\'s defaults, the ring sized from the batch)')
    ap.add_argument("--no-verify", action="store_true", help="skip the untimed exactly-once passes")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds a run may take")
    ap.add_argument("--json", default=None, help="write every run's numbers here")
    ap.add_argument("--report", default=None, metavar="JSON", help="print the tables of a --json file, run nothing")
    ap.add_argument("--setup", action="store_true", help="create/update the venv with the peers and kspeed, then exit")
    ap.add_argument("--venv", default=DEFAULT_VENV)
    ap.add_argument("--base-venv", default=DEFAULT_BASE, help="venv with torch to layer on ('' for none)")
    ap.add_argument("--wheel", default=None, help="install this kspeed wheel instead of building ./ffi/python")
    ap.add_argument("--ffcv-system-deps", action="store_true",
                    help="with --setup: apt-get install FFCV's build dependencies first")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        return child_main(json.loads(a.one))
    if a.setup:
        return setup(a)
    if a.report:
        with open(a.report) as f:
            report(json.load(f))
        return 0
    if not have_peers():
        py = os.path.join(a.venv, "bin", "python")
        if os.path.exists(py) and os.path.realpath(sys.prefix) != os.path.realpath(a.venv) \
                and not os.environ.get("KSPEED_PEERS_REEXEC"):
            os.environ["KSPEED_PEERS_REEXEC"] = "1"
            os.execv(py, [py, os.path.abspath(__file__)] + sys.argv[1:])
        sys.exit(f"bench_peers: this python lacks the peers; run {sys.argv[0]} --setup first")
    return main_bench(a)


if __name__ == "__main__":
    sys.exit(main())
