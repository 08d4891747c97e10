//! Tests of `flash.rs`: the tiled kernels against the composed reference (Candle's ops, which a
//! plain f64 loop checks in turn) and against [`scaled_dot_product_attention`], forward and every
//! gradient, for every mask, odd sizes, GQA, half precision, empty rows and NaN.

use super::*;
use crate::nn::{scaled_dot_product_attention, AttentionOptions};
use candle_core::{Device, Var};

/// A case: sizes, masks.
#[derive(Clone, Debug, Default)]
struct Case {
    b: usize,
    h: usize,
    hkv: usize,
    tq: usize,
    tk: usize,
    d: usize,
    dv: usize,
    causal: bool,
    window: Option<usize>,
    /// Document lengths of each row (summing to T_k).
    docs: Option<Vec<Vec<usize>>>,
    /// Padding keys at the end of each row.
    pad: Option<Vec<usize>>,
}

impl Case {
    fn new(b: usize, h: usize, hkv: usize, t: usize, d: usize) -> Case {
        Case {
            b,
            h,
            hkv,
            tq: t,
            tk: t,
            d,
            dv: d,
            ..Default::default()
        }
    }

    fn options(&self, dev: &Device) -> FlashAttentionOptions {
        let mut o = FlashAttentionOptions::default().causal(self.causal);
        if let Some(w) = self.window {
            o = o.window(w);
        }
        if let Some(docs) = &self.docs {
            let mut ids = Vec::new();
            for row in docs {
                for (i, &len) in row.iter().enumerate() {
                    // Ids need not be small or in order: only equality counts.
                    ids.extend(std::iter::repeat_n(1000 - 7 * i as i64, len));
                }
            }
            o = o.document_ids(Tensor::from_vec(ids, (self.b, self.tk), dev).unwrap());
        }
        if let Some(pad) = &self.pad {
            let mut m = vec![0u8; self.b * self.tk];
            for (row, &p) in pad.iter().enumerate() {
                m[row * self.tk + self.tk - p..(row + 1) * self.tk].fill(1);
            }
            o = o.key_padding_mask(Tensor::from_vec(m, (self.b, self.tk), dev).unwrap());
        }
        o
    }

    fn inputs(&self, seed: u64) -> [Tensor; 3] {
        let dev = Device::Cpu;
        let gen = |shape: (usize, usize, usize, usize), salt: u64| {
            let n = shape.0 * shape.1 * shape.2 * shape.3;
            let v: Vec<f32> = (0..n as u64)
                .map(|i| {
                    let x = (i * 2654435761 + salt * 97 + seed * 7919) % 10007;
                    (x as f32 / 10007.0 - 0.5) * 3.0
                })
                .collect();
            Tensor::from_vec(v, shape, &dev).unwrap()
        };
        [
            gen((self.b, self.h, self.tq, self.d), 1),
            gen((self.b, self.hkv, self.tk, self.d), 2),
            gen((self.b, self.hkv, self.tk, self.dv), 3),
        ]
    }
}

/// The output and the gradients of q, k and v of `f` for the loss `sum(y ∘ w)`.
fn run(
    x: &[Tensor; 3],
    f: impl Fn(&Tensor, &Tensor, &Tensor) -> Result<Tensor>,
) -> (Tensor, [Tensor; 3]) {
    let vars = x.clone().map(|t| Var::from_tensor(&t).unwrap());
    let y = f(
        vars[0].as_tensor(),
        vars[1].as_tensor(),
        vars[2].as_tensor(),
    )
    .unwrap();
    let n = y.elem_count();
    let w: Vec<f32> = (0..n).map(|i| ((i * 31 % 17) as f32 - 8.0) / 8.0).collect();
    let w = Tensor::from_vec(w, y.shape(), y.device())
        .unwrap()
        .to_dtype(y.dtype())
        .unwrap();
    let g = (&y * w).unwrap().sum_all().unwrap().backward().unwrap();
    let grads = vars.map(|v| g.get(v.as_tensor()).unwrap().clone());
    (y, grads)
}

