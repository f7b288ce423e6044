//! Which connections the network thread's sweep looks at (timeouts,
//! keepalives due, dead nodes due for a redial).
//!
//! Two speeds. A connection with grants outstanding, not live (closing,
//! dead, waiting for a redial, or dead for good: it then stays), or with
//! a short keepalive interval (under four times `idle_all`: the 1 s of a
//! node that has not said its idle timeout, or one with a short idle
//! timeout) is in the *busy* list, looked at whole every [`BUSY_ALL`]
//! (100 ms: its clocks are the 2 s heartbeat silence, the node timeout, a
//! keepalive every second). Any other connection waits only on slow
//! clocks (a keepalive every 4-15 s, a silence of at least the node
//! timeout before it is judged dead), so a window sized by the time since
//! the last sweep covers every connection once per `idle_all`: an eighth
//! of the node timeout, 100 ms to 1 s, at most a quarter of such a
//! keepalive interval late. With 4,095 idle nodes a sweep looked at each
//! of them every 100 ms, 41,000 looks a second each missing the cache;
//! now every second (BENCHMARKS.md, "One consumer against 4,096 nodes").
//! A connection joins the busy list when it is given a grant with none
//! outstanding, stops being live, or hears a short idle timeout, and
//! leaves it at a busy walk that finds none of these.
//!
//! The lists are sized at start (one place per connection); a sweep's
//! looks are written into a vector of that size, never grown.

use std::time::{Duration, Instant};

/// How often the sweep runs (at most: an idle tick waits up to 50 ms).
/// Between sweeps a tick looks only at the connections marked ready
/// (`Thread::ready`), so its cost follows what happened, not the node
/// count.
pub(super) const SWEEP: Duration = Duration::from_millis(10);
/// Busy connections are looked at whole this often.
pub(super) const BUSY_ALL: Duration = Duration::from_millis(100);
/// The longest an idle live connection goes unlooked at.
const IDLE_ALL_MAX: Duration = Duration::from_secs(1);
/// A sweep's window holds at least this many connections (so up to 64
/// nodes are looked at whole every sweep).
pub(super) const SWEEP_MIN_CONNS: usize = 64;

/// How often each idle live connection is looked at, for a node timeout
/// of `node_timeout`: an eighth of it (an idle node's silence is judged
/// against at least the node timeout), 100 ms to 1 s.
pub(super) fn idle_all(node_timeout: Duration) -> Duration {
    (node_timeout / 8).clamp(BUSY_ALL, IDLE_ALL_MAX)
}

/// How many of `n` connections a sweep `since` the previous one looks at
/// so that each is looked at within `all`.
pub(super) fn sweep_count(n: usize, since: Duration, all: Duration) -> usize {
    let share = (n as u128 * since.as_nanos()).div_ceil(all.as_nanos().max(1));
    n.min(SWEEP_MIN_CONNS.max(share.min(n as u128) as usize))
}

/// The `m` connections of `n` a sweep starting at `start` looks at,
/// wrapping.
pub(super) fn sweep_window(start: usize, m: usize, n: usize) -> impl Iterator<Item = usize> {
    (0..m.min(n)).map(move |j| (start + j) % n)
}

/// The sweep's clock, window and busy list.
pub(super) struct Sweep {
    next: Instant,
    last: Instant,
    at: usize,
    next_busy: Instant,
    idle_all: Duration,
    busy: Vec<usize>,
    in_busy: Vec<bool>,
    /// The busy list was walked by the sweep in progress.
    walked_busy: bool,
    looks: Vec<usize>,
}

impl Sweep {
    /// For `n` connections judged by `node_timeout`, the first sweep due
    /// at `now`.
    pub(super) fn new(n: usize, now: Instant, node_timeout: Duration) -> Sweep {
        Sweep {
            next: now,
            last: now,
            at: 0,
            next_busy: now,
            idle_all: idle_all(node_timeout),
            busy: Vec::with_capacity(n),
            in_busy: vec![false; n],
            walked_busy: false,
            looks: Vec::with_capacity(2 * n),
        }
    }

    /// Connection `i` has grants outstanding, is not live, or has a short
    /// keepalive interval: looked at every [`BUSY_ALL`] until a busy walk
    /// finds none of these.
    pub(super) fn mark_busy(&mut self, i: usize) {
        if !self.in_busy[i] {
            self.in_busy[i] = true;
            self.busy.push(i);
        }
    }

    /// A keepalive interval under this keeps its connection in the busy
    /// list: looked at every [`BUSY_ALL`], not every `idle_all`.
    pub(super) fn short_keepalive(&self) -> Duration {
        4 * self.idle_all
    }

    /// Whether connection `i` is in the busy list.
    #[cfg(test)]
    pub(super) fn is_busy(&self, i: usize) -> bool {
        self.in_busy[i]
    }

