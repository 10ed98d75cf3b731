//! The consumer-side checker: what a [`super::Consumer`] recorded, against what was
//! committed and what the `Sampler`(super::Sampler) sampled.

use std::collections::{HashMap, HashSet};

use super::Rec;

/// What the consumer saw.
#[derive(Debug, Default)]
pub struct Report {
    pub distinct: usize,
    pub duplicates: usize,
    pub markers_checked: usize,
    pub max_body: usize,
}

/// The consumer-side guarantees (panics on a violation):
/// - no loss: every committed row (`committed`, from the table) received;
/// - nothing else: no rolled-back row, nothing that is not in the table;
/// - order: first occurrences in commit order (commit LSN non-decreasing), and
///   within a transaction in insert order (seq increasing);
/// - the confirmed position never passed an unacked message (markers, see
///   `Sampler`).
///
/// With `by_last`, order is checked on last occurrences instead: a message the broker
/// returned (unroutable) is republished from the oldest unconfirmed one onwards, so
/// later messages of the same window can reach a queue before it does, and the
/// final, complete pass is what arrives in order.
pub fn check(recs: &[Rec], committed: &HashSet<String>, samples: &[u64], by_last: bool) -> Report {
    check_with(recs, committed, samples, by_last, false)
}

/// [`check`], for a quorum queue on a cluster when `redelivered_firsts` is set: a
/// message whose first delivery to the consumer was flagged redelivered is left out of
/// the order and marker checks (it must still arrive, and counts for loss and
/// duplicates). Why only there: when the node the consumer is connected to dies, the
/// quorum queue returns that consumer's unacknowledged deliveries — including ones
/// still on the wire, which the consumer never saw — and delivers them again from its
/// returns, ahead of or among messages delivered since, with the redelivered flag set.
/// Their first arrival is then late for reasons of the consumer's connection, not of
/// the relay's publishing: the relay had them confirmed, in order, before anything
/// after them. The flag marks exactly those deliveries; everything the relay published
/// once and the broker delivered once is still checked in full. Single-node tests
/// never set it.
pub fn check_with(
    recs: &[Rec],
    committed: &HashSet<String>,
    samples: &[u64],
    by_last: bool,
    redelivered_firsts: bool,
) -> Report {
    check_impl(
        recs,
        committed,
        samples,
        by_last,
        redelivered_firsts,
        &|_| 0,
    )
}

/// [`check`] for a relay that keeps order per aggregate only (`[rabbitmq] ordering =
/// "aggregate"`): the order is checked among the messages of each `group` (the
/// aggregate a message belongs to), loss, duplicates and the markers as in
/// [`check`]. The markers still hold across groups: the slot moves past a position
/// only once every channel had its messages below it acked, so they were in the
/// queue before the marker.
pub fn check_grouped(
    recs: &[Rec],
    committed: &HashSet<String>,
    samples: &[u64],
    by_last: bool,
    group: &dyn Fn(&Rec) -> u64,
) -> Report {
    check_impl(recs, committed, samples, by_last, false, group)
}

