//! `accelerate_rs::nn` against Candle's composed (differentiable) ops: values and gradients of
//! the input, weight and bias, for many shapes, contiguous and not, in f32, f64 and bf16; and the
//! frozen-parameter trap of `candle_nn`'s fused layers is gone.

use accelerate_rs::nn;
use candle_core::{DType, Device, Module, Tensor, Var, D};
use candle_nn::ops;

pub(crate) fn det(shape: &[usize], salt: usize) -> Tensor {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n)
        .map(|i| (((i * 7919 + salt * 104729) % 1013) as f32 / 1013.0 - 0.5) * 3.0)
        .collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

pub(crate) fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    (a.to_dtype(DType::F32).unwrap() - b.to_dtype(DType::F32).unwrap())
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

/// Values and gradients of `fused` and `reference` on the same variables, with a fixed upstream
/// gradient; returns the largest difference.
pub(crate) fn compare(
    x: &Tensor,
    params: &[Tensor],
    fused: impl Fn(&Tensor, &[Tensor]) -> Tensor,
    reference: impl Fn(&Tensor, &[Tensor]) -> Tensor,
) -> f32 {
    let run = |f: &dyn Fn(&Tensor, &[Tensor]) -> Tensor| run_with(f, x, params, x.dtype());
    let a = run(&fused);
    // The reference in f32 at least: Candle's composed ops in bf16 (f16) round every partial sum.
    // The difference is taken relative to the reference's magnitude.
    let up = |t: &Tensor| {
        if matches!(t.dtype(), DType::BF16 | DType::F16) {
            t.to_dtype(DType::F32).unwrap()
        } else {
            t.clone()
        }
    };
    let (xr, pr): (Tensor, Vec<Tensor>) = (up(x), params.iter().map(up).collect());
    let b = run_with(&reference, &xr, &pr, x.dtype());
    a.iter()
        .zip(&b)
        .map(|(a, b)| {
            let scale = b
                .to_dtype(DType::F32)
                .unwrap()
                .abs()
                .unwrap()
                .flatten_all()
                .unwrap()
                .max(0)
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            max_diff(a, b) / (1.0 + scale)
        })
        .fold(0.0, f32::max)
}

/// `f` on variables made of `x` and `params`, its output and the gradients of
/// `sum(y * r)` (`r` fixed, rounded to `round_to` first).
fn run_with(
    f: &dyn Fn(&Tensor, &[Tensor]) -> Tensor,
    x: &Tensor,
    params: &[Tensor],
    round_to: DType,
) -> Vec<Tensor> {
    let xv = Var::from_tensor(x).unwrap();
    let pv: Vec<Var> = params
        .iter()
        .map(|p| Var::from_tensor(p).unwrap())
        .collect();
    let pt: Vec<Tensor> = pv.iter().map(|v| v.as_tensor().clone()).collect();
    let y = f(xv.as_tensor(), &pt);
    let r = det(y.dims(), 99)
        .to_dtype(round_to)
        .unwrap()
        .to_dtype(y.dtype())
        .unwrap();
    let g = (&y * &r).unwrap().sum_all().unwrap().backward().unwrap();
    let mut out = vec![y];
    out.push(
        g.get(xv.as_tensor())
            .expect("no gradient for the input")
            .clone(),
    );
    for v in &pv {
        out.push(
            g.get(v.as_tensor())
                .expect("no gradient for a parameter")
                .clone(),
        );
    }
    out
}

const SHAPES: &[&[usize]] = &[&[1, 1], &[3, 5], &[2, 3, 17], &[64, 256], &[5, 1000]];

#[test]
fn layer_norm_rms_norm_and_softmax_match_candle_values_and_gradients() {
    for (dtype, tol) in [(DType::F32, 1e-5), (DType::F64, 1e-5), (DType::BF16, 1e-2)] {
        for shape in SHAPES {
            let d = *shape.last().unwrap();
            for transposed in [false, true] {
                let mut x = det(shape, 1).to_dtype(dtype).unwrap();
                if transposed && shape.len() == 2 && shape[0] > 1 {
                    // A non-contiguous input with the same shape.
                    x = det(&[shape[1], shape[0]], 1)
                        .to_dtype(dtype)
                        .unwrap()
                        .t()
                        .unwrap();
                }
                let w = (det(&[d], 2).to_dtype(dtype).unwrap() + 1.0).unwrap();
                let b = det(&[d], 3).to_dtype(dtype).unwrap();
                let what = format!("{dtype:?} {shape:?} transposed {transposed}");
                let diff = compare(
                    &x,
                    &[w.clone(), b.clone()],
                    |x, p| {
                        nn::LayerNorm::new(p[0].clone(), p[1].clone(), 1e-5)
                            .forward(x)
                            .unwrap()
                    },
                    |x, p| ops::layer_norm_slow(x, &p[0], &p[1], 1e-5).unwrap(),
                );
                assert!(diff < tol, "layer_norm {what}: {diff}");
                let diff = compare(
                    &x,
                    std::slice::from_ref(&w),
                    |x, p| nn::RmsNorm::new(p[0].clone(), 1e-5).forward(x).unwrap(),
                    |x, p| ops::rms_norm_slow(x, &p[0], 1e-5).unwrap(),
                );
                assert!(diff < tol, "rms_norm {what}: {diff}");
                let diff = compare(
                    &x,
                    &[],
                    |x, _| nn::softmax_last_dim(x).unwrap(),
                    |x, _| ops::softmax(x, D::Minus1).unwrap(),
                );
                assert!(diff < tol, "softmax {what}: {diff}");
            }
        }
    }
}

