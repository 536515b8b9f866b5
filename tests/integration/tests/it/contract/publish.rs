//! Publish and extend (SPEC §2, §4): outcomes and the ids they use up, later-only extends and
//! their slack, batches, the typed functions `#[timer]` generates, and validation before
//! anything is written.

use super::*;

async fn publish_outcomes_use_up_ids_only_when_they_insert<H: Harness>(h: &H) {
    assert_eq!(
        publish(h, schedule("k", b"v1", at(60))).await,
        Published::Inserted { id: 1 }
    );
    assert_eq!(
        publish(h, schedule("k", b"v2", at(90))).await,
        Published::Skipped
    );
    assert_eq!(
        publish(h, extend("k", b"v3", at(30))).await,
        Published::Unchanged
    );
    // The skipped and the unchanged publish found the key held and used up no id (issue
    // 27: the statements look for the key before the identity default is evaluated).
    assert_eq!(
        publish(h, plain(b"p", 0)).await,
        Published::Inserted { id: 2 }
    );
    // Rejected input uses up nothing.
    let e = h.publish(Message::new("", b"x")).await.unwrap_err();
    assert_eq!(invalid_field(e), "queue");
    assert_eq!(
        publish(h, extend("other", b"o", secs(5))).await,
        Published::Inserted { id: 3 }
    );
    let rows = rows(h, Q).await;
    assert_eq!(
        rows,
        vec![
            row(2, Q, b"p", at(0)),
            timer_row(3, "other", b"o", at(5)),
            timer_row(1, "k", b"v1", at(60)),
        ]
    );
    // The same key in another queue is another timer.
    let other = Message::new(Q2, b"v").timer_id("k");
    assert_eq!(publish(h, other).await, Published::Inserted { id: 4 });
}

/// Issue 27: every write that meets a live row of its key (an extend that moves a pending
/// deadline, one that queues a rearm on a running row, one that changes nothing, a skipped
/// publish, a registration of a stored schedule, changed or not) leaves the identity
/// alone: the next insert gets the id after the last insert's.
async fn writes_to_a_held_key_use_up_no_id<H: Harness>(h: &H) {
    assert_eq!(
        publish(h, extend("run", b"r0", at(0))).await,
        Published::Inserted { id: 1 }
    );
    assert_eq!(
        publish(h, extend("wait", b"w0", at(60))).await,
        Published::Inserted { id: 2 }
    );
    let fp = headers(&[(SCHEDULE_HEADER, "every:1s")]);
    let fp2 = headers(&[(SCHEDULE_HEADER, "every:2s")]);
    let register = |fp, first| RegisterSchedule::new(Q, "schedule:s", b"{}", fp, first);
    assert_eq!(
        h.store()
            .register_schedule(register(&fp, at(30)))
            .await
            .unwrap(),
        Registered::Inserted { id: 3, at: at(30) }
    );
    let d = claim_one(h).await;
    assert_eq!(d.lease.id, 1);
    for i in 1..=3 {
        assert_eq!(
            publish(h, extend("wait", b"w", at(60 + i))).await,
            Published::Extended { id: 2 }
        );
        assert_eq!(
            publish(h, extend("run", b"r", at(100 + i))).await,
            Published::RearmQueued { id: 1 }
        );
    }
    assert_eq!(
        publish(h, extend("wait", b"w", at(10))).await,
        Published::Unchanged
    );
    assert_eq!(
        publish(h, schedule("run", b"x", at(500))).await,
        Published::Skipped
    );
    assert_eq!(
        h.store()
            .register_schedule(register(&fp, at(40)))
            .await
            .unwrap(),
        Registered::Unchanged
    );
    assert_eq!(
        h.store()
            .register_schedule(register(&fp2, at(40)))
            .await
            .unwrap(),
        Registered::Rescheduled { id: 3, at: at(40) }
    );
    assert_eq!(
        publish(h, extend("fresh", b"f", at(5))).await,
        Published::Inserted { id: 4 }
    );
    assert_eq!(
        publish(h, plain(b"p", 0)).await,
        Published::Inserted { id: 5 }
    );
}

