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

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use socket2::{Domain, SockAddr, Socket, Type};

use super::segment::{segment_bytes, AgentSide, Generation, RingMap, Segment};
use crate::error::{Error, Result};

/// The messages' magic: the bytes `KSAT` read as a little-endian u32.
pub const ATTACH_MAGIC: u32 = u32::from_le_bytes(*b"KSAT");
/// The message layout version this build speaks. The first 12 bytes
/// (magic, version, kind, length) are the same in every version, so a
/// peer of another version is answered with a REFUSED it can read.
pub const ATTACH_VERSION: u16 = 1;
/// Kind of an ATTACH message (rank to agent).
pub const KIND_ATTACH: u16 = 1;
/// Kind of an ATTACHED reply.
pub const KIND_ATTACHED: u16 = 2;
/// Kind of a REFUSED reply.
pub const KIND_REFUSED: u16 = 3;
/// Bytes of an ATTACH message (version 1).
pub const ATTACH_BYTES: usize = 96;
/// Bytes of an ATTACHED reply (version 1).
pub const ATTACHED_BYTES: usize = 32;
/// Bytes of a REFUSED reply (version 1).
pub const REFUSED_BYTES: usize = 256;
/// Bytes of a REFUSED reason (longer ones are cut).
pub const REFUSED_REASON_BYTES: usize = REFUSED_BYTES - 20;
/// Descriptors an ATTACH carries: the ring's memfd, then the segment's.
pub const ATTACH_FDS: usize = 2;
/// Most descriptors a received message may carry before the control
/// buffer is cut (the kernel closes those that do not fit).
const MAX_RECV_FDS: usize = 8;
/// The largest message read (bigger ones arrive cut: MSG_TRUNC).
const RECV_BYTES: usize = 512;

/// Why the agent refused an attach: the REFUSED message's code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum RefuseCode {
    /// The message's version is not this agent's.
    Version = 1,
    /// The message is malformed (magic, length, kind, descriptor count).
    Protocol = 2,
    /// The peer's uid may not attach.
    PeerUid = 3,
    /// The segment or the ring does not check out.
    Segment = 4,
    /// The agent cannot take this rank (its own reason).
    Agent = 5,
}

impl RefuseCode {
    /// The code's name, as [`Error::AttachRefused`] shows it.
    pub fn name(self) -> &'static str {
        match self {
            RefuseCode::Version => "version",
            RefuseCode::Protocol => "protocol",
            RefuseCode::PeerUid => "peer_uid",
            RefuseCode::Segment => "segment",
            RefuseCode::Agent => "agent",
        }
    }
    fn from_u32(v: u32) -> Option<RefuseCode> {
        Some(match v {
            1 => RefuseCode::Version,
            2 => RefuseCode::Protocol,
            3 => RefuseCode::PeerUid,
            4 => RefuseCode::Segment,
            5 => RefuseCode::Agent,
            _ => return None,
        })
    }
}

/// What a rank asks for: enough for the agent to compute the rank's
/// schedule itself (the sampler's inputs and the start position) and to
/// check the ring and segment it was given.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttachRequest {
    /// The segment's generation (bumped per re-attach).
    pub generation: Generation,
    /// The dataset's identity (the catalog's id: the agent refuses a rank
    /// of another dataset).
    pub dataset_id: u64,
    /// The sampler's seed.
    pub seed: u64,
    /// This rank.
    pub rank: u32,
    /// Ranks in the job.
    pub world: u32,
    /// Samples per batch.
    pub batch_size: u32,
    /// Batch slots in the segment.
    pub slots: u32,
    /// The epoch to start at.
    pub start_epoch: u64,
    /// The sample index within the epoch to start at.
    pub start_index: u64,
    /// Bytes of the ring memfd.
    pub ring_bytes: u64,
    /// Bytes of the segment (its layout's size, not the page-rounded
    /// memfd's).
    pub segment_bytes: u64,
}

