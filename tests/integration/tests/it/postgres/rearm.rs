//! Extend on running rows (SPEC §5), the fenced completions of §5.1 and cancel (§3), each
//! checked against the exact row contents afterwards.

use sqlx::AssertSqlSafe;
use std::time::Duration;

use chrono::{DateTime, TimeDelta, Utc};
use outbox::dlq::DeadLetterFilter;
use outbox::{
    message::OnConflict,
    store::{ClaimRequest, Completion, Delivery, Failure, FailureReason, Lease, Store, StoredRow},
    Cancelled, Message, Published,
};
use outbox_tests::Fixture;
use sqlx::Connection;

const Q: &str = "presence.expiry";
const TTL: Duration = Duration::from_secs(60);

fn micros(t: DateTime<Utc>) -> DateTime<Utc> {
    DateTime::from_timestamp_micros(t.timestamp_micros()).expect("in range")
}

/// Whole seconds from now, at Postgres' precision.
fn secs(s: i64) -> DateTime<Utc> {
    micros(Utc::now() + TimeDelta::seconds(s))
}

fn extend<'a>(key: &'a str, payload: &'a [u8], at: DateTime<Utc>) -> Message<'a> {
    Message::new(Q, payload)
        .timer_id(key)
        .schedule(at)
        .on_conflict(OnConflict::Extend)
}

async fn publish(f: &Fixture, m: Message<'_>) -> Published {
    let mut conn = f.pool.acquire().await.unwrap();
    f.outbox.publish(&mut conn, m).await.unwrap()
}

/// Publishes timer `key` already due, claims it, returns the delivery.
async fn running_timer(f: &Fixture, key: &str, payload: &[u8]) -> Delivery {
    publish(f, extend(key, payload, secs(-10))).await;
    claim_one(f).await
}

async fn claim_one(f: &Fixture) -> Delivery {
    let mut got = f
        .store
        .claim(ClaimRequest::new(&[Q.to_owned()], 10, TTL))
        .await
        .unwrap();
    assert_eq!(got.len(), 1, "expected one claimable row: {got:#?}");
    got.remove(0)
}

/// Makes every lease of the table look an hour old.
async fn expire_leases(f: &Fixture) {
    // A bound instant, not `acquired_at - interval`: Citus refuses a STABLE function over
    // a column in an UPDATE of a distributed table.
    let sql = format!(
        "UPDATE {} SET acquired_at = $1 WHERE acquired_token IS NOT NULL",
        f.outbox.table()
    );
    sqlx::query(AssertSqlSafe(&*sql))
        .bind(Utc::now() - TimeDelta::hours(1))
        .execute(&f.pool)
        .await
        .unwrap();
}

fn assert_pending_timer(row: &StoredRow, at: DateTime<Utc>, payload: &[u8]) {
    assert_eq!(row.next_attempt_at, at, "{row:#?}");
    assert_eq!(row.payload, payload, "{row:#?}");
    assert_eq!(
        (row.acquired_token, row.acquired_at),
        (None, None),
        "lease cleared: {row:#?}"
    );
    assert_eq!(
        (row.rearm_at, &row.rearm_payload, &row.rearm_headers),
        (None, &None, &None),
        "{row:#?}"
    );
}

#[tokio::test]
async fn rearm_is_queued_on_fresh_and_expired_leases() {
    let f = Fixture::new().await;
    let d = running_timer(&f, "u1", b"p0").await;
    let claimed_deadline = f.only_row(Q).await.next_attempt_at;

    let t1 = secs(60);
    assert_eq!(
        publish(&f, extend("u1", b"p1", t1)).await,
        Published::RearmQueued { id: d.lease.id }
    );
    let row = f.only_row(Q).await;
    assert_eq!(
        row.acquired_token,
        Some(d.lease.token),
        "the running lease is untouched"
    );
    assert_eq!(
        row.next_attempt_at, claimed_deadline,
        "the claimed deadline is untouched"
    );
    assert_eq!(row.payload, b"p0", "the running payload is untouched");
    assert_eq!(
        (row.rearm_at, row.rearm_payload.as_deref()),
        (Some(t1), Some(&b"p1"[..]))
    );
    assert_eq!(row.deliveries_count, 1);

    expire_leases(&f).await;
    let t2 = secs(120);
    assert_eq!(
        publish(&f, extend("u1", b"p2", t2)).await,
        Published::RearmQueued { id: d.lease.id }
    );
    let row = f.only_row(Q).await;
    assert_eq!(row.acquired_token, Some(d.lease.token));
    assert_eq!(
        (row.rearm_at, row.rearm_payload.as_deref()),
        (Some(t2), Some(&b"p2"[..])),
        "one rearm holds the latest"
    );
    f.cleanup().await;
}

