//! Every sslmode × root certificate × host name against libpq, and sslrootcert=system.

use super::*;

#[tokio::test]
async fn sslmode_matrix_matches_libpq() {
    let dirs = Dirs::new();
    let mut table = Vec::new();
    let mut failures = Vec::new();
    for mode in [
        "disable",
        "allow",
        "prefer",
        "require",
        "verify-ca",
        "verify-full",
    ] {
        for root in [
            Root::None,
            Root::RightParam,
            Root::RightEnv,
            Root::RightHome,
            Root::OtherParam,
            Root::OtherHome,
        ] {
            for host in [Host::Localhost, Host::Loopback, Host::Mismatch] {
                let (extra, env) = dirs.setup(root);
                let conninfo = format!(
                    "{} port={} user=postgres dbname=postgres sslmode={mode}{extra}",
                    host_part(host),
                    pg_port()
                );
                let libpq = psql_verdict(&conninfo, &env);
                let (ours, why) = match parse(&conninfo, &env) {
                    Ok(o) => ours_verdict(&o).await,
                    Err(e) => (Verdict::Refused, e),
                };
                let sql = match parse(&conninfo, &env) {
                    Ok(o) => sql_verdict(&o).await,
                    Err(_) => Verdict::Refused,
                };
                let want_libpq = libpq_expected(mode, root, host);
                let want = ours_expected(mode, root, host);
                // tokio-postgres has no `allow`: the SQL connection treats it as
                // prefer (TLS first), so it refuses an unverifiable certificate.
                let want_sql = match (mode, want) {
                    ("allow", _) => ours_expected("prefer", root, host),
                    (_, w) => w,
                };
                let line = format!(
                    "{mode:<11} {root:<10?} {host:<9?} libpq={libpq:?} ours={ours:?} sql={sql:?} {why}"
                );
                if libpq != want_libpq || ours != want || sql != want_sql {
                    failures.push(format!(
                        "{line}\n    expected libpq={want_libpq:?} ours={want:?} sql={want_sql:?}"
                    ));
                }
                table.push(line);
            }
        }
    }
    eprintln!("{}", table.join("\n"));
    assert!(failures.is_empty(), "\n{}", failures.join("\n"));
}

#[tokio::test]
async fn sslrootcert_system_only_with_verify_full_and_errors_name_the_fix() {
    let env = vec![("HOME", "/nonexistent".to_string())];
    for mode in ["disable", "allow", "prefer", "require", "verify-ca"] {
        let ci = format!(
            "host=localhost port={} user=postgres dbname=postgres sslmode={mode} sslrootcert=system",
            pg_port()
        );
        let e = parse(&ci, &env).unwrap_err();
        assert!(e.contains("verify-full"), "{e}");
        // (libpq 16 refuses the same; the installed libpq 15 predates
        // sslrootcert=system and reads a file named "system", so no psql comparison.)
    }
    // With verify-full the system roots are used: they did not sign the test CA.
    let ci = format!(
        "host=localhost port={} user=postgres dbname=postgres sslrootcert=system",
        pg_port()
    );
    let o = parse(&ci, &env).unwrap();
    assert_eq!(o.sslmode, wal_reader::SslMode::VerifyFull);
    let (v, why) = ours_verdict(&o).await;
    assert_eq!(v, Verdict::Refused, "{why}");
    assert!(why.contains("TLS handshake"), "{why}");

    // No root certificate for verify-ca: the error says how to give one.
    let ci = format!(
        "host=localhost port={} user=postgres dbname=postgres sslmode=verify-ca",
        pg_port()
    );
    let (v, why) = ours_verdict(&parse(&ci, &env).unwrap()).await;
    assert_eq!(v, Verdict::Refused);
    assert!(why.contains("sslrootcert"), "{why}");
    // An explicitly given root certificate that cannot be read is an error even with
    // require (libpq would silently skip verification: stricter, docs/security.md).
    let ci = format!(
        "host=localhost port={} user=postgres dbname=postgres sslmode=require sslrootcert=/nonexistent/ca.pem",
        pg_port()
    );
    let (v, why) = ours_verdict(&parse(&ci, &env).unwrap()).await;
    assert_eq!(v, Verdict::Refused);
    assert!(why.contains("sslrootcert"), "{why}");
}
