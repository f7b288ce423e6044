//! A node's space: the samples this node holds, packed into extent files laid
//! out for `O_DIRECT`, plus the catalog and a manifest written last.
//!
//! ```text
//! SPACE/catalog.ksc          the catalog (whole dataset, same on every node)
//! SPACE/manifest.ksm         layout of this node's part; present = complete
//! SPACE/extents/00000000.kse packed sample bytes
//! SPACE/preload.journal      preload progress while a preload is unfinished
//! SPACE/.lock                flock'd by preload and unload
//! ```
//!
//! Alignment rule: every sample starts at a multiple of `align_bytes`
//! (default 4096) inside its extent, and every extent's length is a multiple
//! of `align_bytes`, so the aligned range covering a sample,
//! `[offset, offset + round_up(len, align_bytes))`, can be read with
//! `O_DIRECT` into an aligned buffer and the sample starts at the buffer's
//! first byte. Samples are placed in id order; a new extent starts when the
//! next sample would cross `extent_bytes` (a larger sample gets an extent of
//! its own).

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use super::catalog::Catalog;
use super::owner::{OwnerFn, Placement};
use crate::error::{Error, IoContext, Result};
use crate::format::{self, le_u32, le_u64, FieldsBuilder, FileWriter};
use crate::progress::{Progress, ProgressMode};
use crate::sys::{self, AlignedBuf, ReadOnlyMap};

/// Magic bytes of a manifest.
pub const MANIFEST_MAGIC: [u8; 8] = *b"KSPDMAN\0";
/// The newest manifest format version, which this build writes for a space
/// placed by [`OwnerFn::Jump`]; a space placed by [`OwnerFn::Scaled`] keeps
/// version 1 (so builds that predate jump still read it). This build reads
/// both. Version 2 adds the owner function's code at field offset 88;
/// version 3 (written only for a partial space, so every other space stays
/// readable by older builds) the byte budget at 96
/// ([`LayoutParams::max_held_bytes`]).
pub const MANIFEST_VERSION: u32 = 3;
/// Field offset of the owner function's code in a version-2 manifest.
const OWNER_FN_FIELD: usize = 88;
/// Field offset of the byte budget in a version-3 manifest.
const BUDGET_FIELD: usize = 96;
/// Default sample alignment inside extents.
pub const DEFAULT_ALIGN_BYTES: u32 = 4096;
/// Default extent file size cap.
pub const DEFAULT_EXTENT_BYTES: u64 = 1 << 30;
/// Location entry value meaning "not held by this node".
pub const NOT_HERE: u32 = u32::MAX;

const LOC_REC: usize = 12;

/// File names inside a space.
pub mod files {
    /// The catalog.
    pub const CATALOG: &str = "catalog.ksc";
    /// The manifest.
    pub const MANIFEST: &str = "manifest.ksm";
    /// The extent directory.
    pub const EXTENTS: &str = "extents";
    /// The preload journal.
    pub const JOURNAL: &str = "preload.journal";
    /// A rebalance's new layout, complete but not yet in use
    /// (`kspeed rebalance` stages it; `--commit` renames it to the manifest).
    pub const STAGED: &str = "rebalance.ksm";
    /// A rebalance's progress while its staging is unfinished.
    pub const REBALANCE_JOURNAL: &str = "rebalance.journal";
    /// flock'd by a rebalance while it stages (beside a serve's shared
    /// `.lock`, so that two rebalances of one space never run at once).
    pub const REBALANCE_LOCK: &str = ".rebalance.lock";
    /// The lock file.
    pub const LOCK: &str = ".lock";
}

/// Path of extent `i` in `dir`.
pub fn extent_path(dir: &Path, i: u32) -> PathBuf {
    dir.join(files::EXTENTS).join(format!("{i:08}.kse"))
}

