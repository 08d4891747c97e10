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
//! is never taken for a checkpoint.
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

use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use serde::{Deserialize, Serialize};

use crate::collective::Collective;
use crate::error::{Error, Result};
use crate::optim::{AdamW, OptimizerState, Sgd, StateShard};
use crate::train::mixed_precision::MixedPrecisionOptimizer;
use crate::train::optimizer::AcceleratedOptimizer;
use crate::train::params::Parameters;

mod adapter;
mod manifest;
mod rotation;

use manifest::checksum_file;
pub use manifest::{
    read_manifest, resolve_checkpoint, verify_checkpoint, FileChecksum, Manifest, OptimizerManifest,
};
pub use rotation::latest_checkpoint;
use rotation::{auto_entries, latest_number, rotate};

/// The model file inside a checkpoint.
pub const MODEL_FILE: &str = "model.safetensors";
/// The optimizer state file inside a checkpoint.
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";
/// The manifest inside a checkpoint; written last, so its presence marks a complete checkpoint.
pub const MANIFEST_FILE: &str = "manifest.json";
/// The prefix of the directories written by [`Accelerator::save_state_auto`](crate::Accelerator::save_state_auto).
pub const AUTO_PREFIX: &str = "checkpoint_";

/// An optimizer whose state can go into a checkpoint: [`AdamW`], [`Sgd`], and an
/// [`AcceleratedOptimizer`] wrapping one of them.
pub trait StatefulOptimizer {
    /// A snapshot of the state (see [`OptimizerState`]).
    fn optimizer_state(&self) -> Result<OptimizerState>;
    /// Puts a state back; errors (changing nothing) when it does not fit the parameters.
    fn load_optimizer_state(&mut self, state: OptimizerState) -> Result<()>;
    /// Whether [`optimizer_state`](Self::optimizer_state) is a collective that every rank must
    /// call (a ZeRO-sharded optimizer gathers its slices); the checkpoint writers then take the
    /// state on every rank. Default false.
    fn state_needs_every_rank(&self) -> bool {
        false
    }
    /// ZeRO: this rank's slices of the state when the optimizer holds only those (then every
    /// rank writes its own file; see the module docs). Default `None`: the whole state comes
    /// from [`optimizer_state`](Self::optimizer_state).
    fn optimizer_state_shard(&self) -> Result<Option<StateShard>> {
        Ok(None)
    }
}

impl StatefulOptimizer for AdamW {
    fn optimizer_state(&self) -> Result<OptimizerState> {
        self.state()
    }
    fn optimizer_state_shard(&self) -> Result<Option<StateShard>> {
        self.state_shard()
    }
    fn load_optimizer_state(&mut self, state: OptimizerState) -> Result<()> {
        self.load_state(state)
    }
}

impl StatefulOptimizer for Sgd {
    fn optimizer_state(&self) -> Result<OptimizerState> {
        self.state()
    }
    fn optimizer_state_shard(&self) -> Result<Option<StateShard>> {
        self.state_shard()
    }
    fn load_optimizer_state(&mut self, state: OptimizerState) -> Result<()> {
        self.load_state(state)
    }
}

/// A ZeRO-sharded optimizer's [`optimizer_state`](StatefulOptimizer::optimizer_state) is
/// gathered from every rank into the unsharded layout (every rank must take it:
/// [`state_needs_every_rank`](StatefulOptimizer::state_needs_every_rank)); its
/// [`optimizer_state_shard`](StatefulOptimizer::optimizer_state_shard) is this rank's slices,
/// which checkpoints write one file per rank.
impl<O: candle_nn::Optimizer + StatefulOptimizer> StatefulOptimizer for AcceleratedOptimizer<O> {
    fn optimizer_state(&self) -> Result<OptimizerState> {
        let mut state = self.inner().optimizer_state()?;
        if self.is_sharded() {
            // Each element is one rank's; the others hold zeros there.
            let c = self.engine().collective();
            for (_, t) in state.tensors.iter_mut() {
                *t = c.all_reduce_tensor(t, crate::collective::ReduceOp::Sum)?;
            }
        }
        Ok(state)
    }
    fn state_needs_every_rank(&self) -> bool {
        self.is_sharded()
    }
    fn optimizer_state_shard(&self) -> Result<Option<StateShard>> {
        if self.is_sharded() {
            self.inner().optimizer_state_shard()
        } else {
            Ok(None)
        }
    }
    fn load_optimizer_state(&mut self, state: OptimizerState) -> Result<()> {
        self.inner_mut().load_optimizer_state(state)
    }
}

