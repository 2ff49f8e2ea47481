//! ARCHITECTURE.md against the tree: the map names every workspace member, lists the
//! `meshwork` binary's commands exactly, and lists exactly the files holding `unsafe`.
//!
//! - Crates: every `members` entry of the root `Cargo.toml` is named as its folder in
//!   backticks (`` `xla/mock/` ``). The map may name more (a crate on its way in).
//! - Commands: the section headed [`COMMANDS_HEADING`] has one line `` - `meshwork NAME` ``
//!   per subcommand of the clap enum that `cli/src/args.rs`'s `#[command(subcommand)]`
//!   field holds (a variant's name in kebab case, or its `#[command(name = "…")]`),
//!   and no other such line.
//! - `unsafe`: the section headed [`UNSAFE_HEADING`] has one line `` - `PATH` `` (a path
//!   from the workspace root) per `.rs` file whose code holds the keyword `unsafe`, and no
//!   other such line. Comments (doc comments too), string and character literals do not
//!   count; files under `target/` folders and hidden folders are not read.
//!
//! Everything that reads a file is in [`check`]; the rest are pure functions over text.

use std::fs;
use std::path::Path;

/// The map, at the workspace root.
pub(crate) const DOC: &str = "ARCHITECTURE.md";
/// Where the clap enum of the binary's commands is.
pub(crate) const ARGS: &str = "cli/src/args.rs";
/// The heading of the map's list of commands.
pub(crate) const COMMANDS_HEADING: &str = "## The `meshwork` commands";
/// The heading of the map's list of files holding `unsafe`.
pub(crate) const UNSAFE_HEADING: &str = "## Where `unsafe` is";

/// What the tree says: the facts the map must agree with.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct Tree {
    /// The root `Cargo.toml`'s workspace `members`, as written (folder paths).
    pub(crate) members: Vec<String>,
    /// The `meshwork` binary's subcommands, as typed on the command line.
    pub(crate) commands: Vec<String>,
    /// Each `.rs` file holding `unsafe` code (a `/`-separated path from the root) and
    /// the line of its first `unsafe`.
    pub(crate) unsafe_files: Vec<(String, usize)>,
}

/// Every disagreement between `ARCHITECTURE.md` and the tree under `root`, one line each.
pub(crate) fn check(root: &Path) -> Result<Vec<String>, String> {
    let read = |name: &str| {
        fs::read_to_string(root.join(name)).map_err(|e| format!("cannot read {name}: {e}"))
    };
    let doc = read(DOC)?;
    let members = members(&read("Cargo.toml")?).map_err(|e| format!("Cargo.toml: {e}"))?;
    let commands = subcommands(&read(ARGS)?).map_err(|e| format!("{ARGS}: {e}"))?;
    let mut files = Vec::new();
    super::collect_rust_files(root, &mut files)?;
    files.sort();
    let mut unsafe_files = Vec::new();
    for file in &files {
        let text =
            fs::read_to_string(file).map_err(|e| format!("cannot read {}: {e}", file.display()))?;
        if let Some(line) = first_unsafe(&text) {
            let relative = file.strip_prefix(root).unwrap_or(file);
            let shown: Vec<String> = relative
                .components()
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
                .collect();
            unsafe_files.push((shown.join("/"), line));
        }
    }
    Ok(check_doc(&doc, &Tree { members, commands, unsafe_files }))
}

