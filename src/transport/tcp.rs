//! The TCP backend of [`Link`]: a posted write becomes a DATA frame (24-byte
//! header naming the grant and the ring offset, then the bytes), an error an
//! ERROR frame. Frames go out in post order, several per `sendmsg` (up to
//! [`SEND_BATCH`]), with exactly one `sendmsg` in flight per socket, because
//! io_uring does not order two sends on one stream socket. The sends run on
//! the caller's io_uring (the poller's), so disk reads and network sends of
//! one poller share one submission and one completion queue.
//!
//! Every piece of memory the kernel sees (headers, iovecs, the msghdr) lives
//! in boxed arrays sized at construction; posting never allocates.

use std::collections::VecDeque;
use std::io;
use std::os::fd::RawFd;

use super::proto::{self, Code, Header};
use super::{Done, Link};
use crate::ring::{IoBackend, Uring};

/// Most frames one `sendmsg` carries (each a header and a payload iovec).
pub const SEND_BATCH: usize = 16;

#[derive(Clone, Copy)]
struct Wr {
    wr_id: u64,
    hdr: [u8; proto::HEADER_BYTES],
    src: *const u8,
    len: u32,
    /// Bytes of header + payload already sent.
    sent: usize,
}

struct Tx {
    iov: [libc::iovec; 2 * SEND_BATCH],
    msg: libc::msghdr,
}

/// The owner side of one TCP connection.
pub struct TcpLink {
    fd: RawFd,
    /// user_data of this link's send completions on the driver ring.
    user_data: u64,
    queue: VecDeque<Wr>,
    capacity: usize,
    /// Frames of `queue`'s front in the `sendmsg` in flight (0: none).
    in_flight: usize,
    tx: Box<Tx>,
    done: VecDeque<Done>,
    /// Set once a send failed or the link was closed: everything else fails.
    broken: bool,
}

// SAFETY: the raw pointers are addresses of memory the poster keeps valid
// until completion (post_write's contract); the link is used by one thread
// at a time.
unsafe impl Send for TcpLink {}

impl TcpLink {
    /// A link on socket `fd` holding at most `capacity` posted frames; its
    /// send completions on the driver ring carry `user_data`.
    pub fn new(fd: RawFd, capacity: usize, user_data: u64) -> Self {
        TcpLink {
            fd,
            user_data,
            queue: VecDeque::with_capacity(capacity),
            capacity,
            in_flight: 0,
            tx: Box::new(Tx {
                iov: [libc::iovec {
                    iov_base: std::ptr::null_mut(),
                    iov_len: 0,
                }; 2 * SEND_BATCH],
                // SAFETY: msghdr is plain data; all-zero is a valid empty header.
                msg: unsafe { std::mem::zeroed() },
            }),
            done: VecDeque::with_capacity(capacity),
            broken: false,
        }
    }

    /// Whether a `sendmsg` is in flight on the driver ring.
    pub fn busy(&self) -> bool {
        self.in_flight > 0
    }

    /// Whether frames are queued or in flight (a flush or a completion is
    /// still to come).
    pub(crate) fn pending(&self) -> bool {
        self.in_flight > 0 || !self.queue.is_empty()
    }

    /// Whether the stream is inside a frame: a `sendmsg` is in flight, or
    /// one took part of the first frame and the rest is not sent yet.
    /// Bytes written on the socket by anyone else now (an ERROR before
    /// closing) would land inside that frame.
    pub(crate) fn mid_frame(&self) -> bool {
        self.in_flight > 0 || self.queue.front().is_some_and(|w| w.sent > 0)
    }

    /// Takes the completion of this link's `sendmsg` (`res`: bytes sent or
    /// -errno): frames sent whole complete; a partly sent one stays first.
    pub fn on_send(&mut self, res: i32) {
        let batch = std::mem::take(&mut self.in_flight);
        if res <= 0 || self.broken {
            self.broken = true;
            self.fail_all();
            return;
        }
        let mut left = res as usize;
        for _ in 0..batch {
            let w = self
                .queue
                .front_mut()
                .expect("frames of the batch are queued");
            let total = proto::HEADER_BYTES + w.len as usize;
            let take = left.min(total - w.sent);
            w.sent += take;
            left -= take;
            if w.sent < total {
                break;
            }
            let wr_id = w.wr_id;
            self.queue.pop_front();
            self.done.push_back(Done { wr_id, ok: true });
        }
    }

    /// Stops sending: every posted frame not in flight fails now, those in
    /// flight when their `sendmsg` returns.
    pub fn close(&mut self) {
        self.broken = true;
        if self.in_flight == 0 {
            self.fail_all();
        }
    }

