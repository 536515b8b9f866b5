//! The size limits of SPEC §2.1 (v2): a payload of exactly `MAX_PAYLOAD_BYTES` (64 MiB) and
//! headers of exactly `MAX_HEADERS_BYTES` (64 KiB) travel every path — publish, extend and
//! the rearm it queues, claim, the rearm applied by an ack, the dead-letter archive,
//! `pending`, a batch — on Postgres and in memory; one byte more is `InvalidArgument` before
//! any SQL runs, and nothing is written. A batch holds at most `MAX_BATCH_BYTES` (256 MiB)
//! in all, with the same rule. A publish against a database that was never
//! migrated says to run `migrate()`.

use std::time::Duration;

use outbox::dlq::DeadLetterFilter;
use outbox::testing::MemoryStore;
use outbox::{
    message::{
        BatchItem, Headers, OnConflict, MAX_BATCH_BYTES, MAX_HEADERS_BYTES, MAX_PAYLOAD_BYTES,
    },
    store::{ClaimRequest, Completion, Failure, FailureReason, Store},
    Error, Message, Outbox, Published, Publisher,
};
use outbox_tests::{unique_table, Fixture};

const Q: &str = "big";
const TTL: Duration = Duration::from_secs(60);

/// Headers whose keys and values add up to exactly `total` bytes.
fn headers_of(total: usize) -> Headers {
    let mut h = Headers::new();
    h.insert("k".to_owned(), "v".repeat(total - 1));
    h
}

fn field(e: Error) -> &'static str {
    match e {
        Error::InvalidArgument { field, .. } => field,
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
}

