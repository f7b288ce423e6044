//! The push protocol's frames (docs/PROTOCOL.md is the normative text).
//!
//! Every frame is a fixed 24-byte header followed by `body_len` bytes. All
//! integers are little-endian. The header alone says how many bytes follow,
//! so a receiver reads the header, checks it, and only then decides where the
//! body goes: a DATA body goes straight into the landing ring at the offset
//! the header names (after checking it against the grant), every other body
//! into a small fixed buffer.
//!
//! Decoding never panics and never allocates; it is fuzzed
//! (`fuzz/fuzz_targets/frames.rs`).
//!
//! Why this file is over ~800 lines: every frame's encoder and decoder, the
//! error codes and their checks are one wire contract kept in one place; about
//! 130 lines are unit tests.

/// Protocol version spoken by this build. A peer with another version is
/// refused at HELLO with [`Code::BadVersion`]. Version 2: GRANT entries
/// carry the remote key to write the grant under (a memory window bound to
/// just that range over RDMA), 32 bytes instead of version 1's 24.
pub const VERSION: u32 = 2;

/// First two bytes of every frame ("KS" little-endian).
pub const MAGIC: u16 = 0x534b;

/// Header size in bytes.
pub const HEADER_BYTES: usize = 24;

/// Size of one GRANT entry.
pub const GRANT_ENTRY_BYTES: usize = 32;

/// Fixed part of a HELLO body (the token follows).
pub const HELLO_FIXED_BYTES: usize = 56;

/// Size of a WELCOME body.
pub const WELCOME_BYTES: usize = 16;
/// Body of an RDMA_ENDPOINT frame: the GID.
pub const RDMA_ENDPOINT_BYTES: usize = 16;
/// HELLO's and WELCOME's transport field: data as DATA frames on TCP.
pub const TRANSPORT_TCP: u32 = 0;
/// HELLO's and WELCOME's transport field: data as RDMA WRITE_WITH_IMM.
pub const TRANSPORT_RDMA: u32 = 1;

/// Longest job token.
pub const MAX_TOKEN_BYTES: usize = 1024;

/// Longest ERROR message.
pub const MAX_MESSAGE_BYTES: usize = 4096;

/// Most entries in one GRANT frame.
pub const MAX_GRANT_ENTRIES: usize = 4096;

/// Largest DATA body this build accepts (an owner sends large samples in
/// several frames).
pub const MAX_DATA_BYTES: u32 = 64 << 20;

/// Grant id meaning "the whole connection" in an ERROR frame.
pub const CONNECTION: u32 = u32::MAX;

/// DATA header `b`, bit 31: the owner reports its times for the grant in
/// the other bits (docs/PROTOCOL.md, "DATA"); 0 reports none.
pub const DATA_TIMES: u32 = 1 << 31;

/// Largest time [`data_times`] carries, in microseconds (2047 << 15,
/// about 67 s); longer ones are carried as this.
pub const DATA_TIME_MAX_US: u64 = 2047 << 15;

/// A time in microseconds as 15 bits: an 11-bit mantissa `m` and a 4-bit
/// exponent `e` for `m << e` (rounded down, so at most 1/1024 short;
/// exact below 2048 µs), saturating at [`DATA_TIME_MAX_US`].
fn us15(us: u64) -> u32 {
    let us = us.min(DATA_TIME_MAX_US);
    let e = (64 - us.leading_zeros()).saturating_sub(11);
    ((e << 11) | (us >> e) as u32) & 0x7FFF
}

fn from_us15(v: u32) -> u64 {
    ((v & 0x7FF) as u64) << ((v >> 11) & 0xF)
}

/// DATA header `b` carrying the owner's times for the grant, both from
/// when it read the GRANT frame: `read_us`, until this frame's bytes were
/// ready to send (waiting for a staging slot, then the read; about 0 from
/// a mapped page cache), and `node_us`, until this frame was posted to
/// the socket. Bits 0-14 and 16-30, bit 31 set.
pub fn data_times(read_us: u64, node_us: u64) -> u32 {
    DATA_TIMES | us15(read_us) | (us15(node_us) << 16)
}

/// The owner's times in a DATA header's `b`, (read, at the node) in
/// microseconds; None when it reports none (bit 31 clear: an owner that
/// predates them, which sends 0).
pub fn parse_data_times(b: u32) -> Option<(u64, u64)> {
    (b & DATA_TIMES != 0).then(|| (from_us15(b), from_us15(b >> 16)))
}

/// Header `c` of a consumer's keepalive (an empty ERROR frame for the
/// connection, code 0): bit 0 asks the owner for heartbeats. An owner that
/// predates heartbeats ignores `c` (and every keepalive), so asking is
/// safe with any version-2 owner; one that knows them answers with
/// [`HEARTBEAT_INTERVAL`] heartbeats from then on.
pub(crate) const ASK_HEARTBEATS: u64 = 1;

/// Header `c` of a consumer's keepalive, bit 1 (with bit 0): the consumer
/// restarts its silence clock when it grants to an owner with nothing
/// outstanding, so the owner may beat the connection only every
/// [`IDLE_HEARTBEAT_INTERVAL`] while it has nothing for it. A consumer
/// that does not set it (one from before) judges a silence that began
/// before its grant, and gets heartbeats every [`HEARTBEAT_INTERVAL`].
pub(crate) const SLOW_IDLE_HEARTBEATS: u64 = 2;

