//! `accelerate_rs::nn` against Candle's composed ops, forward and backward, on the shapes of the
//! Transformer LM (batch 8 x 128 tokens x 256 features; attention scores 8 x 8 heads x 128 x
//! 128, plain and scaled + causally masked; causal self-attention over the packed 8 x 128 x 3 x 256
//! projection, 8 heads; cross-entropy over 1024 tokens x 8000 classes; GELU and ReLU over 8 x 128
//! x 1024; a 256 -> 1024 linear layer with bias, and with a ReLU), and on a Llama-style model's
//! (batch 4 x 256 tokens; SiLU and the SwiGLU gate over the 1376-wide MLP; rotary embeddings on
//! the queries, 8 heads x 64; a token embedding, 1024 ids into 8000 x 512), timed in
//! alternating blocks in one run, the backward pass being [`nn::backward`]:
//!
//!     cargo bench --bench nn
//!     cargo bench --bench nn -- --quick
//!     cargo bench --bench nn -- --quick rope swiglu   # only the ops whose names contain these

use std::time::Instant;

use accelerate_rs::nn;
use anyhow::Result;
use candle_core::{Device, Module, Tensor, Var, D};
use candle_nn::ops;

type Op = Box<dyn Fn(&Tensor) -> candle_core::Result<Tensor>>;

/// Mean milliseconds of forward, and of forward + backward, over `reps` runs.
fn time(op: &Op, x: &Var, reps: usize) -> Result<(f64, f64)> {
    let (mut fwd, mut both) = (0f64, 0f64);
    for _ in 0..reps {
        let t = Instant::now();
        let _y = op(x.as_tensor())?;
        fwd += t.elapsed().as_secs_f64();
        let t = Instant::now();
        let y = op(x.as_tensor())?;
        // The backward pass the accelerator runs (fused ops hand it their weight gradients).
        let _g = nn::backward(&y.sum_all()?)?;
        both += t.elapsed().as_secs_f64();
        drop(y);
    }
    Ok((fwd * 1e3 / reps as f64, both * 1e3 / reps as f64))
}

