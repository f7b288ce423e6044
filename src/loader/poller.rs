//! The poller: one pinned thread per core that owns an io_uring, reads its
//! share of the schedule (every P-th sample) into the landing ring, and
//! publishes each sample's readiness. One tick: queue what flow control
//! allows, submit once, drain completions into a fixed array, then act on
//! them. No allocation, lock or copy per sample (the memory tier's copy is
//! the tier's point); locks only on the error path and to publish latency
//! histograms every 100 ms.
//!
//! A sample is read by one or more *parts* of at most `max_read_bytes`, so
//! a 100 MiB volume keeps the queue as busy as a hundred small samples. Each
//! in-flight part occupies an op slot (its index is the io_uring user_data);
//! each sample being read occupies a group record until its last part lands.
//! Both pools are sized once from the queue depth.
//!
//! Why this file is over ~800 lines: one loop and the one record (a group
//! of parts) it keeps per sample, with every path a sample's bytes take
//! (a space's extent, a source file, an object in a bucket, a tier copy,
//! a slot of the cache area)
//! and every way a read ends (done, short, failed, corrupt, cancelled);
//! split, each piece would reach into the same pools and counters.

use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;

use super::cache_plan::Plan;
use super::fdcache::{FdCache, Lease};
use super::registration::PollerIo;
use super::schedule::{Cursor, Placed};
use super::shared::{VIA_DISK, VIA_SOURCE, VIA_TIER};
use super::{Input, Shared, CODE_ERROR, CODE_OK, CODE_TIER};
use crate::error::{errno_name, Error};
use crate::pool::Pool;
use crate::ring::{transient_submit_error, Completion, IoBackend, ReadOp, Target};
use crate::stall::{Phase, Stall};

/// Attempts for a part that came back short or was interrupted.
const MAX_ATTEMPTS: u32 = 4;

/// Consecutive samples one poller takes from an object store.
const REMOTE_RUN: u64 = 64;

/// One sample being read.
struct Group {
    placed: Placed,
    target: Target,
    /// Extent index or source file index (its dataset's own), for messages.
    file: u32,
    /// Its dataset in a mixture (0 otherwise), for messages.
    dataset: u32,
    /// Read from the source files (a source, or a sample a partial space
    /// does not hold): `file` is a source file, and the bytes are checked
    /// against the catalog whatever `verify_crc32c` says when they come
    /// from a partial space's source (it may have changed since).
    from_source: bool,
    /// File offset of the sample's first byte.
    offset: u64,
    /// Bytes to read in all (the aligned slot from extents, the exact length
    /// from source files).
    want: u64,
    parts: u32,
    issued: u32,
    done: u32,
    /// The source file's descriptor (source mode), released when the
    /// sample's reads are done.
    lease: Option<Lease>,
    error: Option<Error>,
    submitted: Instant,
    /// Read from this slot of this cache level (`Shared::cache_level`):
    /// `file` is the slot; the bytes are checked against the catalog, and
    /// a slot that fails is emptied and the sample read from where it
    /// lives instead.
    cache_read: Option<(usize, u32)>,
    /// Kept, once read, in this slot of each cache level (by index): the
    /// memory level above the area keeps what it plans, whether the
    /// sample came from the area, the space or the source.
    cache_admit: [Option<u32>; 2],
}

/// One read in flight.
#[derive(Clone, Copy)]
struct Op {
    group: u32,
    part: u32,
    attempts: u32,
}

pub(crate) struct Poller {
    shared: Arc<Shared>,
    index: u64,
    count: u64,
    backend: Box<dyn IoBackend>,
    /// The ring is the backend's fixed buffers: reads name a `buf_index`.
    fixed: bool,
    /// Registration was tried in this run (it is once a backend's life,
    /// or once a run where it failed; registration.rs).
    registration_tried: bool,
    cursor: Cursor,
    pending: Option<Placed>,
    /// Reads in flight and samples being read: `queue_depth` each,
    /// allocated here and never grown (a full pool waits for completions).
    ops: Pool<Op>,
    groups: Pool<Group>,
    /// A group whose parts are not all issued yet (issued before new samples).
    partial: Option<u32>,
    /// Samples whose read from the cache area failed its check, to be read
    /// from the source (at most one per group: sized at start).
    retry: Vec<Placed>,
    completions: Vec<Completion>,
    hist: Histogram<u64>,
    last_publish: Instant,
    in_flight: usize,
    /// Samples finished by the last drain are marked ready but the consumer
    /// is not woken yet: the tick first starts the reads that replace them.
    unwoken: bool,
    /// Reads pushed since the last submission; submitted every
    /// `submit_batch`.
    unsubmitted: u32,
    /// A submission inside fill() failed; the run loop fails everything.
    submit_error: Option<std::io::Error>,
    part_bytes: u64,
    path_buf: PathBuf,
    /// Per dataset (one without a mixture): where a partial space's
    /// samples it does not hold are read from.
    partial_roots: Vec<Option<PartialSource>>,
    /// The input is a source in an object store: reads name the object
    /// ([`Target::Object`]) and the backend GETs it (`ring/store.rs`).
    remote: bool,
    /// Source files kept open across samples (source mode).
    fds: FdCache,
    stall: Stall,
    /// When the loop last drained a completion (busy-polling for `spin`
    /// after it).
    last_progress: Instant,
    /// A node thread's poller began reading (`node_turn`).
    started: bool,
    /// A node thread's poller announced the sample it waits for
    /// ([`Shared::park_for`]); cleared at its next turn.
    parked: bool,
}

