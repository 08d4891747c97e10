//! The fused, in-place CPU optimizer kernels (`optim::{AdamW, Sgd}`) against Candle's AdamW and
//! a plain tensor-op reference of PyTorch's SGD, on parameters large enough to be split into
//! parallel chunks, in every float dtype.

use accelerate_rs::optim::{AdamW, ParamsAdamW, Sgd, SgdConfig};
use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::Optimizer;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// A weight bigger than one kernel chunk (65,536 elements), a bias, and an odd-sized one.
const SHAPES: [&[usize]; 3] = [&[257, 256], &[257], &[7, 13]];

fn rand_tensor(rng: &mut ChaCha8Rng, shape: &[usize], dtype: DType) -> Tensor {
    let n: usize = shape.iter().product();
    let v: Vec<f64> = (0..n).map(|_| rng.random::<f64>() * 2.0 - 1.0).collect();
    Tensor::from_vec(v, shape, &Device::Cpu)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
}

fn params(dtype: DType) -> Vec<Var> {
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    SHAPES
        .iter()
        .map(|s| Var::from_tensor(&rand_tensor(&mut rng, s, dtype)).unwrap())
        .collect()
}

/// Gradients of step `step`; the first one is handed over transposed (not contiguous) on odd
/// steps, as matmul backward produces them.
fn grads(vars: &[Var], step: u64) -> GradStore {
    let mut rng = ChaCha8Rng::seed_from_u64(100 + step);
    let mut store = GradStore::default();
    for (i, (v, s)) in vars.iter().zip(SHAPES).enumerate() {
        let g = if i == 0 && step % 2 == 1 {
            rand_tensor(&mut rng, &[s[1], s[0]], v.dtype()).t().unwrap()
        } else {
            rand_tensor(&mut rng, s, v.dtype())
        };
        store.insert(v.as_tensor(), g);
    }
    store
}

fn max_diff(a: &[Var], b: &[Var]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| {
            (x.as_tensor() - y.as_tensor())
                .unwrap()
                .abs()
                .unwrap()
                .to_dtype(DType::F64)
                .unwrap()
                .flatten_all()
                .unwrap()
                .max(0)
                .unwrap()
                .to_scalar::<f64>()
                .unwrap()
        })
        .fold(0.0, f64::max)
}

#[test]
fn adamw_equals_candle_after_100_steps_f32_and_f64() {
    for dtype in [DType::F32, DType::F64] {
        for p in [
            ParamsAdamW::default(),
            ParamsAdamW {
                lr: 0.003,
                beta1: 0.8,
                beta2: 0.95,
                eps: 1e-6,
                weight_decay: 0.0,
            },
        ] {
            let (ours_vars, theirs_vars) = (params(dtype), params(dtype));
            let mut ours = AdamW::new(ours_vars.clone(), p.clone()).unwrap();
            let mut theirs = candle_nn::AdamW::new(theirs_vars.clone(), p.clone()).unwrap();
            let before = ours_vars[0].as_tensor().clone();
            for step in 0..100 {
                ours.step(&grads(&ours_vars, step)).unwrap();
                theirs.step(&grads(&theirs_vars, step)).unwrap();
            }
            let d = max_diff(&ours_vars, &theirs_vars);
            assert!(d <= 1e-6, "{dtype:?} {p:?}: max abs diff {d}");
            // In place: a handle taken before the steps sees the new values.
            assert_eq!(
                before
                    .to_dtype(DType::F64)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f64>()
                    .unwrap(),
                ours_vars[0]
                    .to_dtype(DType::F64)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f64>()
                    .unwrap()
            );
            assert!(max_diff(&ours_vars, &params(dtype)) > 1e-2, "did not train");
        }
    }
}

/// PyTorch's SGD as tensor ops: `d = g + wd·θ`; `buf = d` (first step) or
/// `μ·buf + (1 − dampening)·d`; `d = d + μ·buf` (Nesterov) or `buf`; `θ = θ − lr·d`.
struct ReferenceSgd {
    vars: Vec<Var>,
    bufs: Vec<Option<Tensor>>,
    c: SgdConfig,
}

