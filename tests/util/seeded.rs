//! A seeded pseudo-random stream (SplitMix64) for runs that must replay from
//! a printed seed: the crash campaign (`tests/crash_campaign.rs`) and the
//! failover benchmarks (`bench/failover.rs`, which includes this file with
//! `#[path]`, and `bench/cp_failover.rs`, through `tests/util`); and the
//! stratified phases those benchmarks kill at ([`stratified`]).
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

/// `n` phases in [0, 1), stratified: the i-th lies in a stratum of its own
/// (the strata shuffled), at a uniform place within it, so `n` trials
/// sample the whole period, its first n-th included, in an order that
/// tells nothing about the place.
pub fn stratified(n: usize, rng: &mut SplitMix64) -> Vec<f64> {
    let mut strata: Vec<usize> = (0..n).collect();
    for i in (1..strata.len()).rev() {
        let j = rng.below(i as u64 + 1) as usize;
        strata.swap(i, j);
    }
    strata
        .into_iter()
        .map(|s| (s as f64 + rng.unit()) / n as f64)
        .collect()
}
