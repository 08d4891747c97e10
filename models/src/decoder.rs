//! The pieces the decoder-only language models share (Llama, Qwen3, Gemma, Phi-3, the mixtures
//! of experts): RMSNorm (plain or Gemma's `1 + w`), RoPE tables, grouped-query self-attention
//! with its options (biases, fused `qkv_proj`, q/k norms, sliding window, soft-capping, the
//! score scale), the gated MLP (split or fused `gate_up_proj`), the output layer (tied or not,
//! soft-capped or not), and [`CausalDecoder`]: embeddings, a stack of blocks run with or without
//! activation checkpointing, the final norm and the head.
//!
//! Generation's key/value cache sits in [`SelfAttention::forward`], between the projections
//! (after RoPE) and the attention: a cached step ([`CausalDecoder::decode`]) gives each block a
//! [`Context`] holding its layer's [`CacheSlot`], which appends the keys and values and attends
//! over every cached one.

use std::sync::Arc;

use accelerate_rs::nn::{
    checkpoint_fn, flash_attention_fused, rope_attention, swiglu, AttentionOptions as SdpaOptions,
    Linear, RmsNorm,
};
use accelerate_rs::WrapPolicy;
use candle_core::{DType, Device, Module, Result, Tensor};
use candle_nn::{Init, VarBuilder};

use crate::arch::{AttentionBackend, Hidden, Inputs, Mode, Proj, ShardedRun};
use crate::config::Activation;
use crate::generate::{CacheSlot, CachedSpec, DecodeInputs, KvCache};
use crate::layers::{
    attention, causal_lm_loss, causal_lm_loss_from_logits, check_documents, check_mask, embedding,
    linear, lookup, position_ids, softcap, AttentionSpec,
};
use crate::rope::{self, apply_rope, RopeConfig};

/// RMSNorm over the last dimension, its gain `w` (plain) or `1 + w` (Gemma's, whose `w` starts
/// at zero).
#[derive(Debug, Clone)]
pub(crate) struct Norm {
    weight: Tensor,
    eps: f64,
    offset: bool,
}

impl Norm {
    /// `weight` `[size]` under `vb`: ones, or zeros for Gemma's `1 + w`.
    pub(crate) fn new(size: usize, eps: f64, offset: bool, vb: VarBuilder) -> Result<Self> {
        let init = Init::Const(if offset { 0.0 } else { 1.0 });
        Ok(Norm {
            weight: vb.get_with_hints(size, "weight", init)?,
            eps,
            offset,
        })
    }

    /// The same norm over the weight under `vb` (ZeRO-3: its gathered unit).
    fn rebuilt(&self, vb: VarBuilder) -> Result<Self> {
        Norm::new(self.weight.dim(0)?, self.eps, self.offset, vb)
    }

    pub(crate) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let w = if self.offset {
            (&self.weight + 1.0)?
        } else {
            self.weight.clone()
        };
        RmsNorm::new(w, self.eps).forward(x)
    }
}

/// How a decoder rotates its queries and keys: the settings and the head width.
#[derive(Debug, Clone)]
pub(crate) struct Rope {
    config: RopeConfig,
    head_dim: usize,
}

impl Rope {
    pub(crate) fn new(config: RopeConfig, head_dim: usize) -> Self {
        Rope { config, head_dim }
    }

