//! `kspeed._kspeed`: the extension module under the `kspeed` Python package.
//!
//! The Python layer (`python/kspeed/`) validates arguments and reads the
//! launcher's environment; this module owns the loader and every view of
//! the landing ring that Python can see.
//!
//! Lifetime rule (DESIGN.md: "no caller-visible view outlives its bytes"):
//! - every view of a batch (the per-sample and whole-batch numpy arrays, the
//!   memoryviews over them, DLPack capsules and the tensors made from them)
//!   holds a strong reference to its [`Batch`], and the batch holds the
//!   loader's [`Shared`] state, so neither the ring nor the loader can go
//!   while a view exists (nor the memory tier, which the Rust loader owns:
//!   with `tier_views`, per-sample views point into it);
//! - a batch's ring space goes back to the loader only when the batch is no
//!   longer referenced, or on `release()` (refused while views are alive);
//!   releases reach the Rust loader in batch order
//!   ([`kspeed::loader::Loader::release_oldest_batch`]), so releasing one
//!   batch never frees another's bytes;
//! - operations that restart the pollers (an out-of-order `set_epoch`,
//!   `load_state_dict`, `close`) are refused while any batch has live views,
//!   and invalidate batches without views (their methods then raise).
//!
//! Why this file is over ~800 lines: every Python class of the extension is
//! here; splitting it one file per class is part of issue 27.

mod dlpack;
mod errors;
mod launcher;
mod objects;

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use pyo3::exceptions::{PyIndexError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyTuple};

use kspeed::landing::{CudaMode, LandingOptions};
use kspeed::loader::{Loader as RustLoader, LoaderBuilder};

use errors::{Fail, Raise};
use objects::{int64_array, Owned};

/// Per-batch flags shared by the batch, its views and the loader's list of
/// batches out.
pub(crate) struct BatchFlags {
    /// Views alive (numpy arrays' owners, DLPack capsules and tensors).
    pub(crate) exports: AtomicUsize,
    /// The batch's bytes may no longer be read (released, or the loader
    /// restarted or closed).
    pub(crate) invalid: AtomicBool,
    /// Python is done with the batch: its ring space may go back.
    pub(crate) done: AtomicBool,
}

/// A batch out of the Rust loader and not yet released there.
struct OutBatch {
    flags: Arc<BatchFlags>,
}

struct Core {
    /// `None` once closed (and every batch with views is gone).
    loader: Option<RustLoader>,
    /// Batches out, oldest first (mirrors the Rust loader's kept batches).
    out: VecDeque<OutBatch>,
    /// Closed by the caller: no more batches; the Rust loader is dropped
    /// once no batch out has views.
    closed: bool,
    /// Batches Python may hold at once.
    max_out: usize,
    /// The CUDA device of a GPU ring.
    gpu_ordinal: Option<i32>,
}

impl Core {
    /// Returns, oldest first, the ring space of batches Python is done with.
    fn reap(&mut self) {
        while self
            .out
            .front()
            .is_some_and(|b| b.flags.done.load(Ordering::Acquire))
        {
            self.out.pop_front();
            if let Some(l) = self.loader.as_mut() {
                l.release_oldest_batch();
            }
        }
        if self.closed && self.out.is_empty() {
            self.loader = None;
        }
    }

    /// No more batches: batches without views become invalid, and the Rust
    /// loader goes once none is out (returned so the caller picks where it
    /// is dropped). Call with the GIL held (views are made under it).
    fn close(&mut self) -> Option<RustLoader> {
        self.closed = true;
        for b in &self.out {
            if b.flags.exports.load(Ordering::Acquire) == 0 {
                b.flags.invalid.store(true, Ordering::Release);
                b.flags.done.store(true, Ordering::Release);
            }
        }
        self.reap();
        if self.out.is_empty() {
            self.loader.take()
        } else {
            None
        }
    }

    fn loader(&mut self) -> Result<&mut RustLoader, Fail> {
        if self.closed {
            return Err(Fail::named("LoaderClosedError", "the loader is closed"));
        }
        self.loader
            .as_mut()
            .ok_or_else(|| Fail::named("LoaderClosedError", "the loader is closed"))
    }

    /// Before an operation that returns every batch's ring space: refuses
    /// when a batch has live views, else invalidates the batches out. Call
    /// with the GIL held, so that no view appears between check and
    /// invalidation.
    fn drop_out_batches(&mut self, what: &str) -> Result<(), Fail> {
        let live: usize = self
            .out
            .iter()
            .filter(|b| b.flags.exports.load(Ordering::Acquire) > 0)
            .count();
        if live > 0 {
            return Err(Fail::named(
                "BatchInUseError",
                format!(
                    "{what} would free the bytes of {live} batch(es) that still have views \
                     (numpy arrays, memoryviews, DLPack capsules or tensors); drop or copy them first"
                ),
            ));
        }
        for b in self.out.drain(..) {
            b.flags.invalid.store(true, Ordering::Release);
            b.flags.done.store(true, Ordering::Release);
        }
        if let Some(l) = self.loader.as_mut() {
            // Returns the Rust loader's kept batches (none of them is
            // referenced by a view any more).
            l.release_batch();
        }
        Ok(())
    }
}

/// State shared by the Python loader, its batches and the acquiring thread.
pub(crate) struct Shared {
    core: Mutex<Core>,
    /// The process that built the loader. A forked child has a copy of this
    /// memory but none of the threads: it must neither use nor free the
    /// loader (freeing would join pollers that do not exist there).
    pid: u32,
}

impl Shared {
    /// Whether this is a forked child of the process that built the loader.
    pub(crate) fn in_child(&self) -> bool {
        std::process::id() != self.pid
    }

    /// In a forked child: keeps the state from ever being freed here.
    pub(crate) fn leak_in_child(self: &Arc<Self>) {
        std::mem::forget(self.clone());
    }

    fn lock(&self) -> MutexGuard<'_, Core> {
        self.core.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Marks a batch done and returns ring space if the core is free now
    /// (otherwise the acquiring thread does it before its next batch).
    pub(crate) fn batch_done(self: &Arc<Self>, flags: &BatchFlags) {
        flags.done.store(true, Ordering::Release);
        if self.in_child() {
            self.leak_in_child();
            return;
        }
        if let Ok(mut core) = self.core.try_lock() {
            core.reap();
        }
    }
}

/// One batch as the acquiring thread hands it over.
struct BatchData {
    epoch: u64,
    first_index: u64,
    ids: Vec<i64>,
    labels: Vec<i64>,
    /// Address of each sample (host or device): in the landing ring, or in
    /// the memory tier (`tier_views`).
    addrs: Vec<u64>,
    lens: Vec<u64>,
    /// Whether each sample is a view into the memory tier (`tier_views`),
    /// which is never rewritten: its DLPack export is a copy (consumers such
    /// as PyTorch ignore DLPack's read-only flag).
    in_tier: Vec<bool>,
    /// Every sample is in the landing ring, so `span`/`wrap` hold the whole
    /// batch. False when `tier_views` handed out some samples in place in
    /// the memory tier: then the batch is no span of anything, and `span`
    /// and `wrap` are unset.
    in_ring: bool,
    /// The batch's span(s) as (address, bytes), when `in_ring`.
    span: (u64, u64),
    wrap: Option<(u64, u64)>,
    /// CUDA device of a GPU ring.
    device: Option<i32>,
    flags: Arc<BatchFlags>,
}

