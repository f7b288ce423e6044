//! The cache area's planner: walks the rank's known order one sample ahead
//! of the pollers that need it and decides, for each sample that goes to
//! the source, whether it is read from a slot of the area (a hit), read
//! from the source and kept in a slot (admitted, evicting what the policy
//! chooses), or read from the source and not kept (bypass).
//!
//! The decisions are a pure function of the order and of what the area
//! held when the run started, so they do not depend on which poller reads
//! what or when. They are kept in a ring indexed by the sample's sequence
//! number; the pollers of one run share the planner behind a mutex, taken
//! once per sample that goes to the source (a GET or a source read, which
//! costs a thousand times the lock). A poller that finds its entry already
//! overwritten (it fell a whole ring behind) reads the source: the
//! planner's state and the area's slot words may disagree, and every
//! disagreement ends in a source read, never in wrong bytes (area.rs).

use std::collections::HashMap;

use super::schedule::{Cursor, Placed};
use crate::cache::{Belady, CachePolicy, Decision, SlotClasses, MAX_SLOTS};
use crate::sampler::NextUse;

/// What a poller does with a sample that goes to the source.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Plan {
    /// Read the source; do not keep it.
    Source,
    /// Read it from this slot (if the slot holds it; else the source).
    Hit(u32),
    /// Read the source, then keep it in this slot.
    Admit(u32),
}

const HIT: u32 = 1 << 31;
const ADMIT: u32 = 1 << 30;

/// LRU over fixed slots, one list per size class: doubly linked lists of
/// slots, most recent first; O(1) per read and nothing allocated after
/// start.
struct SlotLru {
    prev: Vec<u32>,
    next: Vec<u32>,
    /// Per class: (most recent, least recent).
    ends: Vec<(u32, u32)>,
}

const NIL: u32 = u32::MAX;

impl SlotLru {
    fn new(slots: u32, classes: usize) -> Self {
        SlotLru {
            prev: vec![NIL; slots as usize],
            next: vec![NIL; slots as usize],
            ends: vec![(NIL, NIL); classes],
        }
    }

    fn unlink(&mut self, c: usize, s: u32) {
        let (p, n) = (self.prev[s as usize], self.next[s as usize]);
        if p != NIL {
            self.next[p as usize] = n;
        } else {
            self.ends[c].0 = n;
        }
        if n != NIL {
            self.prev[n as usize] = p;
        } else {
            self.ends[c].1 = p;
        }
        self.prev[s as usize] = NIL;
        self.next[s as usize] = NIL;
    }

    fn push_front(&mut self, c: usize, s: u32) {
        let head = self.ends[c].0;
        self.next[s as usize] = head;
        self.prev[s as usize] = NIL;
        if head != NIL {
            self.prev[head as usize] = s;
        } else {
            self.ends[c].1 = s;
        }
        self.ends[c].0 = s;
    }
}

enum Policy {
    /// One MIN per size class, each over its class's slots.
    NextUse {
        mins: Vec<Belady>,
        next: NextUse,
        world: u64,
        /// Replace a held sample only when the write gains a hit
        /// (`Belady::read_weighing_writes` with this horizon); None: MIN's
        /// every replacement.
        weigh_writes: Option<u64>,
    },
    Lru {
        lists: SlotLru,
        id_of: Vec<u64>,
    },
}

/// The decisions themselves, over one order of reads: which slot holds
/// what, which is free, and the policy's state. A rank's planner feeds it
/// that rank's reads; the node's (`cache_node.rs`) its ranks' reads in
/// the order of the sampler's global steps.
pub(crate) struct PlanCore {
    policy: Policy,
    classes: SlotClasses,
    slot_of: HashMap<u64, u32>,
    /// Per class, its free slots.
    free: Vec<Vec<u32>>,
}

/// The planner of one run (module doc).
pub(crate) struct Planner {
    core: PlanCore,
    rank: u64,
    cursor: Cursor,
    /// The next sequence number to plan.
    planned: u64,
    /// Per sequence number mod the ring's length: (g + 1, code).
    ring: Box<[(u64, u32)]>,
}

/// What a run's planner starts from.
pub(crate) struct PlanSpec {
    pub policy: CachePolicy,
    /// The rank's next reads (next-use policy).
    pub next: Option<NextUse>,
    pub rank: u64,
    pub world: u64,
    /// The area's slots.
    pub classes: SlotClasses,
    /// (slot, sample) held at the run's start.
    pub held: Vec<(u32, u64)>,
    /// The run's schedule from its start, as the pollers walk it.
    pub cursor: Cursor,
    /// Decisions kept (at least the most samples the ring holds at once).
    pub ring_len: usize,
}

