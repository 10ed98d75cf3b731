use amq_protocol::frame::{gen_frame, AMQPContentHeader, AMQPFrame, WriteContext};
use amq_protocol::protocol::{basic, connection, AMQPClass, BasicProperties};
use amq_protocol::types::{AMQPValue, FieldTable};
use proptest::prelude::*;

use super::*;

fn encoded(frame: &AMQPFrame) -> Vec<u8> {
    gen_frame(frame)(WriteContext::from(Vec::new()))
        .unwrap()
        .write
}

fn ack(ch: u16, tag: u64, multiple: bool) -> AMQPFrame {
    AMQPFrame::Method(
        ch,
        AMQPClass::Basic(basic::AMQPMethod::Ack(basic::Ack {
            delivery_tag: tag,
            multiple,
        })),
    )
}

#[test]
fn the_hand_encoded_publish_is_the_codecs_publish() {
    let mut ours = Vec::new();
    encode_publish(&mut ours, 7, "orders", "order.created", true);
    let theirs = encoded(&AMQPFrame::Method(
        7,
        AMQPClass::Basic(basic::AMQPMethod::Publish(basic::Publish {
            exchange: "orders".into(),
            routing_key: "order.created".into(),
            mandatory: true,
            immediate: false,
        })),
    ));
    assert_eq!(ours, theirs);
    let mut body = Vec::new();
    encode_body(&mut body, 7, b"{\"a\":1}");
    assert_eq!(body, encoded(&AMQPFrame::Body(7, b"{\"a\":1}".to_vec())));
}

#[test]
fn frames_are_split_whole_and_only_whole() {
    let one = encoded(&ack(1, 42, true));
    let mut two = one.clone();
    two.extend_from_slice(&one);
    for cut in 0..one.len() {
        assert!(
            split_frame(&two[..cut], FRAME_MIN).unwrap().is_none(),
            "cut at {cut}"
        );
    }
    let (frame, used) = split_frame(&two, FRAME_MIN).unwrap().unwrap();
    assert_eq!(used, one.len());
    assert_eq!(frame, ack(1, 42, true));
}

#[test]
fn malformed_frames_are_errors() {
    let mut one = encoded(&ack(1, 1, false));
    let last = one.len() - 1;
    one[last] = 0;
    assert!(
        matches!(split_frame(&one, FRAME_MIN), Err(FrameError::Frame(_))),
        "no frame-end octet"
    );
    let huge = [1u8, 0, 1, 0x7f, 0xff, 0xff, 0xff];
    assert!(matches!(
        split_frame(&huge, DEFAULT_FRAME_MAX),
        Err(FrameError::Frame(_))
    ));
    assert_eq!(
        split_frame(b"AMQP\x00\x00\x09\x01", FRAME_MIN),
        Err(FrameError::Version)
    );
    // A method frame whose payload is not a method it takes.
    let junk = [1u8, 0, 1, 0, 0, 0, 4, 0xff, 0xff, 0xff, 0xff, 0xCE];
    assert!(matches!(
        split_frame(&junk, FRAME_MIN),
        Err(FrameError::NotImplemented(_))
    ));
    let unknown_type = [9u8, 0, 1, 0, 0, 0, 0, 0xCE];
    assert!(matches!(
        split_frame(&unknown_type, FRAME_MIN),
        Err(FrameError::Frame(_))
    ));
}

#[test]
fn frames_over_the_agreed_size_are_refused_before_they_are_read() {
    // Before tune: 4,096 bytes, whatever the frame says.
    let mut big = vec![3u8, 0, 1];
    big.extend_from_slice(&5000u32.to_be_bytes());
    assert!(matches!(
        split_frame(&big, FRAME_MIN),
        Err(FrameError::Frame(_))
    ));
    // After tune, the agreed size is the limit (frame overhead included).
    let body = AMQPFrame::Body(1, vec![7; 8000]);
    let bytes = encoded(&body);
    assert!(split_frame(&bytes, 8000).is_err());
    assert_eq!(split_frame(&bytes, 8008).unwrap().unwrap().0, body);
}

#[test]
fn methods_a_publisher_never_receives_are_refused_unparsed() {
    let publish = encoded(&AMQPFrame::Method(
        1,
        AMQPClass::Basic(basic::AMQPMethod::Publish(basic::Publish {
            exchange: "x".into(),
            routing_key: "y".into(),
            mandatory: false,
            immediate: false,
        })),
    ));
    let error = split_frame(&publish, FRAME_MIN).unwrap_err();
    assert_eq!(error.code(), 540, "{error}");
    assert!(split_frame(&encoded(&ack(1, 1, false)), FRAME_MIN).is_ok());
}

/// A table nested `depth` deep (a table holding a table ...).
fn nested(depth: usize) -> FieldTable {
    let mut table = FieldTable::default();
    table.insert("leaf".into(), AMQPValue::Boolean(true));
    for _ in 1..depth {
        let mut outer = FieldTable::default();
        outer.insert("t".into(), AMQPValue::FieldTable(table));
        table = outer;
    }
    table
}

