//! The rows a run reads: classification rows (features and class ids) for the MLP,
//! images and class ids for the CNN, token rows for the transformer — from `.npy`
//! files, a text file's bytes, or built in — and how a step's rows become its feeds.

use std::path::Path;

use meshwork_types::{DType, Tensor};
use ndarray::{Array2, Ix2};

use crate::rng::SplitMix;
use meshwork_io::npy;

use crate::{Error, Result};

/// A classification dataset: rows of features and their class ids.
#[derive(Debug, Clone, PartialEq)]
pub struct Classification {
    /// `[rows, features]`.
    pub x: Array2<f64>,
    /// The class of each row, `0..classes`.
    pub labels: Vec<usize>,
    /// Number of classes.
    pub classes: usize,
}

/// Rows, features and classes of the main job's built-in data.
pub const BUILT_IN_CLASSIFICATION: (usize, usize, usize) = (512, 8, 3);

impl Classification {
    /// The built-in data: `rows` Gaussian points in `features` dims, labelled by the
    /// arg-max of a fixed random teacher (`classes` classes), all from `seed`.
    pub fn synthetic(seed: u64, rows: usize, features: usize, classes: usize) -> Classification {
        let mut rng = SplitMix::new(seed ^ 0x6d65_7368_776f_726b);
        let x = Array2::from_shape_fn((rows, features), |_| rng.normal());
        let teacher = Array2::from_shape_fn((features, classes), |_| rng.normal());
        let scores = x.dot(&teacher);
        let labels = scores.outer_iter().map(|row| arg_max(row.iter().copied())).collect();
        Classification { x, labels, classes }
    }

    /// Rows.
    pub fn rows(&self) -> usize {
        self.x.nrows()
    }

    /// Features per row.
    pub fn features(&self) -> usize {
        self.x.ncols()
    }

    /// Reads features `[rows, features]` from `x` and labels (class ids `[rows]` or
    /// `[rows, 1]`, or one-hot `[rows, classes]`) from `y`, within `limit` bytes each.
    /// Without `classes` the largest label sets the classes, and may be at most twice
    /// the rows (a stray id would otherwise build a huge layer).
    pub fn from_npy(
        x: &Path,
        y: &Path,
        limit: u64,
        classes: Option<usize>,
    ) -> Result<Classification> {
        let xs = x.display();
        let xa = npy::read("--data-x", x, limit)?;
        if xa.ndim() != 2 {
            return Err(Error::flag(
                "data-x",
                format!("{xs} has shape {:?}; want [rows, features]", xa.shape()),
            ));
        }
        let xa: Array2<f64> = xa.into_dimensionality::<Ix2>().expect("rank 2");
        if xa.nrows() == 0 || xa.ncols() == 0 {
            return Err(Error::flag(
                "data-x",
                format!("{xs} holds no data (shape {:?})", xa.shape()),
            ));
        }
        if xa.iter().any(|v| !v.is_finite()) {
            return Err(Error::flag("data-x", format!("{xs} holds NaN or infinite values")));
        }
        let ya = npy::read("--data-y", y, limit)?;
        let (labels, classes) = labels_of(ya, y, xa.nrows(), classes)?;
        Ok(Classification { x: xa, labels, classes })
    }

    /// A CRC-32C of the rows, features, values and labels: what the main job's
    /// checkpoints recorded of their data before the one trainer.
    pub fn fingerprint(&self) -> u32 {
        let mut crc = crc32c::crc32c(&(self.rows() as u64).to_le_bytes());
        crc = crc32c::crc32c_append(crc, &(self.features() as u64).to_le_bytes());
        for v in &self.x {
            crc = crc32c::crc32c_append(crc, &v.to_le_bytes());
        }
        for &l in &self.labels {
            crc = crc32c::crc32c_append(crc, &(l as u64).to_le_bytes());
        }
        crc
    }
}