impl PlanCore {
    /// The policy's state over `classes`, starting from `held` (slot,
    /// sample) ranked by their next reads after rank `rank`'s step at
    /// `t0` (the first read planned).
    pub(crate) fn new(
        policy: CachePolicy,
        next: Option<NextUse>,
        (rank, world): (u64, u64),
        classes: SlotClasses,
        held: Vec<(u32, u64)>,
        t0: crate::sampler::Position,
    ) -> Self {
        let slots = classes.slots();
        assert!(slots < MAX_SLOTS, "too many cache slots");
        let slots = slots as u32;
        let n_classes = classes.classes().len();
        let mut p = PlanCore {
            policy: match (policy, next) {
                (CachePolicy::NextUse | CachePolicy::Min, Some(next)) => Policy::NextUse {
                    // Every slot of a class counts as one unit of its MIN.
                    mins: classes
                        .classes()
                        .iter()
                        .map(|c| Belady::new(c.slots as u64, c.slots as usize))
                        .collect(),
                    world,
                    weigh_writes: (policy == CachePolicy::NextUse).then(|| next.swap_horizon()),
                    next,
                },
                _ => Policy::Lru {
                    lists: SlotLru::new(slots, n_classes),
                    id_of: vec![u64::MAX; slots as usize],
                },
            },
            slot_of: HashMap::with_capacity(slots as usize),
            free: classes
                .classes()
                .iter()
                .map(|c| Vec::with_capacity(c.slots as usize))
                .collect(),
            classes,
        };
        let mut used = vec![false; slots as usize];
        // The time just before the first sample planned: what is held is
        // ranked by its next read from there.
        for (slot, id) in held {
            if slot >= slots || used[slot as usize] || p.slot_of.contains_key(&id) {
                continue;
            }
            let c = p.classes.class_of_slot(slot);
            let kept = match &mut p.policy {
                Policy::NextUse {
                    mins, next, world, ..
                } => {
                    let t = rank_time(next, rank, *world, t0);
                    let n = next.after(id, t.saturating_sub(1));
                    mins[c].insert(id, 1, n)
                }
                Policy::Lru { lists, id_of } => {
                    lists.push_front(c, slot);
                    id_of[slot as usize] = id;
                    true
                }
            };
            if kept {
                used[slot as usize] = true;
                p.slot_of.insert(id, slot);
            }
        }
        for (c, class) in p.classes.classes().iter().enumerate() {
            let range = class.first..class.first + class.slots;
            p.free[c].extend(range.rev().filter(|&s| !used[s as usize]));
        }
        p
    }
}

impl Planner {
    pub(crate) fn new(spec: PlanSpec) -> Self {
        let start = spec.cursor.next_g();
        let core = PlanCore::new(
            spec.policy,
            spec.next,
            (spec.rank, spec.world),
            spec.classes,
            spec.held,
            spec.cursor.position(),
        );
        Planner {
            core,
            rank: spec.rank,
            cursor: spec.cursor,
            planned: start,
            ring: vec![(0, 0); spec.ring_len.max(1)].into_boxed_slice(),
        }
    }

    /// The plan for sample `g`, planning every sample up to it first.
    /// `len_of` gives a sample's length (the schedule's), `wants` whether a
    /// scheduled sample goes to the source from this process's pollers.
    pub(crate) fn decide(
        &mut self,
        g: u64,
        len_of: &dyn Fn(u64) -> u64,
        wants: &dyn Fn(&Placed) -> bool,
    ) -> Plan {
        let n = self.ring.len() as u64;
        while self.planned <= g {
            let p = self.cursor.next_with(len_of);
            debug_assert_eq!(p.g, self.planned, "the planner's cursor and its count");
            let code = if wants(&p) {
                self.core.plan(&p, self.rank)
            } else {
                0
            };
            self.ring[(p.g % n) as usize] = (p.g + 1, code);
            self.planned += 1;
        }
        match self.ring[(g % n) as usize] {
            (tag, code) if tag == g + 1 => decode(code),
            _ => Plan::Source,
        }
    }
}