async fn extend_of_a_pending_row_moves_later_only_and_resets_history<H: Harness>(h: &H) {
    let h1 = headers(&[("v", "1")]);
    let h2 = headers(&[("v", "2")]);
    publish(h, extend("k", b"p0", at(0)).headers(&h1)).await;
    let d = claim_one(h).await;
    h.advance(secs(1)).await;
    h.store().retry(d.lease, secs(10)).await.unwrap(); // pending again at 11, with history
    let waiting = StoredRow {
        attempts_count: 1,
        deliveries_count: 1,
        first_attempt_at: Some(at(1)),
        last_attempt_at: Some(at(1)),
        headers: Some(h1.clone()),
        ..timer_row(1, "k", b"p0", at(11))
    };
    assert_eq!(only_row(h).await, waiting);

    // Not later: nothing changes, the newer payload is kept.
    assert_eq!(
        publish(h, extend("k", b"early", at(5))).await,
        Published::Unchanged
    );
    assert_eq!(
        publish(h, extend("k", b"same", at(11))).await,
        Published::Unchanged
    );
    assert_eq!(only_row(h).await, waiting);

    // Later: deadline, payload and headers replaced, retry history reset, deliveries kept.
    assert_eq!(
        publish(h, extend("k", b"p1", at(11) + us(1)).headers(&h2)).await,
        Published::Extended { id: 1 }
    );
    assert_eq!(
        only_row(h).await,
        StoredRow {
            deliveries_count: 1,
            headers: Some(h2),
            ..timer_row(1, "k", b"p1", at(11) + us(1))
        }
    );
    // A relative extend counts from the store's clock; no headers clears them.
    h.advance(secs(100)).await;
    assert_eq!(
        publish(h, extend("k", b"p2", secs(60))).await,
        Published::Extended { id: 1 }
    );
    assert_eq!(
        only_row(h).await,
        StoredRow {
            deliveries_count: 1,
            ..timer_row(1, "k", b"p2", at(161))
        }
    );
}

async fn a_batch_inserts_rows_in_item_order<H: Harness>(h: &H) {
    let hs = headers(&[("n", "2")]);
    let items = [
        BatchItem::new(b"one"),
        BatchItem {
            payload: b"two",
            headers: Some(&hs),
        },
    ];
    assert!(h
        .publish_batch(Q, &[], Schedule::now())
        .await
        .unwrap()
        .is_empty());
    assert_eq!(
        h.publish_batch(Q, &items, secs(5).into()).await.unwrap(),
        vec![1, 2]
    );
    let e = h
        .publish_batch("", &items, Schedule::now())
        .await
        .unwrap_err();
    assert_eq!(invalid_field(e), "queue");
    let e = h
        .publish_batch(Q, &items, TimeDelta::seconds(-1).into())
        .await
        .unwrap_err();
    assert_eq!(invalid_field(e), "schedule");
    assert_eq!(
        rows(h, Q).await,
        vec![
            row(1, Q, b"one", at(5)),
            StoredRow {
                headers: Some(hs),
                ..row(2, Q, b"two", at(5))
            }
        ]
    );
    assert_eq!(
        publish(h, plain(b"after", 0)).await,
        Published::Inserted { id: 3 }
    );
}

#[outbox::timer(queue = "q.main", max_deliveries = 3)]
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct Presence {
    user_id: i64,
}

