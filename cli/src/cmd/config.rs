//! `accelerate-rs config`: write the config file by answering questions, from flags, or with
//! defaults (`config default`), and print it (`config show`).

use std::io::{BufRead, IsTerminal, Write};
use std::path::{Path, PathBuf};

use clap::{Args, Subcommand};

use accelerate_rs::config::{
    cuda_built, default_num_processes, gpus_seen, DEFAULT_COLLECTIVE_TIMEOUT_SECS,
    DEFAULT_MAIN_PROCESS_PORT,
};
use accelerate_rs::{ConfigFile, Error, MixedPrecision, Result};

/// How many answers a question gets before `config` gives up.
const MAX_ATTEMPTS: usize = 3;

/// An example of the non-interactive form, used in messages.
const FLAGS_EXAMPLE: &str = "accelerate-rs config --cpu --num-processes 2 --mixed-precision no";

#[derive(Debug, Args)]
#[command(args_conflicts_with_subcommands = true)]
pub(crate) struct ConfigArgs {
    #[command(subcommand)]
    action: Option<ConfigAction>,

    /// Where to write the config (default: ACCELERATE_RS_CONFIG_FILE, else the platform config
    /// dir, e.g. ~/.config/accelerate-rs/default_config.toml).
    #[arg(long, value_name = "PATH")]
    config_file: Option<PathBuf>,

    /// Read the answers line by line from stdin instead of a terminal (an empty line or the end
    /// of input accepts the default). Ignored when any answer flag is given.
    #[arg(long)]
    answers_from_stdin: bool,

    #[command(flatten)]
    answers: AnswerFlags,
}

#[derive(Debug, Subcommand)]
enum ConfigAction {
    /// Write a default config for this machine without asking (CPU in builds without CUDA).
    Default {
        /// Where to write it (default: ACCELERATE_RS_CONFIG_FILE, else the platform config dir).
        #[arg(long, value_name = "PATH")]
        config_file: Option<PathBuf>,
        /// Overwrite an existing file.
        #[arg(long)]
        force: bool,
    },
    /// Print the config file's path and its validated contents.
    Show {
        /// The file to show (default: ACCELERATE_RS_CONFIG_FILE, else the platform config dir).
        #[arg(long, value_name = "PATH")]
        config_file: Option<PathBuf>,
    },
}

/// One flag per config key. Giving any of them skips the questions; keys left out get defaults.
#[derive(Debug, Default, Args)]
struct AnswerFlags {
    /// Compute on CPUs (`use_cpu = true`).
    #[arg(long, conflicts_with = "gpu", help_heading = "Answers")]
    cpu: bool,
    /// Compute on GPUs (`use_cpu = false`); needs a build with CUDA support to run.
    #[arg(long, help_heading = "Answers")]
    gpu: bool,
    /// Number of machines (default 1).
    #[arg(long, value_name = "N", help_heading = "Answers")]
    num_machines: Option<usize>,
    /// This machine's index, 0 to num_machines - 1 (default 0).
    #[arg(long, value_name = "RANK", help_heading = "Answers")]
    machine_rank: Option<usize>,
    /// Address of the machine running rank 0; required when --num-machines > 1.
    #[arg(long, value_name = "IP", help_heading = "Answers")]
    main_process_ip: Option<String>,
    /// Rendezvous port on the main machine (default 29500 when --num-machines > 1).
    #[arg(long, value_name = "PORT", help_heading = "Answers")]
    main_process_port: Option<u16>,
    /// Processes per machine (default: GPUs seen with --gpu, else up to 2).
    #[arg(long, value_name = "N", help_heading = "Answers")]
    num_processes: Option<usize>,
    /// GPUs to use: `all` or a list such as `0,1` (default all with --gpu).
    #[arg(long, value_name = "IDS", help_heading = "Answers")]
    gpu_ids: Option<String>,
    /// Mixed precision: no, bf16 or fp16 (default no).
    #[arg(long, value_name = "MODE", help_heading = "Answers")]
    mixed_precision: Option<String>,
    /// Micro-batches accumulated before each optimizer step (default 1).
    #[arg(long, value_name = "N", help_heading = "Answers")]
    gradient_accumulation_steps: Option<usize>,
    /// Timeout of every collective, in seconds (default 1800).
    #[arg(
        long,
        value_name = "SECS",
        allow_negative_numbers = true,
        help_heading = "Answers"
    )]
    collective_timeout_secs: Option<f64>,
    /// How many times `launch` restarts the workers after a failure.
    #[arg(long, value_name = "N", help_heading = "Answers")]
    max_restarts: Option<usize>,
    /// How often `launch` checks its workers, in seconds.
    #[arg(
        long,
        value_name = "SECS",
        allow_negative_numbers = true,
        help_heading = "Answers"
    )]
    monitor_interval_secs: Option<f64>,
    /// Gradient bucket cap, in MiB.
    #[arg(
        long,
        value_name = "MB",
        allow_negative_numbers = true,
        help_heading = "Answers"
    )]
    bucket_cap_mb: Option<f64>,
    /// ZeRO stage: 0 (none), 1 (optimizer state sharded), 2 (and gradients), 3 (and
    /// parameters); default 0.
    #[arg(long, value_name = "N", help_heading = "Answers")]
    zero_stage: Option<usize>,
}