/// The class ids of `--data-y` (read as `ya` from `y`): ids `[rows]` or `[rows, 1]`, or
/// one-hot `[rows, classes]`, for `rows` rows of `--data-x`, and the classes (`classes`,
/// or the largest id + 1, at most twice the rows).
fn labels_of(
    ya: ndarray::ArrayD<f64>,
    y: &Path,
    rows: usize,
    classes: Option<usize>,
) -> Result<(Vec<usize>, usize)> {
    let ys = y.display();
    let ids = |y: ndarray::ArrayD<f64>| -> Result<Vec<usize>> {
        y.iter()
            .map(|&v| (v >= 0.0 && v.fract() == 0.0 && v < 1e15).then_some(v as usize))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| {
                Error::flag("data-y", format!("{ys}: class ids must be whole numbers ≥ 0"))
            })
    };
    let (labels, found) = match ya.shape() {
        // Class ids, or a column of them as `y.reshape(-1, 1)` saves them.
        [_] | [_, 1] => {
            let labels = ids(ya)?;
            let found = labels.iter().max().map_or(0, |m| m + 1);
            (labels, found)
        }
        [_, _] => {
            let onehot = ya.into_dimensionality::<Ix2>().expect("rank 2");
            let labels = onehot
                .outer_iter()
                .map(|row| {
                    let ones: Vec<usize> = row
                        .iter()
                        .enumerate()
                        .filter(|(_, v)| **v == 1.0)
                        .map(|(k, _)| k)
                        .collect();
                    (ones.len() == 1 && row.iter().all(|v| *v == 0.0 || *v == 1.0)).then(|| ones[0])
                })
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| {
                    Error::flag(
                        "data-y",
                        format!("{ys}: one-hot rows must hold one 1 and otherwise 0"),
                    )
                })?;
            (labels, onehot.ncols())
        }
        other => {
            return Err(Error::flag(
                "data-y",
                format!(
                    "{ys} has shape {other:?}; want class ids [rows] or [rows, 1], or one-hot [rows, classes]"
                ),
            ));
        }
    };
    if labels.len() != rows {
        return Err(Error::flag(
            "data-y",
            format!("{} labels for {} rows of --data-x", labels.len(), rows),
        ));
    }
    let classes = match classes {
        Some(c) if c < found => {
            return Err(Error::flag(
                "classes",
                format!("{c} classes, but {ys} holds class {} (ids count from 0)", found - 1),
            ));
        }
        Some(c) => c,
        None if found > 2 * labels.len() => {
            return Err(Error::flag(
                "data-y",
                format!(
                    "{ys} holds class {} but only {} rows: give --classes N if the model really has {found} classes",
                    found - 1,
                    labels.len()
                ),
            ));
        }
        None => found,
    };
    if classes < 2 {
        return Err(Error::flag("data-y", format!("{ys} has {classes} class; need at least 2")));
    }
    Ok((labels, classes))
}

/// Of the rows of `--data-x` (`[rows, …]`), those `wanted(rows)` marks, each read alone
/// and checked finite, with every row's label from `--data-y`: what one process of a
/// spread run reads. The rows read packed, and each row's place among them
/// (`u32::MAX`: not read).
pub(crate) struct SomeRows {
    /// Rows in the file.
    pub(crate) n: usize,
    /// Each row's dims (`[features]`, `[H, W, C]`).
    pub(crate) dims: Vec<usize>,
    pub(crate) x: Vec<f64>,
    pub(crate) index: Vec<u32>,
}

/// [`SomeRows`] of `x`, within `limit` bytes; `check(shape)` refuses a shape in its
/// words.
pub(crate) fn some_rows(
    x: &Path,
    limit: u64,
    check: &dyn Fn(&[usize]) -> std::result::Result<(), String>,
    wanted: &dyn Fn(usize) -> Vec<bool>,
) -> Result<SomeRows> {
    let xs = x.display();
    let (shape, rows, values) = npy::read_rows("--data-x", x, limit, &|shape: &[usize]| {
        check(shape)?;
        Ok(wanted(shape[0]))
    })?;
    if let Some((k, v)) = values.iter().enumerate().find(|(_, v)| !v.is_finite()) {
        let per = values.len() / rows.len().max(1);
        return Err(Error::flag(
            "data-x",
            format!(
                "{xs}: row {}, value {} is {v}, not a finite number",
                rows[k / per.max(1)],
                k % per.max(1)
            ),
        ));
    }
    let n = shape[0];
    let mut index = vec![u32::MAX; n];
    for (k, &r) in rows.iter().enumerate() {
        index[r] = k as u32;
    }
    Ok(SomeRows { n, dims: shape[1..].to_vec(), x: values, index })
}

