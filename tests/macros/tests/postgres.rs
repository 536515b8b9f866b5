//! `#[timer]`'s generated functions against a real Postgres (SPEC §2–§5 through the typed
//! layer only): publish, extend, cancel, rollback, and extend / cancel while the timer's
//! handler is running (rearm).
//!
//! Needs Postgres at `DATABASE_URL` (default `postgres://postgres@127.0.0.1:5432/test`).
//! Each test creates its own uniquely named table and drops it at the end.

use sqlx::AssertSqlSafe;
use std::future::Future;
use std::time::Duration;

use outbox::{
    store::{ClaimRequest, Completion, Store, StoredRow},
    Cancelled, Outbox, PgStore, Published, Timer,
};
use outbox_macro_tests::nested::deeper::{
    cancel_operator_timeout, extend_operator_timeout, publish_operator_timeout, OperatorTimeout,
};
use outbox_macro_tests::{extend_presence_expiry, publish_presence_expiry, PresenceExpiry};
use sqlx::PgPool;

const DEFAULT_URL: &str = "postgres://postgres@127.0.0.1:5432/test";

/// Runs `body` against a fresh table, then drops the table whether `body` passed or not.
async fn with_table<F, Fut>(body: F)
where
    F: FnOnce(PgPool, Outbox) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let url = std::env::var("DATABASE_URL").unwrap_or_else(|_| DEFAULT_URL.to_owned());
    let pool = PgPool::connect(&url)
        .await
        .unwrap_or_else(|e| panic!("connect to {url} (set DATABASE_URL): {e}"));
    let table = format!("macro_{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
    let outbox = Outbox::builder()
        .table(table)
        .build()
        .expect("valid table name");
    outbox.migrate(&pool).await.expect("migrate");

    let outcome = tokio::spawn(body(pool.clone(), outbox.clone())).await;

    sqlx::query(AssertSqlSafe(format!(
        "DROP TABLE IF EXISTS {}, {}, {}, {}",
        outbox.table(),
        outbox.dead_letter_table(),
        outbox.migrations_table(),
        outbox.paused_table()
    )))
    .execute(&pool)
    .await
    .expect("drop the test tables");
    if let Err(err) = outcome {
        std::panic::resume_unwind(err.into_panic());
    }
}

async fn rows(pool: &PgPool, outbox: &Outbox, queue: &str) -> Vec<StoredRow> {
    let mut conn = pool.acquire().await.unwrap();
    outbox.pending(&mut conn, queue, 10).await.unwrap()
}

fn timeout(conversation: &str, reminders: u32) -> OperatorTimeout {
    OperatorTimeout {
        conversation: conversation.to_owned(),
        reminders,
    }
}

#[tokio::test]
async fn publish_extend_cancel_a_pending_timer() {
    with_table(|pool, outbox| async move {
        let queue = OperatorTimeout::QUEUE;
        let mut tx = pool.begin().await.unwrap();
        let on = &mut outbox.on(&mut tx);

        let first =
            publish_operator_timeout(&mut *on, "c1", &timeout("c1", 0), Duration::from_secs(60))
                .await
                .unwrap();
        let Published::Inserted { id } = first else {
            panic!("expected Inserted, got {first:?}");
        };
        // The key is taken: publish leaves the live timer alone.
        let again =
            publish_operator_timeout(&mut *on, "c1", &timeout("c1", 9), Duration::from_secs(600))
                .await
                .unwrap();
        assert_eq!(again, Published::Skipped);
        tx.commit().await.unwrap();

        let before = rows(&pool, &outbox, queue).await;
        assert_eq!(before.len(), 1);
        assert_eq!(before[0].id, id);
        assert_eq!(before[0].timer_id.as_deref(), Some("c1"));
        assert_eq!(
            OperatorTimeout::decode(&before[0].payload).unwrap(),
            timeout("c1", 0)
        );

        // Later deadline: moves it and replaces the payload.
        let mut conn = pool.acquire().await.unwrap();
        let extended = extend_operator_timeout(
            &mut outbox.on(&mut conn),
            "c1",
            &timeout("c1", 1),
            Duration::from_secs(120),
        )
        .await
        .unwrap();
        assert_eq!(extended, Published::Extended { id });
        // Earlier deadline: a late, out-of-order extend changes nothing.
        let earlier = extend_operator_timeout(
            &mut outbox.on(&mut conn),
            "c1",
            &timeout("c1", 2),
            Duration::from_secs(5),
        )
        .await
        .unwrap();
        assert_eq!(earlier, Published::Unchanged);

        let after = rows(&pool, &outbox, queue).await;
        assert_eq!(after.len(), 1);
        assert!(after[0].next_attempt_at > before[0].next_attempt_at);
        assert_eq!(
            OperatorTimeout::decode(&after[0].payload).unwrap(),
            timeout("c1", 1)
        );

        let cancelled = cancel_operator_timeout(&mut outbox.on(&mut conn), "c1")
            .await
            .unwrap();
        assert_eq!(cancelled, Cancelled::Deleted { id });
        assert!(rows(&pool, &outbox, queue).await.is_empty());
        let gone = cancel_operator_timeout(&mut outbox.on(&mut conn), "c1")
            .await
            .unwrap();
        assert_eq!(gone, Cancelled::NotFound);

        // Once the row is gone, the key can be scheduled again.
        let fresh = extend_operator_timeout(
            &mut outbox.on(&mut conn),
            "c1",
            &timeout("c1", 3),
            Duration::ZERO,
        )
        .await
        .unwrap();
        assert!(
            matches!(fresh, Published::Inserted { id: new } if new != id),
            "{fresh:?}"
        );
    })
    .await;
}

