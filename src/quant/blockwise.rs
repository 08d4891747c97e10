//! The blockwise arithmetic of bitsandbytes' CPU backend, step for step in f32, so that its
//! results are bitsandbytes' bit for bit: the 4-bit quantizer (its portable PyTorch kernel), the
//! 8-bit quantizer of the double quantization (its C++ kernel, lookup table included), the mean
//! that offsets the block scales (PyTorch's CPU summation order) and the dequantizers.

use rayon::prelude::*;

use crate::par::Inline;

use super::codes::{Lut8, Rounding4};

/// Blocks quantized by one Rayon task.
const BLOCKS_PER_TASK: usize = 64;

/// Lanes of PyTorch's vectorized CPU float sum (`Vectorized<float>` of its reduction kernels).
const SUM_LANES: usize = 8;

/// The 4-bit codes of `x`, blocks of `blocksize` (even) values: `(packed, absmax)`, two codes a
/// byte (the first value in the high nibble), `ceil(len / 2)` bytes (an odd length's last low
/// nibble is the code of 0), and each block's largest magnitude.
///
/// As bitsandbytes' portable kernel: a full block's values are multiplied by `1 / max(absmax,
/// 1e-38)` and its absmax kept as found; the last, partial block's values are divided by its
/// absmax raised to at least 1e-38, which is the absmax kept; clamped to [-1, 1], then rounded by
/// [`Rounding4`].
pub(crate) fn quantize4(x: &[f32], blocksize: usize, rounding: &Rounding4) -> (Vec<u8>, Vec<f32>) {
    let n = x.len();
    let blocks = n.div_ceil(blocksize);
    let full = n / blocksize;
    let mut packed = vec![0u8; n.div_ceil(2)];
    let mut absmax = vec![0f32; blocks];
    let half = blocksize / 2;
    packed
        .par_chunks_mut(half * BLOCKS_PER_TASK)
        .inline_when_single()
        .zip(absmax.par_chunks_mut(BLOCKS_PER_TASK).inline_when_single())
        .zip(
            x.par_chunks(blocksize * BLOCKS_PER_TASK)
                .inline_when_single(),
        )
        .enumerate()
        .for_each(|(task, ((bytes, scales), xs))| {
            let first = task * BLOCKS_PER_TASK;
            for (j, ((bytes, scale), xs)) in bytes
                .chunks_mut(half)
                .zip(scales.iter_mut())
                .zip(xs.chunks(blocksize))
                .enumerate()
            {
                let m = xs.iter().fold(0f32, |m, v| max_nan(m, v.abs()));
                // A full block multiplies by the reciprocal; the partial last one divides.
                let (inv, div) = if first + j < full {
                    *scale = m;
                    (1.0 / m.max(1e-38), None)
                } else {
                    let m = m.max(1e-38);
                    *scale = m;
                    (0.0, Some(m))
                };
                let scaled = |v: f32| match div {
                    None => v * inv,
                    Some(m) => v / m,
                };
                let code = |v: f32| rounding.code(scaled(v).clamp(-1.0, 1.0));
                let zero = rounding.code(0.0);
                for (b, pair) in bytes.iter_mut().zip(xs.chunks(2)) {
                    let hi = code(pair[0]);
                    let lo = pair.get(1).map_or(zero, |&v| code(v));
                    *b = (hi << 4) | lo;
                }
            }
        });
    (packed, absmax)
}

/// `max(a, b)` that keeps a NaN, as PyTorch's `max` reduction does.
fn max_nan(a: f32, b: f32) -> f32 {
    if a.is_nan() || b.is_nan() {
        f32::NAN
    } else {
        a.max(b)
    }
}