#[tokio::test]
async fn rearm_never_moves_earlier_nor_behind_the_claimed_deadline() {
    let f = Fixture::new().await;
    // Claimed deadline 10 s in the future is impossible for a claim, so publish due now and
    // look at what the row holds.
    let d = running_timer(&f, "u1", b"p0").await;
    let claimed = f.only_row(Q).await.next_attempt_at;

    // Not later than the claimed deadline: nothing queued.
    assert_eq!(
        publish(&f, extend("u1", b"old", claimed - TimeDelta::seconds(5))).await,
        Published::Unchanged
    );
    assert_eq!(
        publish(&f, extend("u1", b"old", claimed)).await,
        Published::Unchanged
    );
    assert_eq!(f.only_row(Q).await.rearm_at, None);

    let t1 = secs(60);
    assert_eq!(
        publish(&f, extend("u1", b"p1", t1)).await,
        Published::RearmQueued { id: d.lease.id }
    );
    // Earlier or equal to the queued rearm: unchanged, payload kept.
    assert_eq!(
        publish(&f, extend("u1", b"p-early", secs(30))).await,
        Published::Unchanged
    );
    assert_eq!(
        publish(&f, extend("u1", b"p-same", t1)).await,
        Published::Unchanged
    );
    let row = f.only_row(Q).await;
    assert_eq!(
        (row.rearm_at, row.rearm_payload.as_deref()),
        (Some(t1), Some(&b"p1"[..]))
    );
    f.cleanup().await;
}

/// Gives a running timer retry history: claim, fail with a zero-delay retry, claim again.
async fn running_with_history(f: &Fixture, key: &str) -> Delivery {
    let d = running_timer(f, key, b"p0").await;
    assert!(matches!(
        f.store.retry(d.lease, Duration::ZERO).await.unwrap(),
        Completion::RetryScheduled { .. }
    ));
    let d2 = claim_one(f).await;
    assert_eq!((d2.attempts_count, d2.deliveries_count), (1, 2));
    d2
}

#[tokio::test]
async fn rearm_applied_by_single_delete_resets_history_and_deliveries() {
    let f = Fixture::new().await;
    let d = running_with_history(&f, "u1").await;
    let t1 = secs(60);
    publish(&f, extend("u1", b"p1", t1)).await;
    assert_eq!(
        f.store.ack(d.lease).await.unwrap(),
        Completion::Rearmed { at: t1 }
    );
    let row = f.only_row(Q).await;
    assert_eq!(row.id, d.lease.id);
    assert_pending_timer(&row, t1, b"p1");
    assert_eq!((row.attempts_count, row.deliveries_count), (0, 0));
    assert_eq!((row.first_attempt_at, row.last_attempt_at), (None, None));
    // A second ack with the old token is a lost lease and changes nothing.
    assert_eq!(f.store.ack(d.lease).await.unwrap(), Completion::LeaseLost);
    assert_eq!(f.only_row(Q).await, row);
    f.cleanup().await;
}

#[tokio::test]
async fn batched_ack_deletes_applies_rearm_and_reports_lost_leases() {
    let f = Fixture::new().await;
    let mut conn = f.pool.acquire().await.unwrap();
    f.outbox
        .publish(&mut conn, Message::new(Q, b"plain"))
        .await
        .unwrap();
    publish(&f, extend("u1", b"p0", secs(-1))).await;
    f.outbox
        .publish(&mut conn, Message::new(Q, b"other"))
        .await
        .unwrap();
    let claimed = f
        .store
        .claim(ClaimRequest::new(&[Q.to_owned()], 10, TTL))
        .await
        .unwrap();
    assert_eq!(claimed.len(), 3);
    let timer = claimed.iter().find(|d| d.timer_id.is_some()).unwrap();
    let t1 = secs(60);
    publish(&f, extend("u1", b"p1", t1)).await;

    let mut leases: Vec<Lease> = claimed.iter().map(|d| d.lease).collect();
    let wrong = leases.iter().position(|l| l.id != timer.lease.id).unwrap();
    leases[wrong].token = uuid::Uuid::new_v4();
    let out = f.store.ack_batch(&leases).await.unwrap();
    for (l, c) in leases.iter().zip(&out) {
        let want = if l.id == timer.lease.id {
            Completion::Rearmed { at: t1 }
        } else if l.token
            != claimed
                .iter()
                .find(|d| d.lease.id == l.id)
                .unwrap()
                .lease
                .token
        {
            Completion::LeaseLost
        } else {
            Completion::Deleted
        };
        assert_eq!(*c, want, "{l:?}");
    }
    let rows = f.rows(Q).await;
    assert_eq!(
        rows.len(),
        2,
        "the deleted row is gone, the lost one and the rearmed one stay"
    );
    let rearmed = rows.iter().find(|r| r.id == timer.lease.id).unwrap();
    assert_pending_timer(rearmed, t1, b"p1");
    assert_eq!(rearmed.deliveries_count, 0);
    let lost = rows.iter().find(|r| r.id == leases[wrong].id).unwrap();
    assert!(
        lost.acquired_token.is_some(),
        "a lost lease changes nothing"
    );
    assert!(f.store.ack_batch(&[]).await.unwrap().is_empty());
    f.cleanup().await;
}

