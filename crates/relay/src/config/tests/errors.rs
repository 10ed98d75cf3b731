//! Errors: unknown keys, wrong types, invalid values, and secrets kept out of them.

use super::*;

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

/// Invalid values of `invalid_values_name_the_key`: (the key, the file, a part of
/// the message).
const INVALID_VALUES: &[(&str, &str, &str)] = &[
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
        "rabbitmq.stream_filter_value",
        "[rabbitmq]\nstream_filter_value = \"{aggregate_typ}\"",
        "unknown placeholder `{aggregate_typ}`: did you mean `{aggregate_type}`?",
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
        "relay.pause_alert_after",
        "[relay]\npause_alert_after = \"soon\"",
        "must be a duration in quotes like \"1h\", \"30min\" or \"7D\", or \"\" for none, not the string \"soon\"",
    ),
    (
        "relay.pause_alert_after",
        "[relay]\npause_alert_after = 5",
        "must be a duration in quotes like \"1h\"",
    ),
    (
        "retention.keep",
        "[retention]\nkeep = \"7 days-ish\"",
        "must be a duration",
    ),
];

#[test]
fn invalid_values_name_the_key() {
    for (key, toml, needle) in INVALID_VALUES {
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

/// The tracing headers (credentials) never go to a plain http:// endpoint beyond
/// loopback unless `[tracing] allow_insecure_http = true` says so; https://, a
/// loopback collector, or no headers at all are fine.
#[test]
fn tracing_headers_over_plain_http_beyond_loopback_are_refused() {
    let secret = std::env::temp_dir().join(format!("otlp-headers-{}", std::process::id()));
    std::fs::write(&secret, "x-api-key=k\n").unwrap();
    std::fs::set_permissions(&secret, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    let file = secret.to_str().unwrap();
    let with = |endpoint: &str, allow: &str| {
        load_env(&[
            ("OUTBOX_RELAY_TRACING_ENDPOINT", endpoint),
            ("OUTBOX_RELAY_TRACING_HEADERS_FILE", file),
            ("OUTBOX_RELAY_TRACING_ALLOW_INSECURE_HTTP", allow),
        ])
    };
    let msg = err_about(
        with("http://collector.example:4318", "false"),
        "tracing.endpoint",
    );
    assert!(
        msg.contains("collector.example") && msg.contains("allow_insecure_http = true"),
        "{msg}"
    );
    for (endpoint, allow) in [
        ("http://collector.example:4318", "true"),
        ("https://collector.example:4318", "false"),
        ("http://127.0.0.1:4318", "false"),
        ("http://localhost:4318", "false"),
    ] {
        assert!(with(endpoint, allow).is_ok(), "{endpoint} {allow}");
    }
    let no_headers = load_env(&[("OUTBOX_RELAY_TRACING_ENDPOINT", "http://c.example:4318")]);
    assert!(no_headers.is_ok());
    let _ = std::fs::remove_file(&secret);
}
