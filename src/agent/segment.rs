//! The attach segment: the small shared mapping through which an attached
//! rank and the node's agent exchange, per batch, only a ready word and a
//! release mark (docs/AGENT.md, "The attach segment").
//!
//! The rank creates the segment and its landing ring as sealed memfds
//! ([`Segment::create`], [`RingMap::create`]) and passes both to the agent
//! over the attach socket ([`super::attach`]); the agent maps them with
//! [`Segment::open`] / [`RingMap::open`], which check the layout (magic,
//! version, sizes, seals) before anything else is read. Then the agent
//! drives an [`AgentSide`] (publish batches, wait for room) and the rank a
//! [`RankSide`] (wait for a batch, release it).
//!
//! Why this is safe to share with another process: every word in the
//! mapping is an atomic in `#[repr(C)]` memory; a value that sizes or
//! places anything (slot count, ring bytes) is read once at open into the
//! process's own memory and never again, so a peer that scribbles on the
//! segment can give wrong answers (caught as named errors where they can
//! be: a release past what was published) but cannot make this process
//! read or write outside its mappings. The memfds are sealed against
//! shrinking, so the peer cannot truncate them under us (a SIGBUS).
//!
//! Fast path: publishing is some relaxed stores, one Release store, a
//! SeqCst fence and one load of the waiters word; taking is one Acquire
//! load. A futex call happens only to sleep (nothing ready / no room) or
//! to wake a side that said it sleeps.
//!
//! This module owns raw shared memory and the futex system call, so it is
//! one of the few allowed `unsafe`.

use std::cell::Cell;
use std::fs::File;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{fence, AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::time::{Duration, Instant};

use memmap2::MmapRaw;

use crate::error::{Error, Result};

#[cfg(not(target_endian = "little"))]
compile_error!("the attach segment and messages are little-endian; kspeed builds only on little-endian targets");

/// The segment's magic: the bytes `KSPATSEG` read as a little-endian u64.
pub const SEGMENT_MAGIC: u64 = u64::from_le_bytes(*b"KSPATSEG");
/// The segment layout this build writes and reads (bump on any change of
/// an offset or a meaning; the agent refuses another).
pub const SEGMENT_VERSION: u32 = 1;
/// Error slots in a segment: a side posts at most this many errors; later
/// ones are counted, not stored.
pub const ERROR_SLOTS: usize = 4;
/// Bytes of an error's kind name (an [`Error::kind_name`]) in a slot.
pub const ERROR_KIND_BYTES: usize = 32;
/// Bytes of an error's message in a slot (longer ones are cut on a char
/// boundary).
pub const ERROR_MESSAGE_BYTES: usize = 208;
/// Most batch slots a segment may have (the ring holds at most this many
/// batches in flight).
pub const MAX_SLOTS: u32 = 1 << 16;
/// Bits of a ready word or release mark that carry the batch sequence;
/// the generation takes the 16 bits above them.
pub const SEQ_BITS: u32 = 48;
/// Mask of the sequence bits.
pub const SEQ_MASK: u64 = (1 << SEQ_BITS) - 1;

/// A side's state word: what the peer reads to tell a clean close from a
/// death (a closed side stops beating without being gone).
pub mod side_state {
    /// Not started (the zeroed segment).
    pub const NONE: u32 = 0;
    /// Attached and running.
    pub const RUNNING: u32 = 1;
    /// Closed cleanly (detached); the peer stops waiting at once.
    pub const CLOSED: u32 = 2;
    /// Failed; its error is in an error slot.
    pub const FAILED: u32 = 3;
}

/// Which side of the segment wrote a word or an error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// The node's agent (writes ready words).
    Agent,
    /// The training rank (writes the release mark).
    Rank,
}

impl Side {
    /// The side's name in messages.
    pub fn name(self) -> &'static str {
        match self {
            Side::Agent => "agent",
            Side::Rank => "rank",
        }
    }
    fn code(self) -> u32 {
        match self {
            Side::Agent => 1,
            Side::Rank => 2,
        }
    }
}

/// An attach generation: 1..=65535, bumped by the rank each time it
/// (re)attaches its segment, so no ready word or release mark of an
/// earlier attach (a dead agent's last publishes) counts in this one.
/// Zero is never a generation, so a zeroed word is never ready.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Generation(u16);

impl Generation {
    /// The first generation.
    pub const FIRST: Generation = Generation(1);

    /// The generation of a raw value; `None` for 0.
    pub fn new(raw: u16) -> Option<Generation> {
        (raw != 0).then_some(Generation(raw))
    }

    /// The raw value (1..=65535).
    pub fn get(self) -> u16 {
        self.0
    }

    /// The next generation: 65535 wraps to 1, never 0.
    #[must_use]
    pub fn next(self) -> Generation {
        Generation(if self.0 == u16::MAX { 1 } else { self.0 + 1 })
    }
}

/// The word the agent stores in slot `seq % slots` when batch `seq` of
/// generation `gen` is ready: the generation in the high 16 bits, the
/// sequence (mod 2^48) below. It is never 0.
pub fn ready_word(gen: Generation, seq: u64) -> u64 {
    (u64::from(gen.0) << SEQ_BITS) | (seq & SEQ_MASK)
}

/// Whether `word` says batch `seq` of generation `gen` is ready: exact
/// equality, so a word of another generation or of the batch one lap
/// earlier (`seq - slots`) never counts.
pub fn is_ready(word: u64, gen: Generation, seq: u64) -> bool {
    word == ready_word(gen, seq)
}

/// The release mark: the rank has consumed every batch below `released`
/// in generation `gen`. Same encoding as a ready word.
pub fn release_mark(gen: Generation, released: u64) -> u64 {
    ready_word(gen, released)
}

