//! The f32 matrix products of the fused linear ops, straight through `gemm` into a fresh
//! buffer that is written once. Candle's CPU `matmul` zero-fills its output before `gemm`
//! overwrites it: a wasted pass over every product of a training step (the layers' outputs and
//! both gradients of every weight).

use candle_core::{Result, Storage, Tensor};

/// A matrix in a slice: element `(i, j)` at `i · rs + j · cs`.
#[derive(Clone, Copy)]
pub(super) struct Operand<'a> {
    pub(super) data: &'a [f32],
    pub(super) rs: usize,
    pub(super) cs: usize,
}

impl Operand<'_> {
    /// Whether all `rows × cols` elements lie in the slice.
    fn holds(&self, rows: usize, cols: usize) -> bool {
        let last = (rows - 1)
            .checked_mul(self.rs)
            .zip((cols - 1).checked_mul(self.cs))
            .and_then(|(a, b)| a.checked_add(b));
        last.is_some_and(|last| last < self.data.len())
    }
}

/// `gemm`'s parallelism for Candle's thread count.
pub(super) fn parallelism() -> gemm::Parallelism {
    match candle_core::utils::get_num_threads() {
        threads if threads > 1 => gemm::Parallelism::Rayon(threads),
        _ => gemm::Parallelism::None,
    }
}

/// Refuses operands that do not hold `m × k` and `k × n` elements, or an empty product.
fn check(m: usize, n: usize, k: usize, lhs: &Operand, rhs: &Operand) -> Result<()> {
    if m == 0 || n == 0 || k == 0 || !lhs.holds(m, k) || !rhs.holds(k, n) {
        candle_core::bail!(
            "accelerate-rs-linear: operands of {} and {} elements for {m} x {k} by {k} x {n}",
            lhs.data.len(),
            rhs.data.len()
        );
    }
    Ok(())
}

/// Above this many rows, a product whose left operand is read down its columns (`lhs.rs == 1`:
/// a weight's gradient `gᵀ x`, with one row per output feature) is made in blocks of rows.
/// `gemm` transposes such a product and packs the whole `[k, m]` gradient as its right operand,
/// in one buffer as large as the output: for a language model's head (`m` = the vocabulary) the
/// blocks ran 10-12% faster on an AVX-512 core (`BENCHMARKS.md`, "Kernels on the caller's
/// thread, the head's weight gradient in blocks").
const ROW_BLOCK_ABOVE: usize = 2048;
/// The most rows of one block; a product's blocks are of one size (rounded up to 64), the last
/// one shorter.
const ROW_BLOCK: usize = 1536;

/// `(start, end)` of the row blocks of an `m`-row product read as [`ROW_BLOCK_ABOVE`] says: one
/// block `(0, m)` unless `lhs_rs == 1` and `m > ROW_BLOCK_ABOVE`.
fn row_blocks(m: usize, lhs_rs: usize) -> impl Iterator<Item = (usize, usize)> {
    let size = if lhs_rs == 1 && m > ROW_BLOCK_ABOVE {
        m.div_ceil(m.div_ceil(ROW_BLOCK)).next_multiple_of(64)
    } else {
        m.max(1)
    };
    (0..m).step_by(size).map(move |r0| (r0, (r0 + size).min(m)))
}

/// `dst = lhs · rhs`, or `dst += lhs · rhs` when `add`, for a row-major `m × n` `dst`, one
/// `gemm` call per row block of [`row_blocks`].
///
/// # Safety
/// The operands passed [`check`]; `dst` has room for `m × n` elements, overlaps neither operand
/// and nobody else reads or writes it meanwhile; with `add` its elements are initialized.
unsafe fn gemm_into(
    m: usize,
    n: usize,
    k: usize,
    dst: *mut f32,
    add: bool,
    lhs: Operand,
    rhs: Operand,
) {
    for (r0, r1) in row_blocks(m, lhs.rs) {
        // Rows `r0..r1` of `lhs` start at `r0 · rs`, inside the slice (`check`: `r0 < m`).
        let block = &lhs.data[r0 * lhs.rs..];
        // SAFETY: the caller's guarantees are `gemm`'s (in-bounds operands, an exclusive
        // destination), and rows `r0..r1` of `dst` (row-major, `n` wide) and of `lhs` lie within
        // what they cover for all `m` rows. With `read_dst` false `gemm` never reads the
        // destination (its `alpha` is set to zero, and `k > 0`) and writes each of its elements.
        unsafe {
            gemm::gemm(
                r1 - r0,
                n,
                k,
                dst.add(r0 * n),
                1,
                n as isize,
                add,
                block.as_ptr(),
                lhs.cs as isize,
                lhs.rs as isize,
                rhs.data.as_ptr(),
                rhs.cs as isize,
                rhs.rs as isize,
                if add { 1.0 } else { 0.0 },
                1.0,
                false,
                false,
                false,
                parallelism(),
            )
        }
    }
}