/// A store the limits scenario runs against: publish/cancel through `Publisher`, claims
/// and completions through `Store`, batches and reads through its own methods.
trait Big: Store {
    async fn publish(&self, m: Message<'_>) -> outbox::Result<Published>;
    async fn batch(&self, items: &[BatchItem<'_>]) -> outbox::Result<Vec<i64>>;
    async fn live(&self) -> Vec<outbox::store::StoredRow>;
    async fn dead(&self) -> Vec<outbox::store::DeadLetter>;
    /// Lets a second pass on the store's clock.
    async fn wait_a_second(&self);
}

impl Big for outbox::PgStore {
    async fn publish(&self, m: Message<'_>) -> outbox::Result<Published> {
        self.publish_message(m).await
    }
    async fn batch(&self, items: &[BatchItem<'_>]) -> outbox::Result<Vec<i64>> {
        let mut conn = self.pool().acquire().await?;
        self.outbox()
            .publish_batch(&mut conn, Q, items, Duration::ZERO)
            .await
    }
    async fn live(&self) -> Vec<outbox::store::StoredRow> {
        self.pending(Q, 100).await.unwrap()
    }
    async fn dead(&self) -> Vec<outbox::store::DeadLetter> {
        self.dead_letters(&DeadLetterFilter::new().queue(Q), None, 100)
            .await
            .unwrap()
    }
    async fn wait_a_second(&self) {
        tokio::time::sleep(Duration::from_millis(1100)).await;
    }
}

impl Big for MemoryStore {
    async fn publish(&self, m: Message<'_>) -> outbox::Result<Published> {
        self.publish_message(m).await
    }
    async fn batch(&self, items: &[BatchItem<'_>]) -> outbox::Result<Vec<i64>> {
        self.publish_batch(Q, items, Duration::ZERO)
    }
    async fn live(&self) -> Vec<outbox::store::StoredRow> {
        self.pending(Q, 100).unwrap()
    }
    async fn dead(&self) -> Vec<outbox::store::DeadLetter> {
        self.dead_letters(&DeadLetterFilter::new().queue(Q), None, 100)
            .unwrap()
    }
    async fn wait_a_second(&self) {
        self.advance(Duration::from_secs(1));
    }
}

async fn limits_hold_on_every_path<S: Big>(s: &S) {
    let payload = vec![7u8; MAX_PAYLOAD_BYTES];
    let headers = headers_of(MAX_HEADERS_BYTES);
    let over_payload = vec![7u8; MAX_PAYLOAD_BYTES + 1];
    let over_headers = headers_of(MAX_HEADERS_BYTES + 1);
    let queues = [Q.to_owned()];

    // One byte over, on every way in: nothing is written.
    let e = s.publish(Message::new(Q, &over_payload)).await.unwrap_err();
    assert_eq!(field(e), "payload");
    let e = s
        .publish(Message::new(Q, b"x").headers(&over_headers))
        .await
        .unwrap_err();
    assert_eq!(field(e), "headers");
    let e = s
        .publish(
            Message::new(Q, &over_payload)
                .timer_id("t")
                .on_conflict(OnConflict::Extend),
        )
        .await
        .unwrap_err();
    assert_eq!(field(e), "payload");
    let e = s
        .batch(&[BatchItem::new(b"ok"), BatchItem::new(&over_payload)])
        .await
        .unwrap_err();
    assert_eq!(field(e), "payload");
    let e = s
        .batch(&[BatchItem {
            payload: b"ok",
            headers: Some(&over_headers),
        }])
        .await
        .unwrap_err();
    assert_eq!(field(e), "headers");
    assert!(s.live().await.is_empty(), "nothing was written");

    // Exactly at the limit: publish, pending, claim.
    let first = s
        .publish(
            Message::new(Q, &payload)
                .headers(&headers)
                .timer_id("t")
                .on_conflict(OnConflict::Extend),
        )
        .await
        .unwrap();
    assert!(matches!(first, Published::Inserted { .. }), "{first:?}");
    let live = s.live().await;
    assert_eq!(live.len(), 1);
    assert_eq!(live[0].payload.len(), MAX_PAYLOAD_BYTES);
    assert_eq!(live[0].headers.as_ref(), Some(&headers));
    let d = s
        .claim(ClaimRequest::new(&queues, 10, TTL))
        .await
        .unwrap()
        .remove(0);
    assert_eq!(d.payload.len(), MAX_PAYLOAD_BYTES);
    assert_eq!(d.headers.as_ref(), Some(&headers));

    // Extend of the running row (a second past its claimed deadline): the rearm holds both
    // at the limit, and the ack installs it.
    let mut other = payload.clone();
    other[0] = 8;
    let queued = s
        .publish(
            Message::new(Q, &other)
                .headers(&headers)
                .timer_id("t")
                .schedule(Duration::from_secs(1))
                .on_conflict(OnConflict::Extend),
        )
        .await
        .unwrap();
    assert!(
        matches!(queued, Published::RearmQueued { .. }),
        "{queued:?}"
    );
    let live = s.live().await;
    assert_eq!(
        live[0].rearm_payload.as_ref().map(Vec::len),
        Some(MAX_PAYLOAD_BYTES)
    );
    assert_eq!(live[0].rearm_headers.as_ref(), Some(&headers));
    let done = s.ack(d.lease).await.unwrap();
    assert!(matches!(done, Completion::Rearmed { .. }), "{done:?}");
    let live = s.live().await;
    assert_eq!(live[0].payload, other);
    assert_eq!(live[0].headers.as_ref(), Some(&headers));

    // The dead-letter archive keeps both whole.
    s.wait_a_second().await;
    let d = s
        .claim(ClaimRequest::new(&queues, 10, TTL))
        .await
        .unwrap()
        .remove(0);
    let failure = Failure {
        reason: FailureReason::Rejected,
        last_error: Some("too big to live"),
    };
    assert_eq!(s.fail(d.lease, failure).await.unwrap(), Completion::Deleted);
    let dead = s.dead().await;
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].payload, other);
    assert_eq!(dead[0].headers.as_ref(), Some(&headers));

    // A batch item at the limit.
    let ids = s
        .batch(&[BatchItem {
            payload: &payload,
            headers: Some(&headers),
        }])
        .await
        .unwrap();
    assert_eq!(ids.len(), 1);
    let live = s.live().await;
    assert_eq!(live[0].payload.len(), MAX_PAYLOAD_BYTES);

    // A whole batch: its payloads and headers travel as one statement's values, which
    // Postgres cannot take near 1 GiB (17 items of 64 MiB reset the connection and lost
    // the caller's transaction). One byte over MAX_BATCH_BYTES is refused before any SQL;
    // exactly at it, the batch is written.
    let quarter = MAX_BATCH_BYTES / 4;
    let big = &payload[..quarter.min(MAX_PAYLOAD_BYTES)];
    assert_eq!(big.len() * 4, MAX_BATCH_BYTES, "four payloads fill a batch");
    let at_limit = [
        BatchItem::new(big),
        BatchItem::new(big),
        BatchItem::new(big),
        BatchItem::new(big),
    ];
    let mut over = at_limit.to_vec();
    over.push(BatchItem::new(b"x"));
    let e = s.batch(&over).await.unwrap_err();
    assert_eq!(field(e), "items");
    assert_eq!(
        s.live().await.len(),
        1,
        "nothing of the refused batch was written"
    );
    let ids = s.batch(&at_limit).await.unwrap();
    assert_eq!(ids.len(), 4);
}

#[tokio::test]
async fn limits_hold_on_every_path_on_postgres() {
    let f = Fixture::new().await;
    limits_hold_on_every_path(&f.store).await;
    f.cleanup().await;
}

#[tokio::test]
async fn limits_hold_on_every_path_in_memory() {
    let store = MemoryStore::new().with_dead_letter(true);
    limits_hold_on_every_path(&store).await;
}

/// SPEC §2.1: a publish where the tables do not exist says to run `migrate()`.
#[tokio::test]
async fn a_publish_before_migrate_says_to_run_migrate() {
    let pool = outbox_tests::pool_with(1).await;
    let outbox = Outbox::builder()
        .table(unique_table("never"))
        .build()
        .unwrap();
    let mut conn = pool.acquire().await.unwrap();
    for message in [
        Message::new(Q, b"x"),
        Message::new(Q, b"x")
            .timer_id("k")
            .on_conflict(OnConflict::Extend),
    ] {
        let err = outbox.publish(&mut conn, message).await.unwrap_err();
        assert!(matches!(err, Error::NotMigrated { .. }), "{err:?}");
        let text = err.to_string();
        assert!(text.contains("migrate"), "{text}");
        assert!(text.contains(outbox.table().trim_matches('"')), "{text}");
    }
    let err = outbox.cancel(&mut conn, Q, "k").await.unwrap_err();
    assert!(matches!(err, Error::NotMigrated { .. }), "{err:?}");
}
