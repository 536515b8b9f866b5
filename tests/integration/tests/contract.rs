//! The contract suite (SPEC §10, issue 3): every storage scenario is written once, as a
//! function generic over [`Harness`], and runs against Postgres (`postgres::*`) and the
//! in-memory store (`memory::*`) with the same hand-written expected values.
//!
//! Both stores start at [`start`] (2030-01-01T00:00:00Z) and their clocks move only when a
//! scenario advances them, so expected timestamps are exact: `at(5)` is five seconds after
//! the start. See `outbox_tests::contract` for how Postgres gets such a clock.

use std::time::Duration;

use chrono::{DateTime, TimeDelta, Utc};
use outbox::dlq::{DeadLetterFilter, Redrive, RedriveOutcome, RedriveResult, REDRIVEN_FROM_HEADER};
use outbox::store::MAX_LAST_ERROR_BYTES;
use outbox::{
    admin::RowAction,
    message::{BatchItem, Headers, OnConflict, Schedule, MAX_HEADERS_BYTES},
    stats::{Count, QueueStats, StatsMode, StatsRequest},
    store::{
        Armed, ClaimRequest, Completion, DeadLetter, Delivery, Failure, FailureReason, Lease,
        RegisterSchedule, Registered, Release, Released, Renewal, Store, StoredRow, Wakeup,
        SCHEDULE_HEADER,
    },
    Cancelled, Error, Message, Published,
};
use outbox_tests::contract::{start, Harness, MemHarness, PgHarness};
use uuid::Uuid;

const Q: &str = "q.main";
const Q2: &str = "q.other";
const Q3: &str = "q.third";
const TTL: Duration = Duration::from_secs(30);

/// `s` seconds after the start.
fn at(s: i64) -> DateTime<Utc> {
    start() + TimeDelta::seconds(s)
}

fn us(n: i64) -> TimeDelta {
    TimeDelta::microseconds(n)
}

fn secs(s: u64) -> Duration {
    Duration::from_secs(s)
}

/// A plain message on `Q`, due `delay_s` seconds from now.
fn plain(payload: &[u8], delay_s: u64) -> Message<'_> {
    Message::new(Q, payload).schedule(secs(delay_s))
}

/// `extend` of timer `key` on `Q` to `schedule`.
fn extend<'a>(key: &'a str, payload: &'a [u8], schedule: impl Into<Schedule>) -> Message<'a> {
    Message::new(Q, payload)
        .timer_id(key)
        .schedule(schedule)
        .on_conflict(OnConflict::Extend)
}

/// `publish` (Ignore) of timer `key` on `Q` to `schedule`.
fn schedule<'a>(key: &'a str, payload: &'a [u8], schedule: impl Into<Schedule>) -> Message<'a> {
    Message::new(Q, payload).timer_id(key).schedule(schedule)
}

/// The next `n` wake-up hints, each within 10 s.
async fn next_hints(hints: &mut tokio::sync::mpsc::Receiver<Wakeup>, n: usize) -> Vec<Wakeup> {
    let mut got = Vec::with_capacity(n);
    while got.len() < n {
        let next = tokio::time::timeout(secs(10), hints.recv()).await;
        got.push(
            next.expect("a hint within 10 s")
                .expect("the hint channel is open"),
        );
    }
    got
}

fn rejected(last_error: Option<&str>) -> Failure<'_> {
    Failure {
        reason: FailureReason::Rejected,
        last_error,
    }
}

/// The row a fresh publish at `at(0)` writes: pending, no history.
fn row(id: i64, queue: &str, payload: &[u8], due: DateTime<Utc>) -> StoredRow {
    StoredRow {
        id,
        queue: queue.to_owned(),
        payload: payload.to_vec(),
        headers: None,
        attempts_count: 0,
        deliveries_count: 0,
        created_at: at(0),
        next_attempt_at: due,
        first_attempt_at: None,
        last_attempt_at: None,
        acquired_at: None,
        acquired_token: None,
        timer_id: None,
        rearm_at: None,
        rearm_payload: None,
        rearm_headers: None,
        cancelled_at: None,
        raw_headers: None,
        raw_rearm_headers: None,
    }
}

/// `row` as a timer.
fn timer_row(id: i64, key: &str, payload: &[u8], due: DateTime<Utc>) -> StoredRow {
    StoredRow {
        timer_id: Some(key.to_owned()),
        ..row(id, Q, payload, due)
    }
}

/// `r` leased by `d` at `claimed`, after `deliveries` claims.
fn leased(r: StoredRow, d: &Delivery, claimed: DateTime<Utc>, deliveries: i32) -> StoredRow {
    StoredRow {
        acquired_token: Some(d.lease.token),
        acquired_at: Some(claimed),
        deliveries_count: deliveries,
        ..r
    }
}

fn with_rearm(r: StoredRow, rearm_at: DateTime<Utc>, payload: &[u8]) -> StoredRow {
    StoredRow {
        rearm_at: Some(rearm_at),
        rearm_payload: Some(payload.to_vec()),
        ..r
    }
}

fn headers(pairs: &[(&str, &str)]) -> Headers {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

async fn publish<H: Harness>(h: &H, m: Message<'_>) -> Published {
    h.publish(m).await.expect("publish")
}

async fn claim<H: Harness>(h: &H, queues: &[&str], limit: usize) -> Vec<Delivery> {
    let queues: Vec<String> = queues.iter().map(|q| (*q).to_owned()).collect();
    h.store()
        .claim(ClaimRequest::new(&queues, limit, TTL))
        .await
        .expect("claim")
}

async fn claim_one<H: Harness>(h: &H) -> Delivery {
    let mut got = claim(h, &[Q], 10).await;
    assert_eq!(
        got.len(),
        1,
        "{}: expected one claimable row: {got:#?}",
        H::NAME
    );
    got.remove(0)
}

fn ids(ds: &[Delivery]) -> Vec<i64> {
    ds.iter().map(|d| d.lease.id).collect()
}

async fn rows<H: Harness>(h: &H, queue: &str) -> Vec<StoredRow> {
    h.pending(queue, 1000).await.expect("pending")
}

async fn only_row<H: Harness>(h: &H) -> StoredRow {
    let mut rows = rows(h, Q).await;
    assert_eq!(
        rows.len(),
        1,
        "{}: expected exactly one row: {rows:#?}",
        H::NAME
    );
    rows.remove(0)
}

async fn dead_letters<H: Harness>(h: &H) -> Vec<DeadLetter> {
    h.dead_letters(Q, 1000).await.expect("dead letters")
}

fn wrong(lease: Lease) -> Lease {
    Lease {
        id: lease.id,
        token: Uuid::new_v4(),
    }
}

fn invalid_field(e: Error) -> &'static str {
    match e {
        Error::InvalidArgument { field, .. } => field,
        other => panic!("expected an invalid argument, got {other:?}"),
    }
}

// ---------------------------------------------------------------------------------------
// Claim (SPEC §6)

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
        "both queues, by deadline across them"
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
    assert_eq!(invalid_field(e), "duration");
    assert_eq!(only_row(h).await, row(1, Q, b"a", at(0)));
}

// ---------------------------------------------------------------------------------------
// Fenced completions (SPEC §5.1, §5.2)

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

// ---------------------------------------------------------------------------------------
// Publish, extend, rearm, cancel (SPEC §2.2, §3, §4, §5)

async fn publish_outcomes_use_up_ids_like_an_identity_column<H: Harness>(h: &H) {
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
    // The skipped and the unchanged publish each used up an id.
    assert_eq!(
        publish(h, plain(b"p", 0)).await,
        Published::Inserted { id: 4 }
    );
    // Rejected input uses up nothing.
    let e = h.publish(Message::new("", b"x")).await.unwrap_err();
    assert_eq!(invalid_field(e), "queue");
    assert_eq!(
        publish(h, extend("other", b"o", secs(5))).await,
        Published::Inserted { id: 5 }
    );
    let rows = rows(h, Q).await;
    assert_eq!(
        rows,
        vec![
            row(4, Q, b"p", at(0)),
            timer_row(5, "other", b"o", at(5)),
            timer_row(1, "k", b"v1", at(60)),
        ]
    );
    // The same key in another queue is another timer.
    let other = Message::new(Q2, b"v").timer_id("k");
    assert_eq!(publish(h, other).await, Published::Inserted { id: 6 });
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
    publish(h, plain(b"plain", 0)).await; // id 3 (the extend used id 2)
    publish(h, plain(b"other", 0)).await; // id 4
    let got = claim(h, &[Q], 10).await;
    assert_eq!(ids(&got), vec![3, 4]);
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
                ..leased(row(4, Q, b"other", at(2)), &got[1], at(2), 1)
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
        Published::Inserted { id: 3 }
    );
    assert_eq!(only_row(h).await, timer_row(3, "k", b"c", at(5)));
}

