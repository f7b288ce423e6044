//! The state a Python loader shares with its batches and its acquiring
//! thread ([`Shared`]), and that thread.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, MutexGuard};

use kspeed::loader::Loader as RustLoader;

use crate::errors::Fail;

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
pub(crate) struct OutBatch {
    pub(crate) flags: Arc<BatchFlags>,
}

pub(crate) struct Core {
    /// `None` once closed (and every batch with views is gone).
    pub(crate) loader: Option<RustLoader>,
    /// Batches out, oldest first (mirrors the Rust loader's kept batches).
    pub(crate) out: VecDeque<OutBatch>,
    /// Closed by the caller: no more batches; the Rust loader is dropped
    /// once no batch out has views.
    pub(crate) closed: bool,
    /// Batches Python may hold at once.
    pub(crate) max_out: usize,
    /// The CUDA device of a GPU ring.
    pub(crate) gpu_ordinal: Option<i32>,
}

impl Core {
    /// Returns, oldest first, the ring space of batches Python is done with.
    pub(crate) fn reap(&mut self) {
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
    pub(crate) fn close(&mut self) -> Option<RustLoader> {
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

    pub(crate) fn loader(&mut self) -> Result<&mut RustLoader, Fail> {
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
    pub(crate) fn drop_out_batches(&mut self, what: &str) -> Result<(), Fail> {
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
    pub(crate) core: Mutex<Core>,
    /// The process that built the loader. A forked child has a copy of this
    /// memory but none of the threads: it must neither use nor free the
    /// loader (freeing would join pollers that do not exist there).
    pub(crate) pid: u32,
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

    pub(crate) fn lock(&self) -> MutexGuard<'_, Core> {
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
pub(crate) struct BatchData {
    pub(crate) epoch: u64,
    pub(crate) first_index: u64,
    pub(crate) ids: Vec<i64>,
    pub(crate) labels: Vec<i64>,
    /// Each sample's dataset in a mixture (0 without one).
    pub(crate) datasets: Vec<i64>,
    /// Address of each sample (host or device): in the landing ring, or in
    /// the memory tier (`tier_views`).
    pub(crate) addrs: Vec<u64>,
    pub(crate) lens: Vec<u64>,
    /// Whether each sample is a view into the memory tier (`tier_views`),
    /// which is never rewritten: its DLPack export is a copy (consumers such
    /// as PyTorch ignore DLPack's read-only flag).
    pub(crate) in_tier: Vec<bool>,
    /// Every sample is in the landing ring, so `span`/`wrap` hold the whole
    /// batch. False when `tier_views` handed out some samples in place in
    /// the memory tier: then the batch is no span of anything, and `span`
    /// and `wrap` are unset.
    pub(crate) in_ring: bool,
    /// The batch's span(s) as (address, bytes), when `in_ring`.
    pub(crate) span: (u64, u64),
    pub(crate) wrap: Option<(u64, u64)>,
    /// CUDA device of a GPU ring.
    pub(crate) device: Option<i32>,
    pub(crate) flags: Arc<BatchFlags>,
}

pub(crate) enum Reply {
    Batch(Box<BatchData>),
    EndOfEpoch,
    InUse(String),
    Failed(kspeed::Error),
    Closed,
}

/// The acquiring thread: takes batches from the Rust loader so that the
/// Python thread can wait for them in slices and answer Ctrl-C.
pub(crate) fn acquirer(shared: Arc<Shared>, rx: mpsc::Receiver<()>, tx: mpsc::Sender<Reply>) {
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

pub(crate) fn acquire_one(core: &mut Core) -> Reply {
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
        datasets: Vec::with_capacity(n),
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
        let (id, label, dataset, addr, len, pos, in_tier) = if dev.is_some() {
            let s = loader.held_device_sample(i);
            let len = s.len as u64;
            (s.id, s.label, s.dataset, s.addr, len, s.position, false)
        } else {
            let s = loader.held_sample(i);
            (
                s.id,
                s.label,
                s.dataset,
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
        d.datasets.push(dataset as i64);
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
pub(crate) struct Requester {
    pub(crate) tx: mpsc::Sender<()>,
    pub(crate) rx: mpsc::Receiver<Reply>,
    /// A request was sent and its reply not yet taken (a wait interrupted by
    /// Ctrl-C leaves it for the next call, so no batch is lost).
    pub(crate) outstanding: bool,
    /// A reply taken by [`PyLoader::settle`] for the next call.
    pub(crate) stash: Option<Reply>,
}
