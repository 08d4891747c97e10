//! An optimizer's part of a checkpoint: one `optimizer.safetensors`, or under ZeRO one file per
//! rank, staged by every rank before the main process moves them in; and reading either back
//! into one whole state.

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};

use crate::collective::Collective;
use crate::error::{Error, Result};
use crate::optim::{OptimizerState, StateShard, StatefulOptimizer};

use super::io::{check_ours, checkpoint_err, corrupt, crash_hook, lock_folder, read_safetensors};
use super::manifest::{model_shard_file, OptimizerManifest};
use super::names::{named_optimizer_base, MANIFEST_FILE, OPTIMIZER_BASE};
use super::parts::CheckpointParts;
use crate::collective::agree_on_write;
use crate::files::{io_err, with_suffix, write_err, write_safetensors};

/// Puts an optimizer's state into `tmp`: `<base>.safetensors`, or for a sharded one
/// ([`Took::Shard`]) the `world_size` per-rank files moved in from `stage`; returns its manifest
/// entry.
pub(super) fn write_optimizer(
    tmp: &Path,
    base: &str,
    took: Option<Took>,
    opt: &dyn StatefulOptimizer,
    stage: Option<&Path>,
    world_size: usize,
) -> Result<OptimizerManifest> {
    let took = match took {
        Some(t) => t,
        None => Took::Whole(opt.optimizer_state()?),
    };
    match took {
        Took::Whole(state) => {
            let file = format!("{base}.safetensors");
            write_safetensors(&tmp.join(&file), &state.tensors)?;
            crash_hook(&file);
            Ok(OptimizerManifest {
                step: state.step,
                lr: state.lr,
                tensors: state.tensors.iter().map(|(n, _)| n.clone()).collect(),
                shards: None,
                shapes: Vec::new(),
            })
        }
        Took::Shard(shard) => {
            let stage = stage.ok_or_else(|| {
                write_err(
                    tmp,
                    format!("`{base}`: the ranks' optimizer shards were not staged"),
                    None,
                )
            })?;
            for r in 0..world_size {
                let file = shard_file(base, r, world_size);
                let from = stage.join(&file);
                fs::rename(&from, tmp.join(&file)).map_err(|e| {
                    io_err(format!("moving rank {r}'s optimizer shard from"), &from, e)
                })?;
            }
            crash_hook(&shard_file(base, 0, world_size));
            let (tensors, shapes) = shard.layout.into_iter().unzip();
            Ok(OptimizerManifest {
                step: shard.step,
                lr: shard.lr,
                tensors,
                shards: Some(world_size),
                shapes,
            })
        }
    }
}

/// The file of rank `rank`'s slices of a sharded optimizer's state (`base`: `optimizer` or
/// `optimizer.<name>`).
pub(super) fn shard_file(base: &str, rank: usize, world_size: usize) -> String {
    format!("{base}.rank-{rank:05}-of-{world_size:05}.safetensors")
}

/// How an optimizer's state is stored, for messages: its file, or its per-rank files.
pub(super) fn optimizer_files(dir: &Path, base: &str, m: &OptimizerManifest) -> PathBuf {
    match m.shards {
        Some(n) => dir.join(format!("{base}.rank-*-of-{n:05}.safetensors")),
        None => dir.join(format!("{base}.safetensors")),
    }
}

/// What every rank takes before the writers write: the per-rank states (gathered) and the state
/// of optimizers whose state is a collective ([`StatefulOptimizer::state_needs_every_rank`]).
#[derive(Default)]
pub(super) struct Taken {
    pub(super) states: Option<String>,
    pub(super) main: Option<Took>,
    pub(super) named: Vec<Option<Took>>,
}

/// An optimizer state taken on every rank: whole (gathered), or this rank's slices.
#[derive(Clone)]
pub(super) enum Took {
    Whole(OptimizerState),
    Shard(StateShard),
}

impl Taken {
    /// The slices to write into per-rank files: `(file base, shard)`.
    fn shards(&self, parts: &CheckpointParts<'_>) -> Vec<(String, &StateShard)> {
        let main = std::iter::once((OPTIMIZER_BASE.to_string(), self.main.as_ref()));
        let named = parts
            .optimizers
            .iter()
            .zip(&self.named)
            .map(|((name, _), t)| (named_optimizer_base(name), t.as_ref()));
        main.chain(named)
            .filter_map(|(base, t)| match t {
                Some(Took::Shard(s)) => Some((base, s)),
                _ => None,
            })
            .collect()
    }
}

