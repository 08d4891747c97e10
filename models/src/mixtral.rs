//! The mixtures of experts from one implementation: Mixtral (`block_sparse_moe`, experts `w1`,
//! `w3`, `w2`, top-k weights renormalized, a sliding window on every layer), Qwen2-MoE (a shared
//! expert gated by a sigmoid, biases on q, k and v) and Qwen3-MoE (q/k norms), with dense layers
//! where `mlp_only_layers` or `decoder_sparse_step` say so. Each layer's router trains (see
//! [`moe`](crate::moe)); with `output_router_logits` the loss adds `router_aux_loss_coef` times
//! the load-balancing loss, as `transformers` does.

use std::path::Path;

use accelerate_rs::WrapPolicy;
use candle_core::{Result, Tensor};
use candle_nn::VarBuilder;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::arch::{
    Architecture, Hidden, Inputs, MemoryProfile, Mode, ModelConfig, Proj, ShardedRun, Task,
};
use crate::config::{
    config_value, ensure, ensure_init_range, ensure_layers, ensure_multiple, ensure_positive,
    ensure_probabilities, ensure_sizes, max_position_embeddings, parse, read_json, Activation,
    Origin,
};
use crate::decoder::{
    self, AttentionOptions, AttentionShape, Block, BlockBuilder, BlockOutput, CausalDecoder,
    Context, DecoderOutput, GatedMlp, LmHead, MlpNames, Norm, Rope, SelfAttention,
};
use crate::error::Result as CrateResult;
use crate::generate::{DecodeInputs, KvCache};
use crate::layers::{check_mask, lookup, padding_idx};
use crate::moe::{load_balancing_loss, MoeShape, SparseMoe};
use crate::rope::RopeConfig;

fn default_act() -> Activation {
    Activation::Silu
}
fn default_init() -> f64 {
    0.02
}
fn default_top_k() -> usize {
    2
}
fn default_aux_coef() -> f64 {
    0.001
}
fn one() -> usize {
    1
}

/// A Mixtral, Qwen2-MoE or Qwen3-MoE `config.json` (`MixtralConfig`, `Qwen2MoeConfig`,
/// `Qwen3MoeConfig`). The sizes and the number of experts (`num_local_experts`, or the Qwen
/// MoEs' `num_experts`) are required; the rest default as in `transformers` for the
/// `model_type`. Other keys are kept in `extra` and written back.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct MoeConfig {
    /// `mixtral`, `qwen2_moe` or `qwen3_moe`.
    pub model_type: String,
    /// Tokens in the vocabulary.
    pub vocab_size: usize,
    /// The model width.
    pub hidden_size: usize,
    /// The experts' inner width (Mixtral), or the dense layers' (the Qwen MoEs).
    pub intermediate_size: usize,
    /// Decoder layers.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads; default: as many as the query heads.
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    /// The width of a head; default `hidden_size / num_attention_heads`.
    #[serde(default)]
    pub head_dim: Option<usize>,
    /// The experts' gate activation (`silu`).
    #[serde(default = "default_act")]
    pub hidden_act: Activation,
    /// RMSNorm's epsilon (Mixtral 1e-5, the Qwen MoEs 1e-6 by default).
    #[serde(default)]
    pub rms_norm_eps: Option<f64>,
    /// RoPE's base (transformers 4; default Mixtral 1e6, the Qwen MoEs 1e4).
    #[serde(default)]
    pub rope_theta: Option<f64>,
    /// RoPE scaling (transformers 4).
    #[serde(default)]
    pub rope_scaling: Option<Value>,
    /// RoPE settings (transformers 5).
    #[serde(default)]
    pub rope_parameters: Option<Value>,
    /// The output layer shares the embedding matrix.
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// Mixtral: each query sees at most this many keys on every layer. The Qwen MoEs: only with
    /// `use_sliding_window` (Qwen3-MoE; Qwen2-MoE's is not implemented).
    #[serde(default)]
    pub sliding_window: Option<usize>,
    /// The Qwen MoEs: whether `sliding_window` applies.
    #[serde(default)]
    pub use_sliding_window: bool,
    /// Dropout on the attention probabilities (training mode only).
    #[serde(default)]
    pub attention_dropout: f64,
    /// The standard deviation of the initial weights (`from_config`).
    #[serde(default = "default_init")]
    pub initializer_range: f64,
    /// Experts per sparse layer (Mixtral's key; `transformers` 5 writes it for Qwen3-MoE too).
    #[serde(default)]
    pub num_local_experts: Option<usize>,
    /// Experts per sparse layer (the Qwen MoEs' key).
    #[serde(default)]
    pub num_experts: Option<usize>,
    /// Experts each token is routed to.
    #[serde(default = "default_top_k")]
    pub num_experts_per_tok: usize,
    /// The loss adds `router_aux_loss_coef` times the load-balancing loss.
    #[serde(default)]
    pub output_router_logits: bool,
    /// The load-balancing loss's weight.
    #[serde(default = "default_aux_coef")]
    pub router_aux_loss_coef: f64,
    /// Mixtral's multiplicative noise on the router's input in training (only 0 is
    /// implemented).
    #[serde(default)]
    pub router_jitter_noise: f64,
    /// The Qwen MoEs: each expert's inner width.
    #[serde(default)]
    pub moe_intermediate_size: Option<usize>,
    /// Qwen2-MoE: the shared expert's inner width.
    #[serde(default)]
    pub shared_expert_intermediate_size: Option<usize>,
    /// The Qwen MoEs: whether the top-k weights are divided by their sum (Mixtral always
    /// does).
    #[serde(default)]
    pub norm_topk_prob: Option<bool>,
    /// The Qwen MoEs: every `decoder_sparse_step`-th layer is sparse.
    #[serde(default = "one")]
    pub decoder_sparse_step: usize,
    /// The Qwen MoEs: layers with a dense MLP.
    #[serde(default)]
    pub mlp_only_layers: Option<Vec<usize>>,
    /// Qwen2-MoE: biases on q, k and v (default true).
    #[serde(default)]
    pub qkv_bias: Option<bool>,
    /// Qwen3-MoE: biases on q, k, v and o.
    #[serde(default)]
    pub attention_bias: Option<bool>,
    /// Every other key of the file, written back as it was.
    #[serde(flatten)]
    pub extra: serde_json::Map<String, Value>,
    /// The file it was read from and the keys it had.
    #[serde(skip)]
    origin: Origin,
}

