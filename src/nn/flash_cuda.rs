//! The CUDA path of [`flash_attention`](super::flash_attention) (`cuda` builds): the kernels of
//! `flash.cu` (forward, the query gradient, the key and value gradients; a warp per row, nothing
//! of size `T_q × T_k` stored), compiled with NVRTC as a module of their own at first use. Proven
//! against the CPU path on an H100 (`scripts/gpu-smoke.sh` step 8), but a warp per query row
//! without tensor cores is slower than Candle's composed attention at training sizes (6x slower
//! steps for a 250M Llama at sequence 1024, BENCHMARKS.md): `flash.rs` takes this path only with
//! `ACCELERATE_RS_NN_CUDA_FLASH=1` (see [`super::cuda::use_flash_kernel`]). Also checked on the
//! CPU's emulation of CUDA (`tests/cuda_emulation/check_flash.cpp`) and compiled by NVRTC in CI
//! (`scripts/nvrtc_check.py`).

use std::sync::Mutex;

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::{CudaDType, CudaDevice, CudaStorage, WrapErr};
use candle_core::op::BackpropOp;
use candle_core::{CustomOp3, DType, Layout, Result, Shape, Storage, Tensor};
use cudarc::driver::{CudaView, DeviceRepr, LaunchConfig, PushKernelArg};

use super::flash_cpu::{Dims, Visibility};

const MODULE: &str = "accelerate_rs_flash";
/// The source NVRTC compiles: the shared element types and conversions, then the kernels.
const SOURCE: &str = concat!(include_str!("../cuda_prelude.cu"), include_str!("flash.cu"));
/// Rows (warps) per block, as `FLASH_WARPS` in `flash.cu`.
const WARPS: usize = 4;
/// The widest head the kernels take (`32 * FLASH_COLS`).
pub(super) const MAX_WIDTH: usize = 256;

/// The sizes, strides and switches of one call: `FlashParams` of `flash.cu`, field for field.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct FlashParams {
    qs: [i64; 3],
    ks: [i64; 3],
    vs: [i64; 3],
    b: i32,
    h: i32,
    rep: i32,
    tq: i32,
    tk: i32,
    d: i32,
    dv: i32,
    off: i32,
    ranges_per_batch: i32,
    has_ids: i32,
    has_pad: i32,
    scale: f32,
}

// SAFETY: plain data with the C layout of `FlashParams` in flash.cu (`#[repr(C)]`, the same
// fields in the same order: nine 64-bit integers, eleven 32-bit integers, one float), passed by
// value to the kernels.
unsafe impl DeviceRepr for FlashParams {}

/// The masks on the device: per query row its key range, per key the query rows that may see
/// it (a superset), the document ids and the padding (a one-element placeholder when absent).
struct Masks {
    ranges: Tensor,
    key_ranges: Tensor,
    ids: Tensor,
    pad: Tensor,
    per_batch: bool,
    has_ids: bool,
    has_pad: bool,
    off: usize,
}

/// For every key, the query rows `[lo, hi)` that may see it, from the rows' key ranges: where
/// the ranges' starts and ends never decrease along the rows (causal, windows, documents in
/// order) the rows between the first that ends after the key and the last that starts at or
/// before it; otherwise every row. Flat `(lo, hi)` pairs.
fn key_ranges(ranges: &[(usize, usize)], tk: usize) -> Vec<i64> {
    let monotone = ranges
        .windows(2)
        .all(|w| w[0].0 <= w[1].0 && w[0].1 <= w[1].1);
    let mut out = Vec::with_capacity(2 * tk);
    for j in 0..tk {
        let (lo, hi) = if monotone {
            let lo = ranges.partition_point(|r| r.1 <= j);
            (lo, ranges.partition_point(|r| r.0 <= j).max(lo))
        } else {
            (0, ranges.len())
        };
        out.extend([lo as i64, hi as i64]);
    }
    out
}

