//! The poller: one pinned thread per core that owns an io_uring, reads its
//! share of the schedule (every P-th sample) into the landing ring, and
//! publishes each sample's readiness. One tick: queue what flow control
//! allows, submit once, drain completions into a fixed array, then act on
//! them. No allocation, lock or copy per sample (the memory tier's copy is
//! the tier's point); locks only on the error path and to publish latency
//! histograms every 100 ms.

use std::os::fd::{IntoRawFd, RawFd};
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;

use super::schedule::{Cursor, Placed};
use super::{Input, Shared, CODE_ERROR, CODE_OK};
use crate::error::{errno_name, Error};
use crate::ring::{Completion, IoBackend, ReadOp, Target};

/// Attempts for a read that came back short or was interrupted.
const MAX_ATTEMPTS: u32 = 4;

#[derive(Clone, Copy)]
struct InFlight {
    placed: Placed,
    /// Bytes asked for.
    want: u32,
    /// File offset.
    offset: u64,
    target: Target,
    /// Extent index or source file index, for messages.
    file: u32,
    /// Descriptor to close when done (source mode).
    owned_fd: Option<RawFd>,
    attempts: u32,
    submitted: Instant,
}

pub(crate) struct Poller {
    shared: Arc<Shared>,
    index: u64,
    count: u64,
    backend: Box<dyn IoBackend>,
    cursor: Cursor,
    pending: Option<Placed>,
    slots: Vec<Option<InFlight>>,
    free: Vec<u32>,
    completions: Vec<Completion>,
    hist: Histogram<u64>,
    last_publish: Instant,
    in_flight: usize,
    path_buf: PathBuf,
}

impl Poller {
    pub(crate) fn new(
        shared: Arc<Shared>,
        index: usize,
        count: usize,
        backend: Box<dyn IoBackend>,
    ) -> Self {
        let qd = shared.cfg.queue_depth as usize;
        let cursor = Cursor::new(shared.sampler.clone(), shared.geo, shared.start);
        Poller {
            index: index as u64,
            count: count as u64,
            backend,
            cursor,
            pending: None,
            slots: vec![None; qd],
            free: (0..qd as u32).rev().collect(),
            completions: vec![Completion::default(); qd],
            hist: Histogram::new_with_bounds(1, 60_000_000, 2).expect("valid bounds"),
            last_publish: Instant::now(),
            in_flight: 0,
            path_buf: PathBuf::with_capacity(4096),
            shared,
        }
    }

    /// Runs until the loader stops, then waits for in-flight reads (they
    /// write into the ring) and hands the backend back for reuse.
    pub(crate) fn run(mut self) -> Box<dyn IoBackend> {
        let spin = self.shared.cfg.spin;
        let mut idle_since: Option<Instant> = None;
        loop {
            let stopping = self.shared.stop.load(Ordering::Acquire);
            if stopping && self.in_flight == 0 {
                break;
            }
            let queued = if stopping { 0 } else { self.fill() };
            let waiting = queued == 0
                && self.in_flight > 0
                && idle_since.is_some_and(|t| t.elapsed() >= spin);
            if let Err(e) = self.backend.submit(waiting, Duration::from_millis(10)) {
                // Submission itself failed: fail every sample in flight
                // (they would never complete) and stop.
                log::error!("poller {}: io_uring submit failed: {e}", self.index);
                self.fail_all(e);
                break;
            }
            let n = self.backend.drain(&mut self.completions);
            for i in 0..n {
                let c = self.completions[i];
                self.complete(c);
            }
            if n > 0 && self.last_publish.elapsed() >= Duration::from_millis(100) {
                self.publish_stats();
            }
            if queued > 0 || n > 0 {
                idle_since = None;
                continue;
            }
            let since = *idle_since.get_or_insert_with(Instant::now);
            if self.in_flight == 0 && since.elapsed() >= spin && !stopping {
                // Nothing to read until the consumer releases ring space:
                // sleep; release() unparks us.
                self.publish_stats();
                std::thread::park_timeout(Duration::from_millis(50));
            } else {
                std::hint::spin_loop();
            }
        }
        self.publish_stats();
        self.backend
    }

    fn next_own(&mut self) -> Placed {
        loop {
            let p = self.cursor.next(self.shared.input.catalog());
            if p.g % self.count == self.index {
                return p;
            }
        }
    }

    fn allowed(&self, p: &Placed) -> bool {
        let sh = &self.shared;
        p.v_end <= sh.released_v.load(Ordering::Acquire) + sh.geo.ring_bytes
            && p.g
                < sh.released_g
                    .load(Ordering::Acquire)
                    .saturating_add(sh.cfg.lookahead)
    }

