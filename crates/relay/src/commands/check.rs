//! `check [--declare]`: every precondition, one line each (`ok`, `warn` or `FAIL`
//! with the fix), in one column layout.
//!
//! `check` changes nothing: it looks the exchange (or the stream) up without
//! declaring it and says what `run` would create ("exchange outbox: missing, run will
//! declare it (declare_exchange = true)"). `check --declare` creates what `run`
//! would create, and the publication as `slot create` would, explicitly.
//!
//! A template of `[rabbitmq] exchange` gets a line, then one per name it renders for
//! the pending events and recent rows ([`per_event`]).
//!
//! `[tracing]` gets one line: off, on, or what `run` would refuse (the checks `run`
//! makes, [`crate::telemetry::exporter`]).
//!
//! `[topology]` gets a line per exchange, queue and binding: present, missing (and
//! whether `run` declares it), or different from the configuration, named by the
//! broker's 406 (see [`probe::probe_topology`]).
//!
//! How long the slot outlives a stopped relay (`max_slot_wal_keep_size` against the
//! WAL rate, Postgres 18's idle timeout) gets a line each ([`wal_safety`]).
//!
//! What RabbitMQ 4 refuses or changes by default in that topology and on the broker
//! gets a `warn` line each, on every broker ([`rabbitmq4`]).

mod per_event;
mod rabbitmq4;
pub(crate) mod routes;
mod wal_safety;

use std::io::Write;

use outbox_event::redact::printable;
use publisher::probe::{self, Presence};
use wal_reader::admin::{self, CheckStatus, Preflight};

use crate::cli::CheckArgs;
use crate::config::Config;
use crate::error::CliError;

/// The status column of a line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Status {
    Ok,
    Warn,
    Fail,
}

/// Prints one line: the status padded to one width, the name, the detail; nothing a
/// server sent reaches the terminal as a control character.
fn line(status: Status, name: &str, detail: &str) {
    let status = match status {
        Status::Ok => "ok",
        Status::Warn => "warn",
        Status::Fail => "FAIL",
    };
    let mut out = std::io::stdout().lock();
    let _ = writeln!(
        out,
        "{}",
        printable(&format!("{status:<6}{name}: {detail}"))
    );
    let _ = out.flush();
}

/// `check`: one line per precondition on stdout, the configuration first. A failure
/// is the error line on stderr with exit code 2; configuration errors never get here
/// (the configuration is loaded before any command runs).
pub async fn execute(config: &Config, args: &CheckArgs) -> Result<(), CliError> {
    line(Status::Ok, "config", &config.source.to_string());
    for warning in config.warnings() {
        line(Status::Warn, "config", &warning);
    }
    if args.routes {
        // Which queues each event shape reaches, rather than the preconditions.
        return routes::execute(config, args.since).await;
    }
    let settings = run_settings(config);
    let pg = postgres(config, args.declare).await;
    let mq = rabbitmq(config, args.declare).await;
    let topology = topology(config, args.declare).await;
    if config.stream().is_none() {
        rabbitmq4::lines(config).await;
    }
    settings.and(pg).and(mq).and(topology)
}

/// What `run` validates of the configuration before it connects, beyond what
/// loading it checks: the replay window's anchor slot name, and `[tracing]` (with
/// the `OTEL_*` variables) as the exporter is built; one line for tracing.
fn run_settings(cfg: &Config) -> Result<(), CliError> {
    let background = crate::background::validate(cfg);
    if let Err(e) = &background {
        line(Status::Fail, "config", &e.to_string());
    }
    let tracing = crate::telemetry::exporter(&cfg.tracing);
    match &tracing {
        Ok(None) => line(
            Status::Ok,
            "tracing",
            "off: no endpoint in [tracing] or OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT, or OTEL_SDK_DISABLED = true (docs/tracing.md)",
        ),
        Ok(Some(_)) => line(
            Status::Ok,
            "tracing",
            &format!(
                "on: a publish span per event over OTLP/HTTP, sampling_ratio {}",
                cfg.tracing.sampling_ratio
            ),
        ),
        Err(e) => line(Status::Fail, "tracing", &e.to_string()),
    }
    background.and(tracing.map(drop))
}

