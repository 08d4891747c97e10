//! Checking that a wrapper of a [`Collective`] forwards every method to the collective it wraps.
//!
//! A wrapper (the batch-size search's `ProbedCollective`, a test's counting wrapper, a user's
//! logging one) that runs another method than the wrapped one, say the host path of
//! [`fallback`](super::fallback) instead of the wrapped backend's batched NCCL all-reduce, still
//! computes the right numbers: only the speed (or, for [`Collective::add_gate`] and
//! [`Collective::set_run_outcome`], the backend's behaviour) is lost, and no other test notices.
//! [`check_wrapper`] wraps a recording collective, calls every method of the trait once through
//! the wrapper, and checks that each call reached the same method of the wrapped collective and
//! no other operation.
//!
//! How a method added to the trait is caught: the trait has no default bodies, so the recording
//! collective here (and every wrapper) does not compile until it implements the method; its list
//! [`Method`] is matched exhaustively when calling, and a test compares the list with the
//! trait's methods as written in `collective/base.rs`, so a method cannot be left out of the check.
//!
//! ```
//! use std::sync::Arc;
//! use accelerate_rs::collective::{forwarding, Collective};
//! // A wrapper that is the wrapped collective itself passes.
//! forwarding::check_wrapper("identity", |c: Arc<dyn Collective>| c).unwrap();
//! ```

use std::sync::{Arc, Mutex, Weak};

use candle_core::{Device, Tensor};

use super::{AlignedBytes, Buffer, BufferMut, Collective, Gate, OwnedBuffer, ReduceOp};
use crate::error::{Error, Result};

/// Every method of [`Collective`], in the trait's order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Method {
    /// [`Collective::rank`].
    Rank,
    /// [`Collective::world_size`].
    WorldSize,
    /// [`Collective::backend`].
    Backend,
    /// [`Collective::all_reduce`].
    AllReduce,
    /// [`Collective::broadcast`].
    Broadcast,
    /// [`Collective::all_gather`].
    AllGather,
    /// [`Collective::barrier`].
    Barrier,
    /// [`Collective::reduce_scatter`].
    ReduceScatter,
    /// [`Collective::all_gather_into`].
    AllGatherInto,
    /// [`Collective::reduce_scatter_tensor`].
    ReduceScatterTensor,
    /// [`Collective::all_gather_into_tensor`].
    AllGatherIntoTensor,
    /// [`Collective::check_peers`].
    CheckPeers,
    /// [`Collective::set_run_outcome`].
    SetRunOutcome,
    /// [`Collective::add_gate`].
    AddGate,
    /// [`Collective::all_reduce_tensor`].
    AllReduceTensor,
    /// [`Collective::all_reduce_tensors`].
    AllReduceTensors,
    /// [`Collective::broadcast_tensor`].
    BroadcastTensor,
    /// [`Collective::all_gather_tensor`].
    AllGatherTensor,
}

impl Method {
    /// Every method, in the trait's order.
    pub const ALL: [Method; 18] = [
        Method::Rank,
        Method::WorldSize,
        Method::Backend,
        Method::AllReduce,
        Method::Broadcast,
        Method::AllGather,
        Method::Barrier,
        Method::ReduceScatter,
        Method::AllGatherInto,
        Method::ReduceScatterTensor,
        Method::AllGatherIntoTensor,
        Method::CheckPeers,
        Method::SetRunOutcome,
        Method::AddGate,
        Method::AllReduceTensor,
        Method::AllReduceTensors,
        Method::BroadcastTensor,
        Method::AllGatherTensor,
    ];

