//! The relay: a worker forwards the messages of some queues to a message broker and
//! completes each row only once the broker confirmed it.
//!
//! ```no_run
//! # #[cfg(feature = "relay-nats")]
//! # async fn f(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
//! use outbox::relay::{self, Subject};
//! use outbox::{Outbox, PgStore, Worker};
//!
//! let nats = async_nats::connect("127.0.0.1:4222").await?;
//! let jetstream = async_nats::jetstream::new(nats);
//! let worker = Worker::builder(PgStore::new(pool, Outbox::default()))
//!     .concurrency(64)
//!     .relay(["orders"], relay::nats(jetstream, Subject::from_queue("outbox.")))
//!     .build()?
//!     .start();
//! # drop(worker);
//! # Ok(()) }
//! ```
//!
//! # What a relayed message carries
//!
//! - the **payload** bytes as stored, unchanged;
//! - the row's **headers** as broker headers (AMQP: message headers; NATS: message
//!   headers), `traceparent` and `tracestate` among them when the publisher wrote them
//!   (feature `opentelemetry`);
//! - a **message id** stable across every redelivery of the same row
//!   ([`BrokerMessage::message_id`], [`message_id`]): `<table>:<id>:<created>` for a
//!   message, `<table>:<id>:<created>:<deadline>` for a keyed timer (whose row is used
//!   again for its next firing), instants in µs since the epoch. The row's creation instant
//!   keeps two rows apart that share a table name and an id: two services' default
//!   `outbox` tables relaying into one stream, or a table whose identity was restarted
//!   (`TRUNCATE … RESTART IDENTITY`); without it the broker would take the second row for a
//!   duplicate of the first and drop it. JetStream receives it as `Nats-Msg-Id`, AMQP as the
//!   `message_id` property.
//!
//! # When a row is completed
//!
//! A row is acknowledged (deleted, through the worker's batched acks) only after the
//! broker confirmed its message: JetStream's publish ack, RabbitMQ's publisher confirm. Every
//! handler slot of the worker ([`WorkerBuilder::concurrency`]) has one publish in flight,
//! so `concurrency` publishes are pipelined on one connection and their confirms awaited
//! together; nothing waits for one round trip per row.
//!
//! | the broker | the row |
//! |---|---|
//! | confirmed | acked (deleted) |
//! | rejected the message itself ([`SinkError::Rejected`]: too large, no route with `mandatory`, a nack) | a failed run: retried per [`Relay::retry`], then dead-lettered (`retry_exhausted`, `last_error` the broker's reason; `max_deliveries` instead when [`Relay::max_deliveries`] runs out before the retries do, see there) |
//! | unavailable ([`SinkError::Unavailable`]: connection refused or lost, no stream, no confirm within [`Relay::publish_timeout`], no connection within [`Relay::connect_timeout`]) | given back untouched: pending at its deadline, its delivery not counted, nothing dead-lettered; the relay's **circuit** opens |
//!
//! While the circuit is open the worker claims nothing of the relay's queues (its other
//! queues go on). After a back-off (100 ms, doubling per failed probe, at most 2 s) it
//! claims one row to probe the broker; the probe's confirm closes the circuit and claims
//! resume at once. So once the broker is back, messages flow again within the back-off plus
//! the client's own reconnect delay.
//!
//! # Delivery guarantee
//!
//! At least once, always: a relay that crashes between the broker's confirm and the ack's
//! commit leaves the row leased; once the lease expires it is published again with the
//! **same message id**.
//!
//! - **JetStream**: the stream drops a message whose `Nats-Msg-Id` it has seen within its
//!   duplicate window (`duplicate_window` of the stream, 2 min by default) and acks it as a
//!   duplicate, so the stream holds each row's message **once**, provided the redelivery
//!   comes within the window: set the window longer than the worker's `lease_ttl` plus the
//!   longest outage you want covered. A consumer of the stream still sees a message twice
//!   when its own acks are lost (JetStream's consumer redelivery): de-duplicate by
//!   `Nats-Msg-Id` there if that matters.
//! - **RabbitMQ** (no de-duplication in the broker): the same crash delivers the message
//!   **at most once more** per crash, with the same `message_id`; consumers de-duplicate
//!   by `message_id`.
//!
//! # Ordering
//!
//! Rows of one keyed timer are relayed in order by construction: a timer key has one live
//! row, and its next firing (a rearm) is applied only by the ack of the current one. Other
//! messages are relayed in parallel, in no promised order, unless the relay is ordered by a
//! header ([`Relay::ordered_by_header`]): then the messages of one key reach the broker in
//! commit order, each published once the one before it was confirmed, and different keys
//! in parallel.
// SPEC §14: the relay.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;

