//! `accelerate-rs launch`: flags, merged over the config file (flag > config file > default).

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;

use accelerate_rs::{ConfigFile, MixedPrecision};

use crate::launch::{launch, LaunchOptions};

#[derive(Debug, Args)]
pub(crate) struct LaunchArgs {
    /// Config file to read (default: $ACCELERATE_RS_CONFIG_FILE, else the platform default
    /// location, e.g. ~/.config/accelerate-rs/default_config.toml). Flags override its values.
    #[arg(long, value_name = "PATH")]
    config_file: Option<PathBuf>,

    /// Force the workers onto the CPU (sets ACCELERATE_RS_USE_CPU=1).
    #[arg(long)]
    cpu: bool,

    /// Number of worker processes on this machine, at most 1024 [config: num_processes;
    /// default: 1].
    #[arg(short = 'n', long, value_name = "N")]
    num_processes: Option<usize>,

    /// GPUs the workers see (CUDA_VISIBLE_DEVICES), e.g. 0,1; `all` leaves it unset
    /// [config: gpu_ids].
    #[arg(long, value_name = "IDS")]
    gpu_ids: Option<String>,

    /// Number of machines of the run [config: num_machines; default: 1].
    #[arg(long, value_name = "M")]
    num_machines: Option<usize>,

    /// This machine's index, 0 to M-1; machine 0 hosts rank 0 [config: machine_rank; default: 0].
    #[arg(long, value_name = "R")]
    machine_rank: Option<usize>,

    /// Address of machine rank 0 (MASTER_ADDR); required with several machines
    /// [config: main_process_ip; default: 127.0.0.1].
    #[arg(long, value_name = "IP")]
    main_process_ip: Option<String>,

    /// Port of the rendezvous store; 0 or absent picks a free port on a single machine;
    /// required with several machines [config: main_process_port].
    #[arg(long, value_name = "PORT")]
    main_process_port: Option<u16>,

    /// Mixed precision mode: no, bf16 or fp16 (ACCELERATE_RS_MIXED_PRECISION)
    /// [config: mixed_precision].
    #[arg(long, value_name = "MODE", value_parser = parse_mixed_precision)]
    mixed_precision: Option<MixedPrecision>,

    /// Micro-batches accumulated per optimizer step (ACCELERATE_RS_GRADIENT_ACCUMULATION_STEPS)
    /// [config: gradient_accumulation_steps].
    #[arg(long, value_name = "N")]
    gradient_accumulation_steps: Option<usize>,

    /// ZeRO stage: 0 (none), 1 (optimizer state sharded), 2 (and gradients), 3 (and
    /// parameters) (ACCELERATE_RS_ZERO_STAGE) [config: zero_stage].
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u8).range(0..=3))]
    zero_stage: Option<u8>,

    /// ZeRO stage 3: the shards' optimizer state, f32 masters and f32 gradients in host memory,
    /// stepped there (ACCELERATE_RS_OFFLOAD_OPTIMIZER=1) [config: offload_optimizer].
    #[arg(long)]
    offload_optimizer: bool,

    /// Timeout of every collective in seconds (ACCELERATE_RS_TIMEOUT_SECS)
    /// [config: collective_timeout_secs].
    #[arg(long, value_name = "SECS", value_parser = parse_secs)]
    collective_timeout_secs: Option<Duration>,

    /// Restart the whole worker group up to K times after a failure
    /// [config: max_restarts; default: 0].
    #[arg(long, value_name = "K")]
    max_restarts: Option<usize>,

    /// Seconds between the launcher's checks for signals [config: monitor_interval_secs;
    /// default: 0.1].
    #[arg(long, value_name = "SECS", value_parser = parse_secs)]
    monitor_interval: Option<Duration>,

    /// Seconds stopped workers get between SIGTERM and SIGKILL.
    #[arg(long, value_name = "SECS", value_parser = parse_secs, default_value = "3")]
    grace_period: Duration,

    /// Also write each rank's output to DIR/rank_<i>.stdout.log and .stderr.log (DIR is
    /// --log-dir, else ./accelerate-rs-logs/<time>-<pid>, printed at start).
    #[arg(long)]
    tee: bool,

    /// Directory of the per-rank log files (implies --tee).
    #[arg(long, value_name = "DIR")]
    log_dir: Option<PathBuf>,

    /// Print only the launcher's errors (worker output is still shown).
    #[arg(long, short = 'q')]
    quiet: bool,

    /// Print each worker's command line and environment (secret redacted) and start nothing.
    #[arg(long)]
    dry_run: bool,

    /// The program every worker runs, followed by its arguments (optionally after `--`).
    #[arg(value_name = "PROGRAM", required = true, trailing_var_arg = true,
          allow_hyphen_values = true, num_args = 1..)]
    command: Vec<String>,
}

