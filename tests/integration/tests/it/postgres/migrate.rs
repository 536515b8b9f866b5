//! Online migrations (SPEC §1.3, v2): `migrate()` never stops the application. An
//! up-to-date schema is recognised from the catalog without table locks; a step that must
//! wait for a table gives way after its `lock_timeout` and tries again until its deadline;
//! a new index is built CONCURRENTLY and an INVALID leftover is rebuilt; applied steps are
//! recorded.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use sqlx::{AssertSqlSafe, Connection, Executor, PgConnection, PgPool};
use tokio::time::Instant;

use outbox::{
    schema::{MigrateOptions, SchemaProblem},
    store::{ClaimRequest, Failure, FailureReason, Store},
    Error, Outbox, PgStore,
};
use outbox_tests::{database_url, pool, unique_table};

const QUEUE: &str = "q";

fn outbox(prefix: &str) -> Outbox {
    Outbox::builder()
        .table(unique_table(prefix))
        .dead_letter(true)
        .build()
        .unwrap()
}

async fn drop_tables(pool: &PgPool, outbox: &Outbox) {
    sqlx::raw_sql(AssertSqlSafe(format!(
        "DROP TABLE IF EXISTS {}, {}, {}, {}",
        outbox.table(),
        outbox.dead_letter_table(),
        outbox.migrations_table(),
        outbox.paused_table()
    )))
    .execute(pool)
    .await
    .unwrap();
}

/// Another session, outside the test's pool: it stays in its transaction while the test
/// runs `migrate()`.
async fn session() -> PgConnection {
    PgConnection::connect(&database_url()).await.unwrap()
}

async fn pid(conn: &mut PgConnection) -> i32 {
    sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(conn)
        .await
        .unwrap()
}

fn queues() -> Vec<String> {
    vec![QUEUE.to_owned()]
}

/// Publishes (and, when `claim_and_fail`, claims and dead-letters) in a loop until `stop`,
/// on connections of the pool; returns how many rounds ran and the slowest round.
async fn traffic(
    pool: PgPool,
    outbox: Outbox,
    claim_and_fail: bool,
    stop: Arc<AtomicBool>,
) -> (u32, Duration) {
    let store = PgStore::new(pool.clone(), outbox.clone());
    let (mut rounds, mut slowest) = (0, Duration::ZERO);
    while !stop.load(Ordering::SeqCst) {
        let started = Instant::now();
        let mut conn = pool.acquire().await.unwrap();
        outbox
            .publish(&mut conn, outbox::Message::new(QUEUE, b"x"))
            .await
            .unwrap();
        drop(conn);
        if claim_and_fail {
            let qs = queues();
            let got = store
                .claim(ClaimRequest::new(&qs, 1, Duration::from_secs(60)))
                .await
                .unwrap();
            assert_eq!(got.len(), 1);
            let failure = Failure {
                reason: FailureReason::Rejected,
                last_error: Some("moved to the dead-letter table"),
            };
            store.fail(got[0].lease, failure).await.unwrap();
        }
        slowest = slowest.max(started.elapsed());
        rounds += 1;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    (rounds, slowest)
}

/// SPEC §1.3 (v2): on an up-to-date schema `migrate()` reads the catalog only. Another
/// session holds SHARE UPDATE EXCLUSIVE on both tables (it conflicts with every ALTER TABLE,
/// VALIDATE CONSTRAINT and CREATE INDEX, but not with reads and writes) and stays idle in
/// its transaction: with a deadline of zero, any step that tried to lock a table would fail
/// at once, so success proves no lock was asked for.
#[tokio::test]
async fn up_to_date_migrate_reads_the_catalog_only() {
    let pool = pool().await;
    let outbox = outbox("mig_uptodate");
    outbox.migrate(&pool).await.unwrap();

    let mut holder = session().await;
    holder.execute("BEGIN").await.unwrap();
    holder
        .execute(AssertSqlSafe(format!(
            "SELECT count(*) FROM {}; LOCK TABLE {}, {} IN SHARE UPDATE EXCLUSIVE MODE",
            outbox.table(),
            outbox.table(),
            outbox.dead_letter_table()
        )))
        .await
        .unwrap();

    let strict = MigrateOptions::default()
        .lock_timeout(Duration::from_millis(100))
        .deadline(Duration::ZERO);
    outbox.migrate_with(&pool, strict).await.unwrap();
    outbox.migrate(&pool).await.unwrap();

    // Publishes, claims and dead-letter writes go on beside the idle holder.
    let stop = Arc::new(AtomicBool::new(false));
    let flow = tokio::spawn(traffic(pool.clone(), outbox.clone(), true, stop.clone()));
    tokio::time::sleep(Duration::from_millis(200)).await;
    stop.store(true, Ordering::SeqCst);
    let (rounds, _) = flow.await.unwrap();
    assert!(rounds >= 1);

    holder.execute("ROLLBACK").await.unwrap();
    drop_tables(&pool, &outbox).await;
}

/// The reported case (SPEC §1.3, v2): a base-shape table, a second session that read the
/// queue table in a transaction and stays idle, then `migrate()` to apply the rearm
/// upgrade. Each try waits at most its lock_timeout and gives way, so a publish from a third
/// session is delayed by at most that (bound: 3× the timeout); past the deadline a typed
/// error names the step and the holder. Once the holder ends, `migrate()` goes through.
#[tokio::test]
async fn a_blocked_step_gives_way_and_names_the_holder() {
    let pool = pool().await;
    let outbox = outbox("mig_blocked");
    outbox.migrate_base_only(&pool).await.unwrap();

    let mut reader = session().await;
    let reader_pid = pid(&mut reader).await;
    reader.execute("BEGIN").await.unwrap();
    reader
        .execute(AssertSqlSafe(format!(
            "SELECT count(*) FROM {}",
            outbox.table()
        )))
        .await
        .unwrap();

    let lock_timeout = Duration::from_millis(300);
    let options = MigrateOptions::default()
        .lock_timeout(lock_timeout)
        .deadline(Duration::from_millis(1500));
    let stop = Arc::new(AtomicBool::new(false));
    let flow = tokio::spawn(traffic(pool.clone(), outbox.clone(), false, stop.clone()));
    let started = Instant::now();
    let err = outbox.migrate_with(&pool, options).await.unwrap_err();
    let waited = started.elapsed();
    stop.store(true, Ordering::SeqCst);
    let (rounds, slowest) = flow.await.unwrap();

    let Error::MigrationBlocked { step, holders, .. } = &err else {
        panic!("expected MigrationBlocked, got {err:?}");
    };
    assert_eq!(step, "outbox_rearm_columns");
    let holder = holders
        .iter()
        .find(|h| h.pid == reader_pid)
        .unwrap_or_else(|| panic!("the reader is named: {err}"));
    assert!(holder.transaction_start.is_some(), "{holder:?}");
    assert!(
        holder.modes.iter().any(|m| m == "AccessShareLock"),
        "{holder:?}"
    );
    assert_eq!(holder.state.as_deref(), Some("idle in transaction"));
    assert!(
        err.to_string().contains(&format!("pid {reader_pid}")),
        "{err}"
    );
    assert!(
        waited >= Duration::from_millis(1000) && waited < Duration::from_millis(1500) * 3,
        "kept trying until about the deadline: {waited:?}"
    );
    assert!(rounds >= 2, "publishes went on: {rounds}");
    assert!(
        slowest < lock_timeout * 3,
        "a publish waited {slowest:?} behind the migration (lock_timeout {lock_timeout:?})"
    );
    // Nothing of the blocked step was applied.
    let problems = match outbox.validate_schema(&pool).await {
        Err(Error::SchemaMismatch { problems }) => problems,
        other => panic!("{other:?}"),
    };
    assert!(problems.iter().any(|p| p.object.ends_with(".rearm_at")));

    reader.execute("COMMIT").await.unwrap();
    // The rest of the upgrade builds indexes CONCURRENTLY, which waits for every older
    // snapshot in the database, other tests' included: finish it with the default deadline,
    // not the short one this test blocks on.
    outbox.migrate(&pool).await.unwrap();
    outbox.validate_schema(&pool).await.unwrap();
    let published: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT count(*) FROM {}",
        outbox.table()
    )))
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(published, i64::from(rounds), "every publish kept its row");
    drop_tables(&pool, &outbox).await;
}