/// What decides a space's layout; a manifest or journal with other values
/// belongs to another layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayoutParams {
    /// Identity of the catalog ([`Catalog::identity`]).
    pub catalog_identity: u32,
    /// Samples in the catalog.
    pub catalog_samples: u64,
    /// Node count and copies.
    pub placement: Placement,
    /// This node's index.
    pub node_index: u32,
    /// Sample alignment (power of two, at least 512).
    pub align_bytes: u32,
    /// Extent size cap.
    pub extent_bytes: u64,
    /// A partial space's budget (`kspeed preload --max-bytes`): the node
    /// holds, of the samples its placement gives it, those in id order
    /// while this many bytes last (slots padded to the alignment; the first
    /// that does not fit ends it, `dataset::partial`), and the rest stay in
    /// the source, read from there ahead of need. 0: every sample the
    /// placement gives it.
    pub max_held_bytes: u64,
}

impl LayoutParams {
    pub(crate) fn to_fields(self) -> FieldsBuilder {
        FieldsBuilder::default()
            .u64(self.catalog_identity as u64)
            .u64(self.catalog_samples)
            .u64(self.placement.nodes as u64)
            .u64(self.node_index as u64)
            .u64(self.placement.replicas as u64)
            .u64(self.align_bytes as u64)
            .u64(self.extent_bytes)
    }

    /// The parameters in fields 0..56, placed by `owner_fn` (which the
    /// caller read from its own field: the manifest's and the journal's
    /// differ).
    pub(crate) fn from_fields(f: format::Fields<'_>, owner_fn: OwnerFn) -> Option<Self> {
        Some(LayoutParams {
            catalog_identity: u32::try_from(f.u64(0)).ok()?,
            catalog_samples: f.u64(8),
            placement: Placement::with_fn(
                owner_fn,
                u32::try_from(f.u64(16)).ok()?,
                u32::try_from(f.u64(32)).ok()?,
            )
            .ok()?,
            node_index: u32::try_from(f.u64(24)).ok()?,
            align_bytes: u32::try_from(f.u64(40)).ok()?,
            extent_bytes: f.u64(48),
            // Its own field, at another offset in a manifest and a journal.
            max_held_bytes: 0,
        })
    }

    /// Whether this node holds only a budget's worth of its share.
    pub fn is_partial(&self) -> bool {
        self.max_held_bytes > 0
    }

    /// Checks alignment, extent size and node index.
    pub fn validate(&self) -> Result<()> {
        if !self.align_bytes.is_power_of_two() || self.align_bytes < 512 {
            return Err(Error::InvalidConfig(format!(
                "align_bytes must be a power of two of at least 512, not {}",
                self.align_bytes
            )));
        }
        if self.extent_bytes < self.align_bytes as u64 {
            return Err(Error::InvalidConfig(
                "extent_bytes must be at least align_bytes".into(),
            ));
        }
        if self.node_index >= self.placement.nodes {
            return Err(Error::InvalidConfig(format!(
                "node index {} is not below the node count {}",
                self.node_index, self.placement.nodes
            )));
        }
        Ok(())
    }

    /// Fields from byte 56 on in the manifest header (after the 7 params).
    const PARAM_FIELDS: usize = 56;
}

/// Where a held sample sits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Location {
    /// Extent index.
    pub extent: u32,
    /// Byte offset in the extent (a multiple of the alignment).
    pub offset: u64,
}

/// A computed layout: a location per catalog sample and the extent lengths.
pub struct Plan {
    /// `LOC_REC` bytes per catalog sample: extent u32 (or NOT_HERE), offset u64.
    pub(crate) locs: Vec<u8>,
    /// Final length of each extent.
    pub extent_lens: Vec<u64>,
    /// Samples held here.
    pub held_samples: u64,
    /// Their bytes.
    pub held_bytes: u64,
}

