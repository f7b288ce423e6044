//! One error type for the whole crate: every failure has a named variant that
//! says what was wrong and where (file, sample, line), so the CLI and the C ABI
//! can print it as is and tests can match on it.
//!
//! Why this file is over ~800 lines: it is one enum, each variant with the
//! doc and message a user reads; splitting it by module would scatter the
//! one list the C ABI's status codes and the Python exceptions map from.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// A kspeed result.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What changed about a source file since the catalog recorded it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SourceChange {
    /// The source file.
    pub path: PathBuf,
    /// Human-readable description ("size 100 -> 120 bytes", "vanished", ...).
    pub what: String,
}

fn holders_text(holders: &[(u32, bool)]) -> String {
    if holders.is_empty() {
        return " (preload, unload or serve running?)".into();
    }
    let list: Vec<String> = holders
        .iter()
        .map(|(pid, shared)| {
            format!(
                "pid {pid} ({})",
                if *shared {
                    "shared: serve or a reader"
                } else {
                    "exclusive: preload or unload"
                }
            )
        })
        .collect();
    format!(": held by {}", list.join(", "))
}

/// [`Error::EmptySource`]'s message: a bucket's says what was listed.
fn empty_source(path: &std::path::Path) -> String {
    let p = path.display();
    if path.as_os_str().as_encoded_bytes().starts_with(b"s3://") {
        format!("source {p} has no samples: no objects under {p} (keys ending in / and hidden names are not samples; a tar source needs .tar objects, a list needs lines)")
    } else {
        format!("source {p} has no samples (an ImageFolder tree needs files under class folders, a file list needs lines, tar shards need members)")
    }
}

