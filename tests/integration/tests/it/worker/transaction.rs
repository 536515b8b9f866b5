//! Completion in the handler's transaction (SPEC §7.9) on real Postgres: the handler's
//! writes and its row's fenced completion commit together or not at all.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use sqlx::{AssertSqlSafe, Executor, PgPool};
use tokio::sync::Notify;

use outbox::dlq::DeadLetterFilter;
use outbox::{
    store::Completion, Cancelled, Context, Error, HandlerOptions, Published, RetryStrategy, Worker,
};
use outbox_tests::{eventually, Fixture};

#[outbox::timer(queue = "tx.jobs", max_deliveries = 10)]
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
struct Job {
    n: i64,
}

/// The application's own table, next to the queue.
async fn effects_table(f: &Fixture) -> String {
    let name = format!("{}_effects", f.outbox.table().trim_matches('"'));
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE TABLE \"{name}\" (id bigserial PRIMARY KEY, n bigint NOT NULL, attempt int NOT NULL)"
    )))
    .execute(&f.pool)
    .await
    .unwrap();
    format!("\"{name}\"")
}

async fn drop_table(f: &Fixture, table: &str) {
    sqlx::raw_sql(AssertSqlSafe(format!("DROP TABLE IF EXISTS {table}")))
        .execute(&f.pool)
        .await
        .unwrap();
}

async fn effects(pool: &PgPool, table: &str) -> Vec<(i64, i32)> {
    sqlx::query_as(AssertSqlSafe(format!(
        "SELECT n, attempt FROM {table} ORDER BY n, attempt"
    )))
    .fetch_all(pool)
    .await
    .unwrap()
}

async fn publish(f: &Fixture, n: i64, delay: Duration) -> Published {
    let mut conn = f.pool.acquire().await.unwrap();
    outbox::message::extend_timer(
        &mut f.outbox.on(&mut conn),
        &format!("job-{n}"),
        &Job { n },
        delay,
    )
    .await
    .unwrap()
}

fn fast(f: &Fixture) -> outbox::WorkerBuilder<outbox::PgStore> {
    Worker::builder(f.store.clone()).idle_poll(Duration::from_millis(100))
}

fn insert(table: &str) -> String {
    format!("INSERT INTO {table} (n, attempt) VALUES ($1, $2)")
}

/// Every handler writes its effect and commits it with its completion: each job's effect
/// exists exactly once and the queue is empty.
#[tokio::test]
async fn writes_and_completion_commit_together() {
    let f = Fixture::new().await;
    let table = effects_table(&f).await;
    let completions = Arc::new(std::sync::Mutex::new(Vec::new()));
    let worker = {
        let (sql, completions) = (insert(&table), completions.clone());
        fast(&f)
            .concurrency(4)
            .timer::<Job>(move |job: Job, ctx: Context| {
                let (sql, completions) = (sql.clone(), completions.clone());
                async move {
                    let mut tx = ctx.begin().await?;
                    sqlx::query(AssertSqlSafe(sql))
                        .bind(job.n)
                        .bind(ctx.attempt() as i32)
                        .execute(&mut *tx)
                        .await?;
                    let done = tx.commit().await?;
                    completions.lock().unwrap().push(done);
                    Ok::<_, Error>(())
                }
            })
            .build()
            .unwrap()
            .start()
    };
    for n in 0..20 {
        publish(&f, n, Duration::ZERO).await;
    }
    eventually(20, "every job ran", || async {
        f.rows("tx.jobs").await.is_empty() && effects(&f.pool, &table).await.len() == 20
    })
    .await;
    assert!(worker.shutdown().await.graceful);
    let written = effects(&f.pool, &table).await;
    assert_eq!(
        written,
        (0..20).map(|n| (n, 1)).collect::<Vec<_>>(),
        "each effect once"
    );
    let completions = completions.lock().unwrap().clone();
    assert_eq!(completions.len(), 20);
    assert!(completions.iter().all(|c| *c == Completion::Deleted));
    drop_table(&f, &table).await;
    f.cleanup().await;
}

