//! Who am I in the run? Rank, world size, device and settings, resolved with one precedence:
//! builder call > environment variable > config file > default.

use std::path::PathBuf;
use std::time::Duration;

use candle_core::Device;

use crate::error::Result;
use crate::settings::{ConfigFile, MissingGradients, MixedPrecision, NonFinite, Transport};

use super::groups::{collective_limits, GradientSettings, Rendezvous, RunSettings};
use super::overrides::Overrides;
use super::place::DistributedType;
use super::place::{check_single_process, data_parallel, place, select_device, Place};

/// This process's place in the run and the settings in force.
#[derive(Clone)]
pub struct ProcessState {
    rank: usize,
    local_rank: usize,
    world_size: usize,
    local_world_size: usize,
    distributed_type: DistributedType,
    device: Device,
    master_addr: Option<String>,
    master_port: u16,
    timeout: Duration,
    bucket_cap_bytes: usize,
    tune_malloc: bool,
    transport: Transport,
    missing_gradients: MissingGradients,
    nonfinite: NonFinite,
    zero_stage: usize,
    offload_optimizer: bool,
    split_batches: bool,
    overlap: bool,
    debug: bool,
    data_parallel: usize,
    secret: Vec<u8>,
    mixed_precision: MixedPrecision,
    gradient_accumulation_steps: usize,
    launcher: &'static str,
    config_path: Option<PathBuf>,
    use_cpu: bool,
}

impl std::fmt::Debug for ProcessState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProcessState")
            .field("rank", &self.rank)
            .field("local_rank", &self.local_rank)
            .field("world_size", &self.world_size)
            .field("local_world_size", &self.local_world_size)
            .field("distributed_type", &self.distributed_type)
            .field("device", &self.device)
            .field("master_addr", &self.master_addr)
            .field("master_port", &self.master_port)
            .field("timeout", &self.timeout)
            .field("bucket_cap_bytes", &self.bucket_cap_bytes)
            .field("tune_malloc", &self.tune_malloc)
            .field("transport", &self.transport)
            .field("missing_gradients", &self.missing_gradients)
            .field("nonfinite", &self.nonfinite)
            .field("zero_stage", &self.zero_stage)
            .field("offload_optimizer", &self.offload_optimizer)
            .field("split_batches", &self.split_batches)
            .field("overlap", &self.overlap)
            .field("debug", &self.debug)
            .field("data_parallel", &self.data_parallel)
            .field(
                "secret",
                &if self.secret.is_empty() {
                    "(none)"
                } else {
                    "(set)"
                },
            )
            .field("mixed_precision", &self.mixed_precision)
            .field(
                "gradient_accumulation_steps",
                &self.gradient_accumulation_steps,
            )
            .field("launcher", &self.launcher)
            .field("config_path", &self.config_path)
            .finish()
    }
}

impl ProcessState {
    /// Resolves the state from builder overrides, the environment (`getenv`) and the config file.
    pub(crate) fn resolve(o: &Overrides, getenv: &dyn Fn(&str) -> Option<String>) -> Result<Self> {
        let (cfg, config_path) = ConfigFile::load_located(o.config_file.as_deref(), getenv)?;

        let Place {
            rank,
            world_size,
            local_rank,
            local_world_size,
            launcher,
        } = place(o, getenv)?;
        // DP: one process, several replicas, started by `AcceleratorBuilder::run` (a replica's
        // world is its replicas).
        let data_parallel = data_parallel(o.data_parallel, getenv)?;
        if data_parallel > 1 && o.replica_device.is_none() {
            check_single_process(data_parallel, world_size)?;
        }
        let meet = Rendezvous::resolve(o, getenv, &cfg, world_size, launcher)?;
        let (timeout, bucket_cap_mb) = collective_limits(o, getenv, &cfg)?;
        let grads = GradientSettings::resolve(o, getenv, &cfg)?;
        let run = RunSettings::resolve(o, getenv, &cfg)?;
        check_kernel_switches(getenv)?;

        let (device, distributed_type) = match &o.replica_device {
            Some(d) => (d.clone(), DistributedType::Dp),
            None => select_device(run.use_cpu, rank, local_rank, world_size)?,
        };

        Ok(ProcessState {
            rank,
            local_rank,
            world_size,
            local_world_size,
            distributed_type,
            device,
            master_addr: meet.master_addr,
            master_port: meet.master_port,
            timeout,
            bucket_cap_bytes: (bucket_cap_mb * 1024.0 * 1024.0) as usize,
            tune_malloc: grads.tune_malloc,
            transport: meet.transport,
            missing_gradients: grads.missing_gradients,
            nonfinite: grads.nonfinite,
            zero_stage: grads.zero_stage,
            offload_optimizer: grads.offload_optimizer,
            split_batches: run.split_batches,
            overlap: run.overlap,
            debug: run.debug,
            data_parallel,
            secret: run.secret,
            mixed_precision: run.mixed_precision,
            gradient_accumulation_steps: run.gradient_accumulation_steps,
            launcher,
            config_path,
            use_cpu: run.use_cpu == Some(true),
        })
    }

