//! `check`: every precondition, one line each (`ok`, `warn` or `FAIL` with the fix).

use std::io::Write;

use wal_reader::admin::{CheckStatus, Preflight};

use crate::config::Config;
use crate::error::CliError;

/// `check`: one line per precondition on stdout, the configuration first. A failure
/// is the error line on stderr with exit code 2; configuration errors never get here
/// (the configuration is loaded before any command runs).
pub async fn execute(config: &Config) -> Result<(), CliError> {
    let mut out = std::io::stdout().lock();
    let write_err = |e: std::io::Error| CliError::Runtime(format!("cannot write to stdout: {e}"));
    writeln!(out, "ok   config: {}", config.source).map_err(write_err)?;
    out.flush().map_err(write_err)?;
    drop(out);
    environment(config).await
}

/// Runs the Postgres preconditions, printing one line each. Returns the first
/// failure as an unmet precondition (exit code 2) after printing all of them.
pub async fn postgres(cfg: &Config) -> Result<(), CliError> {
    let client = match crate::sql::connect_for_command(cfg).await {
        Ok(c) => {
            println!("ok    postgres connection: logged in");
            superuser_line(&c).await;
            c
        }
        Err(e) => {
            println!("FAIL  postgres connection: {e}");
            return Err(e);
        }
    };
    let tables = cfg.tables();
    let mapping = cfg.mapping();
    let preflight = Preflight {
        slot: &cfg.postgres.slot,
        publication: &cfg.postgres.publication,
        tables: &tables,
        mapping: &mapping,
    };
    let mut first_failure = None;
    for result in preflight.run(&client).await {
        println!("{result}");
        if let CheckStatus::Failed(e) = result.status {
            first_failure.get_or_insert(e);
        }
    }
    let retention = crate::retention::check(cfg, &client).await;
    match first_failure {
        Some(e) => Err(e.into()),
        None => retention,
    }
}

/// A `warn` line when the relay's role is a superuser: it needs only what
/// sql/role.sql grants (docs/security.md, least privilege).
async fn superuser_line(client: &tokio_postgres::Client) {
    let superuser = client
        .query_one(
            "SELECT current_user::text, current_setting('is_superuser') = 'on'",
            &[],
        )
        .await;
    if let Ok(row) = superuser {
        let (role, is_superuser): (String, bool) = (row.get(0), row.get(1));
        if is_superuser {
            println!(
                "warn  postgres role {role}: is a superuser; run the relay as the least-privileged role of sql/role.sql"
            );
        }
    }
}

/// Connects to the broker as `run` would (declaring the exchange when
/// `declare_exchange` is on, or with `rabbitmq.stream` set, over the stream protocol,
/// declaring the stream when `declare_stream` is on) and prints one line.
pub async fn rabbitmq(cfg: &Config) -> Result<(), CliError> {
    if let Some(stream) = cfg.stream() {
        return match publisher::stream::StreamPublisher::connect(cfg.stream_config()).await {
            Ok(p) => {
                let how = if cfg.rabbitmq.declare_stream {
                    "exists or was declared"
                } else {
                    "exists"
                };
                println!("ok    rabbitmq stream: connected; stream {stream} {how}");
                drop(p);
                Ok(())
            }
            Err(e) => {
                println!("FAIL  rabbitmq stream: {e}");
                Err(e.into())
            }
        };
    }
    match publisher::Publisher::connect(cfg.publisher_config()).await {
        Ok(p) => {
            println!(
                "ok    rabbitmq: connected; exchange {} is usable",
                cfg.rabbitmq.exchange
            );
            drop(p);
            Ok(())
        }
        Err(e) => {
            println!("FAIL  rabbitmq: {e}");
            Err(e.into())
        }
    }
}

/// The database and broker preconditions (wal_level, slot, publication, tables and
/// mapped columns, authentication, broker reachable): Postgres, then the broker.
/// Both are run so one `check` lists every problem; the first failure decides the
/// exit code.
pub async fn environment(cfg: &Config) -> Result<(), CliError> {
    let pg = postgres(cfg).await;
    let mq = rabbitmq(cfg).await;
    pg.and(mq)
}
