//! A model's parameters: the `VarMap` it owns, the dtype and device they were made in, how the
//! model uses them (training mode, activation checkpointing) and its LoRA adapters; building
//! them safely (a shape-only dry run, the weight files' headers and the machine checked before
//! anything is allocated), loading a folder's weights into them, and writing a folder
//! `transformers` loads.

use std::path::Path;
use std::sync::Arc;

use accelerate_rs::checkpoint::{load_weights_mapped, write_model_folder};
use accelerate_rs::nn::LoraConfig;
use accelerate_rs::Parameters;
use candle_core::{DType, Device};
use candle_nn::{VarBuilder, VarMap};

use crate::base4bit::{saved_tensors, Base4bit, Placeholders};
use crate::error::{Error, Result};

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
    /// Which attention the layers run.
    pub(crate) attention: crate::arch::AttentionBackend,
    /// ZeRO-3: the parameters, sharded over the ranks (then `varmap` is empty and the layers
    /// hold shape-only placeholders: every forward pass builds them from the gathered units).
    pub(crate) sharded: Option<accelerate_rs::ShardedModel>,
    /// A 4-bit base (QLoRA): the quantized linear layers, which `varmap` does not hold (their
    /// biases, the embeddings, norms and head it does, in `dtype`).
    pub(crate) base4: Option<Arc<Base4bit>>,
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
    /// `seed`, for a fresh model: its values are drawn from `(seed, name)`
    /// (`accelerate_rs::seeded_var_builder`), the same on every process and in any order.
    /// With a 4-bit base, its layers' weights are placeholders, neither in `varmap` nor in the
    /// checks (see `base4bit::Placeholders`).
    pub(crate) fn build<M>(
        varmap: VarMap,
        device: &Device,
        dtype: DType,
        (source, seed): (Option<Source<'_>>, Option<u64>),
        base4: Option<Arc<Base4bit>>,
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
            let mut specs = shapes.specs();
            if let Some(base) = &base4 {
                specs.retain(|s| !base.holds(&s.name));
            }
            if let Some((dir, map)) = source {
                accelerate_rs::checkpoint::check_weights_mapped(dir, &specs, map)?;
            }
            accelerate_rs::check_allocatable(&specs, device)?;
        }
        let vb = var_builder(
            &varmap,
            seed.filter(|_| given.is_empty()),
            base4.as_ref(),
            dtype,
            device,
        );
        let model = build(vb)?;
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
            attention: Default::default(),
            sharded: None,
            base4,
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
                 `accelerator.save_model_with_config(dir, model.sharded_parameters().unwrap(), \
                 &model.config_json(), max_shard_bytes)`, which streams one unit at a time \
                 through rank 0",
            )));
        }
        match &self.base4 {
            Some(base) => {
                let mut params = self.varmap.named_parameters();
                for (name, t) in saved_tensors(base)? {
                    params.push((name, candle_core::Var::from_tensor(&t)?));
                }
                params.sort_by(|a, b| a.0.cmp(&b.0));
                write_model_folder(dir, &Saved(params), max_shard_bytes, Some(config))?;
            }
            None => write_model_folder(dir, &self.varmap, max_shard_bytes, Some(config))?,
        }
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
            attention: Default::default(),
            sharded: Some(sharded),
            base4: None,
        }
    }
}

/// A builder over `varmap` (values drawn from `(seed, name)` when given), a 4-bit base's
/// quantized weights placeholders (see `base4bit::Placeholders`).
fn var_builder(
    varmap: &VarMap,
    seed: Option<u64>,
    base4: Option<&Arc<Base4bit>>,
    dtype: DType,
    device: &Device,
) -> VarBuilder<'static> {
    match (seed, base4) {
        (Some(seed), _) => accelerate_rs::seeded_var_builder(varmap, seed, dtype, device),
        (None, Some(base)) => VarBuilder::from_backend(
            Box::new(Placeholders {
                inner: Box::new(varmap.clone()),
                base: base.clone(),
            }),
            dtype,
            device.clone(),
        ),
        (None, None) => VarBuilder::from_varmap(varmap, dtype, device),
    }
}

/// The tensors of a 4-bit model's folder: the dense parameters and the quantized layers' saved
/// tensors, sorted by name.
struct Saved(Vec<(String, candle_core::Var)>);

impl Parameters for Saved {
    fn named_parameters(&self) -> Vec<(String, candle_core::Var)> {
        self.0.clone()
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

/// A model's adapters: the settings and the `VarMap` of the `lora_A` / `lora_B` tensors (named
/// `<module path>.lora_A.weight`, ...).
#[derive(Clone)]
pub(crate) struct Adapters {
    pub(crate) config: LoraConfig,
    pub(crate) varmap: VarMap,
}

impl std::fmt::Debug for Adapters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Adapters")
            .field("config", &self.config)
            .field("tensors", &self.varmap.all_vars().len())
            .finish()
    }
}