use crate::error::{Error, Result};
use crate::message::Headers;
use crate::store::Store;
use crate::worker::builder::WorkerBuilder;
use crate::worker::circuit::Circuit;
use crate::worker::decide::Route;
use crate::worker::handler::{Context, HandlerOptions, Outcome};
use crate::worker::retry::RetryStrategy;

#[cfg(feature = "relay-amqp")]
mod amqp;
#[cfg(feature = "relay-nats")]
mod nats;

#[cfg(feature = "relay-amqp")]
pub use self::amqp::{amqp, AmqpSink, RoutingKey};
#[cfg(feature = "relay-nats")]
pub use self::nats::{nats, NatsSink, Subject};

/// How long a relay waits for the broker's confirm of one message unless set otherwise
/// ([`Relay::publish_timeout`]): 10 s.
pub const DEFAULT_PUBLISH_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a relay lets its sink open a connection unless set otherwise
/// ([`Relay::connect_timeout`]): 5 s.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// One message as a [`Sink`] publishes it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct BrokerMessage {
    /// The queue the row was published to.
    pub queue: String,
    /// The row id.
    pub id: i64,
    /// The timer key, for a keyed timer.
    pub timer_id: Option<String>,
    /// The id stable across redeliveries of this row (see the [module docs](self)).
    pub message_id: String,
    /// The stored payload, unchanged.
    pub payload: Vec<u8>,
    /// The stored headers (empty when the row has none).
    pub headers: Headers,
}

/// The message id of a row (see the [module docs](self)): `<table>:<id>:<created>`, and
/// for a keyed timer `:<deadline>` after it (µs since the epoch). `table` is the queue
/// table's name, `created` the row's `created_at`, `timer_deadline` the deadline of a keyed
/// timer's firing (`None` for a message).
pub fn message_id(
    table: &str,
    id: i64,
    created: chrono::DateTime<chrono::Utc>,
    timer_deadline: Option<chrono::DateTime<chrono::Utc>>,
) -> String {
    let created = created.timestamp_micros();
    match timer_deadline {
        None => format!("{table}:{id}:{created}"),
        Some(d) => format!("{table}:{id}:{created}:{}", d.timestamp_micros()),
    }
}

impl BrokerMessage {
    /// The message of the row `id` of `queue` with the id `message_id` (from
    /// [`message_id`]).
    pub fn new(
        queue: &str,
        id: i64,
        timer_id: Option<&str>,
        message_id: String,
        payload: Vec<u8>,
        headers: Headers,
    ) -> Self {
        BrokerMessage {
            queue: queue.to_owned(),
            id,
            timer_id: timer_id.map(str::to_owned),
            message_id,
            payload,
            headers,
        }
    }
}

/// Why a [`Sink`] did not publish a message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SinkError {
    /// The broker is not reachable or not serving (connection refused or lost, no stream
    /// for the subject, no confirm): not the message's fault. The row is given back without
    /// counting a delivery and the relay's circuit opens.
    #[error("broker unavailable: {0}")]
    Unavailable(String),
    /// The broker refused this message (too large, no route with `mandatory`, a nack): the
    /// row is a failed run, retried per the relay's strategy and then dead-lettered with
    /// this text.
    #[error("broker rejected the message: {0}")]
    Rejected(String),
}

