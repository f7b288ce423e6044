//! `_audit`: the exactly-once audit of a job from its ranks' saved
//! positions (`kspeed.audit` in Python; `kspeed audit` on the command line).

use pyo3::prelude::*;

use crate::errors::Raise;
use kspeed::sampler::{audit_positions, SavedPosition};

/// One line per epoch ("epoch 3: 1,281,167 samples, each exactly once");
/// a mismatch raises DataError (kind "AuditMismatch") naming the first
/// difference.
#[pyfunction]
fn _audit(py: Python<'_>, positions: Vec<Vec<u8>>) -> PyResult<Vec<String>> {
    py.detach(|| -> kspeed::Result<Vec<String>> {
        let saved = positions
            .iter()
            .enumerate()
            .map(|(i, b)| {
                SavedPosition::decode(b).map_err(|e| match e {
                    kspeed::Error::BadPosition(why) => {
                        kspeed::Error::BadPosition(format!("position {i}: {why}"))
                    }
                    e => e,
                })
            })
            .collect::<kspeed::Result<Vec<_>>>()?;
        Ok(audit_positions(&saved)?
            .iter()
            .map(|r| r.to_string())
            .collect())
    })
    .raise(py)
}

/// `position` (a rank's saved position) after the rank delivered `ids`
/// too: the position of a checkpoint in the middle of a batch, for the
/// audit (`KSpeedDataset.state_dict()`'s `audit_position`).
#[pyfunction]
fn _position_advanced<'py>(
    py: Python<'py>,
    position: Vec<u8>,
    ids: Vec<u64>,
) -> PyResult<Bound<'py, pyo3::types::PyBytes>> {
    let saved = SavedPosition::decode(&position)
        .and_then(|s| s.advanced(&ids))
        .raise(py)?;
    Ok(pyo3::types::PyBytes::new(py, &saved.save()))
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(_audit, m)?)?;
    m.add_function(wrap_pyfunction!(_position_advanced, m)?)
}
