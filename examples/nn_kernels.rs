//! The device check of `accelerate_rs::nn`'s CUDA kernels (the `cuda` feature), run by
//! `scripts/gpu-smoke.sh`:
//!
//!     cargo run --release --features cuda --example nn_kernels           # on a GPU machine
//!     cargo run --release --features cuda --example nn_kernels -- --no-timing
//!
//! For every op (LayerNorm with and without bias, RMSNorm, softmax, causal softmax, causal
//! attention, cross-entropy with label smoothing and an ignored index, linear_cross_entropy,
//! GELU, ReLU; SiLU, SwiGLU, `swiglu_linear`, `rope_attention`, RoPE (`rope`, `rope_i`,
//! `rope_thd`, the tables' gradients too) and flash attention with
//! `ACCELERATE_RS_NN_CUDA_FLASH=1`, the embedding's trial kernels with
//! `ACCELERATE_RS_CUDA_TRIAL=1`) and dtype (f32, bf16, f16): the same inputs through the CPU
//! path and through the kernels on GPU 0, forward output and every input's gradient (of `sum(out * r)` for a fixed
//! random `r`) compared within a tolerance per dtype, relative to the CPU values' largest
//! magnitude; the kernel launch count must grow (the kernels ran, not the composed ops). One
//! `PASS`/`FAIL` line per op and dtype, then `nn_kernels: N passed, M failed`; exit 1 on a
//! failure, 2 when there is no GPU or the build lacks the feature. Then (unless `--no-timing`)
//! forward + backward time per op at a language model's shapes, kernels against the composed
//! ops on the same GPU, as a table. `--self-test` runs the harness CPU against CPU (no GPU).

use std::time::Instant;

use accelerate_rs::nn::{self, AttentionOptions, CrossEntropyOptions, LayerNorm, Linear, RmsNorm};
use anyhow::{bail, Result};
use candle_core::{DType, Device, Module, Tensor, Var};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Flash attention's switch.
const FLASH: &str = "ACCELERATE_RS_NN_CUDA_FLASH";
/// The trial kernels' switch (kernels not yet proven on a GPU).
const TRIAL: &str = "ACCELERATE_RS_CUDA_TRIAL";

/// One op under test: its inputs' shapes and how to compute it from them.
struct Case {
    name: &'static str,
    shapes: Vec<Vec<usize>>,
    /// Inputs after the first that are integer targets (not differentiated): `(shape, classes)`.
    targets: Option<(Vec<usize>, u32)>,
    op: fn(&[Tensor], Option<&Tensor>) -> candle_core::Result<Tensor>,
    /// Whether the op launches this module's own kernels (LoRA's fused op runs cuBLAS and
    /// Candle's kernels: only its results are checked).
    kernels: bool,
    /// The switch (an environment variable) without which the op does not take its kernels:
    /// flash attention's (`ACCELERATE_RS_NN_CUDA_FLASH=1`) and the trial kernels
    /// (`ACCELERATE_RS_CUDA_TRIAL=1`), both set by `scripts/gpu-smoke.sh`; without it the
    /// case is skipped.
    needs: Option<&'static str>,
}