/// The dead-letter upgrade (`redriven_at`, `redriven_id`) waits for a session reading the
/// dead-letter table while claims and terminal failures (which insert into that table) go
/// on, each delayed by at most the lock timeout.
#[tokio::test]
async fn a_waiting_dead_letter_step_delays_claims_and_failures_by_at_most_its_timeout() {
    let pool = pool().await;
    let outbox = outbox("mig_dlq");
    outbox.migrate(&pool).await.unwrap();
    sqlx::raw_sql(AssertSqlSafe(format!(
        "ALTER TABLE {} DROP COLUMN redriven_at, DROP COLUMN redriven_id",
        outbox.dead_letter_table()
    )))
    .execute(&pool)
    .await
    .unwrap();
    let problems = match outbox.validate_schema(&pool).await {
        Err(Error::SchemaMismatch { problems }) => problems,
        other => panic!("{other:?}"),
    };
    assert_eq!(problems.len(), 2, "{problems:#?}");
    assert!(problems.iter().all(|p| p.needs_upgrade), "{problems:#?}");

    let mut reader = session().await;
    let reader_pid = pid(&mut reader).await;
    reader.execute("BEGIN").await.unwrap();
    reader
        .execute(AssertSqlSafe(format!(
            "SELECT count(*) FROM {}",
            outbox.dead_letter_table()
        )))
        .await
        .unwrap();

    let lock_timeout = Duration::from_millis(300);
    let options = MigrateOptions::default()
        .lock_timeout(lock_timeout)
        .deadline(Duration::from_millis(1200));
    let stop = Arc::new(AtomicBool::new(false));
    let flow = tokio::spawn(traffic(pool.clone(), outbox.clone(), true, stop.clone()));
    let err = outbox.migrate_with(&pool, options).await.unwrap_err();
    stop.store(true, Ordering::SeqCst);
    let (rounds, slowest) = flow.await.unwrap();
    match &err {
        Error::MigrationBlocked { step, holders, .. } => {
            assert_eq!(step, "outbox_dlq_redrive_columns");
            assert!(holders.iter().any(|h| h.pid == reader_pid), "{err}");
        }
        other => panic!("expected MigrationBlocked, got {other:?}"),
    }
    assert!(rounds >= 2, "claims and failures went on: {rounds}");
    assert!(
        slowest < lock_timeout * 3,
        "a publish, claim and fail round waited {slowest:?} (lock_timeout {lock_timeout:?})"
    );

    reader.execute("COMMIT").await.unwrap();
    outbox.migrate(&pool).await.unwrap();
    outbox.validate_schema(&pool).await.unwrap();
    let archived: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT count(*) FROM {} WHERE redriven_at IS NULL",
        outbox.dead_letter_table()
    )))
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(archived, i64::from(rounds), "every failure was archived");
    drop_tables(&pool, &outbox).await;
}

fn index_problem<'a>(problems: &'a [SchemaProblem], index: &str) -> &'a SchemaProblem {
    problems
        .iter()
        .find(|p| p.object.contains(index))
        .unwrap_or_else(|| panic!("{index} not reported: {problems:#?}"))
}

