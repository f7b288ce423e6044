//! `MemNet` (tests only): an in-memory network behind [`IoBackend`], with
//! no socket and no system call, so the loops' transport code runs in one
//! process under a seed (and under Miri). Endpoints come in pairs
//! ([`MemNet::pair`]); a descriptor is an endpoint's index. Each
//! submission is one step of the network: the operations queued progress
//! in a seeded order, within TCP's guarantees (the operations of one kind
//! on one endpoint complete in the order they were queued, and bytes
//! arrive in the order they were sent), with seeded faults: partial sends,
//! completions held back for some steps, a peer that stops reading (its
//! receive buffer is bounded, so the sender stalls), and the loss of a
//! connection ([`MemNet::reset`]). Everything is allocated at
//! construction; operations never allocate.

use std::collections::VecDeque;
use std::io;
use std::os::fd::RawFd;
use std::time::Duration;

use super::{Completion, IoBackend, ReadOp, Timespec};
use crate::error::Result;

/// Fault rates of a [`MemNet`], in parts per million.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct MemNetFaults {
    /// Sends that take only part of what they offer (at least one byte).
    pub(crate) partial_send_ppm: u32,
    /// Operations that could complete but wait another step.
    pub(crate) delay_ppm: u32,
}

struct Endpoint {
    peer: usize,
    /// Bytes sent by the peer, not yet received here.
    rx: VecDeque<u8>,
    /// Most bytes `rx` holds (a peer that does not read stalls its sender).
    cap: usize,
    /// The peer shut its side (no more bytes will come after `rx`).
    eof: bool,
    /// The connection was lost: everything fails with ECONNRESET.
    reset: bool,
}

#[derive(Clone, Copy)]
enum Kind {
    Send(*const u8, u32),
    SendMsg(*const libc::msghdr),
    Recv(*mut u8, u32),
    PollIn,
    Timeout(u32),
    Cancel(u64),
}

#[derive(Clone, Copy)]
struct Op {
    user_data: u64,
    fd: usize,
    kind: Kind,
    /// A receive's bytes so far (MSG_WAITALL takes them as they come, as
    /// the kernel copies into the caller's buffer).
    got: u32,
}

/// The in-memory network (see the module's documentation).
pub(crate) struct MemNet {
    eps: Vec<Endpoint>,
    pending: Vec<Op>,
    done: VecDeque<Completion>,
    /// The pools' capacities at construction (they never grow).
    caps: (usize, usize),
    depth: usize,
    state: u64,
    faults: MemNetFaults,
}

// SAFETY: the raw pointers are the callers' buffers, valid until their
// completions per the IoBackend contracts; one thread uses it at a time.
unsafe impl Send for MemNet {}

impl MemNet {
    /// A network of at most `endpoints` endpoints, each buffering at most
    /// `buffer` bytes, with at most `depth` operations in flight.
    pub(crate) fn new(
        seed: u64,
        endpoints: usize,
        buffer: usize,
        depth: usize,
        faults: MemNetFaults,
    ) -> Self {
        MemNet {
            eps: (0..endpoints)
                .map(|_| Endpoint {
                    peer: usize::MAX,
                    rx: VecDeque::with_capacity(buffer),
                    cap: buffer,
                    eof: false,
                    reset: false,
                })
                .collect(),
            pending: Vec::with_capacity(depth),
            done: VecDeque::with_capacity(depth),
            caps: (0, 0),
            depth,
            state: crate::hash::mix64(seed ^ 0x6e65_7473),
            faults,
        }
        .measured()
    }

    fn measured(mut self) -> Self {
        self.caps = (self.pending.capacity(), self.done.capacity());
        self
    }

    /// Checks that no pool grew since construction.
    pub(crate) fn check_pools(&self) {
        assert_eq!(
            (self.pending.capacity(), self.done.capacity()),
            self.caps,
            "MemNet: a pool grew"
        );
        for e in &self.eps {
            assert!(e.rx.len() <= e.cap, "MemNet: a receive buffer overfilled");
        }
    }

    /// Connects two fresh endpoints; returns their descriptors.
    pub(crate) fn pair(&mut self) -> (RawFd, RawFd) {
        let a = self
            .eps
            .iter()
            .position(|e| e.peer == usize::MAX)
            .expect("MemNet: no endpoint left");
        self.eps[a].peer = a;
        let b = self
            .eps
            .iter()
            .position(|e| e.peer == usize::MAX)
            .expect("MemNet: no endpoint left");
        self.eps[a].peer = b;
        self.eps[b].peer = a;
        (a as RawFd, b as RawFd)
    }

    /// Loses the connection of `fd`: both ends' operations fail.
    pub(crate) fn reset(&mut self, fd: RawFd) {
        let a = fd as usize;
        let b = self.eps[a].peer;
        self.eps[a].reset = true;
        self.eps[b].reset = true;
    }

