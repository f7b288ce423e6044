//! One cache area for a node's ranks (`kspeed agent --cache-scope node`):
//! the node agent's planner, which every rank's loader in the agent asks.
//!
//! A rank's own planner (`cache_plan.rs`) walks that rank's order; with an
//! area per rank, a sample one rank read from the source is a hit only for
//! that rank, and each rank's area holds its own copy of what several
//! read. The node's planner walks every node rank's order together, in the
//! order of the sampler's global steps (step `i` of rank `r` is global
//! step `i·W + r`, `DistributedSampler`'s interleave), and decides for all
//! of them over one area: what one rank fetched from the source is a hit
//! for the next rank of the node that reads it, and the policy's next use
//! counts every node rank's reads (`NextUse` over the node's ranks).
//!
//! Its lanes, one per node rank, are that rank's schedule (the job's
//! sampler and deal, as the rank's loader makes them), walked in lock
//! step: every rank of a job delivers the same steps per epoch. A loader
//! asks for its sample at position `(epoch, index)`; the planner plans
//! every lane up to that position first, and keeps each lane's decisions
//! in a ring of its own, tagged with the position and the sample. A
//! decision not there (a rank a ring behind the fastest, a position
//! before the plan's start, another sample than the lane planned) is a
//! source read: planning and the slots' words may disagree, and every
//! disagreement ends in a source read, never in wrong bytes (area.rs).
//!
//! Planning allocates nothing per sample: the rings are sized once. A rank
//! far ahead (a restore to a later epoch), or one whose run starts inside
//! what was planned, starts the plan again at its position from what the
//! area holds then (that allocates, once per restart).
//!
//! Every lane of the node's ranks is planned, whether its rank attached
//! or not: a node rank that never attaches leaves its planned admits
//! undone, and the hits planned on them for other ranks are source reads.

use std::sync::Arc;

use super::cache_plan::{decode, Plan, PlanCore};
use super::schedule::{Cursor, Deal, Geometry, Placed};
use crate::cache::{CacheArea, CachePolicy};
use crate::error::Result;
use crate::sampler::{ElasticSampler, JobPosition, NextUse, Position, Sampler, SamplerConfig};

/// Decisions kept per lane: how far the fastest of the node's ranks may
/// plan ahead of the slowest before the slowest's are lost (read from the
/// source). 16 K steps is many rings of large samples, and 32 bytes each.
pub(crate) const LANE_DECISIONS: usize = 1 << 14;

/// A node rank's lane of the node's planner, given to its loader in the
/// agent.
#[derive(Clone)]
pub(crate) struct NodeCacheLease {
    pub(crate) area: Arc<CacheArea>,
    pub(crate) plan: Arc<std::sync::Mutex<NodePlan>>,
    pub(crate) lane: usize,
}

/// The job whose node ranks the planner walks: what makes their orders.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct NodeJob {
    /// Samples in the dataset.
    pub(crate) samples: u64,
    pub(crate) seed: u64,
    pub(crate) shuffle: bool,
    pub(crate) drop_last: bool,
    pub(crate) shuffle_block: u64,
    pub(crate) world: u32,
    /// The node's ranks (the lanes, in order).
    pub(crate) ranks: std::ops::Range<u32>,
    pub(crate) batch_size: u32,
    /// Where the job's world resumed inside an epoch (elastic), or None.
    pub(crate) job: Option<JobPosition>,
    pub(crate) end_epoch: Option<u64>,
}