impl Plan {
    /// Lays out the samples of `catalog` that this node holds. Pure function
    /// of the catalog's lengths and `params` (see the module docs).
    pub fn compute(catalog: &Catalog, params: &LayoutParams) -> Plan {
        let align = params.align_bytes as u64;
        let n = catalog.len();
        let mut locs = Vec::with_capacity(n as usize * LOC_REC);
        let mut extent_lens: Vec<u64> = Vec::new();
        let (mut held_samples, mut held_bytes) = (0u64, 0u64);
        // A partial space holds a prefix of the node's share (partial.rs).
        let cutoff = super::partial::cutoff(
            catalog,
            params.placement,
            params.node_index,
            params.align_bytes,
            params.max_held_bytes,
        );
        for id in 0..n {
            let len = catalog.sample(id).len as u64;
            let padded = len.next_multiple_of(align);
            if !params.placement.holds(params.node_index, id) || id >= cutoff {
                locs.extend_from_slice(&NOT_HERE.to_le_bytes());
                locs.extend_from_slice(&0u64.to_le_bytes());
                continue;
            }
            let cur = extent_lens.last().copied();
            let (extent, offset) = match cur {
                Some(end) if end == 0 || end + padded <= params.extent_bytes => {
                    (extent_lens.len() as u32 - 1, end)
                }
                _ => {
                    extent_lens.push(0);
                    (extent_lens.len() as u32 - 1, 0)
                }
            };
            *extent_lens.last_mut().expect("pushed") = offset + padded;
            locs.extend_from_slice(&extent.to_le_bytes());
            locs.extend_from_slice(&offset.to_le_bytes());
            held_samples += 1;
            held_bytes += len;
        }
        Plan {
            locs,
            extent_lens,
            held_samples,
            held_bytes,
        }
    }

    /// Location of sample `id`, if held here.
    pub fn location(&self, id: u64) -> Option<Location> {
        decode_loc(&self.locs, id)
    }
}

fn decode_loc(locs: &[u8], id: u64) -> Option<Location> {
    let o = id as usize * LOC_REC;
    let extent = le_u32(locs, o);
    (extent != NOT_HERE).then(|| Location {
        extent,
        offset: le_u64(locs, o + 4),
    })
}

/// Starts writing a manifest at `path` (header fields; the caller writes the
/// body and commits): version 1 for a space placed by the scaled function,
/// so builds that predate jump still read it, version 2 otherwise.
pub(crate) fn create_manifest(
    path: &Path,
    params: &LayoutParams,
    plan: &Plan,
) -> Result<FileWriter> {
    let created_ns = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    let fields = params
        .to_fields()
        .u64(plan.extent_lens.len() as u64)
        .u64(plan.held_samples)
        .u64(plan.held_bytes)
        .u64(created_ns);
    let owner_fn = params.placement.owner_fn;
    let (version, fields) = match owner_fn {
        _ if params.is_partial() => (
            MANIFEST_VERSION,
            fields
                .u64(owner_fn.code() as u64)
                .u64(params.max_held_bytes),
        ),
        OwnerFn::Scaled => (1, fields),
        OwnerFn::Jump => (2, fields.u64(owner_fn.code() as u64)),
    };
    debug_assert_eq!(OWNER_FN_FIELD, LayoutParams::PARAM_FIELDS + 32);
    debug_assert_eq!(BUDGET_FIELD, OWNER_FN_FIELD + 8);
    FileWriter::create(path, MANIFEST_MAGIC, version, fields)
}

/// Writes the manifest of a completed preload.
pub(crate) fn write_manifest(dir: &Path, params: &LayoutParams, plan: &Plan) -> Result<()> {
    let mut w = create_manifest(&dir.join(files::MANIFEST), params, plan)?;
    for len in &plan.extent_lens {
        w.write(&len.to_le_bytes())?;
    }
    w.write(&plan.locs)?;
    w.commit()
}

/// An open, complete space.
pub struct Space {
    dir: PathBuf,
    catalog: Catalog,
    manifest: ReadOnlyMap,
    params: LayoutParams,
    extent_lens: Vec<u64>,
    locs_start: usize,
    held_samples: u64,
    held_bytes: u64,
}

/// A sample that failed verification.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BadSample {
    /// Sample id.
    pub id: u64,
    /// Its source file (for the user to recognise it).
    pub source: PathBuf,
    /// Its extent file.
    pub extent: PathBuf,
    /// "corrupt (crc ...)", "missing (...)" or "I/O error (...)".
    pub what: String,
    /// Which of the three it is.
    pub kind: BadKind,
}