    /// Global rank, `0..world_size`.
    pub fn rank(&self) -> usize {
        self.rank
    }
    /// Rank on this machine.
    pub fn local_rank(&self) -> usize {
        self.local_rank
    }
    /// Number of processes in the run.
    pub fn world_size(&self) -> usize {
        self.world_size
    }
    /// Number of processes on this machine.
    pub fn local_world_size(&self) -> usize {
        self.local_world_size
    }
    /// How the run is distributed.
    pub fn distributed_type(&self) -> DistributedType {
        self.distributed_type
    }
    /// The device this process computes on.
    pub fn device(&self) -> &Device {
        &self.device
    }
    /// Rank 0?
    pub fn is_main_process(&self) -> bool {
        self.rank == 0
    }
    /// Local rank 0?
    pub fn is_local_main_process(&self) -> bool {
        self.local_rank == 0
    }
    /// Address of rank 0, when distributed.
    pub fn master_addr(&self) -> Option<&str> {
        self.master_addr.as_deref()
    }
    /// Rendezvous port.
    pub fn master_port(&self) -> u16 {
        self.master_port
    }
    /// Timeout of every collective.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }
    /// Gradient bucket cap in bytes.
    pub fn bucket_cap_bytes(&self) -> usize {
        self.bucket_cap_bytes
    }

    /// The data path between processes ([`Transport`]).
    pub fn transport(&self) -> Transport {
        self.transport
    }
    /// Whether prepared data loaders take their batch size as the global one, split across the
    /// ranks (Accelerate's `split_batches`), instead of per rank.
    pub fn split_batches(&self) -> bool {
        self.split_batches
    }
    /// ZeRO-style sharding stage: 0 (none), 1 (optimizer state), 2 (optimizer state and
    /// gradients) or 3 (parameters too).
    pub fn zero_stage(&self) -> usize {
        self.zero_stage
    }

    /// ZeRO stage 3: whether the optimizer state, f32 masters and f32 gradients of this rank's
    /// shards live in host memory and are stepped there (`ACCELERATE_RS_OFFLOAD_OPTIMIZER`).
    pub fn offload_optimizer(&self) -> bool {
        self.offload_optimizer
    }
    /// What the first optimizer step does when registered parameters received no gradient.
    pub fn missing_gradients(&self) -> MissingGradients {
        self.missing_gradients
    }
    /// What an optimizer step does when the gradients turn non-finite.
    pub fn nonfinite(&self) -> NonFinite {
        self.nonfinite
    }

    /// Whether CPU gradient buckets are all-reduced on a communication thread while the next is
    /// flattened (`ACCELERATE_RS_OVERLAP`, default on).
    pub fn overlap(&self) -> bool {
        self.overlap
    }

    /// Whether collectives check shapes across ranks first (`ACCELERATE_RS_DEBUG`, default off).
    pub fn debug(&self) -> bool {
        self.debug
    }

