//! The launcher's environment contract, written here and read by
//! [`ProcessState::resolve`](super::ProcessState) next door: every variable a worker is started
//! with (torchrun names plus accelerate-rs's own). `accelerate-rs launch` exports
//! [`CommonEnv::for_rank`]; a round-trip test checks that resolving it gives back the run.

use crate::settings::env::{self, GROUP_RANK, NODE_RANK, NUM_NODES};
use crate::settings::MixedPrecision;

/// Everything the environment of one attempt depends on.
#[derive(Clone, Debug)]
pub struct EnvSpec {
    /// Processes on this machine.
    pub local_world_size: usize,
    /// Number of machines.
    pub num_machines: usize,
    /// This machine's index.
    pub machine_rank: usize,
    /// Address of the machine running rank 0.
    pub master_addr: String,
    /// Port of the rendezvous store.
    pub port: u16,
    /// The per-run secret.
    pub secret: String,
    /// Attempt number (0 on the first run).
    pub restart_count: usize,
    /// Force CPU.
    pub cpu: bool,
    /// Threads per worker.
    pub threads: usize,
    /// `CUDA_VISIBLE_DEVICES` to set (`None`: leave the launcher's own value).
    pub gpu_ids: Option<String>,
    /// Mixed precision mode to export.
    pub mixed_precision: Option<MixedPrecision>,
    /// Gradient accumulation steps to export.
    pub gradient_accumulation_steps: Option<usize>,
    /// Collective timeout to export, in seconds.
    pub timeout_secs: Option<f64>,
    /// Gradient bucket cap to export, in MiB.
    pub bucket_cap_mb: Option<f64>,
    /// ZeRO stage to export (`ACCELERATE_RS_ZERO_STAGE`).
    pub zero_stage: Option<usize>,
    /// ZeRO-3 offload to export (`ACCELERATE_RS_OFFLOAD_OPTIMIZER`).
    pub offload_optimizer: Option<bool>,
}

/// Variables shared by every rank of one launch.
#[derive(Clone, Debug)]
pub struct CommonEnv {
    vars: Vec<(&'static str, String)>,
    local_world_size: usize,
    machine_rank: usize,
}

impl CommonEnv {
    /// Builds the shared variables. `already_set` tells whether the launcher's own environment
    /// holds a variable (the thread-count variables are then inherited unchanged).
    pub fn new(spec: &EnvSpec, already_set: impl Fn(&str) -> bool) -> Self {
        let world_size = spec.local_world_size * spec.num_machines;
        let mut vars = vec![
            (env::WORLD_SIZE, world_size.to_string()),
            (env::LOCAL_WORLD_SIZE, spec.local_world_size.to_string()),
            (env::MASTER_ADDR, spec.master_addr.clone()),
            (env::MASTER_PORT, spec.port.to_string()),
            (env::SECRET, spec.secret.clone()),
            (env::RESTART_COUNT, spec.restart_count.to_string()),
            (GROUP_RANK, spec.machine_rank.to_string()),
            (NODE_RANK, spec.machine_rank.to_string()),
            (NUM_NODES, spec.num_machines.to_string()),
        ];
        if spec.cpu {
            vars.push((env::USE_CPU, "1".to_string()));
        }
        if let Some(ids) = &spec.gpu_ids {
            vars.push((env::CUDA_VISIBLE_DEVICES, ids.clone()));
        }
        if let Some(mp) = spec.mixed_precision {
            vars.push((env::MIXED_PRECISION, mp.as_str().to_string()));
        }
        if let Some(n) = spec.gradient_accumulation_steps {
            vars.push((env::GRADIENT_ACCUMULATION_STEPS, n.to_string()));
        }
        if let Some(t) = spec.timeout_secs {
            vars.push((env::TIMEOUT_SECS, t.to_string()));
        }
        if let Some(b) = spec.bucket_cap_mb {
            vars.push((env::BUCKET_CAP_MB, b.to_string()));
        }
        if let Some(z) = spec.zero_stage {
            vars.push((env::ZERO_STAGE, z.to_string()));
        }
        if let Some(o) = spec.offload_optimizer {
            vars.push((
                env::OFFLOAD_OPTIMIZER,
                if o { "1" } else { "0" }.to_string(),
            ));
        }
        for var in [env::RAYON_NUM_THREADS, env::OMP_NUM_THREADS] {
            if !already_set(var) {
                vars.push((var, spec.threads.to_string()));
            }
        }
        CommonEnv {
            vars,
            local_world_size: spec.local_world_size,
            machine_rank: spec.machine_rank,
        }
    }

    /// The global rank of local rank `local_rank` on this machine.
    pub fn global_rank(&self, local_rank: usize) -> usize {
        self.machine_rank * self.local_world_size + local_rank
    }

