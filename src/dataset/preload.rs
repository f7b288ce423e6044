//! Preload: copy the samples this node holds from the source into a space.
//!
//! Idempotent (a complete, matching space copies nothing), resumable (a
//! journal records a watermark of sample ids whose bytes are synced to disk;
//! a rerun after SIGKILL continues from it), and honest about change (source
//! files are compared with the catalog by size and mtime before copying, and
//! every copied sample's CRC32C is checked against the catalog). The manifest
//! is written last, by atomic rename, so a space is either complete or
//! visibly unfinished.
//!
//! A source in an object store that this node holds whole, with no catalog
//! yet, is read once: the catalog is first written from the listing with
//! its CRCs pending (`catalog.pending.ksc`), the copy computes each
//! sample's CRC32C from the bytes it writes (recorded with each checkpoint
//! in `crc.pending`, so a rerun resumes), and the catalog with the CRCs
//! replaces the pending one before the manifest is written. Elsewhere the
//! catalog's checksum pass reads everything first and the copy checks
//! every sample against it.
//!
//! Why this file is over ~800 lines: preload is one pipeline (plan, copy
//! threads, CRC check or, in one pass, CRC computation, fsync, resume,
//! manifest) whose steps share one state; split apart they would pass that
//! state around instead.

use std::collections::BTreeSet;
use std::fs::{self, File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::catalog::{self, BuildOptions, Catalog, SpanReader};
use super::owner::{OwnerFn, Placement};
use super::source::{ScanNotes, ScanOptions, SourceSpec};
use super::space::{self, extent_path, files, LayoutParams, Plan, Space};
use crate::error::{Error, IoContext, Result, SourceChange};
use crate::format::{self, FileWriter};
use crate::progress::{Progress, ProgressMode};

const JOURNAL_MAGIC: [u8; 8] = *b"KSPDJRN\0";
/// The catalog of a one-pass build, CRCs not yet known (module comment).
const PENDING_CATALOG: &str = "catalog.pending.ksc";
/// The CRCs a one-pass build computed, u32 little-endian per sample id,
/// synced up to the journal's watermark.
const PENDING_CRCS: &str = "crc.pending";
/// Version 2: the owner function's code at field 64 (version 1 is the
/// scaled function's journal, which builds that predate jump also resume);
/// version 3, only for a partial space: its byte budget at field 72.
const JOURNAL_VERSION: u32 = 3;

/// Preload settings. `Default` is one node holding everything.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct PreloadOptions {
    /// The source; may be omitted when the space already has a catalog.
    pub source: Option<SourceSpec>,
    /// A prebuilt catalog to use instead of building one (copied into the space).
    pub catalog: Option<PathBuf>,
    /// Node count and copies.
    pub placement: Placement,
    /// This node's index.
    pub node_index: u32,
    /// Sample alignment in extents.
    pub align_bytes: u32,
    /// Extent size cap.
    pub extent_bytes: u64,
    /// A partial space (`--max-bytes`): hold at most this many bytes of
    /// this node's share (its start by id, while they last:
    /// [`crate::dataset::partial`]; the rest stays in the source and is
    /// read from there, ahead of need, by the loader). Every node of a
    /// cluster uses the same value. 0 (the default): the whole share.
    pub max_held_bytes: u64,
    /// Copy threads.
    pub threads: usize,
    /// Object-store sources: ranged GETs in flight, one copy thread each
    /// (instead of `threads`). Default 64.
    pub requests: usize,
    /// Progress display.
    pub progress: ProgressMode,
    /// Rebuild the catalog from the source and copy everything again.
    pub refresh: bool,
    /// Sync and record progress after this many copied bytes.
    pub checkpoint_bytes: u64,
    /// Cap on copy bandwidth (bytes/s), e.g. to preload beside a running job.
    pub max_bytes_per_sec: Option<u64>,
    /// Refuse to start when the file system has less free space than needed.
    pub check_free_space: bool,
    /// How the source scan treats special files, symlinks leaving the tree
    /// and damaged tar members (strict by default).
    pub scan: ScanOptions,
    /// Permissions of the files preload writes (catalog, manifest, journal,
    /// extents); directories it creates get these plus `x` where `r` is set.
    /// Default 0o600: a private cache, whatever the source's permissions.
    pub file_mode: u32,
}

impl Default for PreloadOptions {
    fn default() -> Self {
        PreloadOptions {
            source: None,
            catalog: None,
            placement: Placement::SINGLE,
            node_index: 0,
            align_bytes: space::DEFAULT_ALIGN_BYTES,
            extent_bytes: space::DEFAULT_EXTENT_BYTES,
            max_held_bytes: 0,
            threads: crate::par::default_threads(),
            requests: 64,
            progress: ProgressMode::Quiet,
            refresh: false,
            checkpoint_bytes: 64 << 20,
            max_bytes_per_sec: None,
            check_free_space: true,
            scan: ScanOptions::default(),
            file_mode: 0o600,
        }
    }
}

