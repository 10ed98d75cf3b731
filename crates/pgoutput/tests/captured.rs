//! The decoder on bytes captured from a real Postgres 15 (see `fixtures/capture.sh`
//! for the SQL behind each fixture).
//! size: the v1 text test walks one capture in order, reusing the relations and type it found
#![allow(clippy::unwrap_used)]

mod support;

use bytes::Bytes;
use pgoutput::logical::{Column, LogicalMessage as L, Relation, TupleData};
use pgoutput::replication::{parse_copy_data, ReplicationMessage};
use pgoutput::Lsn;

fn text(s: &str) -> Column {
    Column::Text(Bytes::copy_from_slice(s.as_bytes()))
}

fn tags(messages: &[L]) -> String {
    messages
        .iter()
        .map(|m| match m {
            L::Begin(_) => 'B',
            L::Commit(_) => 'C',
            L::Origin(_) => 'O',
            L::Relation(_) => 'R',
            L::Type(_) => 'Y',
            L::Insert(_) => 'I',
            L::Update(_) => 'U',
            L::Delete(_) => 'D',
            L::Truncate(_) => 'T',
            L::Message(_) => 'M',
            L::StreamStart(_) => 'S',
            L::StreamStop => 'E',
            L::StreamCommit(_) => 'c',
            L::StreamAbort(_) => 'A',
            L::BeginPrepare(_) => 'b',
            L::Prepare(_) => 'P',
            L::CommitPrepared(_) => 'K',
            L::RollbackPrepared(_) => 'r',
            L::StreamPrepare(_) => 'p',
        })
        .collect()
}

fn relations(messages: &[L]) -> Vec<&Relation> {
    messages
        .iter()
        .filter_map(|m| match m {
            L::Relation(r) => Some(r),
            _ => None,
        })
        .collect()
}

fn relation<'a>(messages: &'a [L], name: &str) -> &'a Relation {
    relations(messages)
        .into_iter()
        .find(|r| r.name == name)
        .unwrap_or_else(|| panic!("no Relation {name}"))
}

fn cols(t: &TupleData) -> &[Column] {
    &t.columns
}

/// The v1 fixtures hold the same transactions; these are their message types.
const V1_TAGS: &str = "BYRIIC BUC BUC BDC BIC BUC BRIC BUC BDC BRIC BRIC BRRTC BMRIC M BOIC";

