//! The I/O ring: queued reads into caller-owned memory, completions carrying
//! the caller's slot index. [`Uring`] is io_uring (registered buffers and
//! files, batched submission, optional SQPOLL); [`Faulty`] wraps any backend
//! and injects seeded faults (EIO, short reads, delayed completions) so the
//! loader's error paths run everywhere.
//!
//! This module owns the io_uring instance and is one of the few allowed `unsafe`.
//!
//! Why this file is over ~800 lines: about 360 of them are unit tests of the
//! ring and the fault injector.

use std::io;
use std::os::fd::RawFd;

use io_uring::{opcode, types, IoUring};

use crate::error::{Error, Result};

/// Which file a read targets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// Index into the files registered with the ring.
    Fixed(u32),
    /// A plain descriptor.
    Fd(RawFd),
}

/// One read: `len` bytes at `offset` of `target` into `buf`.
#[derive(Debug, Clone, Copy)]
pub struct ReadOp {
    /// Returned in the completion (the caller's slot index).
    pub user_data: u64,
    /// The file.
    pub target: Target,
    /// Destination.
    pub buf: *mut u8,
    /// Bytes.
    pub len: u32,
    /// File offset.
    pub offset: u64,
    /// Registered buffer holding `buf..buf+len`, if any.
    pub buf_index: Option<u16>,
}

/// A completed operation: the slot and the result (bytes read, or -errno).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Completion {
    /// The slot index given in [`ReadOp::user_data`].
    pub user_data: u64,
    /// Bytes read, or a negated errno.
    pub result: i32,
}

/// What the poller needs from an I/O ring.
pub trait IoBackend: Send {
    /// Queues a read. Returns false when the submission queue is full.
    ///
    /// # Safety
    /// `op.buf..op.buf+op.len` must stay valid and unused by anyone else
    /// until the read's completion has been drained.
    unsafe fn push(&mut self, op: &ReadOp) -> bool;
    /// Submits what is queued; with `wait`, blocks until at least one
    /// completion is ready (callers wait only with reads in flight, so one
    /// always comes; no timer is armed, which on VMs costs an exit per wait).
    fn submit(&mut self, wait: bool) -> io::Result<()>;
    /// Moves ready completions into `out`; returns how many.
    fn drain(&mut self, out: &mut [Completion]) -> usize;
    /// Operations pushed whose completion has not been drained yet.
    fn in_flight(&self) -> usize;
    /// Cancels every operation in flight and waits until each has
    /// completed (cancelled, or finished anyway), dropping the completions:
    /// afterwards no operation of this ring references any memory. Used on
    /// error paths, before the memory the operations target is freed or
    /// reused. Blocks as long as the kernel takes (a read already at the
    /// device cannot be cancelled; it finishes).
    fn cancel_all(&mut self);
}

/// Whether a submission error is transient: the kernel is short of memory
/// for the moment (`EAGAIN`), the completion queue is full (`EBUSY`), or a
/// signal came (`EINTR`). The caller reaps completions and submits again
/// (the entries stay queued), as TigerBeetle's `flush_submissions` does.
pub fn transient_submit_error(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EAGAIN) | Some(libc::EBUSY) | Some(libc::EINTR)
    )
}

/// user_data of the cancel operation [`Uring::cancel_all`] queues (never a
/// caller's slot: callers use small indices).
const CANCEL_USER_DATA: u64 = u64::MAX;

/// io_uring settings.
#[derive(Debug, Clone, Copy)]
pub struct UringOptions {
    /// Submission queue entries (a power of two is used).
    pub entries: u32,
    /// Use a kernel submission thread (SQPOLL) that idles after this many ms.
    pub sqpoll_idle_ms: Option<u32>,
}

/// An io_uring instance. It counts the operations in flight (pushed, not
/// yet drained) and, dropped with any, cancels them and waits for their
/// completions first: the memory they target is freed right after a ring
/// is dropped, on every path (a panic included).
pub struct Uring {
    ring: IoUring,
    in_flight: usize,
}

impl Uring {
    /// Creates a ring.
    pub fn new(opts: UringOptions) -> Result<Self> {
        Self::build(opts, false, None)
    }

    /// Creates a ring whose completion queue has `cq_entries` (a power of
    /// two is used; at least the submission queue's): for a user that
    /// bounds what it has in flight by it, so no completion can overflow.
    pub(crate) fn with_cq_entries(opts: UringOptions, cq_entries: u32) -> Result<Self> {
        Self::build(opts, false, Some(cq_entries))
    }

