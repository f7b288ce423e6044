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
reads the rank's whole sequence (rank and world from the launcher, as
``kspeed.Loader``). With ``N`` worker processes, worker ``w`` builds its own
loader, inside the worker (after the fork), that reads steps ``w, w+N,
w+2N, ...`` of the rank's sequence: it is the sampler's rank
``rank + world*w`` of ``world*N``, cut to the rank's epoch length. Every
sample of the rank's epoch is read once, by exactly one worker; and since
``DataLoader`` takes one item from each worker in turn, per-sample output
arrives in the rank's exact sequence order. A loader built in the parent is
never used in a child (kspeed refuses that), and the parent's ring is not
shared with the workers.

Samples are yielded as ``(tensor, label)``, or ``(tensor, label, id)``
with ``return_id=True`` (``id``: the sample's catalog index, as in
``Catalog.path(id)``): ``tensor`` is uint8. Without a ``transform`` it is a
copy (a tensor you may keep); with one, the transform receives a zero-copy
tensor over the landing ring, valid during the call, and must return new
memory (decoders do). A sample served from the memory tier (``tier_views``)
is handed over as a copy: the tier is filled once and served again every
epoch, and PyTorch tensors cannot be read-only, so an in-place transform must
not reach it. ``output="batch"`` yields whole batches as ``(data, offsets,
lengths, labels, ids)`` tensors instead (``data`` is a copy of the batch's
span unless ``copy=False``).

Epochs: ``set_epoch(e)`` before iterating (as with ``DistributedSampler``);
without it each new pass goes on with the next epoch, with 0 workers,
worker processes started anew for each pass, or ``persistent_workers=True``
alike (the epoch is kept in shared memory that the parent's ``set_epoch``
writes and each worker reads when its pass starts).

Length: ``len(DataLoader(ds, batch_size=B, num_workers=N, drop_last=D))``
is the number of batches the DataLoader yields: each worker batches its own
samples, so with workers that can be more than ``ceil(len(ds) / B)``; the
dataset answers the DataLoader that asks with the exact count
(:meth:`KSpeedDataset.batches_per_epoch`), so an LR schedule sized with
``len(dl) * epochs`` steps exactly.

