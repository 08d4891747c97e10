//! Collective communication: one [`Collective`] trait, several backends.
//!
//! | backend | when | file |
//! |---|---|---|
//! | [`SingleProcess`] | world size 1: every call returns at once, no socket is opened | `single.rs` |
//! | [`TcpCollective`] | several processes (one or many machines): rendezvous store + ring over TCP; `all_reduce` and `broadcast` through shared memory when all ranks share a host | `tcp/` |
//! | [`ThreadGroup`] | several ranks as threads of one process (tests, DP over CPU replicas) | `threads.rs` |
//! | [`MpiCollective`] | CPU clusters started by `mpirun` / `srun --mpi` (transport `mpi`, or `auto` under an MPI launcher); needs the `mpi` feature | `mpi.rs` (`mpi_stub.rs` without it) |
//! | [`NcclCollective`] | GPU tensors: DDP (one process per GPU) and DP (one thread per GPU); needs the `cuda` feature | `nccl/` (`nccl/stub.rs` without it) |
//!
//! Every operation has a timeout, and every backend fails (never hangs) when a peer disappears,
//! naming the operation, its own rank and the peer.
//!
//! ```
//! use accelerate_rs::collective::{Collective, ThreadGroup};
//! use accelerate_rs::ReduceOp;
//! # fn main() -> accelerate_rs::Result<()> {
//! let ranks = ThreadGroup::new(3, std::time::Duration::from_secs(10))?;
//! let handles: Vec<_> = ranks
//!     .into_iter()
//!     .map(|c| {
//!         std::thread::spawn(move || {
//!             let mut v = vec![c.rank() as f32; 4];
//!             c.all_reduce((&mut v[..]).into(), ReduceOp::Sum).map(|_| v)
//!         })
//!     })
//!     .collect();
//! for h in handles {
//!     assert_eq!(h.join().unwrap()?, vec![3.0; 4]); // 0 + 1 + 2
//! }
//! # Ok(())
//! # }
//! ```

/// `Collective` for a stub backend's type (a build without its feature), which holds a
/// `never: Infallible` field: no value exists, so no method can run. Unused in a build with every
/// backend.
#[allow(unused_macros)]
macro_rules! uninhabited_collective {
    ($t:ty) => {
        impl Collective for $t {
            fn rank(&self) -> usize {
                match self.never {}
            }
            fn world_size(&self) -> usize {
                match self.never {}
            }
            fn backend(&self) -> &'static str {
                match self.never {}
            }
            fn all_reduce(&self, _: BufferMut<'_>, _: ReduceOp) -> Result<()> {
                match self.never {}
            }
            fn broadcast(&self, _: BufferMut<'_>, _: usize) -> Result<()> {
                match self.never {}
            }
            fn all_gather(&self, _: Buffer<'_>) -> Result<Vec<OwnedBuffer>> {
                match self.never {}
            }
            fn barrier(&self) -> Result<()> {
                match self.never {}
            }
            fn reduce_scatter(&self, _: BufferMut<'_>, _: ReduceOp) -> Result<()> {
                match self.never {}
            }
            fn all_gather_into(&self, _: BufferMut<'_>) -> Result<()> {
                match self.never {}
            }
            fn reduce_scatter_tensor(
                &self,
                _: &candle_core::Tensor,
                _: ReduceOp,
            ) -> Result<candle_core::Tensor> {
                match self.never {}
            }
            fn all_gather_into_tensor(
                &self,
                _: &candle_core::Tensor,
            ) -> Result<candle_core::Tensor> {
                match self.never {}
            }
            fn check_peers(&self) -> Result<()> {
                match self.never {}
            }
            fn set_run_outcome(&self, _: bool) {
                match self.never {}
            }
            fn add_gate(&self, _: std::sync::Weak<dyn $crate::collective::Gate>) {
                match self.never {}
            }
            fn all_reduce_tensor(
                &self,
                _: &candle_core::Tensor,
                _: ReduceOp,
            ) -> Result<candle_core::Tensor> {
                match self.never {}
            }
            fn all_reduce_tensors(
                &self,
                _: &[candle_core::Tensor],
                _: ReduceOp,
            ) -> Result<Vec<candle_core::Tensor>> {
                match self.never {}
            }
            fn broadcast_tensor(
                &self,
                _: &candle_core::Tensor,
                _: usize,
            ) -> Result<candle_core::Tensor> {
                match self.never {}
            }
            fn all_gather_tensor(&self, _: &candle_core::Tensor) -> Result<candle_core::Tensor> {
                match self.never {}
            }
        }
    };
}

mod agree;
mod base;
mod buffer;
pub mod fallback;
pub mod forwarding;
#[cfg(feature = "mpi")]
pub(crate) mod mpi;
#[cfg(not(feature = "mpi"))]
#[path = "mpi_stub.rs"]
pub(crate) mod mpi;
mod nccl;
pub(crate) mod placement;
pub(crate) mod reduce;
mod single;
mod tcp;
mod threads;

pub(crate) use agree::agree_on_write;
pub(crate) use base::{agree_on_rows, check_root};
pub use base::{chunk_range, Collective, Gate};
pub(crate) use buffer::{tensor_from_bytes, HostVec};
pub use buffer::{AlignedBytes, Buffer, BufferMut, ElemType, Element, OwnedBuffer};
pub use mpi::MpiCollective;
pub use nccl::NcclCollective;
pub(crate) use reduce::ReduceOp;
pub(crate) use reduce::{check_reducible, finish_mean, reduce_into, reduce_last};
pub use single::SingleProcess;
pub use tcp::{TcpCollective, TcpOptions};
pub use threads::{ThreadCollective, ThreadGroup};
