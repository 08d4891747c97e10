//! CUDA kernels for `accelerate_rs::nn` (the `cuda` feature): LayerNorm and RMSNorm,
//! softmax and causal softmax, cross-entropy (also `linear_cross_entropy`'s row pass after the
//! product), GELU and ReLU, SiLU, the SwiGLU gate and RoPE (with its tables' gradients), forward
//! and backward, in f32, bf16 and f16 (computed in f32), all proven against the CPU path on a
//! GPU (`scripts/gpu-smoke.sh`, step 8). Flash attention (`flash_cuda.rs`, a module of its own)
//! is proven correct too but is slower than Candle's composed attention at training sizes (a
//! warp per query row, no tensor cores): it runs only with `ACCELERATE_RS_NN_CUDA_FLASH=1`
//! ([`use_flash_kernel`]).
//!
//! The kernels (`kernels.cu`) are compiled with NVRTC at first use for the GPU's architecture
//! ([`crate::cuda_ptx`]). Whether an op takes them is decided before it is built
//! ([`use_kernels`]): a CUDA tensor of one of those dtypes, the kernels switched on (the
//! `cuda` feature, then `ACCELERATE_RS_NN_CUDA`, default on, or [`set_enabled`]), and the
//! kernels compiled and loaded on that GPU. If compiling or loading fails, one warning is logged
//! and the composed ops are used from then on: a missing fast path never stops training.
//!
//! The ops are the CPU ops of each layer (`NormFwd`, `SoftmaxFwd`, ...) with a `cuda_fwd`; their
//! backward passes go through the same ops, so they run on the GPU too.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::Mutex;

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::{CudaDType, CudaDevice, CudaStorage, WrapErr};
use candle_core::{CustomOp1, CustomOp2, DType, Layout, Result, Shape, Storage, Tensor};
use cudarc::driver::{CudaView, DeviceRepr, LaunchConfig, PushKernelArg};

const MODULE: &str = "accelerate_rs_nn";
/// The source NVRTC compiles: the shared element types and conversions, then the kernels.
const SOURCE: &str = concat!(
    include_str!("../cuda_prelude.cu"),
    include_str!("kernels.cu")
);

/// Set once compiling or loading failed: the composed ops are used from then on.
static BROKEN: AtomicBool = AtomicBool::new(false);
/// 0: not decided yet (read `ACCELERATE_RS_NN_CUDA`), 1: off, 2: on.
static SWITCH: AtomicU8 = AtomicU8::new(0);
static LAUNCHES: AtomicU64 = AtomicU64::new(0);
/// Devices (Candle's ids) the module was loaded on.
static LOADED: Mutex<Vec<candle_core::cuda_backend::DeviceId>> = Mutex::new(Vec::new());

/// Number of `nn` CUDA kernels launched by this process.
pub(crate) fn launches() -> u64 {
    LAUNCHES.load(Ordering::Relaxed)
}

/// Switches the kernels on or off for ops built from now on (overrides `ACCELERATE_RS_NN_CUDA`).
pub(crate) fn set_enabled(on: bool) {
    SWITCH.store(if on { 2 } else { 1 }, Ordering::Relaxed);
}

/// Whether the kernels are switched on: [`set_enabled`], else `ACCELERATE_RS_NN_CUDA` (a flag,
/// default on; a value that is not a flag is an error naming it).
fn switched_on() -> Result<bool> {
    match SWITCH.load(Ordering::Relaxed) {
        1 => return Ok(false),
        2 => return Ok(true),
        _ => {}
    }
    let on = crate::settings::parse::process_env::<bool>(crate::settings::env::NN_CUDA)
        .map_err(candle_core::Error::wrap)?
        .unwrap_or(true);
    // A concurrent `set_enabled` wins over the environment.
    let _ = SWITCH.compare_exchange(
        0,
        if on { 2 } else { 1 },
        Ordering::Relaxed,
        Ordering::Relaxed,
    );
    Ok(SWITCH.load(Ordering::Relaxed) == 2)
}

fn disable(why: &str) {
    if !BROKEN.swap(true, Ordering::Relaxed) {
        log::warn!("accelerate_rs::nn CUDA kernels unavailable ({why}); using Candle's composed ops instead");
    }
}

/// Whether an op on `x` takes the kernels: `x` on a GPU in f32, bf16 or f16, the kernels
/// switched on, and compiled and loaded on that GPU (on first use; a failure is one warning and
/// `false` from then on).
pub(super) fn use_kernels(x: &Tensor) -> Result<bool> {
    let candle_core::Device::Cuda(dev) = x.device() else {
        return Ok(false);
    };
    if !matches!(x.dtype(), DType::F32 | DType::BF16 | DType::F16)
        || BROKEN.load(Ordering::Relaxed)
        || !switched_on()?
    {
        return Ok(false);
    }
    let mut loaded = LOADED.lock().unwrap_or_else(|p| p.into_inner());
    if loaded.contains(&dev.id()) {
        return Ok(true);
    }
    match crate::cuda_ptx::ptx(MODULE, SOURCE, dev).and_then(|ptx| {
        dev.get_or_load_custom_func("relu_fwd_f32", MODULE, ptx)
            .map_err(|e| format!("loading the module: {e}"))
    }) {
        Ok(_) => {
            loaded.push(dev.id());
            Ok(true)
        }
        Err(e) => {
            disable(&e);
            Ok(false)
        }
    }
}