    /// cos and sin `[T, rotary_dim / 2]` for positions `0..t`.
    pub(crate) fn tables(
        &self,
        t: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<(Tensor, Tensor)> {
        let inv = self.config.inv_freq_for(self.head_dim, t);
        let scale = self.config.attention_factor() as f32;
        rope::tables(&inv, t, scale, dtype, device)
    }

    /// cos and sin `[B, T, rotary_dim / 2]` for the positions `[B][T]` of a generation step
    /// (`longrope` picks its factors by the largest position, as `transformers` does).
    pub(crate) fn tables_for_steps(
        &self,
        positions: &[Vec<u32>],
        dtype: DType,
        device: &Device,
    ) -> Result<(Tensor, Tensor)> {
        let (b, t) = (positions.len(), positions.first().map_or(0, Vec::len));
        let flat: Vec<u32> = positions.concat();
        let n = flat.iter().copied().max().map_or(1, |m| m as usize + 1);
        let (cos, sin) = self.tables(n, dtype, device)?;
        let at = Tensor::from_vec(flat, b * t, device)?;
        let half = cos.dim(1)?;
        Ok((
            cos.index_select(&at, 0)?.reshape((b, t, half))?,
            sin.index_select(&at, 0)?.reshape((b, t, half))?,
        ))
    }

    /// cos and sin `[B, T, rotary_dim / 2]` at `positions` (`[B·T]` u32, flattened, the largest
    /// `max`): the tables of positions `0..=max` (`longrope` picks its factors by `max + 1`, as
    /// `transformers` does from `position_ids`), gathered.
    pub(crate) fn tables_at(
        &self,
        (positions, max): (&Tensor, usize),
        (b, t): (usize, usize),
        dtype: DType,
    ) -> Result<(Tensor, Tensor)> {
        let (cos, sin) = self.tables(max + 1, dtype, positions.device())?;
        let pick = |table: Tensor| table.index_select(positions, 0)?.reshape((b, t, ()));
        Ok((pick(cos)?, pick(sin)?))
    }
}

/// What every block of one forward pass sees besides its input: the RoPE tables (one pair per
/// kind of layer: Gemma 3's local and global layers rotate with different bases; `[T, R/2]`, or
/// `[B, T, R/2]` at given position ids), the padding mask, the documents of packed rows and the
/// attention backend. Cloned into a checkpointed block's closure.
#[derive(Debug, Clone)]
pub(crate) struct Context {
    /// `(cos, sin)` per RoPE kind.
    pub(crate) rope: Vec<(Tensor, Tensor)>,
    /// `[B, T]`, 1 token, 0 padding.
    pub(crate) mask: Option<Tensor>,
    /// A generation step: this block's part of the key/value cache (the step's mask and
    /// positions with it; `mask` is then unused).
    pub(crate) cache: Option<CacheSlot>,
    /// `[B, T]` document ids (packed rows).
    pub(crate) documents: Option<Tensor>,
    /// Which attention runs.
    pub(crate) backend: AttentionBackend,
}

/// The shape of one layer's self-attention.
#[derive(Debug, Clone, Copy)]
pub(crate) struct AttentionShape {
    pub(crate) hidden: usize,
    pub(crate) heads: usize,
    pub(crate) kv_heads: usize,
    pub(crate) head_dim: usize,
}

/// Everything else about one layer's self-attention.
#[derive(Debug, Clone, Copy)]
pub(crate) struct AttentionOptions {
    /// Biases on q, k and v.
    pub(crate) qkv_bias: bool,
    /// A bias on the output projection.
    pub(crate) o_bias: bool,
    /// One `qkv_proj` (Phi-3) instead of `q_proj`, `k_proj`, `v_proj`.
    pub(crate) fused_qkv: bool,
    /// RMSNorms of each query and key head (`q_norm`, `k_norm`; Qwen3, Gemma 3): `Some(offset)`.
    pub(crate) qk_norm: Option<bool>,
    /// The norms' epsilon.
    pub(crate) eps: f64,
    /// The sliding window of this layer.
    pub(crate) window: Option<usize>,
    /// The factor on the scores (`1 / sqrt(head_dim)`, Gemma's `query_pre_attn_scalar^-0.5`).
    pub(crate) scale: f64,
    /// Soft-capping of the scores (Gemma 2).
    pub(crate) softcap: Option<f64>,
    /// Dropout on the probabilities (training mode).
    pub(crate) dropout: f64,
    /// Which RoPE tables of the [`Context`] this layer uses.
    pub(crate) rope: usize,
}

/// The query, key and value projections: three, or one fused.
#[derive(Debug, Clone)]
enum Qkv {
    Split { q: Proj, k: Proj, v: Proj },
    Fused(Proj),
}

/// Grouped-query self-attention with RoPE, as the Llama family writes it (`self_attn.q_proj`,
/// ...), with the options of the other decoders.
#[derive(Debug, Clone)]
pub(crate) struct SelfAttention {
    qkv: Qkv,
    o: Proj,
    q_norm: Option<Norm>,
    k_norm: Option<Norm>,
    shape: AttentionShape,
    options: AttentionOptions,
}

impl SelfAttention {
    /// The layer under `vb` (`.../self_attn`).
    pub(crate) fn new(
        shape: AttentionShape,
        options: AttentionOptions,
        std: f64,
        vb: VarBuilder,
    ) -> Result<Self> {
        let AttentionShape {
            hidden,
            heads,
            kv_heads,
            head_dim: d,
        } = shape;
        let bias = options.qkv_bias;
        let qkv = if options.fused_qkv {
            let out = (heads + 2 * kv_heads) * d;
            Qkv::Fused(Proj::linear(hidden, out, bias, std, vb.pp("qkv_proj"))?)
        } else {
            Qkv::Split {
                q: Proj::linear(hidden, heads * d, bias, std, vb.pp("q_proj"))?,
                k: Proj::linear(hidden, kv_heads * d, bias, std, vb.pp("k_proj"))?,
                v: Proj::linear(hidden, kv_heads * d, bias, std, vb.pp("v_proj"))?,
            }
        };
        let norm = |name: &str| -> Result<Option<Norm>> {
            options
                .qk_norm
                .map(|offset| Norm::new(d, options.eps, offset, vb.pp(name)))
                .transpose()
        };
        Ok(SelfAttention {
            qkv,
            o: Proj::linear(heads * d, hidden, options.o_bias, std, vb.pp("o_proj"))?,
            q_norm: norm("q_norm")?,
            k_norm: norm("k_norm")?,
            shape,
            options,
        })
    }