/// What a turn of the loop left.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Turn {
    /// It queued or finished something: take another turn.
    Busy,
    /// Reads in flight, none finished: wait for a completion.
    InFlight,
    /// Nothing in flight and nothing allowed (the ring is full, or the
    /// run has not started): wait for the loader.
    Idle,
    /// The run stopped and nothing is in flight.
    Done,
}

/// Where a partial space's samples it does not hold are read from.
enum PartialSource {
    /// The source folder, through the descriptor cache.
    Files(PathBuf),
    /// Objects in a bucket: [`Target::Object`] reads, GETs by the backend.
    Bucket,
}

impl Poller {
    pub(crate) fn new(shared: Arc<Shared>, index: usize, count: usize, io: PollerIo) -> Self {
        let qd = shared.cfg.queue_depth as usize;
        let cursor = shared.cursor();
        let align = shared.geo.align;
        Poller {
            index: index as u64,
            count: count as u64,
            backend: io.io,
            fixed: io.registered,
            registration_tried: io.registered,
            cursor,
            pending: None,
            ops: Pool::with_limit(qd),
            groups: Pool::with_limit(qd),
            partial: None,
            retry: Vec::with_capacity(qd),
            completions: vec![Completion::default(); qd],
            hist: Histogram::new_with_bounds(1, 60_000_000, 2).expect("valid bounds"),
            last_publish: Instant::now(),
            in_flight: 0,
            unwoken: false,
            unsubmitted: 0,
            submit_error: None,
            part_bytes: shared.cfg.max_read_bytes.next_multiple_of(align).max(align),
            path_buf: PathBuf::with_capacity(4096),
            partial_roots: match &shared.input {
                Input::Mix(m) => m.parts.iter().collect(),
                input => vec![input],
            }
            .into_iter()
            .map(|p| match p {
                Input::Space { space, .. } if space.params().is_partial() => {
                    let spec = space.catalog().source_spec();
                    Some(if spec.is_remote() {
                        PartialSource::Bucket
                    } else {
                        PartialSource::Files(spec.root())
                    })
                }
                _ => None,
            })
            .collect(),
            remote: matches!(&shared.input, Input::Source { catalog, .. } if catalog.source_spec().is_remote()),
            fds: FdCache::new(if shared.input.has_source() {
                super::fdcache::capacity(count + 1)
            } else {
                1
            }),
            stall: Stall::new("loader poller", index),
            last_progress: Instant::now(),
            started: false,
            parked: false,
            shared,
        }
    }

    /// Runs until the loader stops, then waits for in-flight reads (they
    /// write into the ring) and hands the backend back for reuse: the
    /// poller's own thread.
    pub(crate) fn run(mut self) -> PollerIo {
        // Parked until the consumer asks for its first batch (or stops the
        // run): a restore right after the build then starts the next run
        // where it should, with nothing of this one's in flight to wait
        // for. An unpark before the park makes it return at once.
        while !self.shared.go.load(Ordering::Acquire) {
            if self.shared.stop.load(Ordering::Acquire) {
                return self.into_io();
            }
            std::thread::park();
        }
        if !self.shared.has_local() {
            // Cluster mode with nothing local: every sample comes over the
            // network, and the schedule has nothing for this poller.
            while !self.shared.stop.load(Ordering::Acquire) {
                std::thread::park_timeout(Duration::from_millis(100));
            }
            return self.into_io();
        }
        self.last_progress = Instant::now();
        self.stall.resume();
        while self.turn(true) != Turn::Done {}
        self.finish()
    }

    /// One turn on a thread that takes turns for several pollers (the node
    /// agent's poller set, `node_pollers.rs`): never waits for I/O. `Idle` and
    /// `InFlight` ask the thread to wait until this poller's ring has a
    /// completion or its loader wakes it ([`super::node_pollers::NodeWake`],
    /// which a release, a stop or the first batch notify in place of an
    /// unpark). After `Done`, [`Poller::finish`] hands the backend back.
    pub(crate) fn node_turn(&mut self) -> Turn {
        if !self.started {
            let stop = self.shared.stop.load(Ordering::Acquire);
            // Before the first batch, or in cluster mode with nothing local
            // (see `run`): nothing to do until the run stops.
            if !self.shared.go.load(Ordering::Acquire) || !self.shared.has_local() {
                return if stop { Turn::Done } else { Turn::Idle };
            }
            self.started = true;
            self.last_progress = Instant::now();
        }
        if self.parked {
            self.shared.park_for(self.index as usize, None);
            self.parked = false;
        }
        self.stall.resume();
        let turn = self.turn(false);
        self.stall
            .lap(&self.shared.stats[self.index as usize].loop_stalls);
        turn
    }

    /// Before its node thread waits in `poll(2)` with this poller's reads
    /// in flight ([`crate::ring::IoBackend::prepare_poll`]); an error is
    /// left to the next turn's submission, which fails the run with it.
    pub(crate) fn prepare_poll(&mut self) -> crate::ring::PollWait {
        self.backend
            .prepare_poll()
            .unwrap_or(crate::ring::PollWait::Soon)
    }