    /// Completions the kernel dropped because the completion queue was
    /// full (the CQ ring's overflow counter): anything but 0 means an
    /// operation will never report back.
    pub(crate) fn cq_overflow(&mut self) -> u32 {
        self.ring.completion().overflow()
    }

    /// Creates a ring for a thread that enters the kernel on every turn of
    /// its loop (the loader's pollers): with `IORING_SETUP_COOP_TASKRUN`
    /// (not with SQPOLL, which refuses it) a completion does not interrupt
    /// the thread with an IPI while it runs in user space; it is processed
    /// at the thread's next system call, which the poller makes every tick.
    /// A thread blocked in a system call is still woken. Kernels before
    /// 5.19 refuse the flag; the ring is then created without it.
    pub fn new_cooperative(opts: UringOptions) -> Result<Self> {
        match Self::build(opts, true, None) {
            Ok(r) => Ok(r),
            Err(_) => Self::build(opts, false, None),
        }
    }

    fn build(opts: UringOptions, coop: bool, cq_entries: Option<u32>) -> Result<Self> {
        let mut b = IoUring::builder();
        if let Some(cq) = cq_entries {
            b.setup_cqsize(cq.next_power_of_two());
        }
        if coop && opts.sqpoll_idle_ms.is_none() {
            b.setup_coop_taskrun();
        }
        // A forked child gets no copy of the rings' mappings (it cannot
        // use this ring; its operations are the parent's).
        b.dontfork();
        if let Some(idle) = opts.sqpoll_idle_ms {
            b.setup_sqpoll(idle);
        }
        let ring = b
            .build(opts.entries.next_power_of_two().max(8))
            .map_err(|e| Error::Uring {
                what: if opts.sqpoll_idle_ms.is_some() {
                    "create ring with SQPOLL"
                } else {
                    "create ring"
                },
                source: e.into(),
            })?;
        Ok(Uring { ring, in_flight: 0 })
    }

    /// Pushes one entry; counts it when it went in.
    ///
    /// # Safety
    /// Whatever memory the entry references must stay valid until its
    /// completion is drained (or [`IoBackend::cancel_all`] returns).
    unsafe fn push_entry(&mut self, e: &io_uring::squeue::Entry) -> bool {
        // SAFETY: per this function's contract.
        let ok = unsafe { self.ring.submission().push(e).is_ok() };
        self.in_flight += ok as usize;
        ok
    }

    /// Moves ready completions into `out` (all of them when `out` is
    /// empty, dropped), counting them off; the cancel operation's own
    /// completion is not one of the caller's. Returns how many were moved.
    fn reap(&mut self, out: &mut [Completion], discard: bool) -> usize {
        let mut n = 0;
        let mut cq = self.ring.completion();
        cq.sync();
        for cqe in &mut cq {
            if cqe.user_data() == CANCEL_USER_DATA {
                continue;
            }
            // Every completion but the cancel's is of an entry counted at
            // push: one more than pushed is a bug (a stray cqe).
            self.in_flight = self
                .in_flight
                .checked_sub(1)
                .expect("ring: a completion with no operation in flight (in_flight counts pushes)");
            if !discard {
                out[n] = Completion {
                    user_data: cqe.user_data(),
                    result: cqe.result(),
                };
                n += 1;
                if n == out.len() {
                    break;
                }
            }
        }
        n
    }

    /// Registers memory regions as fixed buffers (index = position).
    ///
    /// # Safety
    /// Each region must stay mapped and valid for as long as the ring exists.
    pub unsafe fn register_buffers(&self, regions: &[(*mut u8, usize)]) -> Result<()> {
        let iov: Vec<libc::iovec> = regions
            .iter()
            .map(|&(p, l)| libc::iovec {
                iov_base: p.cast(),
                iov_len: l,
            })
            .collect();
        // SAFETY: per this function's contract the regions outlive the ring.
        unsafe { self.ring.submitter().register_buffers(&iov) }.map_err(|e| Error::Uring {
            what: "register buffers",
            source: e.into(),
        })
    }

    /// Shares `other`'s registered buffers with this ring (Linux 6.12+):
    /// the memory is pinned and charged to RLIMIT_MEMLOCK once, not once
    /// per ring.
    pub fn register_buffers_from(&self, other: &Uring) -> Result<()> {
        use std::os::fd::AsRawFd;
        self.ring
            .submitter()
            .register_buffers_clone(other.ring.as_raw_fd())
            .map_err(|e| Error::Uring {
                what: "share registered buffers (register_buffers_clone)",
                source: e.into(),
            })
    }

