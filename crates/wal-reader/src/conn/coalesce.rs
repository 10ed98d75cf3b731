//! Waking the reader once per batch of the walsender's messages rather than once per
//! message (docs/design.md §2, "Reading in batches").
//!
//! The walsender writes and flushes every pgoutput message on its own (Begin, each
//! change, Commit), and a reader that keeps up parks after each one and is woken by
//! the next: on a busy machine each wake-up preempts the walsender, the process that
//! limits the rate (docs/performance.md, "The reader on single-row transactions").
//! While streaming busily — at least [`BUSY_READS`] reads per millisecond, which a
//! drain reaches and 1,000 single-row transactions a second do not — the TCP socket's
//! receive low-water mark (`SO_RCVLOWAT`) is raised to [`LOW_WATER`] bytes, so the
//! kernel wakes the reader when that much is queued. A read that has waited [`WAIT`]
//! lowers it to one byte, so whatever is queued is read at once, and reads are plain
//! again until the stream is busy again. The latency this adds is bounded by [`WAIT`]
//! (plus the timer's granularity), and only while the stream is busy and fewer than
//! [`LOW_WATER`] bytes arrive within it.
//!
//! An end of stream or a socket error wakes the reader whatever the mark. A Unix
//! socket has no such option and is read as before.

use std::io;
use std::os::fd::RawFd;
use std::time::Duration;

use tokio::time::Instant;

/// The receive low-water mark while streaming: about 30 single-row transactions of
/// the harness's ~300-byte payloads.
pub(crate) const LOW_WATER: i32 = 16 * 1024;

/// How long a read waits for [`LOW_WATER`] bytes before taking what is there.
pub(crate) const WAIT: Duration = Duration::from_millis(1);

/// Reads per millisecond from which the stream counts as busy and the mark is raised:
/// 8,000 wake-ups a second. 1,000 single-row transactions a second wake the reader
/// about 1,000–3,000 times (Begin, Insert and Commit arrive close together).
pub(crate) const BUSY_READS: u32 = 8;

/// The span over which reads are counted.
const WINDOW: Duration = Duration::from_millis(1);

/// The low-water mark of one connection's socket.
#[derive(Debug, Default)]
pub(crate) struct Coalesce {
    /// The mark is [`LOW_WATER`] now (else 1, the kernel's default).
    raised: bool,
    /// When the current read lowers the mark; kept across a cancelled read, so a
    /// caller that polls `fill` afresh in a loop cannot postpone it.
    deadline: Option<Instant>,
    /// Setting the option failed once: read without it from then on.
    off: bool,
    /// The last finished span of reads had [`BUSY_READS`] per millisecond or more.
    busy: bool,
    /// The span being counted: when it began, and the reads that returned in it.
    window: Option<Instant>,
    reads: u32,
    /// How many times the mark was raised (for tests).
    #[cfg(test)]
    pub(crate) raises: u32,
}

impl Coalesce {
    /// Before a read on `fd`: raises the mark if it is not, and returns the instant
    /// after which the read should [`Coalesce::lower`] it. `None`: read plainly.
    pub(crate) fn before_read(&mut self, fd: RawFd) -> Option<Instant> {
        if self.off {
            return None;
        }
        if !self.raised {
            if !self.busy {
                return None;
            }
            if let Err(e) = set_rcvlowat(fd, LOW_WATER) {
                tracing::debug!(error = %e, "SO_RCVLOWAT not set; reading without it");
                self.off = true;
                return None;
            }
            self.raised = true;
            #[cfg(test)]
            {
                self.raises += 1;
            }
        }
        Some(*self.deadline.get_or_insert_with(|| Instant::now() + WAIT))
    }

    /// Counts the stream as busy now, whatever its reads (for tests that must not
    /// depend on the scheduler's timing).
    #[cfg(test)]
    pub(crate) fn set_busy(&mut self) {
        self.busy = true;
    }

    /// A read returned (with the mark raised or not).
    pub(crate) fn read_done(&mut self) {
        self.deadline = None;
        self.count_read(Instant::now());
    }

    /// Counts a read that returned at `now`; a span of at least [`WINDOW`] that ends
    /// decides whether the stream is busy.
    fn count_read(&mut self, now: Instant) {
        let start = *self.window.get_or_insert(now);
        let span = now.saturating_duration_since(start);
        if span >= WINDOW {
            // reads / span ≥ BUSY_READS / WINDOW, in whole nanoseconds.
            self.busy = u128::from(self.reads) * WINDOW.as_nanos()
                >= u128::from(BUSY_READS) * span.as_nanos();
            self.window = Some(now);
            self.reads = 0;
        }
        self.reads += 1;
    }