/// Header `c` of a consumer's keepalive, bit 2 (with bit 0): send me
/// node-down notices ([`Code::NodeDown`]). An owner that does not know it
/// sends none; a consumer that does not set it (one from before, which
/// would take an unknown connection ERROR for the end of the connection)
/// gets none.
pub(crate) const ASK_NODE_NOTICES: u64 = 4;

/// Header `c` of a consumer's keepalive, bit 3 (with bit 0): answer with a
/// heartbeat at your next pass, idle or not. Sent after a node-down notice
/// about this owner, when the consumer's own silence clock says nothing
/// (an idle connection is beaten only every [`IDLE_HEARTBEAT_INTERVAL`]).
/// An owner that does not know it beats as before, so a consumer takes
/// its silence for the notice's confirmation only after
/// [`PROBE_SILENCE`].
pub(crate) const PROBE: u64 = 8;

/// How long a consumer that probed an owner after a node-down notice waits
/// for any frame from it before it takes the notice as confirmed: an
/// owner answers a probe at its next pass (within 125 ms), so a live one
/// is heard well within it even on a loaded machine.
pub(crate) const PROBE_SILENCE: std::time::Duration = std::time::Duration::from_millis(1500);

/// A node-down notice about an owner the consumer has grants outstanding
/// on (or one that beats every [`HEARTBEAT_INTERVAL`] idle or not) is
/// confirmed at once by the consumer's own silence clock when the owner
/// was silent this long: a live owner busy with the consumer is heard at
/// least every 375 ms.
pub(crate) const NOTICE_SILENCE: std::time::Duration = std::time::Duration::from_millis(750);

/// An owner sends a heartbeat (the keepalive frame: an empty ERROR for the
/// connection, code 0) to a consumer that asked for them when it sent that
/// consumer nothing for this long, so a consumer can tell a dead owner
/// from a quiet one in a few intervals instead of a node timeout.
pub(crate) const HEARTBEAT_INTERVAL: std::time::Duration = std::time::Duration::from_millis(250);

/// The heartbeat interval on a connection the owner has nothing for (no
/// grant queued, read or being sent): an idle consumer judges an owner's
/// silence by its node timeout (at least [`IDLE_HEARTBEAT_INTERVAL`] x 3),
/// and one that grants after a silence restarts its heartbeat clock at
/// the grant (the owner, now busy, beats every [`HEARTBEAT_INTERVAL`]
/// again, so a dead owner is still found 2 s after the grant). An owner
/// tending 4,095 idle consumers sends 819 frames a second, not 16,380
/// (measured: BENCHMARKS.md, "One node against 4,095 links").
pub(crate) const IDLE_HEARTBEAT_INTERVAL: std::time::Duration = std::time::Duration::from_secs(5);

/// In a heartbeat's `c`, bits 32..63: the owner's idle timeout in
/// milliseconds (`--idle-timeout-ms`; 0: not said, as owners before this
/// field sent). A consumer that reads it may send its keepalives on an
/// idle connection as rarely as a quarter of it; one that ignores it
/// keeps its one per second.
pub(crate) const HEARTBEAT_IDLE_TIMEOUT_SHIFT: u32 = 32;

/// Frame types.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// Consumer → owner, first frame: version, token, who it is, its ring.
    Hello = 1,
    /// Owner → consumer, answer to HELLO: node index, limits.
    Welcome = 2,
    /// Consumer → owner: samples to push and where.
    Grant = 3,
    /// Owner → consumer: bytes of a granted sample at a ring offset.
    Data = 4,
    /// Either way: a grant (or the connection) that cannot be served.
    Error = 5,
    /// Either way, once, right after WELCOME on an RDMA connection: the
    /// sender's RC queue pair (number, first PSN, GID).
    RdmaEndpoint = 6,
}

impl Kind {
    fn from_u8(v: u8) -> Option<Kind> {
        Some(match v {
            1 => Kind::Hello,
            2 => Kind::Welcome,
            3 => Kind::Grant,
            4 => Kind::Data,
            5 => Kind::Error,
            6 => Kind::RdmaEndpoint,
            _ => return None,
        })
    }
}

/// Error codes carried by ERROR frames.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum Code {
    /// The job token does not match the node's.
    BadToken = 1,
    /// The protocol version is not spoken here.
    BadVersion = 2,
    /// The consumer's catalog is not the node's (identity or length differ).
    WrongDataset = 3,
    /// The node does not hold the sample.
    NotHeld = 4,
    /// Reading the sample failed on the node.
    ReadFailed = 5,
    /// A frame broke the protocol (the message says how).
    Violation = 6,
    /// More grants outstanding than the WELCOME allowed.
    TooManyGrants = 7,
    /// The node is shutting down.
    ShuttingDown = 8,
    /// Setting up or running the transport (RDMA) failed on the sender.
    TransportFailed = 9,
    /// The node serves as many consumers as it is configured for
    /// (`kspeed serve --max-consumers-per-poller` times its pollers); the
    /// node itself is fine.
    NodeFull = 10,
    /// Answer to a connection whose HELLO the owner did not read: too many
    /// handshakes were pending and this one, not yet past HELLO, made room
    /// for a newer one (`kspeed serve --max-handshakes`). Retry after a
    /// back-off (docs/PROTOCOL.md, "Admission and retry").
    Busy = 11,
    /// Answer to a connection whose HELLO the owner did not read: its
    /// address presented too many wrong tokens lately and the node had no
    /// room for another handshake from it. Retry after a back-off; a
    /// correct token is never refused for its address once read.
    RateLimited = 12,
    /// Owner → consumer, about another node: the owner's own consumer
    /// side judged that node dead (a node-down notice, sent only to a
    /// consumer that asked with bit 2 of its keepalive's `c`; `c` holds
    /// the node's index in bits 0..31 and its silence in ms in bits
    /// 32..63; docs/PROTOCOL.md, "Node-down notices"). Not an end of the
    /// connection it comes on.
    NodeDown = 13,
    /// A code this build does not know.
    Unknown = 0,
}

