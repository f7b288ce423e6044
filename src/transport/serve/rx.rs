//! Receiving a consumer's frames (GRANTs and keepalives): a header, then a
//! body, each one receive of the poller's io_uring, checked against the
//! catalog and the consumer's ring before any grant is queued.
//!
//! The framing itself (which receive comes next, short reads, bad headers)
//! is `transport::rx::FrameRx`, shared with the consumer's network thread.

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
            // SAFETY: the header and body buffers are boxed in the
            // connection's FrameRx, which is kept until its last op completes
            // (ops counter); a node never receives a payload into a ring.
            if unsafe {
                c.rx.post(
                    &mut self.ring,
                    ud(UD_RECV, ci, 0),
                    fd,
                    |n: Infallible| match n {},
                )
            } {
                c.ops += 1;
            }
        }
    }

    pub(super) fn on_recv(&mut self, ci: u32, res: i32) {
        let c = self.conns.get_mut(ci).expect("live");
        if c.closing {
            return;
        }
        let got = match c.rx.received(res, 0) {
            Ok(got) => got,
            Err(RxError::BadHeader(e)) => {
                self.close(ci, Some((Code::Violation, e.to_string())));
                return;
            }
            Err(e) => {
                let why = match e {
                    RxError::Failed(n) => format!("receive failed: {}", errno_name(n)),
                    _ => "consumer closed the connection".to_string(),
                };
                log::info!("{}: {why}", c.peer);
                self.close(ci, None);
                return;
            }
        };
        c.last_rx = self.ring.now();
        match got {
            Received::Header(h) if h.kind == Kind::Grant => c.rx.expect_body(h),
            // An empty ERROR is a keepalive; one with `ASK_HEARTBEATS`
            // asks for heartbeats (the first goes at the next tick).
            Received::Header(h) if h.kind == Kind::Error && h.body_len == 0 => {
                if h.c & proto::ASK_HEARTBEATS != 0 && !c.heartbeats {
                    c.heartbeats = true;
                    c.slow_idle = h.c & proto::SLOW_IDLE_HEARTBEATS != 0;
                    self.next_beat = self.ring.now();
                }
            }
            Received::Header(h) => {
                let m = format!("unexpected {:?} frame from a consumer", h.kind);
                self.close(ci, Some((Code::Violation, m)));
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
                if c.grants.len() + n > self.c.cfg.max_grants as usize {
                    let m = format!(
                        "{} grants outstanding, more than the {} allowed",
                        c.grants.len() + n,
                        self.c.cfg.max_grants
                    );
                    self.close(ci, Some((Code::TooManyGrants, m)));
                    return;
                }
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
                        return;
                    }
                    if e.len > 0 {
                        // Read now (`last_rx`): the start of the grant's
                        // time at this node, which its DATA frames report.
                        let at = c.last_rx;
                        c.grants.push_back(Work { e, next: 0, at });
                    }
                }
            }
        }
    }
}
