//! Headers checked as the `safetensors` crate checks them, names unique, boxes read
//! exactly (against a brute-force slice of the whole tensor).

use std::ops::Range;

use proptest::prelude::*;

use super::*;

/// A file of `json` as its header and `data` after it.
fn file_of(json: &str, data: &[u8]) -> Vec<u8> {
    let mut b = (json.len() as u64).to_le_bytes().to_vec();
    b.extend(json.as_bytes());
    b.extend(data);
    b
}

fn problem(bytes: &[u8]) -> String {
    parse(bytes).unwrap_err()
}

#[test]
fn a_good_header_lists_every_tensor_in_data_order() {
    let json = r#"{"__metadata__":{"format":"pt"},"b":{"dtype":"F32","shape":[2],"data_offsets":[8,16]},"a":{"dtype":"F64","shape":[1],"data_offsets":[0,8]}}"#;
    let h = parse(&file_of(json, &[0u8; 16])).unwrap();
    let names: Vec<&str> = h.entries.iter().map(|e| e.name.as_str()).collect();
    assert_eq!(names, ["a", "b"]);
    assert_eq!(h.get("b").unwrap().start, 8 + json.len() as u64 + 8);
    assert_eq!(h.metadata.unwrap()["format"], "pt");
}

/// JSON lets a name repeat (serde keeps the last); here it is refused, by name.
#[test]
fn a_name_listed_twice_is_refused_by_name() {
    let json = r#"{"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"w":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}"#;
    let e = problem(&file_of(json, &[0u8; 8]));
    assert!(e.contains("tensor w is listed twice"), "{e}");
}

/// Aliased and overlapping ranges, gaps, sizes that do not match the shape, and data
/// cut short or padded are refused, naming the tensor where there is one.
#[test]
fn aliased_overlapping_cut_or_padded_data_is_refused() {
    let two = |a: &str, b: &str| {
        format!(
            r#"{{"x":{{"dtype":"F32","shape":[2],"data_offsets":{a}}},"y":{{"dtype":"F32","shape":[2],"data_offsets":{b}}}}}"#
        )
    };
    let e = problem(&file_of(&two("[0,8]", "[0,8]"), &[0u8; 8]));
    assert!(e.contains("overlaps") && (e.contains("tensor x") || e.contains("tensor y")), "{e}");
    let e = problem(&file_of(&two("[0,8]", "[4,12]"), &[0u8; 12]));
    assert!(e.contains("tensor y") && e.contains("overlaps"), "{e}");
    let e = problem(&file_of(&two("[0,8]", "[12,20]"), &[0u8; 20]));
    assert!(e.contains("tensor y") && e.contains("gap"), "{e}");
    let e = problem(&file_of(&two("[0,8]", "[8,12]"), &[0u8; 12]));
    assert!(e.contains("tensor y") && e.contains("do not hold"), "{e}");
    let e = problem(&file_of(&two("[0,8]", "[8,16]"), &[0u8; 15]));
    assert!(e.contains("cut short"), "{e}");
    let e = problem(&file_of(&two("[0,8]", "[8,16]"), &[0u8; 17]));
    assert!(e.contains("padded"), "{e}");
    assert!(problem(&[1, 0]).contains("no header length"));
    assert!(problem(&file_of("[]", &[])).contains("header"));
    let mut huge = file_of("{}", &[]);
    huge[..8].copy_from_slice(&u64::MAX.to_le_bytes());
    assert!(problem(&huge).contains("a header of"));
}

/// A shape and a box inside it.
fn shape_and_box() -> impl Strategy<Value = (Vec<usize>, Vec<Range<usize>>)> {
    proptest::collection::vec(1usize..5, 0..4).prop_flat_map(|shape| {
        let ranges: Vec<_> = shape
            .iter()
            .map(|&d| (0..=d).prop_flat_map(move |a| (Just(a), a..=d)).prop_map(|(a, b)| a..b))
            .collect();
        (Just(shape), ranges)
    })
}

proptest! {
    /// Any box of any tensor reads exactly the values a brute-force slice of the whole
    /// tensor holds, in row-major order.
    #[test]
    fn a_box_reads_exactly_its_values((shape, boxed) in shape_and_box()) {
        let count: usize = shape.iter().product();
        let values: Vec<f32> = (0..count).map(|i| i as f32).collect();
        let data: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let json = format!(
            r#"{{"t":{{"dtype":"F32","shape":{shape:?},"data_offsets":[0,{}]}}}}"#,
            data.len()
        );
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.safetensors");
        std::fs::write(&path, file_of(&json, &data)).unwrap();
        let (file, header) = open("--init", &path).unwrap();
        let got = read_box("--init", &path, &file, header.get("t").unwrap(), &boxed).unwrap();
        let got: Vec<f32> =
            got.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
        // Brute force: every flat index whose coordinates lie in the box.
        let want: Vec<f32> = (0..count)
            .filter(|&flat| {
                let mut rest = flat;
                let mut inside = true;
                for d in (0..shape.len()).rev() {
                    let i = rest % shape[d];
                    rest /= shape[d];
                    inside &= boxed[d].contains(&i);
                }
                inside
            })
            .map(|i| values[i])
            .collect();
        prop_assert_eq!(got, want);
        let mut outside = boxed.clone();
        if let Some(r) = outside.first_mut() {
            r.end = shape[0] + 1;
            prop_assert!(read_box("--init", &path, &file, header.get("t").unwrap(), &outside).is_err());
        }
    }
}
