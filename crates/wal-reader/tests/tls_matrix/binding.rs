//! Channel binding, and `allow` retrying with TLS rather than sending a cleartext password.

use super::*;

#[tokio::test]
async fn channel_binding_require_is_enforced() {
    let env = vec![("HOME", "/nonexistent".to_string())];
    let scram = Role::new("outbox_auth_tls", "scram-sha-256");
    // SCRAM-SHA-256-PLUS over TLS: both we and libpq connect.
    for host in ["localhost", "127.0.0.1"] {
        let ci = scram.conninfo(
            host,
            &format!(
                "sslmode=verify-full sslrootcert={} channel_binding=require",
                pg_ca_file()
            ),
        );
        let (v, why) = ours_verdict(&parse(&ci, &env).unwrap()).await;
        assert_eq!(v, Verdict::Tls, "{why}");
        assert_eq!(psql_verdict(&ci, &env), Verdict::Tls);
        // The SQL connection binds too.
        assert_eq!(sql_verdict(&parse(&ci, &env).unwrap()).await, Verdict::Tls);
    }
    // A trust login, or an md5 password, is not channel binding: refused (libpq too).
    let md5 = Role::new("outbox_auth_md5", "md5");
    for ci in [
        format!(
            "host=localhost port={} user=postgres dbname=postgres sslmode=require channel_binding=require",
            pg_port()
        ),
        md5.conninfo("localhost", "sslmode=require channel_binding=require"),
    ] {
        let (v, why) = ours_verdict(&parse(&ci, &env).unwrap()).await;
        assert_eq!(v, Verdict::Refused, "{ci}");
        assert!(why.contains("channel_binding=require"), "{why}");
        assert_eq!(psql_verdict(&ci, &env), Verdict::Refused, "{ci}");
        assert_eq!(sql_verdict(&parse(&ci, &env).unwrap()).await, Verdict::Refused);
    }
    // channel_binding=prefer (the default) over TLS uses the binding when offered.
    let ci = scram.conninfo("localhost", "sslmode=require");
    assert_eq!(
        ours_verdict(&parse(&ci, &env).unwrap()).await.0,
        Verdict::Tls
    );
    // channel_binding=require with sslmode=disable is a configuration error.
    assert!(parse(
        &scram.conninfo("localhost", "sslmode=disable channel_binding=require"),
        &env
    )
    .is_err());
    // gssencmode=require is refused, not ignored.
    let e = parse(&scram.conninfo("localhost", "gssencmode=require"), &env).unwrap_err();
    assert!(e.contains("gssencmode"), "{e}");
}

#[tokio::test]
async fn allow_retries_with_tls_instead_of_sending_a_cleartext_password() {
    let env = vec![("HOME", "/nonexistent".to_string())];
    // pg_hba: outbox_auth_password logs in with a cleartext password. sslmode=allow
    // tries plain first; the relay refuses to send the password there and retries
    // over TLS.
    let role = Role::new("outbox_auth_password", "scram-sha-256");
    let (v, why) =
        ours_verdict(&parse(&role.conninfo("127.0.0.1", "sslmode=allow"), &env).unwrap()).await;
    assert_eq!(v, Verdict::Tls, "{why}");
    // An explicit sslmode=disable sends it (the operator asked for a plain link).
    let (v, why) =
        ours_verdict(&parse(&role.conninfo("127.0.0.1", "sslmode=disable"), &env).unwrap()).await;
    assert_eq!(v, Verdict::Plain, "{why}");
    // md5 likewise.
    let role = Role::new("outbox_auth_md5", "md5");
    let (v, why) =
        ours_verdict(&parse(&role.conninfo("127.0.0.1", "sslmode=allow"), &env).unwrap()).await;
    assert_eq!(v, Verdict::Tls, "{why}");
}
