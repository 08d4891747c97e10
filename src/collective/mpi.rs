//! Collectives over MPI (the `mpi` feature): for CPU clusters whose jobs start under `mpirun` or
//! `srun --mpi`, where a tuned MPI moves the data over the site's network (InfiniBand, ...).
//!
//! MPI finds the other ranks by itself: no rendezvous address, port or secret. Calls are
//! serialized by a lock (MPI is initialized with `MPI_THREAD_SERIALIZED`), and before every
//! operation the ranks compare what they are about to do (operation, element type, length) with
//! one small all-reduce, so mismatched calls are an [`Error::Mismatch`] rather than a hang or
//! garbage. MPI itself has no timeouts: a rank that dies is handled by the MPI launcher, which
//! ends the job.

use std::sync::{Mutex, MutexGuard};

use mpi::collective::SystemOperation;
use mpi::datatype::PartitionMut;
use mpi::environment::Universe;
use mpi::topology::SimpleCommunicator;
use mpi::traits::*;

use candle_core::Tensor;

use super::{
    check_reducible, check_root, finish_mean, AlignedBytes, Buffer, BufferMut, Collective,
    ElemType, OwnedBuffer, ReduceOp,
};
use crate::error::{Error, Result};

/// Whether this build has MPI (the `mpi` feature).
pub(crate) const BUILT: bool = true;

/// One rank of the MPI world (`MPI_COMM_WORLD`).
pub struct MpiCollective {
    rank: usize,
    world: usize,
    /// Finalizes MPI when the last collective goes (`None` when MPI was initialized elsewhere);
    /// the lock serializes every call.
    universe: Mutex<Option<Universe>>,
}

impl std::fmt::Debug for MpiCollective {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MpiCollective")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .finish()
    }
}

// Operation codes compared across ranks before each call.
const OP_ALL_REDUCE: i64 = 1;
const OP_BROADCAST: i64 = 2;
const OP_ALL_GATHER: i64 = 3;
const OP_BARRIER: i64 = 4;

fn op_name(code: i64) -> &'static str {
    match code {
        OP_ALL_REDUCE => "all_reduce",
        OP_BROADCAST => "broadcast",
        OP_ALL_GATHER => "all_gather",
        OP_BARRIER => "barrier",
        _ => "unknown operation",
    }
}

impl MpiCollective {
    /// Joins the MPI world, initializing MPI if nobody did. The ranks and world size are MPI's;
    /// `expect` (rank, world size), when given, must agree with them (they come from the
    /// launcher's variables).
    pub fn connect(expect: Option<(usize, usize)>) -> Result<Self> {
        let universe = mpi::initialize_with_threading(mpi::Threading::Serialized).map(|(u, _)| u);
        let world = SimpleCommunicator::world();
        let (rank, size) = (world.rank() as usize, world.size() as usize);
        if let Some((r, w)) = expect {
            if (r, w) != (rank, size) {
                return Err(Error::Rendezvous {
                    rank: r,
                    addr: "MPI_COMM_WORLD".into(),
                    reason: format!(
                        "MPI says this is rank {rank} of {size}, the environment says rank {r} of {w}; start every rank with the same launcher"
                    ),
                    source: None,
                });
            }
        }
        Ok(MpiCollective {
            rank,
            world: size,
            universe: Mutex::new(universe),
        })
    }

    fn lock(&self) -> MutexGuard<'_, Option<Universe>> {
        self.universe.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Checks that every rank is about to run the same operation on the same element type and
    /// length (`count` is ignored for all_gather, whose lengths may differ).
    fn agree(&self, comm: &SimpleCommunicator, op: i64, elem: i64, count: i64) -> Result<()> {
        let mine = [op, elem, count, -op, -elem, -count];
        let mut max = [0i64; 6];
        comm.all_reduce_into(&mine[..], &mut max[..], SystemOperation::max());
        if max[0] != -max[3] || max[1] != -max[4] || max[2] != -max[5] {
            let detail = if max[0] != -max[3] {
                format!(
                    "rank {} called {} while another rank called a different operation (codes {}..{})",
                    self.rank,
                    op_name(op),
                    -max[3],
                    max[0]
                )
            } else if max[1] != -max[4] {
                format!(
                    "rank {} called {} with another element type than some rank",
                    self.rank,
                    op_name(op)
                )
            } else {
                format!(
                    "rank {} called {} on {count} elements, other ranks on {}..{}",
                    self.rank,
                    op_name(op),
                    -max[5],
                    max[2]
                )
            };
            return Err(Error::Mismatch {
                rank: self.rank,
                op: op_name(op).into(),
                detail,
            });
        }
        Ok(())
    }
}

