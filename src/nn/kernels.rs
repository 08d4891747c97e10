//! The switch and the counter of `nn`'s CUDA kernels (no-ops without the `cuda` feature).

#[cfg(feature = "cuda")]
use super::cuda;

/// Whether this build has the CUDA kernels (the `cuda` feature).
pub const CUDA_KERNELS_BUILT: bool = cfg!(feature = "cuda");

/// Number of this module's CUDA kernels launched by this process (0 without the `cuda`
/// feature): a check can tell that the kernels really ran rather than the composed ops.
pub fn cuda_kernel_launches() -> u64 {
    #[cfg(feature = "cuda")]
    {
        cuda::launches()
    }
    #[cfg(not(feature = "cuda"))]
    {
        0
    }
}

/// Switches the CUDA kernels on or off for the ops called from now on (overriding
/// `ACCELERATE_RS_NN_CUDA`); ops already in a graph keep the path they took. Does nothing
/// without the feature.
pub fn set_cuda_kernels(on: bool) {
    #[cfg(feature = "cuda")]
    cuda::set_enabled(on);
    #[cfg(not(feature = "cuda"))]
    let _ = on;
}
