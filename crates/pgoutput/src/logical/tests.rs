//! Decoder tests on bytes built by hand from the protocol documentation. Bytes captured
//! from a real server are tested in `tests/captured.rs`.

#![allow(clippy::unwrap_used)]

use bytes::Bytes;

use super::*;
use crate::Lsn;

/// Builds a message field by field, big-endian.
#[derive(Default)]
struct Msg(Vec<u8>);

impl Msg {
    fn tag(t: u8) -> Msg {
        Msg(vec![t])
    }
    fn u8(mut self, v: u8) -> Msg {
        self.0.push(v);
        self
    }
    fn u16(mut self, v: u16) -> Msg {
        self.0.extend_from_slice(&v.to_be_bytes());
        self
    }
    fn u32(mut self, v: u32) -> Msg {
        self.0.extend_from_slice(&v.to_be_bytes());
        self
    }
    fn i32(mut self, v: i32) -> Msg {
        self.0.extend_from_slice(&v.to_be_bytes());
        self
    }
    fn u64(mut self, v: u64) -> Msg {
        self.0.extend_from_slice(&v.to_be_bytes());
        self
    }
    fn i64(mut self, v: i64) -> Msg {
        self.0.extend_from_slice(&v.to_be_bytes());
        self
    }
    fn str(mut self, s: &str) -> Msg {
        self.0.extend_from_slice(s.as_bytes());
        self.0.push(0);
        self
    }
    fn raw(mut self, b: &[u8]) -> Msg {
        self.0.extend_from_slice(b);
        self
    }
    fn text(self, v: &[u8]) -> Msg {
        self.u8(b't').i32(v.len() as i32).raw(v)
    }
    fn bytes(&self) -> Bytes {
        Bytes::copy_from_slice(&self.0)
    }
}

fn decode(d: &mut Decoder, m: &Msg) -> Result<LogicalMessage, DecodeError> {
    d.decode(m.bytes())
}

/// Every strict prefix of `m` must fail to decode (messages are self-delimiting).
fn assert_prefixes_fail(d: &Decoder, m: &Msg) {
    for n in 0..m.0.len() {
        let mut after = d.clone();
        let r = after.decode(Bytes::copy_from_slice(&m.0[..n]));
        assert!(r.is_err(), "prefix of {n} bytes decoded: {r:?}");
        assert_eq!(&after, d, "a failed decode changed the decoder's state");
    }
}

fn stream_start(xid: u32) -> Msg {
    Msg::tag(b'S').u32(xid).u8(1)
}

fn stream_abort_v4(parallel_fields: bool) -> Msg {
    let m = Msg::tag(b'A').u32(700).u32(701);
    if parallel_fields {
        m.u64(0x0000_0002_0000_0010).i64(123_456_789)
    } else {
        m
    }
}

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

#[test]
fn tuple_column_kinds() {
    let m = Msg::tag(b'I')
        .u32(1)
        .u8(b'N')
        .u16(4)
        .u8(b'n')
        .u8(b'u')
        .text(b"abc")
        .u8(b'b')
        .i32(2)
        .raw(&[0, 1]);
    let input = m.bytes();
    let base = input.as_ptr();
    let LogicalMessage::Insert(i) = Decoder::new().decode(input).unwrap() else {
        panic!("not an Insert")
    };
    assert_eq!(
        i.tuple.columns,
        vec![
            Column::Null,
            Column::UnchangedToast,
            Column::Text(Bytes::from_static(b"abc")),
            Column::Binary(Bytes::from_static(&[0, 1])),
        ]
    );
    let Column::Text(t) = &i.tuple.columns[2] else {
        panic!("not text")
    };
    assert_eq!(
        t.as_ptr(),
        base.wrapping_add(1 + 4 + 1 + 2 + 1 + 1 + 1 + 4),
        "text is a slice of the input"
    );
    assert_prefixes_fail(&Decoder::new(), &m);
}

#[test]
fn malformed_tuples_are_typed_errors() {
    let ins = || Msg::tag(b'I').u32(1).u8(b'N');
    let mut d = Decoder::new();
    assert_eq!(
        decode(&mut d, &ins().u16(1).u8(b'x')),
        Err(DecodeError::UnknownColumnKind { kind: b'x' })
    );
    // 65535 columns announced, 3 bytes present: rejected before allocating.
    assert_eq!(
        decode(&mut d, &ins().u16(u16::MAX).raw(b"nnn")),
        Err(DecodeError::CountExceedsInput {
            reading: "tuple column count",
            count: 65535,
            remaining: 3
        })
    );
    assert_eq!(
        decode(&mut d, &ins().u16(1).u8(b't').i32(-1)),
        Err(DecodeError::NegativeLength {
            reading: "text column value",
            length: -1
        })
    );
    assert_eq!(
        decode(&mut d, &ins().u16(1).u8(b'b').i32(i32::MAX).raw(b"ab")),
        Err(DecodeError::LengthExceedsInput {
            reading: "binary column value",
            length: i32::MAX as u64,
            remaining: 2
        })
    );
    assert_eq!(
        decode(&mut d, &Msg::tag(b'I').u32(1).u8(b'K').u16(0)),
        Err(DecodeError::UnexpectedTupleMarker {
            message: "Insert",
            found: b'K',
            expected: "'N'"
        })
    );
}

