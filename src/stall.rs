//! A stall detector for the poll loops (glommio's `stall.rs` is the model):
//! a tick whose busy part, from waking to the next wait, takes longer than a
//! threshold is counted and logged at most once per [`LOG_INTERVAL`], with
//! what the tick did (its phases) and how long it took.
//!
//! Every loop that must not block (the loader's pollers, its network
//! thread, the node service's pollers and acceptor) owns one [`Stall`]. Per
//! tick it costs one clock read (`Instant::now`, a vDSO call, at
//! [`Stall::lap`]) plus one on waking from a wait ([`Stall::resume`], next to
//! the system call that waited), an OR per phase and no allocation; the
//! time spent waiting is not counted as a stall.
//!
//! The threshold is `KSPEED_STALL_MS` (milliseconds, default
//! [`DEFAULT_THRESHOLD_MS`]; 0 turns the detector off), read once when a loop
//! starts.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// The default threshold: a tick longer than this is a stall.
pub const DEFAULT_THRESHOLD_MS: u64 = 50;

/// At most one stall log line per loop in this interval (the others are
/// counted and summarised in the next line).
pub const LOG_INTERVAL: Duration = Duration::from_secs(10);

/// The environment variable that sets the threshold in milliseconds.
pub const THRESHOLD_ENV: &str = "KSPEED_STALL_MS";

/// What a loop's tick was doing: each phase a tick goes through is noted
/// (a bit), and a stalled tick's log line names them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Phase {
    /// Queueing or submitting I/O.
    Submit,
    /// Reaping completions and acting on them.
    Reap,
    /// Opening a file (source mode).
    Open,
    /// Copying in or out of the memory tier.
    Tier,
    /// Receiving frames or posting receives.
    Recv,
    /// Sending frames or posting sends.
    Send,
    /// Timers: heartbeats, timeouts, stalled consumers.
    Timers,
    /// Accepting connections.
    Accept,
    /// Handshakes (HELLO/WELCOME, RDMA set-up).
    Handshake,
    /// Connecting or redialling nodes.
    Connect,
    /// Adopting or closing connections.
    Conns,
}

const PHASES: [&str; 11] = [
    "submit",
    "reap",
    "open",
    "tier",
    "recv",
    "send",
    "timers",
    "accept",
    "handshake",
    "connect",
    "connections",
];

/// One loop's stall detector (see the module comment).
#[derive(Debug)]
pub(crate) struct Stall {
    /// The loop, for log lines ("loader poller 3").
    what: &'static str,
    index: usize,
    /// None: off.
    threshold: Option<Duration>,
    /// Start of the current tick's busy part.
    mark: Instant,
    /// Phases of the current tick (bits of [`Phase`]).
    phases: u16,
    /// Stalls since the last log line, and the longest of them.
    unlogged: u64,
    worst: Duration,
    worst_phases: u16,
    last_log: Option<Instant>,
    /// How long the last tick's busy part took (zero while off).
    last_busy: Duration,
    /// Test hook (`test-panic` feature): the first tick takes this long.
    #[cfg(feature = "test-panic")]
    inject: Option<Duration>,
}

/// The threshold from [`THRESHOLD_ENV`] (None: off), warning once about a
/// value that is not a number.
pub(crate) fn threshold_from_env() -> Option<Duration> {
    let ms = match std::env::var(THRESHOLD_ENV) {
        Ok(v) => match v.trim().parse::<u64>() {
            Ok(ms) => ms,
            Err(_) => {
                log::warn!(
                    "{THRESHOLD_ENV}={v:?} is not a number of milliseconds; using {DEFAULT_THRESHOLD_MS}"
                );
                DEFAULT_THRESHOLD_MS
            }
        },
        Err(_) => DEFAULT_THRESHOLD_MS,
    };
    (ms > 0).then(|| Duration::from_millis(ms))
}

impl Stall {
    /// A detector for loop `what` number `index`, with the threshold from
    /// the environment.
    pub(crate) fn new(what: &'static str, index: usize) -> Self {
        Self::with_threshold(what, index, threshold_from_env())
    }

    pub(crate) fn with_threshold(
        what: &'static str,
        index: usize,
        threshold: Option<Duration>,
    ) -> Self {
        Stall {
            what,
            index,
            threshold,
            mark: Instant::now(),
            phases: 0,
            unlogged: 0,
            worst: Duration::ZERO,
            worst_phases: 0,
            last_log: None,
            last_busy: Duration::ZERO,
            #[cfg(feature = "test-panic")]
            inject: std::env::var("KSPEED_TEST_STALL_MS")
                .ok()
                .and_then(|v| v.parse().ok())
                .map(Duration::from_millis),
        }
    }

    /// Notes that the current tick does `p`.
    #[inline]
    pub(crate) fn phase(&mut self, p: Phase) {
        self.phases |= 1 << p as u16;
    }

    /// The loop woke from a wait, or starts (call it first thing in the
    /// loop's thread: construction and thread start are no tick): the busy
    /// part starts now.
    #[inline]
    pub(crate) fn resume(&mut self) {
        if self.threshold.is_some() {
            self.mark = Instant::now();
        }
    }

