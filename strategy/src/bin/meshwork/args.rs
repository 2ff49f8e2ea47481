//! Command-line flags: `--name value` or `--name=value`, and switches.

use std::collections::BTreeMap;

/// A usage error: one line naming the flag and the problem.
#[derive(Debug)]
pub(crate) struct Usage(pub(crate) String);

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

impl From<Usage> for Exit {
    fn from(u: Usage) -> Exit {
        Exit::Usage(u.0)
    }
}

/// Writes to standard output and flushes: a reader that went away is [`Exit::Closed`],
/// any other failure (a full disk) a one-line [`Exit::Usage`] — never a panic.
pub(crate) fn out(text: std::fmt::Arguments<'_>) -> Result<(), Exit> {
    use std::io::Write;
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
    use std::io::Write;
    let mut stderr = std::io::stderr().lock();
    let _ = stderr.write_fmt(text).and_then(|()| stderr.write_all(b"\n"));
}

/// `println!` through [`out`], returning from the function on failure.
macro_rules! outln {
    () => {
        $crate::args::out(format_args!("\n"))?
    };
    ($($arg:tt)*) => {
        $crate::args::out(format_args!("{}\n", format_args!($($arg)*)))?
    };
}
pub(crate) use outln;

/// Parsed flags and positional arguments.
pub(crate) struct Args {
    values: BTreeMap<String, String>,
    switches: Vec<String>,
    pub(crate) positional: Vec<String>,
}

impl Args {
    /// Parses `args` against the flags that take a value and the switches.
    pub(crate) fn parse(
        args: &[String],
        valued: &[&str],
        switches: &[&str],
    ) -> Result<Args, Usage> {
        let mut out =
            Args { values: BTreeMap::new(), switches: Vec::new(), positional: Vec::new() };
        let mut it = args.iter();
        while let Some(a) = it.next() {
            let Some(flag) = a.strip_prefix("--") else {
                if a.len() > 1 && a.starts_with('-') && a.parse::<f64>().is_err() {
                    return Err(Usage(format!(
                        "unknown flag {a:?}: flags are spelled with two dashes (--name)"
                    )));
                }
                out.positional.push(a.clone());
                continue;
            };
            if flag.is_empty() {
                return Err(Usage("a bare \"--\" is not an argument meshwork takes".into()));
            }
            let (name, inline) = match flag.split_once('=') {
                Some((n, v)) => (n, Some(v.to_string())),
                None => (flag, None),
            };
            if switches.contains(&name) {
                if inline.is_some() {
                    return Err(Usage(format!("--{name} takes no value")));
                }
                out.switches.push(name.into());
            } else if valued.contains(&name) {
                let value = match inline {
                    Some(v) => v,
                    None => match it.next() {
                        Some(v) if v.starts_with("--") => {
                            return Err(Usage(format!(
                                "--{name} needs a value, but the next argument is the flag {v}"
                            )));
                        }
                        Some(v) => v.clone(),
                        None => return Err(Usage(format!("--{name} needs a value"))),
                    },
                };
                if out.values.insert(name.into(), value).is_some() {
                    return Err(Usage(format!("--{name} is given twice")));
                }
            } else {
                return Err(Usage(format!("unknown flag --{name}")));
            }
        }
        Ok(out)
    }

    /// The raw value of `--name`.
    pub(crate) fn get(&self, name: &str) -> Option<&str> {
        self.values.get(name).map(String::as_str)
    }

    /// Whether switch `--name` was given.
    pub(crate) fn on(&self, name: &str) -> bool {
        self.switches.iter().any(|s| s == name)
    }

    /// `--name` parsed as `T`, or `default`.
    pub(crate) fn parse_or<T: std::str::FromStr>(
        &self,
        name: &str,
        default: T,
        what: &str,
    ) -> Result<T, Usage> {
        match self.get(name) {
            None => Ok(default),
            Some(v) => v.parse().map_err(|_| Usage(format!("--{name} {v:?} is not {what}"))),
        }
    }
}

/// `DxM` → `(D, M)`.
pub(crate) fn mesh(flag: &str, text: &str) -> Result<(usize, usize), Usage> {
    let bad = || Usage(format!("--{flag} {text:?} is not a mesh like 2x2 (data x model)"));
    let (d, m) = text.split_once(['x', 'X']).ok_or_else(bad)?;
    let (d, m) = (d.trim().parse().map_err(|_| bad())?, m.trim().parse().map_err(|_| bad())?);
    if d == 0 || m == 0 {
        return Err(bad());
    }
    Ok((d, m))
}

/// `8,8` → `[8, 8]`.
pub(crate) fn dims(flag: &str, text: &str) -> Result<Vec<usize>, Usage> {
    text.split(',')
        .map(|d| {
            d.trim()
                .parse()
                .map_err(|_| Usage(format!("--{flag} {text:?} is not a list of sizes like 8,8")))
        })
        .collect()
}

/// The bytes of the regular file `path` given by `--flag`, at most `limit` of them
/// (`--max-memory`): a device, FIFO or directory is refused, and so is a file that
/// holds more, even one that grows while it is read.
pub(crate) fn read_file(flag: &str, path: &str, limit: u64) -> Result<Vec<u8>, Usage> {
    use std::io::Read;
    let bad = |e: &dyn std::fmt::Display| Usage(format!("--{flag} {path}: {e}"));
    let file = std::fs::File::open(path).map_err(|e| bad(&e))?;
    let meta = file.metadata().map_err(|e| bad(&e))?;
    if !meta.is_file() {
        return Err(bad(&"not a regular file"));
    }
    let too_big =
        |n: u64| bad(&format!("{n} bytes or more, over the {limit}-byte limit (--max-memory)"));
    if meta.len() > limit {
        return Err(too_big(meta.len()));
    }
    let mut bytes = Vec::with_capacity(usize::try_from(meta.len()).unwrap_or(0));
    file.take(limit.saturating_add(1)).read_to_end(&mut bytes).map_err(|e| bad(&e))?;
    if bytes.len() as u64 > limit {
        return Err(too_big(bytes.len() as u64));
    }
    Ok(bytes)
}
