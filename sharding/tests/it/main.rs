//! Public-API tests of meshwork-sharding: the JAX conformance suite.

mod conformance;

#[test]
fn every_oracle_case_passes() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/testdata/oracle/cases.jsonl");
    let text = std::fs::read_to_string(path).expect("vendored oracle present");
    let mut failures = Vec::new();
    let mut total = 0;
    for line in text.lines() {
        total += 1;
        let rec: serde_json::Value = serde_json::from_str(line).expect("valid JSON");
        let bad = conformance::check(&rec);
        if !bad.is_empty() {
            failures.push(format!("{}: {}", rec["id"], bad.join("; ")));
        }
    }
    assert_eq!(total, 2000, "the vendored oracle has 2000 cases");
    assert!(
        failures.is_empty(),
        "{} of {total} cases fail:\n{}",
        failures.len(),
        failures.join("\n")
    );
}