/// Every disagreement between the map `doc` and `tree`, one line each, naming where.
pub(crate) fn check_doc(doc: &str, tree: &Tree) -> Vec<String> {
    let mut problems = Vec::new();

    for member in &tree.members {
        let folder = format!("`{}/`", member.trim_end_matches('/'));
        if !doc.contains(&folder) {
            problems.push(format!(
                "Cargo.toml: workspace member `{member}` is not named in {DOC} \
                 (name its folder as {folder})"
            ));
        }
    }

    match listed(doc, COMMANDS_HEADING) {
        None => problems.push(format!(
            "{DOC}: no section `{COMMANDS_HEADING}` (one line `- `meshwork NAME`` per command)"
        )),
        Some(items) => {
            let mut named = Vec::new();
            for (line, item) in items {
                match item.strip_prefix("meshwork ") {
                    Some(name) if !name.trim().is_empty() && !name.contains(' ') => {
                        if !tree.commands.iter().any(|c| c == name) {
                            problems.push(format!(
                                "{DOC}:{line}: lists command `meshwork {name}`, which \
                                 {ARGS} does not define"
                            ));
                        }
                        named.push(name.to_owned());
                    }
                    _ => problems.push(format!(
                        "{DOC}:{line}: `{item}` under `{COMMANDS_HEADING}` is not \
                         `meshwork NAME`"
                    )),
                }
            }
            for command in &tree.commands {
                if !named.contains(command) {
                    problems.push(format!(
                        "{ARGS}: command `{command}` is not listed under {DOC}'s \
                         `{COMMANDS_HEADING}` (add a line `- `meshwork {command}` …`)"
                    ));
                }
            }
        }
    }

    match listed(doc, UNSAFE_HEADING) {
        None => problems.push(format!(
            "{DOC}: no section `{UNSAFE_HEADING}` (one line `- `path/to/file.rs`` per file \
             holding `unsafe`)"
        )),
        Some(items) => {
            for (line, path) in &items {
                if !tree.unsafe_files.iter().any(|(file, _)| file == path) {
                    problems.push(format!(
                        "{DOC}:{line}: lists `{path}` under `{UNSAFE_HEADING}`, but that \
                         file holds no `unsafe` code (or does not exist)"
                    ));
                }
            }
            for (file, line) in &tree.unsafe_files {
                if !items.iter().any(|(_, path)| path == file) {
                    problems.push(format!(
                        "{file}:{line}: holds `unsafe` code, but {DOC}'s `{UNSAFE_HEADING}` \
                         does not list it (add a line `- `{file}` …` saying why)"
                    ));
                }
            }
        }
    }
    problems
}

/// The items of the section headed `heading` (a line equal to it): each line of the
/// section that starts with `` - ` ``, as its line number (from 1) and the text up to
/// the closing backtick. `None` if no line is the heading. The section ends at the next
/// heading of its level or above.
pub(crate) fn listed(doc: &str, heading: &str) -> Option<Vec<(usize, String)>> {
    let level = heading.chars().take_while(|&c| c == '#').count();
    let mut lines = doc.lines().enumerate();
    lines.find(|(_, line)| line.trim_end() == heading)?;
    let mut items = Vec::new();
    for (index, line) in lines {
        let hashes = line.chars().take_while(|&c| c == '#').count();
        if hashes > 0 && hashes <= level && line[hashes..].starts_with(' ') {
            break;
        }
        if let Some(rest) = line.strip_prefix("- `") {
            let item = rest.split('`').next().unwrap_or_default();
            items.push((index + 1, item.to_owned()));
        }
    }
    Some(items)
}

/// The `members` of the `[workspace]` table of a `Cargo.toml`, in order.
pub(crate) fn members(cargo_toml: &str) -> Result<Vec<String>, String> {
    let mut table = String::new();
    let mut array: Option<String> = None;
    for line in cargo_toml.lines() {
        let code = toml_code(line);
        if let Some(text) = array.as_mut() {
            text.push_str(code);
            text.push('\n');
        } else if code.trim_start().starts_with('[') {
            table = code.trim().to_owned();
            continue;
        } else if table == "[workspace]"
            && let Some((key, value)) = code.split_once('=')
            && key.trim() == "members"
        {
            array = Some(format!("{value}\n"));
        } else {
            continue;
        }
        let text = array.as_deref().unwrap_or_default();
        if toml_array_closed(text) {
            let items = toml_strings(text);
            if let Some(glob) = items.iter().find(|m| m.contains(['*', '?', '['])) {
                return Err(format!(
                    "workspace member `{glob}` is a glob; tidy reads members written out"
                ));
            }
            return Ok(items);
        }
    }
    match array {
        Some(_) => Err("the workspace `members` array is not closed".into()),
        None => Err("no `members` in the `[workspace]` table".into()),
    }
}

/// A TOML line without its comment (a `#` outside a string).
fn toml_code(line: &str) -> &str {
    let mut quote = None;
    for (i, c) in line.char_indices() {
        match (quote, c) {
            (None, '#') => return &line[..i],
            (None, '"' | '\'') => quote = Some(c),
            (Some(q), _) if c == q => quote = None,
            _ => {}
        }
    }
    line
}

