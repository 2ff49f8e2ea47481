//! Any `index.json` (and shard file) as a checkpoint: its metadata, its variables and
//! (for small ones) their values are read, or refused in words. Never a panic, and
//! never an allocation the files do not justify.

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let p = meshwork_fuzz::parts(data, 2);
    let dir = meshwork_fuzz::scratch("checkpoint");
    meshwork_fuzz::write_files(&dir, &[("index.json", p[0]), ("shard-0.safetensors", p[1])]);
    let _ = meshwork_checkpoint::checkpoint_metadata(&dir);
    let _ = meshwork_checkpoint::is_checkpoint(&dir);
    let Ok(vars) = meshwork_checkpoint::checkpoint_variables(&dir) else {
        return;
    };
    // Values only for what a caller could hold (the caller sizes what it asks for).
    let elements: u128 =
        vars.iter().map(|(_, _, s)| s.iter().map(|&d| d as u128).product::<u128>()).sum();
    if elements <= 1 << 16 {
        if let Ok(values) = meshwork_checkpoint::read_checkpoint(&dir, &vars) {
            for (v, (_, dtype, shape)) in values.iter().zip(&vars) {
                assert_eq!((v.dtype(), v.shape()), (*dtype, &shape[..]));
            }
        }
    }
});
