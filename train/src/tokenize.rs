//! Text into token rows through a Hugging Face tokenizer: encoded in chunks (the same
//! ids as encoding the whole text), and cached as `.npy` rows keyed by what made them.
//!
//! **Chunks.** A text longer than [`CHUNK_BYTES`] is read and encoded a chunk at a
//! time, so the tokenizer never holds more than a chunk's working state; only the
//! ids accumulate. A chunk ends just after a newline that sits between two ASCII
//! non-space characters (`…x\ny…`): there a byte-level BPE's pre-tokenizer (GPT-2's
//! regex) splits whatever follows, so the ids on each side are those of the whole
//! text. Each cut is also checked, with the tokenizer itself, on the text around it:
//! the ids of a window across the cut must be those of its two sides. A tokenizer for
//! which no cut checks out (one that adds a prefix space to every input, say) or whose
//! post-processor adds special tokens is given the whole text at once.
//!
//! **Cache.** [`token_rows`] with a cache directory keys the rows by the SHA-256 of
//! the text bytes that were encoded, of the `tokenizer.json` and the row width, and
//! keeps them as `tokens-<key>-<crc32c of the rows>.npy` there (written whole or not
//! at all): a second run over the same text reads the rows back instead of encoding
//! again, after checking them against the checksum (a damaged entry is encoded again
//! and replaced, with a warning). Nothing is ever written next to the user's files.

use std::io::Read;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};
use tokenizers::Tokenizer;

use crate::data::read_tokenizer;
use crate::files::{open_regular, write_atomic};
use crate::{Error, Result};

/// Bytes of text a chunk holds (at least; a chunk ends at the next place it may be
/// cut).
pub const CHUNK_BYTES: usize = 1 << 20;

/// The longest row `meshwork tokenize` cuts (`--seq`).
pub const MAX_SEQ: usize = 1 << 24;

/// Bytes around a cut the check encodes on each side.
const WINDOW: usize = 512;

/// Cuts tried before a tokenizer is taken to be one whose text cannot be cut.
const TRIES: usize = 8;

/// Bytes each id takes: the ids (u32) and the rows made of them (i32).
const BYTES_PER_ID: u64 = 8;

/// Text encoded whole may take this share of `--max-memory` (the tokenizer's working
/// state is many times the text).
const WHOLE_TEXT_SHARE: u64 = 10;

/// Bytes of the tokenizer's working memory per byte of text, at least: its
/// normalized string and that string's alignments (16 bytes a byte) held twice over
/// (the normalizer's and the pre-tokenizer's splits), and each token's id, type, mask,
/// offsets, word and string (about 120 bytes a token).
fn working_bytes(normalized: usize, tokens: usize, text: usize) -> f64 {
    let text = text.max(1) as f64;
    1.0 + 2.0 * 17.0 * normalized as f64 / text + 120.0 * tokens as f64 / text
}