/// `lhs · rhs` (`m × k` by `k × n`) as a new row-major `m × n` buffer, `m, n, k > 0`.
pub(super) fn product(
    m: usize,
    n: usize,
    k: usize,
    lhs: Operand,
    rhs: Operand,
) -> Result<Vec<f32>> {
    check(m, n, k, &lhs, &rhs)?;
    let len = m * n;
    let mut y: Vec<f32> = Vec::with_capacity(len);
    // SAFETY: checked operands; `y` is a fresh buffer with room for `m × n` elements, which
    // `gemm_into` writes without reading (not `add`), so all are initialized when the length
    // is set.
    unsafe {
        gemm_into(m, n, k, y.as_mut_ptr(), false, lhs, rhs);
        y.set_len(len);
    }
    Ok(y)
}

/// `dst += lhs · rhs` for a row-major `m × n` `dst`.
pub(super) fn product_add(
    dst: &mut [f32],
    m: usize,
    n: usize,
    k: usize,
    lhs: Operand,
    rhs: Operand,
) -> Result<()> {
    check(m, n, k, &lhs, &rhs)?;
    if dst.len() != m * n {
        candle_core::bail!(
            "accelerate-rs-linear: {} destination elements for {m} x {n}",
            dst.len()
        );
    }
    // SAFETY: checked operands and destination size; `dst` is borrowed exclusively, so it
    // overlaps neither (shared) operand.
    unsafe { gemm_into(m, n, k, dst.as_mut_ptr(), true, lhs, rhs) };
    Ok(())
}

/// `x` `[rows, k]` and `W` `[n, k]` (both row-major) as the operands of `x Wᵀ`: `Wᵀ` is read
/// from `W` with row stride 1 and column stride `k`.
fn x_and_wt<'a>(x: &'a [f32], w: &'a [f32], k: usize) -> (Operand<'a>, Operand<'a>) {
    (
        Operand {
            data: x,
            rs: k,
            cs: 1,
        },
        Operand {
            data: w,
            rs: 1,
            cs: k,
        },
    )
}

/// `x Wᵀ` for `x` `[rows, k]` and `W` `[n, k]`: a new `[rows, n]` buffer (a linear layer's
/// output without bias).
pub(super) fn times_wt(x: &[f32], w: &[f32], rows: usize, n: usize, k: usize) -> Result<Vec<f32>> {
    let (x, wt) = x_and_wt(x, w, k);
    product(rows, n, k, x, wt)
}

/// `y += x Wᵀ` for `y` `[rows, n]`, `x` `[rows, k]` and `W` `[n, k]`.
pub(super) fn add_times_wt(
    y: &mut [f32],
    x: &[f32],
    w: &[f32],
    rows: usize,
    n: usize,
    k: usize,
) -> Result<()> {
    let (x, wt) = x_and_wt(x, w, k);
    product_add(y, rows, n, k, x, wt)
}

