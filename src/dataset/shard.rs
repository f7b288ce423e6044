//! Indexing WebDataset tar shards in place: every member's (offset, length)
//! in the shard, grouped into samples by key, without extracting anything.
//!
//! A shard is read header by header. Nothing is lost without a word:
//!
//! - a damaged member header (zeroed, or with a bad checksum) in the middle of
//!   a shard is [`Error::BadTar`] naming the shard and the header's byte
//!   offset, because every member after it would otherwise vanish. With
//!   [`ScanOptions::skip_bad_members`] the scan moves on to the next intact
//!   header and reports each skip in [`ScanNotes`];
//! - sparse members (GNU `S` headers, PAX `GNU.sparse.*`) are refused by name:
//!   their bytes in the shard are not the file's bytes;
//! - links, devices and FIFOs stored as members are not samples; they are
//!   counted in [`ScanNotes::warnings`];
//! - members of a key other than its sample member (`.json`, `.txt`, ...) are
//!   counted by extension in [`ScanNotes::dropped_members`].

use std::fs::File;
use std::io::{BufReader, Read, Seek, SeekFrom};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::FileExt;
use std::path::Path;

use super::scan::{check_len, split_key, ScanNotes, ScanOptions, ScannedSample, NO_LABEL};
use crate::error::{Error, IoContext, Result};

const BLOCK: u64 = 512;

/// The key being assembled: its members other than `.cls` (extension,
/// data offset, length, name, CRC32C of the data), in shard order, and its
/// label.
struct Group {
    key: Vec<u8>,
    members: Vec<Member>,
    label: u32,
}

/// A member of a key: extension, data offset, length, name, CRC32C.
type Member = (Vec<u8>, u64, u64, Vec<u8>, u32);

/// Where a shard's samples go.
struct Out<'a> {
    shard: &'a Path,
    file: u32,
    members: &'a [String],
    notes: &'a mut ScanNotes,
    samples: &'a mut Vec<ScannedSample>,
    parts: &'a mut Vec<(u32, u32)>,
    /// Each sample's CRC32C, computed from the data as the index pass
    /// reads it (one member per sample); None once a sample's could not
    /// be (a multi-member span holds tar headers the pass does not keep).
    crcs: &'a mut Option<Vec<u32>>,
}

/// Positional reads of a shard: a file, or an object read by ranged GETs
/// (`store_scan.rs`).
pub(crate) trait ReadAt {
    /// Reads at most `buf.len()` bytes at `pos`; 0 at the end.
    fn read_at(&self, buf: &mut [u8], pos: u64) -> std::io::Result<usize>;
}

impl ReadAt for File {
    fn read_at(&self, buf: &mut [u8], pos: u64) -> std::io::Result<usize> {
        FileExt::read_at(self, buf, pos)
    }
}

/// A cursor over a [`ReadAt`]: what the tar reader reads from.
struct Cursor<'a, R> {
    f: &'a R,
    pos: u64,
}

impl<R: ReadAt> Read for Cursor<'_, R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.f.read_at(buf, self.pos)?;
        self.pos += n as u64;
        Ok(n)
    }
}

impl<R: ReadAt> Seek for Cursor<'_, R> {
    fn seek(&mut self, to: SeekFrom) -> std::io::Result<u64> {
        match to {
            SeekFrom::Start(p) => self.pos = p,
            SeekFrom::Current(d) => self.pos = self.pos.saturating_add_signed(d),
            SeekFrom::End(_) => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::Unsupported,
                    "seek from the end of a shard",
                ))
            }
        }
        Ok(self.pos)
    }
}

/// Indexes `shard` (file index `file`, `shard_size` bytes) into `out`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn index_shard(
    shard: &Path,
    file: u32,
    shard_size: u64,
    opts: &ScanOptions,
    notes: &mut ScanNotes,
    samples: &mut Vec<ScannedSample>,
    parts: &mut Vec<(u32, u32)>,
    crcs: &mut Option<Vec<u32>>,
) -> Result<()> {
    let f = File::open(shard).ctx("open", shard)?;
    index_shard_at(
        &f, shard, file, shard_size, opts, notes, samples, parts, crcs,
    )
}

