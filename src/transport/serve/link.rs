//! A connection's send side: DATA frames over its socket (`TcpLink`), or
//! RDMA writes on its queue pair (`RdmaLink`). What only an RDMA link
//! does (arming its CQ, a failed completion) is in `owner_rdma.rs`.

use crate::ring::IoBackend;
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

/// `$body` with `$l` bound to the link, whichever transport it is.
macro_rules! each_link {
    ($link:expr, $l:ident => $body:expr) => {
        match $link {
            ConnLink::Tcp($l) => $body,
            #[cfg(feature = "rdma")]
            ConnLink::Rdma($l) => $body,
        }
    };
}

impl ConnLink {
    /// A chunk of a grant with the node's times for it
    /// ([`crate::transport::proto::data_times`]):
    /// in the DATA header over TCP; an RDMA write's immediate data is the
    /// grant id alone, so there they go only to the node's metrics.
    ///
    /// # Safety
    /// As for [`Link::post_write`].
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn post_data(
        &mut self,
        id: u64,
        src: *const u8,
        len: u32,
        off: u64,
        g: u32,
        rkey: u32,
        times: u32,
    ) -> bool {
        // SAFETY: forwarded contract.
        unsafe {
            match self {
                ConnLink::Tcp(l) => {
                    let _ = rkey;
                    l.post_write_timed(id, src, len, off, g, times)
                }
                #[cfg(feature = "rdma")]
                ConnLink::Rdma(l) => {
                    let _ = times;
                    l.post_write(id, src, len, off, g, rkey)
                }
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
        unsafe { each_link!(self, l => l.post_error(id, g, code, msg, len)) }
    }

    /// Queues a heartbeat on a TCP link (over RDMA the node writes them on
    /// the control socket instead); false when it cannot go now.
    pub(super) fn post_heartbeat(&mut self, id: u64, hdr: crate::transport::proto::Header) -> bool {
        match self {
            ConnLink::Tcp(l) => l.post_header(id, hdr),
            #[cfg(feature = "rdma")]
            ConnLink::Rdma(_) => false,
        }
    }

    pub(super) fn flush<R: IoBackend>(&mut self, ring: &mut R) -> std::io::Result<()> {
        match self {
            ConnLink::Tcp(l) => l.flush_on(ring),
            #[cfg(feature = "rdma")]
            ConnLink::Rdma(l) => l.flush(&mut ()),
        }
    }

    pub(super) fn poll(&mut self, out: &mut [Done]) -> usize {
        each_link!(self, l => l.poll(out))
    }

    pub(super) fn busy(&self) -> bool {
        each_link!(self, l => l.busy())
    }

    /// Whether it has frames queued (TCP: not yet flushed) or in flight.
    pub(super) fn pending(&self) -> bool {
        match self {
            ConnLink::Tcp(l) => l.pending(),
            #[cfg(feature = "rdma")]
            ConnLink::Rdma(l) => l.busy(),
        }
    }

    pub(super) fn close(&mut self) {
        each_link!(self, l => l.close())
    }

    pub(super) fn is_rdma(&self) -> bool {
        !matches!(self, ConnLink::Tcp(_))
    }
}
