//! The I/O interface every poll loop runs on: reads into caller-owned
//! memory, socket sends and receives, polls, timeouts and cancels, each
//! completion carrying the caller's `user_data` (a slot index; nothing is
//! allocated per operation). Behind it:
//!
//! - [`Uring`] (`uring.rs`): io_uring (registered buffers and files,
//!   batched submission, optional SQPOLL), the production backend;
//! - [`StoreRing`] (`store.rs`): ranged GETs from an object store by
//!   worker threads, for a source in a bucket; [`Split`] (`split.rs`)
//!   routes a poller's object reads to one and the rest to io_uring (a
//!   partial space over a bucket);
//! - [`Faulty`] (`faulty.rs`): wraps any backend and injects seeded faults
//!   (EIO, short reads and sends, EAGAIN, EINTR, connection resets, delayed
//!   completions), so the error paths of every loop run everywhere;
//! - `MemBackend` (`mem.rs`, tests only): reads from a file image in
//!   memory, so the loader's poller runs under Miri;
//! - `MemNet` (`memnet.rs`, tests only): an in-memory network of paired
//!   endpoints with seeded delivery and faults, for the simulator
//!   (`src/sim/`).
//!
//! The loops are generic over [`IoBackend`] (the node service's poller is
//! monomorphised on `Uring` in production) or hold a `Box<dyn IoBackend>`
//! (the loader's pollers, whose fault wrapper is chosen at run time).

use std::io;
use std::os::fd::{BorrowedFd, OwnedFd, RawFd};
use std::time::{Duration, Instant};

use crate::error::Result;

mod faulty;
#[cfg(test)]
mod mem;
#[cfg(test)]
pub(crate) mod memnet;
#[cfg(feature = "s3")]
mod split;
#[cfg(feature = "s3")]
mod store;
mod uring;

#[cfg(test)]
pub(crate) use faulty::NetFaults;
pub use faulty::{FaultConfig, Faulty};
#[cfg(test)]
pub(crate) use mem::MemBackend;
#[cfg(feature = "s3")]
pub use split::Split;
#[cfg(feature = "s3")]
pub use store::{ObjectOf, StoreRing};
pub use uring::{Uring, UringOptions};

/// Which file a read targets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// Index into the files registered with the ring.
    Fixed(u32),
    /// A plain descriptor.
    Fd(RawFd),
    /// An object of a source in an object store: the catalog's file index.
    /// Only [`StoreRing`] (and [`Split`], through one) reads these; other
    /// backends complete such a read
    /// with `-EBADF`.
    Object(u32),
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

/// A relative time for [`IoBackend::push_timeout`], laid out as the
/// kernel's `__kernel_timespec` (the caller owns it until the timeout's
/// completion, as it owns a read's buffer).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[repr(C)]
#[allow(dead_code)] // no loop arms a timer yet; the interface and its tests do
pub struct Timespec {
    /// Seconds.
    pub tv_sec: i64,
    /// Nanoseconds (below 10⁹).
    pub tv_nsec: i64,
}

impl From<Duration> for Timespec {
    fn from(d: Duration) -> Self {
        Timespec {
            tv_sec: d.as_secs() as i64,
            tv_nsec: d.subsec_nanos() as i64,
        }
    }
}