#[tokio::test]
async fn terminal_failure_with_dlq_archives_the_run_and_applies_the_rearm() {
    let f = Fixture::new().await;
    let d = running_with_history(&f, "u1").await;
    let t1 = secs(60);
    publish(&f, extend("u1", b"p1", t1)).await;
    let failure = Failure {
        reason: FailureReason::Rejected,
        last_error: Some("boom\0!"),
    };
    assert_eq!(
        f.store.fail(d.lease, failure).await.unwrap(),
        Completion::Rearmed { at: t1 }
    );
    let row = f.only_row(Q).await;
    assert_pending_timer(&row, t1, b"p1");
    assert_eq!((row.attempts_count, row.deliveries_count), (0, 0));
    let dlq = f
        .store
        .dead_letters(&DeadLetterFilter::new().queue(Q), None, 10)
        .await
        .unwrap();
    assert_eq!(dlq.len(), 1);
    let a = &dlq[0];
    assert_eq!(a.original_id, d.lease.id);
    assert_eq!(a.payload, b"p0", "the failed run's own payload is archived");
    assert_eq!(a.timer_id.as_deref(), Some("u1"));
    assert_eq!(
        (a.attempts_count, a.deliveries_count),
        (2, 2),
        "the failed run counts as an attempt"
    );
    assert_eq!(a.failure_reason, "rejected");
    assert_eq!(
        a.last_error.as_deref(),
        Some("boom\\0!"),
        "NUL is escaped for text"
    );
    assert_eq!(a.created_at, d.created_at);

    // Without a rearm: archived and deleted; a decode error does not count as an attempt.
    let mut conn = f.pool.acquire().await.unwrap();
    f.outbox
        .publish(&mut conn, Message::new(Q, b"\xff"))
        .await
        .unwrap();
    let d2 = f
        .store
        .claim(ClaimRequest::new(&[Q.to_owned()], 10, TTL))
        .await
        .unwrap()
        .remove(0);
    let failure = Failure {
        reason: FailureReason::DecodeError,
        last_error: Some("expected value"),
    };
    assert_eq!(
        f.store.fail(d2.lease, failure).await.unwrap(),
        Completion::Deleted
    );
    assert!(f.rows(Q).await.iter().all(|r| r.id != d2.lease.id));
    let dlq = f
        .store
        .dead_letters(&DeadLetterFilter::new().queue(Q), None, 10)
        .await
        .unwrap();
    assert_eq!(dlq.len(), 2);
    assert_eq!(
        (
            dlq[1].payload.as_slice(),
            dlq[1].attempts_count,
            dlq[1].failure_reason.as_str()
        ),
        (&b"\xff"[..], 0, "decode_error")
    );
    // Lost lease: nothing archived, nothing changed.
    let lost = f
        .store
        .fail(
            Lease {
                id: row.id,
                token: uuid::Uuid::new_v4(),
            },
            failure,
        )
        .await
        .unwrap();
    assert_eq!(lost, Completion::LeaseLost);
    assert_eq!(
        f.store
            .dead_letters(&DeadLetterFilter::new().queue(Q), None, 10)
            .await
            .unwrap()
            .len(),
        2
    );
    f.cleanup().await;
}

