//! Loading: verify, read and check everything, then set the model, optimizers and states.

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};

use crate::error::Result;
use crate::train::params::Parameters;

use super::io::read_safetensors;
use super::io::{checkpoint_err, corrupt};
use super::manifest::{resolve_checkpoint, verify_checkpoint, Manifest};
use super::names::{
    named_model_file, named_optimizer_base, MODEL_FILE, OPTIMIZER_BASE, STATES_FILE,
};
use super::optimizer::{optimizer_files, read_optimizer};
use super::parts::{Checkpointable, LoadTargets};
use crate::files::io_err;
use crate::optim::{OptimizerState, StatefulOptimizer};

/// Whether a float tensor holds a NaN or an infinity.
pub(super) fn non_finite(t: &Tensor) -> Result<bool> {
    let t = t.to_dtype(candle_core::DType::F32)?;
    let count = |m: Tensor| -> Result<u32> {
        Ok(m.to_dtype(candle_core::DType::U32)?
            .sum_all()?
            .to_scalar::<u32>()?)
    };
    Ok(count(t.ne(&t)?)? + count(t.abs()?.eq(f64::INFINITY)?)? > 0)
}

/// Checks `file`'s tensors against `model` and returns `(var, value)` pairs to set; nothing is
/// changed here.
pub(super) fn fit_model(
    path: &Path,
    mut tensors: HashMap<String, Tensor>,
    model: &dyn Parameters,
) -> Result<Vec<(candle_core::Var, Tensor)>> {
    let mut named = model.named_parameters();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    let mut out = Vec::with_capacity(named.len());
    for (name, var) in named {
        let t = tensors.remove(&name).ok_or_else(|| {
            checkpoint_err(
                path,
                format!("parameter `{name}` is missing (the model has it, the file does not)"),
            )
        })?;
        if t.dims() != var.dims() {
            return Err(checkpoint_err(
                path,
                format!(
                    "parameter `{name}` has shape {:?} in the file, but {:?} in the model",
                    t.dims(),
                    var.dims()
                ),
            ));
        }
        if t.dtype().is_float() && non_finite(&t)? {
            return Err(corrupt(
                path,
                format!("parameter `{name}` holds NaN or infinite values (a diverged run was saved, or the file was damaged)"),
            ));
        }
        let t = t.to_device(var.device())?.to_dtype(var.dtype())?;
        out.push((var, t));
    }
    if let Some(extra) = tensors.keys().min() {
        return Err(checkpoint_err(
            path,
            format!(
                "parameter `{extra}` is in the file but not in the model ({} unexpected in all)",
                tensors.len()
            ),
        ));
    }
    Ok(out)
}

// Checkpoint writing and reading across the ranks of one run, on a collective (the
// `Accelerator` methods of the same names call these).

/// See [`Accelerator::load_state_into`](crate::Accelerator::load_state_into): reads onto
/// `device`; `rank` picks this rank's states; `world_size` is compared with the writer's.
pub(crate) fn load_state(
    device: &Device,
    rank: usize,
    world_size: usize,
    dir: &Path,
    targets: LoadTargets<'_>,
) -> Result<Manifest> {
    let (manifest, found) = find(dir, world_size)?;
    let LoadTargets {
        model,
        optimizer,
        models,
        optimizers,
        states,
        hooks,
    } = targets;
    for hook in &hooks {
        hook(&found, &manifest)?;
    }
    // Read and check everything first.
    let (mut sets, pieces) = read_model(&found, &manifest, model, device)?;
    sets.extend(read_named_models(&found, &manifest, &models, device)?);
    let opt_state = match (&optimizer, &manifest.optimizer) {
        (Some(_), Some(m)) => Some(read_optimizer(&found, OPTIMIZER_BASE, m, device)?),
        (Some(_), None) => {
            return Err(checkpoint_err(
                &found,
                "an optimizer was given, but the checkpoint holds no optimizer state",
            ))
        }
        (None, _) => None,
    };
    let named_states = read_named_optimizers(&found, &manifest, optimizers, device)?;
    let mine = read_rank_states(&found, &manifest, rank, &states)?;
    // Then change things.
    if let (Some(opt), Some(state), Some(m)) = (optimizer, opt_state, &manifest.optimizer) {
        opt.load_optimizer_state(state).map_err(|e| {
            checkpoint_err(
                &optimizer_files(&found, OPTIMIZER_BASE, m),
                format!("does not fit the optimizer: {e}"),
            )
        })?;
    }
    for (path, opt, state) in named_states {
        opt.load_optimizer_state(state)
            .map_err(|e| checkpoint_err(&path, format!("does not fit the optimizer: {e}")))?;
    }
    for (name, target) in states {
        target.restore_state(&mine[&name]).map_err(|e| {
            checkpoint_err(&found.join(STATES_FILE), format!("state `{name}`: {e}"))
        })?;
    }
    for (var, t) in sets {
        var.set(&t)?;
    }
    if let (Some(target), Some(values)) = (model.sharded_parameters(), pieces) {
        target.write_local(&values)?;
    }
    Ok(manifest)
}

