//! `accelerate-rs launch`.

use std::time::Duration;

use clap::Args;

use super::parse_secs;
use crate::launch::{launch, LaunchOptions};

#[derive(Debug, Args)]
pub(crate) struct LaunchArgs {
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

pub(crate) fn run(args: LaunchArgs) -> crate::Result<()> {
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
