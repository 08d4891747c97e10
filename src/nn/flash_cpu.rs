//! The CPU kernels of [`flash_attention`](super::flash_attention): a tiled forward with an
//! online softmax that keeps one log-sum-exp per query row, and a backward pass that recomputes
//! the tiles from it (FlashAttention-2's arithmetic). Nothing of size `T_q × T_k` is ever
//! allocated: each Rayon task holds two `BQ × BK` tiles and its rows' accumulators.
//!
//! Tasks: the forward pass and the query gradient run one task per (batch entry, head, tile of
//! `BQ` query rows); the key and value gradients one task per (batch entry, key/value head, tile
//! of `BK` keys), looping over the query heads that share that key/value head (GQA), so every
//! task writes only its own rows of its outputs and the results do not depend on the number of
//! threads.

use std::collections::HashMap;

use rayon::prelude::*;

use crate::par::Inline;

use super::attention::{Mat, SharedMut, View};
use super::elem::{exp_f32, max_by, multiversion, sum2_by, sum_by, Elem};

/// Query rows per tile.
const BQ: usize = 64;
/// Keys per tile.
const BK: usize = 128;

/// The sizes: batch, query heads, key/value heads (dividing `h`), queries, keys, the query/key
/// width and the value width.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Dims {
    pub(super) b: usize,
    pub(super) h: usize,
    pub(super) hkv: usize,
    pub(super) tq: usize,
    pub(super) tk: usize,
    pub(super) d: usize,
    pub(super) dv: usize,
}

impl Dims {
    /// Whether there is nothing to compute (the output is empty, or all zeros: no keys).
    pub(super) fn is_empty(&self) -> bool {
        self.b == 0 || self.h == 0 || self.tq == 0 || self.tk == 0 || self.dv == 0
    }

    /// The key/value head of query head `h` (`transformers`' `repeat_kv`: consecutive query
    /// heads share one).
    fn kv_head(&self, h: usize) -> usize {
        h / (self.h / self.hkv)
    }

    /// Query tiles per head.
    fn query_tiles(&self) -> usize {
        self.tq.div_ceil(BQ)
    }

    /// The rows `r0..r1` of query tile `t`.
    fn query_tile(&self, t: usize) -> (usize, usize) {
        (t * BQ, ((t + 1) * BQ).min(self.tq))
    }
}

/// Which keys each query sees: per query row the range of keys that causality, the sliding window
/// and its document allow, then, key by key, its document and the padding.
#[derive(Debug)]
pub(super) struct Visibility {
    /// Keys `lo..hi` at most, per query row: `[B, T_q]` with documents, else `[T_q]` (one for
    /// every batch entry). An empty range (`lo >= hi`) sees nothing.
    ranges: Vec<(usize, usize)>,
    /// Document ids `[B, T_k]`; query `i` has the id of position `i + T_k - T_q`.
    ids: Option<Vec<i64>>,
    /// `[B, T_k]`, nonzero where a key is padding.
    pad: Option<Vec<u8>>,
    /// `T_k - T_q`: the position of query 0 among the keys (0 unless causal or documents).
    off: usize,
    tq: usize,
    tk: usize,
}

impl Visibility {
    /// The visibility for `dims`: causal (query `i` at position `p = i + T_k - T_q` sees keys
    /// `..= p`), a sliding window of `window` keys (`p - window < j`; only with `causal`),
    /// document ids `[B, T_k]` (a query sees keys of its own document only) and a key padding
    /// mask `[B, T_k]`. The caller has checked `T_q <= T_k` for `causal` and documents.
    pub(super) fn new(
        dims: Dims,
        causal: bool,
        window: Option<usize>,
        ids: Option<Vec<i64>>,
        pad: Option<Vec<u8>>,
    ) -> Visibility {
        let Dims { b, tq, tk, .. } = dims;
        let off = if causal || ids.is_some() { tk - tq } else { 0 };
        let base = |i: usize| {
            let p = i + off;
            let lo = window.map_or(0, |w| (p + 1).saturating_sub(w));
            (lo, if causal { p + 1 } else { tk })
        };
        let ranges = match &ids {
            None => (0..tq).map(base).collect(),
            Some(ids) => {
                let mut ranges = Vec::with_capacity(b * tq);
                for row in ids.chunks(tk.max(1)).take(b) {
                    // The first and last position of each document in this row.
                    let mut span: HashMap<i64, (usize, usize)> = HashMap::new();
                    for (j, id) in row.iter().enumerate() {
                        span.entry(*id).and_modify(|s| s.1 = j).or_insert((j, j));
                    }
                    ranges.extend((0..tq).map(|i| {
                        let (lo, hi) = base(i);
                        let (first, last) = span.get(&row[i + off]).copied().unwrap_or((0, 0));
                        (lo.max(first), hi.min(last + 1))
                    }));
                }
                ranges
            }
        };
        Visibility {
            ranges,
            ids,
            pad,
            off,
            tq,
            tk,
        }
    }

