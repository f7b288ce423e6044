//! The attach segment: the small shared mapping through which an attached
//! rank and the node's agent exchange, per batch, only a ready word and a
//! release mark (docs/AGENT.md, "The attach segment").
//!
//! The rank creates the segment and its landing ring as sealed memfds
//! ([`Segment::create`], [`RingMap::create`](super::shm::RingMap::create)) and passes both to the agent
//! over the attach socket ([`super::attach`]); the agent maps them with
//! [`Segment::open`] / [`RingMap::open`](super::shm::RingMap::open), which check the layout (magic,
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
//! Why this file is over ~800 lines: the layout, its compile-time offset
//! checks and the segment's whole life (create, open and check, errors,
//! heartbeats, generations) belong together with the unit tests that pin
//! the documented bytes; the two sides' protocol is `segment/sides.rs`.
//!
//! This module forms references to the atomics of a shared mapping, so
//! it is one of the few allowed `unsafe`; the mapping, memfds and futexes
//! themselves are `super::shm`'s.

use std::fs::File;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicU16, AtomicU32, AtomicU64, AtomicU8, Ordering};

use memmap2::MmapRaw;

use super::shm::{check_sealed, futex_wake_all, io_err, monotonic_ns, sealed_memfd};
use crate::error::{Error, Result};

mod sides;
pub use sides::{AgentSide, Liveness, RankSide};

#[cfg(not(target_endian = "little"))]
compile_error!("the attach segment and messages are little-endian; kspeed builds only on little-endian targets");

/// The segment's magic: the bytes `KSPATSEG` read as a little-endian u64.
pub const SEGMENT_MAGIC: u64 = u64::from_le_bytes(*b"KSPATSEG");
/// The newest segment layout this build writes and reads (bump on any
/// change of an offset or a meaning; the agent refuses another). Version 6
/// adds the tier views: `views_per_slot` in the header and a view table
/// after the slots; a rank that does not ask for views writes version 5
/// (the same layout with no table), which every agent since 5 reads.
/// Version 7 adds the peer waits: `peer_waits_per_slot` in the header
/// ([`PEER_WAITS_PER_SLOT`]) and a peer-wait table after the view table
/// (which it may have or not: `views_per_slot` 0 is no table).
/// Version 8 adds the extra words: `extras_per_slot` in the header
/// ([`EXTRAS_PER_SLOT`]) and an extras table after the peer-wait table
/// (which a version 8 segment always has): the source bytes and where the
/// peers' share of the waits went ([`BatchExtras`]).
pub const SEGMENT_VERSION: u32 = 8;
/// The layout with peer waits and no extra words.
pub const SEGMENT_PEER_WAITS_VERSION: u32 = 7;
/// The layout with tier views and no peer waits.
pub const SEGMENT_VIEWS_VERSION: u32 = 6;
/// Peer-wait words per slot in a layout version 7 segment: the nodes the
/// rank's loader inside the agent waited for longest while it made the
/// batch ([`peer_wait_word`]).
pub const PEER_WAITS_PER_SLOT: u32 = 4;
/// Extra words per slot in a layout version 8 segment ([`BatchExtras`]):
/// the source bytes, one reserved word, then two words for the batch's
/// split of the peers' waits and two for each peer-wait entry's.
pub const EXTRAS_PER_SLOT: u32 = 12;
/// The largest node index a peer-wait word may name: a cluster has at
/// most 65,536 nodes (`transport::cluster`), so a rank's table of nodes
/// stays small whatever an agent writes.
pub const MAX_PEER_WAIT_NODE: u32 = (1 << 16) - 1;
/// The oldest layout this build still reads (and writes, without views).
pub const SEGMENT_OLDEST_VERSION: u32 = 5;
/// Most view words per slot (the largest batch a rank asking for tier
/// views may have).
pub const MAX_VIEWS_PER_SLOT: u32 = 1 << 16;
/// A view word's flag: the sample is in the node tier at the offset in the
/// low 63 bits, not in the ring ([`view_word`]).
pub const VIEW_IN_TIER: u64 = 1 << 63;
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
    /// Layout version 6: view words per batch slot (the batch size when
    /// the rank asked for tier views, else 0); 0 in version 5.
    views_per_slot: AtomicU32,
    /// Layout version 7: peer-wait words per slot ([`PEER_WAITS_PER_SLOT`]);
    /// 0 (reserved) before.
    peer_waits_per_slot: AtomicU32,
    /// Layout version 8: extra words per slot ([`EXTRAS_PER_SLOT`]); 0
    /// (reserved) before.
    extras_per_slot: AtomicU32,
    _reserved: [AtomicU32; 1],
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
    samples: AtomicU32,
    failovers: AtomicU32,
    disk_reads: AtomicU32,
    tier_hits: AtomicU32,
    remote_samples: AtomicU32,
    source_reads: AtomicU32,
    /// Layout version 4: the agent's waits for this rank since the
    /// previous publish, in µs, by cause ([`BatchWaits`]): disk, tier,
    /// source, peers, failover.
    waits_us: [AtomicU32; 5],
    /// Layout version 4: samples read from the rank's cache area in the
    /// agent since the previous publish.
    cache_hits: AtomicU32,
    /// Layout version 5: the agent's disk reads for this rank since the
    /// previous publish by latency, a count per power of two of µs
    /// ([`latency_bucket`]), 16 bits each.
    read_latency: [AtomicU16; LATENCY_BUCKETS],
}

