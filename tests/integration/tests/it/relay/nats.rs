//! The relay to NATS JetStream.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, stream};
use futures::future::BoxFuture;
use outbox::dlq::DeadLetterFilter;
use outbox::relay::{self, BrokerMessage, Relay, Sink, SinkError, Subject};
use outbox::{PgStore, RetryStrategy};
use outbox_tests::proxy::Proxy;
use outbox_tests::{eventually, Fixture};
use tokio::sync::Notify;

use super::{headers, nats_url, publish, unique, worker};

/// A JetStream context on the test server (or `addr`), with quick reconnects and a short
/// ack timeout, so an outage is seen within a second.
async fn jetstream_at(addr: &str) -> jetstream::Context {
    let client = async_nats::ConnectOptions::new()
        .retry_on_initial_connect()
        .connection_timeout(Duration::from_secs(1))
        .reconnect_delay_callback(|_| Duration::from_millis(100))
        .connect(addr)
        .await
        .unwrap_or_else(|e| {
            panic!("NATS at {addr} cannot be reached ({e}): start nats-server -js")
        });
    jetstream::ContextBuilder::new()
        .ack_timeout(Duration::from_secs(1))
        .build(client)
}

pub(super) async fn jetstream() -> jetstream::Context {
    jetstream_at(&nats_url()).await
}

/// A fresh stream over `<subject>.>` with the given settings; returns its name and subject
/// prefix.
pub(super) async fn stream(
    js: &jetstream::Context,
    configure: impl FnOnce(&mut stream::Config),
) -> (String, String) {
    let name = unique("OUTBOX_TEST").to_uppercase();
    let subject = unique("outbox_test");
    let mut config = stream::Config {
        name: name.clone(),
        subjects: vec![format!("{subject}.>")],
        duplicate_window: Duration::from_secs(120),
        ..Default::default()
    };
    configure(&mut config);
    js.create_stream(config).await.expect("create the stream");
    (name, subject)
}

async fn stream_messages(js: &jetstream::Context, name: &str) -> u64 {
    let mut s = js.get_stream(name).await.expect("the stream");
    s.info().await.expect("stream info").state.messages
}

/// Every message of the stream, in stream order.
pub(super) async fn read_all(
    js: &jetstream::Context,
    name: &str,
) -> Vec<jetstream::message::StreamMessage> {
    let mut s = js.get_stream(name).await.expect("the stream");
    let last = s.info().await.expect("stream info").state.last_sequence;
    let mut out = Vec::new();
    for seq in 1..=last {
        if let Ok(m) = s.get_raw_message(seq).await {
            out.push(m);
        }
    }
    out
}

