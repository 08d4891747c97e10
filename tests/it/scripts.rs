//! The GPU scripts' behaviour that can be checked without a GPU: `scripts/gpu-env.sh` on fake
//! library trees (missing folders, a symlinked CUDA folder, `compat` and driver folders, a
//! missing library) under `set -euo pipefail`, the size check of `scripts/gpu-bundle.sh`, and
//! `scripts/gpu-smoke.sh` on a fake bundle (step selection, verdicts, the nn kernels switch).

use std::os::unix::fs::symlink;
use std::path::Path;
use std::process::{Command, Output, Stdio};

const ROOT: &str = env!("CARGO_MANIFEST_DIR");
const LIBS: [&str; 6] = [
    "libcudart.so.13",
    "libcublas.so.13",
    "libcublasLt.so.13",
    "libcurand.so.10",
    "libnvrtc.so.13",
    "libnccl.so.2",
];

fn touch(path: &Path) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, b"").unwrap();
}

/// Sources gpu-env.sh the way a strict script would, with `roots` as the search roots, no
/// nvidia-smi on PATH, and prints LD_LIBRARY_PATH afterwards.
fn source_env(roots: &str) -> Output {
    let script = format!(
        "set -euo pipefail; source {ROOT}/scripts/gpu-env.sh; echo \"RESULT=$LD_LIBRARY_PATH\""
    );
    Command::new("bash")
        .arg("-c")
        .arg(script)
        .env("ACCEL_GPU_ENV_ROOTS", roots)
        .env("PATH", "/usr/bin:/bin")
        .env_remove("LD_LIBRARY_PATH")
        .stdin(Stdio::null())
        .output()
        .unwrap()
}

fn text(out: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn gpu_env_finds_wheels_through_a_symlink_skips_missing_folders_and_puts_the_driver_last() {
    let t = tempfile::tempdir().unwrap();
    let site = t.path().join("site/nvidia");
    for lib in LIBS {
        let pkg = if lib.starts_with("libnccl") {
            "nccl"
        } else {
            "cu13"
        };
        touch(&site.join(pkg).join("lib").join(lib));
    }
    // A driver folder that also holds an old NCCL, and a compat libcuda that must be ignored.
    let driver = t.path().join("driver");
    touch(&driver.join("libcuda.so.1"));
    touch(&driver.join("libnccl.so.2"));
    touch(&t.path().join("cuda/compat/libcuda.so.1"));
    // The wheels are reached through a symlinked root, as /usr/local/cuda often is.
    symlink(t.path().join("site"), t.path().join("linked")).unwrap();
    let roots = format!(
        "{missing} {linked} {driver} {cuda}",
        missing = t.path().join("no-such-folder").display(),
        linked = t.path().join("linked").display(),
        driver = driver.display(),
        cuda = t.path().join("cuda").display(),
    );
    let out = source_env(&roots);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}{stderr}");
    let path = stdout
        .lines()
        .find_map(|l| l.strip_prefix("RESULT="))
        .unwrap_or_else(|| panic!("no LD_LIBRARY_PATH printed: {stdout}{stderr}"));
    let dirs: Vec<&str> = path.split(':').collect();
    let nccl = dirs.iter().position(|d| d.ends_with("nvidia/nccl/lib"));
    let drv = dirs.iter().position(|d| *d == driver.to_str().unwrap());
    assert!(nccl.is_some() && drv.is_some(), "{path}");
    assert!(
        nccl < drv,
        "the pip NCCL must come before the driver folder: {path}"
    );
    assert_eq!(drv, Some(dirs.len() - 1), "driver folder last: {path}");
    assert!(!path.contains("compat"), "a compat folder was used: {path}");
    assert!(stderr.contains("nvidia-smi not found"), "{stderr}");
}

#[test]
fn gpu_env_names_a_missing_library_and_fails_instead_of_exiting_silently() {
    let t = tempfile::tempdir().unwrap();
    for lib in &LIBS[..5] {
        touch(&t.path().join("lib").join(lib));
    }
    touch(&t.path().join("driver/libcuda.so.1"));
    let roots = format!(
        "{} {}",
        t.path().join("lib").display(),
        t.path().join("driver").display()
    );
    let out = source_env(&roots);
    let (stdout, stderr) = text(&out);
    assert!(!out.status.success(), "{stdout}{stderr}");
    assert!(stderr.contains("not found: libnccl.so.2"), "{stderr}");
    assert!(!stdout.contains("RESULT="), "{stdout}");
    // Nothing exists at all: still a message, not a silent exit.
    let out = source_env("/no/such/a /no/such/b");
    let (_, stderr) = text(&out);
    assert!(!out.status.success());
    assert!(stderr.contains("libcudart.so.13"), "{stderr}");
    assert!(
        stderr.contains("none of /no/such/a /no/such/b exists"),
        "{stderr}"
    );
}

