//! Dead letters on Postgres with its real clock (SPEC §1.2, §8):
//! what only a database shows — the caller's transaction, two operators redriving the same
//! rows at once, a purge beside a redrive in progress, plans, a worker woken by a redrive,
//! rows archived by the real worker path.
//!
//! The rules themselves (filters and paging, redrive of one, many and all matching, per-row
//! outcomes for a held key, raw headers and headers over the limit, purge by age in
//! batches, the refusal without the dead-letter queue) are scenarios of the contract suite
//! (`contract::dlq`), which runs each on Postgres and on `MemoryStore` with the same
//! expected values.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use outbox::dlq::{DeadLetterFilter, Redrive, RedriveOutcome, RedriveResult, REDRIVEN_FROM_HEADER};
use outbox::message::Headers;
use outbox::store::{ClaimRequest, Completion, DeadLetter, Failure, FailureReason, Store};
use outbox::{Context, Error, Message, Outbox, Outcome, PgStore, Worker};
use outbox_tests::{eventually, Fixture};
use serde_json::Value;
use sqlx::{AssertSqlSafe, PgPool};

const Q: &str = "dlq.jobs";

/// Publishes `payload` on `queue` (timer `key` if given), claims it and rejects it: one dead
/// letter. Returns the queue row's id.
async fn archive(f: &Fixture, queue: &str, key: Option<&str>, payload: &[u8]) -> i64 {
    let mut conn = f.pool.acquire().await.unwrap();
    let mut m = Message::new(queue, payload);
    if let Some(k) = key {
        m = m.timer_id(k);
    }
    let id = f.outbox.publish(&mut conn, m).await.unwrap().id().unwrap();
    let claimed = f
        .store
        .claim(ClaimRequest::new(&[queue.to_owned()], 1, Duration::from_secs(60)).only(&[id]))
        .await
        .unwrap();
    assert_eq!(claimed.len(), 1);
    let failure = Failure {
        reason: FailureReason::Rejected,
        last_error: Some("no"),
    };
    assert_eq!(
        f.store.fail(claimed[0].lease, failure).await.unwrap(),
        Completion::Deleted
    );
    id
}

async fn all_letters(f: &Fixture) -> Vec<DeadLetter> {
    f.store
        .dead_letters(&DeadLetterFilter::new(), None, 100_000)
        .await
        .unwrap()
}

async fn sql(pool: &PgPool, text: String) {
    sqlx::raw_sql(AssertSqlSafe(text))
        .execute(pool)
        .await
        .unwrap();
}

fn results(outcomes: &[RedriveOutcome]) -> Vec<RedriveResult> {
    outcomes.iter().map(|o| o.result).collect()
}

/// The redrive runs in the caller's transaction: the new rows and the marks exist only if
/// it commits, and `redriven_at` is that transaction's database time.
#[tokio::test]
async fn a_redrive_commits_or_rolls_back_with_the_callers_transaction() {
    let f = Fixture::new().await;
    archive(&f, Q, Some("k"), b"a").await;
    archive(&f, Q, None, b"b").await;

    let mut tx = f.pool.begin().await.unwrap();
    let done = f
        .outbox
        .redrive_dead_letters(&mut tx, &Redrive::ids([1, 2]))
        .await
        .unwrap();
    assert_eq!(
        results(&done),
        [
            RedriveResult::Redriven { id: 3 },
            RedriveResult::Redriven { id: 4 }
        ]
    );
    let inside = f.outbox.pending(&mut tx, Q, 10).await.unwrap();
    assert_eq!(inside.len(), 2, "visible inside the transaction");
    assert!(
        f.rows(Q).await.is_empty(),
        "invisible outside before commit"
    );
    assert!(
        all_letters(&f)
            .await
            .iter()
            .all(|d| d.redriven_at.is_none()),
        "a list is a plain read: not blocked, and sees the dead letters unmarked"
    );
    tx.rollback().await.unwrap();
    assert!(f.rows(Q).await.is_empty());
    assert!(all_letters(&f)
        .await
        .iter()
        .all(|d| d.redriven_at.is_none() && d.redriven_id.is_none()));

    let mut tx = f.pool.begin().await.unwrap();
    let tx_now: DateTime<Utc> = sqlx::query_scalar("SELECT now()")
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    let done = f
        .outbox
        .redrive_dead_letters(&mut tx, &Redrive::ids([1, 2]))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let ids: Vec<i64> = done.iter().filter_map(|o| o.result.id()).collect();
    assert_eq!(ids.len(), 2);
    let live = f.rows(Q).await;
    assert_eq!(live.iter().map(|r| r.id).collect::<Vec<_>>(), ids);
    assert_eq!(live[0].timer_id.as_deref(), Some("k"), "the key goes back");
    assert_eq!(live[0].next_attempt_at, tx_now, "due now");
    for (letter, id) in all_letters(&f).await.iter().zip(&ids) {
        assert_eq!(letter.redriven_at, Some(tx_now), "the database clock");
        assert_eq!(letter.redriven_id, Some(*id));
    }
    f.cleanup().await;
}