pub(super) async fn cleanup(js: &jetstream::Context, name: &str, f: Fixture) {
    let _ = js.delete_stream(name).await;
    f.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relays_payload_headers_and_a_stable_message_id() {
    let f = Fixture::new().await;
    let js = jetstream().await;
    let (name, subject) = stream(&js, |_| {}).await;
    let traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    let h = headers(&[("traceparent", traceparent), ("tenant", "eu")]);
    let ids = publish(&f, "orders", 5, &h).await;
    let running = worker(f.store.clone())
        .relay(
            ["orders"],
            relay::nats(
                js.clone(),
                Subject::from_queue(format!("{subject}.")).with_header("tenant"),
            )
            .expected_stream(&name),
        )
        .build()
        .unwrap()
        .start();
    eventually(15, "every row relayed and acked", || async {
        f.rows("orders").await.is_empty()
    })
    .await;
    running.shutdown().await;
    let got = read_all(&js, &name).await;
    assert_eq!(got.len(), 5, "one message per row");
    let table = f.outbox.table().replace('"', "");
    for (i, m) in got.iter().enumerate() {
        assert_eq!(m.subject.as_str(), format!("{subject}.orders.eu"));
        assert_eq!(
            m.payload.as_ref(),
            format!("m{i}").as_bytes(),
            "payload unchanged"
        );
        assert_eq!(
            m.headers.get("traceparent").map(|v| v.as_str()),
            Some(traceparent)
        );
        assert_eq!(m.headers.get("tenant").map(|v| v.as_str()), Some("eu"));
        let id = m
            .headers
            .get("Nats-Msg-Id")
            .expect("Nats-Msg-Id")
            .as_str()
            .to_owned();
        assert!(
            ids.iter().any(|r| id.starts_with(&format!("{table}:{r}:"))),
            "{id} is a row's id"
        );
    }
    cleanup(&js, &name, f).await;
}

/// Two rows with the same table name and id are two messages: after `TRUNCATE … RESTART
/// IDENTITY` the new rows take the old ids, as the default `outbox` tables of two services
/// relaying into one stream share names and ids. With a message id of table and id alone
/// the stream acked the second rows as duplicates and stored nothing, and their rows were
/// deleted: lost (found by a fresh-user pass). §14 (v3).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_that_reuse_an_id_are_not_dropped_as_duplicates() {
    let f = Fixture::new().await;
    let js = jetstream().await;
    let (name, subject) = stream(&js, |_| {}).await;
    let running = worker(f.store.clone())
        .relay(
            ["orders"],
            relay::nats(js.clone(), Subject::from_queue(format!("{subject}.")))
                .expected_stream(&name),
        )
        .build()
        .unwrap()
        .start();
    let first = publish(&f, "orders", 3, &headers(&[])).await;
    eventually(15, "the first rows relayed", || async {
        f.rows("orders").await.is_empty()
    })
    .await;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "TRUNCATE {} RESTART IDENTITY",
        f.outbox.table()
    )))
    .execute(&f.pool)
    .await
    .unwrap();
    let second = publish(&f, "orders", 3, &headers(&[])).await;
    assert_eq!(first, second, "the identity restarted: the same ids again");
    eventually(15, "the second rows relayed", || async {
        f.rows("orders").await.is_empty()
    })
    .await;
    running.shutdown().await;
    assert_eq!(
        stream_messages(&js, &name).await,
        6,
        "every row is a message of its own"
    );
    cleanup(&js, &name, f).await;
}

/// Publishes through NATS and then waits until the test lets it return: the row's ack
/// cannot come before.
struct Gated {
    inner: relay::NatsSink,
    published: Arc<AtomicUsize>,
    open: Arc<Notify>,
}

