//! The attach protocol's messages (versions 5 and 6): ATTACH, ATTACHED and
//! REFUSED, fixed little-endian layouts behind a 12-byte header that every
//! version shares (docs/AGENT.md, "The attach protocol"). Pure encoding and
//! checking; the socket that carries them is `super::attach`.
//!
//! Version 6 adds the block shuffle and a mixture's datasets to ATTACH, so
//! a rank sends version 5 unless it needs one of them (an agent of either
//! version serves it) and the agent answers in the version it was asked in.
//!
//! Why this file is over ~800 lines: every message's encoding, decoding and
//! checks sit with the unit tests that pin their documented bytes (over
//! half the file); splitting a message from its tests would let the two
//! drift.

use super::segment::Generation;
use crate::error::{Error, Result};

/// The messages' magic: the bytes `KSAT` read as a little-endian u32.
pub const ATTACH_MAGIC: u32 = u32::from_le_bytes(*b"KSAT");
/// The newest message layout version this build speaks. The first 12
/// bytes (magic, version, kind, length) are the same in every version, so
/// a peer of another version is answered with a REFUSED it can read.
pub const ATTACH_VERSION: u16 = 6;
/// The oldest version this build still speaks (and sends, when a request
/// needs nothing newer): ATTACHED and REFUSED are the same in both.
pub const ATTACH_OLDEST_VERSION: u16 = 5;
/// Kind of an ATTACH message (rank to agent).
pub const KIND_ATTACH: u16 = 1;
/// Kind of an ATTACHED reply.
pub const KIND_ATTACHED: u16 = 2;
/// Kind of a REFUSED reply.
pub const KIND_REFUSED: u16 = 3;
/// Bytes of a version 6 ATTACH message before its datasets (a mixture's
/// 16 bytes each follow).
pub const ATTACH_BYTES: usize = 144;
/// Bytes of each dataset of a mixture in a version 6 ATTACH.
pub const ATTACH_DATASET_BYTES: usize = 16;
/// The most datasets a mixture read through the agent has.
pub const MAX_ATTACH_DATASETS: usize = 1024;
/// The largest ATTACH: a mixture of [`MAX_ATTACH_DATASETS`].
pub const ATTACH_MAX_BYTES: usize = ATTACH_BYTES + MAX_ATTACH_DATASETS * ATTACH_DATASET_BYTES;
/// Bytes of a version 5 ATTACH message (as version 4's; 96 in versions 1
/// to 3).
pub const ATTACH_V5_BYTES: usize = 112;
/// Bytes of an ATTACHED reply (version 1).
pub const ATTACHED_BYTES: usize = 32;
/// Bytes of a REFUSED reply (version 1).
pub const REFUSED_BYTES: usize = 256;
/// Bytes of a REFUSED reason (longer ones are cut).
pub const REFUSED_REASON_BYTES: usize = REFUSED_BYTES - 20;
/// Descriptors an ATTACH carries: the ring's memfd, then the segment's.
pub const ATTACH_FDS: usize = 2;

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

/// A mixture's datasets as a rank's schedule deals them (version 6): what
/// the agent needs, besides the datasets themselves (the spaces it serves,
/// in order, named by the request's `dataset_id`: the mixture's identity),
/// to compute the same schedule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MixAttach {
    /// Each dataset's samples per epoch (the rank's weights' counts,
    /// `sampler::epoch_counts`).
    pub counts: Vec<u64>,
    /// Each dataset's stream entries used before `start_epoch`'s order (a
    /// job resumed inside an epoch under other weights,
    /// `Loader::restore_job_position`); all 0 otherwise.
    pub skip: Vec<u64>,
    /// The epoch the mixed order starts in (resumed, or 0).
    pub start_epoch: u64,
    /// Entries of that epoch's order the job had consumed when the order
    /// was resumed (`MixPosition::consumed`; where the rank's deal starts
    /// is the request's job position, which a later restore moves).
    pub start_consumed: u64,
}

impl MixAttach {
    /// Where the mixed order starts, as the rank's sampler resumes it
    /// (`MixSampler::resume`).
    pub fn start(&self) -> crate::sampler::MixPosition {
        crate::sampler::MixPosition {
            epoch: self.start_epoch,
            consumed: self.start_consumed,
            counts: self.counts.clone(),
            skip: self.skip.clone(),
        }
    }
}

