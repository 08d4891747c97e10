//! MPI collectives in a build without the `mpi` feature: the same API as `mpi.rs`; the
//! constructor explains that MPI was not built in, so no value of this type can exist.

use super::{Buffer, BufferMut, Collective, OwnedBuffer, ReduceOp};
use crate::error::{Error, Result};

/// Whether this build has MPI (the `mpi` feature).
pub(crate) const BUILT: bool = false;

/// One rank of the MPI world. This build has no MPI: it cannot be constructed.
#[derive(Debug)]
pub struct MpiCollective {
    never: std::convert::Infallible,
}

impl MpiCollective {
    /// Joins the MPI world: always an error in this build.
    pub fn connect(_expect: Option<(usize, usize)>) -> Result<Self> {
        Err(Error::NotAvailable {
            what: "MPI".into(),
            reason: "this accelerate-rs was built without the `mpi` feature: rebuild with \
                     `--features mpi` (needs an MPI implementation such as Debian's \
                     libopenmpi-dev, and libclang), or use transport `auto`/`tcp`/`shm` with \
                     MASTER_ADDR and MASTER_PORT set"
                .into(),
        })
    }
}

uninhabited_collective!(MpiCollective);