    /// One turn of the loop: queue what flow control allows, submit once,
    /// drain completions and act on them. `own_thread`: the poller's own
    /// thread, which waits inside the submission for a completion when
    /// reads are in flight and parks when nothing is allowed; otherwise
    /// the caller waits (`node_turn`).
    fn turn(&mut self, own_thread: bool) -> Turn {
        let spin = self.shared.cfg.spin;
        let stopping = self.shared.stop.load(Ordering::Acquire);
        if stopping && self.in_flight == 0 {
            return Turn::Done;
        }
        let queued = if stopping { 0 } else { self.fill() };
        if self.unwoken {
            // The last drain finished samples: fill() queued the reads
            // that replace them; get those onto the device, then wake.
            self.flush();
        }
        let result = self.submit_error.take().map_or(Ok(()), Err);
        // fill() stops only when nothing more can be queued until a read
        // completes or the consumer releases space, so with reads in
        // flight, submitting and waiting in one io_uring_enter loses
        // nothing (after busy-polling for `spin`, if configured).
        let wait = own_thread && self.in_flight > 0 && self.last_progress.elapsed() >= spin;
        self.unsubmitted = 0;
        self.stall
            .lap(&self.shared.stats[self.index as usize].loop_stalls);
        let submitted = result.and_then(|()| self.backend.submit(wait));
        if wait {
            self.stall.resume();
        }
        match submitted {
            Ok(()) => {}
            // EAGAIN/EBUSY/EINTR: the reads stay queued; drain what
            // completed and submit again next tick.
            Err(e) if transient_submit_error(&e) => {}
            Err(e) => {
                // The ring stopped working: fail every sample in
                // flight, cancel and reap their reads (they target the
                // ring, which may be freed or reused after we return)
                // and stop.
                log::error!("poller {}: io_uring submit failed: {e}", self.index);
                self.fail_all(e);
                return Turn::Done;
            }
        }
        let n = self.backend.drain(&mut self.completions);
        self.stall.phase(Phase::Reap);
        for i in 0..n {
            let c = self.completions[i];
            self.complete(c);
        }
        if n > 0 {
            self.last_progress = Instant::now();
            if self.last_publish.elapsed() >= Duration::from_millis(100) {
                self.publish_stats();
            }
        }
        #[cfg(debug_assertions)]
        self.check_pools();
        if queued > 0 || n > 0 {
            return Turn::Busy;
        }
        if self.in_flight > 0 {
            return Turn::InFlight;
        }
        if stopping || self.last_progress.elapsed() < spin {
            std::hint::spin_loop();
            return Turn::Busy;
        }
        // Nothing in flight and nothing allowed: the ring is full. Say
        // what we wait for, look once more, then sleep; the release that
        // makes it writable wakes us (the timeout only bounds a stop).
        self.publish_stats();
        let i = self.index as usize;
        self.stall.lap(&self.shared.stats[i].loop_stalls);
        self.shared.park_for(i, self.pending.as_ref());
        let writable = self.pending.is_some_and(|p| self.shared.writable(&p));
        if !own_thread {
            // Cleared at this poller's next turn (`node_turn`).
            self.parked = true;
            return if writable { Turn::Busy } else { Turn::Idle };
        }
        if !writable {
            std::thread::park_timeout(Duration::from_millis(50));
        }
        self.shared.park_for(i, None);
        self.stall.resume();
        Turn::Busy
    }

    /// After the last turn: gives back what the open samples held, and
    /// hands the backend back with nothing in flight (it is reused by the
    /// next run or dropped, and the ring freed, after this).
    pub(crate) fn finish(mut self) -> PollerIo {
        self.close_open_groups();
        assert_eq!(
            self.backend.in_flight(),
            0,
            "poller {} returns with I/O in flight",
            self.index
        );
        self.shared.wake_if_ready();
        self.publish_stats();
        self.into_io()
    }

    /// The backend and its registration, kept for the loader's next run.
    fn into_io(self) -> PollerIo {
        PollerIo {
            io: self.backend,
            registered: self.fixed,
        }
    }

    /// The pools' invariants (debug builds, every tick): every op slot is
    /// free or in flight, every in-flight op belongs to an open group, and
    /// the backend has exactly our reads in flight.
    #[cfg(debug_assertions)]
    fn check_pools(&self) {
        self.ops.check();
        self.groups.check();
        assert_eq!(
            self.ops.len(),
            self.in_flight,
            "op slots in use vs reads in flight"
        );
        for (_, op) in self.ops.iter() {
            assert!(
                self.groups.contains(op.group as usize),
                "an op of a closed group"
            );
        }
        assert_eq!(
            self.backend.in_flight(),
            self.in_flight,
            "backend in flight"
        );
    }

    /// Submits the reads queued so far, then wakes the consumer if a sample
    /// it sleeps on was marked ready. In this order because the device is
    /// idle for as long as the poller takes between a burst of completions
    /// and the next submission, and waking the consumer (a futex wake, often
    /// a cross-core interrupt) is the slow part; with small samples that gap
    /// set the throughput (BENCHMARKS.md, "Small samples").
    fn flush(&mut self) {
        self.submit_queued();
        if self.unwoken {
            self.shared.wake_if_ready();
            self.unwoken = false;
        }
    }

    /// Submits the reads pushed since the last submission, unless a
    /// submission already failed (the run loop then fails everything).
    /// Returns whether the reads went out.
    fn submit_queued(&mut self) -> bool {
        if self.submit_error.is_some() {
            return false;
        }
        if self.unsubmitted > 0 {
            if let Err(e) = self.backend.submit(false) {
                self.submit_error = Some(e);
                return false;
            }
            self.unsubmitted = 0;
        }
        true
    }

