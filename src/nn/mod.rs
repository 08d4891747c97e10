//! Differentiable fused layers for Candle: [`LayerNorm`] / [`layer_norm`], [`RmsNorm`] /
//! [`rms_norm`], [`softmax_last_dim`], [`causal_softmax`] (attention's scale and
//! causal mask in the same pass), [`scaled_dot_product_attention`] and [`packed_self_attention`]
//! (the whole attention, causal or with a key padding mask, as one op), [`flash_attention`]
//! (attention whose memory grows linearly with the sequence: tiled, with sliding windows, GQA and
//! packed documents), [`cross_entropy`] (with label smoothing and an ignored
//! index through [`cross_entropy_with`]; [`linear_cross_entropy`] fuses it with the output layer),
//! [`embedding`] (its table's gradient scattered once), [`gelu`], [`relu`], [`silu`], [`swiglu`] (Llama's MLP gate, `silu(gate) * up`;
//! [`swiglu_linear`] fuses it with the gate and up projections), rotary
//! embeddings [`rope`] / [`rope_i`] / [`rope_thd`] and [`Linear`] / [`linear`] (its bias
//! gradient in one pass of row sums), each one pass forward and one pass backward over the data
//! (Rayon-parallel, f32 arithmetic for f32, bf16 and f16, f64 too).
//!
//! They are drop-in replacements with `candle_nn`'s signatures, so switching is an import
//! change, and unlike `candle_nn::LayerNorm` (its fused path), `candle_nn::RmsNorm`,
//! `candle_nn::ops::softmax_last_dim` and `candle_nn::rotary_emb::{rope, rope_i, rope_thd}`, they
//! have a backward pass: the parameters before them train (a model's query and key projections,
//! for RoPE). On other devices than the CPU they fall back to Candle's differentiable composed
//! ops. `docs/candle-transformers.md` in the repository lists which `candle-transformers` models
//! call the ops without a backward pass, and how to switch.
//!
//! [`recompute`] / [`recompute_fn`] add activation recomputation (checkpointing) to any block (its
//! activations are recomputed in the backward pass instead of kept); [`backward`] is the
//! backward pass that collects the checkpointed blocks' parameter gradients, and the weight
//! gradients the fused ops hand it directly (past Candle's zero-filled store). [`dropout`] draws
//! its masks from a per-thread stream that checkpointing replays, so checkpointed blocks may
//! drop activations.
//!
//! [`LoraLinear`] wraps a [`Linear`] with a LoRA adapter ([`Lora`], configured by
//! [`LoraConfig`] as PEFT's `LoraConfig`): the base frozen, the low-rank update trainable.
//! [`Linear4bit`] is a frozen linear layer over a 4-bit weight
//! ([`quant::Weight4bit`](crate::quant::Weight4bit), bitsandbytes' NF4/FP4): one op on the CPU
//! that dequantizes the weight a tile at a time, whose backward pass gives the input gradient;
//! [`Linear4bit::forward_with_lora`] puts a LoRA adapter on it (QLoRA).
//!
//! **CUDA kernels.** In a build with the `cuda` feature, LayerNorm and RMSNorm, the softmaxes (and
//! so the composed
//! attention's), cross-entropy (and `linear_cross_entropy`'s row pass after the product), GELU and
//! ReLU run as one CUDA kernel each way on GPU tensors in f32, bf16 and f16, compiled with NVRTC
//! at first use. They are on in such a build unless `ACCELERATE_RS_NN_CUDA=0` (or
//! [`set_cuda_kernels`]); if they cannot be compiled or loaded, one warning and the composed ops.
//! They are proven against the CPU path on a GPU by `examples/nn_kernels.rs` (step 8 of
//! `scripts/gpu-smoke.sh`: every op, f32/bf16/f16, forward and backward; passed on an H200, and
//! with SiLU, SwiGLU and RoPE (`rope`, `rope_i`, `rope_thd`) on an H100). [`flash_attention`]'s
//! kernels (forward and backward) passed there too but are slower than Candle's composed
//! attention at training sizes, so they run only with `ACCELERATE_RS_NN_CUDA_FLASH=1`.
//!
//! ```
//! use accelerate_rs::nn::{layer_norm, LayerNormConfig};
//! use candle_core::{DType, Device, Module, Tensor, Var};
//! use candle_nn::{VarBuilder, VarMap};
//!
//! # fn main() -> candle_core::Result<()> {
//! let varmap = VarMap::new();
//! let norm = layer_norm(8, LayerNormConfig::default(), VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu))?;
//! let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, (4, 8), &Device::Cpu)?)?;
//! let grads = norm.forward(&x)?.sqr()?.sum_all()?.backward()?;
//! assert!(grads.get(&x).is_some()); // the input gets its gradient
//! assert!(grads.get(norm.weight()).is_some()); // and so do the parameters
//! # Ok(()) }
//! ```

mod attention;
mod attention_node;
mod cross_entropy_options;
#[cfg(feature = "cuda")]
mod cuda;
mod dropout;
mod elem;
mod embedding;
mod flash;
mod flash_cpu;
#[cfg(feature = "cuda")]
mod flash_cuda;
mod gated;
mod gated_node;
mod gelu;
mod grad_frames;
mod head_loss;
mod head_loss_node;
mod kernels;
mod linear;
mod linear4bit;
mod lora;
mod lora_op;
mod loss;
mod mask;
mod norm;
mod product;
mod recompute;
mod relu;
mod rope;
mod rope_attention;
mod rope_geometry;
mod silu;
mod softmax;

pub use attention::{packed_self_attention, scaled_dot_product_attention, AttentionOptions};
pub use candle_nn::LayerNormConfig;
pub use cross_entropy_options::CrossEntropyOptions;
pub use dropout::{dropout, set_dropout_seed};
pub use embedding::embedding;
pub use flash::{flash_attention, flash_attention_fused, Documents, FlashAttentionOptions};
pub use gated::swiglu_linear;
pub use gelu::gelu;
pub use head_loss::linear_cross_entropy;
pub use kernels::{cuda_kernel_launches, set_cuda_kernels, CUDA_KERNELS_BUILT};
#[doc(hidden)]
pub use kernels::{device_nodes_on_cpu, set_device_nodes_on_cpu};
pub use linear::{linear, linear_no_bias, linear_relu, Linear};
pub use linear4bit::Linear4bit;
pub use lora::{Lora, LoraConfig, LoraLinear, TargetModules};
pub use loss::{cross_entropy, cross_entropy_with};
pub use norm::{layer_norm, rms_norm, LayerNorm, RmsNorm};
pub(crate) use recompute::recompute_then;
pub use recompute::{backward, recompute, recompute_fn};
/// The old names of [`recompute`] and [`recompute_fn`] (PyTorch's `torch.utils.checkpoint`),
/// kept so existing code compiles; "checkpoint" now names the training-state checkpoints
/// ([`crate::checkpoint`]).
#[deprecated(since = "0.2.0", note = "renamed `nn::recompute` / `nn::recompute_fn`")]
pub use recompute::{recompute as checkpoint, recompute_fn as checkpoint_fn};
pub use relu::relu;
pub use rope::{rope, rope_i, rope_thd};
pub use rope_attention::rope_attention;
pub use silu::{silu, swiglu};
pub use softmax::{causal_softmax, softmax_last_dim};
