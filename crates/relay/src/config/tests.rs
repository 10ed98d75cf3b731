//! Unit tests of loading, overriding, validating and redacting the configuration.

#![allow(clippy::unwrap_used)]

use super::env::{env_var_name, Kind, KEYS};
use super::error::closest;
use super::validate::validate_routing_key;
use super::*;
use std::io::Write as _;
use std::path::Path;

use figment::providers::{Format, Toml};
use figment::Figment;
use wal_reader::TableName;

const NO_ENV: [(&str, &str); 0] = [];

/// A TOML file in a fresh temporary directory, removed on drop.
struct TempToml {
    dir: PathBuf,
    path: PathBuf,
}

impl TempToml {
    fn new(contents: &str) -> TempToml {
        let dir = std::env::temp_dir().join(format!(
            "outbox-relay-config-{}-{}",
            std::process::id(),
            uuid::Uuid::new_v4()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("outbox-relay.toml");
        let mut f = std::fs::File::create(&path).unwrap();
        f.write_all(contents.as_bytes()).unwrap();
        TempToml { dir, path }
    }
}

impl Drop for TempToml {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn load_toml(contents: &str) -> Result<Config, ConfigError> {
    let file = TempToml::new(contents);
    Config::load_with_env(Some(&file.path), NO_ENV)
}

fn load_env(env: &[(&str, &str)]) -> Result<Config, ConfigError> {
    Config::load_with_env(None, env.iter().copied())
}

/// The error must be `Invalid` (or `UnknownKey`) about `key`; returns its message.
fn err_about(result: Result<Config, ConfigError>, key: &str) -> String {
    let e = result.expect_err("the configuration was accepted");
    assert_eq!(e.key(), Some(key), "wrong key in: {e}");
    let msg = e.to_string();
    assert!(msg.contains(&format!("`{key}`")), "key not named in: {msg}");
    msg
}

#[test]
fn defaults_match_the_spec() {
    let c = load_env(&[]).unwrap();
    assert_eq!(c.source, ConfigSource::Defaults);
    assert_eq!(c.postgres_url_exposed(), DEFAULT_POSTGRES_URL);
    assert_eq!(c.postgres.slot, "outbox_relay");
    assert_eq!(c.postgres.publication, "outbox_relay");
    assert_eq!(
        c.tables(),
        vec![TableName {
            schema: "public".into(),
            name: "outbox".into()
        }]
    );
    assert_eq!(c.mapping(), ColumnMapping::default());
    assert_eq!(c.expose_amqp_urls(), vec![DEFAULT_AMQP_URL.to_string()]);
    assert_eq!(c.rabbitmq.exchange, "outbox");
    assert_eq!(c.rabbitmq.exchange_type, ExchangeType::Topic);
    assert!(c.rabbitmq.declare_exchange);
    assert_eq!(c.rabbitmq.routing_key, "{aggregate_type}.{event_type}");
    assert_eq!(c.rabbitmq.max_in_flight, 10_000);
    assert_eq!(c.dead_letter_exchange(), None);
    assert_eq!(c.ca_file(), None);
    assert_eq!(c.rabbitmq.heartbeat_secs, 0);
    assert_eq!(c.status_interval(), Duration::from_secs(1));
    assert_eq!(c.metrics_listen(), Some("127.0.0.1:9187".parse().unwrap()));
    assert_eq!(c.replay_window(), None);
    assert_eq!(c.shutdown_timeout(), Duration::from_secs(30));
    assert_eq!(c.retention_keep(), None);
}

#[test]
fn file_values_are_read() {
    let c = load_toml(
        r#"
        [postgres]
        url = "host=db user=relay dbname=app"
        tables = ["app.outbox", "billing_outbox"]
        [mapping]
        headers = ""
        correlation_id = "trace_id"
        [rabbitmq]
        url = ["amqp://a:1@n1/%2f", "amqp://a:1@n2/%2f"]
        exchange_type = "headers"
        dead_letter_exchange = "dlx"
        heartbeat_secs = 15
        [relay]
        metrics_listen = ""
        replay_window = "1h 30m"
        [retention]
        keep = "7d"
        "#,
    )
    .unwrap();
    assert!(matches!(c.source, ConfigSource::File(_)));
    assert_eq!(c.postgres_url_exposed(), "host=db user=relay dbname=app");
    let tables: Vec<String> = c.tables().iter().map(|t| t.qualified()).collect();
    assert_eq!(tables, ["app.outbox", "public.billing_outbox"]);
    let m = c.mapping();
    assert_eq!(m.headers, None);
    assert_eq!(m.correlation_id.as_deref(), Some("trace_id"));
    assert_eq!(
        c.expose_amqp_urls(),
        [
            "amqp://a:1@n1/%2f?heartbeat=15",
            "amqp://a:1@n2/%2f?heartbeat=15"
        ]
    );
    assert_eq!(c.rabbitmq.exchange_type, ExchangeType::Headers);
    assert_eq!(c.dead_letter_exchange(), Some("dlx"));
    assert_eq!(c.metrics_listen(), None);
    assert_eq!(c.replay_window(), Some(Duration::from_secs(5400)));
    assert_eq!(c.retention_keep(), Some(Duration::from_secs(7 * 86400)));
}

#[test]
fn env_overrides_every_kind() {
    let file = TempToml::new("[rabbitmq]\nmax_in_flight = 5\nexchange = \"from_file\"\n");
    let env = [
        ("OUTBOX_RELAY_POSTGRES_URL", "postgresql://u@h/db"),
        ("OUTBOX_RELAY_POSTGRES_TABLES", "a.one, two ,"),
        ("OUTBOX_RELAY_MAPPING_CORRELATION_ID", "trace"),
        ("OUTBOX_RELAY_RABBITMQ_MAX_IN_FLIGHT", "42"),
        ("OUTBOX_RELAY_RABBITMQ_DECLARE_EXCHANGE", "FALSE"),
        ("OUTBOX_RELAY_RABBITMQ_EXCHANGE_TYPE", "fanout"),
        ("OUTBOX_RELAY_RABBITMQ_URL", "amqps://u:p,w@h/v"),
        ("OUTBOX_RELAY_RELAY_STATUS_INTERVAL_MS", "250"),
        ("OUTBOX_RELAY_RELAY_REPLAY_WINDOW", "2h"),
        ("OUTBOX_RELAY_RETENTION_KEEP", "1d"),
        ("UNRELATED_VARIABLE", "ignored"),
    ];
    let c = Config::load_with_env(Some(&file.path), env).unwrap();
    assert_eq!(c.postgres_url_exposed(), "postgresql://u@h/db");
    assert_eq!(c.postgres.tables, ["a.one", "two"]);
    assert_eq!(c.mapping().correlation_id.as_deref(), Some("trace"));
    assert_eq!(c.rabbitmq.max_in_flight, 42);
    assert_eq!(c.rabbitmq.exchange, "from_file");
    assert!(!c.rabbitmq.declare_exchange);
    assert_eq!(c.rabbitmq.exchange_type, ExchangeType::Fanout);
    // A single URL is never split on commas.
    assert_eq!(c.expose_amqp_urls(), ["amqps://u:p,w@h/v"]);
    assert_eq!(c.status_interval(), Duration::from_millis(250));
    assert_eq!(c.replay_window(), Some(Duration::from_secs(7200)));
    assert_eq!(c.retention_keep(), Some(Duration::from_secs(86400)));
}

#[test]
fn env_lists_take_toml_arrays() {
    let c = load_env(&[
        ("OUTBOX_RELAY_POSTGRES_TABLES", r#"["s.a", "b"]"#),
        (
            "OUTBOX_RELAY_RABBITMQ_URL",
            r#"["amqp://u:p@n1/%2f", "amqp://u:p@n2/%2f"]"#,
        ),
    ])
    .unwrap();
    assert_eq!(c.postgres.tables, ["s.a", "b"]);
    assert_eq!(
        c.expose_amqp_urls(),
        ["amqp://u:p@n1/%2f", "amqp://u:p@n2/%2f"]
    );
}

#[test]
fn env_can_empty_optional_strings() {
    let c = load_env(&[
        ("OUTBOX_RELAY_MAPPING_HEADERS", ""),
        ("OUTBOX_RELAY_RELAY_METRICS_LISTEN", ""),
    ])
    .unwrap();
    assert_eq!(c.mapping().headers, None);
    assert_eq!(c.metrics_listen(), None);
}

/// Every key has a variable, and the variable reaches that key.
#[test]
fn every_key_has_a_working_env_var() {
    for (section, key, kind) in KEYS {
        let dotted = format!("{section}.{key}");
        let value = match (dotted.as_str(), kind) {
            ("postgres.url", _) => "postgresql://x@h/db",
            ("postgres.slot", _) => "slot_x",
            ("rabbitmq.exchange_type", _) => "direct",
            ("rabbitmq.routing_key", _) => "{table}",
            ("rabbitmq.ca_file", _) => "Cargo.toml",
            ("rabbitmq.password_file" | "rabbitmq.stream_password_file", _) => "Cargo.toml",
            // A pair, checked against each other (like the metrics keys below).
            ("rabbitmq.cert_file" | "rabbitmq.key_file", _) => continue,
            ("relay.metrics_listen", _) => "0.0.0.0:1",
            // Those of a pair are checked against each other: set alone, each names
            // the other (checked by the test below).
            ("relay.metrics_basic_auth_user" | "relay.metrics_basic_auth_password_file", _)
            | ("relay.metrics_tls_cert_file" | "relay.metrics_tls_key_file", _) => continue,
            ("relay.replay_window" | "retention.keep" | "rabbitmq.max_age", _) => "5m",
            ("rabbitmq.stream_url", _) => "rabbitmq-stream://h",
            ("message.format", _) => "cloudevents",
            ("message.headers", _) => "minimal",
            (_, Kind::Bool) => "false",
            (_, Kind::UInt) => "123",
            (_, Kind::UrlList) => "amqp://h",
            (_, Kind::List) => "x.y",
            (_, Kind::Str) => "value_x",
        };
        let var = env_var_name(&dotted);
        let c = load_env(&[(var.as_str(), value)]).unwrap_or_else(|e| panic!("{var}={value}: {e}"));
        let d = Config::default();
        let changed = match dotted.as_str() {
            "postgres.url" => c.postgres_url_exposed() != d.postgres_url_exposed(),
            "postgres.slot" => c.postgres.slot != d.postgres.slot,
            "postgres.publication" => c.postgres.publication != d.postgres.publication,
            "postgres.tables" => c.postgres.tables != d.postgres.tables,
            "mapping.id" => c.mapping.id == value,
            "mapping.aggregate_type" => c.mapping.aggregate_type == value,
            "mapping.aggregate_id" => c.mapping.aggregate_id == value,
            "mapping.event_type" => c.mapping.event_type == value,
            "mapping.payload" => c.mapping.payload == value,
            "mapping.headers" => c.mapping.headers == value,
            "mapping.correlation_id" => c.mapping.correlation_id == value,
            "rabbitmq.url" => c.expose_amqp_urls() == ["amqp://h"],
            "rabbitmq.exchange" => c.rabbitmq.exchange == value,
            "rabbitmq.exchange_type" => c.rabbitmq.exchange_type == ExchangeType::Direct,
            "rabbitmq.declare_exchange" => !c.rabbitmq.declare_exchange,
            "rabbitmq.routing_key" => c.rabbitmq.routing_key == value,
            "rabbitmq.max_in_flight" => c.rabbitmq.max_in_flight == 123,
            "rabbitmq.dead_letter_exchange" => c.dead_letter_exchange() == Some(value),
            "rabbitmq.ca_file" => c.ca_file() == Some(Path::new(value)),
            "rabbitmq.heartbeat_secs" => c.rabbitmq.heartbeat_secs == 123,
            "rabbitmq.stream" => c.stream() == Some(value),
            "rabbitmq.stream_url" => c.stream_urls_redacted() == [value],
            "rabbitmq.declare_stream" => !c.rabbitmq.declare_stream,
            "rabbitmq.max_length_bytes" => c.rabbitmq.max_length_bytes == 123,
            "rabbitmq.max_age" => c.rabbitmq.max_age == Some(Duration::from_secs(300)),
            "rabbitmq.producer_name" => c.producer_name() == Some(value),
            "message.format" => c.message.format == MessageFormatKind::CloudEvents,
            "message.headers" => c.header_profile() == publisher::message::HeaderProfile::Minimal,
            "message.cloudevents_source" => c.message.cloudevents_source == value,
            "message.cloudevents_type_prefix" => c.message.cloudevents_type_prefix == value,
            "rabbitmq.password_file" => {
                c.publisher_config().auth.password_file == Some(value.into())
            }
            "rabbitmq.stream_password_file" => {
                c.stream_config().auth.password_file == Some(value.into())
            }
            "relay.status_interval_ms" => c.relay.status_interval_ms == 123,
            "relay.metrics_listen" => c.metrics_listen() == value.parse().ok(),
            "relay.replay_window" => c.replay_window() == Some(Duration::from_secs(300)),
            "relay.shutdown_timeout_ms" => c.relay.shutdown_timeout_ms == 123,
            "relay.metrics_read_timeout_ms" => c.relay.metrics_read_timeout_ms == 123,
            "relay.metrics_max_connections" => c.relay.metrics_max_connections == 123,
            "relay.metrics_bearer_token_file" => c.relay.metrics_bearer_token_file == value,
            "retention.keep" => c.retention_keep() == Some(Duration::from_secs(300)),
            other => panic!("key {other} missing from this test"),
        };
        assert!(changed, "{var}={value} did not change {dotted}");
    }
}

/// The metrics endpoint's keys come in pairs where they must: one without the
/// other names the missing one; both through their variables reach the endpoint.
#[test]
fn metrics_endpoint_pairs_are_set_together() {
    for (set, missing) in [
        (
            "relay.metrics_basic_auth_user",
            "relay.metrics_basic_auth_password_file",
        ),
        (
            "relay.metrics_basic_auth_password_file",
            "relay.metrics_basic_auth_user",
        ),
        ("relay.metrics_tls_cert_file", "relay.metrics_tls_key_file"),
        ("relay.metrics_tls_key_file", "relay.metrics_tls_cert_file"),
    ] {
        let var = env_var_name(set);
        let e = load_env(&[(var.as_str(), "x")]).unwrap_err().to_string();
        assert!(e.contains(missing), "{set}: {e}");
    }
    let c = load_env(&[
        (
            env_var_name("relay.metrics_basic_auth_user").as_str(),
            "prom",
        ),
        (
            env_var_name("relay.metrics_basic_auth_password_file").as_str(),
            "/p",
        ),
        (env_var_name("relay.metrics_tls_cert_file").as_str(), "/c"),
        (env_var_name("relay.metrics_tls_key_file").as_str(), "/k"),
    ])
    .unwrap();
    let e = c.metrics_endpoint().unwrap();
    assert_eq!(e.auth.basic, Some(("prom".into(), "/p".into())));
    assert_eq!(e.tls, Some(("/c".into(), "/k".into())));
    // The broker's client certificate: the same rule, and both reach both targets.
    let e = load_env(&[(env_var_name("rabbitmq.cert_file").as_str(), "Cargo.toml")])
        .unwrap_err()
        .to_string();
    assert!(e.contains("rabbitmq.key_file"), "{e}");
    let c = load_env(&[
        (env_var_name("rabbitmq.cert_file").as_str(), "Cargo.toml"),
        (env_var_name("rabbitmq.key_file").as_str(), "Cargo.toml"),
    ])
    .unwrap();
    assert_eq!(
        c.publisher_config().auth.cert_file,
        Some("Cargo.toml".into())
    );
    assert_eq!(c.stream_config().auth.key_file, Some("Cargo.toml".into()));
}

#[test]
fn unknown_key_in_file_is_named_with_a_suggestion() {
    let file = TempToml::new("[rabbitmq]\nmax_inflight = 5\n");
    let e = Config::load_with_env(Some(&file.path), NO_ENV).unwrap_err();
    assert_eq!(e.key(), Some("rabbitmq.max_inflight"));
    assert_eq!(
        e.to_string(),
        format!(
            "unknown key `rabbitmq.max_inflight` in {}: did you mean `max_in_flight`?",
            file.path.display()
        )
    );
    let msg = err_about(load_toml("[relay]\nfoo_bar_baz = 1\n"), "relay.foo_bar_baz");
    assert!(msg.contains("remove it"), "{msg}");
    let msg = err_about(load_toml("[rabbit]\nurl = \"amqp://h\"\n"), "rabbit");
    assert!(msg.contains("did you mean `rabbitmq`?"), "{msg}");
}

#[test]
fn unknown_env_var_is_named_with_a_suggestion() {
    let e = load_env(&[("OUTBOX_RELAY_RABBITMQ_MAX_INFLIGHT", "5")]).unwrap_err();
    assert_eq!(
        e.to_string(),
        "unknown environment variable OUTBOX_RELAY_RABBITMQ_MAX_INFLIGHT: did you mean `OUTBOX_RELAY_RABBITMQ_MAX_IN_FLIGHT`?"
    );
    for var in [
        "OUTBOX_RELAY_NOPE",
        "OUTBOX_RELAY_POSTGRES",
        "OUTBOX_RELAY_RELAY_",
    ] {
        let e = load_env(&[(var, "x")]).unwrap_err();
        assert!(
            matches!(&e, ConfigError::UnknownEnvVar { var: v, .. } if v == var),
            "{var}: {e}"
        );
    }
}

#[test]
fn missing_explicit_file_is_an_error() {
    let e = Config::load_with_env(Some(Path::new("/nonexistent/relay.toml")), NO_ENV).unwrap_err();
    assert!(matches!(e, ConfigError::FileNotFound { .. }));
    assert!(e.to_string().contains("/nonexistent/relay.toml"), "{e}");
}

#[test]
fn syntax_error_names_the_file_and_position_without_the_line() {
    let file = TempToml::new("[postgres]\nurl = \"postgresql://u:hunter2@h/db\nslot = 1\n");
    let e = Config::load_with_env(Some(&file.path), NO_ENV).unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, ConfigError::Syntax { .. }), "{msg}");
    assert!(msg.contains(&file.path.display().to_string()), "{msg}");
    assert!(msg.contains("line 2"), "{msg}");
    assert!(!msg.contains("hunter2"), "{msg}");
    assert!(!msg.contains('\n'), "{msg}");
}

#[test]
fn wrong_types_name_the_key_and_origin() {
    let msg = err_about(
        load_toml("[rabbitmq]\nmax_in_flight = \"many\"\n"),
        "rabbitmq.max_in_flight",
    );
    assert!(msg.contains("outbox-relay.toml"), "{msg}");
    let msg = err_about(
        load_toml("[rabbitmq]\nexchange_type = \"topik\"\n"),
        "rabbitmq.exchange_type",
    );
    assert!(
        msg.contains("must be one of direct, fanout, topic, headers, not \"topik\""),
        "{msg}"
    );
    err_about(
        load_toml("[rabbitmq]\ndeclare_exchange = \"yes\"\n"),
        "rabbitmq.declare_exchange",
    );
    err_about(
        load_toml("[rabbitmq]\nmax_in_flight = -1\n"),
        "rabbitmq.max_in_flight",
    );
    let msg = err_about(
        load_toml("[postgres]\ntables = [\"a\", 5]\n"),
        "postgres.tables",
    );
    assert!(msg.contains("(item #2 is not), not the number 5"), "{msg}");
    // One string, as the environment variable takes it.
    let c = load_toml("[postgres]\ntables = \"public.outbox, app.events\"\n").unwrap();
    assert_eq!(c.postgres.tables, ["public.outbox", "app.events"]);
    err_about(
        load_toml("[relay]\nstatus_interval_ms = 1.5\n"),
        "relay.status_interval_ms",
    );
    let msg = err_about(
        load_env(&[("OUTBOX_RELAY_RABBITMQ_MAX_IN_FLIGHT", "lots")]),
        "rabbitmq.max_in_flight",
    );
    assert!(msg.contains("OUTBOX_RELAY_RABBITMQ_MAX_IN_FLIGHT"), "{msg}");
    err_about(
        load_env(&[("OUTBOX_RELAY_RABBITMQ_DECLARE_EXCHANGE", "yes")]),
        "rabbitmq.declare_exchange",
    );
    err_about(
        load_env(&[("OUTBOX_RELAY_POSTGRES_TABLES", "[\"unterminated")]),
        "postgres.tables",
    );
}

#[test]
fn invalid_values_name_the_key() {
    let cases: &[(&str, &str, &str)] = &[
        ("postgres.url", "[postgres]\nurl = \"\"", "empty"),
        (
            "postgres.url",
            "[postgres]\nurl = \"mysql://h/db\"",
            "mysql",
        ),
        (
            "postgres.url",
            "[postgres]\nurl = \"just-a-host\"",
            "conninfo",
        ),
        (
            "postgres.slot",
            "[postgres]\nslot = \"Bad-Slot\"",
            "lower-case",
        ),
        ("postgres.slot", "[postgres]\nslot = \"\"", "1 to 63"),
        (
            "postgres.publication",
            "[postgres]\npublication = \"\"",
            "1 to 63",
        ),
        ("postgres.tables", "[postgres]\ntables = []", "empty"),
        (
            "postgres.tables",
            "[postgres]\ntables = [\"a.b.c\"]",
            "a.b.c",
        ),
        ("mapping.payload", "[mapping]\npayload = \"\"", "empty"),
        ("rabbitmq.url", "[rabbitmq]\nurl = []", "empty"),
        ("rabbitmq.url", "[rabbitmq]\nurl = \"http://h\"", "amqp://"),
        (
            "rabbitmq.url",
            "[rabbitmq]\nurl = [\"amqp://h\", \"h2\"]",
            "URL #2",
        ),
        (
            "rabbitmq.url",
            "[rabbitmq]\nurl = \"amqp://a,amqp://b\"",
            "TOML array",
        ),
        (
            "rabbitmq.routing_key",
            "[rabbitmq]\nrouting_key = \"{aggregate}.x\"",
            "`{aggregate}`",
        ),
        (
            "rabbitmq.routing_key",
            "[rabbitmq]\nrouting_key = \"{table\"",
            "closing",
        ),
        (
            "rabbitmq.routing_key",
            "[rabbitmq]\nrouting_key = \"a}\"",
            "matching",
        ),
        (
            "rabbitmq.max_in_flight",
            "[rabbitmq]\nmax_in_flight = 0",
            "at least 1",
        ),
        (
            "rabbitmq.ca_file",
            "[rabbitmq]\nca_file = \"/nonexistent/ca.pem\"",
            "not a file",
        ),
        (
            "rabbitmq.heartbeat_secs",
            "[rabbitmq]\nheartbeat_secs = 70000",
            "65535",
        ),
        (
            "rabbitmq.heartbeat_secs",
            "[rabbitmq]\nheartbeat_secs = 5\nurl = \"amqp://h/?heartbeat=10\"",
            "one place",
        ),
        (
            "rabbitmq.exchange",
            "[rabbitmq]\nexchange = \"\"",
            "cannot be declared",
        ),
        (
            "relay.status_interval_ms",
            "[relay]\nstatus_interval_ms = 99",
            "at least 100",
        ),
        (
            "relay.metrics_listen",
            "[relay]\nmetrics_listen = \"localhost\"",
            "must be an address in quotes like \"127.0.0.1:9187\"",
        ),
        (
            "relay.replay_window",
            "[relay]\nreplay_window = \"an hour\"",
            "must be a duration in quotes like \"1h\", \"30min\" or \"7D\", or \"\" for none, not the string \"an hour\"",
        ),
        (
            "relay.replay_window",
            "[relay]\nreplay_window = \"0s\"",
            "zero",
        ),
        (
            "retention.keep",
            "[retention]\nkeep = \"7 days-ish\"",
            "must be a duration",
        ),
    ];
    for (key, toml, needle) in cases {
        let msg = err_about(load_toml(toml), key);
        assert!(msg.contains(needle), "{toml:?}: {msg:?} lacks {needle:?}");
        assert!(
            msg.contains("outbox-relay.toml"),
            "{toml:?}: origin missing in {msg:?}"
        );
    }
}

#[test]
fn routing_key_placeholder_suggestion() {
    let e = validate_routing_key("{event_typ}").unwrap_err();
    assert!(
        e.to_string().contains("did you mean `{event_type}`?"),
        "{e}"
    );
    validate_routing_key("{aggregate_type}.{aggregate_id}.{event_type}.{table}").unwrap();
    validate_routing_key("static.key").unwrap();
}

#[test]
fn invalid_value_from_env_names_the_variable() {
    let msg = err_about(
        load_env(&[("OUTBOX_RELAY_RELAY_STATUS_INTERVAL_MS", "5")]),
        "relay.status_interval_ms",
    );
    assert!(
        msg.contains("in environment variable OUTBOX_RELAY_RELAY_STATUS_INTERVAL_MS"),
        "{msg}"
    );
    let msg = err_about(
        load_env(&[("OUTBOX_RELAY_RELAY_REPLAY_WINDOW", "soon")]),
        "relay.replay_window",
    );
    assert!(msg.contains("OUTBOX_RELAY_RELAY_REPLAY_WINDOW"), "{msg}");
}

#[test]
fn secrets_are_redacted_in_debug() {
    let c = load_env(&[
        (
            "OUTBOX_RELAY_POSTGRES_URL",
            "postgresql://app:pg-s3cret@db:5432/app",
        ),
        (
            "OUTBOX_RELAY_RABBITMQ_URL",
            r#"["amqp://relay:mq-s3cret@n1/%2f", "amqps://relay:mq-s3cret2@n2/%2f"]"#,
        ),
    ])
    .unwrap();
    let debug = format!("{c:?}");
    assert!(!debug.contains("s3cret"), "{debug}");
    assert!(
        debug.contains("postgresql://app:***@db:5432/app"),
        "{debug}"
    );
    assert!(debug.contains("amqps://relay:***@n2/%2f"), "{debug}");
    assert_eq!(
        c.amqp_urls_redacted(),
        ["amqp://relay:***@n1/%2f", "amqps://relay:***@n2/%2f"]
    );
    let c = load_env(&[(
        "OUTBOX_RELAY_POSTGRES_URL",
        "host=db user=app password='pg s3cret' dbname=app",
    )])
    .unwrap();
    let debug = format!("{c:?}");
    assert!(!debug.contains("s3cret"), "{debug}");
}

#[test]
fn secrets_are_not_quoted_in_errors() {
    // Wrong scheme, bad list entry, wrong type: the URL's password never shows.
    let cases = [
        "[postgres]\nurl = \"mysql://app:s3cret@db/app\"",
        "[rabbitmq]\nurl = \"http://relay:s3cret@h/\"",
        "[rabbitmq]\nurl = [\"amqp://relay:s3cret@h/\", 5]",
        "[rabbitmq]\nurl = { a = \"amqp://relay:s3cret@h/\" }",
        "[postgres]\nurl = \"postgresql://u:s3cret@h/db\"\nslot = \"BAD\"",
    ];
    for toml in cases {
        let e = load_toml(toml).unwrap_err();
        let msg = format!("{e} {e:?}");
        assert!(!msg.contains("s3cret"), "{toml:?}: {msg}");
    }
    let e = load_env(&[(
        "OUTBOX_RELAY_RABBITMQ_URL",
        "[\"amqp://relay:s3cret@h/\", unquoted]",
    )])
    .unwrap_err();
    assert_eq!(e.key(), Some("rabbitmq.url"));
    assert!(!format!("{e} {e:?}").contains("s3cret"), "{e}");
}

#[test]
fn amqp_urls_that_no_parser_reads_as_written_are_refused() {
    for (url, words) in [
        ("amqp://guest:Qx#jz@h/%2f", "percent-encode the password"),
        ("amqp://guest:Qx/jz@h/%2f", "percent-encode the password"),
        ("amqp://guest:Qx?jz@h/%2f", "percent-encode the password"),
        ("amqp://guest:Qx jz@h/%2f", "percent-encode it"),
        ("amqps://guest:Qxjz@[fd00::5]/", "IPv6"),
        ("amqps://[fd00::5]:5671/%2f", "IPv6"),
    ] {
        let e = load_toml(&format!("[rabbitmq]\nurl = \"{url}\"")).unwrap_err();
        assert_eq!(e.key(), Some("rabbitmq.url"), "{url}");
        let msg = format!("{e} {e:?}");
        assert!(msg.contains(words), "{url}: {msg}");
        assert!(!msg.contains("Qx") && !msg.contains("jz"), "{url}: {msg}");
    }
}

#[test]
fn readable_config_files_with_a_password_are_noticed() {
    // warn_if_readable_with_password decides on the redaction of the file's text.
    let with = "[postgres]\nurl = \"postgresql://u:Qxjz@h/db\"";
    assert_ne!(redact_url(with), with);
    let guest = "[rabbitmq]\nurl = \"amqp://guest@h/\"";
    assert_eq!(redact_url(guest), guest);
}

#[test]
fn closest_suggests_only_near_names() {
    assert_eq!(
        closest("max_inflight", &["max_in_flight", "url"]),
        Some("max_in_flight")
    );
    assert_eq!(closest("zzz", &["max_in_flight", "url"]), None);
}

fn example_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../outbox-relay.example.toml")
}

#[test]
fn example_file_loads_and_equals_the_defaults() {
    // The example shows the recommended least-privileged `[postgres] url` (the
    // role of sql/role.sql over verify-full), not the built-in default.
    let example = Config::load_with_env(Some(&example_path()), NO_ENV).unwrap();
    assert!(
        example
            .postgres_url_exposed()
            .starts_with("postgresql://outbox_relay@"),
        "the example must connect as the role of sql/role.sql"
    );
    assert!(example
        .postgres_url_exposed()
        .contains("sslmode=verify-full"));
    let mut c = Config::load_with_env(
        Some(&example_path()),
        [("OUTBOX_RELAY_POSTGRES_URL", DEFAULT_POSTGRES_URL)],
    )
    .unwrap();
    c.given = Default::default();
    assert_eq!(
        format!("{c:?}").replace(&format!("{:?}", c.source), ""),
        format!("{:?}", Config::default()).replace(&format!("{:?}", ConfigSource::Defaults), "")
    );
}

/// The local example works as it is: it names both servers (no refusal of built-in
/// defaults), and no file that exists on a server only (no TLS or secret files).
#[test]
fn local_example_needs_no_server_files() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../outbox-relay.local.toml");
    let c = Config::load_with_env(Some(&path), NO_ENV).unwrap();
    assert!(c.given.postgres_url && c.given.rabbitmq_url);
    assert!(c.require_connection_settings("run", true, true).is_ok());
    assert!(c.warnings().is_empty());
    let pg = c.pg_options().unwrap();
    assert_eq!(
        (pg.user.as_str(), pg.dbname.as_str()),
        ("outbox_relay", "app")
    );
    assert!(pg.sslrootcert.is_none() || !pg.sslrootcert_explicit);
    assert!(c.ca_file().is_none() && c.rabbitmq.cert_file.is_empty());
}

