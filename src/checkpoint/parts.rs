//! What a save writes and a load puts back: [`CheckpointParts`], [`LoadTargets`], the hooks, and
//! [`Checkpointable`] (state of your own) with its implementations for a random generator and a
//! learning-rate schedule.

use std::collections::BTreeMap;
use std::path::Path;

use super::manifest::{LoaderPosition, Manifest};
use crate::error::{Error, Result};
use crate::optim::StatefulOptimizer;
use crate::train::params::Parameters;
use crate::train::scheduler::{LrScheduler, Schedule};

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

impl<S: LrScheduler> Checkpointable for Schedule<S> {
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
