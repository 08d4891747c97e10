//! Mixed precision: f32 masters, bf16/f16 working copies, f16 dynamic loss scaling.

use std::io::Read;
use std::sync::Arc;
use std::time::Duration;

use accelerate_rs::collective::{Collective, ThreadGroup};
use accelerate_rs::{Accelerator, DataLoader, LossScaler, MixedPrecision, TensorDataset};
use candle_core::{DType, Device, Module, Tensor, D};
use candle_nn::{linear, loss, AdamW, Linear, Optimizer, ParamsAdamW, VarBuilder, VarMap, SGD};

struct Mlp {
    fc1: Linear,
    fc2: Linear,
}

impl Mlp {
    fn new(vb: VarBuilder, dims: (usize, usize, usize)) -> candle_core::Result<Self> {
        Ok(Mlp {
            fc1: linear(dims.0, dims.1, vb.pp("fc1"))?,
            fc2: linear(dims.1, dims.2, vb.pp("fc2"))?,
        })
    }
}

impl Module for Mlp {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.fc2.forward(&self.fc1.forward(x)?.relu()?)
    }
}

fn accelerator(mode: MixedPrecision) -> Accelerator {
    Accelerator::builder()
        .rank(0)
        .world_size(1)
        .cpu(true)
        .mixed_precision(mode)
        .build()
        .unwrap()
}

/// Regression data: 64 rows of 4 features, target their sum.
fn regression(seed: u64) -> (Tensor, Tensor) {
    let n = 64;
    let x: Vec<f32> = (0..n * 4)
        .map(|i| (((i as u64 * 2654435761 + seed * 97) % 1000) as f32 / 500.0) - 1.0)
        .collect();
    let x = Tensor::from_vec(x, (n, 4), &Device::Cpu).unwrap();
    let y = x.sum_keepdim(1).unwrap();
    (x, y)
}

/// Every master is f32 and its working copy equals it cast to `dtype`.
fn check_copies(master: &VarMap, work: &VarMap, dtype: DType) {
    let m = master.data().lock().unwrap();
    let w = work.data().lock().unwrap();
    assert_eq!(m.len(), w.len());
    for (name, mv) in m.iter() {
        let wv = &w[name];
        assert_eq!(mv.dtype(), DType::F32, "{name}");
        assert_eq!(wv.dtype(), dtype, "{name}");
        let cast = mv
            .as_tensor()
            .to_dtype(dtype)
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap();
        let got = wv.as_tensor().to_dtype(DType::F32).unwrap();
        assert_eq!(
            cast.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            got.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            "{name}"
        );
    }
}