/// The tokenizer's working memory per byte of the text file `file` (of `len` bytes),
/// measured on samples of it (its start, middle and end): the most of them, and
/// never under [`WHOLE_TEXT_SHARE`]. Each sample is normalized small first (64 bytes),
/// and at full size (4 KiB) only where the small one shows that fits `limit`: a
/// normalizer that expands text a thousandfold is measured, not run on megabytes.
fn expansion(tokenizer: &Tokenizer, file: &std::fs::File, len: u64, limit: u64) -> Result<f64> {
    use std::os::unix::fs::FileExt;
    use tokenizers::{NormalizedString, Normalizer};
    let mut most = WHOLE_TEXT_SHARE as f64;
    // Sixteen windows spread over the text, its first and last bytes among them.
    let span = len.saturating_sub(4096);
    for at in (0..16u64).map(|k| span.saturating_mul(k) / 15) {
        for size in [64usize, 4096] {
            let mut buf = vec![0u8; size.min(len.saturating_sub(at) as usize)];
            let got = file.read_at(&mut buf, at).unwrap_or(0);
            buf.truncate(got);
            // Whole characters only.
            let start = buf.iter().position(|&b| (b & 0xC0) != 0x80).unwrap_or(buf.len());
            let text = match std::str::from_utf8(&buf[start..]) {
                Ok(t) => t,
                Err(e) => std::str::from_utf8(&buf[start..start + e.valid_up_to()]).unwrap_or(""),
            };
            if text.is_empty() {
                break;
            }
            let normalized = match tokenizer.get_normalizer() {
                Some(n) => {
                    let mut s = NormalizedString::from(text);
                    crate::data::guarded(|| n.normalize(&mut s))?.map_err(|e| {
                        Error::flag("tokenizer", format!("cannot normalize the text: {e}"))
                    })?;
                    s.get().len()
                }
                None => text.len(),
            };
            let tokens = if normalized as f64 * 64.0 > limit as f64 {
                0
            } else {
                ids_of(tokenizer, text, false)?.len()
            };
            let w = working_bytes(normalized, tokens, text.len());
            most = most.max(w);
            // The full-size sample only where this one's expansion leaves room for it.
            if w * 4096.0 * 4.0 > limit as f64 {
                break;
            }
        }
    }
    Ok(most)
}

/// Whether `b` may be cut at `at`: just after a newline between ASCII non-space
/// characters (`x\n|y`), or just before a line end `\n` or `\r\n` that follows one
/// and precedes another (`x|\r\ny`).
fn cut_at(b: &[u8], at: usize) -> bool {
    let graphic = |i: usize| b.get(i).is_some_and(u8::is_ascii_graphic);
    if at < 1 || at >= b.len() {
        return false;
    }
    let after = at >= 2 && b[at - 1] == b'\n' && graphic(at - 2) && graphic(at);
    let before = graphic(at - 1)
        && ((b[at] == b'\n' && graphic(at + 1))
            || (b[at] == b'\r' && b.get(at + 1) == Some(&b'\n') && graphic(at + 2)));
    after || before
}

/// The ids `tokenizer` gives `text`, `specials` saying whether its post-processor's
/// special tokens are added.
fn ids_of(tokenizer: &Tokenizer, text: &str, specials: bool) -> Result<Vec<u32>> {
    let encoding = crate::data::guarded(|| tokenizer.encode(text, specials))?
        .map_err(|e| Error::flag("tokenizer", format!("cannot encode the text: {e}")))?;
    Ok(encoding.get_ids().to_vec())
}

/// `bytes` as text, or `--text`'s error naming the file and the byte offset `at` of
/// the chunk.
fn utf8<'b>(bytes: &'b [u8], path: &Path, at: u64) -> Result<&'b str> {
    std::str::from_utf8(bytes).map_err(|e| {
        let offset = at + e.valid_up_to() as u64;
        Error::flag("text", format!("{} is not UTF-8 at byte {offset}", path.display()))
    })
}

/// Whether the text cut at `at` encodes on each side as across it, on a window of
/// [`WINDOW`] bytes each way (both ends moved back to character boundaries).
fn cut_checks(tokenizer: &Tokenizer, b: &[u8], at: usize) -> Result<bool> {
    let boundary = |mut i: usize| {
        while i > 0 && i < b.len() && (b[i] & 0xC0) == 0x80 {
            i -= 1;
        }
        i
    };
    let (start, end) = (boundary(at.saturating_sub(WINDOW)), boundary((at + WINDOW).min(b.len())));
    let (Ok(left), Ok(right)) =
        (std::str::from_utf8(&b[start..at]), std::str::from_utf8(&b[at..end]))
    else {
        return Ok(false);
    };
    let mut sides = ids_of(tokenizer, left, false)?;
    sides.extend(ids_of(tokenizer, right, false)?);
    let whole = format!("{left}{right}");
    Ok(ids_of(tokenizer, &whole, false)? == sides)
}