impl AnswerFlags {
    fn any(&self) -> bool {
        self.cpu
            || self.gpu
            || self.num_machines.is_some()
            || self.machine_rank.is_some()
            || self.main_process_ip.is_some()
            || self.main_process_port.is_some()
            || self.num_processes.is_some()
            || self.gpu_ids.is_some()
            || self.mixed_precision.is_some()
            || self.gradient_accumulation_steps.is_some()
            || self.collective_timeout_secs.is_some()
            || self.max_restarts.is_some()
            || self.monitor_interval_secs.is_some()
            || self.bucket_cap_mb.is_some()
            || self.zero_stage.is_some()
    }

    /// The config these flags describe, defaults filled in, validated like a config file.
    fn to_config(&self) -> Result<ConfigFile> {
        let gpu = self.gpu || (!self.cpu && ConfigFile::suggested().use_cpu == Some(false));
        let machines = self.num_machines.unwrap_or(1);
        let multi = machines > 1;
        let mixed_precision = match &self.mixed_precision {
            Some(m) => m.parse::<MixedPrecision>().map_err(|_| {
                flag_error(
                    "mixed_precision",
                    format!("expected no, bf16 or fp16, got {m:?}"),
                )
            })?,
            None => MixedPrecision::No,
        };
        let cfg = ConfigFile {
            use_cpu: Some(!gpu),
            num_machines: Some(machines),
            machine_rank: self.machine_rank.or(multi.then_some(0)),
            main_process_ip: self.main_process_ip.clone(),
            main_process_port: self
                .main_process_port
                .or(multi.then_some(DEFAULT_MAIN_PROCESS_PORT)),
            num_processes: Some(
                self.num_processes
                    .unwrap_or_else(|| default_num_processes(gpu)),
            ),
            gpu_ids: self.gpu_ids.clone().or(gpu.then(|| "all".to_string())),
            mixed_precision: Some(mixed_precision),
            gradient_accumulation_steps: Some(self.gradient_accumulation_steps.unwrap_or(1)),
            collective_timeout_secs: Some(
                self.collective_timeout_secs
                    .unwrap_or(DEFAULT_COLLECTIVE_TIMEOUT_SECS),
            ),
            max_restarts: self.max_restarts,
            monitor_interval_secs: self.monitor_interval_secs,
            bucket_cap_mb: self.bucket_cap_mb,
            tune_malloc: None,
            transport: None,
            missing_gradients: None,
            nonfinite: None,
            zero_stage: self.zero_stage,
            offload_optimizer: None,
            split_batches: None,
        };
        if let Some((key, reason)) = cfg.problem() {
            return Err(flag_error(key, reason));
        }
        if multi && cfg.main_process_ip.is_none() {
            return Err(flag_error(
                "main_process_ip",
                "required when --num-machines is more than 1: the address of the machine \
                 running rank 0, e.g. --main-process-ip 10.0.0.1"
                    .into(),
            ));
        }
        Ok(cfg)
    }
}

/// An error naming the flag and the config key it sets.
fn flag_error(key: &str, reason: String) -> Error {
    let flag = match key {
        "use_cpu" => "--cpu/--gpu".to_string(),
        k => format!("--{}", k.replace('_', "-")),
    };
    Error::invalid(format!("{flag} (config key `{key}`)"), reason)
}

