//! [`Pretrained<A>`]: one architecture's layers with everything every architecture shares around
//! them, written once: the parameters it owns (built safely, loaded from and saved to Hugging
//! Face folders), training mode, activation checkpointing, LoRA adapters (PEFT's format), mixed
//! precision's working copies, and the forward pass and loss through the architecture.

use std::any::Any;
use std::path::Path;
use std::sync::Arc;

use accelerate_rs::nn::LoraConfig;
use accelerate_rs::quant::Quant4bitConfig;
use accelerate_rs::{Accelerator, ShardSource, ShardedModel};
use candle_core::{DType, Device, Tensor};
use candle_nn::{VarBuilder, VarMap};

use crate::arch::{
    Architecture, AttentionBackend, Hidden, Inputs, Mode, ModelConfig, Proj, ShardedRun, Task,
};
use crate::base4bit::{self, Base4bit, Target};
use crate::config::{model_folder, read_json, to_config_json};
use crate::error::{Error, Result};
use crate::generate::{self, GenerationConfig};
use crate::lora::{self, Adaptable};
use crate::weights::{parameters_dtype, Source, Weights, DEFAULT_MAX_SHARD_BYTES};

/// A model of architecture `A` (its layers, see [`Architecture`]) with its configuration and
/// the parameters it owns ([`varmap`](Self::varmap)), under the checkpoints' names. Trainable:
/// every parameter gets a gradient. The public names are aliases of it:
/// [`LlamaForCausalLm`](crate::LlamaForCausalLm) is `Pretrained<Llama>`, and so on; every
/// method here is inherent (no trait to import).
///
/// ```no_run
/// # fn main() -> accelerate_rs_models::Result<()> {
/// use accelerate_rs_models::LlamaForCausalLm;
/// use candle_core::{DType, Device, Tensor};
///
/// let model = LlamaForCausalLm::from_pretrained("TinyLlama", &Device::Cpu, DType::F32)?;
/// let ids = Tensor::new(&[[1u32, 15043, 3186]], &Device::Cpu)?;
/// let logits = model.forward(&ids, None)?; // [1, 3, vocab]
/// let loss = model.loss(&ids, &ids.to_dtype(DType::I64)?)?; // shifted inside
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct Pretrained<A: Architecture> {
    config: A::Config,
    layers: A,
    weights: Weights,
}