/// Decodes a release mark: `Some(count mod 2^48)` when it is of `gen`,
/// `None` for another generation (a mark left by an earlier attach counts
/// as nothing released yet).
pub fn decode_release(mark: u64, gen: Generation) -> Option<u64> {
    ((mark >> SEQ_BITS) == u64::from(gen.0)).then_some(mark & SEQ_MASK)
}

/// Batches in flight between `published` and `released` (both mod 2^48):
/// the wrapping difference, so the counters may wrap.
pub fn in_flight(published: u64, released: u64) -> u64 {
    published.wrapping_sub(released) & SEQ_MASK
}

/// CLOCK_MONOTONIC in nanoseconds: the clock both processes read for
/// heartbeats (one clock per boot; processes in different time
/// namespaces would disagree, docs/AGENT.md).
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes into the timespec we own; the clock id
    // is a constant the kernel always supports.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime(CLOCK_MONOTONIC) failed");
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

// ---- the layout (docs/AGENT.md has the byte tables) ----------------------

/// Line 0: written once by the rank before it publishes the magic.
#[repr(C, align(64))]
struct Header {
    magic: AtomicU64,
    version: AtomicU32,
    header_bytes: AtomicU32,
    total_bytes: AtomicU64,
    slots: AtomicU32,
    error_slots: AtomicU32,
    ring_bytes: AtomicU64,
    generation: AtomicU32,
    rank_pid: AtomicU32,
    _reserved: [AtomicU64; 2],
}

/// Line 1: written by the agent only.
#[repr(C, align(64))]
struct AgentBlock {
    heartbeat_ns: AtomicU64,
    pid: AtomicU32,
    state: AtomicU32,
    /// Bumped (then FUTEX_WAKE) after a publish when the rank sleeps.
    ready_futex: AtomicU32,
    /// Agents sleeping for room (the rank wakes them on release).
    room_waiters: AtomicU32,
    published: AtomicU64,
    published_bytes: AtomicU64,
    wakes: AtomicU64,
    sleeps: AtomicU64,
    errors_dropped: AtomicU64,
}

/// Line 2: written by the rank only.
#[repr(C, align(64))]
struct RankBlock {
    release: AtomicU64,
    heartbeat_ns: AtomicU64,
    pid: AtomicU32,
    state: AtomicU32,
    /// Bumped (then FUTEX_WAKE) after a release when the agent sleeps.
    room_futex: AtomicU32,
    /// Ranks sleeping for a batch (the agent wakes them on publish).
    ready_waiters: AtomicU32,
    taken: AtomicU64,
    wakes: AtomicU64,
    sleeps: AtomicU64,
    errors_dropped: AtomicU64,
}

/// One posted error: 256 bytes.
#[repr(C, align(64))]
struct ErrorSlot {
    /// 0 empty, 1 being written, 2 posted.
    state: AtomicU32,
    side: AtomicU32,
    class: AtomicU32,
    message_len: AtomicU32,
    kind: [AtomicU8; ERROR_KIND_BYTES],
    message: [AtomicU8; ERROR_MESSAGE_BYTES],
}

/// One batch slot: the ready word and where the batch lies in the ring.
#[repr(C, align(64))]
struct Slot {
    ready: AtomicU64,
    ring_offset: AtomicU64,
    bytes: AtomicU64,
    epoch: AtomicU64,
    batch_in_epoch: AtomicU64,
    samples: AtomicU64,
    _reserved: [AtomicU64; 2],
}

const HEADER_OFFSET: usize = 0;
const AGENT_OFFSET: usize = 64;
const RANK_OFFSET: usize = 128;
const ERRORS_OFFSET: usize = 192;
const SLOTS_OFFSET: usize = ERRORS_OFFSET + ERROR_SLOTS * std::mem::size_of::<ErrorSlot>();

// The documented offsets (docs/AGENT.md): a change here is a layout change.
const _: () = {
    assert!(std::mem::size_of::<Header>() == 64);
    assert!(std::mem::size_of::<AgentBlock>() == 64);
    assert!(std::mem::size_of::<RankBlock>() == 64);
    assert!(std::mem::size_of::<ErrorSlot>() == 256);
    assert!(std::mem::size_of::<Slot>() == 64);
    assert!(SLOTS_OFFSET == 192 + 1024);
    use std::mem::offset_of;
    assert!(offset_of!(Header, generation) == 40 && offset_of!(Header, rank_pid) == 44);
    assert!(
        offset_of!(AgentBlock, ready_futex) == 16 && offset_of!(AgentBlock, room_waiters) == 20
    );
    assert!(
        offset_of!(AgentBlock, published) == 24 && offset_of!(AgentBlock, errors_dropped) == 56
    );
    assert!(offset_of!(RankBlock, room_futex) == 24 && offset_of!(RankBlock, ready_waiters) == 28);
    assert!(offset_of!(RankBlock, taken) == 32 && offset_of!(RankBlock, errors_dropped) == 56);
    assert!(offset_of!(ErrorSlot, kind) == 16 && offset_of!(ErrorSlot, message) == 48);
    assert!(offset_of!(Slot, samples) == 40);
};

/// Bytes of a segment with `slots` batch slots (before page rounding).
pub fn segment_bytes(slots: u32) -> u64 {
    (SLOTS_OFFSET + slots as usize * std::mem::size_of::<Slot>()) as u64
}

/// Where one published batch lies in the ring, and what it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct BatchDesc {
    /// Offset of the batch's first byte in the ring.
    pub ring_offset: u64,
    /// The batch's bytes (its samples and their offset table, as the
    /// agent lays them out).
    pub bytes: u64,
    /// The sampler epoch it belongs to.
    pub epoch: u64,
    /// Its index within the epoch.
    pub batch_in_epoch: u64,
    /// Samples in it.
    pub samples: u64,
}

/// An error a side posted in the segment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PostedError {
    /// Who posted it.
    pub side: Side,
    /// The error's kind name ([`Error::kind_name`]).
    pub kind: String,
    /// Its message (cut to [`ERROR_MESSAGE_BYTES`]).
    pub message: String,
}

