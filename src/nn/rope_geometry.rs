//! The layouts of rotary embeddings ([`Variant`]: Candle's three) and the geometry of one
//! application ([`Geometry`]): shared by the CPU kernels (`rope.rs`) and the CUDA ones (`cuda.rs`),
//! so neither imports the other.

use candle_core::{Layout, Result};

/// Which of Candle's three layouts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Variant {
    /// `rope`: `xs` `[B, H, T, D]`, pairs `(i, i + D/2)` (the two halves of each row).
    Halves,
    /// `rope_i`: `xs` `[B, H, T, D]`, pairs `(2i, 2i + 1)` (interleaved).
    Interleaved,
    /// `rope_thd`: `xs` `[B, T, H, D]`, pairs of halves.
    Thd,
}

impl Variant {
    pub(super) fn name(self) -> &'static str {
        match self {
            Variant::Halves => "accelerate_rs::nn::rope",
            Variant::Interleaved => "accelerate_rs::nn::rope_i",
            Variant::Thd => "accelerate_rs::nn::rope_thd",
        }
    }

    pub(super) fn layout(self) -> &'static str {
        match self {
            Variant::Thd => "[batch, seq, heads, head_dim]",
            _ => "[batch, heads, seq, head_dim]",
        }
    }

    pub(super) fn interleaved(self) -> bool {
        self == Variant::Interleaved
    }
}

/// The geometry of one application: rows of `d` features, and the table row each uses (the CUDA
/// kernels take it too).
#[derive(Clone, Copy, Debug)]
pub(super) struct Geometry {
    pub(super) variant: Variant,
    /// `[B, H, T, D]` (or `[B, T, H, D]` for [`Variant::Thd`]), as `(b, h, t, d)`.
    pub(super) b: usize,
    pub(super) h: usize,
    pub(super) t: usize,
    pub(super) d: usize,
    /// One table per sequence (`[B, T, D/2]`) rather than one shared (`[T, D/2]`).
    pub(super) batched: bool,
}

impl Geometry {
    pub(super) fn new(variant: Variant, x: &Layout, cs: &Layout) -> Result<Geometry> {
        let (b, a, c, d) = x.shape().dims4()?;
        let (h, t) = if variant == Variant::Thd {
            (c, a)
        } else {
            (a, c)
        };
        Ok(Geometry {
            variant,
            b,
            h,
            t,
            d,
            batched: cs.dims().len() == 3,
        })
    }

    /// The table row of `xs`'s row `r`.
    #[inline]
    pub(super) fn table_row(&self, r: usize) -> usize {
        let (bi, ti) = match self.variant {
            Variant::Thd => (r / (self.t * self.h), (r / self.h) % self.t),
            _ => (r / (self.h * self.t), r % self.t),
        };
        if self.batched {
            bi * self.t + ti
        } else {
            ti
        }
    }

    /// The rows of `xs` that use table row `p` (the table's gradient sums over them).
    pub(super) fn rows_of(&self, p: usize) -> impl Iterator<Item = usize> + '_ {
        let (ti, batches) = if self.batched {
            (p % self.t, p / self.t..p / self.t + 1)
        } else {
            (p, 0..self.b)
        };
        batches.flat_map(move |bi| {
            (0..self.h).map(move |hi| match self.variant {
                Variant::Thd => (bi * self.t + ti) * self.h + hi,
                _ => (bi * self.h + hi) * self.t + ti,
            })
        })
    }

    /// The layout as the CUDA kernels number it: 0 halves, 1 interleaved, 2 `[B, T, H, D]`.
    #[cfg(feature = "cuda")]
    pub(super) fn kernel_variant(&self) -> i32 {
        match self.variant {
            Variant::Halves => 0,
            Variant::Interleaved => 1,
            Variant::Thd => 2,
        }
    }

    /// Rows of the tables.
    pub(super) fn table_rows(&self) -> usize {
        if self.batched {
            self.b * self.t
        } else {
            self.t
        }
    }
}
