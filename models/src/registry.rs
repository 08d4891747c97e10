//! The architectures this crate implements, one line each ([`REGISTRY`]), and what is read
//! through it: which architecture a `config.json` holds ([`Config`]), the `model_type` values
//! and classes known ([`model_types`], [`architectures`]). `AutoModel` and `estimate-memory`
//! find an architecture here and nowhere else.

use std::any::Any;
use std::path::Path;
use std::sync::Arc;

use accelerate_rs::quant::Quant4bitConfig;
use accelerate_rs::Accelerator;
use candle_core::{DType, Device};
use serde_json::Value;

use crate::arch::{Architecture, ModelConfig, Task};
use crate::bert::{BertClassifier, BertMlm};
use crate::config::read_json;
use crate::error::{Error, Result};
use crate::gemma::Gemma;
use crate::gpt2::Gpt2;
use crate::llama::Llama;
use crate::mixtral::Mixtral;
use crate::phi3::Phi3;
use crate::pretrained::{DynModel, Pretrained};
use crate::qwen3::Qwen3;

/// Every architecture, one line each. Entries that share a `model_type` share its configuration
/// type (BERT's two heads); the first of them is what a folder without `architectures` loads.
pub(crate) const REGISTRY: &[Entry] = &[
    Entry::of::<Llama>(),
    Entry::of::<Qwen3>(),
    Entry::of::<Gemma>(),
    Entry::of::<Mixtral>(),
    Entry::of::<Phi3>(),
    Entry::of::<Gpt2>(),
    Entry::of::<BertMlm>(),
    Entry::of::<BertClassifier>(),
];

/// A parsed configuration of any architecture.
trait AnyConfig: std::fmt::Debug + Send + Sync {
    fn as_any(&self) -> &dyn Any;
}

impl<C: ModelConfig> AnyConfig for C {
    fn as_any(&self) -> &dyn Any {
        self
    }
}

type Parsed = Arc<dyn AnyConfig>;

/// A model behind the registry's object-safe interface.
type Model = Result<Box<dyn DynModel>>;

/// One architecture, its facts and its generic functions, as [`Entry::of`] takes them from its
/// [`Architecture`] impl.
pub(crate) struct Entry {
    pub(crate) model_types: &'static [&'static str],
    pub(crate) classes: &'static [&'static str],
    pub(crate) task: Task,
    parse: fn(&Path, &Value) -> Result<Parsed>,
    load: fn(&Parsed, &Path, &Device, DType, Option<&Quant4bitConfig>) -> Model,
    fresh: fn(&Parsed, Option<u64>, &Device, DType) -> Model,
    sharded: fn(&Parsed, std::result::Result<&Path, u64>, &Accelerator, DType) -> Model,
    memory: fn(&Parsed) -> Result<accelerate_rs::memory::Architecture>,
}

impl Entry {
    const fn of<A: Architecture>() -> Entry {
        Entry {
            model_types: A::MODEL_TYPES,
            classes: A::CLASSES,
            task: A::TASK,
            parse: parse::<A>,
            load: load::<A>,
            fresh: fresh::<A>,
            sharded: sharded::<A>,
            memory: memory::<A>,
        }
    }
}

fn parse<A: Architecture>(path: &Path, json: &Value) -> Result<Parsed> {
    Ok(Arc::new(A::Config::from_json(path, json)?))
}

/// `parsed` as `A`'s configuration (entries sharing a `model_type` share the type).
fn config_of<A: Architecture>(parsed: &Parsed) -> Result<&A::Config> {
    parsed.as_any().downcast_ref::<A::Config>().ok_or_else(|| {
        Error::Accelerate(accelerate_rs::Error::invalid(
            "config",
            format!(
                "the configuration is not a {}'s",
                std::any::type_name::<A::Config>()
            ),
        ))
    })
}

fn load<A: Architecture>(
    parsed: &Parsed,
    dir: &Path,
    device: &Device,
    dtype: DType,
    quant: Option<&Quant4bitConfig>,
) -> Result<Box<dyn DynModel>> {
    let config = config_of::<A>(parsed)?.clone();
    Ok(Box::new(Pretrained::<A>::load(
        config, dir, device, dtype, quant,
    )?))
}

fn fresh<A: Architecture>(
    parsed: &Parsed,
    seed: Option<u64>,
    device: &Device,
    dtype: DType,
) -> Model {
    let config = config_of::<A>(parsed)?;
    Ok(Box::new(match seed {
        Some(seed) => Pretrained::<A>::from_config_seeded(config, seed, device, dtype)?,
        None => Pretrained::<A>::from_config(config, device, dtype)?,
    }))
}

/// ZeRO-3: the weights of the folder (`Ok(dir)`) or drawn from a seed (`Err(seed)`), sharded.
fn sharded<A: Architecture>(
    parsed: &Parsed,
    source: std::result::Result<&Path, u64>,
    accelerator: &Accelerator,
    dtype: DType,
) -> Model {
    let config = config_of::<A>(parsed)?;
    Ok(Box::new(match source {
        Ok(dir) => Pretrained::<A>::load_sharded(config.clone(), dir, accelerator, dtype)?,
        Err(seed) => Pretrained::<A>::from_config_sharded(config, accelerator, dtype, seed)?,
    }))
}

fn memory<A: Architecture>(parsed: &Parsed) -> Result<accelerate_rs::memory::Architecture> {
    Pretrained::<A>::memory_architecture(config_of::<A>(parsed)?)
}