    /// The masks as the CUDA kernels take them: the key range of every query row (`[B, T_q]`
    /// when `per_batch`, else `[T_q]`), the document ids and the padding (`[B, T_k]`), and
    /// `T_k - T_q` when rows sit at the end of the keys.
    #[cfg(feature = "cuda")]
    pub(super) fn parts(&self) -> HostMasks<'_> {
        HostMasks {
            ranges: &self.ranges,
            per_batch: self.ids.is_some(),
            ids: self.ids.as_deref(),
            pad: self.pad.as_deref(),
            off: self.off,
        }
    }

    /// The key range of query row `i` of batch entry `b`.
    fn range(&self, b: usize, i: usize) -> (usize, usize) {
        let at = if self.ids.is_some() {
            b * self.tq + i
        } else {
            i
        };
        self.ranges[at]
    }

    /// The keys `lo..hi` that some row of `r0..r1` may see (`(0, 0)` when none sees any).
    fn keys_of(&self, b: usize, r0: usize, r1: usize) -> (usize, usize) {
        let (mut lo, mut hi) = (usize::MAX, 0);
        for i in r0..r1 {
            let (l, h) = self.range(b, i);
            if l < h {
                lo = lo.min(l);
                hi = hi.max(h);
            }
        }
        if lo < hi {
            (lo, hi)
        } else {
            (0, 0)
        }
    }

    /// Sets to `-inf` the entries of the score tile `s` (rows `r0..r1`, keys `c0..c1`, `n`
    /// columns per row) that their query does not see.
    fn mask(&self, s: &mut [f32], n: usize, b: usize, rows: (usize, usize), keys: (usize, usize)) {
        let ((r0, r1), (c0, c1)) = (rows, keys);
        let width = c1 - c0;
        let keys = b * self.tk + c0..b * self.tk + c1;
        let ids = self.ids.as_ref().map(|v| &v[keys.clone()]);
        let pad = self.pad.as_ref().map(|v| &v[keys]);
        for (i, row) in (r0..r1).zip(s.chunks_mut(n)) {
            let row = &mut row[..width];
            let (lo, hi) = self.range(b, i);
            let before = lo.saturating_sub(c0).min(width);
            let after = hi.saturating_sub(c0).clamp(before, width);
            row[..before].fill(f32::NEG_INFINITY);
            row[after..].fill(f32::NEG_INFINITY);
            if let (Some(ids), Some(all)) = (ids, &self.ids) {
                let own = all[b * self.tk + i + self.off];
                for (x, id) in row.iter_mut().zip(ids) {
                    if *id != own {
                        *x = f32::NEG_INFINITY;
                    }
                }
            }
            if let Some(pad) = pad {
                for (x, p) in row.iter_mut().zip(pad) {
                    if *p != 0 {
                        *x = f32::NEG_INFINITY;
                    }
                }
            }
        }
    }
}

/// What [`Visibility::parts`] shows of the masks.
#[cfg(feature = "cuda")]
pub(super) struct HostMasks<'a> {
    pub(super) ranges: &'a [(usize, usize)],
    pub(super) per_batch: bool,
    pub(super) ids: Option<&'a [i64]>,
    pub(super) pad: Option<&'a [u8]>,
    pub(super) off: usize,
}

/// The inputs of one call: q, k and v (f32) where their views place them, checked to fit.
#[derive(Clone, Copy)]
pub(super) struct Inputs<'a> {
    pub(super) data: [&'a [f32]; 3],
    pub(super) views: [View; 3],
}

