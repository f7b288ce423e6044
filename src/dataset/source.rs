//! Sources: where samples come from before preload. Three layouts:
//!
//! - `dir:PATH` (or any directory): an ImageFolder tree. Each first-level
//!   subfolder is a class; labels are the indices of the sorted class names;
//!   files directly under the root have no label. Symlinks are followed (a
//!   loop is an error), hidden entries (`.name`) and non-regular files are
//!   skipped. Samples are ordered by relative path, component by component.
//! - `list:PATH` (or a regular file not ending in `.tar`): a text file, one
//!   sample per line, `path` or `path<TAB>label`; relative paths are relative
//!   to the list's directory; `#` starts a comment line; blank lines are
//!   skipped; a leading UTF-8 BOM and trailing whitespace (spaces, tabs, CR)
//!   are not part of a line, nor trailing spaces of the path column.
//! - `tar:PATH` (or a path ending in `.tar`): WebDataset shards, one `.tar` file
//!   or a directory of them (sorted by name). Members are grouped by key (the
//!   member path up to the first `.` of its file name); a group's sample is its
//!   first member that is not `.cls`, and a `.cls` member holds the label as
//!   decimal text. Samples are indexed in place: (shard, offset, length).
//!
//! The types a scan produces and the rules shared with `shard.rs` (sample
//! length, WebDataset keys) are in `scan.rs`, below both.

use std::collections::HashSet;
use std::ffi::OsString;
use std::fs;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

use super::scan::{check_len, ScannedFile, ScannedSample};
pub use super::scan::{ScanNotes, ScanOptions, MAX_SAMPLE_BYTES, NO_LABEL};
use crate::error::{Error, IoContext, Result};

