//! The classifiers: the MLP (the main job) and the CNN, each sized by its data (rows of
//! features or images, and class ids), `--init`'s tensors or a resumed checkpoint.

use std::collections::HashMap;

use meshwork_nn::{Cnn, Mlp};
use meshwork_types::DType;

use super::{Ctx, Defaults, Family, Resolved, not_ours, size_flags};
use crate::config::{Data, OptimizerKind};
use crate::data::{self, BUILT_IN_CLASSIFICATION, Classification, Examples, Images};
use crate::model::Net;
use crate::{Error, Result};

/// The MLP.
pub(crate) struct MlpFamily;
/// The CNN.
pub(crate) struct CnnFamily;

pub(crate) static MLP: MlpFamily = MlpFamily;
pub(crate) static CNN: CnnFamily = CnnFamily;

fn usage(m: impl Into<String>) -> Error {
    Error::usage(m)
}

/// The flags of the language models' data (`--text`, `--data-tokens`), with whether
/// each was given.
fn token_flags(ctx: &Ctx<'_>) -> [(&'static str, bool); 5] {
    let c = ctx.config;
    [
        ("text", matches!(c.data, Data::Text(_) | Data::Documents { .. })),
        ("data-jsonl", matches!(c.data, Data::Jsonl { .. })),
        ("data-tokens", matches!(c.data, Data::Tokens(_))),
        ("preset", c.preset.is_some()),
        ("tokenizer", c.tokenizer.is_some()),
    ]
}

impl Family for MlpFamily {
    fn name(&self) -> &'static str {
        "mlp"
    }

    fn defaults(&self) -> Defaults {
        Defaults {
            steps: 200,
            batch: 64,
            optimizer: OptimizerKind::Sgd,
            lr: (0.5, 0.5),
            dtype: DType::F64,
            mesh: (2, 2),
        }
    }

    fn blocks(&self) -> bool {
        false
    }

    fn resolve(&self, ctx: &Ctx<'_>) -> Result<Resolved> {
        let config = ctx.config;
        not_ours("MLP", &token_flags(ctx))?;
        not_ours("MLP", &[("filters", config.filters.is_some())])?;
        not_ours("MLP", &size_flags(config))?;
        if let Some(c) = config.classes
            && c < 2
        {
            return Err(usage(format!("--classes {c}: need at least 2")));
        }
        if ctx.stages > 2 {
            return Err(usage(format!("--stages {}: the MLP has 2 layers", ctx.stages)));
        }
        // Across processes, each reads only the rows of --data-x it trains on.
        if let (Data::Npy { x, y }, Some(share)) = (&config.data, ctx.share) {
            let check = |shape: &[usize]| match shape {
                [n, f] if *n > 0 && *f > 0 => Ok(()),
                other => Err(format!("{} has shape {other:?}; want [rows, features]", x.display())),
            };
            let rows = data::some_rows(x, ctx.limit, &check, &|n| share.wanted(n))?;
            let (labels, classes) = data::class_ids(y, rows.n, config.classes, ctx.limit)?;
            let features = rows.dims[0];
            let hidden = mlp_hidden(ctx, (features, classes))?;
            let (d, m) = ctx.mesh;
            let model = Mlp { features, hidden, classes };
            meshwork_nn::Model::check_mesh(&model, d, m).map_err(usage)?;
            let examples = Examples::Images {
                per: features,
                dims: vec![features],
                x: rows.x,
                y: class_i32(&labels)?,
                index: Some(rows.index),
            };
            // No final accuracy over every row: no process holds them all.
            return Ok(Resolved::new(Net::new(model), examples, rows.n));
        }
        let data = match &config.data {
            Data::BuiltIn => {
                let (rows, features, classes) = BUILT_IN_CLASSIFICATION;
                if let Some(c) = config.classes
                    && c != classes
                {
                    return Err(usage(format!(
                        "--classes {c}: the built-in data has {classes} classes (give --data-x and --data-y for other data)"
                    )));
                }
                Classification::synthetic(config.seed, rows, features, classes)
            }
            Data::Npy { x, y } => Classification::from_npy(x, y, ctx.limit, config.classes)?,
            _ => unreachable!("refused above"),
        };
        let hidden = mlp_hidden(ctx, (data.features(), data.classes))?;
        let (d, m) = ctx.mesh;
        let model = Mlp { features: data.features(), hidden, classes: data.classes };
        meshwork_nn::Model::check_mesh(&model, d, m).map_err(usage)?;
        let n = data.rows();
        let x: Vec<f64> = data.x.iter().copied().collect();
        let y = class_i32(&data.labels)?;
        let examples =
            Examples::Images { per: model.features, dims: vec![model.features], x, y, index: None };
        let mut resolved = Resolved::new(Net::new(model), examples, n);
        resolved.classification = Some(data);
        Ok(resolved)
    }
}

