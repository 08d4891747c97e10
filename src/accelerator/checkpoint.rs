//! Checkpoints on [`Accelerator`]: the format and the atomic writes are the training floor's
//! (`train/checkpoint.rs`); these methods run them on this accelerator's collective.

use std::path::{Path, PathBuf};

use super::Accelerator;
use crate::checkpoint::{self, CheckpointParts, LoadTargets, Manifest};
use crate::error::Result;
use crate::optim::StatefulOptimizer;
use crate::train::params::Parameters;
use crate::weights;

impl Accelerator {
    /// Saves a checkpoint of `parts` into `dir` (replacing a previous one there, atomically; see
    /// the [module docs](crate::checkpoint)). An existing `dir` must be empty or a checkpoint: a
    /// folder of other things is refused, never deleted. Every rank must call it; the main
    /// process writes, the others wait and return its error, if any.
    pub fn save_state(&self, dir: impl AsRef<Path>, parts: &CheckpointParts<'_>) -> Result<()> {
        checkpoint::save_state(
            self.collective().as_ref(),
            self.local_rank(),
            dir.as_ref(),
            parts,
        )
    }

    /// Saves a checkpoint as `root/checkpoint_<N>`, `N` one more than the largest found under
    /// `root` (0 for the first), and then removes the oldest `checkpoint_*` directories so that
    /// at most `total_limit` remain (0 keeps all), together with leftovers of crashed saves
    /// (`checkpoint_*.tmp-*`, `checkpoint_*.old` next to a complete checkpoint). Returns the new
    /// directory. Every rank must call it (see [`save_state`](Self::save_state)).
    pub fn save_state_auto(
        &self,
        root: impl AsRef<Path>,
        parts: &CheckpointParts<'_>,
        total_limit: usize,
    ) -> Result<PathBuf> {
        checkpoint::save_state_auto(
            self.collective().as_ref(),
            self.local_rank(),
            root.as_ref(),
            parts,
            total_limit,
        )
    }

    /// Saves the model's parameters only, as one safetensors file under their names (what
    /// inference needs), creating the folders above it. Every rank must call it; the main
    /// process writes (atomically, through `<path>.tmp-<pid>`). Read it back with
    /// [`load_model`](Self::load_model).
    pub fn save_model(&self, path: impl AsRef<Path>, model: &dyn Parameters) -> Result<()> {
        weights::save_model(self.collective().as_ref(), path.as_ref(), model)
    }

    /// Saves the model's parameters for Hugging Face tooling into the directory `dir`, in
    /// shards of at most `max_shard_bytes` each (`5 << 30` is Hugging Face's default of 5 GB):
    /// `model.safetensors` when everything fits in one, else
    /// `model-00001-of-0000N.safetensors`, ... and `model.safetensors.index.json` (its
    /// `weight_map` names each parameter's file). Load the files back with
    /// [`load_model`](Self::load_model). Every rank must call it; the main process writes (into
    /// `<dir>.tmp-<pid>`, then moved into `dir`, whose other files stay, as with
    /// `save_pretrained`; the folders above `dir` are created).
    pub fn save_model_sharded(
        &self,
        dir: impl AsRef<Path>,
        model: &dyn Parameters,
        max_shard_bytes: usize,
    ) -> Result<()> {
        weights::save_model_sharded(
            self.collective().as_ref(),
            dir.as_ref(),
            model,
            max_shard_bytes,
            None,
        )
    }

    /// [`save_model_sharded`](Self::save_model_sharded) with the model's Hugging Face
    /// configuration written beside the weights as `config.json`, in the same atomic rename:
    /// a folder `transformers`' `from_pretrained` loads. Every rank must call it.
    pub fn save_model_with_config(
        &self,
        dir: impl AsRef<Path>,
        model: &dyn Parameters,
        config: &serde_json::Value,
        max_shard_bytes: usize,
    ) -> Result<()> {
        weights::save_model_sharded(
            self.collective().as_ref(),
            dir.as_ref(),
            model,
            max_shard_bytes,
            Some(config),
        )
    }

    /// Loads model weights into `model`'s parameters: a folder holding `model.safetensors` or a
    /// sharded `model.safetensors.index.json` (what [`save_model_sharded`](Self::save_model_sharded)
    /// and Hugging Face's `save_pretrained` write), a single `.safetensors` file (what
    /// [`save_model`](Self::save_model) writes) or an index file. All or nothing, with dtype
    /// conversion; see [`checkpoint::load_weights`](crate::checkpoint::load_weights). Every rank
    /// reads the files itself; nothing communicates.
    pub fn load_model(&self, path: impl AsRef<Path>, model: &dyn Parameters) -> Result<()> {
        weights::load_weights(path, model)
    }

    /// Loads the checkpoint in `dir` (or its `.old` copy, after a crash mid-save) into `model`
    /// and, if given, `optimizer`, and returns its [`Manifest`] for the rest (loader position,
    /// schedule step, `extra`). Every rank reads the files itself; nothing communicates, except
    /// for a ZeRO-3 [`ShardedModel`](crate::ShardedModel): each rank then reads only the
    /// elements it keeps (from the per-rank files of a checkpoint of any world size and stage,
    /// or from a whole `model.safetensors`), and one all-reduce makes every rank fail when one
    /// cannot (every rank must call it). Checks everything before changing anything: errors
    /// name the file and the parameter or tensor that is missing, unexpected or of the wrong
    /// shape.
    pub fn load_state<'a>(
        &self,
        dir: impl AsRef<Path>,
        model: &'a dyn Parameters,
        optimizer: Option<&'a mut dyn StatefulOptimizer>,
    ) -> Result<Manifest> {
        let mut targets = LoadTargets::new(model);
        targets.optimizer = optimizer;
        self.load_state_into(dir, targets)
    }

    /// [`load_state`](Self::load_state) for everything [`CheckpointParts`] can hold: the model
    /// and optimizer, named models and optimizers, and this rank's named states (a registered
    /// [`Checkpointable`](crate::checkpoint::Checkpointable), such as the generator
    /// [`set_seed`](Self::set_seed) returns). Reads and checks every file before changing
    /// anything; an error names the file and the part.
    pub fn load_state_into(
        &self,
        dir: impl AsRef<Path>,
        targets: LoadTargets<'_>,
    ) -> Result<Manifest> {
        checkpoint::load_state(
            self.device(),
            self.rank(),
            self.world_size(),
            dir.as_ref(),
            targets,
        )
    }
}