/// SPEC §1.2/§1.3 (v2): the `(failed_at)` index is built CONCURRENTLY on an existing table.
/// Such a build waits for every older snapshot in the database; a session in a REPEATABLE
/// READ transaction makes it time out, which leaves an INVALID index behind (Postgres keeps
/// it). `validate_schema` reports it as INVALID, and the next `migrate()` rebuilds it.
#[tokio::test]
async fn an_interrupted_concurrent_build_is_reported_and_rebuilt() {
    let pool = pool().await;
    let outbox = outbox("mig_cic");
    outbox.migrate(&pool).await.unwrap();
    let index = format!(
        "{}_failed_at_idx",
        outbox.dead_letter_table().trim_matches('"')
    );
    sqlx::raw_sql(AssertSqlSafe(format!("DROP INDEX \"{index}\"")))
        .execute(&pool)
        .await
        .unwrap();
    let problems = match outbox.validate_schema(&pool).await {
        Err(Error::SchemaMismatch { problems }) => problems,
        other => panic!("{other:?}"),
    };
    let p = index_problem(&problems, &index);
    assert_eq!(p.message, "index is missing");
    assert!(p.needs_upgrade);

    let mut old = session().await;
    let old_pid = pid(&mut old).await;
    old.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        .await
        .unwrap();
    old.execute("SELECT 1").await.unwrap();
    let options = MigrateOptions::default()
        .lock_timeout(Duration::from_millis(200))
        .deadline(Duration::ZERO);
    let err = outbox.migrate_with(&pool, options).await.unwrap_err();
    match &err {
        Error::MigrationBlocked { step, holders, .. } => {
            assert_eq!(step, "outbox_dlq_failed_at_index");
            let h = holders
                .iter()
                .find(|h| h.pid == old_pid)
                .unwrap_or_else(|| panic!("the old snapshot is named: {err}"));
            assert!(h.modes.iter().any(|m| m == "snapshot"), "{h:?}");
            assert!(h.transaction_start.is_some(), "{h:?}");
        }
        other => panic!("expected MigrationBlocked, got {other:?}"),
    }
    let valid: bool = sqlx::query_scalar(
        "SELECT indisvalid FROM pg_index WHERE indexrelid = to_regclass($1)::oid",
    )
    .bind(format!("\"{index}\""))
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(!valid, "the interrupted build left an INVALID index");
    let problems = match outbox.validate_schema(&pool).await {
        Err(Error::SchemaMismatch { problems }) => problems,
        other => panic!("{other:?}"),
    };
    assert_eq!(problems.len(), 1, "{problems:#?}");
    assert!(
        index_problem(&problems, &index).message.contains("INVALID"),
        "{problems:#?}"
    );

    old.execute("COMMIT").await.unwrap();
    outbox.migrate(&pool).await.unwrap();
    outbox.validate_schema(&pool).await.unwrap();
    let valid: bool = sqlx::query_scalar(
        "SELECT indisvalid FROM pg_index WHERE indexrelid = to_regclass($1)::oid",
    )
    .bind(format!("\"{index}\""))
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(valid, "rebuilt");
    drop_tables(&pool, &outbox).await;
}

/// SPEC §1.3 (v2): each step is recorded with its time; steps found in place (the files run
/// by another tool) are recorded as found. A second `migrate()` changes no record.
#[tokio::test]
async fn applied_steps_are_recorded() {
    let pool = pool().await;
    let fresh = outbox("mig_rec");
    assert!(fresh.applied_migrations(&pool).await.unwrap().is_empty());
    let before = chrono::Utc::now() - chrono::TimeDelta::seconds(5);
    fresh.migrate(&pool).await.unwrap();
    let applied = fresh.applied_migrations(&pool).await.unwrap();
    let steps = outbox::schema::migration_steps(&fresh);
    assert_eq!(
        applied.iter().map(|a| a.version).collect::<Vec<_>>(),
        steps.iter().map(|s| s.version).collect::<Vec<_>>()
    );
    assert!(applied.iter().all(|a| !a.found && a.applied_at > before));
    assert_eq!(applied[6].description, "outbox_dlq_failed_at_index");
    fresh.migrate(&pool).await.unwrap();
    assert_eq!(fresh.applied_migrations(&pool).await.unwrap(), applied);
    drop_tables(&pool, &fresh).await;

    // The files, run as a user's own tool would (each in its transaction, the concurrent
    // index outside any), then `migrate()`: everything is found, nothing applied again.
    let by_files = outbox("mig_files");
    for step in outbox::schema::migration_steps(&by_files) {
        if step.transaction {
            let mut tx = pool.begin().await.unwrap();
            sqlx::raw_sql(AssertSqlSafe(step.sql))
                .execute(&mut *tx)
                .await
                .unwrap();
            tx.commit().await.unwrap();
        } else {
            sqlx::raw_sql(AssertSqlSafe(step.sql))
                .execute(&pool)
                .await
                .unwrap();
        }
    }
    by_files.validate_schema(&pool).await.unwrap();
    assert!(by_files.applied_migrations(&pool).await.unwrap().is_empty());
    let strict = MigrateOptions::default().deadline(Duration::ZERO);
    by_files.migrate_with(&pool, strict).await.unwrap();
    let found = by_files.applied_migrations(&pool).await.unwrap();
    assert_eq!(found.len(), steps.len());
    assert!(found.iter().all(|a| a.found), "{found:#?}");
    drop_tables(&pool, &by_files).await;
}

/// Several processes starting at once all call `migrate()` on a fresh database: every call
/// succeeds, and each step is applied and recorded once.
#[tokio::test]
async fn concurrent_migrates_take_turns() {
    let pool = pool().await;
    let outbox = outbox("mig_conc");
    let calls: Vec<_> = (0..4)
        .map(|_| {
            let (pool, outbox) = (pool.clone(), outbox.clone());
            tokio::spawn(async move { outbox.migrate(&pool).await })
        })
        .collect();
    for call in calls {
        call.await.unwrap().unwrap();
    }
    outbox.validate_schema(&pool).await.unwrap();
    let applied = outbox.applied_migrations(&pool).await.unwrap();
    assert_eq!(
        applied.len(),
        outbox::schema::migration_steps(&outbox).len()
    );
    drop_tables(&pool, &outbox).await;
}

