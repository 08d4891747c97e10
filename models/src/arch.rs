//! The contract every architecture of this crate fulfils: [`Architecture`] (the layers, how
//! they are assembled from a `VarBuilder`, the forward pass, the class names, the default LoRA
//! targets, the memory profile) and [`ModelConfig`] (its `config.json`).
//! [`Pretrained<A>`](crate::Pretrained) holds everything shared once (loading and saving
//! folders, training mode, activation checkpointing, LoRA, mixed precision), so that an
//! architecture is one file implementing these two traits plus one line of the registry (see
//! ARCHITECTURE.md, "Add an architecture").

use std::any::Any;
use std::path::Path;
use std::sync::Arc;

use accelerate_rs::{ShardedModel, WrapPolicy};
use candle_core::{DType, Device, Result, Tensor};
use candle_nn::VarBuilder;

use crate::generate::{DecodeInputs, KvCache};
pub use crate::layers::AttentionBackend;
pub use crate::lora::Proj;
use crate::weights::Adapters;

/// What a model is trained to do (which loss `loss` computes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Task {
    /// Next-token prediction (labels shifted inside `loss`).
    CausalLm,
    /// Masked tokens (labels -100 except at masked positions; no shift).
    MaskedLm,
    /// One label per sequence.
    SequenceClassification,
}

/// A `config.json` of one architecture, parsed and checked.
pub trait ModelConfig: Clone + std::fmt::Debug + Send + Sync + 'static {
    /// Parses and checks `json`, read from `path` (named in errors with the offending key). An
    /// unknown `model_type`, a missing size or a value out of range is an error.
    fn from_json(path: &Path, json: &serde_json::Value) -> crate::Result<Self>;

    /// The configuration as `config.json` holds it: every key of the file it was read from
    /// (unknown ones too), `model_type` set; `architectures` and `dtype` are added by
    /// `save_pretrained`.
    fn to_json(&self) -> serde_json::Value;

    /// The file it was read from (empty for a configuration built in code).
    fn path(&self) -> &Path;

    /// Its `model_type`.
    fn model_type(&self) -> &str;

    /// The standard deviation of fresh weights (`initializer_range`).
    fn initializer_range(&self) -> f64;
}

/// What a forward pass is given: the token ids and what else the architecture takes. Built with
/// [`Inputs::new`] and the setters; more inputs are added as new setters, so code written
/// against it keeps compiling.
///
/// Packed rows (several documents in one row, [`chat::Packer`](crate::chat::Packer)): give
/// [`position_ids`](Self::position_ids) restarting at each document and
/// [`document_ids`](Self::document_ids); every causal architecture then runs each document as
/// if it were alone (its positions, block-diagonal causal attention). BERT refuses documents.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct Inputs<'a> {
    /// `[B, T]` integer token ids.
    pub input_ids: &'a Tensor,
    /// `[B, T]`: 1 for a token, 0 for padding (no query sees a padding key).
    pub attention_mask: Option<&'a Tensor>,
    /// `[B, T]` segment ids (BERT); architectures without token types ignore them.
    pub token_type_ids: Option<&'a Tensor>,
    /// `[B, T]` integer positions (RoPE angles, learned position embeddings); `None`: `0..T` in
    /// every row, as `transformers` defaults them.
    pub position_ids: Option<&'a Tensor>,
    /// `[B, T]` integer document ids: a token attends to the tokens of its own document only
    /// (with the causal mask: block-diagonal causal attention); `None`: one document per row.
    pub document_ids: Option<&'a Tensor>,
}

impl<'a> Inputs<'a> {
    /// The token ids alone.
    pub fn new(input_ids: &'a Tensor) -> Self {
        Inputs {
            input_ids,
            attention_mask: None,
            token_type_ids: None,
            position_ids: None,
            document_ids: None,
        }
    }

    /// With an attention (padding) mask.
    pub fn attention_mask(mut self, mask: Option<&'a Tensor>) -> Self {
        self.attention_mask = mask;
        self
    }

    /// With segment ids.
    pub fn token_type_ids(mut self, ids: Option<&'a Tensor>) -> Self {
        self.token_type_ids = ids;
        self
    }