impl Masks {
    fn new(dims: Dims, vis: &Visibility, dev: &candle_core::Device) -> Result<Masks> {
        let parts = vis.parts();
        let flat = |r: &[(usize, usize)]| -> Vec<i64> {
            r.iter().flat_map(|&(a, b)| [a as i64, b as i64]).collect()
        };
        let ranges = flat(parts.ranges);
        let mut keys = Vec::new();
        for rows in parts.ranges.chunks(dims.tq.max(1)) {
            keys.extend(key_ranges(rows, dims.tk));
        }
        let ids = parts.ids.map_or_else(|| vec![0i64], <[i64]>::to_vec);
        let pad = parts.pad.map_or_else(|| vec![0u8], <[u8]>::to_vec);
        let tensor = |v: Vec<i64>| Tensor::new(v, dev);
        Ok(Masks {
            ranges: tensor(ranges)?,
            key_ranges: tensor(keys)?,
            ids: tensor(ids)?,
            pad: Tensor::new(pad, dev)?,
            per_batch: parts.per_batch,
            has_ids: parts.ids.is_some(),
            has_pad: parts.pad.is_some(),
            off: parts.off,
        })
    }
}

/// `v` as an i32 kernel argument, or an error naming `what`.
fn int(v: usize, what: &str) -> Result<i32> {
    i32::try_from(v).map_err(|_| {
        candle_core::Error::Msg(format!(
            "accelerate-rs-flash-attention (CUDA): {what} {v} is too large for the kernels"
        ))
    })
}

/// The token, head and batch strides of a 4-dimensional layout whose columns are contiguous.
fn strides(l: &Layout) -> Result<[i64; 3]> {
    match l.stride() {
        &[sb, sh, st, 1] => Ok([sb as i64, sh as i64, st as i64]),
        s => candle_core::bail!(
            "accelerate-rs-flash-attention (CUDA): contiguous columns expected, strides {s:?}"
        ),
    }
}

/// `x` with contiguous columns (the last dimension), copied only if it has not.
fn columns_contiguous(x: &Tensor) -> Result<Tensor> {
    if x.stride().last() == Some(&1) {
        Ok(x.clone())
    } else {
        x.contiguous()
    }
}

/// The forward pass on the GPU (the kernels checked to be on, widths at most [`MAX_WIDTH`]).
pub(super) fn forward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    dims: Dims,
    scale: f32,
    vis: &Visibility,
) -> Result<Tensor> {
    let op = FlashCuda {
        dims,
        scale,
        masks: Masks::new(dims, vis, q.device())?,
        lse: Mutex::new(None),
    };
    let [q, k, v] = [q, k, v].map(columns_contiguous);
    q?.apply_op3(&k?, &v?, op)
}

/// The op on the GPU: the sizes, the scale, the masks on the device, and the forward pass's
/// log-sum-exp per query row (`[B · H · T_q]`, f32) for the backward pass.
struct FlashCuda {
    dims: Dims,
    scale: f32,
    masks: Masks,
    lse: Mutex<Option<Tensor>>,
}

/// What the key/value gradient kernel reads: q, k, v and dy, the log-sum-exp and δ per query
/// row, the query rows' key ranges, the keys' row ranges, the document ids, the padding.
struct DkvViews<'a, T> {
    x: [&'a CudaView<'a, T>; 4],
    lse: &'a CudaView<'a, f32>,
    delta: &'a cudarc::driver::CudaSlice<f32>,
    masks: [&'a CudaView<'a, i64>; 3],
    pad: &'a CudaView<'a, u8>,
}

/// Kernel `$name` of the flash module on `$dev`, compiled and loaded at first use. A macro:
/// Candle does not export the type of the loaded function.
macro_rules! kernel {
    ($dev:expr, $name:expr) => {{
        let ptx = crate::cuda_ptx::ptx(MODULE, SOURCE, &$dev).map_err(candle_core::Error::Msg)?;
        $dev.get_or_load_custom_func(&$name, MODULE, ptx)?
    }};
}

/// A view of `t`'s CUDA storage from its start offset, of element type `T`.
fn view<'a, T: CudaDType>(s: &'a CudaStorage, l: &Layout) -> Result<CudaView<'a, T>> {
    Ok(T::as_cuda_slice(s)?.slice(l.start_offset()..))
}