/// Where a relay publishes: implemented by [`NatsSink`] (feature `relay-nats`) and
/// [`AmqpSink`] (feature `relay-amqp`), and by your own type for another broker.
pub trait Sink: Send + Sync + 'static {
    /// Publishes `message`; the future completes once the broker **confirmed** it (or
    /// refused it, or is found unavailable). Calls run concurrently, one per handler slot:
    /// send at once and await the confirm in the future, so that publishes pipeline. The
    /// relay bounds each call by [`Relay::publish_timeout`] (a call still pending then is
    /// [`SinkError::Unavailable`]).
    fn publish(&self, message: BrokerMessage) -> BoxFuture<'static, Result<(), SinkError>>;

    /// Makes the sink ready to publish: opens its connection (and channel) when it has none,
    /// and completes at once when it has one. The relay awaits it before each publish,
    /// bounded by [`Relay::connect_timeout`] (not by the publish timeout, so a short publish
    /// timeout never cuts a connect short); an error or the timeout is the broker being
    /// unavailable. The default is ready at once (a sink over a connection the caller opened,
    /// as [`NatsSink`]).
    fn connect(&self) -> BoxFuture<'static, Result<(), SinkError>> {
        Box::pin(async { Ok(()) })
    }

    /// Checks the sink's own settings (a subject, a URI, an exchange, a routing key), when
    /// the relay is registered: a refusal is [`Error::InvalidConfig`] (knob `relay`) from
    /// the worker's `build()`, before any broker call, rather than every message failing at
    /// run time. The default accepts.
    ///
    /// # Errors
    /// The rule a setting breaks, in words.
    fn check(&self) -> std::result::Result<(), String> {
        Ok(())
    }

    /// Checks that the sink can publish the messages of `queue` (a subject or routing key
    /// it derives from the queue name is valid), when the relay is registered: a refusal is
    /// [`Error::InvalidConfig`] (knob `relay`) from the worker's `build()`, before any
    /// broker call. The default accepts every queue.
    ///
    /// # Errors
    /// The rule the queue name breaks, in words.
    fn check_queue(&self, queue: &str) -> std::result::Result<(), String> {
        let _ = queue;
        Ok(())
    }
}

/// A sink with the relay's settings: what [`WorkerBuilder::relay`] takes (every [`Sink`]
/// converts into one with the defaults).
#[derive(Clone)]
#[must_use = "a Relay does nothing until given to `WorkerBuilder::relay`"]
pub struct Relay {
    sink: Arc<dyn Sink>,
    publish_timeout: Duration,
    connect_timeout: Duration,
    retry: RetryStrategy,
    max_deliveries: Option<u32>,
    ordered_by: Option<String>,
}

impl fmt::Debug for Relay {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Relay")
            .field("publish_timeout", &self.publish_timeout)
            .field("connect_timeout", &self.connect_timeout)
            .field("retry", &self.retry)
            .field("max_deliveries", &self.max_deliveries)
            .field("ordered_by", &self.ordered_by)
            .finish_non_exhaustive()
    }
}

impl<T: Sink> From<T> for Relay {
    fn from(sink: T) -> Self {
        Relay::new(sink)
    }
}

impl Relay {
    /// A relay to `sink` with the defaults: [`DEFAULT_PUBLISH_TIMEOUT`],
    /// [`DEFAULT_CONNECT_TIMEOUT`],
    /// [`RetryStrategy::default`] for messages the broker rejects, `max_deliveries` of raw
    /// queues ([`DEFAULT_MAX_DELIVERIES`](crate::worker::DEFAULT_MAX_DELIVERIES)).
    pub fn new(sink: impl Sink) -> Self {
        Relay {
            sink: Arc::new(sink),
            publish_timeout: DEFAULT_PUBLISH_TIMEOUT,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            retry: RetryStrategy::default(),
            max_deliveries: None,
            ordered_by: None,
        }
    }

