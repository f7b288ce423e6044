//! `kspeed agent`: the node's one kspeed process (issue 28, docs/AGENT.md),
//! first slice: one node, a local space, no peers. It opens and checks the
//! space once, binds the attach socket and serves every rank that
//! attaches: per rank a loader's producer half (its pollers, io_uring,
//! schedule) reading into the rank's own ring, and a feeder thread that
//! takes the loader's batches and publishes them through the rank's
//! attach segment, honouring the rank's release marks.
//!
//! Threads: the main loop (accepts, beats every rank's heartbeat, reaps
//! ranks that ended); per rank one feeder and `pollers` pollers.
//!
//! A rank is judged by its socket (the kernel's hang-up when it dies) and
//! its segment's state word (a clean detach), never by its heartbeat: a
//! rank in a long training step does not call into the loader.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::attach::{AttachListener, Attached, Incoming, ListenerConfig};
use super::msg::{RefuseCode, FLAG_DROP_LAST, FLAG_SHUFFLE};
use super::segment::{side_state, Liveness, Segment, Side};
use super::shm::RingMap;
use crate::dataset::Space;
use crate::error::{Error, Result};
use crate::landing::{CudaMode, LandingOptions};
use crate::loader::{Loader, LoaderBuilder};
use crate::sampler::Position;

/// How the agent runs.
#[derive(Debug, Clone)]
pub struct AgentConfig {
    /// The node's space.
    pub space: PathBuf,
    /// The attach socket.
    pub socket: PathBuf,
    /// Poller threads per attached rank.
    pub pollers: usize,
    /// Reads in flight per poller.
    pub queue_depth: u32,
    /// Register each rank's ring with the pollers' io_urings.
    pub registered_buffers: bool,
    /// The agent's heartbeat period (ranks count it gone after 3).
    pub heartbeat: Duration,
    /// The socket's mode, uid policy and I/O deadlines.
    pub listener: ListenerConfig,
}

impl AgentConfig {
    /// Defaults: 1 poller per rank, queue depth 32, registered buffers,
    /// a 100 ms heartbeat.
    pub fn new(space: impl Into<PathBuf>, socket: impl Into<PathBuf>) -> Self {
        AgentConfig {
            space: space.into(),
            socket: socket.into(),
            pollers: 1,
            queue_depth: 32,
            registered_buffers: true,
            heartbeat: Duration::from_millis(100),
            listener: ListenerConfig::default(),
        }
    }
}

/// What a run of the agent did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AgentSummary {
    /// Ranks attached over the agent's life.
    pub attached: u64,
    /// Attaches refused (another dataset, a bad request...).
    pub refused: u64,
    /// Ranks that ended (detached, died or failed).
    pub ended: u64,
}

/// The space, opened and checked once, shared by every rank's loader.
struct OpenSpace {
    space: Arc<Space>,
    extents: Arc<[File]>,
    direct_io: bool,
    identity: u64,
}

fn open_space(dir: &Path) -> Result<OpenSpace> {
    let space = Space::open(dir)?;
    space.check_extents()?;
    if space.held_samples() != space.catalog().len() {
        // Peers (remote samples through other nodes' agents) are a later
        // step of issue 28.
        return Err(Error::InvalidConfig(format!(
            "space {} holds {} of {} samples: this agent serves a whole local space only (peers are not built yet)",
            dir.display(),
            space.held_samples(),
            space.catalog().len()
        )));
    }
    let mut direct_io = true;
    let mut extents = Vec::with_capacity(space.extent_lens().len());
    for i in 0..space.extent_lens().len() as u32 {
        let path = space.extent_path(i);
        let (f, direct) =
            crate::sys::open_direct(&path).map_err(|e| Error::io("open", &path, e))?;
        direct_io &= direct;
        extents.push(f);
    }
    if !direct_io {
        log::warn!(
            "{}: the file system refuses O_DIRECT; reading through the page cache",
            dir.display()
        );
    }
    let identity = u64::from(space.catalog().identity());
    Ok(OpenSpace {
        space: Arc::new(space),
        extents: extents.into(),
        direct_io,
        identity,
    })
}

/// One attached rank as the main loop sees it.
struct Rank {
    /// A second mapping of the rank's segment: the main loop beats the
    /// agent's heartbeat here while the feeder may be busy in a read.
    beat: Segment,
    pid: u32,
    rank: u32,
    feeder: JoinHandle<Result<u64>>,
}