/// Runs gpu-bundle.sh on given files (no build) with a size limit, output in a temp folder.
fn bundle(files: &[&Path], limit_mb: &str, out_dir: &Path) -> Output {
    let list: Vec<String> = files.iter().map(|p| p.display().to_string()).collect();
    Command::new("bash")
        .arg(format!("{ROOT}/scripts/gpu-bundle.sh"))
        .env("ACCEL_BUNDLE_BINARIES", list.join(" "))
        .env("ACCEL_BUNDLE_LIMIT_MB", limit_mb)
        .env("ACCEL_BUNDLE_DIR", out_dir)
        .stdin(Stdio::null())
        .output()
        .unwrap()
}

/// `n` bytes that xz cannot shrink much (an xorshift stream).
fn incompressible(path: &Path, n: usize) {
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let bytes: Vec<u8> = (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect();
    std::fs::write(path, bytes).unwrap();
}

#[test]
fn gpu_bundle_packs_strips_names_and_enforces_its_size_limit() {
    let t = tempfile::tempdir().unwrap();
    // A real executable (strip must cope) and a bench binary with cargo's hash suffix.
    let launcher = t.path().join("accelerate-rs");
    std::fs::copy("/bin/true", &launcher).unwrap();
    let bench = t.path().join("overhead-0123456789abcdef");
    incompressible(&bench, 3 << 20);
    let out = bundle(&[&launcher, &bench], "60", &t.path().join("b1"));
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}{stderr}");
    let tarball = t.path().join("b1/accelerate-rs-gpu.tar.xz");
    assert!(tarball.exists(), "{stdout}");
    assert!(stdout.contains("MiB"), "the size is printed: {stdout}");
    let listing = Command::new("tar")
        .arg("-tJf")
        .arg(&tarball)
        .output()
        .unwrap();
    let listing = String::from_utf8_lossy(&listing.stdout);
    for want in ["bin/accelerate-rs", "bin/overhead", "COMMIT"] {
        assert!(
            listing.lines().any(|l| l == want),
            "{want} not in {listing}"
        );
    }
    // Over the limit: an error naming the size and the limit, non-zero exit.
    let out = bundle(&[&launcher, &bench], "1", &t.path().join("b2"));
    let (stdout, stderr) = text(&out);
    assert!(!out.status.success(), "{stdout}{stderr}");
    assert!(stderr.contains("over the limit of 1 MiB"), "{stderr}");
    // A missing binary and a bad limit are named.
    let out = bundle(&[&t.path().join("nope")], "60", &t.path().join("b3"));
    assert!(
        text(&out).1.contains("nope does not exist"),
        "{:?}",
        text(&out)
    );
    let out = bundle(&[&launcher], "lots", &t.path().join("b4"));
    assert!(
        text(&out).1.contains("ACCEL_BUNDLE_LIMIT_MB=lots"),
        "{:?}",
        text(&out)
    );
}

/// `scripts/faults.py` on this build's binaries, two of its scenarios: a launcher killed with
/// SIGKILL takes its workers with it, and wrong-secret strangers on the store port neither stop
/// the run nor go unreported. The script prints its table and fails when a scenario fails.
#[test]
fn fault_script_runs_its_scenarios_and_prints_the_table() {
    let exe = std::env::current_exe().unwrap();
    let profile_dir = exe.parent().and_then(|d| d.parent()).unwrap();
    if !profile_dir.join("examples").join("digits").exists() {
        panic!(
            "the digits example is missing: run the whole `cargo test` (it builds the examples)"
        );
    }
    let out = Command::new("python3")
        .arg(Path::new(ROOT).join("scripts/faults.py"))
        .arg("--bin-dir")
        .arg(profile_dir)
        .args(["--only", "kill-launcher,wrong-secret"])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    assert!(
        stdout.contains("| scenario") && stdout.contains("2 of 2 scenarios passed"),
        "{stdout}"
    );
    assert!(stdout.contains("kill -9 the launcher"), "{stdout}");
    // An unknown scenario is an error naming it, not an empty table.
    let out = Command::new("python3")
        .arg(Path::new(ROOT).join("scripts/faults.py"))
        .args(["--no-build", "--only", "no-such-fault"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out).1.contains("no-such-fault"));
}

