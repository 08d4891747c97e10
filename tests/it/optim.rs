//! Optimizers with exposed state (`optim::{AdamW, Sgd}`) and learning-rate schedules.

use accelerate_rs::optim::{AdamW, OptimizerState, ParamsAdamW, Sgd, SgdConfig};
use accelerate_rs::scheduler::{Constant, LinearDecay, LinearWarmupCosine, LrScheduler, Schedule};
use accelerate_rs::{Accelerator, DataLoader, Error, TensorDataset};
use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Module, Tensor, Var};
use candle_nn::{Optimizer, VarBuilder, VarMap};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const SHAPES: [&[usize]; 4] = [&[8, 4], &[8], &[3, 8], &[3]];

fn rand_vec(rng: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.random::<f32>() * 2.0 - 1.0).collect()
}

/// An MLP-like set of parameters with deterministic values.
fn params(seed: u64) -> Vec<Var> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    SHAPES
        .iter()
        .map(|s| {
            let n = s.iter().product();
            Var::from_tensor(&Tensor::from_vec(rand_vec(&mut rng, n), *s, &Device::Cpu).unwrap())
                .unwrap()
        })
        .collect()
}

/// Deterministic random gradients for step `step`; parameter `skip` gets none.
fn grads_for(step: u64, skip: Option<usize>) -> Vec<Option<Tensor>> {
    let mut rng = ChaCha8Rng::seed_from_u64(1000 + step);
    SHAPES
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let n = s.iter().product();
            let t = Tensor::from_vec(rand_vec(&mut rng, n), *s, &Device::Cpu).unwrap();
            (Some(i) != skip).then_some(t)
        })
        .collect()
}

fn store(vars: &[Var], grads: &[Option<Tensor>]) -> GradStore {
    let mut store = GradStore::default();
    for (v, g) in vars.iter().zip(grads) {
        if let Some(g) = g {
            store.insert(v.as_tensor(), g.clone());
        }
    }
    store
}