fn diff(a: &Tensor, b: &Tensor) -> f32 {
    crate::nn::elem::max_diff(
        &a.to_dtype(DType::F32).unwrap(),
        &b.to_dtype(DType::F32).unwrap(),
    )
}

/// The flash op and the composed reference agree on the output and every gradient.
fn check(case: &Case, tol: f32) {
    let dev = Device::Cpu;
    let x = case.inputs(1);
    let o = case.options(&dev);
    let (y, g) = run(&x, |q, k, v| flash_attention(q, k, v, &o));
    let dims = checked_dims(&x[0], &x[1], &x[2]).unwrap();
    let scale = checked_options(dims, &o).unwrap();
    let (ry, rg) = run(&x, |q, k, v| composed(q, k, v, dims, scale, &o));
    let d = diff(&y, &ry);
    assert!(d < tol, "{case:?}: output differs by {d}");
    for (i, (a, b)) in g.iter().zip(&rg).enumerate() {
        let d = diff(a, b);
        assert!(
            d < tol,
            "{case:?}: gradient of {} differs by {d}",
            ["q", "k", "v"][i]
        );
    }
}

#[test]
fn every_mask_equals_the_composed_reference() {
    let mut cases = Vec::new();
    let base = Case::new(2, 4, 4, 150, 16);
    cases.push(base.clone());
    cases.push(Case {
        causal: true,
        ..base.clone()
    });
    // Odd sizes: T not a multiple of the tiles, head widths 8 to 128, D_v != D, T_q < T_k.
    for (t, d) in [(1, 8), (7, 24), (129, 8), (200, 128), (65, 40)] {
        cases.push(Case {
            causal: true,
            ..Case::new(1, 2, 1, t, d)
        });
    }
    cases.push(Case {
        dv: 12,
        ..Case::new(1, 2, 2, 70, 20)
    });
    cases.push(Case {
        tq: 37,
        tk: 170,
        causal: true,
        ..Case::new(2, 2, 2, 0, 16)
    });
    // Sliding windows (smaller and larger than a tile), GQA.
    for w in [1, 5, 64, 100, 500] {
        cases.push(Case {
            causal: true,
            window: Some(w),
            ..Case::new(1, 6, 2, 260, 16)
        });
    }
    // Packed documents (causal and not), with a window, with padding.
    let docs = Some(vec![vec![50, 1, 90, 59], vec![200]]);
    for (causal, window, pad) in [
        (true, None, None),
        (false, None, None),
        (true, Some(20), None),
        (true, None, Some(vec![30, 0])),
    ] {
        cases.push(Case {
            causal,
            window,
            pad,
            docs: docs.clone(),
            ..Case::new(2, 4, 2, 200, 16)
        });
    }
    // Padding alone, causal and not.
    for causal in [false, true] {
        cases.push(Case {
            causal,
            pad: Some(vec![3, 140]),
            ..Case::new(2, 2, 2, 150, 32)
        });
    }
    for case in &cases {
        check(case, 2e-5);
    }
}