/// Runs the agent until `stop` is set: binds the socket, calls
/// `on_ready(socket)` once it accepts, then serves ranks. On return every
/// rank's pollers have stopped (their reads landed) and its ring is
/// unmapped.
pub fn run(
    cfg: &AgentConfig,
    stop: &AtomicBool,
    on_ready: impl FnOnce(&Path),
) -> Result<AgentSummary> {
    crate::sys::raise_open_files_limit();
    let open = open_space(&cfg.space)?;
    let listener = AttachListener::bind(&cfg.socket, cfg.listener)?;
    log::info!(
        "agent: serving {} ({} samples) on {}",
        cfg.space.display(),
        open.space.catalog().len(),
        cfg.socket.display()
    );
    on_ready(listener.path());
    let halt = Arc::new(AtomicBool::new(false));
    let mut ranks: Vec<Rank> = Vec::new();
    let mut summary = AgentSummary::default();
    let heartbeat_ms = cfg.heartbeat.as_millis().clamp(1, u32::MAX as u128) as u32;
    while !stop.load(Ordering::Acquire) {
        match listener.accept_attach(cfg.heartbeat) {
            Ok(Some(incoming)) => match take_rank(cfg, &open, incoming, heartbeat_ms, &halt) {
                Ok(r) => {
                    summary.attached += 1;
                    log::info!("agent: rank {} (pid {}) attached", r.rank, r.pid);
                    ranks.push(r);
                }
                Err(e) => {
                    summary.refused += 1;
                    log::warn!("agent: attach refused: {e}");
                }
            },
            Ok(None) => {}
            // One bad peer (a wrong request, a timeout) never stops the agent.
            Err(e) => {
                summary.refused += 1;
                log::warn!("agent: attach failed: {e}");
            }
        }
        for r in &ranks {
            r.beat.beat_for(Side::Agent);
        }
        let mut i = 0;
        while i < ranks.len() {
            if ranks[i].feeder.is_finished() {
                let r = ranks.swap_remove(i);
                end_rank(r);
                summary.ended += 1;
            } else {
                i += 1;
            }
        }
    }
    halt.store(true, Ordering::Release);
    for r in ranks.drain(..) {
        // Keep beating while feeders stop, so no rank sees silence first.
        r.beat.beat_for(Side::Agent);
        end_rank(r);
        summary.ended += 1;
    }
    Ok(summary)
}

/// [`run`] until SIGINT or SIGTERM (`kspeed agent`): the signals are
/// blocked in every thread and taken here; then every rank's pollers stop
/// (their reads land) and the socket is removed. A failure to start (the
/// space, the socket) ends the wait at once.
pub fn run_until_signal(
    cfg: &AgentConfig,
    on_ready: impl FnOnce(&Path) + Send + 'static,
) -> Result<AgentSummary> {
    let signals = crate::sys::TermSignals::block();
    let stop = Arc::new(AtomicBool::new(false));
    let (s2, cfg2) = (stop.clone(), cfg.clone());
    let agent = std::thread::Builder::new()
        .name("kspeed-agent".into())
        .spawn(move || {
            let r = run(&cfg2, &s2, on_ready);
            if !s2.load(Ordering::Acquire) {
                // SAFETY: kill with our own pid and a valid signal number
                // has no memory effects; every thread blocks SIGTERM, so it
                // reaches the sigwait below.
                unsafe { libc::kill(libc::getpid(), libc::SIGTERM) };
            }
            r
        })
        .map_err(|e| Error::ThreadSpawn {
            thread: "agent",
            source: e.into(),
        })?;
    signals.wait();
    stop.store(true, Ordering::Release);
    agent
        .join()
        .map_err(|_| Error::ThreadPanicked { thread: "agent" })?
}

fn end_rank(r: Rank) {
    match r.feeder.join() {
        Ok(Ok(batches)) => log::info!(
            "agent: rank {} (pid {}) ended after {batches} batches; its pollers stopped and its ring is unmapped",
            r.rank,
            r.pid
        ),
        Ok(Err(e)) => log::warn!("agent: rank {} (pid {}) ended: {e}", r.rank, r.pid),
        Err(_) => log::error!("agent: the feeder of rank {} panicked", r.rank),
    }
}

