//! DDP and FSDP against plain candle on one device: the same losses and parameters of
//! the same global batch, in f64, for SGD and AdamW; replicas bit-identical; a failing
//! replica ends the step everywhere and changes nothing; checkpoints and safetensors
//! across replica counts and layouts.

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};
use candle_nn::{
    AdamW, Linear, Module, Optimizer, ParamsAdamW, SGD, VarBuilder, VarMap, linear, loss,
};
use meshwork_candle::{Config, Devices, Error, Trainer};

/// An MLP whose sizes do not divide by 4: FSDP's shards are uneven, some empty.
struct Mlp {
    l1: Linear,
    l2: Linear,
}

const IN: usize = 6;
const HIDDEN: usize = 5;
const OUT: usize = 3;
const ROWS: usize = 16;

impl Mlp {
    fn new(vb: VarBuilder<'_>) -> candle_core::Result<Mlp> {
        Ok(Mlp { l1: linear(IN, HIDDEN, vb.pp("l1"))?, l2: linear(HIDDEN, OUT, vb.pp("l2"))? })
    }

    fn loss(&self, b: &[Tensor]) -> candle_core::Result<Tensor> {
        let h = self.l1.forward(&b[0])?.tanh()?;
        loss::cross_entropy(&self.l2.forward(&h)?, &b[1])
    }
}

/// A batch for step `s`: rows of a fixed pattern, labels from their sums.
fn batch(s: usize) -> Vec<Tensor> {
    let x: Vec<f64> =
        (0..ROWS * IN).map(|i| (((i * 7 + s * 13) % 23) as f64 - 11.0) / 7.0).collect();
    let x = Tensor::from_vec(x, (ROWS, IN), &Device::Cpu).unwrap();
    let y: Vec<u32> = (0..ROWS).map(|r| ((r * 5 + s) % OUT) as u32).collect();
    vec![x, Tensor::from_vec(y, ROWS, &Device::Cpu).unwrap()]
}

/// Plain candle on one device from `init`: every step's loss and the final values.
fn reference<O: Optimizer>(
    init: &[(String, Tensor)],
    config: O::Config,
    steps: usize,
) -> (Vec<f64>, HashMap<String, Tensor>) {
    let map = VarMap::new();
    let model = Mlp::new(VarBuilder::from_varmap(&map, DType::F64, &Device::Cpu)).unwrap();
    for (name, t) in init {
        map.data().lock().unwrap()[name].set(t).unwrap();
    }
    let mut opt = O::new(map.all_vars(), config).unwrap();
    let mut losses = Vec::new();
    for s in 0..steps {
        let l = model.loss(&batch(s)).unwrap();
        losses.push(l.to_scalar::<f64>().unwrap());
        opt.backward_step(&l).unwrap();
    }
    let values = map
        .data()
        .lock()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.clone(), v.as_tensor().clone()))
        .collect();
    (losses, values)
}

fn values(t: &Tensor) -> Vec<f64> {
    t.flatten_all().unwrap().to_vec1::<f64>().unwrap()
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-12 * b.abs().max(1e-300)
}

/// Every value of `got` within 1e-12 of `want`'s, relative to the tensor's largest
/// value (a value near zero after cancellation keeps the tensor's rounding).
fn close_all(got: &Tensor, want: &Tensor) -> Result<(), String> {
    let (g, w) = (values(got), values(want));
    let scale = w.iter().fold(0f64, |m, x| m.max(x.abs())).max(1e-300);
    match g.iter().zip(&w).find(|(a, b)| (*a - *b).abs() > 1e-12 * scale) {
        Some((a, b)) => Err(format!("{a} vs {b} (largest {scale})")),
        None if g.len() == w.len() => Ok(()),
        None => Err(format!("{} values vs {}", g.len(), w.len())),
    }
}