/// A worker whose lease was taken by another (here: the test re-leases the row, as a
/// second worker's claim after expiry would) commits nothing: `commit` reports
/// `LeaseLost`, the handler's write is rolled back, and the other lease is untouched.
#[tokio::test]
async fn a_stale_worker_commits_nothing() {
    let f = Fixture::new().await;
    let table = effects_table(&f).await;
    let (wrote, steal) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let result = Arc::new(std::sync::Mutex::new(None));
    let worker = {
        let (sql, wrote, steal, result) =
            (insert(&table), wrote.clone(), steal.clone(), result.clone());
        fast(&f)
            .timer::<Job>(move |job: Job, ctx: Context| {
                let (sql, wrote, steal, result) =
                    (sql.clone(), wrote.clone(), steal.clone(), result.clone());
                async move {
                    let mut tx = ctx.begin().await?;
                    sqlx::query(AssertSqlSafe(sql))
                        .bind(job.n)
                        .bind(1)
                        .execute(&mut *tx)
                        .await?;
                    wrote.notify_one();
                    steal.notified().await;
                    let done = tx.commit().await;
                    let lost = matches!(done, Err(Error::LeaseLost { .. }));
                    *result.lock().unwrap() = Some(lost);
                    done.map(drop)
                }
            })
            .build()
            .unwrap()
            .start()
    };
    publish(&f, 1, Duration::ZERO).await;
    wrote.notified().await;
    let other = uuid::Uuid::new_v4();
    sqlx::query(AssertSqlSafe(format!(
        "UPDATE {} SET acquired_token = $1, acquired_at = now()",
        f.outbox.table()
    )))
    .bind(other)
    .execute(&f.pool)
    .await
    .unwrap();
    steal.notify_one();
    eventually(10, "the handler finished", || async {
        result.lock().unwrap().is_some()
    })
    .await;
    assert_eq!(
        *result.lock().unwrap(),
        Some(true),
        "commit reported LeaseLost"
    );
    assert!(
        effects(&f.pool, &table).await.is_empty(),
        "nothing committed"
    );
    let row = f.only_row("tx.jobs").await;
    assert_eq!(
        row.acquired_token,
        Some(other),
        "the other lease is untouched"
    );
    worker.shutdown().await;
    drop_table(&f, &table).await;
    f.cleanup().await;
}

/// SPEC §5.3 inside the handler's transaction: an extend that has locked the running row
/// and not committed yet makes the commit wait; once it commits, the completion applies
/// the rearm it queued, and the timer fires again.
#[tokio::test]
async fn a_rearm_from_an_uncommitted_extend_is_applied_at_commit() {
    let f = Fixture::new().await;
    let table = effects_table(&f).await;
    let (wrote, go) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let completions = Arc::new(std::sync::Mutex::new(Vec::new()));
    let worker = {
        let (sql, wrote, go, completions) = (
            insert(&table),
            wrote.clone(),
            go.clone(),
            completions.clone(),
        );
        fast(&f)
            .timer::<Job>(move |job: Job, ctx: Context| {
                let (sql, wrote, go, completions) =
                    (sql.clone(), wrote.clone(), go.clone(), completions.clone());
                async move {
                    let first = completions.lock().unwrap().is_empty();
                    let mut tx = ctx.begin().await?;
                    sqlx::query(AssertSqlSafe(sql))
                        .bind(job.n)
                        .bind(ctx.delivery() as i32)
                        .execute(&mut *tx)
                        .await?;
                    if first {
                        wrote.notify_one();
                        go.notified().await;
                    }
                    let done = tx.commit().await?;
                    completions.lock().unwrap().push(done);
                    Ok::<_, Error>(())
                }
            })
            .build()
            .unwrap()
            .start()
    };
    publish(&f, 1, Duration::ZERO).await;
    wrote.notified().await;
    // The extend, in an application transaction left open.
    let mut app = f.pool.begin().await.unwrap();
    let extended = outbox::message::extend_timer(
        &mut f.outbox.on(&mut app),
        "job-1",
        &Job { n: 2 },
        Duration::from_millis(300),
    )
    .await
    .unwrap();
    assert!(
        matches!(extended, Published::RearmQueued { .. }),
        "{extended:?}"
    );
    go.notify_one();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        completions.lock().unwrap().is_empty(),
        "the commit waits for the extend's row lock"
    );
    app.commit().await.unwrap();
    eventually(10, "the rearmed timer ran", || async {
        completions.lock().unwrap().len() == 2
    })
    .await;
    let completions = completions.lock().unwrap().clone();
    assert!(
        matches!(completions[0], Completion::Rearmed { .. }),
        "{completions:?}"
    );
    assert_eq!(completions[1], Completion::Deleted);
    assert_eq!(effects(&f.pool, &table).await, vec![(1, 1), (2, 1)]);
    worker.shutdown().await;
    drop_table(&f, &table).await;
    f.cleanup().await;
}

