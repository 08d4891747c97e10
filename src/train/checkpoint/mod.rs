//! Checkpoints: save the training state and resume it bit-identically, as methods on
//! [`Accelerator`](crate::Accelerator) (Hugging Face Accelerate's `save_state` / `load_state` / `save_model`).
//!
//! A checkpoint is a directory holding
//!
//! | file | contents |
//! |---|---|
//! | `model.safetensors` | the model's parameters, under their names ([`Parameters`]) |
//! | `optimizer.safetensors` | the optimizer's state tensors (`"{i}.m"`, ...; only with an optimizer) |
//! | `optimizer.rank-0000R-of-0000N.safetensors` | instead, with a ZeRO-sharded optimizer (`zero_stage` 1 or 2): rank `R`'s slices of the state, written by that rank |
//! | `manifest.json` | [`Manifest`]: steps, learning rate, schedule step, loader position, world size, version, `extra` |
//!
//! What goes in is named explicitly with [`CheckpointParts`]; [`Accelerator::load_state`](crate::Accelerator::load_state) puts
//! the model and optimizer back and returns the [`Manifest`], from which the caller restores the
//! rest ([`DataLoader::resume_at`](crate::DataLoader::resume_at),
//! [`Schedule::set_step`](crate::scheduler::Schedule::set_step)):
//!
//! ```no_run
//! # use accelerate_rs::{Accelerator, DataLoader, TensorDataset};
//! # use accelerate_rs::checkpoint::{CheckpointParts, LoaderPosition, latest_checkpoint};
//! # use accelerate_rs::optim::AdamW;
//! # use candle_nn::VarMap;
//! # fn main() -> accelerate_rs::Result<()> {
//! # let acc = Accelerator::new()?;
//! # let varmap = VarMap::new();
//! # let mut opt = AdamW::new_lr(varmap.all_vars(), 1e-3)?;
//! # let mut loader: DataLoader = todo!();
//! # let (step, epoch, batches_done) = (0u64, 0u64, 0usize);
//! // Save (every rank calls it; the main process writes):
//! let parts = CheckpointParts::new(&varmap)
//!     .optimizer(&opt)
//!     .loader(LoaderPosition { epoch, batches_done })
//!     .step(step);
//! acc.save_state_auto("ckpts", &parts, 3)?;
//!
//! // Resume (every rank reads the same files):
//! if let Some(dir) = latest_checkpoint("ckpts")? {
//!     let manifest = acc.load_state(&dir, &varmap, Some(&mut opt))?;
//!     if let Some(pos) = manifest.loader {
//!         loader.resume_at(pos.epoch, pos.batches_done);
//!     }
//! }
//! # Ok(()) }
//! ```
//!
//! **Every rank** must call [`save_state`](crate::Accelerator::save_state),
//! [`save_state_auto`](crate::Accelerator::save_state_auto) and [`save_model`](crate::Accelerator::save_model)
//! at the same point: only the main process writes, the others wait for it and get its error, if
//! any. The directory must be visible to every rank (the same machine, or a shared file system)
//! for [`load_state`](crate::Accelerator::load_state).
//!
//! **Atomicity.** The main process writes everything into `<dir>.tmp-<pid>`, syncs it, and only
//! then renames it to `<dir>`. A directory cannot be renamed over a non-empty one, so an existing
//! `<dir>` is first renamed to `<dir>.old`, and removed once the new one is in place. A crash
//! leaves either the old checkpoint (as `<dir>` or `<dir>.old`, which `load_state` falls back
//! to) or the new one, never a mix; `manifest.json` is written last, so a directory without it
//! is never taken for a checkpoint. Because the folder is replaced whole, an existing `<dir>`
//! (and `<dir>.old`) must be empty or a checkpoint: a folder of anything else is refused with
//! an error naming it, never deleted. Model folders (`save_model_sharded`, `save_adapter`) are
//! written into their folder instead, keeping its other files.
//!
//! **Sharded optimizers.** Under ZeRO (`zero_stage` 1 or 2) each rank holds only its slices of
//! the optimizer state, and each writes them to its own file
//! (`optimizer.rank-0000R-of-0000N.safetensors`, tensors named `"<name>@<first element>"`) in
//! `<dir>.shards`; the main process moves the files into the new checkpoint, with their
//! checksums in the manifest ([`OptimizerManifest::shards`]). No rank ever holds the whole
//! state to save it. Loading reassembles the whole state from the N files, so the checkpoint
//! loads at any world size and any stage (the optimizer is cut into the new world's slices at
//! its first step), and into an unsharded optimizer. With
//! [`save_on_each_node`](CheckpointParts::save_on_each_node) (no shared file system) the slices
//! are instead gathered and every writer saves the whole state in `optimizer.safetensors`.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

