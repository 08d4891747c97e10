//! Where this process stands in the run: the launcher family whose variables place it (torchrun,
//! SLURM, Open MPI), its rank, world size and local rank, the DP replicas, and its device.

use candle_core::Device;

use crate::error::{Error, Result};

use super::overrides::Overrides;
use super::parse::{env_value, pick, Count};
use super::{env, limits};

/// How the run is distributed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DistributedType {
    /// One process on CPU.
    No,
    /// One process on one GPU.
    SingleGpu,
    /// One process driving several model replicas, one thread each (GPUs, or CPU replicas).
    Dp,
    /// One process per GPU, gradients all-reduced with NCCL.
    Ddp,
    /// Several CPU processes, gradients all-reduced over TCP.
    MultiCpu,
}

impl std::fmt::Display for DistributedType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            DistributedType::No => "NO (single process, CPU)",
            DistributedType::SingleGpu => "SINGLE_GPU",
            DistributedType::Dp => "DP (one process, one thread per model replica)",
            DistributedType::Ddp => "DDP (one process per GPU)",
            DistributedType::MultiCpu => "MULTI_CPU (one process per CPU worker, TCP)",
        })
    }
}

/// A family of launcher variables (torchrun, SLURM, Open MPI).
pub(super) struct Family {
    name: &'static str,
    rank: &'static str,
    world: &'static str,
    local_rank: &'static str,
    local_world: &'static str,
}

pub(super) const FAMILIES: [Family; 3] = [
    Family {
        name: "torchrun",
        rank: env::RANK,
        world: env::WORLD_SIZE,
        local_rank: env::LOCAL_RANK,
        local_world: env::LOCAL_WORLD_SIZE,
    },
    Family {
        name: "slurm",
        rank: env::SLURM_PROCID,
        world: env::SLURM_NTASKS,
        local_rank: env::SLURM_LOCALID,
        local_world: env::SLURM_NTASKS_PER_NODE,
    },
    Family {
        name: "mpi",
        rank: env::OMPI_RANK,
        world: env::OMPI_SIZE,
        local_rank: env::OMPI_LOCAL_RANK,
        local_world: env::OMPI_LOCAL_SIZE,
    },
];

/// The launcher family (`torchrun`, `slurm` or `mpi`) whose rank variable is set, if any: this
/// process was placed in a run by a launcher.
pub(crate) fn launched_by(getenv: &dyn Fn(&str) -> Option<String>) -> Option<&'static str> {
    FAMILIES
        .iter()
        .find(|f| getenv(f.rank).is_some_and(|v| !v.trim().is_empty()))
        .map(|f| f.name)
}

/// The GPU ordinal (an index among the visible GPUs) a process with local rank `local_rank` drives
/// when it sees `visible` GPUs: its local rank when there are enough, GPU 0 when it sees exactly
/// one (SLURM `--gpus-per-task=1`, `CUDA_VISIBLE_DEVICES` set per rank, or several ranks on a
/// one-GPU machine), else its local rank modulo the count (ranks then share GPUs, which
/// the accelerator detects). `None` when no GPU is visible.
pub(crate) fn gpu_ordinal(local_rank: usize, visible: usize) -> Option<usize> {
    match visible {
        0 => None,
        1 => Some(0),
        n => Some(local_rank % n),
    }
}

