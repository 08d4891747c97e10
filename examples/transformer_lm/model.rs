//! A small decoder-only Transformer (GPT-style) in plain candle-nn: token + learned position
//! embeddings, pre-LayerNorm blocks with causal multi-head self-attention and a 4x GELU (or
//! ReLU) MLP, a final LayerNorm and an output head (tied to the token embedding or not).
//!
//! LayerNorm, the causal softmax, GELU/ReLU and the linear layers come from `accelerate_rs::nn`:
//! fused and differentiable (Candle's own fused CPU kernels for LayerNorm and softmax have no
//! backward pass, so everything before them would not train; its GELU and bias backward are
//! slow).

use accelerate_rs::nn::{linear, AttentionOptions, Linear};
use candle_core::{Module, Result, Tensor};
use candle_nn::{Embedding, Init, VarBuilder};

/// Architecture hyper-parameters.
#[derive(Clone, Copy, Debug)]
pub struct Config {
    pub vocab_size: usize,
    pub seq_len: usize,
    pub d_model: usize,
    pub heads: usize,
    pub layers: usize,
    pub tie_weights: bool,
    pub activation: Activation,
}

/// The MLP's non-linearity.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// GELU, tanh approximation (GPT-2).
    Gelu,
    /// ReLU (PyTorch's `nn.TransformerEncoderLayer` default).
    Relu,
}

impl std::str::FromStr for Activation {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "gelu" => Ok(Activation::Gelu),
            "relu" => Ok(Activation::Relu),
            _ => Err(format!("expected gelu or relu, got {s:?}")),
        }
    }
}

/// LayerNorm with weight and bias (`accelerate_rs::nn`'s fused, differentiable one).
struct LayerNorm(accelerate_rs::nn::LayerNorm);

impl LayerNorm {
    fn new(dim: usize, vb: VarBuilder) -> Result<Self> {
        Ok(LayerNorm(accelerate_rs::nn::LayerNorm::new(
            vb.get_with_hints(dim, "weight", Init::Const(1.0))?,
            vb.get_with_hints(dim, "bias", Init::Const(0.0))?,
            1e-5,
        )))
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.0.forward(x)
    }
}

/// Causal multi-head self-attention.
struct Attention {
    qkv: Linear,
    proj: Linear,
    heads: usize,
}

impl Attention {
    fn new(cfg: &Config, vb: VarBuilder) -> Result<Self> {
        Ok(Attention {
            qkv: linear(cfg.d_model, 3 * cfg.d_model, vb.pp("qkv"))?,
            proj: linear(cfg.d_model, cfg.d_model, vb.pp("proj"))?,
            heads: cfg.heads,
        })
    }

    /// `x`: `[B, T, C]`; position `t` attends to positions `0..=t`.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        // [B, T, 3C] (q, k, v side by side) -> [B, T, C], heads split and merged inside one
        // fused op, scaled by 1/sqrt(head_dim) and causally masked.
        let qkv = self.qkv.forward(x)?;
        let causal = AttentionOptions::default().causal(true);
        self.proj.forward(&accelerate_rs::nn::packed_self_attention(
            &qkv, self.heads, &causal,
        )?)
    }
}

/// Pre-LN block: `x + attn(ln1(x))`, then `x + mlp(ln2(x))`.
struct Block {
    ln1: LayerNorm,
    attn: Attention,
    ln2: LayerNorm,
    fc: Linear,
    fc_out: Linear,
    activation: Activation,
}

