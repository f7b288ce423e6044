//! Sources: where samples come from before preload. Three layouts:
//!
//! - `dir:PATH` (or any directory): an ImageFolder tree. Each first-level
//!   subfolder is a class; labels are the indices of the sorted class names;
//!   files directly under the root have no label. Symlinks are followed (a
//!   loop is an error), hidden entries (`.name`) and non-regular files are
//!   skipped. Samples are ordered by relative path, component by component.
//! - `list:PATH` (or a regular file not ending in `.tar`): a text file, one
//!   sample per line, `path` or `path<TAB>label`; relative paths are relative
//!   to the list's directory; `#` starts a comment line; blank lines are skipped.
//! - `tar:PATH` (or a path ending in `.tar`): WebDataset shards, one `.tar` file
//!   or a directory of them (sorted by name). Members are grouped by key (the
//!   member path up to the first `.` of its file name); a group's sample is its
//!   first member that is not `.cls`, and a `.cls` member holds the label as
//!   decimal text. Samples are indexed in place: (shard, offset, length).

use std::collections::HashSet;
use std::fs;
use std::io::Read;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use crate::error::{Error, IoContext, Result};

/// Marks a sample without a label.
pub const NO_LABEL: u32 = u32::MAX;

/// The largest sample kspeed accepts (lengths are stored as u32).
pub const MAX_SAMPLE_BYTES: u64 = u32::MAX as u64;

/// The layout of a source.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum SourceKind {
    /// ImageFolder directory tree.
    Dir = 1,
    /// Text file list.
    List = 2,
    /// WebDataset tar shards.
    Tar = 3,
}

impl SourceKind {
    /// The prefix used in source strings.
    pub fn prefix(self) -> &'static str {
        match self {
            SourceKind::Dir => "dir",
            SourceKind::List => "list",
            SourceKind::Tar => "tar",
        }
    }

    /// Decodes the catalog's kind field.
    pub fn from_u32(v: u32) -> Option<Self> {
        match v {
            1 => Some(SourceKind::Dir),
            2 => Some(SourceKind::List),
            3 => Some(SourceKind::Tar),
            _ => None,
        }
    }
}

/// A source as given on the command line, resolved to an absolute path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SourceSpec {
    /// Its layout.
    pub kind: SourceKind,
    /// The directory, list file or tar file/directory (canonical).
    pub path: PathBuf,
}

impl SourceSpec {
    /// Parses `dir:P`, `list:P`, `tar:P`, or a bare path whose layout is
    /// guessed (directory: dir, or tar if the name ends in `.tar`; file: list,
    /// or tar if it ends in `.tar`).
    pub fn parse(s: &str) -> Result<Self> {
        let (kind, raw) = match s.split_once(':') {
            Some(("dir", p)) => (Some(SourceKind::Dir), p),
            Some(("list", p)) => (Some(SourceKind::List), p),
            Some(("tar", p)) => (Some(SourceKind::Tar), p),
            _ => (None, s),
        };
        if raw.is_empty() {
            return Err(Error::InvalidConfig(format!("source {s:?} names no path")));
        }
        let path = fs::canonicalize(raw).ctx("open source", raw)?;
        let is_dir = path.is_dir();
        let kind = kind.unwrap_or(if path.extension().is_some_and(|e| e == "tar") {
            SourceKind::Tar
        } else if is_dir {
            SourceKind::Dir
        } else {
            SourceKind::List
        });
        match kind {
            SourceKind::Dir if !is_dir => {
                return Err(Error::InvalidConfig(format!(
                    "source {} is not a directory",
                    path.display()
                )))
            }
            SourceKind::List if is_dir => {
                return Err(Error::InvalidConfig(format!(
                    "file list {} is a directory",
                    path.display()
                )))
            }
            _ => {}
        }
        Ok(SourceSpec { kind, path })
    }

    /// The canonical string recorded in catalogs, e.g. `dir:/data/imagenet`.
    pub fn to_source_string(&self) -> String {
        format!("{}:{}", self.kind.prefix(), self.path.display())
    }

    /// The directory relative file names are resolved against.
    pub fn root(&self) -> PathBuf {
        match self.kind {
            SourceKind::Dir => self.path.clone(),
            SourceKind::List => self.path.parent().unwrap_or(Path::new("/")).to_path_buf(),
            SourceKind::Tar if self.path.is_dir() => self.path.clone(),
            SourceKind::Tar => self.path.parent().unwrap_or(Path::new("/")).to_path_buf(),
        }
    }
}

