"""kspeed.Loader(mix=...): several datasets read side by side in one id
space, in the weights' exact counts, each sample labelled with its dataset
(``batch.dataset``) and byte-exact."""

import os
import numpy as np
import pytest

import kspeed
from conftest import cli, make_tree


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
