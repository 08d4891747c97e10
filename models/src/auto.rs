//! [`AutoModel`]: whichever architecture a Hugging Face folder holds, picked from its
//! `config.json` (`architectures`, else `model_type`) through the registry, behind one interface.

use std::path::Path;

use accelerate_rs::nn::LoraConfig;
use accelerate_rs::quant::Quant4bitConfig;
use accelerate_rs::{Accelerator, ShardedModel};
use candle_core::{DType, Device, Result, Tensor};
use candle_nn::VarMap;

use crate::arch::{Architecture, AttentionBackend, Inputs, Task};
use crate::config::{model_folder, read_json};
use crate::error::Result as CrateResult;
use crate::generate::GenerationConfig;
use crate::pretrained::{DynModel, Pretrained};
use crate::registry::Config;
use crate::weights::DEFAULT_MAX_SHARD_BYTES;

/// Any architecture of this crate, loaded from a folder without naming its type: the
/// counterpart of `transformers`' `AutoModelFor*` classes. The model inside is a
/// [`Pretrained<A>`]; [`downcast_ref`](Self::downcast_ref) reaches it.
///
/// ```no_run
/// # fn main() -> accelerate_rs_models::Result<()> {
/// use accelerate_rs_models::{AutoModel, LlamaForCausalLm, Task};
/// use candle_core::{DType, Device};
/// let model = AutoModel::from_pretrained("models/tests/fixtures/llama", &Device::Cpu, DType::F32)?;
/// assert_eq!(model.task(), Task::CausalLm);
/// let varmap = model.varmap(); // for `accelerator.prepare(varmap, opt, loader)`
/// let llama: &LlamaForCausalLm = model.downcast_ref().expect("a Llama");
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct AutoModel(Box<dyn DynModel>);

impl Clone for AutoModel {
    fn clone(&self) -> Self {
        AutoModel(self.0.clone_box())
    }
}

impl<A: Architecture> From<Pretrained<A>> for AutoModel {
    fn from(model: Pretrained<A>) -> Self {
        AutoModel(Box::new(model))
    }
}

impl AutoModel {
    /// Loads the folder `dir` on `device` in `dtype`: the class its `config.json` names in
    /// `architectures` (one of [`architectures`](crate::architectures)), else the `model_type`'s
    /// language model (causal for the decoders, masked for BERT). An unknown `model_type` or
    /// class is an error naming the file and the value.
    pub fn from_pretrained(
        dir: impl AsRef<Path>,
        device: &Device,
        dtype: DType,
    ) -> CrateResult<Self> {
        let dir = model_folder(dir.as_ref())?;
        let (path, json) = read_json(dir)?;
        let config = Config::from_json(&path, &json)?;
        Ok(AutoModel(config.load(dir, device, dtype, None)?))
    }

    /// Loads the folder `dir` with a 4-bit base (QLoRA): see
    /// [`Pretrained::from_pretrained_4bit`].
    pub fn from_pretrained_4bit(
        dir: impl AsRef<Path>,
        device: &Device,
        dtype: DType,
        quant: &Quant4bitConfig,
    ) -> CrateResult<Self> {
        let dir = model_folder(dir.as_ref())?;
        let (path, json) = read_json(dir)?;
        let config = Config::from_json(&path, &json)?;
        Ok(AutoModel(config.load(dir, device, dtype, Some(quant))?))
    }

    /// A model with fresh parameters for `config` (the class it names, as
    /// [`from_pretrained`](Self::from_pretrained) picks it), drawn as `transformers`
    /// initializes them.
    pub fn from_config(config: &Config, device: &Device, dtype: DType) -> CrateResult<Self> {
        Ok(AutoModel(config.fresh(None, device, dtype)?))
    }

    /// [`from_config`](Self::from_config) with the values drawn from `(seed, parameter name)`:
    /// the same model on every process (see [`Pretrained::from_config_seeded`]).
    pub fn from_config_seeded(
        config: &Config,
        seed: u64,
        device: &Device,
        dtype: DType,
    ) -> CrateResult<Self> {
        Ok(AutoModel(config.fresh(Some(seed), device, dtype)?))
    }

