//! `replay --from-lsn | --from-table`: not in this build yet.

use crate::cli::ReplayArgs;
use crate::config::Config;
use crate::error::CliError;

pub async fn replay(_cfg: &Config, args: &ReplayArgs) -> Result<(), CliError> {
    args.source()?;
    Err(CliError::Runtime(
        "`replay` is not yet implemented in this build: re-insert the rows to re-publish them"
            .into(),
    ))
}
