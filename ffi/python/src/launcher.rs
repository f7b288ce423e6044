//! `kspeed._kspeed._launch_env`: the launcher's environment as the crate
//! reads it ([`kspeed::launcher::Launcher`]), for the Python package's
//! `kspeed.launch_env()`. One parser for Rust and Python: the loader's core
//! placement and cluster path read the same variables in the same order.

use std::collections::HashMap;

use pyo3::prelude::*;
use pyo3::types::PyDict;

use kspeed::launcher::Launcher;

use crate::errors::Raise;

/// The launcher's view of this process as a dict (`launcher`, `rank`,
/// `world`, `local_rank`, `local_world_size`, `node`, `nodes`, `nodelist`,
/// `rank_from`, `local_rank_from`, `node_from`, `nodes_from`), from `env`
/// (a dict of variables) or, when `None`, the process environment.
/// Malformed or contradictory variables raise `kspeed.ConfigError` (kind
/// `BadLauncher`).
#[pyfunction]
#[pyo3(signature = (env=None))]
fn _launch_env<'py>(
    py: Python<'py>,
    env: Option<HashMap<String, String>>,
) -> PyResult<Bound<'py, PyDict>> {
    let l = match env {
        Some(e) => Launcher::from_vars(|k| e.get(k).cloned()),
        None => Launcher::from_env(),
    }
    .raise(py)?;
    let d = PyDict::new(py);
    d.set_item("launcher", l.kind.name())?;
    d.set_item("rank", l.rank)?;
    d.set_item("world", l.world)?;
    d.set_item("local_rank", l.local_rank)?;
    d.set_item("local_world_size", l.local_world)?;
    d.set_item("node", l.node)?;
    d.set_item("nodes", l.nodes)?;
    d.set_item("nodelist", l.nodelist)?;
    d.set_item("rank_from", l.rank_from)?;
    d.set_item("local_rank_from", l.local_from)?;
    d.set_item("node_from", l.node_from)?;
    d.set_item("nodes_from", l.nodes_from)?;
    Ok(d)
}

/// Adds this file's functions to the extension module.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(_launch_env, m)?)
}
