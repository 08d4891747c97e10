//! [`Transport`]: the data path of multi-process CPU collectives, a setting like any other.

use crate::error::Result;
use crate::settings::env;

/// Which data path [`TcpCollective`](crate::collective::TcpCollective) uses for `all_reduce` and `broadcast`:
/// the `transport` setting (builder, `ACCELERATE_RS_TRANSPORT`, config file key `transport`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Transport {
    /// Shared memory when every rank is on one host, else TCP.
    #[default]
    Auto,
    /// Always TCP.
    Tcp,
    /// Shared memory; an error when the ranks are on several hosts.
    Shm,
    /// Every collective over MPI ([`MpiCollective`](crate::collective::MpiCollective), the
    /// `mpi` feature): for jobs started by `mpirun` / `srun --mpi`. `Auto` picks it by itself
    /// there when the build has MPI.
    Mpi,
}

impl std::str::FromStr for Transport {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        Transport::parse(&s.trim().to_ascii_lowercase())
            .ok_or_else(|| format!("expected `auto`, `tcp`, `shm` or `mpi`, got {s:?}"))
    }
}

impl Transport {
    /// Reads `ACCELERATE_RS_TRANSPORT` (unset or empty = `auto`).
    pub(crate) fn from_env() -> Result<Transport> {
        Ok(super::parse::process_env(env::TRANSPORT)?.unwrap_or_default())
    }

    /// The setting's name: `auto`, `tcp`, `shm` or `mpi`.
    pub fn as_str(self) -> &'static str {
        self.name()
    }

    pub(crate) fn name(self) -> &'static str {
        match self {
            Transport::Auto => "auto",
            Transport::Tcp => "tcp",
            Transport::Shm => "shm",
            Transport::Mpi => "mpi",
        }
    }

    /// The mode named `s` (lowercase), if any.
    pub(crate) fn parse(s: &str) -> Option<Transport> {
        match s {
            "auto" => Some(Transport::Auto),
            "tcp" => Some(Transport::Tcp),
            "shm" => Some(Transport::Shm),
            "mpi" => Some(Transport::Mpi),
            _ => None,
        }
    }
}

impl crate::settings::parse::Setting for Transport {
    fn parse_setting(s: &str) -> std::result::Result<Self, String> {
        s.parse()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_transport_is_a_setting() {
        let getenv = |k: &str| (k == "T").then(|| "SHM".to_string());
        assert_eq!(
            crate::settings::parse::env_value::<Transport>(&getenv, "T").unwrap(),
            Some(Transport::Shm)
        );
    }

    #[test]
    fn transport_values() {
        for (s, m) in [
            ("auto", Transport::Auto),
            ("tcp", Transport::Tcp),
            ("shm", Transport::Shm),
        ] {
            assert_eq!(Transport::parse(s), Some(m));
            assert_eq!(m.name(), s);
        }
        assert_eq!(Transport::parse("ib"), None);
    }
}