    /// DP replicas driven by this process (builder `data_parallel`,
    /// `ACCELERATE_RS_DATA_PARALLEL`; 1 = no DP).
    pub fn data_parallel(&self) -> usize {
        self.data_parallel
    }

    /// Whether glibc's allocator is tuned for training (see [`crate::allocator`]).
    pub fn tune_malloc(&self) -> bool {
        self.tune_malloc
    }
    /// Which launcher's variables were used: `torchrun`, `slurm`, `mpi`, `builder` or `none`.
    pub fn launcher(&self) -> &'static str {
        self.launcher
    }
    /// The config file that was read, if any.
    pub fn config_path(&self) -> Option<&std::path::Path> {
        self.config_path.as_deref()
    }
    /// Mixed precision mode requested through the builder, `ACCELERATE_RS_MIXED_PRECISION` (set by
    /// `launch --mixed-precision`) or the config file; applied by
    /// [`Accelerator::prepare_mixed`](crate::Accelerator::prepare_mixed).
    pub fn mixed_precision(&self) -> MixedPrecision {
        self.mixed_precision
    }
    /// Gradient accumulation steps requested through `ACCELERATE_RS_GRADIENT_ACCUMULATION_STEPS`
    /// or the config file (1 = step every batch); see [`Accelerator::backward`](crate::Accelerator::backward).
    pub fn gradient_accumulation_steps(&self) -> usize {
        self.gradient_accumulation_steps
    }
    pub(crate) fn secret(&self) -> &[u8] {
        &self.secret
    }
    /// Whether the CPU was asked for (builder, `ACCELERATE_RS_USE_CPU` or `use_cpu`).
    pub(crate) fn use_cpu(&self) -> bool {
        self.use_cpu
    }
}

