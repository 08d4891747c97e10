//! The `accelerate-rs` command line (`config`, `launch`, `env`, `test`, `estimate-memory`) and the launcher behind
//! `accelerate-rs launch`, built on the [`accelerate_rs`] library.
//!
//! A crate of its own (like nextest's runner and CLI split) so that a training script depending
//! on `accelerate-rs` compiles neither clap, nor nix, nor signal-hook: only this crate, which
//! builds the `accelerate-rs` binary, needs them.
#![deny(missing_docs)]
#![deny(rustdoc::broken_intra_doc_links)]

mod cmd;
pub mod launch;

pub use cmd::main;