/// What a rank asks for: enough for the agent to compute the rank's
/// schedule itself (the sampler's inputs and the start position) and to
/// check the ring and segment it was given.
#[derive(Debug, Clone, PartialEq, Eq)]
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
    /// Flags: the sampler's (version 2), [`FLAG_SHUFFLE`] and
    /// [`FLAG_DROP_LAST`], and [`FLAG_VERIFY_CRC32C`], [`FLAG_TIER_VIEWS`],
    /// [`FLAG_PEER_WAITS`], [`FLAG_SLOT_EXTRAS`].
    pub flags: u32,
    /// The job's end (version 3): the agent reads nothing of this epoch or
    /// later for the rank (`LoaderBuilder::end_epoch`); `None`: it reads on
    /// into the next epochs as long as the rank is attached.
    pub end_epoch: Option<u64>,
    /// The epoch the rank's world resumed inside, from a job position
    /// (version 4): its rest is dealt to this world from entry `consumed`
    /// of its global order (`Loader::restore_job_position`); later epochs
    /// are ordinary. `None`: every epoch ordinary.
    pub job: Option<crate::sampler::JobPosition>,
    /// The rank's place on its node (version 5): its local rank and the
    /// node's ranks (`LOCAL_RANK`, `LOCAL_WORLD_SIZE`); `None`: not known.
    /// The agent takes the node's ranks to be `rank - local_rank` and the
    /// `local_world - 1` after it (torchrun's and SLURM's block layout) to
    /// choose the node tier's members by their reads.
    pub local: Option<(u16, u16)>,
    /// The sampler's block shuffle (version 6; `LoaderBuilder::shuffle_block`):
    /// 0 or 1, one permutation of the whole dataset (what a version 5
    /// ATTACH means).
    pub shuffle_block: u64,
    /// A mixture's datasets (version 6); `None`: one dataset.
    pub mix: Option<MixAttach>,
}

/// ATTACH flag: the sampler shuffles each epoch.
pub const FLAG_SHUFFLE: u32 = 1;
/// ATTACH flag: the sampler drops each epoch's last partial batch.
pub const FLAG_DROP_LAST: u32 = 2;
/// ATTACH flag: the agent checks every sample it puts in the rank's ring
/// against the catalog's CRC32C (the rank's `verify_crc32c`). An agent
/// that predates the flag refuses the attach (an unknown bit), so a rank
/// that asks for it never reads unchecked bytes.
pub const FLAG_VERIFY_CRC32C: u32 = 4;
/// ATTACH flag: the rank takes samples the agent serves from its node
/// tier in place, as read-only views of the tier's memory, instead of
/// copies into its ring (the rank's `tier_views`). Its segment is layout
/// version 6 with a view table of one word per sample of a batch
/// (`views_per_slot` = batch_size), or 7 with [`FLAG_PEER_WAITS`]. An
/// agent that predates the flag refuses the attach (an unknown bit).
pub const FLAG_TIER_VIEWS: u32 = 8;
/// ATTACH flag: the rank's segment is layout version 7, with a peer-wait
/// table: per batch, the nodes the rank's loader inside the agent waited
/// for longest while it made the batch, so the rank charges its own wait
/// to them (`Stats::stall_causes`' slowest peers). An agent that predates
/// the flag refuses the attach (an unknown bit); the rank then attaches
/// again without it.
pub const FLAG_PEER_WAITS: u32 = 16;
/// ATTACH flag (with [`FLAG_PEER_WAITS`]): the rank's segment is layout
/// version 8, with an extras table after the peer-wait table: per batch,
/// the bytes the rank's loader inside the agent read from the source and
/// where its waits for peers went (the node reading, the node sending,
/// the link; in total and per peer-wait entry), so the rank's
/// `source_bytes` and `peer_read`/`peer_send`/`peer_link` are what an
/// embedded loader's would be. An agent that predates the flag refuses
/// the attach (an unknown bit); the rank then attaches again without it.
pub const FLAG_SLOT_EXTRAS: u32 = 32;
/// Every flag this version knows; another bit is refused.
const KNOWN_FLAGS: u32 = FLAG_SHUFFLE
    | FLAG_DROP_LAST
    | FLAG_VERIFY_CRC32C
    | FLAG_TIER_VIEWS
    | FLAG_PEER_WAITS
    | FLAG_SLOT_EXTRAS;

