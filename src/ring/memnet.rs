//! `MemNet` (tests only): an in-memory network behind [`IoBackend`], with
//! no socket and no system call, so the loops' transport code runs in one
//! process under a seed (and under Miri). A [`MemNet`] is one loop's port
//! onto a shared world ([`MemNet::port`] makes another, as each loop owns
//! its ring): endpoints come in pairs ([`MemNet::pair`]) and a descriptor
//! is an endpoint's index; files ([`MemNet::add_file`]) are byte images
//! read through `Target::Fixed(i)` or `Target::Fd(FILE_FD_BASE + i)` (a
//! lower `Target::Fd` is a real file the code under test opened, read with
//! the one system call here, `pread`); the
//! clock is virtual ([`IoBackend::now`], moved by [`MemNet::advance`]).
//! Each submission is one step of the port's operations: they progress in
//! a seeded order, within TCP's guarantees (the operations of one kind on
//! one endpoint complete in the order they were queued, and bytes arrive
//! in the order they were sent), with seeded faults: partial sends,
//! completions held back for some steps (a slow disk or network), a peer
//! that stops reading (its receive buffer is bounded, so the sender
//! stalls), and the loss of a connection ([`MemNet::reset`]). Everything
//! is allocated at construction; operations never allocate.

use std::collections::VecDeque;
use std::io;
use std::os::fd::RawFd;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::{Completion, IoBackend, ReadOp, Target, Timespec};
use crate::error::Result;

/// Descriptors from here on name files (`FILE_FD_BASE + i` is file `i`),
/// below it endpoints.
pub(crate) const FILE_FD_BASE: RawFd = 1 << 20;

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
    /// This side was shut (`shutdown(SHUT_RDWR)`): its receives end at
    /// once, its sends fail with EPIPE.
    shut: bool,
    /// The connection was lost: everything fails with ECONNRESET.
    reset: bool,
}

/// What every port shares: the endpoints, the files, the seeded sequence
/// and the clock.
struct World {
    eps: Vec<Endpoint>,
    files: Vec<Vec<u8>>,
    state: u64,
    faults: MemNetFaults,
    base: Instant,
    clock: Duration,
}

impl World {
    fn below(&mut self, n: u64) -> u64 {
        self.state = self.state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        crate::hash::reduce(crate::hash::mix64(self.state), n.max(1))
    }

    fn roll(&mut self, ppm: u32) -> bool {
        self.below(1_000_000) < ppm as u64
    }
}

#[derive(Clone, Copy)]
enum Kind {
    Read(ReadOp),
    Send(*const u8, u32),
    SendMsg(*const libc::msghdr),
    Recv(*mut u8, u32),
    /// Without MSG_WAITALL: what has arrived, into the iovecs in order.
    RecvMsg(*mut libc::msghdr),
    PollIn,
    /// Completes once the virtual clock reaches this time.
    Timeout(Duration),
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

/// One loop's port onto the in-memory network (see the module's
/// documentation).
pub(crate) struct MemNet {
    world: Arc<Mutex<World>>,
    pending: Vec<Op>,
    done: VecDeque<Completion>,
    /// The pools' capacities at construction (they never grow).
    caps: (usize, usize),
    depth: usize,
    /// Completions the port's completion queue holds (`with_cq_limit`;
    /// `usize::MAX`: all), and those lost past it.
    cq_limit: usize,
    lost: u32,
    /// This port's file `i` is the world's file `file_base + i` (each
    /// simulated node reads its own extents by their own indices).
    file_base: u32,
}

// SAFETY: the raw pointers are the callers' buffers, valid until their
// completions per the IoBackend contracts; a port is used by one thread at
// a time (&mut self) and the world is behind a mutex.
unsafe impl Send for MemNet {}

impl MemNet {
    /// A network of at most `endpoints` endpoints, each buffering at most
    /// `buffer` bytes, and its first port, with at most `depth` operations
    /// in flight.
    pub(crate) fn new(
        seed: u64,
        endpoints: usize,
        buffer: usize,
        depth: usize,
        faults: MemNetFaults,
    ) -> Self {
        let world = World {
            eps: (0..endpoints)
                .map(|_| Endpoint {
                    peer: usize::MAX,
                    rx: VecDeque::with_capacity(buffer),
                    cap: buffer,
                    eof: false,
                    shut: false,
                    reset: false,
                })
                .collect(),
            files: Vec::new(),
            state: crate::hash::mix64(seed ^ 0x6e65_7473),
            faults,
            base: Instant::now(),
            clock: Duration::ZERO,
        };
        MemNet::on(Arc::new(Mutex::new(world)), depth)
    }

