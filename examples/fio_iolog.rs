//! Writes a fio iolog (version 2) of the reads `kspeed read` makes for one
//! epoch of a space (rank 0 of 1, the given seed): every sample's aligned
//! slot, in sampler order. Replaying it with fio at the same queue depth
//! measures the device on exactly kspeed's I/O, the fairest reference.
//!
//! Samples larger than `max_read_bytes` (4 MiB, the loader's default) are
//! written as 4 MiB parts, as the loader reads them.
//!
//! cargo run --release --example fio_iolog -- SPACE [SEED] > epoch0.iolog
//! fio --name=replay --read_iolog=epoch0.iolog --direct=1 --ioengine=io_uring --iodepth=32 --readonly

use kspeed::dataset::Space;
use kspeed::sampler::{Sampler, SamplerConfig};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let Some(dir) = args.get(1) else {
        eprintln!("usage: fio_iolog SPACE [SEED]");
        std::process::exit(2);
    };
    let seed = args.get(2).map_or(0, |s| s.parse().expect("seed"));
    let space = Space::open(dir.as_ref()).expect("open space");
    let align = space.params().align_bytes as u64;
    let sampler =
        Sampler::new(SamplerConfig::single(space.catalog().len(), seed)).expect("sampler");
    println!("fio version 2 iolog");
    let extents = space.extent_lens().len() as u32;
    for i in 0..extents {
        println!("{} add", space.extent_path(i).display());
    }
    for i in 0..extents {
        println!("{} open", space.extent_path(i).display());
    }
    let order = sampler.epoch(0);
    for k in 0..sampler.per_rank() {
        let id = order.sample(k);
        let loc = space.location(id).expect("held");
        let len = (space.catalog().sample(id).len as u64)
            .next_multiple_of(align)
            .max(align);
        const PART: u64 = 4 << 20;
        let mut off = 0;
        while off < len {
            let part = (len - off).min(PART);
            println!(
                "{} read {} {}",
                space.extent_path(loc.extent).display(),
                loc.offset + off,
                part
            );
            off += part;
        }
    }
    for i in 0..extents {
        println!("{} close", space.extent_path(i).display());
    }
}