    /// With position ids `[B, T]` (see [`Inputs::position_ids`](Self#structfield.position_ids)).
    pub fn position_ids(mut self, ids: Option<&'a Tensor>) -> Self {
        self.position_ids = ids;
        self
    }

    /// With document ids `[B, T]` (see [`Inputs::document_ids`](Self#structfield.document_ids)).
    pub fn document_ids(mut self, ids: Option<&'a Tensor>) -> Self {
        self.document_ids = ids;
        self
    }
}

/// How a forward pass runs: training mode (dropout applies) and activation checkpointing (every
/// block through `accelerate_rs::nn::checkpoint_fn`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Mode {
    /// Dropout applies.
    pub training: bool,
    /// Every block recomputes its activations in the backward pass.
    pub checkpointing: bool,
    /// Which attention runs.
    pub attention: AttentionBackend,
}

/// The output of the layers, before the head: the hidden states and, for a mixture of experts
/// that reports its router logits, the auxiliary loss the head's loss adds.
#[derive(Debug, Clone)]
pub struct Hidden {
    /// `[B, T, C]` (after the last norm).
    pub states: Tensor,
    /// A scalar added to the task's loss (`router_aux_loss_coef` times the load-balancing
    /// loss), when the architecture has one.
    pub aux_loss: Option<Tensor>,
    /// ZeRO-3: the head built from its gathered unit (the head of the layers is then a
    /// shape-only placeholder), of the type the architecture chose (see
    /// [`gathered_head`](Self::gathered_head)).
    pub(crate) head: Option<Arc<dyn Any + Send + Sync>>,
}

impl Hidden {
    /// Hidden states without an auxiliary loss.
    pub fn new(states: Tensor) -> Self {
        Hidden {
            states,
            aux_loss: None,
            head: None,
        }
    }

    /// With an auxiliary loss.
    pub fn aux_loss(mut self, aux_loss: Option<Tensor>) -> Self {
        self.aux_loss = aux_loss;
        self
    }

    /// ZeRO-3: with the head built from its gathered unit (the architecture's own type: the
    /// output layer of a decoder, BERT's masked-LM head, ...).
    pub(crate) fn with_head<T: Any + Send + Sync>(mut self, head: T) -> Self {
        self.head = Some(Arc::new(head));
        self
    }

    /// ZeRO-3: the head [`with_head`](Self::with_head) put here, if any; an error naming both
    /// types if it is not a `T` (hidden states of another architecture).
    pub(crate) fn gathered_head<T: Any>(&self) -> Result<Option<&T>> {
        match &self.head {
            None => Ok(None),
            Some(head) => head.downcast_ref::<T>().map(Some).ok_or_else(|| {
                candle_core::Error::Msg(format!(
                    "these hidden states carry a head gathered by another architecture (not a \
                     {})",
                    std::any::type_name::<T>()
                ))
            }),
        }
    }

    /// `loss` plus the auxiliary loss, if any.
    pub fn with_aux(&self, loss: Tensor) -> Result<Tensor> {
        match &self.aux_loss {
            Some(aux) => {
                let aux = aux.to_dtype(loss.dtype())?;
                loss + aux
            }
            None => Ok(loss),
        }
    }
}

/// ZeRO-3: what a forward pass over sharded parameters needs besides its inputs (made by
/// [`Pretrained`](crate::Pretrained) for a model loaded with `from_pretrained_sharded` or
/// `from_config_sharded`): the sharded parameters, the LoRA adapters trained beside them, and
/// the parameters' dtype.
#[derive(Debug, Clone)]
pub struct ShardedRun {
    pub(crate) model: ShardedModel,
    pub(crate) adapters: Option<Adapters>,
    pub(crate) dtype: DType,
}