/// Runs the Postgres preconditions, printing one line each. Returns the first
/// failure as an unmet precondition (exit code 2) after printing all of them. With
/// `declare`, a missing publication is created first (as `slot create` does).
async fn postgres(cfg: &Config, declare: bool) -> Result<(), CliError> {
    let client = match crate::sql::connect_for_command(cfg).await {
        Ok(c) => {
            line(Status::Ok, "postgres connection", "logged in");
            superuser_line(&c).await;
            c
        }
        Err(e) => {
            line(Status::Fail, "postgres connection", &e.to_string());
            return Err(e);
        }
    };
    let tables = cfg.tables();
    let publication = &cfg.postgres.publication;
    if declare {
        match admin::ensure_publication(&client, publication, &tables).await {
            Ok(true) => line(
                Status::Ok,
                &format!("publication {publication}"),
                "created (check --declare)",
            ),
            Ok(false) => {}
            // The preflight below says what is wrong, once.
            Err(e) => tracing::debug!(error = %e, "cannot create the publication"),
        }
    }
    let mapping = cfg.mapping();
    let preflight = Preflight {
        slot: &cfg.postgres.slot,
        publication,
        tables: &tables,
        mapping: &mapping,
    };
    let mut first_failure = None;
    for result in preflight.run(&client).await {
        match result.status {
            CheckStatus::Ok(detail) => line(Status::Ok, &result.name, &detail),
            CheckStatus::Warning(e) => line(Status::Warn, &result.name, &e.to_string()),
            CheckStatus::Failed(e) => {
                line(Status::Fail, &result.name, &e.to_string());
                first_failure.get_or_insert(e);
            }
        }
    }
    messages_lines(cfg, &client).await;
    wal_safety::lines(&client).await;
    let retention = crate::retention::check(cfg, &client).await;
    match first_failure {
        Some(e) => Err(e.into()),
        None => retention,
    }
}

/// With `[postgres] messages` set: which prefixes are relayed and that the server's
/// pgoutput sends logical messages (Postgres 14+), and a `warn` line while PUBLIC may
/// still call `pg_logical_emit_message`, that is while any role connected to the
/// database can inject events (docs/messages.md, sql/outbox_messages.sql).
async fn messages_lines(cfg: &Config, client: &tokio_postgres::Client) {
    let prefixes = &cfg.postgres.messages;
    if prefixes.is_empty() {
        return;
    }
    let listed = prefixes
        .iter()
        .map(|p| format!("{p:?}"))
        .collect::<Vec<_>>()
        .join(", ");
    let version = client
        .query_one(
            "SELECT pg_catalog.current_setting('server_version_num'::text)::integer",
            &[],
        )
        .await
        .map(|row| row.get::<_, i32>(0));
    match version {
        Ok(v) if v >= 140_000 => line(
            Status::Ok,
            "logical messages",
            &format!("prefixes {listed} relayed (pgoutput sends messages on this server)"),
        ),
        Ok(v) => line(
            Status::Fail,
            "logical messages",
            &format!("pgoutput sends logical messages from Postgres 14 on, and this server is {v}: upgrade it, or empty [postgres] messages"),
        ),
        Err(e) => line(Status::Warn, "logical messages", &format!("cannot read the server's version: {e}")),
    }
    let open = client
        .query(
            "SELECT p.oid::pg_catalog.regprocedure::text FROM pg_catalog.pg_proc p \
              WHERE p.proname = 'pg_logical_emit_message' \
                AND p.pronamespace = 'pg_catalog'::pg_catalog.regnamespace \
                AND pg_catalog.has_function_privilege('public'::name, p.oid, 'EXECUTE'::text) \
              ORDER BY 1",
            &[],
        )
        .await;
    match open {
        Ok(rows) if rows.is_empty() => line(
            Status::Ok,
            "pg_logical_emit_message",
            "PUBLIC cannot call it: only the roles granted it can emit events",
        ),
        Ok(rows) => {
            let which: Vec<String> = rows.iter().map(|r| r.get(0)).collect();
            line(
                Status::Warn,
                "pg_logical_emit_message",
                &format!(
                    "PUBLIC can still call {}, so any role connected to the database can inject events: run sql/outbox_messages.sql (docs/messages.md)",
                    which.join(", ")
                ),
            );
        }
        Err(e) => line(
            Status::Warn,
            "pg_logical_emit_message",
            &format!("cannot read who may call it: {e}"),
        ),
    }
}