#[test]
fn example_file_shows_every_key() {
    let figment = Figment::from(Toml::file_exact(example_path()));
    for (section, key, _) in KEYS {
        let dotted = format!("{section}.{key}");
        assert!(
            figment.find_value(&dotted).is_ok(),
            "{dotted} missing from the example"
        );
    }
}

#[test]
fn stream_target_defaults_and_keys() {
    let d = Config::default();
    assert_eq!(d.stream(), None);
    assert_eq!(
        d.stream_urls_redacted(),
        ["rabbitmq-stream://guest:***@127.0.0.1:5552/%2f"]
    );
    assert!(d.rabbitmq.declare_stream);
    assert_eq!(d.stream_config().max_length_bytes, None);
    assert_eq!(d.stream_config().max_age, None);

    let c = load_toml(
        "[postgres]\nslot = \"orders_slot\"\n[rabbitmq]\nstream = \"orders\"\nstream_url = [\"rabbitmq-stream://u:s3cret@n1:5552/%2f\", \"rabbitmq-stream+tls://u:s3cret@n2:5551/%2f\"]\nmax_length_bytes = 20000000000\nmax_age = \"7d\"\ndeclare_stream = false\n",
    )
    .unwrap();
    let s = c.stream_config();
    assert_eq!(s.stream, "orders");
    assert_eq!(s.urls.len(), 2);
    assert_eq!(s.urls[1], "rabbitmq-stream+tls://u:s3cret@n2:5551/%2f");
    assert!(!s.declare_stream);
    assert_eq!(s.max_length_bytes, Some(20_000_000_000));
    assert_eq!(s.max_age, Some(Duration::from_secs(7 * 86_400)));
    // The producers' source is set per session, from the server's identity.
    assert_eq!(s.source, None);
    let named =
        load_toml("[rabbitmq]\nstream = \"orders\"\nproducer_name = \"orders-db\"\n").unwrap();
    assert_eq!(named.producer_name(), Some("orders-db"));
    let debug = format!("{c:?}");
    assert!(!debug.contains("s3cret"), "{debug}");
}

