//! [`Uring`]: the io_uring backend of [`IoBackend`] (registered buffers
//! and files, batched submission, optional SQPOLL). It owns the io_uring
//! instance and is one of the few modules allowed `unsafe`.

use std::io;
use std::os::fd::{BorrowedFd, OwnedFd, RawFd};
use std::time::{Duration, Instant};

use io_uring::{opcode, types, IoUring};

use super::{transient_submit_error, Completion, IoBackend, ReadOp, Target, Timespec};
use crate::error::{Error, Result};

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
            // Not a file: the kernel answers -EBADF for descriptor -1, as
            // for any read of something that is not open.
            (Target::Object(_), _) => opcode::Read::new(types::Fd(-1), op.buf, op.len).build(),
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

    /// # Safety
    /// As for [`IoBackend::push_send`].
    unsafe fn push_send(
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

    /// # Safety
    /// As for [`IoBackend::push_sendmsg`].
    unsafe fn push_sendmsg(&mut self, user_data: u64, fd: RawFd, msg: *const libc::msghdr) -> bool {
        let e = opcode::SendMsg::new(types::Fd(fd), msg)
            .flags(libc::MSG_NOSIGNAL as u32)
            .build()
            .user_data(user_data);
        // SAFETY: per this function's contract.
        unsafe { self.push_entry(&e) }
    }

    /// # Safety
    /// As for [`IoBackend::push_recv`].
    unsafe fn push_recv(&mut self, user_data: u64, fd: RawFd, buf: *mut u8, len: u32) -> bool {
        let e = opcode::Recv::new(types::Fd(fd), buf, len)
            .flags(libc::MSG_WAITALL)
            .build()
            .user_data(user_data);
        // SAFETY: the caller keeps the buffer valid until completion.
        unsafe { self.push_entry(&e) }
    }

    /// # Safety
    /// As for [`IoBackend::push_recvmsg`].
    unsafe fn push_recvmsg(&mut self, user_data: u64, fd: RawFd, msg: *mut libc::msghdr) -> bool {
        let e = opcode::RecvMsg::new(types::Fd(fd), msg)
            .build()
            .user_data(user_data);
        // SAFETY: the caller keeps the msghdr, its iovecs and their memory
        // valid until completion.
        unsafe { self.push_entry(&e) }
    }

    /// # Safety
    /// As for [`IoBackend::push_eventfd_read`].
    unsafe fn push_eventfd_read(&mut self, user_data: u64, fd: RawFd, buf: *mut u64) -> bool {
        let e = opcode::Read::new(types::Fd(fd), buf.cast(), 8)
            .build()
            .user_data(user_data);
        // SAFETY: the caller keeps the buffer valid until completion.
        unsafe { self.push_entry(&e) }
    }

    fn push_poll_in(&mut self, user_data: u64, fd: RawFd) -> bool {
        let e = opcode::PollAdd::new(types::Fd(fd), libc::POLLIN as u32)
            .build()
            .user_data(user_data);
        // SAFETY: a poll references no memory of ours.
        unsafe { self.push_entry(&e) }
    }

    /// # Safety
    /// As for [`IoBackend::push_timeout`].
    unsafe fn push_timeout(&mut self, user_data: u64, ts: *const Timespec) -> bool {
        // `Timespec` is `#[repr(C)]` with the fields of the kernel's
        // `__kernel_timespec`, which `types::Timespec` wraps transparently.
        let e = opcode::Timeout::new(ts.cast::<types::Timespec>())
            .build()
            .user_data(user_data);
        // SAFETY: the caller keeps `ts` valid until completion.
        unsafe { self.push_entry(&e) }
    }

    fn push_cancel(&mut self, user_data: u64, target: u64) -> bool {
        let e = opcode::AsyncCancel::new(target)
            .build()
            .user_data(user_data);
        // SAFETY: a cancel references no memory of ours.
        unsafe { self.push_entry(&e) }
    }

    fn submit_pending(&mut self) -> io::Result<()> {
        if self.ring.submission().is_empty() {
            return Ok(());
        }
        match self.ring.submit() {
            Ok(_) => Ok(()),
            Err(e) if matches!(e.raw_os_error(), Some(libc::EINTR) | Some(libc::EBUSY)) => Ok(()),
            Err(e) => Err(e),
        }
    }

    fn submit_wait_timeout(&mut self, timeout: Duration) -> io::Result<()> {
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

    fn lost_completions(&mut self) -> u32 {
        self.ring.completion().overflow()
    }

    /// # Safety
    /// As for [`IoBackend::register_buffers`].
    unsafe fn register_buffers(&mut self, regions: &[(*mut u8, usize)]) -> Result<()> {
        // SAFETY: the same contract.
        unsafe { Uring::register_buffers(self, regions) }
    }

    fn prepare_poll(&mut self) -> io::Result<super::PollWait> {
        if !self.ring.submission().is_empty() {
            // Entries left queued (a transient error last time): in the
            // kernel now, or looked at again soon.
            match self.ring.submit() {
                Ok(_) => {}
                Err(e) if transient_submit_error(&e) => return Ok(super::PollWait::Soon),
                Err(e) => return Err(e),
            }
        }
        let mut cq = self.ring.completion();
        cq.sync();
        Ok(if cq.is_empty() {
            super::PollWait::Ring
        } else {
            super::PollWait::Now
        })
    }

    fn uring_fd(&self) -> Option<OwnedFd> {
        use std::os::fd::AsRawFd;
        // SAFETY: the ring's descriptor is open for as long as `self`,
        // which outlives this borrow; the duplicate is the caller's.
        let fd = unsafe { BorrowedFd::borrow_raw(self.ring.as_raw_fd()) };
        fd.try_clone_to_owned().ok()
    }

    fn share_buffers(&mut self, from: BorrowedFd<'_>) -> Result<()> {
        use std::os::fd::AsRawFd;
        self.ring
            .submitter()
            .register_buffers_clone(from.as_raw_fd())
            .map_err(|e| Error::Uring {
                what: "share registered buffers (register_buffers_clone)",
                source: e.into(),
            })
    }

    fn now(&self) -> Instant {
        Instant::now()
    }

    fn shutdown(&mut self, fd: RawFd) {
        crate::sys::shutdown_socket(fd);
    }

    fn send_now(&mut self, fd: RawFd, buf: &[u8]) -> io::Result<usize> {
        crate::sys::send_nonblocking(fd, buf)
    }

    fn set_user_timeout(&mut self, fd: RawFd, timeout: Duration) -> io::Result<()> {
        crate::sys::set_tcp_user_timeout(fd, timeout)
    }
}

impl Drop for Uring {
    /// Cancels and reaps what is in flight before the ring goes (and, right
    /// after, the memory its operations target).
    fn drop(&mut self) {
        self.cancel_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::fd::AsRawFd;

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

    /// Three rounds of a read from a pipe on a cooperative ring (COOP_TASKRUN)
    /// that another thread's write completes while this one waits with
    /// `wait` (which returns the completions it drained, 0 to wait again).
    fn pipe_read_rounds(mut wait: impl FnMut(&mut Uring, u8, &mut [Completion]) -> usize) {
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
                got = wait(&mut ring, round, &mut out);
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

    /// A thread that waits in poll(2) on a cooperative ring's descriptor
    /// (the node agent's poller threads, `loader/node_pollers.rs`) is woken
    /// when a read it submitted completes: the completion is task work of
    /// that thread, run when the wait is interrupted, and then makes the
    /// descriptor readable. Each round has a 10 s deadline.
    #[test]
    fn a_cooperative_ring_s_descriptor_wakes_poll() {
        let mut deadline = None;
        pipe_read_rounds(|ring, round, out| {
            let until = *deadline.get_or_insert_with(|| Instant::now() + Duration::from_secs(10));
            match ring.prepare_poll().unwrap() {
                // The write was quicker: nothing to wait for.
                super::super::PollWait::Now => return ring.drain(out),
                super::super::PollWait::Ring => {}
                super::super::PollWait::Soon => panic!("a read on a ring cannot end a poll(2)"),
            }
            let left = until.saturating_duration_since(Instant::now());
            assert!(
                !left.is_zero(),
                "round {round}: poll never saw the completion"
            );
            let fd = ring.uring_fd().expect("an io_uring has a descriptor");
            let mut pfd = [libc::pollfd {
                fd: fd.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            }];
            crate::sys::poll_fds(&mut pfd, left.as_millis() as i32).unwrap();
            let got = ring.drain(out);
            if got > 0 {
                deadline = None;
            }
            got
        });
    }

    /// A cooperative ring (COOP_TASKRUN) still wakes a thread blocked in
    /// io_uring_enter when its read completes.
    #[test]
    fn cooperative_ring_wakes_a_waiting_thread() {
        pipe_read_rounds(|ring, _, out| {
            ring.submit(true).unwrap();
            ring.drain(out)
        });
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

    fn socketpair() -> (std::os::fd::OwnedFd, std::os::fd::OwnedFd) {
        use std::os::fd::FromRawFd;
        let mut fds = [0; 2];
        // SAFETY: socketpair writes two new descriptors into fds.
        let rc = unsafe { libc::socketpair(libc::AF_UNIX, libc::SOCK_STREAM, 0, fds.as_mut_ptr()) };
        assert_eq!(rc, 0);
        // SAFETY: both are new descriptors we own.
        unsafe {
            (
                std::os::fd::OwnedFd::from_raw_fd(fds[0]),
                std::os::fd::OwnedFd::from_raw_fd(fds[1]),
            )
        }
    }

    /// Waits (bounded) for the completion of `ud` and returns its result.
    fn wait_for(ring: &mut Uring, ud: u64) -> i32 {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let mut out = [Completion::default(); 8];
        loop {
            assert!(
                std::time::Instant::now() < deadline,
                "no completion for {ud}"
            );
            ring.submit_wait_timeout(Duration::from_millis(100))
                .unwrap();
            let n = ring.drain(&mut out);
            if let Some(c) = out[..n].iter().find(|c| c.user_data == ud) {
                assert_eq!(n, 1, "one operation at a time here: {:?}", &out[..n]);
                return c.result;
            }
            assert_eq!(n, 0, "unexpected completions {:?}", &out[..n]);
        }
    }

    /// The socket operations of the interface, on real io_uring opcodes: a
    /// send and a `sendmsg` arrive whole through a receive, a poll sees
    /// data waiting, a timeout fires with ETIME, and a cancelled receive
    /// completes with ECANCELED without writing its buffer.
    #[test]
    fn socket_ops_timeouts_and_cancels() {
        use std::os::fd::AsRawFd;
        let (a, b) = socketpair();
        let (a, b) = (a.as_raw_fd(), b.as_raw_fd());
        let mut ring = Uring::new(UringOptions {
            entries: 8,
            sqpoll_idle_ms: None,
        })
        .unwrap();
        let msg: Vec<u8> = (0..100u8).collect();
        // SAFETY: msg outlives the send, reaped by wait_for.
        assert!(unsafe { ring.push_send(1, a, msg.as_ptr(), 100, false) });
        assert_eq!(wait_for(&mut ring, 1), 100);
        assert!(ring.push_poll_in(2, b));
        assert!(wait_for(&mut ring, 2) & libc::POLLIN as i32 != 0);
        let mut got = vec![0u8; 100];
        // SAFETY: got outlives the receive, reaped by wait_for.
        assert!(unsafe { ring.push_recv(3, b, got.as_mut_ptr(), 100) });
        assert_eq!(wait_for(&mut ring, 3), 100);
        assert_eq!(got, msg);
        let (head, tail) = ([7u8; 5], [9u8; 3]);
        let mut iov = [
            libc::iovec {
                iov_base: head.as_ptr() as *mut libc::c_void,
                iov_len: 5,
            },
            libc::iovec {
                iov_base: tail.as_ptr() as *mut libc::c_void,
                iov_len: 3,
            },
        ];
        // SAFETY: an all-zero msghdr is valid; its iovecs are set below.
        let mut mh: libc::msghdr = unsafe { std::mem::zeroed() };
        mh.msg_iov = iov.as_mut_ptr();
        mh.msg_iovlen = 2;
        // SAFETY: mh, iov and the bytes outlive the send (wait_for).
        assert!(unsafe { ring.push_sendmsg(4, a, &mh) });
        assert_eq!(wait_for(&mut ring, 4), 8);
        // SAFETY: as above.
        assert!(unsafe { ring.push_recv(5, b, got.as_mut_ptr(), 8) });
        assert_eq!(wait_for(&mut ring, 5), 8);
        assert_eq!(&got[..8], &[7, 7, 7, 7, 7, 9, 9, 9]);
        let ts = Timespec::from(Duration::from_millis(1));
        // SAFETY: ts outlives the timeout (wait_for).
        assert!(unsafe { ring.push_timeout(6, &ts) });
        assert_eq!(wait_for(&mut ring, 6), -libc::ETIME);
        // A receive nothing will satisfy, then its cancel.
        let mut canary = vec![0xaau8; 16];
        // SAFETY: canary outlives the receive: both completions are reaped.
        assert!(unsafe { ring.push_recv(7, b, canary.as_mut_ptr(), 16) });
        ring.submit_pending().unwrap();
        assert!(ring.push_cancel(8, 7));
        let mut seen = Vec::new();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let mut out = [Completion::default(); 8];
        while seen.len() < 2 {
            assert!(std::time::Instant::now() < deadline);
            ring.submit_wait_timeout(Duration::from_millis(100))
                .unwrap();
            let n = ring.drain(&mut out);
            seen.extend_from_slice(&out[..n]);
        }
        seen.sort_by_key(|c| c.user_data);
        assert_eq!(
            seen,
            [
                Completion {
                    user_data: 7,
                    result: -libc::ECANCELED
                },
                Completion {
                    user_data: 8,
                    result: 0
                }
            ]
        );
        assert_eq!(ring.in_flight(), 0);
        assert_eq!(ring.lost_completions(), 0);
        assert!(canary.iter().all(|&x| x == 0xaa));
    }
}