/// A source file as found when scanning.
#[derive(Debug, Clone)]
pub struct ScannedFile {
    /// Path relative to the source root (or absolute, from a file list).
    pub name: PathBuf,
    /// Size in bytes.
    pub size: u64,
    /// Modification time, nanoseconds since the Unix epoch.
    pub mtime_ns: i64,
}

/// A sample as found when scanning (its CRC comes later, from reading it).
#[derive(Debug, Clone, Copy)]
pub struct ScannedSample {
    /// Index into the file table.
    pub file: u32,
    /// Byte offset inside that file (0 except for tar members).
    pub offset: u64,
    /// Length in bytes.
    pub len: u32,
    /// Label, or [`NO_LABEL`].
    pub label: u32,
}

/// The result of listing a source.
#[derive(Debug, Clone)]
pub struct Scan {
    /// The source.
    pub spec: SourceSpec,
    /// Files, in first-use order.
    pub files: Vec<ScannedFile>,
    /// Samples, in catalog order (their index is their id).
    pub samples: Vec<ScannedSample>,
    /// Class names (ImageFolder) in label order; empty otherwise.
    pub classes: Vec<String>,
}

impl Scan {
    /// Adds a file that is one sample (directory trees and file lists).
    fn push_whole_file(
        &mut self,
        abs: &Path,
        name: PathBuf,
        size: u64,
        mtime_ns: i64,
        label: u32,
    ) -> Result<()> {
        let len = check_len(abs, size)?;
        let file = self.files.len() as u32;
        self.files.push(ScannedFile {
            name,
            size,
            mtime_ns,
        });
        self.samples.push(ScannedSample {
            file,
            offset: 0,
            len,
            label,
        });
        Ok(())
    }
}

/// Size and mtime of a file's metadata, the pair preload compares to notice change.
pub fn stat_pair(md: &fs::Metadata) -> (u64, i64) {
    (md.len(), md.mtime() * 1_000_000_000 + md.mtime_nsec())
}

/// Lists the samples of a source. Reads nothing but metadata (and, for tar
/// shards, the tar headers and `.cls` members).
pub fn scan(spec: &SourceSpec) -> Result<Scan> {
    let mut scan = Scan {
        spec: spec.clone(),
        files: Vec::new(),
        samples: Vec::new(),
        classes: Vec::new(),
    };
    match spec.kind {
        SourceKind::Dir => scan_dir(&mut scan)?,
        SourceKind::List => scan_list(&mut scan)?,
        SourceKind::Tar => scan_tar(&mut scan)?,
    }
    if scan.samples.is_empty() {
        return Err(Error::EmptySource {
            path: spec.path.clone(),
        });
    }
    Ok(scan)
}

fn check_len(path: &Path, len: u64) -> Result<u32> {
    if len > MAX_SAMPLE_BYTES {
        return Err(Error::SampleTooLarge {
            path: path.to_path_buf(),
            len,
            max: MAX_SAMPLE_BYTES,
        });
    }
    Ok(len as u32)
}

fn is_hidden(name: &std::ffi::OsStr) -> bool {
    name.as_bytes().first() == Some(&b'.')
}

fn scan_dir(scan: &mut Scan) -> Result<()> {
    let root = scan.spec.path.clone();
    // Walk the tree; `ancestors` holds the (dev, inode) of every directory on
    // the current path so a symlink back up the tree is caught.
    let mut found: Vec<(PathBuf, u64, i64)> = Vec::new();
    let root_md = fs::metadata(&root).ctx("stat", &root)?;
    let mut ancestors = HashSet::new();
    ancestors.insert((root_md.dev(), root_md.ino()));
    walk(&root, Path::new(""), &mut ancestors, &mut found)?;
    found.sort_by(|a, b| a.0.cmp(&b.0));

    let mut classes: Vec<String> = Vec::new();
    for entry in fs::read_dir(&root).ctx("read directory", &root)? {
        let entry = entry.ctx("read directory", &root)?;
        let name = entry.file_name();
        if is_hidden(&name) {
            continue;
        }
        let p = entry.path();
        if fs::metadata(&p).map(|m| m.is_dir()).unwrap_or(false) {
            classes.push(name.to_string_lossy().into_owned());
        }
    }
    classes.sort();
    for (name, size, mtime_ns) in found {
        let label = if name.components().count() > 1 {
            let class = name.components().next().expect("non-empty");
            let class = class.as_os_str().to_string_lossy();
            classes
                .binary_search_by(|c| c.as_str().cmp(&class))
                .map(|i| i as u32)
                .unwrap_or(NO_LABEL)
        } else {
            NO_LABEL
        };
        let abs = root.join(&name);
        scan.push_whole_file(&abs, name, size, mtime_ns, label)?;
    }
    scan.classes = classes;
    Ok(())
}

