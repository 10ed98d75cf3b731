//! Robustness: the decoder never panics, rejects every truncation, and leaves its
//! state unchanged when it fails. Seeds are the captured fixtures (the committed
//! corpus); proptest mutates them and also feeds random bytes. A failing case is
//! saved under `proptest-regressions/` and must be committed with its fix.
#![allow(clippy::unwrap_used)]

mod support;

use std::collections::HashMap;
use std::sync::OnceLock;

use bytes::Bytes;
use pgoutput::logical::Decoder;
use pgoutput::replication::parse_copy_data;
use proptest::prelude::*;
use proptest::sample::Index;

/// Decodes `data` and checks the contract: on error the decoder is unchanged.
fn decode_checked(d: &Decoder, data: &[u8]) -> bool {
    let mut after = d.clone();
    let ok = after.decode(Bytes::copy_from_slice(data)).is_ok();
    if !ok {
        assert_eq!(&after, d, "a failed decode changed the decoder's state");
    }
    ok
}

/// Up to three messages of each type from each fixture, with the decoder state each
/// one is decoded in: a small, varied seed corpus.
fn corpus() -> &'static [(Decoder, Bytes)] {
    static CORPUS: OnceLock<Vec<(Decoder, Bytes)>> = OnceLock::new();
    CORPUS.get_or_init(|| {
        let mut out = Vec::new();
        for (name, messages) in support::all() {
            let mut per_tag: HashMap<(&str, u8, bool), usize> = HashMap::new();
            for (d, m) in support::with_states(&messages) {
                let n = per_tag.entry((name, m[0], d.in_stream())).or_default();
                *n += 1;
                if *n <= 3 {
                    out.push((d, m));
                }
            }
        }
        out
    })
}

fn decoder(in_stream: bool, parallel: bool) -> Decoder {
    let mut d = Decoder::with_parallel_streaming(parallel);
    if in_stream {
        d.decode(Bytes::from_static(&[b'S', 0, 0, 0, 1, 1]))
            .unwrap();
    }
    d
}

#[test]
fn corpus_covers_every_captured_message_type() {
    let mut tags: Vec<char> = corpus().iter().map(|(_, m)| m[0] as char).collect();
    tags.sort_unstable();
    tags.dedup();
    let tags: String = tags.into_iter().collect();
    // Every pgoutput message type Postgres 15 produces (all but v4-only fields).
    assert_eq!(tags, "ABCDEIKMOPRSTUYbcpr");
}

#[test]
fn every_strict_prefix_of_every_captured_message_is_an_error() {
    for (name, messages) in support::all() {
        for (i, (d, m)) in support::with_states(&messages).into_iter().enumerate() {
            for n in 0..m.len() {
                assert!(
                    !decode_checked(&d, &m[..n]),
                    "{name} message {i}: prefix of {n} bytes decoded"
                );
            }
        }
    }
}

#[test]
fn every_single_bit_flip_of_the_corpus_is_handled() {
    for (d, m) in corpus() {
        let mut buf = m.to_vec();
        for byte in 0..buf.len() {
            for bit in 0..8 {
                buf[byte] ^= 1 << bit;
                decode_checked(d, &buf);
                buf[byte] ^= 1 << bit;
            }
        }
    }
}

#[derive(Debug, Clone)]
enum Mutation {
    FlipBit(Index, u8),
    Overwrite(Index, u8),
    Insert(Index, u8),
    Remove(Index),
    Truncate(Index),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (any::<Index>(), 0u8..8).prop_map(|(i, b)| Mutation::FlipBit(i, b)),
        (any::<Index>(), any::<u8>()).prop_map(|(i, v)| Mutation::Overwrite(i, v)),
        (any::<Index>(), any::<u8>()).prop_map(|(i, v)| Mutation::Insert(i, v)),
        any::<Index>().prop_map(Mutation::Remove),
        any::<Index>().prop_map(Mutation::Truncate),
    ]
}

fn apply(buf: &mut Vec<u8>, m: &Mutation) {
    if buf.is_empty() {
        if let Mutation::Insert(_, v) = m {
            buf.push(*v);
        }
        return;
    }
    match m {
        Mutation::FlipBit(i, b) => {
            let at = i.index(buf.len());
            buf[at] ^= 1 << b;
        }
        Mutation::Overwrite(i, v) => {
            let at = i.index(buf.len());
            buf[at] = *v;
        }
        Mutation::Insert(i, v) => {
            let at = i.index(buf.len() + 1);
            buf.insert(at, *v);
        }
        Mutation::Remove(i) => {
            buf.remove(i.index(buf.len()));
        }
        Mutation::Truncate(i) => buf.truncate(i.index(buf.len())),
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2048, ..ProptestConfig::default() })]

    #[test]
    fn random_bytes_never_panic(
        data in prop::collection::vec(any::<u8>(), 0..256),
        in_stream: bool,
        parallel: bool,
    ) {
        decode_checked(&decoder(in_stream, parallel), &data);
    }

    #[test]
    fn random_bytes_after_a_known_tag_never_panic(
        tag in prop::sample::select(b"BCORYIUDTMSEcAbPKrp".to_vec()),
        data in prop::collection::vec(any::<u8>(), 0..128),
        in_stream: bool,
        parallel: bool,
    ) {
        let mut buf = vec![tag];
        buf.extend_from_slice(&data);
        decode_checked(&decoder(in_stream, parallel), &buf);
    }

    #[test]
    fn mutated_captured_messages_never_panic(
        pick: Index,
        mutations in prop::collection::vec(mutation(), 1..5),
    ) {
        let (d, m) = &corpus()[pick.index(corpus().len())];
        let mut buf = m.to_vec();
        for mu in &mutations {
            apply(&mut buf, mu);
        }
        decode_checked(d, &buf);
    }

    #[test]
    fn truncated_captured_messages_are_errors(pick: Index, cut: Index) {
        let (d, m) = &corpus()[pick.index(corpus().len())];
        let n = cut.index(m.len());
        prop_assert!(!decode_checked(d, &m[..n]), "prefix of {} bytes decoded", n);
    }

    #[test]
    fn random_copy_data_never_panics(
        tag in prop_oneof![Just(b'w'), Just(b'k'), any::<u8>()],
        data in prop::collection::vec(any::<u8>(), 0..64),
    ) {
        let mut buf = vec![tag];
        buf.extend_from_slice(&data);
        let r = parse_copy_data(Bytes::from(buf));
        let complete = match tag { b'w' => data.len() >= 24, b'k' => data.len() == 17, _ => false };
        prop_assert_eq!(r.is_ok(), complete);
    }

    #[test]
    fn captured_message_frames_with_truncated_headers_are_errors(pick: Index, cut in 0usize..25) {
        let (_, m) = &corpus()[pick.index(corpus().len())];
        let mut frame = vec![b'w'];
        frame.extend_from_slice(&[7; 24]);
        frame.extend_from_slice(m);
        prop_assert!(parse_copy_data(Bytes::copy_from_slice(&frame[..cut])).is_err());
    }
}