use candle_core::Tensor;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::optim::StatefulOptimizer;
use crate::train::params::Parameters;

mod adapter;
mod io;
mod load;
mod manifest;
mod model_files;
mod model_shards;
mod optimizer;
mod place;
mod rotation;
mod save;
mod stream;

pub use io::LOCK_FILE;
pub(crate) use load::load_state;
pub use manifest::{
    read_manifest, resolve_checkpoint, verify_checkpoint, FileChecksum, Manifest, OptimizerManifest,
};
pub(crate) use model_files::{save_model, save_model_sharded};
pub use model_files::{write_model_folder, SHARD_INDEX_FILE};
pub use place::check_output_dir;
pub use rotation::latest_checkpoint;
pub(crate) use save::{save_state, save_state_auto};

/// The model file inside a checkpoint.
pub const MODEL_FILE: &str = "model.safetensors";
/// The optimizer state file inside a checkpoint.
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";
/// The manifest inside a checkpoint; written last, so its presence marks a complete checkpoint.
pub const MANIFEST_FILE: &str = "manifest.json";
/// The prefix of the directories written by [`Accelerator::save_state_auto`](crate::Accelerator::save_state_auto).
pub const AUTO_PREFIX: &str = "checkpoint_";

/// State of your own to keep in checkpoints, per rank (Accelerate's
/// `register_for_checkpointing`): a data-augmentation RNG, an EMA decay counter, a curriculum
/// position. Hand it to [`CheckpointParts::state`] and [`LoadTargets::state`] under a name.
/// Implemented for [`ChaCha8Rng`](rand_chacha::ChaCha8Rng) (the generator
/// [`Accelerator::set_seed`](crate::Accelerator::set_seed) returns) and for
/// [`Schedule`](crate::scheduler::Schedule). Candle's own CPU RNG (behind `Tensor::randn` on the
/// CPU) cannot be captured: draw from a registered generator instead.
pub trait Checkpointable {
    /// A snapshot of the state, as JSON.
    fn checkpoint_state(&self) -> Result<serde_json::Value>;
    /// Puts a snapshot back; errors (changing nothing) when it does not fit.
    fn restore_state(&mut self, state: &serde_json::Value) -> Result<()>;
}

impl Checkpointable for rand_chacha::ChaCha8Rng {
    fn checkpoint_state(&self) -> Result<serde_json::Value> {
        let seed: Vec<u8> = self.get_seed().to_vec();
        Ok(serde_json::json!({
            "seed": seed,
            "stream": self.get_stream().to_string(),
            "word_pos": self.get_word_pos().to_string(),
        }))
    }
    fn restore_state(&mut self, state: &serde_json::Value) -> Result<()> {
        use rand::SeedableRng;
        let bad = |why: &str| Error::invalid("ChaCha8Rng state", why.to_string());
        let seed: Vec<u8> = serde_json::from_value(state["seed"].clone())
            .map_err(|_| bad("`seed` is not a list of bytes"))?;
        let seed: [u8; 32] = seed
            .try_into()
            .map_err(|_| bad("`seed` does not hold 32 bytes"))?;
        let num = |k: &str| -> Result<u128> {
            state[k]
                .as_str()
                .and_then(|s| s.parse().ok())
                .ok_or_else(|| bad(&format!("`{k}` is not a number")))
        };
        let (stream, pos) = (num("stream")?, num("word_pos")?);
        let stream = u64::try_from(stream).map_err(|_| bad("`stream` is out of range"))?;
        let mut rng = rand_chacha::ChaCha8Rng::from_seed(seed);
        rng.set_stream(stream);
        rng.set_word_pos(pos);
        *self = rng;
        Ok(())
    }
}

/// Where a data loader stands: `batches_done` batches of `epoch` were consumed. Give it back to
/// [`DataLoader::resume_at`](crate::DataLoader::resume_at).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoaderPosition {
    /// The epoch in progress.
    pub epoch: u64,
    /// Batches of that epoch already trained on (per rank; the same on every rank).
    pub batches_done: usize,
}

