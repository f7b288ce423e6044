//! The node tier as the agent lends it: one memory tier for the node,
//! shared by the ranks of one user at a time, its members chosen again by
//! a job's reads on this node when the job's first rank attaches
//! (docs/AGENT.md, "The node tier").

use std::sync::Arc;

use super::msg::{AttachRequest, MixAttach, FLAG_DROP_LAST, FLAG_SHUFFLE};
use crate::dataset::Space;
use crate::loader::tier::TierSamples;
use crate::loader::Tier;

/// The samples the node tier may hold: the agent's space, or a mixture's
/// spaces side by side in one id space (space `d`'s sample `i` is id
/// `offsets[d] + i`, as a mixture's loader numbers them).
pub(super) struct NodeSamples<'a> {
    spaces: Vec<&'a Space>,
    offsets: Vec<u64>,
}

impl<'a> NodeSamples<'a> {
    /// The spaces served, in order.
    pub(super) fn new(spaces: impl IntoIterator<Item = &'a Space>) -> Self {
        let spaces: Vec<&Space> = spaces.into_iter().collect();
        let mut offsets = Vec::with_capacity(spaces.len());
        let mut next = 0;
        for sp in &spaces {
            offsets.push(next);
            next += sp.catalog().len();
        }
        NodeSamples { spaces, offsets }
    }

    /// Id `id`'s space and its id there.
    fn part(&self, id: u64) -> (&Space, u64) {
        let d = self.offsets.partition_point(|&o| o <= id) - 1;
        (self.spaces[d], id - self.offsets[d])
    }

    /// Whether this node does not hold sample `id` (in a cluster: another
    /// node pushes it).
    pub(super) fn remote(&self, id: u64) -> bool {
        let (space, local) = self.part(id);
        space.location(local).is_none()
    }

    /// Each space's sample count.
    fn lens(&self) -> Vec<u64> {
        self.spaces.iter().map(|sp| sp.catalog().len()).collect()
    }
}

impl TierSamples for NodeSamples<'_> {
    fn ids(&self) -> u64 {
        self.offsets.last().copied().unwrap_or(0)
            + self.spaces.last().map_or(0, |sp| sp.catalog().len())
    }

    fn len_crc(&self, id: u64) -> (u32, u32) {
        let (space, local) = self.part(id);
        let smp = space.catalog().sample(local);
        (smp.len, smp.crc32c)
    }
}

/// The node tier and whose it is. A member is filled from one rank's ring,
/// memory that rank can write, and copied into other ranks' rings; a CRC
/// does not stop a rank that forges bytes on purpose. So the tier is shared
/// only among ranks of one user (uid), which trust each other; while ranks
/// of one user hold it, a rank of another user reads without it, and when
/// none does, the next user's first rank empties it and takes it over.
pub(super) struct NodeTier {
    pub(super) tier: Arc<Tier>,
    /// The user whose samples it holds.
    pub(super) uid: Option<u32>,
    /// Ranks of that user given the tier and not ended.
    pub(super) ranks: usize,
    /// The job whose reads chose the members; None: chosen at start (by
    /// id, in a cluster the other nodes' samples first).
    pub(super) layout: Option<TierLayout>,
}

/// A job's reads on this node, as its ranks' ATTACH tells them: what the
/// node tier's members are chosen by (`Tier::relayout`), so a node of a
/// cluster, whose ranks read a different share of the dataset each epoch,
/// keeps the samples they read most in the coming epochs.
#[derive(Debug, Clone)]
pub(super) struct TierLayout {
    seed: u64,
    world: u32,
    flags: u32,
    /// The node's ranks: `rank - local_rank` and the `local_world - 1`
    /// after it (torchrun's and SLURM's block layout).
    ranks: std::ops::Range<u32>,
    from: u64,
    end: Option<u64>,
    shuffle_block: u64,
    /// A mixture's counts and where its order starts (version 6).
    mix: Option<MixAttach>,
}

impl TierLayout {
    /// The layout a rank's ATTACH asks for; None when it did not say which
    /// ranks share its node.
    pub(super) fn of(req: &AttachRequest) -> Option<TierLayout> {
        let (local_rank, local_world) = req.local?;
        let first = req.rank - u32::from(local_rank);
        Some(TierLayout {
            seed: req.seed,
            world: req.world,
            // The sampler's flags only: whether a rank checks CRCs or
            // takes tier views does not change what the node reads.
            flags: req.flags & (FLAG_SHUFFLE | FLAG_DROP_LAST),
            ranks: first..first.saturating_add(u32::from(local_world)).min(req.world),
            from: req.start_epoch,
            end: req.end_epoch,
            shuffle_block: req.shuffle_block,
            mix: req.mix.clone(),
        })
    }

