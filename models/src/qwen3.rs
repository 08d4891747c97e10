//! Qwen3 (`Qwen3ForCausalLM`): Llama's decoder with an RMSNorm on each query and key head
//! (`q_norm`, `k_norm`, before RoPE), a head width of its own (`head_dim`, not
//! `hidden_size / num_attention_heads`), optional biases on every attention projection, and
//! sliding-window layers (`layer_types`, or `use_sliding_window` from `max_window_layers` on).

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
fn default_head_dim() -> usize {
    128
}
fn default_max_window_layers() -> usize {
    28
}

/// A Qwen3 `config.json` (`Qwen3Config`). The sizes but `head_dim` are required; the rest
/// default as in `transformers`. Other keys are kept in `extra` and written back.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Qwen3Config {
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
    /// The width of a head (default 128, whatever `hidden_size / num_attention_heads` is).
    #[serde(default = "default_head_dim")]
    pub head_dim: usize,
    /// The MLP's gate activation (`silu`).
    #[serde(default = "default_act")]
    pub hidden_act: Activation,
    /// RMSNorm's epsilon (also the q/k norms').
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f64,
    /// RoPE's base (transformers 4).
    #[serde(default)]
    pub rope_theta: Option<f64>,
    /// RoPE scaling (transformers 4).
    #[serde(default)]
    pub rope_scaling: Option<Value>,
    /// RoPE settings (transformers 5).
    #[serde(default)]
    pub rope_parameters: Option<Value>,
    /// Biases on q, k, v and o.
    #[serde(default)]
    pub attention_bias: bool,
    /// The output layer shares the embedding matrix.
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// Whether the sliding window applies at all.
    #[serde(default)]
    pub use_sliding_window: bool,
    /// The window of the layers that use one.
    #[serde(default)]
    pub sliding_window: Option<usize>,
    /// Without `layer_types`: the first layer with a sliding window.
    #[serde(default = "default_max_window_layers")]
    pub max_window_layers: usize,
    /// `full_attention` or `sliding_attention`, per layer.
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

impl ModelConfig for Qwen3Config {
    fn from_json(path: &Path, json: &Value) -> CrateResult<Self> {
        let mut c: Self = parse(path, json)?;
        c.origin = Origin::of(path, json);
        c.check()?;
        Ok(c)
    }

    fn to_json(&self) -> Value {
        config_value(self, &self.origin.present, "qwen3")
    }

    fn path(&self) -> &Path {
        &self.origin.path
    }

    fn model_type(&self) -> &str {
        "qwen3"
    }

    fn initializer_range(&self) -> f64 {
        self.initializer_range
    }
}

impl Qwen3Config {
    /// Reads a `config.json` (or the one in a model folder).
    pub fn from_file(path: impl AsRef<Path>) -> CrateResult<Self> {
        let (path, json) = read_json(path.as_ref())?;
        <Self as ModelConfig>::from_json(&path, &json)
    }

    /// Parses and checks a configuration; `path` is named in errors.
    pub fn from_json(path: &Path, json: &Value) -> CrateResult<Self> {
        <Self as ModelConfig>::from_json(path, json)
    }

    fn check(&self) -> CrateResult<()> {
        let p = &self.origin.path;
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
        ensure_positive(p, &[("rms_norm_eps", self.rms_norm_eps)])?;
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
        ensure_probabilities(p, &[("attention_dropout", self.attention_dropout)])?;
        self.rope()?.check_head_dim(p, "head_dim", self.head_dim)
    }

