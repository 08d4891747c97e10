//! The options of the cross-entropy (`loss.rs` on the CPU, `cuda.rs` on the GPU, `head_loss.rs`):
//! a leaf, so the kernels and the losses share it without importing each other.

/// Options of [`cross_entropy_with`](super::cross_entropy_with) (PyTorch's `label_smoothing` and
/// `ignore_index`).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct CrossEntropyOptions {
    /// ε in `[0, 1)`: the target distribution is `(1 - ε)` on the target class plus `ε / C`
    /// spread over all `C` classes. 0 (default) is plain cross-entropy.
    pub label_smoothing: f64,
    /// Rows whose target is this value (e.g. padding) add nothing to the loss or the gradient;
    /// the mean is over the other rows (NaN when every row is ignored, as in PyTorch).
    pub ignore_index: Option<i64>,
}

impl CrossEntropyOptions {
    /// Sets the label smoothing ε.
    pub fn label_smoothing(mut self, epsilon: f64) -> Self {
        self.label_smoothing = epsilon;
        self
    }

    /// Sets the ignored target value.
    pub fn ignore_index(mut self, index: i64) -> Self {
        self.ignore_index = Some(index);
        self
    }
}
