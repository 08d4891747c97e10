//! End-to-end tests of `accelerate-rs launch`'s options with real worker processes: restarts,
//! ports, multi-machine flags, dry runs, the config file, per-rank logs, the failing rank's last
//! lines, the no-GPU notice and absurd numbers.

use std::net::TcpListener;
use std::time::Duration;

use nix::sys::signal::Signal;

use crate::launch::*;

#[test]
fn max_restarts_1_restarts_once_and_a_second_attempt_can_succeed() {
    // Rank 1 fails the first attempt only once rank 0 has printed its line (under load the
    // launcher could otherwise stop rank 0 before its shell ran `echo`).
    let dir = tempfile::tempdir().unwrap();
    let started = dir.path().join("rank0-started");
    let script = format!(
        "echo attempt=$ACCELERATE_RS_RESTART_COUNT port=$MASTER_PORT; \
        if [ \"$ACCELERATE_RS_RESTART_COUNT\" = 0 ] && [ \"$RANK\" = 0 ]; then touch '{f}'; fi; \
        if [ \"$ACCELERATE_RS_RESTART_COUNT\" = 0 ] && [ \"$RANK\" = 1 ]; then \
          i=0; while [ ! -e '{f}' ] && [ $i -lt 200 ]; do sleep 0.05; i=$((i+1)); done; exit 3; fi; \
        if [ \"$ACCELERATE_RS_RESTART_COUNT\" = 0 ]; then exec sleep 60; fi; exit 0",
        f = started.display()
    );
    let (out, elapsed) = run_with_limit(
        launcher().args([
            "launch",
            "--max-restarts",
            "1",
            "-n",
            "2",
            "sh",
            "-c",
            &script,
        ]),
        Duration::from_secs(15),
    );
    let stderr = text(&out.stderr);
    assert!(out.status.success(), "stderr: {stderr}");
    assert!(elapsed < Duration::from_secs(10), "{elapsed:?}");
    let lines = by_rank(&text(&out.stdout));
    for rank in 0..2 {
        let attempts: Vec<String> = lines[&rank]
            .iter()
            .map(|l| kv(l)["attempt"].clone())
            .collect();
        assert_eq!(attempts, ["0", "1"], "rank {rank}");
    }
    assert_eq!(
        stderr.matches("restarting the worker group").count(),
        1,
        "{stderr}"
    );
    assert!(stderr.contains("restart 1 of 1"), "{stderr}");
    assert!(
        stderr.contains("rank 1") && stderr.contains("exited with code 3"),
        "{stderr}"
    );
}

#[test]
fn max_restarts_1_gives_up_after_exactly_2_attempts() {
    let script = "echo attempt=$ACCELERATE_RS_RESTART_COUNT; \
        if [ \"$RANK\" = 1 ]; then exit 3; fi; exec sleep 60";
    let (out, elapsed) = run_with_limit(
        launcher().args([
            "launch",
            "--max-restarts",
            "1",
            "-n",
            "2",
            "sh",
            "-c",
            script,
        ]),
        Duration::from_secs(15),
    );
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "stderr: {stderr}");
    assert!(elapsed < Duration::from_secs(10), "{elapsed:?}");
    let lines = by_rank(&text(&out.stdout));
    assert_eq!(lines[&1], ["attempt=0", "attempt=1"]);
    assert_eq!(
        stderr.matches("restarting the worker group").count(),
        1,
        "{stderr}"
    );
    assert_eq!(stderr.matches("exited with code 3;").count(), 2, "{stderr}");
    assert!(stderr.contains("giving up after 1 restart(s)"), "{stderr}");
}

#[test]
fn ctrl_c_is_never_followed_by_a_restart() {
    let dir = tempfile::tempdir().expect("tempdir");
    let script = "echo $$ > \"$0/pid.$RANK.tmp\" && mv \"$0/pid.$RANK.tmp\" \"$0/pid.$RANK\"; \
                  exec sleep 60";
    let (_, stderr) = interrupt_with(
        &["--max-restarts", "3"],
        dir.path(),
        script,
        &[Signal::SIGINT],
        130,
        "SIGINT",
    );
    assert!(!stderr.contains("restarting"), "{stderr}");
}