/// Whether `s` is a remote source's URL: `s3://`, or plain `https://` /
/// `http://` (a web server's objects, read with ranged GETs).
pub fn is_store_url(s: &[u8]) -> bool {
    [&b"s3://"[..], b"https://", b"http://"]
        .iter()
        .any(|p| s.starts_with(p))
}

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
        Self::parse_os(std::ffi::OsStr::new(s))
    }

    /// [`SourceSpec::parse`] for a path that need not be UTF-8.
    pub fn parse_os(s: &std::ffi::OsStr) -> Result<Self> {
        let b = s.as_bytes();
        let (kind, raw) = match b.iter().position(|&c| c == b':') {
            Some(i) if &b[..i] == b"dir" => (Some(SourceKind::Dir), &b[i + 1..]),
            Some(i) if &b[..i] == b"list" => (Some(SourceKind::List), &b[i + 1..]),
            Some(i) if &b[..i] == b"tar" => (Some(SourceKind::Tar), &b[i + 1..]),
            _ => (None, b),
        };
        let raw = std::ffi::OsStr::from_bytes(raw);
        if raw.is_empty() {
            return Err(Error::InvalidConfig(format!("source {s:?} names no path")));
        }
        if is_store_url(raw.as_bytes()) {
            return Self::parse_store(kind, raw);
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

    /// An object-store source: `s3://bucket/prefix/` (ImageFolder keys),
    /// `s3://bucket/shard.tar` or `s3://bucket/prefix/*.tar` (tar shards),
    /// `list:s3://bucket/files.txt`. Nothing is asked of the store here.
    fn parse_store(kind: Option<SourceKind>, raw: &std::ffi::OsStr) -> Result<Self> {
        let text = raw
            .to_str()
            .ok_or_else(|| Error::InvalidConfig(format!("source {raw:?}: a URL must be UTF-8")))?;
        #[cfg(not(feature = "s3"))]
        {
            let _ = kind;
            Err(Error::InvalidConfig(format!(
                "source {text}: this build of kspeed has no object-store support (the s3 cargo feature)"
            )))
        }
        #[cfg(feature = "s3")]
        {
            use super::store::StoreUrl;
            let (text, glob_tar) = match text.strip_suffix("*.tar") {
                Some(t) => (t, true),
                None => (text, false),
            };
            let url = StoreUrl::parse(text).expect("starts with a store's scheme")?;
            let is_prefix = url.key.is_empty() || url.key.ends_with('/');
            let kind = match kind {
                Some(k) => k,
                None if glob_tar => SourceKind::Tar,
                None if url.key.ends_with(".tar") => SourceKind::Tar,
                None => SourceKind::Dir,
            };
            let key = match kind {
                SourceKind::Dir => url.dir_prefix(),
                SourceKind::Tar if glob_tar || is_prefix => url.dir_prefix(),
                SourceKind::Tar => url.key.clone(),
                SourceKind::List if is_prefix => {
                    return Err(Error::InvalidConfig(format!(
                        "file list {text} names a prefix, not an object"
                    )))
                }
                SourceKind::List => url.key.clone(),
            };
            let url = StoreUrl { key, ..url };
            Ok(SourceSpec {
                kind,
                path: PathBuf::from(url.to_url()),
            })
        }
    }

    /// The object-store location of a source in a bucket (`s3://`), None
    /// for files.
    #[cfg(feature = "s3")]
    pub fn store_url(&self) -> Option<super::store::StoreUrl> {
        self.path
            .to_str()
            .and_then(super::store::StoreUrl::parse)
            .and_then(|r| r.ok())
    }

    /// Whether the source is in an object store (`s3://`).
    pub fn is_remote(&self) -> bool {
        is_store_url(self.path.as_os_str().as_bytes())
    }

    /// The canonical string, e.g. `dir:/data/imagenet`, for messages (a path
    /// that is not UTF-8 is shown lossily; catalogs record
    /// [`SourceSpec::to_source_bytes`]).
    pub fn to_source_string(&self) -> String {
        format!("{}:{}", self.kind.prefix(), self.path.display())
    }

    /// The source as catalogs record it: `kind:` then the path's bytes, exact
    /// even when the path is not UTF-8.
    pub fn to_source_bytes(&self) -> Vec<u8> {
        let mut v = format!("{}:", self.kind.prefix()).into_bytes();
        v.extend_from_slice(self.path.as_os_str().as_bytes());
        v
    }

    /// The directory relative file names are resolved against.
    /// For an object-store source, the URL prefix file names follow
    /// (`s3://bucket/prefix/`): messages name objects by `root().join(name)`.
    pub fn root(&self) -> PathBuf {
        if self.is_remote() {
            let s = self.path.to_string_lossy();
            return match self.kind {
                SourceKind::Dir => self.path.clone(),
                _ if s.ends_with('/') => self.path.clone(),
                _ => PathBuf::from(&s[..s.rfind('/').map_or(s.len(), |i| i + 1)]),
            };
        }
        match self.kind {
            SourceKind::Dir => self.path.clone(),
            SourceKind::List => self.path.parent().unwrap_or(Path::new("/")).to_path_buf(),
            SourceKind::Tar if self.path.is_dir() => self.path.clone(),
            SourceKind::Tar => self.path.parent().unwrap_or(Path::new("/")).to_path_buf(),
        }
    }
}

/// The result of listing a source.
#[derive(Debug, Clone)]
pub(crate) struct Scan {
    /// The source.
    pub spec: SourceSpec,
    /// Files, in first-use order.
    pub files: Vec<ScannedFile>,
    /// Samples, in catalog order (their index is their id).
    pub samples: Vec<ScannedSample>,
    /// Class names (ImageFolder) in label order, as the file system spells
    /// them (bytes, not necessarily UTF-8); empty otherwise.
    pub classes: Vec<OsString>,
    /// What was noticed and not turned into samples.
    pub notes: ScanNotes,
    /// The member extensions each sample is made of (`ScanOptions::members`).
    pub members: Vec<String>,
    /// Per sample, per listed member: (offset inside the sample, length);
    /// `samples.len() * members.len()` entries.
    pub parts: Vec<(u32, u32)>,
    /// Every sample's CRC32C when the scan could take it on the way (tar
    /// shards of one member per sample: the index pass reads the data);
    /// the catalog then needs no checksum pass.
    pub crcs: Option<Vec<u32>>,
}

impl Scan {
    /// Adds a file that is one sample (directory trees and file lists).
    pub(crate) fn push_whole_file(
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
            tag: Vec::new(),
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
pub(crate) fn scan(spec: &SourceSpec, opts: &ScanOptions) -> Result<Scan> {
    scan_with(spec, opts, |scan, opts| match scan.spec.kind {
        SourceKind::Dir => scan_dir(scan, opts),
        SourceKind::List => scan_list(scan),
        SourceKind::Tar => scan_tar(scan, opts),
    })
}

/// [`scan`] with the listing done by `layout` (the object-store scanner
/// passes its own): the options' checks and the empty-source check around it.
pub(crate) fn scan_with(
    spec: &SourceSpec,
    opts: &ScanOptions,
    layout: impl FnOnce(&mut Scan, &ScanOptions) -> Result<()>,
) -> Result<Scan> {
    let mut scan = Scan {
        spec: spec.clone(),
        files: Vec::new(),
        samples: Vec::new(),
        classes: Vec::new(),
        notes: ScanNotes::default(),
        members: Vec::new(),
        parts: Vec::new(),
        crcs: (spec.kind == SourceKind::Tar && opts.members.is_empty()).then(Vec::new),
    };
    if !opts.members.is_empty() {
        if spec.kind != SourceKind::Tar {
            return Err(Error::InvalidConfig(format!(
                "--members applies to tar shards; {} is not a tar: source",
                spec.to_source_string()
            )));
        }
        let mut seen = HashSet::new();
        for m in &opts.members {
            if m.is_empty() || m == "cls" || m.contains(',') || !seen.insert(m.as_str()) {
                return Err(Error::InvalidConfig(format!(
                    "--members {:?}: each member is a distinct extension other than cls",
                    opts.members.join(",")
                )));
            }
        }
        scan.members = opts.members.clone();
    }
    layout(&mut scan, opts)?;
    if scan.samples.is_empty() {
        return Err(Error::EmptySource {
            path: spec.path.clone(),
        });
    }
    Ok(scan)
}

/// The files (names relative to the source root, size, mtime) a source holds
/// now, in scan order, without reading any file: the ImageFolder walk, the
/// list's paths, or the shards. Preload compares them with the catalog's to
/// notice changes and additions with one `stat` per file.
pub(crate) fn current_files(spec: &SourceSpec, opts: &ScanOptions) -> Result<Vec<ScannedFile>> {
    let mut scan = Scan {
        spec: spec.clone(),
        files: Vec::new(),
        samples: Vec::new(),
        classes: Vec::new(),
        notes: ScanNotes::default(),
        members: Vec::new(),
        parts: Vec::new(),
        crcs: (spec.kind == SourceKind::Tar && opts.members.is_empty()).then(Vec::new),
    };
    match spec.kind {
        SourceKind::Dir => scan_dir(&mut scan, opts)?,
        SourceKind::List => scan_list(&mut scan)?,
        SourceKind::Tar => {
            let root = spec.root();
            let mut v = Vec::new();
            for p in list_shards(spec, opts, &mut scan.notes)? {
                let (size, mtime_ns) = stat_pair(&fs::metadata(&p).ctx("stat", &p)?);
                v.push(ScannedFile {
                    name: p.strip_prefix(&root).unwrap_or(&p).to_path_buf(),
                    size,
                    mtime_ns,
                    tag: Vec::new(),
                });
            }
            return Ok(v);
        }
    }
    Ok(scan.files)
}

/// The class folders of an ImageFolder source now, in label order.
pub fn current_classes(spec: &SourceSpec) -> Result<Vec<OsString>> {
    if spec.kind != SourceKind::Dir {
        return Ok(Vec::new());
    }
    class_folders(&spec.path)
}

fn is_hidden(name: &std::ffi::OsStr) -> bool {
    name.as_bytes().first() == Some(&b'.')
}

/// What a non-regular, non-directory entry is, for messages.
pub(crate) fn special_kind(ft: fs::FileType) -> &'static str {
    if ft.is_fifo() {
        "a FIFO"
    } else if ft.is_char_device() {
        "a character device"
    } else if ft.is_block_device() {
        "a block device"
    } else if ft.is_socket() {
        "a socket"
    } else {
        "not a regular file"
    }
}

/// Refuses or counts an entry that is neither a regular file nor a directory.
fn special_entry(
    path: &Path,
    md: &fs::Metadata,
    opts: &ScanOptions,
    notes: &mut ScanNotes,
) -> Result<()> {
    let what = special_kind(md.file_type());
    if !opts.skip_special {
        return Err(Error::NotRegularFile {
            path: path.to_path_buf(),
            what,
        });
    }
    notes.skipped_special += 1;
    notes
        .warnings
        .push(format!("skipped {}: {what}", path.display()));
    Ok(())
}

/// The target of `abs` if it is a symbolic link whose target (followed to
/// the end) does not exist.
fn dangling_target(abs: &Path) -> Option<PathBuf> {
    match fs::metadata(abs) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => fs::read_link(abs).ok(),
        _ => None,
    }
}

/// Refuses or counts a dangling symbolic link in a `dir:` tree or a `tar:`
/// directory: with `skip_special` it is skipped like a FIFO (it holds no
/// sample), else it is named with its target.
fn dangling_entry(
    path: &Path,
    target: PathBuf,
    opts: &ScanOptions,
    notes: &mut ScanNotes,
) -> Result<()> {
    if !opts.skip_special {
        return Err(Error::DanglingSymlink {
            path: path.to_path_buf(),
            target,
        });
    }
    notes.skipped_special += 1;
    notes.warnings.push(format!(
        "skipped {}: a dangling symlink (its target {} does not exist)",
        path.display(),
        target.display()
    ));
    Ok(())
}

/// Refuses a symbolic link at `abs` that leads outside `root` (canonical),
/// unless `opts.follow_symlinks`.
fn check_link(abs: &Path, root: &Path, opts: &ScanOptions) -> Result<()> {
    if opts.follow_symlinks {
        return Ok(());
    }
    let lmd = fs::symlink_metadata(abs).ctx("stat", abs)?;
    if !lmd.file_type().is_symlink() {
        return Ok(());
    }
    let target = fs::canonicalize(abs).map_err(|e| match e.raw_os_error() {
        Some(libc::ELOOP) => Error::SymlinkLoop {
            path: abs.to_path_buf(),
        },
        _ => Error::io("resolve symlink", abs, e),
    })?;
    if !target.starts_with(root) {
        return Err(Error::SymlinkOutsideSource {
            path: abs.to_path_buf(),
            target,
        });
    }
    Ok(())
}

/// Follows symlinks, naming a loop and a dangling link as such.
fn stat_following(abs: &Path) -> Result<fs::Metadata> {
    fs::metadata(abs).map_err(|e| {
        if e.raw_os_error() == Some(libc::ELOOP) {
            Error::SymlinkLoop {
                path: abs.to_path_buf(),
            }
        } else if let Some(target) = (e.kind() == std::io::ErrorKind::NotFound)
            .then(|| fs::read_link(abs).ok())
            .flatten()
        {
            Error::DanglingSymlink {
                path: abs.to_path_buf(),
                target,
            }
        } else {
            Error::io("stat", abs, e)
        }
    })
}

/// First-level folders of an ImageFolder root, sorted bytewise.
fn class_folders(root: &Path) -> Result<Vec<OsString>> {
    let mut classes: Vec<OsString> = Vec::new();
    for entry in fs::read_dir(root).ctx("read directory", root)? {
        let entry = entry.ctx("read directory", root)?;
        let name = entry.file_name();
        if is_hidden(&name) {
            continue;
        }
        let p = entry.path();
        if fs::metadata(&p).map(|m| m.is_dir()).unwrap_or(false) {
            classes.push(name);
        }
    }
    classes.sort();
    Ok(classes)
}

fn scan_dir(scan: &mut Scan, opts: &ScanOptions) -> Result<()> {
    let root = scan.spec.path.clone();
    // Walk the tree; `ancestors` holds the (dev, inode) of every directory on
    // the current path so a symlink back up the tree is caught.
    let mut found: Vec<(PathBuf, u64, i64)> = Vec::new();
    let root_md = fs::metadata(&root).ctx("stat", &root)?;
    let mut ancestors = HashSet::new();
    ancestors.insert((root_md.dev(), root_md.ino()));
    let mut walk = Walk {
        root: &root,
        opts,
        ancestors,
        found: &mut found,
        notes: &mut scan.notes,
    };
    walk.dir(&root, Path::new(""))?;
    found.sort_by(|a, b| a.0.cmp(&b.0));

    // Class names are compared as bytes: two folders that differ only in
    // bytes that are not UTF-8 are two classes.
    let classes = class_folders(&root)?;
    let mut tar_files = 0u64;
    for (name, size, mtime_ns) in found {
        let label = if name.components().count() > 1 {
            let class = name.components().next().expect("non-empty");
            classes
                .binary_search_by(|c| c.as_os_str().cmp(class.as_os_str()))
                .map(|i| i as u32)
                .unwrap_or(NO_LABEL)
        } else {
            NO_LABEL
        };
        if name.extension().is_some_and(|e| e == "tar") {
            tar_files += 1;
        }
        let abs = root.join(&name);
        scan.push_whole_file(&abs, name, size, mtime_ns, label)?;
    }
    if tar_files > 0 {
        scan.notes.warnings.push(format!(
            "{tar_files} of the {} samples in {} are .tar files, each taken whole as one sample; for WebDataset shards give --source tar:{}",
            scan.samples.len(),
            root.display(),
            root.display()
        ));
    }
    scan.classes = classes;
    Ok(())
}

struct Walk<'a> {
    root: &'a Path,
    opts: &'a ScanOptions,
    ancestors: HashSet<(u64, u64)>,
    found: &'a mut Vec<(PathBuf, u64, i64)>,
    notes: &'a mut ScanNotes,
}

