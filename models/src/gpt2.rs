//! GPT-2 (`GPT2LMHeadModel`): learned positions, pre-norm blocks, its `Conv1D` weight layout
//! (`[in, out]`), the output layer tied to the token embeddings; `transformers`' parameter names
//! (`transformer.h.0.attn.c_attn.weight`, ...). At ZeRO stage 3 its units are the parameters
//! outside the blocks (`transformer`: the token and position embeddings and `ln_f`), each block
//! (`transformer.h.{i}`), and the root (an untied `lm_head`).

use std::path::Path;
use std::sync::Arc;

use accelerate_rs::nn::{
    checkpoint_fn, packed_self_attention, AttentionOptions, LayerNorm, Linear,
};
use accelerate_rs::WrapPolicy;
use candle_core::{Module, Result, Tensor};
use candle_nn::VarBuilder;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::arch::{
    Architecture, AttentionBackend, Hidden, Inputs, MemoryProfile, Mode, ModelConfig, Proj,
    ShardedRun, Task,
};
use crate::config::{
    config_value, ensure_init_range, ensure_layers, ensure_multiple, ensure_positive,
    ensure_probabilities, ensure_sizes, parse, read_json, Activation, Origin,
};
use crate::error::Result as CrateResult;
use crate::generate::{CacheSlot, CachedSpec, DecodeInputs, KvCache};
use crate::layers::{
    attention, causal_lm_loss, check_documents, check_mask, dropout, embedding, linear, lookup,
    norm_params, position_ids, AttentionSpec, Masks,
};

fn default_act() -> Activation {
    Activation::GeluNew
}
fn default_pdrop() -> f64 {
    0.1
}
fn default_eps() -> f64 {
    1e-5
}
fn default_init() -> f64 {
    0.02
}
fn yes() -> bool {
    true
}

/// A GPT-2 `config.json` (`GPT2Config`). `vocab_size`, `n_positions`, `n_embd`, `n_layer` and
/// `n_head` are required; the rest default as in `transformers`. Other keys are kept in `extra`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Gpt2Config {
    /// Tokens in the vocabulary.
    pub vocab_size: usize,
    /// The longest sequence (learned positions).
    pub n_positions: usize,
    /// The model width.
    pub n_embd: usize,
    /// Blocks.
    pub n_layer: usize,
    /// Attention heads.
    pub n_head: usize,
    /// The MLP's inner width; default `4 n_embd`.
    #[serde(default)]
    pub n_inner: Option<usize>,
    /// The MLP's activation (`gelu_new`).
    #[serde(default = "default_act")]
    pub activation_function: Activation,
    /// Dropout after each block's attention and MLP.
    #[serde(default = "default_pdrop")]
    pub resid_pdrop: f64,
    /// Dropout on the embeddings.
    #[serde(default = "default_pdrop")]
    pub embd_pdrop: f64,
    /// Dropout on the attention probabilities.
    #[serde(default = "default_pdrop")]
    pub attn_pdrop: f64,
    /// LayerNorm's epsilon.
    #[serde(default = "default_eps")]
    pub layer_norm_epsilon: f64,
    /// The standard deviation of the initial weights.
    #[serde(default = "default_init")]
    pub initializer_range: f64,
    /// Scores divided by `sqrt(head width)`.
    #[serde(default = "yes")]
    pub scale_attn_weights: bool,
    /// Scores also divided by the layer's index + 1.
    #[serde(default)]
    pub scale_attn_by_inverse_layer_idx: bool,
    /// The output layer is the token embedding matrix (default).
    #[serde(default = "yes")]
    pub tie_word_embeddings: bool,
    /// Every other key of the file, written back as it was.
    #[serde(flatten)]
    pub extra: serde_json::Map<String, Value>,
    /// The file it was read from and the keys it had.
    #[serde(skip)]
    origin: Origin,
}

impl ModelConfig for Gpt2Config {
    fn from_json(path: &Path, json: &Value) -> CrateResult<Self> {
        let mut c: Self = parse(path, json)?;
        c.origin = Origin::of(path, json);
        c.check()?;
        Ok(c)
    }

    fn to_json(&self) -> Value {
        config_value(self, &self.origin.present, "gpt2")
    }

    fn path(&self) -> &Path {
        &self.origin.path
    }

    fn model_type(&self) -> &str {
        "gpt2"
    }