    /// `[B, T, heads·d]`, `[B, T, kv·d]`, `[B, T, kv·d]`.
    fn project(&self, x: &Tensor, train: bool) -> Result<(Tensor, Tensor, Tensor)> {
        match &self.qkv {
            Qkv::Split { q, k, v } => Ok((
                q.forward(x, train)?,
                k.forward(x, train)?,
                v.forward(x, train)?,
            )),
            Qkv::Fused(p) => {
                let y = p.forward(x, train)?;
                let d = self.shape.head_dim;
                let (q, kv) = (self.shape.heads * d, self.shape.kv_heads * d);
                Ok((
                    y.narrow(2, 0, q)?,
                    y.narrow(2, q, kv)?,
                    y.narrow(2, q + kv, kv)?,
                ))
            }
        }
    }

    pub(crate) fn forward(&self, x: &Tensor, ctx: &Context, train: bool) -> Result<Tensor> {
        let (b, t, _) = x.dims3()?;
        let (h, kv, d) = (self.shape.heads, self.shape.kv_heads, self.shape.head_dim);
        let (q, k, v) = self.project(x, train)?;
        // Sequence-major heads `[B, T, n, D]` (a free reshape), their norms if any.
        let seq = |y: Tensor, n: usize, norm: &Option<Norm>| -> Result<Tensor> {
            let y = y.reshape((b, t, n, d))?;
            match norm {
                Some(norm) => norm.forward(&y),
                None => Ok(y),
            }
        };
        let q = seq(q, h, &self.q_norm)?;
        let k = seq(k, kv, &self.k_norm)?;
        let v = seq(v, kv, &None)?;
        let (cos, sin) = ctx.rope.get(self.options.rope).ok_or_else(|| {
            candle_core::Error::Msg(format!("no RoPE tables of kind {}", self.options.rope))
        })?;
        if self.rope_attention_takes(&q, cos, ctx, train)? {
            // On a GPU: the rotary embeddings, the heads' transposes and the attention as one
            // node (`accelerate_rs::nn::rope_attention`), its output already sequence-major.
            let options = SdpaOptions::default()
                .causal(true)
                .scale(self.options.scale);
            let y = rope_attention(&q, &k, &v, cos, sin, &options)?;
            return self.o.forward(&y.reshape((b, t, h * d))?, train);
        }
        let (q, k, v) = (q.transpose(1, 2)?, k.transpose(1, 2)?, v.transpose(1, 2)?);
        let q = apply_rope(&q, cos, sin)?;
        let k = apply_rope(&k, cos, sin)?;
        if let Some(slot) = &ctx.cache {
            let spec = CachedSpec {
                window: self.options.window,
                scale: self.options.scale,
                softcap: self.options.softcap,
            };
            let y = slot.attend(&q, &k, &v, spec)?;
            let y = y.transpose(1, 2)?.reshape((b, t, h * d))?;
            return self.o.forward(&y, false);
        }
        // `attention` repeats the key/value heads where its path needs them (flash does not).
        let spec = AttentionSpec {
            causal: true,
            mask: ctx.mask.as_ref(),
            documents: ctx.documents.as_ref(),
            window: self.options.window,
            scale: self.options.scale,
            dropout: self.options.dropout,
            softcap: self.options.softcap,
            backend: ctx.backend,
        };
        let y = attention(&q, &k, &v, &spec, train)?;
        let y = y.transpose(1, 2)?.reshape((b, t, h * d))?;
        self.o.forward(&y, train)
    }