impl Walk<'_> {
    fn dir(&mut self, dir_abs: &Path, dir_rel: &Path) -> Result<()> {
        for entry in fs::read_dir(dir_abs).ctx("read directory", dir_abs)? {
            let entry = entry.ctx("read directory", dir_abs)?;
            let name = entry.file_name();
            if is_hidden(&name) {
                continue;
            }
            let abs = entry.path();
            let rel = dir_rel.join(&name);
            if entry.file_type().is_ok_and(|t| t.is_symlink()) {
                if let Some(target) = dangling_target(&abs) {
                    dangling_entry(&abs, target, self.opts, self.notes)?;
                    continue;
                }
                check_link(&abs, self.root, self.opts)?;
            }
            // Follows symlinks (inside the tree, or anywhere with
            // --follow-symlinks), like torchvision's ImageFolder.
            let md = stat_following(&abs)?;
            if md.is_dir() {
                let key = (md.dev(), md.ino());
                if !self.ancestors.insert(key) {
                    return Err(Error::SymlinkLoop { path: abs });
                }
                self.dir(&abs, &rel)?;
                self.ancestors.remove(&key);
            } else if md.is_file() {
                let (size, mtime_ns) = stat_pair(&md);
                self.found.push((rel, size, mtime_ns));
            } else {
                // Never opened: a FIFO would block the scan forever and a
                // device would read without end.
                special_entry(&abs, &md, self.opts, self.notes)?;
            }
        }
        Ok(())
    }
}