pub(crate) fn run(args: ConfigArgs) -> Result<()> {
    let getenv = |k: &str| std::env::var(k).ok();
    match args.action {
        Some(ConfigAction::Default { config_file, force }) => {
            let path = ConfigFile::target_path(config_file.as_deref(), &getenv)?;
            if path.exists() && !force {
                return Err(Error::Config {
                    path,
                    key: None,
                    reason: "already exists; pass --force to overwrite it, or --config-file PATH \
                             to write another file"
                        .into(),
                });
            }
            let text = ConfigFile::suggested().write_atomic(&path)?;
            print_written(&path, &text);
            Ok(())
        }
        Some(ConfigAction::Show { config_file }) => {
            let path = ConfigFile::target_path(config_file.as_deref(), &getenv)?;
            print!("{}", show(&path)?);
            Ok(())
        }
        None => {
            let path = ConfigFile::target_path(args.config_file.as_deref(), &getenv)?;
            let cfg = if args.answers.any() {
                args.answers.to_config()?
            } else {
                let stdin = std::io::stdin();
                if !args.answers_from_stdin && !stdin.is_terminal() {
                    return Err(not_a_terminal());
                }
                let echo = !stdin.is_terminal();
                let mut input = stdin.lock();
                let mut prompts = std::io::stderr();
                ask_all(&mut input, &mut prompts, echo)?
            };
            if cfg.use_cpu == Some(false) && !cuda_built() {
                eprintln!(
                    "note: this config asks for GPUs, but this build has no CUDA support; \
                     runs need a build with the `cuda` feature"
                );
            }
            let text = cfg.write_atomic(&path)?;
            print_written(&path, &text);
            Ok(())
        }
    }
}

fn not_a_terminal() -> Error {
    Error::NotAvailable {
        what: "interactive `accelerate-rs config`".into(),
        reason: format!(
            "stdin is not a terminal, so no questions can be asked. Run it non-interactively \
             instead: `accelerate-rs config default` writes a default config, or give the answers \
             as flags (see `accelerate-rs config --help`), e.g. `{FLAGS_EXAMPLE}`; \
             `--answers-from-stdin` reads the answers line by line from stdin"
        ),
    }
}

fn print_written(path: &Path, text: &str) {
    println!("accelerate-rs config written to {}\n", path.display());
    print!("{text}");
}

/// The text `config show` prints: the path and the validated contents.
fn show(path: &Path) -> Result<String> {
    if !path.exists() {
        return Err(Error::Config {
            path: path.to_path_buf(),
            key: None,
            reason: format!(
                "not found; create it with `accelerate-rs config` (answer questions), \
                 `accelerate-rs config default`, or flags such as `{FLAGS_EXAMPLE}`"
            ),
        });
    }
    let cfg = ConfigFile::load(path)?;
    let body = cfg.to_toml()?;
    let body = if body.is_empty() {
        "# (empty: every setting takes its default)\n".to_string()
    } else {
        body
    };
    Ok(format!("config file: {}\n\n{body}", path.display()))
}

/// Asks the questions one line at a time on `out`, reading answers from `input`.
struct Asker<'a> {
    input: &'a mut dyn BufRead,
    out: &'a mut dyn Write,
    /// Repeat each answer after its question (when the answers do not come from a terminal, so
    /// that the transcript reads like a session).
    echo: bool,
    eof: bool,
}

impl Asker<'_> {
    fn say(&mut self, text: &str) -> Result<()> {
        writeln!(self.out, "{text}").map_err(prompt_io)
    }

    /// Asks for `key` until `apply` accepts the answer and the config stays valid. An empty line
    /// or the end of input takes `default`.
    fn ask(
        &mut self,
        cfg: &mut ConfigFile,
        key: &'static str,
        question: &str,
        default: Option<&str>,
        apply: &dyn Fn(&mut ConfigFile, &str) -> std::result::Result<(), String>,
    ) -> Result<()> {
        let mut last = String::new();
        for _ in 0..MAX_ATTEMPTS {
            match default {
                Some(d) => write!(self.out, "{question} [{d}]: "),
                None => write!(self.out, "{question}: "),
            }
            .and_then(|()| self.out.flush())
            .map_err(prompt_io)?;
            let mut line = String::new();
            if !self.eof {
                let n = self
                    .input
                    .read_line(&mut line)
                    .map_err(|source| Error::Io {
                        context: "config: cannot read the answer from".into(),
                        path: PathBuf::from("<stdin>"),
                        source,
                    })?;
                self.eof = n == 0;
            }
            let answer = line.trim();
            let answer = match (answer.is_empty(), default) {
                (false, _) => answer,
                (true, Some(d)) => d,
                (true, None) if self.eof => {
                    self.say("")?;
                    return Err(Error::invalid(
                        key,
                        format!("input ended, and `{question}` has no default"),
                    ));
                }
                (true, None) => {
                    last = "an answer is required".into();
                    self.say(&format!("  {last}"))?;
                    continue;
                }
            };
            if self.eof || self.echo {
                self.say(answer)?;
            }
            let mut candidate = cfg.clone();
            let outcome = apply(&mut candidate, answer).and_then(|()| match candidate.problem() {
                Some((_, reason)) => Err(reason),
                None => Ok(()),
            });
            match outcome {
                Ok(()) => {
                    *cfg = candidate;
                    return Ok(());
                }
                Err(reason) => {
                    last = reason;
                    self.say(&format!("  invalid answer: {last}"))?;
                    if self.eof {
                        break;
                    }
                }
            }
        }
        Err(Error::invalid(
            key,
            format!("no valid answer to `{question}` after {MAX_ATTEMPTS} tries: {last}"),
        ))
    }
}

