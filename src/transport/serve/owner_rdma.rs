//! The node service's verbs resources (one context and protection domain,
//! a completion channel per poller) and the RDMA part of a consumer's
//! handshake. Without the `rdma` feature, only the refusal is left.

#[cfg(feature = "rdma")]
use std::net::TcpStream;
#[cfg(feature = "rdma")]
use std::sync::atomic::Ordering;
#[cfg(feature = "rdma")]
use std::sync::Arc;

#[cfg(feature = "rdma")]
use super::Common;
use crate::error::{Error, Result};
#[cfg(feature = "rdma")]
use crate::transport::proto::{self, Code, Header, Kind};

/// The verbs resources of a node service: one device context and protection
/// domain; the staging slabs and (page-cache mode) the mapped extents are
/// registered in it, local access only.
#[cfg(feature = "rdma")]
pub(super) struct OwnerRdma {
    pub(super) opts: crate::transport::RdmaOptions,
    pub(super) ctx: Arc<crate::transport::rdma::Context>,
    pub(super) pd: Arc<crate::transport::rdma::Pd>,
    /// Page-cache mode: the mapped extents, registered read-only.
    pub(super) map_mrs: Vec<crate::transport::rdma::Mr>,
    /// Per poller: the completion channel its connections' CQs wake, so
    /// a poller waiting for its writes sleeps instead of spinning.
    pub(super) channels: Vec<Arc<crate::transport::rdma::CompChannel>>,
}

#[cfg(not(feature = "rdma"))]
pub(super) struct OwnerRdma;

#[cfg(feature = "rdma")]
pub(super) fn open_owner_rdma(
    opts: &crate::transport::RdmaOptions,
    maps: &[crate::sys::ReadOnlyMap],
    pollers: usize,
) -> Result<OwnerRdma> {
    use crate::transport::rdma::{Access, CompChannel, Context, Mr, Pd};
    let ctx = Context::open(opts.device.as_deref(), opts.port, opts.gid_index)?;
    let pd = Pd::new(&ctx)?;
    let mut map_mrs = Vec::with_capacity(maps.len());
    for m in maps {
        let b = m.as_slice();
        if b.is_empty() {
            continue;
        }
        // SAFETY: the mapping lives in Common, which outlives every link
        // (pollers hold an Arc of it); the NIC only reads it.
        match unsafe { Mr::register(&pd, b.as_ptr() as *mut u8, b.len(), Access::ReadOnly) } {
            Ok(mr) => map_mrs.push(mr),
            Err(e) => {
                // Some drivers (soft-RoCE among them) refuse to pin a
                // read-only file mapping. RDMA consumers then get their
                // samples through staging (O_DIRECT reads); TCP ones still
                // from the page cache.
                log::warn!(
                    "page-cache mode: the mapped extents cannot be registered for RDMA ({e}); \
                     RDMA consumers are served through staging"
                );
                map_mrs.clear();
                break;
            }
        }
    }
    log::info!(
        "RDMA transport on {} port {} (GID index {})",
        ctx.name(),
        opts.port,
        opts.gid_index.map_or(
            "per connection: the RoCE v2 GID of its address".to_string(),
            |i| i.to_string()
        )
    );
    let channels = (0..pollers)
        .map(|_| CompChannel::new(&ctx))
        .collect::<Result<Vec<_>>>()?;
    Ok(OwnerRdma {
        opts: opts.clone(),
        ctx,
        pd,
        map_mrs,
        channels,
    })
}

#[cfg(not(feature = "rdma"))]
pub(super) fn open_owner_rdma(
    _: &crate::transport::RdmaOptions,
    _: &[crate::sys::ReadOnlyMap],
    _: usize,
) -> Result<OwnerRdma> {
    Err(Error::InvalidConfig(
        "this kspeed was built without the `rdma` feature: no RDMA transport".into(),
    ))
}

/// The owner's end of an RDMA connection, set up during the handshake.
#[cfg(feature = "rdma")]
pub(super) struct RdmaAccepted {
    pub(super) qp: crate::transport::rdma::Qp,
    pub(super) cq: Arc<crate::transport::rdma::Cq>,
}

/// After WELCOME on an RDMA connection, with the consumer's RDMA_ENDPOINT
/// frame (`hb`, `body`) read by the acceptor: creates and connects this
/// end's queue pair (on the GID of the address the consumer reached, unless
/// one is configured), and answers with it (40 bytes into a socket that has
/// sent only WELCOME: the send buffer takes them whole without blocking).
#[cfg(feature = "rdma")]
pub(super) fn rdma_handshake(
    c: &Common,
    sock: &mut TcpStream,
    hb: &[u8; proto::HEADER_BYTES],
    body: &[u8],
    poller: usize,
) -> Result<RdmaAccepted, (Code, String)> {
    use crate::transport::rdma::{Cq, Qp, RDMA_ERROR_BYTES};
    use std::io::Write;
    let r = c.rdma.as_ref().expect("checked by the caller");
    let violation = |m: String| (Code::Violation, m);
    let failed = |e: Error| (Code::TransportFailed, format!("node RDMA setup: {e}"));
    let h = Header::decode(hb, 0).map_err(|e| violation(e.to_string()))?;
    if h.kind != Kind::RdmaEndpoint {
        return Err(violation(format!(
            "expected RDMA_ENDPOINT, got {:?}",
            h.kind
        )));
    }
    let theirs = proto::RdmaEndpoint::decode(&h, body).map_err(|e| violation(e.to_string()))?;
    let max_wr = c.cfg.slots().clamp(16, 4096) as u32;
    let cq = Cq::with_channel(&r.ctx, max_wr as i32 + 16, &r.channels[poller]).map_err(failed)?;
    let mut qp = Qp::new(&r.pd, &cq, &cq, max_wr, (4 + RDMA_ERROR_BYTES) as u32).map_err(failed)?;
    let ip = sock
        .local_addr()
        .map_err(|e| failed(Error::Serve(format!("local address: {e}"))))?
        .ip();
    let (index, gid) = r.ctx.choose_gid(r.opts.gid_index, ip).map_err(failed)?;
    qp.use_gid(index, gid);
    qp.connect(&theirs).map_err(failed)?;
    sock.write_all(&qp.endpoint().encode())
        .map_err(|e| violation(format!("sending RDMA_ENDPOINT: {e}")))?;
    c.stats.rdma_qps.fetch_add(1, Ordering::Relaxed);
    Ok(RdmaAccepted { qp, cq })
}