/// Why a sample failed verification.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BadKind {
    /// Read, but its CRC32C differs from the catalog's: the space is damaged.
    Corrupt,
    /// Its extent is gone or too short: the space is damaged.
    Missing,
    /// It could not be read (EACCES, EMFILE, EIO, ...): the errno says why;
    /// the space may be fine, so nothing should be copied again.
    Io,
}

/// Classifies an I/O error from reading an extent and describes it with its errno.
fn io_bad(e: &std::io::Error, doing: &str) -> (BadKind, String) {
    match (e.kind(), e.raw_os_error()) {
        (std::io::ErrorKind::NotFound, _) => (BadKind::Missing, format!("missing ({doing}: {e})")),
        (std::io::ErrorKind::UnexpectedEof, _) => (BadKind::Missing, format!("missing ({e})")),
        (_, Some(errno)) => (
            BadKind::Io,
            format!("I/O error ({doing}: {})", crate::error::Errno(errno)),
        ),
        _ => (BadKind::Io, format!("I/O error ({doing}: {e})")),
    }
}

/// An extent file whose length is not the one the manifest planned: it
/// grew (something appended to it) or was cut short. Either way the space
/// is damaged even when every sample in it still reads back intact: the
/// loader and the node service refuse it ([`Error::ExtentSize`],
/// [`Error::Truncated`]), and repair restores the planned length.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BadExtent {
    /// Extent index.
    pub index: u32,
    /// Its file.
    pub path: PathBuf,
    /// Its length on disk.
    pub actual_bytes: u64,
    /// The length the manifest gives it.
    pub manifest_bytes: u64,
}

impl std::fmt::Display for BadExtent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "extent {} is {} bytes, manifest says {}",
            self.path.display(),
            self.actual_bytes,
            self.manifest_bytes
        )
    }
}

/// What [`Space::verify`] found.
#[derive(Debug, Default)]
#[non_exhaustive]
pub struct VerifyReport {
    /// Samples checked.
    pub checked: u64,
    /// Bytes checked.
    pub bytes: u64,
    /// Samples that are corrupt or missing, by id.
    pub bad: Vec<BadSample>,
    /// Extent files that exist but are not the length the manifest gives
    /// them (a missing extent shows as its samples, [`BadKind::Missing`]).
    pub bad_extents: Vec<BadExtent>,
    /// Whether reads bypassed the page cache.
    pub direct_io: bool,
}

impl VerifyReport {
    /// Samples that could not be read at all (I/O errors), as opposed to
    /// corrupt or missing ones.
    pub fn io_errors(&self) -> usize {
        self.bad.iter().filter(|b| b.kind == BadKind::Io).count()
    }

    /// Everything found wrong: bad samples plus extents of the wrong length.
    pub fn bad_count(&self) -> usize {
        self.bad.len() + self.bad_extents.len()
    }
}

/// A space's catalog (the one it was preloaded from).
impl AsRef<Catalog> for Space {
    fn as_ref(&self) -> &Catalog {
        &self.catalog
    }
}

impl Space {
    /// Opens a complete space: catalog, then manifest (which must belong to
    /// that catalog). Extent files are checked by [`Space::check_extents`] and
    /// [`Space::verify`], not here, so a damaged space can still be inspected.
    pub fn open(dir: &Path) -> Result<Space> {
        Space::open_manifest(dir, files::MANIFEST)
    }