/// The members of the family, each with its facts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Family {
    Mixtral,
    Qwen2Moe,
    Qwen3Moe,
}

impl Family {
    fn of(model_type: &str) -> Option<Family> {
        match model_type {
            "mixtral" => Some(Family::Mixtral),
            "qwen2_moe" => Some(Family::Qwen2Moe),
            "qwen3_moe" => Some(Family::Qwen3Moe),
            _ => None,
        }
    }

    fn class(self) -> &'static str {
        match self {
            Family::Mixtral => "MixtralForCausalLM",
            Family::Qwen2Moe => "Qwen2MoeForCausalLM",
            Family::Qwen3Moe => "Qwen3MoeForCausalLM",
        }
    }

    /// The sparse block's name under a layer, and its experts' projections.
    fn moe_names(self) -> (&'static str, MlpNames) {
        match self {
            Family::Mixtral => (
                "block_sparse_moe",
                MlpNames {
                    gate_up: Some(("w1", "w3")),
                    fused: "",
                    down: "w2",
                },
            ),
            Family::Qwen2Moe | Family::Qwen3Moe => ("mlp", MlpNames::LLAMA),
        }
    }
}

impl ModelConfig for MoeConfig {
    fn from_json(path: &Path, json: &Value) -> CrateResult<Self> {
        let mut c: Self = parse(path, json)?;
        c.origin = Origin::of(path, json);
        c.check()?;
        Ok(c)
    }

    fn to_json(&self) -> Value {
        config_value(self, &self.origin.present, &self.model_type)
    }

    fn path(&self) -> &Path {
        &self.origin.path
    }

    fn model_type(&self) -> &str {
        &self.model_type
    }

    fn initializer_range(&self) -> f64 {
        self.initializer_range
    }
}

impl MoeConfig {
    /// Reads a `config.json` (or the one in a model folder).
    pub fn from_file(path: impl AsRef<Path>) -> CrateResult<Self> {
        let (path, json) = read_json(path.as_ref())?;
        <Self as ModelConfig>::from_json(&path, &json)
    }

    /// Parses and checks a configuration; `path` is named in errors.
    pub fn from_json(path: &Path, json: &Value) -> CrateResult<Self> {
        <Self as ModelConfig>::from_json(path, json)
    }

    fn family(&self) -> Family {
        Family::of(&self.model_type).unwrap_or(Family::Mixtral)
    }

