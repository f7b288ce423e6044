//! What a node service serves: one space, or several side by side in one
//! id space (the datasets of a mixture, in the order given): dataset `d`'s
//! sample `i` is id `offsets[d] + i`, as a mixture loader numbers them
//! (`LoaderBuilder::mix`). Every space must be placed alike (nodes, copies,
//! owner function) and held as the same node, so one WELCOME describes
//! them all; a consumer finds each sample's holders from its dataset's own
//! id.

use std::path::PathBuf;

use crate::dataset::{LayoutParams, Location, Space};
use crate::error::{Error, Result};

/// The served spaces.
pub(super) struct Served {
    spaces: Vec<Space>,
    /// Each space's first global id.
    offsets: Vec<u64>,
    /// Each space's first extent among all extents (in space order).
    extent_base: Vec<u32>,
    /// Samples of every space together.
    len: u64,
    /// The identity a consumer's HELLO must carry: the catalog's for one
    /// space, the mixture's ([`crate::dataset::mixture_identity`]) for
    /// several.
    identity: u32,
    /// The mixture identity of a single space too (a consumer reading a
    /// one-dataset mixture sends it).
    mix_identity: u32,
    /// The largest alignment of any space (a multiple of every other).
    align_bytes: u32,
}

impl Served {
    /// Opens and checks every space; `paths[0]` is the first dataset.
    pub(super) fn open(paths: &[PathBuf]) -> Result<Served> {
        let mut spaces = Vec::with_capacity(paths.len());
        for p in paths {
            let s = Space::open(p)?;
            s.check_extents()?;
            spaces.push(s);
        }
        Self::new(spaces, paths)
    }

    /// Side by side; refuses spaces placed unlike the first.
    pub(super) fn new(spaces: Vec<Space>, paths: &[PathBuf]) -> Result<Served> {
        let first = *spaces
            .first()
            .ok_or_else(|| Error::InvalidConfig("a node service needs a space".into()))?
            .params();
        let (mut offsets, mut extent_base) = (Vec::new(), Vec::new());
        let (mut len, mut extents) = (0u64, 0u32);
        for (s, path) in spaces.iter().zip(paths) {
            let p = s.params();
            if p.placement != first.placement || p.node_index != first.node_index {
                return Err(Error::InvalidConfig(format!(
                    "{} is node {} of {} with {} copies ({} owner function), but {} is node {} of {} with {} copies ({}): a node serves spaces placed alike (preload them with the same --nodes, --node-index and --copies)",
                    path.display(),
                    p.node_index,
                    p.placement.nodes,
                    p.placement.replicas,
                    p.placement.owner_fn.name(),
                    paths[0].display(),
                    first.node_index,
                    first.placement.nodes,
                    first.placement.replicas,
                    first.placement.owner_fn.name(),
                )));
            }
            offsets.push(len);
            extent_base.push(extents);
            len = len
                .checked_add(s.catalog().len())
                .ok_or_else(|| Error::InvalidConfig("the spaces' ids overflow u64".into()))?;
            extents = extents
                .checked_add(s.extent_lens().len() as u32)
                .ok_or_else(|| Error::InvalidConfig("the spaces have over 2^32 extents".into()))?;
        }
        let ids: Vec<u32> = spaces.iter().map(|s| s.catalog().identity()).collect();
        let mix_identity = crate::dataset::mixture_identity(&ids);
        Ok(Served {
            identity: if spaces.len() == 1 {
                ids[0]
            } else {
                mix_identity
            },
            mix_identity,
            align_bytes: spaces
                .iter()
                .map(|s| s.params().align_bytes)
                .max()
                .unwrap_or(512),
            spaces,
            offsets,
            extent_base,
            len,
        })
    }

    /// Where sample `id` lies (its extent counted over every space's) and
    /// its space's alignment, if this node holds it.
    pub(super) fn location(&self, id: u64) -> Option<(Location, u32)> {
        if id >= self.len {
            return None;
        }
        let d = self.offsets.partition_point(|&o| o <= id) - 1;
        let s = &self.spaces[d];
        let mut loc = s.location(id - self.offsets[d])?;
        loc.extent += self.extent_base[d];
        Some((loc, s.params().align_bytes))
    }

    /// Sample `id`'s length in bytes (`id` below [`Self::len`]).
    pub(super) fn sample_len(&self, id: u64) -> u32 {
        let d = self.offsets.partition_point(|&o| o <= id) - 1;
        self.spaces[d].catalog().sample(id - self.offsets[d]).len
    }

    /// The first space's parameters: the placement and node index every
    /// space shares.
    pub(super) fn params(&self) -> &LayoutParams {
        self.spaces[0].params()
    }

    /// The largest alignment of any space.
    pub(super) fn align_bytes(&self) -> u32 {
        self.align_bytes
    }

    /// Samples of every space together (the id space a consumer grants in).
    pub(super) fn len(&self) -> u64 {
        self.len
    }

    /// Samples this node holds, over every space.
    pub(super) fn held_samples(&self) -> u64 {
        self.spaces.iter().map(|s| s.held_samples()).sum()
    }

    /// Whether a consumer's HELLO names these datasets.
    pub(super) fn accepts(&self, identity: u32) -> bool {
        identity == self.identity || (self.spaces.len() == 1 && identity == self.mix_identity)
    }

    /// The identity a consumer's HELLO must carry (for messages).
    pub(super) fn identity(&self) -> u32 {
        self.identity
    }

    /// Every extent's path, in global extent order.
    pub(super) fn extent_paths(&self) -> Vec<PathBuf> {
        self.spaces
            .iter()
            .flat_map(|s| (0..s.extent_lens().len() as u32).map(|i| s.extent_path(i)))
            .collect()
    }

    /// The spaces served (for the start line).
    pub(super) fn describe(paths: &[PathBuf]) -> String {
        paths
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(" + ")
    }
}
