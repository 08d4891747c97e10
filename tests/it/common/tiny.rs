//! A deterministic tiny MLP (`IN` → `HIDDEN` → `CLASSES`), its data set, and a plain
//! single-process SGD reference: the DDP, DP and multinode equivalence tests train it through an
//! accelerator and compare with [`reference`].

use std::collections::HashMap;

use accelerate_rs::{Accelerator, DataLoader, Error, TensorDataset};
use candle_core::{Device, Module, Tensor, Var};
use candle_nn::{loss, Linear, Optimizer, SGD};

pub const IN: usize = 8;
pub const HIDDEN: usize = 16;
pub const CLASSES: usize = 4;
pub const LR: f64 = 0.1;

/// A tensor of `shape` with deterministic values in `[-scale / 2, scale / 2)`, varied by `salt`.
pub fn det(shape: &[usize], salt: usize, scale: f32) -> Tensor {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n)
        .map(|i| (((i * 37 + salt * 101) % 97) as f32 / 97.0 - 0.5) * scale)
        .collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

/// Named parameters; `offset` perturbs the values (ranks other than 0 start elsewhere, so the
/// broadcast in `prepare` matters) and `hidden` lets a rank disagree on a shape (pass [`HIDDEN`]
/// otherwise).
pub fn params(offset: f32, hidden: usize) -> Vec<(String, Var)> {
    let mk = |shape: &[usize], salt| {
        Var::from_tensor(&(det(shape, salt, 0.6) + offset as f64).unwrap()).unwrap()
    };
    vec![
        ("fc1.weight".into(), mk(&[hidden, IN], 1)),
        ("fc1.bias".into(), mk(&[hidden], 2)),
        ("fc2.weight".into(), mk(&[CLASSES, hidden], 3)),
        ("fc2.bias".into(), mk(&[CLASSES], 4)),
    ]
}

pub fn forward(p: &[(String, Var)], x: &Tensor) -> candle_core::Result<Tensor> {
    let get = |n: &str| {
        p.iter()
            .find(|(k, _)| k == n)
            .map(|(_, v)| v.as_tensor().clone())
            .ok_or_else(|| candle_core::Error::Msg(format!("no parameter {n}")))
    };
    let l1 = Linear::new(get("fc1.weight")?, Some(get("fc1.bias")?));
    let l2 = Linear::new(get("fc2.weight")?, Some(get("fc2.bias")?));
    l2.forward(&l1.forward(x)?.relu()?)
}

/// `n` deterministic rows of `IN` features with labels in `0..CLASSES`.
pub fn dataset(n: usize) -> TensorDataset {
    let x = det(&[n, IN], 9, 2.0);
    let y: Vec<u32> = (0..n).map(|i| ((i * 7) % CLASSES) as u32).collect();
    TensorDataset::new(vec![x, Tensor::new(y, &Device::Cpu).unwrap()]).unwrap()
}

pub fn snapshot(p: &[(String, Var)]) -> HashMap<String, Tensor> {
    p.iter()
        .map(|(k, v)| (k.clone(), v.as_tensor().copy().unwrap()))
        .collect()
}

/// `steps` SGD steps of per-rank batch `batch` through `acc`, over a data set of
/// `world_size * batch * steps` rows; an error unless the loader gave exactly `steps` batches.
pub fn train(
    acc: &Accelerator,
    p: &[(String, Var)],
    batch: usize,
    steps: usize,
) -> accelerate_rs::Result<()> {
    let vars: Vec<Var> = p.iter().map(|(_, v)| v.clone()).collect();
    let opt = SGD::new(vars, LR)?;
    let loader = DataLoader::new(dataset(acc.world_size() * batch * steps), batch);
    let (mut opt, loader) = acc.prepare(p, opt, loader)?;
    let mut done = 0;
    for b in loader.iter()? {
        let b = b?;
        let loss = loss::cross_entropy(&forward(p, &b[0])?, &b[1])?;
        opt.backward_step(&loss)?;
        done += 1;
    }
    if done != steps {
        return Err(Error::invalid(
            "steps",
            format!("{done} instead of {steps}"),
        ));
    }
    Ok(())
}

/// The plain single-process reference, no accelerate-rs in the loop: `steps` SGD steps of batch
/// `batch` (the global batch of the run it is compared with) over `dataset(batch * steps)`,
/// starting from `params(0.0, HIDDEN)`. Panics unless the loader gave exactly `steps` batches.
pub fn reference(batch: usize, steps: usize) -> HashMap<String, Tensor> {
    let p = params(0.0, HIDDEN);
    let mut opt = SGD::new(p.iter().map(|(_, v)| v.clone()).collect(), LR).unwrap();
    let loader = DataLoader::new(dataset(batch * steps), batch);
    let mut done = 0;
    for b in loader.iter().unwrap() {
        let b = b.unwrap();
        let loss = loss::cross_entropy(&forward(&p, &b[0]).unwrap(), &b[1]).unwrap();
        opt.backward_step(&loss).unwrap();
        done += 1;
    }
    assert_eq!(done, steps);
    snapshot(&p)
}

/// The largest absolute difference between same-named tensors of two snapshots.
pub fn max_abs_diff(a: &HashMap<String, Tensor>, b: &HashMap<String, Tensor>) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .map(|(k, t)| {
            (t - &b[k])
                .unwrap()
                .abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap()
        })
        .fold(0.0, f32::max)
}