/// Two operators redrive the same rows at once. The second waits for the first's row locks;
/// after a commit it reports every row already redriven, after a rollback it redrives them.
/// Never a second queue row for one dead letter.
#[tokio::test]
async fn a_second_redrive_of_the_same_rows_waits_and_never_duplicates() {
    let f = Fixture::new().await;
    for n in 0..3 {
        archive(&f, Q, Some(&format!("k{n}")), b"x").await;
    }
    let ids = Redrive::ids([1, 2, 3]);

    let mut a = f.pool.begin().await.unwrap();
    let first = f.outbox.redrive_dead_letters(&mut a, &ids).await.unwrap();
    let new_ids: Vec<i64> = first.iter().filter_map(|o| o.result.id()).collect();
    assert_eq!(new_ids.len(), 3);
    let second = {
        let (pool, outbox, ids) = (f.pool.clone(), f.outbox.clone(), ids.clone());
        tokio::spawn(async move {
            let mut b = pool.begin().await.unwrap();
            let got = outbox.redrive_dead_letters(&mut b, &ids).await.unwrap();
            b.commit().await.unwrap();
            got
        })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !second.is_finished(),
        "the second redrive waits for the row locks"
    );
    a.commit().await.unwrap();
    let second = tokio::time::timeout(Duration::from_secs(10), second)
        .await
        .expect("the second redrive ends once the first commits")
        .unwrap();
    assert_eq!(
        results(&second),
        new_ids
            .iter()
            .map(|&id| RedriveResult::AlreadyRedriven {
                redriven_id: Some(id)
            })
            .collect::<Vec<_>>()
    );
    assert_eq!(f.rows(Q).await.len(), 3);

    // After a rollback of the first, the second takes the rows.
    for n in 3..5 {
        archive(&f, Q, None, format!("y{n}").as_bytes()).await;
    }
    let both = Redrive::matching(DeadLetterFilter::new().queue(Q), 10);
    let mut a = f.pool.begin().await.unwrap();
    let first = f.outbox.redrive_dead_letters(&mut a, &both).await.unwrap();
    assert_eq!(first.len(), 2);
    let second = {
        let (pool, outbox, both) = (f.pool.clone(), f.outbox.clone(), both.clone());
        tokio::spawn(async move {
            let mut b = pool.begin().await.unwrap();
            let got = outbox.redrive_dead_letters(&mut b, &both).await.unwrap();
            b.commit().await.unwrap();
            got
        })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!second.is_finished());
    a.rollback().await.unwrap();
    let second = tokio::time::timeout(Duration::from_secs(10), second)
        .await
        .expect("the second redrive ends once the first rolls back")
        .unwrap();
    assert_eq!(
        second.iter().map(|o| o.dead_letter_id).collect::<Vec<_>>(),
        [4, 5]
    );
    assert!(second
        .iter()
        .all(|o| matches!(o.result, RedriveResult::Redriven { .. })));
    assert_eq!(f.rows(Q).await.len(), 5);
    f.cleanup().await;
}

