//! Cancel (SPEC §3): a pending row is deleted and a running one marked, its rearm dropped;
//! however a cancelled run ends, the row is gone, and its key is free again.

use super::*;

async fn cancel_deletes_pending_drops_rearm_and_never_deletes_a_running_row<H: Harness>(h: &H) {
    assert_eq!(h.cancel(Q, "nobody").await.unwrap(), Cancelled::NotFound);
    publish(h, extend("p", b"x", secs(60))).await; // 1
    assert_eq!(
        h.cancel(Q2, "p").await.unwrap(),
        Cancelled::NotFound,
        "keys are per queue"
    );
    assert_eq!(
        h.cancel(Q, "p").await.unwrap(),
        Cancelled::Deleted { id: 1 }
    );
    assert!(rows(h, Q).await.is_empty());
    assert_eq!(h.cancel(Q, "p").await.unwrap(), Cancelled::NotFound);

    publish(h, extend("r", b"p0", at(0))).await; // 2
    let d = claim_one(h).await;
    let running = leased(timer_row(2, "r", b"p0", at(0)), &d, at(0), 1);
    let marked = |when| StoredRow {
        cancelled_at: Some(when),
        ..running.clone()
    };
    assert_eq!(
        h.cancel(Q, "r").await.unwrap(),
        Cancelled::Running { id: 2 }
    );
    assert_eq!(
        only_row(h).await,
        marked(at(0)),
        "a running row is never deleted, only marked"
    );

    // An extend after the cancel re-arms the timer and clears the mark (SPEC §3).
    publish(h, extend("r", b"p1", secs(60))).await; // rearm (uses id 3)
    assert_eq!(
        only_row(h).await,
        with_rearm(running.clone(), at(60), b"p1"),
        "the newest intent wins"
    );
    h.advance(secs(1)).await;
    assert_eq!(
        h.cancel(Q, "r").await.unwrap(),
        Cancelled::RearmDropped { id: 2 }
    );
    assert_eq!(
        only_row(h).await,
        marked(at(1)),
        "the rearm columns are cleared, the run untouched, the row marked"
    );
    h.advance(secs(1)).await;
    assert_eq!(
        h.cancel(Q, "r").await.unwrap(),
        Cancelled::Running { id: 2 }
    );
    assert_eq!(only_row(h).await, marked(at(1)), "the first mark is kept");

    // On an expired lease too.
    publish(h, extend("r", b"p2", secs(60))).await; // 4
    h.advance(TTL + secs(1)).await;
    assert_eq!(
        h.cancel(Q, "r").await.unwrap(),
        Cancelled::RearmDropped { id: 2 }
    );
    assert_eq!(only_row(h).await, marked(at(33)));
    assert_eq!(
        h.store().ack(d.lease).await.unwrap(),
        Completion::Deleted,
        "the run ends without firing again"
    );
    assert!(rows(h, Q).await.is_empty());

    let e = h.cancel(Q, "").await.unwrap_err();
    assert_eq!(invalid_field(e), "timer_id");
    let e = h.cancel("", "r").await.unwrap_err();
    assert_eq!(invalid_field(e), "queue");
}

async fn a_timer_key_is_free_again_once_its_row_is_gone<H: Harness>(h: &H) {
    publish(h, schedule("k", b"a", at(0))).await; // 1
    let d = claim_one(h).await;
    assert_eq!(
        publish(h, schedule("k", b"b", at(0))).await,
        Published::Skipped,
        "taken while running"
    );
    h.store().ack(d.lease).await.unwrap();
    assert_eq!(
        publish(h, schedule("k", b"c", secs(5))).await,
        Published::Inserted { id: 2 }
    );
    assert_eq!(
        only_row(h).await,
        timer_row(2, "k", b"c", at(5)),
        "the skipped publish used up no id"
    );
}