fn cases() -> Vec<Case> {
    vec![
        Case {
            name: "layer_norm",
            shapes: vec![vec![64, 256], vec![256], vec![256]],
            kernels: true,
            needs: None,
            targets: None,
            op: |x, _| LayerNorm::new(x[1].clone(), x[2].clone(), 1e-5).forward(&x[0]),
        },
        Case {
            name: "layer_norm (no bias)",
            shapes: vec![vec![3, 40, 200], vec![200]],
            kernels: true,
            needs: None,
            targets: None,
            op: |x, _| LayerNorm::new_no_bias(x[1].clone(), 1e-5).forward(&x[0]),
        },
        Case {
            name: "rms_norm",
            shapes: vec![vec![64, 1100], vec![1100]],
            kernels: true,
            needs: None,
            targets: None,
            op: |x, _| RmsNorm::new(x[1].clone(), 1e-6).forward(&x[0]),
        },
        Case {
            name: "softmax_last_dim",
            shapes: vec![vec![64, 300]],
            kernels: true,
            needs: None,
            targets: None,
            op: |x, _| nn::softmax_last_dim(&x[0]),
        },
        Case {
            name: "causal_softmax",
            shapes: vec![vec![2, 4, 33, 40]],
            kernels: true,
            needs: None,
            targets: None,
            op: |x, _| nn::causal_softmax(&x[0], 0.3),
        },
        Case {
            name: "linear (no bias: one node on the GPU, cuBLAS)",
            shapes: vec![vec![3, 37, 64], vec![48, 64]],
            kernels: false,
            needs: None,
            targets: None,
            op: |x, _| Linear::new(x[1].clone(), None).forward(&x[0]),
        },
        Case {
            name: "attention (one node, T_q 20 < T_k 33, D_v 8)",
            shapes: vec![vec![2, 3, 20, 16], vec![2, 3, 33, 16], vec![2, 3, 33, 8]],
            kernels: true,
            needs: None,
            targets: None,
            op: |x, _| {
                let opts = AttentionOptions::default().scale(0.2);
                nn::scaled_dot_product_attention(&x[0], &x[1], &x[2], &opts)
            },
        },
        Case {
            name: "causal attention (one node, T_q 20 < T_k 33)",
            shapes: vec![vec![2, 3, 20, 16], vec![2, 3, 33, 16], vec![2, 3, 33, 8]],
            kernels: true,
            needs: None,
            targets: None,
            op: |x, _| {
                let opts = AttentionOptions::default().causal(true);
                nn::scaled_dot_product_attention(&x[0], &x[1], &x[2], &opts)
            },
        },
        Case {
            name: "causal attention (one node, grouped key/value heads 6/2)",
            shapes: vec![vec![2, 6, 24, 16], vec![2, 2, 24, 16], vec![2, 2, 24, 16]],
            kernels: true,
            needs: None,
            targets: None,
            op: |x, _| {
                let opts = AttentionOptions::default().causal(true);
                nn::scaled_dot_product_attention(&x[0], &x[1], &x[2], &opts)
            },
        },
        Case {
            name: "causal attention (one node, kernel softmax)",
            shapes: vec![vec![2, 4, 32, 16], vec![2, 4, 32, 16], vec![2, 4, 32, 16]],
            kernels: true,
            needs: None,
            targets: None,
            op: |x, _| {
                let opts = AttentionOptions::default().causal(true);
                nn::scaled_dot_product_attention(&x[0], &x[1], &x[2], &opts)
            },
        },
        Case {
            name: "cross_entropy (smoothing 0.1, ignore 7)",
            shapes: vec![vec![96, 1000]],
            kernels: true,
            needs: None,
            targets: Some((vec![96], 1000)),
            op: |x, t| {
                let t = t.ok_or_else(|| candle_core::Error::Msg("targets".into()))?;
                let o = CrossEntropyOptions::default()
                    .label_smoothing(0.1)
                    .ignore_index(7);
                nn::cross_entropy_with(&x[0], t, o)
            },
        },
        Case {
            name: "linear_cross_entropy",
            shapes: vec![vec![2, 48, 64], vec![500, 64], vec![500]],
            kernels: true,
            needs: None,
            targets: Some((vec![2, 48], 500)),
            op: |x, t| {
                let t = t.ok_or_else(|| candle_core::Error::Msg("targets".into()))?;
                let head = Linear::new(x[1].clone(), Some(x[2].clone()));
                nn::linear_cross_entropy(&x[0], &head, t, Default::default())
            },
        },
        Case {
            name: "linear_cross_entropy (no bias: one node on the GPU, ignored targets)",
            shapes: vec![vec![2, 48, 64], vec![500, 64]],
            kernels: true,
            needs: None,
            targets: Some((vec![2, 48], 500)),
            op: |x, t| {
                let t = t.ok_or_else(|| candle_core::Error::Msg("targets".into()))?;
                let head = Linear::new(x[1].clone(), None);
                let o = CrossEntropyOptions::default().ignore_index(7);
                nn::linear_cross_entropy(&x[0], &head, t, o)
            },
        },
        Case {
            name: "embedding (Candle's index_select on the GPU, repeated ids)",
            shapes: vec![vec![50, 16]],
            kernels: false,
            needs: None,
            targets: Some((vec![4, 30], 50)),
            op: |x, t| {
                let t = t.ok_or_else(|| candle_core::Error::Msg("ids".into()))?;
                nn::set_cuda_kernels(false);
                let y = nn::embedding(&x[0], t);
                nn::set_cuda_kernels(true);
                y
            },
        },
        Case {
            name: "embedding (the trial kernels, repeated ids, a row wider than a block)",
            shapes: vec![vec![50, 1100]],
            kernels: true,
            needs: Some(TRIAL),
            targets: Some((vec![4, 30], 50)),
            op: |x, t| {
                let t = t.ok_or_else(|| candle_core::Error::Msg("ids".into()))?;
                nn::embedding(&x[0], t)
            },
        },
        Case {
            name: "gelu",
            shapes: vec![vec![4099]],
            kernels: true,
            needs: None,
            targets: None,
            op: |x, _| nn::gelu(&x[0]),
        },
        Case {
            name: "lora (fused, frozen base with bias, r 8)",
            kernels: false,
            needs: None,
            shapes: vec![
                vec![2, 40, 64],
                vec![48, 64],
                vec![48],
                vec![8, 64],
                vec![48, 8],
            ],
            targets: None,
            op: |x, _| {
                let lora = nn::Lora::from_tensors(x[3].clone(), x[4].clone(), 2.0, 0.0)?;
                lora.forward_with_base(&x[0], &x[1].detach(), Some(&x[2].detach()), true)
            },
        },
        Case {
            name: "silu",
            shapes: vec![vec![4099]],
            kernels: true,
            needs: None,
            targets: None,
            op: |x, _| nn::silu(&x[0]),
        },
        Case {
            name: "swiglu",
            shapes: vec![vec![3, 1367], vec![3, 1367]],
            kernels: true,
            needs: None,
            targets: None,
            op: |x, _| nn::swiglu(&x[0], &x[1]),
        },
        Case {
            name: "swiglu_linear (one node on the GPU: two products, the SwiGLU kernel)",
            shapes: vec![vec![2, 40, 64], vec![96, 64], vec![96, 64]],
            kernels: true,
            needs: None,
            targets: None,
            op: |x, _| {
                let (g, u) = (
                    Linear::new(x[1].clone(), None),
                    Linear::new(x[2].clone(), None),
                );
                nn::swiglu_linear(&x[0], &g, &u)
            },
        },
        Case {
            name: "rope_attention (one node on the GPU: RoPE, transposes, causal GQA 4/2)",
            shapes: vec![
                vec![2, 33, 4, 16],
                vec![2, 33, 2, 16],
                vec![2, 33, 2, 16],
                vec![40, 8],
                vec![40, 8],
            ],
            kernels: true,
            needs: None,
            targets: None,
            op: |x, _| {
                let o = AttentionOptions::default().causal(true);
                nn::rope_attention(&x[0], &x[1], &x[2], &x[3].detach(), &x[4].detach(), &o)
            },
        },
        Case {
            name: "rope (halves, shared tables of 7 positions)",
            shapes: vec![vec![2, 3, 5, 8], vec![7, 4], vec![7, 4]],
            kernels: true,
            needs: None,
            targets: None,
            op: |x, _| nn::rope(&x[0], &x[1], &x[2]),
        },
        Case {
            name: "rope_i (interleaved)",
            shapes: vec![vec![2, 3, 5, 8], vec![5, 4], vec![5, 4]],
            kernels: true,
            needs: None,
            targets: None,
            op: |x, _| nn::rope_i(&x[0], &x[1], &x[2]),
        },
        Case {
            name: "rope_thd (one table per sequence)",
            shapes: vec![vec![2, 5, 3, 64], vec![2, 5, 32], vec![2, 5, 32]],
            kernels: true,
            needs: None,
            targets: None,
            op: |x, _| nn::rope_thd(&x[0], &x[1], &x[2]),
        },
        Case {
            name: "flash attention (causal, window 9, GQA 4/2, head 40)",
            shapes: vec![vec![2, 4, 37, 40], vec![2, 2, 37, 40], vec![2, 2, 37, 40]],
            kernels: true,
            needs: Some(FLASH),
            targets: None,
            op: |x, _| {
                let o = nn::FlashAttentionOptions::default().causal(true).window(9);
                nn::flash_attention(&x[0], &x[1], &x[2], &o)
            },
        },
        Case {
            name: "flash attention (packed documents 12+1+20, padding, T_q < T_k)",
            shapes: vec![vec![2, 2, 30, 16], vec![2, 2, 33, 16], vec![2, 2, 33, 16]],
            kernels: true,
            needs: Some(FLASH),
            targets: None,
            op: |x, _| {
                let pad: Vec<u8> = (0..66).map(|i| u8::from(i >= 62)).collect();
                let pad = Tensor::from_vec(pad, (2, 33), x[0].device())?;
                let o = nn::FlashAttentionOptions::default()
                    .causal(true)
                    .cu_seqlens(vec![0, 12, 13, 33, 66])
                    .key_padding_mask(pad);
                nn::flash_attention(&x[0], &x[1], &x[2], &o)
            },
        },
        Case {
            name: "relu",
            shapes: vec![vec![4099]],
            kernels: true,
            needs: None,
            targets: None,
            op: |x, _| nn::relu(&x[0]),
        },
    ]
}

