//! The relay against the real brokers of the machine (SPEC §14): NATS JetStream on
//! `NATS_URL` (default `127.0.0.1:4222`) and RabbitMQ on `AMQP_URL` (default
//! `amqp://guest:guest@127.0.0.1:5672/%2f`). Every test makes its own stream, exchange and
//! queues (unique names) and removes them; an outage is played by a TCP proxy between the
//! relay and the broker, never by stopping the broker. A broker that cannot be reached
//! fails the test, as Postgres does.
//!
//! Time bounds derive from the configured values with a margin of at least 3×.

mod amqp;
mod memory;
mod nats;
mod runs;

use std::collections::BTreeMap;
use std::time::Duration;

use outbox::message::Headers;
use outbox::{Message, PgStore, Worker};
use outbox_tests::Fixture;

/// The NATS server the tests use.
fn nats_url() -> String {
    std::env::var("NATS_URL").unwrap_or_else(|_| "127.0.0.1:4222".to_owned())
}

/// The AMQP broker the tests use.
fn amqp_url() -> String {
    std::env::var("AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned())
}

/// A short unique name for a stream, subject, exchange or queue.
fn unique(prefix: &str) -> String {
    format!(
        "{prefix}_{}",
        &uuid::Uuid::new_v4().simple().to_string()[..10]
    )
}

/// A relay worker's builder with quick polling.
fn worker(store: PgStore) -> outbox::WorkerBuilder<PgStore> {
    Worker::builder(store)
        .concurrency(16)
        .fetch_batch_size(32)
        .idle_poll(Duration::from_millis(200))
}

/// Publishes `n` messages `m0`, `m1`, … to `queue`, each with `headers`; returns their ids.
async fn publish(f: &Fixture, queue: &str, n: usize, headers: &Headers) -> Vec<i64> {
    let mut conn = f.pool.acquire().await.unwrap();
    let mut ids = Vec::with_capacity(n);
    for i in 0..n {
        let payload = format!("m{i}");
        let published = f
            .outbox
            .publish(
                &mut conn,
                Message::new(queue, payload.as_bytes()).headers(headers),
            )
            .await
            .unwrap();
        ids.push(published.id().unwrap());
    }
    ids
}

fn headers(pairs: &[(&str, &str)]) -> Headers {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect::<BTreeMap<_, _>>()
}
