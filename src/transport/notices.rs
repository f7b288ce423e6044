//! The node-down notices of one agent (issue 28, docs/PROTOCOL.md "Node-down
//! notices"): when the agent's consumer side (its network threads) judges a
//! node dead from its own silence clocks, it posts a notice here; its node
//! service sends each notice, once, to every consumer connected to it that
//! asked for them (other agents' network threads and embedded ranks), so
//! they act on the death now instead of each waiting out its own timer.
//!
//! A notice is a rare event (a node's death, seen by one process), so the
//! board is a mutex over a fixed ring of [`NOTICES_KEPT`] entries, written
//! by the network threads and read by the service's pollers at their
//! 125 ms sweep, which compare one atomic counter per sweep and take the
//! lock only when it moved. Nothing here is on a sample's path.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Notices kept for pollers that have not sent them yet: a connection that
/// falls further behind (a burst of deaths while its link was blocked)
/// skips the oldest, which are then stale anyway.
pub(crate) const NOTICES_KEPT: usize = 64;

/// A node posted again within this long is not sent again: an agent's
/// network threads (or its ranks' own connections, where links are not
/// shared) each judge the same death within a sweep or two of each other
/// (their clocks count the same silence). A node that comes back and dies
/// again is judged after another 2 s of silence at least, so it is posted
/// again.
const REPEAT_WITHIN: Duration = Duration::from_secs(2);

/// One node judged dead by this process.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Notice {
    /// The dead node's index in the cluster's node list.
    pub(crate) node: u32,
    /// How long this process had heard nothing from it, in milliseconds.
    pub(crate) silent_ms: u32,
}

/// The agent's notices, in the order they were posted.
#[derive(Debug)]
pub(crate) struct NodeNotices {
    /// Notices posted so far (the next one's sequence number).
    posted: AtomicU64,
    /// Entry `seq % NOTICES_KEPT`, with the sequence number it holds and
    /// when it was posted.
    ring: Mutex<[(u64, Notice, Option<Instant>); NOTICES_KEPT]>,
}

impl NodeNotices {
    pub(crate) fn new() -> NodeNotices {
        NodeNotices {
            posted: AtomicU64::new(0),
            ring: Mutex::new([(0, Notice::default(), None); NOTICES_KEPT]),
        }
    }

    /// Posts a notice that `node` is dead after `silent_ms` of silence,
    /// unless it was posted less than [`REPEAT_WITHIN`] before `now` (the
    /// poster's clock: virtual in the simulator); whether it was posted.
    pub(crate) fn post(&self, node: u32, silent_ms: u32, now: Instant) -> bool {
        let mut ring = self.ring.lock().unwrap_or_else(|p| p.into_inner());
        let repeat = ring.iter().any(|&(_, n, at)| {
            at.is_some_and(|at| n.node == node && now.saturating_duration_since(at) < REPEAT_WITHIN)
        });
        if repeat {
            return false;
        }
        // Under the lock, so sequence numbers and entries agree.
        let seq = self.posted.load(Ordering::Relaxed);
        ring[(seq % NOTICES_KEPT as u64) as usize] = (seq, Notice { node, silent_ms }, Some(now));
        self.posted.store(seq + 1, Ordering::Release);
        true
    }

    /// Notices posted so far: the sequence number of the next one.
    pub(crate) fn posted(&self) -> u64 {
        self.posted.load(Ordering::Acquire)
    }

    /// The notice with sequence number `seq`, or, when it was overwritten,
    /// the oldest one kept (with its sequence number); None when `seq` has
    /// not been posted.
    pub(crate) fn get(&self, seq: u64) -> Option<(u64, Notice)> {
        let ring = self.ring.lock().unwrap_or_else(|p| p.into_inner());
        let posted = self.posted.load(Ordering::Relaxed);
        if seq >= posted {
            return None;
        }
        let seq = seq.max(posted.saturating_sub(NOTICES_KEPT as u64));
        let (held, n, _) = ring[(seq % NOTICES_KEPT as u64) as usize];
        assert_eq!(held, seq, "notice ring out of step");
        Some((seq, n))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notices_come_back_in_order_and_a_late_reader_skips_to_the_oldest_kept() {
        let b = NodeNotices::new();
        let t0 = Instant::now();
        assert_eq!(b.posted(), 0);
        assert_eq!(b.get(0), None);
        assert!(b.post(3, 2000, t0));
        assert!(b.post(5, 2100, t0));
        // The same death judged by another of the agent's threads.
        assert!(!b.post(3, 2050, t0));
        assert_eq!(b.posted(), 2);
        assert_eq!(
            b.get(0),
            Some((
                0,
                Notice {
                    node: 3,
                    silent_ms: 2000
                }
            ))
        );
        assert_eq!(b.get(1).map(|(_, n)| n.node), Some(5));
        assert_eq!(b.get(2), None);
        // The same node after the window: posted again.
        assert!(b.post(3, 2000, t0 + REPEAT_WITHIN));
        for k in 0..NOTICES_KEPT as u32 {
            assert!(b.post(100 + k, 1, t0));
        }
        // Sequences 0 to 2 were overwritten: the oldest kept is 3.
        let (seq, n) = b.get(0).expect("kept");
        assert_eq!((seq, n.node), (3, 100));
        let last = b.posted() - 1;
        assert_eq!(b.get(last).map(|(_, n)| n.node), Some(163));
    }
}
