//! Gemma 2 and Gemma 3 (text): RMSNorm with a `1 + w` gain, embeddings scaled by
//! `sqrt(hidden_size)`, GeGLU (`gelu_pytorch_tanh`), sliding-window and global layers alternating
//! (`layer_types`; Gemma 2 every other layer, Gemma 3 five local for one global), norms before
//! and after the attention and the MLP, the scores scaled by `query_pre_attn_scalar^-0.5`,
//! soft-capping of the scores and of the logits (Gemma 2's `attn_logit_softcapping` and
//! `final_logit_softcapping`), q/k norms and a RoPE base per kind of layer (Gemma 3).

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
    config_value, ensure, ensure_init_range, ensure_layer_types, ensure_layers, ensure_positive,
    ensure_probabilities, ensure_sizes, max_position_embeddings, parse, read_json, Activation,
    Origin,
};
use crate::decoder::{
    self, AttentionOptions, AttentionShape, Block, BlockBuilder, BlockOutput, CausalDecoder,
    Context, GatedMlp, LmHead, MlpNames, Norm, Rope, SelfAttention,
};
use crate::error::{Error, Result as CrateResult};
use crate::generate::{DecodeInputs, KvCache};
use crate::layers::padding_idx;
use crate::rope::RopeConfig;

fn default_act() -> Activation {
    Activation::GeluPytorchTanh
}
fn default_eps() -> f64 {
    1e-6
}
fn default_init() -> f64 {
    0.02
}
fn default_head_dim() -> usize {
    256
}
fn default_query_pre_attn_scalar() -> serde_json::Number {
    256.into()
}
fn default_window() -> Option<usize> {
    Some(4096)
}
fn yes() -> bool {
    true
}

/// A Gemma 2 or Gemma 3 text `config.json` (`Gemma2Config`, `Gemma3TextConfig`). The sizes but
/// `head_dim` are required; the rest default as in `transformers` for the `model_type` (Gemma 2
/// soft-caps the scores at 50 and the logits at 30 unless the file says otherwise; Gemma 3 does
/// not). Other keys are kept in `extra` and written back.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct GemmaConfig {
    /// `gemma2` or `gemma3_text`.
    pub model_type: String,
    /// Tokens in the vocabulary.
    pub vocab_size: usize,
    /// The model width.
    pub hidden_size: usize,
    /// The MLP's inner width.
    pub intermediate_size: usize,
    /// Decoder layers.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads; default: as many as the query heads.
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    /// The width of a head (default 256).
    #[serde(default = "default_head_dim")]
    pub head_dim: usize,
    /// The MLP's gate activation (`gelu_pytorch_tanh`).
    #[serde(default = "default_act")]
    pub hidden_activation: Activation,
    /// RMSNorm's epsilon.
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f64,
    /// RoPE's base (transformers 4; Gemma 3: the global layers').
    #[serde(default)]
    pub rope_theta: Option<f64>,
    /// Gemma 3 (transformers 4): the local layers' RoPE base (default 10000).
    #[serde(default)]
    pub rope_local_base_freq: Option<f64>,
    /// RoPE scaling (transformers 4; Gemma 3: the global layers').
    #[serde(default)]
    pub rope_scaling: Option<Value>,
    /// RoPE settings (transformers 5): one set, or one per layer kind (`full_attention`,
    /// `sliding_attention`).
    #[serde(default)]
    pub rope_parameters: Option<Value>,
    /// Biases on the attention projections.
    #[serde(default)]
    pub attention_bias: bool,
    /// Dropout on the attention probabilities (training mode only).
    #[serde(default)]
    pub attention_dropout: f64,
    /// The scores are scaled by `query_pre_attn_scalar^-0.5` (kept as the file writes it: an
    /// integer for `transformers`).
    #[serde(default = "default_query_pre_attn_scalar")]
    pub query_pre_attn_scalar: serde_json::Number,
    /// The window of the sliding layers.
    #[serde(default = "default_window")]
    pub sliding_window: Option<usize>,
    /// `full_attention` or `sliding_attention`, per layer (default: Gemma 2 alternates from a
    /// sliding layer, Gemma 3 has one global layer in `sliding_window_pattern`).
    #[serde(default)]
    pub layer_types: Option<Vec<String>>,
    /// Soft-capping of the logits (Gemma 2: 30 by default).
    #[serde(default)]
    pub final_logit_softcapping: Option<f64>,
    /// Soft-capping of the attention scores (Gemma 2: 50 by default).
    #[serde(default)]
    pub attn_logit_softcapping: Option<f64>,
    /// The output layer shares the embedding matrix (default).
    #[serde(default = "yes")]
    pub tie_word_embeddings: bool,
    /// The standard deviation of the initial weights (`from_config`).
    #[serde(default = "default_init")]
    pub initializer_range: f64,
    /// Every other key of the file, written back as it was.
    #[serde(flatten)]
    pub extra: serde_json::Map<String, Value>,
    /// The file it was read from and the keys it had.
    #[serde(skip)]
    origin: Origin,
}