#[test]
fn invalid_stream_values_name_the_key() {
    let cases = [
        (
            "[rabbitmq]\nstream = \"s\"\nstream_url = \"amqp://u:s3cret@h/%2f\"",
            "rabbitmq.stream_url",
            "rabbitmq-stream://",
        ),
        (
            "[rabbitmq]\nstream = \"s\"\nstream_url = []",
            "rabbitmq.stream_url",
            "at least one",
        ),
        ("[rabbitmq]\nstream = \"amq.s\"", "rabbitmq.stream", "amq."),
        (
            "[rabbitmq]\nstream = \"s\"\nmax_age = \"soon\"",
            "rabbitmq.max_age",
            "duration",
        ),
    ];
    for (toml, key, fix) in cases {
        let msg = err_about(load_toml(toml), key);
        assert!(msg.contains(fix), "{toml}: {msg}");
        assert!(!msg.contains("s3cret"), "{toml}: {msg}");
    }
}

#[test]
fn message_format_defaults_to_native() {
    let c = Config::default();
    assert_eq!(c.message.format, MessageFormatKind::Native);
    assert_eq!(
        c.message.cloudevents_source,
        "/outbox-relay/{database}/{table}"
    );
    assert_eq!(c.message.cloudevents_type_prefix, "");
    assert_eq!(
        c.message_format(),
        publisher::message::MessageFormat::Native
    );
    assert_eq!(c.publisher_config().format.name(), "native");
    assert_eq!(c.stream_config().format.name(), "native");
}