impl Inputs<'_> {
    /// Head `h` of q and its key/value head's k and v, of batch entry `b`, as matrices.
    fn mats(&self, dims: &Dims, b: usize, h: usize) -> [Mat; 3] {
        let g = dims.kv_head(h);
        [
            self.views[0].mat(self.data[0].as_ptr(), b, h),
            self.views[1].mat(self.data[1].as_ptr(), b, g),
            self.views[2].mat(self.data[2].as_ptr(), b, g),
        ]
    }
}

/// Whether `b × heads × t × width` elements at `v` lie within a buffer of `len`.
pub(super) fn fits(v: &View, b: usize, heads: usize, t: usize, width: usize, len: usize) -> bool {
    let last = |n: usize| n.saturating_sub(1);
    let end = v.at(last(b), last(heads)) + last(t) * v.st + last(width) * v.sc;
    b * heads * t * width == 0 || end < len
}

/// `dst = beta · lhs · rhs`, or `dst += beta · lhs · rhs` when `add`, for `lhs` `m × k` and
/// `rhs` `k × n` (`gemm`, on this thread).
///
/// # Safety
/// Every element of `lhs` (`m × k`), `rhs` (`k × n`) and `dst` (`m × n`) lies in a live
/// allocation; no other thread reads or writes `dst`'s elements meanwhile, and `dst` overlaps
/// neither operand.
#[allow(clippy::too_many_arguments)]
unsafe fn gemm(m: usize, n: usize, k: usize, dst: Mat, lhs: Mat, rhs: Mat, add: bool, beta: f32) {
    // SAFETY: the caller's guarantees are `gemm`'s: in-bounds operands, an exclusive `dst`.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.ptr as *mut f32,
            dst.cs,
            dst.rs,
            add,
            lhs.ptr,
            lhs.cs,
            lhs.rs,
            rhs.ptr,
            rhs.cs,
            rhs.rs,
            if add { 1.0 } else { 0.0 },
            beta,
            false,
            false,
            false,
            gemm::Parallelism::None,
        )
    }
}

/// The larger of two maxima, NaN if either is: a NaN score must never pass for a masked one.
fn nan_max(a: f32, b: f32) -> f32 {
    if a.is_nan() || b.is_nan() {
        f32::NAN
    } else {
        a.max(b)
    }
}

multiversion! {
    /// One row of a score tile in the online softmax: with `m` the row's running maximum, the
    /// row becomes `exp(s - m')` for its new maximum `m'`; returns `m'`, the factor `exp(m - m')`
    /// for what was accumulated before, and the row's sum. A row that has seen only masked keys
    /// (`m' = -inf`) becomes zeros, with factor 1.
    fn online_row<T: Elem>(row: &mut [T], m: f32) -> (f32, f32, f32) {
        let m_new = nan_max(m, max_by(row, |v| v));
        if m_new == f32::NEG_INFINITY {
            row.fill(T::of(0.0));
            return (m_new, 1.0, 0.0);
        }
        for s in row.iter_mut() {
            *s = T::of(exp_f32(s.f() - m_new));
        }
        (m_new, exp_f32(m - m_new), sum_by(row, |v| v))
    }
}

multiversion! {
    /// The attention weights of one recomputed score row from its log-sum-exp `lse`:
    /// `exp(s - lse)` (zeros for a row that sees no key, `lse = -inf`).
    fn weights_row<T: Elem>(row: &mut [T], lse: f32) {
        if lse == f32::NEG_INFINITY {
            row.fill(T::of(0.0));
            return;
        }
        for s in row.iter_mut() {
            *s = T::of(exp_f32(s.f() - lse));
        }
    }
}

multiversion! {
    /// `dS = P ∘ (dP − δ)` in place over `dp`, for the row's weights `p` and `δ = dOᵀ O`.
    fn score_grad_row<T: Elem>(dp: &mut [T], p: &[T], delta: f32) {
        for (g, w) in dp.iter_mut().zip(p) {
            *g = T::of(w.f() * (g.f() - delta));
        }
    }
}

/// The per-task buffers of the forward pass.
struct FwdScratch {
    /// The score tile, `BQ × BK` (rows of the tile's width).
    s: Vec<f32>,
    /// The unnormalized output rows, `BQ × D_v`.
    o: Vec<f32>,
    /// Running maximum and sum per row.
    m: Vec<f32>,
    l: Vec<f32>,
}