/// Every error kspeed reports.
///
/// Errors are `Clone` (OS errors are shared behind an `Arc`), so a loader that
/// failed can hand its first error to every later call.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An I/O call failed on a named file.
    #[error("{op} {path}: {source}")]
    Io {
        /// What kspeed was doing ("open", "read", "write", ...).
        op: &'static str,
        /// The file it was doing it to.
        path: PathBuf,
        /// The operating system's error.
        #[source]
        source: Arc<io::Error>,
    },
    /// The source holds no samples.
    #[error("{}", empty_source(path))]
    EmptySource {
        /// The source.
        path: PathBuf,
    },
    /// Following a symbolic link leads back to one of its own parents.
    #[error("symlink loop at {path}: it leads back to a directory already being scanned")]
    SymlinkLoop {
        /// The link.
        path: PathBuf,
    },
    /// A source entry is not a regular file (FIFO, device, socket): reading it
    /// could block forever or yield endless bytes, so it is never read.
    #[error("{path} is {what}, not a regular file; only regular files are read (--skip-special skips such entries with a count)")]
    NotRegularFile {
        /// The entry.
        path: PathBuf,
        /// "a FIFO", "a character device", ...
        what: &'static str,
    },
    /// The catalog (`--catalog`, `catalog=`) was built from another source
    /// than the one given (`--source`, `source=`).
    #[error("catalog {catalog} was built from {catalog_source}, not {given}; give the source {catalog_source} (--source, source=), or build a catalog of {given} with `kspeed catalog`")]
    CatalogOfAnotherSource {
        /// The catalog file.
        catalog: PathBuf,
        /// The source recorded in it.
        catalog_source: String,
        /// The source asked for.
        given: String,
    },
    /// A symbolic link in the source points outside the source tree.
    #[error("symlink {path} leads outside the source tree (to {target}); refused so a source cannot pull in files from elsewhere (--follow-symlinks allows it)")]
    SymlinkOutsideSource {
        /// The link.
        path: PathBuf,
        /// Where it leads.
        target: PathBuf,
    },
    /// A line of a file list cannot be parsed.
    #[error("file list {path}, line {line}: {reason}")]
    BadFileList {
        /// The list.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// What is wrong with it.
        reason: String,
    },
    /// A tar shard cannot be indexed.
    #[error("tar shard {path}: {reason}")]
    BadTar {
        /// The shard.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// An object store has no such bucket or key.
    #[error("{url}: no such {what} in the object store ({detail})")]
    StoreNotFound {
        /// The bucket or object.
        url: String,
        /// "bucket" or "key".
        what: &'static str,
        /// The store's answer.
        detail: String,
    },
    /// An object store refused the credentials or the request (403, 401, a
    /// bad key id or signature, an expired token).
    #[error("{url}: access denied by the object store: {detail}; check AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE (or --aws-profile) and the endpoint")]
    StoreAccessDenied {
        /// What was asked for.
        url: String,
        /// The store's answer and where the credentials came from (never
        /// the credentials).
        detail: String,
    },
    /// An object-store request failed after its retries (5xx, SlowDown,
    /// connections refused or reset, time-outs), or the store answered
    /// something that is not S3.
    #[error("{url}: object store request failed: {detail}")]
    StoreFailed {
        /// What was asked for.
        url: String,
        /// The last error and the client's settings (never the credentials).
        detail: String,
    },
    /// A sample is larger than the format allows (4 GiB - 1).
    #[error("sample {path} is {len} bytes; kspeed samples are limited to {max} bytes")]
    SampleTooLarge {
        /// The sample's source file.
        path: PathBuf,
        /// Its length.
        len: u64,
        /// The limit.
        max: u64,
    },
    /// A kspeed file does not start with the expected magic bytes.
    #[error("{path} is not a kspeed {kind} file (magic {found:02x?}, expected {expected:02x?})")]
    BadMagic {
        /// The file.
        path: PathBuf,
        /// "catalog", "manifest", "journal".
        kind: &'static str,
        /// The bytes found.
        found: Vec<u8>,
        /// The bytes expected.
        expected: Vec<u8>,
    },
    /// A kspeed file was written by a format version this build cannot read.
    #[error("{path}: {kind} format version {found} is not supported (this build reads version {supported})")]
    UnsupportedVersion {
        /// The file.
        path: PathBuf,
        /// "catalog", "manifest", "journal".
        kind: &'static str,
        /// The version in the file.
        found: u32,
        /// The version this build reads.
        supported: u32,
    },
    /// A checksum over part of a kspeed file does not match.
    #[error("{path}: {kind} {part} checksum mismatch (stored {stored:#010x}, computed {computed:#010x}); the file is corrupt")]
    ChecksumMismatch {
        /// The file.
        path: PathBuf,
        /// "catalog", "manifest", "journal".
        kind: &'static str,
        /// "header" or "body".
        part: &'static str,
        /// Stored CRC32C.
        stored: u32,
        /// Computed CRC32C.
        computed: u32,
    },
    /// A kspeed file is shorter than its header says.
    #[error("{path}: {kind} is truncated ({actual} bytes, expected {expected})")]
    Truncated {
        /// The file.
        path: PathBuf,
        /// "catalog", "manifest", "extent", ...
        kind: &'static str,
        /// Bytes expected.
        expected: u64,
        /// Bytes found.
        actual: u64,
    },
    /// A kspeed file passed its checksums but its contents do not hold together.
    #[error("{path}: corrupt {kind}: {detail}")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// "catalog", "manifest", ...
        kind: &'static str,
        /// What is inconsistent.
        detail: String,
    },
    /// Source files changed (size, mtime, content) or vanished since the catalog was built.
    #[error("{} source file(s) changed since the catalog was built: {}{}; rerun with --refresh to rebuild the catalog and copy again",
        changes.len(),
        changes.iter().take(5).map(|c| format!("{} ({})", c.path.display(), c.what)).collect::<Vec<_>>().join(", "),
        if changes.len() > 5 { ", ..." } else { "" })]
    SourceChanged {
        /// Every change found.
        changes: Vec<SourceChange>,
    },
    /// The catalog in a space was built from another source than the one given.
    #[error("space {space} holds a catalog of {catalog_source}, not {given}; use another space or --refresh")]
    SourceMismatch {
        /// The space.
        space: PathBuf,
        /// The source recorded in its catalog.
        catalog_source: String,
        /// The source asked for.
        given: String,
    },
    /// The space's file system has too little free space for what preload must write.
    #[error("not enough space on {path}: {needed} bytes needed, {available} available")]
    DiskFull {
        /// The file or directory being written.
        path: PathBuf,
        /// Bytes still to write.
        needed: u64,
        /// Bytes free (for unprivileged users) when checked, 0 when the write itself failed.
        available: u64,
    },
    /// A cache area (`cache_dir`) cannot be used as it is: held by another
    /// process, another dataset's, another version's, or cut short.
    #[error("cache area {path}: {reason}")]
    CacheArea {
        /// The area's folder.
        path: PathBuf,
        /// What is wrong and what to do.
        reason: String,
    },
    /// Another process holds the space's lock.
    #[error(
        "space {path} is locked by another kspeed process{}",
        holders_text(holders)
    )]
    SpaceLocked {
        /// The space.
        path: PathBuf,
        /// Pids holding the lock (from /proc/locks; empty when unknown) and
        /// whether each holds it shared (a running `kspeed serve`).
        holders: Vec<(u32, bool)>,
    },
    /// The directory is not a complete space (no manifest yet, or none at all).
    #[error("{path} is not a complete kspeed space: {reason}")]
    NotASpace {
        /// The directory.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// A configuration value is invalid.
    #[error("invalid configuration: {0}")]
    InvalidConfig(String),
    /// A batch release named a batch this loader never handed out (C
    /// `ksp_loader_release_batch`, Python's batch handles).
    #[error("batch {seq} was never handed out (the last batch is {last})")]
    UnknownBatch {
        /// The batch named.
        seq: u64,
        /// The last batch handed out (0: none yet).
        last: u64,
    },
    /// A loader option's value is of the wrong type or out of its range
    /// (the one message of every front end:
    /// [`crate::loader::options::OPTIONS`]).
    #[error("option {key}: {value} is {problem}; it takes {allowed}")]
    InvalidOption {
        /// The option's key.
        key: String,
        /// The value given, as given (a string quoted) or as the number it
        /// was read as.
        value: String,
        /// What is wrong with it ("above the maximum", "not an integer"...).
        problem: String,
        /// What the option takes ("an integer from 1 to 16384").
        allowed: String,
        /// The value is of a type the option never takes (Python raises
        /// `TypeError` for these, `ValueError` for the others).
        wrong_type: bool,
    },
    /// No loader option has this key.
    #[error("unknown option {key:?} (set to {value}); the options are listed at ksp_config_set in kspeed.h, by kspeed.options() and in the README")]
    UnknownOption {
        /// The key given.
        key: String,
        /// The value given (a string quoted).
        value: String,
    },
    /// The landing ring cannot be locked in memory.
    #[error("cannot mlock the {needed}-byte landing ring (errno {errno}): RLIMIT_MEMLOCK is {}; raise it (ulimit -l, or LimitMEMLOCK= in systemd, or memlock in /etc/security/limits.conf) or use a smaller ring",
        if *limit == u64::MAX { "unlimited".to_string() } else { format!("{limit} bytes") })]
    Memlock {
        /// Bytes that needed locking.
        needed: u64,
        /// The current soft limit (u64::MAX = unlimited).
        limit: u64,
        /// The errno of mlock.
        errno: i32,
    },
    /// The landing ring cannot be bound to a NUMA node.
    #[error("cannot bind the landing ring to NUMA node {node}: {reason}")]
    Numa {
        /// The node asked for.
        node: u32,
        /// Why.
        reason: String,
    },
    /// CUDA registration was required but is not possible.
    #[error("CUDA registration of the landing ring failed: {0}")]
    Cuda(String),
    /// A sample cannot fit in the landing ring.
    #[error("sample {sample} ({len} bytes, {slot} with alignment) does not fit in the {ring_bytes}-byte landing ring (or its 1 GiB registration segments); raise ring_bytes")]
    SampleLargerThanRing {
        /// The sample.
        sample: u64,
        /// Its length.
        len: u64,
        /// Its slot size in the ring.
        slot: u64,
        /// The ring size.
        ring_bytes: u64,
    },
    /// Reading a sample failed.
    #[error("reading sample {sample} from {path} at offset {offset} failed: {errno_name}")]
    ReadFailed {
        /// The sample.
        sample: u64,
        /// The file.
        path: PathBuf,
        /// Byte offset of the read.
        offset: u64,
        /// The errno (its number and description; `errno_name.0 ==
        /// libc::EIO`...).
        errno_name: Errno,
        /// The OS error.
        #[source]
        source: Arc<io::Error>,
    },
    /// A sample's file ended before the sample did (truncated after preload?).
    #[error("sample {sample}: {path} is truncated: read {got} of {expected} bytes at offset {offset} (after {attempts} attempts)")]
    ShortRead {
        /// The sample.
        sample: u64,
        /// The file.
        path: PathBuf,
        /// Byte offset of the read.
        offset: u64,
        /// Bytes expected.
        expected: u64,
        /// Bytes read in the last attempt.
        got: u64,
        /// Attempts made.
        attempts: u32,
    },
    /// A sample's bytes do not match the catalog's CRC32C.
    #[error("sample {sample} from {path}: crc32c {computed:#010x} does not match the catalog's {expected:#010x}")]
    SampleCorrupt {
        /// The sample.
        sample: u64,
        /// The file it was read from.
        path: PathBuf,
        /// CRC32C in the catalog.
        expected: u32,
        /// CRC32C of the bytes read.
        computed: u32,
    },
    /// The loader stopped after an earlier error, which it keeps: every
    /// call after the first failure returns this, carrying that first error
    /// (its kind, and through the C ABI its status).
    #[error("the loader stopped after an earlier error: {0}")]
    LoaderFailed(Box<Error>),
    /// A kspeed thread (a poller, the network thread) panicked: a bug.
    #[error("the {thread} thread panicked (a bug; please report it)")]
    ThreadPanicked {
        /// Which thread.
        thread: &'static str,
    },
    /// The operating system refused to start a thread.
    #[error("cannot start the {thread} thread: {source}")]
    ThreadSpawn {
        /// Which thread.
        thread: &'static str,
        /// The OS error.
        #[source]
        source: Arc<io::Error>,
    },
    /// A batch of `batch_size` samples may not fit in the landing ring, so
    /// some batch would have to be cut short (and ranks would see different
    /// batch counts): refused at build.
    #[error("the {ring_bytes}-byte landing ring cannot hold a whole batch: {batch_size} samples may take up to {batch_bytes} bytes of ring (the catalog's {batch_size} largest samples, aligned to {align_bytes} bytes, plus padding at the ring's end); set ring_bytes to at least {needed_bytes} ({needed_human})")]
    RingTooSmallForBatch {
        /// Samples per batch.
        batch_size: usize,
        /// The most ring bytes one batch can take.
        batch_bytes: u64,
        /// Slot alignment.
        align_bytes: u64,
        /// The ring size asked for.
        ring_bytes: u64,
        /// The smallest ring that holds every batch.
        needed_bytes: u64,
        /// `needed_bytes` for people ("24.0 MiB").
        needed_human: String,
    },
    /// io_uring could not be set up.
    #[error("io_uring setup failed ({what}): {source}")]
    Uring {
        /// What was being set up.
        what: &'static str,
        /// The OS error.
        #[source]
        source: Arc<io::Error>,
    },
    /// A cluster file or launcher environment cannot be used.
    #[error("cluster description {origin}: {reason}")]
    BadCluster {
        /// The file (with line) or the environment variable.
        origin: String,
        /// What is wrong.
        reason: String,
    },
    /// The local rank, the NUMA node or the topology cannot place the
    /// pollers (see [`crate::placement`]).
    #[error("core placement {origin}: {reason}")]
    BadPlacement {
        /// The environment variable, option or sysfs file.
        origin: String,
        /// What is wrong.
        reason: String,
    },
    /// The launcher's environment variables are malformed or contradict
    /// each other (see [`crate::launcher`]).
    #[error("launcher environment ({vars}): {reason}")]
    BadLauncher {
        /// The variables and their values (`RANK=8, WORLD_SIZE=8`).
        vars: String,
        /// What is wrong.
        reason: String,
    },
    /// A SLURM hostlist (`SLURM_JOB_NODELIST`, `--nodelist`) does not
    /// follow the grammar.
    #[error("hostlist {list:?} at byte {at}: {reason}")]
    BadHostlist {
        /// The hostlist as given.
        list: String,
        /// Byte offset in `list` where it is wrong.
        at: usize,
        /// What is wrong.
        reason: String,
    },
    /// A node refused the connection at HELLO (token, version, dataset).
    #[error("node {node} ({addr}) refused the connection: {code}: {message}")]
    Refused {
        /// Node index.
        node: u32,
        /// Its address.
        addr: String,
        /// The protocol's error code name.
        code: &'static str,
        /// The node's message.
        message: String,
    },
    /// A peer broke the protocol; the connection was dropped.
    #[error("node {node} ({addr}) broke the protocol: {what}")]
    ProtocolViolation {
        /// Node index.
        node: u32,
        /// Its address.
        addr: String,
        /// What it did.
        what: String,
    },
    /// A node service that went away came back as another node: its space
    /// is placed otherwise (another node count, copies or owner function)
    /// or it is another node index. The consumer does not use it again;
    /// the samples only it held fail with this error.
    #[error("node {node} ({addr}) came back changed: {what}")]
    NodeChanged {
        /// Node index.
        node: u32,
        /// Its address.
        addr: String,
        /// What differs.
        what: String,
    },
    /// No node and no source could deliver a sample.
    #[error("sample {sample} is unavailable: {tried}")]
    SampleUnavailable {
        /// The sample.
        sample: u64,
        /// Every place tried and why it failed.
        tried: String,
    },
    /// A verbs call failed (device, port, memory registration, QP state).
    #[error("RDMA {op}: {detail}")]
    Rdma {
        /// What was being done.
        op: &'static str,
        /// The details (device, sizes, the OS error).
        detail: String,
    },
    /// A work request completed with an error status.
    #[error("RDMA work request {wr_id} failed: {status} (vendor error {vendor_err:#x})")]
    RdmaCompletion {
        /// The work request id (the poster's slot).
        wr_id: u64,
        /// The completion status name (`IBV_WC_REM_ACCESS_ERR`...).
        status: &'static str,
        /// The vendor's error code.
        vendor_err: u32,
    },
    /// The node service could not start (bind, space).
    #[error("node service: {0}")]
    Serve(String),
    /// A saved sampler position cannot be decoded or does not fit the sampler.
    #[error("invalid sampler position: {0}")]
    BadPosition(String),
    /// Ranks' positions that should describe one lock-step job disagree
    /// (another epoch, step, world or segment), so no job position exists.
    #[error("ranks were not in lock-step: {0}")]
    NotLockStep(String),
    /// The exactly-once audit found delivered samples that differ from the
    /// sampler's consumed set (a count or a digest mismatch).
    #[error("exactly-once audit failed: {0}")]
    AuditMismatch(String),
    /// A symbolic link in the source leads to nothing: its target does not
    /// exist.
    #[error("symlink {path} is dangling: its target {target} does not exist (in a dir: tree or a tar: directory, --skip-special skips such entries with a count)")]
    DanglingSymlink {
        /// The link.
        path: PathBuf,
        /// What it points to (as written in the link).
        target: PathBuf,
    },
    /// An extent file is longer than the manifest says: something wrote
    /// past its planned end after preload (a shorter one is
    /// [`Error::Truncated`]).
    #[error("extent {path} is {actual_bytes} bytes, manifest says {manifest_bytes}: it changed after preload (kspeed verify lists it, kspeed verify --repair restores its length)")]
    ExtentSize {
        /// The extent file.
        path: PathBuf,
        /// Its length on disk.
        actual_bytes: u64,
        /// The length the manifest gives it.
        manifest_bytes: u64,
    },
    /// An attach segment or ring a peer passed does not hold together
    /// (magic, layout version, sizes, seals, a release mark past what was
    /// published): docs/AGENT.md.
    #[error("attach segment: {what}")]
    AttachSegment {
        /// What is wrong with it.
        what: String,
    },
    /// A message on the agent's attach socket is malformed (magic,
    /// version, length, kind, descriptor count): docs/AGENT.md.
    #[error("attach protocol: {what}")]
    AttachProtocol {
        /// What is wrong with it.
        what: String,
    },
    /// The agent refused the attach (REFUSED with its reason), or the
    /// agent refused the peer (its credentials).
    #[error("attach refused ({code}): {reason}")]
    AttachRefused {
        /// The refusal code's name (`peer_uid`, `version`, ...).
        code: &'static str,
        /// The reason as the refusing side wrote it.
        reason: String,
    },
    /// A peer on the attach socket did not answer in time.
    #[error("attach: no {what} within {waited_ms} ms (the peer is silent)")]
    AttachTimeout {
        /// What was awaited ("ATTACHED reply", "ATTACH message", "ready batch"...).
        what: &'static str,
        /// How long it waited.
        waited_ms: u64,
    },
    /// The other side of an attach segment stopped beating (died) or
    /// detached.
    #[error("attached {peer} (pid {pid}) is gone: {}", if *closed { "it detached".to_string() } else { format!("no heartbeat for {silent_ms} ms") })]
    AttachPeerGone {
        /// "agent" or "rank".
        peer: &'static str,
        /// Its process id, as it wrote it in the segment.
        pid: u32,
        /// How long since its last heartbeat.
        silent_ms: u64,
        /// Whether it closed cleanly instead.
        closed: bool,
    },
    /// The other side of an attach segment failed and posted this error.
    #[error("attached {peer} failed: {kind}: {message}")]
    AttachPeerError {
        /// "agent" or "rank".
        peer: &'static str,
        /// The posted error's kind name.
        kind: String,
        /// Its message.
        message: String,
    },
    /// The agent's attach socket cannot be set up (in use, not a socket,
    /// its directory).
    #[error("attach socket {path}: {what}")]
    AttachSocket {
        /// The socket's path.
        path: PathBuf,
        /// What is wrong.
        what: String,
    },
    /// The node agent an attached loader reads through is gone: it died
    /// (no heartbeat, or its socket hung up) or detached.
    #[error("the kspeed agent at {} (pid {pid}) is gone: {why}; its last heartbeat was {last_heartbeat_ms} ms ago", socket.display())]
    AgentGone {
        /// The agent's attach socket.
        socket: PathBuf,
        /// The agent's process id, as it wrote it in the segment.
        pid: u32,
        /// How long before the error its last heartbeat was.
        last_heartbeat_ms: u64,
        /// What showed it ("no heartbeat", "its socket hung up", "it detached").
        why: String,
    },
    /// `agent = required` (or `auto` where the agent could serve) and no
    /// agent could be attached to.
    #[error("{}", no_agent_message(socket, reason))]
    NoAgent {
        /// The socket tried.
        socket: PathBuf,
        /// Why it failed (no such socket, refused, timed out...).
        reason: String,
    },
}