    /// Queues reads while slots, flow control and the queue allow. Returns
    /// how many samples or parts were started.
    fn fill(&mut self) -> usize {
        let mut started = 0;
        self.stall.phase(Phase::Submit);
        loop {
            if let Some(gi) = self.partial {
                match self.issue_parts(gi) {
                    (n, true) => {
                        started += n;
                        self.partial = None;
                    }
                    (n, false) => return started + n,
                }
            }
            if self.ops.is_full() || self.groups.is_full() {
                return started;
            }
            if let Some(p) = self.retry.pop() {
                // Its slot in the ring is writable still (it was when its
                // cache read was queued, and nothing was published since).
                match self.open_group(p, false) {
                    Ok(gi) => self.partial = Some(gi),
                    Err(e) => {
                        self.fail(&p, e);
                        started += 1;
                    }
                }
                continue;
            }
            let p = match self.pending.take() {
                Some(p) => p,
                None => {
                    let input = &self.shared.input;
                    self.cursor.next_with(|id| input.sample(id).len as u64)
                }
            };
            // The scan for this poller's next sample stops at flow control
            // too, so a stretch of samples that are not its own (other
            // pollers', or remote in cluster mode) is walked only as far as
            // the ring allows, never ahead without bound.
            if !self.shared.writable(&p) {
                self.pending = Some(p);
                return started;
            }
            if p.v >= self.shared.geo.ring_bytes && !self.registration_tried {
                // The ring's second lap: its pages have all been written
                // (or are being), so pinning them costs no faults now.
                self.registration_tried = true;
                let sh = &self.shared;
                self.fixed = sh
                    .registration
                    .register(&mut *self.backend, &sh.ring, &sh.geo);
            }
            // Every P-th sample is this poller's; from a bucket, every P-th
            // run of REMOTE_RUN, so that neighbouring samples a block
            // shuffle puts together reach one backend and merge into one
            // GET (ring/store.rs) instead of alternating between pollers.
            let turn = if self.remote { p.g / REMOTE_RUN } else { p.g };
            if turn % self.count != self.index || !self.shared.is_local(p.id) {
                continue;
            }
            if p.v < self.shared.geo.ring_bytes {
                // The first lap: the sample's pages exist before its read
                // is queued (landing/mod.rs `populate_to`).
                self.shared.ring.populate_to(p.v_end);
            }
            let dst = self.dst(&p);
            if p.len == 0 {
                self.shared.publish(p.g, CODE_OK, VIA_DISK);
                started += 1;
                continue;
            }
            if self.shared.cfg.tier_views
                && self.shared.tier.as_ref().is_some_and(|t| t.is_filled(p.id))
            {
                // Handed out in place: nothing to copy, the slot stays
                // unwritten (the consumer reads the tier for CODE_TIER).
                self.shared.stats[self.index as usize]
                    .tier_hits
                    .fetch_add(1, Ordering::Relaxed);
                self.shared.publish(p.g, CODE_TIER, VIA_TIER);
                started += 1;
                continue;
            }
            if (self.unwoken || self.unsubmitted > 0)
                && self.shared.tier.as_ref().is_some_and(|t| t.is_member(p.id))
            {
                // A run of tier copies can take a while: start the queued
                // reads and wake the consumer for finished ones first.
                self.flush();
            }
            if let Some(tier) = &self.shared.tier {
                self.stall.phase(Phase::Tier);
                // SAFETY: dst..dst+len is this sample's slot, inside the ring
                // and outside the consumer's window (flow control above).
                if unsafe { tier.copy_out(p.id, p.len as usize, dst) } {
                    self.shared.stats[self.index as usize]
                        .tier_hits
                        .fetch_add(1, Ordering::Relaxed);
                    self.shared.publish(p.g, CODE_OK, VIA_TIER);
                    started += 1;
                    continue;
                }
            }
            // This node's copies demoted for the epoch (they kept
            // failing): the network thread serves the sample from the next
            // holder or the source, without a read that would fail again.
            if let Some(e) = self
                .shared
                .net
                .as_ref()
                .and_then(|n| n.local_demoted(p.pos.epoch))
            {
                self.local_failed(&p, e);
                started += 1;
                continue;
            }
            match self.open_group(p, true) {
                Ok(gi) => self.partial = Some(gi),
                Err(e) => {
                    self.fail(&p, e);
                    started += 1;
                }
            }
        }
    }

    fn dst(&self, p: &Placed) -> *mut u8 {
        // SAFETY: phys + slot <= ring length by the schedule's construction.
        unsafe {
            self.shared
                .ring
                .as_mut_ptr()
                .add(p.phys(&self.shared.geo) as usize)
        }
    }

