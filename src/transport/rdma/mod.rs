//! RDMA verbs (rdma-sys): the device probe, and RAII owners of the verbs
//! resources the RDMA transport is built from — device context, protection
//! domain, memory region and window (`verbs.rs`), completion queues and the RC
//! queue pair (`qp.rs`), the shared receive queue (`srq.rs`) — with the one-sided WRITE_WITH_IMM the push protocol uses
//! (immediate = grant id); the verbs-shaped interface work requests
//! (sends, memory-window binds and invalidations, receives) are
//! posted and polled through ([`WorkQueue`], `wq.rs`, with the real QP's
//! implementation, and [`FaultyQueue`], `faulty.rs`, which injects seeded
//! faults into any of them); and the owner side's link over it ([`RdmaLink`],
//! `link.rs`). Tests only: an in-memory queue-pair pair behind the same
//! interface, memory windows included (`memverbs.rs`), and the seeded
//! simulation that runs the real link over it (`sim.rs`; the consumer's
//! `RdmaRx` against the link: `crate::sim::rdma`).
//!
//! This module owns the verbs resources and is one of the few allowed
//! `unsafe`; the submodules say which resources each owns.

mod faulty;
mod link;
#[cfg(test)]
pub(crate) mod memverbs;
mod qp;
#[cfg(test)]
mod sim;
mod srq;
mod verbs;
mod wq;

pub use faulty::{FaultyQueue, QueueFaultStats, QueueFaults};
pub use link::{RdmaLink, RDMA_ERROR_BYTES, SIGNAL_EVERY};
pub use qp::{completion_error, wc_status_name, CompChannel, Cq, Endpoint, Qp, WorkCompletion};
pub use srq::{Srq, SRQ_CHAIN_MAX};
pub use verbs::{
    device_names, next_rkey, Access, Context, Mr, Mw, Pd, PortInfo, SendRegions, WindowOp,
};
pub use wq::{MwOp, MwWr, PostError, RecvWr, SendOp, SendWr, VerbsQueue, WorkQueue};