/// The SLURM job scripts of `examples/slurm/` parse (`bash -n`), and every flag they pass to
/// `accelerate-rs launch` is one the launcher has.
#[test]
fn slurm_scripts_parse_and_use_real_launcher_flags() {
    let help = Command::new(crate::common::launcher())
        .args(["launch", "--help"])
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&help.stdout).to_string();
    let dir = Path::new(ROOT).join("examples/slurm");
    let mut scripts = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().and_then(|e| e.to_str()) != Some("sbatch") {
            continue;
        }
        scripts += 1;
        let out = Command::new("bash").arg("-n").arg(&path).output().unwrap();
        assert!(out.status.success(), "{}: {:?}", path.display(), out);
        let text = std::fs::read_to_string(&path).unwrap();
        if let Some(launch) = text
            .rsplit("accelerate-rs launch")
            .next()
            .filter(|_| text.contains("accelerate-rs launch"))
        {
            let args = launch.split("examples/").next().unwrap();
            for flag in args
                .split(|c: char| c.is_whitespace() || c == '\'' || c == '"')
                .filter(|w| w.starts_with("--"))
            {
                assert!(
                    help.contains(flag),
                    "{}: `{flag}` is not a launch flag",
                    path.display()
                );
            }
        }
    }
    assert_eq!(scripts, 4);
}

