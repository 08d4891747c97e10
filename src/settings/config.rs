//! The config file (`default_config.toml`): where it lives, what it may hold, and how a bad one is
//! reported (file, key and the expected form).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::env;
use crate::error::{Error, Result};

/// Settings read from the config file. Every key is optional; unknown keys are rejected.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConfigFile {
    /// Run on CPU even when GPUs are present.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub use_cpu: Option<bool>,
    /// Number of machines.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub num_machines: Option<usize>,
    /// This machine's index among `num_machines`, from 0 (the machine running rank 0).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub machine_rank: Option<usize>,
    /// Address of the machine running rank 0 (becomes `MASTER_ADDR`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub main_process_ip: Option<String>,
    /// Port of the rendezvous store (becomes `MASTER_PORT`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub main_process_port: Option<u16>,
    /// Processes per machine that `accelerate-rs launch` starts.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub num_processes: Option<usize>,
    /// GPUs the launcher makes visible (`CUDA_VISIBLE_DEVICES`): `all` or a list such as `0,1,3`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gpu_ids: Option<String>,
    /// Mixed precision mode: `no` (f32), `bf16` or `fp16`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mixed_precision: Option<MixedPrecision>,
    /// Micro-batches whose gradients are accumulated before each optimizer step.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gradient_accumulation_steps: Option<usize>,
    /// Timeout of every collective, in seconds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub collective_timeout_secs: Option<f64>,
    /// Gradient bucket cap, in MiB: gradients are all-reduced in buckets of about this size.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bucket_cap_mb: Option<f64>,
    /// Data path between processes on one machine: `auto` (shared memory when every rank is on
    /// one host), `tcp` or `shm`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub transport: Option<crate::settings::Transport>,
    /// What the first optimizer step does when registered parameters received no gradient:
    /// `warn` (default), `error` or `off`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub missing_gradients: Option<crate::settings::MissingGradients>,
    /// What an optimizer step does when the gradients turn non-finite: `error` (default),
    /// `warn`, `skip-step` or `off`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub nonfinite: Option<crate::settings::NonFinite>,
    /// ZeRO-style sharding: 0 (none), 1 (optimizer state), 2 (optimizer state and gradients)
    /// or 3 (parameters too).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub zero_stage: Option<usize>,
    /// ZeRO stage 3: the shards' optimizer state, masters and f32 gradients in host memory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub offload_optimizer: Option<bool>,
    /// Whether the data loaders' batch size is the global one, split across the ranks.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub split_batches: Option<bool>,
    /// Tune glibc's allocator for training (keep freed memory instead of unmapping it; default
    /// true), see `accelerate_rs::allocator`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tune_malloc: Option<bool>,
    /// How many times `launch` restarts the worker group after a failure.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_restarts: Option<usize>,
    /// How often `launch` checks its workers, in seconds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub monitor_interval_secs: Option<f64>,
}

/// Mixed precision modes (`no`, `bf16`, `fp16`), as in Accelerate.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MixedPrecision {
    /// Full precision (f32).
    #[default]
    No,
    /// bfloat16 compute with f32 master weights.
    Bf16,
    /// f16 compute with f32 master weights and dynamic loss scaling.
    #[serde(alias = "f16")]
    Fp16,
}

impl MixedPrecision {
    /// The name used in config files, flags and `ACCELERATE_RS_MIXED_PRECISION`.
    pub fn as_str(self) -> &'static str {
        match self {
            MixedPrecision::No => "no",
            MixedPrecision::Bf16 => "bf16",
            MixedPrecision::Fp16 => "fp16",
        }
    }

    /// The dtype the forward and backward passes run in: f32, bf16 or f16.
    pub fn compute_dtype(self) -> candle_core::DType {
        match self {
            MixedPrecision::No => candle_core::DType::F32,
            MixedPrecision::Bf16 => candle_core::DType::BF16,
            MixedPrecision::Fp16 => candle_core::DType::F16,
        }
    }
}

