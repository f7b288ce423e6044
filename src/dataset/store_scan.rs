//! Scanning sources in an object store: the same three layouts as files
//! (`source.rs`), from a LIST instead of a directory walk.
//!
//! - `s3://bucket/prefix/`: an ImageFolder in the keys. The first key
//!   component under the prefix is the class ("folder"); keys directly under
//!   the prefix have no label; a zero-byte key ending in `/` (a "folder"
//!   marker some tools write) is a folder, not a sample; any component
//!   starting with `.` is hidden, as for files. Samples are in the order of
//!   their names compared component by component, the order of the same
//!   tree on a file system, so a bucket and its copy on disk catalog the
//!   same ids.
//! - `s3://bucket/shards/*.tar` (or `tar:s3://bucket/shards/`): the `.tar`
//!   objects under the prefix, by name; `s3://bucket/one.tar`: one shard.
//!   Shards are indexed in place through ranged GETs of 8 MiB windows read
//!   in order, so indexing reads each shard once.
//! - `list:s3://bucket/lists/train.txt`: one key per line, relative to the
//!   list's "folder" (`lists/`), or `s3://bucket/key` in the same bucket;
//!   `<TAB>label` as for file lists. Each key's size and ETag come from a
//!   HEAD, many in flight.
//!
//! Files record each object's ETag (catalog version 3); preload reads every
//! object only while its ETag is the cataloged one.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use super::scan::{check_len, ScanOptions, ScannedFile, ScannedSample, NO_LABEL};
use super::source::{Scan, SourceKind, SourceSpec};
use super::store::{Object, Store, StoreUrl};
use crate::error::{Error, Result};

/// The largest file list read (it is read whole).
const MAX_LIST_BYTES: u64 = 1 << 30;

/// HEAD requests in flight while a list's keys are looked up.
const HEADS_IN_FLIGHT: usize = 64;

fn url_of(spec: &SourceSpec) -> Result<StoreUrl> {
    spec.store_url().ok_or_else(|| {
        Error::InvalidConfig(format!("{} is not an s3:// source", spec.path.display()))
    })
}

fn hidden(name: &str) -> bool {
    name.split('/').any(|c| c.starts_with('.'))
}

/// Every object of a `dir` source: (name, object), sorted by name
/// component-wise, hidden names and folder markers left out; and the
/// class folders.
fn list_tree(store: &Store, url: &StoreUrl) -> Result<(Vec<Object>, Vec<OsString>)> {
    let mut objects = Vec::new();
    let mut classes = std::collections::BTreeSet::new();
    store.list(&url.dir_prefix(), |o| {
        if o.name.is_empty() || hidden(&o.name) {
            return Ok(());
        }
        if let Some((first, _)) = o.name.split_once('/') {
            classes.insert(first.to_string());
        }
        if o.name.ends_with('/') {
            // A folder marker ("cls/", zero bytes): a folder, not a sample.
            return Ok(());
        }
        objects.push(o);
        Ok(())
    })?;
    // A zero-byte object named like a folder that holds keys ("cls" beside
    // "cls/x.jpg") is a marker too (some clients strip the slash).
    let names: std::collections::HashSet<String> = objects
        .iter()
        .filter_map(|o| o.name.rsplit_once('/').map(|(d, _)| d.to_string()))
        .collect();
    objects.retain(|o| !(o.size == 0 && names.contains(&o.name)));
    objects.sort_by(|a, b| Path::new(&a.name).cmp(Path::new(&b.name)));
    Ok((objects, classes.into_iter().map(OsString::from).collect()))
}

/// The shards of a tar source: the one object, or the `.tar` objects under
/// the prefix by name.
fn list_shards(store: &Store, url: &StoreUrl) -> Result<Vec<Object>> {
    if !(url.key.is_empty() || url.key.ends_with('/')) {
        let mut o = store.head(&url.key)?;
        o.name = url.key.rsplit('/').next().unwrap_or(&url.key).to_string();
        return Ok(vec![o]);
    }
    let mut v = Vec::new();
    store.list(&url.dir_prefix(), |o| {
        if o.name.ends_with(".tar") && !hidden(&o.name) {
            v.push(o);
        }
        Ok(())
    })?;
    v.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(v)
}