/// The class ids of `--data-y` for `rows` rows ([`Classification::from_npy`]'s rules).
pub(crate) fn class_ids(
    y: &Path,
    rows: usize,
    classes: Option<usize>,
    limit: u64,
) -> Result<(Vec<usize>, usize)> {
    labels_of(npy::read("--data-y", y, limit)?, y, rows, classes)
}

/// The index of the first largest value.
fn arg_max(values: impl Iterator<Item = f64>) -> usize {
    values.enumerate().fold((0, f64::NEG_INFINITY), |b, (k, v)| if v > b.1 { (k, v) } else { b }).0
}

/// Images `[N, H, W, C]` as f64 and class ids `[N]`.
#[derive(Debug, Clone, PartialEq)]
pub struct Images {
    /// `[N, H, W, C]`.
    pub dims: [usize; 4],
    /// The pixels, row-major.
    pub x: Vec<f64>,
    /// The class ids.
    pub y: Vec<i32>,
    /// The classes.
    pub classes: usize,
}

impl Images {
    /// The built-in images: 512 8x8 one-channel images of 4 classes, a brighter quadrant
    /// each under noise, from `seed`.
    pub fn synthetic(seed: u64) -> Images {
        let (n, h, w) = (512, 8, 8);
        let mut rng = SplitMix::new(seed ^ 0x696d_6167_6573);
        let mut x = Vec::with_capacity(n * h * w);
        let mut y = Vec::with_capacity(n);
        for _ in 0..n {
            let k = rng.below(4);
            for r in 0..h {
                for c in 0..w {
                    let lit = usize::from(r >= h / 2) * 2 + usize::from(c >= w / 2) == k;
                    x.push(if lit { 0.5 } else { 0.0 } + 2.0 * (rng.uniform() - 0.5));
                }
            }
            y.push(k as i32);
        }
        Images { dims: [n, h, w, 1], x, y, classes: 4 }
    }

    /// Images `[N, H, W, C]` from `x` and class ids `[N]` (or `[N, 1]`) from `y`, within
    /// `limit` bytes each.
    pub fn from_npy(x: &Path, y: &Path, limit: u64) -> Result<Images> {
        let xs = x.display();
        let xa = npy::read("--data-x", x, limit)?;
        let [n, h, w, c] = xa.shape()[..] else {
            return Err(Error::flag(
                "data-x",
                format!("{xs} has shape {:?}; want [N, H, W, C]", xa.shape()),
            ));
        };
        if n == 0 || h < 2 || w < 2 || c == 0 {
            return Err(Error::flag(
                "data-x",
                format!("{xs}: images of shape {:?} are too small", xa.shape()),
            ));
        }
        if let Some((k, v)) = xa.iter().enumerate().find(|(_, v)| !v.is_finite()) {
            return Err(Error::flag(
                "data-x",
                format!("{xs}: value {k} (flat) is {v}, not a finite number"),
            ));
        }
        let (labels, classes) = image_labels(y, n, limit)?;
        Ok(Images { dims: [n, h, w, c], x: xa.iter().copied().collect(), y: labels, classes })
    }
}

/// The class ids of a CNN's `--data-y` for `n` images: `[n]` or `[n, 1]` ids below
/// 65536, the classes their largest + 1 (at least 2, at most twice the images).
pub(crate) fn image_labels(y: &Path, n: usize, limit: u64) -> Result<(Vec<i32>, usize)> {
    let ys = y.display();
    let ya = npy::read("--data-y", y, limit)?;
    if ya.shape() != [n] && ya.shape() != [n, 1] {
        return Err(Error::flag(
            "data-y",
            format!("{ys} has shape {:?}; want [{n}] (or [{n}, 1])", ya.shape()),
        ));
    }
    let mut labels = Vec::with_capacity(n);
    for (i, &v) in ya.iter().enumerate() {
        if v.fract() != 0.0 || !(0.0..65536.0).contains(&v) {
            return Err(Error::flag("data-y", format!("{ys}: row {i} holds {v}, not a class id")));
        }
        labels.push(v as i32);
    }
    let classes = labels.iter().copied().max().unwrap_or(0) as usize + 1;
    if classes < 2 {
        return Err(Error::flag("data-y", format!("{ys} holds one class")));
    }
    // The classes are the largest id + 1; one stray id must not build a head of
    // thousands of classes that no row has.
    if classes > 2 * n {
        return Err(Error::flag(
            "data-y",
            format!(
                "{ys}: the largest class id {} is more than twice the {n} rows; is it a stray label?",
                classes - 1
            ),
        ));
    }
    Ok((labels, classes))
}