impl<A: Architecture> Pretrained<A> {
    /// The model over `varmap` (fresh, or holding every parameter, see `Weights::build`), with
    /// `std` the initializer's standard deviation, checked against the weight files of `source`
    /// before anything is allocated.
    fn build(
        config: &A::Config,
        varmap: VarMap,
        (device, dtype): (&Device, DType),
        std: f64,
        origin: (Option<Source<'_>>, Option<u64>),
    ) -> Result<Self> {
        Self::build_over(config, varmap, (device, dtype), std, origin, None)
    }

    /// [`build`](Self::build) over a 4-bit base (when given): its layers hold their weights in
    /// 4 bits, which `varmap` does not hold.
    fn build_over(
        config: &A::Config,
        varmap: VarMap,
        (device, dtype): (&Device, DType),
        std: f64,
        origin: (Option<Source<'_>>, Option<u64>),
        base4: Option<Arc<Base4bit>>,
    ) -> Result<Self> {
        let (layers, weights) =
            Weights::build(varmap, device, dtype, origin, base4.clone(), |vb| {
                let mut layers = A::assemble(config, vb, std)?;
                attach_4bit(&mut layers, base4.as_deref())?;
                Ok(layers)
            })?;
        Ok(Pretrained {
            config: config.clone(),
            layers,
            weights,
        })
    }

    /// The layers again over the same parameters (frozen or not), for LoRA.
    fn rebuilt(&self, frozen: bool) -> Result<Self> {
        let vb = match &self.weights.sharded {
            // ZeRO-3: placeholders again; the forward pass builds from the gathered units.
            Some(_) => {
                accelerate_rs::shape_only_var_builder(self.weights.dtype, &self.weights.device).0
            }
            None => lora::rebuild_vb(&self.weights, frozen),
        };
        let mut layers = A::assemble(&self.config, vb, 0.0)?;
        attach_4bit(&mut layers, self.weights.base4.as_deref())?;
        Ok(Pretrained {
            config: self.config.clone(),
            layers,
            weights: self.weights.clone(),
        })
    }

    /// A model with fresh parameters on `device` in `dtype`, drawn as `transformers`
    /// initializes them (N(0, `initializer_range`²) weights, zero biases, unit norms).
    pub fn from_config(config: &A::Config, device: &Device, dtype: DType) -> Result<Self> {
        let std = config.initializer_range();
        Self::build(config, VarMap::new(), (device, dtype), std, (None, None))
    }

    /// [`from_config`](Self::from_config) with the values drawn from `(seed, parameter name)`
    /// (`accelerate_rs::seeded_var_builder`): the same model on every process and in every run
    /// with the same seed (training from scratch on several processes).
    pub fn from_config_seeded(
        config: &A::Config,
        seed: u64,
        device: &Device,
        dtype: DType,
    ) -> Result<Self> {
        let std = config.initializer_range();
        Self::build(
            config,
            VarMap::new(),
            (device, dtype),
            std,
            (None, Some(seed)),
        )
    }

    /// Loads a Hugging Face folder (`config.json` and `model.safetensors` or a sharded index)
    /// on `device` in `dtype` (a bf16 checkpoint into f32 parameters, or the reverse). All or
    /// nothing; errors name the file and the key or tensor. The folder's `architectures` must be
    /// one of the architecture's classes ([`Architecture::CLASSES`]) or absent, its
    /// `model_type` one of [`Architecture::MODEL_TYPES`]. A `transformers` 4-bit folder (a
    /// bitsandbytes `quantization_config` in `config.json`) loads with its 4-bit base, as
    /// [`from_pretrained_4bit`](Self::from_pretrained_4bit) reads it, `dtype` the compute dtype.
    pub fn from_pretrained(dir: impl AsRef<Path>, device: &Device, dtype: DType) -> Result<Self> {
        let dir = model_folder(dir.as_ref())?;
        Self::load(Self::read_config(dir)?, dir, device, dtype, None)
    }

    /// Loads a folder with a 4-bit base (QLoRA; `transformers`' `from_pretrained(dir,
    /// quantization_config=BitsAndBytesConfig(load_in_4bit=True, ...))`): every linear layer
    /// LoRA may target ([`Architecture::projections_mut`]; the output layer never) holds its
    /// weight in 4 bits (`accelerate_rs::nn::Linear4bit`, frozen), while the embeddings, norms,
    /// biases and the output layer are parameters in `dtype`, the compute dtype. From a float
    /// folder (bf16, f32) each weight is read in `dtype` and quantized by `quant` on load, one
    /// at a time (`Quant4bitConfig::nf4()`: QLoRA's NF4 with double quantization, bitsandbytes'
    /// bytes); a `transformers` 4-bit folder is read as saved (its `quantization_config` must
    /// agree with `quant`'s type and double quantization).
    ///
    /// Then add LoRA adapters ([`add_lora`](Self::add_lora)) and train them: the base gets no
    /// gradient. [`merge_lora`](Self::merge_lora) merges them into the dequantized base (the
    /// model is a full-precision one after); [`save_pretrained`](Self::save_pretrained) without
    /// merging writes `transformers`' 4-bit format. Not at ZeRO stage 3, nor under mixed
    /// precision's working copies ([`with_parameters`](Self::with_parameters)).
    pub fn from_pretrained_4bit(
        dir: impl AsRef<Path>,
        device: &Device,
        dtype: DType,
        quant: &Quant4bitConfig,
    ) -> Result<Self> {
        let dir = model_folder(dir.as_ref())?;
        Self::load(Self::read_config(dir)?, dir, device, dtype, Some(quant))
    }

    /// The configuration of the folder `dir`, whose `architectures` and `model_type` must be
    /// this architecture's.
    fn read_config(dir: &Path) -> Result<A::Config> {
        let (path, json) = read_json(dir)?;
        check_architecture(&path, &json, A::CLASSES)?;
        if let Some(t) = json.get("model_type").and_then(|t| t.as_str()) {
            if !A::MODEL_TYPES.contains(&t) {
                return Err(Error::config(
                    &path,
                    Some("model_type"),
                    format!(
                        "the folder holds a `{t}`; this type loads {}",
                        A::MODEL_TYPES.join(", ")
                    ),
                ));
            }
        }
        A::Config::from_json(&path, &json)
    }

    /// [`from_pretrained`](Self::from_pretrained) at `zero_stage = 3`: the parameters are
    /// sharded over the ranks of `accelerator` by the architecture's units
    /// ([`Architecture::wrap_policy`]: the embeddings, each block, the rest), and each rank
    /// reads only its 1/N of every unit from the memory-mapped files (no rank holds the whole
    /// model). Every rank calls it. Forward and backward then gather each unit for the time it
    /// runs (blocks are recomputed in the backward pass); train it with the optimizer of
    /// `accelerator.prepare_sharded_optimizer(model.sharded_parameters(), opt)`, or add LoRA
    /// adapters (the base stays sharded and frozen; the adapters train replicated, prepared as
    /// usual). `dtype` is the parameters' (f32 under mixed precision, where the units are
    /// gathered in the compute dtype). Below stage 3 an error naming `from_pretrained`.
    pub fn from_pretrained_sharded(
        dir: impl AsRef<Path>,
        accelerator: &Accelerator,
        dtype: DType,
    ) -> Result<Self> {
        let dir = model_folder(dir.as_ref())?;
        Self::load_sharded(Self::read_config(dir)?, dir, accelerator, dtype)
    }

    /// [`from_pretrained_sharded`](Self::from_pretrained_sharded) of a configuration already
    /// read from `dir`.
    pub(crate) fn load_sharded(
        config: A::Config,
        dir: &Path,
        accelerator: &Accelerator,
        dtype: DType,
    ) -> Result<Self> {
        let (path, json) = read_json(dir)?;
        if base4bit::declared(&path, &json)?.is_some() {
            return Err(Error::Accelerate(accelerate_rs::Error::invalid(
                "zero_stage",
                format!(
                    "{} holds a 4-bit model: a 4-bit base is not sharded (ZeRO-3); load it on \
                     every process with `from_pretrained` (it is frozen: only the LoRA adapters \
                     are all-reduced)",
                    dir.display()
                ),
            )));
        }
        let map = |name: &str| A::parameter_name(&config, name);
        let source = ShardSource::Files {
            path: dir,
            map: &map,
        };
        Self::sharded(&config, accelerator, dtype, source)
    }

    /// [`from_config_seeded`](Self::from_config_seeded) at `zero_stage = 3`: each rank draws
    /// one parameter at a time from `(seed, name)` and keeps its pieces (the same model at any
    /// world size).
    pub fn from_config_sharded(
        config: &A::Config,
        accelerator: &Accelerator,
        dtype: DType,
        seed: u64,
    ) -> Result<Self> {
        Self::sharded(config, accelerator, dtype, ShardSource::Seeded(seed))
    }

    fn sharded(
        config: &A::Config,
        accelerator: &Accelerator,
        dtype: DType,
        source: ShardSource<'_>,
    ) -> Result<Self> {
        let policy = A::wrap_policy(config).ok_or_else(|| {
            Error::Accelerate(accelerate_rs::Error::invalid(
                "zero_stage",
                format!(
                    "{} does not run at ZeRO stage 3 yet: use stage 0-2",
                    A::CLASSES[0]
                ),
            ))
        })?;
        let std = config.initializer_range();
        let build = |vb: VarBuilder<'_>| A::assemble(config, vb, std).map(drop);
        let model = accelerator.shard_model(&policy, dtype, &build, source)?;
        let device = accelerator.device();
        let (vb, _) = accelerate_rs::shape_only_var_builder(dtype, device);
        Ok(Pretrained {
            config: config.clone(),
            layers: A::assemble(config, vb, 0.0)?,
            weights: Weights::sharded(model, dtype, device),
        })
    }

    /// ZeRO-3: the sharded parameters, when the model was made sharded
    /// ([`from_pretrained_sharded`](Self::from_pretrained_sharded)); give them to
    /// `accelerator.prepare_sharded_optimizer`, `save_state` and `save_model_with_config`.
    pub fn sharded_parameters(&self) -> Option<&ShardedModel> {
        self.weights.sharded.as_ref()
    }

    /// Builds from `config` (nothing allocated until the weight files' headers and the machine
    /// are checked) and loads the weights at `dir` into it; with a 4-bit base when `quant` is
    /// given or the folder is a `transformers` 4-bit one.
    pub(crate) fn load(
        config: A::Config,
        dir: &Path,
        device: &Device,
        dtype: DType,
        quant: Option<&Quant4bitConfig>,
    ) -> Result<Self> {
        let (path, json) = read_json(dir)?;
        let quant = match (base4bit::declared(&path, &json)?, quant) {
            (Some(saved), Some(asked))
                if (saved.quant_type, saved.double_quant)
                    != (asked.quant_type, asked.double_quant) =>
            {
                return Err(Error::config(
                    &path,
                    Some("quantization_config"),
                    format!(
                        "the folder is quantized {} (double quantization {}); {} ({}) was asked",
                        saved.quant_type.name(),
                        saved.double_quant,
                        asked.quant_type.name(),
                        asked.double_quant
                    ),
                ))
            }
            (saved, asked) => asked.copied().or(saved),
        };
        let map = |name: &str| A::parameter_name(&config, name);
        let base4 = match quant {
            Some(q) => {
                q.check()?;
                let targets = Self::targets(&config)?;
                Some(Arc::new(base4bit::read(dir, &targets, &map, dtype, &q)?))
            }
            None => None,
        };
        let skip = |name: &str| match &base4 {
            Some(b) => base4bit::skipping(b, &map)(name),
            None => map(name),
        };
        let source = (Some((dir, &skip as &dyn Fn(&str) -> Option<String>)), None);
        let model = Self::build_over(
            &config,
            VarMap::new(),
            (device, dtype),
            0.0,
            source,
            base4.clone(),
        )?;
        model.weights.load(dir, skip)?;
        Ok(model)
    }

    /// The linear layers a 4-bit base quantizes: every one LoRA may target, from a dry run of
    /// the layers' constructor (nothing allocated).
    fn targets(config: &A::Config) -> Result<Vec<Target>> {
        let (vb, _) = accelerate_rs::shape_only_var_builder(DType::F32, &Device::Cpu);
        let mut layers = A::assemble(config, vb, 0.0)?;
        let targets = layers
            .projections_mut()
            .into_iter()
            .map(|p| Target {
                path: p.path().to_string(),
                fan_in_fan_out: p.is_fan_in_fan_out(),
            })
            .collect();
        Ok(targets)
    }

    /// The configuration.
    pub fn config(&self) -> &A::Config {
        &self.config
    }

    /// The layers (the architecture's own methods, such as a mixture of experts' routing
    /// statistics).
    pub fn layers(&self) -> &A {
        &self.layers
    }

    /// What `loss` computes.
    pub fn task(&self) -> Task {
        A::TASK
    }

    /// The parameters, by their Hugging Face names: what
    /// `accelerate_rs::Accelerator::prepare` (or `prepare_model`) and the optimizer take.
    pub fn varmap(&self) -> &VarMap {
        &self.weights.varmap
    }

    /// The same model over `varmap`, which holds every parameter of this one under its name,
    /// all in one float dtype: the working copies that `accelerate_rs::Accelerator::prepare_mixed`
    /// returns. For mixed precision this model keeps the f32 masters (prepared, stepped, saved)
    /// and the returned one, in the compute dtype, runs forward and backward; training mode and
    /// activation checkpointing are carried over. A parameter `varmap` lacks is an error naming
    /// it. Not for a model with LoRA adapters (train the adapters in f32 over a bf16 base
    /// instead).
    pub fn with_parameters(&self, varmap: &VarMap) -> Result<Self> {
        if self.weights.base4.is_some() {
            return Err(Error::Accelerate(accelerate_rs::Error::invalid(
                "with_parameters",
                "the model has a 4-bit base: load it in the compute dtype and train LoRA \
                 adapters (in f32) instead of mixed-precision working copies",
            )));
        }
        let dtype = parameters_dtype(varmap, self.weights.adapters.is_some())?;
        let device = self.weights.device.clone();
        let mut model = Self::build(
            &self.config,
            varmap.clone(),
            (&device, dtype),
            0.0,
            (None, None),
        )?;
        model.weights.training = self.weights.training;
        model.weights.checkpointing = self.weights.checkpointing;
        model.weights.attention = self.weights.attention;
        Ok(model)
    }

    /// The dtype of the parameters.
    pub fn dtype(&self) -> DType {
        self.weights.dtype
    }

    /// The configuration as `config.json` (unknown keys of the loaded file kept,
    /// `architectures` and `dtype` set).
    pub fn config_json(&self) -> serde_json::Value {
        let mut json = to_config_json(
            self.config.to_json(),
            A::class_name(&self.config),
            self.weights.dtype,
        );
        if let Some(map) = json.as_object_mut() {
            match &self.weights.base4 {
                Some(base) => {
                    let q = base.quantization_config(self.weights.dtype);
                    map.insert("quantization_config".into(), q);
                }
                None => {
                    map.remove("quantization_config");
                }
            }
        }
        json
    }

    /// The 4-bit base's bytes (codes, scales, maps) and elements, when the model has one
    /// ([`from_pretrained_4bit`](Self::from_pretrained_4bit)).
    pub fn base_4bit_size(&self) -> Option<(usize, usize)> {
        self.weights
            .base4
            .as_ref()
            .map(|b| (b.nbytes(), b.elem_count()))
    }

    /// Writes a folder `transformers`' `from_pretrained` loads: `config.json` and
    /// `model.safetensors` (sharded above 5 GB), written into `<dir>.tmp-<pid>` and then moved
    /// into `dir`, whose other files (a tokenizer, a README) stay. With LoRA adapters it writes
    /// the base weights as they are (call [`merge_lora`](Self::merge_lora) first for merged
    /// weights, or [`save_adapter`](Self::save_adapter) for the adapters). Call it on one
    /// process (`accelerator.is_main_process()`), or on every rank use
    /// `accelerator.save_model_with_config(dir, model.varmap(), &model.config_json(), max)`.
    pub fn save_pretrained(&self, dir: impl AsRef<Path>) -> Result<()> {
        self.save_pretrained_sharded(dir, DEFAULT_MAX_SHARD_BYTES)
    }

    /// [`save_pretrained`](Self::save_pretrained) with shards of at most `max_shard_bytes`
    /// (`model-0000i-of-0000n.safetensors` and `model.safetensors.index.json` when the weights
    /// do not fit in one).
    pub fn save_pretrained_sharded(
        &self,
        dir: impl AsRef<Path>,
        max_shard_bytes: usize,
    ) -> Result<()> {
        self.weights
            .save(dir.as_ref(), &self.config_json(), max_shard_bytes)
    }

    /// Training mode on or off (PyTorch's `model.train()` / `model.eval()`): dropout applies in
    /// training mode only. Off after loading, as in `transformers`.
    pub fn train(&mut self, on: bool) {
        self.weights.training = on;
    }

    /// Whether dropout applies ([`train`](Self::train)).
    pub fn is_training(&self) -> bool {
        self.weights.training
    }

    /// Activation checkpointing on or off (`transformers`' `gradient_checkpointing_enable()`):
    /// every block runs through `accelerate_rs::nn::checkpoint_fn`, so its activations are
    /// recomputed in the backward pass instead of kept (about one more forward pass per step,
    /// for the memory of all but the blocks' inputs). The gradients are the same as without,
    /// bit for bit on the CPU (dropout included: the recomputation replays the masks). Compute
    /// them through the accelerator (`backward_step`, `accelerator.backward`) or
    /// `accelerate_rs::nn::backward`, not `loss.backward()`.
    pub fn set_gradient_checkpointing(&mut self, on: bool) {
        self.weights.checkpointing = on;
    }

    /// Whether activation checkpointing is on.
    pub fn is_gradient_checkpointing(&self) -> bool {
        self.weights.checkpointing
    }

    /// Adds LoRA adapters (PEFT's `get_peft_model`) to the linear layers `config` targets (by
    /// module path, PEFT's rules; no targets given: PEFT's default for the architecture,
    /// [`Architecture::LORA_TARGETS`]). The output layer is never targeted. From then on the
    /// base parameters are frozen (no gradient is computed for them) and
    /// [`trainable_parameters`](Self::trainable_parameters) is the adapters: give that to the
    /// optimizer and to `Accelerator::prepare`, so that only the adapters are stepped and
    /// all-reduced. Adapters are f32 on an f16/bf16 base unless `config` says otherwise. An
    /// error if the model already has adapters or nothing matches.
    pub fn add_lora(&mut self, config: &LoraConfig) -> Result<()> {
        lora::add_lora(self, config)
    }

    /// Loads a PEFT adapter folder (`adapter_config.json`, `adapter_model.safetensors`, as
    /// `peft`'s `save_pretrained` writes it) onto the model: [`add_lora`](Self::add_lora) with
    /// its settings, then its tensors, all or nothing.
    pub fn load_adapter(&mut self, dir: impl AsRef<Path>) -> Result<()> {
        lora::load(self, dir.as_ref())
    }

    /// Writes the adapters as a PEFT adapter folder that `peft`'s
    /// `PeftModel.from_pretrained(base, dir)` loads (one process;
    /// `accelerator.is_main_process()`).
    pub fn save_adapter(&self, dir: impl AsRef<Path>) -> Result<()> {
        lora::save(self, dir.as_ref())
    }

    /// Merges the adapters into the base weights (`W + s · B A`, PEFT's `merge_and_unload`) and
    /// drops them: [`save_pretrained`](Self::save_pretrained) then writes a plain Hugging Face
    /// folder, and every parameter trains again.
    pub fn merge_lora(&mut self) -> Result<()> {
        lora::merge(self)
    }

    /// The adapters' settings, when the model has adapters.
    pub fn lora_config(&self) -> Option<&LoraConfig> {
        self.weights.adapters.as_ref().map(|a| &a.config)
    }

    /// What trains: the adapters (`<module path>.lora_A.weight`, ...) when the model has them,
    /// else every parameter ([`varmap`](Self::varmap)). Give it to the optimizer and to
    /// `Accelerator::prepare`.
    pub fn trainable_parameters(&self) -> &VarMap {
        lora::trainable(&self.weights)
    }

    /// How the forward pass runs now (training mode, activation checkpointing).
    pub fn mode(&self) -> Mode {
        Mode {
            training: self.weights.training,
            checkpointing: self.weights.checkpointing,
            attention: self.weights.attention,
        }
    }

    /// Which attention the layers run (see [`AttentionBackend`]): `Auto` after loading (tiled
    /// flash attention on the CPU where a layer's options allow it), `Composed` for the
    /// reference path.
    pub fn set_attention_backend(&mut self, backend: AttentionBackend) {
        self.weights.attention = backend;
    }

    /// Which attention the layers run.
    pub fn attention_backend(&self) -> AttentionBackend {
        self.weights.attention
    }

    /// The layers' output for `inputs` (see [`Architecture::hidden_states`]).
    pub fn hidden(&self, inputs: &Inputs<'_>) -> candle_core::Result<Hidden> {
        match &self.weights.sharded {
            Some(model) => {
                let run = ShardedRun {
                    model: model.clone(),
                    adapters: self.weights.adapters.clone(),
                    dtype: self.weights.dtype,
                };
                self.layers.hidden_states_sharded(inputs, self.mode(), &run)
            }
            None => self.layers.hidden_states(inputs, self.mode()),
        }
    }

    /// The final hidden states `[B, T, hidden]` (after the last norm, before the head) of
    /// `input_ids` `[B, T]` (integer ids), with an optional `attention_mask` `[B, T]` (1 for a
    /// token, 0 for padding: no query sees a padding key). Positions are `0..T` whatever the
    /// mask, as in `transformers`' forward.
    pub fn hidden_states(
        &self,
        input_ids: &Tensor,
        attention_mask: Option<&Tensor>,
    ) -> candle_core::Result<Tensor> {
        let inputs = Inputs::new(input_ids).attention_mask(attention_mask);
        Ok(self.hidden(&inputs)?.states)
    }

    /// The logits: `[B, T, vocab]` for a language model (every position), `[B, num_labels]` for
    /// a sequence classifier.
    pub fn forward(
        &self,
        input_ids: &Tensor,
        attention_mask: Option<&Tensor>,
    ) -> candle_core::Result<Tensor> {
        self.forward_with(&Inputs::new(input_ids).attention_mask(attention_mask))
    }

    /// [`forward`](Self::forward) with every input the architecture takes (segment ids for
    /// BERT).
    pub fn forward_with(&self, inputs: &Inputs<'_>) -> candle_core::Result<Tensor> {
        let hidden = self.hidden(inputs)?;
        self.layers.logits(&hidden, self.mode())
    }

    /// The task's loss (see [`Task`]): for a causal language model, `labels` `[B, T]` (usually
    /// the input ids; -100 where nothing is to be predicted) are shifted here, as `transformers`
    /// does, and the mean is over the labels that are not -100 (the output layer and the
    /// cross-entropy one fused op); a mixture of experts adds its load-balancing loss when its
    /// configuration asks for it (`output_router_logits`).
    pub fn loss(&self, input_ids: &Tensor, labels: &Tensor) -> candle_core::Result<Tensor> {
        self.loss_with_mask(input_ids, None, labels)
    }

    /// [`loss`](Self::loss) with an attention mask (give padding positions the label -100).
    pub fn loss_with_mask(
        &self,
        input_ids: &Tensor,
        attention_mask: Option<&Tensor>,
        labels: &Tensor,
    ) -> candle_core::Result<Tensor> {
        self.loss_with(
            &Inputs::new(input_ids).attention_mask(attention_mask),
            labels,
        )
    }

    /// [`loss`](Self::loss) with every input the architecture takes.
    pub fn loss_with(&self, inputs: &Inputs<'_>, labels: &Tensor) -> candle_core::Result<Tensor> {
        let hidden = self.hidden(inputs)?;
        self.layers.loss(&hidden, labels, self.mode())
    }

    /// Generates from `prompts` (token ids; batched with left padding): the new tokens of each
    /// prompt, at most `config.max_new_tokens`, a stop token included as the last (see
    /// [`GenerationConfig`] and the [`generate`](crate::generate) module). Runs in evaluation
    /// mode (no dropout, whatever [`train`](Self::train) says) with a key/value cache, keeping
    /// no autograd graph; LoRA adapters apply. An error for an architecture that does not
    /// generate, for a model sharded at ZeRO stage 3, for bad settings or prompts, and for
    /// logits no token can be picked from (NaN or +inf: the activations overflowed).
    pub fn generate(
        &self,
        prompts: &[Vec<u32>],
        config: &GenerationConfig,
    ) -> Result<Vec<Vec<u32>>> {
        if A::TASK != Task::CausalLm || self.weights.sharded.is_some() {
            return Err(Error::Generation {
                what: "model".into(),
                reason: format!(
                    "{} generates only as a causal language model with its parameters on this \
                     process (not sharded at ZeRO stage 3)",
                    A::class_name(&self.config)
                ),
            });
        }
        let decode = |inputs: &generate::DecodeInputs<'_>, cache: &mut generate::KvCache| {
            self.layers.decode(inputs, cache)
        };
        generate::generate(&decode, &self.weights.device, prompts, config)
    }

    /// Floating-point operations per trained token of a forward and backward pass over windows
    /// of `seq_len` tokens (model FLOPs, the PaLM paper's convention, for
    /// `StepTimer::flops_per_step` and a FLOP/s or MFU figure): 2 per parameter forward, 2 per
    /// parameter for the gradient of the activations, 2 per *trained* parameter for the weight
    /// gradients (6 per parameter when every parameter trains; about 4 with LoRA, whose frozen
    /// base gets no weight gradient), plus attention's score and value products,
    /// `12 x layers x seq_len x hidden` (all of them, although a causal mask makes half
    /// unnecessary). Embedding lookups count as products (a small overestimate); activation
    /// checkpointing's recomputation is not counted; a mixture of experts counts every
    /// expert's parameters (an overestimate: each token runs `top_k` of them). At ZeRO stage 3
    /// the parameters are counted from their shapes (no rank holds them whole): the same figure
    /// as at every other stage.
    pub fn flops_per_token(&self, seq_len: usize) -> f64 {
        let count =
            |m: &VarMap| -> f64 { m.all_vars().iter().map(|v| v.elem_count() as f64).sum() };
        // At stage 3 no rank holds the parameters whole: their shapes say how many there are.
        let base = match self.sharded_parameters().filter(|s| s.is_sharded()) {
            Some(s) => s
                .parameter_specs()
                .iter()
                .map(|p| p.shape.iter().product::<usize>() as f64)
                .sum(),
            None => count(self.varmap()),
        };
        let quantized = self.base_4bit_size().map_or(0.0, |(_, n)| n as f64);
        let (all, trained) = if self.lora_config().is_some() {
            let adapters = count(self.trainable_parameters());
            (base + quantized + adapters, adapters)
        } else {
            (base, base)
        };
        let p = A::memory_profile(&self.config);
        4.0 * all + 2.0 * trained + 12.0 * p.layers as f64 * seq_len as f64 * p.hidden as f64
    }

    /// The architecture of `config` as `estimate-memory` sees it
    /// (`accelerate_rs::memory::estimate`): its sizes and activations per token
    /// ([`Architecture::memory_profile`]), its parameters (names and shapes, from a dry run of
    /// the layers' constructor: nothing is allocated) and `peft`'s default LoRA targets.
    pub fn memory_architecture(config: &A::Config) -> Result<accelerate_rs::memory::Architecture> {
        let (vb, shapes) = accelerate_rs::shape_only_var_builder(DType::F32, &Device::Cpu);
        A::assemble(config, vb, 0.0)?;
        let p = A::memory_profile(config);
        let parameters = shapes
            .specs()
            .into_iter()
            .map(|s| accelerate_rs::memory::TensorInfo {
                name: s.name,
                shape: s.shape,
                dtype: "F32".into(),
            })
            .collect();
        Ok(accelerate_rs::memory::Architecture {
            name: config.model_type().to_string(),
            hidden: p.hidden,
            intermediate: p.intermediate,
            layers: p.layers,
            heads: p.heads,
            kv_heads: p.kv_heads,
            head_dim: p.head_dim,
            vocab: p.vocab,
            max_positions: p.max_positions,
            block_elements: p.block_elements,
            outer_elements: p.outer_elements,
            lm_head: p.lm_head,
            default_lora_targets: A::lora_targets(config)
                .iter()
                .map(|s| s.to_string())
                .collect(),
            parameters,
        })
    }
}

impl<A: Architecture> Adaptable for Pretrained<A> {
    fn weights(&self) -> &Weights {
        &self.weights
    }

