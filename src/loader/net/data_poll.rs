//! The network thread's data paths that complete on their own (RDMA):
//! polling their completions once a tick and arming them before it
//! sleeps. Where the connections share CQs (`cqs.rs`, the default) a tick
//! polls those, each completion naming its connection, so its work follows
//! the completions; otherwise it polls every connection's own CQ.

use std::time::{Duration, Instant};

use super::{Event, Receive, State, Thread, UD_CHAN};
use crate::ring::IoBackend;

/// How long a dead connection's data path on the thread's SRQ is kept
/// before its QP is destroyed. Its QP went to the error state when the
/// connection was shut (it accepts no write), and what it still completes
/// (flushed sends, a receive in progress) comes within microseconds; a
/// driver may drop a destroyed QP's completions still in the CQ, and the
/// SRQ receives they used would never be posted again. So it goes once
/// the CQs were polled empty this long after it died.
const RETIRE_WAIT: Duration = Duration::from_millis(500);

/// Shared-CQ batches one tick takes at most (32 completions each); the
/// rest wait for the next tick, which comes at once (this one
/// progressed).
const SHARED_POLLS_PER_TICK: usize = 64;

impl<R: Receive, I: IoBackend> Thread<R, I> {
    /// Polls the data paths (RDMA: the shared CQs, or each connection's
    /// own) and acts on what completed; re-posts the receives used. True
    /// when anything completed.
    pub(super) fn poll_data(&mut self) -> bool {
        if R::FRAMED {
            return false;
        }
        let mut any = false;
        let started = self.ring.now();
        for _ in 0..SHARED_POLLS_PER_TICK {
            let n = match R::poll_shared(&self.common, &mut self.shared_wc) {
                None => return self.poll_each(),
                Some(Ok(0)) => {
                    // Drained: every completion made before `started` is out.
                    self.reap_retired(started);
                    break;
                }
                Some(Ok(n)) => n,
                Some(Err(e)) => {
                    // A CQ that cannot be polled fails every link on it:
                    // each is shut and its grants move elsewhere.
                    let why = format!("polling the shared CQs: {e}");
                    for i in 0..self.conns.len() {
                        self.kill(i, why.clone());
                    }
                    return true;
                }
            };
            any = true;
            R::route_shared(
                &self.common,
                &self.shared_wc[..n],
                &mut self.shared_nodes[..n],
            );
            for k in 0..n {
                let w = self.shared_wc[k];
                let i = self.shared_nodes[k] as usize;
                // None: a queue pair no link has now (gone since).
                let Some(c) = self.conns.get_mut(i) else {
                    continue;
                };
                if c.state != State::Live {
                    continue; // flushed requests of a connection being shut
                }
                // None: a queue pair's this connection had before.
                let Some(event) = c.data.as_mut().and_then(|d| d.take_shared(&w)) else {
                    continue;
                };
                if !self.refills.contains(&i) {
                    self.refills.push(i);
                }
                self.on_data_event(i, event);
            }
            for j in 0..self.refills.len() {
                self.refill(self.refills[j]);
            }
            self.refills.clear();
            // The shared receives used, once their messages were read.
            if let Err(e) = R::refill_shared(&self.common, &self.shared_wc[..n]) {
                let why = format!("re-posting the shared receives: {e}");
                for i in 0..self.conns.len() {
                    self.kill(i, why.clone());
                }
                return true;
            }
        }
        any
    }

    /// A dead connection's data path: destroyed now, or kept until its
    /// completions are out of the shared CQs ([`Receive::retire_when_dead`]).
    pub(super) fn retire(&mut self, d: R) {
        if R::retire_when_dead(&self.common) {
            let now = self.ring.now();
            self.retired.push((d, now));
        }
    }

    /// Destroys the kept data paths that died `RETIRE_WAIT` before
    /// `drained`, a time before which every completion was polled.
    fn reap_retired(&mut self, drained: Instant) {
        if !self.retired.is_empty() {
            self.retired
                .retain(|(_, died)| *died + RETIRE_WAIT > drained);
        }
    }

    /// [`Thread::poll_data`] where each connection has its own CQ: polls
    /// every one.
    fn poll_each(&mut self) -> bool {
        let mut any = false;
        for i in 0..self.conns.len() {
            while let Some(d) = self.conns[i].data.as_mut() {
                let n = match d.poll() {
                    Ok(n) => n,
                    Err(e) => {
                        self.kill(i, e.to_string());
                        break;
                    }
                };
                if n == 0 {
                    break;
                }
                any = true;
                for k in 0..n {
                    if self.conns[i].state != State::Live {
                        break; // flushed requests of a connection being shut
                    }
                    let event = self.conns[i].data.as_mut().expect("live").take(k);
                    self.on_data_event(i, event);
                }
                self.refill(i);
            }
        }
        any
    }

    /// Acts on a completion of connection `i`'s data path.
    fn on_data_event(&mut self, i: usize, event: Event) {
        match event {
            Event::Failed(why) => self.kill(i, why),
            Event::Flushed => {
                Self::post_send(&mut self.ring, &mut self.conns[i]);
                // Not posted (the queue was full): again next tick.
                self.mark_ready(i);
            }
            Event::Closed => {
                while let Some((window, entry)) =
                    self.conns[i].data.as_mut().and_then(|d| d.take_closed())
                {
                    self.on_window_closed(i, window, entry);
                }
            }
            Event::Received(what) => {
                self.conns[i].last_rx = self.ring.now();
                self.beats[i].heard_at(self.conns[i].last_rx);
                self.on_landed(i, what);
            }
        }
    }

    /// Re-posts the receives connection `i`'s completions used, if it is
    /// still live.
    fn refill(&mut self, i: usize) {
        if self.conns[i].state != State::Live {
            return;
        }
        if let Some(Err(e)) = self.conns[i].data.as_mut().map(|d| d.refill()) {
            self.kill(i, format!("re-posting receives: {e}"));
        }
    }

    /// Before sleeping with grants outstanding on a data path that
    /// completes on its own (RDMA): arms the CQs (the shared ones, or
    /// those of the connections with work) and puts a poll of the wake
    /// descriptor in the ring, so the first completion wakes the thread.
    /// True when anything was armed.
    pub(super) fn arm_data(&mut self) -> bool {
        let Some(fd) = R::wake_fd(&self.common) else {
            return false;
        };
        let working = |c: &super::Conn<R>| {
            c.state == State::Live
                && c.data
                    .as_ref()
                    .is_some_and(|d| c.outstanding > 0 || !d.idle())
        };
        let armed = if self.conns.iter().any(working) {
            match R::arm_shared(&self.common) {
                Ok(true) => true,
                Ok(false) => self.arm_each(working),
                Err(e) => {
                    let why = format!("arming the shared CQs: {e}");
                    for i in 0..self.conns.len() {
                        self.kill(i, why.clone());
                    }
                    false
                }
            }
        } else {
            false
        };
        if !armed {
            return false;
        }
        if !self.chan_inflight && self.ring.push_poll_in(UD_CHAN, fd) {
            self.chan_inflight = true;
        }
        true
    }

    /// Arms the own CQ of each connection with work.
    fn arm_each(&mut self, working: impl Fn(&super::Conn<R>) -> bool) -> bool {
        let mut armed = false;
        for i in 0..self.conns.len() {
            if !working(&self.conns[i]) {
                continue;
            }
            if let Err(e) = self.conns[i].data.as_ref().expect("working").arm() {
                self.kill(i, e.to_string());
                continue;
            }
            armed = true;
        }
        armed
    }
}
