//! One decoder block partitioned Megatron-style on a `data × model` mesh: prints the
//! per-device program (the `--dump` form: layouts, then the program text with its
//! collectives) of the forward pass, then the collectives of the gradient program with
//! the launch that carries each (independent all-reduces over one axis share one), and
//! their counts per mesh axis. The loss is the mean square of the block's output, so
//! the backward pass reads the forward's result, as a model's loss does.
//!
//! ```text
//! cargo run --release -p meshwork-strategy --example spmd_block [DATA MODEL]
//! ```

#![allow(clippy::print_stdout, missing_docs)]

use meshwork_nn as nn;
use meshwork_program::{Builder, Value};
use meshwork_strategy::partition::{megatron_spec, partition};
use meshwork_strategy::sharding::Mesh;
use meshwork_strategy::sharding::spmd::Layout;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let (data, model) = match args[..] {
        [d, m] => (d, m),
        _ => (1, 2),
    };
    let mut b = Builder::new();
    let x = b.param("x", format!("f32[{},16,64]", 4 * data).parse()?)?;
    let y = b.scope("layers.0", |b| nn::decoder_block(b, x, 4, 256))?;
    let sq = b.square(y)?;
    let loss = b.reduce_mean(sq, &[0, 1, 2], false)?;
    let program = b.finish(&[loss])?;
    let mesh = Mesh::iota(&[("data", data), ("model", model)])?;
    let layouts =
        |p: &meshwork_program::Program| -> Result<Vec<Option<Layout>>, Box<dyn std::error::Error>> {
            p.params()
                .iter()
                .map(|q| {
                    let spec = if q.name == "x" {
                        "P('data')".parse()?
                    } else {
                        megatron_spec(&q.name, q.spec.shape.rank())
                    };
                    Ok(Some(Layout::from_spec(&mesh, &spec, q.spec.shape.rank())?))
                })
                .collect()
        };
    let inputs = layouts(&program)?;
    let forward = partition(&program, &mesh, &inputs, &[None])?;
    println!("{forward}");
    let wrt: Vec<Value> = (0..program.params().len()).map(|k| Value(k as u32)).collect();
    let grads = meshwork_program::grad(&program, loss, &wrt)?;
    let mut outputs = vec![None];
    outputs.extend(inputs.iter().cloned());
    let backward = partition(&grads, &mesh, &inputs, &outputs)?;
    println!("\ncollectives of the forward pass:");
    for c in forward.collectives() {
        println!(
            "  launch {}: {} over {:?} of {} ({} bytes)",
            c.launch, c.op, c.axes, c.value, c.bytes
        );
    }
    println!("collectives of forward + backward (the gradient program):");
    for c in backward.collectives() {
        println!(
            "  launch {}: {} over {:?} of {} ({} bytes)",
            c.launch, c.op, c.axes, c.value, c.bytes
        );
    }
    for (name, p) in [("forward", &forward), ("forward + backward", &backward)] {
        for axis in mesh.axis_names() {
            let on: Vec<_> = p.collectives().iter().filter(|c| c.axes == [axis.clone()]).collect();
            let mut launches: Vec<usize> = on.iter().map(|c| c.launch).collect();
            launches.sort_unstable();
            launches.dedup();
            println!(
                "{name}: {} collectives over {axis:?} in {} launches",
                on.len(),
                launches.len()
            );
        }
    }
    Ok(())
}
