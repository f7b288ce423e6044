//! `kspeed._kspeed`: the extension module under the `kspeed` Python package.
//!
//! The Python layer (`python/kspeed/`) validates arguments and reads the
//! launcher's environment; this module owns the loader and every view of
//! the landing ring that Python can see.
//!
//! Lifetime rule (DESIGN.md: "no caller-visible view outlives its bytes"):
//! - every view of a batch (the per-sample and whole-batch numpy arrays, the
//!   memoryviews over them, DLPack capsules and the tensors made from them)
//!   holds a strong reference to its [`Batch`], and the batch holds the
//!   loader's [`Shared`] state, so neither the ring nor the loader can go
//!   while a view exists (nor the memory tier, which the Rust loader owns:
//!   with `tier_views`, per-sample views point into it);
//! - a batch's ring space goes back to the loader only when the batch is no
//!   longer referenced, or on `release()` (refused while views are alive);
//!   releases reach the Rust loader in batch order
//!   ([`kspeed::loader::Loader::release_oldest_batch`]), so releasing one
//!   batch never frees another's bytes;
//! - operations that restart the pollers (an out-of-order `set_epoch`,
//!   `load_state_dict`, `close`) are refused while any batch has live views,
//!   and invalidate batches without views (their methods then raise).
//!
//! One file per class or group of functions (as pydantic-core does), each
//! with a `register` function that the module init below calls: adding a
//! file is one line here.

mod batch;
mod bench;
mod catalog;
mod dlpack;
mod errors;
mod launcher;
mod loader;
mod node_service;
mod objects;
mod options;
mod position;
mod shared;

use pyo3::prelude::*;

pub(crate) use batch::Batch;
pub(crate) use shared::BatchFlags;

#[pymodule]
fn _kspeed(m: &Bound<'_, PyModule>) -> PyResult<()> {
    loader::register(m)?;
    batch::register(m)?;
    catalog::register(m)?;
    node_service::register(m)?;
    options::register(m)?;
    bench::register(m)?;
    launcher::register(m)?;
    position::register(m)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
