//! The consumer's receive side of one framed stream socket (the node takes
//! a consumer's small frames with `transport::stream_rx` instead, several
//! to a receive): a 24-byte header into a fixed buffer, then its body into
//! the connection's body buffer (GRANT entries, an ERROR message) or, once
//! the caller has checked a DATA header against its grant, straight into the
//! landing ring. One receive is in flight at a time, on the caller's
//! io_uring: `MSG_WAITALL` for a header or a body; for a payload of at most
//! the look-ahead size ([`FrameRx::with_lookahead`]), one `recvmsg` into
//! the payload and the next header's buffer, which takes whatever has
//! arrived. A busy stream so costs one receive per small frame instead of
//! two (header, then payload), and a quiet one never waits for a header
//! that may not come: the payload's bytes are handed on as they land.
//!
//! The state machine decides nothing about the protocol: it says what the
//! next receive fills, turns a completion into what arrived (or why the
//! stream ended), and leaves it to the caller (the consumer's network
//! thread, the node service's poller) to decide what a header means with
//! [`FrameRx::expect_body`] or [`FrameRx::expect_payload`].
//!
//! The buffers are boxed at construction; posting and completing never
//! allocate.

use std::os::fd::RawFd;

use super::proto::{FrameError, Header, HEADER_BYTES};
use crate::ring::IoBackend;

/// What the next receive of a [`FrameRx`] fills.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum RxState<T> {
    /// A frame header, into the fixed header buffer.
    Header,
    /// The body of frame `Header`, into the body buffer.
    Body(Header),
    /// `len` bytes of a DATA frame, into the caller's memory at `to`
    /// (consumer: the grant-table entry whose ring range they land in).
    Payload {
        /// Where the bytes go, as the caller names it.
        to: T,
        /// Bytes.
        len: u32,
    },
}

/// What a completed receive brought.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Received<T> {
    /// A header that decoded (kind, per-kind length limits). The next
    /// receive is another header unless the caller says otherwise.
    Header(Header),
    /// The whole body of frame `Header` (read it with [`FrameRx::body`]).
    Body(Header),
    /// `len` more payload bytes landed at `to`, after those that landed
    /// before: all of the frame's payload, or (a look-ahead receive) the
    /// part that had arrived, the rest coming with the next receive.
    Payload {
        /// Where they went.
        to: T,
        /// Bytes.
        len: u32,
    },
}

/// Why a receive ended the stream (every case closes the connection).
#[derive(Debug)]
pub(crate) enum RxError {
    /// The receive failed with this errno.
    Failed(i32),
    /// The peer closed the connection between two frames.
    Closed,
    /// The stream ended (or was shut down) inside a frame.
    Truncated {
        /// Bytes received.
        got: u32,
        /// Bytes the receive asked for.
        want: u32,
    },
    /// A header that is not a frame of this protocol.
    BadHeader(FrameError),
}

/// The `recvmsg` of one receive: its msghdr and `N` iovecs, boxed by
/// their owner so the pointers the kernel holds stay valid when the owner
/// moves. A look-ahead receive here has two (a payload, then a header);
/// `transport::stream_rx` has one.
pub(super) struct RecvMsg<const N: usize> {
    hdr: libc::msghdr,
    iov: [libc::iovec; N],
}

// SAFETY: the pointers are into memory the owner describes for the
// receive in flight (its boxed buffers, the caller's payload target); they
// are rebuilt for every receive and never dereferenced here.
unsafe impl<const N: usize> Send for RecvMsg<N> {}

impl<const N: usize> RecvMsg<N> {
    /// Empty: no receive described yet.
    pub(super) fn new() -> Box<Self> {
        let empty = libc::iovec {
            iov_base: std::ptr::null_mut(),
            iov_len: 0,
        };
        Box::new(RecvMsg {
            // SAFETY: msghdr is plain data; all-zero is its empty value.
            hdr: unsafe { std::mem::zeroed() },
            iov: [empty; N],
        })
    }

