//! A connection's send side: DATA frames over its socket (`TcpLink`), or
//! RDMA writes on its queue pair (`RdmaLink`).

use crate::ring::Uring;
use crate::transport::proto::Code;
use crate::transport::tcp::TcpLink;
use crate::transport::{Done, Link};

/// A connection's send side: DATA frames on its socket, or RDMA writes on
/// its queue pair.
pub(super) enum ConnLink {
    Tcp(TcpLink),
    #[cfg(feature = "rdma")]
    Rdma(Box<crate::transport::rdma::RdmaLink>),
}

impl ConnLink {
    /// # Safety
    /// As for [`Link::post_write`].
    pub(super) unsafe fn post_write(
        &mut self,
        id: u64,
        src: *const u8,
        len: u32,
        off: u64,
        g: u32,
        rkey: u32,
    ) -> bool {
        // SAFETY: forwarded contract.
        unsafe {
            match self {
                ConnLink::Tcp(l) => l.post_write(id, src, len, off, g, rkey),
                #[cfg(feature = "rdma")]
                ConnLink::Rdma(l) => l.post_write(id, src, len, off, g, rkey),
            }
        }
    }

    /// # Safety
    /// As for [`Link::post_error`].
    pub(super) unsafe fn post_error(
        &mut self,
        id: u64,
        g: u32,
        code: Code,
        msg: *const u8,
        len: u32,
    ) -> bool {
        // SAFETY: forwarded contract.
        unsafe {
            match self {
                ConnLink::Tcp(l) => l.post_error(id, g, code, msg, len),
                #[cfg(feature = "rdma")]
                ConnLink::Rdma(l) => l.post_error(id, g, code, msg, len),
            }
        }
    }

    pub(super) fn flush(&mut self, ring: &mut Uring) -> std::io::Result<()> {
        match self {
            ConnLink::Tcp(l) => l.flush(ring),
            #[cfg(feature = "rdma")]
            ConnLink::Rdma(l) => l.flush(&mut ()),
        }
    }

    pub(super) fn poll(&mut self, out: &mut [Done]) -> usize {
        match self {
            ConnLink::Tcp(l) => l.poll(out),
            #[cfg(feature = "rdma")]
            ConnLink::Rdma(l) => l.poll(out),
        }
    }

    pub(super) fn busy(&self) -> bool {
        match self {
            ConnLink::Tcp(l) => l.busy(),
            #[cfg(feature = "rdma")]
            ConnLink::Rdma(l) => l.busy(),
        }
    }

    pub(super) fn close(&mut self) {
        match self {
            ConnLink::Tcp(l) => l.close(),
            #[cfg(feature = "rdma")]
            ConnLink::Rdma(l) => l.close(),
        }
    }

    pub(super) fn is_rdma(&self) -> bool {
        !matches!(self, ConnLink::Tcp(_))
    }

    /// RDMA: arms the CQ (see [`crate::transport::rdma::RdmaLink::arm`]).
    pub(super) fn arm(&self) -> std::result::Result<(), String> {
        match self {
            ConnLink::Tcp(_) => Ok(()),
            #[cfg(feature = "rdma")]
            ConnLink::Rdma(l) => l.arm().map_err(|e| e.to_string()),
        }
    }

    /// Why an RDMA link broke (a failed completion), if it did.
    pub(super) fn failure(&self) -> Option<String> {
        match self {
            ConnLink::Tcp(_) => None,
            #[cfg(feature = "rdma")]
            ConnLink::Rdma(l) => l.error().map(|e| e.to_string()),
        }
    }
}