/// The two generations, each with its own defaults.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Generation {
    Gemma2,
    Gemma3,
}

impl Generation {
    fn of(model_type: &str) -> Option<Generation> {
        match model_type {
            "gemma2" => Some(Generation::Gemma2),
            "gemma3_text" => Some(Generation::Gemma3),
            _ => None,
        }
    }

    fn class(self) -> &'static str {
        match self {
            Generation::Gemma2 => "Gemma2ForCausalLM",
            Generation::Gemma3 => "Gemma3ForCausalLM",
        }
    }
}

impl ModelConfig for GemmaConfig {
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

impl GemmaConfig {
    /// Reads a `config.json` (or the one in a model folder).
    pub fn from_file(path: impl AsRef<Path>) -> CrateResult<Self> {
        let (path, json) = read_json(path.as_ref())?;
        <Self as ModelConfig>::from_json(&path, &json)
    }

    /// Parses and checks a configuration; `path` is named in errors.
    pub fn from_json(path: &Path, json: &Value) -> CrateResult<Self> {
        <Self as ModelConfig>::from_json(path, json)
    }

    fn generation(&self) -> Generation {
        Generation::of(&self.model_type).unwrap_or(Generation::Gemma2)
    }

    fn check(&self) -> CrateResult<()> {
        let p = &self.origin.path;
        ensure(
            Generation::of(&self.model_type).is_some(),
            p,
            "model_type",
            format!("`{}` is not gemma2 or gemma3_text", self.model_type),
        )?;
        ensure_sizes(
            p,
            &[
                ("vocab_size", self.vocab_size),
                ("hidden_size", self.hidden_size),
                ("intermediate_size", self.intermediate_size),
                ("num_attention_heads", self.num_attention_heads),
                ("num_key_value_heads", self.kv_heads()),
                ("head_dim", self.head_dim),
            ],
        )?;
        ensure_layers(p, ("num_hidden_layers", self.num_hidden_layers))?;
        ensure_positive(
            p,
            &[
                ("rms_norm_eps", self.rms_norm_eps),
                ("query_pre_attn_scalar", self.query_scalar()),
            ],
        )?;
        for (key, cap) in [
            ("final_logit_softcapping", self.final_softcap()),
            ("attn_logit_softcapping", self.attn_softcap()),
        ] {
            if let Some(cap) = cap {
                ensure_positive(p, &[(key, cap)])?;
            }
        }
        ensure_init_range(p, self.initializer_range)?;
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
        ensure_layer_types(p, self.layer_types.as_deref(), self.num_hidden_layers)?;
        ensure(
            self.sliding_window.is_none_or(|w| w > 0),
            p,
            "sliding_window",
            "must be at least 1",
        )?;
        let bidirectional = self
            .extra
            .get("use_bidirectional_attention")
            .and_then(Value::as_bool);
        ensure(
            bidirectional != Some(true),
            p,
            "use_bidirectional_attention",
            "bidirectional (encoder) attention is not implemented: only causal decoders",
        )?;
        ensure_probabilities(p, &[("attention_dropout", self.attention_dropout)])?;
        for rope in self.ropes()? {
            rope.check_head_dim(p, "head_dim", self.head_dim)?;
        }
        Ok(())
    }