    /// [`from_pretrained`](Self::from_pretrained) at `zero_stage = 3`: every rank calls it and
    /// reads only its slices of each unit (see [`Pretrained::from_pretrained_sharded`]).
    pub fn from_pretrained_sharded(
        dir: impl AsRef<Path>,
        accelerator: &Accelerator,
        dtype: DType,
    ) -> CrateResult<Self> {
        let dir = model_folder(dir.as_ref())?;
        let (path, json) = read_json(dir)?;
        let config = Config::from_json(&path, &json)?;
        Ok(AutoModel(config.sharded(Ok(dir), accelerator, dtype)?))
    }

    /// [`from_config_seeded`](Self::from_config_seeded) at `zero_stage = 3` (see
    /// [`Pretrained::from_config_sharded`]).
    pub fn from_config_sharded(
        config: &Config,
        accelerator: &Accelerator,
        dtype: DType,
        seed: u64,
    ) -> CrateResult<Self> {
        Ok(AutoModel(config.sharded(Err(seed), accelerator, dtype)?))
    }

    /// ZeRO-3: the sharded parameters of a model made by
    /// [`from_pretrained_sharded`](Self::from_pretrained_sharded) (see
    /// [`Pretrained::sharded_parameters`]).
    pub fn sharded_parameters(&self) -> Option<&ShardedModel> {
        self.0.sharded_parameters()
    }

    /// The 4-bit base's bytes and elements, when the model has one (see
    /// [`Pretrained::base_4bit_size`]).
    pub fn base_4bit_size(&self) -> Option<(usize, usize)> {
        self.0.base_4bit_size()
    }

    /// The model inside, if it is a `Pretrained<A>` (`model.downcast_ref::<Llama>()`, or with the
    /// alias's type: `let m: &LlamaForCausalLm = model.downcast_ref()?`).
    pub fn downcast_ref<A: Architecture>(&self) -> Option<&Pretrained<A>> {
        self.0.as_any().downcast_ref()
    }

    /// [`downcast_ref`](Self::downcast_ref), to change.
    pub fn downcast_mut<A: Architecture>(&mut self) -> Option<&mut Pretrained<A>> {
        self.0.as_any_mut().downcast_mut()
    }

    /// What `loss` computes.
    pub fn task(&self) -> Task {
        self.0.task()
    }

    /// The `model_type`.
    pub fn model_type(&self) -> &str {
        self.0.model_type()
    }

    /// The dtype of the parameters.
    pub fn dtype(&self) -> DType {
        self.0.dtype()
    }

    /// The logits: `[B, T, vocab]` for the language models, `[B, num_labels]` for a classifier.
    pub fn forward(&self, input_ids: &Tensor, attention_mask: Option<&Tensor>) -> Result<Tensor> {
        self.0
            .forward_with(&Inputs::new(input_ids).attention_mask(attention_mask))
    }

    /// [`forward`](Self::forward) with every input the architecture takes.
    pub fn forward_with(&self, inputs: &Inputs<'_>) -> Result<Tensor> {
        self.0.forward_with(inputs)
    }

    /// The task's loss (see [`Task`] and [`Pretrained::loss`]).
    pub fn loss(&self, input_ids: &Tensor, labels: &Tensor) -> Result<Tensor> {
        self.loss_with_mask(input_ids, None, labels)
    }

    /// [`loss`](Self::loss) with an attention mask `[B, T]` (1 token, 0 padding).
    pub fn loss_with_mask(
        &self,
        input_ids: &Tensor,
        attention_mask: Option<&Tensor>,
        labels: &Tensor,
    ) -> Result<Tensor> {
        self.0.loss_with(
            &Inputs::new(input_ids).attention_mask(attention_mask),
            labels,
        )
    }

    /// [`loss`](Self::loss) with every input the architecture takes.
    pub fn loss_with(&self, inputs: &Inputs<'_>, labels: &Tensor) -> Result<Tensor> {
        self.0.loss_with(inputs, labels)
    }

    /// Generates from `prompts` (token ids, batched with left padding): the new tokens of each
    /// (see [`Pretrained::generate`]).
    pub fn generate(
        &self,
        prompts: &[Vec<u32>],
        config: &GenerationConfig,
    ) -> CrateResult<Vec<Vec<u32>>> {
        self.0.generate(prompts, config)
    }

