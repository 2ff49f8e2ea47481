//! Every program of the vendored JAX oracle (`testdata/cases.jsonl`, 1500 programs of
//! 44 op kinds) built with the builder: each op is accepted, every output's dtype and
//! shape is the one JAX computed, the program's text reads back to it, and the
//! reference interpreter's outputs and `vjp`'s gradients are JAX's within the oracle's
//! tolerance `|got - want| <= 1e-9 (1 + |want|)` (bool and int outputs exactly).

use meshwork_program::{Program, Tensor, Value, fast, reference};
use serde_json::Value as Json;

#[path = "case.rs"]
mod case;
use case::{build, tensor};

/// Whether `got` matches `want` by the oracle's rule.
fn close(got: &Tensor, want: &Tensor) -> Result<(), String> {
    if got.spec() != want.spec() {
        return Err(format!("{} vs JAX {}", got.spec(), want.spec()));
    }
    let (g, w) = (got.to_f64(), want.to_f64());
    let float = want.spec().dtype.is_float();
    for (k, (a, b)) in g.iter().zip(&w).enumerate() {
        let ok = if float { (a - b).abs() <= 1e-9 * (1.0 + b.abs()) } else { a == b };
        if !ok {
            return Err(format!("element {k}: {a} vs JAX {b}"));
        }
    }
    Ok(())
}

/// Rule 1: the program builds, each output's dtype and shape is JAX's, and its text
/// reads back to it. Returns the program for the other rules.
fn check_specs(case: &Json) -> Result<Program, String> {
    let program = build(case).map_err(|e| format!("does not build: {e}"))?;
    let want = case["expected"].as_array().ok_or("no `expected`")?;
    if program.results().len() != want.len() {
        return Err(format!("{} outputs, JAX {}", program.results().len(), want.len()));
    }
    for (k, (&v, w)) in program.results().iter().zip(want).enumerate() {
        let got = program.spec(v).ok_or("a result is not a value")?;
        let want = tensor(w).spec();
        if *got != want {
            return Err(format!("output {k} is {got}, JAX {want}"));
        }
    }
    let text = program.to_string();
    match text.parse::<Program>() {
        Ok(back) if back == program && back.to_string() == text => Ok(program),
        other => Err(format!("the text does not read back: {other:?}")),
    }
}

/// The case's inputs.
fn inputs(case: &Json) -> Result<Vec<Tensor>, String> {
    Ok(case["inputs"].as_array().ok_or("no `inputs`")?.iter().map(tensor).collect())
}

/// An interpreter: the reference's or the fast one's `evaluate`.
pub(crate) type Interpreter = fn(&Program, &[Tensor]) -> meshwork_program::Result<Vec<Tensor>>;

/// Both interpreters, by name.
pub(crate) const INTERPRETERS: [(&str, Interpreter); 2] =
    [("reference", reference::evaluate), ("fast", fast::evaluate)];

/// Anything that runs a program on host tensors: an interpreter, or XLA through a
/// plugin (the conformance example's `--backend xla`).
pub(crate) type Runner<'a> = &'a dyn Fn(&Program, &[Tensor]) -> Result<Vec<Tensor>, String>;

/// Rule 2: the interpreter's outputs are JAX's within the tolerance.
fn check_outputs(case: &Json, program: &Program, run: Interpreter) -> Result<(), String> {
    check_outputs_with(case, program, &|p: &Program, i: &[Tensor]| {
        run(p, i).map_err(|e| e.to_string())
    })
}

/// Rule 2 for any runner.
fn check_outputs_with(case: &Json, program: &Program, run: Runner<'_>) -> Result<(), String> {
    let got = run(program, &inputs(case)?)?;
    let want = case["expected"].as_array().ok_or("no `expected`")?;
    if got.len() != want.len() {
        return Err(format!("{} outputs, JAX {}", got.len(), want.len()));
    }
    for (k, (g, w)) in got.iter().zip(want).enumerate() {
        close(g, &tensor(w)).map_err(|e| format!("output {k}: {e}"))?;
    }
    Ok(())
}

/// Rule 3: `vjp` with respect to every f64 input, run by the interpreter with
/// the oracle's cotangents, gives JAX's gradients within the tolerance; the gradient
/// program's text (with `pad`, `scatter_add` and the conv2d backprops) reads back.
fn check_gradients(case: &Json, program: &Program, run: Interpreter) -> Result<(), String> {
    check_gradients_with(case, program, &|p: &Program, i: &[Tensor]| {
        run(p, i).map_err(|e| e.to_string())
    })
}

