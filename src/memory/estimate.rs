//! What an estimate says: the bytes of one rank ([`Estimate`], [`Activations`]), what it does not
//! count ([`NOT_COUNTED`]), and the check that a count fits in 64 bits.

use crate::error::{Error, Result};

/// What the estimate does not count, in the words the command line prints.
pub const NOT_COUNTED: &[&str] = &[
    "the allocator's overhead and fragmentation (glibc's arenas, CUDA's caching, freed memory not yet returned)",
    "the CUDA context and libraries (about 0.3-1 GiB per GPU: kernels, cuBLAS and NCCL workspaces and buffers)",
    "temporary buffers inside ops beyond the backward working set (matrix-product workspaces, casts, reductions)",
    "the gradient buckets of several processes (on the CPU, one more copy of the gradients; on GPUs a bucket at a time)",
    "the data loader's batches and prefetching, the tokenizer, checkpoint writing (a copy of what is saved)",
    "the process itself: the program, its threads' stacks, Candle's kernels",
];

/// The activations of a training step, in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Activations {
    /// What the forward pass keeps for the backward pass.
    pub kept: u64,
    /// What the backward pass holds at its peak besides the kept activations and the
    /// gradients: the logits' gradient at its start (less the parameter gradients, which do not
    /// exist yet then), or at its end one block's gradients in flight and, with checkpointing,
    /// the block being recomputed.
    pub backward: u64,
}

/// The memory of one rank, in bytes (see [the module](crate::memory)).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Estimate {
    /// Parameters that train (all of them, or the LoRA adapters).
    pub trainable_params: u64,
    /// Parameters that do not (the base under LoRA).
    pub frozen_params: u64,
    /// Linear layers with LoRA adapters.
    pub lora_layers: usize,
    /// The weights the model computes with.
    pub parameters: u64,
    /// The trainable parameters' gradients.
    pub gradients: u64,
    /// The optimizer's state.
    pub optimizer_state: u64,
    /// The f32 masters of mixed precision.
    pub masters: u64,
    /// The activations, when the architecture is known.
    pub activations: Option<Activations>,
    /// With [`Plan::offload_optimizer`](super::Plan::offload_optimizer): bytes kept in host memory instead of the device (not
    /// in [`total`](Self::total)).
    pub offloaded: u64,
}

impl Estimate {
    /// Parameters, gradients, optimizer state and masters: what does not depend on the batch.
    pub fn states(&self) -> u64 {
        self.parameters + self.gradients + self.optimizer_state + self.masters
    }

    /// Everything counted: the states and, when known, the activations.
    pub fn total(&self) -> u64 {
        self.states()
            + self
                .activations
                .map_or(0, |a| a.kept.saturating_add(a.backward))
    }
}

/// `bytes` as a `u64`, or an error saying the estimate of `what` is over 2^64 bytes (the sizes
/// given are not a real model's or plan's). Every quantity is computed in 128 bits from inputs
/// of at most 2^26 (sizes, batch, sequence, rank) and 4,096 layers, so nothing wraps on the way.
pub(super) fn fit(bytes: u128, what: &str) -> Result<u64> {
    u64::try_from(bytes).map_err(|_| {
        Error::invalid(
            "memory estimate",
            format!(
                "{what} would take about 2^{} bytes: the sizes given (config.json, batch, \
                 sequence length, LoRA rank) are not a real model's",
                128 - bytes.leading_zeros()
            ),
        )
    })
}