/// The composed reference itself, against a plain loop in f64 (forward).
#[test]
fn the_composed_reference_equals_a_plain_loop() {
    let case = Case {
        causal: true,
        window: Some(4),
        docs: Some(vec![vec![5, 6], vec![11]]),
        pad: Some(vec![0, 2]),
        ..Case::new(2, 4, 2, 11, 8)
    };
    let x = case.inputs(3);
    let o = case.options(&Device::Cpu);
    let dims = checked_dims(&x[0], &x[1], &x[2]).unwrap();
    let scale = checked_options(dims, &o).unwrap() as f64;
    let y = composed(&x[0], &x[1], &x[2], dims, scale as f32, &o).unwrap();
    let flat = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let (q, k, v, y) = (flat(&x[0]), flat(&x[1]), flat(&x[2]), flat(&y));
    let ids: Vec<usize> = [vec![0; 5], vec![1; 6], vec![0; 11]].concat();
    let (t, d) = (case.tq, case.d);
    for b in 0..2 {
        for h in 0..4 {
            let g = h / 2;
            for i in 0..t {
                let seen: Vec<usize> = (0..t)
                    .filter(|&j| j <= i && j + 4 > i && ids[b * t + j] == ids[b * t + i])
                    .filter(|&j| !(b == 1 && j >= t - 2))
                    .collect();
                let score = |j: usize| {
                    (0..d)
                        .map(|c| {
                            q[((b * 4 + h) * t + i) * d + c] as f64
                                * k[((b * 2 + g) * t + j) * d + c] as f64
                        })
                        .sum::<f64>()
                        * scale
                };
                let m = seen.iter().map(|&j| score(j)).fold(f64::MIN, f64::max);
                let z: f64 = seen.iter().map(|&j| (score(j) - m).exp()).sum();
                for c in 0..d {
                    let want: f64 = seen
                        .iter()
                        .map(|&j| {
                            (score(j) - m).exp() / z * v[((b * 2 + g) * t + j) * d + c] as f64
                        })
                        .sum();
                    let got = y[((b * 4 + h) * t + i) * d + c] as f64;
                    assert!(
                        (got - want).abs() < 1e-5,
                        "b {b} h {h} i {i} c {c}: {got} vs {want}"
                    );
                }
            }
        }
    }
}

/// Where the existing op applies (causal, padding, one key/value head per head), the flash op
/// equals it too, forward and backward.
#[test]
fn it_equals_scaled_dot_product_attention() {
    for (causal, pad, tq, tk) in [
        (true, false, 100, 100),
        (false, true, 70, 90),
        (true, true, 50, 140),
    ] {
        let case = Case {
            tq,
            tk,
            causal,
            pad: pad.then(|| vec![0, 7]),
            ..Case::new(2, 3, 3, 0, 16)
        };
        let x = case.inputs(2);
        let o = case.options(&Device::Cpu);
        let mut old = AttentionOptions::default().causal(causal);
        if let Some(m) = &o.key_padding_mask {
            old = old.key_padding_mask(m.clone());
        }
        assert_eq!(FlashAttentionOptions::from(&old).causal, causal);
        let (y, g) = run(&x, |q, k, v| flash_attention(q, k, v, &o));
        let (ry, rg) = run(&x, |q, k, v| scaled_dot_product_attention(q, k, v, &old));
        assert!(diff(&y, &ry) < 2e-5, "{case:?}");
        for (a, b) in g.iter().zip(&rg) {
            assert!(diff(a, b) < 2e-5, "{case:?}: {}", diff(a, b));
        }
    }
}

#[test]
fn cu_seqlens_equal_document_ids_and_bad_ones_are_refused() {
    let case = Case {
        causal: true,
        docs: Some(vec![vec![3, 4, 3], vec![10]]),
        ..Case::new(2, 2, 2, 10, 8)
    };
    let x = case.inputs(4);
    let by_ids = flash_attention(&x[0], &x[1], &x[2], &case.options(&Device::Cpu)).unwrap();
    let cu = FlashAttentionOptions::default()
        .causal(true)
        .cu_seqlens(vec![0, 3, 7, 10, 20]);
    let by_cu = flash_attention(&x[0], &x[1], &x[2], &cu).unwrap();
    assert_eq!(diff(&by_ids, &by_cu), 0.0);
    for (bad, says) in [
        (vec![0, 3, 7, 12, 20], "runs past the end of row 0"),
        (vec![0, 3, 2, 20], "decrease at document 1"),
        (vec![0, 10, 19], "from 0 to B · T_k = 20"),
        (vec![1, 10, 20], "from 0 to B · T_k = 20"),
    ] {
        let o = FlashAttentionOptions::default().cu_seqlens(bad);
        let err = flash_attention(&x[0], &x[1], &x[2], &o)
            .unwrap_err()
            .to_string();
        assert!(err.contains(says), "{err}");
    }
}