setters!(PreloadOptions {
    source: Option<SourceSpec>,
    catalog: Option<PathBuf>,
    placement: Placement,
    node_index: u32,
    align_bytes: u32,
    extent_bytes: u64,
    max_held_bytes: u64,
    threads: usize,
    requests: usize,
    progress: ProgressMode,
    refresh: bool,
    checkpoint_bytes: u64,
    max_bytes_per_sec: Option<u64>,
    check_free_space: bool,
    scan: ScanOptions,
    file_mode: u32,
});

/// The directory mode matching a file mode: `x` wherever `r` is set.
pub(crate) fn dir_mode(file_mode: u32) -> u32 {
    let m = file_mode & 0o777;
    m | ((m & 0o444) >> 2)
}

/// Creates `dir` (and parents) with `mode` for the directories it creates.
fn create_private_dir(dir: &Path, mode: u32) -> Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    fs::DirBuilder::new()
        .recursive(true)
        .mode(mode)
        .create(dir)
        .ctx("create directory", dir)
}

/// Sets `path`'s permissions to `mode`.
fn chmod(path: &Path, mode: u32) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    fs::set_permissions(path, fs::Permissions::from_mode(mode)).ctx("chmod", path)
}

/// What a preload did.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct PreloadReport {
    /// The space was already complete; nothing was copied.
    pub up_to_date: bool,
    /// A catalog was built from the source in this run.
    pub catalog_built: bool,
    /// Samples below this id were already copied by an interrupted run.
    pub resumed_at: Option<u64>,
    /// Samples copied in this run.
    pub copied_samples: u64,
    /// Bytes copied in this run.
    pub copied_bytes: u64,
    /// Samples this node holds.
    pub held_samples: u64,
    /// Their bytes.
    pub held_bytes: u64,
    /// Time spent building the catalog.
    pub catalog_time: Duration,
    /// Time spent copying.
    pub copy_time: Duration,
    /// What the catalog build noticed and did not turn into samples (empty
    /// when no catalog was built in this run).
    pub notes: ScanNotes,
}

/// Holds a space's lock file (`SPACE/.lock`, flock). Preload, repair and
/// unload hold it exclusively; `kspeed serve` (and anything else that reads
/// the extents for a long time) holds it shared, so a space is never removed
/// or rewritten under a process that serves it. A refusal names the holders'
/// pids (from `/proc/locks`).
pub struct SpaceLock {
    _file: File,
}

impl SpaceLock {
    /// Takes the lock exclusively (to change the space).
    pub fn exclusive(dir: &Path) -> Result<Self> {
        Self::take(dir, false)
    }

    /// Takes the lock shared (to read the space while it must not change).
    pub fn shared(dir: &Path) -> Result<Self> {
        Self::take(dir, true)
    }

    pub(crate) fn acquire(dir: &Path) -> Result<Self> {
        Self::exclusive(dir)
    }

    fn take(dir: &Path, shared: bool) -> Result<Self> {
        let p = dir.join(files::LOCK);
        // A reader only needs to read the lock file (flock works on a
        // read-only descriptor), so serve runs on a space it cannot write.
        let existing = if shared { File::open(&p).ok() } else { None };
        let file = match existing {
            Some(f) => f,
            None => {
                use std::os::unix::fs::OpenOptionsExt;
                OpenOptions::new()
                    .create(true)
                    .truncate(false)
                    .read(true)
                    .write(true)
                    .mode(0o600)
                    .open(&p)
                    .ctx("create", &p)?
            }
        };
        let r = if shared {
            file.try_lock_shared()
        } else {
            file.try_lock()
        };
        match r {
            Ok(()) => Ok(SpaceLock { _file: file }),
            Err(fs::TryLockError::WouldBlock) => Err(Error::SpaceLocked {
                path: dir.to_path_buf(),
                holders: lock_holders(&file),
            }),
            Err(fs::TryLockError::Error(e)) => Err(Error::io("lock", &p, e)),
        }
    }
}

/// The pids holding a flock on `file`, and whether each lock is shared,
/// read from `/proc/locks` (empty when it cannot be read).
fn lock_holders(file: &File) -> Vec<(u32, bool)> {
    use std::os::unix::fs::MetadataExt;
    let Ok(md) = file.metadata() else {
        return Vec::new();
    };
    let dev = md.dev();
    let want = format!(
        "{:02x}:{:02x}:{}",
        libc::major(dev),
        libc::minor(dev),
        md.ino()
    );
    let Ok(text) = fs::read_to_string("/proc/locks") else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for line in text.lines() {
        // "1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF"; waiters carry "->".
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() < 6 || f[1] != "FLOCK" || f.contains(&"->") {
            continue;
        }
        if f[5] != want {
            continue;
        }
        if let Ok(pid) = f[4].parse::<u32>() {
            out.push((pid, f[3] == "READ"));
        }
    }
    out.sort();
    out.dedup();
    out
}