    /// The sizes: each from 1 to the largest accepted, the experts' count and top-k consistent.
    fn check_sizes(&self) -> CrateResult<()> {
        let p = &self.origin.path;
        let key = if self.num_local_experts.is_some() || self.family() == Family::Mixtral {
            "num_local_experts"
        } else {
            "num_experts"
        };
        ensure(
            self.experts() > 0,
            p,
            key,
            "missing or 0 (experts per layer)",
        )?;
        ensure_sizes(
            p,
            &[
                ("vocab_size", self.vocab_size),
                ("hidden_size", self.hidden_size),
                ("intermediate_size", self.intermediate_size),
                ("num_attention_heads", self.num_attention_heads),
                ("num_key_value_heads", self.kv_heads()),
                ("head_dim", self.head_dim()),
                ("moe_intermediate_size", self.expert_size()),
                (key, self.experts()),
                ("num_experts_per_tok", self.num_experts_per_tok),
                ("decoder_sparse_step", self.decoder_sparse_step),
            ],
        )?;
        if let Some(s) = self.shared_expert_intermediate_size {
            ensure_sizes(p, &[("shared_expert_intermediate_size", s)])?;
        }
        ensure(
            self.num_experts_per_tok <= self.experts(),
            p,
            "num_experts_per_tok",
            format!(
                "{} is more than the {} experts",
                self.num_experts_per_tok,
                self.experts()
            ),
        )?;
        Ok(())
    }

    fn check(&self) -> CrateResult<()> {
        let p = &self.origin.path;
        ensure(
            Family::of(&self.model_type).is_some(),
            p,
            "model_type",
            format!(
                "`{}` is not mixtral, qwen2_moe or qwen3_moe",
                self.model_type
            ),
        )?;
        self.check_sizes()?;
        ensure_layers(p, ("num_hidden_layers", self.num_hidden_layers))?;
        ensure_positive(p, &[("rms_norm_eps", self.eps())])?;
        ensure_init_range(p, self.initializer_range)?;
        ensure(
            self.router_aux_loss_coef.is_finite() && self.router_aux_loss_coef >= 0.0,
            p,
            "router_aux_loss_coef",
            "must be a finite number, 0 or above",
        )?;
        ensure(
            self.router_jitter_noise == 0.0,
            p,
            "router_jitter_noise",
            "only 0 is implemented (no noise on the router's input)",
        )?;
        ensure(
            !(self.family() == Family::Qwen2Moe && self.use_sliding_window),
            p,
            "use_sliding_window",
            "Qwen2-MoE's sliding window is not implemented",
        )?;
        if self.head_dim.is_none() {
            ensure_multiple(
                p,
                ("hidden_size", self.hidden_size),
                ("num_attention_heads", self.num_attention_heads),
                " (and no head_dim is given)",
            )?;
        }
        ensure(
            self.num_attention_heads.is_multiple_of(self.kv_heads()),
            p,
            "num_key_value_heads",
            format!(
                "{} does not divide num_attention_heads = {}",
                self.kv_heads(),
                self.num_attention_heads
            ),
        )?;
        ensure(
            self.window().is_none_or(|w| w > 0),
            p,
            "sliding_window",
            "must be at least 1",
        )?;
        ensure_probabilities(p, &[("attention_dropout", self.attention_dropout)])?;
        self.rope()?.check_head_dim(p, "head_dim", self.head_dim())
    }

    /// Key/value heads.
    pub fn kv_heads(&self) -> usize {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    /// The width of a head.
    pub fn head_dim(&self) -> usize {
        self.head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads.max(1))
    }

    /// Experts per sparse layer.
    pub fn experts(&self) -> usize {
        self.num_local_experts.or(self.num_experts).unwrap_or(0)
    }

    /// Each expert's inner width.
    pub fn expert_size(&self) -> usize {
        match self.family() {
            Family::Mixtral => self.intermediate_size,
            _ => self.moe_intermediate_size.unwrap_or(self.intermediate_size),
        }
    }

    fn eps(&self) -> f64 {
        let default = if self.family() == Family::Mixtral {
            1e-5
        } else {
            1e-6
        };
        self.rms_norm_eps.unwrap_or(default)
    }

    /// The RoPE settings.
    pub fn rope(&self) -> CrateResult<RopeConfig> {
        let default = (self.family() == Family::Mixtral).then_some(1e6);
        RopeConfig::from_json(
            &self.origin.path,
            self.rope_theta.or(default),
            self.rope_scaling.as_ref(),
            self.rope_parameters.as_ref(),
        )
    }

