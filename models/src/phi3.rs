//! Phi-3 (`Phi3ForCausalLM`): Llama's decoder with the query, key and value projections fused in
//! one `qkv_proj` and the MLP's gate and up projections in one `gate_up_proj`, dropout on each
//! residual branch (`resid_pdrop`), a sliding window on every layer, and RoPE scaled as Phi-3's
//! long-context checkpoints do (`longrope`, also written `su`: per-frequency short and long
//! factors around `original_max_position_embeddings`, and an attention factor on cos and sin),
//! with partial rotation (`partial_rotary_factor`).

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
    Context, GatedMlp, LmHead, MlpNames, Norm, Rope, SelfAttention,
};
use crate::error::Result as CrateResult;
use crate::generate::{DecodeInputs, KvCache};
use crate::layers::{dropout, padding_idx};
use crate::rope::RopeConfig;

fn default_act() -> Activation {
    Activation::Silu
}
fn default_eps() -> f64 {
    1e-5
}
fn default_init() -> f64 {
    0.02
}

/// A Phi-3 `config.json` (`Phi3Config`). The five sizes are required; the rest default as in
/// `transformers`. Other keys (`original_max_position_embeddings`, ...) are kept in `extra` and
/// written back.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Phi3Config {
    /// Tokens in the vocabulary.
    pub vocab_size: usize,
    /// The model width.
    pub hidden_size: usize,
    /// The MLP's inner width (each half of `gate_up_proj`).
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
    /// The MLP's gate activation (`silu`).
    #[serde(default = "default_act")]
    pub hidden_act: Activation,
    /// RMSNorm's epsilon.
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f64,
    /// RoPE's base (transformers 4).
    #[serde(default)]
    pub rope_theta: Option<f64>,
    /// RoPE scaling (transformers 4): `{"type": "longrope" | "su", "short_factor": [...],
    /// "long_factor": [...]}`.
    #[serde(default)]
    pub rope_scaling: Option<Value>,
    /// RoPE settings (transformers 5).
    #[serde(default)]
    pub rope_parameters: Option<Value>,
    /// Dropout on each residual branch (training mode only).
    #[serde(default)]
    pub resid_pdrop: f64,
    /// Dropout on the attention probabilities (training mode only).
    #[serde(default)]
    pub attention_dropout: f64,
    /// Each query sees at most this many keys, on every layer.
    #[serde(default)]
    pub sliding_window: Option<usize>,
    /// The output layer shares the embedding matrix.
    #[serde(default)]
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

impl ModelConfig for Phi3Config {
    fn from_json(path: &Path, json: &Value) -> CrateResult<Self> {
        let mut c: Self = parse(path, json)?;
        c.origin = Origin::of(path, json);
        c.check()?;
        Ok(c)
    }

    fn to_json(&self) -> Value {
        config_value(self, &self.origin.present, "phi3")
    }

    fn path(&self) -> &Path {
        &self.origin.path
    }

    fn model_type(&self) -> &str {
        "phi3"
    }

    fn initializer_range(&self) -> f64 {
        self.initializer_range
    }
}

impl Phi3Config {
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
                ("head_dim", self.head_dim()),
            ],
        )?;
        ensure_layers(p, ("num_hidden_layers", self.num_hidden_layers))?;
        ensure_positive(p, &[("rms_norm_eps", self.rms_norm_eps)])?;
        ensure_init_range(p, self.initializer_range)?;
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
            self.sliding_window.is_none_or(|w| w > 0),
            p,
            "sliding_window",
            "must be at least 1",
        )?;
        ensure_probabilities(
            p,
            &[
                ("resid_pdrop", self.resid_pdrop),
                ("attention_dropout", self.attention_dropout),
            ],
        )?;
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

    /// The RoPE settings, standardized as `transformers` does for Phi-3: `su` and `yarn` read as
    /// `longrope`; `original_max_position_embeddings` (the top-level key first, else
    /// `max_position_embeddings`), `max_position_embeddings` (for the default extension factor)
    /// and a top-level `partial_rotary_factor` moved into the settings.
    pub fn rope(&self) -> CrateResult<RopeConfig> {
        let (at_parameters, mut map) = match (&self.rope_parameters, &self.rope_scaling) {
            (Some(Value::Object(m)), _) => (true, m.clone()),
            (None | Some(Value::Null), Some(Value::Object(m))) => (false, m.clone()),
            (None | Some(Value::Null), None | Some(Value::Null)) => (true, Default::default()),
            // Not an object: the parser names what is wrong.
            _ => {
                return RopeConfig::from_json(
                    &self.origin.path,
                    self.rope_theta,
                    self.rope_scaling.as_ref(),
                    self.rope_parameters.as_ref(),
                )
            }
        };
        for key in ["rope_type", "type"] {
            if matches!(map.get(key).and_then(Value::as_str), Some("su" | "yarn")) {
                map.insert(key.into(), "longrope".into());
            }
        }
        let top = |key: &str| self.extra.get(key).filter(|v| !v.is_null()).cloned();
        let max_positions = top("max_position_embeddings").unwrap_or(4096.into());
        match top("original_max_position_embeddings") {
            Some(v) => {
                map.insert("original_max_position_embeddings".into(), v);
            }
            None => {
                map.entry("original_max_position_embeddings")
                    .or_insert(max_positions.clone());
            }
        }
        map.entry("max_position_embeddings")
            .or_insert(max_positions);
        if let Some(v) = top("partial_rotary_factor") {
            map.entry("partial_rotary_factor").or_insert(v);
        }
        let map = Value::Object(map);
        let (scaling, parameters) = if at_parameters {
            (None, Some(&map))
        } else {
            (Some(&map), None)
        };
        RopeConfig::from_json(&self.origin.path, self.rope_theta, scaling, parameters)
    }
}