#[test]
fn cloudevents_format_reaches_both_publishers() {
    use publisher::message::cloudevents::CloudEventsFormat;
    use publisher::message::MessageFormat;
    let c = load_toml(
        "[postgres]\nurl = \"postgresql://u@h/orders\"\n\
         [message]\nformat = \"cloudevents\"\ncloudevents_type_prefix = \"com.example.\"\n",
    )
    .unwrap();
    let expected = MessageFormat::CloudEvents(CloudEventsFormat::with_default_source(
        "orders",
        "com.example.",
    ));
    assert_eq!(c.message_format(), expected);
    assert_eq!(c.publisher_config().format, expected);
    assert_eq!(c.stream_config().format, expected);
    let MessageFormat::CloudEvents(f) = c.message_format() else {
        panic!("not cloudevents");
    };
    assert_eq!(
        f.source_of("public.outbox"),
        "/outbox-relay/orders/public.outbox"
    );

    let c = load_env(&[
        ("OUTBOX_RELAY_POSTGRES_URL", "host=h dbname=app"),
        ("OUTBOX_RELAY_MESSAGE_FORMAT", "cloudevents"),
        ("OUTBOX_RELAY_MESSAGE_CLOUDEVENTS_SOURCE", "urn:app:{table}"),
    ])
    .unwrap();
    let MessageFormat::CloudEvents(f) = c.message_format() else {
        panic!("not cloudevents");
    };
    assert_eq!(f.source_of("s.t"), "urn:app:s.t");
    assert_eq!(f.type_prefix(), "");
}