#[tokio::test]
async fn out_of_range_options_are_refused_before_any_sql() {
    let outbox = outbox("mig_opts");
    // A pool that would fail on first use: the options are checked before it is touched.
    let pool = sqlx::postgres::PgPoolOptions::new()
        .acquire_timeout(Duration::from_millis(100))
        .connect_lazy("postgres://nobody@127.0.0.1:1/none")
        .unwrap();
    for options in [
        MigrateOptions::default().lock_timeout(Duration::from_millis(1)),
        MigrateOptions::default().lock_timeout(Duration::from_secs(3600)),
        MigrateOptions::default().deadline(Duration::from_secs(25 * 3600)),
    ] {
        let err = outbox.migrate_with(&pool, options).await.unwrap_err();
        assert!(matches!(err, Error::InvalidArgument { .. }), "{err:?}");
    }
}

/// The storage parameters a table sets, sorted.
async fn storage_options(pool: &PgPool, table: &str) -> Vec<String> {
    let mut o = sqlx::query_scalar::<_, Vec<String>>(
        "SELECT coalesce(reloptions, '{}') FROM pg_class WHERE oid = to_regclass($1)",
    )
    .bind(table)
    .fetch_one(pool)
    .await
    .unwrap();
    o.sort();
    o
}

/// What step 0008 sets, sorted.
const AUTOVACUUM: [&str; 7] = [
    "autovacuum_analyze_scale_factor=0.02",
    "autovacuum_analyze_threshold=1000",
    "autovacuum_vacuum_cost_delay=0",
    "autovacuum_vacuum_insert_scale_factor=0.01",
    "autovacuum_vacuum_insert_threshold=1000",
    "autovacuum_vacuum_scale_factor=0.01",
    "autovacuum_vacuum_threshold=1000",
];

fn with_fillfactor(f: &str, rest: &[&str]) -> Vec<String> {
    let mut v: Vec<String> = rest.iter().map(|s| (*s).to_owned()).collect();
    v.push(format!("fillfactor={f}"));
    v.sort();
    v
}

/// SPEC §1.3 (v2): a storage setting is applied once, by the step that introduces it, and
/// never again: an operator's own tuning survives every later `migrate()`, a reset too.
#[tokio::test]
async fn an_operators_storage_tuning_survives_migrate() {
    let pool = pool().await;
    let outbox = outbox("mig_tuning");
    outbox.migrate(&pool).await.unwrap();
    let t = outbox.table();
    assert_eq!(
        storage_options(&pool, t).await,
        with_fillfactor("70", &AUTOVACUUM)
    );
    sqlx::raw_sql(AssertSqlSafe(format!(
        "ALTER TABLE {t} SET (fillfactor = 90, autovacuum_vacuum_scale_factor = 0.05); \
         ALTER TABLE {t} RESET (autovacuum_vacuum_cost_delay)"
    )))
    .execute(&pool)
    .await
    .unwrap();
    let tuned = storage_options(&pool, t).await;
    assert!(tuned.contains(&"autovacuum_vacuum_scale_factor=0.05".to_owned()));
    assert!(!tuned
        .iter()
        .any(|o| o.starts_with("autovacuum_vacuum_cost_delay")));
    outbox.migrate(&pool).await.unwrap();
    assert_eq!(storage_options(&pool, t).await, tuned);
    outbox.validate_schema(&pool).await.unwrap();
    drop_tables(&pool, &outbox).await;
}

/// An operator who tuned autovacuum on the table before step 0008 arrived keeps every value
/// of theirs: the step is recorded as found, and sets none of its own.
#[tokio::test]
async fn autovacuum_settings_leave_an_operators_earlier_tuning_alone() {
    let pool = pool().await;
    let outbox = outbox("mig_av_pre");
    outbox.migrate_base_only(&pool).await.unwrap();
    let t = outbox.table();
    sqlx::raw_sql(AssertSqlSafe(format!(
        "ALTER TABLE {t} SET (autovacuum_vacuum_threshold = 5000)"
    )))
    .execute(&pool)
    .await
    .unwrap();
    outbox.migrate(&pool).await.unwrap();
    assert_eq!(
        storage_options(&pool, t).await,
        with_fillfactor("70", &["autovacuum_vacuum_threshold=5000"])
    );
    let step = outbox
        .applied_migrations(&pool)
        .await
        .unwrap()
        .into_iter()
        .find(|m| m.description == "outbox_autovacuum_settings")
        .expect("recorded");
    assert!(step.found, "recorded as found, not applied: {step:?}");
    drop_tables(&pool, &outbox).await;
}

/// A pool of one connection whose sessions never run Postgres' deadlock check in time to
/// matter (`deadlock_timeout` 60 s): a wait cycle between migrators would hang instead of
/// being broken by a cancelled statement.
async fn patient_pool(max: u32) -> PgPool {
    let options: sqlx::postgres::PgConnectOptions = database_url().parse().unwrap();
    sqlx::postgres::PgPoolOptions::new()
        .max_connections(max)
        .connect_with(options.options([("deadlock_timeout", "60s")]))
        .await
        .unwrap()
}

/// Found by a trial: migrators that waited for the advisory lock inside a statement held a
/// snapshot, which the lock holder's CREATE INDEX CONCURRENTLY waited for: a cycle that
/// Postgres broke by cancelling the build, over and over. The lock is now polled, so
/// several processes upgrading one table at once all finish, each on a pool of one
/// connection, with no deadlock check needed.
#[tokio::test]
async fn concurrent_upgrades_through_a_concurrent_build_all_finish() {
    let pool = pool().await;
    let outbox = outbox("mig_conc_up");
    outbox.migrate_base_only(&pool).await.unwrap();
    sqlx::raw_sql(AssertSqlSafe(format!(
        "INSERT INTO {} (original_id, queue, payload, deliveries_count, attempts_count, \
                         created_at, failure_reason) \
         SELECT g, 'q', 'x', 1, 1, now(), 'rejected' FROM generate_series(1, 100000) g",
        outbox.dead_letter_table()
    )))
    .execute(&pool)
    .await
    .unwrap();
    let mut calls = Vec::new();
    for i in 0..4u64 {
        let outbox = outbox.clone();
        let own = patient_pool(1).await;
        calls.push(tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(40 * i)).await;
            outbox.migrate(&own).await
        }));
    }
    let all = tokio::time::timeout(Duration::from_secs(30), async {
        for call in calls {
            call.await.unwrap().unwrap();
        }
    })
    .await;
    assert!(all.is_ok(), "the migrators waited for each other");
    outbox.validate_schema(&pool).await.unwrap();
    assert_eq!(
        outbox.applied_migrations(&pool).await.unwrap().len(),
        outbox.migration_steps().len()
    );
    drop_tables(&pool, &outbox).await;
}

