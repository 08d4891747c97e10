//! ZeRO-3 checkpoints: `save_state` at stage 3 writes each rank's pieces of the model and of the
//! optimizer (one file per rank, no gather) and the sealed manifest; `load_state` reads them at
//! another world size and stage (stage 3 on 4 ranks → stages 0 and 3 on 2, and back), and a
//! run continued from them matches one continued from a stage-0 checkpoint. Damaged or missing
//! shards are named.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::common::tiny::{dataset, forward, max_abs_diff, params, snapshot, HIDDEN};
use crate::zero3::sharded_forward;
use accelerate_rs::checkpoint::CheckpointParts;
use accelerate_rs::collective::Collective;
use accelerate_rs::optim::AdamW;
use accelerate_rs::{Accelerator, DataLoader, WrapPolicy};
use candle_core::{Tensor, Var};
use candle_nn::loss;

const STEPS: usize = 4;
const BATCH: usize = 4;

/// On `world` in-process ranks at `stage`: loads `load` (if any) into the model and AdamW,
/// takes `STEPS` steps, saves into `save`; rank 0's whole parameters after loading and at the
/// end.
fn train_and_save(
    world: usize,
    stage: usize,
    load: Option<PathBuf>,
    save: PathBuf,
) -> (HashMap<String, Tensor>, HashMap<String, Tensor>) {
    let out = crate::common::in_process_with(
        world,
        move |c: Arc<dyn Collective>| Accelerator::builder().collective(c).zero_stage(stage),
        move |acc| {
            // Each rank starts elsewhere: only a loaded checkpoint (or rank 0's values) counts.
            let p = params(0.3 * acc.rank() as f32, HIDDEN);
            let vars: Vec<Var> = p.iter().map(|(_, v)| v.clone()).collect();
            let opt = AdamW::new_lr(vars, 0.01).unwrap();
            let loader = DataLoader::new(dataset(world * BATCH * STEPS), BATCH);
            if stage < 3 {
                let (mut opt, loader) = acc.prepare(&p, opt, loader).unwrap();
                if let Some(dir) = &load {
                    acc.load_state(dir, &p, Some(&mut opt)).unwrap();
                }
                let loaded = snapshot(&p);
                for b in loader.iter().unwrap() {
                    let b = b.unwrap();
                    let l = loss::cross_entropy(&forward(&p, &b[0]).unwrap(), &b[1]).unwrap();
                    opt.backward_step(&l).unwrap();
                }
                acc.save_state(&save, &CheckpointParts::new(&p).optimizer(&opt))
                    .unwrap();
                return (loaded, snapshot(&p));
            }
            let policy = WrapPolicy::prefixes(["fc1", "fc2"]);
            let (mut opt, loader, model) = acc.prepare_sharded(&p, &policy, opt, loader).unwrap();
            drop(p);
            if let Some(dir) = &load {
                acc.load_state(dir, &model, Some(&mut opt)).unwrap();
            }
            let whole = |m: &accelerate_rs::ShardedModel| -> HashMap<String, Tensor> {
                m.full_parameters().unwrap().into_iter().collect()
            };
            let loaded = whole(&model);
            for b in loader.iter().unwrap() {
                let b = b.unwrap();
                let out = sharded_forward(&model, &b[0]).unwrap();
                opt.backward_step(&loss::cross_entropy(&out, &b[1]).unwrap())
                    .unwrap();
            }
            acc.save_state(&save, &CheckpointParts::new(&model).optimizer(&opt))
                .unwrap();
            (loaded, whole(&model))
        },
    );
    out.into_iter().next().unwrap()
}

fn exists(dir: &Path, file: &str) -> bool {
    dir.join(file).is_file()
}