/// Rows of the built-in token data.
pub const BUILT_IN_ROWS: usize = 512;

/// Token rows `[N, T + 1]` of a vocabulary of `vocab`: the built-in rows (a noisy affine
/// sequence a model can learn: each token is 3·previous + 1 mod V, one in eight random),
/// from `seed`.
pub fn token_rows_synthetic(seed: u64, vocab: usize, seq: usize) -> (usize, Vec<i32>) {
    let mut rng = SplitMix::new(seed ^ 0x746f_6b65_6e73);
    let width = seq + 1;
    let v = vocab;
    let mut tokens = Vec::with_capacity(BUILT_IN_ROWS * width);
    for _ in 0..BUILT_IN_ROWS {
        let mut t = rng.below(v);
        for _ in 0..width {
            tokens.push(t as i32);
            t = if rng.uniform() < 0.125 { rng.below(v) } else { (3 * t + 1) % v };
        }
    }
    (BUILT_IN_ROWS, tokens)
}

/// Token rows `[N, T + 1]` of a text file's bytes (tokens of a vocabulary of 256): row
/// `i` is bytes `i·T … i·T + T`. The bytes and their tokens (4 bytes each, `(T + 1)/T`
/// of them a byte) are held at once within `limit` bytes, so at most
/// `limit · T / (5T + 4)` bytes are read.
pub fn token_rows_of_text(path: &Path, seq: usize, limit: u64) -> Result<(usize, Vec<i32>)> {
    let seq_bytes = seq.max(1) as u128;
    let read_limit = (u128::from(limit) * seq_bytes / (5 * seq_bytes + 4)) as u64;
    let bytes = crate::files::read_file("text", path, read_limit)?;
    let width = seq + 1;
    let n = bytes.len().saturating_sub(1) / seq;
    if n == 0 {
        return Err(Error::flag(
            "text",
            format!(
                "{} has {} bytes: fewer than one row of --seq {seq} + 1",
                path.display(),
                bytes.len()
            ),
        ));
    }
    let mut tokens = Vec::with_capacity(n * width);
    for i in 0..n {
        let row = &bytes[i * seq..i * seq + width];
        tokens.extend(row.iter().map(|&b| i32::from(b)));
    }
    Ok((n, tokens))
}

/// The most bytes of a `tokenizer.json` read (real ones are a few MB; the cap is the
/// reader's own, not `--max-memory`'s).
pub const MAX_TOKENIZER_BYTES: u64 = 64 << 20;

/// A Hugging Face `tokenizer.json` (`--tokenizer`), read within
/// [`MAX_TOKENIZER_BYTES`], checked ([`check_tokenizer_json`]), its truncation and
/// padding (if it was saved with any) turned off. A panic of the `tokenizers` crate
/// while loading it is `--tokenizer`'s error.
pub fn read_tokenizer(path: &Path) -> Result<tokenizers::Tokenizer> {
    Ok(read_tokenizer_hashed(path)?.0)
}

/// [`read_tokenizer`], and the SHA-256 of the bytes it was made from.
pub fn read_tokenizer_hashed(path: &Path) -> Result<(tokenizers::Tokenizer, [u8; 32])> {
    use sha2::Digest;
    let bytes = crate::files::read_input("--tokenizer", path, MAX_TOKENIZER_BYTES)?;
    let sha: [u8; 32] = sha2::Sha256::digest(&bytes).into();
    let shown = path.display();
    let json: serde_json::Value = serde_json::from_slice(&bytes)
        .map_err(|e| Error::flag("tokenizer", format!("{shown} is not a tokenizer.json: {e}")))?;
    let mut tokenizer = guarded(|| tokenizers::Tokenizer::from_bytes(&bytes))?.map_err(|e| {
        Error::flag(
            "tokenizer",
            format!("{shown} is not a tokenizer.json: {}", one_line(&e.to_string())),
        )
    })?;
    check_tokenizer_json(&json, tokenizer.get_vocab_size(true))
        .map_err(|p| Error::flag("tokenizer", format!("{shown}: {p}")))?;
    // A file saved with truncation or padding would cut or pad a training text.
    tokenizer
        .with_truncation(None)
        .map_err(|e| Error::flag("tokenizer", format!("{shown}: {e}")))?;
    tokenizer.with_padding(None);
    Ok((tokenizer, sha))
}