impl Sink for Gated {
    fn publish(&self, message: BrokerMessage) -> BoxFuture<'static, Result<(), SinkError>> {
        let publish = self.inner.publish(message);
        let published = self.published.clone();
        let open = self.open.clone();
        Box::pin(async move {
            let done = publish.await;
            published.fetch_add(1, Ordering::SeqCst);
            open.notified().await;
            done
        })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_is_acked_only_after_the_publish_ack() {
    let f = Fixture::new().await;
    let js = jetstream().await;
    let (name, subject) = stream(&js, |_| {}).await;
    publish(&f, "orders", 1, &headers(&[])).await;
    let published = Arc::new(AtomicUsize::new(0));
    let open = Arc::new(Notify::new());
    let gated = Gated {
        inner: relay::nats(js.clone(), Subject::fixed(format!("{subject}.orders"))),
        published: published.clone(),
        open: open.clone(),
    };
    let running = worker(f.store.clone())
        .relay(["orders"], Relay::new(gated))
        .build()
        .unwrap()
        .start();
    eventually(10, "the message confirmed by the stream", || async {
        published.load(Ordering::SeqCst) == 1
    })
    .await;
    assert_eq!(stream_messages(&js, &name).await, 1);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let row = f.only_row("orders").await;
    assert!(
        row.acquired_token.is_some(),
        "still leased, not acked: {row:?}"
    );
    open.notify_one();
    eventually(10, "the row acked after the confirm", || async {
        f.rows("orders").await.is_empty()
    })
    .await;
    running.shutdown().await;
    cleanup(&js, &name, f).await;
}

/// Publishes through NATS, counts, and then never returns: a relay that "dies" after the
/// broker's confirm and before its ack.
struct DiesAfterConfirm {
    inner: relay::NatsSink,
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
fn a_redelivery_after_a_crash_between_confirm_and_ack_is_dropped_by_the_stream() {
    const ROWS: usize = 20;
    let lease_ttl = Duration::from_secs(1);
    let main = tokio::runtime::Runtime::new().unwrap();
    let (f, js, name, subject) = main.block_on(async {
        let f = Fixture::new().await;
        let js = jetstream().await;
        let (name, subject) = stream(&js, |_| {}).await;
        publish(&f, "orders", ROWS, &headers(&[])).await;
        (f, js, name, subject)
    });
    // The first relay runs in a runtime of its own, which the test then drops: every task
    // of it, its pool connections and its NATS connection die at once, as in a crash.
    let crashed = tokio::runtime::Runtime::new().unwrap();
    let confirmed = Arc::new(AtomicUsize::new(0));
    {
        let confirmed = confirmed.clone();
        let outbox = f.outbox.clone();
        let subject = subject.clone();
        crashed.block_on(async move {
            let pool = outbox_tests::pool().await;
            let js = jetstream().await;
            let sink = DiesAfterConfirm {
                inner: relay::nats(js, Subject::fixed(format!("{subject}.orders"))),
                confirmed: confirmed.clone(),
            };
            let running = worker(PgStore::new(pool, outbox))
                .concurrency(32)
                .lease_ttl(lease_ttl)
                .relay(["orders"], Relay::new(sink))
                .build()
                .unwrap()
                .start();
            eventually(15, "every row confirmed by the stream", || async {
                confirmed.load(Ordering::SeqCst) == ROWS
            })
            .await;
            std::mem::forget(running);
        });
    }
    crashed.shutdown_background();
    main.block_on(async {
        assert_eq!(f.rows("orders").await.len(), ROWS, "nothing was acked");
        assert_eq!(stream_messages(&js, &name).await, ROWS as u64);
        let republished = Arc::new(AtomicUsize::new(0));
        let counting = Counting {
            inner: relay::nats(js.clone(), Subject::fixed(format!("{subject}.orders"))),
            calls: republished.clone(),
        };
        let running = worker(f.store.clone())
            .lease_ttl(lease_ttl)
            .relay(["orders"], Relay::new(counting))
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
        assert!(
            republished.load(Ordering::SeqCst) >= ROWS,
            "the restarted relay published every row again"
        );
        assert_eq!(
            stream_messages(&js, &name).await,
            ROWS as u64,
            "the stream dropped every redelivery by its Nats-Msg-Id"
        );
        cleanup(&js, &name, f).await;
    });
}

/// Counts publishes.
struct Counting {
    inner: relay::NatsSink,
    calls: Arc<AtomicUsize>,
}

impl Sink for Counting {
    fn publish(&self, message: BrokerMessage) -> BoxFuture<'static, Result<(), SinkError>> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        self.inner.publish(message)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outage_pauses_the_relay_without_counting_deliveries_and_it_flows_again() {
    const ROWS: usize = 40;
    let f = Fixture::new().await;
    let direct = jetstream().await;
    let (name, subject) = stream(&direct, |_| {}).await;
    let proxy = Proxy::start_to(&nats_url()).await;
    let js = jetstream_at(&proxy.addr().to_string()).await;
    let publish_timeout = Duration::from_millis(500);
    let running = worker(f.store.clone())
        .relay(
            ["orders"],
            Relay::new(relay::nats(js, Subject::fixed(format!("{subject}.orders"))))
                .publish_timeout(publish_timeout)
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
    // Many publish timeouts and probes long: far more than max_deliveries(2) claims per row
    // if an outage counted.
    tokio::time::sleep(Duration::from_secs(6)).await;
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
    assert_eq!(stream_messages(&direct, &name).await, 5);

    proxy.restore().await;
    // Back within the circuit's longest back-off (2 s) plus a reconnect and a probe:
    // at least 3× that.
    eventually(15, "every row relayed once the broker is back", || async {
        f.rows("orders").await.is_empty()
    })
    .await;
    running.shutdown().await;
    assert_eq!(stream_messages(&direct, &name).await, (ROWS + 5) as u64);
    cleanup(&direct, &name, f).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_the_stream_refuses_is_retried_then_dead_lettered_with_the_reason() {
    let f = Fixture::new().await;
    let js = jetstream().await;
    let (name, subject) = stream(&js, |c| c.max_message_size = 256).await;
    let mut conn = f.pool.acquire().await.unwrap();
    let big = vec![b'x'; 1024];
    f.outbox
        .publish(&mut conn, outbox::Message::new("orders", &big))
        .await
        .unwrap();
    f.outbox
        .publish(&mut conn, outbox::Message::new("orders", b"small"))
        .await
        .unwrap();
    drop(conn);
    let running = worker(f.store.clone())
        .relay(
            ["orders"],
            Relay::new(relay::nats(
                js.clone(),
                Subject::fixed(format!("{subject}.orders")),
            ))
            .retry(RetryStrategy::constant(Duration::from_millis(50)).max_attempts(3)),
        )
        .build()
        .unwrap()
        .start();
    eventually(
        15,
        "the small message relayed, the large one dead-lettered",
        || async { f.rows("orders").await.is_empty() },
    )
    .await;
    running.shutdown().await;
    let dead = f
        .store
        .dead_letters(&DeadLetterFilter::new().queue("orders"), None, 10)
        .await
        .unwrap();
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(dead[0].payload, big);
    assert_eq!(dead[0].failure_reason, "retry_exhausted");
    assert_eq!(dead[0].attempts_count, 3);
    let reason = dead[0].last_error.as_deref().unwrap_or_default();
    assert!(
        reason.contains("rejected") && reason.contains("maximum"),
        "the broker's reason: {reason}"
    );
    let got = read_all(&js, &name).await;
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].payload.as_ref(), b"small");
    cleanup(&js, &name, f).await;
}

/// A row's headers cannot steer JetStream (`Nats-*`) nor lose a line break on the way: such
/// a message is the row's fault, dead-lettered with the reason, and the others flow. (Found
/// by a fresh user: a row header `Nats-Expected-Stream` failed every publish as an outage,
/// and `a\nb` arrived as `a b`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn control_headers_and_line_breaks_in_a_rows_headers_are_refused() {
    let f = Fixture::new().await;
    let js = jetstream().await;
    let (name, subject) = stream(&js, |_| {}).await;
    let mut conn = f.pool.acquire().await.unwrap();
    for (payload, hs) in [
        (&b"steer"[..], headers(&[("Nats-Expected-Stream", "NOPE")])),
        (&b"lines"[..], headers(&[("multi", "line1\nline2")])),
        (&b"fine"[..], headers(&[("k", "v")])),
    ] {
        f.outbox
            .publish(
                &mut conn,
                outbox::Message::new("orders", payload).headers(&hs),
            )
            .await
            .unwrap();
    }
    drop(conn);
    let running = worker(f.store.clone())
        .relay(
            ["orders"],
            Relay::new(relay::nats(
                js.clone(),
                Subject::fixed(format!("{subject}.orders")),
            ))
            .retry(RetryStrategy::constant(Duration::from_millis(50)).max_attempts(2)),
        )
        .build()
        .unwrap()
        .start();
    eventually(15, "every row done", || async {
        f.rows("orders").await.is_empty()
    })
    .await;
    running.shutdown().await;
    let mut dead = f
        .store
        .dead_letters(&DeadLetterFilter::new().queue("orders"), None, 10)
        .await
        .unwrap();
    dead.sort_by(|a, b| a.payload.cmp(&b.payload));
    assert_eq!(dead.len(), 2, "{dead:?}");
    let reason = |i: usize| dead[i].last_error.clone().unwrap_or_default();
    assert_eq!(dead[0].payload, b"lines");
    assert!(reason(0).contains("line break"), "{}", reason(0));
    assert_eq!(dead[1].payload, b"steer");
    assert!(reason(1).contains("control header"), "{}", reason(1));
    let got = read_all(&js, &name).await;
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].payload.as_ref(), b"fine");
    cleanup(&js, &name, f).await;
}

