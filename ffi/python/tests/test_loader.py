"""kspeed.Loader over real spaces: bytes, labels and order of every sample,
resume, lifetime of views, errors."""

import gc
import os
import pickle
import subprocess
import sys
import time
import zlib

import numpy as np
import pytest

import kspeed
from conftest import cli, make_tree, read_to_eof


def expected_ids(n, rank, world, drop_last, epoch_ids=None):
    """DistributedSampler's split of one epoch's order `epoch_ids` (default
    0..n-1, i.e. shuffle=False): pad by wrapping to a multiple of world, or
    drop the tail; then every world-th from rank."""
    order = list(range(n)) if epoch_ids is None else list(epoch_ids)
    if drop_last:
        order = order[: n - n % world]
    else:
        pad = (-n) % world
        order = order + order[:pad]
    return order[rank::world]


def read_epoch(loader, cat, check_bytes=True):
    ids = []
    for b in loader:
        assert 0 < len(b) <= loader.batch_size
        bid, lab = b.ids, b.labels
        assert bid.dtype == np.int64 and lab.dtype == np.int64
        arr, offs, lens = b.array(), b.offsets, b.lengths
        for i in range(len(b)):
            sid = int(bid[i])
            assert lab[i] == cat.labels[sid]
            assert lens[i] == cat.lengths[sid]
            if check_bytes:
                want = cat.read_source(sid)
                v = b.sample(i)
                assert v.dtype == np.uint8 and v.tobytes() == want, f"sample {sid}"
                assert bytes(b.memoryview(i)) == want
                assert arr[offs[i]: offs[i] + lens[i]].tobytes() == want
        ids.extend(bid.tolist())
    return ids