    /// How long to wait for the broker's confirm of one message (default 10 s, range
    /// 1 ms..=10 min, checked by the worker's `build()`). A confirm that does not come in
    /// time counts as the broker being unavailable: the row is given back and the circuit
    /// opens. A client's own publish-ack timeout (async-nats' context `timeout`) that is
    /// shorter ends the wait first, with the same effect. It does not bound opening the
    /// sink's connection ([`Relay::connect_timeout`] does).
    pub fn publish_timeout(mut self, timeout: Duration) -> Self {
        self.publish_timeout = timeout;
        self
    }

    /// How long the sink may take to open its connection ([`Sink::connect`]; the AMQP
    /// sink's connection, channel and `confirm.select`), default 5 s, range 1 ms..=10 min,
    /// checked by the worker's `build()`. A connect that does not finish in time counts as
    /// the broker being unavailable: the row is given back and the circuit opens. Kept apart
    /// from the [publish timeout](Relay::publish_timeout) so that a publish timeout of a few
    /// milliseconds (a confirm on a local broker) does not cut every connect short.
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// The retry strategy for messages the broker rejects (default
    /// [`RetryStrategy::default`]); when it gives up the row is dead-lettered with the
    /// broker's reason.
    pub fn retry(mut self, retry: RetryStrategy) -> Self {
        self.retry = retry;
        self
    }

    /// Claims allowed before a row is dead-lettered (`max_deliveries`, default
    /// [`DEFAULT_MAX_DELIVERIES`](crate::worker::DEFAULT_MAX_DELIVERIES)). Rows given back
    /// during an outage do not count; a relay that crashes with the row leased does. When
    /// this runs out before the [`Relay::retry`] strategy gives up (a strategy without an
    /// attempt limit, or fewer deliveries than attempts), the dead letter's reason is
    /// `max_deliveries` and its `last_error` counts the deliveries: the broker's reason is
    /// only in the log line of each failed run (INFO, `outbox: handler failed; retry
    /// scheduled`), since the queue row keeps no error between runs.
    pub fn max_deliveries(mut self, max: u32) -> Self {
        self.max_deliveries = Some(max);
        self
    }

    /// Relays the messages of one key in commit order: the key is the value of the message
    /// header `header`, and a message is published only once no message of its queue with
    /// the same key and a lower row id is left in the queue table (pending, in flight, or
    /// waiting for a retry after a rejection). So a key's messages never overtake each other,
    /// across retries, outages and any number of relay processes; different keys flow in
    /// parallel, and messages without the header are not held back. Commit order is id
    /// order for the transactions of one key that follow each other (a lower id still
    /// uncommitted is invisible, and does not hold a later one back: transactions of one
    /// key that commit concurrently have no order to keep).
    ///
    /// A key's messages go one at a time. A claim takes a key's earliest message and the due
    /// messages right after it together (a **run**, at most `fetch_batch_size` rows), and
    /// the relay publishes a run's messages one after another, each once the broker
    /// confirmed the one before it, so one key's rate is bounded by one publish round trip
    /// per message. A message the broker rejects (or cannot take: an outage) ends its run:
    /// the messages after it are given back untouched, and it holds its key's later
    /// messages back until it is published or dead-lettered. After a crash, a message already published may be published again
    /// (same message id) after its successors were: JetStream drops it within its duplicate
    /// window; on RabbitMQ a consumer that de-duplicates by `message_id` sees the order kept.
    ///
    /// Claims check each due row against the rows before it of the same key: on a large
    /// backlog give the table an index for the header,
    /// `CREATE INDEX CONCURRENTLY ON <table> (queue, (headers ->> 'header'), id) WHERE headers ? 'header'`.
    /// While the worker has messages of the queue in flight, a publish to it does not make
    /// the worker claim at once (the notification does not name the key, and a claim then
    /// reads the rows waiting behind the runs): it claims at the end of a run, or within a
    /// second. A message of a key with nothing in flight waits that long at most.
    /// Needs a [`PgStore`](crate::PgStore) over an outbox that is not distributed; `build()`
    /// refuses it otherwise ([`Error::InvalidConfig`], knob `relay`), and for a header name
    /// that is empty or longer than 255 bytes. [`Worker::run_due`](crate::Worker::run_due)
    /// keeps the order too: it claims the relay's queues with the same statement and runs
    /// each run's rows in order.
    pub fn ordered_by_header(mut self, header: impl Into<String>) -> Self {
        self.ordered_by = Some(header.into());
        self
    }

