//! Dropout whose masks come from a per-thread stream that [`checkpoint`](super::checkpoint)
//! replays: a checkpointed block that drops activations draws the same masks when its backward
//! pass recomputes it (PyTorch's `preserve_rng_state`), so dropout and activation checkpointing
//! go together.

use std::cell::RefCell;
use std::sync::Arc;

use candle_core::{CpuStorage, CustomOp1, Device, Layout, Result, Shape, Tensor};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;

use crate::par::Inline;

use super::elem::{fused_cpu, slice, Elem};

/// Elements per Rayon task (a multiple of 64: whole mask words).
const CHUNK: usize = 64 * 256;

thread_local! {
    /// This thread's dropout stream.
    static STREAM: RefCell<ChaCha8Rng> = RefCell::new(ChaCha8Rng::seed_from_u64(rand::random()));
}

/// Inverted dropout (PyTorch's `nn.Dropout` in training mode, `candle_nn::ops::dropout`'s
/// signature): each element is zeroed with probability `p` and the others are scaled by
/// `1 / (1 - p)`; differentiable (the gradient goes through the same mask). `p = 0` returns `x`.
///
/// The masks are drawn on the CPU from this thread's stream (seeded by [`set_dropout_seed`], or
/// [`Accelerator::set_seed`](crate::Accelerator::set_seed)), and kept as one bit per element.
/// Inside a [`checkpoint`](super::checkpoint)ed block the recomputation draws the same masks
/// as the first pass, so the gradients are those of the forward pass that ran. On the CPU it is
/// one fused op; elsewhere the mask is copied to the device and multiplied in.
///
/// ```
/// # fn main() -> candle_core::Result<()> {
/// use accelerate_rs::nn::{dropout, set_dropout_seed};
/// use candle_core::{Device, Tensor};
/// let x = Tensor::ones((4, 1000), candle_core::DType::F32, &Device::Cpu)?;
/// set_dropout_seed(7);
/// let a = dropout(&x, 0.25)?;
/// set_dropout_seed(7);
/// let b = dropout(&x, 0.25)?;
/// assert_eq!(a.to_vec2::<f32>()?, b.to_vec2::<f32>()?); // the same stream, the same mask
/// let kept = a.ne(0f32)?.to_dtype(candle_core::DType::F32)?.mean_all()?.to_scalar::<f32>()?;
/// assert!((kept - 0.75).abs() < 0.03);
/// # Ok(()) }
/// ```
pub fn dropout(x: &Tensor, p: f32) -> Result<Tensor> {
    if !(0.0..1.0).contains(&p) {
        candle_core::bail!(
            "accelerate_rs::nn::dropout: the probability must be in [0, 1), got {p}"
        );
    }
    if p == 0.0 {
        return Ok(x.clone());
    }
    if !x.dtype().is_float() {
        candle_core::bail!(
            "accelerate_rs::nn::dropout: a float tensor is expected, got {:?}",
            x.dtype()
        );
    }
    let n = x.elem_count();
    let keep = STREAM.with(|s| draw_mask(&mut s.borrow_mut(), n, p));
    let op = DropoutOp {
        keep: Arc::new(keep),
        scale: 1.0 / (1.0 - p as f64),
    };
    if fused_cpu(x) {
        return x.contiguous()?.apply_op1(op);
    }
    // Elsewhere: the mask as a tensor of the input's dtype, on its device.
    let mask = op.mask_values(n);
    let mask = Tensor::from_vec(mask, x.shape(), &Device::Cpu)?
        .to_dtype(x.dtype())?
        .to_device(x.device())?;
    x.mul(&mask)
}

/// Seeds this thread's dropout stream: the masks [`dropout`] draws next are then the same on
/// every run (and on every rank seeded alike).
pub fn set_dropout_seed(seed: u64) {
    STREAM.with(|s| *s.borrow_mut() = ChaCha8Rng::seed_from_u64(seed));
}

/// This thread's dropout stream as it is now (for [`checkpoint`](super::checkpoint) to replay).
pub(super) fn stream_state() -> ChaCha8Rng {
    STREAM.with(|s| s.borrow().clone())
}

/// Replaces this thread's dropout stream; returns the one it had.
pub(super) fn replace_stream(state: ChaCha8Rng) -> ChaCha8Rng {
    STREAM.with(|s| std::mem::replace(&mut *s.borrow_mut(), state))
}