/// Relative tolerance of a dtype (one or two units in the last place of a value near 1, and the
/// f32 reductions' reordering).
fn tolerance(dtype: DType) -> f32 {
    match dtype {
        DType::BF16 => 3e-2,
        DType::F16 => 5e-3,
        _ => 1e-4,
    }
}

fn random(shape: &[usize], rng: &mut ChaCha8Rng) -> Result<Tensor> {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n).map(|_| rng.random_range(-2.0f32..2.0)).collect();
    Ok(Tensor::from_vec(v, shape, &Device::Cpu)?)
}

/// `|a - b|` over `max(1, |a|)`, largest over the elements (`a` the CPU's).
fn rel_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
    let a = a.to_dtype(DType::F32)?.to_device(&Device::Cpu)?;
    let b = b.to_dtype(DType::F32)?.to_device(&Device::Cpu)?;
    let scale = a.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?.max(1.0);
    let d = (a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
    Ok(if d.is_nan() { f32::INFINITY } else { d / scale })
}

/// The op's output and its inputs' gradients on `dev` (inputs and `r` given on the CPU).
fn run(
    case: &Case,
    inputs: &[Tensor],
    targets: Option<&Tensor>,
    r: Option<&Tensor>,
    dev: &Device,
    dtype: DType,
) -> Result<(Tensor, Vec<Option<Tensor>>)> {
    let vars = inputs
        .iter()
        .map(|t| Ok(Var::from_tensor(&t.to_dtype(dtype)?.to_device(dev)?)?))
        .collect::<Result<Vec<_>>>()?;
    let xs: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let targets = targets.map(|t| t.to_device(dev)).transpose()?;
    let out = (case.op)(&xs, targets.as_ref())?;
    let loss = match r {
        Some(r) => (out.to_dtype(DType::F32)? * r.to_device(dev)?)?.sum_all()?,
        None => out.to_dtype(DType::F32)?.sum_all()?,
    };
    let grads = loss.backward()?;
    let g = vars
        .iter()
        .map(|v| grads.get(v.as_tensor()).cloned())
        .collect();
    Ok((out, g))
}

