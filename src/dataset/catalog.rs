//! The catalog: sample id → source location, length, label, CRC32C, in a
//! versioned, checksummed binary file that is memory-mapped on open.
//! docs/FORMAT.md is the reference; the layout is summarised here.
//!
//! Header fields (after the common 32-byte prefix, see `crate::format` and docs/FORMAT.md):
//! source kind, sample count, file count, class count, total bytes, the body
//! offsets of the four sections, the source string, creation time and the
//! largest sample. Body sections, each 8-byte aligned:
//!
//! - samples, 24 bytes each: file u32, label u32, len u32, crc32c u32, offset u64
//! - files, 32 bytes each: name_off u64, size u64, mtime_ns i64, name_len u32,
//!   tag_len u32 (version 3: an object's ETag, stored right after its name
//!   in the strings; 0 for files)
//! - classes, 16 bytes each: name_off u64, name_len u32, 0u32
//! - strings: the bytes the name offsets point into
//!
//! Why this file is over ~800 lines: the catalog's reader and writer stay
//! together so that the binary layout is defined in one place (docs/FORMAT.md
//! mirrors it).

use std::borrow::Cow;
use std::ffi::OsStr;
use std::fs::File;
use std::io::Read;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Instant;

use super::scan::ScannedFile;
use super::source::{self, Scan, ScanNotes, ScanOptions, SourceKind, SourceSpec, NO_LABEL};
use crate::error::{Error, IoContext, Result, SourceChange};
use crate::format::{self, le_u32, le_u64, FieldsBuilder, FileWriter};
use crate::progress::{Progress, ProgressMode};
use crate::sys::ReadOnlyMap;

/// Magic bytes of a catalog file.
pub const MAGIC: [u8; 8] = *b"KSPDCAT\0";
/// The catalog format version this build writes. Version 2 allows file
/// names, class names and the source path to be any bytes (paths that are not
/// UTF-8); version 1 required UTF-8 class names and source. Version 3
/// records each object's ETag (object-store sources); a catalog of files is
/// still written as version 2, so older builds read it. All three are read.
pub const VERSION: u32 = 3;
/// The oldest catalog version this build reads.
pub const OLDEST_VERSION: u32 = 1;

const SAMPLE_REC: usize = 24;
const FILE_REC: usize = 32;
const CLASS_REC: usize = 16;
const PART_REC: usize = 8;

/// One sample's catalog entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sample {
    /// Its id (index in the catalog).
    pub id: u64,
    /// Index of its source file.
    pub file: u32,
    /// Byte offset in that file.
    pub offset: u64,
    /// Length in bytes.
    pub len: u32,
    /// Label, if it has one.
    pub label: Option<u32>,
    /// CRC32C of its bytes.
    pub crc32c: u32,
}

/// One source file's catalog entry.
#[derive(Debug, Clone, Copy)]
pub struct SourceFile<'a> {
    /// Path relative to the source root (absolute paths from a file list stay absolute).
    pub name: &'a Path,
    /// Size when the catalog was built.
    pub size: u64,
    /// Modification time when the catalog was built (ns since the epoch);
    /// an object's last-modified time.
    pub mtime_ns: i64,
    /// An object's ETag as the store gave it (object-store sources); empty
    /// for files.
    pub etag: &'a [u8],
}

/// Options for building a catalog.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct BuildOptions {
    /// Reader threads for the checksum pass.
    pub threads: usize,
    /// Object-store sources: requests in flight, one reader thread each
    /// (instead of `threads`). Default 64.
    pub requests: usize,
    /// How to show progress.
    pub progress: ProgressMode,
    /// How the source scan treats special files, symlinks and damaged tar members.
    pub scan: ScanOptions,
}

impl Default for BuildOptions {
    fn default() -> Self {
        BuildOptions {
            threads: crate::par::default_threads(),
            requests: 64,
            progress: ProgressMode::Quiet,
            scan: ScanOptions::default(),
        }
    }
}

setters!(BuildOptions {
    threads: usize,
    requests: usize,
    progress: ProgressMode,
    scan: ScanOptions,
});

/// An open, validated catalog.
pub struct Catalog {
    path: PathBuf,
    map: ReadOnlyMap,
    body_start: usize,
    kind: SourceKind,
    samples: u64,
    files: u64,
    classes: u64,
    total_bytes: u64,
    max_sample: u32,
    off_samples: usize,
    off_files: usize,
    off_classes: usize,
    off_strings: usize,
    strings_len: usize,
    source: (usize, usize),
    body_crc: u32,
    created_ns: u64,
    version: u32,
    member_count: usize,
    members: (usize, usize),
    off_parts: usize,
}

