//! What the fine-tuning example writes, checked before the run and written after it.

use std::collections::HashMap;

use accelerate_rs::{Accelerator, ReduceOp};
use accelerate_rs_models::AutoModel;
use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};

use crate::data::{inputs_and_labels, Data};
use crate::Args;

/// Saves the trained model: every rank calls it. Without LoRA the weights and `config.json` go
/// through `save_model_with_config` (the main process writes); the main process then writes the
/// adapter folder (with LoRA), the tokenizer files, the probe and the merged folder, and every
/// rank learns whether it could.
pub(crate) fn save(
    accelerator: &Accelerator,
    args: &Args,
    model: &mut AutoModel,
    data: &Data,
) -> Result<()> {
    let device = accelerator.device();
    if model.lora_config().is_none() {
        // At ZeRO stage 3 the weights stream through the main process one unit at a time.
        let parameters: &dyn accelerate_rs::Parameters = match model.sharded_parameters() {
            Some(s) => s,
            None => model.varmap(),
        };
        accelerator.save_model_with_config(
            &args.output,
            parameters,
            &model.config_json(),
            accelerate_rs_models::DEFAULT_MAX_SHARD_BYTES,
        )?;
    }
    // The probe's logits: on the main process, or at ZeRO stage 3 on every rank (each runs
    // every unit).
    let sharded = model.sharded_parameters().is_some();
    let probe = match &args.probe {
        Some(_) if sharded || accelerator.is_main_process() => {
            Some(probe(args, model, data, device)?)
        }
        _ => None,
    };
    let saved = if accelerator.is_main_process() {
        save_main(args, model, probe)
    } else {
        Ok(())
    };
    let failed = f64::from(u8::from(saved.is_err()));
    let failed = accelerator.reduce(&Tensor::new(&[failed], device)?, ReduceOp::Sum)?;
    saved?;
    if failed.to_vec1::<f64>()?[0] > 0.0 {
        bail!("the main process could not save {}", args.output.display());
    }
    accelerator.wait_for_everyone()?;
    Ok(())
}

/// The probe: the inputs of the first held-out windows and the trained model's logits.
fn probe(
    args: &Args,
    model: &AutoModel,
    data: &Data,
    device: &Device,
) -> Result<HashMap<String, Tensor>> {
    let val = &data.val;
    let rows = val.0.dim(0)?.min(2);
    let ids = val.0.narrow(0, 0, rows)?;
    let index = val.1.narrow(0, 0, rows)?;
    let (task, mask_id) = (data.task, data.mask_id);
    let (x, _) = inputs_and_labels(task, &ids, &index, mask_id, args.mlm_probability, args.seed)?;
    let logits = model.forward(&x.to_device(device)?, None)?;
    Ok([
        ("input_ids".to_string(), x.to_dtype(DType::I64)?),
        ("logits".to_string(), logits.to_device(&Device::Cpu)?),
    ]
    .into_iter()
    .collect())
}

/// What the main process writes after training: the PEFT adapter folder (with LoRA; the
/// weights are written by every rank's `save_model_with_config` otherwise), the tokenizer files,
/// the probe, and the merged folder.
fn save_main(
    args: &Args,
    model: &mut AutoModel,
    probe: Option<HashMap<String, Tensor>>,
) -> Result<()> {
    if model.lora_config().is_some() {
        model.save_adapter(&args.output)?;
    } else {
        copy_tokenizer(&args.model, &args.output)?;
    }
    if let (Some(path), Some(probe)) = (&args.probe, probe) {
        candle_core::safetensors::save(&probe, path)?;
    }
    println!("saved {}", args.output.display());
    if let Some(dir) = &args.merge {
        model.merge_lora()?;
        model.save_pretrained(dir)?;
        copy_tokenizer(&args.model, dir)?;
        println!("saved the merged model {}", dir.display());
    }
    Ok(())
}

/// Copies the tokenizer files (and the chat template) of the model folder `model` into `dir`
/// (nothing to do when `dir`
/// is that folder: a file copied onto itself would be emptied).
fn copy_tokenizer(model: &std::path::Path, dir: &std::path::Path) -> Result<()> {
    if let (Ok(from), Ok(to)) = (model.canonicalize(), dir.canonicalize()) {
        if from == to {
            return Ok(());
        }
    }
    for file in [
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        accelerate_rs_models::chat::CHAT_TEMPLATE_FILE,
    ] {
        let src = model.join(file);
        if src.is_file() {
            std::fs::copy(&src, dir.join(file))
                .with_context(|| format!("copying {}", src.display()))?;
        }
    }
    Ok(())
}

/// What the run will write, checked before anything is loaded or trained: `--output` and
/// `--merge` are folders that can be written, neither the model's folder, the adapter's nor each
/// other, and empty or new unless `--overwrite`; `--probe` is a file outside every folder the
/// run reads or writes, and not an existing file unless `--overwrite`. Every rank checks (the
/// checks only read, and create missing parent folders), so all stop together.
pub(crate) fn check_outputs(args: &Args) -> Result<()> {
    use accelerate_rs::checkpoint::check_output_dir;
    let mut inputs: Vec<&std::path::Path> = vec![&args.model];
    if let Some(a) = &args.adapter {
        inputs.push(a);
    }
    check_output_dir(&args.output, &inputs, args.overwrite)?;
    let same = |a: &std::path::Path, b: &std::path::Path| {
        let abs = |p: &std::path::Path| std::path::absolute(p).unwrap_or(p.to_path_buf());
        abs(a) == abs(b)
    };
    if let Some(merge) = &args.merge {
        if same(merge, &args.output) {
            bail!(
                "--merge {} is the --output folder: the adapter and the merged model need two \
                 folders",
                merge.display()
            );
        }
        check_output_dir(merge, &inputs, args.overwrite)?;
    }
    if let Some(probe) = &args.probe {
        let abs = std::path::absolute(probe).unwrap_or(probe.clone());
        let mut folders: Vec<&std::path::Path> = inputs.clone();
        folders.push(&args.output);
        if let Some(m) = &args.merge {
            folders.push(m);
        }
        for folder in folders {
            let f = std::path::absolute(folder).unwrap_or(folder.to_path_buf());
            if abs.starts_with(&f) {
                bail!(
                    "--probe {} is inside {}, a folder this run reads or writes: put the probe \
                     elsewhere",
                    probe.display(),
                    folder.display()
                );
            }
        }
        if same(probe, &args.train) {
            bail!("--probe {} is the training text", probe.display());
        }
        match std::fs::symlink_metadata(probe) {
            Ok(m) if m.is_dir() => {
                bail!("--probe {} is a folder: it names a file", probe.display())
            }
            Ok(_) if !args.overwrite => bail!(
                "--probe {} exists: pass --overwrite to replace it, or name a new file",
                probe.display()
            ),
            _ => {}
        }
    }
    Ok(())
}