enum Reply {
    Batch(Box<BatchData>),
    EndOfEpoch,
    InUse(String),
    Failed(kspeed::Error),
    Closed,
}

/// The acquiring thread: takes batches from the Rust loader so that the
/// Python thread can wait for them in slices and answer Ctrl-C.
fn acquirer(shared: Arc<Shared>, rx: mpsc::Receiver<()>, tx: mpsc::Sender<Reply>) {
    while rx.recv().is_ok() {
        let reply = {
            let mut core = shared.lock();
            core.reap();
            acquire_one(&mut core)
        };
        if tx.send(reply).is_err() {
            break;
        }
    }
    // The Python loader is gone (its drop may not have had the lock, if this
    // thread was waiting for data then): closed, so the Rust loader goes as
    // soon as no batch is out. Batches still referenced are left alone: this
    // thread has no GIL, and a Python thread may be making a view of one.
    let mut core = shared.lock();
    core.closed = true;
    core.reap();
}

fn acquire_one(core: &mut Core) -> Reply {
    if core.closed || core.loader.is_none() {
        return Reply::Closed;
    }
    let held = core
        .out
        .iter()
        .filter(|b| !b.flags.done.load(Ordering::Acquire))
        .count();
    if held >= core.max_out {
        return Reply::InUse(format!(
            "{held} batch(es) are still referenced (batches_in_flight={}) and those with views \
             cannot be reclaimed: drop the views (numpy arrays, memoryviews, tensors) or copy what \
             you keep before asking for the next batch",
            core.max_out
        ));
    }
    let out_before = core.out.len();
    let gpu = core.gpu_ordinal;
    let loader = core.loader.as_mut().expect("checked");
    let n = match loader.acquire_batch_keep() {
        Ok(0) => return Reply::EndOfEpoch,
        Ok(n) => n,
        Err(kspeed::Error::InvalidConfig(msg)) if out_before > 0 => {
            return Reply::InUse(format!(
            "{msg} ({out_before} batch(es) still referenced; those with views cannot be reclaimed)"
        ))
        }
        Err(e) => return Reply::Failed(e),
    };
    let mut d = BatchData {
        epoch: 0,
        first_index: 0,
        ids: Vec::with_capacity(n),
        labels: Vec::with_capacity(n),
        addrs: Vec::with_capacity(n),
        lens: Vec::with_capacity(n),
        in_tier: Vec::with_capacity(n),
        in_ring: true,
        span: (0, 0),
        wrap: None,
        device: None,
        flags: Arc::new(BatchFlags {
            exports: AtomicUsize::new(0),
            invalid: AtomicBool::new(false),
            done: AtomicBool::new(false),
        }),
    };
    let dev = loader.landing_device().and(gpu);
    d.in_ring = loader.held_in_ring();
    // The Rust builder refuses a memory tier with a GPU ring.
    debug_assert!(dev.is_none() || d.in_ring, "tier samples in a GPU ring");
    for i in 0..n {
        let (id, label, addr, len, pos, in_tier) = if dev.is_some() {
            let s = loader.held_device_sample(i);
            (s.id, s.label, s.addr, s.len as u64, s.position, false)
        } else {
            let s = loader.held_sample(i);
            (
                s.id,
                s.label,
                s.bytes.as_ptr() as u64,
                s.bytes.len() as u64,
                s.position,
                s.in_tier,
            )
        };
        if i == 0 {
            d.epoch = pos.epoch;
            d.first_index = pos.index;
        }
        d.ids.push(id as i64);
        d.labels.push(label.map_or(-1, |l| l as i64));
        d.addrs.push(addr);
        d.lens.push(len);
        d.in_tier.push(in_tier);
    }
    if dev.is_some() {
        let (a, b) = loader.held_device_spans();
        d.span = (a.0, a.1 as u64);
        d.wrap = b.map(|(p, l)| (p, l as u64));
    } else if d.in_ring {
        let (a, b) = loader.held_spans();
        d.span = (a.as_ptr() as u64, a.len() as u64);
        d.wrap = b.map(|s| (s.as_ptr() as u64, s.len() as u64));
    }
    d.device = dev;
    core.out.push_back(OutBatch {
        flags: d.flags.clone(),
    });
    Reply::Batch(Box::new(d))
}

/// The Python thread's end of the acquiring thread.
struct Requester {
    tx: mpsc::Sender<()>,
    rx: mpsc::Receiver<Reply>,
    /// A request was sent and its reply not yet taken (a wait interrupted by
    /// Ctrl-C leaves it for the next call, so no batch is lost).
    outstanding: bool,
    /// A reply taken by [`PyLoader::settle`] for the next call.
    stash: Option<Reply>,
}

/// The loader behind `kspeed.Loader` (which validates the arguments).
#[pyclass(module = "kspeed._kspeed", name = "_Loader", frozen)]
struct PyLoader {
    shared: Arc<Shared>,
    req: Mutex<Requester>,
    batch_size: usize,
    epoch_len: u64,
    rank: u32,
    world: u32,
    seed: u64,
    catalog_len: u64,
    catalog_identity: u32,
}

fn get<'py, T: pyo3::conversion::FromPyObjectOwned<'py>>(
    cfg: &Bound<'py, PyDict>,
    key: &str,
) -> PyResult<Option<T>> {
    match cfg.get_item(key)? {
        None => Ok(None),
        Some(v) if v.is_none() => Ok(None),
        Some(v) => v.extract::<T>().map(Some).map_err(|e| {
            let e: PyErr = e.into();
            PyTypeError::new_err(format!("argument {key}: {e}"))
        }),
    }
}

