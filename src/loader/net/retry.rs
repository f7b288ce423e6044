//! When a handshake is tried again: which failures a node may get over by
//! itself ([`ConnectError::Transient`], and the refusals whose code asks
//! for it), and the back-off with jitter between tries (docs/PROTOCOL.md,
//! "Admission and retry").

use std::time::Duration;

use crate::error::Error;
use crate::transport::proto::Code;

/// Why a node could not be connected.
pub(crate) enum ConnectError {
    Refused(Error),
    Unreachable(String),
    /// Refused at TCP connect (no service listening yet), or the
    /// connection reset or closed before the node answered HELLO: the
    /// service may be starting or restarting, so [`connect_retrying`]
    /// tries again with back-off until the node's deadline.
    Transient(String),
}

/// First back-off after a retryable refusal at HELLO; each next one's
/// bound doubles up to [`RETRY_MAX`] (docs/PROTOCOL.md, "Admission and
/// retry").
pub(crate) const RETRY_FIRST: Duration = Duration::from_millis(100);
/// Longest back-off between two tries.
pub(crate) const RETRY_MAX: Duration = Duration::from_secs(2);

/// The wait before try `attempt + 1` (`attempt` from 0): uniform in
/// `[bound / 2, bound]` with `bound = min(RETRY_FIRST x 2^attempt,
/// RETRY_MAX)`, so consumers refused together spread out.
pub(crate) fn retry_backoff(attempt: u32, jitter: u64) -> Duration {
    let bound = RETRY_FIRST
        .saturating_mul(1u32 << attempt.min(16))
        .min(RETRY_MAX);
    let half = bound / 2;
    let span = half.as_micros() as u64 + 1;
    half + Duration::from_micros(jitter % span)
}

/// A random number for the back-off's jitter (std's randomly keyed hasher;
/// no generator needed for this).
pub(crate) fn jitter(node: u32, attempt: u32) -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(node);
    h.write_u32(attempt);
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
    );
    h.finish()
}

/// Whether a refusal's code (by name) asks the consumer to try again.
pub(super) fn retryable(name: &str) -> bool {
    [Code::NodeFull, Code::Busy, Code::RateLimited]
        .iter()
        .any(|c| c.retry_at_hello() && c.name() == name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_backoff_stays_within_its_documented_bounds() {
        // docs/PROTOCOL.md: try k waits in [b/2, b], b = min(100 ms x 2^k, 2 s).
        for attempt in 0..40u32 {
            let bound = Duration::from_millis(100)
                .saturating_mul(1u32 << attempt.min(16))
                .min(Duration::from_secs(2));
            for jitter in [0u64, 1, 12_345, u64::MAX / 3, u64::MAX] {
                let w = retry_backoff(attempt, jitter);
                assert!(
                    w >= bound / 2 && w <= bound,
                    "try {attempt}: {w:?} outside [{:?}, {bound:?}]",
                    bound / 2
                );
            }
        }
        assert_eq!(retry_backoff(0, 0), Duration::from_millis(50));
        assert_eq!(retry_backoff(30, 0), Duration::from_secs(1));
    }

    #[test]
    fn only_full_busy_and_rate_limited_are_retried() {
        for c in (0..20).map(Code::from_u32) {
            let want = matches!(c, Code::NodeFull | Code::Busy | Code::RateLimited);
            assert_eq!(retryable(c.name()), want, "{c:?}");
            assert_eq!(c.retry_at_hello(), want, "{c:?}");
        }
    }
}
