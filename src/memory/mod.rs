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
//! attention; on a GPU the one-node attention keeps the softmax in the compute dtype, half as
//! many bytes in bf16; Candle's composed attention, with a padding mask or the kernels off,
//! keeps the scores and their softmax, about as many). A language model's output layer keeps the
//! logits (vocabulary × tokens in the compute dtype, plus an f32 copy for the loss under mixed
//! precision); an encoder's task head is not counted.
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

mod activations;
mod adapters;
mod count;
mod estimate;
mod model;
mod plan;
mod stage3;

pub use count::{estimate, estimate_4bit};
pub use estimate::{Activations, Estimate, NOT_COUNTED};
pub use model::{read_safetensors_header, Architecture, ModelSpec, TensorInfo, TensorSource};
pub use plan::{Lora, OptimizerKind, Plan};