fn elem_code(e: ElemType) -> i64 {
    e.code() as i64
}

/// MPI counts are C ints.
fn count_of(n: usize, rank: usize, op: &str) -> Result<i32> {
    i32::try_from(n).map_err(|_| {
        Error::invalid(
            format!("{op} buffer"),
            format!(
                "rank {rank}: {n} elements is more than MPI's limit of {} per call",
                i32::MAX
            ),
        )
    })
}

impl Collective for MpiCollective {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.world
    }
    fn backend(&self) -> &'static str {
        "mpi"
    }

    fn all_reduce(&self, mut buf: BufferMut<'_>, op: ReduceOp) -> Result<()> {
        check_reducible(buf.elem(), op)?;
        if self.world == 1 {
            return Ok(());
        }
        let _guard = self.lock();
        let comm = SimpleCommunicator::world();
        let (elem, n) = (buf.elem(), buf.len());
        count_of(n, self.rank, "all_reduce")?;
        self.agree(
            &comm,
            OP_ALL_REDUCE,
            elem_code(elem) * 8 + op.code() as i64,
            n as i64,
        )?;
        let mpi_op = match op {
            ReduceOp::Max => SystemOperation::max(),
            ReduceOp::Min => SystemOperation::min(),
            ReduceOp::Sum | ReduceOp::Mean => SystemOperation::sum(),
        };
        let bytes = buf.bytes_mut();
        match elem {
            ElemType::F32 => {
                let v: &mut [f32] = bytemuck::cast_slice_mut(bytes);
                let send = v.to_vec();
                comm.all_reduce_into(&send[..], v, mpi_op);
            }
            ElemType::F64 => {
                let v: &mut [f64] = bytemuck::cast_slice_mut(bytes);
                let send = v.to_vec();
                comm.all_reduce_into(&send[..], v, mpi_op);
            }
            ElemType::F16 | ElemType::BF16 => {
                // MPI has no half types: reduce in f32 and round once.
                let wide: Vec<f32> = if elem == ElemType::F16 {
                    bytemuck::cast_slice::<u8, half::f16>(bytes)
                        .iter()
                        .map(|x| x.to_f32())
                        .collect()
                } else {
                    bytemuck::cast_slice::<u8, half::bf16>(bytes)
                        .iter()
                        .map(|x| x.to_f32())
                        .collect()
                };
                let mut out = vec![0f32; wide.len()];
                comm.all_reduce_into(&wide[..], &mut out[..], mpi_op);
                if op == ReduceOp::Mean {
                    let k = self.world as f32;
                    out.iter_mut().for_each(|x| *x /= k);
                }
                if elem == ElemType::F16 {
                    for (d, s) in bytemuck::cast_slice_mut::<u8, half::f16>(bytes)
                        .iter_mut()
                        .zip(&out)
                    {
                        *d = half::f16::from_f32(*s);
                    }
                } else {
                    for (d, s) in bytemuck::cast_slice_mut::<u8, half::bf16>(bytes)
                        .iter_mut()
                        .zip(&out)
                    {
                        *d = half::bf16::from_f32(*s);
                    }
                }
                return Ok(());
            }
            ElemType::U8 => {
                return Err(Error::UnsupportedDType {
                    op: "all_reduce".into(),
                    dtype: "u8".into(),
                })
            }
        }
        if op == ReduceOp::Mean {
            finish_mean(elem, bytes, self.world)?;
        }
        Ok(())
    }

    fn broadcast(&self, mut buf: BufferMut<'_>, root: usize) -> Result<()> {
        check_root(root, self.world, self.rank)?;
        if self.world == 1 {
            return Ok(());
        }
        let _guard = self.lock();
        let comm = SimpleCommunicator::world();
        let (elem, n) = (buf.elem(), buf.len());
        count_of(buf.bytes().len(), self.rank, "broadcast")?;
        self.agree(
            &comm,
            OP_BROADCAST,
            elem_code(elem) * 4096 + root as i64,
            n as i64,
        )?;
        comm.process_at_rank(root as i32)
            .broadcast_into(buf.bytes_mut());
        Ok(())
    }

    fn all_gather(&self, buf: Buffer<'_>) -> Result<Vec<OwnedBuffer>> {
        let elem = buf.elem();
        if self.world == 1 {
            return Ok(vec![OwnedBuffer::new(
                AlignedBytes::copy_from(buf.bytes()),
                elem,
            )]);
        }
        let _guard = self.lock();
        let comm = SimpleCommunicator::world();
        self.agree(&comm, OP_ALL_GATHER, elem_code(elem), 0)?;
        let mine = count_of(buf.bytes().len(), self.rank, "all_gather")?;
        let mut counts = vec![0i32; self.world];
        comm.all_gather_into(&mine, &mut counts[..]);
        let mut displs = Vec::with_capacity(self.world);
        let mut total = 0i64;
        for &c in &counts {
            displs.push(count_of(total as usize, self.rank, "all_gather")?);
            total += i64::from(c);
        }
        count_of(total as usize, self.rank, "all_gather")?;
        let mut all = vec![0u8; total as usize];
        // Nothing to move (MPI refuses the empty receive buffer).
        if total > 0 {
            let mut part = PartitionMut::new(&mut all[..], &counts[..], &displs[..]);
            comm.all_gather_varcount_into(buf.bytes(), &mut part);
        }
        Ok(counts
            .iter()
            .zip(&displs)
            .map(|(&c, &d)| {
                let (d, c) = (d as usize, c as usize);
                OwnedBuffer::new(AlignedBytes::copy_from(&all[d..d + c]), elem)
            })
            .collect())
    }

    fn barrier(&self) -> Result<()> {
        if self.world == 1 {
            return Ok(());
        }
        let _guard = self.lock();
        let comm = SimpleCommunicator::world();
        self.agree(&comm, OP_BARRIER, 0, 0)?;
        comm.barrier();
        Ok(())
    }
    fn reduce_scatter(&self, buf: BufferMut<'_>, op: ReduceOp) -> Result<()> {
        super::fallback::reduce_scatter(self, buf, op)
    }
    fn all_gather_into(&self, buf: BufferMut<'_>) -> Result<()> {
        super::fallback::all_gather_into(self, buf)
    }
    fn reduce_scatter_tensor(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        super::fallback::reduce_scatter_tensor(self, t, op)
    }
    fn all_gather_into_tensor(&self, t: &Tensor) -> Result<Tensor> {
        super::fallback::all_gather_into_tensor(self, t)
    }
    fn check_peers(&self) -> Result<()> {
        Ok(())
    }
    fn set_run_outcome(&self, _finished: bool) {}
    fn add_gate(&self, _gate: std::sync::Weak<dyn super::Gate>) {}
    fn all_reduce_tensor(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        super::fallback::all_reduce_tensor(self, t, op)
    }
    fn all_reduce_tensors(&self, ts: &[Tensor], op: ReduceOp) -> Result<Vec<Tensor>> {
        super::fallback::all_reduce_tensors(self, ts, op)
    }
    fn broadcast_tensor(&self, t: &Tensor, root: usize) -> Result<Tensor> {
        super::fallback::broadcast_tensor(self, t, root)
    }
    fn all_gather_tensor(&self, t: &Tensor) -> Result<Tensor> {
        super::fallback::all_gather_tensor(self, t)
    }
}
