//! What every architecture shares around its parameters: the `VarMap` it owns, building it on a
//! device in a dtype, loading a folder's weights into it, and writing a folder `transformers`
//! loads.

use std::path::Path;

use accelerate_rs::checkpoint::{load_weights_mapped, write_model_folder};
use candle_core::{DType, Device};
use candle_nn::{VarBuilder, VarMap};

use crate::error::{Error, Result};
use crate::lora::Adapters;

/// The weight files a fresh model is checked against before it is allocated: the folder (or
/// file) and the map from the files' tensor names to parameter names (see
/// `accelerate_rs::checkpoint::load_weights_mapped`).
pub(crate) type Source<'a> = (&'a Path, &'a dyn Fn(&str) -> Option<String>);

/// `save_pretrained`'s shard size: 5 GB, `transformers`' `max_shard_size="5GB"`.
pub const DEFAULT_MAX_SHARD_BYTES: usize = 5_000_000_000;

/// A model's parameters: the map `accelerate_rs::Accelerator::prepare` takes, with the dtype
/// they were made in, and how the model uses them (training mode, activation checkpointing),
/// which a model built again over the same parameters keeps.
#[derive(Clone)]
pub(crate) struct Weights {
    pub(crate) varmap: VarMap,
    pub(crate) dtype: DType,
    pub(crate) device: Device,
    /// The LoRA adapters, when the model has them (then the parameters above are frozen).
    pub(crate) adapters: Option<Adapters>,
    /// Training mode: dropout applies.
    pub(crate) training: bool,
    /// Every block runs through `accelerate_rs::nn::checkpoint_fn`.
    pub(crate) checkpointing: bool,
    /// ZeRO-3: the parameters, sharded over the ranks (then `varmap` is empty and the model's
    /// layers hold shape-only placeholders: every forward builds them from the gathered units).
    pub(crate) sharded: Option<accelerate_rs::ShardedModel>,
}

impl std::fmt::Debug for Weights {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let vars = self.varmap.all_vars();
        let elems: usize = vars.iter().map(|v| v.elem_count()).sum();
        write!(
            f,
            "Weights {{ tensors: {}, elements: {elems}, dtype: {:?}, adapters: {:?} }}",
            vars.len(),
            self.dtype,
            self.adapters
        )
    }
}

impl Weights {
    /// Builds a model with `build` on `varmap`: a fresh one (the parameters created by it), or
    /// one that already holds every parameter the model asks for, under its name and in
    /// `dtype` (the model then uses them; a parameter it lacks is an error naming it).
    ///
    /// A fresh model is first built without allocating anything
    /// (`accelerate_rs::shape_only_var_builder`), its parameters compared with the weight files
    /// of `source` when given (headers only: a `config.json` claiming sizes the files do not
    /// hold is an error naming the tensor) and checked to be allocatable on `device` (an error
    /// naming the tensor and the bytes, rather than a failed allocation aborting the process);
    /// only then is it allocated.
    pub(crate) fn build<M>(
        varmap: VarMap,
        device: &Device,
        dtype: DType,
        source: Option<Source<'_>>,
        build: impl Fn(VarBuilder) -> Result<M>,
    ) -> Result<(M, Weights)> {
        if !dtype.is_float() {
            return Err(Error::Accelerate(accelerate_rs::Error::invalid(
                "dtype",
                format!("model parameters must be a float dtype, got {dtype:?}"),
            )));
        }
        let names = |m: &VarMap| -> Vec<String> {
            let data = m.data().lock().unwrap_or_else(|p| p.into_inner());
            data.keys().cloned().collect()
        };
        let given = names(&varmap);
        if given.is_empty() {
            let (vb, shapes) = accelerate_rs::shape_only_var_builder(dtype, device);
            build(vb)?;
            let specs = shapes.specs();
            if let Some((dir, map)) = source {
                accelerate_rs::checkpoint::check_weights_mapped(dir, &specs, map)?;
            }
            accelerate_rs::check_allocatable(&specs, device)?;
        }
        let model = build(VarBuilder::from_varmap(&varmap, dtype, device))?;
        if !given.is_empty() {
            let mut missing: Vec<String> = names(&varmap)
                .into_iter()
                .filter(|n| !given.contains(n))
                .collect();
            if !missing.is_empty() {
                missing.sort();
                // Leave the caller's map as it was given.
                let mut data = varmap.data().lock().unwrap_or_else(|p| p.into_inner());
                for n in &missing {
                    data.remove(n);
                }
                return Err(Error::Accelerate(accelerate_rs::Error::invalid(
                    "parameters",
                    format!(
                        "the parameters given lack {} of the model's: {}",
                        missing.len(),
                        missing.join(", ")
                    ),
                )));
            }
        }
        let weights = Weights {
            varmap,
            dtype,
            device: device.clone(),
            adapters: None,
            training: false,
            checkpointing: false,
            sharded: None,
        };
        Ok((model, weights))
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
        if self.sharded.is_some() {
            return Err(Error::Accelerate(accelerate_rs::Error::invalid(
                "save_pretrained",
                "the model is sharded (ZeRO-3): every rank calls \
                 `accelerator.save_model_with_config(dir, model.sharded_parameters().unwrap(), &model.config_json(), max_shard_bytes)`, \
                 which streams one unit at a time through rank 0",
            )));
        }
        write_model_folder(dir, &self.varmap, max_shard_bytes, Some(config))?;
        Ok(())
    }

