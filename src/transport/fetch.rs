//! Fetching chosen samples from a cluster's node services: the
//! [`Fetch`] that `kspeed rebalance` copies arriving samples with. A plain
//! blocking client of the push protocol over TCP (HELLO with the job's
//! token, WELCOME, GRANTs for the samples wanted, DATA into a buffer that
//! stands for the ring), one connection per node, opened when first needed
//! and again after a failure. A sample is asked of its old holders in copy
//! order (the placement the nodes' WELCOMEs announce), then of the source
//! when one is given; the bytes are checked by the caller against the
//! catalog's CRC32C. It is not the loader's data path: no ring, no
//! pollers, one batch in flight at a time, which is what a bulk copy that
//! runs beside a training job should ask of the nodes.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use super::cluster::Cluster;
use super::proto::{self, Code, GrantEntry, Header, Hello, Kind, Welcome};
use crate::dataset::{Catalog, Fetch, OwnerFn, Placement, SourceFetch};
use crate::error::{Error, Result};

/// Bytes of the stand-in ring a connection's grants are placed in (a
/// larger sample gets a ring of its own size).
const RING_BYTES: u64 = 16 << 20;

struct Peer {
    index: u32,
    addr: String,
    sock: Option<TcpStream>,
    welcome: Option<Welcome>,
    /// Why the last try failed (reported when no place could deliver).
    last_error: Option<String>,
}

/// Fetches samples from the node services of `cluster` (the old layout's
/// nodes), falling back to the source.
pub struct PeerFetch {
    peers: Vec<Peer>,
    token: Vec<u8>,
    identity: u32,
    samples: u64,
    placement: Option<Placement>,
    source: Option<SourceFetch>,
    timeout: Duration,
    /// The stand-in ring's length: [`RING_BYTES`], or the largest sample.
    ring_bytes: u64,
    ring: Vec<u8>,
    scratch: Vec<u8>,
    counts: (u64, u64, u64, u64),
}

impl PeerFetch {
    /// A fetcher of `catalog`'s samples from `cluster`'s nodes with the
    /// job token `token`; `source`, when given, serves what no node can.
    /// Every connect, send and receive is bounded by `timeout`.
    pub fn new(
        cluster: &Cluster,
        token: &[u8],
        catalog: &Catalog,
        source: Option<SourceFetch>,
        timeout: Duration,
    ) -> PeerFetch {
        PeerFetch {
            peers: cluster
                .nodes
                .iter()
                .map(|n| Peer {
                    index: n.index,
                    addr: n.addr.clone(),
                    sock: None,
                    welcome: None,
                    last_error: None,
                })
                .collect(),
            token: token.to_vec(),
            identity: catalog.identity(),
            samples: catalog.len(),
            placement: None,
            source,
            timeout,
            ring_bytes: RING_BYTES.max(catalog.max_sample_bytes() as u64),
            ring: Vec::new(),
            scratch: Vec::new(),
            counts: (0, 0, 0, 0),
        }
    }

    /// The old layout's placement, from the first node that answers (every
    /// node's must agree).
    pub fn placement(&mut self) -> Result<Placement> {
        if let Some(p) = self.placement {
            return Ok(p);
        }
        let mut why = Vec::new();
        for i in 0..self.peers.len() {
            match self.connect(i) {
                Ok(()) => return self.placement.ok_or_else(|| unreachable_bug(i)),
                Err(e) => why.push(format!("node {}: {e}", self.peers[i].index)),
            }
        }
        Err(Error::BadCluster {
            origin: "rebalance".into(),
            reason: format!("no node of the old layout answered: {}", why.join("; ")),
        })
    }