fn builder_from(cfg: &Bound<'_, PyDict>) -> PyResult<(LoaderBuilder, usize)> {
    let py = cfg.py();
    let mut b = LoaderBuilder::empty();
    match (get::<String>(cfg, "space")?, get::<String>(cfg, "source")?) {
        (Some(s), None) => b = b.set_space(s),
        (None, Some(s)) => b = b.set_source(&s),
        _ => {
            return Err(PyValueError::new_err(
                "give exactly one of space= (a preloaded space) or source= (files read directly)",
            ))
        }
    }
    if let Some(c) = get::<String>(cfg, "catalog")? {
        b = b.catalog(c);
    }
    if let Some(n) = get::<usize>(cfg, "batch_size")? {
        b = b.batch_size(n);
    }
    if let Some(s) = get::<u64>(cfg, "seed")? {
        b = b.seed(s);
    }
    if let Some(s) = get::<bool>(cfg, "shuffle")? {
        b = b.shuffle(s);
    }
    if let Some(d) = get::<bool>(cfg, "drop_last")? {
        b = b.drop_last(d);
    }
    let rank = get::<u32>(cfg, "rank")?.unwrap_or(0);
    let world = get::<u32>(cfg, "world")?.unwrap_or(1);
    b = b.rank(rank, world);
    let mut landing = LandingOptions::default();
    if let Some(r) = get::<u64>(cfg, "ring_bytes")? {
        landing.ring_bytes = r;
    }
    if let Some(h) = get::<bool>(cfg, "huge_pages")? {
        landing.huge_pages = h;
    }
    if let Some(m) = get::<bool>(cfg, "mlock")? {
        landing.mlock = m;
    }
    landing.numa_node = get::<u32>(cfg, "numa_node")?;
    landing.gpu_pci = get::<String>(cfg, "gpu_pci")?;
    if let Some(c) = get::<String>(cfg, "cuda")? {
        landing.cuda = match c.as_str() {
            "auto" => CudaMode::Auto,
            "off" => CudaMode::Off,
            "require" => CudaMode::Require,
            other => {
                return Err(PyValueError::new_err(format!(
                    "cuda must be 'auto', 'off' or 'require', not {other:?}"
                )))
            }
        };
    }
    b = b.landing(landing);
    if let Some(n) = get::<usize>(cfg, "pollers")? {
        b = b.pollers(n);
    }
    if let Some(n) = get::<u32>(cfg, "queue_depth")? {
        b = b.queue_depth(n);
    }
    if let Some(n) = get::<u32>(cfg, "submit_batch")? {
        b = b.submit_batch(n);
    }
    if let Some(n) = get::<u64>(cfg, "max_read_bytes")? {
        b = b.max_read_bytes(n);
    }
    if let Some(n) = get::<u64>(cfg, "lookahead")? {
        b = b.lookahead(n);
    }
    if let Some(us) = get::<u64>(cfg, "spin_us")? {
        b = b.spin(Duration::from_micros(us));
    }
    if let Some(ms) = get::<u32>(cfg, "sqpoll_idle_ms")? {
        b = b.sqpoll(Some(ms));
    }
    if let Some(p) = get::<bool>(cfg, "pin")? {
        b = b.pin(p);
    }
    match (
        get::<u32>(cfg, "local_rank")?,
        get::<u32>(cfg, "local_world_size")?,
    ) {
        (Some(r), Some(n)) => b = b.local_rank(r, n),
        (None, None) => {}
        _ => {
            return Err(PyValueError::new_err(
                "give both local_rank and local_world_size, or neither",
            ))
        }
    }
    if let Some(n) = get::<u32>(cfg, "poller_numa_node")? {
        b = b.poller_numa_node(Some(n));
    }
    if let Some(dir) = get::<String>(cfg, "sysfs_root")? {
        b = b.sysfs_root(dir);
    }
    if let Some(p) = get::<bool>(cfg, "registered_buffers")? {
        b = b.registered_buffers(p);
    }
    if let Some(p) = get::<bool>(cfg, "registered_files")? {
        b = b.registered_files(p);
    }
    if let Some(p) = get::<bool>(cfg, "verify_crc32c")? {
        b = b.verify_crc32c(p);
    }
    if let Some(t) = get::<u64>(cfg, "tier_bytes")? {
        b = b.tier_bytes(t);
    }
    let tier_views = get::<bool>(cfg, "tier_views")?.unwrap_or(false);
    b = b.tier_views(tier_views);
    if let Some(g) = get::<u32>(cfg, "gpu_ring")? {
        if tier_views {
            // The Rust builder refuses a memory tier with a GPU ring, and
            // without a tier tier_views does nothing: say so.
            return Err(PyValueError::new_err(format!(
                "tier_views=True needs a memory tier in host memory, and a GPU ring \
                 (gpu_ring={g}) has no memory tier: leave tier_views off"
            )));
        }
        b = b.gpu_ring(Some(g));
    }
    if let Some(f) = get::<(u64, u32, u32, u32)>(cfg, "fault_injection")? {
        b = b.fault_injection(
            kspeed::loader::FaultConfig::default()
                .seed(f.0)
                .eio_ppm(f.1)
                .short_ppm(f.2)
                .delay_ppm(f.3),
        );
    }
    if let Some(file) = get::<String>(cfg, "cluster_file")? {
        b = b.cluster(kspeed::transport::Cluster::from_file(file.as_ref()).raise(py)?);
    }
    if get::<bool>(cfg, "cluster_env")?.unwrap_or(false) {
        // KSPEED_NODES / MASTER_ADDR; the rank and world come from the
        // Python layer, which reads the same torchrun variables.
        let (c, _) = kspeed::transport::Cluster::from_env().raise(py)?;
        b = b.cluster(c);
    }
    if let Some(nodes) = get::<Vec<String>>(cfg, "cluster_nodes")? {
        let text: String = nodes
            .iter()
            .enumerate()
            .map(|(i, a)| format!("{i} {a}\n"))
            .collect();
        b = b.cluster(kspeed::transport::Cluster::parse(&text, "the cluster argument").raise(py)?);
    }
    if let Some(t) = get::<Vec<u8>>(cfg, "token")? {
        b = b.token(&t);
    }
    if let Some(s) = get::<f64>(cfg, "node_timeout")? {
        b = b.node_timeout(Duration::from_secs_f64(s));
    }
    if let Some(r) = get::<(Option<String>, u8, Option<u8>)>(cfg, "rdma")? {
        b = b.rdma(Some(
            kspeed::transport::RdmaOptions::default()
                .device(r.0)
                .port(r.1)
                .gid_index(r.2),
        ));
    }
    if let Some(n) = get::<u32>(cfg, "local_node")? {
        b = b.local_node(Some(n));
    }
    if let Some((e, i)) = get::<(u64, u64)>(cfg, "start")? {
        b = b.start_at(kspeed::sampler::Position { epoch: e, index: i });
    }
    if let Some(end) = get::<u64>(cfg, "end_epoch")? {
        b = b.end_epoch(Some(end));
    }
    let max_out = get::<usize>(cfg, "batches_in_flight")?.unwrap_or(2).max(1);
    Ok((b, max_out))
}

impl PyLoader {
    /// Asks the acquiring thread for the next batch (unless a request is
    /// still outstanding) and waits for its reply in 50 ms slices with the
    /// GIL released, checking for signals (Ctrl-C) between slices.
    fn wait_reply(&self, py: Python<'_>) -> PyResult<Reply> {
        loop {
            let got = py.detach(|| {
                let mut r = self.req.lock().unwrap_or_else(|e| e.into_inner());
                if let Some(rep) = r.stash.take() {
                    return Some(rep);
                }
                if !r.outstanding {
                    if r.tx.send(()).is_err() {
                        return Some(Reply::Closed);
                    }
                    r.outstanding = true;
                }
                match r.rx.recv_timeout(Duration::from_millis(50)) {
                    Ok(rep) => {
                        r.outstanding = false;
                        Some(rep)
                    }
                    Err(mpsc::RecvTimeoutError::Timeout) => None,
                    Err(mpsc::RecvTimeoutError::Disconnected) => {
                        r.outstanding = false;
                        Some(Reply::Closed)
                    }
                }
            });
            match got {
                Some(rep) => {
                    // A signal that came during the wait (the futex wait
                    // resumes after it, so the reply can come in the same
                    // slice) is answered here, the reply kept for the next
                    // call: returned with a signal pending, the batch would
                    // be dropped by the interpreter's check right after this
                    // call (its KeyboardInterrupt replaces the result).
                    if let Err(e) = py.check_signals() {
                        self.req.lock().unwrap_or_else(|e| e.into_inner()).stash = Some(rep);
                        return Err(e);
                    }
                    return Ok(rep);
                }
                None => py.check_signals()?,
            }
        }
    }