/// Found by a trial: the deadline bounds the wait for another `migrate()` too (one busy
/// with a long step holds the migrators' advisory lock); the error names it.
#[tokio::test]
async fn the_deadline_bounds_waiting_for_another_migrator() {
    let pool = pool().await;
    let outbox = outbox("mig_adv");
    outbox.migrate_base_only(&pool).await.unwrap();
    let mut other = session().await;
    let other_pid = pid(&mut other).await;
    sqlx::query("SELECT pg_advisory_lock(hashtextextended($1, 0))")
        .bind(format!("outbox.migrate:{}", outbox.table()))
        .execute(&mut other)
        .await
        .unwrap();
    let deadline = Duration::from_millis(800);
    let options = MigrateOptions::default()
        .lock_timeout(Duration::from_millis(100))
        .deadline(deadline);
    let started = Instant::now();
    let err = tokio::time::timeout(deadline * 3, outbox.migrate_with(&pool, options))
        .await
        .expect("migrate() returns by its deadline")
        .unwrap_err();
    assert!(started.elapsed() < deadline * 3);
    match &err {
        Error::MigrationBlocked { step, holders, .. } => {
            assert_eq!(step, "outbox_rearm_columns");
            let h = holders
                .iter()
                .find(|h| h.pid == other_pid)
                .unwrap_or_else(|| panic!("the other migrator is named: {err}"));
            assert_eq!(h.modes, vec!["advisory".to_owned()]);
        }
        other => panic!("expected MigrationBlocked, got {other:?}"),
    }
    // No setting or lock is left on the pool's connections.
    let mut conn = pool.acquire().await.unwrap();
    let timeout: String = sqlx::query_scalar("SHOW lock_timeout")
        .fetch_one(&mut *conn)
        .await
        .unwrap();
    assert_eq!(timeout, "0");
    drop(conn);
    drop(other);
    outbox.migrate(&pool).await.unwrap();
    drop_tables(&pool, &outbox).await;
}

/// Found by a trial: the index build ran on a connection of its own, without the pool's
/// `after_connect` (here, the `search_path` that finds the tables): it failed, or built
/// the index on another schema's table of the same name. It now runs on a pool connection.
#[tokio::test]
async fn the_search_path_of_the_pool_reaches_every_step() {
    let admin = pool().await;
    let schema = unique_table("mig_sp");
    sqlx::raw_sql(AssertSqlSafe(format!("CREATE SCHEMA \"{schema}\"")))
        .execute(&admin)
        .await
        .unwrap();
    let set = format!("SET search_path TO \"{schema}\"");
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .after_connect(move |conn, _| {
            let set = set.clone();
            Box::pin(async move {
                conn.execute(AssertSqlSafe(set)).await?;
                Ok(())
            })
        })
        .connect(&database_url())
        .await
        .unwrap();
    let outbox = Outbox::builder()
        .table("outbox_sp")
        .dead_letter(true)
        .build()
        .unwrap();
    outbox.migrate_base_only(&pool).await.unwrap();
    outbox.migrate(&pool).await.unwrap();
    outbox.validate_schema(&pool).await.unwrap();
    let index: Option<String> = sqlx::query_scalar("SELECT to_regclass($1)::text")
        .bind(format!("\"{schema}\".outbox_sp_dlq_failed_at_idx"))
        .fetch_one(&admin)
        .await
        .unwrap();
    assert!(index.is_some(), "the index is on the schema's table");
    sqlx::raw_sql(AssertSqlSafe(format!("DROP SCHEMA \"{schema}\" CASCADE")))
        .execute(&admin)
        .await
        .unwrap();
}

/// Found by a trial: `migrate()` matched indexes and CHECKs by name where validate_schema
/// matches them by definition, so a renamed constraint or index re-ran the base step (and
/// its table locks) at every start. Both now use one rule: an up-to-date schema with
/// renamed pieces takes no lock either.
#[tokio::test]
async fn renamed_indexes_and_checks_still_count_as_applied() {
    let pool = pool().await;
    let outbox = outbox("mig_ren");
    outbox.migrate(&pool).await.unwrap();
    let applied = outbox.applied_migrations(&pool).await.unwrap();
    let name = outbox.table().trim_matches('"').to_owned();
    sqlx::raw_sql(AssertSqlSafe(format!(
        "ALTER TABLE {t} RENAME CONSTRAINT \"{name}_lease_ck\" TO lease_check_{name}; \
         ALTER TABLE {t} RENAME CONSTRAINT \"{name}_cancel_ck\" TO cancel_check_{name}; \
         ALTER INDEX \"{name}_pending_idx\" RENAME TO pending_{name}; \
         ALTER INDEX \"{name}_dlq_failed_at_idx\" RENAME TO failed_{name}",
        t = outbox.table()
    )))
    .execute(&pool)
    .await
    .unwrap();
    outbox.validate_schema(&pool).await.unwrap();

    // An uncommitted insert holds ROW EXCLUSIVE on the queue table: any DDL would wait.
    let mut writer = session().await;
    writer.execute("BEGIN").await.unwrap();
    writer
        .execute(AssertSqlSafe(format!(
            "INSERT INTO {} (queue, payload) VALUES ('q', 'x')",
            outbox.table()
        )))
        .await
        .unwrap();
    let strict = MigrateOptions::default()
        .lock_timeout(Duration::from_millis(100))
        .deadline(Duration::ZERO);
    outbox.migrate_with(&pool, strict).await.unwrap();
    assert_eq!(outbox.applied_migrations(&pool).await.unwrap(), applied);
    writer.execute("ROLLBACK").await.unwrap();
    drop_tables(&pool, &outbox).await;
}

