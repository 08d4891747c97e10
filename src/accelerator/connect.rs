//! Joining the run: the collective of an accelerator that was handed none.

use std::sync::Arc;

use crate::collective::{
    Collective, MpiCollective, NcclCollective, SingleProcess, TcpCollective, TcpOptions,
};
use crate::error::{Error, Result};
use crate::settings::{env, DistributedType, ProcessState, Transport};

/// Whether this process's collectives go over MPI: asked for, or `auto` in a process started by
/// an MPI launcher of a build with MPI.
fn wants_mpi(state: &ProcessState) -> bool {
    match state.transport() {
        Transport::Mpi => true,
        Transport::Auto => state.launcher() == "mpi" && crate::collective::mpi::BUILT,
        Transport::Tcp | Transport::Shm => false,
    }
}

/// The collective of a process that was handed none: [`SingleProcess`] alone, NCCL between GPU
/// processes, else TCP (with its shared-memory path on one host).
pub(super) fn connect(state: &ProcessState) -> Result<Arc<dyn Collective>> {
    if state.world_size() == 1 {
        return Ok(Arc::new(SingleProcess));
    }
    let host: Option<Arc<dyn Collective>> = if wants_mpi(state) {
        Some(Arc::new(MpiCollective::connect(Some((
            state.rank(),
            state.world_size(),
        )))?))
    } else {
        None
    };
    if host.is_none() && state.master_addr().is_none() {
        return Err(Error::Env {
            var: env::MASTER_ADDR.into(),
            value: String::new(),
            reason: format!("must be set when the world size is {}: the address of the machine running rank 0 (or start the program with `accelerate-rs launch`, or under `mpirun` with a build that has the `mpi` feature)", state.world_size()),
        });
    }
    if host.is_none() && state.secret().is_empty() && state.is_main_process() {
        log::warn!("ACCELERATE_RS_SECRET is not set: connections between ranks are not authenticated (`accelerate-rs launch` sets it)");
    }
    let tcp = TcpOptions {
        rank: state.rank(),
        world_size: state.world_size(),
        master_addr: state.master_addr().unwrap_or("127.0.0.1").to_string(),
        master_port: state.master_port(),
        secret: state.secret().to_vec(),
        timeout: state.timeout(),
        transport: Some(state.transport()),
    };
    let host = match host {
        Some(mpi) => mpi,
        None => Arc::new(TcpCollective::connect(&tcp)?),
    };
    Ok(if state.distributed_type() == DistributedType::Ddp {
        gpu_collective(state, host)?
    } else {
        host
    })
}

/// DDP on GPUs: NCCL when every rank drives its own GPU; when ranks share one (NCCL refuses
/// that), the host collective itself, which reduces GPU tensors through host memory over shared
/// memory or TCP, after one warning from the main process.
fn gpu_collective(state: &ProcessState, host: Arc<dyn Collective>) -> Result<Arc<dyn Collective>> {
    // NCCL's own rule: one rank per (host, PCI bus id); MIG slices of one GPU share a bus id.
    let id = crate::collective::placement::gpu_key(
        &crate::collective::placement::host_identity(),
        &crate::settings::gpu::pci_bus_id(state.device())?,
    );
    match crate::collective::placement::shared_gpu(host.as_ref(), &id)? {
        Some((a, b)) => {
            if state.is_main_process() {
                eprintln!(
                    "{}",
                    crate::collective::placement::sharing_warning(
                        a,
                        b,
                        "ranks",
                        "shared memory or TCP"
                    )
                );
            }
            Ok(host)
        }
        None => Ok(Arc::new(NcclCollective::over(
            host,
            state.device(),
            state.timeout(),
        )?)),
    }
}
