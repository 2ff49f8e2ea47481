//! Command-line flags: `--name value` or `--name=value`, and switches.

use std::collections::BTreeMap;

/// A usage error: one line naming the flag and the problem.
#[derive(Debug)]
pub(crate) struct Usage(pub(crate) String);

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
                out.positional.push(a.clone());
                continue;
            };
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
                    None => it
                        .next()
                        .cloned()
                        .ok_or_else(|| Usage(format!("--{name} needs a value")))?,
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
