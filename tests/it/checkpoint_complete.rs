//! Complete checkpoints: named models and optimizers (a model and its EMA copy, a second
//! optimizer), a registered RNG, the schedule and the loader position in samples, and with f16
//! the loss scaler: a run stopped mid-epoch and resumed from a fresh process state ends
//! bit-identical to an uninterrupted one.

use std::collections::HashMap;

use accelerate_rs::checkpoint::{CheckpointParts, LoadTargets};
use accelerate_rs::optim::{AdamW, Sgd, SgdConfig};
use accelerate_rs::scheduler::{LinearWarmupCosine, Schedule};
use accelerate_rs::{Accelerator, DataLoader, MixedPrecision};
use candle_core::{Tensor, Var};
use candle_nn::{loss, Optimizer};
use rand::Rng;

use crate::common::single;
use crate::common::tiny::{dataset, forward, params, snapshot, HIDDEN};

const STEPS: usize = 13; // over 3 epochs of 5 batches
const STOP: usize = 7; // mid-epoch

struct Run {
    acc: Accelerator,
    main: Vec<(String, Var)>,
    ema: Vec<(String, Var)>,
    disc: Vec<(String, Var)>,
}

/// Trains until `stop` optimizer steps (all of them with `None`), resuming from `resume` when
/// given, and returns every parameter plus the next number the RNG draws; with `save`, saves a
/// checkpoint there at `stop`.
fn run(
    stop: Option<usize>,
    save: Option<&std::path::Path>,
    resume: Option<&std::path::Path>,
) -> (HashMap<String, Tensor>, f32) {
    let r = Run {
        acc: single(),
        main: params(0.0, HIDDEN),
        ema: params(0.0, HIDDEN),
        disc: params(0.5, HIDDEN),
    };
    let vars = |p: &[(String, Var)]| p.iter().map(|(_, v)| v.clone()).collect::<Vec<_>>();
    let mut rng = r.acc.set_seed(5).unwrap();
    let loader = DataLoader::new(dataset(40), 8).shuffle(true).seed(9);
    let (mut opt, mut loader) = r
        .acc
        .prepare(&r.main, AdamW::new_lr(vars(&r.main), 0.01).unwrap(), loader)
        .unwrap();
    let mut disc_opt = Sgd::new(vars(&r.disc), SgdConfig::new(0.05).momentum(0.9)).unwrap();
    let mut sched = Schedule::new(LinearWarmupCosine::new(0.01, 2, STEPS as u64, 0.001).unwrap());
    let mut step = 0usize;
    let mut epoch = 0u64;
    if let Some(dir) = resume {
        let m = r
            .acc
            .load_state_into(
                dir,
                LoadTargets::new(&r.main)
                    .optimizer(&mut opt)
                    .model_named("ema", &r.ema)
                    .model_named("disc", &r.disc)
                    .optimizer_named("disc", &mut disc_opt)
                    .state("rng", &mut rng)
                    .state("schedule", &mut sched),
            )
            .unwrap();
        step = m.step as usize;
        let pos = m.samples.unwrap();
        epoch = pos.epoch;
        loader.resume_from(pos);
    }
    'outer: loop {
        if resume.is_none() || epoch > 0 && step > STOP {
            loader.set_epoch(epoch);
        }
        let mut done = 0;
        for b in loader.iter().unwrap() {
            let b = b.unwrap();
            if step == STEPS {
                break 'outer;
            }
            sched.step(&mut opt);
            let noise = rng.random::<f32>();
            let x = (&b[0] * (1.0 + noise as f64 * 0.01)).unwrap();
            let l = loss::cross_entropy(&forward(&r.main, &x).unwrap(), &b[1]).unwrap();
            opt.backward_step(&l).unwrap();
            let ld = loss::cross_entropy(&forward(&r.disc, &x).unwrap(), &b[1]).unwrap();
            disc_opt.backward_step(&ld).unwrap();
            for ((_, e), (_, p)) in r.ema.iter().zip(&r.main) {
                e.set(&((e.as_tensor() * 0.9).unwrap() + (p.as_tensor() * 0.1).unwrap()).unwrap())
                    .unwrap();
            }
            step += 1;
            done += 1;
            if Some(step) == stop {
                if let Some(dir) = save {
                    let parts = CheckpointParts::new(&r.main)
                        .optimizer(&opt)
                        .model_named("ema", &r.ema)
                        .model_named("disc", &r.disc)
                        .optimizer_named("disc", &disc_opt)
                        .state("rng", &rng)
                        .state("schedule", &sched)
                        .samples(loader.sample_position(done))
                        .step(step as u64);
                    r.acc.save_state(dir, &parts).unwrap();
                }
                break 'outer;
            }
        }
        epoch += 1;
        loader.clear_resume();
    }
    let mut all = HashMap::new();
    for (prefix, p) in [("main", &r.main), ("ema", &r.ema), ("disc", &r.disc)] {
        for (k, v) in snapshot(p) {
            all.insert(format!("{prefix}.{k}"), v);
        }
    }
    (all, rng.random::<f32>())
}