async fn typed_functions_publish_through_the_store<H: Harness>(h: &H) {
    let p = |user_id| Presence { user_id };
    assert_eq!(
        h.publish_typed("7", &p(7), secs(60).into()).await.unwrap(),
        Published::Inserted { id: 1 }
    );
    assert_eq!(
        h.publish_typed("7", &p(8), secs(90).into()).await.unwrap(),
        Published::Skipped
    );
    h.advance(secs(10)).await;
    assert_eq!(
        h.extend_typed("7", &p(9), secs(60).into()).await.unwrap(),
        Published::Extended { id: 1 }
    );
    assert_eq!(only_row(h).await.payload, br#"{"user_id":9}"#);
    assert_eq!(only_row(h).await.next_attempt_at, at(70));
    h.advance(secs(60)).await;
    let d = claim_one(h).await;
    assert_eq!(
        h.extend_typed("7", &p(10), secs(60).into()).await.unwrap(),
        Published::RearmQueued { id: 1 }
    );
    assert_eq!(
        h.cancel_typed::<Presence>("7").await.unwrap(),
        Cancelled::RearmDropped { id: 1 }
    );
    assert_eq!(
        h.cancel_typed::<Presence>("7").await.unwrap(),
        Cancelled::Running { id: 1 }
    );
    h.store().ack(d.lease).await.unwrap();
    assert_eq!(
        h.cancel_typed::<Presence>("7").await.unwrap(),
        Cancelled::NotFound
    );
    let e = h
        .extend_typed("", &p(1), Schedule::now())
        .await
        .unwrap_err();
    assert_eq!(invalid_field(e), "timer_id");
}

async fn invalid_input_is_rejected_before_anything_is_written<H: Harness>(h: &H) {
    let nul = headers(&[("a\0b", "v")]);
    let long_key = "k".repeat(256);
    let cases: Vec<(Message<'_>, &str)> = vec![
        (Message::new("", b"x"), "queue"),
        (Message::new("a\0b", b"x"), "queue"),
        (Message::new(Q, b"x").timer_id(""), "timer_id"),
        (Message::new(Q, b"x").timer_id(&long_key), "timer_id"),
        (
            Message::new(Q, b"x").on_conflict(OnConflict::Extend),
            "on_conflict",
        ),
        (Message::new(Q, b"x").headers(&nul), "headers"),
        (
            Message::new(Q, b"x").schedule(TimeDelta::seconds(-1)),
            "schedule",
        ),
        (
            Message::new(Q, b"x").schedule(TimeDelta::days(366 * 10_001)),
            "schedule",
        ),
    ];
    for (m, field) in cases {
        let e = h.publish(m).await.unwrap_err();
        assert_eq!(invalid_field(e), field, "{m:?}");
    }
    // Absolute deadlines are kept to whole microseconds, far past and far future alike.
    let fine = start() + TimeDelta::nanoseconds(1_234_567);
    assert_eq!(
        publish(h, schedule("a", b"x", fine)).await,
        Published::Inserted { id: 1 }
    );
    assert_eq!(only_row(h).await.next_attempt_at, start() + us(1234));
    let past: DateTime<Utc> = "1900-01-01T00:00:00Z".parse().unwrap();
    assert_eq!(
        publish(h, schedule("b", b"x", past)).await,
        Published::Inserted { id: 2 }
    );
    assert_eq!(rows(h, Q).await[0].next_attempt_at, past);
}

/// An extend with a slack writes only a move of more than the slack, of a pending
/// deadline or of a queued rearm; a running row without a rearm always gets one.
async fn an_extend_with_slack_skips_small_moves<H: Harness>(h: &H) {
    let slack = secs(10);
    publish(h, extend("k", b"p0", at(60))).await;
    let pending = timer_row(1, "k", b"p0", at(60));

    // Pending row: a move of at most the slack writes nothing (payload kept too).
    for due in [at(61), at(70)] {
        assert_eq!(
            publish(h, extend("k", b"small", due).slack(slack)).await,
            Published::Unchanged
        );
    }
    assert_eq!(only_row(h).await, pending);
    // More than the slack: written as a plain extend would.
    assert_eq!(
        publish(h, extend("k", b"p1", at(70) + us(1)).slack(slack)).await,
        Published::Extended { id: 1 }
    );
    assert_eq!(only_row(h).await, timer_row(1, "k", b"p1", at(70) + us(1)));
    // A zero slack is the plain extend.
    assert_eq!(
        publish(h, extend("k", b"p2", at(71)).slack(Duration::ZERO)).await,
        Published::Extended { id: 1 }
    );

    // Running row without a rearm: the slack does not apply, any later deadline queues.
    h.advance(secs(71)).await;
    let d = claim_one(h).await;
    let running = leased(timer_row(1, "k", b"p2", at(71)), &d, at(71), 1);
    assert_eq!(
        publish(h, extend("k", b"r1", at(72)).slack(secs(3600))).await,
        Published::RearmQueued { id: 1 }
    );
    let queued = with_rearm(running.clone(), at(72), b"r1");
    assert_eq!(only_row(h).await, queued);
    // Running row with a rearm: measured from the rearm.
    assert_eq!(
        publish(h, extend("k", b"r-small", at(82)).slack(slack)).await,
        Published::Unchanged
    );
    assert_eq!(only_row(h).await, queued);
    assert_eq!(
        publish(h, extend("k", b"r2", at(83)).slack(slack)).await,
        Published::RearmQueued { id: 1 }
    );
    assert_eq!(only_row(h).await, with_rearm(running, at(83), b"r2"));

    // Bad slacks are refused before anything is written.
    let rows_before = rows(h, Q).await;
    let e = h
        .publish(
            extend("k", b"x", at(900)).slack(outbox::message::MAX_SLACK + us(1).to_std().unwrap()),
        )
        .await
        .unwrap_err();
    assert_eq!(invalid_field(e), "slack");
    let e = h
        .publish(schedule("other", b"x", at(900)).slack(slack))
        .await
        .unwrap_err();
    assert_eq!(invalid_field(e), "slack");
    assert_eq!(rows(h, Q).await, rows_before);
}

contract! {
    publish_outcomes_use_up_ids_only_when_they_insert(dead_letter = true);
    writes_to_a_held_key_use_up_no_id(dead_letter = true);
    extend_of_a_pending_row_moves_later_only_and_resets_history(dead_letter = true);
    an_extend_with_slack_skips_small_moves(dead_letter = true);
    a_batch_inserts_rows_in_item_order(dead_letter = true);
    typed_functions_publish_through_the_store(dead_letter = true);
    invalid_input_is_rejected_before_anything_is_written(dead_letter = true);
}
