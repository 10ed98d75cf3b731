//! `peek [--limit N] [--json]`: not in this build yet.

use crate::cli::PeekArgs;
use crate::config::Config;
use crate::error::CliError;

pub async fn peek(_cfg: &Config, _args: &PeekArgs) -> Result<(), CliError> {
    Err(CliError::Runtime(
        "`peek` is not yet implemented in this build: use `status` for the slot's position".into(),
    ))
}
