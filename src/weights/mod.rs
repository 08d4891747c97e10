//! Hugging Face model weights: loading safetensors files (one `model.safetensors`, or a sharded
//! folder with its `model.safetensors.index.json`) into a model's parameters, writing model
//! folders (`save_model`, `save_model_sharded`, [`write_model_folder`]; a ZeRO-3 model streamed
//! through rank 0), PEFT adapter folders ([`save_adapter`], [`load_adapter`]), and checking an
//! output folder before a run ([`check_output_dir`]).
//!
//! These are the files a model is shared as, without the training state: the training state
//! (optimizer, loader position, step) is a checkpoint ([`crate::checkpoint`]).
//!
//! ```no_run
//! # use accelerate_rs::Parameters;
//! # fn main() -> accelerate_rs::Result<()> {
//! # let varmap = candle_nn::VarMap::new();
//! accelerate_rs::weights::load_weights("Llama-3.2-1B", &varmap)?;
//! accelerate_rs::weights::write_model_folder("out", &varmap, 1 << 30, None)?;
//! # Ok(()) }
//! ```

mod adapter;
mod folder;
mod model_file;
mod place;
mod stream;

pub use crate::train::weights::{
    check_weights_mapped, load_weights, load_weights_mapped, ParamSpec, WeightFiles, CONFIG_FILE,
    INDEX_FILE, SINGLE_FILE,
};
pub use adapter::{
    load_adapter, read_adapter_config, save_adapter, ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE,
    PEFT_PREFIX,
};
pub use folder::write_model_folder;
pub(crate) use folder::{save_model, save_model_sharded};
pub use model_file::SHARD_INDEX_FILE;
pub use place::check_output_dir;