    /// Key/value heads.
    pub fn kv_heads(&self) -> usize {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    /// `query_pre_attn_scalar` as a number.
    pub fn query_scalar(&self) -> f64 {
        self.query_pre_attn_scalar.as_f64().unwrap_or(f64::NAN)
    }

    /// The value of `key` as the file gives it, or the generation's default when it has none.
    fn softcap(&self, key: &str, value: Option<f64>, gemma2: f64) -> Option<f64> {
        if self.origin.present.contains(key) || self.generation() == Generation::Gemma3 {
            value
        } else {
            Some(gemma2)
        }
    }

    /// Soft-capping of the logits, if any.
    pub fn final_softcap(&self) -> Option<f64> {
        self.softcap(
            "final_logit_softcapping",
            self.final_logit_softcapping,
            30.0,
        )
    }

    /// Soft-capping of the attention scores, if any.
    pub fn attn_softcap(&self) -> Option<f64> {
        self.softcap("attn_logit_softcapping", self.attn_logit_softcapping, 50.0)
    }

    /// Whether layer `i` is a sliding-window one.
    pub fn is_sliding(&self, i: usize) -> bool {
        if let Some(types) = &self.layer_types {
            return types.get(i).is_some_and(|t| t == "sliding_attention");
        }
        let pattern = match self.generation() {
            Generation::Gemma2 => 2,
            Generation::Gemma3 => ["sliding_window_pattern", "_sliding_window_pattern"]
                .iter()
                .find_map(|k| self.extra.get(*k).and_then(Value::as_u64))
                .map_or(6, |p| p.max(1) as usize),
        };
        !(i + 1).is_multiple_of(pattern)
    }

    /// The RoPE settings of the global and the local (sliding) layers.
    pub fn ropes(&self) -> CrateResult<[RopeConfig; 2]> {
        let p = &self.origin.path;
        let per_kind = self.rope_parameters.as_ref().and_then(|r| {
            let m = r.as_object()?;
            (m.contains_key("full_attention") || m.contains_key("sliding_attention")).then_some(m)
        });
        let gemma3 = self.generation() == Generation::Gemma3;
        if let Some(m) = per_kind {
            let kind = |name: &str, theta: f64| -> CrateResult<RopeConfig> {
                let sub = m.get(name).ok_or_else(|| {
                    Error::config(p, Some(&format!("rope_parameters.{name}")), "missing")
                })?;
                RopeConfig::from_json(p, Some(theta), None, Some(sub))
            };
            return Ok([
                kind("full_attention", 1e6)?,
                kind("sliding_attention", 1e4)?,
            ]);
        }
        let global_theta = self.rope_theta.or(gemma3.then_some(1e6));
        let global = RopeConfig::from_json(
            p,
            global_theta,
            self.rope_scaling.as_ref(),
            self.rope_parameters.as_ref(),
        )?;
        let local = if gemma3 {
            RopeConfig::from_json(
                p,
                Some(self.rope_local_base_freq.unwrap_or(1e4)),
                None,
                None,
            )?
        } else {
            global.clone()
        };
        Ok([global, local])
    }
}

/// One Gemma decoder layer: norms before and after the attention and the MLP.
#[derive(Debug, Clone)]
pub(crate) struct GemmaBlock {
    input_norm: Norm,
    attn: SelfAttention,
    post_attn_norm: Norm,
    pre_ff_norm: Norm,
    mlp: GatedMlp,
    post_ff_norm: Norm,
}

impl GemmaBlock {
    fn new(c: &GemmaConfig, layer: usize, std: f64, vb: VarBuilder) -> Result<Self> {
        let sliding = c.is_sliding(layer);
        let shape = AttentionShape {
            hidden: c.hidden_size,
            heads: c.num_attention_heads,
            kv_heads: c.kv_heads(),
            head_dim: c.head_dim,
        };
        let options = AttentionOptions {
            qkv_bias: c.attention_bias,
            o_bias: c.attention_bias,
            fused_qkv: false,
            qk_norm: (c.generation() == Generation::Gemma3).then_some(true),
            eps: c.rms_norm_eps,
            window: if sliding { c.sliding_window } else { None },
            scale: 1.0 / c.query_scalar().sqrt(),
            softcap: c.attn_softcap(),
            dropout: c.attention_dropout,
            rope: usize::from(sliding),
        };
        let (h, eps) = (c.hidden_size, c.rms_norm_eps);
        let norm = |name: &str| Norm::new(h, eps, true, vb.pp(name));
        Ok(GemmaBlock {
            input_norm: norm("input_layernorm")?,
            attn: SelfAttention::new(shape, options, std, vb.pp("self_attn"))?,
            post_attn_norm: norm("post_attention_layernorm")?,
            pre_ff_norm: norm("pre_feedforward_layernorm")?,
            mlp: GatedMlp::new(
                (h, c.intermediate_size),
                false,
                c.hidden_activation,
                MlpNames::LLAMA,
                std,
                vb.pp("mlp"),
            )?,
            post_ff_norm: norm("post_feedforward_layernorm")?,
        })
    }
}

impl Block for GemmaBlock {
    fn forward(&self, x: &Tensor, ctx: &Context, train: bool) -> Result<BlockOutput> {
        let a = self
            .attn
            .forward(&self.input_norm.forward(x)?, ctx, train)?;
        let h = (x + self.post_attn_norm.forward(&a)?)?;
        let m = self.mlp.forward(&self.pre_ff_norm.forward(&h)?, train)?;
        Ok(BlockOutput {
            hidden: (&h + self.post_ff_norm.forward(&m)?)?,
            router_logits: None,
        })
    }