/// Takes [`Taken`] on every rank (every rank must call it, in the same order).
/// A sharded optimizer gives its slices, to be written one file per rank, unless every writer
/// must hold the whole state ([`CheckpointParts::save_on_each_node`]).
pub(super) fn take_on_every_rank(c: &dyn Collective, parts: &CheckpointParts<'_>) -> Result<Taken> {
    let states = gather_states(c, parts)?;
    let take = |o: &dyn StatefulOptimizer| -> Result<Option<Took>> {
        if !o.state_needs_every_rank() {
            return Ok(None);
        }
        if !parts.save_on_each_node && c.world_size() > 1 {
            if let Some(shard) = o.optimizer_state_shard()? {
                return Ok(Some(Took::Shard(shard)));
            }
        }
        Ok(Some(Took::Whole(o.optimizer_state()?)))
    };
    let main = match parts.optimizer {
        Some(o) => take(o)?,
        None => None,
    };
    let mut named = Vec::with_capacity(parts.optimizers.len());
    for (_, o) in &parts.optimizers {
        named.push(take(*o)?);
    }
    Ok(Taken {
        states,
        main,
        named,
    })
}

/// Every rank's [`CheckpointParts::states`], gathered on every rank as the text of
/// `states.json` (`{"world_size": n, "ranks": [{name: state}, ...]}`); `None` without states.
/// Every rank must call it (a rank whose state fails to serialize sends its error instead, so
/// that nobody waits for it; the main process then fails the save naming it).
pub(super) fn gather_states(
    c: &dyn Collective,
    parts: &CheckpointParts<'_>,
) -> Result<Option<String>> {
    if parts.states.is_empty() {
        return Ok(None);
    }
    let mine = parts
        .states
        .iter()
        .map(|(n, s)| s.checkpoint_state().map(|v| (n.clone(), v)))
        .collect::<Result<serde_json::Map<String, serde_json::Value>>>()
        .and_then(|m| {
            serde_json::to_string(&m).map_err(|e| Error::invalid("checkpoint state", e.to_string()))
        })
        .unwrap_or_else(|e| format!("\u{0}rank {}: {e}", c.rank()));
    let all = c.all_gather(crate::collective::Buffer::from(mine.as_bytes()))?;
    let mut ranks = Vec::with_capacity(all.len());
    for (r, b) in all.iter().enumerate() {
        let text = String::from_utf8_lossy(b.bytes());
        if let Some(err) = text.strip_prefix('\u{0}') {
            return Err(Error::invalid("checkpoint state", err.to_string()));
        }
        let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| {
            Error::invalid(
                "checkpoint state",
                format!("rank {r} sent an invalid state: {e}"),
            )
        })?;
        ranks.push(v);
    }
    let doc = serde_json::json!({ "world_size": c.world_size(), "ranks": ranks });
    serde_json::to_string_pretty(&doc)
        .map(Some)
        .map_err(|e| Error::invalid("checkpoint state", e.to_string()))
}

