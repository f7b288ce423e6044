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
//! which stops rot, not a forger. A rank of another user, or of another
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

/// The folder under `--cache-dir` the node's area is in.
pub(super) const NODE_AREA: &str = "node";

/// The node's area, whose samples it holds, and the plan of the job whose
/// ranks share it now.
pub(super) struct NodeCache {
    dir: PathBuf,
    bytes: u64,
    policy: CachePolicy,
    /// None after it could not be opened again for a new user (until the
    /// next user's first rank tries again).
    area: Option<Arc<CacheArea>>,
    /// The user whose ranks' reads filled it.
    uid: Option<u32>,
    /// Ranks given a lane and not ended.
    ranks: usize,
    plan: Option<Arc<Mutex<NodePlan>>>,
}

/// Why a rank reads without the node's area (logged by the caller).
#[derive(Debug)]
pub(super) enum NoArea {
    /// Another user's ranks hold it.
    OtherUser(u32, usize),
    /// Another job's ranks hold it.
    OtherJob(usize),
    /// More node ranks than a plan walks.
    TooManyRanks(u32),
    /// It could not be opened again empty (the error).
    Broken(String),
}

impl std::fmt::Display for NoArea {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NoArea::OtherUser(uid, n) => write!(
                f,
                "it holds samples read for uid {uid}'s ranks, {n} still attached (ranks of one user share it)"
            ),
            NoArea::OtherJob(n) => write!(
                f,
                "{n} ranks of another job (another seed, world, node ranks, end or resume point) share it now"
            ),
            NoArea::TooManyRanks(n) => write!(
                f,
                "the rank says its node has {n} ranks; one plan walks at most {MAX_LANES}"
            ),
            NoArea::Broken(e) => write!(f, "it could not be opened ({e})"),
        }
    }
}

impl NodeCache {
    /// Opens (or finds, after a restart) the node's area under `dir`.
    pub(super) fn open(
        dir: &std::path::Path,
        bytes: u64,
        policy: CachePolicy,
        catalog: &Catalog,
    ) -> Result<NodeCache> {
        let dir = dir.join(NODE_AREA);
        let area = open_area(&dir, bytes, catalog)?;
        log::info!(
            "agent: node cache area {}: {} slots, {} bytes, {} held, policy {}, shared by the node's ranks of one job",
            dir.display(),
            area.slots(),
            area.classes().area_bytes(),
            area.held().len(),
            policy.name()
        );
        Ok(NodeCache {
            dir,
            bytes,
            policy,
            area: Some(Arc::new(area)),
            uid: None,
            ranks: 0,
            plan: None,
        })
    }

    /// A lane for a rank of `uid` attaching with `req`, if it may share
    /// the area now.
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
            if self.uid.is_some() || self.area.is_none() {
                // Another user's samples: emptied first. No loader holds
                // the area now (each is dropped before its rank ends).
                self.plan = None;
                self.area = None;
                let fresh = std::fs::remove_dir_all(&self.dir)
                    .or_else(|e| match e.kind() {
                        std::io::ErrorKind::NotFound => Ok(()),
                        _ => Err(crate::Error::io("remove", &self.dir, e)),
                    })
                    .and_then(|()| open_area(&self.dir, self.bytes, catalog));
                match fresh {
                    Ok(a) => self.area = Some(Arc::new(a)),
                    Err(e) => {
                        self.uid = None;
                        return Err(NoArea::Broken(e.to_string()));
                    }
                }
            }
            self.uid = Some(uid);
        }
        let area = self.area.clone().expect("opened above");
        let job = NodeJob {
            len: catalog.len(),
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
        let same = self.plan.as_ref().is_some_and(|p| *lock(p).job() == job);
        if !same {
            if self.ranks > 0 {
                return Err(NoArea::OtherJob(self.ranks));
            }
            let start = Position {
                epoch: req.start_epoch,
                index: req.start_index,
            };
            let plan = NodePlan::new(job, area.clone(), self.policy, start)
                .map_err(|e| NoArea::Broken(e.to_string()))?;
            log::info!(
                "agent: node cache area planned for ranks {:?} of {} from epoch {} step {}",
                ranks,
                req.world,
                req.start_epoch,
                req.start_index
            );
            self.plan = Some(Arc::new(Mutex::new(plan)));
        }
        self.ranks += 1;
        Ok(NodeCacheLease {
            area,
            plan: self.plan.clone().expect("set above"),
            lane: (req.rank - ranks.start) as usize,
        })
    }

    /// A rank given a lane ended (its loader is dropped).
    pub(super) fn give_back(&mut self) {
        self.ranks = self
            .ranks
            .checked_sub(1)
            .expect("a node cache lane given back more often than taken");
        if self.ranks == 0 {
            // Every loader that shared it is gone, its pollers stopped:
            // a read of a slot left open would keep that slot from ever
            // being written again.
            if let Some(a) = &self.area {
                assert_eq!(
                    a.readers(),
                    0,
                    "node cache area readers left after its ranks ended"
                );
                let st = a.stats();
                log::info!(
                    "agent: node cache area {}: {} hits ({} planned), {} writes, {} skipped, {} corrupt, {} failed writes so far; no rank attached",
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
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn open_area(dir: &std::path::Path, bytes: u64, catalog: &Catalog) -> Result<CacheArea> {
    CacheArea::open(&AreaSpec {
        dir,
        catalog,
        cache_bytes: bytes,
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