/// The agent's answer to an accepted ATTACH.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttachedReply {
    /// The generation the agent publishes in (the request's).
    pub generation: Generation,
    /// The agent's process id.
    pub agent_pid: u32,
    /// The agent's heartbeat period in ms (the rank's silence limit is 3 of them).
    pub heartbeat_ms: u32,
}

fn proto(what: impl Into<String>) -> Error {
    Error::AttachProtocol { what: what.into() }
}

fn put_header(b: &mut [u8], kind: u16) {
    let len = b.len() as u32;
    b[0..4].copy_from_slice(&ATTACH_MAGIC.to_le_bytes());
    b[4..6].copy_from_slice(&ATTACH_VERSION.to_le_bytes());
    b[6..8].copy_from_slice(&kind.to_le_bytes());
    b[8..12].copy_from_slice(&len.to_le_bytes());
}

fn u16_at(b: &[u8], o: usize) -> u16 {
    u16::from_le_bytes(b[o..o + 2].try_into().expect("2 bytes"))
}
fn u32_at(b: &[u8], o: usize) -> u32 {
    u32::from_le_bytes(b[o..o + 4].try_into().expect("4 bytes"))
}
fn u64_at(b: &[u8], o: usize) -> u64 {
    u64::from_le_bytes(b[o..o + 8].try_into().expect("8 bytes"))
}

/// Checks the 12-byte header every version shares and returns the kind:
/// magic, then version, then that the length field is both what arrived
/// and what the kind has.
pub fn check_header(b: &[u8]) -> Result<u16> {
    if b.len() < 12 {
        return Err(proto(format!(
            "a message of {} bytes is shorter than the 12-byte header",
            b.len()
        )));
    }
    let magic = u32_at(b, 0);
    if magic != ATTACH_MAGIC {
        return Err(proto(format!(
            "magic {:02x?}, expected {:02x?} (\"KSAT\")",
            magic.to_le_bytes(),
            ATTACH_MAGIC.to_le_bytes()
        )));
    }
    let version = u16_at(b, 4);
    if version != ATTACH_VERSION {
        return Err(proto(format!(
            "message version {version}, this build speaks version {ATTACH_VERSION}"
        )));
    }
    let kind = u16_at(b, 6);
    let want = match kind {
        KIND_ATTACH => ATTACH_BYTES,
        KIND_ATTACHED => ATTACHED_BYTES,
        KIND_REFUSED => REFUSED_BYTES,
        k => return Err(proto(format!("unknown message kind {k}"))),
    };
    let len = u32_at(b, 8) as usize;
    if len != want || b.len() != want {
        return Err(proto(format!(
            "kind {kind}: length field {len}, received {} bytes; version {ATTACH_VERSION} has {want}",
            b.len()
        )));
    }
    Ok(kind)
}

impl AttachRequest {
    /// The message's bytes (version 1, little-endian).
    pub fn encode(&self) -> [u8; ATTACH_BYTES] {
        let mut b = [0u8; ATTACH_BYTES];
        put_header(&mut b, KIND_ATTACH);
        b[12..16].copy_from_slice(&u32::from(self.generation.get()).to_le_bytes());
        b[16..24].copy_from_slice(&self.dataset_id.to_le_bytes());
        b[24..32].copy_from_slice(&self.seed.to_le_bytes());
        b[32..36].copy_from_slice(&self.rank.to_le_bytes());
        b[36..40].copy_from_slice(&self.world.to_le_bytes());
        b[40..44].copy_from_slice(&self.batch_size.to_le_bytes());
        b[44..48].copy_from_slice(&self.slots.to_le_bytes());
        b[48..56].copy_from_slice(&self.start_epoch.to_le_bytes());
        b[56..64].copy_from_slice(&self.start_index.to_le_bytes());
        b[64..72].copy_from_slice(&self.ring_bytes.to_le_bytes());
        b[72..80].copy_from_slice(&self.segment_bytes.to_le_bytes());
        // 80..96: flags and reserved, zero in version 1.
        b
    }