    /// Waits (answering Ctrl-C) for the reply to a request a Ctrl-C left
    /// outstanding and keeps it for the next call; with `discard`, drops it
    /// instead (before a restart: its batch belongs to the old position and
    /// no Python object holds it).
    fn settle(&self, py: Python<'_>, discard: bool) -> PyResult<()> {
        loop {
            let done = py.detach(|| {
                let mut r = self.req.lock().unwrap_or_else(|e| e.into_inner());
                if r.outstanding {
                    match r.rx.recv_timeout(Duration::from_millis(50)) {
                        Ok(rep) => {
                            r.outstanding = false;
                            r.stash = Some(rep);
                        }
                        Err(mpsc::RecvTimeoutError::Timeout) => return false,
                        Err(mpsc::RecvTimeoutError::Disconnected) => r.outstanding = false,
                    }
                }
                if discard {
                    if let Some(Reply::Batch(d)) = r.stash.take() {
                        d.flags.invalid.store(true, Ordering::Release);
                        d.flags.done.store(true, Ordering::Release);
                    }
                }
                true
            });
            if done {
                return Ok(());
            }
            py.check_signals()?;
        }
    }

    /// Invalidates the oldest batch out that has no views and is not done,
    /// and returns its ring space if it can go now. Runs with the GIL held:
    /// views are made and dropped only under the GIL, so none can appear
    /// between the check and the invalidation.
    fn reclaim_one(&self) -> bool {
        let mut core = self.shared.lock();
        let victim = core.out.iter().find(|b| {
            !b.flags.done.load(Ordering::Acquire) && b.flags.exports.load(Ordering::Acquire) == 0
        });
        match victim {
            Some(b) => {
                b.flags.invalid.store(true, Ordering::Release);
                b.flags.done.store(true, Ordering::Release);
                core.reap();
                true
            }
            None => false,
        }
    }
}

#[pymethods]
impl PyLoader {
    #[new]
    fn new(py: Python<'_>, cfg: &Bound<'_, PyDict>) -> PyResult<Self> {
        let (builder, max_out) = builder_from(cfg)?;
        let (rank, world) = builder.rank_world();
        let seed = get::<u64>(cfg, "seed")?.unwrap_or(0);
        let loader = py.detach(|| builder.build()).raise(py)?;
        let batch_size = loader.batch_size();
        let epoch_len = loader.epoch_len();
        let catalog_len = loader.catalog().len();
        let catalog_identity = loader.catalog().identity();
        let shared = Arc::new(Shared {
            pid: std::process::id(),
            core: Mutex::new(Core {
                loader: Some(loader),
                out: VecDeque::new(),
                closed: false,
                max_out,
                gpu_ordinal: get::<u32>(cfg, "gpu_ring")?.map(|g| g as i32),
            }),
        });
        let (tx, rx_req) = mpsc::channel();
        let (tx_reply, rx) = mpsc::channel();
        let sh = shared.clone();
        std::thread::Builder::new()
            .name("kspeed-py-acquire".into())
            .spawn(move || acquirer(sh, rx_req, tx_reply))
            .map_err(|e| {
                Fail::named("IoError", format!("cannot start a thread: {e}")).into_py(py)
            })?;
        Ok(PyLoader {
            shared,
            req: Mutex::new(Requester {
                tx,
                rx,
                outstanding: false,
                stash: None,
            }),
            batch_size,
            epoch_len,
            rank,
            world,
            seed,
            catalog_len,
            catalog_identity,
        })
    }

    /// The next batch of the current epoch, or None at its end. Waits with
    /// the GIL released; Ctrl-C interrupts the wait (the batch is not lost:
    /// the next call returns it).
    ///
    /// When the ring or `batches_in_flight` has no room for it, batches
    /// without views are reclaimed, oldest first (their byte methods then
    /// raise BatchReleasedError); batches with views are never touched, and
    /// if they alone leave no room, BatchInUseError is raised.
    fn next_batch(slf: Bound<'_, Self>) -> PyResult<Option<Py<Batch>>> {
        let py = slf.py();
        let this = slf.get();
        loop {
            let reply = this.wait_reply(py)?;
            return match reply {
                Reply::EndOfEpoch => Ok(None),
                Reply::Closed => {
                    Err(Fail::named("LoaderClosedError", "the loader is closed").into_py(py))
                }
                Reply::InUse(msg) => {
                    if this.reclaim_one() {
                        continue;
                    }
                    Err(Fail::named("BatchInUseError", msg).into_py(py))
                }
                Reply::Failed(e) => Err(Fail::from_kspeed(e).into_py(py)),
                Reply::Batch(d) => {
                    let batch = Batch::new(this.shared.clone(), *d);
                    Ok(Some(Py::new(py, batch)?))
                }
            };
        }
    }

    /// Moves to `epoch`. Batches out stay valid when the pipeline goes on
    /// (the next epoch after finishing one); a restart needs every batch's
    /// views gone.
    fn set_epoch(&self, py: Python<'_>, epoch: u64) -> PyResult<()> {
        self.settle(py, false)?;
        // With the GIL held throughout: no other Python thread can make a
        // view between the check for views and the restart that reuses
        // the ring (a restart is rare and short: the pollers stop and start).
        (|| {
            let mut core = self.shared.lock();
            core.reap();
            let continues = core.loader()?.epoch_continues(epoch);
            if !continues {
                let mut r = self.req.lock().unwrap_or_else(|e| e.into_inner());
                if let Some(Reply::Batch(d)) = r.stash.take() {
                    d.flags.invalid.store(true, Ordering::Release);
                    d.flags.done.store(true, Ordering::Release);
                }
                drop(r);
                core.drop_out_batches(&format!("set_epoch({epoch}) (a restart)"))?;
            }
            core.loader()?.set_epoch(epoch).map_err(Fail::from_kspeed)
        })()
        .raise(py)
    }

    /// (epoch, index) of the next sample to be delivered.
    fn position(&self, py: Python<'_>) -> PyResult<(u64, u64)> {
        py.detach(|| {
            let mut core = self.shared.lock();
            let p = core.loader()?.position();
            Ok::<_, Fail>((p.epoch, p.index))
        })
        .raise(py)
    }

