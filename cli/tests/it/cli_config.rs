//! End-to-end tests of `accelerate-rs config` (questions, flags, `default`, `show`) with the real
//! binary. Every config path, `HOME` and `XDG_CONFIG_HOME` live in a temporary directory, so the
//! user's real config is never read or written.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use accelerate_rs::{ConfigFile, MixedPrecision};

/// A private home: `HOME` and `XDG_CONFIG_HOME` point into it.
struct Home {
    dir: tempfile::TempDir,
}

impl Home {
    fn new() -> Self {
        Home {
            dir: tempfile::tempdir().unwrap(),
        }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// Where the platform default config lives inside this home.
    fn default_config(&self) -> PathBuf {
        self.path("xdg/accelerate-rs/default_config.toml")
    }

    /// The binary with `args`, this home, no inherited accelerate-rs variables and stdin closed.
    fn cmd(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_accelerate-rs"));
        cmd.args(args);
        self.prepare(cmd)
    }

    /// `cmd` with this home, no inherited accelerate-rs variables and stdin closed.
    fn prepare(&self, mut cmd: Command) -> Command {
        cmd.env("HOME", self.dir.path())
            .env("XDG_CONFIG_HOME", self.path("xdg"))
            .env_remove("RUST_LOG")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        for (k, _) in std::env::vars_os() {
            if k.to_string_lossy().starts_with("ACCELERATE_RS_") {
                cmd.env_remove(k);
            }
        }
        cmd
    }
}

struct Out {
    ok: bool,
    stdout: String,
    stderr: String,
}

/// Waits for `child`, killing it and failing the test after 10 s.
fn finish(mut child: Child) -> Out {
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("accelerate-rs did not finish within 10 s (it must not wait for input)");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut stdout = String::new();
    let mut stderr = String::new();
    child
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut stdout)
        .unwrap();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .unwrap();
    Out {
        ok: status.success(),
        stdout,
        stderr,
    }
}

fn run(mut cmd: Command) -> Out {
    finish(cmd.spawn().unwrap())
}

/// Runs `cmd` with `input` on its stdin (then closed).
fn run_with_input(mut cmd: Command, input: &str) -> Out {
    cmd.stdin(Stdio::piped());
    let mut child = cmd.spawn().unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    finish(child)
}

fn ok(out: Out) -> Out {
    assert!(
        out.ok,
        "failed:\nstdout:\n{}\nstderr:\n{}",
        out.stdout, out.stderr
    );
    out
}