    /// ZeRO-3 weights: nothing in `varmap`, the parameters in `sharded`.
    pub(crate) fn sharded(
        sharded: accelerate_rs::ShardedModel,
        dtype: DType,
        device: &Device,
    ) -> Self {
        Weights {
            varmap: VarMap::new(),
            dtype,
            device: device.clone(),
            adapters: None,
            training: false,
            checkpointing: false,
            sharded: Some(sharded),
        }
    }
}

/// The one float dtype of the parameters in `varmap`, for `with_parameters`.
pub(crate) fn parameters_dtype(varmap: &VarMap, has_adapters: bool) -> Result<DType> {
    let invalid = |reason: String| {
        Error::Accelerate(accelerate_rs::Error::invalid("with_parameters", reason))
    };
    if has_adapters {
        return Err(invalid(
            "the model has LoRA adapters: train the adapters (in f32) over a base loaded in the \
             compute dtype instead of mixed-precision working copies"
                .into(),
        ));
    }
    let data = varmap.data().lock().unwrap_or_else(|p| p.into_inner());
    let mut dtypes: Vec<(DType, &String)> = data.iter().map(|(n, v)| (v.dtype(), n)).collect();
    dtypes.sort_by_key(|(_, n)| n.as_str());
    let Some(&(first, first_name)) = dtypes.first() else {
        return Err(invalid("the parameters given are empty".into()));
    };
    if let Some((other, name)) = dtypes.iter().find(|(d, _)| *d != first) {
        return Err(invalid(format!(
            "the parameters given mix dtypes: `{first_name}` is {first:?}, `{name}` {other:?}"
        )));
    }
    if !first.is_float() {
        return Err(invalid(format!(
            "the parameters given are {first:?}, not a float dtype"
        )));
    }
    Ok(first)
}

