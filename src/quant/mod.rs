//! 4-bit weights in the format of `bitsandbytes` (NF4 and FP4, QLoRA's double quantization), as
//! `transformers`' 4-bit model folders hold them: quantize a weight, read and write the six
//! tensors a quantized linear layer's weight is saved as, dequantize. The differentiable layer
//! over such a weight is [`nn::Linear4bit`](crate::nn::Linear4bit).
//!
//! **The format.** A weight of `n` elements (any shape, in bf16, f16 or f32) is cut, flat in
//! row-major order, into blocks of 64 (the block size); each block keeps its largest magnitude
//! (`absmax`) and each element the 4-bit code of the nearest value of a 16-value table (NF4's
//! normal quantiles, or FP4) after dividing by it. Two codes share a byte, the first element in
//! the high nibble: `ceil(n / 2)` bytes. With double quantization the block scales are
//! themselves quantized: their mean (the offset) is subtracted, and they are coded in 8 bits in
//! blocks of 256 with a dynamic map and one f32 absmax a block (QLoRA: 0.127 bits a parameter
//! for the scales instead of 0.5). A `transformers` folder stores, under a layer's prefix:
//!
//! | tensor | dtype, shape | holds |
//! |---|---|---|
//! | `weight` | u8 `[ceil(n/2), 1]` | the packed codes |
//! | `weight.absmax` | u8 `[blocks]` (f32 without double quantization) | the block scales |
//! | `weight.quant_map` | f32 `[16]` | the 4-bit table |
//! | `weight.nested_absmax` | f32 `[ceil(blocks/256)]` | the scales' block scales |
//! | `weight.nested_quant_map` | f32 `[256]` | the 8-bit dynamic map |
//! | `weight.quant_state.bitsandbytes__nf4` | u8 `[len]` | JSON: type, block size, dtype, shape, nested block size and dtype, offset |
//!
//! **Exactness.** [`Weight4bit::quantize`] gives the bytes `bitsandbytes.functional.quantize_4bit`
//! gives on the CPU for the same weight, and [`Weight4bit::dequantize`] the values of its
//! dequantization, bit for bit (`tests/fixtures/bnb4bit`, written by
//! `scripts/bnb_reference.py`, checks both on tiny-llama's layers and edge cases). Two caveats,
//! both bitsandbytes' own: its offset is PyTorch's CPU mean, whose summation order depends on
//! PyTorch's thread count above 32,768 blocks (2M-element weights); ours is PyTorch's one-thread
//! order at every size, so for such weights the offset may differ in its last bit from a
//! multi-threaded PyTorch's (and a GPU's quantization rounds differently anyway). And
//! bitsandbytes 0.50.2's AVX-512 CPU dequantization takes the wrong block scales when a weight's
//! last dimension is a multiple of 16 but not of 64; ours, like its portable and CUDA kernels,
//! follows the flat block layout.
//!
//! **On a GPU.** The weights are held in host memory; `src/quant/dequant4.cu` is the CUDA
//! dequantization kernel (bit for bit the values above, checked on the CPU's emulation of CUDA by
//! `tests/cuda_emulation/check_quant.cpp` and compiled by the real NVRTC in
//! `scripts/nvrtc_check.py`), not launched yet: no GPU has run it.
//!
//! ```
//! use accelerate_rs::quant::{Quant4bitConfig, Weight4bit};
//! use candle_core::{Device, Tensor};
//!
//! # fn main() -> accelerate_rs::Result<()> {
//! let w = Tensor::randn(0f32, 0.02, (96, 32), &Device::Cpu)?;
//! let q = Weight4bit::quantize(&w, &Quant4bitConfig::nf4())?;
//! assert_eq!(q.packed().len(), 96 * 32 / 2);
//! // The tensors of a `transformers` 4-bit folder, and back.
//! let tensors: std::collections::HashMap<String, Tensor> =
//!     q.tensors("model.layers.0.mlp.up_proj")?.into_iter().collect();
//! let back = Weight4bit::read("model.layers.0.mlp.up_proj", |name| tensors.get(name).cloned())?;
//! let (a, b) = (q.dequantize()?, back.dequantize()?);
//! assert_eq!(a.to_vec2::<f32>()?, b.to_vec2::<f32>()?);
//! assert!((a - &w)?.abs()?.max_all()?.to_scalar::<f32>()? < 0.02);
//! # Ok(()) }
//! ```

mod blockwise;
mod codes;
mod config;
mod state;
mod weight;

pub use codes::QuantType;
pub use config::{Quant4bitConfig, BLOCKSIZES, NESTED_BLOCKSIZE};
pub use state::{NestedScales, QuantState, Scales};
pub(crate) use weight::rounding;
pub use weight::Weight4bit;
