//! Chat templates as `transformers`' `apply_chat_template(messages,
//! add_generation_prompt=True)` renders them: the template from the folder
//! (`chat_template.jinja`, as `transformers` 5 saves it, or the `chat_template`
//! string — or the list's `default` — in `tokenizer_config.json`, as 4.x does), the
//! special tokens (`bos_token`, `eos_token`, …) from `tokenizer_config.json`, rendered
//! by MiniJinja with Jinja2's settings `transformers` uses (`trim_blocks`,
//! `lstrip_blocks`, loop controls, Python's string and dict methods, `tojson`,
//! `raise_exception`, `strftime_now`), then encoded without adding special tokens (the
//! template writes its own).

use std::path::Path;

use serde_json::Value as Json;

use crate::{Error, Result, files};

/// The most bytes a template, a tokenizer config or a messages file may take.
const LIMIT: u64 = 16 << 20;

fn bad(flag: &str, path: &Path, problem: impl std::fmt::Display) -> Error {
    Error::flag(flag, format!("{}: {problem}", path.display()))
}

/// A folder's chat template and the special tokens it is rendered with.
#[derive(Debug, Clone)]
pub struct ChatTemplate {
    /// The Jinja source.
    pub source: String,
    /// `bos_token`, `eos_token`, … as strings.
    pub tokens: serde_json::Map<String, Json>,
}

/// The text of a special token as `tokenizer_config.json` writes it: a string, or an
/// `AddedToken`'s `content`.
fn token_text(v: &Json) -> Option<&str> {
    v.as_str().or_else(|| v.get("content").and_then(Json::as_str))
}

impl ChatTemplate {
    /// The chat template of the folder `dir` (named by `--flag` in errors).
    pub fn of_folder(flag: &str, dir: &Path) -> Result<ChatTemplate> {
        let config_path = dir.join("tokenizer_config.json");
        let config: Json = match config_path.exists() {
            true => {
                let text = files::read_capped(flag, &config_path, LIMIT)?;
                serde_json::from_slice(&text)
                    .map_err(|e| bad(flag, &config_path, format!("not JSON: {e}")))?
            }
            false => Json::Object(Default::default()),
        };
        let jinja = dir.join("chat_template.jinja");
        let source = if jinja.exists() {
            let bytes = files::read_capped(flag, &jinja, LIMIT)?;
            String::from_utf8(bytes).map_err(|_| bad(flag, &jinja, "not UTF-8"))?
        } else {
            match config.get("chat_template") {
                Some(Json::String(s)) => s.clone(),
                // Several named templates: the default one.
                Some(Json::Array(list)) => list
                    .iter()
                    .find(|t| t.get("name").and_then(Json::as_str) == Some("default"))
                    .and_then(|t| t.get("template").and_then(Json::as_str))
                    .map(str::to_string)
                    .ok_or_else(|| bad(flag, &config_path, "no chat_template named default"))?,
                _ => {
                    return Err(bad(
                        flag,
                        dir,
                        "no chat template (chat_template.jinja, or chat_template in tokenizer_config.json)",
                    ));
                }
            }
        };
        let mut tokens = serde_json::Map::new();
        for key in [
            "bos_token",
            "eos_token",
            "unk_token",
            "pad_token",
            "sep_token",
            "cls_token",
            "mask_token",
        ] {
            if let Some(t) = config.get(key).and_then(token_text) {
                tokens.insert(key.to_string(), Json::String(t.to_string()));
            }
        }
        Ok(ChatTemplate { source, tokens })
    }