/// `a · b` for 2-D tensors, where `a` is `a_t`-transposed when asked (`aᵀ · b`): through
/// [`product`] when both are contiguous f32 CPU tensors, else Candle's `matmul`.
pub(super) fn matmul(a: &Tensor, a_t: bool, b: &Tensor) -> Result<Tensor> {
    let composed = || match a_t {
        true => a.t()?.matmul(b),
        false => a.matmul(b),
    };
    let (Ok((ar, ac)), Ok((br, bc))) = (a.dims2(), b.dims2()) else {
        return composed();
    };
    let (m, k) = if a_t { (ac, ar) } else { (ar, ac) };
    if !a.device().is_cpu() || !b.device().is_cpu() || k != br || m * bc * k == 0 {
        return composed();
    }
    let (sa, la) = a.storage_and_layout();
    let (sb, lb) = b.storage_and_layout();
    let (
        Storage::Cpu(candle_core::CpuStorage::F32(da)),
        Storage::Cpu(candle_core::CpuStorage::F32(db)),
    ) = (&*sa, &*sb)
    else {
        drop((sa, sb));
        return composed();
    };
    let (Some((a0, a1)), Some((b0, b1))) = (la.contiguous_offsets(), lb.contiguous_offsets())
    else {
        drop((sa, sb));
        return composed();
    };
    // Row-major `a` is `[ar, ac]`: its transpose reads with row stride 1, column stride `ac`.
    let (rs, cs) = if a_t { (1, ac) } else { (ac, 1) };
    let lhs = Operand {
        data: &da[a0..a1],
        rs,
        cs,
    };
    let rhs = Operand {
        data: &db[b0..b1],
        rs: bc,
        cs: 1,
    };
    let y = product(m, bc, k, lhs, rhs)?;
    drop((sa, sb));
    Tensor::from_vec(y, (m, bc), a.device())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn matches_candle_for_both_forms_and_odd_sizes() -> Result<()> {
        let dev = Device::Cpu;
        for (m, k, n) in [(1, 1, 1), (3, 5, 7), (17, 33, 9), (64, 70, 130)] {
            let a = Tensor::randn(0f32, 1.0, (m, k), &dev)?;
            let at = Tensor::randn(0f32, 1.0, (k, m), &dev)?;
            let b = Tensor::randn(0f32, 1.0, (k, n), &dev)?;
            for (got, want) in [
                (matmul(&a, false, &b)?, a.matmul(&b)?),
                (matmul(&at, true, &b)?, at.t()?.matmul(&b)?),
            ] {
                let diff = (got - want)?.abs()?.max_all()?.to_scalar::<f32>()?;
                assert!(diff < 1e-4, "{m}x{k}x{n}: {diff}");
            }
        }
        Ok(())
    }

    #[test]
    fn weight_gradients_in_row_blocks_match_one_product() -> Result<()> {
        let dev = Device::Cpu;
        // `gᵀ x` with more rows than ROW_BLOCK_ABOVE (uneven blocks) and at the threshold (one).
        for m in [ROW_BLOCK_ABOVE + 77, ROW_BLOCK_ABOVE] {
            let blocks: Vec<_> = row_blocks(m, 1).collect();
            assert_eq!(blocks.first().map(|b| b.0), Some(0));
            assert_eq!(blocks.last().map(|b| b.1), Some(m));
            assert!(blocks.windows(2).all(|w| w[0].1 == w[1].0));
            assert_eq!(blocks.len() > 1, m > ROW_BLOCK_ABOVE, "{m}: {blocks:?}");
            let g = Tensor::randn(0f32, 1.0, (5, m), &dev)?;
            let x = Tensor::randn(0f32, 1.0, (5, 3), &dev)?;
            let got = matmul(&g, true, &x)?;
            let want = g.t()?.matmul(&x)?;
            let diff = (got - want)?.abs()?.max_all()?.to_scalar::<f32>()?;
            assert!(diff < 1e-4, "{m}: {diff}");
            let mut acc = vec![1f32; m * 3];
            let (gd, xd) = (
                g.flatten_all()?.to_vec1::<f32>()?,
                x.flatten_all()?.to_vec1::<f32>()?,
            );
            let gt = Operand {
                data: &gd,
                rs: 1,
                cs: m,
            };
            let xs = Operand {
                data: &xd,
                rs: 3,
                cs: 1,
            };
            product_add(&mut acc, m, 3, 5, gt, xs)?;
            let want = (g.t()?.matmul(&x)? + 1.0)?
                .flatten_all()?
                .to_vec1::<f32>()?;
            let worst = acc
                .iter()
                .zip(&want)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(worst < 1e-4, "{m} (add): {worst}");
        }
        assert_eq!(row_blocks(8000, 1).count(), 6);
        assert_eq!(row_blocks(8000, 512).count(), 1);
        Ok(())
    }

    #[test]
    fn operands_too_short_are_refused() {
        let data = [0f32; 5];
        let op = Operand {
            data: &data,
            rs: 3,
            cs: 1,
        };
        assert!(product(2, 2, 3, op, op).is_err());
        let f64s = Tensor::new(&[[1f64, 2.0]], &Device::Cpu).and_then(|a| {
            let b = Tensor::new(&[[3f64], [4.0]], &Device::Cpu)?;
            matmul(&a, false, &b)?.to_vec2::<f64>()
        });
        assert_eq!(f64s.ok(), Some(vec![vec![11.0]]));
    }
}