    /// The read waited [`WAIT`]: lowers the mark to one byte, so that what is queued
    /// wakes it (Linux signals readability when the mark falls below what is queued).
    pub(crate) fn lower(&mut self, fd: RawFd) {
        self.deadline = None;
        self.raised = false;
        // Slower than the mark: plain reads until a span shows the stream busy again.
        self.busy = false;
        self.window = None;
        self.reads = 0;
        if let Err(e) = set_rcvlowat(fd, 1) {
            // The mark may still be raised: stop using it, but the read must not
            // wait for it either, so the caller reads on; the next read is plain.
            tracing::debug!(error = %e, "SO_RCVLOWAT not lowered; reading without it");
            self.off = true;
        }
    }
}

/// Sets the socket option `SO_RCVLOWAT` of `fd` to `bytes`.
///
/// The one `unsafe` call of the workspace (docs/design.md §2, "Reading in batches"):
/// none of the socket crates this tree uses (socket2, rustix, nix) offers this
/// option, and it is a plain `setsockopt` of an `int`.
#[allow(unsafe_code)]
fn set_rcvlowat(fd: RawFd, bytes: i32) -> io::Result<()> {
    let value: libc::c_int = bytes;
    // SAFETY: `fd` is the descriptor of a socket that the caller's stream owns and
    // keeps open for the call; the option value is a `c_int` on the stack that
    // outlives the call, and its size is passed with it.
    let rc = unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_RCVLOWAT,
            std::ptr::from_ref(&value).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    /// The option really is set on a TCP socket, and what a lowered mark lets
    /// through is readable: a 10-byte write does not make a socket with the raised
    /// mark readable, and does once the mark is lowered.
    #[tokio::test]
    async fn the_mark_holds_small_writes_back_until_lowered() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (client, server) =
            tokio::join!(tokio::net::TcpStream::connect(addr), listener.accept());
        let mut reader = client.unwrap();
        let (mut writer, _) = server.unwrap();
        let mut c = Coalesce {
            busy: true,
            ..Coalesce::default()
        };
        let fd = reader.as_raw_fd();
        let deadline = c.before_read(fd).expect("raised");
        assert!(c.raised);
        writer.write_all(b"0123456789").await.unwrap();
        writer.flush().await.unwrap();
        let mut buf = [0u8; 64];
        // Raised: 10 bytes are below the mark, so the socket is not readable.
        let early = tokio::time::timeout_at(
            Instant::now() + Duration::from_millis(200),
            reader.readable(),
        )
        .await;
        assert!(early.is_err(), "readable below the low-water mark");
        assert!(deadline <= Instant::now());
        c.lower(fd);
        assert!(!c.raised && !c.off && !c.busy);
        let n = tokio::time::timeout(Duration::from_secs(5), reader.read(&mut buf))
            .await
            .expect("readable once the mark is lowered")
            .unwrap();
        assert_eq!(&buf[..n], b"0123456789");
    }

    /// A descriptor that is not a socket turns the mark off instead of failing reads.
    #[test]
    fn a_failed_option_turns_the_mark_off() {
        let file = std::fs::File::open("/dev/null").unwrap();
        let mut c = Coalesce {
            busy: true,
            ..Coalesce::default()
        };
        assert!(c.before_read(file.as_raw_fd()).is_none());
        assert!(c.off);
        assert!(c.before_read(file.as_raw_fd()).is_none());
    }

    /// A stream counts as busy from [`BUSY_READS`] reads per millisecond: 3 per
    /// millisecond (1,000 single-row transactions a second) leave the mark alone, 20
    /// raise it, and a quiet span after a busy one lowers the count again.
    #[test]
    fn busy_is_reads_per_millisecond() {
        let t0 = Instant::now();
        let mut c = Coalesce::default();
        let at = |c: &mut Coalesce, per_ms: u32, ms: u32, from: Duration| {
            for i in 0..per_ms * ms {
                c.count_read(t0 + from + WINDOW * i / per_ms);
            }
            from + WINDOW * ms
        };
        let end = at(&mut c, 3, 5, Duration::ZERO);
        assert!(!c.busy, "3 reads per ms is not busy");
        let end = at(&mut c, 20, 5, end);
        assert!(c.busy, "20 reads per ms is busy");
        let end = at(&mut c, BUSY_READS, 5, end);
        assert!(c.busy, "exactly BUSY_READS per ms is busy");
        at(&mut c, 1, 5, end);
        assert!(!c.busy, "1 read per ms is not busy");
        // Not busy: no mark, whatever the socket.
        let file = std::fs::File::open("/dev/null").unwrap();
        assert!(c.before_read(file.as_raw_fd()).is_none());
        assert!(!c.off, "the option was not even tried");
    }
}
