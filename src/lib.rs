//! accelerate-rs (work in progress skeleton)
#![deny(missing_docs)]

pub mod collective;
pub mod config;
pub mod data;
pub mod env;
pub mod error;
pub mod launch;

pub use error::{Error, Result};