    /// The position, serialized (the Rust loader's checkpoint bytes).
    fn save_position<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let b = py
            .detach(|| {
                let mut core = self.shared.lock();
                Ok::<_, Fail>(core.loader()?.save_position())
            })
            .raise(py)?;
        Ok(PyBytes::new(py, &b))
    }

    /// Continues from bytes of `save_position` (a restart).
    fn restore_position(&self, py: Python<'_>, bytes: Vec<u8>) -> PyResult<()> {
        self.settle(py, true)?;
        // With the GIL held throughout, as in set_epoch.
        (|| {
            let mut core = self.shared.lock();
            core.reap();
            core.loader()?;
            core.drop_out_batches("load_state_dict")?;
            core.loader()?
                .restore_position(&bytes)
                .map_err(Fail::from_kspeed)
        })()
        .raise(py)
    }

    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let (st, placement) = py
            .detach(|| {
                let mut core = self.shared.lock();
                let l = core.loader()?;
                Ok::<_, Fail>((l.stats(), l.placement().clone()))
            })
            .raise(py)?;
        let d = PyDict::new(py);
        d.set_item("samples", st.samples)?;
        d.set_item("bytes", st.bytes)?;
        d.set_item("elapsed_s", st.elapsed.as_secs_f64())?;
        d.set_item("stall_s", st.stall.as_secs_f64())?;
        d.set_item("samples_per_s", st.samples_per_sec())?;
        d.set_item("bytes_per_s", st.bytes_per_sec())?;
        d.set_item("stall_fraction", st.stall_fraction())?;
        d.set_item("disk_reads", st.disk_reads)?;
        d.set_item("tier_hits", st.tier_hits)?;
        d.set_item("retries", st.retries)?;
        let lat = PyDict::new(py);
        lat.set_item("count", st.read_latency.count)?;
        lat.set_item("p50_us", st.read_latency.p50_us)?;
        lat.set_item("p90_us", st.read_latency.p90_us)?;
        lat.set_item("p99_us", st.read_latency.p99_us)?;
        lat.set_item("p999_us", st.read_latency.p999_us)?;
        lat.set_item("max_us", st.read_latency.max_us)?;
        d.set_item("read_latency", lat)?;
        d.set_item("remote_samples", st.remote_samples)?;
        d.set_item("failovers", st.failovers)?;
        d.set_item("source_reads", st.source_reads)?;
        d.set_item("read_ahead", st.read_ahead)?;
        d.set_item("read_ahead_discarded", st.read_ahead_discarded)?;
        // Where the pollers run (docs/LOCAL_PATH.md, "Placement on a node").
        let p = PyDict::new(py);
        p.set_item("local_rank", placement.plan.local.rank)?;
        p.set_item("local_world_size", placement.plan.local.size)?;
        p.set_item("local_rank_from", &placement.plan.local.origin)?;
        p.set_item("numa_node", placement.plan.numa_node)?;
        p.set_item("slice_cores", &placement.plan.slice)?;
        p.set_item("shared", placement.plan.shared)?;
        p.set_item("pollers", placement.pollers)?;
        p.set_item("pinned_cores", &placement.pinned)?;
        d.set_item("placement", p)?;
        Ok(d)
    }

    /// The catalog's per-sample arrays (see `kspeed.Catalog`).
    fn catalog_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let mut core = self.shared.lock();
        let cat = core.loader().raise(py)?.catalog();
        objects::catalog_dict(py, cat)
    }

    fn landing_info<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let mut core = self.shared.lock();
        let l = core.loader().raise(py)?;
        let info = l.landing_info().clone();
        let tier = l.tier();
        let d = PyDict::new(py);
        d.set_item("bytes", info.bytes)?;
        d.set_item("huge_pages", info.huge_pages)?;
        d.set_item("locked", info.locked)?;
        d.set_item("numa_node", info.numa_node)?;
        d.set_item("cuda", &info.cuda)?;
        d.set_item("tier_samples", tier.map(|t| t.0))?;
        d.set_item("tier_bytes", tier.map(|t| t.1))?;
        Ok(d)
    }

    /// Batches out of the Rust loader (referenced, or released but waiting
    /// for an older batch to go first).
    fn batches_out(&self, py: Python<'_>) -> usize {
        py.detach(|| self.shared.lock().out.len())
    }

    /// Closes the loader: invalidates batches without views and, once no
    /// batch has views, stops the pollers and frees the ring. Refuses
    /// nothing: batches with live views keep the ring until they go.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        if self.shared.in_child() {
            return Ok(());
        }
        // A wait left by Ctrl-C ends first (or this one is interrupted too).
        self.settle(py, true)?;
        // Batches are invalidated with the GIL held (no view can appear
        // meanwhile); the Rust loader is dropped without it (pollers joined).
        let dropped = self.shared.lock().close();
        py.detach(move || drop(dropped));
        Ok(())
    }

    #[getter]
    fn closed(&self, py: Python<'_>) -> bool {
        py.detach(|| self.shared.lock().closed)
    }

    #[getter]
    fn batch_size(&self) -> usize {
        self.batch_size
    }

    #[getter]
    fn epoch_len(&self) -> u64 {
        self.epoch_len
    }

    #[getter]
    fn rank(&self) -> u32 {
        self.rank
    }

    #[getter]
    fn world(&self) -> u32 {
        self.world
    }

    #[getter]
    fn seed(&self) -> u64 {
        self.seed
    }

    #[getter]
    fn catalog_len(&self) -> u64 {
        self.catalog_len
    }

    #[getter]
    fn catalog_identity(&self) -> u32 {
        self.catalog_identity
    }
}

impl Drop for PyLoader {
    fn drop(&mut self) {
        if self.shared.in_child() {
            self.shared.leak_in_child();
            return;
        }
        // The acquiring thread ends when its request channel closes (after
        // the request it may be serving) and closes the core then; close now
        // if the core is free, so the pollers stop at once. Batches still
        // referenced keep the Rust loader until they go.
        if let Ok(mut core) = self.shared.core.try_lock() {
            drop(core.close());
        }
    }
}

/// A batch: consecutive samples of the rank's sequence, in the landing ring
/// (or, with `tier_views`, some of them in place in the memory tier).
#[pyclass(module = "kspeed._kspeed", frozen)]
pub(crate) struct Batch {
    shared: Arc<Shared>,
    d: BatchData,
    /// Each sample's offset in `array()`.
    offsets: Vec<i64>,
    /// The whole batch made contiguous on its first whole-batch use, when it
    /// is not one span of the ring (host memory only): a batch that wrapped
    /// around the ring's end, or one with samples in the memory tier
    /// (samples packed back to back).
    copy: OnceLock<Box<[u8]>>,
}

impl Batch {
    fn new(shared: Arc<Shared>, d: BatchData) -> Batch {
        let offsets = if d.in_ring {
            let (s0, l0) = d.span;
            d.addrs
                .iter()
                .map(|&a| match d.wrap {
                    // The second span starts at the ring's start, below the
                    // first span's start.
                    Some((w0, _)) if a < s0 => (l0 + (a - w0)) as i64,
                    _ => (a - s0) as i64,
                })
                .collect()
        } else {
            // Packed back to back in the copy `whole()` makes.
            d.lens
                .iter()
                .scan(0u64, |at, &l| {
                    let o = *at;
                    *at += l;
                    Some(o as i64)
                })
                .collect()
        };
        Batch {
            shared,
            d,
            offsets,
            copy: OnceLock::new(),
        }
    }

    pub(crate) fn flags(&self) -> &Arc<BatchFlags> {
        &self.d.flags
    }

    fn check(&self, py: Python<'_>) -> PyResult<()> {
        if self.shared.in_child() {
            // The ring and the tier are MADV_DONTFORK: nothing of this batch
            // is mapped in a forked child (views made before the fork must
            // not be read there either, README "Fork").
            return Err(Fail::named(
                "LoaderError",
                format!(
                    "this batch's loader was built in process {}; a forked child (a DataLoader \
                     worker, multiprocessing) has none of its memory and must build its own loader",
                    self.shared.pid
                ),
            )
            .into_py(py));
        }
        if self.d.flags.invalid.load(Ordering::Acquire) {
            return Err(Fail::named(
                "BatchReleasedError",
                "this batch was released (release(), its context manager, set_epoch, \
                 load_state_dict or close): its bytes are gone",
            )
            .into_py(py));
        }
        Ok(())
    }

    fn index(&self, i: isize) -> PyResult<usize> {
        let n = self.d.ids.len() as isize;
        let j = if i < 0 { i + n } else { i };
        if j < 0 || j >= n {
            return Err(PyIndexError::new_err(format!(
                "sample index {i} out of range for a batch of {n}"
            )));
        }
        Ok(j as usize)
    }