impl PlanCore {
    /// The decision for `p`, read by rank `rank`, as a code (`decode`).
    pub(crate) fn plan(&mut self, p: &Placed, rank: u64) -> u32 {
        let id = p.id;
        // Larger than every slot (the top 1 % of sizes), or a class the
        // budget gave no slot: not kept.
        let Some(c) = self
            .classes
            .class_for(p.len)
            .filter(|&c| self.classes.classes()[c].slots > 0)
        else {
            return 0;
        };
        match &mut self.policy {
            Policy::NextUse {
                mins,
                next,
                world,
                weigh_writes,
            } => {
                let n = next.after(id, rank_time(next, rank, *world, p.pos));
                let (slot_of, free) = (&mut self.slot_of, &mut self.free[c]);
                let evicted = |gone| {
                    let s = slot_of.remove(&gone).expect("a held sample has a slot");
                    free.push(s);
                };
                let decision = match *weigh_writes {
                    Some(horizon) => mins[c].read_weighing_writes(
                        id,
                        1,
                        n,
                        || next.after(id, n),
                        horizon,
                        evicted,
                    ),
                    None => mins[c].read(id, 1, n, evicted),
                };
                match decision {
                    Decision::Hit => HIT | self.slot_of[&id],
                    Decision::Bypass => 0,
                    Decision::Admit => {
                        let s = self.free[c]
                            .pop()
                            .expect("MIN admits only with a slot free");
                        self.slot_of.insert(id, s);
                        ADMIT | s
                    }
                }
            }
            Policy::Lru { lists, id_of } => {
                if let Some(&s) = self.slot_of.get(&id) {
                    lists.unlink(c, s);
                    lists.push_front(c, s);
                    return HIT | s;
                }
                let s = match self.free[c].pop() {
                    Some(s) => s,
                    None => {
                        let s = lists.ends[c].1;
                        lists.unlink(c, s);
                        self.slot_of.remove(&id_of[s as usize]);
                        s
                    }
                };
                lists.push_front(c, s);
                id_of[s as usize] = id;
                self.slot_of.insert(id, s);
                ADMIT | s
            }
        }
    }
}

/// The time (`NextUse`'s global step) of this rank's step `pos`: ranks
/// interleave, `DistributedSampler`'s way.
fn rank_time(next: &NextUse, rank: u64, world: u64, pos: crate::sampler::Position) -> u64 {
    next.time(pos.epoch, pos.index * world + rank)
}

