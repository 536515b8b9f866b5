//! Publishing on the caller's transaction (SPEC §2): outcomes, validation before SQL,
//! notifications that follow the transaction, batches.

use std::time::Duration;

use chrono::{DateTime, TimeDelta, Utc};
use outbox::{
    message::{BatchItem, Headers, OnConflict, Schedule},
    Error, Message, Published,
};
use outbox_tests::Fixture;
use sqlx::postgres::PgListener;
use sqlx::Connection;

fn micros(t: DateTime<Utc>) -> DateTime<Utc> {
    DateTime::from_timestamp_micros(t.timestamp_micros()).expect("in range")
}

#[tokio::test]
async fn publish_outcomes_and_rows() {
    let f = Fixture::new().await;
    let mut conn = f.pool.acquire().await.unwrap();
    let q = "orders";
    let in_1h = micros(Utc::now() + TimeDelta::hours(1));
    let in_2h = in_1h + TimeDelta::hours(1);

    let plain = f
        .outbox
        .publish(&mut conn, Message::new(q, b"plain"))
        .await
        .unwrap();
    let Published::Inserted { id: plain_id } = plain else {
        panic!("{plain:?}")
    };

    let mut headers = Headers::new();
    headers.insert("content-type".into(), "application/json".into());
    let timer = Message::new(q, b"v1")
        .timer_id("k")
        .headers(&headers)
        .schedule(in_1h);
    let first = f.outbox.publish(&mut conn, timer).await.unwrap();
    let Published::Inserted { id: timer_id } = first else {
        panic!("{first:?}")
    };
    assert_eq!(first.id(), Some(timer_id));

    // Ignore: the key is taken, nothing changes.
    let again = f
        .outbox
        .publish(
            &mut conn,
            Message::new(q, b"v2").timer_id("k").schedule(in_2h),
        )
        .await
        .unwrap();
    assert_eq!(again, Published::Skipped);

    // Extend later on a pending row: deadline, payload, headers replaced.
    let ext = Message::new(q, b"v3")
        .timer_id("k")
        .schedule(in_2h)
        .on_conflict(OnConflict::Extend);
    assert_eq!(
        f.outbox.publish(&mut conn, ext).await.unwrap(),
        Published::Extended { id: timer_id }
    );

    // Extend earlier or equal: unchanged.
    for at in [in_1h, in_2h] {
        let ext = Message::new(q, b"v4")
            .timer_id("k")
            .schedule(at)
            .on_conflict(OnConflict::Extend);
        assert_eq!(
            f.outbox.publish(&mut conn, ext).await.unwrap(),
            Published::Unchanged
        );
    }

    // Extend of an unknown key inserts.
    let ext = Message::new(q, b"n1")
        .timer_id("new")
        .schedule(in_1h)
        .on_conflict(OnConflict::Extend);
    let Published::Inserted { id: new_id } = f.outbox.publish(&mut conn, ext).await.unwrap() else {
        panic!()
    };

    let rows = f.rows(q).await;
    assert_eq!(rows.len(), 3);
    let plain_row = &rows[0];
    assert_eq!(plain_row.id, plain_id);
    assert_eq!(plain_row.payload, b"plain");
    assert_eq!(plain_row.timer_id, None);
    assert_eq!(plain_row.headers, None);
    assert_eq!(
        plain_row.next_attempt_at, plain_row.created_at,
        "due now = now() of the publish"
    );
    let new_row = &rows[1];
    assert_eq!((new_row.id, new_row.next_attempt_at), (new_id, in_1h));
    let timer_row = &rows[2];
    assert_eq!(timer_row.id, timer_id);
    assert_eq!(timer_row.payload, b"v3");
    assert_eq!(timer_row.headers, None, "extend replaces headers too");
    assert_eq!(timer_row.next_attempt_at, in_2h);
    assert_eq!(timer_row.timer_id.as_deref(), Some("k"));
    assert_eq!(
        (timer_row.attempts_count, timer_row.deliveries_count),
        (0, 0)
    );
    assert_eq!(timer_row.acquired_token, None);
    assert_eq!(timer_row.rearm_at, None);
    f.cleanup().await;
}