/// The agent's answer to an accepted ATTACH.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttachedReply {
    /// The generation the agent publishes in (the request's).
    pub generation: Generation,
    /// The agent's process id.
    pub agent_pid: u32,
    /// The agent's heartbeat period in ms (the rank's silence limit is 3 of them).
    pub heartbeat_ms: u32,
    /// Bytes of the node tier whose read-only memfd comes with the reply
    /// (one descriptor), for a rank that asked for tier views
    /// ([`FLAG_TIER_VIEWS`]) and may share the tier; 0 with no descriptor:
    /// every sample comes in the ring.
    pub tier_bytes: u64,
}

pub(super) fn proto(what: impl Into<String>) -> Error {
    Error::AttachProtocol { what: what.into() }
}

fn put_header(b: &mut [u8], kind: u16, version: u16) {
    debug_assert!((ATTACH_OLDEST_VERSION..=ATTACH_VERSION).contains(&version));
    let len = b.len() as u32;
    b[0..4].copy_from_slice(&ATTACH_MAGIC.to_le_bytes());
    b[4..6].copy_from_slice(&version.to_le_bytes());
    b[6..8].copy_from_slice(&kind.to_le_bytes());
    b[8..12].copy_from_slice(&len.to_le_bytes());
}

pub(super) fn u16_at(b: &[u8], o: usize) -> u16 {
    u16::from_le_bytes(b[o..o + 2].try_into().expect("2 bytes"))
}
fn u32_at(b: &[u8], o: usize) -> u32 {
    u32::from_le_bytes(b[o..o + 4].try_into().expect("4 bytes"))
}
fn u64_at(b: &[u8], o: usize) -> u64 {
    u64::from_le_bytes(b[o..o + 8].try_into().expect("8 bytes"))
}

/// Checks the 12-byte header every version shares and returns the kind
/// and the version: magic, then version (one this build speaks), then
/// that the length field is both what arrived and what the kind has in
/// that version.
pub fn check_header(b: &[u8]) -> Result<(u16, u16)> {
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
    if !(ATTACH_OLDEST_VERSION..=ATTACH_VERSION).contains(&version) {
        return Err(proto(format!(
            "message version {version}, this build speaks versions {ATTACH_OLDEST_VERSION} to {ATTACH_VERSION}"
        )));
    }
    let kind = u16_at(b, 6);
    let want = match kind {
        KIND_ATTACH if version == 5 => ATTACH_V5_BYTES,
        KIND_ATTACH if b.len() >= 124 => {
            let datasets = u32_at(b, 120) as usize;
            if datasets > MAX_ATTACH_DATASETS {
                return Err(proto(format!(
                    "an ATTACH for a mixture of {datasets} datasets; the agent reads at most {MAX_ATTACH_DATASETS}"
                )));
            }
            ATTACH_BYTES + datasets * ATTACH_DATASET_BYTES
        }
        KIND_ATTACH => ATTACH_BYTES,
        KIND_ATTACHED => ATTACHED_BYTES,
        KIND_REFUSED => REFUSED_BYTES,
        k => return Err(proto(format!("unknown message kind {k}"))),
    };
    let len = u32_at(b, 8) as usize;
    if len != want || b.len() != want {
        return Err(proto(format!(
            "kind {kind}: length field {len}, received {} bytes; version {version} has {want}",
            b.len()
        )));
    }
    Ok((kind, version))
}

impl AttachRequest {
    /// The version the request is sent in: 6 with a block shuffle or a
    /// mixture, else 5 (which every agent since version 5 reads).
    pub fn version(&self) -> u16 {
        if self.shuffle_block > 1 || self.mix.is_some() {
            6
        } else {
            ATTACH_OLDEST_VERSION
        }
    }