/// (key relative to the list's folder, label) of every line of a list.
fn list_lines(store: &Store, url: &StoreUrl) -> Result<Vec<(String, u32, usize)>> {
    let text = store.read_all(&url.key, MAX_LIST_BYTES)?;
    let list = PathBuf::from(url.to_url());
    let text = text.strip_prefix(b"\xef\xbb\xbf").unwrap_or(&text);
    let mut out = Vec::new();
    for (i, raw) in text.split(|&b| b == b'\n').enumerate() {
        let line = i + 1;
        let raw = raw.trim_ascii_end();
        if raw.is_empty() || raw.first() == Some(&b'#') {
            continue;
        }
        let bad = |reason: String| Error::BadFileList {
            path: list.clone(),
            line,
            reason,
        };
        let raw =
            std::str::from_utf8(raw).map_err(|_| bad("not UTF-8 (object keys are)".into()))?;
        let mut cols = raw.split('\t');
        let key = cols.next().unwrap_or_default().trim_end();
        let label = match cols.next() {
            None => NO_LABEL,
            Some(l) => match l.trim().parse::<u32>() {
                Ok(v) if v != NO_LABEL => v,
                _ => {
                    return Err(bad(format!(
                        "label {l:?} is not an integer below {NO_LABEL}"
                    )))
                }
            },
        };
        if cols.next().is_some() {
            return Err(bad("more than two tab-separated columns".into()));
        }
        if key.is_empty() {
            return Err(bad("empty key".into()));
        }
        let name = match StoreUrl::parse(key) {
            Some(u) => {
                let u = u?;
                let folder = url.parent_prefix();
                if u.bucket != url.bucket || !u.key.starts_with(&folder) {
                    return Err(bad(format!(
                        "{key} is not under s3://{}/{folder} (a list names objects under its own folder)",
                        url.bucket
                    )));
                }
                u.key[folder.len()..].to_string()
            }
            None => key.trim_start_matches('/').to_string(),
        };
        if name.ends_with('/') {
            return Err(bad(format!("{key} is a folder, not an object")));
        }
        out.push((name, label, line));
    }
    Ok(out)
}

fn push(scan: &mut Scan, url: &StoreUrl, o: Object, label: u32) -> Result<()> {
    let len = check_len(Path::new(&url.child(&o.name)), o.size)?;
    let file = scan.files.len() as u32;
    scan.files.push(ScannedFile {
        name: PathBuf::from(o.name),
        size: o.size,
        mtime_ns: o.modified_ns,
        tag: o.etag.into_bytes(),
    });
    scan.samples.push(ScannedSample {
        file,
        offset: 0,
        len,
        label,
    });
    Ok(())
}

/// Lists the samples of an object-store source into `scan`.
pub(crate) fn scan(scan: &mut Scan, opts: &ScanOptions) -> Result<()> {
    let url = url_of(&scan.spec)?;
    let store = Store::of(&url.bucket)?;
    match scan.spec.kind {
        SourceKind::Dir => {
            let (objects, classes) = list_tree(&store, &url)?;
            let mut tar_files = 0u64;
            for o in objects {
                let label = match o.name.split_once('/') {
                    Some((c, _)) => classes
                        .binary_search_by(|x| x.as_os_str().cmp(std::ffi::OsStr::new(c)))
                        .map(|i| i as u32)
                        .unwrap_or(NO_LABEL),
                    None => NO_LABEL,
                };
                tar_files += o.name.ends_with(".tar") as u64;
                push(scan, &url, o, label)?;
            }
            if tar_files > 0 {
                scan.notes.warnings.push(format!(
                    "{tar_files} of the {} samples in {} are .tar objects, each taken whole as one sample; for WebDataset shards give --source {}*.tar",
                    scan.samples.len(),
                    url.to_url(),
                    url.to_url()
                ));
            }
            scan.classes = classes;
        }
        SourceKind::List => {
            let lines = list_lines(&store, &url)?;
            let folder = StoreUrl {
                key: url.parent_prefix(),
                ..url.clone()
            };
            let heads = head_all(&store, &url, &folder, &lines)?;
            for ((_, label, _), o) in lines.iter().zip(heads) {
                push(scan, &folder, o, *label)?;
            }
        }
        SourceKind::Tar => {
            let root = StoreUrl {
                key: url.dir_prefix_or_parent(),
                ..url.clone()
            };
            for o in list_shards(&store, &url)? {
                let file = scan.files.len() as u32;
                let key = format!("{}{}", root.key, o.name);
                let shown = PathBuf::from(root.child(&o.name));
                let reader = ObjectReader::new(store.clone(), key, o.etag.clone(), o.size);
                super::shard::index_shard_at(
                    &reader,
                    &shown,
                    file,
                    o.size,
                    opts,
                    &mut scan.notes,
                    &mut scan.samples,
                    &mut scan.parts,
                    &mut scan.crcs,
                )?;
                scan.files.push(ScannedFile {
                    name: PathBuf::from(o.name),
                    size: o.size,
                    mtime_ns: o.modified_ns,
                    // The listing's, else the one the index pass read.
                    tag: reader.etag.into_inner().expect("not poisoned").into_bytes(),
                });
            }
        }
    }
    Ok(())
}