#[tokio::test]
async fn a_rolled_back_publish_leaves_no_row() {
    with_table(|pool, outbox| async move {
        let mut tx = pool.begin().await.unwrap();
        let out = publish_presence_expiry(
            &mut outbox.on(&mut tx),
            "7",
            &PresenceExpiry { user_id: 7 },
            Duration::from_secs(60),
        )
        .await
        .unwrap();
        assert!(matches!(out, Published::Inserted { .. }), "{out:?}");
        tx.rollback().await.unwrap();
        assert!(rows(&pool, &outbox, PresenceExpiry::QUEUE).await.is_empty());
    })
    .await;
}

#[tokio::test]
async fn timers_are_keyed_per_queue() {
    with_table(|pool, outbox| async move {
        // Same key, two timer types: two queues, two live rows.
        let mut conn = pool.acquire().await.unwrap();
        let a = publish_presence_expiry(
            &mut outbox.on(&mut conn),
            "k",
            &PresenceExpiry { user_id: 1 },
            Duration::ZERO,
        )
        .await
        .unwrap();
        let b = publish_operator_timeout(
            &mut outbox.on(&mut conn),
            "k",
            &timeout("k", 0),
            Duration::ZERO,
        )
        .await
        .unwrap();
        assert!(matches!(a, Published::Inserted { .. }), "{a:?}");
        assert!(matches!(b, Published::Inserted { .. }), "{b:?}");
        assert_eq!(rows(&pool, &outbox, PresenceExpiry::QUEUE).await.len(), 1);
        assert_eq!(rows(&pool, &outbox, OperatorTimeout::QUEUE).await.len(), 1);
    })
    .await;
}

/// The product's hard case through the typed layer: the timer's handler is running (its
/// row is claimed), and the generated `extend_` queues a rearm that the run's completion
/// applies; the generated `cancel_` drops a queued rearm and never deletes a running row.
/// The store's `claim` / `ack` stand in for the worker.
#[tokio::test]
async fn extend_and_cancel_while_the_handler_runs() {
    with_table(|pool, outbox| async move {
        let queue = PresenceExpiry::QUEUE;
        let store = PgStore::new(pool.clone(), outbox.clone());
        let mut conn = pool.acquire().await.unwrap();

        let published = extend_presence_expiry(
            &mut outbox.on(&mut conn),
            "u1",
            &PresenceExpiry { user_id: 1 },
            Duration::ZERO,
        )
        .await
        .unwrap();
        let Published::Inserted { id } = published else {
            panic!("expected Inserted, got {published:?}");
        };
        let claimed = store
            .claim(ClaimRequest::new(
                &[queue.to_owned()],
                10,
                Duration::from_secs(60),
            ))
            .await
            .unwrap();
        assert_eq!(claimed.len(), 1);
        let delivery = &claimed[0];
        assert_eq!(delivery.lease.id, id);
        assert_eq!(
            PresenceExpiry::decode(&delivery.payload).unwrap(),
            PresenceExpiry { user_id: 1 }
        );

        // A ping during the run: queued as a rearm, the running row untouched.
        let rearm = extend_presence_expiry(
            &mut outbox.on(&mut conn),
            "u1",
            &PresenceExpiry { user_id: 2 },
            Duration::from_secs(60),
        )
        .await
        .unwrap();
        assert_eq!(rearm, Published::RearmQueued { id });
        // Cancel drops the rearm but leaves the run alone; a second cancel finds it running.
        let dropped = outbox_macro_tests::cancel_presence_expiry(&mut outbox.on(&mut conn), "u1")
            .await
            .unwrap();
        assert_eq!(dropped, Cancelled::RearmDropped { id });
        let running = outbox_macro_tests::cancel_presence_expiry(&mut outbox.on(&mut conn), "u1")
            .await
            .unwrap();
        assert_eq!(running, Cancelled::Running { id });
        // A publish (not extend) during the run is skipped: the key is live.
        let skipped = publish_presence_expiry(
            &mut outbox.on(&mut conn),
            "u1",
            &PresenceExpiry { user_id: 9 },
            Duration::ZERO,
        )
        .await
        .unwrap();
        assert_eq!(skipped, Published::Skipped);

        // Another ping: the rearm is queued again, and the run's success applies it.
        let rearm = extend_presence_expiry(
            &mut outbox.on(&mut conn),
            "u1",
            &PresenceExpiry { user_id: 3 },
            Duration::from_secs(90),
        )
        .await
        .unwrap();
        assert_eq!(rearm, Published::RearmQueued { id });
        let running_rows = rows(&pool, &outbox, queue).await;
        assert_eq!(running_rows.len(), 1);
        assert!(running_rows[0].acquired_token.is_some());
        assert_eq!(
            PresenceExpiry::decode(&running_rows[0].payload).unwrap(),
            PresenceExpiry { user_id: 1 },
            "the running instance keeps its payload"
        );

        let completion = store.ack(delivery.lease).await.unwrap();
        assert!(
            matches!(completion, Completion::Rearmed { .. }),
            "{completion:?}"
        );
        let after = rows(&pool, &outbox, queue).await;
        assert_eq!(after.len(), 1);
        let row = &after[0];
        assert_eq!(row.id, id);
        assert!(row.acquired_token.is_none(), "pending again");
        assert!(row.rearm_at.is_none());
        assert_eq!(row.deliveries_count, 0);
        assert!(row.next_attempt_at > delivery.deadline + chrono::TimeDelta::seconds(60));
        assert_eq!(
            PresenceExpiry::decode(&row.payload).unwrap(),
            PresenceExpiry { user_id: 3 }
        );

        let cancelled = outbox_macro_tests::cancel_presence_expiry(&mut outbox.on(&mut conn), "u1")
            .await
            .unwrap();
        assert_eq!(cancelled, Cancelled::Deleted { id });
    })
    .await;
}