impl NodeJob {
    /// What differs between this job and `other`, for a log line (the
    /// first field that does; empty when none).
    pub(crate) fn differs(&self, other: &NodeJob) -> String {
        let (a, b) = (self, other);
        if a.ranks != b.ranks {
            return format!(
                "its node ranks are {}-{}, the attaching rank's {}-{}: a rank that does not say its local rank and local world size is a node of one",
                a.ranks.start,
                a.ranks.end.saturating_sub(1),
                b.ranks.start,
                b.ranks.end.saturating_sub(1)
            );
        }
        let fields: [(&str, String, String); 9] = [
            (
                "dataset length",
                a.samples.to_string(),
                b.samples.to_string(),
            ),
            ("seed", a.seed.to_string(), b.seed.to_string()),
            ("shuffle", a.shuffle.to_string(), b.shuffle.to_string()),
            (
                "drop_last",
                a.drop_last.to_string(),
                b.drop_last.to_string(),
            ),
            (
                "shuffle block",
                a.shuffle_block.to_string(),
                b.shuffle_block.to_string(),
            ),
            ("world", a.world.to_string(), b.world.to_string()),
            (
                "batch size",
                a.batch_size.to_string(),
                b.batch_size.to_string(),
            ),
            (
                "resume point",
                format!("{:?}", a.job),
                format!("{:?}", b.job),
            ),
            (
                "end epoch",
                format!("{:?}", a.end_epoch),
                format!("{:?}", b.end_epoch),
            ),
        ];
        fields
            .iter()
            .find(|(_, x, y)| x != y)
            .map_or_else(String::new, |(name, x, y)| {
                format!("its {name} is {x}, the attaching rank's {y}")
            })
    }

    /// Rank `rank`'s sampler.
    fn sampler(&self, rank: u32) -> Result<Sampler> {
        Sampler::new(SamplerConfig {
            len: self.samples,
            seed: self.seed,
            shuffle: self.shuffle,
            rank,
            world: self.world,
            drop_last: self.drop_last,
            shuffle_block: self.shuffle_block,
        })
    }

    /// Rank `rank`'s deal, as its loader makes it (`LoaderBuilder`).
    fn deal(&self, rank: u32) -> Result<Deal> {
        let start = self.job.unwrap_or(JobPosition {
            epoch: 0,
            consumed: 0,
        });
        Ok(Deal::new(
            ElasticSampler::over(self.sampler(rank)?, start)?,
            if self.drop_last {
                self.batch_size.max(1) as u64
            } else {
                1
            },
        ))
    }
}

/// One lane's decision for the sample at `pos`: kept with its position
/// and sample so a loader asking for another (a lane behind by a ring, a
/// schedule that differs) is told "source", never another's decision.
#[derive(Clone, Copy)]
struct Entry {
    pos: Position,
    id: u64,
    code: u32,
}

/// No decision: a position no schedule reaches.
const UNSET: Entry = Entry {
    pos: Position {
        epoch: u64::MAX,
        index: u64::MAX,
    },
    id: u64::MAX,
    code: 0,
};

/// The node's planner (module doc).
pub(crate) struct NodePlan {
    job: NodeJob,
    area: Arc<CacheArea>,
    policy: CachePolicy,
    next_use: Option<NextUse>,
    deals: Vec<Deal>,
    core: PlanCore,
    lanes: Vec<Cursor>,
    /// The first position planned (decisions before it are source reads).
    start: Position,
    /// The next position to plan, every lane's.
    next: Position,
    /// Per lane, `LANE_DECISIONS` entries.
    ring: Box<[Entry]>,
    /// Times the plan started again (a rank far ahead, or one before it).
    restarts: u64,
    /// The most steps an epoch has (the ring's keys: consecutive
    /// positions take consecutive entries).
    key_steps: u64,
}

/// Where the lanes' cursors place samples: nowhere that matters (the
/// planner needs ids and positions, not ring offsets).
const NO_RING: Geometry = Geometry {
    ring_bytes: 1 << 40,
    align: 4096,
};

impl NodePlan {
    /// The plan of `job`'s node ranks over `area`, from `start`.
    pub(crate) fn new(
        job: NodeJob,
        area: Arc<CacheArea>,
        policy: CachePolicy,
        start: Position,
    ) -> Result<NodePlan> {
        let deals = job
            .ranks
            .clone()
            .map(|r| job.deal(r))
            .collect::<Result<Vec<_>>>()?;
        // As the rank's loader checks it (its build refuses the same).
        if start.index > deals[0].steps(start.epoch) {
            return Err(crate::Error::BadPosition(format!(
                "step {} is past epoch {}'s {} steps",
                start.index,
                start.epoch,
                deals[0].steps(start.epoch)
            )));
        }
        let next_use = match policy {
            CachePolicy::NextUse | CachePolicy::Min => Some(NextUse::new(
                &job.sampler(job.ranks.start)?,
                Some(job.ranks.clone()),
                job.end_epoch,
            )?),
            CachePolicy::Lru => None,
        };
        let lanes = deals.len();
        let e0 = job.job.map_or(start.epoch, |j| j.epoch.min(start.epoch));
        let key_steps = deals[0].steps(e0).max(deals[0].steps(e0 + 1)).max(1);
        let mut p = NodePlan {
            key_steps,
            core: PlanCore::new(
                policy,
                next_use.clone(),
                (job.ranks.start as u64, job.world as u64),
                area.classes().clone(),
                area.held(),
                start,
            ),
            lanes: deals
                .iter()
                .map(|d| Cursor::with_deal(d.clone(), NO_RING, start))
                .collect(),
            deals,
            job,
            area,
            policy,
            next_use,
            start,
            next: start,
            ring: vec![UNSET; lanes * LANE_DECISIONS].into_boxed_slice(),
            restarts: 0,
        };
        p.next = p.lanes[0].position();
        p.start = p.next;
        Ok(p)
    }