    /// Takes a group record for `p` (the caller checked one is free). With
    /// `use_cache`, a sample that goes to the source is read from the cache
    /// area where the planner says it is there (and is), or kept there.
    fn open_group(&mut self, p: Placed, use_cache: bool) -> Result<u32, Error> {
        let sh = &self.shared;
        let (dataset, input, local) = sh.input.part(p.id);
        // A mixture's extents are registered after the parts before it;
        // its source files are cached after theirs.
        let (extent_base, file_base) = match &sh.input {
            Input::Mix(m) => (m.extent_base[dataset], m.file_base[dataset]),
            _ => (0, 0),
        };
        let cat = input.catalog();
        let in_space = match input {
            Input::Space { space, extents } => space.location(local).map(|loc| (loc, extents)),
            _ => None,
        };
        let mut cache_admit = [None; 2];
        let mut cache_hit = None;
        // Fastest level first: the first that holds the sample gives it;
        // each level's planner sees every sample it plans for, in order,
        // and a level below one that gave it keeps it only if its plan
        // says so (an admit, or a slot planned as held but found empty).
        for (level, rc) in sh
            .cache_levels()
            .filter(|(_, rc)| use_cache && (in_space.is_none() || rc.area.in_memory()))
        {
            let plan = rc.decide(&p, &|id| sh.input.sample(id).len as u64, &|q| {
                sh.cache_plans(rc, q)
            });
            match plan {
                // An admit into a slot that holds the sample already (in
                // the node's area, another rank read it first, ahead of
                // the order the plan assumed): read it from there.
                Plan::Hit(slot) | Plan::Admit(slot)
                    if cache_hit.is_none() && rc.begin_read(slot, p.id) =>
                {
                    if matches!(plan, Plan::Hit(_)) {
                        rc.area.planned_hit();
                    }
                    let (at, slot_bytes) = rc.area.slot(slot);
                    // Whole blocks for O_DIRECT, within the ring's slot for
                    // the sample and the area's.
                    let want = sh.geo.slot(p.len).min(slot_bytes);
                    cache_hit = Some((Target::Fd(rc.area.data_fd()), at, want, level, slot));
                }
                // Planned as held but not there (its write was skipped or
                // failed): the slot is still this sample's, so fill it.
                Plan::Hit(slot) if rc.area.slot_empty(slot) => {
                    if cache_hit.is_none() {
                        rc.area.planned_hit();
                    }
                    cache_admit[level] = Some(slot);
                }
                Plan::Admit(slot) => cache_admit[level] = Some(slot),
                // Held here, but given by the level above: not counted
                // as this level's planned hit (it was not read here).
                Plan::Hit(_) if cache_hit.is_some() => {}
                Plan::Hit(_) => rc.area.planned_hit(),
                Plan::Source => {}
            }
        }
        let (target, offset, want, file, lease) = match input {
            // From a slot of the cache area: `file` names the slot.
            _ if cache_hit.is_some() => {
                let (target, at, want, _, slot) = cache_hit.expect("checked");
                (target, at, want, slot, None)
            }
            Input::Space { space, .. } if in_space.is_some() => {
                let (loc, extents) = in_space.expect("checked");
                let target = if sh.fixed_files {
                    Target::Fixed(extent_base + loc.extent)
                } else {
                    Target::Fd(extents[loc.extent as usize].as_raw_fd())
                };
                // Whole blocks of its own space's alignment: a mixture's
                // ring slots are aligned to the largest of its spaces',
                // and a space's extent ends at its own (its last sample's
                // slot rounded to the ring's would read past the end).
                let align = u64::from(space.params().align_bytes);
                let want = p.len.next_multiple_of(align).max(align);
                debug_assert!(
                    want <= sh.geo.slot(p.len),
                    "a space's alignment divides the ring's"
                );
                (target, loc.offset, want, loc.extent, None)
            }
            Input::Mix(_) => unreachable!("a mixture's parts are spaces or sources"),
            Input::Source { .. } if self.remote => {
                let s = cat.sample(local);
                let target = Target::Object(file_base + s.file);
                (target, s.offset, s.len as u64, s.file, None)
            }
            // A partial space over a bucket: the backend GETs it
            // (ring/split.rs; a mixture of such is refused: input.rs).
            Input::Space { .. }
                if matches!(self.partial_roots[dataset], Some(PartialSource::Bucket)) =>
            {
                let s = cat.sample(local);
                (Target::Object(s.file), s.offset, s.len as u64, s.file, None)
            }
            // A source, or a sample a partial space leaves in its source
            // (the pollers read only the samples a cluster's space holds:
            // Shared::is_local): the file, through the descriptor cache.
            Input::Source { .. } | Input::Space { .. } => {
                let s = cat.sample(local);
                self.path_buf.clear();
                match input {
                    Input::Source { root, .. } => self.path_buf.push(root),
                    _ => match &self.partial_roots[dataset] {
                        Some(PartialSource::Files(root)) => self.path_buf.push(root),
                        _ => unreachable!("only a partial space leaves samples to its source"),
                    },
                }
                self.path_buf.push(cat.file(s.file).name);
                let path = &self.path_buf;
                let stall = &mut self.stall;
                let lease = self
                    .fds
                    .acquire(file_base + s.file, || {
                        // Not cached: a blocking open (named in a stall).
                        stall.phase(Phase::Open);
                        std::fs::File::open(path)
                    })
                    .map_err(|e| Error::ReadFailed {
                        sample: p.id,
                        path: self.path_buf.clone(),
                        offset: s.offset,
                        errno_name: errno_name(e.raw_os_error().unwrap_or(0)),
                        source: e.into(),
                    })?;
                let fd = self.fds.fd(&lease);
                (Target::Fd(fd), s.offset, s.len as u64, s.file, Some(lease))
            }
        };
        let from_source = in_space.is_none();
        let gi = self.groups.insert(Group {
            placed: p,
            target,
            file,
            dataset: dataset as u32,
            from_source,
            offset,
            want,
            parts: want.div_ceil(self.part_bytes) as u32,
            issued: 0,
            done: 0,
            lease,
            error: None,
            submitted: Instant::now(),
            cache_read: cache_hit.map(|h| (h.3, h.4)),
            cache_admit,
        });
        let gi = gi.unwrap_or_else(|_| panic!("caller checked a free group"));
        Ok(gi as u32)
    }

