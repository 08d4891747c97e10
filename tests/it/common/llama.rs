//! A Llama-style language model built with `accelerate_rs::nn` (RMSNorm, RoPE, grouped-query
//! attention as one fused op, SwiGLU MLP, untied output layer) as Hugging Face's
//! `LlamaDecoderLayer` is written for Candle, and the peak memory of training it, measured in a
//! process of its own: what `estimate-memory`'s prediction is checked against. Shared by the
//! integration test (`tests/it/memory.rs`) and the benchmark (`benches/memory.rs`).

use std::sync::Arc;

use accelerate_rs::nn::{self, AttentionOptions, Linear, RmsNorm};
use accelerate_rs::optim::AdamW;
use accelerate_rs::{Accelerator, MixedPrecision};
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{Embedding, Optimizer, ParamsAdamW, VarBuilder, VarMap};

/// The model's sizes and the training step's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LlamaRun {
    pub hidden: usize,
    pub intermediate: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub vocab: usize,
    pub batch: usize,
    pub seq: usize,
    /// Every block through `nn::checkpoint_fn`.
    pub checkpoint: bool,
    /// bf16 mixed precision (f32 masters) instead of f32.
    pub bf16: bool,
    /// Optimizer steps measured.
    pub steps: usize,
}

impl LlamaRun {
    /// The model as `estimate-memory` sees it: its parameters (from a dry run of its
    /// constructor, nothing allocated) and what its blocks keep per token, counted as
    /// `accelerate-rs-models` counts Llama's (the same layers).
    pub fn architecture(&self) -> accelerate_rs::memory::Architecture {
        let (vb, shapes) = accelerate_rs::shape_only_var_builder(DType::F32, &Device::Cpu);
        if let Err(e) = Model::new(self, vb, DType::F32) {
            panic!("the test model's dry run failed: {e}");
        }
        let parameters = shapes
            .specs()
            .into_iter()
            .map(|s| accelerate_rs::memory::TensorInfo {
                name: s.name,
                shape: s.shape,
                dtype: "F32".into(),
            })
            .collect();
        let (h, i) = (self.hidden as u64, self.intermediate as u64);
        let d = self.hidden / self.heads;
        let (q, kv) = (h, (self.kv_heads * d) as u64);
        let gqa = if self.kv_heads < self.heads { 2 * q } else { 0 };
        accelerate_rs::memory::Architecture {
            name: "llama".into(),
            hidden: self.hidden,
            intermediate: self.intermediate,
            layers: self.layers,
            heads: self.heads,
            kv_heads: self.kv_heads,
            head_dim: d,
            vocab: self.vocab,
            max_positions: self.seq,
            block_elements: 6 * h + 5 * q + 4 * kv + 3 * i + gqa,
            outer_elements: 2 * h,
            lm_head: true,
            default_lora_targets: vec!["q_proj".into(), "v_proj".into()],
            parameters,
        }
    }

    /// The run as one line of text (for a child process's environment), and back.
    pub fn encode(&self) -> String {
        [
            self.hidden,
            self.intermediate,
            self.layers,
            self.heads,
            self.kv_heads,
            self.vocab,
            self.batch,
            self.seq,
            self.checkpoint as usize,
            self.bf16 as usize,
            self.steps,
        ]
        .map(|v| v.to_string())
        .join(",")
    }

    pub fn decode(s: &str) -> Option<Self> {
        let v: Vec<usize> = s
            .split(',')
            .map(|x| x.parse().ok())
            .collect::<Option<_>>()?;
        let &[hidden, intermediate, layers, heads, kv_heads, vocab, batch, seq, ck, bf, steps] =
            v.as_slice()
        else {
            return None;
        };
        Some(LlamaRun {
            hidden,
            intermediate,
            layers,
            heads,
            kv_heads,
            vocab,
            batch,
            seq,
            checkpoint: ck == 1,
            bf16: bf == 1,
            steps,
        })
    }
}

#[derive(Clone)]
struct Block {
    norm1: RmsNorm,
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    norm2: RmsNorm,
    gate: Linear,
    up: Linear,
    down: Linear,
    heads: usize,
    kv_heads: usize,
    cos: Tensor,
    sin: Tensor,
}