    /// Decodes and checks an ATTACH message.
    pub fn decode(b: &[u8]) -> Result<AttachRequest> {
        let kind = check_header(b)?;
        if kind != KIND_ATTACH {
            return Err(proto(format!("expected ATTACH (kind 1), got kind {kind}")));
        }
        if b[80..96].iter().any(|&x| x != 0) {
            return Err(proto("flags or reserved bytes set in a version 1 ATTACH"));
        }
        let gen = u32_at(b, 12);
        let generation = u16::try_from(gen)
            .ok()
            .and_then(Generation::new)
            .ok_or_else(|| proto(format!("generation {gen}: must be 1 to 65535")))?;
        let r = AttachRequest {
            generation,
            dataset_id: u64_at(b, 16),
            seed: u64_at(b, 24),
            rank: u32_at(b, 32),
            world: u32_at(b, 36),
            batch_size: u32_at(b, 40),
            slots: u32_at(b, 44),
            start_epoch: u64_at(b, 48),
            start_index: u64_at(b, 56),
            ring_bytes: u64_at(b, 64),
            segment_bytes: u64_at(b, 72),
        };
        if r.world == 0 || r.rank >= r.world || r.batch_size == 0 {
            return Err(proto(format!(
                "rank {} of world {} with batch size {}",
                r.rank, r.world, r.batch_size
            )));
        }
        Ok(r)
    }
}

impl AttachedReply {
    /// The reply's bytes.
    pub fn encode(&self) -> [u8; ATTACHED_BYTES] {
        let mut b = [0u8; ATTACHED_BYTES];
        put_header(&mut b, KIND_ATTACHED);
        b[12..16].copy_from_slice(&u32::from(self.generation.get()).to_le_bytes());
        b[16..20].copy_from_slice(&self.agent_pid.to_le_bytes());
        b[20..24].copy_from_slice(&self.heartbeat_ms.to_le_bytes());
        b
    }
}

/// Encodes a REFUSED reply.
pub fn encode_refused(code: RefuseCode, reason: &str) -> [u8; REFUSED_BYTES] {
    let mut b = [0u8; REFUSED_BYTES];
    put_header(&mut b, KIND_REFUSED);
    let mut n = reason.len().min(REFUSED_REASON_BYTES);
    while !reason.is_char_boundary(n) {
        n -= 1;
    }
    b[12..16].copy_from_slice(&(code as u32).to_le_bytes());
    b[16..20].copy_from_slice(&(n as u32).to_le_bytes());
    b[20..20 + n].copy_from_slice(&reason.as_bytes()[..n]);
    b
}

/// Decodes the agent's reply: the ATTACHED reply, or the refusal as
/// [`Error::AttachRefused`].
pub fn decode_reply(b: &[u8]) -> Result<AttachedReply> {
    match check_header(b)? {
        KIND_ATTACHED => {
            let gen = u32_at(b, 12);
            let generation = u16::try_from(gen)
                .ok()
                .and_then(Generation::new)
                .ok_or_else(|| proto(format!("ATTACHED with generation {gen}")))?;
            Ok(AttachedReply {
                generation,
                agent_pid: u32_at(b, 16),
                heartbeat_ms: u32_at(b, 20),
            })
        }
        KIND_REFUSED => {
            let code = u32_at(b, 12);
            let n = (u32_at(b, 16) as usize).min(REFUSED_REASON_BYTES);
            Err(Error::AttachRefused {
                code: RefuseCode::from_u32(code).map_or("unknown", RefuseCode::name),
                reason: String::from_utf8_lossy(&b[20..20 + n]).into_owned(),
            })
        }
        k => Err(proto(format!("expected ATTACHED or REFUSED, got kind {k}"))),
    }
}

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
        Ok(AttachConn { sock, peer })
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
                timeout_err("room to send on the attach socket", Duration::ZERO)
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

    /// Sends REFUSED (best effort: the peer may be gone already).
    pub fn refuse(&self, code: RefuseCode, reason: &str) {
        let _ = self.send(&encode_refused(code, reason), &[]);
    }
}

