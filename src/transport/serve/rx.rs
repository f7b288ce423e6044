//! Receiving a consumer's frames (GRANTs and keepalives): whatever arrived
//! with one receive of the poller's io_uring, taken frame by frame, each
//! GRANT checked against the catalog and the consumer's ring before any of
//! its grants is queued.
//!
//! The framing itself (frames cut across receives, bad headers) is
//! `transport::stream_rx::StreamRx`.

use std::convert::Infallible;
use std::sync::atomic::Ordering;

use super::conn::{ud, Work, UD_RECV};
use super::poller::ServePoller;
use crate::error::errno_name;
use crate::ring::IoBackend;
use crate::transport::proto::{self, Code, GrantEntry, Kind};
use crate::transport::rx::{Received, RxError};

impl<R: IoBackend> ServePoller<R> {
    pub(super) fn post_recvs(&mut self) {
        for k in 0..self.conns.work_len() {
            let ci = self.conns.work(k);
            let Some(c) = self.conns.get_mut(ci) else {
                continue;
            };
            if c.closing || c.rx.inflight() {
                continue;
            }
            let fd = c.fd;
            // SAFETY: the buffer is boxed in the connection's StreamRx,
            // which is kept until its last op completes (ops counter).
            if unsafe { c.rx.post(&mut self.ring, ud(UD_RECV, ci, 0), fd) } {
                c.ops += 1;
            }
        }
    }

    pub(super) fn on_recv(&mut self, ci: u32, res: i32) {
        let c = self.conns.get_mut(ci).expect("live");
        if c.closing {
            return;
        }
        if let Err(e) = c.rx.received(res) {
            let why = match e {
                RxError::Failed(n) => format!("receive failed: {}", errno_name(n)),
                RxError::Truncated { got, want } => {
                    format!("consumer closed the connection inside a frame ({got} of {want} bytes)")
                }
                _ => "consumer closed the connection".to_string(),
            };
            log::info!("{}: {why}", c.peer);
            self.close(ci, None);
            return;
        }
        // Every whole frame the receive completed, in order (one receive
        // takes a GRANT's header and body, and any frames behind them).
        let now = self.ring.now();
        while let Some(r) = self.conns.get_mut(ci).expect("live").rx.next(0) {
            match r {
                Ok(got) => {
                    // A frame's part, not any byte, keeps the connection
                    // from idling out (a peer that trickles a header a
                    // byte at a time is still idle).
                    self.conns.get_mut(ci).expect("live").last_rx = now;
                    if !self.on_frame(ci, got) {
                        return;
                    }
                }
                Err(e) => {
                    self.close(ci, Some((Code::Violation, e.to_string())));
                    return;
                }
            }
        }
    }

    /// Acts on one part of a frame from connection `ci`; false when it
    /// closed the connection.
    fn on_frame(&mut self, ci: u32, got: Received<Infallible>) -> bool {
        let c = self.conns.get_mut(ci).expect("live");
        match got {
            Received::Header(h) if h.kind == Kind::Grant => {
                // Refused at the header, before its body is read: the
                // buffer holds at most `max_grants` entries.
                let n = h.a as usize;
                if c.grants.len() + n > self.c.cfg.max_grants as usize {
                    let m = format!(
                        "{} grants outstanding, more than the {} allowed",
                        c.grants.len() + n,
                        self.c.cfg.max_grants
                    );
                    self.close(ci, Some((Code::TooManyGrants, m)));
                    return false;
                }
                c.rx.expect_body(h)
            }
            // An empty ERROR is a keepalive; one with `ASK_HEARTBEATS`
            // asks for heartbeats (the first goes at the next tick), with
            // `ASK_NODE_NOTICES` for the node-down notices posted from now
            // on, and with `PROBE` for a heartbeat at the next tick, idle
            // or not (the connection, its receive done, is in the work
            // list the next sweep walks).
            Received::Header(h)
                if h.kind == Kind::Error
                    && h.body_len == 0
                    && h.a == proto::CONNECTION
                    && h.b == Code::Unknown as u32 =>
            {
                if h.c & proto::ASK_HEARTBEATS != 0 {
                    if !c.heartbeats {
                        c.heartbeats = true;
                        c.slow_idle = h.c & proto::SLOW_IDLE_HEARTBEATS != 0;
                        self.next_beat = self.ring.now();
                    }
                    if h.c & proto::ASK_NODE_NOTICES != 0 && c.notices_from.is_none() {
                        c.notices_from = Some(self.c.notices.posted());
                    }
                    if h.c & proto::PROBE != 0 {
                        self.c.stats.probes.fetch_add(1, Ordering::Relaxed);
                        c.last_beat = None;
                        self.next_beat = self.ring.now();
                    }
                }
            }
            // Any other ERROR (another code, a grant id, a body) is not
            // one a consumer sends (docs/PROTOCOL.md, "Connection").
            Received::Header(h) if h.kind == Kind::Error => {
                let m = format!(
                    "unexpected ERROR frame from a consumer (code {}, grant id {:#x}, {} body bytes): \
                     a consumer sends only keepalives (code 0, grant id 0xFFFFFFFF, no body)",
                    h.b, h.a, h.body_len
                );
                self.close(ci, Some((Code::Violation, m)));
                return false;
            }
            Received::Header(h) => {
                let m = format!("unexpected {:?} frame from a consumer", h.kind);
                self.close(ci, Some((Code::Violation, m)));
                return false;
            }
            Received::Payload { to, .. } => match to {},
            Received::Body(h) => {
                let n = h.a as usize;
                c.metrics.grants.fetch_add(n as u64, Ordering::Relaxed);
                log::debug!(
                    "{}: GRANT with {n} entries ({} queued)",
                    c.peer,
                    c.grants.len()
                );
                // Checked at its header; the queue has not changed since
                // (only this connection's receives add to it).
                debug_assert!(c.grants.len() + n <= self.c.cfg.max_grants as usize);
                for i in 0..n {
                    let e = GrantEntry::decode(c.rx.body(&h), i);
                    let bad = if e.grant == proto::CONNECTION {
                        // Reserved: an ERROR with this id is about the
                        // connection, so an answer for such a grant would be
                        // read as the end of the connection.
                        Some(format!(
                            "grant id {:#x} is reserved for the connection",
                            e.grant
                        ))
                    } else if e.sample >= self.c.space.len() {
                        Some(format!(
                            "grant {} names sample {}, past the catalog's {}",
                            e.grant,
                            e.sample,
                            self.c.space.len()
                        ))
                    } else if self.c.space.sample_len(e.sample) != e.len {
                        Some(format!(
                            "grant {} says sample {} has {} bytes; the catalog says {}",
                            e.grant,
                            e.sample,
                            e.len,
                            self.c.space.sample_len(e.sample)
                        ))
                    } else if e.offset.saturating_add(e.len as u64) > c.hello.ring_len {
                        Some(format!(
                            "grant {} range {}+{} is outside the {}-byte ring",
                            e.grant, e.offset, e.len, c.hello.ring_len
                        ))
                    } else {
                        None
                    };
                    if let Some(m) = bad {
                        self.close(ci, Some((Code::Violation, m)));
                        return false;
                    }
                    if e.len > 0 {
                        // Read now (`last_rx`): the start of the grant's
                        // time at this node, which its DATA frames report.
                        let at = c.last_rx;
                        let serial = c.grants_read;
                        c.grants_read = c.grants_read.wrapping_add(1);
                        c.grants.push_back(Work {
                            e,
                            next: 0,
                            at,
                            serial,
                        });
                    }
                }
            }
        }
        true
    }
}
