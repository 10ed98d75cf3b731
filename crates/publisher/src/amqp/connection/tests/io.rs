//! The I/O loop's defects of issue 40: 1 the CPU spin while the broker stops
//! reading, 2 memory given back after a large message, 3 a given-up connection
//! closes its socket, 5 frames in the same read as an awaited reply.

use std::future::poll_fn;
use std::time::Duration;

use amq_protocol::frame::AMQPFrame;
use amq_protocol::protocol::{channel, connection, AMQPClass};
use tokio::io::AsyncReadExt;

use super::super::{ConnError, Event};
use super::broker::*;

/// CPU time this thread has used (user and system), from /proc (10 ms ticks).
fn thread_cpu() -> Duration {
    let stat = std::fs::read_to_string("/proc/thread-self/stat").expect("/proc/thread-self/stat");
    // Fields after the command name (which may hold spaces): state is the first,
    // utime the 12th and stime the 13th.
    let fields: Vec<&str> = stat[stat.rfind(')').unwrap() + 1..]
        .split_whitespace()
        .collect();
    let ticks: u64 = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
    Duration::from_millis(ticks * 10)
}

/// Defect 1. The broker stops reading (its receive buffer is tiny and it never
/// reads again) while 20 MB wait to be written; it keeps sending heartbeats, so
/// the connection is healthy. For 3 s the connection must sleep: few polls, and
/// next to no CPU on its thread.
#[tokio::test]
async fn a_broker_that_stops_reading_costs_no_cpu_while_bytes_wait() {
    let script = Script {
        frame_max: 131_072,
        heartbeat: 1,
        rcvbuf: Some(4096),
        ..Script::default()
    };
    let (mut conn, broker) = pair(script, |mut socket| async move {
        for _ in 0..9 {
            send(&mut socket, &[AMQPFrame::Heartbeat]).await;
            tokio::time::sleep(Duration::from_millis(400)).await;
        }
    })
    .await;
    let body = vec![7u8; 20 << 20];
    conn.publish("orders", "big", properties("big"), &body)
        .unwrap();
    let cpu_before = thread_cpu();
    let mut polls = 0u32;
    let outcome = tokio::time::timeout(
        Duration::from_secs(3),
        poll_fn(|cx| {
            polls += 1;
            conn.poll_io(cx)
        }),
    )
    .await;
    let cpu = thread_cpu() - cpu_before;
    assert!(
        cpu < Duration::from_millis(500) && polls < 100,
        "the connection used {cpu:?} of CPU and was polled {polls} times in 3 s while the broker did not read (then: {outcome:?})"
    );
    assert!(
        outcome.is_err(),
        "the connection ended while the broker was only slow: {outcome:?}"
    );
    assert!(conn.unwritten() > 0, "the broker read none of it");
    broker.done().await;
}

/// Defect 2. Once a 20 MB message is written out, the write buffer keeps at most
/// 1 MiB allocated.
#[tokio::test]
async fn the_write_buffer_gives_its_capacity_back_after_a_large_message() {
    let script = Script {
        frame_max: 131_072,
        ..Script::default()
    };
    let (mut conn, broker) = pair(script, |mut socket| async move {
        let (_, _, body) = read_publish(&mut socket, 2, 131_072).await;
        send(&mut socket, &[ack(2, 1, false)]).await;
        body.len()
    })
    .await;
    let body = vec![7u8; 20 << 20];
    assert_eq!(
        conn.publish("orders", "big", properties("big"), &body),
        Ok(1)
    );
    assert!(conn.write_capacity() >= body.len());
    let events = next_events(&mut conn).await.unwrap();
    assert_eq!(events, vec![Event::Confirm { tag: 1, ack: true }]);
    assert_eq!(conn.unwritten(), 0);
    assert!(
        conn.write_capacity() <= 1 << 20,
        "the write buffer still holds {} bytes after the message went out",
        conn.write_capacity()
    );
    let (_, received) = broker.done().await;
    assert_eq!(received, body.len());
}

/// Defect 3. A connection given up closes its socket at once: the broker reads
/// EOF while the connection value still exists.
#[tokio::test]
async fn a_given_up_connection_closes_its_socket_at_once() {
    let (mut conn, broker) = pair(Script::default(), |mut socket| async move {
        let mut buf = [0u8; 64];
        tokio::time::timeout(Duration::from_secs(1), socket.read(&mut buf))
            .await
            .ok()
            .map(|read| read.map_err(|e| e.to_string()))
    })
    .await;
    conn.abandon();
    let (_, read) = broker.done().await;
    assert_eq!(
        read,
        Some(Ok(0)),
        "the broker saw no end of the socket within 1 s (None: nothing at all)"
    );
    assert!(!conn.is_alive());
    let quiet = events_within(&mut conn, Duration::from_millis(50)).await;
    assert!(quiet.is_none(), "given up, it reports nothing: {quiet:?}");
}