    fn weights_mut(&mut self) -> &mut Weights {
        &mut self.weights
    }

    fn projections_mut(&mut self) -> Vec<&mut Proj> {
        self.layers.projections_mut()
    }

    fn rebuild(&self, frozen: bool) -> Result<Self> {
        self.rebuilt(frozen)
    }

    fn default_targets(&self) -> &'static [&'static str] {
        A::lora_targets(&self.config)
    }

    fn task_type(&self) -> Option<&'static str> {
        A::PEFT_TASK_TYPE
    }

    fn config_path(&self) -> &Path {
        self.config.path()
    }
}

/// Any [`Pretrained<A>`] behind one object-safe interface: what `AutoModel` holds, so that
/// adding an architecture adds no match arm anywhere.
pub(crate) trait DynModel: std::fmt::Debug + Send + Sync {
    fn clone_box(&self) -> Box<dyn DynModel>;
    fn as_any(&self) -> &dyn Any;
    fn as_any_mut(&mut self) -> &mut dyn Any;
    fn task(&self) -> Task;
    fn model_type(&self) -> &str;
    fn dtype(&self) -> DType;
    fn forward_with(&self, inputs: &Inputs<'_>) -> candle_core::Result<Tensor>;
    fn loss_with(&self, inputs: &Inputs<'_>, labels: &Tensor) -> candle_core::Result<Tensor>;
    fn varmap(&self) -> &VarMap;
    fn with_parameters(&self, varmap: &VarMap) -> Result<Box<dyn DynModel>>;
    fn config_json(&self) -> serde_json::Value;
    fn save_pretrained_sharded(&self, dir: &Path, max_shard_bytes: usize) -> Result<()>;
    fn train(&mut self, on: bool);
    fn is_training(&self) -> bool;
    fn set_gradient_checkpointing(&mut self, on: bool);
    fn is_gradient_checkpointing(&self) -> bool;
    fn set_attention_backend(&mut self, backend: AttentionBackend);
    fn attention_backend(&self) -> AttentionBackend;
    fn add_lora(&mut self, config: &LoraConfig) -> Result<()>;
    fn load_adapter(&mut self, dir: &Path) -> Result<()>;
    fn save_adapter(&self, dir: &Path) -> Result<()>;
    fn merge_lora(&mut self) -> Result<()>;
    fn lora_config(&self) -> Option<&LoraConfig>;
    fn trainable_parameters(&self) -> &VarMap;
    fn flops_per_token(&self, seq_len: usize) -> f64;
    fn memory_architecture(&self) -> Result<accelerate_rs::memory::Architecture>;
    fn sharded_parameters(&self) -> Option<&ShardedModel>;
    fn generate(&self, prompts: &[Vec<u32>], config: &GenerationConfig) -> Result<Vec<Vec<u32>>>;
    fn base_4bit_size(&self) -> Option<(usize, usize)>;
}

impl<A: Architecture> DynModel for Pretrained<A> {
    fn clone_box(&self) -> Box<dyn DynModel> {
        Box::new(self.clone())
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
    fn task(&self) -> Task {
        A::TASK
    }
    fn model_type(&self) -> &str {
        self.config.model_type()
    }
    fn dtype(&self) -> DType {
        self.weights.dtype
    }
    fn forward_with(&self, inputs: &Inputs<'_>) -> candle_core::Result<Tensor> {
        Pretrained::forward_with(self, inputs)
    }
    fn loss_with(&self, inputs: &Inputs<'_>, labels: &Tensor) -> candle_core::Result<Tensor> {
        Pretrained::loss_with(self, inputs, labels)
    }
    fn varmap(&self) -> &VarMap {
        Pretrained::varmap(self)
    }
    fn with_parameters(&self, varmap: &VarMap) -> Result<Box<dyn DynModel>> {
        Ok(Box::new(Pretrained::with_parameters(self, varmap)?))
    }
    fn config_json(&self) -> serde_json::Value {
        Pretrained::config_json(self)
    }
    fn save_pretrained_sharded(&self, dir: &Path, max_shard_bytes: usize) -> Result<()> {
        Pretrained::save_pretrained_sharded(self, dir, max_shard_bytes)
    }
    fn train(&mut self, on: bool) {
        Pretrained::train(self, on)
    }
    fn is_training(&self) -> bool {
        Pretrained::is_training(self)
    }
    fn set_gradient_checkpointing(&mut self, on: bool) {
        Pretrained::set_gradient_checkpointing(self, on)
    }
    fn is_gradient_checkpointing(&self) -> bool {
        Pretrained::is_gradient_checkpointing(self)
    }
    fn set_attention_backend(&mut self, backend: AttentionBackend) {
        Pretrained::set_attention_backend(self, backend)
    }
    fn attention_backend(&self) -> AttentionBackend {
        Pretrained::attention_backend(self)
    }
    fn add_lora(&mut self, config: &LoraConfig) -> Result<()> {
        Pretrained::add_lora(self, config)
    }
    fn load_adapter(&mut self, dir: &Path) -> Result<()> {
        Pretrained::load_adapter(self, dir)
    }
    fn save_adapter(&self, dir: &Path) -> Result<()> {
        Pretrained::save_adapter(self, dir)
    }
    fn merge_lora(&mut self) -> Result<()> {
        Pretrained::merge_lora(self)
    }
    fn lora_config(&self) -> Option<&LoraConfig> {
        Pretrained::lora_config(self)
    }
    fn trainable_parameters(&self) -> &VarMap {
        Pretrained::trainable_parameters(self)
    }
    fn flops_per_token(&self, seq_len: usize) -> f64 {
        Pretrained::flops_per_token(self, seq_len)
    }
    fn memory_architecture(&self) -> Result<accelerate_rs::memory::Architecture> {
        Self::memory_architecture(&self.config)
    }
    fn sharded_parameters(&self) -> Option<&ShardedModel> {
        Pretrained::sharded_parameters(self)
    }
    fn generate(&self, prompts: &[Vec<u32>], config: &GenerationConfig) -> Result<Vec<Vec<u32>>> {
        Pretrained::generate(self, prompts, config)
    }
    fn base_4bit_size(&self) -> Option<(usize, usize)> {
        Pretrained::base_4bit_size(self)
    }
}

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

/// Puts the 4-bit weights of `base` on `layers`' linear layers it quantized.
fn attach_4bit<A: Architecture>(
    layers: &mut A,
    base: Option<&Base4bit>,
) -> candle_core::Result<()> {
    let Some(base) = base else { return Ok(()) };
    for p in layers.projections_mut() {
        if let Some(q) = base.layer(p.path()) {
            p.set_4bit(q.clone())?;
        }
    }
    Ok(())
}
