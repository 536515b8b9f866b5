//! Runs of an ordered relay (SPEC §14): a claim takes a key's earliest row and the rows
//! right after it together, and the worker publishes them one after another, each only once
//! the one before it was confirmed.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use outbox::relay::{BrokerMessage, Relay, Sink, SinkError};
use outbox::store::{ClaimRequest, Store};
use outbox::Worker;
use outbox_tests::{eventually, Fixture};
use sqlx::AssertSqlSafe;

use crate::worker::wakeups::Counting;

use super::nats::{cleanup, jetstream, publish_sequence, read_all, refusing_relay, stream};
use super::{headers, publish};

/// Moves row `id`'s deadline an hour ahead, as a retry waiting for its back-off would.
async fn not_due_for_an_hour(f: &Fixture, id: i64) {
    let t = f.outbox.table();
    sqlx::query(AssertSqlSafe(format!(
        "UPDATE {t} SET next_attempt_at = now() + interval '1 hour' WHERE id = $1"
    )))
    .bind(id)
    .execute(&f.pool)
    .await
    .unwrap();
}

/// A run ends before the first row the claim may not take: one locked by another
/// transaction (`a`'s third row), one not due (`b`'s third), and the batch is cut by
/// position in the run, so every run keeps a prefix.
#[tokio::test]
async fn a_claim_takes_each_keys_run_up_to_the_first_row_it_may_not_take() {
    let f = Fixture::new().await;
    let t = f.outbox.table();
    let a = publish(&f, "orders", 5, &headers(&[("key", "a")])).await;
    let b = publish(&f, "orders", 4, &headers(&[("key", "b")])).await;
    let c = publish(&f, "orders", 3, &headers(&[("key", "c")])).await;
    not_due_for_an_hour(&f, b[2]).await;
    let mut holder = f.pool.begin().await.unwrap();
    sqlx::query(AssertSqlSafe(format!(
        "SELECT 1 FROM {t} WHERE id = $1 FOR UPDATE"
    )))
    .bind(a[2])
    .execute(&mut *holder)
    .await
    .unwrap();
    let queues = ["orders".to_owned()];
    let ttl = Duration::from_secs(60);

    // Room for everything: a1 a2 | b1 b2 | c1 c2 c3.
    let claimed = f
        .store
        .claim_in_order(ClaimRequest::new(&queues, 20, ttl), "key")
        .await
        .unwrap();
    let ids: Vec<i64> = claimed.iter().map(|d| d.lease.id).collect();
    assert_eq!(ids, vec![a[0], a[1], b[0], b[1], c[0], c[1], c[2]]);
    assert!(claimed.iter().all(|d| d.deliveries_count == 1));
    holder.rollback().await.unwrap();

    // Give everything back; a cut to 5 rows keeps the heads, then the second rows by id.
    let releases: Vec<_> = claimed
        .iter()
        .map(|d| outbox::store::Release {
            lease: d.lease,
            started: false,
        })
        .collect();
    f.store.release(&releases).await.unwrap();
    let claimed = f
        .store
        .claim_in_order(ClaimRequest::new(&queues, 5, ttl), "key")
        .await
        .unwrap();
    let ids: Vec<i64> = claimed.iter().map(|d| d.lease.id).collect();
    assert_eq!(ids, vec![a[0], a[1], b[0], b[1], c[0]]);
    f.cleanup().await;
}

/// A key whose first message waits for a retry, with more due messages behind it than a
/// claim reads first (eight times its limit), does not hide a later key's message: the claim
/// then reads every due row.
#[tokio::test]
async fn a_key_held_back_by_a_retry_does_not_hide_the_keys_after_it() {
    let f = Fixture::new().await;
    let a = publish(&f, "orders", 200, &headers(&[("key", "a")])).await;
    let b = publish(&f, "orders", 1, &headers(&[("key", "b")])).await;
    not_due_for_an_hour(&f, a[0]).await;
    let claimed = f
        .store
        .claim_in_order(
            ClaimRequest::new(&["orders".to_owned()], 10, Duration::from_secs(60)),
            "key",
        )
        .await
        .unwrap();
    let ids: Vec<i64> = claimed.iter().map(|d| d.lease.id).collect();
    assert_eq!(
        ids, b,
        "only b's message: every one of a's waits behind its first"
    );
    f.cleanup().await;
}

