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

    /// A kspeed error, mapped to its class by the crate's one mapping of
    /// every variant (`Error::kind_name` and `Error::class`, shared with
    /// the C ABI's statuses): `kind` is the variant's name, the class
    /// follows its `ErrorClass`. No wildcard: a new class does not compile
    /// until it has a Python class here.
    pub(crate) fn from_kspeed(e: kspeed::Error) -> Fail {
        use kspeed::error::ErrorClass as C;
        // A loader that failed keeps failing with its first error: classify
        // by that (the message still says the loader stopped).
        let root = e.root();
        let class = match root.class() {
            C::Io => "IoError",
            C::Data => "DataError",
            C::Config => "ConfigError",
            C::Network => "NetworkError",
            // An OSError too: memlock, io_uring, threads, NUMA, CUDA, RDMA
            // devices (with `errno` where the OS gave one).
            C::Resource => "IoError",
            // A kspeed thread panicked: the loader stops.
            C::Bug => "LoaderError",
            // The node service could not start.
            C::Service => "NetworkError",
        };
        Fail {
            class,
            kind: root.kind_name(),
            msg: e.to_string(),
            errno: root.os_errno(),
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
