//! Transports: how sample bytes reach a consumer's landing ring.
//!
//! The protocol ([`proto`], docs/PROTOCOL.md) is shaped for one-sided
//! writes: a consumer *grants* an owner ranges of its registered landing
//! ring, the owner writes each sample's bytes into its granted range and the
//! completion carries the grant id. Over TCP (`serve` on the owner side,
//! the loader's network thread on the consumer side) a write is a DATA frame
//! whose header names the grant and the ring offset, checked against the
//! outstanding grant before a single payload byte lands; over RDMA it is a
//! WRITE_WITH_IMM (immediate = grant id) into a region registered for
//! remote write. `Link` is that owner-side seam: `tcp::TcpLink`
//! implements it over the poller's io_uring, `rdma::RdmaLink` (with the
//! `rdma` feature) over an RC queue pair.

pub mod cluster;
pub mod fetch;
pub(crate) mod hostlist;
pub mod proto;
// The verbs layer and the RDMA link: not part of the API (not in the docs
// or api/kspeed.txt); public only because tests/rdma.rs drives the verbs
// in the soft-RoCE VM and `kspeed inspect` lists devices. Moving those
// tests into unit tests would let this become pub(crate).
pub(crate) mod notices;
#[cfg(feature = "rdma")]
#[doc(hidden)]
pub mod rdma;
pub(crate) mod rx;
pub(crate) mod serve;
pub(crate) mod stream_rx;
pub(crate) mod tcp;

use std::io;

/// A finished piece of work posted to a [`Link`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[doc(hidden)]
pub struct Done {
    /// The id given when it was posted (the poster's slot index).
    pub wr_id: u64,
    /// Whether it reached the peer's transport (false: the connection broke).
    pub ok: bool,
}

/// The owner side of one connection to a consumer: one-sided writes of
/// local memory into ranges of the consumer's landing ring it granted, each
/// carrying the grant id to the consumer's completion, plus ERROR control
/// messages. Shaped after an RC queue pair:
///
/// - work is *posted* with a caller-chosen `wr_id` (the index of a slot the
///   caller owns: nothing is allocated per request) and executes in post
///   order;
/// - a post is refused when the send queue is full (back-pressure, never a
///   heap fallback);
/// - [`Link::flush`] hands what was posted to the transport in one go (one
///   doorbell, or one `sendmsg` for many frames);
/// - completions are polled in batches with [`Link::poll`].
#[doc(hidden)]
pub trait Link {
    /// What submissions go through: the poller's io_uring for TCP; the
    /// verbs backend rings its queue pair's doorbell itself.
    type Driver;

    /// Posts a write of `len` bytes at `src` to ring offset `remote_offset`
    /// of the peer, completing grant `grant` (in part or whole), under the
    /// grant's remote key `rkey` (RDMA; ignored over TCP). Returns false
    /// when the send queue is full.
    ///
    /// # Safety
    /// `src..src+len` must stay valid and unchanged until the [`Done`] for
    /// `wr_id` has been polled.
    unsafe fn post_write(
        &mut self,
        wr_id: u64,
        src: *const u8,
        len: u32,
        remote_offset: u64,
        grant: u32,
        rkey: u32,
    ) -> bool;

    /// Posts an ERROR for `grant` (`proto::CONNECTION`: the whole
    /// connection) with a UTF-8 message of `len` bytes at `msg`.
    ///
    /// # Safety
    /// As for [`Link::post_write`], for the message bytes.
    unsafe fn post_error(
        &mut self,
        wr_id: u64,
        grant: u32,
        code: proto::Code,
        msg: *const u8,
        len: u32,
    ) -> bool;

    /// Hands posted work to the transport.
    fn flush(&mut self, driver: &mut Self::Driver) -> io::Result<()>;

    /// Moves finished work into `out`; returns how many.
    fn poll(&mut self, out: &mut [Done]) -> usize;
}

/// Which RDMA device, port and GID a node service or a loader uses for the
/// RDMA transport.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RdmaOptions {
    /// Device name (`mlx5_0`, `rxe0`); `None`: the first device.
    pub device: Option<String>,
    /// Port number (from 1).
    pub port: u8,
    /// GID index; `None`: the RoCE v2 GID carrying the IP address of the
    /// TCP control connection (the address the node service listens on, or
    /// the one the consumer reaches it from).
    pub gid_index: Option<u8>,
}

impl Default for RdmaOptions {
    fn default() -> Self {
        RdmaOptions {
            device: None,
            port: 1,
            gid_index: None,
        }
    }
}

setters!(RdmaOptions {
    device: Option<String>,
    port: u8,
    gid_index: Option<u8>,
});

/// Whether this build has the RDMA transport (the `rdma` feature).
pub const RDMA_BUILT: bool = cfg!(feature = "rdma");

pub use cluster::{Cluster, ClusterSpec, LaunchEnv, Node, DEFAULT_PORT};
pub use fetch::PeerFetch;
pub use serve::{serve_until_signal, NodeService, ServeConfig, ServeStats, MIN_IDLE_TIMEOUT};
