//! Reconnecting to a node whose connection was shut (heartbeat silence, a
//! failure, a reset) or that could not be reached at start: a node paused
//! for a few seconds (cgroup throttling, a VM pause, a debugger) or
//! restarted is not lost to the consumer for the rest of the run.
//!
//! Each dead node is tried again after a back-off with jitter
//! ([`redial_backoff`]: 1 s doubling to 30 s), by a thread of its own that
//! runs the start's handshake ([`connect_retrying`], under its own
//! `node_timeout` deadline) so the network thread never blocks. The network
//! thread takes the result at its next pass: a WELCOME with the same
//! placement makes the connection live again and it takes new grants. The
//! grants of the old connection were failed over when it went dead (once
//! its receive was back, so nothing more lands from it): each sample is in
//! one place at a time and is delivered once.
//!
//! A sample whose holders are all gone, and that the source cannot serve
//! either (one copy, no source), waits up to [`REDIAL_WAIT`] for a holder
//! that is being dialled again (tried at least every [`REDIAL_WAITED`]
//! meanwhile), and is granted to it once it is back: a node service
//! restarted mid-epoch costs a pause, not the run. A node that comes back
//! as another node (its space placed otherwise, another index) is not used
//! again ([`Error::NodeChanged`]), nor is one that refuses the
//! consumer at HELLO (another token or dataset: [`Error::Refused`]); the
//! samples only it held fail with that error.
//!
//! Over RDMA the reconnect sets up a new queue pair beside the new control
//! connection (the old one was destroyed when the node went dead).

use std::sync::mpsc;
use std::time::{Duration, Instant};

use super::connect::welcome_placement;
use super::handshake::handshake_all;
use super::retry::{jitter, ConnectError};
use super::{Beats, Conn, NetSetup, Receive, State, Thread, USER_TIMEOUT_MAX, USER_TIMEOUT_MIN};
use crate::ring::IoBackend;
use crate::transport::proto::Welcome;

/// The first wait before a dead node is tried again; each next one's bound
/// doubles up to [`REDIAL_MAX`].
pub(crate) const REDIAL_FIRST: Duration = Duration::from_secs(1);
/// The longest wait between two tries of a dead node.
pub(crate) const REDIAL_MAX: Duration = Duration::from_secs(30);
/// How long a sample that only gone nodes hold (and the source cannot
/// serve) waits for one of them to come back before it fails.
pub(crate) const REDIAL_WAIT: Duration = Duration::from_secs(10);
/// While a sample waits for a gone node, that node is tried again within
/// this (uniform in its second half), whatever its back-off.
pub(crate) const REDIAL_WAITED: Duration = Duration::from_secs(1);

/// The wait before try `attempt + 1` (from 0) of a dead node: uniform in
/// `[bound / 2, bound]`, `bound = min(REDIAL_FIRST x 2^attempt,
/// REDIAL_MAX)`, so consumers that lost a node together spread out.
pub(crate) fn redial_backoff(attempt: u32, jitter: u64) -> Duration {
    let bound = REDIAL_FIRST
        .saturating_mul(1u32 << attempt.min(16))
        .min(REDIAL_MAX);
    let half = bound / 2;
    let span = half.as_micros() as u64 + 1;
    half + Duration::from_micros(jitter % span)
}

/// One node's reconnect state (kept beside `conns`).
#[derive(Clone, Default)]
pub(super) struct Redial {
    /// When the connection went dead (unset for a node unreachable at
    /// start): samples wait for it until [`REDIAL_WAIT`] after this.
    dead_since: Option<Instant>,
    /// It came back changed or refused us: not tried again, and the
    /// samples only it holds fail with this.
    pub(super) refused: Option<crate::error::Error>,
    /// Tries since the connection was last live.
    attempt: u32,
    /// When to try next; `None`: not to be tried (live, local, or given up).
    next: Option<Instant>,
    /// A try is running on its thread.
    inflight: bool,
    /// When the node was last reconnected.
    back_since: Option<Instant>,
}

/// What a reconnect thread sends back: the connection index and its result.
pub(super) type Redialed<R> = (usize, Result<(super::Conn<R>, Welcome), ConnectError>);

pub(super) struct Redials<R: Receive> {
    pub(super) state: Vec<Redial>,
    /// Dead nodes are reconnected (off in the simulator, which has no TCP).
    enabled: bool,
    tx: mpsc::Sender<Redialed<R>>,
    rx: mpsc::Receiver<Redialed<R>>,
}

impl Redial {
    /// The first try of a node unreachable at start.
    pub(super) fn schedule_first(&mut self, node: u32, now: Instant) {
        self.next = Some(now + redial_backoff(0, jitter(node, 0)));
        self.attempt = 1;
    }
}

impl<R: Receive> Redials<R> {
    pub(super) fn new(n: usize, enabled: bool) -> Self {
        let (tx, rx) = mpsc::channel();
        Redials {
            state: vec![Redial::default(); n],
            enabled,
            tx,
            rx,
        }
    }
}