/// `n` keep flags, one bit each (bit `i % 64` of word `i / 64`): kept with probability `1 - p`.
fn draw_mask(rng: &mut ChaCha8Rng, n: usize, p: f32) -> Vec<u64> {
    // An element is dropped when a uniform 32-bit draw falls below `p · 2³²`.
    let threshold = (p as f64 * 4_294_967_296.0) as u64;
    let mut words = vec![0u64; n.div_ceil(64)];
    for (w, word) in words.iter_mut().enumerate() {
        let len = (n - w * 64).min(64);
        let mut bits = 0u64;
        for b in 0..len {
            if (rng.random::<u32>() as u64) >= threshold {
                bits |= 1 << b;
            }
        }
        *word = bits;
    }
    words
}

/// Multiplies by a fixed mask: `x · scale` where the bit is set, 0 elsewhere. Its own backward
/// is itself (on the output gradient).
#[derive(Clone)]
struct DropoutOp {
    keep: Arc<Vec<u64>>,
    scale: f64,
}

impl DropoutOp {
    fn kept(&self, i: usize) -> bool {
        self.keep
            .get(i / 64)
            .is_some_and(|w| (w >> (i % 64)) & 1 == 1)
    }

    /// The mask as values: `scale` or 0 (f32).
    fn mask_values(&self, n: usize) -> Vec<f32> {
        (0..n)
            .map(|i| if self.kept(i) { self.scale as f32 } else { 0.0 })
            .collect()
    }

    fn apply<T: Copy + Send + Sync>(
        &self,
        x: &[T],
        zero: T,
        mul: impl Fn(T) -> T + Sync,
    ) -> Vec<T> {
        let mut out = vec![zero; x.len()];
        out.par_chunks_mut(CHUNK)
            .inline_when_single()
            .zip(x.par_chunks(CHUNK).inline_when_single())
            .enumerate()
            .for_each(|(c, (o, xs))| {
                let base = c * CHUNK;
                for (j, (o, v)) in o.iter_mut().zip(xs).enumerate() {
                    if self.kept(base + j) {
                        *o = mul(*v);
                    }
                }
            });
        out
    }

    fn apply_elem<T: Elem>(&self, x: &[T]) -> Vec<T> {
        let s = self.scale as f32;
        self.apply(x, T::of(0.0), |v| T::of(v.f() * s))
    }
}

impl CustomOp1 for DropoutOp {
    fn name(&self) -> &'static str {
        "accelerate-rs-dropout"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        if self.keep.len() * 64 < l.shape().elem_count() {
            candle_core::bail!("{}: the mask is shorter than the input", self.name());
        }
        let out = match s {
            CpuStorage::F32(x) => CpuStorage::F32(self.apply_elem(slice(x, l)?)),
            CpuStorage::F64(x) => {
                let s = self.scale;
                CpuStorage::F64(self.apply(slice(x, l)?, 0.0, |v| v * s))
            }
            CpuStorage::BF16(x) => CpuStorage::BF16(self.apply_elem(slice(x, l)?)),
            CpuStorage::F16(x) => CpuStorage::F16(self.apply_elem(slice(x, l)?)),
            _ => candle_core::bail!("{}: a float dtype is expected", self.name()),
        };
        Ok((out, l.shape().clone()))
    }

    fn bwd(&self, _x: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let grad = grad.contiguous()?;
        if fused_cpu(&grad) {
            return Ok(Some(grad.apply_op1_no_bwd(self)?));
        }
        let mask = Tensor::from_vec(
            self.mask_values(grad.elem_count()),
            grad.shape(),
            &Device::Cpu,
        )?
        .to_dtype(grad.dtype())?
        .to_device(grad.device())?;
        Ok(Some(grad.mul(&mask)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::DType;

    #[test]
    fn masks_replay_from_a_saved_stream_and_gradients_use_them() {
        set_dropout_seed(3);
        let x = candle_core::Var::from_tensor(
            &Tensor::arange(1f32, 301.0, &Device::Cpu)
                .unwrap()
                .reshape((3, 100))
                .unwrap(),
        )
        .unwrap();
        let saved = stream_state();
        let a = dropout(&x, 0.5).unwrap();
        let after = replace_stream(saved);
        let b = dropout(&x, 0.5).unwrap();
        replace_stream(after);
        assert_eq!(a.to_vec2::<f32>().unwrap(), b.to_vec2::<f32>().unwrap());
        // Kept elements are doubled; the gradient of the sum is the mask itself.
        let g = a.sum_all().unwrap().backward().unwrap();
        let g = g
            .get(&x)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let y = a.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        for (i, (g, y)) in g.iter().zip(&y).enumerate() {
            let want = if *y == 0.0 { 0.0 } else { 2.0 };
            assert_eq!(*g, want, "element {i}");
            assert!(*y == 0.0 || *y == 2.0 * (i + 1) as f32);
        }
        assert!(dropout(&x, 1.0).is_err() && dropout(&x, -0.1).is_err());
        assert_eq!(DType::F32, dropout(&x, 0.0).unwrap().dtype());
    }
}
