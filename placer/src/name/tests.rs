//! TF's `device_name_utils_test.cc`, case by case (D1–D11 of the test list).

use super::*;

fn p(s: &str) -> DeviceName {
    DeviceName::parse(s).unwrap_or_else(|e| panic!("{s}: {e}"))
}

fn show(s: &str) -> String {
    p(s).to_string()
}

#[test]
fn d1_basic() {
    assert_eq!(
        DeviceName::full("hello", 1, 2, "CPU", 3).to_string(),
        "/job:hello/replica:1/task:2/device:CPU:3"
    );
    for bad in [
        "foobar",
        "/job:123/replica:1/task:2/device:GPU:3",
        "/job:123/replica:1/task:2/gpu:",
        "/job:123/replica:1/task:2/device:gpu:",
        "/job:foo/replica:-1/task:2/device:GPU:3",
        "/job:foo/replica:1/task:-2/device:GPU:3",
        "/job:foo/replica:1/task:2/bar:3",
        "/job:foo/replica:1/task:2/device:GPU:3/extra",
        "cpu:0",
        "/foo:bar",
    ] {
        assert_eq!(
            DeviceName::parse(bad),
            Err(Error::MalformedDeviceName { input: bad.into() }),
            "{bad}"
        );
    }
    let n = p("/job:foo/replica:1/task:2/device:GPU:3");
    assert_eq!(n, DeviceName::full("foo", 1, 2, "GPU", 3));
    assert_eq!(p("/job:foo_bar/replica:1/task:2/device:GPU:3").job.as_deref(), Some("foo_bar"));
    assert_eq!(
        DeviceName::parse_full_or_local("/job:foo_bar/replica:1/task:2/device:GPU:3")
            .unwrap()
            .job
            .as_deref(),
        Some("foo_bar")
    );
    let want =
        DeviceName { replica: Some(4), device_type: Some("GPU".into()), ..DeviceName::default() };
    assert_eq!(p("/job:*/replica:4/gpu:*"), want);
    assert_eq!(p("/job:*/replica:4/device:GPU:*"), want);
    assert_eq!(p("/job:*/device:GPU/replica:4"), want);
    assert_eq!(p("/gpu:*/job:*/replica:4"), want);
    let special = p("/job:*/replica:4/device:myspecialdevice:13");
    assert_eq!((special.device_type.as_deref(), special.id), (Some("myspecialdevice"), Some(13)));
    assert_eq!(p("/"), DeviceName::default());
    assert_eq!(p("/job:*/replica:4/device:GPU:5").id, Some(5));
    // Address spaces.
    let same = |a: &str, b: &str| p(a).is_same_address_space(&p(b));
    assert!(same("/job:foo/replica:1/task:2/cpu:1", "/job:foo/replica:1/task:2/device:GPU:2"));
    assert!(!same("/job:foo/replica:1/task:2/cpu:1", "/job:foo/replica:1/task:3/device:GPU:2"));
    assert!(!same("/job:foo/replica:1/task:2/cpu:1", "/job:foo/replica:10/task:2/device:GPU:2"));
    assert!(!same("/job:foo/replica:1/task:2/cpu:1", "/job:bar/replica:1/task:2/device:GPU:2"));
    // Local names.
    let local = |t: &str, id| {
        DeviceName { device_type: Some(t.into()), id: Some(id), ..DeviceName::default() }
            .local_name()
    };
    assert_eq!(local("CPU", 1), "/device:CPU:1");
    assert_eq!(local("MySpecialDevice", 13), "/device:MySpecialDevice:13");
    assert_eq!(p("/job:foo/replica:1/task:2/device:CPU:3").local_name(), "/device:CPU:3");
    assert_eq!(p("/job:foo/replica:1/task:2/cpu:3").local_name(), "/device:CPU:3");
    assert_eq!(p("/job:foo/replica:1/task:2/device:abc:73").local_name(), "/device:abc:73");
    assert_eq!(DeviceName::parse_local("CPU:10").unwrap().id, Some(10));
    assert_eq!(
        DeviceName::parse_full_or_local("CPU:10").unwrap().device_type.as_deref(),
        Some("CPU")
    );
    for bad in ["cpu:abc", "abc:", "abc", "myspecialdevice"] {
        assert!(DeviceName::parse_local(bad).is_err(), "{bad}");
    }
    // Every subset of the components roundtrips, legacy types upper-cased.
    for (device, printed) in
        [("CPU:3", "CPU:3"), ("GPU:3", "GPU:3"), ("cpu:3", "CPU:3"), ("gpu:3", "GPU:3")]
    {
        for mask in 0..16 {
            let mut legacy = String::new();
            let mut explicit = String::new();
            let mut expected = String::new();
            for (bit, part) in [(1, "/job:foo"), (2, "/replica:1"), (4, "/task:2")] {
                if mask & bit != 0 {
                    legacy.push_str(part);
                    explicit.push_str(part);
                    expected.push_str(part);
                }
            }
            if mask & 8 != 0 {
                legacy.push_str(&format!("/{device}"));
                explicit.push_str(&format!("/device:{device}"));
            }
            let legacy_expected = if mask & 8 != 0 {
                format!("{expected}/device:{printed}")
            } else {
                expected.clone()
            };
            let explicit_expected =
                if mask & 8 != 0 { format!("{expected}/device:{device}") } else { expected };
            assert_eq!(show(&legacy), legacy_expected, "{legacy}");
            assert_eq!(show(&explicit), explicit_expected, "{explicit}");
        }
    }
    assert_eq!(show("/device:someDevice:3"), "/device:someDevice:3");
    assert!(!p("/job:work/replica:1/task:3/device:GPU:*").is_compatible_with(&p("/device:CPU:*")));
    assert!(p("/job:work/replica:1/task:3").is_compatible_with(&p("/device:CPU:*")));
}