/// [`Error::NoAgent`]'s text: an agent that answered and refused the rank
/// is named as such (starting one would not help), anything else as no
/// agent at the socket.
fn no_agent_message(socket: &std::path::Path, reason: &str) -> String {
    if reason.starts_with("attach refused") {
        format!(
            "the kspeed agent at {} did not take this rank: {reason} (a rank and its agent must be of one kspeed release and read one dataset, docs/DEPLOY.md; or set agent = off)",
            socket.display()
        )
    } else {
        format!(
            "no kspeed agent at {}: {reason} (start one with `kspeed agent --space DIR`, docs/DEPLOY.md; or set agent = off)",
            socket.display()
        )
    }
}

impl Error {
    /// The error itself, or for [`Error::LoaderFailed`] the first error the
    /// loader failed with.
    pub fn root(&self) -> &Error {
        match self {
            Error::LoaderFailed(e) => e.root(),
            e => e,
        }
    }

    /// Wraps an `io::Error` with the operation and file, mapping "no space
    /// left" to [`Error::DiskFull`] so a full disk is never a generic I/O error.
    pub fn io(op: &'static str, path: impl AsRef<Path>, source: io::Error) -> Self {
        let path = path.as_ref().to_path_buf();
        if source.kind() == io::ErrorKind::StorageFull
            || source.raw_os_error() == Some(libc::EDQUOT)
        {
            return Error::DiskFull {
                path,
                needed: 0,
                available: 0,
            };
        }
        Error::Io {
            op,
            path,
            source: Arc::new(source),
        }
    }
}