/// Buckets of an attached rank's read latencies in a batch slot: bucket
/// `k` counts reads of `2^k` to `2^(k+1) - 1` µs (bucket 0 also 0 µs),
/// the last everything from `2^19` µs (0.52 s) on.
pub const LATENCY_BUCKETS: usize = 20;

/// The bucket of a read of `micros` µs ([`LATENCY_BUCKETS`]).
pub fn latency_bucket(micros: u64) -> usize {
    ((63 - micros.max(1).leading_zeros()) as usize).min(LATENCY_BUCKETS - 1)
}

/// The latency a read counted in bucket `k` is taken to have: the middle
/// of the bucket (`1.5 × 2^k` µs, 1 µs for bucket 0), so percentiles made
/// from the buckets are within a third of the reads' own.
pub fn latency_of_bucket(k: usize) -> u64 {
    if k == 0 {
        1
    } else {
        3 << (k - 1)
    }
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
    assert!(std::mem::size_of::<Slot>() == 128);
    assert!(SLOTS_OFFSET == 192 + 1024);
    use std::mem::offset_of;
    assert!(offset_of!(Header, generation) == 40 && offset_of!(Header, rank_pid) == 44);
    assert!(offset_of!(Header, views_per_slot) == 48);
    assert!(offset_of!(Header, peer_waits_per_slot) == 52);
    assert!(offset_of!(Header, extras_per_slot) == 56);
    assert!(
        offset_of!(AgentBlock, ready_futex) == 16 && offset_of!(AgentBlock, room_waiters) == 20
    );
    assert!(
        offset_of!(AgentBlock, published) == 24 && offset_of!(AgentBlock, errors_dropped) == 56
    );
    assert!(offset_of!(RankBlock, room_futex) == 24 && offset_of!(RankBlock, ready_waiters) == 28);
    assert!(offset_of!(RankBlock, taken) == 32 && offset_of!(RankBlock, errors_dropped) == 56);
    assert!(offset_of!(ErrorSlot, kind) == 16 && offset_of!(ErrorSlot, message) == 48);
    assert!(offset_of!(Slot, samples) == 40 && offset_of!(Slot, failovers) == 44);
    assert!(offset_of!(Slot, disk_reads) == 48 && offset_of!(Slot, source_reads) == 60);
    assert!(offset_of!(Slot, waits_us) == 64 && offset_of!(Slot, cache_hits) == 84);
    assert!(offset_of!(Slot, read_latency) == 88 && LATENCY_BUCKETS * 2 == 40);
};

/// Bytes of a segment with `slots` batch slots and no view table (before
/// page rounding).
pub fn segment_bytes(slots: u32) -> u64 {
    segment_bytes_with_views(slots, 0)
}

/// Bytes of a segment with `slots` batch slots and `views_per_slot` view
/// words per slot (layout version 6; 0: version 5's size).
pub fn segment_bytes_with_views(slots: u32, views_per_slot: u32) -> u64 {
    segment_bytes_for(slots, views_per_slot, 0)
}

/// Bytes of a segment with `slots` batch slots, `views_per_slot` view
/// words and `peer_waits_per_slot` peer-wait words per slot (layout
/// version 7 when the last is [`PEER_WAITS_PER_SLOT`]).
pub fn segment_bytes_for(slots: u32, views_per_slot: u32, peer_waits_per_slot: u32) -> u64 {
    segment_bytes_with(slots, views_per_slot, peer_waits_per_slot, 0)
}

/// As [`segment_bytes_for`], with `extras_per_slot` extra words per slot
/// (layout version 8 when it is [`EXTRAS_PER_SLOT`]).
pub fn segment_bytes_with(
    slots: u32,
    views_per_slot: u32,
    peer_waits_per_slot: u32,
    extras_per_slot: u32,
) -> u64 {
    // Saturating: the agent sizes a peer's unchecked fields with this, and
    // a sum that does not fit is then refused as the wrong size.
    let words = u64::from(views_per_slot)
        .saturating_add(u64::from(peer_waits_per_slot))
        .saturating_add(u64::from(extras_per_slot));
    (views_offset(slots) as u64)
        .saturating_add(8u64.saturating_mul(u64::from(slots)).saturating_mul(words))
}