/// Whether the text after `members =` holds the array's closing `]`.
fn toml_array_closed(text: &str) -> bool {
    let mut quote = None;
    for c in text.chars() {
        match (quote, c) {
            (None, ']') => return true,
            (None, '"' | '\'') => quote = Some(c),
            (Some(q), _) if c == q => quote = None,
            _ => {}
        }
    }
    false
}

/// The quoted strings of a TOML array of strings, up to its closing `]`.
fn toml_strings(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut quote = None;
    let mut current = String::new();
    for c in text.chars() {
        match (quote, c) {
            (None, ']') => break,
            (None, '"' | '\'') => quote = Some(c),
            (Some(q), _) if c == q => {
                out.push(std::mem::take(&mut current));
                quote = None;
            }
            (Some(_), _) => current.push(c),
            _ => {}
        }
    }
    out
}

/// The subcommands of a clap (derive) command line: the variants of the enum held by
/// the field marked `#[command(subcommand)]`, each in kebab case or as its
/// `#[command(name = "…")]`. Hidden commands count; `external_subcommand` does not.
pub(crate) fn subcommands(source: &str) -> Result<Vec<String>, String> {
    let tokens = tokens(source);
    let is = |k: usize, want: &str| tokens.get(k).is_some_and(|t| t.text == want);

    // The `#[command(subcommand)]` field and its type's last name (`Option<Command>`).
    let marker = ["#", "[", "command", "(", "subcommand", ")", "]"];
    let start = (0..tokens.len())
        .find(|&k| {
            marker
                .iter()
                .enumerate()
                .all(|(j, want)| is(k + j, want) || (j == 2 && is(k + j, "clap")))
        })
        .ok_or("no field marked `#[command(subcommand)]`")?;
    let mut k = start + marker.len();
    while is(k, "#") {
        k = skip_group(&tokens, k + 1);
    }
    if is(k, "pub") {
        k += 1;
        if is(k, "(") {
            k = skip_group(&tokens, k);
        }
    }
    if !is(k + 1, ":") {
        return Err("the `#[command(subcommand)]` field has no `name: Type`".into());
    }
    let mut enum_name = None;
    let mut depth = 0usize;
    for token in &tokens[k + 2..] {
        match token.text.as_str() {
            "<" | "(" | "[" => depth += 1,
            ">" | ")" | "]" => depth = depth.saturating_sub(1),
            "," | "}" if depth == 0 => break,
            _ if token.kind == Kind::Ident => enum_name = Some(token.text.clone()),
            _ => {}
        }
    }
    let enum_name = enum_name.ok_or("the `#[command(subcommand)]` field has no type")?;

    // `enum NAME { … }`.
    let open = (0..tokens.len())
        .find(|&k| is(k, "enum") && is(k + 1, &enum_name) && is(k + 2, "{"))
        .map(|k| k + 2)
        .ok_or_else(|| format!("no `enum {enum_name} {{ … }}` (the subcommand field's type)"))?;
    let close = skip_group(&tokens, open) - 1;
    let mut names = Vec::new();
    let mut k = open + 1;
    while k < close {
        let mut rename = None;
        let mut external = false;
        while is(k, "#") {
            let end = skip_group(&tokens, k + 1);
            let attribute = &tokens[k + 1..end];
            if attribute.get(1).is_some_and(|t| t.text == "command" || t.text == "clap") {
                for (j, t) in attribute.iter().enumerate() {
                    if t.text == "external_subcommand" {
                        external = true;
                    }
                    if t.text == "flatten" {
                        return Err(format!(
                            "enum {enum_name} flattens another enum's commands; tidy reads \
                             the commands of one enum"
                        ));
                    }
                    if t.text == "name"
                        && attribute.get(j + 1).is_some_and(|t| t.text == "=")
                        && let Some(value) = attribute.get(j + 2).filter(|t| t.kind == Kind::Str)
                    {
                        rename = Some(value.text.clone());
                    }
                }
            }
            k = end;
        }
        if k >= close {
            break;
        }
        let variant = &tokens[k];
        if variant.kind != Kind::Ident {
            return Err(format!(
                "line {}: expected a variant of enum {enum_name}, found `{}`",
                variant.line, variant.text
            ));
        }
        k += 1;
        // Its fields, a discriminant, up to the comma.
        while k < close && !is(k, ",") {
            k = if is(k, "(") || is(k, "{") || is(k, "[") { skip_group(&tokens, k) } else { k + 1 };
        }
        k += 1;
        if !external {
            names.push(rename.unwrap_or_else(|| kebab(variant.text.trim_start_matches("r#"))));
        }
    }
    if names.is_empty() {
        return Err(format!("enum {enum_name} has no commands"));
    }
    Ok(names)
}

