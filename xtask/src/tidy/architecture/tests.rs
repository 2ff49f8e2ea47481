use super::*;

#[test]
fn unsafe_is_found_in_code_only() {
    assert_eq!(first_unsafe("fn f() {}\nunsafe fn g() {}\n"), Some(2));
    assert_eq!(first_unsafe("#[unsafe(no_mangle)]\nextern \"C\" fn f() {}\n"), Some(1));
    assert_eq!(first_unsafe("fn f() { let x = unsafe { g() }; }"), Some(1));
    // Comments, doc comments and literals are not code.
    assert_eq!(first_unsafe("// unsafe\n/// unsafe\n//! unsafe\nfn f() {}\n"), None);
    assert_eq!(first_unsafe("/* unsafe /* nested */ still unsafe */ fn f() {}"), None);
    assert_eq!(first_unsafe("/** unsafe */\nconst S: &str = \"an unsafe \\\" word\";"), None);
    assert_eq!(first_unsafe("const S: &str = r#\"a \"quoted\" unsafe\"#;"), None);
    assert_eq!(first_unsafe("const S: &[u8] = br##\"x\"# unsafe\"##;"), None);
    assert_eq!(first_unsafe("const B: &[u8] = b\"unsafe\"; const C: &CStr = c\"unsafe\";"), None);
    assert_eq!(first_unsafe("#[doc = \"unsafe\"]\nfn f() {}\n"), None);
    // Names that merely contain the word, and raw identifiers, are not the keyword.
    assert_eq!(first_unsafe("#![deny(unsafe_code)]\nfn unsafe_free() {}\nfn r#unsafe() {}"), None);
    // A quote in a char literal opens no string; a lifetime is no char literal.
    assert_eq!(first_unsafe("let q = '\"'; unsafe {}"), Some(1));
    assert_eq!(first_unsafe("let q = '\\''; let e = b'\\\\'; unsafe {}"), Some(1));
    assert_eq!(first_unsafe("fn f<'a>(x: &'a str) -> &'static str { unsafe { g(x) } }"), Some(1));
    // Lines are counted through multi-line strings and comments.
    assert_eq!(first_unsafe("const S: &str = \"one\ntwo\";\n/*\n*/\nunsafe fn g() {}"), Some(5));
    assert_eq!(first_unsafe("const S: &str = r\"one\ntwo\";\nunsafe fn g() {}"), Some(3));
}

/// A command line in clap's derive style, with the usual distractions.
const ARGS_RS: &str = r#"
//! The command line. An `enum Other { Nope }` in a comment is not the enum.

use clap::{Parser, Subcommand};

/// The commands, for `help COMMAND`.
pub(crate) const COMMANDS: [&str; 2] = ["train", "shard"];

#[derive(Debug, Subcommand)]
enum Unrelated {
    Nope,
}

#[derive(Debug, Parser)]
#[command(name = "meshwork", version)]
pub(crate) struct Cli {
    /// The command; `enum` in a doc.
    #[command(subcommand)]
    pub(crate) command: Option<Command>,
}

