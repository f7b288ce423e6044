//! The common envelope of kspeed's binary files (catalog, manifest, journal):
//! a fixed prefix with magic, version and two CRC32C checksums, then
//! kind-specific header fields, then the body. docs/FORMAT.md describes it.
//!
//! ```text
//! off  size  field
//!   0     8  magic
//!   8     4  version (u32 LE)
//!  12     4  header_len: bytes from offset 0 to the body (multiple of 8)
//!  16     8  body_len (u64 LE)
//!  24     4  body_crc32c: CRC32C of the body
//!  28     4  header_crc32c: CRC32C of bytes 0..header_len with this field zeroed
//!  32   ...  kind-specific header fields (zero padded to header_len)
//! ```
//!
//! Files are written to a temporary name, synced and renamed into place, so a
//! reader sees either the old file or the complete new one.

use std::fs::File;
use std::io::{BufWriter, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use crate::error::{Error, IoContext, Result};

/// Bytes of the common prefix.
pub const PREFIX_LEN: usize = 32;

/// A validated view of a kspeed file: its kind-specific header fields and body.
#[derive(Debug)]
pub struct Parsed<'a> {
    /// The format version (already checked to be supported).
    pub version: u32,
    /// Kind-specific header fields: bytes `32..header_len`.
    pub fields: Fields<'a>,
    /// The body.
    pub body: &'a [u8],
}

/// Parses and checks the envelope of `bytes` read from `path`: magic, header
/// checksum, version, length, body checksum, in that order, so a bit flip in
/// the version is reported as corruption rather than as a version mismatch.
pub fn parse<'a>(
    path: &Path,
    kind: &'static str,
    magic: &[u8; 8],
    supported: u32,
    bytes: &'a [u8],
) -> Result<Parsed<'a>> {
    parse_versions(path, kind, magic, supported..=supported, bytes)
}

/// [`parse`] for a kind whose readers accept several versions (the catalog
/// reads version 1 and writes version 2); [`Parsed::version`] says which.
pub fn parse_versions<'a>(
    path: &Path,
    kind: &'static str,
    magic: &[u8; 8],
    supported: std::ops::RangeInclusive<u32>,
    bytes: &'a [u8],
) -> Result<Parsed<'a>> {
    let truncated = |expected: u64| Error::Truncated {
        path: path.to_path_buf(),
        kind,
        expected,
        actual: bytes.len() as u64,
    };
    if bytes.len() < PREFIX_LEN {
        if bytes.len() >= 8 && &bytes[..8] != magic {
            return Err(bad_magic(path, kind, magic, bytes));
        }
        return Err(truncated(PREFIX_LEN as u64));
    }
    if &bytes[..8] != magic {
        return Err(bad_magic(path, kind, magic, bytes));
    }
    let header_len = le_u32(bytes, 12) as usize;
    if header_len < PREFIX_LEN || !header_len.is_multiple_of(8) {
        return Err(Error::Corrupt {
            path: path.to_path_buf(),
            kind,
            detail: format!("header length {header_len} is invalid"),
        });
    }
    if bytes.len() < header_len {
        return Err(truncated(header_len as u64));
    }
    let stored = le_u32(bytes, 28);
    let computed = header_crc(&bytes[..header_len]);
    if stored != computed {
        return Err(Error::ChecksumMismatch {
            path: path.to_path_buf(),
            kind,
            part: "header",
            stored,
            computed,
        });
    }
    let version = le_u32(bytes, 8);
    if !supported.contains(&version) {
        return Err(Error::UnsupportedVersion {
            path: path.to_path_buf(),
            kind,
            found: version,
            supported: *supported.end(),
        });
    }
    let body_len = le_u64(bytes, 16);
    let end = (header_len as u64).checked_add(body_len);
    match end {
        Some(end) if end <= bytes.len() as u64 => {}
        _ => return Err(truncated(header_len as u64 + body_len)),
    }
    let body = &bytes[header_len..header_len + body_len as usize];
    let stored = le_u32(bytes, 24);
    let computed = crc32c::crc32c(body);
    if stored != computed {
        return Err(Error::ChecksumMismatch {
            path: path.to_path_buf(),
            kind,
            part: "body",
            stored,
            computed,
        });
    }
    Ok(Parsed {
        version,
        fields: Fields {
            bytes: &bytes[PREFIX_LEN..header_len],
        },
        body,
    })
}

fn bad_magic(path: &Path, kind: &'static str, magic: &[u8; 8], bytes: &[u8]) -> Error {
    Error::BadMagic {
        path: path.to_path_buf(),
        kind,
        found: bytes[..bytes.len().min(8)].to_vec(),
        expected: magic.to_vec(),
    }
}

fn header_crc(header: &[u8]) -> u32 {
    let crc = crc32c::crc32c(&header[..28]);
    let crc = crc32c::crc32c_append(crc, &[0; 4]);
    crc32c::crc32c_append(crc, &header[32..])
}

