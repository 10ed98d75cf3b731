//! Streamed transactions: stream blocks, aborts and their state.

use super::*;

#[test]
fn stream_abort_with_parallel_streaming_reads_abort_lsn_and_time() {
    let mut d = Decoder::with_parallel_streaming(true);
    let m = stream_abort_v4(true);
    assert_eq!(
        decode(&mut d, &m).unwrap(),
        LogicalMessage::StreamAbort(StreamAbort {
            xid: 700,
            subxid: 701,
            abort_lsn: Some(Lsn(0x0000_0002_0000_0010)),
            abort_time: Some(123_456_789),
        })
    );
    assert_prefixes_fail(&d, &m);
}

#[test]
fn stream_abort_without_parallel_streaming_has_no_abort_fields() {
    let mut d = Decoder::new();
    assert_eq!(
        decode(&mut d, &stream_abort_v4(false)).unwrap(),
        LogicalMessage::StreamAbort(StreamAbort {
            xid: 700,
            subxid: 701,
            abort_lsn: None,
            abort_time: None,
        })
    );
    // A v4 parallel abort fed to a decoder that was not told: a clear error.
    assert_eq!(
        decode(&mut d, &stream_abort_v4(true)),
        Err(DecodeError::TrailingBytes {
            message: "Stream Abort",
            count: 16
        })
    );
    // And the reverse: the parallel decoder needs the fields.
    let mut p = Decoder::with_parallel_streaming(true);
    assert!(matches!(
        decode(&mut p, &stream_abort_v4(false)),
        Err(DecodeError::UnexpectedEnd {
            reading: "Stream Abort LSN",
            ..
        })
    ));
}

#[test]
fn messages_inside_a_stream_block_carry_the_xid() {
    let mut d = Decoder::new();
    assert!(!d.in_stream());
    assert_eq!(
        decode(&mut d, &stream_start(9)).unwrap(),
        LogicalMessage::StreamStart(StreamStart {
            xid: 9,
            first_segment: true
        })
    );
    assert!(d.in_stream());
    let insert = Msg::tag(b'I').u32(9).u32(16384).u8(b'N').u16(1).text(b"x");
    let LogicalMessage::Insert(i) = decode(&mut d, &insert).unwrap() else {
        panic!("not an Insert")
    };
    assert_eq!((i.xid, i.relation_id), (Some(9), 16384));
    let ty = Msg::tag(b'Y').u32(9).u32(50000).str("public").str("mood");
    assert_eq!(
        decode(&mut d, &ty).unwrap(),
        LogicalMessage::Type(TypeMessage {
            xid: Some(9),
            id: 50000,
            namespace: "public".into(),
            name: "mood".into()
        })
    );
    let msg = Msg::tag(b'M')
        .u32(9)
        .u8(1)
        .u64(77)
        .str("p")
        .i32(2)
        .raw(b"hi");
    let LogicalMessage::Message(m) = decode(&mut d, &msg).unwrap() else {
        panic!("not a Message")
    };
    assert_eq!(
        (m.xid, m.flags, m.lsn, &m.prefix[..], &m.content[..]),
        (Some(9), 1, Lsn(77), "p", &b"hi"[..])
    );
    assert_prefixes_fail(&d, &insert);
    assert_eq!(
        decode(&mut d, &Msg::tag(b'E')).unwrap(),
        LogicalMessage::StreamStop
    );
    assert!(!d.in_stream());
    // Outside the block the same Insert without the xid.
    let plain = Msg::tag(b'I').u32(16384).u8(b'N').u16(0);
    let LogicalMessage::Insert(i) = decode(&mut d, &plain).unwrap() else {
        panic!("not an Insert")
    };
    assert_eq!(
        (i.xid, i.relation_id, i.tuple.columns.len()),
        (None, 16384, 0)
    );
}

#[test]
fn stream_state_violations_are_errors() {
    let mut d = Decoder::new();
    assert_eq!(
        decode(&mut d, &Msg::tag(b'E')),
        Err(DecodeError::UnexpectedMessage {
            message: "Stream Stop",
            context: "outside a Stream Start..Stream Stop block"
        })
    );
    decode(&mut d, &stream_start(1)).unwrap();
    for tag in [b'B', b'C', b'S', b'c', b'A', b'b', b'P', b'K', b'r', b'p'] {
        let r = d.clone().decode(Bytes::copy_from_slice(&[tag]));
        assert!(
            matches!(
                r,
                Err(DecodeError::UnexpectedMessage {
                    context: "inside a Stream Start..Stream Stop block",
                    ..
                })
            ),
            "{:?}: {r:?}",
            tag as char
        );
    }
    // Origin is allowed inside a block (sent after Stream Start for replayed
    // transactions) and has no xid.
    let origin = Msg::tag(b'O').u64(5).str("node_a");
    assert_eq!(
        decode(&mut d, &origin).unwrap(),
        LogicalMessage::Origin(Origin {
            commit_lsn: Lsn(5),
            name: "node_a".into()
        })
    );
}

#[test]
fn failed_decode_leaves_stream_state_unchanged() {
    let mut d = Decoder::new();
    assert!(d.decode(Bytes::from_static(b"S\0\0")).is_err());
    assert!(!d.in_stream());
    // A Stream Start with trailing garbage does not open a block either.
    assert!(decode(&mut d, &stream_start(3).u8(0)).is_err());
    assert!(!d.in_stream());
    decode(&mut d, &stream_start(3)).unwrap();
    assert!(d.decode(Bytes::from_static(b"E\0")).is_err());
    assert!(d.in_stream());
}
