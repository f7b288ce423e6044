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
//! - [`ring`]: io_uring reads into caller-owned slots, and a fault-injecting wrapper;
//! - [`landing`]: the landing ring's memory (huge pages, mlock, NUMA, CUDA);
//! - [`loader`]: pollers, the schedule, the memory tier and the consumer API;
//! - [`placement`]: the node's CPU topology, the local rank and the cores a loader's pollers use;
//! - [`transport`]: how bytes reach a remote consumer: the push protocol, the node
//!   service (`kspeed serve`), cluster files, TCP and (with the `rdma` feature) RDMA links;
//! - [`progress`]: progress for long work (lines; bars with the `cli` feature);
//! - [`par`]: the scoped worker pool of the bulk passes (checksums, preload, verify);
//! - [`capi`]: the C ABI (`libkspeed.so`, `include/kspeed.h`);
//! - internal (`pub(crate)`): `format` (the checksummed envelope of kspeed's
//!   binary files), `hash` (the frozen integer mixers of the sampler and owner function), `sys` (the system calls
//!   std lacks).

#![warn(missing_docs)]

pub mod capi;
pub mod dataset;
pub mod error;
pub(crate) mod format;
// Public: the frozen mixers are part of the wire contract (docs/FORMAT.md)
// that other implementations and the scale model compute alike.
pub mod hash;
pub mod landing;
pub mod loader;
pub mod par;
pub mod placement;
mod pool;
pub mod progress;
pub mod ring;
pub mod sampler;
mod sys;
pub mod transport;

pub use error::{Error, Result};
