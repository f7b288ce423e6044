//! The receive side of one framed stream socket, shared by both ends of the
//! push protocol: a 24-byte header into a fixed buffer, then its body into
//! the connection's body buffer (GRANT entries, an ERROR message) or, once
//! the caller has checked a DATA header against its grant, straight into the
//! landing ring. One receive (`MSG_WAITALL`) is in flight at a time, on the
//! caller's io_uring.
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
    /// `len` payload bytes landed at `to`.
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

/// One connection's receive state machine and buffers.
pub(crate) struct FrameRx<T> {
    hdr: Box<[u8; HEADER_BYTES]>,
    body: Box<[u8]>,
    state: RxState<T>,
    inflight: bool,
}

impl<T: Copy> FrameRx<T> {
    /// Waiting for a header, with a body buffer of `body_bytes` (the
    /// largest body of the kinds this end accepts into it).
    pub(crate) fn new(body_bytes: usize) -> Self {
        FrameRx {
            hdr: Box::new([0; HEADER_BYTES]),
            body: vec![0u8; body_bytes].into_boxed_slice(),
            state: RxState::Header,
            inflight: false,
        }
    }

    /// Whether a receive is posted and has not returned.
    pub(crate) fn inflight(&self) -> bool {
        self.inflight
    }

    /// Bytes the current state's receive asks for.
    pub(crate) fn want(&self) -> u32 {
        match self.state {
            RxState::Header => HEADER_BYTES as u32,
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
        let (buf, len) = match self.state {
            RxState::Header => (self.hdr.as_mut_ptr(), HEADER_BYTES as u32),
            RxState::Body(h) => (self.body.as_mut_ptr(), h.body_len),
            RxState::Payload { to, len } => (payload(to), len),
        };
        // SAFETY: the header and body buffers are boxed (they do not move
        // with `self`) and outlive the receive per this function's
        // contract, which also covers the payload target; a body is never
        // longer than the buffer (`expect_body`).
        if unsafe { ring.push_recv(user_data, fd, buf, len) } {
            self.inflight = true;
        }
        self.inflight
    }

    /// The posted receive returned (whether or not its result is used).
    pub(crate) fn returned(&mut self) {
        self.inflight = false;
    }

    /// Interprets the result `res` (bytes, or -errno) of the receive that
    /// returned; a header is decoded with `max_data` as the DATA limit. A
    /// body or payload puts the machine back to waiting for a header.
    pub(crate) fn received(&mut self, res: i32, max_data: u32) -> Result<Received<T>, RxError> {
        let want = self.want();
        if res < 0 {
            return Err(RxError::Failed(-res));
        }
        if (res as u32) < want {
            return Err(if res == 0 && matches!(self.state, RxState::Header) {
                RxError::Closed
            } else {
                RxError::Truncated {
                    got: res as u32,
                    want,
                }
            });
        }
        match self.state {
            RxState::Header => Header::decode(&self.hdr, max_data)
                .map(Received::Header)
                .map_err(RxError::BadHeader),
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

    #[test]
    #[should_panic(expected = "does not fit")]
    fn a_body_longer_than_the_buffer_is_a_caller_bug() {
        let mut rx: FrameRx<u32> = FrameRx::new(8);
        rx.expect_body(Header::error(1, Code::ReadFailed, 9));
    }
}