/// `GpuBench` → `gpu-bench`, `HTTPServer` → `http-server`: a variant's name as clap
/// (through `heck`) writes it in kebab case.
fn kebab(name: &str) -> String {
    let chars: Vec<char> = name.chars().collect();
    let mut out = String::new();
    for (i, &c) in chars.iter().enumerate() {
        if c == '_' {
            out.push('-');
            continue;
        }
        if c.is_uppercase() && i > 0 {
            let before = chars[i - 1];
            let after_lower = chars.get(i + 1).is_some_and(|n| n.is_lowercase());
            if before.is_lowercase()
                || before.is_ascii_digit()
                || (before.is_uppercase() && after_lower)
            {
                out.push('-');
            }
        }
        out.extend(c.to_lowercase());
    }
    out
}

/// The index just past the group opening at `tokens[open]` (`(`, `[` or `{`, matched
/// with its closer across nesting), or past `tokens[open]` if it opens none.
fn skip_group(tokens: &[Token], open: usize) -> usize {
    let mut depth = 0usize;
    for (k, token) in tokens.iter().enumerate().skip(open) {
        match token.text.as_str() {
            "(" | "[" | "{" if token.kind == Kind::Punct => depth += 1,
            ")" | "]" | "}" if token.kind == Kind::Punct => {
                depth = depth.saturating_sub(1);
                if depth == 0 {
                    return k + 1;
                }
            }
            _ if depth == 0 => return k + 1,
            _ => {}
        }
    }
    tokens.len()
}

/// The line (from 1) of the first `unsafe` keyword in Rust `source`'s code, or `None`.
/// Comments, doc comments, strings and character literals are not code.
pub(crate) fn first_unsafe(source: &str) -> Option<usize> {
    tokens(source).into_iter().find(|t| t.kind == Kind::Ident && t.text == "unsafe").map(|t| t.line)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// An identifier or keyword (a raw one keeps its `r#`).
    Ident,
    /// A string literal of any kind; the text is its contents (escapes left as written).
    Str,
    /// Anything else: one punctuation character, a number, a lifetime, a char literal.
    Punct,
}

#[derive(Debug, Clone)]
struct Token {
    kind: Kind,
    text: String,
    line: usize,
}