impl ShardedRun {
    /// The parameters of `unit`, gathered and held until the backward pass ends (see
    /// `ShardedModel::gather`), as a `VarBuilder` at the root (full names).
    pub(crate) fn gather(&self, unit: &str) -> Result<VarBuilder<'static>> {
        Ok(self.model.gather(unit)?)
    }

    /// Puts the LoRA adapters, if any, on `projections`, those of a layer just built from a
    /// gathered unit (as `add_lora` put them on the whole model's).
    pub(crate) fn attach(&self, projections: Vec<&mut Proj>, device: &Device) -> Result<()> {
        match &self.adapters {
            Some(a) => crate::lora::attach(projections, a, self.dtype, device),
            None => Ok(()),
        }
    }

    /// One block on `x` through `ShardedModel::run` (gathered for the call, recomputed in the
    /// backward pass, its gradients reduce-scattered right after): `build` makes it from the
    /// gathered unit `unit` (a `VarBuilder` at the root), the LoRA adapters go on the
    /// projections `projections` lists, and `forward` runs it. Whatever the block reads besides
    /// `x` (masks, RoPE tables) is moved into `forward`.
    pub(crate) fn run_block<B: 'static>(
        &self,
        unit: &str,
        x: &Tensor,
        build: impl Fn(VarBuilder<'static>) -> Result<B> + Send + Sync + 'static,
        projections: fn(&mut B) -> Vec<&mut Proj>,
        forward: impl Fn(&B, &Tensor) -> Result<Tensor> + Send + Sync + 'static,
    ) -> Result<Tensor> {
        let run = self.clone();
        Ok(self.model.run(unit, x, move |vb, x| {
            let mut block = build(vb)?;
            run.attach(projections(&mut block), x.device())?;
            forward(&block, x)
        })?)
    }
}

/// What `estimate-memory` needs to know about an architecture beyond its parameters (which come
/// from the layers themselves, or from the weight files' headers): sizes, and what the backward
/// pass keeps per token, counted as `accelerate_rs::nn`'s layers keep it. Converted into
/// `accelerate_rs::memory::Architecture` by [`Pretrained::memory_architecture`](crate::Pretrained::memory_architecture).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemoryProfile {
    /// Width of the residual stream.
    pub hidden: usize,
    /// Width of the widest per-token branch (the MLP's inner width).
    pub intermediate: usize,
    /// Blocks.
    pub layers: usize,
    /// Query heads (the attention weights kept are heads × keys per query).
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
    /// Vocabulary size.
    pub vocab: usize,
    /// Longest sequence (the default sequence length of an estimate).
    pub max_positions: usize,
    /// Elements one block keeps per token for the backward pass, in the compute dtype (the
    /// attention weights apart).
    pub block_elements: u64,
    /// Elements kept per token outside the blocks (embeddings, final norm).
    pub outer_elements: u64,
    /// Whether the model ends in a vocabulary-sized output layer whose logits are kept.
    pub lm_head: bool,
}

