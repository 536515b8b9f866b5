//! Fenced completions (SPEC §5.1, §5.2, §7.4, §7.5, §7.8): ack, batched ack, retry, terminal
//! failure and its dead-letter archive, renewal, release at shutdown, and the terminal failure
//! of a row no claim can take — each with the right token, a wrong one and an unleased row.

use super::*;

async fn ack_with_the_right_token_a_wrong_token_and_an_unleased_row<H: Harness>(h: &H) {
    publish(h, plain(b"a", 0)).await;
    publish(h, plain(b"b", 60)).await;
    let d = claim_one(h).await;
    let before = rows(h, Q).await;
    assert_eq!(
        h.store().ack(wrong(d.lease)).await.unwrap(),
        Completion::LeaseLost
    );
    let unleased = Lease {
        id: 2,
        token: d.lease.token,
    };
    assert_eq!(
        h.store().ack(unleased).await.unwrap(),
        Completion::LeaseLost
    );
    assert_eq!(rows(h, Q).await, before, "nothing changed");
    assert_eq!(h.store().ack(d.lease).await.unwrap(), Completion::Deleted);
    assert_eq!(rows(h, Q).await, vec![row(2, Q, b"b", at(60))]);
    assert_eq!(
        h.store().ack(d.lease).await.unwrap(),
        Completion::LeaseLost,
        "the row is gone"
    );
}

async fn dead_letter_archive_contents<H: Harness>(h: &H) {
    assert!(h.store().dead_letter_enabled());
    let hs = headers(&[("trace", "t-1")]);
    publish(h, Message::new(Q, b"p0").timer_id("k").headers(&hs)).await;
    let d = claim_one(h).await;
    h.advance(secs(1)).await;
    assert_eq!(
        h.store().retry(d.lease, Duration::ZERO).await.unwrap(),
        Completion::RetryScheduled { at: at(1) }
    );
    h.advance(secs(1)).await;
    let d = claim_one(h).await;
    assert_eq!((d.attempts_count, d.deliveries_count), (1, 2));
    h.advance(secs(1)).await;
    let lost = h
        .store()
        .fail(wrong(d.lease), rejected(Some("x")))
        .await
        .unwrap();
    assert_eq!(lost, Completion::LeaseLost);
    assert!(
        dead_letters(h).await.is_empty(),
        "a lost lease archives nothing"
    );

    let outcome = h
        .store()
        .fail(d.lease, rejected(Some("boom\0!")))
        .await
        .unwrap();
    assert_eq!(outcome, Completion::Deleted);
    assert!(rows(h, Q).await.is_empty());
    let dlq = dead_letters(h).await;
    assert_eq!(
        dlq,
        vec![DeadLetter {
            id: 1,
            original_id: 1,
            queue: Q.to_owned(),
            payload: b"p0".to_vec(),
            headers: Some(hs),
            raw_headers: None,
            timer_id: Some("k".to_owned()),
            attempts_count: 2,
            deliveries_count: 2,
            created_at: at(0),
            failed_at: at(3),
            failure_reason: "rejected".to_owned(),
            last_error: Some("boom\\0!".to_owned()),
            redriven_at: None,
            redriven_id: None,
        }]
    );

    // A failure where the handler never ran does not count as an attempt; a long error is
    // cut at a character boundary.
    publish(h, plain(b"\xff", 0)).await; // id 2
    let d = claim_one(h).await;
    let long = "é".repeat(MAX_LAST_ERROR_BYTES);
    let failure = Failure {
        reason: FailureReason::DecodeError,
        last_error: Some(&long),
    };
    assert_eq!(
        h.store().fail(d.lease, failure).await.unwrap(),
        Completion::Deleted
    );
    let max = Failure {
        reason: FailureReason::MaxDeliveries,
        last_error: None,
    };
    publish(h, plain(b"m", 0)).await; // id 3
    let d = claim_one(h).await;
    assert_eq!(
        h.store().fail(d.lease, max).await.unwrap(),
        Completion::Deleted
    );
    let dlq = dead_letters(h).await;
    assert_eq!(dlq.len(), 3);
    assert_eq!(
        (
            dlq[1].id,
            dlq[1].original_id,
            dlq[1].attempts_count,
            dlq[1].deliveries_count
        ),
        (2, 2, 0, 1)
    );
    assert_eq!(dlq[1].failure_reason, "decode_error");
    assert_eq!(
        dlq[1].last_error.as_deref(),
        Some(&long[..MAX_LAST_ERROR_BYTES])
    );
    assert_eq!(
        (
            dlq[2].id,
            dlq[2].attempts_count,
            dlq[2].failure_reason.as_str(),
            dlq[2].last_error.as_deref()
        ),
        (3, 0, "max_deliveries", None)
    );
    publish(h, plain(b"r", 0)).await; // id 4
    let d = claim_one(h).await;
    let exhausted = Failure {
        reason: FailureReason::RetryExhausted,
        last_error: None,
    };
    assert_eq!(
        h.store().fail(d.lease, exhausted).await.unwrap(),
        Completion::Deleted
    );
    let dlq = dead_letters(h).await;
    assert_eq!(
        (dlq[3].attempts_count, dlq[3].failure_reason.as_str()),
        (1, "retry_exhausted")
    );
    assert!(
        h.dead_letters(Q2, 10).await.unwrap().is_empty(),
        "per queue"
    );
    assert_eq!(h.dead_letters(Q, 2).await.unwrap().len(), 2, "limit");
}