pub(crate) fn remove_if_exists(p: &Path) -> Result<()> {
    match fs::remove_file(p) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(Error::io("remove", p, e)),
    }
}

/// A full disk while writing the catalog: name the bytes the catalog needs
/// (the `.tmp` file is already removed by the writer).
fn catalog_write_error(e: Error, dir: &Path) -> Error {
    match e {
        Error::DiskFull { path, needed, .. } => Error::DiskFull {
            path,
            needed,
            available: crate::sys::free_bytes(dir).unwrap_or(0),
        },
        e => e,
    }
}

/// Removes the layout (manifest, journal, extents) but keeps the catalog.
fn clear_layout(dir: &Path) -> Result<()> {
    remove_if_exists(&dir.join(files::MANIFEST))?;
    remove_if_exists(&dir.join(files::JOURNAL))?;
    // A staged rebalance is of the old layout's extents.
    remove_if_exists(&dir.join(files::STAGED))?;
    remove_if_exists(&dir.join(files::REBALANCE_JOURNAL))?;
    let ext = dir.join(files::EXTENTS);
    match fs::remove_dir_all(&ext) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(Error::io("remove", &ext, e)),
    }
}

/// Refuses a catalog built with other `--members` than asked for.
fn check_members(cat: &Catalog, opts: &PreloadOptions) -> Result<()> {
    let want = &opts.scan.members;
    if !want.is_empty() && cat.members() != *want {
        return Err(Error::InvalidConfig(format!(
            "catalog {} makes samples of members [{}], not [{}]; use --refresh (or another space) to rebuild it",
            cat.path().display(),
            cat.members().join(","),
            want.join(",")
        )));
    }
    Ok(())
}

/// Whether this preload reads its source once (module comment): a source
/// in an object store, no catalog given or in the space yet (or a
/// refresh), and this node holds every sample (not a partial space: the
/// catalog needs the CRC of every sample, the copy reads only some).
fn one_pass_eligible(dir: &Path, opts: &PreloadOptions) -> bool {
    opts.source.as_ref().is_some_and(|s| s.is_remote())
        && opts.catalog.is_none()
        && (opts.refresh || !dir.join(files::CATALOG).exists())
        && opts.placement.replicas >= opts.placement.nodes
        && opts.max_held_bytes == 0
}

/// The pending catalog of a one-pass build: the one an interrupted run
/// left (same source), or one written now from the listing.
fn pending_catalog(
    dir: &Path,
    opts: &PreloadOptions,
    report: &mut PreloadReport,
) -> Result<Catalog> {
    let spec = opts.source.as_ref().expect("one pass has a source");
    let ppath = dir.join(PENDING_CATALOG);
    if opts.refresh {
        clear_layout(dir)?;
        remove_if_exists(&ppath)?;
        remove_if_exists(&dir.join(PENDING_CRCS))?;
    }
    match Catalog::open(&ppath) {
        Ok(c) if c.source_spec() == *spec && check_members(&c, opts).is_ok() => return Ok(c),
        Ok(_) | Err(_) if ppath.exists() => {
            log::warn!(
                "{}: an earlier one-pass preload of another source or layout; starting over",
                dir.display()
            );
            clear_layout(dir)?;
            remove_if_exists(&dir.join(PENDING_CRCS))?;
        }
        _ => {}
    }
    let t0 = Instant::now();
    let scan = catalog::scan_any(spec, &opts.scan)?;
    log::info!(
        "listed {}: {} samples in {} objects; their CRC32C is computed while copying",
        spec.to_source_string(),
        scan.samples.len(),
        scan.files.len()
    );
    catalog::write(&scan, &vec![0; scan.samples.len()], &ppath)
        .map_err(|e| catalog_write_error(e, dir))?;
    chmod(&ppath, opts.file_mode)?;
    report.notes = scan.notes;
    report.catalog_built = true;
    report.catalog_time = t0.elapsed();
    Catalog::open(&ppath)
}

/// Appends the CRCs of ids `from..crcs.len()` to `crc.pending` and syncs it.
fn save_crcs(dir: &Path, crcs: &[AtomicU32], from: u64) -> Result<()> {
    let p = dir.join(PENDING_CRCS);
    let f = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&p)
        .ctx("open", &p)?;
    let bytes: Vec<u8> = crcs[from as usize..]
        .iter()
        .flat_map(|c| c.load(Ordering::Relaxed).to_le_bytes())
        .collect();
    f.write_all_at(&bytes, from * 4).ctx("write", &p)?;
    f.sync_data().ctx("fsync", &p)
}

