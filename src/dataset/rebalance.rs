//! Rebalance: change a space's placement (another node count, or the scaled
//! owner function to jump) by copying only the samples this node holds
//! under the new placement and did not hold under the old one.
//!
//! A kept sample stays where it is: the new layout is the old extents plus
//! new extents (numbered after the old ones) holding the arriving samples,
//! and its manifest lists every held sample's place. So a node's work is
//! the bytes that move to it, not its whole share.
//!
//! Two phases, each safe to kill and rerun:
//!
//! 1. **Stage** (beside a running `kspeed serve`, which keeps serving the
//!    old layout: staging holds the space's lock shared and its own
//!    `.rebalance.lock`): arriving samples are fetched ([`Fetch`]: the
//!    peers' node services over the protocol, or the source), checked
//!    against the catalog's CRC32C and written to the new extents; a
//!    journal (`rebalance.journal`) records a watermark of ids whose bytes
//!    are synced, so a rerun after SIGKILL resumes there. The new manifest
//!    is written last, as `rebalance.ksm`.
//! 2. **Commit** (the node service stopped: the space's lock exclusive):
//!    `rebalance.ksm` is renamed over `manifest.ksm` (atomic), then the
//!    blocks of the samples the node no longer holds are punched out of the
//!    old extents (their lengths, and every kept sample's offset, stay).
//!    Punching is computed from the manifest alone (every range of an
//!    extent no held sample covers), so a commit killed half-way finishes
//!    on rerun.
//!
//! The nodes are coordinated by whoever runs the commands (docs/DEPLOY.md,
//! "Resizing a cluster"): every node stages, while the old services keep
//! serving the running job and each other's fetches; only when every node
//! has staged are the services stopped, every node committed and the
//! services started over the new node count. Committing one node earlier
//! would punch out samples another node may still need to fetch from it.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::catalog::{Catalog, SpanReader};
use super::owner::{OwnerFn, Placement};
use super::preload::{dir_mode, remove_if_exists, SpaceLock};
use super::space::{self, extent_path, files, LayoutParams, Plan, Space, NOT_HERE};
use crate::error::{Error, IoContext, Result};
use crate::format::{self, FileWriter};
use crate::progress::{Progress, ProgressMode};

const JOURNAL_MAGIC: [u8; 8] = *b"KSPDRBJ\0";
const JOURNAL_VERSION: u32 = 1;
/// Journal field offsets after the layout parameters (0..56).
const J_WATERMARK: usize = 56;
const J_OWNER_FN: usize = 64;
const J_BASE_EXTENTS: usize = 72;
const J_OLD_CREATED: usize = 80;
/// The manifest's `created_ns` field (ties a journal to the old layout).
const M_CREATED: usize = 80;

/// Most samples and bytes asked of a [`Fetch`] at once.
const BATCH_SAMPLES: usize = 256;
const BATCH_BYTES: u64 = 16 << 20;

/// Where the samples arriving at a node come from.
pub trait Fetch {
    /// Delivers every sample of `want` (ids ascending, with the catalog's
    /// lengths) through `put(id, bytes)`, each once, in any order; or fails
    /// naming the first one none of its places could deliver
    /// ([`Error::SampleUnavailable`]). The bytes are checked by the caller.
    fn fetch(
        &mut self,
        want: &[(u64, u32)],
        put: &mut dyn FnMut(u64, &[u8]) -> Result<()>,
    ) -> Result<()>;

    /// What the fetch read from, for the report: (peers' samples, peers'
    /// bytes, source samples, source bytes).
    fn counts(&self) -> (u64, u64, u64, u64) {
        (0, 0, 0, 0)
    }
}

/// Reads arriving samples from the catalog's source (the dataset's files).
pub struct SourceFetch {
    reader: SpanReader,
    catalog: Catalog,
    buf: Vec<u8>,
    samples: u64,
    bytes: u64,
}

