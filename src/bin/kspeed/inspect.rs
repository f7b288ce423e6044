//! `kspeed inspect`: a human summary of a catalog or space.

use std::path::PathBuf;

use indicatif::HumanBytes;
use kspeed::dataset::{Catalog, OwnerFn, Placement, Space};
use serde_json::{json, Value};

fn percentile(sorted: &[u32], p: f64) -> u32 {
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i]
}

pub(crate) fn run(
    space: &Option<PathBuf>,
    catalog: &Option<PathBuf>,
    nodes: Option<u32>,
    replicas: Option<u32>,
    devices: bool,
    json: bool,
) -> kspeed::Result<()> {
    if devices && space.is_none() && catalog.is_none() {
        print_devices();
        return Ok(());
    }
    let (cat, space) = crate::open_target(space, catalog)?;
    let placement = match (nodes, &space) {
        // Another node count for this space keeps its owner function.
        (Some(n), s) => Some(Placement::with_fn(
            s.as_ref()
                .map_or(OwnerFn::Jump, |s| s.params().placement.owner_fn),
            n,
            replicas.unwrap_or(1),
        )?),
        (None, Some(s)) if s.params().placement.nodes > 1 => Some(s.params().placement),
        _ => None,
    };
    if json {
        println!("{}", json_summary(&cat, space.as_ref(), placement));
        return Ok(());
    }
    print_catalog(&cat);
    if let Some(p) = placement {
        print_nodes(&cat, p);
    }
    if let Some(s) = &space {
        print_space(s);
    }
    if devices {
        print_devices();
    }
    Ok(())
}

fn print_catalog(cat: &Catalog) {
    let n = cat.len();
    println!(
        "catalog:      {} (format v{})",
        cat.path().display(),
        cat.version()
    );
    // What a consumer's HELLO carries and a node checks against its own.
    println!(
        "identity:     {:08x} (CRC32C of the catalog body)",
        cat.identity()
    );
    println!("source:       {}", cat.source());
    println!(
        "samples:      {n} in {} source files, {} ({:.1} catalog bytes/sample)",
        cat.file_count(),
        HumanBytes(cat.total_bytes()),
        cat.bytes_per_sample()
    );
    let mut lens: Vec<u32> = (0..n).map(|i| cat.sample(i).len).collect();
    lens.sort_unstable();
    let fmt = |v: u32| HumanBytes(v.into());
    println!(
        "sample size:  min {}  p50 {}  p90 {}  p99 {}  max {}  mean {}",
        fmt(lens[0]),
        fmt(percentile(&lens, 0.5)),
        fmt(percentile(&lens, 0.9)),
        fmt(percentile(&lens, 0.99)),
        fmt(*lens.last().expect("non-empty")),
        HumanBytes((cat.total_bytes() as f64 / n as f64) as u64)
    );
    let mut per_class = vec![0u64; cat.class_count() as usize];
    let mut unlabeled = 0u64;
    let mut max_label = None::<u32>;
    for i in 0..n {
        match cat.sample(i).label {
            Some(l) if (l as usize) < per_class.len() => per_class[l as usize] += 1,
            Some(l) => max_label = Some(max_label.map_or(l, |m| m.max(l))),
            None => unlabeled += 1,
        }
    }
    if per_class.is_empty() {
        match max_label {
            Some(m) => println!("labels:       numeric, largest {m}; {unlabeled} unlabeled"),
            None => println!("labels:       none"),
        }
    } else {
        let shown: Vec<String> = per_class
            .iter()
            .enumerate()
            .take(5)
            .map(|(i, c)| format!("{} ({c})", cat.class_name(i as u32)))
            .collect();
        let (lo, hi) = (
            per_class.iter().min().expect("non-empty"),
            per_class.iter().max().expect("non-empty"),
        );
        println!(
            "classes:      {} ({}{}), {lo}..{hi} samples per class; {unlabeled} unlabeled",
            per_class.len(),
            shown.join(", "),
            if per_class.len() > 5 { ", ..." } else { "" }
        );
    }
}