/// Loads the CRCs of the first `into.len()` samples from `crc.pending`.
fn load_crcs(dir: &Path, into: &[AtomicU32]) -> Result<()> {
    let p = dir.join(PENDING_CRCS);
    let bytes = fs::read(&p).ctx("read", &p)?;
    if bytes.len() < into.len() * 4 {
        return Err(Error::Corrupt {
            path: p,
            kind: "pending CRCs",
            detail: format!(
                "{} bytes, but the journal says {} samples are copied",
                bytes.len(),
                into.len()
            ),
        });
    }
    for (c, b) in into.iter().zip(bytes.chunks_exact(4)) {
        c.store(
            u32::from_le_bytes(b.try_into().expect("4 bytes")),
            Ordering::Relaxed,
        );
    }
    Ok(())
}

/// Brings the catalog in `dir` up to date with `opts`, building it if needed.
fn ensure_catalog(
    dir: &Path,
    opts: &PreloadOptions,
    report: &mut PreloadReport,
) -> Result<Catalog> {
    let cpath = dir.join(files::CATALOG);
    if let Some(given) = &opts.catalog {
        let given_cat = Catalog::open(given)?;
        check_members(&given_cat, opts)?;
        // A catalog indexes one source: preloading it "from" another would
        // silently copy the catalog's source instead.
        if let Some(spec) = &opts.source {
            if given_cat.source_spec() != *spec {
                return Err(Error::CatalogOfAnotherSource {
                    catalog: given.clone(),
                    catalog_source: given_cat.source().into_owned(),
                    given: spec.to_source_string(),
                });
            }
        }
        let same = Catalog::open(&cpath)
            .map(|c| c.identity() == given_cat.identity())
            .unwrap_or(false);
        if !same {
            clear_layout(dir)?;
            let tmp = dir.join("catalog.ksc.tmp");
            if let Err(e) = fs::copy(given, &tmp).ctx("copy", given) {
                let _ = fs::remove_file(&tmp);
                return Err(match e {
                    Error::DiskFull { path, .. } => Error::DiskFull {
                        path,
                        needed: fs::metadata(given).map(|m| m.len()).unwrap_or(0),
                        available: crate::sys::free_bytes(dir).unwrap_or(0),
                    },
                    e => e,
                });
            }
            chmod(&tmp, opts.file_mode)?;
            File::open(&tmp)
                .and_then(|f| f.sync_all())
                .ctx("fsync", &tmp)?;
            fs::rename(&tmp, &cpath).ctx("rename", &cpath)?;
            format::sync_parent(&cpath)?;
        }
        return Catalog::open(&cpath);
    }
    if cpath.exists() && !opts.refresh {
        let cat = Catalog::open(&cpath)?;
        check_members(&cat, opts)?;
        if let Some(spec) = &opts.source {
            if cat.source_spec() != *spec {
                return Err(Error::SourceMismatch {
                    space: dir.to_path_buf(),
                    catalog_source: cat.source().into_owned(),
                    given: spec.to_source_string(),
                });
            }
        }
        return Ok(cat);
    }
    let spec = match (&opts.source, cpath.exists()) {
        (Some(s), _) => s.clone(),
        (None, true) => Catalog::open(&cpath)?.source_spec(),
        (None, false) => {
            return Err(Error::InvalidConfig(format!(
                "space {} has no catalog yet: give --source",
                dir.display()
            )))
        }
    };
    if opts.refresh {
        clear_layout(dir)?;
    }
    let t0 = Instant::now();
    let (cat, notes) = catalog::build_with_notes(
        &spec,
        &cpath,
        &BuildOptions {
            threads: opts.threads,
            requests: opts.requests,
            progress: opts.progress,
            scan: opts.scan.clone(),
        },
    )
    .map_err(|e| catalog_write_error(e, dir))?;
    chmod(&cpath, opts.file_mode)?;
    report.notes = notes;
    report.catalog_built = true;
    report.catalog_time = t0.elapsed();
    Ok(cat)
}

struct Journal {
    params: LayoutParams,
    watermark: u64,
}

fn read_journal(dir: &Path) -> Result<Option<Journal>> {
    let p = dir.join(files::JOURNAL);
    if !p.exists() {
        return Ok(None);
    }
    let bytes = format::read_small(&p)?;
    let parsed =
        format::parse_versions(&p, "journal", &JOURNAL_MAGIC, 1..=JOURNAL_VERSION, &bytes)?;
    let owner_fn = match parsed.version {
        1 => Some(OwnerFn::Scaled),
        _ => u32::try_from(parsed.fields.u64(64))
            .ok()
            .and_then(OwnerFn::from_code),
    };
    let params = owner_fn.and_then(|f| LayoutParams::from_fields(parsed.fields, f));
    let mut params = params.ok_or_else(|| Error::Corrupt {
        path: p.clone(),
        kind: "journal",
        detail: "layout parameters out of range".into(),
    })?;
    if parsed.version >= 3 {
        params.max_held_bytes = parsed.fields.u64(72);
    }
    Ok(Some(Journal {
        params,
        watermark: parsed.fields.u64(56),
    }))
}

