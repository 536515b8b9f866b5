//! The relay to RabbitMQ (AMQP 0-9-1, publisher confirms).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use lapin::options::{
    BasicGetOptions, ExchangeDeclareOptions, ExchangeDeleteOptions, QueueBindOptions,
    QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, Connection, ConnectionProperties, ExchangeKind};
use outbox::dlq::DeadLetterFilter;
use outbox::relay::{self, BrokerMessage, Relay, RoutingKey, Sink, SinkError};
use outbox::{PgStore, RetryStrategy};
use outbox_tests::{eventually, Fixture};

use super::{amqp_url, headers, publish, unique, worker};

/// A channel on the test broker, and a fresh direct exchange with one queue bound to it by
/// `key`.
async fn setup(key: &str) -> (Connection, Channel, String, String) {
    let url = amqp_url();
    let conn = Connection::connect(&url, ConnectionProperties::default())
        .await
        .unwrap_or_else(|e| {
            panic!("RabbitMQ at {url} cannot be reached ({e}): start rabbitmq-server")
        });
    let channel = conn.create_channel().await.unwrap();
    let exchange = unique("outbox_test_x");
    let queue = unique("outbox_test_q");
    channel
        .exchange_declare(
            exchange.as_str().into(),
            ExchangeKind::Direct,
            ExchangeDeclareOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    channel
        .queue_declare(
            queue.as_str().into(),
            QueueDeclareOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    channel
        .queue_bind(
            queue.as_str().into(),
            exchange.as_str().into(),
            key.into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    (conn, channel, exchange, queue)
}

/// Every message in `queue` (taken off it): (payload, message_id, headers, delivery mode).
async fn drain(channel: &Channel, queue: &str) -> Vec<(Vec<u8>, String, FieldTable, Option<u8>)> {
    let mut out = Vec::new();
    while let Some(m) = channel
        .basic_get(queue.into(), BasicGetOptions { no_ack: true })
        .await
        .unwrap()
    {
        let p = &m.delivery.properties;
        out.push((
            m.delivery.data.clone(),
            p.message_id()
                .as_ref()
                .map(|s| s.to_string())
                .unwrap_or_default(),
            p.headers().clone().unwrap_or_default(),
            *p.delivery_mode(),
        ));
    }
    out
}

async fn teardown(channel: &Channel, exchange: &str, queue: &str, f: Fixture) {
    let _ = channel
        .queue_delete(queue.into(), QueueDeleteOptions::default())
        .await;
    let _ = channel
        .exchange_delete(exchange.into(), ExchangeDeleteOptions::default())
        .await;
    f.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relays_with_publisher_confirms_message_id_headers_and_persistence() {
    let f = Fixture::new().await;
    let (_conn, channel, exchange, queue) = setup("orders").await;
    let traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    let ids = publish(&f, "orders", 5, &headers(&[("traceparent", traceparent)])).await;
    let running = worker(f.store.clone())
        .relay(["orders"], relay::amqp(amqp_url(), exchange.clone()))
        .build()
        .unwrap()
        .start();
    eventually(15, "every row relayed and acked", || async {
        f.rows("orders").await.is_empty()
    })
    .await;
    running.shutdown().await;
    let got = drain(&channel, &queue).await;
    assert_eq!(got.len(), 5);
    let table = f.outbox.table().replace('"', "");
    let mut seen: Vec<String> = Vec::new();
    for (payload, message_id, h, mode) in &got {
        assert!(payload.starts_with(b"m"), "payload unchanged");
        assert_eq!(*mode, Some(2), "persistent");
        let tp = h.inner().get("traceparent");
        assert!(
            matches!(tp, Some(AMQPValue::LongString(s)) if s.as_bytes() == traceparent.as_bytes()),
            "{tp:?}"
        );
        assert!(
            ids.iter()
                .any(|r| message_id.starts_with(&format!("{table}:{r}:"))),
            "{message_id}"
        );
        seen.push(message_id.clone());
    }
    seen.sort();
    seen.dedup();
    assert_eq!(seen.len(), 5, "one message id per row");
    teardown(&channel, &exchange, &queue, f).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unroutable_message_with_mandatory_is_retried_then_dead_lettered() {
    let f = Fixture::new().await;
    let (_conn, channel, exchange, queue) = setup("orders").await;
    publish(&f, "nowhere", 1, &headers(&[])).await;
    publish(&f, "orders", 1, &headers(&[])).await;
    let running = worker(f.store.clone())
        .relay(
            ["orders", "nowhere"],
            Relay::new(relay::amqp(amqp_url(), exchange.clone()).routing_key(RoutingKey::Queue))
                .retry(RetryStrategy::constant(Duration::from_millis(50)).max_attempts(3)),
        )
        .build()
        .unwrap()
        .start();
    eventually(15, "both rows done", || async {
        f.rows("orders").await.is_empty() && f.rows("nowhere").await.is_empty()
    })
    .await;
    running.shutdown().await;
    let dead = f
        .store
        .dead_letters(&DeadLetterFilter::new().queue("nowhere"), None, 10)
        .await
        .unwrap();
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(dead[0].failure_reason, "retry_exhausted");
    let reason = dead[0].last_error.as_deref().unwrap_or_default();
    assert!(
        reason.contains("NO_ROUTE") || reason.contains("312"),
        "the broker's reason: {reason}"
    );
    assert_eq!(
        drain(&channel, &queue).await.len(),
        1,
        "the routable one arrived"
    );
    teardown(&channel, &exchange, &queue, f).await;
}

/// A message above RabbitMQ's `max_message_size` (128 MiB by default) makes the broker close
/// the channel with 406 PRECONDITION_FAILED. That is the message's fault: it is retried and
/// dead-lettered, and the queue's other rows flow. (Found by a fresh user: it counted as an
/// outage, the row went back untouched for ever and the queue relayed nothing else.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_above_the_brokers_size_limit_is_dead_lettered_and_the_queue_flows() {
    let f = Fixture::new().await;
    let (_conn, channel, exchange, queue) = setup("orders").await;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO {} (queue, payload) VALUES ('orders', convert_to(repeat('y', 134217729 + 1024), 'UTF8'))",
        f.outbox.table()
    )))
    .execute(&f.pool)
    .await
    .unwrap();
    publish(&f, "orders", 3, &headers(&[])).await;
    let running = worker(f.store.clone())
        .relay(
            ["orders"],
            Relay::new(relay::amqp(amqp_url(), exchange.clone()).routing_key(RoutingKey::Queue))
                .retry(RetryStrategy::constant(Duration::from_millis(50)).max_attempts(2)),
        )
        .build()
        .unwrap()
        .start();
    eventually(60, "every row done", || async {
        f.rows("orders").await.is_empty()
    })
    .await;
    running.shutdown().await;
    let dead = f
        .store
        .dead_letters(&DeadLetterFilter::new().queue("orders"), None, 10)
        .await
        .unwrap();
    assert_eq!(dead.len(), 1, "the big one only");
    assert_eq!(dead[0].failure_reason, "retry_exhausted");
    let reason = dead[0].last_error.as_deref().unwrap_or_default();
    assert!(
        reason.contains("PRECONDITION"),
        "the broker's reason: {reason}"
    );
    assert_eq!(
        drain(&channel, &queue).await.len(),
        3,
        "the small ones arrived"
    );
    teardown(&channel, &exchange, &queue, f).await;
}

/// Publishes through AMQP, counts the confirms, and then never returns: a relay that
/// "dies" after the confirm and before its ack.
struct DiesAfterConfirm {
    inner: relay::AmqpSink,
    confirmed: Arc<AtomicUsize>,
}

impl Sink for DiesAfterConfirm {
    fn publish(&self, message: BrokerMessage) -> BoxFuture<'static, Result<(), SinkError>> {
        let publish = self.inner.publish(message);
        let confirmed = self.confirmed.clone();
        Box::pin(async move {
            publish.await?;
            confirmed.fetch_add(1, Ordering::SeqCst);
            std::future::pending().await
        })
    }
}

