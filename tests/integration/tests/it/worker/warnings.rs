//! A `RunningWorker` dropped without `shutdown()` (a `let _ = worker.start()`, or a handle
//! that went out of scope) stops the worker at once and silently unless the runtime says
//! so: it logs one warning (found by a trial run), and a worker shut down properly
//! logs none. No database: the in-memory store.

use std::io::Write;
use std::sync::{Arc, Mutex};

use outbox::testing::MemoryStore;
use outbox::{Context, Worker};

#[outbox::timer(queue = "drop.test", max_deliveries = 3)]
#[derive(serde::Serialize, serde::Deserialize)]
struct Tick {
    n: i64,
}

/// Everything the subscriber writes, shared with the test.
#[derive(Clone, Default)]
struct Logs(Arc<Mutex<Vec<u8>>>);

impl Logs {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

impl Write for Logs {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Logs {
    type Writer = Logs;
    fn make_writer(&'a self) -> Logs {
        self.clone()
    }
}

fn worker(store: &MemoryStore) -> Worker<MemoryStore> {
    Worker::builder(store.clone())
        .timer::<Tick>(|_t: Tick, _ctx: Context| async {})
        .build()
        .unwrap()
}

/// A runtime on this thread whose logs go to the returned `Logs` while the guard lives.
fn capture() -> (
    Logs,
    tracing::subscriber::DefaultGuard,
    tokio::runtime::Runtime,
) {
    crate::own_process();
    let logs = Logs::default();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(logs.clone())
        .with_ansi(false)
        .finish();
    let guard = tracing::subscriber::set_default(subscriber);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    (logs, guard, rt)
}

const WARNING: &str = "a RunningWorker was dropped without shutdown()";

#[test]
fn a_dropped_worker_warns_once_and_a_shut_down_one_does_not() {
    let (logs, _guard, rt) = capture();
    let store = MemoryStore::new();

    let report = rt.block_on(async { worker(&store).start().shutdown().await });
    assert!(report.graceful, "{report:?}");
    assert!(!logs.text().contains(WARNING), "{}", logs.text());

    rt.block_on(async {
        let running = worker(&store).start();
        tokio::task::yield_now().await;
        drop(running);
    });
    let text = logs.text();
    assert_eq!(text.matches(WARNING).count(), 1, "{text}");
    assert!(text.contains("WARN"), "{text}");
}

/// A worker started before `migrate()` says so once, at start, as an error (found by a
/// trial run: it only logged a backing-off warning every few seconds, and an autovacuum
/// warning about a table that did not exist). Postgres: `DATABASE_URL`.
#[test]
fn a_worker_on_a_table_that_does_not_exist_says_to_migrate() {
    use outbox::store::Store;
    use outbox::{Error, Outbox, PgStore};

    let (logs, _guard, rt) = capture();
    rt.block_on(async {
        let pool = outbox_tests::pool().await;
        let outbox = Outbox::builder()
            .table(outbox_tests::unique_table("never_migrated"))
            .build()
            .unwrap();
        let store = PgStore::new(pool, outbox);
        let err = store.autovacuum_off().await.unwrap_err();
        assert!(matches!(err, Error::NotMigrated { .. }), "{err:?}");
        // The table as Postgres names it, quoted once (a fresh-user review found it twice).
        let Error::NotMigrated { detail } = &err else {
            unreachable!()
        };
        assert_eq!(
            detail,
            &format!("relation {} does not exist", store.outbox().table())
        );
        assert!(!detail.contains("\"\""), "{detail}");

        let running = Worker::builder(store)
            .timer::<Tick>(|_t: Tick, _ctx: Context| async {})
            .build()
            .unwrap()
            .start();
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
        running.shutdown().await;
    });
    let text = logs.text();
    let line = "the worker started, but the queue table does not exist";
    assert_eq!(text.matches(line).count(), 1, "{text}");
    assert!(text.contains("ERROR"), "{text}");
    assert!(!text.contains("autovacuum is off"), "{text}");
}

/// A worker started on a table that predates an upgrade (no paused-queues table, no rearm
/// columns: `migrate` has not run with this version) says to run `migrate`, as an error,
/// not as the back-off warning of a failing database (found by the fresh-user trial of
/// 2026-12-05, which saw "claim failed; backing off" every ten seconds and nothing else).
/// Postgres: `DATABASE_URL`.
#[test]
fn a_worker_on_a_table_that_predates_the_upgrade_says_to_migrate() {
    use outbox::{Outbox, PgStore};

    let (logs, _guard, rt) = capture();
    let outbox = Outbox::builder()
        .table(outbox_tests::unique_table("not_upgraded"))
        .build()
        .unwrap();
    let pool = rt.block_on(async {
        let pool = outbox_tests::pool().await;
        outbox.migrate_base_only(&pool).await.unwrap();
        let running = Worker::builder(PgStore::new(pool.clone(), outbox.clone()))
            .timer::<Tick>(|_t: Tick, _ctx: Context| async {})
            .build()
            .unwrap()
            .start();
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
        running.shutdown().await;
        pool
    });
    let text = logs.text();
    let line =
        "claim failed: the schema needs `migrate` (see the error); retrying until it has run";
    assert_eq!(text.matches(line).count(), 1, "{text}");
    assert!(text.contains("ERROR"), "{text}");
    assert!(text.contains(outbox::schema::UPGRADE_GUIDE), "{text}");
    assert!(!text.contains("backing off"), "{text}");
    rt.block_on(async {
        let drop = format!(
            "DROP TABLE IF EXISTS {}, {}, {}",
            outbox.table(),
            outbox.dead_letter_table(),
            outbox.migrations_table()
        );
        sqlx::raw_sql(sqlx::AssertSqlSafe(drop))
            .execute(&pool)
            .await
            .unwrap();
    });
}

/// A handler that begins a transaction and returns without committing it is a mistake in
/// the handler: the worker says so at WARN, not only in the INFO line of the retry (found
/// by the fresh-user trial of 2026-12-05, which saw nothing with a `warn` filter until
/// `max_deliveries`). Postgres: `DATABASE_URL`.
#[test]
fn a_handler_that_forgets_to_commit_is_a_warning() {
    use outbox::{HandlerOptions, Message, RetryStrategy};

    let (logs, _guard, rt) = capture();
    rt.block_on(async {
        let f = outbox_tests::Fixture::new().await;
        let mut conn = f.pool.acquire().await.unwrap();
        let payload = serde_json::to_vec(&Tick { n: 1 }).unwrap();
        f.outbox
            .publish(&mut conn, Message::new("drop.test", &payload))
            .await
            .unwrap();
        drop(conn);
        let running = Worker::builder(f.store.clone())
            .timer_with::<Tick>(
                |_t: Tick, ctx: Context| async move {
                    let _tx = ctx.begin().await?;
                    // No commit: `_tx` is dropped here.
                    Ok::<_, outbox::Error>(())
                },
                HandlerOptions::new().retry(RetryStrategy::none()),
            )
            .build()
            .unwrap()
            .start();
        outbox_tests::eventually(10, "the run failed for good", || async {
            f.rows("drop.test").await.is_empty()
        })
        .await;
        running.shutdown().await;
        f.cleanup().await;
    });
    let text = logs.text();
    let line = text
        .lines()
        .find(|l| l.contains("the handler began a transaction and returned without committing"))
        .unwrap_or_else(|| panic!("no warning in:\n{text}"));
    assert!(line.contains("WARN"), "{line}");
}
