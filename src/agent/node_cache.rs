//! The node's NVMe cache area as the agent lends it (`kspeed agent
//! --cache-dir DIR --cache-scope node`, the default scope): one area,
//! `DIR/node`, for what the node's ranks read from the source, planned
//! for all of them together (`loader/cache_node.rs`), so a sample one
//! rank fetched is a hit for the next rank of the node that reads it
//! (docs/AGENT.md, "The node's cache area").
//!
//! As the node tier, it is shared by the ranks of one job and one user at
//! a time: its slots are filled from ranks' rings, memory those ranks can
//! write, and every read from it is checked against the catalog's CRC,
//! which stops rot, not a forger. An area in the agent's memory
//! (`--cache-dir :memory:`) checks instead the copy it keeps, once, in
//! its writer (memory no rank can write), and its reads are not checked
//! again unless the rank asks for `verify_crc32c`. A rank of another user, or of another
//! job while a job's ranks hold it, reads without it; the next user's
//! first rank finds it emptied.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use super::msg::{AttachRequest, FLAG_DROP_LAST, FLAG_SHUFFLE};
use crate::cache::{AreaSpec, CacheArea, CachePolicy};
use crate::dataset::Catalog;
use crate::error::Result;
use crate::loader::cache_node::{NodeCacheLease, NodeJob, NodePlan};
use crate::sampler::Position;

/// The most ranks one node plan walks (each a lane of decisions): the
/// ranks of a node that says it has more read without the area (logged).
const MAX_LANES: u32 = 64;

/// How long a job's end waits for its admitted samples to be written.
const FLUSH_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// The folder under `--cache-dir` the node's area is in.
pub(super) const NODE_AREA: &str = "node";

/// The node's area, whose samples it holds, and the plan of the job whose
/// ranks share it now.
pub(super) struct NodeCache {
    dir: PathBuf,
    /// `DIR/node.uid`: the user whose ranks filled the area, kept across
    /// agent restarts (another user's first rank empties the area); None
    /// for an area in the agent's memory (`--cache-dir :memory:`), which
    /// no restart keeps.
    owner_file: Option<PathBuf>,
    budget_bytes: u64,
    policy: CachePolicy,
    /// None after it could not be opened again (until the next rank's
    /// attach tries again).
    area: Option<Arc<CacheArea>>,
    /// The user whose ranks' reads filled it; None: not known (no owner
    /// file: emptied before a rank uses it).
    uid: Option<u32>,
    /// Ranks given a lane and not ended.
    ranks: usize,
    /// The job whose ranks hold it now (a copy of the plan's), and its plan.
    plan: Option<(NodeJob, Arc<Mutex<NodePlan>>)>,
}

/// Why a rank reads without the node's area (logged by the caller).
#[derive(Debug)]
pub(super) enum NoArea {
    /// Another user's ranks hold it.
    OtherUser(u32, usize),
    /// Another job's ranks hold it: how many, and what differs.
    OtherJob(usize, String),
    /// More node ranks than a plan walks.
    TooManyRanks(u32),
    /// It could not be opened again empty, or the rank's schedule not
    /// planned (the error).
    Broken(String),
}

impl std::fmt::Display for NoArea {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NoArea::OtherUser(uid, n) => write!(
                f,
                "it holds samples read for uid {uid}'s ranks, {n} still attached (ranks of one user share it)"
            ),
            NoArea::OtherJob(n, what) => {
                write!(f, "{n} ranks of another job share it now ({what})")
            }
            NoArea::TooManyRanks(n) => write!(
                f,
                "the rank says its node has {n} ranks; one plan walks at most {MAX_LANES}"
            ),
            NoArea::Broken(e) => write!(f, "it could not be opened or planned ({e})"),
        }
    }
}

impl NodeCache {
    /// Opens (or finds, after a restart) the node's area under `dir`.
    pub(super) fn open(
        dir: &std::path::Path,
        budget_bytes: u64,
        policy: CachePolicy,
        catalog: &Catalog,
    ) -> Result<NodeCache> {
        let in_memory = crate::cache::is_memory_dir(dir);
        let (dir, owner_file) = if in_memory {
            (dir.to_path_buf(), None)
        } else {
            (
                dir.join(NODE_AREA),
                Some(dir.join(format!("{NODE_AREA}.uid"))),
            )
        };
        let area = open_area(&dir, budget_bytes, catalog)?;
        // In memory the area starts empty, so no user is known: the first
        // rank's attach opens it again for its user.
        let uid = owner_file
            .as_ref()
            .and_then(|f| std::fs::read_to_string(f).ok())
            .and_then(|t| t.trim().parse::<u32>().ok());
        log::info!(
            "agent: node cache area {}: {} slots, {} bytes, {} held{}, policy {}, shared by the node's ranks of one job",
            dir.display(),
            area.slots(),
            area.classes().area_bytes(),
            area.held().len(),
            uid.map_or_else(String::new, |u| format!(" for uid {u}")),
            policy.name()
        );
        Ok(NodeCache {
            dir,
            owner_file,
            budget_bytes,
            policy,
            area: Some(Arc::new(area)),
            uid,
            ranks: 0,
            plan: None,
        })
    }