/// Found by a trial: without the dead-letter queue, `migrate()` built the dead-letter
/// table's new index anyway, and a long transaction anywhere in the database (which a
/// concurrent build waits for) made it fail after its deadline. The dead-letter upgrade
/// now runs with the `migrate()` of an outbox that has the queue on.
#[tokio::test]
async fn the_dead_letter_upgrade_waits_for_the_dead_letter_queue() {
    let pool = pool().await;
    let name = unique_table("mig_nodlq");
    let without = Outbox::builder().table(&name).build().unwrap();
    without.migrate_base_only(&pool).await.unwrap();

    let mut old = session().await;
    old.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        .await
        .unwrap();
    old.execute("SELECT 1").await.unwrap();
    let strict = MigrateOptions::default()
        .lock_timeout(Duration::from_millis(200))
        .deadline(Duration::ZERO);
    without.migrate_with(&pool, strict).await.unwrap();
    without.validate_schema(&pool).await.unwrap();
    let versions: Vec<i64> = without
        .applied_migrations(&pool)
        .await
        .unwrap()
        .iter()
        .map(|a| a.version)
        .collect();
    // Every step but the two of the dead-letter upgrade (20240101000006 and …07).
    assert_eq!(
        versions.len(),
        without.migration_steps().len() - 2,
        "{versions:?}"
    );
    assert!(!versions.contains(&20240101000006) && !versions.contains(&20240101000007));
    old.execute("COMMIT").await.unwrap();

    let with = Outbox::builder()
        .table(&name)
        .dead_letter(true)
        .build()
        .unwrap();
    assert!(matches!(
        with.validate_schema(&pool).await,
        Err(Error::SchemaMismatch { .. })
    ));
    with.migrate(&pool).await.unwrap();
    with.validate_schema(&pool).await.unwrap();
    assert_eq!(
        with.applied_migrations(&pool).await.unwrap().len(),
        with.migration_steps().len()
    );
    drop_tables(&pool, &with).await;
}

/// An explicit schema that was never created is a typed error that says to create it (a
/// newcomer's mistake found in a trial run), for migrate and for every later call;
/// nothing is created anywhere.
#[tokio::test]
async fn a_schema_that_does_not_exist_is_a_typed_error() {
    let pool = pool().await;
    let schema = unique_table("nosuchschema");
    let outbox = Outbox::builder().schema(&schema).build().unwrap();
    let err = outbox.migrate(&pool).await.unwrap_err();
    assert!(matches!(err, Error::SchemaNotFound { .. }), "{err:?}");
    let text = err.to_string();
    assert!(text.contains(&schema), "{text}");
    assert!(text.contains("CREATE SCHEMA"), "{text}");
    let err = outbox.validate_schema(&pool).await.unwrap_err();
    // validate_schema says the same as migrate: the schema is missing, not "table is
    // missing" (found by a fresh-user review).
    let Error::SchemaNotFound { detail } = &err else {
        panic!("{err:?}");
    };
    assert_eq!(detail, &format!("schema \"{schema}\" does not exist"));
    assert!(err.to_string().contains("CREATE SCHEMA"), "{err}");
    let exists: bool =
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)")
            .bind(&schema)
            .fetch_one(&pool)
            .await
            .unwrap();
    assert!(!exists);
}

/// `migrate` over a table of the same name that is not an outbox queue table (one of the
/// application's) says so, naming the columns it lacks, before any DDL: it used to fail on
/// the first step with a raw database error (`column "acquired_token" does not exist`) and
/// leave the table of applied steps behind (found by a fresh-user pass).
#[tokio::test]
async fn migrate_over_a_foreign_table_is_refused_before_any_ddl() {
    let pool = pool().await;
    let table = unique_table("foreign");
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE TABLE \"{table}\" (id int, queue text)"
    )))
    .execute(&pool)
    .await
    .unwrap();
    let outbox = Outbox::builder().table(&table).build().unwrap();
    let err = outbox.migrate(&pool).await.unwrap_err();
    let Error::SchemaMismatch { problems } = &err else {
        panic!("{err:?}");
    };
    let objects: Vec<&str> = problems.iter().map(|p| p.object.as_str()).collect();
    assert!(
        objects.contains(&format!("{table}.payload").as_str()),
        "{objects:?}"
    );
    assert!(
        objects.contains(&format!("{table}.acquired_token").as_str()),
        "{objects:?}"
    );
    assert!(
        !objects.contains(&format!("{table}.queue").as_str()),
        "{objects:?}"
    );
    assert!(
        problems
            .iter()
            .all(|p| p.message.contains("not an outbox queue table")),
        "{problems:?}"
    );
    // `validate_schema` says the same, not a list of what migrate would add (found by a
    // fresh user: `outbox validate` advised running migrate, which refuses the table).
    match outbox.validate_schema(&pool).await {
        Err(Error::SchemaMismatch { problems: seen }) => assert_eq!(&seen, problems),
        other => panic!("{other:?}"),
    }
    let created: i64 = sqlx::query_scalar("SELECT count(*) FROM pg_class WHERE relname LIKE $1")
        .bind(format!("{table}%"))
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(created, 1, "only the application's own table exists");
    sqlx::raw_sql(AssertSqlSafe(format!("DROP TABLE \"{table}\"")))
        .execute(&pool)
        .await
        .unwrap();
}