Resume: ``state_dict()`` / ``load_state_dict()`` give the exact position of
the next sample, also in the middle of a kspeed batch (``num_workers=0``, or
per worker under torchdata's ``StatefulDataLoader``, which calls them in
each worker). With ``num_workers=0`` a state also resumes at another world
size (load any rank's state on every rank of the new world): the rest of the
epoch is dealt to the new ranks, each sample exactly once.

Images: ``KSpeedImageFolder(space, decode=True, random_resized_crop=224)``
yields whole decoded, cropped and flipped batches from threads in this
process (pinned where CUDA is available; ``decode="cuda"``: nvJPEG), see
:class:`KSpeedImageFolder` and :mod:`kspeed._decode`.

Mixtures: ``mix=`` (as :class:`kspeed.Loader`; each dataset a space or a
catalog file) reads several datasets side by side, with ``num_workers=0``.
A state of a mixture also resumes under other weights (a dataset built with
other ``mix=`` weights loads it): the rest of the epoch follows the new
weights, nothing the job delivered in the epoch comes again, and the next
epoch is the new weights' own.
"""

import inspect
import os
import sys
import warnings

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from . import _decode, _kspeed
from ._loader import Loader, _bool, _int, _rank_world
from .errors import BatchInUseError

#: Worker processes a dataset keeps an epoch for (DataLoader num_workers).
MAX_WORKERS = 256

__all__ = ["KSpeedDataset", "KSpeedImageFolder"]


class KSpeedDataset(IterableDataset):
    """The samples of a preloaded space (or a source) in the rank's sampler
    order. Keyword arguments go to :class:`kspeed.Loader`."""

    def __init__(self, space=None, *, transform=None, target_transform=None, output="sample", copy=None,
                 return_id=False, rank=None, world=None, ignore_launcher_env=False, **loader_kwargs):
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
        # KSpeedImageFolder(random_resized_crop=...): decoded batches.
        self._images = getattr(self, "_images", None)
        self.copy = (transform is None) if copy is None else bool(copy)
        self.return_id = _bool("return_id", return_id)
        if "source" in loader_kwargs and space is not None:
            raise ValueError("give space or source=, not both")
        self._mix = loader_kwargs.get("mix") is not None
        if self._mix and (space is not None or "source" in loader_kwargs):
            raise ValueError("give space, source= or mix=, not two of them")
        # A misspelt option is named now, not at the first iteration (in a
        # worker, wrapped in DataLoader's message).
        known = inspect.signature(Loader.__init__).parameters
        unknown = sorted(k for k in loader_kwargs if k not in known or k in ("self", "space"))
        if unknown:
            raise TypeError(f"{type(self).__name__} got unexpected keyword argument(s) "
                            f"{', '.join(map(repr, unknown))}: its own are listed in its help, the others go to "
                            f"kspeed.Loader, which has no such option")
        self._kwargs = dict(loader_kwargs)
        # Resolve rank and world now (in the parent), so that workers agree.
        rank, world, _ = _rank_world(rank, world, ignore_launcher_env)
        # The epoch each worker's next pass reads (slot w for worker w; 0
        # workers: slot 0), in shared memory: worker processes, new for each
        # pass or persistent, see the parent's set_epoch, and each pass
        # moves its worker's slot on (see _next_epoch).
        start = _int("start_epoch", self._kwargs.get("start_epoch", 0), 0)
        self._epochs = torch.full((MAX_WORKERS,), start, dtype=torch.int64).share_memory_()
        self._loader = None
        self._loader_key = None
        self._state = None
        self._cursor = None
        from ._loader import Catalog

        self.rank, self.world = rank, world
        self._epoch_len = None
        if self._mix:
            # The mixed epoch's length and the datasets' identity come from
            # the loader (its weights' counts), built on first need.
            self._catalog = None
            return
        if space is not None:
            self._catalog = Catalog.open(space)
        elif loader_kwargs.get("catalog") is not None:
            self._catalog = Catalog.open(loader_kwargs["catalog"])
        else:
            raise ValueError(
                "KSpeedDataset needs space=, mix= or, with source=, catalog= (build one with `kspeed catalog`) "
                "so that every worker reads the same catalog without checksumming the source again"
            )
        self._epoch_len = self._rank_len(len(self._catalog))

    def _rank_len(self, n):
        """Samples of an epoch of `n` for this rank (DistributedSampler's)."""
        return n // self.world if self._kwargs.get("drop_last", False) else -(-n // self.world)

    @property
    def epoch_len(self):
        """Samples per epoch for this rank (an ordinary epoch; a mixture's
        under this dataset's weights)."""
        if self._epoch_len is None:
            self._epoch_len = self._rank_len(sum(self._mix_loader()._l.mix_counts))
        return self._epoch_len

    def _mix_loader(self):
        """This process's loader of the mixture (num_workers=0 only)."""
        w, n = self._worker()
        self._refuse_mix_workers(n)
        return self._get_loader(w, n)

    def _refuse_mix_workers(self, n):
        if self._mix and n > 1:
            raise ValueError(
                f"KSpeedDataset with mix= reads with num_workers=0 (asked for {n} workers): splitting a "
                f"mixture's epoch between worker processes is not supported yet"
            )

    @property
    def catalog(self):
        """The dataset's :class:`kspeed.Catalog` (``None`` for a mixture)."""
        return self._catalog

    def set_epoch(self, epoch):
        """The epoch the next pass reads (DistributedSampler.set_epoch); the
        passes after it go on with the next epochs."""
        epoch = _int("epoch", epoch, 0)
        self._epochs.fill_(epoch)
        self._state = None

    def _next_epoch(self, w, n, reading):
        """Worker ``w`` of ``n`` starts a pass of epoch ``reading``: its next
        pass reads the one after. The last worker also moves the slots of
        worker ids above ``n``, so that a DataLoader with more workers later
        goes on from the same epoch."""
        self._epochs[w] = reading + 1
        if w == n - 1:
            self._epochs[n:] = reading + 1

    def batches_per_epoch(self, batch_size=None, num_workers=0, drop_last=False):
        """What one pass of ``DataLoader(self, batch_size=batch_size,
        num_workers=num_workers, drop_last=drop_last)`` yields: samples (or,
        with ``output="batch"``, kspeed batches) for ``batch_size=None``,
        else DataLoader batches. Each worker batches its own samples, so
        this is the sum over workers, not ``ceil(len(self) / batch_size)``."""
        n = max(1, _int("num_workers", num_workers, 0))
        self._refuse_mix_workers(n)
        if num_workers > MAX_WORKERS:
            raise ValueError(f"num_workers {num_workers} is above {MAX_WORKERS}, the most KSpeedDataset supports")
        per_worker = [self._steps(w, n) for w in range(n)]
        if self.output == "batch" or self._images is not None:
            kb = self._kwargs.get("batch_size", 64)
            per_worker = [-(-s // kb) for s in per_worker]
        if batch_size is None:
            return sum(per_worker)
        b = _int("batch_size", batch_size, 1)
        return sum((s // b) if drop_last else -(-s // b) for s in per_worker)

    def __len__(self):
        """Samples per epoch for this rank (``output="sample"``). Asked by a
        DataLoader (as ``len(dataloader)`` does), the value from which the
        DataLoader computes exactly the batches it yields
        (:meth:`batches_per_epoch`)."""
        dl = _calling_dataloader(self)
        if dl is not None:
            got = self.batches_per_epoch(dl.batch_size, dl.num_workers, dl.drop_last)
            # The DataLoader divides by its batch size (rounding up, or down
            # with drop_last): hand it a length that gives `got` batches.
            return got if dl.batch_size is None else got * dl.batch_size
        if self.output != "sample" or self._images is not None:
            raise TypeError("len() is the sample count; with output='batch' or random_resized_crop (batches) it "
                            "depends on the workers (batches_per_epoch(num_workers=N) gives it)")
        return self.epoch_len

    def _worker(self):
        info = get_worker_info()
        if info is not None and info.num_workers > MAX_WORKERS:
            raise ValueError(f"num_workers {info.num_workers} is above {MAX_WORKERS}, the most KSpeedDataset supports")
        return (0, 1) if info is None else (info.id, info.num_workers)

    def _get_loader(self, w, n):
        key = (os.getpid(), w, n)
        if self._loader is not None and self._loader_key == key:
            return self._loader
        kw = dict(self._kwargs)
        # Worker w of n reads steps w, w+n, ... of the rank's sequence: the
        # sampler's rank (rank + world*w) of world*n, without drop_last (the
        # cut to the rank's length is done here). Those contradict the
        # launcher's RANK/WORLD_SIZE on purpose.
        kw["drop_last"] = False
        kw["start_epoch"] = int(self._epochs[w])
        self._loader = Loader(self.space, rank=self.rank + self.world * w, world=self.world * n,
                              ignore_launcher_env=True, **kw)
        self._loader_key = key
        return self._loader

    def _steps(self, w, n):
        """Samples of the rank's epoch that worker w of n delivers."""
        return max(0, -(-(self.epoch_len - w) // n))

    def __iter__(self):
        w, n = self._worker()
        self._refuse_mix_workers(n)
        loader = self._get_loader(w, n)
        state, self._state = self._state, None
        skip = 0
        if state is not None and state.get("_elastic"):
            # Another rank or world size: the job's position, the rest of
            # the epoch dealt to this world.
            loader._l.restore_job_position(state["job_position"])
            loader._epoch = loader.position()[0]
        elif state is not None:
            job = state.get("job_position")
            if self._mix and job is not None:
                # The epoch may be the rest of one resumed under other
                # weights, which the rank position checks only as a hash:
                # its job position first, then the rank's exact place.
                loader._l.restore_job_position(job)
            loader._l.restore_position(state["position"])
            loader._epoch = state["epoch"]
            skip = state["skip"]
        else:
            epoch = int(self._epochs[w])
            if loader.position() != (epoch, 0) or loader.epoch != epoch:
                loader.set_epoch(epoch)
        reading, index = loader.position()
        self._next_epoch(w, n, reading)
        if n == 1 and not self._kwargs.get("drop_last", False):
            # The loader's own epoch (shorter in an epoch resumed at another
            # world size).
            left = loader._l.epoch_steps(reading) - index
        else:
            left = self._steps(w, n) - index
        if self._images is not None:
            for images, labels, ids, start, k in _decode.pipelined(
                    lambda room: self._kspeed_batches(loader, left, skip, w, room), self._decoder(n),
                    self._images["prefetch_batches"]):
                self._cursor = (start, k)
                yield (images, labels, ids) if self.return_id else (images, labels)
            return
        for b, lo, k, start in self._kspeed_batches(loader, left, skip, w):
            if self.output == "batch":
                if lo < k:
                    self._cursor = (start, k)
                    yield self._batch(b, k, lo)
                continue
            labels, ids = b.labels, b.ids
            for i in range(lo, k):
                # A ring sample in place; a memory tier sample as a copy
                # (sample_dlpack copies those: the tier is never
                # rewritten, and a tensor cannot be read-only).
                t = torch.from_dlpack(b.sample_dlpack(i))
                if self.transform is not None:
                    t = self.transform(t)
                elif self.copy and not b.sample_in_tier(i):
                    t = t.clone()
                y = int(labels[i])
                if self.target_transform is not None:
                    y = self.target_transform(y)
                self._cursor = (start, i + 1)
                yield (t, y, int(ids[i])) if self.return_id else (t, y)

    def _kspeed_batches(self, loader, left, skip, w, room=None):
        """Yields (batch, lo, k, start) for the rest of the pass: the
        batch's samples lo..k are this pass's (lo: the samples a restored
        state had consumed in its first batch), ``start`` where the batch
        starts (for :meth:`state_dict`). Then leaves the loader at the next
        epoch's start. ``room()``: called when the batches still referenced
        leave no room for the next one (BatchInUseError); True when it let
        one go (then the batch is asked for again)."""
        while left > 0:
            # Where this batch starts, so that a state taken in the middle of
            # it resumes at the exact sample (restore there, skip the rest),
            # and where this world started dealing the epoch (for the job
            # position).
            pos, at, base = loader._l.save_position(), loader.position(), loader._l.rank_position()[1]
            while True:
                try:
                    b = loader.next_batch()
                    break
                except BatchInUseError:
                    if room is None or not room():
                        raise
            if b is None:
                break
            k = min(len(b), left)
            left -= k
            # The batch's ids too: a state taken inside it gives the audit
            # the start advanced by the samples handed out.
            yield b, min(skip, k), k, (pos, at, base, b.ids[:k].copy())
            skip = 0
            del b
        self._cursor = None
        # Leave the loader at the next epoch's start, reading ahead (the cut
        # may have left the padding steps of this epoch unread).
        nxt = int(self._epochs[w])
        if loader.position() != (nxt, 0) or loader.epoch != nxt:
            loader.set_epoch(nxt)

    def _decoder(self, n):
        """This process's decoder of batches (worker processes: n)."""
        im = self._images
        in_worker = get_worker_info() is not None
        if im["device"] is not None:
            if in_worker:
                raise ValueError("decode='cuda' decodes in the training process (CUDA cannot be used in forked "
                                 "DataLoader workers): use num_workers=0")
            return _decode.CudaBatches(im["spec"], im["device"])
        threads = im["threads"] or _decode.default_threads(n)
        # A forked worker cannot touch CUDA (page-locking memory would
        # initialise it): there the DataLoader's own pin_memory=True pins.
        return _decode.CpuBatches(im["spec"], im["decoder"], threads, im["pin_memory"] and not in_worker)

    def _batch(self, b, k, lo=0):
        offsets, lengths = b.offsets[lo:k], b.lengths[lo:k]
        begin = int(offsets[0]) if len(offsets) else 0
        end = int(offsets[-1] + lengths[-1]) if len(offsets) else 0
        # Through DLPack: numpy views are read-only, which torch.from_numpy
        # warns about. The ring span in place (a batch with tier samples: its
        # packed copy, not the tier).
        data = torch.from_dlpack(b)[begin:end]
        if self.copy:
            data = data.clone()
        if begin:
            # A batch resumed after its first samples: offsets into `data`.
            offsets = offsets - begin
        return (data, torch.from_numpy(offsets), torch.from_numpy(lengths), torch.from_numpy(b.labels[lo:k]),
                torch.from_numpy(b.ids[lo:k]))

    # Checkpoints.
    def _identity(self):
        """What a state must match: the job (rank, world, seed) and the
        dataset (a mixture's: its datasets, whatever the weights)."""
        identity = self._mix_loader()._l.catalog_identity if self._mix else self._catalog.identity
        return {"rank": self.rank, "world": self.world, "seed": self._kwargs.get("seed", 0),
                "catalog_identity": identity}

    def state_dict(self):
        """Position of this process's (or worker's) next sample: exact, also
        in the middle of a kspeed batch."""
        w, n = self._worker()
        loader = self._get_loader(w, n)
        cursor = getattr(self, "_cursor", None)
        if cursor is not None:
            (pos, (epoch, index), base, ids), skip = cursor
        else:
            pos, (epoch, index), skip = loader._l.save_position(), loader.position(), 0
            base = loader._l.rank_position()[1]
        state = {"kspeed_dataset_state": 1, **self._identity(), "worker": w, "num_workers": n, "epoch": epoch,
                 "index": index + skip, "position": bytes(pos), "skip": skip}
        if skip:
            # What kspeed.audit reads: `position` is the batch's start (a
            # resume reads the batch again and skips `skip`), whose digest
            # lacks the samples handed out since.
            state["audit_position"] = _kspeed._position_advanced(bytes(pos), [int(i) for i in ids[:skip]])
        if n == 1 and not self._kwargs.get("drop_last", False):
            # The job's position at this exact sample (valid at any world
            # size when the ranks are in lock-step, as DDP steps are; a
            # mixture's, KSPDMIX1, also under other weights).
            state["job_position"] = bytes(loader._l.save_job_position(epoch, base + (index + skip) * self.world))
        if self._mix:
            state["mix_counts"] = list(loader._l.mix_counts)
        return state

    def load_state_dict(self, state):
        """The next pass continues from ``state`` (from :meth:`state_dict`).
        With ``num_workers=0`` (and no ``drop_last``), a state of another
        rank or world size continues the job from its job position (a job
        resumed on another number of GPUs: load any rank's state on every
        rank): the rest of the epoch, each sample not yet consumed exactly
        once across the new ranks. So does a mixture's state saved under
        other weights: the rest of the epoch follows this dataset's weights,
        nothing the job delivered in the epoch coming again. Otherwise a
        state of another job (world size, rank, seed), dataset or worker
        count is refused here, naming the field."""
        if not isinstance(state, dict) or state.get("kspeed_dataset_state") != 1:
            raise ValueError("state is not a KSpeedDataset state (no kspeed_dataset_state: 1)")
        w, n = self._worker()
        self._refuse_mix_workers(n)
        job = state.get("job_position")
        mix_job = isinstance(job, (bytes, bytearray)) and bytes(job[:8]) == b"KSPDMIX1"
        if self._mix != mix_job and job is not None:
            raise ValueError("state is of a mixture of datasets and this dataset reads one, or the other way "
                             "round: the state belongs to another job or dataset")
        reweighted = (mix_job and state.get("mix_counts") is not None
                      and list(state["mix_counts"]) != list(self._mix_loader()._l.mix_counts))
        elastic = (((state.get("rank"), state.get("world")) != (self.rank, self.world) or reweighted)
                   and job is not None and n == 1 and state.get("num_workers") == 1
                   and not self._kwargs.get("drop_last", False))
        for key, mine in self._identity().items():
            if elastic and key in ("rank", "world"):
                continue
            if key not in state:
                raise ValueError(f"state[{key!r}] is missing: the state is from an older kspeed or not a "
                                 f"KSpeedDataset state")
            if state[key] != mine:
                why = "the state belongs to another job or dataset"
                if key in ("rank", "world"):
                    why = ("a state of another rank or world size continues the job only without DataLoader "
                           "workers (num_workers 0, when saved and now) and without drop_last; otherwise it "
                           "belongs to another job")
                raise ValueError(f"state[{key!r}] is {state[key]!r} but this dataset has {mine!r}: {why}")
        if elastic:
            self._state = dict(state, _elastic=True)
            return
        if (state["worker"], state["num_workers"]) != (w, n):
            raise ValueError(
                f"state['num_workers'] is {state['num_workers']} (worker {state['worker']}) but this is worker "
                f"{w} of {n}: resume with the same num_workers"
            )
        if not isinstance(state.get("position"), (bytes, bytearray)):
            raise TypeError("state['position'] must be bytes")
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


def _calling_dataloader(ds):
    """The DataLoader whose ``__len__`` asks ``len(ds)``, if one does (its
    batch size and worker count decide what it yields).

    A DataLoader further up whose dataset is not ``ds`` (``ds`` wrapped in
    another dataset) cannot be answered exactly: its length is then the
    sample count's, which undercounts with workers, so that case warns
    (once per dataset) and names :meth:`KSpeedDataset.batches_per_epoch`."""
    f = sys._getframe(2)
    for depth in range(_LEN_FRAMES):
        if f is None:
            return None
        me = f.f_locals.get("self")
        if isinstance(me, DataLoader) and f.f_code.co_name == "__len__":
            if me.dataset is ds and depth < 4:
                return me
            if me.num_workers > 0 and not getattr(ds, "_warned_wrapped_len", False):
                ds._warned_wrapped_len = True
                warnings.warn(
                    "len() of a DataLoader over a wrapped KSpeedDataset with num_workers > 0 is "
                    "the sample count divided by the batch size, which can be less than the "
                    "batches iteration yields; use ds.batches_per_epoch(batch_size, num_workers, "
                    "drop_last) for schedules that need the exact count",
                    stacklevel=3,
                )
            return None
        f = f.f_back
    return None


# How far up len(ds) looks for the DataLoader asking (its own __len__ is
# within 4 frames; a wrapper dataset's __len__ adds a few).
_LEN_FRAMES = 12


class KSpeedImageFolder(KSpeedDataset):
    """:class:`KSpeedDataset` over an ImageFolder tree, with torchvision's
    ``classes``, ``class_to_idx`` and ``targets`` (labels in catalog order).

    Decoding, two ways:

    - ``decode=True`` alone: each sample is decoded with
      ``torchvision.io.decode_image`` (uint8, C x H x W, any format
      torchvision reads) before the per-sample ``transform``.
    - ``decode=True, random_resized_crop=224``: the training pipeline
      decode + ``RandomResizedCrop(224, scale=crop_scale, ratio=crop_ratio)``
      + horizontal flip (probability ``hflip``) + to ``dtype`` (float: in
      [0, 1]; ``torch.uint8``: the pixel values) in kspeed, and the dataset
      yields whole batches ``(images, labels)`` (``(images, labels, ids)``
      with ``return_id=True``): ``images`` is ``[B, 3, 224, 224]``, ``labels``
      and ``ids`` int64 ``[B]``, ``B`` the ``batch_size`` (the epoch's last
      batch may be shorter). Use it with ``DataLoader(ds, batch_size=None,
      num_workers=0)`` or iterate it directly: ``decode_threads`` threads
      (default: one per CPU this process may use, divided between DataLoader
      workers if there are any) decode in this process, from views over the
      landing ring, with the GIL released, into one batch tensor, pinned
      (``pin_memory``, default: when CUDA is available) so that
      ``images.cuda(non_blocking=True)`` is an asynchronous DMA.
      ``prefetch_batches`` batches decode ahead of the one yielded. The JPEG
      decoder (``decoder``): ``"simplejpeg"`` where installed (the ``torch``
      extra installs it), else ``"pil"``, else ``"torchvision"``; the first
      two decode at a reduced DCT scale (1/2, 1/4, 1/8) where the crop
      stays at least 224 px (see :mod:`kspeed._decode` for what that changes
      in the pixels). The crop and flip of a sample depend only on
      ``seed``, the epoch and the sample's id: the same for every run,
      thread count, worker count and world size.
    - ``decode="cuda"`` (or ``"cuda:N"``), with ``random_resized_crop``:
      each batch goes whole to nvJPEG (``torchvision.io.decode_jpeg(list,
      device="cuda")``) from the landing ring (pinned: registered with CUDA
      by the loader), crop, resize and flip run on the GPU, and ``images``
      is a CUDA tensor. Without a CUDA device it raises a RuntimeError that
      says so; ``decode="auto"`` takes CUDA where there is one and the CPU
      threads elsewhere.

    State: ``state_dict()`` after a yielded batch resumes at the next batch
    (batches decoding ahead are decoded again after a restore)."""

    def __init__(self, space=None, *, transform=None, decode=False, random_resized_crop=None,
                 crop_scale=(0.08, 1.0), crop_ratio=(3 / 4, 4 / 3), hflip=0.5, dtype=torch.float32, decoder=None,
                 decode_threads=None, pin_memory=None, prefetch_batches=2, **kw):
        if kw.get("mix") is not None:
            raise ValueError("KSpeedImageFolder reads one ImageFolder dataset (its classes); for a mixture use "
                             "KSpeedDataset(mix=...), whose batches say each sample's dataset")
        if decode not in (False, True, "cpu", "auto") and not (isinstance(decode, str) and
                                                               decode.split(":")[0] == "cuda"):
            raise ValueError(f"decode must be False, True, 'cpu', 'cuda', 'cuda:N' or 'auto', not {decode!r}")
        self._images = None
        if random_resized_crop is not None:
            self._images = self._images_setup(decode, random_resized_crop, crop_scale, crop_ratio, hflip, dtype,
                                              decoder, decode_threads, pin_memory, prefetch_batches, transform, kw)
            # The pipeline holds prefetch_batches + 1 batches' ring views.
            kw.setdefault("batches_in_flight", self._images["prefetch_batches"] + 1)
        elif decode not in (False, True):
            raise ValueError(f"decode={decode!r} decodes whole batches into one tensor, so it needs "
                             f"random_resized_crop= (the output size); decode=True decodes each sample")
        elif decode:
            from torchvision.io import decode_image

            inner = transform

            def transform(t, _inner=inner):
                img = decode_image(t)
                return img if _inner is None else _inner(img)

        super().__init__(space, transform=transform, **kw)
        self.classes = list(self.catalog.class_names)
        self.class_to_idx = {c: i for i, c in enumerate(self.classes)}
        self.targets = np.asarray(self.catalog.labels).tolist()

    @staticmethod
    def _images_setup(decode, size, scale, ratio, hflip, dtype, decoder, threads, pin_memory, prefetch, transform,
                      kw):
        if not decode:
            raise ValueError("random_resized_crop= decodes the images: give decode=True (CPU threads), "
                             "decode='cuda' or decode='auto'")
        if transform is not None:
            raise ValueError("random_resized_crop= yields whole decoded batches, so it takes no per-sample "
                             "transform (apply one to the batch tensor, e.g. normalisation on the GPU)")
        if kw.get("output", "sample") != "sample":
            raise ValueError("random_resized_crop= yields decoded batches; output= does not apply")
        prefetch = _int("prefetch_batches", prefetch, 0, 64)
        if threads is not None:
            threads = _int("decode_threads", threads, 1, 1024)
        spec = _decode.Spec(size, scale, ratio, hflip, dtype, kw.get("seed", 0))
        device = None
        if decode == "auto":
            try:
                device = _decode.cuda_device("cuda")
            except (RuntimeError, ImportError):
                device = None
        elif isinstance(decode, str) and decode.startswith("cuda"):
            device = _decode.cuda_device(decode)
        if device is not None:
            if decoder is not None:
                raise ValueError(f"decoder={decoder!r} chooses a CPU decoder; decode={decode!r} decodes with nvJPEG")
            if pin_memory:
                raise ValueError("pin_memory=True: the batches are already in GPU memory with decode='cuda'")
            return {"spec": spec, "device": device, "decoder": None, "threads": None, "pin_memory": False,
                    "prefetch_batches": max(1, prefetch)}
        decoder = _decode.pick_decoder(decoder)
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        elif pin_memory and not torch.cuda.is_available():
            raise ValueError("pin_memory=True needs CUDA (page-locked memory for copies to a GPU), and "
                             "torch.cuda.is_available() is False here; leave pin_memory=None (pinned where "
                             "CUDA is available)")
        return {"spec": spec, "device": None, "decoder": decoder, "threads": threads, "pin_memory": bool(pin_memory),
                "prefetch_batches": prefetch}
