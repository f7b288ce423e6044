//! Repair: re-copy exactly the samples `verify` found corrupt or missing from
//! the source into their places in the extents, each checked against the
//! catalog's CRC32C, without touching the rest of the space.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::Path;

use super::catalog::SpanReader;
use super::preload::SpaceLock;
use super::space::{BadExtent, BadKind, BadSample, Space, VerifyReport};
use crate::error::{Error, IoContext, Result, SourceChange};

/// What [`repair`] did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RepairReport {
    /// Ids of the samples copied again, ascending.
    pub repaired: Vec<u64>,
    /// Bytes copied.
    pub bytes: u64,
    /// Extent files that were missing and were recreated.
    pub recreated_extents: Vec<u32>,
    /// Extent files whose length was not the manifest's and was set back
    /// to it ([`VerifyReport::bad_extents`]).
    pub resized_extents: Vec<u32>,
}

/// Repairs everything [`Space::verify`] found: the bad samples (as
/// [`repair`]) and the extents of the wrong length, which get their planned
/// length back (bytes appended past it are dropped; the samples a short
/// extent lost are among the bad samples and are copied again).
pub fn repair_verified(dir: &Path, report: &VerifyReport) -> Result<RepairReport> {
    repair_all(dir, &report.bad, &report.bad_extents)
}

/// Re-copies the samples in `bad` (from [`Space::verify`]) into the space at
/// `dir`, under the space's exclusive lock. Samples with [`BadKind::Io`] are
/// refused: an I/O error is not damage and copying would not fix its cause.
/// The source must still match the catalog for those samples: each one's
/// CRC32C is checked as it is copied, and a mismatch stops the repair with
/// [`Error::SourceChanged`] naming the file (that sample stays bad, the ones
/// before it are repaired; `preload --refresh` is the way then).
pub fn repair(dir: &Path, bad: &[BadSample]) -> Result<RepairReport> {
    repair_all(dir, bad, &[])
}

fn repair_all(dir: &Path, bad: &[BadSample], bad_extents: &[BadExtent]) -> Result<RepairReport> {
    if let Some(b) = bad.iter().find(|b| b.kind == BadKind::Io) {
        return Err(Error::InvalidConfig(format!(
            "sample {} could not be read ({}); an I/O error is not repaired by copying: fix its cause and verify again",
            b.id, b.what
        )));
    }
    let _lock = SpaceLock::exclusive(dir)?;
    let space = Space::open(dir)?;
    let cat = space.catalog();
    let mut ids: Vec<u64> = bad.iter().map(|b| b.id).collect();
    ids.sort_unstable();
    ids.dedup();
    let mut report = RepairReport::default();
    let mut reader = SpanReader::new(&cat.source_spec());
    // A recreated extent gets the permissions the catalog has (preload gave
    // both its --file-mode).
    let mode = {
        use std::os::unix::fs::PermissionsExt;
        std::fs::metadata(cat.path())
            .map(|m| m.permissions().mode() & 0o777)
            .unwrap_or(0o600)
    };
    let mut open: Option<(u32, File)> = None;
    let mut touched: Vec<u32> = Vec::new();
    for b in bad_extents {
        let Some(&want) = space.extent_lens().get(b.index as usize) else {
            return Err(Error::InvalidConfig(format!(
                "extent {} is not in the space ({} extents)",
                b.index,
                space.extent_lens().len()
            )));
        };
        let p = space.extent_path(b.index);
        let f = OpenOptions::new().write(true).open(&p).ctx("open", &p)?;
        if f.metadata().ctx("stat", &p)?.len() != want {
            f.set_len(want).ctx("truncate", &p)?;
            report.resized_extents.push(b.index);
            touched.push(b.index);
        }
    }
    for &id in &ids {
        if id >= cat.len() {
            return Err(Error::InvalidConfig(format!(
                "sample {id} is not in the catalog ({} samples)",
                cat.len()
            )));
        }
        let Some(loc) = space.location(id) else {
            return Err(Error::InvalidConfig(format!(
                "sample {id} is not held by this node"
            )));
        };
        let p = space.extent_path(loc.extent);
        if open.as_ref().is_none_or(|(e, _)| *e != loc.extent) {
            let f = match OpenOptions::new().write(true).open(&p) {
                Ok(f) => f,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    use std::os::unix::fs::OpenOptionsExt;
                    let f = OpenOptions::new()
                        .write(true)
                        .create_new(true)
                        .mode(mode)
                        .open(&p)
                        .ctx("create", &p)?;
                    report.recreated_extents.push(loc.extent);
                    f
                }
                Err(e) => return Err(Error::io("open", &p, e)),
            };
            // A truncated or recreated extent gets its planned length back.
            let want = space.extent_lens()[loc.extent as usize];
            if f.metadata().ctx("stat", &p)?.len() != want {
                f.set_len(want).ctx("truncate", &p)?;
            }
            open = Some((loc.extent, f));
            touched.push(loc.extent);
        }
        let f = &open.as_ref().expect("just opened").1;
        // Streamed through the reader's buffer (memory stays bounded); the
        // CRC32C is checked as the bytes go by. A mismatch leaves the sample
        // as bad as it was and names the source file.
        let s = cat.sample(id);
        let (mut pos, mut crc) = (0u64, 0u32);
        reader.read(
            s.file,
            cat.file(s.file).name,
            cat.file(s.file).etag,
            s.offset,
            s.len as u64,
            |piece| {
                crc = crc32c::crc32c_append(crc, piece);
                f.write_all_at(piece, loc.offset + pos).ctx("write", &p)?;
                pos += piece.len() as u64;
                Ok(())
            },
        )?;
        if crc != s.crc32c {
            return Err(Error::SourceChanged {
                changes: vec![SourceChange {
                    path: cat.file_path(s.file),
                    what: format!(
                        "content of sample {id} changed (crc32c {crc:#010x}, catalog says {:#010x}); it cannot be repaired from this source (samples before it were repaired)",
                        s.crc32c
                    ),
                }],
            });
        }
        report.repaired.push(id);
        report.bytes += s.len as u64;
    }
    drop(open);
    touched.sort_unstable();
    touched.dedup();
    for e in touched {
        let p = space.extent_path(e);
        let f = OpenOptions::new().write(true).open(&p).ctx("open", &p)?;
        f.sync_all().ctx("fsync", &p)?;
        crate::sys::drop_cache(&f, 0, 0);
    }
    Ok(report)
}