    /// Key/value heads.
    pub fn kv_heads(&self) -> usize {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    /// The RoPE settings.
    pub fn rope(&self) -> CrateResult<RopeConfig> {
        RopeConfig::from_json(
            &self.origin.path,
            self.rope_theta,
            self.rope_scaling.as_ref(),
            self.rope_parameters.as_ref(),
        )
    }

    /// The sliding window of layer `i`, if it has one (`use_sliding_window` on, and the layer a
    /// `sliding_attention` one, by default those from `max_window_layers` on).
    pub fn layer_window(&self, i: usize) -> Option<usize> {
        if !self.use_sliding_window {
            return None;
        }
        let window = self.sliding_window?;
        let sliding = match &self.layer_types {
            Some(types) => types.get(i).is_some_and(|t| t == "sliding_attention"),
            None => i >= self.max_window_layers,
        };
        sliding.then_some(window)
    }
}

/// One Qwen3 decoder layer: Llama's, with the q/k norms.
#[derive(Debug, Clone)]
pub(crate) struct Qwen3Block {
    input_norm: Norm,
    attn: SelfAttention,
    post_norm: Norm,
    mlp: GatedMlp,
}

impl Qwen3Block {
    fn new(c: &Qwen3Config, layer: usize, std: f64, vb: VarBuilder) -> Result<Self> {
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
            qk_norm: Some(false),
            eps: c.rms_norm_eps,
            window: c.layer_window(layer),
            scale: 1.0 / (c.head_dim as f64).sqrt(),
            softcap: None,
            dropout: c.attention_dropout,
            rope: 0,
        };
        let (h, eps) = (c.hidden_size, c.rms_norm_eps);
        Ok(Qwen3Block {
            input_norm: Norm::new(h, eps, false, vb.pp("input_layernorm"))?,
            attn: SelfAttention::new(shape, options, std, vb.pp("self_attn"))?,
            post_norm: Norm::new(h, eps, false, vb.pp("post_attention_layernorm"))?,
            mlp: GatedMlp::new(
                (h, c.intermediate_size),
                false,
                c.hidden_act,
                MlpNames::LLAMA,
                std,
                vb.pp("mlp"),
            )?,
        })
    }
}

impl Block for Qwen3Block {
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

/// The layers of a Qwen3 causal language model ([`Qwen3ForCausalLm`]).
#[derive(Debug, Clone)]
pub struct Qwen3 {
    decoder: CausalDecoder<Qwen3Block>,
}

/// A Qwen3 causal language model (`Qwen3ForCausalLM`), trainable: every parameter gets a
/// gradient, the q/k norms included.
pub type Qwen3ForCausalLm = crate::Pretrained<Qwen3>;

impl Architecture for Qwen3 {
    type Config = Qwen3Config;
    const MODEL_TYPES: &'static [&'static str] = &["qwen3"];
    const CLASSES: &'static [&'static str] = &["Qwen3ForCausalLM"];
    const TASK: Task = Task::CausalLm;
    const LORA_TARGETS: &'static [&'static str] = &["q_proj", "v_proj"];
    const PEFT_TASK_TYPE: Option<&'static str> = Some("CAUSAL_LM");

    fn parameter_name(config: &Qwen3Config, name: &str) -> Option<String> {
        let skip = name.ends_with(".rotary_emb.inv_freq")
            || (config.tie_word_embeddings && name == "lm_head.weight");
        (!skip).then(|| name.to_string())
    }

    fn assemble(c: &Qwen3Config, vb: VarBuilder, std: f64) -> Result<Self> {
        let embed_tokens =
            CausalDecoder::<Qwen3Block>::embedding(c.vocab_size, c.hidden_size, std, &vb)?;
        let m = vb.pp("model");
        let build = {
            let c = c.clone();
            BlockBuilder::new(move |i, vb: VarBuilder| {
                Qwen3Block::new(&c, i, std, vb.pp(format!("model.layers.{i}")))
            })
        };
        let layers = build.blocks(c.num_hidden_layers, &vb)?;
        let head = LmHead::new(&embed_tokens, c.tie_word_embeddings, None, std, vb.clone())?;
        Ok(Qwen3 {
            decoder: CausalDecoder {
                build,
                embed_tokens,
                layers,
                norm: Norm::new(c.hidden_size, c.rms_norm_eps, false, m.pp("norm"))?,
                head,
                ropes: vec![Rope::new(c.rope()?, c.head_dim)],
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

    fn memory_profile(c: &Qwen3Config) -> MemoryProfile {
        let (h, i) = (c.hidden_size as u64, c.intermediate_size as u64);
        let q = (c.num_attention_heads * c.head_dim) as u64;
        let kv = (c.kv_heads() * c.head_dim) as u64;
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
            head_dim: c.head_dim,
            vocab: c.vocab_size,
            max_positions: max_position_embeddings(&c.extra),
            // Llama's block (6h + 5q + 4kv + 3i, 2q more with grouped-query attention) and the
            // q/k norms' outputs: q + kv.
            block_elements: 6 * h + 6 * q + 5 * kv + 3 * i + gqa,
            outer_elements: 2 * h,
            lm_head: true,
        }
    }
}