/// Rule 3 for any runner.
fn check_gradients_with(case: &Json, program: &Program, run: Runner<'_>) -> Result<(), String> {
    let wrt: Vec<(usize, String)> = case["inputs"]
        .as_array()
        .ok_or("no `inputs`")?
        .iter()
        .enumerate()
        .filter(|(_, i)| i["dtype"] == "f64")
        .map(|(k, i)| (k, i["name"].as_str().unwrap_or_default().to_string()))
        .collect();
    let values: Vec<Value> = wrt.iter().map(|(k, _)| Value(*k as u32)).collect();
    let back = meshwork_program::vjp(program, &values).map_err(|e| format!("vjp: {e}"))?;
    if back.to_string().parse::<Program>().as_ref() != Ok(&back) {
        return Err("the gradient program's text does not read back".into());
    }
    let mut feed = inputs(case)?;
    let cotangents = case["cotangents"].as_array().ok_or("no `cotangents`")?;
    feed.extend(cotangents.iter().filter(|c| !c.is_null()).map(tensor));
    let grads = run(&back, &feed)?;
    let n = program.results().len();
    for (k, (_, name)) in wrt.iter().enumerate() {
        let got = grads.get(n + k).ok_or(format!("no gradient of {name}"))?;
        close(got, &tensor(&case["grads"][name.as_str()]))
            .map_err(|e| format!("gradient of {name}: {e}"))?;
    }
    Ok(())
}

/// Every rule for one oracle case, or the first it breaks (what the conformance example
/// runs over any oracle file).
#[allow(dead_code)] // used by the conformance example, which includes this file
pub(crate) fn check_case(case: &Json) -> Result<(), String> {
    let program = check_specs(case)?;
    for (name, run) in INTERPRETERS {
        check_outputs(case, &program, run).map_err(|e| format!("{name} interpreter: {e}"))?;
        check_gradients(case, &program, run).map_err(|e| format!("{name} interpreter: {e}"))?;
    }
    Ok(())
}

/// Every rule for one oracle case with `run` in place of the interpreters (the
/// conformance example's other back ends).
#[allow(dead_code)] // used by the conformance example, which includes this file
pub(crate) fn check_case_with(case: &Json, name: &str, run: Runner<'_>) -> Result<(), String> {
    let program = check_specs(case)?;
    check_outputs_with(case, &program, run).map_err(|e| format!("{name}: {e}"))?;
    check_gradients_with(case, &program, run).map_err(|e| format!("{name}: {e}"))
}

/// Applies `rule` to every vendored case; asserts all 1500 pass it.
#[cfg(test)]
fn all_cases_pass(rule: impl Fn(&Json) -> Result<(), String>) {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/testdata/cases.jsonl");
    let text = std::fs::read_to_string(path).unwrap();
    let (mut passed, mut failed) = (0, Vec::new());
    for line in text.lines() {
        let case: Json = serde_json::from_str(line).unwrap();
        match rule(&case) {
            Ok(()) => passed += 1,
            Err(e) => failed.push(format!("{}: {e}", case["id"])),
        }
    }
    let shown: Vec<&String> = failed.iter().take(20).collect();
    assert!(failed.is_empty(), "{} of 1500 failed:\n{shown:#?}", failed.len());
    assert_eq!(passed, 1500);
}

#[test]
fn every_oracle_program_builds_with_jaxs_output_specs() {
    all_cases_pass(|case| check_specs(case).map(drop));
}

#[test]
fn the_reference_interpreter_computes_jaxs_outputs() {
    all_cases_pass(|case| check_outputs(case, &build(case).unwrap(), reference::evaluate));
}

#[test]
fn the_fast_interpreter_computes_jaxs_outputs() {
    all_cases_pass(|case| check_outputs(case, &build(case).unwrap(), fast::evaluate));
}

/// Gradients for all 1500 programs, by the reference interpreter.
#[test]
fn vjp_gives_jaxs_gradients() {
    all_cases_pass(|case| check_gradients(case, &build(case).unwrap(), reference::evaluate));
}

/// Gradients for all 1500 programs, by the fast interpreter.
#[test]
fn vjp_gives_jaxs_gradients_with_the_fast_interpreter() {
    all_cases_pass(|case| check_gradients(case, &build(case).unwrap(), fast::evaluate));
}
