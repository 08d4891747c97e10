//! Joining the run: the collective of an accelerator that was handed none.

use std::sync::Arc;

use crate::collective::{Collective, NcclCollective, SingleProcess, TcpCollective, TcpOptions};
use crate::error::Result;
use crate::settings::{DistributedType, ProcessState};

/// The collective of a process that was handed none: [`SingleProcess`] alone, NCCL between GPU
/// processes, else TCP (with its shared-memory path on one host).
pub(super) fn connect(state: &ProcessState) -> Result<Arc<dyn Collective>> {
    if state.world_size() == 1 {
        return Ok(Arc::new(SingleProcess));
    }
    if state.secret().is_empty() && state.is_main_process() {
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
    Ok(if state.distributed_type() == DistributedType::Ddp {
        gpu_collective(state, &tcp)?
    } else {
        Arc::new(TcpCollective::connect(&tcp)?)
    })
}

/// DDP on GPUs: NCCL when every rank drives its own GPU; when ranks share one (NCCL refuses
/// that), the host collective itself, which reduces GPU tensors through host memory over shared
/// memory or TCP, after one warning from the main process.
fn gpu_collective(state: &ProcessState, opts: &TcpOptions) -> Result<Arc<dyn Collective>> {
    let host: Arc<dyn Collective> = Arc::new(TcpCollective::connect(opts)?);
    let id = crate::settings::gpu::identity(state.device())?;
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