    /// The sliding window of every layer, if any.
    pub fn window(&self) -> Option<usize> {
        match self.family() {
            Family::Mixtral => self.sliding_window,
            Family::Qwen3Moe if self.use_sliding_window => self.sliding_window,
            _ => None,
        }
    }

    /// Whether layer `i` is a sparse one (the others have a dense MLP).
    pub fn is_sparse(&self, i: usize) -> bool {
        let dense = self
            .mlp_only_layers
            .as_ref()
            .is_some_and(|l| l.contains(&i));
        !dense && (i + 1).is_multiple_of(self.decoder_sparse_step.max(1))
    }
}

/// A layer's MLP: the sparse block or a dense one.
#[derive(Debug, Clone)]
enum Mlp {
    Sparse(Box<SparseMoe>),
    Dense(Box<GatedMlp>),
}

/// One decoder layer: Llama's attention (with the family's biases and norms) and a mixture of
/// experts.
#[derive(Debug, Clone)]
pub(crate) struct MoeBlock {
    input_norm: Norm,
    attn: SelfAttention,
    post_norm: Norm,
    mlp: Mlp,
}

impl MoeBlock {
    fn new(c: &MoeConfig, layer: usize, std: f64, vb: VarBuilder) -> Result<Self> {
        let family = c.family();
        let shape = AttentionShape {
            hidden: c.hidden_size,
            heads: c.num_attention_heads,
            kv_heads: c.kv_heads(),
            head_dim: c.head_dim(),
        };
        let (qkv_bias, o_bias) = match family {
            Family::Mixtral => (false, false),
            Family::Qwen2Moe => (c.qkv_bias.unwrap_or(true), false),
            Family::Qwen3Moe => {
                let b = c.attention_bias.unwrap_or(false);
                (b, b)
            }
        };
        let options = AttentionOptions {
            qkv_bias,
            o_bias,
            fused_qkv: false,
            qk_norm: (family == Family::Qwen3Moe).then_some(false),
            eps: c.eps(),
            window: c.window(),
            scale: 1.0 / (c.head_dim() as f64).sqrt(),
            softcap: None,
            dropout: c.attention_dropout,
            rope: 0,
        };
        let (h, eps) = (c.hidden_size, c.eps());
        let (name, names) = family.moe_names();
        let mlp = if c.is_sparse(layer) {
            let moe = MoeShape {
                hidden: h,
                inner: c.expert_size(),
                experts: c.experts(),
                top_k: c.num_experts_per_tok,
                normalize: family == Family::Mixtral || c.norm_topk_prob.unwrap_or(false),
                shared: match family {
                    Family::Qwen2Moe => Some(
                        c.shared_expert_intermediate_size
                            .unwrap_or(c.intermediate_size),
                    ),
                    _ => None,
                },
                act: c.hidden_act,
            };
            Mlp::Sparse(Box::new(SparseMoe::new(moe, names, std, vb.pp(name))?))
        } else {
            Mlp::Dense(Box::new(GatedMlp::new(
                (h, c.intermediate_size),
                false,
                c.hidden_act,
                MlpNames::LLAMA,
                std,
                vb.pp("mlp"),
            )?))
        };
        Ok(MoeBlock {
            input_norm: Norm::new(h, eps, false, vb.pp("input_layernorm"))?,
            attn: SelfAttention::new(shape, options, std, vb.pp("self_attn"))?,
            post_norm: Norm::new(h, eps, false, vb.pp("post_attention_layernorm"))?,
            mlp,
        })
    }
}

impl Block for MoeBlock {
    fn forward(&self, x: &Tensor, ctx: &Context, train: bool) -> Result<BlockOutput> {
        let a = self
            .attn
            .forward(&self.input_norm.forward(x)?, ctx, train)?;
        let h = (x + a)?;
        let n = self.post_norm.forward(&h)?;
        let (m, router_logits) = match &self.mlp {
            Mlp::Sparse(moe) => {
                let (m, logits) = moe.forward(&n, train)?;
                (m, Some(logits))
            }
            Mlp::Dense(mlp) => (mlp.forward(&n, train)?, None),
        };
        Ok(BlockOutput {
            hidden: (&h + m)?,
            router_logits,
        })
    }

    fn experts(&self) -> Option<usize> {
        match &self.mlp {
            Mlp::Sparse(moe) => Some(moe.experts()),
            Mlp::Dense(_) => None,
        }
    }