/// The switches of `nn`'s CUDA kernels are read where the kernels are first used, on a GPU
/// only; a value that is not a flag is still an error naming the variable here, at start-up,
/// on every device (a CPU run would otherwise never say that the variable is wrong).
fn check_kernel_switches(getenv: &dyn Fn(&str) -> Option<String>) -> Result<()> {
    for var in [
        super::env::NN_CUDA,
        super::env::NN_CUDA_FLASH,
        super::env::CUDA_TRIAL,
    ] {
        super::parse::env_value::<bool>(getenv, var)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::settings::defaults::DEFAULT_TIMEOUT;
    use crate::settings::env;
    use std::collections::HashMap;

    /// Resolves with a private empty config file unless the test names one, so that a config
    /// file on the developer's machine cannot change the outcome.
    fn resolve(vars: &[(&str, &str)], o: Overrides) -> Result<ProcessState> {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let empty = tempfile::NamedTempFile::new().unwrap();
        let o = Overrides {
            config_file: o.config_file.clone().or(Some(empty.path().to_path_buf())),
            ..o
        };
        ProcessState::resolve(&o, &|k| map.get(k).cloned())
    }

    #[test]
    fn nonfinite_comes_from_builder_env_and_default() {
        let s = resolve(&[], Overrides::default()).unwrap();
        assert_eq!(s.nonfinite(), NonFinite::Error);
        let s = resolve(&[(env::NONFINITE, "skip-step")], Overrides::default()).unwrap();
        assert_eq!(s.nonfinite(), NonFinite::SkipStep);
        let o = Overrides {
            nonfinite: Some(NonFinite::Warn),
            ..Overrides::default()
        };
        assert_eq!(
            resolve(&[(env::NONFINITE, "off")], o).unwrap().nonfinite(),
            NonFinite::Warn
        );
        let e = resolve(&[(env::NONFINITE, "sometimes")], Overrides::default())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("ACCELERATE_RS_NONFINITE") && e.contains("`skip-step`"),
            "{e}"
        );
    }

    #[test]
    fn kernel_switches_that_are_not_flags_are_errors_at_start_up() {
        for var in [env::NN_CUDA, env::NN_CUDA_FLASH, env::CUDA_TRIAL] {
            assert!(resolve(&[(var, "0")], Overrides::default()).is_ok());
            let e = resolve(&[(var, "maybe")], Overrides::default())
                .unwrap_err()
                .to_string();
            assert!(e.contains(var) && e.contains("maybe"), "{e}");
        }
    }

    #[test]
    fn defaults_to_a_single_cpu_process() {
        let s = resolve(&[], Overrides::default()).unwrap();
        assert_eq!((s.rank(), s.world_size(), s.local_rank()), (0, 1, 0));
        assert_eq!(s.distributed_type(), DistributedType::No);
        assert!(s.is_main_process() && s.is_local_main_process());
        assert_eq!(s.timeout(), DEFAULT_TIMEOUT);
        assert_eq!(s.bucket_cap_bytes(), 25 * 1024 * 1024);
    }

    #[test]
    fn torchrun_variables() {
        let s = resolve(
            &[
                ("RANK", "3"),
                ("WORLD_SIZE", "4"),
                ("LOCAL_RANK", "1"),
                ("LOCAL_WORLD_SIZE", "2"),
                ("MASTER_ADDR", "10.0.0.1"),
                ("MASTER_PORT", "1234"),
            ],
            Overrides::default(),
        )
        .unwrap();
        assert_eq!((s.rank(), s.world_size(), s.local_rank()), (3, 4, 1));
        assert_eq!(s.local_world_size(), 2);
        assert!(!s.is_main_process() && !s.is_local_main_process());
        assert_eq!(s.master_addr(), Some("10.0.0.1"));
        assert_eq!(s.master_port(), 1234);
        assert_eq!(s.distributed_type(), DistributedType::MultiCpu);
        assert_eq!(s.launcher(), "torchrun");
    }

    #[test]
    fn slurm_and_mpi_variables() {
        let s = resolve(
            &[
                ("SLURM_PROCID", "5"),
                ("SLURM_NTASKS", "8"),
                ("SLURM_LOCALID", "1"),
                ("SLURM_NTASKS_PER_NODE", "4(x2)"),
                ("MASTER_ADDR", "node1"),
            ],
            Overrides::default(),
        )
        .unwrap();
        assert_eq!(
            (
                s.rank(),
                s.world_size(),
                s.local_rank(),
                s.local_world_size()
            ),
            (5, 8, 1, 4)
        );
        assert_eq!(s.launcher(), "slurm");
        let s = resolve(
            &[
                ("OMPI_COMM_WORLD_RANK", "1"),
                ("OMPI_COMM_WORLD_SIZE", "2"),
                ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
                ("MASTER_ADDR", "127.0.0.1"),
            ],
            Overrides::default(),
        )
        .unwrap();
        assert_eq!((s.rank(), s.world_size(), s.local_rank()), (1, 2, 1));
        assert_eq!(s.launcher(), "mpi");
    }

    #[test]
    fn inconsistent_environment_names_the_variable_and_value() {
        let err =
            |vars: &[(&str, &str)]| resolve(vars, Overrides::default()).unwrap_err().to_string();
        let e = err(&[("RANK", "2"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "x")]);
        assert!(e.contains("RANK") && e.contains("\"2\""), "{e}");
        let e = err(&[("RANK", "0"), ("WORLD_SIZE", "2")]);
        assert!(e.contains("MASTER_ADDR"), "{e}");
        let e = err(&[("RANK", "zero"), ("WORLD_SIZE", "2")]);
        assert!(e.contains("RANK") && e.contains("zero"), "{e}");
        let e = err(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "x"),
            ("MASTER_PORT", "99999"),
        ]);
        assert!(e.contains("MASTER_PORT") && e.contains("99999"), "{e}");
        let e = err(&[("WORLD_SIZE", "2")]);
        assert!(e.contains("RANK"), "{e}");
        let e = err(&[("RANK", "1")]);
        assert!(e.contains("WORLD_SIZE"), "{e}");
        let e = err(&[("ACCELERATE_RS_TIMEOUT_SECS", "-3")]);
        assert!(
            e.contains("ACCELERATE_RS_TIMEOUT_SECS") && e.contains("-3"),
            "{e}"
        );
        let e = err(&[("ACCELERATE_RS_USE_CPU", "maybe")]);
        assert!(
            e.contains("ACCELERATE_RS_USE_CPU") && e.contains("maybe"),
            "{e}"
        );
    }

    #[test]
    fn gpus_asked_of_a_build_without_cuda_is_a_clear_error() {
        if crate::settings::gpu::BUILT_WITH_CUDA {
            return;
        }
        let err = resolve(&[("ACCELERATE_RS_USE_CPU", "0")], Overrides::default())
            .unwrap_err()
            .to_string();
        assert!(err.contains("built without the `cuda` feature"), "{err}");
        // Nobody asked: the CPU is used quietly.
        let s = resolve(&[], Overrides::default()).unwrap();
        assert!(matches!(s.device(), Device::Cpu));
    }

    #[test]
    fn tune_malloc_precedence_and_bad_values() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = dir.path().join("c.toml");
        std::fs::write(&cfg, "tune_malloc = false\n").unwrap();
        let with_cfg = || Overrides {
            config_file: Some(cfg.clone()),
            ..Overrides::default()
        };
        assert!(resolve(&[], Overrides::default()).unwrap().tune_malloc());
        assert!(!resolve(&[], with_cfg()).unwrap().tune_malloc());
        let env_on = [("ACCELERATE_RS_TUNE_MALLOC", "1")];
        assert!(resolve(&env_on, with_cfg()).unwrap().tune_malloc());
        let builder_off = Overrides {
            tune_malloc: Some(false),
            ..with_cfg()
        };
        assert!(!resolve(&env_on, builder_off).unwrap().tune_malloc());
        let err = resolve(
            &[("ACCELERATE_RS_TUNE_MALLOC", "maybe")],
            Overrides::default(),
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("ACCELERATE_RS_TUNE_MALLOC"), "{err}");
    }

    #[test]
    fn transport_precedence_and_bad_values() {
        use crate::settings::Transport;
        let dir = tempfile::tempdir().unwrap();
        let cfg = dir.path().join("c.toml");
        std::fs::write(&cfg, "transport = \"tcp\"\n").unwrap();
        let with_cfg = || Overrides {
            config_file: Some(cfg.clone()),
            ..Overrides::default()
        };
        let t = |env: &[(&str, &str)], o: Overrides| resolve(env, o).unwrap().transport();
        assert_eq!(t(&[], Overrides::default()), Transport::Auto);
        assert_eq!(t(&[], with_cfg()), Transport::Tcp);
        let env_shm = [("ACCELERATE_RS_TRANSPORT", "SHM")];
        assert_eq!(t(&env_shm, with_cfg()), Transport::Shm);
        let builder = Overrides {
            transport: Some(Transport::Auto),
            ..with_cfg()
        };
        assert_eq!(t(&env_shm, builder), Transport::Auto);
        let err = resolve(&[("ACCELERATE_RS_TRANSPORT", "ib")], Overrides::default())
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("ACCELERATE_RS_TRANSPORT") && err.contains("\"ib\""),
            "{err}"
        );
        std::fs::write(&cfg, "transport = \"ib\"\n").unwrap();
        let err = resolve(&[], with_cfg()).unwrap_err().to_string();
        assert!(err.contains("transport"), "{err}");
    }

    #[test]
    fn builder_beats_env_beats_config_beats_default() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = dir.path().join("c.toml");
        std::fs::write(
            &cfg,
            "collective_timeout_secs = 7\nbucket_cap_mb = 3\nmain_process_port = 4444\n",
        )
        .unwrap();
        let with_cfg = || Overrides {
            config_file: Some(cfg.clone()),
            ..Overrides::default()
        };
        // config beats default
        let s = resolve(&[], with_cfg()).unwrap();
        assert_eq!(s.timeout(), Duration::from_secs(7));
        assert_eq!(s.bucket_cap_bytes(), 3 * 1024 * 1024);
        assert_eq!(s.master_port(), 4444);
        assert_eq!(s.config_path(), Some(cfg.as_path()));
        // env beats config
        let s = resolve(
            &[("ACCELERATE_RS_TIMEOUT_SECS", "9"), ("MASTER_PORT", "5555")],
            with_cfg(),
        )
        .unwrap();
        assert_eq!(s.timeout(), Duration::from_secs(9));
        assert_eq!(s.master_port(), 5555);
        // builder beats env
        let s = resolve(
            &[("ACCELERATE_RS_TIMEOUT_SECS", "9")],
            Overrides {
                timeout: Some(Duration::from_secs(11)),
                ..with_cfg()
            },
        )
        .unwrap();
        assert_eq!(s.timeout(), Duration::from_secs(11));
    }
}

