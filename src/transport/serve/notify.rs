//! Sending the agent's node-down notices (`crate::transport::notices`) to
//! the consumers that asked for them (docs/PROTOCOL.md, "Node-down
//! notices"): at each sweep (every 125 ms) one counter says whether a
//! notice was posted since the last; if so, the poller lists its
//! connections that asked and have notices to get (a walk of its
//! connections, once per notice: a node's death, not a sample), then
//! sends each its notices, header-only frames like heartbeats. A
//! connection whose TCP queue is full, or whose RDMA control socket takes
//! nothing now, keeps its place in the list for the next sweep.

use std::sync::atomic::Ordering;

use super::conn::HEARTBEAT_WR;
use super::poller::ServePoller;
use crate::ring::IoBackend;
use crate::transport::proto;

impl<R: IoBackend> ServePoller<R> {
    /// Sends the notices posted since the last sweep (and those that could
    /// not go at the last one).
    pub(super) fn send_notices(&mut self) {
        let posted = self.c.notices.posted();
        if posted != self.notices_seen {
            let new = posted - self.notices_seen;
            self.notices_seen = posted;
            self.notice_due.clear();
            for k in 0..self.conns.live_len() {
                let ci = self.conns.live(k);
                let behind = self.conns.get(ci).is_some_and(|c| {
                    !c.closing && c.notices_from.is_some_and(|from| from < posted)
                });
                if behind {
                    // Within capacity: the live list holds at most the
                    // pool's limit, which `notice_due` was sized for.
                    debug_assert!(self.notice_due.len() < self.notice_due.capacity());
                    self.notice_due.push(ci);
                }
            }
            let last = self.c.notices.get(posted - 1);
            if let (Some((_, n)), false) = (last, self.notice_due.is_empty()) {
                log::info!(
                    "node service poller {}: telling {} consumers that node {} is down{}",
                    self.index,
                    self.notice_due.len(),
                    n.node,
                    if new > 1 {
                        format!(" ({} notices since the last sweep)", new)
                    } else {
                        String::new()
                    }
                );
            }
        }
        let mut k = 0;
        while k < self.notice_due.len() {
            if self.notify(self.notice_due[k], posted) {
                self.notice_due.swap_remove(k);
            } else {
                k += 1;
            }
        }
    }

    /// Sends connection `ci` its notices up to `posted`: true when it has
    /// them all (or is gone), false when its link takes no more now.
    fn notify(&mut self, ci: u32, posted: u64) -> bool {
        loop {
            let Some(c) = self.conns.get_mut(ci) else {
                return true;
            };
            let from = match c.notices_from {
                Some(from) if !c.closing && from < posted => from,
                _ => return true,
            };
            let Some((seq, n)) = self.c.notices.get(from) else {
                return true;
            };
            let h = proto::Header::node_down(n.node, n.silent_ms);
            if !c.link.is_rdma() {
                if !c.link.post_heartbeat(HEARTBEAT_WR, h) {
                    return false;
                }
                // Queued on its link: the tick's sends flush it.
                self.conns.mark(ci);
            } else {
                // Over RDMA the control socket carries only heartbeats and
                // notices after the handshake, written whole or not at all.
                match self.ring.send_now(c.fd, &h.encode()) {
                    Ok(k) if k == proto::HEADER_BYTES => {}
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return false,
                    Ok(_) | Err(_) => {
                        self.close(ci, None);
                        return true;
                    }
                }
            }
            let c = self.conns.get_mut(ci).expect("live");
            c.notices_from = Some(seq + 1);
            self.c
                .stats
                .node_notices_sent
                .fetch_add(1, Ordering::Relaxed);
            // One line per consumer would be thousands per death in a
            // large cluster: the count is in the metrics, one INFO line
            // per poller and notice in `send_notices`.
            log::debug!(
                "node service: told {} that node {} is down ({} ms silent here)",
                c.peer,
                n.node,
                n.silent_ms
            );
        }
    }
}
