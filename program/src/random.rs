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
    let ks = [key[0], key[1], key[0] ^ key[1] ^ 0x1BD1_1BDA];
    let mut x = [counter[0].wrapping_add(ks[0]), counter[1].wrapping_add(ks[1])];
    for i in 0..5 {
        for &r in &ROTATIONS[i % 2] {
            x[0] = x[0].wrapping_add(x[1]);
            x[1] = x[1].rotate_left(r) ^ x[0];
        }
        x[0] = x[0].wrapping_add(ks[(i + 1) % 3]);
        x[1] = x[1].wrapping_add(ks[(i + 2) % 3]).wrapping_add(i as u32 + 1);
    }
    x
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
    f32::from_bits(((y1 ^ y2) >> 9) | 0x3f80_0000) - 1.0
}