impl ReferenceSgd {
    fn step(&mut self, grads: &GradStore) {
        for (v, buf) in self.vars.iter().zip(self.bufs.iter_mut()) {
            let g = grads.get(v.as_tensor()).unwrap();
            let mut d = (g + (v.as_tensor() * self.c.weight_decay).unwrap()).unwrap();
            if self.c.momentum != 0.0 {
                let b = match buf.take() {
                    None => d.clone(),
                    Some(b) => ((b * self.c.momentum).unwrap()
                        + (&d * (1.0 - self.c.dampening)).unwrap())
                    .unwrap(),
                };
                d = if self.c.nesterov {
                    (d + (&b * self.c.momentum).unwrap()).unwrap()
                } else {
                    b.clone()
                };
                *buf = Some(b);
            }
            let next = (v.as_tensor() - (d * self.c.lr).unwrap()).unwrap();
            v.set(&next).unwrap();
        }
    }
}

#[test]
fn sgd_equals_the_reference_for_every_option() {
    let configs = [
        SgdConfig::new(0.05),
        SgdConfig::new(0.05).weight_decay(0.01),
        SgdConfig::new(0.05).momentum(0.9),
        SgdConfig::new(0.05).momentum(0.9).dampening(0.3),
        SgdConfig::new(0.05)
            .momentum(0.9)
            .nesterov(true)
            .weight_decay(1e-3),
    ];
    for dtype in [DType::F32, DType::F64] {
        for c in &configs {
            let ours_vars = params(dtype);
            let mut ours = Sgd::new(ours_vars.clone(), c.clone()).unwrap();
            let mut reference = ReferenceSgd {
                vars: params(dtype),
                bufs: vec![None; SHAPES.len()],
                c: c.clone(),
            };
            for step in 0..30 {
                ours.step(&grads(&ours_vars, step)).unwrap();
                reference.step(&grads(&reference.vars, step));
            }
            let d = max_diff(&ours_vars, &reference.vars);
            assert!(d <= 1e-6, "{dtype:?} {c:?}: max abs diff {d}");
            assert!(max_diff(&ours_vars, &params(dtype)) > 1e-2, "did not train");
        }
    }
}

#[test]
fn half_precision_parameters_follow_the_f32_run() {
    for dtype in [DType::BF16, DType::F16] {
        let (half_vars, full_vars) = (params(dtype), params(DType::F32));
        // Start both from the same (rounded) values.
        for (h, f) in half_vars.iter().zip(&full_vars) {
            f.set(&h.to_dtype(DType::F32).unwrap()).unwrap();
        }
        let mut half_opt = AdamW::new_lr(half_vars.clone(), 1e-3).unwrap();
        let mut full_opt = AdamW::new_lr(full_vars.clone(), 1e-3).unwrap();
        for step in 0..20 {
            half_opt.step(&grads(&half_vars, step)).unwrap();
            full_opt.step(&grads(&full_vars, step)).unwrap();
        }
        let as_f32: Vec<Var> = half_vars
            .iter()
            .map(|v| Var::from_tensor(&v.to_dtype(DType::F32).unwrap()).unwrap())
            .collect();
        let d = max_diff(&as_f32, &full_vars);
        assert!(d <= 2e-2, "{dtype:?}: max abs diff {d} from the f32 run");
        assert!(
            max_diff(&as_f32, &params(DType::F32)) > 1e-2,
            "did not train"
        );

        let mut sgd = Sgd::new(half_vars.clone(), SgdConfig::new(0.01).momentum(0.9)).unwrap();
        sgd.step(&grads(&half_vars, 0)).unwrap();
        assert_eq!(sgd.state().unwrap().tensors.len(), SHAPES.len());
    }
}

#[test]
fn a_gradient_of_another_dtype_is_an_error_not_a_silent_skip() {
    let vars = params(DType::F32);
    let mut opt = AdamW::new_lr(vars.clone(), 1e-3).unwrap();
    let mut store = GradStore::default();
    store.insert(
        vars[1].as_tensor(),
        Tensor::zeros(257, DType::F64, &Device::Cpu).unwrap(),
    );
    // Not fusable: the tensor-op path runs and Candle reports the dtype mismatch.
    assert!(opt.step(&store).is_err());
}

