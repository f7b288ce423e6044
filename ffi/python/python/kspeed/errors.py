"""kspeed's exceptions.

Every error kspeed itself reports is a :class:`Error`; its message is
kspeed's (what was wrong and where), ``kind`` names the Rust error variant
(``"ReadFailed"``, ``"SampleCorrupt"``, ...) and I/O errors carry ``errno``.
Bad arguments to this package's functions raise the built-in ``ValueError``
or ``TypeError`` naming the argument.
"""


class Error(Exception):
    """Base class of every kspeed error."""

    kind = "Error"


class IoError(Error, OSError):
    """Reading or writing a file failed (the message names the file and the errno)."""

    kind = "Io"


class DataError(Error):
    """A source, catalog, space or sample is wrong or corrupt (CRC mismatch, changed source...)."""

    kind = "Data"


class ConfigError(Error, ValueError):
    """kspeed refused a configuration (ring too small for a sample, bad cluster file...)."""

    kind = "InvalidConfig"


class NetworkError(Error):
    """A node refused the connection, broke the protocol, or no node could deliver a sample."""

    kind = "Network"


class LoaderError(Error):
    """The loader stopped after an earlier error."""

    kind = "LoaderFailed"


class BatchInUseError(Error):
    """An operation would free the bytes of a batch that is still referenced.

    Raised by ``next()`` when ``batches_in_flight`` batches are still
    referenced (or the ring cannot hold another batch beside them), by
    ``Batch.release()`` while views of the batch are alive, and by
    ``set_epoch`` (a restart), ``load_state_dict`` and ``close`` while any
    batch has views.
    """

    kind = "BatchInUse"


class BatchReleasedError(Error):
    """The batch was released; its bytes are gone."""

    kind = "BatchReleased"


class LoaderClosedError(Error):
    """The loader was closed."""

    kind = "LoaderClosed"


__all__ = [
    "Error",
    "IoError",
    "DataError",
    "ConfigError",
    "NetworkError",
    "LoaderError",
    "BatchInUseError",
    "BatchReleasedError",
    "LoaderClosedError",
]
