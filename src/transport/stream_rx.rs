//! The node service's receive side of a consumer's stream: one buffer that
//! each receive fills with whatever has arrived (a `recvmsg` without
//! `MSG_WAITALL`), from which whole frames are taken in order.
//!
//! A consumer's frames are small and come one at a time at scale: a GRANT
//! of one entry (24 + 32 bytes) every few hundred milliseconds, a keepalive
//! every few seconds. [`FrameRx`](super::rx::FrameRx) takes a header with
//! one receive and its body with another, so every GRANT cost the node two
//! receives and two completions; a consumer sends each frame with one
//! `send`, so both parts are there together. Here one receive takes the
//! header, the body and any frames behind them; a frame cut by a segment
//! boundary waits in the buffer for the next receive. The bytes of a frame
//! left at the buffer's end are moved to its start before the next
//! receive, so the buffer (one header and the largest body accepted) always
//! has room for a whole frame; a buffer consumed to its end costs no move.
//!
//! As with `FrameRx`, the caller decides what a header means: a header is
//! handed out as soon as its 24 bytes are here (so a GRANT of more entries
//! than the caller allows is refused before its body is read), and its body
//! is taken only after [`StreamRx::expect_body`]. The buffers are boxed at
//! construction; posting and taking frames never allocate.

use std::convert::Infallible;
use std::os::fd::RawFd;

use super::proto::{FrameError, Header, HEADER_BYTES};
use super::rx::{Received, RecvMsg, RxError};
use crate::ring::IoBackend;

/// One connection's receive buffer and framing state.
pub(crate) struct StreamRx {
    buf: Box<[u8]>,
    /// Bytes before this offset were taken as frames.
    start: usize,
    /// Bytes before this offset have arrived.
    end: usize,
    /// The body of this header comes next (the caller accepted it).
    body: Option<Header>,
    /// Where the last body handed out lies in `buf` (offset, bytes).
    last_body: (usize, usize),
    inflight: bool,
    /// The `recvmsg` of a receive: one iovec, the buffer's free end.
    msg: Box<RecvMsg<1>>,
}

impl StreamRx {
    /// Room for one header and a body of at most `max_body_bytes`.
    pub(crate) fn new(max_body_bytes: usize) -> Self {
        StreamRx {
            buf: vec![0u8; HEADER_BYTES + max_body_bytes].into_boxed_slice(),
            start: 0,
            end: 0,
            body: None,
            last_body: (0, 0),
            inflight: false,
            msg: RecvMsg::new(),
        }
    }

    /// Whether a receive is posted and has not returned.
    pub(crate) fn inflight(&self) -> bool {
        self.inflight
    }

    /// Bytes that arrived and are not yet taken as frames.
    fn buffered_bytes(&self) -> usize {
        self.end - self.start
    }

    /// Posts a receive of whatever arrives, up to the buffer's free room,
    /// on `ring` (socket `fd`, its completion carrying `user_data`); first
    /// moves the bytes of a frame not yet whole to the buffer's start. A
    /// body handed out before ([`StreamRx::body`]) is no longer readable.
    /// False when the ring's submission queue is full (try again later).
    /// The caller posts only when none is in flight and
    /// [`StreamRx::next`] has nothing more.
    ///
    /// # Safety
    /// This `StreamRx` must not be dropped before the receive has returned
    /// ([`StreamRx::returned`]): the kernel writes its boxed buffer until
    /// then.
    pub(crate) unsafe fn post<R: IoBackend + ?Sized>(
        &mut self,
        ring: &mut R,
        user_data: u64,
        fd: RawFd,
    ) -> bool {
        debug_assert!(!self.inflight, "one receive at a time");
        self.compact();
        debug_assert!(self.end < self.buf.len(), "a whole frame always fits");
        let msg = self.msg.set([libc::iovec {
            // SAFETY: end < buf.len() (a frame not yet whole is shorter
            // than the buffer: `expect_body` checks the body's length).
            iov_base: unsafe { self.buf.as_mut_ptr().add(self.end) }.cast(),
            iov_len: self.buf.len() - self.end,
        }]);
        // SAFETY: the msghdr, its iovec and the buffer are boxed (they do
        // not move with `self`) and outlive the receive per this
        // function's contract; nothing reads past `end` until the
        // completion.
        if unsafe { ring.push_recvmsg(user_data, fd, msg) } {
            self.inflight = true;
        }
        self.inflight
    }

    /// Moves what is left of a frame to the buffer's start (nothing to
    /// move when every byte was taken, the common case).
    fn compact(&mut self) {
        if self.start == 0 {
            return;
        }
        self.buf.copy_within(self.start..self.end, 0);
        self.end -= self.start;
        self.start = 0;
        self.last_body = (0, 0);
    }

