//! [`Faulty`]: wraps any [`IoBackend`] and injects seeded faults, so the
//! error paths of the loops run in every test: reads that fail (EIO) or
//! come back short, delayed completions, failing submissions, and (with
//! [`NetFaults`]) sends and receives cut short, or completed with EAGAIN,
//! EINTR or a connection reset without reaching the kernel.

use std::io;
use std::os::fd::RawFd;
use std::time::{Duration, Instant};

use super::{Completion, IoBackend, ReadOp, Timespec};
use crate::error::Result;

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
    /// Per slot: the last read pushed (user_data, buffer address with its
    /// provenance exposed, length), so an injected short read can scribble
    /// over the bytes past its count: the kernel would not have written
    /// them, and a reader that took them must be caught.
    reads: Vec<(u64, usize, u32)>,
    submits: u32,
    completions: u64,
    /// Socket-operation faults (none unless [`Faulty::with_net_faults`]).
    net: NetFaults,
    /// user_data of the socket operations in flight in `inner` (sized at
    /// construction; a full list is a full queue): their completions get
    /// no read faults.
    net_ud: Vec<u64>,
    /// Reads that complete with EAGAIN or EINTR (transient, as a short
    /// read: never twice in a row for a slot), in parts per million.
    read_transient_ppm: u32,
}

/// Faults of socket operations, in parts per million of operations: a
/// send or receive cut to half its length (the real operation runs on the
/// shorter length, so the peer sees exactly the bytes reported), or one
/// that never reaches the kernel and completes with `EAGAIN`, `EINTR` or
/// `ECONNRESET` (its memory untouched). Delays come from
/// [`FaultConfig::delay_ppm`], as for reads.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct NetFaults {
    pub(crate) short_send_ppm: u32,
    pub(crate) short_recv_ppm: u32,
    /// A `recvmsg` (taken without MSG_WAITALL, so its caller takes any
    /// count) asks for half its iovecs' length.
    pub(crate) short_recvmsg_ppm: u32,
    pub(crate) eagain_ppm: u32,
    pub(crate) eintr_ppm: u32,
    pub(crate) reset_ppm: u32,
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
            reads: vec![(u64::MAX, 0, 0); max_inflight],
            submits: 0,
            completions: 0,
            net: NetFaults::default(),
            net_ud: Vec::with_capacity(max_inflight),
            read_transient_ppm: 0,
        }
    }

    /// Also injects `net` into socket operations.
    #[allow(dead_code)] // used by tests and the simulator
    pub(crate) fn with_net_faults(mut self, net: NetFaults) -> Self {
        self.net = net;
        self
    }

    /// Also fails reads with a transient EAGAIN or EINTR (`ppm` of them),
    /// never twice in a row for a slot, so a reader that retries always
    /// recovers.
    #[allow(dead_code)] // used by the simulator
    pub(crate) fn with_transient_read_faults(mut self, ppm: u32) -> Self {
        self.read_transient_ppm = ppm;
        self
    }

    /// The wrapped backend.
    #[allow(dead_code)] // used by tests and the simulator
    pub(crate) fn inner(&self) -> &B {
        &self.inner
    }

    /// Before a socket operation reaches `inner`: Err(errno) to complete it
    /// at once with that error instead (nothing reaches the kernel), Ok
    /// when it goes on; None when the queue is full (nothing is queued).
    fn net_fault(&mut self, user_data: u64) -> Option<Result<(), i32>> {
        if self.net_ud.len() == self.net_ud.capacity() {
            return None;
        }
        if self.held.len() < self.held.capacity() {
            let errno = if self.roll(self.net.eagain_ppm) {
                libc::EAGAIN
            } else if self.roll(self.net.eintr_ppm) {
                libc::EINTR
            } else if self.roll(self.net.reset_ppm) {
                libc::ECONNRESET
            } else {
                0
            };
            if errno != 0 {
                let c = Completion {
                    user_data,
                    result: -errno,
                };
                self.held.push((c, 0));
                return Some(Err(errno));
            }
        }
        Some(Ok(()))
    }

    /// Records a socket operation that went to `inner` (`ok`).
    fn net_pushed(&mut self, user_data: u64, ok: bool) -> bool {
        if ok {
            debug_assert!(self.net_ud.len() < self.net_ud.capacity());
            self.net_ud.push(user_data);
        }
        ok
    }

    /// Whether a completion from `inner` is a socket operation's (and
    /// forgets it).
    fn net_done(&mut self, user_data: u64) -> bool {
        match self.net_ud.iter().position(|&u| u == user_data) {
            Some(i) => {
                self.net_ud.swap_remove(i);
                true
            }
            None => false,
        }
    }

    fn roll(&mut self, ppm: u32) -> bool {
        self.state = self.state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        crate::hash::reduce(crate::hash::mix64(self.state), 1_000_000) < ppm as u64
    }
}

