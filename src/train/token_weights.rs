//! Token-weighted losses: the gradient of an optimizer step as the mean over every target token
//! of the step — all its micro-batches, on all ranks — as if one process had run the whole
//! batch. This is the recipe Hugging Face Accelerate documents for causal language models
//! (`num_items_in_batch`): averaging per micro-batch means and then over ranks weighs a token of
//! a short micro-batch more than one of a long micro-batch, so the result depends on how the
//! tokens were split.
//!
//! The user hands each micro-step a [`TokenLoss`] — the micro-batch's loss *summed* over its
//! target tokens, and their number — through
//! [`Accelerator::backward_tokens`](crate::Accelerator::backward_tokens) or
//! [`AcceleratedOptimizer::backward_step_tokens`](crate::AcceleratedOptimizer::backward_step_tokens).
//! The gradient engine adds up the sums' gradients and the counts over the micro-steps of a cycle
//! without communicating; at the sync step one all-reduce of the count (a single number) gives
//! the step's global token count `C`, and the summed gradients, averaged across the `W` ranks as
//! usual, are multiplied by `W / C`: the step's gradient is `Σ ∇(token losses) / C`.

use candle_core::Tensor;

use crate::collective::{Collective, ReduceOp};
use crate::error::{Error, Result};
use crate::nn::{cross_entropy_with, CrossEntropyOptions};

/// A micro-batch's loss summed over its target tokens, and how many target tokens it had: what
/// [`Accelerator::backward_tokens`](crate::Accelerator::backward_tokens) and
/// [`AcceleratedOptimizer::backward_step_tokens`](crate::AcceleratedOptimizer::backward_step_tokens)
/// take to make a step's gradient the mean over all its target tokens — every micro-batch of
/// the step on every rank — as if one process had run the whole batch (Hugging Face
/// Accelerate's recipe for causal language models). Averaging per-micro-batch means instead
/// weighs a token of a short micro-batch more than one of a long micro-batch.
///
/// The engine adds up the sums' gradients and the counts over a cycle's micro-steps without
/// communicating; at the sync step one all-reduce of the count gives the step's token count
/// `C`, and the gradients, averaged over the `W` ranks as usual, are multiplied by `W / C`.
///
/// ```
/// # fn main() -> accelerate_rs::Result<()> {
/// use accelerate_rs::TokenLoss;
/// use candle_core::{Device, Tensor};
/// let logits = Tensor::new(&[[2f32, 0.0], [0.0, 1.0], [1.0, 1.0]], &Device::Cpu)?;
/// // The last token is padding (label -100): two target tokens.
/// let labels = Tensor::new(&[0i64, 1, -100], &Device::Cpu)?;
/// let loss = TokenLoss::cross_entropy(&logits, &labels, Some(-100))?;
/// assert_eq!(loss.tokens(), 2);
/// let mean = loss.mean()?.to_scalar::<f32>()?;
/// assert!((loss.sum().to_scalar::<f32>()? - 2.0 * mean).abs() < 1e-6);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct TokenLoss {
    sum: Tensor,
    tokens: u64,
}

impl TokenLoss {
    /// A loss `sum` (a scalar tensor, or one element) over `tokens` target tokens. A micro-batch
    /// with no target token passes a zero sum and 0.
    pub fn new(sum: Tensor, tokens: u64) -> Result<TokenLoss> {
        if sum.elem_count() != 1 {
            return Err(Error::invalid(
                "TokenLoss",
                format!(
                    "the loss sum must be a scalar, got a tensor of shape {:?}",
                    sum.dims()
                ),
            ));
        }
        let sum = if sum.rank() == 0 {
            sum
        } else {
            sum.flatten_all()?.squeeze(0)?
        };
        Ok(TokenLoss { sum, tokens })
    }

    /// The cross-entropy of `logits` (`[..., C]`) against `targets` summed over the targets that
    /// are not `ignore_index` (a language model's padding and prompt tokens, `-100` in
    /// `transformers`), with their count: [`nn::cross_entropy_with`](crate::nn::cross_entropy_with)'s
    /// mean times the count (a zero sum, still part of the graph, when every target is ignored).
    pub fn cross_entropy(
        logits: &Tensor,
        targets: &Tensor,
        ignore_index: Option<i64>,
    ) -> Result<TokenLoss> {
        let flat = targets.flatten_all()?.to_dtype(candle_core::DType::I64)?;
        let tokens = match ignore_index {
            Some(ignored) => flat
                .to_vec1::<i64>()?
                .iter()
                .filter(|&&t| t != ignored)
                .count(),
            None => flat.elem_count(),
        } as u64;
        if tokens == 0 {
            // Zero, with a (zero) gradient for the logits' producers: multiplied by a zero
            // tensor, not the number 0, which Candle's backward pass prunes from the graph (the
            // blocks behind the logits would then not run their backward pass on this rank
            // only, and at ZeRO stage 3 every rank must recompute and reduce the same units).
            let zero = Tensor::zeros((), logits.dtype(), logits.device())?;
            let sum = logits.sum_all()?.mul(&zero)?;
            return TokenLoss::new(sum, 0);
        }
        let options = CrossEntropyOptions {
            ignore_index,
            ..Default::default()
        };
        let mean = cross_entropy_with(logits, targets, options)?;
        TokenLoss::new((mean * tokens as f64)?, tokens)
    }