/// Reads sample byte ranges from source files, keeping the last file open
/// (consecutive tar members share a shard). One per worker thread.
pub(crate) struct SpanReader {
    root: PathBuf,
    open: Option<(u32, File)>,
    buf: Vec<u8>,
    /// An object-store source: its bucket and the prefix names follow.
    #[cfg(feature = "s3")]
    store: Option<(
        super::store::StoreUrl,
        Option<std::sync::Arc<super::store::Store>>,
    )>,
}

impl SpanReader {
    pub(crate) fn new(spec: &SourceSpec) -> Self {
        SpanReader {
            root: spec.root(),
            open: None,
            buf: Vec::new(),
            #[cfg(feature = "s3")]
            store: spec.store_url().map(|u| {
                let key = u.dir_prefix_or_parent();
                (super::store::StoreUrl { key, ..u }, None)
            }),
        }
    }

    /// Streams `len` bytes at `offset` of file `file` (named `name`; `tag`:
    /// an object's ETag, read only while it is that version) to `sink` in
    /// pieces of at most 4 MiB. A file shorter than expected, or an object
    /// replaced, is reported as a [`Error::SourceChanged`]. Returns an
    /// object's ETag as the store sent it with the bytes (empty for files).
    pub(crate) fn read(
        &mut self,
        file: u32,
        name: &Path,
        tag: &[u8],
        offset: u64,
        len: u64,
        mut sink: impl FnMut(&[u8]) -> Result<()>,
    ) -> Result<String> {
        #[cfg(feature = "s3")]
        if let Some((url, store)) = &mut self.store {
            let store = match store {
                Some(s) => s.clone(),
                None => store.insert(super::store::Store::of(&url.bucket)?).clone(),
            };
            let key = format!("{}{}", url.key, name.to_string_lossy());
            if len == 0 && tag.is_empty() {
                // Nothing to GET, but the catalog records the version.
                return Ok(store.head(&key)?.etag);
            }
            let tag = String::from_utf8_lossy(tag);
            return store.read(&key, Some(&tag), offset..offset + len, sink);
        }
        let _ = tag;
        if self.buf.is_empty() {
            self.buf = vec![0; 4 << 20];
        }
        let path = self.root.join(name);
        if self.open.as_ref().is_none_or(|(i, _)| *i != file) {
            // O_NONBLOCK: if the file was replaced by a FIFO since the scan,
            // opening it must not wait for a writer; only regular files are read.
            let f = {
                use std::os::unix::fs::OpenOptionsExt;
                std::fs::OpenOptions::new()
                    .read(true)
                    .custom_flags(libc::O_NONBLOCK)
                    .open(&path)
                    .ctx("open", &path)?
            };
            let md = f.metadata().ctx("stat", &path)?;
            if !md.is_file() {
                return Err(Error::NotRegularFile {
                    path,
                    what: source::special_kind(md.file_type()),
                });
            }
            self.open = Some((file, f));
        }
        let f = &self.open.as_ref().expect("opened").1;
        let mut pos = 0u64;
        while pos < len {
            let want = (len - pos).min(self.buf.len() as u64) as usize;
            let got = f
                .read_at(&mut self.buf[..want], offset + pos)
                .ctx("read", &path)?;
            if got == 0 {
                return Err(Error::SourceChanged {
                    changes: vec![SourceChange {
                        path,
                        what: format!(
                            "ends at byte {} but the catalog expects {}",
                            offset + pos,
                            offset + len
                        ),
                    }],
                });
            }
            sink(&self.buf[..got])?;
            pos += got as u64;
        }
        Ok(String::new())
    }
}

/// Lists `spec`, reads every sample once to compute its CRC32C, and writes
/// the catalog to `out`. What the scan skipped or dropped is logged as
/// warnings; [`build_with_notes`] returns it.
pub fn build(spec: &SourceSpec, out: &Path, opts: &BuildOptions) -> Result<Catalog> {
    let (cat, notes) = build_with_notes(spec, out, opts)?;
    for line in notes.lines() {
        log::warn!("{line}");
    }
    Ok(cat)
}

/// [`build`], returning what the scan noticed without failing (skipped
/// entries, tar members that are not part of a sample) for the caller to report.
pub fn build_with_notes(
    spec: &SourceSpec,
    out: &Path,
    opts: &BuildOptions,
) -> Result<(Catalog, ScanNotes)> {
    let t0 = Instant::now();
    let scan = scan_any(spec, &opts.scan)?;
    log::info!(
        "scanned {}: {} samples in {} files, {} classes ({:.2} s)",
        spec.to_source_string(),
        scan.samples.len(),
        scan.files.len(),
        scan.classes.len(),
        t0.elapsed().as_secs_f64()
    );
    let mut scan = scan;
    let crcs = checksum_all(&mut scan, opts)?;
    write(&scan, &crcs, out)?;
    Ok((Catalog::open(out)?, scan.notes))
}

/// Lists a source, in a bucket or on a file system.
pub(crate) fn scan_any(spec: &SourceSpec, opts: &ScanOptions) -> Result<Scan> {
    #[cfg(feature = "s3")]
    if spec.is_remote() {
        return source::scan_with(spec, opts, super::store_scan::scan);
    }
    source::scan(spec, opts)
}