#[test]
fn causal_softmax_matches_scaling_masking_and_candles_softmax() {
    // [..., T_q, T_k] with T_q == T_k (training) and T_q < T_k (queries at the end), contiguous
    // or not, against the composed ops: scale, add a -inf upper-triangular mask, softmax.
    let shapes: &[&[usize]] = &[
        &[1, 1],
        &[4, 4],
        &[2, 3, 5, 7],
        &[2, 8, 16, 16],
        &[1, 3, 128],
    ];
    for (dtype, tol) in [(DType::F32, 1e-5), (DType::F64, 1e-5), (DType::BF16, 1e-2)] {
        for shape in shapes {
            let (tq, tk) = (shape[shape.len() - 2], shape[shape.len() - 1]);
            for transposed in [false, true] {
                let mut x = det(shape, 8).to_dtype(dtype).unwrap();
                if transposed && tq == tk {
                    x = x.transpose(shape.len() - 2, shape.len() - 1).unwrap();
                }
                let scale = 0.37;
                let mask: Vec<f32> = (0..tq)
                    .flat_map(|i| {
                        (0..tk).map(move |j| {
                            if j + tq <= i + tk {
                                0.0
                            } else {
                                f32::NEG_INFINITY
                            }
                        })
                    })
                    .collect();
                let mask = Tensor::from_vec(mask, (tq, tk), &Device::Cpu).unwrap();
                let diff = compare(
                    &x,
                    &[],
                    |x, _| nn::causal_softmax(x, scale).unwrap(),
                    |x, _| {
                        let m = mask.to_dtype(x.dtype()).unwrap();
                        ops::softmax(&(x * scale).unwrap().broadcast_add(&m).unwrap(), D::Minus1)
                            .unwrap()
                    },
                );
                assert!(
                    diff < tol,
                    "causal_softmax {dtype:?} {shape:?} {transposed}: {diff}"
                );
            }
        }
    }
    // Masked entries are exactly 0, and a shape without two dims or with T_q > T_k is an error.
    let y = nn::causal_softmax(&det(&[3, 3], 1), 1.0).unwrap();
    assert_eq!(y.to_vec2::<f32>().unwrap()[0][1..], [0.0, 0.0]);
    let err = nn::causal_softmax(&det(&[4, 3], 1), 1.0).unwrap_err();
    assert!(err.to_string().contains("T_q <= T_k"), "{err}");
    assert!(nn::causal_softmax(&det(&[5], 1), 1.0).is_err());
}