    /// The template rendered for `messages` (a list of `{role, content, …}`, maps in
    /// their order) with a generation prompt, `tools` and `documents` none, the special
    /// tokens defined.
    pub fn render(&self, flag: &str, messages: &minijinja::Value) -> Result<String> {
        let failed = |e: minijinja::Error| Error::flag(flag, format!("the chat template: {e:#}"));
        let mut env = minijinja::Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(failed)?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", tojson);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        // A template is code from the folder: its work and its output are bounded.
        env.set_fuel(Some(FUEL));
        let source = generation_blocks_as_ifs(&self.source);
        env.add_template("chat", &source).map_err(failed)?;
        let mut context: Vec<(String, minijinja::Value)> = self
            .tokens
            .iter()
            .map(|(k, v)| (k.clone(), minijinja::Value::from(v.as_str().unwrap_or(""))))
            .collect();
        context.push(("messages".into(), messages.clone()));
        context.push(("add_generation_prompt".into(), minijinja::Value::from(true)));
        context.push(("tools".into(), minijinja::Value::from(())));
        context.push(("documents".into(), minijinja::Value::from(())));
        let template = env.get_template("chat").map_err(failed)?;
        let mut out = Capped(Vec::new());
        template
            .render_captured_to(minijinja::Value::from_pairs(context), &mut out)
            .map_err(failed)?;
        String::from_utf8(out.0)
            .map_err(|_| Error::flag(flag, "the chat template wrote bytes that are not UTF-8"))
    }
}

/// The most a template may compute (MiniJinja's fuel: instructions, and the bytes of
/// the strings it builds): over a thousand times what the Hub-style templates of
/// `testdata/chat` take over 200 messages (at most 13 000).
const FUEL: u64 = 20_000_000;

/// A render's output, refused past [`LIMIT`] bytes.
struct Capped(Vec<u8>);

impl std::io::Write for Capped {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.0.len() as u64 + buf.len() as u64 > LIMIT {
            return Err(std::io::Error::other(format!("the rendered chat passes {LIMIT} bytes")));
        }
        self.0.extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// `transformers`' `{% generation %}…{% endgeneration %}` (which marks the assistant's
/// tokens and renders its body unchanged) as `{% if true %}…{% endif %}`, whitespace
/// control kept, for a Jinja engine without that tag.
fn generation_blocks_as_ifs(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(at) = rest.find("{%") {
        out.push_str(&rest[..at]);
        let tag = &rest[at..];
        let Some(end) = tag.find("%}") else {
            out.push_str(tag);
            return out;
        };
        let inner = &tag[2..end];
        let open = if inner.starts_with('-') || inner.starts_with('+') { &inner[..1] } else { "" };
        let close = if inner.ends_with('-') || inner.ends_with('+') {
            &inner[inner.len() - 1..]
        } else {
            ""
        };
        let word = inner[open.len()..inner.len() - close.len()].trim();
        match word {
            "generation" => out.push_str(&format!("{{%{open} if true {close}%}}")),
            "endgeneration" => out.push_str(&format!("{{%{open} endif {close}%}}")),
            _ => out.push_str(&tag[..end + 2]),
        }
        rest = &tag[end + 2..];
    }
    out.push_str(rest);
    out
}

/// How [`dumps`] writes JSON: Python's `json.dumps` options.
#[derive(Debug, Clone)]
struct Dumps {
    indent: Option<usize>,
    /// Between items, and between a key and its value.
    separators: (String, String),
    sort_keys: bool,
    ensure_ascii: bool,
}

/// `tojson` as `transformers` defines it: Python's `json.dumps(value,
/// ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)`,
/// maps in their order (a template's `tool_call.arguments` as written).
fn tojson(
    value: minijinja::Value,
    kwargs: minijinja::value::Kwargs,
) -> std::result::Result<minijinja::Value, minijinja::Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    kwargs.assert_all_used()?;
    let separators = match separators.as_deref() {
        Some([item, key]) => (item.clone(), key.clone()),
        Some(_) => {
            return Err(minijinja::Error::new(
                minijinja::ErrorKind::InvalidOperation,
                "tojson: separators is a pair (item, key)",
            ));
        }
        // Python's defaults: ", " without an indent, "," with one.
        None if indent.is_some() => (",".into(), ": ".into()),
        None => (", ".into(), ": ".into()),
    };
    let options = Dumps {
        indent,
        separators,
        sort_keys: sort_keys.unwrap_or(false),
        ensure_ascii: ensure_ascii.unwrap_or(false),
    };
    Ok(minijinja::Value::from_safe_string(dumps(&value, &options, 0)?))
}