impl<R: Receive, I: IoBackend> Thread<R, I> {
    /// Schedules the next try of dead connection `i` (not the local node's
    /// place, and only where the data path can be set up again).
    pub(super) fn schedule_redial(&mut self, i: usize) {
        if Some(self.conns[i].node) == self.setup.local_node
            || !self.redials.enabled
            || R::redial_common(&self.common).is_none()
        {
            return;
        }
        let now = self.ring.now();
        let r = &mut self.redials.state[i];
        if r.refused.is_some() {
            r.next = None;
            return;
        }
        // The back-off goes on growing across reconnects, so a node that
        // fails again soon after each (alive but not delivering) costs
        // the consumer a stall at most every REDIAL_MAX; one that served
        // for that long starts again from the shortest wait.
        if r.back_since
            .is_some_and(|t| now.saturating_duration_since(t) > REDIAL_MAX)
        {
            r.attempt = 0;
        }
        let wait = redial_backoff(r.attempt, jitter(self.conns[i].node, r.attempt));
        r.attempt = r.attempt.saturating_add(1);
        r.next = Some(now + wait);
    }

    /// Starts the redials due among a sweep's `looks` (a dead connection
    /// is in the sweep's busy list, looked at every 100 ms), then takes the
    /// finished ones.
    pub(super) fn redial(&mut self, looks: &[usize]) {
        let now = self.ring.now();
        for &i in looks {
            let r = &self.redials.state[i];
            if r.inflight || r.next.is_none_or(|t| t > now) || self.conns[i].state != State::Dead {
                continue;
            }
            let Some(common) = R::redial_common(&self.common) else {
                continue;
            };
            let (setup, tx) = (self.setup.clone(), self.redials.tx.clone());
            let (node, addr) = (self.conns[i].node, self.conns[i].addr.clone());
            let spawned = std::thread::Builder::new()
                .name("kspeed-redial".into())
                .stack_size(256 << 10)
                .spawn(move || {
                    let res = connect_retrying::<R>(&setup, node, &addr, &common);
                    // The loader may be gone: the connection is dropped.
                    let _ = tx.send((i, res));
                });
            match spawned {
                Ok(_) => {
                    self.redials.state[i].inflight = true;
                    self.redials.state[i].next = None;
                }
                // No thread to spare now: later.
                Err(_) => self.schedule_redial(i),
            }
        }
        while let Ok((i, res)) = self.redials.rx.try_recv() {
            self.redials.state[i].inflight = false;
            self.redialed(i, res);
        }
    }

    /// A rank's lane joined a shared thread (`lanes.rs`): its dead links
    /// are dialled again now rather than after their back-off, and are
    /// treated as nodes that just went away (a sample only they hold and
    /// the source cannot serve waits up to [`REDIAL_WAIT`] from now). An
    /// agent's links are kept across jobs (`agent/cluster.rs`): one may be
    /// down since before that node was up, since it restarted, or since it
    /// refused us (it was full, or served another dataset then), and a new
    /// job should find it as a job that connected at its start would: a
    /// refusal is forgotten too, and the node asked again.
    pub(super) fn dial_dead_now(&mut self) {
        if !self.redials.enabled || R::redial_common(&self.common).is_none() {
            return;
        }
        let now = self.ring.now();
        for i in 0..self.conns.len() {
            if self.conns[i].state != State::Dead
                || Some(self.conns[i].node) == self.setup.local_node
            {
                continue;
            }
            let r = &mut self.redials.state[i];
            r.refused = None;
            r.dead_since = Some(now);
            if !r.inflight {
                r.attempt = 0;
                r.next = Some(now);
            }
        }
    }

    /// Connection `i` was live and is dead now: samples only it holds
    /// wait for it from now on, up to [`REDIAL_WAIT`].
    pub(super) fn went_dead(&mut self, i: usize) {
        let now = self.ring.now();
        self.redials.state[i].dead_since = Some(now);
        self.schedule_redial(i);
    }

    /// Whether node `node` is gone but being dialled again, and went away
    /// less than [`REDIAL_WAIT`] ago: a sample only it can serve waits for
    /// it. Its next try is brought within [`REDIAL_WAITED`].
    pub(super) fn coming_back(&mut self, node: usize) -> bool {
        let now = self.ring.now();
        let Some(c) = self.conns.get(node) else {
            return false;
        };
        let redials = self.redials.enabled
            && Some(c.node) != self.setup.local_node
            && R::redial_common(&self.common).is_some();
        let r = &mut self.redials.state[node];
        // Closing: it goes dead (and is dialled again) once its receive
        // and send are back.
        if c.state == State::Closing {
            return redials && r.refused.is_none();
        }
        let waiting = c.state == State::Dead
            && r.refused.is_none()
            && (r.inflight || r.next.is_some())
            && r.dead_since
                .is_some_and(|t| now.saturating_duration_since(t) < REDIAL_WAIT);
        if waiting {
            let half = REDIAL_WAITED / 2;
            let soon = now
                + half
                + Duration::from_micros(jitter(c.node, r.attempt) % (half.as_micros() as u64 + 1));
            if r.next.is_some_and(|t| t > soon) {
                r.next = Some(soon);
            }
        }
        waiting
    }