/// The verified manifest of `dir` and the folder to load (`dir`, or the complete checkpoint an
/// interrupted save left it for), with a word when either surprises.
fn find(dir: &Path, world_size: usize) -> Result<(Manifest, PathBuf)> {
    let manifest = verify_checkpoint(dir)?;
    let found = resolve_checkpoint(dir).unwrap_or_else(|| dir.to_path_buf());
    if found != dir {
        log::warn!(
            "checkpoint {} is incomplete; loading {} (a save was interrupted)",
            dir.display(),
            found.display()
        );
    }
    if manifest.world_size != world_size {
        log::info!(
            "checkpoint {} was written by {} process(es), loading into {}",
            found.display(),
            manifest.world_size,
            world_size
        );
    }
    Ok((manifest, found))
}

/// The named models' values, read from their files and checked against the models.
fn read_named_models(
    found: &Path,
    manifest: &Manifest,
    models: &[(String, &dyn Parameters)],
    device: &Device,
) -> Result<Vec<(candle_core::Var, Tensor)>> {
    let mut sets = Vec::new();
    for (name, m) in models {
        if !manifest.models.contains_key(name) {
            return Err(checkpoint_err(
                found,
                format!(
                    "model `{name}` is not in the checkpoint (it has: {:?})",
                    manifest.models.keys().collect::<Vec<_>>()
                ),
            ));
        }
        let path = found.join(named_model_file(name));
        sets.extend(fit_model(&path, read_safetensors(&path, device)?, *m)?);
    }
    Ok(sets)
}

/// A named optimizer's state to load: its files (for errors), the optimizer, the state.
type NamedState<'a> = (PathBuf, &'a mut dyn StatefulOptimizer, OptimizerState);

/// The named optimizers' states, read (not yet loaded).
fn read_named_optimizers<'a>(
    found: &Path,
    manifest: &Manifest,
    optimizers: Vec<(String, &'a mut dyn StatefulOptimizer)>,
    device: &Device,
) -> Result<Vec<NamedState<'a>>> {
    let mut named_states = Vec::with_capacity(optimizers.len());
    for (name, opt) in optimizers {
        let m = manifest.optimizers.get(&name).ok_or_else(|| {
            checkpoint_err(
                found,
                format!(
                    "optimizer `{name}` is not in the checkpoint (it has: {:?})",
                    manifest.optimizers.keys().collect::<Vec<_>>()
                ),
            )
        })?;
        let base = named_optimizer_base(&name);
        let state = read_optimizer(found, &base, m, device)?;
        named_states.push((optimizer_files(found, &base, m), opt, state));
    }
    Ok(named_states)
}

/// This rank's saved states (`rank % ranks` when the writer had fewer ranks), checked to hold
/// every named state; `Null` when none is asked for.
fn read_rank_states(
    found: &Path,
    manifest: &Manifest,
    rank: usize,
    states: &[(String, &mut dyn Checkpointable)],
) -> Result<serde_json::Value> {
    let mine = if states.is_empty() {
        serde_json::Value::Null
    } else {
        let path = found.join(STATES_FILE);
        let text = fs::read_to_string(&path).map_err(|e| io_err("reading", &path, e))?;
        let doc: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| corrupt(&path, format!("it does not parse: {e}")))?;
        let ranks = doc["ranks"]
            .as_array()
            .filter(|r| !r.is_empty())
            .ok_or_else(|| corrupt(&path, "it holds no per-rank states"))?;
        if rank >= ranks.len() {
            crate::logging::warn_always(format_args!(
                "checkpoint {} holds states of {} rank(s); rank {rank} takes rank {}'s",
                found.display(),
                ranks.len(),
                rank % ranks.len()
            ));
        }
        ranks[rank % ranks.len()].clone()
    };
    for (name, _) in states {
        if mine.get(name).is_none() {
            return Err(checkpoint_err(
                found,
                format!(
                    "state `{name}` is not in the checkpoint (it has: {:?})",
                    manifest.states
                ),
            ));
        }
    }
    Ok(mine)
}

/// The values to give the model: whole parameters to set, or, for a ZeRO-3 model, this rank's
/// pieces (agreed on by every rank: a rank that cannot read its pieces fails them all).
type ModelValues = (
    Vec<(candle_core::Var, Tensor)>,
    Option<Vec<(String, usize, Tensor)>>,
);

fn read_model(
    found: &Path,
    manifest: &Manifest,
    model: &dyn Parameters,
    device: &Device,
) -> Result<ModelValues> {
    if let Some(target) = model.sharded_parameters() {
        let (values, outcome) = match super::model_shards::read_local(found, manifest, target) {
            Ok(v) => (Some(v), Ok(())),
            Err(e) => (None, Err(e)),
        };
        target.agree(
            "load_state (reading this rank's pieces of the model)",
            outcome,
        )?;
        return Ok((Vec::new(), values));
    }
    let sets = match manifest.model_shards {
        Some(n) => {
            let whole = super::model_shards::read_whole(found, manifest, n, device)?;
            let at = found.join(format!("model.rank-*-of-{n:05}.safetensors"));
            fit_model(&at, whole, model)?
        }
        None => {
            let path = found.join(MODEL_FILE);
            fit_model(&path, read_safetensors(&path, device)?, model)?
        }
    };
    Ok((sets, None))
}