/// The `model_type` values this crate implements, in the registry's order.
pub fn model_types() -> Vec<&'static str> {
    let mut out: Vec<&'static str> = Vec::new();
    for t in REGISTRY.iter().flat_map(|e| e.model_types) {
        if !out.contains(t) {
            out.push(t);
        }
    }
    out
}

/// The `transformers` classes (`architectures[0]` of `config.json`) this crate loads.
pub fn architectures() -> Vec<&'static str> {
    REGISTRY.iter().flat_map(|e| e.classes).copied().collect()
}

/// A model folder's configuration, whatever its architecture: its `model_type`, the class its
/// `architectures` names, and the architecture's configuration, parsed and checked
/// ([`get`](Self::get) it by type).
#[derive(Debug, Clone)]
pub struct Config {
    model_type: String,
    class: Option<String>,
    path: std::path::PathBuf,
    entry: &'static Entry,
    parsed: Parsed,
}

impl std::fmt::Debug for Entry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Entry")
            .field("model_types", &self.model_types)
            .field("classes", &self.classes)
            .finish()
    }
}

impl Config {
    /// Reads `path`: a `config.json`, or a model folder holding one. An unknown `model_type` is
    /// an error naming the file and the value; a missing required key (`hidden_size`, ...) or a
    /// value of the wrong type names the key.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let (path, json) = read_json(path.as_ref())?;
        Self::from_json(&path, &json)
    }

    /// Parses a configuration already read; `path` is named in errors.
    pub fn from_json(path: &Path, json: &Value) -> Result<Self> {
        let model_type = json
            .get("model_type")
            .ok_or_else(|| {
                Error::config(
                    path,
                    Some("model_type"),
                    format!("missing (one of {} expected)", model_types().join(", ")),
                )
            })?
            .as_str()
            .ok_or_else(|| Error::config(path, Some("model_type"), "expected a string"))?;
        let entry = REGISTRY
            .iter()
            .find(|e| e.model_types.contains(&model_type))
            .ok_or_else(|| {
                Error::config(
                    path,
                    Some("model_type"),
                    format!(
                        "unknown value `{model_type}`: this crate implements {}",
                        model_types().join(", ")
                    ),
                )
            })?;
        let class = json
            .get("architectures")
            .and_then(|a| a.as_array())
            .and_then(|a| a.first())
            .and_then(|a| a.as_str())
            .map(str::to_string);
        Ok(Config {
            model_type: model_type.to_string(),
            class,
            path: path.to_path_buf(),
            entry,
            parsed: (entry.parse)(path, json)?,
        })
    }

    /// The `model_type`.
    pub fn model_type(&self) -> &str {
        &self.model_type
    }

    /// The first entry of `architectures` (the class `save_pretrained` was called on), if any.
    pub fn architecture(&self) -> Option<&str> {
        self.class.as_deref()
    }

    /// The architecture's configuration, if it is a `C` (`config.get::<LlamaConfig>()`).
    pub fn get<C: ModelConfig>(&self) -> Option<&C> {
        self.parsed.as_any().downcast_ref::<C>()
    }

    /// The architecture that loads this configuration: the class `architectures` names among
    /// those of the `model_type`, or the `model_type`'s first (its language model) when the
    /// file names none. A class this crate does not implement for the `model_type` is an error
    /// naming it.
    pub(crate) fn entry(&self) -> Result<&'static Entry> {
        let Some(class) = self.class.as_deref() else {
            return Ok(self.entry);
        };
        REGISTRY
            .iter()
            .find(|e| {
                e.model_types.contains(&self.model_type.as_str()) && e.classes.contains(&class)
            })
            .ok_or_else(|| {
                Error::config(
                    &self.path,
                    Some("architectures"),
                    format!(
                        "`{class}` with model_type `{}` is not implemented (supported: {})",
                        self.model_type,
                        architectures().join(", ")
                    ),
                )
            })
    }

    /// What the model of this configuration is trained to do.
    pub fn task(&self) -> Result<Task> {
        Ok(self.entry()?.task)
    }

    /// The model of this configuration, its weights loaded from `dir` (with a 4-bit base
    /// quantized by `quant` when given, or when the folder is a 4-bit one).
    pub(crate) fn load(
        &self,
        dir: &Path,
        device: &Device,
        dtype: DType,
        quant: Option<&Quant4bitConfig>,
    ) -> Result<Box<dyn DynModel>> {
        (self.entry()?.load)(&self.parsed, dir, device, dtype, quant)
    }

    /// The model of this configuration with fresh parameters (drawn from `(seed, name)` when
    /// a seed is given).
    pub(crate) fn fresh(&self, seed: Option<u64>, device: &Device, dtype: DType) -> Model {
        (self.entry()?.fresh)(&self.parsed, seed, device, dtype)
    }

    /// ZeRO-3: the model of this configuration, sharded over `accelerator`'s ranks, its weights
    /// read from the folder (`Ok(dir)`: each rank only its slices) or drawn from a seed
    /// (`Err(seed)`).
    pub(crate) fn sharded(
        &self,
        source: std::result::Result<&Path, u64>,
        accelerator: &Accelerator,
        dtype: DType,
    ) -> Model {
        (self.entry()?.sharded)(&self.parsed, source, accelerator, dtype)
    }

    /// The architecture as `estimate-memory` sees it (`accelerate_rs::memory::estimate`): its
    /// sizes, activations per token, parameters and default LoRA targets.
    pub fn memory_architecture(&self) -> Result<accelerate_rs::memory::Architecture> {
        (self.entry()?.memory)(&self.parsed)
    }
}