#[tokio::test]
async fn relative_schedule_is_computed_by_the_database_clock() {
    let f = Fixture::new().await;
    let mut conn = f.pool.acquire().await.unwrap();
    f.outbox
        .publish(
            &mut conn,
            Message::new("q", b"x").schedule(Duration::from_millis(90_500)),
        )
        .await
        .unwrap();
    let row = f.only_row("q").await;
    // created_at and the deadline both come from the same now() of the statement.
    assert_eq!(
        row.next_attempt_at - row.created_at,
        TimeDelta::milliseconds(90_500)
    );
    f.cleanup().await;
}

#[tokio::test]
async fn rolled_back_publish_leaves_nothing_and_committed_one_notifies() {
    let f = Fixture::new().await;
    let mut listener = PgListener::connect_with(&f.pool).await.unwrap();
    listener.listen(f.outbox.channel()).await.unwrap();

    // Rolled back: no row, no notification.
    let mut tx = f.pool.begin().await.unwrap();
    let p = f
        .outbox
        .publish(&mut tx, Message::new("q", b"gone"))
        .await
        .unwrap();
    assert!(matches!(p, Published::Inserted { .. }));
    tx.rollback().await.unwrap();
    assert!(f.rows("q").await.is_empty());

    // Committed and future-dated: a row and one notification carrying queue and deadline.
    let at = micros(Utc::now() + TimeDelta::seconds(30));
    let mut tx = f.pool.begin().await.unwrap();
    f.outbox
        .publish(&mut tx, Message::new("q", b"kept").schedule(at))
        .await
        .unwrap();
    tx.commit().await.unwrap();

    let n = tokio::time::timeout(Duration::from_secs(5), listener.recv())
        .await
        .expect("a notification arrives")
        .unwrap();
    assert_eq!(
        n.payload(),
        format!("{}:q", at.timestamp_millis()),
        "rolled-back one never arrives"
    );
    assert_eq!(f.only_row("q").await.payload, b"kept");

    // Skipped, Unchanged and Extended notify nothing; only the insert does.
    let mut conn = f.pool.acquire().await.unwrap();
    let m = Message::new("q", b"t").timer_id("k").schedule(at);
    f.outbox.publish(&mut conn, m).await.unwrap();
    f.outbox.publish(&mut conn, m).await.unwrap();
    f.outbox
        .publish(&mut conn, m.on_conflict(OnConflict::Extend))
        .await
        .unwrap();
    let later = m
        .schedule(at + TimeDelta::seconds(1))
        .on_conflict(OnConflict::Extend);
    assert!(matches!(
        f.outbox.publish(&mut conn, later).await.unwrap(),
        Published::Extended { .. }
    ));
    let first = listener.recv().await.unwrap();
    assert_eq!(first.payload(), format!("{}:q", at.timestamp_millis()));
    let extra = tokio::time::timeout(Duration::from_millis(500), listener.recv()).await;
    assert!(extra.is_err(), "only the insert notifies, got {extra:?}");
    f.cleanup().await;
}