async fn terminal_failure_without_the_dead_letter_queue<H: Harness>(h: &H) {
    assert!(!h.store().dead_letter_enabled());
    publish(h, plain(b"a", 0)).await;
    let d = claim_one(h).await;
    assert_eq!(
        h.store()
            .fail(wrong(d.lease), rejected(None))
            .await
            .unwrap(),
        Completion::LeaseLost
    );
    assert_eq!(
        h.store().fail(d.lease, rejected(Some("e"))).await.unwrap(),
        Completion::Deleted
    );
    assert!(rows(h, Q).await.is_empty());
    assert!(dead_letters(h).await.is_empty(), "nothing archived");
}

async fn batched_ack_with_one_wrong_token_in_three<H: Harness>(h: &H) {
    for (p, delay) in [(b"a", 0), (b"b", 1), (b"c", 2)] {
        publish(h, plain(p, delay)).await;
    }
    h.advance(secs(2)).await;
    let got = claim(h, &[Q], 10).await;
    assert_eq!(ids(&got), vec![1, 2, 3]);
    let leases = [got[0].lease, wrong(got[1].lease), got[2].lease];
    let out = h.store().ack_batch(&leases).await.unwrap();
    assert_eq!(
        out,
        vec![
            Completion::Deleted,
            Completion::LeaseLost,
            Completion::Deleted
        ]
    );
    assert_eq!(
        rows(h, Q).await,
        vec![leased(row(2, Q, b"b", at(1)), &got[1], at(2), 1)]
    );
    assert!(
        h.store().ack_batch(&[]).await.unwrap().is_empty(),
        "empty batch"
    );
    assert_eq!(
        h.store().ack_batch(&[got[1].lease]).await.unwrap(),
        vec![Completion::Deleted]
    );
    assert!(rows(h, Q).await.is_empty());
}

async fn retry_with_the_right_token_a_wrong_token_and_an_unleased_row<H: Harness>(h: &H) {
    publish(h, plain(b"a", 0)).await;
    publish(h, plain(b"b", 60)).await;
    let d = claim_one(h).await;
    h.advance(secs(2)).await;
    let before = rows(h, Q).await;
    assert_eq!(
        h.store().retry(wrong(d.lease), secs(5)).await.unwrap(),
        Completion::LeaseLost
    );
    let unleased = Lease {
        id: 2,
        token: d.lease.token,
    };
    assert_eq!(
        h.store().retry(unleased, secs(5)).await.unwrap(),
        Completion::LeaseLost
    );
    assert_eq!(rows(h, Q).await, before);
    let e = h.store().retry(d.lease, Duration::MAX).await.unwrap_err();
    assert_eq!(invalid_field(e), "delay");
    let e = h
        .store()
        .retry(d.lease, outbox::message::MAX_DELAY + secs(1))
        .await
        .unwrap_err();
    assert_eq!(invalid_field(e), "delay");

    assert_eq!(
        h.store().retry(d.lease, secs(5)).await.unwrap(),
        Completion::RetryScheduled { at: at(7) }
    );
    let want = StoredRow {
        attempts_count: 1,
        deliveries_count: 1,
        first_attempt_at: Some(at(2)),
        last_attempt_at: Some(at(2)),
        ..row(1, Q, b"a", at(7))
    };
    assert_eq!(rows(h, Q).await[0], want);
    assert_eq!(
        h.store().retry(d.lease, secs(5)).await.unwrap(),
        Completion::LeaseLost,
        "lease cleared"
    );

    h.advance(secs(5)).await;
    let d = claim_one(h).await;
    assert_eq!(
        (d.attempts_count, d.deliveries_count, d.first_attempt_at),
        (1, 2, Some(at(2)))
    );
    h.advance(secs(1)).await;
    assert_eq!(
        h.store()
            .retry(d.lease, Duration::from_millis(1500))
            .await
            .unwrap(),
        Completion::RetryScheduled {
            at: at(8) + TimeDelta::milliseconds(1500)
        }
    );
    let want = StoredRow {
        attempts_count: 2,
        deliveries_count: 2,
        first_attempt_at: Some(at(2)),
        last_attempt_at: Some(at(8)),
        ..row(1, Q, b"a", at(8) + TimeDelta::milliseconds(1500))
    };
    assert_eq!(rows(h, Q).await[0], want);
}