#[test]
fn bad_shapes_and_options_are_refused_with_what_is_wrong() {
    let dev = Device::Cpu;
    let t = |s: (usize, usize, usize, usize)| Tensor::zeros(s, DType::F32, &dev).unwrap();
    let (q, k) = (t((1, 4, 5, 8)), t((1, 3, 5, 8)));
    let err = flash_attention(&q, &k, &k, &FlashAttentionOptions::default()).unwrap_err();
    assert!(err.to_string().contains("H a multiple of H_kv"), "{err}");
    let k = t((1, 2, 5, 8));
    let k16 = k.to_dtype(DType::F16).unwrap();
    let err = flash_attention(&q, &k16, &k, &FlashAttentionOptions::default()).unwrap_err();
    assert!(err.to_string().contains("one dtype"), "{err}");
    for (o, says) in [
        (FlashAttentionOptions::default().window(3), "needs causal"),
        (
            FlashAttentionOptions::default().causal(true).window(0),
            "window of 0",
        ),
        (
            FlashAttentionOptions::default()
                .key_padding_mask(Tensor::zeros(4, DType::U8, &dev).unwrap()),
            "key_padding_mask of shape [4]",
        ),
        (
            FlashAttentionOptions::default()
                .document_ids(Tensor::zeros((1, 5), DType::F32, &dev).unwrap()),
            "must be integers",
        ),
        (FlashAttentionOptions::default().scale(f64::NAN), "finite"),
    ] {
        let err = flash_attention(&q, &k, &k, &o).unwrap_err().to_string();
        assert!(err.contains(says), "{says}: {err}");
    }
    let long_q = t((1, 4, 6, 8));
    let err = flash_attention(
        &long_q,
        &k,
        &k,
        &FlashAttentionOptions::default().causal(true),
    );
    assert!(err.unwrap_err().to_string().contains("T_q <= T_k"));
    // Empty sizes give zeros of the right shape.
    let y = flash_attention(&t((1, 4, 0, 8)), &k, &k, &FlashAttentionOptions::default()).unwrap();
    assert_eq!(y.dims(), [1, 4, 0, 8]);
}

/// Rows that see no key get zeros and pass no gradient, as the existing op's convention.
#[test]
fn fully_masked_rows_are_zeros() {
    let case = Case {
        pad: Some(vec![150, 0]),
        causal: true,
        ..Case::new(2, 2, 1, 150, 16)
    };
    check(&case, 2e-5);
    let x = case.inputs(5);
    let (y, g) = run(&x, |q, k, v| {
        flash_attention(q, k, v, &case.options(&Device::Cpu))
    });
    let y0 = y
        .get(0)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    assert!(y0.iter().all(|v| *v == 0.0));
    for g in &g {
        let g0 = g
            .get(0)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        assert!(g0.iter().all(|v| *v == 0.0));
        assert!(g
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
            .iter()
            .all(|v| v.is_finite()));
    }
}

/// A NaN input gives NaN where it is seen (never zeros, as a masked row would), and leaves the
/// rows that do not see it alone.
#[test]
fn nan_inputs_give_nan() {
    let case = Case {
        causal: true,
        ..Case::new(1, 1, 1, 140, 8)
    };
    let o = case.options(&Device::Cpu);
    let [q, k, v] = case.inputs(6);
    let poison = |t: &Tensor, row: usize| {
        let mut x = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        x[row * case.d + 1] = f32::NAN;
        Tensor::from_vec(x, t.shape(), t.device()).unwrap()
    };
    let rows_nan = |y: &Tensor| -> Vec<bool> {
        let y = y.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        y.chunks(case.dv)
            .map(|r| r.iter().all(|v| v.is_nan()))
            .collect()
    };
    // A NaN query row: that row only.
    let (y, g) = run(&[poison(&q, 100), k.clone(), v.clone()], |q, k, v| {
        flash_attention(q, k, v, &o)
    });
    let nan = rows_nan(&y);
    assert!((0..140).all(|i| nan[i] == (i == 100)), "{nan:?}");
    assert!(rows_nan(&g[0])[100]);
    // A NaN key at position 130: every query that sees it (130..) and none before.
    let (y, _) = run(&[q.clone(), poison(&k, 130), v.clone()], |q, k, v| {
        flash_attention(q, k, v, &o)
    });
    let nan = rows_nan(&y);
    assert!((0..140).all(|i| nan[i] == (i >= 130)), "{nan:?}");
}