/// Counters of both sides (each written by one side only).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SegmentStats {
    /// Batches the agent published in this generation.
    pub published: u64,
    /// Bytes of those batches.
    pub published_bytes: u64,
    /// Futex wakes the agent sent (the rank was asleep).
    pub agent_wakes: u64,
    /// Times the agent slept for room.
    pub agent_sleeps: u64,
    /// Batches the rank took.
    pub taken: u64,
    /// Futex wakes the rank sent (the agent was asleep).
    pub rank_wakes: u64,
    /// Times the rank slept for a batch.
    pub rank_sleeps: u64,
}

fn seg_err(what: impl Into<String>) -> Error {
    Error::AttachSegment { what: what.into() }
}

fn io_err(op: &'static str, what: &str, e: std::io::Error) -> Error {
    Error::io(op, format!("<{what}>"), e)
}

/// Creates a sealed memfd of `bytes` (rounded up to a page): it can grow
/// no more and never shrink, so a peer mapping it can trust its size.
fn sealed_memfd(name: &std::ffi::CStr, bytes: u64) -> Result<File> {
    // SAFETY: memfd_create reads the NUL-terminated name and returns a new
    // descriptor or -1; it touches no memory of ours otherwise.
    let fd =
        unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    if fd < 0 {
        return Err(io_err(
            "memfd_create",
            "attach",
            std::io::Error::last_os_error(),
        ));
    }
    // SAFETY: fd is a fresh descriptor nothing else owns.
    let file = File::from(unsafe { OwnedFd::from_raw_fd(fd) });
    let page = 4096u64;
    let len = bytes.div_ceil(page) * page;
    file.set_len(len)
        .map_err(|e| io_err("ftruncate", "attach memfd", e))?;
    let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
    // SAFETY: fcntl on a descriptor we own with an integer argument.
    if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, seals) } != 0 {
        return Err(io_err(
            "F_ADD_SEALS",
            "attach memfd",
            std::io::Error::last_os_error(),
        ));
    }
    Ok(file)
}

/// Checks that `file` is a memfd sealed against shrinking and at least
/// `need` bytes long: what makes mapping a peer's memory safe.
fn check_sealed(file: &File, need: u64, what: &str) -> Result<()> {
    // SAFETY: fcntl F_GET_SEALS on a descriptor we own; no pointer.
    let seals = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GET_SEALS) };
    if seals < 0 || seals & libc::F_SEAL_SHRINK == 0 {
        return Err(seg_err(format!(
            "the {what} is not a memfd sealed against shrinking (seals {seals:#x}); a peer could truncate it under the mapping"
        )));
    }
    let len = file.metadata().map_err(|e| io_err("fstat", what, e))?.len();
    if len < need {
        return Err(seg_err(format!("the {what} is {len} bytes, needs {need}")));
    }
    Ok(())
}

/// The shared mapping of an attach segment. The slot count and ring size
/// are the values checked at open, kept here (never re-read from the
/// shared memory).
pub struct Segment {
    map: MmapRaw,
    file: File,
    slots: u32,
    ring_bytes: u64,
}

// SAFETY: the mapping holds only atomics and is reached only through
// shared references to them; the raw pointer is valid for the struct's
// life on any thread.
unsafe impl Send for Segment {}
// SAFETY: as above: every access is an atomic operation.
unsafe impl Sync for Segment {}

impl std::fmt::Debug for Segment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Segment")
            .field("slots", &self.slots)
            .field("ring_bytes", &self.ring_bytes)
            .finish()
    }
}

impl Segment {
    /// Creates a segment (the rank's side): a sealed memfd with `slots`
    /// batch slots (a power of two, 1..=[`MAX_SLOTS`]) for a ring of
    /// `ring_bytes`, in generation [`Generation::FIRST`]. The magic is
    /// stored last (Release), so a peer never accepts a half-written header.
    pub fn create(slots: u32, ring_bytes: u64) -> Result<Segment> {
        if slots == 0 || slots > MAX_SLOTS || !slots.is_power_of_two() {
            return Err(Error::InvalidConfig(format!(
                "attach segment slots {slots}: must be a power of two from 1 to {MAX_SLOTS}"
            )));
        }
        let total = segment_bytes(slots);
        let file = sealed_memfd(c"kspeed-attach-segment", total)?;
        let map = MmapRaw::map_raw(&file).map_err(|e| io_err("mmap", "attach segment", e))?;
        let seg = Segment {
            map,
            file,
            slots,
            ring_bytes,
        };
        let h = seg.header();
        h.version.store(SEGMENT_VERSION, Ordering::Relaxed);
        h.header_bytes.store(64, Ordering::Relaxed);
        h.total_bytes.store(total, Ordering::Relaxed);
        h.slots.store(slots, Ordering::Relaxed);
        h.error_slots.store(ERROR_SLOTS as u32, Ordering::Relaxed);
        h.ring_bytes.store(ring_bytes, Ordering::Relaxed);
        h.generation
            .store(u32::from(Generation::FIRST.get()), Ordering::Relaxed);
        h.rank_pid.store(std::process::id(), Ordering::Relaxed);
        seg.rank()
            .release
            .store(release_mark(Generation::FIRST, 0), Ordering::Relaxed);
        h.magic.store(SEGMENT_MAGIC, Ordering::Release);
        Ok(seg)
    }

