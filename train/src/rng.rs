//! The one random stream of the trainer: SplitMix64, with uniform and normal draws. The
//! built-in data, the initial weights and the shuffled row order all come from it, so
//! runs of the same seed read the same rows and start from the same weights.

/// SplitMix64 (Steele, Lea and Flood), with a Box–Muller normal.
#[derive(Debug, Clone)]
pub struct SplitMix(u64);

impl SplitMix {
    /// The stream of `seed`.
    pub fn new(seed: u64) -> SplitMix {
        SplitMix(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in (0, 1): never 0, so its logarithm is finite.
    pub fn uniform(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }

    /// Standard normal.
    pub fn normal(&mut self) -> f64 {
        let (u, v) = (self.uniform(), self.uniform());
        (-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()
    }

    /// Uniform in `0..n` (`n` at least 1).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n.max(1) as u64) as usize
    }
}

/// The row order of epoch `epoch` of `n` rows when shuffling with `seed`: a
/// Fisher–Yates shuffle driven by SplitMix64. Every model reads shuffled rows in this
/// order, so runs of the same seed see the same batches.
pub fn permutation(seed: u64, epoch: usize, n: usize) -> Vec<usize> {
    let mut rng = SplitMix(seed ^ (epoch as u64).wrapping_mul(0x2545_f491_4f6c_dd1d));
    let mut p: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        p.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
    }
    p
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::{SplitMix, permutation};

    /// The reference values of SplitMix64 from seed 1234567 (Vigna's `splitmix64.c`),
    /// and uniforms strictly inside (0, 1).
    #[test]
    fn splitmix_gives_the_reference_stream() {
        let mut r = SplitMix::new(1_234_567);
        let want =
            [6_457_827_717_110_365_317u64, 3_203_168_211_198_807_973, 9_817_491_932_198_370_423];
        for w in want {
            assert_eq!(r.next_u64(), w);
        }
        let mut r = SplitMix::new(0);
        assert!((0..10_000).map(|_| r.uniform()).all(|u| u > 0.0 && u < 1.0));
    }

    proptest! {
        /// A shuffle is a permutation (every row once), and the same seed and epoch
        /// give the same one.
        #[test]
        fn prop_a_shuffle_is_a_permutation(seed in any::<u64>(), epoch in 0usize..5, n in 0usize..300) {
            let p = permutation(seed, epoch, n);
            let mut sorted = p.clone();
            sorted.sort_unstable();
            prop_assert_eq!(sorted, (0..n).collect::<Vec<_>>());
            prop_assert_eq!(p, permutation(seed, epoch, n));
        }
    }
}