    fn connect(&mut self, i: usize) -> Result<()> {
        if self.peers[i].sock.is_some() {
            return Ok(());
        }
        let p = &self.peers[i];
        let addr = super::cluster::Node {
            index: p.index,
            addr: p.addr.clone(),
        }
        .resolve()
        .map_err(|e| net_err(p, format!("resolving: {e}")))?;
        let mut s = TcpStream::connect_timeout(&addr, self.timeout)
            .map_err(|e| net_err(p, format!("connecting: {e}")))?;
        let io = |e: std::io::Error| net_err(p, e.to_string());
        s.set_read_timeout(Some(self.timeout)).map_err(io)?;
        s.set_write_timeout(Some(self.timeout)).map_err(io)?;
        s.set_nodelay(true).map_err(io)?;
        let mut hello = Vec::new();
        Hello {
            catalog_identity: self.identity,
            rank: 0,
            world: 1,
            catalog_samples: self.samples,
            seed: 0,
            ring_addr: 0,
            ring_len: self.ring_bytes,
            rkey: 0,
            transport: proto::TRANSPORT_TCP,
        }
        .encode(&self.token, &mut hello);
        s.write_all(&hello).map_err(io)?;
        let (h, body) = read_frame(&mut s, &mut self.scratch).map_err(|e| net_err(p, e))?;
        if h.kind == Kind::Error {
            return Err(Error::Refused {
                node: p.index,
                addr: p.addr.clone(),
                code: Code::from_u32(h.b).name(),
                message: String::from_utf8_lossy(body).into_owned(),
            });
        }
        let w = Welcome::decode(&h, body).map_err(|e| Error::ProtocolViolation {
            node: p.index,
            addr: p.addr.clone(),
            what: e.to_string(),
        })?;
        let f = OwnerFn::from_code(w.owner_fn);
        let theirs = f.and_then(|f| Placement::with_fn(f, w.nodes, w.replicas).ok());
        let Some(theirs) = theirs else {
            return Err(Error::BadCluster {
                origin: format!("node {} ({})", p.index, p.addr),
                reason: format!(
                    "its WELCOME announces {} nodes x {} copies by function {}",
                    w.nodes, w.replicas, w.owner_fn
                ),
            });
        };
        if w.node_index != p.index
            || self.placement.is_some_and(|q| q != theirs)
            || theirs.nodes as usize != self.peers.len()
        {
            return Err(Error::BadCluster {
                origin: format!("node {} ({})", p.index, p.addr),
                reason: format!(
                    "it is node {} of {} ({} copies, {}); the old layout's cluster lists {} nodes{}",
                    w.node_index,
                    theirs.nodes,
                    theirs.replicas,
                    theirs.owner_fn.name(),
                    self.peers.len(),
                    self.placement
                        .map(|q| format!(" placed {} x {} by {}", q.nodes, q.replicas, q.owner_fn.name()))
                        .unwrap_or_default()
                ),
            });
        }
        self.placement = Some(theirs);
        let p = &mut self.peers[i];
        p.welcome = Some(w);
        p.sock = Some(s);
        Ok(())
    }

    /// Asks node `i` for `want` (all of which it holds under the old
    /// layout); delivers what it sends through `put` and returns the ones
    /// it could not deliver. A broken connection fails every sample not yet
    /// delivered (the connection is dropped and opened again next time).
    fn ask_peer(
        &mut self,
        i: usize,
        want: &[(u64, u32)],
        put: &mut dyn FnMut(u64, &[u8]) -> Result<()>,
        failed: &mut Vec<(u64, u32)>,
    ) -> Result<()> {
        if let Err(e) = self.connect(i) {
            if matches!(e, Error::BadCluster { .. }) {
                return Err(e);
            }
            self.peers[i].last_error = Some(e.to_string());
            failed.extend_from_slice(want);
            return Ok(());
        }
        let w = self.peers[i].welcome.expect("connected");
        let max_grants = (w.max_grants as usize).clamp(1, proto::MAX_GRANT_ENTRIES);
        let mut rest = want;
        while !rest.is_empty() {
            // As many as fit the ring and the node's grant limit.
            let mut n = 0usize;
            let mut off = 0u64;
            while n < rest.len() && n < max_grants {
                let len = rest[n].1 as u64;
                if off + len > self.ring_bytes {
                    break;
                }
                off += len;
                n += 1;
            }
            let batch = &rest[..n];
            rest = &rest[n..];
            match self.grant_batch(i, batch, off, put) {
                Ok(missing) => failed.extend(missing),
                Err(BatchError::Put(e)) => return Err(e),
                Err(BatchError::Conn(why)) => {
                    log::warn!(
                        "node {} ({}): {why}; its samples are asked elsewhere",
                        self.peers[i].index,
                        self.peers[i].addr
                    );
                    self.peers[i].sock = None;
                    self.peers[i].last_error = Some(why);
                    failed.extend_from_slice(batch);
                    failed.extend_from_slice(rest);
                    return Ok(());
                }
            }
        }
        Ok(())
    }