@pytest.mark.parametrize("drop_last", [False, True])
def test_every_sample_matches_its_source_2_ranks_3_epochs(space, drop_last):
    cat = kspeed.Catalog.open(space)
    n = len(cat)
    per_epoch = {}
    for rank in (0, 1):
        loader = kspeed.Loader(space, batch_size=7, seed=9, rank=rank, world=2, drop_last=drop_last,
                               ring_bytes="256KiB", pollers=2)
        # drop_last drops DistributedSampler's tail and then the last
        # partial batch (lock-step: whole batches only).
        want_len = n // 2 // 7 * 7 if drop_last else -(-n // 2)
        assert loader.epoch_len == want_len
        assert len(loader) == -(-want_len // 7)
        for epoch in range(3):
            loader.set_epoch(epoch)
            ids = read_epoch(loader, cat)
            assert len(ids) == want_len
            per_epoch.setdefault(epoch, []).append(ids)
        st = loader.stats()
        assert st["samples"] == 3 * want_len and st["bytes"] > 0
        loader.close()
    for epoch, (r0, r1) in per_epoch.items():
        both = r0 + r1
        if drop_last:
            assert len(set(both)) == len(both) == 2 * (n // 2 // 7 * 7)
        else:
            assert set(both) == set(range(n))
            assert len(both) == n + (-n) % 2
    assert per_epoch[0][0] != per_epoch[1][0], "epochs are shuffled differently"


def test_stats_has_loop_stalls(space):
    # The loops' stall count (ticks longer than KSPEED_STALL_MS), as in
    # Rust's Stats::loop_stalls and C's ksp_stats.loop_stalls.
    cat = kspeed.Catalog.open(space)
    with kspeed.Loader(space, batch_size=8, seed=3, ring_bytes="256KiB") as loader:
        read_epoch(loader, cat, check_bytes=False)
        st = loader.stats()
    assert type(st["loop_stalls"]) is int and st["loop_stalls"] >= 0, st
    assert type(st["stall_waits"]) is int and st["stall_waits"] >= 0, st


def test_stats_charge_the_stall_to_its_causes(space):
    # stall_s split by the path of the sample waited for (Rust's
    # Stats::stall_causes, C's ksp_stats.stall_*_s): one node, a space read
    # with O_DIRECT, so every wait is the disk's; the causes add up.
    cat = kspeed.Catalog.open(space)
    with kspeed.Loader(space, batch_size=8, seed=3, ring_bytes="256KiB", page_cache="off") as loader:
        read_epoch(loader, cat, check_bytes=False)
        st = loader.stats()
    c = st["stall_causes"]
    causes = ("disk_s", "tier_s", "source_s", "peers_s", "failover_s", "agent_s")
    assert abs(sum(c[k] for k in causes) - st["stall_s"]) < 1e-6, (c, st["stall_s"])
    assert abs(c["disk_s"] - st["stall_s"]) < 1e-6, c
    assert c["slowest_peers"] == [], c
    # peers_s split by where the grants' time went: no peers here.
    assert (c["peer_read_s"], c["peer_send_s"], c["peer_link_s"]) == (0.0, 0.0, 0.0), c


@pytest.mark.parametrize("mode", ["auto", "off", "on"])
def test_page_cache_modes_read_the_same(space, mode):
    # page_cache: 'on' reads through the page cache, 'off' with O_DIRECT
    # where the file system allows; every mode delivers the same epoch.
    cat = kspeed.Catalog.open(space)
    with kspeed.Loader(space, batch_size=8, seed=3, ring_bytes="256KiB", page_cache=mode) as loader:
        assert sorted(read_epoch(loader, cat)) == list(range(len(cat)))
        info = loader.landing_info()
    if mode == "on":
        assert info["direct_io"] is False and "page_cache on" in info["io"], info
    with pytest.raises(ValueError, match="page_cache"):
        kspeed.Loader(space, page_cache="sometimes")


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("world", [2, 3])
def test_order_is_distributed_samplers_without_shuffle(space, drop_last, world):
    cat = kspeed.Catalog.open(space)
    n = len(cat)
    for rank in range(world):
        with kspeed.Loader(space, batch_size=5, shuffle=False, rank=rank, world=world,
                           drop_last=drop_last, ring_bytes="256KiB") as loader:
            ids = read_epoch(loader, cat, check_bytes=False)
        want = expected_ids(n, rank, world, drop_last)
        if drop_last:
            want = want[: len(want) // 5 * 5]  # whole batches only
        assert ids == want
        try:
            import torch.utils.data as tud
        except ImportError:
            continue
        ds = list(range(n))
        s = tud.distributed.DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=False, drop_last=drop_last)
        assert ids == list(iter(s))[: len(ids)]


def test_iteration_goes_on_to_the_next_epoch_and_set_epoch_repeats(space):
    cat = kspeed.Catalog.open(space)
    loader = kspeed.Loader(space, batch_size=16, seed=4, ring_bytes="512KiB")
    e0 = read_epoch(loader, cat, check_bytes=False)
    e1 = read_epoch(loader, cat, check_bytes=False)
    assert loader.epoch == 1 and sorted(e0) == sorted(e1) == list(range(len(cat))) and e0 != e1
    loader.set_epoch(0)
    assert read_epoch(loader, cat, check_bytes=False) == e0
    loader.set_epoch(1)
    assert read_epoch(loader, cat, check_bytes=False) == e1


def test_end_epoch_reads_nothing_past_the_last_epoch(space):
    cat = kspeed.Catalog.open(space)
    n = len(cat)
    # The ring holds the whole dataset several times over: without
    # end_epoch the pollers read on into epoch 2 while epoch 1 is consumed.
    with kspeed.Loader(space, batch_size=16, seed=4, ring_bytes="16MiB", end_epoch=2) as loader:
        for _ in range(2):
            assert len(read_epoch(loader, cat, check_bytes=False)) == n
        with pytest.raises(kspeed.ConfigError, match="last epoch 1"):
            loader.set_epoch(2)
        st = loader.stats()
        # Empty samples need no read.
        assert st["disk_reads"] == 2 * int((cat.lengths > 0).sum()), st
        assert st["read_ahead"] + st["read_ahead_discarded"] == 0, st
    with pytest.raises(ValueError, match="end_epoch 1 must be after start_epoch 1"):
        kspeed.Loader(space, batch_size=16, start_epoch=1, end_epoch=1)


def test_state_dict_resumes_in_a_new_process(space, tmp_path):
    cat = kspeed.Catalog.open(space)
    args = dict(batch_size=6, seed=21, rank=1, world=2, ring_bytes="256KiB")
    ref = kspeed.Loader(space, **args)
    ref.set_epoch(2)
    full = read_epoch(ref, cat, check_bytes=False)
    ref.close()
    a = kspeed.Loader(space, **args)
    a.set_epoch(2)
    taken = []
    for _ in range(4):
        taken.extend(a.next_batch().ids.tolist())
    state = a.state_dict()
    assert state["epoch"] == 2 and state["index"] == 24
    path = tmp_path / "state.pkl"
    path.write_bytes(pickle.dumps(state))
    a.close()
    script = f"""
import pickle, kspeed
l = kspeed.Loader({space!r}, **{args!r})
l.load_state_dict(pickle.load(open({str(path)!r}, "rb")))
ids = []
for b in l:
    ids.extend(b.ids.tolist())
print(ids)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    rest = eval(out.stdout.strip())
    assert taken == full[:24] and rest == full[24:]


def test_reading_starts_at_the_first_batch_or_start_reading(space):
    """A local loader reads nothing until its first batch is asked for
    (a restore right after construction throws no read away), unless
    start_reading() starts it earlier: the ring then fills from the
    restored step with nobody consuming."""
    args = dict(batch_size=4, seed=5, ring_bytes="256KiB", end_epoch=1)
    a = kspeed.Loader(space, **args)
    for _ in range(2):
        a.next_batch()
    state = a.state_dict()
    a.close()
    with kspeed.Loader(space, **args) as b:
        b.load_state_dict(state)
        assert b.stats()["disk_reads"] == 0, b.stats()
        assert b.position() == (0, 8)
        b.start_reading()
        deadline = time.monotonic() + 60
        while b.stats()["read_ahead"] == 0:
            assert time.monotonic() < deadline, ("no read ahead within 60 s", b.stats())
            time.sleep(0.01)
        st = b.stats()
        assert st["samples"] == 0 and st["disk_reads"] > 0, st
        assert b.position() == (0, 8)
        n = sum(len(x) for x in b)
        assert n == b.epoch_len - 8
        # Every read was for the restored step onwards, each once.
        assert b.stats()["disk_reads"] <= b.epoch_len - 8, b.stats()


def test_state_dict_refuses_another_job(space):
    a = kspeed.Loader(space, batch_size=4, seed=1, ring_bytes="256KiB")
    st = a.state_dict()
    b = kspeed.Loader(space, batch_size=4, seed=2, ring_bytes="256KiB")
    with pytest.raises(ValueError, match="seed"):
        b.load_state_dict(st)
    with pytest.raises(ValueError, match="kspeed Loader state"):
        b.load_state_dict({"epoch": 0})
    with pytest.raises(TypeError):
        b.load_state_dict([1, 2])


# Lifetime of views.


def crc_of(views):
    return [zlib.crc32(v.tobytes()) for v in views]


def test_views_held_across_next_keep_their_bytes_small_ring(space):
    """A ring that holds only a few batches: views of earlier batches stay
    byte-exact while later ones are read, and asking for more batches than
    may be held raises instead of reusing their memory."""
    cat = kspeed.Catalog.open(space)
    loader = kspeed.Loader(space, batch_size=4, seed=5, ring_bytes="128KiB", batches_in_flight=3, pollers=2)
    held = []  # (ids, views) of the batches kept
    refused = 0
    epochs_done = 0
    while epochs_done < 2:
        try:
            b = loader.next_batch()
        except kspeed.BatchInUseError as e:
            assert "still referenced" in str(e) or "cannot hold another batch" in str(e)
            refused += 1
            held.pop(0)  # drop the oldest batch's views: its ring space comes back
            gc.collect()
            continue
        if b is None:
            epochs_done += 1
            loader.set_epoch(epochs_done)
            continue
        views = [b.sample(i) for i in range(len(b))] + [np.from_dlpack(b)]
        held.append((b.ids.tolist(), views, b.offsets, b.lengths))
        del b, views
        for ids, vs, offs, lens in held:
            for sid, v in zip(ids, vs):
                assert v.tobytes() == cat.read_source(sid), f"sample {sid} changed while held"
            whole = vs[-1]
            for sid, o, n in zip(ids, offs, lens):
                assert whole[o: o + n].tobytes() == cat.read_source(sid)
        if held:
            # The loop's variables would keep the last batch's views alive.
            del vs, v, whole
    assert refused > 0
    assert loader.stats()["samples"] >= 2 * len(cat)


def test_release_is_refused_while_views_live_and_then_invalidates(space):
    loader = kspeed.Loader(space, batch_size=8, ring_bytes="256KiB")
    b = loader.next_batch()
    v = b.sample(0)
    mv = b.memoryview(1)
    assert b.views == 2
    with pytest.raises(kspeed.BatchInUseError, match="2 view"):
        b.release()
    with pytest.raises(kspeed.BatchInUseError):
        with b:
            pass
    del v, mv
    assert b.views == 0
    with b:
        first = b.ids[0]
    assert b.released
    for call in (lambda: b.sample(0), lambda: b.array(), lambda: b.tobytes(0), lambda: b.__dlpack__()):
        with pytest.raises(kspeed.BatchReleasedError):
            call()
    # The ids are plain copies and stay readable.
    assert b.ids[0] == first
    # The batch's space went back: the rest of the epoch reads on.
    assert sum(len(x) for x in loader) == loader.epoch_len - 8


def test_views_outlive_close_and_the_loader(space):
    cat = kspeed.Catalog.open(space)
    loader = kspeed.Loader(space, batch_size=8, ring_bytes="256KiB")
    b = loader.next_batch()
    ids = b.ids.tolist()
    arrs = b.samples()
    cap = b.__dlpack__()
    other = loader.next_batch()  # no views: invalidated by close
    loader.close()
    assert loader.closed
    with pytest.raises(kspeed.LoaderClosedError):
        loader.next_batch()
    with pytest.raises(kspeed.BatchReleasedError):
        other.sample(0)
    del b, other, loader
    gc.collect()
    for sid, a in zip(ids, arrs):
        assert a.tobytes() == cat.read_source(sid)
    whole = np.from_dlpack(_Capsule(cap))
    assert whole.size >= sum(len(a) for a in arrs)
    del arrs, whole, cap
    gc.collect()


class _Capsule:
    """Hands numpy.from_dlpack a capsule made earlier."""

    def __init__(self, cap):
        self.cap = cap

    def __dlpack__(self, **kw):
        return self.cap

    def __dlpack_device__(self):
        return (1, 0)


def test_restart_is_refused_while_views_live(space):
    loader = kspeed.Loader(space, batch_size=8, ring_bytes="256KiB")
    b = loader.next_batch()
    v = b.sample(0)
    with pytest.raises(kspeed.BatchInUseError, match="set_epoch"):
        loader.set_epoch(5)
    with pytest.raises(kspeed.BatchInUseError, match="load_state_dict"):
        loader.load_state_dict(loader.state_dict())
    before = v.tobytes()
    del v
    loader.set_epoch(5)
    with pytest.raises(kspeed.BatchReleasedError):
        b.sample(0)
    assert loader.next_batch().epoch == 5
    assert before is not None


def test_dlpack_into_numpy_without_copy(space):
    loader = kspeed.Loader(space, batch_size=8, ring_bytes="256KiB")
    b = loader.next_batch()
    assert b.__dlpack_device__() == (1, 0)
    x = np.from_dlpack(b)
    a = b.array()
    assert x.dtype == np.uint8 and x.shape == a.shape and (x == a).all()
    assert x.__array_interface__["data"][0] == a.__array_interface__["data"][0], "a copy was made"
    assert b.is_zero_copy
    s = np.from_dlpack(_Capsule(b.sample_dlpack(2)))
    assert s.tobytes() == b.tobytes(2)
    assert b.views == 3
    del x, a, s
    assert b.views == 0
    # A capsule nobody consumed frees its view when it goes.
    cap = b.__dlpack__()
    assert b.views == 1
    del cap
    assert b.views == 0
    # copy=True: a private copy (writable), the batch not held by it.
    c = np.from_dlpack(b, copy=True)
    assert c.flags.writeable and c.tobytes() == b.array().tobytes()
    assert c.__array_interface__["data"][0] != b.array().__array_interface__["data"][0]
    assert b.views == 0
    del c
    with pytest.raises(BufferError, match="device"):
        b.__dlpack__(dl_device=(2, 0))
    assert b.views == 0


def test_wrapped_batch_array_is_a_correct_copy(tmp_path):
    """Batches that wrap around the ring's end: array() is a contiguous copy
    with offsets into it; per-sample views stay zero-copy."""
    src = make_tree(str(tmp_path / "src"), n=60, max_len=9000)
    sp = str(tmp_path / "sp")
    cli("preload", "--source", src, "--space", sp)
    cat = kspeed.Catalog.open(sp)
    loader = kspeed.Loader(sp, batch_size=5, ring_bytes="80KiB", seed=2)
    wrapped = 0
    for epoch in range(2):
        loader.set_epoch(epoch)
        for b in loader:
            a = b.array()
            wrapped += not b.is_zero_copy
            for i, sid in enumerate(b.ids):
                want = cat.read_source(int(sid))
                assert a[b.offsets[i]: b.offsets[i] + b.lengths[i]].tobytes() == want
                assert b.sample(i).tobytes() == want
            del a
    assert wrapped > 0


def test_corrupt_sample_is_a_data_error_and_verify_names_it(tmp_path):
    src = make_tree(str(tmp_path / "src"), n=20, max_len=5000)
    sp = str(tmp_path / "sp")
    kspeed.preload(src, sp)
    assert kspeed.verify(sp)["ok"]
    ext = sorted(os.listdir(os.path.join(sp, "extents")))
    assert ext, os.listdir(sp)
    # Every sample starts at a 4096-byte boundary of an extent: flip the
    # first byte of every aligned block, so every non-empty sample is hit.
    for name in ext:
        path = os.path.join(sp, "extents", name)
        data = bytearray(open(path, "rb").read())
        for off in range(0, len(data), 4096):
            data[off] ^= 0xFF
        open(path, "wb").write(bytes(data))
    cat = kspeed.Catalog.open(sp)
    nonempty = int((cat.lengths > 0).sum())
    r = kspeed.verify(sp)
    assert not r["ok"] and len(r["bad"]) == nonempty and all("corrupt" in b["what"] for b in r["bad"])
    loader = kspeed.Loader(sp, batch_size=4, verify_crc32c=True, shuffle=False, ring_bytes="256KiB")
    with pytest.raises(kspeed.DataError) as e:
        for _ in loader:
            pass
    assert e.value.kind == "SampleCorrupt" and "crc32c" in str(e.value)
    # Every later call fails with that first error, said to be an earlier one.
    with pytest.raises(kspeed.DataError) as again:
        loader.next_batch()
    assert again.value.kind == "SampleCorrupt" and "stopped after an earlier error" in str(again.value)


def test_verify_names_an_extent_that_grew(tmp_path):
    src = make_tree(str(tmp_path / "src"), n=20, max_len=5000)
    sp = str(tmp_path / "sp")
    kspeed.preload(src, sp)
    r = kspeed.verify(sp)
    assert r["ok"] and r["bad_extents"] == []
    name = sorted(os.listdir(os.path.join(sp, "extents")))[0]
    path = os.path.join(sp, "extents", name)
    before = os.path.getsize(path)
    with open(path, "ab") as f:
        f.write(b"\0" * 4096)
    r = kspeed.verify(sp)
    assert not r["ok"] and r["bad"] == [], r
    (x,) = r["bad_extents"]
    assert x["path"].endswith(name) and x["actual_bytes"] == before + 4096 and x["manifest_bytes"] == before


def test_token_file_is_read_up_to_its_limit(tmp_path):
    # /dev/zero never ends: read whole, it would fill memory.
    with pytest.raises(ValueError, match="a token is at most 1024 bytes"):
        kspeed.Loader(str(tmp_path), batch_size=1, cluster=["127.0.0.1:9"], token_file="/dev/zero")
    long = tmp_path / "long"
    long.write_bytes(b"x" * 1025 + b"\n")
    with pytest.raises(ValueError, match="1025-byte token"):
        kspeed.Loader(str(tmp_path), batch_size=1, cluster=["127.0.0.1:9"], token_file=str(long))


def test_bad_arguments_name_the_argument(space, tmp_path, monkeypatch):
    cases = [
        (dict(batch_size=0), ValueError, "batch_size"),
        (dict(batch_size="8"), TypeError, "batch_size"),
        (dict(batch_size=1.5), TypeError, "batch_size"),
        (dict(rank=2, world=2), ValueError, "rank 2 is not below world 2"),
        (dict(rank=0), ValueError, "rank and world"),
        (dict(seed=-1), ValueError, "seed"),
        (dict(shuffle=1), TypeError, "shuffle"),
        (dict(ring_bytes="12XB"), ValueError, "ring_bytes"),
        (dict(pollers=0), ValueError, "pollers"),
        (dict(cuda="yes"), ValueError, "cuda"),
        (dict(cluster=["127.0.0.1:1"]), ValueError, "token"),
        (dict(cluster=3, token="t"), TypeError, "cluster"),
        (dict(rdma=True), ValueError, "cluster mode"),
        (dict(batches_in_flight=0), ValueError, "batches_in_flight"),
    ]
    for kw, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            kspeed.Loader(space, **kw)
    with pytest.raises(ValueError, match="space"):
        kspeed.Loader(str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="exactly one"):
        kspeed.Loader()
    # kspeed's own refusals: named kspeed.Error subclasses with its message.
    with pytest.raises(kspeed.ConfigError, match="does not fit in the 8192-byte landing ring") as e:
        kspeed.Loader(space, ring_bytes=8192)
    assert isinstance(e.value, ValueError) and e.value.kind == "SampleLargerThanRing"
    (tmp_path / "empty").mkdir()
    with pytest.raises(kspeed.DataError, match="not a complete kspeed space"):
        kspeed.Loader(str(tmp_path / "empty"))
    with pytest.raises(kspeed.DataError, match="no samples"):
        kspeed.preload(str(tmp_path / "empty"), str(tmp_path / "sp2"))
    # The launcher's environment.
    monkeypatch.setenv("RANK", "1")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match="WORLD_SIZE is not set"):
        kspeed.Loader(space)
    monkeypatch.setenv("WORLD_SIZE", "x")
    with pytest.raises(ValueError, match='WORLD_SIZE="x"\\): not a number'):
        kspeed.Loader(space)


def test_rank_and_world_from_torchrun_and_slurm(space, monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(var, raising=False)
    assert kspeed.launch_env()[:2] == (0, 1)
    monkeypatch.setenv("SLURM_PROCID", "2")
    monkeypatch.setenv("SLURM_NTASKS", "3")
    with kspeed.Loader(space, ring_bytes="2MiB") as l:
        assert (l.rank, l.world) == (2, 3)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with kspeed.Loader(space, ring_bytes="2MiB") as l:
        assert (l.rank, l.world) == (1, 4)
    # Explicit values that contradict the launcher's: only when asked for.
    with pytest.raises(ValueError, match="contradict the launcher's environment variables RANK=1, WORLD_SIZE=4"):
        kspeed.Loader(space, rank=0, world=1, ring_bytes="2MiB")
    with kspeed.Loader(space, rank=0, world=1, ignore_launcher_env=True, ring_bytes="2MiB") as l:
        assert (l.rank, l.world) == (0, 1)


def test_catalog_has_lengths_crcs_labels_and_classes(space, tree):
    loader = kspeed.Loader(space, ring_bytes="2MiB")
    cat = loader.catalog
    assert len(cat) == 123 and cat.class_names == ["ant", "bee", "cat", "dog"]
    for i in range(len(cat)):
        data = cat.read_source(i)
        assert len(data) == cat.lengths[i]
        name = os.path.relpath(cat.path(i), tree)
        assert cat.class_names[cat.labels[i]] == name.split(os.sep)[0]


def test_cluster_mode_over_tcp_with_kspeed_serve(tree, space, serve, token_file):
    """All samples pushed by a `kspeed serve` process over TCP (the loader's
    input is the source, which holds nothing locally)."""
    cat = kspeed.Catalog.open(space)
    for rank in (0, 1):
        loader = kspeed.Loader(source=tree, catalog=os.path.join(space, "catalog.ksc"), cluster=[serve.addr],
                               token_file=token_file, rank=rank, world=2, batch_size=8, seed=3,
                               ring_bytes="256KiB", node_timeout=30)
        ids = read_epoch(loader, cat)
        assert len(ids) == loader.epoch_len
        st = loader.stats()
        # Every non-empty sample came from the node (an empty one needs no
        # transfer; the counter also includes read-ahead past the epoch).
        assert st["remote_samples"] >= sum(1 for i in ids if cat.lengths[i] > 0), st
        assert st["source_reads"] == 0, st
        # Nothing came from the source: no lead to report.
        assert st["source_lead"] == {"count": 0, "late": 0, "p10_s": 0.0, "p50_s": 0.0}, st
        # kspeed serve reports its times over TCP: every wait for a peer's
        # sample is split into its reading, its sending and the link.
        c = st["stall_causes"]
        split = c["peer_read_s"] + c["peer_send_s"] + c["peer_link_s"]
        assert abs(split - c["peers_s"]) < 1e-6, c
        for p in c["slowest_peers"]:
            assert abs(p["read_s"] + p["send_s"] + p["link_s"] - p["stall_s"]) < 1e-6, c
        loader.close()


def test_node_service_in_process(tree, space, token_file):
    cat = kspeed.Catalog.open(space)
    with kspeed.NodeService(space, token_file=token_file) as svc:
        loader = kspeed.Loader(source=tree, catalog=os.path.join(space, "catalog.ksc"), cluster=[svc.address],
                               token="pytest-job-token", batch_size=8, ring_bytes="256KiB")
        ids = read_epoch(loader, cat)
        assert sorted(ids) == list(range(len(cat)))
        loader.close()
        assert svc.stats()["samples"] >= len(cat)
    with pytest.raises(kspeed.NetworkError, match="refused"):
        with kspeed.NodeService(space, token="other") as svc:
            kspeed.Loader(source=tree, catalog=os.path.join(space, "catalog.ksc"), cluster=[svc.address],
                          token="pytest-job-token", ring_bytes="2MiB")


def test_forked_child_refuses_the_parents_loader_and_drops_it_safely(space):
    """os.fork with a loader, a batch and a view alive: the child's use is
    refused, dropping them there neither hangs nor frees anything, and the
    parent reads on exactly."""
    with kspeed.Loader(space, batch_size=4, seed=12, ring_bytes="256KiB") as ref:
        want = [i for b in ref for i in b.ids.tolist()]
    loader = kspeed.Loader(space, batch_size=4, seed=12, ring_bytes="256KiB")
    b = loader.next_batch()
    v = b.sample(0)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        os.close(r)
        msg = b"used"
        try:
            loader.next_batch()
        except kspeed.LoaderError as e:
            msg = b"refused" if "built in process" in str(e) else str(e).encode()
        # The batch's bytes are not mapped here (MADV_DONTFORK): every call
        # that would read them is refused by name, none faults.
        for use in (b.array, lambda: b.sample(0), lambda: b.tobytes(0), b.__dlpack__, b.samples):
            try:
                use()
                msg += b" batch-used"
            except kspeed.LoaderError as e:
                if "built in process" not in str(e):
                    msg += b" " + str(e).encode()
        del v, b, loader
        gc.collect()
        os.write(w, msg + b" dropped")
        os._exit(0)
    os.close(w)
    try:
        out = read_to_eof(r)  # EOF when the child exits (it holds the write end)
    except AssertionError:
        os.kill(pid, 9)
        raise
    finally:
        os.close(r)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    assert out == b"refused dropped", out
    assert v.tobytes() == kspeed.Catalog.open(space).read_source(want[0])
    del v
    got = b.ids.tolist() + [i for x in loader for i in x.ids.tolist()]
    assert got == want


def test_offsets_of_a_trailing_empty_sample(tmp_path):
    """A batch ending in an empty sample: its offset lies inside array()."""
    src = tmp_path / "src" / "c"
    src.mkdir(parents=True)
    (src / "x0.bin").write_bytes(b"0123456789")
    (src / "x1.bin").write_bytes(b"")
    sp = str(tmp_path / "sp")
    cli("preload", "--source", str(tmp_path / "src"), "--space", sp)
    with kspeed.Loader(sp, batch_size=2, shuffle=False, ring_bytes="128KiB") as loader:
        b = loader.next_batch()
        assert b.lengths.tolist() == [10, 0]
        a = b.array()
        assert 0 <= b.offsets[1] <= a.size, b.offsets.tolist()
        assert a[b.offsets[0]: b.offsets[0] + 10].tobytes() == b"0123456789"
        del a


def test_cluster_from_the_launchers_environment(tree, space, serve, token_file, monkeypatch):
    """cluster="env": the node list from KSPEED_NODES, rank and world from
    torchrun's variables."""
    monkeypatch.setenv("KSPEED_NODES", serve.addr)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    cat = kspeed.Catalog.open(space)
    with kspeed.Loader(source=tree, catalog=os.path.join(space, "catalog.ksc"), cluster="env",
                       token_file=token_file, batch_size=8, seed=3, ring_bytes="256KiB") as loader:
        assert (loader.rank, loader.world) == (1, 2)
        ids = read_epoch(loader, cat)
        assert len(ids) == loader.epoch_len
        # Every non-empty sample came from the node (an empty one needs no
        # transfer; read-ahead may add more, none came from the source).
        st = loader.stats()
        assert st["remote_samples"] >= sum(1 for i in ids if cat.lengths[i] > 0), st
        assert st["source_reads"] == 0, st
    with kspeed.Loader(space, batch_size=8, seed=3, rank=1, world=2, ring_bytes="256KiB") as local:
        assert ids == [i for b in local for i in b.ids.tolist()]


@pytest.mark.parametrize("seed", range(4))
def test_random_holds_and_releases_never_show_changed_bytes(space, seed):
    """Random sequences of next / take views / drop views / release / drop
    batches on a small ring: every view alive is checked against its source
    after every step; refusals are named errors, never reuse."""
    import random

    rng = random.Random(seed)
    cat = kspeed.Catalog.open(space)
    src = {i: cat.read_source(i) for i in range(len(cat))}
    loader = kspeed.Loader(space, batch_size=rng.choice([1, 3, 4, 7]), seed=seed, ring_bytes="192KiB",
                           batches_in_flight=rng.choice([1, 2, 4]), pollers=rng.choice([1, 2]))
    batches, views = [], []  # views: (sample id, numpy view)
    delivered, errors = 0, 0
    for step in range(600):
        op = rng.random()
        try:
            if op < 0.45:
                b = loader.next_batch()
                if b is None:
                    loader.set_epoch(loader.epoch + 1)  # the next epoch goes on: views stay
                    continue
                delivered += len(b)
                batches.append(b)
            elif op < 0.7 and any(not x.released for x in batches):
                b = rng.choice([x for x in batches if not x.released])
                if rng.random() < 0.7:
                    i = rng.randrange(len(b))
                    views.append((int(b.ids[i]), b.sample(i)))
                else:
                    views.append(((b.ids.tolist(), b.offsets.tolist(), b.lengths.tolist()), np.from_dlpack(b)))
            elif op < 0.85 and views:
                views.pop(rng.randrange(len(views)))
            elif op < 0.93 and batches:
                batches.pop(rng.randrange(len(batches)))
            elif batches:
                rng.choice(batches).release()
        except kspeed.BatchInUseError as e:
            errors += 1
            if views:
                views.pop(0)
        if len(batches) > 4:
            batches.pop(0)
        for key, v in views:
            if isinstance(key, tuple):
                ids, offs, lens = key
                for sid, o, n in zip(ids, offs, lens):
                    assert v[o: o + n].tobytes() == src[sid], f"step {step}: sample {sid} changed under a view"
            else:
                assert v.tobytes() == src[key], f"step {step}: sample {key} changed under a view"
        v = None  # the loop variable would keep the last view (and its batch) alive
    print(f"seed {seed}: {delivered} samples delivered, {errors} refusals")
    assert delivered > len(cat)  # at least one epoch boundary crossed
    del batches, views
    gc.collect()
    loader.close()


def test_preload_and_verify_release_the_gil(tmp_path):
    """Another Python thread runs while preload and verify work."""
    import threading
    import time

    src = make_tree(str(tmp_path / "src"), n=1500, max_len=30000)
    sp = str(tmp_path / "sp")
    for work in (lambda: kspeed.preload(src, sp, threads=1), lambda: kspeed.verify(sp, threads=1)):
        span = []

        def run():
            span.append(time.perf_counter())
            work()
            span.append(time.perf_counter())

        t = threading.Thread(target=run)
        t.start()
        last = 0.0
        while len(span) < 2:
            last = time.perf_counter()
        t.join()
        start, end = span
        # This thread ran in the second half of the call: impossible if the
        # call held the GIL (it could run only before it or after `end`, and
        # after `end` the loop stops without a new timestamp).
        assert last > start + (end - start) / 2, (start, last, end)


def test_placement_follows_the_local_rank(space, monkeypatch):
    """The loader takes its local rank from torchrun's variables and pins
    its pollers to its own slice of the cores it may use."""
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with kspeed.Loader(space, batch_size=4, ring_bytes="256KiB") as loader:
        p = loader.stats()["placement"]
    assert (p["local_rank"], p["local_world_size"]) == (1, 2), p
    assert p["local_rank_from"] == "LOCAL_RANK/LOCAL_WORLD_SIZE", p
    mask = os.sched_getaffinity(0)
    assert p["slice_cores"] and set(p["slice_cores"]) <= mask, (p, mask)
    assert len(p["pinned_cores"]) == p["pollers"] >= 1, p
    assert all(c in p["slice_cores"] for c in p["pinned_cores"]), p
    monkeypatch.setenv("LOCAL_RANK", "2")
    with pytest.raises(kspeed.ConfigError, match="local rank 2 is not below local world size 2") as e:
        kspeed.Loader(space, batch_size=4, ring_bytes="256KiB")
    assert e.value.kind == "BadLauncher"


def _fake_sysfs(root):
    """A 2-node, 64-CPU sysfs tree: node 0 holds the even CPUs, node 1 the
    odd ones (so this machine's CPUs 0 and 1 sit on different nodes)."""
    def w(rel, text):
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)

    w("devices/system/cpu/online", "0-63\n")
    for node in (0, 1):
        w(f"devices/system/node/node{node}/cpulist", ",".join(str(c) for c in range(node, 64, 2)) + "\n")
    for c in range(64):
        w(f"devices/system/cpu/cpu{c}/topology/thread_siblings_list", f"{c % 32},{c % 32 + 32}\n")


def test_placement_keyword_arguments_override_the_environment(space, tmp_path, monkeypatch):
    """local_rank/local_world_size, poller_numa_node and sysfs_root reach
    the Rust builder: explicit values win over the environment's."""
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.delenv("KSPEED_LOCAL_RANK", raising=False)
    monkeypatch.delenv("KSPEED_LOCAL_WORLD_SIZE", raising=False)
    with kspeed.Loader(space, batch_size=4, ring_bytes="256KiB", local_rank=1, local_world_size=2) as loader:
        p = loader.stats()["placement"]
    assert (p["local_rank"], p["local_world_size"]) == (1, 2), p
    assert p["local_rank_from"] == "option", p

    sys_root = tmp_path / "sys"
    _fake_sysfs(sys_root)
    # The environment points elsewhere: the argument wins.
    monkeypatch.setenv("KSPEED_SYSFS_ROOT", str(tmp_path / "missing"))
    mask = os.sched_getaffinity(0)
    for node in (0, 1):
        want = sorted(c for c in mask if c % 2 == node)
        if not want:
            continue
        with kspeed.Loader(
            space, batch_size=4, ring_bytes="256KiB", sysfs_root=sys_root, poller_numa_node=node
        ) as loader:
            p = loader.stats()["placement"]
            assert p["numa_node"] == node, p
            assert p["slice_cores"] == want, (p, want)
            assert sum(1 for _ in loader) > 0
    # The tree the argument names is the one read: a broken one is named.
    (sys_root / "devices/system/node/node1/cpulist").write_text("1-x\n")
    with pytest.raises(kspeed.Error, match=r'node1/cpulist: "x" is not a CPU number'):
        kspeed.Loader(space, batch_size=4, ring_bytes="256KiB", sysfs_root=sys_root)


@pytest.mark.parametrize(
    "kwargs, exc, msg",
    [
        ({"local_rank": 0}, ValueError, "both local_rank and local_world_size"),
        ({"local_world_size": 2}, ValueError, "both local_rank and local_world_size"),
        ({"local_rank": 2, "local_world_size": 2}, ValueError, "local_rank 2 is not below local_world_size 2"),
        ({"local_rank": "0", "local_world_size": 2}, TypeError, 'option local_rank: "0" is not an integer'),
        ({"local_rank": 0, "local_world_size": 0}, ValueError, "option local_world_size: 0 is below the minimum"),
        ({"poller_numa_node": -1}, ValueError, "option poller_numa_node: -1 is below the minimum"),
        ({"poller_numa_node": 1.0}, TypeError, r"option poller_numa_node: 1\.0 is not an integer"),
        ({"sysfs_root": 3}, TypeError, "sysfs_root must be a path"),
        ({"sysfs_root": "/nonexistent/kspeed-sys"}, ValueError, "sysfs_root: /nonexistent/kspeed-sys does not exist"),
    ],
)
def test_placement_keyword_arguments_are_checked(space, kwargs, exc, msg):
    with pytest.raises(exc, match=msg):
        kspeed.Loader(space, batch_size=4, ring_bytes="256KiB", **kwargs)


# Memory tier views (tier_views=True): samples served in place from the tier.


def _addr(a):
    return a.__array_interface__["data"][0]


def test_tier_views_serve_every_sample_exactly_over_3_epochs(space):
    """The whole set in the tier: epoch 0 reads the disk and fills the tier
    (every batch in the ring), epochs 1 and 2 serve from the tier in place.
    Bytes and labels of every sample equal the source files through every
    view; a batch not in the ring gives one packed copy for array() and
    DLPack; per-sample views point into the tier (the same address for a
    sample in both later epochs: no copy)."""
    cat = kspeed.Catalog.open(space)
    n = len(cat)
    loader = kspeed.Loader(space, batch_size=7, seed=3, ring_bytes="256KiB", tier_bytes="8MiB", tier_views=True,
                           pollers=2)
    assert loader.landing_info()["tier_samples"] == n, "the tier holds the whole set"
    not_in_ring = {}
    where = {}  # (epoch, sample id) -> address of its view
    for epoch in range(3):
        loader.set_epoch(epoch)
        ids = []
        for b in loader:
            bid, lab, lens, offs = b.ids, b.labels, b.lengths, b.offsets
            arr = b.array()
            if b.in_ring:
                assert arr.size >= int(lens.sum())
            else:
                not_in_ring[epoch] = not_in_ring.get(epoch, 0) + 1
                assert not b.is_zero_copy
                # Samples back to back in one copy, made once.
                assert offs.tolist() == np.concatenate(([0], np.cumsum(lens)[:-1])).tolist()
                assert arr.size == int(lens.sum())
                assert _addr(b.array()) == _addr(arr), "array() copied again"
                x = np.from_dlpack(b)
                assert x.dtype == np.uint8 and _addr(x) == _addr(arr) and x.tobytes() == arr.tobytes()
                del x
            views = b.samples()
            for i in range(len(b)):
                sid = int(bid[i])
                want = cat.read_source(sid)
                assert lab[i] == cat.labels[sid] and lens[i] == len(want)
                assert views[i].tobytes() == want, f"epoch {epoch} sample {sid}"
                assert b.sample(i).tobytes() == want and b[i].tobytes() == want
                assert bytes(b.memoryview(i)) == want and b.tobytes(i) == want
                assert arr[offs[i]: offs[i] + lens[i]].tobytes() == want
                if len(want):
                    where[(epoch, sid)] = _addr(views[i])
            ids.extend(bid.tolist())
            del arr, views
        assert sorted(ids) == list(range(n)), f"epoch {epoch}"
    # Epoch 0 filled the tier (nothing to serve from it yet); the later
    # epochs were served from it.
    assert not_in_ring.get(0, 0) == 0 and not_in_ring.get(1, 0) > 0 and not_in_ring.get(2, 0) > 0, not_in_ring
    assert loader.stats()["tier_hits"] > 0
    nonempty = [i for i in range(n) if cat.lengths[i] > 0]
    same = sum(where[(1, i)] == where[(2, i)] for i in nonempty)
    # (A sample read at an epoch's very end and again at the next one's
    # start may be read ahead before the tier has it: then it is in the ring.)
    assert same >= len(nonempty) * 3 // 4, f"{same} of {len(nonempty)} samples at one place in the tier"
    loader.close()


def test_tier_views_off_keeps_every_batch_in_the_ring(space):
    """The default: samples from the tier are copied into the ring, and
    every batch is one ring span."""
    cat = kspeed.Catalog.open(space)
    with kspeed.Loader(space, batch_size=7, seed=3, ring_bytes="512KiB", tier_bytes="8MiB") as loader:
        for epoch in range(2):
            loader.set_epoch(epoch)
            for b in loader:
                assert b.in_ring
                arr = b.array()
                for i, sid in enumerate(b.ids.tolist()):
                    assert arr[b.offsets[i]: b.offsets[i] + b.lengths[i]].tobytes() == cat.read_source(sid)
                del arr
        assert loader.stats()["tier_hits"] > 0


@pytest.mark.parametrize("close", [True, False])
def test_tier_view_outlives_next_close_and_the_loader(space, close):
    """Views of a batch served from the tier, held while the next batches
    are read and after the loader is closed (or not) and dropped: their
    bytes stay right (the batch keeps the Rust loader, and so the tier's
    memory, alive)."""
    cat = kspeed.Catalog.open(space)
    loader = kspeed.Loader(space, batch_size=5, seed=4, ring_bytes="512KiB", tier_bytes="8MiB", tier_views=True,
                           batches_in_flight=2)
    assert sum(len(x) for x in loader) == len(cat)  # epoch 0 fills the tier
    loader.set_epoch(1)
    b = loader.next_batch()
    while b.in_ring:
        b = loader.next_batch()
    ids = b.ids.tolist()
    views = b.samples()
    mv = b.memoryview(len(b) - 1)
    packed = b.array()
    cap = b.__dlpack__()
    assert b.views == len(ids) + 3
    want = [cat.read_source(i) for i in ids]
    del b
    gc.collect()
    # Later batches come meanwhile (the held batch's ring space stays
    # reserved until it goes: releases reach the loader in batch order).
    for _ in range(3):
        x = loader.next_batch()
        assert [x.sample(i).tobytes() for i in range(len(x))] == [cat.read_source(int(i)) for i in x.ids]
        assert [v.tobytes() for v in views] == want
    del x
    if close:
        loader.close()
        assert loader.closed
    del loader
    gc.collect()
    assert [v.tobytes() for v in views] == want
    assert bytes(mv) == want[-1]
    assert packed.tobytes() == b"".join(want)
    whole = np.from_dlpack(_Capsule(cap))
    assert whole.tobytes() == b"".join(want)
    del views, mv, packed, whole, cap
    gc.collect()


def test_tier_views_bad_arguments(space):
    for v in (1, "yes", None):
        with pytest.raises(TypeError, match="option tier_views: .* is not true or false"):
            kspeed.Loader(space, tier_bytes="8MiB", tier_views=v)
    with pytest.raises(ValueError, match=r"tier_views=True .* GPU ring \(gpu_ring=0\)"):
        kspeed.Loader(space, tier_views=True, gpu_ring=0)
    # The extension checks its configuration too.
    with pytest.raises(TypeError, match="tier_views"):
        kspeed._kspeed._Loader({"space": space, "tier_views": 2})
    with pytest.raises(ValueError, match="tier_views=True .* GPU ring"):
        kspeed._kspeed._Loader({"space": space, "tier_views": True, "gpu_ring": 0})


# Views are read-only: the landing ring belongs to the loader, and a memory
# tier sample is filled once and served again every epoch.


def test_views_are_read_only_and_writes_never_reach_the_tier(space):
    cat = kspeed.Catalog.open(space)
    loader = kspeed.Loader(space, batch_size=5, seed=3, ring_bytes="256KiB", tier_bytes="8MiB", tier_views=True)
    in_tier = 0
    for epoch in range(3):
        loader.set_epoch(epoch)
        for b in loader:
            views = [b.sample(0), b[0], b.array(), np.from_dlpack(b)] + b.samples()
            for v in views:
                assert not v.flags.writeable
                if v.size:
                    with pytest.raises(ValueError, match="read-only"):
                        v[0] = 1
            mv = b.memoryview(0)
            assert mv.readonly
            if len(mv):
                with pytest.raises(TypeError):
                    mv[0] = 1
            for i in range(len(b)):
                sid = int(b.ids[i])
                in_tier += b.sample_in_tier(i)
                assert b.sample(i).tobytes() == cat.read_source(sid), f"epoch {epoch}: sample {sid} changed"
                # The DLPack export of a tier sample is a copy: writable, and
                # a write does not reach the tier (checked next epoch).
                s = np.from_dlpack(_Capsule(b.sample_dlpack(i)))
                assert s.tobytes() == cat.read_source(sid)
            del views, mv, s, b
    assert in_tier > 0, "no sample came from the tier"


def test_catalog_builds_what_the_cli_builds(tree, tmp_path):
    out = tmp_path / "py.ksc"
    r = kspeed.catalog(tree, out)
    assert r["samples"] == 123 and r["catalog"] == str(out) and r["source"] == "dir:" + os.path.realpath(tree)
    assert r["notes"] == [] and r["classes"] == 4
    assert oct(os.stat(out).st_mode & 0o777) == oct(0o600)
    cli("catalog", "--source", tree, "--out", tmp_path / "cli.ksc")
    a, b = kspeed.Catalog.open(out), kspeed.Catalog.open(tmp_path / "cli.ksc")
    for col in ("lengths", "crc32c", "labels", "file_index", "file_offset"):
        assert (getattr(a, col) == getattr(b, col)).all(), col
    assert (a.file_paths, a.class_names, a.source, a.identity) == (b.file_paths, b.class_names, b.source, b.identity)
    # source= mode reads with it.
    with kspeed.Loader(source=tree, catalog=out, batch_size=8) as loader:
        for batch in loader:
            for i, sid in enumerate(batch.ids.tolist()):
                assert batch.tobytes(i) == a.read_source(sid)
    with pytest.raises(kspeed.Error, match="does-not-exist"):
        kspeed.catalog(tmp_path / "does-not-exist", tmp_path / "x.ksc")
    with pytest.raises(TypeError, match="skip_special must be True or False"):
        kspeed.catalog(tree, out, skip_special=1)


def test_a_source_that_is_not_the_catalogs_is_refused(tree, tmp_path):
    """source= with catalog= of another source: refused (the catalog's own
    source would be read instead of the one named)."""
    other = make_tree(str(tmp_path / "other"), n=10)
    cat = tmp_path / "c.ksc"
    cli("catalog", "--source", tree, "--out", cat)
    with pytest.raises(kspeed.Error, match=r"was built from dir:.*, not dir:.*other"):
        kspeed.Loader(source=other, catalog=cat)
    with kspeed.Loader(source=tree, catalog=cat) as loader:
        assert loader.epoch_len == 123


def test_explicit_rank_world_against_the_launcher_is_refused(space, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"rank=0, world=1 contradict the launcher's environment variables "
                                         r"RANK=0, WORLD_SIZE=2.*ignore_launcher_env=True"):
        kspeed.Loader(space, rank=0, world=1)
    with kspeed.Loader(space, rank=0, world=1, ignore_launcher_env=True) as l:
        assert (l.rank, l.world) == (0, 1)
    with kspeed.Loader(space, rank=0, world=2) as l:  # agrees with the launcher
        assert l.world == 2
    with kspeed.Loader(space) as l:
        assert (l.rank, l.world) == (0, 2)
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.setenv("SLURM_PROCID", "1")
    monkeypatch.setenv("SLURM_NTASKS", "4")
    with pytest.raises(ValueError, match="SLURM_PROCID=1, SLURM_NTASKS=4"):
        kspeed.Loader(space, rank=0, world=4)


def test_partial_space_reads_the_rest_from_the_source(tmp_path):
    # A space holding about a third of the dataset (preload max_bytes): the
    # loader reads the rest from the source, every sample exact, and says
    # how much came from where.
    src = make_tree(str(tmp_path / "src"), n=60, max_len=20000)
    sp = str(tmp_path / "sp")
    cat_all = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(src) for f in fs)
    r = kspeed.preload(src, sp, max_bytes=cat_all // 3)
    assert 0 < r["held_samples"] < 60
    cat = kspeed.Catalog.open(sp)
    loader = kspeed.Loader(sp, batch_size=4, ring_bytes="1MiB", end_epoch=2)
    seen = 0
    for epoch in range(2):
        loader.set_epoch(epoch)
        for b in loader:
            for i, sid in enumerate(b.ids):
                assert b.sample(i).tobytes() == cat.read_source(int(sid))
                seen += 1
    assert seen == 120
    st = loader.stats()
    # Empty samples are read from nowhere.
    nonempty = int((cat.lengths > 0).sum())
    assert st["disk_reads"] + st["source_reads"] == 2 * nonempty
    assert st["disk_reads"] <= 2 * r["held_samples"] and st["disk_reads"] > 0
    assert st["source_reads"] > 0 and st["source_bytes"] > 0
    lead = st["source_lead"]
    assert lead["count"] > 0 and lead["late"] <= lead["count"] and lead["p10_s"] <= lead["p50_s"], lead
    with pytest.raises(ValueError):
        kspeed.preload(src, str(tmp_path / "sp2"), max_bytes=0)


def test_the_default_ring_is_sized_from_the_batch(space):
    # ring_bytes="auto" (the default): six batches of the mean sample from
    # 4 MiB, at most twice the dataset, at least a batch of the largest.
    # The fixture's dataset is small, so twice its slots bound the ring.
    cat = kspeed.Catalog.open(space)
    with kspeed.Loader(space, batch_size=8, seed=3, mlock=False) as default, \
            kspeed.Loader(space, batch_size=8, seed=3, mlock=False, ring_bytes="auto") as auto:
        ring = default.landing_info()["bytes"]
        assert auto.landing_info()["bytes"] == ring
        read_epoch(default, cat, check_bytes=True)
    assert 0 < ring <= 64 << 20, ring
    with pytest.raises(ValueError, match="option ring_bytes: 0 is below the minimum"):
        kspeed.Loader(space, ring_bytes=0)
    with pytest.raises(ValueError, match="ring_bytes: 'autos' is not a size .*or 'auto'"):
        kspeed.Loader(space, ring_bytes="autos")


@pytest.mark.parametrize("policy", ["next-use", "min", "lru"])
def test_cache_area_keeps_source_samples_for_the_next_loader(tree, space, tmp_path, policy):
    # A source read directly, with an NVMe cache area of about a third of
    # it: every sample exact; the stats say what the area did; a second
    # loader (as a restarted job would) finds what the first kept.
    cat = kspeed.Catalog.open(space)
    budget = int(cat.lengths.sum()) // 3
    kw = dict(source=tree, catalog=os.path.join(space, "catalog.ksc"), batch_size=16, seed=3,
              ring_bytes="2MiB", cache_dir=str(tmp_path / "cache"), cache_bytes=budget,
              cache_policy=policy, end_epoch=3)
    with kspeed.Loader(**kw) as loader:
        for _ in range(3):
            assert sorted(read_epoch(loader, cat)) == list(range(len(cat)))
        c = loader.stats()["cache"]
        assert c["slots"] > 0 and c["area_bytes"] % 4096 == 0 and c["corrupt"] == 0, c
        assert c["held"] <= c["slots"] and c["area_bytes"] <= budget, c
    assert os.path.isfile(tmp_path / "cache" / "rank0" / "cache.journal")
    with kspeed.Loader(**kw) as loader:
        assert sorted(read_epoch(loader, cat)) == list(range(len(cat)))
        c = loader.stats()["cache"]
        if policy != "lru":
            assert c["hits"] > 0, c
    with pytest.raises(kspeed.ConfigError, match="cache_bytes"):
        kspeed.Loader(**{**kw, "cache_bytes": 0})


def test_cache_area_in_memory_hits_and_writes_nothing(tree, space, tmp_path, monkeypatch):
    # cache_dir=":memory:": the area in this process's memory, by next
    # use: exact, hits from the second epoch, no folder made (here, in the
    # working directory), empty again for the next loader.
    monkeypatch.chdir(tmp_path)
    cat = kspeed.Catalog.open(space)
    budget = int(cat.lengths.sum()) // 3
    kw = dict(source=tree, catalog=os.path.join(space, "catalog.ksc"), batch_size=16, seed=3,
              ring_bytes="2MiB", cache_dir=":memory:", cache_bytes=budget, end_epoch=3)
    with kspeed.Loader(**kw) as loader:
        for _ in range(3):
            assert sorted(read_epoch(loader, cat)) == list(range(len(cat)))
        c = loader.stats()["cache"]
        assert c["hits"] > 0 and c["corrupt"] == 0 and c["area_bytes"] <= budget, c
    assert os.listdir(tmp_path) == []
    # One epoch (no read ahead into a next epoch, whose reads could hit).
    with kspeed.Loader(**{**kw, "end_epoch": 1}) as loader:
        assert sorted(read_epoch(loader, cat)) == list(range(len(cat)))
        assert loader.stats()["cache"]["hits"] == 0


def test_a_memory_level_above_the_area_on_disk_serves_first(tree, space, tmp_path):
    # cache_memory_bytes above cache_dir (a folder): exact, both levels
    # hit, their counters apart in stats(); refused without a folder below.
    cat = kspeed.Catalog.open(space)
    budget = int(cat.lengths.sum()) // 3
    kw = dict(source=tree, catalog=os.path.join(space, "catalog.ksc"), batch_size=16, seed=3,
              ring_bytes="2MiB", cache_dir=str(tmp_path / "cache"), cache_bytes=budget,
              cache_memory_bytes=budget // 2, cache_policy="min", end_epoch=4)
    with kspeed.Loader(**kw) as loader:
        for _ in range(4):
            assert sorted(read_epoch(loader, cat)) == list(range(len(cat)))
        st = loader.stats()
    mem, disk = st["cache_memory"], st["cache"]
    assert mem["hits"] > 0 and disk["hits"] > 0, st
    assert mem["area_bytes"] <= budget // 2 < disk["area_bytes"] <= budget, st
    # Empty samples are read by no one (the tree has some).
    empty = int((cat.lengths == 0).sum())
    assert mem["hits"] + disk["hits"] + st["disk_reads"] == 4 * (len(cat) - empty), st
    with pytest.raises(kspeed.ConfigError, match="cache_memory_bytes.*folder"):
        kspeed.Loader(**{**kw, "cache_dir": ":memory:"})