/// A panic, an error returned before the commit, and a transaction dropped open all leave
/// no writes; only the run that commits writes, once.
#[tokio::test]
async fn failed_runs_leave_no_writes() {
    let f = Fixture::new().await;
    let table = effects_table(&f).await;
    let runs = Arc::new(AtomicUsize::new(0));
    let worker = {
        let (sql, runs) = (insert(&table), runs.clone());
        fast(&f)
            .timer_with::<Job>(
                move |job: Job, ctx: Context| {
                    let (sql, runs) = (sql.clone(), runs.clone());
                    async move {
                        let run = runs.fetch_add(1, Ordering::SeqCst) + 1;
                        let mut tx = ctx.begin().await?;
                        sqlx::query(AssertSqlSafe(sql))
                            .bind(job.n)
                            .bind(run as i32)
                            .execute(&mut *tx)
                            .await?;
                        match run {
                            1 => panic!("the first run panics inside its transaction"),
                            2 => {
                                return Err(Error::TransactionUnavailable {
                                    reason: "the second run fails before committing".into(),
                                })
                            }
                            3 => {
                                drop(tx);
                                return Ok(());
                            }
                            _ => {}
                        }
                        tx.commit().await?;
                        Ok(())
                    }
                },
                HandlerOptions::new().retry(RetryStrategy::constant(Duration::from_millis(10))),
            )
            .build()
            .unwrap()
            .start()
    };
    publish(&f, 7, Duration::ZERO).await;
    eventually(20, "the fourth run committed", || async {
        f.rows("tx.jobs").await.is_empty()
    })
    .await;
    worker.shutdown().await;
    assert_eq!(runs.load(Ordering::SeqCst), 4);
    assert_eq!(
        effects(&f.pool, &table).await,
        vec![(7, 4)],
        "only the committed run wrote"
    );
    drop_table(&f, &table).await;
    f.cleanup().await;
}

/// A handler that begins a transaction and returns `Ok` without committing it fails its
/// run ("transaction not committed"): here terminally, so the dead letter says why.
#[tokio::test]
async fn a_handler_that_forgets_to_commit_fails_its_run() {
    let f = Fixture::new().await;
    let table = effects_table(&f).await;
    let worker = {
        let sql = insert(&table);
        fast(&f)
            .timer_with::<Job>(
                move |job: Job, ctx: Context| {
                    let sql = sql.clone();
                    async move {
                        let mut tx = ctx.begin().await?;
                        sqlx::query(AssertSqlSafe(sql))
                            .bind(job.n)
                            .bind(1)
                            .execute(&mut *tx)
                            .await?;
                        // No commit: `tx` is dropped here.
                        Ok::<_, Error>(())
                    }
                },
                HandlerOptions::new().retry(RetryStrategy::none()),
            )
            .build()
            .unwrap()
            .start()
    };
    publish(&f, 3, Duration::ZERO).await;
    eventually(10, "the run failed for good", || async {
        f.rows("tx.jobs").await.is_empty()
    })
    .await;
    worker.shutdown().await;
    assert!(effects(&f.pool, &table).await.is_empty());
    let letters = f
        .store
        .dead_letters(&DeadLetterFilter::new().queue("tx.jobs"), None, 10)
        .await
        .unwrap();
    assert_eq!(letters.len(), 1);
    assert!(
        letters[0]
            .last_error
            .as_deref()
            .unwrap_or_default()
            .contains("transaction not committed"),
        "{letters:?}"
    );
    drop_table(&f, &table).await;
    f.cleanup().await;
}