    /// Whether the attention of sequence-major `q` runs as `accelerate_rs::nn::rope_attention`:
    /// off the CPU (where flash attention runs), flash attention's kernel off, the whole head
    /// turned (no partial rotary), and nothing `rope_attention` does not do: no cache, padding
    /// mask, documents, cutting window, soft-capping, attention dropout in training or backend
    /// other than `Auto`.
    fn rope_attention_takes(
        &self,
        q: &Tensor,
        cos: &Tensor,
        ctx: &Context,
        train: bool,
    ) -> Result<bool> {
        let t = q.dim(1)?;
        // Off the CPU, or on it under the test switch that runs a GPU's graph there.
        let device_graph = accelerate_rs::nn::device_nodes_on_cpu()
            || (!q.device().is_cpu() && !flash_attention_fused(&q.transpose(1, 2)?)?);
        Ok(device_graph
            && ctx.cache.is_none()
            && ctx.mask.is_none()
            && ctx.documents.is_none()
            && ctx.backend == AttentionBackend::Auto
            && self.options.window.is_none_or(|w| w >= t)
            && self.options.softcap.is_none()
            && !(train && self.options.dropout > 0.0)
            && 2 * cos.dim(candle_core::D::Minus1)? == self.shape.head_dim)
    }

    pub(crate) fn projections_mut(&mut self) -> Vec<&mut Proj> {
        let mut out: Vec<&mut Proj> = match &mut self.qkv {
            Qkv::Split { q, k, v } => vec![q, k, v],
            Qkv::Fused(p) => vec![p],
        };
        out.push(&mut self.o);
        out
    }
}

/// The names of a gated MLP's projections under its prefix: `gate_proj`, `up_proj`,
/// `down_proj` (Mixtral's experts: `w1`, `w3`, `w2`); `None` for the gate and up halves fused in
/// one `gate_up_proj` (Phi-3).
#[derive(Debug, Clone, Copy)]
pub(crate) struct MlpNames {
    pub(crate) gate_up: Option<(&'static str, &'static str)>,
    pub(crate) fused: &'static str,
    pub(crate) down: &'static str,
}

impl MlpNames {
    /// `gate_proj`, `up_proj`, `down_proj`.
    pub(crate) const LLAMA: MlpNames = MlpNames {
        gate_up: Some(("gate_proj", "up_proj")),
        fused: "",
        down: "down_proj",
    };
}

/// `down(act(gate(x)) · up(x))`: SwiGLU (Llama), GeGLU (Gemma).
#[derive(Debug, Clone)]
pub(crate) struct GatedMlp {
    gate: Proj,
    /// `None`: the gate projection holds both halves (`gate_up_proj`, gate first).
    up: Option<Proj>,
    down: Proj,
    act: Activation,
}

impl GatedMlp {
    pub(crate) fn new(
        (hidden, inner): (usize, usize),
        bias: bool,
        act: Activation,
        names: MlpNames,
        std: f64,
        vb: VarBuilder,
    ) -> Result<Self> {
        let (gate, up) = match names.gate_up {
            Some((g, u)) => (
                Proj::linear(hidden, inner, bias, std, vb.pp(g))?,
                Some(Proj::linear(hidden, inner, bias, std, vb.pp(u))?),
            ),
            None => (
                Proj::linear(hidden, 2 * inner, bias, std, vb.pp(names.fused))?,
                None,
            ),
        };
        Ok(GatedMlp {
            gate,
            up,
            down: Proj::linear(inner, hidden, bias, std, vb.pp(names.down))?,
            act,
        })
    }