#[test]
fn v1_text_decodes_every_message_type_of_ordinary_transactions() {
    let m = support::decode_all(&support::parse(support::V1_TEXT));
    assert_eq!(tags(&m), V1_TAGS.replace(' ', ""));

    // Begin and Commit agree; the end LSN (the position to confirm) is past the commit.
    let mut open = None;
    for msg in &m {
        match msg {
            L::Begin(b) => open = Some(b.clone()),
            L::Commit(c) => {
                let b = open.take().expect("Commit without Begin");
                assert_eq!(b.final_lsn, c.commit_lsn);
                assert_eq!(b.commit_time, c.commit_time);
                assert!(c.end_lsn > c.commit_lsn);
                assert_eq!(c.flags, 0);
            }
            _ => {}
        }
    }

    // A user-defined enum: Type before the Relation that uses it.
    let L::Type(ty) = &m[1] else {
        panic!("{:?}", m[1])
    };
    assert_eq!(
        (ty.xid, &ty.namespace[..], &ty.name[..]),
        (None, "public", "mood")
    );
    let item = relation(&m, "item");
    assert_eq!(
        (item.xid, &item.namespace[..], item.replica_identity),
        (None, "public", b'd')
    );
    let names: Vec<_> = item.columns.iter().map(|c| c.name.as_str()).collect();
    assert_eq!(names, ["id", "label", "qty", "feeling", "blob"]);
    let types: Vec<_> = item.columns.iter().map(|c| c.type_oid).collect();
    assert_eq!(types, [23, 25, 23, ty.id, 25]);
    let keys: Vec<_> = item.columns.iter().map(|c| c.is_key()).collect();
    assert_eq!(keys, [true, false, false, false, false]);
    assert!(item.columns.iter().all(|c| c.type_modifier == -1));

    // Inserts, with NULLs.
    let L::Insert(a) = &m[3] else {
        panic!("{:?}", m[3])
    };
    let L::Insert(b) = &m[4] else {
        panic!("{:?}", m[4])
    };
    assert_eq!(a.relation_id, item.id);
    assert_eq!(
        cols(&a.tuple),
        [
            text("1"),
            text("one"),
            text("10"),
            text("happy"),
            Column::Null
        ]
    );
    assert_eq!(
        cols(&b.tuple),
        [
            text("2"),
            Column::Null,
            Column::Null,
            Column::Null,
            Column::Null
        ]
    );

    let updates: Vec<_> = m
        .iter()
        .filter_map(|x| if let L::Update(u) = x { Some(u) } else { None })
        .collect();
    let deletes: Vec<_> = m
        .iter()
        .filter_map(|x| if let L::Delete(d) = x { Some(d) } else { None })
        .collect();
    assert_eq!((updates.len(), deletes.len()), (4, 2));
    // REPLICA IDENTITY DEFAULT, key unchanged: no old tuple.
    assert!(updates[0].old_key.is_none() && updates[0].old_tuple.is_none());
    assert_eq!(cols(&updates[0].new_tuple)[2], text("11"));
    // Key changed: the old key ('K') with the key column set.
    let old_key = updates[1].old_key.as_ref().expect("old key");
    assert_eq!(cols(old_key)[0], text("2"));
    assert_eq!(cols(&updates[1].new_tuple)[0], text("3"));
    assert_eq!(
        cols(deletes[0].old_key.as_ref().expect("old key"))[0],
        text("3")
    );
    assert!(deletes[0].old_tuple.is_none());
    // Unchanged TOAST value in an update.
    assert_eq!(
        cols(&updates[2].new_tuple),
        [
            text("4"),
            text("toasted"),
            text("2"),
            text("ok"),
            Column::UnchangedToast
        ]
    );
    // REPLICA IDENTITY FULL: the whole old row ('O').
    let full = relation(&m, "item_full");
    assert_eq!(full.replica_identity, b'f');
    assert_eq!(updates[3].relation_id, full.id);
    assert_eq!(
        cols(updates[3].old_tuple.as_ref().expect("old tuple")),
        [text("1"), text("full"), text("1")]
    );
    assert!(updates[3].old_key.is_none());
    assert_eq!(
        cols(deletes[1].old_tuple.as_ref().expect("old tuple")),
        [text("1"), text("full"), text("2")]
    );

    // TRUNCATE parent, child RESTART IDENTITY CASCADE.
    let L::Truncate(t) = m.iter().find(|x| matches!(x, L::Truncate(_))).unwrap() else {
        unreachable!()
    };
    let (parent, child) = (relation(&m, "parent"), relation(&m, "child"));
    assert_eq!(t.options, 1 | 2);
    let mut ids = t.relation_ids.clone();
    ids.sort_unstable();
    let mut want = vec![parent.id, child.id];
    want.sort_unstable();
    assert_eq!(ids, want);

    // Logical decoding messages: transactional inside its transaction, the other alone.
    let msgs: Vec<_> = m
        .iter()
        .enumerate()
        .filter_map(|(i, x)| {
            if let L::Message(x) = x {
                Some((i, x))
            } else {
                None
            }
        })
        .collect();
    assert_eq!(msgs.len(), 2);
    let (i, tx) = msgs[0];
    assert!(matches!(m[i - 1], L::Begin(_)));
    assert_eq!(
        (tx.xid, tx.flags, &tx.prefix[..], &tx.content[..]),
        (None, 1, "capture", &b"transactional hello"[..])
    );
    let (i, non) = msgs[1];
    assert!(matches!(m[i - 1], L::Commit(_)) && matches!(m[i + 1], L::Begin(_)));
    assert_eq!(
        (non.flags, &non.prefix[..], &non.content[..]),
        (0, "capture", &[0x00, 0xff, 0x01][..])
    );
    assert!(non.lsn > tx.lsn);

    // Origin, right after Begin.
    let L::Origin(o) = &m[m.len() - 3] else {
        panic!("{:?}", m[m.len() - 3])
    };
    assert!(matches!(m[m.len() - 4], L::Begin(_)));
    assert_eq!(o.name, "pgoutput_capture_origin");
    assert_eq!(o.commit_lsn, "0/ABCDEF".parse::<Lsn>().unwrap());
}

