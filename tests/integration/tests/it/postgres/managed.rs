//! A managed server's session limits, set on the worker's role (`ALTER ROLE … SET`), as a
//! managed service's parameter group would: `statement_timeout`,
//! `idle_in_transaction_session_timeout` and `idle_session_timeout`, all well under a second.
//! The role has only the grants `docs/guide/deployment.md` lists (its SQL block, through
//! `grants.rs`'s database of one test's own). A worker runs rows in three waves with idle
//! stretches between them longer than `idle_session_timeout`, so the server ends its idle
//! pool connections; some handlers' own transactions are cancelled (SQLSTATE 57014) or
//! ended (25P03) on their first run. Every row still completes, the worker stays up, and its
//! LISTEN session is the same one at the end (it turns `idle_session_timeout` off for
//! itself), so a wave wakes it although its poll is 30 s.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use outbox::{Context, HandlerOptions, PgStore, RetryStrategy, Worker};
use outbox_tests::eventually;
use sqlx::{AssertSqlSafe, Executor, PgPool};

use super::grants::AppDatabase;

#[outbox::timer(queue = "managed.job", max_deliveries = 10)]
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct Job {
    n: i64,
    /// `plain`, `tx` (a short transaction of its own), `slow` (a statement over
    /// `statement_timeout` on the first run), `idle` (idle in its transaction past
    /// `idle_in_transaction_session_timeout` on the first run).
    kind: String,
}

const STATEMENT_TIMEOUT_MS: u64 = 250;
const IDLE_IN_TX_MS: u64 = 250;
const IDLE_SESSION_MS: u64 = 400;
const IDLE_POLL: Duration = Duration::from_secs(30);

async fn handle(j: Job, ctx: Context) -> Result<(), outbox::Error> {
    let first = ctx.attempt() == 1;
    match j.kind.as_str() {
        "plain" => Ok(()),
        "tx" | "slow" | "idle" => {
            let mut tx = ctx.begin().await?;
            sqlx::query("SELECT 1").execute(&mut *tx).await?;
            if first && j.kind == "slow" {
                sqlx::query("SELECT pg_sleep(2)").execute(&mut *tx).await?;
            }
            if first && j.kind == "idle" {
                tokio::time::sleep(Duration::from_millis(3 * IDLE_IN_TX_MS)).await;
                sqlx::query("SELECT 1").execute(&mut *tx).await?;
            }
            tx.commit().await?;
            Ok(())
        }
        other => panic!("unknown kind {other}"),
    }
}

/// The pid of the session LISTENing for the worker, if there is one.
async fn listener_pid(owner: &PgPool, db: &str) -> Option<i32> {
    sqlx::query_scalar(
        "SELECT pid FROM pg_stat_activity WHERE datname = $1 AND query ILIKE 'LISTEN %'",
    )
    .bind(db)
    .fetch_optional(owner)
    .await
    .unwrap()
}

#[tokio::test]
async fn a_worker_runs_through_the_session_limits_of_its_role() {
    let db = AppDatabase::create().await;
    for (setting, ms) in [
        ("statement_timeout", STATEMENT_TIMEOUT_MS),
        ("idle_in_transaction_session_timeout", IDLE_IN_TX_MS),
        ("idle_session_timeout", IDLE_SESSION_MS),
    ] {
        db.owner
            .execute(AssertSqlSafe(format!(
                "ALTER ROLE {} SET {setting} = '{ms}ms'",
                db.role
            )))
            .await
            .unwrap();
    }
    let app = db.app_pool(6).await;
    let shown: String = sqlx::query_scalar("SHOW idle_session_timeout")
        .fetch_one(&app)
        .await
        .unwrap();
    assert_eq!(
        shown,
        format!("{IDLE_SESSION_MS}ms"),
        "the role's setting applies"
    );

    let runs: Arc<Mutex<HashMap<i64, u32>>> = Arc::default();
    let worker = {
        let runs = runs.clone();
        Worker::builder(PgStore::new(app.clone(), db.outbox.clone()))
            .idle_poll(IDLE_POLL)
            .concurrency(4)
            .timer_with::<Job>(
                move |j: Job, ctx: Context| {
                    let runs = runs.clone();
                    async move {
                        let n = j.n;
                        let done = handle(j, ctx).await;
                        if done.is_ok() {
                            *runs.lock().unwrap().entry(n).or_default() += 1;
                        }
                        done
                    }
                },
                HandlerOptions::default().retry(RetryStrategy::constant(Duration::from_millis(50))),
            )
            .build()
            .unwrap()
            .start()
    };
    eventually(10, "the worker LISTENs", || async {
        listener_pid(&db.owner, &db.name).await.is_some()
    })
    .await;
    let listener = listener_pid(&db.owner, &db.name).await;

    let kinds = ["plain", "tx", "slow", "idle", "plain", "tx"];
    let mut n = 0i64;
    for wave in 0..3 {
        // Longer than idle_session_timeout: the server ends the worker's idle connections.
        tokio::time::sleep(Duration::from_millis(3 * IDLE_SESSION_MS)).await;
        let mut conn = db.owner.acquire().await.unwrap();
        let started = Instant::now();
        let first = n;
        for kind in kinds {
            publish_job(
                db.outbox.on(&mut conn),
                &format!("j{n}"),
                &Job {
                    n,
                    kind: kind.to_owned(),
                },
                Duration::ZERO,
            )
            .await
            .unwrap();
            n += 1;
        }
        drop(conn);
        let last = n;
        // A third of the idle poll: the wave's notification woke the worker.
        eventually(IDLE_POLL.as_secs() / 3, "the wave completes", || {
            let done = (first..last).all(|i| runs.lock().unwrap().contains_key(&i));
            async move { done }
        })
        .await;
        eprintln!("wave {wave} done in {:?}", started.elapsed());
    }

    assert_eq!(
        listener_pid(&db.owner, &db.name).await,
        listener,
        "the LISTEN session lived through the idle stretches"
    );
    let report = worker.shutdown().await;
    assert!(report.graceful, "{report:?}");
    let runs = runs.lock().unwrap().clone();
    assert_eq!(runs.len(), n as usize, "every row completed: {runs:?}");
    assert!(runs.values().all(|&c| c == 1), "each once: {runs:?}");
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox")
        .fetch_one(&db.owner)
        .await
        .unwrap();
    assert_eq!(left, 0);
    // The server did end sessions (idle ones, and the idle transactions), and not the
    // LISTEN session.
    eventually(10, "the server counts sessions it ended", || async {
        let fatal: i64 =
            sqlx::query_scalar("SELECT sessions_fatal FROM pg_stat_database WHERE datname = $1")
                .bind(&db.name)
                .fetch_one(&db.owner)
                .await
                .unwrap();
        fatal >= 3
    })
    .await;
    app.close().await;
    db.drop_all().await;
}
