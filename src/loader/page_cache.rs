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
    /// `RESIDENT_PERCENT` (90%) of a sample of the space's pages is cached when
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
pub(crate) const RESIDENT_PERCENT: u64 = 90;

/// Whether `resident` of `checked` sampled pages are enough to read
/// through the page cache (in integers: `1.0 - 0.9` is 0.0999... in
/// floating point, and the early exit must agree with this exactly).
fn cached(resident: u64, checked: u64) -> bool {
    checked > 0 && resident * 100 >= checked * RESIDENT_PERCENT
}

/// Windows of 16 pages checked over the whole space (`mincore`), shared
/// among its extent files by length (at least one each): 4,096 pages, a
/// share estimated within about 1.5 points, in 0.2-0.3 ms whatever the
/// space's size. It was 1,024 windows per extent file, 2-2.8 ms of a
/// 20,000-sample loader's 4.6 ms build over three extents (a warm cache
/// costs more per window than a cold one), with no better decision.
const WINDOWS_PER_SPACE: u64 = 256;

/// The most pages of `planned` that may be missing with the rest still
/// [`cached`].
fn max_missing_of(planned: u64) -> u64 {
    planned - (planned * RESIDENT_PERCENT).div_ceil(100)
}

/// The windows each extent of `lens` gets of [`WINDOWS_PER_SPACE`]: its
/// share by length, at least one for a non-empty file.
fn windows_for(lens: &[u64]) -> Vec<u64> {
    let total: u128 = lens.iter().map(|&l| u128::from(l)).sum();
    lens.iter()
        .map(|&len| {
            if len == 0 {
                0
            } else {
                ((u128::from(WINDOWS_PER_SPACE) * u128::from(len) / total) as u64).max(1)
            }
        })
        .collect()
}

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
            // The pages the whole sample would check (a file's last window
            // may be shorter): once more than the uncached share allows
            // are missing, the answer is O_DIRECT and the rest of the
            // sample cannot change it (a cold space costs a few windows).
            let windows = windows_for(lens);
            let planned = windows.iter().sum::<u64>() * crate::sys::RESIDENT_WINDOW_PAGES;
            let max_missing = max_missing_of(planned);
            let (mut resident, mut checked) = (0u64, 0u64);
            for (i, (f, &len)) in extents.iter().zip(lens).enumerate() {
                let missing = checked - resident;
                let (r, c) =
                    crate::sys::sample_resident_pages(f, len, windows[i], max_missing - missing)
                        .map_err(|e| {
                            Error::io("check the page cache (mincore) of", path_of(i), e)
                        })?;
                resident += r;
                checked += c;
                if checked - resident > max_missing {
                    break;
                }
            }
            let fraction = if checked == 0 {
                0.0
            } else {
                resident as f64 / checked as f64
            };
            let settled_early = checked - resident > max_missing;
            let buffered = cached(resident, checked);
            let why = if settled_early {
                format!(
                    "page_cache auto: {} of the first {checked} sampled pages not cached, \
                     more than {}% of the {planned} sampled",
                    checked - resident,
                    100 - RESIDENT_PERCENT
                )
            } else {
                format!(
                    "page_cache auto: {:.0}% of {checked} sampled pages cached, {} {}%",
                    fraction * 100.0,
                    if buffered { "at least" } else { "under" },
                    RESIDENT_PERCENT
                )
            };
            Ok(Choice { buffered, why })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{cached, windows_for, WINDOWS_PER_SPACE};

    /// The budget is shared by length, every non-empty extent gets at least
    /// one window, and the whole stays within the budget plus those minima.
    #[test]
    fn windows_are_shared_by_length() {
        let lens = [1 << 30, 1 << 30, 150 << 20, 0, 4096];
        let w = windows_for(&lens);
        assert_eq!(w[0], w[1], "{w:?}");
        assert!(w[0] > 6 * w[2] && w[2] > 0, "{w:?}");
        assert_eq!(w[3], 0, "an empty extent: {w:?}");
        assert_eq!(w[4], 1, "a tiny extent still gets one: {w:?}");
        let total: u64 = w.iter().sum();
        assert!(
            total <= WINDOWS_PER_SPACE + lens.len() as u64 && total + 3 >= WINDOWS_PER_SPACE,
            "{w:?}"
        );
        assert_eq!(windows_for(&[7 << 30]), [WINDOWS_PER_SPACE]);
    }

    /// The early exit agrees with the final comparison at its edge:
    /// exactly 90% cached is cached, one page fewer is not.
    #[test]
    fn max_missing_is_the_edge_of_the_final_comparison() {
        for planned in [0u64, 1, 7, 10, 16, 4080, 4096, 4095, 100_000] {
            let m = super::max_missing_of(planned);
            if planned > 0 {
                assert!(cached(planned - m, planned), "{planned}: {m}");
            }
            if m < planned {
                assert!(!cached(planned - m - 1, planned), "{planned}: {m}");
            }
        }
        assert_eq!(super::max_missing_of(4080), 408);
    }
}