fn write_journal(dir: &Path, params: &LayoutParams, watermark: u64) -> Result<()> {
    let fields = params.to_fields().u64(watermark);
    let owner_fn = params.placement.owner_fn;
    let (version, fields) = match owner_fn {
        _ if params.is_partial() => (
            JOURNAL_VERSION,
            fields
                .u64(owner_fn.code() as u64)
                .u64(params.max_held_bytes),
        ),
        OwnerFn::Scaled => (1, fields),
        OwnerFn::Jump => (2, fields.u64(owner_fn.code() as u64)),
    };
    let w = FileWriter::create(&dir.join(files::JOURNAL), JOURNAL_MAGIC, version, fields)?;
    w.commit()
}

/// Whether a complete space with `have` may stay as it is when preload is
/// asked for `want`: the same layout, or the same but for the owner
/// function (a space placed by the scaled function before jump existed
/// keeps it, so rerunning an old preload command copies nothing;
/// `kspeed rebalance` converts it, moving only what the new function moves).
fn keeps_layout(have: &LayoutParams, want: &LayoutParams) -> bool {
    let mut w = *want;
    w.placement.owner_fn = have.placement.owner_fn;
    *have == w
}

fn empty_report() -> PreloadReport {
    PreloadReport {
        up_to_date: false,
        catalog_built: false,
        resumed_at: None,
        copied_samples: 0,
        copied_bytes: 0,
        held_samples: 0,
        held_bytes: 0,
        catalog_time: Duration::ZERO,
        copy_time: Duration::ZERO,
        notes: ScanNotes::default(),
    }
}

fn layout_params(catalog: &Catalog, opts: &PreloadOptions) -> LayoutParams {
    LayoutParams {
        catalog_identity: catalog.identity(),
        catalog_samples: catalog.len(),
        placement: opts.placement,
        node_index: opts.node_index,
        align_bytes: opts.align_bytes,
        extent_bytes: opts.extent_bytes,
        max_held_bytes: opts.max_held_bytes,
    }
}

/// Whether the space is complete and matches `opts` and the source, checked
/// under a shared lock without changing anything (preload beside a serve).
fn up_to_date_under_readers(dir: &Path, opts: &PreloadOptions) -> Result<Option<PreloadReport>> {
    let _shared = SpaceLock::shared(dir)?;
    let space = Space::open(dir)?;
    let catalog = space.catalog();
    check_members(catalog, opts)?;
    if let Some(given) = &opts.catalog {
        if Catalog::open(given)?.identity() != catalog.identity() {
            return Ok(None);
        }
    }
    if opts
        .source
        .as_ref()
        .is_some_and(|s| *s != catalog.source_spec())
    {
        return Ok(None);
    }
    let changes = catalog.source_status(&opts.scan)?;
    if !changes.is_empty() {
        return Err(Error::SourceChanged { changes });
    }
    if !keeps_layout(space.params(), &layout_params(catalog, opts))
        || space.check_extents().is_err()
    {
        return Ok(None);
    }
    let mut r = empty_report();
    r.up_to_date = true;
    r.held_samples = space.held_samples();
    r.held_bytes = space.held_bytes();
    Ok(Some(r))
}

