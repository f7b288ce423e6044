"""Batched image decoding for :class:`kspeed.torch.KSpeedImageFolder`
(``random_resized_crop=``): decode + RandomResizedCrop + horizontal flip +
to tensor, written straight into one (pinned) batch tensor.

CPU (``decode=True``): a pool of threads inside the training process, each
decoding whole samples from views over the landing ring (no copy of the
JPEG bytes, no worker processes, no pickling of batches). Every decoder used
here releases the GIL while it decodes, and so does torch while it resizes,
so the threads run in parallel. Decoders, best first (``decoder=``):

- ``"simplejpeg"`` (libjpeg-turbo, PyPI ``simplejpeg``): reads the header,
  draws the crop, then decodes at the smallest power-of-two DCT scale
  (1/2, 1/4, 1/8) at which the crop is still at least the output size on
  both sides;
- ``"pil"`` (Pillow, libjpeg-turbo): the same reduced-size decode through
  ``Image.draft()``;
- ``"torchvision"``: ``torchvision.io.decode_jpeg`` at full size (no DCT
  scaling), the decoder of ``decode=True`` without a crop.

What the crop sees with a reduced-size decode: the crop box is drawn on the
full image (the same distribution as ``torchvision.transforms.v2.
RandomResizedCrop``), then scaled to the decoded image (rounded to whole
pixels there, so the box may move by less than one decoded pixel) and
resized to the output with the same antialiased bilinear filter. The
pixels are those of libjpeg-turbo's scaled IDCT instead of an antialiased
bilinear reduction of the full image: a few levels apart, not a different
crop. Scales 7/8 .. 5/8 are never used: on ~400 px JPEGs they cost more
CPU than a full decode (measured: 1.60 against 1.24 ms per image).

CUDA (``decode="cuda"``): each batch goes whole to nvJPEG through
``torchvision.io.decode_jpeg(list, device="cuda")``, straight from the
landing ring (registered with CUDA as pinned memory when the loader's
``cuda`` option finds the driver); crop, resize, flip and conversion run on
the GPU and the batch tensor is in GPU memory.

The crop and flip of a sample depend only on (seed, epoch, sample id):
every run, worker count, thread count and world size gives the same tensor
for the same sample (see :func:`sample_rng`).
"""

import io
import math
import os
import random
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import warnings

import numpy as np
import torch
import torch.nn.functional as F

DECODERS = ("simplejpeg", "pil", "torchvision")

# Tensors over read-only arrays (ring views, Pillow's pixels) are only read
# here: torch's warning about them says nothing to the user.
warnings.filterwarnings("ignore", message="The given NumPy array is not writable", module=r"kspeed\._decode")
_MASK = (1 << 64) - 1