/// Checks one case in one dtype; `Ok(description)` or `Err(what differs)`.
fn check(
    case: &Case,
    dtype: DType,
    gpu: &Device,
    seed: u64,
) -> Result<std::result::Result<String, String>> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let inputs = case
        .shapes
        .iter()
        .map(|s| random(s, &mut rng))
        .collect::<Result<Vec<_>>>()?;
    let targets = match &case.targets {
        Some((shape, classes)) => {
            let n: usize = shape.iter().product();
            let t: Vec<u32> = (0..n).map(|_| rng.random_range(0..*classes)).collect();
            Some(Tensor::from_vec(t, shape.as_slice(), &Device::Cpu)?)
        }
        None => None,
    };
    // The weight of each output element in the loss (a scalar loss has none).
    let cpu_out = (case.op)(
        &inputs
            .iter()
            .map(|t| t.to_dtype(dtype))
            .collect::<candle_core::Result<Vec<_>>>()?,
        targets.as_ref(),
    )?;
    let r = if cpu_out.rank() == 0 {
        None
    } else {
        Some(random(cpu_out.dims(), &mut rng)?)
    };
    let before = nn::cuda_kernel_launches();
    let (c_out, c_grads) = run(
        case,
        &inputs,
        targets.as_ref(),
        r.as_ref(),
        &Device::Cpu,
        dtype,
    )?;
    let (g_out, g_grads) = run(case, &inputs, targets.as_ref(), r.as_ref(), gpu, dtype)?;
    let launched = nn::cuda_kernel_launches() - before;
    let self_test = gpu.is_cpu();
    if !self_test && !g_out.device().is_cuda() {
        return Ok(Err("the output is not on the GPU".into()));
    }
    if !self_test && case.kernels && launched == 0 {
        return Ok(Err(
            "no kernel launched: the composed ops ran (see the warning above)".into(),
        ));
    }
    let tol = tolerance(dtype);
    let mut worst = rel_diff(&c_out, &g_out)?;
    let mut what = format!("output {worst:.2e}");
    if worst > tol {
        return Ok(Err(format!(
            "output differs by {worst:.3e} (tolerance {tol:.0e})"
        )));
    }
    for (i, (c, g)) in c_grads.iter().zip(&g_grads).enumerate() {
        match (c, g) {
            (Some(c), Some(g)) => {
                let d = rel_diff(c, g)?;
                if d > tol {
                    return Ok(Err(format!(
                        "the gradient of input {i} differs by {d:.3e} (tolerance {tol:.0e})"
                    )));
                }
                worst = worst.max(d);
                what.push_str(&format!(", grad {i} {d:.2e}"));
            }
            (None, None) => {}
            _ => return Ok(Err(format!("input {i} has a gradient on one device only"))),
        }
    }
    Ok(Ok(format!("{what}; {launched} kernel launches")))
}

