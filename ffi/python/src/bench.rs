//! `_bench_rust`: the Rust loader alone, for scripts/bench_python.py.

use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::Raise;
use crate::options::builder_from;

/// For scripts/bench_python.py: the same configuration read by the Rust
/// loader alone, in this process and build (the baseline of the Python
/// layer's cost). Reads `warm_epochs` untimed epochs, then `epochs` timed
/// ones, touching each batch's span as Python callers touch `array()` (each
/// sample's view instead for a batch with `tier_views` samples, which has
/// no span); returns (seconds, samples, batches) of the timed part.
#[pyfunction]
fn _bench_rust(
    py: Python<'_>,
    cfg: &Bound<'_, PyDict>,
    warm_epochs: u64,
    epochs: u64,
) -> PyResult<(f64, u64, u64)> {
    let (builder, _) = builder_from(cfg)?;
    py.detach(|| {
        let mut l = builder.build()?;
        let (mut samples, mut batches, mut t) = (0u64, 0u64, None);
        for e in 0..warm_epochs + epochs {
            if e == warm_epochs {
                t = Some(std::time::Instant::now());
            }
            l.set_epoch(e)?;
            while let Some(b) = l.next_batch()? {
                if b.in_ring() {
                    let (span, wrap) = b.spans();
                    std::hint::black_box((span.first(), wrap.map(|w| w.len())));
                } else {
                    // tier_views: no span; the samples' views instead.
                    for s in b.iter() {
                        std::hint::black_box(s.bytes.first());
                    }
                }
                if e >= warm_epochs {
                    samples += b.len() as u64;
                    batches += 1;
                }
            }
        }
        let secs = t.map_or(0.0, |t| t.elapsed().as_secs_f64());
        Ok::<_, kspeed::Error>((secs, samples, batches))
    })
    .raise(py)
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(_bench_rust, m)?)
}