/// Reads a little-endian u32 at `off`. Callers check bounds first.
pub fn le_u32(b: &[u8], off: usize) -> u32 {
    u32::from_le_bytes(b[off..off + 4].try_into().expect("4 bytes"))
}

/// Reads a little-endian u64 at `off`. Callers check bounds first.
pub fn le_u64(b: &[u8], off: usize) -> u64 {
    u64::from_le_bytes(b[off..off + 8].try_into().expect("8 bytes"))
}

/// Kind-specific header fields, read by offset from the end of the prefix.
#[derive(Debug, Clone, Copy)]
pub struct Fields<'a> {
    bytes: &'a [u8],
}

impl Fields<'_> {
    /// The u64 at field offset `off` (0 = byte 32 of the file), or 0 when the
    /// header is shorter: fields appended by a later minor change read as 0.
    pub fn u64(&self, off: usize) -> u64 {
        if off + 8 <= self.bytes.len() {
            le_u64(self.bytes, off)
        } else {
            0
        }
    }
}

/// Builds kind-specific header fields.
#[derive(Default)]
pub struct FieldsBuilder {
    bytes: Vec<u8>,
}

impl FieldsBuilder {
    /// Appends a u64.
    pub fn u64(mut self, v: u64) -> Self {
        self.bytes.extend_from_slice(&v.to_le_bytes());
        self
    }
}

/// Streams a kspeed file to `<path>.tmp`, then [`FileWriter::commit`] fills
/// in the checksums, syncs and renames it to `path`.
pub struct FileWriter {
    path: PathBuf,
    tmp: PathBuf,
    out: BufWriter<File>,
    magic: [u8; 8],
    version: u32,
    fields: Vec<u8>,
    body_len: u64,
    body_crc: u32,
    committed: bool,
}

/// A writer dropped before [`FileWriter::commit`] (an error, a full disk)
/// removes its `.tmp` file instead of leaving it behind.
impl Drop for FileWriter {
    fn drop(&mut self) {
        if !self.committed {
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}

impl FileWriter {
    /// Starts writing a file of the given kind.
    pub fn create(
        path: &Path,
        magic: [u8; 8],
        version: u32,
        fields: FieldsBuilder,
    ) -> Result<Self> {
        let mut tmp = path.as_os_str().to_owned();
        tmp.push(".tmp");
        let tmp = PathBuf::from(tmp);
        // Private (0600) like everything in a space; preload widens it when
        // asked to (`--file-mode`).
        let file = {
            use std::os::unix::fs::OpenOptionsExt;
            std::fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(0o600)
                .open(&tmp)
                .ctx("create", &tmp)?
        };
        let mut w = FileWriter {
            path: path.to_path_buf(),
            tmp,
            out: BufWriter::with_capacity(1 << 20, file),
            magic,
            version,
            fields: fields.bytes,
            body_len: 0,
            body_crc: 0,
            committed: false,
        };
        let header = w.header();
        w.out.write_all(&header).ctx("write", &w.tmp)?;
        Ok(w)
    }

    fn header_len(&self) -> usize {
        (PREFIX_LEN + self.fields.len()).next_multiple_of(8)
    }

    fn header(&self) -> Vec<u8> {
        let header_len = self.header_len();
        let mut h = Vec::with_capacity(header_len);
        h.extend_from_slice(&self.magic);
        h.extend_from_slice(&self.version.to_le_bytes());
        h.extend_from_slice(&(header_len as u32).to_le_bytes());
        h.extend_from_slice(&self.body_len.to_le_bytes());
        h.extend_from_slice(&self.body_crc.to_le_bytes());
        h.extend_from_slice(&[0; 4]);
        h.extend_from_slice(&self.fields);
        h.resize(header_len, 0);
        let crc = header_crc(&h);
        h[28..32].copy_from_slice(&crc.to_le_bytes());
        h
    }

    /// Appends body bytes.
    pub fn write(&mut self, bytes: &[u8]) -> Result<()> {
        self.body_crc = crc32c::crc32c_append(self.body_crc, bytes);
        self.body_len += bytes.len() as u64;
        self.out.write_all(bytes).ctx("write", &self.tmp)
    }

    /// Pads the body with zeros to a multiple of 8 bytes.
    pub fn pad8(&mut self) -> Result<()> {
        let pad = (self.body_len.next_multiple_of(8) - self.body_len) as usize;
        self.write(&[0u8; 8][..pad])
    }

    /// Writes the final header, syncs, renames into place and syncs the directory.
    pub fn commit(mut self) -> Result<()> {
        let header = self.header();
        let tmp = self.tmp.clone();
        self.out.flush().ctx("write", &tmp)?;
        let file = self.out.get_mut();
        file.seek(SeekFrom::Start(0)).ctx("seek", &tmp)?;
        file.write_all(&header).ctx("write", &tmp)?;
        file.sync_all().ctx("fsync", &tmp)?;
        std::fs::rename(&tmp, &self.path).ctx("rename", &self.path)?;
        self.committed = true;
        sync_parent(&self.path)
    }
}

/// Syncs the directory holding `path`, so a rename into it is durable.
pub fn sync_parent(path: &Path) -> Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    File::open(dir).and_then(|d| d.sync_all()).ctx("fsync", dir)
}

/// Writes `bytes` to `path` through a temporary file beside it (`path` +
/// `.tmp`) and a rename, the file and its directory synced: after a crash
/// `path` holds the old bytes or the new, never a part.
pub(crate) fn write_file_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    write_file_atomic_mode(path, bytes, 0o666)
}