/// A command.
#[derive(Debug, Subcommand)]
pub(crate) enum Command {
    /// Train a model, "quoted" and {braced}.
    Train(Box<TrainArgs>),
    /// Two words.
    GpuBench { dir: PathBuf, #[arg(long)] quick: bool },
    #[command(name = "mesh-shard", alias = "ms")]
    Shard(ShardArgs),
    /// Hidden commands are commands too.
    #[command(hide = true)]
    Version,
    #[command(external_subcommand)]
    External(Vec<String>),
}
"#;

#[test]
fn subcommands_are_read_from_the_clap_enum() {
    assert_eq!(subcommands(ARGS_RS).unwrap(), ["train", "gpu-bench", "mesh-shard", "version"]);
    assert_eq!(kebab("Train"), "train");
    assert_eq!(kebab("GpuBench"), "gpu-bench");
    assert_eq!(kebab("HTTPServer"), "http-server");
    assert_eq!(kebab("Xla2Test"), "xla2-test");
}

#[test]
fn a_command_line_tidy_cannot_read_is_an_error() {
    let no_field = ARGS_RS.replace("#[command(subcommand)]", "");
    assert!(subcommands(&no_field).unwrap_err().contains("#[command(subcommand)]"));
    let no_enum = ARGS_RS.replace("enum Command", "enum Commands");
    assert!(subcommands(&no_enum).unwrap_err().contains("enum Command"));
    let flattened = ARGS_RS.replace("#[command(hide = true)]", "#[command(flatten)]");
    assert!(subcommands(&flattened).unwrap_err().contains("flattens"));
}

#[test]
fn the_binary_s_commands_are_read() {
    let source = fs::read_to_string(crate::workspace_root().join(ARGS)).unwrap();
    let commands = subcommands(&source).unwrap();
    assert!(commands.iter().any(|c| c == "train"), "{commands:?}");
}

#[test]
fn members_are_read_from_the_workspace_table() {
    let toml = r#"
[package]
members = ["not-this"]

[workspace]
resolver = "3"
members = [
    "types", # the vocabulary, with a ] in its comment
    "xla/mock",
    'bridges/candle',
]
exclude = ["fuzz"]

[workspace.package]
members = ["nor-this"]
"#;
    assert_eq!(members(toml).unwrap(), ["types", "xla/mock", "bridges/candle"]);
    assert_eq!(members("[workspace]\nmembers = [\"a\", \"b/c\"]\n").unwrap(), ["a", "b/c"]);
    assert!(members("[workspace]\nresolver = \"3\"\n").unwrap_err().contains("no `members`"));
    assert!(members("[workspace]\nmembers = [\"a\",\n").unwrap_err().contains("not closed"));
    assert!(members("[workspace]\nmembers = [\"crates/*\"]\n").unwrap_err().contains("glob"));
}

#[test]
fn a_section_s_items_are_its_backticked_list_lines() {
    let doc = "# Map\n## A\n- `x` why\n\n### Inside\n- `y`\ntext `z`\n## B\n- `w`\n";
    assert_eq!(listed(doc, "## A").unwrap(), [(3, "x".to_owned()), (6, "y".to_owned())]);
    assert_eq!(listed(doc, "## B").unwrap(), [(9, "w".to_owned())]);
    assert_eq!(listed(doc, "## C"), None);
}

/// A map that agrees with [`tree`].
const DOC_OK: &str = "\
# Architecture

`types/` and `xla/mock/`, and `io/`, which is not a member yet.

## The `meshwork` commands

- `meshwork train` trains.
- `meshwork generate` generates.

`help COMMAND` is prose, not an item.

## Where `unsafe` is

- `executor/src/direct.rs` — lent buffers.
- `xla/src/pjrt.rs` — the FFI.

## Next
";

fn tree() -> Tree {
    Tree {
        members: vec!["types".into(), "xla/mock".into()],
        commands: vec!["train".into(), "generate".into()],
        unsafe_files: vec![("executor/src/direct.rs".into(), 54), ("xla/src/pjrt.rs".into(), 41)],
    }
}

#[test]
fn a_true_map_passes() {
    assert_eq!(check_doc(DOC_OK, &tree()), Vec::<String>::new());
}

#[test]
fn an_unnamed_member_is_reported() {
    let mut tree = tree();
    tree.members.push("bridges/candle".into());
    let problems = check_doc(DOC_OK, &tree);
    assert_eq!(problems.len(), 1, "{problems:#?}");
    assert!(problems[0].starts_with("Cargo.toml: workspace member `bridges/candle`"));
    assert!(problems[0].contains("`bridges/candle/`"), "{}", problems[0]);
}

#[test]
fn missing_and_extra_commands_are_reported() {
    let mut tree = tree();
    tree.commands = vec!["train".into(), "tokenize".into()];
    let problems = check_doc(DOC_OK, &tree);
    assert_eq!(problems.len(), 2, "{problems:#?}");
    assert!(problems[0].starts_with("ARCHITECTURE.md:8: lists command `meshwork generate`"));
    assert!(problems[1].starts_with("cli/src/args.rs: command `tokenize` is not listed"));

    let malformed = DOC_OK.replace("- `meshwork train`", "- `train`");
    let problems = check_doc(&malformed, &self::tree());
    assert_eq!(problems.len(), 2, "{problems:#?}");
    assert!(problems[0].starts_with("ARCHITECTURE.md:7: `train`"), "{}", problems[0]);
    assert!(problems[1].contains("command `train` is not listed"), "{}", problems[1]);
}

#[test]
fn missing_and_extra_unsafe_files_are_reported() {
    let mut tree = tree();
    tree.unsafe_files = vec![("xla/src/pjrt.rs".into(), 41), ("cli/src/main.rs".into(), 63)];
    let problems = check_doc(DOC_OK, &tree);
    assert_eq!(problems.len(), 2, "{problems:#?}");
    assert!(problems[0].starts_with("ARCHITECTURE.md:14: lists `executor/src/direct.rs`"));
    assert!(problems[0].contains("holds no `unsafe` code"), "{}", problems[0]);
    assert!(problems[1].starts_with("cli/src/main.rs:63: holds `unsafe` code"));
    assert!(problems[1].contains("- `cli/src/main.rs`"), "{}", problems[1]);
}

#[test]
fn missing_sections_are_reported() {
    let problems = check_doc("# Architecture\n`types/` `xla/mock/`\n", &tree());
    assert_eq!(problems.len(), 2, "{problems:#?}");
    assert!(problems[0].contains("no section `## The `meshwork` commands`"), "{}", problems[0]);
    assert!(problems[1].contains("no section `## Where `unsafe` is`"), "{}", problems[1]);
}