fn parse_mixed_precision(s: &str) -> Result<MixedPrecision, String> {
    s.parse::<MixedPrecision>()
        .map_err(|_| format!("`{s}` is not one of no, bf16, fp16"))
}

/// The options of `args` over the config file's values (flag > config file > default).
fn options(args: LaunchArgs, cfg: &ConfigFile) -> LaunchOptions {
    let mut o = LaunchOptions::from_config(cfg);
    let mut command = args.command.into_iter();
    o.program = command.next().unwrap_or_default();
    o.args = command.collect();
    o.cpu |= args.cpu;
    if let Some(v) = args.num_processes {
        o.num_processes = v;
    }
    if let Some(v) = args.gpu_ids {
        o.gpu_ids = Some(v);
    }
    if let Some(v) = args.num_machines {
        o.num_machines = v;
    }
    if let Some(v) = args.machine_rank {
        o.machine_rank = v;
    }
    if let Some(v) = args.main_process_ip {
        o.main_process_ip = Some(v);
    }
    if let Some(v) = args.main_process_port {
        o.main_process_port = Some(v);
    }
    if let Some(v) = args.mixed_precision {
        o.mixed_precision = Some(v);
    }
    if let Some(v) = args.gradient_accumulation_steps {
        o.gradient_accumulation_steps = Some(v);
    }
    if let Some(v) = args.zero_stage {
        o.zero_stage = Some(usize::from(v));
    }
    if args.offload_optimizer {
        o.offload_optimizer = Some(true);
    }
    if let Some(v) = args.collective_timeout_secs {
        o.collective_timeout = Some(v);
    }
    if let Some(v) = args.max_restarts {
        o.max_restarts = v;
    }
    if let Some(v) = args.monitor_interval {
        o.monitor_interval = v;
    }
    o.grace_period = args.grace_period;
    o.tee = args.tee;
    o.log_dir = args.log_dir;
    o.quiet = args.quiet;
    o.dry_run = args.dry_run;
    o
}

pub(crate) fn run(args: LaunchArgs) -> crate::Result<()> {
    let getenv = |k: &str| std::env::var(k).ok();
    let (cfg, path) = ConfigFile::load_located(args.config_file.as_deref(), &getenv)?;
    if let Some(path) = &path {
        log::info!("launch: using config file {}", path.display());
    }
    launch(&options(args, &cfg))
}

/// A number of seconds from 0 to a week ([`accelerate_rs::limits::MAX_TIMEOUT_SECS`]).
fn parse_secs(s: &str) -> Result<Duration, String> {
    let secs: f64 = s
        .parse()
        .map_err(|e| format!("`{s}` is not a number of seconds: {e}"))?;
    accelerate_rs::limits::checked_secs(secs, true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct T {
        #[command(flatten)]
        a: LaunchArgs,
    }

    fn parse(argv: &[&str]) -> LaunchArgs {
        T::try_parse_from(std::iter::once("launch").chain(argv.iter().copied()))
            .unwrap()
            .a
    }

    #[test]
    fn flags_override_the_config_file_which_overrides_defaults() {
        let cfg = ConfigFile {
            num_processes: Some(3),
            use_cpu: Some(true),
            max_restarts: Some(2),
            mixed_precision: Some(MixedPrecision::Bf16),
            main_process_port: Some(4000),
            zero_stage: Some(2),
            ..ConfigFile::default()
        };
        let o = options(parse(&["prog", "x"]), &cfg);
        assert_eq!(o.num_processes, 3);
        assert!(o.cpu);
        assert_eq!(o.max_restarts, 2);
        assert_eq!(o.mixed_precision, Some(MixedPrecision::Bf16));
        assert_eq!(o.main_process_port, Some(4000));
        assert_eq!(o.zero_stage, Some(2));
        assert_eq!(
            (o.program.as_str(), o.args.as_slice()),
            ("prog", &["x".to_string()][..])
        );
        let o = options(
            parse(&[
                "-n",
                "2",
                "--max-restarts",
                "0",
                "--mixed-precision",
                "fp16",
                "--main-process-port",
                "0",
                "--zero-stage",
                "3",
                "--",
                "prog",
            ]),
            &cfg,
        );
        assert_eq!(o.num_processes, 2);
        assert_eq!(o.max_restarts, 0);
        assert_eq!(o.mixed_precision, Some(MixedPrecision::Fp16));
        assert_eq!(o.main_process_port, Some(0));
        assert_eq!(o.zero_stage, Some(3));
        let bad = T::try_parse_from(["launch", "--zero-stage", "4", "prog"]);
        assert!(bad.is_err());
        let o = options(parse(&["prog"]), &ConfigFile::default());
        assert_eq!(o.num_processes, 1);
        assert!(!o.cpu);
    }
}