fn fails(out: Out) -> Out {
    assert!(!out.ok, "unexpectedly succeeded:\nstdout:\n{}", out.stdout);
    out
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn answers_from_stdin_round_trip_with_a_reasked_answer() {
    let home = Home::new();
    let file = home.path("sub/dir/cfg.toml");
    // gpu, 2 machines, rank 1, ip, port, a bad process count then 3, GPU ids, fp16, 4 steps, 90 s,
    // ZeRO stage 3.
    let answers = "gpu\n2\n1\n10.1.2.3\n29600\nthree\n3\n0,1\nfp16\n4\n90\n3\n";
    let out = ok(run_with_input(
        home.cmd(&["config", "--answers-from-stdin", "--config-file", s(&file)]),
        answers,
    ));
    assert!(
        out.stderr.contains("expected a whole number") && out.stderr.contains("\"three\""),
        "{}",
        out.stderr
    );
    assert_eq!(
        out.stderr
            .matches("Number of processes per machine")
            .count(),
        2,
        "{}",
        out.stderr
    );
    assert!(out.stdout.contains(s(&file)), "{}", out.stdout);

    let want = ConfigFile {
        use_cpu: Some(false),
        num_machines: Some(2),
        machine_rank: Some(1),
        main_process_ip: Some("10.1.2.3".into()),
        main_process_port: Some(29600),
        num_processes: Some(3),
        gpu_ids: Some("0,1".into()),
        mixed_precision: Some(MixedPrecision::Fp16),
        gradient_accumulation_steps: Some(4),
        collective_timeout_secs: Some(90.0),
        zero_stage: Some(3),
        ..ConfigFile::default()
    };
    assert_eq!(ConfigFile::load(&file).unwrap(), want);

    let show = ok(run(home.cmd(&[
        "config",
        "show",
        "--config-file",
        s(&file),
    ])));
    for line in [
        "use_cpu = false",
        "num_machines = 2",
        "machine_rank = 1",
        "main_process_ip = \"10.1.2.3\"",
        "main_process_port = 29600",
        "num_processes = 3",
        "gpu_ids = \"0,1\"",
        "mixed_precision = \"fp16\"",
        "gradient_accumulation_steps = 4",
        "collective_timeout_secs = 90",
        "zero_stage = 3",
    ] {
        assert!(
            show.stdout.contains(line),
            "missing {line}:\n{}",
            show.stdout
        );
    }
    assert!(show.stdout.contains(s(&file)), "{}", show.stdout);
    // Nothing was written to the default location.
    assert!(!home.default_config().exists());
}

#[test]
fn end_of_input_accepts_the_remaining_defaults() {
    let home = Home::new();
    let file = home.path("cfg.toml");
    ok(run_with_input(
        home.cmd(&["config", "--answers-from-stdin", "--config-file", s(&file)]),
        "cpu\n1\n1\nbf16\n",
    ));
    let cfg = ConfigFile::load(&file).unwrap();
    assert_eq!(cfg.use_cpu, Some(true));
    assert_eq!(cfg.num_processes, Some(1));
    assert_eq!(cfg.mixed_precision, Some(MixedPrecision::Bf16));
    assert_eq!(cfg.gradient_accumulation_steps, Some(1));
    assert_eq!(cfg.collective_timeout_secs, Some(1800.0));
}

#[test]
fn three_bad_answers_are_an_error_naming_the_key() {
    let home = Home::new();
    let file = home.path("cfg.toml");
    let out = fails(run_with_input(
        home.cmd(&["config", "--answers-from-stdin", "--config-file", s(&file)]),
        "cpu\n1\n2\nbf17\nbf18\nbf19\n",
    ));
    assert!(
        out.stderr.contains("mixed_precision") && out.stderr.contains("no, bf16 or fp16"),
        "{}",
        out.stderr
    );
    assert!(!file.exists());
}

#[test]
fn flags_round_trip_without_questions() {
    let home = Home::new();
    let file = home.path("flags.toml");
    let out = ok(run(home.cmd(&[
        "config",
        "--config-file",
        s(&file),
        "--cpu",
        "--num-machines",
        "3",
        "--machine-rank",
        "2",
        "--main-process-ip",
        "node0",
        "--main-process-port",
        "12345",
        "--num-processes",
        "4",
        "--mixed-precision",
        "bf16",
        "--gradient-accumulation-steps",
        "8",
        "--collective-timeout-secs",
        "30.5",
        "--max-restarts",
        "2",
        "--monitor-interval-secs",
        "0.5",
        "--bucket-cap-mb",
        "10",
    ])));
    assert!(!out.stderr.contains("Number of"), "asked: {}", out.stderr);
    let want = ConfigFile {
        use_cpu: Some(true),
        num_machines: Some(3),
        machine_rank: Some(2),
        main_process_ip: Some("node0".into()),
        main_process_port: Some(12345),
        num_processes: Some(4),
        gpu_ids: None,
        mixed_precision: Some(MixedPrecision::Bf16),
        gradient_accumulation_steps: Some(8),
        collective_timeout_secs: Some(30.5),
        bucket_cap_mb: Some(10.0),
        tune_malloc: None,
        transport: None,
        missing_gradients: None,
        nonfinite: None,
        zero_stage: None,
        offload_optimizer: None,
        split_batches: None,
        max_restarts: Some(2),
        monitor_interval_secs: Some(0.5),
    };
    assert_eq!(ConfigFile::load(&file).unwrap(), want);
    assert!(out.stdout.contains("max_restarts = 2"), "{}", out.stdout);

    // One flag is enough; the rest get defaults.
    let file2 = home.path("one.toml");
    ok(run(home.cmd(&[
        "config",
        "--config-file",
        s(&file2),
        "--num-processes",
        "2",
    ])));
    let cfg = ConfigFile::load(&file2).unwrap();
    assert_eq!(cfg.num_processes, Some(2));
    assert_eq!(cfg.use_cpu, Some(true));
    assert_eq!(cfg.num_machines, Some(1));
    assert_eq!(cfg.mixed_precision, Some(MixedPrecision::No));
}

#[test]
fn bad_flags_name_the_flag_and_the_expected_form() {
    let home = Home::new();
    let file = home.path("bad.toml");
    for (args, want) in [
        (&["--num-processes", "0"][..], "--num-processes"),
        (&["--gpu-ids", "zero"][..], "--gpu-ids"),
        (&["--mixed-precision", "fp8"][..], "--mixed-precision"),
        (&["--collective-timeout-secs", "-1"][..], "above 0"),
        (&["--collective-timeout-secs", "1e19"][..], "at most 604800"),
        (&["--num-machines", "100000000"][..], "--num-machines"),
        (&["--num-machines", "2"][..], "--main-process-ip"),
        (&["--machine-rank", "1"][..], "--machine-rank"),
        (&["--main-process-port", "70000"][..], "--main-process-port"),
    ] {
        let mut all = vec!["config", "--config-file", s(&file)];
        all.extend_from_slice(args);
        let out = fails(run(home.cmd(&all)));
        assert!(out.stderr.contains(want), "{args:?}: {}", out.stderr);
        assert!(!file.exists(), "{args:?} wrote the file");
    }
}

#[test]
fn default_then_show_and_no_overwrite_without_force() {
    let home = Home::new();
    let file = home.path("d/default.toml");
    let out = ok(run(home.cmd(&[
        "config",
        "default",
        "--config-file",
        s(&file),
    ])));
    assert!(out.stdout.contains(s(&file)), "{}", out.stdout);
    let cfg = ConfigFile::load(&file).unwrap();
    assert_eq!(cfg.use_cpu, Some(true), "this build has no CUDA");
    assert!(cfg.num_processes.unwrap() >= 1);

    let show = ok(run(home.cmd(&[
        "config",
        "show",
        "--config-file",
        s(&file),
    ])));
    assert!(show.stdout.contains("use_cpu = true"), "{}", show.stdout);
    assert!(show.stdout.contains(s(&file)), "{}", show.stdout);

    std::fs::write(&file, "num_processes = 7\n").unwrap();
    let out = fails(run(home.cmd(&[
        "config",
        "default",
        "--config-file",
        s(&file),
    ])));
    assert!(
        out.stderr.contains(s(&file)) && out.stderr.contains("--force"),
        "{}",
        out.stderr
    );
    assert_eq!(
        std::fs::read_to_string(&file).unwrap(),
        "num_processes = 7\n"
    );
    ok(run(home.cmd(&[
        "config",
        "default",
        "--config-file",
        s(&file),
        "--force",
    ])));
    assert_eq!(ConfigFile::load(&file).unwrap().use_cpu, Some(true));
}

#[test]
fn default_location_is_under_the_config_dir() {
    let home = Home::new();
    ok(run(home.cmd(&["config", "default"])));
    assert!(home.default_config().exists());
    let show = ok(run(home.cmd(&["config", "show"])));
    assert!(
        show.stdout.contains(s(&home.default_config())),
        "{}",
        show.stdout
    );
}

#[test]
fn no_terminal_and_no_flags_exits_at_once_with_advice() {
    let home = Home::new();
    let file = home.path("never.toml");
    // stdin closed.
    let started = Instant::now();
    let out = fails(run(home.cmd(&["config", "--config-file", s(&file)])));
    assert!(started.elapsed() < Duration::from_secs(10));
    for want in ["config default", "--num-processes", "--answers-from-stdin"] {
        assert!(out.stderr.contains(want), "missing {want}: {}", out.stderr);
    }
    // stdin a pipe that stays open: it must not read (and so must not hang).
    let mut cmd = home.cmd(&["config", "--config-file", s(&file)]);
    cmd.stdin(Stdio::piped());
    let mut child = cmd.spawn().unwrap();
    let stdin = child.stdin.take();
    let out = fails(finish(child));
    drop(stdin);
    assert!(out.stderr.contains("config default"), "{}", out.stderr);
    assert!(!file.exists());
}

#[test]
fn show_missing_file_says_how_to_create_it() {
    let home = Home::new();
    let file = home.path("missing.toml");
    let out = fails(run(home.cmd(&[
        "config",
        "show",
        "--config-file",
        s(&file),
    ])));
    assert!(
        out.stderr.contains(s(&file))
            && out.stderr.contains("not found")
            && out.stderr.contains("config default"),
        "{}",
        out.stderr
    );
}

#[test]
fn malformed_files_name_file_and_key() {
    let home = Home::new();
    for (name, text, key, expected) in [
        (
            "unknown.toml",
            "use_cpu = true\nnum_procs = 2\n",
            "num_procs",
            "expected one of",
        ),
        (
            "type.toml",
            "num_processes = \"two\"\n",
            "num_processes",
            "whole number",
        ),
        (
            "range.toml",
            "collective_timeout_secs = 0\n",
            "collective_timeout_secs",
            "above 0",
        ),
    ] {
        let file = home.path(name);
        std::fs::write(&file, text).unwrap();
        let out = fails(run(home.cmd(&[
            "config",
            "show",
            "--config-file",
            s(&file),
        ])));
        assert!(
            out.stderr.contains(s(&file))
                && out.stderr.contains(&format!("`{key}`"))
                && out.stderr.contains(expected),
            "{name}: {}",
            out.stderr
        );
        // `env` still prints its report, with the config error in it.
        let env = ok(run(home.cmd(&["env", "--config-file", s(&file)])));
        assert!(
            env.stdout.contains("invalid") && env.stdout.contains(key),
            "{name}: {}",
            env.stdout
        );
        assert!(
            env.stdout.contains("accelerate-rs version"),
            "{}",
            env.stdout
        );
    }
}

#[test]
fn config_file_variable_is_honoured_by_config_and_show() {
    let home = Home::new();
    let file = home.path("from-env/cfg.toml");
    let mut cmd = home.cmd(&["config", "--cpu", "--num-processes", "5"]);
    cmd.env("ACCELERATE_RS_CONFIG_FILE", &file);
    ok(run(cmd));
    assert_eq!(ConfigFile::load(&file).unwrap().num_processes, Some(5));
    assert!(!home.default_config().exists());

    let mut cmd = home.cmd(&["config", "show"]);
    cmd.env("ACCELERATE_RS_CONFIG_FILE", &file);
    let show = ok(run(cmd));
    assert!(
        show.stdout.contains(s(&file)) && show.stdout.contains("num_processes = 5"),
        "{}",
        show.stdout
    );

    // --config-file beats the variable.
    let other = home.path("other.toml");
    let mut cmd = home.cmd(&["config", "default", "--config-file", s(&other)]);
    cmd.env("ACCELERATE_RS_CONFIG_FILE", &file);
    ok(run(cmd));
    assert!(other.exists());
    assert_eq!(ConfigFile::load(&file).unwrap().num_processes, Some(5));
}

/// The questions on a real terminal, through `script` (util-linux) when it is installed.
#[test]
fn questions_on_a_pseudo_terminal() {
    let has_script = Command::new("script")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !has_script {
        eprintln!("skipped: `script` is not installed");
        return;
    }
    let home = Home::new();
    let file = home.path("pty.toml");
    let bin = env!("CARGO_BIN_EXE_accelerate-rs");
    let inner = format!("'{bin}' config --config-file '{}'", s(&file));
    let mut script = Command::new("script");
    script.args(["-qec", &inner, "/dev/null"]);
    let out = run_with_input(home.prepare(script), "cpu\n1\n2\nno\n1\n60\n");
    assert!(out.ok, "{}\n{}", out.stdout, out.stderr);
    let cfg = ConfigFile::load(&file).unwrap();
    assert_eq!(cfg.num_processes, Some(2));
    assert_eq!(cfg.collective_timeout_secs, Some(60.0));
}
