//! The commands of docs/design.md §6, each over the loaded [`Config`].

pub mod check;
pub mod peek;
pub mod replay;
pub mod run;
pub mod slot;
pub mod standby;
pub mod status;

use outbox_event::Lsn;
use publisher::PublisherConfig;
use tokio_postgres::error::SqlState;
use wal_reader::admin::AdminError;
use wal_reader::{PgConnectOptions, ReaderConfig};

use crate::config::Config;
use crate::error::CliError;

/// The parsed `[postgres] url` (a parse error names the key, never the password).
pub fn pg_options(cfg: &Config) -> Result<PgConnectOptions, CliError> {
    PgConnectOptions::parse(cfg.postgres_url_exposed())
        .map_err(|e| CliError::Precondition(e.to_string()))
}

/// What the reader needs, from the configuration.
pub fn reader_config(cfg: &Config, start_lsn: Option<Lsn>) -> Result<ReaderConfig, CliError> {
    Ok(ReaderConfig {
        conn: pg_options(cfg)?,
        slot: cfg.postgres.slot.clone(),
        publication: cfg.postgres.publication.clone(),
        tables: cfg.tables(),
        mapping: cfg.mapping(),
        start_lsn,
        status_interval: cfg.status_interval(),
        hold_events: cfg.rabbitmq.max_in_flight,
    })
}

/// What the publisher needs, from the configuration.
pub fn publisher_config(cfg: &Config) -> PublisherConfig {
    let urls = cfg.expose_amqp_urls();
    let mut p = PublisherConfig::new(
        urls.first().cloned().unwrap_or_default(),
        &cfg.rabbitmq.exchange,
    );
    p.urls = urls;
    p.ca_file = cfg.ca_file().map(|p| p.to_path_buf());
    p.exchange_type = cfg.rabbitmq.exchange_type.as_str().to_string();
    p.declare_exchange = cfg.rabbitmq.declare_exchange;
    p.routing_key = cfg.rabbitmq.routing_key.clone();
    p.max_in_flight = cfg.rabbitmq.max_in_flight;
    p.dead_letter_exchange = cfg.dead_letter_exchange().map(str::to_string);
    p.shutdown_timeout = cfg.shutdown_timeout();
    p.connection_name = format!("outbox-relay {}", cfg.postgres.slot);
    p
}

/// Classifies a failure of an SQL connection or statement: authentication and
/// unknown database are unmet preconditions (exit 2), the rest runtime failures.
pub fn sql_error(e: tokio_postgres::Error) -> CliError {
    // tokio-postgres prints a server error as a bare "db error": use the server's
    // own message.
    let text = match e.as_db_error() {
        Some(db) => db.message().to_string(),
        None => e.to_string(),
    };
    match e.code() {
        Some(c) if *c == SqlState::INVALID_PASSWORD || *c == SqlState::INVALID_AUTHORIZATION_SPECIFICATION => {
            CliError::Precondition(format!(
                "Postgres refused the login ({text}): check the user and password in [postgres] url and the server's pg_hba.conf"
            ))
        }
        Some(c) if *c == SqlState::INVALID_CATALOG_NAME => CliError::Precondition(format!(
            "{text}: fix the database name in [postgres] url"
        )),
        _ => CliError::Runtime(format!("Postgres: {text}")),
    }
}

/// An admin failure: preconditions exit 2, the rest 1.
pub fn admin_error(e: AdminError) -> CliError {
    if e.is_precondition() {
        CliError::Precondition(e.to_string())
    } else {
        CliError::Runtime(e.to_string())
    }
}

/// An ordinary SQL connection to the configured database, under the replication
/// connection's rules (docs/security.md): no cleartext or md5 password over a plain
/// link unless `sslmode=disable` is explicit, and a size cap before login.
pub async fn sql_client(cfg: &Config) -> Result<tokio_postgres::Client, CliError> {
    use wal_reader::tls::SqlConnectError;
    let opts = pg_options(cfg)?;
    let (client, conn) = wal_reader::tls::connect_sql(&opts)
        .await
        .map_err(|e| match e {
            SqlConnectError::Setup(e) => CliError::Precondition(e.to_string()),
            SqlConnectError::Refused(sentence) => CliError::Precondition(sentence),
            SqlConnectError::Connect { .. } => CliError::Runtime(e.to_string()),
            SqlConnectError::Postgres(e) if e.code().is_some() => sql_error(e),
            SqlConnectError::Postgres(e) => CliError::Runtime(format!(
                "cannot connect to Postgres at {}: {}; check host and port in [postgres] url and that Postgres is running",
                opts.display_target(),
                crate::pipeline::describe_pg_error(&e)
            )),
        })?;
    tokio::spawn(async move {
        if let Err(e) = conn.await {
            tracing::debug!(error = %e, "sql connection closed");
        }
    });
    Ok(client)
}
