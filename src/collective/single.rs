//! The world-size-1 backend: every operation returns at once and no socket is opened.

use candle_core::Tensor;

use super::{check_root, AlignedBytes, Buffer, BufferMut, Collective, OwnedBuffer, ReduceOp};
use crate::error::Result;

/// The collective of a run with a single process. All operations are no-ops (an all-gather returns
/// a copy of the input), so the single-process path costs nothing.
#[derive(Debug, Default, Clone, Copy)]
pub struct SingleProcess;

impl Collective for SingleProcess {
    fn rank(&self) -> usize {
        0
    }
    fn world_size(&self) -> usize {
        1
    }
    fn backend(&self) -> &'static str {
        "single"
    }
    fn all_reduce(&self, buf: BufferMut<'_>, op: ReduceOp) -> Result<()> {
        super::check_reducible(buf.elem(), op)
    }
    fn broadcast(&self, _buf: BufferMut<'_>, root: usize) -> Result<()> {
        check_root(root, 1, 0)
    }
    fn all_gather(&self, buf: Buffer<'_>) -> Result<Vec<OwnedBuffer>> {
        Ok(vec![OwnedBuffer::new(
            AlignedBytes::copy_from(buf.bytes()),
            buf.elem(),
        )])
    }
    fn barrier(&self) -> Result<()> {
        Ok(())
    }
    fn reduce_scatter(&self, buf: BufferMut<'_>, op: ReduceOp) -> Result<()> {
        super::fallback::reduce_scatter(self, buf, op)
    }
    fn all_gather_into(&self, buf: BufferMut<'_>) -> Result<()> {
        super::fallback::all_gather_into(self, buf)
    }
    fn reduce_scatter_tensor(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        super::fallback::reduce_scatter_tensor(self, t, op)
    }
    fn all_gather_into_tensor(&self, t: &Tensor) -> Result<Tensor> {
        super::fallback::all_gather_into_tensor(self, t)
    }
    fn check_peers(&self) -> Result<()> {
        Ok(())
    }
    fn set_run_outcome(&self, _finished: bool) {}
    fn add_gate(&self, _gate: std::sync::Weak<dyn super::Gate>) {}
    fn all_reduce_tensor(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        super::fallback::all_reduce_tensor(self, t, op)
    }
    fn all_reduce_tensors(&self, ts: &[Tensor], op: ReduceOp) -> Result<Vec<Tensor>> {
        super::fallback::all_reduce_tensors(self, ts, op)
    }
    fn broadcast_tensor(&self, t: &Tensor, root: usize) -> Result<Tensor> {
        super::fallback::broadcast_tensor(self, t, root)
    }
    fn all_gather_tensor(&self, t: &Tensor) -> Result<Tensor> {
        super::fallback::all_gather_tensor(self, t)
    }
}