    /// The message's bytes (little-endian), in [`AttachRequest::version`]:
    /// 112 bytes in version 5, 144 and 16 per mixed dataset in version 6.
    pub fn encode(&self) -> Vec<u8> {
        let version = self.version();
        let datasets = self.mix.as_ref().map_or(0, |m| m.counts.len());
        let mut b = vec![
            0u8;
            if version == 5 {
                ATTACH_V5_BYTES
            } else {
                ATTACH_BYTES + datasets * ATTACH_DATASET_BYTES
            }
        ];
        put_header(&mut b, KIND_ATTACH, version);
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
        b[80..84].copy_from_slice(&self.flags.to_le_bytes());
        // 84..88 (version 5): local rank u16, local world u16; both 0
        // when not known. 88..96: end_epoch, 0 for none (an end epoch is
        // after the start epoch, so never 0).
        let (local_rank, local_world) = self.local.unwrap_or((0, 0));
        b[84..86].copy_from_slice(&local_rank.to_le_bytes());
        b[86..88].copy_from_slice(&local_world.to_le_bytes());
        b[88..96].copy_from_slice(&self.end_epoch.unwrap_or(0).to_le_bytes());
        // 96..112 (version 4): the job position the world resumed at, its
        // epoch and the entries consumed; both 0 for ordinary epochs (a
        // resume with nothing consumed deals an ordinary epoch).
        let job = self.job.unwrap_or(crate::sampler::JobPosition {
            epoch: 0,
            consumed: 0,
        });
        b[96..104].copy_from_slice(&job.epoch.to_le_bytes());
        b[104..112].copy_from_slice(&job.consumed.to_le_bytes());
        if version >= 6 {
            // 112..144 (version 6): the block shuffle, the datasets of a
            // mixture (0: one dataset), 4 reserved bytes, where the mixed
            // order starts; then each dataset's count and skip.
            b[112..120].copy_from_slice(&self.shuffle_block.to_le_bytes());
            b[120..124].copy_from_slice(&(datasets as u32).to_le_bytes());
            if let Some(m) = &self.mix {
                b[128..136].copy_from_slice(&m.start_epoch.to_le_bytes());
                b[136..144].copy_from_slice(&m.start_consumed.to_le_bytes());
                for (d, (c, k)) in m.counts.iter().zip(&m.skip).enumerate() {
                    let o = ATTACH_BYTES + d * ATTACH_DATASET_BYTES;
                    b[o..o + 8].copy_from_slice(&c.to_le_bytes());
                    b[o + 8..o + 16].copy_from_slice(&k.to_le_bytes());
                }
            }
        }
        b
    }