/// A peer-wait word: `(node + 1) << 32 | µs` (µs saturating at 2^32 − 1);
/// 0 is an empty entry.
pub fn peer_wait_word(node: u32, wait_us: u64) -> u64 {
    debug_assert!(node <= MAX_PEER_WAIT_NODE);
    (u64::from(node) + 1) << 32 | wait_us.min(u64::from(u32::MAX))
}

/// A peer-wait word's (node, µs), None for an empty word; an error names a
/// word whose node is beyond [`MAX_PEER_WAIT_NODE`].
pub fn decode_peer_wait(word: u64) -> std::result::Result<Option<(u32, u32)>, String> {
    if word == 0 {
        return Ok(None);
    }
    let node = (word >> 32) as u32;
    if node == 0 || node - 1 > MAX_PEER_WAIT_NODE {
        return Err(format!(
            "peer-wait word {word:#x}: its node field {node} is not 1 to {}",
            MAX_PEER_WAIT_NODE + 1
        ));
    }
    Ok(Some((node - 1, word as u32)))
}

/// Where one part of the peers' waits went, in µs (each saturating at
/// `u32::MAX`): the node reading the sample, the node sending it, the link
/// ([`StallCauses::peer_read`](crate::loader::StallCauses::peer_read)).
/// Two extra words: `read_us | send_us << 32`, then `link_us` (its high 32
/// bits 0).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PeerSplit {
    /// The node reading (queued for staging or the disk).
    pub read_us: u32,
    /// The node sending, after its read.
    pub send_us: u32,
    /// The link.
    pub link_us: u32,
}

impl PeerSplit {
    /// Its two extra words.
    pub fn words(self) -> [u64; 2] {
        [
            u64::from(self.read_us) | u64::from(self.send_us) << 32,
            u64::from(self.link_us),
        ]
    }

    /// From its two extra words; an error names a `link` word whose high
    /// 32 bits are not 0.
    pub fn from_words(w: [u64; 2]) -> std::result::Result<PeerSplit, String> {
        if w[1] >> 32 != 0 {
            return Err(format!(
                "extra word {:#x}: a link time's high 32 bits must be 0",
                w[1]
            ));
        }
        Ok(PeerSplit {
            read_us: w[0] as u32,
            send_us: (w[0] >> 32) as u32,
            link_us: w[1] as u32,
        })
    }
}

/// The extra words of a batch slot (layout version 8, [`EXTRAS_PER_SLOT`]
/// words): what the rank's loader inside the agent read from the source
/// and where the peers' share of its waits went, since the previous
/// publish. Word 0: `source_bytes`; word 1: reserved (0); words 2-3:
/// `split`; words 4 + 2i and 5 + 2i: `peers[i]`, the split of peer-wait
/// entry `i`'s wait.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct BatchExtras {
    /// Bytes of the samples read from the dataset's source.
    pub source_bytes: u64,
    /// The batch's waits for the peers (the slot's `peers` wait), split
    /// where the nodes report their times (TCP); what came over RDMA or
    /// from nodes that report none stays unsplit, so the three sum to at
    /// most that wait.
    pub split: PeerSplit,
    /// As `split`, per entry of the peer-wait table (same order).
    pub peers: [PeerSplit; PEER_WAITS_PER_SLOT as usize],
}

impl BatchExtras {
    /// Its [`EXTRAS_PER_SLOT`] words.
    pub fn words(&self) -> [u64; EXTRAS_PER_SLOT as usize] {
        let mut w = [0u64; EXTRAS_PER_SLOT as usize];
        w[0] = self.source_bytes;
        w[2..4].copy_from_slice(&self.split.words());
        for (i, p) in self.peers.iter().enumerate() {
            w[4 + 2 * i..6 + 2 * i].copy_from_slice(&p.words());
        }
        w
    }

    /// From its words; an error names a word out of its range.
    pub fn from_words(w: &[u64; EXTRAS_PER_SLOT as usize]) -> std::result::Result<Self, String> {
        let mut peers = [PeerSplit::default(); PEER_WAITS_PER_SLOT as usize];
        for (i, p) in peers.iter_mut().enumerate() {
            *p = PeerSplit::from_words([w[4 + 2 * i], w[5 + 2 * i]])?;
        }
        Ok(BatchExtras {
            source_bytes: w[0],
            split: PeerSplit::from_words([w[2], w[3]])?,
            peers,
        })
    }
}