/// HEADs every listed key, [`HEADS_IN_FLIGHT`] at a time; a missing key is
/// named with its line.
fn head_all(
    store: &Arc<Store>,
    list: &StoreUrl,
    folder: &StoreUrl,
    lines: &[(String, u32, usize)],
) -> Result<Vec<Object>> {
    let out: Vec<Mutex<Option<Object>>> = lines.iter().map(|_| Mutex::new(None)).collect();
    crate::par::for_each_chunk(lines.len() as u64, 16, HEADS_IN_FLIGHT, |r| {
        for i in r {
            let (name, _, line) = &lines[i as usize];
            let mut o = store
                .head(&format!("{}{name}", folder.key))
                .map_err(|e| match e {
                    Error::StoreNotFound { url, .. } => Error::BadFileList {
                        path: PathBuf::from(list.to_url()),
                        line: *line,
                        reason: format!("{url}: no such key"),
                    },
                    e => e,
                })?;
            o.name = name.clone();
            *out[i as usize].lock().expect("not poisoned") = Some(o);
        }
        Ok(())
    })?;
    Ok(out
        .into_iter()
        .map(|m| {
            m.into_inner()
                .expect("not poisoned")
                .expect("every line looked up")
        })
        .collect())
}

/// What the source holds now (names, sizes, ETags), for change reports.
pub(crate) fn current_files(spec: &SourceSpec) -> Result<Vec<ScannedFile>> {
    let url = url_of(spec)?;
    let store = Store::of(&url.bucket)?;
    let objects = match spec.kind {
        SourceKind::Dir => list_tree(&store, &url)?.0,
        SourceKind::Tar => list_shards(&store, &url)?,
        SourceKind::List => {
            let lines = list_lines(&store, &url)?;
            let folder = StoreUrl {
                key: url.parent_prefix(),
                ..url.clone()
            };
            head_all(&store, &url, &folder, &lines)?
        }
    };
    Ok(objects
        .into_iter()
        .map(|o| ScannedFile {
            name: PathBuf::from(o.name),
            size: o.size,
            mtime_ns: o.modified_ns,
            tag: o.etag.into_bytes(),
        })
        .collect())
}

/// The class folders of an ImageFolder source in a bucket now.
pub(crate) fn current_classes(spec: &SourceSpec) -> Result<Vec<OsString>> {
    let url = url_of(spec)?;
    Ok(list_tree(&*Store::of(&url.bucket)?, &url)?.1)
}

/// Reads of one object through ranged GETs of [`WINDOW_BYTES`], the last
/// window kept: a reader going forward (the tar index, a span) asks the
/// store once per window.
pub(crate) struct ObjectReader {
    store: Arc<Store>,
    key: String,
    /// The listing's ETag, else the first GET's: every window is read from
    /// that one version of the object.
    etag: Mutex<String>,
    size: u64,
    window: Mutex<(u64, Vec<u8>)>,
}

/// The bytes one GET of a shard's index pass asks for.
const WINDOW_BYTES: u64 = 8 << 20;

impl ObjectReader {
    pub(crate) fn new(store: Arc<Store>, key: String, etag: String, size: u64) -> Self {
        ObjectReader {
            store,
            key,
            etag: Mutex::new(etag),
            size,
            window: Mutex::new((0, Vec::new())),
        }
    }

    fn fill(&self, pos: u64) -> std::io::Result<(u64, Vec<u8>)> {
        let end = (pos + WINDOW_BYTES).min(self.size);
        let mut buf = Vec::with_capacity((end - pos) as usize);
        let mut etag = self.etag.lock().expect("not poisoned");
        let seen = self
            .store
            .read(&self.key, Some(&etag), pos..end, |b| {
                buf.extend_from_slice(b);
                Ok(())
            })
            .map_err(std::io::Error::other)?;
        if etag.is_empty() {
            *etag = seen;
        }
        Ok((pos, buf))
    }
}

impl super::shard::ReadAt for ObjectReader {
    fn read_at(&self, buf: &mut [u8], pos: u64) -> std::io::Result<usize> {
        if pos >= self.size || buf.is_empty() {
            return Ok(0);
        }
        let mut w = self.window.lock().expect("not poisoned");
        let inside = pos >= w.0 && pos < w.0 + w.1.len() as u64;
        if !inside {
            *w = self.fill(pos)?;
        }
        let at = (pos - w.0) as usize;
        let n = buf.len().min(w.1.len().saturating_sub(at));
        buf[..n].copy_from_slice(&w.1[at..at + n]);
        Ok(n)
    }
}

impl StoreUrl {
    /// The prefix shard names follow: the prefix itself, or the folder of
    /// a single shard's key.
    pub(crate) fn dir_prefix_or_parent(&self) -> String {
        if self.key.is_empty() || self.key.ends_with('/') {
            self.key.clone()
        } else {
            self.parent_prefix()
        }
    }
}
