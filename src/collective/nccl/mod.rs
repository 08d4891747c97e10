//! NCCL: the collective of GPU tensors ([`NcclCollective`]), in `cuda` builds; a stub that says
//! how to rebuild in the others. Its parts: the backend (`collective.rs`), the communicator
//! handle (`comm.rs`), the operations as Candle ops (`ops.rs`), and, compiled and tested in every
//! build (over fake communicators), the dtype map (`dtype.rs`) and the watchdog, close and
//! prepare-gate-queue-wait logic (`life.rs`).

#[cfg(feature = "cuda")]
mod collective;
#[cfg(not(feature = "cuda"))]
#[path = "stub.rs"]
mod collective;
#[cfg(feature = "cuda")]
mod comm;
#[allow(dead_code)]
mod dtype;
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
mod life;
#[cfg(feature = "cuda")]
mod ops;

pub use collective::NcclCollective;
