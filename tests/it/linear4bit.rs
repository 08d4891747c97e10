//! `nn::Linear4bit`, a frozen linear layer over a 4-bit weight: its output and input gradient
//! equal a `Linear` over the dequantized weight's (and finite differences), no gradient reaches
//! the weight or bias, and with a LoRA adapter it is the same as LoRA over the dequantized base
//! (QLoRA), in f32, bf16 and f16.

use accelerate_rs::nn::{Linear, Linear4bit, Lora};
use accelerate_rs::quant::{Quant4bitConfig, Weight4bit};
use candle_core::{DType, Device, Module, Tensor, Var};

const DEV: Device = Device::Cpu;

/// Deterministic values in [-0.5, 0.5) times `scale`.
fn det(shape: &[usize], salt: usize, scale: f32) -> Tensor {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n)
        .map(|i| (((i * 7919 + salt * 104_729) % 1000) as f32 / 1000.0 - 0.5) * scale)
        .collect();
    Tensor::from_vec(v, shape, &DEV).unwrap()
}

fn f32s(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// `max |a - b| / max(1, max |b|)`.
fn rel_err(a: &Tensor, b: &Tensor) -> f32 {
    assert_eq!(a.dims(), b.dims());
    let (a, b) = (f32s(a), f32s(b));
    let scale = b.iter().fold(1f32, |m, v| m.max(v.abs()));
    a.iter()
        .zip(&b)
        .fold(0f32, |m, (x, y)| m.max((x - y).abs()))
        / scale
}

/// A `[out, in]` 4-bit layer of weight dtype `wdtype`, with a bias if `bias`.
fn layer(out: usize, inp: usize, wdtype: DType, bias: bool) -> Linear4bit {
    let w = det(&[out, inp], 1, 0.2).to_dtype(wdtype).unwrap();
    let b = bias.then(|| det(&[out], 2, 1.0).to_dtype(wdtype).unwrap());
    let q = Weight4bit::quantize(&w, &Quant4bitConfig::nf4()).unwrap();
    Linear4bit::new(q, b).unwrap()
}

/// The reference: a `Linear` over the dequantized weight (cast to `dtype`, as bitsandbytes
/// does), the bias cast likewise.
fn reference(l: &Linear4bit, dtype: DType) -> Linear {
    let w = l.dequantized_weight().unwrap().to_dtype(dtype).unwrap();
    Linear::new(w, l.bias().map(|b| b.to_dtype(dtype).unwrap()))
}

#[test]
fn linear4bit_equals_a_linear_over_the_dequantized_weight() {
    for (xdtype, wdtype, tol) in [
        (DType::F32, DType::F32, 1e-5),
        (DType::F32, DType::BF16, 1e-5),
        (DType::BF16, DType::BF16, 2e-2),
        (DType::BF16, DType::F32, 2e-2),
        (DType::F16, DType::F16, 2e-3),
        // f64 takes the composed path (the weight dequantized, then Candle's ops).
        (DType::F64, DType::F32, 1e-12),
    ] {
        for bias in [false, true] {
            let l = layer(48, 80, wdtype, bias);
            let r = reference(&l, xdtype);
            let x = Var::from_tensor(&det(&[2, 3, 80], 3, 2.0).to_dtype(xdtype).unwrap()).unwrap();
            let xr = Var::from_tensor(x.as_tensor()).unwrap();
            let y = l.forward(&x).unwrap();
            let yr = r.forward(&xr).unwrap();
            assert_eq!((y.dims(), y.dtype()), (&[2usize, 3, 48][..], xdtype));
            let what = format!("x {xdtype:?}, W {wdtype:?}, bias {bias}");
            assert!(
                rel_err(&y, &yr) < tol,
                "{what}: output {}",
                rel_err(&y, &yr)
            );
            let probe = det(&[2, 3, 48], 4, 1.0).to_dtype(xdtype).unwrap();
            let grads = (y * &probe).unwrap().sum_all().unwrap().backward().unwrap();
            let gr = (yr * &probe)
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            let (dx, dxr) = (grads.get(&x).unwrap(), gr.get(&xr).unwrap());
            assert_eq!(dx.dtype(), xdtype);
            assert!(
                rel_err(dx, dxr) < tol,
                "{what}: input gradient {}",
                rel_err(dx, dxr)
            );
        }
    }
}

#[test]
fn linear4bit_input_gradient_matches_finite_differences() {
    let l = layer(7, 130, DType::F32, true);
    let x = det(&[3, 130], 5, 2.0);
    let probe = det(&[3, 7], 6, 1.0);
    let loss = |x: &Tensor| -> f64 {
        let y = l.forward(x).unwrap();
        f64::from(
            (y * &probe)
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap(),
        )
    };
    let xv = Var::from_tensor(&x).unwrap();
    let y = l.forward(&xv).unwrap();
    let grads = (y * &probe).unwrap().sum_all().unwrap().backward().unwrap();
    let dx = f32s(grads.get(&xv).unwrap());
    let base = f32s(&x);
    let h = 0.05f32;
    for i in [0usize, 1, 64, 129, 200, 389] {
        let mut plus = base.clone();
        plus[i] += h;
        let mut minus = base.clone();
        minus[i] -= h;
        let t = |v: Vec<f32>| Tensor::from_vec(v, (3, 130), &DEV).unwrap();
        let fd = (loss(&t(plus)) - loss(&t(minus))) / (2.0 * f64::from(h));
        assert!(
            (fd - f64::from(dx[i])).abs() < 1e-3,
            "element {i}: {fd} vs {}",
            dx[i]
        );
    }
}

#[test]
fn linear4bit_weight_and_bias_get_no_gradient() {
    let w = det(&[16, 64], 7, 0.2);
    let bias = Var::from_tensor(&det(&[16], 8, 1.0)).unwrap();
    let fc = Linear::new(w, Some(bias.as_tensor().clone()));
    let l = Linear4bit::from_linear(&fc, &Quant4bitConfig::fp4()).unwrap();
    let x = Var::from_tensor(&det(&[4, 64], 9, 1.0)).unwrap();
    let grads = l
        .forward(&x)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    assert!(grads.get(&x).is_some());
    assert!(grads.get(&bias).is_none(), "the frozen bias got a gradient");
    // 4 bits a weight, 8-bit block scales, the nested statistics, the f32 bias.
    assert_eq!(l.nbytes(), 16 * 64 / 2 + 16 + 4 + 1024 + 16 * 4);
    assert_eq!(l.dims(), (16, 64));
}

/// An adapter with nonzero `A` and `B` in `dtype` for a `[out, in]` layer.
fn adapter(out: usize, inp: usize, dtype: DType, dropout: f64) -> (Var, Var, Lora) {
    let a = Var::from_tensor(&det(&[4, inp], 10, 0.5).to_dtype(dtype).unwrap()).unwrap();
    let b = Var::from_tensor(&det(&[out, 4], 11, 0.5).to_dtype(dtype).unwrap()).unwrap();
    let lora =
        Lora::from_tensors(a.as_tensor().clone(), b.as_tensor().clone(), 1.5, dropout).unwrap();
    (a, b, lora)
}

#[test]
fn qlora_equals_lora_over_the_dequantized_base() {
    // The adapter in the input's dtype (one fused op on the CPU), and an f32 adapter on bf16
    // inputs (the fused base, then the update added in f32).
    for (xdtype, wdtype, adtype, tol) in [
        (DType::F32, DType::F32, DType::F32, 1e-5),
        (DType::F32, DType::BF16, DType::F32, 1e-5),
        (DType::BF16, DType::BF16, DType::BF16, 2e-2),
        (DType::F16, DType::F32, DType::F16, 3e-3),
        (DType::BF16, DType::BF16, DType::F32, 2e-2),
    ] {
        let l = layer(40, 96, wdtype, true);
        let dense = reference(&l, xdtype);
        let (a, b, lora) = adapter(40, 96, adtype, 0.0);
        let (ar, br, lora_r) = adapter(40, 96, adtype, 0.0);
        let x = Var::from_tensor(&det(&[5, 96], 12, 2.0).to_dtype(xdtype).unwrap()).unwrap();
        let xr = Var::from_tensor(x.as_tensor()).unwrap();
        let y = l.forward_with_lora(&x, &lora, true).unwrap();
        let yr = lora_r
            .forward_with_base(&xr, dense.weight(), dense.bias(), true)
            .unwrap();
        let what = format!("x {xdtype:?}, W {wdtype:?}, adapter {adtype:?}");
        assert_eq!(y.dtype(), yr.dtype(), "{what}");
        assert!(
            rel_err(&y, &yr) < tol,
            "{what}: output {}",
            rel_err(&y, &yr)
        );
        let probe = det(&[5, 40], 13, 1.0).to_dtype(y.dtype()).unwrap();
        let g = (y * &probe).unwrap().sum_all().unwrap().backward().unwrap();
        let gr = (yr * &probe)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        for (name, ours, theirs) in [("x", &x, &xr), ("A", &a, &ar), ("B", &b, &br)] {
            let (d, dr) = (g.get(ours).unwrap(), gr.get(theirs).unwrap());
            assert!(
                rel_err(d, dr) < tol,
                "{what}: gradient of {name}: {}",
                rel_err(d, dr)
            );
        }
    }
}

#[test]
fn qlora_dropout_trains_the_adapter() {
    let l = layer(8, 64, DType::F32, false);
    let (a, b, lora) = adapter(8, 64, DType::F32, 0.5);
    let x = det(&[6, 64], 14, 1.0);
    // Evaluation: no dropout, the fused op.
    let eval = l.forward_with_lora(&x, &lora, false).unwrap();
    let dense = reference(&l, DType::F32);
    let want = lora
        .forward_with_base(&x, dense.weight(), None, false)
        .unwrap();
    assert!(rel_err(&eval, &want) < 1e-5);
    // Training with dropout: the update on dropped inputs, both adapter tensors trained.
    let y = l.forward_with_lora(&x, &lora, true).unwrap();
    assert!(rel_err(&y, &eval) > 1e-3, "dropout changed nothing");
    let g = y.sum_all().unwrap().backward().unwrap();
    assert!(g.get(&a).is_some() && g.get(&b).is_some());
}

#[test]
fn linear4bit_refuses_bad_parts() {
    let q = Weight4bit::quantize(&det(&[3, 4, 64], 15, 1.0), &Quant4bitConfig::nf4()).unwrap();
    let e = Linear4bit::new(q, None).unwrap_err().to_string();
    assert!(e.contains("[out, in] expected"), "{e}");
    let q = Weight4bit::quantize(&det(&[4, 64], 15, 1.0), &Quant4bitConfig::nf4()).unwrap();
    let e = Linear4bit::new(q, Some(det(&[5], 1, 1.0)))
        .unwrap_err()
        .to_string();
    assert!(e.contains("[4] of a float dtype expected"), "{e}");
    // An input of the wrong width is Candle's shape error, not a panic.
    let l = layer(4, 64, DType::F32, false);
    assert!(l.forward(&det(&[2, 63], 1, 1.0)).is_err());
}
