//! Connecting a launch's network thread to every node: the TCP control
//! connection, HELLO and WELCOME (checked: version, node index, transport,
//! placement), then the data path's own setup ([`Receive::connect`]).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

#[cfg(feature = "rdma")]
use super::rdma::RdmaRx;
use super::tcp::TcpRx;
use super::{Conn, NetSetup, Receive};
use crate::dataset::{OwnerFn, Placement};
use crate::error::{Error, Result};
use crate::landing::LandingRing;
use crate::transport::proto::{self, Code, Header, Kind, Welcome};

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
    // Every node at once, each under its own deadline (`node_timeout` from
    // when its connect starts, the retries included): stalled nodes cost
    // the start one timeout, not one each, and a connection that starts
    // late (no thread to spare) still gets its whole time.
    let shared: &NetSetup = setup;
    let common_ref = &common;
    let one =
        |n: &crate::transport::Node| connect_retrying::<R>(shared, n.index, &n.addr, common_ref);
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

/// Why a node could not be connected.
pub(crate) enum ConnectError {
    Refused(Error),
    Unreachable(String),
    /// Refused at TCP connect (no service listening yet), or the
    /// connection reset or closed before the node answered HELLO: the
    /// service may be starting or restarting, so [`connect_retrying`]
    /// tries again with back-off until the node's deadline.
    Transient(String),
}

/// Whether a failed connect, send or read of the handshake is one the
/// node may get over by itself (see [`ConnectError::Transient`]).
fn transient(e: &std::io::Error) -> bool {
    use std::io::ErrorKind as K;
    matches!(
        e.kind(),
        K::ConnectionRefused
            | K::ConnectionReset
            | K::ConnectionAborted
            | K::BrokenPipe
            | K::UnexpectedEof
    )
}

/// First back-off after a retryable refusal at HELLO; each next one's
/// bound doubles up to [`RETRY_MAX`] (docs/PROTOCOL.md, "Admission and
/// retry").
pub(crate) const RETRY_FIRST: Duration = Duration::from_millis(100);
/// Longest back-off between two tries.
pub(crate) const RETRY_MAX: Duration = Duration::from_secs(2);

/// The wait before try `attempt + 1` (`attempt` from 0): uniform in
/// `[bound / 2, bound]` with `bound = min(RETRY_FIRST x 2^attempt,
/// RETRY_MAX)`, so consumers refused together spread out.
pub(crate) fn retry_backoff(attempt: u32, jitter: u64) -> Duration {
    let bound = RETRY_FIRST
        .saturating_mul(1u32 << attempt.min(16))
        .min(RETRY_MAX);
    let half = bound / 2;
    let span = half.as_micros() as u64 + 1;
    half + Duration::from_micros(jitter % span)
}

/// A random number for the back-off's jitter (std's randomly keyed hasher;
/// no generator needed for this).
pub(crate) fn jitter(node: u32, attempt: u32) -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(node);
    h.write_u32(attempt);
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
    );
    h.finish()
}

/// [`connect`] under its own deadline (`node_timeout` from now), trying
/// again after a back-off with jitter while the node answers HELLO with a
/// code that asks for it ([`Code::retry_at_hello`]: node full, busy,
/// rate-limited), and likewise after a [`ConnectError::Transient`] failure
/// (a refused connect, a reset or close before the answer: a service not
/// started yet, or restarting). When the deadline comes first: a node that
/// still fails so is unreachable; a full node is `Refused`
/// (the job has more consumers than the nodes are configured for); a busy
/// or rate-limiting one is unreachable (dead from the start, its samples
/// fail over).
pub(crate) fn connect_retrying<R: Receive>(
    setup: &NetSetup,
    node: u32,
    addr: &str,
    common: &R::Common,
) -> Result<(Conn<R>, Welcome), ConnectError> {
    let started = Instant::now();
    let deadline = started + setup.node_timeout;
    let mut attempt = 0u32;
    loop {
        let (code, message) = match connect::<R>(setup, node, addr, deadline, common) {
            Err(ConnectError::Refused(Error::Refused {
                code: name,
                message,
                ..
            })) if retryable(name) => (name, message),
            Err(ConnectError::Transient(why)) => {
                // Not listening yet, or gone before it answered: tried
                // again like a busy node until the deadline.
                let wait = retry_backoff(attempt, jitter(node, attempt));
                attempt += 1;
                if Instant::now() + wait >= deadline {
                    return Err(ConnectError::Unreachable(format!(
                        "{why} (still so after {attempt} tries over {} ms, the node timeout)",
                        started.elapsed().as_millis()
                    )));
                }
                log::debug!(
                    "node {node} ({addr}): {why}; trying again in {} ms",
                    wait.as_millis()
                );
                std::thread::sleep(wait);
                continue;
            }
            other => return other,
        };
        let wait = retry_backoff(attempt, jitter(node, attempt));
        attempt += 1;
        if Instant::now() + wait >= deadline {
            let message = format!(
                "{message} (still so after {attempt} tries over {} ms, the node timeout)",
                started.elapsed().as_millis()
            );
            if code == Code::NodeFull.name() {
                return Err(ConnectError::Refused(Error::Refused {
                    node,
                    addr: addr.to_string(),
                    code,
                    message,
                }));
            }
            return Err(ConnectError::Unreachable(format!("{code}: {message}")));
        }
        log::debug!(
            "node {node} ({addr}) answered HELLO with {code}: {message}; trying again in {} ms",
            wait.as_millis()
        );
        std::thread::sleep(wait);
    }
}

