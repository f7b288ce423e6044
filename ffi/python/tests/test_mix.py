"""kspeed.Loader(mix=...): several datasets read side by side in one id
space, in the weights' exact counts, each sample labelled with its dataset
(``batch.dataset``) and byte-exact."""

import os
import numpy as np
import pytest

import kspeed
from conftest import cli, make_tree, require


@pytest.fixture(scope="module")
def second(tmp_path_factory):
    """A second dataset read from its source, with a catalog file."""
    root = make_tree(str(tmp_path_factory.mktemp("src2")), n=17, classes=("x", "y"))
    cat = str(tmp_path_factory.mktemp("cat2") / "two.ksc")
    cli("catalog", "--source", root, "--out", cat)
    return root, cat


@pytest.mark.parametrize("weights", [(0.7, 0.3), ("repeat=1", "choose=40")])
def test_mix_counts_datasets_and_bytes(space, second, weights):
    root2, cat2 = second
    cats = [kspeed.Catalog.open(os.path.join(space, "catalog.ksc")), kspeed.Catalog.open(cat2)]
    n0 = len(cats[0])
    loader = kspeed.Loader(
        mix=[(space, weights[0]), (cat2, weights[1])],
        mix_epoch_size=100 if isinstance(weights[0], float) else None,
        batch_size=8,
        seed=3,
        mlock=False,
    )
    per_epoch = []
    for epoch in range(2):
        loader.set_epoch(epoch)
        counts = [0, 0]
        order = []
        for b in loader:
            ds = b.dataset
            assert ds.dtype == np.int64 and len(ds) == len(b)
            ids = b.ids
            for i in range(len(b)):
                d = int(ds[i])
                counts[d] += 1
                # Ids of dataset 1 come after all of dataset 0's.
                assert (ids[i] >= n0) == (d == 1), (ids[i], d, n0)
                order.append(int(ids[i]))
                local = int(ids[i]) - (n0 if d else 0)
                assert b.sample(i).tobytes() == cats[d].read_source(local), (d, local)
                assert b.labels[i] == cats[d].labels[local]
        per_epoch.append(order)
        if isinstance(weights[0], float):
            assert counts == [70, 30], counts
        else:
            assert counts == [n0, 40], counts
    assert per_epoch[0] != per_epoch[1], "epochs differ"
    loader.close()


@pytest.mark.parametrize("views", [False, True])
def test_mix_with_a_memory_tier_reads_a_repeated_dataset_from_memory(space, second, views):
    """A memory tier over a mixture: the 17-sample dataset drawn 3 times an
    epoch is what the tier holds (its members chosen by the mixture's
    draws), so after its first reads its draws are tier hits; every sample
    byte-exact, copied into the ring or handed out in place."""
    root2, cat2 = second
    cats = [kspeed.Catalog.open(os.path.join(space, "catalog.ksc")), kspeed.Catalog.open(cat2)]
    n0 = len(cats[0])
    loader = kspeed.Loader(
        mix=[(space, "choose=20"), (cat2, "repeat=3")],
        batch_size=8,
        seed=3,
        mlock=False,
        tier_bytes="4MiB",
        tier_views=views,
        end_epoch=2,
    )
    drawn = 0
    for epoch in range(2):
        loader.set_epoch(epoch)
        for b in loader:
            ids = b.ids
            for i in range(len(b)):
                d = int(b.dataset[i])
                local = int(ids[i]) - (n0 if d else 0)
                assert b.sample(i).tobytes() == cats[d].read_source(local), (d, local)
                drawn += d == 1 and cats[1].lengths[local] > 0
    stats = loader.stats()
    # Each of the repeated dataset's samples is read once (or again while
    # that read is in flight); the rest of its draws are hits.
    assert drawn - 2 * len(cats[1]) <= stats["tier_hits"] <= drawn + 2 * 20, (stats["tier_hits"], drawn)
    loader.close()