pub(crate) fn decode(code: u32) -> Plan {
    if code & HIT != 0 {
        Plan::Hit(code & !HIT)
    } else if code & ADMIT != 0 {
        Plan::Admit(code & !ADMIT)
    } else {
        Plan::Source
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::loader::schedule::Geometry;
    use crate::sampler::{Position, Sampler, SamplerConfig, NEVER};

    fn cursor(sampler: &Sampler, steps: u64) -> Cursor {
        let geo = Geometry {
            ring_bytes: 1 << 20,
            align: 4096,
        };
        Cursor::new(sampler.clone(), geo, Position { epoch: 0, index: 0 }, steps)
    }

    /// The planner's decisions over `epochs` of rank `rank` of `world`,
    /// every sample one slot, with `held` at the start.
    fn plans(
        policy: CachePolicy,
        len: u64,
        world: u32,
        rank: u32,
        slots: u32,
        epochs: u64,
        held: Vec<(u32, u64)>,
    ) -> Vec<(u64, Plan)> {
        let cfg = SamplerConfig {
            world,
            rank,
            ..SamplerConfig::single(len, 5)
        };
        let sampler = Sampler::new(cfg).unwrap();
        let steps = sampler.per_rank();
        let next = NextUse::new(&sampler, Some(rank..rank + 1), Some(epochs)).unwrap();
        let mut p = Planner::new(PlanSpec {
            policy,
            next: Some(next),
            rank: rank as u64,
            world: world as u64,
            classes: SlotClasses::uniform(4096, slots),
            held,
            cursor: cursor(&sampler, steps),
            ring_len: 64,
        });
        let mut ids = cursor(&sampler, steps);
        (0..epochs * steps)
            .map(|g| {
                let id = ids.next_with(|_| 100).id;
                (id, p.decide(g, &|_| 100, &|_| true))
            })
            .collect()
    }

    /// MIN with bypass by brute force over the read sequence: on a miss,
    /// keep the sample if something held is read later (evict the
    /// farthest; "never again" is farthest, ties by the larger id).
    pub(in crate::loader) fn brute_min(seq: &[u64], slots: usize, held: &[u64]) -> Vec<Decision> {
        brute(seq, slots, held, None)
    }

    /// `next-use` by brute force: MIN, except that a full cache replaces
    /// its farthest only if that one is never read again, or the new
    /// sample is read twice before it, or more than `epoch` reads before
    /// it (the rule as docs/CACHE.md states it, in reads of this rank).
    fn brute_next_use(
        seq: &[u64],
        slots: usize,
        held: &[u64],
        world: u64,
        horizon: u64,
    ) -> Vec<Decision> {
        brute(seq, slots, held, Some((world, horizon)))
    }

    fn brute(seq: &[u64], slots: usize, held: &[u64], weigh: Option<(u64, u64)>) -> Vec<Decision> {
        let next_of = |id: u64, t: usize| {
            seq[t + 1..]
                .iter()
                .position(|&x| x == id)
                .map_or(NEVER, |k| (t + 1 + k) as u64)
        };
        let mut cache: Vec<u64> = held.to_vec();
        let mut out = Vec::new();
        for (t, &id) in seq.iter().enumerate() {
            if cache.contains(&id) {
                out.push(Decision::Hit);
                continue;
            }
            let n = next_of(id, t);
            if n == NEVER {
                out.push(Decision::Bypass);
                continue;
            }
            if cache.len() < slots {
                cache.push(id);
                out.push(Decision::Admit);
                continue;
            }
            let (k, far) = cache
                .iter()
                .enumerate()
                .map(|(k, &h)| (k, (next_of(h, t), h)))
                .max_by_key(|&(_, key)| key)
                .unwrap();
            let gains = match weigh {
                None => far > (n, id),
                // Times here are this rank's reads, `world` global steps
                // apart.
                Some((world, horizon)) => {
                    far.0 == NEVER
                        || (n < far.0
                            && (next_of(id, n as usize) < far.0 || (far.0 - n) * world > horizon))
                }
            };
            if !gains {
                out.push(Decision::Bypass);
            } else {
                cache[k] = id;
                out.push(Decision::Admit);
            }
        }
        out
    }

    /// Checks that hits name the slot the sample was put in and admits a
    /// slot no one else holds.
    fn check_slots(plans: &[(u64, Plan)], slots: u32, held: &[(u32, u64)]) {
        let mut slot_id: Vec<Option<u64>> = vec![None; slots as usize];
        for &(s, id) in held {
            slot_id[s as usize] = Some(id);
        }
        for &(id, plan) in plans {
            match plan {
                Plan::Hit(s) => assert_eq!(slot_id[s as usize], Some(id), "hit in slot {s}"),
                Plan::Admit(s) => {
                    assert!(!slot_id.contains(&Some(id)), "sample {id} admitted twice");
                    slot_id[s as usize] = Some(id);
                }
                Plan::Source => {}
            }
        }
    }

    fn as_decisions(plans: &[(u64, Plan)]) -> Vec<Decision> {
        plans
            .iter()
            .map(|&(_, p)| match p {
                Plan::Hit(_) => Decision::Hit,
                Plan::Admit(_) => Decision::Admit,
                Plan::Source => Decision::Bypass,
            })
            .collect()
    }

    fn count(d: &[Decision], what: Decision) -> usize {
        d.iter().filter(|&&x| x == what).count()
    }

    #[test]
    fn next_use_plans_are_the_rules_decisions_with_consistent_slots() {
        for (len, world, rank, slots, epochs) in [
            (60u64, 1u32, 0u32, 12u32, 4u64),
            (90, 3, 1, 7, 5),
            (40, 1, 0, 39, 3),
            (200, 2, 0, 30, 6),
        ] {
            let got = plans(
                CachePolicy::NextUse,
                len,
                world,
                rank,
                slots,
                epochs,
                vec![],
            );
            let seq: Vec<u64> = got.iter().map(|&(id, _)| id).collect();
            // An epoch of P global steps, a rank reading P/W of len.
            let p = seq.len() as u64 / epochs * world as u64;
            let horizon = p * (p / world as u64) / len;
            let want = brute_next_use(&seq, slots as usize, &[], world as u64, horizon);
            assert_eq!(as_decisions(&got), want, "{len}/{world}/{slots}");
            check_slots(&got, slots, &[]);
        }
    }

    /// The point of weighing writes: on the same orders, next use keeps
    /// (nearly) MIN's hits with far fewer writes; under a plain reshuffle
    /// exactly MIN's hits, writing only to fill the slots.
    #[test]
    fn next_use_hits_as_min_does_with_fewer_writes() {
        for (len, world, rank, slots, epochs) in [
            (400u64, 1u32, 0u32, 200u32, 4u64),
            (400, 1, 0, 40, 5),
            (300, 3, 2, 30, 8),
            (500, 2, 1, 225, 4),
        ] {
            let run = |p| as_decisions(&plans(p, len, world, rank, slots, epochs, vec![]));
            let (ours, min) = (run(CachePolicy::NextUse), run(CachePolicy::Min));
            let (h, hm) = (count(&ours, Decision::Hit), count(&min, Decision::Hit));
            let (w, wm) = (count(&ours, Decision::Admit), count(&min, Decision::Admit));
            assert!(
                h * 100 >= hm * 95,
                "{len}/{world}/{slots}: hits {h} vs MIN's {hm}"
            );
            assert!(w <= wm, "{len}/{world}/{slots}: writes {w} vs MIN's {wm}");
            if world == 1 {
                // Every sample once an epoch: MIN's hits, one write a slot.
                assert_eq!(h, hm, "{len}/{slots}");
                assert_eq!(w, slots as usize, "{len}/{slots}: writes {w}, MIN {wm}");
                assert!(wm > 2 * w, "{len}/{slots}: MIN wrote only {wm}");
            }
        }
    }

    #[test]
    fn min_plans_are_min_s_decisions_with_consistent_slots() {
        for (len, world, rank, slots, epochs) in [
            (60u64, 1u32, 0u32, 12u32, 4u64),
            (90, 3, 1, 7, 5),
            (40, 1, 0, 39, 3),
        ] {
            let got = plans(CachePolicy::Min, len, world, rank, slots, epochs, vec![]);
            let seq: Vec<u64> = got.iter().map(|&(id, _)| id).collect();
            let want = brute_min(&seq, slots as usize, &[]);
            for (t, (&(id, plan), w)) in got.iter().zip(&want).enumerate() {
                let as_decision = match plan {
                    Plan::Hit(_) => Decision::Hit,
                    Plan::Admit(_) => Decision::Admit,
                    Plan::Source => Decision::Bypass,
                };
                assert_eq!(
                    as_decision, *w,
                    "read {t} (sample {id}), {len}/{world}/{slots}"
                );
            }
            check_slots(&got, slots, &[]);
        }
    }

    #[test]
    fn a_planner_starts_from_what_the_area_held() {
        // Held at start: three samples in slots 4, 1, 7; the plans hit them
        // where MIN starting with them does.
        let held = vec![(4u32, 3u64), (1, 10), (7, 22)];
        for policy in [CachePolicy::Min, CachePolicy::NextUse] {
            let got = plans(policy, 30, 1, 0, 8, 3, held.clone());
            let seq: Vec<u64> = got.iter().map(|&(id, _)| id).collect();
            let want = match policy {
                CachePolicy::Min => brute_min(&seq, 8, &[3, 10, 22]),
                _ => brute_next_use(&seq, 8, &[3, 10, 22], 1, 30),
            };
            assert_eq!(as_decisions(&got), want, "{policy:?}");
            check_slots(&got, 8, &held);
        }
    }

    #[test]
    fn lru_plans_hit_where_the_reference_lru_does() {
        let got = plans(CachePolicy::Lru, 50, 1, 0, 10, 6, vec![]);
        let mut reference = crate::cache::Lru::new(10);
        for (t, &(id, plan)) in got.iter().enumerate() {
            let hit = reference.read(id, 1);
            assert_eq!(matches!(plan, Plan::Hit(_)), hit, "read {t}");
            assert!(!matches!(plan, Plan::Source), "LRU keeps every sample");
        }
        check_slots(&got, 10, &[]);
        // Side by side on the same order: next use's hits are several
        // times LRU's.
        let min_hits = plans(CachePolicy::NextUse, 50, 1, 0, 10, 6, vec![])
            .iter()
            .filter(|(_, p)| matches!(p, Plan::Hit(_)))
            .count();
        let lru_hits = got
            .iter()
            .filter(|(_, p)| matches!(p, Plan::Hit(_)))
            .count();
        assert!(
            min_hits >= 3 * lru_hits.max(1),
            "MIN {min_hits}, LRU {lru_hits}"
        );
    }

    #[test]
    fn a_poller_a_whole_ring_behind_reads_the_source() {
        let sampler = Sampler::new(SamplerConfig::single(100, 1)).unwrap();
        let mut p = Planner::new(PlanSpec {
            policy: CachePolicy::Lru,
            next: None,
            rank: 0,
            world: 1,
            classes: SlotClasses::uniform(4096, 50),
            held: vec![],
            cursor: cursor(&sampler, 100),
            ring_len: 8,
        });
        assert!(matches!(p.decide(20, &|_| 100, &|_| true), Plan::Admit(_)));
        // Sample 3's entry was overwritten by sample 19's (ring of 8).
        assert_eq!(p.decide(3, &|_| 100, &|_| true), Plan::Source);
        // A sample that is not the source's is never planned.
        assert_eq!(p.decide(21, &|_| 100, &|q| q.g != 21), Plan::Source);
    }
}