    fn projections_mut(&mut self) -> Vec<&mut Proj> {
        let mut out = self.attn.projections_mut();
        out.extend(match &mut self.mlp {
            Mlp::Sparse(moe) => moe.projections_mut(),
            Mlp::Dense(mlp) => mlp.projections_mut(),
        });
        out
    }
}

/// The layers of a Mixtral, Qwen2-MoE or Qwen3-MoE causal language model
/// ([`MixtralForCausalLm`]).
#[derive(Debug, Clone)]
pub struct Mixtral {
    decoder: CausalDecoder<MoeBlock>,
    experts: usize,
    top_k: usize,
    /// `router_aux_loss_coef` when `output_router_logits` is on.
    aux_coef: Option<f64>,
}

/// A Mixtral, Qwen2-MoE or Qwen3-MoE causal language model (`MixtralForCausalLM`,
/// `Qwen2MoeForCausalLM`, `Qwen3MoeForCausalLM`), trainable: every parameter gets a gradient,
/// the routers included.
pub type MixtralForCausalLm = crate::Pretrained<Mixtral>;

impl Mixtral {
    /// The tokens each expert of each sparse layer takes for `inputs` (top-k choices, padding
    /// left out), without dropout: the expert load `transformers`' load-balancing loss evens
    /// out.
    pub fn expert_load(&self, inputs: &Inputs<'_>) -> Result<Vec<Vec<usize>>> {
        let ids = inputs.input_ids;
        let (b, t) = ids.dims2()?;
        check_mask(inputs.attention_mask, b, t)?;
        let mask: Option<Vec<f32>> = match inputs.attention_mask {
            Some(m) => Some(
                m.to_dtype(candle_core::DType::F32)?
                    .flatten_all()?
                    .to_vec1()?,
            ),
            None => None,
        };
        let d = &self.decoder;
        let mut h = lookup(&d.embed_tokens, ids, d.pad, "input_ids")?;
        let ctx = d.context(inputs, Mode::default(), &h)?;
        let mut loads = Vec::new();
        for layer in &d.layers {
            if let Mlp::Sparse(moe) = &layer.mlp {
                let a = layer
                    .attn
                    .forward(&layer.input_norm.forward(&h)?, &ctx, false)?;
                let x = (&h + a)?;
                loads.push(moe.load(&layer.post_norm.forward(&x)?, mask.as_deref())?);
            }
            h = layer.forward(&h, &ctx, false)?.hidden;
        }
        Ok(loads)
    }
}

impl Mixtral {
    /// The decoder's output with the load-balancing loss of its routers' logits (when
    /// `output_router_logits`).
    fn with_aux_loss(&self, out: DecoderOutput, inputs: &Inputs<'_>) -> Result<Hidden> {
        let aux_loss = match self.aux_coef {
            Some(coef) if !out.router_logits.is_empty() => Some(
                (load_balancing_loss(
                    &out.router_logits,
                    self.experts,
                    self.top_k,
                    inputs.attention_mask,
                )? * coef)?,
            ),
            _ => None,
        };
        Ok(out.into_hidden().aux_loss(aux_loss))
    }
}

