//! Relation, truncate, transaction and two-phase messages; unknown tags; names.

use super::*;

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
