//! The one way to open the ordinary SQL connection the admin functions run over:
//! [`crate::tls::connect_sql`]'s rules (TLS per `sslmode`, the guard before login)
//! bounded by [`PgConnectOptions::connect_limit`], with the connection driven by a
//! task of its own.

use tokio_postgres::Client;

use crate::conninfo::PgConnectOptions;
use crate::tls::{connect_sql, SqlConnectError};

/// Opens a SQL connection and spawns the task that drives it (it ends, with a debug
/// line, when the connection closes).
pub async fn connect(opts: &PgConnectOptions) -> Result<Client, SqlConnectError> {
    let (client, conn) = connect_sql(opts).await?;
    tokio::spawn(async move {
        if let Err(e) = conn.await {
            tracing::debug!(error = %e, "sql connection closed");
        }
    });
    Ok(client)
}
