//! How a command ends, and writing to people: standard output that may be closed by
//! its reader, standard error that may be gone.

use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};

/// Set in every process of an MPI job but the first: the job speaks through process
/// 0 (its progress, summary and errors), the others write nothing.
static SILENT: AtomicBool = AtomicBool::new(false);

/// Makes this process write nothing to standard output or error from now on.
pub(crate) fn silence() {
    SILENT.store(true, Ordering::SeqCst);
}

/// How a command ends when it does not simply succeed.
#[derive(Debug)]
pub(crate) enum Exit {
    /// Bad input (or output that cannot be written): one line, status 2.
    Usage(String),
    /// The job ran and failed (a loss that is not finite, a failed check): one line,
    /// status 1.
    Failed(String),
    /// Stopped by SIGINT or SIGTERM after saving what it could: status 130.
    Interrupted,
    /// Standard output was closed by its reader (`meshwork ... | head`): end quietly,
    /// status 0, as `ls | head` does.
    Closed,
}

/// Writes to standard output and flushes: a reader that went away is [`Exit::Closed`],
/// any other failure (a full disk) a one-line [`Exit::Usage`] — never a panic.
pub(crate) fn out(text: std::fmt::Arguments<'_>) -> Result<(), Exit> {
    if SILENT.load(Ordering::SeqCst) {
        return Ok(());
    }
    let mut stdout = std::io::stdout().lock();
    stdout.write_fmt(text).and_then(|()| stdout.flush()).map_err(|e| {
        if e.kind() == std::io::ErrorKind::BrokenPipe {
            Exit::Closed
        } else {
            Exit::Usage(format!("cannot write to standard output: {e}"))
        }
    })
}

/// A line on standard error; if standard error itself cannot be written there is no
/// one left to tell, so the failure is ignored (the exit status still says it).
pub(crate) fn note(text: std::fmt::Arguments<'_>) {
    if SILENT.load(Ordering::SeqCst) {
        return;
    }
    let mut stderr = std::io::stderr().lock();
    let _ = stderr.write_fmt(text).and_then(|()| stderr.write_all(b"\n"));
}

/// A line on standard output through [`out`], returning from the function on failure.
macro_rules! outln {
    ($($arg:tt)*) => {
        $crate::out::out(format_args!("{}\n", format_args!($($arg)*)))?
    };
}
pub(crate) use outln;

/// `message` as one readable line: line breaks as spaces, a number of more than 20
/// digits (an `f64` printed in full decimal, hundreds of digits; every `u64` has at
/// most 20) in scientific notation, any word longer than [`LONGEST_WORD`] characters
/// cut in its middle, its length said, and the whole line at most [`LONGEST_LINE`]
/// characters (a 50 KB sharding spec echoed back: its start and end are kept).
pub(crate) fn readable(message: &str) -> String {
    let line = words(message);
    let n = line.chars().count();
    if n <= LONGEST_LINE {
        return line;
    }
    let head: String = line.chars().take(LONGEST_LINE * 2 / 3).collect();
    let tail: String = line.chars().skip(n - LONGEST_LINE / 4).collect();
    format!("{head} … ({n} characters) … {tail}")
}

/// The longest error line shown whole.
pub(crate) const LONGEST_LINE: usize = 300;

/// `message`'s words, shortened, on one line.
fn words(message: &str) -> String {
    message
        .split_whitespace()
        .map(|word| {
            let word = shorten_numbers(word);
            let n = word.chars().count();
            if n <= LONGEST_WORD {
                return word;
            }
            let head: String = word.chars().take(LONGEST_WORD / 2).collect();
            let tail: String = word.chars().skip(n - LONGEST_WORD / 4).collect();
            format!("{head}…{tail} ({n} characters)")
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// The longest word an error line shows whole.
pub(crate) const LONGEST_WORD: usize = 160;

/// `word` with each run of digits (and one decimal point) holding more than 20 digits
/// written as `{:e}` of its value.
fn shorten_numbers(word: &str) -> String {
    let mut out = String::with_capacity(word.len());
    let mut run = String::new();
    let flush = |run: &mut String, out: &mut String| {
        let digits = run.chars().filter(char::is_ascii_digit).count();
        match run.parse::<f64>() {
            Ok(v) if digits > 20 => {
                out.push_str(&format!("{v:e}"));
            }
            _ => out.push_str(run),
        }
        run.clear();
    };
    for c in word.chars() {
        if c.is_ascii_digit() || (c == '.' && !run.contains('.') && !run.is_empty()) {
            run.push(c);
        } else {
            flush(&mut run, &mut out);
            out.push(c);
        }
    }
    flush(&mut run, &mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A huge f64 in full decimal becomes scientific notation; a long word is cut, its
    /// length said; short numbers, words and ids stay as they are; the result is one
    /// line however many the message had.
    #[test]
    fn error_lines_stay_readable() {
        let huge = format!("{}", 1e300f64);
        assert!(huge.len() > 300);
        let got = readable(&format!("--lr {huge} is too large"));
        assert_eq!(got, "--lr 1e300 is too large");
        let tiny = format!("{}", 1.5e-30f64);
        assert_eq!(readable(&format!("eps {tiny}.")), "eps 1.5e-30.");
        assert_eq!(readable("step 12 loss 0.0123456 at 2x4"), "step 12 loss 0.0123456 at 2x4");
        let spec = format!("{{devices=[{}]}}", vec!["1"; 25_000].join(","));
        let got = readable(&format!("--spec {spec}: bad\nsecond line"));
        assert!(got.len() < 300 && got.contains("(50012 characters)"), "{got}");
        assert!(got.ends_with(": bad second line") || got.contains("bad second line"), "{got}");
        assert!(!got.contains('\n'));
        assert_eq!(readable("a\tb\n c"), "a b c");
        // A spec with spaces (no one long word) is cut as a line; u64s stay exact.
        let spaced = format!("--spec P({}) is bad", vec!["'a'"; 20_000].join(", "));
        let got = readable(&spaced);
        assert!(got.chars().count() < 400 && got.starts_with("--spec P('a', "), "{got}");
        assert!(got.ends_with("'a') is bad"), "{got}");
        assert_eq!(readable("18446744073709551615 bytes"), "18446744073709551615 bytes");
    }
}