    /// The method's name in the trait.
    pub fn name(self) -> &'static str {
        match self {
            Method::Rank => "rank",
            Method::WorldSize => "world_size",
            Method::Backend => "backend",
            Method::AllReduce => "all_reduce",
            Method::Broadcast => "broadcast",
            Method::AllGather => "all_gather",
            Method::Barrier => "barrier",
            Method::ReduceScatter => "reduce_scatter",
            Method::AllGatherInto => "all_gather_into",
            Method::ReduceScatterTensor => "reduce_scatter_tensor",
            Method::AllGatherIntoTensor => "all_gather_into_tensor",
            Method::CheckPeers => "check_peers",
            Method::SetRunOutcome => "set_run_outcome",
            Method::AddGate => "add_gate",
            Method::AllReduceTensor => "all_reduce_tensor",
            Method::AllReduceTensors => "all_reduce_tensors",
            Method::BroadcastTensor => "broadcast_tensor",
            Method::AllGatherTensor => "all_gather_tensor",
        }
    }

    /// The three queries, which a wrapper may call on the wrapped collective at any time (to
    /// name its rank in a message, say).
    fn is_query(self) -> bool {
        matches!(self, Method::Rank | Method::WorldSize | Method::Backend)
    }

    /// Calls this method on `c` once, with small arguments (CPU tensors and buffers of f32).
    fn call(self, c: &dyn Collective) -> Result<()> {
        let mut v = [1.0f32, 2.0, 3.0, 4.0];
        let t = Tensor::new(&v, &Device::Cpu)?;
        match self {
            Method::Rank => drop(c.rank()),
            Method::WorldSize => drop(c.world_size()),
            Method::Backend => drop(c.backend()),
            Method::AllReduce => c.all_reduce(BufferMut::from(&mut v[..]), ReduceOp::Sum)?,
            Method::Broadcast => c.broadcast(BufferMut::from(&mut v[..]), 0)?,
            Method::AllGather => drop(c.all_gather(Buffer::from(&v[..]))?),
            Method::Barrier => c.barrier()?,
            Method::ReduceScatter => {
                c.reduce_scatter(BufferMut::from(&mut v[..]), ReduceOp::Sum)?
            }
            Method::AllGatherInto => c.all_gather_into(BufferMut::from(&mut v[..]))?,
            Method::ReduceScatterTensor => drop(c.reduce_scatter_tensor(&t, ReduceOp::Sum)?),
            Method::AllGatherIntoTensor => drop(c.all_gather_into_tensor(&t)?),
            Method::CheckPeers => c.check_peers()?,
            Method::SetRunOutcome => c.set_run_outcome(true),
            Method::AddGate => c.add_gate(Weak::<OpenGate>::new()),
            Method::AllReduceTensor => drop(c.all_reduce_tensor(&t, ReduceOp::Sum)?),
            Method::AllReduceTensors => drop(c.all_reduce_tensors(&[t.clone(), t], ReduceOp::Sum)?),
            Method::BroadcastTensor => drop(c.broadcast_tensor(&t, 0)?),
            Method::AllGatherTensor => drop(c.all_gather_tensor(&t)?),
        }
        Ok(())
    }
}

/// A gate that lets everything through (only its type is used, for an empty `Weak`).
struct OpenGate;

impl Gate for OpenGate {
    fn pass(&self, _op: &str, _failure: Option<&Error>) -> Result<()> {
        Ok(())
    }
}

/// Rank 0 of a world of 2 that records which of its methods ran and returns plausible results
/// without communicating (so that a wrapper's shortcut for world size 1 is not taken).
#[derive(Debug, Default)]
struct Recorder {
    log: Mutex<Vec<Method>>,
}

impl Recorder {
    fn note(&self, m: Method) {
        self.log.lock().unwrap_or_else(|p| p.into_inner()).push(m);
    }

    fn take(&self) -> Vec<Method> {
        std::mem::take(&mut *self.log.lock().unwrap_or_else(|p| p.into_inner()))
    }
}

