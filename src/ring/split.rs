//! An [`IoBackend`] over two: reads of objects in a bucket
//! ([`Target::Object`]) go to a [`StoreRing`], everything else to the
//! local backend (io_uring). A poller over a partial space whose source is
//! a bucket (`kspeed preload --max-bytes` from `s3://…`) reads the samples
//! its space holds from the NVMe and the others from the bucket, in one
//! loop, in the rank's order.
//!
//! **Waiting on both.** The store's workers bump an eventfd after each
//! GET's completions ([`StoreRing::wake_fd`]); while the store has reads
//! in flight, one read of that eventfd is queued on the local ring (with a
//! reserved `user_data` the drain hides), so a wait on the local ring also
//! ends when a GET finishes. A wake-up may be stale (its completions were
//! drained on the way): the caller's loop only sees an empty drain and
//! waits again.

use std::io;
use std::os::fd::RawFd;
use std::time::{Duration, Instant};

use super::{Completion, IoBackend, ReadOp, StoreRing, Target, Timespec};
use crate::error::Result;

/// The eventfd read's `user_data` (`u64::MAX` is io_uring's cancel; slot
/// indices are far below).
const WAKE_USER_DATA: u64 = u64::MAX - 1;

/// Local reads on `L`, object reads on a [`StoreRing`].
pub struct Split<L: IoBackend> {
    local: L,
    store: StoreRing,
    /// The eventfd read's destination: boxed, so its address stays put
    /// while the read is in flight.
    wake_buf: Box<u64>,
    /// The eventfd read is in flight on `local`.
    armed: bool,
}

impl<L: IoBackend> Split<L> {
    /// Routes object reads to `store`, the rest to `local`.
    pub fn new(local: L, store: StoreRing) -> Self {
        Split {
            local,
            store,
            wake_buf: Box::new(0),
            armed: false,
        }
    }

    /// Before a wait on the local ring: the store's GETs must be able to
    /// end it. Returns false when the store already has a completion (the
    /// caller must not block).
    fn arm(&mut self) -> io::Result<bool> {
        self.store.submit_pending()?;
        if self.store.has_completions() {
            return Ok(false);
        }
        if self.store.in_flight() > 0 && !self.armed {
            let fd = self.store.wake_fd();
            let buf: *mut u64 = &mut *self.wake_buf;
            // SAFETY: `wake_buf` is boxed and lives as long as `self`, whose
            // Drop cancels and reaps every read on `local` first; the read
            // is the only user of it while in flight (`armed`).
            if unsafe { self.local.push_eventfd_read(WAKE_USER_DATA, fd, buf) } {
                self.armed = true;
            } else {
                // The submission queue is full: submit, then the wait below
                // ends on one of those (and re-arms next time).
                return Ok(true);
            }
        }
        Ok(true)
    }
}

impl<L: IoBackend> Drop for Split<L> {
    fn drop(&mut self) {
        // The eventfd read points into `wake_buf`: reap it before the box
        // goes (the store's own Drop waits for its GETs).
        self.local.cancel_all();
    }
}

impl<L: IoBackend> IoBackend for Split<L> {
    /// # Safety
    /// As for [`IoBackend::push`].
    unsafe fn push(&mut self, op: &ReadOp) -> bool {
        // SAFETY: the caller's contract, passed on.
        unsafe {
            match op.target {
                Target::Object(_) => self.store.push(op),
                _ => self.local.push(op),
            }
        }
    }

    fn submit(&mut self, wait: bool) -> io::Result<()> {
        if wait && self.arm()? {
            self.local.submit(true)
        } else {
            self.store.submit_pending()?;
            self.local.submit(false)
        }
    }

    fn drain(&mut self, out: &mut [Completion]) -> usize {
        let mut n = self.local.drain(out);
        if let Some(i) = out[..n].iter().position(|c| c.user_data == WAKE_USER_DATA) {
            // Hidden from the caller; a later wait arms it again.
            out.copy_within(i + 1..n, i);
            n -= 1;
            self.armed = false;
        }
        n + self.store.drain(&mut out[n..])
    }

    fn in_flight(&self) -> usize {
        self.local.in_flight() - self.armed as usize + self.store.in_flight()
    }

