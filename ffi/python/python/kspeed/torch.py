"""PyTorch front end: :class:`KSpeedDataset` (an ``IterableDataset``) and
:class:`KSpeedImageFolder`.

Recommended set-up::

    ds = KSpeedDataset("/nvme/kspeed/train", batch_size=64, seed=42,
                       transform=torchvision.io.decode_jpeg)
    dl = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=4)
    for epoch in range(90):
        ds.set_epoch(epoch)
        for image, label in dl:
            ...

What each process reads. With ``num_workers=0`` the dataset's one loader
reads the rank's whole sequence (rank and world from torchrun/SLURM, as
``kspeed.Loader``). With ``N`` worker processes, worker ``w`` builds its own
loader, inside the worker (after the fork), that reads steps ``w, w+N,
w+2N, ...`` of the rank's sequence: it is the sampler's rank
``rank + world*w`` of ``world*N``, cut to the rank's epoch length. Every
sample of the rank's epoch is read once, by exactly one worker; and since
``DataLoader`` takes one item from each worker in turn, per-sample output
arrives in the rank's exact sequence order. A loader built in the parent is
never used in a child (kspeed refuses that), and the parent's ring is not
shared with the workers.

Samples are yielded as ``(tensor, label)``: ``tensor`` is uint8. Without a
``transform`` it is a copy (a tensor you may keep); with one, the transform
receives a zero-copy tensor over the landing ring, valid during the call,
and must return new memory (decoders do). ``output="batch"`` yields whole
batches as ``(data, offsets, lengths, labels, ids)`` tensors instead (``data``
is a copy of the batch's span unless ``copy=False``).

Epochs: ``set_epoch(e)`` before iterating (as with ``DistributedSampler``);
without it each new pass goes on with the next epoch. With
``persistent_workers=True`` the workers do not see ``set_epoch``: each pass
is the next epoch.

Resume: ``state_dict()`` / ``load_state_dict()`` give the exact position of
the next sample, also in the middle of a kspeed batch (``num_workers=0``, or
per worker under torchdata's ``StatefulDataLoader``, which calls them in
each worker).
"""

import os

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from ._loader import Loader, _int

__all__ = ["KSpeedDataset", "KSpeedImageFolder"]


