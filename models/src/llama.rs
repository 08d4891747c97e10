//! The Llama family from one implementation: Llama 2 and 3 (grouped-query attention, RoPE with
//! Llama 3's scaling, SwiGLU, RMSNorm, tied or untied embeddings), Mistral (sliding window) and
//! Qwen2 (biases on the query, key and value projections), with `transformers`' parameter names
//! (`model.layers.0.self_attn.q_proj.weight`, ...).

use std::path::Path;

use accelerate_rs::nn::{checkpoint_fn, Linear, RmsNorm};
use accelerate_rs::{Accelerator, ShardSource, ShardedModel, WrapPolicy};
use candle_core::{DType, Device, Module, Result, Tensor};
use candle_nn::{Init, VarBuilder};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::config::{
    config_readers, ensure, ensure_init_range, ensure_layers, ensure_multiple, ensure_positive,
    ensure_probabilities, ensure_sizes, Activation, Origin,
};
use crate::error::Result as CrateResult;
use crate::layers::{
    attention, causal_lm_methods, check_mask, embedding, linear, lookup, padding_idx, repeat_kv,
    AttentionSpec,
};
use crate::lora::{adaptable, Proj};
use crate::pretrained::{pretrained_methods, Weights};
use crate::rope::{self, apply_rope, RopeConfig};

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

config_readers!(LlamaConfig);

impl LlamaConfig {
    fn check(&self) -> CrateResult<()> {
        let p = &self.origin.path;
        ensure(
            matches!(self.model_type.as_str(), "llama" | "mistral" | "qwen2"),
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
        let d = self.head_dim();
        ensure(
            d > 0 && d.is_multiple_of(2),
            p,
            "head_dim",
            format!("{d}: RoPE needs an even head width"),
        )?;
        if let Some(types) = &self.layer_types {
            ensure(
                types.len() == self.num_hidden_layers,
                p,
                "layer_types",
                format!(
                    "{} entries for {} layers",
                    types.len(),
                    self.num_hidden_layers
                ),
            )?;
            if let Some(bad) = types
                .iter()
                .find(|t| !matches!(t.as_str(), "full_attention" | "sliding_attention"))
            {
                return Err(crate::Error::config(
                    p,
                    Some("layer_types"),
                    format!("`{bad}` is not full_attention or sliding_attention"),
                ));
            }
        }
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
        match self.model_type.as_str() {
            "mistral" => Some(window),
            "qwen2" => {
                let sliding = match &self.layer_types {
                    Some(types) => types.get(i).is_some_and(|t| t == "sliding_attention"),
                    None => {
                        self.use_sliding_window.unwrap_or(false)
                            && i >= self.max_window_layers.unwrap_or(0)
                    }
                };
                sliding.then_some(window)
            }
            _ => None,
        }
    }

    /// Whether q, k and v have biases (Qwen2: always; Llama: `attention_bias`).
    fn qkv_bias(&self) -> bool {
        self.model_type == "qwen2" || self.attention_bias.unwrap_or(false)
    }

    /// Whether the output projection has a bias (Llama's `attention_bias`).
    fn o_bias(&self) -> bool {
        self.model_type != "qwen2" && self.attention_bias.unwrap_or(false)
    }

    /// The `transformers` class of a causal LM of this type.
    pub fn causal_lm_class(&self) -> &'static str {
        match self.model_type.as_str() {
            "mistral" => "MistralForCausalLM",
            "qwen2" => "Qwen2ForCausalLM",
            _ => "LlamaForCausalLM",
        }
    }
}

/// The parts of a model: embeddings, layers, final norm, output layer.
type Parts = (Tensor, Vec<DecoderLayer>, RmsNorm, Linear);

#[derive(Debug, Clone)]
struct SelfAttention {
    q: Proj,
    k: Proj,
    v: Proj,
    o: Proj,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    window: Option<usize>,
    dropout: f64,
}

