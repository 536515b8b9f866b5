//! Wake-ups (SPEC §7.3): the next deadline or lease expiry a sleeping worker waits for, and
//! the hints that inserts and completions making a row due send.

use super::*;

async fn next_wakeup_reports_the_earliest_deadline_and_lease_expiry<H: Harness>(h: &H) {
    let qs = |qs: &[&str]| qs.iter().map(|q| (*q).to_owned()).collect::<Vec<_>>();
    let w = h
        .store()
        .next_wakeup(ClaimRequest::new(&qs(&[Q]), 0, TTL))
        .await
        .unwrap();
    assert_eq!((w.now, w.deadline, w.lease_expiry), (at(0), None, None));
    publish(h, plain(b"a", 0)).await;
    publish(h, plain(b"b", 50)).await;
    publish(h, Message::new(Q2, b"c").schedule(secs(20))).await;
    claim_one(h).await;
    h.advance(secs(10)).await;
    let w = h
        .store()
        .next_wakeup(ClaimRequest::new(&qs(&[Q]), 0, TTL))
        .await
        .unwrap();
    assert_eq!(
        (w.now, w.deadline, w.lease_expiry),
        (at(10), Some(at(50)), Some(at(30)))
    );
    assert_eq!(w.earliest(), Some(at(30)));
    let w = h
        .store()
        .next_wakeup(ClaimRequest::new(&qs(&[Q, Q2]), 0, secs(60)))
        .await
        .unwrap();
    assert_eq!((w.deadline, w.lease_expiry), (Some(at(20)), Some(at(60))));
    let w = h
        .store()
        .next_wakeup(ClaimRequest::new(&[], 0, TTL))
        .await
        .unwrap();
    assert_eq!((w.now, w.deadline, w.lease_expiry), (at(10), None, None));
    let e = h
        .store()
        .next_wakeup(ClaimRequest::new(&qs(&[Q]), 0, Duration::MAX))
        .await
        .unwrap_err();
    assert_eq!(invalid_field(e), "lease_ttl");
    assert_eq!(h.store().now().await.unwrap(), at(10));
}

async fn inserts_and_completions_that_make_a_row_due_send_a_wakeup_hint<H: Harness>(h: &H) {
    let mut hints = h
        .store()
        .wakeups()
        .await
        .unwrap()
        .expect("both stores push hints");
    publish(h, plain(b"a", 5)).await;
    let due = at(10) + us(1_234);
    publish(h, extend("k", b"t", due)).await;
    // An extend of a pending row, a rearm, a skipped publish: no hint (SPEC §2.4).
    assert_eq!(
        publish(h, extend("k", b"t2", at(20))).await,
        Published::Extended { id: 2 }
    );
    assert_eq!(
        publish(h, schedule("k", b"x", at(30))).await,
        Published::Skipped
    );
    h.advance(secs(20)).await;
    let d = claim(h, &[Q], 10).await;
    assert_eq!(d.len(), 2);
    assert_eq!(
        publish(h, extend("k", b"t3", secs(60))).await,
        Published::RearmQueued { id: 2 }
    );
    h.store()
        .ack_batch(&[d[0].lease, d[1].lease])
        .await
        .unwrap();
    // One hint per batch; then a marker, so nothing can hide between the expected hints.
    h.publish_batch(
        Q2,
        &[BatchItem::new(b"1"), BatchItem::new(b"2")],
        secs(7).into(),
    )
    .await
    .unwrap();
    publish(h, Message::new(Q3, b"marker")).await;
    let hint = |queue: &str, at: DateTime<Utc>| Wakeup::Published {
        queue: queue.to_owned(),
        at,
    };
    // The batched ack applied the rearm queued at 20 s + 60 s: the row is due again, and
    // that is announced like a publish.
    let want = vec![
        hint(Q, at(5)),
        hint(Q, at(10) + TimeDelta::milliseconds(1)),
        hint(Q, at(80)),
        hint(Q2, at(27)),
        hint(Q3, at(20)),
    ];
    let got = next_hints(&mut hints, want.len()).await;
    assert_eq!(
        got, want,
        "deadlines at millisecond precision, as the NOTIFY payload carries"
    );
}

/// Bad queue names are rejected by next_wakeup before any SQL.
async fn next_wakeup_validates_queue_names<H: Harness>(h: &H) {
    for bad in ["", "a\0b"] {
        let err = h
            .store()
            .next_wakeup(ClaimRequest::new(&[bad.to_owned()], 0, TTL))
            .await
            .unwrap_err();
        assert!(
            matches!(err, Error::InvalidArgument { field: "queue", .. }),
            "{}: {err:?}",
            H::NAME
        );
    }
}

contract! {
    next_wakeup_reports_the_earliest_deadline_and_lease_expiry(dead_letter = true);
    inserts_and_completions_that_make_a_row_due_send_a_wakeup_hint(dead_letter = true);
    next_wakeup_validates_queue_names(dead_letter = true);
}
