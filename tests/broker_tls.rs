//! The broker over TLS: `amqps://` and `rabbitmq-stream+tls://` against the test
//! broker's TLS listeners (scripts/test-services.sh writes them, signed by a test CA),
//! with `[rabbitmq] ca_file`. A certificate the relay cannot verify is refused with an
//! error that names `ca_file`, and no password appears in any output.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use support::stream::{assert_exactly_once, delete_stream, read_stream, stream_exists};
use support::*;

const WAIT: Duration = Duration::from_secs(60);
const QUIET: Duration = Duration::from_secs(2);

fn service_var(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| {
        panic!("{name} is not set: run scripts/test-services.sh and load target/test-services.env")
    })
}

/// `amqps://` with `ca_file`: every row arrives once, in order; without the CA the
/// connection is refused naming `ca_file`; a wrong password is not echoed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqps_with_the_brokers_ca() {
    let mut env = Env::new().await;
    let url = service_var("OUTBOX_TEST_AMQPS");
    let ca = service_var("OUTBOX_TEST_RABBITMQ_CA");
    env.create_slot();

    let untrusted = vec![("OUTBOX_RELAY_RABBITMQ_URL", url.clone())];
    let out = env.cli_env(&["check"], &as_refs(&untrusted));
    let text = format!("{}{}", stdout(&out), stderr(&out));
    assert!(!out.status.success(), "{text}");
    assert!(text.contains("FAIL  rabbitmq"), "{text}");
    assert!(text.contains("ca_file"), "{text}");

    let wrong = vec![
        (
            "OUTBOX_RELAY_RABBITMQ_URL",
            url.replace("guest:guest@", "guest:not-the-password@"),
        ),
        ("OUTBOX_RELAY_RABBITMQ_CA_FILE", ca.clone()),
    ];
    let out = env.cli_env(&["check"], &as_refs(&wrong));
    let text = format!("{}{}", stdout(&out), stderr(&out));
    assert!(!out.status.success(), "{text}");
    assert!(!text.contains("not-the-password"), "{text}");

    let vars = vec![
        ("OUTBOX_RELAY_RABBITMQ_URL", url.clone()),
        ("OUTBOX_RELAY_RABBITMQ_CA_FILE", ca.clone()),
    ];
    let out = env.cli_env(&["check"], &as_refs(&vars));
    assert!(out.status.success(), "{}{}", stdout(&out), stderr(&out));

    let got = env.consumer().await;
    let relay = env.start_env(&[], &as_refs(&vars));
    let mut next = 1;
    for size in [1usize, 40, 300] {
        env.insert_seq(next, size, size);
        next += size;
    }
    let total = next - 1;
    let msgs = got.wait_for(total, WAIT).await;
    tokio::time::sleep(QUIET).await;
    assert_eq!(check_sequence(&got.snapshot(), total), 0, "{}", msgs.len());
    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    assert!(!log.contains("guest:guest@"), "{log}");
    env.cleanup().await;
}
/// `rabbitmq-stream+tls://` with `ca_file`: the relay verifies the broker's
/// certificate against the test CA and publishes every row over TLS exactly once;
/// without the CA (system roots) `check` fails and says how to fix it, and the
/// password appears nowhere in the output.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_target_over_tls() {
    let env = Env::new().await;
    let tls_url = service_var("OUTBOX_TEST_STREAM_TLS_URL");
    let ca = service_var("OUTBOX_TEST_RABBITMQ_CA");
    let stream = testkit::unique_name("stream_tls");
    env.create_slot();
    let secret_url = tls_url.replace("guest:guest@", "guest:not-the-password@");
    let vars = vec![
        ("OUTBOX_RELAY_RABBITMQ_STREAM", stream.clone()),
        ("OUTBOX_RELAY_RABBITMQ_STREAM_URL", tls_url.clone()),
        ("OUTBOX_RELAY_RABBITMQ_CA_FILE", ca.clone()),
    ];

    // Right credentials, but the broker's certificate is not signed by a trusted
    // root (no ca_file: the system's): the handshake is refused.
    let untrusted = vec![
        ("OUTBOX_RELAY_RABBITMQ_STREAM", stream.clone()),
        ("OUTBOX_RELAY_RABBITMQ_STREAM_URL", tls_url.clone()),
    ];
    let out = env.cli_env(&["check"], &as_refs(&untrusted));
    let text = format!("{}{}", stdout(&out), stderr(&out));
    assert!(!out.status.success(), "{text}");
    assert!(text.contains("FAIL  rabbitmq stream"), "{text}");
    assert!(text.contains("ca_file"), "{text}");
    assert!(!stream_exists(&stream).await, "nothing was declared");

    // The trusted CA and a wrong password: refused, the password not shown.
    let mut wrong = vars.clone();
    wrong[1].1 = secret_url;
    let out = env.cli_env(&["check"], &as_refs(&wrong));
    let text = format!("{}{}", stdout(&out), stderr(&out));
    assert!(!out.status.success(), "{text}");
    assert!(!text.contains("not-the-password"), "{text}");

    let out = env.cli_env(&["check"], &as_refs(&vars));
    assert!(out.status.success(), "{}{}", stdout(&out), stderr(&out));
    assert!(
        stdout(&out).contains("ok    rabbitmq stream: connected"),
        "{}",
        stdout(&out)
    );

    let relay = env.start_env(&[], &as_refs(&vars));
    let mut next = 1;
    for size in [1usize, 40, 300] {
        env.insert_seq(next, size, size);
        next += size;
    }
    let total = (next - 1) as u64;
    let msgs = read_stream(&stream, total as usize, QUIET, WAIT).await;
    assert_eq!(assert_exactly_once(&msgs, total), 0);
    let (code, log) = relay.terminate();
    assert_eq!(code, Some(0), "{log}");
    assert!(!log.contains("guest:guest@"), "{log}");

    delete_stream(&stream).await;
    env.cleanup().await;
}