/// Many operators at once, by ids and by filter, over the same 30 rows: each dead letter is
/// redriven exactly once, and its queue row points back to it.
#[tokio::test]
async fn concurrent_redrives_redrive_each_row_exactly_once() {
    let f = Fixture::new().await;
    let mut values = Vec::new();
    for n in 0..30 {
        // Every third a timer, so the ON CONFLICT path runs too.
        let key = (n % 3 == 0).then(|| format!("t{n}"));
        values.push((n, key));
    }
    for (n, key) in &values {
        archive(&f, Q, key.as_deref(), format!("{n}").as_bytes()).await;
    }
    let letters = all_letters(&f).await;
    let dlq_ids: Vec<i64> = letters.iter().map(|d| d.id).collect();
    let mut tasks = Vec::new();
    for i in 0..6 {
        let (pool, outbox) = (f.pool.clone(), f.outbox.clone());
        let redrive = if i % 2 == 0 {
            Redrive::ids(dlq_ids.iter().rev().copied())
        } else {
            Redrive::matching(DeadLetterFilter::new().queue(Q), 1000)
        };
        tasks.push(tokio::spawn(async move {
            let mut tx = pool.begin().await.unwrap();
            let got = outbox
                .redrive_dead_letters(&mut tx, &redrive)
                .await
                .unwrap();
            tokio::time::sleep(Duration::from_millis(20)).await;
            tx.commit().await.unwrap();
            got
        }));
    }
    let mut redriven = Vec::new();
    for t in tasks {
        for o in tokio::time::timeout(Duration::from_secs(30), t)
            .await
            .expect("no redrive hangs")
            .unwrap()
        {
            match o.result {
                RedriveResult::Redriven { id } => redriven.push((o.dead_letter_id, id)),
                RedriveResult::AlreadyRedriven { .. } => {}
                other => panic!("unexpected {other:?} for {}", o.dead_letter_id),
            }
        }
    }
    redriven.sort();
    assert_eq!(
        redriven.iter().map(|(d, _)| *d).collect::<Vec<_>>(),
        dlq_ids,
        "each dead letter redriven by exactly one operator"
    );
    let live = f.rows(Q).await;
    assert_eq!(live.len(), 30, "one queue row per dead letter");
    for letter in all_letters(&f).await {
        let row = live
            .iter()
            .find(|r| Some(r.id) == letter.redriven_id)
            .expect("redriven_id names a live row");
        let from = row.headers.as_ref().unwrap()[REDRIVEN_FROM_HEADER].clone();
        assert_eq!(from, letter.id.to_string());
        assert_eq!(row.payload, letter.payload);
        assert_eq!(row.timer_id, letter.timer_id);
    }
    f.cleanup().await;
}

/// A purge skips the rows a redrive in progress holds instead of waiting for it, and a
/// later purge takes them.
#[tokio::test]
async fn a_purge_never_waits_for_a_redrive_in_progress() {
    let f = Fixture::new().await;
    for n in 0..4 {
        archive(&f, Q, None, format!("{n}").as_bytes()).await;
    }
    let d = f.outbox.dead_letter_table();
    sql(
        &f.pool,
        format!("UPDATE {d} SET failed_at = now() - interval '2 days'"),
    )
    .await;
    let mut a = f.pool.begin().await.unwrap();
    f.outbox
        .redrive_dead_letters(&mut a, &Redrive::ids([1, 2]))
        .await
        .unwrap();
    let day = DeadLetterFilter::new().older_than(Duration::from_secs(86_400));
    let purged = tokio::time::timeout(
        Duration::from_secs(10),
        f.outbox.purge_dead_letters(&f.pool, &day, 10),
    )
    .await
    .expect("the purge does not wait for the redrive's locks")
    .unwrap();
    assert_eq!(purged, 2, "the rows the redrive holds are skipped");
    a.commit().await.unwrap();
    let left = all_letters(&f).await;
    assert_eq!(left.iter().map(|d| d.id).collect::<Vec<_>>(), [1, 2]);
    assert!(left.iter().all(|d| d.redriven_id.is_some()));
    assert_eq!(
        f.outbox
            .purge_dead_letters(&f.pool, &day, 10)
            .await
            .unwrap(),
        2
    );
    assert!(all_letters(&f).await.is_empty());
    assert_eq!(f.rows(Q).await.len(), 2, "the redriven rows live on");
    f.cleanup().await;
}

/// Purge by age on the real clock, in batches: rows older than the cutoff go, newer stay,
/// the count is returned.
#[tokio::test]
async fn a_purge_by_age_deletes_in_batches_and_keeps_newer_rows() {
    let f = Fixture::new().await;
    for n in 0..7 {
        archive(&f, Q, None, format!("{n}").as_bytes()).await;
    }
    let d = f.outbox.dead_letter_table();
    // Five rows between 31 and 35 days old, two fresh.
    sql(
        &f.pool,
        format!("UPDATE {d} SET failed_at = now() - (30 + id) * interval '1 day' WHERE id <= 5"),
    )
    .await;
    let month = DeadLetterFilter::new().older_than(Duration::from_secs(30 * 86_400));
    assert_eq!(
        f.outbox
            .purge_dead_letters(&f.pool, &month, 2)
            .await
            .unwrap(),
        5,
        "three batches: 2 + 2 + 1"
    );
    let left = all_letters(&f).await;
    assert_eq!(left.iter().map(|d| d.id).collect::<Vec<_>>(), [6, 7]);
    assert_eq!(
        f.outbox
            .purge_dead_letters(&f.pool, &month, 2)
            .await
            .unwrap(),
        0
    );
    f.cleanup().await;
}

