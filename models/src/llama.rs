//! The Llama family from one implementation: Llama 2 and 3 (grouped-query attention, RoPE with
//! Llama 3's scaling, SwiGLU, RMSNorm, tied or untied embeddings), Mistral (sliding window) and
//! Qwen2 (biases on the query, key and value projections), with `transformers`' parameter names
//! (`model.layers.0.self_attn.q_proj.weight`, ...).

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
    config_value, ensure, ensure_init_range, ensure_layer_types, ensure_layers, ensure_multiple,
    ensure_positive, ensure_probabilities, ensure_sizes, max_position_embeddings, parse, read_json,
    Activation, Origin,
};
use crate::decoder::{
    self, AttentionOptions, AttentionShape, Block, BlockBuilder, BlockOutput, CausalDecoder,
    Context, GatedMlp, LmHead, MlpNames, Norm, Rope, SelfAttention,
};
use crate::error::Result as CrateResult;
use crate::generate::{DecodeInputs, KvCache};
use crate::layers::padding_idx;
use crate::rope::RopeConfig;

fn default_act() -> Activation {
    Activation::Silu
}
fn default_eps() -> f64 {
    1e-6
}
fn default_init() -> f64 {
    0.02
}
fn default_llama() -> String {
    "llama".into()
}

/// A Llama, Mistral or Qwen2 `config.json` (`LlamaConfig`, `MistralConfig`, `Qwen2Config` in
/// `transformers`). The five sizes are required; the rest default as in `transformers`. Keys this
/// crate does not use are kept in `extra` and written back by `save_pretrained`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LlamaConfig {
    /// `llama`, `mistral` or `qwen2`.
    #[serde(default = "default_llama")]
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
    /// Key/value heads (grouped-query attention); default: as many as the query heads.
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    /// The width of a head; default `hidden_size / num_attention_heads`.
    #[serde(default)]
    pub head_dim: Option<usize>,
    /// The MLP's gate activation (`silu`).
    #[serde(default = "default_act")]
    pub hidden_act: Activation,
    /// RMSNorm's epsilon.
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f64,
    /// RoPE's base (transformers 4; in `rope_parameters` with transformers 5). Default 10000.
    #[serde(default)]
    pub rope_theta: Option<f64>,
    /// RoPE scaling (transformers 4): `{"rope_type": "llama3", "factor": 8.0, ...}`.
    #[serde(default)]
    pub rope_scaling: Option<Value>,
    /// RoPE settings (transformers 5): `rope_type`, `rope_theta` and the scaling's keys.
    #[serde(default)]
    pub rope_parameters: Option<Value>,
    /// Biases on the attention projections (Llama's `attention_bias`; Qwen2 always has them on
    /// q, k and v).
    #[serde(default)]
    pub attention_bias: Option<bool>,
    /// Biases on the MLP's projections.
    #[serde(default)]
    pub mlp_bias: Option<bool>,
    /// The output layer shares the embedding matrix (no `lm_head.weight`).
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// Mistral: each query sees at most this many keys (itself included). Qwen2: the window of
    /// the layers that use one.
    #[serde(default)]
    pub sliding_window: Option<usize>,
    /// Qwen2 (transformers 4): whether layers from `max_window_layers` on use the window.
    #[serde(default)]
    pub use_sliding_window: Option<bool>,
    /// Qwen2 (transformers 4): the first layer with a sliding window.
    #[serde(default)]
    pub max_window_layers: Option<usize>,
    /// Qwen2 (transformers 5): `full_attention` or `sliding_attention`, per layer.
    #[serde(default)]
    pub layer_types: Option<Vec<String>>,
    /// Dropout on the attention probabilities (training mode only).
    #[serde(default)]
    pub attention_dropout: f64,
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

/// The members of the family, each with its own facts (its class, its biases, where its sliding
/// window applies): `model_type` read once into this.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Family {
    Llama,
    Mistral,
    Qwen2,
}

impl Family {
    fn of(model_type: &str) -> Option<Family> {
        match model_type {
            "llama" => Some(Family::Llama),
            "mistral" => Some(Family::Mistral),
            "qwen2" => Some(Family::Qwen2),
            _ => None,
        }
    }

    /// The `transformers` class of a causal LM.
    fn class(self) -> &'static str {
        match self {
            Family::Llama => "LlamaForCausalLM",
            Family::Mistral => "MistralForCausalLM",
            Family::Qwen2 => "Qwen2ForCausalLM",
        }
    }
}

impl ModelConfig for LlamaConfig {
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

impl LlamaConfig {
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
        Family::of(&self.model_type).unwrap_or(Family::Llama)
    }