/// One architecture: its layers (the implementing type), its configuration, its names in
/// `transformers` and in `peft`, how it is assembled and how it runs. The compiler checks that an
/// architecture gives all of it; [`Pretrained<A>`](crate::Pretrained) adds loading, saving,
/// LoRA, activation checkpointing and mixed precision on top, the same for every architecture.
///
/// Parameters are fetched from the `VarBuilder` under the names `transformers` saves them with
/// (`model.layers.0.self_attn.q_proj.weight`), with `transformers`' initializers (for
/// `from_config`; `init_std` 0 when the values are about to be loaded). Linear layers are
/// [`Proj`]s, listed by [`projections_mut`](Self::projections_mut), so that LoRA can adapt
/// them. The forward pass takes [`Inputs`] (new kinds of inputs, such as position ids for
/// packed sequences, arrive as new fields there) and a [`Mode`].
pub trait Architecture: Clone + std::fmt::Debug + Send + Sync + Sized + 'static {
    /// Its `config.json`.
    type Config: ModelConfig;

    /// The `model_type` values it reads.
    const MODEL_TYPES: &'static [&'static str];

    /// The `transformers` classes (`architectures[0]` of `config.json`) it loads; the first is
    /// the default one, written by `save_pretrained` unless [`class_name`](Self::class_name)
    /// says otherwise.
    const CLASSES: &'static [&'static str];

    /// What its `loss` computes.
    const TASK: Task;

    /// `peft`'s default LoRA target modules for it
    /// (`TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING`).
    const LORA_TARGETS: &'static [&'static str];

    /// `peft`'s `task_type` for an adapter of it (`CAUSAL_LM`), or `None` where `peft`'s
    /// would add modules this crate does not adapt (a classifier head).
    const PEFT_TASK_TYPE: Option<&'static str>;

    /// The class `save_pretrained` writes in `architectures` for `config`.
    fn class_name(config: &Self::Config) -> &'static str {
        let _ = config;
        Self::CLASSES[0]
    }

    /// `peft`'s default LoRA target modules for `config` (by default [`LORA_TARGETS`](Self::LORA_TARGETS);
    /// a family whose members `peft` treats apart says so here). Empty: `peft` has none, and
    /// `add_lora` asks for target modules.
    fn lora_targets(config: &Self::Config) -> &'static [&'static str] {
        let _ = config;
        Self::LORA_TARGETS
    }

    /// The parameter a tensor of a checkpoint's weight files is loaded into (its name, or
    /// another for older layouts), or `None` to skip it (buffers, tied copies, heads this class
    /// has not).
    fn parameter_name(config: &Self::Config, tensor: &str) -> Option<String> {
        let _ = config;
        Some(tensor.to_string())
    }

    /// The layers, their parameters fetched from `vb` (under `transformers`' names), fresh ones
    /// drawn from N(0, `init_std`²) (zero biases, unit norms, as `transformers` initializes).
    fn assemble(config: &Self::Config, vb: VarBuilder, init_std: f64) -> Result<Self>;

    /// Every linear layer LoRA may target (never the output layer).
    fn projections_mut(&mut self) -> Vec<&mut Proj>;

    /// The layers' output for `inputs`: the hidden states before the head (after the last
    /// norm) and any auxiliary loss.
    fn hidden_states(&self, inputs: &Inputs<'_>, mode: Mode) -> Result<Hidden>;

    /// The head's output: `[B, T, vocab]` logits for a language model, `[B, labels]` for a
    /// sequence classifier.
    fn logits(&self, hidden: &Hidden, mode: Mode) -> Result<Tensor>;

    /// The task's loss (see [`Task`]) of `hidden` against `labels`, the auxiliary loss added.
    fn loss(&self, hidden: &Hidden, labels: &Tensor, mode: Mode) -> Result<Tensor>;

    /// What `estimate-memory` needs beyond the parameters.
    fn memory_profile(config: &Self::Config) -> MemoryProfile;

    /// One step of generation, in evaluation mode: the layers over the new tokens of `inputs`
    /// (at their positions), each attending over the keys and values `cache` holds and
    /// appending the new ones; the `[B, vocab]` logits of the last new token, detached. An
    /// error for an architecture that does not generate (the default).
    fn decode(&self, inputs: &DecodeInputs<'_>, cache: &mut KvCache) -> Result<Tensor> {
        let _ = (inputs, cache);
        Err(candle_core::Error::Msg(format!(
            "{}: this architecture does not generate text",
            Self::CLASSES[0]
        )))
    }

    /// ZeRO-3's units (FSDP's wrap policy): the embeddings, each block, and the root unit (the
    /// final norm and the head), or `None` where the architecture does not run sharded yet.
    fn wrap_policy(config: &Self::Config) -> Option<WrapPolicy> {
        let _ = config;
        None
    }

    /// [`hidden_states`](Self::hidden_states) over sharded parameters (`self` holds shape-only
    /// placeholders): each unit gathered for the time it runs, the blocks recomputed in the
    /// backward pass; the output layer built from its gathered unit comes back in the
    /// [`Hidden`] for [`logits`](Self::logits) and [`loss`](Self::loss). An error where
    /// [`wrap_policy`](Self::wrap_policy) is `None`.
    fn hidden_states_sharded(
        &self,
        inputs: &Inputs<'_>,
        mode: Mode,
        sharded: &ShardedRun,
    ) -> Result<Hidden> {
        let _ = (inputs, mode, sharded);
        Err(candle_core::Error::Msg(format!(
            "{}: this architecture does not run at ZeRO stage 3 yet",
            Self::CLASSES[0]
        )))
    }
}

#[cfg(test)]
#[path = "arch_tests.rs"]
mod tests;
