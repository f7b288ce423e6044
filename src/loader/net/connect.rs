//! Connecting a launch's network thread to every node: the handshakes
//! (`handshake.rs`: the TCP control connection, HELLO and WELCOME checked
//! for version, node index and transport, then the data path's own setup),
//! then the placement every WELCOME must agree on.

#[cfg(test)]
use std::time::Instant;

use super::handshake::handshake_all;
#[cfg(feature = "rdma")]
use super::rdma::RdmaRx;
use super::retry::ConnectError;
use super::tcp::TcpRx;
use super::{Conn, NetSetup, Receive};
use crate::dataset::{OwnerFn, Placement};
use crate::error::{Error, Result};
use crate::landing::LandingRing;
use crate::transport::proto::{self, Welcome};

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
    /// How the space is placed: from the local space, the first WELCOME,
    /// or (neither) any placement, every holder being dead.
    pub(crate) placement: Placement,
}

/// Connects to every node but the local one. A node that cannot be reached
/// is dead from the start (its samples fail over); a node that refuses the
/// HELLO (token, version, dataset) is an error: the job is misconfigured.
///
/// Over RDMA the landing ring `ring` (address, length) is registered for
/// remote write first, and every connection gets its queue pair.
pub(crate) fn connect_all(setup: &mut NetSetup, ring: &LandingRing) -> Result<Connected> {
    check_token(setup)?;
    match setup.rdma.clone() {
        None => Ok(Connected::Tcp(connect_with::<TcpRx>(setup, ())?)),
        #[cfg(feature = "rdma")]
        Some(opts) => {
            let common = RdmaRx::open(&opts, ring, &mut setup.hello, setup.cluster.nodes.len())?;
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

/// [`connect_all`] for a node agent's shared links (`hub.rs`): no ring yet
/// (each rank's joins as a lane); the HELLO announces
/// [`super::lanes::SHARED_RING_BASE`] and [`super::lanes::SHARED_RING_LEN`].
pub(crate) fn connect_shared(setup: &mut NetSetup) -> Result<Connected> {
    check_token(setup)?;
    setup.hello.ring_len = super::lanes::SHARED_RING_LEN;
    match setup.rdma.clone() {
        None => Ok(Connected::Tcp(connect_with::<TcpRx>(setup, ())?)),
        #[cfg(feature = "rdma")]
        Some(opts) => {
            let common = RdmaRx::open_shared(&opts, &mut setup.hello, setup.cluster.nodes.len())?;
            Ok(Connected::Rdma(connect_with::<RdmaRx>(setup, common)?))
        }
        #[cfg(not(feature = "rdma"))]
        Some(_) => Err(Error::InvalidConfig(
            "this kspeed was built without the `rdma` feature: no RDMA transport".into(),
        )),
    }
}

/// The job token fits a HELLO.
fn check_token(setup: &NetSetup) -> Result<()> {
    if setup.token.is_empty() || setup.token.len() > proto::MAX_TOKEN_BYTES {
        return Err(Error::InvalidConfig(format!(
            "the job token has {} bytes; it must have 1 to {} (the HELLO frame's limit)",
            setup.token.len(),
            proto::MAX_TOKEN_BYTES
        )));
    }
    Ok(())
}

/// One node's connection and its WELCOME, or why there is none.
type Connect<R> = Result<(Conn<R>, Welcome), ConnectError>;

/// Connects to every node but the local one over data path `R`.
fn connect_with<R: Receive>(setup: &mut NetSetup, common: R::Common) -> Result<Connections<R>> {
    let mut out = Vec::with_capacity(setup.cluster.nodes.len());
    // Every node from this one thread, up to HANDSHAKES_IN_FLIGHT at once,
    // each under its own deadline (`node_timeout` from when its handshake
    // starts, the retries included): stalled nodes cost the start one
    // timeout, not one each (`handshake.rs`).
    let remote: Vec<(u32, String)> = setup
        .cluster
        .nodes
        .iter()
        .filter(|n| Some(n.index) != setup.local_node)
        .map(|n| (n.index, n.addr.clone()))
        .collect();
    let mut outcomes = handshake_all::<R>(setup, &common, &remote).into_iter();
    let results: Vec<Option<Connect<R>>> = setup
        .cluster
        .nodes
        .iter()
        .map(|n| {
            (Some(n.index) != setup.local_node).then(|| outcomes.next().expect("one per node"))
        })
        .collect();
    for (n, res) in setup.cluster.nodes.iter().zip(results) {
        let Some(res) = res else {
            out.push(Conn::dead(n.index, n.addr.clone(), "local node".into()));
            continue;
        };
        match res {
            Ok((c, w)) => {
                let theirs = welcome_placement(&w).map_err(|e| Error::BadCluster {
                    origin: format!("node {} ({})", n.index, n.addr),
                    reason: e.to_string(),
                })?;
                let ours = *setup.placement.get_or_insert(theirs);
                if theirs != ours || ours.nodes as usize != setup.cluster.nodes.len() {
                    return Err(Error::BadCluster {
                        origin: format!("node {} ({})", n.index, n.addr),
                        reason: format!(
                            "its space is placed over {} nodes × {} copies by the {} function; this loader expects {} × {} by {} and the cluster lists {} nodes",
                            theirs.nodes,
                            theirs.replicas,
                            theirs.owner_fn.name(),
                            ours.nodes,
                            ours.replicas,
                            ours.owner_fn.name(),
                            setup.cluster.nodes.len()
                        ),
                    });
                }
                out.push(c)
            }
            Err(ConnectError::Refused(e)) => return Err(e),
            Err(ConnectError::Unreachable(why) | ConnectError::Transient(why)) => {
                log::warn!("node {} ({}) is unreachable: {why}", n.index, n.addr);
                out.push(Conn::dead(n.index, n.addr.clone(), why));
            }
        }
    }
    let placement = match setup.placement {
        Some(p) => p,
        None => {
            // No WELCOME and no local space: reading a source (a space
            // gives the placement), which serves every sample when no node
            // can. Any placement will do: every holder of every sample is
            // dead.
            let nodes = setup.cluster.nodes.len() as u32;
            let any = Placement::new(nodes.max(1), 1).map_err(|e| Error::BadCluster {
                origin: "cluster".into(),
                reason: e.to_string(),
            })?;
            log::warn!(
                "none of the {nodes} node(s) could be reached: every sample is read from the source"
            );
            setup.placement = Some(any);
            any
        }
    };
    Ok(Connections {
        conns: out,
        common,
        placement,
    })
}

/// [`connect_with`] for tests.
#[cfg(test)]
pub(crate) fn connect_with_for_tests<R: Receive>(
    setup: &mut NetSetup,
    common: R::Common,
) -> Result<Connections<R>> {
    connect_with(setup, common)
}

/// The placement a WELCOME announces (nodes, copies, owner function).
pub(crate) fn welcome_placement(w: &Welcome) -> Result<Placement> {
    let f = OwnerFn::from_code(w.owner_fn).ok_or_else(|| {
        Error::InvalidConfig(format!(
            "owner function {} is unknown to this build (0 scaled, 1 jump)",
            w.owner_fn
        ))
    })?;
    Placement::with_fn(f, w.nodes, w.replicas)
}

/// The simulator's connections (tests only): node `i` is live on MemNet
/// endpoint `fds[i]` (its handshake taken as done, with WELCOME's
/// `max_grants` and `max_data`), or dead from the start where `None` (the
/// local node, or one unreachable at start). No socket owns the
/// descriptors; the clocks start at `now` (the ring's virtual time).
#[cfg(test)]
pub(crate) fn sim_connections(
    fds: &[Option<std::os::fd::RawFd>],
    placement: Placement,
    max_grants: u32,
    max_data: u32,
    now: Instant,
) -> Connections<TcpRx> {
    let conns = fds
        .iter()
        .enumerate()
        .map(|(i, fd)| {
            let node = i as u32;
            let addr = format!("sim-node-{i}");
            let Some(fd) = *fd else {
                return Conn::dead(node, addr, "dead from the start".into());
            };
            Conn::live(
                node,
                addr,
                fd,
                None,
                max_grants as u64,
                max_data,
                TcpRx,
                now,
            )
        })
        .collect();
    Connections {
        conns,
        common: (),
        placement,
    }
}