/// Validation happens before any SQL: on a connection whose transaction is aborted, any
/// statement would fail with 25P02, yet we get the validation error.
#[tokio::test]
async fn invalid_input_is_rejected_before_sql() {
    let f = Fixture::new().await;
    let mut conn = f.pool.acquire().await.unwrap();
    let mut tx = conn.begin().await.unwrap();
    assert!(sqlx::query("SELECT 1/0").execute(&mut *tx).await.is_err());

    let long = "x".repeat(256);
    let mut nul_headers = Headers::new();
    nul_headers.insert("a".into(), "b\0c".into());
    let cases: Vec<(Message<'_>, &str)> = vec![
        (Message::new("", b"p"), "queue"),
        (Message::new(&long, b"p"), "queue"),
        (Message::new("a\0b", b"p"), "queue"),
        (Message::new("q", b"p").timer_id(""), "timer_id"),
        (Message::new("q", b"p").timer_id(&long), "timer_id"),
        (Message::new("q", b"p").timer_id("a\0"), "timer_id"),
        (
            Message::new("q", b"p").on_conflict(OnConflict::Extend),
            "on_conflict",
        ),
        (Message::new("q", b"p").headers(&nul_headers), "headers"),
        (
            Message::new("q", b"p").schedule(TimeDelta::seconds(-1)),
            "schedule",
        ),
        (Message::new("q", b"p").schedule(TimeDelta::MAX), "schedule"),
        (Message::new("q", b"p").schedule(Duration::MAX), "schedule"),
        (
            Message::new("q", b"p").schedule(DateTime::<Utc>::MIN_UTC),
            "schedule",
        ),
    ];
    for (msg, field) in cases {
        match f.outbox.publish(&mut tx, msg).await {
            Err(Error::InvalidArgument { field: got, .. }) => assert_eq!(got, field, "{msg:?}"),
            other => panic!("{msg:?}: expected InvalidArgument({field}), got {other:?}"),
        }
    }
    let err = f.outbox.cancel(&mut tx, "q", "").await.unwrap_err();
    assert!(
        matches!(
            err,
            Error::InvalidArgument {
                field: "timer_id",
                ..
            }
        ),
        "{err:?}"
    );
    let err = f
        .outbox
        .publish_batch(&mut tx, "", &[BatchItem::new(b"x")], Schedule::now())
        .await
        .unwrap_err();
    assert!(
        matches!(err, Error::InvalidArgument { field: "queue", .. }),
        "{err:?}"
    );
    // The message names the field and the rule.
    let err = f
        .outbox
        .publish(&mut tx, Message::new(&long, b"p"))
        .await
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "invalid `queue`: is 256 bytes long; at most 255 bytes are allowed"
    );
    drop(tx);
    assert!(f.rows("q").await.is_empty());
    f.cleanup().await;
}

#[tokio::test]
async fn batch_is_one_statement_all_or_nothing() {
    let f = Fixture::new().await;
    let mut listener = PgListener::connect_with(&f.pool).await.unwrap();
    listener.listen(f.outbox.channel()).await.unwrap();
    let mut conn = f.pool.acquire().await.unwrap();
    let mut h = Headers::new();
    h.insert("k".into(), "v".into());
    let items = [
        BatchItem::new(b"a"),
        BatchItem {
            payload: b"b",
            headers: Some(&h),
        },
        BatchItem::new(b"c"),
    ];
    let ids = f
        .outbox
        .publish_batch(&mut conn, "b", &items, Schedule::now())
        .await
        .unwrap();
    assert_eq!(ids.len(), 3);
    let rows = f.rows("b").await;
    assert_eq!(rows.iter().map(|r| r.id).collect::<Vec<_>>(), ids);
    assert_eq!(
        rows.iter().map(|r| r.payload.clone()).collect::<Vec<_>>(),
        vec![b"a".to_vec(), b"b".to_vec(), b"c".to_vec()]
    );
    assert_eq!(rows[1].headers.as_ref(), Some(&h));
    assert!(rows
        .iter()
        .all(|r| r.timer_id.is_none() && r.next_attempt_at == rows[0].next_attempt_at));
    // One notification for the batch.
    listener.recv().await.unwrap();
    let extra = tokio::time::timeout(Duration::from_millis(300), listener.recv()).await;
    assert!(extra.is_err(), "one notification per batch");

    // An invalid item rejects the whole batch before any SQL.
    let mut bad = Headers::new();
    bad.insert("x\0".into(), "v".into());
    let items = [
        BatchItem::new(b"d"),
        BatchItem {
            payload: b"e",
            headers: Some(&bad),
        },
    ];
    let err = f
        .outbox
        .publish_batch(&mut conn, "b", &items, Schedule::now())
        .await
        .unwrap_err();
    assert!(matches!(
        err,
        Error::InvalidArgument {
            field: "headers",
            ..
        }
    ));
    // A batch rolled back with its transaction leaves nothing.
    let mut tx = f.pool.begin().await.unwrap();
    f.outbox
        .publish_batch(&mut tx, "b", &[BatchItem::new(b"f")], Schedule::now())
        .await
        .unwrap();
    tx.rollback().await.unwrap();
    assert_eq!(f.rows("b").await.len(), 3);
    assert!(f
        .outbox
        .publish_batch(&mut conn, "b", &[], Schedule::now())
        .await
        .unwrap()
        .is_empty());
    f.cleanup().await;
}