impl Architecture for Mixtral {
    type Config = MoeConfig;
    const MODEL_TYPES: &'static [&'static str] = &["mixtral", "qwen2_moe", "qwen3_moe"];
    const CLASSES: &'static [&'static str] = &[
        "MixtralForCausalLM",
        "Qwen2MoeForCausalLM",
        "Qwen3MoeForCausalLM",
    ];
    const TASK: Task = Task::CausalLm;
    const LORA_TARGETS: &'static [&'static str] = &["q_proj", "v_proj"];
    const PEFT_TASK_TYPE: Option<&'static str> = Some("CAUSAL_LM");

    fn class_name(config: &MoeConfig) -> &'static str {
        config.family().class()
    }

    /// Mixtral's, as `peft`'s; `peft` has none for the Qwen MoEs.
    fn lora_targets(config: &MoeConfig) -> &'static [&'static str] {
        match config.family() {
            Family::Mixtral => Self::LORA_TARGETS,
            Family::Qwen2Moe | Family::Qwen3Moe => &[],
        }
    }

    fn parameter_name(config: &MoeConfig, name: &str) -> Option<String> {
        let skip = name.ends_with(".rotary_emb.inv_freq")
            || (config.tie_word_embeddings && name == "lm_head.weight");
        (!skip).then(|| name.to_string())
    }

    fn assemble(c: &MoeConfig, vb: VarBuilder, std: f64) -> Result<Self> {
        let embed_tokens =
            CausalDecoder::<MoeBlock>::embedding(c.vocab_size, c.hidden_size, std, &vb)?;
        let m = vb.pp("model");
        let build = {
            let c = c.clone();
            BlockBuilder::new(move |i, vb: VarBuilder| {
                MoeBlock::new(&c, i, std, vb.pp(format!("model.layers.{i}")))
            })
        };
        let layers = build.blocks(c.num_hidden_layers, &vb)?;
        let head = LmHead::new(&embed_tokens, c.tie_word_embeddings, None, std, vb.clone())?;
        Ok(Mixtral {
            decoder: CausalDecoder {
                build,
                embed_tokens,
                layers,
                norm: Norm::new(c.hidden_size, c.eps(), false, m.pp("norm"))?,
                head,
                ropes: vec![Rope::new(c.rope()?, c.head_dim())],
                pad: padding_idx(&c.extra, c.vocab_size),
                embed_scale: None,
            },
            experts: c.experts(),
            top_k: c.num_experts_per_tok,
            aux_coef: c.output_router_logits.then_some(c.router_aux_loss_coef),
        })
    }

    fn projections_mut(&mut self) -> Vec<&mut Proj> {
        self.decoder.projections_mut()
    }

    fn hidden_states(&self, inputs: &Inputs<'_>, mode: Mode) -> Result<Hidden> {
        self.with_aux_loss(self.decoder.run(inputs, mode)?, inputs)
    }

    fn hidden_states_sharded(
        &self,
        inputs: &Inputs<'_>,
        mode: Mode,
        sharded: &ShardedRun,
    ) -> Result<Hidden> {
        self.with_aux_loss(self.decoder.run_sharded(inputs, mode, sharded)?, inputs)
    }

    fn wrap_policy(config: &Self::Config) -> Option<WrapPolicy> {
        Some(decoder::wrap_policy(config.num_hidden_layers))
    }

    fn decode(&self, inputs: &DecodeInputs<'_>, cache: &mut KvCache) -> Result<Tensor> {
        self.decoder.decode(inputs, cache)
    }

    fn logits(&self, hidden: &Hidden, _mode: Mode) -> Result<Tensor> {
        self.decoder.logits(hidden)
    }

    fn loss(&self, hidden: &Hidden, labels: &Tensor, _mode: Mode) -> Result<Tensor> {
        self.decoder.loss(hidden, labels)
    }

    fn memory_profile(c: &MoeConfig) -> MemoryProfile {
        let h = c.hidden_size as u64;
        let q = (c.num_attention_heads * c.head_dim()) as u64;
        let kv = (c.kv_heads() * c.head_dim()) as u64;
        let gqa = if c.kv_heads() < c.num_attention_heads {
            2 * q
        } else {
            0
        };
        let qk_norm = if c.family() == Family::Qwen3Moe {
            q + kv
        } else {
            0
        };
        let (e, k, i) = (
            c.experts() as u64,
            c.num_experts_per_tok as u64,
            c.expert_size() as u64,
        );
        let shared = match c.family() {
            Family::Qwen2Moe => 3 * c.shared_expert_intermediate_size.unwrap_or(0) as u64 + 3 * h,
            _ => 0,
        };
        MemoryProfile {
            hidden: c.hidden_size,
            intermediate: c.expert_size().max(c.intermediate_size),
            layers: c.num_hidden_layers,
            heads: c.num_attention_heads,
            kv_heads: c.kv_heads(),
            head_dim: c.head_dim(),
            vocab: c.vocab_size,
            max_positions: max_position_embeddings(&c.extra),
            // Llama's attention and norms (4h + 5q + 4kv, 2q more with grouped-query attention,
            // the q/k norms' outputs for Qwen3-MoE); the router's logits and probabilities (2e);
            // per routed copy (k per token) the gathered input, gate, up, SwiGLU, the expert's
            // output and its weighted copy (3i + 3h); the scattered sum and the residual (2h);
            // Qwen2-MoE's shared expert. Every layer is counted as sparse.
            block_elements: 4 * h
                + 5 * q
                + 4 * kv
                + gqa
                + qk_norm
                + 2 * e
                + k * (3 * i + 3 * h)
                + 2 * h
                + shared,
            outer_elements: 2 * h,
            lm_head: true,
        }
    }
}