    /// Times it started again at another position.
    #[cfg(test)]
    pub(crate) fn restarts(&self) -> u64 {
        self.restarts
    }

    /// Starts the plan again at `at` from what the area holds now: every
    /// decision made is dropped (a source read if asked for).
    fn restart(&mut self, at: Position) {
        self.core = PlanCore::new(
            self.policy,
            self.next_use.clone(),
            (self.job.ranks.start as u64, self.job.world as u64),
            self.area.classes().clone(),
            self.area.held(),
            at,
        );
        for (lane, deal) in self.lanes.iter_mut().zip(&self.deals) {
            *lane = Cursor::with_deal(deal.clone(), NO_RING, at);
        }
        self.ring.fill(UNSET);
        self.next = self.lanes[0].position();
        self.start = self.next;
        self.restarts += 1;
    }

    /// Lane `lane`'s loader starts a run at `at` (its build, or a restore).
    /// At the plan's start (the job's ranks starting together) nothing
    /// changes; before it, or inside what was planned (a restore: the
    /// job's ranks all go there), the plan starts again at `at`, so the
    /// decisions follow the order the ranks read from now on.
    pub(crate) fn lane_starts(&mut self, lane: usize, at: Position) {
        debug_assert!(lane < self.lanes.len());
        if at < self.start || (at > self.start && at < self.next) {
            self.restart(at);
        }
    }

    /// Whether `to` is more than a quarter of a lane's decisions past the
    /// next position to plan: planning up to it would hold the planner's
    /// lock (every source read of the node waits on it) for thousands of
    /// steps of every lane, and drop most decisions kept anyway.
    fn far_ahead(&self, to: Position) -> bool {
        const FAR_STEPS: u64 = LANE_DECISIONS as u64 / 4;
        let d = &self.deals[0];
        let mut steps = 0u64;
        let mut at = self.next;
        while at.epoch < to.epoch {
            steps += d.steps(at.epoch).saturating_sub(at.index);
            if steps > FAR_STEPS {
                return true;
            }
            at = Position {
                epoch: at.epoch + 1,
                index: 0,
            };
        }
        steps + to.index.saturating_sub(at.index) > FAR_STEPS
    }

    fn slot(&self, lane: usize, pos: Position) -> usize {
        // Consecutive positions take consecutive entries (an epoch has at
        // most `key_steps`), so the last LANE_DECISIONS planned never
        // collide; an older one's entry may be taken (its tag then fails).
        let k = pos
            .epoch
            .wrapping_mul(self.key_steps)
            .wrapping_add(pos.index);
        lane * LANE_DECISIONS + (k % LANE_DECISIONS as u64) as usize
    }

    /// Plans one position: every lane's sample there, lanes in rank order
    /// (their global steps' order).
    fn step(&mut self, len_of: &dyn Fn(u64) -> u64, wants: &dyn Fn(&Placed) -> bool) {
        let first = self.job.ranks.start as u64;
        for lane in 0..self.lanes.len() {
            let p = self.lanes[lane].next_with(len_of);
            debug_assert_eq!(p.pos, self.next, "the node's lanes walk in lock step");
            let code = if wants(&p) {
                self.core.plan(&p, first + lane as u64)
            } else {
                0
            };
            let at = self.slot(lane, p.pos);
            self.ring[at] = Entry {
                pos: p.pos,
                id: p.id,
                code,
            };
        }
        self.next = self.lanes[0].position();
    }

