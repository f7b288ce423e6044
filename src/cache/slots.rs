//! The cache area's shared pieces: its journal records, the atomic word per
//! slot that says what the slot holds right now, its counters, and the
//! state the pollers, the planner and the writer thread share (area.rs
//! opens an area; writer.rs writes it).

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicU64;

use crate::error::{IoContext, Result};

/// A journal record's size.
pub(crate) const RECORD_BYTES: usize = 32;
const RECORD_MAGIC: u32 = 0x4A43_534B; // "KSCJ" little-endian
pub(crate) const REC_FULL: u32 = 1;
pub(crate) const REC_EMPTY: u32 = 2;

/// One journal record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Record {
    pub kind: u32,
    pub slot: u32,
    pub id: u64,
    pub len: u32,
    pub crc: u32,
}

impl Record {
    pub(crate) fn encode(&self) -> [u8; RECORD_BYTES] {
        let mut b = [0u8; RECORD_BYTES];
        b[0..4].copy_from_slice(&RECORD_MAGIC.to_le_bytes());
        b[4..8].copy_from_slice(&self.kind.to_le_bytes());
        b[8..12].copy_from_slice(&self.slot.to_le_bytes());
        b[12..16].copy_from_slice(&self.len.to_le_bytes());
        b[16..24].copy_from_slice(&self.id.to_le_bytes());
        b[24..28].copy_from_slice(&self.crc.to_le_bytes());
        let c = crc32c::crc32c(&b[..28]);
        b[28..32].copy_from_slice(&c.to_le_bytes());
        b
    }

    /// The record in `b`, or None when it is torn or not a record.
    pub(crate) fn decode(b: &[u8]) -> Option<Record> {
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        if b.len() < RECORD_BYTES
            || u32_at(0) != RECORD_MAGIC
            || crc32c::crc32c(&b[..28]) != u32_at(28)
        {
            return None;
        }
        let kind = u32_at(4);
        if kind != REC_FULL && kind != REC_EMPTY {
            return None;
        }
        Some(Record {
            kind,
            slot: u32_at(8),
            len: u32_at(12),
            id: u64::from_le_bytes(b[16..24].try_into().expect("8 bytes")),
            crc: u32_at(24),
        })
    }
}

/// A slot's state in one word: bits 0-39 the sample id + 1 (0: none),
/// bits 40-41 the state, bits 42-63 the pollers reading it now.
pub(crate) struct SlotWord;

const ID_MASK: u64 = (1 << 40) - 1;
const STATE_SHIFT: u32 = 40;
const READER_SHIFT: u32 = 42;
pub(crate) const READER_ONE: u64 = 1 << READER_SHIFT;
pub(crate) const S_EMPTY: u64 = 0;
pub(crate) const S_WRITING: u64 = 1;
pub(crate) const S_FULL: u64 = 2;

/// Sample ids the area can name (40 bits, minus the "none").
pub const MAX_CACHED_ID: u64 = ID_MASK - 1;

impl SlotWord {
    pub(crate) fn pack(id: Option<u64>, state: u64) -> u64 {
        id.map_or(0, |i| i + 1) | (state << STATE_SHIFT)
    }
    pub(crate) fn id(w: u64) -> Option<u64> {
        (w & ID_MASK).checked_sub(1)
    }
    pub(crate) fn state(w: u64) -> u64 {
        (w >> STATE_SHIFT) & 3
    }
    pub(crate) fn readers(w: u64) -> u64 {
        w >> READER_SHIFT
    }
}

/// What the area counts (cumulative over the loader's life).
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub hits: AtomicU64,
    pub planned_hits: AtomicU64,
    pub hit_bytes: AtomicU64,
    pub writes: AtomicU64,
    pub write_bytes: AtomicU64,
    pub skipped: AtomicU64,
    pub corrupt: AtomicU64,
    pub write_errors: AtomicU64,
}

/// State shared by the pollers, the planner and the writer thread.
pub(crate) struct AreaShared {
    pub dir: PathBuf,
    pub data: File,
    pub direct: bool,
    /// The area is in memory (`MEMORY_DIR`), not in a folder.
    pub in_memory: bool,
    pub classes: super::SlotClasses,
    pub words: Box<[AtomicU64]>,
    pub counters: Counters,
}

/// Writes `recs` as a whole journal at `path`: a temporary file beside it
/// (`cache.journal.tmp`), synced, renamed over it. Returns the new
/// journal, open for appending. The folder's sync after the rename is the
/// caller's (until then a crash may leave the old journal, which is whole
/// too).
pub(crate) fn write_journal(path: &Path, recs: &[Record]) -> Result<File> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let tmp = path.with_extension("journal.tmp");
    match std::fs::remove_file(&tmp) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(crate::Error::io("remove", &tmp, e)),
    }
    // 0600, as the journal it replaces (area.rs: the area is private).
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)
        .ctx("create", &tmp)?;
    let mut bytes = Vec::with_capacity(recs.len() * RECORD_BYTES);
    for r in recs {
        bytes.extend_from_slice(&r.encode());
    }
    f.write_all(&bytes).ctx("write", &tmp)?;
    f.sync_all().ctx("fsync", &tmp)?;
    std::fs::rename(&tmp, path).ctx("rename", path)?;
    Ok(f)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A rewritten journal (compaction, a replay that dropped records)
    /// stays private: 0600 whatever the umask lets through.
    #[test]
    fn a_rewritten_journal_is_0600() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cache.journal");
        std::fs::write(&path, b"").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let r = Record {
            kind: REC_FULL,
            slot: 1,
            id: 2,
            len: 3,
            crc: 4,
        };
        drop(write_journal(&path, &[r]).unwrap());
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        assert_eq!(std::fs::read(&path).unwrap(), r.encode());
    }

    #[test]
    fn records_round_trip_and_torn_ones_are_refused() {
        let r = Record {
            kind: REC_FULL,
            slot: 7,
            id: 123_456_789,
            len: 4096,
            crc: 0xDEAD_BEEF,
        };
        let b = r.encode();
        assert_eq!(Record::decode(&b), Some(r));
        for i in 0..RECORD_BYTES {
            let mut t = b;
            t[i] ^= 1;
            assert_eq!(Record::decode(&t), None, "byte {i} flipped");
        }
        assert_eq!(Record::decode(&b[..31]), None);
    }

    #[test]
    fn slot_words_pack_ids_states_and_readers() {
        let w = SlotWord::pack(Some(MAX_CACHED_ID), S_FULL);
        assert_eq!(SlotWord::id(w), Some(MAX_CACHED_ID));
        assert_eq!(SlotWord::state(w), S_FULL);
        assert_eq!(SlotWord::readers(w + 3 * READER_ONE), 3);
        assert_eq!(SlotWord::id(SlotWord::pack(None, S_EMPTY)), None);
    }
}