    /// Queues reads while slots, flow control and the queue allow. Returns
    /// how many samples were started (read or served from memory).
    fn fill(&mut self) -> usize {
        let mut started = 0;
        while !self.free.is_empty() {
            let p = match self.pending.take() {
                Some(p) => p,
                None => self.next_own(),
            };
            if !self.allowed(&p) {
                self.pending = Some(p);
                break;
            }
            let dst = self.dst(&p);
            if p.len == 0 {
                self.finish_ok(&p);
                started += 1;
                continue;
            }
            if let Some(tier) = &self.shared.tier {
                // SAFETY: dst..dst+len is this sample's slot, inside the ring
                // and outside the consumer's window (flow control above).
                if unsafe { tier.copy_out(p.id, p.len as usize, dst) } {
                    self.shared.stats[self.index as usize]
                        .tier_hits
                        .fetch_add(1, Ordering::Relaxed);
                    self.finish_ok(&p);
                    started += 1;
                    continue;
                }
            }
            match self.start_read(p, dst) {
                Ok(true) => started += 1,
                Ok(false) => {
                    self.pending = Some(p);
                    break;
                }
                Err(e) => {
                    self.fail(&p, e);
                    started += 1;
                }
            }
        }
        started
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

    /// Starts the read of `p`; Ok(false) when the submission queue is full.
    fn start_read(&mut self, p: Placed, dst: *mut u8) -> Result<bool, Error> {
        let sh = &self.shared;
        let cat = sh.input.catalog();
        let (target, offset, want, file, owned_fd) = match &sh.input {
            Input::Space { space, .. } => {
                let loc = space
                    .location(p.id)
                    .expect("loader checked the space holds every sample");
                let want = sh.geo.slot(p.len).min(u32::MAX as u64) as u32;
                (
                    Target::Fixed(loc.extent),
                    loc.offset,
                    want,
                    loc.extent,
                    None,
                )
            }
            Input::Source { root, .. } => {
                let s = cat.sample(p.id);
                self.path_buf.clear();
                self.path_buf.push(root);
                self.path_buf.push(cat.file(s.file).name);
                let f = std::fs::File::open(&self.path_buf).map_err(|e| Error::ReadFailed {
                    sample: p.id,
                    path: self.path_buf.clone(),
                    offset: s.offset,
                    errno_name: errno_name(e.raw_os_error().unwrap_or(0)),
                    source: e,
                })?;
                let fd = f.into_raw_fd();
                (Target::Fd(fd), s.offset, s.len, s.file, Some(fd))
            }
        };
        let slot = *self.free.last().expect("caller checked a free slot");
        let op = self.read_op(slot, target, dst, want, offset, &p);
        // SAFETY: dst..dst+want lies in this sample's ring slot, which no one
        // else touches until we publish it ready.
        if !unsafe { self.backend.push(&op) } {
            if let Some(fd) = owned_fd {
                // SAFETY: fd came from into_raw_fd above and is closed once.
                unsafe { libc::close(fd) };
            }
            return Ok(false);
        }
        self.free.pop();
        self.slots[slot as usize] = Some(InFlight {
            placed: p,
            want,
            offset,
            target,
            file,
            owned_fd,
            attempts: 1,
            submitted: Instant::now(),
        });
        self.in_flight += 1;
        Ok(true)
    }

    fn read_op(
        &self,
        slot: u32,
        target: Target,
        dst: *mut u8,
        want: u32,
        offset: u64,
        p: &Placed,
    ) -> ReadOp {
        let seg = self.shared.geo.segment();
        ReadOp {
            user_data: slot as u64,
            target,
            buf: dst,
            len: want,
            offset,
            buf_index: self
                .shared
                .fixed_buffers
                .then(|| (p.phys(&self.shared.geo) / seg) as u16),
        }
    }

    fn complete(&mut self, c: Completion) {
        let slot = c.user_data as u32;
        let Some(mut f) = self.slots[slot as usize] else {
            log::error!("poller {}: completion for idle slot {slot}", self.index);
            return;
        };
        let retry = match c.result {
            r if r < 0 => {
                let errno = -r;
                if (errno == libc::EAGAIN || errno == libc::EINTR) && f.attempts < MAX_ATTEMPTS {
                    true
                } else {
                    let e = Error::ReadFailed {
                        sample: f.placed.id,
                        path: self.file_path(&f),
                        offset: f.offset,
                        errno_name: errno_name(errno),
                        source: std::io::Error::from_raw_os_error(errno),
                    };
                    self.release_slot(slot, &f);
                    self.fail(&f.placed, e);
                    return;
                }
            }
            r if (r as u64) < expected_bytes(&f) => {
                if f.attempts < MAX_ATTEMPTS {
                    self.stat_retry();
                    true
                } else {
                    let e = Error::ShortRead {
                        sample: f.placed.id,
                        path: self.file_path(&f),
                        offset: f.offset,
                        expected: expected_bytes(&f),
                        got: r as u64,
                        attempts: f.attempts,
                    };
                    self.release_slot(slot, &f);
                    self.fail(&f.placed, e);
                    return;
                }
            }
            _ => false,
        };
        if retry {
            f.attempts += 1;
            let dst = self.dst(&f.placed);
            let op = self.read_op(slot, f.target, dst, f.want, f.offset, &f.placed);
            // SAFETY: the same slot memory as the first attempt, still ours.
            if unsafe { self.backend.push(&op) } {
                self.slots[slot as usize] = Some(f);
                return;
            }
            let e = Error::ReadFailed {
                sample: f.placed.id,
                path: self.file_path(&f),
                offset: f.offset,
                errno_name: "EBUSY",
                source: std::io::Error::from_raw_os_error(libc::EBUSY),
            };
            self.release_slot(slot, &f);
            self.fail(&f.placed, e);
            return;
        }
        let micros = f.submitted.elapsed().as_micros() as u64;
        let _ = self.hist.record(micros.max(1));
        self.release_slot(slot, &f);
        let p = f.placed;
        let dst = self.dst(&p);
        if self.shared.cfg.verify_crc32c {
            let want = self.shared.input.catalog().sample(p.id).crc32c;
            // SAFETY: the read completed into this slot, which is still ours.
            let got = crc32c::crc32c(unsafe { std::slice::from_raw_parts(dst, p.len as usize) });
            if got != want {
                let e = Error::SampleCorrupt {
                    sample: p.id,
                    path: self.file_path(&f),
                    expected: want,
                    computed: got,
                };
                self.fail(&p, e);
                return;
            }
        }
        if let Some(tier) = &self.shared.tier {
            // SAFETY: the slot holds the sample's bytes and is still ours.
            unsafe { tier.fill(p.id, p.len as usize, dst) };
        }
        self.shared.stats[self.index as usize]
            .disk_reads
            .fetch_add(1, Ordering::Relaxed);
        self.finish_ok(&p);
    }

    fn stat_retry(&self) {
        self.shared.stats[self.index as usize]
            .retries
            .fetch_add(1, Ordering::Relaxed);
    }

    fn release_slot(&mut self, slot: u32, f: &InFlight) {
        if let Some(fd) = f.owned_fd {
            // SAFETY: the descriptor was opened for this read and is closed once.
            unsafe { libc::close(fd) };
        }
        self.slots[slot as usize] = None;
        self.free.push(slot);
        self.in_flight -= 1;
    }

    fn file_path(&self, f: &InFlight) -> PathBuf {
        match &self.shared.input {
            Input::Space { space, .. } => space.extent_path(f.file),
            Input::Source { catalog, root } => root.join(catalog.file(f.file).name),
        }
    }

    fn finish_ok(&self, p: &Placed) {
        self.shared.publish(p.g, CODE_OK);
    }

    fn fail(&self, p: &Placed, e: Error) {
        self.shared
            .errors
            .lock()
            .expect("not poisoned")
            .push((p.g, e));
        self.shared.publish(p.g, CODE_ERROR);
    }

    fn fail_all(&mut self, e: std::io::Error) {
        for slot in 0..self.slots.len() {
            if let Some(f) = self.slots[slot] {
                let err = Error::ReadFailed {
                    sample: f.placed.id,
                    path: self.file_path(&f),
                    offset: f.offset,
                    errno_name: errno_name(e.raw_os_error().unwrap_or(0)),
                    source: std::io::Error::new(e.kind(), e.to_string()),
                };
                if let Some(fd) = f.owned_fd {
                    // SAFETY: opened for this read, closed once.
                    unsafe { libc::close(fd) };
                }
                self.fail(&f.placed, err);
            }
        }
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

/// Bytes a read must return: the whole slot from extents (they are padded
/// to the alignment), exactly the sample from a source file.
fn expected_bytes(f: &InFlight) -> u64 {
    match f.target {
        Target::Fixed(_) => f.want as u64,
        Target::Fd(_) => f.placed.len,
    }
}