    /// Maps a segment a peer passed (the agent's side) and checks it:
    /// sealed memfd, magic, version, header size, slot count, total size
    /// and the ring size the ATTACH message announced.
    pub fn open(fd: OwnedFd, expect_ring_bytes: u64) -> Result<Segment> {
        let file = File::from(fd);
        check_sealed(&file, segment_bytes(1), "attach segment")?;
        let map = MmapRaw::map_raw(&file).map_err(|e| io_err("mmap", "attach segment", e))?;
        let mapped = map.len() as u64;
        // Read the header through a provisional view over the checked
        // minimum size (one slot) before trusting the slot count.
        let seg = Segment {
            map,
            file,
            slots: 1,
            ring_bytes: 0,
        };
        let h = seg.header();
        let magic = h.magic.load(Ordering::Acquire);
        if magic != SEGMENT_MAGIC {
            return Err(seg_err(format!(
                "magic {:02x?}, expected {:02x?} (\"KSPATSEG\")",
                magic.to_le_bytes(),
                SEGMENT_MAGIC.to_le_bytes()
            )));
        }
        let version = h.version.load(Ordering::Relaxed);
        if version != SEGMENT_VERSION {
            return Err(seg_err(format!(
                "layout version {version}, this build reads version {SEGMENT_VERSION}"
            )));
        }
        let header_bytes = h.header_bytes.load(Ordering::Relaxed);
        let error_slots = h.error_slots.load(Ordering::Relaxed);
        if header_bytes != 64 || error_slots != ERROR_SLOTS as u32 {
            return Err(seg_err(format!(
                "header of {header_bytes} bytes with {error_slots} error slots; version {SEGMENT_VERSION} has 64 and {ERROR_SLOTS}"
            )));
        }
        let slots = h.slots.load(Ordering::Relaxed);
        if slots == 0 || slots > MAX_SLOTS || !slots.is_power_of_two() {
            return Err(seg_err(format!(
                "{slots} slots: must be a power of two from 1 to {MAX_SLOTS}"
            )));
        }
        let total = h.total_bytes.load(Ordering::Relaxed);
        if total != segment_bytes(slots) || mapped < total {
            return Err(seg_err(format!(
                "total size {total} bytes (mapped {mapped}); {slots} slots need {}",
                segment_bytes(slots)
            )));
        }
        let ring_bytes = h.ring_bytes.load(Ordering::Relaxed);
        if ring_bytes != expect_ring_bytes {
            return Err(seg_err(format!(
                "ring of {ring_bytes} bytes, the ATTACH message says {expect_ring_bytes}"
            )));
        }
        Ok(Segment {
            slots,
            ring_bytes,
            ..seg
        })
    }

    /// The memfd, to pass to the agent.
    pub fn fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.file.as_fd()
    }

    /// Batch slots.
    pub fn slots(&self) -> u32 {
        self.slots
    }

    /// The ring's bytes, as the segment records it.
    pub fn ring_bytes(&self) -> u64 {
        self.ring_bytes
    }

    /// The generation the rank set in the header (for the agent to check
    /// against the ATTACH message).
    pub fn generation(&self) -> Option<Generation> {
        Generation::new(self.header().generation.load(Ordering::Acquire) as u16)
    }

    /// The rank's side starts a new generation (re-attach): the slots and
    /// the release mark of the old one count as nothing in the new.
    /// Call only while no agent is attached.
    pub fn begin_generation(&self) -> Generation {
        let old = self.generation().unwrap_or(Generation::FIRST);
        let gen = old.next();
        let r = self.rank();
        r.release.store(release_mark(gen, 0), Ordering::Relaxed);
        r.state.store(side_state::NONE, Ordering::Relaxed);
        self.agent()
            .state
            .store(side_state::NONE, Ordering::Relaxed);
        self.header()
            .generation
            .store(u32::from(gen.get()), Ordering::Release);
        gen
    }

    /// Both sides' counters.
    pub fn stats(&self) -> SegmentStats {
        let (a, r) = (self.agent(), self.rank());
        SegmentStats {
            published: a.published.load(Ordering::Relaxed),
            published_bytes: a.published_bytes.load(Ordering::Relaxed),
            agent_wakes: a.wakes.load(Ordering::Relaxed),
            agent_sleeps: a.sleeps.load(Ordering::Relaxed),
            taken: r.taken.load(Ordering::Relaxed),
            rank_wakes: r.wakes.load(Ordering::Relaxed),
            rank_sleeps: r.sleeps.load(Ordering::Relaxed),
        }
    }

    /// The errors posted so far (either side), in slot order.
    pub fn posted_errors(&self) -> Vec<PostedError> {
        let mut out = Vec::new();
        for i in 0..ERROR_SLOTS {
            let e = self.error_slot(i);
            if e.state.load(Ordering::Acquire) != 2 {
                continue;
            }
            let side = if e.side.load(Ordering::Relaxed) == Side::Agent.code() {
                Side::Agent
            } else {
                Side::Rank
            };
            let bytes = |a: &[AtomicU8], n: usize| -> String {
                let v: Vec<u8> = a[..n.min(a.len())]
                    .iter()
                    .map(|b| b.load(Ordering::Relaxed))
                    .collect();
                String::from_utf8_lossy(&v).into_owned()
            };
            let kind_len = e.kind.iter().position(|b| b.load(Ordering::Relaxed) == 0);
            out.push(PostedError {
                side,
                kind: bytes(&e.kind, kind_len.unwrap_or(ERROR_KIND_BYTES)),
                message: bytes(&e.message, e.message_len.load(Ordering::Relaxed) as usize),
            });
        }
        out
    }

    /// Posts `err` in the first free error slot and marks `side` failed,
    /// so the peer's waits end with [`Error::AttachPeerError`]. With every
    /// slot taken the error is only counted.
    pub fn post_error(&self, side: Side, err: &Error) {
        let state = match side {
            Side::Agent => &self.agent().state,
            Side::Rank => &self.rank().state,
        };
        let mut stored = false;
        for i in 0..ERROR_SLOTS {
            let e = self.error_slot(i);
            if e.state
                .compare_exchange(0, 1, Ordering::Acquire, Ordering::Relaxed)
                .is_err()
            {
                continue;
            }
            e.side.store(side.code(), Ordering::Relaxed);
            e.class.store(err.class() as u32, Ordering::Relaxed);
            let kind = err.kind_name().as_bytes();
            for (j, b) in e.kind.iter().enumerate() {
                b.store(kind.get(j).copied().unwrap_or(0), Ordering::Relaxed);
            }
            let msg = err.to_string();
            let mut n = msg.len().min(ERROR_MESSAGE_BYTES);
            while !msg.is_char_boundary(n) {
                n -= 1;
            }
            for (j, b) in msg.as_bytes()[..n].iter().enumerate() {
                e.message[j].store(*b, Ordering::Relaxed);
            }
            e.message_len.store(n as u32, Ordering::Relaxed);
            e.state.store(2, Ordering::Release);
            stored = true;
            break;
        }
        if !stored {
            let dropped = match side {
                Side::Agent => &self.agent().errors_dropped,
                Side::Rank => &self.rank().errors_dropped,
            };
            dropped.fetch_add(1, Ordering::Relaxed);
        }
        state.store(side_state::FAILED, Ordering::Release);
        // Wake whoever may sleep on the other side so it sees the failure
        // now rather than at its next heartbeat check.
        self.agent().ready_futex.fetch_add(1, Ordering::Release);
        futex_wake_all(&self.agent().ready_futex);
        self.rank().room_futex.fetch_add(1, Ordering::Release);
        futex_wake_all(&self.rank().room_futex);
    }

    fn word<T>(&self, offset: usize) -> &T {
        assert!(offset + std::mem::size_of::<T>() <= self.map.len());
        // SAFETY: the offset is in bounds (checked above) and aligned (the
        // mapping is page-aligned and every offset is a multiple of 64);
        // the memory holds only atomics, valid for any bit pattern, shared
        // through `&` for the mapping's life, which `&self` bounds.
        unsafe { &*(self.map.as_ptr().add(offset) as *const T) }
    }
    fn header(&self) -> &Header {
        self.word(HEADER_OFFSET)
    }
    fn agent(&self) -> &AgentBlock {
        self.word(AGENT_OFFSET)
    }
    fn rank(&self) -> &RankBlock {
        self.word(RANK_OFFSET)
    }
    fn error_slot(&self, i: usize) -> &ErrorSlot {
        assert!(i < ERROR_SLOTS);
        self.word(ERRORS_OFFSET + i * std::mem::size_of::<ErrorSlot>())
    }
    fn slot(&self, seq: u64) -> &Slot {
        let i = (seq & u64::from(self.slots - 1)) as usize;
        self.word(SLOTS_OFFSET + i * std::mem::size_of::<Slot>())
    }

    /// How long a peer has been silent and what state it says it is in.
    fn peer(&self, peer: Side) -> (u32, u32, u64) {
        let (hb, pid, state) = match peer {
            Side::Agent => (
                &self.agent().heartbeat_ns,
                &self.agent().pid,
                &self.agent().state,
            ),
            Side::Rank => (
                &self.rank().heartbeat_ns,
                &self.rank().pid,
                &self.rank().state,
            ),
        };
        let last = hb.load(Ordering::Acquire);
        (
            state.load(Ordering::Acquire),
            pid.load(Ordering::Relaxed),
            monotonic_ns().saturating_sub(last),
        )
    }
}