#[tokio::test]
async fn bad_relay_settings_are_refused_by_build_before_any_broker_call() {
    let f = Fixture::new().await;
    // A context over a client that never connected: build() must not need it.
    let client = async_nats::ConnectOptions::new()
        .retry_on_initial_connect()
        .connect("127.0.0.1:1")
        .await
        .unwrap();
    let js = jetstream::new(client);
    let bad_queue = worker(f.store.clone())
        .relay(
            ["my orders"],
            relay::nats(js.clone(), Subject::from_queue("x.")),
        )
        .build()
        .map(drop)
        .expect_err("a queue that is no subject token");
    assert!(
        matches!(&bad_queue, outbox::Error::InvalidConfig { knob: "relay", reason } if reason.contains("subject")),
        "{bad_queue:?}"
    );
    let none = worker(f.store.clone())
        .relay(
            Vec::<String>::new(),
            relay::nats(js.clone(), Subject::fixed("x")),
        )
        .build()
        .map(drop)
        .expect_err("no queue");
    assert!(
        matches!(none, outbox::Error::InvalidConfig { knob: "relay", .. }),
        "{none:?}"
    );
    let timeout = worker(f.store.clone())
        .relay(
            ["q"],
            Relay::new(relay::nats(js.clone(), Subject::fixed("x")))
                .publish_timeout(Duration::ZERO),
        )
        .build()
        .map(drop)
        .expect_err("a zero publish timeout");
    assert!(
        matches!(timeout, outbox::Error::InvalidConfig { knob: "relay", .. }),
        "{timeout:?}"
    );
    let twice = worker(f.store.clone())
        .relay(["q"], relay::nats(js.clone(), Subject::fixed("x")))
        .queue("q", |_: Vec<u8>, _: outbox::Context| async {})
        .build()
        .map(drop)
        .expect_err("a queue relayed and handled");
    assert!(
        matches!(twice, outbox::Error::DuplicateHandler { .. }),
        "{twice:?}"
    );
    f.cleanup().await;
}

