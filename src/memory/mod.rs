//! Memory planning: what training a model takes on each rank, from the description of its
//! architecture ([`Architecture`]: sizes, activations per token, parameters) and the headers of
//! its safetensors files (never the weights). The numbers behind `accelerate-rs
//! estimate-memory`. This module knows no architecture: `accelerate-rs-models` describes its
//! own from a `config.json` (`accelerate_rs_models::model_spec`), as Accelerate's estimate asks
//! `transformers`.
//!
//! Per rank, for a [`Plan`] (precision, ZeRO stage and world size, optimizer, LoRA, batch and
//! sequence length, activation checkpointing), [`estimate`] counts:
//!
//! | part | bytes per parameter, or what |
//! |---|---|
//! | parameters | 4 (f32), or 2 for the bf16/fp16 working copies of mixed precision; LoRA: the frozen base in the compute dtype plus the adapters |
//! | gradients (trainable parameters) | 4; mixed precision: 2 (the half-precision gradients of the backward pass) + 4 (their f32 copy, averaged and stepped); ZeRO stage 2 keeps 1/N of the f32 ones |
//! | optimizer state (trainable) | AdamW 8 (two f32 moments), SGD with momentum 4, plain SGD 0; ZeRO stage 1 and 2 keep 1/N |
//! | f32 masters (trainable, mixed precision) | 4 |
//! | activations | what the backward pass keeps, per block and token, as accelerate-rs's `nn` layers keep it (see [`Architecture`] and below), plus the output layer; with activation checkpointing only each block's input, plus one block recomputed at a time |
//! | backward working set | at the backward pass's start the head's input gradient (with the fused output layer and loss, `nn::linear_cross_entropy`; three logits-sized f32 tensors with a composed head, `Plan::fused_head` false), at its end a few tensors of one block's size (and with checkpointing the block being recomputed), whichever is larger beyond the gradients |
//!
//! ZeRO is counted as accelerate-rs implements it: stage 1 shards the optimizer state, stage 2
//! also the averaged gradients; parameters and f32 masters stay whole on every rank. Stage 3
//! shards the parameters too (as f32 masters under mixed precision: no whole working copy),
//! holds what lies outside the blocks (embeddings, final norm, head) gathered for the step and
//! about two blocks at a time, keeps 1/N of the f32 gradients plus one unit's gradients in
//! flight, and recomputes every block (its activations are the checkpointed ones); with
//! [`Plan::offload_optimizer`] the shards' optimizer state, masters and f32 gradients are host
//! memory ([`Estimate::offloaded`]). What is not counted is listed in [`NOT_COUNTED`].
//!
//! Activations per block and token are the architecture's
//! ([`Architecture::block_elements`], in elements of the compute dtype, as `nn`'s layers keep
//! them), plus the attention weights (heads × sequence length, kept in f32 by `nn`'s fused
//! attention; Candle's composed attention on a GPU keeps the scores and their softmax, about as
//! many bytes in bf16). A language model's output layer keeps the logits (vocabulary × tokens in
//! the compute dtype, plus an f32 copy for the loss under mixed precision); an encoder's task
//! head is not counted.
//!
//! ```
//! use accelerate_rs::memory::{estimate, Architecture, ModelSpec, Plan, TensorInfo};
//! use accelerate_rs::MixedPrecision;
//! # fn main() -> accelerate_rs::Result<()> {
//! // A one-layer MLP "architecture", described by hand.
//! let tensor = |name: &str, shape: Vec<usize>| TensorInfo {
//!     name: name.into(),
//!     shape,
//!     dtype: "F32".into(),
//! };
//! let model = ModelSpec::from_architecture(Architecture {
//!     name: "mlp".into(),
//!     hidden: 1024, intermediate: 4096, layers: 1, heads: 1, kv_heads: 1, head_dim: 1024,
//!     vocab: 1000, max_positions: 512,
//!     block_elements: 3 * 1024 + 2 * 4096, outer_elements: 1024, lm_head: true,
//!     default_lora_targets: vec!["up".into()],
//!     parameters: vec![tensor("up.weight", vec![4096, 1024]), tensor("down.weight", vec![1024, 4096])],
//! });
//! assert_eq!(model.parameter_count(), 2 * 4096 * 1024);
//! let plan = Plan { precision: MixedPrecision::Bf16, ..Plan::default() };
//! let e = estimate(&model, &plan)?;
//! // 2 (bf16 weights) + 6 (gradients) + 8 (AdamW) + 4 (f32 masters) bytes per parameter.
//! assert_eq!(e.states(), 20 * 2 * 4096 * 1024);
//! # Ok(()) }
//! ```

