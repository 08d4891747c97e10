//! The `accelerate-rs` command line: argument parsing and one module per subcommand. The binary
//! (`cli/src/main.rs`) only calls [`main`].

mod cli;
mod config;
mod env;
mod estimate;
mod launch;
mod test;
mod test_train;

pub use cli::main;