/// A text file's ids, and how many pieces it was encoded in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Encoded {
    /// The ids, as encoding the whole text gives them.
    pub ids: Vec<u32>,
    /// The pieces the text was encoded in (1: whole).
    pub chunks: usize,
    /// SHA-256 of the bytes encoded (those read, however the file changed meanwhile).
    pub text_sha: [u8; 32],
}

/// The ids `tokenizer` gives the text file `path` (as encoding it whole, special
/// tokens included), read and encoded `chunk` bytes at a time where it can be cut;
/// the ids held are bounded by `limit` bytes (`--max-memory`) as they accumulate.
pub fn encode_file(
    tokenizer: &Tokenizer,
    path: &Path,
    chunk: usize,
    limit: u64,
) -> Result<Encoded> {
    let chunk = chunk.max(1);
    let (file, len) = open_regular("--text", path)?;
    let too_many = |n: usize| {
        Error::usage(format!(
            "--text {}: its {n} token ids and their rows need more than --max-memory {limit} bytes",
            path.display()
        ))
    };
    // Special tokens added around every input would be added around every chunk.
    let specials = ids_of(tokenizer, "a\nb", true)? != ids_of(tokenizer, "a\nb", false)?;
    // What the tokenizer takes per byte of this text, measured: chunks are made small
    // enough for it, and a text encoded whole must fit it, or the run is refused here
    // (never an allocation failure later).
    let per_byte = expansion(tokenizer, &file, len, limit)?;
    let fitting = (limit as f64 / per_byte) as u64;
    let chunk = chunk.min(usize::try_from(fitting).unwrap_or(usize::MAX)).max(1);
    if fitting < 4 * WINDOW as u64 {
        return Err(Error::usage(format!(
            "--text {}: this tokenizer takes about {per_byte:.0} bytes of memory per byte of \
             this text (its normalizer expands it); --max-memory {limit} leaves no room to \
             encode it",
            path.display()
        )));
    }
    let chunked = !specials && len > chunk as u64;
    let mut reader = file.take(u64::MAX);
    let mut sha = Sha256::new();
    let mut ids: Vec<u32> = Vec::new();
    let mut buf: Vec<u8> = Vec::new();
    let mut consumed: u64 = 0;
    let mut chunks = 1;
    let mut cuttable = chunked;
    loop {
        // Read a chunk more (or, once chunks are off, everything), within the limit.
        // Text given to the tokenizer whole takes it tens of bytes a byte (its tokens'
        // strings, offsets and words), so such text may take a tenth of the limit.
        let want = if cuttable { chunk } else { usize::MAX };
        let before = buf.len();
        let budget = if cuttable { limit } else { fitting };
        let room = budget.saturating_sub(buf.len() as u64 + ids.len() as u64 * BYTES_PER_ID);
        let take = (want as u64).min(room.saturating_add(1));
        (&mut reader)
            .take(take)
            .read_to_end(&mut buf)
            .map_err(|e| Error::usage(format!("--text: cannot read {}: {e}", path.display())))?;
        sha.update(&buf[before..]);
        let ended = buf.len() - before < take as usize || take == 0;
        if buf.len() as u64 + ids.len() as u64 * BYTES_PER_ID > budget {
            let whole = if cuttable {
                String::new()
            } else {
                format!(
                    " (this text is encoded whole, which takes about {per_byte:.0} bytes a byte)"
                )
            };
            return Err(Error::usage(format!(
                "--text {}: the text and its ids need more than --max-memory {limit} bytes{whole}",
                path.display()
            )));
        }
        if ended {
            let text = utf8(&buf, path, consumed)?;
            ids.extend(ids_of(tokenizer, text, specials)?);
            if ids.len() as u64 * BYTES_PER_ID > limit {
                return Err(too_many(ids.len()));
            }
            return Ok(Encoded { ids, chunks, text_sha: sha.finalize().into() });
        }
        if !cuttable {
            continue;
        }
        // The last cut that checks out, trying at most TRIES from the end, among the
        // places a whole window of text now follows (earlier ones were tried when
        // their window came in).
        let mut tried = 0;
        let mut cut = None;
        let mut at = buf.len().saturating_sub(WINDOW);
        let lower = before.saturating_sub(WINDOW + 2);
        while at > lower && tried < TRIES {
            at -= 1;
            if cut_at(&buf, at) {
                tried += 1;
                if cut_checks(tokenizer, &buf, at)? {
                    cut = Some(at);
                    break;
                }
            }
        }
        match cut {
            Some(at) => {
                let text = utf8(&buf[..at], path, consumed)?;
                ids.extend(ids_of(tokenizer, text, false)?);
                if ids.len() as u64 * BYTES_PER_ID > limit {
                    return Err(too_many(ids.len()));
                }
                buf.drain(..at);
                consumed += at as u64;
                chunks += 1;
            }
            // Places to cut were found and none encodes as the whole text: this
            // tokenizer's text is not cut.
            None if tried == TRIES => cuttable = false,
            None => {}
        }
    }
}

