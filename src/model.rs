//! The constants `examples/scale_model.rs` computes with, re-exported from
//! the modules whose code uses them, so the model's figures follow the
//! code rather than a copy of it. The example's test compares the tables
//! these feed with docs/SCALE.md: change a constant and that test fails
//! until the doc is regenerated (`cargo run --release --example
//! scale_model -- --connections`). Hidden: not an API, a window for the
//! model.

pub use crate::loader::net::handshake::HANDSHAKES_IN_FLIGHT;
pub use crate::loader::net::lanes::{MAX_LANES, SHARED_LANE_SHIFT};
#[cfg(feature = "rdma")]
pub use crate::loader::net::rdma::{
    CONSUMER_CQ_ENTRIES, LINK_SEND_CQ_ENTRIES, RDMA_RECVS, RDMA_RECV_BYTES, RDMA_WINDOWS,
    SRQ_RECVS_MAX,
};
pub use crate::transport::serve::config::MAX_HANDSHAKES;
#[cfg(feature = "rdma")]
pub use crate::transport::serve::owner_rdma::{OWNER_CQ_SPARE, OWNER_WRS};
