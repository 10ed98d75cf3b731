use super::*;

fn encoded(frame: &AMQPFrame) -> Vec<u8> {
    gen_frame(frame)(WriteContext::from(Vec::new()))
        .unwrap()
        .write
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
    let ack = encoded(&AMQPFrame::Method(
        1,
        AMQPClass::Basic(basic::AMQPMethod::Ack(basic::Ack {
            delivery_tag: 42,
            multiple: true,
        })),
    ));
    let mut two = ack.clone();
    two.extend_from_slice(&ack);
    for cut in 0..ack.len() {
        assert!(
            split_frame(&two[..cut], 0).unwrap().is_none(),
            "cut at {cut}"
        );
    }
    let (frame, used) = split_frame(&two, 0).unwrap().unwrap();
    assert_eq!(used, ack.len());
    assert!(matches!(
        frame,
        AMQPFrame::Method(
            1,
            AMQPClass::Basic(basic::AMQPMethod::Ack(basic::Ack {
                delivery_tag: 42,
                multiple: true
            }))
        )
    ));
}

#[test]
fn malformed_frames_are_errors() {
    let mut ack = encoded(&AMQPFrame::Method(
        1,
        AMQPClass::Basic(basic::AMQPMethod::Ack(basic::Ack {
            delivery_tag: 1,
            multiple: false,
        })),
    ));
    let last = ack.len() - 1;
    ack[last] = 0;
    assert!(split_frame(&ack, 0).is_err(), "no frame-end octet");
    let huge = [1u8, 0, 1, 0x7f, 0xff, 0xff, 0xff];
    assert!(
        split_frame(&huge, 0).is_err(),
        "a frame far above frame_max"
    );
    assert!(
        split_frame(b"AMQP\x00\x00\x09\x01", 0).is_err(),
        "a version refusal"
    );
    // A method frame whose payload is not a method.
    let junk = [1u8, 0, 1, 0, 0, 0, 3, 0xff, 0xff, 0xff, 0xCE];
    assert!(split_frame(&junk, 0).is_err());
}