fn bits(m: &HashMap<String, Tensor>) -> HashMap<String, Vec<u32>> {
    m.iter()
        .map(|(k, t)| {
            (
                k.clone(),
                t.flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap()
                    .iter()
                    .map(|x| x.to_bits())
                    .collect(),
            )
        })
        .collect()
}

#[test]
fn a_resumed_run_with_every_part_is_bit_identical() {
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("ck");
    let (full, full_next) = run(None, None, None);
    run(Some(STOP), Some(&ck), None);
    let (resumed, resumed_next) = run(None, None, Some(&ck));
    assert_eq!(bits(&full), bits(&resumed));
    assert_eq!(
        full_next.to_bits(),
        resumed_next.to_bits(),
        "the RNG was not restored"
    );
    // A part asked for that the checkpoint lacks is named.
    let q = params(0.0, HIDDEN);
    let e = single()
        .load_state_into(&ck, LoadTargets::new(&q).model_named("teacher", &q))
        .unwrap_err()
        .to_string();
    assert!(e.contains("teacher") && e.contains("ema"), "{e}");
}

#[test]
fn the_f16_loss_scaler_is_restored() {
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("ck");
    let make = || {
        let acc = Accelerator::builder()
            .rank(0)
            .world_size(1)
            .cpu(true)
            .mixed_precision(MixedPrecision::Fp16)
            .build()
            .unwrap();
        let p = params(0.0, HIDDEN);
        let v: Vec<Var> = p.iter().map(|(_, v)| v.clone()).collect();
        let (opt, _, work) = acc
            .prepare_mixed(
                &p,
                AdamW::new_lr(v, 0.01).unwrap(),
                DataLoader::new(dataset(8), 8),
            )
            .unwrap();
        (acc, p, opt, work)
    };
    let (acc, p, mut opt, work) = make();
    opt.set_loss_scaler(accelerate_rs::LossScaler::new(256.0).with_growth_interval(3));
    let wp: Vec<(String, Var)> = p
        .iter()
        .map(|(k, _)| (k.clone(), work.data().lock().unwrap()[k].clone()))
        .collect();
    for _ in 0..4 {
        let xs = Tensor::ones((4, 8), candle_core::DType::F16, &candle_core::Device::Cpu).unwrap();
        let out = forward(&wp, &xs)
            .unwrap()
            .to_dtype(candle_core::DType::F32)
            .unwrap();
        let l = out.sqr().unwrap().mean_all().unwrap();
        opt.backward_step(&l).unwrap();
    }
    let scaler = opt.loss_scaler().unwrap();
    let (scale, clean) = (scaler.scale(), scaler.clean_steps());
    assert_eq!(
        (scale, clean),
        (512.0, 1),
        "the scale grew once after 3 clean steps"
    );
    acc.save_state(&ck, &CheckpointParts::new(&p).optimizer(&opt))
        .unwrap();
    let (acc2, p2, mut opt2, _) = make();
    assert_eq!(opt2.loss_scale(), 65536.0);
    acc2.load_state(&ck, &p2, Some(&mut opt2)).unwrap();
    let s = opt2.loss_scaler().unwrap();
    assert_eq!((s.scale(), s.clean_steps()), (scale, clean));
}

#[test]
fn save_and_load_hooks_add_and_read_files_of_the_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("ck");
    let acc = single();
    let p = params(0.0, HIDDEN);
    let write = |d: &std::path::Path| -> accelerate_rs::Result<()> {
        std::fs::write(d.join("tokenizer.json"), b"{\"vocab\": 42}")
            .map_err(|e| accelerate_rs::Error::invalid("hook", e.to_string()))
    };
    acc.save_state(&ck, &CheckpointParts::new(&p).on_save(&write))
        .unwrap();
    let m = accelerate_rs::checkpoint::read_manifest(&ck).unwrap();
    assert!(
        m.files.contains_key("tokenizer.json"),
        "{:?}",
        m.files.keys()
    );
    let seen = std::sync::Mutex::new(String::new());
    let read = |d: &std::path::Path,
                _: &accelerate_rs::checkpoint::Manifest|
     -> accelerate_rs::Result<()> {
        *seen.lock().unwrap() = std::fs::read_to_string(d.join("tokenizer.json")).unwrap();
        Ok(())
    };
    acc.load_state_into(&ck, LoadTargets::new(&p).on_load(&read))
        .unwrap();
    assert_eq!(*seen.lock().unwrap(), "{\"vocab\": 42}");
    // The hook's file is covered by the checksums.
    let mut b = std::fs::read(ck.join("tokenizer.json")).unwrap();
    b[3] ^= 1;
    std::fs::write(ck.join("tokenizer.json"), b).unwrap();
    let e = acc.load_state(&ck, &p, None).unwrap_err().to_string();
    assert!(e.contains("tokenizer.json"), "{e}");
    // A failing save hook fails the save and leaves nothing behind.
    let fail = |_: &std::path::Path| -> accelerate_rs::Result<()> {
        Err(accelerate_rs::Error::invalid("hook", "no tokenizer"))
    };
    let other = dir.path().join("other");
    let e = acc
        .save_state(&other, &CheckpointParts::new(&p).on_save(&fail))
        .unwrap_err()
        .to_string();
    assert!(e.contains("no tokenizer"), "{e}");
    assert!(!other.exists());
}
