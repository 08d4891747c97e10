//! The settings [`ProcessState`](super::ProcessState) resolves in groups, each with its checks:
//! where the ranks meet, the collective's limits, what happens to gradients, how the loop runs.
//! Each goes through the one precedence: builder call > environment variable > config file >
//! default.

use std::time::Duration;

use crate::error::{Error, Result};
use crate::settings::parse::{env_value, pick, Positive, Secs};
use crate::settings::{
    env, limits, ConfigFile, MissingGradients, MixedPrecision, NonFinite, Transport,
};

use super::defaults::{DEFAULT_BUCKET_CAP_MB, DEFAULT_MASTER_PORT, DEFAULT_TIMEOUT};
use super::overrides::Overrides;

/// The highest ZeRO stage there is.
const MAX_ZERO_STAGE: usize = 3;

/// Where the ranks meet: rank 0's address and port, and the transport.
pub(crate) struct Rendezvous {
    pub(crate) master_addr: Option<String>,
    pub(crate) master_port: u16,
    pub(crate) transport: Transport,
}

impl Rendezvous {
    /// The meeting point, checked: several processes that meet by address need one.
    pub(crate) fn resolve(
        o: &Overrides,
        getenv: &dyn Fn(&str) -> Option<String>,
        cfg: &ConfigFile,
        world_size: usize,
        launcher: &str,
    ) -> Result<Self> {
        let master_addr = o
            .master_addr
            .clone()
            .or(env_value::<String>(getenv, env::MASTER_ADDR)?)
            .or(cfg.main_process_ip.clone());
        let master_port = pick(
            o.master_port,
            env_value(getenv, env::MASTER_PORT)?,
            cfg.main_process_port,
            DEFAULT_MASTER_PORT,
        );
        // Under MPI the ranks find each other without an address (checked again when joining).
        let transport = pick(
            o.transport,
            env_value(getenv, env::TRANSPORT)?,
            cfg.transport,
            Transport::Auto,
        );
        let over_mpi =
            transport == Transport::Mpi || (transport == Transport::Auto && launcher == "mpi");
        let by_address = !(o.external_collective || over_mpi);
        if world_size > 1 && master_addr.is_none() && by_address {
            return Err(Error::Env {
                var: env::MASTER_ADDR.into(),
                value: String::new(),
                reason: format!("must be set when the world size is {world_size}: the address of the machine running rank 0 (or start the program with `accelerate-rs launch`)"),
            });
        }
        if world_size > 1 && master_port == 0 && by_address {
            return Err(Error::Env {
                var: env::MASTER_PORT.into(),
                value: "0".into(),
                reason: "every rank must know rank 0's port: set a real port (`accelerate-rs launch` picks a free one)".into(),
            });
        }
        Ok(Rendezvous {
            master_addr,
            master_port,
            transport,
        })
    }
}

/// The collective's limits: its timeout and the gradient bucket's size in MiB, range-checked.
pub(crate) fn collective_limits(
    o: &Overrides,
    getenv: &dyn Fn(&str) -> Option<String>,
    cfg: &ConfigFile,
) -> Result<(Duration, f64)> {
    // The config file's value was range-checked when it was read.
    let from_cfg = cfg
        .collective_timeout_secs
        .and_then(|s| limits::checked_secs(s, false).ok());
    let timeout = pick(
        o.timeout,
        env_value::<Secs>(getenv, env::TIMEOUT_SECS)?.map(|s| s.0),
        from_cfg,
        DEFAULT_TIMEOUT,
    );
    if timeout.is_zero() || timeout.as_secs_f64() > limits::MAX_TIMEOUT_SECS {
        return Err(Error::invalid(
            "timeout",
            format!(
                "must be above 0 and at most {} s (a week), got {timeout:?}",
                limits::MAX_TIMEOUT_SECS
            ),
        ));
    }
    let bucket_cap_mb = pick(
        o.bucket_cap_mb,
        env_value::<Positive>(getenv, env::BUCKET_CAP_MB)?.map(|p| p.0),
        cfg.bucket_cap_mb,
        DEFAULT_BUCKET_CAP_MB,
    );
    if !(bucket_cap_mb.is_finite()
        && bucket_cap_mb > 0.0
        && bucket_cap_mb <= limits::MAX_BUCKET_CAP_MB)
    {
        return Err(Error::invalid(
            "bucket_cap_mb",
            format!(
                "expected a number of MiB above 0 and at most {}, got {bucket_cap_mb}",
                limits::MAX_BUCKET_CAP_MB
            ),
        ));
    }
    Ok((timeout, bucket_cap_mb))
}