def _mix64(x):
    """SplitMix64's finaliser."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def sample_rng(seed, epoch, sample_id):
    """The random source of one sample's crop and flip: a function of the
    job's seed, the epoch and the sample's catalog id only."""
    return random.Random(_mix64(_mix64(_mix64(seed & _MASK) ^ epoch) ^ sample_id))


def rrc_params(height, width, rng, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)):
    """(top, left, h, w) of a RandomResizedCrop box: the algorithm of
    ``torchvision.transforms.v2.RandomResizedCrop.make_params`` (10 tries,
    then the central crop), drawn from ``rng``."""
    area = height * width
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target_area = area * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(log_ratio[0], log_ratio[1]))
        w = int(round(math.sqrt(target_area * aspect)))
        h = int(round(math.sqrt(target_area / aspect)))
        if 0 < w <= width and 0 < h <= height:
            return rng.randint(0, height - h), rng.randint(0, width - w), h, w
    in_ratio = width / height
    if in_ratio < min(ratio):
        w = width
        h = int(round(w / min(ratio)))
    elif in_ratio > max(ratio):
        h = height
        w = int(round(h * max(ratio)))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def dct_scale(h, w, size):
    """The largest power-of-two reduction (1, 2, 4 or 8) that keeps an
    ``h`` x ``w`` crop at least ``size`` (out_h, out_w) on both sides."""
    d = 1
    while d < 8 and h // (2 * d) >= size[0] and w // (2 * d) >= size[1]:
        d *= 2
    return d


def _have(mod):
    try:
        __import__(mod)
        return True
    except ImportError:
        return False


def pick_decoder(name=None):
    """The CPU decoder for ``decoder=name`` (None: the best installed)."""
    if name is None:
        for d in DECODERS:
            if _have({"pil": "PIL"}.get(d, d)):
                return d
        raise ImportError("decode with random_resized_crop needs simplejpeg, Pillow or torchvision "
                          "(pip install 'kspeed[torch]' installs simplejpeg)")
    if name not in DECODERS:
        raise ValueError(f"decoder must be one of {', '.join(DECODERS)} or None, not {name!r}")
    if not _have({"pil": "PIL"}.get(name, name)):
        raise ImportError(f"decoder={name!r} but {name} is not installed")
    return name


class Spec:
    """What each sample becomes: a ``size`` crop of the image (drawn as
    RandomResizedCrop with ``scale`` and ``ratio``), flipped with
    probability ``hflip``, as ``dtype`` (float: scaled to [0, 1]; uint8:
    the pixel values)."""

    def __init__(self, size, scale, ratio, hflip, dtype, seed):
        if isinstance(size, int):
            size = (size, size)
        size = tuple(int(s) for s in size)
        if len(size) != 2 or min(size) < 1:
            raise ValueError(f"random_resized_crop must be a positive int or (height, width), not {size!r}")
        scale, ratio = tuple(map(float, scale)), tuple(map(float, ratio))
        if len(scale) != 2 or not 0 < scale[0] <= scale[1]:
            raise ValueError(f"crop_scale must be (min, max) with 0 < min <= max, not {scale!r}")
        if len(ratio) != 2 or not 0 < ratio[0] <= ratio[1]:
            raise ValueError(f"crop_ratio must be (min, max) with 0 < min <= max, not {ratio!r}")
        if not 0.0 <= float(hflip) <= 1.0:
            raise ValueError(f"hflip is a probability in [0, 1], not {hflip!r}")
        if dtype not in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.uint8):
            raise ValueError(f"dtype must be a float dtype or torch.uint8, not {dtype!r}")
        self.size, self.scale, self.ratio, self.hflip, self.dtype = size, scale, ratio, float(hflip), dtype
        self.seed = int(seed)

    def box_and_flip(self, height, width, epoch, sample_id):
        rng = sample_rng(self.seed, epoch, sample_id)
        box = rrc_params(height, width, rng, self.scale, self.ratio)
        return box, rng.random() < self.hflip

    def finish(self, crop, flip, out):
        """Resizes ``crop`` (uint8 CHW, any strides, on any device) into
        ``out`` (CHW of self.dtype): antialiased bilinear, as
        torchvision's resized_crop on uint8; then flip and scale."""
        if crop.device.type == "cpu":
            r = F.interpolate(crop.unsqueeze(0), size=self.size, mode="bilinear", antialias=True,
                              align_corners=False)[0]
        else:
            # No uint8 antialiased resize on CUDA: float, then back to the
            # uint8 levels the CPU path produces.
            r = F.interpolate(crop.unsqueeze(0).float(), size=self.size, mode="bilinear", antialias=True,
                              align_corners=False)[0].round_().clamp_(0, 255)
        if flip:
            r = r.flip(-1)
        if self.dtype == torch.uint8:
            out.copy_(r)
        else:
            # One pass, the same values as torchvision's to_dtype(scale=True)
            # (r.to(float).mul_(1 / 255)).
            torch.mul(r, 1.0 / 255, out=out)


def _crop_of(arr, box, full_hw):
    """The box (drawn on the full image) in a decoded HWC uint8 array,
    which may be a DCT-scaled decode: as a CHW tensor view."""
    top, left, h, w = box
    H, W = full_hw
    ah, aw = arr.shape[0], arr.shape[1]
    if (ah, aw) != (H, W):
        fy, fx = ah / H, aw / W
        t0, l0 = min(ah - 1, int(round(top * fy))), min(aw - 1, int(round(left * fx)))
        top, left = t0, l0
        h, w = max(1, min(ah - t0, int(round(h * fy)))), max(1, min(aw - l0, int(round(w * fx))))
    return torch.from_numpy(arr[top:top + h, left:left + w]).permute(2, 0, 1)