    /// Shuts `fd`'s sending side: its peer reads what was sent, then EOF.
    pub(crate) fn shutdown(&mut self, fd: RawFd) {
        let b = self.eps[fd as usize].peer;
        self.eps[b].eof = true;
    }

    /// Bytes the peer of `fd` has sent and `fd` has not received.
    #[allow(dead_code)]
    pub(crate) fn unread(&self, fd: RawFd) -> usize {
        self.eps[fd as usize].rx.len()
    }

    /// A number below `n` from the seeded sequence.
    pub(crate) fn below(&mut self, n: u64) -> u64 {
        self.state = self.state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        crate::hash::reduce(crate::hash::mix64(self.state), n.max(1))
    }

    fn roll(&mut self, ppm: u32) -> bool {
        self.below(1_000_000) < ppm as u64
    }

    fn queue(&mut self, user_data: u64, fd: RawFd, kind: Kind) -> bool {
        if self.in_flight() == self.depth {
            return false;
        }
        self.pending.push(Op {
            user_data,
            fd: fd as usize,
            kind,
            got: 0,
        });
        true
    }

    /// Moves up to `len` bytes from `src` (a list of pieces) into `fd`'s
    /// peer, as a send would; returns how many went (bounded by room).
    fn transfer(&mut self, fd: usize, pieces: &[(*const u8, usize)], want: usize) -> usize {
        let peer = self.eps[fd].peer;
        let room = self.eps[peer].cap - self.eps[peer].rx.len();
        let mut n = want.min(room);
        if n > 1 && self.roll(self.faults.partial_send_ppm) {
            n = 1 + self.below(n as u64 - 1) as usize;
        }
        let mut left = n;
        for &(p, l) in pieces {
            let take = l.min(left);
            // SAFETY: the send's contract: the caller's memory is valid
            // for its length until the completion.
            let s = unsafe { std::slice::from_raw_parts(p, take) };
            self.eps[peer].rx.extend(s.iter().copied());
            left -= take;
            if left == 0 {
                break;
            }
        }
        n
    }

    /// Tries to complete `op`; None while it must wait.
    fn progress(&mut self, op: Op) -> Option<i32> {
        let reset = self.eps.get(op.fd).is_some_and(|e| e.reset);
        match op.kind {
            Kind::Timeout(0) => Some(-libc::ETIME),
            Kind::Timeout(_) => None,
            Kind::Cancel(target) => match self.pending.iter().position(|o| o.user_data == target) {
                Some(i) => {
                    let o = self.pending.remove(i);
                    self.done.push_back(Completion {
                        user_data: o.user_data,
                        result: -libc::ECANCELED,
                    });
                    Some(0)
                }
                None => Some(-libc::ENOENT),
            },
            _ if reset => Some(-libc::ECONNRESET),
            Kind::Send(p, len) => {
                let n = self.transfer(op.fd, &[(p, len as usize)], len as usize);
                (n > 0 || len == 0).then_some(n as i32)
            }
            Kind::SendMsg(m) => {
                let mut pieces = [(std::ptr::null::<u8>(), 0usize); 64];
                // SAFETY: the sendmsg contract: msg and its iovecs are
                // valid until the completion.
                let (iov, k) = unsafe { ((*m).msg_iov, (*m).msg_iovlen) };
                assert!(k <= pieces.len(), "MemNet: {k} iovecs");
                let mut want = 0;
                for (i, piece) in pieces.iter_mut().enumerate().take(k) {
                    // SAFETY: as above, i < msg_iovlen.
                    let v = unsafe { *iov.add(i) };
                    *piece = (v.iov_base as *const u8, v.iov_len);
                    want += v.iov_len;
                }
                let n = self.transfer(op.fd, &pieces[..k], want);
                (n > 0 || want == 0).then_some(n as i32)
            }
            Kind::Recv(buf, len) => {
                let e = &mut self.eps[op.fd];
                let (got, len) = (op.got as usize, len as usize);
                let n = e.rx.len().min(len - got);
                for (i, b) in e.rx.drain(..n).enumerate() {
                    // SAFETY: the receive's contract: buf..buf+len is the
                    // caller's until the completion; got + i < len.
                    unsafe { *buf.add(got + i) = b };
                }
                let got = got + n;
                // MSG_WAITALL: all of it, or what came before EOF.
                if got == len || e.eof {
                    return Some(got as i32);
                }
                let at = self
                    .pending
                    .iter()
                    .position(|o| o.user_data == op.user_data && o.fd == op.fd)
                    .expect("the op is pending");
                self.pending[at].got = got as u32;
                None
            }
            Kind::PollIn => {
                let e = &self.eps[op.fd];
                (!e.rx.is_empty() || e.eof).then_some(libc::POLLIN as i32)
            }
        }
    }
}

