//! `_Loader`: the loader behind `kspeed.Loader`.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use crate::errors::{Fail, Raise};
use crate::objects;
use crate::options::{builder_from, get};
use crate::shared::*;
use crate::Batch;

/// The loader behind `kspeed.Loader` (which validates the arguments).
#[pyclass(module = "kspeed._kspeed", name = "_Loader", frozen)]
pub(crate) struct PyLoader {
    pub(crate) shared: Arc<Shared>,
    pub(crate) req: Mutex<Requester>,
    pub(crate) batch_size: usize,
    pub(crate) epoch_len: u64,
    pub(crate) rank: u32,
    pub(crate) world: u32,
    pub(crate) seed: u64,
    pub(crate) catalog_len: u64,
    pub(crate) catalog_identity: u32,
    pub(crate) mix_counts: Option<Vec<u64>>,
}

impl PyLoader {
    /// Asks the acquiring thread for the next batch (unless a request is
    /// still outstanding) and waits for its reply in 50 ms slices with the
    /// GIL released, checking for signals (Ctrl-C) between slices.
    pub(crate) fn wait_reply(&self, py: Python<'_>) -> PyResult<Reply> {
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
    pub(crate) fn settle(&self, py: Python<'_>, discard: bool) -> PyResult<()> {
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
    pub(crate) fn reclaim_one(&self) -> bool {
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
    pub(crate) fn new(py: Python<'_>, cfg: &Bound<'_, PyDict>) -> PyResult<Self> {
        let (builder, max_out) = builder_from(cfg)?;
        let (rank, world) = builder.rank_world();
        let seed = get::<u64>(cfg, "seed")?.unwrap_or(0);
        let loader = py.detach(|| builder.build()).raise(py)?;
        let batch_size = loader.batch_size();
        let epoch_len = loader.epoch_len();
        let catalog_len = loader.catalog().len();
        let catalog_identity = loader.catalog().identity();
        let mix_counts = loader.mixture().map(|m| m.counts().to_vec());
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
            mix_counts,
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
    pub(crate) fn next_batch(slf: Bound<'_, Self>) -> PyResult<Option<Py<Batch>>> {
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
    pub(crate) fn set_epoch(&self, py: Python<'_>, epoch: u64) -> PyResult<()> {
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

    /// Starts the pollers now rather than at the first batch (Rust's
    /// `Loader::start_reading`).
    pub(crate) fn start_reading(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| {
            let mut core = self.shared.lock();
            core.loader()?.start_reading();
            Ok::<_, Fail>(())
        })
        .raise(py)
    }

    /// (epoch, index) of the next sample to be delivered.
    pub(crate) fn position(&self, py: Python<'_>) -> PyResult<(u64, u64)> {
        py.detach(|| {
            let mut core = self.shared.lock();
            let p = core.loader()?.position();
            Ok::<_, Fail>((p.epoch, p.index))
        })
        .raise(py)
    }

    /// The position, serialized (the Rust loader's checkpoint bytes).
    pub(crate) fn save_position<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let b = py
            .detach(|| {
                let mut core = self.shared.lock();
                Ok::<_, Fail>(core.loader()?.save_position())
            })
            .raise(py)?;
        Ok(PyBytes::new(py, &b))
    }

    /// Continues from bytes of `save_position` (a restart).
    pub(crate) fn restore_position(&self, py: Python<'_>, bytes: Vec<u8>) -> PyResult<()> {
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

    /// (epoch, base, index, rank, world): this rank's place, and where its
    /// world started dealing the epoch.
    pub(crate) fn rank_position(&self, py: Python<'_>) -> PyResult<(u64, u64, u64, u32, u32)> {
        py.detach(|| {
            let mut core = self.shared.lock();
            let p = core.loader()?.rank_position();
            Ok::<_, Fail>((p.epoch, p.base, p.index, p.rank, p.world))
        })
        .raise(py)
    }

    /// The job position (KSPDJOB1 bytes; a mixture's KSPDMIX1) of
    /// `consumed` entries of `epoch` (default: the job position from this
    /// rank's position).
    #[pyo3(signature = (epoch=None, consumed=None))]
    pub(crate) fn save_job_position<'py>(
        &self,
        py: Python<'py>,
        epoch: Option<u64>,
        consumed: Option<u64>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let b = py
            .detach(|| {
                let mut core = self.shared.lock();
                let l = core.loader()?;
                let job = match (epoch, consumed) {
                    (Some(epoch), Some(consumed)) => {
                        kspeed::sampler::JobPosition { epoch, consumed }
                    }
                    _ => l.job_position(),
                };
                Ok::<_, Fail>(l.encode_job_position(job))
            })
            .raise(py)?;
        Ok(PyBytes::new(py, &b))
    }

    /// Continues the job from a job position (or any rank's saved
    /// position) at this loader's rank and world (a restart).
    pub(crate) fn restore_job_position(&self, py: Python<'_>, bytes: Vec<u8>) -> PyResult<()> {
        self.settle(py, true)?;
        (|| {
            let mut core = self.shared.lock();
            core.reap();
            core.loader()?;
            core.drop_out_batches("load_state_dict")?;
            core.loader()?
                .restore_job_position(&bytes)
                .map_err(Fail::from_kspeed)
        })()
        .raise(py)
    }

    /// Samples this rank delivers in `epoch` (fewer in an epoch resumed
    /// at a job position).
    pub(crate) fn epoch_steps(&self, py: Python<'_>, epoch: u64) -> PyResult<u64> {
        py.detach(|| {
            let mut core = self.shared.lock();
            Ok::<_, Fail>(core.loader()?.epoch_steps(epoch))
        })
        .raise(py)
    }

    pub(crate) fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
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
        d.set_item("stall_waits", st.stall_waits)?;
        d.set_item("samples_per_s", st.samples_per_sec())?;
        d.set_item("bytes_per_s", st.bytes_per_sec())?;
        d.set_item("stall_fraction", st.stall_fraction())?;
        d.set_item("disk_reads", st.disk_reads)?;
        d.set_item("tier_hits", st.tier_hits)?;
        d.set_item("retries", st.retries)?;
        d.set_item("loop_stalls", st.loop_stalls)?;
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
        d.set_item("source_bytes", st.source_bytes)?;
        // The NVMe cache area (cache_dir), and the memory level above it
        // (cache_memory_bytes); all 0 without one.
        for (key, c) in [("cache", &st.cache), ("cache_memory", &st.cache_memory)] {
            let cache = PyDict::new(py);
            cache.set_item("hits", c.hits)?;
            cache.set_item("hit_bytes", c.hit_bytes)?;
            cache.set_item("planned_hits", c.planned_hits)?;
            cache.set_item("writes", c.writes)?;
            cache.set_item("write_bytes", c.write_bytes)?;
            cache.set_item("skipped", c.skipped)?;
            cache.set_item("corrupt", c.corrupt)?;
            cache.set_item("write_errors", c.write_errors)?;
            cache.set_item("held", c.held)?;
            cache.set_item("slots", c.slots)?;
            cache.set_item("area_bytes", c.area_bytes)?;
            d.set_item(key, cache)?;
        }
        // How long before it was asked for each source sample was ready.
        let lead = PyDict::new(py);
        lead.set_item("count", st.source_lead.count)?;
        lead.set_item("late", st.source_lead.late)?;
        lead.set_item("p10_s", st.source_lead.p10.as_secs_f64())?;
        lead.set_item("p50_s", st.source_lead.p50.as_secs_f64())?;
        d.set_item("source_lead", lead)?;
        d.set_item("read_ahead", st.read_ahead)?;
        d.set_item("read_ahead_discarded", st.read_ahead_discarded)?;
        // stall_s charged to its causes (README, "Stall charged to its cause").
        let c = &st.stall_causes;
        let causes = PyDict::new(py);
        causes.set_item("disk_s", c.disk.as_secs_f64())?;
        causes.set_item("tier_s", c.tier.as_secs_f64())?;
        causes.set_item("source_s", c.source.as_secs_f64())?;
        causes.set_item("peers_s", c.peers.as_secs_f64())?;
        causes.set_item("failover_s", c.failover.as_secs_f64())?;
        causes.set_item("agent_s", c.agent.as_secs_f64())?;
        causes.set_item("peer_read_s", c.peer_read.as_secs_f64())?;
        causes.set_item("peer_send_s", c.peer_send.as_secs_f64())?;
        causes.set_item("peer_link_s", c.peer_link.as_secs_f64())?;
        let peers = pyo3::types::PyList::empty(py);
        for p in c.slowest_peers.iter().filter(|p| p.waits > 0) {
            let e = PyDict::new(py);
            e.set_item("node", p.node)?;
            e.set_item("stall_s", p.stall.as_secs_f64())?;
            e.set_item("waits", p.waits)?;
            e.set_item("read_s", p.read.as_secs_f64())?;
            e.set_item("send_s", p.send.as_secs_f64())?;
            e.set_item("link_s", p.link.as_secs_f64())?;
            peers.append(e)?;
        }
        causes.set_item("slowest_peers", peers)?;
        d.set_item("stall_causes", causes)?;
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
        // The exactly-once digest (docs/FORMAT.md, "Exactly-once digest").
        let g = PyDict::new(py);
        g.set_item("epoch", st.digest.epoch)?;
        g.set_item("count", st.digest.count)?;
        g.set_item("sum", st.digest.sum)?;
        g.set_item("base", st.digest_at.base)?;
        g.set_item("index", st.digest_at.index)?;
        d.set_item("digest", g)?;
        Ok(d)
    }

    /// The catalog's per-sample arrays (see `kspeed.Catalog`).
    pub(crate) fn catalog_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let mut core = self.shared.lock();
        let cat = core.loader().raise(py)?.catalog();
        objects::catalog_dict(py, cat)
    }

    pub(crate) fn landing_info<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let mut core = self.shared.lock();
        let l = core.loader().raise(py)?;
        let info = l.landing_info();
        let tier = l.tier();
        let d = PyDict::new(py);
        d.set_item("bytes", info.bytes)?;
        d.set_item("huge_pages", info.huge_pages)?;
        d.set_item("locked", info.locked)?;
        d.set_item("numa_node", info.numa_node)?;
        d.set_item("cuda", &info.cuda)?;
        // How the pollers read: registered buffers, O_DIRECT or the page
        // cache and why (`page_cache`).
        d.set_item("io", &info.io)?;
        d.set_item("io_registered", info.io_registered)?;
        d.set_item("direct_io", info.direct_io)?;
        d.set_item("tier_samples", tier.map(|t| t.0))?;
        d.set_item("tier_bytes", tier.map(|t| t.1))?;
        Ok(d)
    }

    /// Batches out of the Rust loader (referenced, or released but waiting
    /// for an older batch to go first).
    pub(crate) fn batches_out(&self, py: Python<'_>) -> usize {
        py.detach(|| self.shared.lock().out.len())
    }

    /// Closes the loader: invalidates batches without views and, once no
    /// batch has views, stops the pollers and frees the ring. Refuses
    /// nothing: batches with live views keep the ring until they go.
    pub(crate) fn close(&self, py: Python<'_>) -> PyResult<()> {
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
    pub(crate) fn closed(&self, py: Python<'_>) -> bool {
        py.detach(|| self.shared.lock().closed)
    }

    #[getter]
    pub(crate) fn batch_size(&self) -> usize {
        self.batch_size
    }

    #[getter]
    pub(crate) fn epoch_len(&self) -> u64 {
        self.epoch_len
    }

    #[getter]
    pub(crate) fn rank(&self) -> u32 {
        self.rank
    }

    #[getter]
    pub(crate) fn world(&self) -> u32 {
        self.world
    }

    #[getter]
    pub(crate) fn seed(&self) -> u64 {
        self.seed
    }

    #[getter]
    pub(crate) fn catalog_len(&self) -> u64 {
        self.catalog_len
    }

    #[getter]
    pub(crate) fn catalog_identity(&self) -> u32 {
        self.catalog_identity
    }

    /// A mixture's samples per epoch from each dataset (its weights'
    /// counts), or None for one dataset.
    #[getter]
    pub(crate) fn mix_counts(&self) -> Option<Vec<u64>> {
        self.mix_counts.clone()
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

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyLoader>()
}