/// Every setting source fed random strings and extreme numbers: the result is a valid state or
/// an error, never a panic (an overflow, `Duration::from_secs_f64` on `1e300`, ...).
#[cfg(test)]
mod property {
    use std::collections::HashMap;

    use proptest::prelude::*;

    use super::*;
    use crate::settings::env as e;

    /// Every variable the settings read.
    const VARS: [&str; 33] = [
        e::RANK,
        e::WORLD_SIZE,
        e::LOCAL_RANK,
        e::LOCAL_WORLD_SIZE,
        e::MASTER_ADDR,
        e::MASTER_PORT,
        e::GROUP_RANK,
        e::NODE_RANK,
        e::NUM_NODES,
        e::SLURM_PROCID,
        e::SLURM_NTASKS,
        e::SLURM_LOCALID,
        e::SLURM_NTASKS_PER_NODE,
        e::OMPI_RANK,
        e::OMPI_SIZE,
        e::OMPI_LOCAL_RANK,
        e::OMPI_LOCAL_SIZE,
        e::SECRET,
        e::USE_CPU,
        e::TIMEOUT_SECS,
        e::BUCKET_CAP_MB,
        e::OVERLAP,
        e::TUNE_MALLOC,
        e::MIXED_PRECISION,
        e::GRADIENT_ACCUMULATION_STEPS,
        e::DATA_PARALLEL,
        e::DEBUG,
        e::TRANSPORT,
        e::MISSING_GRADIENTS,
        e::NONFINITE,
        e::ZERO_STAGE,
        e::OFFLOAD_OPTIMIZER,
        e::NUM_PROCESSES,
    ];