    /// Decodes and checks an ATTACH message.
    pub fn decode(b: &[u8]) -> Result<AttachRequest> {
        let (kind, version) = check_header(b)?;
        if kind != KIND_ATTACH {
            return Err(proto(format!("expected ATTACH (kind 1), got kind {kind}")));
        }
        let flags = u32_at(b, 80);
        if flags & !KNOWN_FLAGS != 0 {
            return Err(proto(format!(
                "unknown flags {:#x} in a version {version} ATTACH",
                flags & !KNOWN_FLAGS
            )));
        }
        if flags & FLAG_SLOT_EXTRAS != 0 && flags & FLAG_PEER_WAITS == 0 {
            return Err(proto(format!(
                "flags {flags:#x} in a version {version} ATTACH: flag 32 (extra words) needs flag 16 (peer waits)"
            )));
        }
        let local = match (u16_at(b, 84), u16_at(b, 86)) {
            (0, 0) => None,
            (r, w) if r < w => Some((r, w)),
            (r, w) => {
                return Err(proto(format!(
                    "local rank {r} of {w} ranks on the node (0 0 when not known)"
                )))
            }
        };
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
            flags,
            end_epoch: Some(u64_at(b, 88)).filter(|&e| e != 0),
            job: None,
            local,
            shuffle_block: if version >= 6 { u64_at(b, 112) } else { 0 },
            mix: None,
        };
        let datasets = if version >= 6 {
            u32_at(b, 120) as usize
        } else {
            0
        };
        let r = match (version, datasets) {
            (6, datasets) if datasets > 0 => {
                if u32_at(b, 124) != 0 {
                    return Err(proto("reserved ATTACH bytes 124..128 are not 0"));
                }
                let at =
                    |d: usize, k: usize| u64_at(b, ATTACH_BYTES + d * ATTACH_DATASET_BYTES + k);
                let mix = MixAttach {
                    counts: (0..datasets).map(|d| at(d, 0)).collect(),
                    skip: (0..datasets).map(|d| at(d, 8)).collect(),
                    start_epoch: u64_at(b, 128),
                    start_consumed: u64_at(b, 136),
                };
                if mix.counts.iter().all(|&c| c == 0) {
                    return Err(proto(
                        "a mixture whose every dataset has 0 samples per epoch",
                    ));
                }
                AttachRequest {
                    mix: Some(mix),
                    ..r
                }
            }
            (6, _) if b[124..144].iter().any(|&x| x != 0) => {
                return Err(proto(
                    "ATTACH bytes 124..144 are not 0 without a mixture (they describe one)",
                ))
            }
            _ => r,
        };
        let (job_epoch, consumed) = (u64_at(b, 96), u64_at(b, 104));
        let r = match (job_epoch, consumed) {
            (0, 0) => r,
            (_, 0) => {
                return Err(proto(format!(
                    "job epoch {job_epoch} with no entry consumed (0 0 for ordinary epochs)"
                )))
            }
            (epoch, consumed) if epoch > r.start_epoch => {
                return Err(proto(format!(
                    "job position in epoch {epoch} ({consumed} consumed), after the start epoch {}",
                    r.start_epoch
                )))
            }
            (epoch, consumed) => AttachRequest {
                job: Some(crate::sampler::JobPosition { epoch, consumed }),
                ..r
            },
        };
        if let Some(end) = r.end_epoch.filter(|&end| end <= r.start_epoch) {
            return Err(proto(format!(
                "end_epoch {end} is not after the start epoch {}",
                r.start_epoch
            )));
        }
        // A hint: a place on the node that cannot be this rank's (local
        // rank above its rank, more ranks on the node than in the world)
        // is ignored, as if not known.
        let r = AttachRequest {
            local: r
                .local
                .filter(|&(lr, lw)| u32::from(lr) <= r.rank && u32::from(lw) <= r.world),
            ..r
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
    /// The reply's bytes in `version` (the request's: the layout is the
    /// same in every version this build speaks).
    pub fn encode(&self, version: u16) -> [u8; ATTACHED_BYTES] {
        let mut b = [0u8; ATTACHED_BYTES];
        put_header(&mut b, KIND_ATTACHED, version);
        b[12..16].copy_from_slice(&u32::from(self.generation.get()).to_le_bytes());
        b[16..20].copy_from_slice(&self.agent_pid.to_le_bytes());
        b[20..24].copy_from_slice(&self.heartbeat_ms.to_le_bytes());
        b[24..32].copy_from_slice(&self.tier_bytes.to_le_bytes());
        b
    }
}

/// Encodes a REFUSED reply in `version` (the request's, where it was one
/// this build speaks; else [`ATTACH_VERSION`]).
pub fn encode_refused(version: u16, code: RefuseCode, reason: &str) -> [u8; REFUSED_BYTES] {
    let mut b = [0u8; REFUSED_BYTES];
    put_header(&mut b, KIND_REFUSED, version);
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
    match check_header(b)?.0 {
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
                tier_bytes: u64_at(b, 24),
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agent::segment::segment_bytes;

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
            flags: FLAG_SHUFFLE | FLAG_DROP_LAST | FLAG_VERIFY_CRC32C,
            end_epoch: Some(5),
            job: Some(crate::sampler::JobPosition {
                epoch: 2,
                consumed: 1000,
            }),
            local: Some((1, 2)),
            shuffle_block: 0,
            mix: None,
        }
    }