#[test]
fn set_fused_false_runs_the_tensor_op_chain_with_the_same_result() {
    let (fused_vars, chain_vars) = (params(DType::F32), params(DType::F32));
    let mut fused = AdamW::new_lr(fused_vars.clone(), 1e-2).unwrap();
    let mut chain = AdamW::new_lr(chain_vars.clone(), 1e-2).unwrap();
    assert!(fused.fused());
    chain.set_fused(false);
    let before = chain_vars[0].as_tensor().clone();
    for step in 0..100 {
        fused.step(&grads(&fused_vars, step)).unwrap();
        chain.step(&grads(&chain_vars, step)).unwrap();
    }
    let d = max_diff(&fused_vars, &chain_vars);
    assert!(d <= 1e-6, "AdamW fused vs chain: max abs diff {d}");
    // The chain replaces the parameter's storage content through `Var::set`, the fused kernel
    // writes it in place: both leave a handle taken before up to date.
    assert_eq!(
        before.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
        chain_vars[0]
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
    );

    let c = SgdConfig::new(0.05)
        .momentum(0.9)
        .nesterov(true)
        .weight_decay(1e-3);
    let (fused_vars, chain_vars) = (params(DType::F32), params(DType::F32));
    let mut fused = Sgd::new(fused_vars.clone(), c.clone()).unwrap();
    let mut chain = Sgd::new(chain_vars.clone(), c).unwrap();
    chain.set_fused(false);
    for step in 0..30 {
        fused.step(&grads(&fused_vars, step)).unwrap();
        chain.step(&grads(&chain_vars, step)).unwrap();
    }
    let d = max_diff(&fused_vars, &chain_vars);
    assert!(d <= 1e-6, "Sgd fused vs chain: max abs diff {d}");
}

#[test]
fn no_weight_decay_on_equals_two_parameter_groups() {
    for fused in [true, false] {
        let cfg = ParamsAdamW {
            lr: 0.01,
            weight_decay: 0.3,
            ..Default::default()
        };
        let ours = params(DType::F32);
        let mut opt = AdamW::new(ours.clone(), cfg.clone())
            .unwrap()
            .no_weight_decay_on(&ours[1..]);
        opt.set_fused(fused);
        assert!(opt.decaying()[0]);
        assert!(opt.decaying()[1..].iter().all(|d| !d));
        let theirs = params(DType::F32);
        let mut decay = candle_nn::AdamW::new(theirs[..1].to_vec(), cfg.clone()).unwrap();
        let no_decay = ParamsAdamW {
            weight_decay: 0.0,
            ..cfg.clone()
        };
        let mut rest = candle_nn::AdamW::new(theirs[1..].to_vec(), no_decay).unwrap();
        let plain = params(DType::F32);
        let mut all = AdamW::new(plain.clone(), cfg.clone()).unwrap();
        for step in 0..30 {
            opt.step(&grads(&ours, step)).unwrap();
            let g = grads(&theirs, step);
            decay.step(&g).unwrap();
            rest.step(&g).unwrap();
            all.step(&grads(&plain, step)).unwrap();
        }
        let d = max_diff(&ours, &theirs);
        assert!(d < 1e-5, "fused {fused}: {d}");
        // Decay on every parameter gives another result.
        assert!(max_diff(&ours[1..], &plain[1..]) > 1e-3);
        assert!(max_diff(&ours[..1], &plain[..1]) < 1e-6);

        let sgd_cfg = SgdConfig::new(0.05).momentum(0.9).weight_decay(0.2);
        let ours = params(DType::F32);
        let mut opt = Sgd::new(ours.clone(), sgd_cfg.clone())
            .unwrap()
            .no_weight_decay_on(&ours[1..]);
        opt.set_fused(fused);
        let theirs = params(DType::F32);
        let mut decay = Sgd::new(theirs[..1].to_vec(), sgd_cfg.clone()).unwrap();
        let mut rest = Sgd::new(theirs[1..].to_vec(), sgd_cfg.weight_decay(0.0)).unwrap();
        for step in 0..30 {
            opt.step(&grads(&ours, step)).unwrap();
            let g = grads(&theirs, step);
            decay.step(&g).unwrap();
            rest.step(&g).unwrap();
        }
        let d = max_diff(&ours, &theirs);
        assert!(d < 1e-6, "sgd fused {fused}: {d}");
    }
}