    /// Config keys and the kind of value they take (any value is tried anyway).
    const KEYS: [&str; 18] = [
        "use_cpu",
        "num_machines",
        "machine_rank",
        "main_process_ip",
        "main_process_port",
        "num_processes",
        "mixed_precision",
        "gradient_accumulation_steps",
        "collective_timeout_secs",
        "bucket_cap_mb",
        "transport",
        "tune_malloc",
        "max_restarts",
        "monitor_interval_secs",
        "missing_gradients",
        "nonfinite",
        "zero_stage",
        "offload_optimizer",
    ];

    fn value() -> impl Strategy<Value = String> {
        prop_oneof![
            Just("1e300".to_string()),
            Just("1e19".to_string()),
            Just("-1".to_string()),
            Just("NaN".to_string()),
            Just("inf".to_string()),
            Just("0".to_string()),
            Just("18446744073709551615".to_string()),
            Just("18446744073709551616".to_string()),
            Just("4(x2)".to_string()),
            Just(String::new()),
            "-?[0-9]{1,22}(\\.[0-9]{1,4})?(e-?[0-9]{1,3})?",
            "[a-z0-9 .:()-]{0,12}",
            any::<String>(),
        ]
    }

    fn toml_value() -> impl Strategy<Value = String> {
        prop_oneof![
            Just("1e300".to_string()),
            Just("1e19".to_string()),
            Just("-1".to_string()),
            Just("nan".to_string()),
            Just("inf".to_string()),
            Just("-inf".to_string()),
            Just("9223372036854775807".to_string()),
            Just("0".to_string()),
            Just("true".to_string()),
            "-?[0-9]{1,19}",
            "-?[0-9]{1,6}\\.[0-9]{1,4}(e[0-9]{1,3})?",
            "\"[a-z0-9,.]{0,8}\"",
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(300))]

