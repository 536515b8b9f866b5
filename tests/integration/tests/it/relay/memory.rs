//! The relay's decisions without a broker, on `MemoryStore` with `run_due`: a sink that is
//! unavailable gets its rows given back untouched (no delivery counted, nothing
//! dead-lettered) and its queue left alone while the circuit is open; a sink that rejects
//! a message gets it retried and then dead-lettered with the reason; a confirm acks.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::future::BoxFuture;
use outbox::dlq::DeadLetterFilter;
use outbox::relay::{BrokerMessage, Relay, Sink, SinkError};

use outbox::testing::MemoryStore;
use outbox::{Message, Publisher, RetryStrategy, Worker};

/// Answers each publish with the next scripted answer (a confirm once the script is out),
/// rejects one payload always, and records what it was asked to publish.
#[derive(Clone, Default)]
struct Scripted {
    answers: Arc<Mutex<VecDeque<Result<(), SinkError>>>>,
    seen: Arc<Mutex<Vec<BrokerMessage>>>,
    /// Every message with this payload is rejected.
    reject: Option<&'static [u8]>,
}

impl Scripted {
    fn answer(&self, a: Result<(), SinkError>) {
        self.answers.lock().unwrap().push_back(a);
    }
    fn seen(&self) -> Vec<BrokerMessage> {
        self.seen.lock().unwrap().clone()
    }
}

impl Sink for Scripted {
    fn publish(&self, message: BrokerMessage) -> BoxFuture<'static, Result<(), SinkError>> {
        let answer = if self.reject == Some(message.payload.as_slice()) {
            Err(SinkError::Rejected("message too large".into()))
        } else {
            self.answers.lock().unwrap().pop_front().unwrap_or(Ok(()))
        };
        self.seen.lock().unwrap().push(message);
        Box::pin(async move { answer })
    }
}

async fn publish(store: &MemoryStore, payload: &[u8]) -> i64 {
    store
        .publish_message(Message::new("events", payload))
        .await
        .unwrap()
        .id()
        .unwrap()
}

#[tokio::test(start_paused = true)]
async fn an_unavailable_sink_gives_rows_back_and_pauses_the_queue_until_its_probe() {
    let store = MemoryStore::new().with_dead_letter(true);
    let sink = Scripted::default();
    let worker = Worker::builder(store.clone())
        .relay(["events"], Relay::new(sink.clone()).max_deliveries(1))
        .build()
        .unwrap();
    let id = publish(&store, b"a").await;
    sink.answer(Err(SinkError::Unavailable("connection refused".into())));
    let ran = worker.run_due().await.unwrap();
    assert!(ran.is_empty(), "a row given back is not a run: {ran:?}");
    let rows = store.rows();
    assert_eq!(rows.len(), 1);
    assert_eq!(
        (rows[0].deliveries_count, rows[0].attempts_count),
        (0, 0),
        "{rows:?}"
    );
    assert!(rows[0].acquired_token.is_none(), "pending again");
    // The circuit is open: the queue is not claimed, however often the worker looks, and
    // max_deliveries(1) is never reached.
    for _ in 0..5 {
        assert!(worker.run_due().await.unwrap().is_empty());
    }
    assert_eq!(sink.seen().len(), 1, "no publish while the circuit is open");
    // After the back-off, one probe; its confirm closes the circuit and the row is acked.
    tokio::time::advance(Duration::from_secs(3)).await;
    let ran = worker.run_due().await.unwrap();
    assert_eq!(ran.len(), 1, "{ran:?}");
    assert_eq!(ran[0].delivery.lease.id, id);
    assert!(store.rows().is_empty());
    let seen = sink.seen();
    assert_eq!(seen.len(), 2);
    assert_eq!(
        seen[0].message_id, seen[1].message_id,
        "the same id on the second try"
    );
    assert!(
        seen[1].message_id.starts_with(&format!("memory:{id}:")),
        "{}",
        seen[1].message_id
    );
    assert!(store
        .dead_letters(&DeadLetterFilter::new(), None, 10)
        .unwrap()
        .is_empty());
}

#[tokio::test(start_paused = true)]
async fn a_rejected_message_is_retried_then_dead_lettered_with_the_reason() {
    let store = MemoryStore::new().with_dead_letter(true);
    let sink = Scripted {
        reject: Some(b"big"),
        ..Scripted::default()
    };
    let worker = Worker::builder(store.clone())
        .relay(
            ["events"],
            Relay::new(sink.clone()).retry(RetryStrategy::constant(Duration::ZERO).max_attempts(3)),
        )
        .build()
        .unwrap();
    publish(&store, b"big").await;
    let other = publish(&store, b"small").await;
    let ran = worker.run_due().await.unwrap();
    // The rejections do not open the circuit: the other row is published meanwhile.
    assert!(ran.iter().any(|d| d.delivery.lease.id == other));
    assert!(store.rows().is_empty(), "{:?}", store.rows());
    let dead = store
        .dead_letters(&DeadLetterFilter::new(), None, 10)
        .unwrap();
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(dead[0].payload, b"big");
    assert_eq!(dead[0].failure_reason, "retry_exhausted");
    assert_eq!(dead[0].attempts_count, 3);
    assert!(
        dead[0]
            .last_error
            .as_deref()
            .is_some_and(|e| e.contains("message too large")),
        "{dead:?}"
    );
}