/// One key's backlog is claimed as a run; the broker refuses its third message once. The
/// rows after it are given back untouched (pending, their delivery not counted) and are
/// published only after it, so the stream holds the key's messages in commit order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_message_gives_the_rest_of_its_run_back_uncounted() {
    const N: usize = 6;
    let f = Fixture::new().await;
    let js = jetstream().await;
    let (name, subject) = stream(&js, |_| {}).await;
    publish_sequence(&f, N).await;
    let (relay, published) = refusing_relay(&f, &js, &subject, "2", Duration::from_secs(2));
    let running = relay.start();
    // Until the retry is due (2 s), the refused row waits and the three after it are back
    // in the table, unleased and uncounted.
    eventually(
        10,
        "the refused row retried later, the rest of its run given back",
        || async {
            let rows = f.rows("orders").await;
            rows.len() == N - 2
                && rows.iter().all(|r| r.acquired_token.is_none())
                && rows.iter().filter(|r| r.deliveries_count == 0).count() == N - 3
        },
    )
    .await;
    let log = published.lock().unwrap().clone();
    assert_eq!(
        log,
        vec![
            ("0".to_owned(), false),
            ("1".to_owned(), false),
            ("2".to_owned(), true)
        ],
        "nothing after the refused message was published"
    );
    // The retry comes due 2 s after the refusal; 10 s is beyond 3×.
    eventually(10, "every message relayed", || async {
        f.rows("orders").await.is_empty()
    })
    .await;
    running.shutdown().await;
    let seqs: Vec<String> = read_all(&js, &name)
        .await
        .iter()
        .map(|m| m.headers.get("seq").unwrap().as_str().to_owned())
        .collect();
    assert_eq!(
        seqs,
        (0..N).map(|s| s.to_string()).collect::<Vec<_>>(),
        "commit order in the stream"
    );
    cleanup(&js, &name, f).await;
}

/// A sink that holds every message of key `held` until the test opens the gate, confirms
/// the others at once, and logs each message's key and payload as it is asked to publish.
#[derive(Clone)]
struct HoldKey {
    held: &'static str,
    open: Arc<tokio::sync::Semaphore>,
    log: Arc<Mutex<Vec<(String, String)>>>,
}

impl HoldKey {
    fn keys(&self) -> Vec<String> {
        self.log
            .lock()
            .unwrap()
            .iter()
            .map(|(k, _)| k.clone())
            .collect()
    }
}

impl Sink for HoldKey {
    fn publish(&self, message: BrokerMessage) -> BoxFuture<'static, Result<(), SinkError>> {
        let key = message.headers.get("key").cloned().unwrap_or_default();
        let payload = String::from_utf8_lossy(&message.payload).into_owned();
        self.log.lock().unwrap().push((key.clone(), payload));
        let open = (key == self.held).then(|| self.open.clone());
        Box::pin(async move {
            if let Some(open) = open {
                // Closed only by the test's end: a dropped semaphore also lets it through.
                let _ = open.acquire().await;
            }
            Ok(())
        })
    }
}

/// Publishes of a key whose run is in flight do not make the worker claim again: the
/// notification does not say the key, and such a claim reads every due row behind the run
/// (a backlog drained at a third of its speed under 200 publishes a second). The worker
/// looks again at the end of a run or within a second (`ORDERED_LOOK_AGAIN`), so a row of
/// another key still goes out within that second.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publishes_behind_a_run_in_flight_do_not_trigger_claims() {
    const LOOK_AGAIN: Duration = Duration::from_secs(1);
    let f = Fixture::new().await;
    let store = Counting::new(f.store.clone());
    let sink = HoldKey {
        held: "a",
        open: Arc::new(tokio::sync::Semaphore::new(0)),
        log: Arc::default(),
    };
    let a = headers(&[("key", "a")]);
    publish(&f, "orders", 3, &a).await;
    let running = Worker::builder(store.clone())
        .concurrency(16)
        .fetch_batch_size(32)
        .idle_poll(Duration::from_secs(60))
        .relay(
            ["orders"],
            Relay::new(sink.clone()).ordered_by_header("key"),
        )
        .build()
        .unwrap()
        .start();
    eventually(10, "key a's first message held in the sink", || async {
        sink.keys() == ["a"]
    })
    .await;
    let claims = || store.snapshot().get("claim_in_order").copied().unwrap_or(0);
    let before = claims();
    let started = Instant::now();
    for _ in 0..20 {
        publish(&f, "orders", 1, &a).await;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let looks = claims() - before;
    // One look-again a second at most, with a margin of 3×; without the rule each publish
    // made one (20).
    let seconds = started.elapsed().as_secs_f64().ceil().max(1.0) as usize;
    assert!(
        looks <= 3 * seconds,
        "{looks} ordered claims while 20 publishes waited behind a run over {seconds} s"
    );
    // Another key's row goes out while key a's run is still held: within the look-again
    // (3× margin).
    publish(&f, "orders", 1, &headers(&[("key", "b")])).await;
    let sent = Instant::now();
    eventually(
        3 * LOOK_AGAIN.as_secs(),
        "key b relayed past the held run",
        || async { sink.keys().contains(&"b".to_owned()) },
    )
    .await;
    assert!(sent.elapsed() < 3 * LOOK_AGAIN, "{:?}", sent.elapsed());
    sink.open.add_permits(1000);
    eventually(15, "every message relayed", || async {
        f.rows("orders").await.is_empty()
    })
    .await;
    running.shutdown().await;
    let a_payloads: Vec<String> = sink
        .log
        .lock()
        .unwrap()
        .iter()
        .filter(|(k, _)| k == "a")
        .map(|(_, p)| p.clone())
        .collect();
    let mut expected: Vec<String> = (0..3).map(|i| format!("m{i}")).collect();
    expected.extend(std::iter::repeat_n("m0".to_owned(), 20));
    assert_eq!(
        a_payloads, expected,
        "key a's messages once each, in commit order"
    );
    f.cleanup().await;
}