impl Code {
    /// Decodes a code; unknown values map to [`Code::Unknown`].
    pub fn from_u32(v: u32) -> Code {
        match v {
            1 => Code::BadToken,
            2 => Code::BadVersion,
            3 => Code::WrongDataset,
            4 => Code::NotHeld,
            5 => Code::ReadFailed,
            6 => Code::Violation,
            7 => Code::TooManyGrants,
            8 => Code::ShuttingDown,
            9 => Code::TransportFailed,
            10 => Code::NodeFull,
            11 => Code::Busy,
            12 => Code::RateLimited,
            13 => Code::NodeDown,
            _ => Code::Unknown,
        }
    }

    /// Short name for messages.
    pub fn name(self) -> &'static str {
        match self {
            Code::BadToken => "bad token",
            Code::BadVersion => "bad version",
            Code::WrongDataset => "wrong dataset",
            Code::NotHeld => "sample not held",
            Code::ReadFailed => "read failed",
            Code::Violation => "protocol violation",
            Code::TooManyGrants => "too many grants",
            Code::ShuttingDown => "shutting down",
            Code::TransportFailed => "transport failed",
            Code::NodeFull => "node full",
            Code::Busy => "node busy",
            Code::RateLimited => "rate-limited",
            Code::NodeDown => "node down",
            Code::Unknown => "unknown error",
        }
    }

    /// Whether a consumer that gets this code in answer to HELLO tries the
    /// node again (with a back-off, within its node timeout) instead of
    /// giving up: the node is fine but cannot take it now.
    pub fn retry_at_hello(self) -> bool {
        matches!(self, Code::NodeFull | Code::Busy | Code::RateLimited)
    }
}

/// Why a frame was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FrameError {
    /// The first two bytes are not [`MAGIC`].
    BadMagic(u16),
    /// The type byte names no frame.
    UnknownKind(u8),
    /// The flags byte is not zero.
    BadFlags(u8),
    /// The body is longer than the type allows.
    TooLong {
        /// Frame type.
        kind: Kind,
        /// Body length announced.
        body_len: u32,
        /// Most allowed.
        max: u32,
    },
    /// The body has the wrong size for its type.
    BadLength {
        /// Frame type.
        kind: Kind,
        /// Body length announced.
        body_len: u32,
    },
    /// A frame of this type is not expected here.
    Unexpected(Kind),
    /// A field holds a value its type does not allow.
    BadValue {
        /// Frame type.
        kind: Kind,
        /// Which field.
        field: &'static str,
        /// The value found.
        value: u64,
    },
}

impl std::fmt::Display for FrameError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FrameError::BadMagic(m) => write!(f, "bad frame magic {m:#06x}"),
            FrameError::UnknownKind(k) => write!(f, "unknown frame type {k}"),
            FrameError::BadFlags(x) => write!(f, "non-zero frame flags {x:#04x}"),
            FrameError::TooLong {
                kind,
                body_len,
                max,
            } => write!(f, "{kind:?} frame body of {body_len} bytes exceeds {max}"),
            FrameError::BadLength { kind, body_len } => {
                write!(
                    f,
                    "{kind:?} frame body of {body_len} bytes has the wrong size"
                )
            }
            FrameError::Unexpected(k) => write!(f, "unexpected {k:?} frame"),
            FrameError::BadValue { kind, field, value } => {
                write!(f, "{kind:?} frame: {field} {value:#x} is out of range")
            }
        }
    }
}

/// A decoded header. `a`, `b` and `c` mean different things per type (see
/// the constructors and docs/PROTOCOL.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// Frame type.
    pub kind: Kind,
    /// Bytes after the header.
    pub body_len: u32,
    /// HELLO/WELCOME: version; GRANT: entries; DATA/ERROR: grant id.
    pub a: u32,
    /// WELCOME: node index; ERROR: code; otherwise 0.
    pub b: u32,
    /// WELCOME: most grants outstanding; DATA: ring offset; otherwise 0.
    pub c: u64,
}

impl Header {
    /// Encodes into 24 bytes.
    pub fn encode(&self) -> [u8; HEADER_BYTES] {
        let mut out = [0u8; HEADER_BYTES];
        out[0..2].copy_from_slice(&MAGIC.to_le_bytes());
        out[2] = self.kind as u8;
        out[3] = 0;
        out[4..8].copy_from_slice(&self.body_len.to_le_bytes());
        out[8..12].copy_from_slice(&self.a.to_le_bytes());
        out[12..16].copy_from_slice(&self.b.to_le_bytes());
        out[16..24].copy_from_slice(&self.c.to_le_bytes());
        out
    }