/// An outbox built with `notify(false)` publishes without `pg_notify` (its
/// commits skip the notification queue's database-wide lock); workers then find the row by
/// polling. The same publish through a notifying outbox of the same table is heard, so the
/// listener is known to work.
#[tokio::test]
async fn a_quiet_outbox_publishes_without_notifying() {
    let f = Fixture::new().await;
    let quiet = outbox::Outbox::builder()
        .table(f.outbox.table().trim_matches('"'))
        .dead_letter(true)
        .notify(false)
        .build()
        .unwrap();
    assert!(!quiet.notifies() && f.outbox.notifies());
    assert_eq!(quiet.channel(), f.outbox.channel());
    let mut listener = PgListener::connect_with(&f.pool).await.unwrap();
    listener.listen(f.outbox.channel()).await.unwrap();
    let mut conn = f.pool.acquire().await.unwrap();

    let items = [BatchItem::new(b"b1"), BatchItem::new(b"b2")];
    quiet
        .publish(&mut conn, Message::new("q", b"plain"))
        .await
        .unwrap();
    quiet
        .publish(
            &mut conn,
            Message::new("q", b"t")
                .timer_id("k")
                .on_conflict(OnConflict::Extend),
        )
        .await
        .unwrap();
    quiet
        .publish_batch(&mut conn, "q", &items, Schedule::now())
        .await
        .unwrap();
    assert_eq!(f.rows("q").await.len(), 4, "every row written");
    // Then one notifying publish: the first notification the listener gets is its own.
    f.outbox
        .publish(&mut conn, Message::new("loud", b"x"))
        .await
        .unwrap();
    let n = tokio::time::timeout(Duration::from_secs(5), listener.recv())
        .await
        .expect("the notifying publish is heard")
        .unwrap();
    assert!(n.payload().ends_with(":loud"), "{}", n.payload());
    f.cleanup().await;
}