/// Forward + backward time of `f` on `dev` (ms per iteration, after a warm-up).
fn time_it(dev: &Device, iters: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    for _ in 0..3 {
        f()?;
    }
    dev.synchronize()?;
    let start = Instant::now();
    for _ in 0..iters {
        f()?;
    }
    dev.synchronize()?;
    Ok(start.elapsed().as_secs_f64() * 1e3 / iters as f64)
}

/// A variable of `shape` on `gpu` in `dtype`, random.
fn gpu_var(shape: &[usize], dtype: DType, gpu: &Device, rng: &mut ChaCha8Rng) -> Result<Var> {
    Ok(Var::from_tensor(
        &random(shape, rng)?.to_dtype(dtype)?.to_device(gpu)?,
    )?)
}

/// One timed op of the table: its name and how to run it.
type Op<'a> = (
    &'static str,
    Box<dyn Fn() -> candle_core::Result<Tensor> + 'a>,
);

/// Kernels against the composed ops at transformer_lm's shapes (batch 8 x 128 tokens, d_model
/// 256, 8 heads, vocab 8000), then at the 254M Llama's ([`llama_timing`]), f32 and bf16.
fn timing(gpu: &Device) -> Result<()> {
    println!();
    println!("| op (forward + backward) | dtype | composed ms | kernels ms | speed-up |");
    println!("|---|---|---:|---:|---:|");
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    for dtype in [DType::F32, DType::BF16] {
        let mut var = |shape: &[usize]| gpu_var(shape, dtype, gpu, &mut rng);
        let (x, w, b) = (var(&[1024, 256])?, var(&[256])?, var(&[256])?);
        let scores = var(&[8, 8, 128, 128])?;
        let logits = var(&[1024, 8000])?;
        let (hidden, up) = (var(&[1024, 1024])?, var(&[1024, 1024])?);
        let heads = var(&[8, 8, 128, 64])?;
        let (cos, sin) = (var(&[128, 32])?, var(&[128, 32])?);
        let t: Vec<u32> = (0..1024).map(|_| rng.random_range(0..8000)).collect();
        let targets = Tensor::from_vec(t, 1024, gpu)?;
        let ops: Vec<Op> = vec![
            (
                "layer_norm [1024, 256]",
                Box::new(|| {
                    LayerNorm::new(w.as_tensor().clone(), b.as_tensor().clone(), 1e-5).forward(&x)
                }),
            ),
            (
                "causal_softmax [8, 8, 128, 128]",
                Box::new(|| nn::causal_softmax(&scores, 0.125)),
            ),
            (
                "cross_entropy [1024, 8000]",
                Box::new(|| nn::cross_entropy(&logits, &targets)),
            ),
            ("gelu [1024, 1024]", Box::new(|| nn::gelu(&hidden))),
            ("relu [1024, 1024]", Box::new(|| nn::relu(&hidden))),
            (
                "rope [8, 8, 128, 64]",
                Box::new(|| nn::rope(&heads, &cos, &sin)),
            ),
            ("silu [1024, 1024]", Box::new(|| nn::silu(&hidden))),
            ("swiglu [1024, 1024]", Box::new(|| nn::swiglu(&hidden, &up))),
        ];
        for (name, op) in &ops {
            time_row(gpu, name, dtype, op)?;
        }
        llama_timing(gpu, dtype, &mut rng)?;
    }
    nn::set_cuda_kernels(true);
    Ok(())
}

