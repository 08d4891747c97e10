//! Multi-process collectives over TCP.
//!
//! 1. Rank 0 hosts a rendezvous store at `MASTER_ADDR:MASTER_PORT` (`store.rs`).
//! 2. Every rank listens on an ephemeral port of the interface that reaches rank 0, publishes
//!    `peer/<rank>` in the store, connects to the next rank and accepts the previous one. Every
//!    connection opens with a handshake carrying the run's secret ([`wire`]).
//! 3. Collectives run over that ring ([`ring`](self)): all-reduce is reduce-scatter + all-gather
//!    over `world` chunks, streamed in segments.
//! 4. When every rank is on the same host (same hostname and boot id), `all_reduce` and
//!    `broadcast` go through a shared-memory segment instead (`shm.rs`); the ring still carries
//!    `all_gather` and `barrier` and tells a waiting rank when a peer dies.
//!    `ACCELERATE_RS_TRANSPORT` = `auto` (default) | `tcp` | `shm` overrides the choice;
//!    [`TcpCollective::transport`] says which one is in use.

mod base;
mod ring;
mod segment;
mod shm;
mod startup;
mod store;
pub mod wire;

pub use base::TcpCollective;
pub use startup::TcpOptions;