/// The MLP's hidden units: `--hidden`, or `--init`'s (its four tensors checked
/// against the data), or the checkpoint's, or 32; a flag that disagrees with either is
/// refused, and so is a checkpoint of other features or classes.
fn mlp_hidden(ctx: &Ctx<'_>, (features, classes): (usize, usize)) -> Result<usize> {
    let config = ctx.config;
    let from_file = match ctx.init.file() {
        Some(f) => Some(mlp_init_hidden(f, (features, classes))?),
        None => None,
    };
    let from_saved = match ctx.saved {
        Some(s) => Some(s.size("hidden")?),
        None => None,
    };
    if let (Some(h), Some(f)) = (config.hidden, from_file)
        && h != f
    {
        return Err(usage(format!(
            "--hidden {h} disagrees with --init, whose w1 has {f} hidden units"
        )));
    }
    if let (Some(h), Some(s), Some(saved)) = (config.hidden, from_saved, ctx.saved)
        && h != s
    {
        return Err(Error::flag(
            "resume",
            format!("{} holds a model with hidden {s}; --hidden is {h}", saved.dir.display()),
        ));
    }
    let hidden = config.hidden.or(from_file).or(from_saved).unwrap_or(32);
    if hidden == 0 {
        return Err(usage("--hidden must be at least 1"));
    }
    if let Some(saved) = ctx.saved {
        for (what, flag, ours) in [("features", "data-x", features), ("classes", "data-y", classes)]
        {
            let theirs = saved.size(what)?;
            if theirs != ours {
                return Err(Error::flag(
                    "resume",
                    format!(
                        "{} holds a model with {theirs} {what}; --{flag} gives {ours}",
                        saved.dir.display()
                    ),
                ));
            }
        }
    }
    Ok(hidden)
}

/// The MLP's hidden units an `--init` file's w1 says, its four tensors checked against
/// the data: names, ranks and shapes.
fn mlp_init_hidden(
    f: &HashMap<String, crate::init::Shaped>,
    (features, classes): (usize, usize),
) -> Result<usize> {
    let get = |name: &str, rank: usize| -> Result<Vec<usize>> {
        let t = f.get(name).ok_or_else(|| {
            Error::flag("init", format!("has no tensor {name:?} (want w1, b1, w2, b2)"))
        })?;
        if t.shape().len() != rank {
            return Err(Error::flag(
                "init",
                format!("{name} has shape {:?}; want rank {rank}", t.shape()),
            ));
        }
        Ok(t.shape().to_vec())
    };
    let (s1, sb1, s2, sb2) = (get("w1", 2)?, get("b1", 1)?, get("w2", 2)?, get("b2", 1)?);
    let hidden = s1[1];
    if hidden == 0 {
        return Err(Error::flag(
            "init",
            format!("w1 has shape {s1:?}; a model needs at least 1 hidden unit"),
        ));
    }
    let want = [
        ("w1", &s1, vec![features, hidden]),
        ("b1", &sb1, vec![hidden]),
        ("w2", &s2, vec![hidden, classes]),
        ("b2", &sb2, vec![classes]),
    ];
    for (name, got, want) in want {
        if *got != want {
            return Err(Error::flag(
                "init",
                format!(
                    "{name} has shape {got:?}; the data ({features} features, {classes} classes) needs {want:?}"
                ),
            ));
        }
    }
    Ok(hidden)
}