    /// One GRANT of `batch` (laid out from ring offset 0, `bytes` in all)
    /// and its answers. Returns the samples answered with ERROR. The
    /// connection is kept unless it failed.
    fn grant_batch(
        &mut self,
        i: usize,
        batch: &[(u64, u32)],
        bytes: u64,
        put: &mut dyn FnMut(u64, &[u8]) -> Result<()>,
    ) -> std::result::Result<Vec<(u64, u32)>, BatchError> {
        let mut sock = self.peers[i].sock.take().expect("connected");
        let r = self.grant_batch_on(&mut sock, i, batch, bytes, put);
        if !matches!(r, Err(BatchError::Conn(_))) {
            self.peers[i].sock = Some(sock);
        }
        r
    }

    fn grant_batch_on(
        &mut self,
        sock: &mut TcpStream,
        i: usize,
        batch: &[(u64, u32)],
        bytes: u64,
        put: &mut dyn FnMut(u64, &[u8]) -> Result<()>,
    ) -> std::result::Result<Vec<(u64, u32)>, BatchError> {
        if (self.ring.len() as u64) < bytes {
            self.ring.resize(bytes as usize, 0);
        }
        let mut frame =
            Vec::with_capacity(proto::HEADER_BYTES + batch.len() * proto::GRANT_ENTRY_BYTES);
        frame.extend_from_slice(&Header::grant(batch.len() as u32).encode());
        let mut at = Vec::with_capacity(batch.len());
        let mut off = 0u64;
        for (k, &(id, len)) in batch.iter().enumerate() {
            let mut e = [0u8; proto::GRANT_ENTRY_BYTES];
            GrantEntry {
                grant: k as u32,
                len,
                sample: id,
                offset: off,
                rkey: 0,
            }
            .encode_into(&mut e);
            frame.extend_from_slice(&e);
            at.push((off, 0u32));
            off += len as u64;
        }
        sock.write_all(&frame)
            .map_err(|e| BatchError::Conn(format!("sending GRANT: {e}")))?;
        let mut open = batch.len();
        let mut errors = Vec::new();
        let mut done = vec![false; batch.len()];
        while open > 0 {
            let mut hb = [0u8; proto::HEADER_BYTES];
            sock.read_exact(&mut hb)
                .map_err(|e| BatchError::Conn(format!("receiving: {e}")))?;
            let h = Header::decode(&hb, proto::MAX_DATA_BYTES)
                .map_err(|e| BatchError::Conn(format!("bad frame: {e}")))?;
            let k = h.a as usize;
            match h.kind {
                Kind::Data => {
                    let Some(&(start, got)) = at.get(k) else {
                        return Err(BatchError::Conn(format!("DATA for unknown grant {k}")));
                    };
                    let len = batch[k].1;
                    let end = h.c.checked_add(h.body_len as u64);
                    if done[k]
                        || h.c != start + got as u64
                        || end.is_none_or(|e| e > start + len as u64)
                    {
                        return Err(BatchError::Conn(format!(
                            "DATA for grant {k} at {} + {} is not its next range",
                            h.c, h.body_len
                        )));
                    }
                    let dst = &mut self.ring[h.c as usize..(h.c + h.body_len as u64) as usize];
                    sock.read_exact(dst)
                        .map_err(|e| BatchError::Conn(format!("receiving DATA: {e}")))?;
                    at[k].1 += h.body_len;
                    if at[k].1 == len {
                        done[k] = true;
                        open -= 1;
                        let s = start as usize;
                        put(batch[k].0, &self.ring[s..s + len as usize])
                            .map_err(BatchError::Put)?;
                        self.counts.0 += 1;
                        self.counts.1 += len as u64;
                    }
                }
                Kind::Error => {
                    self.scratch.resize(h.body_len as usize, 0);
                    sock.read_exact(&mut self.scratch)
                        .map_err(|e| BatchError::Conn(format!("receiving ERROR: {e}")))?;
                    let msg = String::from_utf8_lossy(&self.scratch).into_owned();
                    if h.a == proto::CONNECTION {
                        if h.b == 0 {
                            continue; // a heartbeat
                        }
                        return Err(BatchError::Conn(format!(
                            "closed the connection: {}: {msg}",
                            Code::from_u32(h.b).name()
                        )));
                    }
                    if k >= batch.len() || done[k] {
                        return Err(BatchError::Conn(format!("ERROR for unknown grant {k}")));
                    }
                    done[k] = true;
                    open -= 1;
                    self.peers[i].last_error = Some(format!(
                        "sample {}: {}: {msg}",
                        batch[k].0,
                        Code::from_u32(h.b).name()
                    ));
                    errors.push(batch[k]);
                }
                other => {
                    return Err(BatchError::Conn(format!("unexpected {other:?} frame")));
                }
            }
        }
        Ok(errors)
    }
}