#[test]
fn unknown_message_format_names_the_valid_values() {
    let file = TempToml::new("[message]\nformat = \"cloud-events\"\n");
    let e = Config::load_with_env(Some(&file.path), NO_ENV).unwrap_err();
    assert_eq!(
        e.to_string(),
        format!(
            "`message.format` in {} must be one of native, cloudevents, not \"cloud-events\"",
            file.path.display()
        )
    );
    let e = load_env(&[("OUTBOX_RELAY_MESSAGE_FORMAT", "CloudEvents")]).unwrap_err();
    assert_eq!(
        e.to_string(),
        "`message.format` in environment variable OUTBOX_RELAY_MESSAGE_FORMAT must be one of native, cloudevents, not \"CloudEvents\""
    );
}

#[test]
fn header_profile_reaches_both_publishers() {
    use publisher::message::HeaderProfile;
    let c = Config::default();
    assert_eq!(c.publisher_config().headers, HeaderProfile::Full);
    assert_eq!(c.stream_config().headers, HeaderProfile::Full);
    let c = load_toml("[message]\nheaders = \"minimal\"\n").unwrap();
    assert_eq!(c.publisher_config().headers, HeaderProfile::Minimal);
    assert_eq!(c.stream_config().headers, HeaderProfile::Minimal);
    let e = load_env(&[("OUTBOX_RELAY_MESSAGE_HEADERS", "lean")]).unwrap_err();
    assert_eq!(
        e.to_string(),
        "`message.headers` in environment variable OUTBOX_RELAY_MESSAGE_HEADERS must be one of full, minimal, not \"lean\""
    );
}

#[test]
fn bad_cloudevents_source_is_refused() {
    for (source, fix) in [
        ("", "set a URI reference"),
        ("/x/{db}", "use only {database} and {table}"),
        ("/x/{table", "fix the template"),
        ("/a b", "percent-encode it"),
    ] {
        let toml = format!("[message]\ncloudevents_source = {source:?}\n");
        let msg = err_about(load_toml(&toml), "message.cloudevents_source");
        assert!(msg.contains(fix), "{source:?}: {msg}");
    }
}
