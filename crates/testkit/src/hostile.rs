//! Test doubles for the security tests (docs/security.md): a scripted fake Postgres
//! that answers as no real server would, the wire messages it sends, an encoding the
//! log scans look for, and broker users of a test's own.

use std::io::{Read, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// The body of an SSLRequest (after its length word).
pub const SSL_REQUEST: [u8; 4] = [0x04, 0xd2, 0x16, 0x2f];

/// An AuthenticationRequest with `code` (0 ok, 3 cleartext, 5 md5 + salt, 10 SASL +
/// mechanisms) and the rest of its body.
pub fn auth_request(code: i32, extra: &[u8]) -> Vec<u8> {
    let mut m = vec![b'R'];
    m.extend_from_slice(&(8 + extra.len() as i32).to_be_bytes());
    m.extend_from_slice(&code.to_be_bytes());
    m.extend_from_slice(extra);
    m
}

/// An ErrorResponse with `fields` (`(b'S', "FATAL")`, `(b'C', "28000")`, `(b'M', …)`).
pub fn error_response(fields: &[(u8, &str)]) -> Vec<u8> {
    let mut body = Vec::new();
    for (k, v) in fields {
        body.push(*k);
        body.extend_from_slice(v.as_bytes());
        body.push(0);
    }
    body.push(0);
    let mut m = vec![b'E'];
    m.extend_from_slice(&((body.len() + 4) as i32).to_be_bytes());
    m.extend_from_slice(&body);
    m
}

/// A fake Postgres on a local port, serving every client on its own thread.
pub struct FakePostgres {
    pub port: u16,
    password_sent: Arc<AtomicBool>,
}

impl FakePostgres {
    /// Answers every SSLRequest with the byte `answer` (`N`, or one no Postgres
    /// server sends), then writes `reply` after the startup message and watches
    /// whether the client sends a PasswordMessage.
    pub fn start(answer: u8, reply: Vec<u8>) -> FakePostgres {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = listener.local_addr().expect("local address").port();
        let password_sent = Arc::new(AtomicBool::new(false));
        let flag = password_sent.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut s) = stream else { continue };
                let flag = flag.clone();
                let reply = reply.clone();
                std::thread::spawn(move || {
                    let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
                    loop {
                        let mut len = [0u8; 4];
                        if s.read_exact(&mut len).is_err() {
                            return;
                        }
                        let n = (u32::from_be_bytes(len) as usize).saturating_sub(4);
                        let mut rest = vec![0u8; n.min(1 << 16)];
                        if s.read_exact(&mut rest).is_err() {
                            return;
                        }
                        if rest == SSL_REQUEST {
                            let _ = s.write_all(&[answer]);
                            continue;
                        }
                        break;
                    }
                    let _ = s.write_all(&reply);
                    let mut first = [0u8; 1];
                    if s.read_exact(&mut first).is_ok() && first[0] == b'p' {
                        flag.store(true, Ordering::SeqCst);
                    }
                });
            }
        });
        FakePostgres {
            port,
            password_sent,
        }
    }

    /// True once any client sent a PasswordMessage.
    pub fn password_sent(&self) -> bool {
        self.password_sent.load(Ordering::SeqCst)
    }
}

/// Standard base64 with padding (what HTTP basic credentials and some log lines
/// use).
pub fn base64(data: &[u8]) -> String {
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for chunk in data.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |a, (i, x)| a | (*x as u32) << (16 - 8 * i));
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(A[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// Runs `rabbitmqctl -q args`; panics with its stderr on failure.
pub fn rabbitmqctl(args: &[&str]) -> String {
    let out = crate::rabbitmqctl_command()
        .arg("-q")
        .args(args)
        .output()
        .expect("run rabbitmqctl");
    assert!(
        out.status.success(),
        "rabbitmqctl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A broker user of the test's own with every permission on `/`, deleted on drop.
pub struct BrokerUser(pub String);

impl BrokerUser {
    pub fn new(prefix: &str, password: &str) -> BrokerUser {
        let name = crate::unique_name(prefix);
        rabbitmqctl(&["add_user", &name, password]);
        rabbitmqctl(&["set_permissions", "-p", "/", &name, ".*", ".*", ".*"]);
        BrokerUser(name)
    }

    /// Limits this user to `n` connections (`rabbitmqctl set_user_limits`); the
    /// limit goes with the user when it is deleted on drop.
    pub fn set_max_connections(&self, n: u32) {
        rabbitmqctl(&[
            "set_user_limits",
            &self.0,
            &format!("{{\"max-connections\": {n}}}"),
        ]);
    }

    /// Closes every connection of this user, so that its client reconnects.
    pub fn close_connections(&self) {
        for line in rabbitmqctl(&["list_connections", "user", "pid"]).lines() {
            let mut cols = line.split('\t');
            if let (Some(user), Some(pid)) = (cols.next(), cols.next()) {
                if user == self.0 {
                    let _ = crate::rabbitmqctl_command()
                        .args(["-q", "close_connection", pid, "closed by a test"])
                        .output();
                }
            }
        }
    }
}

impl Drop for BrokerUser {
    fn drop(&mut self) {
        let _ = crate::rabbitmqctl_command()
            .args(["-q", "delete_user", &self.0])
            .output();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_is_standard() {
        assert_eq!(base64(b"\0u\0pw-secret"), "AHUAcHctc2VjcmV0");
        assert_eq!(base64(b"u:pw"), "dTpwdw==");
    }
}
