//! The CNN: images from `.npy` files, data parallel and in pipelines, resumed on
//! another mesh, evaluated; `--init` sets its weights and says its filters.

use meshwork_train::{Config, Data, ModelKind};
use meshwork_types::DType;

use crate::{
    assert_close, config, losses, refused_with, run, write_npy_f32, write_safetensors_f64,
};

#[test]
fn the_cnn_trains_on_images_from_npy_files() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // 64 images 6x6x2: class 1 when the first channel's left half is brighter.
    let (n, h, w, c) = (64, 6, 6, 2);
    let mut x = Vec::new();
    let mut y = Vec::new();
    for i in 0..n {
        let class = i % 2;
        for _r in 0..h {
            for col in 0..w {
                for ch in 0..c {
                    let bright = ch == 0 && (col < w / 2) == (class == 1);
                    let jitter = ((i * 7 + col * 3 + ch) % 5) as f32 * 0.1;
                    x.push(if bright { 1.0 } else { 0.0 } + jitter);
                }
            }
        }
        y.push(class as f32);
    }
    let xp = write_npy_f32(&d.join("x.npy"), &[n, h, w, c], &x);
    let yp = write_npy_f32(&d.join("y.npy"), &[n], &y);
    let images = Data::Npy { x: xp.clone(), y: yp.clone() };
    let cnn = |steps: usize| Config {
        data: images.clone(),
        batch: Some(16),
        steps: Some(steps),
        dtype: Some(DType::F64),
        ..config(ModelKind::Cnn)
    };
    let report = run(&Config { mesh: Some((4, 1)), filters: Some([4, 6]), ..cnn(30) });
    assert!(report.model.contains("on 6x6x2 images"), "{}", report.model);
    assert!(report.summary()[0].contains("on mesh 4x1"), "{:?}", report.summary());
    assert!(report.losses[29] < 0.5 * report.losses[0], "learns: {:?}", report.losses);
    let built_in = run(&Config { steps: Some(40), ..config(ModelKind::Cnn) });
    assert!(built_in.losses[39] < built_in.losses[0], "the built-in images");
    // Saved on one device, resumed on four: the uninterrupted run.
    let whole = losses(&cnn(12));
    let ck = d.join("ck");
    run(&Config { checkpoint_dir: Some(ck.clone()), ..cnn(6) });
    let tail = run(&Config { resume: Some(ck), mesh: Some((4, 1)), ..cnn(12) });
    assert_close(&tail.losses, &whole[6..], 1e-9, "resumed on 4x1");
    // In a pipeline: every step equal to one device's (the run's check) and the mesh's.
    let piped =
        losses(&Config { mesh: Some((2, 1)), stages: Some(2), microbatches: Some(2), ..cnn(12) });
    assert_close(&piped, &whole, 1e-9, "pipeline");
    run(&Config { stages: Some(3), ..cnn(4) });
    refused_with(
        &Config { stages: Some(4), ..config(ModelKind::Cnn) },
        "--stages 4: the CNN has 3 layers",
    );
    let evaluated = run(&Config { eval_every: Some(10), eval_fraction: Some(0.25), ..cnn(20) });
    assert!(
        evaluated
            .summary()
            .iter()
            .any(|l| l.contains("eval         after step 20: loss ") && l.contains(", accuracy "))
    );
    // --init: zero weights and a head bias of [1, 0] make every image's logits [1, 0],
    // so the first loss (both classes evenly) is (ln(1 + e⁻¹) + ln(1 + e)) / 2, and so
    // is the held-out loss at a learning rate too small to move the weights, with an
    // accuracy of one half.
    let zeros = |shape: &[usize]| (shape.to_vec(), vec![0.0; shape.iter().product()]);
    let init = write_safetensors_f64(
        &d.join("init.safetensors"),
        &[
            ("conv1.weight", zeros(&[3, 3, 2, 4])),
            ("conv1.bias", zeros(&[4])),
            ("conv2.weight", zeros(&[3, 3, 4, 6])),
            ("conv2.bias", zeros(&[6])),
            ("head.weight", zeros(&[3 * 3 * 6, 2])),
            ("head.bias", (vec![2], vec![1.0, 0.0])),
        ],
    );
    let want = ((1.0 + (-1f64).exp()).ln() + (1.0 + 1f64.exp()).ln()) / 2.0;
    let l = losses(&Config { mesh: Some((2, 1)), init: Some(init.clone()), ..cnn(3) });
    assert!((l[0] - want).abs() < 1e-12 && l[2] < l[0], "{l:?} vs {want}");
    let still = run(&Config {
        lr: Some(1e-300),
        init: Some(init.clone()),
        eval_every: Some(2),
        eval_fraction: Some(0.25),
        ..cnn(2)
    });
    let (_, eval_loss, accuracy) = still.evals[0];
    assert!((eval_loss - want).abs() < 1e-12 && accuracy == 0.5, "{:?}", still.evals);
    refused_with(
        &Config { init: Some(init), filters: Some([8, 16]), ..cnn(2) },
        "--filters: 8,16 disagrees with --init's convolutions, which have 4,6",
    );
    // One stray label that would make a head of 60001 classes; a NaN pixel; files of
    // the wrong ranks.
    let mut bad_y = y.clone();
    bad_y[5] = 60000.0;
    let stray = write_npy_f32(&d.join("stray.npy"), &[n], &bad_y);
    let mut bad_x = x.clone();
    bad_x[17] = f32::NAN;
    let nan_x = write_npy_f32(&d.join("nan.npy"), &[n, h, w, c], &bad_x);
    for (data, flag) in [
        (Data::Npy { x: yp.clone(), y: yp.clone() }, "--data-x"),
        (Data::Npy { x: xp.clone(), y: xp.clone() }, "--data-y"),
        (Data::Npy { x: xp.clone(), y: stray }, "--data-y"),
        (Data::Npy { x: nan_x, y: yp.clone() }, "--data-x"),
        (Data::Text(xp.clone()), "--text is not the CNN's"),
    ] {
        refused_with(&Config { data, ..config(ModelKind::Cnn) }, flag);
    }
    refused_with(&Config { mesh: Some((1, 2)), ..config(ModelKind::Cnn) }, "--mesh 1x2");
    refused_with(&Config { seq: Some(8), ..config(ModelKind::Cnn) }, "--seq is not the CNN's");
}