/// The state of the optimizer stepping the f32 masters; load the masters themselves with
/// [`Accelerator::load_state`](crate::Accelerator::load_state) and then call
/// [`sync_working_copies`](MixedPrecisionOptimizer::sync_working_copies).
///
/// With f16 the loss scaler's scale and clean-step count are saved too (as the scalar tensors
/// `loss_scaler.scale` and `loss_scaler.clean_steps`), so a resumed run scales as the
/// uninterrupted one.
impl<O: candle_nn::Optimizer + StatefulOptimizer> StatefulOptimizer for MixedPrecisionOptimizer<O> {
    fn state_needs_every_rank(&self) -> bool {
        self.accelerated().state_needs_every_rank()
    }
    /// The wrapped optimizer's slices; the loss scaler's scalars go with rank 0's.
    fn optimizer_state_shard(&self) -> Result<Option<StateShard>> {
        let Some(mut shard) = self.accelerated().optimizer_state_shard()? else {
            return Ok(None);
        };
        if let Some(s) = self.loss_scaler() {
            let dev = Device::Cpu;
            let rank = self.accelerated().engine().collective().rank();
            for (name, value) in [
                (SCALER_SCALE, s.scale()),
                (SCALER_CLEAN, s.clean_steps() as f64),
            ] {
                shard.layout.push((name.into(), Vec::new()));
                if rank == 0 {
                    shard
                        .pieces
                        .push((name.into(), 0, Tensor::new(&[value], &dev)?));
                }
            }
        }
        Ok(Some(shard))
    }
    fn optimizer_state(&self) -> Result<OptimizerState> {
        let mut state = self.accelerated().optimizer_state()?;
        if let Some(s) = self.loss_scaler() {
            let dev = Device::Cpu;
            state
                .tensors
                .push((SCALER_SCALE.into(), Tensor::new(s.scale(), &dev)?));
            state.tensors.push((
                SCALER_CLEAN.into(),
                Tensor::new(s.clean_steps() as f64, &dev)?,
            ));
        }
        Ok(state)
    }
    fn load_optimizer_state(&mut self, mut state: OptimizerState) -> Result<()> {
        let mut take = |name: &str| -> Result<Option<f64>> {
            match state.tensors.iter().position(|(n, _)| n == name) {
                Some(i) => {
                    let (_, t) = state.tensors.remove(i);
                    Ok(Some(
                        t.to_dtype(candle_core::DType::F64)?.to_scalar::<f64>()?,
                    ))
                }
                None => Ok(None),
            }
        };
        let scale = take(SCALER_SCALE)?;
        let clean = take(SCALER_CLEAN)?;
        self.accelerated_mut().load_optimizer_state(state)?;
        if let (Some(scaler), Some(scale)) = (self.loss_scaler_mut(), scale) {
            if !(scale.is_finite() && scale > 0.0) {
                return Err(Error::invalid(
                    "loss scaler state",
                    format!("the saved scale {scale} is not a positive number"),
                ));
            }
            scaler.restore(scale, clean.unwrap_or(0.0).max(0.0) as u64);
        }
        Ok(())
    }
}

const SCALER_SCALE: &str = "loss_scaler.scale";
const SCALER_CLEAN: &str = "loss_scaler.clean_steps";

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