    /// (address, bytes) of the whole batch as one contiguous range: its span
    /// of the ring, or, for a batch that is not one span, a copy made here
    /// on first use (a wrapped batch's two spans end to end; a batch with
    /// samples in the memory tier, its samples back to back). Call after
    /// [`Batch::check`], with the GIL still held.
    fn whole(&self) -> PyResult<(u64, u64)> {
        match (self.d.in_ring, self.d.wrap, self.d.device) {
            (true, None, _) => return Ok(self.d.span),
            (true, Some(_), Some(_)) => {
                return Err(PyValueError::new_err(
                    "this batch wraps around the end of a GPU ring: take its samples one by one",
                ))
            }
            _ => {}
        }
        let c = self.copy.get_or_init(|| {
            let mut v = Vec::new();
            let mut append = |addr: u64, len: u64| {
                // SAFETY: (addr, len) is a span or a sample of this batch,
                // in host memory (GPU batches returned above): in the ring
                // or in the memory tier. The caller checked that the batch
                // is valid and holds the GIL, which release, reclaim,
                // restart and close need too, so the batch stays out (its
                // ring bytes stay put) and the Rust loader, which owns the
                // ring and the tier, stays alive (`shared`); tier members
                // are never written again.
                v.extend_from_slice(unsafe {
                    std::slice::from_raw_parts(addr as *const u8, len as usize)
                });
            };
            match self.d.wrap {
                Some(wrap) if self.d.in_ring => {
                    append(self.d.span.0, self.d.span.1);
                    append(wrap.0, wrap.1);
                }
                _ => {
                    for (&a, &l) in self.d.addrs.iter().zip(&self.d.lens) {
                        append(a, l);
                    }
                }
            }
            v.into_boxed_slice()
        });
        Ok((c.as_ptr() as u64, c.len() as u64))
    }

    fn host_only(&self) -> PyResult<()> {
        if let Some(dev) = self.d.device {
            return Err(PyValueError::new_err(format!(
                "the batch is in GPU memory (CUDA device {dev}): use __dlpack__ \
                 (torch.from_dlpack) instead of numpy views"
            )));
        }
        Ok(())
    }
}

impl Drop for Batch {
    fn drop(&mut self) {
        // Views hold the batch, so none is alive now.
        self.d.flags.invalid.store(true, Ordering::Release);
        self.shared.batch_done(&self.d.flags);
    }
}

#[pymethods]
impl Batch {
    fn __len__(&self) -> usize {
        self.d.ids.len()
    }

    /// Sample ids (catalog indices), numpy int64.
    #[getter]
    fn ids<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        int64_array(py, self.d.ids.clone())
    }

    /// Labels, numpy int64 (-1 for a sample without one).
    #[getter]
    fn labels<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        int64_array(py, self.d.labels.clone())
    }

    /// Each sample's byte length, numpy int64.
    #[getter]
    fn lengths<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        int64_array(py, self.d.lens.iter().map(|&l| l as i64).collect())
    }

    /// Each sample's offset in `array()`, numpy int64 (alignment padding
    /// lies between samples in the ring; none in the copy made for a batch
    /// that is not `in_ring`).
    #[getter]
    fn offsets<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        int64_array(py, self.offsets.clone())
    }

    /// The epoch of the batch.
    #[getter]
    fn epoch(&self) -> u64 {
        self.d.epoch
    }

    /// The rank's step of the batch's first sample within its epoch.
    #[getter]
    fn first_index(&self) -> u64 {
        self.d.first_index
    }

    /// Whether `array()` is the ring itself (False: the batch wrapped around
    /// the ring's end or is not `in_ring`, and `array()` is a copy made on
    /// first use). Per-sample views are never copies.
    #[getter]
    fn is_zero_copy(&self) -> bool {
        self.d.in_ring && self.d.wrap.is_none()
    }

    /// Whether every sample is in the landing ring (so the batch is one
    /// span of it, two if it wraps). False only with `tier_views=True`, for
    /// a batch with samples served in place from the memory tier.
    #[getter]
    fn in_ring(&self) -> bool {
        self.d.in_ring
    }

    #[getter]
    fn released(&self) -> bool {
        self.d.flags.invalid.load(Ordering::Acquire)
    }

    /// Views alive (numpy arrays, memoryviews, DLPack capsules, tensors).
    #[getter]
    fn views(&self) -> usize {
        self.d.flags.exports.load(Ordering::Acquire)
    }

    /// Sample `i` as a numpy uint8 array over the ring, or over the memory
    /// tier for a sample served from it with `tier_views` (no copy).
    fn sample<'py>(slf: &Bound<'py, Self>, i: isize) -> PyResult<Bound<'py, PyAny>> {
        let b = slf.get();
        b.check(slf.py())?;
        b.host_only()?;
        let j = b.index(i)?;
        objects::view_array(slf, b.d.addrs[j], b.d.lens[j])
    }

    fn __getitem__<'py>(slf: &Bound<'py, Self>, i: isize) -> PyResult<Bound<'py, PyAny>> {
        Self::sample(slf, i)
    }

    /// Every sample as a numpy uint8 array over the ring or the memory tier
    /// (no copy).
    fn samples<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyList>> {
        let b = slf.get();
        b.check(slf.py())?;
        b.host_only()?;
        let list = PyList::empty(slf.py());
        for j in 0..b.d.ids.len() {
            list.append(objects::view_array(slf, b.d.addrs[j], b.d.lens[j])?)?;
        }
        Ok(list)
    }

    /// Sample `i` as a memoryview (over the numpy view; no copy).
    fn memoryview<'py>(slf: &Bound<'py, Self>, i: isize) -> PyResult<Bound<'py, PyAny>> {
        let arr = Self::sample(slf, i)?;
        let mv = slf.py().import("builtins")?.getattr("memoryview")?;
        mv.call1((arr,))
    }

    /// The whole batch as one numpy uint8 array (the ring span from the first
    /// sample's start to the last one's end; for a batch that wrapped around
    /// the ring's end, its two spans end to end, and for one that is not
    /// `in_ring`, its samples back to back: one copy, made on first use and
    /// shared by later calls and `__dlpack__`). Sample `i` is
    /// `array()[offsets[i]:offsets[i] + lengths[i]]`.
    fn array<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        let b = slf.get();
        b.check(slf.py())?;
        b.host_only()?;
        let (addr, len) = b.whole()?;
        objects::view_array(slf, addr, len)
    }

    /// Sample `i`'s bytes, copied.
    fn tobytes<'py>(&self, py: Python<'py>, i: isize) -> PyResult<Bound<'py, PyBytes>> {
        self.check(py)?;
        self.host_only()?;
        let j = self.index(i)?;
        // SAFETY: the batch is valid (checked), so its bytes stay put while
        // this call holds the GIL (release and drop need it too).
        let s = unsafe {
            std::slice::from_raw_parts(self.d.addrs[j] as *const u8, self.d.lens[j] as usize)
        };
        Ok(PyBytes::new(py, s))
    }

    /// DLPack export of the whole batch (1-D uint8, see `array()`): a
    /// versioned capsule marked read-only for consumers that ask with
    /// `max_version >= (1, 0)` (numpy then gives a read-only array), else a
    /// legacy one; `copy=True`: a private copy (host batches).
    #[pyo3(signature = (*, stream=None, max_version=None, dl_device=None, copy=None))]
    fn __dlpack__<'py>(
        slf: &Bound<'py, Self>,
        stream: Option<Bound<'py, PyAny>>,
        max_version: Option<Bound<'py, PyAny>>,
        dl_device: Option<Bound<'py, PyAny>>,
        copy: Option<bool>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let _ = stream;
        let b = slf.get();
        b.check(slf.py())?;
        let how = dlpack::Export::from_args(max_version.as_ref(), copy)?;
        let (addr, len) = b.whole()?;
        dlpack::export(slf, addr, len, b.d.device, dl_device, how)
    }

    fn __dlpack_device__(&self) -> (i32, i32) {
        dlpack::device_tuple(self.d.device)
    }

    /// A DLPack capsule of sample `i` alone (for `torch.from_dlpack`): the
    /// ring bytes in place, or, for a sample in the memory tier
    /// (`tier_views`), a copy (PyTorch ignores DLPack's read-only flag, and
    /// the tier is served again every epoch). `max_version` as in
    /// `__dlpack__`.
    #[pyo3(signature = (i, *, max_version=None))]
    fn sample_dlpack<'py>(
        slf: &Bound<'py, Self>,
        i: isize,
        max_version: Option<Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let b = slf.get();
        b.check(slf.py())?;
        let j = b.index(i)?;
        let how = dlpack::Export::from_args(max_version.as_ref(), Some(b.d.in_tier[j]))?;
        dlpack::export(slf, b.d.addrs[j], b.d.lens[j], b.d.device, None, how)
    }

    /// Whether sample `i` is served in place from the memory tier
    /// (`tier_views`) rather than from the landing ring.
    fn sample_in_tier(&self, py: Python<'_>, i: isize) -> PyResult<bool> {
        self.check(py)?;
        Ok(self.d.in_tier[self.index(i)?])
    }

    /// Returns the batch's ring space now. Refused (BatchInUseError) while
    /// views of it are alive; afterwards every method raises.
    fn release(&self, py: Python<'_>) -> PyResult<()> {
        let n = self.d.flags.exports.load(Ordering::Acquire);
        if n > 0 {
            return Err(Fail::named(
                "BatchInUseError",
                format!(
                    "release(): {n} view(s) of this batch are alive (numpy arrays, memoryviews, \
                     DLPack capsules or tensors); drop them or copy what you keep first"
                ),
            )
            .into_py(py));
        }
        self.d.flags.invalid.store(true, Ordering::Release);
        self.shared.batch_done(&self.d.flags);
        Ok(())
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, PyTuple>) -> PyResult<bool> {
        self.release(py)?;
        Ok(false)
    }

    fn __repr__(&self) -> String {
        format!(
            "<kspeed.Batch epoch={} first_index={} samples={}{}>",
            self.d.epoch,
            self.d.first_index,
            self.d.ids.len(),
            if self.released() { " released" } else { "" }
        )
    }
}