/// The forward pass: `y` `[B, H, T_q, D_v]` and the log-sum-exp of every query row, `lse`
/// `[B, H, T_q]` (`-inf` for a row that sees no key; its output is zeros). Non-empty dims, inputs
/// checked.
pub(super) fn forward(
    dims: Dims,
    scale: f32,
    vis: &Visibility,
    x: Inputs<'_>,
    y: &mut [f32],
    lse: &mut [f32],
) {
    let Dims { h, tq, dv, .. } = dims;
    let nt = dims.query_tiles();
    let (yp, lp) = (SharedMut(y.as_mut_ptr()), SharedMut(lse.as_mut_ptr()));
    (0..dims.b * h * nt)
        .into_par_iter()
        .inline_when_single()
        .for_each_init(
            || FwdScratch {
                s: vec![0.0; BQ * BK],
                o: vec![0.0; BQ * dv],
                m: vec![0.0; BQ],
                l: vec![0.0; BQ],
            },
            |sc, task| {
                // The whole pointers, not their fields (a closure would capture a bare `*mut f32`).
                let (yp, lp) = (yp, lp);
                let (bh, (r0, r1)) = (task / nt, dims.query_tile(task % nt));
                forward_tile(dims, scale, vis, x, sc, (bh / h, bh % h), (r0, r1));
                // SAFETY: task (b, h, tile) alone writes rows r0..r1 of head (b, h) of `y`
                // (`[B, H, T_q, D_v]`) and of `lse` (`[B, H, T_q]`), both sized for the dims, and
                // nothing reads them before every task has finished.
                let (yo, lo) = unsafe {
                    (
                        std::slice::from_raw_parts_mut(
                            yp.0.add((bh * tq + r0) * dv),
                            (r1 - r0) * dv,
                        ),
                        std::slice::from_raw_parts_mut(lp.0.add(bh * tq + r0), r1 - r0),
                    )
                };
                let rows = sc.o.chunks(dv).zip(sc.m.iter().zip(&sc.l));
                for ((out, lse), (o, (&m, &l))) in yo.chunks_mut(dv).zip(lo.iter_mut()).zip(rows) {
                    if l == 0.0 {
                        // Every key masked: zeros (a NaN row has l = NaN and stays NaN).
                        out.fill(0.0);
                        *lse = f32::NEG_INFINITY;
                    } else {
                        let inv = 1.0 / l;
                        out.iter_mut().zip(o).for_each(|(y, o)| *y = o * inv);
                        *lse = m + l.ln();
                    }
                }
            },
        );
}

/// Query rows `r0..r1` of head `(b, h)`: the unnormalized output rows, their maxima and sums in
/// `sc`, key tile after key tile.
fn forward_tile(
    dims: Dims,
    scale: f32,
    vis: &Visibility,
    x: Inputs<'_>,
    sc: &mut FwdScratch,
    (b, h): (usize, usize),
    (r0, r1): (usize, usize),
) {
    let (rows, dv) = (r1 - r0, dims.dv);
    let [qm, km, vm] = x.mats(&dims, b, h);
    sc.o[..rows * dv].fill(0.0);
    sc.m.fill(f32::NEG_INFINITY);
    sc.l.fill(0.0);
    let (klo, khi) = vis.keys_of(b, r0, r1);
    for c0 in (klo..khi).step_by(BK) {
        let c1 = (c0 + BK).min(khi);
        let n = c1 - c0;
        // SAFETY: the inputs were checked to fit their buffers (rows < T_q, keys < T_k), and
        // `s` is this task's own `BQ × BK` buffer.
        unsafe {
            gemm(
                rows,
                n,
                dims.d,
                Mat::rows_mut(&mut sc.s, n),
                qm.at(r0, 0),
                km.at(c0, 0).t(),
                false,
                scale,
            )
        };
        let s = &mut sc.s[..rows * n];
        vis.mask(s, n, b, (r0, r1), (c0, c1));
        for (r, row) in s.chunks_mut(n).enumerate() {
            let (m, corr, sum) = online_row(row, sc.m[r]);
            sc.m[r] = m;
            sc.l[r] = sc.l[r] * corr + sum;
            if corr != 1.0 {
                sc.o[r * dv..(r + 1) * dv]
                    .iter_mut()
                    .for_each(|o| *o *= corr);
            }
        }
        // SAFETY: v checked as above; `o` and `s` are this task's own buffers.
        unsafe {
            gemm(
                rows,
                dv,
                n,
                Mat::rows_mut(&mut sc.o, dv),
                Mat::rows(&sc.s, n),
                vm.at(c0, 0),
                true,
                1.0,
            )
        };
    }
}

