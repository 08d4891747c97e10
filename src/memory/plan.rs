//! What to estimate for: the [`Plan`] (precision, ZeRO stage, world size, optimizer, LoRA,
//! batch, checkpointing) and its checks, and the bytes of the compute dtype.

use crate::error::{Error, Result};
use crate::settings::MixedPrecision;

/// The optimizer whose state is counted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OptimizerKind {
    /// AdamW: two f32 moments per trainable parameter.
    AdamW,
    /// SGD with momentum: one f32 buffer per trainable parameter.
    SgdMomentum,
    /// Plain SGD: no state.
    Sgd,
}

impl OptimizerKind {
    /// Bytes of state per trainable parameter.
    pub fn state_bytes(self) -> u64 {
        match self {
            OptimizerKind::AdamW => 8,
            OptimizerKind::SgdMomentum => 4,
            OptimizerKind::Sgd => 0,
        }
    }

    /// Its name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            OptimizerKind::AdamW => "adamw",
            OptimizerKind::SgdMomentum => "sgd-momentum",
            OptimizerKind::Sgd => "sgd",
        }
    }
}

/// LoRA adapters: rank `r` on the Linear layers named in `targets`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lora {
    /// The adapters' rank.
    pub r: usize,
    /// Module names (the part of a weight's name before `.weight`, matched at its end, as
    /// `peft`'s `target_modules`), or `all-linear`; empty: the architecture's defaults
    /// ([`Architecture::default_lora_targets`](super::Architecture::default_lora_targets)).
    pub targets: Vec<String>,
}

/// What to estimate for.
#[derive(Clone, Debug, PartialEq)]
pub struct Plan {
    /// The precision: f32, or bf16/fp16 mixed precision (f32 masters, half working copies).
    pub precision: MixedPrecision,
    /// ZeRO stage (0 to 3).
    pub zero_stage: usize,
    /// Ranks the ZeRO stage shards over.
    pub world_size: usize,
    /// The optimizer.
    pub optimizer: OptimizerKind,
    /// LoRA adapters instead of full fine-tuning.
    pub lora: Option<Lora>,
    /// Sequences per rank per step.
    pub batch_size: usize,
    /// Tokens per sequence.
    pub seq_len: usize,
    /// Whether every block is checkpointed (`nn::checkpoint`).
    pub checkpointing: bool,
    /// Whether the output layer and the loss are one fused op (`nn::linear_cross_entropy`, as
    /// the `loss` of `accelerate-rs-models`' causal LMs): the kept logits then become their
    /// gradient in place. When false (a `Linear`, then `nn::cross_entropy` on its logits) the
    /// backward pass starts with three logits-sized f32 tensors (the loss's gradient, and the
    /// zero-filled tensor and sum Candle's backward makes of it).
    pub fused_head: bool,
    /// ZeRO-3 offload: the optimizer state, the f32 masters and the f32 gradients of the
    /// rank's shards live in host memory ([`Estimate::offloaded`](super::Estimate::offloaded)), the device keeping the
    /// shards in the compute dtype for the gathers.
    pub offload_optimizer: bool,
}

impl Default for Plan {
    /// f32, no ZeRO, one rank, AdamW, full fine-tuning, batch 1 of 512 tokens, no
    /// checkpointing, the fused output layer and loss.
    fn default() -> Self {
        Plan {
            precision: MixedPrecision::No,
            zero_stage: 0,
            world_size: 1,
            optimizer: OptimizerKind::AdamW,
            lora: None,
            batch_size: 1,
            seq_len: 512,
            checkpointing: false,
            fused_head: true,
            offload_optimizer: false,
        }
    }
}

/// Bytes per element of the compute dtype.
pub(super) fn compute_bytes(p: MixedPrecision) -> u128 {
    match p {
        MixedPrecision::No => 4,
        MixedPrecision::Bf16 | MixedPrecision::Fp16 => 2,
    }
}

/// Checks a plan on its own.
pub(super) fn check_plan(plan: &Plan) -> Result<()> {
    let bad = |name: &str, reason: String| Err(Error::invalid(name, reason));
    if plan.zero_stage > 3 {
        return bad(
            "zero_stage",
            format!("must be 0, 1, 2 or 3, got {}", plan.zero_stage),
        );
    }
    if plan.offload_optimizer && plan.zero_stage != 3 {
        return bad(
            "offload_optimizer",
            format!(
                "offloads the shards' optimizer state and masters of ZeRO stage 3, got stage {}",
                plan.zero_stage
            ),
        );
    }
    if plan.world_size == 0 || plan.world_size > crate::settings::limits::MAX_WORLD_SIZE {
        return bad(
            "world_size",
            format!(
                "must be from 1 to {}, got {}",
                crate::settings::limits::MAX_WORLD_SIZE,
                plan.world_size
            ),
        );
    }
    if plan.batch_size == 0 || plan.seq_len == 0 {
        return bad(
            "batch",
            format!(
                "batch size and sequence length must be at least 1, got {} x {}",
                plan.batch_size, plan.seq_len
            ),
        );
    }
    let max = crate::settings::limits::MAX_MODEL_SIZE;
    if plan.batch_size > max || plan.seq_len > max {
        return bad(
            "batch",
            format!(
                "batch size and sequence length must be at most {max}, got {} x {}",
                plan.batch_size, plan.seq_len
            ),
        );
    }
    if let Some(l) = &plan.lora {
        if l.r == 0 || l.r > max {
            return bad("lora rank", format!("must be from 1 to {max}, got {}", l.r));
        }
    }
    Ok(())
}