    /// Describes a receive into `iov`, in order; the msghdr to post.
    pub(super) fn set(&mut self, iov: [libc::iovec; N]) -> &mut libc::msghdr {
        self.iov = iov;
        // SAFETY: msghdr is plain data; all-zero is its empty value.
        self.hdr = unsafe { std::mem::zeroed() };
        self.hdr.msg_iov = self.iov.as_mut_ptr();
        self.hdr.msg_iovlen = N as _;
        &mut self.hdr
    }
}

/// One connection's receive state machine and buffers.
pub(crate) struct FrameRx<T> {
    hdr: Box<[u8; HEADER_BYTES]>,
    /// Bytes of the next header already in `hdr` (a look-ahead receive's
    /// tail).
    hdr_got: u32,
    body: Box<[u8]>,
    state: RxState<T>,
    inflight: bool,
    /// Largest payload received with the next header (0: none).
    lookahead_bytes: u32,
    /// The receive in flight is a look-ahead `recvmsg`.
    posted_lookahead: bool,
    msg: Box<RecvMsg<2>>,
}

impl<T: Copy> FrameRx<T> {
    /// Waiting for a header, with a body buffer of `body_bytes` (the
    /// largest body of the kinds this end accepts into it).
    pub(crate) fn new(body_bytes: usize) -> Self {
        FrameRx {
            hdr: Box::new([0; HEADER_BYTES]),
            hdr_got: 0,
            body: vec![0u8; body_bytes].into_boxed_slice(),
            state: RxState::Header,
            inflight: false,
            lookahead_bytes: 0,
            posted_lookahead: false,
            msg: RecvMsg::new(),
        }
    }

    /// Receives a payload of at most `bytes` together with the next
    /// frame's header (one `recvmsg` without `MSG_WAITALL`; see the
    /// module's documentation). Larger payloads keep one `MSG_WAITALL`
    /// receive each: taken in pieces as they arrive, they would cost more
    /// completions than the header's receive saves.
    pub(crate) fn with_lookahead(mut self, bytes: u32) -> Self {
        self.lookahead_bytes = bytes;
        self
    }

    /// Whether a receive is posted and has not returned.
    pub(crate) fn inflight(&self) -> bool {
        self.inflight
    }

    /// Bytes the current state's receive asks for.
    pub(crate) fn want(&self) -> u32 {
        match self.state {
            RxState::Header => HEADER_BYTES as u32 - self.hdr_got,
            RxState::Body(h) => h.body_len,
            RxState::Payload { len, .. } => len,
        }
    }

    /// Posts the receive of the current state on `ring` (socket `fd`, its
    /// completion carrying `user_data`); `payload` turns a payload target
    /// into its address. False when the ring's submission queue is full
    /// (try again later). The caller posts only when none is in flight.
    ///
    /// # Safety
    /// This `FrameRx` must not be dropped before the receive has returned
    /// ([`FrameRx::returned`]): the kernel writes its boxed buffers until
    /// then. In the payload state, `payload(to)` must point to `len`
    /// writable bytes that nothing else reads or writes until then.
    pub(crate) unsafe fn post<R: IoBackend + ?Sized>(
        &mut self,
        ring: &mut R,
        user_data: u64,
        fd: RawFd,
        payload: impl FnOnce(T) -> *mut u8,
    ) -> bool {
        debug_assert!(!self.inflight, "one receive at a time");
        debug_assert!(
            self.hdr_got < HEADER_BYTES as u32,
            "a whole header is buffered: take it first (FrameRx::buffered)"
        );
        if let RxState::Payload { to, len } = self.state {
            if len > 0 && len <= self.lookahead_bytes {
                debug_assert_eq!(self.hdr_got, 0, "a payload follows its header");
                let msg = self.msg.set([
                    libc::iovec {
                        iov_base: payload(to).cast(),
                        iov_len: len as usize,
                    },
                    libc::iovec {
                        iov_base: self.hdr.as_mut_ptr().cast(),
                        iov_len: HEADER_BYTES,
                    },
                ]);
                // SAFETY: the msghdr, its iovecs and the header buffer are
                // boxed (they do not move with `self`) and outlive the
                // receive per this function's contract, as does the
                // payload target; nothing reads the header buffer until
                // the completion.
                if unsafe { ring.push_recvmsg(user_data, fd, msg) } {
                    self.inflight = true;
                    self.posted_lookahead = true;
                }
                return self.inflight;
            }
        }
        let (buf, len) = match self.state {
            RxState::Header => (
                // SAFETY: hdr_got < HEADER_BYTES (asserted above: the
                // caller takes a whole buffered header before posting).
                unsafe { self.hdr.as_mut_ptr().add(self.hdr_got as usize) },
                HEADER_BYTES as u32 - self.hdr_got,
            ),
            RxState::Body(h) => (self.body.as_mut_ptr(), h.body_len),
            RxState::Payload { to, len } => (payload(to), len),
        };
        // SAFETY: the header and body buffers are boxed (they do not move
        // with `self`) and outlive the receive per this function's
        // contract, which also covers the payload target; a body is never
        // longer than the buffer (`expect_body`).
        if unsafe { ring.push_recv(user_data, fd, buf, len) } {
            self.inflight = true;
            self.posted_lookahead = false;
        }
        self.inflight
    }