#[test]
fn d2_is_complete_specification() {
    let name = p("/job:work/replica:1/task:2/device:GPU:3");
    for pattern in [
        "/job:*",
        "/job:*/replica:*",
        "/job:*/task:*",
        "/job:*/replica:*/task:*",
        "/job:*/replica:*/gpu:*",
        "/gpu:*",
    ] {
        assert!(p(pattern).matches(&name), "{pattern}");
    }
    assert!(!p("/cpu:*").matches(&name));
    assert!(!p("/device:GPU:2").matches(&p("/job:work/replica:1/task:2/device:GPU:1")));
}

#[test]
fn d3_is_specification() {
    let spec = |less: &str, more: &str| p(less).is_specification_of(&p(more));
    let full = "/job:work/replica:1/task:2/device:GPU:3";
    for (less, more) in [
        ("/job:*", full),
        ("/job:*", "/job:work/replica:1/device:GPU:3"),
        ("/job:*", "/job:work/replica:1"),
        ("/job:*", "/replica:1"),
        ("/job:*", "/job:work"),
        ("/job:*/replica:*", full),
        ("/job:work/replica:1/gpu:*", full),
        ("/job:work/replica:1/device:GPU:3", full),
        ("/job:work/replica:1/task:2", full),
        ("/job:work/replica:*/task:2", full),
        ("/task:*", "/job:*/replica:1/task:2/device:GPU:3"),
        ("/task:2", "/job:*/replica:1/task:2/device:GPU:3"),
        ("/cpu:*", "/job:*/replica:1/task:2/cpu:1"),
        ("/cpu:0", "/cpu:0"),
        ("/gpu:*", "/job:worker/replica:1/task:2/device:GPU:3"),
    ] {
        assert!(spec(less, more), "{less} ⊑ {more}");
    }
    for (less, more) in [
        (full, "/gpu:*"),
        ("/cpu:*", "/job:*/replica:1/task:2"),
        ("/cpu:*", "/job:*/replica:1/task:2/device:GPU:1"),
        ("/cpu:*", "/job:work/replica:1/task:2/device:GPU:3"),
        ("/device:GPU:2", "/job:*/replica:1/task:2/device:GPU:1"),
        ("/job:work/replica:*/task:0", full),
        ("/job:work/replica:0/task:2", "/job:work/replica:*/task:2/device:GPU:3"),
    ] {
        assert!(!spec(less, more), "{less} ⋢ {more}");
    }
}

#[test]
fn d4_split_device_name() {
    let split = |s: &str| p(s).split();
    assert_eq!(
        split("/job:foo/replica:1/task:2/cpu:1"),
        Some(("/job:foo/replica:1/task:2".into(), "CPU:1".into()))
    );
    assert_eq!(
        split("/job:foo/cpu:1/task:2/replica:1"),
        Some(("/job:foo/replica:1/task:2".into(), "CPU:1".into()))
    );
    assert_eq!(split("/device:GPU:3"), Some((String::new(), "GPU:3".into())));
    assert!(DeviceName::parse("gpu:3").is_err());
    assert_eq!(split("/job:foo/task:2/replica:1"), None);
    assert_eq!(
        split("/device:myspecialdevice:3"),
        Some((String::new(), "myspecialdevice:3".into()))
    );
}