/// Where the view table starts: right after the slots.
fn views_offset(slots: u32) -> usize {
    SLOTS_OFFSET + slots as usize * std::mem::size_of::<Slot>()
}

/// The view word of a sample in the node tier at `tier_offset`; a sample
/// in the ring has the word 0.
pub fn view_word(tier_offset: u64) -> u64 {
    debug_assert!(tier_offset < VIEW_IN_TIER);
    VIEW_IN_TIER | tier_offset
}

/// The node tier offset a view word names, or `None` for a sample in the
/// ring.
pub fn view_tier_offset(word: u64) -> Option<u64> {
    (word & VIEW_IN_TIER != 0).then_some(word & !VIEW_IN_TIER)
}

/// Where one published batch lies in the ring, and what it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct BatchDesc {
    /// Offset of the batch's first byte in the ring.
    pub ring_offset: u64,
    /// The batch's span in the ring: from `ring_offset` to the end of its
    /// last sample, the padding between samples and any skip to the
    /// ring's start included (docs/AGENT.md, "A batch in the ring").
    pub bytes: u64,
    /// The sampler epoch it belongs to.
    pub epoch: u64,
    /// Its index within the epoch.
    pub batch_in_epoch: u64,
    /// Samples in it.
    pub samples: u64,
    /// What the agent read for this rank since the previous batch it
    /// published (so the rank's stats can say where its samples came from).
    pub reads: BatchReads,
}

/// Reads the agent made for one rank between two publishes, counted as the
/// embedded loader's [`Stats`](crate::loader::Stats) counts them: a sample
/// read ahead is counted with the batch published after its read, so the
/// sums over a rank's batches are its loader's counters at the last
/// publish (reads for batches the rank never took are not in them).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct BatchReads {
    /// Samples read from the node's disk.
    pub disk_reads: u32,
    /// Samples copied from the node's memory tier.
    pub tier_hits: u32,
    /// Samples another node pushed.
    pub remote_samples: u32,
    /// Samples read from the dataset's source.
    pub source_reads: u32,
    /// Samples whose holder failed (a read, a node) and that were served
    /// by another copy or the source (layout version 3).
    pub failovers: u32,
    /// How long the rank's loader in the agent waited for its samples
    /// since the previous publish, by cause (layout version 4).
    pub waits: BatchWaits,
    /// Samples read from the rank's NVMe cache area in the agent
    /// (`kspeed agent --cache-dir`; layout version 4).
    pub cache_hits: u32,
    /// The agent's disk reads for the rank by latency, a count per
    /// [`latency_bucket`] (layout version 5; a count over 65,535 is sent
    /// in later batches).
    pub read_latency: [u16; LATENCY_BUCKETS],
}

/// What the rank's loader inside the agent waited for between two
/// publishes, in µs, by the causes of
/// [`StallCauses`](crate::loader::StallCauses) (each saturating at
/// `u32::MAX`, 71 minutes): the rank charges its own wait for the batch to
/// them, and only the rest to the agent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct BatchWaits {
    /// Samples read from the node's disk.
    pub disk_us: u32,
    /// Samples copied from the node tier.
    pub tier_us: u32,
    /// Samples read from the source.
    pub source_us: u32,
    /// Samples other nodes served as their first holder.
    pub peers_us: u32,
    /// Samples that failed over from their holder.
    pub failover_us: u32,
}

impl BatchWaits {
    /// The five waits in slot order.
    pub(crate) fn to_array(self) -> [u32; 5] {
        [
            self.disk_us,
            self.tier_us,
            self.source_us,
            self.peers_us,
            self.failover_us,
        ]
    }

    /// From the slot order.
    pub(crate) fn from_array(a: [u32; 5]) -> Self {
        BatchWaits {
            disk_us: a[0],
            tier_us: a[1],
            source_us: a[2],
            peers_us: a[3],
            failover_us: a[4],
        }
    }
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

/// The shared mapping of an attach segment. The slot count and ring size
/// are the values checked at open, kept here (never re-read from the
/// shared memory).
pub struct Segment {
    map: MmapRaw,
    file: File,
    slots: u32,
    ring_bytes: u64,
    views_per_slot: u32,
    peer_waits_per_slot: u32,
    extras_per_slot: u32,
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
        Self::create_with_views(slots, ring_bytes, 0)
    }

    /// As [`Segment::create`], with a view table of `views_per_slot` words
    /// per slot (the batch size) for a rank that asks for tier views:
    /// layout version 6 (version 5 when 0).
    pub fn create_with_views(slots: u32, ring_bytes: u64, views_per_slot: u32) -> Result<Segment> {
        Self::create_for(slots, ring_bytes, views_per_slot, false)
    }

