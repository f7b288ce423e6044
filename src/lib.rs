//! kspeed feeds GPU training jobs without I/O stalls.
//!
//! A dataset is preloaded once onto the local NVMe of the cluster's nodes
//! ([`dataset::preload()`]). Every rank's sample order is a pure function of
//! (seed, epoch, rank, world size, dataset length) ([`sampler`]), so the nodes
//! that own the samples can push them into each rank's landing buffer before
//! it asks. See docs/ and the repository's DESIGN notes for the architecture.
//!
//! Modules, following the architecture:
//! - [`dataset`]: sources, the catalog, the owner function, spaces, preload, verify, and
//!   (with the `gen` feature) a synthetic dataset generator;
//! - [`sampler`]: the per-epoch permutation and each rank's sequence;
//! - [`landing`]: the landing ring's memory (huge pages, mlock, NUMA, CUDA);
//! - [`loader`]: pollers, the schedule, the memory tier and the consumer API;
//! - [`placement`]: the node's CPU topology, the local rank and the cores a loader's pollers use;
//! - [`transport`]: how bytes reach a remote consumer: the push protocol, the node
//!   service (`kspeed serve`), cluster files, TCP and (with the `rdma` feature) RDMA links;
//! - [`progress`]: progress for long work (lines; bars with the `cli` feature);
//! - [`hash`]: the frozen integer mixers of the sampler and owner function
//!   (a wire contract, docs/FORMAT.md);
//! - internal (`pub(crate)`): `ring` (io_uring reads into caller-owned
//!   slots, and a fault-injecting wrapper, configured through
//!   [`loader::FaultConfig`]), `par` (the scoped worker pool of the bulk
//!   passes; its default size is [`dataset::default_threads`]), `format`
//!   (the checksummed envelope of kspeed's binary files), `sys` (the system
//!   calls std lacks), and inside the public modules the loader's schedule
//!   and memory tier and the transports' TCP link and serve internals.
//!
//! The public surface is listed in `api/kspeed.txt`, which CI checks
//! (`scripts/api_listing.sh --check`): a change to it shows in review.
//! Option and report structs are `#[non_exhaustive]`: build them from
//! `Default` (or their constructor) and the builder-style setters, so a
//! field added later does not break callers.

#![warn(missing_docs)]

/// Builder-style setters, one per listed public field, for the
/// `#[non_exhaustive]` option structs (which callers outside the crate
/// cannot build with a struct literal): `Options::default().field(v)`.
macro_rules! setters {
    ($t:ty { $($f:ident: $ft:ty),* $(,)? }) => {
        impl $t {
            $(
                #[doc = concat!("Sets `", stringify!($f), "` (builder style).")]
                #[must_use]
                pub fn $f(mut self, v: $ft) -> Self {
                    self.$f = v;
                    self
                }
            )*
        }
    };
}

// The node agent's attach layer (issue 28): hidden until the loader and
// the agent use it; public so tests/attach.rs drives it across processes.
#[doc(hidden)]
pub mod agent;
pub mod cache;
pub mod dataset;
pub mod error;
pub(crate) mod format;
// Public: the frozen mixers are part of the wire contract (docs/FORMAT.md)
// that other implementations and the scale model compute alike.
pub mod hash;
pub mod landing;
pub mod launcher;
pub mod loader;
// The constants the scale model computes with (examples/scale_model.rs):
// hidden, not an API.
#[doc(hidden)]
pub mod model;
pub(crate) mod par;
pub mod placement;
mod pool;
pub mod progress;
pub(crate) mod ring;
pub mod sampler;
#[cfg(test)]
mod sim;
pub(crate) mod stall;
mod sys;
pub mod transport;

pub use error::{Error, Result};
