//! The control connection of each node, on the network thread's io_uring:
//! GRANT frames (and keepalives) out, one send in flight; frames in through
//! the shared receive state machine ([`FrameRx`](crate::transport::rx::FrameRx)):
//! a header, then an ERROR message into the connection's buffer or, over
//! TCP, a DATA payload straight into the ring once its header was checked
//! against the outstanding grant (id, node, offset, length).

use super::lanes::entry_ptr;
use super::{Conn, Receive, State, Thread, UD_RECV, UD_SEND};
use crate::error::errno_name;
use crate::ring::IoBackend;
use crate::stall::Phase;
use crate::transport::proto::{self, Header, Kind};
use crate::transport::rx::{Received, RxError};

impl<R: Receive, I: IoBackend> Thread<R, I> {
    /// Puts connection `i` in the next `service_ready`'s list (once).
    pub(super) fn mark_ready(&mut self, i: usize) {
        if !self.queued[i] {
            self.queued[i] = true;
            self.ready.push(i);
        }
    }

    /// The connections marked ready since the last call: their GRANT
    /// frames (or keepalives) go out, then their receives are posted. A
    /// tick looks at these only, not at every node, so its cost grows with
    /// what completed and what was granted (the sweep in `tick` looks at
    /// a busy one every 100 ms, an idle one every `idle_all`, 1 s by
    /// default: `sweep.rs`). One that could not post (the submission queue
    /// was full) is marked again for the next tick.
    pub(super) fn service_ready(&mut self) {
        std::mem::swap(&mut self.ready, &mut self.ready_now);
        let now = self.ring.now();
        for k in 0..self.ready_now.len() {
            let i = self.ready_now[k];
            self.queued[i] = false;
            self.flush_one(i, now);
        }
        self.stall.phase(Phase::Recv);
        for k in 0..self.ready_now.len() {
            let i = self.ready_now[k];
            let posted = self.post_recv_one(i);
            let c = &self.conns[i];
            // (A frame waiting for its windows' binds goes when they are
            // bound: `Event::Flushed` marks it.)
            let unsent = !c.tx_inflight && !c.flushing() && c.flight_sent < c.flight.len();
            if c.state == State::Live && (!posted || unsent) {
                self.mark_ready(i);
            }
        }
        self.ready_now.clear();
    }

    /// Marks the live connections among a sweep's `looks` that owe their
    /// node a keepalive (or the first frame, which asks for heartbeats).
    pub(super) fn keepalives_due(&mut self, now: std::time::Instant, looks: &[usize]) {
        for &i in looks {
            let c = &self.conns[i];
            if c.state == State::Live
                && (!self.beats[i].asked
                    || now.saturating_duration_since(c.last_tx) >= self.beats[i].keepalive)
            {
                self.mark_ready(i);
            }
        }
    }

    /// Sends connection `i`'s GRANT frame, or a keepalive when it has
    /// none and one is due.
    fn flush_one(&mut self, i: usize, now: std::time::Instant) {
        #[cfg(test)]
        {
            self.conn_visits += 1;
        }
        let c = &mut self.conns[i];
        if c.state != State::Live || c.tx_inflight || c.flushing() {
            return;
        }
        if c.flight_sent < c.flight.len() {
            // Its frame did not go (the submission queue was full):
            // send it before anything else, never overwrite it.
            Self::post_send(&mut self.ring, c);
            return;
        }
        // The first frame asks for heartbeats (an older node ignores
        // it as a keepalive); so do the later keepalives, harmlessly. A
        // probe after a node-down notice about this node goes before any
        // grant (`notice.rs`).
        let probe = self.beats[i].probe_due;
        let ask = !self.beats[i].asked || probe;
        if c.fill_entries == 0 || ask {
            if now.saturating_duration_since(c.last_tx) >= self.beats[i].keepalive || ask {
                self.beats[i].asked = true;
                self.beats[i].probe_due = false;
                let h = super::notice::keepalive(probe).encode();
                c.flight.clear();
                c.flight.extend_from_slice(&h);
                c.flight_sent = 0;
                c.last_tx = now;
                Self::post_send(&mut self.ring, c);
            }
            // Grants filled meanwhile go once the keepalive's send is
            // back (its completion marks the connection ready).
            return;
        }
        c.last_tx = now;
        let h = Header::grant(c.fill_entries).encode();
        c.fill[..proto::HEADER_BYTES].copy_from_slice(&h);
        std::mem::swap(&mut c.fill, &mut c.flight);
        c.fill.clear();
        c.fill.resize(proto::HEADER_BYTES, 0);
        c.fill_entries = 0;
        c.flight_sent = 0;
        // RDMA windows: the frame goes once they are bound (their
        // chain's completion), so no write can arrive before its window.
        match c.data.as_mut().map(|d| d.flush()) {
            Some(Ok(true)) => return,
            Some(Err(e)) => {
                self.kill(i, e.to_string());
                return;
            }
            _ => {}
        }
        Self::post_send(&mut self.ring, c);
    }

    pub(super) fn post_send(ring: &mut I, c: &mut Conn<R>) {
        let fd = c.fd();
        let rest = &c.flight[c.flight_sent..];
        // SAFETY: `flight` is not touched until this send completes.
        if unsafe {
            ring.push_send(
                UD_SEND | c.node as u64,
                fd,
                rest.as_ptr(),
                rest.len() as u32,
                false,
            )
        } {
            c.tx_inflight = true;
        }
    }

