"""Resume at another world size (issue 29 part 1): a job of 4 ranks saves
its state mid-epoch and resumes on 3 and on 6 ranks, through
``kspeed.Loader.state_dict`` and through torchdata's ``StatefulDataLoader``
over ``KSpeedDataset``; the union of the ids delivered is the epoch
exactly once (plus the padding the new world needs), every sample's bytes
equal the source's, and ``kspeed.audit`` agrees (and catches a rank's file
missing)."""

from collections import Counter

import pytest

import kspeed
from conftest import require

KW = dict(batch_size=4, seed=9, ring_bytes="256KiB", ignore_launcher_env=True)


def check_union(seen, n, padding):
    """Every id at least once; exactly `padding` of them twice; none more."""
    assert set(seen) == set(range(n)), f"missing: {sorted(set(range(n)) - set(seen))[:10]}"
    assert sum(seen.values()) == n + padding
    assert sorted(Counter(seen.values()).items()) == ([(1, n - padding), (2, padding)] if padding else [(1, n)])


def expected_report(n, padding):
    line = f"epoch 0: {n} samples, each exactly once"
    return [line + (f", and {padding} padding duplicates" if padding else "")]


@pytest.mark.parametrize("new_world", [3, 6])
def test_loader_state_resumes_at_another_world_size(space, new_world, tmp_path):
    cat = kspeed.Catalog.open(space)
    n = len(cat)
    seen = Counter()
    states, positions = [], []
    for r in range(4):
        with kspeed.Loader(space, rank=r, world=4, **KW) as l:
            for _ in range(3):
                b = l.next_batch()
                for i, sid in enumerate(b.ids.tolist()):
                    assert bytes(b.sample(i)) == cat.read_source(sid)
                    seen[sid] += 1
                del b
            assert l.job_position() == (0, 48)
            states.append(l.state_dict())
            positions.append(l.save_position())
    left = n - 48
    per_rank = -(-left // new_world)
    for r in range(new_world):
        with kspeed.Loader(space, rank=r, world=new_world, **KW) as l:
            # Any rank's state: the job's position.
            l.load_state_dict(states[r % 4])
            got = 0
            for b in l:
                for i, sid in enumerate(b.ids.tolist()):
                    assert bytes(b.sample(i)) == cat.read_source(sid)
                    seen[sid] += 1
                    got += 1
                del b
            assert got == per_rank
            assert l.stats()["digest"]["count"] == per_rank
            positions.append(l.save_position())
    padding = per_rank * new_world - left
    check_union(seen, n, padding)
    assert kspeed.audit(positions) == expected_report(n, padding)
    # The old world's state dicts, and a file, do as well as the bytes.
    f = tmp_path / "rank0.pos"
    f.write_bytes(positions[0])
    assert kspeed.audit([str(f)] + states[1:] + positions[4:]) == expected_report(n, padding)
    # A rank of the new world missing: named.
    with pytest.raises(kspeed.DataError, match=f"{new_world - 1} rank positions for a world of {new_world}"):
        kspeed.audit(positions[:-1])


def test_a_state_of_another_world_without_a_job_position_is_refused(space):
    with kspeed.Loader(space, rank=0, world=4, **KW) as l:
        l.next_batch()
        state = l.state_dict()
    del state["job_position"]
    with kspeed.Loader(space, rank=0, world=3, **KW) as l:
        with pytest.raises(ValueError, match="world"):
            l.load_state_dict(state)


@pytest.mark.parametrize("new_world", [3, 6])
def test_stateful_dataloader_resumes_at_another_world_size(space, new_world):
    """Each of 4 ranks' StatefulDataLoader takes 10 samples (mid-batch),
    saves; the new world's StatefulDataLoaders load any rank's state and
    finish the epoch."""
    require("torchdata")
    from torchdata.stateful_dataloader import StatefulDataLoader

    from kspeed.torch import KSpeedDataset

    cat = kspeed.Catalog.open(space)
    n = len(cat)

    def make(rank, world):
        ds = KSpeedDataset(space, rank=rank, world=world, return_id=True, **KW)
        return StatefulDataLoader(ds, batch_size=None, num_workers=0)

    seen = Counter()
    states = []
    for r in range(4):
        dl = make(r, 4)
        it = iter(dl)
        for _ in range(10):
            t, _, sid = next(it)
            assert bytes(t.numpy()) == cat.read_source(sid)
            seen[sid] += 1
        states.append(dl.state_dict())
        del it, dl
    left = n - 40
    per_rank = -(-left // new_world)
    ends = []
    for r in range(new_world):
        dl = make(r, new_world)
        dl.load_state_dict(states[r % 4])
        got = 0
        for t, _, sid in dl:
            assert bytes(t.numpy()) == cat.read_source(sid)
            seen[sid] += 1
            got += 1
        assert got == per_rank, f"rank {r} of {new_world}"
        ends.append(dl.state_dict())
        del dl
    padding = per_rank * new_world - left
    check_union(seen, n, padding)
    # The audit from the dataset states alone: 10 samples is inside the
    # third kspeed batch of 4, so each old rank's state carries the
    # batch's start advanced by the 2 samples handed out of it.
    old = [s["dataset_state"] for s in states]
    assert all(s["skip"] == 2 and "audit_position" in s for s in old), old[0]
    assert kspeed.audit(old + [s["dataset_state"] for s in ends]) == expected_report(n, padding)
    # The batch's start alone misses those samples: named.
    with pytest.raises(kspeed.DataError, match="AuditMismatch|stop at"):
        kspeed.audit([s["position"] for s in old] + [s["dataset_state"] for s in ends])
