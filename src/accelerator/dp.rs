//! DP: one process drives several model replicas, one thread each.
//!
//! Rust has no global interpreter lock, so a thread per replica scales like a process per
//! replica (DDP) without a launcher: each replica gets its own [`Accelerator`] (rank = replica
//! index, world size = number of replicas, [`DistributedType::Dp`](crate::settings::DistributedType::Dp)),
//! and the replicas average their gradients through an in-process collective: NCCL
//! communicators between GPUs `0..replicas`, or a [`ThreadGroup`] for CPU replicas
//! ([`cpu(true)`](crate::AcceleratorBuilder::cpu)).
//!
//! Ask for DP with [`data_parallel(n)`](crate::AcceleratorBuilder::data_parallel) or
//! `ACCELERATE_RS_DATA_PARALLEL=n` (the builder wins; `1` means no DP), then start the training
//! closure with [`run`](crate::AcceleratorBuilder::run). `run` calls the closure once per
//! replica on threads named `accelerate-rs-replica-<i>`, or exactly once on the calling thread in
//! every other mode, so the same closure serves DP, DDP and a single process. Only replica 0 is
//! the main process: [`Accelerator::print`] prints once.
//!
//! DP runs in one process: combining it with a world size above 1 (`RANK`/`WORLD_SIZE`) is an
//! error; use `accelerate-rs launch -n N` (DDP) for several processes. `build()` and
//! [`Accelerator::new`] refuse a DP request too, since they make a single accelerator.
//!
//! ```
//! use accelerate_rs::{Accelerator, AcceleratorBuilder, DataLoader, TensorDataset};
//! use candle_core::{DType, Device, Module, Tensor};
//! use candle_nn::{linear, loss, Optimizer, VarBuilder, VarMap, SGD};
//!
//! /// The training closure: the same code for DP, DDP and one process.
//! fn train(accelerator: Accelerator) -> accelerate_rs::Result<f32> {
//!     let device = accelerator.device().clone();
//!     let x = Tensor::arange(0f32, 64.0, &Device::Cpu)?.reshape((16, 4))?.affine(0.01, 0.0)?;
//!     let y = x.sum_keepdim(1)?;
//!     let varmap = VarMap::new();
//!     let model = linear(4, 1, VarBuilder::from_varmap(&varmap, DType::F32, &device).pp("fc"))?;
//!     let opt = SGD::new(varmap.all_vars(), 0.1)?;
//!     let loader = DataLoader::new(TensorDataset::new(vec![x, y])?, 4);
//!     let (mut opt, loader) = accelerator.prepare(&varmap, opt, loader)?;
//!     let mut last = 0.0;
//!     for _epoch in 0..5 {
//!         for batch in loader.iter()? {
//!             let batch = batch?;
//!             let loss = loss::mse(&model.forward(&batch[0])?, &batch[1])?;
//!             opt.backward_step(&loss)?;
//!             last = loss.to_scalar::<f32>()?;
//!         }
//!     }
//!     accelerator.print(format!("{}: last loss {last}", accelerator.distributed_type()));
//!     Ok(last)
//! }
//!
//! fn main() -> accelerate_rs::Result<()> {
//!     // DP: two CPU replicas, one thread each; one result per replica, in replica order.
//!     let per_replica = Accelerator::builder().cpu(true).data_parallel(2).run(train)?;
//!     assert_eq!(per_replica.len(), 2);
//!     // Without DP the same closure runs once, on this thread.
//!     let single = AcceleratorBuilder::default().cpu(true).data_parallel(1).run(train)?;
//!     assert_eq!(single.len(), 1);
//!     Ok(())
//! }
//! ```

use std::sync::{Arc, Mutex};
use std::time::Duration;

use candle_core::Device;

use super::Accelerator;
use crate::collective::{Collective, NcclCollective, ThreadGroup};
use crate::error::{panic_message, Error, ReplicaCause, ReplicaFailure, Result};
use crate::settings::{env, Overrides, ProcessState};

/// The error of `build()` / `Accelerator::new()` when DP is asked for.
pub(crate) fn needs_run(replicas: usize) -> Error {
    Error::invalid(
        "data_parallel",
        format!(
            "{replicas} DP replicas were asked for (`data_parallel` / {}): DP drives one accelerator per replica, so start them with `AcceleratorBuilder::run(|accelerator| ...)` instead of `build()` / `Accelerator::new()`",
            env::DATA_PARALLEL
        ),
    )
}

