//! Loading: the defaults, the file, the environment and their precedence.

use super::*;

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
    // A password file the secret files' rule accepts (owner only).
    let secret = std::env::temp_dir().join(format!("every-key-{}", std::process::id()));
    std::fs::write(&secret, "pw\n").unwrap();
    std::fs::set_permissions(&secret, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    let secret = secret.display().to_string();
    for (section, key, kind) in KEYS {
        let dotted = format!("{section}.{key}");
        let Some(value) = env_value(&dotted, kind, &secret) else {
            continue;
        };
        let var = env_var_name(&dotted);
        let c = load_env(&[(var.as_str(), value)]).unwrap_or_else(|e| panic!("{var}={value}: {e}"));
        assert!(
            reaches(&c, &dotted, value),
            "{var}={value} did not change {dotted}"
        );
    }
}

/// The value `every_key_has_a_working_env_var` sets `dotted` to through its variable
/// (`secret`: a password file the secret files' rule accepts); `None` for the keys
/// checked elsewhere.
fn env_value<'a>(dotted: &str, kind: &Kind, secret: &'a str) -> Option<&'a str> {
    let value = match (dotted, kind) {
        ("postgres.url", _) => "postgresql://x@h/db",
        ("postgres.slot", _) => "slot_x",
        ("rabbitmq.exchange_type", _) => "direct",
        ("rabbitmq.ordering", _) => "aggregate",
        // Checked with ordering (more than one channel needs "aggregate"): below.
        ("rabbitmq.channels", _) => return None,
        ("rabbitmq.routing_key", _) => "{table}",
        ("rabbitmq.management_url", _) => "http://h:15672",
        // A pair: checked against each other below.
        ("rabbitmq.management_user" | "rabbitmq.management_password_file", _) => return None,
        ("rabbitmq.allow_insecure_http" | "tracing.allow_insecure_http", _) => "true",
        ("tracing.attributes", _) => "minimal",
        ("rabbitmq.ca_file", _) => "Cargo.toml",
        ("rabbitmq.password_file" | "rabbitmq.stream_password_file", _) => secret,
        // A pair, checked against each other (like the metrics keys below).
        ("rabbitmq.cert_file" | "rabbitmq.key_file", _) => return None,
        ("relay.metrics_listen", _) => "0.0.0.0:1",
        // Those of a pair are checked against each other: set alone, each names
        // the other (checked by the test below).
        ("relay.metrics_basic_auth_user" | "relay.metrics_basic_auth_password_file", _)
        | ("relay.metrics_tls_cert_file" | "relay.metrics_tls_key_file", _) => return None,
        ("relay.replay_window" | "retention.keep" | "rabbitmq.max_age", _) => "5m",
        ("relay.pause_alert_after", _) => "5m",
        ("rabbitmq.request_timeout" | "rabbitmq.stall_after", _) => "5m",
        ("tracing.endpoint", _) => "http://h:4318",
        ("tracing.headers_file", _) => secret,
        ("relay.log_filter", _) => "debug",
        ("relay.metrics_allowed_hosts", _) => "relay, Relay.Example",
        ("rabbitmq.stream_url", _) => "rabbitmq-stream://h",
        ("message.format", _) => "cloudevents",
        ("message.headers", _) => "minimal",
        ("rabbitmq.declare_topology", _) => "true",
        (_, Kind::Bool) => "false",
        (_, Kind::UInt) => "123",
        (_, Kind::Float) => "0.5",
        (_, Kind::UrlList) => "amqp://h",
        (_, Kind::List) => "x.y",
        (_, Kind::Str) => "value_x",
    };
    Some(value)
}