/// A JSON string literal as Python writes it (`ensure_ascii`: every non-ASCII
/// character as `\uXXXX`, astral ones as surrogate pairs).
fn json_string(s: &str, ensure_ascii: bool) -> String {
    let quoted = Json::String(s.to_string()).to_string();
    if !ensure_ascii {
        return quoted;
    }
    let mut out = String::with_capacity(quoted.len());
    for c in quoted.chars() {
        if c.is_ascii() && c != '\x7f' {
            out.push(c);
        } else {
            let mut units = [0u16; 2];
            for u in c.encode_utf16(&mut units) {
                out += &format!("\\u{u:04x}");
            }
        }
    }
    out
}

/// The deepest `tojson` writes (Python's `json.dumps` refuses a value that holds
/// itself; here it is refused this deep).
const MAX_DEPTH: usize = 256;

/// A float as Python's `json.dumps` writes it (`repr`): the shortest digits that read
/// back, positional from 1e-4 up to 1e16 (with `.0` when whole), else `d.ddde±XX`;
/// `Infinity`, `-Infinity`, `NaN`.
fn python_float(x: f64) -> String {
    if x.is_nan() {
        return "NaN".into();
    }
    if x.is_infinite() {
        return if x > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    // Rust's `{:e}` is the shortest round-trip digits: `d[.ddd]e[-]x`.
    let sci = format!("{:e}", x.abs());
    let (mantissa, exponent) = sci.split_once('e').expect("`{:e}` writes an exponent");
    let exponent: i32 = exponent.parse().expect("an integer exponent");
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    let sign = if x.is_sign_negative() { "-" } else { "" };
    if !(-4..16).contains(&exponent) {
        let e_sign = if exponent < 0 { '-' } else { '+' };
        let (head, tail) = digits.split_at(1);
        let dot = if tail.is_empty() { String::new() } else { format!(".{tail}") };
        return format!("{sign}{head}{dot}e{e_sign}{:02}", exponent.abs());
    }
    let point = exponent + 1;
    let text = if point <= 0 {
        format!("0.{}{digits}", "0".repeat((-point) as usize))
    } else if point as usize >= digits.len() {
        format!("{digits}{}.0", "0".repeat(point as usize - digits.len()))
    } else {
        let (whole, frac) = digits.split_at(point as usize);
        format!("{whole}.{frac}")
    };
    format!("{sign}{text}")
}

/// `value` as Python's `json.dumps` writes it with `options`, at nesting `level`.
fn dumps(
    value: &minijinja::Value,
    options: &Dumps,
    level: usize,
) -> std::result::Result<String, minijinja::Error> {
    use minijinja::value::ValueKind;
    if level > MAX_DEPTH {
        return Err(minijinja::Error::new(
            minijinja::ErrorKind::InvalidOperation,
            format!("tojson: nested deeper than {MAX_DEPTH} (a value that holds itself?)"),
        ));
    }
    let items: Vec<String> = match value.kind() {
        ValueKind::Undefined | ValueKind::None => return Ok("null".into()),
        ValueKind::Bool => return Ok(if value.is_true() { "true" } else { "false" }.into()),
        ValueKind::Number if value.is_integer() => return Ok(value.to_string()),
        ValueKind::Number => return Ok(python_float(f64::try_from(value.clone())?)),
        ValueKind::String => {
            return Ok(json_string(value.as_str().unwrap_or(""), options.ensure_ascii));
        }
        ValueKind::Map => {
            let mut keys: Vec<minijinja::Value> = value.try_iter()?.collect();
            if options.sort_keys {
                keys.sort_by_key(|k| k.to_string());
            }
            keys.iter()
                .map(|k| {
                    let v = value.get_item(k)?;
                    let key = json_string(&k.to_string(), options.ensure_ascii);
                    Ok(format!("{key}{}{}", options.separators.1, dumps(&v, options, level + 1)?))
                })
                .collect::<std::result::Result<_, minijinja::Error>>()?
        }
        _ => value
            .try_iter()?
            .map(|v| dumps(&v, options, level + 1))
            .collect::<std::result::Result<_, minijinja::Error>>()?,
    };
    let (open, close) = if value.kind() == ValueKind::Map { ("{", "}") } else { ("[", "]") };
    let item = &options.separators.0;
    Ok(match options.indent {
        _ if items.is_empty() => format!("{open}{close}"),
        None => format!("{open}{}{close}", items.join(item)),
        Some(n) => {
            let inner = " ".repeat(n * (level + 1));
            let outer = " ".repeat(n * level);
            format!("{open}\n{inner}{}\n{outer}{close}", items.join(&format!("{item}\n{inner}")))
        }
    })
}

/// `raise_exception(message)`: the template refuses its input.
fn raise_exception(message: String) -> std::result::Result<minijinja::Value, minijinja::Error> {
    Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, message))
}