    fn check(&self) -> Result<()> {
        for (name, t) in [
            ("publish_timeout", self.publish_timeout),
            ("connect_timeout", self.connect_timeout),
        ] {
            if t < Duration::from_millis(1) || t > Duration::from_secs(600) {
                return Err(Error::config(
                    "relay",
                    format!("{name} must be within 1ms..=10 min, got {t:?}"),
                ));
            }
        }
        self.sink
            .check()
            .map_err(|reason| Error::config("relay", reason))?;
        if let Some(h) = &self.ordered_by {
            if h.is_empty() || h.len() > 255 || h.contains('\0') {
                return Err(Error::config(
                    "relay",
                    "ordered_by_header: the header name must be 1..=255 bytes without NUL",
                ));
            }
        }
        Ok(())
    }
}

/// One relay's runs: publish, classify, tell the circuit.
struct Run {
    sink: Arc<dyn Sink>,
    table: String,
    publish_timeout: Duration,
    connect_timeout: Duration,
    circuit: Arc<Circuit>,
}

impl Run {
    async fn relay<St>(&self, payload: Vec<u8>, ctx: &Context<St>) -> Outcome {
        let id = ctx.id();
        if self.circuit.is_open() {
            // Buffered before the circuit opened: back without a try.
            self.circuit.unavailable(id, "the relay's circuit is open");
            return Outcome::Retry("broker unavailable".to_owned());
        }
        // The connect has its own bound: under the publish timeout a slow connect (TLS, a
        // remote broker) would be cut short on every try and never finish.
        let reason = match tokio::time::timeout(self.connect_timeout, self.sink.connect()).await {
            Ok(Ok(())) => None,
            Ok(Err(SinkError::Unavailable(r) | SinkError::Rejected(r))) => Some(r),
            Err(_) => Some(format!(
                "no connection within the connect timeout ({:?})",
                self.connect_timeout
            )),
        };
        if let Some(reason) = reason {
            self.circuit.unavailable(id, &reason);
            return Outcome::Retry(format!("broker unavailable: {reason}"));
        }
        let firing = ctx.timer_id().map(|_| ctx.deadline());
        let message = BrokerMessage::new(
            ctx.queue(),
            id,
            ctx.timer_id(),
            message_id(&self.table, id, ctx.created_at(), firing),
            payload,
            ctx.headers().cloned().unwrap_or_default(),
        );
        let published = tokio::time::timeout(self.publish_timeout, self.sink.publish(message));
        match published.await {
            Ok(Ok(())) => {
                self.circuit.available();
                Outcome::Ack
            }
            Ok(Err(SinkError::Rejected(reason))) => {
                // The broker answered: it works, the message is at fault.
                self.circuit.available();
                Outcome::Retry(format!("broker rejected the message: {reason}"))
            }
            Ok(Err(SinkError::Unavailable(reason))) => {
                self.circuit.unavailable(id, &reason);
                Outcome::Retry(format!("broker unavailable: {reason}"))
            }
            Err(_) => {
                let reason = format!(
                    "no confirm within the publish timeout ({:?})",
                    self.publish_timeout
                );
                self.circuit.unavailable(id, &reason);
                Outcome::Retry(reason)
            }
        }
    }
}