#[test]
fn update_and_delete_old_tuple_markers() {
    let mut d = Decoder::new();
    let key = Msg::tag(b'U')
        .u32(5)
        .u8(b'K')
        .u16(1)
        .text(b"1")
        .u8(b'N')
        .u16(1)
        .text(b"2");
    let LogicalMessage::Update(u) = decode(&mut d, &key).unwrap() else {
        panic!("not an Update")
    };
    assert!(u.old_key.is_some() && u.old_tuple.is_none());
    assert_eq!(
        u.new_tuple.columns,
        vec![Column::Text(Bytes::from_static(b"2"))]
    );
    assert_prefixes_fail(&d, &key);

    let full = Msg::tag(b'U')
        .u32(5)
        .u8(b'O')
        .u16(1)
        .u8(b'n')
        .u8(b'N')
        .u16(1)
        .u8(b'u');
    let LogicalMessage::Update(u) = decode(&mut d, &full).unwrap() else {
        panic!("not an Update")
    };
    assert_eq!(u.old_tuple.unwrap().columns, vec![Column::Null]);
    assert!(u.old_key.is_none());

    let plain = Msg::tag(b'U').u32(5).u8(b'N').u16(0);
    let LogicalMessage::Update(u) = decode(&mut d, &plain).unwrap() else {
        panic!("not an Update")
    };
    assert!(u.old_key.is_none() && u.old_tuple.is_none());

    assert!(matches!(
        decode(&mut d, &Msg::tag(b'U').u32(5).u8(b'X').u16(0)),
        Err(DecodeError::UnexpectedTupleMarker {
            message: "Update",
            found: b'X',
            ..
        })
    ));
    assert!(matches!(
        decode(
            &mut d,
            &Msg::tag(b'U').u32(5).u8(b'K').u16(0).u8(b'K').u16(0)
        ),
        Err(DecodeError::UnexpectedTupleMarker {
            message: "Update",
            found: b'K',
            ..
        })
    ));

    let del = Msg::tag(b'D').u32(5).u8(b'O').u16(1).text(b"1");
    let LogicalMessage::Delete(x) = decode(&mut d, &del).unwrap() else {
        panic!("not a Delete")
    };
    assert!(x.old_tuple.is_some() && x.old_key.is_none());
    assert_prefixes_fail(&d, &del);
    assert!(matches!(
        decode(&mut d, &Msg::tag(b'D').u32(5).u8(b'N').u16(0)),
        Err(DecodeError::UnexpectedTupleMarker {
            message: "Delete",
            found: b'N',
            ..
        })
    ));
}

#[test]
fn relation_and_truncate_counts_are_bounded_by_the_input() {
    let mut d = Decoder::new();
    let rel = Msg::tag(b'R')
        .u32(16384)
        .str("")
        .str("t")
        .u8(b'd')
        .u16(2)
        .u8(1)
        .str("id")
        .u32(23)
        .i32(-1)
        .u8(0)
        .str("v")
        .u32(1043)
        .i32(36);
    let LogicalMessage::Relation(r) = decode(&mut d, &rel).unwrap() else {
        panic!("not a Relation")
    };
    assert_eq!(
        (
            r.xid,
            r.id,
            &r.namespace[..],
            &r.name[..],
            r.replica_identity
        ),
        (None, 16384, "", "t", b'd')
    );
    assert!(r.columns[0].is_key() && !r.columns[1].is_key());
    assert_eq!(
        (r.columns[1].type_oid, r.columns[1].type_modifier),
        (1043, 36)
    );
    assert_prefixes_fail(&d, &rel);

    let huge = Msg::tag(b'R')
        .u32(1)
        .str("")
        .str("t")
        .u8(b'd')
        .u16(u16::MAX)
        .raw(&[0; 30]);
    assert!(matches!(
        decode(&mut d, &huge),
        Err(DecodeError::CountExceedsInput {
            reading: "Relation column count",
            count: 65535,
            ..
        })
    ));

    let trunc = Msg::tag(b'T').u32(2).u8(3).u32(10).u32(11);
    assert_eq!(
        decode(&mut d, &trunc).unwrap(),
        LogicalMessage::Truncate(Truncate {
            xid: None,
            options: 3,
            relation_ids: vec![10, 11]
        })
    );
    assert!(matches!(
        decode(&mut d, &Msg::tag(b'T').u32(u32::MAX).u8(0).u32(1)),
        Err(DecodeError::CountExceedsInput {
            reading: "Truncate relation count",
            ..
        })
    ));
}