def test_mix_is_refused_with_space_and_names_a_bad_weight(space, second):
    _, cat2 = second
    with pytest.raises(ValueError, match="exactly one of"):
        kspeed.Loader(space, mix=[(cat2, 0.5)])
    with pytest.raises(Exception, match="mix"):
        kspeed.Loader(mix=[(space, "-1"), (cat2, 0.5)], mlock=False)


def _take(loader, batches=None):
    """(dataset, id) of the next `batches` batches (all of the epoch if None)."""
    got = []
    for i, b in enumerate(loader):
        got += [(int(d), int(x)) for d, x in zip(b.dataset, b.ids)]
        del b
        if batches is not None and i + 1 == batches:
            break
    return got


def test_mix_resumes_under_new_weights(space, second):
    """A state saved with weights A (40 + 8 samples per epoch) loaded by a
    loader with weights B (60 + 12): the rest of the epoch follows B (B's
    counts less what A had delivered), no sample twice in the epoch; a
    state taken in that rest resumes it exactly in a fresh loader of B."""
    _, cat2 = second

    def make(c0, c1):
        return kspeed.Loader(mix=[(space, f"choose={c0}"), (cat2, f"choose={c1}")],
                             batch_size=8, seed=3, mlock=False)

    a = make(40, 8)
    a.set_epoch(1)
    first = _take(a, 3)
    state = a.state_dict()
    a.close()
    assert state["mix_counts"] == [40, 8]
    assert state["job_position"][:8] == b"KSPDMIX1"
    used = [sum(1 for d, _ in first if d == k) for k in (0, 1)]
    assert sum(used) == 24

    b = make(60, 12)
    b.load_state_dict(state)
    one = _take(b, 1)
    mid = b.state_dict()
    rest = one + _take(b)
    b.close()
    assert [sum(1 for d, _ in rest if d == k) for k in (0, 1)] == [60 - used[0], 12 - used[1]]
    ids = [x for _, x in first + rest]
    assert len(ids) == len(set(ids)) == 72, "each sample at most once in the epoch"

    c = make(60, 12)
    c.load_state_dict(mid)
    assert _take(c) == rest[len(one):]
    c.close()


def test_audit_of_a_mixture_across_new_weights(space, second):
    """``kspeed.audit`` of a mixture's rank positions alone: 2 ranks of
    weights A (40 + 8) take 2 batches each, 3 ranks of weights B (60 + 12)
    load a state and finish the epoch (72 - 32 = 40 entries over 3 ranks:
    2 padding duplicates). Without the first world's positions, or with a
    rank's missing, it names the difference."""
    _, cat2 = second
    first, states = [], []
    for rank in range(2):
        a = kspeed.Loader(mix=[(space, "choose=40"), (cat2, "choose=8")], batch_size=8, seed=3, mlock=False,
                          rank=rank, world=2, ignore_launcher_env=True)
        a.set_epoch(1)
        _take(a, 2)
        states.append(a.state_dict())
        first.append(a.save_position())
        a.close()
    assert first[0][:8] == b"KSPDPOS4" and len(first[0]) == 120 + 24 * 2
    second_world = []
    for rank in range(3):
        b = kspeed.Loader(mix=[(space, "choose=60"), (cat2, "choose=12")], batch_size=8, seed=3, mlock=False,
                          rank=rank, world=3, ignore_launcher_env=True)
        b.load_state_dict(states[rank % 2])
        assert len(_take(b)) == 14
        second_world.append(b.save_position())
        b.close()
    assert kspeed.audit(first + second_world) == ["epoch 1: 72 samples, each exactly once, and 2 padding duplicates"]
    with pytest.raises(kspeed.DataError, match="missing"):
        kspeed.audit(second_world)
    with pytest.raises(kspeed.DataError, match="1 rank positions for a world of 2"):
        kspeed.audit(first[1:] + second_world)