/// Everything the text summary shows, as one JSON object (exact numbers, no
/// human units).
fn json_summary(cat: &Catalog, space: Option<&Space>, placement: Option<Placement>) -> Value {
    let n = cat.len();
    let mut lens: Vec<u32> = (0..n).map(|i| cat.sample(i).len).collect();
    lens.sort_unstable();
    let mut per_class = vec![0u64; cat.class_count() as usize];
    let mut unlabeled = 0u64;
    for i in 0..n {
        match cat.sample(i).label {
            Some(l) if (l as usize) < per_class.len() => per_class[l as usize] += 1,
            Some(_) => {}
            None => unlabeled += 1,
        }
    }
    let classes: Vec<Value> = per_class
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let mut v = json!({"label": i, "samples": c});
            crate::ls::put_name(&mut v, "name", Some(cat.class_name_bytes(i as u32)));
            v
        })
        .collect();
    let mut v = json!({
        "catalog": {
            "path": cat.path().to_string_lossy(),
            "format_version": cat.version(),
            "identity": format!("{:08x}", cat.identity()),
            "source": cat.source(),
            "samples": n,
            "files": cat.file_count(),
            "total_bytes": cat.total_bytes(),
            "catalog_bytes_per_sample": cat.bytes_per_sample(),
            "sample_bytes": {
                "min": lens[0],
                "p50": percentile(&lens, 0.5),
                "p90": percentile(&lens, 0.9),
                "p99": percentile(&lens, 0.99),
                "max": lens[lens.len() - 1],
                "mean": cat.total_bytes() as f64 / n as f64,
            },
            "classes": classes,
            "unlabeled": unlabeled,
        }
    });
    if let Some(p) = placement {
        let mut held = vec![(0u64, 0u64); p.nodes as usize];
        for i in 0..n {
            let len = cat.sample(i).len as u64;
            for r in 0..p.replicas {
                let h = &mut held[p.holder(i, r) as usize];
                h.0 += 1;
                h.1 += len;
            }
        }
        v["nodes"] = json!({
            "nodes": p.nodes,
            "replicas": p.replicas,
            "held": held.iter().enumerate().map(|(i, (s, b))| json!({"node": i, "samples": s, "bytes": b})).collect::<Vec<_>>(),
        });
    }
    if let Some(s) = space {
        let p = s.params();
        let on_disk: u64 = s.extent_lens().iter().sum();
        let status = match s.check_extents() {
            Ok(()) => json!({"complete": true}),
            Err(e) => json!({"complete": false, "damage": e.to_string()}),
        };
        v["space"] = json!({
            "dir": s.dir().to_string_lossy(),
            "node_index": p.node_index,
            "nodes": p.placement.nodes,
            "replicas": p.placement.replicas,
            "owner_fn": p.placement.owner_fn.name(),
            "held_samples": s.held_samples(),
            "held_bytes": s.held_bytes(),
            "max_held_bytes": p.max_held_bytes,
            "extents": s.extent_lens().len(),
            "extent_bytes_on_disk": on_disk,
            "align_bytes": p.align_bytes,
            "extent_cap_bytes": p.extent_bytes,
            "status": status,
        });
    }
    v
}

fn print_nodes(cat: &Catalog, p: Placement) {
    let mut held = vec![(0u64, 0u64); p.nodes as usize];
    for i in 0..cat.len() {
        let len = cat.sample(i).len as u64;
        for r in 0..p.replicas {
            let h = &mut held[p.holder(i, r) as usize];
            h.0 += 1;
            h.1 += len;
        }
    }
    println!(
        "nodes:        {} nodes, {} cop{} per sample, placed by {}",
        p.nodes,
        p.replicas,
        if p.replicas == 1 { "y" } else { "ies" },
        p.owner_fn.name()
    );
    for (i, (s, b)) in held.iter().enumerate() {
        println!("  node {i:>4}:  {s} samples, {}", HumanBytes(*b));
    }
}

fn print_space(s: &Space) {
    let p = s.params();
    let on_disk: u64 = s.extent_lens().iter().sum();
    println!(
        "space:        {} (node {} of {}, {} cop{})",
        s.dir().display(),
        p.node_index,
        p.placement.nodes,
        p.placement.replicas,
        if p.placement.replicas == 1 {
            "y"
        } else {
            "ies"
        }
    );
    println!(
        "held:         {} samples, {} ({:.1}% of the dataset)",
        s.held_samples(),
        HumanBytes(s.held_bytes()),
        100.0 * s.held_bytes() as f64 / s.catalog().total_bytes().max(1) as f64
    );
    if p.is_partial() {
        println!(
            "partial:      at most {} held (--max-bytes); the node's other samples are read from the source ahead of need",
            HumanBytes(p.max_held_bytes)
        );
    }
    println!(
        "extents:      {} files, {} on disk ({:.1}% alignment padding), align {} B, cap {}",
        s.extent_lens().len(),
        HumanBytes(on_disk),
        100.0 * (on_disk as f64 - s.held_bytes() as f64) / on_disk.max(1) as f64,
        p.align_bytes,
        HumanBytes(p.extent_bytes)
    );
    match s.check_extents() {
        Ok(()) => println!("status:       complete (run kspeed verify to check every byte)"),
        Err(e) => println!("status:       DAMAGED: {e}"),
    }
}

#[cfg(feature = "rdma")]
fn print_devices() {
    use kspeed::transport::rdma::Context;
    let names = kspeed::transport::rdma::device_names();
    if names.is_empty() {
        println!("rdma devices: none");
        return;
    }
    println!("rdma devices: {}", names.join(", "));
    // Per device and port: what `kspeed serve/read --rdma` would use. The
    // node service's --listen address must be one of a port's GIDs.
    for name in &names {
        let ctx = match Context::open(Some(name), 1, Some(0)) {
            Ok(c) => c,
            Err(e) => {
                println!("  {name}: {e}");
                continue;
            }
        };
        for p in ctx.ports() {
            println!(
                "  {name} port {}: {}, MTU {} bytes",
                p.port,
                if p.active { "active" } else { "NOT active" },
                p.mtu_bytes
            );
            for (i, addr, kind) in &p.gids {
                println!("    GID index {i}: {addr} ({kind})");
            }
        }
    }
}

#[cfg(not(feature = "rdma"))]
fn print_devices() {
    println!("rdma devices: not built with the rdma feature");
}
