//! Operator actions (SPEC §1, §8): a paused queue is skipped by claims and wake-ups; a
//! pending row is run now, rescheduled or deleted by id.

use super::*;

/// SPEC §1, §8 (v2): a paused queue's due rows and expired leases are not claimed and its
/// deadlines and leases do not wake a worker; publishing goes on; resume restores both and
/// wakes the workers.
async fn a_paused_queue_is_skipped_by_claims_and_wakeups<H: Harness>(h: &H) {
    let mut hints = h
        .store()
        .wakeups()
        .await
        .unwrap()
        .expect("both stores push hints");
    publish(h, plain(b"a", 0)).await;
    publish(h, plain(b"b", 0)).await;
    assert_eq!(ids(&claim(h, &[Q], 1).await), [1]);
    h.advance(TTL + secs(1)).await; // the lease of row 1 expired at 30 s
    publish(h, Message::new(Q2, b"c")).await;
    assert!(h.pause(Q, true).await.unwrap(), "paused by this call");
    assert!(!h.pause(Q, true).await.unwrap(), "already paused");
    assert!(!h.pause(Q3, false).await.unwrap(), "Q3 was not paused");
    assert_eq!(
        publish(h, plain(b"d", 0)).await,
        Published::Inserted { id: 4 },
        "publishing goes on"
    );
    assert_eq!(ids(&claim(h, &[Q, Q2], 10).await), [3], "only Q2's row");
    let queues = [Q.to_owned(), Q2.to_owned()];
    let w = h
        .store()
        .next_wakeup(ClaimRequest::new(&queues, 10, TTL))
        .await
        .unwrap();
    assert_eq!(w.deadline, None, "Q's due rows do not wake a worker");
    assert_eq!(w.upcoming, None);
    assert_eq!(w.lease_expiry, Some(at(61)), "Q2's lease, not Q's");

    assert!(h.pause(Q, false).await.unwrap(), "resumed by this call");
    assert!(!h.pause(Q, false).await.unwrap(), "not paused any more");
    let mut got = ids(&claim(h, &[Q, Q2], 10).await);
    got.sort_unstable();
    assert_eq!(got, [1, 2, 4], "the expired lease and both due rows");
    // The hints: the publishes at 0 s (two), 31 s (Q2, then Q's while paused) and the
    // resume's, due now.
    let hint = |queue: &str, at: DateTime<Utc>| Wakeup::Published {
        queue: queue.to_owned(),
        at,
    };
    let want = vec![
        hint(Q, at(0)),
        hint(Q, at(0)),
        hint(Q2, at(31)),
        hint(Q, at(31)),
        hint(Q, at(31)),
    ];
    let seen = next_hints(&mut hints, want.len()).await;
    assert_eq!(seen, want);
    // Bad names are refused before any SQL.
    assert_eq!(invalid_field(h.pause("", true).await.unwrap_err()), "queue");
}

/// SPEC §8 (v2): run now, reschedule and delete act on a pending row by id; a leased row
/// and an unknown id change nothing.
async fn pending_rows_are_run_now_rescheduled_or_deleted_by_id<H: Harness>(h: &H) {
    publish(h, plain(b"a", 100)).await;
    publish(h, plain(b"b", 100)).await;
    publish(h, plain(b"c", 0)).await;
    let leased = claim(h, &[Q], 1).await;
    assert_eq!(ids(&leased), [3]);
    h.advance(secs(5)).await;

    assert_eq!(
        h.act(1, Some(Schedule::now())).await.unwrap(),
        RowAction::Rescheduled {
            next_attempt_at: at(5)
        }
    );
    assert_eq!(
        h.act(2, Some(secs(500).into())).await.unwrap(),
        RowAction::Rescheduled {
            next_attempt_at: at(505)
        },
        "later is allowed"
    );
    assert_eq!(
        h.act(2, Some(at(50).into())).await.unwrap(),
        RowAction::Rescheduled {
            next_attempt_at: at(50)
        },
        "and earlier, at an absolute time"
    );
    assert_eq!(
        h.act(3, Some(Schedule::now())).await.unwrap(),
        RowAction::Leased
    );
    assert_eq!(h.act(3, None).await.unwrap(), RowAction::Leased);
    assert_eq!(h.act(99, None).await.unwrap(), RowAction::NotFound);
    assert_eq!(
        h.act(99, Some(Schedule::now())).await.unwrap(),
        RowAction::NotFound
    );
    // Row 1 is due now and claimed; row 2 waits for 50 s.
    assert_eq!(ids(&claim(h, &[Q], 10).await), [1]);
    let two = rows(h, Q)
        .await
        .into_iter()
        .find(|r| r.id == 2)
        .expect("row 2 is live");
    assert_eq!(two.next_attempt_at, at(50));
    assert_eq!(two.deliveries_count, 0, "counters kept");
    assert_eq!(h.act(2, None).await.unwrap(), RowAction::Deleted);
    assert_eq!(h.act(2, None).await.unwrap(), RowAction::NotFound);
    assert_eq!(
        ids_of(&rows(h, Q).await),
        [1, 3],
        "only the leased rows remain"
    );
    assert_eq!(invalid_field(h.act(0, None).await.unwrap_err()), "id");
    assert_eq!(
        invalid_field(
            h.act(1, Some(Schedule::after(Duration::MAX)))
                .await
                .unwrap_err()
        ),
        "schedule"
    );
}

fn ids_of(rows: &[StoredRow]) -> Vec<i64> {
    let mut ids: Vec<i64> = rows.iter().map(|r| r.id).collect();
    ids.sort_unstable();
    ids
}

contract! {
    a_paused_queue_is_skipped_by_claims_and_wakeups(dead_letter = true);
    pending_rows_are_run_now_rescheduled_or_deleted_by_id(dead_letter = false);
}
