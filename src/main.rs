//! `accelerate-rs`: command-line front end of the accelerate-rs library.

use std::error::Error as _;
use std::process::ExitCode;
use std::time::Duration;

use accelerate_rs::launch::{launch, LaunchOptions};
use accelerate_rs::Error;
use clap::{Args, Parser, Subcommand};

/// Data-parallel training for Candle: launch and configure multi-process runs.
#[derive(Debug, Parser)]
#[command(name = "accelerate-rs", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run N local copies of PROGRAM with the torchrun environment (RANK, WORLD_SIZE, ...).
    Launch(LaunchArgs),
}

#[derive(Debug, Args)]
struct LaunchArgs {
    /// Force the workers onto the CPU (sets ACCELERATE_RS_USE_CPU=1).
    #[arg(long)]
    cpu: bool,

    /// Number of worker processes.
    #[arg(short = 'n', long, value_name = "N", default_value_t = 1)]
    num_processes: usize,

    /// Port of the rendezvous store (default: a free loopback port).
    #[arg(long, value_name = "PORT")]
    main_process_port: Option<u16>,

    /// Seconds stopped workers get between SIGTERM and SIGKILL.
    #[arg(long, value_name = "SECS", value_parser = parse_secs, default_value = "3")]
    grace_period: Duration,

    /// The program every worker runs, followed by its arguments.
    #[arg(value_name = "PROGRAM", required = true, trailing_var_arg = true,
          allow_hyphen_values = true, num_args = 1..)]
    command: Vec<String>,
}

fn parse_secs(s: &str) -> Result<Duration, String> {
    let secs: f64 = s
        .parse()
        .map_err(|e| format!("`{s}` is not a number of seconds: {e}"))?;
    Duration::try_from_secs_f64(secs).map_err(|e| format!("`{s}` is not a valid duration: {e}"))
}

fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Launch(args) => run_launch(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        // The library already printed which rank failed or which signal arrived.
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

fn run_launch(args: LaunchArgs) -> accelerate_rs::Result<()> {
    let mut command = args.command.into_iter();
    let program = command.next().unwrap_or_default();
    launch(&LaunchOptions {
        num_processes: args.num_processes,
        cpu: args.cpu,
        main_process_port: args.main_process_port,
        program,
        args: command.collect(),
        grace_period: args.grace_period,
    })
}