impl IoBackend for MemNet {
    /// # Safety
    /// As for [`IoBackend::push`]. (No files: the read fails with EBADF.)
    unsafe fn push(&mut self, op: &ReadOp) -> bool {
        if self.in_flight() == self.depth {
            return false;
        }
        self.done.push_back(Completion {
            user_data: op.user_data,
            result: -libc::EBADF,
        });
        true
    }

    fn submit(&mut self, _wait: bool) -> io::Result<()> {
        // One step: the operations queued, in a seeded order; of those of
        // one kind on one endpoint, only the oldest may go (TCP's order).
        let n = self.pending.len();
        if n == 0 {
            return Ok(());
        }
        let mut k = self.below(n as u64) as usize;
        for _ in 0..n {
            if self.pending.is_empty() {
                break;
            }
            k %= self.pending.len();
            let op = self.pending[k];
            let blocked = self.pending[..k].iter().any(|o| {
                o.fd == op.fd
                    && std::mem::discriminant(&o.kind) == std::mem::discriminant(&op.kind)
                    && !matches!(o.kind, Kind::Timeout(_) | Kind::Cancel(_))
            });
            if blocked || self.roll(self.faults.delay_ppm) {
                k += 1;
                continue;
            }
            if let Kind::Timeout(t @ 1..) = op.kind {
                self.pending[k].kind = Kind::Timeout(t - 1);
                k += 1;
                continue;
            }
            match self.progress(op) {
                Some(result) => {
                    // A cancel may have removed an entry before it.
                    let at = self
                        .pending
                        .iter()
                        .position(|o| o.user_data == op.user_data && o.fd == op.fd)
                        .expect("the op is pending");
                    self.pending.remove(at);
                    self.done.push_back(Completion {
                        user_data: op.user_data,
                        result,
                    });
                }
                None => k += 1,
            }
        }
        Ok(())
    }

    fn drain(&mut self, out: &mut [Completion]) -> usize {
        let n = out.len().min(self.done.len());
        for c in out.iter_mut().take(n) {
            *c = self.done.pop_front().expect("counted");
        }
        n
    }

    fn in_flight(&self) -> usize {
        self.pending.len() + self.done.len()
    }

    fn cancel_all(&mut self) {
        // Nothing runs outside a submission: dropping is cancelling.
        self.pending.clear();
        self.done.clear();
    }

    /// # Safety
    /// As for [`IoBackend::push_send`].
    unsafe fn push_send(&mut self, ud: u64, fd: RawFd, buf: *const u8, len: u32, _: bool) -> bool {
        self.queue(ud, fd, Kind::Send(buf, len))
    }

    /// # Safety
    /// As for [`IoBackend::push_sendmsg`].
    unsafe fn push_sendmsg(&mut self, ud: u64, fd: RawFd, msg: *const libc::msghdr) -> bool {
        self.queue(ud, fd, Kind::SendMsg(msg))
    }

    /// # Safety
    /// As for [`IoBackend::push_recv`].
    unsafe fn push_recv(&mut self, ud: u64, fd: RawFd, buf: *mut u8, len: u32) -> bool {
        self.queue(ud, fd, Kind::Recv(buf, len))
    }

    /// # Safety
    /// Not supported: completes with EBADF.
    unsafe fn push_eventfd_read(&mut self, ud: u64, _: RawFd, _: *mut u64) -> bool {
        if self.in_flight() == self.depth {
            return false;
        }
        self.done.push_back(Completion {
            user_data: ud,
            result: -libc::EBADF,
        });
        true
    }

    fn push_poll_in(&mut self, ud: u64, fd: RawFd) -> bool {
        self.queue(ud, fd, Kind::PollIn)
    }

    /// # Safety
    /// As for [`IoBackend::push_timeout`]. Virtual time: one step per
    /// millisecond asked (at least one).
    unsafe fn push_timeout(&mut self, ud: u64, ts: *const Timespec) -> bool {
        // SAFETY: the caller's timespec is valid until the completion.
        let t = unsafe { *ts };
        let ms = (t.tv_sec as u64 * 1000 + t.tv_nsec as u64 / 1_000_000).clamp(1, u32::MAX as u64);
        self.queue(ud, -1, Kind::Timeout(ms as u32))
    }

    fn push_cancel(&mut self, ud: u64, target: u64) -> bool {
        self.queue(ud, -1, Kind::Cancel(target))
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
    /// Nothing is registered.
    unsafe fn register_buffers(&mut self, _: &[(*mut u8, usize)]) -> Result<()> {
        Ok(())
    }
}