    /// Opens the space with the manifest named `name` in `dir` (the
    /// manifest, or a rebalance's staged one).
    pub(crate) fn open_manifest(dir: &Path, name: &str) -> Result<Space> {
        let mpath = dir.join(name);
        if !mpath.exists() {
            let reason = if dir.join(files::JOURNAL).exists() {
                "a preload was started but has not finished (no manifest); rerun kspeed preload"
            } else if dir.exists() {
                "no manifest; run kspeed preload"
            } else {
                "the directory does not exist"
            };
            return Err(Error::NotASpace {
                path: dir.to_path_buf(),
                reason: reason.into(),
            });
        }
        let catalog = Catalog::open(&dir.join(files::CATALOG))?;
        let mfile = File::open(&mpath).ctx("open", &mpath)?;
        let manifest = ReadOnlyMap::new(&mfile).ctx("mmap", &mpath)?;
        let corrupt = |detail: String| Error::Corrupt {
            path: mpath.clone(),
            kind: "manifest",
            detail,
        };
        let (params, extent_count, held_samples, held_bytes, body_start, body_len) = {
            let bytes = manifest.as_slice();
            let p = format::parse_versions(
                &mpath,
                "manifest",
                &MANIFEST_MAGIC,
                1..=MANIFEST_VERSION,
                bytes,
            )?;
            let owner_fn = match p.version {
                1 => Some(OwnerFn::Scaled),
                _ => u32::try_from(p.fields.u64(OWNER_FN_FIELD))
                    .ok()
                    .and_then(OwnerFn::from_code),
            }
            .ok_or_else(|| {
                corrupt(format!(
                    "unknown owner function {}",
                    p.fields.u64(OWNER_FN_FIELD)
                ))
            })?;
            let mut params = LayoutParams::from_fields(p.fields, owner_fn)
                .ok_or_else(|| corrupt("layout parameters out of range".into()))?;
            if p.version >= 3 {
                params.max_held_bytes = p.fields.u64(BUDGET_FIELD);
            }
            let f = LayoutParams::PARAM_FIELDS;
            (
                params,
                p.fields.u64(f),
                p.fields.u64(f + 8),
                p.fields.u64(f + 16),
                p.body.as_ptr() as usize - bytes.as_ptr() as usize,
                p.body.len(),
            )
        };
        params.validate().map_err(|e| corrupt(e.to_string()))?;
        if params.catalog_identity != catalog.identity() || params.catalog_samples != catalog.len()
        {
            return Err(corrupt(format!(
                "it belongs to another catalog (identity {:#010x}, {} samples; catalog.ksc has {:#010x}, {})",
                params.catalog_identity,
                params.catalog_samples,
                catalog.identity(),
                catalog.len()
            )));
        }
        let expected = extent_count
            .checked_mul(8)
            .and_then(|e| e.checked_add(catalog.len() * LOC_REC as u64));
        if expected != Some(body_len as u64) {
            return Err(corrupt(format!(
                "body is {body_len} bytes, expected {:?} for {extent_count} extents and {} samples",
                expected,
                catalog.len()
            )));
        }
        let body = &manifest.as_slice()[body_start..];
        let extent_lens: Vec<u64> = (0..extent_count as usize)
            .map(|i| le_u64(body, i * 8))
            .collect();
        let space = Space {
            dir: dir.to_path_buf(),
            params,
            extent_lens,
            locs_start: body_start + extent_count as usize * 8,
            held_samples,
            held_bytes,
            catalog,
            manifest,
        };
        // Every location must lie inside its extent and be aligned.
        let (mut count, mut bytes) = (0u64, 0u64);
        for id in 0..space.catalog.len() {
            if let Some(loc) = space.location(id) {
                let len = space.catalog.sample(id).len as u64;
                let ok = (loc.extent as usize) < space.extent_lens.len()
                    && loc.offset.is_multiple_of(params.align_bytes as u64)
                    && loc.offset + len <= space.extent_lens[loc.extent as usize];
                if !ok {
                    return Err(corrupt(format!("sample {id}: location outside its extent")));
                }
                count += 1;
                bytes += len;
            }
        }
        if count != held_samples || bytes != held_bytes {
            return Err(corrupt(
                "held sample totals do not match the locations".into(),
            ));
        }
        Ok(space)
    }

    /// The space directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The catalog.
    pub fn catalog(&self) -> &Catalog {
        &self.catalog
    }

    /// The layout parameters.
    pub fn params(&self) -> &LayoutParams {
        &self.params
    }