/// Issue 27: with the identity ten values from 2^63 − 1, a thousand extends of existing
/// timers all succeed and the sequence does not move; so do skipped publishes, extends that
/// change nothing, extends that queue a rearm on a running row and registrations of a
/// stored schedule. Before the fix each of them evaluated `nextval` ahead of ON CONFLICT,
/// and all but the first ten failed ("reached maximum value of sequence").
#[tokio::test]
async fn writes_to_a_held_key_consume_no_sequence_value_near_the_identity_end() {
    use outbox::store::{ClaimRequest, RegisterSchedule, Registered, Store, SCHEDULE_HEADER};
    use sqlx::AssertSqlSafe;

    const KEYS: usize = 10;
    const EXTENDS: usize = 1000;
    const LAST: i64 = i64::MAX - KEYS as i64 + 1;
    let f = Fixture::new().await;
    let mut conn = f.pool.acquire().await.unwrap();
    let t = f.outbox.table();
    let q = "near-the-end";
    let base = micros(Utc::now() + TimeDelta::hours(1));
    let keys: Vec<String> = (0..KEYS).map(|k| format!("k{k}")).collect();
    for k in &keys {
        let m = Message::new(q, b"v0").timer_id(k).schedule(base);
        assert!(matches!(
            f.outbox.publish(&mut conn, m).await.unwrap(),
            Published::Inserted { .. }
        ));
    }
    // A running timer (due now, claimed) and a stored schedule.
    let m = Message::new(q, b"r0").timer_id("running");
    f.outbox.publish(&mut conn, m).await.unwrap();
    let queues = vec![q.to_owned()];
    let claimed = f
        .store
        .claim(ClaimRequest::new(&queues, 10, Duration::from_secs(600)))
        .await
        .unwrap();
    assert_eq!(claimed.len(), 1);
    let fp: Headers = [(SCHEDULE_HEADER.to_owned(), "every:1s".to_owned())].into();
    let fp2: Headers = [(SCHEDULE_HEADER.to_owned(), "every:2s".to_owned())].into();
    let register = |fp, first| RegisterSchedule::new(q, "schedule:s", b"{}", fp, first);
    assert!(matches!(
        f.store
            .register_schedule(register(&fp, base))
            .await
            .unwrap(),
        Registered::Inserted { .. }
    ));

    // Ten values left: LAST ..= i64::MAX.
    let restart = format!("ALTER TABLE {t} ALTER COLUMN id RESTART WITH {LAST}");
    sqlx::raw_sql(AssertSqlSafe(restart))
        .execute(&f.pool)
        .await
        .unwrap();
    let seq: String = sqlx::query_scalar("SELECT pg_get_serial_sequence($1, 'id')")
        .bind(t)
        .fetch_one(&f.pool)
        .await
        .unwrap();
    let read_seq = format!("SELECT last_value, is_called FROM {seq}");
    let sequence = || async {
        sqlx::query_as::<_, (i64, bool)>(AssertSqlSafe(read_seq.clone()))
            .fetch_one(&f.pool)
            .await
            .unwrap()
    };
    let before = sequence().await;
    assert_eq!(before, (LAST, false));

    let mut failures = Vec::new();
    let mut extended = 0;
    for i in 0..EXTENDS {
        let at = base + TimeDelta::seconds(i as i64 + 1);
        let m = Message::new(q, b"v")
            .timer_id(&keys[i % KEYS])
            .schedule(at)
            .on_conflict(OnConflict::Extend);
        match f.outbox.publish(&mut conn, m).await {
            Ok(Published::Extended { .. }) => extended += 1,
            other => failures.push(format!("extend {i}: {other:?}")),
        }
    }
    // The other writes that meet a live row, a few of each.
    for i in 0..20 {
        let later = base + TimeDelta::seconds(10_000 + i);
        let writes = [
            (
                Message::new(q, b"x").timer_id("k0").schedule(later),
                Published::Skipped,
            ),
            (
                Message::new(q, b"x")
                    .timer_id("k0")
                    .schedule(base)
                    .on_conflict(OnConflict::Extend),
                Published::Unchanged,
            ),
        ];
        for (m, want) in writes {
            match f.outbox.publish(&mut conn, m).await {
                Ok(got) if got == want => {}
                other => failures.push(format!("{want:?} {i}: {other:?}")),
            }
        }
        let m = Message::new(q, b"r")
            .timer_id("running")
            .schedule(later)
            .on_conflict(OnConflict::Extend);
        match f.outbox.publish(&mut conn, m).await {
            Ok(Published::RearmQueued { .. }) => {}
            other => failures.push(format!("rearm {i}: {other:?}")),
        }
        let fp = if i % 2 == 0 { &fp2 } else { &fp };
        match f.store.register_schedule(register(fp, later)).await {
            Ok(Registered::Rescheduled { .. }) => {}
            other => failures.push(format!("register {i}: {other:?}")),
        }
        match f.store.register_schedule(register(fp, later)).await {
            Ok(Registered::Unchanged) => {}
            other => failures.push(format!("register again {i}: {other:?}")),
        }
    }
    assert!(
        failures.is_empty(),
        "{} writes failed, the first: {:?}",
        failures.len(),
        &failures[..failures.len().min(3)]
    );
    assert_eq!(extended, EXTENDS);
    assert_eq!(
        sequence().await,
        before,
        "a write to a held key used up a value"
    );

    // A real insert still takes the next value.
    let m = Message::new(q, b"n").timer_id("new").schedule(base);
    assert_eq!(
        f.outbox.publish(&mut conn, m).await.unwrap(),
        Published::Inserted { id: LAST }
    );
    drop(conn);
    f.cleanup().await;
}