fn flat(vars: &[Var]) -> Vec<f32> {
    vars.iter()
        .flat_map(|v| v.flatten_all().unwrap().to_vec1::<f32>().unwrap())
        .collect()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Skip parameter 1 on every third step, to exercise "no gradient, no update".
fn skip_at(step: u64) -> Option<usize> {
    (step % 3 == 2).then_some(1)
}

#[test]
fn adamw_matches_candle_over_100_steps() {
    for p in [
        ParamsAdamW::default(),
        ParamsAdamW {
            lr: 0.01,
            beta1: 0.8,
            beta2: 0.99,
            eps: 1e-6,
            weight_decay: 0.0,
        },
    ] {
        let ours_vars = params(1);
        let theirs_vars = params(1);
        let mut ours = AdamW::new(ours_vars.clone(), p.clone()).unwrap();
        let mut theirs = candle_nn::AdamW::new(theirs_vars.clone(), p.clone()).unwrap();
        for step in 0..100 {
            let g = grads_for(step, skip_at(step));
            ours.step(&store(&ours_vars, &g)).unwrap();
            theirs.step(&store(&theirs_vars, &g)).unwrap();
        }
        let d = max_diff(&flat(&ours_vars), &flat(&theirs_vars));
        assert!(d <= 1e-6, "max abs diff {d} with {p:?}");
        assert!(
            max_diff(&flat(&ours_vars), &flat(&params(1))) > 1e-3,
            "did not train"
        );
        assert_eq!(ours.step_count(), 100);
    }
}

#[test]
fn adamw_skips_parameters_without_gradient() {
    let vars = params(2);
    let before = flat(&vars[1..2]);
    let mut opt = AdamW::new_lr(vars.clone(), 0.1).unwrap();
    for step in 0..3 {
        opt.step(&store(&vars, &grads_for(step, Some(1)))).unwrap();
    }
    assert_eq!(flat(&vars[1..2]), before);
    let state = opt.state().unwrap();
    let m1 = state.get("1.m").unwrap();
    assert_eq!(
        m1.abs()
            .unwrap()
            .sum_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap(),
        0.0
    );
}

#[test]
fn sgd_plain_equals_candle_sgd_exactly() {
    let ours_vars = params(3);
    let theirs_vars = params(3);
    let mut ours = Sgd::new(ours_vars.clone(), SgdConfig::new(0.05)).unwrap();
    let mut theirs = candle_nn::SGD::new(theirs_vars.clone(), 0.05).unwrap();
    for step in 0..20 {
        let g = grads_for(step, skip_at(step));
        ours.step(&store(&ours_vars, &g)).unwrap();
        theirs.step(&store(&theirs_vars, &g)).unwrap();
    }
    assert_eq!(flat(&ours_vars), flat(&theirs_vars));
    assert!(ours.state().unwrap().tensors.is_empty());
}

/// Two steps on a scalar parameter (p = 1, g = 0.5 then 0.25, lr = 0.1), against values worked
/// out by hand from PyTorch's update rule.
fn two_steps(config: SgdConfig) -> f64 {
    let p = Var::from_tensor(&Tensor::new(&[1f64], &Device::Cpu).unwrap()).unwrap();
    let mut opt = Sgd::new(vec![p.clone()], config).unwrap();
    for g in [0.5f64, 0.25] {
        let mut s = GradStore::default();
        s.insert(p.as_tensor(), Tensor::new(&[g], &Device::Cpu).unwrap());
        opt.step(&s).unwrap();
    }
    p.to_vec1::<f64>().unwrap()[0]
}

#[test]
fn sgd_hand_computed_two_steps() {
    let close = |a: f64, b: f64| assert!((a - b).abs() < 1e-12, "{a} != {b}");
    // d1 = 0.5 + 0.1·1 = 0.6, buf = 0.6, p = 0.94; d2 = 0.25 + 0.1·0.94 = 0.344,
    // buf = 0.9·0.6 + 0.344 = 0.884, p = 0.94 − 0.0884 = 0.8516.
    close(
        two_steps(SgdConfig::new(0.1).momentum(0.9).weight_decay(0.1)),
        0.8516,
    );
    // Nesterov: d1 = 0.6 + 0.9·0.6 = 1.14, p = 0.886; d2 = 0.25 + 0.0886 = 0.3386,
    // buf = 0.54 + 0.3386 = 0.8786, d = 0.3386 + 0.9·0.8786 = 1.12934, p = 0.773066.
    close(
        two_steps(
            SgdConfig::new(0.1)
                .momentum(0.9)
                .weight_decay(0.1)
                .nesterov(true),
        ),
        0.773066,
    );
    // Dampening 0.5 (not applied on the first step): buf = 0.5, p = 0.95;
    // buf = 0.45 + 0.5·0.25 = 0.575, p = 0.8925.
    close(
        two_steps(SgdConfig::new(0.1).momentum(0.9).dampening(0.5)),
        0.8925,
    );
    // Weight decay only: p = 1 − 0.1·0.6 = 0.94; p = 0.94 − 0.1·0.344 = 0.9056.
    close(two_steps(SgdConfig::new(0.1).weight_decay(0.1)), 0.9056);
}

/// Trains 5 steps, checkpoints, resumes on fresh parameters and optimizer, trains 5 more; must
/// equal 10 uninterrupted steps bit for bit.
fn round_trip<O: Optimizer>(
    make: impl Fn(Vec<Var>) -> O,
    state: impl Fn(&O) -> OptimizerState,
    load: impl Fn(&mut O, OptimizerState),
) {
    let straight = params(4);
    let mut opt = make(straight.clone());
    for step in 0..10 {
        opt.step(&store(&straight, &grads_for(step, skip_at(step))))
            .unwrap();
    }

    let first = params(4);
    let mut opt = make(first.clone());
    for step in 0..5 {
        opt.step(&store(&first, &grads_for(step, skip_at(step))))
            .unwrap();
    }
    let saved = state(&opt);
    let snapshot: Vec<Vec<f32>> = saved
        .tensors
        .iter()
        .map(|(_, t)| t.flatten_all().unwrap().to_vec1().unwrap())
        .collect();
    // Keep training the first optimizer: the saved state must not change under it.
    opt.step(&store(&first, &grads_for(5, None))).unwrap();
    let after: Vec<Vec<f32>> = saved
        .tensors
        .iter()
        .map(|(_, t)| t.flatten_all().unwrap().to_vec1().unwrap())
        .collect();
    assert_eq!(snapshot, after, "state() is not a snapshot");

    // Resume: fresh parameters holding the checkpointed values, fresh optimizer.
    let resumed: Vec<Var> = params(0);
    let first_values = params(4);
    let mut warm = make(first_values.clone());
    for step in 0..5 {
        warm.step(&store(&first_values, &grads_for(step, skip_at(step))))
            .unwrap();
    }
    for (r, w) in resumed.iter().zip(&first_values) {
        r.set(w.as_tensor()).unwrap();
    }
    let mut opt = make(resumed.clone());
    opt.set_learning_rate(123.0); // overwritten by load
    load(&mut opt, saved);
    for step in 5..10 {
        opt.step(&store(&resumed, &grads_for(step, skip_at(step))))
            .unwrap();
    }
    assert_eq!(flat(&resumed), flat(&straight));
}

#[test]
fn adamw_state_round_trip_is_bit_identical() {
    round_trip(
        |vars| AdamW::new_lr(vars, 0.01).unwrap(),
        |o| o.state().unwrap(),
        |o, s| o.load_state(s).unwrap(),
    );
}

#[test]
fn sgd_state_round_trip_is_bit_identical() {
    for config in [
        SgdConfig::new(0.05).momentum(0.9).weight_decay(0.01),
        SgdConfig::new(0.05).momentum(0.9).nesterov(true),
        SgdConfig::new(0.05).momentum(0.5).dampening(0.1),
    ] {
        round_trip(
            |vars| Sgd::new(vars, config.clone()).unwrap(),
            |o| o.state().unwrap(),
            |o, s| o.load_state(s).unwrap(),
        );
    }
}

#[test]
fn state_names_step_and_lr() {
    let vars = params(5);
    let mut opt = AdamW::new_lr(vars.clone(), 0.02).unwrap();
    opt.step(&store(&vars, &grads_for(0, None))).unwrap();
    let s = opt.state().unwrap();
    assert_eq!((s.step, s.lr), (1, 0.02));
    let names: Vec<&str> = s.tensors.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        ["0.m", "0.v", "1.m", "1.v", "2.m", "2.v", "3.m", "3.v"]
    );

    let mut sgd = Sgd::new(vars.clone(), SgdConfig::new(0.1).momentum(0.9)).unwrap();
    sgd.step(&store(&vars, &grads_for(0, Some(2)))).unwrap();
    let names: Vec<String> = sgd
        .state()
        .unwrap()
        .tensors
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    assert_eq!(names, ["0.momentum", "1.momentum", "3.momentum"]);
}

