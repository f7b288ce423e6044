//! A rate limit of a poller's WARN lines (failed reads, truncated
//! extents): a dying disk must not flood the log.

/// Read-error WARN lines one poller writes per [`WARN_WINDOW`]; the rest
/// are counted and summed up in one line when the window ends.
pub(super) const WARNS_PER_WINDOW: u32 = 10;
/// See [`WARNS_PER_WINDOW`].
pub(super) const WARN_WINDOW: std::time::Duration = std::time::Duration::from_secs(10);

/// Rate limit of a poller's read-error WARN lines.
pub(super) struct WarnLimit {
    since: std::time::Instant,
    lines: u32,
    suppressed: u64,
}

impl WarnLimit {
    pub(super) fn new(now: std::time::Instant) -> Self {
        WarnLimit {
            since: now,
            lines: 0,
            suppressed: 0,
        }
    }

    /// Whether one more line may be written now (else it is counted).
    pub(super) fn allow(&mut self, now: std::time::Instant) -> bool {
        self.roll(now);
        if self.lines < WARNS_PER_WINDOW {
            self.lines += 1;
            return true;
        }
        self.suppressed += 1;
        false
    }

    /// Ends a window that is over: says how many lines it left out.
    pub(super) fn roll(&mut self, now: std::time::Instant) {
        if now.duration_since(self.since) < WARN_WINDOW {
            return;
        }
        if self.suppressed > 0 {
            log::warn!(
                "{} more failed reads in the last {} s (at most {WARNS_PER_WINDOW} logged per window)",
                self.suppressed,
                WARN_WINDOW.as_secs()
            );
        }
        self.since = now;
        self.lines = 0;
        self.suppressed = 0;
    }
}