/// A stale and a fresh lease of the same row in one batch: only the fresh one succeeds.
async fn a_stale_and_a_fresh_lease_of_one_row_in_one_batch<H: Harness>(h: &H) {
    for with_rearm in [false, true] {
        publish(h, extend("k", b"a", Duration::ZERO)).await;
        let stale = claim_one(h).await;
        h.advance(TTL + Duration::from_micros(1)).await;
        let fresh = claim_one(h).await;
        assert_eq!(fresh.lease.id, stale.lease.id);
        if with_rearm {
            publish(h, extend("k", b"b", secs(3600))).await;
        }
        let out = h
            .store()
            .ack_batch(&[stale.lease, fresh.lease])
            .await
            .unwrap();
        let want = if with_rearm {
            Completion::Rearmed {
                at: h.store().now().await.unwrap() + TimeDelta::seconds(3600),
            }
        } else {
            Completion::Deleted
        };
        assert_eq!(
            out,
            vec![Completion::LeaseLost, want],
            "{}: rearm {with_rearm}",
            H::NAME
        );
        if with_rearm {
            let c = h.cancel(Q, "k").await.unwrap();
            assert!(matches!(c, Cancelled::Deleted { .. }), "{c:?}");
        }
        assert!(rows(h, Q).await.is_empty());
    }
}

/// SPEC §7.8: a renewal moves `acquired_at` of every lease still held, reports a row a
/// cancel reached, and reports a lease that is lost; it changes nothing else.
async fn renew_keeps_leases_alive_and_reports_cancel_and_loss<H: Harness>(h: &H) {
    for key in ["a", "b", "c"] {
        publish(h, extend(key, b"p", at(0))).await; // 1, 2, 3
    }
    let ds = claim(h, &[Q], 10).await;
    assert_eq!(ids(&ds), vec![1, 2, 3]);
    h.advance(secs(20)).await;
    h.cancel(Q, "b").await.unwrap();
    // Row 3's lease is taken over: its old token is lost.
    h.advance(TTL).await;
    let renewed = h.store().renew(&[ds[0].lease, ds[1].lease]).await.unwrap();
    assert_eq!(renewed, vec![Renewal::Renewed, Renewal::Cancelled]);
    let taken = claim(h, &[Q], 10).await;
    assert_eq!(ids(&taken), vec![3], "only the lease not renewed expired");
    assert_eq!(
        h.store()
            .renew(&[ds[2].lease, wrong(ds[0].lease)])
            .await
            .unwrap(),
        vec![Renewal::Lost, Renewal::Lost]
    );
    let live = rows(h, Q).await;
    assert_eq!(
        live[0].acquired_at,
        Some(at(50)),
        "renewed at the store's now"
    );
    assert_eq!(live[1].acquired_at, Some(at(50)));
    assert_eq!(live[1].cancelled_at, Some(at(20)), "the mark stays");
    assert_eq!(live[0].deliveries_count, 1, "a renewal is not a delivery");
    assert!(h.store().renew(&[]).await.unwrap().is_empty());
}

