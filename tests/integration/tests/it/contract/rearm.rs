//! Rearms (SPEC §5): an extend of a leased row queues a rearm, later only; success, a
//! terminal failure and a retry apply or replace it, a lost lease keeps it.

use super::*;

async fn a_rearm_is_queued_on_fresh_and_expired_leases_later_only<H: Harness>(h: &H) {
    publish(h, extend("k", b"p0", at(0))).await;
    h.advance(secs(5)).await;
    let d = claim_one(h).await;
    let running = leased(timer_row(1, "k", b"p0", at(0)), &d, at(5), 1);

    // Not later than the claimed deadline (even though that is in the past): nothing queued.
    assert_eq!(
        publish(h, extend("k", b"x", at(-1))).await,
        Published::Unchanged
    );
    assert_eq!(
        publish(h, extend("k", b"x", at(0))).await,
        Published::Unchanged
    );
    assert_eq!(only_row(h).await, running);
    // Later than the claimed deadline, even if already past: queued.
    assert_eq!(
        publish(h, extend("k", b"p1", at(0) + us(1))).await,
        Published::RearmQueued { id: 1 }
    );
    assert_eq!(
        only_row(h).await,
        with_rearm(running.clone(), at(0) + us(1), b"p1")
    );

    // Later than the queued rearm: moved, with the newer payload and headers.
    let hs = headers(&[("v", "2")]);
    assert_eq!(
        publish(h, extend("k", b"p2", secs(60)).headers(&hs)).await,
        Published::RearmQueued { id: 1 }
    );
    let queued = StoredRow {
        rearm_headers: Some(hs),
        ..with_rearm(running.clone(), at(65), b"p2")
    };
    assert_eq!(only_row(h).await, queued);
    // Not later than the queued rearm: unchanged.
    assert_eq!(
        publish(h, extend("k", b"x", at(65))).await,
        Published::Unchanged
    );
    assert_eq!(
        publish(h, extend("k", b"x", at(64))).await,
        Published::Unchanged
    );
    // `Ignore` never touches a running row.
    assert_eq!(
        publish(h, schedule("k", b"x", at(500))).await,
        Published::Skipped
    );
    assert_eq!(only_row(h).await, queued);

    // The lease expires: still leased, the extend still queues a rearm.
    h.advance(TTL + secs(1)).await;
    assert_eq!(
        publish(h, extend("k", b"p3", at(100))).await,
        Published::RearmQueued { id: 1 }
    );
    assert_eq!(only_row(h).await, with_rearm(running, at(100), b"p3"));
}

/// A timer that has failed once and is running its second delivery, with a rearm queued.
async fn running_with_history_and_rearm<H: Harness>(h: &H) -> Delivery {
    publish(h, extend("k", b"p0", at(0))).await;
    let d = claim_one(h).await;
    h.advance(secs(1)).await;
    h.store().retry(d.lease, Duration::ZERO).await.unwrap();
    h.advance(secs(1)).await;
    let d = claim_one(h).await;
    assert_eq!(
        (d.attempts_count, d.deliveries_count, d.deadline),
        (1, 2, at(1))
    );
    let hs = headers(&[("v", "1")]);
    assert_eq!(
        publish(h, extend("k", b"p1", at(60)).headers(&hs)).await,
        Published::RearmQueued { id: 1 }
    );
    d
}

/// What a rearm applied by success or terminal failure leaves: a fresh pending timer.
fn rearmed_row() -> StoredRow {
    StoredRow {
        headers: Some(headers(&[("v", "1")])),
        ..timer_row(1, "k", b"p1", at(60))
    }
}

async fn a_rearm_is_applied_by_the_single_delete<H: Harness>(h: &H) {
    let d = running_with_history_and_rearm(h).await;
    assert_eq!(
        h.store().ack(wrong(d.lease)).await.unwrap(),
        Completion::LeaseLost
    );
    assert_eq!(
        h.store().ack(d.lease).await.unwrap(),
        Completion::Rearmed { at: at(60) }
    );
    assert_eq!(
        only_row(h).await,
        rearmed_row(),
        "history and deliveries_count reset"
    );
    assert_eq!(h.store().ack(d.lease).await.unwrap(), Completion::LeaseLost);
    // The fresh instance fires at the rearm deadline.
    h.advance(secs(58)).await;
    let d = claim_one(h).await;
    assert_eq!(
        (d.deliveries_count, d.attempts_count, d.payload.as_slice()),
        (1, 0, &b"p1"[..])
    );
}

async fn a_rearm_is_applied_by_the_batched_delete<H: Harness>(h: &H) {
    let d = running_with_history_and_rearm(h).await;
    publish(h, plain(b"plain", 0)).await; // id 2 (the extend that queued the rearm used none)
    publish(h, plain(b"other", 0)).await; // id 3
    let got = claim(h, &[Q], 10).await;
    assert_eq!(ids(&got), vec![2, 3]);
    let (p, other) = (got[0].lease, got[1].lease);
    // A lost lease first must not keep the follow-up from applying the rearm.
    let out = h
        .store()
        .ack_batch(&[wrong(other), p, d.lease])
        .await
        .unwrap();
    assert_eq!(
        out,
        vec![
            Completion::LeaseLost,
            Completion::Deleted,
            Completion::Rearmed { at: at(60) }
        ]
    );
    assert_eq!(
        rows(h, Q).await,
        vec![
            StoredRow {
                created_at: at(2),
                ..leased(row(3, Q, b"other", at(2)), &got[1], at(2), 1)
            },
            rearmed_row()
        ]
    );
    assert_eq!(
        h.store().ack_batch(&[d.lease, p]).await.unwrap(),
        vec![Completion::LeaseLost, Completion::LeaseLost]
    );
}