mod model;

pub use model::{read_safetensors_header, Architecture, ModelSpec, TensorInfo, TensorSource};

use crate::error::{Error, Result};
use crate::settings::MixedPrecision;

/// What the estimate does not count, in the words the command line prints.
pub const NOT_COUNTED: &[&str] = &[
    "the allocator's overhead and fragmentation (glibc's arenas, CUDA's caching, freed memory not yet returned)",
    "the CUDA context and libraries (about 0.3-1 GiB per GPU: kernels, cuBLAS and NCCL workspaces and buffers)",
    "temporary buffers inside ops beyond the backward working set (matrix-product workspaces, casts, reductions)",
    "the gradient buckets of several processes (on the CPU, one more copy of the gradients; on GPUs a bucket at a time)",
    "the data loader's batches and prefetching, the tokenizer, checkpoint writing (a copy of what is saved)",
    "the process itself: the program, its threads' stacks, Candle's kernels",
];

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
    /// ([`Architecture::default_lora_targets`]).
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
    /// rank's shards live in host memory ([`Estimate::offloaded`]), the device keeping the
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

/// The memory of one rank, in bytes (see [the module](self)).
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
    /// With [`Plan::offload_optimizer`]: bytes kept in host memory instead of the device (not
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

/// Bytes per element of the compute dtype.
fn compute_bytes(p: MixedPrecision) -> u128 {
    match p {
        MixedPrecision::No => 4,
        MixedPrecision::Bf16 | MixedPrecision::Fp16 => 2,
    }
}

/// The module name of a weight (`model.layers.0.self_attn.q_proj` of
/// `model.layers.0.self_attn.q_proj.weight`), for a 2-D float weight only.
fn linear_module(t: &TensorInfo) -> Option<&str> {
    if t.shape.len() != 2 || !t.is_float() {
        return None;
    }
    t.name.strip_suffix(".weight")
}

/// Whether `module` is a LoRA target: `all-linear` takes every Linear layer but the embeddings
/// and the output layer (as `peft`); a name matches the module's last components.
fn is_target(module: &str, targets: &[String]) -> bool {
    targets.iter().any(|t| {
        if t == "all-linear" {
            let last = module.rsplit('.').next().unwrap_or(module);
            !(module.contains("embed")
                || matches!(last, "wte" | "wpe" | "lm_head" | "word_embeddings")
                || module.ends_with("embeddings"))
        } else {
            module == t || module.ends_with(&format!(".{t}"))
        }
    })
}