#[test]
fn v1_binary_tuples_are_binary_columns() {
    let m = support::decode_all(&support::parse(support::V1_BINARY));
    assert_eq!(tags(&m), V1_TAGS.replace(' ', ""));
    let bin = |b: &[u8]| Column::Binary(Bytes::copy_from_slice(b));
    let L::Insert(a) = &m[3] else {
        panic!("{:?}", m[3])
    };
    // int4 send format is 4 big-endian bytes; text and enum send their characters.
    assert_eq!(
        cols(&a.tuple),
        [
            bin(&[0, 0, 0, 1]),
            bin(b"one"),
            bin(&[0, 0, 0, 10]),
            bin(b"happy"),
            Column::Null
        ]
    );
    for msg in &m {
        let tuples: Vec<&TupleData> = match msg {
            L::Insert(i) => vec![&i.tuple],
            L::Update(u) => [u.old_key.as_ref(), u.old_tuple.as_ref(), Some(&u.new_tuple)]
                .into_iter()
                .flatten()
                .collect(),
            L::Delete(d) => [d.old_key.as_ref(), d.old_tuple.as_ref()]
                .into_iter()
                .flatten()
                .collect(),
            _ => vec![],
        };
        for c in tuples.iter().flat_map(|t| &t.columns) {
            assert!(
                !matches!(c, Column::Text(_)),
                "text column in binary mode: {msg:?}"
            );
        }
    }
}

#[test]
fn v2_stream_tracks_stream_blocks_commits_and_aborts() {
    let m = support::decode_all(&support::parse(support::V2_STREAM));
    let mut current: Option<u32> = None;
    let mut seen_xids = Vec::new();
    let (mut inserts, mut commits, mut aborts) = (0, Vec::new(), Vec::new());
    // Inside a block, changes carry the xid of the (sub)transaction that made them:
    // the Stream Start xid, or one of its subtransactions.
    let mut subxids = std::collections::BTreeSet::new();
    let mut check_xid = |xid: Option<u32>, current: Option<u32>| {
        let (Some(xid), Some(top)) = (xid, current) else {
            panic!("change outside a stream block or without xid: {xid:?} in {current:?}")
        };
        if xid != top {
            subxids.insert(xid);
        }
    };
    for msg in &m {
        match msg {
            L::StreamStart(s) => {
                assert!(current.is_none());
                assert_eq!(
                    s.first_segment,
                    !seen_xids.contains(&s.xid),
                    "first_segment of {}",
                    s.xid
                );
                seen_xids.push(s.xid);
                current = Some(s.xid);
            }
            L::StreamStop => current = None,
            L::Relation(r) => check_xid(r.xid, current),
            L::Type(t) => check_xid(t.xid, current),
            L::Insert(i) => {
                check_xid(i.xid, current);
                inserts += 1;
            }
            L::Update(u) => check_xid(u.xid, current),
            L::Delete(d) => check_xid(d.xid, current),
            L::Truncate(t) => check_xid(t.xid, current),
            L::Message(x) => {
                check_xid(x.xid, current);
                assert_eq!((x.flags, &x.content[..]), (1, &b"inside a stream"[..]));
            }
            L::StreamCommit(c) => {
                assert!(current.is_none());
                assert!(c.end_lsn > c.commit_lsn);
                commits.push(c.xid);
            }
            L::StreamAbort(a) => {
                assert!(current.is_none());
                assert_eq!((a.abort_lsn, a.abort_time), (None, None));
                aborts.push(a.clone());
            }
            other => panic!("unexpected message in a streaming-only fixture: {other:?}"),
        }
    }
    assert!(current.is_none());
    // The committed 1500-row transaction, streamed in several blocks, then the
    // transaction with a rolled-back savepoint.
    assert_eq!(commits.len(), 2);
    assert!(
        seen_xids.iter().filter(|&&x| x == commits[0]).count() > 1,
        "first transaction streamed in one block"
    );
    assert!(inserts >= 1500);
    // A whole transaction aborted (subxid == xid), then a subtransaction (subxid != xid)
    // of the transaction that commits last.
    assert_eq!(aborts.len(), 2);
    assert_eq!(aborts[0].xid, aborts[0].subxid);
    assert_ne!(aborts[1].xid, aborts[1].subxid);
    assert_eq!(aborts[1].xid, commits[1]);
    // Subtransaction xids seen on changes: the rolled-back savepoint's (aborted), and
    // the next one, because ROLLBACK TO SAVEPOINT re-establishes the savepoint and the
    // final insert runs in a new subtransaction of the committed transaction.
    let subxids: Vec<u32> = subxids.into_iter().collect();
    assert_eq!(subxids.len(), 2, "{subxids:?}");
    assert_eq!(subxids[0], aborts[1].subxid);
    let last_insert = m
        .iter()
        .rev()
        .find_map(|x| if let L::Insert(i) = x { Some(i) } else { None })
        .unwrap();
    assert_eq!(last_insert.xid, Some(subxids[1]));
    let truncs = m.iter().filter(|x| matches!(x, L::Truncate(_))).count();
    assert_eq!(truncs, 1);
}