impl Family for CnnFamily {
    fn name(&self) -> &'static str {
        "cnn"
    }

    fn defaults(&self) -> Defaults {
        Defaults { batch: 32, ..Defaults::LM }
    }

    fn blocks(&self) -> bool {
        false
    }

    fn resolve(&self, ctx: &Ctx<'_>) -> Result<Resolved> {
        let config = ctx.config;
        let (d, m) = ctx.mesh;
        if m > 1 {
            return Err(usage(format!(
                "--mesh {d}x{m}: the CNN's weights are not split over a model axis (--mesh Dx1, or --stages K)"
            )));
        }
        if ctx.stages > 3 {
            return Err(usage(format!("--stages {}: the CNN has 3 layers", ctx.stages)));
        }
        not_ours("CNN", &token_flags(ctx))?;
        not_ours(
            "CNN",
            &[("hidden", config.hidden.is_some()), ("classes", config.classes.is_some())],
        )?;
        not_ours("CNN", &size_flags(config))?;
        // Across processes, each reads only the images it trains on.
        let mut index = None;
        let images = match (&config.data, ctx.share) {
            (Data::BuiltIn, _) => Images::synthetic(config.seed),
            (Data::Npy { x, y }, Some(share)) => {
                let check = |shape: &[usize]| match shape {
                    [n, h, w, c] if *n > 0 && *h >= 2 && *w >= 2 && *c > 0 => Ok(()),
                    other => Err(format!(
                        "{} has shape {other:?}; want [N, H, W, C] of images at least 2x2",
                        x.display()
                    )),
                };
                let rows = data::some_rows(x, ctx.limit, &check, &|n| share.wanted(n))?;
                // The labels by the rules a single process reads them by.
                let (labels, classes) = data::image_labels(y, rows.n, ctx.limit)?;
                index = Some(rows.index);
                let [h, w, c] = rows.dims[..] else { unreachable!("checked rank 4") };
                Images { dims: [rows.n, h, w, c], x: rows.x, y: labels, classes }
            }
            (Data::Npy { x, y }, None) => Images::from_npy(x, y, ctx.limit)?,
            _ => unreachable!("refused above"),
        };
        let [f1, f2] = cnn_filters(ctx)?;
        let [n, h, w, c] = images.dims;
        let model = Cnn { image: [h, w, c], classes: images.classes, filters: [f1, f2] };
        if let Some(saved) = ctx.saved
            && saved.image() != Some(serde_json::json!(model.image))
        {
            return Err(Error::flag(
                "resume",
                format!(
                    "the checkpoint's images are {}, the data's {:?}",
                    saved.image().unwrap_or_default(),
                    model.image
                ),
            ));
        }
        let examples = Examples::Images {
            per: h * w * c,
            dims: vec![h, w, c],
            x: images.x,
            y: images.y,
            index,
        };
        Ok(Resolved::new(Net::new(model), examples, n))
    }
}

/// The CNN's filters: from `--init`'s convolutions (HWIO), the checkpoint's run, or
/// `--filters` (default 8,16); a flag that disagrees with the file or the checkpoint
/// is refused.
fn cnn_filters(ctx: &Ctx<'_>) -> Result<[usize; 2]> {
    let from_file = match ctx.init.file() {
        Some(f) => {
            let out = |name: &str| {
                f.get(name).and_then(|t| match t.shape() {
                    &[3, 3, _, o] => Some(o),
                    _ => None,
                })
            };
            match (out("conv1.weight"), out("conv2.weight")) {
                (Some(f1), Some(f2)) => Some([f1, f2]),
                _ => {
                    return Err(Error::flag(
                        "init",
                        "the CNN needs conv1.weight and conv2.weight of shape [3, 3, in, out]",
                    ));
                }
            }
        }
        None => None,
    };
    let from_saved = match ctx.saved {
        Some(s) => s.filters()?,
        None => None,
    };
    let [f1, f2] = match ctx.config.filters {
        None => from_saved.or(from_file).unwrap_or([8, 16]),
        Some([f1, f2]) => {
            for (whose, had) in
                [("--init's convolutions", from_file), ("the checkpoint", from_saved)]
            {
                if let Some([g1, g2]) = had
                    && [g1, g2] != [f1, f2]
                {
                    return Err(Error::flag(
                        "filters",
                        format!("{f1},{f2} disagrees with {whose}, which have {g1},{g2}"),
                    ));
                }
            }
            [f1, f2]
        }
    };
    if f1 == 0 || f2 == 0 {
        return Err(usage(format!("--filters {f1},{f2}: each convolution needs a filter")));
    }
    Ok([f1, f2])
}

/// Class ids as the model takes them (i32).
fn class_i32(labels: &[usize]) -> Result<Vec<i32>> {
    labels
        .iter()
        .map(|&l| {
            i32::try_from(l).map_err(|_| {
                Error::flag("data-y", format!("class {l} is past the 2^31 classes a label holds"))
            })
        })
        .collect()
}