    /// Decodes and checks a header: magic, type, flags, and the body length
    /// each type allows (DATA up to `max_data`).
    pub fn decode(b: &[u8; HEADER_BYTES], max_data: u32) -> Result<Header, FrameError> {
        let magic = u16::from_le_bytes([b[0], b[1]]);
        if magic != MAGIC {
            return Err(FrameError::BadMagic(magic));
        }
        let kind = Kind::from_u8(b[2]).ok_or(FrameError::UnknownKind(b[2]))?;
        if b[3] != 0 {
            return Err(FrameError::BadFlags(b[3]));
        }
        let h = Header {
            kind,
            body_len: u32_at(b, 4),
            a: u32_at(b, 8),
            b: u32_at(b, 12),
            c: u64_at(b, 16),
        };
        let max = match kind {
            Kind::Hello => (HELLO_FIXED_BYTES + MAX_TOKEN_BYTES) as u32,
            Kind::Welcome => WELCOME_BYTES as u32,
            Kind::Grant => (MAX_GRANT_ENTRIES * GRANT_ENTRY_BYTES) as u32,
            Kind::Data => max_data,
            Kind::Error => MAX_MESSAGE_BYTES as u32,
            Kind::RdmaEndpoint => RDMA_ENDPOINT_BYTES as u32,
        };
        // A receiver that takes no DATA (an owner: `max_data` 0) refuses
        // one by its type, not by its size.
        if kind == Kind::Data && max_data == 0 {
            return Err(FrameError::Unexpected(kind));
        }
        if h.body_len > max {
            return Err(FrameError::TooLong {
                kind,
                body_len: h.body_len,
                max,
            });
        }
        let exact = match kind {
            Kind::Welcome => h.body_len == WELCOME_BYTES as u32,
            Kind::Grant => h.body_len as u64 == h.a as u64 * GRANT_ENTRY_BYTES as u64 && h.a > 0,
            Kind::Hello => h.body_len as usize >= HELLO_FIXED_BYTES,
            Kind::Data => h.body_len > 0,
            Kind::Error => true,
            Kind::RdmaEndpoint => h.body_len == RDMA_ENDPOINT_BYTES as u32,
        };
        if !exact {
            return Err(FrameError::BadLength {
                kind,
                body_len: h.body_len,
            });
        }
        Ok(h)
    }

    /// A DATA header with the owner's times in `b` ([`data_times`]).
    pub fn data_timed(grant: u32, offset: u64, len: u32, times: u32) -> Header {
        Header {
            b: times,
            ..Header::data(grant, offset, len)
        }
    }

    /// A DATA header: `len` bytes for grant `grant` at ring offset `offset`.
    pub fn data(grant: u32, offset: u64, len: u32) -> Header {
        Header {
            kind: Kind::Data,
            body_len: len,
            a: grant,
            b: 0,
            c: offset,
        }
    }

    /// A GRANT header for `entries` entries.
    pub fn grant(entries: u32) -> Header {
        Header {
            kind: Kind::Grant,
            body_len: entries * GRANT_ENTRY_BYTES as u32,
            a: entries,
            b: 0,
            c: 0,
        }
    }

    /// A keepalive (either way): an empty ERROR frame for the connection
    /// with code 0; from a consumer, `ask_heartbeats` sets
    /// [`ASK_HEARTBEATS`] in `c`.
    pub(crate) fn keepalive(ask_heartbeats: bool) -> Header {
        Header {
            kind: Kind::Error,
            body_len: 0,
            a: CONNECTION,
            b: Code::Unknown as u32,
            c: if ask_heartbeats {
                ASK_HEARTBEATS | SLOW_IDLE_HEARTBEATS | ASK_NODE_NOTICES
            } else {
                0
            },
        }
    }

    /// A consumer's probe: an asking keepalive with [`PROBE`] set.
    pub(crate) fn probe() -> Header {
        let k = Header::keepalive(true);
        Header {
            c: k.c | PROBE,
            ..k
        }
    }

    /// An owner's node-down notice: an empty ERROR for the connection with
    /// code [`Code::NodeDown`]; `c` holds the dead node's index (bits
    /// 0..31) and how long the owner's consumer side had heard nothing
    /// from it, in milliseconds (bits 32..63).
    pub(crate) fn node_down(node: u32, silent_ms: u32) -> Header {
        Header {
            kind: Kind::Error,
            body_len: 0,
            a: CONNECTION,
            b: Code::NodeDown as u32,
            c: (silent_ms as u64) << 32 | node as u64,
        }
    }

    /// The node and silence (ms) of a node-down notice, if this is one.
    pub(crate) fn node_down_notice(&self) -> Option<(u32, u32)> {
        (self.kind == Kind::Error
            && self.a == CONNECTION
            && self.b == Code::NodeDown as u32
            && self.body_len == 0)
            .then_some((self.c as u32, (self.c >> 32) as u32))
    }

