//! RDMA verbs (rdma-sys): the device probe, and RAII owners of the verbs
//! resources the RDMA transport is built from — device context, protection
//! domain, memory region and window (`verbs.rs`), completion queues and the RC
//! queue pair (`qp.rs`) — with the one-sided WRITE_WITH_IMM the push protocol uses
//! (immediate = grant id); and the owner side's link over them
//! ([`RdmaLink`], `link.rs`).
//!
//! This module owns the verbs resources and is one of the few allowed
//! `unsafe`; the submodules say which resources each owns.

mod link;
mod qp;
mod verbs;

pub use link::{RdmaLink, RDMA_ERROR_BYTES, SIGNAL_EVERY};
pub use qp::{completion_error, wc_status_name, CompChannel, Cq, Endpoint, Qp, WorkCompletion};
pub use verbs::{
    device_names, next_rkey, Access, Context, Mr, Mw, Pd, PortInfo, SendRegions, WindowOp,
};
