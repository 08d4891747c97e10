//! CUDA sources compiled at run time with NVRTC (the fused optimizer kernels of `optim`, and
//! `nn`'s kernels): each source is compiled once per process and GPU
//! architecture, for the device's own architecture (`compute_XY` of its compute capability), so
//! the driver only finishes the code for that GPU instead of JIT-compiling generic PTX.
//!
//! Every source is compiled with IEEE division and square root and without contracting products
//! and sums into FMAs (`--fmad=false`): the kernels then do the same f32 operations as the CPU
//! kernels they mirror. They are memory-bound, so this costs nothing measurable.

use std::sync::Mutex;

use candle_core::cuda_backend::CudaDevice;

/// NVRTC's virtual architecture for a compute capability (`compute_90` for an H100).
pub(crate) fn arch_of(major: i32, minor: i32) -> String {
    format!("compute_{major}{minor}")
}

/// `dev`'s compute capability as an NVRTC architecture.
pub(crate) fn device_arch(dev: &CudaDevice) -> Result<String, String> {
    let stream = dev.cuda_stream();
    let (major, minor) = stream
        .context()
        .compute_capability()
        .map_err(|e| format!("reading the compute capability: {e:?}"))?;
    Ok(arch_of(major, minor))
}

/// NVRTC's options for `arch` (see the module docs).
pub(crate) fn compile_options(arch: &str) -> cudarc::nvrtc::CompileOptions {
    cudarc::nvrtc::CompileOptions {
        fmad: Some(false),
        prec_div: Some(true),
        prec_sqrt: Some(true),
        ftz: Some(false),
        options: vec![format!("--gpu-architecture={arch}")],
        ..Default::default()
    }
}

/// PTX compiled so far: `(source name, architecture)` → PTX, leaked (a process compiles a few).
static CACHE: Mutex<Vec<(&'static str, String, &'static str)>> = Mutex::new(Vec::new());

/// The PTX of `source` (called `name` in messages and the cache) for `dev`'s architecture,
/// compiled on first use; the error says what failed.
pub(crate) fn ptx(
    name: &'static str,
    source: &'static str,
    dev: &CudaDevice,
) -> Result<&'static str, String> {
    let arch = device_arch(dev)?;
    let mut cache = CACHE.lock().unwrap_or_else(|p| p.into_inner());
    if let Some((.., p)) = cache.iter().find(|(n, a, _)| *n == name && *a == arch) {
        return Ok(p);
    }
    let compiled = cudarc::nvrtc::compile_ptx_with_opts(source, compile_options(&arch))
        .map_err(|e| format!("NVRTC could not compile {name} for {arch}: {e:?}"))?;
    let p: &'static str = Box::leak(compiled.to_src().into_boxed_str());
    cache.push((name, arch, p));
    Ok(p)
}