/// [`timing`]'s rows at the 254M Llama's shapes (step 17): its embedding table and batch (4 x
/// 1024 ids into [32000, 1024]), its attention (16 heads over 8 key/value heads of 64) and its
/// MLP's gate and up projections.
fn llama_timing(gpu: &Device, dtype: DType, rng: &mut ChaCha8Rng) -> Result<()> {
    let mut var = |shape: &[usize]| gpu_var(shape, dtype, gpu, rng);
    let table = var(&[32000, 1024])?;
    let hidden = var(&[1024, 1024])?;
    let gate = Linear::new(var(&[2816, 1024])?.as_tensor().clone(), None);
    let up = Linear::new(var(&[2816, 1024])?.as_tensor().clone(), None);
    let (q, k, v) = (
        var(&[4, 1024, 16, 64])?,
        var(&[4, 1024, 8, 64])?,
        var(&[4, 1024, 8, 64])?,
    );
    let (cos, sin) = (
        var(&[1024, 32])?.as_tensor().detach(),
        var(&[1024, 32])?.as_tensor().detach(),
    );
    let t: Vec<u32> = (0..4096).map(|_| rng.random_range(0..32000)).collect();
    let ids = Tensor::from_vec(t, (4, 1024), gpu)?;
    let causal = AttentionOptions::default().causal(true);
    let ops: Vec<Op> = vec![
        (
            "embedding [32000, 1024] x 4096 ids (kernels: ACCELERATE_RS_CUDA_TRIAL=1)",
            Box::new(|| nn::embedding(&table, &ids)),
        ),
        (
            "rope_attention [4, 1024, 16/8, 64] causal",
            Box::new(|| nn::rope_attention(&q, &k, &v, &cos, &sin, &causal)),
        ),
        (
            "swiglu_linear [1024, 1024] x 2 [2816, 1024]",
            Box::new(|| nn::swiglu_linear(&hidden, &gate, &up)),
        ),
    ];
    for (name, op) in &ops {
        time_row(gpu, name, dtype, op)?;
    }
    Ok(())
}

