//! Frozen integer mixers. The sampler's permutation and the owner function are
//! part of kspeed's on-the-wire contract (every node and every consumer must
//! compute them alike, in any language), so they are spelled out here and in
//! docs/FORMAT.md rather than taken from a crate whose output may change.

/// The SplitMix64 finalizer (Steele, Lea, Flood 2014): a bijection on u64 with
/// full avalanche.
#[inline]
pub const fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Maps a uniformly distributed `h` into `0..n` without division (Lemire's
/// multiply-shift). `n` must be non-zero.
#[inline]
pub const fn reduce(h: u64, n: u64) -> u64 {
    ((h as u128 * n as u128) >> 64) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mix64_known_values() {
        // Reference values of the SplitMix64 finalizer, so an accidental edit
        // of the constants (which would reshuffle every dataset) fails here.
        assert_eq!(mix64(0), 0);
        assert_eq!(mix64(1), 0x5692_161d_100b_05e5);
        assert_eq!(mix64(0x9e37_79b9_7f4a_7c15), 0xe220_a839_7b1d_cdaf);
    }

    #[test]
    fn reduce_stays_in_range() {
        for n in [1u64, 2, 3, 7, 1000, u64::MAX] {
            for h in [0u64, 1, u64::MAX / 2, u64::MAX] {
                assert!(reduce(h, n) < n);
            }
        }
    }
}
