//! The node agent's poller set: a few threads, each taking turns for the
//! pollers of several attached ranks, instead of a thread per rank's
//! poller (issue 28: the agent owns the node's pollers; 8 ranks on a node
//! need 8 rings served, not 8 threads).
//!
//! A rank's loader inside the agent hands each of its pollers (its own
//! io_uring, its share of that rank's schedule) to one of the node's
//! threads, the least loaded, instead of spawning a thread for it. A
//! thread turns every poller it holds ([`Poller::node_turn`]: queue, submit
//! once, drain, act; it never waits for I/O) and, when none made progress, waits
//! in one `poll(2)` on its pollers' io_uring descriptors (readable once a
//! completion is posted) and one eventfd ([`NodeWake`]) that the loaders
//! notify where a thread of their own would be unparked: a release that
//! makes room in a ring, a stop, the first batch. Per wait: one system
//! call for all the thread's rings. The work per turn of a thread grows
//! with the pollers it holds (the node's ranks times `--pollers`), which a
//! node bounds (its GPUs), not with peers or samples.
//!
//! A turn does block where an embedded poller's does (registering a ring's
//! buffers at a run's first read, faulting in the ring's first lap, a tier
//! copy, opening a source file), and then every poller on that thread waits
//! for it, not only its rank's.
//!
//! A poller that panics fails its own rank's run (as its own thread's
//! crash guard would) and is dropped, its reads cancelled and reaped by the
//! backend's drop; the thread goes on for the other ranks. If the thread
//! itself unwinds, every poller it holds fails its rank the same way.

use std::os::fd::{AsRawFd, OwnedFd};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use crossbeam_channel::{Receiver, Sender, TryRecvError};

use super::poller::{Poller, Turn};
use super::registration::PollerIo;
use super::Shared;
use crate::error::{Error, Result};
use crate::ring::PollWait;
use crate::sys::EventFd;

/// How long a thread waits at most when every poller it holds waits
/// (bounds nothing that matters: every wake is notified; a guard against a
/// lost one).
const IDLE_WAIT_MS: i32 = 100;

/// How long it waits when a poller with reads in flight has no descriptor
/// to poll (a simulated backend): it looks again this soon.
const BLIND_WAIT_MS: i32 = 1;

/// The eventfd a node thread waits on besides its rings: notified in
/// place of an unpark.
pub(crate) struct NodeWake {
    fd: EventFd,
}

impl NodeWake {
    /// Wakes the thread (or makes its next wait return at once).
    pub(crate) fn notify(&self) {
        self.fd.notify();
    }
}

/// One poller handed to a node thread, and where its backend goes back
/// when its run ends.
struct Job {
    shared: Arc<Shared>,
    index: usize,
    count: usize,
    io: PollerIo,
    back: Sender<PollerIo>,
}

/// A poller a node thread holds.
struct Held {
    /// Taken when its run ends ([`Poller::finish`]); dropped here with it
    /// still in, the thread unwound or its turn panicked.
    poller: Option<Poller>,
    /// The backend's io_uring (a duplicate), polled for completions; None
    /// for a backend without one.
    ring: Option<OwnedFd>,
    /// Declared before `back`, so dropped first: the loader's `join`
    /// returns when `back` sends or closes, and then takes its run's
    /// state back whole (no clone of it may be left here).
    shared: Arc<Shared>,
    back: Sender<PollerIo>,
    /// Test builds only (`test-panic`): its first turn panics.
    #[cfg(feature = "test-panic")]
    panics: bool,
}

impl Drop for Held {
    /// A poller whose run did not end: its reads are cancelled and reaped
    /// (the backend's drop) before its rank's run is failed and its
    /// loader's `join` returns (`back` closes after this).
    fn drop(&mut self) {
        if let Some(p) = self.poller.take() {
            drop(p);
            self.shared
                .fail_run(Error::ThreadPanicked { thread: "poller" });
        }
    }
}