/// The double quantization of the block scales `absmax`: their mean (the offset), then
/// `absmax - offset` quantized in blocks of `blocksize` with the 8-bit `lut`, as bitsandbytes'
/// C++ CPU kernel does (a block's absmax from 0 up; an all-zero block gets code 0; values
/// multiplied by `1 / absmax`). Returns `(codes, nested absmax, offset)`.
pub(crate) fn quantize_nested(
    absmax: &[f32],
    blocksize: usize,
    lut: &Lut8,
) -> (Vec<u8>, Vec<f32>, f32) {
    let offset = torch_mean(absmax);
    let centred: Vec<f32> = absmax.iter().map(|a| a - offset).collect();
    let mut codes = vec![0u8; centred.len()];
    let nested: Vec<f32> = codes
        .par_chunks_mut(blocksize)
        .inline_when_single()
        .zip(centred.par_chunks(blocksize).inline_when_single())
        .map(|(codes, xs)| {
            let m = xs.iter().fold(0f32, |m, v| m.max(v.abs()));
            if m != 0.0 {
                let inv = 1.0 / m;
                for (c, v) in codes.iter_mut().zip(xs) {
                    *c = lut.code(v * inv);
                }
            }
            m
        })
        .collect();
    (codes, nested, offset)
}

/// The block scales of a double-quantized state: `code[c] · nested[i / blocksize] + offset` for
/// the `i`-th code `c` (a product and a sum, each rounded to f32, as bitsandbytes computes them).
pub(crate) fn dequantize_nested(
    codes: &[u8],
    nested: &[f32],
    code: &[f32; 256],
    blocksize: usize,
    offset: f32,
) -> Vec<f32> {
    codes
        .iter()
        .enumerate()
        .map(|(i, &c)| code[c as usize] * nested[i / blocksize] + offset)
        .collect()
}

/// Fills `out` with the dequantized values of the flat elements `start..start + out.len()` of a
/// 4-bit weight: `round(code[nibble] · scale(block))`, with `packed` two codes a byte (high
/// nibble first) and `scale(b)` the scale of block `b` (`blocksize` elements, even). `round`
/// takes each f32 product to the value the caller computes with (a dtype's rounding).
pub(crate) fn dequantize4_into(
    packed: &[u8],
    code: &[f32; 16],
    blocksize: usize,
    scale: impl Fn(usize) -> f32,
    round: impl Fn(f32) -> f32,
    start: usize,
    out: &mut [f32],
) {
    let end = start + out.len();
    let mut e = start;
    let mut o = 0;
    while e < end {
        let b = e / blocksize;
        let stop = ((b + 1) * blocksize).min(end);
        let s = scale(b);
        // The block's 16 values, each product rounded once.
        let lut: [f32; 16] = std::array::from_fn(|i| round(code[i] * s));
        let nibble = |e: usize| (packed[e / 2] >> if e.is_multiple_of(2) { 4 } else { 0 }) & 0x0f;
        if e % 2 == 1 {
            out[o] = lut[nibble(e) as usize];
            e += 1;
            o += 1;
        }
        let pairs = (stop - e) / 2;
        let bytes = &packed[e / 2..e / 2 + pairs];
        for (dst, &byte) in out[o..o + 2 * pairs].chunks_exact_mut(2).zip(bytes) {
            dst[0] = lut[(byte >> 4) as usize];
            dst[1] = lut[(byte & 0x0f) as usize];
        }
        e += 2 * pairs;
        o += 2 * pairs;
        if e < stop {
            out[o] = lut[nibble(e) as usize];
            e += 1;
            o += 1;
        }
    }
}

/// `x.mean()` as PyTorch computes it on the CPU for a contiguous f32 vector in one thread (which
/// it uses below 32,768 elements): the cascade sum of `SumKernel.cpp` (8-lane vectors summed four
/// at a time into levels of 16, the leftover elements one by one, then the lanes in order),
/// divided by the count in f32. Above 32,768 elements PyTorch splits the sum across its threads,
/// so its own result depends on their number; this one is the one-thread result.
pub(crate) fn torch_mean(x: &[f32]) -> f32 {
    torch_sum(x) / x.len() as f32
}

/// The sum of [`torch_mean`].
fn torch_sum(x: &[f32]) -> f32 {
    let n = x.len();
    if n < SUM_LANES {
        return row_sum(n, 0f32, |a, b| a + b, |i| x[i]);
    }
    let vecs = n / SUM_LANES;
    let add = |a: [f32; SUM_LANES], b: [f32; SUM_LANES]| -> [f32; SUM_LANES] {
        std::array::from_fn(|l| a[l] + b[l])
    };
    let load = |i: usize| -> [f32; SUM_LANES] { std::array::from_fn(|l| x[i * SUM_LANES + l]) };
    let lanes = row_sum(vecs, [0f32; SUM_LANES], add, load);
    let mut acc = 0f32;
    for v in &x[vecs * SUM_LANES..] {
        acc += v;
    }
    for v in lanes {
        acc += v;
    }
    acc
}

