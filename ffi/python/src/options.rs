//! The loader's options from Python: keyword arguments go through the
//! crate's one options table (`kspeed::loader::options`), shared with the C
//! ABI, the `kspeed read` flags and the DALI operator; `_options()` hands
//! the table itself to Python (`kspeed.options()`, the `Loader` docstring).

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};

use kspeed::loader::options::{spec, OptionKind, OptionValue, OPTIONS};
use kspeed::loader::{LoaderBuilder, LoaderOptions};

use crate::errors::{Fail, Raise};

/// `cfg[key]`, `None` when absent or None.
pub(crate) fn get<'py, T: pyo3::conversion::FromPyObjectOwned<'py>>(
    cfg: &Bound<'py, PyDict>,
    key: &str,
) -> PyResult<Option<T>> {
    match cfg.get_item(key)? {
        None => Ok(None),
        Some(v) if v.is_none() => Ok(None),
        Some(v) => v.extract::<T>().map(Some).map_err(|e| {
            let e: PyErr = e.into();
            PyTypeError::new_err(format!("argument {key}: {e}"))
        }),
    }
}

/// The table's error as Python raises it: `TypeError` for a value of a
/// type the option never takes, `kspeed.ConfigError` (a `ValueError`)
/// otherwise; the message is the crate's, as in every front end.
fn raise(py: Python<'_>, e: kspeed::Error) -> PyErr {
    match &e {
        kspeed::Error::InvalidOption {
            wrong_type: true, ..
        } => PyTypeError::new_err(e.to_string()),
        _ => Fail::from_kspeed(e).into_py(py),
    }
}

/// Sets `key` from a Python value through the table.
fn set_py(o: &mut LoaderOptions, key: &str, v: &Bound<'_, PyAny>) -> PyResult<()> {
    let py = v.py();
    let r = if v.is_none() {
        o.set_value(key, OptionValue::None)
    } else if let Ok(b) = v.cast::<PyBool>() {
        o.set_value(key, OptionValue::Bool(b.is_true()))
    } else if v.is_instance_of::<PyInt>() {
        match v.extract::<i128>() {
            Ok(n) => o.set_value(key, OptionValue::Int(n)),
            // Beyond i128: above any maximum.
            Err(_) => o.set_value(key, OptionValue::Int(i128::MAX)),
        }
    } else if let Ok(x) = v.cast::<PyFloat>() {
        o.set_value(key, OptionValue::Float(x.value()))
    } else if let Ok(s) = v.cast::<PyString>() {
        let s = s.to_cow()?;
        o.set_value(key, OptionValue::Str(&s))
    } else if key == "token" && v.extract::<Vec<u8>>().is_ok() {
        o.set_token(&v.extract::<Vec<u8>>()?);
        Ok(())
    } else if v.is_instance_of::<PyList>() || v.is_instance_of::<PyTuple>() {
        match v.extract::<Vec<String>>() {
            Ok(l) => o.set_value(key, OptionValue::List(&l)),
            Err(_) => o.set_value(key, OptionValue::Other(&v.repr()?.to_cow()?)),
        }
    } else {
        o.set_value(key, OptionValue::Other(&v.repr()?.to_cow()?))
    };
    r.map_err(|e| raise(py, e))
}

/// Keys of the extension's configuration dict that are the Python layer's
/// own (not loader options).
const PYTHON_ONLY: &[&str] = &["batches_in_flight", "fault_injection", "start"];