/// Issue 5 req 7 end to end with the real worker: a `#[timer]` type published, extended
/// while its typed handler runs (rearm), cancelled, all through the generated functions.
#[tokio::test]
async fn typed_handler_on_a_real_worker() {
    with_table(|pool, outbox| async move {
        use std::sync::{Arc, Mutex};
        let store = PgStore::new(pool.clone(), outbox.clone());
        let seen: Arc<Mutex<Vec<i64>>> = Arc::default();
        let started = Arc::new(tokio::sync::Notify::new());
        let release = Arc::new(tokio::sync::Notify::new());
        let worker = {
            let (seen, started, release) = (seen.clone(), started.clone(), release.clone());
            outbox::Worker::builder(store)
                .idle_poll(Duration::from_millis(200))
                .timer::<PresenceExpiry>(move |p: PresenceExpiry, _ctx: outbox::Context| {
                    let (seen, started, release) = (seen.clone(), started.clone(), release.clone());
                    async move {
                        let first = seen.lock().unwrap().is_empty();
                        seen.lock().unwrap().push(p.user_id);
                        if first {
                            started.notify_one();
                            release.notified().await;
                        }
                        Ok::<(), std::convert::Infallible>(())
                    }
                })
                .build()
                .unwrap()
                .start()
        };
        let mut conn = pool.acquire().await.unwrap();
        let on = &mut outbox.on(&mut conn);
        let first = publish_presence_expiry(
            &mut *on,
            "u",
            &PresenceExpiry { user_id: 1 },
            Duration::ZERO,
        )
        .await
        .unwrap();
        assert!(matches!(first, Published::Inserted { .. }), "{first:?}");
        started.notified().await;
        let rearm = extend_presence_expiry(
            &mut *on,
            "u",
            &PresenceExpiry { user_id: 2 },
            Duration::from_millis(300),
        )
        .await
        .unwrap();
        assert!(matches!(rearm, Published::RearmQueued { .. }), "{rearm:?}");
        release.notify_one();
        let end = tokio::time::Instant::now() + Duration::from_secs(10);
        while seen.lock().unwrap().len() < 2 {
            assert!(
                tokio::time::Instant::now() < end,
                "the rearmed timer never fired"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(*seen.lock().unwrap(), vec![1, 2]);
        while !rows(&pool, &outbox, PresenceExpiry::QUEUE).await.is_empty() {
            assert!(
                tokio::time::Instant::now() < end,
                "the second run was never acked"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // Scheduled again, then cancelled before its deadline: it never fires.
        let later = extend_presence_expiry(
            &mut *on,
            "u",
            &PresenceExpiry { user_id: 3 },
            Duration::from_millis(400),
        )
        .await
        .unwrap();
        assert!(
            matches!(
                later,
                Published::Inserted { .. } | Published::Extended { .. }
            ),
            "{later:?}"
        );
        let cancelled = outbox_macro_tests::cancel_presence_expiry(&mut *on, "u")
            .await
            .unwrap();
        assert!(
            matches!(cancelled, Cancelled::Deleted { .. }),
            "{cancelled:?}"
        );
        tokio::time::sleep(Duration::from_millis(800)).await;
        assert_eq!(
            *seen.lock().unwrap(),
            vec![1, 2],
            "a cancelled timer does not fire"
        );
        assert!(worker.shutdown().await.graceful);
    })
    .await;
}
