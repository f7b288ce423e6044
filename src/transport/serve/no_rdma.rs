//! Stands in for `owner_rdma.rs` in a build without the `rdma` feature:
//! the same names, no RDMA (a service asked for it is refused at start).

use super::link::ConnLink;
use super::{Accepted, Common};
use crate::error::{Error, Result};
use crate::sys::AlignedBuf;

pub(super) struct OwnerRdma;

impl OwnerRdma {
    pub(super) fn sends_from_maps(&self) -> bool {
        false
    }
}

pub(super) fn open_owner_rdma(
    _: &crate::transport::RdmaOptions,
    _: &[crate::sys::ReadOnlyMap],
    _: usize,
) -> Result<OwnerRdma> {
    Err(Error::InvalidConfig(
        "this kspeed was built without the `rdma` feature: no RDMA transport".into(),
    ))
}

/// Nothing is registered.
pub(super) struct StagingMr;

impl StagingMr {
    pub(super) fn register(_: &Common, _: &mut AlignedBuf) -> Result<StagingMr> {
        Ok(StagingMr)
    }
}

/// No completion channel.
pub(super) struct PollerChannel;

impl PollerChannel {
    pub(super) fn new(_: &Common, _: usize) -> Self {
        PollerChannel
    }

    pub(super) fn fd(&self) -> Option<i32> {
        None
    }

    pub(super) fn drain(&self) {}
}

impl Accepted {
    pub(super) fn has_rdma(&self) -> bool {
        false
    }

    pub(super) fn take_rdma_link(&mut self, _: &StagingMr, _: usize) -> Option<ConnLink> {
        None
    }
}

impl ConnLink {
    /// Only RDMA links arm a CQ.
    pub(super) fn arm(&self) -> std::result::Result<(), String> {
        Ok(())
    }

    /// Only RDMA links fail by completion.
    pub(super) fn failure(&self) -> Option<String> {
        None
    }
}