/// A cancel that reaches the row while its handler runs: the handler's commit deletes the
/// row (its work stands), and the timer never runs again.
#[tokio::test]
async fn a_cancel_during_the_run_deletes_the_row_at_commit() {
    let f = Fixture::new().await;
    let table = effects_table(&f).await;
    let (wrote, go) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let runs = Arc::new(AtomicUsize::new(0));
    let worker = {
        let (sql, wrote, go, runs) = (insert(&table), wrote.clone(), go.clone(), runs.clone());
        fast(&f)
            .timer::<Job>(move |job: Job, ctx: Context| {
                let (sql, wrote, go, runs) = (sql.clone(), wrote.clone(), go.clone(), runs.clone());
                async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    let mut tx = ctx.begin().await?;
                    sqlx::query(AssertSqlSafe(sql))
                        .bind(job.n)
                        .bind(1)
                        .execute(&mut *tx)
                        .await?;
                    wrote.notify_one();
                    go.notified().await;
                    tx.commit().await?;
                    Ok::<_, Error>(())
                }
            })
            .build()
            .unwrap()
            .start()
    };
    publish(&f, 5, Duration::ZERO).await;
    wrote.notified().await;
    let mut conn = f.pool.acquire().await.unwrap();
    let cancelled = f
        .outbox
        .cancel(&mut conn, "tx.jobs", "job-5")
        .await
        .unwrap();
    assert!(
        matches!(cancelled, Cancelled::Running { .. }),
        "{cancelled:?}"
    );
    go.notify_one();
    eventually(10, "the row is gone", || async {
        f.rows("tx.jobs").await.is_empty()
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    worker.shutdown().await;
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(effects(&f.pool, &table).await, vec![(5, 1)]);
    drop_table(&f, &table).await;
    f.cleanup().await;
}

/// The lock order the docs warn about: an application transaction that locks the timer
/// first (an extend) and then a domain row, against a handler that locked the domain row
/// and then commits (locking the timer). Postgres breaks the deadlock by aborting the
/// handler's transaction (the application's waits with a long `deadlock_timeout`, so the
/// handler's check fires first): the run fails and rolls back, the application commits,
/// its rearm replaces the retry, and the next run writes once. Nothing is written twice.
#[tokio::test]
async fn a_deadlock_with_an_application_transaction_rolls_back_the_run() {
    let f = Fixture::new().await;
    let counter = format!("{}_counter", f.outbox.table().trim_matches('"'));
    let counter = format!("\"{counter}\"");
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE TABLE {counter} (id int PRIMARY KEY, n int NOT NULL); \
         INSERT INTO {counter} VALUES (1, 0)"
    )))
    .execute(&f.pool)
    .await
    .unwrap();
    let (locked, go) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let runs = Arc::new(AtomicUsize::new(0));
    let worker = {
        let bump = format!("UPDATE {counter} SET n = n + 1 WHERE id = 1");
        let (locked, go, runs) = (locked.clone(), go.clone(), runs.clone());
        fast(&f)
            .timer_with::<Job>(
                move |_: Job, ctx: Context| {
                    let (bump, locked, go, runs) =
                        (bump.clone(), locked.clone(), go.clone(), runs.clone());
                    async move {
                        let run = runs.fetch_add(1, Ordering::SeqCst) + 1;
                        let mut tx = ctx.begin().await?;
                        tx.execute(AssertSqlSafe(bump)).await?;
                        if run == 1 {
                            locked.notify_one();
                            go.notified().await;
                        }
                        tx.commit().await?;
                        Ok::<_, Error>(())
                    }
                },
                HandlerOptions::new().retry(RetryStrategy::constant(Duration::from_millis(50))),
            )
            .build()
            .unwrap()
            .start()
    };
    publish(&f, 1, Duration::ZERO).await;
    locked.notified().await;
    // The application: timer first (an extend locks the running row), then the domain row.
    let mut app = f.pool.begin().await.unwrap();
    app.execute("SET LOCAL deadlock_timeout = '10s'")
        .await
        .unwrap();
    let extended = outbox::message::extend_timer(
        &mut f.outbox.on(&mut app),
        "job-1",
        &Job { n: 1 },
        Duration::from_millis(200),
    )
    .await
    .unwrap();
    assert!(
        matches!(extended, Published::RearmQueued { .. }),
        "{extended:?}"
    );
    go.notify_one();
    // The handler's commit now waits for the timer row; this waits for the domain row.
    app.execute(AssertSqlSafe(format!(
        "UPDATE {counter} SET n = n + 1 WHERE id = 1"
    )))
    .await
    .unwrap();
    app.commit().await.unwrap();
    eventually(20, "the rearmed run committed", || async {
        runs.load(Ordering::SeqCst) == 2 && f.rows("tx.jobs").await.is_empty()
    })
    .await;
    worker.shutdown().await;
    let n: i32 = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT n FROM {counter} WHERE id = 1"
    )))
    .fetch_one(&f.pool)
    .await
    .unwrap();
    assert_eq!(
        n, 2,
        "the application's write and one handler run's, nothing twice"
    );
    drop_table(&f, &counter).await;
    f.cleanup().await;
}

