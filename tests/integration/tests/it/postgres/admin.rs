//! Operator actions on Postgres (SPEC §1, §8 (v2)): a pause reaches
//! running workers, resume wakes them, and every action on a row by id is fenced against a
//! concurrent claim. The store-level behaviour (what a claim and a wake-up skip, each
//! action's outcome) is in the contract suite, on both stores.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use outbox::admin::RowAction;
use outbox::message::Schedule;
use outbox::store::{ClaimRequest, Store};
use outbox::{Error, Message, Timer, Worker};
use outbox_tests::{count_runs, eventually, Fixture};
use sqlx::{AssertSqlSafe, Executor};

#[outbox::timer(queue = "admin.job", max_deliveries = 3)]
#[derive(serde::Serialize, serde::Deserialize)]
struct Job {
    n: i64,
}

#[outbox::timer(queue = "admin.other", max_deliveries = 3)]
#[derive(serde::Serialize, serde::Deserialize)]
struct Other {
    n: i64,
}

async fn publish_jobs(f: &Fixture, from: i64, count: i64) {
    let mut tx = f.pool.begin().await.unwrap();
    for n in from..from + count {
        publish_job(
            f.outbox.on(&mut tx),
            &format!("job-{n}"),
            &Job { n },
            Duration::ZERO,
        )
        .await
        .unwrap();
    }
    tx.commit().await.unwrap();
}

/// A pause reaches a running worker from its next claim on (publishing goes on, the other
/// queue keeps running), and a resume wakes it through the notification, long before its
/// idle poll.
#[tokio::test]
async fn a_running_worker_stops_on_pause_and_wakes_on_resume() {
    let f = Fixture::new().await;
    let (jobs, others) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let idle_poll = Duration::from_secs(60);
    let worker = Worker::builder(f.store.clone())
        .idle_poll(idle_poll)
        .timer::<Job>(count_runs(&jobs))
        .timer::<Other>(count_runs(&others))
        .build()
        .unwrap()
        .start();
    publish_jobs(&f, 0, 1).await;
    eventually(10, "the first job runs", || async {
        jobs.load(Ordering::SeqCst) == 1
    })
    .await;

    let mut conn = f.pool.acquire().await.unwrap();
    assert!(f.outbox.pause_queue(&mut conn, Job::QUEUE).await.unwrap());
    publish_jobs(&f, 1, 5).await;
    let mut other_tx = f.pool.begin().await.unwrap();
    publish_other(
        f.outbox.on(&mut other_tx),
        "o",
        &Other { n: 1 },
        Duration::ZERO,
    )
    .await
    .unwrap();
    other_tx.commit().await.unwrap();
    eventually(10, "the other queue keeps running", || async {
        others.load(Ordering::SeqCst) == 1
    })
    .await;
    // The worker woke for both publishes (the notifications) and claimed after the pause
    // had committed: the paused queue's rows wait.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(jobs.load(Ordering::SeqCst), 1, "no job ran while paused");
    assert_eq!(f.rows(Job::QUEUE).await.len(), 5, "publishing went on");
    assert_eq!(
        f.outbox.paused_queues(&mut conn).await.unwrap()[0].queue,
        Job::QUEUE
    );

    let resumed = Instant::now();
    assert!(f.outbox.resume_queue(&mut conn, Job::QUEUE).await.unwrap());
    eventually(10, "every waiting job runs after the resume", || async {
        jobs.load(Ordering::SeqCst) == 6
    })
    .await;
    assert!(
        resumed.elapsed() < idle_poll / 3,
        "woken by the resume's notification, not by the idle poll: {:?}",
        resumed.elapsed()
    );
    drop(conn);
    let report = worker.shutdown().await;
    assert!(report.graceful, "{report:?}");
    f.cleanup().await;
}

/// A pause or resume is transactional: rolled back, it never happened.
#[tokio::test]
async fn a_pause_commits_with_the_callers_transaction() {
    let f = Fixture::new().await;
    publish_jobs(&f, 0, 1).await;
    let queues = [Job::QUEUE.to_owned()];
    let request = || ClaimRequest::new(&queues, 10, Duration::from_secs(30));

    let mut tx = f.pool.begin().await.unwrap();
    assert!(f.outbox.pause_queue(&mut tx, Job::QUEUE).await.unwrap());
    assert!(
        f.store
            .claim_on(&mut tx, request())
            .await
            .unwrap()
            .is_empty(),
        "paused within the transaction"
    );
    tx.rollback().await.unwrap();
    let mut conn = f.pool.acquire().await.unwrap();
    assert!(f.outbox.paused_queues(&mut conn).await.unwrap().is_empty());
    assert_eq!(f.store.claim(request()).await.unwrap().len(), 1);
    f.cleanup().await;
}