    /// Registers files (index = position).
    pub fn register_files(&self, fds: &[RawFd]) -> Result<()> {
        self.ring
            .submitter()
            .register_files(fds)
            .map_err(|e| Error::Uring {
                what: "register files",
                source: e.into(),
            })
    }
}

impl Uring {
    /// Queues a `send` of `len` bytes at `buf` on socket `fd` (`more`: the
    /// caller sends the rest of a frame right after, so the kernel may
    /// coalesce). Returns false when the submission queue is full.
    ///
    /// # Safety
    /// `buf..buf+len` must stay valid until the completion is drained.
    pub unsafe fn push_send(
        &mut self,
        user_data: u64,
        fd: RawFd,
        buf: *const u8,
        len: u32,
        more: bool,
    ) -> bool {
        let flags = libc::MSG_NOSIGNAL | if more { libc::MSG_MORE } else { 0 };
        let e = opcode::Send::new(types::Fd(fd), buf, len)
            .flags(flags)
            .build()
            .user_data(user_data);
        // SAFETY: the caller keeps the buffer valid until completion.
        unsafe { self.push_entry(&e) }
    }

    /// Queues a `sendmsg` of `msg` on socket `fd` (a frame header and its
    /// payload from two places in one call, no copy).
    ///
    /// # Safety
    /// `msg`, its iovecs and the memory they describe must stay valid and
    /// unchanged until the completion is drained.
    pub unsafe fn push_sendmsg(
        &mut self,
        user_data: u64,
        fd: RawFd,
        msg: *const libc::msghdr,
    ) -> bool {
        let e = opcode::SendMsg::new(types::Fd(fd), msg)
            .flags(libc::MSG_NOSIGNAL as u32)
            .build()
            .user_data(user_data);
        // SAFETY: per this function's contract.
        unsafe { self.push_entry(&e) }
    }

    /// Queues a `recv` of exactly `len` bytes into `buf` (MSG_WAITALL: the
    /// completion is short only at end of stream or on error).
    ///
    /// # Safety
    /// `buf..buf+len` must stay valid and unused by anyone else until the
    /// completion is drained.
    pub unsafe fn push_recv(&mut self, user_data: u64, fd: RawFd, buf: *mut u8, len: u32) -> bool {
        let e = opcode::Recv::new(types::Fd(fd), buf, len)
            .flags(libc::MSG_WAITALL)
            .build()
            .user_data(user_data);
        // SAFETY: the caller keeps the buffer valid until completion.
        unsafe { self.push_entry(&e) }
    }

    /// Queues a read of 8 bytes from an eventfd (a wake-up).
    ///
    /// # Safety
    /// `buf` must stay valid until the completion is drained.
    pub unsafe fn push_eventfd_read(&mut self, user_data: u64, fd: RawFd, buf: *mut u64) -> bool {
        let e = opcode::Read::new(types::Fd(fd), buf.cast(), 8)
            .build()
            .user_data(user_data);
        // SAFETY: the caller keeps the buffer valid until completion.
        unsafe { self.push_entry(&e) }
    }

    /// Queues a one-shot poll for readability of `fd` (a completion
    /// channel's descriptor, to sleep until an armed CQ has work).
    pub fn push_poll_in(&mut self, user_data: u64, fd: RawFd) -> bool {
        let e = opcode::PollAdd::new(types::Fd(fd), libc::POLLIN as u32)
            .build()
            .user_data(user_data);
        // SAFETY: a poll references no memory of ours.
        unsafe { self.push_entry(&e) }
    }

    /// Submits what is queued without waiting, and makes no system call
    /// when nothing is: for loops that busy-poll something else (RDMA
    /// completion queues) and peek at this ring's completions in passing.
    pub fn submit_pending(&mut self) -> io::Result<()> {
        if self.ring.submission().is_empty() {
            return Ok(());
        }
        match self.ring.submit() {
            Ok(_) => Ok(()),
            Err(e) if matches!(e.raw_os_error(), Some(libc::EINTR) | Some(libc::EBUSY)) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Submits what is queued and waits until a completion is ready or
    /// `timeout` passes (whichever is first).
    pub fn submit_wait_timeout(&mut self, timeout: std::time::Duration) -> io::Result<()> {
        let ts = types::Timespec::from(timeout);
        let args = types::SubmitArgs::new().timespec(&ts);
        match self.ring.submitter().submit_with_args(1, &args) {
            Ok(_) => Ok(()),
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::EINTR) | Some(libc::EBUSY) | Some(libc::ETIME)
                ) =>
            {
                Ok(())
            }
            Err(e) => Err(e),
        }
    }
}