/// SPEC §7.9 sizing: every handler slot holding its own transaction at once, on a pool of
/// exactly `concurrency + 2`, while leases are renewed and claims go on: every job runs
/// once and commits once (no pool starvation, no lease lost).
#[tokio::test]
async fn a_pool_of_concurrency_plus_two_serves_transactional_handlers() {
    let f = Fixture::new().await;
    let table = effects_table(&f).await;
    let pool = outbox_tests::pool_with(3 + 2).await;
    let store = outbox::PgStore::new(pool, f.outbox.clone());
    let runs = Arc::new(AtomicUsize::new(0));
    let worker = {
        let (sql, runs) = (insert(&table), runs.clone());
        Worker::builder(store)
            .idle_poll(Duration::from_millis(100))
            .concurrency(3)
            .lease_ttl(Duration::from_millis(600))
            .timer::<Job>(move |job: Job, ctx: Context| {
                let (sql, runs) = (sql.clone(), runs.clone());
                async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    let mut tx = ctx.begin().await?;
                    sqlx::query(AssertSqlSafe(sql))
                        .bind(job.n)
                        .bind(ctx.delivery() as i32)
                        .execute(&mut *tx)
                        .await?;
                    // Longer than a renewal period (lease_ttl / 3).
                    tokio::time::sleep(Duration::from_millis(350)).await;
                    tx.commit().await?;
                    Ok::<_, Error>(())
                }
            })
            .build()
            .unwrap()
            .start()
    };
    for n in 0..9 {
        publish(&f, n, Duration::ZERO).await;
    }
    eventually(30, "every job committed", || async {
        f.rows("tx.jobs").await.is_empty()
    })
    .await;
    assert!(worker.shutdown().await.graceful);
    assert_eq!(runs.load(Ordering::SeqCst), 9, "each job ran once");
    assert_eq!(
        effects(&f.pool, &table).await,
        (0..9).map(|n| (n, 1)).collect::<Vec<_>>()
    );
    drop_table(&f, &table).await;
    f.cleanup().await;
}