class _Cpu:
    """Decodes one sample into its slot of the batch tensor, in a pool thread."""

    def __init__(self, spec, decoder):
        self.spec = spec
        self.decoder = decoder
        if decoder == "simplejpeg":
            import simplejpeg

            self.sj = simplejpeg
        if decoder == "torchvision":
            from torchvision.io import ImageReadMode, decode_image, decode_jpeg

            self.tv = (decode_jpeg, decode_image, ImageReadMode.RGB)

    def one(self, buf, epoch, sid, out):
        spec = self.spec
        if self.decoder == "simplejpeg":
            try:
                H, W, _, _ = self.sj.decode_jpeg_header(buf)
            except ValueError:
                return self._pil(buf, epoch, sid, out)  # not a JPEG (PNG, ...)
            box, flip = spec.box_and_flip(H, W, epoch, sid)
            d = dct_scale(box[2], box[3], spec.size)
            try:
                if d > 1:
                    arr = self.sj.decode_jpeg(buf, colorspace="RGB", min_height=-(-H // d), min_width=-(-W // d))
                else:
                    arr = self.sj.decode_jpeg(buf, colorspace="RGB")
            except ValueError:
                return self._pil(buf, epoch, sid, out)  # a JPEG libturbojpeg cannot convert (CMYK)
            spec.finish(_crop_of(arr, box, (H, W)), flip, out)
        elif self.decoder == "pil":
            self._pil(buf, epoch, sid, out)
        else:
            decode_jpeg, decode_image, rgb = self.tv
            t = torch.from_numpy(buf)
            try:
                img = decode_jpeg(t, mode=rgb)
            except RuntimeError:
                img = decode_image(t, mode=rgb)
            box, flip = spec.box_and_flip(img.shape[1], img.shape[2], epoch, sid)
            top, left, h, w = box
            spec.finish(img[:, top:top + h, left:left + w], flip, out)

    def _pil(self, buf, epoch, sid, out):
        from PIL import Image

        im = Image.open(io.BytesIO(buf))
        W, H = im.size
        box, flip = self.spec.box_and_flip(H, W, epoch, sid)
        d = dct_scale(box[2], box[3], self.spec.size)
        if d > 1 and im.format == "JPEG":
            im.draft("RGB", (-(-W // d), -(-H // d)))
        if im.mode != "RGB":
            im = im.convert("RGB")
        self.spec.finish(_crop_of(np.asarray(im), box, (H, W)), flip, out)


def _thread_init():
    # One intra-op thread per decode thread: each pool thread would
    # otherwise start its own OpenMP team of one thread per core.
    torch.set_num_threads(1)


class _Handle:
    """One batch being decoded: its output tensor, and the ring views its
    decode still reads (dropped by :meth:`release_inputs`)."""

    __slots__ = ("out", "futs", "ids", "views", "event")

    def __init__(self, out, futs, ids, views, event=None):
        self.out, self.futs, self.ids, self.views, self.event = out, futs, ids, views, event

    def release_inputs(self):
        """Waits until the decode has read every input, then drops the
        views (the batch's ring space can go back)."""
        if self.views is None:
            return False
        if self.event is not None:
            self.event.synchronize()
        for f in self.futs:
            f.exception()  # waits; errors are raised by result()
        self.views = None
        return True

    def result(self):
        self.release_inputs()
        for i, f in enumerate(self.futs):
            e = f.exception()
            if e is not None:
                raise RuntimeError(f"decoding sample {self.ids[i]} failed: {type(e).__name__}: {e}") from e
        return self.out


class CpuBatches:
    """Decodes kspeed batches into batch tensors on ``threads`` threads."""

    def __init__(self, spec, decoder, threads, pin_memory):
        self.spec, self.pin = spec, pin_memory
        self.cpu = _Cpu(spec, decoder)
        self.pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="kspeed-decode", initializer=_thread_init)

    def submit(self, b, lo, k):
        """Starts decoding samples lo..k of batch ``b``; returns a _Handle."""
        views = b.samples()[lo:k]
        ids = b.ids[lo:k].tolist()
        epoch = b.epoch
        h, w = self.spec.size
        out = torch.empty((k - lo, 3, h, w), dtype=self.spec.dtype, pin_memory=self.pin)
        h = _Handle(out, [], ids, views)
        # The task reaches its view through the handle: once the handle
        # drops its views no finished task keeps one (a pool's work item
        # keeps its arguments a moment after its future is done).
        h.futs = [self.pool.submit(self._task, h, i, epoch) for i in range(k - lo)]
        return h

    def _task(self, h, i, epoch):
        self.cpu.one(h.views[i], epoch, h.ids[i], h.out[i])

    def close(self):
        self.pool.shutdown(wait=True, cancel_futures=True)


class CudaBatches:
    """Decodes each kspeed batch whole with nvJPEG on ``device``."""

    def __init__(self, spec, device):
        from torchvision.io import ImageReadMode, decode_image, decode_jpeg

        self.spec, self.device = spec, device
        self.decode_jpeg, self.decode_image, self.rgb = decode_jpeg, decode_image, ImageReadMode.RGB

    def submit(self, b, lo, k):
        datas = [torch.from_dlpack(b.sample_dlpack(i)) for i in range(lo, k)]
        ids = b.ids[lo:k].tolist()
        epoch = b.epoch
        try:
            imgs = self.decode_jpeg(datas, mode=self.rgb, device=self.device)
        except RuntimeError:
            # A sample nvJPEG refuses (not a JPEG, CMYK): that one on the CPU.
            imgs = []
            for t in datas:
                try:
                    imgs.append(self.decode_jpeg(t, mode=self.rgb, device=self.device))
                except RuntimeError:
                    imgs.append(self.decode_image(t, mode=self.rgb).to(self.device))
        h, w = self.spec.size
        out = torch.empty((k - lo, 3, h, w), dtype=self.spec.dtype, device=self.device)
        for i, img in enumerate(imgs):
            box, flip = self.spec.box_and_flip(img.shape[1], img.shape[2], epoch, ids[i])
            top, left, bh, bw = box
            self.spec.finish(img[:, top:top + bh, left:left + bw], flip, out[i])
        ev = torch.cuda.Event()
        ev.record()
        # Copies from the ring may still run: the views (which hold the
        # batch) live until the event has passed.
        return _Handle(out, [], ids, datas, ev)

    def close(self):
        pass


def cuda_device(decode):
    """The torch device for ``decode="cuda"`` / ``"cuda:N"``, or a clear
    error where CUDA or nvJPEG is missing."""
    if not torch.cuda.is_available():
        raise RuntimeError(
            f"decode={decode!r} needs a CUDA device, and torch.cuda.is_available() is False here "
            f"(torch {torch.__version__}, built with CUDA {torch.version.cuda}); use decode=True to decode on the "
            f"CPU's threads, or decode='auto' for CUDA where there is one and the CPU elsewhere")
    dev = torch.device(decode)
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    import torchvision  # noqa: F401

    if not hasattr(torch.ops.image, "decode_jpegs_cuda"):
        raise RuntimeError(f"decode={decode!r}: this torchvision ({torchvision.__version__}) has no nvJPEG "
                           f"decoder (torch.ops.image.decode_jpegs_cuda)")
    return dev


def default_threads(workers):
    """Decode threads per process: the CPUs this process may use, shared
    between DataLoader workers."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    return max(1, n // max(1, workers))


def pipelined(batches, decoder, depth):
    """Yields (tensor, labels, ids, start) for each (b, lo, k, start) of
    the generator ``batches(room)``, in order, with up to ``depth``
    batches decoding ahead. ``room()`` (for the generator, when the ring or
    ``batches_in_flight`` has no room for the next batch) waits until the
    oldest batch still reading the ring is done with it and lets it go."""
    inflight = deque()

    def room():
        for h, *_ in inflight:
            if h.release_inputs():
                return True
        return False

    try:
        for b, lo, k, start in batches(room):
            if lo >= k:
                continue
            labels = torch.from_numpy(b.labels[lo:k].copy())
            ids = torch.from_numpy(b.ids[lo:k].copy())
            inflight.append((decoder.submit(b, lo, k), labels, ids, start, k))
            del b
            if len(inflight) > depth:
                h, labels, ids, start, k = inflight.popleft()
                yield h.result(), labels, ids, start, k
        while inflight:
            h, labels, ids, start, k = inflight.popleft()
            yield h.result(), labels, ids, start, k
    finally:
        inflight.clear()
        decoder.close()
