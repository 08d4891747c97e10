//! Three checks of `accelerate-rs test` on training machinery that must agree across ranks: f16
//! loss scaling when only one rank overflows, `find_executable_batch_size` when only one rank
//! runs out of memory, and the gradients' finiteness check. Each returns how it passed (the
//! first and the third `None` when they do not apply).

use candle_core::{DType, Module, Tensor};
use candle_nn::{linear, Optimizer, VarBuilder, VarMap, SGD};

use accelerate_rs::collective::Buffer;
use accelerate_rs::optim::SgdConfig;
use accelerate_rs::{Accelerator, DataLoader, Error, MixedPrecision, ReduceOp, Result};
use accelerate_rs::{LossScaler, TensorDataset};

fn fail(what: String) -> Error {
    Error::Data { reason: what }
}

/// The masters of `vm`, flattened in name order.
fn masters(vm: &VarMap) -> Result<Vec<f32>> {
    let data = vm
        .data()
        .lock()
        .map_err(|_| fail("the VarMap's lock is poisoned".into()))?;
    let mut names: Vec<&String> = data.keys().collect();
    names.sort();
    let mut out = Vec::new();
    for n in names {
        out.extend(data[n].as_tensor().flatten_all()?.to_vec1::<f32>()?);
    }
    Ok(out)
}

/// f16 mixed precision (`ACCELERATE_RS_MIXED_PRECISION=fp16`) with dynamic loss scaling: the last
/// rank's loss overflows f16 at the initial scale, the others' do not. The gradient averaging
/// carries the overflow to every rank, so every rank must skip the step, halve the scale, keep
/// its masters, and then take the next (clean) step at the lowered scale, all ranks equal.
/// `None` when the mode is not fp16.
pub(super) fn fp16_overflow_on_one_rank(acc: &Accelerator) -> Result<Option<String>> {
    if acc.state().mixed_precision() != MixedPrecision::Fp16 {
        return Ok(None);
    }
    let (rank, world, device) = (acc.rank(), acc.world_size(), acc.device());
    let master = VarMap::new();
    linear(
        4,
        1,
        VarBuilder::from_varmap(&master, DType::F32, device).pp("fc"),
    )?;
    let opt = SGD::new(master.all_vars(), 0.01)?;
    let x: Vec<f32> = (0..64)
        .map(|i| ((i * 7) % 11) as f32 / 11.0 - 0.5)
        .collect();
    let x = Tensor::from_vec(x, (16, 4), device)?;
    let y = (x.sum_keepdim(1)? * 0.5)?;
    let loader = DataLoader::new(TensorDataset::new(vec![x.clone(), y.clone()])?, 16);
    let (mut opt, _loader, work) = acc.prepare_mixed(&master, opt, loader)?;
    let model = linear(
        4,
        1,
        VarBuilder::from_varmap(&work, DType::F16, device).pp("fc"),
    )?;
    let x16 = x.to_dtype(DType::F16)?;
    let forward = || -> Result<Tensor> { Ok(model.forward(&x16)?.to_dtype(DType::F32)?) };
    let before = masters(&master)?;
    // The last rank's gradient times the scale does not fit in f16; the others' do.
    let loss = if rank == world - 1 {
        (forward()?.sum_all()? * 1e4)?
    } else {
        (candle_nn::loss::mse(&forward()?, &y)? * 1e-3)?
    };
    let stepped = opt.backward_step(&loss)?;
    let initial = LossScaler::default().scale();
    let halved = initial / 2.0;
    if stepped || opt.skipped_steps() != 1 || opt.loss_scale() != halved {
        return Err(fail(format!(
            "rank {rank}: after an overflow on rank {} only, stepped {stepped}, skipped {} step(s), scale {} (want no step, 1 skipped, scale {halved})",
            world - 1,
            opt.skipped_steps(),
            opt.loss_scale()
        )));
    }
    if masters(&master)? != before {
        return Err(fail(format!(
            "rank {rank}: a skipped step moved the masters"
        )));
    }
    let clean = (candle_nn::loss::mse(&forward()?, &y)? * 1e-3)?;
    if !opt.backward_step(&clean)? || masters(&master)? == before {
        return Err(fail(format!(
            "rank {rank}: the clean step after the overflow did not step"
        )));
    }
    let mine = masters(&master)?;
    let all = acc.collective().all_gather(Buffer::from(&mine[..]))?;
    if all.iter().any(|b| b.bytes() != all[0].bytes()) {
        return Err(fail("the ranks' masters differ after the steps".into()));
    }
    Ok(Some(format!(
        "rank {} overflowed: every rank skipped, scale {} -> {}, then stepped together",
        world - 1,
        initial,
        opt.loss_scale()
    )))
}

