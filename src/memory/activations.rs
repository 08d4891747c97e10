//! The activations of a training step: what the forward pass keeps and the backward pass's peak.

use super::estimate::{fit, Activations};
use super::model::Architecture;
use super::plan::{compute_bytes, Plan};
use crate::error::Result;

/// The activations of `plan`'s step; `gradients`: the gradient bytes of the whole model (the
/// backward pass's peak is either at its start, with the logits' gradient and no parameter
/// gradient yet, or at its end, with every parameter gradient).
pub(super) fn activations(
    a: &Architecture,
    plan: &Plan,
    adapter_per_block: u128,
    gradients: u128,
) -> Result<Activations> {
    let e = compute_bytes(plan.precision);
    let tokens = (plan.batch_size * plan.seq_len) as u128;
    let (h, i, v) = (a.hidden as u128, a.intermediate as u128, a.vocab as u128);
    let layers = a.layers as u128;
    // Attention weights: heads x keys per query, f32.
    let attention = (a.heads * plan.seq_len) as u128 * 4;
    let block = tokens * ((a.block_elements as u128 + adapter_per_block) * e + attention);
    let outer = tokens * a.outer_elements as u128 * e;
    // The logits (and an f32 copy for the loss under mixed precision); an encoder's task head
    // is not counted.
    let head = a.lm_head;
    let logits = if head {
        tokens * v * (e + if e < 4 { 4 } else { 0 })
    } else {
        0
    };
    let kept = if plan.checkpointing {
        // Each checkpointed block keeps its output (the next block's input).
        outer + logits + layers * tokens * h * e
    } else {
        outer + logits + layers * block
    };
    // Start of the backward pass: fused, the head's input gradient (the logits' gradient takes
    // their place); composed, the logits' f32 gradient, with the zero-filled tensor and the sum
    // Candle's backward makes of it.
    let start = match (head, plan.fused_head) {
        (false, _) => 0,
        (true, true) => tokens * h * e,
        (true, false) => 3 * tokens * v * 4,
    };
    // End: the gradients of the residual stream and of the widest branch, each being read
    // while the next is written; with checkpointing, the first block recomputed.
    let end = tokens * 2 * (h + i.max(h)) * e + if plan.checkpointing { block } else { 0 };
    Ok(Activations {
        kept: fit(kept, "the kept activations")?,
        backward: fit(
            start.saturating_sub(gradients).max(end),
            "the backward pass",
        )?,
    })
}