/// Trains on `replicas` replicas with `config` and checks every loss and final value
/// against plain candle; returns the trainer.
fn check<O>(replicas: usize, config: Config, opt: O::Config, steps: usize) -> Trainer<Mlp, O>
where
    O: Optimizer + Send + 'static,
    O::Config: Clone + Send + Sync + 'static,
{
    let what = format!("{:?} on {replicas}", config.parallel);
    let devices = Devices::cpu(replicas).unwrap();
    let mut t =
        Trainer::<Mlp, O>::new(&devices, config.with_dtype(DType::F64), opt.clone(), Mlp::new)
            .unwrap();
    let init = t.parameters().unwrap();
    let (want, final_values) = reference::<O>(&init, opt, steps);
    for (s, w) in want.iter().enumerate() {
        let got = t.step(&batch(s), |m: &Mlp, b: &[Tensor]| m.loss(b)).unwrap();
        assert!(close(got, *w), "{what} step {s}: {got} vs one device's {w}");
    }
    for (name, v) in t.parameters().unwrap() {
        if let Err(e) = close_all(&v, &final_values[&name]) {
            panic!("{what} {name}: {e} (one device's)");
        }
    }
    t
}

#[test]
fn ddp_and_fsdp_give_one_devices_losses_for_sgd_and_adamw() {
    let adamw = ParamsAdamW { lr: 0.05, weight_decay: 0.1, ..Default::default() };
    for replicas in [1, 2, 4] {
        check::<SGD>(replicas, Config::ddp(), 0.3, 6);
        check::<AdamW>(replicas, Config::ddp(), adamw.clone(), 6);
    }
    for replicas in [2, 4] {
        check::<SGD>(replicas, Config::fsdp(), 0.3, 6);
        check::<AdamW>(replicas, Config::fsdp(), adamw.clone(), 6);
        // Another dim, and buckets of one parameter each.
        let other = Config::fsdp().with_shard_dim("l1.weight", 1).with_bucket_bytes(1);
        check::<AdamW>(replicas, other, adamw.clone(), 4);
    }
}

#[test]
fn ddp_replicas_stay_bit_identical_and_fsdp_shards_split_the_model_once() {
    let adamw = ParamsAdamW { lr: 0.05, ..Default::default() };
    let ddp = check::<AdamW>(4, Config::ddp().with_bucket_bytes(64), adamw.clone(), 5);
    let hashes = ddp.replica_hashes().unwrap();
    assert!(hashes.iter().all(|&h| h == hashes[0]), "{hashes:x?}");
    let fsdp = check::<AdamW>(4, Config::fsdp(), adamw, 2);
    let whole: usize = ddp.resident_parameter_bytes()[0];
    let shards = fsdp.resident_parameter_bytes();
    assert_eq!(shards.iter().sum::<usize>(), whole, "the shards cover the model once");
    // Uneven (XLA's padded layout): l1's 5 rows as 2, 2, 1, 0 and l2's 3 as 1, 1, 1, 0.
    let bytes = |l1: usize, l2: usize| 8 * (l1 * (IN + 1) + l2 * (HIDDEN + 1));
    assert_eq!(shards, [bytes(2, 1), bytes(2, 1), bytes(1, 1), bytes(0, 0)]);
}

/// A marker row that makes the loss fail, on replica 2's slice (rows 8..12 of 16).
fn poisoned(s: usize) -> Vec<Tensor> {
    let mut b = batch(s);
    let mut x = values(&b[0]);
    x[9 * IN] = 1e9;
    b[0] = Tensor::from_vec(x, (ROWS, IN), &Device::Cpu).unwrap();
    b
}