impl<S: crate::scheduler::LrScheduler> Checkpointable for crate::scheduler::Schedule<S> {
    fn checkpoint_state(&self) -> Result<serde_json::Value> {
        Ok(serde_json::json!({ "step": self.current_step() }))
    }
    fn restore_state(&mut self, state: &serde_json::Value) -> Result<()> {
        let step = state["step"].as_u64().ok_or_else(|| {
            Error::invalid("schedule state", "`step` is not a non-negative integer")
        })?;
        self.set_step(step);
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
            .field(
                "models",
                &self.models.iter().map(|(n, _)| n).collect::<Vec<_>>(),
            )
            .field(
                "optimizers",
                &self.optimizers.iter().map(|(n, _)| n).collect::<Vec<_>>(),
            )
            .field(
                "states",
                &self.states.iter().map(|(n, _)| n).collect::<Vec<_>>(),
            )
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

fn write_safetensors(path: &Path, tensors: &[(String, Tensor)]) -> Result<()> {
    let map: HashMap<String, Tensor> = tensors.iter().cloned().collect();
    // Create it first, so that a refusal (missing folder, no space, no permission) comes with
    // its OS error.
    fs::File::create(path).map_err(|e| write_err(path, "could not create the file", Some(e)))?;
    candle_core::safetensors::save(&map, path).map_err(|e| match e {
        candle_core::Error::Io(io) => write_err(path, "the file system refused it", Some(io)),
        e => write_err(path, e.to_string(), None),
    })?;
    sync_file(path)
}

fn sync_file(path: &Path) -> Result<()> {
    fs::File::open(path)
        .and_then(|f| f.sync_all())
        .map_err(|e| io_err("syncing", path, e))
}

fn sync_dir(path: &Path) {
    // Best effort: not every platform can fsync a directory.
    if let Ok(f) = fs::File::open(path) {
        let _ = f.sync_all();
    }
}

/// Test-only hook ([`env::TEST_CRASH_AFTER`](crate::env::TEST_CRASH_AFTER)`=<file>`): the main process exits (code 3)
/// right after writing that file of a checkpoint, as a kill would.
fn crash_hook(file: &str) {
    let var = crate::settings::env::TEST_CRASH_AFTER;
    if matches!(crate::settings::parse::process_env::<String>(var), Ok(Some(v)) if v == file) {
        log::error!("{var}={file}: exiting mid-save");
        std::process::exit(3);
    }
}

/// Writes a checkpoint into `tmp` (which must not exist).
fn write_checkpoint(
    tmp: &Path,
    parts: &CheckpointParts<'_>,
    world_size: usize,
    taken: &Taken,
    stage: Option<&Path>,
) -> Result<()> {
    let states = taken.states.as_deref();
    check_part_names(parts)?;
    fs::create_dir_all(tmp).map_err(|e| io_err("creating", tmp, e))?;
    let mut models = BTreeMap::new();
    for (name, m) in &parts.models {
        let tensors = named_tensors(*m)?;
        write_safetensors(&tmp.join(named_model_file(name)), &tensors)?;
        models.insert(name.clone(), tensors.into_iter().map(|(n, _)| n).collect());
    }
    let mut optimizers = BTreeMap::new();
    for (i, (name, o)) in parts.optimizers.iter().enumerate() {
        let took = taken.named.get(i).cloned().flatten();
        let base = named_optimizer_base(name);
        let m = write_optimizer(tmp, &base, took, *o, stage, world_size)?;
        optimizers.insert(name.clone(), m);
    }
    for hook in &parts.hooks {
        hook(tmp)?;
    }
    if let Some(text) = states {
        let path = tmp.join(STATES_FILE);
        fs::write(&path, text).map_err(|e| write_err(&path, "could not write it", Some(e)))?;
        sync_file(&path)?;
    }
    let model = named_tensors(parts.model)?;
    write_safetensors(&tmp.join(MODEL_FILE), &model)?;
    crash_hook(MODEL_FILE);
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
    // Checksums of every file as it is on disk.
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
    let path = tmp.join(MANIFEST_FILE);
    let manifest = Manifest {
        version: env!("CARGO_PKG_VERSION").to_string(),
        world_size,
        step: parts.step,
        optimizer,
        schedule_step: parts.schedule_step,
        loader: parts.loader,
        samples: parts.samples,
        parameters: model.iter().map(|(n, _)| n.clone()).collect(),
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

/// Puts an optimizer's state into `tmp`: `<base>.safetensors`, or for a sharded one
/// ([`Took::Shard`]) the `world_size` per-rank files moved in from `stage`; returns its manifest
/// entry.
fn write_optimizer(
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
fn shard_file(base: &str, rank: usize, world_size: usize) -> String {
    format!("{base}.rank-{rank:05}-of-{world_size:05}.safetensors")
}

/// How an optimizer's state is stored, for messages: its file, or its per-rank files.
fn optimizer_files(dir: &Path, base: &str, m: &OptimizerManifest) -> PathBuf {
    match m.shards {
        Some(n) => dir.join(format!("{base}.rank-*-of-{n:05}.safetensors")),
        None => dir.join(format!("{base}.safetensors")),
    }
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

/// Names of named parts: non-empty, `[A-Za-z0-9_-]`, unique per kind.
fn check_part_names(parts: &CheckpointParts<'_>) -> Result<()> {
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

/// What every rank takes before the writers write: the per-rank states (gathered) and the state
/// of optimizers whose state is a collective ([`StatefulOptimizer::state_needs_every_rank`]).
#[derive(Default)]
struct Taken {
    states: Option<String>,
    main: Option<Took>,
    named: Vec<Option<Took>>,
}

/// An optimizer state taken on every rank: whole (gathered), or this rank's slices.
#[derive(Clone)]
enum Took {
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
fn take_on_every_rank(c: &dyn Collective, parts: &CheckpointParts<'_>) -> Result<Taken> {
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
fn gather_states(c: &dyn Collective, parts: &CheckpointParts<'_>) -> Result<Option<String>> {
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
fn stage_shards(
    c: &dyn Collective,
    dir: &Path,
    folder: &Path,
    parts: &CheckpointParts<'_>,
    taken: Result<Taken>,
) -> Result<(Taken, Option<PathBuf>)> {
    let sharded = taken
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
                fs::remove_dir_all(&stage).map_err(|e| io_err("removing stale", &stage, e))?;
            }
            fs::create_dir_all(&stage).map_err(|e| io_err("creating", &stage, e))
        })
    } else {
        Ok(())
    };
    agree(
        c,
        "save_state (making the folder of the optimizer shards)",
        &stage,
        made,
    )?;
    let (rank, world) = (c.rank(), c.world_size());
    let wrote = taken.and_then(|t| {
        for (base, shard) in t.shards(parts) {
            let pieces: Vec<(String, Tensor)> = shard
                .pieces
                .iter()
                .map(|(name, start, piece)| (format!("{name}@{start}"), piece.clone()))
                .collect();
            write_safetensors(&stage.join(shard_file(&base, rank, world)), &pieces)?;
        }
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
                "rank {} could not write its optimizer shard (see its error)",
                failed[0] as usize - 1
            ),
            None,
        ));
    }
    Ok((t, Some(stage)))
}

fn save_atomic(
    dir: &Path,
    parts: &CheckpointParts<'_>,
    world_size: usize,
    taken: &Taken,
    stage: Option<&Path>,
) -> Result<()> {
    let tmp = with_suffix(dir, &format!(".tmp-{}", std::process::id()));
    if tmp.exists() {
        fs::remove_dir_all(&tmp).map_err(|e| io_err("removing stale", &tmp, e))?;
    }
    if let Err(e) = write_checkpoint(&tmp, parts, world_size, taken, stage) {
        let _ = fs::remove_dir_all(&tmp);
        return Err(e);
    }
    let old = with_suffix(dir, ".old");
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

/// Loads a safetensors file of a checkpoint onto `device`.
fn read_safetensors(path: &Path, device: &Device) -> Result<HashMap<String, Tensor>> {
    if !path.is_file() {
        return Err(checkpoint_err(path, "the file is missing"));
    }
    candle_core::safetensors::load(path, device)
        .map_err(|e| checkpoint_err(path, format!("could not read: {e}")))
}

/// Whether a float tensor holds a NaN or an infinity.
fn non_finite(t: &Tensor) -> Result<bool> {
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
fn fit_model(
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

/// The lock file of a checkpoint folder.
pub const LOCK_FILE: &str = ".accelerate-rs.lock";

/// Checkpoint folders this process has locked, with their open lock files: a lock lasts as long
/// as its file is open, i.e. until this process ends (so a crashed run never blocks the next).
static LOCKS: std::sync::Mutex<Vec<(PathBuf, fs::File)>> = std::sync::Mutex::new(Vec::new());

/// This machine's host name, for lock files.
fn host_name() -> String {
    fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .ok()
        .filter(|s| !s.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "an unknown host".into())
}

/// Takes (once per process) the exclusive lock of checkpoint folder `folder`: two runs saving
/// into one folder would overwrite and rotate away each other's checkpoints. Fails with
/// [`Error::CheckpointLocked`], naming the holder, when another live process holds it.
fn lock_folder(folder: &Path) -> Result<()> {
    use std::os::fd::AsRawFd;
    fs::create_dir_all(folder).map_err(|e| io_err("creating", folder, e))?;
    let key = folder
        .canonicalize()
        .unwrap_or_else(|_| folder.to_path_buf());
    let mut locks = LOCKS.lock().unwrap_or_else(|p| p.into_inner());
    if locks.iter().any(|(p, _)| *p == key) {
        return Ok(());
    }
    let path = folder.join(LOCK_FILE);
    let mut f = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(|e| io_err("opening the lock file", &path, e))?;
    // SAFETY: `flock` on the descriptor of `f`, which stays open for the whole call; it only
    // changes the lock state of the open file, no memory is involved.
    let rc = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if rc != 0 {
        let err = std::io::Error::last_os_error();
        if err.raw_os_error() == Some(libc::EWOULDBLOCK) {
            let holder = fs::read_to_string(&path)
                .ok()
                .map(|s| s.trim().to_string())
                .filter(|s| !s.is_empty())
                .unwrap_or_else(|| "a process that wrote no details".into());
            return Err(Error::CheckpointLocked {
                path: folder.to_path_buf(),
                holder,
            });
        }
        return Err(io_err("locking", &path, err));
    }
    let since = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let who = format!(
        "pid {} on {}, since {since} (Unix time)",
        std::process::id(),
        host_name()
    );
    f.set_len(0)
        .and_then(|()| f.write_all(who.as_bytes()))
        .and_then(|()| f.sync_all())
        .map_err(|e| io_err("writing the lock file", &path, e))?;
    locks.push((key, f));
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

/// Removes the staging folder of optimizer shards (what is left after a failed save).
fn remove_stage(stage: Option<&Path>) {
    if let Some(s) = stage {
        if s.exists() {
            if let Err(e) = fs::remove_dir_all(s) {
                log::warn!("could not remove {}: {e}", s.display());
            }
        }
    }
}

/// Whether this rank writes the checkpoint: rank 0, or every machine's local rank 0 with
/// [`CheckpointParts::save_on_each_node`].
fn writes(c: &dyn Collective, local_rank: usize, parts: &CheckpointParts<'_>) -> bool {
    if parts.save_on_each_node {
        local_rank == 0
    } else {
        c.rank() == 0
    }
}

/// Makes every rank fail when any writer failed (several writers with `save_on_each_node`).
fn agree_all(c: &dyn Collective, op: &str, path: &Path, result: Result<()>) -> Result<()> {
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

pub use super::weights::{
    load_weights, load_weights_mapped, WeightFiles, CONFIG_FILE, INDEX_FILE, SINGLE_FILE,
};

pub use adapter::{
    load_adapter, read_adapter_config, save_adapter, ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE,
    PEFT_PREFIX,
};

/// A model file's write error as [`Error::ModelFile`] (the checkpoint writers' errors say
/// "checkpoint").
fn model_write_err(e: Error) -> Error {
    match e {
        Error::CheckpointWrite {
            path,
            reason,
            source,
        } => Error::ModelFile {
            path,
            tensor: None,
            reason: format!("could not write it: {reason}"),
            source,
        },
        e => e,
    }
}

/// See [`Accelerator::save_model`](crate::Accelerator::save_model).
pub(crate) fn save_model(c: &dyn Collective, path: &Path, model: &dyn Parameters) -> Result<()> {
    let result = if c.rank() == 0 {
        let tmp = with_suffix(path, &format!(".tmp-{}", std::process::id()));
        let folder = path.parent().filter(|p| !p.as_os_str().is_empty());
        folder
            .map_or(Ok(()), |f| {
                fs::create_dir_all(f)
                    .map_err(|e| write_err(f, "could not create the folder", Some(e)))
            })
            .and_then(|()| named_tensors(model))
            .and_then(|t| write_safetensors(&tmp, &t))
            .and_then(|()| {
                fs::rename(&tmp, path).map_err(|e| io_err("renaming the model into", path, e))
            })
    } else {
        Ok(())
    };
    agree(c, "save_model", path, result).map_err(model_write_err)
}

/// The index Hugging Face tooling reads next to sharded safetensors files.
pub const SHARD_INDEX_FILE: &str = "model.safetensors.index.json";

/// Groups `tensors` (in name order) into shards of at most `max_bytes` each (a tensor larger
/// than that gets a shard of its own).
fn plan_shards(tensors: &[(String, Tensor)], max_bytes: usize) -> Vec<Vec<(String, Tensor)>> {
    let mut shards: Vec<Vec<(String, Tensor)>> = Vec::new();
    let mut size = 0usize;
    for (name, t) in tensors {
        let bytes = t.elem_count() * t.dtype().size_in_bytes();
        if shards.is_empty() || (size + bytes > max_bytes && size > 0) {
            shards.push(Vec::new());
            size = 0;
        }
        if let Some(last) = shards.last_mut() {
            last.push((name.clone(), t.clone()));
        }
        size += bytes;
    }
    shards
}

/// Writes the model into `dir` as Hugging Face does: `model.safetensors` when it fits in one
/// shard of `max_shard_bytes`, else `model-0000i-of-0000n.safetensors` files and
/// `model.safetensors.index.json` (`metadata.total_size`, `weight_map`). Main process only;
/// written into `<dir>.tmp-<pid>` and renamed into place.
fn write_sharded(
    dir: &Path,
    model: &dyn Parameters,
    max_shard_bytes: usize,
    config: Option<&serde_json::Value>,
) -> Result<()> {
    if max_shard_bytes == 0 {
        return Err(Error::invalid("max_shard_size", "must be at least 1 byte"));
    }
    let tensors = named_tensors(model)?;
    let shards = plan_shards(&tensors, max_shard_bytes);
    let tmp = with_suffix(dir, &format!(".tmp-{}", std::process::id()));
    if tmp.exists() {
        fs::remove_dir_all(&tmp).map_err(|e| io_err("removing stale", &tmp, e))?;
    }
    fs::create_dir_all(&tmp).map_err(|e| write_err(&tmp, "could not create it", Some(e)))?;
    let n = shards.len();
    if n <= 1 {
        write_safetensors(&tmp.join(MODEL_FILE), &tensors)?;
    } else {
        let mut weight_map = BTreeMap::new();
        for (i, shard) in shards.iter().enumerate() {
            let name = format!("model-{:05}-of-{n:05}.safetensors", i + 1);
            write_safetensors(&tmp.join(&name), shard)?;
            for (t, _) in shard {
                weight_map.insert(t.clone(), name.clone());
            }
        }
        let total: usize = tensors
            .iter()
            .map(|(_, t)| t.elem_count() * t.dtype().size_in_bytes())
            .sum();
        let index = serde_json::json!({
            "metadata": { "total_size": total },
            "weight_map": weight_map,
        });
        let path = tmp.join(SHARD_INDEX_FILE);
        let text = serde_json::to_string_pretty(&index)
            .map_err(|e| write_err(&path, format!("could not serialize the index: {e}"), None))?;
        fs::write(&path, text).map_err(|e| write_err(&path, "could not write it", Some(e)))?;
        sync_file(&path)?;
    }
    if let Some(config) = config {
        let path = tmp.join(CONFIG_FILE);
        let text = serde_json::to_string_pretty(config)
            .map_err(|e| write_err(&path, format!("could not serialize the config: {e}"), None))?;
        fs::write(&path, text).map_err(|e| write_err(&path, "could not write it", Some(e)))?;
        sync_file(&path)?;
    }
    replace_dir(&tmp, dir)
}

/// Puts the finished folder `tmp` in place of `dir` (a previous `dir` is moved aside to
/// `<dir>.old` first and removed after).
fn replace_dir(tmp: &Path, dir: &Path) -> Result<()> {
    sync_dir(tmp);
    let old = with_suffix(dir, ".old");
    if dir.exists() {
        if old.exists() {
            fs::remove_dir_all(&old).map_err(|e| io_err("removing stale", &old, e))?;
        }
        fs::rename(dir, &old).map_err(|e| io_err("renaming the previous model", dir, e))?;
    }
    fs::rename(tmp, dir).map_err(|e| io_err("renaming the new model into", dir, e))?;
    if old.exists() {
        fs::remove_dir_all(&old).map_err(|e| io_err("removing the previous model", &old, e))?;
    }
    Ok(())
}

/// See [`Accelerator::save_model_sharded`](crate::Accelerator::save_model_sharded).
pub(crate) fn save_model_sharded(
    c: &dyn Collective,
    dir: &Path,
    model: &dyn Parameters,
    max_shard_bytes: usize,
    config: Option<&serde_json::Value>,
) -> Result<()> {
    let result = if c.rank() == 0 {
        write_sharded(dir, model, max_shard_bytes, config)
    } else {
        Ok(())
    };
    agree(c, "save_model_sharded", dir, result).map_err(model_write_err)
}

/// What the main process does in
/// [`save_model_sharded`](crate::Accelerator::save_model_sharded), with no communication (call
/// it on one process only): writes `model`'s parameters into the folder `dir` as Hugging Face
/// does (`model.safetensors`, or shards of at most `max_shard_bytes` and their index), and
/// `config` as `config.json` if given, into `<dir>.tmp-<pid>` renamed into place (replacing a
/// previous `dir`). The folders above `dir` are created.
pub fn write_model_folder(
    dir: impl AsRef<Path>,
    model: &dyn Parameters,
    max_shard_bytes: usize,
    config: Option<&serde_json::Value>,
) -> Result<()> {
    write_sharded(dir.as_ref(), model, max_shard_bytes, config).map_err(model_write_err)
}

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

impl std::fmt::Debug for LoadTargets<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadTargets")
            .field("optimizer", &self.optimizer.is_some())
            .field(
                "models",
                &self.models.iter().map(|(n, _)| n).collect::<Vec<_>>(),
            )
            .field(
                "optimizers",
                &self.optimizers.iter().map(|(n, _)| n).collect::<Vec<_>>(),
            )
            .field(
                "states",
                &self.states.iter().map(|(n, _)| n).collect::<Vec<_>>(),
            )
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

/// The optimizer state stored in `dir` under `base` (tensor order from the manifest): one file,
/// or reassembled from the per-rank files of a sharded optimizer.
fn read_optimizer(
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
fn read_optimizer_shards(
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
    let mut pieces: HashMap<String, Vec<(usize, Tensor, PathBuf)>> = HashMap::new();
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
    let mut tensors = Vec::with_capacity(m.tensors.len());
    for (name, shape) in m.tensors.iter().zip(&m.shapes) {
        let total: usize = shape.iter().product();
        let mut list = pieces.remove(name).unwrap_or_default();
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
                format!("optimizer tensor `{name}` has {at} of its {total} elements in the ranks' files"),
            ));
        }
        let whole = if flat.is_empty() {
            // A parameter without elements.
            Tensor::zeros(shape.as_slice(), candle_core::DType::F32, device)
        } else {
            Tensor::cat(&flat, 0).and_then(|t| t.reshape(shape.as_slice()))
        }
        .map_err(|e| {
            corrupt(
                &optimizer_files(dir, base, m),
                format!("optimizer tensor `{name}`: {e}"),
            )
        })?;
        tensors.push((name.clone(), whole));
    }
    Ok(OptimizerState {
        step: m.step,
        lr: m.lr,
        tensors,
    })
}

/// See [`Accelerator::load_state_into`](crate::Accelerator::load_state_into): reads onto
/// `device`; `rank` picks this rank's states; `world_size` is compared with the writer's.
pub(crate) fn load_state(
    device: &Device,
    rank: usize,
    world_size: usize,
    dir: &Path,
    targets: LoadTargets<'_>,
) -> Result<Manifest> {
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
    let model_path = found.join(MODEL_FILE);
    let mut sets = fit_model(&model_path, read_safetensors(&model_path, device)?, model)?;
    for (name, m) in &models {
        if !manifest.models.contains_key(name) {
            return Err(checkpoint_err(
                &found,
                format!(
                    "model `{name}` is not in the checkpoint (it has: {:?})",
                    manifest.models.keys().collect::<Vec<_>>()
                ),
            ));
        }
        let path = found.join(named_model_file(name));
        sets.extend(fit_model(&path, read_safetensors(&path, device)?, *m)?);
    }
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
    let mut named_states = Vec::with_capacity(optimizers.len());
    for (name, opt) in optimizers {
        let m = manifest.optimizers.get(&name).ok_or_else(|| {
            checkpoint_err(
                &found,
                format!(
                    "optimizer `{name}` is not in the checkpoint (it has: {:?})",
                    manifest.optimizers.keys().collect::<Vec<_>>()
                ),
            )
        })?;
        let base = named_optimizer_base(&name);
        let state = read_optimizer(&found, &base, m, device)?;
        named_states.push((optimizer_files(&found, &base, m), opt, state));
    }
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
    for (name, _) in &states {
        if mine.get(name).is_none() {
            return Err(checkpoint_err(
                &found,
                format!(
                    "state `{name}` is not in the checkpoint (it has: {:?})",
                    manifest.states
                ),
            ));
        }
    }
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
    Ok(manifest)
}

/// Makes every rank return the main process's result of a write.
fn agree(c: &dyn Collective, op: &str, path: &Path, result: Result<()>) -> Result<()> {
    let mut ok = [if result.is_ok() { 1f32 } else { 0f32 }];
    c.broadcast((&mut ok[..]).into(), 0)?;
    result?;
    if ok[0] != 1.0 {
        return Err(write_err(
            path,
            format!("{op} failed on the main process, rank 0 (see its error)"),
            None,
        ));
    }
    Ok(())
}
