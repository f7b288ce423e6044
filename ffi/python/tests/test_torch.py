"""PyTorch: DLPack into torch, KSpeedDataset in a DataLoader with and without
worker processes (fork), resume, and JPEG decoding of real images."""

import io
import multiprocessing
import os

import numpy as np
import pytest

import kspeed
from conftest import cli, require

require("torch")
import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from kspeed.torch import KSpeedDataset, KSpeedImageFolder  # noqa: E402


def rank_sequence(space, epoch, **kw):
    kw.setdefault("ring_bytes", "256KiB")
    with kspeed.Loader(space, **kw) as l:
        l.set_epoch(epoch)
        return [i for b in l for i in b.ids.tolist()]


def test_torch_from_dlpack_is_zero_copy_and_keeps_the_batch(space):
    cat = kspeed.Catalog.open(space)
    loader = kspeed.Loader(space, batch_size=8, ring_bytes="4MiB")
    b = loader.next_batch()
    t = torch.from_dlpack(b)
    a = b.array()
    assert t.dtype == torch.uint8 and t.device.type == "cpu"
    assert t.data_ptr() == a.__array_interface__["data"][0], "torch copied the batch"
    ids, offs, lens = b.ids.tolist(), b.offsets.tolist(), b.lengths.tolist()
    s3 = torch.from_dlpack(b.sample_dlpack(3))
    assert bytes(s3.numpy()) == cat.read_source(ids[3])
    del a, b
    # The tensors alone keep the batch: it is still out, and reading on
    # does not touch it.
    for _ in range(5):
        loader.next_batch()
    for sid, o, n in zip(ids, offs, lens):
        assert bytes(t[o: o + n].numpy()) == cat.read_source(sid)
    del t, s3