/// Checks what the `tokenizers` crate takes on trust in a `tokenizer.json` and would
/// panic on, or give ids past its vocabulary for, later: every id its model's
/// vocabulary and its added tokens hold is below `vocab` (the size the tokenizer
/// reports, added tokens included); every special token a `TemplateProcessing`
/// post-processor's templates name (in a `Sequence` too) is defined in its
/// `special_tokens`, and every id there is below `vocab` too.
pub fn check_tokenizer_json(json: &serde_json::Value, vocab: usize) -> Result<(), String> {
    let past = |id: &serde_json::Value| id.as_u64().is_none_or(|i| (i as usize) >= vocab);
    if let Some(map) = json.pointer("/model/vocab").and_then(serde_json::Value::as_object)
        && let Some((token, id)) = map.iter().find(|(_, id)| past(id))
    {
        return Err(format!(
            "its vocabulary gives {token:?} the id {id}, outside its {vocab} ids (0..{vocab})"
        ));
    }
    let added = json.get("added_tokens").and_then(serde_json::Value::as_array);
    if let Some(t) = added.into_iter().flatten().find(|t| past(&t["id"])) {
        return Err(format!(
            "its added token {} has the id {}, outside its {vocab} ids (0..{vocab})",
            t["content"], t["id"]
        ));
    }
    fn walk(p: &serde_json::Value, vocab: usize) -> Result<(), String> {
        match p.get("type").and_then(serde_json::Value::as_str) {
            Some("Sequence") => {
                for q in
                    p.get("processors").and_then(serde_json::Value::as_array).into_iter().flatten()
                {
                    walk(q, vocab)?;
                }
            }
            Some("TemplateProcessing") => {
                let specials = p.get("special_tokens").and_then(serde_json::Value::as_object);
                for (key, token) in specials.into_iter().flatten() {
                    let ids = token.get("ids").and_then(serde_json::Value::as_array);
                    for id in ids.into_iter().flatten() {
                        match id.as_u64() {
                            Some(i) if (i as usize) < vocab => {}
                            _ => {
                                return Err(format!(
                                    "its post-processor's special token {key:?} has id {id}, \
                                     outside the vocabulary of {vocab}"
                                ));
                            }
                        }
                    }
                }
                for template in ["single", "pair"] {
                    let pieces = p.get(template).and_then(serde_json::Value::as_array);
                    for piece in pieces.into_iter().flatten() {
                        let name = piece
                            .get("SpecialToken")
                            .and_then(|t| t.get("id"))
                            .and_then(serde_json::Value::as_str);
                        if let Some(name) = name
                            && !specials.is_some_and(|s| s.contains_key(name))
                        {
                            return Err(format!(
                                "its post-processor's {template} template names the special \
                                 token {name:?}, which its special_tokens do not define"
                            ));
                        }
                    }
                }
            }
            _ => {}
        }
        Ok(())
    }
    match json.get("post_processor") {
        Some(p) if !p.is_null() => walk(p, vocab),
        _ => Ok(()),
    }
}

/// `text` on one line: a library's error may span several.
fn one_line(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

std::thread_local! {
    /// Whether this thread is inside [`guarded`], whose panics are reported as errors.
    static GUARDED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `f`, a call into the `tokenizers` crate: a panic in it (a malformed
/// tokenizer the crate trusted) becomes `--tokenizer`'s one-line error instead of
/// ending the process, and prints nothing. Panics elsewhere are reported as before.
pub(crate) fn guarded<T>(f: impl FnOnce() -> T) -> Result<T> {
    static HOOK: std::sync::Once = std::sync::Once::new();
    HOOK.call_once(|| {
        let before = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if !GUARDED.with(std::cell::Cell::get) {
                before(info);
            }
        }));
    });
    let was = GUARDED.with(|g| g.replace(true));
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    GUARDED.with(|g| g.set(was));
    result.map_err(|panic| {
        let why = panic
            .downcast_ref::<&str>()
            .map(|s| (*s).to_string())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "no message".into());
        Error::flag(
            "tokenizer",
            format!("the tokenizers library failed on this tokenizer ({})", one_line(&why)),
        )
    })
}