/// PyTorch's `row_sum`: `size` terms read as rows of 4 summed by [`multi_row_sum`], the rest
/// added to the first partial sum, then the four partial sums in order.
fn row_sum<T: Copy>(size: usize, zero: T, add: impl Fn(T, T) -> T, load: impl Fn(usize) -> T) -> T {
    const ILP: usize = 4;
    let rows = size / ILP;
    let mut p = multi_row_sum(rows, zero, &add, |i, k| load(i * ILP + k));
    for i in rows * ILP..size {
        p[0] = add(p[0], load(i));
    }
    for k in 1..ILP {
        p[0] = add(p[0], p[k]);
    }
    p[0]
}

/// PyTorch's `multi_row_sum` for 4 columns: `size` rows summed in 4 levels of `2^level_power`
/// rows each (a level is added into the next and cleared when it fills).
fn multi_row_sum<T: Copy>(
    size: usize,
    zero: T,
    add: impl Fn(T, T) -> T,
    load: impl Fn(usize, usize) -> T,
) -> [T; 4] {
    const LEVELS: usize = 4;
    let level_power = (ceil_log2(size) / LEVELS).max(4);
    let step = 1usize << level_power;
    let mask = step - 1;
    let mut acc = [[zero; 4]; LEVELS];
    let mut i = 0;
    while i + step <= size {
        for _ in 0..step {
            for (k, a) in acc[0].iter_mut().enumerate() {
                *a = add(*a, load(i, k));
            }
            i += 1;
        }
        for j in 1..LEVELS {
            let (lower, upper) = acc.split_at_mut(j);
            for (hi, lo) in upper[0].iter_mut().zip(lower[j - 1].iter_mut()) {
                *hi = add(*hi, *lo);
                *lo = zero;
            }
            if i & (mask << (j * level_power)) != 0 {
                break;
            }
        }
    }
    while i < size {
        for (k, a) in acc[0].iter_mut().enumerate() {
            *a = add(*a, load(i, k));
        }
        i += 1;
    }
    let (first, rest) = acc.split_at_mut(1);
    for level in rest.iter() {
        for (a, b) in first[0].iter_mut().zip(level) {
            *a = add(*a, *b);
        }
    }
    acc[0]
}

/// PyTorch's `CeilLog2`: 1 up to 2, else `ceil(log2(x))`.
fn ceil_log2(x: usize) -> usize {
    if x <= 2 {
        1
    } else {
        (usize::BITS - (x - 1).leading_zeros()) as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn torch_sum_small_cases() {
        // Exact sums (integers): every path of the cascade adds every element once.
        for n in [
            0usize, 1, 3, 7, 8, 9, 31, 32, 33, 511, 512, 513, 4097, 70_000,
        ] {
            let x: Vec<f32> = (0..n).map(|i| (i % 7) as f32).collect();
            let want: f32 = (0..n).map(|i| (i % 7) as f32).sum();
            assert_eq!(torch_sum(&x), want, "n = {n}");
        }
        assert_eq!(ceil_log2(3), 2);
        assert_eq!(ceil_log2(4), 2);
        assert_eq!(ceil_log2(5), 3);
    }

    #[test]
    fn dequantize_ranges_agree() {
        // Any sub-range, odd starts and ends included, equals the same slice of the whole.
        let packed: Vec<u8> = (0..50u32).map(|i| (i * 37 % 256) as u8).collect();
        let code: [f32; 16] = std::array::from_fn(|i| i as f32 - 7.5);
        let scale = |b: usize| 1.0 + b as f32;
        let mut whole = vec![0f32; 99];
        dequantize4_into(&packed, &code, 8, scale, |v| v, 0, &mut whole);
        assert_eq!(whole[9], code[(packed[4] & 0x0f) as usize] * 2.0);
        for start in 0..20 {
            for len in [1usize, 2, 7, 8, 17, 60] {
                let len = len.min(99 - start);
                let mut part = vec![0f32; len];
                dequantize4_into(&packed, &code, 8, scale, |v| v, start, &mut part);
                assert_eq!(part, whole[start..start + len], "start {start}, len {len}");
            }
        }
    }
}