/// One row of [`timing`]'s table: `op` forward + backward with the kernels off, then on.
fn time_row(
    gpu: &Device,
    name: &str,
    dtype: DType,
    op: &dyn Fn() -> candle_core::Result<Tensor>,
) -> Result<()> {
    let mut ms = [0.0; 2];
    for (i, on) in [false, true].into_iter().enumerate() {
        nn::set_cuda_kernels(on);
        ms[i] = time_it(gpu, 50, || {
            let y = op()?;
            y.to_dtype(DType::F32)?.sum_all()?.backward()?;
            Ok(())
        })?;
    }
    println!(
        "| {name} | {dtype:?} | {:.3} | {:.3} | {:.2}x |",
        ms[0],
        ms[1],
        ms[0] / ms[1]
    );
    Ok(())
}

#[derive(clap::Parser)]
#[command(about = "Check the CUDA kernels of accelerate_rs::nn against the CPU and time them")]
struct Args {
    /// Check only, no timing table.
    #[arg(long)]
    no_timing: bool,
    /// The harness itself, CPU against CPU (no GPU needed; checks nothing about the kernels).
    #[arg(long)]
    self_test: bool,
}

fn main() -> Result<()> {
    let Args {
        no_timing,
        self_test,
    } = <Args as clap::Parser>::parse();
    if self_test {
        let mut failed = 0;
        for (k, case) in cases().iter().enumerate() {
            for dtype in [DType::F32, DType::BF16, DType::F16] {
                let r = check(case, dtype, &Device::Cpu, 1000 + k as u64)?;
                println!(
                    "{} {} {dtype:?}: {r:?}",
                    if r.is_ok() { "PASS" } else { "FAIL" },
                    case.name
                );
                failed += usize::from(r.is_err());
            }
        }
        if failed > 0 {
            bail!("{failed} self-test check(s) failed");
        }
        return Ok(());
    }
    if !nn::CUDA_KERNELS_BUILT {
        eprintln!("nn_kernels: this build has no `cuda` feature (cargo build --features cuda)");
        std::process::exit(2);
    }
    let gpu = match accelerate_rs::gpu::device(0) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("nn_kernels: no GPU: {e}");
            std::process::exit(2);
        }
    };
    nn::set_cuda_kernels(true);
    let (mut passed, mut failed) = (0, 0);
    for (k, case) in cases().iter().enumerate() {
        if let Some(var) = case
            .needs
            .filter(|v| !std::env::var(v).is_ok_and(|v| v == "1"))
        {
            println!(
                "SKIP {}: its kernels are off ({var}=1 runs them)",
                case.name
            );
            continue;
        }
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            match check(case, dtype, &gpu, 1000 + k as u64) {
                Ok(Ok(what)) => {
                    passed += 1;
                    println!("PASS {} {dtype:?}: {what}", case.name);
                }
                Ok(Err(why)) => {
                    failed += 1;
                    println!("FAIL {} {dtype:?}: {why}", case.name);
                }
                Err(e) => {
                    failed += 1;
                    println!("FAIL {} {dtype:?}: error: {e}", case.name);
                }
            }
        }
    }
    println!("nn_kernels: {passed} passed, {failed} failed");
    if !no_timing {
        if let Err(e) = timing(&gpu) {
            println!("nn_kernels: timing failed: {e}");
            failed += 1;
        }
    }
    if failed > 0 {
        bail!("{failed} check(s) failed");
    }
    Ok(())
}
