//! End-to-end tests of `accelerate-rs env` with the real binary, in a private home.

use std::path::Path;
use std::process::{Command, Output, Stdio};

/// `accelerate-rs env <args>` with `HOME`/`XDG_CONFIG_HOME` in `home`, no inherited accelerate-rs
/// variables, and `vars` set.
fn env_report(home: &Path, args: &[&str], vars: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_accelerate-rs"));
    cmd.arg("env")
        .args(args)
        .env("HOME", home)
        .env("XDG_CONFIG_HOME", home.join("xdg"))
        .stdin(Stdio::null());
    for (k, _) in std::env::vars_os() {
        if k.to_string_lossy().starts_with("ACCELERATE_RS_") {
            cmd.env_remove(k);
        }
    }
    cmd.envs(vars.iter().copied());
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "env failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn env_reports_versions_machine_config_and_masks_the_secret() {
    let home = tempfile::tempdir().unwrap();
    let cfg = home.path().join("cfg.toml");
    std::fs::write(&cfg, "num_processes = 3\nmixed_precision = \"bf16\"\n").unwrap();
    let secret = "s3cr3t-value-that-must-not-leak";
    let out = env_report(
        home.path(),
        &[],
        &[
            ("ACCELERATE_RS_SECRET", secret),
            ("ACCELERATE_RS_CONFIG_FILE", cfg.to_str().unwrap()),
            ("RANK", "1"),
            ("WORLD_SIZE", "4"),
        ],
    );
    let text = stdout(&out);
    let cpus = std::thread::available_parallelism().unwrap().get();
    for want in [
        format!("- accelerate-rs version: {}", env!("CARGO_PKG_VERSION")),
        format!("- CPU count: {cpus}"),
        format!(
            "- Config file: {} (from ACCELERATE_RS_CONFIG_FILE)",
            cfg.display()
        ),
        "num_processes = 3".to_string(),
        "mixed_precision = \"bf16\"".to_string(),
        "- ACCELERATE_RS_SECRET: (set)".to_string(),
        "- RANK: 1".to_string(),
        "- WORLD_SIZE: 4".to_string(),
        "- Candle (candle-core requirement): 0.11".to_string(),
        "- CUDA: not built (enable the `cuda` feature)".to_string(),
        "- GPUs seen: none: built without CUDA".to_string(),
    ] {
        assert!(text.contains(&want), "missing {want:?} in:\n{text}");
    }
    assert!(!text.contains(secret), "secret leaked:\n{text}");
    assert!(!String::from_utf8_lossy(&out.stderr).contains(secret));
}

#[test]
fn env_without_a_config_file_says_not_found() {
    let home = tempfile::tempdir().unwrap();
    let text = stdout(&env_report(home.path(), &[], &[]));
    let default = home.path().join("xdg/accelerate-rs/default_config.toml");
    assert!(
        text.contains(&format!(
            "- Config file: {} (from default location)",
            default.display()
        )),
        "{text}"
    );
    assert!(text.contains("- Config file status: not found"), "{text}");
    assert!(!text.contains("ACCELERATE_RS_SECRET"), "{text}");
}

#[test]
fn env_reports_a_malformed_config_instead_of_failing() {
    let home = tempfile::tempdir().unwrap();
    let cfg = home.path().join("bad.toml");
    std::fs::write(&cfg, "num_machines = 0\n").unwrap();
    let text = stdout(&env_report(
        home.path(),
        &["--config-file", cfg.to_str().unwrap()],
        &[],
    ));
    assert!(
        text.contains("- Config file status: invalid")
            && text.contains("`num_machines`")
            && text.contains("from 1 to"),
        "{text}"
    );
    assert!(text.contains("(from --config-file)"), "{text}");
}

#[test]
fn gpus_prints_only_the_count_this_build_sees() {
    let home = tempfile::tempdir().unwrap();
    let out = env_report(home.path(), &["--gpus"], &[("CUDA_VISIBLE_DEVICES", "")]);
    let text = stdout(&out);
    let n: usize = text
        .trim()
        .parse()
        .unwrap_or_else(|e| panic!("`env --gpus` printed {text:?}, not a count: {e}"));
    // This test machine has no GPU (and CUDA_VISIBLE_DEVICES="" hides any), so 0.
    assert_eq!(n, 0, "{text:?}");
    assert_eq!(text.lines().count(), 1, "{text:?}");
}
