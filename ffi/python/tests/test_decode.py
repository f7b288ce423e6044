"""KSpeedImageFolder's decoded batches (decode + RandomResizedCrop + flip +
to tensor in kspeed's threads; decode="cuda" through nvJPEG): real JPEG
files written by Pillow, real torch and torchvision, no mocks."""

import os

import numpy as np
import pytest

import kspeed
from conftest import cli, require

require("torch")
require("torchvision")
require("PIL")
import torch  # noqa: E402
from PIL import Image  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from kspeed import _decode  # noqa: E402
from kspeed.torch import KSpeedImageFolder  # noqa: E402

# Sizes (width, height): small ones the crop upsamples, ImageNet-like ones,
# and large ones whose crops allow a 1/2 or 1/4 DCT-scaled decode.
SIZES = [(500, 375), (375, 500), (120, 90), (640, 480), (1000, 750), (1600, 1200), (333, 250), (460, 460)]
N = 40
CLASSES = ("cat", "dog", "eel")


def smooth_image(i, w, h, mode):
    """Smooth content (gradients and a few soft discs): decoders at other
    DCT scales stay close to the full-size decode on it."""
    rng = np.random.default_rng(i)
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    img = np.zeros((h, w, 3), np.float32)
    for c in range(3):
        a, b = rng.uniform(-1, 1, 2)
        img[..., c] = 128 + 90 * np.sin(a * x / w * 3 + b * y / h * 3 + c)
    for _ in range(4):
        cx, cy, r = rng.uniform(0, w), rng.uniform(0, h), rng.uniform(0.1, 0.4) * min(w, h)
        img += (40 * np.exp(-((x - cx) ** 2 + (y - cy) ** 2) / (2 * r * r)))[..., None] * rng.uniform(-1, 1, 3)
    im = Image.fromarray(np.clip(img, 0, 255).astype(np.uint8))
    return im.convert(mode) if mode != "RGB" else im


@pytest.fixture(scope="module")
def jpeg_space(tmp_path_factory):
    """An ImageFolder of N real JPEGs (a grayscale one, a CMYK one and a PNG
    among them), preloaded with the CLI."""
    src = tmp_path_factory.mktemp("jpegs")
    for i in range(N):
        w, h = SIZES[i % len(SIZES)]
        mode = {7: "L", 13: "CMYK"}.get(i, "RGB")
        d = src / CLASSES[i % len(CLASSES)]
        d.mkdir(exist_ok=True)
        im = smooth_image(i, w, h, mode)
        if i == 21:
            im.save(d / f"{i:03d}.png")
        else:
            im.save(d / f"{i:03d}.jpg", quality=90)
    sp = tmp_path_factory.mktemp("sp") / "space"
    cli("preload", "--source", src, "--space", sp)
    return str(sp)


def epoch_of(space, **kw):
    """{id: (image, label)} of one pass, and the batches' sizes."""
    kw = dict({"decode": True, "random_resized_crop": 224, "batch_size": 8, "seed": 5, "ring_bytes": "8MiB",
               "return_id": True}, **kw)
    epoch = kw.pop("epoch", None)
    ds = KSpeedImageFolder(space, **kw)
    if epoch is not None:
        ds.set_epoch(epoch)
    out, sizes = {}, []
    for images, labels, ids in ds:
        sizes.append(images.shape[0])
        for img, y, i in zip(images, labels.tolist(), ids.tolist()):
            assert i not in out, f"sample {i} came twice"
            out[i] = (img, y)
    ds.close()
    return out, sizes


@pytest.mark.parametrize("decoder", ["simplejpeg", "pil", "torchvision"])
def test_batches_have_the_exact_shape_dtype_and_every_sample_once(jpeg_space, decoder):
    if decoder == "simplejpeg":
        require("simplejpeg")
    cat = kspeed.Catalog.open(jpeg_space)
    ds = KSpeedImageFolder(jpeg_space, decode=True, random_resized_crop=224, batch_size=8, seed=1, ring_bytes="8MiB",
                           decoder=decoder)
    seen = []
    for images, labels in ds:
        assert images.dtype == torch.float32 and images.device.type == "cpu"
        assert tuple(images.shape[1:]) == (3, 224, 224) and images.is_contiguous()
        assert labels.dtype == torch.int64 and labels.shape == (images.shape[0],)
        assert float(images.min()) >= 0.0 and float(images.max()) <= 1.0
        assert images.is_pinned() == torch.cuda.is_available()
        seen += labels.tolist()
    assert sorted(seen) == sorted(np.asarray(cat.labels).tolist())
    out, sizes = epoch_of(jpeg_space, decoder=decoder, random_resized_crop=(96, 128), dtype=torch.uint8,
                          batch_size=16)
    assert sizes == [16, 16, 8] and sorted(out) == list(range(N))
    for img, _ in out.values():
        assert img.dtype == torch.uint8 and tuple(img.shape) == (3, 96, 128)