/// How a side waits: how long one futex sleep lasts at most (it beats its
/// own heartbeat and checks the peer's between sleeps) and how long the
/// peer may be silent before it counts as gone.
#[derive(Debug, Clone, Copy)]
pub struct Liveness {
    /// One futex sleep at most (also the heartbeat period while waiting).
    pub slice: Duration,
    /// The peer is gone after this long without a heartbeat (3 of its
    /// heartbeat periods).
    pub silence_limit: Duration,
}

impl Default for Liveness {
    fn default() -> Self {
        Liveness {
            slice: Duration::from_millis(100),
            silence_limit: Duration::from_millis(300),
        }
    }
}

/// Spins before a side goes to sleep: a batch that is microseconds away
/// is taken without a system call.
const SPINS_BEFORE_SLEEP: u32 = 200;

/// The common wait loop: returns when `ready()` holds; sleeps on `futex`
/// with `waiters` counted; between sleeps beats `me`, runs `check` and
/// checks the peer.
#[allow(clippy::too_many_arguments)]
fn wait_until(
    seg: &Segment,
    me: Side,
    futex: &AtomicU32,
    waiters: &AtomicU32,
    sleeps: &AtomicU64,
    timeouts: &Cell<u64>,
    live: &Liveness,
    deadline: Option<Instant>,
    check: &mut dyn FnMut() -> Result<()>,
    ready: &mut dyn FnMut() -> bool,
) -> Result<()> {
    for _ in 0..SPINS_BEFORE_SLEEP {
        if ready() {
            return Ok(());
        }
        std::hint::spin_loop();
    }
    let peer = match me {
        Side::Agent => Side::Rank,
        Side::Rank => Side::Agent,
    };
    loop {
        seg.beat(me);
        let (state, pid, silent_ns) = seg.peer(peer);
        // A failure or a close ends the wait even when data is ahead of
        // it: the peer's error is the answer.
        if state == side_state::FAILED {
            let posted = seg.posted_errors().into_iter().find(|e| e.side == peer);
            let (kind, message) = posted.map_or((String::from("unknown"), String::new()), |e| {
                (e.kind, e.message)
            });
            return Err(Error::AttachPeerError {
                peer: peer.name(),
                kind,
                message,
            });
        }
        if ready() {
            return Ok(());
        }
        if state == side_state::CLOSED {
            return Err(Error::AttachPeerGone {
                peer: peer.name(),
                pid,
                silent_ms: 0,
                closed: true,
            });
        }
        if silent_ns > live.silence_limit.as_nanos() as u64 {
            return Err(Error::AttachPeerGone {
                peer: peer.name(),
                pid,
                silent_ms: silent_ns / 1_000_000,
                closed: false,
            });
        }
        check()?;
        let mut slice = live.slice;
        if let Some(d) = deadline {
            let now = Instant::now();
            if now >= d {
                return Err(Error::AttachTimeout {
                    what: match me {
                        Side::Rank => "a ready batch",
                        Side::Agent => "room in the ring",
                    },
                    waited_ms: 0,
                });
            }
            slice = slice.min(d - now);
        }
        // Dekker with the publisher: count ourselves as a waiter, read
        // the futex word, then (after a SeqCst fence, paired with the
        // publisher's fence between its store and its load of `waiters`)
        // re-check. Either the publisher sees us waiting and bumps the
        // word (so the futex wait returns), or we see its store.
        waiters.fetch_add(1, Ordering::SeqCst);
        let seen = futex.load(Ordering::SeqCst);
        fence(Ordering::SeqCst);
        if ready() {
            waiters.fetch_sub(1, Ordering::SeqCst);
            return Ok(());
        }
        sleeps.store(sleeps.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
        if futex_wait(futex, seen, slice) {
            timeouts.set(timeouts.get() + 1);
        }
        waiters.fetch_sub(1, Ordering::SeqCst);
        if ready() {
            return Ok(());
        }
    }
}

/// The agent's view of one attached rank's segment.
#[derive(Debug)]
pub struct AgentSide {
    seg: Segment,
    gen: Generation,
    /// Batches published (mod 2^48 on the wire; a u64 here).
    published: u64,
    /// Sleeps that lasted their whole slice (no wake came).
    sleep_timeouts: Cell<u64>,
}

impl AgentSide {
    /// Starts publishing into `seg` in generation `gen` (from the ATTACH
    /// message; refused when the header says otherwise).
    pub fn new(seg: Segment, gen: Generation) -> Result<AgentSide> {
        if seg.generation() != Some(gen) {
            return Err(seg_err(format!(
                "the header's generation is {:?}, the ATTACH message says {}",
                seg.generation().map(|g| g.get()),
                gen.get()
            )));
        }
        let a = seg.agent();
        a.published.store(0, Ordering::Relaxed);
        a.published_bytes.store(0, Ordering::Relaxed);
        a.pid.store(std::process::id(), Ordering::Relaxed);
        seg.beat(Side::Agent);
        a.state.store(side_state::RUNNING, Ordering::Release);
        Ok(AgentSide {
            seg,
            gen,
            published: 0,
            sleep_timeouts: Cell::new(0),
        })
    }

    /// The segment.
    pub fn segment(&self) -> &Segment {
        &self.seg
    }

    /// The next sequence to publish.
    pub fn published(&self) -> u64 {
        self.published
    }

    /// Sleeps of this side that lasted their whole slice: no wake came
    /// (the peer was slower than a slice, or a wake was lost).
    pub fn sleep_timeouts(&self) -> u64 {
        self.sleep_timeouts.get()
    }

    /// Batches the rank has released, checked: a mark of this generation
    /// that is not past what was published.
    pub fn released(&self) -> Result<u64> {
        let mark = self.seg.rank().release.load(Ordering::Acquire);
        let Some(rel) = decode_release(mark, self.gen) else {
            // A mark of an earlier generation: nothing released in this one.
            return Ok(0);
        };
        let flight = in_flight(self.published, rel);
        if flight > u64::from(self.seg.slots) {
            return Err(seg_err(format!(
                "the rank's release mark {rel} is not within the {} slots below the {} batches published",
                self.seg.slots, self.published
            )));
        }
        Ok(self.published - flight)
    }

    /// Whether the slot for the next batch is free (no system call).
    pub fn has_room(&self) -> Result<bool> {
        Ok(self.published - self.released()? < u64::from(self.seg.slots))
    }

    /// Waits until the next batch's slot is free: spins, then sleeps on
    /// the room futex; between sleeps beats and checks the rank's
    /// heartbeat and runs `check` (e.g. the socket's hang-up).
    pub fn wait_room(
        &self,
        live: &Liveness,
        deadline: Option<Instant>,
        check: &mut dyn FnMut() -> Result<()>,
    ) -> Result<()> {
        let mut err = None;
        let mut ready = || match self.has_room() {
            Ok(r) => r,
            Err(e) => {
                err = Some(e);
                true
            }
        };
        let r = self.seg.rank();
        let a = self.seg.agent();
        wait_until(
            &self.seg,
            Side::Agent,
            &r.room_futex,
            &a.room_waiters,
            &a.sleeps,
            &self.sleep_timeouts,
            live,
            deadline,
            check,
            &mut ready,
        )?;
        err.map_or(Ok(()), Err)
    }

    /// Publishes the next batch: its descriptor (Relaxed), then its ready
    /// word (Release: the ring bytes and the descriptor are visible to a
    /// rank that Acquires the word), then wakes the rank if it sleeps.
    /// The slot must be free ([`AgentSide::has_room`]); publishing over an
    /// unreleased batch is a bug and panics.
    pub fn publish(&mut self, desc: &BatchDesc) -> Result<u64> {
        assert!(self.has_room()?, "publish without room: a bug in the agent");
        let seq = self.published;
        let s = self.seg.slot(seq);
        s.ring_offset.store(desc.ring_offset, Ordering::Relaxed);
        s.bytes.store(desc.bytes, Ordering::Relaxed);
        s.epoch.store(desc.epoch, Ordering::Relaxed);
        s.batch_in_epoch
            .store(desc.batch_in_epoch, Ordering::Relaxed);
        s.samples.store(desc.samples, Ordering::Relaxed);
        s.ready.store(ready_word(self.gen, seq), Ordering::Release);
        self.published = seq + 1;
        let a = self.seg.agent();
        a.published.store(self.published, Ordering::Relaxed);
        a.published_bytes.store(
            a.published_bytes.load(Ordering::Relaxed) + desc.bytes,
            Ordering::Relaxed,
        );
        // The store-load half of the Dekker pair (see wait_until).
        fence(Ordering::SeqCst);
        if self.seg.rank().ready_waiters.load(Ordering::Relaxed) > 0 {
            a.ready_futex.fetch_add(1, Ordering::SeqCst);
            futex_wake_all(&a.ready_futex);
            a.wakes
                .store(a.wakes.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
        }
        Ok(seq)
    }

    /// Records the agent's heartbeat (CLOCK_MONOTONIC ns).
    pub fn beat(&self) {
        self.seg.beat(Side::Agent);
    }

    /// Marks the agent's side closed (a clean detach): the rank's waits
    /// end with [`Error::AttachPeerGone`] `closed: true`.
    pub fn close(&self) {
        self.seg.close(Side::Agent);
    }
}

/// The rank's view of its own segment.
#[derive(Debug)]
pub struct RankSide {
    seg: Segment,
    gen: Generation,
    /// The next batch to take.
    taken: u64,
    /// Batches released.
    released: u64,
    /// Sleeps that lasted their whole slice (no wake came).
    sleep_timeouts: Cell<u64>,
}

impl RankSide {
    /// Starts taking batches from `seg` in its current generation, from
    /// sequence 0.
    pub fn new(seg: Segment) -> Result<RankSide> {
        let gen = seg
            .generation()
            .ok_or_else(|| seg_err("generation 0 in the header"))?;
        let r = seg.rank();
        r.release.store(release_mark(gen, 0), Ordering::Release);
        r.taken.store(0, Ordering::Relaxed);
        r.pid.store(std::process::id(), Ordering::Relaxed);
        seg.beat(Side::Rank);
        r.state.store(side_state::RUNNING, Ordering::Release);
        Ok(RankSide {
            seg,
            gen,
            taken: 0,
            released: 0,
            sleep_timeouts: Cell::new(0),
        })
    }

    /// The segment.
    pub fn segment(&self) -> &Segment {
        &self.seg
    }

    /// The generation.
    pub fn generation(&self) -> Generation {
        self.gen
    }

    /// Batches taken so far (the next one's sequence).
    pub fn taken(&self) -> u64 {
        self.taken
    }

    /// Sleeps of this side that lasted their whole slice: no wake came
    /// (the peer was slower than a slice, or a wake was lost).
    pub fn sleep_timeouts(&self) -> u64 {
        self.sleep_timeouts.get()
    }

    /// The next batch's descriptor if it is ready (one Acquire load; no
    /// system call); it is then taken.
    pub fn try_take(&mut self) -> Option<BatchDesc> {
        let s = self.seg.slot(self.taken);
        if !is_ready(s.ready.load(Ordering::Acquire), self.gen, self.taken) {
            return None;
        }
        let d = BatchDesc {
            ring_offset: s.ring_offset.load(Ordering::Relaxed),
            bytes: s.bytes.load(Ordering::Relaxed),
            epoch: s.epoch.load(Ordering::Relaxed),
            batch_in_epoch: s.batch_in_epoch.load(Ordering::Relaxed),
            samples: s.samples.load(Ordering::Relaxed),
        };
        self.taken += 1;
        let r = self.seg.rank();
        r.taken.store(self.taken, Ordering::Relaxed);
        Some(d)
    }

    /// Waits for the next batch: spins, then sleeps on the ready futex;
    /// between sleeps beats, checks the agent's heartbeat and state, and
    /// runs `check`.
    pub fn wait_take(
        &mut self,
        live: &Liveness,
        deadline: Option<Instant>,
        check: &mut dyn FnMut() -> Result<()>,
    ) -> Result<BatchDesc> {
        if let Some(d) = self.try_take() {
            return Ok(d);
        }
        let (gen, seq) = (self.gen, self.taken);
        let slot = self.seg.slot(seq);
        let mut ready = || is_ready(slot.ready.load(Ordering::Acquire), gen, seq);
        let (a, r) = (self.seg.agent(), self.seg.rank());
        wait_until(
            &self.seg,
            Side::Rank,
            &a.ready_futex,
            &r.ready_waiters,
            &r.sleeps,
            &self.sleep_timeouts,
            live,
            deadline,
            check,
            &mut ready,
        )?;
        Ok(self
            .try_take()
            .expect("a ready word seen stays until released"))
    }

    /// Releases every batch below `count` (taken ones only, in order):
    /// one Release store of the mark, then wakes the agent if it sleeps.
    pub fn release(&mut self, count: u64) {
        assert!(
            count >= self.released && count <= self.taken,
            "release {count}: released {} taken {} (a bug in the loader)",
            self.released,
            self.taken
        );
        self.released = count;
        let r = self.seg.rank();
        r.release
            .store(release_mark(self.gen, count), Ordering::Release);
        fence(Ordering::SeqCst);
        if self.seg.agent().room_waiters.load(Ordering::Relaxed) > 0 {
            r.room_futex.fetch_add(1, Ordering::SeqCst);
            futex_wake_all(&r.room_futex);
            r.wakes
                .store(r.wakes.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
        }
    }

    /// Records the rank's heartbeat (CLOCK_MONOTONIC ns).
    pub fn beat(&self) {
        self.seg.beat(Side::Rank);
    }

    /// Marks the rank's side closed (a clean detach).
    pub fn close(&self) {
        self.seg.close(Side::Rank);
    }

    /// Gives the segment back (to begin a new generation and re-attach).
    pub fn into_segment(self) -> Segment {
        self.seg
    }
}

impl Segment {
    fn beat(&self, side: Side) {
        let hb = match side {
            Side::Agent => &self.agent().heartbeat_ns,
            Side::Rank => &self.rank().heartbeat_ns,
        };
        hb.store(monotonic_ns(), Ordering::Release);
    }

    fn close(&self, side: Side) {
        match side {
            Side::Agent => self
                .agent()
                .state
                .store(side_state::CLOSED, Ordering::Release),
            Side::Rank => self
                .rank()
                .state
                .store(side_state::CLOSED, Ordering::Release),
        }
        self.agent().ready_futex.fetch_add(1, Ordering::Release);
        futex_wake_all(&self.agent().ready_futex);
        self.rank().room_futex.fetch_add(1, Ordering::Release);
        futex_wake_all(&self.rank().room_futex);
    }
}

/// The landing ring as a shared mapping (a sealed memfd).
pub struct RingMap {
    map: MmapRaw,
    file: File,
}

// SAFETY: the mapping is plain shared memory reached through raw-pointer
// copies (`write_at`/`read_at`) or `unsafe` slices whose callers follow
// the ready/release protocol.
unsafe impl Send for RingMap {}
// SAFETY: as above.
unsafe impl Sync for RingMap {}

impl std::fmt::Debug for RingMap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RingMap")
            .field("bytes", &self.len())
            .finish()
    }
}

impl RingMap {
    /// Creates a ring of `bytes` (rounded up to a page) as a sealed memfd.
    pub fn create(bytes: u64) -> Result<RingMap> {
        let file = sealed_memfd(c"kspeed-attach-ring", bytes)?;
        let map = MmapRaw::map_raw(&file).map_err(|e| io_err("mmap", "attach ring", e))?;
        Ok(RingMap { map, file })
    }

    /// Maps a ring a peer passed, checking it is a sealed memfd of at
    /// least `bytes`.
    pub fn open(fd: OwnedFd, bytes: u64) -> Result<RingMap> {
        let file = File::from(fd);
        check_sealed(&file, bytes, "attach ring")?;
        let map = MmapRaw::map_raw(&file).map_err(|e| io_err("mmap", "attach ring", e))?;
        Ok(RingMap { map, file })
    }

    /// The memfd, to pass to the agent.
    pub fn fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.file.as_fd()
    }

    /// The mapped bytes.
    pub fn len(&self) -> u64 {
        self.map.len() as u64
    }

    /// Whether the ring is empty (never, once created).
    pub fn is_empty(&self) -> bool {
        self.map.len() == 0
    }

    fn check(&self, offset: u64, len: usize) {
        assert!(
            offset
                .checked_add(len as u64)
                .is_some_and(|e| e <= self.len()),
            "ring access {offset}+{len} past {} bytes",
            self.len()
        );
    }

    /// Copies `data` into the ring at `offset` (the agent's side, into a
    /// slot the rank released).
    pub fn write_at(&self, offset: u64, data: &[u8]) {
        self.check(offset, data.len());
        // SAFETY: in bounds (checked); the destination is shared memory no
        // Rust reference of this process covers while the slot is free; a
        // peer breaking the protocol can only see torn bytes.
        unsafe {
            std::ptr::copy_nonoverlapping(
                data.as_ptr(),
                self.map.as_mut_ptr().add(offset as usize),
                data.len(),
            );
        }
    }

    /// A view of `len` bytes at `offset` (the rank's side, a batch taken
    /// and not yet released).
    ///
    /// # Safety
    /// The bytes must belong to a batch this side took and has not
    /// released, so the agent does not write them while the view lives.
    pub unsafe fn slice(&self, offset: u64, len: usize) -> &[u8] {
        self.check(offset, len);
        // SAFETY: in bounds (checked); the caller guarantees no writer for
        // the view's life; the mapping outlives `&self`.
        unsafe { std::slice::from_raw_parts(self.map.as_ptr().add(offset as usize), len) }
    }
}