/// [`use_kernels`] for the flash attention kernel (correct, but slower than Candle's composed
/// attention at training sizes): also needs `ACCELERATE_RS_NN_CUDA_FLASH` (a flag, default off;
/// read once).
pub(super) fn use_flash_kernel(x: &Tensor) -> Result<bool> {
    static FLASH: once_cell::sync::OnceCell<bool> = once_cell::sync::OnceCell::new();
    let on = *FLASH.get_or_try_init(|| {
        crate::settings::parse::process_env::<bool>(crate::settings::env::NN_CUDA_FLASH)
            .map(|v| v.unwrap_or(false))
            .map_err(candle_core::Error::wrap)
    })?;
    Ok(on && use_kernels(x)?)
}

/// Loads kernel `$name` on `$dev` (compiled and loaded by [`use_kernels`] already). A macro:
/// Candle does not export the type of the loaded function.
macro_rules! func {
    ($dev:expr, $name:expr) => {{
        let ptx = crate::cuda_ptx::ptx(MODULE, SOURCE, &$dev).map_err(candle_core::Error::Msg)?;
        $dev.get_or_load_custom_func(&$name, MODULE, ptx)?
    }};
}

/// A contiguous input's elements as a typed view.
fn view<'a, T: CudaDType>(s: &'a CudaStorage, l: &Layout, op: &str) -> Result<CudaView<'a, T>> {
    let (a, b) = l
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg(format!("{op}: a contiguous input is expected")))?;
    Ok(T::as_cuda_slice(s)?.slice(a..b))
}

/// Threads per block for rows of `d`: a multiple of 32, at most 1024.
fn row_threads(d: usize) -> u32 {
    (d.div_ceil(32) * 32).clamp(32, 1024) as u32
}

/// One block per row.
fn rows_config(rows: usize, d: usize) -> Result<LaunchConfig> {
    let grid = u32::try_from(rows)
        .map_err(|_| candle_core::Error::Msg(format!("{rows} rows are too many for one launch")))?;
    Ok(LaunchConfig {
        grid_dim: (grid, 1, 1),
        block_dim: (row_threads(d), 1, 1),
        shared_mem_bytes: 0,
    })
}