#[tokio::test]
async fn terminal_failure_without_dlq_deletes_or_applies_the_rearm() {
    let f = Fixture::with(|b| b.dead_letter(false)).await;
    let d = running_timer(&f, "u1", b"p0").await;
    let failure = Failure {
        reason: FailureReason::RetryExhausted,
        last_error: None,
    };
    assert_eq!(
        f.store.fail(d.lease, failure).await.unwrap(),
        Completion::Deleted
    );
    assert!(f.rows(Q).await.is_empty());
    let d = running_timer(&f, "u1", b"p0").await;
    let t1 = secs(60);
    publish(&f, extend("u1", b"p1", t1)).await;
    assert_eq!(
        f.store.fail(d.lease, failure).await.unwrap(),
        Completion::Rearmed { at: t1 }
    );
    assert_pending_timer(&f.only_row(Q).await, t1, b"p1");
    // The dead-letter operations refuse with the DLQ off; the table itself, read around
    // them, holds nothing.
    assert!(matches!(
        f.store
            .dead_letters(&DeadLetterFilter::new().queue(Q), None, 10)
            .await,
        Err(outbox::Error::DeadLetterDisabled)
    ));
    let archived: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT count(*) FROM {}",
        f.outbox.dead_letter_table()
    )))
    .fetch_one(&f.pool)
    .await
    .unwrap();
    assert_eq!(archived, 0, "nothing archived when the DLQ is off");
    assert_eq!(
        f.store.fail(d.lease, failure).await.unwrap(),
        Completion::LeaseLost
    );
    f.cleanup().await;
}

#[tokio::test]
async fn a_lost_lease_keeps_the_rearm_for_the_new_holder() {
    let f = Fixture::new().await;
    let stale = running_timer(&f, "u1", b"p0").await;
    let t1 = secs(60);
    publish(&f, extend("u1", b"p1", t1)).await;
    expire_leases(&f).await;
    let fresh = claim_one(&f).await;
    assert_ne!(fresh.lease.token, stale.lease.token);
    assert_eq!(fresh.deliveries_count, 2);
    let before = f.only_row(Q).await;
    assert_eq!(
        before.rearm_at,
        Some(t1),
        "the reclaim does not touch the rearm"
    );

    // Every completion of the stale worker is dropped.
    assert_eq!(
        f.store.ack(stale.lease).await.unwrap(),
        Completion::LeaseLost
    );
    assert_eq!(
        f.store.ack_batch(&[stale.lease]).await.unwrap(),
        vec![Completion::LeaseLost]
    );
    assert_eq!(
        f.store.retry(stale.lease, Duration::ZERO).await.unwrap(),
        Completion::LeaseLost
    );
    let failure = Failure {
        reason: FailureReason::Rejected,
        last_error: None,
    };
    assert_eq!(
        f.store.fail(stale.lease, failure).await.unwrap(),
        Completion::LeaseLost
    );
    assert_eq!(f.only_row(Q).await, before, "neither applied nor cleared");
    assert!(f
        .store
        .dead_letters(&DeadLetterFilter::new().queue(Q), None, 10)
        .await
        .unwrap()
        .is_empty());

    assert_eq!(
        f.store.ack(fresh.lease).await.unwrap(),
        Completion::Rearmed { at: t1 }
    );
    assert_pending_timer(&f.only_row(Q).await, t1, b"p1");
    f.cleanup().await;
}

#[tokio::test]
async fn retry_yields_to_the_rearm_and_keeps_deliveries() {
    let f = Fixture::new().await;
    // Plain retry first: pending at now() + delay, history updated.
    let d = running_timer(&f, "u1", b"p0").await;
    let Completion::RetryScheduled { at } = f
        .store
        .retry(d.lease, Duration::from_secs(90))
        .await
        .unwrap()
    else {
        panic!()
    };
    let row = f.only_row(Q).await;
    assert_eq!(row.next_attempt_at, at);
    assert_eq!(
        row.last_attempt_at.map(|l| at - l),
        Some(TimeDelta::seconds(90)),
        "delay from the database clock"
    );
    assert_eq!(row.first_attempt_at, row.last_attempt_at);
    assert_eq!(
        (row.attempts_count, row.deliveries_count, row.acquired_token),
        (1, 1, None)
    );

    // Make it due again, claim, extend while running, then fail with a retry.
    let sql = format!(
        "UPDATE {} SET next_attempt_at = now() - interval '1 second'",
        f.outbox.table()
    );
    sqlx::query(AssertSqlSafe(&*sql))
        .execute(&f.pool)
        .await
        .unwrap();
    let d = claim_one(&f).await;
    let t1 = secs(60);
    publish(&f, extend("u1", b"p1", t1)).await;
    assert_eq!(
        f.store
            .retry(d.lease, Duration::from_secs(3600))
            .await
            .unwrap(),
        Completion::Rearmed { at: t1 }
    );
    let row2 = f.only_row(Q).await;
    assert_pending_timer(&row2, t1, b"p1");
    assert_eq!(
        row2.attempts_count, 2,
        "history updated as for the failed run"
    );
    assert_eq!(row2.first_attempt_at, row.first_attempt_at);
    assert!(row2.last_attempt_at > row.last_attempt_at);
    assert_eq!(
        row2.deliveries_count, 2,
        "deliveries_count kept so max_deliveries still applies"
    );
    f.cleanup().await;
}