/// ZeRO: every rank writes its slices of each sharded optimizer ([`Took::Shard`]) into
/// `<dir>.shards`, made afresh by rank 0 (holding the lock of `folder`); returns the taken state
/// and that folder (`None` when nothing is sharded). Every rank must call it; when any rank
/// fails, every rank fails, naming it.
pub(super) fn stage_shards(
    c: &dyn Collective,
    dir: &Path,
    folder: &Path,
    parts: &CheckpointParts<'_>,
    taken: Result<Taken>,
) -> Result<(Taken, Option<PathBuf>)> {
    let model = parts.model.sharded_parameters();
    let taken = taken.and_then(|t| {
        if model.is_some() && parts.save_on_each_node {
            return Err(crate::train::zero3::unsupported(
                "save_on_each_node (a copy of the checkpoint per machine)",
                "save to a folder every rank sees (each rank writes its own shard)",
            ));
        }
        Ok(t)
    });
    let sharded = model.is_some()
        || taken
            .as_ref()
            .map(|t| !t.shards(parts).is_empty())
            .unwrap_or(false);
    let mut any = [if sharded { 1f32 } else { 0f32 }];
    c.all_reduce((&mut any[..]).into(), crate::collective::ReduceOp::Max)?;
    if any[0] == 0.0 {
        return taken.map(|t| (t, None));
    }
    let stage = with_suffix(dir, ".shards");
    let made = if c.rank() == 0 {
        lock_folder(folder).and_then(|()| {
            if stage.exists() {
                check_stale_stage(&stage)?;
                fs::remove_dir_all(&stage).map_err(|e| io_err("removing stale", &stage, e))?;
            }
            fs::create_dir_all(&stage).map_err(|e| io_err("creating", &stage, e))
        })
    } else {
        Ok(())
    };
    agree_on_write(
        c,
        "save_state (making the folder of the optimizer shards)",
        &stage,
        made,
    )?;
    let rank = c.rank();
    let wrote = taken.and_then(|t| {
        write_own_shards(&stage, &t, parts, model, rank, c.world_size())?;
        Ok(t)
    });
    let mut failed = [match &wrote {
        Ok(_) => 0f32,
        Err(_) => (rank + 1) as f32,
    }];
    c.all_reduce((&mut failed[..]).into(), crate::collective::ReduceOp::Max)?;
    if failed[0] != 0.0 && rank == 0 {
        let _ = fs::remove_dir_all(&stage);
    }
    let t = wrote?;
    if failed[0] != 0.0 {
        return Err(write_err(
            &stage,
            format!(
                "rank {} could not write its shard of the optimizer or model (see its error)",
                failed[0] as usize - 1
            ),
            None,
        ));
    }
    Ok((t, Some(stage)))
}

/// This rank's files in the shard folder `stage`: its slices of each sharded optimizer of `t`
/// and, at ZeRO stage 3, its pieces of the model (`<name>@<start>` tensors).
fn write_own_shards(
    stage: &Path,
    t: &Taken,
    parts: &CheckpointParts<'_>,
    model: Option<&dyn crate::train::pieces::ShardedParameters>,
    rank: usize,
    world: usize,
) -> Result<()> {
    for (base, shard) in t.shards(parts) {
        let pieces: Vec<(String, Tensor)> = shard
            .pieces
            .iter()
            .map(|(name, start, piece)| (format!("{name}@{start}"), piece.clone()))
            .collect();
        write_safetensors(&stage.join(shard_file(&base, rank, world)), &pieces)?;
    }
    if let Some(m) = model {
        let pieces: Vec<(String, Tensor)> = m
            .local_pieces()?
            .into_iter()
            .map(|(name, start, piece)| (format!("{name}@{start}"), piece))
            .collect();
        write_safetensors(&stage.join(model_shard_file(rank, world)), &pieces)?;
    }
    Ok(())
}

/// An error unless `stage`, found in the way, is what a crashed save leaves there: a folder of
/// optimizer shard files (`*.rank-*.safetensors`) only. Anything else is not removed.
fn check_stale_stage(stage: &Path) -> Result<()> {
    check_ours(
        stage,
        |names| {
            names
                .iter()
                .all(|n| n.contains(".rank-") && n.ends_with(".safetensors"))
        },
        "it is not a stage of optimizer shards",
        "a sharded save stages its optimizer shards under this name: \
         move it away, or save the checkpoint under another name",
    )
}

/// Removes the staging folder of optimizer shards (what is left after a failed save).
pub(super) fn remove_stage(stage: Option<&Path>) {
    if let Some(s) = stage {
        if s.exists() {
            if let Err(e) = fs::remove_dir_all(s) {
                log::warn!("could not remove {}: {e}", s.display());
            }
        }
    }
}

/// The optimizer state stored in `dir` under `base` (tensor order from the manifest): one file,
/// or reassembled from the per-rank files of a sharded optimizer.
pub(super) fn read_optimizer(
    dir: &Path,
    base: &str,
    m: &OptimizerManifest,
    device: &Device,
) -> Result<OptimizerState> {
    if let Some(n) = m.shards {
        return read_optimizer_shards(dir, base, m, n, device);
    }
    let path = &dir.join(format!("{base}.safetensors"));
    let mut tensors = read_safetensors(path, device)?;
    let mut ordered = Vec::with_capacity(m.tensors.len());
    for name in &m.tensors {
        let t = tensors
            .remove(name)
            .ok_or_else(|| checkpoint_err(path, format!("optimizer tensor `{name}` is missing")))?;
        ordered.push((name.clone(), t));
    }
    Ok(OptimizerState {
        step: m.step,
        lr: m.lr,
        tensors: ordered,
    })
}