impl IoBackend for Uring {
    /// # Safety
    /// As for [`IoBackend::push`].
    unsafe fn push(&mut self, op: &ReadOp) -> bool {
        let entry = match (op.target, op.buf_index) {
            (Target::Fixed(i), Some(b)) => {
                opcode::ReadFixed::new(types::Fixed(i), op.buf, op.len, b)
                    .offset(op.offset)
                    .build()
            }
            (Target::Fd(fd), Some(b)) => opcode::ReadFixed::new(types::Fd(fd), op.buf, op.len, b)
                .offset(op.offset)
                .build(),
            (Target::Fixed(i), None) => opcode::Read::new(types::Fixed(i), op.buf, op.len)
                .offset(op.offset)
                .build(),
            (Target::Fd(fd), None) => opcode::Read::new(types::Fd(fd), op.buf, op.len)
                .offset(op.offset)
                .build(),
        };
        // SAFETY: the caller keeps the buffer valid until completion (this
        // method's contract); the entry refers to nothing else.
        unsafe { self.push_entry(&entry.user_data(op.user_data)) }
    }

    fn submit(&mut self, wait: bool) -> io::Result<()> {
        let r = if wait {
            self.ring.submit_and_wait(1)
        } else {
            // With SQPOLL this only wakes the kernel thread if it idles.
            self.ring.submit()
        };
        match r {
            Ok(_) => Ok(()),
            // Transient: the entries stay queued; the caller drains and
            // submits again on its next tick.
            Err(e) if transient_submit_error(&e) => Ok(()),
            Err(e) => Err(e),
        }
    }

    fn drain(&mut self, out: &mut [Completion]) -> usize {
        if out.is_empty() {
            return 0;
        }
        self.reap(out, false)
    }

    fn in_flight(&self) -> usize {
        self.in_flight
    }

    fn cancel_all(&mut self) {
        if self.in_flight == 0 {
            return;
        }
        let cancel = opcode::AsyncCancel2::new(types::CancelBuilder::any())
            .build()
            .user_data(CANCEL_USER_DATA);
        let t0 = std::time::Instant::now();
        let mut cancel_queued = false;
        let mut warned_s = 0;
        while self.in_flight > 0 {
            if !cancel_queued {
                // SAFETY: a cancel references no memory of ours. (Not
                // counted: its completion is skipped by reap.)
                cancel_queued = unsafe { self.ring.submission().push(&cancel).is_ok() };
            }
            let ts = types::Timespec::from(std::time::Duration::from_millis(100));
            let args = types::SubmitArgs::new().timespec(&ts);
            if let Err(e) = self.ring.submitter().submit_with_args(1, &args) {
                if !transient_submit_error(&e) && e.raw_os_error() != Some(libc::ETIME) {
                    // Entering the ring fails: the completions still come
                    // (the kernel owns the operations); look for them.
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
            }
            self.reap(&mut [], true);
            let waited_s = t0.elapsed().as_secs();
            if waited_s >= warned_s + 5 {
                warned_s = waited_s;
                log::warn!(
                    "io_uring teardown: {} operation(s) still in flight after {waited_s} s; \
                     waiting for them before their memory is freed",
                    self.in_flight
                );
            }
        }
    }
}

impl Drop for Uring {
    /// Cancels and reaps what is in flight before the ring goes (and, right
    /// after, the memory its operations target).
    fn drop(&mut self) {
        self.cancel_all();
    }
}

/// Fault rates, in parts per million of reads, and the seed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct FaultConfig {
    /// Seed of the fault sequence.
    pub seed: u64,
    /// Reads that fail with EIO.
    pub eio_ppm: u32,
    /// Reads that return fewer bytes than asked (a retry is right).
    pub short_ppm: u32,
    /// Reads whose completion is held back for a few drains.
    pub delay_ppm: u32,
    /// Submissions (io_uring_enter) that fail with a transient `EAGAIN`.
    pub eagain_ppm: u32,
    /// The submission with this number (1-based) and every later one fail
    /// with `submit_errno` (0: never): a ring that stops working.
    pub submit_fail_after: u32,
    /// The errno of those failures (`EINVAL` when 0).
    pub submit_errno: i32,
    /// The drain that brings this many completions in all (0: never)
    /// panics, as a bug in the poller would, with reads in flight.
    pub panic_after_completions: u64,
}