    /// The posted receive returned (whether or not its result is used).
    pub(crate) fn returned(&mut self) {
        self.inflight = false;
    }

    /// Takes the result `res` (bytes, or -errno) of the receive that
    /// returned; the frames it completed come from [`StreamRx::next`].
    pub(crate) fn received(&mut self, res: i32) -> Result<(), RxError> {
        if res < 0 {
            return Err(RxError::Failed(-res));
        }
        if res == 0 {
            let got = self.buffered_bytes() as u32;
            return Err(match self.body {
                None if got == 0 => RxError::Closed,
                None => RxError::Truncated {
                    got,
                    want: HEADER_BYTES as u32,
                },
                Some(h) => RxError::Truncated {
                    got,
                    want: h.body_len,
                },
            });
        }
        let got = res as usize;
        assert!(
            got <= self.buf.len() - self.end,
            "a receive of {got} bytes into {} free",
            self.buf.len() - self.end
        );
        self.end += got;
        Ok(())
    }

    /// The next whole part in the buffer: a header (decoded with
    /// `max_data` as the DATA limit; its body, if the caller accepts one,
    /// only after [`StreamRx::expect_body`]), or the body the caller
    /// accepted (read with [`StreamRx::body`]). None: the next part has
    /// not all arrived (post another receive).
    pub(crate) fn next(
        &mut self,
        max_data: u32,
    ) -> Option<Result<Received<Infallible>, FrameError>> {
        let have = self.buffered_bytes();
        if let Some(h) = self.body {
            let len = h.body_len as usize;
            if have < len {
                return None;
            }
            self.body = None;
            self.last_body = (self.start, len);
            self.start += len;
            return Some(Ok(Received::Body(h)));
        }
        if have < HEADER_BYTES {
            return None;
        }
        let mut hb = [0u8; HEADER_BYTES];
        hb.copy_from_slice(&self.buf[self.start..self.start + HEADER_BYTES]);
        self.start += HEADER_BYTES;
        Some(Header::decode(&hb, max_data).map(Received::Header))
    }

    /// The next part taken is the body of frame `h`.
    ///
    /// # Panics
    /// When the body is longer than the buffer was made for: the caller
    /// refuses such a header first.
    pub(crate) fn expect_body(&mut self, h: Header) {
        assert!(
            HEADER_BYTES + h.body_len as usize <= self.buf.len(),
            "a {:?} body of {} bytes does not fit the {}-byte buffer",
            h.kind,
            h.body_len,
            self.buf.len()
        );
        self.body = Some(h);
    }