    #[test]
    fn attach_round_trips_and_checks_its_header() {
        let r = req();
        let b = r.encode();
        assert_eq!(AttachRequest::decode(&b).unwrap(), r);
        assert_eq!((b.len(), u16_at(&b, 4)), (ATTACH_V5_BYTES, 5));
        let mut bad = b.clone();
        bad[0] ^= 1;
        assert!(AttachRequest::decode(&bad)
            .unwrap_err()
            .to_string()
            .contains("magic"));
        let mut bad = b.clone();
        bad[4] = 3;
        assert!(AttachRequest::decode(&bad)
            .unwrap_err()
            .to_string()
            .contains("version 3"));
        let ordinary = AttachRequest {
            job: None,
            ..r.clone()
        };
        let enc = ordinary.encode();
        assert!(enc[96..112].iter().all(|&x| x == 0));
        assert_eq!(AttachRequest::decode(&enc).unwrap(), ordinary);
        let mut bad = b.clone();
        bad[96..104].copy_from_slice(&3u64.to_le_bytes());
        assert!(AttachRequest::decode(&bad)
            .unwrap_err()
            .to_string()
            .contains("after the start epoch 2"));
        let mut bad = enc;
        bad[96..104].copy_from_slice(&1u64.to_le_bytes());
        assert!(AttachRequest::decode(&bad)
            .unwrap_err()
            .to_string()
            .contains("no entry consumed"));
        let open_ended = AttachRequest {
            end_epoch: None,
            ..r.clone()
        };
        assert_eq!(
            AttachRequest::decode(&open_ended.encode()).unwrap(),
            open_ended
        );
        let mut bad = b.clone();
        bad[88..96].copy_from_slice(&2u64.to_le_bytes());
        assert!(AttachRequest::decode(&bad)
            .unwrap_err()
            .to_string()
            .contains("end_epoch 2 is not after the start epoch 2"));
        let unknown = AttachRequest { local: None, ..r };
        let enc = unknown.encode();
        assert!(enc[84..88].iter().all(|&x| x == 0));
        assert_eq!(AttachRequest::decode(&enc).unwrap(), unknown);
        let mut bad = b.clone();
        bad[84] = 2; // local rank 2 of 2
        assert!(AttachRequest::decode(&bad)
            .unwrap_err()
            .to_string()
            .contains("local rank 2 of 2"));
        let mut odd = b.clone();
        odd[86] = 5; // 5 ranks on the node, world 4: ignored
        assert_eq!(AttachRequest::decode(&odd).unwrap().local, None);
        let mut views = b.clone();
        views[80] |= 8; // tier views
        assert_eq!(
            AttachRequest::decode(&views).unwrap().flags & FLAG_TIER_VIEWS,
            8
        );
        let mut peers = b.clone();
        peers[80] |= 16; // peer waits
        assert_eq!(
            AttachRequest::decode(&peers).unwrap().flags & FLAG_PEER_WAITS,
            16
        );
        // Extra words (flag 32) with peer waits; alone, refused by name.
        let mut extras = b.clone();
        extras[80] |= 16 | 32;
        assert_eq!(
            AttachRequest::decode(&extras).unwrap().flags & (FLAG_PEER_WAITS | FLAG_SLOT_EXTRAS),
            48
        );
        let mut alone = b.clone();
        alone[80] |= 32;
        let e = AttachRequest::decode(&alone).unwrap_err().to_string();
        assert!(e.contains("flag 32 (extra words) needs flag 16"), "{e}");
        let mut bad = b.clone();
        bad[80] |= 64;
        assert!(AttachRequest::decode(&bad)
            .unwrap_err()
            .to_string()
            .contains("unknown flags 0x40"));
        assert!(AttachRequest::decode(&b[..111])
            .unwrap_err()
            .to_string()
            .contains("received 111"));
        let mut bad = b.clone();
        bad[8] = 97;
        assert!(AttachRequest::decode(&bad)
            .unwrap_err()
            .to_string()
            .contains("length field 97"));
    }

    #[test]
    fn a_block_shuffle_is_sent_in_version_6_and_only_then() {
        let r = AttachRequest {
            shuffle_block: 4096,
            ..req()
        };
        let b = r.encode();
        assert_eq!((b.len(), u16_at(&b, 4), r.version()), (ATTACH_BYTES, 6, 6));
        assert_eq!(AttachRequest::decode(&b).unwrap(), r);
        // A whole-dataset shuffle (0 or 1) needs nothing newer than 5.
        for whole in [0, 1] {
            let w = AttachRequest {
                shuffle_block: whole,
                ..req()
            };
            assert_eq!(w.version(), 5);
            assert_eq!(w.encode().len(), ATTACH_V5_BYTES);
        }
        // Each version has its own length: a version 6 header on version
        // 5's 112 bytes (and the reverse) is refused.
        let mut short = r.encode()[..ATTACH_V5_BYTES].to_vec();
        short[8..12].copy_from_slice(&(ATTACH_V5_BYTES as u32).to_le_bytes());
        assert!(AttachRequest::decode(&short)
            .unwrap_err()
            .to_string()
            .contains("version 6 has 144"));
        let mut long = req().encode();
        long.extend_from_slice(&[0; 8]);
        long[8..12].copy_from_slice(&(ATTACH_BYTES as u32).to_le_bytes());
        assert!(AttachRequest::decode(&long)
            .unwrap_err()
            .to_string()
            .contains("version 5 has 112"));
        let mut v7 = b;
        v7[4] = 7;
        assert!(AttachRequest::decode(&v7)
            .unwrap_err()
            .to_string()
            .contains("message version 7, this build speaks versions 5 to 6"));
    }