/// Cuts the iovecs of `msg` to half their total length (at least one byte),
/// from the tail: a receive the kernel returns short.
///
/// # Safety
/// `msg` and its `msg_iovlen` iovecs must be valid and writable.
unsafe fn halve_iovecs(msg: *mut libc::msghdr) {
    // SAFETY: per this function's contract.
    let (iov, k) = unsafe { ((*msg).msg_iov, (*msg).msg_iovlen) };
    let mut total = 0usize;
    for i in 0..k {
        // SAFETY: i < msg_iovlen.
        total += unsafe { (*iov.add(i)).iov_len };
    }
    let mut keep = (total / 2).max(1);
    for i in 0..k {
        // SAFETY: i < msg_iovlen.
        let v = unsafe { &mut *iov.add(i) };
        v.iov_len = v.iov_len.min(keep);
        keep -= v.iov_len;
    }
}

impl<B: IoBackend> IoBackend for Faulty<B> {
    /// # Safety
    /// As for [`IoBackend::push`].
    unsafe fn push(&mut self, op: &ReadOp) -> bool {
        // SAFETY: forwarded with the same contract.
        let pushed = unsafe { self.inner.push(op) };
        if let Some(r) = self.reads.get_mut(op.user_data as u32 as usize) {
            if pushed {
                *r = (op.user_data, op.buf.expose_provenance(), op.len);
            }
        }
        pushed
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
        // Held completions are finished (or never started): nothing to
        // wait for.
        self.held.clear();
        self.net_ud.clear();
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
            if !self.net_ud.is_empty() && self.net_done(c.user_data) {
                // A socket operation's: its faults were injected at push.
                if self.held.len() < self.held.capacity() && self.roll(self.cfg.delay_ppm) {
                    let delay = (self.state % 4) as u32 + 1;
                    self.held.push((c, delay));
                } else {
                    out[w] = c;
                    w += 1;
                }
                continue;
            }
            // The slot is the low 32 bits (the serve poller keeps its
            // operation's kind and connection above them).
            let slot = c.user_data as u32 as usize;
            let was_short = self.short_last.get(slot).copied().unwrap_or(true);
            let mut short = false;
            // Only reads get read faults: an eventfd read, a poll or a
            // timeout that shares a read's slot number is left alone (and
            // leaves the slot's "last was short" alone).
            let read = self.reads.get(slot).is_some_and(|r| r.0 == c.user_data);
            if !read {
                // Falls through to the delay below.
            } else if c.result > 0 && self.roll(self.cfg.eio_ppm) {
                c.result = -libc::EIO;
            } else if c.result > 1 && !was_short && self.roll(self.cfg.short_ppm) {
                let full = c.result as usize;
                c.result /= 2;
                short = true;
                if let Some(&(ud, buf, len)) = self.reads.get(slot) {
                    if ud == c.user_data && full <= len as usize {
                        let past = c.result as usize;
                        let p = std::ptr::with_exposed_provenance_mut::<u8>(buf);
                        // SAFETY: push's contract: buf..buf+len is the
                        // caller's until this completion is drained (it is
                        // being drained now), and past < full <= len.
                        unsafe { std::ptr::write_bytes(p.add(past), 0xA5, full - past) };
                    }
                }
            } else if self.read_transient_ppm > 0
                && c.result > 0
                && !was_short
                && self.roll(self.read_transient_ppm)
            {
                c.result = if self.state & 1 == 0 {
                    -libc::EAGAIN
                } else {
                    -libc::EINTR
                };
                short = true;
            }
            if let Some(s) = self.short_last.get_mut(slot).filter(|_| read) {
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
        match self.net_fault(user_data) {
            None => false,
            Some(Err(_)) => true,
            Some(Ok(())) => {
                let len = if len > 1 && self.roll(self.net.short_send_ppm) {
                    len / 2
                } else {
                    len
                };
                // SAFETY: forwarded with the same contract (a shorter
                // length covers less of the caller's memory).
                let ok = unsafe { self.inner.push_send(user_data, fd, buf, len, more) };
                self.net_pushed(user_data, ok)
            }
        }
    }

    /// # Safety
    /// As for [`IoBackend::push_sendmsg`].
    unsafe fn push_sendmsg(&mut self, user_data: u64, fd: RawFd, msg: *const libc::msghdr) -> bool {
        // Not cut short: the msghdr is the caller's and stays unchanged
        // (the kernel's own partial sends reach the caller all the same).
        match self.net_fault(user_data) {
            None => false,
            Some(Err(_)) => true,
            Some(Ok(())) => {
                // SAFETY: forwarded with the same contract.
                let ok = unsafe { self.inner.push_sendmsg(user_data, fd, msg) };
                self.net_pushed(user_data, ok)
            }
        }
    }

    /// # Safety
    /// As for [`IoBackend::push_recv`].
    unsafe fn push_recv(&mut self, user_data: u64, fd: RawFd, buf: *mut u8, len: u32) -> bool {
        match self.net_fault(user_data) {
            None => false,
            Some(Err(_)) => true,
            Some(Ok(())) => {
                let len = if len > 1 && self.roll(self.net.short_recv_ppm) {
                    len / 2
                } else {
                    len
                };
                // SAFETY: forwarded with the same contract.
                let ok = unsafe { self.inner.push_recv(user_data, fd, buf, len) };
                self.net_pushed(user_data, ok)
            }
        }
    }

    /// # Safety
    /// As for [`IoBackend::push_recvmsg`].
    unsafe fn push_recvmsg(&mut self, user_data: u64, fd: RawFd, msg: *mut libc::msghdr) -> bool {
        match self.net_fault(user_data) {
            None => false,
            Some(Err(_)) => true,
            Some(Ok(())) => {
                if self.roll(self.net.short_recvmsg_ppm) {
                    // SAFETY: the contract lets the backend change the
                    // msghdr and its iovec array (not the memory they
                    // describe) until the completion; shorter iovecs cover
                    // less of the caller's memory.
                    unsafe { halve_iovecs(msg) };
                }
                // SAFETY: forwarded with the same contract.
                let ok = unsafe { self.inner.push_recvmsg(user_data, fd, msg) };
                self.net_pushed(user_data, ok)
            }
        }
    }

    /// # Safety
    /// As for [`IoBackend::push_eventfd_read`].
    unsafe fn push_eventfd_read(&mut self, user_data: u64, fd: RawFd, buf: *mut u64) -> bool {
        // SAFETY: forwarded with the same contract.
        unsafe { self.inner.push_eventfd_read(user_data, fd, buf) }
    }

    fn push_poll_in(&mut self, user_data: u64, fd: RawFd) -> bool {
        self.inner.push_poll_in(user_data, fd)
    }

    /// # Safety
    /// As for [`IoBackend::push_timeout`].
    unsafe fn push_timeout(&mut self, user_data: u64, ts: *const Timespec) -> bool {
        // SAFETY: forwarded with the same contract.
        unsafe { self.inner.push_timeout(user_data, ts) }
    }

    fn push_cancel(&mut self, user_data: u64, target: u64) -> bool {
        self.inner.push_cancel(user_data, target)
    }

    fn submit_pending(&mut self) -> io::Result<()> {
        self.inner.submit_pending()
    }

    fn submit_wait_timeout(&mut self, timeout: Duration) -> io::Result<()> {
        if self.held.is_empty() {
            self.inner.submit_wait_timeout(timeout)
        } else {
            // Held completions count as ready.
            self.inner.submit_pending()
        }
    }

    fn lost_completions(&mut self) -> u32 {
        self.inner.lost_completions()
    }

    /// # Safety
    /// As for [`IoBackend::register_buffers`].
    unsafe fn register_buffers(&mut self, regions: &[(*mut u8, usize)]) -> Result<()> {
        // SAFETY: forwarded with the same contract.
        unsafe { self.inner.register_buffers(regions) }
    }

    fn uring_fd(&self) -> Option<std::os::fd::OwnedFd> {
        self.inner.uring_fd()
    }

    fn prepare_poll(&mut self) -> io::Result<super::PollWait> {
        if !self.held.is_empty() {
            // Released by later drains, not by the kernel.
            self.inner.submit_pending()?;
            return Ok(super::PollWait::Soon);
        }
        self.inner.prepare_poll()
    }

    fn share_buffers(&mut self, from: std::os::fd::BorrowedFd<'_>) -> Result<()> {
        self.inner.share_buffers(from)
    }

    fn now(&self) -> Instant {
        self.inner.now()
    }

    fn shutdown(&mut self, fd: RawFd) {
        self.inner.shutdown(fd)
    }

    fn send_now(&mut self, fd: RawFd, buf: &[u8]) -> io::Result<usize> {
        self.inner.send_now(fd, buf)
    }

    fn set_user_timeout(&mut self, fd: RawFd, timeout: Duration) -> io::Result<()> {
        self.inner.set_user_timeout(fd, timeout)
    }
}

#[cfg(test)]
mod tests {
    use super::super::{transient_submit_error, MemBackend, Target, Uring, UringOptions};
    use super::*;