#[test]
fn port_0_picks_a_free_port_and_a_busy_port_is_replaced_with_a_warning() {
    let (out, _) = run_launch(&[
        "--main-process-port",
        "0",
        "sh",
        "-c",
        "echo P=$MASTER_PORT",
    ]);
    assert!(out.status.success(), "stderr: {}", text(&out.stderr));
    let p: u16 = kv(&by_rank(&text(&out.stdout))[&0][0])["P"]
        .parse()
        .expect("port");
    assert_ne!(p, 0);

    let busy = TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = busy.local_addr().expect("addr").port().to_string();
    let (out, _) = run_launch(&[
        "--main-process-port",
        &port,
        "-n",
        "2",
        "sh",
        "-c",
        "echo P=$MASTER_PORT",
    ]);
    let stderr = text(&out.stderr);
    assert!(out.status.success(), "stderr: {stderr}");
    let lines = by_rank(&text(&out.stdout));
    let used = kv(&lines[&0][0])["P"].clone();
    assert_ne!(used, port);
    assert_eq!(kv(&lines[&1][0])["P"], used);
    assert!(
        stderr.contains("warning") && stderr.contains(&port) && stderr.contains(&used),
        "{stderr}"
    );

    // --quiet silences the warning but not the workers.
    let (out, _) = run_launch(&[
        "--quiet",
        "--main-process-port",
        &port,
        "sh",
        "-c",
        "echo P=$MASTER_PORT",
    ]);
    assert!(out.status.success());
    assert_eq!(text(&out.stderr), "");
    assert_ne!(kv(&by_rank(&text(&out.stdout))[&0][0])["P"], port);
    drop(busy);
}

#[test]
fn multi_machine_options_are_validated_naming_the_flag() {
    let busy = TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = busy.local_addr().expect("addr").port().to_string();
    let multi = |extra: &[&str], secret: Option<&str>| {
        let mut cmd = launcher();
        cmd.args(["launch", "--num-machines", "2", "-n", "1"])
            .args(extra)
            .args(["sh", "-c", "echo ran"]);
        if let Some(s) = secret {
            cmd.env("ACCELERATE_RS_SECRET", s);
        }
        let out = cmd.output().expect("run");
        assert!(!out.status.success(), "{extra:?} should fail");
        assert_eq!(text(&out.stdout), "", "{extra:?}: nothing may start");
        text(&out.stderr)
    };
    let ip = ["--main-process-ip", "127.0.0.1"];
    // Machine rank 0 with a busy port.
    let err = multi(
        &[
            &ip[..],
            &["--machine-rank", "0", "--main-process-port", &port],
        ]
        .concat(),
        Some("s3cret"),
    );
    assert!(
        err.contains(&format!("port {port}")) && err.contains("in use"),
        "{err}"
    );
    // No port.
    let err = multi(
        &[&ip[..], &["--machine-rank", "1"]].concat(),
        Some("s3cret"),
    );
    assert!(err.contains("--main-process-port"), "{err}");
    // No address.
    let err = multi(
        &["--machine-rank", "1", "--main-process-port", &port],
        Some("s"),
    );
    assert!(err.contains("--main-process-ip"), "{err}");
    // Machine rank out of range.
    let err = multi(
        &[
            &ip[..],
            &["--machine-rank", "2", "--main-process-port", &port],
        ]
        .concat(),
        Some("s"),
    );
    assert!(err.contains("--machine-rank"), "{err}");
    // No shared secret.
    let err = multi(
        &[
            &ip[..],
            &["--machine-rank", "1", "--main-process-port", &port],
        ]
        .concat(),
        None,
    );
    assert!(
        err.contains("export the same ACCELERATE_RS_SECRET on every machine"),
        "{err}"
    );
    drop(busy);
}