#[test]
fn a_failing_replica_ends_the_step_everywhere_and_changes_nothing() {
    for config in [Config::ddp(), Config::fsdp()] {
        let devices = Devices::cpu(4).unwrap();
        let mut t =
            Trainer::<Mlp, SGD>::new(&devices, config.with_dtype(DType::F64), 0.3, Mlp::new)
                .unwrap();
        t.step(&batch(0), |m: &Mlp, b: &[Tensor]| m.loss(b)).unwrap();
        let before = t.replica_hashes().unwrap();
        let err = t
            .step(&poisoned(1), |m: &Mlp, b: &[Tensor]| {
                if b[0].max_all()?.to_scalar::<f64>()? > 1e8 {
                    candle_core::bail!("a marker row in this replica's slice");
                }
                m.loss(b)
            })
            .unwrap_err();
        let text = err.to_string();
        assert!(
            matches!(err, Error::Devices(_))
                && text.contains("replica 2")
                && text.contains("marker row"),
            "{text}"
        );
        assert_eq!(t.replica_hashes().unwrap(), before, "no replica stepped");
        let err = t
            .step(&poisoned(1), |m: &Mlp, b: &[Tensor]| {
                assert!(b[0].max_all()?.to_scalar::<f64>()? < 1e8, "the user's code panics");
                m.loss(b)
            })
            .unwrap_err();
        assert!(err.to_string().contains("replica 2 panicked"), "{err}");
        assert_eq!(t.replica_hashes().unwrap(), before, "no replica stepped");
        // The trainer goes on.
        assert!(t.step(&batch(1), |m: &Mlp, b: &[Tensor]| m.loss(b)).unwrap().is_finite());
    }
}

#[test]
fn bad_input_is_a_typed_error() {
    let devices = Devices::cpu(4).unwrap();
    let mut t =
        Trainer::<Mlp, SGD>::new(&devices, Config::ddp().with_dtype(DType::F64), 0.1, Mlp::new)
            .unwrap();
    let mut b = batch(0);
    b[0] = b[0].narrow(0, 0, 6).unwrap();
    assert!(matches!(
        t.step(&b, |m: &Mlp, b: &[Tensor]| m.loss(b)),
        Err(Error::Batch { input: 0, rows: 6, replicas: 4 })
    ));
    let e = Trainer::<Mlp, SGD>::new(
        &devices,
        Config::fsdp().with_shard_dim("l2.bias", 1),
        0.1,
        Mlp::new,
    )
    .err()
    .unwrap();
    assert!(matches!(e, Error::Shard { .. }), "{e}");
    let e = Trainer::<Mlp, SGD>::new(
        &devices,
        Config::fsdp().with_shard_dim("l3.bias", 0),
        0.1,
        Mlp::new,
    )
    .err()
    .unwrap();
    assert!(e.to_string().contains("l3.bias"), "{e}");
    let e = Trainer::<Mlp, SGD>::new(&devices, Config::ddp().with_bucket_bytes(0), 0.1, Mlp::new)
        .err()
        .unwrap();
    assert!(matches!(e, Error::Config { .. }), "{e}");
    let e = Trainer::<Mlp, SGD>::new(&devices, Config::ddp().with_dtype(DType::U8), 0.1, Mlp::new)
        .err()
        .unwrap();
    assert!(matches!(e, Error::DType { .. }), "{e}");
    let vector = |m: &Mlp, b: &[Tensor]| m.l1.forward(&b[0])?.sum(0);
    let e = t.step(&batch(0), vector).unwrap_err();
    assert!(e.to_string().contains("scalar"), "{e}");
}