/// `strftime_now(format)`: today's date and time (UTC) in `format`'s `%d %m %y %Y %b
/// %B %H %M %S %j %%`.
fn strftime_now(format: String) -> std::result::Result<String, minijinja::Error> {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    Ok(strftime(&format, secs))
}

/// `format` at `secs` past the epoch (UTC).
fn strftime(format: &str, secs: u64) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    let days = (secs / 86_400) as i64;
    let (h, m, s) = (secs / 3600 % 24, secs / 60 % 60, secs % 60);
    // Days to a civil date (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
    let before = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334][(month - 1) as usize];
    let yday = before + day + i64::from(leap && month > 2);
    let name = MONTHS[(month - 1) as usize];
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('d') => out += &format!("{day:02}"),
            Some('m') => out += &format!("{month:02}"),
            Some('Y') => out += &year.to_string(),
            Some('y') => out += &format!("{:02}", year % 100),
            Some('b') => out += &name[..3],
            Some('B') => out += name,
            Some('H') => out += &format!("{h:02}"),
            Some('M') => out += &format!("{m:02}"),
            Some('S') => out += &format!("{s:02}"),
            Some('j') => out += &format!("{yday:03}"),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// The messages of `--chat FILE`: a JSON list of objects, each with a string `role`
/// (and whatever else the template reads), their keys in the file's order.
pub fn read_messages(flag: &str, path: &Path) -> Result<minijinja::Value> {
    let text = files::read_capped(flag, path, LIMIT)?;
    let messages: Json =
        serde_json::from_slice(&text).map_err(|e| bad(flag, path, format!("not JSON: {e}")))?;
    let Some(list) = messages.as_array() else {
        return Err(bad(flag, path, "not a JSON list of messages"));
    };
    if list.is_empty() {
        return Err(bad(flag, path, "an empty conversation: give at least one message"));
    }
    for (k, m) in list.iter().enumerate() {
        if m.get("role").and_then(Json::as_str).is_none() {
            return Err(bad(flag, path, format!("message {k} has no string \"role\"")));
        }
    }
    let messages: minijinja::Value =
        serde_json::from_slice(&text).map_err(|e| bad(flag, path, format!("not JSON: {e}")))?;
    normalize(&messages).map_err(|e| bad(flag, path, e))
}