    fn check(&self) -> CrateResult<()> {
        let p = &self.origin.path;
        ensure(
            Family::of(&self.model_type).is_some(),
            p,
            "model_type",
            format!("`{}` is not llama, mistral or qwen2", self.model_type),
        )?;
        ensure_sizes(
            p,
            &[
                ("vocab_size", self.vocab_size),
                ("hidden_size", self.hidden_size),
                ("intermediate_size", self.intermediate_size),
                ("num_attention_heads", self.num_attention_heads),
            ],
        )?;
        if let Some(kv) = self.num_key_value_heads {
            ensure_sizes(p, &[("num_key_value_heads", kv)])?;
        }
        if let Some(d) = self.head_dim {
            ensure_sizes(p, &[("head_dim", d)])?;
        }
        ensure_layers(p, ("num_hidden_layers", self.num_hidden_layers))?;
        ensure_positive(p, &[("rms_norm_eps", self.rms_norm_eps)])?;
        ensure_init_range(p, self.initializer_range)?;
        let kv = self.kv_heads();
        ensure(
            kv > 0 && self.num_attention_heads.is_multiple_of(kv),
            p,
            "num_key_value_heads",
            format!(
                "{kv} does not divide num_attention_heads = {}",
                self.num_attention_heads
            ),
        )?;
        if self.head_dim.is_none() {
            ensure_multiple(
                p,
                ("hidden_size", self.hidden_size),
                ("num_attention_heads", self.num_attention_heads),
                " (and no head_dim is given)",
            )?;
        }
        self.rope()?
            .check_head_dim(p, "head_dim", self.head_dim())?;
        ensure_layer_types(p, self.layer_types.as_deref(), self.num_hidden_layers)?;
        ensure(
            self.sliding_window.is_none_or(|w| w > 0),
            p,
            "sliding_window",
            "must be at least 1",
        )?;
        ensure_probabilities(p, &[("attention_dropout", self.attention_dropout)])?;
        self.rope()?;
        Ok(())
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

    /// The RoPE settings (`rope_parameters`, or `rope_theta` and `rope_scaling`).
    pub fn rope(&self) -> CrateResult<RopeConfig> {
        RopeConfig::from_json(
            &self.origin.path,
            self.rope_theta,
            self.rope_scaling.as_ref(),
            self.rope_parameters.as_ref(),
        )
    }

    /// The sliding window of layer `i`, if it has one: Mistral's on every layer, Qwen2's on
    /// the layers `layer_types` (or `use_sliding_window` and `max_window_layers`) give one.
    pub fn layer_window(&self, i: usize) -> Option<usize> {
        let window = self.sliding_window?;
        match self.family() {
            Family::Mistral => Some(window),
            Family::Qwen2 => {
                let sliding = match &self.layer_types {
                    Some(types) => types.get(i).is_some_and(|t| t == "sliding_attention"),
                    None => {
                        self.use_sliding_window.unwrap_or(false)
                            && i >= self.max_window_layers.unwrap_or(0)
                    }
                };
                sliding.then_some(window)
            }
            Family::Llama => None,
        }
    }

    /// Whether q, k and v have biases (Qwen2: always; Llama: `attention_bias`).
    fn qkv_bias(&self) -> bool {
        self.family() == Family::Qwen2 || self.attention_bias.unwrap_or(false)
    }

    /// Whether the output projection has a bias (Llama's `attention_bias`).
    fn o_bias(&self) -> bool {
        self.family() != Family::Qwen2 && self.attention_bias.unwrap_or(false)
    }

    /// The `transformers` class of a causal LM of this type.
    pub fn causal_lm_class(&self) -> &'static str {
        self.family().class()
    }
}

/// One decoder layer: pre-norm attention and SwiGLU MLP.
#[derive(Debug, Clone)]
pub(crate) struct LlamaBlock {
    input_norm: Norm,
    attn: SelfAttention,
    post_norm: Norm,
    mlp: GatedMlp,
}

impl LlamaBlock {
    fn new(c: &LlamaConfig, layer: usize, std: f64, vb: VarBuilder) -> Result<Self> {
        let shape = AttentionShape {
            hidden: c.hidden_size,
            heads: c.num_attention_heads,
            kv_heads: c.kv_heads(),
            head_dim: c.head_dim(),
        };
        let options = AttentionOptions {
            qkv_bias: c.qkv_bias(),
            o_bias: c.o_bias(),
            fused_qkv: false,
            qk_norm: None,
            eps: c.rms_norm_eps,
            window: c.layer_window(layer),
            scale: 1.0 / (c.head_dim() as f64).sqrt(),
            softcap: None,
            dropout: c.attention_dropout,
            rope: 0,
        };
        let (h, eps) = (c.hidden_size, c.rms_norm_eps);
        Ok(LlamaBlock {
            input_norm: Norm::new(h, eps, false, vb.pp("input_layernorm"))?,
            attn: SelfAttention::new(shape, options, std, vb.pp("self_attn"))?,
            post_norm: Norm::new(h, eps, false, vb.pp("post_attention_layernorm"))?,
            mlp: GatedMlp::new(
                (h, c.intermediate_size),
                c.mlp_bias.unwrap_or(false),
                c.hidden_act,
                MlpNames::LLAMA,
                std,
                vb.pp("mlp"),
            )?,
        })
    }
}