#[test]
fn checkpoints_restore_on_another_replica_count_and_layout() {
    let tmp_dir = tempfile::tempdir().unwrap();
    let dir = tmp_dir.path().to_path_buf();
    let adamw = ParamsAdamW { lr: 0.05, ..Default::default() };
    let saved = check::<AdamW>(4, Config::fsdp(), adamw.clone(), 3);
    saved.save(dir.join("fsdp4"), Some(&serde_json::json!({"step": 3}))).unwrap();
    let want = saved.parameters().unwrap();
    for (replicas, config) in
        [(2, Config::ddp()), (2, Config::fsdp()), (3, Config::fsdp()), (1, Config::ddp())]
    {
        let devices = Devices::cpu(replicas).unwrap();
        let mut t = Trainer::<Mlp, AdamW>::new(
            &devices,
            config.with_dtype(DType::F64),
            adamw.clone(),
            Mlp::new,
        )
        .unwrap();
        t.restore(dir.join("fsdp4")).unwrap();
        for ((n, g), (_, w)) in t.parameters().unwrap().iter().zip(&want) {
            assert_eq!(values(g), values(w), "{n} on {replicas}");
        }
        // And back: a DDP save restores into FSDP on 4.
        if replicas == 2 && t.parallel() == meshwork_candle::Parallel::Ddp {
            t.save(dir.join("ddp2"), None).unwrap();
            let devices = Devices::cpu(4).unwrap();
            let mut f = Trainer::<Mlp, AdamW>::new(
                &devices,
                Config::fsdp().with_dtype(DType::F64),
                adamw.clone(),
                Mlp::new,
            )
            .unwrap();
            f.restore(dir.join("ddp2")).unwrap();
            for ((n, g), (_, w)) in f.parameters().unwrap().iter().zip(&want) {
                assert_eq!(values(g), values(w), "{n} via DDP");
            }
        }
    }
    // Never over something that exists.
    assert!(saved.save(dir.join("fsdp4"), None).is_err());
}

#[test]
fn a_safetensors_file_loads_with_each_replica_reading_its_shards() {
    let tmp_dir = tempfile::tempdir().unwrap();
    let dir = tmp_dir.path().to_path_buf();
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("init.safetensors");
    let mut init = HashMap::new();
    for (name, shape) in [
        ("l1.weight", vec![HIDDEN, IN]),
        ("l1.bias", vec![HIDDEN]),
        ("l2.weight", vec![OUT, HIDDEN]),
        ("l2.bias", vec![OUT]),
    ] {
        let n: usize = shape.iter().product();
        let v: Vec<f64> = (0..n).map(|i| (i as f64 * 0.37).sin()).collect();
        init.insert(name.to_string(), Tensor::from_vec(v, shape, &Device::Cpu).unwrap());
    }
    candle_core::safetensors::save(&init, &path).unwrap();
    for (replicas, config) in [
        (4, Config::fsdp()),
        (3, Config::fsdp().with_shard_dim("l1.weight", 1)),
        (2, Config::ddp()),
    ] {
        let devices = Devices::cpu(replicas).unwrap();
        let t = Trainer::<Mlp, SGD>::from_safetensors(
            &devices,
            config.with_dtype(DType::F64),
            0.1,
            &path,
            Mlp::new,
        )
        .unwrap();
        for (name, v) in t.parameters().unwrap() {
            assert_eq!(values(&v), values(&init[&name]), "{name} on {replicas}");
        }
    }
    let mut wrong = init.clone();
    wrong.insert("l2.bias".into(), Tensor::zeros(4, DType::F64, &Device::Cpu).unwrap());
    candle_core::safetensors::save(&wrong, dir.join("wrong.safetensors")).unwrap();
    let devices = Devices::cpu(2).unwrap();
    let e = Trainer::<Mlp, SGD>::from_safetensors(
        &devices,
        Config::fsdp(),
        0.1,
        dir.join("wrong.safetensors"),
        Mlp::new,
    )
    .err()
    .unwrap();
    assert!(matches!(e, Error::Load { .. }) && e.to_string().contains("l2.bias"), "{e}");
}

/// An SGD whose next update fails once, on whichever replica gets there first.
struct Flaky(SGD);

static FAIL_NEXT: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

impl Optimizer for Flaky {
    type Config = f64;
    fn new(vars: Vec<candle_core::Var>, lr: f64) -> candle_core::Result<Flaky> {
        Ok(Flaky(SGD::new(vars, lr)?))
    }
    fn step(&mut self, grads: &candle_core::backprop::GradStore) -> candle_core::Result<()> {
        if FAIL_NEXT.swap(false, std::sync::atomic::Ordering::SeqCst) {
            candle_core::bail!("the optimizer failed");
        }
        self.0.step(grads)
    }
    fn learning_rate(&self) -> f64 {
        self.0.learning_rate()
    }
    fn set_learning_rate(&mut self, lr: f64) {
        self.0.set_learning_rate(lr)
    }
}