/// The same for the dead-letter table, with the dead-letter queue on or off (the base step
/// creates and indexes it): an application's table named as the dead-letter table used to
/// get the outbox's indexes and redrive columns, and `migrate` said it was done (found by a
/// fresh-user trial).
#[tokio::test]
async fn migrate_over_a_foreign_dead_letter_table_is_refused_before_any_ddl() {
    let pool = pool().await;
    let table = unique_table("foreign_dlq");
    let dlq = format!("{table}_events");
    let create =
        format!("CREATE TABLE \"{dlq}\" (id bigint, queue text, failed_at timestamptz, note text)");
    sqlx::raw_sql(AssertSqlSafe(create))
        .execute(&pool)
        .await
        .unwrap();
    for dead_letter in [false, true] {
        let outbox = Outbox::builder()
            .table(&table)
            .dead_letter_table(&dlq)
            .dead_letter(dead_letter)
            .build()
            .unwrap();
        let err = outbox.migrate(&pool).await.unwrap_err();
        let Error::SchemaMismatch { problems } = &err else {
            panic!("dead letter {dead_letter}: {err:?}");
        };
        let objects: Vec<&str> = problems.iter().map(|p| p.object.as_str()).collect();
        assert!(
            objects.contains(&format!("{dlq}.original_id").as_str())
                && !objects.contains(&format!("{dlq}.failed_at").as_str()),
            "{objects:?}"
        );
        assert!(
            problems
                .iter()
                .all(|p| p.message.contains("not an outbox dead-letter table")),
            "{problems:?}"
        );
        if dead_letter {
            match outbox.validate_schema(&pool).await {
                // Beside the queue table that does not exist yet.
                Err(Error::SchemaMismatch { problems: seen }) => {
                    assert!(problems.iter().all(|p| seen.contains(p)), "{seen:?}")
                }
                other => panic!("{other:?}"),
            }
        }
    }
    let created: i64 = sqlx::query_scalar("SELECT count(*) FROM pg_class WHERE relname LIKE $1")
        .bind(format!("{table}%"))
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(
        created, 1,
        "only the application's own table exists, no index on it"
    );
    let columns: i64 =
        sqlx::query_scalar("SELECT count(*) FROM information_schema.columns WHERE table_name = $1")
            .bind(&dlq)
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(columns, 4, "no column added");
    sqlx::raw_sql(AssertSqlSafe(format!("DROP TABLE \"{dlq}\"")))
        .execute(&pool)
        .await
        .unwrap();
}

/// A worker's claim and wake-up read on a database never migrated say NotMigrated, not
/// UpgradeRequired (found by a fresh-user review: both statements name `<table>_paused`
/// before the queue table, and Postgres reports the first missing relation); so do pause,
/// resume and the paused-queues read, which name only the paused table. With only the
/// paused table missing (a table from before that upgrade), UpgradeRequired stays.
#[tokio::test]
async fn a_claim_on_a_database_never_migrated_says_not_migrated() {
    let pool = pool().await;
    let outbox = Outbox::builder()
        .table(unique_table("never_claimed"))
        .build()
        .unwrap();
    let store = PgStore::new(pool.clone(), outbox.clone());
    let qs = queues();
    let err = store
        .claim(ClaimRequest::new(&qs, 1, Duration::from_secs(60)))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::NotMigrated { .. }), "{err:?}");
    assert!(err.to_string().contains(outbox.table()), "{err}");
    let err = store
        .next_wakeup(ClaimRequest::new(&qs, 1, Duration::from_secs(60)))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::NotMigrated { .. }), "{err:?}");
    // Pausing reads only the paused table: it looks the queue table up too.
    let mut conn = pool.acquire().await.unwrap();
    let err = outbox.pause_queue(&mut conn, QUEUE).await.unwrap_err();
    assert!(matches!(err, Error::NotMigrated { .. }), "{err:?}");
    let err = outbox.resume_queue(&mut conn, QUEUE).await.unwrap_err();
    assert!(matches!(err, Error::NotMigrated { .. }), "{err:?}");
    let err = outbox.paused_queues(&mut conn).await.unwrap_err();
    assert!(matches!(err, Error::NotMigrated { .. }), "{err:?}");
    drop(conn);

    outbox.migrate(&pool).await.unwrap();
    sqlx::query(AssertSqlSafe(format!(
        "DROP TABLE {}",
        outbox.paused_table()
    )))
    .execute(&pool)
    .await
    .unwrap();
    let err = store
        .claim(ClaimRequest::new(&qs, 1, Duration::from_secs(60)))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::UpgradeRequired { .. }), "{err:?}");
    let mut conn = pool.acquire().await.unwrap();
    let err = outbox.pause_queue(&mut conn, QUEUE).await.unwrap_err();
    assert!(matches!(err, Error::UpgradeRequired { .. }), "{err:?}");
    drop(conn);
    drop_tables(&pool, &outbox).await;
}

/// An outbox that names a table of the application's (not an outbox table) gets a typed
/// `SchemaMismatch` naming the missing column from every call, not a raw database error
/// (found by a fresh-user trial: `outbox --table pg_class status`); nothing is written.
#[tokio::test]
async fn a_table_that_is_not_an_outbox_table_says_schema_mismatch() {
    let pool = pool().await;
    let outbox = outbox("not_ours");
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE TABLE {t} (id bigint PRIMARY KEY, note text); INSERT INTO {t} VALUES (1, 'mine')",
        t = outbox.table()
    )))
    .execute(&pool)
    .await
    .unwrap();
    let mismatch = |what: &str, err: Error| match &err {
        Error::SchemaMismatch { problems } => {
            assert_eq!(problems.len(), 1, "{what}: {err}");
            // The first column the statement names that the table lacks.
            let column = problems[0].object.as_str();
            assert!(
                !column.is_empty() && column.chars().all(|c| c == '_' || c.is_ascii_lowercase()),
                "a bare column name: {what}: {err}"
            );
            assert!(!problems[0].needs_upgrade, "{what}: {err}");
            assert!(
                err.to_string().contains("not an outbox table"),
                "{what}: {err}"
            );
        }
        other => panic!("{what}: {other:?}"),
    };
    let mut conn = pool.acquire().await.unwrap();
    mismatch(
        "publish",
        outbox
            .publish(&mut conn, outbox::Message::new(QUEUE, b"x"))
            .await
            .unwrap_err(),
    );
    mismatch(
        "pending",
        outbox.pending(&mut conn, QUEUE, 10).await.unwrap_err(),
    );
    mismatch(
        "cancel",
        outbox.cancel(&mut conn, QUEUE, "k").await.unwrap_err(),
    );
    mismatch(
        "stats",
        outbox
            .stats(
                &mut conn,
                &outbox::stats::StatsRequest::new(Duration::from_secs(60)),
            )
            .await
            .unwrap_err(),
    );
    mismatch("run_now", outbox.run_now(&mut conn, 1).await.unwrap_err());
    // The statements that meet the missing paused table first say the same, not that an
    // upgrade is missing (`migrate` refuses such a table).
    mismatch(
        "pause_queue",
        outbox.pause_queue(&mut conn, QUEUE).await.unwrap_err(),
    );
    mismatch(
        "claim",
        PgStore::new(pool.clone(), outbox.clone())
            .claim(ClaimRequest::new(&queues(), 1, Duration::from_secs(60)))
            .await
            .unwrap_err(),
    );
    let rows: Vec<(i64, String)> = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT id, note FROM {}",
        outbox.table()
    )))
    .fetch_all(&mut *conn)
    .await
    .unwrap();
    assert_eq!(rows, vec![(1, "mine".to_owned())], "the table is untouched");
    drop(conn);
    drop_tables(&pool, &outbox).await;
}

