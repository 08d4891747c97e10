//! accelerate-rs (work in progress skeleton)
#![deny(missing_docs)]

pub mod collective;
pub mod env;
pub mod error;

pub use error::{Error, Result};