/// Every id below `vocab`, else `--tokenizer`'s error.
fn check_vocab(ids: &[u32], vocab: usize) -> Result<()> {
    match ids.iter().find(|&&id| id as usize >= vocab) {
        Some(&bad) => Err(Error::flag(
            "tokenizer",
            format!("it gives id {bad}, past the model's vocabulary of {vocab}"),
        )),
        None => Ok(()),
    }
}

/// Rows `[N, T + 1]` of `ids`: consecutive, non-overlapping, the tail dropped; every
/// id below `vocab` (else `--tokenizer`'s error). `what` names the source in the
/// error for too few ids.
fn rows_of(ids: &[u32], vocab: usize, seq: usize, what: &str) -> Result<(usize, Vec<i32>)> {
    check_vocab(ids, vocab)?;
    let width = seq + 1;
    let n = ids.len() / width;
    if n == 0 {
        return Err(Error::flag(
            "text",
            format!(
                "{what} encodes to {} tokens: fewer than one row of --seq {seq} + 1",
                ids.len()
            ),
        ));
    }
    let mut tokens = Vec::new();
    tokens
        .try_reserve_exact(n * width)
        .map_err(|_| Error::usage("--max-memory: no room for the rows"))?;
    tokens.extend(ids[..n * width].iter().map(|&id| id as i32));
    Ok((n, tokens))
}

/// The cache key of text and tokenizer bytes of these SHA-256s cut into rows of
/// `width`, in hex.
fn key_of(text_sha: &[u8], tokenizer_sha: &[u8], width: usize) -> String {
    let mut hash = Sha256::new();
    // What made the rows: this way of cutting, and the tokenizers crate's version.
    hash.update(b"meshwork token rows v2; tokenizers 0.23\n");
    hash.update(text_sha);
    hash.update(tokenizer_sha);
    hash.update((width as u64).to_le_bytes());
    hash.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// SHA-256 of the regular file `path` (`flag` names it in an error), streamed.
fn sha_of_file(flag: &str, path: &Path) -> Result<[u8; 32]> {
    let (mut file, _) = open_regular(flag, path)?;
    let mut hash = Sha256::new();
    let mut block = vec![0u8; 1 << 16];
    loop {
        let n = file
            .read(&mut block)
            .map_err(|e| Error::usage(format!("{flag}: cannot read {}: {e}", path.display())))?;
        if n == 0 {
            break;
        }
        hash.update(&block[..n]);
    }
    Ok(hash.finalize().into())
}

/// The cache key of the text file `text` encoded by the tokenizer file `tokenizer`
/// into rows of `width`: of the SHA-256s of both files' bytes as they are now, and
/// the width. (Rows are stored under the key of the bytes that were encoded.)
pub fn cache_key(text: &Path, tokenizer: &Path, width: usize) -> Result<String> {
    Ok(key_of(&sha_of_file("--text", text)?, &sha_of_file("--tokenizer", tokenizer)?, width))
}

/// The CRC-32C of rows of ids, as their little-endian bytes.
fn rows_crc(tokens: &[i32]) -> u32 {
    let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
    crc32c::crc32c(&bytes)
}

/// Where rows of `key` whose checksum is `crc` are cached under `dir`: the checksum
/// is in the name, so that the entry and its check are one file.
pub fn cache_file(dir: &Path, key: &str, crc: u32) -> PathBuf {
    dir.join(format!("tokens-{key}-{crc:08x}.npy"))
}

/// The cache entry of `key` under `dir`, if there is one, and the checksum its name
/// records (`None` for a name that records none).
pub fn cached_entry(dir: &Path, key: &str) -> Option<(PathBuf, Option<u32>)> {
    let prefix = format!("tokens-{key}-");
    std::fs::read_dir(dir).ok()?.flatten().find_map(|e| {
        let name = e.file_name().into_string().ok()?;
        let crc = name.strip_prefix(&prefix)?.strip_suffix(".npy")?;
        Some((e.path(), u32::from_str_radix(crc, 16).ok().filter(|_| crc.len() == 8)))
    })
}

/// meshwork's folder in the user's cache directory (`$XDG_CACHE_HOME/meshwork`, else
/// `~/.cache/meshwork`); `None` when neither variable says where that is.
pub fn default_cache_dir() -> Option<PathBuf> {
    let base = std::env::var_os("XDG_CACHE_HOME")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME")
                .filter(|v| !v.is_empty())
                .map(|h| PathBuf::from(h).join(".cache"))
        })?;
    Some(base.join("meshwork"))
}