/// [`index_shard`] reading through `f`; `shard` names it in messages.
#[allow(clippy::too_many_arguments)]
pub(crate) fn index_shard_at<R: ReadAt>(
    f: &R,
    shard: &Path,
    file: u32,
    shard_size: u64,
    opts: &ScanOptions,
    notes: &mut ScanNotes,
    samples: &mut Vec<ScannedSample>,
    parts: &mut Vec<(u32, u32)>,
    crcs: &mut Option<Vec<u32>>,
) -> Result<()> {
    let mut out = Out {
        shard,
        file,
        members: &opts.members,
        notes,
        samples,
        parts,
        crcs,
    };
    // The index pass reads every member's data anyway (a tar reader skips
    // it by reading it): its CRC32C is taken on the way.
    let mut data = vec![0u8; 1 << 16];
    let notes_warn = |out: &mut Out<'_>, w: String| out.notes.warnings.push(w);
    let bad = |reason: String| Error::BadTar {
        path: shard.to_path_buf(),
        reason,
    };
    let mut group: Option<Group> = None;
    // Where the current pass over the shard starts (0, or the intact header
    // found after a damaged one).
    let mut start = 0u64;
    loop {
        let mut reader = BufReader::with_capacity(1 << 16, Cursor { f, pos: 0 });
        reader.seek(SeekFrom::Start(start)).ctx("seek", shard)?;
        let mut archive = tar::Archive::new(reader);
        // End of the last intact member's data, block-rounded: where the next
        // header must start.
        let mut next_header = start;
        let mut damage: Option<String> = None;
        let entries = archive.entries().map_err(|e| bad(e.to_string()))?;
        for entry in entries {
            let mut entry = match entry {
                Ok(e) => e,
                Err(e) => {
                    damage = Some(format!("unreadable member header ({e})"));
                    break;
                }
            };
            let offset = start + entry.raw_file_position();
            let len = entry.size();
            next_header = offset + len.next_multiple_of(BLOCK);
            let name = entry.path_bytes().into_owned();
            let shown = String::from_utf8_lossy(&name).into_owned();
            let header_at = start + entry.raw_header_position();
            let et = entry.header().entry_type();
            // PAX sparse members (GNU tar --sparse --format=pax) carry
            // GNU.sparse.* records; the real name is GNU.sparse.name.
            let mut sparse_pax = false;
            let mut shown = shown;
            if let Ok(Some(exts)) = entry.pax_extensions() {
                for e in exts.flatten() {
                    if e.key_bytes().starts_with(b"GNU.sparse") {
                        sparse_pax = true;
                        if e.key_bytes() == b"GNU.sparse.name" {
                            shown = String::from_utf8_lossy(e.value_bytes()).into_owned();
                        }
                    }
                }
            }
            if et == tar::EntryType::GNUSparse || sparse_pax {
                return Err(bad(format!(
                    "member {shown} (header at byte {header_at}) is a sparse file; its bytes in the shard are not the file's bytes. Sparse members are not supported: re-create the shard without --sparse"
                )));
            }
            match et {
                tar::EntryType::Regular | tar::EntryType::Continuous => {}
                tar::EntryType::Directory => continue,
                other => {
                    notes_warn(
                        &mut out,
                        format!(
                            "{}: member {shown} (header at byte {header_at}) is not a regular file ({other:?}), not a sample",
                            shard.display()
                        ),
                    );
                    continue;
                }
            }
            if offset + len > shard_size {
                return Err(bad(format!(
                    "member {shown} ends at byte {} but the shard has {shard_size} bytes (truncated?)",
                    offset + len
                )));
            }
            let (key, ext) = split_key(&name);
            if group.as_ref().is_none_or(|g| g.key != key) {
                flush(&mut out, group.take())?;
                group = Some(Group {
                    key: key.to_vec(),
                    members: Vec::new(),
                    label: NO_LABEL,
                });
            }
            let g = group.as_mut().expect("just set");
            if ext == b"cls" {
                let mut text = String::new();
                entry
                    .by_ref()
                    .take(64)
                    .read_to_string(&mut text)
                    .map_err(|e| bad(format!("member {shown}: {e}")))?;
                g.label = match text.trim().parse::<u32>() {
                    Ok(v) if v != NO_LABEL => v,
                    _ => {
                        return Err(bad(format!(
                            "member {shown}: label {:?} is not an integer",
                            text.trim()
                        )))
                    }
                };
            } else {
                let mut crc = 0u32;
                loop {
                    let n = entry
                        .read(&mut data)
                        .map_err(|e| bad(format!("member {shown}: {e}")))?;
                    if n == 0 {
                        break;
                    }
                    crc = crc32c::crc32c_append(crc, &data[..n]);
                }
                g.members
                    .push((ext.to_vec(), offset, len, name.clone(), crc));
            }
        }
        // The tar reader stops at the first all-zero block, which is the end
        // of the archive only if nothing but zeros follows.
        if damage.is_none() {
            if let Some(at) = first_nonzero(f, next_header, shard_size).ctx("read", shard)? {
                damage = Some(format!(
                    "zeroed member header, but data follows (first non-zero byte at {at})"
                ));
            }
        }
        let Some(why) = damage else {
            break;
        };
        if !opts.skip_bad_members {
            return Err(bad(format!(
                "damaged member header at byte {next_header}: {why}; the members after it would be lost (--skip-bad-members skips to the next intact header)"
            )));
        }
        let resume = next_intact_header(f, next_header + BLOCK, shard_size).ctx("read", shard)?;
        out.notes.skipped_bad_members += 1;
        out.notes.warnings.push(match resume {
            Some(at) => format!(
                "{}: damaged member header at byte {next_header} ({why}); skipped to the intact header at byte {at}",
                shard.display()
            ),
            None => format!(
                "{}: damaged member header at byte {next_header} ({why}); no intact header after it, the rest of the shard is skipped",
                shard.display()
            ),
        });
        match resume {
            Some(at) => start = at,
            None => break,
        }
    }
    flush(&mut out, group.take())
}

