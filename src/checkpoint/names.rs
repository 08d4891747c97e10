//! The names of the files inside a checkpoint folder.

/// The model file inside a checkpoint.
pub const MODEL_FILE: &str = "model.safetensors";

/// The optimizer state file inside a checkpoint.
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";

/// The manifest inside a checkpoint; written last, so its presence marks a complete checkpoint.
pub const MANIFEST_FILE: &str = "manifest.json";

/// The prefix of the directories written by [`Accelerator::save_state_auto`](crate::Accelerator::save_state_auto).
pub const AUTO_PREFIX: &str = "checkpoint_";

/// The base name of the main optimizer's files.
pub(super) const OPTIMIZER_BASE: &str = "optimizer";

/// The per-rank states file inside a checkpoint.
pub const STATES_FILE: &str = "states.json";

/// The file of the model saved under `name`.
pub(super) fn named_model_file(name: &str) -> String {
    format!("model.{name}.safetensors")
}

/// The base name of the files of the optimizer saved under `name`.
pub(super) fn named_optimizer_base(name: &str) -> String {
    format!("{OPTIMIZER_BASE}.{name}")
}