/// `AcceleratorBuilder::run`: `getenv` reads the environment.
pub(crate) fn run<R, F>(
    o: Overrides,
    collective: Option<Arc<dyn Collective>>,
    getenv: &(dyn Fn(&str) -> Option<String> + Sync),
    f: F,
) -> Result<Vec<R>>
where
    R: Send,
    F: Fn(Accelerator) -> Result<R> + Send + Sync,
{
    // Resolved once as a whole: the settings are checked, and the replica count, the device kind
    // and the timeout are known.
    let probe = ProcessState::resolve(&o, getenv)?;
    let n = probe.data_parallel();
    if n == 1 {
        let collective = match collective {
            Some(c) => c,
            None => super::connect::connect(&probe)?,
        };
        // A handle kept here, so that the collective hears how the run ended before it goes
        // (NCCL closes a finished run together with the other ranks, and aborts a failed one).
        let keep = collective.clone();
        let result = f(Accelerator::from_parts(probe, collective));
        keep.set_run_outcome(result.is_ok());
        drop(keep);
        return Ok(vec![result?]);
    }
    if collective.is_some() {
        return Err(Error::invalid(
            "data_parallel",
            format!("{n} DP replicas were asked for together with an existing collective (`collective`); DP creates its own, one per replica"),
        ));
    }
    let (collectives, devices) = if probe.use_cpu() {
        cpu_replicas(n, probe.timeout())?
    } else {
        gpu_replicas(n, probe.timeout())?
    };
    log::debug!(
        "DP: {n} replicas on {}",
        if probe.use_cpu() { "the CPU" } else { "GPUs" }
    );
    run_replicas(&o, collectives, devices, getenv, &f)
}

type Replicas = (Vec<Arc<dyn Collective>>, Vec<Device>);

fn cpu_replicas(n: usize, timeout: Duration) -> Result<Replicas> {
    let collectives = ThreadGroup::new(n, timeout)?
        .into_iter()
        .map(|c| Arc::new(c) as Arc<dyn Collective>)
        .collect();
    Ok((collectives, vec![Device::Cpu; n]))
}

fn gpu_replicas(n: usize, timeout: Duration) -> Result<Replicas> {
    let visible = crate::settings::gpu::device_count().map_err(|e| match e {
        Error::NotAvailable { what, reason } => Error::NotAvailable {
            what,
            reason: format!(
                "{reason}; DP over {n} GPUs needs a build with CUDA, and `.cpu(true)` (or {}=1) runs the {n} replicas on the CPU instead",
                env::USE_CPU
            ),
        },
        other => other,
    })?;
    let ordinals = replica_ordinals(n, visible)?;
    let devices = ordinals
        .iter()
        .map(|&o| crate::settings::gpu::device(o))
        .collect::<Result<Vec<_>>>()?;
    // Two ordinals can be one GPU to NCCL (the same PCI bus id), not only a repeated ordinal.
    let bus_ids = devices
        .iter()
        .map(crate::settings::gpu::pci_bus_id)
        .collect::<Result<Vec<_>>>()?;
    if let Some((a, b)) = crate::collective::placement::first_shared(&bus_ids) {
        // NCCL cannot put two replicas on one GPU: reduce through host memory in a thread group,
        // every replica on its GPU's one device (and stream).
        eprintln!(
            "{}",
            crate::collective::placement::sharing_warning(a, b, "DP replicas", "a thread group")
        );
        let collectives = ThreadGroup::new(n, timeout)?
            .into_iter()
            .map(|c| Arc::new(c) as Arc<dyn Collective>)
            .collect();
        return Ok((collectives, devices));
    }
    let group = NcclCollective::group(&ordinals, timeout)?;
    if group.len() != n {
        return Err(Error::invalid(
            "data_parallel",
            format!("asked for {n} GPU communicators, got {}", group.len()),
        ));
    }
    // Each replica computes on the very device (and stream) its communicator was built on.
    Ok(group
        .into_iter()
        .map(|(device, c)| (Arc::new(c) as Arc<dyn Collective>, device))
        .unzip())
}

/// The GPU ordinal of each of `n` DP replicas when `visible` GPUs are visible: replica i on GPU
/// i, wrapping around (and so sharing) when there are more replicas than GPUs.
fn replica_ordinals(n: usize, visible: usize) -> Result<Vec<usize>> {
    (0..n)
        .map(|i| {
            crate::settings::place::gpu_ordinal(i, visible).ok_or_else(|| Error::NotAvailable {
                what: "GPU".into(),
                reason: format!(
                    "DP over {n} GPU replicas, but no GPU is visible{}; `.cpu(true)` (or {}=1) runs them on the CPU",
                    env::cuda_visible_devices_note(),
                    env::USE_CPU
                ),
            })
        })
        .collect()
}