/// Found by a trial: a session whose default isolation is REPEATABLE READ made every commit
/// that followed a lease renewal fail with a serialization error. The handler's
/// transaction is READ COMMITTED whatever the session's default.
#[tokio::test]
async fn a_renewal_during_the_transaction_does_not_fail_the_commit_under_a_stricter_default() {
    let f = Fixture::new().await;
    let table = effects_table(&f).await;
    let options: sqlx::postgres::PgConnectOptions = outbox_tests::database_url().parse().unwrap();
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .connect_with(options.options([("default_transaction_isolation", "repeatable read")]))
        .await
        .unwrap();
    let store = outbox::PgStore::new(pool, f.outbox.clone());
    let levels = Arc::new(std::sync::Mutex::new(Vec::new()));
    let worker = {
        let (sql, levels) = (insert(&table), levels.clone());
        Worker::builder(store)
            .idle_poll(Duration::from_millis(100))
            .lease_ttl(Duration::from_millis(300))
            .timer_with::<Job>(
                move |job: Job, ctx: Context| {
                    let (sql, levels) = (sql.clone(), levels.clone());
                    async move {
                        let mut tx = ctx.begin().await?;
                        let level: String = sqlx::query_scalar("SHOW transaction_isolation")
                            .fetch_one(&mut *tx)
                            .await?;
                        levels.lock().unwrap().push(level);
                        sqlx::query(AssertSqlSafe(sql))
                            .bind(job.n)
                            .bind(ctx.attempt() as i32)
                            .execute(&mut *tx)
                            .await?;
                        // Past two renewal periods (lease_ttl / 3).
                        tokio::time::sleep(Duration::from_millis(250)).await;
                        tx.commit().await?;
                        Ok::<_, Error>(())
                    }
                },
                HandlerOptions::new().retry(RetryStrategy::none()),
            )
            .build()
            .unwrap()
            .start()
    };
    publish(&f, 1, Duration::ZERO).await;
    eventually(10, "the job ran", || async {
        f.rows("tx.jobs").await.is_empty()
    })
    .await;
    worker.shutdown().await;
    assert_eq!(*levels.lock().unwrap(), vec!["read committed".to_owned()]);
    assert_eq!(
        effects(&f.pool, &table).await,
        vec![(1, 1)],
        "committed on the first run"
    );
    assert!(f
        .store
        .dead_letters(&DeadLetterFilter::new().queue("tx.jobs"), None, 10)
        .await
        .unwrap()
        .is_empty());
    drop_table(&f, &table).await;
    f.cleanup().await;
}

/// Found by a trial: a handler stopped by its timeout while its COMMIT was in flight was
/// reported as a failed run (and its retry as a lost lease), though the commit landed.
/// The commit now finishes on its own and the run reports it: `Decision::Completed`.
#[tokio::test]
async fn a_timeout_during_the_commit_reports_what_the_commit_did() {
    let f = Fixture::new().await;
    let table = effects_table(&f).await;
    // A deferred trigger makes the COMMIT itself slow.
    let name = table.trim_matches('"');
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE FUNCTION \"{name}_slow\"() RETURNS trigger LANGUAGE plpgsql AS \
           $$BEGIN PERFORM pg_sleep(0.6); RETURN NULL; END$$; \
         CREATE CONSTRAINT TRIGGER \"{name}_slow\" AFTER INSERT ON {table} \
           DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION \"{name}_slow\"()"
    )))
    .execute(&f.pool)
    .await
    .unwrap();
    let worker = {
        let sql = insert(&table);
        Worker::builder(f.store.clone())
            .timer_with::<Job>(
                move |job: Job, ctx: Context| {
                    let sql = sql.clone();
                    async move {
                        let mut tx = ctx.begin().await?;
                        sqlx::query(AssertSqlSafe(sql))
                            .bind(job.n)
                            .bind(1)
                            .execute(&mut *tx)
                            .await?;
                        tx.commit().await?;
                        Ok::<_, Error>(())
                    }
                },
                HandlerOptions::new().timeout(Duration::from_millis(200)),
            )
            .build()
            .unwrap()
    };
    publish(&f, 9, Duration::ZERO).await;
    let ran = worker.run_due().await.unwrap();
    assert_eq!(ran.len(), 1);
    assert_eq!(
        ran[0].decision,
        outbox::worker::Decision::Completed {
            completion: Completion::Deleted
        }
    );
    assert_eq!(ran[0].completion, Completion::Deleted);
    assert_eq!(effects(&f.pool, &table).await, vec![(9, 1)]);
    assert!(f.rows("tx.jobs").await.is_empty());
    sqlx::raw_sql(AssertSqlSafe(format!(
        "DROP TABLE {table}; DROP FUNCTION \"{name}_slow\"()"
    )))
    .execute(&f.pool)
    .await
    .unwrap();
    f.cleanup().await;
}

