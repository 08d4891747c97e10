//! Parameter gradients handed straight to the backward pass that asked for them, past Candle's
//! gradient store.
//!
//! Candle's backward pass adds every gradient an op returns into a zero-filled tensor of the
//! input's size (`zeros_like` then `add`), even for an input that gets one gradient only. For
//! a weight that is a full pass writing zeros and a second pass reading them back, per weight and
//! per step: about 6% of a small Llama's CPU step. The fused ops whose weight is a variable
//! ([`Linear`](super::Linear), [`linear_cross_entropy`](super::linear_cross_entropy)) instead
//! [`deposit`] its gradient in the innermost *frame*: one per backward pass of ours running on this
//! thread ([`backward`](super::backward), and each recomputed block's inside it). The pass
//! [`collect`]s its frame into the store Candle returned when Candle is done, adding where the
//! store also holds a gradient of the same variable (a weight used by two ops, such as tied
//! embeddings): `a + b` is what `0 + a + b` gives. A plain `loss.backward()` opens no frame, and
//! the ops then hand the gradient to Candle as before.

use std::cell::RefCell;
use std::collections::HashMap;

use candle_core::backprop::GradStore;
use candle_core::{Result, Tensor, TensorId};

/// The gradients deposited in one frame: id -> (variable, gradient).
type Frame = HashMap<TensorId, (Tensor, Tensor)>;

thread_local! {
    /// The open frames of this thread, innermost last.
    static FRAMES: RefCell<Vec<Frame>> = const { RefCell::new(Vec::new()) };
}

/// `grad` for the variable `param`: kept in the innermost open frame (added to what it holds
/// for `param`), and `None` returned; or, when `param` is not a variable or no frame is open,
/// handed back for Candle's store.
pub(super) fn deposit(param: &Tensor, grad: Tensor) -> Result<Option<Tensor>> {
    if !param.is_variable() {
        return Ok(Some(grad));
    }
    FRAMES.with(|f| {
        let mut frames = f.borrow_mut();
        let Some(frame) = frames.last_mut() else {
            return Ok(Some(grad));
        };
        let grad = grad.detach();
        match frame.get_mut(&param.id()) {
            Some((_, sum)) => *sum = (&*sum + &grad)?,
            None => {
                frame.insert(param.id(), (param.clone(), grad));
            }
        }
        Ok(None)
    })
}

/// `loss.backward()` inside a frame of its own: the gradients the fused ops deposited are added
/// to the store it returns. The frame is closed on every path out.
pub(super) fn backward_collected(loss: &Tensor) -> Result<GradStore> {
    FRAMES.with(|f| f.borrow_mut().push(Frame::new()));
    let result = loss.backward();
    let frame = FRAMES.with(|f| f.borrow_mut().pop()).unwrap_or_default();
    let mut grads = result?;
    collect(frame, &mut grads)?;
    Ok(grads)
}

/// Adds the gradients of `frame` to `grads`.
fn collect(frame: Frame, grads: &mut GradStore) -> Result<()> {
    for (id, (param, g)) in frame {
        let sum = match grads.get_id(id) {
            Some(other) => (other + &g)?,
            None => g,
        };
        grads.insert(&param, sum);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    #[test]
    fn a_deposit_outside_any_frame_or_for_a_constant_goes_back_to_candle() -> Result<()> {
        let dev = Device::Cpu;
        let v = Var::new(&[1f32, 2.0], &dev)?;
        let g = Tensor::new(&[3f32, 4.0], &dev)?;
        assert!(deposit(v.as_tensor(), g.clone())?.is_some());
        let c = Tensor::new(&[1f32, 2.0], &dev)?;
        FRAMES.with(|f| f.borrow_mut().push(Frame::new()));
        let back = deposit(&c, g.clone());
        let kept = deposit(v.as_tensor(), g.clone());
        let again = deposit(v.as_tensor(), g);
        let frame = FRAMES.with(|f| f.borrow_mut().pop()).unwrap_or_default();
        assert!(back?.is_some());
        assert!(kept?.is_none() && again?.is_none());
        let (_, sum) = &frame[&v.as_tensor().id()];
        assert_eq!(sum.to_vec1::<f32>()?, [6.0, 8.0]);
        Ok(())
    }
}