    /// A lane for a rank of `uid` attaching with `req`, if it may share
    /// the area now. The first rank of a job (none holding a lane) plans
    /// it afresh from what the area holds, from its start position.
    pub(super) fn take(
        &mut self,
        uid: u32,
        req: &AttachRequest,
        catalog: &Catalog,
    ) -> std::result::Result<NodeCacheLease, NoArea> {
        let ranks = node_ranks(req);
        if ranks.len() as u32 > MAX_LANES {
            return Err(NoArea::TooManyRanks(ranks.len() as u32));
        }
        if self.uid != Some(uid) || self.area.is_none() {
            if self.ranks > 0 {
                return Err(NoArea::OtherUser(self.uid.unwrap_or(u32::MAX), self.ranks));
            }
            // No loader holds the area now (each is dropped before its
            // rank is counted ended).
            self.plan = None;
            self.area = None;
            match self.reopen(uid, self.uid != Some(uid), catalog) {
                Ok(a) => self.area = Some(Arc::new(a)),
                Err(e) => {
                    self.uid = None;
                    return Err(NoArea::Broken(e.to_string()));
                }
            }
            self.uid = Some(uid);
        }
        let area = self.area.clone().expect("opened above");
        let job = NodeJob {
            samples: catalog.len(),
            seed: req.seed,
            shuffle: req.flags & FLAG_SHUFFLE != 0,
            drop_last: req.flags & FLAG_DROP_LAST != 0,
            shuffle_block: req.shuffle_block,
            world: req.world,
            ranks: ranks.clone(),
            batch_size: req.batch_size,
            job: req.job,
            end_epoch: req.end_epoch,
        };
        match &self.plan {
            Some((held, _)) if self.ranks > 0 && *held != job => {
                return Err(NoArea::OtherJob(self.ranks, held.differs(&job)));
            }
            Some(_) if self.ranks > 0 => {}
            // The job's first rank: planned afresh from what the area
            // holds now (a plan left by an earlier run of the same job
            // is ahead of where a restarted job resumes).
            _ => {
                let start = Position {
                    epoch: req.start_epoch,
                    index: req.start_index,
                };
                let plan = NodePlan::new(job.clone(), area.clone(), self.policy, start)
                    .map_err(|e| NoArea::Broken(e.to_string()))?;
                log::info!(
                    "agent: node cache area planned for node ranks {}-{} of {} from epoch {} step {}",
                    ranks.start,
                    ranks.end - 1,
                    req.world,
                    req.start_epoch,
                    req.start_index
                );
                self.plan = Some((job, Arc::new(Mutex::new(plan))));
            }
        }
        self.ranks += 1;
        Ok(NodeCacheLease {
            area,
            plan: self.plan.as_ref().expect("set above").1.clone(),
            lane: (req.rank - ranks.start) as usize,
        })
    }

    /// Opens the area again: emptied first (the folder removed) when
    /// `empty` (another or an unknown user's samples), then owned by `uid`.
    fn reopen(&self, uid: u32, empty: bool, catalog: &Catalog) -> Result<CacheArea> {
        let Some(owner_file) = &self.owner_file else {
            // In memory: a fresh area is an empty one (and never a folder
            // of that name removed).
            return open_area(&self.dir, self.budget_bytes, catalog);
        };
        if empty {
            match std::fs::remove_dir_all(&self.dir) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(crate::Error::io("remove", &self.dir, e)),
            }
        }
        let area = open_area(&self.dir, self.budget_bytes, catalog)?;
        if empty {
            // Written after the area is empty: a crash in between leaves
            // the old owner named over an empty area, which is harmless.
            crate::format::write_file_atomic(owner_file, format!("{uid}\n").as_bytes())?;
        }
        Ok(area)
    }

    /// A rank given a lane ended (its loader is dropped).
    pub(super) fn give_back(&mut self) {
        self.ranks = self
            .ranks
            .checked_sub(1)
            .expect("a node cache lane given back more often than taken");
        if self.ranks > 0 {
            return;
        }
        let Some(a) = &self.area else { return };
        // Every loader that shared it is gone. A read of a slot left open
        // (a poller that panicked mid-read) would keep that slot from ever
        // being written again, and the writer waits for it before each
        // write to it: the area is opened again from its journal at the
        // next rank's attach, the old one dropped off this loop (its
        // writer finishes its queue first).
        let open_reads = a.readers();
        if open_reads > 0 {
            log::warn!(
                "agent: node cache area {}: {open_reads} slot reads left open by ranks that failed; opened again at the next attach",
                self.dir.display()
            );
            self.plan = None;
            let old = self.area.take();
            let spawned = std::thread::Builder::new()
                .name("kspeed-cache-drop".into())
                .spawn(move || drop(old));
            if let Err(e) = spawned {
                log::warn!("agent: could not start a thread to close the node cache area ({e}); closing it here");
            }
            return;
        }
        // What the job admitted is written before the next job plans from
        // what the area holds (a batch: tens of milliseconds).
        if !a.flush(FLUSH_WAIT) {
            log::warn!(
                "agent: node cache area {}: writes still queued after {FLUSH_WAIT:?}; the next job plans without them",
                self.dir.display()
            );
        }
        let st = a.stats();
        log::info!(
            "agent: node cache area {}: {} hits ({} planned), {} writes, {} skipped, {} corrupt, {} failed writes since the agent started; no rank attached",
            self.dir.display(),
            st.hits,
            st.planned_hits,
            st.writes,
            st.skipped,
            st.corrupt,
            st.write_errors
        );
    }
}

fn open_area(dir: &std::path::Path, bytes: u64, catalog: &Catalog) -> Result<CacheArea> {
    CacheArea::open(&AreaSpec {
        dir,
        catalog,
        cache_bytes: bytes,
        // `kspeed agent --cache-bytes`.
        budget_setting: "--cache-bytes",
    })
}

/// The node's ranks as the rank's ATTACH gives them: `rank - local_rank`
/// and the `local_world - 1` after it (as the node tier takes them); the
/// rank alone when it did not say.
fn node_ranks(req: &AttachRequest) -> std::ops::Range<u32> {
    match req.local {
        Some((local_rank, local_world)) => {
            let first = req.rank - u32::from(local_rank);
            first..first.saturating_add(u32::from(local_world)).min(req.world)
        }
        None => req.rank..req.rank + 1,
    }
}