setters!(FaultConfig {
    seed: u64,
    eio_ppm: u32,
    short_ppm: u32,
    delay_ppm: u32,
    eagain_ppm: u32,
    submit_fail_after: u32,
    submit_errno: i32,
    panic_after_completions: u64,
});

/// Wraps a backend and injects faults into its completions.
pub struct Faulty<B> {
    inner: B,
    cfg: FaultConfig,
    state: u64,
    held: Vec<(Completion, u32)>,
    /// Per slot: whether its last completion was an injected short read.
    /// Injected short reads are transient (never twice in a row for a
    /// slot), so a retry always recovers and tests do not depend on timing;
    /// a persistent short read is a real truncation, tested on real files.
    short_last: Vec<bool>,
    submits: u32,
    completions: u64,
}

impl<B: IoBackend> Faulty<B> {
    /// Wraps `inner`. `max_inflight` sizes the held-back list once.
    pub fn new(inner: B, cfg: FaultConfig, max_inflight: usize) -> Self {
        Faulty {
            inner,
            cfg,
            state: crate::hash::mix64(cfg.seed ^ 0xfa17),
            held: Vec::with_capacity(max_inflight),
            short_last: vec![false; max_inflight],
            submits: 0,
            completions: 0,
        }
    }

    fn roll(&mut self, ppm: u32) -> bool {
        self.state = self.state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        crate::hash::reduce(crate::hash::mix64(self.state), 1_000_000) < ppm as u64
    }
}

impl<B: IoBackend> IoBackend for Faulty<B> {
    /// # Safety
    /// As for [`IoBackend::push`].
    unsafe fn push(&mut self, op: &ReadOp) -> bool {
        // SAFETY: forwarded with the same contract.
        unsafe { self.inner.push(op) }
    }

    fn submit(&mut self, wait: bool) -> io::Result<()> {
        self.submits = self.submits.saturating_add(1);
        let fail_at = self.cfg.submit_fail_after;
        if fail_at > 0 && self.submits >= fail_at {
            let errno = match self.cfg.submit_errno {
                0 => libc::EINVAL,
                e => e,
            };
            return Err(io::Error::from_raw_os_error(errno));
        }
        if self.roll(self.cfg.eagain_ppm) {
            // Nothing was submitted: the entries stay queued.
            return Err(io::Error::from_raw_os_error(libc::EAGAIN));
        }
        // Held completions count as ready: do not block on the kernel then.
        self.inner.submit(wait && self.held.is_empty())
    }

    fn in_flight(&self) -> usize {
        self.inner.in_flight() + self.held.len()
    }

    fn cancel_all(&mut self) {
        // Held completions are finished reads: nothing to wait for.
        self.held.clear();
        self.inner.cancel_all();
    }

    fn drain(&mut self, out: &mut [Completion]) -> usize {
        let mut n = 0;
        // Release held completions whose delay ran out.
        let mut i = 0;
        while i < self.held.len() && n < out.len() {
            if self.held[i].1 == 0 {
                out[n] = self.held.swap_remove(i).0;
                n += 1;
            } else {
                self.held[i].1 -= 1;
                i += 1;
            }
        }
        let got = self.inner.drain(&mut out[n..]);
        let mut w = n;
        for r in n..n + got {
            let mut c = out[r];
            let slot = c.user_data as usize;
            let was_short = self.short_last.get(slot).copied().unwrap_or(true);
            let mut short = false;
            if c.result > 0 && self.roll(self.cfg.eio_ppm) {
                c.result = -libc::EIO;
            } else if c.result > 1 && !was_short && self.roll(self.cfg.short_ppm) {
                c.result /= 2;
                short = true;
            }
            if let Some(s) = self.short_last.get_mut(slot) {
                *s = short;
            }
            if self.held.len() < self.held.capacity() && self.roll(self.cfg.delay_ppm) {
                let delay = (self.state % 4) as u32 + 1;
                self.held.push((c, delay));
                continue;
            }
            out[w] = c;
            w += 1;
        }
        self.completions += w as u64;
        let at = self.cfg.panic_after_completions;
        if at > 0 && self.completions >= at {
            panic!("injected panic after {} completions", self.completions);
        }
        w
    }
}

/// A backend over a file image in memory, for tests that run under Miri
/// (which cannot enter io_uring): a read's bytes are copied into its buffer
/// at the submission that follows the push, as the kernel would, and its
/// completion is ready from then on. Pools are sized at construction.
#[cfg(test)]
pub(crate) struct MemBackend {
    image: Vec<u8>,
    queued: Vec<ReadOp>,
    done: std::collections::VecDeque<Completion>,
    in_flight: usize,
    depth: usize,
}