/// The ids `tokenizer` gives `text` (as the `tokenizers` library's `encode(text)`,
/// special tokens as its post-processor adds them).
pub fn encode(tokenizer: &tokenizers::Tokenizer, text: &str) -> Result<Vec<u32>> {
    let encoding = guarded(|| tokenizer.encode(text, true))?.map_err(|e| {
        Error::flag("tokenizer", format!("cannot encode the text: {}", one_line(&e.to_string())))
    })?;
    Ok(encoding.get_ids().to_vec())
}

/// Of the token rows `[N, T + 1]` of a `.npy` file, only those `wanted(N)` marks, read
/// alone (each row's bytes, nothing else of the data), checked as
/// [`token_rows_of_npy`] checks them: `N`, the rows read packed, and each row's place
/// among them (`u32::MAX`: not read). Within `limit` bytes of the rows read.
pub(crate) fn token_rows_of_npy_wanted(
    flag: &str,
    path: &Path,
    (vocab, seq): (usize, usize),
    limit: u64,
    wanted: &dyn Fn(usize) -> Vec<bool>,
) -> Result<(usize, Vec<i32>, Vec<u32>)> {
    let width = seq + 1;
    let shown = path.display();
    let (shape, rows, x) =
        npy::read_rows(&format!("--{flag}"), path, limit, &|shape: &[usize]| {
            if shape.len() != 2 || shape[1] != width || shape[0] == 0 {
                return Err(format!(
                    "{shown} has shape {shape:?}; want [rows, {width}] (--seq {seq} + 1)"
                ));
            }
            Ok(wanted(shape[0]))
        })?;
    let n = shape[0];
    let mut index = vec![u32::MAX; n];
    let mut tokens = Vec::with_capacity(x.len());
    for (k, &r) in rows.iter().enumerate() {
        index[r] = k as u32;
        for (c, &t) in x[k * width..(k + 1) * width].iter().enumerate() {
            if t.fract() != 0.0 || t < 0.0 || t >= vocab as f64 {
                return Err(Error::flag(
                    flag,
                    format!(
                        "{shown}: row {r}, column {c} holds {t}, not a token id below --vocab {vocab}"
                    ),
                ));
            }
            tokens.push(t as i32);
        }
    }
    Ok((n, tokens, index))
}

/// Token rows `[N, T + 1]` of ids below `vocab` from a `.npy` file, within `limit` bytes.
pub fn token_rows_of_npy(
    path: &Path,
    vocab: usize,
    seq: usize,
    limit: u64,
) -> Result<(usize, Vec<i32>)> {
    let width = seq + 1;
    let shown = path.display();
    let x = npy::read("--data-tokens", path, limit)?;
    let shape = x.shape().to_vec();
    if shape.len() != 2 || shape[1] != width || shape[0] == 0 {
        return Err(Error::flag(
            "data-tokens",
            format!("{shown} has shape {shape:?}; want [rows, {width}] (--seq {seq} + 1)"),
        ));
    }
    let mut tokens = Vec::with_capacity(x.len());
    for (k, &t) in x.iter().enumerate() {
        if t.fract() != 0.0 || t < 0.0 || t >= vocab as f64 {
            return Err(Error::flag(
                "data-tokens",
                format!(
                    "{shown}: row {}, column {} holds {t}, not a token id below --vocab {vocab}",
                    k / width,
                    k % width
                ),
            ));
        }
        tokens.push(t as i32);
    }
    Ok((shape[0], tokens))
}

/// The rows a run reads, as the model takes them.
#[derive(Debug, Clone)]
pub(crate) enum Examples {
    /// Token rows `[N, T+1]`: all of them, or (`index`) only the rows a process of a
    /// spread run trains on, row `r` at `index[r]` of `tokens` (`u32::MAX`: not read,
    /// fed as zeros to the positions of other processes, which drop them).
    Tokens { width: usize, tokens: Vec<i32>, index: Option<Vec<u32>> },
    /// Inputs `[N, dims…]` (images, features) and class ids: every row's inputs, or
    /// (`index`, as for tokens) only those of the rows a process trains on.
    Images { per: usize, dims: Vec<usize>, x: Vec<f64>, y: Vec<i32>, index: Option<Vec<u32>> },
}