    fn projections_mut(&mut self) -> Vec<&mut Proj> {
        let mut out = self.attn.projections_mut();
        out.extend(self.mlp.projections_mut());
        out
    }
}

/// The layers of a Gemma 2 or Gemma 3 text causal language model ([`GemmaForCausalLm`]).
#[derive(Debug, Clone)]
pub struct Gemma {
    decoder: CausalDecoder<GemmaBlock>,
}

/// A Gemma 2 or Gemma 3 text causal language model (`Gemma2ForCausalLM`, `Gemma3ForCausalLM`),
/// trainable: every parameter gets a gradient.
pub type GemmaForCausalLm = crate::Pretrained<Gemma>;

impl Architecture for Gemma {
    type Config = GemmaConfig;
    const MODEL_TYPES: &'static [&'static str] = &["gemma2", "gemma3_text"];
    const CLASSES: &'static [&'static str] = &["Gemma2ForCausalLM", "Gemma3ForCausalLM"];
    const TASK: Task = Task::CausalLm;
    const LORA_TARGETS: &'static [&'static str] = &["q_proj", "v_proj"];
    const PEFT_TASK_TYPE: Option<&'static str> = Some("CAUSAL_LM");

    fn class_name(config: &GemmaConfig) -> &'static str {
        config.generation().class()
    }

    fn parameter_name(config: &GemmaConfig, name: &str) -> Option<String> {
        let skip =
            name.ends_with("inv_freq") || (config.tie_word_embeddings && name == "lm_head.weight");
        (!skip).then(|| name.to_string())
    }

    fn assemble(c: &GemmaConfig, vb: VarBuilder, std: f64) -> Result<Self> {
        let embed_tokens =
            CausalDecoder::<GemmaBlock>::embedding(c.vocab_size, c.hidden_size, std, &vb)?;
        let m = vb.pp("model");
        let build = {
            let c = c.clone();
            BlockBuilder::new(move |i, vb: VarBuilder| {
                GemmaBlock::new(&c, i, std, vb.pp(format!("model.layers.{i}")))
            })
        };
        let layers = build.blocks(c.num_hidden_layers, &vb)?;
        let head = LmHead::new(
            &embed_tokens,
            c.tie_word_embeddings,
            c.final_softcap(),
            std,
            vb.clone(),
        )?;
        let [global, local] = c.ropes()?;
        Ok(Gemma {
            decoder: CausalDecoder {
                build,
                embed_tokens,
                layers,
                norm: Norm::new(c.hidden_size, c.rms_norm_eps, true, m.pp("norm"))?,
                head,
                ropes: vec![Rope::new(global, c.head_dim), Rope::new(local, c.head_dim)],
                pad: padding_idx(&c.extra, c.vocab_size),
                embed_scale: Some((c.hidden_size as f64).sqrt()),
            },
        })
    }

    fn projections_mut(&mut self) -> Vec<&mut Proj> {
        self.decoder.projections_mut()
    }

    fn hidden_states(&self, inputs: &Inputs<'_>, mode: Mode) -> Result<Hidden> {
        Ok(self.decoder.run(inputs, mode)?.into_hidden())
    }

    fn hidden_states_sharded(
        &self,
        inputs: &Inputs<'_>,
        mode: Mode,
        sharded: &ShardedRun,
    ) -> Result<Hidden> {
        Ok(self
            .decoder
            .run_sharded(inputs, mode, sharded)?
            .into_hidden())
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

    fn memory_profile(c: &GemmaConfig) -> MemoryProfile {
        let (h, i) = (c.hidden_size as u64, c.intermediate_size as u64);
        let q = (c.num_attention_heads * c.head_dim) as u64;
        let kv = (c.kv_heads() * c.head_dim) as u64;
        let gqa = if c.kv_heads() < c.num_attention_heads {
            2 * q
        } else {
            0
        };
        let qk_norm = if c.generation() == Generation::Gemma3 {
            q + kv
        } else {
            0
        };
        MemoryProfile {
            hidden: c.hidden_size,
            intermediate: c.intermediate_size,
            layers: c.num_hidden_layers,
            heads: c.num_attention_heads,
            kv_heads: c.kv_heads(),
            head_dim: c.head_dim,
            vocab: c.vocab_size,
            max_positions: max_position_embeddings(&c.extra),
            // Four norms, o_proj, two residual adds, down_proj: 8h; Llama's attention (5q + 4kv,
            // 2q more with grouped-query attention) and the q/k norms' outputs (Gemma 3); gate,
            // up, GELU and the product: 4i. The soft-capped scores of Gemma 2's composed
            // attention are counted as the attention weights are (heads x keys).
            block_elements: 8 * h + 5 * q + 4 * kv + gqa + qk_norm + 4 * i,
            // The embedding lookup, its scaling and the final norm.
            outer_elements: 3 * h,
            lm_head: true,
        }
    }
}