#[tokio::test]
async fn cancel_deletes_pending_drops_rearm_and_never_deletes_running() {
    let f = Fixture::new().await;
    let mut conn = f.pool.acquire().await.unwrap();
    assert_eq!(
        f.outbox.cancel(&mut conn, Q, "nobody").await.unwrap(),
        Cancelled::NotFound
    );

    let Published::Inserted { id } = publish(&f, extend("p", b"x", secs(60))).await else {
        panic!()
    };
    let mut tx = conn.begin().await.unwrap();
    assert_eq!(
        f.outbox.cancel(&mut tx, Q, "p").await.unwrap(),
        Cancelled::Deleted { id }
    );
    tx.commit().await.unwrap();
    assert!(f.rows(Q).await.is_empty());

    let d = running_timer(&f, "r", b"p0").await;
    let before = f.only_row(Q).await;
    // Bare connection (autocommit) and transaction alike.
    assert_eq!(
        f.outbox.cancel(&mut conn, Q, "r").await.unwrap(),
        Cancelled::Running { id: d.lease.id }
    );
    let marked = f.only_row(Q).await;
    assert!(marked.cancelled_at.is_some(), "{marked:?}");
    assert_eq!(
        StoredRow {
            cancelled_at: None,
            ..marked
        },
        before,
        "a running row is never deleted, only marked"
    );

    publish(&f, extend("r", b"p1", secs(60))).await;
    assert_eq!(
        f.only_row(Q).await.cancelled_at,
        None,
        "an extend after the cancel clears the mark"
    );
    let mut tx = conn.begin().await.unwrap();
    assert_eq!(
        f.outbox.cancel(&mut tx, Q, "r").await.unwrap(),
        Cancelled::RearmDropped { id: d.lease.id }
    );
    tx.commit().await.unwrap();
    let after = f.only_row(Q).await;
    assert!(after.cancelled_at.is_some(), "{after:?}");
    assert_eq!(
        StoredRow {
            cancelled_at: None,
            ..after
        },
        before,
        "the rearm columns are cleared, the run is untouched"
    );
    assert_eq!(
        f.store.ack(d.lease).await.unwrap(),
        Completion::Deleted,
        "the run ends without firing again"
    );
    assert!(f.rows(Q).await.is_empty());
    f.cleanup().await;
}

/// Waits until some backend is blocked on a lock while running a statement on our table.
async fn wait_for_lock_wait(f: &Fixture) {
    let table = f.outbox.table().trim_matches('"').to_owned();
    for _ in 0..500 {
        // On Citus the wait is on the worker node that holds the shard (whose name starts
        // with the table's): `citus_stat_activity` sees every node.
        let activity = if outbox_tests::citus() {
            "citus_stat_activity"
        } else {
            "pg_stat_activity"
        };
        let waiting: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT count(*) FROM {activity} WHERE wait_event_type = 'Lock' AND position($1 in query) > 0",
        )))
        .bind(&table)
        .fetch_one(&f.pool)
        .await
        .unwrap();
        if waiting > 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("no backend ever waited on the row lock");
}

