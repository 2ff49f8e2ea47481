//! Fuzzes the JSON graph loader and the placer behind it: no input may panic; a graph
//! that loads is placed (or refused with a typed error) on a fixed device set.
//!
//! `cd placer/fuzz && RUSTC_BOOTSTRAP=1 cargo fuzz run graph_json`

#![no_main]

use libfuzzer_sys::fuzz_target;
use meshwork_placer::{ArgKind, DeviceSet, OpDef, PlacerOptions, Registry, graph_from_json, place};

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let Ok(graph) = graph_from_json(text) else { return };
    let mut ops = Registry::new();
    ops.insert("Const", OpDef::new(&[], &[ArgKind::Value], &["CPU", "GPU"]))
        .insert("Var", OpDef::new(&[], &[ArgKind::Resource], &["CPU"]))
        .insert("Read", OpDef::new(&[ArgKind::Resource], &[ArgKind::Value], &["CPU", "GPU"]))
        .insert("Add", OpDef::new(&[ArgKind::Value, ArgKind::Value], &[ArgKind::Value], &["GPU"]));
    let devices = DeviceSet::new(&["/job:a/replica:0/task:0/device:CPU:0", "/job:a/replica:0/task:0/device:GPU:0"]).unwrap();
    for soft in [false, true] {
        let options = PlacerOptions { allow_soft_placement: soft, log_device_placement: true };
        if let Ok(p) = place(&graph, &devices, &ops, options) {
            assert_eq!(p.devices().len(), graph.len());
        }
    }
});
