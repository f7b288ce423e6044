//! kspeed errors as `kspeed.Error` subclasses (defined in
//! `python/kspeed/errors.py`, so that `ConfigError` can also be a
//! `ValueError` and `IoError` an `OSError`).
//!
//! Work done with the GIL released returns a [`Fail`]; it becomes a Python
//! exception once the GIL is back ([`Fail::into_py`]).

use pyo3::prelude::*;

/// An error on its way to Python: the `kspeed.errors` class and the message.
#[derive(Debug)]
pub(crate) struct Fail {
    class: &'static str,
    /// The Rust variant (`ReadFailed`, ...), set as the exception's `kind`.
    kind: &'static str,
    msg: String,
    errno: Option<i32>,
}

impl Fail {
    /// An error of the binding itself (`BatchInUseError`, ...).
    pub(crate) fn named(class: &'static str, msg: impl Into<String>) -> Fail {
        Fail {
            class,
            kind: class,
            msg: msg.into(),
            errno: None,
        }
    }

    /// A kspeed error, mapped to its class by variant.
    pub(crate) fn from_kspeed(e: kspeed::Error) -> Fail {
        use kspeed::Error as E;
        // A loader that failed keeps failing with its first error: classify
        // by that (the message still says the loader stopped).
        let (class, kind, errno) = match e.root() {
            E::Io { source, .. } => ("IoError", "Io", source.raw_os_error()),
            E::ReadFailed { source, .. } => ("IoError", "ReadFailed", source.raw_os_error()),
            E::Uring { source, .. } => ("IoError", "Uring", source.raw_os_error()),
            E::ShortRead { .. } => ("IoError", "ShortRead", None),
            E::DiskFull { .. } => ("IoError", "DiskFull", Some(libc_enospc())),
            E::Memlock { errno, .. } => ("IoError", "Memlock", Some(*errno)),
            E::SpaceLocked { .. } => ("IoError", "SpaceLocked", None),
            E::EmptySource { .. } => ("DataError", "EmptySource", None),
            E::SymlinkLoop { .. } => ("DataError", "SymlinkLoop", None),
            E::BadFileList { .. } => ("DataError", "BadFileList", None),
            E::BadTar { .. } => ("DataError", "BadTar", None),
            E::SampleTooLarge { .. } => ("DataError", "SampleTooLarge", None),
            E::BadMagic { .. } => ("DataError", "BadMagic", None),
            E::UnsupportedVersion { .. } => ("DataError", "UnsupportedVersion", None),
            E::ChecksumMismatch { .. } => ("DataError", "ChecksumMismatch", None),
            E::Truncated { .. } => ("DataError", "Truncated", None),
            E::Corrupt { .. } => ("DataError", "Corrupt", None),
            E::SourceChanged { .. } => ("DataError", "SourceChanged", None),
            E::SourceMismatch { .. } => ("DataError", "SourceMismatch", None),
            E::NotASpace { .. } => ("DataError", "NotASpace", None),
            E::SampleCorrupt { .. } => ("DataError", "SampleCorrupt", None),
            E::InvalidConfig(_) => ("ConfigError", "InvalidConfig", None),
            E::SampleLargerThanRing { .. } => ("ConfigError", "SampleLargerThanRing", None),
            E::RingTooSmallForBatch { .. } => ("ConfigError", "RingTooSmallForBatch", None),
            E::ThreadSpawn { source, .. } => ("IoError", "ThreadSpawn", source.raw_os_error()),
            E::ThreadPanicked { .. } => ("LoaderError", "ThreadPanicked", None),
            E::Numa { .. } => ("ConfigError", "Numa", None),
            E::Cuda(_) => ("ConfigError", "Cuda", None),
            E::BadPosition(_) => ("ConfigError", "BadPosition", None),
            E::BadCluster { .. } => ("ConfigError", "BadCluster", None),
            E::BadPlacement { .. } => ("ConfigError", "BadPlacement", None),
            E::BadHostlist { .. } => ("ConfigError", "BadHostlist", None),
            E::Refused { .. } => ("NetworkError", "Refused", None),
            E::ProtocolViolation { .. } => ("NetworkError", "ProtocolViolation", None),
            E::SampleUnavailable { .. } => ("NetworkError", "SampleUnavailable", None),
            E::Rdma { .. } => ("NetworkError", "Rdma", None),
            E::RdmaCompletion { .. } => ("NetworkError", "RdmaCompletion", None),
            E::Serve(_) => ("NetworkError", "Serve", None),
            E::LoaderFailed(_) => ("LoaderError", "LoaderFailed", None),
            _ => ("Error", "Other", None),
        };
        Fail {
            class,
            kind,
            msg: e.to_string(),
            errno,
        }
    }

    /// The Python exception (with `kind` and, for I/O errors, `errno`).
    pub(crate) fn into_py(self, py: Python<'_>) -> PyErr {
        let make = || -> PyResult<PyErr> {
            let cls = py.import("kspeed.errors")?.getattr(self.class)?;
            let exc = cls.call1((self.msg.clone(),))?;
            exc.setattr("kind", self.kind)?;
            if let Some(n) = self.errno {
                exc.setattr("errno", n)?;
            }
            Ok(PyErr::from_value(exc))
        };
        make().unwrap_or_else(|e| e)
    }
}

fn libc_enospc() -> i32 {
    28
}

/// Converts a `Result<T, Fail>` with the GIL held.
pub(crate) trait Raise<T> {
    fn raise(self, py: Python<'_>) -> PyResult<T>;
}

impl<T> Raise<T> for Result<T, Fail> {
    fn raise(self, py: Python<'_>) -> PyResult<T> {
        self.map_err(|f| f.into_py(py))
    }
}

impl<T> Raise<T> for Result<T, kspeed::Error> {
    fn raise(self, py: Python<'_>) -> PyResult<T> {
        self.map_err(|e| Fail::from_kspeed(e).into_py(py))
    }
}