/// The Rust builder for a configuration dict (every loader option by its
/// table key; `batches_in_flight`, `fault_injection` and `start` besides),
/// and the batches Python may hold at once.
pub(crate) fn builder_from(cfg: &Bound<'_, PyDict>) -> PyResult<(LoaderBuilder, usize)> {
    let py = cfg.py();
    let given = [
        get::<String>(cfg, "space")?.is_some(),
        get::<String>(cfg, "source")?.is_some(),
        cfg.contains("mix")?,
    ];
    if given.iter().filter(|&&g| g).count() != 1 {
        return Err(PyValueError::new_err(
            "give exactly one of space= (a preloaded space), source= (files read directly) \
             or mix= (several datasets with weights)",
        ));
    }
    let mut o = LoaderOptions::new();
    for (k, v) in cfg.iter() {
        let key: String = k.extract()?;
        if PYTHON_ONLY.contains(&key.as_str()) {
            continue;
        }
        set_py(&mut o, &key, &v)?;
    }
    match (
        get::<u32>(cfg, "local_rank")?,
        get::<u32>(cfg, "local_world_size")?,
    ) {
        (Some(_), Some(_)) | (None, None) => {}
        _ => {
            return Err(PyValueError::new_err(
                "give both local_rank and local_world_size, or neither",
            ))
        }
    }
    if let (Some(g), true) = (
        get::<u32>(cfg, "gpu_ring")?,
        get::<bool>(cfg, "tier_views")?.unwrap_or(false),
    ) {
        // The Rust builder refuses a memory tier with a GPU ring, and
        // without a tier tier_views does nothing: say so.
        return Err(PyValueError::new_err(format!(
            "tier_views=True needs a memory tier in host memory, and a GPU ring \
             (gpu_ring={g}) has no memory tier: leave tier_views off"
        )));
    }
    let mut b = o.builder().raise(py)?;
    // The Python layer settles the rank and world (the arguments, else the
    // launcher's environment, refusing contradictions): they win over
    // `cluster_env`'s reading of the same environment.
    if let (Some(r), Some(w)) = (get::<u32>(cfg, "rank")?, get::<u32>(cfg, "world")?) {
        b = b.rank(r, w);
    }
    if let Some(f) = get::<(u64, u32, u32, u32)>(cfg, "fault_injection")? {
        b = b.fault_injection(
            kspeed::loader::FaultConfig::default()
                .seed(f.0)
                .eio_ppm(f.1)
                .short_ppm(f.2)
                .delay_ppm(f.3),
        );
    }
    if let Some((e, i)) = get::<(u64, u64)>(cfg, "start")? {
        b = b.start_at(kspeed::sampler::Position { epoch: e, index: i });
    }
    let max_out = get::<usize>(cfg, "batches_in_flight")?.unwrap_or(2).max(1);
    Ok((b, max_out))
}

/// The options table: one dict per option (`name`, `type`, `unit`, `min`,
/// `max`, `choices`, `default`, `doc`, `alias_of`, `cli`, `allowed`).
#[pyfunction]
fn _options<'py>(py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
    let l = PyList::empty(py);
    for o in OPTIONS {
        let d = PyDict::new(py);
        d.set_item("name", o.name)?;
        d.set_item("type", o.kind.type_name())?;
        d.set_item("unit", o.unit)?;
        let (min, max) = match o.kind.range() {
            Some((a, b)) => (Some(a), Some(b)),
            None => (None, None),
        };
        d.set_item("min", min)?;
        d.set_item("max", max)?;
        let choices: Option<Vec<&str>> = match o.kind {
            OptionKind::Choice(w) => Some(w.to_vec()),
            _ => None,
        };
        d.set_item("choices", choices)?;
        d.set_item("default", o.default)?;
        d.set_item("doc", o.doc)?;
        d.set_item("alias_of", o.alias_of)?;
        d.set_item("cli", o.cli)?;
        d.set_item("allowed", o.kind.allowed())?;
        l.append(d)?;
    }
    Ok(l)
}

/// Checks one option's value through the table, as `Loader(...)` will
/// (raises its error); `from_str`: parse a string as the C ABI does.
#[pyfunction]
#[pyo3(signature = (key, value, from_str = false))]
fn _check_option(
    py: Python<'_>,
    key: &str,
    value: &Bound<'_, PyAny>,
    from_str: bool,
) -> PyResult<()> {
    let mut o = LoaderOptions::new();
    if from_str {
        let s: String = value.extract()?;
        return o.set(key, &s).map_err(|e| raise(py, e));
    }
    if spec(key).is_none() {
        return Err(raise(
            py,
            kspeed::Error::UnknownOption {
                key: key.into(),
                value: value.repr()?.to_string(),
            },
        ));
    }
    set_py(&mut o, key, value)
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(_options, m)?)?;
    m.add_function(wrap_pyfunction!(_check_option, m)?)
}