    pub(crate) fn forward(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        let silu = matches!(self.act, Activation::Silu | Activation::Swish);
        if let (true, Some(up)) = (silu, &self.up) {
            if let (Some(g), Some(u)) = (self.gate.plain(), up.plain()) {
                // Both projections and the gate as one node (one fused op on the CPU).
                let gated = accelerate_rs::nn::swiglu_linear(x, &g, &u)?;
                return self.down.forward(&gated, train);
            }
        }
        let (gate, up) = match &self.up {
            Some(up) => (self.gate.forward(x, train)?, up.forward(x, train)?),
            None => {
                let y = self.gate.forward(x, train)?;
                let n = y.dim(candle_core::D::Minus1)? / 2;
                (
                    y.narrow(candle_core::D::Minus1, 0, n)?,
                    y.narrow(candle_core::D::Minus1, n, n)?,
                )
            }
        };
        // SwiGLU as one fused op (`silu(gate) * up`, both gradients in one pass).
        let gated = match self.act {
            Activation::Silu | Activation::Swish => swiglu(&gate.contiguous()?, &up.contiguous()?)?,
            act => (act.apply(&gate)? * up)?,
        };
        self.down.forward(&gated, train)
    }

    /// A scalar zero that depends on every parameter (see [`Proj::zero_contribution`]).
    pub(crate) fn zero_contribution(&self) -> Result<Tensor> {
        let mut sum = self.gate.zero_contribution()?;
        if let Some(up) = &self.up {
            sum = (sum + up.zero_contribution()?)?;
        }
        sum + self.down.zero_contribution()?
    }

    pub(crate) fn projections_mut(&mut self) -> Vec<&mut Proj> {
        let mut out = vec![&mut self.gate];
        if let Some(up) = self.up.as_mut() {
            out.push(up);
        }
        out.push(&mut self.down);
        out
    }
}

/// The output layer: the embedding matrix (tied) or `lm_head`, and Gemma 2's soft-capping of the
/// logits.
#[derive(Debug, Clone)]
pub(crate) struct LmHead {
    head: Linear,
    softcap: Option<f64>,
    tied: bool,
}

impl LmHead {
    /// `lm_head.weight` under `vb` (the root), or `embed` when `tied`.
    pub(crate) fn new(
        embed: &Tensor,
        tied: bool,
        softcap: Option<f64>,
        std: f64,
        vb: VarBuilder,
    ) -> Result<Self> {
        let (vocab, hidden) = embed.dims2()?;
        let head = if tied {
            Linear::new(embed.clone(), None)
        } else {
            linear(hidden, vocab, false, std, vb.pp("lm_head"))?
        };
        Ok(LmHead {
            head,
            softcap,
            tied,
        })
    }

    /// This head, or (ZeRO-3) the same over the output layer built from its gathered unit.
    fn of(&self, hidden: &Hidden) -> Result<LmHead> {
        Ok(match hidden.gathered_head::<Linear>()? {
            Some(head) => LmHead {
                head: head.clone(),
                softcap: self.softcap,
                tied: self.tied,
            },
            None => self.clone(),
        })
    }

    /// `[B, T, vocab]`.
    pub(crate) fn logits(&self, hidden: &Tensor) -> Result<Tensor> {
        let logits = self.head.forward(hidden)?;
        match self.softcap {
            Some(cap) => softcap(&logits, cap),
            None => Ok(logits),
        }
    }

