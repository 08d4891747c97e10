//! The fused ops that span several layers (`nn::swiglu_linear`) and the weight gradients they
//! hand straight to `nn::backward`, against Candle's composed ops and a plain backward pass.

use accelerate_rs::nn;
use candle_core::{DType, Module, Tensor, Var};
use candle_nn::ops;

use super::nn::{compare, det, max_diff};

#[test]
fn swiglu_linear_matches_the_composed_mlp_in_values_and_gradients() {
    for shape in [&[1usize, 1][..], &[3, 5], &[2, 3, 17], &[64, 96]] {
        let k = *shape.last().unwrap();
        for n in [1, 7, 33] {
            let x = det(shape, 1);
            let wg = (det(&[n, k], 2) * 0.3).unwrap();
            let wu = (det(&[n, k], 3) * 0.3).unwrap();
            let lin = |w: &Tensor| nn::Linear::new(w.clone(), None);
            let diff = compare(
                &x,
                &[wg, wu],
                |x, p| nn::swiglu_linear(x, &lin(&p[0]), &lin(&p[1])).unwrap(),
                |x, p| {
                    let g = candle_nn::Linear::new(p[0].clone(), None)
                        .forward(x)
                        .unwrap();
                    let u = candle_nn::Linear::new(p[1].clone(), None)
                        .forward(x)
                        .unwrap();
                    (ops::silu(&g).unwrap() * u).unwrap()
                },
            );
            assert!(diff < 1e-5, "{shape:?} -> {n}: {diff}");
        }
    }
    // Other dtypes and biases take the composed ops: the same values.
    let x = det(&[3, 4], 1).to_dtype(DType::F64).unwrap();
    let w = det(&[5, 4], 2).to_dtype(DType::F64).unwrap();
    let l = nn::Linear::new(w.clone(), None);
    let y = nn::swiglu_linear(&x, &l, &l).unwrap();
    let g = x.matmul(&w.t().unwrap()).unwrap();
    let want = (ops::silu(&g).unwrap() * &g).unwrap();
    assert!(max_diff(&y, &want) < 1e-5);
    // Mismatched layers are refused with an error, not a panic.
    let lin = |r: usize, c: usize| nn::Linear::new(det(&[r, c], 2), None);
    let x = det(&[3, 4], 1);
    let e = nn::swiglu_linear(&x, &lin(6, 4), &lin(5, 4))
        .unwrap_err()
        .to_string();
    assert!(e.contains("one shape"), "{e}");
    assert!(nn::swiglu_linear(&x, &lin(6, 3), &lin(6, 3)).is_err());
    let empty = nn::swiglu_linear(&det(&[0, 4], 1), &lin(6, 4), &lin(6, 4)).unwrap();
    assert_eq!(empty.dims(), [0, 6]);
}

/// The fused ops hand a variable's gradient to `nn::backward`'s frame instead of Candle's
/// store: the same gradients as a plain `loss.backward()`, for a weight used once, a weight used
/// by a fused op and a composed one (added), a weight used twice by fused ops, and frozen
/// (detached) weights, which get none; and a second backward pass over the same graph.
#[test]
fn nn_backward_gives_the_gradients_of_a_plain_backward_pass() {
    let x = Var::from_tensor(&det(&[2, 5, 8], 1)).unwrap();
    let [wa, wb, wc, wd] =
        [2, 3, 4, 5].map(|s| Var::from_tensor(&(det(&[8, 8], s) * 0.2).unwrap()).unwrap());
    let frozen = (det(&[8, 8], 6) * 0.2).unwrap();
    let loss = || {
        let lin = |w: &Tensor| nn::Linear::new(w.clone(), None);
        let h = lin(wa.as_tensor()).forward(x.as_tensor()).unwrap();
        let h = nn::swiglu_linear(&h, &lin(wb.as_tensor()), &lin(wb.as_tensor())).unwrap();
        let h = lin(&frozen).forward(&h).unwrap();
        let h = nn::swiglu_linear(&h, &lin(wc.as_tensor()), &lin(&frozen)).unwrap();
        // `wa` again, composed: Candle's store holds a gradient the frame's is added to.
        let h = (h.broadcast_matmul(&wa.as_tensor().t().unwrap()).unwrap()
            + lin(wd.as_tensor()).forward(&h).unwrap())
        .unwrap();
        h.sqr().unwrap().sum_all().unwrap()
    };
    let l = loss();
    let plain = l.backward().unwrap();
    let ours = nn::backward(&l).unwrap();
    let again = nn::backward(&l).unwrap();
    for (name, v) in [
        ("x", &x),
        ("wa", &wa),
        ("wb", &wb),
        ("wc", &wc),
        ("wd", &wd),
    ] {
        let p = plain.get(v.as_tensor()).expect("plain gradient");
        for (run, grads) in [("first", &ours), ("second", &again)] {
            let o = grads
                .get(v.as_tensor())
                .unwrap_or_else(|| panic!("{name}: none ({run})"));
            let diff = max_diff(p, o);
            assert!(
                diff < 1e-4 * (1.0 + max_diff(p, &p.zeros_like().unwrap())),
                "{name} ({run}): {diff}"
            );
        }
    }
    assert!(ours.get(&frozen).is_none());
}