fn invalid_name(e: Error) -> String {
    match e {
        Error::InvalidArgument { name, .. } => name,
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
}

#[test]
fn load_state_rejects_mismatches_naming_them() {
    let vars = params(6);
    let mut opt = AdamW::new_lr(vars.clone(), 0.01).unwrap();
    opt.step(&store(&vars, &grads_for(0, None))).unwrap();
    let good = opt.state().unwrap();

    // Wrong shape.
    let mut bad = good.clone();
    bad.tensors[2].1 = Tensor::zeros((2, 2), DType::F32, &Device::Cpu).unwrap();
    let e = opt.load_state(bad).unwrap_err();
    assert!(e.to_string().contains("1.m"), "{e}");
    assert!(invalid_name(e).contains("`1.m`"));

    // Wrong count.
    let mut bad = good.clone();
    bad.tensors.pop();
    let e = opt.load_state(bad).unwrap_err();
    assert!(e.to_string().contains("has 7 tensors"), "{e}");

    // Unknown name (count right).
    let mut bad = good.clone();
    bad.tensors[7].0 = "9.v".into();
    let e = opt.load_state(bad).unwrap_err();
    assert!(invalid_name(e).contains("`9.v`"));

    // Duplicate (so another is missing).
    let mut bad = good.clone();
    bad.tensors[7].0 = "3.m".into();
    let e = opt.load_state(bad).unwrap_err();
    assert!(e.to_string().contains("twice"), "{e}");

    // Nothing changed by the failed loads; a good one still works.
    assert_eq!(opt.step_count(), 1);
    opt.load_state(good.clone()).unwrap();

    // A state for a different model (fewer parameters).
    let mut small = AdamW::new_lr(params(6)[..2].to_vec(), 0.01).unwrap();
    assert!(small.load_state(good).is_err());

    // Sgd: shape, unknown name, buffers for a momentum-free optimizer.
    let mut sgd = Sgd::new(vars.clone(), SgdConfig::new(0.1).momentum(0.9)).unwrap();
    sgd.step(&store(&vars, &grads_for(0, None))).unwrap();
    let good = sgd.state().unwrap();
    let mut bad = good.clone();
    bad.tensors[0].1 = Tensor::zeros(8, DType::F32, &Device::Cpu).unwrap();
    let e = sgd.load_state(bad).unwrap_err();
    assert!(
        e.to_string().contains("`0.momentum`") && e.to_string().contains("[8, 4]"),
        "{e}"
    );
    let mut bad = good.clone();
    bad.tensors[0].0 = "0.m".into();
    assert!(invalid_name(sgd.load_state(bad).unwrap_err()).contains("`0.m`"));
    let mut plain = Sgd::new(vars.clone(), SgdConfig::new(0.1)).unwrap();
    assert!(plain.load_state(good.clone()).is_err());
    sgd.load_state(good).unwrap();
}

#[test]
fn invalid_optimizer_configs_are_rejected() {
    let vars = params(7);
    for (config, field) in [
        (SgdConfig::new(-0.1), "lr"),
        (SgdConfig::new(0.1).momentum(-0.5), "momentum"),
        (SgdConfig::new(0.1).nesterov(true), "nesterov"),
        (
            SgdConfig::new(0.1)
                .momentum(0.9)
                .dampening(0.1)
                .nesterov(true),
            "nesterov",
        ),
    ] {
        let e = Sgd::new(vars.clone(), config).unwrap_err().to_string();
        assert!(e.contains(field), "{e}");
    }
    let bad = ParamsAdamW {
        beta1: 1.0,
        ..ParamsAdamW::default()
    };
    let e = AdamW::new(vars.clone(), bad).unwrap_err().to_string();
    assert!(e.contains("beta1"), "{e}");
    assert!(AdamW::new_lr(vars, f64::NAN).is_err());
}

#[test]
fn works_with_prepare_and_backward_step() {
    let acc = Accelerator::builder().cpu(true).build().unwrap();
    let device = acc.device().clone();
    // Fixed data and initial weights: the test is the same every run (random ones missed the
    // 10x loss drop about once in a hundred runs).
    let xs: Vec<f32> = (0..256)
        .map(|i| (i * 37 % 101) as f32 / 50.0 - 1.0)
        .collect();
    let x = Tensor::from_vec(xs, (64, 4), &device).unwrap();
    let y = x.sum_keepdim(1).unwrap();
    let mut varmap = VarMap::new();
    let model = candle_nn::linear(
        4,
        1,
        VarBuilder::from_varmap(&varmap, DType::F32, &device).pp("fc"),
    )
    .unwrap();
    let w = Tensor::new(&[[-0.4f32, 0.3, -0.2, 0.1]], &device).unwrap();
    varmap.set_one("fc.weight", &w).unwrap();
    varmap
        .set_one("fc.bias", Tensor::new(&[0.5f32], &device).unwrap())
        .unwrap();
    let opt = AdamW::new_lr(varmap.all_vars(), 0.05).unwrap();
    let loader = DataLoader::new(TensorDataset::new(vec![x.clone(), y.clone()]).unwrap(), 16);
    let (mut opt, loader) = acc.prepare(&varmap, opt, loader).unwrap();
    let mut schedule = Schedule::new(LinearWarmupCosine::new(0.05, 5, 100, 0.0).unwrap());
    let loss = |m: &candle_nn::Linear| {
        candle_nn::loss::mse(&m.forward(&x).unwrap(), &y)
            .unwrap()
            .to_scalar::<f32>()
            .unwrap()
    };
    let before = loss(&model);
    for _ in 0..25 {
        for batch in loader.iter().unwrap() {
            let batch = batch.unwrap();
            schedule.step(&mut opt);
            let l = candle_nn::loss::mse(&model.forward(&batch[0]).unwrap(), &batch[1]).unwrap();
            opt.backward_step(&l).unwrap();
        }
    }
    assert_eq!(schedule.current_step(), 100);
    assert_eq!(opt.inner().step_count(), 100);
    assert_eq!(opt.learning_rate(), schedule.scheduler().lr(99));
    assert!(
        loss(&model) < before * 0.1,
        "{} -> {}",
        before,
        loss(&model)
    );
}

// ---- schedulers ----

fn close(a: f64, b: f64) {
    assert!((a - b).abs() < 1e-12, "{a} != {b}");
}

#[test]
fn constant_schedule() {
    let c = Constant::new(0.3).unwrap();
    assert_eq!((c.lr(0), c.lr(u64::MAX)), (0.3, 0.3));
    assert_eq!(invalid_name(Constant::new(-1.0).unwrap_err()), "lr");
}

#[test]
fn warmup_cosine_values() {
    let s = LinearWarmupCosine::new(1.0, 10, 110, 0.1).unwrap();
    close(s.lr(0), 0.0);
    close(s.lr(5), 0.5);
    close(s.lr(10), 1.0); // end of warmup: the peak
    close(s.lr(60), 0.55); // cosine midpoint: (base + min) / 2
    close(s.lr(110), 0.1);
    close(s.lr(1_000_000), 0.1);
    // Monotonic: rising through the warmup, falling after.
    for k in 0..10 {
        assert!(s.lr(k) < s.lr(k + 1));
    }
    for k in 10..120 {
        assert!(s.lr(k) >= s.lr(k + 1), "step {k}");
    }
    // No warmup: the first step gets the peak.
    let s = LinearWarmupCosine::new(0.5, 0, 100, 0.0).unwrap();
    close(s.lr(0), 0.5);
    close(s.lr(50), 0.25);
    close(s.lr(100), 0.0);
    // All warmup.
    let s = LinearWarmupCosine::new(0.5, 10, 10, 0.0).unwrap();
    close(s.lr(9), 0.45);
    close(s.lr(10), 0.0);
}

#[test]
fn linear_decay_values() {
    let s = LinearDecay::new(1.0, 10, 110, 0.2).unwrap();
    close(s.lr(0), 0.0);
    close(s.lr(10), 1.0);
    close(s.lr(60), 0.6);
    close(s.lr(110), 0.2);
    close(s.lr(500), 0.2);
    for k in 0..10 {
        assert!(s.lr(k) < s.lr(k + 1));
    }
    for k in 10..120 {
        assert!(s.lr(k) >= s.lr(k + 1), "step {k}");
    }
}

#[test]
fn invalid_schedules_name_the_field() {
    let name = |r: accelerate_rs::Result<LinearWarmupCosine>| invalid_name(r.unwrap_err());
    assert_eq!(
        name(LinearWarmupCosine::new(1.0, 10, 5, 0.0)),
        "total_steps"
    );
    assert_eq!(name(LinearWarmupCosine::new(-1.0, 0, 5, 0.0)), "base_lr");
    assert_eq!(name(LinearWarmupCosine::new(1.0, 0, 5, -0.1)), "min_lr");
    assert_eq!(name(LinearWarmupCosine::new(1.0, 0, 5, 2.0)), "min_lr");
    assert_eq!(
        name(LinearWarmupCosine::new(f64::NAN, 0, 5, 0.0)),
        "base_lr"
    );
    let name = |r: accelerate_rs::Result<LinearDecay>| invalid_name(r.unwrap_err());
    assert_eq!(name(LinearDecay::new(1.0, 10, 5, 0.0)), "total_steps");
    assert_eq!(name(LinearDecay::new(-1.0, 0, 5, 0.0)), "base_lr");
    assert_eq!(name(LinearDecay::new(1.0, 0, 5, -0.1)), "end_lr");
}

#[test]
fn schedule_drives_the_optimizer_and_resumes() {
    let vars = params(8);
    let mut opt = Sgd::new(vars, SgdConfig::new(0.0)).unwrap();
    let s = LinearDecay::new(1.0, 2, 6, 0.0).unwrap();
    let mut schedule = Schedule::new(s);
    let mut seen = vec![];
    for _ in 0..4 {
        seen.push(schedule.step(&mut opt));
        assert_eq!(opt.learning_rate(), *seen.last().unwrap());
    }
    assert_eq!(seen, [0.0, 0.5, 1.0, 0.75]);
    assert_eq!(schedule.current_step(), 4);
    // Resume at step 4 elsewhere: same next value.
    let mut resumed = Schedule::new(s);
    resumed.set_step(4);
    assert_eq!(resumed.next_lr(), schedule.next_lr());
    assert_eq!(resumed.step(&mut opt), 0.5);
    // Closures are schedulers too.
    let mut halving = Schedule::new(|k: u64| 1.0 / (1u64 << k) as f64);
    halving.step(&mut opt);
    halving.step(&mut opt);
    assert_eq!(opt.learning_rate(), 0.5);
}