async fn a_rearm_is_applied_by_the_dead_letter_delete<H: Harness>(h: &H) {
    let d = running_with_history_and_rearm(h).await;
    h.advance(secs(1)).await;
    assert_eq!(
        h.store().fail(d.lease, rejected(Some("no"))).await.unwrap(),
        Completion::Rearmed { at: at(60) }
    );
    assert_eq!(only_row(h).await, rearmed_row());
    let dlq = dead_letters(h).await;
    assert_eq!(
        dlq,
        vec![DeadLetter {
            id: 1,
            original_id: 1,
            queue: Q.to_owned(),
            payload: b"p0".to_vec(),
            headers: None,
            raw_headers: None,
            timer_id: Some("k".to_owned()),
            attempts_count: 2,
            deliveries_count: 2,
            created_at: at(0),
            failed_at: at(3),
            failure_reason: "rejected".to_owned(),
            last_error: Some("no".to_owned()),
            redriven_at: None,
            redriven_id: None,
        }],
        "the failed run is archived with its own payload"
    );
}

async fn a_rearm_is_applied_by_a_terminal_failure_without_dead_letters<H: Harness>(h: &H) {
    let d = running_with_history_and_rearm(h).await;
    let max = Failure {
        reason: FailureReason::MaxDeliveries,
        last_error: None,
    };
    assert_eq!(
        h.store().fail(d.lease, max).await.unwrap(),
        Completion::Rearmed { at: at(60) }
    );
    assert_eq!(only_row(h).await, rearmed_row());
    assert!(dead_letters(h).await.is_empty());
}

async fn a_rearm_is_kept_through_a_lost_lease<H: Harness>(h: &H) {
    publish(h, extend("k", b"p0", at(0))).await;
    let stale = claim_one(h).await;
    assert_eq!(
        publish(h, extend("k", b"p1", at(60))).await,
        Published::RearmQueued { id: 1 }
    );
    h.advance(TTL + secs(1)).await;
    let fresh = claim_one(h).await;
    assert_eq!(fresh.deliveries_count, 2);
    assert_eq!(
        fresh.payload, b"p0",
        "the reclaim runs the claimed instance again"
    );
    let before = only_row(h).await;
    assert_eq!(
        before,
        with_rearm(
            leased(timer_row(1, "k", b"p0", at(0)), &fresh, at(31), 2),
            at(60),
            b"p1"
        ),
        "the reclaim does not touch the rearm"
    );

    assert_eq!(
        h.store().ack(stale.lease).await.unwrap(),
        Completion::LeaseLost
    );
    assert_eq!(
        h.store().ack_batch(&[stale.lease]).await.unwrap(),
        vec![Completion::LeaseLost]
    );
    assert_eq!(
        h.store().retry(stale.lease, Duration::ZERO).await.unwrap(),
        Completion::LeaseLost
    );
    assert_eq!(
        h.store().fail(stale.lease, rejected(None)).await.unwrap(),
        Completion::LeaseLost
    );
    assert_eq!(only_row(h).await, before, "neither applied nor cleared");
    assert!(dead_letters(h).await.is_empty());

    assert_eq!(
        h.store().ack(fresh.lease).await.unwrap(),
        Completion::Rearmed { at: at(60) }
    );
    assert_eq!(only_row(h).await, timer_row(1, "k", b"p1", at(60)));
}

async fn a_rearm_replaces_a_retry_and_keeps_deliveries<H: Harness>(h: &H) {
    let d = running_with_history_and_rearm(h).await;
    h.advance(secs(1)).await;
    assert_eq!(
        h.store().retry(d.lease, secs(3600)).await.unwrap(),
        Completion::Rearmed { at: at(60) }
    );
    let want = StoredRow {
        attempts_count: 2,
        deliveries_count: 2,
        first_attempt_at: Some(at(1)),
        last_attempt_at: Some(at(3)),
        ..rearmed_row()
    };
    assert_eq!(
        only_row(h).await,
        want,
        "history updated as for the failed run, deliveries kept"
    );
}

contract! {
    a_rearm_is_queued_on_fresh_and_expired_leases_later_only(dead_letter = true);
    a_rearm_is_applied_by_the_single_delete(dead_letter = true);
    a_rearm_is_applied_by_the_batched_delete(dead_letter = true);
    a_rearm_is_applied_by_the_dead_letter_delete(dead_letter = true);
    a_rearm_is_applied_by_a_terminal_failure_without_dead_letters(dead_letter = false);
    a_rearm_is_kept_through_a_lost_lease(dead_letter = true);
    a_rearm_replaces_a_retry_and_keeps_deliveries(dead_letter = true);
}