/// Checks an incoming rank, builds its loader over the shared space and
/// the rank's ring, answers ATTACHED and starts its feeder; refuses it
/// (with the reason) otherwise.
fn take_rank(
    cfg: &AgentConfig,
    open: &OpenSpace,
    incoming: Incoming,
    heartbeat_ms: u32,
    halt: &Arc<AtomicBool>,
) -> Result<Rank> {
    let req = incoming.request;
    let refuse = |incoming: &Incoming, e: Error| {
        incoming.conn.refuse(RefuseCode::Agent, &e.to_string());
        e
    };
    if req.dataset_id != open.identity {
        let e = Error::InvalidConfig(format!(
            "the rank reads dataset {:#x}; this agent serves {} (dataset {:#x})",
            req.dataset_id,
            cfg.space.display(),
            open.identity
        ));
        return Err(refuse(&incoming, e));
    }
    let built = (|| {
        // The loader maps the ring a second time: the attach keeps its
        // own mapping, and each is unmapped by its owner.
        let ring = RingMap::open(
            incoming
                .ring
                .fd()
                .try_clone_to_owned()
                .map_err(|e| Error::io("dup", "attach ring", e))?,
            req.ring_bytes,
        )?;
        let beat = Segment::open(
            incoming
                .segment
                .fd()
                .try_clone_to_owned()
                .map_err(|e| Error::io("dup", "attach segment", e))?,
            req.ring_bytes,
        )?;
        let loader = LoaderBuilder::space(&cfg.space)
            .agent_input(crate::loader::AgentInput {
                space: open.space.clone(),
                extents: open.extents.clone(),
                direct_io: open.direct_io,
                ring: Arc::new(Mutex::new(Some(ring))),
            })
            .batch_size(req.batch_size as usize)
            .seed(req.seed)
            .shuffle(req.flags & FLAG_SHUFFLE != 0)
            .drop_last(req.flags & FLAG_DROP_LAST != 0)
            .rank(req.rank, req.world)
            .landing(
                LandingOptions::default()
                    .ring_bytes(req.ring_bytes)
                    .huge_pages(false)
                    .mlock(false)
                    .cuda(CudaMode::Off),
            )
            .pollers(cfg.pollers)
            .queue_depth(cfg.queue_depth)
            .registered_buffers(cfg.registered_buffers)
            .pin(false)
            .local_rank(0, 1)
            .start_at(Position {
                epoch: req.start_epoch,
                index: req.start_index,
            })
            .build()?;
        Ok::<_, Error>((loader, beat))
    })();
    let (loader, beat) = match built {
        Ok(b) => b,
        Err(e) => return Err(refuse(&incoming, e)),
    };
    let pid = incoming.conn.peer().pid;
    let attached = incoming.accept(heartbeat_ms)?;
    let halt = halt.clone();
    let heartbeat = Duration::from_millis(u64::from(heartbeat_ms));
    let feeder = std::thread::Builder::new()
        .name(format!("kspeed-feed-{}", req.rank))
        .spawn(move || feed(attached, loader, &halt, heartbeat))
        .map_err(|e| Error::ThreadSpawn {
            thread: "agent feeder",
            source: e.into(),
        })?;
    Ok(Rank {
        beat,
        pid,
        rank: req.rank,
        feeder,
    })
}

/// Moves one rank's batches from its loader to its segment until the
/// rank goes (socket hang-up or a clean detach) or the agent stops.
/// Returns the batches published. Dropping the loader at the end stops its
/// pollers after their in-flight reads land; then the ring is unmapped.
fn feed(
    mut att: Attached,
    mut loader: Loader,
    halt: &AtomicBool,
    heartbeat: Duration,
) -> Result<u64> {
    // Judged by its socket and state word, not by its heartbeat.
    let live = Liveness {
        slice: heartbeat,
        silence_limit: Duration::from_secs(u32::MAX as u64),
    };
    let mut released = 0u64;
    let result = loop {
        if halt.load(Ordering::Acquire)
            || att.conn.peer_closed()
            || att.side.segment().side_status(Side::Rank).0 != side_state::RUNNING
        {
            break Ok(());
        }
        // The rank's releases free the loader's oldest batches.
        match att.side.released() {
            Ok(r) => {
                while released < r {
                    assert!(
                        loader.release_oldest_batch(),
                        "the rank released a batch the agent never published"
                    );
                    released += 1;
                }
            }
            Err(e) => break Err(e),
        }
        let room = match att.side.has_room() {
            Ok(room) => room && loader.keep_bytes_needed().is_none(),
            Err(e) => break Err(e),
        };
        if !room {
            let conn = &att.conn;
            let mut check = || {
                if conn.peer_closed() {
                    return Err(Error::AttachPeerGone {
                        peer: "rank",
                        pid: conn.peer().pid,
                        silent_ms: 0,
                        closed: true,
                    });
                }
                Ok(())
            };
            let deadline = Some(Instant::now() + heartbeat);
            match att
                .side
                .wait_released(released, &live, deadline, &mut check)
            {
                Ok(()) | Err(Error::AttachTimeout { .. }) => continue,
                Err(Error::AttachPeerGone { .. }) => break Ok(()),
                Err(e) => break Err(e),
            }
        }
        match loader.acquire_batch_keep() {
            Ok(0) => {
                // The epoch's end: go on into the next, as the rank does.
                let next = loader.position().epoch;
                if let Err(e) = loader.set_epoch(next) {
                    break Err(e);
                }
            }
            Ok(_) => {
                let desc = loader.held_desc().expect("a batch is held");
                if let Err(e) = att.side.publish(&desc) {
                    break Err(e);
                }
            }
            Err(e) => break Err(e),
        }
    };
    let published = att.side.published();
    if let Err(e) = &result {
        // The rank's wait ends with this error at once.
        att.side.segment().post_error(Side::Agent, e);
    } else {
        att.side.close();
    }
    // Pollers stop and their reads land before the ring's mapping goes.
    drop(loader);
    drop(att);
    result.map(|()| published)
}
