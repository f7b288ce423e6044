//! Receiving a consumer's frames (GRANTs and keepalives): a header, then a
//! body, each one receive of the poller's io_uring, checked against the
//! catalog and the consumer's ring before any grant is queued.
//!
//! Moved here unchanged from the poller so that the consumer side's receive
//! state machine and this one can become one (issue 17).

use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering;

use super::poller::{ud, ServePoller, Work, UD_RECV};
use crate::error::errno_name;
use crate::transport::proto::{self, Code, GrantEntry, Header, Kind};

#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Rx {
    Header,
    Body(Header),
}

impl ServePoller {
    pub(super) fn post_recvs(&mut self) {
        for k in 0..self.live.len() {
            let ci = self.live[k] as usize;
            let Some(c) = self.conns.get_mut(ci) else {
                continue;
            };
            if c.closing || c.rx_inflight {
                continue;
            }
            let (buf, len) = match c.rx {
                Rx::Header => (c.hdr.as_mut_ptr(), proto::HEADER_BYTES as u32),
                Rx::Body(h) => (c.body.as_mut_ptr(), h.body_len),
            };
            let fd = c.sock.as_raw_fd();
            // SAFETY: hdr/body are boxed in the connection, which is kept
            // until its last op completes (ops counter).
            if unsafe { self.ring.push_recv(ud(UD_RECV, ci as u32, 0), fd, buf, len) } {
                c.rx_inflight = true;
                c.ops += 1;
            }
        }
    }

    pub(super) fn on_recv(&mut self, ci: u32, res: i32) {
        let c = self.conns.get_mut(ci as usize).expect("live");
        if c.closing {
            return;
        }
        let want = match c.rx {
            Rx::Header => proto::HEADER_BYTES as i32,
            Rx::Body(h) => h.body_len as i32,
        };
        if res <= 0 || res < want {
            let why = if res == 0 || (res > 0 && res < want) {
                "consumer closed the connection".to_string()
            } else {
                format!("receive failed: {}", errno_name(-res))
            };
            log::info!("{}: {why}", c.peer);
            self.close(ci, None);
            return;
        }
        c.last_rx = std::time::Instant::now();
        match c.rx {
            Rx::Header => match Header::decode(&c.hdr, 0) {
                Ok(h) if h.kind == Kind::Grant => c.rx = Rx::Body(h),
                Ok(h) if h.kind == Kind::Error && h.body_len == 0 => {}
                Ok(h) => {
                    let m = format!("unexpected {:?} frame from a consumer", h.kind);
                    self.close(ci, Some((Code::Violation, m)));
                }
                Err(e) => self.close(ci, Some((Code::Violation, e.to_string()))),
            },
            Rx::Body(h) => {
                c.rx = Rx::Header;
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
                let cat = self.c.space.catalog();
                for i in 0..n {
                    let e = GrantEntry::decode(&c.body, i);
                    let bad = if e.sample >= cat.len() {
                        Some(format!(
                            "grant {} names sample {}, past the catalog's {}",
                            e.grant,
                            e.sample,
                            cat.len()
                        ))
                    } else if cat.sample(e.sample).len != e.len {
                        Some(format!(
                            "grant {} says sample {} has {} bytes; the catalog says {}",
                            e.grant,
                            e.sample,
                            e.len,
                            cat.sample(e.sample).len
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
                        c.grants.push_back(Work { e, next: 0 });
                    }
                }
            }
        }
    }
}
