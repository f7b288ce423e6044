//! The agent's attach socket: a `SOCK_SEQPACKET` Unix socket on which a
//! rank sends one ATTACH message with its ring and segment memfds
//! (`SCM_RIGHTS`) and gets ATTACHED or REFUSED back; the connection then
//! stays open for the attach's life, so either side sees the other's
//! process end as a hang-up (docs/AGENT.md, "The attach protocol").
//!
//! Every wait has a deadline: accept polls with a timeout, the connected
//! sockets carry `SO_RCVTIMEO`/`SO_SNDTIMEO` (connect honours the send
//! timeout on Unix sockets), so a silent peer ends in
//! [`Error::AttachTimeout`], never a hang.
//!
//! Who may attach: the peer's uid (`SO_PEERCRED`) must be the agent's; an
//! agent running as root may also serve other uids when its
//! [`ListenerConfig::allow_other_uids`] says so (the system service
//! serving every user's jobs). A non-root agent with that flag is refused
//! at bind: a user's own agent does not serve other users.
//!
//! This module calls `sendmsg`/`recvmsg` with control messages and
//! `getsockopt(SO_PEERCRED)` through libc, so it is allowed `unsafe`.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU16, Ordering};
use std::time::{Duration, Instant};

use socket2::{Domain, SockAddr, Socket, Type};

use super::msg::{
    decode_reply, encode_refused, proto, u16_at, AttachRequest, AttachedReply, RefuseCode,
    ATTACH_FDS, ATTACH_OLDEST_VERSION, ATTACH_VERSION, FLAG_PEER_WAITS, FLAG_SLOT_EXTRAS,
    FLAG_TIER_VIEWS,
};
use super::segment::{
    segment_bytes_with, AgentSide, Segment, EXTRAS_PER_SLOT, PEER_WAITS_PER_SLOT,
};
use super::shm::RingMap;
use super::sock_lock::SocketLock;
use crate::error::{Error, Result};

/// Most descriptors a received message may carry before the control
/// buffer is cut (the kernel closes those that do not fit).
const MAX_RECV_FDS: usize = 8;
/// The largest message read (bigger ones arrive cut: MSG_TRUNC): an
/// ATTACH of the largest mixture.
const RECV_BYTES: usize = super::msg::ATTACH_MAX_BYTES;

/// The peer's credentials, from `SO_PEERCRED` (taken by the kernel at
/// connect, so the peer cannot lie about them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerCred {
    /// Its process id.
    pub pid: u32,
    /// Its user id.
    pub uid: u32,
    /// Its group id.
    pub gid: u32,
}

/// One connection on the attach socket (either side).
#[derive(Debug)]
pub struct AttachConn {
    sock: Socket,
    peer: PeerCred,
    /// The send and receive timeout (for the errors' text).
    timeout: Duration,
    /// The version the agent answers in: the request's, once one in a
    /// version this build speaks arrived (an older rank reads only its
    /// own), else the newest.
    reply_version: AtomicU16,
}

fn timeout_err(what: &'static str, timeout: Duration) -> Error {
    Error::AttachTimeout {
        what,
        waited_ms: timeout.as_millis() as u64,
    }
}