/// The family an [`Error`] belongs to: what the front ends group errors by
/// (the C ABI's `ksp_status`, the Python package's exception classes).
/// Every variant of [`Error`] has exactly one, given by [`Error::class`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorClass {
    /// An I/O call on a named file failed (open, read, write, a full disk,
    /// a space locked by another process).
    Io,
    /// A source, catalog, space or sample is wrong or corrupt (no samples,
    /// an entry that cannot be read as a sample, a checksum that does not
    /// match, a catalog of another source).
    Data,
    /// A configuration or argument kspeed refuses (a ring too small, a bad
    /// cluster description, placement or position).
    Config,
    /// A node refused, broke the protocol, or no node could deliver a
    /// sample; or the node agent a rank attaches to is missing or gone.
    Network,
    /// A system resource is missing or limited (memlock, io_uring, threads,
    /// NUMA, CUDA, RDMA verbs).
    Resource,
    /// A kspeed thread panicked: a bug.
    Bug,
    /// The node service could not start.
    Service,
}

impl Error {
    /// The variant's name (`"ReadFailed"`, `"NotRegularFile"`...): the
    /// Python exception's `kind`. [`Error::LoaderFailed`] is
    /// `"LoaderFailed"`; its first error is [`Error::root`].
    pub fn kind_name(&self) -> &'static str {
        self.kind().0
    }

    /// The variant's [`ErrorClass`]. [`Error::LoaderFailed`] has its first
    /// error's class: a loader that failed keeps failing the same way.
    pub fn class(&self) -> ErrorClass {
        self.kind().1
    }

    /// The one mapping of every variant to its name and class, for every
    /// front end. No wildcard: a new variant does not compile until it is
    /// given both here.
    fn kind(&self) -> (&'static str, ErrorClass) {
        use ErrorClass::*;
        match self {
            Error::Io { .. } => ("Io", Io),
            Error::ReadFailed { .. } => ("ReadFailed", Io),
            Error::ShortRead { .. } => ("ShortRead", Io),
            Error::DiskFull { .. } => ("DiskFull", Io),
            Error::SpaceLocked { .. } => ("SpaceLocked", Io),
            Error::CacheArea { .. } => ("CacheArea", Io),
            Error::EmptySource { .. } => ("EmptySource", Data),
            Error::SymlinkLoop { .. } => ("SymlinkLoop", Data),
            Error::NotRegularFile { .. } => ("NotRegularFile", Data),
            Error::SymlinkOutsideSource { .. } => ("SymlinkOutsideSource", Data),
            Error::DanglingSymlink { .. } => ("DanglingSymlink", Data),
            Error::CatalogOfAnotherSource { .. } => ("CatalogOfAnotherSource", Data),
            Error::ExtentSize { .. } => ("ExtentSize", Data),
            Error::BadFileList { .. } => ("BadFileList", Data),
            Error::BadTar { .. } => ("BadTar", Data),
            Error::StoreNotFound { .. } => ("StoreNotFound", Data),
            Error::StoreAccessDenied { .. } => ("StoreAccessDenied", Io),
            Error::StoreFailed { .. } => ("StoreFailed", Io),
            Error::SampleTooLarge { .. } => ("SampleTooLarge", Data),
            Error::BadMagic { .. } => ("BadMagic", Data),
            Error::UnsupportedVersion { .. } => ("UnsupportedVersion", Data),
            Error::ChecksumMismatch { .. } => ("ChecksumMismatch", Data),
            Error::Truncated { .. } => ("Truncated", Data),
            Error::Corrupt { .. } => ("Corrupt", Data),
            Error::SourceChanged { .. } => ("SourceChanged", Data),
            Error::SourceMismatch { .. } => ("SourceMismatch", Data),
            Error::NotASpace { .. } => ("NotASpace", Data),
            Error::SampleCorrupt { .. } => ("SampleCorrupt", Data),
            Error::InvalidConfig(_) => ("InvalidConfig", Config),
            Error::UnknownBatch { .. } => ("UnknownBatch", Config),
            Error::InvalidOption { .. } => ("InvalidOption", Config),
            Error::UnknownOption { .. } => ("UnknownOption", Config),
            Error::SampleLargerThanRing { .. } => ("SampleLargerThanRing", Config),
            Error::RingTooSmallForBatch { .. } => ("RingTooSmallForBatch", Config),
            Error::BadPosition(_) => ("BadPosition", Config),
            Error::NotLockStep(_) => ("NotLockStep", Config),
            Error::AuditMismatch(_) => ("AuditMismatch", Data),
            Error::BadCluster { .. } => ("BadCluster", Config),
            Error::BadPlacement { .. } => ("BadPlacement", Config),
            Error::BadLauncher { .. } => ("BadLauncher", Config),
            Error::BadHostlist { .. } => ("BadHostlist", Config),
            Error::Refused { .. } => ("Refused", Network),
            Error::ProtocolViolation { .. } => ("ProtocolViolation", Network),
            Error::SampleUnavailable { .. } => ("SampleUnavailable", Network),
            Error::NodeChanged { .. } => ("NodeChanged", Network),
            Error::RdmaCompletion { .. } => ("RdmaCompletion", Network),
            Error::AttachSegment { .. } => ("AttachSegment", Network),
            Error::AttachProtocol { .. } => ("AttachProtocol", Network),
            Error::AttachRefused { .. } => ("AttachRefused", Network),
            Error::AttachTimeout { .. } => ("AttachTimeout", Network),
            Error::AttachPeerGone { .. } => ("AttachPeerGone", Network),
            Error::AttachPeerError { .. } => ("AttachPeerError", Network),
            Error::AttachSocket { .. } => ("AttachSocket", Service),
            // The node's agent is the rank's node service: missing or gone,
            // as a node that refused or died (C: KSP_ERR_NETWORK).
            Error::AgentGone { .. } => ("AgentGone", Network),
            Error::NoAgent { .. } => ("NoAgent", Network),
            Error::Memlock { .. } => ("Memlock", Resource),
            Error::Uring { .. } => ("Uring", Resource),
            Error::ThreadSpawn { .. } => ("ThreadSpawn", Resource),
            Error::Numa { .. } => ("Numa", Resource),
            Error::Cuda(_) => ("Cuda", Resource),
            Error::Rdma { .. } => ("Rdma", Resource),
            Error::ThreadPanicked { .. } => ("ThreadPanicked", Bug),
            Error::Serve(_) => ("Serve", Service),
            Error::LoaderFailed(first) => ("LoaderFailed", first.class()),
        }
    }

    /// The operating system's error number the error carries, if any
    /// (`errno` of the Python exception).
    pub fn os_errno(&self) -> Option<i32> {
        match self {
            Error::Io { source, .. }
            | Error::ReadFailed { source, .. }
            | Error::Uring { source, .. }
            | Error::ThreadSpawn { source, .. } => source.raw_os_error(),
            Error::DiskFull { .. } => Some(libc::ENOSPC),
            Error::Memlock { errno, .. } => Some(*errno),
            Error::LoaderFailed(first) => first.os_errno(),
            // The other variants carry no OS error (a wildcard is right
            // here: a new variant with one adds its arm above).
            _ => None,
        }
    }
}