/// Whether a refusal's code (by name) asks the consumer to try again.
fn retryable(name: &str) -> bool {
    [Code::NodeFull, Code::Busy, Code::RateLimited]
        .iter()
        .any(|c| c.retry_at_hello() && c.name() == name)
}

/// Says what a failed read of the handshake means: a read that ran out of
/// time (`EAGAIN` from a socket timeout) is "timed out after N ms".
fn read_failure(what: &str, e: &std::io::Error, waited: Duration) -> ConnectError {
    match e.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
            ConnectError::Unreachable(format!("{what}: timed out after {} ms", waited.as_millis()))
        }
        _ if transient(e) => ConnectError::Transient(format!("{what}: {e}")),
        _ => ConnectError::Unreachable(format!("{what}: {e}")),
    }
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
    let io_failure = |what: &str, e: &std::io::Error| {
        if transient(e) {
            ConnectError::Transient(format!("{what}: {e}"))
        } else {
            unreachable(what, e)
        }
    };
    let sa = crate::transport::Node {
        index: node,
        addr: addr.to_string(),
    }
    .resolve()
    .map_err(|e| unreachable("resolve", &e))?;
    let mut sock = TcpStream::connect_timeout(&sa, setup.connect_timeout.min(left()))
        .map_err(|e| io_failure("connect", &e))?;
    let _ = sock.set_nodelay(true);
    let sent = Instant::now();
    let _ = sock.set_read_timeout(Some(left()));
    let mut hello = Vec::new();
    setup.hello.encode(&setup.token, &mut hello);
    sock.write_all(&hello)
        .map_err(|e| io_failure("send HELLO", &e))?;
    let mut hb = [0u8; proto::HEADER_BYTES];
    sock.read_exact(&mut hb)
        .map_err(|e| read_failure("no answer to HELLO", &e, sent.elapsed()))?;
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
        .map_err(|e| read_failure("truncated answer to HELLO", &e, sent.elapsed()))?;
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
    let fd = sock.as_raw_fd();
    let conn = Conn::live(
        node,
        addr.to_string(),
        fd,
        Some(sock),
        w.max_grants,
        w.max_data_bytes,
        data,
        Instant::now(),
    );
    Ok((conn, w))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_backoff_stays_within_its_documented_bounds() {
        // docs/PROTOCOL.md: try k waits in [b/2, b], b = min(100 ms x 2^k, 2 s).
        for attempt in 0..40u32 {
            let bound = Duration::from_millis(100)
                .saturating_mul(1u32 << attempt.min(16))
                .min(Duration::from_secs(2));
            for jitter in [0u64, 1, 12_345, u64::MAX / 3, u64::MAX] {
                let w = retry_backoff(attempt, jitter);
                assert!(
                    w >= bound / 2 && w <= bound,
                    "try {attempt}: {w:?} outside [{:?}, {bound:?}]",
                    bound / 2
                );
            }
        }
        assert_eq!(retry_backoff(0, 0), Duration::from_millis(50));
        assert_eq!(retry_backoff(30, 0), Duration::from_secs(1));
    }

    #[test]
    fn only_full_busy_and_rate_limited_are_retried() {
        for c in (0..20).map(Code::from_u32) {
            let want = matches!(c, Code::NodeFull | Code::Busy | Code::RateLimited);
            assert_eq!(retryable(c.name()), want, "{c:?}");
            assert_eq!(c.retry_at_hello(), want, "{c:?}");
        }
    }
}