/// Preloads `dir` (created if missing) as `opts` says.
pub fn preload(dir: &Path, opts: &PreloadOptions) -> Result<PreloadReport> {
    crate::sys::raise_open_files_limit();
    create_private_dir(dir, dir_mode(opts.file_mode))?;
    let _lock = match SpaceLock::acquire(dir) {
        Ok(l) => l,
        // Readers only (a running serve): a space that is already up to date
        // is reported as such; anything that would change it is refused.
        Err(Error::SpaceLocked { holders, path })
            if !opts.refresh && !holders.is_empty() && holders.iter().all(|h| h.1) =>
        {
            return match up_to_date_under_readers(dir, opts)? {
                Some(r) => Ok(r),
                None => Err(Error::SpaceLocked { path, holders }),
            };
        }
        Err(e) => return Err(e),
    };
    let mut report = empty_report();
    let one_pass = one_pass_eligible(dir, opts);
    let catalog = if one_pass {
        pending_catalog(dir, opts, &mut report)?
    } else {
        remove_if_exists(&dir.join(PENDING_CATALOG))?;
        remove_if_exists(&dir.join(PENDING_CRCS))?;
        ensure_catalog(dir, opts, &mut report)?
    };
    let mut params = layout_params(&catalog, opts);
    params.validate()?;

    // Additions are changes too: without this check new files and class
    // folders would be silently absent from an "up to date" space. A catalog
    // built in this run only needs the cheap size/mtime check.
    let changes = if report.catalog_built {
        catalog.source_changes()
    } else {
        catalog.source_status(&opts.scan)?
    };
    if !changes.is_empty() {
        return Err(Error::SourceChanged { changes });
    }

    // A complete space with the same layout: nothing to do.
    if dir.join(files::MANIFEST).exists() {
        match Space::open(dir) {
            Ok(space) if keeps_layout(space.params(), &params) && space.check_extents().is_ok() => {
                report.up_to_date = true;
                report.held_samples = space.held_samples();
                report.held_bytes = space.held_bytes();
                return Ok(report);
            }
            Ok(_) => log::warn!("{}: layout changed, copying again", dir.display()),
            Err(e) => log::warn!(
                "{}: existing manifest unusable ({e}), copying again",
                dir.display()
            ),
        }
        clear_layout(dir)?;
    }

    let plan = Plan::compute(&catalog, &params);
    report.held_samples = plan.held_samples;
    report.held_bytes = plan.held_bytes;
    let start_id = match read_journal(dir) {
        Ok(Some(j)) if j.params == params && j.watermark <= catalog.len() => j.watermark,
        Ok(Some(_)) => {
            log::warn!(
                "{}: journal is for another layout, starting over",
                dir.display()
            );
            clear_layout(dir)?;
            0
        }
        Ok(None) => {
            clear_layout(dir)?;
            0
        }
        Err(e) => {
            log::warn!("{}: journal unusable ({e}), starting over", dir.display());
            clear_layout(dir)?;
            0
        }
    };
    // A one-pass build's CRCs of the samples already copied.
    let crcs: Vec<AtomicU32> = if one_pass {
        (0..catalog.len()).map(|_| AtomicU32::new(0)).collect()
    } else {
        Vec::new()
    };
    let tags: Vec<std::sync::OnceLock<String>> = if one_pass {
        (0..catalog.file_count())
            .map(|_| std::sync::OnceLock::new())
            .collect()
    } else {
        Vec::new()
    };
    let start_id = if one_pass && start_id > 0 {
        match load_crcs(dir, &crcs[..start_id as usize]) {
            Ok(()) => start_id,
            Err(e) => {
                log::warn!("{}: {e}; copying from the start", dir.display());
                clear_layout(dir)?;
                0
            }
        }
    } else {
        start_id
    };
    if start_id > 0 {
        report.resumed_at = Some(start_id);
    }

    let ext_dir = dir.join(files::EXTENTS);
    create_private_dir(&ext_dir, dir_mode(opts.file_mode))?;
    // Extents are created here but opened only while written (one per copy
    // thread at a time), so a space of many extents fits the open-files limit.
    let mut extents = Vec::with_capacity(plan.extent_lens.len());
    let mut existing = 0u64;
    for i in 0..plan.extent_lens.len() as u32 {
        let p = extent_path(dir, i);
        let f = {
            use std::os::unix::fs::OpenOptionsExt;
            OpenOptions::new()
                .create(true)
                .truncate(false)
                .read(true)
                .write(true)
                .mode(opts.file_mode)
                .open(&p)
                .ctx("create", &p)?
        };
        // An extent left by an earlier run keeps its old mode otherwise.
        chmod(&p, opts.file_mode)?;
        existing += f
            .metadata()
            .ctx("stat", &p)?
            .len()
            .min(plan.extent_lens[i as usize]);
        drop(f);
        extents.push(p);
    }
    let needed = plan
        .extent_lens
        .iter()
        .sum::<u64>()
        .saturating_sub(existing);
    if opts.check_free_space {
        let available = crate::sys::free_bytes(dir).ctx("statvfs", dir)?;
        if needed > available {
            return Err(Error::DiskFull {
                path: dir.to_path_buf(),
                needed,
                available,
            });
        }
    }

    let t0 = Instant::now();
    let (to_copy, samples_to_copy) = (start_id..catalog.len())
        .filter_map(|id| plan.location(id).map(|_| catalog.sample(id).len as u64))
        .fold((0u64, 0u64), |(b, n), len| (b + len, n + 1));
    let copier = Copier {
        dir,
        catalog: &catalog,
        plan: &plan,
        params: &params,
        extents: &extents,
        dirty: Mutex::new(BTreeSet::new()),
        opts,
        progress: Progress::with_items("preload", to_copy, samples_to_copy, opts.progress),
        copied_samples: AtomicU64::new(0),
        copied_bytes: AtomicU64::new(0),
        started: Instant::now(),
        state: Mutex::new(Watermark {
            next: start_id,
            done: BTreeSet::new(),
            unsynced_bytes: 0,
            crcs_synced: start_id,
        }),
        crcs: one_pass.then_some(&crcs[..]),
        tags: &tags,
    };
    // Chunks of about 8 MiB of samples (less with a small checkpoint
    // interval), so the watermark moves between checkpoints even for large
    // samples and the pool stays busy for small ones.
    let mean = (catalog.total_bytes() / catalog.len()).max(1);
    let target = (8u64 << 20).min(opts.checkpoint_bytes / 2).max(1);
    let chunk = (target / mean).clamp(1, 4096);
    let n_left = catalog.len() - start_id;
    // A store's reads wait on the network, not the CPU: one thread per
    // request in flight, and chunks small enough that every thread has
    // some (a chunk's samples are read one after another).
    let (threads, chunk) = if catalog.source_spec().is_remote() {
        let t = opts.requests.max(1);
        (t, chunk.min((n_left / (t as u64 * 4)).max(1)))
    } else {
        (opts.threads, chunk)
    };
    let result = crate::par::for_each_chunk(n_left, chunk, threads, |r| {
        copier.copy_range(start_id + r.start..start_id + r.end)
    });
    if let Err(e) = result {
        // Record what is safely on disk so a rerun resumes from there.
        let _ = copier.checkpoint(true);
        return Err(match e {
            Error::DiskFull { path, .. } => Error::DiskFull {
                path,
                needed: to_copy.saturating_sub(copier.copied_bytes.load(Ordering::Relaxed)),
                available: crate::sys::free_bytes(dir).unwrap_or(0),
            },
            e => e,
        });
    }
    report.copied_samples = copier.copied_samples.load(Ordering::Relaxed);
    report.copied_bytes = copier.copied_bytes.load(Ordering::Relaxed);
    drop(copier);

    for (p, &len) in extents.iter().zip(&plan.extent_lens) {
        let f = OpenOptions::new().write(true).open(p).ctx("open", p)?;
        f.set_len(len).ctx("truncate", p)?;
        f.sync_all().ctx("fsync", p)?;
        crate::sys::drop_cache(&f, 0, 0);
    }
    format::sync_parent(&extent_path(dir, 0))?;
    if one_pass {
        // The catalog with the CRCs the copy computed replaces the pending
        // one (same ids and lengths, so the same plan), then the manifest
        // names it.
        let crcs: Vec<u32> = crcs.into_iter().map(|c| c.into_inner()).collect();
        let cpath = dir.join(files::CATALOG);
        let mut scan = catalog.to_scan();
        // Objects copied by an earlier, interrupted run keep the listing's
        // (possibly empty) ETag: their GETs' answers are gone.
        catalog::fill_tags(&mut scan.files, tags);
        catalog::write(&scan, &crcs, &cpath).map_err(|e| catalog_write_error(e, dir))?;
        chmod(&cpath, opts.file_mode)?;
        params = layout_params(&Catalog::open(&cpath)?, opts);
    }
    space::write_manifest(dir, &params, &plan)?;
    chmod(&dir.join(files::MANIFEST), opts.file_mode)?;
    remove_if_exists(&dir.join(files::JOURNAL))?;
    remove_if_exists(&dir.join(PENDING_CATALOG))?;
    remove_if_exists(&dir.join(PENDING_CRCS))?;
    report.copy_time = t0.elapsed();
    Ok(report)
}