#[test]
fn an_optimizer_that_fails_after_others_stepped_stops_the_trainer_until_a_restore() {
    let tmp_dir = tempfile::tempdir().unwrap();
    let dir = tmp_dir.path().to_path_buf();
    for config in [Config::ddp(), Config::fsdp()] {
        let devices = Devices::cpu(4).unwrap();
        let mut t =
            Trainer::<Mlp, Flaky>::new(&devices, config.with_dtype(DType::F64), 0.3, Mlp::new)
                .unwrap();
        t.step(&batch(0), |m: &Mlp, b: &[Tensor]| m.loss(b)).unwrap();
        let path = dir.join(format!("{:?}", t.parallel()));
        t.save(&path, None).unwrap();
        FAIL_NEXT.store(true, std::sync::atomic::Ordering::SeqCst);
        let e = t.step(&batch(1), |m: &Mlp, b: &[Tensor]| m.loss(b)).unwrap_err();
        assert!(e.to_string().contains("the optimizer failed"), "{e}");
        let e = t.step(&batch(1), |m: &Mlp, b: &[Tensor]| m.loss(b)).unwrap_err();
        assert!(matches!(e, Error::Diverged { step: 1 }), "{e}");
        t.restore(&path).unwrap();
        assert_eq!(t.steps(), 1, "the step count comes back with the checkpoint");
        assert!(t.step(&batch(1), |m: &Mlp, b: &[Tensor]| m.loss(b)).unwrap().is_finite());
    }
}

/// A model with a layer only some replicas' slices use and one no slice uses: the
/// has-gradient flags decide what each optimizer steps.
struct Branchy {
    mlp: Mlp,
    aux: Linear,
    /// Registered with the model, used by no loss: it never has a gradient.
    #[allow(dead_code)]
    unused: Linear,
}

impl Branchy {
    fn new(vb: VarBuilder<'_>) -> candle_core::Result<Branchy> {
        Ok(Branchy {
            mlp: Mlp::new(vb.pp("mlp"))?,
            aux: linear(IN, 2, vb.pp("aux"))?,
            unused: linear(IN, 2, vb.pp("unused"))?,
        })
    }

    /// A slice's loss: the MLP's, plus the aux layer's mean output when the slice's
    /// first label is 0.
    fn loss(&self, b: &[Tensor]) -> candle_core::Result<Tensor> {
        let base = self.mlp.loss(b)?;
        if b[1].get(0)?.to_scalar::<u32>()? == 0 {
            base + (self.aux.forward(&b[0])?.mean_all()? * 0.1)?
        } else {
            Ok(base)
        }
    }
}

