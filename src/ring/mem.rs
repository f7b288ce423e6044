//! `MemBackend` (tests only): a backend over a file image in memory, so
//! the loader's poller runs under Miri, which cannot enter io_uring.

use std::io;
use std::os::fd::RawFd;
use std::time::{Duration, Instant};

use super::{Completion, IoBackend, ReadOp, Timespec};
use crate::error::Result;

/// A backend over a file image in memory, for tests that run under Miri
/// (which cannot enter io_uring): a read's bytes are copied into its buffer
/// at the submission that follows the push, as the kernel would, and its
/// completion is ready from then on. Pools are sized at construction.
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
unsafe impl Send for MemBackend {}

impl MemBackend {
    /// Completes an operation it cannot do with ENOTSOCK.
    fn refuse(&mut self, user_data: u64) -> bool {
        if self.in_flight == self.depth {
            return false;
        }
        self.in_flight += 1;
        self.done.push_back(Completion {
            user_data,
            result: -libc::ENOTSOCK,
        });
        true
    }

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

    // It has no sockets, eventfds or timers: every such operation
    // completes with ENOTSOCK (a caller's bug in a test, named).

    /// # Safety
    /// Nothing is touched.
    unsafe fn push_send(&mut self, ud: u64, _: RawFd, _: *const u8, _: u32, _: bool) -> bool {
        self.refuse(ud)
    }

    /// # Safety
    /// Nothing is touched.
    unsafe fn push_sendmsg(&mut self, ud: u64, _: RawFd, _: *const libc::msghdr) -> bool {
        self.refuse(ud)
    }

    /// # Safety
    /// Nothing is touched.
    unsafe fn push_recv(&mut self, ud: u64, _: RawFd, _: *mut u8, _: u32) -> bool {
        self.refuse(ud)
    }

    /// # Safety
    /// Nothing is touched.
    unsafe fn push_recvmsg(&mut self, ud: u64, _: RawFd, _: *mut libc::msghdr) -> bool {
        self.refuse(ud)
    }

    /// # Safety
    /// Nothing is touched.
    unsafe fn push_eventfd_read(&mut self, ud: u64, _: RawFd, _: *mut u64) -> bool {
        self.refuse(ud)
    }

    fn push_poll_in(&mut self, ud: u64, _: RawFd) -> bool {
        self.refuse(ud)
    }

    /// # Safety
    /// Nothing is touched.
    unsafe fn push_timeout(&mut self, ud: u64, _: *const Timespec) -> bool {
        self.refuse(ud)
    }

    fn push_cancel(&mut self, ud: u64, _: u64) -> bool {
        self.refuse(ud)
    }

    fn submit_pending(&mut self) -> io::Result<()> {
        self.submit(false)
    }

    fn submit_wait_timeout(&mut self, _: Duration) -> io::Result<()> {
        self.submit(false)
    }

    fn lost_completions(&mut self) -> u32 {
        0
    }

    /// # Safety
    /// Nothing is registered: reads copy into the caller's memory.
    unsafe fn register_buffers(&mut self, _: &[(*mut u8, usize)]) -> Result<()> {
        Ok(())
    }

    fn now(&self) -> Instant {
        Instant::now()
    }

    fn shutdown(&mut self, _: RawFd) {
        // No sockets here.
    }

    fn send_now(&mut self, _: RawFd, _: &[u8]) -> io::Result<usize> {
        Err(io::Error::from_raw_os_error(libc::ENOTSOCK))
    }

    fn set_user_timeout(&mut self, _: RawFd, _: Duration) -> io::Result<()> {
        Err(io::Error::from_raw_os_error(libc::ENOTSOCK))
    }
}