    /// The causal language-model loss: the head and the cross-entropy fused, or (soft-capped
    /// logits) composed.
    pub(crate) fn loss(&self, hidden: &Tensor, labels: &Tensor) -> Result<Tensor> {
        match self.softcap {
            None => causal_lm_loss(hidden, &self.head, labels),
            Some(_) => causal_lm_loss_from_logits(&self.logits(hidden)?, labels),
        }
    }
}

/// What one block returns: its output and, for a mixture of experts, its router logits
/// `[B·T, experts]`.
pub(crate) struct BlockOutput {
    pub(crate) hidden: Tensor,
    pub(crate) router_logits: Option<Tensor>,
}

/// One decoder block.
pub(crate) trait Block: Clone + std::fmt::Debug + Send + Sync + 'static {
    fn forward(&self, x: &Tensor, ctx: &Context, train: bool) -> Result<BlockOutput>;

    /// The experts its router chooses among, if it has one (its logits come back with the
    /// output, packed beside it through activation checkpointing).
    fn experts(&self) -> Option<usize> {
        None
    }

    fn projections_mut(&mut self) -> Vec<&mut Proj>;
}

/// Builds block `i` from a `VarBuilder` at the root (its parameters under
/// `model.layers.{i}`): how the blocks were made, kept so that ZeRO-3 builds each block again
/// from its gathered unit.
#[derive(Clone)]
pub(crate) struct BlockBuilder<B>(Arc<BuildBlock<B>>);

/// Block `i` from a `VarBuilder` at the root.
type BuildBlock<B> = dyn Fn(usize, VarBuilder) -> Result<B> + Send + Sync;

impl<B> BlockBuilder<B> {
    pub(crate) fn new(f: impl Fn(usize, VarBuilder) -> Result<B> + Send + Sync + 'static) -> Self {
        BlockBuilder(Arc::new(f))
    }

    /// Blocks `0..n` under `vb` (the root).
    pub(crate) fn blocks(&self, n: usize, vb: &VarBuilder) -> Result<Vec<B>> {
        (0..n).map(|i| (self.0)(i, vb.clone())).collect()
    }
}

impl<B> std::fmt::Debug for BlockBuilder<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("BlockBuilder")
    }
}

/// The ZeRO-3 unit of the token embeddings.
const EMBED_UNIT: &str = "model.embed_tokens";

/// The ZeRO-3 units of a decoder of `layers` blocks: the embeddings, each block
/// (`model.layers.{i}`), and the root unit holding the rest (the final norm, the output layer).
pub(crate) fn wrap_policy(layers: usize) -> WrapPolicy {
    let blocks = (0..layers).map(|i| format!("model.layers.{i}"));
    WrapPolicy::prefixes(std::iter::once(EMBED_UNIT.to_string()).chain(blocks))
}

/// A decoder-only language model: token embeddings (scaled by `sqrt(hidden)` for Gemma), the
/// blocks, the final norm and the output layer.
#[derive(Debug, Clone)]
pub(crate) struct CausalDecoder<B: Block> {
    /// How the blocks were made (ZeRO-3 makes them again from their gathered units).
    pub(crate) build: BlockBuilder<B>,
    pub(crate) embed_tokens: Tensor,
    pub(crate) layers: Vec<B>,
    pub(crate) norm: Norm,
    pub(crate) head: LmHead,
    /// One per RoPE kind the blocks use.
    pub(crate) ropes: Vec<Rope>,
    /// `pad_token_id`: the embedding's padding index.
    pub(crate) pad: Option<usize>,
    /// Gemma's `sqrt(hidden)` on the embeddings.
    pub(crate) embed_scale: Option<f64>,
}

/// The outputs of [`CausalDecoder::run`]: the final hidden states and every router's logits.
pub(crate) struct DecoderOutput {
    pub(crate) hidden: Tensor,
    pub(crate) router_logits: Vec<Tensor>,
    /// ZeRO-3: the output layer built from its gathered unit.
    pub(crate) head: Option<Linear>,
}

impl DecoderOutput {
    /// The hidden states (and the gathered head) without an auxiliary loss.
    pub(crate) fn into_hidden(self) -> Hidden {
        let hidden = Hidden::new(self.hidden);
        match self.head {
            Some(head) => hidden.with_head(head),
            None => hidden,
        }
    }
}