/// The CUDA storages (and layouts) of `tensors`, for the closure.
fn with_storages<R>(
    tensors: &[&Tensor],
    f: impl FnOnce(&[(&CudaStorage, &Layout)]) -> Result<R>,
) -> Result<R> {
    let guards: Vec<_> = tensors.iter().map(|t| t.storage_and_layout()).collect();
    let mut out = Vec::with_capacity(guards.len());
    for (s, l) in &guards {
        match &**s {
            Storage::Cuda(s) => out.push((s, *l)),
            _ => candle_core::bail!("accelerate-rs-flash-attention (CUDA): GPU tensors expected"),
        }
    }
    f(&out)
}

/// Allocates `n` elements that the kernel launched next writes in full.
fn output<T: DeviceRepr>(dev: &CudaDevice, n: usize) -> Result<cudarc::driver::CudaSlice<T>> {
    // SAFETY: every caller launches a kernel that writes all `n` elements (one per row and
    // column, rows and columns covered by the grid) before anything reads them.
    unsafe { dev.alloc::<T>(n.max(1)) }
}

/// A launch of one warp per row over `rows` rows.
fn rows_config(rows: usize) -> Result<LaunchConfig> {
    let blocks = u32::try_from(rows.div_ceil(WARPS)).map_err(|_| {
        candle_core::Error::Msg(format!("accelerate-rs-flash-attention: {rows} rows"))
    })?;
    Ok(LaunchConfig {
        grid_dim: (blocks.max(1), 1, 1),
        block_dim: (32 * WARPS as u32, 1, 1),
        shared_mem_bytes: 0,
    })
}

impl FlashCuda {
    /// The kernels' parameters for inputs laid out as `l`.
    fn params(&self, l: [&Layout; 3]) -> Result<FlashParams> {
        let Dims {
            b,
            h,
            hkv,
            tq,
            tk,
            d,
            dv,
        } = self.dims;
        let m = &self.masks;
        Ok(FlashParams {
            qs: strides(l[0])?,
            ks: strides(l[1])?,
            vs: strides(l[2])?,
            b: int(b, "batch")?,
            h: int(h, "heads")?,
            rep: int(h / hkv, "heads per key/value head")?,
            tq: int(tq, "queries")?,
            tk: int(tk, "keys")?,
            d: int(d, "head width")?,
            dv: int(dv, "value width")?,
            off: int(m.off, "key offset")?,
            ranges_per_batch: i32::from(m.per_batch),
            has_ids: i32::from(m.has_ids),
            has_pad: i32::from(m.has_pad),
            scale: self.scale,
        })
    }

    /// The forward kernel in element type `T` (`suffix` names it).
    fn launch_fwd<T: CudaDType + DeviceRepr>(
        &self,
        suffix: &str,
        x: [(&CudaStorage, &Layout); 3],
    ) -> Result<(CudaStorage, Shape)> {
        let Dims { b, h, tq, dv, .. } = self.dims;
        let dev = x[0].0.device().clone();
        let p = self.params([x[0].1, x[1].1, x[2].1])?;
        let (mut y, mut lse) = (
            output::<T>(&dev, b * h * tq * dv)?,
            output::<f32>(&dev, b * h * tq)?,
        );
        let m = &self.masks;
        with_storages(&[&m.ranges, &m.ids, &m.pad], |s| {
            let (q, k, v) = (
                view::<T>(x[0].0, x[0].1)?,
                view::<T>(x[1].0, x[1].1)?,
                view::<T>(x[2].0, x[2].1)?,
            );
            let (ranges, ids, pad) = (
                view::<i64>(s[0].0, s[0].1)?,
                view::<i64>(s[1].0, s[1].1)?,
                view::<u8>(s[2].0, s[2].1)?,
            );
            let f = kernel!(dev, format!("flash_fwd_{suffix}"));
            let mut a = f.builder();
            a.arg(&q).arg(&k).arg(&v).arg(&mut y).arg(&mut lse);
            a.arg(&ranges).arg(&ids).arg(&pad).arg(&p);
            // SAFETY: matches `flash_fwd_<T>` (q, k, v read at their strides, y and lse written,
            // the masks read, the parameters by value); the inputs were checked to hold
            // [B, H, T_q, D] / [B, H_kv, T_k, D] / [B, H_kv, T_k, D_v] at those strides by
            // `flash_attention`, y holds B·H·T_q·D_v and lse B·H·T_q elements, the masks the
            // sizes `Masks::new` gave them; each warp writes its own row.
            unsafe { a.launch(rows_config(b * h * tq)?) }.w()?;
            super::cuda::counted();
            Ok(())
        })?;
        let lse = Storage::Cuda(f32::wrap_cuda_slice(lse, dev.clone()));
        let lse = Tensor::from_storage(lse, b * h * tq, BackpropOp::none(), false);
        *self.lse.lock().unwrap_or_else(|p| p.into_inner()) = Some(lse);
        Ok((T::wrap_cuda_slice(y, dev), Shape::from((b, h, tq, dv))))
    }