impl std::fmt::Display for MixedPrecision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for MixedPrecision {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "no" | "none" | "fp32" | "f32" => Ok(MixedPrecision::No),
            "bf16" => Ok(MixedPrecision::Bf16),
            "fp16" | "f16" => Ok(MixedPrecision::Fp16),
            other => Err(Error::invalid(
                "mixed precision",
                format!("`{other}` is not one of no, bf16, fp16"),
            )),
        }
    }
}

impl ConfigFile {
    /// The platform default location, e.g. `~/.config/accelerate-rs/default_config.toml`.
    pub fn default_path() -> Option<PathBuf> {
        dirs::config_dir().map(|d| d.join("accelerate-rs").join("default_config.toml"))
    }

    /// The file in force: `explicit` if given, else `ACCELERATE_RS_CONFIG_FILE`, else the default
    /// location. The flag says whether the file must exist (it must when named explicitly).
    pub fn locate(
        explicit: Option<&Path>,
        getenv: &dyn Fn(&str) -> Option<String>,
    ) -> Option<(PathBuf, bool)> {
        if let Some(p) = explicit {
            return Some((p.to_path_buf(), true));
        }
        if let Some(p) = getenv(env::CONFIG_FILE).filter(|p| !p.is_empty()) {
            return Some((PathBuf::from(p), true));
        }
        Self::default_path().map(|p| (p, false))
    }

    /// Loads the file found by [`locate`](ConfigFile::locate); a missing default file is an
    /// empty config.
    pub fn load_located(
        explicit: Option<&Path>,
        getenv: &dyn Fn(&str) -> Option<String>,
    ) -> Result<(ConfigFile, Option<PathBuf>)> {
        match Self::locate(explicit, getenv) {
            Some((path, required)) => {
                if !required && !path.exists() {
                    return Ok((ConfigFile::default(), None));
                }
                Ok((Self::load(&path)?, Some(path)))
            }
            None => Ok((ConfigFile::default(), None)),
        }
    }