    /// Whether `other` is the same job on the same ranks of this node,
    /// whatever epoch it starts at (a restart keeps what its tier holds);
    /// a mixture's with the same weights' counts, wherever its order
    /// resumed (new weights draw other samples: chosen again).
    fn same_job(&self, other: &TierLayout) -> bool {
        (
            self.seed,
            self.world,
            self.flags,
            &self.ranks,
            self.end,
            self.shuffle_block,
            self.mix.as_ref().map(|m| &m.counts),
        ) == (
            other.seed,
            other.world,
            other.flags,
            &other.ranks,
            other.end,
            other.shuffle_block,
            other.mix.as_ref().map(|m| &m.counts),
        )
    }

    /// How often the node's ranks read each sample of datasets of `lens`
    /// (one, or a mixture's side by side) in the coming epochs; None where
    /// every count is the same (the node holds every rank of a job of one
    /// dataset) or the job's schedule cannot be made (its loaders are
    /// refused by name).
    fn reads(&self, lens: &[u64]) -> Option<Vec<u16>> {
        use crate::sampler::{MixSampler, Sampler, SamplerConfig};
        let cfg = SamplerConfig {
            len: lens.iter().sum(),
            seed: self.seed,
            shuffle: self.flags & FLAG_SHUFFLE != 0,
            rank: 0,
            world: self.world,
            drop_last: self.flags & FLAG_DROP_LAST != 0,
            shuffle_block: self.shuffle_block,
        };
        let sampler = match &self.mix {
            None => Sampler::new(cfg).ok()?,
            // As the agent builds the rank's loader (`Weight::Choose` of
            // each count, resumed where the mixed order starts).
            Some(m) => {
                let mix = MixSampler::new(cfg, lens, &m.counts)
                    .ok()?
                    .resume(&m.start())
                    .ok()?;
                Sampler::mixed(mix).ok()?
            }
        };
        crate::loader::tier::future_reads(&sampler, self.ranks.clone(), self.from, self.end)
    }
}

impl NodeTier {
    /// The tier for a rank of `uid`, if that user may have it now. The
    /// first rank to take it while no rank holds it chooses its members
    /// by its job's reads on this node (`want`, when it said), unless they
    /// were chosen for that job already: a restarted job finds its tier
    /// as it left it.
    pub(super) fn take(
        &mut self,
        uid: u32,
        want: Option<TierLayout>,
        samples: &NodeSamples<'_>,
        in_cluster: bool,
    ) -> Option<Arc<Tier>> {
        let usable = self.tier.has_memory();
        if self.uid != Some(uid) || !usable {
            if self.ranks > 0 {
                return None;
            }
            if self.uid.is_some() || !usable {
                // Another user's samples: emptied first, in fresh memory
                // (or memory a failed renewal left the tier without).
                // `get_mut` is None only while a loader of theirs still
                // holds the tier (it is dropped before its rank is counted
                // ended).
                if let Err(e) = Arc::get_mut(&mut self.tier)?.reset() {
                    self.uid = None;
                    log::warn!(
                        "agent: the node tier could not be given to uid {uid} ({e}); its ranks read without it"
                    );
                    return None;
                }
            }
            self.uid = Some(uid);
        }
        let chosen = |w: &TierLayout| self.layout.as_ref().is_some_and(|l| l.same_job(w));
        let allowed = crate::loader::tier::by_reads_allowed();
        if let Some(want) = want.filter(|w| allowed && self.ranks == 0 && !chosen(w)) {
            let t0 = std::time::Instant::now();
            let reads = want.reads(&samples.lens());
            match (Arc::get_mut(&mut self.tier), reads) {
                (Some(tier), Some(reads)) => {
                    let remote = |id| in_cluster && samples.remote(id);
                    if let Err(e) = tier.relayout(samples, &reads, &remote) {
                        // Without memory until a later rank's reset.
                        self.uid = None;
                        self.layout = None;
                        log::warn!(
                            "agent: the node tier's fresh memory for a new job could not be had ({e}); ranks read without it"
                        );
                        return None;
                    }
                    log::info!(
                        "agent: node memory tier chosen by the reads of ranks {:?} of {} from epoch {}: {} samples, {} bytes ({} ms)",
                        want.ranks,
                        want.world,
                        want.from,
                        tier.members(),
                        tier.member_bytes(),
                        t0.elapsed().as_millis()
                    );
                    self.layout = Some(want);
                }
                // Every count the same (the node runs the whole job): the
                // members chosen at start are as good.
                (_, None) => {}
                (None, Some(_)) => log::debug!("agent: node tier still held; members kept"),
            }
        }
        self.ranks += 1;
        Some(self.tier.clone())
    }