    fn cancel_all(&mut self) {
        self.local.cancel_all();
        self.armed = false;
        self.store.cancel_all();
    }

    /// # Safety
    /// As for [`IoBackend::push_send`].
    unsafe fn push_send(
        &mut self,
        ud: u64,
        fd: RawFd,
        buf: *const u8,
        len: u32,
        more: bool,
    ) -> bool {
        // SAFETY: the caller's contract, passed on.
        unsafe { self.local.push_send(ud, fd, buf, len, more) }
    }

    /// # Safety
    /// As for [`IoBackend::push_sendmsg`].
    unsafe fn push_sendmsg(&mut self, ud: u64, fd: RawFd, msg: *const libc::msghdr) -> bool {
        // SAFETY: the caller's contract, passed on.
        unsafe { self.local.push_sendmsg(ud, fd, msg) }
    }

    /// # Safety
    /// As for [`IoBackend::push_recv`].
    unsafe fn push_recv(&mut self, ud: u64, fd: RawFd, buf: *mut u8, len: u32) -> bool {
        // SAFETY: the caller's contract, passed on.
        unsafe { self.local.push_recv(ud, fd, buf, len) }
    }

    /// # Safety
    /// As for [`IoBackend::push_recvmsg`].
    unsafe fn push_recvmsg(&mut self, ud: u64, fd: RawFd, msg: *mut libc::msghdr) -> bool {
        // SAFETY: the caller's contract, passed on.
        unsafe { self.local.push_recvmsg(ud, fd, msg) }
    }

    /// # Safety
    /// As for [`IoBackend::push_eventfd_read`].
    unsafe fn push_eventfd_read(&mut self, ud: u64, fd: RawFd, buf: *mut u64) -> bool {
        // SAFETY: the caller's contract, passed on.
        unsafe { self.local.push_eventfd_read(ud, fd, buf) }
    }

    fn push_poll_in(&mut self, ud: u64, fd: RawFd) -> bool {
        self.local.push_poll_in(ud, fd)
    }

    /// # Safety
    /// As for [`IoBackend::push_timeout`].
    unsafe fn push_timeout(&mut self, ud: u64, ts: *const Timespec) -> bool {
        // SAFETY: the caller's contract, passed on.
        unsafe { self.local.push_timeout(ud, ts) }
    }

    fn push_cancel(&mut self, ud: u64, target: u64) -> bool {
        self.local.push_cancel(ud, target)
    }

    fn submit_pending(&mut self) -> io::Result<()> {
        self.store.submit_pending()?;
        self.local.submit_pending()
    }

    fn submit_wait_timeout(&mut self, timeout: Duration) -> io::Result<()> {
        if self.arm()? {
            self.local.submit_wait_timeout(timeout)
        } else {
            self.local.submit_pending()
        }
    }

    fn lost_completions(&mut self) -> u32 {
        self.local.lost_completions()
    }

    /// # Safety
    /// As for [`IoBackend::register_buffers`] (the store copies into the
    /// caller's memory and registers nothing).
    unsafe fn register_buffers(&mut self, regions: &[(*mut u8, usize)]) -> Result<()> {
        // SAFETY: the caller's contract, passed on.
        unsafe { self.local.register_buffers(regions) }
    }

    fn uring_fd(&self) -> Option<std::os::fd::OwnedFd> {
        self.local.uring_fd()
    }

    /// The store's GETs end a wait on the local ring through the eventfd
    /// read `arm` queues there, as a wait inside `submit` does.
    fn prepare_poll(&mut self) -> io::Result<super::PollWait> {
        if !self.arm()? {
            return Ok(super::PollWait::Now);
        }
        self.local.prepare_poll()
    }

    fn share_buffers(&mut self, from: std::os::fd::BorrowedFd<'_>) -> Result<()> {
        self.local.share_buffers(from)
    }

    fn now(&self) -> Instant {
        self.local.now()
    }

    fn shutdown(&mut self, fd: RawFd) {
        self.local.shutdown(fd)
    }

    fn send_now(&mut self, fd: RawFd, buf: &[u8]) -> io::Result<usize> {
        self.local.send_now(fd, buf)
    }

    fn set_user_timeout(&mut self, fd: RawFd, timeout: Duration) -> io::Result<()> {
        self.local.set_user_timeout(fd, timeout)
    }
}