    /// The plan for lane `lane`'s sample `p` (placed by its loader's own
    /// schedule), planning every lane up to its position first. `len_of`
    /// and `wants` are the loader's (the same for every rank of the node).
    pub(crate) fn decide(
        &mut self,
        lane: usize,
        p: &Placed,
        len_of: &dyn Fn(u64) -> u64,
        wants: &dyn Fn(&Placed) -> bool,
    ) -> Plan {
        if lane >= self.lanes.len() || p.pos < self.start {
            return Plan::Source;
        }
        if self.far_ahead(p.pos) {
            self.restart(p.pos);
        }
        while self.next <= p.pos {
            self.step(len_of, wants);
        }
        let e = self.ring[self.slot(lane, p.pos)];
        if e.pos == p.pos && e.id == p.id {
            decode(e.code)
        } else {
            Plan::Source
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::{AreaSpec, Decision};
    use crate::dataset::Catalog;

    /// A catalog of `n` samples of 100 bytes.
    fn catalog(dir: &std::path::Path, n: u64) -> Catalog {
        let src = dir.join("src");
        std::fs::create_dir_all(&src).unwrap();
        for i in 0..n {
            std::fs::write(src.join(format!("{i:05}")), vec![i as u8; 100]).unwrap();
        }
        let spec = crate::dataset::SourceSpec::parse(&format!("dir:{}", src.display())).unwrap();
        crate::dataset::catalog::build(&spec, &dir.join("catalog"), &Default::default()).unwrap()
    }

    fn area(dir: &std::path::Path, cat: &Catalog, bytes: u64) -> Arc<CacheArea> {
        Arc::new(
            CacheArea::open(&AreaSpec {
                dir: &dir.join("area"),
                catalog: cat,
                cache_bytes: bytes,
                budget_setting: "cache_bytes",
            })
            .unwrap(),
        )
    }

    fn job(len: u64, world: u32, ranks: std::ops::Range<u32>, epochs: u64) -> NodeJob {
        NodeJob {
            samples: len,
            seed: 7,
            shuffle: true,
            drop_last: false,
            shuffle_block: 0,
            world,
            ranks,
            batch_size: 4,
            job: None,
            end_epoch: Some(epochs),
        }
    }

    /// Each lane's schedule, as its loader walks it.
    fn schedule(j: &NodeJob, lane: u32, epochs: u64) -> Vec<Placed> {
        let d = j.deal(j.ranks.start + lane).unwrap();
        let mut c = Cursor::with_deal(d.clone(), NO_RING, Position { epoch: 0, index: 0 });
        let n: u64 = (0..epochs).map(|e| d.steps(e)).sum();
        (0..n).map(|_| c.next_with(|_| 100)).collect()
    }

    /// The node's plan is MIN over the node's reads in global step order:
    /// the same decisions as MIN by brute force over that merged order,
    /// whichever lane asks first, and a sample one lane admitted is a hit
    /// for another.
    #[test]
    fn the_node_plan_is_min_over_the_node_s_merged_reads() {
        let dir = tempfile::tempdir().unwrap();
        let cat = catalog(dir.path(), 120);
        let a = area(dir.path(), &cat, 30 * 4096);
        let slots = a.slots() as usize;
        assert!(slots >= 20, "{slots} slots");
        let j = job(120, 4, 0..2, 3);
        let mut plan = NodePlan::new(
            j.clone(),
            a.clone(),
            CachePolicy::Min,
            Position { epoch: 0, index: 0 },
        )
        .unwrap();
        let (s0, s1) = (schedule(&j, 0, 3), schedule(&j, 1, 3));
        assert_eq!(s0.len(), s1.len());
        let len_of = |_| 100;
        let wants = |_: &Placed| true;
        // Lane 1 asks a few steps ahead of lane 0, in turns.
        let mut got = vec![None; 2 * s0.len()];
        let mut i1 = 0;
        for (i, p) in s0.iter().enumerate() {
            while i1 < s1.len() && i1 <= i + 3 {
                got[2 * i1 + 1] = Some(plan.decide(1, &s1[i1], &len_of, &wants));
                i1 += 1;
            }
            got[2 * i] = Some(plan.decide(0, p, &len_of, &wants));
        }
        let merged: Vec<u64> = s0.iter().zip(&s1).flat_map(|(a, b)| [a.id, b.id]).collect();
        let want = crate::loader::cache_plan::tests::brute_min(&merged, slots, &[]);
        let got: Vec<Decision> = got
            .iter()
            .map(|d| match d.expect("every read decided") {
                Plan::Hit(_) => Decision::Hit,
                Plan::Admit(_) => Decision::Admit,
                Plan::Source => Decision::Bypass,
            })
            .collect();
        assert_eq!(got, want);
        // Hits across lanes: a sample admitted on one lane read as a hit
        // on the other.
        let mut by = std::collections::HashMap::new();
        let mut across = 0;
        for (t, d) in got.iter().enumerate() {
            match d {
                Decision::Admit => {
                    by.insert(merged[t], t % 2);
                }
                Decision::Hit if by.get(&merged[t]) != Some(&(t % 2)) => across += 1,
                _ => {}
            }
        }
        assert!(across > 0, "no hit across the node's ranks");
        assert_eq!(plan.restarts(), 0);
    }

    /// A lane more than its ring behind, a position before the start, or
    /// another sample than planned: a source read; a lane far ahead starts
    /// the plan again there.
    #[test]
    fn decisions_not_kept_are_source_reads() {
        let dir = tempfile::tempdir().unwrap();
        let cat = catalog(dir.path(), 64);
        let a = area(dir.path(), &cat, 16 * 4096);
        let j = job(64, 2, 0..2, 1000);
        let start = Position { epoch: 1, index: 0 };
        let mut plan = NodePlan::new(j.clone(), a, CachePolicy::Lru, start).unwrap();
        let s0 = schedule(&j, 0, 1000);
        let s1 = schedule(&j, 1, 2000);
        let (len_of, wants) = (|_| 100, |_: &Placed| true);
        // Before the start.
        assert_eq!(plan.decide(0, &s0[0], &len_of, &wants), Plan::Source);
        // LRU admits every first read.
        let at = |s: &[Placed], e: u64, i: u64| {
            s.iter()
                .find(|p| p.pos == Position { epoch: e, index: i })
                .copied()
                .unwrap()
        };
        assert!(matches!(
            plan.decide(0, &at(&s0, 1, 0), &len_of, &wants),
            Plan::Admit(_)
        ));
        // Another sample at that position (not the lane's schedule).
        let mut other = at(&s1, 1, 0);
        other.id = (other.id + 1) % 64;
        assert_eq!(plan.decide(1, &other, &len_of, &wants), Plan::Source);
        // Lane 0 runs ahead by more than a ring of decisions, a step at a
        // time: lane 1's first ones are gone.
        let ahead = 32 * (LANE_DECISIONS as u64 / 32 + 2);
        for g in 0..ahead {
            let p = at(&s0, 1 + g / 32, g % 32);
            plan.decide(0, &p, &len_of, &wants);
        }
        assert_eq!(plan.restarts(), 0);
        assert_eq!(
            plan.decide(1, &at(&s1, 1, 1), &len_of, &wants),
            Plan::Source
        );
        // A jump far ahead starts again there, and plans on from it.
        let far = at(&s1, 1900, 5);
        assert!(!matches!(
            plan.decide(1, &far, &len_of, &wants),
            Plan::Source
        ));
        assert_eq!(plan.restarts(), 1);
        // A run that starts before the plan's start starts it again.
        plan.lane_starts(0, Position { epoch: 2, index: 0 });
        assert_eq!(plan.restarts(), 2);
        assert!(!matches!(
            plan.decide(0, &at(&s0, 2, 0), &len_of, &wants),
            Plan::Source
        ));
        // Another rank of the job starting at the plan's start: kept.
        plan.lane_starts(1, Position { epoch: 2, index: 0 });
        assert_eq!(plan.restarts(), 2);
        // A run starting inside what was planned (a restore): again.
        plan.decide(0, &at(&s0, 2, 9), &len_of, &wants);
        plan.lane_starts(1, Position { epoch: 2, index: 4 });
        assert_eq!(plan.restarts(), 3);
        // A start past an epoch's steps is refused by name.
        assert!(matches!(
            NodePlan::new(
                j.clone(),
                plan.area.clone(),
                CachePolicy::Lru,
                Position {
                    epoch: 0,
                    index: 33
                }
            ),
            Err(crate::Error::BadPosition(_))
        ));
    }
}
