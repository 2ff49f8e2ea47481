//! Random numbers as JAX draws them: the Threefry-2x32 block cipher (Salmon et al.,
//! "Parallel random numbers: as easy as 1, 2, 3", 2011; 20 rounds, as
//! `jax.random`'s default generator), its keys made and folded as
//! `jax.random.PRNGKey` and `jax.random.fold_in` make them, and the float32 uniform
//! `jax.random.uniform` makes of its bits (with `jax_threefry_partitionable`, JAX's
//! default: an element's bits depend on its key and its index alone). The host's half
//! of [`Op::ThreefryUniform`](crate::Op::ThreefryUniform), whose definition this is.

/// The rotations of the two groups of four rounds.
const ROTATIONS: [[u32; 4]; 2] = [[13, 15, 26, 6], [17, 29, 16, 24]];

/// The Threefry-2x32 block of `counter` under `key` (20 rounds): JAX's
/// `threefry_2x32` of one counter pair.
pub fn threefry2x32(key: [u32; 2], counter: [u32; 2]) -> [u32; 2] {
    let [[y0], [y1]] = threefry_lanes([[key[0]], [key[1]]], [[counter[0]], [counter[1]]]);
    [y0, y1]
}

/// [`threefry2x32`] of `L` keys and counters at once, word by word (`key[0]` holds
/// each lane's first key word): each step on every lane in turn, so that the loops
/// vectorize (the fast interpreter's kernel runs 16 lanes).
#[inline(always)]
pub(crate) fn threefry_lanes<const L: usize>(
    key: [[u32; L]; 2],
    counter: [[u32; L]; 2],
) -> [[u32; L]; 2] {
    let ks = [key[0], key[1], std::array::from_fn(|l| key[0][l] ^ key[1][l] ^ 0x1BD1_1BDA)];
    let mut x0: [u32; L] = std::array::from_fn(|l| counter[0][l].wrapping_add(ks[0][l]));
    let mut x1: [u32; L] = std::array::from_fn(|l| counter[1][l].wrapping_add(ks[1][l]));
    for i in 0..5 {
        for r in ROTATIONS[i % 2] {
            for l in 0..L {
                x0[l] = x0[l].wrapping_add(x1[l]);
                x1[l] = x1[l].rotate_left(r) ^ x0[l];
            }
        }
        for l in 0..L {
            x0[l] = x0[l].wrapping_add(ks[(i + 1) % 3][l]);
            x1[l] = x1[l].wrapping_add(ks[(i + 2) % 3][l]).wrapping_add(i as u32 + 1);
        }
    }
    [x0, x1]
}

/// `jax.random.PRNGKey(seed)`: the seed's high and low 32 bits.
pub fn key(seed: u64) -> [u32; 2] {
    [(seed >> 32) as u32, seed as u32]
}

/// `jax.random.fold_in(key, data)`: the block of counter `(0, data)`.
pub fn fold_in(key: [u32; 2], data: u32) -> [u32; 2] {
    threefry2x32(key, [0, data])
}

/// Element `index` of `jax.random.uniform(key, shape)` (float32) for an array of
/// fewer than 2³² elements: in `[0, 1)`, from the 23 high bits of the block's two
/// words xor-ed.
pub fn uniform(key: [u32; 2], index: u32) -> f32 {
    let [y1, y2] = threefry2x32(key, [0, index]);
    unit_float(y1 ^ y2)
}

/// JAX's float32 in `[0, 1)` of 32 random bits: their 23 high bits as the mantissa
/// of a float in `[1, 2)`, less 1.
#[inline(always)]
pub(crate) fn unit_float(bits: u32) -> f32 {
    f32::from_bits((bits >> 9) | 0x3f80_0000) - 1.0
}