/// One Phi-3 decoder layer: fused projections and dropout on the residual branches.
#[derive(Debug, Clone)]
pub(crate) struct Phi3Block {
    input_norm: Norm,
    attn: SelfAttention,
    post_norm: Norm,
    mlp: GatedMlp,
    resid_pdrop: f64,
}

impl Phi3Block {
    fn new(c: &Phi3Config, std: f64, vb: VarBuilder) -> Result<Self> {
        let shape = AttentionShape {
            hidden: c.hidden_size,
            heads: c.num_attention_heads,
            kv_heads: c.kv_heads(),
            head_dim: c.head_dim(),
        };
        let options = AttentionOptions {
            qkv_bias: false,
            o_bias: false,
            fused_qkv: true,
            qk_norm: None,
            eps: c.rms_norm_eps,
            window: c.sliding_window,
            scale: 1.0 / (c.head_dim() as f64).sqrt(),
            softcap: None,
            dropout: c.attention_dropout,
            rope: 0,
        };
        let (h, eps) = (c.hidden_size, c.rms_norm_eps);
        let names = MlpNames {
            gate_up: None,
            fused: "gate_up_proj",
            down: "down_proj",
        };
        Ok(Phi3Block {
            input_norm: Norm::new(h, eps, false, vb.pp("input_layernorm"))?,
            attn: SelfAttention::new(shape, options, std, vb.pp("self_attn"))?,
            post_norm: Norm::new(h, eps, false, vb.pp("post_attention_layernorm"))?,
            mlp: GatedMlp::new(
                (h, c.intermediate_size),
                false,
                c.hidden_act,
                names,
                std,
                vb.pp("mlp"),
            )?,
            resid_pdrop: c.resid_pdrop,
        })
    }
}

impl Block for Phi3Block {
    fn forward(&self, x: &Tensor, ctx: &Context, train: bool) -> Result<BlockOutput> {
        let a = self
            .attn
            .forward(&self.input_norm.forward(x)?, ctx, train)?;
        let h = (x + dropout(&a, self.resid_pdrop, train)?)?;
        let m = self.mlp.forward(&self.post_norm.forward(&h)?, train)?;
        Ok(BlockOutput {
            hidden: (&h + dropout(&m, self.resid_pdrop, train)?)?,
            router_logits: None,
        })
    }

    fn projections_mut(&mut self) -> Vec<&mut Proj> {
        let mut out = self.attn.projections_mut();
        out.extend(self.mlp.projections_mut());
        out
    }
}

/// The layers of a Phi-3 causal language model ([`Phi3ForCausalLm`]).
#[derive(Debug, Clone)]
pub struct Phi3 {
    decoder: CausalDecoder<Phi3Block>,
}

/// A Phi-3 causal language model (`Phi3ForCausalLM`), trainable: every parameter gets a gradient.
/// `peft` has no default LoRA targets for it: name them (`qkv_proj`, `o_proj`, `gate_up_proj`,
/// `down_proj`).
pub type Phi3ForCausalLm = crate::Pretrained<Phi3>;

impl Architecture for Phi3 {
    type Config = Phi3Config;
    const MODEL_TYPES: &'static [&'static str] = &["phi3"];
    const CLASSES: &'static [&'static str] = &["Phi3ForCausalLM"];
    const TASK: Task = Task::CausalLm;
    /// None: `peft` has none for `phi3`.
    const LORA_TARGETS: &'static [&'static str] = &[];
    const PEFT_TASK_TYPE: Option<&'static str> = Some("CAUSAL_LM");

    fn parameter_name(config: &Phi3Config, name: &str) -> Option<String> {
        let skip =
            name.ends_with("inv_freq") || (config.tie_word_embeddings && name == "lm_head.weight");
        (!skip).then(|| name.to_string())
    }

    fn assemble(c: &Phi3Config, vb: VarBuilder, std: f64) -> Result<Self> {
        let embed_tokens =
            CausalDecoder::<Phi3Block>::embedding(c.vocab_size, c.hidden_size, std, &vb)?;
        let m = vb.pp("model");
        let build = {
            let c = c.clone();
            BlockBuilder::new(move |i, vb: VarBuilder| {
                Phi3Block::new(&c, std, vb.pp(format!("model.layers.{i}")))
            })
        };
        let layers = build.blocks(c.num_hidden_layers, &vb)?;
        let head = LmHead::new(&embed_tokens, c.tie_word_embeddings, None, std, vb.clone())?;
        Ok(Phi3 {
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

    fn memory_profile(c: &Phi3Config) -> MemoryProfile {
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
            // Llama's block (6h + 5q + 4kv + 3i, 2q more with grouped-query attention), the
            // fused gate_up's output (2i) instead of gate and up, and the narrowed gate and up
            // made contiguous for SwiGLU (2i).
            block_elements: 6 * h + 5 * q + 4 * kv + 5 * i + gqa,
            outer_elements: 2 * h,
            lm_head: true,
        }
    }
}
