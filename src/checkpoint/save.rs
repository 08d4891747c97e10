//! Saving: the checkpoint's files and manifest written into a temporary folder, then swapped in
//! atomically; `save_state` and `save_state_auto` on every rank.

use std::collections::BTreeMap;
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use crate::collective::Collective;
use crate::error::{Error, Result};

use super::io::{check_ours, crash_hook, lock_folder};
use super::manifest::{checksum_file, model_shard_file, FileChecksum, Manifest, OptimizerManifest};
use super::names::{
    named_model_file, named_optimizer_base, AUTO_PREFIX, MANIFEST_FILE, MODEL_FILE, OPTIMIZER_BASE,
    STATES_FILE,
};
use super::optimizer::{remove_stage, stage_shards, take_on_every_rank, write_optimizer, Taken};
use super::parts::CheckpointParts;
use super::rotation::{auto_entries, latest_number, rotate};
use crate::files::{io_err, sync_dir, sync_file, with_suffix, write_err, write_safetensors};
use crate::train::params::named_tensors;

/// Writes a checkpoint into `tmp` (which must not exist).
pub(super) fn write_checkpoint(
    tmp: &Path,
    parts: &CheckpointParts<'_>,
    world_size: usize,
    taken: &Taken,
    stage: Option<&Path>,
) -> Result<()> {
    let states = taken.states.as_deref();
    check_part_names(parts)?;
    fs::create_dir_all(tmp).map_err(|e| io_err("creating", tmp, e))?;
    let models = write_named_models(tmp, parts)?;
    let optimizers = write_named_optimizers(tmp, parts, world_size, taken, stage)?;
    for hook in &parts.hooks {
        hook(tmp)?;
    }
    if let Some(text) = states {
        let path = tmp.join(STATES_FILE);
        fs::write(&path, text).map_err(|e| write_err(&path, "could not write it", Some(e)))?;
        sync_file(&path)?;
    }
    let (parameters, model_shards, model_shapes) = write_model(tmp, parts, world_size, stage)?;
    let optimizer = match parts.optimizer {
        Some(opt) => {
            let took = taken.main.clone();
            Some(write_optimizer(
                tmp,
                OPTIMIZER_BASE,
                took,
                opt,
                stage,
                world_size,
            )?)
        }
        None => None,
    };
    let files = checksums(tmp)?;
    let path = tmp.join(MANIFEST_FILE);
    let manifest = Manifest {
        version: env!("CARGO_PKG_VERSION").to_string(),
        world_size,
        step: parts.step,
        optimizer,
        schedule_step: parts.schedule_step,
        loader: parts.loader,
        samples: parts.samples,
        parameters,
        model_shards,
        model_shapes,
        extra: parts.extra.clone(),
        models,
        optimizers,
        states: parts.states.iter().map(|(n, _)| n.clone()).collect(),
        files,
        checksum: None,
        manifest_crc32: None,
    };
    let text = manifest.to_sealed_json()?;
    let mut f = fs::File::create(&path).map_err(|e| io_err("creating", &path, e))?;
    f.write_all(text.as_bytes())
        .and_then(|()| f.sync_all())
        .map_err(|e| io_err("writing", &path, e))?;
    sync_dir(tmp);
    Ok(())
}

/// The named models ([`CheckpointParts::model_named`]), each in its own file: the manifest's
/// names of each one's tensors.
fn write_named_models(
    tmp: &Path,
    parts: &CheckpointParts<'_>,
) -> Result<BTreeMap<String, Vec<String>>> {
    let mut models = BTreeMap::new();
    for (name, m) in &parts.models {
        if m.sharded_parameters().is_some() {
            return Err(crate::train::zero3::unsupported(
                &format!("a sharded model saved under a name (`{name}`)"),
                "save it as the checkpoint's model",
            ));
        }
        let tensors = named_tensors(*m)?;
        write_safetensors(&tmp.join(named_model_file(name)), &tensors)?;
        models.insert(name.clone(), tensors.into_iter().map(|(n, _)| n).collect());
    }
    Ok(models)
}

/// The named optimizers' states ([`CheckpointParts::optimizer_named`]): the manifest's entry of
/// each.
fn write_named_optimizers(
    tmp: &Path,
    parts: &CheckpointParts<'_>,
    world_size: usize,
    taken: &Taken,
    stage: Option<&Path>,
) -> Result<BTreeMap<String, OptimizerManifest>> {
    let mut optimizers = BTreeMap::new();
    for (i, (name, o)) in parts.optimizers.iter().enumerate() {
        let took = taken.named.get(i).cloned().flatten();
        let base = named_optimizer_base(name);
        let m = write_optimizer(tmp, &base, took, *o, stage, world_size)?;
        optimizers.insert(name.clone(), m);
    }
    Ok(optimizers)
}

