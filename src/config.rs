//! The config file (`default_config.toml`): where it lives, what it may hold, and how a bad one is
//! reported (file, key and the expected form).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::env;
use crate::error::{Error, Result};

/// Settings read from the config file. Every key is optional; unknown keys are rejected.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConfigFile {
    /// Run on CPU even when GPUs are present.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub use_cpu: Option<bool>,
    /// Processes per machine that `accelerate-rs launch` starts.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub num_processes: Option<usize>,
    /// Number of machines.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub num_machines: Option<usize>,
    /// This machine's index among `num_machines`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub machine_rank: Option<usize>,
    /// Address of the machine running rank 0 (becomes `MASTER_ADDR`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub main_process_ip: Option<String>,
    /// Port of the rendezvous store (becomes `MASTER_PORT`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub main_process_port: Option<u16>,
    /// Timeout of every collective, in seconds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub collective_timeout_secs: Option<f64>,
    /// Gradient bucket cap, in MiB.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bucket_cap_mb: Option<f64>,
    /// GPUs the launcher makes visible (`CUDA_VISIBLE_DEVICES`): `all` or a list such as `0,1,3`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gpu_ids: Option<String>,
    /// Mixed precision mode.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mixed_precision: Option<MixedPrecision>,
    /// Micro-batches whose gradients are accumulated before each optimizer step.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gradient_accumulation_steps: Option<usize>,
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
                reason: e.message().trim().to_string(),
            }
        })?;
        cfg.validate(path)?;
        Ok(cfg)
    }

    fn validate(&self, path: &Path) -> Result<()> {
        let bad = |key: &str, reason: String| Error::Config {
            path: path.to_path_buf(),
            key: Some(key.to_string()),
            reason,
        };
        let positive = |key: &str, v: Option<f64>| match v {
            Some(x) if !(x.is_finite() && x > 0.0) => {
                Err(bad(key, format!("expected a positive number, got {x}")))
            }
            _ => Ok(()),
        };
        positive("collective_timeout_secs", self.collective_timeout_secs)?;
        positive("bucket_cap_mb", self.bucket_cap_mb)?;
        positive("monitor_interval_secs", self.monitor_interval_secs)?;
        for (key, v) in [
            ("num_processes", self.num_processes),
            ("num_machines", self.num_machines),
            (
                "gradient_accumulation_steps",
                self.gradient_accumulation_steps,
            ),
        ] {
            if v == Some(0) {
                return Err(bad(key, "expected an integer of at least 1, got 0".into()));
            }
        }
        if let Some(ids) = &self.gpu_ids {
            let ok = ids.trim() == "all"
                || (!ids.trim().is_empty()
                    && ids.split(',').all(|p| p.trim().parse::<usize>().is_ok()));
            if !ok {
                return Err(bad(
                    "gpu_ids",
                    format!("expected `all` or comma-separated GPU indices such as \"0,1\", got {ids:?}"),
                ));
            }
        }
        if let (Some(r), Some(m)) = (self.machine_rank, self.num_machines) {
            if r >= m {
                return Err(bad(
                    "machine_rank",
                    format!("{r} is not below num_machines = {m}"),
                ));
            }
        }
        Ok(())
    }

    /// The TOML text of this config.
    pub fn to_toml(&self) -> Result<String> {
        toml::to_string(self).map_err(|e| Error::invalid("config", e.to_string()))
    }
}

/// The key on the line containing byte offset `at`, if the line looks like `key = value`.
fn key_at(text: &str, at: usize) -> Option<String> {
    let start = text[..at.min(text.len())].rfind('\n').map_or(0, |i| i + 1);
    let line = text[start..].lines().next()?;
    let key = line.split('=').next()?.trim();
    (!key.is_empty() && !key.starts_with('[')).then(|| key.trim_matches('"').to_string())
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
            err.contains("collective_timeout_secs") && err.contains("positive"),
            "{err}"
        );
        let err = ConfigFile::parse("num_machines = 2\nmachine_rank = 2\n", Path::new("c.toml"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("machine_rank"), "{err}");
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