#[test]
fn parameters_some_or_no_replicas_use_step_as_one_device_would() {
    let adamw = ParamsAdamW { lr: 0.05, weight_decay: 0.1, ..Default::default() };
    let n = 4;
    for config in [Config::ddp(), Config::fsdp()] {
        let devices = Devices::cpu(n).unwrap();
        let mut t = Trainer::<Branchy, AdamW>::new(
            &devices,
            config.with_dtype(DType::F64),
            adamw.clone(),
            Branchy::new,
        )
        .unwrap();
        let init = t.parameters().unwrap();
        // One device: the mean of the replicas' slice losses, each slice as a replica
        // sees it — the loss whose gradient the replicas' average is.
        let map = VarMap::new();
        let model = Branchy::new(VarBuilder::from_varmap(&map, DType::F64, &Device::Cpu)).unwrap();
        for (name, v) in &init {
            map.data().lock().unwrap()[name].set(v).unwrap();
        }
        let mut opt = AdamW::new(map.all_vars(), adamw.clone()).unwrap();
        let mut used_aux = 0;
        for s in 0..5 {
            let b = batch(s);
            let per = ROWS / n;
            let mut total = Tensor::zeros((), DType::F64, &Device::Cpu).unwrap();
            for r in 0..n {
                let slice: Vec<Tensor> =
                    b.iter().map(|t| t.narrow(0, r * per, per).unwrap()).collect();
                used_aux += usize::from(slice[1].get(0).unwrap().to_scalar::<u32>().unwrap() == 0);
                total = (total + model.loss(&slice).unwrap()).unwrap();
            }
            let want = (total / n as f64).unwrap();
            let got = t.step(&b, |m: &Branchy, b: &[Tensor]| m.loss(b)).unwrap();
            let w = want.to_scalar::<f64>().unwrap();
            assert!(close(got, w), "{:?} step {s}: {got} vs {w}", t.parallel());
            opt.backward_step(&want).unwrap();
        }
        assert!(used_aux > 0 && used_aux < 5 * n, "some slices use aux: {used_aux}");
        let reference = map.data().lock().unwrap().clone();
        for (name, v) in t.parameters().unwrap() {
            if let Err(e) = close_all(&v, reference[&name].as_tensor()) {
                panic!("{:?} {name}: {e}", t.parallel());
            }
        }
        let start: HashMap<String, Tensor> = init.into_iter().collect();
        let now: HashMap<String, Tensor> = t.parameters().unwrap().into_iter().collect();
        assert_eq!(values(&now["unused.weight"]), values(&start["unused.weight"]), "never stepped");
    }
}

/// A CNN with BatchNorm: its running statistics are written by the forward and have
/// no gradient.
struct Normed {
    conv: candle_nn::Conv2d,
    bn: candle_nn::BatchNorm,
    head: Linear,
}

impl Normed {
    fn new(vb: VarBuilder<'_>) -> candle_core::Result<Normed> {
        Ok(Normed {
            conv: candle_nn::conv2d(1, 3, 3, Default::default(), vb.pp("conv"))?,
            bn: candle_nn::batch_norm(3, candle_nn::BatchNormConfig::default(), vb.pp("bn"))?,
            head: linear(3 * 2 * 2, OUT, vb.pp("head"))?,
        })
    }

    fn loss(&self, b: &[Tensor]) -> candle_core::Result<Tensor> {
        use candle_nn::ModuleT;
        let x = b[0]
            .reshape((b[0].dim(0)?, 1, 2, 3))?
            .pad_with_zeros(2, 1, 1)?
            .pad_with_zeros(3, 1, 0)?;
        let h = self.bn.forward_t(&self.conv.forward(&x)?, true)?.relu()?;
        loss::cross_entropy(&self.head.forward(&h.flatten_from(1)?)?, &b[1])
    }
}

#[test]
fn buffers_the_forward_writes_are_replica_zeros_everywhere() {
    let mut stats = Vec::new();
    let mut init: Option<HashMap<String, Tensor>> = None;
    for config in [Config::ddp(), Config::fsdp()] {
        let devices = Devices::cpu(4).unwrap();
        let config = config.with_dtype(DType::F64);
        let mut t = match init.clone() {
            None => Trainer::<Normed, SGD>::new(&devices, config, 0.1, Normed::new).unwrap(),
            Some(v) => {
                Trainer::<Normed, SGD>::with_values(&devices, config, 0.1, v, Normed::new).unwrap()
            }
        };
        let start: HashMap<String, Tensor> = t.parameters().unwrap().into_iter().collect();
        init.get_or_insert_with(|| start.clone());
        for s in 0..4 {
            t.step(&batch(s), |m: &Normed, b: &[Tensor]| m.loss(b)).unwrap();
        }
        let now: HashMap<String, Tensor> = t.parameters().unwrap().into_iter().collect();
        assert_ne!(values(&now["bn.running_mean"]), values(&start["bn.running_mean"]), "moved");
        if t.parallel() == meshwork_candle::Parallel::Ddp {
            let h = t.replica_hashes().unwrap();
            assert!(h.iter().all(|&x| x == h[0]), "DDP replicas stay bit-identical: {h:x?}");
        }
        stats.push((values(&now["bn.running_mean"]), values(&now["bn.running_var"])));
    }
    // The same statistics (replica 0's) whether whole or sharded.
    for (a, b) in stats[0].0.iter().zip(&stats[1].0).chain(stats[0].1.iter().zip(&stats[1].1)) {
        assert!(close(*a, *b), "{stats:?}");
    }
}