    /// Issues the group's remaining parts while op slots and the queue allow.
    /// Returns (parts issued, whether all are issued now).
    fn issue_parts(&mut self, gi: u32) -> (usize, bool) {
        let mut n = 0;
        loop {
            let g = self.groups.get(gi as usize).expect("open group");
            if g.issued == g.parts {
                return (n, true);
            }
            let Some(slot) = self.ops.vacant_key().map(|k| k as u32) else {
                return (n, false);
            };
            let part = g.issued;
            let op = self.read_op(slot, gi, part);
            // SAFETY: the part's destination lies in this sample's ring slot,
            // which no one else touches until we publish it ready.
            if !unsafe { self.backend.push(&op) } {
                return (n, false);
            }
            let taken = self.ops.insert(Op {
                group: gi,
                part,
                attempts: 1,
            });
            debug_assert!(matches!(taken, Ok(k) if k == slot as usize));
            self.groups.get_mut(gi as usize).expect("open group").issued += 1;
            self.in_flight += 1;
            n += 1;
            self.unsubmitted += 1;
            // A full batch goes to the device now, not after the rest of
            // the tick's reads are queued.
            if self.unsubmitted >= self.shared.cfg.submit_batch && !self.submit_queued() {
                return (n, false);
            }
        }
    }

    fn part_range(&self, g: &Group, part: u32) -> (u64, u64) {
        let start = part as u64 * self.part_bytes;
        (start, (g.want - start).min(self.part_bytes))
    }

    fn read_op(&self, slot: u32, gi: u32, part: u32) -> ReadOp {
        let g = self.groups.get(gi as usize).expect("open group");
        let (start, len) = self.part_range(g, part);
        let seg = self.shared.geo.segment();
        ReadOp {
            user_data: slot as u64,
            target: g.target,
            // SAFETY: start + len <= want <= the sample's slot in the ring.
            buf: unsafe { self.dst(&g.placed).add(start as usize) },
            len: len as u32,
            offset: g.offset + start,
            buf_index: self
                .fixed
                .then(|| (g.placed.phys(&self.shared.geo) / seg) as u16),
        }
    }

    fn complete(&mut self, c: Completion) {
        let slot = c.user_data as u32;
        // A completion for a slot with no read in flight means the ring
        // and this poller disagree about what the kernel is writing: stop
        // (the crash guard names it) rather than guess.
        let Some(mut op) = self.ops.get(slot as usize).copied() else {
            panic!("poller {}: completion for idle slot {slot}", self.index);
        };
        let g = self.groups.get(op.group as usize).expect("open group");
        let (_, part_len) = self.part_range(g, op.part);
        // Extents are padded to the alignment and source reads ask for the
        // exact sample, so every part must come back whole.
        let expected = part_len;
        let outcome = match c.result {
            r if r < 0 => {
                let errno = -r;
                if (errno == libc::EAGAIN || errno == libc::EINTR) && op.attempts < MAX_ATTEMPTS {
                    Err(None)
                } else {
                    Err(Some(self.read_failed(g, op.part, errno)))
                }
            }
            r if (r as u64) < expected => {
                if op.attempts < MAX_ATTEMPTS {
                    Err(None)
                } else {
                    Err(Some(Error::ShortRead {
                        sample: g.placed.id,
                        path: self.file_path(g),
                        offset: g.offset + op.part as u64 * self.part_bytes,
                        expected,
                        got: r as u64,
                        attempts: op.attempts,
                    }))
                }
            }
            _ => Ok(()),
        };
        if let Err(None) = outcome {
            // Retry the same part into the same memory.
            self.shared.stats[self.index as usize]
                .retries
                .fetch_add(1, Ordering::Relaxed);
            op.attempts += 1;
            let rop = self.read_op(slot, op.group, op.part);
            // SAFETY: the same slot memory as the first attempt, still ours.
            if unsafe { self.backend.push(&rop) } {
                self.ops[slot as usize] = op;
                return;
            }
            let g = self.groups.get(op.group as usize).expect("open group");
            let e = self.read_failed(g, op.part, libc::EBUSY);
            self.part_done(slot, op.group, Some(e));
            return;
        }
        self.part_done(slot, op.group, outcome.err().flatten());
    }