#[tokio::test]
async fn completion_waits_on_an_uncommitted_extend_and_applies_it() {
    let f = Fixture::new().await;
    let d = running_timer(&f, "u1", b"p0").await;
    let t1 = secs(60);

    let mut extender = f.pool.acquire().await.unwrap();
    let mut tx = extender.begin().await.unwrap();
    let p = f
        .outbox
        .publish(&mut tx, extend("u1", b"p1", t1))
        .await
        .unwrap();
    assert_eq!(p, Published::RearmQueued { id: d.lease.id });

    // The ack blocks on the extend's row lock...
    let store = f.store.clone();
    let ack = tokio::spawn(async move { store.ack(d.lease).await });
    wait_for_lock_wait(&f).await;
    assert!(!ack.is_finished());
    // ...and once the extend commits, re-checks rearm_at and applies it.
    tx.commit().await.unwrap();
    assert_eq!(ack.await.unwrap().unwrap(), Completion::Rearmed { at: t1 });
    assert_pending_timer(&f.only_row(Q).await, t1, b"p1");

    // The same with a batched ack.
    let sql = format!(
        "UPDATE {} SET next_attempt_at = now() - interval '1 second'",
        f.outbox.table()
    );
    sqlx::query(AssertSqlSafe(&*sql))
        .execute(&f.pool)
        .await
        .unwrap();
    let d = claim_one(&f).await;
    let t2 = secs(120);
    let mut tx = extender.begin().await.unwrap();
    f.outbox
        .publish(&mut tx, extend("u1", b"p2", t2))
        .await
        .unwrap();
    let store = f.store.clone();
    let ack = tokio::spawn(async move { store.ack_batch(&[d.lease]).await });
    wait_for_lock_wait(&f).await;
    tx.commit().await.unwrap();
    assert_eq!(
        ack.await.unwrap().unwrap(),
        vec![Completion::Rearmed { at: t2 }]
    );
    assert_pending_timer(&f.only_row(Q).await, t2, b"p2");
    f.cleanup().await;
}

#[tokio::test]
async fn an_extend_racing_a_claim_queues_a_rearm() {
    let f = Fixture::new().await;
    publish(&f, extend("u1", b"p0", secs(-5))).await;

    // Hold the claim open in a transaction: its row lock stays taken.
    let mut claimer = f.pool.acquire().await.unwrap();
    let mut tx = claimer.begin().await.unwrap();
    let claimed = f
        .store
        .claim_on(&mut tx, ClaimRequest::new(&[Q.to_owned()], 10, TTL))
        .await
        .unwrap();
    assert_eq!(claimed.len(), 1);

    let t1 = secs(60);
    let outbox = f.outbox.clone();
    let pool = f.pool.clone();
    let ext = tokio::spawn(async move {
        let mut conn = pool.acquire().await.unwrap();
        outbox.publish(&mut conn, extend("u1", b"p1", t1)).await
    });
    wait_for_lock_wait(&f).await;
    tx.commit().await.unwrap();
    assert_eq!(
        ext.await.unwrap().unwrap(),
        Published::RearmQueued {
            id: claimed[0].lease.id
        }
    );
    let row = f.only_row(Q).await;
    assert_eq!(row.acquired_token, Some(claimed[0].lease.token));
    assert_eq!(row.payload, b"p0");
    assert_eq!(
        (row.rearm_at, row.rearm_payload.as_deref()),
        (Some(t1), Some(&b"p1"[..]))
    );
    f.cleanup().await;
}

/// Issue 27: an extend first tries an UPDATE of the key's row and inserts only when there
/// is none. Two first extends of one key: the second's insert meets the first's row,
/// uncommitted, waits for it, and once it commits runs again and extends that row
/// (later) or leaves it (not later); once it rolls back, inserts. Never an error, never
/// two rows.
#[tokio::test]
async fn an_extend_racing_the_first_extend_of_its_key_extends_that_timer() {
    let f = Fixture::new().await;
    let mut first = f.pool.acquire().await.unwrap();
    // (the second extend's deadline, commit the first?, the outcome, the row left)
    let cases = [
        (120, true, "extended", (120, &b"second"[..])),
        (30, true, "unchanged", (60, &b"first"[..])),
        (120, false, "inserted", (120, &b"second"[..])),
    ];
    for (i, (second_at, commit, want, (row_at, row_payload))) in cases.into_iter().enumerate() {
        let key = format!("race{i}");
        let (t_first, t_second) = (secs(60), secs(second_at));
        let mut tx = first.begin().await.unwrap();
        let Published::Inserted { id } = f
            .outbox
            .publish(&mut tx, extend(&key, b"first", t_first))
            .await
            .unwrap()
        else {
            panic!("the first extend inserts")
        };
        let (outbox, pool, k) = (f.outbox.clone(), f.pool.clone(), key.clone());
        let second = tokio::spawn(async move {
            let mut conn = pool.acquire().await.unwrap();
            outbox
                .publish(&mut conn, extend(&k, b"second", t_second))
                .await
        });
        wait_for_lock_wait(&f).await;
        assert!(!second.is_finished());
        if commit {
            tx.commit().await.unwrap();
        } else {
            tx.rollback().await.unwrap();
        }
        let got = second.await.unwrap().unwrap();
        match (want, got) {
            ("extended", Published::Extended { id: got }) => assert_eq!(got, id),
            ("unchanged", Published::Unchanged) => {}
            ("inserted", Published::Inserted { id: got }) => assert_ne!(got, id),
            (want, got) => panic!("case {i}: want {want}, got {got:?}"),
        }
        let rows: Vec<_> = f
            .rows(Q)
            .await
            .into_iter()
            .filter(|r| r.timer_id.as_deref() == Some(key.as_str()))
            .collect();
        assert_eq!(rows.len(), 1, "case {i}: one live row per key: {rows:#?}");
        let at = if row_at == 60 { t_first } else { t_second };
        assert_pending_timer(&rows[0], at, row_payload);
    }
    f.cleanup().await;
}