/// Rust source as tokens, comments dropped: enough of Rust's lexer to tell code from
/// comments and literals (nested block comments, raw strings with `#`s, byte and C
/// strings, char literals beside lifetimes).
fn tokens(source: &str) -> Vec<Token> {
    let chars: Vec<char> = source.chars().collect();
    let mut out = Vec::new();
    let mut line = 1;
    let mut k = 0;
    let at = |k: usize| chars.get(k).copied().unwrap_or('\0');
    let is_ident_start = |c: char| c == '_' || c.is_alphabetic();
    let is_ident = |c: char| c == '_' || c.is_alphanumeric();
    // Skips `chars[from..to]`, counting its newlines.
    let newlines = |from: usize, to: usize| {
        chars[from..to.min(chars.len())].iter().filter(|&&c| c == '\n').count()
    };
    while k < chars.len() {
        let c = chars[k];
        let start = k;
        let start_line = line;
        if c == '\n' {
            line += 1;
            k += 1;
        } else if c.is_whitespace() {
            k += 1;
        } else if c == '/' && at(k + 1) == '/' {
            while k < chars.len() && chars[k] != '\n' {
                k += 1;
            }
        } else if c == '/' && at(k + 1) == '*' {
            let mut depth = 0usize;
            while k < chars.len() {
                if chars[k] == '/' && at(k + 1) == '*' {
                    depth += 1;
                    k += 2;
                } else if chars[k] == '*' && at(k + 1) == '/' {
                    depth -= 1;
                    k += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    k += 1;
                }
            }
            line += newlines(start, k);
        } else if is_ident_start(c) {
            while k < chars.len() && is_ident(chars[k]) {
                k += 1;
            }
            let word: String = chars[start..k].iter().collect();
            let raw_prefix = matches!(word.as_str(), "r" | "br" | "cr");
            let string_prefix = matches!(word.as_str(), "b" | "c");
            if raw_prefix && (at(k) == '"' || (at(k) == '#' && matches!(at(k + 1), '"' | '#'))) {
                // A raw string: `r#"…"#`, no escapes, closed by `"` and as many `#`s.
                let mut hashes = 0;
                while at(k) == '#' {
                    hashes += 1;
                    k += 1;
                }
                k += 1;
                let body = k;
                loop {
                    if k >= chars.len() {
                        break;
                    }
                    if chars[k] == '"' && (1..=hashes).all(|h| at(k + h) == '#') {
                        break;
                    }
                    k += 1;
                }
                let text = chars[body..k.min(chars.len())].iter().collect();
                k = (k + 1 + hashes).min(chars.len());
                line += newlines(start, k);
                out.push(Token { kind: Kind::Str, text, line: start_line });
            } else if word == "r" && at(k) == '#' && is_ident_start(at(k + 1)) {
                // A raw identifier: `r#unsafe` is a name, not the keyword.
                k += 1;
                while k < chars.len() && is_ident(chars[k]) {
                    k += 1;
                }
                let text = chars[start..k].iter().collect();
                out.push(Token { kind: Kind::Ident, text, line });
            } else if string_prefix && (at(k) == '"' || at(k) == '\'') {
                // `b"…"`, `c"…"`, `b'…'`: lexed as the literal after the prefix.
                continue_literal(&chars, &mut k, &mut line, &mut out);
            } else {
                out.push(Token { kind: Kind::Ident, text: word, line });
            }
        } else if c == '"' || c == '\'' {
            continue_literal(&chars, &mut k, &mut line, &mut out);
        } else if c.is_ascii_digit() {
            while k < chars.len() && is_ident(chars[k]) {
                k += 1;
            }
            out.push(Token { kind: Kind::Punct, text: chars[start..k].iter().collect(), line });
        } else {
            k += 1;
            out.push(Token { kind: Kind::Punct, text: c.to_string(), line });
        }
    }
    out
}

/// Lexes the string, char literal or lifetime opening at `chars[*k]` (`"` or `'`).
fn continue_literal(chars: &[char], k: &mut usize, line: &mut usize, out: &mut Vec<Token>) {
    let at = |k: usize| chars.get(k).copied().unwrap_or('\0');
    let start_line = *line;
    if chars[*k] == '"' {
        *k += 1;
        let body = *k;
        while *k < chars.len() && chars[*k] != '"' {
            if chars[*k] == '\\' {
                *k += 1;
            }
            if at(*k) == '\n' {
                *line += 1;
            }
            *k += 1;
        }
        let text = chars[body..(*k).min(chars.len())].iter().collect();
        *k = (*k + 1).min(chars.len());
        out.push(Token { kind: Kind::Str, text, line: start_line });
    } else if at(*k + 1) == '\\' {
        // An escaped char literal: `'\n'`, `'\''`, `'\u{1F600}'`: past the quote, the
        // backslash and the escaped character, then to the closing quote.
        *k += 3;
        while *k < chars.len() && chars[*k] != '\'' && chars[*k] != '\n' {
            *k += 1;
        }
        *k = (*k + 1).min(chars.len());
        out.push(Token { kind: Kind::Punct, text: "'char'".into(), line: start_line });
    } else if at(*k + 2) == '\'' && at(*k + 1) != '\n' {
        *k += 3;
        out.push(Token { kind: Kind::Punct, text: "'char'".into(), line: start_line });
    } else {
        // A lifetime or a label: `'a`, `'static`.
        *k += 1;
        while *k < chars.len() && (chars[*k] == '_' || chars[*k].is_alphanumeric()) {
            *k += 1;
        }
        out.push(Token { kind: Kind::Punct, text: "'lifetime".into(), line: start_line });
    }
}

#[cfg(test)]
mod tests;