struct Watermark {
    /// Every sample id below `next` is copied and synced or about to be.
    next: u64,
    /// Completed ranges (start, end) above `next`.
    done: BTreeSet<(u64, u64)>,
    unsynced_bytes: u64,
    /// A one-pass build: CRCs of ids below this are in `crc.pending`.
    crcs_synced: u64,
}

struct Copier<'a> {
    dir: &'a Path,
    catalog: &'a Catalog,
    plan: &'a Plan,
    params: &'a LayoutParams,
    extents: &'a [PathBuf],
    /// Extents written by completed ranges since the last checkpoint.
    dirty: Mutex<BTreeSet<u32>>,
    opts: &'a PreloadOptions,
    progress: Progress,
    copied_samples: AtomicU64,
    copied_bytes: AtomicU64,
    started: Instant,
    state: Mutex<Watermark>,
    /// A one-pass build: each copied sample's CRC32C goes here (there is
    /// none in the catalog yet to check it against).
    crcs: Option<&'a [AtomicU32]>,
    /// A one-pass build: the ETags the GETs saw, for objects the listing
    /// gave none (as the catalog's checksum pass records them).
    tags: &'a [std::sync::OnceLock<String>],
}

impl Copier<'_> {
    fn copy_range(&self, range: std::ops::Range<u64>) -> Result<()> {
        let mut reader = SpanReader::new(&self.catalog.source_spec());
        let mut bytes = 0u64;
        let mut open: Option<(u32, File)> = None;
        let mut touched: Vec<u32> = Vec::new();
        for id in range.clone() {
            let Some(loc) = self.plan.location(id) else {
                continue;
            };
            let s = self.catalog.sample(id);
            let ext_path = &self.extents[loc.extent as usize];
            if open.as_ref().is_none_or(|(e, _)| *e != loc.extent) {
                let f = OpenOptions::new()
                    .write(true)
                    .open(ext_path)
                    .ctx("open", ext_path)?;
                open = Some((loc.extent, f));
                if !touched.contains(&loc.extent) {
                    touched.push(loc.extent);
                }
            }
            let ext = &open.as_ref().expect("just opened").1;
            let src = self.catalog.file(s.file);
            let mut pos = 0u64;
            let mut crc = 0u32;
            let tag = reader
                .read(
                    s.file,
                    src.name,
                    src.etag,
                    s.offset,
                    s.len as u64,
                    |piece| {
                        crc = crc32c::crc32c_append(crc, piece);
                        ext.write_all_at(piece, loc.offset + pos)
                            .ctx("write", ext_path)?;
                        pos += piece.len() as u64;
                        Ok(())
                    },
                )
                .map_err(|e| self.source_error(s.file, e))?;
            if let Some(crcs) = self.crcs {
                crcs[id as usize].store(crc, Ordering::Relaxed);
                if src.etag.is_empty() && !tag.is_empty() {
                    let _ = self.tags[s.file as usize].set(tag);
                }
            } else if crc != s.crc32c {
                return Err(Error::SourceChanged {
                    changes: vec![SourceChange {
                        path: self.catalog.file_path(s.file),
                        what: format!(
                            "content of sample {id} changed (crc32c {crc:#010x}, catalog says {:#010x})",
                            s.crc32c
                        ),
                    }],
                });
            }
            bytes += s.len as u64;
            self.copied_samples.fetch_add(1, Ordering::Relaxed);
            self.progress.add_item(s.len as u64);
            let total = self.copied_bytes.fetch_add(s.len as u64, Ordering::Relaxed) + s.len as u64;
            self.throttle(total);
        }
        drop(open);
        let mut st = self.state.lock().expect("not poisoned");
        self.dirty.lock().expect("not poisoned").extend(touched);
        st.done.insert((range.start, range.end));
        st.unsynced_bytes += bytes;
        while let Some(&(a, b)) = st.done.first() {
            if a != st.next {
                break;
            }
            st.done.pop_first();
            st.next = b;
        }
        let due = st.unsynced_bytes >= self.opts.checkpoint_bytes;
        drop(st);
        if due {
            self.checkpoint(false)?;
        }
        Ok(())
    }

    /// A vanished source file is a change of the source, not a plain I/O error.
    fn source_error(&self, file: u32, e: Error) -> Error {
        match e {
            Error::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound => {
                Error::SourceChanged {
                    changes: vec![SourceChange {
                        path: self.catalog.file_path(file),
                        what: "vanished during preload".into(),
                    }],
                }
            }
            e => e,
        }
    }

    fn throttle(&self, total_bytes: u64) {
        if let Some(rate) = self.opts.max_bytes_per_sec.filter(|&r| r > 0) {
            let due = Duration::from_secs_f64(total_bytes as f64 / rate as f64);
            let elapsed = self.started.elapsed();
            if due > elapsed {
                std::thread::sleep(due - elapsed);
            }
        }
    }

    /// Syncs the extents and records the watermark in the journal. Holding
    /// the state lock across the sync keeps journal writes ordered.
    fn checkpoint(&self, force: bool) -> Result<()> {
        let mut st = self.state.lock().expect("not poisoned");
        if !force && st.unsynced_bytes < self.opts.checkpoint_bytes {
            return Ok(());
        }
        let watermark = st.next;
        let dirty = std::mem::take(&mut *self.dirty.lock().expect("not poisoned"));
        for i in dirty {
            // fsync through a new descriptor syncs the file's dirty pages
            // written through any descriptor.
            let p = &self.extents[i as usize];
            let f = OpenOptions::new().write(true).open(p).ctx("open", p)?;
            f.sync_data().ctx("fsync", p)?;
            crate::sys::drop_cache(&f, 0, 0);
        }
        if let Some(crcs) = self.crcs {
            // The CRCs of what the journal will say is copied, first.
            save_crcs(self.dir, &crcs[..watermark as usize], st.crcs_synced)?;
            st.crcs_synced = watermark;
        }
        write_journal(self.dir, self.params, watermark)?;
        st.unsynced_bytes = 0;
        Ok(())
    }
}

