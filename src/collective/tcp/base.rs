//! The TCP group ([`TcpCollective`]): formed by [`TcpCollective::connect`] (the steps in
//! `startup.rs`), its collectives on the ring or, for `all_reduce`, `broadcast`,
//! `reduce_scatter` and `all_gather_into` between ranks of one host, the shared-memory segment.

use std::sync::{Mutex, MutexGuard};

use candle_core::Tensor;

use super::ring::Ring;
use super::segment;
use super::shm::Shm;
use super::startup::{self, TcpOptions};
use super::store::{self, StoreServer};
use super::wire::op;
use crate::collective::{
    check_reducible, check_root, fallback, Buffer, BufferMut, Collective, Gate, OwnedBuffer,
    ReduceOp, SingleProcess,
};
use crate::error::{Error, Result};

/// A rank of a multi-process group connected in a ring over TCP; `all_reduce` and `broadcast`
/// use shared memory instead when every rank is on the same host (see
/// [`transport`](TcpCollective::transport)).
#[derive(Debug)]
pub struct TcpCollective {
    rank: usize,
    world: usize,
    link: Option<Mutex<Link>>,
    transport: &'static str,
    _store: Option<StoreServer>,
}

/// The connections of a group of more than one rank.
#[derive(Debug)]
struct Link {
    ring: Ring,
    shm: Option<Shm>,
}

impl TcpCollective {
    /// Forms the group: waits (up to `opts.timeout`) until every rank has joined.
    pub fn connect(opts: &TcpOptions) -> Result<Self> {
        // Any step of start-up that runs out of a tiny timeout says the timeout is too short.
        Self::connect_inner(opts).map_err(|e| match e {
            Error::Timeout {
                rank,
                peer,
                op,
                timeout,
            } if store::is_short(timeout) => Error::Rendezvous {
                rank,
                addr: format!("{}:{}", opts.master_addr, opts.master_port),
                reason: format!(
                    "{op}: timed out during start-up waiting for rank {peer}: {}",
                    store::startup_hint(timeout)
                ),
                source: None,
            },
            other => other,
        })
    }

    fn connect_inner(opts: &TcpOptions) -> Result<Self> {
        let (rank, world) = (opts.rank, opts.world_size);
        let mode = startup::check_options(opts)?;
        let master = format!("{}:{}", opts.master_addr, opts.master_port);
        let deadline = crate::settings::limits::deadline_after(opts.timeout);
        let store = match rank {
            0 => Some(startup::host_store(opts, &master)?),
            _ => None,
        };
        if world == 1 {
            return Ok(TcpCollective {
                rank,
                world,
                link: None,
                transport: "tcp",
                _store: store,
            });
        }
        let mut ring = startup::form_ring(opts, &master, deadline)?;
        let shm = segment::setup(&mut ring, mode)?;
        let transport = if shm.is_some() { "shm" } else { "tcp" };
        log::debug!("rank {rank}: all_reduce and broadcast use the {transport} transport");
        Ok(TcpCollective {
            rank,
            world,
            link: Some(Mutex::new(Link { ring, shm })),
            transport,
            _store: store,
        })
    }

    /// The data path of `all_reduce` and `broadcast`: `"shm"` (a shared-memory segment, chosen
    /// when every rank is on this host) or `"tcp"` (the ring; also for a world of one, where
    /// nothing moves). `all_gather` and `barrier` always use the ring. Set
    /// `ACCELERATE_RS_TRANSPORT` to `tcp` or `shm` to force one.
    pub fn transport(&self) -> &'static str {
        self.transport
    }

    fn link(&self) -> Option<MutexGuard<'_, Link>> {
        self.link
            .as_ref()
            .map(|m| m.lock().unwrap_or_else(|p| p.into_inner()))
    }
}