    /// The parameters, for `accelerate_rs::Accelerator::prepare` and the optimizer.
    pub fn varmap(&self) -> &VarMap {
        self.0.varmap()
    }

    /// The same model over the working copies of mixed precision (see
    /// [`Pretrained::with_parameters`]).
    pub fn with_parameters(&self, varmap: &VarMap) -> CrateResult<Self> {
        Ok(AutoModel(self.0.with_parameters(varmap)?))
    }

    /// The configuration as `config.json`.
    pub fn config_json(&self) -> serde_json::Value {
        self.0.config_json()
    }

    /// Writes a folder `transformers` loads (one process; see [`Pretrained::save_pretrained`]).
    pub fn save_pretrained(&self, dir: impl AsRef<Path>) -> CrateResult<()> {
        self.0
            .save_pretrained_sharded(dir.as_ref(), DEFAULT_MAX_SHARD_BYTES)
    }

    /// [`save_pretrained`](Self::save_pretrained) with shards of at most `max_shard_bytes`.
    pub fn save_pretrained_sharded(
        &self,
        dir: impl AsRef<Path>,
        max_shard_bytes: usize,
    ) -> CrateResult<()> {
        self.0
            .save_pretrained_sharded(dir.as_ref(), max_shard_bytes)
    }

    /// Training mode (dropout) on or off.
    pub fn train(&mut self, on: bool) {
        self.0.train(on)
    }

    /// Whether training mode (dropout) is on.
    pub fn is_training(&self) -> bool {
        self.0.is_training()
    }

    /// Activation checkpointing of every block on or off (see
    /// [`Pretrained::set_gradient_checkpointing`]).
    pub fn set_gradient_checkpointing(&mut self, on: bool) {
        self.0.set_gradient_checkpointing(on)
    }

    /// Whether activation checkpointing is on.
    pub fn is_gradient_checkpointing(&self) -> bool {
        self.0.is_gradient_checkpointing()
    }

    /// Which attention the layers run (see [`Pretrained::set_attention_backend`]).
    pub fn set_attention_backend(&mut self, backend: AttentionBackend) {
        self.0.set_attention_backend(backend)
    }

    /// Which attention the layers run.
    pub fn attention_backend(&self) -> AttentionBackend {
        self.0.attention_backend()
    }

    /// Adds LoRA adapters (see [`Pretrained::add_lora`]).
    pub fn add_lora(&mut self, config: &LoraConfig) -> CrateResult<()> {
        self.0.add_lora(config)
    }

    /// Loads a PEFT adapter folder (see [`Pretrained::load_adapter`]).
    pub fn load_adapter(&mut self, dir: impl AsRef<Path>) -> CrateResult<()> {
        self.0.load_adapter(dir.as_ref())
    }

    /// Writes the adapters as a PEFT adapter folder (see [`Pretrained::save_adapter`]).
    pub fn save_adapter(&self, dir: impl AsRef<Path>) -> CrateResult<()> {
        self.0.save_adapter(dir.as_ref())
    }

    /// Merges the adapters into the base weights (see [`Pretrained::merge_lora`]).
    pub fn merge_lora(&mut self) -> CrateResult<()> {
        self.0.merge_lora()
    }

    /// The adapters' settings, when the model has adapters.
    pub fn lora_config(&self) -> Option<&LoraConfig> {
        self.0.lora_config()
    }

    /// What trains: the adapters when the model has them, else every parameter (see
    /// [`Pretrained::trainable_parameters`]).
    pub fn trainable_parameters(&self) -> &VarMap {
        self.0.trainable_parameters()
    }

    /// Floating-point operations per trained token (see [`Pretrained::flops_per_token`]).
    pub fn flops_per_token(&self, seq_len: usize) -> f64 {
        self.0.flops_per_token(seq_len)
    }

    /// The architecture as `estimate-memory` sees it (see
    /// [`Pretrained::memory_architecture`]).
    pub fn memory_architecture(&self) -> CrateResult<accelerate_rs::memory::Architecture> {
        self.0.memory_architecture()
    }
}
