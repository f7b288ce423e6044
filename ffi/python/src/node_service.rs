//! `_NodeService`: the node service (`kspeed serve`) in this process.

use std::sync::atomic::Ordering;
use std::sync::Mutex;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::Raise;
use crate::options::get;

/// The node service (`kspeed serve`) running in this process.
#[pyclass(module = "kspeed._kspeed", name = "_NodeService", frozen)]
struct PyNodeService {
    svc: Mutex<Option<kspeed::transport::NodeService>>,
    addr: String,
}

#[pymethods]
impl PyNodeService {
    #[new]
    fn new(py: Python<'_>, cfg: &Bound<'_, PyDict>) -> PyResult<Self> {
        let space: String =
            get(cfg, "space")?.ok_or_else(|| PyValueError::new_err("space is required"))?;
        let listen: String = get(cfg, "listen")?.unwrap_or_else(|| "127.0.0.1:0".into());
        let token: Vec<u8> = get(cfg, "token")?.unwrap_or_default();
        let mut c = kspeed::transport::ServeConfig::new(space, &listen, &token);
        if let Some(p) = get(cfg, "pollers")? {
            c.pollers = p;
        }
        if let Some(s) = get(cfg, "staging_bytes")? {
            c.staging_bytes = s;
        }
        if let Some(s) = get(cfg, "chunk_bytes")? {
            c.chunk_bytes = s;
        }
        if let Some(s) = get(cfg, "page_cache")? {
            c.page_cache = s;
        }
        if let Some(r) = get::<(Option<String>, u8, Option<u8>)>(cfg, "rdma")? {
            c.rdma = Some(
                kspeed::transport::RdmaOptions::default()
                    .device(r.0)
                    .port(r.1)
                    .gid_index(r.2),
            );
        }
        let svc = py
            .detach(|| kspeed::transport::NodeService::start(c))
            .raise(py)?;
        let addr = svc.local_addr().to_string();
        Ok(PyNodeService {
            svc: Mutex::new(Some(svc)),
            addr,
        })
    }

    #[getter]
    fn address(&self) -> String {
        self.addr.clone()
    }

    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let g = self.svc.lock().unwrap_or_else(|e| e.into_inner());
        let d = PyDict::new(py);
        if let Some(s) = g.as_ref() {
            let st = s.stats();
            let l = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
            d.set_item("connections", l(&st.connections))?;
            d.set_item("refused", l(&st.refused))?;
            d.set_item("violations", l(&st.violations))?;
            d.set_item("samples", l(&st.samples))?;
            d.set_item("bytes", l(&st.bytes))?;
            d.set_item("errors", l(&st.errors))?;
        }
        Ok(d)
    }

    fn stop(&self, py: Python<'_>) {
        let svc = self.svc.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(s) = svc {
            py.detach(move || s.stop());
        }
    }
}

/// Whether this build has the RDMA transport.
#[pyfunction]
fn _has_rdma() -> bool {
    cfg!(feature = "rdma")
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyNodeService>()?;
    m.add_function(wrap_pyfunction!(_has_rdma, m)?)
}