/// The output's gradient and what the backward pass derives from it.
#[derive(Clone, Copy)]
pub(super) struct Upstream<'a> {
    /// `dO`, contiguous `[B, H, T_q, D_v]`.
    pub(super) dy: &'a [f32],
    /// The forward pass's log-sum-exp per row, `[B, H, T_q]`.
    pub(super) lse: &'a [f32],
    /// `δ = rowsum(dO ∘ O)` per row, `[B, H, T_q]`.
    pub(super) delta: &'a [f32],
}

/// `δ = rowsum(dO ∘ O)` of every query row (`y` and `dy` contiguous `[B, H, T_q, D_v]`).
pub(super) fn deltas(y: &[f32], dy: &[f32], dv: usize) -> Vec<f32> {
    y.par_chunks(dv)
        .inline_when_single()
        .zip(dy.par_chunks(dv).inline_when_single())
        .map(|(o, g)| sum2_by(o, g, |a, b| a * b))
        .collect()
}

/// The backward pass of one call: what every task reads.
#[derive(Clone, Copy)]
struct Grad<'a> {
    dims: Dims,
    scale: f32,
    vis: &'a Visibility,
    x: Inputs<'a>,
    up: Upstream<'a>,
}

impl Grad<'_> {
    /// The recomputed tiles of one (query tile, key tile) pair of head `(b, h)`: the weights `P`
    /// in `p` and the score gradient `dS` in `ds` (`rows × n` each, `n` columns per row).
    fn tile(
        &self,
        (b, h): (usize, usize),
        (r0, r1): (usize, usize),
        (c0, c1): (usize, usize),
        p: &mut [f32],
        ds: &mut [f32],
    ) {
        let (dims, up) = (self.dims, self.up);
        let (rows, n) = (r1 - r0, c1 - c0);
        let [qm, km, vm] = self.x.mats(&dims, b, h);
        let row0 = (b * dims.h + h) * dims.tq + r0;
        let dym = Mat::rows(&up.dy[row0 * dims.dv..], dims.dv);
        let (pm, dsm) = (Mat::rows_mut(p, n), Mat::rows_mut(ds, n));
        // SAFETY: the inputs were checked to fit their buffers, `dy` holds `[B, H, T_q, D_v]`,
        // and `p`/`ds` are this task's own `BQ × BK` buffers.
        unsafe {
            let (qr, kr, vr) = (qm.at(r0, 0), km.at(c0, 0).t(), vm.at(c0, 0).t());
            gemm(rows, n, dims.d, pm, qr, kr, false, self.scale);
            gemm(rows, n, dims.dv, dsm, dym, vr, false, 1.0);
        }
        let p = &mut p[..rows * n];
        self.vis.mask(p, n, b, (r0, r1), (c0, c1));
        let stats = up.lse[row0..row0 + rows].iter().zip(&up.delta[row0..]);
        for ((pr, dr), (&lse, &delta)) in p.chunks_mut(n).zip(ds.chunks_mut(n)).zip(stats) {
            weights_row(pr, lse);
            score_grad_row(dr, pr, delta);
        }
    }

    /// `dQ` `[B, H, T_q, D]`: one task per query tile, over the key tiles it sees (in order,
    /// the key tiles of [`key_grads`](Self::key_grads)).
    fn query_grads(&self, gq: &mut [f32]) {
        let Dims { h, tq, d, .. } = self.dims;
        let scratch = || (vec![0f32; BQ * BK], vec![0f32; BQ * BK]);
        gq.par_chunks_mut(tq * d)
            .inline_when_single()
            .enumerate()
            .flat_map(|(bh, g)| {
                g.par_chunks_mut(BQ * d)
                    .inline_when_single()
                    .enumerate()
                    .map(move |t| (bh, t))
            })
            .for_each_init(scratch, |(p, ds), (bh, (t, dq))| {
                let (b, hh, (r0, r1)) = (bh / h, bh % h, self.dims.query_tile(t));
                let km = self.x.mats(&self.dims, b, hh)[1];
                let (klo, khi) = self.vis.keys_of(b, r0, r1);
                for c0 in (klo / BK * BK..khi).step_by(BK) {
                    // The keys past the last one this tile sees add nothing (their weights are
                    // zero): the tile stops there, in both passes alike.
                    let (c1, dst) = ((c0 + BK).min(khi), Mat::rows_mut(dq, d));
                    self.tile((b, hh), (r0, r1), (c0, c1), p, ds);
                    let (n, k) = (c1 - c0, km.at(c0, 0));
                    // SAFETY: `dq` is this task's own rows of `gq`, `ds` its own buffer, k
                    // checked.
                    unsafe { gemm(r1 - r0, d, n, dst, Mat::rows(ds, n), k, true, self.scale) }
                }
            });
    }

    /// The keys each query tile sees (`[(lo, hi)]` per tile), per batch entry with documents,
    /// else once for all.
    fn seen_by_tiles(&self) -> Vec<Vec<(usize, usize)>> {
        let per_batch = if self.vis.ids.is_some() {
            self.dims.b
        } else {
            1
        };
        (0..per_batch)
            .map(|bb| {
                let tile = |t| self.dims.query_tile(t);
                let seen = |(r0, r1)| self.vis.keys_of(bb, r0, r1);
                (0..self.dims.query_tiles()).map(tile).map(seen).collect()
            })
            .collect()
    }

    /// Key tile `c0..c1` of key/value head `(b, g)`: adds to its `dk` and `dv` rows over the
    /// query heads sharing it and the query tiles that see it (`seen`), and when `dq` holds the
    /// group's query gradients (`[H / H_kv, T_q, D]`), to those too.
    #[allow(clippy::too_many_arguments)]
    fn key_tile(
        &self,
        (b, g): (usize, usize),
        (c0, c1): (usize, usize),
        seen: &[(usize, usize)],
        (p, ds): (&mut [f32], &mut [f32]),
        (dk, dvv): (&mut [f32], &mut [f32]),
        mut dq: Option<&mut [f32]>,
    ) {
        let Dims { h, tq, d, dv, .. } = self.dims;
        let rep = h / self.dims.hkv;
        for hh in g * rep..(g + 1) * rep {
            let [qm, km, _] = self.x.mats(&self.dims, b, hh);
            let row0 = (b * h + hh) * tq;
            for (t, s) in seen
                .iter()
                .enumerate()
                .filter(|(_, s)| s.0 < c1 && s.1 > c0)
            {
                let (r0, r1) = self.dims.query_tile(t);
                // Up to the last key the query tile sees, as in `query_grads`.
                let c1 = c1.min(s.1);
                let n = c1 - c0;
                self.tile((b, hh), (r0, r1), (c0, c1), p, ds);
                let dym = Mat::rows(&self.up.dy[(row0 + r0) * dv..], dv);
                let (pm, dsm) = (Mat::rows(p, n).t(), Mat::rows(ds, n).t());
                let (dvm, dkm) = (Mat::rows_mut(dvv, dv), Mat::rows_mut(dk, d));
                // SAFETY: `dk`/`dvv` are this task's own key rows, `p`/`ds` its own buffers,
                // `dq` (if any) its own query rows; q, k and `dy` checked.
                unsafe {
                    gemm(n, dv, r1 - r0, dvm, pm, dym, true, 1.0);
                    gemm(n, d, r1 - r0, dkm, dsm, qm.at(r0, 0), true, self.scale);
                    if let Some(dq) = dq.as_deref_mut() {
                        let rows = &mut dq[((hh - g * rep) * tq + r0) * d..];
                        let (dqm, dsm) = (Mat::rows_mut(rows, d), Mat::rows(ds, n));
                        gemm(r1 - r0, d, n, dqm, dsm, km.at(c0, 0), true, self.scale);
                    }
                }
            }
        }
    }

    /// `dK` `[B, H_kv, T_k, D]` and `dV` `[B, H_kv, T_k, D_v]`: one task per key tile of a
    /// key/value head.
    fn key_grads(&self, gk: &mut [f32], gv: &mut [f32]) {
        let Dims { hkv, tk, d, dv, .. } = self.dims;
        let seen = self.seen_by_tiles();
        let scratch = || (vec![0f32; BQ * BK], vec![0f32; BQ * BK]);
        gk.par_chunks_mut(tk * d)
            .inline_when_single()
            .zip(gv.par_chunks_mut(tk * dv).inline_when_single())
            .enumerate()
            .flat_map(|(bg, (k, v))| {
                let tiles = k
                    .par_chunks_mut(BK * d)
                    .inline_when_single()
                    .zip(v.par_chunks_mut(BK * dv).inline_when_single());
                tiles.enumerate().map(move |t| (bg, t))
            })
            .for_each_init(scratch, |(p, ds), (bg, (kt, out))| {
                let (b, c0) = (bg / hkv, kt * BK);
                let keys = (c0, (c0 + BK).min(tk));
                let seen = &seen[b.min(seen.len() - 1)];
                self.key_tile((b, bg % hkv), keys, seen, (p, ds), out, None);
            });
    }

    /// All three gradients in one pass: one task per key/value head, its key tiles in order,
    /// each adding to the query gradients of the heads sharing it as well (no recomputation for
    /// `dQ`). The same operations in the same order per element as
    /// [`query_grads`](Self::query_grads) and [`key_grads`](Self::key_grads), so the same bits.
    fn all_grads(&self, gq: &mut [f32], gk: &mut [f32], gv: &mut [f32]) {
        let Dims {
            h,
            hkv,
            tq,
            tk,
            d,
            dv,
            ..
        } = self.dims;
        let seen = self.seen_by_tiles();
        let scratch = || (vec![0f32; BQ * BK], vec![0f32; BQ * BK]);
        gq.par_chunks_mut(h / hkv * tq * d)
            .inline_when_single()
            .zip(
                gk.par_chunks_mut(tk * d)
                    .inline_when_single()
                    .zip(gv.par_chunks_mut(tk * dv).inline_when_single()),
            )
            .enumerate()
            .for_each_init(scratch, |(p, ds), (bg, (dq, (dk, dvv)))| {
                let b = bg / hkv;
                let seen = &seen[b.min(seen.len() - 1)];
                for c0 in (0..tk).step_by(BK) {
                    let keys = (c0, (c0 + BK).min(tk));
                    let rows = (&mut dk[c0 * d..], &mut dvv[c0 * dv..]);
                    let dq = Some(&mut dq[..]);
                    self.key_tile((b, bg % hkv), keys, seen, (p, ds), rows, dq);
                }
            });
    }
}