/// A `warn` line when the relay's role is a superuser: it needs only what
/// sql/role.sql grants (docs/security.md, least privilege).
async fn superuser_line(client: &tokio_postgres::Client) {
    let superuser = client
        .query_one(
            "SELECT current_user::text, pg_catalog.current_setting('is_superuser'::text) = 'on'",
            &[],
        )
        .await;
    if let Ok(row) = superuser {
        let (role, is_superuser): (String, bool) = (row.get(0), row.get(1));
        if is_superuser {
            line(
                Status::Warn,
                &format!("postgres role {role}"),
                "is a superuser; run the relay as the least-privileged role of sql/role.sql",
            );
        }
    }
}

/// The broker, as `run` would log in, without creating anything (unless
/// `declare`): the exchange (and the dead-letter exchange), or with
/// `rabbitmq.stream` set the stream and its producer.
async fn rabbitmq(cfg: &Config, declare: bool) -> Result<(), CliError> {
    if cfg.stream().is_some() {
        return stream(cfg, declare).await;
    }
    let exchange = &cfg.rabbitmq.exchange;
    let name = format!("exchange {exchange}");
    let mut publisher_config = cfg.publisher_config();
    let per_event = routes::is_template(cfg);
    if per_event {
        // No one exchange: the names it renders are looked up below.
        publisher_config.exchange = String::new();
    }
    if declare && cfg.rabbitmq.declare_exchange {
        // The topology first when it declares the exchange or the DLX: with its
        // arguments, and before the DLX is checked (`topology` declares it all).
        publisher_config.topology = topology_to_declare(cfg);
        // What `run` does at connect: declares it (durable) when it is missing.
        return match publisher::Publisher::connect(publisher_config).await {
            Ok(p) => {
                line(Status::Ok, "rabbitmq", "logged in");
                p.close().await;
                if per_event {
                    return per_event::lines(cfg).await;
                }
                line(
                    Status::Ok,
                    &name,
                    "exists or was declared (check --declare)",
                );
                Ok(())
            }
            Err(e) => {
                line(Status::Fail, "rabbitmq", &e.to_string());
                Err(e.into())
            }
        };
    }
    if cfg.topology.exchange(exchange).is_some() {
        // Declared with the topology's arguments: compared on its own line.
        publisher_config.declare_exchange = false;
    }
    let found = match probe::probe_exchanges(&publisher_config).await {
        Ok(found) => found,
        Err(e) => {
            line(Status::Fail, "rabbitmq", &e.to_string());
            return Err(e.into());
        }
    };
    line(
        Status::Ok,
        "rabbitmq",
        &format!("logged in at {}", found.node),
    );
    let mut result = Ok(());
    match found.exchange {
        None if per_event => result = per_event::lines(cfg).await,
        None => line(
            Status::Ok,
            "exchange \"\"",
            "the default exchange: routes by queue name",
        ),
        Some(Presence::Exists) => line(Status::Ok, &name, "exists"),
        Some(Presence::Missing) if cfg.rabbitmq.declare_exchange => line(
            Status::Ok,
            &name,
            "missing, run will declare it (declare_exchange = true); `check --declare` declares it now",
        ),
        Some(Presence::Missing) => {
            let fix = format!(
                "missing, and run will not declare it (declare_exchange = false): declare it ({} exchange, durable) or set declare_exchange = true",
                cfg.rabbitmq.exchange_type.as_str()
            );
            line(Status::Fail, &name, &fix);
            result = Err(CliError::Precondition(format!(
                "exchange {exchange} does not exist and declare_exchange = false: declare it, or set [rabbitmq] declare_exchange = true"
            )));
        }
    }
    // A DLX of the topology is reported on the topology's line.
    let dead_letter = found.dead_letter.filter(|_| {
        (cfg.dead_letter_exchange()).is_some_and(|d| cfg.topology.exchange(d).is_none())
    });
    if let (Some(dlx), Some(presence)) = (cfg.dead_letter_exchange(), dead_letter) {
        let name = format!("dead-letter exchange {dlx}");
        if presence == Presence::Exists {
            line(Status::Ok, &name, "exists");
        } else {
            line(
                Status::Fail,
                &name,
                "missing: declare it (the relay never declares it) or fix [rabbitmq] dead_letter_exchange",
            );
            result = result.and(Err(CliError::Precondition(format!(
                "the dead-letter exchange {dlx} does not exist: declare it, or fix [rabbitmq] dead_letter_exchange"
            ))));
        }
    }
    result
}