impl<B: Block> CausalDecoder<B> {
    /// The token embeddings `model.embed_tokens.weight` `[vocab, hidden]` under `vb` (the root).
    pub(crate) fn embedding(
        vocab: usize,
        hidden: usize,
        std: f64,
        vb: &VarBuilder,
    ) -> Result<Tensor> {
        embedding(vocab, hidden, std, vb.pp("model").pp("embed_tokens"))
    }

    /// The blocks over the embeddings of `inputs`, then the final norm.
    pub(crate) fn run(&self, inputs: &Inputs<'_>, mode: Mode) -> Result<DecoderOutput> {
        let ids = inputs.input_ids;
        let mut h = lookup(&self.embed_tokens, ids, self.pad, "input_ids")?;
        if let Some(s) = self.embed_scale {
            h = h.affine(s, 0.0)?;
        }
        let ctx = self.context(inputs, mode, &h)?;
        let mut router_logits = Vec::new();
        for layer in &self.layers {
            let out = run_block(layer, &h, &ctx, mode)?;
            h = out.hidden;
            router_logits.extend(out.router_logits);
        }
        Ok(DecoderOutput {
            hidden: self.norm.forward(&h)?,
            router_logits,
            head: None,
        })
    }

    /// [`run`](Self::run) at ZeRO stage 3: the embeddings and the root unit (final norm, output
    /// layer) gathered and held until the backward pass ends; each block built from its
    /// gathered unit (with the LoRA adapters attached), run, and recomputed in the backward
    /// pass, its gradients reduce-scattered right after. `mode.checkpointing` is implied.
    pub(crate) fn run_sharded(
        &self,
        inputs: &Inputs<'_>,
        mode: Mode,
        s: &ShardedRun,
    ) -> Result<DecoderOutput> {
        let ids = inputs.input_ids;
        let (b, t) = ids.dims2()?;
        let embed = s
            .gather(EMBED_UNIT)?
            .get(self.embed_tokens.dims2()?, "model.embed_tokens.weight")?;
        let mut h = lookup(&embed, ids, self.pad, "input_ids")?;
        if let Some(scale) = self.embed_scale {
            h = h.affine(scale, 0.0)?;
        }
        let ctx = self.context(inputs, mode, &h)?;
        let mut router_logits = Vec::new();
        for (i, layer) in self.layers.iter().enumerate() {
            let (build, ctx, train) = (self.build.clone(), ctx.clone(), mode.training);
            let packed = s.run_block(
                &format!("model.layers.{i}"),
                &h,
                move |vb| (build.0)(i, vb),
                B::projections_mut,
                move |block, x| pack(block.forward(x, &ctx, train)?, (b, t)),
            )?;
            let out = unpack(packed, layer.experts(), (b, t))?;
            h = out.hidden;
            router_logits.extend(out.router_logits);
        }
        let root = s.gather("")?;
        let norm = self.norm.rebuilt(root.pp("model").pp("norm"))?;
        let head = LmHead::new(&embed, self.head.tied, None, 0.0, root)?;
        Ok(DecoderOutput {
            hidden: norm.forward(&h)?,
            router_logits,
            head: Some(head.head),
        })
    }