#[test]
fn linear_cross_entropy_equals_the_head_then_the_loss() {
    // x [rows.., k], head [n, k] (+ bias [n]); the composed reference is the head's forward and
    // the fused cross-entropy (itself checked against Candle in src/nn/loss.rs).
    let cases: &[(&[usize], usize)] = &[(&[1, 1], 1), (&[5, 7], 11), (&[2, 3, 16], 50)];
    for (dtype, tol) in [(DType::F32, 1e-5), (DType::F64, 1e-5), (DType::BF16, 2e-2)] {
        for &(shape, n) in cases {
            let k = *shape.last().unwrap();
            let rows: usize = shape[..shape.len() - 1].iter().product();
            let x = det(shape, 11).to_dtype(dtype).unwrap();
            let w = (det(&[n, k], 12).to_dtype(dtype).unwrap() * 0.3).unwrap();
            let b = det(&[n], 13).to_dtype(dtype).unwrap();
            let t: Vec<i64> = (0..rows).map(|i| ((i * 7) % n) as i64).collect();
            let t = Tensor::from_vec(t, rows, &Device::Cpu).unwrap();
            for options in [
                nn::CrossEntropyOptions::default(),
                nn::CrossEntropyOptions::default()
                    .label_smoothing(0.1)
                    .ignore_index(0),
            ] {
                let what = format!("{dtype:?} {shape:?} -> {n} {options:?}");
                for bias in [true, false] {
                    let head = |p: &[Tensor]| nn::Linear::new(p[0].clone(), p.get(1).cloned());
                    let params = if bias {
                        vec![w.clone(), b.clone()]
                    } else {
                        vec![w.clone()]
                    };
                    let diff = compare(
                        &x,
                        &params,
                        |x, p| nn::linear_cross_entropy(x, &head(p), &t, options).unwrap(),
                        |x, p| {
                            nn::cross_entropy_with(&head(p).forward(x).unwrap(), &t, options)
                                .unwrap()
                        },
                    );
                    assert!(
                        diff < tol,
                        "linear_cross_entropy {what} bias {bias}: {diff}"
                    );
                }
            }
        }
    }
    // A second backward pass over the same loss (the kept logits are gone) gives the same
    // gradients; bad targets are the loss's errors.
    let (x, w) = (Var::from_tensor(&det(&[4, 6], 1)).unwrap(), det(&[9, 6], 2));
    let head = nn::Linear::new(w, None);
    let t = Tensor::new(&[1u32, 8, 0, 3], &Device::Cpu).unwrap();
    let loss = nn::linear_cross_entropy(&x, &head, &t, Default::default()).unwrap();
    let g1 = loss.backward().unwrap().get(&x).unwrap().clone();
    let g2 = loss.backward().unwrap().get(&x).unwrap().clone();
    assert_eq!(max_diff(&g1, &g2), 0.0);
    let bad = Tensor::new(&[1u32, 9, 0, 3], &Device::Cpu).unwrap();
    let err = nn::linear_cross_entropy(&x, &head, &bad, Default::default()).unwrap_err();
    assert!(err.to_string().contains("row 1"), "{err}");
}

#[test]
fn gelu_relu_and_linear_match_candle_values_and_gradients() {
    // Linear inputs of rank 2, 3 and 4 (the last dim is `in`), contiguous or not.
    const LINEAR: &[(&[usize], usize)] = &[
        (&[1, 1], 1),
        (&[3, 5], 7),
        (&[2, 3, 17], 9),
        (&[2, 2, 4, 16], 33),
        (&[64, 256], 1024),
    ];
    for (dtype, tol) in [(DType::F32, 1e-5), (DType::F64, 1e-5), (DType::BF16, 2e-2)] {
        for shape in SHAPES {
            for transposed in [false, true] {
                let mut x = det(shape, 1).to_dtype(dtype).unwrap();
                if transposed && shape.len() == 2 && shape[0] > 1 {
                    x = det(&[shape[1], shape[0]], 1)
                        .to_dtype(dtype)
                        .unwrap()
                        .t()
                        .unwrap();
                }
                let diff = compare(
                    &x,
                    &[],
                    |x, _| nn::gelu(x).unwrap(),
                    |x, _| x.gelu().unwrap(),
                );
                assert!(
                    diff < tol,
                    "gelu {dtype:?} {shape:?} transposed {transposed}: {diff}"
                );
                let diff = compare(
                    &x,
                    &[],
                    |x, _| nn::relu(x).unwrap(),
                    |x, _| x.relu().unwrap(),
                );
                assert!(
                    diff < tol,
                    "relu {dtype:?} {shape:?} transposed {transposed}: {diff}"
                );
            }
        }
        for &(shape, out) in LINEAR {
            let k = *shape.last().unwrap();
            for transposed in [false, true] {
                let mut x = det(shape, 4).to_dtype(dtype).unwrap();
                if transposed && shape.len() == 2 && shape[0] > 1 {
                    x = det(&[shape[1], shape[0]], 4)
                        .to_dtype(dtype)
                        .unwrap()
                        .t()
                        .unwrap();
                }
                let w = (det(&[out, k], 5).to_dtype(dtype).unwrap() * 0.1).unwrap();
                let b = det(&[out], 6).to_dtype(dtype).unwrap();
                let what = format!("{dtype:?} {shape:?} -> {out} transposed {transposed}");
                let diff = compare(
                    &x,
                    &[w.clone(), b.clone()],
                    |x, p| {
                        nn::Linear::new(p[0].clone(), Some(p[1].clone()))
                            .forward(x)
                            .unwrap()
                    },
                    |x, p| {
                        candle_nn::Linear::new(p[0].clone(), Some(p[1].clone()))
                            .forward(x)
                            .unwrap()
                    },
                );
                assert!(diff < tol, "linear {what}: {diff}");
                let diff = compare(
                    &x,
                    std::slice::from_ref(&w),
                    |x, p| nn::Linear::new(p[0].clone(), None).forward(x).unwrap(),
                    |x, p| {
                        candle_nn::Linear::new(p[0].clone(), None)
                            .forward(x)
                            .unwrap()
                    },
                );
                assert!(diff < tol, "linear without bias {what}: {diff}");
                // Linear + ReLU as one op, against Candle's Linear then its ReLU (in bf16, against
                // our Linear then our ReLU in bf16: where a product is near 0, bf16 and f32 can
                // disagree on its sign, and so on the ReLU's mask).
                for bias in [true, false] {
                    let params = if bias {
                        vec![w.clone(), b.clone()]
                    } else {
                        vec![w.clone()]
                    };
                    let layer = |p: &[Tensor]| nn::Linear::new(p[0].clone(), p.get(1).cloned());
                    let fused = |x: &Tensor, p: &[Tensor]| nn::linear_relu(x, &layer(p)).unwrap();
                    if dtype == DType::BF16 {
                        let composed = |x: &Tensor, p: &[Tensor]| {
                            nn::relu(&layer(p).forward(x).unwrap()).unwrap()
                        };
                        let a = run_with(&fused, &x, &params, dtype);
                        let c = run_with(&composed, &x, &params, dtype);
                        for (a, c) in a.iter().zip(&c) {
                            assert_eq!(max_diff(a, c), 0.0, "linear_relu (bias {bias}) {what}");
                        }
                        continue;
                    }
                    let diff = compare(&x, &params, fused, |x, p| {
                        candle_nn::Linear::new(p[0].clone(), p.get(1).cloned())
                            .forward(x)
                            .unwrap()
                            .relu()
                            .unwrap()
                    });
                    assert!(diff < tol, "linear_relu (bias {bias}) {what}: {diff}");
                }
            }
        }
    }
    // The constructors take the same variables, initialized the same way, as candle_nn's.
    let varmap = candle_nn::VarMap::new();
    let vb = candle_nn::VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let ours = nn::linear(4, 3, vb.pp("fc")).unwrap();
    let theirs = candle_nn::linear(4, 3, vb.pp("fc")).unwrap();
    let x = det(&[2, 4], 7);
    assert!(max_diff(&ours.forward(&x).unwrap(), &theirs.forward(&x).unwrap()) < 1e-6);
    assert_eq!(varmap.all_vars().len(), 2);
    let nb = nn::linear_no_bias(4, 3, vb.pp("nb")).unwrap();
    assert!(nb.bias().is_none());
    assert_eq!(nb.weight().dims(), [3, 4]);
}