/// CPU when asked (or when no GPU is available and none was asked for), else GPU `local_rank`.
pub(super) fn select_device(
    use_cpu: Option<bool>,
    rank: usize,
    local_rank: usize,
    world_size: usize,
) -> Result<(Device, DistributedType)> {
    let cpu = (
        Device::Cpu,
        if world_size > 1 {
            DistributedType::MultiCpu
        } else {
            DistributedType::No
        },
    );
    if use_cpu == Some(true) {
        return Ok(cpu);
    }
    let gpus_requested = use_cpu == Some(false);
    match crate::settings::gpu::device_count() {
        Ok(n) if n > 0 => {
            // One visible GPU is GPU 0 whatever the local rank (SLURM --gpus-per-task=1); more
            // local ranks than GPUs share them, which the accelerator detects and handles.
            let ordinal = gpu_ordinal(local_rank, n).unwrap_or(0);
            log::debug!("rank {rank}: local rank {local_rank} drives GPU {ordinal} of {n}");
            let device = crate::settings::gpu::device(ordinal)?;
            let kind = if world_size > 1 {
                DistributedType::Ddp
            } else {
                DistributedType::SingleGpu
            };
            Ok((device, kind))
        }
        Ok(_) if gpus_requested => Err(Error::NotAvailable {
            what: "GPU".into(),
            reason: format!(
                "use_cpu is false but no GPU is visible{}",
                env::cuda_visible_devices_note()
            ),
        }),
        Err(e) if gpus_requested => Err(e),
        _ => Ok(cpu),
    }
}

/// Number of DP replicas: the builder's value, else `ACCELERATE_RS_DATA_PARALLEL`, else 1.
/// Zero is an error.
pub(crate) fn data_parallel(
    builder: Option<usize>,
    getenv: &dyn Fn(&str) -> Option<String>,
) -> Result<usize> {
    let from_env = match builder {
        Some(_) => None,
        None => env_value::<usize>(getenv, env::DATA_PARALLEL).map_err(|e| match e {
            Error::Env { var, value, .. } => Error::Env {
                var,
                value,
                reason: "expected the number of DP replicas (1 = no DP)".into(),
            },
            other => other,
        })?,
    };
    match pick(builder, from_env, None, 1) {
        n if n > limits::MAX_PROCESSES => Err(Error::invalid(
            "data_parallel",
            format!(
                "{n} DP replicas is more than the {} one process can drive",
                limits::MAX_PROCESSES
            ),
        )),
        0 if builder.is_some() => Err(Error::invalid(
            "data_parallel",
            "DP needs at least 1 replica, got 0",
        )),
        0 => Err(Error::Env {
            var: env::DATA_PARALLEL.into(),
            value: "0".into(),
            reason: "DP needs at least 1 replica (1 = no DP)".into(),
        }),
        n => Ok(n),
    }
}

/// DP runs in one process: a world size above 1 is an error.
pub(super) fn check_single_process(replicas: usize, world_size: usize) -> Result<()> {
    if world_size > 1 {
        return Err(Error::invalid(
            "data_parallel",
            format!(
                "{replicas} DP replicas were asked for (`data_parallel` / {}) but the world size is {world_size}: DP runs all its replicas in one process; for several processes use `accelerate-rs launch -n N` (DDP) without DP",
                env::DATA_PARALLEL
            ),
        ));
    }
    Ok(())
}

/// Where this process stands: rank, world size, local rank and local world size, and which
/// launcher's variables said so.
pub(super) struct Place {
    pub(super) rank: usize,
    pub(super) world_size: usize,
    pub(super) local_rank: usize,
    pub(super) local_world_size: usize,
    pub(super) launcher: &'static str,
}

/// Rank and world size: the builder, else the first launcher family whose rank is set (the
/// families are not mixed); local rank and local world size likewise, defaulting to "every rank
/// on this machine". Inconsistent values are errors naming the variable.
pub(super) fn place(o: &Overrides, getenv: &dyn Fn(&str) -> Option<String>) -> Result<Place> {
    let get = |var: &str| getenv(var).filter(|v| !v.trim().is_empty());
    // Rank and world size: builder, else the first launcher family whose rank is set.
    let family = FAMILIES.iter().find(|f| get(f.rank).is_some());
    if family.is_none() && o.rank.is_none() {
        refuse_world_without_rank(getenv)?;
    }
    let (rank, world_size) = rank_and_world(o, getenv, family)?;
    let (local_rank, local_world_size) = local_place(o, getenv, family, rank, world_size)?;
    Ok(Place {
        rank,
        world_size,
        local_rank,
        local_world_size,
        launcher: match (o.rank, family) {
            (Some(_), _) => "builder",
            (None, Some(f)) => f.name,
            (None, None) => "none",
        },
    })
}