/// Checksums of every file in `tmp` but the manifest, as it is on disk.
fn checksums(tmp: &Path) -> Result<BTreeMap<String, FileChecksum>> {
    let mut files = BTreeMap::new();
    for entry in fs::read_dir(tmp).map_err(|e| io_err("listing", tmp, e))? {
        let entry = entry.map_err(|e| io_err("listing", tmp, e))?;
        let Some(name) = entry.file_name().to_str().map(str::to_string) else {
            continue;
        };
        if name == MANIFEST_FILE {
            continue;
        }
        let path = entry.path();
        let sum = checksum_file(&path).map_err(|e| io_err("reading back", &path, e))?;
        files.insert(name, sum);
    }
    Ok(files)
}

/// The model's part of a checkpoint in `tmp`: `model.safetensors`, or for a ZeRO-3 model the
/// `world_size` per-rank files every rank staged in `stage`. Returns the manifest's parameter
/// names, number of model files and shapes.
type ModelEntry = (Vec<String>, Option<usize>, Vec<Vec<usize>>);

fn write_model(
    tmp: &Path,
    parts: &CheckpointParts<'_>,
    world_size: usize,
    stage: Option<&Path>,
) -> Result<ModelEntry> {
    let Some(sharded) = parts.model.sharded_parameters() else {
        let model = named_tensors(parts.model)?;
        write_safetensors(&tmp.join(MODEL_FILE), &model)?;
        crash_hook(MODEL_FILE);
        return Ok((
            model.into_iter().map(|(n, _)| n).collect(),
            None,
            Vec::new(),
        ));
    };
    let stage =
        stage.ok_or_else(|| write_err(tmp, "the ranks' model shards were not staged", None))?;
    for r in 0..world_size {
        let file = model_shard_file(r, world_size);
        let from = stage.join(&file);
        fs::rename(&from, tmp.join(&file))
            .map_err(|e| io_err(format!("moving rank {r}'s model shard from"), &from, e))?;
    }
    crash_hook(MODEL_FILE);
    let mut params: Vec<(String, Vec<usize>)> = sharded
        .unit_specs()
        .into_iter()
        .flat_map(|(_, _, members)| members)
        .collect();
    params.sort();
    let (names, shapes) = params.into_iter().unzip();
    Ok((names, Some(world_size), shapes))
}

/// An error unless the checkpoint may take the place of `dir` whole (the previous one is moved
/// to `<dir>.old`, then removed): `dir` is absent, an empty folder, or a checkpoint (it holds
/// `manifest.json`). Anything else, a file or a folder of other things, is refused and left as
/// it is, never deleted.
pub(super) fn check_replaceable(dir: &Path) -> Result<()> {
    check_ours(
        dir,
        |names| names.is_empty() || names.iter().any(|n| n == MANIFEST_FILE),
        &format!("it is not a checkpoint (no {MANIFEST_FILE})"),
        "a checkpoint replaces its folder whole: save into a new or empty folder \
         (or move that one away)",
    )
}

/// Names of named parts: non-empty, `[A-Za-z0-9_-]`, unique per kind.
pub(super) fn check_part_names(parts: &CheckpointParts<'_>) -> Result<()> {
    for (kind, names) in [
        (
            "model",
            parts.models.iter().map(|(n, _)| n).collect::<Vec<_>>(),
        ),
        (
            "optimizer",
            parts.optimizers.iter().map(|(n, _)| n).collect(),
        ),
        ("state", parts.states.iter().map(|(n, _)| n).collect()),
    ] {
        let mut seen = std::collections::BTreeSet::new();
        for n in names {
            if n.is_empty()
                || !n
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
            {
                return Err(Error::invalid(
                    format!("{kind} name {n:?}"),
                    "use letters, digits, `_` and `-` only",
                ));
            }
            if kind == "optimizer" && n.starts_with("rank-") {
                return Err(Error::invalid(
                    format!("{kind} name {n:?}"),
                    "may not start with `rank-` (the names of the per-rank files of sharded optimizers)",
                ));
            }
            if !seen.insert(n) {
                return Err(Error::invalid(
                    format!("{kind} name {n:?}"),
                    "is used twice",
                ));
            }
        }
    }
    Ok(())
}

