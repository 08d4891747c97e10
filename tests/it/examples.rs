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