/// Checks a plan on its own.
fn check_plan(plan: &Plan) -> Result<()> {
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

/// The Linear layers `lora` adapts: the ones it names, else the architecture's defaults.
fn lora_targets(model: &ModelSpec, lora: &Lora) -> Result<Vec<String>> {
    if !lora.targets.is_empty() {
        return Ok(lora.targets.clone());
    }
    let arch = model.architecture.as_ref().ok_or_else(|| {
        Error::invalid(
            "lora targets",
            "the architecture is unknown (no config.json read): name the target modules",
        )
    })?;
    if arch.default_lora_targets.is_empty() {
        return Err(Error::invalid(
            "lora targets",
            format!(
                "`{}` has no default LoRA targets (peft has none for it): name the target modules",
                arch.name
            ),
        ));
    }
    Ok(arch.default_lora_targets.clone())
}

/// The memory of one rank training `model` as `plan` says (see [the module](self)).
pub fn estimate(model: &ModelSpec, plan: &Plan) -> Result<Estimate> {
    check_plan(plan)?;
    let e = compute_bytes(plan.precision);
    let mixed = plan.precision != MixedPrecision::No;
    let n = plan.world_size as u128;
    let params: u128 = model
        .tensors
        .iter()
        .filter(|t| t.is_float())
        .map(|t| t.elem_count() as u128)
        .sum();
    if params == 0 {
        return Err(Error::invalid(
            "model",
            "it has no floating-point tensors to train",
        ));
    }
    // (trainable, frozen, adapter layers, adapter elements per token and block).
    let (trainable, frozen, lora_layers, adapter_tokens) = match &plan.lora {
        None => (params, 0, 0, 0),
        Some(lora) => {
            let targets = lora_targets(model, lora)?;
            let r = lora.r as u128;
            let (mut adapters, mut layers, mut per_token) = (0u128, 0usize, 0u128);
            for t in &model.tensors {
                if let Some(m) = linear_module(t) {
                    if is_target(m, &targets) {
                        let (a, b) = (t.shape[0] as u128, t.shape[1] as u128);
                        adapters += r * (a + b);
                        layers += 1;
                        // In f32 the base and the update are one fused op (`nn::LoraLinear`,
                        // `Lora::forward_with_base`): its output is the only tensor kept, as for
                        // a plain Linear. With a half-precision base the adapters (f32) are
                        // composed: x·A (r), then B (the output) scaled and added, r + 2·out per
                        // token. The output width is the larger dimension for GPT-2's `c_attn`.
                        if plan.precision != MixedPrecision::No {
                            per_token += r + 2 * a.max(b);
                        }
                    }
                }
            }
            if layers == 0 {
                let some: Vec<&str> = model
                    .tensors
                    .iter()
                    .filter_map(linear_module)
                    .filter_map(|m| m.rsplit('.').next())
                    .fold(Vec::new(), |mut v, m| {
                        if !v.contains(&m) {
                            v.push(m);
                        }
                        v
                    });
                return Err(Error::invalid(
                    "lora targets",
                    format!(
                        "{targets:?} match no Linear layer of the model; its Linear layers are named {}",
                        some.join(", ")
                    ),
                ));
            }
            let per_block = model
                .architecture
                .as_ref()
                .map_or(0, |a| per_token / a.layers as u128);
            (adapters, params, layers, per_block)
        }
    };
    if plan.zero_stage == 3 {
        return stage3(
            model,
            plan,
            (trainable, frozen, lora_layers, adapter_tokens),
        );
    }
    // Trainable parameters live in f32 (masters under mixed precision, with half working
    // copies); a frozen base lives in the compute dtype.
    let parameters = frozen * e + trainable * if mixed { 2 } else { 4 };
    let masters = if mixed { trainable * 4 } else { 0 };
    let f32_grads = trainable * 4;
    let f32_grads = if plan.zero_stage >= 2 {
        f32_grads.div_ceil(n)
    } else {
        f32_grads
    };
    let gradients = f32_grads + if mixed { trainable * 2 } else { 0 };
    let state = trainable * plan.optimizer.state_bytes() as u128;
    let optimizer_state = if plan.zero_stage >= 1 {
        state.div_ceil(n)
    } else {
        state
    };
    let activations = model
        .architecture
        .as_ref()
        .map(|a| activations(a, plan, adapter_tokens, gradients))
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
        offloaded: 0,
    };
    // The totals must fit too.
    let states = [
        estimate.parameters,
        estimate.gradients,
        estimate.optimizer_state,
        estimate.masters,
    ]
    .iter()
    .map(|&b| b as u128)
    .sum::<u128>();
    let acts = estimate
        .activations
        .map_or(0, |a| a.kept as u128 + a.backward as u128);
    fit(states + acts, "the whole step")?;
    Ok(estimate)
}

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