struct NodeThread {
    jobs: Option<Sender<Job>>,
    wake: Arc<NodeWake>,
    /// Pollers it holds (the least loaded takes the next).
    load: Arc<AtomicUsize>,
    handle: Option<JoinHandle<()>>,
}

/// The node's poller threads (`kspeed agent --node-pollers`). Dropped
/// after every loader that handed it pollers (each holds it): the threads
/// end once their last poller has.
pub(crate) struct NodePollers {
    threads: Vec<NodeThread>,
}

impl std::fmt::Debug for NodePollers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodePollers")
            .field("threads", &self.threads.len())
            .finish()
    }
}

/// A run's poller: its own thread, or a turn on a node thread.
pub(super) enum PollerThread {
    Own(JoinHandle<PollerIo>),
    Node {
        wake: Arc<NodeWake>,
        back: Receiver<PollerIo>,
    },
}

impl PollerThread {
    /// Wakes the poller to look at its loader's state again.
    pub(super) fn unpark(&self) {
        match self {
            PollerThread::Own(t) => t.thread().unpark(),
            PollerThread::Node { wake, .. } => wake.notify(),
        }
    }

    /// Waits until the poller's run ended (the run was stopped first):
    /// its backend, or None if it panicked.
    pub(super) fn join(self) -> Option<PollerIo> {
        match self {
            PollerThread::Own(t) => t.join().ok(),
            PollerThread::Node { back, .. } => back.recv().ok(),
        }
    }
}

impl NodePollers {
    /// The agent's node poller threads (`kspeed agent --node-pollers N
    /// --node-poller-cores LIST`): None for 0 (a thread per poller);
    /// thread k pinned to `cores_listed[k % len]`, each core checked
    /// against the agent's affinity.
    pub(crate) fn for_agent(n: usize, cores_listed: &[u32]) -> Result<Option<Arc<NodePollers>>> {
        Ok(match n {
                0 if !cores_listed.is_empty() => {
                    return Err(Error::InvalidConfig(
                        "--node-poller-cores pins the node's poller threads, and --node-pollers 0 runs none (a thread per poller, unpinned): give one or the other"
                            .into(),
                    ))
                }
                0 => None,
                n => {
                    let allowed = crate::placement::affinity();
                    if let Some(c) = cores_listed.iter().find(|c| !allowed.contains(c)) {
                        return Err(Error::InvalidConfig(format!(
                            "--node-poller-cores: core {c} is not one this agent may run on ({})",
                            crate::placement::format_cpulist(&allowed)
                        )));
                    }
                    let all = &cores_listed;
                    let cores: Vec<u32> = if all.is_empty() {
                        Vec::new()
                    } else {
                        (0..n).map(|k| all[k % all.len()]).collect()
                    };
                    if n > allowed.len() {
                        log::warn!(
                            "agent: {n} node poller threads for {} cores it may run on: they take turns on the cores (a quarter of them is the default)",
                            allowed.len()
                        );
                    }
                    log::info!(
                        "agent: node poller threads: {n}, taking turns for every attached rank's pollers{}",
                        if cores.is_empty() {
                            String::new()
                        } else {
                            format!(", pinned to cores {cores:?}")
                        }
                    );
                    Some(Arc::new(NodePollers::new(n, &cores)?))
                }
            })
    }

