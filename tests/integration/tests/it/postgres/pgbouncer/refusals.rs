//! What needs a server session is refused through a transaction-mode pooler, with a typed
//! error and before any SQL runs (SPEC §13): `migrate`, and a worker that would `LISTEN`.

use std::time::Duration;

use outbox::{Context, Error, Outbox, Worker};
use outbox_tests::unique_table;

use super::{pooled, Bouncer, Through};

/// `migrate` on a `transaction_pooler` outbox is `SessionRequired`, and nothing was
/// created: the table does not exist afterwards.
#[tokio::test]
async fn migrate_through_the_pooler_is_session_required() {
    let bouncer = Bouncer::start();
    let pool = pooled(&bouncer, 2).await;
    let table = unique_table("pgb_mig");
    let outbox = Outbox::builder()
        .table(&table)
        .transaction_pooler(true)
        .build()
        .unwrap();
    let e = outbox.migrate(&pool).await.expect_err("refused");
    assert!(
        matches!(
            e,
            Error::SessionRequired {
                what: "migrate",
                ..
            }
        ),
        "{e:?}"
    );
    assert!(e.to_string().contains("direct connection"), "{e}");
    let e = outbox
        .migrate_with(&pool, outbox::schema::MigrateOptions::default())
        .await
        .expect_err("refused");
    assert!(matches!(e, Error::SessionRequired { .. }), "{e:?}");
    let exists: bool = sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL")
        .persistent(false)
        .bind(&table)
        .fetch_one(&outbox_tests::pool_with(1).await)
        .await
        .unwrap();
    assert!(!exists, "nothing was created");
}

/// A worker over a `transaction_pooler` store that would `LISTEN` is refused when it is
/// built (`InvalidConfig`, knob `listen`); with `listen(false)` it builds.
#[tokio::test]
async fn a_listening_worker_through_the_pooler_is_refused_at_build() {
    let t = Through::new(6).await;
    let noop = |_: Vec<u8>, _ctx: Context| async {};
    let Err(e) = Worker::builder(t.store.clone())
        .queue("pgb.listen", noop)
        .build()
    else {
        panic!("listen(true) through the pooler built");
    };
    assert!(
        matches!(e, Error::InvalidConfig { knob: "listen", .. }),
        "{e:?}"
    );
    assert!(e.to_string().contains("listen(false)"), "{e}");
    // The message is one sentence: no runs of spaces from a literal continued without `\`.
    assert!(!e.to_string().contains("  "), "{e}");
    let _poll_only = Worker::builder(t.store.clone())
        .listen(false)
        .idle_poll(Duration::from_millis(200))
        .queue("pgb.listen", noop)
        .build()
        .expect("a poll-only worker builds");
    t.cleanup().await;
}
