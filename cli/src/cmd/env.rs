//! `accelerate-rs env`: the block a user pastes into a bug report (versions, build, machine,
//! relevant environment variables, config file).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use clap::Args;

use accelerate_rs::config::{cuda_built, gpus_seen};
use accelerate_rs::{env, ConfigFile};

/// The candle-core version requirement in Cargo.toml (Candle does not expose its version at run
/// time). A unit test keeps the two in sync.
pub(crate) const CANDLE_VERSION_REQ: &str = "0.11";

#[derive(Debug, Args)]
pub(crate) struct EnvArgs {
    /// Report this config file instead of the one in force (ACCELERATE_RS_CONFIG_FILE, else the
    /// platform config dir).
    #[arg(long, value_name = "PATH")]
    config_file: Option<PathBuf>,
    /// Print only the number of GPUs this build sees (after CUDA_VISIBLE_DEVICES; 0 without the
    /// `cuda` feature or a driver), for scripts: unlike `nvidia-smi -L | wc -l` it counts what
    /// the training program will see, not MIG lines or hidden GPUs.
    #[arg(long, conflicts_with = "config_file")]
    gpus: bool,
}

pub(crate) fn run(args: EnvArgs) -> accelerate_rs::Result<()> {
    if args.gpus {
        println!("{}", gpus_seen());
        return Ok(());
    }
    let vars: BTreeMap<String, String> = std::env::vars_os()
        .map(|(k, v)| {
            (
                k.to_string_lossy().into_owned(),
                v.to_string_lossy().into_owned(),
            )
        })
        .collect();
    print!("{}", report(&vars, args.config_file.as_deref()));
    Ok(())
}

/// Variables worth reporting, in this order; every other `ACCELERATE_RS_*` variable follows.
const RELEVANT: &[&str] = &[
    env::RANK,
    env::WORLD_SIZE,
    env::LOCAL_RANK,
    env::LOCAL_WORLD_SIZE,
    env::MASTER_ADDR,
    env::MASTER_PORT,
    env::SLURM_PROCID,
    env::SLURM_NTASKS,
    env::SLURM_LOCALID,
    env::SLURM_NTASKS_PER_NODE,
    env::OMPI_RANK,
    env::OMPI_SIZE,
    env::OMPI_LOCAL_RANK,
    env::OMPI_LOCAL_SIZE,
    env::CUDA_VISIBLE_DEVICES,
    env::RAYON_NUM_THREADS,
    env::OMP_NUM_THREADS,
    "RUST_LOG",
    "RUST_BACKTRACE",
];

/// Whether a variable's value must not be printed.
fn is_secret(name: &str) -> bool {
    let upper = name.to_ascii_uppercase();
    name == env::SECRET
        || ["SECRET", "TOKEN", "PASSWORD"]
            .iter()
            .any(|w| upper.contains(w))
}

/// What this build says about CUDA.
fn cuda_line() -> &'static str {
    if cuda_built() {
        "built"
    } else {
        "not built (enable the `cuda` feature)"
    }
}

/// The report, from the environment `vars` and an explicit config file.
pub(crate) fn report(vars: &BTreeMap<String, String>, config_file: Option<&Path>) -> String {
    let mut out = String::from(
        "## accelerate-rs environment\n\nCopy and paste the text below into your bug report.\n\n",
    );
    write_build_and_machine(&mut out);
    write_config_file(&mut out, vars, config_file);
    write_variables(&mut out, vars);
    out
}

