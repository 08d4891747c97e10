//! Checkpoints: save the training state and resume it bit-identically, as methods on
//! [`Accelerator`](crate::Accelerator) (Hugging Face Accelerate's `save_state` / `load_state` / `save_model`).
//!
//! A checkpoint is a directory holding
//!
//! | file | contents |
//! |---|---|
//! | `model.safetensors` | the model's parameters, under their names ([`Parameters`](crate::Parameters)) |
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

mod io;
mod load;
mod manifest;
mod model_shards;
mod names;
mod optimizer;
mod parts;
mod rotation;
mod save;

pub use io::LOCK_FILE;
pub(crate) use load::load_state;
pub use manifest::{
    read_manifest, resolve_checkpoint, verify_checkpoint, FileChecksum, LoaderPosition, Manifest,
    OptimizerManifest,
};
pub use names::{AUTO_PREFIX, MANIFEST_FILE, MODEL_FILE, OPTIMIZER_FILE, STATES_FILE};
pub use parts::{CheckpointParts, Checkpointable, LoadHook, LoadTargets, SaveHook};
pub use rotation::latest_checkpoint;
pub(crate) use save::{save_state, save_state_auto};

// Hugging Face model folders, weights and adapters moved to `accelerate_rs::weights` (issue 37):
// their old paths here keep working.
#[deprecated(since = "0.2.0", note = "moved to `accelerate_rs::weights`")]
pub use crate::weights::{
    check_output_dir, check_weights_mapped, load_adapter, load_weights, load_weights_mapped,
    read_adapter_config, save_adapter, write_model_folder, ParamSpec, WeightFiles,
    ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE, CONFIG_FILE, INDEX_FILE, PEFT_PREFIX,
    SHARD_INDEX_FILE, SINGLE_FILE,
};