// ---------------------------------------------------------------------------------------
// Reads, wake-ups, batches, typed functions, validation

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
    assert_eq!(invalid_field(e), "duration");
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

async fn pending_reads_live_rows_by_deadline_with_a_limit<H: Harness>(h: &H) {
    publish(h, plain(b"a", 30)).await; // 1
    publish(h, plain(b"b", 0)).await; // 2
    publish(h, plain(b"c", 10)).await; // 3
    publish(h, Message::new(Q2, b"d")).await; // 4
    let d = claim_one(h).await;
    assert_eq!(d.lease.id, 2);
    let all = rows(h, Q).await;
    assert_eq!(
        all.iter().map(|r| r.id).collect::<Vec<_>>(),
        vec![2, 3, 1],
        "leased rows included"
    );
    let two = h.pending(Q, 2).await.unwrap();
    assert_eq!(two, all[..2].to_vec());
    assert!(h.pending(Q, 0).await.unwrap().is_empty());
    assert!(h.pending("nobody", 10).await.unwrap().is_empty());
    assert_eq!(invalid_field(h.pending("", 10).await.unwrap_err()), "queue");
    assert_eq!(
        invalid_field(h.dead_letters("", 10).await.unwrap_err()),
        "queue"
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

// ---------------------------------------------------------------------------------------

/// Runs each scenario against both stores: `postgres::<name>` and `memory::<name>`.
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

/// Issue 14: an extend with a slack writes only a move of more than the slack, of a pending
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

// ---------------------------------------------------------------------------------------
// Dead letters: list, redrive, purge (issue 16; SPEC §1.2, §8)

/// Publishes `payload` on `queue` (timer `key` if given, with `hs` if given) due now, claims
/// it and fails it with `reason` (last error "e"): one dead letter archived at the current
/// clock. Returns the queue row's id.
async fn archive<H: Harness>(
    h: &H,
    queue: &str,
    key: Option<&str>,
    payload: &[u8],
    hs: Option<&Headers>,
    reason: FailureReason,
) -> i64 {
    let mut m = Message::new(queue, payload);
    if let Some(k) = key {
        m = m.timer_id(k);
    }
    if let Some(hs) = hs {
        m = m.headers(hs);
    }
    let id = publish(h, m).await.id().expect("a fresh row");
    let mut got = claim(h, &[queue], 10).await;
    assert_eq!(got.len(), 1, "{}: one row to fail", H::NAME);
    let d = got.remove(0);
    assert_eq!(d.lease.id, id);
    let failure = Failure {
        reason,
        last_error: Some("e"),
    };
    assert_eq!(
        h.store().fail(d.lease, failure).await.unwrap(),
        Completion::Deleted
    );
    id
}

async fn list<H: Harness>(
    h: &H,
    f: DeadLetterFilter,
    after: Option<i64>,
    limit: usize,
) -> Vec<i64> {
    h.list_dead_letters(&f, after, limit)
        .await
        .expect("list dead letters")
        .iter()
        .map(|d| d.id)
        .collect()
}

fn every() -> DeadLetterFilter {
    DeadLetterFilter::new()
}

fn outcome(dead_letter_id: i64, result: RedriveResult) -> RedriveOutcome {
    RedriveOutcome {
        dead_letter_id,
        result,
    }
}

fn redriven(dead_letter_id: i64, id: i64) -> RedriveOutcome {
    outcome(dead_letter_id, RedriveResult::Redriven { id })
}

async fn dead_letters_are_listed_by_filter_and_paged<H: Harness>(h: &H) {
    archive(h, Q, None, b"a", None, FailureReason::Rejected).await; // dlq 1 at 0 s
    h.advance(secs(10)).await;
    archive(h, Q2, None, b"b", None, FailureReason::RetryExhausted).await; // dlq 2 at 10 s
    h.advance(secs(10)).await;
    archive(h, Q, None, b"c", None, FailureReason::DecodeError).await; // dlq 3 at 20 s
    h.advance(secs(10)).await;
    archive(h, Q, None, b"d", None, FailureReason::Rejected).await; // dlq 4 at 30 s
    h.advance(secs(10)).await; // now 40 s

    let all = h.list_dead_letters(&every(), None, 100).await.unwrap();
    assert_eq!(all.iter().map(|d| d.id).collect::<Vec<_>>(), [1, 2, 3, 4]);
    assert_eq!(
        all[0],
        DeadLetter {
            id: 1,
            original_id: 1,
            queue: Q.to_owned(),
            payload: b"a".to_vec(),
            headers: None,
            raw_headers: None,
            timer_id: None,
            attempts_count: 1,
            deliveries_count: 1,
            created_at: at(0),
            failed_at: at(0),
            failure_reason: "rejected".to_owned(),
            last_error: Some("e".to_owned()),
            redriven_at: None,
            redriven_id: None,
        }
    );
    assert_eq!(list(h, every().queue(Q), None, 100).await, [1, 3, 4]);
    assert_eq!(
        list(
            h,
            every().queue(Q).reason(FailureReason::Rejected),
            None,
            100
        )
        .await,
        [1, 4]
    );
    assert_eq!(
        list(h, every().reason(FailureReason::RetryExhausted), None, 100).await,
        [2]
    );
    assert_eq!(
        list(
            h,
            every().failed_after(at(10)).failed_before(at(30)),
            None,
            100
        )
        .await,
        [2, 3],
        "half-open: from 10 s, before 30 s"
    );
    assert_eq!(list(h, every().failed_after(at(30)), None, 100).await, [4]);
    assert_eq!(list(h, every().failed_before(at(10)), None, 100).await, [1]);
    assert_eq!(
        list(h, every().older_than(secs(20)), None, 100).await,
        [1, 2],
        "older than 20 s at 40 s: before 20 s"
    );
    assert!(list(h, every().queue("nobody"), None, 100).await.is_empty());
    let millennium = secs(1000 * 366 * 24 * 3600);
    assert!(
        list(h, every().older_than(millennium), None, 100)
            .await
            .is_empty(),
        "the longest age is a time Postgres can compute"
    );

    // Keyset paging on the id.
    assert_eq!(list(h, every(), None, 2).await, [1, 2]);
    assert_eq!(list(h, every(), Some(2), 2).await, [3, 4]);
    assert!(list(h, every(), Some(4), 2).await.is_empty());
    assert_eq!(list(h, every().queue(Q), None, 2).await, [1, 3]);
    assert_eq!(list(h, every().queue(Q), Some(3), 2).await, [4]);
    assert!(list(h, every(), None, 0).await.is_empty());

    // Redriven rows are listed by default, with their link; `include_redriven(false)`
    // leaves them out.
    assert_eq!(h.redrive(&Redrive::id(1)).await.unwrap(), [redriven(1, 5)]);
    let first = &h.list_dead_letters(&every(), None, 1).await.unwrap()[0];
    assert_eq!(
        (first.redriven_at, first.redriven_id),
        (Some(at(40)), Some(5))
    );
    assert_eq!(list(h, every(), None, 100).await, [1, 2, 3, 4]);
    assert_eq!(
        list(h, every().include_redriven(false), None, 100).await,
        [2, 3, 4]
    );

    // Bad filters, before anything is read.
    let bad = |f: DeadLetterFilter| async move {
        invalid_field(h.list_dead_letters(&f, None, 10).await.unwrap_err())
    };
    assert_eq!(bad(every().queue("")).await, "queue");
    assert_eq!(bad(every().queue("q".repeat(256))).await, "queue");
    assert_eq!(
        bad(every().failed_after(at(30)).failed_before(at(10))).await,
        "failed_at",
        "inverted"
    );
    assert_eq!(
        bad(every().failed_after(at(10)).failed_before(at(10))).await,
        "failed_at",
        "empty"
    );
    assert_eq!(
        bad(every().older_than(millennium + secs(1))).await,
        "older_than"
    );
}

async fn redrive_publishes_dead_letters_again_into_their_queue<H: Harness>(h: &H) {
    let hs = headers(&[("trace", "t-1")]);
    publish(h, Message::new(Q, b"p1").timer_id("k1").headers(&hs)).await; // 1
    let d = claim_one(h).await;
    h.advance(secs(1)).await;
    h.store().retry(d.lease, Duration::ZERO).await.unwrap();
    h.advance(secs(1)).await;
    let d = claim_one(h).await;
    h.advance(secs(1)).await;
    h.store().fail(d.lease, rejected(Some("x"))).await.unwrap(); // dlq 1 at 3 s
    archive(h, Q2, None, b"p2", None, FailureReason::Rejected).await; // 2, dlq 2
    archive(h, Q, None, b"p3", None, FailureReason::Timeout).await; // 3, dlq 3
    archive(h, Q, None, b"p4", None, FailureReason::Rejected).await; // 4, dlq 4
    archive(h, Q, None, b"p5", None, FailureReason::Rejected).await; // 5, dlq 5
    h.advance(secs(7)).await; // 10 s

    // One: the original queue, payload, headers and key; fresh counters; due now.
    assert_eq!(h.redrive(&Redrive::id(1)).await.unwrap(), [redriven(1, 6)]);
    let mut want_headers = hs.clone();
    want_headers.insert(REDRIVEN_FROM_HEADER.to_owned(), "1".to_owned());
    let new_row = StoredRow {
        headers: Some(want_headers),
        created_at: at(10),
        ..timer_row(6, "k1", b"p1", at(10))
    };
    assert_eq!(rows(h, Q).await, vec![new_row.clone()]);
    let letter = &h.list_dead_letters(&every(), None, 1).await.unwrap()[0];
    assert_eq!(
        (
            letter.attempts_count,
            letter.deliveries_count,
            letter.redriven_at,
            letter.redriven_id
        ),
        (2, 2, Some(at(10)), Some(6)),
        "the dead letter keeps its history and gains the link"
    );

    // Once only; unknown ids are reported, not skipped; an id named twice counts once.
    assert_eq!(
        h.redrive(&Redrive::ids([99, 1, 1])).await.unwrap(),
        [
            outcome(
                1,
                RedriveResult::AlreadyRedriven {
                    redriven_id: Some(6)
                }
            ),
            outcome(99, RedriveResult::NotFound),
        ]
    );
    assert_eq!(rows(h, Q).await, vec![new_row.clone()], "nothing new");
    assert!(h.redrive(&Redrive::ids([])).await.unwrap().is_empty());
    // Ids below 1 are a mistake, refused before any SQL (found by the issue-16 trial: they
    // were reported `NotFound`, unlike `run_now`'s).
    for bad in [0, -3] {
        let e = h.redrive(&Redrive::ids([1, bad])).await.unwrap_err();
        assert_eq!(invalid_field(e), "id");
    }

    // Many by filter, lowest ids first, up to the limit, never a redriven one.
    h.advance(secs(5)).await; // 15 s
    assert!(h
        .redrive(&Redrive::matching(every(), 0))
        .await
        .unwrap()
        .is_empty());
    assert_eq!(
        h.redrive(&Redrive::matching(every().queue(Q), 2))
            .await
            .unwrap(),
        [redriven(3, 7), redriven(4, 8)]
    );
    assert_eq!(
        h.redrive(&Redrive::matching(every().include_redriven(true), 10))
            .await
            .unwrap(),
        [redriven(2, 9), redriven(5, 10)],
        "include_redriven cannot make a redrive take a row twice"
    );
    assert!(h
        .redrive(&Redrive::matching(every(), 10))
        .await
        .unwrap()
        .is_empty());
    assert_eq!(
        rows(h, Q2).await,
        vec![StoredRow {
            headers: Some(headers(&[(REDRIVEN_FROM_HEADER, "2")])),
            created_at: at(15),
            ..row(9, Q2, b"p2", at(15))
        }]
    );
    assert!(list(h, every().include_redriven(false), None, 10)
        .await
        .is_empty());

    // The new rows are ordinary rows: claimed (delivery 1, no history) and completed.
    let got = claim(h, &[Q], 10).await;
    assert_eq!(ids(&got), [6, 7, 8, 10]);
    assert_eq!(
        (
            got[0].attempts_count,
            got[0].deliveries_count,
            got[0].timer_id.as_deref(),
            got[0]
                .headers
                .as_ref()
                .map(|h| h[REDRIVEN_FROM_HEADER].as_str())
        ),
        (0, 1, Some("k1"), Some("1"))
    );
    for d in &got {
        assert_eq!(h.store().ack(d.lease).await.unwrap(), Completion::Deleted);
    }
    assert_eq!(
        publish(h, Message::new(Q, b"next")).await,
        Published::Inserted { id: 11 },
        "every redrive used up exactly one id"
    );
}

async fn redrive_gives_per_row_outcomes_and_leaves_refused_rows_alone<H: Harness>(h: &H) {
    archive(h, Q, Some("held"), b"h", None, FailureReason::Rejected).await; // 1, dlq 1
    assert_eq!(
        publish(h, schedule("held", b"live", secs(60))).await,
        Published::Inserted { id: 2 },
        "the key is scheduled again"
    );
    let live = only_row(h).await;
    let raw = |json: &str| DeadLetter {
        id: 0,
        original_id: 1000,
        queue: Q.to_owned(),
        payload: b"r".to_vec(),
        headers: None,
        raw_headers: Some(json.to_owned()),
        timer_id: None,
        attempts_count: 0,
        deliveries_count: 1,
        created_at: at(0),
        failed_at: at(0),
        failure_reason: "decode_error".to_owned(),
        last_error: Some("headers".to_owned()),
        redriven_at: None,
        redriven_id: None,
    };
    assert_eq!(h.insert_dead_letter(raw(r#"["not","a","map"]"#)).await, 2);
    assert_eq!(h.insert_dead_letter(raw(r#"{"n":1}"#)).await, 3);
    // Headers 5 bytes under the limit: the redrive header (20 + 1 bytes) pushes them over.
    let big = headers(&[("k", &"v".repeat(MAX_HEADERS_BYTES - 6))]);
    archive(h, Q, None, b"big", Some(&big), FailureReason::Rejected).await; // 3, dlq 4
    archive(h, Q, None, b"ok", None, FailureReason::Rejected).await; // 4, dlq 5
    let before = h.list_dead_letters(&every(), None, 10).await.unwrap();
    assert_eq!(before.len(), 5);
    assert_eq!(
        before[1].raw_headers.as_deref(),
        Some(r#"["not","a","map"]"#)
    );

    assert_eq!(
        h.redrive(&Redrive::ids(1..=5)).await.unwrap(),
        [
            outcome(1, RedriveResult::TimerKeyHeld),
            outcome(2, RedriveResult::HeadersNotAMap),
            outcome(3, RedriveResult::HeadersNotAMap),
            outcome(
                4,
                RedriveResult::HeadersTooLarge {
                    bytes: MAX_HEADERS_BYTES + 16
                }
            ),
            // The held key's insert used up id 5, as an identity does under ON CONFLICT.
            redriven(5, 6),
        ]
    );
    let after = h.list_dead_letters(&every(), None, 10).await.unwrap();
    assert_eq!(
        after[..4],
        before[..4],
        "refused rows are left as they were"
    );
    assert_eq!(
        rows(h, Q).await,
        vec![
            StoredRow {
                headers: Some(headers(&[(REDRIVEN_FROM_HEADER, "5")])),
                ..row(6, Q, b"ok", at(0))
            },
            live.clone(),
        ],
        "the live timer is untouched"
    );

    // Once the key is free, the dead letter can go back.
    assert_eq!(
        h.cancel(Q, "held").await.unwrap(),
        Cancelled::Deleted { id: 2 }
    );
    assert_eq!(h.redrive(&Redrive::id(1)).await.unwrap(), [redriven(1, 7)]);

    // Two dead letters of one key in one redrive: the lower id goes back, the other finds
    // the key held by it.
    archive(h, Q2, Some("dup"), b"d1", None, FailureReason::Rejected).await; // 8, dlq 6
    archive(h, Q2, Some("dup"), b"d2", None, FailureReason::Rejected).await; // 9, dlq 7
    assert_eq!(
        h.redrive(&Redrive::matching(every().queue(Q2), 10))
            .await
            .unwrap(),
        [redriven(6, 10), outcome(7, RedriveResult::TimerKeyHeld)]
    );
    assert_eq!(
        rows(h, Q2)
            .await
            .iter()
            .map(|r| (r.id, r.payload.clone()))
            .collect::<Vec<_>>(),
        [(10, b"d1".to_vec())]
    );
    assert_eq!(
        publish(h, Message::new(Q3, b"next")).await,
        Published::Inserted { id: 12 }
    );
}

async fn a_redrive_wakes_workers_once_per_queue<H: Harness>(h: &H) {
    archive(h, Q, None, b"a", None, FailureReason::Rejected).await;
    archive(h, Q, None, b"b", None, FailureReason::Rejected).await;
    archive(h, Q2, None, b"c", None, FailureReason::Rejected).await;
    h.advance(secs(5)).await;
    let mut hints = h
        .store()
        .wakeups()
        .await
        .unwrap()
        .expect("both stores push hints");
    let done = h.redrive(&Redrive::ids([1, 2, 3])).await.unwrap();
    assert_eq!(done, [redriven(1, 4), redriven(2, 5), redriven(3, 6)]);
    publish(h, Message::new(Q3, b"marker").schedule(secs(1))).await;
    let hint = |queue: &str, at: DateTime<Utc>| Wakeup::Published {
        queue: queue.to_owned(),
        at,
    };
    let mut got = next_hints(&mut hints, 3).await;
    // The queues of one statement notify in no particular order; the marker comes last.
    let marker = got.pop();
    assert_eq!(marker, Some(hint(Q3, at(6))));
    got.sort_by_key(|w| format!("{w:?}"));
    assert_eq!(got, [hint(Q, at(5)), hint(Q2, at(5))]);
}

async fn dead_letters_are_purged_by_age_in_batches<H: Harness>(h: &H) {
    archive(h, Q, None, b"a", None, FailureReason::Rejected).await; // dlq 1 at 0 s
    h.advance(secs(10)).await;
    archive(h, Q2, None, b"b", None, FailureReason::Rejected).await; // dlq 2 at 10 s
    h.advance(secs(10)).await;
    archive(h, Q, None, b"c", None, FailureReason::Rejected).await; // dlq 3 at 20 s
    h.advance(secs(10)).await;
    archive(h, Q, None, b"d", None, FailureReason::Rejected).await; // dlq 4 at 30 s
    assert_eq!(h.redrive(&Redrive::id(1)).await.unwrap(), [redriven(1, 5)]);
    h.advance(secs(10)).await; // 40 s

    let bad = |f: DeadLetterFilter, batch: usize| async move {
        invalid_field(h.purge_dead_letters(&f, batch).await.unwrap_err())
    };
    assert_eq!(bad(every().queue(Q), 10).await, "filter", "no age bound");
    assert_eq!(bad(every().older_than(secs(1)), 0).await, "batch_size");
    assert_eq!(
        bad(every().queue("").older_than(secs(1)), 10).await,
        "queue"
    );
    assert_eq!(list(h, every(), None, 10).await, [1, 2, 3, 4]);

    let purge = |f: DeadLetterFilter, batch: usize| async move {
        h.purge_dead_letters(&f, batch).await.expect("purge")
    };
    assert_eq!(
        purge(every().older_than(secs(25)).include_redriven(false), 10).await,
        1,
        "before 15 s and not redriven: dlq 2 only"
    );
    assert_eq!(list(h, every(), None, 10).await, [1, 3, 4]);
    assert_eq!(
        purge(every().older_than(secs(25)), 1).await,
        1,
        "batches of one: the redriven dlq 1"
    );
    assert_eq!(purge(every().failed_before(at(30)).queue(Q2), 10).await, 0);
    assert_eq!(list(h, every(), None, 10).await, [3, 4]);
    archive(h, Q2, None, b"e", None, FailureReason::Rejected).await; // dlq 5 at 40 s
    assert_eq!(
        purge(every().older_than(secs(10)), 1).await,
        1,
        "before 30 s: dlq 3; dlq 4 at exactly 30 s stays"
    );
    h.advance(Duration::from_micros(1)).await;
    assert_eq!(
        purge(every().failed_before(at(50)), 1).await,
        2,
        "two batches"
    );
    assert!(list(h, every(), None, 10).await.is_empty());
    assert_eq!(rows(h, Q).await.len(), 1, "the redriven row lives on");
}

async fn dead_letter_operations_refuse_without_the_dead_letter_queue<H: Harness>(h: &H) {
    assert!(!h.store().dead_letter_enabled());
    let off = |e: Error| assert!(matches!(e, Error::DeadLetterDisabled), "{e:?}");
    off(h.list_dead_letters(&every(), None, 10).await.unwrap_err());
    // The setting is checked first, before the arguments.
    off(h
        .list_dead_letters(&every().queue(""), None, 10)
        .await
        .unwrap_err());
    off(h.redrive(&Redrive::id(1)).await.unwrap_err());
    off(h
        .redrive(&Redrive::matching(every(), 10))
        .await
        .unwrap_err());
    off(h
        .purge_dead_letters(&every().older_than(secs(1)), 10)
        .await
        .unwrap_err());
    assert!(format!("{:?}", Error::DeadLetterDisabled).contains("dead_letter(true)"));
}

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

// ---------------------------------------------------------------------------------------
// Queue statistics (SPEC §8)

/// The figures of one queue as a tuple: `(queue, pending, due, leased, expired_leases,
/// oldest_due_lateness, rearms, cancel_marks, dead_letters)`.
type Figures = (
    String,
    Count,
    Count,
    Count,
    Count,
    Option<Duration>,
    Count,
    Count,
    Count,
);

fn figures(s: &QueueStats) -> Figures {
    (
        s.queue.clone(),
        s.pending,
        s.due,
        s.leased,
        s.expired_leases,
        s.oldest_due_lateness,
        s.rearms,
        s.cancel_marks,
        s.dead_letters,
    )
}

/// Exact figures, in the order of [`Figures`] (lateness in whole seconds).
#[allow(clippy::too_many_arguments)]
fn exact(
    queue: &str,
    pending: u64,
    due: u64,
    leased: u64,
    expired: u64,
    late_s: Option<u64>,
    rearms: u64,
    cancel_marks: u64,
    dead: Count,
) -> Figures {
    (
        queue.to_owned(),
        Count::Exact(pending),
        Count::Exact(due),
        Count::Exact(leased),
        Count::Exact(expired),
        late_s.map(secs),
        Count::Exact(rearms),
        Count::Exact(cancel_marks),
        dead,
    )
}

async fn stats<H: Harness>(h: &H, request: &StatsRequest) -> Result<Vec<Figures>, Error> {
    let got = h.store().queue_stats(request).await?;
    let got = got.unwrap_or_else(|| panic!("{}: the store has no statistics", H::NAME));
    Ok(got.iter().map(figures).collect())
}

/// Rows in every state on three queues, read at t = 45 s:
///
/// - `Q`: timer `k1` leased at 0 with a queued rearm, timer `k2` leased at 0 with a cancel
///   mark, a plain row leased at 0, a row due at 10 (late by 35 s), a row due at 1010, one
///   dead letter;
/// - `Q2`: a row leased at 30, a row due at 15 (late by 30 s);
/// - `Q3`: only a dead letter.
async fn crafted_states<H: Harness>(h: &H) {
    publish(h, Message::new(Q, b"k1").timer_id("k1")).await;
    publish(h, Message::new(Q, b"k2").timer_id("k2")).await;
    publish(h, Message::new(Q, b"plain")).await;
    publish(h, Message::new(Q, b"to-dlq")).await;
    publish(h, Message::new(Q3, b"to-dlq")).await;
    assert_eq!(claim(h, &[Q], 4).await.len(), 4);
    let q3 = claim(h, &[Q3], 1).await;
    let failed = claim(h, &[Q], 10).await;
    assert!(failed.is_empty(), "{}: {failed:#?}", H::NAME);
    // The two plain rows of Q were claimed last (ids 3 and 4): fail the fourth, and Q3's.
    let held = rows(h, Q).await;
    let fourth = held.iter().find(|r| r.payload == b"to-dlq").unwrap();
    let lease = Lease {
        id: fourth.id,
        token: fourth.acquired_token.unwrap(),
    };
    h.store().fail(lease, rejected(Some("no"))).await.unwrap();
    h.store()
        .fail(q3[0].lease, rejected(Some("no")))
        .await
        .unwrap();

    h.advance(secs(10)).await;
    assert!(matches!(
        publish(h, extend("k1", b"k1 again", secs(60))).await,
        Published::RearmQueued { .. }
    ));
    assert!(matches!(
        h.cancel(Q, "k2").await.unwrap(),
        Cancelled::Running { .. }
    ));
    publish(h, plain(b"due at 10", 0)).await;
    publish(h, plain(b"due at 1010", 1000)).await;
    publish(h, Message::new(Q2, b"due at 10")).await;
    publish(h, Message::new(Q2, b"due at 15").schedule(secs(5))).await;
    h.advance(secs(20)).await;
    assert_eq!(claim(h, &[Q2], 1).await.len(), 1);
    h.advance(secs(15)).await;
}

async fn stats_count_every_state_per_queue<H: Harness>(h: &H) {
    crafted_states(h).await;
    let dead = Count::Exact;
    // Default TTL 40 s: Q's leases (45 s old) expired, Q2's (15 s old) not.
    let ttl = StatsRequest::new(secs(40));
    assert_eq!(
        stats(h, &ttl).await.unwrap(),
        vec![
            exact(Q, 2, 1, 3, 3, Some(35), 1, 1, dead(1)),
            exact(Q2, 1, 1, 1, 0, Some(30), 0, 0, dead(0)),
            exact(Q3, 0, 0, 0, 0, None, 0, 0, dead(1)),
        ],
        "{}",
        H::NAME
    );
    // Per-queue TTLs: Q's workers hold leases for 50 s (none expired), Q2's for 10 s (its
    // lease, 15 s old, expired). Exactly at the TTL a lease is not expired yet (`<`).
    let per_queue = ttl
        .clone()
        .lease_ttl_for(Q, secs(50))
        .lease_ttl_for(Q2, secs(10));
    let got = stats(h, &per_queue).await.unwrap();
    assert_eq!(got[0], exact(Q, 2, 1, 3, 0, Some(35), 1, 1, dead(1)));
    assert_eq!(got[1], exact(Q2, 1, 1, 1, 1, Some(30), 0, 0, dead(0)));
    let edge = StatsRequest::new(secs(45)).lease_ttl_for(Q2, secs(15));
    let got = stats(h, &edge).await.unwrap();
    assert_eq!((got[0].4, got[1].4), (Count::Exact(0), Count::Exact(0)));
    // A queue list: those queues only, each once, a queue without rows with zeros.
    let listed = ttl.clone().queues(["q.none", Q2, Q3, Q2]);
    assert_eq!(
        stats(h, &listed).await.unwrap(),
        vec![
            exact("q.none", 0, 0, 0, 0, None, 0, 0, dead(0)),
            exact(Q2, 1, 1, 1, 0, Some(30), 0, 0, dead(0)),
            exact(Q3, 0, 0, 0, 0, None, 0, 0, dead(1)),
        ]
    );
    assert!(stats(h, &ttl.clone().queues(Vec::<String>::new()))
        .await
        .unwrap()
        .is_empty());
    // A claim (lease TTL 30 s) takes the due rows and Q's expired leases, deleting the
    // cancelled one instead of delivering it: nothing is due or expired any more, the row
    // due at 1010 stays pending, k1's rearm stays queued.
    assert_eq!(claim(h, &[Q, Q2], 10).await.len(), 4);
    let got = stats(h, &ttl.queues([Q])).await.unwrap();
    assert_eq!(got, vec![exact(Q, 1, 0, 3, 0, None, 1, 0, dead(1))]);
}

async fn stats_without_the_dead_letter_queue<H: Harness>(h: &H) {
    crafted_states(h).await;
    // Terminal failures deleted their rows: Q3 has nothing left, and dead letters are not
    // measured.
    let none = Count::Unavailable;
    assert_eq!(
        stats(h, &StatsRequest::new(secs(40))).await.unwrap(),
        vec![
            exact(Q, 2, 1, 3, 3, Some(35), 1, 1, none),
            exact(Q2, 1, 1, 1, 0, Some(30), 0, 0, none),
        ]
    );
    let listed = StatsRequest::new(secs(40)).queues([Q3]);
    assert_eq!(
        stats(h, &listed).await.unwrap(),
        vec![exact(Q3, 0, 0, 0, 0, None, 0, 0, none)]
    );
}

async fn stats_reject_bad_requests<H: Harness>(h: &H) {
    publish(h, plain(b"x", 0)).await;
    let ok = StatsRequest::new(secs(30));
    let bad = [
        (StatsRequest::new(Duration::ZERO), "lease_ttl"),
        (ok.clone().lease_ttl_for(Q, Duration::ZERO), "lease_ttl"),
        (ok.clone().lease_ttl_for("", secs(1)), "queue"),
        (ok.clone().queues(["", Q]), "queue"),
        (ok.clone().queues(["a\0b"]), "queue"),
        (ok.clone().queues(["q".repeat(256)]), "queue"),
        (
            ok.clone()
                .mode(StatsMode::Estimate)
                .queues(["q".repeat(256)]),
            "queue",
        ),
    ];
    for (request, field) in bad {
        let e = stats(h, &request).await.unwrap_err();
        assert_eq!(invalid_field(e), field, "{}: {request:?}", H::NAME);
    }
    assert_eq!(stats(h, &ok).await.unwrap().len(), 1);
}

/// A redriven dead letter is no longer counted as one: the statistics count
/// `redriven_at IS NULL`, and the redriven row is pending in its queue again.
async fn stats_do_not_count_redriven_dead_letters<H: Harness>(h: &H) {
    archive(h, Q, None, b"a", None, FailureReason::Rejected).await;
    let request = StatsRequest::new(TTL).queues([Q]);
    assert_eq!(
        stats(h, &request).await.unwrap(),
        [exact(Q, 0, 0, 0, 0, None, 0, 0, Count::Exact(1))]
    );
    let done = h.redrive(&Redrive::id(1)).await.unwrap();
    assert!(done[0].result.id().is_some(), "{done:?}");
    assert_eq!(
        stats(h, &request).await.unwrap(),
        [exact(Q, 1, 1, 0, 0, Some(0), 0, 0, Count::Exact(0))]
    );
}

// ---------------------------------------------------------------------------------------
// Periodic timers (SPEC §9.1): arming the next instant at the start of a run, registration

const SCHED: &str = "schedule:nightly";

/// A schedule's headers: the fingerprint of schedule `fp`, one letter naming an interval
/// (`"A"` is every 1 s, `"B"` every 2 s, …), or none at all for `""`.
fn fingerprint(fp: &str) -> Headers {
    let text = match fp.as_bytes() {
        [] => String::new(),
        [letter] => format!("every:{}s", letter - b'A' + 1),
        _ => panic!("one letter: {fp:?}"),
    };
    headers(&[(SCHEDULE_HEADER, &text)])
}

async fn register<H: Harness>(h: &H, payload: &[u8], fp: &str, first: DateTime<Utc>) -> Registered {
    let hs = fingerprint(fp);
    h.store()
        .register_schedule(RegisterSchedule::new(Q, SCHED, payload, &hs, first))
        .await
        .expect("register")
}

/// The pending row of the schedule as registered at `at(0)`.
fn schedule_row(id: i64, payload: &[u8], fp: &str, due: DateTime<Utc>) -> StoredRow {
    StoredRow {
        headers: Some(fingerprint(fp)),
        ..timer_row(id, SCHED, payload, due)
    }
}

/// `r` with the rearm `arm_next` or a registration queues.
fn armed(r: StoredRow, rearm_at: DateTime<Utc>, payload: &[u8], fp: &str) -> StoredRow {
    StoredRow {
        rearm_headers: Some(fingerprint(fp)),
        ..with_rearm(r, rearm_at, payload)
    }
}

async fn arm_next_queues_the_next_instant_fenced_by_the_token<H: Harness>(h: &H) {
    assert_eq!(
        register(h, b"s", "A", at(0)).await,
        Registered::Inserted { id: 1, at: at(0) }
    );
    h.advance(secs(5)).await;
    let d = claim_one(h).await;
    let running = leased(schedule_row(1, b"s", "A", at(0)), &d, at(5), 1);
    assert_eq!(
        h.store().arm_next(wrong(d.lease), at(60)).await.unwrap(),
        Armed::LeaseLost
    );
    assert_eq!(only_row(h).await, running, "a wrong token writes nothing");
    assert_eq!(
        h.store().arm_next(d.lease, at(60)).await.unwrap(),
        Armed::Queued { at: at(60) }
    );
    assert_eq!(
        only_row(h).await,
        armed(running.clone(), at(60), b"s", "A"),
        "the row's own payload and headers"
    );
    // A queued rearm of the same schedule that is not earlier stays (a reclaimed run
    // finds the one its crashed predecessor queued).
    for earlier_or_same in [at(30), at(60)] {
        assert_eq!(
            h.store().arm_next(d.lease, earlier_or_same).await.unwrap(),
            Armed::Kept { at: at(60) }
        );
    }
    // An earlier one is replaced by the later next instant.
    assert_eq!(
        h.store().arm_next(d.lease, at(90)).await.unwrap(),
        Armed::Queued { at: at(90) }
    );
    assert_eq!(only_row(h).await, armed(running, at(90), b"s", "A"));
    // Success applies it unchanged: the next instance, pending at the next instant.
    assert_eq!(
        h.store().ack(d.lease).await.unwrap(),
        Completion::Rearmed { at: at(90) }
    );
    assert_eq!(only_row(h).await, schedule_row(1, b"s", "A", at(90)));
    assert_eq!(
        h.store().arm_next(d.lease, at(120)).await.unwrap(),
        Armed::LeaseLost,
        "an unleased row is never armed"
    );
    assert_eq!(only_row(h).await, schedule_row(1, b"s", "A", at(90)));
}

async fn schedule_keys_are_reserved_for_registrations<H: Harness>(h: &H) {
    register(h, b"s", "A", at(0)).await;
    // A publish or extend of a `schedule:` key (the registered one or any other) is
    // refused before anything is written: only registrations write those rows.
    for message in [
        extend(SCHED, b"user", at(500)),
        schedule(SCHED, b"user", at(500)),
        Message::new(Q, b"user").timer_id("schedule:other"),
    ] {
        let e = h.publish(message).await.unwrap_err();
        assert_eq!(invalid_field(e), "timer_id", "{}", H::NAME);
    }
    let d = claim_one(h).await;
    let running = leased(schedule_row(1, b"s", "A", at(0)), &d, at(0), 1);
    let e = h
        .publish(extend(SCHED, b"user", at(500)))
        .await
        .unwrap_err();
    assert_eq!(invalid_field(e), "timer_id", "{}", H::NAME);
    assert_eq!(only_row(h).await, running, "nothing written");
    // Keys that only contain the prefix elsewhere are ordinary.
    assert!(matches!(
        publish(h, schedule("my-schedule:x", b"v", at(10))).await,
        Published::Inserted { .. }
    ));
}

async fn arm_next_never_arms_nor_clears_a_cancelled_row<H: Harness>(h: &H) {
    register(h, b"s", "A", at(0)).await;
    let d = claim_one(h).await;
    let running = leased(schedule_row(1, b"s", "A", at(0)), &d, at(0), 1);
    assert_eq!(
        h.cancel(Q, SCHED).await.unwrap(),
        Cancelled::Running { id: 1 }
    );
    assert_eq!(
        h.store().arm_next(d.lease, at(60)).await.unwrap(),
        Armed::Cancelled
    );
    assert_eq!(
        only_row(h).await,
        StoredRow {
            cancelled_at: Some(at(0)),
            ..running
        },
        "no rearm, the mark kept"
    );
    // The schedule stops: the run's end deletes the row.
    assert_eq!(h.store().ack(d.lease).await.unwrap(), Completion::Deleted);
    assert!(rows(h, Q).await.is_empty());
    // ... until the next registration, which inserts it again (id 2: the identity).
    assert_eq!(
        register(h, b"s", "A", at(60)).await,
        Registered::Inserted { id: 2, at: at(60) }
    );

    // A cancel after the next instant was armed drops it: the schedule stops too.
    h.advance(secs(60)).await;
    let d = claim_one(h).await;
    h.store().arm_next(d.lease, at(120)).await.unwrap();
    assert_eq!(
        h.cancel(Q, SCHED).await.unwrap(),
        Cancelled::RearmDropped { id: 2 }
    );
    assert_eq!(
        h.store().fail(d.lease, rejected(None)).await.unwrap(),
        Completion::Cancelled
    );
    assert!(rows(h, Q).await.is_empty());
    assert!(dead_letters(h).await.is_empty());
}

async fn registration_inserts_once_and_follows_a_changed_schedule<H: Harness>(h: &H) {
    assert_eq!(
        register(h, b"a", "A", at(60)).await,
        Registered::Inserted { id: 1, at: at(60) }
    );
    // The same fingerprint and payload: nothing written, whatever the first instant.
    assert_eq!(register(h, b"a", "A", at(10)).await, Registered::Unchanged);
    assert_eq!(register(h, b"a", "A", at(100)).await, Registered::Unchanged);
    assert_eq!(only_row(h).await, schedule_row(1, b"a", "A", at(60)));
    // Another fingerprint moves a pending row, earlier too, with the new payload.
    assert_eq!(
        register(h, b"b", "B", at(30)).await,
        Registered::Rescheduled { id: 1, at: at(30) }
    );
    assert_eq!(only_row(h).await, schedule_row(1, b"b", "B", at(30)));

    // A pending row waiting for a retry: moved, retry history reset, deliveries kept.
    h.advance(secs(30)).await;
    let d = claim_one(h).await;
    h.store().retry(d.lease, secs(10)).await.unwrap();
    assert_eq!(
        register(h, b"c", "C", at(35)).await,
        Registered::Rescheduled { id: 1, at: at(35) }
    );
    assert_eq!(
        only_row(h).await,
        StoredRow {
            deliveries_count: 1,
            ..schedule_row(1, b"c", "C", at(35))
        }
    );

    // A running row of the same schedule, no rearm yet: unchanged (its run arms the next).
    h.advance(secs(5)).await;
    let d = claim_one(h).await;
    assert_eq!(register(h, b"c", "C", at(70)).await, Registered::Unchanged);
    let running = leased(
        StoredRow {
            deliveries_count: 1,
            ..schedule_row(1, b"c", "C", at(35))
        },
        &d,
        at(35),
        2,
    );
    assert_eq!(only_row(h).await, running);
    assert_eq!(
        h.store().arm_next(d.lease, at(100)).await.unwrap(),
        Armed::Queued { at: at(100) }
    );
    // Another fingerprint replaces the queued rearm, earlier allowed.
    assert_eq!(
        register(h, b"d", "D", at(50)).await,
        Registered::RearmReplaced { id: 1, at: at(50) }
    );
    assert_eq!(only_row(h).await, armed(running.clone(), at(50), b"d", "D"));
    // The same fingerprint as the queued rearm: unchanged.
    assert_eq!(register(h, b"d", "D", at(40)).await, Registered::Unchanged);
    // A run of the old schedule arming its next instant keeps the registration's rearm.
    assert_eq!(
        h.store().arm_next(d.lease, at(100)).await.unwrap(),
        Armed::Kept { at: at(50) }
    );
    assert_eq!(only_row(h).await, armed(running, at(50), b"d", "D"));
    assert_eq!(
        h.store().ack(d.lease).await.unwrap(),
        Completion::Rearmed { at: at(50) }
    );
    assert_eq!(only_row(h).await, schedule_row(1, b"d", "D", at(50)));
}

async fn registration_brings_a_changed_payload_and_keeps_the_timing<H: Harness>(h: &H) {
    register(h, b"a", "A", at(60)).await;
    // A pending row waiting for a retry: the new payload, its deadline kept, retry history
    // reset (a fixed payload deserves fresh counts), deliveries kept.
    h.advance(secs(60)).await;
    let d = claim_one(h).await;
    h.store().retry(d.lease, secs(10)).await.unwrap();
    assert_eq!(
        register(h, b"b", "A", at(500)).await,
        Registered::Rescheduled { id: 1, at: at(70) }
    );
    assert_eq!(
        only_row(h).await,
        StoredRow {
            deliveries_count: 1,
            ..schedule_row(1, b"b", "A", at(70))
        }
    );
    assert_eq!(register(h, b"b", "A", at(500)).await, Registered::Unchanged);

    // A running row whose run armed its next instant: the rearm gets the new payload and
    // keeps its deadline; the run's end applies it.
    h.advance(secs(10)).await;
    let d = claim_one(h).await;
    let running = leased(
        StoredRow {
            deliveries_count: 1,
            ..schedule_row(1, b"b", "A", at(70))
        },
        &d,
        at(70),
        2,
    );
    h.store().arm_next(d.lease, at(130)).await.unwrap();
    assert_eq!(
        register(h, b"c", "A", at(500)).await,
        Registered::RearmReplaced { id: 1, at: at(130) }
    );
    assert_eq!(
        only_row(h).await,
        armed(running.clone(), at(130), b"c", "A")
    );
    assert_eq!(register(h, b"c", "A", at(500)).await, Registered::Unchanged);
    assert_eq!(
        h.store().ack(d.lease).await.unwrap(),
        Completion::Rearmed { at: at(130) }
    );
    assert_eq!(only_row(h).await, schedule_row(1, b"c", "A", at(130)));

    // A running row with no rearm yet: the first instant is queued with the new payload,
    // and the run's own next instant, not later, keeps it.
    h.advance(secs(60)).await;
    let d = claim_one(h).await;
    let running = leased(schedule_row(1, b"c", "A", at(130)), &d, at(130), 1);
    assert_eq!(
        register(h, b"d", "A", at(190)).await,
        Registered::RearmReplaced { id: 1, at: at(190) }
    );
    assert_eq!(
        only_row(h).await,
        armed(running.clone(), at(190), b"d", "A")
    );
    assert_eq!(
        h.store().arm_next(d.lease, at(190)).await.unwrap(),
        Armed::Kept { at: at(190) }
    );
    assert_eq!(only_row(h).await, armed(running, at(190), b"d", "A"));
}

async fn a_changed_schedule_keeps_an_overdue_instant<H: Harness>(h: &H) {
    register(h, b"a", "A", at(10)).await;
    // Workers were down past the instant: the new schedule takes the row (payload,
    // headers) but the missed instant keeps its deadline and fires at once.
    h.advance(secs(20)).await;
    assert_eq!(
        register(h, b"b", "B", at(25)).await,
        Registered::Rescheduled { id: 1, at: at(10) }
    );
    assert_eq!(only_row(h).await, schedule_row(1, b"b", "B", at(10)));
    let d = claim_one(h).await;
    assert_eq!((d.deadline, d.payload.as_slice()), (at(10), &b"b"[..]));
    // Not overdue: moved to the new first instant, later too.
    h.store().arm_next(d.lease, at(40)).await.unwrap();
    h.store().ack(d.lease).await.unwrap();
    assert_eq!(
        register(h, b"c", "C", at(90)).await,
        Registered::Rescheduled { id: 1, at: at(90) }
    );
}

async fn a_redriven_instant_runs_once_without_restarting_its_schedule<H: Harness>(h: &H) {
    register(h, b"s", "A", at(0)).await;
    let d = claim_one(h).await;
    h.store().arm_next(d.lease, at(60)).await.unwrap();
    assert_eq!(
        h.store()
            .fail(d.lease, rejected(Some("boom")))
            .await
            .unwrap(),
        Completion::Rearmed { at: at(60) }
    );
    let letters = dead_letters(h).await;
    assert_eq!(letters.len(), 1);
    assert_eq!(letters[0].timer_id.as_deref(), Some(SCHED));
    // The schedule's row is live, and the redrive is not refused for it: the instant goes
    // back as a one-off message, without the key and the fingerprint.
    let outcomes = h.redrive(&Redrive::id(letters[0].id)).await.unwrap();
    let [RedriveOutcome {
        result: RedriveResult::Redriven { id },
        ..
    }] = outcomes[..]
    else {
        panic!("{}: {outcomes:?}", H::NAME);
    };
    let again = rows(h, Q).await;
    let one_off = again.iter().find(|r| r.id == id).expect("the one-off row");
    assert_eq!(one_off.timer_id, None);
    assert_eq!(
        one_off.headers,
        Some(headers(&[(
            REDRIVEN_FROM_HEADER,
            &letters[0].id.to_string()
        )]))
    );
    assert_eq!(
        (one_off.payload.as_slice(), one_off.next_attempt_at),
        (&b"s"[..], at(0))
    );
    let schedule = again
        .iter()
        .find(|r| r.id != id)
        .expect("the schedule's row");
    assert_eq!(*schedule, schedule_row(1, b"s", "A", at(60)));
    // The two are independent: cancelling the schedule leaves the one-off row, which runs
    // once and is gone.
    assert_eq!(
        h.cancel(Q, SCHED).await.unwrap(),
        Cancelled::Deleted { id: 1 }
    );
    h.store().ack(claim_one(h).await.lease).await.unwrap();
    assert!(rows(h, Q).await.is_empty());
}

async fn registration_after_a_cancel_restarts_the_schedule<H: Harness>(h: &H) {
    // A pending row deleted by a cancel: inserted again.
    register(h, b"s", "A", at(10)).await;
    assert_eq!(
        h.cancel(Q, SCHED).await.unwrap(),
        Cancelled::Deleted { id: 1 }
    );
    assert_eq!(
        register(h, b"s", "A", at(10)).await,
        Registered::Inserted { id: 2, at: at(10) }
    );
    // A running row a cancel marked: the same schedule queues its first instant as the
    // rearm and clears the mark; the run's end applies it.
    h.advance(secs(10)).await;
    let d = claim_one(h).await;
    h.store().arm_next(d.lease, at(20)).await.unwrap();
    h.cancel(Q, SCHED).await.unwrap();
    assert_eq!(
        register(h, b"s", "A", at(30)).await,
        Registered::RearmReplaced { id: 2, at: at(30) }
    );
    let row = only_row(h).await;
    assert_eq!(
        (row.cancelled_at, row.rearm_at),
        (None, Some(at(30))),
        "{row:#?}"
    );
    assert_eq!(register(h, b"s", "A", at(40)).await, Registered::Unchanged);
    assert_eq!(
        h.store().renew(&[d.lease]).await.unwrap(),
        vec![Renewal::Renewed],
        "no longer cancelled"
    );
    assert_eq!(
        h.store().retry(d.lease, secs(3600)).await.unwrap(),
        Completion::Rearmed { at: at(30) }
    );
    assert_eq!(only_row(h).await.next_attempt_at, at(30));
}

async fn an_armed_instant_survives_every_way_a_run_ends<H: Harness>(h: &H) {
    register(h, b"s", "A", at(0)).await;
    // A retry yields to the next instant: history updated, deliveries kept.
    let d = claim_one(h).await;
    h.store().arm_next(d.lease, at(60)).await.unwrap();
    assert_eq!(
        h.store().retry(d.lease, secs(3600)).await.unwrap(),
        Completion::Rearmed { at: at(60) }
    );
    assert_eq!(
        only_row(h).await,
        StoredRow {
            attempts_count: 1,
            deliveries_count: 1,
            first_attempt_at: Some(at(0)),
            last_attempt_at: Some(at(0)),
            ..schedule_row(1, b"s", "A", at(60))
        }
    );
    // A terminal failure with the dead-letter queue: archived and re-armed.
    h.advance(secs(60)).await;
    let d = claim_one(h).await;
    h.store().arm_next(d.lease, at(120)).await.unwrap();
    assert_eq!(
        h.store().fail(d.lease, rejected(Some("no"))).await.unwrap(),
        Completion::Rearmed { at: at(120) }
    );
    assert_eq!(only_row(h).await, schedule_row(1, b"s", "A", at(120)));
    let dlq = dead_letters(h).await;
    assert_eq!(dlq.len(), 1, "{dlq:#?}");
    assert_eq!(
        (dlq[0].payload.as_slice(), dlq[0].timer_id.as_deref()),
        (&b"s"[..], Some(SCHED))
    );
    // A crash: the reclaiming run arms the same instant; it stays queued and applies once.
    h.advance(secs(60)).await;
    let stale = claim_one(h).await;
    h.store().arm_next(stale.lease, at(180)).await.unwrap();
    h.advance(TTL + secs(1)).await;
    let fresh = claim_one(h).await;
    assert_eq!(
        h.store().arm_next(fresh.lease, at(180)).await.unwrap(),
        Armed::Kept { at: at(180) }
    );
    assert_eq!(
        h.store().ack(stale.lease).await.unwrap(),
        Completion::LeaseLost
    );
    assert_eq!(
        h.store().ack(fresh.lease).await.unwrap(),
        Completion::Rearmed { at: at(180) }
    );
    assert_eq!(only_row(h).await, schedule_row(1, b"s", "A", at(180)));
}

async fn an_armed_instant_survives_a_terminal_failure_without_dead_letters<H: Harness>(h: &H) {
    register(h, b"s", "A", at(0)).await;
    let d = claim_one(h).await;
    h.store().arm_next(d.lease, at(60)).await.unwrap();
    let max = Failure {
        reason: FailureReason::MaxDeliveries,
        last_error: None,
    };
    assert_eq!(
        h.store().fail(d.lease, max).await.unwrap(),
        Completion::Rearmed { at: at(60) }
    );
    assert_eq!(only_row(h).await, schedule_row(1, b"s", "A", at(60)));
}

async fn registration_rejects_bad_requests_before_writing<H: Harness>(h: &H) {
    let good = fingerprint("A");
    let empty = fingerprint("");
    let none = headers(&[("other", "x")]);
    let unreadable = headers(&[(SCHEDULE_HEADER, "every 300s")]);
    let not_canonical = headers(&[(SCHEDULE_HEADER, "every:0300s")]);
    let long = "q".repeat(256);
    let cases: [(RegisterSchedule<'_>, &str); 9] = [
        (
            RegisterSchedule::new("", SCHED, b"s", &good, at(0)),
            "queue",
        ),
        (
            RegisterSchedule::new(&long, SCHED, b"s", &good, at(0)),
            "queue",
        ),
        (
            RegisterSchedule::new(Q, "nightly", b"s", &good, at(0)),
            "timer_id",
        ),
        (
            RegisterSchedule::new(Q, "schedule:", b"s", &good, at(0)),
            "timer_id",
        ),
        (
            RegisterSchedule::new(Q, SCHED, b"s", &none, at(0)),
            "headers",
        ),
        (
            RegisterSchedule::new(Q, SCHED, b"s", &empty, at(0)),
            "headers",
        ),
        (
            RegisterSchedule::new(Q, SCHED, b"s", &unreadable, at(0)),
            "headers",
        ),
        (
            RegisterSchedule::new(Q, SCHED, b"s", &not_canonical, at(0)),
            "headers",
        ),
        (
            RegisterSchedule::new(Q, SCHED, b"s", &good, DateTime::<Utc>::MIN_UTC),
            "first",
        ),
    ];
    for (request, field) in cases {
        let e = h.store().register_schedule(request).await.unwrap_err();
        assert_eq!(invalid_field(e), field, "{}: {request:?}", H::NAME);
    }
    assert!(rows(h, Q).await.is_empty());
    register(h, b"s", "A", at(0)).await;
    let d = claim_one(h).await;
    let e = h
        .store()
        .arm_next(d.lease, DateTime::<Utc>::MIN_UTC)
        .await
        .unwrap_err();
    assert_eq!(invalid_field(e), "at");
    assert_eq!(only_row(h).await.rearm_at, None);
}

async fn registrations_that_make_a_row_due_send_a_wakeup_hint<H: Harness>(h: &H) {
    let mut hints = h
        .store()
        .wakeups()
        .await
        .unwrap()
        .expect("both stores push hints");
    register(h, b"s", "A", at(10)).await; // inserted: a hint
    register(h, b"s", "A", at(5)).await; // unchanged: none
    register(h, b"s", "B", at(3)).await; // a pending row moved: a hint
    h.advance(secs(3)).await;
    let d = claim_one(h).await;
    // A rearm replaced on a running row: no hint (its completion sends one).
    assert_eq!(
        register(h, b"s", "C", at(50)).await,
        Registered::RearmReplaced { id: 1, at: at(50) }
    );
    h.store().ack(d.lease).await.unwrap();
    publish(h, Message::new(Q3, b"marker")).await;
    let hint = |queue: &str, at: DateTime<Utc>| Wakeup::Published {
        queue: queue.to_owned(),
        at,
    };
    let want = vec![
        hint(Q, at(10)),
        hint(Q, at(3)),
        hint(Q, at(50)),
        hint(Q3, at(3)),
    ];
    let got = next_hints(&mut hints, want.len()).await;
    assert_eq!(got, want);
}

macro_rules! contract {
    ($($name:ident(dead_letter = $dlq:expr);)*) => {
        mod postgres {
            use super::*;
            $(
                #[tokio::test]
                async fn $name() {
                    let h = PgHarness::new($dlq).await;
                    super::$name(&h).await;
                    h.finish().await;
                }
            )*
        }
        mod memory {
            use super::*;
            $(
                #[tokio::test]
                async fn $name() {
                    let h = MemHarness::new($dlq).await;
                    super::$name(&h).await;
                    h.finish().await;
                }
            )*
        }
    };
}

contract! {
    claim_of_an_unleased_due_row(dead_letter = true);
    a_paused_queue_is_skipped_by_claims_and_wakeups(dead_letter = true);
    pending_rows_are_run_now_rescheduled_or_deleted_by_id(dead_letter = false);
    a_future_row_is_not_claimed_before_its_deadline(dead_letter = true);
    an_expired_lease_is_reclaimed_with_a_new_token(dead_letter = true);
    a_fresh_lease_is_not_reclaimed(dead_letter = true);
    the_oldest_rows_are_chosen_under_a_limit(dead_letter = true);
    expired_leases_and_due_rows_are_taken_by_deadline(dead_letter = true);
    the_limit_is_respected(dead_letter = true);
    the_queue_filter(dead_letter = true);
    claims_take_queues_round_robin_within_their_limits(dead_letter = true);
    an_empty_queue_list_and_bad_arguments(dead_letter = true);
    ack_with_the_right_token_a_wrong_token_and_an_unleased_row(dead_letter = true);
    dead_letter_archive_contents(dead_letter = true);
    terminal_failure_without_the_dead_letter_queue(dead_letter = false);
    batched_ack_with_one_wrong_token_in_three(dead_letter = true);
    retry_with_the_right_token_a_wrong_token_and_an_unleased_row(dead_letter = true);
    publish_outcomes_use_up_ids_like_an_identity_column(dead_letter = true);
    extend_of_a_pending_row_moves_later_only_and_resets_history(dead_letter = true);
    a_rearm_is_queued_on_fresh_and_expired_leases_later_only(dead_letter = true);
    an_extend_with_slack_skips_small_moves(dead_letter = true);
    a_rearm_is_applied_by_the_single_delete(dead_letter = true);
    a_rearm_is_applied_by_the_batched_delete(dead_letter = true);
    a_rearm_is_applied_by_the_dead_letter_delete(dead_letter = true);
    a_rearm_is_applied_by_a_terminal_failure_without_dead_letters(dead_letter = false);
    a_rearm_is_kept_through_a_lost_lease(dead_letter = true);
    a_rearm_replaces_a_retry_and_keeps_deliveries(dead_letter = true);
    cancel_deletes_pending_drops_rearm_and_never_deletes_a_running_row(dead_letter = true);
    a_timer_key_is_free_again_once_its_row_is_gone(dead_letter = true);
    next_wakeup_reports_the_earliest_deadline_and_lease_expiry(dead_letter = true);
    inserts_and_completions_that_make_a_row_due_send_a_wakeup_hint(dead_letter = true);
    pending_reads_live_rows_by_deadline_with_a_limit(dead_letter = true);
    a_batch_inserts_rows_in_item_order(dead_letter = true);
    typed_functions_publish_through_the_store(dead_letter = true);
    invalid_input_is_rejected_before_anything_is_written(dead_letter = true);
    a_stale_and_a_fresh_lease_of_one_row_in_one_batch(dead_letter = true);
    a_queue_named_twice_does_not_shrink_the_claim(dead_letter = true);
    next_wakeup_validates_queue_names(dead_letter = true);
    a_cancelled_run_is_deleted_however_it_ends(dead_letter = true);
    a_reclaimed_cancelled_row_is_deleted_not_delivered(dead_letter = true);
    renew_keeps_leases_alive_and_reports_cancel_and_loss(dead_letter = true);
    release_gives_rows_back_as_the_table_says(dead_letter = true);
    claim_exclude_only_and_peek(dead_letter = true);
    fail_unclaimed_ends_only_unheld_rows(dead_letter = true);
    dead_letters_are_listed_by_filter_and_paged(dead_letter = true);
    redrive_publishes_dead_letters_again_into_their_queue(dead_letter = true);
    redrive_gives_per_row_outcomes_and_leaves_refused_rows_alone(dead_letter = true);
    a_redrive_wakes_workers_once_per_queue(dead_letter = true);
    dead_letters_are_purged_by_age_in_batches(dead_letter = true);
    dead_letter_operations_refuse_without_the_dead_letter_queue(dead_letter = false);
    stats_count_every_state_per_queue(dead_letter = true);
    stats_without_the_dead_letter_queue(dead_letter = false);
    stats_reject_bad_requests(dead_letter = true);
    stats_do_not_count_redriven_dead_letters(dead_letter = true);
    arm_next_queues_the_next_instant_fenced_by_the_token(dead_letter = true);
    schedule_keys_are_reserved_for_registrations(dead_letter = true);
    arm_next_never_arms_nor_clears_a_cancelled_row(dead_letter = true);
    registration_inserts_once_and_follows_a_changed_schedule(dead_letter = true);
    registration_brings_a_changed_payload_and_keeps_the_timing(dead_letter = true);
    a_changed_schedule_keeps_an_overdue_instant(dead_letter = true);
    a_redriven_instant_runs_once_without_restarting_its_schedule(dead_letter = true);
    registration_after_a_cancel_restarts_the_schedule(dead_letter = true);
    an_armed_instant_survives_every_way_a_run_ends(dead_letter = true);
    an_armed_instant_survives_a_terminal_failure_without_dead_letters(dead_letter = false);
    registration_rejects_bad_requests_before_writing(dead_letter = true);
    registrations_that_make_a_row_due_send_a_wakeup_hint(dead_letter = true);
}