/// `rows` (`[n, width]` ids) as `.npy` bytes of little-endian i32.
pub fn npy_bytes(n: usize, width: usize, rows: &[i32]) -> Vec<u8> {
    meshwork_io::npy::encode(&[n, width], rows).expect("n rows of width ids")
}

/// What [`token_rows`] did: the rows, and whether they came from the cache.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenRows {
    /// Rows.
    pub n: usize,
    /// `n × (T + 1)` ids, row after row.
    pub tokens: Vec<i32>,
    /// The cache file read or written (`None` without a cache directory, or when it
    /// could not be written: the rows are then used without it).
    pub cached: Option<PathBuf>,
    /// Whether the rows were read from the cache.
    pub hit: bool,
    /// A cache entry found damaged (its rows not those its checksum records) and
    /// replaced: one line to show the user.
    pub warning: Option<String>,
}

/// Token rows `[N, T + 1]` of the text file `text` encoded by `tokenizer` (`--text
/// FILE --tokenizer tokenizer.json --seq T`): the whole text's ids ([`encode_file`])
/// cut into consecutive, non-overlapping rows of `T + 1`, the tail dropped, every id
/// below `vocab`. With `cache`, rows cached by an earlier run of the same text,
/// tokenizer and `T` are read back (checked as `--data-tokens` is), and new ones are
/// written there (a failure to write costs only the cache). Within `limit` bytes.
pub fn token_rows(
    text: &Path,
    tokenizer: &Path,
    vocab: usize,
    seq: usize,
    limit: u64,
    cache: Option<&Path>,
) -> Result<TokenRows> {
    let width = seq + 1;
    let mut warning = None;
    if let Some(dir) = cache {
        let key = cache_key(text, tokenizer, width)?;
        if let Some(rows) = cached_rows(dir, &key, (vocab, seq), limit, &mut warning)? {
            return Ok(rows);
        }
    }
    let (t, tokenizer_sha) = crate::data::read_tokenizer_hashed(tokenizer)?;
    let encoded = encode_file(&t, text, CHUNK_BYTES, limit)?;
    let (n, tokens) = rows_of(&encoded.ids, vocab, seq, &text.display().to_string())?;
    // Stored under the key of the bytes that were encoded: a text changed between the
    // lookup and the encoding is never cached under the other text's key.
    let key = key_of(&encoded.text_sha, &tokenizer_sha, width);
    drop(encoded);
    let cached = cache.and_then(|dir| store_rows(dir, &key, n, width, &tokens));
    Ok(TokenRows { n, tokens, cached, hit: false, warning })
}

