//! Activation recomputation ("activation checkpointing"; not to be confused with the
//! training-state checkpoints of [`crate::checkpoint`]): a block's forward pass keeps only its
//! input; the backward pass runs
//! the block again and back-propagates through the recomputed graph (PyTorch's
//! `torch.utils.checkpoint`).
//!
//! How it fits Candle's graph: [`recompute`] runs the block on a detached copy of its input, so
//! the intermediate activations are freed as soon as the output is taken, and returns that
//! output through one custom op whose only input is the block's input. When Candle's backward
//! reaches the op, it runs the block again on a fresh variable holding the input, back-propagates
//! the op's output gradient through it, returns the input's gradient to Candle, and sets the
//! parameters' gradients aside on this thread. [`backward`] (which `Accelerator::backward` and
//! the optimizer wrappers call) adds them to the store `loss.backward()` returned. A plain
//! `loss.backward()` would miss them: the next [`recompute`] call then fails naming this.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use candle_core::backend::BackendStorage;
use candle_core::backprop::GradStore;
use candle_core::{CpuStorage, CudaStorage, CustomOp1, Layout, Module, Result, Shape, Storage};
use candle_core::{Tensor, TensorId, Var};
use rand_chacha::ChaCha8Rng;

/// A block's forward function, as [`recompute_fn`] takes it.
type Block = dyn Fn(&Tensor) -> Result<Tensor> + Send + Sync;

/// What [`recompute_then`] runs right after a recomputed block's backward pass, inside Candle's
/// backward: it gets the gradients of the variables the recomputation used and takes those it
/// owns out of the store (ZeRO-3 reduce-scatters a unit's gradients there); the others go where
/// [`recompute_fn`] sends them.
pub(crate) type AfterBackward = dyn Fn(&mut GradStore) -> Result<()> + Send + Sync;

thread_local! {
    /// Parameter gradients of the checkpointed blocks back-propagated on this thread, waiting for
    /// [`backward`] (id -> (parameter, gradient)).
    static PENDING: RefCell<HashMap<TensorId, (Tensor, Tensor)>> = RefCell::new(HashMap::new());
    /// How many [`backward`] calls are running on this thread.
    static DEPTH: Cell<usize> = const { Cell::new(0) };
}

/// Runs `module` on `x` with activation checkpointing: the same output and the same gradients
/// as `module.forward(x)`, but only `x` is kept for the backward pass, which runs `module`
/// again. Use it on each block of a deep model to trade about one more forward pass for the
/// memory of the blocks' activations.
///
/// The module is cloned into the graph (Candle modules are cheap to clone: their tensors are
/// shared). Its forward must be deterministic, except for [`dropout`](super::dropout): the
/// recomputation replays this thread's dropout stream from where the first pass started, so it
/// draws the same masks (other random draws, such as `candle_nn::ops::dropout`'s, would differ).
/// Compute the gradients with `accelerator.backward(&loss)`, an
/// optimizer wrapper's `backward_step`, or [`backward`]: a plain `loss.backward()` does not see
/// the parameters inside checkpointed blocks.
///
/// ```
/// use accelerate_rs::nn::{self, linear};
/// use candle_core::{DType, Device, Module, Tensor};
/// use candle_nn::{VarBuilder, VarMap};
///
/// # fn main() -> candle_core::Result<()> {
/// let varmap = VarMap::new();
/// let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
/// let block = linear(8, 8, vb.pp("block"))?;
/// let x = Tensor::randn(0f32, 1.0, (4, 8), &Device::Cpu)?;
/// let y = nn::recompute(&block, &x)?;
/// let grads = nn::backward(&y.sqr()?.sum_all()?)?;
/// assert!(grads.get(block.weight()).is_some());
/// # Ok(()) }
/// ```
pub fn recompute<M>(module: &M, x: &Tensor) -> Result<Tensor>
where
    M: Module + Clone + Send + Sync + 'static,
{
    let m = module.clone();
    recompute_fn(move |x: &Tensor| m.forward(x), x)
}

/// [`recompute`] for a closure: `recompute_fn(move |x| block.forward(x, &mask), &x)` (move
/// in clones of what it needs: it is kept in the graph until the backward pass).
pub fn recompute_fn<F>(f: F, x: &Tensor) -> Result<Tensor>
where
    F: Fn(&Tensor) -> Result<Tensor> + Send + Sync + 'static,
{
    checkpointed(Arc::new(f), None, x, false)
}