/// What a source holds now (names, sizes, times, ETags).
fn current_files_any(spec: &SourceSpec, opts: &ScanOptions) -> Result<Vec<ScannedFile>> {
    #[cfg(feature = "s3")]
    if spec.is_remote() {
        return super::store_scan::current_files(spec);
    }
    source::current_files(spec, opts)
}

/// The class folders of an ImageFolder source now.
fn current_classes_any(spec: &SourceSpec) -> Result<Vec<std::ffi::OsString>> {
    #[cfg(feature = "s3")]
    if spec.is_remote() {
        return super::store_scan::current_classes(spec);
    }
    source::current_classes(spec)
}

/// Every sample's CRC32C (read from the source, unless the scan took them);
/// for a source in a store, the ETags the reads saw fill those the listing
/// left empty.
fn checksum_all(scan: &mut Scan, opts: &BuildOptions) -> Result<Vec<u32>> {
    if let Some(c) = scan.crcs.as_ref().filter(|c| c.len() == scan.samples.len()) {
        // Taken while indexing (tar shards): no second read.
        return Ok(c.clone());
    }
    let total: u64 = scan.samples.iter().map(|s| s.len as u64).sum();
    let progress = Progress::new("checksum", total, opts.progress);
    let crcs: Vec<std::sync::atomic::AtomicU32> = (0..scan.samples.len())
        .map(|_| std::sync::atomic::AtomicU32::new(0))
        .collect();
    let readers: Mutex<Vec<SpanReader>> = Mutex::new(Vec::new());
    // ETags the GETs saw, for objects the listing gave none.
    let seen: Vec<std::sync::OnceLock<String>> = if scan.spec.is_remote() {
        (0..scan.files.len())
            .map(|_| std::sync::OnceLock::new())
            .collect()
    } else {
        Vec::new()
    };
    let threads = if scan.spec.is_remote() {
        opts.requests.max(1)
    } else {
        opts.threads
    };
    // Small chunks for a store: a chunk is requests one after another.
    let chunk = if scan.spec.is_remote() { 4 } else { 64 };
    crate::par::for_each_chunk(scan.samples.len() as u64, chunk, threads, |range| {
        let mut reader = readers
            .lock()
            .expect("not poisoned")
            .pop()
            .unwrap_or_else(|| SpanReader::new(&scan.spec));
        for id in range {
            let s = scan.samples[id as usize];
            let f = &scan.files[s.file as usize];
            let mut crc = 0u32;
            let tag = reader.read(s.file, &f.name, &f.tag, s.offset, s.len as u64, |b| {
                crc = crc32c::crc32c_append(crc, b);
                progress.add(b.len() as u64);
                Ok(())
            })?;
            if !tag.is_empty() {
                let _ = seen[s.file as usize].set(tag);
            }
            crcs[id as usize].store(crc, std::sync::atomic::Ordering::Relaxed);
        }
        readers.lock().expect("not poisoned").push(reader);
        Ok(())
    })?;
    progress.finish();
    fill_tags(&mut scan.files, seen);
    Ok(crcs.into_iter().map(|c| c.into_inner()).collect())
}

/// Gives each file whose tag is empty the ETag a read of it saw.
pub(crate) fn fill_tags(
    files: &mut [super::scan::ScannedFile],
    seen: Vec<std::sync::OnceLock<String>>,
) {
    for (f, t) in files.iter_mut().zip(seen) {
        if f.tag.is_empty() {
            if let Some(t) = t.into_inner() {
                f.tag = t.into_bytes();
            }
        }
    }
}