    /// As [`Segment::create_with_views`], and with `peer_waits` a
    /// peer-wait table of [`PEER_WAITS_PER_SLOT`] words per slot: layout
    /// version 7 (else 6 with views, 5 without).
    pub fn create_for(
        slots: u32,
        ring_bytes: u64,
        views_per_slot: u32,
        peer_waits: bool,
    ) -> Result<Segment> {
        Self::create_with(slots, ring_bytes, views_per_slot, peer_waits, false)
    }

    /// As [`Segment::create_for`], and with `extras` an extras table of
    /// [`EXTRAS_PER_SLOT`] words per slot after the peer-wait table:
    /// layout version 8 (`extras` needs `peer_waits`).
    pub fn create_with(
        slots: u32,
        ring_bytes: u64,
        views_per_slot: u32,
        peer_waits: bool,
        extras: bool,
    ) -> Result<Segment> {
        if extras && !peer_waits {
            return Err(Error::InvalidConfig(
                "an attach segment with extra words has a peer-wait table too (layout 8)".into(),
            ));
        }
        if slots == 0 || slots > MAX_SLOTS || !slots.is_power_of_two() {
            return Err(Error::InvalidConfig(format!(
                "attach segment slots {slots}: must be a power of two from 1 to {MAX_SLOTS}"
            )));
        }
        if views_per_slot > MAX_VIEWS_PER_SLOT {
            return Err(Error::InvalidConfig(format!(
                "tier views for batches of {views_per_slot} samples: at most {MAX_VIEWS_PER_SLOT} (leave tier_views off)"
            )));
        }
        let peer_waits_per_slot = if peer_waits { PEER_WAITS_PER_SLOT } else { 0 };
        let extras_per_slot = if extras { EXTRAS_PER_SLOT } else { 0 };
        let total = segment_bytes_with(slots, views_per_slot, peer_waits_per_slot, extras_per_slot);
        let file = sealed_memfd(c"kspeed-attach-segment", total)?;
        let map = MmapRaw::map_raw(&file).map_err(|e| io_err("mmap", "attach segment", e))?;
        let seg = Segment {
            map,
            file,
            slots,
            ring_bytes,
            views_per_slot,
            peer_waits_per_slot,
            extras_per_slot,
        };
        let h = seg.header();
        h.version.store(
            if extras {
                SEGMENT_VERSION
            } else if peer_waits {
                SEGMENT_PEER_WAITS_VERSION
            } else if views_per_slot > 0 {
                SEGMENT_VIEWS_VERSION
            } else {
                SEGMENT_OLDEST_VERSION
            },
            Ordering::Relaxed,
        );
        h.views_per_slot.store(views_per_slot, Ordering::Relaxed);
        h.peer_waits_per_slot
            .store(peer_waits_per_slot, Ordering::Relaxed);
        h.extras_per_slot.store(extras_per_slot, Ordering::Relaxed);
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
            views_per_slot: 0,
            peer_waits_per_slot: 0,
            extras_per_slot: 0,
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
        if !(SEGMENT_OLDEST_VERSION..=SEGMENT_VERSION).contains(&version) {
            return Err(seg_err(format!(
                "layout version {version}, this build reads versions {SEGMENT_OLDEST_VERSION} to {SEGMENT_VERSION}"
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
        // Version 5's bytes 48..63 are reserved (zero); version 6 has a
        // view table only where the rank asked for tier views; version 7
        // a peer-wait table, and a view table or not; version 8 an extras
        // table too.
        let views_per_slot = h.views_per_slot.load(Ordering::Relaxed);
        let views_ok = match version {
            SEGMENT_OLDEST_VERSION => views_per_slot == 0,
            SEGMENT_VIEWS_VERSION => (1..=MAX_VIEWS_PER_SLOT).contains(&views_per_slot),
            _ => views_per_slot <= MAX_VIEWS_PER_SLOT,
        };
        if !views_ok {
            return Err(seg_err(format!(
                "views_per_slot {views_per_slot} in a layout version {version} header (version 5: 0; version 6: 1 to {MAX_VIEWS_PER_SLOT}; versions 7 and 8: 0 to {MAX_VIEWS_PER_SLOT})"
            )));
        }
        let peer_waits_per_slot = h.peer_waits_per_slot.load(Ordering::Relaxed);
        let want_peer_waits = if version >= SEGMENT_PEER_WAITS_VERSION {
            PEER_WAITS_PER_SLOT
        } else {
            0
        };
        if peer_waits_per_slot != want_peer_waits {
            return Err(seg_err(format!(
                "peer_waits_per_slot {peer_waits_per_slot} in a layout version {version} header (versions 7 and 8: {PEER_WAITS_PER_SLOT}; before: 0)"
            )));
        }
        let extras_per_slot = h.extras_per_slot.load(Ordering::Relaxed);
        let want_extras = if version == SEGMENT_VERSION {
            EXTRAS_PER_SLOT
        } else {
            0
        };
        if extras_per_slot != want_extras {
            return Err(seg_err(format!(
                "extras_per_slot {extras_per_slot} in a layout version {version} header (version 8: {EXTRAS_PER_SLOT}; before: 0)"
            )));
        }
        let need = segment_bytes_with(slots, views_per_slot, peer_waits_per_slot, extras_per_slot);
        let total = h.total_bytes.load(Ordering::Relaxed);
        if total != need || mapped < total {
            return Err(seg_err(format!(
                "total size {total} bytes (mapped {mapped}); {slots} slots, {views_per_slot} views, {peer_waits_per_slot} peer waits and {extras_per_slot} extra words per slot need {need}"
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
            views_per_slot,
            peer_waits_per_slot,
            extras_per_slot,
            ..seg
        })
    }

    /// Extra words per slot: [`EXTRAS_PER_SLOT`] in layout version 8, else
    /// 0.
    pub fn extras_per_slot(&self) -> u32 {
        self.extras_per_slot
    }

    /// Peer-wait words per slot: [`PEER_WAITS_PER_SLOT`] in layout version
    /// 7, else 0.
    pub fn peer_waits_per_slot(&self) -> u32 {
        self.peer_waits_per_slot
    }

    /// View words per slot: the batch size where the rank asked for tier
    /// views, else 0 (layout version 5).
    pub fn views_per_slot(&self) -> u32 {
        self.views_per_slot
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
    /// The view words of batch `seq`'s slot (empty without a view table).
    fn views(&self, seq: u64) -> &[AtomicU64] {
        self.row(seq, 0, self.views_per_slot as usize)
    }

    /// The peer-wait words of batch `seq`'s slot (empty without a
    /// peer-wait table): after the view table.
    fn peer_waits(&self, seq: u64) -> &[AtomicU64] {
        let table = self.slots as usize * self.views_per_slot as usize * 8;
        self.row(seq, table, self.peer_waits_per_slot as usize)
    }

    /// The extra words of batch `seq`'s slot (empty without an extras
    /// table): after the peer-wait table.
    fn extras(&self, seq: u64) -> &[AtomicU64] {
        let words = self.views_per_slot as usize + self.peer_waits_per_slot as usize;
        let table = self.slots as usize * words * 8;
        self.row(seq, table, self.extras_per_slot as usize)
    }

    /// Batch `seq`'s row of `n` words in the table that starts `table`
    /// bytes after the slots (empty when `n` is 0).
    fn row(&self, seq: u64, table: usize, n: usize) -> &[AtomicU64] {
        if n == 0 {
            return &[];
        }
        let i = (seq & u64::from(self.slots - 1)) as usize;
        let offset = views_offset(self.slots) + table + i * n * 8;
        assert!(offset + n * 8 <= self.map.len());
        // SAFETY: in bounds (checked above: open checked the mapping holds
        // total_bytes, which covers every slot's row of either table),
        // 8-aligned (the tables start where the slots end, a multiple of
        // 64, plus whole words, and each word is 8 bytes); the
        // memory holds only atomics, valid for any bit pattern, shared
        // through `&` for the mapping's life, which `&self` bounds.
        unsafe { std::slice::from_raw_parts(self.map.as_ptr().add(offset) as *const AtomicU64, n) }
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

impl Segment {
    /// Records `side`'s heartbeat: for a process that beats for a side
    /// from another thread than the one holding its [`AgentSide`] (the
    /// agent's main loop maps each rank's segment a second time and beats
    /// there, so a feeder busy in a read never looks dead).
    pub fn beat_for(&self, side: Side) {
        self.beat(side);
    }

    /// `side`'s state word, pid and nanoseconds since its last heartbeat.
    pub fn side_status(&self, side: Side) -> (u32, u32, u64) {
        self.peer(side)
    }

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_offsets_are_the_documented_ones() {
        assert_eq!(segment_bytes(1), 1216 + 128);
        assert_eq!(segment_bytes(16), 1216 + 16 * 128);
    }

    #[test]
    fn a_view_table_follows_the_slots_in_version_6() {
        assert_eq!(segment_bytes_with_views(8, 0), segment_bytes(8));
        assert_eq!(segment_bytes_with_views(8, 16), 1216 + 8 * 128 + 8 * 16 * 8);
        let plain = Segment::create(8, 1 << 20).unwrap();
        assert_eq!(plain.header().version.load(Ordering::Relaxed), 5);
        let seg = Segment::create_with_views(8, 1 << 20, 16).unwrap();
        assert_eq!(seg.header().version.load(Ordering::Relaxed), 6);
        let dup = || seg.fd().try_clone_to_owned().unwrap();
        assert_eq!(Segment::open(dup(), 1 << 20).unwrap().views_per_slot(), 16);
        // The agent writes a batch's words before its ready word; the rank
        // reads those of the batch it took last.
        let rank = RankSide::new(Segment::open(dup(), 1 << 20).unwrap()).unwrap();
        let gen = rank.generation();
        let mut agent = AgentSide::new(Segment::open(dup(), 1 << 20).unwrap(), gen).unwrap();
        let mut rank = rank;
        let desc = BatchDesc {
            samples: 3,
            ..Default::default()
        };
        agent.set_views(&[0, view_word(4096), 0]);
        agent.publish(&desc).unwrap();
        rank.try_take().expect("published");
        let words: Vec<u64> = (0..3).map(|i| rank.taken_view(i)).collect();
        assert_eq!(
            words
                .iter()
                .map(|&w| view_tier_offset(w))
                .collect::<Vec<_>>(),
            [None, Some(4096), None]
        );
        // A version 5 header with views, or version 6 without, is refused.
        seg.header().version.store(5, Ordering::Relaxed);
        let e = Segment::open(dup(), 1 << 20).unwrap_err();
        assert!(e.to_string().contains("views_per_slot 16"), "{e}");
        seg.header().version.store(6, Ordering::Relaxed);
        seg.header().views_per_slot.store(0, Ordering::Relaxed);
        assert!(Segment::open(dup(), 1 << 20).is_err());
        assert!(Segment::create_with_views(8, 1 << 20, MAX_VIEWS_PER_SLOT + 1).is_err());
    }

    #[test]
    fn a_peer_wait_table_follows_the_view_table_in_version_7() {
        assert_eq!(
            segment_bytes_for(8, 16, PEER_WAITS_PER_SLOT),
            1216 + 8 * 128 + 8 * 16 * 8 + 8 * 4 * 8
        );
        for views in [0, 16] {
            let seg = Segment::create_for(8, 1 << 20, views, true).unwrap();
            assert_eq!(seg.header().version.load(Ordering::Relaxed), 7);
            let dup = || seg.fd().try_clone_to_owned().unwrap();
            let opened = Segment::open(dup(), 1 << 20).unwrap();
            assert_eq!(
                (opened.views_per_slot(), opened.peer_waits_per_slot()),
                (views, PEER_WAITS_PER_SLOT)
            );
            let rank = RankSide::new(Segment::open(dup(), 1 << 20).unwrap()).unwrap();
            let gen = rank.generation();
            let mut agent = AgentSide::new(Segment::open(dup(), 1 << 20).unwrap(), gen).unwrap();
            let mut rank = rank;
            // Nine batches through 8 slots: each row is the last batch's.
            for k in 0..9u64 {
                if views > 0 {
                    agent.set_views(&[view_word(64 * k)]);
                }
                agent.set_peer_waits(&[peer_wait_word(3, 1000 + k), peer_wait_word(0, k)]);
                agent.publish(&BatchDesc::default()).unwrap();
                rank.try_take().expect("published");
                assert_eq!(
                    decode_peer_wait(rank.taken_peer_wait(0)),
                    Ok(Some((3, 1000 + k as u32)))
                );
                // Node 0 with 0 µs is an entry (node + 1 in the high half).
                assert_eq!(
                    decode_peer_wait(rank.taken_peer_wait(1)),
                    Ok(Some((0, k as u32)))
                );
                assert_eq!(rank.taken_peer_wait(2), 0);
                if views > 0 {
                    assert_eq!(view_tier_offset(rank.taken_view(0)), Some(64 * k));
                }
                rank.release(k + 1);
            }
            // Peer waits in another version, or another count, are refused.
            seg.header().peer_waits_per_slot.store(3, Ordering::Relaxed);
            let e = Segment::open(dup(), 1 << 20).unwrap_err();
            assert!(e.to_string().contains("peer_waits_per_slot 3"), "{e}");
            seg.header()
                .peer_waits_per_slot
                .store(PEER_WAITS_PER_SLOT, Ordering::Relaxed);
            seg.header()
                .version
                .store(if views > 0 { 6 } else { 5 }, Ordering::Relaxed);
            assert!(Segment::open(dup(), 1 << 20).is_err());
        }
        // Words: empty, a node, µs saturating, a node field out of range.
        assert_eq!(decode_peer_wait(0), Ok(None));
        assert_eq!(
            decode_peer_wait(peer_wait_word(7, u64::MAX)),
            Ok(Some((7, u32::MAX)))
        );
        assert!(decode_peer_wait(5).is_err(), "node field 0 with a time");
        assert!(decode_peer_wait(u64::MAX).is_err());
    }

    /// Version 8: the extras table after the peer-wait table, each row the
    /// last batch's, round trips; a version, count or word out of range
    /// is refused by name.
    #[test]
    fn an_extras_table_follows_the_peer_wait_table_in_version_8() {
        assert_eq!(
            segment_bytes_with(8, 16, PEER_WAITS_PER_SLOT, EXTRAS_PER_SLOT),
            1216 + 8 * 128 + 8 * 16 * 8 + 8 * 4 * 8 + 8 * 12 * 8
        );
        assert!(Segment::create_with(8, 1 << 20, 0, false, true).is_err());
        for views in [0, 16] {
            let seg = Segment::create_with(8, 1 << 20, views, true, true).unwrap();
            assert_eq!(seg.header().version.load(Ordering::Relaxed), 8);
            let dup = || seg.fd().try_clone_to_owned().unwrap();
            let opened = Segment::open(dup(), 1 << 20).unwrap();
            assert_eq!(
                (
                    opened.views_per_slot(),
                    opened.peer_waits_per_slot(),
                    opened.extras_per_slot()
                ),
                (views, PEER_WAITS_PER_SLOT, EXTRAS_PER_SLOT)
            );
            let rank = RankSide::new(Segment::open(dup(), 1 << 20).unwrap()).unwrap();
            let gen = rank.generation();
            let mut agent = AgentSide::new(Segment::open(dup(), 1 << 20).unwrap(), gen).unwrap();
            let mut rank = rank;
            for k in 0..9u32 {
                let split = |b: u32| PeerSplit {
                    read_us: b + k,
                    send_us: u32::MAX - k,
                    link_us: 7 * k,
                };
                let extras = BatchExtras {
                    source_bytes: u64::MAX - u64::from(k),
                    split: split(100),
                    peers: [split(1), split(2), PeerSplit::default(), split(4)],
                };
                if views > 0 {
                    agent.set_views(&[view_word(64 * u64::from(k))]);
                }
                agent.set_peer_waits(&[peer_wait_word(3, 1000)]);
                agent.set_extras(&extras);
                agent.publish(&BatchDesc::default()).unwrap();
                rank.try_take().expect("published");
                assert_eq!(rank.taken_extras(), Ok(extras));
                assert_eq!(
                    decode_peer_wait(rank.taken_peer_wait(0)),
                    Ok(Some((3, 1000)))
                );
                if views > 0 {
                    assert_eq!(
                        view_tier_offset(rank.taken_view(0)),
                        Some(64 * u64::from(k))
                    );
                }
                rank.release(u64::from(k) + 1);
            }
            // The documented words: source bytes first, a link word's high
            // half 0 (else refused by name).
            let row = seg.extras(8);
            assert_eq!(row[0].load(Ordering::Relaxed), u64::MAX - 8);
            assert_eq!(
                row[2].load(Ordering::Relaxed),
                108 | u64::from(u32::MAX - 8) << 32
            );
            assert_eq!(row[3].load(Ordering::Relaxed), 56);
            row[3].store(1 << 32, Ordering::Relaxed);
            let e = rank.taken_extras().unwrap_err();
            assert!(e.contains("high 32 bits"), "{e}");
            // Extras in another version, or another count, are refused.
            seg.header().extras_per_slot.store(11, Ordering::Relaxed);
            let e = Segment::open(dup(), 1 << 20).unwrap_err();
            assert!(e.to_string().contains("extras_per_slot 11"), "{e}");
            seg.header()
                .extras_per_slot
                .store(EXTRAS_PER_SLOT, Ordering::Relaxed);
            seg.header().version.store(7, Ordering::Relaxed);
            let e = Segment::open(dup(), 1 << 20).unwrap_err();
            assert!(e.to_string().contains("extras_per_slot 12"), "{e}");
            seg.header().version.store(8, Ordering::Relaxed);
            assert!(Segment::open(dup(), 1 << 20).is_ok());
        }
        // A segment without the table reads all zero.
        let seg = Segment::create_for(8, 1 << 20, 0, true).unwrap();
        let rank = RankSide::new(seg).unwrap();
        assert_eq!(rank.taken_extras(), Ok(BatchExtras::default()));
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
        seg.header()
            .version
            .store(SEGMENT_VERSION + 1, Ordering::Relaxed);
        let e = Segment::open(dup(), 1 << 20).unwrap_err();
        let want = format!("layout version {}", SEGMENT_VERSION + 1);
        assert!(e.to_string().contains(&want), "{e}");
        seg.header()
            .version
            .store(SEGMENT_VERSION, Ordering::Relaxed);
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