/// What [`Accelerator::save_state`](crate::Accelerator::save_state) writes. Built with [`new`](Self::new) and the setters.
pub struct CheckpointParts<'a> {
    /// The model's parameters (required).
    pub model: &'a dyn Parameters,
    /// The optimizer, if its state is to be saved.
    pub optimizer: Option<&'a dyn StatefulOptimizer>,
    /// The learning-rate schedule's step ([`Schedule::current_step`](crate::scheduler::Schedule::current_step)).
    pub schedule_step: Option<u64>,
    /// The data loader's position.
    pub loader: Option<LoaderPosition>,
    /// The data loader's position in global samples (resumable at any world size).
    pub samples: Option<crate::data::SamplePosition>,
    /// The training loop's own step counter.
    pub step: u64,
    /// Free-form strings saved in the manifest.
    pub extra: BTreeMap<String, String>,
    /// More models, by name (EMA weights, a GAN's discriminator): `model.<name>.safetensors`.
    pub models: Vec<(String, &'a dyn Parameters)>,
    /// More optimizers, by name: `optimizer.<name>.safetensors`.
    pub optimizers: Vec<(String, &'a dyn StatefulOptimizer)>,
    /// State of your own, by name, saved for every rank ([`Checkpointable`]).
    pub states: Vec<(String, &'a dyn Checkpointable)>,
    /// Whether the main process of every machine writes a copy (clusters without a shared file
    /// system; Accelerate's `save_on_each_node`), instead of rank 0 alone.
    pub save_on_each_node: bool,
    /// Save hooks ([`on_save`](Self::on_save)), run in order by every writing process.
    pub hooks: Vec<&'a SaveHook<'a>>,
}

/// A save hook: gets the directory being written (not yet renamed into place) and may add files
/// to it.
pub type SaveHook<'a> = dyn Fn(&Path) -> Result<()> + Send + Sync + 'a;

/// A load hook: gets the verified checkpoint directory and its manifest before anything is
/// changed.
pub type LoadHook<'a> = dyn Fn(&Path, &Manifest) -> Result<()> + Send + Sync + 'a;

impl std::fmt::Debug for CheckpointParts<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CheckpointParts")
            .field("optimizer", &self.optimizer.is_some())
            .field("schedule_step", &self.schedule_step)
            .field("loader", &self.loader)
            .field("samples", &self.samples)
            .field("step", &self.step)
            .field("extra", &self.extra)
            .field("save_on_each_node", &self.save_on_each_node)
            .field("models", &names(&self.models))
            .field("optimizers", &names(&self.optimizers))
            .field("states", &names(&self.states))
            .finish()
    }
}