/// Writes a catalog for `scan` with the given per-sample CRCs.
pub(crate) fn write(scan: &Scan, crcs: &[u32], out: &Path) -> Result<()> {
    assert_eq!(crcs.len(), scan.samples.len());
    let n = scan.samples.len() as u64;
    let nf = scan.files.len() as u64;
    let nc = scan.classes.len() as u64;
    let source_string = scan.spec.to_source_bytes();
    let mut strings: Vec<u8> = Vec::new();
    let mut file_names = Vec::with_capacity(scan.files.len());
    for f in &scan.files {
        file_names.push((strings.len() as u64, f.name.as_os_str().len() as u32));
        strings.extend_from_slice(f.name.as_os_str().as_bytes());
        strings.extend_from_slice(&f.tag);
    }
    let mut class_names = Vec::with_capacity(scan.classes.len());
    for c in &scan.classes {
        class_names.push((strings.len() as u64, c.len() as u32));
        strings.extend_from_slice(c.as_os_str().as_bytes());
    }
    let source_off = strings.len() as u64;
    strings.extend_from_slice(&source_string);
    let members = scan.members.join(",");
    let members_off = strings.len() as u64;
    strings.extend_from_slice(members.as_bytes());
    let m = scan.members.len() as u64;
    assert_eq!(scan.parts.len() as u64, n * m);

    let off_samples = 0u64;
    let off_files = (n * SAMPLE_REC as u64).next_multiple_of(8);
    let off_classes = off_files + nf * FILE_REC as u64;
    let off_strings = off_classes + nc * CLASS_REC as u64;
    let total: u64 = scan.samples.iter().map(|s| s.len as u64).sum();
    let max_sample = scan.samples.iter().map(|s| s.len).max().unwrap_or(0);
    let created_ns = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    let fields = FieldsBuilder::default()
        .u64(scan.spec.kind as u64)
        .u64(n)
        .u64(nf)
        .u64(nc)
        .u64(total)
        .u64(off_samples)
        .u64(off_files)
        .u64(off_classes)
        .u64(off_strings)
        .u64(strings.len() as u64)
        .u64(source_off)
        .u64(source_string.len() as u64)
        .u64(created_ns)
        .u64(max_sample as u64)
        .u64(m)
        .u64(members_off)
        .u64(members.len() as u64)
        .u64((off_strings + strings.len() as u64).next_multiple_of(8));
    // What the file needs on disk, named if the disk is full.
    let file_bytes = off_strings + strings.len() as u64 + 8 * n * m + 256;
    write_body(out, fields, scan, crcs, &file_names, &class_names, &strings).map_err(|e| match e {
        Error::DiskFull {
            path, available, ..
        } => Error::DiskFull {
            path,
            needed: file_bytes,
            available,
        },
        e => e,
    })
}

fn write_body(
    out: &Path,
    fields: FieldsBuilder,
    scan: &Scan,
    crcs: &[u32],
    file_names: &[(u64, u32)],
    class_names: &[(u64, u32)],
    strings: &[u8],
) -> Result<()> {
    // Version 3 only where it says more: a catalog of files stays readable
    // by builds that read version 2.
    let version = if scan.files.iter().any(|f| !f.tag.is_empty()) {
        VERSION
    } else {
        2
    };
    let mut w = FileWriter::create(out, MAGIC, version, fields)?;
    let mut rec = [0u8; SAMPLE_REC];
    for (s, crc) in scan.samples.iter().zip(crcs) {
        rec[0..4].copy_from_slice(&s.file.to_le_bytes());
        rec[4..8].copy_from_slice(&s.label.to_le_bytes());
        rec[8..12].copy_from_slice(&s.len.to_le_bytes());
        rec[12..16].copy_from_slice(&crc.to_le_bytes());
        rec[16..24].copy_from_slice(&s.offset.to_le_bytes());
        w.write(&rec)?;
    }
    w.pad8()?;
    for (f, (name_off, name_len)) in scan.files.iter().zip(file_names) {
        let mut r = [0u8; FILE_REC];
        r[0..8].copy_from_slice(&name_off.to_le_bytes());
        r[8..16].copy_from_slice(&f.size.to_le_bytes());
        r[16..24].copy_from_slice(&f.mtime_ns.to_le_bytes());
        r[24..28].copy_from_slice(&name_len.to_le_bytes());
        r[28..32].copy_from_slice(&(f.tag.len() as u32).to_le_bytes());
        w.write(&r)?;
    }
    for (name_off, name_len) in class_names {
        let mut r = [0u8; CLASS_REC];
        r[0..8].copy_from_slice(&name_off.to_le_bytes());
        r[8..12].copy_from_slice(&name_len.to_le_bytes());
        w.write(&r)?;
    }
    w.write(strings)?;
    if !scan.parts.is_empty() {
        w.pad8()?;
        let mut r = [0u8; PART_REC];
        for (off, len) in &scan.parts {
            r[0..4].copy_from_slice(&off.to_le_bytes());
            r[4..8].copy_from_slice(&len.to_le_bytes());
            w.write(&r)?;
        }
    }
    w.commit()
}

/// For code that takes "something holding a catalog" (a catalog, a space).
impl AsRef<Catalog> for Catalog {
    fn as_ref(&self) -> &Catalog {
        self
    }
}