/// The whole optimizer state from the `n` per-rank files of a sharded optimizer: every tensor of
/// the manifest put together from its pieces, which must cover it exactly once.
pub(super) fn read_optimizer_shards(
    dir: &Path,
    base: &str,
    m: &OptimizerManifest,
    n: usize,
    device: &Device,
) -> Result<OptimizerState> {
    let manifest = dir.join(MANIFEST_FILE);
    if m.shapes.len() != m.tensors.len() {
        return Err(corrupt(
            &manifest,
            format!(
                "`{base}` lists {} tensor(s) but {} shape(s)",
                m.tensors.len(),
                m.shapes.len()
            ),
        ));
    }
    let mut pieces = read_shard_pieces(dir, base, m, n, device)?;
    let mut tensors = Vec::with_capacity(m.tensors.len());
    for (name, shape) in m.tensors.iter().zip(&m.shapes) {
        let list = pieces.remove(name).unwrap_or_default();
        let whole = join_pieces(dir, base, m, (name, shape), list, device)?;
        tensors.push((name.clone(), whole));
    }
    Ok(OptimizerState {
        step: m.step,
        lr: m.lr,
        tensors,
    })
}

/// The pieces of a sharded optimizer's tensors: `(first element, values, file)` by tensor name,
/// from the `n` per-rank files (tensors named `<name>@<first element>`).
type Pieces = HashMap<String, Vec<(usize, Tensor, PathBuf)>>;

/// Every piece of the `n` per-rank files, checked to name a tensor the manifest lists.
fn read_shard_pieces(
    dir: &Path,
    base: &str,
    m: &OptimizerManifest,
    n: usize,
    device: &Device,
) -> Result<Pieces> {
    let mut pieces: Pieces = HashMap::new();
    for r in 0..n {
        let path = dir.join(shard_file(base, r, n));
        for (key, t) in read_safetensors(&path, device)? {
            let parsed = key
                .rsplit_once('@')
                .and_then(|(name, start)| Some((name, start.parse::<usize>().ok()?)));
            let Some((name, start)) =
                parsed.filter(|(name, _)| m.tensors.iter().any(|t| t == name))
            else {
                return Err(corrupt(
                    &path,
                    format!("tensor `{key}` is not `<name>@<first element>` of a tensor the manifest lists"),
                ));
            };
            pieces
                .entry(name.to_string())
                .or_default()
                .push((start, t, path.clone()));
        }
    }
    Ok(pieces)
}

/// One tensor (`name`, `shape`) put together from its pieces, which must follow each other from
/// element 0 to the last.
fn join_pieces(
    dir: &Path,
    base: &str,
    m: &OptimizerManifest,
    (name, shape): (&String, &Vec<usize>),
    mut list: Vec<(usize, Tensor, PathBuf)>,
    device: &Device,
) -> Result<Tensor> {
    let total: usize = shape.iter().product();
    list.sort_by_key(|(start, _, _)| *start);
    let mut at = 0;
    let mut flat = Vec::with_capacity(list.len());
    for (start, t, path) in list {
        if start != at || t.rank() != 1 || start + t.elem_count() > total {
            return Err(corrupt(
                &path,
                format!(
                    "optimizer tensor `{name}` ({total} elements): a piece of {} element(s) at {start} does not follow element {at}",
                    t.elem_count()
                ),
            ));
        }
        at += t.elem_count();
        flat.push(t);
    }
    if at != total {
        return Err(corrupt(
            &optimizer_files(dir, base, m),
            format!(
                "optimizer tensor `{name}` has {at} of its {total} elements in the ranks' files"
            ),
        ));
    }
    let whole = if flat.is_empty() {
        // A parameter without elements.
        Tensor::zeros(shape.as_slice(), candle_core::DType::F32, device)
    } else {
        Tensor::cat(&flat, 0).and_then(|t| t.reshape(shape.as_slice()))
    };
    whole.map_err(|e| {
        corrupt(
            &optimizer_files(dir, base, m),
            format!("optimizer tensor `{name}`: {e}"),
        )
    })
}