    /// Starts `threads` poller threads, the k-th pinned to `cores[k]` if
    /// given; returns once each has pinned itself (or said the kernel
    /// refused).
    pub(crate) fn new(threads: usize, cores: &[u32]) -> Result<NodePollers> {
        assert!(threads > 0, "a node poller set has a thread");
        let mut set = NodePollers {
            threads: Vec::with_capacity(threads),
        };
        let (pinned_tx, pinned_rx) = crossbeam_channel::bounded::<()>(threads);
        for k in 0..threads {
            let wake = Arc::new(NodeWake {
                fd: EventFd::new().map_err(|e| Error::io("eventfd", "node poller", e))?,
            });
            let (tx, rx) = crossbeam_channel::unbounded::<Job>();
            let load = Arc::new(AtomicUsize::new(0));
            let core = cores.get(k).copied();
            let (w, l, pinned) = (wake.clone(), load.clone(), pinned_tx.clone());
            let handle = std::thread::Builder::new()
                .name(format!("kspeed-npoll-{k}"))
                .spawn(move || {
                    if let Some(c) = core {
                        if !core_affinity::set_for_current(core_affinity::CoreId { id: c as usize })
                        {
                            log::warn!("node poller {k}: the kernel refused pinning to core {c}");
                        }
                    }
                    let _ = pinned.send(());
                    drop(pinned);
                    node_loop(&rx, &w, &l);
                })
                .map_err(|e| Error::ThreadSpawn {
                    thread: "node poller",
                    source: e.into(),
                })?;
            set.threads.push(NodeThread {
                jobs: Some(tx),
                wake,
                load,
                handle: Some(handle),
            });
        }
        drop(pinned_tx);
        // Each thread sends once, first thing; an error: every sender is
        // gone (a thread died before it sent).
        for _ in 0..threads {
            if pinned_rx.recv().is_err() {
                break;
            }
        }
        Ok(set)
    }

    /// Hands poller `index` of `count` of a run (`shared`) with backend
    /// `io` to the least loaded thread.
    pub(super) fn adopt(
        &self,
        shared: Arc<Shared>,
        index: usize,
        count: usize,
        io: PollerIo,
    ) -> Result<PollerThread> {
        let t = self
            .threads
            .iter()
            .min_by_key(|t| t.load.load(Ordering::Relaxed))
            .expect("a node poller set has a thread");
        let (back, rx) = crossbeam_channel::bounded(1);
        t.load.fetch_add(1, Ordering::Relaxed);
        let job = Job {
            shared,
            index,
            count,
            io,
            back,
        };
        let sent = t.jobs.as_ref().is_some_and(|tx| tx.send(job).is_ok());
        if !sent {
            // Its thread is gone (it panicked outside any poller's turn).
            t.load.fetch_sub(1, Ordering::Relaxed);
            return Err(Error::ThreadPanicked {
                thread: "node poller",
            });
        }
        t.wake.notify();
        Ok(PollerThread::Node {
            wake: t.wake.clone(),
            back: rx,
        })
    }
}

impl Drop for NodePollers {
    fn drop(&mut self) {
        for t in &mut self.threads {
            // Closed: the thread ends once it holds no poller.
            t.jobs = None;
            t.wake.notify();
        }
        for t in &mut self.threads {
            if let Some(h) = t.handle.take() {
                let _ = h.join();
            }
        }
    }
}