    /// Reads and validates `path`.
    pub fn load(path: &Path) -> Result<ConfigFile> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::Config {
            path: path.to_path_buf(),
            key: None,
            reason: format!("cannot read it: {e}"),
        })?;
        Self::parse(&text, path)
    }

    /// Parses TOML text; `path` is only used in messages.
    pub fn parse(text: &str, path: &Path) -> Result<ConfigFile> {
        let cfg: ConfigFile = toml::from_str(text).map_err(|e| {
            let key = e.span().and_then(|s| key_at(text, s.start));
            Error::Config {
                path: path.to_path_buf(),
                key,
                reason: plain_types(e.message().trim()),
            }
        })?;
        cfg.validate(path)?;
        Ok(cfg)
    }

    fn validate(&self, path: &Path) -> Result<()> {
        match self.problem() {
            Some((key, reason)) => Err(Error::Config {
                path: path.to_path_buf(),
                key: Some(key.to_string()),
                reason,
            }),
            None => Ok(()),
        }
    }

    /// The first key whose value breaks the rules a config file must follow, with what is wrong and
    /// the expected form; `None` when every value is acceptable. Loading a file, the `config`
    /// command's questions and its flags all use these rules.
    pub fn problem(&self) -> Option<(&'static str, String)> {
        self.time_and_size_problem()
            .or_else(|| self.count_problem())
            .or_else(|| self.placement_problem())
    }

    /// The durations and the bucket size out of range.
    fn time_and_size_problem(&self) -> Option<(&'static str, String)> {
        use crate::settings::limits;
        for (key, v) in [
            ("collective_timeout_secs", self.collective_timeout_secs),
            ("monitor_interval_secs", self.monitor_interval_secs),
        ] {
            if let Some(x) = v {
                if let Err(reason) = limits::checked_secs(x, false) {
                    return Some((key, reason));
                }
            }
        }
        if let Some(x) = self.bucket_cap_mb {
            if !(x.is_finite() && x > 0.0 && x <= limits::MAX_BUCKET_CAP_MB) {
                return Some((
                    "bucket_cap_mb",
                    format!(
                        "expected a number of MiB above 0 and at most {}, got {x}",
                        limits::MAX_BUCKET_CAP_MB
                    ),
                ));
            }
        }
        None
    }

    /// The counts (processes, machines, accumulation, restarts, ZeRO stage) out of range.
    fn count_problem(&self) -> Option<(&'static str, String)> {
        use crate::settings::limits;
        for (key, v, max) in [
            ("num_processes", self.num_processes, limits::MAX_PROCESSES),
            ("num_machines", self.num_machines, limits::MAX_MACHINES),
            (
                "gradient_accumulation_steps",
                self.gradient_accumulation_steps,
                limits::MAX_ACCUMULATION_STEPS,
            ),
        ] {
            if let Some(n) = v {
                if n == 0 || n > max {
                    return Some((key, format!("expected an integer from 1 to {max}, got {n}")));
                }
            }
        }
        if let Some(n) = self.max_restarts {
            if n > limits::MAX_RESTARTS {
                return Some((
                    "max_restarts",
                    format!(
                        "expected an integer from 0 to {}, got {n}",
                        limits::MAX_RESTARTS
                    ),
                ));
            }
        }
        if let Some(n) = self.zero_stage {
            if n > 3 {
                return Some(("zero_stage", format!("expected 0, 1, 2 or 3, got {n}")));
            }
        }
        None
    }

    /// Where rank 0 is and which GPUs and machine rank: malformed or out of range.
    fn placement_problem(&self) -> Option<(&'static str, String)> {
        if self.main_process_port == Some(0) {
            return Some((
                "main_process_port",
                "expected a port number from 1 to 65535, got 0".into(),
            ));
        }
        if let Some(ip) = &self.main_process_ip {
            if ip.trim().is_empty() || ip.trim().contains(char::is_whitespace) {
                return Some((
                    "main_process_ip",
                    format!("expected an IP address or host name such as \"10.0.0.1\", got {ip:?}"),
                ));
            }
        }
        if let Some(ids) = &self.gpu_ids {
            if !gpu_ids_ok(ids) {
                return Some((
                    "gpu_ids",
                    format!("expected `all` or comma-separated GPU indices such as \"0,1\", got {ids:?}"),
                ));
            }
        }
        let machines = self.num_machines.unwrap_or(1);
        if let Some(r) = self.machine_rank {
            if r >= machines {
                return Some((
                    "machine_rank",
                    format!("expected a machine index below num_machines = {machines}, got {r}"),
                ));
            }
        }
        None
    }

    /// The path `accelerate-rs config` writes and `config show` reads: `explicit` if given, else
    /// `ACCELERATE_RS_CONFIG_FILE`, else [`default_path`](ConfigFile::default_path).
    pub fn target_path(
        explicit: Option<&Path>,
        getenv: &dyn Fn(&str) -> Option<String>,
    ) -> Result<PathBuf> {
        Self::locate(explicit, getenv)
            .map(|(p, _)| p)
            .ok_or_else(|| {
                Error::invalid(
                    "config file",
                    format!(
                        "this platform has no config directory; pass --config-file PATH or set {}",
                        env::CONFIG_FILE
                    ),
                )
            })
    }

    /// A complete config for one machine of this build: CPU unless this build has CUDA support and
    /// sees a GPU, [`default_num_processes`] processes, full precision, no accumulation and the
    /// default collective timeout.
    pub fn suggested() -> ConfigFile {
        let gpu = cuda_built() && gpus_seen() > 0;
        ConfigFile {
            use_cpu: Some(!gpu),
            num_machines: Some(1),
            num_processes: Some(default_num_processes(gpu)),
            gpu_ids: gpu.then(|| "all".to_string()),
            mixed_precision: Some(MixedPrecision::No),
            gradient_accumulation_steps: Some(1),
            collective_timeout_secs: Some(DEFAULT_COLLECTIVE_TIMEOUT_SECS),
            ..ConfigFile::default()
        }
    }

    /// Writes this config (validated, with a header comment) to `path`, creating parent
    /// directories. The text goes to a temporary file next to `path` that is then renamed over it,
    /// so readers never see a half-written file. Returns the text written.
    pub fn write_atomic(&self, path: &Path) -> Result<String> {
        self.validate(path)?;
        let text = format!(
            "# accelerate-rs config, written by `accelerate-rs config`.\n\
             # Check it with `accelerate-rs config show`; every key is optional.\n{}",
            self.to_toml()?
        );
        let io = |context: &str, p: &Path| {
            let context = context.to_string();
            let p = p.to_path_buf();
            move |source| Error::Io {
                context,
                path: p,
                source,
            }
        };
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(io("cannot create the config directory", dir))?;
        }
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "config.toml".into());
        let tmp = path.with_file_name(format!(".{name}.tmp.{}", std::process::id()));
        let write = || -> std::io::Result<()> {
            use std::io::Write as _;
            let mut f = std::fs::File::create(&tmp)?;
            f.write_all(text.as_bytes())?;
            f.sync_all()
        };
        if let Err(e) = write() {
            let _ = std::fs::remove_file(&tmp);
            return Err(io("cannot write the config file", &tmp)(e));
        }
        if let Err(e) = std::fs::rename(&tmp, path) {
            let _ = std::fs::remove_file(&tmp);
            return Err(io("cannot write the config file", path)(e));
        }
        Ok(text)
    }

    /// The TOML text of this config.
    pub fn to_toml(&self) -> Result<String> {
        toml::to_string(self).map_err(|e| Error::invalid("config", e.to_string()))
    }
}

