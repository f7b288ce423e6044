//! Connecting a launch's network thread to every node: the TCP control
//! connection, HELLO and WELCOME (checked: version, node index, transport,
//! placement), then the data path's own setup ([`Receive::connect`]).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

#[cfg(feature = "rdma")]
use super::rdma::RdmaRx;
use super::tcp::TcpRx;
use super::{Conn, NetSetup, Receive, State};
use crate::dataset::Placement;
use crate::error::{Error, Result};
use crate::landing::LandingRing;
use crate::transport::proto::{self, Code, Header, Kind, Welcome};
use crate::transport::rx::FrameRx;

/// What [`connect_all`] made, over the transport the setup asks for.
pub(crate) enum Connected {
    Tcp(Connections<TcpRx>),
    #[cfg(feature = "rdma")]
    Rdma(Connections<RdmaRx>),
}

/// A connection per node (dead ones included) and what they share.
pub(crate) struct Connections<R: Receive> {
    pub(crate) conns: Vec<Conn<R>>,
    pub(crate) common: R::Common,
}

/// Connects to every node but the local one. A node that cannot be reached
/// is dead from the start (its samples fail over); a node that refuses the
/// HELLO (token, version, dataset) is an error: the job is misconfigured.
///
/// Over RDMA the landing ring `ring` (address, length) is registered for
/// remote write first, and every connection gets its queue pair.
pub(crate) fn connect_all(setup: &mut NetSetup, ring: &LandingRing) -> Result<Connected> {
    if setup.token.is_empty() || setup.token.len() > proto::MAX_TOKEN_BYTES {
        return Err(Error::InvalidConfig(format!(
            "the job token has {} bytes; it must have 1 to {} (the HELLO frame's limit)",
            setup.token.len(),
            proto::MAX_TOKEN_BYTES
        )));
    }
    match setup.rdma.clone() {
        None => Ok(Connected::Tcp(connect_with::<TcpRx>(setup, ())?)),
        #[cfg(feature = "rdma")]
        Some(opts) => {
            let common = RdmaRx::open(&opts, ring, &mut setup.hello)?;
            Ok(Connected::Rdma(connect_with::<RdmaRx>(setup, common)?))
        }
        #[cfg(not(feature = "rdma"))]
        Some(_) => {
            let _ = ring;
            Err(Error::InvalidConfig(
                "this kspeed was built without the `rdma` feature: no RDMA transport".into(),
            ))
        }
    }
}

/// One node's connection and its WELCOME, or why there is none.
type Connect<R> = Result<(Conn<R>, Welcome), ConnectError>;

/// Connects to every node but the local one over data path `R`.
fn connect_with<R: Receive>(setup: &mut NetSetup, common: R::Common) -> Result<Connections<R>> {
    let mut out = Vec::with_capacity(setup.cluster.nodes.len());
    // Every node at once, under one deadline (`node_timeout`, the connect
    // included): stalled nodes cost the start one timeout, not one each.
    let deadline = Instant::now() + setup.node_timeout;
    let shared: &NetSetup = setup;
    let common_ref = &common;
    let one =
        |n: &crate::transport::Node| connect::<R>(shared, n.index, &n.addr, deadline, common_ref);
    let results: Vec<Option<Connect<R>>> = std::thread::scope(|sc| {
        let handles: Vec<_> = shared
            .cluster
            .nodes
            .iter()
            .map(|n| {
                if Some(n.index) == shared.local_node {
                    return None;
                }
                let one = &one;
                Some(
                    std::thread::Builder::new()
                        .name("kspeed-connect".into())
                        .stack_size(256 << 10)
                        .spawn_scoped(sc, move || one(n))
                        .map_err(|_| n),
                )
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.map(|h| match h {
                    Ok(t) => t.join().unwrap_or_else(|_| {
                        Err(ConnectError::Unreachable("connect thread panicked".into()))
                    }),
                    // No thread to spare: connect from here.
                    Err(n) => one(n),
                })
            })
            .collect()
    });
    for (n, res) in setup.cluster.nodes.iter().zip(results) {
        let Some(res) = res else {
            out.push(Conn::dead(n.index, n.addr.clone(), "local node".into()));
            continue;
        };
        match res {
            Ok((c, w)) => {
                let theirs =
                    Placement::new(w.nodes, w.replicas).map_err(|e| Error::BadCluster {
                        origin: format!("node {} ({})", n.index, n.addr),
                        reason: e.to_string(),
                    })?;
                let ours = *setup.placement.get_or_insert(theirs);
                if theirs != ours || ours.nodes as usize != setup.cluster.nodes.len() {
                    return Err(Error::BadCluster {
                        origin: format!("node {} ({})", n.index, n.addr),
                        reason: format!(
                            "its space is placed over {} nodes × {} copies; this loader expects {} × {} and the cluster lists {} nodes",
                            theirs.nodes,
                            theirs.replicas,
                            ours.nodes,
                            ours.replicas,
                            setup.cluster.nodes.len()
                        ),
                    });
                }
                out.push(c)
            }
            Err(ConnectError::Refused(e)) => return Err(e),
            Err(ConnectError::Unreachable(why)) => {
                log::warn!("node {} ({}) is unreachable: {why}", n.index, n.addr);
                out.push(Conn::dead(n.index, n.addr.clone(), why));
            }
        }
    }
    Ok(Connections { conns: out, common })
}