    /// An owner's heartbeat: a keepalive whose `c` carries the owner's idle
    /// timeout (see [`HEARTBEAT_IDLE_TIMEOUT_SHIFT`]).
    pub(crate) fn heartbeat(idle_timeout: std::time::Duration) -> Header {
        let ms = idle_timeout.as_millis().min(u32::MAX as u128) as u64;
        Header {
            c: ms << HEARTBEAT_IDLE_TIMEOUT_SHIFT,
            ..Header::keepalive(false)
        }
    }

    /// The idle timeout an owner's heartbeat says, if it says one.
    pub(crate) fn heartbeat_idle_timeout(&self) -> Option<std::time::Duration> {
        let ms = self.c >> HEARTBEAT_IDLE_TIMEOUT_SHIFT;
        (ms > 0).then(|| std::time::Duration::from_millis(ms))
    }

    /// Whether this is a keepalive (from a consumer) or heartbeat (from an
    /// owner): an empty ERROR for the connection with code 0.
    pub(crate) fn is_keepalive(&self) -> bool {
        self.kind == Kind::Error
            && self.a == CONNECTION
            && self.b == Code::Unknown as u32
            && self.body_len == 0
    }

    /// An ERROR header for a message of `len` bytes.
    pub fn error(grant: u32, code: Code, len: u32) -> Header {
        Header {
            kind: Kind::Error,
            body_len: len,
            a: grant,
            b: code as u32,
            c: 0,
        }
    }
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut x = [0u8; 8];
    x.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(x)
}

/// What a consumer says about itself in HELLO.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hello {
    /// The catalog's identity ([`crate::dataset::Catalog::identity`]).
    pub catalog_identity: u32,
    /// The consumer's rank and world size (for the owner's logs).
    pub rank: u32,
    /// World size.
    pub world: u32,
    /// Samples in the catalog.
    pub catalog_samples: u64,
    /// Shuffle seed.
    pub seed: u64,
    /// Landing ring address (RDMA: the registered address; TCP: 0).
    pub ring_addr: u64,
    /// Landing ring length: every granted range lies below it.
    pub ring_len: u64,
    /// Remote key of the whole ring (RDMA, when the consumer's device has
    /// no memory windows), or 0: each GRANT entry carries the key to use
    /// (TCP: 0).
    pub rkey: u32,
    /// The transport asked for: [`TRANSPORT_TCP`] or [`TRANSPORT_RDMA`].
    pub transport: u32,
}

impl Hello {
    /// Encodes the frame (header and body) with `token` into `out`.
    pub fn encode(&self, token: &[u8], out: &mut Vec<u8>) {
        let body = HELLO_FIXED_BYTES + token.len();
        out.extend_from_slice(
            &Header {
                kind: Kind::Hello,
                body_len: body as u32,
                a: VERSION,
                b: 0,
                c: 0,
            }
            .encode(),
        );
        out.extend_from_slice(&self.catalog_identity.to_le_bytes());
        out.extend_from_slice(&self.rank.to_le_bytes());
        out.extend_from_slice(&self.world.to_le_bytes());
        out.extend_from_slice(&self.transport.to_le_bytes());
        out.extend_from_slice(&self.catalog_samples.to_le_bytes());
        out.extend_from_slice(&self.seed.to_le_bytes());
        out.extend_from_slice(&self.ring_addr.to_le_bytes());
        out.extend_from_slice(&self.ring_len.to_le_bytes());
        out.extend_from_slice(&self.rkey.to_le_bytes());
        out.extend_from_slice(&(token.len() as u32).to_le_bytes());
        out.extend_from_slice(token);
    }

    /// Checks the fields an owner relies on: a world of at least one rank,
    /// a rank inside it, a ring of at least one byte and a transport this
    /// protocol names. The error names the field and its value.
    pub fn check(&self) -> Result<(), String> {
        if self.world == 0 {
            return Err("HELLO field world is 0; a job has at least 1 rank".into());
        }
        if self.rank >= self.world {
            return Err(format!(
                "HELLO field rank is {}; it must be below world ({})",
                self.rank, self.world
            ));
        }
        if self.ring_len == 0 {
            return Err("HELLO field ring_len is 0; no grant can fit in it".into());
        }
        if self.transport != TRANSPORT_TCP && self.transport != TRANSPORT_RDMA {
            return Err(format!(
                "HELLO field transport is {}; it must be {TRANSPORT_TCP} (TCP) or {TRANSPORT_RDMA} (RDMA)",
                self.transport
            ));
        }
        Ok(())
    }

    /// Decodes a HELLO body; returns the fields and the token.
    pub fn decode(body: &[u8]) -> Result<(Hello, &[u8]), FrameError> {
        let bad = FrameError::BadLength {
            kind: Kind::Hello,
            body_len: body.len() as u32,
        };
        if body.len() < HELLO_FIXED_BYTES {
            return Err(bad);
        }
        let token_len = u32_at(body, 52) as usize;
        if token_len > MAX_TOKEN_BYTES || HELLO_FIXED_BYTES + token_len != body.len() {
            return Err(bad);
        }
        Ok((
            Hello {
                catalog_identity: u32_at(body, 0),
                rank: u32_at(body, 4),
                world: u32_at(body, 8),
                catalog_samples: u64_at(body, 16),
                seed: u64_at(body, 24),
                ring_addr: u64_at(body, 32),
                ring_len: u64_at(body, 40),
                rkey: u32_at(body, 48),
                transport: u32_at(body, 12),
            },
            &body[HELLO_FIXED_BYTES..],
        ))
    }
}