/// Injects broker errors around a real publish: every 11th call finds the broker
/// unavailable before publishing, every 13th publishes and then loses the confirm (the
/// stream has it; the row is given back and published again with the same id), every 7th
/// is rejected before publishing.
struct Flaky {
    inner: relay::NatsSink,
    calls: Arc<AtomicUsize>,
}

impl Sink for Flaky {
    fn publish(&self, message: BrokerMessage) -> BoxFuture<'static, Result<(), SinkError>> {
        let n = self.calls.fetch_add(1, Ordering::SeqCst) + 1;
        let publish = self.inner.publish(message);
        Box::pin(async move {
            if n.is_multiple_of(11) {
                return Err(SinkError::Unavailable(
                    "injected: connection refused".into(),
                ));
            }
            if n.is_multiple_of(7) {
                return Err(SinkError::Rejected("injected: refused".into()));
            }
            publish.await?;
            if n.is_multiple_of(13) {
                return Err(SinkError::Unavailable("injected: confirm lost".into()));
            }
            Ok(())
        })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_of_one_key_reach_the_stream_in_commit_order_under_four_relays_and_errors() {
    const KEYS: usize = 5;
    const PER_KEY: usize = 30;
    let f = Fixture::new().await;
    let js = jetstream().await;
    let (name, subject) = stream(&js, |_| {}).await;
    let calls = Arc::new(AtomicUsize::new(0));
    let relays: Vec<_> = (0..4)
        .map(|_| {
            let sink = Flaky {
                inner: relay::nats(js.clone(), Subject::fixed(format!("{subject}.orders"))),
                calls: calls.clone(),
            };
            worker(f.store.clone())
                .concurrency(8)
                .relay(
                    ["orders"],
                    Relay::new(sink)
                        .ordered_by_header("key")
                        .retry(RetryStrategy::constant(Duration::from_millis(20)).max_attempts(50)),
                )
                .build()
                .unwrap()
                .start()
        })
        .collect();
    // One transaction per message while the relays run: per key, commit order is the
    // order of `seq`.
    let mut conn = f.pool.acquire().await.unwrap();
    for seq in 0..PER_KEY {
        for k in 0..KEYS {
            let h = headers(&[("key", &format!("k{k}")), ("seq", &seq.to_string())]);
            f.outbox
                .publish(&mut conn, outbox::Message::new("orders", b"x").headers(&h))
                .await
                .unwrap();
        }
    }
    drop(conn);
    eventually(60, "every message relayed", || async {
        f.rows("orders").await.is_empty()
    })
    .await;
    for r in relays {
        r.shutdown().await;
    }
    assert!(
        calls.load(Ordering::SeqCst) > KEYS * PER_KEY,
        "errors were injected and retried"
    );
    let got = read_all(&js, &name).await;
    assert_eq!(got.len(), KEYS * PER_KEY, "once each in the stream");
    let mut per_key: std::collections::BTreeMap<String, Vec<usize>> = Default::default();
    for m in &got {
        let key = m.headers.get("key").unwrap().as_str().to_owned();
        let seq: usize = m.headers.get("seq").unwrap().as_str().parse().unwrap();
        per_key.entry(key).or_default().push(seq);
    }
    assert_eq!(per_key.len(), KEYS);
    for (key, seqs) in &per_key {
        assert_eq!(
            *seqs,
            (0..PER_KEY).collect::<Vec<_>>(),
            "key {key} reached the stream out of commit order"
        );
    }
    cleanup(&js, &name, f).await;
}

#[tokio::test]
async fn an_ordered_relay_needs_a_store_that_claims_in_order() {
    let client = async_nats::ConnectOptions::new()
        .retry_on_initial_connect()
        .connect("127.0.0.1:1")
        .await
        .unwrap();
    let js = jetstream::new(client);
    let e = outbox::Worker::builder(outbox::testing::MemoryStore::new())
        .relay(
            ["q"],
            Relay::new(relay::nats(js, Subject::fixed("x"))).ordered_by_header("key"),
        )
        .build()
        .map(drop)
        .expect_err("MemoryStore does not claim in order");
    assert!(
        matches!(&e, outbox::Error::InvalidConfig { knob: "relay", reason } if reason.contains("in order")),
        "{e:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ordered_claim_deletes_a_cancelled_row_whose_lease_expired() {
    use outbox::store::{ClaimRequest, Store};
    let f = Fixture::new().await;
    let js = jetstream().await;
    let (name, subject) = stream(&js, |_| {}).await;
    let h = headers(&[("key", "k")]);
    let mut conn = f.pool.acquire().await.unwrap();
    f.outbox
        .publish(
            &mut conn,
            outbox::Message::new("orders", b"timer")
                .timer_id("t")
                .headers(&h),
        )
        .await
        .unwrap();
    // A relay claimed the timer's row and died; the timer is cancelled while it "runs".
    let lease_ttl = Duration::from_millis(500);
    let claimed = f
        .store
        .claim(ClaimRequest::new(&["orders".to_owned()], 10, lease_ttl))
        .await
        .unwrap();
    assert_eq!(claimed.len(), 1);
    let cancelled = f.outbox.cancel(&mut conn, "orders", "t").await.unwrap();
    assert!(
        matches!(cancelled, outbox::Cancelled::Running { .. }),
        "{cancelled:?}"
    );
    f.outbox
        .publish(
            &mut conn,
            outbox::Message::new("orders", b"after").headers(&h),
        )
        .await
        .unwrap();
    drop(conn);
    let running = worker(f.store.clone())
        .lease_ttl(lease_ttl)
        .relay(
            ["orders"],
            Relay::new(relay::nats(
                js.clone(),
                Subject::fixed(format!("{subject}.orders")),
            ))
            .ordered_by_header("key"),
        )
        .build()
        .unwrap()
        .start();
    // The lease expires after 500 ms; the idle poll is 200 ms.
    eventually(
        10,
        "the cancelled row deleted, the key's next message relayed",
        || async { f.rows("orders").await.is_empty() },
    )
    .await;
    running.shutdown().await;
    let got = read_all(&js, &name).await;
    assert_eq!(got.len(), 1, "the cancelled row is never relayed");
    assert_eq!(&got[0].payload[..], b"after");
    cleanup(&js, &name, f).await;
}

/// Refuses the first publish of the message whose header `seq` is `seq`; publishes the
/// rest. Records every publish: its `seq`, and whether it was refused.
pub(super) struct RefuseOnce {
    inner: relay::NatsSink,
    seq: &'static str,
    published: PublishLog,
}

/// What [`RefuseOnce`] published, in order: each message's `seq`, and whether it was refused.
pub(super) type PublishLog = Arc<std::sync::Mutex<Vec<(String, bool)>>>;

impl RefuseOnce {
    fn new(inner: relay::NatsSink, seq: &'static str) -> Self {
        RefuseOnce {
            inner,
            seq,
            published: Arc::default(),
        }
    }
}

impl Sink for RefuseOnce {
    fn publish(&self, message: BrokerMessage) -> BoxFuture<'static, Result<(), SinkError>> {
        let seq = message.headers.get("seq").cloned().unwrap_or_default();
        let mut log = self.published.lock().unwrap();
        let refuse = seq == self.seq && !log.iter().any(|(s, _)| *s == seq);
        log.push((seq, refuse));
        drop(log);
        if refuse {
            return Box::pin(async { Err(SinkError::Rejected("injected".into())) });
        }
        self.inner.publish(message)
    }
}

/// A worker relaying `orders` to `<subject>.orders`, ordered by the header `key`, whose
/// broker refuses the message with header `seq` = `refuse` once (retried after `retry`);
/// with the log of its publishes.
pub(super) fn refusing_relay(
    f: &Fixture,
    js: &jetstream::Context,
    subject: &str,
    refuse: &'static str,
    retry: Duration,
) -> (outbox::Worker<PgStore>, PublishLog) {
    let sink = RefuseOnce::new(
        relay::nats(js.clone(), Subject::fixed(format!("{subject}.orders"))),
        refuse,
    );
    let published = sink.published.clone();
    let relay = worker(f.store.clone())
        .relay(
            ["orders"],
            Relay::new(sink)
                .ordered_by_header("key")
                .retry(RetryStrategy::constant(retry).max_attempts(5)),
        )
        .build()
        .unwrap();
    (relay, published)
}

/// Publishes `n` messages of `orders` with the key `k` and the headers `seq` 0, 1, …, one
/// transaction each.
pub(super) async fn publish_sequence(f: &Fixture, n: usize) {
    let mut conn = f.pool.acquire().await.unwrap();
    for seq in 0..n {
        let h = headers(&[("key", "k"), ("seq", &seq.to_string())]);
        f.outbox
            .publish(&mut conn, outbox::Message::new("orders", b"x").headers(&h))
            .await
            .unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_due_keeps_an_ordered_relays_key_order_when_a_message_is_retried() {
    const N: usize = 5;
    let f = Fixture::new().await;
    let js = jetstream().await;
    let (name, subject) = stream(&js, |_| {}).await;
    let (relay, published) = refusing_relay(&f, &js, &subject, "0", Duration::from_millis(300));
    publish_sequence(&f, N).await;
    relay.run_due().await.unwrap();
    assert!(
        published.lock().unwrap().contains(&("0".to_owned(), true)),
        "the first message was rejected"
    );
    assert_eq!(
        stream_messages(&js, &name).await,
        0,
        "no message of the key overtook the rejected first one"
    );
    // The retry comes due after 300 ms; 10 s is far beyond.
    eventually(10, "every message relayed by run_due", || async {
        relay.run_due().await.unwrap();
        f.rows("orders").await.is_empty()
    })
    .await;
    let seqs: Vec<usize> = read_all(&js, &name)
        .await
        .iter()
        .map(|m| m.headers.get("seq").unwrap().as_str().parse().unwrap())
        .collect();
    assert_eq!(
        seqs,
        (0..N).collect::<Vec<_>>(),
        "commit order in the stream"
    );
    cleanup(&js, &name, f).await;
}

#[tokio::test]
async fn bad_subject_settings_are_refused_by_build_before_any_broker_call() {
    let f = Fixture::new().await;
    // A context over a client that never connected: build() must not need it.
    let client = async_nats::ConnectOptions::new()
        .retry_on_initial_connect()
        .connect("127.0.0.1:1")
        .await
        .unwrap();
    let js = jetstream::new(client);
    let nats = |subject: Subject| relay::nats(js.clone(), subject);
    let cases = [
        (
            "a prefix without its dot",
            nats(Subject::from_queue("events")),
            "must end in `.`",
        ),
        (
            "a prefix with an empty token",
            nats(Subject::from_queue("events..")),
            "empty subject token",
        ),
        (
            "a wildcard in a prefix",
            nats(Subject::from_queue("events.>.")),
            "not a subject token",
        ),
        (
            "a wildcard in a fixed subject",
            nats(Subject::fixed("events.*")),
            "not a subject token",
        ),
        (
            "an empty subject header name",
            nats(Subject::fixed("events").with_header("")),
            "with_header",
        ),
        (
            "a stream name with a dot",
            nats(Subject::fixed("events")).expected_stream("A.B"),
            "expected_stream",
        ),
        (
            "an empty stream name",
            nats(Subject::fixed("events")).expected_stream(""),
            "expected_stream",
        ),
    ];
    for (what, sink, says) in cases {
        let e = worker(f.store.clone())
            .relay(["orders"], sink)
            .build()
            .map(drop)
            .expect_err(what);
        assert!(
            matches!(&e, outbox::Error::InvalidConfig { knob: "relay", reason } if reason.contains(says)),
            "{what}: {e:?}"
        );
    }
    // What a user writes for the usual set-ups still builds.
    for sink in [
        nats(Subject::from_queue("")),
        nats(Subject::from_queue("events.eu.").with_header("tenant")).expected_stream("EVENTS"),
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
