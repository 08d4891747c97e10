//! The pieces the decoder-only language models share (Llama, Qwen3, Gemma, Phi-3, the mixtures
//! of experts): RMSNorm (plain or Gemma's `1 + w`), RoPE tables, grouped-query self-attention
//! with its options (biases, fused `qkv_proj`, q/k norms, sliding window, soft-capping, the
//! score scale), the gated MLP (split or fused `gate_up_proj`), the output layer (tied or not,
//! soft-capped or not), and [`CausalDecoder`]: embeddings, a stack of blocks run with or without
//! activation checkpointing, the final norm and the head.
//!
//! A KV cache for generation would sit in [`SelfAttention::forward`], between the projections
//! (after RoPE) and [`attention`]: each block's attention is one value, reached through
//! [`Block`].

use accelerate_rs::nn::{checkpoint_fn, swiglu, Linear, RmsNorm};
use candle_core::{DType, Device, Module, Result, Tensor};
use candle_nn::{Init, VarBuilder};

use crate::arch::{Inputs, Mode, Proj};
use crate::config::Activation;
use crate::layers::{
    attention, causal_lm_loss, causal_lm_loss_from_logits, check_mask, embedding, linear, lookup,
    repeat_kv, softcap, AttentionSpec,
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
}

/// What every block of one forward pass sees besides its input: the RoPE tables (one pair per
/// kind of layer: Gemma 3's local and global layers rotate with different bases) and the padding
/// mask. Cloned into a checkpointed block's closure.
#[derive(Debug, Clone)]
pub(crate) struct Context {
    /// `(cos, sin)` per RoPE kind.
    pub(crate) rope: Vec<(Tensor, Tensor)>,
    /// `[B, T]`, 1 token, 0 padding.
    pub(crate) mask: Option<Tensor>,
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
        let heads = |y: Tensor, n: usize, norm: &Option<Norm>| -> Result<Tensor> {
            let y = y.reshape((b, t, n, d))?;
            let y = match norm {
                Some(norm) => norm.forward(&y)?,
                None => y,
            };
            y.transpose(1, 2)
        };
        let q = heads(q, h, &self.q_norm)?;
        let k = heads(k, kv, &self.k_norm)?;
        let v = heads(v, kv, &None)?;
        let (cos, sin) = ctx.rope.get(self.options.rope).ok_or_else(|| {
            candle_core::Error::Msg(format!("no RoPE tables of kind {}", self.options.rope))
        })?;
        let q = apply_rope(&q, cos, sin)?;
        let k = apply_rope(&k, cos, sin)?;
        let rep = h / kv;
        let (k, v) = (repeat_kv(&k, rep)?, repeat_kv(&v, rep)?);
        let spec = AttentionSpec {
            causal: true,
            mask: ctx.mask.as_ref(),
            window: self.options.window,
            scale: self.options.scale,
            dropout: self.options.dropout,
            softcap: self.options.softcap,
        };
        let y = attention(&q, &k, &v, &spec, train)?;
        let y = y.transpose(1, 2)?.reshape((b, t, h * d))?;
        self.o.forward(&y, train)
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
        Ok(LmHead { head, softcap })
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

/// A decoder-only language model: token embeddings (scaled by `sqrt(hidden)` for Gemma), the
/// blocks, the final norm and the output layer.
#[derive(Debug, Clone)]
pub(crate) struct CausalDecoder<B: Block> {
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
        let (b, t) = ids.dims2()?;
        check_mask(inputs.attention_mask, b, t)?;
        let mut h = lookup(&self.embed_tokens, ids, self.pad, "input_ids")?;
        if let Some(s) = self.embed_scale {
            h = h.affine(s, 0.0)?;
        }
        let rope = self
            .ropes
            .iter()
            .map(|r| r.tables(t, h.dtype(), h.device()))
            .collect::<Result<Vec<_>>>()?;
        let ctx = Context {
            rope,
            mask: inputs.attention_mask.cloned(),
        };
        let mut router_logits = Vec::new();
        for layer in &self.layers {
            let out = run_block(layer, &h, &ctx, mode)?;
            h = out.hidden;
            router_logits.extend(out.router_logits);
        }
        Ok(DecoderOutput {
            hidden: self.norm.forward(&h)?,
            router_logits,
        })
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
    let (b, t, c) = x.dims3()?;
    let (layer, ctx, train) = (block.clone(), ctx.clone(), mode.training);
    let packed = checkpoint_fn(
        move |x| {
            let out = layer.forward(x, &ctx, train)?;
            match out.router_logits {
                Some(r) => {
                    let r = r.reshape((b, t, ()))?.to_dtype(out.hidden.dtype())?;
                    Tensor::cat(&[&out.hidden, &r], 2)
                }
                None => Ok(out.hidden),
            }
        },
        x,
    )?;
    match block.experts() {
        Some(e) => Ok(BlockOutput {
            hidden: packed.narrow(2, 0, c)?,
            router_logits: Some(packed.narrow(2, c, e)?.reshape((b * t, e))?),
        }),
        None => Ok(BlockOutput {
            hidden: packed,
            router_logits: None,
        }),
    }
}