fn scan_list(scan: &mut Scan) -> Result<()> {
    let list = scan.spec.path.clone();
    let root = scan.spec.root();
    // Checked before reading: reading a FIFO would wait for a writer forever.
    let md = stat_following(&list)?;
    if !md.is_file() {
        return Err(Error::NotRegularFile {
            path: list,
            what: special_kind(md.file_type()),
        });
    }
    let text = fs::read(&list).ctx("read", &list)?;
    // A byte-order mark (editors on Windows write one) is not part of the
    // first path.
    let text = text.strip_prefix(UTF8_BOM).unwrap_or(&text);
    for (i, raw) in text.split(|&b| b == b'\n').enumerate() {
        let line_no = i + 1;
        // Trailing spaces, tabs and the `\r` of CRLF files are not part of
        // the line: a path that really ends in whitespace cannot be listed
        // (docs/FORMAT.md); a `dir:` source reads such files.
        let raw = trim_end_ascii_ws(raw);
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
        // `path<spaces><TAB>label`: the spaces belong to the separator too.
        let path_bytes = trim_end_ascii_ws(path_bytes);
        if path_bytes.is_empty() {
            return Err(bad("empty path".into()));
        }
        let name = PathBuf::from(std::ffi::OsStr::from_bytes(path_bytes));
        let abs = root.join(&name);
        // A path that cannot be followed is named with its line.
        let md = stat_following(&abs).map_err(|e| match e {
            Error::Io { source, .. } => bad(format!("{}: {source}", abs.display())),
            e => bad(e.to_string()),
        })?;
        if !md.is_file() {
            return Err(bad(format!(
                "{} is {}; only regular files are read",
                abs.display(),
                special_kind(md.file_type())
            )));
        }
        let (size, mtime_ns) = stat_pair(&md);
        scan.push_whole_file(&abs, name, size, mtime_ns, label)?;
    }
    Ok(())
}