/// An errno value in messages: its number and the C library's description
/// (`errno 5 (Input/output error)`), for every value: the number is never
/// dropped, and the description comes from the C library (`strerror_r`,
/// through std's `io::Error`) rather than a table of names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Errno(pub i32);

impl std::fmt::Display for Errno {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // std writes "DESCRIPTION (os error N)"; the number is ours to place.
        let e = std::io::Error::from_raw_os_error(self.0).to_string();
        let suffix = format!(" (os error {})", self.0);
        let desc = e.strip_suffix(&suffix).unwrap_or(&e);
        write!(f, "errno {} ({desc})", self.0)
    }
}

/// The errno `errno` for a message (see [`Errno`]).
pub fn errno_name(errno: i32) -> Errno {
    Errno(errno)
}

/// Adds the operation and path to an `io::Result`.
pub(crate) trait IoContext<T> {
    /// Maps the error with [`Error::io`].
    fn ctx(self, op: &'static str, path: impl AsRef<Path>) -> Result<T>;
}

impl<T> IoContext<T> for io::Result<T> {
    fn ctx(self, op: &'static str, path: impl AsRef<Path>) -> Result<T> {
        self.map_err(|e| Error::io(op, path, e))
    }
}

/// The text of a panic's payload (`panic!` with a literal or a formatted
/// message), for the errors that report a caught panic. Public but hidden
/// for the C ABI crate (kspeed-capi), which reports panics the same way.
#[doc(hidden)]
pub fn panic_text(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The three variants the Python binding's wildcard used to turn into
    /// kind "Other" have their own kind and class, shared by the C ABI and
    /// Python (the exhaustive match maps every other variant: a new one
    /// does not compile until it is given both).
    #[test]
    fn every_variant_has_its_own_kind_and_class() {
        let cases = [
            (
                Error::NotRegularFile {
                    path: "/src/a/fifo".into(),
                    what: "a FIFO",
                },
                "NotRegularFile",
                ErrorClass::Data,
            ),
            (
                Error::SymlinkOutsideSource {
                    path: "/src/a/l".into(),
                    target: "/etc/passwd".into(),
                },
                "SymlinkOutsideSource",
                ErrorClass::Data,
            ),
            (
                Error::CatalogOfAnotherSource {
                    catalog: "/c.ksc".into(),
                    catalog_source: "/a".into(),
                    given: "/b".into(),
                },
                "CatalogOfAnotherSource",
                ErrorClass::Data,
            ),
            (
                Error::Memlock {
                    needed: 1,
                    limit: 0,
                    errno: libc::ENOMEM,
                },
                "Memlock",
                ErrorClass::Resource,
            ),
            (Error::Serve("bind".into()), "Serve", ErrorClass::Service),
            (
                Error::NotLockStep("rank 1: step 3".into()),
                "NotLockStep",
                ErrorClass::Config,
            ),
            (
                Error::AuditMismatch("epoch 0".into()),
                "AuditMismatch",
                ErrorClass::Data,
            ),
            // The node agent missing or gone is the network's (C
            // KSP_ERR_NETWORK), as a node that refused or died.
            (
                Error::NoAgent {
                    socket: "/run/kspeed/agent.sock".into(),
                    reason: "connect: ENOENT".into(),
                },
                "NoAgent",
                ErrorClass::Network,
            ),
            (
                Error::UnknownBatch { seq: 9, last: 3 },
                "UnknownBatch",
                ErrorClass::Config,
            ),
        ];
        for (e, name, class) in cases {
            assert_eq!(e.kind_name(), name, "{e}");
            assert_eq!(e.class(), class, "{e}");
        }
        // A loader that failed keeps its first error's class; its own kind
        // is LoaderFailed, the first error's is root()'s.
        let failed = Error::LoaderFailed(Box::new(Error::SampleCorrupt {
            sample: 3,
            path: "/x".into(),
            expected: 1,
            computed: 2,
        }));
        assert_eq!(failed.kind_name(), "LoaderFailed");
        assert_eq!(failed.class(), ErrorClass::Data);
        assert_eq!(failed.root().kind_name(), "SampleCorrupt");
        assert_eq!(
            Error::DiskFull {
                path: "/x".into(),
                needed: 1,
                available: 0
            }
            .os_errno(),
            Some(libc::ENOSPC)
        );
    }

    /// Every errno keeps its number, and gets the C library's description:
    /// the old table knew 26 names and printed a bare "errno" for the rest.
    #[test]
    fn errno_messages_keep_the_number_and_describe_it() {
        assert_eq!(
            errno_name(libc::EIO).to_string(),
            "errno 5 (Input/output error)"
        );
        let ehwpoison = errno_name(libc::EHWPOISON).to_string();
        assert!(
            ehwpoison.starts_with(&format!("errno {} (", libc::EHWPOISON))
                && ehwpoison.len() > "errno 133 ()".len(),
            "{ehwpoison}"
        );
        assert!(errno_name(4000).to_string().starts_with("errno 4000 ("));
    }
}