impl SourceFetch {
    /// Reads from `catalog`'s source.
    pub fn new(catalog: &Catalog) -> Result<SourceFetch> {
        Ok(SourceFetch {
            reader: SpanReader::new(&catalog.source_spec()),
            catalog: Catalog::open(catalog.path())?,
            buf: Vec::new(),
            samples: 0,
            bytes: 0,
        })
    }

    /// One sample into `out` (replaced).
    pub fn read(&mut self, id: u64, out: &mut Vec<u8>) -> Result<()> {
        let s = self.catalog.sample(id);
        let f = self.catalog.file(s.file);
        out.clear();
        self.reader
            .read(s.file, f.name, f.etag, s.offset, s.len as u64, |piece| {
                out.extend_from_slice(piece);
                Ok(())
            })
            .map_err(|e| Error::SampleUnavailable {
                sample: id,
                tried: format!(
                    "the source ({}): {e}",
                    self.catalog.file_path(s.file).display()
                ),
            })?;
        self.samples += 1;
        self.bytes += s.len as u64;
        Ok(())
    }
}

impl Fetch for SourceFetch {
    fn fetch(
        &mut self,
        want: &[(u64, u32)],
        put: &mut dyn FnMut(u64, &[u8]) -> Result<()>,
    ) -> Result<()> {
        let mut buf = std::mem::take(&mut self.buf);
        for &(id, _) in want {
            self.read(id, &mut buf)?;
            put(id, &buf)?;
        }
        self.buf = buf;
        Ok(())
    }

    fn counts(&self) -> (u64, u64, u64, u64) {
        (0, 0, self.samples, self.bytes)
    }
}

/// What to rebalance to.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct RebalanceOptions {
    /// The new placement (node count, copies, owner function).
    pub placement: Placement,
    /// This node's index (the same as before: nodes keep their indices; a
    /// growing cluster's new nodes take the next ones).
    pub node_index: u32,
    /// Commit after staging (the node service must be stopped, and every
    /// other node must have staged: see the module docs).
    pub commit: bool,
    /// Sync and record progress after this many copied bytes.
    pub checkpoint_bytes: u64,
    /// Progress display.
    pub progress: ProgressMode,
    /// Permissions of the files written (as preload's `file_mode`).
    pub file_mode: u32,
}

impl RebalanceOptions {
    /// Rebalance to `placement` as node `node_index`, staging only.
    pub fn new(placement: Placement, node_index: u32) -> Self {
        RebalanceOptions {
            placement,
            node_index,
            commit: false,
            checkpoint_bytes: 64 << 20,
            progress: ProgressMode::Quiet,
            file_mode: 0o600,
        }
    }
}

setters!(RebalanceOptions {
    commit: bool,
    checkpoint_bytes: u64,
    progress: ProgressMode,
    file_mode: u32,
});

/// What [`rebalance`] found and did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RebalanceReport {
    /// The space already has the new layout (committed): nothing copied.
    pub up_to_date: bool,
    /// A staged layout was found complete: nothing copied.
    pub already_staged: bool,
    /// The new layout is staged (complete, `rebalance.ksm`).
    pub staged: bool,
    /// The new layout is in use (`manifest.ksm`).
    pub committed: bool,
    /// Samples below this id had been staged by an interrupted run.
    pub resumed_at: Option<u64>,
    /// Samples this node keeps in place, and their bytes.
    pub kept_samples: u64,
    /// Bytes of the kept samples.
    pub kept_bytes: u64,
    /// Samples arriving at this node (the whole plan), and their bytes.
    pub arriving_samples: u64,
    /// Bytes of the arriving samples.
    pub arriving_bytes: u64,
    /// Samples copied by this run (less than arriving after a resume).
    pub copied_samples: u64,
    /// Bytes copied by this run.
    pub copied_bytes: u64,
    /// Samples this node no longer holds, and their bytes.
    pub dropped_samples: u64,
    /// Bytes of the dropped samples.
    pub dropped_bytes: u64,
    /// Bytes punched out of the extents at commit: every range no held
    /// sample covers, including those an earlier resize already punched.
    pub reclaimed_bytes: u64,
    /// Copied from peers (samples, bytes) and from the source.
    pub from_peers: (u64, u64),
    /// Copied from the source (samples, bytes).
    pub from_source: (u64, u64),
    /// Time spent staging.
    pub stage_time: Duration,
}