/// The stream target: the stream (declared only with `declare`), then the producer
/// `run` would publish as, with what the broker stored for it.
async fn stream(cfg: &Config, declare: bool) -> Result<(), CliError> {
    let Some(stream) = cfg.stream() else {
        return Ok(());
    };
    let name = format!("stream {stream}");
    let mut config = cfg.stream_config();
    if !declare || !cfg.rabbitmq.declare_stream {
        config.declare_stream = false;
        match probe::probe_stream(&config).await {
            Ok(Presence::Exists) => {}
            Ok(Presence::Missing) if cfg.rabbitmq.declare_stream => {
                line(Status::Ok, "rabbitmq stream", "logged in");
                line(
                    Status::Ok,
                    &name,
                    "missing, run will declare it (declare_stream = true); `check --declare` declares it now",
                );
                return Ok(());
            }
            Ok(Presence::Missing) => {
                line(Status::Ok, "rabbitmq stream", "logged in");
                line(
                    Status::Fail,
                    &name,
                    "missing, and run will not declare it (declare_stream = false): create it or set declare_stream = true",
                );
                return Err(CliError::Precondition(format!(
                    "stream {stream} does not exist and declare_stream = false: create it, or set [rabbitmq] declare_stream = true"
                )));
            }
            Err(e) => {
                line(Status::Fail, "rabbitmq stream", &e.to_string());
                return Err(e.into());
            }
        }
    }
    config.source = stream_source(cfg).await;
    match publisher::stream::StreamPublisher::connect(config).await {
        Ok(p) => {
            line(Status::Ok, "rabbitmq stream", "logged in");
            let how = if declare && cfg.rabbitmq.declare_stream {
                "exists or was declared (check --declare)"
            } else {
                "exists"
            };
            line(Status::Ok, &name, how);
            if let Some((reference, last)) = p.producer() {
                let stored = if last == 0 {
                    "nothing stored yet".to_string()
                } else {
                    let epoch = reference
                        .rsplit_once("/e")
                        .and_then(|(_, e)| e.parse().ok())
                        .unwrap_or(0);
                    let (lsn, index) = publisher::stream::identity::position_of(last, epoch);
                    format!("last stored publishing id {last}: commit {lsn}, index {index}")
                };
                line(
                    Status::Ok,
                    "rabbitmq stream producer",
                    &format!("{reference} ({stored})"),
                );
            }
            drop(p);
            Ok(())
        }
        Err(e) => {
            line(Status::Fail, "rabbitmq stream", &e.to_string());
            Err(e.into())
        }
    }
}

/// The stream producers' source as `run` derives it (docs/streams.md): the server's
/// identity over a replication connection. `None` (with a `warn` line) when it cannot
/// be read; `check` then connects without naming a producer.
async fn stream_source(cfg: &Config) -> Option<publisher::stream::StreamSource> {
    let opts = cfg.pg_options().ok()?;
    let database = opts.dbname.clone();
    match wal_reader::identify_server(&opts).await {
        Ok((history, wal)) => Some(crate::pipeline::sink::stream_source_of(
            cfg.producer_name(),
            &cfg.postgres.slot,
            &database,
            &history,
            wal,
        )),
        Err(e) => {
            line(
                Status::Warn,
                "rabbitmq stream producer",
                &format!("cannot read the server's identity ({e}); the producer reference is derived from it when the relay runs"),
            );
            None
        }
    }
}

/// `[topology]` to declare with `check --declare` (whatever `declare_topology`
/// says: an operator may declare it once as a user allowed to configure, and run
/// the relay as one that is not); `None` when it is empty.
fn topology_to_declare(
    cfg: &Config,
) -> Option<std::sync::Arc<publisher::settings::TopologyConfig>> {
    (!cfg.topology.is_empty()).then(|| std::sync::Arc::new(cfg.topology.clone()))
}