// SAFETY: the queued reads' buffers belong to the caller, who promised
// (push's contract) they stay valid until completion whichever thread
// submits; the backend is used by one thread at a time (&mut self).
#[cfg(test)]
unsafe impl Send for MemBackend {}

#[cfg(test)]
impl MemBackend {
    pub(crate) fn new(image: Vec<u8>, depth: usize) -> Self {
        MemBackend {
            image,
            queued: Vec::with_capacity(depth),
            done: std::collections::VecDeque::with_capacity(depth),
            in_flight: 0,
            depth,
        }
    }
}

#[cfg(test)]
impl IoBackend for MemBackend {
    /// # Safety
    /// As for [`IoBackend::push`].
    unsafe fn push(&mut self, op: &ReadOp) -> bool {
        if self.in_flight == self.depth {
            return false;
        }
        self.queued.push(*op);
        self.in_flight += 1;
        true
    }

    fn submit(&mut self, _wait: bool) -> io::Result<()> {
        for op in self.queued.drain(..) {
            let start = (op.offset as usize).min(self.image.len());
            let n = (op.len as usize).min(self.image.len() - start);
            // SAFETY: push's contract: buf..buf+len is the caller's until
            // the completion is drained.
            unsafe { std::ptr::copy_nonoverlapping(self.image.as_ptr().add(start), op.buf, n) };
            self.done.push_back(Completion {
                user_data: op.user_data,
                result: n as i32,
            });
        }
        Ok(())
    }

    fn drain(&mut self, out: &mut [Completion]) -> usize {
        let mut n = 0;
        while n < out.len() {
            let Some(c) = self.done.pop_front() else {
                break;
            };
            out[n] = c;
            n += 1;
        }
        self.in_flight -= n;
        n
    }

    fn in_flight(&self) -> usize {
        self.in_flight
    }

    fn cancel_all(&mut self) {
        // Queued reads never started; submitted ones are finished.
        self.queued.clear();
        self.done.clear();
        self.in_flight = 0;
    }
}

#[cfg(test)]
mod tests {
    /// A completion the ring did not count (here a NOP pushed behind its
    /// back) is a bug and is named, not absorbed by a saturating count.
    #[test]
    #[should_panic(expected = "a completion with no operation in flight")]
    fn a_stray_completion_is_a_named_bug_not_a_silent_zero() {
        let mut ring = Uring::new(UringOptions {
            entries: 8,
            sqpoll_idle_ms: None,
        })
        .unwrap();
        let nop = opcode::Nop::new().build().user_data(9);
        // SAFETY: a NOP references no memory.
        assert!(unsafe { ring.ring.submission().push(&nop).is_ok() });
        ring.ring.submit_and_wait(1).unwrap();
        let mut out = [Completion::default(); 4];
        ring.drain(&mut out);
    }

    use super::*;
    use std::io::Write;
    use std::os::fd::AsRawFd;