/// The rows cached under `key` in `dir`, checked against the checksum their name
/// records; an entry that fails is removed (it is meshwork's), said in `warning`,
/// and `None` returned so that the rows are made again. An entry too big for the
/// limit is left alone (making the rows meets the same limit); the model's
/// vocabulary is checked after the checksum, so that an entry of a larger
/// vocabulary is refused as making the rows would be, not taken for damage.
fn cached_rows(
    dir: &Path,
    key: &str,
    (vocab, seq): (usize, usize),
    limit: u64,
    warning: &mut Option<String>,
) -> Result<Option<TokenRows>> {
    let fits =
        |file: &Path| std::fs::metadata(file).is_ok_and(|m| m.len().saturating_mul(3) <= limit);
    let Some((file, crc)) = cached_entry(dir, key).filter(|(file, _)| fits(file)) else {
        return Ok(None);
    };
    let any_id = i32::MAX as usize;
    match crate::data::token_rows_of_npy(&file, any_id, seq, limit) {
        Ok((n, tokens)) if crc == Some(rows_crc(&tokens)) => {
            let ids: Vec<u32> = tokens.iter().map(|&t| t as u32).collect();
            check_vocab(&ids, vocab)?;
            let warning = warning.take();
            Ok(Some(TokenRows { n, tokens, cached: Some(file), hit: true, warning }))
        }
        _ => {
            *warning = Some(format!(
                "--cache-dir: {} is damaged (its rows do not match its checksum); \
                 the data are encoded again and the entry replaced",
                file.display()
            ));
            let _ = std::fs::remove_file(&file);
            Ok(None)
        }
    }
}

/// Writes `n` rows of `width` ids as the cache entry of `key` in `dir`, whole or not
/// at all; the file, or `None` where it could not be written (the rows are used
/// without it).
fn store_rows(dir: &Path, key: &str, n: usize, width: usize, tokens: &[i32]) -> Option<PathBuf> {
    let file = cache_file(dir, key, rows_crc(tokens));
    // What a killed run left writing this entry goes first.
    let _ = meshwork_io::files::remove_stale_temps(&file);
    let written = std::fs::create_dir_all(dir).is_ok()
        && write_atomic(&file, &npy_bytes(n, width, tokens)).is_ok();
    written.then_some(file)
}

/// The end-of-text tokens looked for, in order, as a tokenizer names them: GPT-2's,
/// Llama 3's, SentencePiece models' (Llama 2, Mistral), Gemma's, Qwen's chat end.
const END_OF_TEXT: [&str; 5] = ["<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>"];

/// Token rows `[N, T + 1]` of a JSON Lines file (`--data-jsonl FILE --text-field F`):
/// each line a JSON object whose string `field` is a document (blank lines skipped),
/// the documents encoded one by one (with the tokenizer's own special tokens), the
/// tokenizer's end-of-text token between consecutive documents and none after the
/// last, then cut as [`token_rows`] cuts a text. The file is read whole, within
/// `limit` bytes, and the ids held are bounded by it too. ([`documents_rows`] of the
/// one file, without a cache.)
pub fn jsonl_rows(
    path: &Path,
    field: &str,
    tokenizer: &Path,
    vocab: usize,
    seq: usize,
    limit: u64,
) -> Result<(usize, Vec<i32>)> {
    let sources = [path.to_path_buf()];
    let rows = documents_rows("data-jsonl", &sources, field, tokenizer, (vocab, seq), limit, None)?;
    Ok((rows.n, rows.tokens))
}

/// Whether `path` is read as a JSON Lines file of documents (its name ends in
/// `.jsonl`), rather than as one text.
pub fn is_jsonl(path: &Path) -> bool {
    path.extension().and_then(|e| e.to_str()).is_some_and(|e| e.eq_ignore_ascii_case("jsonl"))
}

