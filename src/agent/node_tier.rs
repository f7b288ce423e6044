//! The node tier as the agent lends it: one memory tier for the node,
//! shared by the ranks of one user at a time, its members chosen again by
//! a job's reads on this node when the job's first rank attaches
//! (docs/AGENT.md, "The node tier").

use std::sync::Arc;

use super::msg::{AttachRequest, FLAG_DROP_LAST, FLAG_SHUFFLE};
use crate::dataset::Space;
use crate::loader::Tier;

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
            flags: req.flags,
            ranks: first..(first + u32::from(local_world)).min(req.world),
            from: req.start_epoch,
            end: req.end_epoch,
        })
    }

    /// Whether `other` is the same job on the same ranks of this node,
    /// whatever epoch it starts at (a restart keeps what its tier holds).
    fn same_job(&self, other: &TierLayout) -> bool {
        (self.seed, self.world, self.flags, &self.ranks, self.end)
            == (
                other.seed,
                other.world,
                other.flags,
                &other.ranks,
                other.end,
            )
    }

    /// How often the node's ranks read each sample of a dataset of `len`
    /// in the coming epochs; None where every count is the same (the node
    /// holds every rank of the job).
    fn reads(&self, len: u64) -> Option<Vec<u16>> {
        let sampler = crate::sampler::Sampler::new(crate::sampler::SamplerConfig {
            len,
            seed: self.seed,
            shuffle: self.flags & FLAG_SHUFFLE != 0,
            rank: 0,
            world: self.world,
            drop_last: self.flags & FLAG_DROP_LAST != 0,
            shuffle_block: 0,
        })
        .ok()?;
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
        space: &Space,
        in_cluster: bool,
    ) -> Option<Arc<Tier>> {
        if self.uid != Some(uid) {
            if self.ranks > 0 {
                return None;
            }
            if self.uid.is_some() {
                // Another user's samples: emptied first. `get_mut` is
                // None only while a loader of theirs still holds the
                // tier (it is dropped before its rank is counted ended).
                Arc::get_mut(&mut self.tier)?.reset();
            }
            self.uid = Some(uid);
        }
        let chosen = |w: &TierLayout| self.layout.as_ref().is_some_and(|l| l.same_job(w));
        let allowed = crate::loader::tier::by_reads_allowed();
        if let Some(want) = want.filter(|w| allowed && self.ranks == 0 && !chosen(w)) {
            let t0 = std::time::Instant::now();
            let reads = want.reads(space.catalog().len());
            match (Arc::get_mut(&mut self.tier), reads) {
                (Some(tier), Some(reads)) => {
                    let remote = |id| in_cluster && space.location(id).is_none();
                    tier.relayout(space.catalog(), &reads, &remote);
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