/// `find_executable_batch_size` from 8 while the last rank fails with an (injected)
/// [`Error::OutOfMemory`] above batch size 2, right after a collective on the device (a
/// `reduce`, through NCCL on GPUs) that the other ranks finish: the `Min` vote must make every
/// rank try 8, 4 and 2 and settle on 2, with the reductions right at every size.
pub(super) fn batch_size_search(acc: &Accelerator) -> Result<String> {
    let (rank, world, device) = (acc.rank(), acc.world_size(), acc.device());
    let mut tried = Vec::new();
    let used = acc.find_executable_batch_size(8, |b| {
        tried.push(b);
        let t = Tensor::full(rank as f32 + 1.0, b, device)?;
        let sum = acc.reduce(&t, ReduceOp::Sum)?.to_vec1::<f32>()?;
        let want = (world * (world + 1) / 2) as f32;
        if sum.len() != b || sum.iter().any(|s| *s != want) {
            return Err(fail(format!(
                "rank {rank}: reduce at batch size {b}: got {sum:?}, want {b} x {want}"
            )));
        }
        if rank == world - 1 && b > 2 {
            return Err(Error::OutOfMemory {
                rank: None,
                device: format!("{device:?}"),
                requested: None,
                limit: None,
                detail: "injected by accelerate-rs test".into(),
            });
        }
        Ok(b)
    })?;
    if used != 2 || tried != [8, 4, 2] {
        return Err(fail(format!(
            "rank {rank}: tried {tried:?} and settled on {used}, want [8, 4, 2] and 2"
        )));
    }
    Ok(format!(
        "rank {} ran out at 8 and 4: every rank tried {tried:?} and settled on {used}",
        world - 1
    ))
}

/// The gradients' finiteness check before an optimizer step (the default `nonfinite = error`),
/// in f32, bf16 and f16 on this rank's device: a finite step steps, and a NaN, +inf or -inf in
/// one element of the gradient (on every rank) stops the step with [`Error::NonFinite`]. On a
/// GPU with `ACCELERATE_RS_CUDA_TRIAL=1` the check is the trial kernel's (its launches are
/// counted). `None` when another `nonfinite` setting is in force.
pub(super) fn nonfinite_detection(acc: &Accelerator) -> Result<Option<String>> {
    if acc.state().nonfinite() != accelerate_rs::NonFinite::Error {
        return Ok(None);
    }
    let device = acc.device();
    let launched = accelerate_rs::optim::cuda_kernel_launches();
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        let vm = VarMap::new();
        // A name of its own per dtype: the accelerator registers every prepared model's names.
        let name = format!("nonfinite_check_{dtype:?}");
        let w = VarBuilder::from_varmap(&vm, dtype, device).get((300, 257), &name)?;
        acc.prepare_model(&vm)?;
        let sgd = accelerate_rs::optim::Sgd::new(vm.all_vars(), SgdConfig::new(0.01))?;
        let mut opt = acc.prepare_optimizer(sgd);
        let loss = |bad: f32| -> Result<Tensor> {
            let mut scale = vec![1e-3f32; 300 * 257];
            scale[300 * 257 - 2] = bad;
            let scale = Tensor::from_vec(scale, (300, 257), device)?;
            Ok((w.to_dtype(DType::F32)? * scale)?.sum_all()?)
        };
        let before = w.to_dtype(DType::F32)?.sum_all()?.to_scalar::<f32>()?;
        opt.backward_step(&loss(1e-3)?)?;
        if w.to_dtype(DType::F32)?.sum_all()?.to_scalar::<f32>()? == before {
            return Err(fail(format!("{dtype:?}: a finite step did not step")));
        }
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            match opt.backward_step(&loss(bad)?) {
                Err(Error::NonFinite { .. }) => {}
                other => {
                    return Err(fail(format!(
                        "{dtype:?}: a gradient holding {bad} gave {other:?}, not a non-finite \
                         gradient error"
                    )))
                }
            }
        }
    }
    let launched = accelerate_rs::optim::cuda_kernel_launches() - launched;
    Ok(Some(format!(
        "f32, bf16, f16: NaN, +inf and -inf stop the step; {launched} CUDA kernel launches"
    )))
}
