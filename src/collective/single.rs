//! The world-size-1 backend: every operation returns at once and no socket is opened.

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
}