/// SPEC §3, §5.1: however a cancelled run ends, the row is gone — a failed run is neither
/// retried nor archived, and a success deletes it as usual.
async fn a_cancelled_run_is_deleted_however_it_ends<H: Harness>(h: &H) {
    for (i, key) in ["retry", "fail", "ack", "rearm-then-retry"]
        .iter()
        .enumerate()
    {
        publish(h, extend(key, b"p", at(0))).await;
        let d = claim_one(h).await;
        if *key == "rearm-then-retry" {
            // A rearm queued before the cancel is dropped by it.
            publish(h, extend(key, b"later", secs(60))).await;
            assert_eq!(
                h.cancel(Q, key).await.unwrap(),
                Cancelled::RearmDropped { id: d.lease.id }
            );
        } else {
            assert_eq!(
                h.cancel(Q, key).await.unwrap(),
                Cancelled::Running { id: d.lease.id }
            );
        }
        let done = match i {
            1 => h.store().fail(d.lease, rejected(Some("boom"))).await,
            2 => h.store().ack(d.lease).await,
            _ => h.store().retry(d.lease, secs(30)).await,
        }
        .unwrap();
        let want = if *key == "ack" {
            Completion::Deleted
        } else {
            Completion::Cancelled
        };
        assert_eq!(done, want, "{key}");
        assert!(rows(h, Q).await.is_empty(), "{key}: the row is gone");
    }
    assert!(
        dead_letters(h).await.is_empty(),
        "a cancelled run is never archived"
    );
    // The fence still holds: a cancelled row's completion with a wrong token writes nothing.
    publish(h, extend("fenced", b"p", at(0))).await;
    let d = claim_one(h).await;
    h.cancel(Q, "fenced").await.unwrap();
    assert_eq!(
        h.store().retry(wrong(d.lease), secs(1)).await.unwrap(),
        Completion::LeaseLost
    );
    assert_eq!(rows(h, Q).await.len(), 1);
}

/// SPEC §3: a worker that reclaims a cancelled row after its lease expired deletes it
/// instead of running it; rows beside it are delivered as usual.
async fn a_reclaimed_cancelled_row_is_deleted_not_delivered<H: Harness>(h: &H) {
    publish(h, extend("gone", b"p", at(0))).await; // 1
    publish(h, extend("kept", b"q", at(0))).await; // 2
    let first = claim(h, &[Q], 10).await;
    assert_eq!(ids(&first), vec![1, 2]);
    h.cancel(Q, "gone").await.unwrap();
    h.advance(TTL + secs(1)).await;
    let again = claim(h, &[Q], 10).await;
    assert_eq!(ids(&again), vec![2], "the cancelled row is not delivered");
    let live = rows(h, Q).await;
    assert_eq!(live.len(), 1, "{live:#?}");
    assert_eq!(live[0].id, 2);

    // With a rearm queued after the cancel, the rearm wins: the row is delivered and the
    // rearm applies when that run ends.
    publish(h, extend("again", b"r", at(0))).await; // 3
    h.store().ack(again[0].lease).await.unwrap();
    let d = claim_one(h).await;
    assert_eq!(d.lease.id, 3);
    h.cancel(Q, "again").await.unwrap();
    publish(h, extend("again", b"r2", secs(100))).await;
    h.advance(TTL + secs(1)).await;
    let d2 = claim_one(h).await;
    assert_eq!(d2.lease.id, 3, "re-armed after the cancel: delivered");
    assert_eq!(
        h.store().ack(d2.lease).await.unwrap(),
        Completion::Rearmed { at: at(131) }
    );
    assert_eq!(only_row(h).await.cancelled_at, None);
}

contract! {
    cancel_deletes_pending_drops_rearm_and_never_deletes_a_running_row(dead_letter = true);
    a_timer_key_is_free_again_once_its_row_is_gone(dead_letter = true);
    a_cancelled_run_is_deleted_however_it_ends(dead_letter = true);
    a_reclaimed_cancelled_row_is_deleted_not_delivered(dead_letter = true);
}