@pytest.mark.parametrize("workers", [0, 2])
def test_dataset_in_a_dataloader_delivers_the_rank_sequence(space, workers):
    cat = kspeed.Catalog.open(space)
    for rank in (0, 1):
        ds = KSpeedDataset(space, batch_size=5, seed=8, rank=rank, world=2, ring_bytes="256KiB")
        assert len(ds) == ds.epoch_len == -(-len(cat) // 2)
        dl = DataLoader(ds, batch_size=None, num_workers=workers,
                        multiprocessing_context="fork" if workers else None)
        for epoch in (0, 1):
            ds.set_epoch(epoch)
            want = rank_sequence(space, epoch, batch_size=5, seed=8, rank=rank, world=2)
            got = list(dl)
            assert len(got) == len(want)
            for k, ((t, y), sid) in enumerate(zip(got, want)):
                assert y == cat.labels[sid], f"step {k}"
                assert t.dtype == torch.uint8 and bytes(t.numpy()) == cat.read_source(sid), f"step {k}"


def test_batch_output_with_workers_reads_each_sample_once(space):
    cat = kspeed.Catalog.open(space)
    ds = KSpeedDataset(space, batch_size=6, seed=1, rank=1, world=2, output="batch", drop_last=True,
                       ring_bytes="256KiB")
    dl = DataLoader(ds, batch_size=None, num_workers=3, multiprocessing_context="fork")
    seen = []
    for data, offs, lens, labels, ids in dl:
        for o, n, y, sid in zip(offs.tolist(), lens.tolist(), labels.tolist(), ids.tolist()):
            assert bytes(data[o: o + n].numpy()) == cat.read_source(sid)
            assert y == cat.labels[sid]
            seen.append(sid)
    # KSpeedDataset's drop_last is DistributedSampler's (the DataLoader
    # batches): the first n // world samples of the rank's sequence.
    want = rank_sequence(space, 0, batch_size=6, seed=1, rank=1, world=2)[: len(cat) // 2]
    assert sorted(seen) == sorted(want) and len(seen) == len(want) == len(cat) // 2


def test_fork_after_building_a_loader(space):
    """The parent builds a loader and reads; DataLoader workers fork; a child
    refuses to use the parent's loader; the parent reads on exactly."""
    want = rank_sequence(space, 0, batch_size=4, seed=6)
    loader = kspeed.Loader(space, batch_size=4, seed=6, ring_bytes="256KiB")
    first = loader.next_batch().ids.tolist()
    ds = KSpeedDataset(space, batch_size=4, seed=6, ring_bytes="256KiB")
    assert len(list(DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork"))) == len(want)
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()

    def child():
        try:
            loader.next_batch()
            q.put("used the parent's loader")
        except kspeed.LoaderError as e:
            q.put("refused: " + str(e))

    p = ctx.Process(target=child)
    p.start()
    msg = q.get(timeout=60)
    p.join(60)
    assert p.exitcode == 0 and msg.startswith("refused: this loader was built in process"), msg
    rest = [i for b in loader for i in b.ids.tolist()]
    assert first + rest == want


def test_dataset_state_dict_resumes(space):
    kw = dict(batch_size=5, seed=2, ring_bytes="256KiB")
    want = rank_sequence(space, 0, **kw)
    ds = KSpeedDataset(space, **kw)
    it = iter(ds)
    head = [next(it) for _ in range(17)]
    state = ds.state_dict()
    del it, head
    ds2 = KSpeedDataset(space, **kw)
    ds2.load_state_dict(state)
    cat = kspeed.Catalog.open(space)
    rest = list(ds2)
    # Exact, in the middle of a kspeed batch of 5.
    assert state["index"] == 17 and state["skip"] == 2
    assert [bytes(t.numpy()) for t, _ in rest] == [cat.read_source(i) for i in want[17:]]
    # Pickled and loaded in a new dataset at an epoch boundary too.
    import pickle

    ds3 = KSpeedDataset(space, **kw)
    assert len(list(ds3)) == len(want)
    st3 = pickle.loads(pickle.dumps(ds3.state_dict()))
    assert (st3["epoch"], st3["index"], st3["skip"]) == (1, 0, 0)
    assert "audit_position" not in st3
    # The mid-batch state's audit position is the one a loader saves after
    # exactly those 17 samples (batches of 1), the batch's start is not.
    with kspeed.Loader(space, **dict(kw, batch_size=1)) as one:
        for _ in range(17):
            one.next_batch()
        assert state["audit_position"] == one.save_position()
        assert state["position"] != one.save_position()


def test_dataset_options_are_checked_at_construction(space):
    """A misspelt option is a TypeError naming it when the dataset is
    made, not at the first iteration (in a worker)."""
    with pytest.raises(TypeError, match="'batch_sise'"):
        KSpeedDataset(space, batch_sise=8)
    with pytest.raises(TypeError, match="'ring_byte', 'sed'"):
        KSpeedImageFolder(space, sed=1, ring_byte="1MiB")
    KSpeedDataset(space, batch_size=8, seed=1)


def test_decode_jpeg_of_real_jpegs_equals_pil(tmp_path):
    require("torchvision")
    require("PIL")
    from PIL import Image
    from torchvision.io import decode_jpeg

    src = tmp_path / "jpg"
    rng = np.random.default_rng(0)
    for i in range(24):
        cls = src / ("red" if i % 2 else "blue")
        cls.mkdir(parents=True, exist_ok=True)
        h, w = 16 + 8 * (i % 5), 24 + 4 * (i % 7)
        img = (rng.random((h, w, 3)) * 255).astype(np.uint8)
        Image.fromarray(img).save(cls / f"{i:03d}.jpg", quality=85)
    sp = tmp_path / "sp"
    cli("preload", "--source", src, "--space", sp)
    ds = KSpeedImageFolder(str(sp), transform=decode_jpeg, batch_size=4, ring_bytes="256KiB")
    assert ds.classes == ["blue", "red"] and ds.class_to_idx == {"blue": 0, "red": 1}
    assert len(ds.targets) == 24
    cat = ds.catalog
    order = rank_sequence(str(sp), 0, batch_size=4)
    n = 0
    for (img, y), sid in zip(DataLoader(ds, batch_size=None, num_workers=0), order):
        pil = np.asarray(Image.open(io.BytesIO(cat.read_source(sid))).convert("RGB"))
        assert tuple(img.shape) == (3, pil.shape[0], pil.shape[1])
        assert np.array_equal(img.permute(1, 2, 0).numpy(), pil), f"sample {sid} decodes differently"
        assert ds.classes[y] == os.path.basename(os.path.dirname(cat.path(sid)))
        n += 1
    assert n == 24
    ds2 = KSpeedImageFolder(str(sp), decode=True, batch_size=4, ring_bytes="256KiB")
    img, _ = next(iter(ds2))
    assert img.dtype == torch.uint8 and img.shape[0] == 3


@pytest.mark.parametrize("workers", [0, 2])
def test_stateful_dataloader_resumes_exactly(space, workers):
    """torchdata's StatefulDataLoader: state taken after 23 samples, loaded
    into a new DataLoader over a new dataset: the rest, exactly."""
    require("torchdata")
    from torchdata.stateful_dataloader import StatefulDataLoader

    kw = dict(batch_size=5, seed=4, ring_bytes="256KiB")
    want = rank_sequence(space, 0, **kw)
    cat = kspeed.Catalog.open(space)

    def make():
        return StatefulDataLoader(KSpeedDataset(space, **kw), batch_size=None, num_workers=workers,
                                  multiprocessing_context="fork" if workers else None)

    dl = make()
    it = iter(dl)
    head = [next(it) for _ in range(23)]
    state = dl.state_dict()
    del it, dl
    dl2 = make()
    dl2.load_state_dict(state)
    rest = list(dl2)
    got = [bytes(t.numpy()) for t, _ in head + rest]
    assert len(got) == len(want)
    assert got == [cat.read_source(i) for i in want]


def _same(t):
    return t


def _seen_then_zeroed(t):
    """What the transform was handed (a copy), then an in-place write to it."""
    seen = t.clone()
    t.zero_()
    return seen


@pytest.mark.parametrize("output, workers", [("sample", 0), ("sample", 2), ("batch", 0)])
def test_dataset_with_tier_views_delivers_the_rank_sequence(space, output, workers):
    """tier_views=True through KSpeedDataset: samples from the memory tier
    (epochs 1 and 2) reach the transform as copies (an in-place transform
    does not reach the tier, which is served again every epoch), batches
    as the packed copy; bytes, labels and order equal the plain loader's."""
    cat = kspeed.Catalog.open(space)
    args = dict(batch_size=5, seed=8, rank=1, world=2)
    kw = dict(transform=_seen_then_zeroed) if output == "sample" else dict(output="batch")
    ds = KSpeedDataset(space, ring_bytes="256KiB", tier_bytes="8MiB", tier_views=True, **args, **kw)
    dl = DataLoader(ds, batch_size=None, num_workers=workers, multiprocessing_context="fork" if workers else None)
    packed = 0  # batches laid out back to back (the copy of a batch not in the ring)
    for epoch in range(3):
        ds.set_epoch(epoch)
        want = rank_sequence(space, epoch, **args)
        got = []
        for item in dl:
            if output == "sample":
                t, y = item
                sid = want[len(got)]
                assert y == cat.labels[sid] and bytes(t.numpy()) == cat.read_source(sid), f"epoch {epoch}"
                got.append(sid)
            else:
                data, offs, lens, labels, ids = item
                for o, n, y, sid in zip(offs.tolist(), lens.tolist(), labels.tolist(), ids.tolist()):
                    assert bytes(data[o: o + n].numpy()) == cat.read_source(sid) and y == cat.labels[sid]
                    got.append(sid)
                o, n = offs.tolist(), lens.tolist()
                # In the ring, samples start on 4 KiB boundaries: back to
                # back with an unaligned length before the last means packed.
                if all(o[i + 1] == o[i] + n[i] for i in range(len(n) - 1)) and any(x % 4096 for x in n[:-1]):
                    packed += 1
            del item
        assert got == want, f"epoch {epoch}"
    if output == "batch":
        assert packed > 0, "no batch came as the packed copy: tier_views did not reach the loader"


@pytest.mark.parametrize("copy", [True, False])
def test_in_place_ops_never_reach_the_memory_tier(space, copy):
    """Every way a tier sample reaches torch (KSpeedDataset with and without
    copy, torch.from_dlpack of sample_dlpack and of the batch) is written
    to in place, over 3 epochs: the tier's bytes still equal the source,
    and the writes changed only the tensors."""
    cat = kspeed.Catalog.open(space)
    ds = KSpeedDataset(space, batch_size=5, seed=3, ring_bytes="256KiB", tier_bytes="8MiB", tier_views=True,
                       copy=copy)
    loader = kspeed.Loader(space, batch_size=5, seed=3, ring_bytes="256KiB", tier_bytes="8MiB", tier_views=True)
    in_tier = 0
    for epoch in range(3):
        ds.set_epoch(epoch)
        want = rank_sequence(space, epoch, batch_size=5, seed=3)
        for (t, y), sid in zip(ds, want):
            assert bytes(t.numpy()) == cat.read_source(sid), f"epoch {epoch}: sample {sid} was changed"
            t.fill_(0xA5)
        loader.set_epoch(epoch)
        for b in loader:
            in_tier += not b.in_ring
            for i in range(len(b)):
                sid = int(b.ids[i])
                s = torch.from_dlpack(b.sample_dlpack(i))
                assert bytes(s.numpy()) == cat.read_source(sid), f"epoch {epoch}: sample {sid} was changed"
                s.fill_(0x5A)
            w = torch.from_dlpack(b)
            w.fill_(0x33)
            del s, w, b
    assert in_tier > 0, "no batch had samples from the tier"


@pytest.mark.parametrize("workers, persistent", [(0, False), (2, False), (2, True)])
def test_each_pass_without_set_epoch_reads_the_next_epoch(space, workers, persistent):
    """The docs' rule with every kind of worker: a pass without set_epoch
    reads the epoch after the last pass's, and set_epoch(e) sets the next
    pass's epoch (also for persistent workers)."""
    args = dict(batch_size=5, seed=8, rank=1, world=2)
    cat = kspeed.Catalog.open(space)
    ds = KSpeedDataset(space, ring_bytes="256KiB", **args)
    dl = DataLoader(ds, batch_size=None, num_workers=workers, persistent_workers=persistent,
                    multiprocessing_context="fork" if workers else None)

    def epoch_of_the_pass(epoch):
        return [bytes(t.numpy()) for t, _ in dl] == [cat.read_source(i) for i in rank_sequence(space, epoch, **args)]

    for epoch in (0, 1, 2):
        assert epoch_of_the_pass(epoch), f"pass {epoch} did not read epoch {epoch}"
    ds.set_epoch(7)
    assert epoch_of_the_pass(7)
    assert epoch_of_the_pass(8)


def test_len_of_a_dataloader_is_what_it_yields(space):
    """len(DataLoader) equals the batches one pass yields, for every worker
    count, batch size and drop_last (each worker batches its own samples)."""
    wrong, counts = [], {}
    for world in (1, 2):
        ds = KSpeedDataset(space, batch_size=5, seed=2, rank=0, world=world, ring_bytes="256KiB")
        for workers in (0, 1, 2, 3):
            for bs in (None, 1, 7, 16, 64):
                for drop_last in ((False, True) if bs else (False,)):
                    dl = DataLoader(ds, batch_size=bs, num_workers=workers, drop_last=drop_last,
                                    collate_fn=list if bs else None,
                                    multiprocessing_context="fork" if workers else None)
                    n = sum(1 for _ in dl)
                    counts[world, workers, bs, drop_last] = n
                    if len(dl) != n:
                        wrong.append(f"world {world}, {workers} workers, batch_size {bs}, drop_last {drop_last}: "
                                     f"len {len(dl)}, yielded {n}")
        assert len(ds) == ds.epoch_len
    assert not wrong, wrong
    for (world, workers, bs, drop_last), n in counts.items():
        ds = KSpeedDataset(space, batch_size=5, seed=2, rank=0, world=world)
        assert ds.batches_per_epoch(bs, workers, drop_last) == n


def test_len_through_a_wrapper_dataset_warns_once(space):
    """A DataLoader over a wrapper of the dataset cannot be answered
    exactly: with workers that says so (once) instead of undercounting in
    silence; without workers the sample count is exact and nothing warns."""
    import warnings

    class Wrapper(torch.utils.data.IterableDataset):
        def __init__(self, inner):
            self.inner = inner

        def __iter__(self):
            return iter(self.inner)

        def __len__(self):
            return len(self.inner)

    ds = KSpeedDataset(space, batch_size=5, seed=2, ring_bytes="256KiB")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        len(DataLoader(Wrapper(ds), batch_size=7, num_workers=0))
        assert not [x for x in w if "batches_per_epoch" in str(x.message)]
        for _ in range(2):
            len(DataLoader(Wrapper(ds), batch_size=7, num_workers=2))
        hits = [x for x in w if "batches_per_epoch" in str(x.message)]
    assert len(hits) == 1, [str(x.message) for x in w]


def test_load_state_dict_of_another_job_fails_naming_the_field(space):
    ds2 = KSpeedDataset(space, batch_size=5, seed=2, rank=0, world=2, ring_bytes="256KiB")
    state = ds2.state_dict()
    ds1 = KSpeedDataset(space, batch_size=5, seed=2, ring_bytes="256KiB")
    # Another world size resumes from the job position (test_elastic.py);
    # a state without one (an older kspeed's) is refused.
    old = {k: v for k, v in state.items() if k != "job_position"}
    with pytest.raises(ValueError, match=r"state\['world'\] is 2 but this dataset has 1"):
        ds1.load_state_dict(old)
    ds1.load_state_dict(state)
    with pytest.raises(ValueError, match=r"state\['seed'\] is 2 but this dataset has 9"):
        KSpeedDataset(space, batch_size=5, seed=9, rank=0, world=2).load_state_dict(state)
    with pytest.raises(ValueError, match=r"state\['num_workers'\] is 2 \(worker 1\) but this is worker 0 of 1"):
        ds2.load_state_dict({**state, "num_workers": 2, "worker": 1})
    ds2.load_state_dict(state)  # its own: accepted


def test_return_id_gives_the_catalog_index(space):
    cat = kspeed.Catalog.open(space)
    ds = KSpeedDataset(space, batch_size=5, seed=2, ring_bytes="256KiB", return_id=True)
    got = list(DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork"))
    assert [sid for _, _, sid in got] == rank_sequence(space, 0, batch_size=5, seed=2)
    for t, y, sid in got:
        assert bytes(t.numpy()) == cat.read_source(sid) and y == cat.labels[sid]
    with pytest.raises(TypeError, match="return_id must be True or False"):
        KSpeedDataset(space, return_id=1)


def test_explicit_rank_world_against_torchrun_is_refused(space, monkeypatch):
    """world=1 under a 2-rank torchrun would read every sample twice per
    epoch: refused unless ignore_launcher_env=True."""
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"rank=0, world=1 contradict the launcher's environment variables RANK=1"):
        KSpeedDataset(space, rank=0, world=1)
    ds = KSpeedDataset(space, rank=0, world=1, ignore_launcher_env=True)
    assert (ds.rank, ds.world) == (0, 1)
    assert (KSpeedDataset(space).rank, KSpeedDataset(space, rank=1, world=2).world) == (1, 2)


def test_batch_output_resumes_after_the_last_batch_yielded(space):
    """output="batch": a state taken after a yielded batch resumes at the
    next one (the batch is not yielded again)."""
    want = rank_sequence(space, 0, batch_size=8, seed=3)
    ds = KSpeedDataset(space, output="batch", batch_size=8, seed=3, ring_bytes="256KiB")
    it = iter(ds)
    first = [next(it)[4].tolist() for _ in range(2)]
    state = ds.state_dict()
    del it
    ds.close()
    ds2 = KSpeedDataset(space, output="batch", batch_size=8, seed=3, ring_bytes="256KiB")
    ds2.load_state_dict(state)
    rest = [b[4].tolist() for b in ds2]
    assert [i for b in first + rest for i in b] == want