/// Token rows `[N, T + 1]` of documents from several files, in order (`--text A B …`,
/// a directory's `.txt` and `.jsonl` files, or `--data-jsonl FILE`; `flag` names them
/// in errors): a `.jsonl` file's documents are its lines' string `field` (blank
/// lines skipped), any other file is one document, its whole text. The documents
/// are encoded one by one (with the tokenizer's own special tokens; a text in chunks
/// as [`encode_file`] does), the tokenizer's end-of-text token between consecutive
/// documents and none after the last, then cut into rows as [`token_rows`] cuts a
/// text. A `.jsonl` file is read whole within `limit` bytes, and the ids held are
/// bounded by it too. With `cache`, the rows are cached as [`token_rows`] caches a
/// text's, keyed by every file's bytes in order, `field`, the tokenizer and `T`.
pub fn documents_rows(
    flag: &str,
    paths: &[PathBuf],
    field: &str,
    tokenizer: &Path,
    (vocab, seq): (usize, usize),
    limit: u64,
    cache: Option<&Path>,
) -> Result<TokenRows> {
    let width = seq + 1;
    let mut warning = None;
    if let Some(dir) = cache {
        let shas = paths
            .iter()
            .map(|p| sha_of_file(&format!("--{flag}"), p))
            .collect::<Result<Vec<_>>>()?;
        let key =
            key_of(&documents_sha(&shas, field), &sha_of_file("--tokenizer", tokenizer)?, width);
        if let Some(rows) = cached_rows(dir, &key, (vocab, seq), limit, &mut warning)? {
            return Ok(rows);
        }
    }
    let (t, tokenizer_sha) = crate::data::read_tokenizer_hashed(tokenizer)?;
    let mut ids: Vec<u32> = Vec::new();
    let mut shas = Vec::with_capacity(paths.len());
    let mut documents = 0usize;
    let mut end = None;
    // The end-of-text id before every document but the first.
    let mut next = |ids: &mut Vec<u32>, documents: &mut usize| -> Result<()> {
        if *documents > 0 {
            let eos = match end {
                Some(id) => id,
                None => {
                    let id = END_OF_TEXT.iter().find_map(|s| t.token_to_id(s)).ok_or_else(|| {
                        Error::flag(
                            flag,
                            format!(
                                "the tokenizer has no end-of-text token ({}) to put between documents",
                                END_OF_TEXT.join(", ")
                            ),
                        )
                    })?;
                    end = Some(id);
                    id
                }
            };
            ids.push(eos);
        }
        *documents += 1;
        Ok(())
    };
    let over = |path: &Path| {
        Error::flag(
            flag,
            format!(
                "{}: the text and its ids need more than --max-memory {limit} bytes",
                path.display()
            ),
        )
    };
    for path in paths {
        if !is_jsonl(path) {
            let encoded = encode_file(
                &t,
                path,
                CHUNK_BYTES,
                limit.saturating_sub(ids.len() as u64 * BYTES_PER_ID),
            )?;
            shas.push(encoded.text_sha);
            next(&mut ids, &mut documents)?;
            ids.extend(encoded.ids);
            continue;
        }
        let bytes = crate::files::read_file(flag, path, limit)?;
        shas.push(Sha256::digest(&bytes).into());
        let text = std::str::from_utf8(&bytes).map_err(|e| {
            Error::flag(
                flag,
                format!("{} is not UTF-8 at byte {}", path.display(), e.valid_up_to()),
            )
        })?;
        let before = documents;
        for (k, line) in text.lines().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            let at = || format!("{} line {}", path.display(), k + 1);
            let value: serde_json::Value = serde_json::from_str(line)
                .map_err(|e| Error::flag(flag, format!("{}: not a JSON object ({e})", at())))?;
            let Some(document) = value.get(field).and_then(serde_json::Value::as_str) else {
                return Err(Error::flag(
                    flag,
                    format!("{}: no string field {field:?} (--text-field names it)", at()),
                ));
            };
            next(&mut ids, &mut documents)?;
            ids.extend(ids_of(&t, document, true)?);
            if (bytes.len() as u64).saturating_add(ids.len() as u64 * BYTES_PER_ID) > limit {
                return Err(over(path));
            }
        }
        if documents == before {
            return Err(Error::flag(flag, format!("{} holds no documents", path.display())));
        }
    }
    let shown = match paths {
        [one] => one.display().to_string(),
        _ => format!("the {} files", paths.len()),
    };
    let (n, tokens) = rows_of(&ids, vocab, seq, &shown)?;
    drop(ids);
    // Stored under the key of the bytes that were encoded.
    let key = key_of(&documents_sha(&shas, field), &tokenizer_sha, width);
    let cached = cache.and_then(|dir| store_rows(dir, &key, n, width, &tokens));
    Ok(TokenRows { n, tokens, cached, hit: false, warning })
}