#[test]
fn dry_run_prints_every_worker_and_starts_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let marker = dir.path().join("created");
    let out = launcher()
        .env("ACCELERATE_RS_SECRET", "do-not-print-this-secret")
        .args([
            "launch",
            "--dry-run",
            "--cpu",
            "--mixed-precision",
            "bf16",
            "-n",
            "2",
            "sh",
            "-c",
        ])
        .arg(format!("touch {}", marker.display()))
        .output()
        .expect("run");
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "stderr: {}", text(&out.stderr));
    std::thread::sleep(Duration::from_millis(200));
    assert!(!marker.exists(), "the dry run started a worker");
    assert!(!stdout.contains("do-not-print-this-secret"), "{stdout}");
    assert_eq!(
        stdout.matches("ACCELERATE_RS_SECRET=<redacted>").count(),
        2,
        "{stdout}"
    );
    for needle in [
        "rank 0 (local rank 0)",
        "rank 1 (local rank 1)",
        "  RANK=0\n",
        "  RANK=1\n",
        "  WORLD_SIZE=2\n",
        "  LOCAL_WORLD_SIZE=2\n",
        "  MASTER_ADDR=127.0.0.1\n",
        "  ACCELERATE_RS_USE_CPU=1\n",
        "  ACCELERATE_RS_MIXED_PRECISION=bf16\n",
        "  command: sh -c 'touch ",
    ] {
        assert!(stdout.contains(needle), "missing {needle:?} in\n{stdout}");
    }
}

const PRINT_SETTINGS: &str = "echo R=$RANK C=${ACCELERATE_RS_USE_CPU:-unset} \
    MP=${ACCELERATE_RS_MIXED_PRECISION:-unset} GA=${ACCELERATE_RS_GRADIENT_ACCUMULATION_STEPS:-unset} \
    TO=${ACCELERATE_RS_TIMEOUT_SECS:-unset} GPU=${CUDA_VISIBLE_DEVICES:-unset}";

#[test]
fn config_file_values_apply_and_flags_override_them() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = dir.path().join("cfg.toml");
    std::fs::write(
        &cfg,
        "num_processes = 3\nuse_cpu = true\nmixed_precision = \"bf16\"\n\
         gradient_accumulation_steps = 4\ncollective_timeout_secs = 12.5\ngpu_ids = \"0,1\"\n",
    )
    .expect("write config");
    let cfg_arg = cfg.to_str().expect("utf-8 path");
    let (out, _) = run_launch(&["--config-file", cfg_arg, "sh", "-c", PRINT_SETTINGS]);
    assert!(out.status.success(), "stderr: {}", text(&out.stderr));
    let lines = by_rank(&text(&out.stdout));
    assert_eq!(lines.len(), 3);
    let v = kv(&lines[&2][0]);
    assert_eq!(
        (&*v["C"], &*v["MP"], &*v["GA"], &*v["TO"], &*v["GPU"]),
        ("1", "bf16", "4", "12.5", "0,1")
    );

    // Through ACCELERATE_RS_CONFIG_FILE, with flags overriding.
    let out = launcher()
        .env("ACCELERATE_RS_CONFIG_FILE", &cfg)
        .args([
            "launch",
            "-n",
            "2",
            "--mixed-precision",
            "fp16",
            "--gradient-accumulation-steps",
            "2",
            "--collective-timeout-secs",
            "3",
            "--gpu-ids",
            "all",
            "sh",
            "-c",
            PRINT_SETTINGS,
        ])
        .output()
        .expect("run");
    assert!(out.status.success(), "stderr: {}", text(&out.stderr));
    let lines = by_rank(&text(&out.stdout));
    assert_eq!(lines.len(), 2);
    let v = kv(&lines[&1][0]);
    assert_eq!(
        (&*v["C"], &*v["MP"], &*v["GA"], &*v["TO"], &*v["GPU"]),
        ("1", "fp16", "2", "3", "unset")
    );

    // Without config or flags nothing extra is exported.
    let (out, _) = run_launch(&["sh", "-c", PRINT_SETTINGS]);
    let v = kv(&by_rank(&text(&out.stdout))[&0][0]);
    assert_eq!(
        (&*v["C"], &*v["MP"], &*v["GA"], &*v["TO"], &*v["GPU"]),
        ("unset", "unset", "unset", "unset", "unset")
    );
}

