//! The one HTTP/1 exchange both of the relay's clients make (`client.rs`,
//! asking the relay's own endpoint, and `check --routes`, asking the management
//! API): a whole request written, then the answer read until the peer closes the
//! connection, at most `limit` bytes. Each client builds its request and reads the
//! status and body its own way.

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// Writes `request` and reads the answer to its end (or `limit` bytes).
pub(crate) async fn exchange<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    request: &str,
    limit: u64,
) -> Result<Vec<u8>, std::io::Error> {
    stream.write_all(request.as_bytes()).await?;
    let mut answer = Vec::new();
    let read = stream.take(limit).read_to_end(&mut answer).await;
    // A TLS peer that closes without close_notify still sent the whole answer.
    if let Err(e) = read {
        if answer.is_empty() {
            return Err(e);
        }
    }
    Ok(answer)
}