fn walk(
    dir_abs: &Path,
    dir_rel: &Path,
    ancestors: &mut HashSet<(u64, u64)>,
    found: &mut Vec<(PathBuf, u64, i64)>,
) -> Result<()> {
    for entry in fs::read_dir(dir_abs).ctx("read directory", dir_abs)? {
        let entry = entry.ctx("read directory", dir_abs)?;
        let name = entry.file_name();
        if is_hidden(&name) {
            continue;
        }
        let abs = entry.path();
        let rel = dir_rel.join(&name);
        // Follows symlinks, like torchvision's ImageFolder.
        let md = fs::metadata(&abs).map_err(|e| {
            if e.raw_os_error() == Some(libc::ELOOP) {
                Error::SymlinkLoop { path: abs.clone() }
            } else {
                Error::io("stat", &abs, e)
            }
        })?;
        if md.is_dir() {
            let key = (md.dev(), md.ino());
            if !ancestors.insert(key) {
                return Err(Error::SymlinkLoop { path: abs });
            }
            walk(&abs, &rel, ancestors, found)?;
            ancestors.remove(&key);
        } else if md.is_file() {
            let (size, mtime_ns) = stat_pair(&md);
            found.push((rel, size, mtime_ns));
        } else {
            log::warn!("skipping {}: not a regular file", abs.display());
        }
    }
    Ok(())
}

fn scan_list(scan: &mut Scan) -> Result<()> {
    let list = scan.spec.path.clone();
    let root = scan.spec.root();
    let text = fs::read(&list).ctx("read", &list)?;
    for (i, raw) in text.split(|&b| b == b'\n').enumerate() {
        let line_no = i + 1;
        let raw = raw.strip_suffix(b"\r").unwrap_or(raw);
        if raw.is_empty() || raw.first() == Some(&b'#') {
            continue;
        }
        let bad = |reason: String| Error::BadFileList {
            path: list.clone(),
            line: line_no,
            reason,
        };
        let mut cols = raw.split(|&b| b == b'\t');
        let path_bytes = cols.next().unwrap_or_default();
        let label = match cols.next() {
            None => NO_LABEL,
            Some(l) => {
                let s = std::str::from_utf8(l).map_err(|_| bad("label is not UTF-8".into()))?;
                match s.trim().parse::<u32>() {
                    Ok(v) if v != NO_LABEL => v,
                    _ => {
                        return Err(bad(format!(
                            "label {s:?} is not an integer below {NO_LABEL}"
                        )))
                    }
                }
            }
        };
        if cols.next().is_some() {
            return Err(bad("more than two tab-separated columns".into()));
        }
        if path_bytes.is_empty() {
            return Err(bad("empty path".into()));
        }
        let name = PathBuf::from(std::ffi::OsStr::from_bytes(path_bytes));
        let abs = root.join(&name);
        let md = fs::metadata(&abs).map_err(|e| match e.raw_os_error() {
            Some(libc::ELOOP) => Error::SymlinkLoop { path: abs.clone() },
            _ => Error::io("stat", &abs, e),
        })?;
        if !md.is_file() {
            return Err(bad(format!("{} is not a regular file", abs.display())));
        }
        let (size, mtime_ns) = stat_pair(&md);
        scan.push_whole_file(&abs, name, size, mtime_ns, label)?;
    }
    Ok(())
}

/// Splits a WebDataset member path into (key, extension): the key is the path
/// up to the first `.` of the file name.
fn split_key(member: &str) -> (&str, &str) {
    let base_start = member.rfind('/').map(|i| i + 1).unwrap_or(0);
    match member[base_start..].find('.') {
        Some(dot) => (&member[..base_start + dot], &member[base_start + dot + 1..]),
        None => (member, ""),
    }
}