/// What an owner answers in WELCOME.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Welcome {
    /// The owner's node index.
    pub node_index: u32,
    /// Nodes in its placement.
    pub nodes: u32,
    /// Copies per sample in its placement (at most 64: the low 16 bits of
    /// the body's word at 4).
    pub replicas: u32,
    /// Its placement's owner function (docs/FORMAT.md, "Owner function"):
    /// 0 scaled, 1 jump; bits 16..31 of the body's word at 4, so a consumer
    /// that predates jump reads a jump space's copies as 65,536 or more and
    /// refuses the node instead of misplacing every sample.
    pub owner_fn: u32,
    /// Largest DATA body it sends.
    pub max_data_bytes: u32,
    /// Most grants a consumer may have outstanding with it.
    pub max_grants: u64,
    /// The transport it agreed to: the HELLO's, or [`TRANSPORT_TCP`] when
    /// it cannot speak that one.
    pub transport: u32,
}

impl Welcome {
    /// Encodes the whole frame.
    pub fn encode(&self) -> [u8; HEADER_BYTES + WELCOME_BYTES] {
        let mut out = [0u8; HEADER_BYTES + WELCOME_BYTES];
        out[..HEADER_BYTES].copy_from_slice(
            &Header {
                kind: Kind::Welcome,
                body_len: WELCOME_BYTES as u32,
                a: VERSION,
                b: self.node_index,
                c: self.max_grants,
            }
            .encode(),
        );
        out[24..28].copy_from_slice(&self.nodes.to_le_bytes());
        let placed = (self.replicas & 0xffff) | (self.owner_fn << 16);
        out[28..32].copy_from_slice(&placed.to_le_bytes());
        out[32..36].copy_from_slice(&self.max_data_bytes.to_le_bytes());
        out[36..40].copy_from_slice(&self.transport.to_le_bytes());
        out
    }

    /// Decodes from a checked WELCOME header and its body.
    pub fn decode(h: &Header, body: &[u8]) -> Result<Welcome, FrameError> {
        if h.kind != Kind::Welcome {
            return Err(FrameError::Unexpected(h.kind));
        }
        if body.len() != WELCOME_BYTES {
            return Err(FrameError::BadLength {
                kind: Kind::Welcome,
                body_len: body.len() as u32,
            });
        }
        Ok(Welcome {
            node_index: h.b,
            nodes: u32_at(body, 0),
            replicas: u32_at(body, 4) & 0xffff,
            owner_fn: u32_at(body, 4) >> 16,
            max_data_bytes: u32_at(body, 8),
            max_grants: h.c,
            transport: u32_at(body, 12),
        })
    }
}

/// An RDMA_ENDPOINT frame's content: the sender's RC queue pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RdmaEndpoint {
    /// Queue pair number (24 bits).
    pub qpn: u32,
    /// First packet sequence number (24 bits).
    pub psn: u32,
    /// The GID (RoCE: the IP address, IPv4-mapped).
    pub gid: [u8; 16],
}

impl RdmaEndpoint {
    /// Encodes the whole frame.
    pub fn encode(&self) -> [u8; HEADER_BYTES + RDMA_ENDPOINT_BYTES] {
        let mut out = [0u8; HEADER_BYTES + RDMA_ENDPOINT_BYTES];
        out[..HEADER_BYTES].copy_from_slice(
            &Header {
                kind: Kind::RdmaEndpoint,
                body_len: RDMA_ENDPOINT_BYTES as u32,
                a: self.qpn,
                b: self.psn,
                c: 0,
            }
            .encode(),
        );
        out[HEADER_BYTES..].copy_from_slice(&self.gid);
        out
    }

    /// Decodes from a checked header and its body.
    pub fn decode(h: &Header, body: &[u8]) -> Result<RdmaEndpoint, FrameError> {
        if h.kind != Kind::RdmaEndpoint {
            return Err(FrameError::Unexpected(h.kind));
        }
        let gid: [u8; 16] = body.try_into().map_err(|_| FrameError::BadLength {
            kind: Kind::RdmaEndpoint,
            body_len: body.len() as u32,
        })?;
        for (field, v) in [("QP number", h.a), ("PSN", h.b)] {
            if v > 0xff_ffff {
                return Err(FrameError::BadValue {
                    kind: Kind::RdmaEndpoint,
                    field,
                    value: v as u64,
                });
            }
        }
        Ok(RdmaEndpoint {
            qpn: h.a,
            psn: h.b,
            gid,
        })
    }
}

/// One GRANT entry: push sample `sample` (`len` bytes) to ring offset `offset`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GrantEntry {
    /// Grant id (echoed in DATA and ERROR frames).
    pub grant: u32,
    /// Sample length.
    pub len: u32,
    /// Sample id.
    pub sample: u64,
    /// Ring offset of the sample's first byte.
    pub offset: u64,
    /// RDMA: the remote key to write this grant under (a memory window the
    /// consumer bound to exactly `offset..offset + len`, or its whole
    /// ring's key); TCP: 0.
    pub rkey: u32,
}