    /// The backward kernels in element type `T`: the gradients of q, k and v (contiguous) from
    /// the output `y` and its gradient `dy` (contiguous).
    fn launch_bwd<T: CudaDType + DeviceRepr>(
        &self,
        suffix: &str,
        x: [&Tensor; 3],
        y: &Tensor,
        dy: &Tensor,
        lse: &Tensor,
    ) -> Result<[Tensor; 3]> {
        let Dims {
            b,
            h,
            hkv,
            tq,
            tk,
            d,
            dv,
        } = self.dims;
        let m = &self.masks;
        let all = [
            x[0],
            x[1],
            x[2],
            y,
            dy,
            lse,
            &m.ranges,
            &m.key_ranges,
            &m.ids,
            &m.pad,
        ];
        with_storages(&all, |s| {
            let dev = s[0].0.device().clone();
            let p = self.params([s[0].1, s[1].1, s[2].1])?;
            let t = |i: usize| view::<T>(s[i].0, s[i].1);
            let (q, k, v, y, dy) = (t(0)?, t(1)?, t(2)?, t(3)?, t(4)?);
            let lse = view::<f32>(s[5].0, s[5].1)?;
            let i64s = |i: usize| view::<i64>(s[i].0, s[i].1);
            let (ranges, keys, ids) = (i64s(6)?, i64s(7)?, i64s(8)?);
            let pad = view::<u8>(s[9].0, s[9].1)?;
            let mut delta = output::<f32>(&dev, b * h * tq)?;
            let mut dq = output::<T>(&dev, b * h * tq * d)?;
            let f = kernel!(dev, format!("flash_bwd_dq_{suffix}"));
            let mut a = f.builder();
            a.arg(&q)
                .arg(&k)
                .arg(&v)
                .arg(&y)
                .arg(&dy)
                .arg(&lse)
                .arg(&mut delta)
                .arg(&mut dq);
            a.arg(&ranges).arg(&ids).arg(&pad).arg(&p);
            // SAFETY: matches `flash_bwd_dq_<T>` (q, k, v, y, dy, lse and the masks read, delta
            // and dq written, the parameters by value); sizes as in the forward pass, y and dy
            // contiguous [B, H, T_q, D_v], delta B·H·T_q and dq B·H·T_q·D elements, each warp
            // writing its own row.
            unsafe { a.launch(rows_config(b * h * tq)?) }.w()?;
            super::cuda::counted();
            let views = DkvViews {
                x: [&q, &k, &v, &dy],
                lse: &lse,
                delta: &delta,
                masks: [&ranges, &keys, &ids],
                pad: &pad,
            };
            let (dk, dvv) = self.launch_dkv(suffix, &dev, &views, &p)?;
            let wrap = |s: cudarc::driver::CudaSlice<T>, shape: (usize, usize, usize, usize)| {
                let st = Storage::Cuda(T::wrap_cuda_slice(s, dev.clone()));
                Tensor::from_storage(st, shape, BackpropOp::none(), false)
            };
            Ok([
                wrap(dq, (b, h, tq, d)),
                wrap(dk, (b, hkv, tk, d)),
                wrap(dvv, (b, hkv, tk, dv)),
            ])
        })
    }