    /// What every block sees besides its input `h` (the embeddings of `inputs`): the RoPE
    /// tables (at the position ids, if given), the padding mask, the documents and the backend,
    /// each checked against the input ids' shape.
    pub(crate) fn context(&self, inputs: &Inputs<'_>, mode: Mode, h: &Tensor) -> Result<Context> {
        let (b, t) = inputs.input_ids.dims2()?;
        check_mask(inputs.attention_mask, b, t)?;
        check_documents(inputs.document_ids, b, t)?;
        let positions = position_ids(inputs.position_ids, b, t)?;
        let rope = self
            .ropes
            .iter()
            .map(|r| match &positions {
                Some((p, max)) => r.tables_at((p, *max), (b, t), h.dtype()),
                None => r.tables(t, h.dtype(), h.device()),
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Context {
            rope,
            mask: inputs.attention_mask.cloned(),
            cache: None,
            documents: inputs.document_ids.cloned(),
            backend: mode.attention,
        })
    }

    /// One generation step (evaluation mode, no autograd graph kept): the blocks over the new
    /// tokens of `inputs`, each attending over its cached keys and values (the new ones
    /// appended to `cache`); the `[B, vocab]` logits of the last position.
    pub(crate) fn decode(&self, inputs: &DecodeInputs<'_>, cache: &mut KvCache) -> Result<Tensor> {
        let ids = inputs.input_ids;
        let (_, t) = ids.dims2()?;
        let step = cache.begin(inputs, self.layers.len())?;
        let mut h = lookup(&self.embed_tokens, ids, self.pad, "input_ids")?;
        if let Some(s) = self.embed_scale {
            h = h.affine(s, 0.0)?;
        }
        let rope = self
            .ropes
            .iter()
            .map(|r| r.tables_for_steps(inputs.position_ids, h.dtype(), h.device()))
            .collect::<Result<Vec<_>>>()?;
        for (i, layer) in self.layers.iter().enumerate() {
            let ctx = Context {
                rope: rope.clone(),
                mask: None,
                cache: Some(step.slot(i)?),
                documents: None,
                backend: AttentionBackend::default(),
            };
            h = layer.forward(&h, &ctx, false)?.hidden;
        }
        let last = self.norm.forward(&h.narrow(1, t - 1, 1)?)?;
        Ok(self.head.logits(&last)?.squeeze(1)?.detach())
    }

    /// The output layer's `[B, T, vocab]` logits of `hidden`.
    pub(crate) fn logits(&self, hidden: &Hidden) -> Result<Tensor> {
        self.head.of(hidden)?.logits(&hidden.states)
    }

    /// The causal language-model loss of `hidden` against `labels`, the auxiliary loss added.
    pub(crate) fn loss(&self, hidden: &Hidden, labels: &Tensor) -> Result<Tensor> {
        hidden.with_aux(self.head.of(hidden)?.loss(&hidden.states, labels)?)
    }

    pub(crate) fn projections_mut(&mut self) -> Vec<&mut Proj> {
        self.layers
            .iter_mut()
            .flat_map(B::projections_mut)
            .collect()
    }
}

/// One block on `x`, through `accelerate_rs::nn::checkpoint_fn` when `mode` checkpoints (a
/// router's logits packed beside the output on the last dimension, so that they come through
/// the one output a checkpointed block has).
fn run_block<B: Block>(block: &B, x: &Tensor, ctx: &Context, mode: Mode) -> Result<BlockOutput> {
    if !mode.checkpointing {
        return block.forward(x, ctx, mode.training);
    }
    let (b, t, _) = x.dims3()?;
    let (layer, ctx, train) = (block.clone(), ctx.clone(), mode.training);
    let packed = checkpoint_fn(move |x| pack(layer.forward(x, &ctx, train)?, (b, t)), x)?;
    unpack(packed, block.experts(), (b, t))
}

/// A block's output as one tensor: its router's logits, if any, beside the hidden states on the
/// last dimension (a recomputed block has one output).
fn pack(out: BlockOutput, (b, t): (usize, usize)) -> Result<Tensor> {
    match out.router_logits {
        Some(r) => {
            let r = r.reshape((b, t, ()))?.to_dtype(out.hidden.dtype())?;
            Tensor::cat(&[&out.hidden, &r], 2)
        }
        None => Ok(out.hidden),
    }
}

/// [`pack`] undone: `experts` router logits per token after the hidden states.
fn unpack(packed: Tensor, experts: Option<usize>, (b, t): (usize, usize)) -> Result<BlockOutput> {
    match experts {
        Some(e) => {
            let c = packed.dim(2)? - e;
            Ok(BlockOutput {
                hidden: packed.narrow(2, 0, c)?,
                router_logits: Some(packed.narrow(2, c, e)?.reshape((b * t, e))?),
            })
        }
        None => Ok(BlockOutput {
            hidden: packed,
            router_logits: None,
        }),
    }
}