/// Issue 27: an extend whose key's row is deleted (a completion) while the extend waits
/// for its lock brings the timer back as a new row, as it would have if it had come after
/// the deletion: the UPDATE finds the row gone, the look under lock finds nothing, the
/// insert runs.
#[tokio::test]
async fn an_extend_racing_the_deletion_of_its_row_inserts_the_timer_again() {
    let f = Fixture::new().await;
    let Published::Inserted { id } = publish(&f, extend("u1", b"p0", secs(60))).await else {
        panic!()
    };
    let mut deleter = f.pool.acquire().await.unwrap();
    let mut tx = deleter.begin().await.unwrap();
    let sql = format!("DELETE FROM {} WHERE id = $1", f.outbox.table());
    let deleted = sqlx::query(AssertSqlSafe(&*sql))
        .bind(id)
        .execute(&mut *tx)
        .await
        .unwrap();
    assert_eq!(deleted.rows_affected(), 1);
    let t1 = secs(120);
    let (outbox, pool) = (f.outbox.clone(), f.pool.clone());
    let ext = tokio::spawn(async move {
        let mut conn = pool.acquire().await.unwrap();
        outbox.publish(&mut conn, extend("u1", b"p1", t1)).await
    });
    wait_for_lock_wait(&f).await;
    tx.commit().await.unwrap();
    let Published::Inserted { id: new } = ext.await.unwrap().unwrap() else {
        panic!("the extend inserts the timer again")
    };
    assert_ne!(new, id);
    let row = f.only_row(Q).await;
    assert_eq!(row.id, new);
    assert_pending_timer(&row, t1, b"p1");
    f.cleanup().await;
}

#[tokio::test]
async fn every_completion_is_fenced_by_the_token() {
    let f = Fixture::new().await;
    let d = running_timer(&f, "u1", b"p0").await;
    let wrong = Lease {
        id: d.lease.id,
        token: uuid::Uuid::new_v4(),
    };
    let before = f.only_row(Q).await;
    assert_eq!(f.store.ack(wrong).await.unwrap(), Completion::LeaseLost);
    assert_eq!(
        f.store.ack_batch(&[wrong]).await.unwrap(),
        vec![Completion::LeaseLost]
    );
    assert_eq!(
        f.store.retry(wrong, Duration::ZERO).await.unwrap(),
        Completion::LeaseLost
    );
    for reason in [FailureReason::Rejected, FailureReason::MaxDeliveries] {
        let failure = Failure {
            reason,
            last_error: None,
        };
        assert_eq!(
            f.store.fail(wrong, failure).await.unwrap(),
            Completion::LeaseLost
        );
    }
    assert_eq!(f.only_row(Q).await, before);
    // An unleased row cannot be completed either.
    let Published::Inserted { id } = publish(&f, extend("u2", b"x", secs(60))).await else {
        panic!()
    };
    let unleased = Lease {
        id,
        token: d.lease.token,
    };
    assert_eq!(f.store.ack(unleased).await.unwrap(), Completion::LeaseLost);
    assert_eq!(
        f.store.retry(unleased, Duration::ZERO).await.unwrap(),
        Completion::LeaseLost
    );
    assert_eq!(f.rows(Q).await.len(), 2);
    // The right token deletes a row without rearm in one statement.
    assert_eq!(f.store.ack(d.lease).await.unwrap(), Completion::Deleted);
    assert_eq!(f.rows(Q).await.len(), 1);
    f.cleanup().await;
}