/// Defect 5. `connection.close` in the same write as the reply the channel's
/// opening waited for, heartbeats off: the close comes out of the next poll
/// without the broker writing anything more, and the broker gets close-ok.
#[tokio::test]
async fn a_close_behind_an_awaited_reply_is_handled_without_another_read() {
    let script = Script {
        with_select_ok: vec![connection_close(320, "CONNECTION_FORCED - broker shutdown")],
        ..Script::default()
    };
    let (mut conn, broker) = pair(script, |mut socket| async move {
        read_frame_within(&mut socket, Duration::from_secs(2)).await
    })
    .await;
    let outcome = events_within(&mut conn, Duration::from_secs(1)).await;
    assert_eq!(
        outcome,
        Some(Err(ConnError::Closed {
            code: 320,
            text: "CONNECTION_FORCED - broker shutdown".into()
        })),
        "(None: nothing within 1 s)"
    );
    let (_, answer) = broker.done().await;
    assert!(
        matches!(
            answer,
            Some(AMQPFrame::Method(
                0,
                AMQPClass::Connection(connection::AMQPMethod::CloseOk(_))
            ))
        ),
        "the broker got {answer:?}, not close-ok"
    );
}

/// Defect 5. `connection.blocked` behind `channel.open-ok`, heartbeats off: handed
/// out by the next poll, without another read.
#[tokio::test]
async fn blocked_behind_an_awaited_reply_is_handed_out_without_another_read() {
    let blocked = connection::Blocked {
        reason: "low on memory".into(),
    };
    let script = Script {
        with_open_ok: vec![conn_frame(connection::AMQPMethod::Blocked(blocked))],
        ..Script::default()
    };
    let (mut conn, broker) = pair(script, |mut socket| async move {
        // Quiet, the socket open: nothing more arrives for the client to read.
        read_frame_within(&mut socket, Duration::from_millis(1500)).await
    })
    .await;
    let outcome = events_within(&mut conn, Duration::from_secs(1)).await;
    assert!(conn.blocked(), "the connection is blocked");
    assert_eq!(
        outcome,
        Some(Ok(vec![Event::Blocked("low on memory".into())])),
        "(None: nothing within 1 s)"
    );
    let (_, sent) = broker.done().await;
    assert_eq!(sent, None, "the client sent {sent:?}");
}

/// Issue 49. A flood of `connection.blocked` / `unblocked` read while nothing is
/// handed out keeps at most one notice waiting (the event queue does not grow with
/// the flood), and the last state wins: blocked and unblocked cancel out.
#[tokio::test]
async fn a_flood_of_blocked_and_unblocked_keeps_one_notice_at_most() {
    let blocked = || {
        conn_frame(connection::AMQPMethod::Blocked(connection::Blocked {
            reason: "low on memory".into(),
        }))
    };
    let unblocked = || conn_frame(connection::AMQPMethod::Unblocked(connection::Unblocked {}));
    let mut flood = Vec::new();
    for _ in 0..5000 {
        flood.push(blocked());
        flood.push(unblocked());
    }
    flood.push(blocked());
    let script = Script {
        with_select_ok: flood,
        ..Script::default()
    };
    let (mut conn, broker) = pair(script, |mut socket| async move {
        read_frame_within(&mut socket, Duration::from_millis(1500)).await
    })
    .await;
    let mut events = Vec::new();
    let mut polls = 0;
    while let Some(Ok(more)) = events_within(&mut conn, Duration::from_millis(300)).await {
        // Each poll hands out one notice at most, however many frames it read.
        assert!(more.len() <= 1, "{} notices at once", more.len());
        events.extend(more);
        polls += 1;
    }
    assert!(polls < 10_001 && events.len() <= polls, "{polls} polls");
    for pair in events.windows(2) {
        assert_ne!(pair[0], pair[1], "notices alternate");
    }
    assert_eq!(events.last(), Some(&Event::Blocked("low on memory".into())));
    assert!(conn.blocked());
    let (_, sent) = broker.done().await;
    assert_eq!(sent, None, "the client sent {sent:?}");
}

/// Defect 5. `connection.close` in the same write as `channel.open-ok`: the
/// channel's opening fails with the close (its confirm.select is never sent), the
/// broker gets close-ok, and the end is reported once: `poll_io` stays quiet after.
#[tokio::test]
async fn a_close_behind_channel_open_ok_ends_the_opening_and_is_reported_once() {
    let broker = broker(None, |mut socket| async move {
        accept(&mut socket, 4096, 0).await;
        assert!(matches!(
            expect_method(&mut socket, 2).await,
            AMQPClass::Channel(channel::AMQPMethod::Open(_))
        ));
        let open_ok = method(
            2,
            AMQPClass::Channel(channel::AMQPMethod::OpenOk(channel::OpenOk {})),
        );
        let close = connection_close(320, "CONNECTION_FORCED - broker shutdown");
        send(&mut socket, &[open_ok, close]).await;
        read_frame_within(&mut socket, Duration::from_secs(2)).await
    });
    let mut conn = tokio::time::timeout(EVENT_LIMIT, connect_to(broker.port))
        .await
        .expect("the handshake did not end in time")
        .expect("the handshake failed");
    let opened = tokio::time::timeout(Duration::from_secs(1), conn.open_channel())
        .await
        .expect("the channel's opening did not end within 1 s");
    assert_eq!(
        opened,
        Err(ConnError::Closed {
            code: 320,
            text: "CONNECTION_FORCED - broker shutdown".into()
        })
    );
    assert!(!conn.channel_open());
    let again = events_within(&mut conn, Duration::from_millis(200)).await;
    assert!(
        again.is_none(),
        "the end was reported a second time: {again:?}"
    );
    let answer = broker.done().await;
    assert!(
        matches!(
            answer,
            Some(AMQPFrame::Method(
                0,
                AMQPClass::Connection(connection::AMQPMethod::CloseOk(_))
            ))
        ),
        "the broker got {answer:?}, not close-ok"
    );
}