/// As [`write_file_atomic`], the file created with `mode` (less the
/// umask) from the start: a private file is never readable by others,
/// not even between its write and a chmod.
pub(crate) fn write_file_atomic_mode(path: &Path, bytes: &[u8], mode: u32) -> Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = std::path::PathBuf::from(tmp);
    // A tmp file left by a crash keeps its mode: start afresh.
    match std::fs::remove_file(&tmp) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(crate::Error::io("remove", &tmp, e)),
    }
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(&tmp)
        .ctx("create", &tmp)?;
    f.write_all(bytes).ctx("write", &tmp)?;
    f.sync_all().ctx("fsync", &tmp)?;
    std::fs::rename(&tmp, path).ctx("rename", path)?;
    sync_parent(path)
}

/// Reads a whole small file (journal) into memory.
pub fn read_small(path: &Path) -> Result<Vec<u8>> {
    std::fs::read(path).ctx("read", path)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAGIC: [u8; 8] = *b"KSPDTEST";

    fn write_sample(dir: &Path) -> PathBuf {
        let p = dir.join("f");
        let mut w =
            FileWriter::create(&p, MAGIC, 3, FieldsBuilder::default().u64(7).u64(9)).unwrap();
        w.write(b"hello body").unwrap();
        w.commit().unwrap();
        p
    }

    #[test]
    fn round_trip() {
        let d = tempfile::tempdir().unwrap();
        let p = write_sample(d.path());
        let bytes = std::fs::read(&p).unwrap();
        let parsed = parse(&p, "test", &MAGIC, 3, &bytes).unwrap();
        assert_eq!(parsed.version, 3);
        assert_eq!(parsed.fields.u64(0), 7);
        assert_eq!(parsed.fields.u64(8), 9);
        assert_eq!(parsed.fields.u64(16), 0, "missing field reads as 0");
        assert_eq!(parsed.body, b"hello body");
        assert!(!d.path().join("f.tmp").exists());
    }

    #[test]
    fn every_bit_flip_is_caught() {
        let d = tempfile::tempdir().unwrap();
        let p = write_sample(d.path());
        let bytes = std::fs::read(&p).unwrap();
        for i in 0..bytes.len() {
            for bit in 0..8 {
                let mut b = bytes.clone();
                b[i] ^= 1 << bit;
                assert!(
                    parse(&p, "test", &MAGIC, 3, &b).is_err(),
                    "flip at byte {i} bit {bit} passed"
                );
            }
        }
    }

    #[test]
    fn named_errors() {
        let d = tempfile::tempdir().unwrap();
        let p = write_sample(d.path());
        let bytes = std::fs::read(&p).unwrap();
        let e = parse(&p, "test", b"KSPDXXXX", 3, &bytes).unwrap_err();
        assert!(matches!(e, Error::BadMagic { .. }), "{e}");
        let e = parse(&p, "test", &MAGIC, 4, &bytes).unwrap_err();
        assert!(
            matches!(
                e,
                Error::UnsupportedVersion {
                    found: 3,
                    supported: 4,
                    ..
                }
            ),
            "{e}"
        );
        let e = parse(&p, "test", &MAGIC, 3, &bytes[..bytes.len() - 1]).unwrap_err();
        assert!(matches!(e, Error::Truncated { .. }), "{e}");
        let e = parse(&p, "test", &MAGIC, 3, &bytes[..10]).unwrap_err();
        assert!(matches!(e, Error::Truncated { .. }), "{e}");
        let mut b = bytes.clone();
        b[8] = 99; // version byte: header checksum catches it first
        let e = parse(&p, "test", &MAGIC, 3, &b).unwrap_err();
        assert!(
            matches!(e, Error::ChecksumMismatch { part: "header", .. }),
            "{e}"
        );
        let mut b = bytes.clone();
        let last = b.len() - 1;
        b[last] ^= 1;
        let e = parse(&p, "test", &MAGIC, 3, &b).unwrap_err();
        assert!(
            matches!(e, Error::ChecksumMismatch { part: "body", .. }),
            "{e}"
        );
    }
}