    /// Samples held by this node.
    pub fn held_samples(&self) -> u64 {
        self.held_samples
    }

    /// Bytes of samples held by this node.
    pub fn held_bytes(&self) -> u64 {
        self.held_bytes
    }

    /// Extent lengths.
    pub fn extent_lens(&self) -> &[u64] {
        &self.extent_lens
    }

    /// Path of extent `i`.
    pub fn extent_path(&self, i: u32) -> PathBuf {
        extent_path(&self.dir, i)
    }

    /// Where sample `id` sits in this space, if this node holds it.
    pub fn location(&self, id: u64) -> Option<Location> {
        decode_loc(&self.manifest.as_slice()[self.locs_start..], id)
    }

    /// Checks that every extent file exists with its planned length: a
    /// shorter one is [`Error::Truncated`], a longer one
    /// [`Error::ExtentSize`] (both are what [`Space::verify`] lists in
    /// [`VerifyReport::bad_extents`]).
    pub fn check_extents(&self) -> Result<()> {
        for (i, &len) in self.extent_lens.iter().enumerate() {
            let p = self.extent_path(i as u32);
            let actual = std::fs::metadata(&p).ctx("stat", &p)?.len();
            if actual < len {
                return Err(Error::Truncated {
                    path: p,
                    kind: "extent",
                    expected: len,
                    actual,
                });
            }
            if actual > len {
                return Err(Error::ExtentSize {
                    path: p,
                    actual_bytes: actual,
                    manifest_bytes: len,
                });
            }
        }
        Ok(())
    }

    /// Extents that exist with another length than the manifest's (one
    /// `stat` each; a missing or unreadable one is left to the sample reads,
    /// which name it).
    fn extents_of_wrong_size(&self) -> Vec<BadExtent> {
        let mut v = Vec::new();
        for (i, &len) in self.extent_lens.iter().enumerate() {
            let path = self.extent_path(i as u32);
            if let Ok(md) = std::fs::metadata(&path) {
                if md.len() != len {
                    v.push(BadExtent {
                        index: i as u32,
                        path,
                        actual_bytes: md.len(),
                        manifest_bytes: len,
                    });
                }
            }
        }
        v
    }