impl<S: Store, St: Send + Sync + 'static> WorkerBuilder<S, St> {
    /// Relays the messages of `queues` to a broker: each row is published to `relay`'s sink
    /// and acked once the broker confirmed it (the [`relay`](crate::relay) module says what
    /// the message carries, what a rejection and an outage do, and the guarantee per
    /// broker). Give the worker a [`concurrency`](Self::concurrency) of 32 or more: each
    /// handler slot keeps one publish in flight. The queues count as handled: another
    /// handler (or relay) for one of them is [`Error::DuplicateHandler`] from `build()`.
    ///
    /// Checked by [`build`](Self::build): at least one queue
    /// ([`Error::InvalidConfig`], knob `relay`), each a valid queue name
    /// ([`Error::InvalidArgument`]) that the sink accepts ([`Sink::check_queue`]; knob
    /// `relay`), the sink's settings ([`Sink::check`]: a subject, an AMQP URI, an exchange,
    /// a routing key; knob `relay`) and the relay's own (knob `relay`), all before any
    /// broker call.
    pub fn relay<Q: Into<String>>(
        self,
        queues: impl IntoIterator<Item = Q>,
        relay: impl Into<Relay>,
    ) -> Self {
        let relay: Relay = relay.into();
        let queues: Vec<String> = queues.into_iter().map(Into::into).collect();
        self.push_route(move |store, state| {
            relay.check()?;
            if relay.ordered_by.is_some() && !store.claims_in_order() {
                return Err(crate::store::in_order_unsupported());
            }
            if queues.is_empty() {
                return Err(Error::config("relay", "give the relay at least one queue"));
            }
            let circuit = Arc::new(Circuit::default());
            let run = Arc::new(Run {
                sink: relay.sink.clone(),
                table: store.queue_table_name(),
                publish_timeout: relay.publish_timeout,
                connect_timeout: relay.connect_timeout,
                circuit: circuit.clone(),
            });
            // A safety net above the run's own bounds (connect, then publish).
            let mut options = HandlerOptions::new().retry(relay.retry).timeout(
                relay.publish_timeout.saturating_mul(2)
                    + relay.connect_timeout
                    + Duration::from_secs(1),
            );
            if let Some(max) = relay.max_deliveries {
                options = options.max_deliveries(max);
            }
            let mut routes = Vec::with_capacity(queues.len());
            for queue in queues {
                crate::message::validate_queue(&queue)?;
                relay.sink.check_queue(&queue).map_err(|reason| {
                    Error::config("relay", format!("queue `{queue}`: {reason}"))
                })?;
                let run = run.clone();
                let handler = move |payload: Vec<u8>, ctx: Context<St>| {
                    let run = run.clone();
                    async move { run.relay(payload, &ctx).await }
                };
                let mut route = Route::raw(queue, handler, state.clone(), options);
                route.name = "relay".to_owned();
                route.circuit = Some(circuit.clone());
                route.ordered_by.clone_from(&relay.ordered_by);
                routes.push(route);
            }
            Ok(routes)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn message_ids_are_stable_per_row_and_per_firing_of_a_timer() {
        let created = chrono::DateTime::from_timestamp_micros(1_700_000_000_000_001).unwrap();
        let at = chrono::DateTime::from_timestamp_micros(1_700_000_000_123_456).unwrap();
        assert_eq!(
            message_id("outbox", 7, created, None),
            "outbox:7:1700000000000001"
        );
        assert_eq!(
            message_id("app.t", 7, created, Some(at)),
            "app.t:7:1700000000000001:1700000000123456"
        );
        // Another row with the same table name and id (another database's `outbox`, or
        // an identity restarted): another id, so the broker does not drop it.
        let later = created + chrono::TimeDelta::microseconds(1);
        assert_ne!(
            message_id("outbox", 7, created, None),
            message_id("outbox", 7, later, None)
        );
    }
}