fn check_impl(
    recs: &[Rec],
    committed: &HashSet<String>,
    samples: &[u64],
    by_last: bool,
    redelivered_firsts: bool,
    group: &dyn Fn(&Rec) -> u64,
) -> Report {
    let mut first: HashMap<&str, usize> = HashMap::new();
    let mut firsts: Vec<&Rec> = Vec::new();
    let mut total = 0;
    let mut max_body = 0;
    for r in recs.iter().filter(|r| r.marker.is_none()) {
        total += 1;
        max_body = max_body.max(r.body_len);
        assert_ne!(r.kind, "rolledback", "a rolled-back row was published");
        assert!(
            committed.contains(&r.id),
            "message {} is not a committed row",
            r.id
        );
        if !first.contains_key(r.id.as_str()) {
            first.insert(&r.id, firsts.len());
            firsts.push(r);
        }
    }
    let missing = committed
        .iter()
        .filter(|id| !first.contains_key(id.as_str()))
        .count();
    assert_eq!(missing, 0, "{missing} committed rows never arrived");
    let mut ordered: Vec<&Rec> = firsts
        .iter()
        .copied()
        .filter(|r| !(redelivered_firsts && r.redelivered))
        .collect();
    if by_last {
        let mut last: HashMap<&str, usize> = HashMap::new();
        let msgs: Vec<&Rec> = recs.iter().filter(|r| r.marker.is_none()).collect();
        for (i, r) in msgs.iter().enumerate() {
            last.insert(&r.id, i);
        }
        ordered.sort_by_key(|r| last[r.id.as_str()]);
    }
    let mut groups: HashMap<u64, Vec<&Rec>> = HashMap::new();
    for r in ordered {
        groups.entry(group(r)).or_default().push(r);
    }
    for w in groups.values().flat_map(|g| g.windows(2)) {
        let (a, b) = (w[0], w[1]);
        assert!(
            a.commit_lsn < b.commit_lsn || (a.commit_lsn == b.commit_lsn && a.seq < b.seq),
            "occurrences out of order: {} (lsn {:X}, seq {}) before {} (lsn {:X}, seq {})",
            a.id,
            a.commit_lsn,
            a.seq,
            b.id,
            b.commit_lsn,
            b.seq
        );
    }
    // Markers: everything committed below the sample arrived before the marker.
    let mut markers_checked = 0;
    // suffix_min[i]: the oldest commit LSN among messages first received at i or later.
    let mut suffix_min = vec![u64::MAX; firsts.len() + 1];
    for i in (0..firsts.len()).rev() {
        let lsn = if redelivered_firsts && firsts[i].redelivered {
            u64::MAX
        } else {
            firsts[i].commit_lsn
        };
        suffix_min[i] = suffix_min[i + 1].min(lsn);
    }
    let mut received_firsts = 0usize;
    for r in recs {
        if let Some(i) = r.marker {
            let sample = samples[i];
            // The oldest transaction not yet (completely) received when the marker
            // arrived must not be below the sampled position.
            assert!(
                suffix_min[received_firsts] >= sample,
                "slot confirmed {sample:X} while a message of the transaction at {:X} had not \
                 been acked (it arrived after the marker)",
                suffix_min[received_firsts]
            );
            markers_checked += 1;
        } else if first.get(r.id.as_str()) == Some(&received_firsts) {
            received_firsts += 1;
        }
    }
    Report {
        distinct: firsts.len(),
        duplicates: total - firsts.len(),
        markers_checked,
        max_body,
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::*;

    fn rec(seq: i64, commit_lsn: u64) -> Rec {
        Rec {
            id: seq.to_string(),
            kind: "seq".into(),
            seq,
            commit_lsn,
            body_len: 0,
            marker: None,
            redelivered: false,
            at: Instant::now(),
        }
    }

    fn committed(recs: &[Rec]) -> HashSet<String> {
        recs.iter().map(|r| r.id.clone()).collect()
    }

    /// Two aggregates (odd and even seq) interleaved across commits: in order per
    /// aggregate, not globally.
    #[test]
    fn grouped_order_is_checked_within_each_group_only() {
        let recs = vec![rec(2, 20), rec(1, 10), rec(4, 40), rec(3, 30)];
        let by_parity = |r: &Rec| (r.seq % 2) as u64;
        let report = check_grouped(&recs, &committed(&recs), &[], false, &by_parity);
        assert_eq!(report.distinct, 4);
        let global = std::panic::catch_unwind(|| check(&recs, &committed(&recs), &[], false));
        assert!(global.is_err(), "the global order check must refuse this");
    }

    #[test]
    #[should_panic(expected = "out of order")]
    fn a_group_out_of_order_is_refused() {
        let recs = vec![rec(1, 10), rec(5, 50), rec(3, 30)];
        let by_parity = |r: &Rec| (r.seq % 2) as u64;
        check_grouped(&recs, &committed(&recs), &[], false, &by_parity);
    }
}