impl Block for LlamaBlock {
    fn forward(&self, x: &Tensor, ctx: &Context, train: bool) -> Result<BlockOutput> {
        let a = self
            .attn
            .forward(&self.input_norm.forward(x)?, ctx, train)?;
        let h = (x + a)?;
        let m = self.mlp.forward(&self.post_norm.forward(&h)?, train)?;
        Ok(BlockOutput {
            hidden: (&h + m)?,
            router_logits: None,
        })
    }

    fn projections_mut(&mut self) -> Vec<&mut Proj> {
        let mut out = self.attn.projections_mut();
        out.extend(self.mlp.projections_mut());
        out
    }
}

/// The layers of a Llama, Mistral or Qwen2 causal language model ([`LlamaForCausalLm`]).
#[derive(Debug, Clone)]
pub struct Llama {
    decoder: CausalDecoder<LlamaBlock>,
}

/// A Llama, Mistral or Qwen2 causal language model (`LlamaForCausalLM`, `MistralForCausalLM`,
/// `Qwen2ForCausalLM`), trainable: every parameter gets a gradient. It owns its parameters
/// ([`varmap`](crate::Pretrained::varmap)), under the checkpoints' names.
pub type LlamaForCausalLm = crate::Pretrained<Llama>;

impl Architecture for Llama {
    type Config = LlamaConfig;
    const MODEL_TYPES: &'static [&'static str] = &["llama", "mistral", "qwen2"];
    const CLASSES: &'static [&'static str] =
        &["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"];
    const TASK: Task = Task::CausalLm;
    const LORA_TARGETS: &'static [&'static str] = &["q_proj", "v_proj"];
    const PEFT_TASK_TYPE: Option<&'static str> = Some("CAUSAL_LM");

    fn class_name(config: &LlamaConfig) -> &'static str {
        config.causal_lm_class()
    }

    fn parameter_name(config: &LlamaConfig, name: &str) -> Option<String> {
        let skip = name.ends_with(".rotary_emb.inv_freq")
            || (config.tie_word_embeddings && name == "lm_head.weight");
        (!skip).then(|| name.to_string())
    }

    fn assemble(config: &LlamaConfig, vb: VarBuilder, std: f64) -> Result<Self> {
        let c = config;
        let embed_tokens =
            CausalDecoder::<LlamaBlock>::embedding(c.vocab_size, c.hidden_size, std, &vb)?;
        let m = vb.pp("model");
        let build = {
            let c = c.clone();
            BlockBuilder::new(move |i, vb: VarBuilder| {
                LlamaBlock::new(&c, i, std, vb.pp(format!("model.layers.{i}")))
            })
        };
        let layers = build.blocks(c.num_hidden_layers, &vb)?;
        let head = LmHead::new(&embed_tokens, c.tie_word_embeddings, None, std, vb.clone())?;
        Ok(Llama {
            decoder: CausalDecoder {
                build,
                embed_tokens,
                layers,
                norm: Norm::new(c.hidden_size, c.rms_norm_eps, false, m.pp("norm"))?,
                head,
                ropes: vec![Rope::new(c.rope()?, c.head_dim())],
                pad: padding_idx(&c.extra, c.vocab_size),
                embed_scale: None,
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

    fn memory_profile(c: &LlamaConfig) -> MemoryProfile {
        let (h, i) = (c.hidden_size as u64, c.intermediate_size as u64);
        let q = (c.num_attention_heads * c.head_dim()) as u64;
        let kv = (c.kv_heads() * c.head_dim()) as u64;
        let gqa = if c.kv_heads() < c.num_attention_heads {
            2 * q
        } else {
            0
        };
        MemoryProfile {
            hidden: c.hidden_size,
            intermediate: c.intermediate_size,
            layers: c.num_hidden_layers,
            heads: c.num_attention_heads,
            kv_heads: c.kv_heads(),
            head_dim: c.head_dim(),
            vocab: c.vocab_size,
            max_positions: max_position_embeddings(&c.extra),
            // norm, o_proj, two residual adds, norm, down_proj: 6h; q_proj, its contiguous head
            // layout, RoPE, the attention output and its merged copy: 5q; k_proj, v_proj, the
            // contiguous keys and their RoPE: 4kv; gate, up and SwiGLU: 3i; with grouped-query
            // attention the keys and values repeated to every head: 2q.
            block_elements: 6 * h + 5 * q + 4 * kv + 3 * i + gqa,
            // The embedding lookup and the final norm.
            outer_elements: 2 * h,
            lm_head: true,
        }
    }
}