fn start_with(properties: FieldTable) -> Vec<u8> {
    encoded(&AMQPFrame::Method(
        0,
        AMQPClass::Connection(connection::AMQPMethod::Start(connection::Start {
            version_major: 0,
            version_minor: 9,
            server_properties: properties,
            mechanisms: "PLAIN".into(),
            locales: "en_US".into(),
        })),
    ))
}

fn header_with(headers: FieldTable) -> Vec<u8> {
    encoded(&AMQPFrame::Header(
        2,
        AMQPContentHeader {
            class_id: 60,
            body_size: 0,
            properties: BasicProperties::default()
                .with_content_type("a".into())
                .with_headers(headers),
        },
    ))
}

#[test]
fn tables_nested_deeper_than_the_bound_are_a_syntax_error() {
    assert!(split_frame(&start_with(nested(MAX_TABLE_DEPTH)), FRAME_MIN).is_ok());
    let deep = split_frame(&start_with(nested(MAX_TABLE_DEPTH + 1)), FRAME_MIN).unwrap_err();
    assert_eq!(deep.code(), 502, "{deep}");
    assert!(split_frame(&header_with(nested(MAX_TABLE_DEPTH)), DEFAULT_FRAME_MAX).is_ok());
    assert!(split_frame(&header_with(nested(MAX_TABLE_DEPTH + 1)), DEFAULT_FRAME_MAX).is_err());
    // Arrays nest too.
    let mut value = AMQPValue::Boolean(true);
    for _ in 0..MAX_TABLE_DEPTH + 1 {
        value = AMQPValue::FieldArray(vec![value].into());
    }
    let mut table = FieldTable::default();
    table.insert("a".into(), value);
    assert!(split_frame(&header_with(table), DEFAULT_FRAME_MAX).is_err());
}

#[test]
fn a_table_deep_enough_to_overflow_the_codec_is_refused_without_recursing() {
    // 18,000 levels of tables, written by hand (the codec itself would recurse to
    // encode them): about 5 bytes a level inside a 128 KiB frame.
    let depth = 18_000;
    let mut table = Vec::new();
    for _ in 0..depth {
        table.extend_from_slice(&0u32.to_be_bytes()); // length, patched below
        table.push(1);
        table.push(b't');
        table.push(b'F');
    }
    table.extend_from_slice(&0u32.to_be_bytes());
    // Patch the lengths from the innermost out.
    let level = 7;
    for i in (0..depth).rev() {
        let at = i * level;
        let len = (table.len() - at - 4) as u32;
        table[at..at + 4].copy_from_slice(&len.to_be_bytes());
    }
    let mut payload = vec![0, 10, 0, 10, 0, 9];
    payload.extend_from_slice(&table);
    let mut frame = vec![1u8, 0, 0];
    frame.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    frame.extend_from_slice(&payload);
    frame.push(0xCE);
    let error = split_frame(&frame, DEFAULT_FRAME_MAX).unwrap_err();
    assert_eq!(error.code(), 502, "{error}");
}

#[test]
fn the_frame_size_is_clamped() {
    assert_eq!(
        negotiate_frame_max(None, 0),
        DEFAULT_FRAME_MAX,
        "a broker without a limit"
    );
    assert_eq!(
        negotiate_frame_max(None, u32::MAX),
        DEFAULT_FRAME_MAX,
        "4 GiB proposed"
    );
    assert_eq!(negotiate_frame_max(None, 16_384), 16_384);
    assert_eq!(
        negotiate_frame_max(None, 100),
        FRAME_MIN,
        "below the spec's minimum"
    );
    assert_eq!(negotiate_frame_max(Some(0), u32::MAX), DEFAULT_FRAME_MAX);
    assert_eq!(
        negotiate_frame_max(Some(1 << 20), 0),
        1 << 20,
        "the URL asks for more"
    );
    assert_eq!(negotiate_frame_max(Some(1 << 20), 1 << 19), 1 << 19);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(3000))]

    /// Any bytes: an error or a frame, never a panic or a read past the input.
    #[test]
    fn split_frame_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..300), max in 0u32..70_000) {
        if let Ok(Some((_, used))) = split_frame(&bytes, max) {
            prop_assert!(used <= bytes.len());
        }
    }

    /// Valid frames with random damage: never a panic.
    #[test]
    fn damaged_frames_never_panic(tag in any::<u64>(), at in any::<prop::sample::Index>(), byte in any::<u8>(), headers in 0usize..4) {
        let mut table = FieldTable::default();
        for i in 0..headers {
            table.insert(format!("h{i}").into(), AMQPValue::LongString(format!("v{tag}").into()));
        }
        for mut bytes in [encoded(&ack(3, tag, true)), header_with(table), start_with(nested(3))] {
            let i = at.index(bytes.len());
            bytes[i] = byte;
            let _ = split_frame(&bytes, DEFAULT_FRAME_MAX);
        }
    }
}
