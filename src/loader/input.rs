//! Opening a loader's input: a space (its extents, O_DIRECT where the
//! file system allows), a source with its catalog, or a mixture of them
//! side by side in one id space (`LoaderBuilder::mix`), and the mixture
//! entries the front ends write (`PATH:WEIGHT`).

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::page_cache::{self, PageCache, SpaceIo};
use super::{Input, MixInput};
use crate::dataset::{Catalog, SourceSpec, Space};
use crate::error::{Error, Result};
use crate::sampler::Weight;

/// One entry of a mixture as the front ends write it: `PATH:WEIGHT` (the
/// weight after the last `:`: a proportion `0.7`, `repeat=R` or
/// `choose=N`), or `PATH` alone (`repeat=1`: the dataset once per epoch).
/// What follows the last `:` is a weight if it starts like one (a digit,
/// `.`, a sign, `repeat=`, `choose=`), else part of the path (`tar:DIR`).
pub fn parse_mix_entry(entry: &str) -> Result<(String, Weight)> {
    let entry = entry.trim();
    if let Some((path, w)) = entry.rsplit_once(':') {
        let looks = w.starts_with(|c: char| c.is_ascii_digit() || ".-+".contains(c))
            || w.starts_with("repeat=")
            || w.starts_with("choose=");
        if looks {
            if path.is_empty() {
                return Err(Error::InvalidConfig(format!("{entry:?} names no dataset")));
            }
            return Ok((path.to_string(), w.parse()?));
        }
    }
    if entry.is_empty() {
        return Err(Error::InvalidConfig("an empty mixture entry".into()));
    }
    Ok((entry.to_string(), Weight::Repeat(1.0)))
}

/// Opens one input: a space (its extents, O_DIRECT where the file
/// system allows and `io.mode` asks for it; `io.direct_io` is cleared
/// where it is not) or a source with its catalog. Returns it with its
/// alignment.
pub(super) fn open_input(
    space: Option<&PathBuf>,
    source: Option<&String>,
    catalog: Option<&PathBuf>,
    cluster: bool,
    io: &mut SpaceIo,
) -> Result<(Input, u64)> {
    Ok(match (space, source) {
        (Some(dir), _) => {
            let space = Space::open(dir)?;
            space.check_extents()?;
            let p = space.params();
            if p.is_partial() {
                check_partial(&space, cluster)?;
            } else if !cluster && space.held_samples() != space.catalog().len() {
                return Err(Error::InvalidConfig(format!(
                    "space {} holds {} of {} samples (node {} of {}); reading a partial space needs the cluster transport",
                    dir.display(),
                    space.held_samples(),
                    space.catalog().len(),
                    p.node_index,
                    p.placement.nodes
                )));
            }
            let align = p.align_bytes as u64;
            let mut extents = Vec::with_capacity(space.extent_lens().len());
            let mut all_direct = true;
            for i in 0..space.extent_lens().len() as u32 {
                let path = space.extent_path(i);
                let (f, direct) =
                    crate::sys::open_direct(&path).map_err(|e| Error::io("open", &path, e))?;
                if !direct && io.mode != PageCache::On {
                    // Not silent: every read then goes through (and
                    // evicts from) the page cache.
                    log::warn!(
                        "{}: the file system refuses O_DIRECT; reading through the page cache",
                        path.display()
                    );
                }
                all_direct &= direct;
                extents.push(f);
            }
            if all_direct {
                let choice = page_cache::decide(io.mode, &extents, space.extent_lens(), |i| {
                    space.extent_path(i as u32)
                })?;
                log::info!("{}: {}", dir.display(), choice.why);
                if choice.buffered {
                    for (i, f) in extents.iter_mut().enumerate() {
                        let path = space.extent_path(i as u32);
                        *f = std::fs::File::open(&path).map_err(|e| Error::io("open", &path, e))?;
                    }
                    all_direct = false;
                    io.why.get_or_insert(choice.why);
                }
            }
            io.direct_io &= all_direct;
            (
                Input::Space {
                    space: Arc::new(space),
                    extents: extents.into(),
                },
                align,
            )
        }
        (None, Some(src)) => {
            // A bucket is read by GETs from the pollers' object-store
            // backends (ring/store.rs); in cluster mode the nodes read and
            // the bucket is read only when every copy of a sample is lost
            // (net/store_fetch.rs).
            let catalog = match catalog {
                Some(c) => {
                    let cat = Catalog::open(c)?;
                    match SourceSpec::parse(src) {
                        // A catalog indexes one source: reading it "from"
                        // another would silently read the catalog's source.
                        Ok(spec) if cat.source_spec() != spec => {
                            return Err(Error::CatalogOfAnotherSource {
                                catalog: c.clone(),
                                catalog_source: cat.source().into_owned(),
                                given: spec.to_source_string(),
                            });
                        }
                        Ok(_) => {}
                        // In cluster mode the source is the last resort:
                        // a rank on a node without it still reads what the
                        // nodes serve.
                        Err(e @ Error::Io { .. }) if cluster => log::info!(
                            "the source is not reachable here ({e}); every sample comes from the nodes, and one no node can serve fails"
                        ),
                        Err(e) => return Err(e),
                    }
                    cat
                }
                None => {
                    let spec = SourceSpec::parse(src)?;
                    log::info!(
                        "no catalog given: building one of {src} (reads every file to checksum it)"
                    );
                    // Unique per process and build; removed once mapped.
                    static BUILDS: AtomicU64 = AtomicU64::new(0);
                    let tmp = std::env::temp_dir().join(format!(
                        "kspeed-{}-{}.ksc",
                        std::process::id(),
                        BUILDS.fetch_add(1, Ordering::Relaxed)
                    ));
                    let c = crate::dataset::catalog::build(&spec, &tmp, &Default::default())?;
                    let _ = std::fs::remove_file(&tmp);
                    c
                }
            };
            let root = catalog.source_spec().root();
            (
                Input::Source {
                    catalog: std::sync::Arc::new(catalog),
                    root,
                },
                4096,
            )
        }
        (None, None) => return Err(Error::InvalidConfig("give a space or a source".into())),
    })
}