#[test]
fn v3_two_phase_prepare_commit_rollback_and_stream_prepare() {
    let m = support::decode_all(&support::parse(support::V3_TWOPHASE));
    let t = tags(&m);
    assert!(t.starts_with("bRIPKbIPrS"), "{}", &t[..12]);
    assert!(t.ends_with("EpK"), "{}", &t[t.len() - 3..]);

    let L::BeginPrepare(bp) = &m[0] else { panic!() };
    let L::Prepare(p) = &m[3] else { panic!() };
    let L::CommitPrepared(cp) = &m[4] else {
        panic!()
    };
    assert_eq!(bp.gid, "capture_gid_commit");
    assert_eq!(
        (p.xid, &p.gid[..], p.prepare_lsn, p.end_lsn),
        (bp.xid, &bp.gid[..], bp.prepare_lsn, bp.end_lsn)
    );
    assert_eq!((cp.xid, &cp.gid[..]), (bp.xid, "capture_gid_commit"));
    assert!(cp.end_lsn > cp.commit_lsn && cp.commit_lsn > p.end_lsn);

    let L::BeginPrepare(bp2) = &m[5] else {
        panic!()
    };
    let L::RollbackPrepared(rp) = &m[8] else {
        panic!()
    };
    assert_eq!((rp.xid, &rp.gid[..]), (bp2.xid, "capture_gid_rollback"));
    assert_eq!(rp.prepare_end_lsn, bp2.end_lsn);
    assert!(rp.rollback_end_lsn > rp.prepare_end_lsn);
    assert!(rp.rollback_time >= rp.prepare_time);

    let L::StreamStart(s) = &m[9] else { panic!() };
    let n = m.len();
    let L::StreamPrepare(sp) = &m[n - 2] else {
        panic!()
    };
    let L::CommitPrepared(cp3) = &m[n - 1] else {
        panic!()
    };
    assert_eq!((sp.xid, &sp.gid[..]), (s.xid, "capture_gid_streamed"));
    assert_eq!((cp3.xid, &cp3.gid[..]), (s.xid, "capture_gid_streamed"));
    assert!(sp.end_lsn > sp.prepare_lsn);
    for msg in &m[9..n - 2] {
        if let L::Insert(i) = msg {
            assert_eq!(i.xid, Some(s.xid));
        }
    }
}

#[test]
fn captured_messages_decode_inside_xlogdata_frames() {
    for (name, messages) in support::all() {
        let plain = support::decode_all(&messages);
        let mut d = pgoutput::logical::Decoder::new();
        for (msg, want) in messages.iter().zip(&plain) {
            let mut frame = vec![b'w'];
            frame.extend_from_slice(&[
                0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 8, 0, 0, 0, 0, 0, 0, 0, 9,
            ]);
            frame.extend_from_slice(msg);
            let ReplicationMessage::XLogData(x) = parse_copy_data(Bytes::from(frame)).unwrap()
            else {
                panic!("{name}: not XLogData")
            };
            assert_eq!(
                (x.wal_start.0, x.wal_end.0, x.send_time),
                (1 << 32, (1 << 32) | 8, 9)
            );
            assert_eq!(&d.decode(x.data).unwrap(), want, "{name}");
        }
    }
}
