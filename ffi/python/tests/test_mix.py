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