impl GrantEntry {
    /// Writes the 32-byte encoding (the last 4 bytes are reserved, 0).
    pub fn encode_into(&self, out: &mut [u8]) {
        out[0..4].copy_from_slice(&self.grant.to_le_bytes());
        out[4..8].copy_from_slice(&self.len.to_le_bytes());
        out[8..16].copy_from_slice(&self.sample.to_le_bytes());
        out[16..24].copy_from_slice(&self.offset.to_le_bytes());
        out[24..28].copy_from_slice(&self.rkey.to_le_bytes());
        out[28..32].copy_from_slice(&0u32.to_le_bytes());
    }

    /// Decodes entry `i` of a GRANT body (whose length the header checked).
    pub fn decode(body: &[u8], i: usize) -> GrantEntry {
        let e = &body[i * GRANT_ENTRY_BYTES..(i + 1) * GRANT_ENTRY_BYTES];
        GrantEntry {
            grant: u32_at(e, 0),
            len: u32_at(e, 4),
            sample: u64_at(e, 8),
            offset: u64_at(e, 16),
            rkey: u32_at(e, 24),
        }
    }
}

/// Decodes a stream of frames as a peer would, never trusting the input:
/// the fuzz target's entry point. Returns how many frames were accepted
/// before the first refusal or the end of input.
pub fn decode_stream(mut bytes: &[u8]) -> (usize, Option<FrameError>) {
    let mut n = 0;
    while bytes.len() >= HEADER_BYTES {
        let mut hb = [0u8; HEADER_BYTES];
        hb.copy_from_slice(&bytes[..HEADER_BYTES]);
        let h = match Header::decode(&hb, MAX_DATA_BYTES) {
            Ok(h) => h,
            Err(e) => return (n, Some(e)),
        };
        let rest = &bytes[HEADER_BYTES..];
        if rest.len() < h.body_len as usize {
            return (n, None);
        }
        let body = &rest[..h.body_len as usize];
        let checked = match h.kind {
            Kind::Hello => Hello::decode(body).map(|_| ()),
            Kind::Welcome => Welcome::decode(&h, body).map(|_| ()),
            Kind::Grant => {
                let mut ok = Ok(());
                for i in 0..h.a as usize {
                    let e = GrantEntry::decode(body, i);
                    if e.offset.checked_add(e.len as u64).is_none() {
                        ok = Err(FrameError::BadLength {
                            kind: Kind::Grant,
                            body_len: h.body_len,
                        });
                    }
                }
                ok
            }
            Kind::RdmaEndpoint => RdmaEndpoint::decode(&h, body).map(|_| ()),
            // Any bytes are a message (shown lossily) or a payload.
            Kind::Error | Kind::Data => Ok(()),
        };
        if let Err(e) = checked {
            return (n, Some(e));
        }
        n += 1;
        bytes = &rest[h.body_len as usize..];
    }
    (n, None)
}

#[cfg(test)]
mod tests {
    #[test]
    fn data_times_round_trip_within_a_thousandth() {
        assert_eq!(parse_data_times(0), None, "an older owner's 0");
        for (r, n) in [
            (0u64, 0u64),
            (1, 2047),
            (2048, 4095),
            (4096, 123_456),
            (999_999, 5_000_000),
            (DATA_TIME_MAX_US, DATA_TIME_MAX_US),
        ] {
            let (r2, n2) = parse_data_times(data_times(r, n)).unwrap();
            for (want, got) in [(r, r2), (n, n2)] {
                assert!(got <= want && want - got <= want / 1024, "{want} -> {got}");
                if want < 2048 {
                    assert_eq!(got, want);
                }
            }
        }
        let (r, n) = parse_data_times(data_times(u64::MAX, 1 << 40)).unwrap();
        assert_eq!((r, n), (DATA_TIME_MAX_US, DATA_TIME_MAX_US), "saturates");
        let h = Header::data_timed(7, 4096, 100, data_times(5, 9));
        let mut hb = h.encode();
        assert_eq!(Header::decode(&hb, MAX_DATA_BYTES), Ok(h));
        hb[12..16].copy_from_slice(&0u32.to_le_bytes());
        assert_eq!(Header::decode(&hb, MAX_DATA_BYTES).unwrap().b, 0);
    }

    use super::*;

    /// A notice round-trips its node and silence, is neither a keepalive
    /// nor an error with a body, and a probe is an asking keepalive with
    /// every bit a consumer of this build sets.
    #[test]
    fn node_down_notices_and_probes_encode_what_the_protocol_says() {
        let h = Header::node_down(4095, 2003);
        let d = Header::decode(&h.encode(), MAX_DATA_BYTES).unwrap();
        assert_eq!(d.node_down_notice(), Some((4095, 2003)));
        assert_eq!((d.a, d.b, d.body_len), (CONNECTION, 13, 0));
        assert_eq!(d.c, 2003 << 32 | 4095);
        assert!(!d.is_keepalive());
        assert_eq!(Code::from_u32(d.b), Code::NodeDown);
        assert_eq!(Header::keepalive(true).node_down_notice(), None);
        assert_eq!(
            Header::error(CONNECTION, Code::NodeDown, 5).node_down_notice(),
            None
        );
        let p = Header::decode(&Header::probe().encode(), MAX_DATA_BYTES).unwrap();
        assert!(p.is_keepalive());
        assert_eq!(
            p.c,
            ASK_HEARTBEATS | SLOW_IDLE_HEARTBEATS | ASK_NODE_NOTICES | PROBE
        );
        assert_eq!(Header::keepalive(true).c, 0b0111);
        assert_eq!(Header::keepalive(false).c, 0);
    }

