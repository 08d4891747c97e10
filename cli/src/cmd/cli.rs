//! The command line's parser ([`Cli`]) and dispatcher ([`main`]): one subcommand, one module, and
//! the exit code of its result.

use std::error::Error as _;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

use super::{config, env, estimate, launch, test};
use crate::Error;

/// Data-parallel training for Candle: configure and launch multi-process runs.
#[derive(Debug, Parser)]
#[command(name = "accelerate-rs", version, about)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run N local copies of PROGRAM with the torchrun environment (RANK, WORLD_SIZE, ...).
    Launch(Box<launch::LaunchArgs>),
    /// Write the config file by answering questions, from flags, or with defaults; `config show`
    /// prints it.
    Config(Box<config::ConfigArgs>),
    /// Print versions, build, machine, relevant environment variables and the config file, for
    /// bug reports.
    Env(env::EnvArgs),
    /// Run a multi-process sanity check (collectives, sampler, DDP steps) and say if it passed.
    Test(test::TestArgs),
    /// Estimate the memory of training a model on each rank (parameters, gradients, optimizer
    /// state, masters, activations) from its config.json and safetensors headers.
    EstimateMemory(Box<estimate::EstimateArgs>),
    /// One worker of `accelerate-rs test` (started by it).
    #[command(hide = true)]
    TestWorker,
}

/// Parses the process arguments, runs the subcommand and returns the exit code.
pub fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Launch(args) => launch::run(*args),
        Command::Config(args) => config::run(*args).map_err(Error::from),
        Command::Env(args) => env::run(args).map_err(Error::from),
        Command::Test(args) => test::run(args),
        Command::EstimateMemory(args) => estimate::run(*args),
        Command::TestWorker => test::worker().map_err(Error::from),
    };
    exit_code(result)
}

/// Maps a subcommand's result to the process exit code, printing errors with their causes.
fn exit_code(result: crate::Result<()>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        // The launcher already printed which rank failed or which signal arrived.
        Err(Error::WorkerFailed { code, .. }) | Err(Error::Interrupted { code, .. }) => {
            ExitCode::from(u8::try_from(code).unwrap_or(1))
        }
        Err(e) => {
            eprintln!("error: {e}");
            let mut source = e.source();
            while let Some(s) = source {
                eprintln!("  caused by: {s}");
                source = s.source();
            }
            ExitCode::FAILURE
        }
    }
}
