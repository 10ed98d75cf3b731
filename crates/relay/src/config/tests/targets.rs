//! The stream target and the message shape reach the publishers.

use super::*;

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
    // No filter values unless asked (docs/streams.md, "Filter values").
    assert_eq!(s.filter_value, None);
    let f =
        load_toml("[rabbitmq]\nstream = \"orders\"\nstream_filter_value = \"{aggregate_type}\"\n")
            .unwrap();
    assert_eq!(
        f.stream_config().filter_value,
        Some(publisher::message::RoutingKeyTemplate::parse("{aggregate_type}").unwrap())
    );
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
