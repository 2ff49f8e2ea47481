//! Any `generation_config.json`, `tokenizer_config.json` (its chat template) and
//! messages file as `generate` reads them: read, rendered and encoded with the test
//! Llama tokenizer, or refused in words. Never a panic.

#![no_main]

use libfuzzer_sys::fuzz_target;

const TOKENIZER: &[u8] = include_bytes!("../../train/testdata/llama/tokenizer.json");

fuzz_target!(|data: &[u8]| {
    let p = meshwork_fuzz::parts(data, 3);
    let dir = meshwork_fuzz::scratch("configs");
    meshwork_fuzz::write_files(
        &dir,
        &[
            ("generation_config.json", p[0]),
            ("tokenizer_config.json", p[1]),
            ("messages.json", p[2]),
            ("tokenizer.json", TOKENIZER),
        ],
    );
    let _ = meshwork_train::hf::read_generation_config("init", &dir);
    let _ = meshwork_train::chat::chat_prompt_ids(
        &dir,
        &dir.join("tokenizer.json"),
        &dir.join("messages.json"),
    );
});
