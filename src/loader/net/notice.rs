//! Node-down notices on the consumer's side (issue 28, docs/PROTOCOL.md
//! "Node-down notices").
//!
//! - **Posting.** In an agent with a node service, a node this thread
//!   judges dead by its own clocks (heartbeat silence, no data with grants
//!   outstanding) is posted to the agent's board
//!   (`crate::transport::notices`), whose node service tells every
//!   consumer that asked. A node shut because of a notice is not posted
//!   again (the notices would echo round the cluster), nor is one shut for
//!   other reasons (a reset or a closed connection reaches every consumer
//!   by itself; a slow node is not a dead one).
//! - **Receiving.** A notice about node X from node A is a hint, not a
//!   verdict: A may have lost only its own path to X. If this thread's own
//!   clock already agrees (X silent for [`proto::NOTICE_SILENCE`] on a
//!   connection X beats every 250 ms: grants are outstanding there, or X
//!   beats fast idle or not), X is shut now and its grants fail over. Else
//!   (an idle connection, beaten every 5 s, whose silence says nothing)
//!   X is probed (a keepalive asking for a heartbeat at once) and shut if
//!   nothing comes from it within [`proto::PROBE_SILENCE`]. A live X
//!   answers and keeps its connection; a dead one is shut before this
//!   consumer's next grant would have had to wait out its own 2 s.

use std::time::{Duration, Instant};

use super::{Receive, State, Thread, NOT_RUNNING};
use crate::ring::IoBackend;
use crate::transport::proto;

/// Whether this process's consumers ask for node-down notices: yes, unless
/// `KSPEED_NODE_NOTICES=off` (for measuring a cluster without them,
/// scripts/bench_node_down.py).
pub(super) fn ask_notices() -> bool {
    static ASK: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ASK.get_or_init(|| std::env::var("KSPEED_NODE_NOTICES").as_deref() != Ok("off"))
}

/// A consumer's keepalive: asking for heartbeats (and for notices, see
/// [`ask_notices`]), a probe when `probe`.
pub(super) fn keepalive(probe: bool) -> proto::Header {
    let mut h = if probe {
        proto::Header::probe()
    } else {
        proto::Header::keepalive(true)
    };
    if !ask_notices() {
        h.c &= !proto::ASK_NODE_NOTICES;
    }
    h
}

impl<R: Receive, I: IoBackend> Thread<R, I> {
    /// Posts connection `i`'s node as dead after `silent` (judged by this
    /// thread's own clocks), when this thread has a board to post to.
    pub(super) fn post_node_down(&self, i: usize, silent: Duration) {
        let Some(board) = &self.setup.notices else {
            return;
        };
        let ms = silent.as_millis().min(u32::MAX as u128) as u32;
        if board.post(self.conns[i].node, ms, self.ring.now()) {
            log::info!(
                "node {}: posted as down for the node service to tell the other nodes",
                self.conns[i].node
            );
        }
    }

    /// A notice from connection `from`'s node: node `node` was silent for
    /// `silent_ms` there and is taken for dead.
    pub(super) fn on_node_down(&mut self, from: usize, node: u32, silent_ms: u32) {
        let by = self.conns[from].node;
        let j = node as usize;
        // conns is indexed by node (this node's own entry is never live).
        if j >= self.conns.len() || node == by || self.setup.local_node == Some(node) {
            log::debug!("node {by}: a node-down notice about node {node} ignored");
            return;
        }
        let c = &self.conns[j];
        if c.state != State::Live {
            return;
        }
        let now = self.ring.now();
        let b = &mut self.beats[j];
        let silent = now.saturating_duration_since(b.last_heard);
        // A node that beats this connection every 250 ms (grants
        // outstanding, or a node that beats fast idle or not) and was
        // silent this long agrees with the notice.
        let beats_fast = b.heard && (c.outstanding > 0 || !b.slow);
        // A thread that did not run for a while has not yet moved its
        // clocks past the gap (`check_timeouts`): its silence says nothing.
        let ran = now.saturating_duration_since(self.last_check) <= NOT_RUNNING;
        if beats_fast && ran && silent >= proto::NOTICE_SILENCE {
            let why = format!(
                "node {by} reported it down ({silent_ms} ms silent there), {} ms silent here",
                silent.as_millis()
            );
            log::warn!("node {node} ({}): {why}", c.addr);
            self.kill(j, why);
            return;
        }
        if b.probed.is_none() {
            b.probed = Some((now, by, silent_ms));
            b.probe_due = true;
            log::info!(
                "node {node} ({}): node {by} reported it down ({silent_ms} ms silent there); \
                 asking it for a heartbeat",
                c.addr
            );
            self.sweep.mark_busy(j);
            self.mark_ready(j);
        }
    }

    /// Whether connection `i` was probed after a notice and said nothing
    /// for [`proto::PROBE_SILENCE`]: then it is shut (true). A probed node
    /// heard from since keeps its connection, and its probe is done.
    pub(super) fn probe_unanswered(&mut self, i: usize, now: Instant) -> bool {
        let b = &mut self.beats[i];
        let Some((at, by, silent_ms)) = b.probed else {
            return false;
        };
        // A frame from the node, not a grant to it (which moves
        // `last_heard` on a slow-beating node).
        if b.last_frame >= at {
            b.probed = None;
            log::info!(
                "node {} ({}): answered after node {by}'s notice; kept",
                self.conns[i].node,
                self.conns[i].addr
            );
            return false;
        }
        if now.saturating_duration_since(at) <= proto::PROBE_SILENCE {
            return false;
        }
        let why = format!(
            "node {by} reported it down ({silent_ms} ms silent there), and it did not answer \
             a probe within {} ms",
            proto::PROBE_SILENCE.as_millis()
        );
        log::warn!(
            "node {} ({}): {why}",
            self.conns[i].node,
            self.conns[i].addr
        );
        self.kill(i, why);
        true
    }
}