/// Whether `value`, set through the variable of `dotted`, reached that key of `c`.
fn reaches(c: &Config, dotted: &str, value: &str) -> bool {
    let d = Config::default();
    match dotted {
        "postgres.url" => c.postgres_url_exposed() != d.postgres_url_exposed(),
        "postgres.slot" => c.postgres.slot != d.postgres.slot,
        "postgres.publication" => c.postgres.publication != d.postgres.publication,
        "postgres.tables" => c.postgres.tables != d.postgres.tables,
        "postgres.messages" => c.postgres.messages == ["x.y"],
        "mapping.id" => c.mapping.id == value,
        "mapping.aggregate_type" => c.mapping.aggregate_type == value,
        "mapping.aggregate_id" => c.mapping.aggregate_id == value,
        "mapping.event_type" => c.mapping.event_type == value,
        "mapping.payload" => c.mapping.payload == value,
        "mapping.headers" => c.mapping.headers == value,
        "mapping.correlation_id" => c.mapping.correlation_id == value,
        "mapping.exchange" => c.mapping.exchange == value,
        "mapping.expiration" => c.mapping.expiration == value,
        "mapping.priority" => c.mapping.priority == value,
        "mapping.content_type" => c.mapping.content_type == value,
        "mapping.content_encoding" => c.mapping.content_encoding == value,
        "mapping.reply_to" => c.mapping.reply_to == value,
        "rabbitmq.url" => c.expose_amqp_urls() == ["amqp://h"],
        "rabbitmq.exchange" => c.rabbitmq.exchange == value,
        "rabbitmq.exchange_type" => c.rabbitmq.exchange_type == ExchangeType::Direct,
        "rabbitmq.declare_exchange" => !c.rabbitmq.declare_exchange,
        "rabbitmq.declare_topology" => c.rabbitmq.declare_topology,
        "rabbitmq.routing_key" => c.rabbitmq.routing_key == value,
        "rabbitmq.max_in_flight" => c.rabbitmq.max_in_flight == 123,
        "rabbitmq.max_in_flight_bytes" => c.rabbitmq.max_in_flight_bytes == 123,
        "rabbitmq.allowed_exchanges" => c.rabbitmq.allowed_exchanges == ["x.y"],
        "rabbitmq.max_declared_exchanges" => c.rabbitmq.max_declared_exchanges == 123,
        "rabbitmq.request_timeout" => {
            c.publisher_config().request_timeout == Duration::from_secs(300)
        }
        "rabbitmq.stall_after" => c.publisher_config().stall_after == Duration::from_secs(300),
        "rabbitmq.ordering" => c.rabbitmq.ordering == publisher::settings::Ordering::Aggregate,
        "rabbitmq.dead_letter_exchange" => c.dead_letter_exchange() == Some(value),
        "rabbitmq.ca_file" => c.ca_file() == Some(Path::new(value)),
        "rabbitmq.heartbeat_secs" => c.rabbitmq.heartbeat_secs == 123,
        "rabbitmq.stream" => c.stream() == Some(value),
        "rabbitmq.stream_url" => c.stream_urls_redacted() == [value],
        "rabbitmq.declare_stream" => !c.rabbitmq.declare_stream,
        "rabbitmq.max_length_bytes" => c.rabbitmq.max_length_bytes == 123,
        "rabbitmq.max_age" => c.rabbitmq.max_age == Some(Duration::from_secs(300)),
        "rabbitmq.producer_name" => c.producer_name() == Some(value),
        "rabbitmq.stream_filter_value" => c.rabbitmq.stream_filter_value == value,
        "rabbitmq.management_url" => {
            secrecy::ExposeSecret::expose_secret(&c.rabbitmq.management_url) == value
        }
        "message.format" => c.message.format == MessageFormatKind::CloudEvents,
        "message.headers" => c.header_profile() == publisher::message::HeaderProfile::Minimal,
        "message.cloudevents_source" => c.message.cloudevents_source == value,
        "message.cloudevents_type_prefix" => c.message.cloudevents_type_prefix == value,
        "rabbitmq.password_file" => c.publisher_config().auth.password_file == Some(value.into()),
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
        "relay.metrics_allowed_hosts" => {
            c.relay.metrics_allowed_hosts == ["relay", "Relay.Example"]
        }
        "relay.control_token_file" => {
            c.metrics_endpoint().map(|e| e.token_file.path) == Some(value.into())
        }
        "retention.keep" => c.retention_keep() == Some(Duration::from_secs(300)),
        "relay.log_filter" => c.relay.log_filter == value,
        "tracing.endpoint" => c.tracing.endpoint == value,
        "tracing.sampling_ratio" => c.tracing.sampling_ratio == 0.5,
        "tracing.headers_file" => c.tracing.headers_file == value,
        "tracing.max_queue_size" => c.tracing.max_queue_size == 123,
        "tracing.attributes" => c.tracing.attributes == TraceAttributesKind::Minimal,
        "tracing.respect_parent_sampled" => !c.tracing.respect_parent_sampled,
        "tracing.allow_insecure_http" => c.tracing.allow_insecure_http,
        "rabbitmq.allow_insecure_http" => c.rabbitmq.allow_insecure_http,
        "relay.pause_alert_after" => c.relay.pause_alert_after == Some(Duration::from_secs(300)),
        other => panic!("key {other} missing from this test"),
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
    // The management API's own user and password file: the same rule.
    for (set, missing) in [
        (
            "rabbitmq.management_user",
            "rabbitmq.management_password_file",
        ),
        (
            "rabbitmq.management_password_file",
            "rabbitmq.management_user",
        ),
    ] {
        let var = env_var_name(set);
        let e = load_env(&[(var.as_str(), "x")]).unwrap_err().to_string();
        assert!(e.contains(missing), "{set}: {e}");
    }
    let secret = std::env::temp_dir().join(format!("mgmt-pair-{}", std::process::id()));
    std::fs::write(&secret, "pw\n").unwrap();
    std::fs::set_permissions(&secret, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    let c = load_env(&[
        (env_var_name("rabbitmq.management_user").as_str(), "monitor"),
        (
            env_var_name("rabbitmq.management_password_file").as_str(),
            secret.to_str().unwrap(),
        ),
    ])
    .unwrap();
    assert_eq!(c.rabbitmq.management_user, "monitor");
    assert_eq!(
        c.rabbitmq.management_password_file,
        secret.to_str().unwrap()
    );
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

/// `channels` from the environment, with the ordering it needs, reaches the
/// publisher; without it, the refusal names the fix.
#[test]
fn channels_and_ordering_from_the_environment() {
    let ordering = env_var_name("rabbitmq.ordering");
    let channels = env_var_name("rabbitmq.channels");
    let c = load_env(&[(ordering.as_str(), "aggregate"), (channels.as_str(), "4")]).unwrap();
    assert_eq!(c.publisher_config().channels, 4);
    let e = load_env(&[(channels.as_str(), "4")])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("rabbitmq.channels") && e.contains("ordering = \"aggregate\""),
        "{e}"
    );
}

/// A host name with a port or a scheme is refused, naming the key and the fix.
#[test]
fn metrics_allowed_hosts_are_names_alone() {
    for bad in ["relay:9187", "http://relay", "", "a b"] {
        let e = load_env(&[(
            "OUTBOX_RELAY_RELAY_METRICS_ALLOWED_HOSTS",
            &format!("[{bad:?}]"),
        )])
        .map(|_| ())
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("relay.metrics_allowed_hosts") && e.contains("without port or scheme"),
            "{bad}: {e}"
        );
    }
    let c = load_env(&[("OUTBOX_RELAY_RELAY_METRICS_ALLOWED_HOSTS", "*")]).unwrap();
    assert_eq!(c.metrics_endpoint().unwrap().allowed_hosts, ["*"]);
}