/// Versions, build, CUDA, GPUs, OS and CPUs.
fn write_build_and_machine(out: &mut String) {
    let gpus = if cuda_built() {
        gpus_seen().to_string()
    } else {
        "none: built without CUDA".to_string()
    };
    let cpus = std::thread::available_parallelism()
        .map_or_else(|e| format!("unknown ({e})"), |n| n.get().to_string());
    for (k, v) in [
        (
            "accelerate-rs version",
            env!("CARGO_PKG_VERSION").to_string(),
        ),
        (
            "Rust version required (rust-version)",
            env!("CARGO_PKG_RUST_VERSION").to_string(),
        ),
        (
            "Candle (candle-core requirement)",
            CANDLE_VERSION_REQ.to_string(),
        ),
        (
            "Build profile",
            if cfg!(debug_assertions) {
                "debug"
            } else {
                "release"
            }
            .to_string(),
        ),
        ("CUDA", cuda_line().to_string()),
        ("GPUs seen", gpus),
        (
            "OS",
            format!("{} ({})", std::env::consts::OS, std::env::consts::FAMILY),
        ),
        ("Architecture", std::env::consts::ARCH.to_string()),
        ("CPU count", cpus),
    ] {
        let _ = writeln!(out, "- {k}: {v}");
    }
}

/// Which config file is in force, where from, and its contents or why it is invalid.
fn write_config_file(
    out: &mut String,
    vars: &BTreeMap<String, String>,
    config_file: Option<&Path>,
) {
    let getenv = |k: &str| vars.get(k).cloned();
    match ConfigFile::locate(config_file, &getenv) {
        None => {
            let _ = writeln!(
                out,
                "- Config file: none (this platform has no config directory)"
            );
        }
        Some((path, _)) => {
            let source = if config_file.is_some() {
                "--config-file"
            } else if getenv(env::CONFIG_FILE).is_some_and(|p| !p.is_empty()) {
                env::CONFIG_FILE
            } else {
                "default location"
            };
            let _ = writeln!(out, "- Config file: {} (from {source})", path.display());
            if !path.exists() {
                let _ = writeln!(out, "- Config file status: not found");
            } else {
                match ConfigFile::load(&path).and_then(|c| c.to_toml()) {
                    Ok(text) => {
                        let _ = writeln!(out, "- Config file status: valid");
                        let _ = writeln!(out, "- Config file contents:");
                        if text.is_empty() {
                            let _ = writeln!(out, "    (empty)");
                        }
                        for l in text.lines() {
                            let _ = writeln!(out, "    {l}");
                        }
                    }
                    Err(e) => {
                        let _ = writeln!(out, "- Config file status: invalid: {e}");
                    }
                }
            }
        }
    }
}

/// The relevant environment variables set (secrets as `(set)`).
fn write_variables(out: &mut String, vars: &BTreeMap<String, String>) {
    let mut names: Vec<&str> = RELEVANT
        .iter()
        .copied()
        .filter(|k| vars.contains_key(*k))
        .collect();
    names.extend(
        vars.keys()
            .map(String::as_str)
            .filter(|k| k.starts_with("ACCELERATE_RS_")),
    );
    if names.is_empty() {
        let _ = writeln!(
            out,
            "- Environment variables: none of the relevant ones is set"
        );
    } else {
        let _ = writeln!(out, "- Environment variables:");
        for k in names {
            let v = match vars.get(k) {
                Some(_) if is_secret(k) => "(set)",
                Some(v) => v.as_str(),
                None => continue,
            };
            let _ = writeln!(out, "    - {k}: {v}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn candle_requirement_matches_cargo_toml() {
        let manifest = include_str!("../../Cargo.toml");
        let want = format!("candle-core = \"{CANDLE_VERSION_REQ}\"");
        assert!(manifest.contains(&want), "Cargo.toml lacks {want}");
    }

    #[test]
    fn secret_is_masked_and_vars_listed() {
        let dir = tempfile::tempdir().unwrap();
        let vars: BTreeMap<String, String> = [
            (env::SECRET, "hunter2hunter2"),
            (env::RANK, "3"),
            ("ACCELERATE_RS_FOO", "bar"),
            ("UNRELATED", "x"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        let cfg = dir.path().join("c.toml");
        let r = report(&vars, Some(&cfg));
        assert!(r.contains("- ACCELERATE_RS_SECRET: (set)"), "{r}");
        assert!(!r.contains("hunter2"), "{r}");
        assert!(
            r.contains("- RANK: 3") && r.contains("ACCELERATE_RS_FOO: bar"),
            "{r}"
        );
        assert!(!r.contains("UNRELATED"), "{r}");
        assert!(r.contains("not found"), "{r}");
    }
}