impl Collective for Recorder {
    fn rank(&self) -> usize {
        self.note(Method::Rank);
        0
    }
    fn world_size(&self) -> usize {
        self.note(Method::WorldSize);
        2
    }
    fn backend(&self) -> &'static str {
        self.note(Method::Backend);
        "recorder"
    }
    fn all_reduce(&self, _: BufferMut<'_>, _: ReduceOp) -> Result<()> {
        self.note(Method::AllReduce);
        Ok(())
    }
    fn broadcast(&self, _: BufferMut<'_>, _: usize) -> Result<()> {
        self.note(Method::Broadcast);
        Ok(())
    }
    fn all_gather(&self, buf: Buffer<'_>) -> Result<Vec<OwnedBuffer>> {
        self.note(Method::AllGather);
        let copy = || OwnedBuffer::new(AlignedBytes::copy_from(buf.bytes()), buf.elem());
        Ok(vec![copy(), copy()])
    }
    fn barrier(&self) -> Result<()> {
        self.note(Method::Barrier);
        Ok(())
    }
    fn reduce_scatter(&self, _: BufferMut<'_>, _: ReduceOp) -> Result<()> {
        self.note(Method::ReduceScatter);
        Ok(())
    }
    fn all_gather_into(&self, _: BufferMut<'_>) -> Result<()> {
        self.note(Method::AllGatherInto);
        Ok(())
    }
    fn reduce_scatter_tensor(&self, t: &Tensor, _: ReduceOp) -> Result<Tensor> {
        self.note(Method::ReduceScatterTensor);
        Ok(t.flatten_all()?)
    }
    fn all_gather_into_tensor(&self, t: &Tensor) -> Result<Tensor> {
        self.note(Method::AllGatherIntoTensor);
        Ok(t.flatten_all()?)
    }
    fn check_peers(&self) -> Result<()> {
        self.note(Method::CheckPeers);
        Ok(())
    }
    fn set_run_outcome(&self, _: bool) {
        self.note(Method::SetRunOutcome);
    }
    fn add_gate(&self, _: Weak<dyn Gate>) {
        self.note(Method::AddGate);
    }
    fn all_reduce_tensor(&self, t: &Tensor, _: ReduceOp) -> Result<Tensor> {
        self.note(Method::AllReduceTensor);
        Ok(t.clone())
    }
    fn all_reduce_tensors(&self, ts: &[Tensor], _: ReduceOp) -> Result<Vec<Tensor>> {
        self.note(Method::AllReduceTensors);
        Ok(ts.to_vec())
    }
    fn broadcast_tensor(&self, t: &Tensor, _: usize) -> Result<Tensor> {
        self.note(Method::BroadcastTensor);
        Ok(t.clone())
    }
    fn all_gather_tensor(&self, t: &Tensor) -> Result<Tensor> {
        self.note(Method::AllGatherTensor);
        Ok(Tensor::cat(&[t, t], 0)?)
    }
}