/// Opens every dataset of the mixture ([`LoaderBuilder::mix`]) side by
/// side: ids follow the order given, extents are registered in that
/// order. Returns the mixture with the largest alignment (a multiple of
/// every other: alignments are powers of two). In cluster mode a space
/// may hold only this node's share (the rest comes from the nodes serving
/// the same spaces side by side: `kspeed serve --space A --space B`), and a
/// catalog stands for a dataset this node holds none of.
pub(super) fn open_mix(
    mix: &[(String, Weight)],
    cluster: bool,
    io: &mut SpaceIo,
) -> Result<(Input, u64)> {
    let mut parts = Vec::with_capacity(mix.len());
    let mut align = 4096u64;
    let mut any_space = false;
    for (what, _) in mix {
        let path = PathBuf::from(what);
        if what.contains("s3://") {
            return Err(Error::InvalidConfig(format!(
                "mix: {what} is in an object store; a mixture reads spaces and sources on files for now (preload it: kspeed preload --source {what} --space DIR)"
            )));
        }
        let (input, a) = if path.join(crate::dataset::space::files::MANIFEST).is_file() {
            any_space = true;
            let input = open_input(Some(&path), None, None, cluster, io)?;
            if let (true, Input::Space { space, .. }) = (cluster, &input.0) {
                if space.params().is_partial() {
                    return Err(Error::InvalidConfig(format!(
                        "mix: {what} is a partial space (--max-bytes): a mixture of partial spaces is read on one node for now"
                    )));
                }
            }
            if let Input::Space { space, .. } = &input.0 {
                let spec = space.catalog().source_spec();
                if space.params().is_partial() && spec.is_remote() {
                    return Err(Error::InvalidConfig(format!(
                        "mix: {what} is a partial space over a bucket ({}): a mixture reads partial spaces over source files for now (read it alone, or preload it whole)",
                        spec.to_source_string()
                    )));
                }
            }
            input
        } else if what.ends_with(".ksc") && path.is_file() {
            // A catalog: read from the source it records (in cluster
            // mode, from the nodes serving its space).
            let source = Catalog::open(&path)?.source().into_owned();
            open_input(None, Some(&source), Some(&path), cluster, io)?
        } else {
            open_input(None, Some(what), None, false, io)?
        };
        align = align.max(a);
        parts.push(input);
    }
    io.direct_io &= any_space;
    Ok((assemble_mix(parts)?, align))
}