    fn on(world: Arc<Mutex<World>>, depth: usize) -> Self {
        let pending = Vec::with_capacity(depth);
        let done = VecDeque::with_capacity(depth);
        MemNet {
            caps: (pending.capacity(), done.capacity()),
            world,
            pending,
            done,
            depth,
            cq_limit: usize::MAX,
            lost: 0,
            file_base: 0,
        }
    }

    /// Another port onto the same network (for another loop), with at most
    /// `depth` operations in flight.
    pub(crate) fn port(&self, depth: usize) -> Self {
        MemNet::on(self.world.clone(), depth)
    }

    fn w(&self) -> MutexGuard<'_, World> {
        // A panic elsewhere in a test poisons it; the world's state is
        // still what that test wants to report on.
        self.world.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Checks that no pool of this port grew since construction and that
    /// no receive buffer overfilled.
    pub(crate) fn check_pools(&self) {
        assert_eq!(
            (self.pending.capacity(), self.done.capacity()),
            self.caps,
            "MemNet: a pool grew"
        );
        for e in &self.w().eps {
            assert!(e.rx.len() <= e.cap, "MemNet: a receive buffer overfilled");
        }
    }

    /// Connects two fresh endpoints; returns their descriptors.
    pub(crate) fn pair(&mut self) -> (RawFd, RawFd) {
        let mut w = self.w();
        let a = w
            .eps
            .iter()
            .position(|e| e.peer == usize::MAX)
            .expect("MemNet: no endpoint left");
        w.eps[a].peer = a;
        let b = w
            .eps
            .iter()
            .position(|e| e.peer == usize::MAX)
            .expect("MemNet: no endpoint left");
        w.eps[a].peer = b;
        w.eps[b].peer = a;
        (a as RawFd, b as RawFd)
    }

    /// Adds a file holding `bytes`; returns its index (`Target::Fixed`).
    pub(crate) fn add_file(&mut self, bytes: Vec<u8>) -> u32 {
        let mut w = self.w();
        w.files.push(bytes);
        (w.files.len() - 1) as u32
    }

    /// Moves the virtual clock forward.
    pub(crate) fn advance(&mut self, d: Duration) {
        self.w().clock += d;
    }

    /// Loses the connection of `fd`: both ends' operations fail.
    pub(crate) fn reset(&mut self, fd: RawFd) {
        let mut w = self.w();
        let a = fd as usize;
        let b = w.eps[a].peer;
        w.eps[a].reset = true;
        w.eps[b].reset = true;
    }

    /// Shuts `fd`'s sending side (`shutdown(SHUT_WR)`): its peer reads
    /// what was sent, then EOF.
    pub(crate) fn shutdown_write(&mut self, fd: RawFd) {
        let mut w = self.w();
        let b = w.eps[fd as usize].peer;
        w.eps[b].eof = true;
    }

    /// Bytes the peer of `fd` has sent and `fd` has not received.
    #[allow(dead_code)]
    pub(crate) fn unread(&self, fd: RawFd) -> usize {
        self.w().eps[fd as usize].rx.len()
    }