/// Removes a space: manifest first (so it stops being a space at once), then
/// the journal, extents, catalog and lock file, and the directory if empty.
pub fn unload(dir: &Path) -> Result<()> {
    let known = [
        files::MANIFEST,
        files::CATALOG,
        PENDING_CATALOG,
        files::JOURNAL,
        files::EXTENTS,
    ];
    if !known.iter().any(|f| dir.join(f).exists()) {
        return Err(Error::NotASpace {
            path: dir.to_path_buf(),
            reason: "it holds no kspeed files; nothing removed".into(),
        });
    }
    let lock = SpaceLock::acquire(dir)?;
    clear_layout(dir)?;
    remove_if_exists(&dir.join(files::CATALOG))?;
    remove_if_exists(&dir.join(PENDING_CATALOG))?;
    remove_if_exists(&dir.join(PENDING_CRCS))?;
    remove_if_exists(&dir.join("catalog.ksc.tmp"))?;
    remove_if_exists(&dir.join("manifest.ksm.tmp"))?;
    remove_if_exists(&dir.join("preload.journal.tmp"))?;
    drop(lock);
    remove_if_exists(&dir.join(files::LOCK))?;
    match fs::remove_dir(dir) {
        Ok(()) => {}
        Err(_) => log::warn!("{}: left in place, it holds other files", dir.display()),
    }
    Ok(())
}