/// What happens to gradients and optimizer state: missing and non-finite gradients, the ZeRO
/// stage and its offload, malloc tuning.
pub(crate) struct GradientSettings {
    pub(crate) tune_malloc: bool,
    pub(crate) missing_gradients: MissingGradients,
    pub(crate) nonfinite: NonFinite,
    pub(crate) zero_stage: usize,
    pub(crate) offload_optimizer: bool,
}

impl GradientSettings {
    /// The gradient settings, checked: a ZeRO stage that exists, offload only at stage 3.
    pub(crate) fn resolve(
        o: &Overrides,
        getenv: &dyn Fn(&str) -> Option<String>,
        cfg: &ConfigFile,
    ) -> Result<Self> {
        let tune_malloc = pick(
            o.tune_malloc,
            env_value(getenv, env::TUNE_MALLOC)?,
            cfg.tune_malloc,
            true,
        );
        let missing_gradients = pick(
            o.missing_gradients,
            env_value(getenv, env::MISSING_GRADIENTS)?,
            cfg.missing_gradients,
            MissingGradients::Warn,
        );
        let nonfinite = pick(
            o.nonfinite,
            env_value(getenv, env::NONFINITE)?,
            cfg.nonfinite,
            NonFinite::Error,
        );
        let zero_stage = pick(
            o.zero_stage,
            env_value(getenv, env::ZERO_STAGE)?,
            cfg.zero_stage,
            0,
        );
        if zero_stage > MAX_ZERO_STAGE {
            return Err(Error::invalid(
                "zero_stage",
                format!("must be 0, 1, 2 or 3 (builder `zero_stage`, {} or config key `zero_stage`), got {zero_stage}", env::ZERO_STAGE),
            ));
        }
        let offload_optimizer = pick(
            o.offload_optimizer,
            env_value(getenv, env::OFFLOAD_OPTIMIZER)?,
            cfg.offload_optimizer,
            false,
        );
        if offload_optimizer && zero_stage != 3 {
            return Err(Error::invalid(
                "offload_optimizer",
                format!(
                    "offloads the optimizer state of ZeRO stage 3's shards, but zero_stage is {zero_stage} (builder `offload_optimizer`, {} or config key `offload_optimizer`)",
                    env::OFFLOAD_OPTIMIZER
                ),
            ));
        }
        Ok(GradientSettings {
            tune_malloc,
            missing_gradients,
            nonfinite,
            zero_stage,
            offload_optimizer,
        })
    }
}

/// How the training loop runs: batches, overlap, debugging, the CPU, the secret, precision and
/// accumulation.
pub(crate) struct RunSettings {
    pub(crate) split_batches: bool,
    pub(crate) overlap: bool,
    pub(crate) debug: bool,
    /// `None`: nobody said; GPUs are used when this build and machine have them.
    pub(crate) use_cpu: Option<bool>,
    pub(crate) secret: Vec<u8>,
    pub(crate) mixed_precision: MixedPrecision,
    pub(crate) gradient_accumulation_steps: usize,
}

impl RunSettings {
    /// The loop's settings, checked: an accumulation count in range.
    pub(crate) fn resolve(
        o: &Overrides,
        getenv: &dyn Fn(&str) -> Option<String>,
        cfg: &ConfigFile,
    ) -> Result<Self> {
        let split_batches = pick(
            o.split_batches,
            env_value(getenv, env::SPLIT_BATCHES)?,
            cfg.split_batches,
            false,
        );
        let overlap = pick(None, env_value(getenv, env::OVERLAP)?, None, true);
        let debug = pick(None, env_value(getenv, env::DEBUG)?, None, false);
        let use_cpu = o.cpu.or(env_value(getenv, env::USE_CPU)?).or(cfg.use_cpu);
        let secret = pick(
            o.secret.clone(),
            env_value(getenv, env::SECRET)?,
            None,
            String::new(),
        )
        .into_bytes();
        let mixed_precision = pick(
            o.mixed_precision,
            env_value(getenv, env::MIXED_PRECISION)?,
            cfg.mixed_precision,
            MixedPrecision::No,
        );
        let gradient_accumulation_steps = pick(
            o.gradient_accumulation_steps,
            env_value(getenv, env::GRADIENT_ACCUMULATION_STEPS)?,
            cfg.gradient_accumulation_steps,
            1,
        );
        if gradient_accumulation_steps == 0
            || gradient_accumulation_steps > limits::MAX_ACCUMULATION_STEPS
        {
            return Err(Error::invalid(
                "gradient_accumulation_steps",
                format!(
                    "must be from 1 to {}, got {gradient_accumulation_steps}",
                    limits::MAX_ACCUMULATION_STEPS
                ),
            ));
        }
        Ok(RunSettings {
            split_batches,
            overlap,
            debug,
            use_cpu,
            secret,
            mixed_precision,
            gradient_accumulation_steps,
        })
    }
}