/// Found by a trial: a transaction moved out of the handler (into a spawned task) and
/// still open when the handler returned was reported as rolled back, and could then commit
/// after the worker had scheduled the retry. The run fails, and the escaped transaction
/// can no longer commit: its writes never land.
#[tokio::test]
async fn a_transaction_still_open_when_the_handler_returns_can_no_longer_commit() {
    let f = Fixture::new().await;
    let table = effects_table(&f).await;
    let late = Arc::new(std::sync::Mutex::new(None));
    let worker = {
        let (sql, late) = (insert(&table), late.clone());
        Worker::builder(f.store.clone())
            .timer_with::<Job>(
                move |job: Job, ctx: Context| {
                    let (sql, late) = (sql.clone(), late.clone());
                    async move {
                        let mut tx = ctx.begin().await?;
                        sqlx::query(AssertSqlSafe(sql))
                            .bind(job.n)
                            .bind(1)
                            .execute(&mut *tx)
                            .await?;
                        let handle = tokio::spawn(async move {
                            tokio::time::sleep(Duration::from_millis(100)).await;
                            tx.commit().await
                        });
                        *late.lock().unwrap() = Some(handle);
                        Ok::<_, Error>(())
                    }
                },
                HandlerOptions::new().retry(RetryStrategy::none()),
            )
            .build()
            .unwrap()
    };
    publish(&f, 4, Duration::ZERO).await;
    let ran = worker.run_due().await.unwrap();
    assert_eq!(ran.len(), 1);
    match &ran[0].decision {
        outbox::worker::Decision::Fail { error: Some(e), .. } => {
            assert!(e.contains("still open elsewhere"), "{e}");
        }
        other => panic!("{other:?}"),
    }
    let handle = late.lock().unwrap().take().unwrap();
    let committed = handle.await.unwrap();
    assert!(
        matches!(committed, Err(Error::TransactionUnavailable { .. })),
        "{committed:?}"
    );
    assert!(
        effects(&f.pool, &table).await.is_empty(),
        "nothing committed"
    );
    drop_table(&f, &table).await;
    f.cleanup().await;
}

/// Found by a trial: at shutdown, a handler that had committed and kept working was counted
/// as a lease not given back, and one whose commit had failed was not given back at all
/// (its row waited for lease expiry). Now the committed row is no longer held, and the
/// failed one is stopped and given back like any running handler.
#[tokio::test]
async fn shutdown_after_a_commit_or_a_failed_commit_accounts_for_each_row() {
    let f = Fixture::new().await;
    let table = effects_table(&f).await;
    let started = Arc::new(AtomicUsize::new(0));
    let worker = {
        let (sql, started) = (insert(&table), started.clone());
        fast(&f)
            .concurrency(2)
            .graceful_timeout(Duration::from_millis(300))
            .timer::<Job>(move |job: Job, ctx: Context| {
                let (sql, started) = (sql.clone(), started.clone());
                async move {
                    let mut tx = ctx.begin().await?;
                    if job.n == 1 {
                        sqlx::query(AssertSqlSafe(sql))
                            .bind(job.n)
                            .bind(1)
                            .execute(&mut *tx)
                            .await?;
                        tx.commit().await?;
                    } else {
                        // A failed statement: the commit fails (rolled back).
                        let _ = tx.execute("SELECT 1 / 0").await;
                        assert!(tx.commit().await.is_err());
                    }
                    started.fetch_add(1, Ordering::SeqCst);
                    // Keeps working past graceful_timeout.
                    tokio::time::sleep(Duration::from_secs(5)).await;
                    Ok::<_, Error>(())
                }
            })
            .build()
            .unwrap()
            .start()
    };
    publish(&f, 1, Duration::ZERO).await;
    publish(&f, 2, Duration::ZERO).await;
    eventually(10, "both handlers passed their commit", || async {
        started.load(Ordering::SeqCst) == 2
    })
    .await;
    let report = worker.shutdown().await;
    assert_eq!(report.abandoned, 1, "{report:?}");
    assert_eq!(report.retried, 1, "{report:?}");
    assert_eq!(report.unreleased, 0, "{report:?}");
    let rows = f.rows("tx.jobs").await;
    assert_eq!(rows.len(), 1, "job 1 committed, job 2 given back");
    assert_eq!(rows[0].acquired_token, None, "given back, not left leased");
    assert_eq!(effects(&f.pool, &table).await, vec![(1, 1)]);
    drop_table(&f, &table).await;
    f.cleanup().await;
}