#[test]
fn half_precision_inputs_are_computed_in_f32() {
    let case = Case {
        causal: true,
        window: Some(40),
        ..Case::new(1, 4, 2, 100, 32)
    };
    let x = case.inputs(7);
    let o = case.options(&Device::Cpu);
    for dtype in [DType::BF16, DType::F16] {
        let xh = x.clone().map(|t| t.to_dtype(dtype).unwrap());
        let (y, g) = run(&xh, |q, k, v| flash_attention(q, k, v, &o));
        assert_eq!(y.dtype(), dtype);
        // The reference in f32 from the same rounded inputs.
        let x32 = xh.clone().map(|t| t.to_dtype(DType::F32).unwrap());
        let (ry, rg) = run(&x32, |q, k, v| flash_attention(q, k, v, &o));
        let tol = if dtype == DType::BF16 { 2e-2 } else { 3e-3 };
        assert!(diff(&y, &ry) < tol, "{dtype:?}: {}", diff(&y, &ry));
        for (a, b) in g.iter().zip(&rg) {
            assert_eq!(a.dtype(), dtype);
            assert!(diff(a, b) < 4.0 * tol, "{dtype:?}: {}", diff(a, b));
        }
    }
}

/// Strided inputs (the heads of a `[B, T, H, D]` projection, transposed without a copy) and a
/// second backward pass through the same graph.
#[test]
fn strided_inputs_and_a_second_backward_pass() {
    let case = Case {
        causal: true,
        ..Case::new(2, 4, 2, 90, 16)
    };
    let [q, k, v] = case.inputs(8);
    let strided = [&q, &k, &v].map(|t| {
        t.transpose(1, 2)
            .unwrap()
            .contiguous()
            .unwrap()
            .transpose(1, 2)
            .unwrap()
    });
    assert!(!strided[0].is_contiguous());
    let o = case.options(&Device::Cpu);
    let y = flash_attention(&q, &k, &v, &o).unwrap();
    let ys = flash_attention(&strided[0], &strided[1], &strided[2], &o).unwrap();
    assert_eq!(diff(&y, &ys), 0.0);
    let qv = Var::from_tensor(&q).unwrap();
    let y = flash_attention(qv.as_tensor(), &k, &v, &o).unwrap();
    let loss = y.sqr().unwrap().sum_all().unwrap();
    let g1 = loss
        .backward()
        .unwrap()
        .get(qv.as_tensor())
        .unwrap()
        .clone();
    let g2 = loss
        .backward()
        .unwrap()
        .get(qv.as_tensor())
        .unwrap()
        .clone();
    assert_eq!(diff(&g1, &g2), 0.0);
}

/// The one-pass backward (a task per key/value head) and the two-pass one (per tile) give the
/// same bits, for every mask.
#[test]
fn both_backward_schedules_give_the_same_bits() {
    let cases = [
        Case {
            causal: true,
            window: Some(70),
            ..Case::new(2, 6, 2, 300, 24)
        },
        Case {
            causal: true,
            docs: Some(vec![vec![10, 150, 40], vec![1, 199]]),
            pad: Some(vec![0, 20]),
            ..Case::new(2, 2, 1, 200, 16)
        },
        Case {
            tq: 90,
            tk: 260,
            ..Case::new(1, 3, 3, 0, 8)
        },
    ];
    for case in cases {
        let x = case.inputs(9);
        let o = case.options(&Device::Cpu);
        let dims = checked_dims(&x[0], &x[1], &x[2]).unwrap();
        let scale = checked_options(dims, &o).unwrap();
        let grads = |one_pass| {
            run(&x, |q, k, v| {
                let op = FlashAttention {
                    one_pass: Some(one_pass),
                    ..FlashAttention::new(dims, scale, visibility(dims, &o)?)
                };
                q.apply_op3(k, v, op)
            })
            .1
        };
        let (one, two) = (grads(true), grads(false));
        for (a, b) in one.iter().zip(&two) {
            assert_eq!(diff(a, b), 0.0, "{case:?}");
        }
        check(&case, 2e-5);
    }
}
