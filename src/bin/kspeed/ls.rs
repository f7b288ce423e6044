//! `kspeed ls` (what a catalog or space holds, per sample) and `kspeed cat`
//! (one sample's bytes from the space, checked).

use std::io::Write;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;

use clap::Args;
use kspeed::dataset::{Catalog, OwnerFn, Placement, SourceKind, Space};
use serde_json::json;

#[derive(Args)]
pub(crate) struct LsArgs {
    /// A space directory.
    #[arg(long, required_unless_present = "catalog")]
    space: Option<PathBuf>,
    /// A catalog file.
    #[arg(long, conflicts_with = "space")]
    catalog: Option<PathBuf>,
    /// Only ids in this range: N, A..B (B excluded) or A..=B.
    #[arg(long)]
    ids: Option<String>,
    /// Only samples of this class (its folder name, or its label number).
    #[arg(long)]
    class: Option<String>,
    /// Only samples whose source path (relative to the source root) matches
    /// this glob, e.g. 'dog/*.jpg' or '**/img_00?.bin'.
    #[arg(long)]
    path: Option<String>,
    /// Show the holder nodes for this many nodes (default: the space's placement).
    #[arg(long)]
    nodes: Option<u32>,
    /// Copies per sample for --nodes.
    #[arg(long)]
    replicas: Option<u32>,
    /// One JSON object per line instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
pub(crate) struct CatArgs {
    /// The space directory.
    #[arg(long)]
    space: PathBuf,
    /// The sample id.
    #[arg(long)]
    id: u64,
}

/// Standard base64 (RFC 4648, with padding) of `b`: how `--json` output
/// gives the exact bytes of a name that is not UTF-8.
pub(crate) fn base64(b: &[u8]) -> String {
    const ABC: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(b.len().div_ceil(3) * 4);
    for chunk in b.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, &c)| n | (c as u32) << (16 - 8 * i));
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(ABC[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// Sets `v[key]` to `bytes` for display (lossy), and, when they are not
/// UTF-8, `v[key + "_b64"]` to their exact bytes in base64 (docs/FORMAT.md).
pub(crate) fn put_name(v: &mut serde_json::Value, key: &str, bytes: Option<&[u8]>) {
    v[key] = json!(bytes.map(String::from_utf8_lossy));
    if let Some(b) = bytes.filter(|b| std::str::from_utf8(b).is_err()) {
        v[format!("{key}_b64")] = json!(base64(b));
    }
}

/// Parses `N`, `A..B` or `A..=B` into a half-open range.
fn parse_ids(s: &str) -> kspeed::Result<std::ops::Range<u64>> {
    let bad = || kspeed::Error::InvalidConfig(format!("--ids {s:?}: expected N, A..B or A..=B"));
    let num = |t: &str| t.trim().parse::<u64>().map_err(|_| bad());
    if let Some((a, b)) = s.split_once("..=") {
        let (a, b) = (num(a)?, num(b)?);
        return Ok(a..b.checked_add(1).ok_or_else(bad)?);
    }
    if let Some((a, b)) = s.split_once("..") {
        let a = if a.is_empty() { 0 } else { num(a)? };
        let b = if b.is_empty() { u64::MAX } else { num(b)? };
        return Ok(a..b);
    }
    let n = num(s)?;
    Ok(n..n + 1)
}

pub(crate) fn ls(a: LsArgs) -> kspeed::Result<()> {
    let (cat, space) = crate::open_target(&a.space, &a.catalog)?;
    let placement = match (a.nodes, &space) {
        (Some(n), s) => Some(Placement::with_fn(
            s.as_ref()
                .map_or(OwnerFn::Jump, |s| s.params().placement.owner_fn),
            n,
            a.replicas.unwrap_or(1),
        )?),
        (None, Some(s)) => Some(s.params().placement),
        _ => None,
    };
    let range = match &a.ids {
        Some(s) => parse_ids(s)?,
        None => 0..u64::MAX,
    };
    let class: Option<u32> = match &a.class {
        None => None,
        Some(c) => Some(
            (0..cat.class_count() as u32)
                .find(|&i| cat.class_name(i) == c.as_str())
                .or_else(|| c.parse::<u32>().ok())
                .ok_or_else(|| {
                    kspeed::Error::InvalidConfig(format!(
                        "--class {c:?}: no such class in {} ({} classes)",
                        cat.path().display(),
                        cat.class_count()
                    ))
                })?,
        ),
    };
    let glob = match &a.path {
        None => None,
        Some(g) => Some(glob::Pattern::new(g).map_err(|e| {
            kspeed::Error::InvalidConfig(format!("--path {g:?} is not a glob: {e}"))
        })?),
    };
    let tar = cat.source_kind() == SourceKind::Tar;
    let member_names = cat.members();
    let out = std::io::stdout();
    let mut out = std::io::BufWriter::new(out.lock());
    let w = |out: &mut std::io::BufWriter<std::io::StdoutLock<'_>>, line: String| {
        // A closed pipe (`| head`) ends the listing quietly.
        writeln!(out, "{line}").is_ok()
    };
    if !a.json {
        let head = format!(
            "{:>10}  {:>6}  {:<16}  {:>10}  {:<10}  {:<9}  source",
            "id",
            "label",
            "class",
            "bytes",
            "crc32c",
            if placement.is_some() { "holders" } else { "" }
        );
        if !w(&mut out, head) {
            return Ok(());
        }
    }
    let end = range.end.min(cat.len());
    for id in range.start.min(end)..end {
        let smp = cat.sample(id);
        if class.is_some() && smp.label != class {
            continue;
        }
        let name = cat.file(smp.file).name;
        if let Some(g) = &glob {
            // Shell-like: `*` and `?` stay within a path component, `**` crosses them.
            let opts = glob::MatchOptions {
                case_sensitive: true,
                require_literal_separator: true,
                require_literal_leading_dot: false,
            };
            if !g.matches_path_with(name, opts) {
                continue;
            }
        }
        let class_bytes = smp
            .label
            .filter(|&l| (l as u64) < cat.class_count())
            .map(|l| cat.class_name_bytes(l));
        let class_name = class_bytes.map(String::from_utf8_lossy);
        let holders: Vec<u32> = placement
            .map(|p| (0..p.replicas).map(|r| p.holder(id, r)).collect())
            .unwrap_or_default();
        let path = cat.file_path(smp.file);
        let line = if a.json {
            let mut v = json!({
                "id": id,
                "len": smp.len,
                "crc32c": format!("{:#010x}", smp.crc32c),
                "label": smp.label,
            });
            put_name(&mut v, "path", Some(path.as_os_str().as_bytes()));
            put_name(&mut v, "class", class_bytes);
            if tar {
                v["offset"] = json!(smp.offset);
            }
            if !member_names.is_empty() {
                v["members"] = cat
                    .sample_members(id)
                    .zip(&member_names)
                    .map(|((off, len), ext)| json!({"ext": ext, "offset": off, "len": len}))
                    .collect();
            }
            if placement.is_some() {
                v["holders"] = json!(holders);
            }
            if let Some(s) = &space {
                v["held_here"] = json!(s.location(id).is_some());
            }
            v.to_string()
        } else {
            let src = if tar {
                format!("{}@{}", path.display(), smp.offset)
            } else {
                path.display().to_string()
            };
            format!(
                "{id:>10}  {:>6}  {:<16}  {:>10}  {:#010x}  {:<9}  {src}",
                smp.label.map_or("-".to_string(), |l| l.to_string()),
                class_name.as_deref().unwrap_or("-"),
                smp.len,
                smp.crc32c,
                holders
                    .iter()
                    .map(|h| h.to_string())
                    .collect::<Vec<_>>()
                    .join(",")
            )
        };
        if !w(&mut out, line) {
            return Ok(());
        }
    }
    let _ = out.flush();
    Ok(())
}

/// Writes sample `id`'s bytes from the space to stdout after checking its
/// CRC32C against the catalog; nothing is written for a corrupt sample.
pub(crate) fn cat(a: CatArgs) -> kspeed::Result<()> {
    let space = Space::open(&a.space)?;
    let cat: &Catalog = space.catalog();
    if a.id >= cat.len() {
        return Err(kspeed::Error::InvalidConfig(format!(
            "sample {} is not in the catalog ({} samples)",
            a.id,
            cat.len()
        )));
    }
    let smp = cat.sample(a.id);
    let Some(loc) = space.location(a.id) else {
        let p = space.params().placement;
        let holders: Vec<String> = (0..p.replicas)
            .map(|r| p.holder(a.id, r).to_string())
            .collect();
        return Err(kspeed::Error::InvalidConfig(format!(
            "sample {} is not held by this space (node {} of {}); node(s) {} hold it",
            a.id,
            space.params().node_index,
            p.nodes,
            holders.join(", ")
        )));
    };
    let path = space.extent_path(loc.extent);
    let f = std::fs::File::open(&path).map_err(|e| kspeed::Error::io("open", &path, e))?;
    let mut buf = vec![0u8; smp.len as usize];
    f.read_exact_at(&mut buf, loc.offset)
        .map_err(|e| kspeed::Error::io("read", &path, e))?;
    let crc = crc32c::crc32c(&buf);
    if crc != smp.crc32c {
        return Err(kspeed::Error::SampleCorrupt {
            sample: a.id,
            path,
            expected: smp.crc32c,
            computed: crc,
        });
    }
    let mut out = std::io::stdout().lock();
    out.write_all(&buf)
        .and_then(|()| out.flush())
        .map_err(|e| kspeed::Error::io("write", "stdout", e))
}

#[cfg(test)]
mod tests {
    #[test]
    fn base64_matches_rfc4648() {
        for (raw, enc) in [
            (&b""[..], ""),
            (b"f", "Zg=="),
            (b"fo", "Zm8="),
            (b"foo", "Zm9v"),
            (b"foob", "Zm9vYg=="),
            (b"fooba", "Zm9vYmE="),
            (b"foobar", "Zm9vYmFy"),
            (b"cl\xfe", "Y2z+"),
            (b"\xff\xff\xff", "////"),
        ] {
            assert_eq!(super::base64(raw), enc, "{raw:?}");
        }
    }
}