/// SPEC §7.5: every row of the release table.
async fn release_gives_rows_back_as_the_table_says<H: Harness>(h: &H) {
    // 1: never started, no rearm. 2: never started, rearm queued. 3: cancelled.
    // 4: started, no rearm. 5: started, rearm queued.
    for key in ["n", "nr", "c", "s", "sr"] {
        publish(h, extend(key, key.as_bytes(), at(0))).await;
    }
    let ds = claim(h, &[Q], 10).await;
    assert_eq!(ids(&ds), vec![1, 2, 3, 4, 5]);
    h.advance(secs(1)).await;
    publish(h, extend("nr", b"later", secs(60))).await; // uses id 6
    publish(h, extend("sr", b"later", secs(90))).await; // uses id 7
    h.cancel(Q, "c").await.unwrap();
    h.advance(secs(1)).await;
    let items: Vec<Release> = ds
        .iter()
        .map(|d| Release {
            lease: d.lease,
            started: matches!(d.timer_id.as_deref(), Some("s" | "sr")),
        })
        .collect();
    let mut with_stale = items.clone();
    with_stale.push(Release {
        lease: wrong(ds[0].lease),
        started: false,
    });
    assert_eq!(
        h.store().release(&with_stale).await.unwrap(),
        vec![
            Released::Pending,
            Released::Pending,
            Released::Cancelled,
            Released::Retried,
            Released::Retried,
            Released::LeaseLost,
        ]
    );
    let live = rows(h, Q).await;
    let by = |k: &str| {
        live.iter()
            .find(|r| r.timer_id.as_deref() == Some(k))
            .unwrap()
            .clone()
    };
    assert!(
        live.iter().all(|r| r.timer_id.as_deref() != Some("c")),
        "cancelled: deleted"
    );
    assert_eq!(
        by("n"),
        timer_row(1, "n", b"n", at(0)),
        "pending as before, not delivered"
    );
    assert_eq!(
        by("nr"),
        timer_row(2, "nr", b"later", at(61)),
        "the rearm applied as a pending extend"
    );
    assert_eq!(
        by("s"),
        StoredRow {
            attempts_count: 1,
            deliveries_count: 1,
            first_attempt_at: Some(at(2)),
            last_attempt_at: Some(at(2)),
            ..timer_row(4, "s", b"s", at(2))
        },
        "due now, the attempt recorded"
    );
    assert_eq!(
        by("sr"),
        StoredRow {
            attempts_count: 1,
            deliveries_count: 1,
            first_attempt_at: Some(at(2)),
            last_attempt_at: Some(at(2)),
            ..timer_row(5, "sr", b"later", at(91))
        },
        "the rearm replaces the due-now retry"
    );
    assert!(h.store().release(&[]).await.unwrap().is_empty());
}

/// SPEC §7.4: the delete-based terminal failure of a row no claim can take ends it only
/// when nobody holds it, archiving it when the dead-letter queue is on.
async fn fail_unclaimed_ends_only_unheld_rows<H: Harness>(h: &H) {
    publish(h, plain(b"free", 0)).await; // 1
    publish(h, plain(b"held", 0)).await; // 2
    let held = claim(h, &[Q], 1).await;
    assert_eq!(ids(&held), vec![1]);
    let failure = Failure {
        reason: FailureReason::MaxDeliveries,
        last_error: Some("could not be claimed"),
    };
    assert_eq!(
        h.store().fail_unclaimed(1, TTL, failure).await.unwrap(),
        Completion::LeaseLost,
        "a held row is not touched"
    );
    assert_eq!(
        h.store().fail_unclaimed(2, TTL, failure).await.unwrap(),
        Completion::Deleted
    );
    h.advance(TTL + secs(1)).await;
    assert_eq!(
        h.store().fail_unclaimed(1, TTL, failure).await.unwrap(),
        Completion::Deleted,
        "an expired lease is nobody's"
    );
    assert_eq!(
        h.store().fail_unclaimed(1, TTL, failure).await.unwrap(),
        Completion::LeaseLost,
        "gone"
    );
    assert!(rows(h, Q).await.is_empty());
    let dead = dead_letters(h).await;
    assert_eq!(dead.len(), 2);
    assert_eq!(dead[0].original_id, 2);
    assert_eq!(dead[0].failure_reason, "max_deliveries");
    assert_eq!(dead[0].last_error.as_deref(), Some("could not be claimed"));
    assert_eq!(dead[1].original_id, 1);
    assert_eq!(dead[1].deliveries_count, 1);
}

contract! {
    ack_with_the_right_token_a_wrong_token_and_an_unleased_row(dead_letter = true);
    dead_letter_archive_contents(dead_letter = true);
    terminal_failure_without_the_dead_letter_queue(dead_letter = false);
    batched_ack_with_one_wrong_token_in_three(dead_letter = true);
    retry_with_the_right_token_a_wrong_token_and_an_unleased_row(dead_letter = true);
    a_stale_and_a_fresh_lease_of_one_row_in_one_batch(dead_letter = true);
    renew_keeps_leases_alive_and_reports_cancel_and_loss(dead_letter = true);
    release_gives_rows_back_as_the_table_says(dead_letter = true);
    fail_unclaimed_ends_only_unheld_rows(dead_letter = true);
}
