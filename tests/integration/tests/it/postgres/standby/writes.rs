//! On a standby every write of the outbox is `Error::ReadOnly`, never a raw SQL error:
//! publish, extend and cancel in the application's transaction, a batch on a bare
//! connection, `run_due`, and `migrate`, which asks `pg_is_in_recovery()` and refuses before
//! any DDL. Reads still work there.

use std::error::Error as _;
use std::time::Duration;

use outbox::{Error, PgStore, Worker};

use super::{pool_at, Pair};

#[outbox::timer(queue = "standby.write", max_deliveries = 3)]
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct Write {
    n: i64,
}

/// SQLSTATE 25006 `read_only_sql_transaction`, wrapped with its sqlx error as `source`.
fn assert_refused_statement(e: &Error, what: &str) {
    match e {
        Error::ReadOnly {
            detail,
            source: Some(sqlx::Error::Database(db)),
        } => {
            assert_eq!(db.code().as_deref(), Some("25006"), "{what}: {e}");
            assert!(
                detail.contains("read-only transaction") || detail.contains("during recovery"),
                "{what}: {detail}"
            );
        }
        other => panic!("{what}: expected Error::ReadOnly with its statement error, got {other:?}"),
    }
    assert_eq!(e.sqlstate().as_deref(), Some("25006"), "{what}");
    assert!(e.source().is_some(), "{what}: the sqlx error is the source");
    assert!(!e.is_connection_error() && !e.is_transient(), "{what}");
    assert!(e.to_string().contains("the primary"), "{what}: {e}");
}

#[tokio::test]
async fn publishing_and_cancelling_on_a_standby_say_read_only() {
    let pair = Pair::start().await;
    let primary = pool_at(pair.primary.port()).await;
    let outbox = &pair.outbox;
    // A row to cancel, replicated.
    let mut conn = primary.acquire().await.unwrap();
    publish_write(
        outbox.on(&mut conn),
        "kept",
        &Write { n: 0 },
        Duration::from_secs(3600),
    )
    .await
    .unwrap();
    drop(conn);
    pair.replayed().await;

    let standby = pool_at(pair.standby.port()).await;
    let mut tx = standby
        .begin()
        .await
        .expect("a read-only transaction begins");
    let e = publish_write(outbox.on(&mut tx), "a", &Write { n: 1 }, Duration::ZERO)
        .await
        .unwrap_err();
    assert_refused_statement(&e, "publish in a transaction");
    tx.rollback().await.unwrap();

    let mut conn = standby.acquire().await.unwrap();
    let e = extend_write(outbox.on(&mut conn), "a", &Write { n: 1 }, Duration::ZERO)
        .await
        .unwrap_err();
    assert_refused_statement(&e, "extend");
    let e = cancel_write(outbox.on(&mut conn), "kept")
        .await
        .unwrap_err();
    assert_refused_statement(&e, "cancel");
    let items = [outbox::message::BatchItem::new(br#"{"n":2}"#)];
    let e = outbox
        .publish_batch(
            &mut conn,
            "standby.write",
            &items,
            outbox::message::Schedule::now(),
        )
        .await
        .unwrap_err();
    assert_refused_statement(&e, "batch");

    // LISTEN too: "cannot execute LISTEN during recovery" is SQLSTATE 25006. The worker's
    // own LISTEN is classified as `ReadOnly` (standby/worker.rs watches it being retried);
    // the application's own statement, converted with `?`/`From`, stays `Database`: only
    // the library's statements are read for what their SQLSTATE means.
    let mut listener = sqlx::postgres::PgListener::connect_with(&standby)
        .await
        .unwrap();
    let e = Error::from(listener.listen("outbox_standby").await.unwrap_err());
    assert!(matches!(e, Error::Database(_)), "{e:?}");
    assert_eq!(e.sqlstate().as_deref(), Some("25006"));

    // Reads are a standby's job.
    let rows = outbox
        .pending(&mut conn, "standby.write", 10)
        .await
        .unwrap();
    assert_eq!(rows.len(), 1, "the replicated row reads: {rows:?}");
}

#[tokio::test]
async fn run_due_on_a_standby_is_read_only() {
    let pair = Pair::start().await;
    let primary = pool_at(pair.primary.port()).await;
    let mut conn = primary.acquire().await.unwrap();
    publish_write(
        pair.outbox.on(&mut conn),
        "due",
        &Write { n: 1 },
        Duration::ZERO,
    )
    .await
    .unwrap();
    drop(conn);
    pair.replayed().await;

    let store = PgStore::new(pool_at(pair.standby.port()).await, pair.outbox.clone());
    let worker = Worker::builder(store)
        .timer::<Write>(|_: Write, _| async {})
        .build()
        .unwrap();
    let e = worker.run_due().await.unwrap_err();
    assert_refused_statement(&e, "run_due's claim");
}

#[tokio::test]
async fn migrate_on_a_standby_is_refused_before_any_ddl() {
    let pair = Pair::start().await;
    let standby = pool_at(pair.standby.port()).await;
    // Tables the primary never had: migrate would start with CREATE TABLE.
    let fresh = outbox::Outbox::builder()
        .table(outbox_tests::unique_table("sbm"))
        .build()
        .unwrap();
    for (outbox, what) in [
        (&fresh, "a fresh outbox"),
        (&pair.outbox, "an up-to-date one"),
    ] {
        let e = outbox.migrate(&standby).await.unwrap_err();
        match &e {
            // No statement was refused: the check came first.
            Error::ReadOnly {
                detail,
                source: None,
            } => assert!(detail.contains("pg_is_in_recovery()"), "{what}: {detail}"),
            other => {
                panic!("{what}: expected Error::ReadOnly from the recovery check, got {other:?}")
            }
        }
        assert!(e.to_string().contains("read-only"), "{e}");
    }
    // The check reads the catalog only; the standby still serves the schema check.
    pair.outbox
        .validate_schema(&standby)
        .await
        .expect("validate_schema reads on a standby");
}