/// Records the order in which replicas fail, so that `run` reports the first failure (the cause)
/// rather than the replicas that failed because of it.
struct FailureOrder<'a> {
    order: &'a Mutex<Vec<usize>>,
    replica: usize,
    armed: bool,
}

impl Drop for FailureOrder<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.order
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(self.replica);
        }
    }
}

fn run_replicas<R, F>(
    o: &Overrides,
    collectives: Vec<Arc<dyn Collective>>,
    devices: Vec<Device>,
    getenv: &(dyn Fn(&str) -> Option<String> + Sync),
    f: &F,
) -> Result<Vec<R>>
where
    R: Send,
    F: Fn(Accelerator) -> Result<R> + Send + Sync,
{
    let n = collectives.len();
    let order = Mutex::new(Vec::with_capacity(n));
    let outcomes: Vec<std::result::Result<R, ReplicaCause>> = std::thread::scope(|s| {
        let mut handles = Vec::with_capacity(n);
        for (i, (c, device)) in collectives.into_iter().zip(devices).enumerate() {
            let order = &order;
            let o = replica_overrides(o, n, i, device);
            let body = move || run_replica(&o, c, i, order, getenv, f);
            let spawned = std::thread::Builder::new()
                .name(format!("accelerate-rs-replica-{i}"))
                .spawn_scoped(s, body);
            handles.push(spawned.map_err(|e| {
                order.lock().unwrap_or_else(|p| p.into_inner()).push(i);
                ReplicaCause::Error(Error::invalid(
                    "data_parallel",
                    format!("could not start the thread of DP replica {i}: {e}"),
                ))
            }));
        }
        handles
            .into_iter()
            .map(|h| match h?.join() {
                Ok(Ok(r)) => Ok(r),
                Ok(Err(e)) => Err(ReplicaCause::Error(e)),
                Err(payload) => Err(ReplicaCause::Panic(panic_message(payload.as_ref()))),
            })
            .collect()
    });
    let order = order.into_inner().unwrap_or_else(|p| p.into_inner());
    first_failure_or_all(outcomes, order)
}

/// Replica `i` of `n`'s overrides: `o` with its place in the DP group and its device.
fn replica_overrides(o: &Overrides, n: usize, i: usize, device: Device) -> Overrides {
    Overrides {
        data_parallel: Some(n),
        replica_device: Some(device),
        rank: Some(i),
        world_size: Some(n),
        local_rank: Some(i),
        local_world_size: Some(n),
        external_collective: true,
        ..o.clone()
    }
}

/// Replica `i`'s thread: its accelerator over collective `c`, then `f`; its failure recorded in
/// `order` before its collective goes (so the replicas that fail because of it come after).
fn run_replica<R, F>(
    o: &Overrides,
    c: Arc<dyn Collective>,
    i: usize,
    order: &Mutex<Vec<usize>>,
    getenv: &(dyn Fn(&str) -> Option<String> + Sync),
    f: &F,
) -> Result<R>
where
    F: Fn(Accelerator) -> Result<R>,
{
    // Declared before the guard, so dropped after it: this replica's failure is recorded before
    // its collective goes and the other replicas fail in turn.
    let keep = c.clone();
    let mut guard = FailureOrder {
        order,
        replica: i,
        armed: true,
    };
    let result = ProcessState::resolve(o, getenv)
        .map(|state| Accelerator::from_parts(state, c))
        .and_then(f);
    guard.armed = result.is_err();
    drop(guard);
    keep.set_run_outcome(result.is_ok());
    drop(keep);
    result
}