/// Fencing, both ways round: an action waits for a claim that locked the row first and then
/// sees it leased (nothing changes); a claim skips a row an action holds, and takes it once
/// the action's transaction ends.
#[tokio::test]
async fn row_actions_are_fenced_against_a_concurrent_claim() {
    let f = Fixture::new().await;
    let mut conn = f.pool.acquire().await.unwrap();
    let first = f
        .outbox
        .publish(&mut conn, Message::new("admin.raw", b"x"))
        .await
        .unwrap();
    let id = first.id().unwrap();
    let queues = ["admin.raw".to_owned()];
    let request = || ClaimRequest::new(&queues, 10, Duration::from_secs(30));

    // A claim locks the row in an open transaction; the operator's delete waits for it.
    let mut claimer = f.pool.begin().await.unwrap();
    let claimed = f.store.claim_on(&mut claimer, request()).await.unwrap();
    assert_eq!(claimed.len(), 1);
    let outbox = f.outbox.clone();
    let pool = f.pool.clone();
    let delete = tokio::spawn(async move {
        let mut c = pool.acquire().await.unwrap();
        outbox.delete_pending(&mut c, id).await
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !delete.is_finished(),
        "the delete waits for the claim's lock"
    );
    claimer.commit().await.unwrap();
    assert_eq!(delete.await.unwrap().unwrap(), RowAction::Leased);
    assert_eq!(
        f.only_row("admin.raw").await.id,
        id,
        "the row is still there"
    );
    f.store.ack(claimed[0].lease).await.unwrap();

    // The operator holds a row (its transaction is open): a claim skips it, then takes it.
    let second = f
        .outbox
        .publish(
            &mut conn,
            Message::new("admin.raw", b"y").schedule(Duration::from_secs(3600)),
        )
        .await
        .unwrap()
        .id()
        .unwrap();
    let mut operator = f.pool.begin().await.unwrap();
    let moved = f.outbox.run_now(&mut operator, second).await.unwrap();
    assert!(matches!(moved, RowAction::Rescheduled { .. }), "{moved:?}");
    assert!(
        f.store.claim(request()).await.unwrap().is_empty(),
        "a claim skips the row the operator holds"
    );
    operator.commit().await.unwrap();
    let got = f.store.claim(request()).await.unwrap();
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].lease.id, second, "due now, claimed");
    f.cleanup().await;
}

/// Bad input is refused before any SQL; a schema without the paused-queues table (a
/// database not yet upgraded) is reported by `validate_schema` as needing the upgrade, and
/// `migrate` adds it back.
#[tokio::test]
async fn bad_input_and_a_missing_paused_table() {
    let f = Fixture::new().await;
    let mut conn = f.pool.acquire().await.unwrap();
    for bad in ["", &"q".repeat(256), "a\0b"] {
        let e = f.outbox.pause_queue(&mut conn, bad).await.unwrap_err();
        assert!(
            matches!(e, Error::InvalidArgument { field: "queue", .. }),
            "{e:?}"
        );
    }
    let e = f.outbox.run_now(&mut conn, -1).await.unwrap_err();
    assert!(
        matches!(e, Error::InvalidArgument { field: "id", .. }),
        "{e:?}"
    );
    let e = f
        .outbox
        .reschedule(&mut conn, 1, Schedule::after(Duration::MAX))
        .await
        .unwrap_err();
    assert!(
        matches!(
            e,
            Error::InvalidArgument {
                field: "schedule",
                ..
            }
        ),
        "{e:?}"
    );

    conn.execute(AssertSqlSafe(format!(
        "DROP TABLE {}",
        f.outbox.paused_table()
    )))
    .await
    .unwrap();
    let problems = match f.outbox.validate_schema(&f.pool).await {
        Err(Error::SchemaMismatch { problems }) => problems,
        other => panic!("expected a schema mismatch, got {other:?}"),
    };
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert!(problems[0].object.ends_with("_paused"), "{problems:?}");
    assert!(problems[0].needs_upgrade, "{problems:?}");
    // Every claim reads the table: without it a claim names the upgrade, not a bare SQL error.
    let queues = [Job::QUEUE.to_owned()];
    let e = f
        .store
        .claim(ClaimRequest::new(&queues, 10, Duration::from_secs(30)))
        .await
        .unwrap_err();
    assert!(matches!(e, Error::UpgradeRequired { .. }), "{e:?}");
    assert!(
        e.to_string()
            .contains("Outbox::migrate` with this outbox's settings"),
        "{e}"
    );
    f.outbox.migrate(&f.pool).await.unwrap();
    f.outbox.validate_schema(&f.pool).await.unwrap();
    assert!(f.outbox.pause_queue(&mut conn, "q").await.unwrap());
    drop(conn);
    f.cleanup().await;
}
