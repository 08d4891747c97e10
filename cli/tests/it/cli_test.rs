//! `accelerate-rs test`: the built-in multi-process sanity check, run for real.

use std::process::Command;

fn bin() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_accelerate-rs"));
    // Never read the developer's own config file.
    c.env("ACCELERATE_RS_CONFIG_FILE", "");
    c.env(
        "XDG_CONFIG_HOME",
        std::env::temp_dir().join("accelerate-rs-cli-test-none"),
    );
    c
}

/// With `ACCELERATE_RS_ZERO_STAGE`, the DDP check runs sharded (momentum SGD, each rank keeping
/// its slice; at stage 3 of the parameters too) and still equals the single-process reference,
/// on 3 processes (uneven slices).
#[test]
fn zero_stages_pass_the_ddp_check_against_the_reference() {
    for stage in ["1", "2", "3"] {
        let out = bin()
            .args(["test", "-n", "3", "--cpu"])
            .env("ACCELERATE_RS_ZERO_STAGE", stage)
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "stage {stage}: {stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let want = format!(
            "[rank 0] ok: DDP steps equal a single-process reference (zero_stage {stage}: sharded true)"
        );
        assert!(stdout.contains(&want), "missing `{want}`:\n{stdout}");
    }
}

/// With `ACCELERATE_RS_MIXED_PRECISION=fp16`, the loss-scaling check runs: only the last of 3
/// processes overflows, and every one skips the step and halves the scale.
#[test]
fn fp16_overflow_on_one_rank_is_skipped_by_every_rank() {
    let out = bin()
        .args(["test", "-n", "3", "--cpu"])
        .env("ACCELERATE_RS_MIXED_PRECISION", "fp16")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let want = "[rank 0] ok: fp16 loss scaling: an overflow on the last rank only skips the step on every rank (rank 2 overflowed: every rank skipped, scale 65536 -> 32768, then stepped together)";
    assert!(stdout.contains(want), "missing `{want}`:\n{stdout}");
}

#[test]
fn passes_on_two_cpu_processes_with_every_check_reported() {
    let out = bin().args(["test", "-n", "2"]).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for check in [
        "ok: all_reduce",
        "ok: broadcast",
        "ok: all_gather",
        "ok: distributed sampler",
        "ok: DDP steps equal a single-process reference",
        // A check that does not apply says so: never `ok` for what did not run.
        "skipped: GPU tensors: all_reduce, broadcast, all_gather, reduce_scatter, all_gather_into (f32, bf16, f16) (this rank runs on the CPU)",
        "skipped: GPU setup: event tracking off (one stream), the memory pool keeps freed memory (this rank runs on the CPU)",
        "skipped: fp16 loss scaling: an overflow on the last rank only skips the step on every rank (mixed precision is not fp16",
        "ok: find_executable_batch_size: the last rank runs out of memory, every rank retries (Min vote) (rank 1 ran out at 8 and 4: every rank tried [8, 4, 2] and settled on 2)",
        "ok: non-finite gradients (NaN, +inf, -inf in f32, bf16, f16) stop the step (f32, bf16, f16: NaN, +inf and -inf stop the step; 0 CUDA kernel launches)",
    ] {
        assert!(
            stdout.contains(&format!("[rank 0] {check}")),
            "missing `{check}`:\n{stdout}"
        );
    }
    assert!(!stdout.contains("ok: GPU"), "{stdout}");
    assert_eq!(
        stdout.lines().last(),
        Some("accelerate-rs test: PASSED on 2 process(es)")
    );
}

#[test]
fn passes_with_three_processes_and_with_one() {
    for n in ["3", "1"] {
        let out = bin().args(["test", "-n", n]).output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "n={n}: {stdout}");
        assert!(
            stdout.contains(&format!("PASSED on {n} process(es)")),
            "{stdout}"
        );
    }
}

#[test]
fn takes_the_process_count_from_the_config_file_and_reports_a_bad_one() {
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("good.toml");
    std::fs::write(&good, "num_processes = 3\n").unwrap();
    let out = bin()
        .args(["test", "--config-file"])
        .arg(&good)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("PASSED on 3 process(es)"), "{stdout}");

    let bad = dir.path().join("bad.toml");
    std::fs::write(&bad, "num_processes = \"many\"\n").unwrap();
    let out = bin()
        .args(["test", "--config-file"])
        .arg(&bad)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("bad.toml") && stderr.contains("num_processes"),
        "{stderr}"
    );
}

#[test]
fn a_failing_worker_makes_it_fail_with_one_line_saying_what() {
    // A timeout of 0 s is rejected by every worker: the run must fail, not hang or pass.
    let out = bin()
        .args(["test", "-n", "2"])
        .env("ACCELERATE_RS_TIMEOUT_SECS", "0")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stdout}");
    let last = stdout.lines().last().unwrap_or_default();
    assert!(
        last.starts_with("accelerate-rs test: FAILED: launch: rank"),
        "{last}"
    );
    assert!(stderr.contains("ACCELERATE_RS_TIMEOUT_SECS"), "{stderr}");
}

#[test]
fn dp_mode_runs_the_same_checks_on_replicas_in_one_process() {
    let out = bin().args(["test", "--dp", "3", "--cpu"]).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("ok: DDP steps equal a single-process reference"),
        "{stdout}"
    );
    assert_eq!(
        stdout.lines().last(),
        Some("accelerate-rs test: PASSED on 3 DP replica(s)")
    );
}