/// The replicas' results, or the first failure in `order` (the cause; else, should the order be
/// incomplete, the lowest failed replica).
fn first_failure_or_all<R>(
    outcomes: Vec<std::result::Result<R, ReplicaCause>>,
    order: Vec<usize>,
) -> Result<Vec<R>> {
    let n = outcomes.len();
    let mut outcomes: Vec<Option<_>> = outcomes.into_iter().map(Some).collect();
    let failed = order
        .into_iter()
        .chain(0..n)
        .find(|&i| matches!(outcomes.get(i), Some(Some(Err(_)))));
    if let Some(i) = failed {
        if let Some(Some(Err(cause))) = outcomes.get_mut(i).map(Option::take) {
            return Err(ReplicaFailure {
                replica: i,
                replicas: n,
                cause,
            }
            .into());
        }
    }
    outcomes
        .into_iter()
        .enumerate()
        .map(|(i, r)| match r {
            Some(Ok(r)) => Ok(r),
            _ => Err(Error::ReplicaMissing {
                replica: i,
                replicas: n,
            }),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::settings::place::data_parallel as replicas;
    use std::collections::HashMap;

    fn env_of(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> + Sync {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| map.get(k).cloned()
    }

    /// Overrides with a private empty config file, so a developer's config cannot interfere.
    fn overrides(cfg: &tempfile::NamedTempFile) -> Overrides {
        Overrides {
            config_file: Some(cfg.path().to_path_buf()),
            ..Overrides::default()
        }
    }

    #[test]
    fn replicas_get_their_own_gpus_then_share_and_none_without_gpus() {
        assert_eq!(replica_ordinals(2, 8).unwrap(), vec![0, 1]);
        assert_eq!(replica_ordinals(4, 4).unwrap(), vec![0, 1, 2, 3]);
        // One GPU: every replica on GPU 0 (the thread-group fallback then reduces).
        let shared = replica_ordinals(3, 1).unwrap();
        assert_eq!(shared, vec![0, 0, 0]);
        assert_eq!(
            crate::collective::placement::first_shared(&shared),
            Some((0, 1))
        );
        assert_eq!(replica_ordinals(3, 2).unwrap(), vec![0, 1, 0]);
        assert_eq!(
            crate::collective::placement::first_shared(&replica_ordinals(2, 2).unwrap()),
            None
        );
        let e = replica_ordinals(2, 0).unwrap_err().to_string();
        assert!(e.contains("no GPU is visible"), "{e}");
    }

    #[test]
    fn replicas_come_from_builder_then_env_then_default() {
        let dp3 = env_of(&[(env::DATA_PARALLEL, "3")]);
        assert_eq!(replicas(None, &env_of(&[])).unwrap(), 1);
        assert_eq!(replicas(None, &dp3).unwrap(), 3);
        assert_eq!(replicas(Some(2), &dp3).unwrap(), 2);
        assert_eq!(replicas(Some(1), &dp3).unwrap(), 1);
        assert_eq!(
            replicas(None, &env_of(&[(env::DATA_PARALLEL, " ")])).unwrap(),
            1
        );
        let e = replicas(None, &env_of(&[(env::DATA_PARALLEL, "two")]))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("ACCELERATE_RS_DATA_PARALLEL") && e.contains("two"),
            "{e}"
        );
        let e = replicas(None, &env_of(&[(env::DATA_PARALLEL, "0")]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("ACCELERATE_RS_DATA_PARALLEL"), "{e}");
        assert!(replicas(Some(0), &env_of(&[])).is_err());
    }

    #[test]
    fn run_reads_the_replica_count_from_the_environment() {
        let cfg = tempfile::NamedTempFile::new().unwrap();
        let getenv = env_of(&[(env::DATA_PARALLEL, "3"), (env::USE_CPU, "1")]);
        let out = run(overrides(&cfg), None, &getenv, |acc| {
            Ok((acc.rank(), acc.world_size(), acc.distributed_type()))
        })
        .unwrap();
        assert_eq!(
            out,
            (0..3)
                .map(|r| (r, 3, crate::settings::DistributedType::Dp))
                .collect::<Vec<_>>()
        );
        // The builder beats the environment.
        let o = Overrides {
            data_parallel: Some(1),
            ..overrides(&cfg)
        };
        let out = run(o, None, &getenv, |acc| Ok(acc.distributed_type())).unwrap();
        assert_eq!(out, vec![crate::settings::DistributedType::No]);
    }

    #[test]
    fn env_dp_with_several_processes_is_an_error() {
        let cfg = tempfile::NamedTempFile::new().unwrap();
        let getenv = env_of(&[
            (env::DATA_PARALLEL, "2"),
            (env::RANK, "0"),
            (env::WORLD_SIZE, "2"),
            (env::MASTER_ADDR, "127.0.0.1"),
        ]);
        let e = ProcessState::resolve(&overrides(&cfg), &getenv)
            .unwrap_err()
            .to_string();
        assert!(e.contains("one process") && e.contains("launch -n"), "{e}");
        let e = run(overrides(&cfg), None, &getenv, |_| Ok(()))
            .unwrap_err()
            .to_string();
        assert!(e.contains("one process") && e.contains("launch -n"), "{e}");
    }
}