/// A layer of a model of units: linear, then tanh unless it is the last.
struct Layer {
    lin: Linear,
    last: bool,
}

impl Module for Layer {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let y = self.lin.forward(x)?;
        if self.last { Ok(y) } else { y.tanh() }
    }
}

/// Layer `k` of IN → HIDDEN → HIDDEN → OUT.
fn layer(k: usize, vb: VarBuilder<'_>) -> candle_core::Result<Layer> {
    let (i, o) = match k {
        0 => (IN, HIDDEN),
        1 => (HIDDEN, HIDDEN),
        _ => (HIDDEN, OUT),
    };
    Ok(Layer { lin: linear(i, o, vb.pp(format!("layer{k}")))?, last: k == 2 })
}

#[test]
fn fsdp_units_gather_each_layer_and_give_one_devices_losses() {
    let adamw = ParamsAdamW { lr: 0.05, weight_decay: 0.1, ..Default::default() };
    for replicas in [2, 4] {
        let devices = Devices::cpu(replicas).unwrap();
        let mut t = Trainer::<meshwork_candle::Units, AdamW>::units(
            &devices,
            Config::fsdp().with_dtype(DType::F64),
            adamw.clone(),
            3,
            layer,
        )
        .unwrap();
        let init = t.parameters().unwrap();
        let map = VarMap::new();
        let vb = VarBuilder::from_varmap(&map, DType::F64, &Device::Cpu);
        let layers: Vec<Layer> = (0..3).map(|k| layer(k, vb.clone()).unwrap()).collect();
        for (name, v) in &init {
            map.data().lock().unwrap()[name].set(v).unwrap();
        }
        let mut opt = AdamW::new(map.all_vars(), adamw.clone()).unwrap();
        for s in 0..5 {
            let b = batch(s);
            let mut x = b[0].clone();
            for l in &layers {
                x = l.forward(&x).unwrap();
            }
            let want = loss::cross_entropy(&x, &b[1]).unwrap();
            let got = t
                .step_units(&b, |out: &Tensor, b: &[Tensor]| loss::cross_entropy(out, &b[1]))
                .unwrap();
            let w = want.to_scalar::<f64>().unwrap();
            assert!(close(got, w), "units on {replicas}, step {s}: {got} vs {w}");
            opt.backward_step(&want).unwrap();
        }
        let reference = map.data().lock().unwrap().clone();
        for (name, v) in t.parameters().unwrap() {
            if let Err(e) = close_all(&v, reference[&name].as_tensor()) {
                panic!("units on {replicas}, {name}: {e}");
            }
        }
    }
    // Units own their parameters.
    let devices = Devices::cpu(2).unwrap();
    let shared = |_: usize, vb: VarBuilder<'_>| linear(IN, IN, vb.pp("same"));
    let e = Trainer::<meshwork_candle::Units, SGD>::units(&devices, Config::fsdp(), 0.1, 2, shared)
        .err()
        .unwrap();
    assert!(matches!(e, Error::Builder { .. }), "{e}");
}