#[test]
fn layers_built_like_candle_nn_train_what_candle_nns_fused_ones_freeze() {
    let varmap = candle_nn::VarMap::new();
    let vb = candle_nn::VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let lin = candle_nn::linear(4, 8, vb.pp("enc")).unwrap();
    let ours = nn::layer_norm(8, nn::LayerNormConfig::default(), vb.pp("norm")).unwrap();
    let theirs =
        candle_nn::layer_norm(8, candle_nn::LayerNormConfig::default(), vb.pp("norm")).unwrap();
    let x = det(&[6, 4], 5);
    // The same values as candle_nn's layer (same variables)...
    let h = lin.forward(&x).unwrap();
    assert!(max_diff(&ours.forward(&h).unwrap(), &theirs.forward(&h).unwrap()) < 1e-5);
    // ...but the layer before gets its gradient.
    let g = ours
        .forward(&h)
        .unwrap()
        .sqr()
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    assert!(g.get(lin.weight()).is_some());
    let g = theirs
        .forward(&h)
        .unwrap()
        .sqr()
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    assert!(
        g.get(lin.weight()).is_none(),
        "candle_nn's fused LayerNorm now has a backward pass"
    );
    let rms = nn::rms_norm(8, 1e-6, vb.pp("rms")).unwrap();
    let g = rms
        .forward(&h)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    assert!(g.get(lin.weight()).is_some() && g.get(rms.weight()).is_some());
}

/// Attention composed from Candle's ops, formulated apart from the fused op: an additive `-1e4`
/// mask, softmax, and rows that see no key multiplied by 0.
fn attention_reference(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    causal: bool,
    padding: Option<&[u8]>,
    scale: f64,
) -> Tensor {
    let (b, _, tq, _) = q.dims4().unwrap();
    let tk = k.dim(2).unwrap();
    let mut add = vec![0f32; b * tq * tk];
    let mut any = vec![0f32; b * tq];
    for bi in 0..b {
        for i in 0..tq {
            for j in 0..tk {
                let hidden =
                    (causal && j + tq > i + tk) || padding.is_some_and(|p| p[bi * tk + j] != 0);
                if hidden {
                    add[(bi * tq + i) * tk + j] = -1e4;
                } else {
                    any[bi * tq + i] = 1.0;
                }
            }
        }
    }
    let dt = q.dtype();
    let add = Tensor::from_vec(add, (b, 1, tq, tk), &Device::Cpu)
        .unwrap()
        .to_dtype(dt)
        .unwrap();
    let any = Tensor::from_vec(any, (b, 1, tq, 1), &Device::Cpu)
        .unwrap()
        .to_dtype(dt)
        .unwrap();
    let s = (q.matmul(&k.t().unwrap()).unwrap() * scale).unwrap();
    let p = ops::softmax(&s.broadcast_add(&add).unwrap(), D::Minus1).unwrap();
    p.broadcast_mul(&any).unwrap().matmul(v).unwrap()
}