    /// The key/value gradient kernel in element type `T`: `(dk, dv)`.
    fn launch_dkv<T: CudaDType + DeviceRepr>(
        &self,
        suffix: &str,
        dev: &CudaDevice,
        x: &DkvViews<'_, T>,
        p: &FlashParams,
    ) -> Result<(cudarc::driver::CudaSlice<T>, cudarc::driver::CudaSlice<T>)> {
        let Dims {
            b, hkv, tk, d, dv, ..
        } = self.dims;
        let (mut dk, mut dvv) = (
            output::<T>(dev, b * hkv * tk * d)?,
            output::<T>(dev, b * hkv * tk * dv)?,
        );
        let f = kernel!(dev, format!("flash_bwd_dkv_{suffix}"));
        let mut a = f.builder();
        let [q, k, v, dy] = x.x;
        a.arg(q).arg(k).arg(v).arg(dy).arg(x.lse).arg(x.delta);
        a.arg(&mut dk).arg(&mut dvv);
        let [ranges, keys, ids] = x.masks;
        a.arg(ranges).arg(keys).arg(ids).arg(x.pad).arg(p);
        // SAFETY: matches `flash_bwd_dkv_<T>` (inputs, lse, delta and the masks read, dk and dv
        // written, the parameters by value); key_ranges holds a pair per key (per batch entry
        // with documents), dk and dv B·H_kv·T_k·D and ·D_v elements, each warp writing its own
        // key row; queued after the kernel that wrote delta on the same stream.
        unsafe { a.launch(rows_config(b * hkv * tk)?) }.w()?;
        super::cuda::counted();
        Ok((dk, dvv))
    }
}

impl CustomOp3 for FlashCuda {
    fn name(&self) -> &'static str {
        "accelerate-rs-flash-attention (CUDA)"
    }

    fn cpu_fwd(
        &self,
        _: &candle_core::CpuStorage,
        _: &Layout,
        _: &candle_core::CpuStorage,
        _: &Layout,
        _: &candle_core::CpuStorage,
        _: &Layout,
    ) -> Result<(candle_core::CpuStorage, Shape)> {
        candle_core::bail!("{}: GPU tensors are expected", self.name())
    }

    fn cuda_fwd(
        &self,
        s1: &CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
        s3: &CudaStorage,
        l3: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let x = [(s1, l1), (s2, l2), (s3, l3)];
        match s1.dtype() {
            DType::F32 => self.launch_fwd::<f32>("f32", x),
            DType::BF16 => self.launch_fwd::<half::bf16>("bf16", x),
            DType::F16 => self.launch_fwd::<half::f16>("f16", x),
            other => candle_core::bail!("{}: no kernel for {other:?}", self.name()),
        }
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let Some(lse) = self.lse.lock().unwrap_or_else(|p| p.into_inner()).clone() else {
            candle_core::bail!("{}: backward before forward", self.name());
        };
        let (y, dy) = (res.contiguous()?, grad.to_dtype(res.dtype())?.contiguous()?);
        let x = [q, k, v];
        let [gq, gk, gv] = match q.dtype() {
            DType::F32 => self.launch_bwd::<f32>("f32", x, &y, &dy, &lse)?,
            DType::BF16 => self.launch_bwd::<half::bf16>("bf16", x, &y, &dy, &lse)?,
            DType::F16 => self.launch_bwd::<half::f16>("f16", x, &y, &dy, &lse)?,
            other => candle_core::bail!("{}: no kernel for {other:?}", self.name()),
        };
        Ok((Some(gq), Some(gk), Some(gv)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_ranges_cover_the_rows_that_see_each_key() {
        // Causal, 4 rows over 4 keys: key j is seen by rows j..4.
        let causal = [(0, 1), (0, 2), (0, 3), (0, 4)];
        assert_eq!(key_ranges(&causal, 4), [0, 4, 1, 4, 2, 4, 3, 4]);
        // A window of 2: key j by rows j..j + 2.
        let window = [(0, 1), (0, 2), (1, 3), (2, 4)];
        assert_eq!(key_ranges(&window, 4), [0, 2, 1, 3, 2, 4, 3, 4]);
        // Not monotone (documents out of order): every row.
        let docs = [(2, 3), (0, 2), (0, 2)];
        assert_eq!(key_ranges(&docs, 3), [0, 3, 0, 3, 0, 3]);
    }
}