#[test]
fn a_crash_between_confirm_and_ack_delivers_at_most_one_duplicate_with_the_same_message_id() {
    const ROWS: usize = 10;
    let lease_ttl = Duration::from_secs(1);
    let main = tokio::runtime::Runtime::new().unwrap();
    let (f, conn, channel, exchange, queue) = main.block_on(async {
        let f = Fixture::new().await;
        let (conn, channel, exchange, queue) = setup("orders").await;
        publish(&f, "orders", ROWS, &headers(&[])).await;
        (f, conn, channel, exchange, queue)
    });
    let crashed = tokio::runtime::Runtime::new().unwrap();
    let confirmed = Arc::new(AtomicUsize::new(0));
    {
        let confirmed = confirmed.clone();
        let outbox = f.outbox.clone();
        let exchange = exchange.clone();
        crashed.block_on(async move {
            let pool = outbox_tests::pool().await;
            let sink = DiesAfterConfirm {
                inner: relay::amqp(amqp_url(), exchange),
                confirmed: confirmed.clone(),
            };
            let running = worker(PgStore::new(pool, outbox))
                .lease_ttl(lease_ttl)
                .relay(["orders"], Relay::new(sink))
                .build()
                .unwrap()
                .start();
            eventually(15, "every row confirmed", || async {
                confirmed.load(Ordering::SeqCst) == ROWS
            })
            .await;
            std::mem::forget(running);
        });
    }
    crashed.shutdown_background();
    main.block_on(async {
        let running = worker(f.store.clone())
            .lease_ttl(lease_ttl)
            .relay(["orders"], relay::amqp(amqp_url(), exchange.clone()))
            .build()
            .unwrap()
            .start();
        eventually(
            15,
            "the rows relayed again after their leases expired",
            || async { f.rows("orders").await.is_empty() },
        )
        .await;
        running.shutdown().await;
        let got = drain(&channel, &queue).await;
        let mut per_id: std::collections::BTreeMap<String, usize> = Default::default();
        for (_, id, _, _) in &got {
            *per_id.entry(id.clone()).or_default() += 1;
        }
        assert_eq!(per_id.len(), ROWS, "every row arrived: {per_id:?}");
        assert!(
            per_id.values().all(|&n| n <= 2),
            "at most one duplicate per row: {per_id:?}"
        );
        assert_eq!(
            got.len(),
            2 * ROWS,
            "each row once before the crash and once after"
        );
        teardown(&channel, &exchange, &queue, f).await;
        drop(conn);
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outage_pauses_the_relay_and_the_sink_reconnects_when_the_broker_is_back() {
    const ROWS: usize = 30;
    let f = Fixture::new().await;
    let (_conn, channel, exchange, queue) = setup("orders").await;
    let proxy = outbox_tests::proxy::Proxy::start_to(&broker_host(&amqp_url())).await;
    let through_proxy = through(&proxy);
    let running = worker(f.store.clone())
        .relay(
            ["orders"],
            Relay::new(relay::amqp(through_proxy, exchange.clone()))
                .publish_timeout(Duration::from_millis(500))
                .max_deliveries(2),
        )
        .build()
        .unwrap()
        .start();
    publish(&f, "orders", 5, &headers(&[])).await;
    eventually(10, "the first rows relayed", || async {
        f.rows("orders").await.is_empty()
    })
    .await;

    proxy.cut().await;
    publish(&f, "orders", ROWS, &headers(&[])).await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    let rows = f.rows("orders").await;
    assert_eq!(rows.len(), ROWS, "every row still pending");
    for r in &rows {
        assert_eq!(r.attempts_count, 0, "no attempt recorded: {r:?}");
        let in_flight = i32::from(r.acquired_token.is_some());
        assert!(
            r.deliveries_count <= in_flight,
            "the outage counted no delivery: {r:?}"
        );
    }
    let dead = f
        .store
        .dead_letters(&DeadLetterFilter::new().queue("orders"), None, 100)
        .await
        .unwrap();
    assert!(dead.is_empty(), "nothing dead-lettered: {dead:?}");

    proxy.restore().await;
    // The circuit's longest back-off (2 s) plus a connect and a probe, at least 3×.
    eventually(15, "every row relayed once the broker is back", || async {
        f.rows("orders").await.is_empty()
    })
    .await;
    running.shutdown().await;
    let got = drain(&channel, &queue).await;
    let mut ids: Vec<&String> = got.iter().map(|(_, id, _, _)| id).collect();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), ROWS + 5, "every row arrived");
    teardown(&channel, &exchange, &queue, f).await;
}

/// `host:port` of the test broker, and its URL with `proxy` in its place.
fn through(proxy: &outbox_tests::proxy::Proxy) -> String {
    let upstream = amqp_url();
    let host = broker_host(&upstream);
    upstream.replace(&host, &proxy.addr().to_string())
}

fn broker_host(url: &str) -> String {
    url.split('@')
        .nth(1)
        .and_then(|rest| rest.split('/').next())
        .unwrap_or("127.0.0.1:5672")
        .to_owned()
}

#[tokio::test]
async fn bad_amqp_settings_are_refused_by_build_before_any_broker_call() {
    let f = Fixture::new().await;
    let url = amqp_url();
    let long = "k".repeat(256);
    let cases = [
        (
            "an unparsable URI",
            relay::amqp("amqp://guest:s3cret@127.0.0.1:notaport/%2f", "x"),
            "does not parse",
        ),
        (
            "a URI that is no URL base",
            relay::amqp("amqp:s3cret", "x"),
            "does not parse",
        ),
        (
            // Not the parser's text with `…` between every character.
            "an empty URI",
            relay::amqp("", "x"),
            "the AMQP URI is empty",
        ),
        (
            "an exchange name over 255 bytes",
            relay::amqp(url.clone(), long.clone()),
            "exchange name",
        ),
        (
            "a fixed routing key over 255 bytes",
            relay::amqp(url.clone(), "x").routing_key(RoutingKey::Fixed(long.clone())),
            "routing key is 256 bytes",
        ),
        (
            "an empty routing key on the default exchange",
            relay::amqp(url.clone(), "").routing_key(RoutingKey::Fixed(String::new())),
            "empty routing key",
        ),
        (
            "an empty routing header",
            relay::amqp(url.clone(), "x").routing_key(RoutingKey::Header(String::new())),
            "RoutingKey::Header",
        ),
        (
            "the default exchange without mandatory",
            relay::amqp(url.clone(), "").mandatory(false),
            "mandatory(false)",
        ),
    ];
    for (what, sink, says) in cases {
        let e = worker(f.store.clone())
            .relay(["orders"], sink)
            .build()
            .map(drop)
            .expect_err(what);
        assert!(
            matches!(&e, outbox::Error::InvalidConfig { knob: "relay", reason }
                if reason.contains(says) && !reason.contains("s3cret")),
            "{what}: {e:?}"
        );
    }
    let e = worker(f.store.clone())
        .relay(
            ["orders"],
            Relay::new(relay::amqp(url.clone(), "x")).connect_timeout(Duration::ZERO),
        )
        .build()
        .map(drop)
        .expect_err("a zero connect timeout");
    assert!(
        matches!(&e, outbox::Error::InvalidConfig { knob: "relay", reason } if reason.contains("connect_timeout")),
        "{e:?}"
    );
    // What a user writes for the usual set-ups still builds (no connection is opened).
    for sink in [
        relay::amqp(url.clone(), ""),
        relay::amqp(url.clone(), "events").mandatory(false),
        relay::amqp(url.clone(), "events").routing_key(RoutingKey::Header("tenant".into())),
    ] {
        drop(
            worker(f.store.clone())
                .relay(["orders"], sink)
                .build()
                .unwrap(),
        );
    }
    f.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publish_timeout_shorter_than_the_connect_still_relays() {
    let f = Fixture::new().await;
    let (_conn, channel, exchange, queue) = setup("orders").await;
    // Every connection takes 300 ms to open; a publish on an open one is quick.
    let connect = Duration::from_millis(300);
    let proxy =
        outbox_tests::proxy::Proxy::start_delayed_to(&broker_host(&amqp_url()), connect).await;
    let publish_timeout = Duration::from_millis(50);
    let running = worker(f.store.clone())
        .relay(
            ["orders"],
            Relay::new(relay::amqp(through(&proxy), exchange.clone()))
                .publish_timeout(publish_timeout),
        )
        .build()
        .unwrap()
        .start();
    publish(&f, "orders", 5, &headers(&[])).await;
    // One connect, the circuit's back-offs around it (at most 2 s): far within 15 s.
    eventually(15, "every row relayed", || async {
        f.rows("orders").await.is_empty()
    })
    .await;
    running.shutdown().await;
    assert_eq!(drain(&channel, &queue).await.len(), 5);
    teardown(&channel, &exchange, &queue, f).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connect_slower_than_the_connect_timeout_is_an_outage_that_counts_nothing() {
    let f = Fixture::new().await;
    let (_conn, channel, exchange, queue) = setup("orders").await;
    // Every connection takes 1 s to open; the relay allows 300 ms.
    let proxy = outbox_tests::proxy::Proxy::start_delayed_to(
        &broker_host(&amqp_url()),
        Duration::from_secs(1),
    )
    .await;
    let running = worker(f.store.clone())
        .relay(
            ["orders"],
            Relay::new(relay::amqp(through(&proxy), exchange.clone()))
                .connect_timeout(Duration::from_millis(300)),
        )
        .build()
        .unwrap()
        .start();
    publish(&f, "orders", 3, &headers(&[])).await;
    // 3 s: ten connect timeouts, and three times the connect the relay never waits for.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let rows = f.rows("orders").await;
    assert_eq!(rows.len(), 3, "nothing relayed");
    for r in &rows {
        assert_eq!(r.attempts_count, 0, "no attempt recorded: {r:?}");
        let in_flight = i32::from(r.acquired_token.is_some());
        assert!(
            r.deliveries_count <= in_flight,
            "the outage counted no delivery: {r:?}"
        );
    }
    running.shutdown().await;
    assert!(drain(&channel, &queue).await.is_empty());
    teardown(&channel, &exchange, &queue, f).await;
}