#[test]
fn attention_matches_composed_ops_values_and_gradients() {
    // (B, H, T_q, T_k, D, D_v); q is made [B, T_q, H, D] and transposed, so it is strided.
    let cases: &[[usize; 6]] = &[
        [1, 1, 1, 1, 1, 1],
        [2, 3, 5, 5, 4, 4],
        [2, 2, 3, 7, 8, 5],
        [2, 1, 6, 4, 3, 3],
        [1, 4, 64, 64, 16, 16],
        // Causal attention works in blocks of 64 rows and keys: lengths across them.
        [1, 2, 70, 70, 8, 8],
        [1, 1, 40, 75, 4, 4],
    ];
    for (dtype, tol) in [(DType::F32, 1e-5), (DType::F64, 1e-5), (DType::BF16, 2e-2)] {
        for &[b, h, tq, tk, d, dv] in cases {
            for causal in [false, true] {
                if causal && tq > tk {
                    continue;
                }
                for padded in [false, true] {
                    // Sequence 0 keeps its last key; sequence 1 (if any) has every key padded.
                    let pad: Vec<u8> = (0..b * tk)
                        .map(|i| u8::from(padded && (i / tk == 1 || i % tk % 2 == 1)))
                        .collect();
                    let pad = padded.then_some(pad);
                    let mut options = nn::AttentionOptions::default().causal(causal).scale(0.3);
                    if let Some(p) = &pad {
                        let m = Tensor::from_vec(p.clone(), (b, tk), &Device::Cpu).unwrap();
                        options = options.key_padding_mask(m);
                    }
                    let q = det(&[b, tq, h, d], 1).to_dtype(dtype).unwrap();
                    let k = det(&[b, h, tk, d], 2).to_dtype(dtype).unwrap();
                    let v = det(&[b, h, tk, dv], 3).to_dtype(dtype).unwrap();
                    let pad_ref = pad.as_deref();
                    let diff = compare(
                        &q,
                        &[k, v],
                        |q, p| {
                            let q = q.transpose(1, 2).unwrap();
                            nn::scaled_dot_product_attention(&q, &p[0], &p[1], &options).unwrap()
                        },
                        |q, p| {
                            let q = q.transpose(1, 2).unwrap().contiguous().unwrap();
                            attention_reference(&q, &p[0], &p[1], causal, pad_ref, 0.3)
                        },
                    );
                    let case = format!(
                        "{dtype:?} {:?} causal {causal} padded {padded}",
                        [b, h, tq, tk, d, dv]
                    );
                    assert!(diff < tol, "scaled_dot_product_attention {case}: {diff}");
                }
            }
        }
    }
}

#[test]
fn packed_self_attention_equals_split_heads_and_merged_output() {
    for (dtype, tol) in [(DType::F32, 1e-5), (DType::BF16, 2e-2)] {
        for &(b, t, heads, d) in &[
            (1usize, 1usize, 1usize, 1usize),
            (2, 5, 3, 4),
            (2, 16, 4, 8),
        ] {
            let c = heads * d;
            for causal in [false, true] {
                let pad: Vec<u8> = (0..b * t)
                    .map(|i| u8::from(i % t == t / 2 && t > 1))
                    .collect();
                let mask = Tensor::from_vec(pad.clone(), (b, t), &Device::Cpu).unwrap();
                let options = nn::AttentionOptions::default()
                    .causal(causal)
                    .key_padding_mask(mask);
                let qkv = det(&[b, t, 3 * c], 4).to_dtype(dtype).unwrap();
                let diff = compare(
                    &qkv,
                    &[],
                    |x, _| nn::packed_self_attention(x, heads, &options).unwrap(),
                    |x, _| {
                        let s = x
                            .reshape((b, t, 3, heads, d))
                            .unwrap()
                            .permute((2, 0, 3, 1, 4))
                            .unwrap();
                        let part = |i| s.get(i).unwrap().contiguous().unwrap();
                        let scale = 1.0 / (d as f64).sqrt();
                        let y = attention_reference(
                            &part(0),
                            &part(1),
                            &part(2),
                            causal,
                            Some(&pad),
                            scale,
                        );
                        y.transpose(1, 2).unwrap().reshape((b, t, c)).unwrap()
                    },
                );
                assert!(
                    diff < tol,
                    "packed {dtype:?} {:?} causal {causal}: {diff}",
                    (b, t, heads, d)
                );
            }
        }
    }
}

