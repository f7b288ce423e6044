//! Whether a space is read with O_DIRECT or through the page cache
//! (`page_cache`: auto, off, on).
//!
//! O_DIRECT is right for a cold dataset (no double buffering, no page
//! cache churn pushing the trainer's own memory out), but a dataset that is
//! already resident (a warm machine, a small dataset read every epoch) is
//! then read from the device again every epoch although its bytes sit in
//! memory: a plain `DataLoader` with 0 workers beat kspeed there (0.94×).
//! `auto`, the default, samples which of the space's pages are cached when
//! the loader is built and reads through the page cache only when nearly
//! all of them are.

use std::fs::File;

use crate::error::{Error, Result};

/// How a loader reads a preloaded space's extents.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PageCache {
    /// The default: through the page cache when at least
    /// `RESIDENT_FRACTION` (90%) of a sample of the space's pages is cached when
    /// the loader is built, else O_DIRECT.
    #[default]
    Auto,
    /// Always O_DIRECT (where the file system allows it).
    Off,
    /// Always through the page cache.
    On,
}

/// The share of sampled pages that must be cached for `auto` to read
/// through the page cache. High on purpose: a dataset that is half cached
/// gains little from buffered reads of the cached half and pays page cache
/// churn (and memory taken from the trainer) for the other half.
pub(crate) const RESIDENT_FRACTION: f64 = 0.9;

/// Windows of 16 pages checked per extent file (`mincore`): a few
/// milliseconds for a whole space, whatever its size.
const WINDOWS_PER_EXTENT: u64 = 1024;

impl PageCache {
    /// Parses `auto`, `off` or `on`.
    pub fn parse(s: &str) -> Option<PageCache> {
        match s {
            "auto" => Some(PageCache::Auto),
            "off" => Some(PageCache::Off),
            "on" => Some(PageCache::On),
            _ => None,
        }
    }
}

/// How a loader's spaces are read, as its inputs are opened: the mode
/// asked, whether every read bypasses the page cache, and why.
#[derive(Debug, Clone)]
pub(crate) struct SpaceIo {
    /// What the loader was built with.
    pub mode: PageCache,
    /// Every space is read with O_DIRECT (false as soon as one is not).
    pub direct_io: bool,
    /// Why a space is read through the page cache, for the loader's I/O
    /// description (the first such space).
    pub why: Option<String>,
}

/// What [`decide`] chose for a space.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Choice {
    /// Read through the page cache (the extents are to be opened without
    /// O_DIRECT).
    pub buffered: bool,
    /// Why, for the loader's I/O description and its log line.
    pub why: String,
}

/// Decides for a space whose extent files are `extents` (opened, any
/// mode) with `lens` bytes each; `path_of(i)` names extent `i` in errors.
pub(crate) fn decide(
    mode: PageCache,
    extents: &[File],
    lens: &[u64],
    path_of: impl Fn(usize) -> std::path::PathBuf,
) -> Result<Choice> {
    match mode {
        PageCache::Off => Ok(Choice {
            buffered: false,
            why: "page_cache off".into(),
        }),
        PageCache::On => Ok(Choice {
            buffered: true,
            why: "page_cache on".into(),
        }),
        PageCache::Auto => {
            let (mut resident, mut checked) = (0u64, 0u64);
            for (i, (f, &len)) in extents.iter().zip(lens).enumerate() {
                let (r, c) = crate::sys::sample_resident_pages(f, len, WINDOWS_PER_EXTENT)
                    .map_err(|e| Error::io("check the page cache (mincore) of", path_of(i), e))?;
                resident += r;
                checked += c;
            }
            let fraction = if checked == 0 {
                0.0
            } else {
                resident as f64 / checked as f64
            };
            let buffered = checked > 0 && fraction >= RESIDENT_FRACTION;
            Ok(Choice {
                buffered,
                why: format!(
                    "page_cache auto: {:.0}% of {checked} sampled pages cached, {} {:.0}%",
                    fraction * 100.0,
                    if buffered { "at least" } else { "under" },
                    RESIDENT_FRACTION * 100.0
                ),
            })
        }
    }
}