        #[test]
        fn env_and_config_never_panic(
            vars in proptest::collection::vec((0..VARS.len(), value()), 0..8),
            keys in proptest::collection::vec((0..KEYS.len(), toml_value()), 0..5),
        ) {
            let mut map: HashMap<String, String> = vars
                .into_iter()
                .map(|(i, v)| (VARS[i].to_string(), v))
                .collect();
            // Never touch GPUs or the process's own environment.
            map.insert(e::USE_CPU.to_string(), "1".into());
            let mut text = String::new();
            let mut seen = std::collections::HashSet::new();
            for (i, v) in keys {
                if seen.insert(i) {
                    text.push_str(&format!("{} = {v}\n", KEYS[i]));
                }
            }
            let cfg = tempfile::NamedTempFile::new().unwrap();
            std::fs::write(cfg.path(), &text).unwrap();
            let o = Overrides {
                config_file: Some(cfg.path().to_path_buf()),
                ..Overrides::default()
            };
            // Ok or Err; a panic fails the test.
            let _ = ProcessState::resolve(&o, &|k| map.get(k).cloned());
            let _ = crate::settings::self_launch(&o, &|k| map.get(k).cloned());
            let _ = ConfigFile::parse(&text, cfg.path());
        }

        #[test]
        fn builder_values_never_panic(
            secs in prop_oneof![Just(f64::MAX), Just(1e19), Just(0.0), any::<f64>()],
            big in prop_oneof![Just(usize::MAX), Just(0usize), any::<usize>()],
            mb in prop_oneof![Just(f64::NAN), Just(-1.0), Just(1e300), any::<f64>()],
        ) {
            let timeout = Duration::try_from_secs_f64(secs.abs()).unwrap_or(Duration::MAX);
            for o in [
                Overrides { timeout: Some(timeout), ..Overrides::default() },
                Overrides { bucket_cap_mb: Some(mb), ..Overrides::default() },
                Overrides { gradient_accumulation_steps: Some(big), ..Overrides::default() },
                Overrides { data_parallel: Some(big), ..Overrides::default() },
                Overrides { zero_stage: Some(big), ..Overrides::default() },
                Overrides { world_size: Some(big), rank: Some(big / 2), ..Overrides::default() },
            ] {
                let cfg = tempfile::NamedTempFile::new().unwrap();
                let o = Overrides { config_file: Some(cfg.path().to_path_buf()), cpu: Some(true), ..o };
                let _ = ProcessState::resolve(&o, &|_| None);
            }
        }
    }

    #[test]
    fn the_panics_of_the_fault_injection_pass_are_range_errors() {
        let cfg = tempfile::NamedTempFile::new().unwrap();
        for bad in ["1e300", "1e19", "NaN", "-1", "inf"] {
            std::fs::write(
                cfg.path(),
                format!(
                    "collective_timeout_secs = {}\n",
                    if bad == "NaN" { "nan" } else { bad }
                ),
            )
            .unwrap();
            let e = ConfigFile::load(cfg.path()).unwrap_err().to_string();
            assert!(
                e.contains("collective_timeout_secs") && e.contains("604800"),
                "{bad}: {e}"
            );
            let map: HashMap<&str, &str> = [(e::TIMEOUT_SECS, bad), (e::USE_CPU, "1")].into();
            let empty = tempfile::NamedTempFile::new().unwrap();
            let o = Overrides {
                config_file: Some(empty.path().to_path_buf()),
                ..Overrides::default()
            };
            let err = ProcessState::resolve(&o, &|k| map.get(k).map(|v| v.to_string()))
                .unwrap_err()
                .to_string();
            assert!(
                err.contains(e::TIMEOUT_SECS) && err.contains("604800"),
                "{bad}: {err}"
            );
        }
    }
}