/// ZeRO stage 3 (see [the module](self)): every rank keeps 1/N of the parameters (as f32
/// masters under mixed precision), of their gradients and of the optimizer state; it holds the
/// units outside the blocks (embeddings, final norm, head) gathered for the whole step, and
/// about two blocks at a time (the block gathered for its forward or its recomputation, and
/// the copy its gather goes through); every block is recomputed in the backward pass.
/// [`estimate`] with a 4-bit base (QLoRA: `load_in_4bit`, bitsandbytes' NF4/FP4 with blocks of
/// `blocksize`): the Linear layers of the frozen base (every one but the embeddings and the
/// output layer, as `all-linear` takes them) held in half a byte a weight plus their scales
/// (with `double_quant`, one byte a block, an f32 a 256 blocks and the 1 KiB 8-bit map per layer;
/// without, an f32 a block) instead of the compute dtype, plus the largest such layer
/// dequantized in the compute dtype (the working copy its forward and backward products use);
/// the embeddings, norms, biases and head stay in the compute dtype. Needs [`Plan::lora`] (a
/// 4-bit base is frozen) and a ZeRO stage below 3 (a 4-bit base is not sharded).
pub fn estimate_4bit(
    model: &ModelSpec,
    plan: &Plan,
    blocksize: usize,
    double_quant: bool,
) -> Result<Estimate> {
    if plan.lora.is_none() {
        return Err(Error::invalid(
            "load in 4 bits",
            "a 4-bit base is frozen: train LoRA adapters over it (a LoRA rank)",
        ));
    }
    if plan.zero_stage == 3 {
        return Err(Error::invalid(
            "load in 4 bits",
            "a 4-bit base is not sharded (ZeRO stage 3): use stage 0-2",
        ));
    }
    if blocksize == 0 {
        return Err(Error::invalid("4-bit block size", "must be at least 1"));
    }
    let mut est = estimate(model, plan)?;
    let e = compute_bytes(plan.precision);
    let all = ["all-linear".to_string()];
    let (mut dense, mut packed, mut largest) = (0u128, 0u128, 0u128);
    for t in &model.tensors {
        if linear_module(t).is_some_and(|m| is_target(m, &all)) {
            let n = t.elem_count() as u128;
            let blocks = n.div_ceil(blocksize as u128);
            let scales = if double_quant {
                blocks + blocks.div_ceil(256) * 4 + 256 * 4
            } else {
                blocks * 4
            };
            dense += n * e;
            packed += n.div_ceil(2) + scales;
            largest = largest.max(n * e);
        }
    }
    let parameters = est.parameters as u128 - dense.min(est.parameters as u128) + packed + largest;
    est.parameters = fit(parameters, "the parameters")?;
    Ok(est)
}