impl Block {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let (b, t, h) = x.dims3()?;
        let d = h / self.heads;
        let n = self.norm1.forward(x)?;
        let q = self.q.forward(&n)?;
        let k = self.k.forward(&n)?;
        let v = self.v.forward(&n)?;
        let q = q
            .reshape((b, t, self.heads, d))?
            .transpose(1, 2)?
            .contiguous()?;
        let k = k
            .reshape((b, t, self.kv_heads, d))?
            .transpose(1, 2)?
            .contiguous()?;
        let v = v.reshape((b, t, self.kv_heads, d))?.transpose(1, 2)?;
        let q = nn::rope(&q, &self.cos, &self.sin)?;
        let k = nn::rope(&k, &self.cos, &self.sin)?;
        let rep = self.heads / self.kv_heads;
        let (k, v) = if rep > 1 {
            let repeat = |x: &Tensor| -> candle_core::Result<Tensor> {
                x.unsqueeze(2)?
                    .expand((b, self.kv_heads, rep, t, d))?
                    .reshape((b, self.heads, t, d))
            };
            (repeat(&k)?, repeat(&v)?)
        } else {
            (k, v)
        };
        let y = nn::scaled_dot_product_attention(
            &q,
            &k,
            &v,
            &AttentionOptions::default().causal(true),
        )?;
        let y = y.transpose(1, 2)?.reshape((b, t, h))?;
        let x = (x + self.o.forward(&y)?)?;
        let n = self.norm2.forward(&x)?;
        let m = nn::swiglu(&self.gate.forward(&n)?, &self.up.forward(&n)?)?;
        x + self.down.forward(&m)?
    }
}

struct Model {
    embed: Embedding,
    blocks: Vec<Block>,
    norm: RmsNorm,
    head: Linear,
    checkpoint: bool,
}

impl Model {
    fn new(r: &LlamaRun, vb: VarBuilder, dtype: DType) -> candle_core::Result<Self> {
        let (h, i) = (r.hidden, r.intermediate);
        let d = h / r.heads;
        let kv = r.kv_heads * d;
        // RoPE tables: [seq, d / 2].
        let inv: Vec<f32> = (0..d / 2)
            .map(|j| 1.0 / 10000f32.powf(2.0 * j as f32 / d as f32))
            .collect();
        let angles: Vec<f32> = (0..r.seq)
            .flat_map(|p| inv.iter().map(move |f| p as f32 * f))
            .collect();
        let angles = Tensor::from_vec(angles, (r.seq, d / 2), &Device::Cpu)?;
        let (cos, sin) = (
            angles.cos()?.to_dtype(dtype)?,
            angles.sin()?.to_dtype(dtype)?,
        );
        let mut blocks = Vec::new();
        for l in 0..r.layers {
            let vb = vb.pp(format!("model.layers.{l}"));
            let a = vb.pp("self_attn");
            let m = vb.pp("mlp");
            blocks.push(Block {
                norm1: nn::rms_norm(h, 1e-5, vb.pp("input_layernorm"))?,
                q: nn::linear_no_bias(h, h, a.pp("q_proj"))?,
                k: nn::linear_no_bias(h, kv, a.pp("k_proj"))?,
                v: nn::linear_no_bias(h, kv, a.pp("v_proj"))?,
                o: nn::linear_no_bias(h, h, a.pp("o_proj"))?,
                norm2: nn::rms_norm(h, 1e-5, vb.pp("post_attention_layernorm"))?,
                gate: nn::linear_no_bias(h, i, m.pp("gate_proj"))?,
                up: nn::linear_no_bias(h, i, m.pp("up_proj"))?,
                down: nn::linear_no_bias(i, h, m.pp("down_proj"))?,
                heads: r.heads,
                kv_heads: r.kv_heads,
                cos: cos.clone(),
                sin: sin.clone(),
            });
        }
        Ok(Model {
            embed: candle_nn::embedding(r.vocab, h, vb.pp("model.embed_tokens"))?,
            blocks,
            norm: nn::rms_norm(h, 1e-5, vb.pp("model.norm"))?,
            head: nn::linear_no_bias(h, r.vocab, vb.pp("lm_head"))?,
            checkpoint: r.checkpoint,
        })
    }

    fn loss(&self, tokens: &Tensor, targets: &Tensor) -> candle_core::Result<Tensor> {
        let mut x = self.embed.forward(tokens)?;
        for b in &self.blocks {
            x = if self.checkpoint {
                let b = Arc::new(b.clone());
                nn::checkpoint_fn(move |x: &Tensor| b.forward(x), &x)?
            } else {
                b.forward(&x)?
            };
        }
        let logits = self.head.forward(&self.norm.forward(&x)?)?;
        let logits = logits.flatten_to(1)?.to_dtype(DType::F32)?;
        nn::cross_entropy(&logits, &targets.flatten_all()?)
    }
}

/// `VmRSS` and `VmHWM` of this process, in bytes.
pub fn rss() -> (u64, u64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|kb| kb.parse::<u64>().ok())
            .map_or(0, |kb| kb * 1024)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// Resets `VmHWM` to the current resident size (Linux: `5` to `/proc/self/clear_refs`).
pub fn reset_peak() -> std::io::Result<()> {
    std::fs::write("/proc/self/clear_refs", "5")
}

