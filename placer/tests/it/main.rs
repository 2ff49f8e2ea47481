//! Public-API tests of meshwork-placer: the TensorFlow conformance suite.

mod bad_input;
mod conformance;
mod cost;
mod graphs;
mod props;
mod report;
mod tf_placer_test;

#[test]
fn every_oracle_case_passes() {
    let text = include_str!("../../testdata/oracle/cases.jsonl");
    let mut lines = text.lines();
    let registry = conformance::registry(lines.next().expect("header")).expect("valid header");
    let mut failures = Vec::new();
    let mut total = 0;
    for (n, line) in lines.enumerate() {
        total += 1;
        let bad = conformance::check(&registry, line);
        if !bad.is_empty() {
            failures.push(format!("case {n}: {}", bad.join("; ")));
        }
    }
    assert_eq!(total, 300, "the vendored oracle has 300 cases");
    assert!(
        failures.is_empty(),
        "{} of {total} cases fail:\n{}",
        failures.len(),
        failures.join("\n")
    );
}