    /// The posted receive returned (whether or not its result is used).
    pub(crate) fn returned(&mut self) {
        self.inflight = false;
    }

    /// Interprets the result `res` (bytes, or -errno) of the receive that
    /// returned; a header is decoded with `max_data` as the DATA limit. A
    /// body or a whole payload puts the machine back to waiting for a
    /// header (part of which a look-ahead receive may have brought:
    /// [`FrameRx::buffered`]); a look-ahead receive that brought part of
    /// the payload stays on the payload, for the rest.
    pub(crate) fn received(&mut self, res: i32, max_data: u32) -> Result<Received<T>, RxError> {
        let want = self.want();
        let lookahead = std::mem::take(&mut self.posted_lookahead);
        if res < 0 {
            return Err(RxError::Failed(-res));
        }
        let got = res as u32;
        if lookahead {
            let RxState::Payload { to, len } = self.state else {
                unreachable!("a look-ahead receive is posted for a payload only")
            };
            if got == 0 {
                return Err(RxError::Truncated { got: 0, want: len });
            }
            if got < len {
                self.state = RxState::Payload { to, len: len - got };
                return Ok(Received::Payload { to, len: got });
            }
            debug_assert!(
                got - len <= HEADER_BYTES as u32,
                "{got} of {len} + a header"
            );
            self.hdr_got = got - len;
            self.state = RxState::Header;
            return Ok(Received::Payload { to, len });
        }
        if got < want {
            return Err(
                if got == 0 && self.hdr_got == 0 && matches!(self.state, RxState::Header) {
                    RxError::Closed
                } else if matches!(self.state, RxState::Header) {
                    RxError::Truncated {
                        got: self.hdr_got + got,
                        want: HEADER_BYTES as u32,
                    }
                } else {
                    RxError::Truncated { got, want }
                },
            );
        }
        match self.state {
            RxState::Header => {
                self.hdr_got = 0;
                Header::decode(&self.hdr, max_data)
                    .map(Received::Header)
                    .map_err(RxError::BadHeader)
            }
            RxState::Body(h) => {
                self.state = RxState::Header;
                Ok(Received::Body(h))
            }
            RxState::Payload { to, len } => {
                self.state = RxState::Header;
                Ok(Received::Payload { to, len })
            }
        }
    }

    /// A whole header that a look-ahead receive brought after its payload
    /// (decoded as [`FrameRx::received`] does, `max_data` the DATA limit),
    /// or None. Called after acting on what `received` returned, before
    /// the next receive is posted.
    pub(crate) fn buffered(&mut self, max_data: u32) -> Option<Result<Received<T>, RxError>> {
        if !matches!(self.state, RxState::Header) || self.hdr_got < HEADER_BYTES as u32 {
            return None;
        }
        self.hdr_got = 0;
        Some(
            Header::decode(&self.hdr, max_data)
                .map(Received::Header)
                .map_err(RxError::BadHeader),
        )
    }