impl<'a> CheckpointParts<'a> {
    /// Parts holding only `model` (step 0).
    pub fn new(model: &'a dyn Parameters) -> Self {
        CheckpointParts {
            model,
            optimizer: None,
            schedule_step: None,
            loader: None,
            samples: None,
            step: 0,
            extra: BTreeMap::new(),
            models: Vec::new(),
            optimizers: Vec::new(),
            states: Vec::new(),
            save_on_each_node: false,
            hooks: Vec::new(),
        }
    }
    /// Runs `hook` on each writing process once the checkpoint's files are written into its
    /// temporary directory, before the manifest (Accelerate's `register_save_state_pre_hook`):
    /// files the hook adds there (a tokenizer, a config) become part of the checkpoint, written
    /// atomically with it and covered by its checksums. An error from the hook fails the save.
    pub fn on_save(mut self, hook: &'a SaveHook<'a>) -> Self {
        self.hooks.push(hook);
        self
    }
    /// Every machine's local main process (local rank 0) writes its own copy, into the same
    /// path on its own disk: for clusters without a shared file system. Each rank then resumes
    /// from its machine's copy.
    pub fn save_on_each_node(mut self, on: bool) -> Self {
        self.save_on_each_node = on;
        self
    }
    /// Saves another model under `name` (letters, digits, `_` and `-`).
    pub fn model_named(mut self, name: impl Into<String>, model: &'a dyn Parameters) -> Self {
        self.models.push((name.into(), model));
        self
    }
    /// Saves another optimizer's state under `name` (letters, digits, `_` and `-`).
    pub fn optimizer_named(
        mut self,
        name: impl Into<String>,
        optimizer: &'a dyn StatefulOptimizer,
    ) -> Self {
        self.optimizers.push((name.into(), optimizer));
        self
    }
    /// Saves state of your own under `name`, from every rank (each rank gets its own back).
    pub fn state(mut self, name: impl Into<String>, state: &'a dyn Checkpointable) -> Self {
        self.states.push((name.into(), state));
        self
    }
    /// Saves the loader's position in **global samples**
    /// ([`DataLoader::sample_position`](crate::DataLoader::sample_position) or
    /// [`StreamingLoader`](crate::StreamingLoader)'s): unlike [`loader`](Self::loader), it
    /// resumes at any world size, each sample not yet seen exactly once
    /// ([`DataLoader::resume_from`](crate::DataLoader::resume_from)).
    pub fn samples(mut self, position: crate::data::SamplePosition) -> Self {
        self.samples = Some(position);
        self
    }
    /// Saves this optimizer's state too.
    pub fn optimizer(mut self, optimizer: &'a dyn StatefulOptimizer) -> Self {
        self.optimizer = Some(optimizer);
        self
    }
    /// Saves the schedule's step.
    pub fn schedule_step(mut self, step: u64) -> Self {
        self.schedule_step = Some(step);
        self
    }
    /// Saves the loader's position.
    pub fn loader(mut self, position: LoaderPosition) -> Self {
        self.loader = Some(position);
        self
    }
    /// Sets the training loop's step.
    pub fn step(mut self, step: u64) -> Self {
        self.step = step;
        self
    }
    /// Adds a free-form `key = value` to the manifest.
    pub fn extra(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.extra.insert(key.into(), value.into());
        self
    }
}