    /// A short `recvmsg` covers the first half of its iovecs, in order, so
    /// a later iovec (the consumer's next header) gets bytes only once the
    /// earlier ones (the payload) are full.
    #[test]
    fn a_short_recvmsg_keeps_the_head_of_its_iovecs() {
        let mut a = [0u8; 64];
        let mut b = [0u8; 24];
        let cut = |la: usize, lb: usize, a: &mut [u8], b: &mut [u8]| {
            let mut iov = [
                libc::iovec {
                    iov_base: a.as_mut_ptr().cast(),
                    iov_len: la,
                },
                libc::iovec {
                    iov_base: b.as_mut_ptr().cast(),
                    iov_len: lb,
                },
            ];
            // SAFETY: msghdr is plain data; zero is its empty value.
            let mut m: libc::msghdr = unsafe { std::mem::zeroed() };
            m.msg_iov = iov.as_mut_ptr();
            m.msg_iovlen = 2;
            // SAFETY: m and its iovecs are valid and writable.
            unsafe { halve_iovecs(&mut m) };
            (iov[0].iov_len, iov[1].iov_len)
        };
        assert_eq!(cut(10, 24, &mut a, &mut b), (10, 7));
        assert_eq!(cut(64, 24, &mut a, &mut b), (44, 0));
        assert_eq!(cut(1, 0, &mut a, &mut b), (1, 0));
    }
    use std::io::Write;
    use std::os::fd::AsRawFd;
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