    fn initializer_range(&self) -> f64 {
        self.initializer_range
    }
}

impl Gpt2Config {
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
                ("n_positions", self.n_positions),
                ("n_embd", self.n_embd),
                ("n_head", self.n_head),
            ],
        )?;
        if let Some(inner) = self.n_inner {
            ensure_sizes(p, &[("n_inner", inner)])?;
        }
        ensure_layers(p, ("n_layer", self.n_layer))?;
        ensure_positive(p, &[("layer_norm_epsilon", self.layer_norm_epsilon)])?;
        ensure_init_range(p, self.initializer_range)?;
        ensure_multiple(p, ("n_embd", self.n_embd), ("n_head", self.n_head), "")?;
        ensure_probabilities(
            p,
            &[
                ("resid_pdrop", self.resid_pdrop),
                ("embd_pdrop", self.embd_pdrop),
                ("attn_pdrop", self.attn_pdrop),
            ],
        )?;
        Ok(())
    }

    /// The MLP's inner width.
    pub fn inner(&self) -> usize {
        self.n_inner.unwrap_or(4 * self.n_embd)
    }
}

#[derive(Debug, Clone)]
struct Block {
    ln_1: LayerNorm,
    /// `transformers`' `Conv1D` layers: `y = x W + b` with `W` stored `[in, out]`.
    c_attn: Proj,
    c_proj: Proj,
    ln_2: LayerNorm,
    c_fc: Proj,
    mlp_proj: Proj,
    heads: usize,
    scale: f64,
    act: Activation,
    attn_pdrop: f64,
    resid_pdrop: f64,
}

fn layer_norm(size: usize, eps: f64, vb: VarBuilder) -> Result<LayerNorm> {
    let (w, b) = norm_params(size, true, &vb)?;
    let b = b.ok_or_else(|| candle_core::Error::Msg("layer norm without bias".into()))?;
    Ok(LayerNorm::new(w, b, eps))
}

impl Block {
    fn new(c: &Gpt2Config, layer: usize, std: f64, vb: VarBuilder) -> Result<Self> {
        let e = c.n_embd;
        let mut scale = if c.scale_attn_weights {
            1.0 / ((e / c.n_head) as f64).sqrt()
        } else {
            1.0
        };
        if c.scale_attn_by_inverse_layer_idx {
            scale /= (layer + 1) as f64;
        }
        Ok(Block {
            ln_1: layer_norm(e, c.layer_norm_epsilon, vb.pp("ln_1"))?,
            c_attn: Proj::conv1d(e, 3 * e, std, vb.pp("attn.c_attn"))?,
            c_proj: Proj::conv1d(e, e, std, vb.pp("attn.c_proj"))?,
            ln_2: layer_norm(e, c.layer_norm_epsilon, vb.pp("ln_2"))?,
            c_fc: Proj::conv1d(e, c.inner(), std, vb.pp("mlp.c_fc"))?,
            mlp_proj: Proj::conv1d(c.inner(), e, std, vb.pp("mlp.c_proj"))?,
            heads: c.n_head,
            scale,
            act: c.activation_function,
            attn_pdrop: c.attn_pdrop,
            resid_pdrop: c.resid_pdrop,
        })
    }

    /// The fused `packed_self_attention` over `c_attn`'s output, except on the CPU (tiled
    /// flash attention), with documents, attention dropout or the composed backend (through
    /// [`attention`]).
    fn attention(&self, x: &Tensor, masks: &Masks, train: bool) -> Result<Tensor> {
        let qkv = self.c_attn.forward(x, train)?;
        let fused = masks.backend == AttentionBackend::Auto
            && !qkv.device().is_cpu()
            && masks.documents.is_none()
            && !(train && self.attn_pdrop > 0.0);
        if !fused {
            let (b, t, c3) = qkv.dims3()?;
            let (h, d) = (self.heads, c3 / 3 / self.heads);
            let split = qkv.reshape((b, t, 3, h, d))?.permute((2, 0, 3, 1, 4))?;
            let spec = AttentionSpec {
                causal: true,
                mask: masks.mask.as_ref(),
                documents: masks.documents.as_ref(),
                window: None,
                scale: self.scale,
                dropout: self.attn_pdrop,
                softcap: None,
                backend: masks.backend,
            };
            let y = attention(&split.get(0)?, &split.get(1)?, &split.get(2)?, &spec, train)?;
            return y.transpose(1, 2)?.reshape((b, t, h * d));
        }
        let mut options = AttentionOptions::default().causal(true).scale(self.scale);
        if let Some(m) = &masks.mask {
            options = options.key_padding_mask(m.eq(0.0)?);
        }
        packed_self_attention(&qkv, self.heads, &options)
    }