fn corrupt(path: &Path, reason: impl Into<String>) -> Error {
    Error::CheckpointCorrupt {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

fn write_err(path: &Path, reason: impl Into<String>, source: Option<std::io::Error>) -> Error {
    Error::CheckpointWrite {
        path: path.to_path_buf(),
        reason: reason.into(),
        source,
    }
}

fn io_err(context: impl Into<String>, path: &Path, source: std::io::Error) -> Error {
    Error::Io {
        context: context.into(),
        path: path.to_path_buf(),
        source,
    }
}

/// Before a save replaces or removes `path`, which must then be its own: `Ok` when `path` is
/// absent, or a folder whose entry names `ours` accepts. Anything else (a file, a symbolic link,
/// a folder `ours` refuses) is [`Error::CheckpointWrite`] naming it, saying `not_ours` and up to
/// three of the names it holds, then `advice`; nothing is touched.
fn check_ours(
    path: &Path,
    ours: impl Fn(&[String]) -> bool,
    not_ours: &str,
    advice: &str,
) -> Result<()> {
    let Ok(meta) = fs::symlink_metadata(path) else {
        return Ok(());
    };
    let what = if meta.file_type().is_symlink() {
        "it is a symbolic link (which would be replaced, not written through)".to_string()
    } else if !meta.is_dir() {
        "it exists and is not a folder".to_string()
    } else {
        let mut names = Vec::new();
        for entry in fs::read_dir(path).map_err(|e| io_err("listing", path, e))? {
            let entry = entry.map_err(|e| io_err("listing", path, e))?;
            names.push(entry.file_name().to_string_lossy().into_owned());
        }
        if ours(&names) {
            return Ok(());
        }
        names.sort();
        let shown: Vec<_> = names.iter().take(3).map(|n| format!("`{n}`")).collect();
        let more = match names.len().saturating_sub(3) {
            0 => String::new(),
            n => format!(" and {n} more"),
        };
        format!("{not_ours} and holds {}{more}", shown.join(", "))
    };
    Err(write_err(path, format!("{what}; {advice}"), None))
}

fn checkpoint_err(path: &Path, reason: impl Into<String>) -> Error {
    Error::invalid(format!("checkpoint {}", path.display()), reason)
}

/// `path` with `suffix` appended to its last component.
fn with_suffix(path: &Path, suffix: &str) -> PathBuf {
    let mut s = path.as_os_str().to_os_string();
    s.push(suffix);
    PathBuf::from(s)
}

/// Parameters as a name → tensor map, checking that names are unique.
fn named_tensors(model: &dyn Parameters) -> Result<Vec<(String, Tensor)>> {
    let mut named: Vec<(String, Tensor)> = model
        .named_parameters()
        .into_iter()
        .map(|(n, v)| (n, v.as_tensor().clone()))
        .collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    if let Some(w) = named.windows(2).find(|w| w[0].0 == w[1].0) {
        return Err(Error::invalid(
            "model parameters",
            format!("the name `{}` is used twice", w[0].0),
        ));
    }
    Ok(named)
}

/// The base name of the main optimizer's files.
const OPTIMIZER_BASE: &str = "optimizer";

/// The per-rank states file inside a checkpoint.
pub const STATES_FILE: &str = "states.json";

fn named_model_file(name: &str) -> String {
    format!("model.{name}.safetensors")
}

fn named_optimizer_base(name: &str) -> String {
    format!("{OPTIMIZER_BASE}.{name}")
}

pub use super::weights::{
    check_weights_mapped, load_weights, load_weights_mapped, ParamSpec, WeightFiles, CONFIG_FILE,
    INDEX_FILE, SINGLE_FILE,
};

pub use adapter::{
    load_adapter, read_adapter_config, save_adapter, ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE,
    PEFT_PREFIX,
};

/// See [`Accelerator::load_state`](crate::Accelerator::load_state): reads onto `device`;
/// `world_size` is only compared with the writer's, for the log.
/// What [`Accelerator::load_state_into`](crate::Accelerator::load_state_into) puts back: the
/// counterpart of [`CheckpointParts`], with the same names.
pub struct LoadTargets<'a> {
    /// The model (required).
    pub model: &'a dyn Parameters,
    /// The optimizer whose state to restore.
    pub optimizer: Option<&'a mut dyn StatefulOptimizer>,
    /// Named models ([`CheckpointParts::model_named`]).
    pub models: Vec<(String, &'a dyn Parameters)>,
    /// Named optimizers ([`CheckpointParts::optimizer_named`]).
    pub optimizers: Vec<(String, &'a mut dyn StatefulOptimizer)>,
    /// Named states ([`CheckpointParts::state`]); each rank gets the state it saved.
    pub states: Vec<(String, &'a mut dyn Checkpointable)>,
    /// Load hooks ([`on_load`](Self::on_load)).
    pub hooks: Vec<&'a LoadHook<'a>>,
}

/// The names of named parts (for `Debug`).
fn names<T>(parts: &[(String, T)]) -> Vec<&str> {
    parts.iter().map(|(n, _)| n.as_str()).collect()
}

impl std::fmt::Debug for LoadTargets<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadTargets")
            .field("optimizer", &self.optimizer.is_some())
            .field("models", &names(&self.models))
            .field("optimizers", &names(&self.optimizers))
            .field("states", &names(&self.states))
            .finish()
    }
}

impl<'a> LoadTargets<'a> {
    /// Targets holding only `model`.
    pub fn new(model: &'a dyn Parameters) -> Self {
        LoadTargets {
            model,
            optimizer: None,
            models: Vec::new(),
            optimizers: Vec::new(),
            states: Vec::new(),
            hooks: Vec::new(),
        }
    }
    /// Runs `hook` on every rank with the verified checkpoint directory and its manifest,
    /// before anything is changed (Accelerate's `register_load_state_pre_hook`): read the files
    /// a save hook added. An error from the hook fails the load and changes nothing.
    pub fn on_load(mut self, hook: &'a LoadHook<'a>) -> Self {
        self.hooks.push(hook);
        self
    }
    /// Restores this optimizer's state too.
    pub fn optimizer(mut self, optimizer: &'a mut dyn StatefulOptimizer) -> Self {
        self.optimizer = Some(optimizer);
        self
    }
    /// Restores the model saved under `name`.
    pub fn model_named(mut self, name: impl Into<String>, model: &'a dyn Parameters) -> Self {
        self.models.push((name.into(), model));
        self
    }
    /// Restores the optimizer state saved under `name`.
    pub fn optimizer_named(
        mut self,
        name: impl Into<String>,
        optimizer: &'a mut dyn StatefulOptimizer,
    ) -> Self {
        self.optimizers.push((name.into(), optimizer));
        self
    }
    /// Restores the state saved under `name` (this rank's).
    pub fn state(mut self, name: impl Into<String>, state: &'a mut dyn Checkpointable) -> Self {
        self.states.push((name.into(), state));
        self
    }
}
