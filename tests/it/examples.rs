//! The example binaries carry their data: a binary built on one machine runs on another (a GPU
//! node without the repository), and `--help` shows no path of the machine that built it.

use std::path::PathBuf;
use std::process::{Command, Output, Stdio};

/// `target/<profile>/examples/<name>` (built by `cargo test`, which builds the examples).
fn example(name: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let profile_dir = exe.parent().and_then(|d| d.parent()).unwrap();
    let path = profile_dir.join("examples").join(name);
    assert!(
        path.exists(),
        "{} is missing: run the whole `cargo test` (it builds the examples)",
        path.display()
    );
    path
}

/// Runs the example from an empty directory, far from the repository.
fn run(name: &str, args: &[&str]) -> Output {
    let dir = tempfile::tempdir().unwrap();
    Command::new(example(name))
        .args(args)
        .current_dir(dir.path())
        .env_remove("RANK")
        .env_remove("WORLD_SIZE")
        .env("ACCELERATE_RS_USE_CPU", "1")
        .stdin(Stdio::null())
        .output()
        .unwrap()
}

#[test]
fn help_shows_no_build_path() {
    let build_dir = env!("CARGO_MANIFEST_DIR");
    for name in ["digits", "digits_plain", "transformer_lm"] {
        let out = run(name, &["--help"]);
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{name} --help failed: {text}");
        assert!(
            !text.contains(build_dir),
            "{name} --help shows the build directory {build_dir}:\n{text}"
        );
    }
}

#[test]
fn digits_trains_on_its_built_in_data_away_from_the_repository() {
    let out = run("digits_plain", &["--epochs", "1"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "digits_plain failed away from the repository: {text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("final test accuracy"), "{text}");
    // A file given with --data still wins, and a missing one is named.
    let out = run(
        "digits_plain",
        &["--epochs", "1", "--data", "no-such.csv.gz"],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("no-such.csv.gz"), "{err}");
}

/// Code lines (doc comments left out) of `examples/<name>.rs`.
fn code_lines(name: &str) -> Vec<String> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("examples/{name}.rs"));
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .filter(|l| !l.trim_start().starts_with("//!"))
        .map(str::to_string)
        .collect()
}

/// The length of the longest common subsequence of two line lists.
fn lcs(a: &[String], b: &[String]) -> usize {
    let mut row = vec![0usize; b.len() + 1];
    for x in a {
        let mut prev = 0;
        for (j, y) in b.iter().enumerate() {
            let keep = row[j + 1];
            row[j + 1] = if x == y {
                prev + 1
            } else {
                row[j + 1].max(row[j])
            };
            prev = keep;
        }
    }
    row[b.len()]
}

/// The last `weights [[...]]` line printed, as numbers.
fn weights(text: &str) -> Vec<f32> {
    let line = text
        .lines()
        .rev()
        .find_map(|l| l.split("weights ").nth(1))
        .unwrap_or_else(|| panic!("no weights line in:\n{text}"));
    line.trim_matches(|c| c == '[' || c == ']')
        .split(',')
        .map(|v| v.trim().parse().unwrap())
        .collect()
}

#[test]
fn a_manual_batching_loop_converts_in_at_most_ten_lines_and_matches_at_any_world_size() {
    let (plain, converted) = (code_lines("regression_plain"), code_lines("regression"));
    let common = lcs(&plain, &converted);
    let (added, removed) = (converted.len() - common, plain.len() - common);
    assert!(
        added <= 10 && removed <= 10,
        "{added} lines added or changed, {removed} removed"
    );

    let reference = weights(&String::from_utf8_lossy(
        &run("regression_plain", &[]).stdout,
    ));
    let one = weights(&String::from_utf8_lossy(&run("regression", &[]).stdout));
    assert_eq!(reference, one, "one process differs from the plain loop");
    for n in ["2", "4"] {
        let out = Command::new(crate::common::launcher())
            .args(["launch", "--cpu", "-n", n])
            .arg(example("regression"))
            .env_remove("RUST_LOG")
            .stdin(Stdio::null())
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        assert!(
            out.status.success(),
            "{n} processes: {text}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let got = weights(&text);
        let diff = reference
            .iter()
            .zip(&got)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(
            diff < 1e-5,
            "{n} processes end {diff} away from one: {got:?} vs {reference:?}"
        );
        // The printed loss is the mean over all ranks, not rank 0's share.
        assert_eq!(
            text.lines().filter(|l| l.contains("epoch 9 loss")).count(),
            1,
            "{text}"
        );
    }
}
