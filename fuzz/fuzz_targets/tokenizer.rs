//! Any `tokenizer.json` and text as `--tokenizer` loads and encodes them: ids of its
//! vocabulary, or a refusal naming `--tokenizer` — a panic inside the tokenizers crate
//! included, which meshwork contains. Never a panic out of meshwork.

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let p = meshwork_fuzz::parts(data, 2);
    let dir = meshwork_fuzz::scratch("tokenizer");
    let path = dir.join("tokenizer.json");
    std::fs::write(&path, p[0]).unwrap();
    let Ok(tokenizer) = meshwork_train::data::read_tokenizer(&path) else {
        return;
    };
    // A tokenizer that loads gives only ids of its vocabulary (its size checked on
    // load against every id it holds).
    let text = String::from_utf8_lossy(p[1]);
    if let Ok(ids) = meshwork_train::data::encode(&tokenizer, &text) {
        let vocab = tokenizer.get_vocab_size(true);
        assert!(ids.iter().all(|&i| (i as usize) < vocab), "an id past {vocab}: {ids:?}");
    }
});