    fn forward(&self, x: &Tensor, masks: &Masks, train: bool) -> Result<Tensor> {
        let a = self.attention(&self.ln_1.forward(x)?, masks, train)?;
        self.after_attention(x, &a, train)
    }

    /// A generation step: the attention over the cached keys and values of `slot` (the new
    /// ones appended), evaluation mode.
    fn forward_cached(&self, x: &Tensor, slot: &CacheSlot) -> Result<Tensor> {
        let qkv = self.c_attn.forward(&self.ln_1.forward(x)?, false)?;
        let (b, t, c3) = qkv.dims3()?;
        let (h, d) = (self.heads, c3 / 3 / self.heads);
        let split = qkv.reshape((b, t, 3, h, d))?.permute((2, 0, 3, 1, 4))?;
        let spec = CachedSpec {
            window: None,
            scale: self.scale,
            softcap: None,
        };
        let y = slot.attend(&split.get(0)?, &split.get(1)?, &split.get(2)?, spec)?;
        let y = y.transpose(1, 2)?.reshape((b, t, h * d))?;
        self.after_attention(x, &y, false)
    }

    /// The rest of the block after the attention `a` (heads merged) of `ln_1(x)`.
    fn after_attention(&self, x: &Tensor, a: &Tensor, train: bool) -> Result<Tensor> {
        let a = self.c_proj.forward(a, train)?;
        let h = (x + dropout(&a, self.resid_pdrop, train)?)?;
        let m = self.mlp_proj.forward(
            &self
                .act
                .apply(&self.c_fc.forward(&self.ln_2.forward(&h)?, train)?)?,
            train,
        )?;
        &h + dropout(&m, self.resid_pdrop, train)?
    }

    fn projections_mut(&mut self) -> Vec<&mut Proj> {
        vec![
            &mut self.c_attn,
            &mut self.c_proj,
            &mut self.c_fc,
            &mut self.mlp_proj,
        ]
    }
}

/// The ZeRO-3 unit of the parameters outside the blocks: `transformer.wte`, `transformer.wpe`
/// and `transformer.ln_f` (one prefix holds the three; the blocks' longer prefixes win for
/// theirs).
const OUTER_UNIT: &str = "transformer";

/// The layers of GPT-2 with its language-model head ([`Gpt2LmHeadModel`]).
#[derive(Debug, Clone)]
pub struct Gpt2 {
    /// How the blocks are made (ZeRO-3 makes them again from their gathered units).
    config: Arc<Gpt2Config>,
    wte: Tensor,
    wpe: Tensor,
    blocks: Vec<Block>,
    ln_f: LayerNorm,
    lm_head: Linear,
    n_positions: usize,
    embd_pdrop: f64,
}

/// GPT-2 with its language-model head (`GPT2LMHeadModel`), trainable: every parameter gets a
/// gradient. It owns its parameters ([`varmap`](crate::Pretrained::varmap)), under the
/// checkpoints' names. Checkpoints of the bare `GPT2Model` (names without `transformer.`, such
/// as the original `gpt2`) load too.
pub type Gpt2LmHeadModel = crate::Pretrained<Gpt2>;

impl Gpt2 {
    /// The embeddings of `inputs` (token plus position, dropout) over the matrices `wte` and
    /// `wpe` (this model's, or at ZeRO stage 3 the gathered ones), and what every block sees
    /// besides its input; the inputs' shapes and positions checked.
    fn embed(
        &self,
        wte: &Tensor,
        wpe: &Tensor,
        inputs: &Inputs<'_>,
        mode: Mode,
    ) -> Result<(Tensor, Masks)> {
        let (input_ids, attention_mask) = (inputs.input_ids, inputs.attention_mask);
        let (b, t) = input_ids.dims2()?;
        check_mask(attention_mask, b, t)?;
        check_documents(inputs.document_ids, b, t)?;
        let positions = position_ids(inputs.position_ids, b, t)?;
        let last = positions.as_ref().map_or(t, |(_, max)| max + 1);
        if last > self.n_positions {
            candle_core::bail!(
                "input_ids: position {} reached, but GPT-2 has positions for n_positions = {} only",
                last - 1,
                self.n_positions
            );
        }
        // GPT-2's embedding has no padding index.
        let tok = lookup(wte, input_ids, None, "input_ids")?;
        let pos = match &positions {
            Some((p, _)) => wpe.index_select(p, 0)?.reshape((b, t, ()))?,
            None => wpe.narrow(0, 0, t)?.unsqueeze(0)?,
        };
        let h = dropout(&tok.broadcast_add(&pos)?, self.embd_pdrop, mode.training)?;
        let masks = Masks {
            mask: attention_mask.cloned(),
            documents: inputs.document_ids.cloned(),
            backend: mode.attention,
        };
        Ok((h, masks))
    }