/// A publish in the caller's transaction begun `READ ONLY` is `ReadOnly`, and the message
/// names that case too, not only a read-only server (found by the fresh-user trial of
/// 2026-12-05, whose server was a writable primary). Nothing is written.
#[tokio::test]
async fn a_publish_in_a_read_only_transaction_says_the_transaction_is_read_only() {
    let f = Fixture::new().await;
    let mut conn = f.pool.acquire().await.unwrap();
    let mut tx = conn.begin().await.unwrap();
    sqlx::query("SET TRANSACTION READ ONLY")
        .execute(&mut *tx)
        .await
        .unwrap();
    let extend = Message::new("q", b"x")
        .timer_id("k")
        .on_conflict(OnConflict::Extend);
    let err = f.outbox.publish(&mut tx, extend).await.unwrap_err();
    assert!(matches!(err, Error::ReadOnly { .. }), "{err:?}");
    assert!(
        err.to_string().contains("a transaction begun READ ONLY"),
        "{err}"
    );
    tx.rollback().await.unwrap();
    assert!(f.rows("q").await.is_empty());
    f.cleanup().await;
}

/// A raw database error says what Postgres said, with its SQLSTATE, and not sqlx's
/// "at line N" (the line of Postgres' C source, which read like a line of the statement:
/// found by the fresh-user trial of 2026-12-05). Here: a publish in a transaction an
/// earlier statement aborted.
#[tokio::test]
async fn a_database_error_reads_as_postgres_reported_it() {
    let f = Fixture::new().await;
    let mut conn = f.pool.acquire().await.unwrap();
    let mut tx = conn.begin().await.unwrap();
    assert!(sqlx::query("SELECT 1/0").execute(&mut *tx).await.is_err());
    let err = f
        .outbox
        .publish(&mut tx, Message::new("q", b"x"))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Database(_)), "{err:?}");
    assert_eq!(
        err.to_string(),
        "database error: current transaction is aborted, commands ignored until end of \
         transaction block (SQLSTATE 25P02)"
    );
    tx.rollback().await.unwrap();
    f.cleanup().await;
}

/// An outbox built with `distributed` over a table migrated for a single node is told so,
/// not with a raw "column bucket does not exist" (found by the fresh-user trial of
/// 2026-12-05, with the CLI's `--distributed 4`). Nothing is written.
#[tokio::test]
async fn a_distributed_outbox_over_a_single_node_table_is_a_config_error() {
    let f = Fixture::new().await;
    let table = f.outbox.table().trim_matches('"').to_owned();
    let distributed = outbox::Outbox::builder()
        .table(table)
        .distributed(4)
        .build()
        .unwrap();
    let mut conn = f.pool.acquire().await.unwrap();
    let err = distributed
        .publish(&mut conn, Message::new("q", b"x"))
        .await
        .unwrap_err();
    match &err {
        Error::InvalidConfig { knob, reason } => {
            assert_eq!(*knob, "distributed");
            assert!(reason.contains("has no bucket column"), "{reason}");
        }
        other => panic!("expected InvalidConfig, got {other:?}"),
    }
    assert!(f.rows("q").await.is_empty());
    // validate_schema says that alone, not the distributed indexes `migrate` would refuse
    // to build (a fresh-user trial was told to run it).
    match distributed.validate_schema(&f.pool).await {
        Err(Error::SchemaMismatch { problems }) => {
            assert_eq!(problems.len(), 1, "{problems:?}");
            assert!(
                problems[0].message.contains("single-node outbox table")
                    && problems[0].message.contains("without `distributed(4)`"),
                "{problems:?}"
            );
        }
        other => panic!("{other:?}"),
    }
    f.cleanup().await;
}