    #[test]
    fn a_mixture_is_sent_in_version_6_with_its_datasets() {
        let mix = MixAttach {
            counts: vec![120, 60, 5],
            skip: vec![40, 0, 3],
            start_epoch: 2,
            start_consumed: 1000,
        };
        let r = AttachRequest {
            mix: Some(mix.clone()),
            ..req()
        };
        let b = r.encode();
        assert_eq!(r.version(), 6);
        assert_eq!(b.len(), ATTACH_BYTES + 3 * ATTACH_DATASET_BYTES);
        assert_eq!(AttachRequest::decode(&b).unwrap(), r);
        // The job position is the rank's deal's own (a rank position
        // restored later moves it, not the mixed order's start).
        let other_job = AttachRequest {
            job: Some(crate::sampler::JobPosition {
                epoch: 2,
                consumed: 999,
            }),
            ..r.clone()
        };
        assert_eq!(
            AttachRequest::decode(&other_job.encode()).unwrap(),
            other_job
        );
        // A count of datasets the message does not hold, too many, every
        // count 0, reserved bytes set: refused by name.
        let mut short = b.clone();
        short.truncate(b.len() - ATTACH_DATASET_BYTES);
        let n = short.len() as u32;
        short[8..12].copy_from_slice(&n.to_le_bytes());
        assert!(AttachRequest::decode(&short)
            .unwrap_err()
            .to_string()
            .contains(&format!("version 6 has {}", b.len())));
        let mut many = b.clone();
        many[120..124].copy_from_slice(&(MAX_ATTACH_DATASETS as u32 + 1).to_le_bytes());
        assert!(AttachRequest::decode(&many)
            .unwrap_err()
            .to_string()
            .contains("a mixture of 1025 datasets"));
        let zero = AttachRequest {
            mix: Some(MixAttach {
                counts: vec![0, 0],
                skip: vec![0, 0],
                start_epoch: 0,
                start_consumed: 0,
            }),
            job: None,
            ..req()
        };
        assert!(AttachRequest::decode(&zero.encode())
            .unwrap_err()
            .to_string()
            .contains("0 samples per epoch"));
        let mut reserved = b.clone();
        reserved[124] = 1;
        assert!(AttachRequest::decode(&reserved)
            .unwrap_err()
            .to_string()
            .contains("reserved"));
        let mut stray = AttachRequest {
            shuffle_block: 8,
            ..req()
        }
        .encode();
        stray[130] = 1;
        assert!(AttachRequest::decode(&stray)
            .unwrap_err()
            .to_string()
            .contains("without a mixture"));
        assert!(ATTACH_MAX_BYTES >= b.len());
    }

    #[test]
    fn replies_are_read_in_either_version() {
        for version in [5, 6] {
            let ok = AttachedReply {
                generation: Generation::FIRST,
                agent_pid: 9,
                heartbeat_ms: 100,
                tier_bytes: 0,
            };
            let b = ok.encode(version);
            assert_eq!(u16_at(&b, 4), version);
            assert_eq!(decode_reply(&b).unwrap(), ok);
            let shared = AttachedReply {
                tier_bytes: 1 << 30,
                ..ok
            };
            assert_eq!(u64_at(&shared.encode(version), 24), 1 << 30);
            assert_eq!(decode_reply(&shared.encode(version)).unwrap(), shared);
            assert_eq!(decode_reply(&b).unwrap(), ok);
            let b = encode_refused(version, RefuseCode::Agent, "why");
            assert!(matches!(
                decode_reply(&b),
                Err(Error::AttachRefused { code: "agent", .. })
            ));
        }
    }

    #[test]
    fn refused_carries_code_and_reason() {
        let b = encode_refused(ATTACH_VERSION, RefuseCode::PeerUid, "no");
        match decode_reply(&b) {
            Err(Error::AttachRefused { code, reason }) => {
                assert_eq!((code, reason.as_str()), ("peer_uid", "no"))
            }
            other => panic!("{other:?}"),
        }
    }
}