impl SelfAttention {
    fn new(c: &LlamaConfig, layer: usize, std: f64, vb: VarBuilder) -> Result<Self> {
        let (h, kv, d) = (c.num_attention_heads, c.kv_heads(), c.head_dim());
        let bias = c.qkv_bias();
        Ok(SelfAttention {
            q: Proj::linear(c.hidden_size, h * d, bias, std, vb.pp("q_proj"))?,
            k: Proj::linear(c.hidden_size, kv * d, bias, std, vb.pp("k_proj"))?,
            v: Proj::linear(c.hidden_size, kv * d, bias, std, vb.pp("v_proj"))?,
            o: Proj::linear(h * d, c.hidden_size, c.o_bias(), std, vb.pp("o_proj"))?,
            heads: h,
            kv_heads: kv,
            head_dim: d,
            window: c.layer_window(layer),
            dropout: c.attention_dropout,
        })
    }

    fn forward(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        mask: Option<&Tensor>,
        train: bool,
    ) -> Result<Tensor> {
        let (b, t, _) = x.dims3()?;
        let d = self.head_dim;
        let split = |y: Tensor, n: usize| y.reshape((b, t, n, d))?.transpose(1, 2);
        let q = split(self.q.forward(x, train)?, self.heads)?;
        let k = split(self.k.forward(x, train)?, self.kv_heads)?;
        let v = split(self.v.forward(x, train)?, self.kv_heads)?;
        let q = apply_rope(&q, cos, sin)?;
        let k = apply_rope(&k, cos, sin)?;
        let rep = self.heads / self.kv_heads;
        let (k, v) = (repeat_kv(&k, rep)?, repeat_kv(&v, rep)?);
        let spec = AttentionSpec {
            causal: true,
            mask,
            window: self.window,
            scale: 1.0 / (d as f64).sqrt(),
            dropout: self.dropout,
        };
        let y = attention(&q, &k, &v, &spec, train)?;
        let y = y.transpose(1, 2)?.reshape((b, t, self.heads * d))?;
        self.o.forward(&y, train)
    }
}

#[derive(Debug, Clone)]
struct Mlp {
    gate: Proj,
    up: Proj,
    down: Proj,
    act: Activation,
}

impl Mlp {
    fn new(c: &LlamaConfig, std: f64, vb: VarBuilder) -> Result<Self> {
        let bias = c.mlp_bias.unwrap_or(false);
        let (h, i) = (c.hidden_size, c.intermediate_size);
        Ok(Mlp {
            gate: Proj::linear(h, i, bias, std, vb.pp("gate_proj"))?,
            up: Proj::linear(h, i, bias, std, vb.pp("up_proj"))?,
            down: Proj::linear(i, h, bias, std, vb.pp("down_proj"))?,
            act: c.hidden_act,
        })
    }

    fn forward(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        let (gate, up) = (self.gate.forward(x, train)?, self.up.forward(x, train)?);
        // SwiGLU as one fused op (`silu(gate) * up`, both gradients in one pass).
        let gated = match self.act {
            Activation::Silu | Activation::Swish => accelerate_rs::nn::swiglu(&gate, &up)?,
            act => (act.apply(&gate)? * up)?,
        };
        self.down.forward(&gated, train)
    }
}

#[derive(Debug, Clone)]
struct DecoderLayer {
    input_norm: RmsNorm,
    attn: SelfAttention,
    post_norm: RmsNorm,
    mlp: Mlp,
}

fn rms_norm(size: usize, eps: f64, vb: VarBuilder) -> Result<RmsNorm> {
    let w = vb.get_with_hints(size, "weight", Init::Const(1.0))?;
    Ok(RmsNorm::new(w, eps))
}

impl DecoderLayer {
    fn new(c: &LlamaConfig, layer: usize, std: f64, vb: VarBuilder) -> Result<Self> {
        Ok(DecoderLayer {
            input_norm: rms_norm(c.hidden_size, c.rms_norm_eps, vb.pp("input_layernorm"))?,
            attn: SelfAttention::new(c, layer, std, vb.pp("self_attn"))?,
            post_norm: rms_norm(
                c.hidden_size,
                c.rms_norm_eps,
                vb.pp("post_attention_layernorm"),
            )?,
            mlp: Mlp::new(c, std, vb.pp("mlp"))?,
        })
    }