#[test]
fn a_malformed_config_file_is_reported_with_file_and_key() {
    let dir = tempfile::tempdir().expect("tempdir");
    for (body, key) in [
        ("num_procs = 2\n", "num_procs"),
        ("num_processes = \"two\"\n", "num_processes"),
    ] {
        let cfg = dir.path().join("bad.toml");
        std::fs::write(&cfg, body).expect("write config");
        let (out, _) = run_launch(&[
            "--config-file",
            cfg.to_str().expect("utf-8"),
            "sh",
            "-c",
            "echo ran",
        ]);
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{stderr}");
        assert_eq!(text(&out.stdout), "");
        assert!(stderr.contains(cfg.to_str().expect("utf-8")), "{stderr}");
        assert!(stderr.contains(key), "{stderr}");
    }
}

#[test]
fn tee_writes_per_rank_log_files() {
    let dir = tempfile::tempdir().expect("tempdir");
    let logs = dir.path().join("logs");
    let script = "echo out $RANK a; echo err $RANK >&2; echo out $RANK b";
    let (out, _) = run_launch(&[
        "--tee",
        "--log-dir",
        logs.to_str().expect("utf-8"),
        "-n",
        "2",
        "sh",
        "-c",
        script,
    ]);
    assert!(out.status.success(), "stderr: {}", text(&out.stderr));
    for rank in 0..2 {
        let read = |name: String| std::fs::read_to_string(logs.join(name)).expect("log file");
        assert_eq!(
            read(format!("rank_{rank}.stdout.log")),
            format!("out {rank} a\nout {rank} b\n")
        );
        assert_eq!(
            read(format!("rank_{rank}.stderr.log")),
            format!("err {rank}\n")
        );
    }
    // The terminal still gets everything.
    assert_eq!(by_rank(&text(&out.stdout))[&1], ["out 1 a", "out 1 b"]);

    // --tee alone: a default directory under the working directory, printed.
    let out = launcher()
        .current_dir(dir.path())
        .args(["launch", "--tee", "sh", "-c", "echo hello"])
        .output()
        .expect("run");
    let stderr = text(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("accelerate-rs-logs"), "{stderr}");
    let base = dir.path().join("accelerate-rs-logs");
    let run_dir = std::fs::read_dir(&base)
        .expect("default log dir")
        .next()
        .expect("one run")
        .expect("entry")
        .path();
    assert_eq!(
        std::fs::read_to_string(run_dir.join("rank_0.stdout.log")).expect("log"),
        "hello\n"
    );
}

#[test]
fn the_failing_ranks_last_lines_are_shown_again_at_the_end() {
    // Rank 1 prints 30 lines and fails; rank 0 keeps printing noise until it is stopped.
    let script = "if [ \"$RANK\" = 1 ]; then \
          i=0; while [ $i -lt 30 ]; do echo \"line $i\"; i=$((i+1)); done; \
          sleep 0.05; echo 'Traceback: boom' >&2; sleep 0.1; exit 2; \
        fi; while :; do echo noise; sleep 0.01; done";
    let (out, _) = run_with_limit(
        launcher().args(["launch", "-n", "2", "sh", "-c", script]),
        Duration::from_secs(15),
    );
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    let (_, report) = stderr
        .split_once("last 20 line(s) of rank 1's output:")
        .unwrap_or_else(|| panic!("no tail in {stderr}"));
    let tail: Vec<&str> = report
        .lines()
        .filter_map(|l| l.strip_prefix("  [rank 1] "))
        .collect();
    let expected: Vec<String> = (11..30)
        .map(|i| format!("line {i}"))
        .chain(["Traceback: boom".to_string()])
        .collect();
    assert_eq!(tail, expected, "{stderr}");
}