/// Keyset paging through more rows than a page, with rows archived between pages: every row
/// once, in id order.
#[tokio::test]
async fn paging_sees_every_row_once_while_rows_are_archived() {
    let f = Fixture::new().await;
    let d = f.outbox.dead_letter_table().to_owned();
    let insert = |n: i64| {
        format!(
            "INSERT INTO {d} (original_id, queue, payload, attempts_count, deliveries_count, \
               created_at, failure_reason) \
             SELECT g, '{Q}', 'p', 1, 1, now(), 'rejected' FROM generate_series(1, {n}) g"
        )
    };
    sql(&f.pool, insert(250)).await;
    let mut conn = f.pool.acquire().await.unwrap();
    let all = DeadLetterFilter::new().queue(Q);
    let mut seen = Vec::new();
    let mut after = None;
    let mut pages = 0;
    loop {
        let page = f
            .outbox
            .dead_letters(&mut conn, &all, after, 100)
            .await
            .unwrap();
        pages += 1;
        if pages == 1 {
            sql(&f.pool, insert(5)).await;
        }
        seen.extend(page.iter().map(|d| d.id));
        match page.last() {
            Some(last) if page.len() == 100 => after = Some(last.id),
            _ => break,
        }
    }
    assert_eq!(pages, 3);
    assert_eq!(seen, (1..=255).collect::<Vec<i64>>());
    f.cleanup().await;
}

/// Index scans on a dead-letter table of 20 000 rows: the purge walks `(failed_at)`, the
/// list and the redrives the primary key; none reads the whole table.
#[tokio::test]
async fn dead_letter_statements_use_their_indexes() {
    let f = Fixture::new().await;
    let d = f.outbox.dead_letter_table();
    sql(
        &f.pool,
        format!(
            "INSERT INTO {d} (original_id, queue, payload, attempts_count, deliveries_count, \
               created_at, failed_at, failure_reason) \
             SELECT g, 'q' || (g % 20), 'p', 1, 1, now(), now() - g * interval '1 minute', \
               'rejected' FROM generate_series(1, 20000) g; ANALYZE {d};"
        ),
    )
    .await;
    let name = d.trim_matches('"').to_owned();
    let statements = f.outbox.statements();
    let text = |name: &str| {
        statements
            .iter()
            .find(|(n, _)| *n == name)
            .unwrap_or_else(|| panic!("no statement {name}"))
            .1
            .clone()
    };
    let none: Option<String> = None;
    let no_time: Option<DateTime<Utc>> = None;
    let day = sqlx::postgres::types::PgInterval {
        months: 0,
        days: 1,
        microseconds: 0,
    };
    async fn plan(
        pool: &PgPool,
        q: sqlx::query::QueryScalar<'_, sqlx::Postgres, Value, sqlx::postgres::PgArguments>,
    ) -> Value {
        q.fetch_one(pool).await.unwrap()
    }
    let explain = |sql: String| -> &'static str {
        Box::leak(format!("EXPLAIN (FORMAT JSON) {sql}").into_boxed_str())
    };
    let purge = plan(
        &f.pool,
        sqlx::query_scalar(AssertSqlSafe(explain(text("dlq.purge"))))
            .bind(none.clone())
            .bind(none.clone())
            .bind(no_time)
            .bind(no_time)
            .bind(Some(day))
            .bind(true)
            .bind(100i64),
    )
    .await;
    let list = plan(
        &f.pool,
        sqlx::query_scalar(AssertSqlSafe(explain(text("dlq.list"))))
            .bind(none.clone())
            .bind(none.clone())
            .bind(no_time)
            .bind(no_time)
            .bind(None::<sqlx::postgres::types::PgInterval>)
            .bind(true)
            .bind(5_000i64)
            .bind(100i64),
    )
    .await;
    let redrive = plan(
        &f.pool,
        sqlx::query_scalar(AssertSqlSafe(explain(text("dlq.redrive_ids"))))
            .bind(vec![10i64, 20, 30])
            .bind(REDRIVEN_FROM_HEADER)
            .bind(65_536i64),
    )
    .await;
    let matching = plan(
        &f.pool,
        sqlx::query_scalar(AssertSqlSafe(explain(text("dlq.redrive_matching"))))
            .bind(none.clone())
            .bind(none.clone())
            .bind(no_time)
            .bind(no_time)
            .bind(None::<sqlx::postgres::types::PgInterval>)
            .bind(true)
            .bind(100i64)
            .bind(REDRIVEN_FROM_HEADER)
            .bind(65_536i64),
    )
    .await;
    /// `(node type, index name)` of every scan of `table` (a bitmap scan's index is its
    /// child's).
    fn scans(plan: &Value, table: &str, out: &mut Vec<(String, String)>) {
        let kind = plan["Node Type"].as_str().unwrap_or("");
        if plan.get("Relation Name").and_then(Value::as_str) == Some(table)
            && kind.ends_with("Scan")
        {
            let index = match kind {
                "Bitmap Heap Scan" => &plan["Plans"][0]["Index Name"],
                _ => &plan["Index Name"],
            };
            out.push((kind.to_owned(), index.as_str().unwrap_or("").to_owned()));
        }
        for c in plan
            .get("Plans")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            scans(c, table, out);
        }
    }
    // The rows a statement selects come through `index`; its writes (the purge's DELETE,
    // the redrive's UPDATE) name the ids, through the primary key.
    let pkey = format!("{name}_pkey");
    for (stmt, plan, index) in [
        ("dlq.purge", &purge, format!("{name}_failed_at_idx")),
        ("dlq.list", &list, pkey.clone()),
        ("dlq.redrive_ids", &redrive, pkey.clone()),
        ("dlq.redrive_matching", &matching, pkey.clone()),
    ] {
        let mut found = Vec::new();
        scans(&plan[0]["Plan"], &name, &mut found);
        assert!(
            found.iter().any(|(_, used)| *used == index),
            "{stmt} does not select through {index}:\n{plan:#}"
        );
        for (kind, used) in &found {
            assert!(
                (kind.starts_with("Index") || kind == "Bitmap Heap Scan")
                    && (*used == index || *used == pkey),
                "{stmt}: {kind} on {used:?}, expected index scans on {index} or {pkey}:\n{plan:#}"
            );
        }
    }
    f.cleanup().await;
}