/// [`recompute_fn`] with `after` run on the recomputed block's parameter gradients as soon as
/// its backward pass is done (see [`AfterBackward`]). With `record`, the node is kept even when
/// the first pass tracked nothing (a block whose first pass reads its parameters as constants
/// and whose recomputation reads them as variables).
pub(crate) fn recompute_then(
    f: Arc<Block>,
    after: Arc<AfterBackward>,
    x: &Tensor,
    record: bool,
) -> Result<Tensor> {
    checkpointed(f, Some(after), x, record)
}

fn checkpointed(
    f: Arc<Block>,
    after: Option<Arc<AfterBackward>>,
    x: &Tensor,
    record: bool,
) -> Result<Tensor> {
    // Reported once, then forgotten: the gradients are lost either way.
    let uncollected = if DEPTH.with(Cell::get) == 0 {
        PENDING.with(|p| std::mem::take(&mut *p.borrow_mut()).len())
    } else {
        0
    };
    if uncollected > 0 {
        candle_core::bail!(
            "accelerate_rs::nn::recompute: the gradients of {uncollected} parameter(s) inside checkpointed blocks were never collected: compute gradients with `accelerator.backward(&loss)`, an optimizer wrapper's `backward_step`, or `accelerate_rs::nn::backward(&loss)` instead of `loss.backward()`"
        );
    }
    let rng = super::dropout::stream_state();
    let y = f(&x.detach())?;
    if !y.track_op() && !record && !x.track_op() {
        // Neither the block's parameters nor its input need a gradient: nothing to keep. (An
        // input that needs one is passed on through the node even by a block without
        // parameters: a frozen layer between trainable ones.)
        return Ok(y);
    }
    let y = y.detach();
    // The op must be recorded even when `x` itself needs no gradient (the block's parameters
    // do): then it hangs off a variable holding `x`, which nobody reads.
    let input = if x.track_op() {
        x.clone()
    } else {
        Var::from_tensor(x)?.as_tensor().clone()
    };
    let op = Checkpointed {
        f,
        after,
        output: Mutex::new(Some(y)),
        rng,
    };
    input.apply_op1_arc(Arc::new(Box::new(op)))
}

/// `loss.backward()`, plus the gradients of the parameters inside [`recompute`]ed blocks. The
/// one backward pass accelerate-rs runs; call it instead of `loss.backward()` when not going
/// through an [`Accelerator`](crate::Accelerator) or optimizer wrapper. The fused ops hand it
/// their variable weights' gradients directly (a plain `loss.backward()` gets the same values
/// through Candle's store, each added into a zero-filled tensor first).
pub fn backward(loss: &Tensor) -> Result<GradStore> {
    if DEPTH.with(Cell::get) > 0 {
        // Inside a checkpointed block's recomputation: its parameters' gradients stay pending
        // for the outermost call.
        return super::grad_frames::backward_collected(loss);
    }
    check_memory_limit(loss)?;
    PENDING.with(|p| p.borrow_mut().clear());
    DEPTH.with(|d| d.set(1));
    let result = super::grad_frames::backward_collected(loss);
    DEPTH.with(|d| d.set(0));
    let pending = PENDING.with(|p| std::mem::take(&mut *p.borrow_mut()));
    let mut grads = result?;
    for (id, (param, g)) in pending {
        match grads.get_id(id) {
            Some(other) => {
                let sum = (other + &g)?;
                grads.insert(&param, sum);
            }
            None => {
                grads.insert(&param, g);
            }
        }
    }
    detach_all(&mut grads);
    Ok(grads)
}

/// Replaces every gradient that records the ops it was computed with by a detached tensor on
/// the same storage. Candle's backward pass computes a parameter's gradient from tracked tensors
/// (`zeros + dW`, `dW = gᵀ·x`), so the gradient it hands out keeps those operands alive (a
/// zero-filled and a partial copy of the parameter's size, and the gradient of the layer's
/// output) for as long as the gradients are held, through the optimizer step: about two more
/// copies of the gradients. Detached, only the gradients themselves stay.
fn detach_all(grads: &mut GradStore) {
    let ids: Vec<TensorId> = grads.get_ids().copied().collect();
    for id in ids {
        if let Some(g) = grads.get_id(id).filter(|g| g.track_op()) {
            let plain = g.detach();
            grads.insert_id(id, plain);
        }
    }
}