    /// At `now`, the connections a sweep due now looks at (a window of
    /// all, then the busy list when its walk is due; an index may come
    /// twice), or None when none is due. Give the vector back with
    /// [`Sweep::done`].
    pub(super) fn due(&mut self, now: Instant) -> Option<Vec<usize>> {
        if now < self.next {
            return None;
        }
        self.next = now + SWEEP;
        let n = self.in_busy.len();
        let m = sweep_count(n, now.saturating_duration_since(self.last), self.idle_all);
        self.last = now;
        let mut looks = std::mem::take(&mut self.looks);
        debug_assert!(looks.is_empty());
        looks.extend(sweep_window(self.at, m, n));
        self.at = (self.at + m) % n.max(1);
        self.walked_busy = now >= self.next_busy;
        if self.walked_busy {
            // Every 100 ms on the clock, not 100 ms after a late sweep.
            self.next_busy += BUSY_ALL;
            if self.next_busy <= now {
                self.next_busy = now + BUSY_ALL;
            }
            looks.extend_from_slice(&self.busy);
        }
        debug_assert!(looks.len() <= 2 * n, "a sweep's looks outgrew their pool");
        Some(looks)
    }

    /// The sweep is over: `looks` comes back, and when it walked the busy
    /// list, the connections `busy(i)` says are idle leave it.
    pub(super) fn done(&mut self, mut looks: Vec<usize>, busy: impl Fn(usize) -> bool) {
        looks.clear();
        self.looks = looks;
        if std::mem::take(&mut self.walked_busy) {
            let in_busy = &mut self.in_busy;
            self.busy.retain(|&i| {
                let keep = busy(i);
                in_busy[i] = keep;
                keep
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each connection is looked at within its period whatever the time
    /// between sweeps, and a small cluster whole at every sweep.
    #[test]
    fn sweeps_cover_every_connection_within_their_period() {
        let all = IDLE_ALL_MAX;
        assert_eq!(sweep_count(0, SWEEP, all), 0);
        assert_eq!(sweep_count(40, SWEEP, all), 40);
        assert_eq!(sweep_count(4095, SWEEP, all), 64);
        assert_eq!(sweep_count(4095, Duration::from_millis(50), all), 205);
        assert_eq!(sweep_count(4095, Duration::from_secs(2), all), 4095);
        assert_eq!(sweep_count(4095, Duration::ZERO, all), SWEEP_MIN_CONNS);
        assert_eq!(sweep_count(4095, SWEEP, BUSY_ALL), 410);
        for (n, gap_ms, all) in [
            (1usize, 10u64, all),
            (100, 10, all),
            (4095, 10, all),
            (4095, 50, all),
            (777, 37, all),
            (4095, 10, BUSY_ALL),
            (777, 37, Duration::from_millis(250)),
        ] {
            let mut seen = vec![0u32; n];
            let (mut at, mut elapsed) = (0usize, Duration::ZERO);
            while elapsed < all {
                let m = sweep_count(n, Duration::from_millis(gap_ms), all);
                for i in sweep_window(at, m, n) {
                    seen[i] += 1;
                }
                at = (at + m) % n;
                elapsed += Duration::from_millis(gap_ms);
            }
            assert!(
                seen.iter().all(|&k| k >= 1),
                "{n} connections, a sweep every {gap_ms} ms: some not looked at within {all:?}"
            );
        }
    }

    #[test]
    fn the_idle_period_follows_the_node_timeout() {
        assert_eq!(idle_all(Duration::from_secs(10)), Duration::from_secs(1));
        assert_eq!(idle_all(Duration::from_secs(2)), Duration::from_millis(250));
        assert_eq!(idle_all(Duration::from_millis(200)), BUSY_ALL);
        assert_eq!(idle_all(Duration::from_secs(600)), IDLE_ALL_MAX);
    }

    /// A busy connection is looked at every 100 ms, however many idle ones
    /// there are, until a busy walk finds it idle; an idle one within its
    /// period.
    #[test]
    fn busy_connections_are_looked_at_every_busy_period() {
        let n = 4095;
        let t0 = Instant::now();
        let mut s = Sweep::new(n, t0, Duration::from_secs(10));
        s.mark_busy(7);
        s.mark_busy(7);
        s.mark_busy(3000);
        let mut looked_busy = Vec::new();
        let mut looked_idle = vec![false; n];
        let mut idle_at = 0u64;
        let mut t = t0;
        // Connection 3000 is busy for the first 300 ms.
        while t < t0 + Duration::from_millis(1000) {
            if let Some(looks) = s.due(t) {
                let ms = t.duration_since(t0).as_millis() as u64;
                if looks.contains(&7) && looks.contains(&3000) {
                    looked_busy.push(ms);
                }
                for &i in &looks {
                    looked_idle[i] = true;
                }
                assert!(looks.len() <= 2 * n);
                s.done(looks, |i| i == 7 || (i == 3000 && ms < 300));
                if looked_idle.iter().all(|&l| l) && idle_at == 0 {
                    idle_at = ms;
                }
            }
            t += Duration::from_millis(10);
        }
        // Walked at 0, 100, 200, 300 ms with both; 3000 left at 300.
        assert_eq!(&looked_busy[..4], &[0, 100, 200, 300]);
        assert!(s.is_busy(7) && !s.is_busy(3000));
        assert!(
            idle_at > 0 && idle_at < 1000,
            "every connection within 1 s: {idle_at}"
        );
        // It joins again when busy again.
        s.mark_busy(3000);
        assert!(s.is_busy(3000));
    }
}