impl Collective for TcpCollective {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.world
    }
    fn backend(&self) -> &'static str {
        "tcp"
    }
    fn all_reduce(&self, mut buf: BufferMut<'_>, rop: ReduceOp) -> Result<()> {
        check_reducible(buf.elem(), rop)?;
        let Some(mut link) = self.link() else {
            return Ok(());
        };
        let Link { ring, shm } = &mut *link;
        match shm {
            Some(shm) => {
                let (elem, count) = (buf.elem(), buf.len());
                let h = ring.header(op::ALL_REDUCE, elem, count, rop.code() as u64);
                ring.run("all_reduce", |ring, deadline| {
                    shm.all_reduce(ring, deadline, h, elem, rop, buf.bytes_mut())
                })
            }
            None => ring.all_reduce(buf, rop),
        }
    }
    fn broadcast(&self, mut buf: BufferMut<'_>, root: usize) -> Result<()> {
        check_root(root, self.world, self.rank)?;
        let Some(mut link) = self.link() else {
            return Ok(());
        };
        let Link { ring, shm } = &mut *link;
        match shm {
            Some(shm) => {
                let (elem, count) = (buf.elem(), buf.len());
                let h = ring.header(op::BROADCAST, elem, count, root as u64);
                ring.run("broadcast", |ring, deadline| {
                    shm.broadcast(ring, deadline, h, elem, root, buf.bytes_mut())
                })
            }
            None => ring.broadcast(buf, root),
        }
    }
    fn reduce_scatter(&self, mut buf: BufferMut<'_>, rop: ReduceOp) -> Result<()> {
        check_reducible(buf.elem(), rop)?;
        let Some(mut link) = self.link() else {
            return Ok(());
        };
        let Link { ring, shm } = &mut *link;
        match shm {
            Some(shm) => {
                let (elem, count) = (buf.elem(), buf.len());
                let h = ring.header(op::REDUCE_SCATTER, elem, count, rop.code() as u64);
                ring.run("reduce_scatter", |ring, deadline| {
                    shm.reduce_scatter(ring, deadline, h, elem, rop, buf.bytes_mut())
                })
            }
            None => ring.reduce_scatter(buf, rop),
        }
    }
    fn all_gather_into(&self, mut buf: BufferMut<'_>) -> Result<()> {
        let Some(mut link) = self.link() else {
            return Ok(());
        };
        let Link { ring, shm } = &mut *link;
        match shm {
            Some(shm) => {
                let (elem, count) = (buf.elem(), buf.len());
                let h = ring.header(op::ALL_GATHER_INTO, elem, count, 0);
                ring.run("all_gather_into", |ring, deadline| {
                    shm.all_gather_into(ring, deadline, h, elem, buf.bytes_mut())
                })
            }
            None => ring.all_gather_into(buf),
        }
    }
    fn all_gather(&self, buf: Buffer<'_>) -> Result<Vec<OwnedBuffer>> {
        match self.link() {
            Some(mut link) => link.ring.all_gather(buf),
            None => SingleProcess.all_gather(buf),
        }
    }
    fn barrier(&self) -> Result<()> {
        match self.link() {
            Some(mut link) => link.ring.barrier(),
            None => Ok(()),
        }
    }
    fn check_peers(&self) -> Result<()> {
        match self.link() {
            Some(link) => {
                link.ring.check_peers()?;
                match &link.shm {
                    Some(shm) => shm.check_abort("check_peers"),
                    None => Ok(()),
                }
            }
            None => Ok(()),
        }
    }
    fn reduce_scatter_tensor(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        fallback::reduce_scatter_tensor(self, t, op)
    }
    fn all_gather_into_tensor(&self, t: &Tensor) -> Result<Tensor> {
        fallback::all_gather_into_tensor(self, t)
    }
    fn set_run_outcome(&self, _finished: bool) {}
    fn add_gate(&self, _gate: std::sync::Weak<dyn Gate>) {}
    fn all_reduce_tensor(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        fallback::all_reduce_tensor(self, t, op)
    }
    fn all_reduce_tensors(&self, ts: &[Tensor], op: ReduceOp) -> Result<Vec<Tensor>> {
        fallback::all_reduce_tensors(self, ts, op)
    }
    fn broadcast_tensor(&self, t: &Tensor, root: usize) -> Result<Tensor> {
        fallback::broadcast_tensor(self, t, root)
    }
    fn all_gather_tensor(&self, t: &Tensor) -> Result<Tensor> {
        fallback::all_gather_tensor(self, t)
    }
}