    /// Cancelling reaps a read the kernel still holds (a pipe with no data
    /// yet): afterwards nothing is in flight and data arriving later does
    /// not land in the buffer (a canary). Drop runs the same.
    #[test]
    fn cancel_all_reaps_a_pending_read_before_its_memory_goes() {
        let mut fds = [0; 2];
        // SAFETY: pipe writes two new descriptors into fds.
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        let (r, w) = (fds[0], fds[1]);
        let mut buf = vec![0xaau8; 64];
        let mut ring = Uring::new(UringOptions {
            entries: 8,
            sqpoll_idle_ms: None,
        })
        .unwrap();
        let op = ReadOp {
            user_data: 3,
            target: Target::Fd(r),
            buf: buf.as_mut_ptr(),
            len: 64,
            offset: u64::MAX, // the pipe's own position
            buf_index: None,
        };
        // SAFETY: buf outlives the read: cancel_all below reaps it.
        assert!(unsafe { ring.push(&op) });
        ring.submit(false).unwrap();
        let mut out = [Completion::default(); 4];
        assert_eq!(ring.drain(&mut out), 0, "no data yet");
        assert_eq!(ring.in_flight(), 1);
        ring.cancel_all();
        assert_eq!(ring.in_flight(), 0);
        // The ring lives on: a read that was not cancelled would take this.
        // SAFETY: writes 64 bytes from a live buffer to our pipe.
        let wrote = unsafe { libc::write(w, [0x55u8; 64].as_ptr().cast(), 64) };
        assert_eq!(wrote, 64);
        ring.submit(false).unwrap();
        assert_eq!(ring.drain(&mut out), 0);
        assert!(buf.iter().all(|&b| b == 0xaa), "the cancelled read wrote");
        // And a ring dropped with a read pending returns only once it is
        // reaped (the pipe is empty again after this read).
        let mut sink = [0u8; 64];
        // SAFETY: reads what we wrote back out of our pipe.
        assert_eq!(unsafe { libc::read(r, sink.as_mut_ptr().cast(), 64) }, 64);
        let mut buf2 = vec![0xaau8; 64];
        let op2 = ReadOp {
            buf: buf2.as_mut_ptr(),
            ..op
        };
        // SAFETY: buf2 outlives the ring, whose drop reaps the read.
        assert!(unsafe { ring.push(&op2) });
        ring.submit(false).unwrap();
        let t0 = std::time::Instant::now();
        drop(ring);
        assert!(t0.elapsed() < std::time::Duration::from_secs(5));
        // SAFETY: as above.
        let wrote = unsafe { libc::write(w, [0x55u8; 64].as_ptr().cast(), 64) };
        assert_eq!(wrote, 64);
        assert!(buf2.iter().all(|&b| b == 0xaa), "a read outlived its ring");
        // SAFETY: our descriptors, closed once.
        unsafe {
            libc::close(r);
            libc::close(w);
        }
    }

    /// A cooperative ring (COOP_TASKRUN) still wakes a thread blocked in
    /// io_uring_enter when its read completes: the read from a pipe is
    /// completed by another thread's write while this one waits.
    #[test]
    fn cooperative_ring_wakes_a_waiting_thread() {
        let mut fds = [0; 2];
        // SAFETY: pipe writes two new descriptors into fds.
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        let (r, w) = (fds[0], fds[1]);
        let mut ring = Uring::new_cooperative(UringOptions {
            entries: 8,
            sqpoll_idle_ms: None,
        })
        .unwrap();
        for round in 0..3u8 {
            let mut buf = vec![0u8; 16];
            let op = ReadOp {
                user_data: round as u64,
                target: Target::Fd(r),
                buf: buf.as_mut_ptr(),
                len: 16,
                offset: u64::MAX,
                buf_index: None,
            };
            // SAFETY: buf outlives the read: it is reaped below (or by the
            // ring's drop on a failed assertion).
            assert!(unsafe { ring.push(&op) });
            ring.submit(false).unwrap();
            let writer = std::thread::spawn(move || {
                // SAFETY: writes 16 bytes from a live buffer to our pipe.
                let n = unsafe { libc::write(w, [round + 1; 16].as_ptr().cast(), 16) };
                assert_eq!(n, 16);
            });
            let mut out = [Completion::default(); 4];
            let mut got = 0;
            while got == 0 {
                ring.submit(true).unwrap();
                got = ring.drain(&mut out);
            }
            writer.join().unwrap();
            assert_eq!(
                (got, out[0].user_data, out[0].result),
                (1, round as u64, 16)
            );
            assert!(buf.iter().all(|&b| b == round + 1));
        }
        // SAFETY: our descriptors, closed once.
        unsafe {
            libc::close(r);
            libc::close(w);
        }
    }