/// Why a node could not be connected.
pub(crate) enum ConnectError {
    Refused(Error),
    Unreachable(String),
}

fn connect<R: Receive>(
    setup: &NetSetup,
    node: u32,
    addr: &str,
    deadline: Instant,
    common: &R::Common,
) -> Result<(Conn<R>, Welcome), ConnectError> {
    // What is left of the start's deadline (never zero: a zero timeout
    // means "none" to the socket calls).
    let left = || {
        deadline
            .saturating_duration_since(Instant::now())
            .max(Duration::from_millis(1))
    };
    let unreachable =
        |what: &str, e: &dyn std::fmt::Display| ConnectError::Unreachable(format!("{what}: {e}"));
    let sa = crate::transport::Node {
        index: node,
        addr: addr.to_string(),
    }
    .resolve()
    .map_err(|e| unreachable("resolve", &e))?;
    let mut sock = TcpStream::connect_timeout(&sa, setup.connect_timeout.min(left()))
        .map_err(|e| unreachable("connect", &e))?;
    let _ = sock.set_nodelay(true);
    let _ = sock.set_read_timeout(Some(left()));
    let mut hello = Vec::new();
    setup.hello.encode(&setup.token, &mut hello);
    sock.write_all(&hello)
        .map_err(|e| unreachable("send HELLO", &e))?;
    let mut hb = [0u8; proto::HEADER_BYTES];
    sock.read_exact(&mut hb)
        .map_err(|e| unreachable("no answer to HELLO", &e))?;
    let violation = |what: String| {
        ConnectError::Refused(Error::ProtocolViolation {
            node,
            addr: addr.to_string(),
            what,
        })
    };
    let h = Header::decode(&hb, 0).map_err(|e| violation(e.to_string()))?;
    let mut body = vec![0u8; h.body_len as usize];
    let _ = sock.set_read_timeout(Some(left()));
    sock.read_exact(&mut body)
        .map_err(|e| unreachable("truncated answer to HELLO", &e))?;
    match h.kind {
        Kind::Welcome => {}
        Kind::Error => {
            return Err(ConnectError::Refused(Error::Refused {
                node,
                addr: addr.to_string(),
                code: Code::from_u32(h.b).name(),
                message: String::from_utf8_lossy(&body).into_owned(),
            }))
        }
        k => return Err(violation(format!("answered HELLO with {k:?}"))),
    }
    let w = Welcome::decode(&h, &body).map_err(|e| violation(e.to_string()))?;
    if h.a != proto::VERSION {
        return Err(violation(format!("WELCOME with version {}", h.a)));
    }
    if w.node_index != node {
        return Err(ConnectError::Refused(Error::BadCluster {
            origin: format!("node {node} ({addr})"),
            reason: format!("the service there is node {}", w.node_index),
        }));
    }
    if w.transport != setup.hello.transport {
        return Err(ConnectError::Refused(Error::BadCluster {
            origin: format!("node {node} ({addr})"),
            reason: if setup.hello.transport == proto::TRANSPORT_RDMA {
                "it does not serve over RDMA (start `kspeed serve` with --rdma, or read over TCP)"
                    .into()
            } else {
                format!("it answered with transport {}", w.transport)
            },
        }));
    }
    let data = R::connect(common, &mut sock, node, addr)?;
    let _ = sock.set_read_timeout(None);
    let entries = proto::MAX_GRANT_ENTRIES.min(w.max_grants.max(1) as usize);
    let frame = proto::HEADER_BYTES + entries * proto::GRANT_ENTRY_BYTES;
    let mut fill = Vec::with_capacity(frame);
    fill.resize(proto::HEADER_BYTES, 0);
    Ok((
        Conn {
            node,
            addr: addr.to_string(),
            sock: Some(sock),
            state: State::Live,
            reason: String::new(),
            last_error: String::new(),
            rx: FrameRx::new(proto::MAX_MESSAGE_BYTES),
            fill,
            fill_entries: 0,
            flight: Vec::with_capacity(frame),
            flight_sent: 0,
            tx_inflight: false,
            outstanding: 0,
            max_grants: w.max_grants.max(1),
            max_data: w.max_data_bytes.min(proto::MAX_DATA_BYTES),
            last_rx: Instant::now(),
            last_done: Instant::now(),
            errors: 0,
            errors_since: Instant::now(),
            demoted: false,
            last_tx: Instant::now(),
            data: Some(data),
        },
        w,
    ))
}