/// The mixture of `parts` (each a space or a source, opened), side by
/// side in one id space in the order given: its ids, extents and files
/// numbered part after part, and its identity (a hash of every catalog's).
pub(super) fn assemble_mix(parts: Vec<Input>) -> Result<Input> {
    let mut offsets = Vec::with_capacity(parts.len());
    let (mut extent_base, mut file_base) = (Vec::new(), Vec::new());
    let (mut id, mut extents, mut files) = (0u64, 0u32, 0u32);
    for p in &parts {
        offsets.push(id);
        extent_base.push(extents);
        file_base.push(files);
        id = id
            .checked_add(p.len())
            .ok_or_else(|| Error::InvalidConfig("the mixture's ids overflow u64".into()))?;
        if let Input::Space { extents: e, .. } = p {
            extents += e.len() as u32;
        }
        files = files
            .checked_add(p.file_count() as u32)
            .ok_or_else(|| Error::InvalidConfig("the mixture has over 2^32 files".into()))?;
    }
    let identity = crate::dataset::mixture_identity(
        &parts
            .iter()
            .map(|p| p.catalog().identity())
            .collect::<Vec<_>>(),
    );
    Ok(Input::Mix(Box::new(MixInput {
        parts,
        offsets,
        extent_base,
        file_base,
        identity,
    })))
}

/// The placement and node index a cluster loader's local spaces give
/// (none without a space: the nodes' WELCOMEs tell it). A mixture's spaces
/// must agree, as the nodes serving them side by side require.
pub(super) fn cluster_placement(
    input: &Input,
    mix: &[(String, Weight)],
) -> Result<(Option<crate::dataset::Placement>, Option<u32>)> {
    let parts: Vec<(&Input, &str)> = match input {
        Input::Mix(m) => m
            .parts
            .iter()
            .zip(mix.iter().map(|(w, _)| w.as_str()))
            .collect(),
        input => vec![(input, "")],
    };
    let mut found: Option<(crate::dataset::Placement, u32, &str)> = None;
    for (p, what) in parts {
        let Input::Space { space, .. } = p else {
            continue;
        };
        let (pl, node) = (space.params().placement, space.params().node_index);
        match found {
            None => found = Some((pl, node, what)),
            Some((fp, fnode, fwhat)) if fp != pl || fnode != node => {
                return Err(Error::InvalidConfig(format!(
                    "mix: {what} is node {node} of {} with {} copies ({}), but {fwhat} is node {fnode} of {} with {} copies ({}): the spaces of a mixture read in cluster mode are placed alike (preload them with the same --nodes, --node-index and --copies)",
                    pl.nodes,
                    pl.replicas,
                    pl.owner_fn.name(),
                    fp.nodes,
                    fp.replicas,
                    fp.owner_fn.name()
                )))
            }
            Some(_) => {}
        }
    }
    Ok((found.map(|f| f.0), found.map(|f| f.1)))
}

/// A partial space (`kspeed preload --max-bytes`): the samples it does not
/// hold are read from the source its catalog records (files, which must be
/// there, or a bucket) (in cluster mode, those no node's space holds, every node having
/// the same budget: `dataset::partial`).
fn check_partial(space: &Space, cluster: bool) -> Result<()> {
    let dir = space.dir().display();
    let spec = space.catalog().source_spec();
    let root = spec.root();
    // A bucket is not looked at here: its first GET names what is wrong
    // (credentials, endpoint, a missing or replaced object) with the sample.
    if !spec.is_remote() {
        if let Err(e) = std::fs::metadata(&root) {
            return Err(Error::io("open source of the partial space", &root, e));
        }
    }
    log::info!(
        "space {dir} holds {} of {} samples; the other {} are read from {} ahead of need{}",
        space.held_samples(),
        space.catalog().len(),
        space.catalog().len() - space.held_samples(),
        root.display(),
        if cluster {
            " (those no node holds; the others from their nodes)"
        } else {
            ""
        }
    );
    Ok(())
}
