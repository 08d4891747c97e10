//! The simulated device-memory limit of tests ([`env::TEST_MEMORY_LIMIT`]), read once per
//! process.

use once_cell::sync::OnceCell;

use crate::error::{Error, Result};
use crate::settings::env;
use crate::settings::parse::{process_env, Bytes};

/// The variable's parse, kept: `Err((value, reason))` for a value that does not parse.
static LIMIT: OnceCell<std::result::Result<Option<u64>, (String, String)>> = OnceCell::new();

/// The simulated memory limit in bytes, if [`env::TEST_MEMORY_LIMIT`] is set; an
/// [`Error::Env`] naming the variable and its value if it does not parse (every time asked).
pub(crate) fn injected_memory_limit() -> Result<Option<u64>> {
    let parsed = LIMIT.get_or_init(|| match process_env::<Bytes>(env::TEST_MEMORY_LIMIT) {
        Ok(limit) => Ok(limit.map(|b| b.0)),
        Err(Error::Env { value, reason, .. }) => Err((value, reason)),
        Err(other) => Err((String::new(), other.to_string())),
    });
    parsed.clone().map_err(|(value, reason)| Error::Env {
        var: env::TEST_MEMORY_LIMIT.into(),
        value,
        reason,
    })
}