/// Holds `.rebalance.lock` exclusively (one rebalance of a space at a time).
fn rebalance_lock(dir: &Path) -> Result<File> {
    let p = dir.join(files::REBALANCE_LOCK);
    let f = {
        use std::os::unix::fs::OpenOptionsExt;
        OpenOptions::new()
            .create(true)
            .truncate(false)
            .read(true)
            .write(true)
            .mode(0o600)
            .open(&p)
            .ctx("create", &p)?
    };
    match f.try_lock() {
        Ok(()) => Ok(f),
        Err(std::fs::TryLockError::WouldBlock) => Err(Error::SpaceLocked {
            path: dir.to_path_buf(),
            holders: Vec::new(),
        }),
        Err(std::fs::TryLockError::Error(e)) => Err(Error::io("lock", &p, e)),
    }
}

/// The old layout: a space's current manifest, or none (a node new to the
/// cluster, which holds only the catalog).
struct Old {
    space: Option<Space>,
    created_ns: u64,
}

impl Old {
    fn extents(&self) -> u32 {
        self.space
            .as_ref()
            .map_or(0, |s| s.extent_lens().len() as u32)
    }

    fn location(&self, id: u64) -> Option<space::Location> {
        self.space.as_ref().and_then(|s| s.location(id))
    }
}

fn manifest_created_ns(dir: &Path) -> Result<u64> {
    let p = dir.join(files::MANIFEST);
    let bytes = format::read_small(&p)?;
    let parsed = format::parse_versions(
        &p,
        "manifest",
        &space::MANIFEST_MAGIC,
        1..=space::MANIFEST_VERSION,
        &bytes,
    )?;
    Ok(parsed.fields.u64(M_CREATED))
}