    /// A number below `n` from the seeded sequence.
    pub(crate) fn below(&mut self, n: u64) -> u64 {
        self.w().below(n)
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
}

/// Moves up to `want` bytes from `pieces` into `fd`'s peer, as a send
/// would; returns how many went (bounded by room).
fn transfer(w: &mut World, fd: usize, pieces: &[(*const u8, usize)], want: usize) -> usize {
    let peer = w.eps[fd].peer;
    let room = w.eps[peer].cap - w.eps[peer].rx.len();
    let mut n = want.min(room);
    if n > 1 && w.roll(w.faults.partial_send_ppm) {
        n = 1 + w.below(n as u64 - 1) as usize;
    }
    let mut left = n;
    for &(p, l) in pieces {
        let take = l.min(left);
        if take > 0 {
            // SAFETY: the send's contract: the caller's memory is valid
            // for its length until the completion.
            let s = unsafe { std::slice::from_raw_parts(p, take) };
            w.eps[peer].rx.extend(s.iter().copied());
        }
        left -= take;
        if left == 0 {
            break;
        }
    }
    n
}

/// A read of a file image: the bytes there are (short at the end), or
/// EBADF for a descriptor at or above [`FILE_FD_BASE`] that names no file;
/// a descriptor below it is a real file, read with `pread`.
fn read(w: &World, op: &ReadOp, base: u32) -> i32 {
    let base = base as usize;
    let file = match op.target {
        Target::Fixed(i) => w.files.get(base + i as usize),
        Target::Fd(fd) if fd >= FILE_FD_BASE => w.files.get(base + (fd - FILE_FD_BASE) as usize),
        Target::Object(_) => None,
        Target::Fd(fd) => {
            // A real descriptor: a file the code under test opened itself
            // (the network thread's source fallback over a simulation's
            // real source tree). Read it as the kernel would; the bytes
            // are the file's, so the run stays a function of its seed.
            // SAFETY: push's contract: buf..buf+len is the caller's until
            // the completion is drained.
            let n = unsafe { libc::pread(fd, op.buf.cast(), op.len as usize, op.offset as i64) };
            return if n < 0 {
                -std::io::Error::last_os_error()
                    .raw_os_error()
                    .unwrap_or(libc::EIO)
            } else {
                n as i32
            };
        }
    };
    let Some(f) = file else {
        return -libc::EBADF;
    };
    let start = (op.offset as usize).min(f.len());
    let n = (op.len as usize).min(f.len() - start);
    // SAFETY: push's contract: buf..buf+len is the caller's until the
    // completion is drained; n <= len.
    unsafe { std::ptr::copy_nonoverlapping(f.as_ptr().add(start), op.buf, n) };
    n as i32
}

fn lock(world: &Mutex<World>) -> MutexGuard<'_, World> {
    world.lock().unwrap_or_else(|p| p.into_inner())
}

impl MemNet {
    /// Tries to complete `op`; None while it must wait.
    fn progress(&mut self, w: &mut World, op: Op) -> Option<i32> {
        let ep = w.eps.get(op.fd);
        let reset = ep.is_some_and(|e| e.reset);
        let shut = ep.is_some_and(|e| e.shut);
        match op.kind {
            Kind::Timeout(at) => (w.clock >= at).then_some(-libc::ETIME),
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
            Kind::Read(r) => Some(read(w, &r, self.file_base)),
            _ if reset => Some(-libc::ECONNRESET),
            Kind::Send(..) | Kind::SendMsg(_) if shut => Some(-libc::EPIPE),
            Kind::Send(p, len) => {
                let n = transfer(w, op.fd, &[(p, len as usize)], len as usize);
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
                let n = transfer(w, op.fd, &pieces[..k], want);
                (n > 0 || want == 0).then_some(n as i32)
            }
            Kind::Recv(buf, len) => {
                let e = &mut w.eps[op.fd];
                let (got, len) = (op.got as usize, len as usize);
                let n = if shut { 0 } else { e.rx.len().min(len - got) };
                for (i, b) in e.rx.drain(..n).enumerate() {
                    // SAFETY: the receive's contract: buf..buf+len is the
                    // caller's until the completion; got + i < len.
                    unsafe { *buf.add(got + i) = b };
                }
                let got = got + n;
                // MSG_WAITALL: all of it, or what came before EOF (or
                // before this side was shut).
                if got == len || e.eof || shut {
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
            Kind::RecvMsg(m) => {
                let e = &mut w.eps[op.fd];
                if e.rx.is_empty() && !e.eof && !shut {
                    return None;
                }
                // SAFETY: the recvmsg contract: msg and its iovecs are
                // valid until the completion.
                let (iov, k) = unsafe { ((*m).msg_iov, (*m).msg_iovlen) };
                let mut got = 0usize;
                for i in 0..k {
                    // SAFETY: as above, i < msg_iovlen.
                    let v = unsafe { *iov.add(i) };
                    let n = if shut { 0 } else { e.rx.len().min(v.iov_len) };
                    for (j, b) in e.rx.drain(..n).enumerate() {
                        // SAFETY: the iovec is the caller's until the
                        // completion; j < iov_len.
                        unsafe { *(v.iov_base as *mut u8).add(j) = b };
                    }
                    got += n;
                    if n < v.iov_len {
                        break;
                    }
                }
                Some(got as i32)
            }
            Kind::PollIn => {
                let e = &w.eps[op.fd];
                (!e.rx.is_empty() || e.eof || shut).then_some(libc::POLLIN as i32)
            }
        }
    }

    fn refuse(&mut self, user_data: u64, errno: i32) -> bool {
        if self.in_flight() == self.depth {
            return false;
        }
        self.done.push_back(Completion {
            user_data,
            result: -errno,
        });
        true
    }
}

/// The simulator's views of a port: a bounded completion queue (as
/// io_uring's, which drops what overflows and counts it), and the memory
/// its operations in flight reference.
impl MemNet {
    /// Holds at most `n` completions not yet drained; more are lost and
    /// counted ([`IoBackend::lost_completions`]), as io_uring's CQ
    /// overflow (without IORING_FEAT_NODROP's backlog).
    pub(crate) fn with_cq_limit(mut self, n: usize) -> Self {
        self.cq_limit = n;
        self
    }

    /// Reads this port's file `i` as the world's file `base + i` (files
    /// `base..` are one node's extents, added in order).
    pub(crate) fn with_file_base(mut self, base: u32) -> Self {
        self.file_base = base;
        self
    }

    fn complete(&mut self, c: Completion) {
        if self.done.len() >= self.cq_limit {
            self.lost += 1;
            return;
        }
        self.done.push_back(c);
    }

    /// Calls `f(user_data, fd, writes, ptr, len)` for each piece of memory
    /// an operation in flight may still read (a send's) or write (a
    /// read's or receive's, `writes`).
    pub(crate) fn each_pending_buffer(
        &self,
        mut f: impl FnMut(u64, RawFd, bool, *const u8, usize),
    ) {
        for o in &self.pending {
            let fd = o.fd as RawFd;
            match o.kind {
                Kind::Read(r) => f(o.user_data, fd, true, r.buf, r.len as usize),
                Kind::Recv(b, len) => f(o.user_data, fd, true, b, len as usize),
                Kind::RecvMsg(m) => {
                    // SAFETY: the recvmsg contract: msg and its iovecs are
                    // valid until the completion.
                    let (iov, k) = unsafe { ((*m).msg_iov, (*m).msg_iovlen) };
                    for i in 0..k {
                        // SAFETY: as above, i < msg_iovlen.
                        let v = unsafe { *iov.add(i) };
                        f(o.user_data, fd, true, v.iov_base as *const u8, v.iov_len);
                    }
                }
                Kind::Send(p, len) => f(o.user_data, fd, false, p, len as usize),
                Kind::SendMsg(m) => {
                    // SAFETY: the sendmsg contract: msg and its iovecs are
                    // valid until the completion.
                    let (iov, k) = unsafe { ((*m).msg_iov, (*m).msg_iovlen) };
                    for i in 0..k {
                        // SAFETY: as above, i < msg_iovlen.
                        let v = unsafe { *iov.add(i) };
                        f(o.user_data, fd, false, v.iov_base as *const u8, v.iov_len);
                    }
                }
                Kind::PollIn | Kind::Timeout(_) | Kind::Cancel(_) => {}
            }
        }
    }
}

impl IoBackend for MemNet {
    /// # Safety
    /// As for [`IoBackend::push`].
    unsafe fn push(&mut self, op: &ReadOp) -> bool {
        self.queue(op.user_data, -1, Kind::Read(*op))
    }

    fn submit(&mut self, _wait: bool) -> io::Result<()> {
        // One step: the operations queued, in a seeded order; of those of
        // one kind on one endpoint, only the oldest may go (TCP's order).
        let n = self.pending.len();
        if n == 0 {
            return Ok(());
        }
        let world = self.world.clone();
        let mut w = lock(&world);
        let delay_ppm = w.faults.delay_ppm;
        let mut k = w.below(n as u64) as usize;
        for _ in 0..n {
            if self.pending.is_empty() {
                break;
            }
            k %= self.pending.len();
            let op = self.pending[k];
            let blocked = self.pending[..k].iter().any(|o| {
                o.fd == op.fd
                    && std::mem::discriminant(&o.kind) == std::mem::discriminant(&op.kind)
                    && !matches!(o.kind, Kind::Timeout(_) | Kind::Cancel(_) | Kind::Read(_))
            });
            if blocked || w.roll(delay_ppm) {
                k += 1;
                continue;
            }
            match self.progress(&mut w, op) {
                Some(result) => {
                    // A cancel may have removed an entry before it.
                    let at = self
                        .pending
                        .iter()
                        .position(|o| o.user_data == op.user_data && o.fd == op.fd)
                        .expect("the op is pending");
                    self.pending.remove(at);
                    self.complete(Completion {
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
    /// As for [`IoBackend::push_recvmsg`].
    unsafe fn push_recvmsg(&mut self, ud: u64, fd: RawFd, msg: *mut libc::msghdr) -> bool {
        self.queue(ud, fd, Kind::RecvMsg(msg))
    }

    /// # Safety
    /// Not supported: completes with EBADF.
    unsafe fn push_eventfd_read(&mut self, ud: u64, _: RawFd, _: *mut u64) -> bool {
        self.refuse(ud, libc::EBADF)
    }

    fn push_poll_in(&mut self, ud: u64, fd: RawFd) -> bool {
        self.queue(ud, fd, Kind::PollIn)
    }

    /// # Safety
    /// As for [`IoBackend::push_timeout`]. Virtual time: it completes at
    /// the first submission after [`MemNet::advance`] has moved the clock
    /// past it.
    unsafe fn push_timeout(&mut self, ud: u64, ts: *const Timespec) -> bool {
        // SAFETY: the caller's timespec is valid until the completion.
        let t = unsafe { *ts };
        let d = Duration::new(
            t.tv_sec.max(0) as u64,
            t.tv_nsec.clamp(0, 999_999_999) as u32,
        );
        let at = lock(&self.world).clock + d;
        self.queue(ud, -1, Kind::Timeout(at))
    }

    fn push_cancel(&mut self, ud: u64, target: u64) -> bool {
        self.queue(ud, -1, Kind::Cancel(target))
    }

    fn submit_pending(&mut self) -> io::Result<()> {
        self.submit(false)
    }

    fn submit_wait_timeout(&mut self, _: Duration) -> io::Result<()> {
        // The simulator moves the clock; a wait is one step.
        self.submit(false)
    }

    fn lost_completions(&mut self) -> u32 {
        self.lost
    }

    /// # Safety
    /// Nothing is registered.
    unsafe fn register_buffers(&mut self, _: &[(*mut u8, usize)]) -> Result<()> {
        Ok(())
    }

    fn now(&self) -> Instant {
        let w = lock(&self.world);
        w.base + w.clock
    }

    fn shutdown(&mut self, fd: RawFd) {
        let mut w = lock(&self.world);
        let Some(e) = w.eps.get_mut(fd as usize) else {
            return;
        };
        e.shut = true;
        let peer = e.peer;
        w.eps[peer].eof = true;
    }

    fn send_now(&mut self, fd: RawFd, buf: &[u8]) -> io::Result<usize> {
        let mut w = lock(&self.world);
        let e = w
            .eps
            .get(fd as usize)
            .ok_or_else(|| io::Error::from_raw_os_error(libc::EBADF))?;
        if e.reset {
            return Err(io::Error::from_raw_os_error(libc::ECONNRESET));
        }
        if e.shut {
            return Err(io::Error::from_raw_os_error(libc::EPIPE));
        }
        match transfer(&mut w, fd as usize, &[(buf.as_ptr(), buf.len())], buf.len()) {
            0 if !buf.is_empty() => Err(io::ErrorKind::WouldBlock.into()),
            n => Ok(n),
        }
    }

    fn set_user_timeout(&mut self, fd: RawFd, _: Duration) -> io::Result<()> {
        // The simulator ends connections itself (MemNet::reset).
        match lock(&self.world).eps.get(fd as usize) {
            Some(_) => Ok(()),
            None => Err(io::Error::from_raw_os_error(libc::EBADF)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_ports_share_the_endpoints_files_and_clock() {
        let mut a = MemNet::new(7, 4, 64, 8, MemNetFaults::default());
        let mut b = a.port(8);
        let (x, y) = a.pair();
        let f = a.add_file((0u8..100).collect());
        let msg = *b"hello";
        let mut got = [0u8; 5];
        let mut page = [0u8; 10];
        // SAFETY: the buffers outlive the completions drained below.
        unsafe {
            assert!(a.push_send(1, x, msg.as_ptr(), 5, false));
            assert!(b.push_recv(2, y, got.as_mut_ptr(), 5));
            assert!(b.push(&ReadOp {
                user_data: 3,
                target: Target::Fixed(f),
                buf: page.as_mut_ptr(),
                len: 10,
                offset: 95,
                buf_index: None,
            }));
        }
        let mut out = [Completion::default(); 4];
        for _ in 0..4 {
            a.submit(false).unwrap();
            b.submit(false).unwrap();
        }
        assert_eq!(a.drain(&mut out), 1);
        assert_eq!(
            out[0],
            Completion {
                user_data: 1,
                result: 5
            }
        );
        let n = b.drain(&mut out);
        assert_eq!(n, 2);
        assert!(out[..2].contains(&Completion {
            user_data: 2,
            result: 5
        }));
        assert!(out[..2].contains(&Completion {
            user_data: 3,
            result: 5
        }));
        assert_eq!(&got, b"hello");
        assert_eq!(&page[..5], &[95, 96, 97, 98, 99]);
        let t0 = b.now();
        a.advance(Duration::from_millis(3));
        assert_eq!(b.now() - t0, Duration::from_millis(3));
        a.check_pools();
        b.check_pools();
    }

    #[test]
    fn shutdown_ends_receives_and_sends_and_the_peer_sees_eof() {
        let mut a = MemNet::new(1, 2, 64, 8, MemNetFaults::default());
        let (x, y) = a.pair();
        assert_eq!(a.send_now(y, b"ab").unwrap(), 2);
        let mut buf = [0u8; 8];
        let mut pbuf = [0u8; 8];
        // SAFETY: the buffers outlive the completions drained below.
        unsafe {
            assert!(a.push_recv(1, x, buf.as_mut_ptr(), 8));
            assert!(a.push_recv(2, y, pbuf.as_mut_ptr(), 8));
        }
        a.submit(false).unwrap();
        a.shutdown(x);
        a.submit(false).unwrap();
        a.submit(false).unwrap();
        let mut out = [Completion::default(); 4];
        let n = a.drain(&mut out);
        assert_eq!(n, 2);
        // x's receive ends with what it had (SHUT_RD); y's sees EOF.
        assert!(out[..2].contains(&Completion {
            user_data: 1,
            result: 2
        }));
        assert!(out[..2].contains(&Completion {
            user_data: 2,
            result: 0
        }));
        assert_eq!(
            a.send_now(x, b"c").unwrap_err().raw_os_error(),
            Some(libc::EPIPE)
        );
    }

    #[test]
    fn a_full_peer_buffer_is_would_block_for_send_now() {
        let mut a = MemNet::new(1, 2, 4, 8, MemNetFaults::default());
        let (x, _y) = a.pair();
        assert_eq!(a.send_now(x, b"abcdef").unwrap(), 4);
        assert_eq!(
            a.send_now(x, b"g").unwrap_err().kind(),
            io::ErrorKind::WouldBlock
        );
    }
}