/// Serde's Rust type names in a message, spelled for users.
fn plain_types(message: &str) -> String {
    [
        ("expected usize", "expected a whole number such as 2"),
        ("expected u16", "expected a port number from 1 to 65535"),
        ("expected f64", "expected a number such as 1.5"),
        ("expected a boolean", "expected true or false"),
    ]
    .iter()
    .fold(message.to_string(), |m, (from, to)| m.replace(from, to))
}

/// Whether `ids` is `all` or a comma-separated list of GPU indices.
fn gpu_ids_ok(ids: &str) -> bool {
    ids.trim() == "all"
        || (!ids.trim().is_empty() && ids.split(',').all(|p| p.trim().parse::<usize>().is_ok()))
}

/// Default rendezvous port (`main_process_port`, `MASTER_PORT`).
pub const DEFAULT_MAIN_PROCESS_PORT: u16 = crate::settings::defaults::DEFAULT_MASTER_PORT;

/// Default collective timeout in seconds (`collective_timeout_secs`).
pub const DEFAULT_COLLECTIVE_TIMEOUT_SECS: f64 =
    crate::settings::defaults::DEFAULT_TIMEOUT.as_secs() as f64;

/// Whether this build can drive CUDA GPUs (the `cuda` cargo feature).
pub fn cuda_built() -> bool {
    crate::settings::gpu::BUILT_WITH_CUDA
}

/// How many GPUs this build sees: 0 without CUDA support or without a usable driver.
pub fn gpus_seen() -> usize {
    crate::settings::gpu::device_count().unwrap_or(0)
}

/// The default number of processes per machine: one per GPU seen (at least one) when `gpu`, else
/// up to two CPU processes (fewer on a single-core machine) so that each keeps threads for its
/// kernels.
pub fn default_num_processes(gpu: bool) -> usize {
    if gpu {
        gpus_seen().max(1)
    } else {
        std::thread::available_parallelism().map_or(1, |n| n.get().min(2))
    }
}

/// The key on the line containing byte offset `at`, if the line looks like `key = value`.
fn key_at(text: &str, at: usize) -> Option<String> {
    let start = text[..at.min(text.len())].rfind('\n').map_or(0, |i| i + 1);
    let line = text[start..].lines().next()?;
    let key = line.split('=').next()?.trim();
    (!key.is_empty() && !key.starts_with('[')).then(|| key.trim_matches('"').to_string())
}

