//! A seeded pseudo-random stream (SplitMix64) for runs that must replay from
//! a printed seed: the crash campaign (`tests/crash_campaign.rs`) and the
//! failover benchmark (`bench/failover.rs`, which includes this file with
//! `#[path]`).
//!
//! It only picks operations, delays and phases; it must never be used for
//! anything secret (keys, nonces: those come from `getrandom`).

#![allow(dead_code)]

/// SplitMix64: one `u64` of state, every seed gives a full-period stream.
pub struct SplitMix64(pub u64);

impl SplitMix64 {
    /// The next value of the stream.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A value in `0..n` (`n` > 0; the modulo bias is negligible for the
    /// small `n` used here).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }

    /// A value in [0, 1), from the top 53 bits.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}
