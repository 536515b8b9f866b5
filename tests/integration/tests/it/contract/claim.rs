//! Claiming (SPEC §6): due rows and expired leases, in deadline order under a limit, the
//! queue filter, round robin across queues within their limits, exclusions and `peek`.

use super::*;

async fn claim_of_an_unleased_due_row<H: Harness>(h: &H) {
    let hs = headers(&[("content-type", "application/json")]);
    assert_eq!(
        publish(h, Message::new(Q, b"a").headers(&hs)).await,
        Published::Inserted { id: 1 }
    );
    h.advance(secs(5)).await;
    let got = claim(h, &[Q], 10).await;
    assert_eq!(got.len(), 1);
    let d = &got[0];
    assert_eq!(
        d,
        &Delivery {
            lease: Lease {
                id: 1,
                token: d.lease.token
            },
            queue: Q.to_owned(),
            payload: b"a".to_vec(),
            headers: Some(hs.clone()),
            timer_id: None,
            attempts_count: 0,
            deliveries_count: 1,
            created_at: at(0),
            deadline: at(0),
            first_attempt_at: None,
            claimed_at: at(5),
            decode_error: None,
        }
    );
    let want = StoredRow {
        headers: Some(hs),
        ..leased(row(1, Q, b"a", at(0)), d, at(5), 1)
    };
    assert_eq!(only_row(h).await, want);
    assert!(
        claim(h, &[Q], 10).await.is_empty(),
        "a leased row is not claimed again"
    );
}

async fn a_future_row_is_not_claimed_before_its_deadline<H: Harness>(h: &H) {
    publish(h, plain(b"a", 10)).await;
    assert!(claim(h, &[Q], 10).await.is_empty());
    h.advance(secs(10) - Duration::from_micros(1)).await;
    assert!(claim(h, &[Q], 10).await.is_empty(), "one microsecond early");
    assert_eq!(only_row(h).await, row(1, Q, b"a", at(10)));
    h.advance(Duration::from_micros(1)).await;
    let d = claim_one(h).await;
    assert_eq!(
        (d.deadline, d.claimed_at),
        (at(10), at(10)),
        "due at its deadline exactly"
    );
}

async fn an_expired_lease_is_reclaimed_with_a_new_token<H: Harness>(h: &H) {
    publish(h, plain(b"a", 0)).await;
    let first = claim_one(h).await;
    h.advance(TTL).await;
    assert!(
        claim(h, &[Q], 10).await.is_empty(),
        "a lease exactly lease_ttl old still holds"
    );
    h.advance(Duration::from_micros(1)).await;
    let second = claim_one(h).await;
    assert_ne!(second.lease.token, first.lease.token);
    assert_eq!(second.lease.id, 1);
    assert_eq!(second.deliveries_count, 2);
    assert_eq!(second.attempts_count, 0);
    assert_eq!(
        (second.deadline, second.claimed_at),
        (at(0), at(30) + us(1))
    );
    assert_eq!(
        only_row(h).await,
        leased(row(1, Q, b"a", at(0)), &second, at(30) + us(1), 2)
    );
}

async fn a_fresh_lease_is_not_reclaimed<H: Harness>(h: &H) {
    publish(h, plain(b"a", 0)).await;
    let d = claim_one(h).await;
    let before = only_row(h).await;
    h.advance(secs(29)).await;
    assert!(claim(h, &[Q], 10).await.is_empty());
    assert_eq!(only_row(h).await, before);
    assert_eq!(before, leased(row(1, Q, b"a", at(0)), &d, at(0), 1));
}

async fn the_oldest_rows_are_chosen_under_a_limit<H: Harness>(h: &H) {
    for (p, delay) in [(b"1", 5), (b"2", 3), (b"3", 4), (b"4", 1), (b"5", 2)] {
        publish(h, plain(p, delay)).await;
    }
    h.advance(secs(10)).await;
    assert_eq!(ids(&claim(h, &[Q], 2).await), vec![4, 5]);
    assert_eq!(ids(&claim(h, &[Q], 2).await), vec![2, 3]);
    let last = claim(h, &[Q], 2).await;
    assert_eq!(ids(&last), vec![1]);
    assert_eq!(last[0].deadline, at(5));
    // Equal deadlines come back in id order.
    h.publish_batch(
        Q2,
        &[
            BatchItem::new(b"x"),
            BatchItem::new(b"y"),
            BatchItem::new(b"z"),
        ],
        Schedule::now(),
    )
    .await
    .unwrap();
    assert_eq!(ids(&claim(h, &[Q2], 10).await), vec![6, 7, 8]);
}