/// Builds a catalog of a source (`kspeed catalog`): the scan and the
/// checksum pass through the crate, the file written with `file_mode`.
#[pyfunction]
#[pyo3(signature = (cfg))]
fn _catalog<'py>(py: Python<'py>, cfg: &Bound<'py, PyDict>) -> PyResult<Bound<'py, PyDict>> {
    use kspeed::dataset::{BuildOptions, ScanOptions, SourceSpec};
    use std::os::unix::fs::PermissionsExt;
    let source: String =
        get(cfg, "source")?.ok_or_else(|| PyValueError::new_err("source is required"))?;
    let out: String = get(cfg, "out")?.ok_or_else(|| PyValueError::new_err("out is required"))?;
    let spec = SourceSpec::parse(&source).raise(py)?;
    let mut scan = ScanOptions::default();
    scan.skip_special = get(cfg, "skip_special")?.unwrap_or(false);
    scan.follow_symlinks = get(cfg, "follow_symlinks")?.unwrap_or(false);
    scan.skip_bad_members = get(cfg, "skip_bad_members")?.unwrap_or(false);
    scan.members = get(cfg, "members")?.unwrap_or_default();
    let mut opts = BuildOptions::default().scan(scan);
    if let Some(t) = get(cfg, "threads")? {
        opts = opts.threads(t);
    }
    let mode: u32 = get(cfg, "file_mode")?.unwrap_or(0o600);
    let out_path = std::path::PathBuf::from(&out);
    let (cat, notes) = py
        .detach(|| {
            let (cat, notes) = kspeed::dataset::catalog::build_with_notes(&spec, &out_path, &opts)?;
            std::fs::set_permissions(&out_path, std::fs::Permissions::from_mode(mode))
                .map_err(|e| kspeed::Error::io("chmod", &out_path, e))?;
            Ok::<_, kspeed::Error>((cat, notes))
        })
        .raise(py)?;
    let d = PyDict::new(py);
    d.set_item("catalog", out)?;
    d.set_item("source", spec.to_source_string())?;
    d.set_item("samples", cat.len())?;
    d.set_item("bytes", cat.total_bytes())?;
    d.set_item("classes", cat.class_count())?;
    d.set_item("notes", notes.lines())?;
    Ok(d)
}

/// Preloads a source into a space (`kspeed preload`).
#[pyfunction]
#[pyo3(signature = (cfg))]
fn _preload<'py>(py: Python<'py>, cfg: &Bound<'py, PyDict>) -> PyResult<Bound<'py, PyDict>> {
    use kspeed::dataset::{Placement, PreloadOptions, SourceSpec};
    let space: String =
        get(cfg, "space")?.ok_or_else(|| PyValueError::new_err("space is required"))?;
    let mut o = PreloadOptions::default();
    if let Some(s) = get::<String>(cfg, "source")? {
        o.source = Some(SourceSpec::parse(&s).raise(py)?);
    }
    o.catalog = get::<String>(cfg, "catalog")?.map(Into::into);
    o.placement = Placement {
        nodes: get(cfg, "nodes")?.unwrap_or(1),
        replicas: get(cfg, "replicas")?.unwrap_or(1),
    };
    o.node_index = get(cfg, "node_index")?.unwrap_or(0);
    if let Some(a) = get(cfg, "align_bytes")? {
        o.align_bytes = a;
    }
    if let Some(a) = get(cfg, "extent_bytes")? {
        o.extent_bytes = a;
    }
    if let Some(t) = get(cfg, "threads")? {
        o.threads = t;
    }
    o.refresh = get(cfg, "refresh")?.unwrap_or(false);
    o.max_bytes_per_sec = get(cfg, "max_bytes_per_sec")?;
    let r = py
        .detach(|| kspeed::dataset::preload(space.as_ref(), &o))
        .raise(py)?;
    let d = PyDict::new(py);
    d.set_item("up_to_date", r.up_to_date)?;
    d.set_item("catalog_built", r.catalog_built)?;
    d.set_item("resumed_at", r.resumed_at)?;
    d.set_item("copied_samples", r.copied_samples)?;
    d.set_item("copied_bytes", r.copied_bytes)?;
    d.set_item("held_samples", r.held_samples)?;
    d.set_item("held_bytes", r.held_bytes)?;
    d.set_item("catalog_s", r.catalog_time.as_secs_f64())?;
    d.set_item("copy_s", r.copy_time.as_secs_f64())?;
    Ok(d)
}