    /// [`Link::flush`] on any backend: posts the next `sendmsg` of queued
    /// frames unless one is in flight.
    pub(crate) fn flush_on<R: IoBackend + ?Sized>(&mut self, ring: &mut R) -> io::Result<()> {
        if self.in_flight > 0 || self.broken || self.queue.is_empty() {
            return Ok(());
        }
        let (mut k, mut n) = (0, 0);
        for w in self.queue.iter_mut().take(SEND_BATCH) {
            let hdr_left = proto::HEADER_BYTES.saturating_sub(w.sent);
            let pay_done = w.sent.saturating_sub(proto::HEADER_BYTES);
            if hdr_left > 0 {
                self.tx.iov[n] = libc::iovec {
                    iov_base: w.hdr[proto::HEADER_BYTES - hdr_left..].as_mut_ptr().cast(),
                    iov_len: hdr_left,
                };
                n += 1;
            }
            if w.len as usize > pay_done {
                self.tx.iov[n] = libc::iovec {
                    iov_base: w.src.wrapping_add(pay_done) as *mut libc::c_void,
                    iov_len: w.len as usize - pay_done,
                };
                n += 1;
            }
            k += 1;
        }
        self.tx.msg.msg_iov = self.tx.iov.as_mut_ptr();
        self.tx.msg.msg_iovlen = n as _;
        // SAFETY: headers live in `queue` (not moved while in flight: only
        // completed frames are popped, and pushes go to the back of a deque
        // with reserved capacity, which never reallocates), payloads are
        // valid per post_write's contract, iovecs and msghdr are boxed.
        if unsafe { ring.push_sendmsg(self.user_data, self.fd, &self.tx.msg) } {
            self.in_flight = k;
            Ok(())
        } else {
            Err(io::Error::from(io::ErrorKind::WouldBlock))
        }
    }

    fn fail_all(&mut self) {
        while let Some(w) = self.queue.pop_front() {
            self.done.push_back(Done {
                wr_id: w.wr_id,
                ok: false,
            });
        }
    }

    /// A DATA frame as [`Link::post_write`] posts one, with the owner's
    /// times for the grant in its header's `b` ([`proto::data_times`]).
    ///
    /// # Safety
    /// As for [`super::Link::post_write`].
    pub(crate) unsafe fn post_write_timed(
        &mut self,
        wr_id: u64,
        src: *const u8,
        len: u32,
        remote_offset: u64,
        grant: u32,
        times: u32,
    ) -> bool {
        self.post(Wr {
            wr_id,
            hdr: Header::data_timed(grant, remote_offset, len, times).encode(),
            src,
            len,
            sent: 0,
        })
    }

    /// Queues a frame that is only a header (a heartbeat); false when the
    /// queue is full or the link broken, as a post is.
    pub(crate) fn post_header(&mut self, wr_id: u64, hdr: proto::Header) -> bool {
        self.post(Wr {
            wr_id,
            hdr: hdr.encode(),
            src: std::ptr::null(),
            len: 0,
            sent: 0,
        })
    }

    fn post(&mut self, wr: Wr) -> bool {
        if self.broken || self.queue.len() == self.capacity {
            return false;
        }
        self.queue.push_back(wr);
        true
    }
}

impl Link for TcpLink {
    type Driver = Uring;

    /// # Safety
    /// As for [`super::Link::post_write`].
    unsafe fn post_write(
        &mut self,
        wr_id: u64,
        src: *const u8,
        len: u32,
        remote_offset: u64,
        grant: u32,
        _rkey: u32,
    ) -> bool {
        // SAFETY: forwarded contract; times 0 report none.
        unsafe { self.post_write_timed(wr_id, src, len, remote_offset, grant, 0) }
    }

    /// # Safety
    /// As for [`super::Link::post_error`].
    unsafe fn post_error(
        &mut self,
        wr_id: u64,
        grant: u32,
        code: Code,
        msg: *const u8,
        len: u32,
    ) -> bool {
        let len = len.min(proto::MAX_MESSAGE_BYTES as u32);
        self.post(Wr {
            wr_id,
            hdr: Header::error(grant, code, len).encode(),
            src: msg,
            len,
            sent: 0,
        })
    }

    fn flush(&mut self, ring: &mut Uring) -> io::Result<()> {
        self.flush_on(ring)
    }

    fn poll(&mut self, out: &mut [Done]) -> usize {
        let n = out.len().min(self.done.len());
        for slot in out.iter_mut().take(n) {
            *slot = self.done.pop_front().expect("counted");
        }
        n
    }
}
