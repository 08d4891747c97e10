//! What every architecture shares around its parameters: the `VarMap` it owns, building it on a
//! device in a dtype, loading a folder's weights into it, and writing a folder `transformers`
//! loads.

use std::path::Path;

use accelerate_rs::checkpoint::{load_weights_mapped, write_model_folder};
use candle_core::{DType, Device};
use candle_nn::{VarBuilder, VarMap};

use crate::error::{Error, Result};

/// `save_pretrained`'s shard size: 5 GB, `transformers`' `max_shard_size="5GB"`.
pub const DEFAULT_MAX_SHARD_BYTES: usize = 5_000_000_000;

/// A model's parameters: the map `accelerate_rs::Accelerator::prepare` takes, with the dtype
/// they were made in.
#[derive(Clone)]
pub(crate) struct Weights {
    pub(crate) varmap: VarMap,
    pub(crate) dtype: DType,
}

impl std::fmt::Debug for Weights {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let vars = self.varmap.all_vars();
        let elems: usize = vars.iter().map(|v| v.elem_count()).sum();
        write!(
            f,
            "Weights {{ tensors: {}, elements: {elems}, dtype: {:?} }}",
            vars.len(),
            self.dtype
        )
    }
}

impl Weights {
    /// Builds a model with `build` on a fresh `VarMap` (the parameters created by it).
    pub(crate) fn build<M>(
        device: &Device,
        dtype: DType,
        build: impl FnOnce(VarBuilder) -> Result<M>,
    ) -> Result<(M, Weights)> {
        if !dtype.is_float() {
            return Err(Error::Accelerate(accelerate_rs::Error::invalid(
                "dtype",
                format!("model parameters must be a float dtype, got {dtype:?}"),
            )));
        }
        let varmap = VarMap::new();
        let model = build(VarBuilder::from_varmap(&varmap, dtype, device))?;
        Ok((model, Weights { varmap, dtype }))
    }

    /// Loads the weights of the folder (or file) `dir` into these parameters, all or nothing;
    /// `map` gives a checkpoint tensor's parameter name, or `None` to skip it.
    pub(crate) fn load(&self, dir: &Path, map: impl Fn(&str) -> Option<String>) -> Result<()> {
        load_weights_mapped(dir, &self.varmap, map)?;
        Ok(())
    }

    /// Writes `dir`: `config.json` and the weights (`model.safetensors`, or shards of at most
    /// `max_shard_bytes` and their index).
    pub(crate) fn save(
        &self,
        dir: &Path,
        config: &serde_json::Value,
        max_shard_bytes: usize,
    ) -> Result<()> {
        write_model_folder(dir, &self.varmap, max_shard_bytes, Some(config))?;
        Ok(())
    }
}

/// The methods every architecture has around its parameters (inherent, so no trait import is
/// needed): `varmap`, `dtype`, `config_json`, `save_pretrained`, `save_pretrained_sharded`,
/// `train`/`is_training`. The type needs fields `weights: Weights` and `training: bool`, and a
/// method `config_value(&self) -> serde_json::Value`.
macro_rules! pretrained_methods {
    ($ty:ty) => {
        impl $ty {
            /// The parameters, by their Hugging Face names: what
            /// `accelerate_rs::Accelerator::prepare` (or `prepare_model`) and the optimizer take.
            pub fn varmap(&self) -> &candle_nn::VarMap {
                &self.weights.varmap
            }

            /// The dtype of the parameters.
            pub fn dtype(&self) -> candle_core::DType {
                self.weights.dtype
            }

            /// The configuration as `config.json` (unknown keys of the loaded file kept,
            /// `architectures` and `dtype` set).
            pub fn config_json(&self) -> serde_json::Value {
                crate::config::to_config_json(
                    self.config_value(),
                    self.class_name(),
                    self.weights.dtype,
                )
            }

            /// Writes a folder `transformers`' `from_pretrained` loads: `config.json` and
            /// `model.safetensors` (sharded above 5 GB), atomically (into `<dir>.tmp-<pid>`,
            /// renamed into place). Call it on one process (`accelerator.is_main_process()`),
            /// or on every rank use
            /// `accelerator.save_model_with_config(dir, model.varmap(), &model.config_json(), max)`.
            pub fn save_pretrained(&self, dir: impl AsRef<std::path::Path>) -> crate::Result<()> {
                self.save_pretrained_sharded(dir, crate::pretrained::DEFAULT_MAX_SHARD_BYTES)
            }

            /// [`save_pretrained`](Self::save_pretrained) with shards of at most
            /// `max_shard_bytes` (`model-0000i-of-0000n.safetensors` and
            /// `model.safetensors.index.json` when the weights do not fit in one).
            pub fn save_pretrained_sharded(
                &self,
                dir: impl AsRef<std::path::Path>,
                max_shard_bytes: usize,
            ) -> crate::Result<()> {
                self.weights
                    .save(dir.as_ref(), &self.config_json(), max_shard_bytes)
            }

            /// Training mode on or off (PyTorch's `model.train()` / `model.eval()`): dropout
            /// applies in training mode only. Off after loading, as in `transformers`.
            pub fn train(&mut self, on: bool) {
                self.training = on;
            }

            /// Whether dropout applies ([`train`](Self::train)).
            pub fn is_training(&self) -> bool {
                self.training
            }
        }
    };
}

pub(crate) use pretrained_methods;

/// Checks `config.json`'s `architectures` against the classes a type implements: absent, or
/// one of `accepted`.
pub(crate) fn check_architecture(
    path: &Path,
    json: &serde_json::Value,
    accepted: &[&str],
) -> Result<()> {
    let Some(arch) = json
        .get("architectures")
        .and_then(|a| a.as_array())
        .and_then(|a| a.first())
        .and_then(|a| a.as_str())
    else {
        return Ok(());
    };
    if accepted.contains(&arch) {
        return Ok(());
    }
    Err(Error::config(
        path,
        Some("architectures"),
        format!(
            "the folder holds a `{arch}`; this type loads {}",
            accepted.join(", ")
        ),
    ))
}