/// Re-reads every sample of a space and checks its CRC32C (`kspeed verify`).
#[pyfunction]
fn _verify<'py>(py: Python<'py>, space: String, threads: usize) -> PyResult<Bound<'py, PyDict>> {
    let r = py
        .detach(|| {
            let s = kspeed::dataset::Space::open(space.as_ref())?;
            s.verify(threads, kspeed::progress::ProgressMode::Quiet)
        })
        .raise(py)?;
    let d = PyDict::new(py);
    d.set_item("checked", r.checked)?;
    d.set_item("bytes", r.bytes)?;
    d.set_item("direct_io", r.direct_io)?;
    let bad = PyList::empty(py);
    for b in &r.bad {
        let e = PyDict::new(py);
        e.set_item("id", b.id)?;
        e.set_item("source", b.source.display().to_string())?;
        e.set_item("extent", b.extent.display().to_string())?;
        e.set_item("what", &b.what)?;
        bad.append(e)?;
    }
    d.set_item("bad", bad)?;
    let bad_extents = PyList::empty(py);
    for x in &r.bad_extents {
        let e = PyDict::new(py);
        e.set_item("index", x.index)?;
        e.set_item("path", x.path.display().to_string())?;
        e.set_item("actual_bytes", x.actual_bytes)?;
        e.set_item("manifest_bytes", x.manifest_bytes)?;
        bad_extents.append(e)?;
    }
    d.set_item("bad_extents", bad_extents)?;
    Ok(d)
}

/// The catalog of a space or a catalog file, as arrays.
#[pyfunction]
fn _open_catalog<'py>(py: Python<'py>, path: String) -> PyResult<Bound<'py, PyDict>> {
    let p = std::path::Path::new(&path);
    let cat = py
        .detach(|| {
            if p.is_dir() {
                kspeed::dataset::Space::open(p).map(|s| Catalog::Space(Box::new(s)))
            } else {
                kspeed::dataset::Catalog::open(p).map(Catalog::File)
            }
        })
        .raise(py)?;
    match &cat {
        Catalog::Space(s) => objects::catalog_dict(py, s.catalog()),
        Catalog::File(c) => objects::catalog_dict(py, c),
    }
}

enum Catalog {
    Space(Box<kspeed::dataset::Space>),
    File(kspeed::dataset::Catalog),
}

/// The node service (`kspeed serve`) running in this process.
#[pyclass(module = "kspeed._kspeed", name = "_NodeService", frozen)]
struct PyNodeService {
    svc: Mutex<Option<kspeed::transport::NodeService>>,
    addr: String,
}

#[pymethods]
impl PyNodeService {
    #[new]
    fn new(py: Python<'_>, cfg: &Bound<'_, PyDict>) -> PyResult<Self> {
        let space: String =
            get(cfg, "space")?.ok_or_else(|| PyValueError::new_err("space is required"))?;
        let listen: String = get(cfg, "listen")?.unwrap_or_else(|| "127.0.0.1:0".into());
        let token: Vec<u8> = get(cfg, "token")?.unwrap_or_default();
        let mut c = kspeed::transport::ServeConfig::new(space, &listen, &token);
        if let Some(p) = get(cfg, "pollers")? {
            c.pollers = p;
        }
        if let Some(s) = get(cfg, "staging_bytes")? {
            c.staging_bytes = s;
        }
        if let Some(s) = get(cfg, "chunk_bytes")? {
            c.chunk_bytes = s;
        }
        if let Some(s) = get(cfg, "page_cache")? {
            c.page_cache = s;
        }
        if let Some(r) = get::<(Option<String>, u8, Option<u8>)>(cfg, "rdma")? {
            c.rdma = Some(
                kspeed::transport::RdmaOptions::default()
                    .device(r.0)
                    .port(r.1)
                    .gid_index(r.2),
            );
        }
        let svc = py
            .detach(|| kspeed::transport::NodeService::start(c))
            .raise(py)?;
        let addr = svc.local_addr().to_string();
        Ok(PyNodeService {
            svc: Mutex::new(Some(svc)),
            addr,
        })
    }

    #[getter]
    fn address(&self) -> String {
        self.addr.clone()
    }

    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let g = self.svc.lock().unwrap_or_else(|e| e.into_inner());
        let d = PyDict::new(py);
        if let Some(s) = g.as_ref() {
            let st = s.stats();
            let l = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
            d.set_item("connections", l(&st.connections))?;
            d.set_item("refused", l(&st.refused))?;
            d.set_item("violations", l(&st.violations))?;
            d.set_item("samples", l(&st.samples))?;
            d.set_item("bytes", l(&st.bytes))?;
            d.set_item("errors", l(&st.errors))?;
        }
        Ok(d)
    }

    fn stop(&self, py: Python<'_>) {
        let svc = self.svc.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(s) = svc {
            py.detach(move || s.stop());
        }
    }
}

/// For scripts/bench_python.py: the same configuration read by the Rust
/// loader alone, in this process and build (the baseline of the Python
/// layer's cost). Reads `warm_epochs` untimed epochs, then `epochs` timed
/// ones, touching each batch's span as Python callers touch `array()` (each
/// sample's view instead for a batch with `tier_views` samples, which has
/// no span); returns (seconds, samples, batches) of the timed part.
#[pyfunction]
fn _bench_rust(
    py: Python<'_>,
    cfg: &Bound<'_, PyDict>,
    warm_epochs: u64,
    epochs: u64,
) -> PyResult<(f64, u64, u64)> {
    let (builder, _) = builder_from(cfg)?;
    py.detach(|| {
        let mut l = builder.build()?;
        let (mut samples, mut batches, mut t) = (0u64, 0u64, None);
        for e in 0..warm_epochs + epochs {
            if e == warm_epochs {
                t = Some(std::time::Instant::now());
            }
            l.set_epoch(e)?;
            while let Some(b) = l.next_batch()? {
                if b.in_ring() {
                    let (span, wrap) = b.spans();
                    std::hint::black_box((span.first(), wrap.map(|w| w.len())));
                } else {
                    // tier_views: no span; the samples' views instead.
                    for s in b.iter() {
                        std::hint::black_box(s.bytes.first());
                    }
                }
                if e >= warm_epochs {
                    samples += b.len() as u64;
                    batches += 1;
                }
            }
        }
        let secs = t.map_or(0.0, |t| t.elapsed().as_secs_f64());
        Ok::<_, kspeed::Error>((secs, samples, batches))
    })
    .raise(py)
}

/// Whether this build has the RDMA transport.
#[pyfunction]
fn _has_rdma() -> bool {
    cfg!(feature = "rdma")
}

#[pymodule]
fn _kspeed(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyLoader>()?;
    m.add_class::<Batch>()?;
    m.add_class::<Owned>()?;
    m.add_class::<objects::View>()?;
    m.add_class::<PyNodeService>()?;
    m.add_function(wrap_pyfunction!(_preload, m)?)?;
    m.add_function(wrap_pyfunction!(_catalog, m)?)?;
    m.add_function(wrap_pyfunction!(_verify, m)?)?;
    m.add_function(wrap_pyfunction!(_open_catalog, m)?)?;
    m.add_function(wrap_pyfunction!(_has_rdma, m)?)?;
    m.add_function(wrap_pyfunction!(_bench_rust, m)?)?;
    launcher::register(m)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
