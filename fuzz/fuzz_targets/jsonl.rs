//! Any bytes as `--data-jsonl` (GPT-2's case tokenizer, field `text`, context 4): rows
//! of the tokenizer's ids, or a refusal naming `--data-jsonl` (or the tokenizer, for
//! a document it cannot encode). Never a panic.

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let dir = meshwork_fuzz::scratch("jsonl");
    let path = dir.join("docs.jsonl");
    std::fs::write(&path, data).unwrap();
    let tokenizer = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../train/testdata/gpt2/tokenizer.json");
    match meshwork_train::tokenize::jsonl_rows(&path, "text", &tokenizer, 320, 4, 1 << 24) {
        Ok((n, rows)) => {
            assert_eq!(rows.len(), n * 5);
            assert!(rows.iter().all(|&id| (0..320).contains(&id)), "an id past 320");
        }
        Err(e) => {
            let m = e.to_string();
            assert!(
                m.starts_with("--data-jsonl: ")
                    || m.starts_with("--tokenizer: ")
                    || m.starts_with("--text: "),
                "{m}"
            );
        }
    }
});