enum BatchError {
    /// The connection failed: its samples are asked elsewhere.
    Conn(String),
    /// The caller refused a sample (bad bytes, a write error): stop.
    Put(Error),
}

fn unreachable_bug(i: usize) -> Error {
    Error::InvalidConfig(format!("node {i} connected without a placement"))
}

fn net_err(p: &Peer, why: String) -> Error {
    Error::SampleUnavailable {
        sample: u64::MAX,
        tried: format!("node {} ({}): {why}", p.index, p.addr),
    }
}

/// Reads one non-DATA frame (the WELCOME or an ERROR) into `buf`.
fn read_frame<'b>(
    s: &mut TcpStream,
    buf: &'b mut Vec<u8>,
) -> std::result::Result<(Header, &'b [u8]), String> {
    let mut hb = [0u8; proto::HEADER_BYTES];
    s.read_exact(&mut hb)
        .map_err(|e| format!("receiving: {e}"))?;
    let h = Header::decode(&hb, proto::MAX_DATA_BYTES).map_err(|e| e.to_string())?;
    if h.body_len as usize > proto::MAX_MESSAGE_BYTES + 64 {
        return Err(format!("a {:?} frame of {} bytes", h.kind, h.body_len));
    }
    buf.resize(h.body_len as usize, 0);
    s.read_exact(buf).map_err(|e| format!("receiving: {e}"))?;
    Ok((h, &buf[..]))
}

impl Fetch for PeerFetch {
    fn fetch(
        &mut self,
        want: &[(u64, u32)],
        put: &mut dyn FnMut(u64, &[u8]) -> Result<()>,
    ) -> Result<()> {
        let placement = self.placement()?;
        // Every sample first from its owner; what failed goes to its next
        // copy in the failover order (`Placement::try_copy`: a dead
        // owner's samples spread over its replicas), then to the source.
        let mut todo: Vec<(u64, u32)> = want.to_vec();
        let mut per_node: Vec<Vec<(u64, u32)>> = vec![Vec::new(); self.peers.len()];
        for r in 0..placement.replicas {
            if todo.is_empty() {
                break;
            }
            for v in per_node.iter_mut() {
                v.clear();
            }
            for &(id, len) in &todo {
                let copy = placement.try_copy(id, r);
                per_node[placement.holder(id, copy) as usize].push((id, len));
            }
            todo.clear();
            for (i, batch) in per_node.iter().enumerate() {
                if !batch.is_empty() {
                    self.ask_peer(i, batch, put, &mut todo)?;
                }
            }
            todo.sort_unstable();
        }
        if todo.is_empty() {
            return Ok(());
        }
        let Some(src) = self.source.as_mut() else {
            let (id, _) = todo[0];
            let tried: Vec<String> = (0..placement.replicas)
                .map(|r| {
                    let p = &self.peers[placement.holder(id, r) as usize];
                    format!(
                        "node {} ({}): {}",
                        p.index,
                        p.addr,
                        p.last_error.as_deref().unwrap_or("failed")
                    )
                })
                .collect();
            return Err(Error::SampleUnavailable {
                sample: id,
                tried: format!("{}; no source given", tried.join("; ")),
            });
        };
        src.fetch(&todo, put)?;
        let (_, _, ss, sb) = src.counts();
        self.counts.2 = ss;
        self.counts.3 = sb;
        Ok(())
    }

    fn counts(&self) -> (u64, u64, u64, u64) {
        self.counts
    }
}