/// FUTEX_WAIT on a word in shared memory (not _PRIVATE: the key must be
/// the page, not this process's address), for at most `timeout`; true
/// when it slept the whole timeout (no wake came).
fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) -> bool {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: the word is a live, aligned u32 in a mapping `&word` keeps
    // alive; the timespec outlives the call; FUTEX_WAIT only reads both.
    // EAGAIN, EINTR and ETIMEDOUT are all fine: callers re-check.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
        )
    };
    rc != 0 && io_errno() == libc::ETIMEDOUT
}

fn io_errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

/// FUTEX_WAKE of every sleeper on a shared word (one rank thread and one
/// agent thread at most per word, but waking all costs nothing more).
fn futex_wake_all(word: &AtomicU32) {
    // SAFETY: FUTEX_WAKE uses the address only as a key; the word is live.
    unsafe {
        libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE, i32::MAX);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_offsets_are_the_documented_ones() {
        assert_eq!(segment_bytes(1), 1216 + 64);
        assert_eq!(segment_bytes(16), 1216 + 16 * 64);
    }

    #[test]
    fn open_checks_magic_version_and_seals() {
        let seg = Segment::create(8, 1 << 20).unwrap();
        let dup = || seg.fd().try_clone_to_owned().unwrap();
        Segment::open(dup(), 1 << 20).unwrap();
        assert!(matches!(
            Segment::open(dup(), 1 << 21),
            Err(Error::AttachSegment { .. })
        ));
        seg.header().version.store(2, Ordering::Relaxed);
        let e = Segment::open(dup(), 1 << 20).unwrap_err();
        assert!(e.to_string().contains("layout version 2"), "{e}");
        seg.header().version.store(1, Ordering::Relaxed);
        seg.header().magic.store(7, Ordering::Relaxed);
        let e = Segment::open(dup(), 1 << 20).unwrap_err();
        assert!(e.to_string().contains("magic"), "{e}");
        // A plain file is not a sealed memfd.
        let f = tempfile::tempfile().unwrap();
        f.set_len(1 << 16).unwrap();
        let e = Segment::open(OwnedFd::from(f), 1 << 20).unwrap_err();
        assert!(e.to_string().contains("sealed"), "{e}");
    }
}