    /// The next receive takes the body of frame `h` into the body buffer.
    ///
    /// # Panics
    /// When the body is longer than the buffer: the buffer is sized for
    /// the largest body [`Header::decode`] lets through for every kind the
    /// caller reads this way.
    pub(crate) fn expect_body(&mut self, h: Header) {
        assert!(
            h.body_len as usize <= self.body.len(),
            "a {:?} body of {} bytes does not fit the {}-byte body buffer",
            h.kind,
            h.body_len,
            self.body.len()
        );
        self.state = RxState::Body(h);
    }

    /// The next receive takes `len` payload bytes into the caller's memory
    /// named `to` (see [`FrameRx::post`]).
    pub(crate) fn expect_payload(&mut self, to: T, len: u32) {
        self.state = RxState::Payload { to, len };
    }

    /// The body of frame `h`, just received.
    pub(crate) fn body(&self, h: &Header) -> &[u8] {
        &self.body[..h.body_len as usize]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::proto::{Code, Kind};

    fn rx_with_header(h: Header) -> FrameRx<u32> {
        let mut rx = FrameRx::new(64);
        *rx.hdr = h.encode();
        rx
    }

    #[test]
    fn header_then_body_then_header() {
        let h = Header::error(7, Code::ReadFailed, 5);
        let mut rx = rx_with_header(h);
        assert_eq!(rx.want(), HEADER_BYTES as u32);
        let got = rx.received(HEADER_BYTES as i32, 0).expect("a header");
        assert_eq!(got, Received::Header(h));
        rx.expect_body(h);
        assert_eq!(rx.want(), 5);
        rx.body[..5].copy_from_slice(b"hello");
        assert_eq!(rx.received(5, 0).expect("a body"), Received::Body(h));
        assert_eq!(rx.body(&h), b"hello");
        assert_eq!(rx.state, RxState::Header);
    }

    #[test]
    fn payload_goes_back_to_header() {
        let h = Header::data(3, 4096, 100);
        let mut rx = rx_with_header(h);
        assert_eq!(
            rx.received(HEADER_BYTES as i32, 1 << 20).unwrap(),
            Received::Header(h)
        );
        rx.expect_payload(9, 100);
        assert_eq!(rx.want(), 100);
        assert_eq!(
            rx.received(100, 0).unwrap(),
            Received::Payload { to: 9, len: 100 }
        );
        assert_eq!(rx.state, RxState::Header);
    }

    #[test]
    fn ends_of_the_stream_are_named() {
        let mut rx: FrameRx<u32> = FrameRx::new(8);
        assert!(matches!(rx.received(0, 0), Err(RxError::Closed)));
        assert!(matches!(
            rx.received(10, 0),
            Err(RxError::Truncated { got: 10, want: 24 })
        ));
        assert!(matches!(
            rx.received(-libc::ECONNRESET, 0),
            Err(RxError::Failed(libc::ECONNRESET))
        ));
        rx.expect_payload(1, 50);
        // Zero bytes inside a frame is a truncation, not a clean close.
        assert!(matches!(
            rx.received(0, 0),
            Err(RxError::Truncated { got: 0, want: 50 })
        ));
    }

    #[test]
    fn a_bad_header_is_a_frame_error() {
        let mut rx: FrameRx<u32> = FrameRx::new(8);
        rx.hdr[0] = 0xee;
        assert!(matches!(
            rx.received(HEADER_BYTES as i32, 0),
            Err(RxError::BadHeader(FrameError::BadMagic(_)))
        ));
        // DATA longer than the limit given is refused before its payload.
        *rx.hdr = Header::data(1, 0, 100).encode();
        assert!(matches!(
            rx.received(HEADER_BYTES as i32, 99),
            Err(RxError::BadHeader(FrameError::TooLong {
                kind: Kind::Data,
                ..
            }))
        ));
    }

    /// A look-ahead receive that brought `got` bytes (as post would have
    /// set it up).
    fn lookahead_received(rx: &mut FrameRx<u32>, got: i32) -> Result<Received<u32>, RxError> {
        rx.posted_lookahead = true;
        rx.received(got, 1 << 20)
    }

    #[test]
    fn a_lookahead_receive_takes_the_payload_and_the_next_header() {
        let next = Header::data(4, 8192, 50);
        let mut rx: FrameRx<u32> = FrameRx::new(8).with_lookahead(1000);
        rx.expect_payload(7, 100);
        *rx.hdr = next.encode();
        let got = lookahead_received(&mut rx, 100 + HEADER_BYTES as i32).unwrap();
        assert_eq!(got, Received::Payload { to: 7, len: 100 });
        assert_eq!(
            rx.buffered(1 << 20).unwrap().unwrap(),
            Received::Header(next)
        );
        assert!(rx.buffered(1 << 20).is_none(), "taken once");
        assert_eq!(rx.want(), HEADER_BYTES as u32);
    }

    #[test]
    fn a_lookahead_receive_hands_on_a_partial_payload() {
        let mut rx: FrameRx<u32> = FrameRx::new(8).with_lookahead(1000);
        rx.expect_payload(3, 100);
        let got = lookahead_received(&mut rx, 30).unwrap();
        assert_eq!(got, Received::Payload { to: 3, len: 30 });
        assert!(rx.buffered(1 << 20).is_none());
        assert_eq!(rx.state, RxState::Payload { to: 3, len: 70 });
        // Then the rest and part of the next header: the header's receive
        // asks for what is missing, and ends in the header.
        let got = lookahead_received(&mut rx, 70 + 10).unwrap();
        assert_eq!(got, Received::Payload { to: 3, len: 70 });
        assert!(rx.buffered(1 << 20).is_none(), "10 of 24 header bytes");
        assert_eq!(rx.want(), HEADER_BYTES as u32 - 10);
        let h = Header::keepalive(false);
        *rx.hdr = h.encode();
        assert_eq!(
            rx.received(HEADER_BYTES as i32 - 10, 0).unwrap(),
            Received::Header(h)
        );
        assert_eq!(rx.want(), HEADER_BYTES as u32);
    }

    #[test]
    fn a_stream_that_ends_inside_a_lookahead_frame_is_truncated() {
        let mut rx: FrameRx<u32> = FrameRx::new(8).with_lookahead(1000);
        rx.expect_payload(3, 100);
        assert!(matches!(
            lookahead_received(&mut rx, 0),
            Err(RxError::Truncated { got: 0, want: 100 })
        ));
        // Ended inside the next header: truncated, not a clean close.
        let mut rx: FrameRx<u32> = FrameRx::new(8).with_lookahead(1000);
        rx.expect_payload(3, 100);
        lookahead_received(&mut rx, 105).unwrap();
        assert!(matches!(
            rx.received(0, 0),
            Err(RxError::Truncated { got: 5, want: 24 })
        ));
        // A bad header brought by a look-ahead is refused as any other.
        let mut rx: FrameRx<u32> = FrameRx::new(8).with_lookahead(1000);
        rx.expect_payload(3, 10);
        rx.hdr[0] = 0xee;
        lookahead_received(&mut rx, 10 + HEADER_BYTES as i32).unwrap();
        assert!(matches!(
            rx.buffered(1 << 20),
            Some(Err(RxError::BadHeader(FrameError::BadMagic(_))))
        ));
    }

    /// Frames of random sizes written in random pieces over a real socket
    /// pair, received on io_uring with look-ahead: every payload byte lands
    /// where its header said and every header decodes, with fewer receives
    /// than two per frame.
    #[test]
    fn lookahead_receives_on_io_uring_take_a_stream_whole() {
        use crate::ring::Completion;
        use crate::ring::{Uring, UringOptions};
        use std::io::Write;
        use std::os::fd::AsRawFd;
        use std::os::unix::net::UnixStream;

        let (mut tx, rxs) = UnixStream::pair().unwrap();
        const FRAMES: usize = 2000;
        let mut state = 0x1234_5678_u64;
        let mut next = || {
            state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
            crate::hash::mix64(state)
        };
        let mut stream = Vec::new();
        let mut want = Vec::new();
        let mut offset = 0u64;
        for i in 0..FRAMES {
            let len = 1 + (next() % 3000) as u32;
            stream.extend_from_slice(&Header::data(i as u32, offset, len).encode());
            for j in 0..len {
                stream.push((i as u32 * 7 + j) as u8);
            }
            want.push((offset, len));
            offset += len as u64;
        }
        let cuts: Vec<usize> = (0..400).map(|_| (next() % 9000) as usize + 1).collect();
        let writer = std::thread::spawn(move || {
            let mut at = 0;
            for c in cuts.iter().cycle() {
                if at == stream.len() {
                    break;
                }
                let end = (at + c).min(stream.len());
                tx.write_all(&stream[at..end]).unwrap();
                at = end;
            }
        });
        let mut ring = Uring::new(UringOptions {
            entries: 8,
            sqpoll_idle_ms: None,
        })
        .unwrap();
        let mut land = vec![0u8; offset as usize];
        let mut rx: FrameRx<u32> = FrameRx::new(0).with_lookahead(4096);
        let (mut frames, mut receives, mut landed) = (0usize, 0usize, 0u64);
        let mut out = [Completion::default(); 4];
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        let on = |rx: &mut FrameRx<u32>,
                  got: Received<u32>,
                  frames: &mut usize,
                  landed: &mut u64| match got {
            Received::Header(h) => {
                assert_eq!(h.a as usize, *frames, "frames in order");
                assert_eq!((h.c, h.body_len), want[*frames]);
                rx.expect_payload(h.a, h.body_len);
                *landed = 0;
            }
            Received::Payload { to, len } => {
                *landed += len as u64;
                if *landed == want[to as usize].1 as u64 {
                    *frames += 1;
                }
            }
            Received::Body(_) => panic!("no bodies here"),
        };
        let mut cursor = 0u64;
        while frames < FRAMES {
            assert!(std::time::Instant::now() < deadline, "{frames} frames");
            let base = land.as_mut_ptr();
            // SAFETY: `land` outlives the receive (reaped below before the
            // next post); a payload goes to its frame's own range.
            let posted = unsafe {
                rx.post(&mut ring, 1, rxs.as_raw_fd(), |i| {
                    base.add((want[i as usize].0 + landed) as usize)
                })
            };
            assert!(posted);
            receives += 1;
            ring.submit_wait_timeout(std::time::Duration::from_millis(100))
                .unwrap();
            let n = loop {
                let n = ring.drain(&mut out);
                if n > 0 {
                    break n;
                }
                assert!(std::time::Instant::now() < deadline, "no completion");
                ring.submit_wait_timeout(std::time::Duration::from_millis(100))
                    .unwrap();
            };
            assert_eq!(n, 1);
            rx.returned();
            let got = rx.received(out[0].result, 1 << 20).unwrap();
            on(&mut rx, got, &mut frames, &mut landed);
            if let Some(got) = rx.buffered(1 << 20) {
                on(&mut rx, got.unwrap(), &mut frames, &mut landed);
            }
            cursor += 1;
        }
        writer.join().unwrap();
        for (i, &(off, len)) in want.iter().enumerate() {
            for j in 0..len {
                assert_eq!(land[(off + j as u64) as usize], (i as u32 * 7 + j) as u8);
            }
        }
        assert!(
            receives < 2 * FRAMES,
            "{receives} receives for {FRAMES} frames ({cursor} completions)"
        );
    }

    #[test]
    #[should_panic(expected = "does not fit")]
    fn a_body_longer_than_the_buffer_is_a_caller_bug() {
        let mut rx: FrameRx<u32> = FrameRx::new(8);
        rx.expect_body(Header::error(1, Code::ReadFailed, 9));
    }
}