/// A redriven row wakes a sleeping worker (NOTIFY at commit, like a publish) and is
/// handled like any row; the handler sees where it came from.
#[tokio::test]
async fn a_redriven_row_wakes_a_worker_and_is_handled() {
    let f = Fixture::new().await;
    // (row id, headers, payload) of each run.
    type Run = (i64, Option<Headers>, Vec<u8>);
    let seen: Arc<Mutex<Vec<Run>>> = Arc::default();
    let handler = {
        let seen = seen.clone();
        move |payload: Vec<u8>, ctx: Context| {
            let seen = seen.clone();
            async move {
                let redriven = ctx
                    .headers()
                    .is_some_and(|h| h.contains_key(REDRIVEN_FROM_HEADER));
                seen.lock()
                    .unwrap()
                    .push((ctx.id(), ctx.headers().cloned(), payload));
                if redriven {
                    Outcome::Ack
                } else {
                    Outcome::Reject("bad input".to_owned())
                }
            }
        }
    };
    let worker = Worker::builder(f.store.clone())
        .queue(Q, handler)
        .idle_poll(Duration::from_secs(60))
        .build()
        .unwrap()
        .start();
    let hs = Headers::from([("trace".to_owned(), "t-1".to_owned())]);
    let mut conn = f.pool.acquire().await.unwrap();
    let first = f
        .outbox
        .publish(
            &mut conn,
            Message::new(Q, b"job").timer_id("j1").headers(&hs),
        )
        .await
        .unwrap()
        .id()
        .unwrap();
    eventually(10, "the first run rejects it", || async {
        all_letters(&f).await.len() == 1
    })
    .await;
    let letter = all_letters(&f).await.remove(0);
    assert_eq!(
        (letter.original_id, letter.failure_reason.as_str()),
        (first, "rejected")
    );

    // The worker sleeps now (idle_poll 60 s): only the redrive's notification wakes it
    // within the 10 s bound.
    let mut tx = f.pool.begin().await.unwrap();
    let done = f
        .outbox
        .redrive_dead_letters(&mut tx, &Redrive::id(letter.id))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let new_id = done[0].result.id().expect("redriven");
    eventually(10, "the redriven row runs and is acked", || async {
        seen.lock().unwrap().len() == 2 && f.rows(Q).await.is_empty()
    })
    .await;
    worker.shutdown().await;
    let runs = seen.lock().unwrap().clone();
    let mut want = hs.clone();
    want.insert(REDRIVEN_FROM_HEADER.to_owned(), letter.id.to_string());
    assert_eq!(runs[1], (new_id, Some(want), b"job".to_vec()));
    let letters = all_letters(&f).await;
    assert_eq!(letters.len(), 1, "acked: not archived again");
    assert_eq!(letters[0].redriven_id, Some(new_id));
    f.cleanup().await;
}