impl Catalog {
    /// Opens and validates a catalog: envelope checksums, then every record's
    /// references (file indices, string ranges, labels, offsets within files).
    pub fn open(path: &Path) -> Result<Self> {
        let mut file = File::open(path).ctx("open", path)?;
        // Read the magic first so a foreign file is named as such even when
        // it is too small to map meaningfully.
        let mut magic = [0u8; 8];
        let got = file.read(&mut magic).ctx("read", path)?;
        if got == 8 && magic != MAGIC {
            return Err(Error::BadMagic {
                path: path.to_path_buf(),
                kind: "catalog",
                found: magic.to_vec(),
                expected: MAGIC.to_vec(),
            });
        }
        let map = ReadOnlyMap::new(&file).ctx("mmap", path)?;
        let (body_start, body_len, body_crc, h, version) = {
            let bytes = map.as_slice();
            let parsed =
                format::parse_versions(path, "catalog", &MAGIC, OLDEST_VERSION..=VERSION, bytes)?;
            let mut h = [0u64; 18];
            for (i, v) in h.iter_mut().enumerate() {
                *v = parsed.fields.u64(i * 8);
            }
            let body_start = parsed.body.as_ptr() as usize - bytes.as_ptr() as usize;
            (
                body_start,
                parsed.body.len(),
                le_u32(bytes, 24),
                h,
                parsed.version,
            )
        };
        let corrupt = |detail: String| Error::Corrupt {
            path: path.to_path_buf(),
            kind: "catalog",
            detail,
        };
        let kind = SourceKind::from_u32(h[0] as u32)
            .ok_or_else(|| corrupt(format!("unknown source kind {}", h[0])))?;
        let (samples, files, classes) = (h[1], h[2], h[3]);
        let to_usize = |v: u64| usize::try_from(v).unwrap_or(usize::MAX);
        let cat = Catalog {
            path: path.to_path_buf(),
            map,
            body_start,
            kind,
            samples,
            files,
            classes,
            total_bytes: h[4],
            off_samples: to_usize(h[5]),
            off_files: to_usize(h[6]),
            off_classes: to_usize(h[7]),
            off_strings: to_usize(h[8]),
            strings_len: to_usize(h[9]),
            source: (to_usize(h[10]), to_usize(h[11])),
            created_ns: h[12],
            max_sample: u32::try_from(h[13]).unwrap_or(u32::MAX),
            body_crc,
            version,
            member_count: to_usize(h[14]),
            members: (to_usize(h[15]), to_usize(h[16])),
            off_parts: to_usize(h[17]),
        };
        // Section bounds, with overflow-checked arithmetic: the header is
        // trusted only as far as it is consistent.
        let span = |off: usize, count: u64, rec: usize| -> Option<usize> {
            off.checked_add(usize::try_from(count).ok()?.checked_mul(rec)?)
        };
        let ok = span(cat.off_samples, samples, SAMPLE_REC).is_some_and(|e| e <= cat.off_files)
            && span(cat.off_files, files, FILE_REC).is_some_and(|e| e <= cat.off_classes)
            && span(cat.off_classes, classes, CLASS_REC).is_some_and(|e| e <= cat.off_strings)
            && cat
                .off_strings
                .checked_add(cat.strings_len)
                .is_some_and(|e| e <= body_len)
            && cat
                .source
                .0
                .checked_add(cat.source.1)
                .is_some_and(|e| e <= cat.strings_len);
        if !ok {
            return Err(corrupt("section offsets do not fit the file".into()));
        }
        if samples == 0 {
            return Err(corrupt("no samples".into()));
        }
        if cat.member_count > 0 {
            let ok = cat
                .members
                .0
                .checked_add(cat.members.1)
                .is_some_and(|e| e <= cat.strings_len)
                && cat.off_parts >= cat.off_strings + cat.strings_len
                && cat
                    .member_count
                    .checked_mul(PART_REC)
                    .and_then(|rec| span(cat.off_parts, samples, rec))
                    .is_some_and(|e| e <= body_len)
                && std::str::from_utf8(cat.members_bytes())
                    .is_ok_and(|m| m.split(',').count() == cat.member_count);
            if !ok || kind != SourceKind::Tar {
                return Err(corrupt("member table does not fit the file".into()));
            }
        }
        for i in 0..files as u32 {
            let (off, len) = cat.file_name_range(i);
            let tag = cat.file_tag_len(i);
            if off
                .checked_add(len)
                .and_then(|e| e.checked_add(tag))
                .is_none_or(|e| e > cat.strings_len)
            {
                return Err(corrupt(format!("file {i}: name outside the string table")));
            }
        }
        for i in 0..classes as u32 {
            let r = cat.class_rec(i);
            let (off, len) = (le_u64(r, 0) as usize, le_u32(r, 8) as usize);
            // Version 1 promised UTF-8 class names; version 2 stores bytes.
            if off.checked_add(len).is_none_or(|e| e > cat.strings_len)
                || (version == 1 && std::str::from_utf8(&cat.strings()[off..off + len]).is_err())
            {
                return Err(corrupt(format!("class {i}: bad name")));
            }
        }
        let mut total = 0u64;
        let mut max = 0u32;
        for id in 0..samples {
            let s = cat.sample(id);
            if s.file as u64 >= files {
                return Err(corrupt(format!(
                    "sample {id}: file index {} out of range",
                    s.file
                )));
            }
            if let Some(l) = s.label {
                if classes > 0 && l as u64 >= classes {
                    return Err(corrupt(format!(
                        "sample {id}: label {l} but {classes} classes"
                    )));
                }
            }
            let fsize = cat.file(s.file).size;
            if s.offset.checked_add(s.len as u64).is_none_or(|e| e > fsize) {
                return Err(corrupt(format!(
                    "sample {id}: range past the end of its file"
                )));
            }
            for (j, (off, len)) in cat.sample_members(id).enumerate() {
                if off as u64 + len as u64 > s.len as u64 {
                    return Err(corrupt(format!(
                        "sample {id}: member {j} runs past the sample"
                    )));
                }
            }
            total += s.len as u64;
            max = max.max(s.len);
        }
        if total != cat.total_bytes || max != cat.max_sample {
            return Err(corrupt(
                "totals in the header do not match the samples".into(),
            ));
        }
        if version == 1 && std::str::from_utf8(cat.source_bytes()).is_err() {
            return Err(corrupt("source string is not UTF-8".into()));
        }
        if !cat.source_bytes().contains(&b':') {
            return Err(corrupt("source string has no kind prefix".into()));
        }
        Ok(cat)
    }