    fn forward(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        mask: Option<&Tensor>,
        train: bool,
    ) -> Result<Tensor> {
        let h = (x + self
            .attn
            .forward(&self.input_norm.forward(x)?, cos, sin, mask, train)?)?;
        &h + self.mlp.forward(&self.post_norm.forward(&h)?, train)?
    }

    fn projections_mut(&mut self) -> [&mut Proj; 7] {
        let (a, m) = (&mut self.attn, &mut self.mlp);
        [
            &mut a.q,
            &mut a.k,
            &mut a.v,
            &mut a.o,
            &mut m.gate,
            &mut m.up,
            &mut m.down,
        ]
    }
}

/// A Llama, Mistral or Qwen2 causal language model (`LlamaForCausalLM`, `MistralForCausalLM`,
/// `Qwen2ForCausalLM`), trainable: every parameter gets a gradient. It owns its parameters
/// ([`varmap`](Self::varmap)), under the checkpoints' names.
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
pub struct LlamaForCausalLm {
    config: LlamaConfig,
    embed_tokens: Tensor,
    layers: Vec<DecoderLayer>,
    norm: RmsNorm,
    lm_head: Linear,
    inv_freq: Vec<f32>,
    weights: Weights,
}

pretrained_methods!(
    LlamaForCausalLm,
    config = LlamaConfig,
    architectures = ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"],
);

impl LlamaForCausalLm {
    /// Builds from `config` (parameters zeroed) and loads the weights at `dir` into it.
    pub(crate) fn load(
        config: LlamaConfig,
        dir: &Path,
        device: &Device,
        dtype: DType,
    ) -> CrateResult<Self> {
        let tied = config.tie_word_embeddings;
        let map = |name: &str| {
            let skip = name.ends_with(".rotary_emb.inv_freq") || (tied && name == "lm_head.weight");
            (!skip).then(|| name.to_string())
        };
        let model = Self::build(
            &config,
            candle_nn::VarMap::new(),
            device,
            dtype,
            0.0,
            Some((dir, &map)),
        )?;
        model.weights.load(dir, map)?;
        Ok(model)
    }

    /// The model around `parts` (built by [`assemble`](Self::assemble) over `weights`).
    fn from_parts(config: &LlamaConfig, parts: Parts, weights: Weights) -> CrateResult<Self> {
        let (embed_tokens, layers, norm, lm_head) = parts;
        Ok(LlamaForCausalLm {
            config: config.clone(),
            embed_tokens,
            layers,
            norm,
            lm_head,
            inv_freq: config.rope()?.inv_freq(config.head_dim()),
            weights,
        })
    }

    /// The layers, their parameters fetched from `vb`.
    fn assemble(config: &LlamaConfig, vb: VarBuilder, std: f64) -> CrateResult<Parts> {
        {
            let m = vb.pp("model");
            let embed_tokens = embedding(
                config.vocab_size,
                config.hidden_size,
                std,
                m.pp("embed_tokens"),
            )?;
            let layers = (0..config.num_hidden_layers)
                .map(|i| DecoderLayer::new(config, i, std, m.pp(format!("layers.{i}"))))
                .collect::<Result<Vec<_>>>()?;
            let norm = rms_norm(config.hidden_size, config.rms_norm_eps, m.pp("norm"))?;
            let lm_head = if config.tie_word_embeddings {
                Linear::new(embed_tokens.clone(), None)
            } else {
                linear(
                    config.hidden_size,
                    config.vocab_size,
                    false,
                    std,
                    vb.pp("lm_head"),
                )?
            };
            Ok((embed_tokens, layers, norm, lm_head))
        }
    }

    /// The configuration.
    pub fn config(&self) -> &LlamaConfig {
        &self.config
    }

    fn config_value(&self) -> Value {
        crate::config::config_value(
            &self.config,
            &self.config.origin.present,
            &self.config.model_type,
        )
    }

