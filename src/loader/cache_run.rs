//! What a run's pollers ask of the cache area: the decision for a sample
//! that goes to the source (from the rank's own planner, `cache_plan.rs`,
//! or its lane of the node's, `cache_node.rs`), and this run's reads of
//! the area's slots and hits, counted apart from other loaders that share
//! the area.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use super::cache_plan::{Plan, PlanSpec, Planner};
use super::schedule::{Cursor, Placed};
use crate::cache::CachePolicy;
use crate::sampler::NextUse;

/// A loader's cache area and how its runs plan for it.
pub(crate) struct CacheSetup {
    pub area: Arc<crate::cache::CacheArea>,
    pub planning: Planning,
    /// Samples this loader's pollers read from the area (the area's own
    /// count is every loader's that shares it).
    pub hits: Arc<AtomicU64>,
}

/// Who decides what the area keeps.
#[derive(Clone)]
pub(crate) enum Planning {
    /// This loader alone, along its rank's order (a planner per run).
    Own {
        policy: CachePolicy,
        next: Option<NextUse>,
        rank: u64,
        world: u64,
    },
    /// The node agent's planner for the node's ranks, shared by their
    /// loaders (`kspeed agent --cache-scope node`): this loader reads
    /// lane `lane`'s decisions.
    Node {
        plan: Arc<Mutex<super::cache_node::NodePlan>>,
        lane: usize,
    },
}

enum RunPlan {
    // Boxed: a planner is large, and one is made per run, not per sample.
    Own(Box<Mutex<Planner>>),
    Node {
        plan: Arc<Mutex<super::cache_node::NodePlan>>,
        lane: usize,
    },
}

/// The cache area as one run's pollers see it.
pub(crate) struct RunCache {
    pub area: Arc<crate::cache::CacheArea>,
    plan: RunPlan,
    hits: Arc<AtomicU64>,
    /// This run's reads of the area's slots begun and not ended (the
    /// area's own count includes other loaders' that share it).
    open_reads: AtomicU64,
}

impl CacheSetup {
    /// The run starting with `cursor`'s schedule, its planner starting
    /// from what the area holds now; `ring_len`: the most samples the
    /// landing ring holds at once.
    pub(crate) fn run(&self, cursor: Cursor, ring_len: usize) -> RunCache {
        let area = &self.area;
        let plan = match &self.planning {
            Planning::Own {
                policy,
                next,
                rank,
                world,
            } => RunPlan::Own(Box::new(Mutex::new(Planner::new(PlanSpec {
                policy: *policy,
                next: next.clone(),
                rank: *rank,
                world: *world,
                classes: area.classes().clone(),
                held: area.held(),
                cursor,
                ring_len: ring_len.saturating_mul(2),
            })))),
            Planning::Node { plan, lane } => {
                lock(plan).lane_starts(*lane, cursor.position());
                RunPlan::Node {
                    plan: plan.clone(),
                    lane: *lane,
                }
            }
        };
        RunCache {
            area: area.clone(),
            plan,
            hits: self.hits.clone(),
            open_reads: AtomicU64::new(0),
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl RunCache {
    /// The plan for `p`, a sample that goes to the source (module doc).
    pub(crate) fn decide(
        &self,
        p: &Placed,
        len_of: &dyn Fn(u64) -> u64,
        wants: &dyn Fn(&Placed) -> bool,
    ) -> Plan {
        match &self.plan {
            RunPlan::Own(m) => lock(m).decide(p.g, len_of, wants),
            RunPlan::Node { plan, lane } => lock(plan).decide(*lane, p, len_of, wants),
        }
    }

    /// [`CacheArea::begin_read`](crate::cache::CacheArea::begin_read),
    /// counted for this run.
    pub(crate) fn begin_read(&self, slot: u32, id: u64) -> bool {
        let began = self.area.begin_read(slot, id);
        if began {
            self.open_reads.fetch_add(1, Ordering::Relaxed);
        }
        began
    }

    /// [`CacheArea::end_read`](crate::cache::CacheArea::end_read), counted
    /// for this run and its loader.
    pub(crate) fn end_read(&self, slot: u32, len: u64, corrupt: bool) {
        self.area.end_read(slot, len, corrupt);
        self.close_read();
        if !corrupt {
            self.hits.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// [`CacheArea::abandon_read`](crate::cache::CacheArea::abandon_read),
    /// counted for this run.
    pub(crate) fn abandon_read(&self, slot: u32) {
        self.area.abandon_read(slot);
        self.close_read();
    }

    fn close_read(&self) {
        let before = self.open_reads.fetch_sub(1, Ordering::Relaxed);
        assert!(before > 0, "a cache read ended that this run did not begin");
    }

    /// Reads of the area's slots this run began and did not end.
    pub(crate) fn open_reads(&self) -> u64 {
        self.open_reads.load(Ordering::Relaxed)
    }
}