async fn expired_leases_and_due_rows_are_taken_by_deadline<H: Harness>(h: &H) {
    publish(h, plain(b"old", 0)).await; // 1, due at 0, claimed and then lost
    let lost = claim_one(h).await;
    publish(h, plain(b"new", 10)).await; // 2, due at 10
    h.advance(secs(40)).await;
    publish(h, plain(b"newest", 0)).await; // 3, due at 40
    let got = claim(h, &[Q], 2).await;
    assert_eq!(
        ids(&got),
        vec![1, 2],
        "the reclaim and the older due row, by deadline"
    );
    assert_ne!(got[0].lease.token, lost.lease.token);
    assert_eq!(
        got[0].lease.token, got[1].lease.token,
        "one token per claim"
    );
    assert_eq!(ids(&claim(h, &[Q], 2).await), vec![3]);
}

async fn the_limit_is_respected<H: Harness>(h: &H) {
    for i in 0..5u8 {
        publish(h, plain(&[b'a' + i], 0)).await;
        h.advance(secs(1)).await;
    }
    assert!(claim(h, &[Q], 0).await.is_empty(), "limit 0 claims nothing");
    assert!(rows(h, Q).await.iter().all(|r| r.acquired_token.is_none()));
    assert_eq!(ids(&claim(h, &[Q], 3).await), vec![1, 2, 3]);
    assert_eq!(ids(&claim(h, &[Q], 3).await), vec![4, 5]);
    assert!(claim(h, &[Q], 3).await.is_empty());
}

/// SPEC §6 (v2): a claim takes the served queues round robin, each queue's rows by
/// deadline, so one queue's backlog of older rows never holds back another's due rows; and
/// per-queue limits cap each queue's share.
async fn claims_take_queues_round_robin_within_their_limits<H: Harness>(h: &H) {
    for i in 0..5u8 {
        publish(h, Message::new(Q, &[b'a', b'0' + i])).await; // ids 1..=5 at 0..=4
        h.advance(secs(1)).await;
    }
    publish(h, Message::new(Q2, b"b")).await; // id 6 at 5
    h.advance(secs(1)).await;

    let got = claim(h, &[Q, Q2], 3).await;
    assert_eq!(
        ids(&got),
        vec![1, 6, 2],
        "each queue's oldest row first, then each queue's second"
    );

    let queues = [Q.to_owned(), Q2.to_owned()];
    let bad = h
        .store()
        .claim(ClaimRequest::new(&queues, 10, TTL).queue_limits(&[1]))
        .await;
    assert!(
        matches!(
            bad,
            Err(Error::InvalidArgument {
                field: "queue_limits",
                ..
            })
        ),
        "{bad:?}"
    );
    let limits = [1, 0];
    let got = h
        .store()
        .claim(ClaimRequest::new(&queues, 10, TTL).queue_limits(&limits))
        .await
        .expect("claim");
    assert_eq!(ids(&got), vec![3], "at most one of {Q}, none of {Q2}");

    // A queue named twice gets the smaller of its limits.
    let twice = [Q.to_owned(), Q.to_owned()];
    let got = h
        .store()
        .claim(ClaimRequest::new(&twice, 10, TTL).queue_limits(&[5, 1]))
        .await
        .expect("claim");
    assert_eq!(ids(&got), vec![4]);
    let all_zero = h
        .store()
        .claim(ClaimRequest::new(&queues, 10, TTL).queue_limits(&[0, 0]))
        .await
        .expect("claim");
    assert!(all_zero.is_empty());
    assert_eq!(ids(&claim(h, &[Q, Q2], 10).await), vec![5]);
}

async fn the_queue_filter<H: Harness>(h: &H) {
    publish(h, Message::new(Q, b"q1")).await; // 1 at 0
    h.advance(secs(1)).await;
    publish(h, Message::new(Q2, b"q2")).await; // 2 at 1
    h.advance(secs(1)).await;
    publish(h, Message::new(Q3, b"q3")).await; // 3 at 2
    h.advance(secs(1)).await;
    publish(h, Message::new(Q2, b"q2b")).await; // 4 at 3
    publish(h, Message::new(Q, b"q1b")).await; // 5 at 3

    assert!(claim(h, &["nobody"], 10).await.is_empty());
    let got = claim(h, &[Q3, Q2], 10).await;
    assert_eq!(
        ids(&got),
        vec![2, 3, 4],
        "both queues round robin, {Q2} before {Q3} by name, each by deadline"
    );
    assert_eq!(
        got.iter().map(|d| d.queue.as_str()).collect::<Vec<_>>(),
        vec![Q2, Q3, Q2]
    );
    let q3 = StoredRow {
        created_at: at(2),
        ..row(3, Q3, b"q3", at(2))
    };
    assert_eq!(rows(h, Q3).await, vec![leased(q3, &got[1], at(3), 1)]);
    assert!(
        rows(h, Q).await.iter().all(|r| r.acquired_token.is_none()),
        "{Q} untouched"
    );
    let got = claim(h, &[Q], 10).await;
    assert_eq!(ids(&got), vec![1, 5]);
    for q in [Q, Q2, Q3] {
        assert!(
            rows(h, q).await.iter().all(|r| r.deliveries_count == 1),
            "{q}: claimed once"
        );
    }
}