/// See [`Accelerator::save_state`](crate::Accelerator::save_state).
pub(crate) fn save_state(
    c: &dyn Collective,
    local_rank: usize,
    dir: &Path,
    parts: &CheckpointParts<'_>,
) -> Result<()> {
    let folder = match dir.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let staged = stage_shards(c, dir, &folder, parts, take_on_every_rank(c, parts));
    let result = if writes(c, local_rank, parts) {
        staged.and_then(|(taken, stage)| {
            let saved = lock_folder(&folder)
                .and_then(|()| save_atomic(dir, parts, c.world_size(), &taken, stage.as_deref()));
            remove_stage(stage.as_deref());
            saved
        })
    } else {
        staged.map(|_| ())
    };
    agree_all(c, "save_state", dir, result)
}

/// Whether this rank writes the checkpoint: rank 0, or every machine's local rank 0 with
/// [`CheckpointParts::save_on_each_node`].
pub(super) fn writes(c: &dyn Collective, local_rank: usize, parts: &CheckpointParts<'_>) -> bool {
    if parts.save_on_each_node {
        local_rank == 0
    } else {
        c.rank() == 0
    }
}

/// Makes every rank fail when any writer failed (several writers with `save_on_each_node`).
pub(super) fn agree_all(
    c: &dyn Collective,
    op: &str,
    path: &Path,
    result: Result<()>,
) -> Result<()> {
    let mut failed = [if result.is_ok() { 0f32 } else { 1f32 }];
    c.all_reduce((&mut failed[..]).into(), crate::collective::ReduceOp::Max)?;
    result?;
    if failed[0] != 0.0 {
        return Err(write_err(
            path,
            format!("{op} failed on the main process, rank 0 (or, with save_on_each_node, on a machine's local rank 0; see its error)"),
            None,
        ));
    }
    Ok(())
}

/// See [`Accelerator::save_state_auto`](crate::Accelerator::save_state_auto).
pub(crate) fn save_state_auto(
    c: &dyn Collective,
    local_rank: usize,
    root: &Path,
    parts: &CheckpointParts<'_>,
    total_limit: usize,
) -> Result<PathBuf> {
    // Every rank lists `root` before anyone writes, and all take the largest N any rank found
    // (with a copy per machine, the machines' folders may differ).
    let next = auto_entries(root)
        .iter()
        .map(|(n, _)| n + 1)
        .chain(latest_number(root).map(|n| n + 1))
        .max()
        .unwrap_or(0);
    let mut agreed = [next as f64];
    c.all_reduce((&mut agreed[..]).into(), crate::collective::ReduceOp::Max)?;
    let next = agreed[0] as u64;
    let dir = root.join(format!("{AUTO_PREFIX}{next}"));
    let staged = stage_shards(c, &dir, root, parts, take_on_every_rank(c, parts));
    let result = if writes(c, local_rank, parts) {
        staged
            .and_then(|(taken, stage)| {
                let saved = lock_folder(root).and_then(|()| {
                    save_atomic(&dir, parts, c.world_size(), &taken, stage.as_deref())
                });
                remove_stage(stage.as_deref());
                saved
            })
            .and_then(|()| rotate(root, total_limit))
    } else {
        staged.map(|_| ())
    };
    agree_all(c, "save_state_auto", &dir, result)?;
    Ok(dir)
}

pub(super) fn save_atomic(
    dir: &Path,
    parts: &CheckpointParts<'_>,
    world_size: usize,
    taken: &Taken,
    stage: Option<&Path>,
) -> Result<()> {
    let old = with_suffix(dir, ".old");
    check_replaceable(dir)?;
    check_replaceable(&old)?;
    let tmp = with_suffix(dir, &format!(".tmp-{}", std::process::id()));
    if tmp.exists() {
        fs::remove_dir_all(&tmp).map_err(|e| io_err("removing stale", &tmp, e))?;
    }
    if let Err(e) = write_checkpoint(&tmp, parts, world_size, taken, stage) {
        let _ = fs::remove_dir_all(&tmp);
        return Err(e);
    }
    if dir.exists() {
        if old.exists() {
            fs::remove_dir_all(&old).map_err(|e| io_err("removing stale", &old, e))?;
        }
        fs::rename(dir, &old).map_err(|e| io_err("renaming the previous checkpoint", dir, e))?;
    }
    fs::rename(&tmp, dir).map_err(|e| io_err("renaming the new checkpoint into", dir, e))?;
    if let Some(parent) = dir.parent() {
        sync_dir(parent);
    }
    if old.exists() {
        fs::remove_dir_all(&old)
            .map_err(|e| io_err("removing the previous checkpoint", &old, e))?;
    }
    Ok(())
}