/// A node thread: takes turns for every poller it holds until its set is
/// dropped and its last poller's run ended.
fn node_loop(jobs: &Receiver<Job>, wake: &NodeWake, load: &AtomicUsize) {
    let mut held: Vec<Held> = Vec::new();
    // The eventfd first, then each held poller's ring (rebuilt when the
    // list changes, not per turn).
    let mut fds: Vec<libc::pollfd> = Vec::new();
    let mut changed = true;
    let mut open = true;
    // Test builds only: the N-th poller this thread takes panics on its
    // first turn (`KSPEED_TEST_NODE_POLLER_PANIC=N`; tests/agent_panic.rs).
    #[cfg(feature = "test-panic")]
    let (mut taken, panic_at) = (
        0u64,
        std::env::var("KSPEED_TEST_NODE_POLLER_PANIC")
            .ok()
            .and_then(|v| v.parse::<u64>().ok()),
    );
    loop {
        // Cleared before the turns: a notify after this makes the wait
        // below return at once.
        wake.fd.drain();
        loop {
            match jobs.try_recv() {
                Ok(j) => {
                    let ring = j.io.io.uring_fd();
                    let (shared, back) = (j.shared.clone(), j.back);
                    let poller = catch_unwind(AssertUnwindSafe(|| {
                        Poller::new(j.shared, j.index, j.count, j.io)
                    }));
                    match poller {
                        Ok(p) => held.push(Held {
                            poller: Some(p),
                            ring,
                            back,
                            shared,
                            #[cfg(feature = "test-panic")]
                            panics: {
                                taken += 1;
                                panic_at == Some(taken)
                            },
                        }),
                        Err(_) => {
                            load.fetch_sub(1, Ordering::Relaxed);
                            shared.fail_run(Error::ThreadPanicked { thread: "poller" });
                            // The run's state before `back`, which the
                            // loader's join waits on (see Held).
                            drop(shared);
                            drop(back);
                        }
                    }
                    changed = true;
                }
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => {
                    open = false;
                    break;
                }
            }
        }
        if !open && held.is_empty() {
            return;
        }
        let (mut busy, mut blind) = (false, false);
        let mut i = 0;
        while i < held.len() {
            let h = &mut held[i];
            let p = h.poller.as_mut().expect("held until its run ends");
            #[cfg(feature = "test-panic")]
            let panics = std::mem::take(&mut h.panics);
            let turn = catch_unwind(AssertUnwindSafe(|| {
                #[cfg(feature = "test-panic")]
                if panics {
                    panic!("KSPEED_TEST_NODE_POLLER_PANIC: this node poller's turn panics");
                }
                match p.node_turn() {
                    // About to wait: can its ring's descriptor end the wait?
                    Turn::InFlight => match p.prepare_poll() {
                        PollWait::Now => Turn::Busy,
                        PollWait::Ring if h.ring.is_some() => Turn::InFlight,
                        PollWait::Ring | PollWait::Soon => {
                            blind = true;
                            Turn::InFlight
                        }
                    },
                    t => t,
                }
            }));
            match turn {
                Ok(Turn::Busy) => busy = true,
                Ok(Turn::InFlight | Turn::Idle) => {}
                Ok(Turn::Done) => {
                    let mut h = held.swap_remove(i);
                    load.fetch_sub(1, Ordering::Relaxed);
                    changed = true;
                    let p = h.poller.take().expect("held until its run ends");
                    let finished = catch_unwind(AssertUnwindSafe(|| p.finish()));
                    if finished.is_err() {
                        // Its backend went with the unwinding: its reads
                        // were reaped.
                        h.shared
                            .fail_run(Error::ThreadPanicked { thread: "poller" });
                    }
                    // Its hold on the run's state goes before the backend
                    // does: the loader's join returns on `back` and then
                    // takes that state back whole.
                    let back = h.back.clone();
                    drop(h);
                    if let Ok(io) = finished {
                        let _ = back.send(io);
                    }
                    continue;
                }
                Err(_) => {
                    // Held's drop reaps its reads, then fails its run.
                    drop(held.swap_remove(i));
                    load.fetch_sub(1, Ordering::Relaxed);
                    changed = true;
                    continue;
                }
            }
            i += 1;
        }
        if changed {
            fds.clear();
            fds.push(pollin(wake.fd.raw()));
            fds.extend(
                held.iter()
                    .filter_map(|h| h.ring.as_ref())
                    .map(|r| pollin(r.as_raw_fd())),
            );
            changed = false;
        }
        if busy {
            continue;
        }
        let wait_ms = if blind { BLIND_WAIT_MS } else { IDLE_WAIT_MS };
        if let Err(e) = crate::sys::poll_fds(&mut fds, wait_ms) {
            // EINVAL/ENOMEM: nothing to wait on; turn again after a pause
            // rather than spin.
            log::warn!("node poller: poll failed: {e}");
            std::thread::sleep(std::time::Duration::from_millis(BLIND_WAIT_MS as u64));
        }
    }
}

fn pollin(fd: std::os::fd::RawFd) -> libc::pollfd {
    libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    }
}
