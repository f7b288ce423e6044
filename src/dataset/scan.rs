//! What a source scan produces and the rules both scanners share: the
//! options and notes of a scan, the scanned files and samples, the largest
//! sample and WebDataset member keys. Below `source.rs` (directories, lists,
//! the scan's driver) and `shard.rs` (tar shards), which both use it, so
//! neither depends on the other's internals.

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// Marks a sample without a label.
pub const NO_LABEL: u32 = u32::MAX;

/// The largest sample kspeed accepts (lengths are stored as u32).
pub const MAX_SAMPLE_BYTES: u64 = u32::MAX as u64;

/// How a scan treats entries that are not plain samples. `Default` is the
/// strict setting: anything that could lose or invent a sample is an error.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ScanOptions {
    /// Skip FIFOs, devices and sockets (counted in [`ScanNotes`]) instead of
    /// refusing them with [`Error::NotRegularFile`], and dangling symbolic
    /// links instead of refusing them with [`Error::DanglingSymlink`].
    pub skip_special: bool,
    /// Follow symbolic links that lead outside the source tree instead of
    /// refusing them with [`Error::SymlinkOutsideSource`].
    pub follow_symlinks: bool,
    /// In tar shards, skip a damaged member header to the next intact one
    /// (each skip reported in [`ScanNotes`]) instead of failing with
    /// [`Error::BadTar`].
    pub skip_bad_members: bool,
    /// Tar shards: make each sample the listed members of its key (by
    /// extension, e.g. `["jpg", "json", "txt"]`), in this order, instead of
    /// its first non-`.cls` member. Every key must have every listed member.
    /// The sample's bytes are the shard's contiguous range from the first to
    /// the last of them (tar headers between them included); the catalog
    /// records each member's offset and length inside that range
    /// ([`crate::dataset::Catalog::sample_members`]). Empty: one member per
    /// sample.
    pub members: Vec<String>,
}

setters!(ScanOptions {
    skip_special: bool,
    follow_symlinks: bool,
    skip_bad_members: bool,
    members: Vec<String>,
});

/// What a scan noticed without failing: every entry it did not turn into a
/// sample, so nothing is dropped without a word.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ScanNotes {
    /// One line per thing the user should know (skipped entries, damaged
    /// members skipped, a directory of `.tar` files read as plain files).
    pub warnings: Vec<String>,
    /// Entries skipped because they are not regular files, or are dangling
    /// symbolic links (`skip_special`).
    pub skipped_special: u64,
    /// Damaged tar headers skipped (`skip_bad_members`).
    pub skipped_bad_members: u64,
    /// Tar members that belong to a sample's key but are not its data member
    /// (captions, metadata, ...), counted by extension.
    pub dropped_members: std::collections::BTreeMap<String, u64>,
    /// The members that make a sample (`--members`), if they were given:
    /// what the dropped ones' note says a sample is.
    pub sample_members: Vec<String>,
}

impl ScanNotes {
    /// Members not delivered, in total.
    pub fn dropped_member_count(&self) -> u64 {
        self.dropped_members.values().sum()
    }

    /// Every note as a line for the user (warnings, then dropped members).
    pub fn lines(&self) -> Vec<String> {
        let mut v = self.warnings.clone();
        if !self.dropped_members.is_empty() {
            let by_ext: Vec<String> = self
                .dropped_members
                .iter()
                .map(|(e, n)| format!(".{e}: {n}"))
                .collect();
            let rule = if self.sample_members.is_empty() {
                "the first member of its key that is not .cls".to_string()
            } else {
                format!(
                    "its key's {} members (--members)",
                    self.sample_members
                        .iter()
                        .map(|m| format!(".{m}"))
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            };
            v.push(format!(
                "{} tar member(s) are not part of any sample ({}): a sample is {rule}",
                self.dropped_member_count(),
                by_ext.join(", ")
            ));
        }
        v
    }
}

/// A source file as found when scanning.
#[derive(Debug, Clone)]
pub(crate) struct ScannedFile {
    /// Path relative to the source root (or absolute, from a file list).
    pub name: PathBuf,
    /// Size in bytes.
    pub size: u64,
    /// Modification time, nanoseconds since the Unix epoch.
    pub mtime_ns: i64,
    /// An object's ETag (object-store sources); empty for files.
    pub tag: Vec<u8>,
}

/// A sample as found when scanning (its CRC comes later, from reading it).
#[derive(Debug, Clone, Copy)]
pub(crate) struct ScannedSample {
    /// Index into the file table.
    pub file: u32,
    /// Byte offset inside that file (0 except for tar members).
    pub offset: u64,
    /// Length in bytes.
    pub len: u32,
    /// Label, or [`NO_LABEL`].
    pub label: u32,
}

/// The sample length of a file or member of `len` bytes, refused past
/// [`MAX_SAMPLE_BYTES`].
pub(crate) fn check_len(path: &Path, len: u64) -> Result<u32> {
    if len > MAX_SAMPLE_BYTES {
        return Err(Error::SampleTooLarge {
            path: path.to_path_buf(),
            len,
            max: MAX_SAMPLE_BYTES,
        });
    }
    Ok(len as u32)
}

/// Splits a WebDataset member path into (key, extension): the key is the path
/// up to the first `.` of the file name. Bytes, so names that are not UTF-8
/// keep their identity.
pub(crate) fn split_key(member: &[u8]) -> (&[u8], &[u8]) {
    let base_start = member
        .iter()
        .rposition(|&b| b == b'/')
        .map(|i| i + 1)
        .unwrap_or(0);
    match member[base_start..].iter().position(|&b| b == b'.') {
        Some(dot) => (&member[..base_start + dot], &member[base_start + dot + 1..]),
        None => (member, b""),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn webdataset_keys() {
        assert_eq!(split_key(b"0001.jpg"), (&b"0001"[..], &b"jpg"[..]));
        assert_eq!(
            split_key(b"a/b/0001.seg.png"),
            (&b"a/b/0001"[..], &b"seg.png"[..])
        );
        assert_eq!(split_key(b"dir.x/0001"), (&b"dir.x/0001"[..], &b""[..]));
    }
}