    /// The output layer: this model's, or (ZeRO-3) the one built from its gathered unit.
    fn head<'a>(&'a self, hidden: &'a Hidden) -> Result<&'a Linear> {
        Ok(hidden.gathered_head::<Linear>()?.unwrap_or(&self.lm_head))
    }
}

impl Architecture for Gpt2 {
    type Config = Gpt2Config;
    const MODEL_TYPES: &'static [&'static str] = &["gpt2"];
    const CLASSES: &'static [&'static str] = &["GPT2LMHeadModel", "GPT2Model"];
    const TASK: Task = Task::CausalLm;
    const LORA_TARGETS: &'static [&'static str] = &["c_attn"];
    const PEFT_TASK_TYPE: Option<&'static str> = Some("CAUSAL_LM");

    fn parameter_name(config: &Gpt2Config, name: &str) -> Option<String> {
        // The causal-mask buffers of older checkpoints.
        if name.ends_with(".attn.bias") || name.ends_with(".attn.masked_bias") {
            return None;
        }
        if name == "lm_head.weight" {
            return (!config.tie_word_embeddings).then(|| name.to_string());
        }
        if name.starts_with("transformer.") {
            Some(name.to_string())
        } else {
            Some(format!("transformer.{name}"))
        }
    }

    fn assemble(config: &Gpt2Config, vb: VarBuilder, std: f64) -> Result<Self> {
        let t = vb.pp("transformer");
        let wte = embedding(config.vocab_size, config.n_embd, std, t.pp("wte"))?;
        let wpe = embedding(config.n_positions, config.n_embd, std, t.pp("wpe"))?;
        let blocks = (0..config.n_layer)
            .map(|i| Block::new(config, i, std, t.pp(format!("h.{i}"))))
            .collect::<Result<Vec<_>>>()?;
        let ln_f = layer_norm(config.n_embd, config.layer_norm_epsilon, t.pp("ln_f"))?;
        let lm_head = if config.tie_word_embeddings {
            Linear::new(wte.clone(), None)
        } else {
            linear(
                config.n_embd,
                config.vocab_size,
                false,
                std,
                vb.pp("lm_head"),
            )?
        };
        Ok(Gpt2 {
            config: Arc::new(config.clone()),
            wte,
            wpe,
            blocks,
            ln_f,
            lm_head,
            n_positions: config.n_positions,
            embd_pdrop: config.embd_pdrop,
        })
    }

    fn projections_mut(&mut self) -> Vec<&mut Proj> {
        self.blocks
            .iter_mut()
            .flat_map(Block::projections_mut)
            .collect()
    }

    /// The final hidden states `[B, T, n_embd]` (after `ln_f`). Positions are the position ids,
    /// else `0..T`; a position at or past `n_positions` is an error.
    fn hidden_states(&self, inputs: &Inputs<'_>, mode: Mode) -> Result<Hidden> {
        let (mut h, masks) = self.embed(&self.wte, &self.wpe, inputs, mode)?;
        let train = mode.training;
        for block in &self.blocks {
            h = if mode.checkpointing {
                let (block, masks) = (block.clone(), masks.clone());
                checkpoint_fn(move |x| block.forward(x, &masks, train), &h)?
            } else {
                block.forward(&h, &masks, train)?
            };
        }
        Ok(Hidden::new(self.ln_f.forward(&h)?))
    }

    /// [`hidden_states`](Self::hidden_states) at ZeRO stage 3: the outer unit (embeddings,
    /// `ln_f`) gathered and held until the backward pass ends; each block built from its
    /// gathered unit (LoRA adapters attached), run and recomputed in the backward pass; the
    /// output layer (the gathered token embeddings, or the root unit's `lm_head`) comes back in
    /// the [`Hidden`].
    fn hidden_states_sharded(
        &self,
        inputs: &Inputs<'_>,
        mode: Mode,
        s: &ShardedRun,
    ) -> Result<Hidden> {
        let outer = s.gather(OUTER_UNIT)?.pp(OUTER_UNIT);
        let wte = outer.get(self.wte.dims2()?, "wte.weight")?;
        let wpe = outer.get(self.wpe.dims2()?, "wpe.weight")?;
        let (mut h, masks) = self.embed(&wte, &wpe, inputs, mode)?;
        let c = &self.config;
        for i in 0..self.blocks.len() {
            let (config, masks, train) = (self.config.clone(), masks.clone(), mode.training);
            let unit = format!("{OUTER_UNIT}.h.{i}");
            let at = unit.clone();
            h = s.run_block(
                &unit,
                &h,
                move |vb| Block::new(&config, i, 0.0, vb.pp(&at)),
                Block::projections_mut,
                move |block, x| block.forward(x, &masks, train),
            )?;
        }
        let ln_f = layer_norm(c.n_embd, c.layer_norm_epsilon, outer.pp("ln_f"))?;
        let head = if c.tie_word_embeddings {
            Linear::new(wte, None)
        } else {
            let root = s.gather("")?;
            linear(c.n_embd, c.vocab_size, false, 0.0, root.pp("lm_head"))?
        };
        Ok(Hidden::new(ln_f.forward(&h)?).with_head(head))
    }

    fn wrap_policy(config: &Gpt2Config) -> Option<WrapPolicy> {
        let blocks = (0..config.n_layer).map(|i| format!("{OUTER_UNIT}.h.{i}"));
        Some(WrapPolicy::prefixes(
            std::iter::once(OUTER_UNIT.to_string()).chain(blocks),
        ))
    }

    /// A generation step: learned positions at `inputs.position_ids` (below `n_positions`).
    fn decode(&self, inputs: &DecodeInputs<'_>, cache: &mut KvCache) -> Result<Tensor> {
        let ids = inputs.input_ids;
        let (b, t) = ids.dims2()?;
        let step = cache.begin(inputs, self.blocks.len())?;
        let flat: Vec<u32> = inputs.position_ids.concat();
        if let Some(&p) = flat
            .iter()
            .max()
            .filter(|&&p| p as usize >= self.n_positions)
        {
            candle_core::bail!(
                "position {p}: GPT-2 has positions for n_positions = {} only (prompt and new \
                 tokens together)",
                self.n_positions
            );
        }
        let at = Tensor::from_vec(flat, b * t, ids.device())?;
        let pos = self.wpe.index_select(&at, 0)?.reshape((b, t, ()))?;
        let mut h = (lookup(&self.wte, ids, None, "input_ids")? + pos)?;
        for (i, block) in self.blocks.iter().enumerate() {
            h = block.forward_cached(&h, &step.slot(i)?)?;
        }
        let last = self.ln_f.forward(&h.narrow(1, t - 1, 1)?)?;
        Ok(self.lm_head.forward(&last)?.squeeze(1)?.detach())
    }

    fn logits(&self, hidden: &Hidden, _mode: Mode) -> Result<Tensor> {
        self.head(hidden)?.forward(&hidden.states)
    }

    fn loss(&self, hidden: &Hidden, labels: &Tensor, _mode: Mode) -> Result<Tensor> {
        hidden.with_aux(causal_lm_loss(&hidden.states, self.head(hidden)?, labels)?)
    }

    fn memory_profile(c: &Gpt2Config) -> MemoryProfile {
        let (h, i) = (c.n_embd as u64, c.inner() as u64);
        MemoryProfile {
            hidden: c.n_embd,
            intermediate: c.inner(),
            layers: c.n_layer,
            heads: c.n_head,
            kv_heads: c.n_head,
            head_dim: c.n_embd / c.n_head.max(1),
            vocab: c.vocab_size,
            max_positions: c.n_positions,
            // ln_1, c_attn (3h), attention, c_proj, add, ln_2, mlp c_proj, add; c_fc and GELU
            // (packed attention: no head copies).
            block_elements: 9 * h + 2 * i,
            // Token and position embeddings, their sum, ln_f.
            outer_elements: 4 * h,
            lm_head: true,
        }
    }
}