    /// The body of frame `h`, just taken by [`StreamRx::next`] (readable
    /// until the next [`StreamRx::post`]).
    pub(crate) fn body(&self, h: &Header) -> &[u8] {
        let (at, len) = self.last_body;
        debug_assert_eq!(len, h.body_len as usize, "the body of another frame");
        &self.buf[at..at + len]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::proto::{Code, GrantEntry, Kind};

    /// A receive that brought `bytes` (as the kernel would write them at
    /// the buffer's free end after a post).
    fn feed(rx: &mut StreamRx, bytes: &[u8]) {
        rx.compact();
        let end = rx.end;
        rx.buf[end..end + bytes.len()].copy_from_slice(bytes);
        rx.received(bytes.len() as i32).expect("bytes");
    }

    fn grant_frame(first: u32, n: u32) -> Vec<u8> {
        let mut f = Header::grant(n).encode().to_vec();
        for i in 0..n {
            let mut b = [0u8; crate::transport::proto::GRANT_ENTRY_BYTES];
            GrantEntry {
                grant: first + i,
                len: 7,
                sample: (first + i) as u64,
                offset: 64 * i as u64,
                rkey: 0,
            }
            .encode_into(&mut b);
            f.extend_from_slice(&b);
        }
        f
    }

    /// Takes every whole frame, accepting every GRANT's body; the grant
    /// ids of each GRANT and the count of keepalives.
    fn take(rx: &mut StreamRx, out: &mut Vec<Vec<u32>>, keepalives: &mut u32) {
        while let Some(r) = rx.next(0) {
            match r.expect("frames of the protocol") {
                Received::Header(h) if h.kind == Kind::Grant => rx.expect_body(h),
                Received::Header(h) => {
                    assert_eq!(h.kind, Kind::Error);
                    *keepalives += 1;
                }
                Received::Body(h) => out.push(
                    (0..h.a as usize)
                        .map(|i| GrantEntry::decode(rx.body(&h), i).grant)
                        .collect(),
                ),
                Received::Payload { to, .. } => match to {},
            }
        }
    }

    #[test]
    fn a_frame_and_the_frames_behind_it_come_with_one_receive() {
        let mut rx = StreamRx::new(8 * 32);
        let mut stream = grant_frame(1, 1);
        stream.extend(Header::keepalive(true).encode());
        stream.extend(grant_frame(2, 3));
        let (mut got, mut ka) = (Vec::new(), 0);
        feed(&mut rx, &stream);
        take(&mut rx, &mut got, &mut ka);
        assert_eq!(got, vec![vec![1], vec![2, 3, 4]]);
        assert_eq!(ka, 1);
        // Every byte taken: the next receive starts at the buffer's start.
        assert_eq!(rx.buffered_bytes(), 0);
        rx.compact();
        assert_eq!((rx.start, rx.end), (0, 0));
    }

    #[test]
    fn frames_cut_anywhere_come_whole_and_in_order() {
        // Every way of cutting a stream of frames into two receives, and
        // a stream fed one byte at a time, give the same frames; the
        // buffer holds one header and a 4-entry body, no more.
        let mut stream = Vec::new();
        let mut want = Vec::new();
        for k in 0..6u32 {
            let n = 1 + k % 4;
            stream.extend(grant_frame(10 * k, n));
            want.push((10 * k..10 * k + n).collect::<Vec<_>>());
            if k % 2 == 0 {
                stream.extend(Header::keepalive(false).encode());
            }
        }
        let cap = 4 * 32;
        for cut in 0..=stream.len() {
            let mut rx = StreamRx::new(cap);
            let (mut got, mut ka) = (Vec::new(), 0);
            // At most what the buffer's free room takes per receive.
            for part in [&stream[..cut], &stream[cut..]] {
                let mut at = 0;
                while at < part.len() {
                    rx.compact();
                    let room = rx.buf.len() - rx.end;
                    let n = room.min(part.len() - at);
                    feed(&mut rx, &part[at..at + n]);
                    at += n;
                    take(&mut rx, &mut got, &mut ka);
                }
            }
            assert_eq!(got, want, "cut at {cut}");
            assert_eq!(ka, 3, "cut at {cut}");
        }
        let mut rx = StreamRx::new(cap);
        let (mut got, mut ka) = (Vec::new(), 0);
        for b in &stream {
            feed(&mut rx, std::slice::from_ref(b));
            take(&mut rx, &mut got, &mut ka);
        }
        assert_eq!(got, want);
        assert_eq!(ka, 3);
    }

    #[test]
    fn a_header_is_handed_out_before_its_body_arrives() {
        // The caller can refuse a GRANT by its header alone.
        let mut rx = StreamRx::new(32);
        feed(&mut rx, &Header::grant(100).encode());
        match rx.next(0) {
            Some(Ok(Received::Header(h))) => assert_eq!(h.a, 100),
            _ => panic!("a header"),
        }
        assert!(rx.next(0).is_none());
    }

    #[test]
    #[should_panic(expected = "does not fit")]
    fn a_body_longer_than_the_buffer_is_refused_by_the_caller_first() {
        let mut rx = StreamRx::new(32);
        rx.expect_body(Header::grant(2));
    }

    #[test]
    fn ends_of_the_stream_are_named() {
        let mut rx = StreamRx::new(64);
        assert!(matches!(rx.received(0), Err(RxError::Closed)));
        assert!(matches!(
            rx.received(-libc::ECONNRESET),
            Err(RxError::Failed(libc::ECONNRESET))
        ));
        // Part of a header, then the end: a truncation, not a close.
        feed(&mut rx, &[0u8; 10]);
        assert!(rx.next(0).is_none());
        assert!(matches!(
            rx.received(0),
            Err(RxError::Truncated { got: 10, want: 24 })
        ));
        // A body cut short.
        let mut rx = StreamRx::new(64);
        let f = grant_frame(1, 2);
        feed(&mut rx, &f[..HEADER_BYTES + 40]);
        match rx.next(0) {
            Some(Ok(Received::Header(h))) => rx.expect_body(h),
            _ => panic!("a header"),
        }
        assert!(rx.next(0).is_none());
        assert!(matches!(
            rx.received(0),
            Err(RxError::Truncated { got: 40, want: 64 })
        ));
    }

    #[test]
    fn a_bad_header_is_a_frame_error() {
        let mut rx = StreamRx::new(64);
        feed(&mut rx, &[0xeeu8; HEADER_BYTES]);
        assert!(matches!(rx.next(0), Some(Err(FrameError::BadMagic(_)))));
        let mut rx = StreamRx::new(64);
        feed(&mut rx, &Header::error(1, Code::ReadFailed, 3).encode());
        assert!(matches!(rx.next(0), Some(Ok(Received::Header(_)))));
    }
}