/// What a child process measured: the resident size before the model existed, the peak during
/// training, and the tensors the last step's graph held (views counted in full).
#[derive(Clone, Copy, Debug)]
pub struct Measured {
    pub baseline: u64,
    pub peak: u64,
    pub graph: u64,
}

impl Measured {
    pub fn line(&self) -> String {
        format!(
            "measured baseline {} peak {} graph {}",
            self.baseline, self.peak, self.graph
        )
    }

    pub fn parse(text: &str) -> Option<Self> {
        // The line may follow libtest's `test ... ` prefix.
        let l = text
            .lines()
            .find_map(|l| l.find("measured baseline ").map(|i| &l[i..]))?;
        let w: Vec<&str> = l.split_whitespace().collect();
        Some(Measured {
            baseline: w.get(2)?.parse().ok()?,
            peak: w.get(4)?.parse().ok()?,
            graph: w.get(6)?.parse().ok()?,
        })
    }
}

/// Trains the model `r.steps` optimizer steps (AdamW, one process) and measures the peak
/// resident size above what the process held before the model was built (`at_baseline` runs
/// then, for a caller that measures more). Run it in a fresh process: the peak is the
/// process's.
pub fn train_and_measure(r: &LlamaRun, at_baseline: &dyn Fn()) -> accelerate_rs::Result<Measured> {
    let acc = Accelerator::builder()
        .rank(0)
        .world_size(1)
        .cpu(true)
        .mixed_precision(if r.bf16 {
            MixedPrecision::Bf16
        } else {
            MixedPrecision::No
        })
        .build()?;
    let dev = Device::Cpu;
    // Warm up the thread pool and the allocator before the baseline.
    let warm = Tensor::randn(0f32, 1.0, (64, 64), &dev)?;
    let _ = warm.matmul(&warm)?.sum_all()?.to_scalar::<f32>()?;
    drop(warm);
    let tokens: Vec<u32> = (0..r.batch * (r.seq + 1))
        .map(|i| ((i * 7919 + 13) % r.vocab) as u32)
        .collect();
    let tokens = Tensor::from_vec(tokens, (r.batch, r.seq + 1), &dev)?;
    let (inputs, targets) = (tokens.narrow(1, 0, r.seq)?, tokens.narrow(1, 1, r.seq)?);
    reset_peak().map_err(|e| accelerate_rs::Error::Io {
        context: "could not reset the peak resident size through".into(),
        path: "/proc/self/clear_refs".into(),
        source: e,
    })?;
    let baseline = rss().0;
    at_baseline();
    let masters = VarMap::new();
    let dtype = if r.bf16 { DType::BF16 } else { DType::F32 };
    let cfg = ParamsAdamW {
        lr: 1e-4,
        ..Default::default()
    };
    let mut graph = 0u64;
    if r.bf16 {
        // Masters in f32, the model on their bf16 working copies.
        Model::new(
            r,
            VarBuilder::from_varmap(&masters, DType::F32, &dev),
            DType::F32,
        )?;
        let opt = AdamW::new(masters.all_vars(), cfg)?;
        let loader = accelerate_rs::DataLoader::new(
            accelerate_rs::TensorDataset::new(vec![inputs.clone()])?,
            r.batch,
        );
        let (mut opt, _loader, work) = acc.prepare_mixed(&masters, opt, loader)?;
        let model = Model::new(r, VarBuilder::from_varmap(&work, dtype, &dev), dtype)?;
        for _ in 0..r.steps {
            let loss = model.loss(&inputs, &targets)?;
            graph = graph_bytes(&loss);
            opt.backward_step(&loss)?;
        }
    } else {
        let model = Model::new(r, VarBuilder::from_varmap(&masters, dtype, &dev), dtype)?;
        let opt = AdamW::new(masters.all_vars(), cfg)?;
        let loader = accelerate_rs::DataLoader::new(
            accelerate_rs::TensorDataset::new(vec![inputs.clone()])?,
            r.batch,
        );
        let (mut opt, _loader) = acc.prepare(&masters, opt, loader)?;
        for _ in 0..r.steps {
            let loss = model.loss(&inputs, &targets)?;
            graph = graph_bytes(&loss);
            opt.backward_step(&loss)?;
        }
    }
    Ok(Measured {
        baseline,
        peak: rss().1,
        graph,
    })
}

/// Bytes of the tensors a loss's graph holds (parameters excluded, views counted in full).
fn graph_bytes(loss: &Tensor) -> u64 {
    loss.sorted_nodes()
        .iter()
        .filter(|t| !t.is_variable())
        .map(|t| (t.elem_count() * t.dtype().size_in_bytes()) as u64)
        .sum()
}
