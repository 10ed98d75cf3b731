//! Tuples: column kinds, malformed tuples, old-tuple markers.

use super::*;

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