def test_same_seed_same_tensors_whatever_the_threads_and_prefetch(jpeg_space):
    a, _ = epoch_of(jpeg_space, decode_threads=1, prefetch_batches=0)
    b, _ = epoch_of(jpeg_space, decode_threads=3, prefetch_batches=3, batch_size=5)
    assert sorted(a) == sorted(b) == list(range(N))
    for i in a:
        assert torch.equal(a[i][0], b[i][0]), f"sample {i} differs between runs with the same seed"
        assert a[i][1] == b[i][1]
    # Another epoch or seed draws other crops.
    c, _ = epoch_of(jpeg_space, epoch=1)
    d, _ = epoch_of(jpeg_space, seed=6)
    assert sum(not torch.equal(a[i][0], c[i][0]) for i in a) > N // 2
    assert sum(not torch.equal(a[i][0], d[i][0]) for i in a) > N // 2


def test_torchvision_decoder_is_torchvisions_resized_crop_exactly(jpeg_space):
    """decoder="torchvision": the pixels of torchvision's own decode_jpeg +
    resized_crop(antialias) + hflip + to_dtype for the same crop box."""
    from torchvision.io import ImageReadMode, decode_image
    from torchvision.transforms.v2 import functional as TF

    cat = kspeed.Catalog.open(jpeg_space)
    got, _ = epoch_of(jpeg_space, decoder="torchvision", seed=9, epoch=2)
    for i, (img, _) in got.items():
        full = decode_image(torch.frombuffer(bytearray(cat.read_source(i)), dtype=torch.uint8),
                            mode=ImageReadMode.RGB)
        (top, left, h, w), flip = _decode.Spec(224, (0.08, 1.0), (3 / 4, 4 / 3), 0.5, torch.float32,
                                               9).box_and_flip(full.shape[1], full.shape[2], 2, i)
        want = TF.resized_crop(full, top, left, h, w, [224, 224], antialias=True)
        if flip:
            want = TF.horizontal_flip(want)
        want = TF.to_dtype(want, torch.float32, scale=True)
        assert torch.equal(img, want), f"sample {i}: max difference {float((img - want).abs().max())}"


@pytest.mark.parametrize("decoder", ["simplejpeg", "pil"])
def test_reduced_size_decode_sees_the_same_crop(jpeg_space, decoder):
    """The DCT-scaled decoders crop the same box: close to the full-size
    decode's pixels (same geometry, other filtering), and some samples of
    the large images were decoded at 1/2 or less."""
    if decoder == "simplejpeg":
        require("simplejpeg")
    ref, _ = epoch_of(jpeg_space, decoder="torchvision")
    got, _ = epoch_of(jpeg_space, decoder=decoder)
    cat = kspeed.Catalog.open(jpeg_space)
    spec = _decode.Spec(224, (0.08, 1.0), (3 / 4, 4 / 3), 0.5, torch.float32, 5)
    scaled = 0
    for i in ref:
        w, h = Image.open(cat.path(i)).size
        (_, _, bh, bw), _ = spec.box_and_flip(h, w, 0, i)
        scaled += _decode.dct_scale(bh, bw, (224, 224)) > 1
        diff = (got[i][0] - ref[i][0]).abs().mean().item()
        assert diff < 0.02, f"sample {i} ({w}x{h}): mean difference {diff:.4f} from the full-size decode"
    assert scaled >= 3, "no sample was decoded at a reduced DCT scale"


def test_resume_mid_epoch_gives_the_rest_with_the_same_tensors(jpeg_space):
    whole, _ = epoch_of(jpeg_space)
    kw = dict(decode=True, random_resized_crop=224, batch_size=8, seed=5, ring_bytes="8MiB", return_id=True)
    ds = KSpeedImageFolder(jpeg_space, **kw)
    it = iter(ds)
    first = [next(it) for _ in range(2)]
    state = ds.state_dict()
    del it
    ds.close()
    ds2 = KSpeedImageFolder(jpeg_space, **kw)
    ds2.load_state_dict(state)
    rest = list(ds2)
    ids = [i for _, _, b in first + rest for i in b.tolist()]
    assert sorted(ids) == list(range(N))
    for images, _, b in first + rest:
        for img, i in zip(images, b.tolist()):
            assert torch.equal(img, whole[i][0])