/// The handler's own statement in its transaction, converted into `outbox::Error` by `?`,
/// is `Error::Database` whatever its SQLSTATE: a typo'd table is not `NotMigrated` (found by
/// a fresh-user review; only the library's own statements are read for what a missing
/// table means).
#[tokio::test]
async fn a_handlers_own_sql_error_is_a_database_error() {
    let f = Fixture::new().await;
    let seen = Arc::new(std::sync::Mutex::new(None::<Error>));
    let worker = {
        let seen = seen.clone();
        fast(&f)
            .timer::<Job>(move |_job: Job, ctx: Context| {
                let seen = seen.clone();
                async move {
                    let mut tx = ctx.begin().await?;
                    let own = async {
                        sqlx::query("SELECT * FROM no_such_table")
                            .execute(&mut *tx)
                            .await?;
                        Ok::<_, Error>(())
                    }
                    .await;
                    *seen.lock().unwrap() = own.err();
                    tx.rollback().await?;
                    Ok::<_, Error>(())
                }
            })
            .build()
            .unwrap()
            .start()
    };
    publish(&f, 1, Duration::ZERO).await;
    eventually(20, "the handler ran", || async {
        seen.lock().unwrap().is_some()
    })
    .await;
    assert!(worker.shutdown().await.graceful);
    let e = seen.lock().unwrap().take().unwrap();
    assert!(matches!(e, Error::Database(_)), "{e:?}");
    assert_eq!(e.sqlstate().as_deref(), Some("42P01"));
    f.cleanup().await;
}

/// The handler transaction's `COMMIT` runs the application's deferred constraints and
/// triggers: an error there is theirs, `Error::Database`, not one of the library's schema
/// (found by a fresh-user review: a deferred trigger reading a missing table came back as
/// `NotMigrated`).
#[tokio::test]
async fn a_deferred_trigger_failing_at_commit_is_a_database_error() {
    let f = Fixture::new().await;
    let table = format!("{}_deferred", f.outbox.table().trim_matches('"'));
    let setup = format!(
        r#"CREATE TABLE "{table}" (id bigint);
        CREATE FUNCTION "{table}_check"() RETURNS trigger LANGUAGE plpgsql AS
          $$BEGIN PERFORM 1 FROM no_such_table_at_commit; RETURN NULL; END$$;
        CREATE CONSTRAINT TRIGGER "{table}_trg" AFTER INSERT ON "{table}"
          DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION "{table}_check"();"#
    );
    sqlx::raw_sql(AssertSqlSafe(setup))
        .execute(&f.pool)
        .await
        .unwrap();
    let seen = Arc::new(std::sync::Mutex::new(None::<Error>));
    let worker = {
        let (seen, table) = (seen.clone(), table.clone());
        fast(&f)
            .timer::<Job>(move |_job: Job, ctx: Context| {
                let (seen, table) = (seen.clone(), table.clone());
                async move {
                    let mut tx = ctx.begin().await?;
                    sqlx::query(AssertSqlSafe(format!(
                        r#"INSERT INTO "{table}" VALUES (1)"#
                    )))
                    .execute(&mut *tx)
                    .await?;
                    if let Err(e) = tx.commit().await {
                        let mut seen = seen.lock().unwrap();
                        if seen.is_none() {
                            *seen = Some(e);
                        }
                    }
                    Ok::<_, Error>(())
                }
            })
            .build()
            .unwrap()
            .start()
    };
    publish(&f, 1, Duration::ZERO).await;
    eventually(20, "the handler's commit failed", || async {
        seen.lock().unwrap().is_some()
    })
    .await;
    worker.shutdown().await;
    let e = seen.lock().unwrap().take().unwrap();
    assert!(matches!(e, Error::Database(_)), "{e:?}");
    assert_eq!(e.sqlstate().as_deref(), Some("42P01"));
    sqlx::raw_sql(AssertSqlSafe(format!(
        r#"DROP TABLE "{table}"; DROP FUNCTION "{table}_check"();"#
    )))
    .execute(&f.pool)
    .await
    .unwrap();
    f.cleanup().await;
}