#[test]
fn the_error_line_is_reprinted_even_when_a_backtrace_follows_it() {
    // What `main` returning `Err` prints under RUST_BACKTRACE=1: the error, then a long trace.
    let script = "if [ \"$RANK\" = 1 ]; then \
          echo 'Error: data: shard 7 is truncated' >&2; echo '' >&2; \
          echo 'Stack backtrace:' >&2; i=0; while [ $i -lt 40 ]; do \
          echo \"  $i: std::rt::lang_start\" >&2; i=$((i+1)); done; exit 1; \
        fi; sleep 30";
    let (out, _) = run_with_limit(
        launcher().args(["launch", "-n", "2", "sh", "-c", script]),
        Duration::from_secs(15),
    );
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    let (_, report) = stderr
        .split_once("of rank 1's output:")
        .unwrap_or_else(|| panic!("no tail in {stderr}"));
    let shown: Vec<&str> = report
        .lines()
        .filter_map(|l| l.strip_prefix("  [rank 1] "))
        .collect();
    assert_eq!(shown[0], "Error: data: shard 7 is truncated", "{stderr}");
    assert!(shown[1].contains("more line(s)"), "{stderr}");
    assert_eq!(shown.last().copied(), Some("  39: std::rt::lang_start"));
}

#[test]
fn a_launch_without_cpu_on_a_machine_without_gpus_says_it_runs_on_the_cpu() {
    let gpus = std::fs::read_dir("/proc/driver/nvidia/gpus").map_or(0, |d| d.count());
    if gpus > 0 {
        eprintln!("skipping: this machine has {gpus} GPU(s)");
        return;
    }
    let (out, _) = run_launch(&["-n", "2", "sh", "-c", "true"]);
    let stderr = text(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("no GPU found") && stderr.contains("2 worker(s) will run on the CPU"),
        "{stderr}"
    );
    assert!(stderr.contains("--cpu"), "{stderr}");
    // Hidden GPUs count as none, whatever the machine has.
    let (out, _) = run_launch_env(&["sh", "-c", "true"], &[("CUDA_VISIBLE_DEVICES", "")]);
    assert!(
        text(&out.stderr).contains("no GPU found"),
        "{}",
        text(&out.stderr)
    );
    // Said so, or --quiet: no notice.
    for flags in [&["--cpu"][..], &["--quiet"][..]] {
        let mut args = flags.to_vec();
        args.extend(["-n", "2", "sh", "-c", "true"]);
        let (out, _) = run_launch(&args);
        assert!(
            !text(&out.stderr).contains("no GPU"),
            "{flags:?}: {}",
            text(&out.stderr)
        );
    }
}

/// Every numeric flag of `launch`, given absurd values: a clear error naming the flag (or a
/// valid run of `--dry-run`), never a panic.
#[test]
fn absurd_numbers_in_every_flag_are_errors_not_panics() {
    let flags = [
        "-n",
        "--num-machines",
        "--machine-rank",
        "--main-process-port",
        "--gradient-accumulation-steps",
        "--collective-timeout-secs",
        "--max-restarts",
        "--monitor-interval",
        "--grace-period",
    ];
    let values = [
        "1e300",
        "1e19",
        "-1",
        "NaN",
        "inf",
        "18446744073709551616",
        "4294967296",
        "100000",
        "0",
        "",
        "abc",
    ];
    for flag in flags {
        for value in values {
            let out = launcher()
                .args(["launch", "--dry-run", "--cpu", flag, value, "true"])
                .output()
                .unwrap();
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert_ne!(out.status.code(), Some(101), "{flag} {value:?}: {stderr}");
            assert!(!stderr.contains("panicked"), "{flag} {value:?}: {stderr}");
            if !out.status.success() {
                let named = flag.trim_start_matches('-');
                assert!(
                    stderr.contains(named) || flag == "-n" && stderr.contains("num-processes"),
                    "{flag} {value:?}: the error does not name the flag: {stderr}"
                );
            }
        }
    }
}