/// Checks that the wrapper `wrap` makes of a collective forwards every method of [`Collective`]:
/// for each [`Method`], a fresh recording collective (rank 0 of 2) is wrapped, the method is
/// called once through the wrapper, and the wrapped collective must have seen that method and
/// no other operation (the queries `rank`, `world_size` and `backend` may come along). Returns
/// an error naming the wrapper (`name`), the method and what the wrapped collective saw.
pub fn check_wrapper(
    name: &str,
    wrap: impl Fn(Arc<dyn Collective>) -> Arc<dyn Collective>,
) -> Result<()> {
    let mut wrong = Vec::new();
    for m in Method::ALL {
        let inner = Arc::new(Recorder::default());
        let wrapper = wrap(inner.clone());
        inner.take();
        if let Err(e) = m.call(wrapper.as_ref()) {
            wrong.push(format!("`{}` failed: {e}", m.name()));
            continue;
        }
        let seen: Vec<Method> = inner
            .take()
            .into_iter()
            .filter(|s| *s == m || !s.is_query())
            .collect();
        if seen != [m] {
            let names: Vec<&str> = seen.iter().map(|s| s.name()).collect();
            wrong.push(format!(
                "`{}` reached {names:?} of the wrapped collective instead of its `{}` once",
                m.name(),
                m.name()
            ));
        }
    }
    if wrong.is_empty() {
        return Ok(());
    }
    Err(Error::invalid(
        format!("collective wrapper `{name}`"),
        format!(
            "it does not forward every method (forward each to the wrapped collective's own): {}",
            wrong.join("; ")
        ),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The methods of `pub trait Collective` as written in `base.rs`.
    fn trait_methods() -> Vec<String> {
        let src = include_str!("base.rs");
        let start = src
            .find("pub trait Collective:")
            .expect("base.rs declares the trait");
        let body = &src[start..];
        let end = body.find("\n}\n").expect("the trait ends");
        body[..end]
            .lines()
            .filter_map(|l| l.trim_start().strip_prefix("fn "))
            .map(|l| l.split(['(', '<']).next().unwrap_or("").to_string())
            .collect()
    }

    #[test]
    fn the_list_of_methods_is_the_traits() {
        let written = trait_methods();
        let listed: Vec<String> = Method::ALL.iter().map(|m| m.name().to_string()).collect();
        assert_eq!(
            written, listed,
            "forwarding::Method must list every method of Collective, in order"
        );
    }

    #[test]
    fn the_recorder_itself_passes() {
        check_wrapper("identity", |c| c).unwrap();
    }

    /// Forwards every method but two: `all_reduce_tensors` runs the host fallback (as a default
    /// body once did in `ProbedCollective`), `add_gate` is dropped.
    #[derive(Debug)]
    struct Leaky(Arc<dyn Collective>);

    impl Collective for Leaky {
        fn rank(&self) -> usize {
            self.0.rank()
        }
        fn world_size(&self) -> usize {
            self.0.world_size()
        }
        fn backend(&self) -> &'static str {
            self.0.backend()
        }
        fn all_reduce(&self, buf: BufferMut<'_>, op: ReduceOp) -> Result<()> {
            self.0.all_reduce(buf, op)
        }
        fn broadcast(&self, buf: BufferMut<'_>, root: usize) -> Result<()> {
            self.0.broadcast(buf, root)
        }
        fn all_gather(&self, buf: Buffer<'_>) -> Result<Vec<OwnedBuffer>> {
            self.0.all_gather(buf)
        }
        fn barrier(&self) -> Result<()> {
            self.0.barrier()
        }
        fn reduce_scatter(&self, buf: BufferMut<'_>, op: ReduceOp) -> Result<()> {
            self.0.reduce_scatter(buf, op)
        }
        fn all_gather_into(&self, buf: BufferMut<'_>) -> Result<()> {
            self.0.all_gather_into(buf)
        }
        fn reduce_scatter_tensor(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
            self.0.reduce_scatter_tensor(t, op)
        }
        fn all_gather_into_tensor(&self, t: &Tensor) -> Result<Tensor> {
            self.0.all_gather_into_tensor(t)
        }
        fn check_peers(&self) -> Result<()> {
            self.0.check_peers()
        }
        fn set_run_outcome(&self, finished: bool) {
            self.0.set_run_outcome(finished)
        }
        fn add_gate(&self, _: Weak<dyn Gate>) {}
        fn all_reduce_tensor(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
            self.0.all_reduce_tensor(t, op)
        }
        fn all_reduce_tensors(&self, ts: &[Tensor], op: ReduceOp) -> Result<Vec<Tensor>> {
            super::super::fallback::all_reduce_tensors(self, ts, op)
        }
        fn broadcast_tensor(&self, t: &Tensor, root: usize) -> Result<Tensor> {
            self.0.broadcast_tensor(t, root)
        }
        fn all_gather_tensor(&self, t: &Tensor) -> Result<Tensor> {
            self.0.all_gather_tensor(t)
        }
    }

    #[test]
    fn a_wrapper_that_loses_an_override_is_caught_naming_it() {
        let e = check_wrapper("Leaky", |c| Arc::new(Leaky(c))).unwrap_err();
        let text = e.to_string();
        assert!(text.contains("collective wrapper `Leaky`"), "{text}");
        assert!(
            text.contains(
                "`all_reduce_tensors` reached [\"all_reduce_tensor\", \"all_reduce_tensor\"]"
            ),
            "{text}"
        );
        assert!(text.contains("`add_gate` reached []"), "{text}");
        // Nothing else is blamed.
        assert_eq!(text.matches(" reached ").count(), 2, "{text}");
    }
}
