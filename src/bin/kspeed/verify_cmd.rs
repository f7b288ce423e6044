//! `kspeed verify`: re-read every held sample, check its CRC32C and every
//! extent's length, tell damage (corrupt, missing, an extent of the wrong
//! length: exit 3, repairable with --repair) from I/O errors (exit 1, with
//! the errno), optionally repair, optionally as JSON.

use std::process::ExitCode;
use std::time::Instant;

use indicatif::HumanBytes;
use kspeed::dataset::{self, BadExtent, BadKind, BadSample, Space, VerifyReport};
use kspeed::progress::ProgressMode;
use serde_json::{json, Value};

use crate::VerifyArgs;

fn bad_json(b: &BadSample) -> Value {
    json!({
        "id": b.id,
        "source": b.source.to_string_lossy(),
        "extent": b.extent.to_string_lossy(),
        "kind": match b.kind {
            BadKind::Corrupt => "corrupt",
            BadKind::Missing => "missing",
            BadKind::Io => "io_error",
        },
        "what": b.what,
    })
}

fn bad_extent_json(b: &BadExtent) -> Value {
    json!({
        "index": b.index,
        "extent": b.path.to_string_lossy(),
        "bytes": b.actual_bytes,
        "manifest_bytes": b.manifest_bytes,
        "what": b.to_string(),
    })
}

/// ", and 1 extent of the wrong length" when there is one.
fn extents_note(r: &VerifyReport) -> String {
    match r.bad_extents.len() {
        0 => String::new(),
        1 => " (and 1 extent of the wrong length)".into(),
        n => format!(" (and {n} extents of the wrong length)"),
    }
}

fn print_bad(r: &VerifyReport) {
    for b in &r.bad_extents {
        println!("{b}");
    }
    for b in &r.bad {
        println!(
            "sample {} ({}): {} in {}",
            b.id,
            b.source.display(),
            b.what,
            b.extent.display()
        );
    }
}

pub(crate) fn run(a: VerifyArgs, progress: ProgressMode) -> kspeed::Result<ExitCode> {
    let space = Space::open(&a.space)?;
    let t0 = Instant::now();
    let r = space.verify(a.threads, progress)?;
    let secs = t0.elapsed().as_secs_f64().max(1e-9);
    drop(space);
    let mut out = json!({
        "space": a.space.to_string_lossy(),
        "checked": r.checked,
        "bytes": r.bytes,
        "seconds": secs,
        "direct_io": r.direct_io,
        "bad": r.bad.iter().map(bad_json).collect::<Vec<_>>(),
        "bad_extents": r.bad_extents.iter().map(bad_extent_json).collect::<Vec<_>>(),
        "io_errors": r.io_errors(),
    });
    if !a.json {
        print_bad(&r);
        println!(
            "verified {} samples, {} in {:.2} s ({}/s{}): {} bad{}",
            r.checked,
            HumanBytes(r.bytes),
            secs,
            HumanBytes((r.bytes as f64 / secs) as u64),
            if r.direct_io {
                ", O_DIRECT"
            } else {
                ", page cache"
            },
            r.bad.len(),
            extents_note(&r)
        );
    }
    let io_errors = r.io_errors();
    if io_errors > 0 {
        if a.json {
            println!("{out}");
        }
        // Not damage: copying again would not help and could hide the cause.
        eprintln!(
            "kspeed: error: {io_errors} sample(s) in {} could not be read because of I/O errors (the errno says why); fix the cause (permissions, open-files limit, device) and verify again",
            a.space.display()
        );
        return Ok(ExitCode::from(1));
    }
    if r.bad_count() == 0 {
        if a.json {
            println!("{out}");
        }
        return Ok(ExitCode::SUCCESS);
    }
    if !a.repair {
        if a.json {
            println!("{out}");
        }
        eprintln!(
            "kspeed: error: {} corrupt or missing sample(s){} in {}; kspeed verify --repair copies exactly those again{}, kspeed preload --refresh copies everything",
            r.bad.len(),
            extents_note(&r),
            a.space.display(),
            if r.bad_extents.is_empty() {
                ""
            } else {
                " and gives each extent its planned length"
            }
        );
        return Ok(ExitCode::from(3));
    }
    let fixed = dataset::repair_verified(&a.space, &r)?;
    let again = Space::open(&a.space)?.verify(a.threads, progress)?;
    if a.json {
        out["repair"] = json!({
            "repaired": fixed.repaired,
            "bytes": fixed.bytes,
            "recreated_extents": fixed.recreated_extents,
            "resized_extents": fixed.resized_extents,
            "bad_after": again.bad.iter().map(bad_json).collect::<Vec<_>>(),
            "bad_extents_after": again.bad_extents.iter().map(bad_extent_json).collect::<Vec<_>>(),
        });
        println!("{out}");
    } else {
        let mut ids: Vec<String> = fixed
            .repaired
            .iter()
            .take(20)
            .map(|i| i.to_string())
            .collect();
        if fixed.repaired.len() > 20 {
            ids.push("...".into());
        }
        println!(
            "repaired {} sample(s), {} copied from the source{}{}: ids {}",
            fixed.repaired.len(),
            HumanBytes(fixed.bytes),
            if fixed.recreated_extents.is_empty() {
                String::new()
            } else {
                format!(
                    " ({} extent file(s) recreated)",
                    fixed.recreated_extents.len()
                )
            },
            if fixed.resized_extents.is_empty() {
                String::new()
            } else {
                format!(
                    " ({} extent file(s) given their planned length)",
                    fixed.resized_extents.len()
                )
            },
            ids.join(", ")
        );
        println!(
            "verified {} samples again: {} bad{}",
            again.checked,
            again.bad.len(),
            extents_note(&again)
        );
        print_bad(&again);
    }
    Ok(if again.bad_count() == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(3)
    })
}