class KSpeedDataset(IterableDataset):
    """The samples of a preloaded space (or a source) in the rank's sampler
    order. Keyword arguments go to :class:`kspeed.Loader`."""

    def __init__(self, space=None, *, transform=None, target_transform=None, output="sample", copy=None,
                 rank=None, world=None, **loader_kwargs):
        super().__init__()
        if output not in ("sample", "batch"):
            raise ValueError(f"output must be 'sample' or 'batch', not {output!r}")
        if transform is not None and not callable(transform):
            raise TypeError("transform must be callable")
        if target_transform is not None and not callable(target_transform):
            raise TypeError("target_transform must be callable")
        self.space = space
        self.transform = transform
        self.target_transform = target_transform
        self.output = output
        self.copy = (transform is None) if copy is None else bool(copy)
        if "source" in loader_kwargs and space is not None:
            raise ValueError("give space or source=, not both")
        self._kwargs = dict(loader_kwargs)
        # Resolve rank and world now (in the parent), so that workers agree.
        from ._loader import launch_env

        if rank is None and world is None:
            rank, world, _ = launch_env()
        elif rank is None or world is None:
            raise ValueError("give both rank and world, or neither (then they come from torchrun/SLURM)")
        self._epoch = None
        self._loader = None
        self._loader_key = None
        self._state = None
        self._cursor = None
        from ._loader import Catalog

        if space is not None:
            self._catalog = Catalog.open(space)
        elif loader_kwargs.get("catalog") is not None:
            self._catalog = Catalog.open(loader_kwargs["catalog"])
        else:
            raise ValueError(
                "KSpeedDataset needs space= or, with source=, catalog= (build one with `kspeed catalog`) "
                "so that every worker reads the same catalog without checksumming the source again"
            )
        rank = _int("rank", rank, 0)
        world = _int("world", world, 1)
        if rank >= world:
            raise ValueError(f"rank {rank} is not below world {world}")
        self.rank, self.world = rank, world
        n = len(self._catalog)
        self.epoch_len = n // world if loader_kwargs.get("drop_last", False) else -(-n // world)

    @property
    def catalog(self):
        return self._catalog

    def set_epoch(self, epoch):
        """The epoch the next pass reads (DistributedSampler.set_epoch)."""
        self._epoch = _int("epoch", epoch, 0)
        self._state = None

    def __len__(self):
        if self.output != "sample":
            raise TypeError("len() is the sample count; with output='batch' it depends on the workers")
        return self.epoch_len

    def _worker(self):
        info = get_worker_info()
        return (0, 1) if info is None else (info.id, info.num_workers)

    def _get_loader(self, w, n):
        key = (os.getpid(), w, n)
        if self._loader is not None and self._loader_key == key:
            return self._loader
        kw = dict(self._kwargs)
        # Worker w of n reads steps w, w+n, ... of the rank's sequence: the
        # sampler's rank (rank + world*w) of world*n, without drop_last (the
        # cut to the rank's length is done here).
        kw["drop_last"] = False
        self._loader = Loader(self.space, rank=self.rank + self.world * w, world=self.world * n, **kw)
        self._loader_key = key
        return self._loader

    def _steps(self, w, n):
        """Samples of the rank's epoch that worker w of n delivers."""
        return max(0, -(-(self.epoch_len - w) // n))

    def __iter__(self):
        w, n = self._worker()
        loader = self._get_loader(w, n)
        state, self._state = self._state, None
        skip = 0
        if state is not None:
            loader._l.restore_position(state["position"])
            loader._epoch = state["epoch"]
            skip = state["skip"]
        elif self._epoch is not None:
            loader.set_epoch(self._epoch)
        epoch = loader.position()[0]
        if epoch > loader.epoch:
            loader.set_epoch(epoch)
        left = self._steps(w, n) - loader.position()[1]
        while left > 0:
            # Where this batch starts, so that a state taken in the middle of
            # it resumes at the exact sample (restore there, skip the rest).
            start = (loader._l.save_position(), loader.position())
            b = loader.next_batch()
            if b is None:
                break
            k = min(len(b), left)
            left -= k
            if self.output == "batch":
                self._cursor = (start, k)
                yield self._batch(b, k)
            else:
                labels = b.labels
                for i in range(skip, k):
                    t = torch.from_numpy(b.sample(i))
                    if self.transform is not None:
                        t = self.transform(t)
                    elif self.copy:
                        t = t.clone()
                    y = int(labels[i])
                    if self.target_transform is not None:
                        y = self.target_transform(y)
                    self._cursor = (start, i + 1)
                    yield t, y
            skip = 0
            del b
        self._cursor = None
        # Leave the loader at the next epoch's start (the cut may have left
        # the padding steps of this epoch unread).
        self._epoch = None
        loader.set_epoch(loader.epoch + 1)

    def _batch(self, b, k):
        offsets, lengths = b.offsets[:k], b.lengths[:k]
        arr = b.array()
        end = int(offsets[-1] + lengths[-1]) if k else 0
        data = torch.from_numpy(arr[:end])
        if self.copy:
            data = data.clone()
        return data, torch.from_numpy(offsets), torch.from_numpy(lengths), torch.from_numpy(b.labels[:k]), torch.from_numpy(b.ids[:k])

    # Checkpoints.
    def state_dict(self):
        """Position of this process's (or worker's) next sample: exact, also
        in the middle of a kspeed batch."""
        w, n = self._worker()
        loader = self._get_loader(w, n)
        cursor = getattr(self, "_cursor", None)
        if cursor is not None:
            (pos, (epoch, index)), skip = cursor
        else:
            pos, (epoch, index), skip = loader._l.save_position(), loader.position(), 0
        return {"kspeed_dataset_state": 1, "worker": w, "num_workers": n, "epoch": epoch, "index": index + skip,
                "position": bytes(pos), "skip": skip}

    def load_state_dict(self, state):
        """The next pass continues from ``state`` (from :meth:`state_dict`)."""
        if not isinstance(state, dict) or state.get("kspeed_dataset_state") != 1:
            raise ValueError("state is not a KSpeedDataset state")
        w, n = self._worker()
        if (state["worker"], state["num_workers"]) != (w, n):
            raise ValueError(
                f"state was saved by worker {state['worker']} of {state['num_workers']}, "
                f"this is worker {w} of {n}: resume with the same num_workers"
            )
        self._state = state

    def close(self):
        if self._loader is not None and self._loader_key[0] == os.getpid():
            self._loader.close()
        self._loader = None

    def __getstate__(self):
        # A loader never crosses into another process (spawned workers get
        # the arguments and build their own).
        d = dict(self.__dict__)
        d["_loader"] = None
        d["_loader_key"] = None
        d["_cursor"] = None
        return d


class KSpeedImageFolder(KSpeedDataset):
    """:class:`KSpeedDataset` over an ImageFolder tree, with torchvision's
    ``classes``, ``class_to_idx`` and ``targets`` (labels in catalog order).
    ``decode=True`` decodes with ``torchvision.io.decode_image`` before the
    ``transform``."""

    def __init__(self, space=None, *, transform=None, decode=False, **kw):
        if decode:
            from torchvision.io import decode_image

            inner = transform

            def transform(t, _inner=inner):
                img = decode_image(t)
                return img if _inner is None else _inner(img)

        super().__init__(space, transform=transform, **kw)
        self.classes = list(self.catalog.class_names)
        self.class_to_idx = {c: i for i, c in enumerate(self.classes)}
        self.targets = np.asarray(self.catalog.labels).tolist()