/// No family's rank is set: a family's world size above 1 is an error (its rank is missing).
fn refuse_world_without_rank(getenv: &dyn Fn(&str) -> Option<String>) -> Result<()> {
    for f in &FAMILIES {
        if let Some(Count(w)) = env_value(getenv, f.world)? {
            if w > 1 {
                return Err(Error::Env {
                    var: f.rank.into(),
                    value: String::new(),
                    reason: format!("{}={w} is set but {} is not; set both (or run under `accelerate-rs launch`)", f.world, f.rank),
                });
            }
        }
    }
    Ok(())
}

/// The count in variable `var` of the launcher family (none without a family), with its name.
fn family_count(
    getenv: &dyn Fn(&str) -> Option<String>,
    var: Option<&'static str>,
) -> Result<Option<(usize, &'static str)>> {
    match var {
        Some(v) => Ok(env_value::<Count>(getenv, v)?.map(|c| (c.0, v))),
        None => Ok(None),
    }
}

/// Rank and world size: the builder, else the family's variables (both or neither), checked.
fn rank_and_world(
    o: &Overrides,
    getenv: &dyn Fn(&str) -> Option<String>,
    family: Option<&Family>,
) -> Result<(usize, usize)> {
    let env_rank = family_count(getenv, family.map(|f| f.rank))?;
    let env_world = family_count(getenv, family.map(|f| f.world))?;
    if let (Some(f), Some(_), None) = (family, env_rank, env_world) {
        if o.world_size.is_none() {
            return Err(Error::Env {
                var: f.world.into(),
                value: String::new(),
                reason: format!("{} is set but {} is not; set both", f.rank, f.world),
            });
        }
    }
    let rank = pick(o.rank, env_rank.map(|r| r.0), None, 0);
    let world_size = pick(o.world_size, env_world.map(|w| w.0), None, 1);
    let (rank_var, world_var) = (
        env_rank.map_or("rank (builder)", |r| r.1),
        env_world.map_or("world_size (builder)", |w| w.1),
    );
    if world_size == 0 || world_size > limits::MAX_WORLD_SIZE {
        return Err(Error::Env {
            var: world_var.into(),
            value: world_size.to_string(),
            reason: format!(
                "the world size must be from 1 to {}",
                limits::MAX_WORLD_SIZE
            ),
        });
    }
    if rank >= world_size {
        return Err(Error::Env {
            var: rank_var.into(),
            value: rank.to_string(),
            reason: format!("rank {rank} is not below the world size {world_size} ({world_var})"),
        });
    }
    Ok((rank, world_size))
}

/// Local rank and local world size: the builder, else the family's variables, else "every rank
/// on this machine"; checked.
fn local_place(
    o: &Overrides,
    getenv: &dyn Fn(&str) -> Option<String>,
    family: Option<&Family>,
    rank: usize,
    world_size: usize,
) -> Result<(usize, usize)> {
    let env_local_rank = family_count(getenv, family.map(|f| f.local_rank))?;
    let env_local_world = family_count(getenv, family.map(|f| f.local_world))?;
    let local_world_size = pick(
        o.local_world_size,
        env_local_world.map(|v| v.0),
        None,
        world_size,
    );
    // Without a local rank, assume every rank runs on this machine.
    let local_rank = pick(o.local_rank, env_local_rank.map(|v| v.0), None, rank);
    if local_world_size == 0 || local_rank >= local_world_size {
        let var = env_local_rank.map_or("local_rank", |v| v.1);
        return Err(Error::Env {
            var: var.into(),
            value: local_rank.to_string(),
            reason: format!(
                "local rank {local_rank} is not below the local world size {local_world_size}"
            ),
        });
    }
    Ok((local_rank, local_world_size))
}
