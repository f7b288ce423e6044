//! The RDMA side of the node service (built with the `rdma` feature;
//! `no_rdma.rs` stands in without it): the verbs resources (one context and
//! protection domain, a completion channel per poller), the staging slab's
//! registration, the RDMA part of a consumer's handshake and the link it
//! gets. The pollers use these through the same names either way, so
//! their logic has no `cfg`.

use std::net::TcpStream;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::link::ConnLink;
use super::{Accepted, Common};
use crate::error::{Error, Result};
use crate::sys::AlignedBuf;
use crate::transport::proto::{self, Code, Header, Kind};
use crate::transport::rdma::{Access, CompChannel, Mr, SendRegions};

/// Work requests of a consumer's QP on the node's side: one per staging
/// slot (a slot is written at most once at a time), within these bounds.
pub const OWNER_WRS: (usize, usize) = (16, 4096);
/// CQ entries beyond the QP's work requests (its SENDs of ERRORs).
pub const OWNER_CQ_SPARE: usize = 16;

/// The verbs resources of a node service: one device context and protection
/// domain; the staging slabs and (page-cache mode) the mapped extents are
/// registered in it, local access only.
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

/// The owner's end of an RDMA connection, set up during the handshake.
pub(super) struct RdmaAccepted {
    pub(super) qp: crate::transport::rdma::Qp,
    pub(super) cq: Arc<crate::transport::rdma::Cq>,
}

/// After WELCOME on an RDMA connection, with the consumer's RDMA_ENDPOINT
/// frame (`hb`, `body`) read by the acceptor: creates and connects this
/// end's queue pair (on the GID of the address the consumer reached, unless
/// one is configured), and answers with it (40 bytes into a socket that has
/// sent only WELCOME: the send buffer takes them whole without blocking).
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
    let max_wr = c.cfg.slots().clamp(OWNER_WRS.0, OWNER_WRS.1) as u32;
    let cq = Cq::with_channel(
        &r.ctx,
        (max_wr as usize + OWNER_CQ_SPARE) as i32,
        &r.channels[poller],
    )
    .map_err(failed)?;
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

impl OwnerRdma {
    /// Whether RDMA links may send from the mapped extents (registered).
    pub(super) fn sends_from_maps(&self) -> bool {
        !self.map_mrs.is_empty()
    }
}

/// A poller's staging slab as the NIC sees it: registered read-only, with
/// the mapped extents' regions (page-cache mode) the links send from.
pub(super) struct StagingMr {
    pub(super) regions: SendRegions,
    pub(super) _mr: Option<Mr>,
}

impl StagingMr {
    /// Registers `buf` when the service offers RDMA.
    pub(super) fn register(c: &Common, buf: &mut AlignedBuf) -> Result<StagingMr> {
        let mut st = StagingMr {
            regions: Default::default(),
            _mr: None,
        };
        if let Some(r) = &c.rdma {
            let p = buf.as_mut_ptr();
            // SAFETY: the slab lives in the poller, which drops every
            // link (QP) before the slab; the NIC only reads it.
            let mr = unsafe { Mr::register(&r.pd, p, buf.len(), Access::ReadOnly) }?;
            let mut all: Vec<&Mr> = r.map_mrs.iter().collect();
            all.push(&mr);
            st.regions = SendRegions::new(&all);
            st._mr = Some(mr);
        }
        Ok(st)
    }
}

/// A poller's completion channel (the one its connections' CQs wake), when
/// the service offers RDMA.
pub(super) struct PollerChannel(Option<Arc<CompChannel>>);

impl PollerChannel {
    pub(super) fn new(c: &Common, index: usize) -> Self {
        PollerChannel(c.rdma.as_ref().map(|r| r.channels[index].clone()))
    }

    /// Its descriptor, to poll in the ring.
    pub(super) fn fd(&self) -> Option<i32> {
        self.0.as_ref().map(|ch| ch.fd())
    }

    /// Consumes its events (after the ring's poll of it completed).
    pub(super) fn drain(&self) {
        if let Some(ch) = &self.0 {
            ch.drain();
        }
    }
}

impl Accepted {
    /// Whether the handshake set up a queue pair (counted in `rdma_qps`).
    pub(super) fn has_rdma(&self) -> bool {
        self.rdma.is_some()
    }

    /// The RDMA link of a consumer that asked for RDMA: its queue pair,
    /// sending from the staging slab `staging` registers (and the mapped
    /// extents); None over TCP.
    pub(super) fn take_rdma_link(&mut self, staging: &StagingMr, slots: usize) -> Option<ConnLink> {
        let r = self.rdma.take()?;
        Some(ConnLink::Rdma(Box::new(
            crate::transport::rdma::RdmaLink::new(
                r.qp,
                r.cq,
                staging.regions.clone(),
                self.hello.ring_addr,
                slots.clamp(OWNER_WRS.0, OWNER_WRS.1),
            ),
        )))
    }
}

impl ConnLink {
    /// RDMA: arms the CQ (see [`crate::transport::rdma::RdmaLink::arm`]).
    pub(super) fn arm(&self) -> std::result::Result<(), String> {
        match self {
            ConnLink::Tcp(_) => Ok(()),
            ConnLink::Rdma(l) => l.arm().map_err(|e| e.to_string()),
        }
    }

    /// Why an RDMA link broke (a failed completion), if it did.
    pub(super) fn failure(&self) -> Option<String> {
        match self {
            ConnLink::Tcp(_) => None,
            ConnLink::Rdma(l) => l.error().map(|e| e.to_string()),
        }
    }
}