fn is_timeout(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

impl AttachConn {
    fn new(sock: Socket, timeout: Duration) -> Result<AttachConn> {
        let path = Path::new("<attach socket>");
        sock.set_nonblocking(false)
            .map_err(|e| Error::io("fcntl", path, e))?;
        sock.set_read_timeout(Some(timeout))
            .map_err(|e| Error::io("setsockopt SO_RCVTIMEO", path, e))?;
        sock.set_write_timeout(Some(timeout))
            .map_err(|e| Error::io("setsockopt SO_SNDTIMEO", path, e))?;
        let peer = peer_cred(sock.as_raw_fd()).map_err(|e| Error::io("SO_PEERCRED", path, e))?;
        Ok(AttachConn {
            sock,
            peer,
            timeout,
            reply_version: AtomicU16::new(ATTACH_VERSION),
        })
    }

    /// Connects to the agent's socket at `path`; connect, send and receive
    /// each give up after `timeout`.
    pub fn connect(path: &Path, timeout: Duration) -> Result<AttachConn> {
        let sock = Socket::new(Domain::UNIX, Type::from(libc::SOCK_SEQPACKET), None)
            .map_err(|e| Error::io("socket", path, e))?;
        // Unix connect waits for room in a full backlog up to SO_SNDTIMEO.
        sock.set_write_timeout(Some(timeout))
            .map_err(|e| Error::io("setsockopt SO_SNDTIMEO", path, e))?;
        let addr = SockAddr::unix(path).map_err(|e| Error::io("socket address", path, e))?;
        sock.connect(&addr).map_err(|e| {
            if is_timeout(&e) {
                timeout_err("room in the agent's listen backlog", timeout)
            } else {
                Error::io("connect", path, e)
            }
        })?;
        AttachConn::new(sock, timeout)
    }

    /// The peer's credentials.
    pub fn peer(&self) -> PeerCred {
        self.peer
    }

    /// The socket's descriptor (to poll for the peer's hang-up along with
    /// other work).
    pub fn as_raw_fd(&self) -> RawFd {
        self.sock.as_raw_fd()
    }

    /// Sends one message with `fds` attached (`SCM_RIGHTS`).
    pub fn send(&self, bytes: &[u8], fds: &[BorrowedFd<'_>]) -> Result<()> {
        send_msg(self.sock.as_raw_fd(), bytes, fds).map_err(|e| {
            if is_timeout(&e) {
                timeout_err("room to send on the attach socket", self.timeout)
            } else {
                Error::io("sendmsg", "<attach socket>", e)
            }
        })
    }

    /// Receives one message and the descriptors it carried (all of them
    /// owned, so every one is closed when dropped). `what` names the
    /// awaited message in the timeout error. A message larger than this
    /// build reads, or with more than 8 descriptors, is a protocol error
    /// (its descriptors are closed).
    pub fn recv(&self, what: &'static str) -> Result<(Vec<u8>, Vec<OwnedFd>)> {
        let t0 = Instant::now();
        let (bytes, fds, flags) = recv_msg(self.sock.as_raw_fd()).map_err(|e| {
            if is_timeout(&e) {
                timeout_err(what, t0.elapsed())
            } else {
                Error::io("recvmsg", "<attach socket>", e)
            }
        })?;
        if bytes.is_empty() && fds.is_empty() {
            return Err(proto(format!(
                "the peer closed the connection before its {what}"
            )));
        }
        if flags & libc::MSG_CTRUNC != 0 {
            return Err(proto(format!(
                "{what} carried more than {MAX_RECV_FDS} descriptors"
            )));
        }
        if flags & libc::MSG_TRUNC != 0 {
            return Err(proto(format!("{what} longer than {RECV_BYTES} bytes")));
        }
        Ok((bytes, fds))
    }

    /// Whether the peer has hung up (its process ended or it closed): one
    /// `poll` with no wait, for the wait loops' periodic check.
    pub fn peer_closed(&self) -> bool {
        let mut p = libc::pollfd {
            fd: self.sock.as_raw_fd(),
            events: libc::POLLRDHUP,
            revents: 0,
        };
        // SAFETY: one pollfd we own, count 1, no wait.
        let n = unsafe { libc::poll(&mut p, 1, 0) };
        n > 0 && p.revents & (libc::POLLHUP | libc::POLLRDHUP | libc::POLLERR) != 0
    }

    /// Sends REFUSED (best effort: the peer may be gone already), in the
    /// version the peer's request came in.
    pub fn refuse(&self, code: RefuseCode, reason: &str) {
        let version = self.reply_version.load(Ordering::Relaxed);
        let _ = self.send(&encode_refused(version, code, reason), &[]);
    }
}

/// The rank's side of an attach: connect to the agent's socket, send
/// ATTACH with the ring's and the segment's memfds, and wait for the reply
/// (each step within `timeout`). Keep the returned connection open for the
/// attach's life: closing it is how the agent learns the rank is gone.
///
/// With the reply comes the node tier's read-only memfd when the reply's
/// `tier_bytes` is not 0 (the rank asked for tier views and may share the
/// tier).
pub fn attach(
    path: &Path,
    req: &AttachRequest,
    ring: &RingMap,
    seg: &Segment,
    timeout: Duration,
) -> Result<(AttachConn, AttachedReply, Option<OwnedFd>)> {
    let conn = AttachConn::connect(path, timeout)?;
    if let Err(sent) = conn.send(&req.encode(), &[ring.fd(), seg.fd()]) {
        // An agent that answered and closed before reading (one that gave
        // up on us): a REFUSED may still be queued for us to read.
        return Err(
            match conn.recv("REFUSED reply").map(|(b, _)| decode_reply(&b)) {
                Ok(Err(refused @ Error::AttachRefused { .. })) => refused,
                _ => sent,
            },
        );
    }
    let (bytes, mut fds) = conn.recv("ATTACHED reply")?;
    let reply = decode_reply(&bytes)?;
    if reply.generation != req.generation {
        return Err(proto(format!(
            "ATTACHED for generation {}, asked {}",
            reply.generation.get(),
            req.generation.get()
        )));
    }
    // The node tier's memfd comes with a reply that says its size, only
    // to a rank that asked for tier views; nothing else carries one.
    let want = usize::from(reply.tier_bytes > 0);
    if fds.len() != want || (want == 1 && req.flags & FLAG_TIER_VIEWS == 0) {
        return Err(proto(format!(
            "ATTACHED with tier_bytes {} carried {} descriptors (the rank {} tier views)",
            reply.tier_bytes,
            fds.len(),
            if req.flags & FLAG_TIER_VIEWS == 0 {
                "did not ask for"
            } else {
                "asked for"
            }
        )));
    }
    Ok((conn, reply, fds.pop()))
}

/// How the agent's listener behaves.
#[derive(Debug, Clone, Copy)]
pub struct ListenerConfig {
    /// The socket file's mode. 0o660: the agent's user and group may
    /// connect (the uid check is the real gate; the mode keeps strangers
    /// from even reaching it).
    pub mode: u32,
    /// A root agent also serves other uids (a non-root agent with this
    /// set is refused at bind).
    pub allow_other_uids: bool,
    /// How long a connected rank has to send its ATTACH (and the reply to
    /// be sent).
    pub io_timeout: Duration,
}

impl Default for ListenerConfig {
    fn default() -> Self {
        ListenerConfig {
            mode: 0o660,
            allow_other_uids: false,
            io_timeout: Duration::from_secs(5),
        }
    }
}

/// An accepted, checked attach: the connection, the request, and the
/// rank's segment and ring, mapped and checked. Answer with
/// [`Incoming::accept`] or refuse through `conn`.
#[derive(Debug)]
pub struct Incoming {
    /// The connection (kept open for the attach's life).
    pub conn: AttachConn,
    /// What the rank asked.
    pub request: AttachRequest,
    /// The rank's segment.
    pub segment: Segment,
    /// The rank's ring.
    pub ring: RingMap,
}

impl Incoming {
    /// Takes the rank: starts the agent's side of the segment (its
    /// heartbeat first, so the rank never waits on an agent that has not
    /// beaten yet), then sends ATTACHED. Returns the connection (keep it
    /// open: its hang-up is the rank's death), the request, the agent's
    /// side of the segment and the ring.
    ///
    /// `tier`: the node tier's read-only memfd and its bytes, sent with
    /// ATTACHED to a rank that asked for tier views ([`FLAG_TIER_VIEWS`])
    /// and may share the tier; None for any other.
    pub fn accept(
        self,
        heartbeat_ms: u32,
        tier: Option<(BorrowedFd<'_>, u64)>,
    ) -> Result<Attached> {
        let side = AgentSide::new(self.segment, self.request.generation)?;
        let reply = AttachedReply {
            generation: self.request.generation,
            agent_pid: std::process::id(),
            heartbeat_ms,
            tier_bytes: tier.map_or(0, |(_, bytes)| bytes),
        };
        // In the version the request came in (what the rank reads).
        let version = self.conn.reply_version.load(Ordering::Relaxed);
        let fds: Vec<BorrowedFd<'_>> = tier.map(|(fd, _)| fd).into_iter().collect();
        self.conn.send(&reply.encode(version), &fds)?;
        Ok(Attached {
            conn: self.conn,
            request: self.request,
            side,
            ring: self.ring,
        })
    }
}

/// A rank the agent took ([`Incoming::accept`]).
#[derive(Debug)]
pub struct Attached {
    /// The connection (kept open for the attach's life).
    pub conn: AttachConn,
    /// What the rank asked.
    pub request: AttachRequest,
    /// The agent's side of the rank's segment.
    pub side: AgentSide,
    /// The rank's ring.
    pub ring: RingMap,
}

/// The agent's listening socket. Holds `<path>.lock` (flock) for its life,
/// so two agents never both take the path; removes the socket file on drop.
#[derive(Debug)]
pub struct AttachListener {
    sock: Socket,
    path: PathBuf,
    cfg: ListenerConfig,
    /// `<path>.lock`, held until the listener is dropped (after the socket
    /// file is removed, it removes itself).
    _lock: SocketLock,
    euid: u32,
}

impl AttachListener {
    /// Binds the attach socket at `path`: creates its parent directories
    /// (0755), takes `<path>.lock`, removes a stale socket file (one on
    /// which nobody answers; anything but a socket is left alone and
    /// refused), binds, sets the mode, listens with SOMAXCONN.
    pub fn bind(path: &Path, cfg: ListenerConfig) -> Result<AttachListener> {
        let sock_err = |what: String| Error::AttachSocket {
            path: path.to_path_buf(),
            what,
        };
        // SAFETY: geteuid has no arguments and cannot fail.
        let euid = unsafe { libc::geteuid() };
        if cfg.allow_other_uids && euid != 0 {
            return Err(Error::InvalidConfig(format!(
                "the agent runs as uid {euid}: only an agent running as root may serve other uids"
            )));
        }
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o755)
                .create(dir)
                .map_err(|e| Error::io("create directory", dir, e))?;
        }
        let mut lock_path = path.as_os_str().to_owned();
        lock_path.push(".lock");
        let lock_path = PathBuf::from(lock_path);
        let lock = SocketLock::take(&lock_path, &sock_err)?;
        match std::fs::symlink_metadata(path) {
            Ok(m) if m.file_type().is_socket() => {
                if someone_answers(path) {
                    return Err(sock_err("in use: an agent answers on it".into()));
                }
                std::fs::remove_file(path)
                    .map_err(|e| Error::io("remove stale socket", path, e))?;
                log::info!("removed stale attach socket {}", path.display());
            }
            Ok(_) => {
                return Err(sock_err(
                    "exists and is not a socket; not removed (remove it or choose another path)"
                        .into(),
                ))
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(Error::io("stat", path, e)),
        }
        let sock = Socket::new(Domain::UNIX, Type::from(libc::SOCK_SEQPACKET), None)
            .map_err(|e| Error::io("socket", path, e))?;
        let addr = SockAddr::unix(path).map_err(|e| Error::io("socket address", path, e))?;
        sock.bind(&addr).map_err(|e| Error::io("bind", path, e))?;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(cfg.mode))
            .map_err(|e| Error::io("chmod", path, e))?;
        sock.listen(libc::SOMAXCONN)
            .map_err(|e| Error::io("listen", path, e))?;
        sock.set_nonblocking(true)
            .map_err(|e| Error::io("fcntl", path, e))?;
        Ok(AttachListener {
            sock,
            path: path.to_path_buf(),
            cfg,
            _lock: lock,
            euid,
        })
    }

    /// The socket's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The listening descriptor (to poll along with other work).
    pub fn as_raw_fd(&self) -> RawFd {
        self.sock.as_raw_fd()
    }

    /// Waits up to `wait` for a connection: `Ok(None)` when none came.
    pub fn accept_conn(&self, wait: Duration) -> Result<Option<AttachConn>> {
        let mut p = libc::pollfd {
            fd: self.sock.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = wait.as_millis().min(i32::MAX as u128) as i32;
        // SAFETY: one pollfd we own, count 1.
        let n = unsafe { libc::poll(&mut p, 1, ms) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                return Ok(None);
            }
            return Err(Error::io("poll", &self.path, e));
        }
        match self.sock.accept() {
            Ok((s, _)) => Ok(Some(AttachConn::new(s, self.cfg.io_timeout)?)),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(None),
            Err(e) => Err(Error::io("accept", &self.path, e)),
        }
    }

    /// Accepts and checks one attach (waiting up to `wait` for a
    /// connection; `Ok(None)` when none came): the ATTACH message is read
    /// (within the io timeout), then the peer's uid, the message, exactly
    /// two descriptors, the segment and the ring. A
    /// failed check is answered with REFUSED (its code) and returned as the
    /// error; every received descriptor is closed.
    pub fn accept_attach(&self, wait: Duration) -> Result<Option<Incoming>> {
        let Some(conn) = self.accept_conn(wait)? else {
            return Ok(None);
        };
        let refuse = |conn: &AttachConn, code: RefuseCode, e: Error| -> Error {
            conn.refuse(code, &e.to_string());
            e
        };
        let (bytes, mut fds) = match conn.recv("ATTACH message") {
            Ok(m) => m,
            Err(e @ Error::AttachTimeout { .. }) => return Err(e),
            Err(e) => return Err(refuse(&conn, RefuseCode::Protocol, e)),
        };
        if bytes.len() >= 12 {
            let version = u16_at(&bytes, 4);
            if (ATTACH_OLDEST_VERSION..=ATTACH_VERSION).contains(&version) {
                conn.reply_version.store(version, Ordering::Relaxed);
            }
        }
        // The uid is checked after the ATTACH is read, not before: closing
        // a connection with a message still unread resets it, and the rank
        // would read ECONNRESET instead of the REFUSED that says why. What
        // a stranger sent is closed unread.
        let peer = conn.peer();
        if peer.uid != self.euid && !(self.euid == 0 && self.cfg.allow_other_uids) {
            drop(fds);
            let e = Error::AttachRefused {
                code: RefuseCode::PeerUid.name(),
                reason: format!(
                    "pid {} runs as uid {} (gid {}); this agent serves uid {} only",
                    peer.pid, peer.uid, peer.gid, self.euid
                ),
            };
            return Err(refuse(&conn, RefuseCode::PeerUid, e));
        }
        let request = match AttachRequest::decode(&bytes) {
            Ok(r) => r,
            Err(e) => {
                // Close what came before answering, so the rank sees no
                // descriptor of its own left here once it reads REFUSED.
                drop(fds);
                let code = if bytes.len() >= 12
                    && !(ATTACH_OLDEST_VERSION..=ATTACH_VERSION).contains(&u16_at(&bytes, 4))
                {
                    RefuseCode::Version
                } else {
                    RefuseCode::Protocol
                };
                return Err(refuse(&conn, code, e));
            }
        };
        if fds.len() != ATTACH_FDS {
            let e = proto(format!(
                "ATTACH carried {} descriptors; it carries exactly {ATTACH_FDS} (ring, segment)",
                fds.len()
            ));
            drop(fds);
            return Err(refuse(&conn, RefuseCode::Protocol, e));
        }
        let seg_fd = fds.pop().expect("two descriptors");
        let ring_fd = fds.pop().expect("two descriptors");
        let checked = (|| {
            // A rank asking for tier views has a view table of one word
            // per sample of a batch (layout version 6).
            let views = if request.flags & FLAG_TIER_VIEWS != 0 {
                request.batch_size
            } else {
                0
            };
            // And one asking for peer waits a peer-wait table (version 7).
            let peer_waits = if request.flags & FLAG_PEER_WAITS != 0 {
                PEER_WAITS_PER_SLOT
            } else {
                0
            };
            // And one asking for extra words an extras table (version 8).
            let extras = if request.flags & FLAG_SLOT_EXTRAS != 0 {
                EXTRAS_PER_SLOT
            } else {
                0
            };
            let need = segment_bytes_with(request.slots, views, peer_waits, extras);
            if request.segment_bytes != need {
                return Err(Error::AttachSegment {
                    what: format!(
                        "ATTACH says {} bytes for {} slots{}{}{}; the layout needs {need}",
                        request.segment_bytes,
                        request.slots,
                        if views > 0 {
                            format!(" and tier views for batches of {views}")
                        } else {
                            String::new()
                        },
                        if peer_waits > 0 {
                            " and peer waits"
                        } else {
                            ""
                        },
                        if extras > 0 { " and extra words" } else { "" },
                    ),
                });
            }
            let segment = Segment::open(seg_fd, request.ring_bytes)?;
            if segment.views_per_slot() != views {
                return Err(Error::AttachSegment {
                    what: format!(
                        "the segment has {} view words per slot; ATTACH asks for {views} (tier views: the batch size; else 0)",
                        segment.views_per_slot()
                    ),
                });
            }
            if segment.peer_waits_per_slot() != peer_waits {
                return Err(Error::AttachSegment {
                    what: format!(
                        "the segment has {} peer-wait words per slot; ATTACH asks for {peer_waits} (flag 16: {PEER_WAITS_PER_SLOT}; else 0)",
                        segment.peer_waits_per_slot()
                    ),
                });
            }
            if segment.extras_per_slot() != extras {
                return Err(Error::AttachSegment {
                    what: format!(
                        "the segment has {} extra words per slot; ATTACH asks for {extras} (flag 32: {EXTRAS_PER_SLOT}; else 0)",
                        segment.extras_per_slot()
                    ),
                });
            }
            if segment.slots() != request.slots || segment.generation() != Some(request.generation)
            {
                return Err(Error::AttachSegment {
                    what: format!(
                        "the segment has {} slots in generation {}; ATTACH says {} in {}",
                        segment.slots(),
                        segment
                            .generation()
                            .map_or("none (0)".to_string(), |g| g.get().to_string()),
                        request.slots,
                        request.generation.get()
                    ),
                });
            }
            let ring = RingMap::open(ring_fd, request.ring_bytes)?;
            Ok((segment, ring))
        })();
        match checked {
            Ok((segment, ring)) => Ok(Some(Incoming {
                conn,
                request,
                segment,
                ring,
            })),
            Err(e) => Err(refuse(&conn, RefuseCode::Segment, e)),
        }
    }
}

impl Drop for AttachListener {
    fn drop(&mut self) {
        // We hold the lock, so the socket file is ours; the lock file goes
        // after it, with the lock (`SocketLock`'s drop).
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Whether a listener answers at `path` (a refused connect means the file
/// is stale; a full backlog still means someone listens).
fn someone_answers(path: &Path) -> bool {
    let Ok(sock) = Socket::new(Domain::UNIX, Type::from(libc::SOCK_SEQPACKET), None) else {
        return true;
    };
    let Ok(addr) = SockAddr::unix(path) else {
        return true;
    };
    let _ = sock.set_nonblocking(true);
    match sock.connect(&addr) {
        Ok(()) => true,
        Err(e) => e.raw_os_error() != Some(libc::ECONNREFUSED),
    }
}

fn peer_cred(fd: RawFd) -> io::Result<PeerCred> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `cred`, which we
    // own and whose size `len` gives.
    let rc = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(PeerCred {
        pid: cred.pid as u32,
        uid: cred.uid,
        gid: cred.gid,
    })
}

/// A control buffer aligned for `cmsghdr`, big enough for 8 descriptors.
#[repr(C, align(8))]
struct CmsgBuf([u8; 64]);

const _: () = assert!(
    std::mem::size_of::<libc::cmsghdr>() + MAX_RECV_FDS * std::mem::size_of::<RawFd>() <= 64
);

fn send_msg(fd: RawFd, bytes: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<()> {
    assert!(
        fds.len() <= MAX_RECV_FDS,
        "at most {MAX_RECV_FDS} descriptors"
    );
    let mut iov = libc::iovec {
        iov_base: bytes.as_ptr() as *mut libc::c_void,
        iov_len: bytes.len(),
    };
    let mut cbuf = CmsgBuf([0; 64]);
    // SAFETY: a zeroed msghdr is a valid empty one.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if !fds.is_empty() {
        let data_len = (fds.len() * std::mem::size_of::<RawFd>()) as u32;
        // SAFETY: CMSG_SPACE/CMSG_LEN are pure arithmetic.
        let space = unsafe { libc::CMSG_SPACE(data_len) } as usize;
        assert!(space <= cbuf.0.len());
        msg.msg_control = cbuf.0.as_mut_ptr().cast();
        msg.msg_controllen = space as _;
        // SAFETY: msg_control points to `space` bytes of our aligned
        // buffer, so CMSG_FIRSTHDR returns a header inside it, and its data
        // area holds `fds.len()` descriptors (space was computed for them).
        unsafe {
            let c = libc::CMSG_FIRSTHDR(&msg);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN(data_len) as _;
            let data = libc::CMSG_DATA(c).cast::<RawFd>();
            for (i, f) in fds.iter().enumerate() {
                data.add(i).write_unaligned(f.as_raw_fd());
            }
        }
    }
    // SAFETY: msg points to our iovec and control buffer, both alive for
    // the call; sendmsg only reads them.
    let n = unsafe { libc::sendmsg(fd, &msg, libc::MSG_NOSIGNAL) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    if n as usize != bytes.len() {
        return Err(io::Error::other("short send on a SEQPACKET socket"));
    }
    Ok(())
}

fn recv_msg(fd: RawFd) -> io::Result<(Vec<u8>, Vec<OwnedFd>, libc::c_int)> {
    let mut buf = vec![0u8; RECV_BYTES];
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    let mut cbuf = CmsgBuf([0; 64]);
    // SAFETY: a zeroed msghdr is a valid empty one.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.0.as_mut_ptr().cast();
    msg.msg_controllen = cbuf.0.len() as _;
    let n = loop {
        // SAFETY: msg points to our buffer and control buffer, alive and
        // writable for the call, with their true lengths.
        let n = unsafe { libc::recvmsg(fd, &mut msg, libc::MSG_CMSG_CLOEXEC) };
        if n >= 0 {
            break n as usize;
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    };
    // Take ownership of every descriptor first, so each is closed whatever
    // the checks after this decide.
    let mut fds = Vec::new();
    // SAFETY: the kernel filled msg_control/msg_controllen; CMSG_FIRSTHDR
    // and CMSG_NXTHDR walk only within them; an SCM_RIGHTS message's data
    // holds (cmsg_len - CMSG_LEN(0)) / 4 descriptors now installed in this
    // process and owned by nobody else.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let data_len = (*c).cmsg_len as usize - libc::CMSG_LEN(0) as usize;
                let data = libc::CMSG_DATA(c).cast::<RawFd>();
                for i in 0..data_len / std::mem::size_of::<RawFd>() {
                    fds.push(OwnedFd::from_raw_fd(data.add(i).read_unaligned()));
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    buf.truncate(n);
    Ok((buf, fds, msg.msg_flags))
}
