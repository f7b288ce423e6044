//! Transports: how sample bytes reach a consumer's landing ring.
//!
//! The protocol ([`proto`], docs/PROTOCOL.md) is shaped for one-sided
//! writes: a consumer *grants* an owner ranges of its registered landing
//! ring, the owner writes each sample's bytes into its granted range and the
//! completion carries the grant id. Over TCP ([`serve`] on the owner side,
//! the loader's network thread on the consumer side) a write is a DATA frame
//! whose header names the grant and the ring offset, checked against the
//! outstanding grant before a single payload byte lands; over RDMA it will
//! be a WRITE_WITH_IMM (immediate = grant id) into a region registered for
//! remote write.

pub mod cluster;
pub mod proto;
#[cfg(feature = "rdma")]
pub mod rdma;
pub mod serve;

pub use cluster::{Cluster, LaunchEnv, Node};
pub use serve::{NodeService, ServeConfig, ServeStats};