/// The simulated memory limit of tests ([`env::TEST_MEMORY_LIMIT`](crate::env::TEST_MEMORY_LIMIT)):
/// an [`Error::OutOfMemory`](crate::Error::OutOfMemory) (typed through Candle's `Result`) when
/// the tensors the loss's graph holds exceed it. Nothing to do when the variable is unset.
fn check_memory_limit(loss: &Tensor) -> Result<()> {
    let Some(limit) = crate::settings::memory::injected_memory_limit()? else {
        return Ok(());
    };
    let nodes = loss.sorted_nodes();
    let held: u64 = nodes
        .iter()
        .filter(|t| !t.is_variable())
        .map(|t| (t.elem_count() * t.dtype().size_in_bytes()) as u64)
        .sum();
    if held <= limit {
        return Ok(());
    }
    Err(crate::error::Error::OutOfMemory {
        rank: None,
        device: crate::error::device_label(loss.device()),
        requested: Some(held),
        limit: Some(limit),
        detail: format!(
            "the backward pass of a graph of {} tensors holding {held} bytes of activations would exceed the simulated limit {}",
            nodes.len(),
            crate::settings::env::TEST_MEMORY_LIMIT
        ),
    }
    .into())
}

/// The checkpoint node: forward hands out the output computed in [`recompute_fn`]; backward
/// recomputes the block.
struct Checkpointed {
    f: Arc<Block>,
    /// Run on the parameter gradients right after the recomputed backward pass.
    after: Option<Arc<AfterBackward>>,
    /// The block's output until the forward pass takes it.
    output: Mutex<Option<Tensor>>,
    /// The dropout stream as the first pass found it, replayed by the recomputation.
    rng: ChaCha8Rng,
}

impl Checkpointed {
    /// The block's output as new storage of the device's kind.
    fn take<S>(&self, pick: impl Fn(&Storage) -> Option<&S>) -> Result<(S, Shape)>
    where
        S: BackendStorage,
    {
        let y = self
            .output
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
            .ok_or_else(|| {
                candle_core::Error::Msg(
                    "accelerate_rs::nn::recompute: the op's forward ran twice".into(),
                )
            })?;
        let y = if y.is_contiguous() && y.layout().start_offset() == 0 {
            y
        } else {
            y.force_contiguous()?
        };
        let (storage, layout) = y.storage_and_layout();
        let s = pick(&storage).ok_or_else(|| {
            candle_core::Error::Msg(
                "accelerate_rs::nn::recompute: the block's output is on another device than its input"
                    .into(),
            )
        })?;
        Ok((s.try_clone(layout)?, layout.shape().clone()))
    }
}

impl CustomOp1 for Checkpointed {
    fn name(&self) -> &'static str {
        "accelerate-rs-checkpoint"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        self.take(|s| match s {
            Storage::Cpu(s) => Some(s),
            _ => None,
        })
    }

    fn cuda_fwd(&self, _: &CudaStorage, _: &Layout) -> Result<(CudaStorage, Shape)> {
        self.take(|s| match s {
            Storage::Cuda(s) => Some(s),
            _ => None,
        })
    }

    fn bwd(&self, x: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let input = Var::from_tensor(&x.detach())?;
        // The first pass's dropout masks again; the thread's stream is left where it was.
        let current = super::dropout::replace_stream(self.rng.clone());
        let y = (self.f)(input.as_tensor());
        super::dropout::replace_stream(current);
        let y = y?;
        if y.shape() != grad.shape() {
            candle_core::bail!(
                "accelerate_rs::nn::recompute: the recomputed block gives shape {:?}, the first pass gave {:?} (the block must be deterministic)",
                y.shape(),
                grad.shape()
            );
        }
        // `sum(y * grad)` back-propagates exactly `grad` into `y` (`1 * g` and `0 + g` are exact),
        // as the first pass's graph would have.
        let seeded = (&y * grad.detach())?.sum_all()?;
        let mut grads = super::grad_frames::backward_collected(&seeded)?;
        // Detached: a gradient computed with tracked ops keeps the recomputed block (its
        // activations and their gradients) alive for as long as it is held, which would undo
        // the checkpointing for every block until the backward pass ends.
        let dx = grads.remove(input.as_tensor()).map(|g| g.detach());
        if let Some(after) = &self.after {
            after(&mut grads)?;
        }
        let params: HashMap<TensorId, Tensor> = y
            .sorted_nodes()
            .into_iter()
            .filter(|t| t.is_variable() && t.id() != input.as_tensor().id())
            .map(|t| (t.id(), t.clone()))
            .collect();
        PENDING.with(|p| -> Result<()> {
            let mut p = p.borrow_mut();
            for (id, param) in params {
                let Some(g) = grads.remove(&param).map(|g| g.detach()) else {
                    continue;
                };
                match p.get_mut(&id) {
                    Some((_, sum)) => *sum = (&*sum + &g)?,
                    None => {
                        p.insert(id, (param, g));
                    }
                }
            }
            Ok(())
        })?;
        Ok(dx)
    }
}