@pytest.mark.parametrize("new_world", [2, 3])
def test_dataset_mixture_resumes_under_new_weights(space, second, new_world):
    """``KSpeedDataset(mix=...)`` with ``num_workers=0`` through torchdata's
    StatefulDataLoader: 2 ranks of weights A (40 + 8 per epoch) take 13
    samples each (mid-batch) and save; ``new_world`` ranks of weights B
    (60 + 12) load any rank's state and finish the epoch: the rest follows
    B (B's counts less what A used), every sample of the epoch once (the
    padding the new world needs aside), each byte-exact; a state taken in
    that rest resumes exactly in a fresh dataset of B; workers are refused
    by name."""
    require("torch")
    require("torchdata")
    from torchdata.stateful_dataloader import StatefulDataLoader

    from kspeed.torch import KSpeedDataset

    _, cat2 = second
    cats = [kspeed.Catalog.open(os.path.join(space, "catalog.ksc")), kspeed.Catalog.open(cat2)]
    n0 = len(cats[0])
    assert n0 >= 60

    def make(c0, c1, rank, world):
        ds = KSpeedDataset(mix=[(space, f"choose={c0}"), (cat2, f"choose={c1}")], batch_size=8, seed=3,
                           mlock=False, ring_bytes="256KiB", rank=rank, world=world, return_id=True,
                           ignore_launcher_env=True)
        return ds, StatefulDataLoader(ds, batch_size=None, num_workers=0)

    def check(t, sid):
        d = int(sid >= n0)
        assert bytes(t.numpy()) == cats[d].read_source(sid - (n0 if d else 0)), sid
        return d, sid

    first, states = [], []
    for rank in range(2):
        ds, dl = make(40, 8, rank, 2)
        assert ds.catalog is None and len(ds) == 24
        it = iter(dl)
        for _ in range(13):
            t, _, sid = next(it)
            first.append(check(t, sid))
        states.append(dl.state_dict())
        del it, dl, ds
    # The dataset's own state, inside the DataLoader's.
    assert _find(states[0], "mix_counts") == [40, 8]
    assert _find(states[0], "job_position")[:8] == b"KSPDMIX1"
    used = [sum(1 for d, _ in first if d == k) for k in (0, 1)]
    assert sum(used) == 26
    rest = (60 - used[0]) + (12 - used[1])
    per_rank = -(-rest // new_world)
    later, mid = [], None
    for rank in range(new_world):
        ds, dl = make(60, 12, rank, new_world)
        dl.load_state_dict(states[rank % 2])
        got = [check(t, sid) for t, _, sid in dl]
        assert len(got) == per_rank, f"rank {rank} of {new_world}"
        # Rank r's k-th sample is entry r + k*W of the rest; past it: padding.
        later += [g for k, g in enumerate(got) if rank + k * new_world < rest]
        if rank == 0:
            # A state 5 samples into the rest, and what follows it.
            ds, dl = make(60, 12, rank, new_world)
            dl.load_state_dict(states[0])
            it = iter(dl)
            for _ in range(5):
                next(it)
            mid = (dl.state_dict(), got[5:])
            del it
        del dl, ds
    assert [sum(1 for d, _ in later if d == k) for k in (0, 1)] == [60 - used[0], 12 - used[1]]
    ids = [x for _, x in first + later]
    assert len(ids) == len(set(ids)) == 72, "each sample once in the epoch"
    # The mid state in a fresh dataset of B: the same rest, exactly.
    state, after = mid
    ds, dl = make(60, 12, 0, new_world)
    dl.load_state_dict(state)
    assert [check(t, sid) for t, _, sid in dl] == after
    with pytest.raises(ValueError, match="num_workers=0"):
        ds.batches_per_epoch(num_workers=2)
    del dl, ds
    from kspeed.torch import KSpeedImageFolder

    with pytest.raises(ValueError, match="KSpeedDataset"):
        KSpeedImageFolder(mix=[(space, 0.5), (cat2, 0.5)])
    with pytest.raises(ValueError, match="not two"):
        KSpeedDataset(space, mix=[(space, 0.5), (cat2, 0.5)])


def _find(state, key):
    """`state[key]`, or the first nested dict's that has `key`."""
    if isinstance(state, dict):
        if key in state:
            return state[key]
        for v in state.values():
            got = _find(v, key)
            if got is not None:
                return got
    return None