/// `[topology]`, one line per exchange, queue and binding. Without `declare`,
/// nothing is created: each exchange and queue is present, missing (`run` declares
/// it with `declare_topology = true`, else FAIL) or **different** (FAIL naming the
/// argument the broker's 406 names, and the fix); bindings cannot be looked up over
/// AMQP. With `declare`, everything is declared (idempotently).
async fn topology(cfg: &Config, declare: bool) -> Result<(), CliError> {
    let topology = &cfg.topology;
    if topology.is_empty() {
        return Ok(());
    }
    let config = cfg.publisher_config();
    let bindings = || {
        let exchanges = topology.exchanges.iter().map(|e| (&e.name, &e.bindings));
        let queues = topology.queues.iter().map(|q| (&q.name, &q.bindings));
        exchanges
            .chain(queues)
            .flat_map(|(destination, bindings)| bindings.iter().map(move |b| (destination, b)))
    };
    let binding_name = |destination: &str, b: &publisher::settings::Binding| {
        format!(
            "binding {} -> {destination} ({:?})",
            b.exchange, b.routing_key
        )
    };
    if declare {
        return match probe::declare_topology(&config, topology).await {
            Ok(_) => {
                let done = "exists as configured or was declared (check --declare)";
                for e in &topology.exchanges {
                    line(Status::Ok, &format!("exchange {}", e.name), done);
                }
                for q in &topology.queues {
                    line(Status::Ok, &format!("queue {}", q.name), done);
                }
                for (destination, b) in bindings() {
                    line(
                        Status::Ok,
                        &binding_name(destination, b),
                        "bound (check --declare)",
                    );
                }
                Ok(())
            }
            Err(e) => {
                line(Status::Fail, "topology", &e.to_string());
                Err(e.into())
            }
        };
    }
    let found = match probe::probe_topology(&config, topology).await {
        Ok(found) => found,
        Err(e) => {
            line(Status::Fail, "topology", &e.to_string());
            return Err(e.into());
        }
    };
    let declares = cfg.rabbitmq.declare_topology;
    let mut failures = Vec::new();
    let objects = (found.exchanges.iter().map(|(n, s)| ("exchange", n, s)))
        .chain(found.queues.iter().map(|(n, s)| ("queue", n, s)));
    for (kind, object, state) in objects {
        let name = format!("{kind} {object}");
        match state {
            probe::TopologyState::Present => line(Status::Ok, &name, "exists as configured"),
            probe::TopologyState::Missing if declares => line(
                Status::Ok,
                &name,
                "missing, run will declare it (declare_topology = true); `check --declare` declares it now",
            ),
            probe::TopologyState::Missing => {
                line(
                    Status::Fail,
                    &name,
                    "missing, and run will not declare it (declare_topology = false): declare it (`check --declare` does), or set [rabbitmq] declare_topology = true",
                );
                failures.push(format!("{name} does not exist"));
            }
            probe::TopologyState::Different {
                argument,
                text,
                fix,
            } => {
                let which = match argument {
                    Some(arg) => format!("differs from the configuration in {arg}"),
                    None => "differs from the configuration".to_string(),
                };
                line(
                    Status::Fail,
                    &name,
                    &format!("{which} (the broker: {text}); {fix}"),
                );
                failures.push(format!("{name} {which}"));
            }
            probe::TopologyState::NotCompared { reason } => line(
                Status::Warn,
                &name,
                &format!("exists; not compared with the configuration: {reason}"),
            ),
        }
    }
    for (destination, b) in bindings() {
        let how = if declares {
            "not looked up (AMQP cannot); run binds it (declare_topology = true)"
        } else {
            "not looked up (AMQP cannot), and run will not bind it (declare_topology = false): `check --declare` binds it"
        };
        line(Status::Ok, &binding_name(destination, b), how);
    }
    if failures.is_empty() {
        Ok(())
    } else {
        Err(CliError::Precondition(format!(
            "[topology] does not match the broker: {}",
            failures.join("; ")
        )))
    }
}