impl Examples {
    /// A CRC-32C of the rows (their values, labels and shape): a resumed run tells
    /// whether it reads the data the checkpoint's run read.
    ///
    /// `None` for rows read in part (a process of a spread run).
    pub(crate) fn fingerprint(&self) -> Option<u32> {
        match self {
            Examples::Tokens { index: Some(_), .. } => None,
            Examples::Tokens { width, tokens, index: None } => {
                let crc = crc32c::crc32c(&(*width as u64).to_le_bytes());
                Some(tokens.iter().fold(crc, |c, t| crc32c::crc32c_append(c, &t.to_le_bytes())))
            }
            Examples::Images { index: Some(_), .. } => None,
            Examples::Images { dims, x, y, index: None, .. } => {
                let crc = dims
                    .iter()
                    .fold(0, |c, d| crc32c::crc32c_append(c, &(*d as u64).to_le_bytes()));
                let crc = x.iter().fold(crc, |c, v| crc32c::crc32c_append(c, &v.to_le_bytes()));
                Some(y.iter().fold(crc, |c, l| crc32c::crc32c_append(c, &l.to_le_bytes())))
            }
        }
    }

    /// Whether row `r` was read (every row, unless only a process's rows were).
    pub(crate) fn has(&self, r: usize) -> bool {
        match self {
            Examples::Tokens { index: Some(index), .. }
            | Examples::Images { index: Some(index), .. } => {
                index.get(r).is_some_and(|&k| k != u32::MAX)
            }
            _ => true,
        }
    }

    /// The feeds of rows `idx`: token rows `i32[B, T+1]`, or inputs of `dtype` and
    /// class ids `i32[B]`.
    pub(crate) fn batch(&self, idx: &[usize], dtype: DType) -> Result<Vec<Tensor>> {
        let failed = |e: meshwork_types::Error| Error::failed(e);
        match self {
            Examples::Tokens { width, tokens, index } => {
                let mut out = Vec::with_capacity(idx.len() * width);
                for &r in idx {
                    let at = match index {
                        None => Some(r),
                        Some(index) => {
                            index.get(r).filter(|&&k| k != u32::MAX).map(|&k| k as usize)
                        }
                    };
                    match at {
                        Some(k) => out.extend_from_slice(&tokens[k * width..(k + 1) * width]),
                        None => out.extend(std::iter::repeat_n(0, *width)),
                    }
                }
                Ok(vec![Tensor::i32(&[idx.len(), *width], out).map_err(failed)?])
            }
            Examples::Images { per, dims, x, y, index } => {
                let mut xs = Vec::with_capacity(idx.len() * per);
                for &r in idx {
                    let at = match index {
                        None => Some(r),
                        Some(index) => {
                            index.get(r).filter(|&&k| k != u32::MAX).map(|&k| k as usize)
                        }
                    };
                    match at {
                        Some(k) => xs.extend_from_slice(&x[k * per..(k + 1) * per]),
                        None => xs.extend(std::iter::repeat_n(0.0, *per)),
                    }
                }
                let mut shape = vec![idx.len()];
                shape.extend(dims);
                let x = Tensor::from_f64(dtype, &shape, &xs).map_err(failed)?;
                let ys = idx.iter().map(|&r| y[r]).collect();
                Ok(vec![x, Tensor::i32(&[idx.len()], ys).map_err(failed)?])
            }
        }
    }
}

#[cfg(test)]
mod tests {
    /// A panic inside a guarded call (the tokenizers crate trusting a bad file) is
    /// `--tokenizer`'s one-line error; the process goes on, and a panic outside a
    /// guard still reaches the hook as before.
    #[test]
    fn a_panic_in_the_tokenizer_library_is_an_error() {
        let e = super::guarded(|| -> u32 { panic!("no such\nspecial token") }).unwrap_err();
        let e = e.to_string();
        assert!(e.starts_with("--tokenizer: ") && !e.contains('\n'), "{e}");
        assert!(e.contains("no such special token"), "{e}");
        assert_eq!(super::guarded(|| 7).unwrap(), 7);
    }
}