    fn body(&self) -> &[u8] {
        &self.map.as_slice()[self.body_start..]
    }

    fn strings(&self) -> &[u8] {
        &self.body()[self.off_strings..self.off_strings + self.strings_len]
    }

    fn members_bytes(&self) -> &[u8] {
        &self.strings()[self.members.0..self.members.0 + self.members.1]
    }

    /// The tar member extensions each sample is made of, in order, when the
    /// catalog was built with `--members` (empty otherwise: a sample is one
    /// member, or one file).
    pub fn members(&self) -> Vec<&str> {
        if self.member_count == 0 {
            return Vec::new();
        }
        std::str::from_utf8(self.members_bytes())
            .expect("validated at open")
            .split(',')
            .collect()
    }

    /// Where each listed member (see [`Catalog::members`]) lies inside sample
    /// `id`'s bytes: (offset, length), in the listed order. Empty when the
    /// catalog has no member list. Panics if `id >= len()`.
    pub fn sample_members(&self, id: u64) -> impl Iterator<Item = (u32, u32)> + '_ {
        assert!(id < self.samples, "sample {id} out of range");
        let m = self.member_count;
        let start = self.off_parts + id as usize * m * PART_REC;
        (0..m).map(move |j| {
            let r = &self.body()[start + j * PART_REC..start + (j + 1) * PART_REC];
            (le_u32(r, 0), le_u32(r, 4))
        })
    }

    fn source_bytes(&self) -> &[u8] {
        &self.strings()[self.source.0..self.source.0 + self.source.1]
    }

    fn file_rec(&self, i: u32) -> &[u8] {
        let o = self.off_files + i as usize * FILE_REC;
        &self.body()[o..o + FILE_REC]
    }

    fn class_rec(&self, i: u32) -> &[u8] {
        let o = self.off_classes + i as usize * CLASS_REC;
        &self.body()[o..o + CLASS_REC]
    }

    /// This catalog as a scan: what [`write`] needs to write it again
    /// (with other CRCs: preload's one-pass build from a store).
    pub(crate) fn to_scan(&self) -> Scan {
        let files = (0..self.files as u32)
            .map(|i| {
                let f = self.file(i);
                super::scan::ScannedFile {
                    name: f.name.to_path_buf(),
                    size: f.size,
                    mtime_ns: f.mtime_ns,
                    tag: f.etag.to_vec(),
                }
            })
            .collect();
        let samples = (0..self.samples)
            .map(|id| {
                let s = self.sample(id);
                super::scan::ScannedSample {
                    file: s.file,
                    offset: s.offset,
                    len: s.len,
                    label: s.label.unwrap_or(NO_LABEL),
                }
            })
            .collect();
        let classes = (0..self.classes as u32)
            .map(|i| OsStr::from_bytes(self.class_name_bytes(i)).to_os_string())
            .collect();
        let parts = if self.member_count == 0 {
            Vec::new()
        } else {
            (0..self.samples)
                .flat_map(|id| self.sample_members(id))
                .collect()
        };
        Scan {
            spec: self.source_spec(),
            files,
            samples,
            classes,
            notes: ScanNotes::default(),
            members: self.members().iter().map(|m| m.to_string()).collect(),
            parts,
            crcs: None,
        }
    }

    /// The length of file `i`'s ETag (version 3; before, the field is 0).
    fn file_tag_len(&self, i: u32) -> usize {
        if self.version >= 3 {
            le_u32(self.file_rec(i), 28) as usize
        } else {
            0
        }
    }

    fn file_name_range(&self, i: u32) -> (usize, usize) {
        let r = self.file_rec(i);
        (le_u64(r, 0) as usize, le_u32(r, 24) as usize)
    }

    /// The catalog file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Number of samples.
    pub fn len(&self) -> u64 {
        self.samples
    }

    /// Whether there are no samples (never true for an opened catalog).
    pub fn is_empty(&self) -> bool {
        self.samples == 0
    }

    /// Sum of all sample lengths.
    pub fn total_bytes(&self) -> u64 {
        self.total_bytes
    }

    /// The largest sample's length.
    pub fn max_sample_bytes(&self) -> u32 {
        self.max_sample
    }

    /// Number of source files.
    pub fn file_count(&self) -> u64 {
        self.files
    }

    /// Number of classes (ImageFolder sources).
    pub fn class_count(&self) -> u64 {
        self.classes
    }

    /// The source layout.
    pub fn source_kind(&self) -> SourceKind {
        self.kind
    }

    /// The source string recorded at build time, e.g. `dir:/data/train`
    /// (bytes that are not UTF-8 shown as U+FFFD; [`Catalog::source_spec`]
    /// has the exact path).
    pub fn source(&self) -> Cow<'_, str> {
        String::from_utf8_lossy(self.source_bytes())
    }

    /// The catalog format version of this file (1, 2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// The source as a spec (without touching the file system).
    pub fn source_spec(&self) -> SourceSpec {
        let s = self.source_bytes();
        let colon = s
            .iter()
            .position(|&b| b == b':')
            .expect("validated at open");
        SourceSpec {
            kind: self.kind,
            path: PathBuf::from(OsStr::from_bytes(&s[colon + 1..])),
        }
    }

    /// The catalog's identity: the CRC32C of its body. Manifests and journals
    /// record it to tell which catalog their layout belongs to.
    pub fn identity(&self) -> u32 {
        self.body_crc
    }

    /// When the catalog was built (ns since the Unix epoch).
    pub fn created_ns(&self) -> u64 {
        self.created_ns
    }

    /// The sample with id `id`. Panics if `id >= len()`.
    pub fn sample(&self, id: u64) -> Sample {
        assert!(
            id < self.samples,
            "sample {id} out of range ({} samples)",
            self.samples
        );
        let o = self.off_samples + id as usize * SAMPLE_REC;
        let r = &self.body()[o..o + SAMPLE_REC];
        let label = le_u32(r, 4);
        Sample {
            id,
            file: le_u32(r, 0),
            label: (label != NO_LABEL).then_some(label),
            len: le_u32(r, 8),
            crc32c: le_u32(r, 12),
            offset: le_u64(r, 16),
        }
    }

    /// Source file `i`. Panics if out of range.
    pub fn file(&self, i: u32) -> SourceFile<'_> {
        let r = self.file_rec(i);
        let (off, len) = self.file_name_range(i);
        let tag = self.file_tag_len(i);
        SourceFile {
            name: Path::new(std::ffi::OsStr::from_bytes(&self.strings()[off..off + len])),
            size: le_u64(r, 8),
            mtime_ns: le_u64(r, 16) as i64,
            etag: &self.strings()[off + len..off + len + tag],
        }
    }

    /// Absolute path of source file `i`.
    pub fn file_path(&self, i: u32) -> PathBuf {
        self.source_spec().root().join(self.file(i).name)
    }

    /// Name of class `i` (the class folder's name; bytes that are not UTF-8
    /// shown as U+FFFD). Panics if out of range.
    pub fn class_name(&self, i: u32) -> Cow<'_, str> {
        String::from_utf8_lossy(self.class_name_bytes(i))
    }

    /// Name of class `i` exactly as the folder is named. Panics if out of range.
    pub fn class_name_bytes(&self, i: u32) -> &[u8] {
        let r = self.class_rec(i);
        let (off, len) = (le_u64(r, 0) as usize, le_u32(r, 8) as usize);
        &self.strings()[off..off + len]
    }

    /// Bytes of catalog per sample (file size / samples).
    pub fn bytes_per_sample(&self) -> f64 {
        self.map.as_slice().len() as f64 / self.samples as f64
    }

    /// Everything that differs between the source now and the catalog:
    /// files changed (size, mtime), vanished, no longer listed, or no longer
    /// regular; files added to the tree (or the list, or shards added to the
    /// directory); new class folders, reported with the labels they would
    /// shift (labels are the indices of the sorted class names). One scan of
    /// the source's names, one `stat` per file.
    pub fn source_status(&self, opts: &ScanOptions) -> Result<Vec<SourceChange>> {
        let spec = self.source_spec();
        let root = spec.root();
        let mut changes = Vec::new();
        if spec.kind == SourceKind::Dir {
            let now = current_classes_any(&spec)?;
            let old: Vec<&[u8]> = (0..self.classes as u32)
                .map(|i| self.class_name_bytes(i))
                .collect();
            for (new_label, c) in now.iter().enumerate() {
                let b = c.as_os_str().as_bytes();
                if old.contains(&b) {
                    continue;
                }
                let shifted: Vec<String> = old
                    .iter()
                    .enumerate()
                    .filter(|(_, o)| **o > b)
                    .map(|(i, o)| format!("{} {i} -> {}", String::from_utf8_lossy(o), i + 1))
                    .collect();
                let what = if shifted.is_empty() {
                    format!("new class folder (label {new_label})")
                } else {
                    format!(
                        "new class folder; it shifts the labels of {} later class(es): {}{}",
                        shifted.len(),
                        shifted
                            .iter()
                            .take(3)
                            .cloned()
                            .collect::<Vec<_>>()
                            .join(", "),
                        if shifted.len() > 3 { ", ..." } else { "" }
                    )
                };
                changes.push(SourceChange {
                    path: root.join(c),
                    what,
                });
            }
        }
        let current = current_files_any(&spec, opts)?;
        let mut now: std::collections::HashMap<&Path, (u64, i64, &[u8])> = current
            .iter()
            .map(|f| (f.name.as_path(), (f.size, f.mtime_ns, f.tag.as_slice())))
            .collect();
        for i in 0..self.files as u32 {
            let f = self.file(i);
            let p = root.join(f.name);
            match now.remove(f.name) {
                Some(stat) => {
                    if let Some(what) = Self::stat_change(&f, stat) {
                        changes.push(SourceChange { path: p, what });
                    }
                }
                // Not among the source's files now: vanished, or still there
                // but no longer part of the source.
                None if spec.is_remote() => changes.push(SourceChange {
                    path: p,
                    what: "vanished (not in the store's listing)".into(),
                }),
                None => {
                    let what = match std::fs::metadata(&p) {
                        Err(e) if e.kind() == std::io::ErrorKind::NotFound => "vanished".into(),
                        Err(e) => format!("cannot stat: {e}"),
                        Ok(_) if spec.kind == SourceKind::List => {
                            format!("no longer listed in {}", spec.path.display())
                        }
                        Ok(_) => "no longer part of the source".into(),
                    };
                    changes.push(SourceChange { path: p, what });
                }
            }
        }
        let mut added: Vec<&Path> = now.into_keys().collect();
        added.sort();
        for name in added {
            changes.push(SourceChange {
                path: root.join(name),
                what: "added".into(),
            });
        }
        Ok(changes)
    }

    /// How a file's (size, mtime) now differs from the catalog's, if at all.
    /// An object is compared by size and ETag (its last-modified time
    /// changes on a rewrite of the same bytes, and only bytes matter), or by
    /// size and Last-Modified when the listing gives no ETag.
    fn stat_change(f: &SourceFile<'_>, (size, mtime_ns, tag): (u64, i64, &[u8])) -> Option<String> {
        if size != f.size {
            Some(format!("size {} -> {} bytes", f.size, size))
        } else if !f.etag.is_empty() && !tag.is_empty() {
            // A listing without ETags (some S3-compatible servers) is
            // compared by Last-Modified below.
            (tag != f.etag).then(|| {
                format!(
                    "replaced (ETag {} -> {})",
                    String::from_utf8_lossy(f.etag),
                    String::from_utf8_lossy(tag)
                )
            })
        } else if mtime_ns != f.mtime_ns {
            Some("modification time changed".into())
        } else {
            None
        }
    }

    /// Compares every source file's size and mtime with the catalog. Returns
    /// the changed and vanished files.
    pub fn source_changes(&self) -> Vec<SourceChange> {
        if self.source_spec().is_remote() {
            // Built from the store's listing moments ago; every read is
            // conditional on the cataloged ETag anyway.
            return Vec::new();
        }
        let root = self.source_spec().root();
        let mut changes = Vec::new();
        for i in 0..self.files as u32 {
            let f = self.file(i);
            let p = root.join(f.name);
            match std::fs::metadata(&p) {
                Ok(md) => {
                    let (size, mtime_ns) = source::stat_pair(&md);
                    if size != f.size {
                        changes.push(SourceChange {
                            path: p,
                            what: format!("size {} -> {} bytes", f.size, size),
                        });
                    } else if mtime_ns != f.mtime_ns {
                        changes.push(SourceChange {
                            path: p,
                            what: "modification time changed".into(),
                        });
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => changes.push(SourceChange {
                    path: p,
                    what: "vanished".into(),
                }),
                Err(e) => changes.push(SourceChange {
                    path: p,
                    what: format!("cannot stat: {e}"),
                }),
            }
        }
        changes
    }
}

/// The identity of a mixture of datasets side by side in one id space, in
/// the order given (`LoaderBuilder::mix`; a node service serving several
/// spaces): a hash of the dataset count and every catalog's identity, so
/// another dataset, order or count is another identity (docs/FORMAT.md,
/// "Mixing datasets").
pub fn mixture_identity(catalog_identities: &[u32]) -> u32 {
    let mut h = crate::hash::mix64(catalog_identities.len() as u64);
    for &c in catalog_identities {
        h = crate::hash::mix64(h ^ c as u64);
    }
    (h ^ (h >> 32)) as u32
}
