//! A deterministic dataset generator for tests and benchmarks: an ImageFolder
//! tree whose file sizes follow a profile. Sample `i` goes to class
//! `i mod classes`, named `class_CCC/IIIIIIII.EXT`; its size and bytes come
//! from a ChaCha8 stream seeded by `mix64(seed) ^ i`, so the same
//! (profile, count, seed, classes) always gives the same tree.
//!
//! | profile | sizes | default classes |
//! |---|---|---|
//! | imagenet | log-normal, median 110 KiB, sigma 0.55, clamped to 2 KiB..8 MiB | 100 |
//! | audio | uniform 512 KiB..5 MiB (WAV-sized clips) | 10 |
//! | volumes | uniform 20 MiB..200 MiB (3-D medical volumes) | 4 |
//! | tiny | uniform 1 KiB..8 KiB | 10 |

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use rand::{Rng, RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, LogNormal};

use crate::error::{Error, IoContext, Result};
use crate::progress::{Progress, ProgressMode};

/// A size distribution.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Profile {
    /// ImageNet-like JPEG sizes.
    Imagenet,
    /// Audio clips.
    Audio,
    /// 3-D volumes.
    Volumes,
    /// Tiny records.
    Tiny,
}

impl std::str::FromStr for Profile {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "imagenet" => Ok(Profile::Imagenet),
            "audio" => Ok(Profile::Audio),
            "volumes" => Ok(Profile::Volumes),
            "tiny" => Ok(Profile::Tiny),
            _ => Err(format!(
                "unknown profile {s:?}: expected imagenet, audio, volumes or tiny"
            )),
        }
    }
}

impl Profile {
    fn ext(self) -> &'static str {
        match self {
            Profile::Imagenet => "jpg",
            Profile::Audio => "wav",
            Profile::Volumes => "nii",
            Profile::Tiny => "bin",
        }
    }

    /// Default class count.
    pub fn default_classes(self) -> u32 {
        match self {
            Profile::Imagenet => 100,
            Profile::Audio | Profile::Tiny => 10,
            Profile::Volumes => 4,
        }
    }

    fn size(self, rng: &mut ChaCha8Rng) -> u64 {
        const KIB: u64 = 1024;
        const MIB: u64 = 1024 * KIB;
        match self {
            Profile::Imagenet => {
                let d = LogNormal::new((110.0 * KIB as f64).ln(), 0.55).expect("valid parameters");
                (d.sample(rng) as u64).clamp(2 * KIB, 8 * MIB)
            }
            Profile::Audio => rng.random_range(512 * KIB..=5 * MIB),
            Profile::Volumes => rng.random_range(20 * MIB..=200 * MIB),
            Profile::Tiny => rng.random_range(KIB..=8 * KIB),
        }
    }
}

/// Generator settings.
#[derive(Debug, Clone)]
pub struct GenOptions {
    /// Size profile.
    pub profile: Profile,
    /// Number of samples.
    pub count: u64,
    /// Output directory (created).
    pub out: PathBuf,
    /// Seed.
    pub seed: u64,
    /// Class folders; `None` takes the profile's default (at most `count`).
    pub classes: Option<u32>,
    /// Writer threads.
    pub threads: usize,
    /// Progress display.
    pub progress: ProgressMode,
}

fn rng_for(seed: u64, i: u64) -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(crate::hash::mix64(seed) ^ i)
}

/// Size of sample `i` for `(profile, seed)`, without generating it.
pub fn sample_size(profile: Profile, seed: u64, i: u64) -> u64 {
    profile.size(&mut rng_for(seed, i))
}

/// What [`generate`] wrote.
#[derive(Debug, Clone, Copy)]
pub struct GenReport {
    /// Samples in the tree.
    pub samples: u64,
    /// Their total bytes.
    pub bytes: u64,
    /// Files that already existed with the right size and were kept.
    pub kept: u64,
}

/// Writes the tree. Files that already exist with the right size are kept, so
/// rerunning an interrupted generation finishes it.
pub fn generate(opts: &GenOptions) -> Result<GenReport> {
    if opts.count == 0 {
        return Err(Error::InvalidConfig("count must be at least 1".into()));
    }
    let classes = opts
        .classes
        .unwrap_or(opts.profile.default_classes())
        .clamp(1, u32::try_from(opts.count).unwrap_or(u32::MAX));
    for c in 0..classes {
        let d = opts.out.join(format!("class_{c:03}"));
        fs::create_dir_all(&d).ctx("create directory", &d)?;
    }
    let total: u64 = (0..opts.count)
        .map(|i| sample_size(opts.profile, opts.seed, i))
        .sum();
    let progress = Progress::new("gen", total, opts.progress);
    let kept = std::sync::atomic::AtomicU64::new(0);
    crate::par::for_each_chunk(opts.count, 16, opts.threads, |range| {
        let mut buf = Vec::new();
        for i in range {
            let mut rng = rng_for(opts.seed, i);
            let size = opts.profile.size(&mut rng);
            let path = sample_path(&opts.out, classes, i, opts.profile);
            if fs::metadata(&path).is_ok_and(|m| m.len() == size) {
                kept.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                progress.add(size);
                continue;
            }
            buf.resize(size as usize, 0);
            rng.fill_bytes(&mut buf);
            write_file(&path, &buf)?;
            progress.add(size);
        }
        Ok(())
    })?;
    progress.finish();
    Ok(GenReport {
        samples: opts.count,
        bytes: total,
        kept: kept.into_inner(),
    })
}

fn sample_path(out: &Path, classes: u32, i: u64, profile: Profile) -> PathBuf {
    out.join(format!("class_{:03}", i % classes as u64))
        .join(format!("{i:08}.{}", profile.ext()))
}

fn write_file(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut f = fs::File::create(path).ctx("create", path)?;
    f.write_all(bytes).ctx("write", path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn imagenet_median_is_near_110_kib() {
        let mut sizes: Vec<u64> = (0..5001)
            .map(|i| sample_size(Profile::Imagenet, 1, i))
            .collect();
        sizes.sort();
        let median = sizes[2500] as f64 / 1024.0;
        assert!((100.0..120.0).contains(&median), "median {median} KiB");
    }

    #[test]
    fn profiles_stay_in_range() {
        for i in 0..2000 {
            let a = sample_size(Profile::Audio, 3, i);
            assert!((512 << 10..=5 << 20).contains(&a));
            let t = sample_size(Profile::Tiny, 3, i);
            assert!((1 << 10..=8 << 10).contains(&t));
            let v = sample_size(Profile::Volumes, 3, i);
            assert!((20 << 20..=200 << 20).contains(&v));
        }
    }

    #[test]
    fn deterministic_tree() {
        let a = tempfile::tempdir().unwrap();
        let b = tempfile::tempdir().unwrap();
        for d in [&a, &b] {
            generate(&GenOptions {
                profile: Profile::Tiny,
                count: 30,
                out: d.path().to_path_buf(),
                seed: 5,
                classes: Some(3),
                threads: 2,
                progress: ProgressMode::Quiet,
            })
            .unwrap();
        }
        for i in 0..30 {
            let p = sample_path(Path::new(""), 3, i, Profile::Tiny);
            assert_eq!(
                fs::read(a.path().join(&p)).unwrap(),
                fs::read(b.path().join(&p)).unwrap()
            );
        }
    }
}
