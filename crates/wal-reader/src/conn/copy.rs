//! The CopyBoth sub-protocol of `START_REPLICATION`: the connection hands the
//! replication stream only CopyData payloads. Everything else the server sends
//! while streaming is handled here: NoticeResponse is logged and ParameterStatus
//! ignored; ErrorResponse ends the stream with the server's error; CopyDone, and the
//! CommandComplete of a walsender shutting down (server stop or restart), end it
//! as a lost connection (transient: the relay reconnects).

use std::io;
use std::time::Duration;

use bytes::Bytes;
use postgres_protocol::message::backend::Message;
use postgres_protocol::message::frontend;
use tracing::debug;

use super::framing::parse_error;
use super::ReplicationConnection;
use crate::error::ReaderError;

impl ReplicationConnection {
    /// Sends a query that answers with CopyBoth (`START_REPLICATION`) and waits for
    /// that response. `slot` is used to word errors.
    pub(crate) async fn start_copy_both(
        &mut self,
        sql: &str,
        slot: &str,
    ) -> Result<(), ReaderError> {
        frontend::query(sql, &mut self.wbuf)?;
        self.flush().await?;
        loop {
            let frame = self.read_frame().await?;
            match frame.tag() {
                b'W' => {
                    self.streaming_slot = Some(slot.to_string());
                    return Ok(());
                }
                b'N' | b'S' => {}
                b'E' => {
                    let e = parse_error(frame.body());
                    // Drain to ReadyForQuery so the connection stays usable.
                    loop {
                        match self.read_frame().await {
                            Ok(m) if m.tag() == b'Z' => break,
                            Ok(_) => {}
                            Err(_) => break,
                        }
                    }
                    return Err(ReaderError::from_server(e, &self.user, Some(slot)));
                }
                other => {
                    return Err(ReaderError::Protocol(format!(
                        "message {:?} instead of CopyBothResponse",
                        other as char
                    )))
                }
            }
        }
    }

    /// The next CopyData payload already in the read buffer (a slice of it, not a
    /// copy), or `None` when the buffer holds no further complete message: then
    /// [`Self::fill`] reads more. Any other message is handled here (module docs).
    pub(crate) fn try_copy_data(&mut self) -> Result<Option<Bytes>, ReaderError> {
        while let Some(frame) = self.try_frame()? {
            match frame.tag() {
                // The replication stream itself: every XLogData and keepalive.
                b'd' => return Ok(Some(frame.into_body())),
                b'c' | b'C' | b'S' => {}
                b'E' => {
                    return Err(ReaderError::from_server(
                        parse_error(frame.body()),
                        &self.user,
                        self.streaming_slot.as_deref(),
                    ));
                }
                b'N' => {
                    let notice = parse_error(frame.body());
                    debug!(severity = %notice.severity, %notice, "notice from Postgres while streaming");
                    continue;
                }
                other => {
                    return Err(ReaderError::Protocol(format!(
                        "message {:?} during replication",
                        other as char
                    )))
                }
            }
            match frame.parse()? {
                Message::CopyDone => {
                    return Err(ReaderError::Io(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "Postgres ended the replication stream (CopyDone)",
                    )))
                }
                // A walsender shutting down (server stop or restart) ends the stream
                // with CommandComplete, without CopyDone: the same transient end.
                Message::CommandComplete(_) => {
                    return Err(ReaderError::Io(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "Postgres ended the replication stream (server shutting down)",
                    )))
                }
                _ => {}
            }
        }
        Ok(None)
    }

    /// Queues a CopyData message carrying `payload` for the next flush.
    pub(crate) fn queue_copy_data(&mut self, payload: &[u8]) {
        self.wbuf.extend_from_slice(b"d");
        self.wbuf
            .extend_from_slice(&((payload.len() + 4) as i32).to_be_bytes());
        self.wbuf.extend_from_slice(payload);
    }

    /// Ends CopyBoth from our side and reads until the server finishes
    /// (CopyDone / CommandComplete / ReadyForQuery), bounded by `timeout`; then
    /// terminates the session.
    pub(crate) async fn finish_copy(&mut self, timeout: Duration) -> Result<(), ReaderError> {
        frontend::copy_done(&mut self.wbuf);
        self.flush().await?;
        let drain = async {
            loop {
                let m = self.read_frame().await?;
                match m.tag() {
                    b'Z' => return Ok::<(), ReaderError>(()),
                    b'E' => return Err(ReaderError::Server(parse_error(m.body()))),
                    _ => {}
                }
            }
        };
        let _ = tokio::time::timeout(timeout, drain).await;
        self.terminate().await;
        Ok(())
    }
}