impl crate::settings::parse::Setting for MixedPrecision {
    fn parse_setting(s: &str) -> std::result::Result<Self, String> {
        s.parse().map_err(|_| "expected no, bf16 or fp16".into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_known_keys() {
        let c = ConfigFile::parse(
            "use_cpu = true\nnum_processes = 2\ncollective_timeout_secs = 12.5\n",
            Path::new("c.toml"),
        )
        .unwrap();
        assert_eq!(c.use_cpu, Some(true));
        assert_eq!(c.num_processes, Some(2));
        assert_eq!(c.collective_timeout_secs, Some(12.5));
        let back = ConfigFile::parse(&c.to_toml().unwrap(), Path::new("c.toml")).unwrap();
        assert_eq!(back, c);
    }

    #[test]
    fn mixed_precision_and_gpu_ids() {
        let c = ConfigFile::parse(
            "mixed_precision = \"bf16\"\ngpu_ids = \"0, 2\"\n",
            Path::new("c.toml"),
        )
        .unwrap();
        assert_eq!(c.mixed_precision, Some(MixedPrecision::Bf16));
        let err = ConfigFile::parse("mixed_precision = \"fp8\"\n", Path::new("c.toml"))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("mixed_precision") && err.contains("fp8"),
            "{err}"
        );
        let err = ConfigFile::parse("gpu_ids = \"zero\"\n", Path::new("c.toml"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("gpu_ids") && err.contains("all"), "{err}");
        assert_eq!(
            "f16".parse::<MixedPrecision>().unwrap(),
            MixedPrecision::Fp16
        );
    }

    #[test]
    fn unknown_key_names_file_and_key() {
        let err = ConfigFile::parse("use_cpu = true\nnum_procs = 2\n", Path::new("/x/c.toml"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("/x/c.toml"), "{err}");
        assert!(err.contains("num_procs"), "{err}");
    }

    #[test]
    fn bad_values_name_the_key_and_expected_form() {
        let err = ConfigFile::parse("main_process_port = \"abc\"\n", Path::new("c.toml"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("main_process_port"), "{err}");
        let err = ConfigFile::parse("collective_timeout_secs = -1\n", Path::new("c.toml"))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("collective_timeout_secs") && err.contains("above 0"),
            "{err}"
        );
        let err = ConfigFile::parse("num_machines = 2\nmachine_rank = 2\n", Path::new("c.toml"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("machine_rank"), "{err}");
    }

    #[test]
    fn write_atomic_creates_dirs_and_reads_back() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a/b/c.toml");
        let cfg = ConfigFile::suggested();
        let text = cfg.write_atomic(&path).unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), text);
        assert_eq!(ConfigFile::load(&path).unwrap(), cfg);
        let left: Vec<_> = std::fs::read_dir(path.parent().unwrap()).unwrap().collect();
        assert_eq!(left.len(), 1, "temporary file left behind");
        let bad = ConfigFile {
            num_processes: Some(0),
            ..cfg
        };
        let err = bad.write_atomic(&path).unwrap_err().to_string();
        assert!(err.contains("num_processes"), "{err}");
        assert_eq!(ConfigFile::load(&path).unwrap(), ConfigFile::suggested());
    }

    #[test]
    fn explicit_missing_file_is_an_error_default_missing_is_not() {
        let none = |_: &str| None;
        let err = ConfigFile::load_located(Some(Path::new("/nonexistent/x.toml")), &none)
            .unwrap_err()
            .to_string();
        assert!(err.contains("/nonexistent/x.toml"), "{err}");
        let from_env = |k: &str| (k == env::CONFIG_FILE).then(|| "/nonexistent/y.toml".to_string());
        assert!(ConfigFile::load_located(None, &from_env).is_err());
    }
}