/// The files `--text` names: each file as given, and each directory's `.txt` and
/// `.jsonl` files (not those in its subdirectories, nor hidden ones), in the order of
/// their names; a directory that holds none, or a path that is neither, is refused
/// naming it.
pub fn text_files(paths: &[PathBuf]) -> Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    for path in paths {
        let meta = std::fs::metadata(path)
            .map_err(|e| Error::flag("text", format!("{}: {e}", path.display())))?;
        if !meta.is_dir() {
            files.push(path.clone());
            continue;
        }
        let entries = std::fs::read_dir(path)
            .map_err(|e| Error::flag("text", format!("{}: {e}", path.display())))?;
        let mut inside: Vec<PathBuf> = entries
            .flatten()
            .map(|e| e.path())
            .filter(|p| {
                let visible =
                    p.file_name().and_then(|n| n.to_str()).is_some_and(|n| !n.starts_with('.'));
                let kind = p.extension().and_then(|e| e.to_str()).map(str::to_ascii_lowercase);
                visible && matches!(kind.as_deref(), Some("txt" | "jsonl")) && p.is_file()
            })
            .collect();
        if inside.is_empty() {
            return Err(Error::flag(
                "text",
                format!("{} holds no .txt or .jsonl file", path.display()),
            ));
        }
        inside.sort();
        files.extend(inside);
    }
    Ok(files)
}

/// What identifies documents' bytes: the SHA-256 of each file's, in order, and the
/// field read from the JSON Lines files among them.
fn documents_sha(shas: &[[u8; 32]], field: &str) -> [u8; 32] {
    let mut hash = Sha256::new();
    hash.update(b"documents\n");
    hash.update((field.len() as u64).to_le_bytes());
    hash.update(field.as_bytes());
    for sha in shas {
        hash.update(sha);
    }
    hash.finalize().into()
}

/// `meshwork tokenize`: `text` encoded by `tokenizer` into rows of `seq + 1`
/// ([`token_rows`], without a cache), written to `out` as `.npy` (`[N, T + 1]`, i32)
/// that `--data-tokens` reads. `out` must be a new file: it is checked before any
/// work and written whole or not at all. Returns the rows written.
pub fn tokenize_to(
    text: &Path,
    tokenizer: &Path,
    seq: usize,
    out: &Path,
    limit: u64,
) -> Result<usize> {
    if seq == 0 || seq > MAX_SEQ {
        return Err(Error::usage(format!("--seq {seq} is not between 1 and {MAX_SEQ}")));
    }
    crate::files::check_output("out", out, crate::files::Output::New)?;
    let vocab = read_tokenizer(tokenizer)?.get_vocab_size(true);
    let rows = token_rows(text, tokenizer, vocab, seq, limit, None)?;
    crate::files::write_new(out, &npy_bytes(rows.n, seq + 1, &rows.tokens))
        .map_err(|e| Error::flag("out", format!("cannot write {}: {e}", out.display())))?;
    Ok(rows.n)
}