/// The methods every architecture has around its parameters (inherent, so no trait import is
/// needed): `varmap`, `dtype`, `config_json`, `save_pretrained`, `save_pretrained_sharded`,
/// `train`/`is_training`, activation checkpointing and LoRA, `with_parameters`, and the
/// constructors `from_config` and `from_pretrained` (for the `architectures` given). The type
/// needs fields `config` and `weights: Weights`, a method `config_value(&self) ->
/// serde_json::Value`, `config.check()`, the constructors `assemble(config, vb, init_std)` (the
/// layers), `from_parts(config, parts, weights)` and `load(config, dir, device, dtype)`, and to
/// implement `lora::Adaptable` (whose `rebuild` is the generated `rebuilt`). It generates
/// `build(config, varmap, device, dtype, init_std)` from them.
macro_rules! pretrained_methods {
    (
        $ty:ty,
        config = $config:ty,
        architectures = [$($arch:literal),+ $(,)?]
        $(, $(#[$doc:meta])+)? $(,)?
    ) => {
        impl $ty {
            /// The model over `varmap` (fresh, or holding every parameter, see
            /// `Weights::build`), with `std` the initializer's standard deviation.
            fn build(
                config: &$config,
                varmap: candle_nn::VarMap,
                device: &candle_core::Device,
                dtype: candle_core::DType,
                std: f64,
                source: Option<$crate::pretrained::Source<'_>>,
            ) -> $crate::error::Result<Self> {
                config.check()?;
                let (parts, weights) = $crate::pretrained::Weights::build(
                    varmap,
                    device,
                    dtype,
                    source,
                    |vb| Self::assemble(config, vb, std),
                )?;
                Self::from_parts(config, parts, weights)
            }

            /// The layers again over the same parameters (frozen or not), for LoRA.
            fn rebuilt(&self, frozen: bool) -> $crate::error::Result<Self> {
                let vb = match &self.weights.sharded {
                    // ZeRO-3: placeholders again; the forward builds from the gathered units.
                    Some(_) => {
                        accelerate_rs::shape_only_var_builder(
                            self.weights.dtype,
                            &self.weights.device,
                        )
                        .0
                    }
                    None => $crate::lora::rebuild_vb(&self.weights, frozen),
                };
                let parts = Self::assemble(&self.config, vb, 0.0)?;
                Self::from_parts(&self.config, parts, self.weights.clone())
            }

            /// A model with fresh parameters on `device` in `dtype`, drawn as `transformers`
            /// initializes them (N(0, `initializer_range`²) weights, zero biases, unit norms).
            pub fn from_config(
                config: &$config,
                device: &candle_core::Device,
                dtype: candle_core::DType,
            ) -> $crate::error::Result<Self> {
                Self::build(
                    config,
                    candle_nn::VarMap::new(),
                    device,
                    dtype,
                    config.initializer_range,
                    None,
                )
            }

            /// Loads a Hugging Face folder (`config.json` and `model.safetensors` or a sharded
            /// index) on `device` in `dtype` (a bf16 checkpoint into f32 parameters, or the
            /// reverse). All or nothing; errors name the file and the key or tensor. The
            /// folder's `architectures` must be one of
            #[doc = concat!($("`", $arch, "` "),+)]
            /// (or absent).
            $($(#[$doc])+)?
            pub fn from_pretrained(
                dir: impl AsRef<std::path::Path>,
                device: &candle_core::Device,
                dtype: candle_core::DType,
            ) -> $crate::error::Result<Self> {
                let dir = $crate::config::model_folder(dir.as_ref())?;
                let (path, json) = $crate::config::read_json(dir)?;
                $crate::pretrained::check_architecture(&path, &json, &[$($arch),+])?;
                let config = <$config>::from_json(&path, &json)?;
                Self::load(config, dir, device, dtype)
            }

            /// The parameters, by their Hugging Face names: what
            /// `accelerate_rs::Accelerator::prepare` (or `prepare_model`) and the optimizer take.
            pub fn varmap(&self) -> &candle_nn::VarMap {
                &self.weights.varmap
            }

            /// The same model over `varmap`, which holds every parameter of this one under its
            /// name, all in one float dtype: the working copies that
            /// `accelerate_rs::Accelerator::prepare_mixed` returns. For mixed precision this
            /// model keeps the f32 masters (prepared, stepped, saved) and the returned one, in
            /// the compute dtype, runs forward and backward; training mode and activation
            /// checkpointing are carried over. A parameter `varmap` lacks is an error naming it.
            /// Not for a model with LoRA adapters (train the adapters in f32 over a bf16 base
            /// instead).
            pub fn with_parameters(
                &self,
                varmap: &candle_nn::VarMap,
            ) -> $crate::error::Result<Self> {
                let dtype = $crate::pretrained::parameters_dtype(
                    varmap,
                    self.weights.adapters.is_some(),
                )?;
                let mut model = Self::build(
                    &self.config,
                    varmap.clone(),
                    &self.weights.device,
                    dtype,
                    0.0,
                    None,
                )?;
                model.weights.training = self.weights.training;
                model.weights.checkpointing = self.weights.checkpointing;
                Ok(model)
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
            /// `model.safetensors` (sharded above 5 GB), written into `<dir>.tmp-<pid>` and
            /// then moved into `dir`, whose other files (a tokenizer, a README) stay. With LoRA adapters it writes the base weights as they are
            /// (call [`merge_lora`](Self::merge_lora) first for merged weights, or
            /// [`save_adapter`](Self::save_adapter) for the adapters). Call it on one process
            /// (`accelerator.is_main_process()`), or on every rank use
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
                self.weights.training = on;
            }

            /// Whether dropout applies ([`train`](Self::train)).
            pub fn is_training(&self) -> bool {
                self.weights.training
            }

            /// Activation checkpointing on or off (`transformers`'
            /// `gradient_checkpointing_enable()`): every block runs through
            /// `accelerate_rs::nn::checkpoint_fn`, so its activations are recomputed in the
            /// backward pass instead of kept (about one more forward pass per step, for the
            /// memory of all but the blocks' inputs). The gradients are the same as without,
            /// bit for bit on the CPU (dropout included: the recomputation replays the masks).
            /// Compute them through the accelerator (`backward_step`, `accelerator.backward`)
            /// or `accelerate_rs::nn::backward`, not `loss.backward()`.
            pub fn set_gradient_checkpointing(&mut self, on: bool) {
                self.weights.checkpointing = on;
            }

            /// Whether activation checkpointing is on.
            pub fn is_gradient_checkpointing(&self) -> bool {
                self.weights.checkpointing
            }

            /// Adds LoRA adapters (PEFT's `get_peft_model`) to the linear layers `config`
            /// targets (by module path, PEFT's rules; no targets given: PEFT's default for the
            /// architecture). The output layer is never targeted. From then on the base
            /// parameters are frozen (no gradient is computed for them) and
            /// [`trainable_parameters`](Self::trainable_parameters) is the adapters: give that
            /// to the optimizer and to `Accelerator::prepare`, so that only the adapters are
            /// stepped and all-reduced. Adapters are f32 on an f16/bf16 base unless `config`
            /// says otherwise. An error if the model already has adapters or nothing matches.
            pub fn add_lora(
                &mut self,
                config: &accelerate_rs::nn::LoraConfig,
            ) -> crate::Result<()> {
                crate::lora::add_lora(self, config)
            }

            /// Loads a PEFT adapter folder (`adapter_config.json`, `adapter_model.safetensors`,
            /// as `peft`'s `save_pretrained` writes it) onto the model:
            /// [`add_lora`](Self::add_lora) with its settings, then its tensors, all or nothing.
            pub fn load_adapter(&mut self, dir: impl AsRef<std::path::Path>) -> crate::Result<()> {
                crate::lora::load(self, dir.as_ref())
            }

            /// Writes the adapters as a PEFT adapter folder that `peft`'s
            /// `PeftModel.from_pretrained(base, dir)` loads (one process;
            /// `accelerator.is_main_process()`).
            pub fn save_adapter(&self, dir: impl AsRef<std::path::Path>) -> crate::Result<()> {
                crate::lora::save(self, dir.as_ref())
            }

            /// Merges the adapters into the base weights (`W + s · B A`, PEFT's
            /// `merge_and_unload`) and drops them: [`save_pretrained`](Self::save_pretrained)
            /// then writes a plain Hugging Face folder, and every parameter trains again.
            pub fn merge_lora(&mut self) -> crate::Result<()> {
                crate::lora::merge(self)
            }

            /// The adapters' settings, when the model has adapters.
            pub fn lora_config(&self) -> Option<&accelerate_rs::nn::LoraConfig> {
                self.weights.adapters.as_ref().map(|a| &a.config)
            }

            /// ZeRO-3: the sharded parameters, when the model was made sharded
            /// (`from_pretrained_sharded`); give them to
            /// `accelerator.prepare_sharded_optimizer`, `save_state` and `save_model_with_config`.
            pub fn sharded_parameters(&self) -> Option<&accelerate_rs::ShardedModel> {
                self.weights.sharded.as_ref()
            }

            /// What trains: the adapters (`<module path>.lora_A.weight`, ...) when the model
            /// has them, else every parameter ([`varmap`](Self::varmap)). Give it to the
            /// optimizer and to `Accelerator::prepare`.
            pub fn trainable_parameters(&self) -> &candle_nn::VarMap {
                crate::lora::trainable(&self.weights)
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