    /// The end of a tick's busy part (before waiting, or before the next
    /// tick when the loop does not wait): counts a stall in `counter` if it
    /// took longer than the threshold. Returns whether it was a stall.
    #[inline]
    pub(crate) fn lap(&mut self, counter: &AtomicU64) -> bool {
        if self.threshold.is_none() {
            return false;
        }
        #[cfg(feature = "test-panic")]
        if let Some(d) = self.inject.take() {
            // The test hook: this tick blocks (tests/serve_panic.rs).
            std::thread::sleep(d);
        }
        self.lap_at(Instant::now(), counter).is_some()
    }

    /// How long the busy part of the tick the last [`lap`](Self::lap) ended
    /// took (zero when the detector is off: `KSPEED_STALL_MS=0`).
    pub(crate) fn last_busy(&self) -> Duration {
        self.last_busy
    }

    /// [`lap`](Self::lap) at time `now`; returns the log line's text when
    /// one is due (unit tests drive time through this).
    fn lap_at(&mut self, now: Instant, counter: &AtomicU64) -> Option<String> {
        let threshold = self.threshold?;
        let took = now.saturating_duration_since(self.mark);
        let phases = std::mem::take(&mut self.phases);
        self.mark = now;
        self.last_busy = took;
        if took <= threshold {
            return None;
        }
        counter.fetch_add(1, Ordering::Relaxed);
        self.unlogged += 1;
        if took > self.worst {
            self.worst = took;
            self.worst_phases = phases;
        }
        if self
            .last_log
            .is_some_and(|t| now.duration_since(t) < LOG_INTERVAL)
        {
            return None;
        }
        // Rare (at most once per interval): the line may allocate.
        let line = format!(
            "{} {}: a tick took {} ms (threshold {} ms) doing {}{}",
            self.what,
            self.index,
            self.worst.as_millis(),
            threshold.as_millis(),
            phase_names(self.worst_phases),
            if self.unlogged > 1 {
                format!(
                    "; {} stalls since the last report (the longest shown)",
                    self.unlogged
                )
            } else {
                String::new()
            }
        );
        log::warn!("{line}");
        self.last_log = Some(now);
        self.unlogged = 0;
        self.worst = Duration::ZERO;
        self.worst_phases = 0;
        Some(line)
    }
}

/// "open+submit+reap" for a set of phase bits ("nothing noted" for none).
fn phase_names(bits: u16) -> String {
    let names: Vec<&str> = PHASES
        .iter()
        .enumerate()
        .filter(|(i, _)| bits & (1 << i) != 0)
        .map(|(_, n)| *n)
        .collect();
    if names.is_empty() {
        "nothing noted".into()
    } else {
        names.join("+")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn det() -> Stall {
        let mut s = Stall::with_threshold("test loop", 0, Some(Duration::from_millis(50)));
        #[cfg(feature = "test-panic")]
        {
            s.inject = None;
        }
        s.mark = Instant::now();
        s
    }

    #[test]
    fn fast_ticks_are_not_stalls() {
        let mut s = det();
        let c = AtomicU64::new(0);
        let t0 = s.mark;
        for i in 1..=1000u64 {
            s.phase(Phase::Submit);
            assert!(s.lap_at(t0 + Duration::from_millis(i), &c).is_none());
        }
        assert_eq!(c.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn a_slow_tick_is_counted_and_logged_once_per_interval() {
        let mut s = det();
        let c = AtomicU64::new(0);
        let t0 = s.mark;
        s.phase(Phase::Open);
        s.phase(Phase::Reap);
        let line = s
            .lap_at(t0 + Duration::from_millis(120), &c)
            .expect("logged");
        assert_eq!(c.load(Ordering::Relaxed), 1);
        assert!(line.contains("took 120 ms"), "{line}");
        assert!(line.contains("reap+open"), "{line}");
        // Two more within the interval: counted, not logged.
        let mut t = t0 + Duration::from_millis(120);
        for _ in 0..2 {
            s.phase(Phase::Send);
            t += Duration::from_millis(200);
            assert!(s.lap_at(t, &c).is_none());
        }
        assert_eq!(c.load(Ordering::Relaxed), 3);
        // A fast tick after the interval: no line (nothing new stalled).
        t += LOG_INTERVAL;
        s.resume();
        s.mark = t - Duration::from_millis(1);
        assert!(s.lap_at(t, &c).is_none());
        // The next stall logs, summarising the two unlogged ones.
        s.phase(Phase::Accept);
        t += Duration::from_millis(60);
        let line = s.lap_at(t, &c).expect("logged");
        assert!(line.contains("took 200 ms"), "{line}");
        assert!(line.contains("3 stalls since"), "{line}");
        assert!(line.contains("send"), "{line}");
        assert_eq!(c.load(Ordering::Relaxed), 4);
    }

    #[test]
    fn waiting_is_not_a_stall() {
        let mut s = det();
        let c = AtomicU64::new(0);
        // Busy 1 ms, then a wait: the wake-up resets the mark.
        let t0 = s.mark;
        assert!(s.lap_at(t0 + Duration::from_millis(1), &c).is_none());
        s.mark = t0 + Duration::from_millis(500); // resume() after a 499 ms wait
        assert!(s.lap_at(t0 + Duration::from_millis(502), &c).is_none());
        assert_eq!(c.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn off_counts_nothing() {
        let mut s = Stall::with_threshold("test loop", 0, None);
        let c = AtomicU64::new(0);
        let t = s.mark + Duration::from_secs(5);
        assert!(s.lap_at(t, &c).is_none());
        assert_eq!(c.load(Ordering::Relaxed), 0);
    }
}