    /// A rank given the tier ended (its loader is dropped).
    pub(super) fn give_back(&mut self) {
        self.ranks = self
            .ranks
            .checked_sub(1)
            .expect("a tier given back more often than taken");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dataset::{PreloadOptions, SourceSpec};

    /// A space of 300 samples (node 0 of 1) and a node tier of a quarter.
    fn node_tier(dir: &std::path::Path) -> (Space, NodeTier) {
        let src = dir.join("src");
        std::fs::create_dir_all(&src).unwrap();
        for i in 0..300u32 {
            let len = 100 + (i % 7) as usize * 40;
            std::fs::write(src.join(format!("f{i:03}.bin")), vec![i as u8; len]).unwrap();
        }
        let spec = SourceSpec::parse(&format!("dir:{}", src.display())).unwrap();
        let sp = dir.join("space");
        let opts = PreloadOptions::default()
            .source(Some(spec))
            .threads(1)
            .check_free_space(false);
        crate::dataset::preload(&sp, &opts).unwrap();
        let space = Space::open(&sp).unwrap();
        let bytes: u64 = (0..300)
            .map(|id| space.catalog().sample(id).len as u64)
            .sum();
        let tier = Tier::new_checked(space.catalog(), bytes / 4, false)
            .unwrap()
            .unwrap();
        let t = NodeTier {
            tier: Arc::new(tier),
            uid: None,
            ranks: 0,
            layout: None,
        };
        (space, t)
    }

    fn job(seed: u64, first: u32, from: u64) -> TierLayout {
        TierLayout {
            seed,
            world: 6,
            flags: FLAG_SHUFFLE,
            ranks: first..first + 2,
            from,
            end: Some(12),
            shuffle_block: 0,
            mix: None,
        }
    }

    fn members(t: &NodeTier) -> Vec<u64> {
        (0..300).filter(|&id| t.tier.is_member(id)).collect()
    }

    /// The members are chosen again only by the first rank of a job while
    /// no rank holds the tier, and only where the counts tell something.
    #[test]
    fn the_members_are_chosen_again_only_for_a_new_job_on_a_free_tier() {
        let dir = tempfile::tempdir().unwrap();
        let (space, mut t) = node_tier(dir.path());
        let samples = NodeSamples::new([&space]);
        let at_start = members(&t);
        // The node runs every rank of the job: the counts are all equal,
        // the members chosen at start stay.
        let whole = TierLayout {
            ranks: 0..6,
            ..job(1, 0, 0)
        };
        let got = t.take(7, Some(whole), &samples, false).unwrap();
        drop(got);
        t.give_back();
        assert_eq!(members(&t), at_start);
        assert!(t.layout.is_none());
        // A job on ranks 2-3 of 6: chosen by their reads.
        let got = t.take(7, Some(job(1, 2, 0)), &samples, false).unwrap();
        let chosen = members(&t);
        assert_ne!(chosen, at_start);
        // Held: a rank of another job attaching meanwhile changes nothing.
        let held = t.take(7, Some(job(2, 0, 0)), &samples, false).unwrap();
        assert_eq!(members(&t), chosen);
        drop((got, held));
        t.give_back();
        t.give_back();
        // The same job restarted at a later epoch keeps its members.
        let got = t.take(7, Some(job(1, 2, 3)), &samples, false).unwrap();
        assert_eq!(members(&t), chosen);
        drop(got);
        t.give_back();
        // A rank that says nothing keeps them too.
        let got = t.take(7, None, &samples, false).unwrap();
        assert_eq!(members(&t), chosen);
        drop(got);
        t.give_back();
        // Another job, the tier free: chosen again.
        let got = t.take(7, Some(job(2, 2, 0)), &samples, false).unwrap();
        assert_ne!(members(&t), chosen);
        drop(got);
        t.give_back();
        // A mixture's job (here of the one space, drawn 400 times an
        // epoch): chosen by its draws; the same weights resumed elsewhere
        // in the order keep the members, new weights choose again.
        let mixed = |count: u64, start_epoch: u64, start_consumed: u64| TierLayout {
            mix: Some(MixAttach {
                counts: vec![count],
                skip: vec![0],
                start_epoch,
                start_consumed,
            }),
            ..job(4, 2, start_epoch)
        };
        let got = t.take(7, Some(mixed(400, 0, 0)), &samples, false).unwrap();
        let by_draws = members(&t);
        assert_ne!(by_draws, chosen);
        drop(got);
        t.give_back();
        let got = t
            .take(7, Some(mixed(400, 2, 150)), &samples, false)
            .unwrap();
        assert_eq!(members(&t), by_draws, "the same weights, resumed");
        drop(got);
        t.give_back();
        let got = t
            .take(7, Some(mixed(100, 2, 150)), &samples, false)
            .unwrap();
        assert_ne!(members(&t), by_draws, "new weights");
        drop(got);
        t.give_back();
        // Another user's job while this user's rank holds it: no tier.
        let mine = t.take(7, None, &samples, false).unwrap();
        assert!(t.take(8, Some(job(3, 0, 0)), &samples, false).is_none());
        drop(mine);
    }
}