impl Block {
    fn new(cfg: &Config, vb: VarBuilder) -> Result<Self> {
        Ok(Block {
            ln1: LayerNorm::new(cfg.d_model, vb.pp("ln1"))?,
            attn: Attention::new(cfg, vb.pp("attn"))?,
            ln2: LayerNorm::new(cfg.d_model, vb.pp("ln2"))?,
            fc: linear(cfg.d_model, 4 * cfg.d_model, vb.pp("mlp.fc"))?,
            fc_out: linear(4 * cfg.d_model, cfg.d_model, vb.pp("mlp.proj"))?,
            activation: cfg.activation,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let x = (x + self.attn.forward(&self.ln1.forward(x)?)?)?;
        let h = self.ln2.forward(&x)?;
        let h = match self.activation {
            Activation::Gelu => accelerate_rs::nn::gelu(&self.fc.forward(&h)?)?,
            // The product and the ReLU as one op.
            Activation::Relu => accelerate_rs::nn::linear_relu(&h, &self.fc)?,
        };
        x + self.fc_out.forward(&h)?
    }
}

/// The language model: token ids `[B, T]` to logits `[B, T, vocab]`.
pub struct TransformerLm {
    tok: Embedding,
    pos: Embedding,
    blocks: Vec<Block>,
    ln_f: LayerNorm,
    /// `None` when the head is tied to the token embedding.
    head: Option<Linear>,
    cfg: Config,
}

impl TransformerLm {
    pub fn new(cfg: Config, vb: VarBuilder) -> Result<Self> {
        if !cfg.d_model.is_multiple_of(cfg.heads) {
            candle_core::bail!(
                "--d-model ({}) must be a multiple of --heads ({})",
                cfg.d_model,
                cfg.heads
            );
        }
        let tok = embedding(cfg.vocab_size, cfg.d_model, vb.pp("tok_emb"))?;
        let pos = embedding(cfg.seq_len, cfg.d_model, vb.pp("pos_emb"))?;
        let blocks = (0..cfg.layers)
            .map(|i| Block::new(&cfg, vb.pp(format!("blocks.{i}"))))
            .collect::<Result<Vec<_>>>()?;
        let ln_f = LayerNorm::new(cfg.d_model, vb.pp("ln_f"))?;
        let head = if cfg.tie_weights {
            None
        } else {
            // N(0, 0.02) like the embeddings, so the first loss is about ln(vocab).
            let vb = vb.pp("head");
            let init = Init::Randn {
                mean: 0.0,
                stdev: 0.02,
            };
            let weight = vb.get_with_hints((cfg.vocab_size, cfg.d_model), "weight", init)?;
            let bias = vb.get_with_hints(cfg.vocab_size, "bias", Init::Const(0.0))?;
            Some(Linear::new(weight, Some(bias)))
        };
        Ok(TransformerLm {
            tok,
            pos,
            blocks,
            ln_f,
            head,
            cfg,
        })
    }

    /// The hidden states after the final LayerNorm, `[B, T, d_model]`.
    pub fn hidden(&self, ids: &Tensor) -> Result<Tensor> {
        let (_b, t) = ids.dims2()?;
        if t > self.cfg.seq_len {
            candle_core::bail!(
                "sequence of {t} tokens, longer than --seq-len {}",
                self.cfg.seq_len
            );
        }
        let positions = Tensor::arange(0u32, t as u32, ids.device())?;
        let mut x = self
            .tok
            .forward(ids)?
            .broadcast_add(&self.pos.forward(&positions)?)?;
        for block in &self.blocks {
            x = block.forward(&x)?;
        }
        self.ln_f.forward(&x)
    }

    /// The output layer: its own, or the token embedding when tied.
    fn head(&self) -> Linear {
        match &self.head {
            Some(head) => head.clone(),
            None => Linear::new(self.tok.embeddings().clone(), None),
        }
    }

    /// Logits `[B, T, vocab]` (training goes through [`TransformerLm::loss`]; the benches use
    /// this).
    #[allow(dead_code)]
    pub fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        self.head().forward(&self.hidden(ids)?)
    }

    /// The mean next-token cross-entropy of `ids` (`[B, T]`) against `targets` (`[B, T]`), with
    /// the output layer and the loss fused (`accelerate_rs::nn::linear_cross_entropy`): the
    /// `[B, T, vocab]` logits never become a graph node of their own.
    pub fn loss(&self, ids: &Tensor, targets: &Tensor) -> Result<Tensor> {
        accelerate_rs::nn::linear_cross_entropy(
            &self.hidden(ids)?,
            &self.head(),
            targets,
            Default::default(),
        )
    }
}

/// An embedding table initialized N(0, 0.02) as in GPT-2 (Candle's `embedding` draws N(0, 1),
/// which makes a tied output head start with huge logits).
fn embedding(n: usize, dim: usize, vb: VarBuilder) -> Result<Embedding> {
    let init = Init::Randn {
        mean: 0.0,
        stdev: 0.02,
    };
    Ok(Embedding::new(
        vb.get_with_hints((n, dim), "weight", init)?,
        dim,
    ))
}