fn merged(a: &str, b: &str, mode: MergeMode) -> Result<String, MergeConflict> {
    let mut target = p(a);
    target.merge(&p(b), mode).map(|()| target.to_string())
}

#[test]
fn d5_merge_dev_names() {
    let both = |a: &str, b: &str, want: &str| {
        assert_eq!(merged(a, b, MergeMode::Hard).as_deref(), Ok(want), "{a} ⊕ {b}");
        assert_eq!(merged(b, a, MergeMode::Hard).as_deref(), Ok(want), "{b} ⊕ {a}");
    };
    both("", "", "");
    both(
        "/job:foo/replica:1/task:2/cpu:1",
        "/job:foo/replica:1/task:2/cpu:1",
        "/job:foo/replica:1/task:2/device:CPU:1",
    );
    both("", "/job:foo", "/job:foo");
    both("", "/replica:2", "/replica:2");
    both("", "/task:7", "/task:7");
    both("", "/device:GPU:1", "/device:GPU:1");
    both("/job:foo", "/task:7", "/job:foo/task:7");
    both("/job:foo", "/device:GPU:1", "/job:foo/device:GPU:1");
    both("/job:foo/replica:0", "/replica:0/task:1", "/job:foo/replica:0/task:1");
    both("", "/gpu:*", "/device:GPU:*");
    both("/gpu:*", "/gpu:*", "/device:GPU:*");
    both("/device:GPU:1", "/gpu:*", "/device:GPU:1");
    for (a, b, field) in [
        ("/job:foo", "/job:bar", "incompatible jobs"),
        ("/replica:0", "/replica:1", "incompatible replicas"),
        ("/task:0", "/task:1", "incompatible tasks"),
        ("/gpu:*", "/cpu:*", "incompatible types"),
        ("/device:GPU:0", "/device:GPU:1", "incompatible ids"),
    ] {
        let err = merged(a, b, MergeMode::Hard).unwrap_err();
        assert!(err.to_string().contains(field), "{err}");
    }
    assert_eq!(
        merged("/gpu:*", "/cpu:*", MergeMode::Hard).unwrap_err().to_string(),
        "Cannot merge devices with incompatible types: '/device:GPU:*' and '/device:CPU:*'"
    );
}

#[test]
fn d6_merge_soft() {
    assert_eq!(merged("/gpu:*", "/cpu:1", MergeMode::Soft).as_deref(), Ok(""));
    assert_eq!(merged("/cpu:*", "/device:GPU:1", MergeMode::Soft).as_deref(), Ok(""));
    assert_eq!(
        merged("/device:GPU:1", "/device:GPU:2", MergeMode::Soft).as_deref(),
        Ok("/device:GPU:*")
    );
}

#[test]
fn d7_merge_override() {
    let ovr = |a: &str, b: &str| merged(a, b, MergeMode::Override).unwrap();
    assert_eq!(ovr("", "/job:foo"), "/job:foo");
    assert_eq!(ovr("/job:foo", "/device:GPU:1"), "/job:foo/device:GPU:1");
    assert_eq!(ovr("/gpu:0", "/cpu:1"), "/device:CPU:1");
    assert_eq!(ovr("/gpu:*", "/cpu:1"), "/device:CPU:1");
    assert_eq!(ovr("/cpu:*", "/device:GPU:1"), "/device:GPU:1");
    assert_eq!(ovr("/device:GPU:1", "/device:GPU:2"), "/device:GPU:2");
    assert_eq!(ovr("/job:foo/CPU:*", "/device:GPU:1"), "/job:foo/device:GPU:1");
    assert_eq!(ovr("/cpu:*", "/job:foo/device:GPU:1"), "/job:foo/device:GPU:1");
    assert_eq!(ovr("/task:0/cpu:*", "/device:GPU:1"), "/task:0/device:GPU:1");
    assert_eq!(ovr("/cpu:*", "/task:0/device:GPU:1"), "/task:0/device:GPU:1");
    // Address-space conflicts are errors even here.
    assert!(merged("/job:foo", "/job:bar", MergeMode::Override).is_err());
}