fn prompt_io(source: std::io::Error) -> Error {
    Error::Io {
        context: "config: cannot write the question to".into(),
        path: PathBuf::from("<stderr>"),
        source,
    }
}

fn parse_count(s: &str) -> std::result::Result<usize, String> {
    s.parse()
        .map_err(|_| format!("expected a whole number such as 2, got {s:?}"))
}

fn parse_number(s: &str) -> std::result::Result<f64, String> {
    s.parse()
        .map_err(|_| format!("expected a number such as 1800, got {s:?}"))
}

/// The questionnaire behind interactive `accelerate-rs config`.
fn ask_all(input: &mut dyn BufRead, out: &mut dyn Write, echo: bool) -> Result<ConfigFile> {
    let mut a = Asker {
        input,
        out,
        echo,
        eof: false,
    };
    let mut cfg = ConfigFile::default();
    let gpu = ask_machines(&mut a, &mut cfg)?;
    ask_processes(&mut a, &mut cfg, gpu)?;
    ask_training(&mut a, &mut cfg)?;
    Ok(cfg)
}

/// The machines: CPU or GPU, how many machines, and (for several) this one's rank and where rank
/// 0 is. `true`: GPUs.
fn ask_machines(a: &mut Asker<'_>, cfg: &mut ConfigFile) -> Result<bool> {
    let gpu_default = cuda_built() && gpus_seen() > 0;
    if !cuda_built() {
        a.say(
            "note: this build has no CUDA support (enable the `cuda` feature); defaulting to cpu",
        )?;
    }
    a.ask(
        cfg,
        "use_cpu",
        "Compute environment (cpu, gpu)",
        Some(if gpu_default { "gpu" } else { "cpu" }),
        &|c, s| {
            c.use_cpu = Some(match s.to_ascii_lowercase().as_str() {
                "cpu" => true,
                "gpu" | "cuda" => false,
                _ => return Err(format!("expected `cpu` or `gpu`, got {s:?}")),
            });
            Ok(())
        },
    )?;
    a.ask(
        cfg,
        "num_machines",
        "Number of machines",
        Some("1"),
        &|c, s| {
            c.num_machines = Some(parse_count(s)?);
            Ok(())
        },
    )?;
    let machines = cfg.num_machines.unwrap_or(1);
    if machines > 1 {
        a.ask(
            cfg,
            "machine_rank",
            &format!("Rank of this machine (0 to {})", machines - 1),
            Some("0"),
            &|c, s| {
                c.machine_rank = Some(parse_count(s)?);
                Ok(())
            },
        )?;
        a.ask(
            cfg,
            "main_process_ip",
            "IP address of the machine running rank 0",
            None,
            &|c, s| {
                c.main_process_ip = Some(s.to_string());
                Ok(())
            },
        )?;
        let port = DEFAULT_MAIN_PROCESS_PORT.to_string();
        a.ask(
            cfg,
            "main_process_port",
            "Port of the main process",
            Some(&port),
            &|c, s| {
                c.main_process_port =
                    Some(s.parse().map_err(|_| {
                        format!("expected a port number from 1 to 65535, got {s:?}")
                    })?);
                Ok(())
            },
        )?;
    }
    Ok(cfg.use_cpu == Some(false))
}

/// The processes of each machine, and which GPUs they use.
fn ask_processes(a: &mut Asker<'_>, cfg: &mut ConfigFile, gpu: bool) -> Result<()> {
    let procs = default_num_processes(gpu).to_string();
    a.ask(
        cfg,
        "num_processes",
        "Number of processes per machine",
        Some(&procs),
        &|c, s| {
            c.num_processes = Some(parse_count(s)?);
            Ok(())
        },
    )?;
    if gpu {
        a.ask(
            cfg,
            "gpu_ids",
            "GPU ids to use (`all` or a list such as 0,1)",
            Some("all"),
            &|c, s| {
                c.gpu_ids = Some(s.to_string());
                Ok(())
            },
        )?;
    }
    Ok(())
}