@pytest.mark.parametrize("workers", [0, 2])
def test_in_a_dataloader_every_sample_once_and_len_is_exact(jpeg_space, workers):
    ds = KSpeedImageFolder(jpeg_space, decode=True, random_resized_crop=64, batch_size=6, seed=2, ring_bytes="8MiB",
                           return_id=True)
    dl = DataLoader(ds, batch_size=None, num_workers=workers)
    batches = list(dl)
    assert len(dl) == len(batches)
    ids = [i for _, _, b in batches for i in b.tolist()]
    assert sorted(ids) == list(range(N))
    assert all(tuple(img.shape[1:]) == (3, 64, 64) for img, _, _ in batches)


def test_a_ring_that_holds_few_batches_still_pipelines(jpeg_space):
    """More batches asked to decode ahead than the ring (or
    batches_in_flight) can hold: the oldest is let go of the ring first,
    nothing fails and nothing is lost."""
    out, _ = epoch_of(jpeg_space, prefetch_batches=8, batches_in_flight=2, batch_size=4)
    assert sorted(out) == list(range(N))


def test_a_corrupt_jpeg_names_the_sample(tmp_path):
    src = tmp_path / "src" / "a"
    src.mkdir(parents=True)
    smooth_image(0, 64, 48, "RGB").save(src / "good.jpg")
    (src / "bad.jpg").write_bytes(b"\xff\xd8\xff\xe0" + os.urandom(3000))
    sp = tmp_path / "sp"
    cli("preload", "--source", src.parent, "--space", sp)
    bad = [i for i in range(2) if kspeed.Catalog.open(str(sp)).path(i).endswith("bad.jpg")][0]
    ds = KSpeedImageFolder(str(sp), decode=True, random_resized_crop=32, batch_size=2, ring_bytes="1MiB")
    with pytest.raises(RuntimeError, match=f"decoding sample {bad} failed"):
        list(ds)


def test_arguments_that_cannot_work_are_refused_by_name(jpeg_space):
    def make(**kw):
        return KSpeedImageFolder(jpeg_space, ring_bytes="8MiB", **kw)

    with pytest.raises(ValueError, match="give decode=True"):
        make(random_resized_crop=224)
    with pytest.raises(ValueError, match="needs random_resized_crop"):
        make(decode="cpu")
    with pytest.raises(ValueError, match="no per-sample transform"):
        make(decode=True, random_resized_crop=224, transform=lambda t: t)
    with pytest.raises(ValueError, match="decoder must be one of"):
        make(decode=True, random_resized_crop=224, decoder="libjpeg")
    with pytest.raises(ValueError, match="hflip"):
        make(decode=True, random_resized_crop=224, hflip=2)
    with pytest.raises(ValueError, match="decode must be"):
        make(decode="gpu", random_resized_crop=224)
    ds = make(decode=True, random_resized_crop=224)
    with pytest.raises(TypeError, match="batches_per_epoch"):
        len(ds)
    assert ds.batches_per_epoch() == -(-N // 64)


def test_cuda_decode_or_its_clear_error_and_the_cpu_fallback(jpeg_space):
    """Without a GPU: decode="cuda" and pin_memory=True fail saying why,
    and decode="auto" decodes on the CPU's threads. With one: decode="cuda"
    yields CUDA batches close to the CPU's (same crops, nvJPEG's pixels)."""
    cpu, _ = epoch_of(jpeg_space, decoder="torchvision")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match=r"torch.cuda.is_available\(\) is False.*decode=True"):
            KSpeedImageFolder(jpeg_space, decode="cuda", random_resized_crop=224, ring_bytes="8MiB")
        with pytest.raises(ValueError, match="pin_memory=True needs CUDA"):
            KSpeedImageFolder(jpeg_space, decode=True, random_resized_crop=224, pin_memory=True, ring_bytes="8MiB")
        auto, _ = epoch_of(jpeg_space, decode="auto", decoder=None)
        assert sorted(auto) == list(range(N))
        assert all(img.device.type == "cpu" for img, _ in auto.values())
        return
    gpu, _ = epoch_of(jpeg_space, decode="cuda")
    assert sorted(gpu) == list(range(N))
    for i, (img, y) in gpu.items():
        assert img.device.type == "cuda" and img.dtype == torch.float32 and tuple(img.shape) == (3, 224, 224)
        assert y == cpu[i][1]
        diff = (img.cpu() - cpu[i][0]).abs().mean().item()
        assert diff < 0.02, f"sample {i}: nvJPEG's batch differs from the CPU's by {diff:.4f} on average"