    /// The loss summed over the micro-batch's target tokens.
    pub fn sum(&self) -> &Tensor {
        &self.sum
    }

    /// The number of target tokens.
    pub fn tokens(&self) -> u64 {
        self.tokens
    }

    /// The micro-batch's mean loss over its tokens (what a loop logs; NaN without tokens).
    pub fn mean(&self) -> Result<Tensor> {
        Ok((&self.sum / self.tokens as f64)?)
    }
}

/// Whether the micro-steps of the current accumulation cycle are token-weighted, and their
/// token count so far (owned by the gradient engine's accumulation state).
#[derive(Debug, Default)]
pub(crate) struct TokenTally {
    /// `None`: no micro-step yet, or mean losses; `Some`: the tokens of token-weighted ones.
    tokens: Option<u64>,
}

impl TokenTally {
    /// Records a micro-step with `tokens` (`None`: a mean loss) after `micro` micro-steps of the
    /// cycle. One cycle takes one kind only: mixing them is an error naming the rank.
    pub(crate) fn add(&mut self, tokens: Option<u64>, micro: usize, rank: usize) -> Result<()> {
        match (self.tokens, tokens) {
            (Some(sum), Some(t)) => self.tokens = Some(sum.saturating_add(t)),
            (None, Some(t)) if micro == 0 => self.tokens = Some(t),
            (None, None) => {}
            (had, _) => {
                let (now, before) = match had {
                    Some(_) => ("a mean loss (`backward`)", "token-weighted"),
                    None => ("a token-weighted loss (`backward_tokens`)", "mean losses"),
                };
                return Err(Error::invalid(
                    "backward_tokens",
                    format!(
                        "rank {rank}: micro-step {} of this accumulation cycle passed {now} after \
                         {micro} micro-step(s) with {before}; one optimizer step's micro-steps \
                         must all use one kind",
                        micro + 1
                    ),
                ));
            }
        }
        Ok(())
    }

    /// The cycle's token count (`None` for mean losses), starting a new cycle.
    pub(crate) fn take(&mut self) -> Option<u64> {
        self.tokens.take()
    }
}

/// The factor that turns gradients of loss sums, about to be averaged over the ranks, into the
/// mean over every token of the step: `W / C` for `W` ranks and `C` tokens on all of them (one
/// all-reduce of this rank's `tokens` unless `alone`). A step without any token gives 0 (its
/// gradients, those of empty sums, are zeros anyway).
pub(crate) fn global_factor(c: &dyn Collective, tokens: u64, alone: bool) -> Result<f64> {
    let total = if alone {
        tokens as f64
    } else {
        // f64 counts tokens exactly up to 2^53.
        let mut count = [tokens as f64];
        c.all_reduce((&mut count[..]).into(), ReduceOp::Sum)?;
        count[0]
    };
    Ok(if total > 0.0 {
        c.world_size() as f64 / total
    } else {
        0.0
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn a_cycle_takes_one_kind_of_loss() {
        let mut t = TokenTally::default();
        t.add(Some(3), 0, 0).unwrap();
        t.add(Some(4), 1, 0).unwrap();
        let err = t.add(None, 2, 1).unwrap_err().to_string();
        assert!(
            err.contains("rank 1: micro-step 3") && err.contains("a mean loss"),
            "{err}"
        );
        assert_eq!(t.take(), Some(7));
        assert_eq!(t.take(), None);
        t.add(None, 0, 0).unwrap();
        let err = t.add(Some(2), 1, 0).unwrap_err().to_string();
        assert!(
            err.contains("after 1 micro-step(s) with mean losses"),
            "{err}"
        );
    }

    #[test]
    fn cross_entropy_sums_over_the_counted_targets() {
        let dev = Device::Cpu;
        let logits =
            Tensor::new(&[[1f32, 2.0, 0.5], [0.0, 0.0, 3.0], [2.0, 1.0, 1.0]], &dev).unwrap();
        let labels = Tensor::new(&[2i64, -100, 0], &dev).unwrap();
        let l = TokenLoss::cross_entropy(&logits, &labels, Some(-100)).unwrap();
        assert_eq!(l.tokens(), 2);
        let lse = |r: [f32; 3]| r.iter().map(|v| v.exp()).sum::<f32>().ln();
        let want = (lse([1.0, 2.0, 0.5]) - 0.5) + (lse([2.0, 1.0, 1.0]) - 2.0);
        let got = l.sum().to_scalar::<f32>().unwrap();
        assert!((got - want).abs() < 1e-5, "{got} vs {want}");
        // Every target ignored: zero, with zero gradients.
        let none = Tensor::new(&[-100i64, -100, -100], &dev).unwrap();
        let l = TokenLoss::cross_entropy(&logits, &none, Some(-100)).unwrap();
        assert_eq!((l.tokens(), l.sum().to_scalar::<f32>().unwrap()), (0, 0.0));
        assert!(
            TokenLoss::new(Tensor::zeros(2, candle_core::DType::F32, &dev).unwrap(), 1)
                .unwrap_err()
                .to_string()
                .contains("shape [2]")
        );
    }

    #[test]
    fn the_factor_is_ranks_over_tokens() {
        let c = crate::collective::SingleProcess;
        assert_eq!(global_factor(&c, 8, true).unwrap(), 1.0 / 8.0);
        assert_eq!(global_factor(&c, 0, true).unwrap(), 0.0);
    }
}