fn scan_tar(scan: &mut Scan) -> Result<()> {
    let path = scan.spec.path.clone();
    let shards: Vec<PathBuf> = if path.is_dir() {
        let mut v = Vec::new();
        for e in fs::read_dir(&path).ctx("read directory", &path)? {
            let e = e.ctx("read directory", &path)?;
            let p = e.path();
            if p.extension().is_some_and(|x| x == "tar") && !is_hidden(&e.file_name()) {
                v.push(p);
            }
        }
        v.sort();
        v
    } else {
        vec![path.clone()]
    };
    let root = scan.spec.root();
    for shard in shards {
        let md = fs::metadata(&shard).ctx("stat", &shard)?;
        let (size, mtime_ns) = stat_pair(&md);
        let file = scan.files.len() as u32;
        scan.files.push(ScannedFile {
            name: shard.strip_prefix(&root).unwrap_or(&shard).to_path_buf(),
            size,
            mtime_ns,
        });
        index_shard(&shard, file, size, &mut scan.samples)?;
    }
    Ok(())
}

fn index_shard(
    shard: &Path,
    file: u32,
    shard_size: u64,
    out: &mut Vec<ScannedSample>,
) -> Result<()> {
    let bad = |reason: String| Error::BadTar {
        path: shard.to_path_buf(),
        reason,
    };
    let f = fs::File::open(shard).ctx("open", shard)?;
    let mut archive = tar::Archive::new(std::io::BufReader::with_capacity(1 << 16, f));
    // The group being assembled: key, data member (offset, len, name), label.
    struct Group {
        key: String,
        data: Option<(u64, u64, String)>,
        label: u32,
    }
    let mut group: Option<Group> = None;
    let flush = |g: Option<Group>, out: &mut Vec<ScannedSample>| -> Result<()> {
        if let Some(g) = g {
            match g.data {
                Some((offset, len, name)) => {
                    let len = check_len(&shard.join(&name), len)?;
                    out.push(ScannedSample {
                        file,
                        offset,
                        len,
                        label: g.label,
                    });
                }
                None => log::warn!(
                    "{}: key {} has no data member, skipped",
                    shard.display(),
                    g.key
                ),
            }
        }
        Ok(())
    };
    let entries = archive.entries().map_err(|e| bad(e.to_string()))?;
    for entry in entries {
        let mut entry = entry.map_err(|e| bad(format!("unreadable member header: {e}")))?;
        if !entry.header().entry_type().is_file() {
            continue;
        }
        let name = entry
            .path()
            .map_err(|e| bad(format!("bad member name: {e}")))?
            .to_string_lossy()
            .into_owned();
        let offset = entry.raw_file_position();
        let len = entry.size();
        if offset + len > shard_size {
            return Err(bad(format!(
                "member {name} ends at byte {} but the shard has {shard_size} bytes (truncated?)",
                offset + len
            )));
        }
        let (key, ext) = split_key(&name);
        if group.as_ref().is_none_or(|g| g.key != key) {
            flush(group.take(), out)?;
            group = Some(Group {
                key: key.to_string(),
                data: None,
                label: NO_LABEL,
            });
        }
        let g = group.as_mut().expect("just set");
        if ext == "cls" {
            let mut text = String::new();
            entry
                .by_ref()
                .take(64)
                .read_to_string(&mut text)
                .map_err(|e| bad(format!("member {name}: {e}")))?;
            g.label = match text.trim().parse::<u32>() {
                Ok(v) if v != NO_LABEL => v,
                _ => {
                    return Err(bad(format!(
                        "member {name}: label {:?} is not an integer",
                        text.trim()
                    )))
                }
            };
        } else if g.data.is_none() {
            g.data = Some((offset, len, name.clone()));
        }
    }
    flush(group.take(), out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn webdataset_keys() {
        assert_eq!(split_key("0001.jpg"), ("0001", "jpg"));
        assert_eq!(split_key("a/b/0001.seg.png"), ("a/b/0001", "seg.png"));
        assert_eq!(split_key("dir.x/0001"), ("dir.x/0001", ""));
    }
}