#[test]
fn stage_3_checkpoints_resume_at_other_world_sizes_and_stages() {
    let tmp = tempfile::tempdir().unwrap();
    let d = |n: &str| tmp.path().join(n);
    // The same training on 4 ranks at stages 0 and 3.
    let (_, p0) = train_and_save(4, 0, None, d("w4s0"));
    let (_, p3) = train_and_save(4, 3, None, d("w4s3"));
    assert!(max_abs_diff(&p0, &p3) < 1e-6);
    // Stage 3 wrote one model file and one optimizer file per rank, and no whole model.
    for r in 0..4 {
        assert!(exists(
            &d("w4s3"),
            &format!("model.rank-0000{r}-of-00004.safetensors")
        ));
        assert!(exists(
            &d("w4s3"),
            &format!("optimizer.rank-0000{r}-of-00004.safetensors")
        ));
    }
    assert!(!exists(&d("w4s3"), "model.safetensors"));
    let manifest = accelerate_rs::checkpoint::verify_checkpoint(d("w4s3")).unwrap();
    assert_eq!(manifest.model_shards, Some(4));
    // Continued on 2 ranks from the stage-0 checkpoint at stage 0: the reference.
    let (l_ref, reference) = train_and_save(2, 0, Some(d("w4s0")), d("ref"));
    assert_eq!(max_abs_diff(&l_ref, &p0), 0.0);
    // From the stage-3 checkpoint at stages 0 and 3, and from the stage-0 one at stage 3.
    for (from, stage, name) in [("w4s3", 0, "a"), ("w4s3", 3, "b"), ("w4s0", 3, "c")] {
        let (loaded, got) = train_and_save(2, stage, Some(d(from)), d(name));
        let saved = if from == "w4s3" { &p3 } else { &p0 };
        assert_eq!(
            max_abs_diff(&loaded, saved),
            0.0,
            "{from} into stage {stage}"
        );
        let diff = max_abs_diff(&reference, &got);
        assert!(diff < 1e-6, "{from} continued at stage {stage}: {diff}");
    }
    // Had the moments not been restored, the continuation would differ.
    let (_, fresh) = train_and_save(2, 3, None, d("fresh"));
    assert!(max_abs_diff(&reference, &fresh) > 1e-3);
    // A stage-3 checkpoint of 2 ranks resumes on 3 at stage 3 (uneven pieces).
    let (l3, _) = train_and_save(3, 3, Some(d("b")), d("w3"));
    let (lb, _) = train_and_save(1, 0, Some(d("b")), d("one"));
    assert_eq!(max_abs_diff(&l3, &lb), 0.0);
}

#[test]
fn a_missing_or_damaged_model_shard_is_named_on_every_rank() {
    let tmp = tempfile::tempdir().unwrap();
    let ck = tmp.path().join("ck");
    train_and_save(2, 3, None, ck.clone());
    let file = ck.join("model.rank-00001-of-00002.safetensors");
    let bytes = std::fs::read(&file).unwrap();
    std::fs::remove_file(&file).unwrap();
    let load = |ck: PathBuf| {
        crate::common::in_process_with(
            2,
            |c: Arc<dyn Collective>| Accelerator::builder().collective(c).zero_stage(3),
            move |acc| {
                let p = params(0.0, HIDDEN);
                let vars: Vec<Var> = p.iter().map(|(_, v)| v.clone()).collect();
                let opt = AdamW::new_lr(vars, 0.01).unwrap();
                let loader = DataLoader::new(dataset(8), BATCH);
                let policy = WrapPolicy::prefixes(["fc1", "fc2"]);
                let (mut opt, _, model) = acc.prepare_sharded(&p, &policy, opt, loader).unwrap();
                acc.load_state(&ck, &model, Some(&mut opt))
                    .map(drop)
                    .map_err(|e| e.to_string())
            },
        )
    };
    for r in load(ck.clone()) {
        let e = r.unwrap_err();
        assert!(e.contains("model.rank-00001-of-00002.safetensors"), "{e}");
    }
    let mut bad = bytes.clone();
    let n = bad.len();
    bad[n - 5] ^= 0x21;
    std::fs::write(&file, &bad).unwrap();
    for r in load(ck.clone()) {
        let e = r.unwrap_err();
        assert!(e.contains("model.rank-00001-of-00002.safetensors"), "{e}");
    }
    std::fs::write(&file, &bytes).unwrap();
    for r in load(ck) {
        r.unwrap();
    }
}