/// The gradients `(dq, dk, dv)`, contiguous `[B, H, T_q, D]`, `[B, H_kv, T_k, D]` and
/// `[B, H_kv, T_k, D_v]`, from the output's gradient. Non-empty dims, inputs checked.
///
/// With at least one key/value head (of a batch entry) per thread, one pass: a task per
/// key/value head computes all three ([`Grad::all_grads`]). With fewer, two passes that keep
/// every thread busy: the query gradients per query tile, then the key and value gradients per
/// key tile, recomputing the tiles once more. `one_pass` forces either (tests); both give the
/// same bits.
pub(super) fn backward(
    dims: Dims,
    scale: f32,
    vis: &Visibility,
    x: Inputs<'_>,
    up: Upstream<'_>,
    one_pass: Option<bool>,
) -> [Vec<f32>; 3] {
    let Dims {
        b,
        h,
        hkv,
        tq,
        tk,
        d,
        dv,
    } = dims;
    let (mut gq, mut gk, mut gv) = (
        vec![0f32; b * h * tq * d],
        vec![0f32; b * hkv * tk * d],
        vec![0f32; b * hkv * tk * dv],
    );
    let pass = Grad {
        dims,
        scale,
        vis,
        x,
        up,
    };
    if one_pass.unwrap_or(b * hkv >= rayon::current_num_threads()) {
        pass.all_grads(&mut gq, &mut gk, &mut gv);
    } else {
        pass.query_grads(&mut gq);
        pass.key_grads(&mut gk, &mut gv);
    }
    [gq, gk, gv]
}
