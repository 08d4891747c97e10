//! Every rank returns the main process's result of a write (a checkpoint, a model folder): one
//! broadcast of whether it succeeded.

use std::path::Path;

use super::Collective;
use crate::error::Result;

/// Makes every rank return the main process's result of a write.
pub(crate) fn agree_on_write(
    c: &dyn Collective,
    op: &str,
    path: &Path,
    result: Result<()>,
) -> Result<()> {
    let mut ok = [if result.is_ok() { 1f32 } else { 0f32 }];
    c.broadcast((&mut ok[..]).into(), 0)?;
    result?;
    if ok[0] != 1.0 {
        return Err(crate::files::write_err(
            path,
            format!("{op} failed on the main process, rank 0 (see its error)"),
            None,
        ));
    }
    Ok(())
}