/// A fake bundle whose binaries are shell scripts printing what the real ones print, run through
/// gpu-smoke.sh with fake CUDA libraries: `ACCEL_SMOKE_ONLY` runs only the listed steps, a step
/// passes or fails on its output, the nn kernels keep the caller's setting (default on) except in
/// 8-9, which switch them on,
/// the models crate's steps find the fixtures and run on the GPU, and the exit status says
/// whether everything passed.
#[test]
fn gpu_smoke_runs_the_listed_steps_and_judges_them_by_their_output() {
    let t = tempfile::tempdir().unwrap();
    for lib in LIBS {
        touch(&t.path().join("lib").join(lib));
    }
    touch(&t.path().join("driver/libcuda.so.1"));
    let roots = format!(
        "{} {}",
        t.path().join("lib").display(),
        t.path().join("driver").display()
    );
    let make_bundle = |nn_failed: u32| -> std::path::PathBuf {
        let stage = t.path().join(format!("stage{nn_failed}"));
        let bin = stage.join("bin");
        std::fs::create_dir_all(&bin).unwrap();
        let script = |name: &str, body: &str| {
            let p = bin.join(name);
            std::fs::write(&p, format!("#!/bin/sh\n{body}\n")).unwrap();
            let mut perm = std::fs::metadata(&p).unwrap().permissions();
            std::os::unix::fs::PermissionsExt::set_mode(&mut perm, 0o755);
            std::fs::set_permissions(&p, perm).unwrap();
        };
        script(
            "accelerate-rs",
            "if [ \"$1 $2\" = \"env --gpus\" ]; then echo 1; else echo \"PASSED ($*)\"; fi",
        );
        script(
            "nn_kernels",
            &format!(
                "echo 'PASS layer_norm F32: output 1e-7'; echo \"nn_kernels: 29 passed, {nn_failed} failed (ACCELERATE_RS_NN_CUDA=$ACCELERATE_RS_NN_CUDA)\""
            ),
        );
        script(
            "transformer_lm",
            "echo \"trained 30 steps (ACCELERATE_RS_NN_CUDA=$ACCELERATE_RS_NN_CUDA)\"",
        );
        script(
            "digits",
            "echo \"final test accuracy 0.99 (ACCELERATE_RS_NN_CUDA=$ACCELERATE_RS_NN_CUDA)\"",
        );
        script(
            "overhead",
            "echo 'overhead of accelerate-rs vs plain Candle: +0.1%'",
        );
        script(
            "parity",
            "echo \"test result: ok. 7 passed; 0 failed (filter $1, device $ACCELERATE_RS_TEST_DEVICE, fixtures $ACCELERATE_RS_MODELS_FIXTURES, ACCELERATE_RS_NN_CUDA=$ACCELERATE_RS_NN_CUDA)\"",
        );
        script(
            "memory_bench",
            "if [ \"$1\" = --find-batch-size ]; then echo \"find_executable_batch_size on Cuda: started at $2, tried [$2, 8]; out-of-memory retries: 1; ran at batch size 8\"; else echo '| ckpt | 1 |'; fi",
        );
        std::fs::write(stage.join("COMMIT"), "fake\n").unwrap();
        let tarball = t.path().join(format!("bundle{nn_failed}.tar.xz"));
        let st = Command::new("bash")
            .arg("-c")
            .arg(format!(
                "tar -C {} -cf - bin COMMIT | xz -1 > {}",
                stage.display(),
                tarball.display()
            ))
            .status()
            .unwrap();
        assert!(st.success());
        tarball
    };
    // `nn`: the caller's ACCELERATE_RS_NN_CUDA (None: unset, the kernels' default).
    let smoke_with = |bundle: &Path, only: &str, nn: Option<&str>| -> (bool, String) {
        let summary = t.path().join(format!(
            "summary-{}-{}.txt",
            only.replace(' ', "-"),
            nn.unwrap_or("default")
        ));
        let mut cmd = Command::new("bash");
        cmd.arg(format!("{ROOT}/scripts/gpu-smoke.sh"))
            .arg(&summary)
            .env("ACCEL_GPU_BUNDLE", bundle)
            .env("ACCEL_GPU_ENV_ROOTS", &roots)
            .env("ACCEL_SMOKE_ONLY", only)
            .env("PATH", "/usr/bin:/bin")
            .env_remove("ACCELERATE_RS_NN_CUDA")
            .stdin(Stdio::null());
        if let Some(v) = nn {
            cmd.env("ACCELERATE_RS_NN_CUDA", v);
        }
        let out = cmd.output().unwrap();
        let text = std::fs::read_to_string(&summary).unwrap_or_default();
        let (stdout, stderr) = (
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
        );
        (
            out.status.success(),
            format!("{text}\n--- output:\n{stdout}{stderr}"),
        )
    };

    let smoke = |bundle: &Path, only: &str| smoke_with(bundle, only, None);
    let good = make_bundle(0);
    let (ok, text) = smoke(&good, "8 9");
    assert!(ok, "{text}");
    assert!(text.contains("PASS 8. nn CUDA kernels"), "{text}");
    assert!(text.contains("PASS 9. transformer_lm 30 steps"), "{text}");
    assert!(!text.contains("1. digits"), "step 1 ran: {text}");
    assert!(text.contains("2 passed, 0 failed"), "{text}");
    // The kernels are switched on for steps 8 and 9 ...
    assert!(
        text.contains("nn_kernels: 29 passed, 0 failed (ACCELERATE_RS_NN_CUDA=1)"),
        "{text}"
    );
    // ... left at the build's default (on) for the other steps ...
    let (ok, text) = smoke(&good, "1");
    assert!(ok, "{text}");
    assert!(text.contains("PASS 1. digits"), "{text}");
    assert!(text.contains("nn CUDA kernels: on (the default)"), "{text}");
    assert!(text.contains("(ACCELERATE_RS_NN_CUDA=)"), "{text}");
    // ... and the caller can prove the composed ops instead, except in 8 and 9.
    let (ok, text) = smoke_with(&good, "1 8", Some("0"));
    assert!(ok, "{text}");
    assert!(
        text.contains("nn CUDA kernels: ACCELERATE_RS_NN_CUDA=0"),
        "{text}"
    );
    assert!(
        text.contains("final test accuracy 0.99 (ACCELERATE_RS_NN_CUDA=0)"),
        "{text}"
    );
    assert!(
        text.contains("nn_kernels: 29 passed, 0 failed (ACCELERATE_RS_NN_CUDA=1)"),
        "{text}"
    );

    // The models crate's steps: the parity tests on the GPU against the repository's fixtures,
    // the search's retries.
    let (ok, text) = smoke(&good, "11 14");
    assert!(ok, "{text}");
    assert!(text.contains("PASS 11. Hugging Face parity"), "{text}");
    assert!(
        text.contains(&format!(
            "filter matches_transformers, device cuda, fixtures {ROOT}/models/tests/fixtures, ACCELERATE_RS_NN_CUDA="
        )),
        "{text}"
    );
    assert!(
        text.contains("PASS 14. find_executable_batch_size"),
        "{text}"
    );
    assert!(text.contains("out-of-memory retries: 1"), "{text}");
    assert!(!text.contains("12a."), "step 12 ran: {text}");

    // A lettered step alone: "6a" runs 6a, not 6b (the fake trains 30 steps, so 6a fails on
    // its pattern; only the selection is checked here).
    let (_, text) = smoke(&good, "6a");
    assert!(text.contains("6a. transformer_lm 50 steps"), "{text}");
    assert!(!text.contains("6b."), "step 6b ran: {text}");

    let bad = make_bundle(1);
    let (ok, text) = smoke(&bad, "8");
    assert!(!ok, "a failed kernel check must fail the run: {text}");
    assert!(text.contains("FAIL 8. nn CUDA kernels"), "{text}");
    assert!(text.contains("0 passed, 1 failed"), "{text}");
}