    /// The error a gone node left for the samples only it holds (it came
    /// back changed, or refused us), if any.
    pub(super) fn refused(&self, node: usize) -> Option<&crate::error::Error> {
        self.redials
            .state
            .get(node)
            .and_then(|r| r.refused.as_ref())
    }

    fn redialed(&mut self, i: usize, res: Result<(super::Conn<R>, Welcome), ConnectError>) {
        let (node, addr) = (self.conns[i].node, self.conns[i].addr.clone());
        let (conn, w) = match res {
            Ok(ok) => ok,
            Err(ConnectError::Refused(e)) => {
                // Another token or dataset: this is not the node the job
                // started with; asking again will not change that.
                log::error!("node {node} ({addr}): reconnect refused: {e}; it is not used again");
                self.redials.state[i].refused = Some(e);
                self.redials.state[i].next = None;
                return;
            }
            Err(ConnectError::Unreachable(why) | ConnectError::Transient(why)) => {
                log::debug!("node {node} ({addr}): reconnect failed: {why}");
                self.schedule_redial(i);
                return;
            }
        };
        let same = welcome_placement(&w)
            .is_ok_and(|p| p == self.placement && p.nodes as usize == self.conns.len());
        if !same || w.node_index != node {
            let e = crate::error::Error::NodeChanged {
                node,
                addr: addr.clone(),
                what: format!(
                    "it is node {} with its space placed over {} nodes x {} copies (owner function {}); this loader uses node {node} of {} x {} ({})",
                    w.node_index,
                    w.nodes,
                    w.replicas,
                    w.owner_fn,
                    self.placement.nodes,
                    self.placement.replicas,
                    self.placement.owner_fn.name()
                ),
            };
            log::error!("{e}; it is not used again");
            self.redials.state[i].refused = Some(e);
            self.redials.state[i].next = None;
            return;
        }
        let t = self
            .setup
            .node_timeout
            .clamp(USER_TIMEOUT_MIN, USER_TIMEOUT_MAX);
        if let Err(e) = self.ring.set_user_timeout(conn.fd(), t) {
            log::debug!("node {node}: TCP_USER_TIMEOUT: {e}");
        }
        // The old connection is dead: nothing of it is in flight (its
        // receive and send are back) and its grants were failed over.
        debug_assert!(!self.conns[i].rx.inflight() && !self.conns[i].tx_inflight);
        let was = std::mem::replace(&mut self.conns[i], conn);
        self.give_rings(i);
        // Its first frame (asking for heartbeats) and receive go next.
        self.mark_ready(i);
        let now = self.ring.now();
        self.beats[i] = Beats::new(now);
        let r = &mut self.redials.state[i];
        r.next = None;
        r.back_since = Some(now);
        r.dead_since = None;
        // A new connection is a fresh try: the entries waiting for another
        // place (their tries of the old connection marked) may go to it.
        let placement = self.placement;
        for k in 0..self.lane_places() {
            if !self.activate(k) {
                continue;
            }
            let input = &self.l.sh.input;
            let partial = &self.l.sh.partial;
            for t in self.l.table.iter_mut() {
                if t.live && t.node == super::NONE {
                    let placed = input.placed_id(t.id);
                    let unheld = partial.as_ref().map_or(0, |p| p.unheld_copies(t.id));
                    for c in 0..placement.replicas {
                        if placement.holder(placed, c) == node && unheld & (1 << c) == 0 {
                            t.tried &= !(1u64 << c);
                        }
                    }
                }
            }
        }
        log::warn!(
            "node {node} ({addr}) is back (it was gone: {}); it takes grants again",
            was.reason
        );
    }
}

/// One node's handshake ([`handshake_all`] over that node alone), under
/// its own deadline (`node_timeout` from now), trying again after a
/// back-off with jitter while the node answers HELLO with a code that asks
/// for it ([`Code::retry_at_hello`]: node full, busy, rate-limited), and
/// likewise after a [`ConnectError::Transient`] failure (a refused
/// connect, a reset or close before the answer: a service not started
/// yet, or restarting). When the deadline comes first: a node that still
/// fails so is unreachable; a full node is `Refused` (the job has more
/// consumers than the nodes are configured for); a busy or rate-limiting
/// one is unreachable (dead from the start, its samples fail over).
fn connect_retrying<R: Receive>(
    setup: &NetSetup,
    node: u32,
    addr: &str,
    common: &R::Common,
) -> Result<(Conn<R>, Welcome), ConnectError> {
    handshake_all::<R>(setup, common, &[(node, addr.to_string())])
        .pop()
        .expect("one outcome")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redial_backoff_stays_within_its_documented_bounds() {
        // docs/PROTOCOL.md: try k waits in [b/2, b], b = min(1 s x 2^k, 30 s).
        for attempt in 0..40u32 {
            let bound = Duration::from_secs(1)
                .saturating_mul(1u32 << attempt.min(16))
                .min(Duration::from_secs(30));
            for jitter in [0u64, 1, 12_345, u64::MAX / 3, u64::MAX] {
                let w = redial_backoff(attempt, jitter);
                assert!(w >= bound / 2 && w <= bound, "try {attempt}: {w:?}");
            }
        }
    }
}