/// The messages as `apply_chat_template` hands them to the template: each message's
/// keys whose value is `null` dropped; a message with a reasoning (the first of
/// `reasoning_content`, `thinking`, `reasoning` it has) made Python's `{"thinking": r,
/// **message, "reasoning_content": r}` (a `thinking` of its own kept, in front).
fn normalize(
    messages: &minijinja::Value,
) -> std::result::Result<minijinja::Value, minijinja::Error> {
    let mut out = Vec::new();
    for m in messages.try_iter()? {
        let mut pairs: Vec<(String, minijinja::Value)> = Vec::new();
        for k in m.try_iter()? {
            let v = m.get_item(&k)?;
            if !v.is_none() {
                pairs.push((k.to_string(), v));
            }
        }
        let reasoning = ["reasoning_content", "thinking", "reasoning"]
            .iter()
            .find_map(|f| pairs.iter().find(|(k, _)| k == f).map(|(_, v)| v.clone()));
        if let Some(r) = reasoning {
            let mut merged = vec![("thinking".to_string(), r.clone())];
            for (k, v) in pairs {
                match merged.iter_mut().find(|(key, _)| *key == k) {
                    Some(slot) => slot.1 = v,
                    None => merged.push((k, v)),
                }
            }
            match merged.iter_mut().find(|(k, _)| k == "reasoning_content") {
                Some(slot) => slot.1 = r,
                None => merged.push(("reasoning_content".into(), r)),
            }
            pairs = merged;
        }
        out.push(minijinja::Value::from_pairs(pairs));
    }
    Ok(minijinja::Value::from(out))
}