    /// Posts connection `i`'s receive unless one is in flight: false
    /// when it is live and could not be posted (the submission queue was
    /// full).
    fn post_recv_one(&mut self, i: usize) -> bool {
        let c = &mut self.conns[i];
        if c.state != State::Live || c.rx.inflight() {
            return true;
        }
        let fd = c.fd();
        let (l, lanes, active, shift) = (&self.l, &self.lanes, self.active, self.lane_shift);
        // SAFETY: the connection (and its boxed header/message buffers)
        // stays in `conns` until run() returns, which waits for this
        // receive (busy()); a payload goes to the granted, unpublished
        // part of a sample's slot, checked against the grant before this
        // receive is posted.
        unsafe {
            c.rx.post(&mut self.ring, UD_RECV | i as u64, fd, |entry| {
                entry_ptr(l, lanes, active, shift, entry)
            })
        }
    }

    pub(super) fn on_recv(&mut self, i: usize, res: i32) {
        let max_data = self.conns[i].max_data;
        let got = self.conns[i].rx.received(res, max_data);
        self.on_received(i, got);
        // A look-ahead receive may have brought the next frame's header
        // after its payload: act on it before the next receive is posted.
        if self.conns[i].state == State::Live {
            if let Some(got) = self.conns[i].rx.buffered(max_data) {
                self.on_received(i, got);
            }
        }
    }

    fn on_received(&mut self, i: usize, got: Result<Received<usize>, RxError>) {
        let now = self.ring.now();
        let c = &mut self.conns[i];
        let got = match got {
            Ok(got) => got,
            Err(RxError::BadHeader(e)) => {
                c.last_rx = now;
                self.beats[i].heard_at(now);
                return self.violation(i, e.to_string());
            }
            Err(e) => {
                let why = match e {
                    RxError::Failed(n) => format!(
                        "receive failed: {} ({})",
                        errno_name(n),
                        std::io::Error::from_raw_os_error(n)
                    ),
                    RxError::Closed => "closed the connection".to_string(),
                    RxError::Truncated { got, want } => {
                        format!("connection ended in the middle of a frame ({got} of {want} bytes)")
                    }
                    RxError::BadHeader(_) => unreachable!("handled above"),
                };
                self.kill(i, why);
                return;
            }
        };
        c.last_rx = now;
        self.beats[i].heard_at(now);
        match got {
            Received::Header(h) => {
                if !R::FRAMED
                    && (h.kind == Kind::Data || (h.kind == Kind::Error && h.a != proto::CONNECTION))
                {
                    // Over RDMA data and grant errors come on the QP, in
                    // order with the writes; on TCP they could overtake them.
                    return self.violation(
                        i,
                        format!(
                            "{:?} frame on the control connection of an RDMA link",
                            h.kind
                        ),
                    );
                }
                if let Some((node, silent_ms)) = h.node_down_notice() {
                    // Not about this connection: the node says another
                    // one is dead (`notice.rs`).
                    self.on_node_down(i, node, silent_ms);
                    return;
                }
                if h.is_keepalive() {
                    // A heartbeat: the node is alive (last_rx, above) and
                    // sends them, so its silence now counts.
                    self.beats[i].heartbeat(h.heartbeat_idle_timeout());
                    if self.beats[i].keepalive < self.sweep.short_keepalive() {
                        // A short idle timeout: its keepalives are looked
                        // at every 100 ms.
                        self.sweep.mark_busy(i);
                    }
                    return;
                }
                match h.kind {
                    Kind::Data => self.on_data_header(i, h),
                    Kind::Error if h.body_len > 0 => self.conns[i].rx.expect_body(h),
                    Kind::Error => self.on_error(i, h, ""),
                    k => self.violation(i, format!("unexpected {k:?} frame")),
                }
            }
            Received::Payload { to, len } => {
                let idx = self.activate_entry(to);
                let s = &mut self.l.table[idx];
                s.received += len;
                if s.received == s.len {
                    self.sample_done(i, idx);
                }
            }
            Received::Body(h) => {
                let msg = String::from_utf8_lossy(c.rx.body(&h)).into_owned();
                self.on_error(i, h, &msg);
            }
        }
    }

    /// Checks a DATA header against the outstanding grant before any of its
    /// payload is read.
    pub(super) fn on_data_header(&mut self, i: usize, h: Header) {
        let lane_ok = self.activate(self.lane_of(h.a));
        let idx = h.a as usize & self.l.mask;
        let s = self.l.table[idx];
        let node = self.conns[i].node;
        if !lane_ok || self.grant_id(s.g) != h.a || !s.outstanding_with(node) {
            return self.violation(
                i,
                format!(
                    "DATA for grant {} that is not outstanding with this node",
                    h.a
                ),
            );
        }
        let expect = s.phys + s.received as u64;
        if h.c != expect {
            return self.violation(
                i,
                format!(
                    "DATA for grant {} at ring offset {}, expected {} (grant covers {}+{})",
                    h.a, h.c, expect, s.phys, s.len
                ),
            );
        }
        if h.body_len > s.len - s.received {
            return self.violation(
                i,
                format!(
                    "DATA for grant {} of {} bytes overruns the grant ({} of {} bytes left)",
                    h.a,
                    h.body_len,
                    s.len - s.received,
                    s.len
                ),
            );
        }
        if let Some((read_us, node_us)) = proto::parse_data_times(h.b) {
            // At most 67 s each (DATA_TIME_MAX_US): they fit.
            let t = &mut self.l.table[idx];
            t.node_read_us = t.node_read_us.max(read_us as u32);
            t.node_us = node_us as u32;
            t.timed = true;
        }
        let entry = self.entry(idx);
        self.conns[i].rx.expect_payload(entry, h.body_len);
    }
}