    /// Frees the op slot; finishes the sample when its last part is in.
    fn part_done(&mut self, slot: u32, gi: u32, error: Option<Error>) {
        self.ops.remove(slot as usize);
        self.in_flight -= 1;
        let g = self.groups.get_mut(gi as usize).expect("open group");
        g.done += 1;
        if let Some(e) = error {
            // Issue no more parts; report the first error once all are back.
            g.parts = g.issued;
            g.error.get_or_insert(e);
        }
        if g.done < g.parts {
            return;
        }
        let mut g = self.groups.remove(gi as usize);
        if self.partial == Some(gi) {
            self.partial = None;
        }
        if let Some(lease) = g.lease.take() {
            // Its reads are done: the descriptor may be closed or reused.
            self.fds.release(lease);
        }
        if let Some((level, slot)) = g.cache_read {
            self.cache_read_done(&g, level, slot);
            return;
        }
        if let Some(e) = g.error {
            self.local_failed(&g.placed, e);
            return;
        }
        let micros = g.submitted.elapsed().as_micros() as u64;
        let _ = self.hist.record(micros.max(1));
        self.shared.stats[self.index as usize].latency_buckets
            [crate::agent::segment::latency_bucket(micros)]
        .fetch_add(1, Ordering::Relaxed);
        let p = g.placed;
        let dst = self.dst(&p);
        let partial_source = g.from_source && matches!(self.input_of(&g), Input::Space { .. });
        if self.shared.cfg.verify_crc32c || partial_source {
            let want = self.shared.input.sample(p.id).crc32c;
            let off = p.phys(&self.shared.geo) as usize;
            // SAFETY: every part completed into this slot, which is still
            // ours (in the ring, host memory: a GPU ring has no space).
            let Some(got) = (unsafe { self.shared.ring.crc32c(off, p.len as usize) }) else {
                // The agent's view of a rank's ring faulted (the rank took
                // the page away): that rank's error, as a read into the
                // page would have been.
                let e = self.read_failed(&g, 0, libc::EFAULT);
                self.local_failed(&p, e);
                return;
            };
            if got != want {
                let e = Error::SampleCorrupt {
                    sample: p.id,
                    path: self.file_path(&g),
                    expected: want,
                    computed: got,
                };
                self.local_failed(&p, e);
                return;
            }
        }
        if let Some(tier) = &self.shared.tier {
            // SAFETY: the slot holds the sample's bytes and is still ours.
            unsafe { tier.fill(p.id, p.len as usize, dst) };
        }
        self.admit(&g, self.shared.cfg.verify_crc32c || partial_source);
        let st = &self.shared.stats[self.index as usize];
        if partial_source {
            st.source_reads.fetch_add(1, Ordering::Relaxed);
            st.source_bytes.fetch_add(p.len, Ordering::Relaxed);
        } else {
            st.disk_reads.fetch_add(1, Ordering::Relaxed);
        }
        // A bucket read directly is the source too (counted with disk
        // reads, as every sample of a `source` loader is).
        let via = if partial_source || self.remote {
            VIA_SOURCE
        } else {
            VIA_DISK
        };
        self.shared.mark_ready(p.g, CODE_OK, via);
        self.unwoken = true;
    }

    /// Keeps `g`'s sample, read into its ring slot, in the cache levels
    /// that planned it (`g.cache_admit`). `checked`: its bytes were
    /// checked against the catalog's CRC already; else a level on disk
    /// checks them now (only the catalog's bytes are kept). An area in
    /// memory checks the copy its writer keeps instead (writer.rs,
    /// `write_slot`): one check, and of the bytes kept, not of a ring a
    /// rank can still write.
    fn admit(&self, g: &Group, checked: bool) {
        if g.cache_admit == [None; 2] {
            // Nothing to keep (every sample of a loader without a cache):
            // no catalog lookup on the way to the consumer.
            return;
        }
        let p = g.placed;
        let want = self.shared.input.sample(p.id).crc32c;
        let off = p.phys(&self.shared.geo) as usize;
        let mut checked = checked;
        for (level, rc) in self.shared.cache_levels() {
            let Some(slot) = g.cache_admit[level] else {
                continue;
            };
            if !checked && !rc.area.in_memory() {
                // SAFETY: every part completed into this slot, which is
                // still ours until it is marked ready.
                if unsafe { self.shared.ring.crc32c(off, p.len as usize) } != Some(want) {
                    continue;
                }
                checked = true;
            }
            // SAFETY: as above.
            let bytes = unsafe { std::slice::from_raw_parts(self.dst(&p), p.len as usize) };
            let faultable = self.shared.ring.reads_through_kernel();
            rc.area.admit(slot, p.id, want, bytes, faultable);
        }
    }

    /// A read from the cache area is in: delivered if its bytes are the
    /// catalog's, else (an I/O error, a short read, rot on the disk) the
    /// slot is emptied and the sample read from the source instead. An
    /// area in memory is not checked again unless `verify_crc32c` asks:
    /// its bytes were checked against the catalog when kept, memory does
    /// not rot as a disk does, and the slot's word keeps a writer off a
    /// slot while it is read (CRC32C was 11 % of the CPU of a run over a
    /// whole space: BENCHMARKS.md, "A cache area in memory").
    fn cache_read_done(&mut self, g: &Group, level: usize, slot: u32) {
        let p = g.placed;
        let rc = self
            .shared
            .cache_level(level)
            .expect("a cache read has its level");
        let check = !rc.area.in_memory() || self.shared.cfg.verify_crc32c;
        let ok = g.error.is_none()
            && (!check || {
                let want = self.shared.input.sample(p.id).crc32c;
                let off = p.phys(&self.shared.geo) as usize;
                // SAFETY: every part completed into this sample's ring slot,
                // which is still ours.
                let Some(got) = (unsafe { self.shared.ring.crc32c(off, p.len as usize) }) else {
                    // The agent's view of a rank's ring faulted (the rank took
                    // the page away): that rank's error; the slot's bytes are
                    // not in question (and no sample came of the read).
                    rc.abandon_read(slot);
                    let e = self.read_failed(g, 0, libc::EFAULT);
                    self.local_failed(&p, e);
                    return;
                };
                got == want
            });
        rc.end_read(slot, p.len, !ok);
        if !ok {
            log::warn!(
                "cache area {}: slot {slot} did not give sample {}'s bytes ({}); emptied, \
                 reading it again from where it lives",
                rc.area.dir().display(),
                p.id,
                g.error
                    .as_ref()
                    .map_or("CRC32C mismatch".to_string(), |e| e.to_string())
            );
            self.retry.push(p);
            return;
        }
        let micros = g.submitted.elapsed().as_micros() as u64;
        let _ = self.hist.record(micros.max(1));
        self.shared.stats[self.index as usize].latency_buckets
            [crate::agent::segment::latency_bucket(micros)]
        .fetch_add(1, Ordering::Relaxed);
        // Kept in the other level too where its plan says so (a read from
        // disk was checked just now; one from memory is checked by `admit`
        // before a disk keeps it).
        self.admit(g, check);
        self.shared.mark_ready(p.g, CODE_OK, VIA_DISK);
        self.unwoken = true;
    }