/// The I/O interface of a poll loop: operations are queued with the
/// caller's `user_data` (returned in their [`Completion`]; `u64::MAX` is
/// reserved), submitted in batches, and their completions drained. Every
/// operation pushed completes exactly once (cancelled ones with
/// `-ECANCELED`), and [`IoBackend::in_flight`] counts those not drained.
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

    /// Queues a `send` of `len` bytes at `buf` on socket `fd` (`more`: the
    /// caller sends the rest of a frame right after, so the kernel may
    /// coalesce). The completion carries the bytes taken, which may be
    /// fewer than `len`, or -errno. Returns false when the queue is full.
    ///
    /// # Safety
    /// `buf..buf+len` must stay valid until the completion is drained.
    unsafe fn push_send(
        &mut self,
        user_data: u64,
        fd: RawFd,
        buf: *const u8,
        len: u32,
        more: bool,
    ) -> bool;

    /// Queues a `sendmsg` of `msg` on socket `fd` (a frame header and its
    /// payload from two places in one call, no copy). The completion
    /// carries the bytes taken (possibly fewer than asked) or -errno.
    ///
    /// # Safety
    /// `msg`, its iovecs and the memory they describe must stay valid and
    /// unchanged until the completion is drained.
    unsafe fn push_sendmsg(&mut self, user_data: u64, fd: RawFd, msg: *const libc::msghdr) -> bool;

    /// Queues a `recv` of exactly `len` bytes into `buf` (MSG_WAITALL: the
    /// completion is short only at end of stream or on error; `FrameRx`
    /// takes a short one as the stream's end. A fault wrapper's
    /// `short_recv_ppm` cuts it too, for callers that post the rest again).
    ///
    /// # Safety
    /// `buf..buf+len` must stay valid and unused by anyone else until the
    /// completion is drained.
    unsafe fn push_recv(&mut self, user_data: u64, fd: RawFd, buf: *mut u8, len: u32) -> bool;

    /// Queues a `recvmsg` into `msg`'s iovecs without MSG_WAITALL: the
    /// completion carries the bytes that had arrived (at least one, at
    /// most the iovecs' total; 0 at end of stream) or -errno. One receive
    /// can so take a frame's payload and the next frame's header when both
    /// are there, without waiting for a header that may not come.
    ///
    /// # Safety
    /// `msg`, its iovecs and the memory they describe must stay valid and
    /// unused by anyone else until the completion is drained. The backend
    /// may change the msghdr and its iovec array (the kernel writes
    /// `msg_flags`; a fault wrapper shortens the iovecs), so the caller
    /// builds them anew for every receive.
    unsafe fn push_recvmsg(&mut self, user_data: u64, fd: RawFd, msg: *mut libc::msghdr) -> bool;

    /// Queues a read of 8 bytes from an eventfd (a wake-up).
    ///
    /// # Safety
    /// `buf` must stay valid until the completion is drained.
    unsafe fn push_eventfd_read(&mut self, user_data: u64, fd: RawFd, buf: *mut u64) -> bool;

    /// Queues a one-shot poll for readability of `fd` (a completion
    /// channel's descriptor, to sleep until an armed CQ has work). The
    /// completion carries the poll mask, or -errno.
    fn push_poll_in(&mut self, user_data: u64, fd: RawFd) -> bool;

    /// Queues a timeout that completes with `-ETIME` after `*ts`.
    ///
    /// # Safety
    /// `ts` must stay valid until the completion is drained.
    #[allow(dead_code)] // no loop arms a timer yet; the interface and its tests do
    unsafe fn push_timeout(&mut self, user_data: u64, ts: *const Timespec) -> bool;

    /// Queues the cancellation of the operation pushed with `target`: that
    /// one completes with `-ECANCELED` (or its own result, if it finished
    /// first); this one with 0, or `-ENOENT` when nothing matched, or
    /// `-EALREADY` when the target was already running.
    #[allow(dead_code)] // loops cancel all at teardown; the interface and its tests do
    fn push_cancel(&mut self, user_data: u64, target: u64) -> bool;

    /// Submits what is queued without waiting, and makes no system call
    /// when nothing is: for loops that busy-poll something else (RDMA
    /// completion queues) and peek at this ring's completions in passing.
    fn submit_pending(&mut self) -> io::Result<()>;

    /// Submits what is queued and waits until a completion is ready or
    /// `timeout` passes (whichever is first).
    fn submit_wait_timeout(&mut self, timeout: Duration) -> io::Result<()>;

    /// Completions this backend lost (io_uring's CQ overflow counter):
    /// anything but 0 means an operation will never report back.
    fn lost_completions(&mut self) -> u32;

    /// Registers memory regions as fixed buffers (index = position), for
    /// reads that name one ([`ReadOp::buf_index`]).
    ///
    /// # Safety
    /// Each region must stay mapped and valid for as long as the backend
    /// exists.
    unsafe fn register_buffers(&mut self, regions: &[(*mut u8, usize)]) -> Result<()>;

    /// A descriptor of this backend's io_uring (a duplicate the caller
    /// owns), from which other backends share its registered buffers
    /// ([`IoBackend::share_buffers`]) and on which a thread serving several
    /// backends waits in `poll(2)` ([`IoBackend::prepare_poll`]); `None`
    /// where there is no io_uring.
    fn uring_fd(&self) -> Option<OwnedFd> {
        None
    }

    /// Before the caller waits for this backend's completions in `poll(2)`
    /// on [`IoBackend::uring_fd`] rather than in [`IoBackend::submit`]
    /// (the node agent's poller threads): gets what is queued into the
    /// kernel and makes every operation in flight able to end that wait.
    /// The default, for a backend without an io_uring: [`PollWait::Soon`].
    fn prepare_poll(&mut self) -> io::Result<PollWait> {
        Ok(PollWait::Soon)
    }

    /// Shares the registered buffers of the io_uring `from` (Linux 6.12+,
    /// `IORING_REGISTER_CLONE_BUFFERS`): the memory is pinned and charged
    /// to `RLIMIT_MEMLOCK` once, not once per backend. An error where the
    /// kernel or the backend cannot; the caller then registers its own.
    fn share_buffers(&mut self, from: BorrowedFd<'_>) -> Result<()> {
        let _ = from;
        Err(crate::error::Error::Uring {
            what: "share registered buffers (not an io_uring backend)",
            source: io::Error::from_raw_os_error(libc::EOPNOTSUPP).into(),
        })
    }

    /// The loop's clock: `Instant::now()` on real backends, the
    /// simulator's virtual time on `MemNet`. Loops read time only here, so
    /// a seed replays their timeouts too.
    fn now(&self) -> Instant;

    /// Shuts both directions of socket `fd` now (`shutdown(SHUT_RDWR)`,
    /// not queued): its receives and sends in flight end, and its peer
    /// reads EOF after what was sent. Errors are ignored (the socket may
    /// already be gone, which is what the caller wants).
    fn shutdown(&mut self, fd: RawFd);

    /// Sends `buf` on socket `fd` now without blocking
    /// (`MSG_DONTWAIT | MSG_NOSIGNAL`), for small frames outside the
    /// queued stream (an ERROR before closing, a heartbeat on an RDMA
    /// connection's control socket): the bytes taken (possibly fewer), or
    /// `WouldBlock` when there is no room, or the error.
    fn send_now(&mut self, fd: RawFd, buf: &[u8]) -> io::Result<usize>;

    /// Sets `TCP_USER_TIMEOUT` on socket `fd`: unacknowledged data older
    /// than `timeout` ends the connection.
    fn set_user_timeout(&mut self, fd: RawFd, timeout: Duration) -> io::Result<()>;
}

/// What a caller about to wait in `poll(2)` on a backend's io_uring may do
/// ([`IoBackend::prepare_poll`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PollWait {
    /// A completion is ready now: drain, do not wait.
    Now,
    /// Every operation in flight ends such a wait when it completes.
    Ring,
    /// Some cannot (held back, or still queued after a transient
    /// submission error): wait briefly and look again.
    Soon,
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