/// How training runs: precision, accumulation, the collective's timeout, the ZeRO stage.
fn ask_training(a: &mut Asker<'_>, cfg: &mut ConfigFile) -> Result<()> {
    a.ask(
        cfg,
        "mixed_precision",
        "Mixed precision (no, bf16, fp16)",
        Some("no"),
        &|c, s| {
            c.mixed_precision = Some(
                s.parse()
                    .map_err(|_| format!("expected no, bf16 or fp16, got {s:?}"))?,
            );
            Ok(())
        },
    )?;
    a.ask(
        cfg,
        "gradient_accumulation_steps",
        "Gradient accumulation steps",
        Some("1"),
        &|c, s| {
            c.gradient_accumulation_steps = Some(parse_count(s)?);
            Ok(())
        },
    )?;
    let timeout = DEFAULT_COLLECTIVE_TIMEOUT_SECS.to_string();
    a.ask(
        cfg,
        "collective_timeout_secs",
        "Collective timeout in seconds",
        Some(&timeout),
        &|c, s| {
            c.collective_timeout_secs = Some(parse_number(s)?);
            Ok(())
        },
    )?;
    a.ask(
        cfg,
        "zero_stage",
        "ZeRO stage (0 none, 1 optimizer state sharded, 2 and gradients, 3 and parameters)",
        Some("0"),
        &|c, s| {
            c.zero_stage = Some(parse_count(s)?);
            Ok(())
        },
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answers(text: &str) -> (Result<ConfigFile>, String) {
        let mut input = text.as_bytes();
        let mut out = Vec::new();
        let r = ask_all(&mut input, &mut out, true);
        (r, String::from_utf8_lossy(&out).into_owned())
    }

    #[test]
    fn empty_input_takes_every_default() {
        let (cfg, _) = answers("");
        let cfg = cfg.unwrap();
        assert_eq!(cfg.use_cpu, Some(true));
        assert_eq!(cfg.num_machines, Some(1));
        assert_eq!(cfg.num_processes, Some(default_num_processes(false)));
        assert_eq!(cfg.collective_timeout_secs, Some(1800.0));
    }

    #[test]
    fn bad_answers_are_reasked_then_fail() {
        let (cfg, out) = answers("cpu\nlots\n1\n");
        assert_eq!(cfg.unwrap().num_machines, Some(1));
        assert!(out.contains("expected a whole number"), "{out}");
        let (cfg, out) = answers("cpu\nx\ny\nz\n");
        let err = cfg.unwrap_err().to_string();
        assert!(
            err.contains("num_machines") && err.contains("3 tries"),
            "{err}"
        );
        assert_eq!(out.matches("Number of machines").count(), 3, "{out}");
    }

    #[test]
    fn multi_machine_questions_and_rank_check() {
        let (cfg, out) = answers("gpu\n2\n2\n1\n10.0.0.1\n\n4\n0,1\nbf16\n2\n60\n");
        let cfg = cfg.unwrap();
        assert!(out.contains("below num_machines = 2"), "{out}");
        assert_eq!(cfg.use_cpu, Some(false));
        assert_eq!(cfg.machine_rank, Some(1));
        assert_eq!(cfg.main_process_ip.as_deref(), Some("10.0.0.1"));
        assert_eq!(cfg.main_process_port, Some(29500));
        assert_eq!(cfg.gpu_ids.as_deref(), Some("0,1"));
        assert_eq!(cfg.mixed_precision, Some(MixedPrecision::Bf16));
        assert_eq!(cfg.collective_timeout_secs, Some(60.0));
        // The IP has no default: running out of input there is an error naming the key.
        let (cfg, _) = answers("cpu\n2\n0\n");
        assert!(cfg.unwrap_err().to_string().contains("main_process_ip"));
    }

    #[test]
    fn flags_fill_defaults_and_name_the_flag() {
        let f = AnswerFlags {
            cpu: true,
            num_processes: Some(3),
            ..Default::default()
        };
        let c = f.to_config().unwrap();
        assert_eq!(c.num_processes, Some(3));
        assert_eq!(c.gradient_accumulation_steps, Some(1));
        let f = AnswerFlags {
            num_processes: Some(0),
            ..Default::default()
        };
        let err = f.to_config().unwrap_err().to_string();
        assert!(
            err.contains("--num-processes") && err.contains("from 1 to 1024"),
            "{err}"
        );
        let f = AnswerFlags {
            num_machines: Some(2),
            ..Default::default()
        };
        let err = f.to_config().unwrap_err().to_string();
        assert!(err.contains("--main-process-ip"), "{err}");
    }
}
