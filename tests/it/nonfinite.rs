//! The `nonfinite` setting: an optimizer step whose averaged gradients hold a NaN or an infinity
//! stops every rank with an error naming the step, the rank and the parameter (`error`, the
//! default), skips the step (`skip-step`) or steps anyway (`warn`); every rank reaches the same
//! verdict, also under ZeRO stage 2 where each rank holds only its slices.

use std::sync::Arc;

use accelerate_rs::collective::Collective;
use accelerate_rs::{Accelerator, Error, NonFinite};
use candle_core::{DType, Device, Tensor};
use candle_nn::{Optimizer, VarBuilder, VarMap};

/// Three SGD steps of `loss = sum(a * x) + sum(b * x)` with `x` all NaN at step `bad` (on rank
/// `bad_rank` only, or every rank for `None`); the parameters after, or the error.
fn train(
    acc: &Accelerator,
    bad: usize,
    bad_rank: Option<usize>,
    clip: Option<f64>,
) -> accelerate_rs::Result<Vec<f32>> {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let a = vb.get_with_hints(6, "a", candle_nn::Init::Const(1.0))?;
    let b = vb.get_with_hints(5, "b", candle_nn::Init::Const(1.0))?;
    acc.prepare_model(&varmap)?;
    let sgd = accelerate_rs::optim::Sgd::new(
        varmap.all_vars(),
        accelerate_rs::optim::SgdConfig::new(0.1),
    )?;
    let mut opt = acc.prepare_optimizer(sgd);
    opt.set_clip_grad_norm(clip);
    for step in 1..=3 {
        let here = bad_rank.is_none_or(|r| r == acc.rank());
        let v = if step == bad && here { f32::NAN } else { 1.0 };
        let xa = Tensor::full(v, 6, &Device::Cpu)?;
        let xb = Tensor::full(1.0f32, 5, &Device::Cpu)?;
        let loss = ((&a * &xa)?.sum_all()? + (&b * &xb)?.sum_all()?)?;
        opt.backward_step(&loss)?;
    }
    let mut out = a.to_vec1::<f32>()?;
    out.extend(b.to_vec1::<f32>()?);
    Ok(out)
}

fn single(mode: Option<NonFinite>) -> Accelerator {
    let mut b = Accelerator::builder().rank(0).world_size(1).cpu(true);
    if let Some(m) = mode {
        b = b.nonfinite(m);
    }
    b.build().unwrap()
}

#[test]
fn the_default_stops_naming_the_step_the_rank_and_the_parameter() {
    for clip in [None, Some(1.0)] {
        let acc = single(None);
        assert_eq!(acc.state().nonfinite(), NonFinite::Error);
        match train(&acc, 2, None, clip) {
            Err(Error::NonFinite {
                rank,
                step,
                param,
                detail,
            }) => {
                assert_eq!((rank, step, param.as_str()), (0, 2, "a"), "{detail}");
                assert_eq!(detail, "6 NaN and 0 infinite values of 6");
            }
            other => panic!("clip {clip:?}: expected NonFinite, got {other:?}"),
        }
    }
}

#[test]
fn skip_step_skips_and_warn_steps() {
    // Two good steps of lr 0.1 on a gradient of ones: 1 - 0.2.
    let skipped = train(&single(Some(NonFinite::SkipStep)), 2, None, None).unwrap();
    assert!(
        skipped.iter().all(|&v| (v - 0.8).abs() < 1e-6),
        "{skipped:?}"
    );
    let warned = train(&single(Some(NonFinite::Warn)), 2, None, None).unwrap();
    assert!(warned[..6].iter().all(|v| v.is_nan()), "{warned:?}");
    let off = train(&single(Some(NonFinite::Off)), 2, None, None).unwrap();
    assert!(off[..6].iter().all(|v| v.is_nan()), "{off:?}");
}

#[test]
fn every_rank_agrees_also_under_zero_2() {
    for zero in [0usize, 2] {
        // A NaN on rank 1 only: after averaging (or with sliced gradients) every rank stops at
        // step 3, none waits for another.
        let results = crate::common::in_process_with(
            3,
            move |c: Arc<dyn Collective>| Accelerator::builder().collective(c).zero_stage(zero),
            |acc| match train(&acc, 3, Some(1), None) {
                Err(Error::NonFinite { step, .. }) => Ok(step),
                other => Err(format!("{other:?}")),
            },
        );
        assert_eq!(results, vec![Ok(3), Ok(3), Ok(3)], "zero {zero}");
        let results = crate::common::in_process_with(
            2,
            move |c: Arc<dyn Collective>| {
                Accelerator::builder()
                    .collective(c)
                    .zero_stage(zero)
                    .nonfinite(NonFinite::SkipStep)
            },
            |acc| train(&acc, 2, Some(0), None).map_err(|e| e.to_string()),
        );
        for r in &results {
            let v = r.as_ref().unwrap();
            assert!(
                v.iter().all(|&v| (v - 0.8).abs() < 1e-6),
                "zero {zero}: {v:?}"
            );
        }
    }
}
