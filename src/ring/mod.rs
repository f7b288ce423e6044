//! The I/O ring: queued reads into caller-owned memory, completions carrying
//! the caller's slot index. [`Uring`] is io_uring (registered buffers and
//! files, batched submission, optional SQPOLL); [`Faulty`] wraps any backend
//! and injects seeded faults (EIO, short reads, delayed completions) so the
//! loader's error paths run everywhere.
//!
//! This module owns the io_uring instance and is one of the few allowed `unsafe`.

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
}

/// io_uring settings.
#[derive(Debug, Clone, Copy)]
pub struct UringOptions {
    /// Submission queue entries (a power of two is used).
    pub entries: u32,
    /// Use a kernel submission thread (SQPOLL) that idles after this many ms.
    pub sqpoll_idle_ms: Option<u32>,
}

/// An io_uring instance.
pub struct Uring {
    ring: IoUring,
}

impl Uring {
    /// Creates a ring.
    pub fn new(opts: UringOptions) -> Result<Self> {
        let mut b = IoUring::builder();
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
        Ok(Uring { ring })
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
        unsafe { self.ring.submission().push(&e).is_ok() }
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
        unsafe { self.ring.submission().push(&e).is_ok() }
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
        unsafe { self.ring.submission().push(&e).is_ok() }
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
        unsafe { self.ring.submission().push(&e).is_ok() }
    }

    /// Queues a one-shot poll for readability of `fd` (a completion
    /// channel's descriptor, to sleep until an armed CQ has work).
    pub fn push_poll_in(&mut self, user_data: u64, fd: RawFd) -> bool {
        let e = opcode::PollAdd::new(types::Fd(fd), libc::POLLIN as u32)
            .build()
            .user_data(user_data);
        // SAFETY: a poll references no memory of ours.
        unsafe { self.ring.submission().push(&e).is_ok() }
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
        unsafe {
            self.ring
                .submission()
                .push(&entry.user_data(op.user_data))
                .is_ok()
        }
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
            Err(e) if matches!(e.raw_os_error(), Some(libc::EINTR) | Some(libc::EBUSY)) => Ok(()),
            Err(e) => Err(e),
        }
    }

    fn drain(&mut self, out: &mut [Completion]) -> usize {
        let mut n = 0;
        let mut cq = self.ring.completion();
        cq.sync();
        for cqe in &mut cq {
            out[n] = Completion {
                user_data: cqe.user_data(),
                result: cqe.result(),
            };
            n += 1;
            if n == out.len() {
                break;
            }
        }
        n
    }
}

/// Fault rates, in parts per million of reads, and the seed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FaultConfig {
    /// Seed of the fault sequence.
    pub seed: u64,
    /// Reads that fail with EIO.
    pub eio_ppm: u32,
    /// Reads that return fewer bytes than asked (a retry is right).
    pub short_ppm: u32,
    /// Reads whose completion is held back for a few drains.
    pub delay_ppm: u32,
}

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
        // Held completions count as ready: do not block on the kernel then.
        self.inner.submit(wait && self.held.is_empty())
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
        w
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::fd::AsRawFd;

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
}