    fn class_name(&self) -> &'static str {
        self.config.causal_lm_class()
    }

    /// The final hidden states `[B, T, hidden]` (after the last norm) of `input_ids` `[B, T]`
    /// (integer ids), with an optional `attention_mask` `[B, T]` (1 for a token, 0 for padding:
    /// no query sees a padding key). Positions are `0..T` whatever the mask, as in
    /// `transformers`' forward.
    pub fn hidden_states(
        &self,
        input_ids: &Tensor,
        attention_mask: Option<&Tensor>,
    ) -> Result<Tensor> {
        Ok(self.hidden_and_head(input_ids, attention_mask)?.0)
    }

    /// The final hidden states and the output layer.
    fn hidden_and_head(
        &self,
        input_ids: &Tensor,
        attention_mask: Option<&Tensor>,
    ) -> Result<(Tensor, Linear)> {
        match &self.weights.sharded {
            Some(s) => self.sharded_hidden_and_head(s, input_ids, attention_mask),
            None => Ok((
                self.dense_hidden_states(input_ids, attention_mask)?,
                self.lm_head.clone(),
            )),
        }
    }

    /// [`hidden_states`](Self::hidden_states) over the whole parameters.
    fn dense_hidden_states(
        &self,
        input_ids: &Tensor,
        attention_mask: Option<&Tensor>,
    ) -> Result<Tensor> {
        let (b, t) = input_ids.dims2()?;
        check_mask(attention_mask, b, t)?;
        let pad = padding_idx(&self.config.extra, self.config.vocab_size);
        let mut h = lookup(&self.embed_tokens, input_ids, pad, "input_ids")?;
        let (cos, sin) = rope::tables(&self.inv_freq, t, h.dtype(), h.device())?;
        for layer in &self.layers {
            h = if self.weights.checkpointing {
                let (layer, cos, sin) = (layer.clone(), cos.clone(), sin.clone());
                let (mask, train) = (attention_mask.cloned(), self.weights.training);
                checkpoint_fn(
                    move |x| layer.forward(x, &cos, &sin, mask.as_ref(), train),
                    &h,
                )?
            } else {
                layer.forward(&h, &cos, &sin, attention_mask, self.weights.training)?
            };
        }
        self.norm.forward(&h)
    }

    /// ZeRO-3: the embeddings and the root unit (final norm, output layer) gathered and held
    /// until the backward pass ends; each decoder layer built from its gathered unit, run and
    /// recomputed in the backward pass, its gradients reduce-scattered right after.
    fn sharded_hidden_and_head(
        &self,
        s: &ShardedModel,
        input_ids: &Tensor,
        attention_mask: Option<&Tensor>,
    ) -> Result<(Tensor, Linear)> {
        let c = &self.config;
        let (b, t) = input_ids.dims2()?;
        check_mask(attention_mask, b, t)?;
        let pad = padding_idx(&c.extra, c.vocab_size);
        let emb = s
            .gather(EMBED_UNIT)?
            .get((c.vocab_size, c.hidden_size), "model.embed_tokens.weight")?;
        let mut h = lookup(&emb, input_ids, pad, "input_ids")?;
        let (cos, sin) = rope::tables(&self.inv_freq, t, h.dtype(), h.device())?;
        let config = std::sync::Arc::new(c.clone());
        for i in 0..c.num_hidden_layers {
            let unit = format!("model.layers.{i}");
            let (config, cos, sin) = (config.clone(), cos.clone(), sin.clone());
            let (mask, train) = (attention_mask.cloned(), self.weights.training);
            let (adapters, dtype) = (self.weights.adapters.clone(), self.weights.dtype);
            let prefix = unit.clone();
            h = s.run(&unit, &h, move |vb, x| {
                let mut layer = DecoderLayer::new(&config, i, 0.0, vb.pp(&prefix))?;
                if let Some(a) = &adapters {
                    crate::lora::attach(layer.projections_mut().into(), a, dtype, x.device())?;
                }
                layer.forward(x, &cos, &sin, mask.as_ref(), train)
            })?;
        }
        let root = s.gather("")?;
        let norm = rms_norm(c.hidden_size, c.rms_norm_eps, root.pp("model.norm"))?;
        let head = if c.tie_word_embeddings {
            Linear::new(emb, None)
        } else {
            linear(c.hidden_size, c.vocab_size, false, 0.0, root.pp("lm_head"))?
        };
        Ok((norm.forward(&h)?, head))
    }

    /// The ZeRO-3 units of a Llama: the embeddings, each decoder layer, and the root unit
    /// (the final norm and the output layer).
    pub fn wrap_policy(config: &LlamaConfig) -> WrapPolicy {
        let layers = (0..config.num_hidden_layers).map(|i| format!("model.layers.{i}"));
        WrapPolicy::prefixes(std::iter::once(EMBED_UNIT.to_string()).chain(layers))
    }

    /// [`from_pretrained`](Self::from_pretrained) at `zero_stage = 3`: the parameters are
    /// sharded over the ranks of `accelerator` by [`wrap_policy`](Self::wrap_policy), and each
    /// rank reads only its 1/N of every unit from the memory-mapped files (no rank holds the
    /// whole model). Every rank calls it. Forward and backward then gather each unit for the
    /// time it runs (decoder layers are recomputed in the backward pass); train it with the
    /// optimizer of `accelerator.prepare_sharded_optimizer(model.sharded_parameters(), opt)`.
    /// `dtype` is the parameters' (f32 under mixed precision, where the units are gathered in
    /// bf16). Below stage 3 an error naming `from_pretrained`.
    pub fn from_pretrained_sharded(
        dir: impl AsRef<Path>,
        accelerator: &Accelerator,
        dtype: DType,
    ) -> CrateResult<Self> {
        let dir = crate::config::model_folder(dir.as_ref())?;
        let (path, json) = crate::config::read_json(dir)?;
        crate::pretrained::check_architecture(
            &path,
            &json,
            &["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"],
        )?;
        let config = LlamaConfig::from_json(&path, &json)?;
        let tied = config.tie_word_embeddings;
        let map = |name: &str| {
            let skip = name.ends_with(".rotary_emb.inv_freq") || (tied && name == "lm_head.weight");
            (!skip).then(|| name.to_string())
        };
        Self::sharded(
            config,
            accelerator,
            dtype,
            ShardSource::Files {
                path: dir,
                map: &map,
            },
        )
    }

    /// [`from_config`](Self::from_config) at `zero_stage = 3`, the values drawn as
    /// `accelerate_rs::seeded_var_builder` draws them with `seed` (each rank draws one
    /// parameter at a time and keeps its pieces: the same model at any world size).
    pub fn from_config_sharded(
        config: &LlamaConfig,
        accelerator: &Accelerator,
        dtype: DType,
        seed: u64,
    ) -> CrateResult<Self> {
        Self::sharded(
            config.clone(),
            accelerator,
            dtype,
            ShardSource::Seeded(seed),
        )
    }

    fn sharded(
        config: LlamaConfig,
        accelerator: &Accelerator,
        dtype: DType,
        source: ShardSource<'_>,
    ) -> CrateResult<Self> {
        config.check()?;
        let std = config.initializer_range;
        let build = |vb: VarBuilder<'_>| -> Result<()> {
            Self::assemble(&config, vb, std)
                .map(drop)
                .map_err(|e| candle_core::Error::Msg(e.to_string()))
        };
        let policy = Self::wrap_policy(&config);
        let model = accelerator.shard_model(&policy, dtype, &build, source)?;
        let device = accelerator.device();
        let (vb, _) = accelerate_rs::shape_only_var_builder(dtype, device);
        let parts = Self::assemble(&config, vb, 0.0)?;
        Self::from_parts(&config, parts, Weights::sharded(model, dtype, device))
    }

    causal_lm_methods!();
}

/// The ZeRO-3 unit of the embeddings.
const EMBED_UNIT: &str = "model.embed_tokens";

adaptable!(
    LlamaForCausalLm,
    targets = ["q_proj", "v_proj"],
    task_type = Some("CAUSAL_LM"),
    |m| m
        .layers
        .iter_mut()
        .flat_map(DecoderLayer::projections_mut)
        .collect(),
);