#[test]
fn attention_backward_twice_and_bad_inputs() {
    // A second backward pass over one graph recomputes the weights and gives the same gradients.
    let qkv = Var::from_tensor(&det(&[2, 6, 3 * 8], 5)).unwrap();
    let y =
        nn::packed_self_attention(&qkv, 2, &nn::AttentionOptions::default().causal(true)).unwrap();
    let loss = (&y * &det(y.dims(), 6)).unwrap().sum_all().unwrap();
    let g1 = loss.backward().unwrap().get(&qkv).unwrap().clone();
    let g2 = loss.backward().unwrap().get(&qkv).unwrap().clone();
    assert_eq!(max_diff(&g1, &g2), 0.0);

    let q = det(&[1, 2, 4, 8], 1);
    let k = det(&[1, 2, 3, 8], 2);
    let opts = nn::AttentionOptions::default();
    let err = |r: candle_core::Result<Tensor>| r.unwrap_err().to_string();
    let e = err(nn::scaled_dot_product_attention(
        &q,
        &det(&[1, 2, 3, 7], 2),
        &k,
        &opts,
    ));
    assert!(
        e.contains("expected q [B, H, T_q, D]") && e.contains("[1, 2, 3, 7]"),
        "{e}"
    );
    let e = err(nn::scaled_dot_product_attention(
        &q,
        &k,
        &k,
        &opts.clone().causal(true),
    ));
    assert!(e.contains("T_q <= T_k") && e.contains("4 queries"), "{e}");
    let bad_mask = opts.clone().key_padding_mask(det(&[1, 4], 0));
    let e = err(nn::scaled_dot_product_attention(&q, &k, &k, &bad_mask));
    assert!(
        e.contains("key_padding_mask of shape [1, 4]") && e.contains("[1, 3]"),
        "{e}"
    );
    let e = err(nn::scaled_dot_product_attention(
        &q,
        &k,
        &k.to_dtype(DType::F64).unwrap(),
        &opts,
    ));
    assert!(e.contains("one dtype"), "{e}");
    let e = err(nn::packed_self_attention(&det(&[1, 4, 24], 0), 5, &opts));
    assert!(e.contains("5 heads") && e.contains("[1, 4, 24]"), "{e}");
    assert!(nn::packed_self_attention(&det(&[1, 4, 24], 0), 0, &opts).is_err());
    // Empty sizes give empty (or zero) outputs, not a panic.
    let y = nn::packed_self_attention(&det(&[2, 0, 24], 0), 2, &opts).unwrap();
    assert_eq!(y.dims(), [2, 0, 8]);
    let e = err(nn::packed_self_attention(&det(&[1, 4, 0], 0), 2, &opts));
    assert!(e.contains("width 0"), "{e}");
}

/// The three rotary layouts: `(name, fused, Candle's fused op, the layout of xs)`.
type RopeFn = fn(&Tensor, &Tensor, &Tensor) -> candle_core::Result<Tensor>;
const ROPES: [(&str, RopeFn, RopeFn, bool); 3] = [
    ("rope", nn::rope, candle_nn::rotary_emb::rope, false),
    ("rope_i", nn::rope_i, candle_nn::rotary_emb::rope_i, false),
    (
        "rope_thd",
        nn::rope_thd,
        candle_nn::rotary_emb::rope_thd,
        true,
    ),
];

