//! The virtual-time harness (SPEC §10): `Worker::run_due` over `MemoryStore`, no database,
//! and the same call draining a Postgres store.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use outbox::testing::MemoryStore;
use outbox::{
    store::{Completion, FailureReason},
    worker::Decision,
    Context, HandlerOptions, Message, Publisher, RetryStrategy, Worker,
};
use outbox_tests::{count_runs, Fixture};

#[outbox::timer(queue = "reminders", max_deliveries = 3)]
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
struct Reminder {
    n: u32,
}

#[tokio::test]
async fn run_due_runs_exactly_what_is_due_at_the_virtual_time() {
    let store = MemoryStore::new().with_dead_letter(true);
    let runs = Arc::new(AtomicUsize::new(0));
    let worker = {
        let (runs, store) = (runs.clone(), store.clone());
        Worker::builder(store.clone())
            .timer_with::<Reminder>(
                move |r: Reminder, ctx: Context| {
                    let (runs, store) = (runs.clone(), store.clone());
                    async move {
                        runs.fetch_add(1, Ordering::SeqCst);
                        match r.n {
                            // Extends itself once, by 10 s, on its first run.
                            0 => {
                                let next = Reminder { n: 100 };
                                extend_reminder(&store, "self", &next, Duration::from_secs(10))
                                    .await?;
                                Ok(())
                            }
                            // Fails twice with a zero-delay retry, then succeeds.
                            1 if ctx.attempt() < 3 => Err(outbox::Error::InvalidArgument {
                                field: "n",
                                reason: "flaky".into(),
                            }),
                            _ => Ok(()),
                        }
                    }
                },
                HandlerOptions::new().retry(RetryStrategy::constant(Duration::ZERO)),
            )
            .build()
            .unwrap()
    };
    publish_reminder(&store, "self", &Reminder { n: 0 }, Duration::from_secs(5))
        .await
        .unwrap();
    publish_reminder(&store, "flaky", &Reminder { n: 1 }, Duration::from_secs(5))
        .await
        .unwrap();
    store
        .publish_message(Message::new("reminders", b"not json").schedule(Duration::from_secs(5)))
        .await
        .unwrap();

    assert!(
        worker.run_due().await.unwrap().is_empty(),
        "nothing is due before 5 s"
    );
    store.advance(Duration::from_secs(5));
    let ran = worker.run_due().await.unwrap();
    // "self" once (rearmed, pending at +10 s), "flaky" three times (zero-delay retries run
    // in the same call), the undecodable row once (dead-lettered, handler not run).
    let decisions: Vec<(Option<&str>, &Decision)> = ran
        .iter()
        .map(|r| (r.delivery.timer_id.as_deref(), &r.decision))
        .collect();
    assert_eq!(ran.len(), 5, "{decisions:#?}");
    assert_eq!(runs.load(Ordering::SeqCst), 4);
    let selfie = ran
        .iter()
        .find(|r| r.delivery.timer_id.as_deref() == Some("self"))
        .unwrap();
    assert!(
        matches!(selfie.completion, Completion::Rearmed { .. }),
        "{selfie:?}"
    );
    assert!(ran.iter().any(|r| matches!(
        &r.decision,
        Decision::Fail {
            reason: FailureReason::DecodeError,
            ..
        }
    )));
    assert_eq!(store.rows().len(), 1, "only the rearmed timer is left");
    assert_eq!(store.dead_letter_rows().len(), 1);

    assert!(
        worker.run_due().await.unwrap().is_empty(),
        "not due again before its new deadline"
    );
    store.advance(Duration::from_secs(10));
    let ran = worker.run_due().await.unwrap();
    assert_eq!(ran.len(), 1);
    assert_eq!(ran[0].completion, Completion::Deleted);
    assert!(store.rows().is_empty());
}

#[tokio::test]
async fn run_due_drains_a_postgres_store() {
    let f = Fixture::new().await;
    let runs = Arc::new(AtomicUsize::new(0));
    let worker = Worker::builder(f.store.clone())
        .fetch_batch_size(7)
        .timer::<Reminder>(count_runs::<Reminder>(&runs))
        .build()
        .unwrap();
    let mut conn = f.pool.acquire().await.unwrap();
    for n in 0..20 {
        publish_reminder(
            &mut f.outbox.on(&mut conn),
            &n.to_string(),
            &Reminder { n },
            Duration::ZERO,
        )
        .await
        .unwrap();
    }
    publish_reminder(
        &mut f.outbox.on(&mut conn),
        "later",
        &Reminder { n: 99 },
        Duration::from_secs(3600),
    )
    .await
    .unwrap();
    let ran = worker.run_due().await.unwrap();
    assert_eq!(ran.len(), 20);
    assert!(ran.iter().all(|r| r.completion == Completion::Deleted));
    assert_eq!(runs.load(Ordering::SeqCst), 20);
    assert_eq!(f.rows("reminders").await.len(), 1, "the future timer stays");
    f.cleanup().await;
}

/// SPEC §7.9 on the in-memory store: a handler that asks for its own transaction gets a
/// typed refusal (the store has no database to run its SQL), never a pretend success; the
/// run fails like any handler error, and the harness reports it.
#[tokio::test]
async fn a_transaction_on_the_memory_store_is_refused_with_a_typed_error() {
    let store = MemoryStore::new().with_dead_letter(true);
    let refusals = Arc::new(std::sync::Mutex::new(Vec::new()));
    let worker = {
        let refusals = refusals.clone();
        Worker::builder(store.clone())
            .timer_with::<Reminder>(
                move |_: Reminder, ctx: Context| {
                    let refusals = refusals.clone();
                    async move {
                        let err = ctx.begin().await.unwrap_err();
                        refusals.lock().unwrap().push(err.to_string());
                        assert!(
                            matches!(err, outbox::Error::TransactionUnavailable { .. }),
                            "{err:?}"
                        );
                        Err::<(), _>(err)
                    }
                },
                HandlerOptions::new().retry(RetryStrategy::none()),
            )
            .build()
            .unwrap()
    };
    publish_reminder(&store, "r", &Reminder { n: 1 }, Duration::ZERO)
        .await
        .unwrap();
    let ran = worker.run_due().await.unwrap();
    assert_eq!(ran.len(), 1);
    assert!(
        matches!(
            &ran[0].decision,
            Decision::Fail { reason: FailureReason::RetryExhausted, error: Some(e) }
                if e.contains("no handler transaction")
        ),
        "{:?}",
        ran[0].decision
    );
    assert_eq!(refusals.lock().unwrap().len(), 1);
    assert!(refusals.lock().unwrap()[0].contains("in-memory store"));
}