    /// Socket faults over real io_uring on a socket pair: a 256 KiB stream
    /// is sent in pieces through injected short sends and receives, EAGAIN,
    /// EINTR, resets and delays, each resumed where the completion says;
    /// the receiver ends with exactly the bytes sent, every kind of fault
    /// came, a faulted operation's memory was never touched, and nothing
    /// is in flight at the end.
    #[test]
    fn socket_faults_lose_and_duplicate_no_byte() {
        use std::os::fd::{FromRawFd, OwnedFd};
        let mut fds = [0; 2];
        // SAFETY: socketpair writes two new descriptors into fds.
        let rc = unsafe { libc::socketpair(libc::AF_UNIX, libc::SOCK_STREAM, 0, fds.as_mut_ptr()) };
        assert_eq!(rc, 0);
        // SAFETY: both are new descriptors we own.
        let (a, b) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        let ring = Uring::new(UringOptions {
            entries: 8,
            sqpoll_idle_ms: None,
        })
        .unwrap();
        let cfg = FaultConfig {
            seed: 11,
            delay_ppm: 200_000,
            ..Default::default()
        };
        let net = NetFaults {
            short_send_ppm: 200_000,
            short_recv_ppm: 200_000,
            short_recvmsg_ppm: 0,
            eagain_ppm: 50_000,
            eintr_ppm: 50_000,
            reset_ppm: 50_000,
        };
        let mut fr = Faulty::new(ring, cfg, 8).with_net_faults(net);
        const TOTAL: usize = 256 << 10;
        const PIECE: usize = 8 << 10;
        let data: Vec<u8> = (0..TOTAL).map(|i| (i * 31 + i / 4093) as u8).collect();
        let mut got = vec![0u8; TOTAL];
        let (mut sent, mut recvd) = (0usize, 0usize);
        let (mut send_at, mut recv_at) = (None::<usize>, None::<usize>);
        let mut errors = [0u32; 3];
        let (mut short_sends, mut short_recvs) = (0, 0);
        let mut out = [Completion::default(); 8];
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while sent < TOTAL || recvd < TOTAL || fr.in_flight() > 0 {
            assert!(
                std::time::Instant::now() < deadline,
                "{sent} sent, {recvd} received"
            );
            if send_at.is_none() && sent < TOTAL {
                let len = PIECE.min(TOTAL - sent);
                // SAFETY: data outlives the send (reaped in this loop).
                if unsafe {
                    fr.push_send(1, a.as_raw_fd(), data[sent..].as_ptr(), len as u32, false)
                } {
                    send_at = Some(len);
                }
            }
            if recv_at.is_none() && recvd < TOTAL {
                let len = PIECE.min(TOTAL - recvd);
                // Canary: a faulted receive must leave it.
                got[recvd] = !data[recvd];
                // SAFETY: got outlives the receive (reaped in this loop).
                if unsafe { fr.push_recv(2, b.as_raw_fd(), got[recvd..].as_mut_ptr(), len as u32) }
                {
                    recv_at = Some(len);
                }
            }
            fr.submit_wait_timeout(Duration::from_millis(50)).unwrap();
            let n = fr.drain(&mut out);
            for c in &out[..n] {
                let asked = if c.user_data == 1 {
                    send_at.take()
                } else {
                    recv_at.take()
                };
                let asked = asked.expect("a completion for an operation in flight");
                if c.result < 0 {
                    let k = match -c.result {
                        libc::EAGAIN => 0,
                        libc::EINTR => 1,
                        libc::ECONNRESET => 2,
                        e => panic!("unexpected errno {e}"),
                    };
                    errors[k] += 1;
                    if c.user_data == 2 {
                        assert_eq!(got[recvd], !data[recvd], "a faulted receive wrote");
                    }
                    continue;
                }
                let n = c.result as usize;
                assert!(n > 0 && n <= asked);
                if c.user_data == 1 {
                    short_sends += (n < asked) as u32;
                    sent += n;
                } else {
                    short_recvs += (n < asked) as u32;
                    recvd += n;
                }
            }
        }
        assert_eq!((sent, recvd), (TOTAL, TOTAL));
        assert!(got == data, "the stream arrived changed");
        assert!(
            errors.iter().all(|&e| e > 0),
            "every error kind came: {errors:?}"
        );
        assert!(
            short_sends > 0 && short_recvs > 0,
            "{short_sends} {short_recvs}"
        );
        assert_eq!(fr.in_flight(), 0);
    }
}
