//! Optimizers whose state can be saved and restored: [`AdamW`] and [`Sgd`] (with momentum,
//! Nesterov and weight decay).
//!
//! Both implement [`candle_nn::Optimizer`], so they drop into
//! [`Accelerator::prepare`](crate::Accelerator::prepare) and
//! [`AcceleratedOptimizer::backward_step`](crate::AcceleratedOptimizer::backward_step) like
//! Candle's own. On top of that they expose their state for checkpoints:
//! [`state`](AdamW::state) returns an [`OptimizerState`] (step count, learning rate and the named
//! per-parameter moment tensors) and [`load_state`](AdamW::load_state) puts one back, checking
//! that it fits the parameters. A run resumed from a state continues bit-identically to one that
//! was never interrupted.
//!
//! Tensor names use the parameter's index in the list given to `new` (after dropping the
//! non-float ones, as Candle does): `"{i}.m"` and `"{i}.v"` for AdamW's first and second moments,
//! `"{i}.momentum"` for SGD's momentum buffer. Pass the parameters in the same order when
//! restoring (e.g. sorted by name, as [`Parameters`](crate::Parameters) does).
//!
//! On the CPU both update every parameter in one fused, in-place pass (parameter, gradient and
//! state read once and written where they are, no tensor allocated per step). On CUDA (f32, bf16
//! and f16) one kernel launch per parameter does the same, with the CPU kernels' arithmetic (bf16
//! and f16 computed in f32); it is compiled with NVRTC at first use for the GPU's architecture,
//! and if that fails the optimizers warn once and fall back. Elsewhere, or with fusion off
//! ([`AdamW::set_fused`], `ACCELERATE_RS_FUSED_OPTIM=0`), they run the same formulas as tensor
//! ops. Because the state is written in place,
//! [`state`](AdamW::state) copies it: a state taken is a snapshot that later steps do not change.

mod adamw;
mod fused;
#[cfg(feature = "cuda")]
mod fused_cuda;
#[cfg(not(feature = "cuda"))]
#[path = "fused_cuda_stub.rs"]
mod fused_cuda;
mod sgd;
mod slots;
mod state;

pub use adamw::AdamW;
pub use candle_nn::ParamsAdamW;
pub(crate) use fused::sq_sum;
pub(crate) use fused_cuda::all_finite as all_finite_on_gpu;
pub use sgd::{Sgd, SgdConfig};

pub use fused_cuda::launches as cuda_kernel_launches;
pub(crate) use state::{candle_err, check_lr, ParamPieces, Shard};
pub use state::{OptimizerState, StateShard, StatefulOptimizer};
