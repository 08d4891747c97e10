//! ZeRO stage 3 in the estimate: the shards, the units held gathered, the blocks in flight.

use super::activations::activations;
use super::estimate::{fit, Estimate};
use super::model::ModelSpec;
use super::plan::{compute_bytes, Plan};
use crate::error::Result;
use crate::settings::MixedPrecision;

/// The block a tensor belongs to (`model.layers.3.…`, `transformer.h.3.…`,
/// `encoder.layer.3.…`): the ZeRO-3 unit of `accelerate-rs-models`' wrap policies.
fn block_of(name: &str) -> Option<usize> {
    let mut parts = name.split('.').peekable();
    while let Some(p) = parts.next() {
        if matches!(p, "layers" | "h" | "layer" | "blocks") {
            if let Some(i) = parts.peek().and_then(|n| n.parse().ok()) {
                return Some(i);
            }
        }
    }
    None
}

/// ZeRO stage 3 (see [the module](crate::memory)): every rank keeps 1/N of the parameters (as f32
/// masters under mixed precision), of their gradients and of the optimizer state; it holds the
/// units outside the blocks (embeddings, final norm, head) gathered for the whole step, and
/// about two blocks at a time (the block gathered for its forward or its recomputation, and
/// the copy its gather goes through); every block is recomputed in the backward pass.
/// `lora`: (trainable, frozen, adapter layers, adapter elements per token and block).
pub(super) fn stage3(
    model: &ModelSpec,
    plan: &Plan,
    lora: (u128, u128, usize, u128),
) -> Result<Estimate> {
    let (trainable, frozen, lora_layers, adapter_tokens) = lora;
    let e = compute_bytes(plan.precision);
    let n = plan.world_size as u128;
    let (all, block, held) = unit_sizes(model);
    // Gathered in the compute dtype: the held units, and two blocks' worth.
    let gathered = (held + 2 * block.min(all)) * e;
    let lora_on = plan.lora.is_some();
    // The sharded parameters: the base (LoRA, frozen) or every trainable one, in f32.
    let sharded = if lora_on { frozen * e } else { trainable * 4 };
    let shard = sharded.div_ceil(n);
    let state = trainable * plan.optimizer.state_bytes() as u128;
    let (mut parameters, mut gradients, mut optimizer_state, mut masters, mut offloaded);
    if lora_on {
        // The adapters are replicated: whole on every rank, as at stage 0.
        parameters = shard + gathered + trainable * 4;
        gradients = trainable * 4;
        optimizer_state = state;
        masters = 0;
        offloaded = 0;
    } else {
        let mixed = plan.precision != MixedPrecision::No;
        // The shard's f32 gradients, a block's gradients (compute dtype) and its f32 reduce
        // buffer, or at the end the held units' gradients in the same two forms.
        let transient = held.max(block) * (e + 4);
        gradients = trainable * 4 / n.max(1) + transient;
        optimizer_state = state.div_ceil(n);
        (parameters, masters) = if mixed {
            (gathered, shard)
        } else {
            (shard + gathered, 0)
        };
        offloaded = 0;
        if plan.offload_optimizer {
            // Host: masters, moments, f32 shard gradients; device: the shard in the compute
            // dtype for the gathers.
            offloaded = shard + optimizer_state + trainable * 4 / n.max(1);
            parameters = (trainable * e).div_ceil(n) + gathered;
            gradients = transient;
            optimizer_state = 0;
            masters = 0;
        }
    }
    let ckpt = Plan {
        checkpointing: true,
        ..plan.clone()
    };
    let activations = model
        .architecture
        .as_ref()
        .map(|a| activations(a, &ckpt, adapter_tokens, gradients))
        .transpose()?;
    let estimate = Estimate {
        trainable_params: fit(trainable, "the trainable parameters")?,
        frozen_params: fit(frozen, "the frozen parameters")?,
        lora_layers,
        parameters: fit(parameters, "the parameters")?,
        gradients: fit(gradients, "the gradients")?,
        optimizer_state: fit(optimizer_state, "the optimizer state")?,
        masters: fit(masters, "the f32 masters")?,
        activations,
        offloaded: fit(offloaded, "the offloaded state")?,
    };
    fit(
        estimate.states() as u128
            + estimate
                .activations
                .map_or(0, |a| a.kept as u128 + a.backward as u128),
        "the whole step",
    )?;
    Ok(estimate)
}

/// A model's float elements in all, in its largest block, and outside the blocks (the units
/// stage 3 holds gathered for the whole step).
fn unit_sizes(model: &ModelSpec) -> (u128, u128, u128) {
    let mut blocks: std::collections::BTreeMap<usize, u128> = Default::default();
    let mut all = 0u128;
    for t in model.tensors.iter().filter(|t| t.is_float()) {
        all += t.elem_count() as u128;
        if let Some(b) = block_of(&t.name) {
            *blocks.entry(b).or_default() += t.elem_count() as u128;
        }
    }
    let block = blocks.values().copied().max().unwrap_or(all);
    (all, block, all - blocks.values().sum::<u128>())
}