    /// Re-reads every held sample (with `O_DIRECT` where the file system
    /// allows, so the disk is read rather than the page cache) and checks its
    /// CRC32C, and checks every extent's length against the manifest.
    /// Corrupt and missing samples and extents of the wrong length are
    /// collected, not fatal.
    pub fn verify(&self, threads: usize, progress: ProgressMode) -> Result<VerifyReport> {
        sys::raise_open_files_limit();
        let align = self.params.align_bytes as usize;
        // Read windows of up to 8 MiB; a larger sample is streamed through it.
        let chunk = (8usize << 20).next_multiple_of(align);
        let progress = Progress::new("verify", self.held_bytes, progress);
        let report = Mutex::new(VerifyReport {
            direct_io: true,
            ..Default::default()
        });
        let bufs: Mutex<Vec<AlignedBuf>> = Mutex::new(Vec::new());
        crate::par::for_each_chunk(self.catalog.len(), 1024, threads, |range| {
            let mut buf = bufs
                .lock()
                .expect("not poisoned")
                .pop()
                .unwrap_or_else(|| AlignedBuf::new(chunk, align));
            let mut local = VerifyReport {
                direct_io: true,
                ..Default::default()
            };
            // One extent open at a time per worker (samples of a chunk are in
            // extent order), so a space of thousands of extents does not need
            // thousands of descriptors.
            let mut open: Option<(u32, std::io::Result<(File, bool)>)> = None;
            // Samples of a chunk are contiguous in their extent, so read them
            // in windows of up to `chunk` bytes rather than one by one; a
            // window never reaches past the chunk's last sample in that extent.
            let mut chunk_end: Vec<(u32, u64)> = Vec::new();
            for id in range.clone() {
                if let Some(loc) = self.location(id) {
                    let end = loc.offset + self.catalog.sample(id).len as u64;
                    match chunk_end.iter_mut().find(|(e, _)| *e == loc.extent) {
                        Some((_, e)) => *e = (*e).max(end),
                        None => chunk_end.push((loc.extent, end)),
                    }
                }
            }
            // The window: extent, start offset, valid bytes in `buf`.
            let mut window: Option<(u32, u64, usize)> = None;
            for id in range {
                let Some(loc) = self.location(id) else {
                    continue;
                };
                let s = self.catalog.sample(id);
                let len = s.len as u64;
                local.checked += 1;
                local.bytes += len;
                let extent = self.extent_path(loc.extent);
                let bad = |(kind, what): (BadKind, String)| BadSample {
                    id,
                    source: self.catalog.file_path(s.file),
                    extent: extent.clone(),
                    what,
                    kind,
                };
                if open.as_ref().is_none_or(|(e, _)| *e != loc.extent) {
                    window = None;
                    open = Some((loc.extent, sys::open_direct(&extent)));
                }
                let (file, direct) = match &open.as_ref().expect("just opened").1 {
                    Ok((f, d)) => (f, d),
                    Err(e) => {
                        local.bad.push(bad(io_bad(e, "open extent")));
                        progress.add(len);
                        continue;
                    }
                };
                local.direct_io &= *direct;
                let in_window = |w: Option<(u32, u64, usize)>| {
                    w.is_some_and(|(e, start, valid)| {
                        e == loc.extent
                            && loc.offset >= start
                            && loc.offset + len <= start + valid as u64
                    })
                };
                if !in_window(window) && len <= buf.len() as u64 {
                    let end = chunk_end
                        .iter()
                        .find(|(e, _)| *e == loc.extent)
                        .map_or(loc.offset + len, |(_, e)| *e);
                    let want = ((end - loc.offset) as usize)
                        .next_multiple_of(align)
                        .min(buf.len());
                    window = match file.read_at(&mut buf.as_mut_slice()[..want], loc.offset) {
                        Ok(got) => Some((loc.extent, loc.offset, got)),
                        Err(_) => None,
                    };
                }
                let result = if in_window(window) {
                    let (_, start, _) = window.expect("in window");
                    let from = (loc.offset - start) as usize;
                    Ok(crc32c::crc32c(&buf.as_slice()[from..from + len as usize]))
                } else {
                    read_crc(file, loc.offset, len, buf.as_mut_slice(), align)
                };
                match result {
                    Ok(crc) if crc == s.crc32c => {}
                    Ok(crc) => local.bad.push(bad((
                        BadKind::Corrupt,
                        format!(
                            "corrupt (crc32c {crc:#010x}, catalog says {:#010x})",
                            s.crc32c
                        ),
                    ))),
                    Err(e) => local.bad.push(bad(io_bad(&e, "read"))),
                }
                progress.add(len);
            }
            bufs.lock().expect("not poisoned").push(buf);
            let mut r = report.lock().expect("not poisoned");
            r.checked += local.checked;
            r.bytes += local.bytes;
            r.bad.extend(local.bad);
            r.direct_io &= local.direct_io;
            Ok(())
        })?;
        progress.finish();
        let mut report = report.into_inner().expect("not poisoned");
        report.bad.sort_by_key(|b| b.id);
        report.bad_extents = self.extents_of_wrong_size();
        Ok(report)
    }
}

/// CRC32C of `len` bytes at `offset` (aligned), reading aligned pieces.
fn read_crc(
    file: &File,
    offset: u64,
    len: u64,
    buf: &mut [u8],
    align: usize,
) -> std::io::Result<u32> {
    let mut crc = 0u32;
    let mut pos = 0u64;
    while pos < len {
        let want = (len - pos).min(buf.len() as u64) as usize;
        let read_len = want.next_multiple_of(align);
        let got = file.read_at(&mut buf[..read_len], offset + pos)?;
        if got < want {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                format!("extent ends at byte {}", offset + pos + got as u64),
            ));
        }
        crc = crc32c::crc32c_append(crc, &buf[..want]);
        pos += want as u64;
    }
    Ok(crc)
}