/// The new layout: kept samples where they are, arriving ones in new
/// extents numbered from `base` on, in id order, aligned as preload does.
fn plan(catalog: &Catalog, params: &LayoutParams, old: &Old) -> Plan {
    let align = params.align_bytes as u64;
    let base = old.extents();
    let mut locs = Vec::with_capacity(catalog.len() as usize * 12);
    let mut extent_lens: Vec<u64> = old
        .space
        .as_ref()
        .map_or_else(Vec::new, |s| s.extent_lens().to_vec());
    let (mut held_samples, mut held_bytes) = (0u64, 0u64);
    for id in 0..catalog.len() {
        if !params.placement.holds(params.node_index, id) {
            locs.extend_from_slice(&NOT_HERE.to_le_bytes());
            locs.extend_from_slice(&0u64.to_le_bytes());
            continue;
        }
        let len = catalog.sample(id).len as u64;
        let (extent, offset) = match old.location(id) {
            Some(l) => (l.extent, l.offset),
            None => {
                let padded = len.next_multiple_of(align);
                let cur = (extent_lens.len() as u32 > base).then(|| extent_lens.last().copied());
                let (extent, offset) = match cur.flatten() {
                    Some(end) if end == 0 || end + padded <= params.extent_bytes => {
                        (extent_lens.len() as u32 - 1, end)
                    }
                    _ => {
                        extent_lens.push(0);
                        (extent_lens.len() as u32 - 1, 0)
                    }
                };
                extent_lens[extent as usize] = offset + padded;
                (extent, offset)
            }
        };
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

struct Journal {
    params: LayoutParams,
    watermark: u64,
    base: u32,
    old_created_ns: u64,
}

fn read_journal(dir: &Path) -> Result<Option<Journal>> {
    let p = dir.join(files::REBALANCE_JOURNAL);
    if !p.exists() {
        return Ok(None);
    }
    let bytes = format::read_small(&p)?;
    let f = format::parse(&p, "journal", &JOURNAL_MAGIC, JOURNAL_VERSION, &bytes)?.fields;
    let owner_fn = u32::try_from(f.u64(J_OWNER_FN))
        .ok()
        .and_then(OwnerFn::from_code);
    let params = owner_fn.and_then(|o| LayoutParams::from_fields(f, o));
    let (Some(params), Ok(base)) = (params, u32::try_from(f.u64(J_BASE_EXTENTS))) else {
        return Err(Error::Corrupt {
            path: p,
            kind: "journal",
            detail: "layout parameters out of range".into(),
        });
    };
    Ok(Some(Journal {
        params,
        watermark: f.u64(J_WATERMARK),
        base,
        old_created_ns: f.u64(J_OLD_CREATED),
    }))
}

fn write_journal(dir: &Path, j: &Journal) -> Result<()> {
    debug_assert_eq!(J_OWNER_FN, J_WATERMARK + 8);
    debug_assert_eq!(J_OLD_CREATED, J_BASE_EXTENTS + 8);
    let fields = j
        .params
        .to_fields()
        .u64(j.watermark)
        .u64(j.params.placement.owner_fn.code() as u64)
        .u64(j.base as u64)
        .u64(j.old_created_ns);
    FileWriter::create(
        &dir.join(files::REBALANCE_JOURNAL),
        JOURNAL_MAGIC,
        JOURNAL_VERSION,
        fields,
    )?
    .commit()
}

/// Rebalances the space at `dir` as `opts` says, fetching arriving samples
/// through `fetch`: stages the new layout (resuming an interrupted
/// staging), and with [`RebalanceOptions::commit`] puts it in use and
/// gives back the dropped samples' blocks. Rerunning after it finished
/// copies nothing.
pub fn rebalance(
    dir: &Path,
    opts: &RebalanceOptions,
    fetch: &mut dyn Fetch,
) -> Result<RebalanceReport> {
    let mut report = RebalanceReport::default();
    {
        let _one = rebalance_lock(dir)?;
        // Shared: a running serve keeps serving the old layout, while
        // preload, repair and unload (exclusive) cannot change it under us.
        let _shared = SpaceLock::shared(dir)?;
        stage(dir, opts, fetch, &mut report)?;
    }
    if opts.commit {
        commit(dir, &mut report)?;
    }
    Ok(report)
}

fn target_params(catalog: &Catalog, old: &Old, opts: &RebalanceOptions) -> Result<LayoutParams> {
    if let Some(s) = old.space.as_ref().filter(|s| s.params().is_partial()) {
        return Err(Error::InvalidConfig(format!(
            "{} is a partial space (--max-bytes {}): rebalancing one is not built yet; preload it again with the new --nodes",
            s.dir().display(),
            s.params().max_held_bytes
        )));
    }
    let (align_bytes, extent_bytes) = old.space.as_ref().map_or(
        (space::DEFAULT_ALIGN_BYTES, space::DEFAULT_EXTENT_BYTES),
        |s| (s.params().align_bytes, s.params().extent_bytes),
    );
    let p = LayoutParams {
        catalog_identity: catalog.identity(),
        catalog_samples: catalog.len(),
        placement: opts.placement,
        node_index: opts.node_index,
        align_bytes,
        extent_bytes,
        max_held_bytes: 0,
    };
    if opts.node_index >= opts.placement.nodes {
        return Err(Error::InvalidConfig(format!(
            "node {} leaves the cluster at {} nodes: the others fetch its samples from its node service while they stage; unload its space after they have committed",
            opts.node_index, opts.placement.nodes
        )));
    }
    p.validate()?;
    if let Some(o) = old.space.as_ref().map(|s| s.params()) {
        if o.node_index != opts.node_index {
            return Err(Error::InvalidConfig(format!(
                "this space is node {} of the old layout; a node keeps its index (asked for {})",
                o.node_index, opts.node_index
            )));
        }
    }
    Ok(p)
}

fn stage(
    dir: &Path,
    opts: &RebalanceOptions,
    fetch: &mut dyn Fetch,
    report: &mut RebalanceReport,
) -> Result<()> {
    let cpath = dir.join(files::CATALOG);
    if !cpath.exists() {
        return Err(Error::NotASpace {
            path: dir.to_path_buf(),
            reason: "no catalog.ksc: a node new to the cluster needs the cluster's catalog (kspeed rebalance --catalog FILE)".into(),
        });
    }
    let catalog = Catalog::open(&cpath)?;
    let old = if dir.join(files::MANIFEST).exists() {
        Old {
            space: Some(Space::open(dir)?),
            created_ns: manifest_created_ns(dir)?,
        }
    } else {
        if dir.join(files::JOURNAL).exists() {
            return Err(Error::NotASpace {
                path: dir.to_path_buf(),
                reason: "a preload was started but has not finished; finish it (kspeed preload) before rebalancing".into(),
            });
        }
        Old {
            space: None,
            created_ns: 0,
        }
    };
    let params = target_params(&catalog, &old, opts)?;
    if let Some(s) = &old.space {
        if *s.params() == params {
            report.up_to_date = true;
            report.committed = true;
            report.kept_samples = s.held_samples();
            report.kept_bytes = s.held_bytes();
            // With --commit, a commit killed while punching finishes then.
            return Ok(());
        }
    }
    let plan = plan(&catalog, &params, &old);
    let base = old.extents();
    for id in 0..catalog.len() {
        let len = catalog.sample(id).len as u64;
        let (had, has) = (old.location(id).is_some(), plan.location(id).is_some());
        match (had, has) {
            (true, true) => {
                report.kept_samples += 1;
                report.kept_bytes += len;
            }
            (false, true) => {
                report.arriving_samples += 1;
                report.arriving_bytes += len;
            }
            (true, false) => {
                report.dropped_samples += 1;
                report.dropped_bytes += len;
            }
            (false, false) => {}
        }
    }
    // A staged layout of these parameters over this old layout: done.
    if dir.join(files::STAGED).exists() {
        match Space::open_manifest(dir, files::STAGED) {
            Ok(s)
                if *s.params() == params
                    && s.extent_lens() == &plan.extent_lens[..]
                    && (0..catalog.len()).all(|id| s.location(id) == plan.location(id)) =>
            {
                report.already_staged = true;
                report.staged = true;
                return Ok(());
            }
            Ok(_) | Err(_) => {
                log::warn!(
                    "{}: a staged rebalance of another layout is replaced",
                    dir.display()
                );
                remove_if_exists(&dir.join(files::STAGED))?;
            }
        }
    }
    let start = match read_journal(dir) {
        Ok(Some(j))
            if j.params == params
                && j.base == base
                && j.old_created_ns == old.created_ns
                && j.watermark <= catalog.len() =>
        {
            j.watermark
        }
        Ok(Some(_)) => {
            log::warn!(
                "{}: rebalance journal is for another layout, starting over",
                dir.display()
            );
            0
        }
        Ok(None) => 0,
        Err(e) => {
            log::warn!(
                "{}: rebalance journal unusable ({e}), starting over",
                dir.display()
            );
            0
        }
    };
    if start > 0 {
        report.resumed_at = Some(start);
    }
    let t0 = Instant::now();
    let ext_dir = dir.join(files::EXTENTS);
    if !ext_dir.exists() {
        std::fs::create_dir(&ext_dir).ctx("create", &ext_dir)?;
        std::fs::set_permissions(
            &ext_dir,
            std::os::unix::fs::PermissionsExt::from_mode(dir_mode(opts.file_mode)),
        )
        .ctx("chmod", &ext_dir)?;
    }
    let new_extents: Vec<PathBuf> = (base..plan.extent_lens.len() as u32)
        .map(|i| extent_path(dir, i))
        .collect();
    let mut files_ = Vec::with_capacity(new_extents.len());
    let mut existing = 0u64;
    for (k, p) in new_extents.iter().enumerate() {
        use std::os::unix::fs::OpenOptionsExt;
        let f = OpenOptions::new()
            .create(true)
            .truncate(start == 0)
            .read(true)
            .write(true)
            .mode(opts.file_mode)
            .open(p)
            .ctx("create", p)?;
        existing += f
            .metadata()
            .ctx("stat", p)?
            .len()
            .min(plan.extent_lens[base as usize + k]);
        files_.push(f);
    }
    let needed = plan.extent_lens[base as usize..]
        .iter()
        .sum::<u64>()
        .saturating_sub(existing);
    let available = crate::sys::free_bytes(dir).ctx("statvfs", dir)?;
    if needed > available {
        return Err(Error::DiskFull {
            path: dir.to_path_buf(),
            needed,
            available,
        });
    }
    let to_copy: u64 = (start..catalog.len())
        .filter(|&id| plan.location(id).is_some() && old.location(id).is_none())
        .map(|id| catalog.sample(id).len as u64)
        .sum();
    let progress = Progress::new("rebalance", to_copy, opts.progress);
    let mut journal = Journal {
        params,
        watermark: start,
        base,
        old_created_ns: old.created_ns,
    };
    let mut dirty = vec![false; files_.len()];
    let mut unsynced = 0u64;
    let mut want: Vec<(u64, u32)> = Vec::with_capacity(BATCH_SAMPLES);
    let mut got: Vec<bool> = Vec::with_capacity(BATCH_SAMPLES);
    let mut id = start;
    while id < catalog.len() {
        want.clear();
        let mut bytes = 0u64;
        while id < catalog.len() && want.len() < BATCH_SAMPLES && bytes < BATCH_BYTES {
            if plan.location(id).is_some() && old.location(id).is_none() {
                let len = catalog.sample(id).len;
                want.push((id, len));
                bytes += len as u64;
            }
            id += 1;
        }
        got.clear();
        got.resize(want.len(), false);
        fetch.fetch(&want, &mut |sid, data| {
            let k = want.binary_search_by_key(&sid, |w| w.0).map_err(|_| {
                Error::InvalidConfig(format!(
                    "fetch delivered sample {sid}, which was not asked for"
                ))
            })?;
            assert!(!got[k], "sample {sid} delivered twice by the fetch");
            let s = catalog.sample(sid);
            let crc = crc32c::crc32c(data);
            if data.len() != s.len as usize || crc != s.crc32c {
                return Err(Error::SampleCorrupt {
                    sample: sid,
                    path: catalog.file_path(s.file),
                    expected: s.crc32c,
                    computed: crc,
                });
            }
            let loc = plan.location(sid).expect("arriving samples are held");
            let e = (loc.extent - base) as usize;
            files_[e]
                .write_all_at(data, loc.offset)
                .ctx("write", &new_extents[e])?;
            dirty[e] = true;
            got[k] = true;
            progress.add(data.len() as u64);
            Ok(())
        })?;
        if let Some(k) = got.iter().position(|g| !g) {
            return Err(Error::SampleUnavailable {
                sample: want[k].0,
                tried: "the fetch returned without it".into(),
            });
        }
        report.copied_samples += want.len() as u64;
        report.copied_bytes += bytes;
        unsynced += bytes;
        if unsynced >= opts.checkpoint_bytes || id == catalog.len() {
            for (k, d) in dirty.iter_mut().enumerate() {
                if std::mem::take(d) {
                    files_[k].sync_data().ctx("fsync", &new_extents[k])?;
                }
            }
            journal.watermark = id;
            write_journal(dir, &journal)?;
            unsynced = 0;
        }
    }
    progress.finish();
    for (k, f) in files_.iter().enumerate() {
        f.set_len(plan.extent_lens[base as usize + k])
            .ctx("truncate", &new_extents[k])?;
        f.sync_all().ctx("fsync", &new_extents[k])?;
    }
    if let Some(p) = new_extents.first() {
        format::sync_parent(p)?;
    }
    let mut w = space::create_manifest(&dir.join(files::STAGED), &params, &plan)?;
    for len in &plan.extent_lens {
        w.write(&len.to_le_bytes())?;
    }
    w.write(&plan.locs)?;
    w.commit()?;
    remove_if_exists(&dir.join(files::REBALANCE_JOURNAL))?;
    let (ps, pb, ss, sb) = fetch.counts();
    report.from_peers = (ps, pb);
    report.from_source = (ss, sb);
    report.staged = true;
    report.stage_time = t0.elapsed();
    Ok(())
}

/// The layout parameters of a staged, uncommitted rebalance of `dir`, if
/// any (a new node's `--commit` takes its node index from them).
pub fn staged_params(dir: &Path) -> Option<LayoutParams> {
    Space::open_manifest(dir, files::STAGED)
        .ok()
        .map(|s| *s.params())
}

/// Puts a staged layout in use and punches out what the node no longer
/// holds. Needs the space's lock exclusively: the node service stopped.
pub fn commit(dir: &Path, report: &mut RebalanceReport) -> Result<()> {
    let _excl = SpaceLock::exclusive(dir)?;
    let staged = dir.join(files::STAGED);
    if staged.exists() {
        // Checked whole before it replaces the manifest.
        Space::open_manifest(dir, files::STAGED)?.check_extents()?;
        let m = dir.join(files::MANIFEST);
        std::fs::rename(&staged, &m).ctx("rename", &staged)?;
        format::sync_parent(&m)?;
    } else if !report.up_to_date {
        return Err(Error::NotASpace {
            path: dir.to_path_buf(),
            reason: "no staged rebalance to commit (rebalance.ksm)".into(),
        });
    }
    report.committed = true;
    report.reclaimed_bytes = reclaim(&Space::open(dir)?)?;
    Ok(())
}

/// Punches out every aligned range of every extent that no held sample
/// covers; returns the bytes punched. Idempotent: computed from the
/// manifest alone. A file system that cannot punch holes keeps the bytes
/// (logged once).
fn reclaim(space: &Space) -> Result<u64> {
    let align = space.params().align_bytes as u64;
    let mut used: Vec<Vec<(u64, u64)>> = vec![Vec::new(); space.extent_lens().len()];
    for id in 0..space.catalog().len() {
        if let Some(l) = space.location(id) {
            let len = (space.catalog().sample(id).len as u64).next_multiple_of(align);
            used[l.extent as usize].push((l.offset, l.offset + len));
        }
    }
    let mut punched = 0u64;
    for (e, mut ranges) in used.into_iter().enumerate() {
        let ext_len = space.extent_lens()[e];
        ranges.sort_unstable();
        let mut gaps = Vec::new();
        let mut at = 0u64;
        for (a, b) in ranges {
            if a > at {
                gaps.push((at, a));
            }
            at = at.max(b);
        }
        if ext_len > at {
            gaps.push((at, ext_len));
        }
        if gaps.is_empty() {
            continue;
        }
        let p = space.extent_path(e as u32);
        let f = OpenOptions::new().write(true).open(&p).ctx("open", &p)?;
        for (a, b) in gaps {
            match crate::sys::punch_hole(&f, a, b - a) {
                Ok(()) => punched += b - a,
                Err(err) if err.raw_os_error() == Some(libc::EOPNOTSUPP) => {
                    log::warn!(
                        "{}: the file system cannot punch holes; the samples this node no longer holds keep their blocks",
                        p.display()
                    );
                    return Ok(punched);
                }
                Err(err) => return Err(Error::io("punch hole in", &p, err)),
            }
        }
        f.sync_all().ctx("fsync", &p)?;
    }
    Ok(punched)
}