/// A grid-stride launch over `n` elements.
fn elems_config(n: usize) -> LaunchConfig {
    const THREADS: usize = 256;
    LaunchConfig {
        grid_dim: (n.div_ceil(THREADS).clamp(1, 8192) as u32, 1, 1),
        block_dim: (THREADS as u32, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn as_i32(v: usize, what: &str) -> Result<i32> {
    i32::try_from(v)
        .map_err(|_| candle_core::Error::Msg(format!("{what} {v} is too large for the kernels")))
}

/// Counts one launch of an `nn` kernel (also the flash-attention module's, `flash_cuda.rs`).
pub(super) fn counted() {
    LAUNCHES.fetch_add(1, Ordering::Relaxed);
}

/// Runs `$body` with `$t` the element type and `$s` the kernels' suffix of `$dtype`.
macro_rules! by_dtype {
    ($dtype:expr, $op:expr, |$t:ident, $s:ident| $body:expr) => {
        match $dtype {
            DType::F32 => {
                type $t = f32;
                let $s = "f32";
                $body
            }
            DType::BF16 => {
                type $t = half::bf16;
                let $s = "bf16";
                $body
            }
            DType::F16 => {
                type $t = half::f16;
                let $s = "f16";
                $body
            }
            other => candle_core::bail!("{}: no CUDA kernel for {other:?}", $op),
        }
    };
}

/// Allocates `n` elements of `T` that the kernel launched next writes in full.
fn output<T: DeviceRepr>(dev: &CudaDevice, n: usize) -> Result<cudarc::driver::CudaSlice<T>> {
    // SAFETY: every caller launches a kernel that writes all `n` elements before anything reads
    // them (later uses are queued after it on the device's one stream).
    unsafe { dev.alloc::<T>(n) }
}

/// LayerNorm (`remove_mean`) or RMSNorm forward of `x` `[rows, d]` with weight and bias `[d]`.
pub(super) fn norm_fwd(
    (xs, xl): (&CudaStorage, &Layout),
    (ws, wl): (&CudaStorage, &Layout),
    (bs, bl): (&CudaStorage, &Layout),
    eps: f32,
    remove_mean: bool,
    has_bias: bool,
) -> Result<(CudaStorage, Shape)> {
    const OP: &str = "accelerate-rs-norm (CUDA)";
    let d = xl.dims().last().copied().unwrap_or(1).max(1);
    let n = xl.shape().elem_count();
    let rows = n / d;
    let dev = xs.device().clone();
    by_dtype!(xs.dtype(), OP, |T, s| {
        let (x, w, b) = (
            view::<T>(xs, xl, OP)?,
            view::<T>(ws, wl, OP)?,
            view::<T>(bs, bl, OP)?,
        );
        let mut y = output::<T>(&dev, n)?;
        if rows > 0 {
            let f = func!(dev, format!("norm_fwd_{s}"));
            let (d32, rm, hb) = (
                as_i32(d, "width")?,
                i32::from(remove_mean),
                i32::from(has_bias),
            );
            let mut a = f.builder();
            a.arg(&x)
                .arg(&w)
                .arg(&b)
                .arg(&mut y)
                .arg(&d32)
                .arg(&rm)
                .arg(&hb)
                .arg(&eps);
            // SAFETY: the arguments match `norm_fwd_<T>`'s signature (three read-only views and
            // one output of the element type, then int d, int remove_mean, int has_bias, float
            // eps); `x` and `y` hold `rows * d` elements, `w` and `b` `d` (the op checked the
            // shapes), and each block touches its own row only.
            unsafe { a.launch(rows_config(rows, d)?) }.w()?;
            counted();
        }
        Ok((T::wrap_cuda_slice(y, dev.clone()), xl.shape().clone()))
    })
}

/// Rows of the partial weight/bias sums of the norm's backward pass per chunk.
const NORM_CHUNK_ROWS: usize = 64;

/// The norm's backward: `(x, w, dy)` → `[dx (all of x), dweight (d), dbias (d)]`, flat.
pub(super) fn norm_bwd(
    (xs, xl): (&CudaStorage, &Layout),
    (ws, wl): (&CudaStorage, &Layout),
    (gs, gl): (&CudaStorage, &Layout),
    eps: f32,
    remove_mean: bool,
) -> Result<(CudaStorage, Shape)> {
    const OP: &str = "accelerate-rs-norm-backward (CUDA)";
    let d = wl.shape().elem_count().max(1);
    let n = xl.shape().elem_count();
    let rows = n / d;
    let dev = xs.device().clone();
    by_dtype!(xs.dtype(), OP, |T, s| {
        let (x, w, dy) = (
            view::<T>(xs, xl, OP)?,
            view::<T>(ws, wl, OP)?,
            view::<T>(gs, gl, OP)?,
        );
        let mut out = output::<T>(&dev, n + 2 * d)?;
        let d32 = as_i32(d, "width")?;
        if rows == 0 {
            // No rows: zero gradients for the weight and the bias.
            let zeros = dev.alloc_zeros::<T>(n + 2 * d)?;
            return Ok((
                T::wrap_cuda_slice(zeros, dev.clone()),
                Shape::from(n + 2 * d),
            ));
        }
        let mut stats = output::<f32>(&dev, 2 * rows)?;
        {
            let f = func!(dev, format!("norm_bwd_rows_{s}"));
            let mut dx = out.slice_mut(0..n);
            let rm = i32::from(remove_mean);
            let mut a = f.builder();
            a.arg(&x)
                .arg(&w)
                .arg(&dy)
                .arg(&mut dx)
                .arg(&mut stats)
                .arg(&d32)
                .arg(&rm)
                .arg(&eps);
            // SAFETY: matches `norm_bwd_rows_<T>` (x, w, dy read-only, dx written, f32 stats,
            // int d, int remove_mean, float eps); x, dy and dx hold `rows * d` elements, w `d`,
            // stats `2 * rows`; each block touches its own row.
            unsafe { a.launch(rows_config(rows, d)?) }.w()?;
            counted();
        }
        // Chunks of rows for the column sums (grid.y stays below CUDA's 65535).
        let chunk = NORM_CHUNK_ROWS.max(rows.div_ceil(65_535));
        let chunks = rows.div_ceil(chunk);
        let mut partial = output::<f32>(&dev, 2 * d * chunks)?;
        let col_blocks = d.div_ceil(256) as u32;
        {
            let f = func!(dev, format!("norm_bwd_cols_{s}"));
            let (rows64, chunk32) = (rows as i64, as_i32(chunk, "chunk")?);
            let mut a = f.builder();
            a.arg(&x)
                .arg(&dy)
                .arg(&stats)
                .arg(&mut partial)
                .arg(&rows64)
                .arg(&d32)
                .arg(&chunk32);
            let cfg = LaunchConfig {
                grid_dim: (col_blocks, chunks as u32, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: matches `norm_bwd_cols_<T>` (x, dy read-only, f32 stats, f32 partial, long
            // long rows, int d, int chunk); thread (j, c) reads rows c*chunk.. of column j < d
            // and writes partial[2c*d + j] and partial[(2c+1)*d + j], inside `2 * d * chunks`.
            unsafe { a.launch(cfg) }.w()?;
            counted();
        }
        {
            let f = func!(dev, format!("norm_bwd_finish_{s}"));
            let mut wb = out.slice_mut(n..n + 2 * d);
            let chunks32 = as_i32(chunks, "chunks")?;
            let mut a = f.builder();
            a.arg(&partial).arg(&mut wb).arg(&chunks32).arg(&d32);
            let cfg = LaunchConfig {
                grid_dim: (col_blocks, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: matches `norm_bwd_finish_<T>` (f32 partial, output, int chunks, int d);
            // column j < d sums `chunks` partials and writes wb[j] and wb[d + j] (`2 * d`).
            unsafe { a.launch(cfg) }.w()?;
            counted();
        }
        Ok((T::wrap_cuda_slice(out, dev.clone()), Shape::from(n + 2 * d)))
    })
}

/// Softmax forward over rows of `d` (`scale`, and the causal mask of `(t_q, t_k)` when given).
pub(super) fn softmax_fwd(
    xs: &CudaStorage,
    xl: &Layout,
    scale: f32,
    causal: Option<(usize, usize)>,
) -> Result<(CudaStorage, Shape)> {
    const OP: &str = "accelerate-rs-softmax (CUDA)";
    let d = xl.dims().last().copied().unwrap_or(1).max(1);
    let n = xl.shape().elem_count();
    let rows = n / d;
    let dev = xs.device().clone();
    by_dtype!(xs.dtype(), OP, |T, s| {
        let x = view::<T>(xs, xl, OP)?;
        let mut y = output::<T>(&dev, n)?;
        if rows > 0 {
            let f = func!(dev, format!("softmax_fwd_{s}"));
            let (tq, tk) = causal.unwrap_or((1, d));
            let (d32, c, tq, tk) = (
                as_i32(d, "width")?,
                i32::from(causal.is_some()),
                as_i32(tq.max(1), "queries")?,
                as_i32(tk, "keys")?,
            );
            let mut a = f.builder();
            a.arg(&x)
                .arg(&mut y)
                .arg(&d32)
                .arg(&scale)
                .arg(&c)
                .arg(&tq)
                .arg(&tk);
            // SAFETY: matches `softmax_fwd_<T>` (x read-only, y written, int d, float scale, int
            // causal, int tq, int tk); both hold `rows * d` elements and each block touches its
            // own row; tq >= 1.
            unsafe { a.launch(rows_config(rows, d)?) }.w()?;
            counted();
        }
        Ok((T::wrap_cuda_slice(y, dev.clone()), xl.shape().clone()))
    })
}

/// Softmax backward: `(y, dy)` → `scale · y · (dy − Σ y·dy)` per row.
pub(super) fn softmax_bwd(
    (ys, yl): (&CudaStorage, &Layout),
    (gs, gl): (&CudaStorage, &Layout),
    scale: f32,
) -> Result<(CudaStorage, Shape)> {
    const OP: &str = "accelerate-rs-softmax-backward (CUDA)";
    let d = yl.dims().last().copied().unwrap_or(1).max(1);
    let n = yl.shape().elem_count();
    let rows = n / d;
    let dev = ys.device().clone();
    by_dtype!(ys.dtype(), OP, |T, s| {
        let (y, dy) = (view::<T>(ys, yl, OP)?, view::<T>(gs, gl, OP)?);
        let mut dx = output::<T>(&dev, n)?;
        if rows > 0 {
            let f = func!(dev, format!("softmax_bwd_{s}"));
            let d32 = as_i32(d, "width")?;
            let mut a = f.builder();
            a.arg(&y).arg(&dy).arg(&mut dx).arg(&d32).arg(&scale);
            // SAFETY: matches `softmax_bwd_<T>` (y, dy read-only, dx written, int d, float
            // scale); all hold `rows * d` elements; each block touches its own row.
            unsafe { a.launch(rows_config(rows, d)?) }.w()?;
            counted();
        }
        Ok((T::wrap_cuda_slice(dx, dev.clone()), yl.shape().clone()))
    })
}

/// Which elementwise kernel.
#[derive(Clone, Copy)]
pub(super) enum Elementwise {
    GeluFwd,
    GeluBwd,
    ReluFwd,
    ReluBwd,
    SiluFwd,
    SiluBwd,
}

impl Elementwise {
    fn kernel(self) -> &'static str {
        match self {
            Elementwise::GeluFwd => "gelu_fwd",
            Elementwise::GeluBwd => "gelu_bwd",
            Elementwise::ReluFwd => "relu_fwd",
            Elementwise::ReluBwd => "relu_bwd",
            Elementwise::SiluFwd => "silu_fwd",
            Elementwise::SiluBwd => "silu_bwd",
        }
    }
}

/// GELU / ReLU / SiLU forward (`second` is `None`) or backward (`second` is `dy`).
pub(super) fn elementwise(
    which: Elementwise,
    (xs, xl): (&CudaStorage, &Layout),
    second: Option<(&CudaStorage, &Layout)>,
) -> Result<(CudaStorage, Shape)> {
    let op = which.kernel();
    let n = xl.shape().elem_count();
    let dev = xs.device().clone();
    by_dtype!(xs.dtype(), op, |T, s| {
        let x = view::<T>(xs, xl, op)?;
        let mut y = output::<T>(&dev, n)?;
        if n > 0 {
            let f = func!(dev, format!("{op}_{s}"));
            let n64 = n as i64;
            let dy;
            let mut a = f.builder();
            a.arg(&x);
            if let Some((gs, gl)) = second {
                dy = view::<T>(gs, gl, op)?;
                if dy.len() != n {
                    candle_core::bail!(
                        "{op}: the gradient has {} elements, the input {n}",
                        dy.len()
                    );
                }
                a.arg(&dy);
            }
            a.arg(&mut y).arg(&n64);
            // SAFETY: matches `<op>_<T>`: (x, y, long long n) for the forward kernels, (x or y,
            // dy, dx, long long n) for the backward ones; every view holds `n` elements and the
            // grid-stride loop stays below `n`.
            unsafe { a.launch(elems_config(n)) }.w()?;
            counted();
        }
        Ok((T::wrap_cuda_slice(y, dev.clone()), xl.shape().clone()))
    })
}

/// The SwiGLU gate's forward pass (`inputs` = gate, up: `silu(gate) * up`) or backward pass
/// (`inputs` = gate, up, dy: `[d gate, d up]` flat, `2 n` elements), on contiguous inputs of
/// one dtype and `n` elements each.
pub(super) fn swiglu(inputs: &[(&CudaStorage, &Layout)]) -> Result<(CudaStorage, Shape)> {
    let backward = inputs.len() == 3;
    let op = if backward { "swiglu_bwd" } else { "swiglu_fwd" };
    let Some(&(first, first_l)) = inputs.first() else {
        candle_core::bail!("{op}: no input");
    };
    let n = first_l.shape().elem_count();
    let dev = first.device().clone();
    by_dtype!(first.dtype(), op, |T, s| {
        let views = inputs
            .iter()
            .map(|&(st, l)| view::<T>(st, l, op))
            .collect::<Result<Vec<_>>>()?;
        if let Some(v) = views.iter().find(|v| v.len() != n) {
            candle_core::bail!("{op}: inputs of {} and {n} elements", v.len());
        }
        let out_len = if backward { 2 * n } else { n };
        let mut y = output::<T>(&dev, out_len)?;
        if n > 0 {
            let f = func!(dev, format!("{op}_{s}"));
            let n64 = n as i64;
            let mut a = f.builder();
            for v in &views {
                a.arg(v);
            }
            a.arg(&mut y).arg(&n64);
            // SAFETY: matches `<op>_<T>`: (gate, up, y, long long n) forward, (gate, up, dy,
            // out, long long n) backward; every input view holds `n` elements, the output `n`
            // (forward) or `2 n` (backward), and the grid-stride loop stays below `n`.
            unsafe { a.launch(elems_config(n)) }.w()?;
            counted();
        }
        let shape = if backward {
            Shape::from(out_len)
        } else {
            first_l.shape().clone()
        };
        Ok((T::wrap_cuda_slice(y, dev.clone()), shape))
    })
}

/// Rotary embeddings: `xs` turned pair by pair by the tables (`sign` -1: the other way, the
/// backward of `xs`).
pub(super) fn rope(
    (xs, xl): (&CudaStorage, &Layout),
    (cs, cl): (&CudaStorage, &Layout),
    (ss, sl): (&CudaStorage, &Layout),
    g: super::rope_geometry::Geometry,
    sign: f32,
) -> Result<(CudaStorage, Shape)> {
    const OP: &str = "rope_fwd";
    let n = xl.shape().elem_count();
    let dev = xs.device().clone();
    by_dtype!(xs.dtype(), OP, |T, s| {
        let (x, c, sn) = (
            view::<T>(xs, xl, OP)?,
            view::<T>(cs, cl, OP)?,
            view::<T>(ss, sl, OP)?,
        );
        let table = g.table_rows() * (g.d / 2);
        if n != g.b * g.h * g.t * g.d
            || c.len() != table
            || sn.len() != table
            || !g.d.is_multiple_of(2)
        {
            candle_core::bail!(
                "{OP}: xs of {n} elements and tables of {} and {} for {g:?}",
                c.len(),
                sn.len()
            );
        }
        let mut y = output::<T>(&dev, n)?;
        if n > 0 {
            let f = func!(dev, format!("{OP}_{s}"));
            let pairs = (n / 2) as i64;
            let (d, h, t) = (
                as_i32(g.d, "head_dim")?,
                as_i32(g.h, "heads")?,
                as_i32(g.t, "sequence")?,
            );
            let batched = i32::from(g.batched);
            let mut a = f.builder();
            a.arg(&x).arg(&c).arg(&sn).arg(&mut y).arg(&pairs).arg(&d);
            let variant = g.kernel_variant();
            a.arg(&variant).arg(&h).arg(&t).arg(&batched).arg(&sign);
            // SAFETY: matches `rope_fwd_<T>` (x, cos, sin read-only, y written, long long pairs,
            // int d, int variant, int h, int t, int batched, float sign); x and y hold
            // `b h t d = 2 pairs` elements and the tables `table` (checked above), which every
            // table row index the kernel computes stays below.
            unsafe { a.launch(elems_config(n / 2)) }.w()?;
            counted();
        }
        Ok((T::wrap_cuda_slice(y, dev.clone()), xl.shape().clone()))
    })
}

/// The rotary tables' gradients: `[d cos, d sin]` flat (`2 n` for tables of `n` elements), each
/// entry summed over the rows of `xs` that use it, `d sin` times `sign`.
pub(super) fn rope_tables(
    (xs, xl): (&CudaStorage, &Layout),
    (gs, gl): (&CudaStorage, &Layout),
    g: super::rope_geometry::Geometry,
    sign: f32,
) -> Result<(CudaStorage, Shape)> {
    const OP: &str = "rope_tables";
    let dev = xs.device().clone();
    let n = g.table_rows() * (g.d / 2);
    by_dtype!(xs.dtype(), OP, |T, s| {
        let (x, dy) = (view::<T>(xs, xl, OP)?, view::<T>(gs, gl, OP)?);
        if x.len() != g.b * g.h * g.t * g.d || dy.len() != x.len() {
            candle_core::bail!(
                "{OP}: xs of {} and a gradient of {} elements for {g:?}",
                x.len(),
                dy.len()
            );
        }
        let mut out = output::<T>(&dev, 2 * n)?;
        if n > 0 {
            let f = func!(dev, format!("{OP}_{s}"));
            let n64 = n as i64;
            let (b, h, t, d) = (
                as_i32(g.b, "batch")?,
                as_i32(g.h, "heads")?,
                as_i32(g.t, "sequence")?,
                as_i32(g.d, "head_dim")?,
            );
            let batched = i32::from(g.batched);
            let mut a = f.builder();
            a.arg(&x)
                .arg(&dy)
                .arg(&mut out)
                .arg(&n64)
                .arg(&b)
                .arg(&h)
                .arg(&t)
                .arg(&d);
            let variant = g.kernel_variant();
            a.arg(&variant).arg(&batched).arg(&sign);
            // SAFETY: matches `rope_tables_<T>` (x, g read-only, out written, long long n, int
            // b, h, t, d, variant, batched, float sign); x and g hold `b h t d` elements
            // (checked above), out `2 n`, and every row the kernel sums over is below `b h t`.
            unsafe { a.launch(elems_config(n)) }.w()?;
            counted();
        }
        Ok((T::wrap_cuda_slice(out, dev.clone()), Shape::from(2 * n)))
    })
}

/// Runs `f` with `t` (`len` elements of `T` on the GPU) as a view: a kernel input that is not
/// one of the op's own arguments (`what` names it in errors).
fn with_view<T: CudaDType, R>(
    t: &Tensor,
    len: usize,
    (op, what): (&str, &str),
    f: impl FnOnce(CudaView<'_, T>) -> Result<R>,
) -> Result<R> {
    let (s, l) = t.storage_and_layout();
    let Storage::Cuda(s) = &*s else {
        candle_core::bail!("{op}: the {what} are not on the GPU");
    };
    let v = view::<T>(s, l, op)?;
    if v.len() != len {
        candle_core::bail!("{op}: {} {what} where {len} are expected", v.len());
    }
    f(v)
}

/// Runs `f` with the targets (`t`, i64 on the GPU, one per row of `rows`) as a view.
fn with_targets<R>(
    t: &Tensor,
    rows: usize,
    op: &str,
    f: impl FnOnce(CudaView<'_, i64>) -> Result<R>,
) -> Result<R> {
    with_view(t, rows, (op, "targets"), f)
}

/// The embedding's rows of the table `[n, dim]` (`ts`): the first `count` entries of `plan`,
/// the packed lookup plan of `embedding.rs` (`[ids (count) | order (count) | starts (uniq + 1)
/// | uniq (uniq)]`, u32, the ids checked by the caller to lie in the table), as `[count, dim]`.
pub(super) fn embedding_rows(
    (ts, tl): (&CudaStorage, &Layout),
    plan: &Tensor,
    count: usize,
) -> Result<(CudaStorage, Shape)> {
    const OP: &str = "accelerate-rs-embedding (CUDA)";
    let dev = ts.device().clone();
    let len = plan.elem_count();
    with_view::<u32, _>(plan, len, (OP, "plan entries"), |p| {
        by_dtype!(ts.dtype(), OP, |T, s| {
            let table = view::<T>(ts, tl, OP)?;
            let (_, dim) = tl.shape().dims2()?;
            if len < count {
                candle_core::bail!("{OP}: a plan of {len} for {count} ids");
            }
            let n = count * dim;
            let mut y = output::<T>(&dev, n)?;
            if n > 0 {
                let f = func!(dev, format!("embedding_rows_{s}"));
                let (ids, n64, d32) = (p.slice(0..count), n as i64, as_i32(dim, "width")?);
                let mut a = f.builder();
                a.arg(&table).arg(&ids).arg(&mut y).arg(&n64).arg(&d32);
                // SAFETY: matches `embedding_rows_<T>` (table and u32 ids read-only, out written,
                // long long n, int dim); out holds `n = count * dim` elements, ids `count`, and
                // every id was checked to be a row of the table (`[n_rows, dim]`).
                unsafe { a.launch(elems_config(n)) }.w()?;
                counted();
            }
            Ok((
                T::wrap_cuda_slice(y, dev.clone()),
                Shape::from((count, dim)),
            ))
        })
    })
}

/// The embedding table's gradient `[n, dim]` from the rows' gradients `gs` (`[count, dim]`):
/// zero-filled, then each of the `uniq` looked-up rows the sum of its lookups' gradients (one
/// block per row, no atomics). `plan` as in [`embedding_rows`], its rows checked by the caller
/// to lie below `n`.
pub(super) fn embedding_grad(
    (gs, gl): (&CudaStorage, &Layout),
    plan: &Tensor,
    (count, uniq): (usize, usize),
    n: usize,
    dim: usize,
) -> Result<(CudaStorage, Shape)> {
    const OP: &str = "accelerate-rs-embedding-backward (CUDA)";
    let dev = gs.device().clone();
    let len = 2 * count + 2 * uniq + 1;
    with_view::<u32, _>(plan, len, (OP, "plan entries"), |p| {
        by_dtype!(gs.dtype(), OP, |T, s| {
            let g = view::<T>(gs, gl, OP)?;
            if g.len() != count * dim {
                candle_core::bail!("{OP}: a gradient of {} for {count} rows of {dim}", g.len());
            }
            let mut out = dev.alloc_zeros::<T>(n * dim)?;
            if uniq > 0 && dim > 0 {
                let f = func!(dev, format!("embedding_grad_{s}"));
                let order = p.slice(count..2 * count);
                let starts = p.slice(2 * count..2 * count + uniq + 1);
                let rows = p.slice(2 * count + uniq + 1..len);
                let d32 = as_i32(dim, "width")?;
                let mut a = f.builder();
                a.arg(&g)
                    .arg(&order)
                    .arg(&starts)
                    .arg(&rows)
                    .arg(&mut out)
                    .arg(&d32);
                // SAFETY: matches `embedding_grad_<T>` (g, u32 order, starts, uniq read-only,
                // out written, int dim); block u < uniq reads starts[u..=u+1] (uniq + 1 entries),
                // the positions order[starts[u]..starts[u+1]] < count (rows of g, `count * dim`)
                // and writes row uniq[u] < n of out (`n * dim`); the plan was built so.
                unsafe { a.launch(rows_config(uniq, dim)?) }.w()?;
                counted();
            }
            Ok((T::wrap_cuda_slice(out, dev.clone()), Shape::from((n, dim))))
        })
    })
}

/// Cross-entropy over rows of `c` logits on the GPU: the targets (`[N]`, i64, on the logits'
/// device), label smoothing and an ignored index, the mean over the `counted` rows that are not
/// ignored.
pub(super) struct CrossEntropyCuda {
    targets: Tensor,
    eps: f32,
    ignore: Option<i64>,
    counted: usize,
}

impl CrossEntropyCuda {
    pub(super) fn new(
        targets: Tensor,
        options: super::CrossEntropyOptions,
        counted: usize,
    ) -> Self {
        CrossEntropyCuda {
            targets,
            eps: options.label_smoothing as f32,
            ignore: options.ignore_index,
            counted,
        }
    }
}

impl CustomOp1 for CrossEntropyCuda {
    fn name(&self) -> &'static str {
        "accelerate-rs-cross-entropy (CUDA)"
    }

    fn cpu_fwd(
        &self,
        _: &candle_core::CpuStorage,
        _: &Layout,
    ) -> Result<(candle_core::CpuStorage, Shape)> {
        candle_core::bail!("{}: CUDA logits are expected", self.name())
    }

    fn cuda_fwd(&self, xs: &CudaStorage, xl: &Layout) -> Result<(CudaStorage, Shape)> {
        let op = self.name();
        let c = xl.dims().last().copied().unwrap_or(1).max(1);
        let rows = xl.shape().elem_count() / c;
        let dev = xs.device().clone();
        with_targets(&self.targets, rows, op, |t| {
            by_dtype!(xs.dtype(), op, |T, s| {
                let x = view::<T>(xs, xl, op)?;
                let mut out = output::<T>(&dev, 1)?;
                let mut losses = output::<f32>(&dev, rows.max(1))?;
                let (has_ignore, ignore) =
                    (i32::from(self.ignore.is_some()), self.ignore.unwrap_or(0));
                if rows > 0 {
                    let f = func!(dev, format!("ce_rows_{s}"));
                    let c32 = as_i32(c, "classes")?;
                    let mut a = f.builder();
                    a.arg(&x)
                        .arg(&t)
                        .arg(&mut losses)
                        .arg(&c32)
                        .arg(&self.eps)
                        .arg(&has_ignore)
                        .arg(&ignore);
                    // SAFETY: matches `ce_rows_<T>` (logits and i64 targets read-only, f32 losses
                    // written, int c, float eps, int has_ignore, long long ignore); logits hold
                    // `rows * c` elements, targets and losses `rows`; every target was checked to be
                    // in 0..c or the ignored value (the kernel also guards the read).
                    unsafe { a.launch(rows_config(rows, c)?) }.w()?;
                    counted();
                }
                let f = func!(dev, format!("ce_mean_{s}"));
                let (rows64, counted_f) = (rows as i64, self.counted as f32);
                let mut a = f.builder();
                a.arg(&losses).arg(&mut out).arg(&rows64).arg(&counted_f);
                let cfg = LaunchConfig {
                    grid_dim: (1, 1, 1),
                    block_dim: (1024, 1, 1),
                    shared_mem_bytes: 0,
                };
                // SAFETY: matches `ce_mean_<T>` (f32 losses, one output element, long long rows,
                // float counted); it reads `rows` losses and thread 0 writes out[0].
                unsafe { a.launch(cfg) }.w()?;
                counted();
                Ok((T::wrap_cuda_slice(out, dev.clone()), Shape::from(())))
            })
        })
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let grad = grad.to_dtype(arg.dtype())?.flatten_all()?.contiguous()?;
        let op = CrossEntropyCudaGrad {
            targets: self.targets.clone(),
            eps: self.eps,
            ignore: self.ignore,
            inv_counted: 1.0 / self.counted as f32,
        };
        Ok(Some(arg.contiguous()?.apply_op2_no_bwd(&grad, &op)?))
    }
}

/// The gradient of [`CrossEntropyCuda`] for its logits, from the upstream gradient (a scalar read
/// on the device: no host round trip).
struct CrossEntropyCudaGrad {
    targets: Tensor,
    eps: f32,
    ignore: Option<i64>,
    inv_counted: f32,
}

impl CustomOp2 for CrossEntropyCudaGrad {
    fn name(&self) -> &'static str {
        "accelerate-rs-cross-entropy-backward (CUDA)"
    }

    fn cpu_fwd(
        &self,
        _: &candle_core::CpuStorage,
        _: &Layout,
        _: &candle_core::CpuStorage,
        _: &Layout,
    ) -> Result<(candle_core::CpuStorage, Shape)> {
        candle_core::bail!("{}: CUDA logits are expected", self.name())
    }

    fn cuda_fwd(
        &self,
        xs: &CudaStorage,
        xl: &Layout,
        gs: &CudaStorage,
        gl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let op = self.name();
        let c = xl.dims().last().copied().unwrap_or(1).max(1);
        let n = xl.shape().elem_count();
        let rows = n / c;
        let dev = xs.device().clone();
        with_targets(&self.targets, rows, op, |t| {
            by_dtype!(xs.dtype(), op, |T, s| {
                let (x, g) = (view::<T>(xs, xl, op)?, view::<T>(gs, gl, op)?);
                if g.len() != 1 {
                    candle_core::bail!(
                        "{op}: the upstream gradient has {} elements, not 1",
                        g.len()
                    );
                }
                let mut dx = output::<T>(&dev, n)?;
                if rows > 0 {
                    let f = func!(dev, format!("ce_bwd_{s}"));
                    let c32 = as_i32(c, "classes")?;
                    let (has_ignore, ignore) =
                        (i32::from(self.ignore.is_some()), self.ignore.unwrap_or(0));
                    let mut a = f.builder();
                    a.arg(&x)
                        .arg(&t)
                        .arg(&g)
                        .arg(&mut dx)
                        .arg(&c32)
                        .arg(&self.eps);
                    a.arg(&has_ignore).arg(&ignore).arg(&self.inv_counted);
                    // SAFETY: matches `ce_bwd_<T>` (logits, i64 targets, one-element upstream
                    // gradient read-only, dx written, int c, float eps, int has_ignore, long long
                    // ignore, float inv_counted); logits and dx hold `rows * c` elements, targets
                    // `rows`; each block touches its own row.
                    unsafe { a.launch(rows_config(rows, c)?) }.w()?;
                    counted();
                }
                Ok((T::wrap_cuda_slice(dx, dev.clone()), xl.shape().clone()))
            })
        })
    }
}