    #[test]
    fn header_round_trips_and_rejects_garbage() {
        let h = Header::data(7, 4096, 1000);
        let b = h.encode();
        assert_eq!(Header::decode(&b, MAX_DATA_BYTES), Ok(h));
        let mut bad = b;
        bad[0] = 0;
        assert!(matches!(
            Header::decode(&bad, MAX_DATA_BYTES),
            Err(FrameError::BadMagic(_))
        ));
        let mut bad = b;
        bad[2] = 99;
        assert_eq!(
            Header::decode(&bad, MAX_DATA_BYTES),
            Err(FrameError::UnknownKind(99))
        );
        let big = Header::data(7, 0, 2000).encode();
        assert!(matches!(
            Header::decode(&big, 1000),
            Err(FrameError::TooLong { .. })
        ));
        // A GRANT whose length disagrees with its entry count.
        let mut g = Header::grant(2).encode();
        g[8] = 3;
        assert!(matches!(
            Header::decode(&g, MAX_DATA_BYTES),
            Err(FrameError::BadLength { .. })
        ));
    }

    #[test]
    fn hello_and_welcome_round_trip() {
        let hello = Hello {
            catalog_identity: 0xdead_beef,
            rank: 3,
            world: 8,
            catalog_samples: 1_000_000,
            seed: 42,
            ring_addr: 0x7f00_0000_0000,
            ring_len: 256 << 20,
            rkey: 0x1234,
            transport: TRANSPORT_RDMA,
        };
        let mut out = Vec::new();
        hello.encode(b"secret", &mut out);
        let mut hb = [0u8; HEADER_BYTES];
        hb.copy_from_slice(&out[..HEADER_BYTES]);
        let h = Header::decode(&hb, MAX_DATA_BYTES).unwrap();
        assert_eq!((h.kind, h.a), (Kind::Hello, VERSION));
        let (back, token) = Hello::decode(&out[HEADER_BYTES..]).unwrap();
        assert_eq!((back, token), (hello, &b"secret"[..]));
        // A token length pointing past the body is refused.
        let mut body = out[HEADER_BYTES..].to_vec();
        body[52] = 200;
        assert!(Hello::decode(&body).is_err());

        let w = Welcome {
            node_index: 2,
            nodes: 3,
            replicas: 2,
            owner_fn: 1,
            max_data_bytes: 1 << 20,
            max_grants: 4096,
            transport: TRANSPORT_RDMA,
        };
        let wb = w.encode();
        let mut hb = [0u8; HEADER_BYTES];
        hb.copy_from_slice(&wb[..HEADER_BYTES]);
        let h = Header::decode(&hb, MAX_DATA_BYTES).unwrap();
        assert_eq!(Welcome::decode(&h, &wb[HEADER_BYTES..]), Ok(w));

        let ep = RdmaEndpoint {
            qpn: 0x12_3456,
            psn: 0xab_cdef,
            gid: [7; 16],
        };
        let eb = ep.encode();
        hb.copy_from_slice(&eb[..HEADER_BYTES]);
        let h = Header::decode(&hb, MAX_DATA_BYTES).unwrap();
        assert_eq!(RdmaEndpoint::decode(&h, &eb[HEADER_BYTES..]), Ok(ep));
        // A 16-byte body is the only size; a 25-bit QP number is refused.
        let mut bad = eb;
        bad[4] = 15;
        hb.copy_from_slice(&bad[..HEADER_BYTES]);
        assert!(Header::decode(&hb, MAX_DATA_BYTES).is_err());
        let mut bad = eb;
        bad[10] = 0x01;
        bad[11] = 0x01;
        hb.copy_from_slice(&bad[..HEADER_BYTES]);
        let h = Header::decode(&hb, MAX_DATA_BYTES).unwrap();
        let e = RdmaEndpoint::decode(&h, &bad[HEADER_BYTES..]).unwrap_err();
        assert!(e.to_string().contains("QP number"), "{e}");
    }

    #[test]
    fn decode_stream_survives_random_bytes() {
        let mut state = 1u64;
        // Fewer rounds under Miri (interpreted), the same code paths.
        let rounds = if cfg!(miri) { 60 } else { 2000 };
        for _ in 0..rounds {
            let len = (crate::hash::mix64(state) % 300) as usize;
            let bytes: Vec<u8> = (0..len)
                .map(|i| {
                    state = crate::hash::mix64(state ^ i as u64);
                    state as u8
                })
                .collect();
            let _ = decode_stream(&bytes);
        }
        // And a valid stream is accepted whole.
        let mut s = Vec::new();
        let mut g = vec![0u8; GRANT_ENTRY_BYTES];
        GrantEntry {
            grant: 1,
            len: 10,
            sample: 5,
            offset: 0,
            rkey: 0,
        }
        .encode_into(&mut g);
        s.extend_from_slice(&Header::grant(1).encode());
        s.extend_from_slice(&g);
        s.extend_from_slice(&Header::data(1, 0, 3).encode());
        s.extend_from_slice(b"abc");
        assert_eq!(decode_stream(&s), (2, None));
    }
}