/// The prompt ids of the conversation in `messages_path` for the folder `dir`: its chat
/// template rendered with a generation prompt, encoded by `tokenizer` without adding
/// special tokens.
pub fn chat_prompt_ids(dir: &Path, tokenizer: &Path, messages_path: &Path) -> Result<Vec<i64>> {
    let messages = read_messages("chat", messages_path)?;
    let template = ChatTemplate::of_folder("init", dir)?;
    let text = template.render("chat", &messages)?;
    let tokenizer = crate::data::read_tokenizer(tokenizer)?;
    let encoding = crate::data::guarded(|| tokenizer.encode(text.as_str(), false))?
        .map_err(|e| Error::flag("tokenizer", format!("cannot encode the chat: {e}")))?;
    Ok(encoding.get_ids().iter().map(|&t| i64::from(t)).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Floats as Python's `json.dumps` wrote them (`json.dumps(v)` under CPython 3.11).
    #[test]
    fn floats_are_written_as_python_writes_them() {
        let python = [
            (0.0, "0.0"),
            (-0.0, "-0.0"),
            (1.0, "1.0"),
            (2.5, "2.5"),
            (1e-07, "1e-07"),
            (0.0001, "0.0001"),
            (1.5e-05, "1.5e-05"),
            (1e16, "1e+16"),
            (1e15, "1000000000000000.0"),
            (123456789012345.6, "123456789012345.6"),
            (1e20, "1e+20"),
            (1.5e300, "1.5e+300"),
            (-3.25e-10, "-3.25e-10"),
            (0.1, "0.1"),
            (0.30000000000000004, "0.30000000000000004"),
            (5e-324, "5e-324"),
            (1.7976931348623157e308, "1.7976931348623157e+308"),
            (12345678901234567.0, "1.2345678901234568e+16"),
            (f64::INFINITY, "Infinity"),
            (f64::NEG_INFINITY, "-Infinity"),
            (0.001, "0.001"),
            (100.0, "100.0"),
            (1e-05, "1e-05"),
        ];
        for (x, want) in python {
            assert_eq!(python_float(x), want, "{x:e}");
        }
        assert_eq!(python_float(f64::NAN), "NaN");
    }

    proptest! {
        /// Every finite float's text reads back to it (the shortest digits), in
        /// Python's layout: positional exactly from 1e-4 up to 1e16.
        #[test]
        fn prop_python_floats_read_back(bits in any::<u64>()) {
            let x = f64::from_bits(bits);
            prop_assume!(x.is_finite());
            let text = python_float(x);
            prop_assert_eq!(text.parse::<f64>().unwrap().to_bits(), x.to_bits(), "{}", text);
            let positional = x == 0.0 || (1e-4..1e16).contains(&x.abs());
            prop_assert_eq!(!text.contains('e'), positional, "{}", text);
            prop_assert!(text.contains('.') || text.contains('e'), "{}", text);
        }
    }

    /// `{% generation %}` blocks render their body, whitespace control kept; other
    /// tags are left alone.
    #[test]
    fn generation_blocks_render_their_body() {
        let template = ChatTemplate {
            source: "a {%- generation %} b {% endgeneration -%} c{% if x %}{% endif %}".into(),
            tokens: Default::default(),
        };
        let messages = minijinja::Value::from(Vec::<minijinja::Value>::new());
        assert_eq!(template.render("chat", &messages).unwrap(), "a b c");
        assert_eq!(
            generation_blocks_as_ifs("{%+ generation-%}x{%endgeneration%}{% set g = 1 %}"),
            "{%+ if true -%}x{% endif %}{% set g = 1 %}"
        );
    }

    /// A template that would loop for ever, write without end, or serialize a value
    /// that holds itself is an error, not a hang, an abort or memory exhausted.
    #[test]
    fn runaway_templates_are_refused() {
        let messages = minijinja::Value::from(Vec::<minijinja::Value>::new());
        for source in [
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
            "{% set s = 'x' * 90000000 %}{% for i in range(100) %}{{ s }}{% endfor %}",
            "{% set ns = namespace() %}{% set ns.me = ns %}{{ ns | tojson }}",
        ] {
            let template = ChatTemplate { source: source.into(), tokens: Default::default() };
            assert!(template.render("chat", &messages).is_err(), "{source}");
        }
    }

    /// The date of a known instant, in every directive.
    #[test]
    fn strftime_formats_a_known_instant() {
        // 2024-02-29 13:05:09 UTC.
        let t = 1_709_211_909;
        assert_eq!(strftime("%d %b %Y", t), "29 Feb 2024");
        assert_eq!(strftime("%B %m/%d/%y %H:%M:%S %j %%", t), "February 02/29/24 13:05:09 060 %");
        assert_eq!(strftime("%d %b %Y", 0), "01 Jan 1970");
    }

    /// Python's `json.dumps`: its separators, with and without an indent, key order as
    /// written or sorted, non-ASCII kept or escaped.
    #[test]
    fn tojson_writes_what_json_dumps_writes() {
        let v: minijinja::Value =
            serde_json::from_str(r#"{"b": [1, 2.5, "é😀"], "a": {"c": null, "t": true}}"#).unwrap();
        let d = |indent, sort_keys, ensure_ascii| Dumps {
            indent,
            separators: if indent.is_some() {
                (",".into(), ": ".into())
            } else {
                (", ".into(), ": ".into())
            },
            sort_keys,
            ensure_ascii,
        };
        assert_eq!(
            dumps(&v, &d(None, false, false), 0).unwrap(),
            r#"{"b": [1, 2.5, "é😀"], "a": {"c": null, "t": true}}"#
        );
        assert_eq!(
            dumps(&v, &d(None, true, false), 0).unwrap(),
            r#"{"a": {"c": null, "t": true}, "b": [1, 2.5, "é😀"]}"#
        );
        assert_eq!(
            dumps(&v, &d(None, false, true), 0).unwrap(),
            r#"{"b": [1, 2.5, "\u00e9\ud83d\ude00"], "a": {"c": null, "t": true}}"#
        );
        assert_eq!(
            dumps(&v, &d(Some(2), false, false), 0).unwrap(),
            "{\n  \"b\": [\n    1,\n    2.5,\n    \"é😀\"\n  ],\n  \"a\": {\n    \"c\": null,\n    \"t\": true\n  }\n}"
        );
    }
}