fn flush(out: &mut Out<'_>, g: Option<Group>) -> Result<()> {
    let Some(g) = g else {
        return Ok(());
    };
    let shard = out.shard;
    let key = || String::from_utf8_lossy(&g.key).into_owned();
    if g.members.is_empty() {
        out.notes.warnings.push(format!(
            "{}: key {} has only a .cls member, no sample",
            shard.display(),
            key()
        ));
        return Ok(());
    }
    let dropped = |notes: &mut ScanNotes, ext: &[u8]| {
        let ext = String::from_utf8_lossy(ext).into_owned();
        *notes.dropped_members.entry(ext).or_insert(0) += 1;
    };
    if !out.members.is_empty() && out.notes.sample_members.is_empty() {
        out.notes.sample_members = out.members.to_vec();
    }
    if out.members.is_empty() {
        // One member per sample: the first; the rest are counted.
        let (_, offset, len, name, crc) = &g.members[0];
        if let Some(c) = out.crcs.as_mut() {
            c.push(*crc);
        }
        let len = check_len(&shard.join(std::ffi::OsStr::from_bytes(name)), *len)?;
        out.samples.push(ScannedSample {
            file: out.file,
            offset: *offset,
            len,
            label: g.label,
        });
        for (ext, ..) in &g.members[1..] {
            dropped(out.notes, ext);
        }
        return Ok(());
    }
    // The listed members, in the listed order; the sample spans them all.
    let mut picked = Vec::with_capacity(out.members.len());
    for want in out.members {
        match g
            .members
            .iter()
            .find(|(e, ..)| e.as_slice() == want.as_bytes())
        {
            Some(m) => picked.push(m),
            None => {
                return Err(Error::BadTar {
                    path: shard.to_path_buf(),
                    reason: format!(
                        "key {} has no .{want} member (--members {}); it has {}",
                        key(),
                        out.members.join(","),
                        g.members
                            .iter()
                            .map(|(e, ..)| format!(".{}", String::from_utf8_lossy(e)))
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                })
            }
        }
    }
    let start = picked.iter().map(|m| m.1).min().expect("non-empty");
    let end = picked.iter().map(|m| m.1 + m.2).max().expect("non-empty");
    let len = check_len(
        &shard.join(std::ffi::OsStr::from_bytes(&picked[0].3)),
        end - start,
    )?;
    for (ext, ..) in &g.members {
        if !out.members.iter().any(|m| m.as_bytes() == ext.as_slice()) {
            dropped(out.notes, ext);
        }
    }
    out.samples.push(ScannedSample {
        file: out.file,
        offset: start,
        len,
        label: g.label,
    });
    *out.crcs = None;
    for m in picked {
        out.parts.push(((m.1 - start) as u32, m.2 as u32));
    }
    Ok(())
}

/// The offset of the first non-zero byte in `[from, end)`, if any.
fn first_nonzero<R: ReadAt>(f: &R, from: u64, end: u64) -> std::io::Result<Option<u64>> {
    let mut buf = vec![0u8; 1 << 16];
    let mut pos = from;
    while pos < end {
        let want = (end - pos).min(buf.len() as u64) as usize;
        let got = f.read_at(&mut buf[..want], pos)?;
        if got == 0 {
            break;
        }
        if let Some(i) = buf[..got].iter().position(|&b| b != 0) {
            return Ok(Some(pos + i as u64));
        }
        pos += got as u64;
    }
    Ok(None)
}

/// Whether `block` is a tar header with a valid checksum.
fn is_intact_header(block: &[u8]) -> bool {
    if block.iter().all(|&b| b == 0) {
        return false;
    }
    let field = &block[148..156];
    let digits: Vec<u8> = field
        .iter()
        .copied()
        .skip_while(|b| *b == b' ')
        .take_while(|b| (b'0'..=b'7').contains(b))
        .collect();
    let Some(stored) = std::str::from_utf8(&digits)
        .ok()
        .and_then(|s| u32::from_str_radix(s, 8).ok())
    else {
        return false;
    };
    let sum: u32 = block[..148]
        .iter()
        .chain(&block[156..])
        .map(|&b| b as u32)
        .sum::<u32>()
        + 8 * 32;
    sum == stored
}

/// The first block at or after `from` (block-aligned) that is an intact header.
fn next_intact_header<R: ReadAt>(f: &R, from: u64, end: u64) -> std::io::Result<Option<u64>> {
    let mut buf = vec![0u8; 1 << 16];
    let mut pos = from;
    while pos + BLOCK <= end {
        let want = ((end - pos) / BLOCK * BLOCK).min(buf.len() as u64) as usize;
        let got = f.read_at(&mut buf[..want], pos)?;
        let blocks = got / BLOCK as usize;
        if blocks == 0 {
            break;
        }
        for i in 0..blocks {
            let b = &buf[i * BLOCK as usize..(i + 1) * BLOCK as usize];
            if is_intact_header(b) {
                return Ok(Some(pos + (i as u64) * BLOCK));
            }
        }
        pos += (blocks as u64) * BLOCK;
    }
    Ok(None)
}