    /// Injected submission failures: EAGAIN is transient (the entries stay
    /// queued), a failed ring keeps failing; in-flight counts include held
    /// completions and cancel_all clears them.
    #[test]
    fn faulty_submissions() {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(&[7u8; 4096]).unwrap();
        let file = f.reopen().unwrap();
        let ring = Uring::new(UringOptions {
            entries: 8,
            sqpoll_idle_ms: None,
        })
        .unwrap();
        let cfg = FaultConfig {
            seed: 1,
            submit_fail_after: 3,
            ..Default::default()
        };
        let mut fr = Faulty::new(ring, cfg, 8);
        let mut buf = vec![0u8; 4096];
        let op = ReadOp {
            user_data: 0,
            target: Target::Fd(file.as_raw_fd()),
            buf: buf.as_mut_ptr(),
            len: 4096,
            offset: 0,
            buf_index: None,
        };
        // SAFETY: buf outlives the read (reaped below).
        assert!(unsafe { fr.push(&op) });
        assert_eq!(fr.in_flight(), 1);
        fr.submit(true).unwrap();
        fr.submit(false).unwrap();
        let e = fr.submit(false).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EINVAL));
        assert!(!transient_submit_error(&e));
        assert!(fr.submit(false).is_err(), "a failed ring stays failed");
        assert!(transient_submit_error(&io::Error::from_raw_os_error(
            libc::EAGAIN
        )));
        fr.cancel_all();
        assert_eq!(fr.in_flight(), 0);
    }

    #[test]
    fn reads_a_file_through_io_uring() {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        let data: Vec<u8> = (0..10_000u32).map(|i| i as u8).collect();
        f.write_all(&data).unwrap();
        let mut ring = Uring::new(UringOptions {
            entries: 8,
            sqpoll_idle_ms: None,
        })
        .unwrap();
        let file = f.reopen().unwrap();
        ring.register_files(&[file.as_raw_fd()]).unwrap();
        let mut buf = vec![0u8; 4000];
        let op = ReadOp {
            user_data: 7,
            target: Target::Fixed(0),
            buf: buf.as_mut_ptr(),
            len: 4000,
            offset: 1000,
            buf_index: None,
        };
        // SAFETY: buf outlives the completion drained below.
        assert!(unsafe { ring.push(&op) });
        ring.submit(true).unwrap();
        let mut out = [Completion::default(); 4];
        let mut n = 0;
        while n == 0 {
            n = ring.drain(&mut out);
        }
        assert_eq!(
            out[0],
            Completion {
                user_data: 7,
                result: 4000
            }
        );
        assert_eq!(&buf[..], &data[1000..5000]);
    }

    /// Faults on the in-memory backend (runs under Miri): EIO, short reads
    /// retried into the same memory, held-back completions; every slot ends
    /// with its own bytes or a named failure, nothing stays in flight, and
    /// slots never see another slot's bytes.
    #[test]
    fn faulty_backend_over_memory_keeps_every_read_in_its_slot() {
        const SLOTS: usize = 24;
        const SLOT: usize = 512;
        let image: Vec<u8> = (0..SLOTS * SLOT)
            .map(|i| (i * 7 + i / SLOT) as u8)
            .collect();
        let cfg = FaultConfig {
            seed: 3,
            eio_ppm: 60_000,
            short_ppm: 200_000,
            delay_ppm: 200_000,
            ..Default::default()
        };
        let mut fr = Faulty::new(MemBackend::new(image.clone(), 8), cfg, 8);
        let buf = crate::sys::AlignedBuf::new(SLOTS * SLOT, 4096);
        let op = |slot: usize, done: usize| ReadOp {
            user_data: slot as u64,
            target: Target::Fd(-1),
            // SAFETY: inside the buffer (slot < SLOTS, done < SLOT).
            buf: unsafe { buf.as_mut_ptr().add(slot * SLOT + done) },
            len: (SLOT - done) as u32,
            offset: (slot * SLOT + done) as u64,
            buf_index: None,
        };
        let mut got = [0usize; SLOTS];
        let mut failed = [false; SLOTS];
        let mut next = 0;
        let mut out = [Completion::default(); 8];
        while next < SLOTS || fr.in_flight() > 0 {
            // SAFETY: each slot's memory is used by one read at a time and
            // outlives it (buf is dropped after the loop).
            while next < SLOTS && unsafe { fr.push(&op(next, 0)) } {
                next += 1;
            }
            fr.submit(true).unwrap();
            let n = fr.drain(&mut out);
            for c in &out[..n] {
                let slot = c.user_data as usize;
                if c.result < 0 {
                    assert_eq!(c.result, -libc::EIO);
                    failed[slot] = true;
                    continue;
                }
                got[slot] += c.result as usize;
                if got[slot] < SLOT {
                    // SAFETY: as above; the slot's previous read is drained.
                    assert!(unsafe { fr.push(&op(slot, got[slot])) });
                }
            }
        }
        assert_eq!(fr.in_flight(), 0);
        let bytes = buf.as_slice();
        let mut whole = 0;
        for slot in 0..SLOTS {
            let want = &image[slot * SLOT..(slot + 1) * SLOT];
            let have = &bytes[slot * SLOT..(slot + 1) * SLOT];
            if failed[slot] {
                assert!(have.iter().zip(want).all(|(h, w)| *h == 0 || h == w));
            } else {
                assert_eq!(got[slot], SLOT);
                assert_eq!(have, want, "slot {slot}");
                whole += 1;
            }
        }
        assert!(whole > SLOTS / 2, "{whole} of {SLOTS} whole");
        assert!(
            failed.iter().any(|&f| f),
            "the seed injects at least one EIO"
        );
    }
}