    /// The named error for part `part` of `g` failing with `errno`.
    fn read_failed(&self, g: &Group, part: u32, errno: i32) -> Error {
        Error::ReadFailed {
            sample: g.placed.id,
            path: self.file_path(g),
            offset: g.offset + part as u64 * self.part_bytes,
            errno_name: errno_name(errno),
            source: std::io::Error::from_raw_os_error(errno).into(),
        }
    }

    /// The input (a mixture's dataset) group `g` reads.
    fn input_of(&self, g: &Group) -> &Input {
        match &self.shared.input {
            Input::Mix(m) => &m.parts[g.dataset as usize],
            input => input,
        }
    }

    fn file_path(&self, g: &Group) -> PathBuf {
        match self.input_of(g) {
            _ if g.cache_read.is_some() => {
                let level = g.cache_read.map_or(0, |(level, _)| level);
                self.shared
                    .cache_level(level)
                    .map_or_else(PathBuf::new, |c| {
                        if c.area.in_memory() {
                            // No file of that name: the memory file's.
                            PathBuf::from(":memory: (memfd kspeed-cache)")
                        } else {
                            c.area.dir().join(crate::cache::DATA_FILE)
                        }
                    })
            }
            Input::Space { space, .. } if g.from_source => space.catalog().file_path(g.file),
            Input::Space { space, .. } => space.extent_path(g.file),
            Input::Source { catalog, root } => root.join(catalog.file(g.file).name),
            Input::Mix(_) => unreachable!("a mixture's parts are spaces or sources"),
        }
    }

    /// Reading sample `p` from this node's space failed (`e`: an I/O error,
    /// a short read, a CRC32C mismatch), and its slot is no longer written
    /// by any read. In cluster mode the network thread serves it instead
    /// from the sample's next holder or the source, as for a node's error
    /// (it reports `e` if none can); alone, the loader fails with `e`.
    fn local_failed(&mut self, p: &Placed, e: Error) {
        match &self.shared.net {
            Some(net) => {
                if let Err(e) = net.hand_over(*p, e) {
                    self.fail(p, e);
                }
            }
            None => self.fail(p, e),
        }
    }

    fn fail(&mut self, p: &Placed, e: Error) {
        super::shared::push_error(&self.shared.errors, p.g, e);
        self.shared.mark_ready(p.g, CODE_ERROR, VIA_DISK);
        self.unwoken = true;
    }

    /// At a stop with nothing in flight, the samples still open (a stop
    /// comes between a sample's parts): their descriptors and cache slots
    /// go back (a slot with a reader left would never be rewritten: the
    /// area lives across runs). Their ring slots are the run's, which ends.
    fn close_open_groups(&mut self) {
        for gi in 0..self.groups.limit() {
            if let Some(g) = self.groups.try_remove(gi) {
                if let Some(lease) = g.lease {
                    self.fds.release(lease);
                }
                if let Some((level, slot)) = g.cache_read {
                    let rc = self
                        .shared
                        .cache_level(level)
                        .expect("a cache read's level");
                    rc.abandon_read(slot);
                }
            }
        }
        self.partial = None;
        self.retry.clear();
    }

    /// The ring failed for good: cancels and reaps every read in flight
    /// (their completions are dropped), fails every open sample with the
    /// named submission error, and records it so the consumer never waits
    /// for this poller's later samples.
    fn fail_all(&mut self, e: std::io::Error) {
        self.backend.cancel_all();
        self.ops.clear();
        self.in_flight = 0;
        self.partial = None;
        let err = Error::Uring {
            what: "submit reads",
            source: std::sync::Arc::new(e),
        };
        while let Some(p) = self.retry.pop() {
            self.fail(&p, err.clone());
        }
        for gi in 0..self.groups.limit() {
            if let Some(g) = self.groups.try_remove(gi) {
                if let Some(lease) = g.lease {
                    // Its reads were reaped above.
                    self.fds.release(lease);
                }
                if let Some((level, slot)) = g.cache_read {
                    let rc = self
                        .shared
                        .cache_level(level)
                        .expect("a cache read's level");
                    rc.abandon_read(slot);
                }
                self.fail(&g.placed, err.clone());
            }
        }
        self.shared.fail_run(err);
    }

    fn publish_stats(&mut self) {
        if self.hist.is_empty() {
            return;
        }
        let mut h = self.shared.stats[self.index as usize]
            .latency
            .lock()
            .expect("not poisoned");
        let _ = h.add(&self.hist);
        drop(h);
        self.hist.reset();
        self.last_publish = Instant::now();
    }
}