/// Headers that are not a string map, archived by the worker's own path (a terminal
/// `decode_error`), give their own outcome; the good row beside them goes back.
#[tokio::test]
async fn a_worker_archived_row_with_raw_headers_is_refused_per_row() {
    let f = Fixture::new().await;
    let mut conn = f.pool.acquire().await.unwrap();
    for p in [&b"bad"[..], b"good"] {
        f.outbox
            .publish(&mut conn, Message::new(Q, p))
            .await
            .unwrap();
    }
    let t = f.outbox.table();
    sql(
        &f.pool,
        format!("UPDATE {t} SET headers = '{{\"n\": 1}}' WHERE payload = 'bad'"),
    )
    .await;
    let worker = Worker::builder(f.store.clone())
        .queue(Q, |_: Vec<u8>, _: Context| async {
            Outcome::Reject("no".to_owned())
        })
        .build()
        .unwrap();
    worker.run_due().await.unwrap();
    let letters = all_letters(&f).await;
    let by_payload = |p: &[u8]| letters.iter().find(|d| d.payload == p).unwrap().clone();
    let (bad, good) = (by_payload(b"bad"), by_payload(b"good"));
    assert_eq!(bad.failure_reason, "decode_error");
    assert_eq!(bad.raw_headers.as_deref(), Some(r#"{"n":1}"#));
    let mut tx = f.pool.begin().await.unwrap();
    let done = f
        .outbox
        .redrive_dead_letters(&mut tx, &Redrive::ids([bad.id, good.id]))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let by_id = |id: i64| done.iter().find(|o| o.dead_letter_id == id).unwrap().result;
    assert_eq!(by_id(bad.id), RedriveResult::HeadersNotAMap);
    assert!(matches!(by_id(good.id), RedriveResult::Redriven { .. }));
    let after = all_letters(&f).await;
    assert_eq!(
        after.iter().find(|d| d.id == bad.id).unwrap(),
        &bad,
        "left as it was"
    );
    assert_eq!(f.rows(Q).await.len(), 1);
    f.cleanup().await;
}

/// Tables migrated with the dead-letter queue off lack the redrive columns: an outbox that
/// turns it on without migrating is told to run the upgrade, not given a bare SQL error;
/// `migrate()` with it on adds them.
#[tokio::test]
async fn tables_migrated_without_the_dead_letter_queue_ask_for_the_upgrade() {
    let f = Fixture::with(|b| b.dead_letter(false)).await;
    let off = f
        .store
        .dead_letters(&DeadLetterFilter::new(), None, 10)
        .await;
    assert!(matches!(off, Err(Error::DeadLetterDisabled)), "{off:?}");
    let table = f.outbox.table().trim_matches('"').to_owned();
    let on = Outbox::builder()
        .table(table)
        .dead_letter(true)
        .build()
        .unwrap();
    let store = PgStore::new(f.pool.clone(), on.clone());
    match store.dead_letters(&DeadLetterFilter::new(), None, 10).await {
        Err(Error::UpgradeRequired { detail }) => assert!(detail.contains("redriven_"), "{detail}"),
        other => panic!("expected UpgradeRequired, got {other:?}"),
    }
    on.migrate(&f.pool).await.unwrap();
    assert!(store
        .dead_letters(&DeadLetterFilter::new(), None, 10)
        .await
        .unwrap()
        .is_empty());
    f.cleanup().await;
}

/// The dead-letter futures are Send (a compile-time check: built, never run), so an
/// operator tool can run them inside `tokio::spawn`.
#[test]
fn dead_letter_futures_are_send() {
    fn send<T: Send>(_: T) {}
    let _ = |outbox: &Outbox, conn: &mut sqlx::PgConnection, pool: &PgPool| {
        let filter = DeadLetterFilter::new();
        send(outbox.dead_letters(conn, &filter, None, 1));
        send(outbox.redrive_dead_letters(conn, &Redrive::id(1)));
        send(outbox.purge_dead_letters(pool, &filter, 1));
    };
}