async fn an_empty_queue_list_and_bad_arguments<H: Harness>(h: &H) {
    publish(h, plain(b"a", 0)).await;
    assert!(claim(h, &[], 10).await.is_empty());
    assert_eq!(only_row(h).await, row(1, Q, b"a", at(0)), "nothing leased");
    let bad = [String::new()];
    let e = h
        .store()
        .claim(ClaimRequest::new(&bad, 0, TTL))
        .await
        .unwrap_err();
    assert_eq!(
        invalid_field(e),
        "queue",
        "names are checked before anything else"
    );
    let long = ["q".repeat(256)];
    assert_eq!(
        invalid_field(
            h.store()
                .claim(ClaimRequest::new(&long, 10, TTL))
                .await
                .unwrap_err()
        ),
        "queue"
    );
    let e = h
        .store()
        .claim(ClaimRequest::new(&[Q.to_owned()], 10, Duration::MAX))
        .await
        .unwrap_err();
    assert_eq!(invalid_field(e), "lease_ttl");
    assert_eq!(only_row(h).await, row(1, Q, b"a", at(0)));
}

/// A queue named twice is served once: duplicates do not eat into the limit.
async fn a_queue_named_twice_does_not_shrink_the_claim<H: Harness>(h: &H) {
    for p in [b"a", b"b", b"c"] {
        publish(h, plain(p, 0)).await;
    }
    let got = claim(h, &[Q, Q], 2).await;
    assert_eq!(ids(&got), vec![1, 2], "{}", H::NAME);
    let next = h
        .store()
        .next_wakeup(ClaimRequest::new(&[Q.to_owned(), Q.to_owned()], 0, TTL))
        .await
        .unwrap();
    assert_eq!(next.deadline, Some(at(0)));
}

/// SPEC §6, §7.4, §7.8: a claim leaves out the rows it is told to, takes only among the
/// rows it is told to, and `peek` lists what a claim would take without taking it.
async fn claim_exclude_only_and_peek<H: Harness>(h: &H) {
    for p in [b"a", b"b", b"c", b"d"] {
        publish(h, plain(p, 0)).await; // 1..=4
    }
    let queues = [Q.to_owned()];
    let peeked = h
        .store()
        .peek(ClaimRequest::new(&queues, 3, TTL).excluding(&[2]))
        .await
        .unwrap();
    assert_eq!(
        peeked,
        vec![(1, Q.to_owned()), (3, Q.to_owned()), (4, Q.to_owned())]
    );
    assert!(
        rows(h, Q).await.iter().all(|r| r.acquired_token.is_none()),
        "peek takes nothing"
    );
    let got = h
        .store()
        .claim(
            ClaimRequest::new(&queues, 10, TTL)
                .only(&[3, 4, 99])
                .excluding(&[4]),
        )
        .await
        .unwrap();
    assert_eq!(ids(&got), vec![3]);
    let next = h
        .store()
        .next_wakeup(ClaimRequest::new(&queues, 0, TTL).excluding(&[1, 2, 4]))
        .await
        .unwrap();
    assert_eq!(
        next.deadline, None,
        "excluded rows are left out of the wake-up too"
    );
    assert_eq!(next.lease_expiry, Some(at(30)), "row 3's lease");
    let rest = h
        .store()
        .claim(ClaimRequest::new(&queues, 10, TTL).excluding(&[1]))
        .await
        .unwrap();
    assert_eq!(ids(&rest), vec![2, 4]);
}

contract! {
    claim_of_an_unleased_due_row(dead_letter = true);
    a_future_row_is_not_claimed_before_its_deadline(dead_letter = true);
    an_expired_lease_is_reclaimed_with_a_new_token(dead_letter = true);
    a_fresh_lease_is_not_reclaimed(dead_letter = true);
    the_oldest_rows_are_chosen_under_a_limit(dead_letter = true);
    expired_leases_and_due_rows_are_taken_by_deadline(dead_letter = true);
    the_limit_is_respected(dead_letter = true);
    the_queue_filter(dead_letter = true);
    claims_take_queues_round_robin_within_their_limits(dead_letter = true);
    an_empty_queue_list_and_bad_arguments(dead_letter = true);
    a_queue_named_twice_does_not_shrink_the_claim(dead_letter = true);
    claim_exclude_only_and_peek(dead_letter = true);
}