/// `lora`: (trainable, frozen, adapter layers, adapter elements per token and block).
fn stage3(model: &ModelSpec, plan: &Plan, lora: (u128, u128, usize, u128)) -> Result<Estimate> {
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
/// The activations of `plan`'s step; `gradients`: the gradient bytes of the whole model (the
/// backward pass's peak is either at its start, with the logits' gradient and no parameter
/// gradient yet, or at its end, with every parameter gradient).
fn activations(
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

/// `bytes` as a `u64`, or an error saying the estimate of `what` is over 2^64 bytes (the sizes
/// given are not a real model's or plan's). Every quantity is computed in 128 bits from inputs
/// of at most 2^26 (sizes, batch, sequence, rank) and 4,096 layers, so nothing wraps on the way.
fn fit(bytes: u128, what: &str) -> Result<u64> {
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A Llama of hidden 64, MLP 176, 2 layers, 4 heads (`kv` key/value heads), vocabulary 100,
    /// untied, described as `accelerate-rs-models` describes Llama.
    fn llama(kv: usize) -> ModelSpec {
        let (h, i, v, d) = (64usize, 176usize, 100usize, 16usize);
        let mut parameters = Vec::new();
        let mut add = |name: String, shape: Vec<usize>| {
            parameters.push(TensorInfo {
                name,
                shape,
                dtype: "F32".into(),
            })
        };
        add("model.embed_tokens.weight".into(), vec![v, h]);
        for l in 0..2 {
            let p = format!("model.layers.{l}");
            add(format!("{p}.input_layernorm.weight"), vec![h]);
            add(format!("{p}.self_attn.q_proj.weight"), vec![h, h]);
            add(format!("{p}.self_attn.k_proj.weight"), vec![kv * d, h]);
            add(format!("{p}.self_attn.v_proj.weight"), vec![kv * d, h]);
            add(format!("{p}.self_attn.o_proj.weight"), vec![h, h]);
            add(format!("{p}.post_attention_layernorm.weight"), vec![h]);
            add(format!("{p}.mlp.gate_proj.weight"), vec![i, h]);
            add(format!("{p}.mlp.up_proj.weight"), vec![i, h]);
            add(format!("{p}.mlp.down_proj.weight"), vec![h, i]);
        }
        add("model.norm.weight".into(), vec![h]);
        add("lm_head.weight".into(), vec![v, h]);
        let gqa = if kv < 4 { 2 * h } else { 0 };
        ModelSpec::from_architecture(Architecture {
            name: "llama".into(),
            hidden: h,
            intermediate: i,
            layers: 2,
            heads: 4,
            kv_heads: kv,
            head_dim: d,
            vocab: v,
            max_positions: 2048,
            block_elements: (6 * h + 5 * h + 4 * kv * d + 3 * i + gqa) as u64,
            outer_elements: 2 * h as u64,
            lm_head: true,
            default_lora_targets: vec!["q_proj".into(), "v_proj".into()],
            parameters,
        })
    }

    #[test]
    fn states_follow_precision_zero_and_optimizer() {
        let m = llama(4);
        let p = m.parameter_count();
        // embed + 2 x (2 norms + 4 attention + 3 MLP) + norm + head.
        let want = 100 * 64 + 2 * (2 * 64 + 4 * 64 * 64 + 3 * 64 * 176) + 64 + 100 * 64;
        assert_eq!(p, want);
        let e = |plan: Plan| estimate(&m, &plan).unwrap();
        let f32 = e(Plan::default());
        assert_eq!(
            (
                f32.parameters,
                f32.gradients,
                f32.optimizer_state,
                f32.masters
            ),
            (4 * p, 4 * p, 8 * p, 0)
        );
        let bf16 = e(Plan {
            precision: MixedPrecision::Bf16,
            ..Plan::default()
        });
        assert_eq!(
            (
                bf16.parameters,
                bf16.gradients,
                bf16.optimizer_state,
                bf16.masters
            ),
            (2 * p, 6 * p, 8 * p, 4 * p)
        );
        let z1 = e(Plan {
            zero_stage: 1,
            world_size: 4,
            ..Plan::default()
        });
        assert_eq!(
            (z1.gradients, z1.optimizer_state),
            (4 * p, (8 * p).div_ceil(4))
        );
        let z2 = e(Plan {
            zero_stage: 2,
            world_size: 4,
            precision: MixedPrecision::Fp16,
            ..Plan::default()
        });
        assert_eq!(z2.gradients, (4 * p).div_ceil(4) + 2 * p);
        let sgd = e(Plan {
            optimizer: OptimizerKind::Sgd,
            ..Plan::default()
        });
        assert_eq!(sgd.optimizer_state, 0);
    }

    #[test]
    fn lora_trains_adapters_on_the_targets_only() {
        let m = llama(4);
        let p = m.parameter_count();
        let plan = Plan {
            precision: MixedPrecision::Bf16,
            lora: Some(Lora {
                r: 8,
                targets: vec![],
            }),
            ..Plan::default()
        };
        let e = estimate(&m, &plan).unwrap();
        // q_proj and v_proj in 2 layers: 8 x (64 + 64) each.
        let adapters = 4 * 8 * 128;
        assert_eq!(
            (e.trainable_params, e.frozen_params, e.lora_layers),
            (adapters, p, 4)
        );
        assert_eq!(e.parameters, 2 * p + 2 * adapters);
        assert_eq!(
            (e.gradients, e.optimizer_state, e.masters),
            (6 * adapters, 8 * adapters, 4 * adapters)
        );
        let all = Plan {
            lora: Some(Lora {
                r: 8,
                targets: vec!["all-linear".into()],
            }),
            ..plan.clone()
        };
        assert_eq!(estimate(&m, &all).unwrap().lora_layers, 2 * 7);
        let none = Plan {
            lora: Some(Lora {
                r: 8,
                targets: vec!["c_attn".into()],
            }),
            ..plan
        };
        let err = estimate(&m, &none).unwrap_err().to_string();
        assert!(err.contains("c_attn") && err.contains("q_proj"), "{err}");
    }

    #[test]
    fn activations_grow_with_the_batch_and_shrink_with_checkpointing() {
        let m = llama(2);
        let a = |batch, ckpt| {
            estimate(
                &m,
                &Plan {
                    batch_size: batch,
                    seq_len: 32,
                    checkpointing: ckpt,
                    ..Plan::default()
                },
            )
            .unwrap()
            .activations
            .unwrap()
        };
        let (one, two) = (a(1, false), a(2, false));
        assert_eq!(two.kept, 2 * one.kept);
        // Per token and block: 6h + 5q + 4kv + 3i + 2q (grouped-query), f32; 4 heads x 32 keys.
        let block = (6 * 64 + 5 * 64 + 4 * 32 + 3 * 176 + 2 * 64) * 4 + 4 * 32 * 4;
        assert_eq!(one.kept, 32 * (2 * block + 2 * 64 * 4 + 100 * 4));
        let ck = a(1, true);
        assert!(
            ck.kept < one.kept / 2 && ck.backward > one.backward,
            "{ck:?} {one:?}"
        );
    }

    #[test]
    fn bad_plans_are_refused() {
        let m = llama(4);
        for plan in [
            Plan {
                zero_stage: 4,
                ..Plan::default()
            },
            Plan {
                zero_stage: 2,
                offload_optimizer: true,
                ..Plan::default()
            },
            Plan {
                world_size: 0,
                ..Plan::default()
            },
            Plan {
                batch_size: 0,
                ..Plan::default()
            },
            Plan {
                lora: Some(Lora {
                    r: 0,
                    targets: vec![],
                }),
                ..Plan::default()
            },
        ] {
            assert!(estimate(&m, &plan).is_err(), "{plan:?}");
        }
    }

    #[test]
    fn stage_3_shards_parameters_masters_and_gradients() {
        let m = llama(4);
        let p = m.parameter_count();
        // Two blocks of 2 x 64 + 4 x 64 x 64 + 3 x 64 x 176; the rest (embeddings, norm, head)
        // held for the step.
        let block = 2 * 64 + 4 * 64 * 64 + 3 * 64 * 176;
        let held = p - 2 * block;
        let plan = Plan {
            precision: MixedPrecision::Bf16,
            zero_stage: 3,
            world_size: 4,
            ..Plan::default()
        };
        let e = estimate(&m, &plan).unwrap();
        assert_eq!(e.masters, (4 * p).div_ceil(4));
        assert_eq!(e.optimizer_state, (8 * p).div_ceil(4));
        assert_eq!(e.parameters, (held + 2 * block) * 2);
        assert_eq!(e.gradients, 4 * p / 4 + held.max(block) * 6);
        // Every block recomputed: the checkpointed activations, asked for or not.
        let ckpt = estimate(
            &m,
            &Plan {
                checkpointing: true,
                ..plan.clone()
            },
        )
        .unwrap();
        assert_eq!(e.activations, ckpt.activations);
        // Offload: moments, masters and f32 shard gradients on the host.
        let o = estimate(
            &m,
            &Plan {
                offload_optimizer: true,
                ..plan
            },
        )
        .unwrap();
        assert_eq!(o.offloaded, e.masters + e.optimizer_state + 4 * p / 4);
        assert_eq!((o.optimizer_state, o.masters), (0, 0));
        assert!(o.total() < e.total());
    }
}