/// A cancel that drops the rearm between the ack's DELETE (which skipped the row for its
/// rearm) and its follow-up must not turn the success into a lost lease: the follow-up
/// decides under the row lock and deletes the row.
#[tokio::test]
async fn a_rearm_dropped_between_the_acks_two_statements_still_deletes_the_row() {
    let f = Fixture::new().await;
    for batched in [false, true] {
        let d = running_timer(&f, "u1", b"p0").await;
        publish(&f, extend("u1", b"p1", secs(60))).await;
        // The cancel holds the row lock with the rearm dropped, uncommitted: the ack's
        // DELETE still sees the committed rearm and skips the row, then its follow-up
        // waits on the cancel's lock.
        let mut canceller = f.pool.acquire().await.unwrap();
        let mut tx = canceller.begin().await.unwrap();
        let c = f.outbox.cancel(&mut tx, Q, "u1").await.unwrap();
        assert_eq!(c, Cancelled::RearmDropped { id: d.lease.id });
        let store = f.store.clone();
        let ack = tokio::spawn(async move {
            if batched {
                store.ack_batch(&[d.lease]).await.map(|v| v[0])
            } else {
                store.ack(d.lease).await
            }
        });
        wait_for_lock_wait(&f).await;
        tx.commit().await.unwrap();
        assert_eq!(
            ack.await.unwrap().unwrap(),
            Completion::Deleted,
            "batched: {batched}"
        );
        assert!(f.rows(Q).await.is_empty(), "batched: {batched}");
    }
    f.cleanup().await;
}

/// SPEC §5.1, §5.3, found by a new user: every completion that waits for an extend's row
/// lock applies the rearm that extend committed — its deadline, its payload — whether the
/// run ends with a retry, a terminal failure, a release at shutdown or a batched success,
/// and whether a rearm was queued before (the extend moves it) or not. Before the fix, the
/// completion's SET used the row as it was before the extend: a NOT NULL violation (no
/// earlier rearm), or the older rearm installed (an earlier one).
#[tokio::test]
async fn a_completion_that_waits_for_an_extend_applies_that_extends_rearm() {
    let f = Fixture::new().await;
    for (i, end) in ["retry", "fail", "release", "batch"].iter().enumerate() {
        for earlier_rearm in [false, true] {
            let key = format!("{end}-{earlier_rearm}");
            let d = running_timer(&f, &key, b"p0").await;
            if earlier_rearm {
                let p = publish(&f, extend(&key, b"older", secs(600))).await;
                assert!(matches!(p, Published::RearmQueued { .. }), "{p:?}");
            }
            let rearm_at = secs(3600 + i as i64);
            let mut conn = f.pool.acquire().await.unwrap();
            let mut tx = conn.begin().await.unwrap();
            let p = f
                .outbox
                .publish(&mut tx, extend(&key, b"newest", rearm_at))
                .await
                .unwrap();
            assert!(matches!(p, Published::RearmQueued { .. }), "{p:?}");
            let store = f.store.clone();
            let lease = d.lease;
            let end_name = end.to_string();
            let completion = tokio::spawn(async move {
                match end_name.as_str() {
                    "retry" => store
                        .retry(lease, Duration::from_secs(5))
                        .await
                        .map(|c| format!("{c:?}")),
                    "fail" => store
                        .fail(
                            lease,
                            Failure {
                                reason: FailureReason::Rejected,
                                last_error: Some("no"),
                            },
                        )
                        .await
                        .map(|c| format!("{c:?}")),
                    "release" => store
                        .release(&[outbox::store::Release {
                            lease,
                            started: true,
                        }])
                        .await
                        .map(|r| format!("{r:?}")),
                    _ => store.ack_batch(&[lease]).await.map(|c| format!("{c:?}")),
                }
            });
            // Past the worker's lock timeout: the completion now waits on the plain pool.
            tokio::time::sleep(Duration::from_millis(400)).await;
            assert!(!completion.is_finished(), "{key}: it waits for the extend");
            tx.commit().await.unwrap();
            let done = completion.await.unwrap();
            let done = done.unwrap_or_else(|e| panic!("{key}: {e}"));
            let row = f.only_row(Q).await;
            assert_eq!(row.acquired_token, None, "{key}: {done} {row:?}");
            assert_eq!(row.payload, b"newest", "{key}: {done}");
            assert_eq!(row.next_attempt_at, rearm_at, "{key}: {done}");
            assert_eq!(row.rearm_at, None, "{key}");
            let mut conn = f.pool.acquire().await.unwrap();
            let c = f.outbox.cancel(&mut conn, Q, &key).await.unwrap();
            assert!(matches!(c, Cancelled::Deleted { .. }), "{key}: {c:?}");
        }
    }
    f.cleanup().await;
}