#[test]
fn d8_merge_unset() {
    let unset = |a: &str, b: &str| {
        let mut t = p(a);
        t.merge_unset(&p(b));
        t.to_string()
    };
    assert_eq!(unset("/job:foo", "/job:bar"), "/job:foo");
    assert_eq!(unset("/job:bar", "/job:foo"), "/job:bar");
    assert_eq!(unset("/replica:1", "/replica:2"), "/replica:1");
    assert_eq!(unset("/task:1", "/task:2"), "/task:1");
    assert_eq!(unset("/gpu:*", "/cpu:*"), "/device:GPU:*");
    assert_eq!(unset("/device:GPU:1", "/device:GPU:2"), "/device:GPU:1");
    assert_eq!(unset("/job:foo/device:GPU", "/job:bar"), "/job:foo/device:GPU:*");
    assert_eq!(unset("/job:bar", "/job:foo/device:GPU"), "/job:bar/device:GPU:*");
    assert_eq!(unset("", "/job:foo/task:3"), "/job:foo/task:3");
}

#[test]
fn d9_names_for_device_mappings() {
    assert_eq!(
        p("/job:foo/replica:10/task:0/device:GPU:1").names_for_device_mappings(),
        ["/job:foo/replica:10/task:0/device:GPU:1", "/job:foo/replica:10/task:0/gpu:1"]
    );
    for partial in [
        "/replica:10/task:0/device:GPU:1",
        "/job:foo/task:0/device:GPU:1",
        "/job:foo/replica:10/device:GPU:1",
        "/job:foo/replica:10/task:0/device:GPU",
        "/job:foo/replica:10/task:0",
    ] {
        assert!(p(partial).names_for_device_mappings().is_empty(), "{partial}");
    }
}

#[test]
fn d10_canonicalize_device_name() {
    let base = "/job:foo/replica:10/task:0/device:CPU:0";
    let canon = |name: &str| DeviceName::canonicalize(name, base);
    assert_eq!(
        canon("/job:foo/replica:10/task:0/device:CPU:1").unwrap(),
        "/job:foo/replica:10/task:0/device:CPU:1"
    );
    assert_eq!(
        canon("/job:foo/task:0/replica:10/cpu:1").unwrap(),
        "/job:foo/replica:10/task:0/device:CPU:1"
    );
    assert_eq!(
        canon("/job:foo/task:0/replica:10/device:CPU:1").unwrap(),
        "/job:foo/replica:10/task:0/device:CPU:1"
    );
    assert_eq!(canon("CPU:0").unwrap(), "/job:foo/replica:10/task:0/device:CPU:0");
    assert_eq!(
        canon("/job:foo/task:0/replica/cpu:1"),
        Err(Error::MalformedDeviceName { input: "/job:foo/task:0/replica/cpu:1".into() })
    );
    assert!(DeviceName::canonicalize("CPU:0", "/job:foo/replica:10/task:0").is_err());
    assert!(DeviceName::canonicalize("CPU:0", "/job:foo/replica:10/task:0/device").is_err());
}

#[test]
fn d11_compare_full_names() {
    let less = |a: &str, b: &str| compare_full_names(a, b) == Ordering::Less;
    assert!(less(
        "/job:foo/replica:0/task:0/device:CPU:0",
        "/job:foo/replica:0/task:0/device:CPU:1"
    ));
    assert!(!less(
        "/job:foo/replica:0/task:0/device:CPU:0",
        "/job:foo/replica:0/task:0/device:CPU:0"
    ));
    assert!(less(
        "/job:bar/replica:0/task:0/device:CPU:0",
        "/job:foo/replica:0/task:0/device:CPU:0"
    ));
    assert!(less(
        "/job:foo/replica:0/task:0/device:CPU:0",
        "/job:foo/replica:1/task:0/device:CPU:0"
    ));
    assert!(less(
        "/job:foo/replica:0/task:0/device:CPU:0",
        "/job:foo/replica:0/task:1/device:CPU:0"
    ));
    assert!(less(
        "/job:foo/replica:0/task:0/device:CPU:0",
        "/job:foo/replica:0/task:0/device:GPU:0"
    ));
    assert!(less(
        "/job:foo/replica:0/task:0/device:CPU:2",
        "/job:foo/replica:0/task:0/device:CPU:10"
    ));
    assert!(less("garbage", "/job:foo/replica:0/task:0/device:CPU:0"));
    assert!(less("/replica:0/task:0/device:CPU:1", "/job:foo/replica:0/task:0/device:CPU:0"));
}