#[test]
fn transaction_and_two_phase_messages() {
    let mut d = Decoder::new();
    let cases: Vec<(Msg, LogicalMessage)> = vec![
        (
            Msg::tag(b'B').u64(0x10).i64(-1).u32(7),
            LogicalMessage::Begin(Begin {
                final_lsn: Lsn(0x10),
                commit_time: -1,
                xid: 7,
            }),
        ),
        (
            Msg::tag(b'C').u8(0).u64(0x10).u64(0x18).i64(5),
            LogicalMessage::Commit(Commit {
                flags: 0,
                commit_lsn: Lsn(0x10),
                end_lsn: Lsn(0x18),
                commit_time: 5,
            }),
        ),
        (
            Msg::tag(b'c').u32(7).u8(0).u64(1).u64(2).i64(3),
            LogicalMessage::StreamCommit(StreamCommit {
                xid: 7,
                flags: 0,
                commit_lsn: Lsn(1),
                end_lsn: Lsn(2),
                commit_time: 3,
            }),
        ),
        (
            Msg::tag(b'b').u64(1).u64(2).i64(3).u32(4).str("g1"),
            LogicalMessage::BeginPrepare(BeginPrepare {
                prepare_lsn: Lsn(1),
                end_lsn: Lsn(2),
                prepare_time: 3,
                xid: 4,
                gid: "g1".into(),
            }),
        ),
        (
            Msg::tag(b'P').u8(0).u64(1).u64(2).i64(3).u32(4).str("g1"),
            LogicalMessage::Prepare(Prepare {
                flags: 0,
                prepare_lsn: Lsn(1),
                end_lsn: Lsn(2),
                prepare_time: 3,
                xid: 4,
                gid: "g1".into(),
            }),
        ),
        (
            Msg::tag(b'K').u8(0).u64(1).u64(2).i64(3).u32(4).str("g1"),
            LogicalMessage::CommitPrepared(CommitPrepared {
                flags: 0,
                commit_lsn: Lsn(1),
                end_lsn: Lsn(2),
                commit_time: 3,
                xid: 4,
                gid: "g1".into(),
            }),
        ),
        (
            Msg::tag(b'r')
                .u8(0)
                .u64(1)
                .u64(2)
                .i64(3)
                .i64(4)
                .u32(5)
                .str("g1"),
            LogicalMessage::RollbackPrepared(RollbackPrepared {
                flags: 0,
                prepare_end_lsn: Lsn(1),
                rollback_end_lsn: Lsn(2),
                prepare_time: 3,
                rollback_time: 4,
                xid: 5,
                gid: "g1".into(),
            }),
        ),
        (
            Msg::tag(b'p').u8(0).u64(1).u64(2).i64(3).u32(4).str("g1"),
            LogicalMessage::StreamPrepare(StreamPrepare {
                flags: 0,
                prepare_lsn: Lsn(1),
                end_lsn: Lsn(2),
                prepare_time: 3,
                xid: 4,
                gid: "g1".into(),
            }),
        ),
    ];
    for (m, want) in cases {
        assert_eq!(decode(&mut d, &m).unwrap(), want);
        assert_prefixes_fail(&d, &m);
        assert_eq!(
            decode(&mut d, &Msg(m.0.clone()).u8(0)),
            Err(DecodeError::TrailingBytes {
                message: want.name(),
                count: 1
            })
        );
    }
}

#[test]
fn unknown_tags_and_empty_input() {
    let mut d = Decoder::new();
    assert!(matches!(
        d.decode(Bytes::new()),
        Err(DecodeError::UnexpectedEnd { .. })
    ));
    assert_eq!(
        d.decode(Bytes::from_static(b"Z")),
        Err(DecodeError::UnknownMessageTag { tag: b'Z' })
    );
    decode(&mut d, &stream_start(1)).unwrap();
    assert_eq!(
        d.decode(Bytes::from_static(b"Z")),
        Err(DecodeError::UnknownMessageTag { tag: b'Z' })
    );
}

#[test]
fn names_must_be_utf8() {
    let m = Msg::tag(b'Y').u32(1).str("public").raw(b"\xc3\x28").u8(0);
    assert_eq!(
        Decoder::new().decode(m.bytes()),
        Err(DecodeError::InvalidUtf8 {
            reading: "Type name"
        })
    );
}
