//! Transports: how sample bytes reach a consumer's landing ring. The local,
//! TCP and RDMA backends arrive with the data-path issues; for now this holds
//! the RDMA device probe, so a build with the `rdma` feature is exercised.

#[cfg(feature = "rdma")]
pub mod rdma;
