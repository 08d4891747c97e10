//! The command line's integration tests, one binary: `config`, `env`, `test` and `launch`, run
//! through the `accelerate-rs` binary this crate builds.

mod cli_config;
mod cli_env;
mod cli_test;
mod estimate;
mod launch;
mod launch_options;

/// A port that was free a moment ago on loopback.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("no free loopback port")
}