    /// The full set of variables for one local rank (RANK and LOCAL_RANK first, then the
    /// shared ones).
    pub fn for_rank(&self, local_rank: usize) -> Vec<(&'static str, String)> {
        let mut vars = vec![
            (env::RANK, self.global_rank(local_rank).to_string()),
            (env::LOCAL_RANK, local_rank.to_string()),
        ];
        vars.extend(self.vars.iter().cloned());
        vars
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> EnvSpec {
        EnvSpec {
            local_world_size: 2,
            num_machines: 1,
            machine_rank: 0,
            master_addr: "127.0.0.1".into(),
            port: 1234,
            secret: "s".into(),
            restart_count: 0,
            cpu: true,
            threads: 3,
            gpu_ids: None,
            mixed_precision: None,
            gradient_accumulation_steps: None,
            timeout_secs: None,
            bucket_cap_mb: None,
            zero_stage: None,
            offload_optimizer: None,
        }
    }

    #[test]
    fn thread_vars_respect_the_launcher_environment() {
        let e = CommonEnv::new(&spec(), |v| v == env::OMP_NUM_THREADS);
        let vars = e.for_rank(1);
        let get = |k: &str| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.clone());
        assert_eq!(get(env::RAYON_NUM_THREADS).as_deref(), Some("3"));
        assert_eq!(get(env::OMP_NUM_THREADS), None);
        assert_eq!(get(env::USE_CPU).as_deref(), Some("1"));
        assert_eq!(get(env::RANK).as_deref(), Some("1"));
        assert_eq!(get(env::MASTER_PORT).as_deref(), Some("1234"));
        assert_eq!(get(env::MIXED_PRECISION), None);
        assert_eq!(get(env::CUDA_VISIBLE_DEVICES), None);
    }

    #[test]
    fn multi_machine_ranks_are_offset_by_the_machine_rank() {
        let e = CommonEnv::new(
            &EnvSpec {
                num_machines: 3,
                machine_rank: 2,
                mixed_precision: Some(MixedPrecision::Bf16),
                gpu_ids: Some("0,1".into()),
                ..spec()
            },
            |_| false,
        );
        let vars = e.for_rank(1);
        let get = |k: &str| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.clone());
        assert_eq!(get(env::RANK).as_deref(), Some("5"));
        assert_eq!(get(env::LOCAL_RANK).as_deref(), Some("1"));
        assert_eq!(get(env::WORLD_SIZE).as_deref(), Some("6"));
        assert_eq!(get(env::LOCAL_WORLD_SIZE).as_deref(), Some("2"));
        assert_eq!(get(NODE_RANK).as_deref(), Some("2"));
        assert_eq!(get(env::MIXED_PRECISION).as_deref(), Some("bf16"));
        assert_eq!(get(env::CUDA_VISIBLE_DEVICES).as_deref(), Some("0,1"));
    }

    /// What `launch` exports, read back by the settings: the same run, on every rank.
    #[test]
    fn exported_environment_resolves_to_the_same_run() {
        use crate::settings::{Overrides, ProcessState};
        use std::collections::HashMap;
        use std::time::Duration;
        let spec = EnvSpec {
            num_machines: 2,
            machine_rank: 1,
            master_addr: "10.0.0.7".into(),
            port: 4321,
            secret: "s3cret".into(),
            restart_count: 1,
            mixed_precision: Some(MixedPrecision::Bf16),
            gradient_accumulation_steps: Some(4),
            timeout_secs: Some(12.5),
            bucket_cap_mb: Some(3.0),
            zero_stage: Some(3),
            offload_optimizer: Some(true),
            ..spec()
        };
        let common = CommonEnv::new(&spec, |_| false);
        let empty = tempfile::NamedTempFile::new().unwrap();
        for local in 0..spec.local_world_size {
            let vars: HashMap<String, String> = common
                .for_rank(local)
                .into_iter()
                .map(|(k, v)| (k.to_string(), v))
                .collect();
            let o = Overrides {
                config_file: Some(empty.path().to_path_buf()),
                ..Overrides::default()
            };
            let s = ProcessState::resolve(&o, &|k| vars.get(k).cloned()).unwrap();
            assert_eq!(s.rank(), common.global_rank(local));
            assert_eq!(s.rank(), 2 + local);
            assert_eq!(s.world_size(), 4);
            assert_eq!(s.local_rank(), local);
            assert_eq!(s.local_world_size(), 2);
            assert_eq!(s.master_addr(), Some("10.0.0.7"));
            assert_eq!(s.master_port(), 4321);
            assert_eq!(s.secret(), b"s3cret");
            assert!(s.use_cpu());
            assert_eq!(s.mixed_precision(), MixedPrecision::Bf16);
            assert_eq!(s.gradient_accumulation_steps(), 4);
            assert_eq!(s.timeout(), Duration::from_secs_f64(12.5));
            assert_eq!(s.bucket_cap_bytes(), 3 * 1024 * 1024);
            assert_eq!(s.zero_stage(), 3);
            assert!(s.offload_optimizer());
            assert_eq!(s.launcher(), "torchrun");
        }
    }
}
