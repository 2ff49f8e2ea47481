//! Any Hugging Face folder — `config.json`, `model.safetensors.index.json`,
//! `model.safetensors` — as `--init DIR` reads it: the model its config makes (within
//! a memory limit), its weights indexed from the headers and read. Refused in words,
//! never a panic.

#![no_main]

use libfuzzer_sys::fuzz_target;
use meshwork_types::DType;

fuzz_target!(|data: &[u8]| {
    let p = meshwork_fuzz::parts(data, 3);
    let dir = meshwork_fuzz::scratch("hf");
    meshwork_fuzz::write_files(
        &dir,
        &[
            ("config.json", p[0]),
            ("model.safetensors.index.json", p[1]),
            ("model.safetensors", p[2]),
        ],
    );
    let Ok((net, _config)) = meshwork_train::hf::model_of("init", &dir, 16) else {
        return;
    };
    let Ok(shards) = meshwork_train::hf::index("init", &dir, net.model(), DType::F32, 1 << 24)
    else {
        return;
    };
    for (name, shape) in net.model().parameters().into_iter().take(4) {
        let whole: Vec<_> = shape.iter().map(|&d| 0..d).collect();
        if let Ok(t) = shards.read(&name, &whole, DType::F32) {
            assert_eq!(t.shape(), &shape[..]);
        }
    }
});