/// `?` on the user's own statement gives `Error::Database` whatever the SQLSTATE: a typo'd
/// table, a missing column named like a rearm column or a missing schema in the user's SQL
/// say nothing about the outbox's schema (found by a fresh-user review: they became
/// NotMigrated, UpgradeRequired and SchemaNotFound).
#[tokio::test]
async fn the_users_own_sql_errors_stay_database_errors() {
    async fn user_sql(pool: &PgPool, sql: &'static str) -> outbox::Result<()> {
        sqlx::query(sql).execute(pool).await?;
        Ok(())
    }
    let pool = pool().await;
    for (sql, code) in [
        ("SELECT * FROM no_such_table", "42P01"),
        ("SELECT * FROM no_such_table_paused", "42P01"),
        ("SELECT rearm_at FROM pg_class", "42703"),
        ("CREATE TABLE no_such_schema.t (x int)", "3F000"),
    ] {
        let err = user_sql(&pool, sql).await.unwrap_err();
        assert!(matches!(err, Error::Database(_)), "{sql}: {err:?}");
        assert_eq!(err.sqlstate().as_deref(), Some(code), "{sql}");
    }
}

/// Distributed mode on a database without Citus is refused before anything is created
/// (found by a fresh user: it said "the outbox tables do not exist (relation
/// \"pg_dist_partition\" does not exist)" and left the table of applied steps behind).
#[tokio::test]
async fn distributed_mode_without_citus_is_refused_before_any_ddl() {
    let pool = pool().await;
    let citus: bool =
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_extension WHERE extname = 'citus')")
            .fetch_one(&pool)
            .await
            .unwrap();
    if citus {
        // Under .ci/citus the database has Citus: the refusal does not apply there.
        return;
    }
    let outbox = Outbox::builder()
        .distributed(16)
        .table(unique_table("mig_nocitus"))
        .build()
        .unwrap();
    match outbox.migrate(&pool).await.unwrap_err() {
        Error::InvalidConfig { knob, reason } => {
            assert_eq!(knob, "distributed");
            assert!(reason.contains("needs the Citus extension"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
    for table in [outbox.table(), outbox.migrations_table()] {
        let exists: bool = sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL")
            .bind(table)
            .fetch_one(&pool)
            .await
            .unwrap();
        assert!(!exists, "{table} was not created");
    }
}

/// Found by a fresh user: `migrate()` on an up-to-date schema waited without bound behind
/// an ACCESS EXCLUSIVE lock on the queue table (9 s against a 2 s deadline), because
/// printing an index predicate (`pg_get_expr`) opens the table with ACCESS SHARE. The read
/// is now bounded like a step: past the deadline a typed error names the holder, and once
/// the holder ends `migrate()` goes through. The dead-letter table's indexes have no
/// predicate, so a lock on it does not stop the read.
#[tokio::test]
async fn an_up_to_date_migrate_behind_an_exclusive_lock_keeps_its_deadline() {
    let pool = pool().await;
    let outbox = outbox("mig_read_blocked");
    outbox.migrate(&pool).await.unwrap();
    let deadline = Duration::from_millis(1000);
    let options = MigrateOptions::default()
        .lock_timeout(Duration::from_millis(200))
        .deadline(deadline);
    // The dead-letter table has no partial index and no CHECK: the read never opens it, so
    // an exclusive lock on it does not stop an up-to-date migrate at all.
    for (table, blocks) in [(outbox.table(), true), (outbox.dead_letter_table(), false)] {
        let mut locker = session().await;
        let locker_pid = pid(&mut locker).await;
        locker.execute("BEGIN").await.unwrap();
        locker
            .execute(AssertSqlSafe(format!(
                "LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE"
            )))
            .await
            .unwrap();

        let started = Instant::now();
        let result = outbox.migrate_with(&pool, options).await;
        let waited = started.elapsed();
        assert!(
            waited < deadline * 3,
            "{table}: bounded by the deadline ({deadline:?}): {waited:?}"
        );
        if blocks {
            let err = result.unwrap_err();
            let Error::MigrationBlocked { step, holders, .. } = &err else {
                panic!("{table}: expected MigrationBlocked, got {err:?}");
            };
            assert_eq!(step, "reading the catalog", "{table}");
            let holder = holders
                .iter()
                .find(|h| h.pid == locker_pid)
                .unwrap_or_else(|| panic!("{table}: the locker is named: {err}"));
            assert!(
                holder.modes.iter().any(|m| m == "AccessExclusiveLock"),
                "{table}: {holder:?}"
            );
        } else {
            result.unwrap_or_else(|e| panic!("{table}: {e:?}"));
        }

        locker.execute("ROLLBACK").await.unwrap();
        outbox.migrate_with(&pool, options).await.unwrap();
    }
    drop_tables(&pool, &outbox).await;
}