fn snapshot(vm: &VarMap) -> Vec<(String, Vec<f32>)> {
    let data = vm.data().lock().unwrap();
    let mut out: Vec<_> = data
        .iter()
        .map(|(k, v)| {
            let t = v.as_tensor().to_dtype(DType::F32).unwrap();
            (
                k.clone(),
                t.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            )
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

#[test]
fn masters_stay_f32_and_working_copies_track_them() {
    for (mode, dtype) in [
        (MixedPrecision::Bf16, DType::BF16),
        (MixedPrecision::Fp16, DType::F16),
    ] {
        let acc = accelerator(mode);
        let dev = acc.device().clone();
        let master = VarMap::new();
        Mlp::new(
            VarBuilder::from_varmap(&master, DType::F32, &dev),
            (4, 8, 1),
        )
        .unwrap();
        let opt = SGD::new(master.all_vars(), 0.05).unwrap();
        let (x, y) = regression(1);
        let loader = DataLoader::new(TensorDataset::new(vec![x, y]).unwrap(), 16);
        let (mut opt, loader, work) = acc.prepare_mixed(&master, opt, loader).unwrap();
        assert_eq!(opt.compute_dtype(), dtype);
        // The default 2^16 overflows this regression's f16 gradients (covered below).
        opt.set_loss_scaler(LossScaler::new(1024.0));
        let model = Mlp::new(VarBuilder::from_varmap(&work, dtype, &dev), (4, 8, 1)).unwrap();
        check_copies(&master, &work, dtype);
        let before = snapshot(&master);
        for batch in loader.iter().unwrap() {
            let batch = batch.unwrap();
            let out = model.forward(&batch[0].to_dtype(dtype).unwrap()).unwrap();
            let l = loss::mse(&out.to_dtype(DType::F32).unwrap(), &batch[1]).unwrap();
            assert!(opt.backward_step(&l).unwrap(), "{mode}: clean step skipped");
            check_copies(&master, &work, dtype);
        }
        assert_ne!(before, snapshot(&master), "{mode}: training must move");
        assert_eq!(opt.skipped_steps(), 0);
        let expected = if mode == MixedPrecision::Fp16 {
            1024.0
        } else {
            1.0
        };
        assert_eq!(opt.loss_scale(), expected);
    }
}

#[test]
fn no_mixed_precision_is_plain_prepare() {
    let run = |mixed: bool| {
        let acc = accelerator(MixedPrecision::No);
        let dev = acc.device().clone();
        let vm = VarMap::new();
        let model = Mlp::new(VarBuilder::from_varmap(&vm, DType::F32, &dev), (4, 8, 1)).unwrap();
        // Same initial values in both runs.
        for (name, v) in vm.data().lock().unwrap().iter() {
            let n = v.elem_count();
            let vals: Vec<f32> = (0..n)
                .map(|i| ((i * 7 + name.len()) % 11) as f32 / 20.0 - 0.25)
                .collect();
            v.set(&Tensor::from_vec(vals, v.shape(), &dev).unwrap())
                .unwrap();
        }
        let opt = SGD::new(vm.all_vars(), 0.05).unwrap();
        let (x, y) = regression(2);
        let loader = DataLoader::new(TensorDataset::new(vec![x, y]).unwrap(), 16);
        let batches: Vec<_> = if mixed {
            let (mut opt, loader, work) = acc.prepare_mixed(&vm, opt, loader).unwrap();
            assert_eq!(snapshot(&work), snapshot(&vm));
            assert_eq!(opt.compute_dtype(), DType::F32);
            loader
                .iter()
                .unwrap()
                .map(|b| {
                    let b = b.unwrap();
                    let l = loss::mse(&model.forward(&b[0]).unwrap(), &b[1]).unwrap();
                    opt.backward_step(&l).unwrap()
                })
                .collect()
        } else {
            let (mut opt, loader) = acc.prepare(&vm, opt, loader).unwrap();
            loader
                .iter()
                .unwrap()
                .map(|b| {
                    let b = b.unwrap();
                    let l = loss::mse(&model.forward(&b[0]).unwrap(), &b[1]).unwrap();
                    opt.backward_step(&l).unwrap();
                    true
                })
                .collect()
        };
        assert!(batches.iter().all(|s| *s));
        snapshot(&vm)
    };
    assert_eq!(run(true), run(false));
}

#[test]
fn f16_overflow_skips_the_step_lowers_the_scale_and_recovers() {
    let acc = accelerator(MixedPrecision::Fp16);
    let dev = acc.device().clone();
    let master = VarMap::new();
    Mlp::new(
        VarBuilder::from_varmap(&master, DType::F32, &dev),
        (4, 8, 1),
    )
    .unwrap();
    let opt = SGD::new(master.all_vars(), 0.01).unwrap();
    let (x, y) = regression(3);
    let loader = DataLoader::new(TensorDataset::new(vec![x.clone(), y.clone()]).unwrap(), 64);
    let (mut opt, _loader, work) = acc.prepare_mixed(&master, opt, loader).unwrap();
    let model = Mlp::new(VarBuilder::from_varmap(&work, DType::F16, &dev), (4, 8, 1)).unwrap();
    let x16 = x.to_dtype(DType::F16).unwrap();
    let forward = || model.forward(&x16).unwrap().to_dtype(DType::F32).unwrap();

    // A huge loss: its gradient times 2^16 does not fit in f16.
    let before = snapshot(&master);
    let huge = (forward().sum_all().unwrap() * 1e4).unwrap();
    assert!(!opt.backward_step(&huge).unwrap(), "overflow must skip");
    assert_eq!(opt.skipped_steps(), 1);
    assert_eq!(opt.loss_scale(), 32768.0);
    assert_eq!(before, snapshot(&master), "a skipped step must not move");
    check_copies(&master, &work, DType::F16);

    // A clean step succeeds at the lowered scale. The loss is scaled down so that its
    // gradients times 2^15 fit in f16 whatever the random initial weights are.
    let clean = || (loss::mse(&forward(), &y).unwrap() * 1e-3).unwrap();
    let l = clean();
    assert!(opt.backward_step(&l).unwrap());
    assert_eq!(opt.skipped_steps(), 1);
    assert_eq!(opt.loss_scale(), 32768.0);
    assert_ne!(before, snapshot(&master));
    check_copies(&master, &work, DType::F16);

    // Growth after the interval of clean steps.
    opt.set_loss_scaler(LossScaler::new(8.0).with_growth_interval(2));
    for expected in [8.0, 16.0, 16.0, 32.0] {
        let l = clean();
        assert!(opt.backward_step(&l).unwrap());
        assert_eq!(opt.loss_scale(), expected);
    }
}

/// Trains one epoch of the regression with accumulation `n` and per-micro-step batch `batch`
/// from fixed initial values; returns the masters and which calls stepped.
fn accumulated_run(
    mode: MixedPrecision,
    dtype: DType,
    n: usize,
    batch: usize,
) -> (Vec<(String, Vec<f32>)>, Vec<bool>) {
    let acc = Accelerator::builder()
        .rank(0)
        .world_size(1)
        .cpu(true)
        .mixed_precision(mode)
        .gradient_accumulation_steps(n)
        .build()
        .unwrap();
    let dev = acc.device().clone();
    let master = VarMap::new();
    Mlp::new(
        VarBuilder::from_varmap(&master, DType::F32, &dev),
        (4, 8, 1),
    )
    .unwrap();
    {
        let data = master.data().lock().unwrap();
        let mut names: Vec<_> = data.keys().cloned().collect();
        names.sort();
        for (k, name) in names.iter().enumerate() {
            let v = &data[name];
            let vals: Vec<f32> = (0..v.elem_count())
                .map(|i| (((i * 31 + k * 17) % 23) as f32 / 23.0 - 0.5) * 0.8)
                .collect();
            v.set(&Tensor::from_vec(vals, v.shape(), &dev).unwrap())
                .unwrap();
        }
    }
    let opt = SGD::new(master.all_vars(), 0.05).unwrap();
    let (x, y) = regression(3);
    let loader = DataLoader::new(TensorDataset::new(vec![x, y]).unwrap(), batch);
    let (mut opt, loader, work) = acc.prepare_mixed(&master, opt, loader).unwrap();
    if mode == MixedPrecision::Fp16 {
        opt.set_loss_scaler(LossScaler::new(1024.0));
    }
    let model = Mlp::new(VarBuilder::from_varmap(&work, dtype, &dev), (4, 8, 1)).unwrap();
    let mut stepped = Vec::new();
    for b in loader.iter().unwrap() {
        let b = b.unwrap();
        let out = model.forward(&b[0].to_dtype(dtype).unwrap()).unwrap();
        let l = loss::mse(&out.to_dtype(DType::F32).unwrap(), &b[1]).unwrap();
        stepped.push(opt.backward_step_batch(&l, &b).unwrap());
        check_copies(&master, &work, dtype);
    }
    (snapshot(&master), stepped)
}

#[test]
fn gradient_accumulation_works_with_half_precision() {
    for (mode, dtype) in [
        (MixedPrecision::Bf16, DType::BF16),
        (MixedPrecision::Fp16, DType::F16),
    ] {
        // 64 rows: 8 micro-batches of 8 with N = 2 against 4 steps of 16 with N = 1.
        let (accumulated, steps2) = accumulated_run(mode, dtype, 2, 8);
        let (plain, steps1) = accumulated_run(mode, dtype, 1, 16);
        assert_eq!(
            steps2,
            [false, true, false, true, false, true, false, true],
            "{mode}: the masters step on every second micro-step only"
        );
        assert!(steps1.iter().all(|s| *s), "{mode}");
        let mut max_diff = 0f32;
        let mut moved = 0f32;
        // One full-batch step, to show that the runs compared above went further than that.
        let (one_step, _) = accumulated_run(mode, dtype, 1, 64 * 2);
        for ((a, b), (_, c)) in accumulated.iter().zip(&plain).zip(&one_step) {
            assert_eq!(a.0, b.0);
            for ((x, y), z) in a.1.iter().zip(&b.1).zip(c) {
                max_diff = max_diff.max((x - y).abs());
                moved = moved.max((x - z).abs());
            }
        }
        assert!(
            max_diff <= 1e-2,
            "{mode}: accumulated vs full batch differ by {max_diff}"
        );
        assert!(
            moved > 1e-2,
            "{mode}: 4 steps barely differ from 1 ({moved})"
        );
    }
}

#[test]
fn two_ranks_agree_bit_for_bit_on_the_masters() {
    for mode in [MixedPrecision::Bf16, MixedPrecision::Fp16] {
        let handles: Vec<_> = ThreadGroup::new(2, Duration::from_secs(30))
            .unwrap()
            .into_iter()
            .map(|c| {
                std::thread::spawn(move || {
                    let c: Arc<dyn Collective> = Arc::new(c);
                    let acc = Accelerator::builder()
                        .collective(c)
                        .cpu(true)
                        .mixed_precision(mode)
                        .build()
                        .unwrap();
                    let dev = acc.device().clone();
                    let dtype = if mode == MixedPrecision::Bf16 {
                        DType::BF16
                    } else {
                        DType::F16
                    };
                    // Different random initialisations: prepare gives everyone rank 0's.
                    let master = VarMap::new();
                    Mlp::new(
                        VarBuilder::from_varmap(&master, DType::F32, &dev),
                        (4, 8, 1),
                    )
                    .unwrap();
                    let opt = AdamW::new(master.all_vars(), ParamsAdamW::default()).unwrap();
                    let (x, y) = regression(5);
                    let loader = DataLoader::new(TensorDataset::new(vec![x, y]).unwrap(), 16);
                    let (mut opt, mut loader, work) =
                        acc.prepare_mixed(&master, opt, loader).unwrap();
                    let model =
                        Mlp::new(VarBuilder::from_varmap(&work, dtype, &dev), (4, 8, 1)).unwrap();
                    for epoch in 0..3 {
                        loader.set_epoch(epoch);
                        for batch in loader.iter().unwrap() {
                            let batch = batch.unwrap();
                            let out = model.forward(&batch[0].to_dtype(dtype).unwrap()).unwrap();
                            let l =
                                loss::mse(&out.to_dtype(DType::F32).unwrap(), &batch[1]).unwrap();
                            opt.backward_step(&l).unwrap();
                        }
                    }
                    check_copies(&master, &work, dtype);
                    (snapshot(&master), opt.loss_scale(), opt.skipped_steps())
                })
            })
            .collect();
        let results: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        assert_eq!(results[0], results[1], "{mode}");
        assert!(results[0].2 < 6, "{mode}: every step was skipped");
    }
}

/// The digits data (features scaled to 0..1), split 80/20 with a fixed order.
fn digits() -> ((Tensor, Tensor), (Tensor, Tensor)) {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/data/digits.csv.gz");
    let mut text = String::new();
    flate2::read::GzDecoder::new(std::fs::File::open(path).unwrap())
        .read_to_string(&mut text)
        .unwrap();
    let rows: Vec<(Vec<f32>, u32)> = text
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let v: Vec<f32> = l.split(',').map(|s| s.trim().parse().unwrap()).collect();
            (v[..64].iter().map(|p| p / 16.0).collect(), v[64] as u32)
        })
        .collect();
    let split = |rows: Vec<&(Vec<f32>, u32)>| {
        let x: Vec<f32> = rows.iter().flat_map(|r| r.0.iter().copied()).collect();
        let y: Vec<u32> = rows.iter().map(|r| r.1).collect();
        (
            Tensor::from_vec(x, (rows.len(), 64), &Device::Cpu).unwrap(),
            Tensor::from_vec(y, rows.len(), &Device::Cpu).unwrap(),
        )
    };
    // Every fifth row is a test row.
    let test = split(rows.iter().step_by(5).collect());
    let train = split(
        rows.iter()
            .enumerate()
            .filter(|(i, _)| i % 5 != 0)
            .map(|(_, r)| r)
            .collect(),
    );
    (train, test)
}

/// Trains the digits MLP with f32 masters and `mode` compute; returns the mean loss of each epoch
/// and the final test accuracy.
fn train_digits(mode: MixedPrecision, epochs: usize) -> (Vec<f32>, f32) {
    let acc = accelerator(mode);
    let dev = acc.device().clone();
    let ((x, y), (tx, ty)) = digits();
    let master = VarMap::new();
    Mlp::new(
        VarBuilder::from_varmap(&master, DType::F32, &dev),
        (64, 64, 10),
    )
    .unwrap();
    let opt = AdamW::new(
        master.all_vars(),
        ParamsAdamW {
            lr: 3e-3,
            ..Default::default()
        },
    )
    .unwrap();
    let loader = DataLoader::new(TensorDataset::new(vec![x, y]).unwrap(), 32)
        .shuffle(true)
        .seed(7);
    let (mut opt, mut loader, work) = acc.prepare_mixed(&master, opt, loader).unwrap();
    let dtype = opt.compute_dtype();
    let model = Mlp::new(VarBuilder::from_varmap(&work, dtype, &dev), (64, 64, 10)).unwrap();
    let mut losses = Vec::new();
    for epoch in 0..epochs {
        loader.set_epoch(epoch as u64);
        let (mut sum, mut n) = (0f32, 0);
        for batch in loader.iter().unwrap() {
            let batch = batch.unwrap();
            let logits = model.forward(&batch[0].to_dtype(dtype).unwrap()).unwrap();
            let l = loss::cross_entropy(&logits.to_dtype(DType::F32).unwrap(), &batch[1]).unwrap();
            opt.backward_step(&l).unwrap();
            sum += l.to_scalar::<f32>().unwrap();
            n += 1;
        }
        losses.push(sum / n as f32);
    }
    check_copies(&master, &work, dtype);
    let pred = model
        .forward(&tx.to_dtype(dtype).unwrap())
        .unwrap()
        .argmax(D::Minus1)
        .unwrap();
    let correct = pred
        .eq(&ty)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap()
        .sum_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    (losses, correct / ty.dim(0).unwrap() as f32)
}

#[test]
fn bf16_digits_reaches_93_percent() {
    let (losses, acc) = train_digits(MixedPrecision::Bf16, 8);
    eprintln!("bf16 digits: losses {losses:?}, test accuracy {acc}");
    assert!(acc >= 0.93, "bf16 test accuracy {acc} < 0.93");
}

#[test]
fn f16_with_loss_scaling_does_not_diverge() {
    let (losses, acc) = train_digits(MixedPrecision::Fp16, 5);
    eprintln!("f16 digits: losses {losses:?}, test accuracy {acc}");
    assert!(losses.iter().all(|l| l.is_finite()), "{losses:?}");
    assert!(losses.windows(2).all(|w| w[1] < w[0]), "{losses:?}");
    assert!(acc >= 0.9, "f16 test accuracy {acc}");
}
