"""kspeed: feeds GPU training jobs without I/O stalls.

A dataset preloaded onto the nodes' local NVMe (``kspeed.preload``) is read
in each rank's sampler order by io_uring pollers (or pushed by other nodes
over TCP or RDMA) into a landing ring; ``kspeed.Loader`` hands out its
batches as zero-copy numpy arrays, memoryviews and DLPack tensors.

    import kspeed
    kspeed.preload("/data/imagenet/train", "/nvme/kspeed/train")
    loader = kspeed.Loader("/nvme/kspeed/train", batch_size=256, seed=42)
    for epoch in range(90):
        loader.set_epoch(epoch)
        for batch in loader:
            data, offsets, lengths = batch.array(), batch.offsets, batch.lengths
            labels = batch.labels

PyTorch: ``kspeed.torch.KSpeedDataset`` (an IterableDataset).
"""

from . import _kspeed
from ._kspeed import Batch
from ._loader import Catalog, Loader, NodeService, audit, catalog, launch_env, options, preload, verify
from .errors import (
    BatchInUseError,
    BatchReleasedError,
    ConfigError,
    DataError,
    Error,
    IoError,
    LoaderClosedError,
    LoaderError,
    NetworkError,
)

__version__ = _kspeed.__version__
#: Whether this build has the RDMA transport (libibverbs was there at build time).
HAS_RDMA = _kspeed._has_rdma()

__all__ = [
    "Batch",
    "Catalog",
    "Loader",
    "NodeService",
    "launch_env",
    "options",
    "catalog",
    "preload",
    "verify",
    "audit",
    "Error",
    "IoError",
    "DataError",
    "ConfigError",
    "NetworkError",
    "LoaderError",
    "BatchInUseError",
    "BatchReleasedError",
    "LoaderClosedError",
    "HAS_RDMA",
]