/// The UTF-8 byte-order mark.
const UTF8_BOM: &[u8] = b"\xef\xbb\xbf";

/// `b` without its trailing ASCII whitespace (space, tab, CR, LF, FF).
fn trim_end_ascii_ws(b: &[u8]) -> &[u8] {
    b.trim_ascii_end()
}

/// The shards of a tar source: the one file, or the `.tar` files of the
/// directory sorted by name. Only regular files are shards.
fn list_shards(
    spec: &SourceSpec,
    opts: &ScanOptions,
    notes: &mut ScanNotes,
) -> Result<Vec<PathBuf>> {
    let path = spec.path.clone();
    let md = stat_following(&path)?;
    if !md.is_dir() {
        if !md.is_file() {
            return Err(Error::NotRegularFile {
                path,
                what: special_kind(md.file_type()),
            });
        }
        return Ok(vec![path]);
    }
    let mut v = Vec::new();
    for e in fs::read_dir(&path).ctx("read directory", &path)? {
        let e = e.ctx("read directory", &path)?;
        let p = e.path();
        if p.extension().is_none_or(|x| x != "tar") || is_hidden(&e.file_name()) {
            continue;
        }
        if e.file_type().is_ok_and(|t| t.is_symlink()) {
            if let Some(target) = dangling_target(&p) {
                dangling_entry(&p, target, opts, notes)?;
                continue;
            }
            check_link(&p, &path, opts)?;
        }
        let md = stat_following(&p)?;
        if md.is_file() {
            v.push(p);
        } else if !md.is_dir() {
            special_entry(&p, &md, opts, notes)?;
        }
    }
    v.sort();
    Ok(v)
}

fn scan_tar(scan: &mut Scan, opts: &ScanOptions) -> Result<()> {
    let shards = list_shards(&scan.spec, opts, &mut scan.notes)?;
    let root = scan.spec.root();
    for shard in shards {
        let md = fs::metadata(&shard).ctx("stat", &shard)?;
        let (size, mtime_ns) = stat_pair(&md);
        let file = scan.files.len() as u32;
        scan.files.push(ScannedFile {
            name: shard.strip_prefix(&root).unwrap_or(&shard).to_path_buf(),
            size,
            mtime_ns,
            tag: Vec::new(),
        });
        super::shard::index_shard(
            &shard,
            file,
            size,
            opts,
            &mut scan.notes,
            &mut scan.samples,
            &mut scan.parts,
            &mut scan.crcs,
        )?;
    }
    Ok(())
}
