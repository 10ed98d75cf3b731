use super::*;

fn no_env(_: &str) -> Option<String> {
    None
}

fn parse(s: &str) -> Result<PgConnectOptions, ConnInfoError> {
    PgConnectOptions::parse_with_env(s, &no_env)
}

#[test]
fn parses_url() {
    let o = parse(
        "postgresql://relay:s%40cret@db.example:6543/app?sslmode=verify-full&sslrootcert=/ca.pem&application_name=x",
    )
    .unwrap();
    assert_eq!(o.host, "db.example");
    assert_eq!(o.port, 6543);
    assert_eq!(o.user, "relay");
    assert_eq!(o.password.as_deref(), Some("s@cret"));
    assert_eq!(o.dbname, "app");
    assert_eq!(o.sslmode, SslMode::VerifyFull);
    assert!(o.sslmode_explicit);
    assert_eq!(o.sslrootcert, Some(PathBuf::from("/ca.pem")));
    assert!(o.sslrootcert_explicit);
    assert_eq!(o.application_name, "x");
}

#[test]
fn parses_keyvalue_with_quotes() {
    let o = parse("host=127.0.0.1 port = 5433 user=u password='a b\\'c' dbname=d sslmode=disable")
        .unwrap();
    assert_eq!(o.port, 5433);
    assert_eq!(o.password.as_deref(), Some("a b'c"));
    assert_eq!(o.sslmode, SslMode::Disable);
}

#[test]
fn ipv6_hostaddr_and_defaults() {
    let o = parse("postgres://u@[::1]:5434").unwrap();
    assert_eq!(o.host, "::1");
    assert_eq!(o.port, 5434);
    assert_eq!(o.dbname, "u");
    assert!(!o.sslmode_explicit);
    assert_eq!(o.sslmode, SslMode::Prefer);
    let o = parse("host=db.example hostaddr=127.0.0.1").unwrap();
    assert_eq!(o.connect_host(), "127.0.0.1");
    assert_eq!(o.host, "db.example");
    assert!(parse("host=db hostaddr=db.example").is_err());
}

#[test]
fn the_last_at_ends_the_userinfo() {
    let o = parse("postgresql://u:p@ss:w@rd@h:5/db").unwrap();
    assert_eq!(o.password.as_deref(), Some("p@ss:w@rd"));
    assert_eq!(o.host, "h");
    assert_eq!(o.port, 5);
}

#[test]
fn tls_rules_of_libpq() {
    // sslrootcert=system: verify-full by default, weaker modes refused.
    let o = parse("host=h sslrootcert=system").unwrap();
    assert_eq!(o.sslmode, SslMode::VerifyFull);
    for m in ["disable", "allow", "prefer", "require", "verify-ca"] {
        let e = parse(&format!("host=h sslrootcert=system sslmode={m}")).unwrap_err();
        assert!(e.to_string().contains("verify-full"), "{e}");
    }
    // ~/.postgresql/root.crt is used when it exists.
    let home = std::env::temp_dir().join(format!("conninfo-home-{}", std::process::id()));
    std::fs::create_dir_all(home.join(".postgresql")).unwrap();
    std::fs::write(home.join(".postgresql/root.crt"), "x").unwrap();
    let h = home.display().to_string();
    let env = move |k: &str| (k == "HOME").then(|| h.clone());
    let o = PgConnectOptions::parse_with_env("host=h sslmode=require", &env).unwrap();
    assert_eq!(o.sslrootcert, Some(home.join(".postgresql/root.crt")));
    assert!(!o.sslrootcert_explicit);
    std::fs::remove_dir_all(&home).unwrap();
    // PGSSLROOTCERT counts as given.
    let env = |k: &str| (k == "PGSSLROOTCERT").then(|| "/ca.pem".to_string());
    let o = PgConnectOptions::parse_with_env("host=h", &env).unwrap();
    assert!(o.sslrootcert_explicit);
    // channel_binding and gssencmode are never ignored.
    assert_eq!(
        parse("host=h channel_binding=require")
            .unwrap()
            .channel_binding,
        ChannelBindingMode::Require
    );
    assert!(parse("host=h channel_binding=require sslmode=disable").is_err());
    assert!(parse("host=h channel_binding=maybe").is_err());
    let e = parse("host=h gssencmode=require").unwrap_err().to_string();
    assert!(e.contains("not supported"), "{e}");
    assert!(parse("host=h gssencmode=prefer").is_ok());
    let env = |k: &str| (k == "PGGSSENCMODE").then(|| "require".to_string());
    assert!(PgConnectOptions::parse_with_env("host=h", &env).is_err());
}