/// Rotary embeddings composed from Candle's differentiable ops: `candle_nn`'s own `rope_slow` /
/// `rope_i_slow` (a `[B, H, T, D]` layout and one `[T, D/2]` table); `thd` through a transpose,
/// and one table per sequence (`[B, T, D/2]`) sequence by sequence.
fn rope_reference(name: &str, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Tensor {
    use candle_nn::rotary_emb::{rope_i_slow, rope_slow};
    if cos.rank() == 3 {
        let parts: Vec<Tensor> = (0..x.dim(0).unwrap())
            .map(|b| {
                let xb = x.narrow(0, b, 1).unwrap();
                rope_reference(name, &xb, &cos.get(b).unwrap(), &sin.get(b).unwrap())
            })
            .collect();
        return Tensor::cat(&parts, 0).unwrap();
    }
    match name {
        "rope" => rope_slow(x, cos, sin).unwrap(),
        "rope_i" => rope_i_slow(x, cos, sin).unwrap(),
        _ => rope_slow(&x.transpose(1, 2).unwrap(), cos, sin)
            .unwrap()
            .transpose(1, 2)
            .unwrap(),
    }
}

/// `(B, H, T, D, positions in the tables)`: odd sizes, one token, more positions than tokens.
const ROPE_CASES: &[[usize; 5]] = &[
    [1, 1, 1, 2, 1],
    [2, 3, 5, 6, 5],
    [3, 2, 7, 14, 9],
    [2, 4, 1, 8, 4],
    [1, 5, 33, 64, 40],
    [2, 8, 64, 128, 64],
];

#[test]
fn rope_forward_equals_candles_fused_rope() {
    for (name, ours, theirs, thd) in ROPES {
        for &[b, h, t, d, positions] in ROPE_CASES {
            for batched in [false, true] {
                // Candle's CPU kernel reads a per-sequence table as if it had exactly `T`
                // positions (see `rope`'s docs), so compare those with `T` positions only.
                let positions = if batched { t } else { positions };
                let shape = if thd { [b, t, h, d] } else { [b, h, t, d] };
                let cs: Vec<usize> = if batched {
                    vec![b, positions, d / 2]
                } else {
                    vec![positions, d / 2]
                };
                let (x, c, s) = (det(&shape, 1), det(&cs, 2), det(&cs, 3));
                let what = format!("{name} {:?} batched {batched}", [b, h, t, d, positions]);
                let diff = max_diff(&ours(&x, &c, &s).unwrap(), &theirs(&x, &c, &s).unwrap());
                assert!(diff <= 1e-6, "{what}: f32 {diff}");
                for (dtype, tol) in [(DType::F64, 1e-6), (DType::BF16, 5e-2), (DType::F16, 5e-3)] {
                    let [x, c, s] = [&x, &c, &s].map(|t| t.to_dtype(dtype).unwrap());
                    let diff = max_diff(&ours(&x, &c, &s).unwrap(), &theirs(&x, &c, &s).unwrap());
                    assert!(diff <= tol, "{what}: {dtype:?} {diff}");
                }
            }
        }
    }
}

#[test]
fn rope_gradients_match_composed_ops_for_xs_cos_and_sin() {
    for (dtype, tol) in [
        (DType::F32, 1e-5),
        (DType::F64, 1e-5),
        (DType::BF16, 2e-2),
        (DType::F16, 5e-3),
    ] {
        for (name, ours, _, thd) in ROPES {
            for &[b, h, t, d, positions] in ROPE_CASES {
                for batched in [false, true] {
                    // xs comes out of the projection as [B, T, H, D]: `rope` and `rope_i` get it
                    // transposed (strided), `rope_thd` as it is; and the other way round.
                    for strided in [false, true] {
                        let made = if thd == strided {
                            [b, h, t, d]
                        } else {
                            [b, t, h, d]
                        };
                        let x = det(&made, 1).to_dtype(dtype).unwrap();
                        let cs: Vec<usize> = if batched {
                            vec![b, positions, d / 2]
                        } else {
                            vec![positions, d / 2]
                        };
                        let c = det(&cs, 2).to_dtype(dtype).unwrap();
                        let s = det(&cs, 3).to_dtype(dtype).unwrap();
                        let layout = |x: &Tensor| {
                            if made == [b, h, t, d] && !thd || made == [b, t, h, d] && thd {
                                x.clone()
                            } else {
                                x.transpose(1, 2).unwrap()
                            }
                        };
                        let diff = compare(
                            &x,
                            &[c, s],
                            |x, p| ours(&layout(x), &p[0], &p[1]).unwrap(),
                            |x, p| {
                                let x = layout(x).contiguous().unwrap();
                                rope_reference(name, &x, &p[0], &p[1])
                            },
                        );
                        let what = format!(
                            "{name} {dtype:?} {:?} batched {batched} strided {strided}",
                            [b, h, t, d, positions]
                        );
                        assert!(diff < tol, "{what}: {diff}");
                    }
                }
            }
        }
    }
}

#[test]
fn rope_shape_errors_name_the_tensor_and_shapes() {
    let err = |r: candle_core::Result<Tensor>| r.unwrap_err().to_string();
    let (x, c) = (det(&[1, 2, 3, 8], 1), det(&[3, 4], 2));
    let e = err(nn::rope(&det(&[2, 3, 8], 1), &c, &c));
    assert!(
        e.contains("nn::rope: xs must be [batch, heads, seq, head_dim]") && e.contains("[2, 3, 8]"),
        "{e}"
    );
    let e = err(nn::rope_thd(&det(&[2, 3, 8], 1), &c, &c));
    assert!(e.contains("[batch, seq, heads, head_dim]"), "{e}");
    let e = err(nn::rope(&x, &det(&[3, 3], 2), &c));
    assert!(
        e.contains("cos of shape [3, 3]") && e.contains("head_dim / 2 = 4"),
        "{e}"
    );
    let e = err(nn::rope_i(&det(&[1, 2, 3, 7], 1), &c, &c));
    assert!(
        e.contains("head_dim / 2 = 3.5") && e.contains("must be even"),
        "{e}"
    );
    let e = err(nn::rope(&x, &c, &det(&[2, 4], 2)));
    assert!(
        e.contains("sin of shape [2, 4] has 2 positions for a sequence of 3"),
        "{e}"
    );
    let e = err(nn::rope(&x, &det(&[2, 3, 4], 2), &det(&[2, 3, 4], 2)));
    assert!(
        e.contains("has a batch of 2, xs [1, 2, 3, 8] a batch of 1"),
        "{e}"
    );
    let e = err(nn::rope(&x, &c, &det(&[1, 3, 4], 2)));
    assert!(e.contains("cos and sin must both be"), "{e}");
    let e = err(nn::rope(&x, &c, &det(&[4], 2)));
    assert!(e.contains("cos and sin must both be"), "{e}");
    let e = err(nn::rope(&x, &c.to_dtype(DType::F16).unwrap(), &c));
    assert!(e.contains("one dtype") && e.contains("F16"), "{e}");
    // Empty sizes give empty outputs.
    let y = nn::rope(&det(&[2, 0, 3, 8], 1), &c, &c).unwrap();
    assert_eq!(y.dims(), [2, 0, 3, 8]);
}

#[test]
fn the_projections_before_rope_train_where_candles_rope_freezes_them() {
    let varmap = candle_nn::VarMap::new();
    let vb = candle_nn::VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let q_proj = candle_nn::linear_no_bias(8, 8, vb.pp("q_proj")).unwrap();
    let x = det(&[1, 5, 8], 1);
    let (cos, sin) = (
        det(&[5, 2], 2).cos().unwrap(),
        det(&[5, 2], 2).sin().unwrap(),
    );
    let q = q_proj
        .forward(&x)
        .unwrap()
        .reshape((1, 5, 2, 4))
        .unwrap()
        .transpose(1, 2)
        .unwrap();
    let loss = |y: Tensor| y.sqr().unwrap().sum_all().unwrap().backward().unwrap();
    let g = loss(nn::rope(&q, &cos, &sin).unwrap());
    assert!(g.get(q_proj.weight()).is_some());
    let g = loss(candle_nn::rotary_emb::rope(&q.contiguous().unwrap(), &cos, &sin).unwrap());
    assert!(
        g.get(q_proj.weight()).is_none(),
        "candle_nn::rotary_emb::rope now has a backward pass"
    );
}

#[test]
fn silu_and_swiglu_match_candle_values_and_gradients() {
    for (dtype, tol) in [
        (DType::F32, 1e-5),
        (DType::F64, 1e-5),
        (DType::BF16, 2e-2),
        (DType::F16, 5e-3),
    ] {
        for shape in SHAPES {
            for transposed in [false, true] {
                let mut x = det(shape, 1).to_dtype(dtype).unwrap();
                if transposed && shape.len() == 2 && shape[0] > 1 {
                    x = det(&[shape[1], shape[0]], 1)
                        .to_dtype(dtype)
                        .unwrap()
                        .t()
                        .unwrap();
                }
                let what = format!("{dtype:?} {shape:?} transposed {transposed}");
                let diff = compare(
                    &x,
                    &[],
                    |x, _| nn::silu(x).unwrap(),
                    |x, _| ops::silu(x).unwrap(),
                );
                assert!(diff < tol, "silu {what}: {diff}");
                let up = (det(shape, 2).to_dtype(dtype).unwrap() * 2.0).unwrap();
                let diff = compare(
                    &x,
                    std::slice::from_ref(&up),
                    |x, p| nn::swiglu(x, &p[0]).unwrap(),
                    |x, p| (ops::silu(x).unwrap() * &p[0]).unwrap(),
                );
                assert!(diff < tol, "swiglu {what}: {diff}");
            }
        }
    }
    // Large magnitudes saturate without NaN or infinity (e^{-x} is clamped).
    let x = Tensor::new(&[-1000f32, -90.0, 0.0, 90.0, 1000.0], &Device::Cpu).unwrap();
    let y = nn::silu(&x).unwrap().to_vec1::<f32>().unwrap();
    assert_eq!(y[2], 0.0);
    assert!(y[0].abs() < 1e-30 && (y[4] - 1000.0).abs() < 1e-3, "{y:?}");
    let e = nn::swiglu(&det(&[2, 3], 1), &det(&[3, 2], 1))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("one shape") && e.contains("[2, 3]") && e.contains("[3, 2]"),
        "{e}"
    );
    let e = nn::swiglu(
        &det(&[2, 3], 1),
        &det(&[2, 3], 1).to_dtype(DType::F64).unwrap(),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("one dtype"), "{e}");
}