/// `scripts/gpu_profile.py --tracer cupti --per-step 1,3` on a fake program that writes the
/// trace file the CUPTI library would (one-off set-up kernels plus per-step kernels): the
/// whole run's table has the set-up, the one-step table has exactly the per-step kernels,
/// launches and span; bad `--per-step` values are refused.
#[test]
fn gpu_profile_subtracts_two_cupti_traces_into_one_step() {
    let t = tempfile::tempdir().unwrap();
    let prog = t.path().join("fake-program");
    std::fs::write(
        &prog,
        "#!/bin/sh\n\
         n=$2\n\
         printf 'kernel\\t%d\\t%d\\tvoid sm90_xmma_gemm_bf16(int)\\nkernel\\t%d\\t%d\\tsoftmax_fwd_bf16\\n\
         kernel\\t5000000\\t10\\tinit_randn\\nmemcpy\\t%d\\t%d\\t-\\nmemset\\t0\\t0\\t-\\n\
         span\\t%d\\t%d\\t-\\ndropped\\t0\\t0\\t-\\n' $((2000000*n)) $((4*n)) $((1000000*n)) \
         $((2*n)) $((100000*n)) $n $((9000000+4000000*n)) $((12+7*n)) > \"$CUPTI_TRACE_OUT\"\n",
    )
    .unwrap();
    let mut perm = std::fs::metadata(&prog).unwrap().permissions();
    std::os::unix::fs::PermissionsExt::set_mode(&mut perm, 0o755);
    std::fs::set_permissions(&prog, perm).unwrap();
    let lib = t.path().join("libcupti_trace.so");
    touch(&lib);
    let profile = |per_step: &str, steps: &str| -> Output {
        Command::new("python3")
            .arg(format!("{ROOT}/scripts/gpu_profile.py"))
            .args(["--tracer", "cupti", "--cupti-lib"])
            .arg(&lib)
            .args(["--per-step", per_step, "--label", "fake", "--"])
            .arg(&prog)
            .args(["--steps", steps])
            .stdin(Stdio::null())
            .output()
            .unwrap()
    };
    let out = profile("1,3", "{steps}");
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}{stderr}");
    let (whole, step) = stdout.split_once("one step").expect("a one-step table");
    assert!(whole.contains("| init_randn | 5.00 | 10 |"), "{stdout}");
    assert!(
        !step.contains("init_randn"),
        "set-up counted in a step: {stdout}"
    );
    assert!(step.contains("fake: 6 kernel launches, 3.0 ms"), "{stdout}");
    assert!(
        step.contains("| sm90_xmma_gemm_bf16 | 2.00 | 4 | 66.7% |"),
        "{stdout}"
    );
    assert!(
        step.contains("| matrix products (cuBLAS) | 2.00 | 4 | 66.7% |"),
        "{stdout}"
    );
    assert!(step.contains("gpu_profile: span 4.0 ms"), "{stdout}");
    assert!(
        step.contains("gpu_profile: total 3.0 ms (fake)"),
        "{stdout}"
    );
    for (bad, why) in [
        ("3,1", "0 < A < B"),
        ("1", "two whole numbers"),
        ("0,2", "0 < A < B"),
    ] {
        let out = profile(bad, "{steps}");
        assert!(!out.status.success(), "--per-step {bad} ran");
        assert!(text(&out).1.contains(why), "{:?}", text(&out));
    }
    let out = profile("1,3", "2");
    assert!(!out.status.success());
    assert!(text(&out).1.contains("needs {steps}"), "{:?}", text(&out));
}