/// The rank's side of an attach: connect to the agent's socket, send
/// ATTACH with the ring's and the segment's memfds, and wait for the reply
/// (each step within `timeout`). Keep the returned connection open for the
/// attach's life: closing it is how the agent learns the rank is gone.
pub fn attach(
    path: &Path,
    req: &AttachRequest,
    ring: &RingMap,
    seg: &Segment,
    timeout: Duration,
) -> Result<(AttachConn, AttachedReply)> {
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
    let (bytes, _fds) = conn.recv("ATTACHED reply")?;
    let reply = decode_reply(&bytes)?;
    if reply.generation != req.generation {
        return Err(proto(format!(
            "ATTACHED for generation {}, asked {}",
            reply.generation.get(),
            req.generation.get()
        )));
    }
    Ok((conn, reply))
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
    pub fn accept(self, heartbeat_ms: u32) -> Result<Attached> {
        let side = AgentSide::new(self.segment, self.request.generation)?;
        let reply = AttachedReply {
            generation: self.request.generation,
            agent_pid: std::process::id(),
            heartbeat_ms,
        };
        self.conn.send(&reply.encode(), &[])?;
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
    _lock: File,
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
        let lock = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(|e| Error::io("open", &lock_path, e))?;
        // SAFETY: flock on a descriptor we own; no pointer.
        if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            return Err(sock_err(format!(
                "another agent holds {} ({})",
                Path::new(&lock_path).display(),
                io::Error::last_os_error()
            )));
        }
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
                let code = if bytes.len() >= 12 && u16_at(&bytes, 4) != ATTACH_VERSION {
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
            if request.segment_bytes != segment_bytes(request.slots) {
                return Err(Error::AttachSegment {
                    what: format!(
                        "ATTACH says {} bytes for {} slots; the layout needs {}",
                        request.segment_bytes,
                        request.slots,
                        segment_bytes(request.slots)
                    ),
                });
            }
            let segment = Segment::open(seg_fd, request.ring_bytes)?;
            if segment.slots() != request.slots || segment.generation() != Some(request.generation)
            {
                return Err(Error::AttachSegment {
                    what: format!(
                        "the segment has {} slots in generation {:?}; ATTACH says {} in {}",
                        segment.slots(),
                        segment.generation().map(|g| g.get()),
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
        // We hold the lock, so the file at the path is ours.
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

#[cfg(test)]
mod tests {
    use super::*;

    fn req() -> AttachRequest {
        AttachRequest {
            generation: Generation::FIRST,
            dataset_id: 0xdead_beef,
            seed: 7,
            rank: 1,
            world: 4,
            batch_size: 32,
            slots: 8,
            start_epoch: 2,
            start_index: 96,
            ring_bytes: 1 << 20,
            segment_bytes: segment_bytes(8),
        }
    }

    #[test]
    fn attach_round_trips_and_checks_its_header() {
        let r = req();
        let b = r.encode();
        assert_eq!(AttachRequest::decode(&b).unwrap(), r);
        let mut bad = b;
        bad[0] ^= 1;
        assert!(AttachRequest::decode(&bad)
            .unwrap_err()
            .to_string()
            .contains("magic"));
        let mut bad = b;
        bad[4] = 2;
        assert!(AttachRequest::decode(&bad)
            .unwrap_err()
            .to_string()
            .contains("version 2"));
        assert!(AttachRequest::decode(&b[..95])
            .unwrap_err()
            .to_string()
            .contains("received 95"));
        let mut bad = b;
        bad[8] = 97;
        assert!(AttachRequest::decode(&bad)
            .unwrap_err()
            .to_string()
            .contains("length field 97"));
    }

    #[test]
    fn refused_carries_code_and_reason() {
        let b = encode_refused(RefuseCode::PeerUid, "no");
        match decode_reply(&b) {
            Err(Error::AttachRefused { code, reason }) => {
                assert_eq!((code, reason.as_str()), ("peer_uid", "no"))
            }
            other => panic!("{other:?}"),
        }
    }
}