#[test]
fn errors_never_contain_the_password() {
    for s in [
        "host=x password=zq9Vw7kX sslmode=bogus",
        "host=x password=zq9Vw7kX bogus=1",
        "host=x password=zq9V w7kX dbname=d",
        "host=x password=zq9V w7kX=x",
        "host=x password=zq9V w7kX",
        "postgresql://u:zq9Vw7kX@h:notaport/db",
        "postgresql://u:zq9V/w7kX@h:5432/db",
        "postgresql://u:zq9V?w7kX@h/db",
        "postgresql://u:zq9V#w7kX@h/db",
        "postgresql://u:zq9Vw7kX/x@h/db",
        "postgresql://u:zq9Vw7kX%zz@h/db",
        "postgresql://u:zq9Vw7kX",
        "host=x password='zq9Vw7kX",
    ] {
        let e = parse(s).unwrap_err().to_string();
        let pw: Vec<char> = "zq9Vw7kX".chars().collect();
        for frag in pw.windows(3) {
            let frag: String = frag.iter().collect();
            assert!(!e.contains(&frag), "{s}: {e}");
        }
    }
    let e = parse("postgresql://u:a/b@h/db").unwrap_err().to_string();
    assert!(e.contains("percent-encode the password"), "{e}");
    let o = parse("postgresql://u:zq9Vw7kX@h/db").unwrap();
    assert!(!format!("{o:?}").contains("zq9"));
}

#[test]
fn client_files_and_secrets_stay_hidden() {
    let o = parse(
        "host=h user=u password=Pw-1 sslcert=/c.pem sslkey=/k.pem sslpassword=Kp-2 passfile=/pf require_auth=!md5",
    )
    .unwrap();
    assert_eq!(o.sslcert.as_deref(), Some(std::path::Path::new("/c.pem")));
    assert_eq!(o.sslkey.as_deref(), Some(std::path::Path::new("/k.pem")));
    assert_eq!(o.sslpassword.as_deref(), Some("Kp-2"));
    assert_eq!(o.passfile.as_deref(), Some(std::path::Path::new("/pf")));
    assert!(!o.require_auth.allows(AuthMethod::Md5));
    let debug = format!("{o:?}");
    assert!(
        !debug.contains("Pw-1") && !debug.contains("Kp-2"),
        "{debug}"
    );
    let url = "postgresql://u@h/db?sslpassword=Kp-2&sslcert=/c.pem";
    assert!(!crate::redact::redact_url(url).contains("Kp-2"));
    assert!(!crate::redact::redact_url("host=h sslpassword='K p-2'").contains("p-2"));
    // A certificate without its key is refused; an empty value turns a default off.
    assert!(parse("host=h sslcert=/c.pem sslkey=").is_err());
    assert_eq!(parse("host=h sslcert=").unwrap().sslcert, None);
}

#[test]
fn target_session_attrs_is_any_or_refused() {
    assert!(parse("postgresql://u@h/db?target_session_attrs=any").is_ok());
    let e = parse("postgresql://u@h/db?target_session_attrs=read-write").unwrap_err();
    assert!(
        e.0.starts_with("target_session_attrs=read-write is not supported: "),
        "{e}"
    );
    // A value that is not libpq's is not echoed.
    let e = parse("host=h target_session_attrs=Sekr1t").unwrap_err();
    assert!(!e.0.contains("Sekr1t"), "{e}");
}