#[test]
fn a_run_saved_with_its_optimizer_state_resumes_on_another_layout_as_if_uninterrupted() {
    use meshwork_candle::optim::AdamW as StatefulAdamW;
    let tmp_dir = tempfile::tempdir().unwrap();
    let dir = tmp_dir.path().to_path_buf();
    let adamw = ParamsAdamW { lr: 0.05, weight_decay: 0.1, ..Default::default() };
    // The bridge's AdamW is candle's, bit for bit: DDP with it equals plain candle's.
    let mut t = check::<StatefulAdamW>(4, Config::fsdp(), adamw.clone(), 3);
    let path = dir.join("fsdp4");
    t.save_with_optimizer(&path, None).unwrap();
    let rest: Vec<f64> =
        (3..6).map(|s| t.step(&batch(s), |m: &Mlp, b: &[Tensor]| m.loss(b)).unwrap()).collect();
    for (replicas, config) in [(2, Config::ddp()), (2, Config::fsdp()), (1, Config::ddp())] {
        let devices = Devices::cpu(replicas).unwrap();
        let config = config.with_dtype(DType::F64);
        let mut r =
            Trainer::<Mlp, StatefulAdamW>::new(&devices, config.clone(), adamw.clone(), Mlp::new)
                .unwrap();
        r.restore_with_optimizer(&path).unwrap();
        assert_eq!(r.steps(), 3);
        for (s, want) in (3..6).zip(&rest) {
            let got = r.step(&batch(s), |m: &Mlp, b: &[Tensor]| m.loss(b)).unwrap();
            assert!(
                close(got, *want),
                "{:?} on {replicas}, step {s}: {got} vs {want}",
                r.parallel()
            );
        }
        // Without the optimizer's state the run is another one.
        let mut fresh =
            Trainer::<Mlp, StatefulAdamW>::new(&devices, config, adamw.clone(), Mlp::new).unwrap();
        fresh.restore(&path).unwrap();
        let got = fresh.step(&batch(3), |m: &Mlp, b: &[Tensor]| m.loss(b)).unwrap();
        let second = fresh.step(&batch(4), |m: &Mlp, b: &[Tensor]| m.loss(b)).unwrap();
        assert!(close(got, rest[0]) && !close(second, rest[1]), "{second} vs {}", rest[1]);
    }
}

/// On 8 replicas with `aux.weight` split along its 6 columns, replica 4 holds an
/// empty shard of `mlp.l2.*` (3 rows) and a non-empty one of `aux.weight` after it:
/// the optimizer, which holds only non-empty shards, must get each state back. (The
/// model's loss depends on how the batch is sliced, so both runs use 8 replicas.)
#[test]
fn optimizer_state_finds_its_shard_past_empty_ones() {
    use meshwork_candle::optim::AdamW as StatefulAdamW;
    let tmp_dir = tempfile::tempdir().unwrap();
    let dir = tmp_dir.path().to_path_buf();
    let adamw = ParamsAdamW { lr: 0.05, weight_decay: 0.1, ..Default::default() };
    let config = || Config::fsdp().with_dtype(DType::F64).with_shard_dim("aux.weight", 1);
    let devices = Devices::cpu(8).unwrap();
    let mut t =
        Trainer::<Branchy, StatefulAdamW>::new(&devices, config(), adamw.clone(), Branchy::new)
            .unwrap();
    let step = |t: &mut Trainer<Branchy, StatefulAdamW>, s: usize| {
        t.step(&batch(s), |m: &Branchy, b: &[Tensor]| m.loss(b)).unwrap()
    };
    for s in 0..2 {
        step(&mut t, s);
    }
    t.save_with_optimizer(dir.join("ck"), None).unwrap();
    let rest: Vec<f64> = (2..5).map(|s| step(&mut t, s)).collect();
    for (devices, config) in [
        (Devices::cpu(8).unwrap(), config()),
        (Devices::cpu(8).unwrap(), Config::ddp().with_dtype(DType::F64)),
    ] {
        let mut r =
            Trainer::<Branchy, StatefulAdamW>::new(&devices, config, adamw.clone(), Branchy::new)
                .unwrap();
        r.restore_with_optimizer(dir.join("ck")).unwrap();
        for (s, want) in (2..5).zip(&rest) {
            let got = step(&mut r, s);
            assert!(close(got, *want), "{:?}, step {s}: {got} vs {want}", r.parallel());
        }
    }
}