fn main() -> Result<()> {
    let quick = std::env::args().any(|a| a == "--quick");
    let filters: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    let reps = if quick { 3 } else { 20 };
    let dev = Device::Cpu;
    let d = 256;
    let w = Tensor::ones(d, candle_core::DType::F32, &dev)?;
    let b = Tensor::zeros(d, candle_core::DType::F32, &dev)?;
    let rows = Var::from_tensor(&Tensor::randn(0f32, 1.0, (8, 128, d), &dev)?)?;
    let scores = Var::from_tensor(&Tensor::randn(0f32, 1.0, (8, 8, 128, 128), &dev)?)?;
    let (w1, b1, w2, w3) = (w.clone(), b.clone(), w.clone(), w.clone());
    // The attention's causal mask as a composed model adds it: 0 on and below the diagonal.
    let mask: Vec<f32> = (0..128)
        .flat_map(|i| (0..128).map(move |j| if j <= i { 0.0 } else { f32::NEG_INFINITY }))
        .collect();
    let mask = Tensor::from_vec(mask, (128, 128), &dev)?;
    let ln = nn::LayerNorm::new(w.clone(), b.clone(), 1e-5);
    let rms = nn::RmsNorm::new(w.clone(), 1e-5);
    let cases: Vec<(&str, &Var, Op, Op)> = vec![
        (
            "layer_norm 1024x256",
            &rows,
            Box::new(move |x| ln.forward(x)),
            Box::new(move |x| ops::layer_norm_slow(x, &w1, &b1, 1e-5)),
        ),
        (
            "rms_norm 1024x256",
            &rows,
            Box::new(move |x| rms.forward(x)),
            Box::new(move |x| ops::rms_norm_slow(x, &w2, 1e-5)),
        ),
        (
            "softmax 8x8x128x128",
            &scores,
            Box::new(nn::softmax_last_dim),
            Box::new(|x| ops::softmax(x, D::Minus1)),
        ),
        (
            "causal_softmax 8x8x128",
            &scores,
            Box::new(|x| nn::causal_softmax(x, 0.125)),
            Box::new(move |x| ops::softmax(&(x * 0.125)?.broadcast_add(&mask)?, D::Minus1)),
        ),
    ];
    let _ = w3;
    // Cross-entropy over the Transformer LM's logits (1024 tokens x the vocab of 8000).
    let logits = Var::from_tensor(&Tensor::randn(0f32, 1.0, (1024, 8000), &dev)?)?;
    let labels = Tensor::from_vec(
        (0..1024u32).map(|i| (i * 37) % 8000).collect::<Vec<_>>(),
        1024,
        &dev,
    )?;
    let labels2 = labels.clone();
    // The MLP's activations (8 x 128 tokens x 1024) and its first layer (256 -> 1024, with bias).
    let hidden = Var::from_tensor(&Tensor::randn(0f32, 1.0, (8, 128, 1024), &dev)?)?;
    let fc_w = (Tensor::randn(0f32, 1.0, (1024, d), &dev)? * 0.05)?;
    let fc_b = Tensor::zeros(1024, candle_core::DType::F32, &dev)?;
    let ours = nn::Linear::new(fc_w.clone(), Some(fc_b.clone()));
    let theirs = candle_nn::Linear::new(fc_w, Some(fc_b));
    let mut cases = cases;
    cases.push((
        "gelu 8x128x1024",
        &hidden,
        Box::new(nn::gelu),
        Box::new(|x| x.gelu()),
    ));
    cases.push((
        "relu 8x128x1024",
        &hidden,
        Box::new(nn::relu),
        Box::new(|x| x.relu()),
    ));
    let (ours2, theirs2) = (ours.clone(), theirs.clone());
    cases.push((
        "linear_relu 1024x256->1024",
        &rows,
        Box::new(move |x| nn::linear_relu(x, &ours2)),
        Box::new(move |x| theirs2.forward(x)?.relu()),
    ));
    cases.push((
        "linear 1024x256->1024",
        &rows,
        Box::new(move |x| ours.forward(x)),
        Box::new(move |x| theirs.forward(x)),
    ));
    // Causal self-attention over the packed q|k|v projection (8 x 128 tokens x 3 x 256, 8 heads):
    // one fused op, against the composed heads split, products, `causal_softmax` (itself fused)
    // and heads merge the Transformer LM used before.
    let qkv = Var::from_tensor(&Tensor::randn(0f32, 1.0, (8, 128, 3 * d), &dev)?)?;
    let causal = nn::AttentionOptions::default().causal(true);
    cases.push((
        "attention 8x128x3x256",
        &qkv,
        Box::new(move |x| nn::packed_self_attention(x, 8, &causal)),
        Box::new(|x| {
            let s = x.reshape((8, 128, 3, 8, 32))?.permute((2, 0, 3, 1, 4))?;
            let (q, k, v) = (
                s.get(0)?.contiguous()?,
                s.get(1)?.contiguous()?,
                s.get(2)?.contiguous()?,
            );
            let att = nn::causal_softmax(&q.matmul(&k.t()?)?, 1.0 / 32f64.sqrt())?;
            att.matmul(&v)?.transpose(1, 2)?.reshape((8, 128, 256))
        }),
    ));
    cases.push((
        "cross_entropy 1024x8000",
        &logits,
        Box::new(move |x| nn::cross_entropy(x, &labels)),
        Box::new(move |x| candle_nn::loss::cross_entropy(x, &labels2)),
    ));
    // A Llama-style MLP's activations (4 x 256 tokens x 1376): SiLU, and the SwiGLU gate
    // `silu(gate) * up` against Candle's `silu` then a product (both inputs get gradients).
    let gate = Var::from_tensor(&Tensor::randn(0f32, 1.0, (4, 256, 1376), &dev)?)?;
    let up = Var::from_tensor(&Tensor::randn(0f32, 1.0, (4, 256, 1376), &dev)?)?;
    let up2 = up.clone();
    cases.push((
        "silu 4x256x1376",
        &gate,
        Box::new(nn::silu),
        Box::new(ops::silu),
    ));
    cases.push((
        "swiglu 4x256x1376",
        &gate,
        Box::new(move |x| nn::swiglu(x, &up)),
        Box::new(move |x| ops::silu(x)? * up2.as_tensor()),
    ));
    // A language model's token embedding: 4 x 256 ids into an 8000 x 512 table (the table's
    // gradient: scattered once and handed over, or Candle's `index_add` and store addition).
    let table = Var::from_tensor(&Tensor::randn(0f32, 1.0, (8000, 512), &dev)?)?;
    let ids: Vec<u32> = (0..1024u32).map(|i| (i * 7919) % 8000).collect();
    let ids = Tensor::from_vec(ids, (4, 256), &dev)?;
    let (ids1, ids2) = (ids.clone(), ids.flatten_all()?);
    cases.push((
        "embedding 8000x512",
        &table,
        Box::new(move |t| nn::embedding(t, &ids1)),
        Box::new(move |t| t.index_select(&ids2, 0)?.reshape((4, 256, 512))),
    ));
    // Rotary embeddings on the queries (batch 4, 8 heads, 256 tokens, head_dim 64), tables of 512
    // positions (constants); Candle's differentiable composed `rope_slow` / `rope_i_slow`, and for
    // the [B, T, H, D] layout `rope_slow` between two transposes.
    let q = Var::from_tensor(&Tensor::randn(0f32, 1.0, (4, 8, 256, 64), &dev)?)?;
    let q_thd = Var::from_tensor(&Tensor::randn(0f32, 1.0, (4, 256, 8, 64), &dev)?)?;
    let angles = Tensor::arange(0f32, 512.0 * 32.0, &dev)?
        .reshape((512, 32))?
        .affine(1e-3, 0.0)?;
    let (cos, sin) = (angles.cos()?, angles.sin()?);
    let cs = || (cos.clone(), sin.clone());
    let ((c1, s1), (c2, s2), (c3, s3)) = (cs(), cs(), cs());
    let ((c4, s4), (c5, s5), (c6, s6)) = (cs(), cs(), cs());
    cases.push((
        "rope 4x8x256x64",
        &q,
        Box::new(move |x| nn::rope(x, &c1, &s1)),
        Box::new(move |x| candle_nn::rotary_emb::rope_slow(x, &c2, &s2)),
    ));
    cases.push((
        "rope_i 4x8x256x64",
        &q,
        Box::new(move |x| nn::rope_i(x, &c3, &s3)),
        Box::new(move |x| candle_nn::rotary_emb::rope_i_slow(x, &c4, &s4)),
    ));
    cases.push((
        "rope_thd 4x256x8x64",
        &q_thd,
        Box::new(move |x| nn::rope_thd(x, &c5, &s5)),
        Box::new(move |x| {
            candle_nn::rotary_emb::rope_slow(&x.transpose(1, 2)?.contiguous()?, &c6, &s6)?
                .transpose(1, 2)
        }),
    ));
    if !filters.is_empty() {
        cases.retain(|(name, ..)| filters.iter().any(|f| name.contains(f.as_str())));
    }
    println!(
        "{:<22} | {:>14} | {:>14} | {:>16} | {:>16} | {:>7}",
        "op", "fused fwd ms", "candle fwd ms", "fused fwd+bwd ms", "candle fwd+bwd ms", "speedup"
    );
    println!("{}", "-".repeat(103));
    for (name, x, fused, composed) in &cases {
        // Alternate blocks so that drift hits both alike.
        let (mut f, mut c) = ((0.0, 0.0), (0.0, 0.0));
        for _ in 0..2 {
            let a = time(fused, x, reps)?;
            let b = time(composed, x, reps)?;
            f = (f.0 + a.0 / 2.0, f.1 + a.1 / 2.0);
            c = (c.0 + b.0 / 2.0, c.1 + b.1 / 2.0);
        }
        println!(
            "{name:<22} | {:>14.2} | {:>14.2} | {:>16.2} | {:>17.2} | {:>6.2}x",
            f.0,
            c.0,
            f.1,
            c.1,
            c.1 / f.1
        );
    }
    Ok(())
}
