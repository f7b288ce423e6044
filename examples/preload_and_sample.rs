//! Preload a source into a space, then walk two ranks' first epoch and check
//! each sample's bytes against the catalog's CRC32C.
//!
//! cargo run --example preload_and_sample -- SOURCE SPACE

use std::fs::File;
use std::os::unix::fs::FileExt;

use kspeed::dataset::{preload, PreloadOptions, SourceSpec, Space};
use kspeed::progress::ProgressMode;
use kspeed::sampler::{Position, Sampler, SamplerConfig};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let [_, source, space_dir] = &args[..] else {
        eprintln!("usage: preload_and_sample SOURCE SPACE");
        std::process::exit(2);
    };
    let opts = PreloadOptions::default()
        .source(Some(SourceSpec::parse(source)?))
        .progress(ProgressMode::Auto);
    let report = preload(space_dir.as_ref(), &opts)?;
    println!(
        "preload: {} samples copied (up to date: {})",
        report.copied_samples, report.up_to_date
    );

    let space = Space::open(space_dir.as_ref())?;
    let catalog = space.catalog();
    for rank in 0..2 {
        let sampler = Sampler::new(
            SamplerConfig::single(catalog.len(), 42)
                .rank_world(rank, 2)
                .shuffle(true)
                .drop_last(false),
        )?;
        let mut buf = Vec::new();
        let mut bytes = 0u64;
        for id in sampler.iter_from(Position { epoch: 0, index: 0 }) {
            let s = catalog.sample(id);
            let loc = space.location(id).expect("one node holds everything");
            buf.resize(s.len as usize, 0);
            File::open(space.extent_path(loc.extent))?.read_exact_at(&mut buf, loc.offset)?;
            assert_eq!(crc32c::crc32c(&buf), s.crc32c, "sample {id}");
            bytes += s.len as u64;
        }
        println!(
            "rank {rank}: {} samples, {bytes} bytes, all CRC32C match",
            sampler.per_rank()
        );
    }
    Ok(())
}
