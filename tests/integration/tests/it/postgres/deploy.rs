//! Rolling deploy (SPEC §1.3, v2; outbox/docs/upgrading.md "Deploy order"): the previous
//! version's statements, as SQL, run against this version's schema beside this version's
//! code, and each outcome is the one the upgrade guide documents.
//!
//! `v1` below is the previous release's SQL for the statements whose behaviour differs
//! (claim, success, retry, terminal failure, extend, cancel, plain publish), rendered for the
//! test's table. Their `pg_notify` wake-ups are left out: they change no row.

use std::time::Duration;

use sqlx::{AssertSqlSafe, PgPool, Row};
use uuid::Uuid;

use outbox::dlq::DeadLetterFilter;
use outbox::{
    message::OnConflict,
    store::{ClaimRequest, Completion, Lease, Store},
    Cancelled, Message, Outbox, PgStore, Published,
};
use outbox_tests::{pool, unique_table};

/// The previous release's statements (outbox 0.1, commit 71e0eca), for one table.
struct V1 {
    t: String,
    d: String,
}

impl V1 {
    /// `$1` queue, `$2` payload: a plain publish.
    fn publish(&self) -> String {
        format!(
            "INSERT INTO {} (queue, payload, next_attempt_at) VALUES ($1, $2, now()) RETURNING id",
            self.t
        )
    }

    /// `$1` queue, `$2` payload, `$3` deadline, `$4` timer id: the extend (ON CONFLICT).
    fn extend(&self) -> String {
        let t = &self.t;
        let pending = "t.acquired_token IS NULL";
        format!(
            "INSERT INTO {t} AS t (queue, payload, headers, next_attempt_at, timer_id) \
             VALUES ($1, $2, NULL, $3, $4) \
             ON CONFLICT (queue, timer_id) WHERE timer_id IS NOT NULL DO UPDATE SET \
               next_attempt_at  = CASE WHEN {pending} THEN excluded.next_attempt_at ELSE t.next_attempt_at END, \
               payload          = CASE WHEN {pending} THEN excluded.payload ELSE t.payload END, \
               headers          = CASE WHEN {pending} THEN excluded.headers ELSE t.headers END, \
               attempts_count   = CASE WHEN {pending} THEN 0 ELSE t.attempts_count END, \
               first_attempt_at = CASE WHEN {pending} THEN NULL ELSE t.first_attempt_at END, \
               last_attempt_at  = CASE WHEN {pending} THEN NULL ELSE t.last_attempt_at END, \
               rearm_at         = CASE WHEN {pending} THEN t.rearm_at ELSE excluded.next_attempt_at END, \
               rearm_payload    = CASE WHEN {pending} THEN t.rearm_payload ELSE excluded.payload END, \
               rearm_headers    = CASE WHEN {pending} THEN t.rearm_headers ELSE excluded.headers END \
             WHERE excluded.next_attempt_at > CASE WHEN {pending} THEN t.next_attempt_at \
                                                   ELSE greatest(t.next_attempt_at, t.rearm_at) END \
             RETURNING t.id"
        )
    }

    /// `$1` queues, `$2` limit, `$3` lease ttl, `$4` token: the claim.
    fn claim(&self) -> String {
        let t = &self.t;
        format!(
            "WITH cand AS (\
               SELECT c.id, c.next_attempt_at FROM unnest($1::text[]) AS q(queue) \
               CROSS JOIN LATERAL (\
                 SELECT id, next_attempt_at FROM {t} \
                 WHERE queue = q.queue AND acquired_token IS NULL AND next_attempt_at <= now() \
                 ORDER BY next_attempt_at LIMIT $2 FOR UPDATE SKIP LOCKED) c \
               UNION ALL \
               SELECT c.id, c.next_attempt_at FROM unnest($1::text[]) AS q(queue) \
               CROSS JOIN LATERAL (\
                 SELECT id, next_attempt_at FROM {t} \
                 WHERE queue = q.queue AND acquired_token IS NOT NULL \
                   AND acquired_at < now() - $3::interval AND next_attempt_at <= now() \
                 ORDER BY acquired_at LIMIT $2 FOR UPDATE SKIP LOCKED) c), \
             due AS (SELECT id FROM cand ORDER BY next_attempt_at, id LIMIT $2) \
             UPDATE {t} t SET acquired_token = $4, acquired_at = now(), \
                              deliveries_count = t.deliveries_count + 1 \
             FROM due WHERE t.id = due.id RETURNING t.id"
        )
    }

    /// `$1` id, `$2` token: the success path's DELETE.
    fn ack_delete(&self) -> String {
        format!(
            "DELETE FROM {} WHERE id = $1 AND acquired_token = $2 AND rearm_at IS NULL",
            self.t
        )
    }

    /// `$1` id, `$2` token: the success follow-up that applies a queued rearm.
    fn ack_settle(&self) -> String {
        let t = &self.t;
        format!(
            "WITH cur AS (SELECT id, rearm_at IS NOT NULL AS rearm FROM {t} \
                          WHERE id = $1 AND acquired_token = $2 FOR UPDATE), \
             deleted AS (DELETE FROM {t} t USING cur WHERE t.id = cur.id AND NOT cur.rearm), \
             rearmed AS (UPDATE {t} t SET {APPLY_REARM} FROM cur \
                         WHERE t.id = cur.id AND cur.rearm RETURNING t.next_attempt_at) \
             SELECT (SELECT count(*) FROM cur), (SELECT next_attempt_at FROM rearmed)"
        )
    }

    /// `$1` id, `$2` token, `$3` delay: a failed run's retry.
    fn retry(&self) -> String {
        let t = &self.t;
        format!(
            "WITH cur AS (SELECT id, rearm_at IS NOT NULL AS rearm FROM {t} \
                          WHERE id = $1 AND acquired_token = $2 FOR UPDATE) \
             UPDATE {t} t SET \
               next_attempt_at = CASE WHEN t.rearm_at IS NOT NULL THEN t.rearm_at ELSE now() + $3::interval END, \
               payload = CASE WHEN t.rearm_at IS NOT NULL THEN t.rearm_payload ELSE t.payload END, \
               headers = CASE WHEN t.rearm_at IS NOT NULL THEN t.rearm_headers ELSE t.headers END, \
               attempts_count = t.attempts_count + 1, \
               first_attempt_at = coalesce(t.first_attempt_at, now()), \
               last_attempt_at = now(), \
               rearm_at = NULL, rearm_payload = NULL, rearm_headers = NULL, \
               acquired_token = NULL, acquired_at = NULL \
             FROM cur WHERE t.id = cur.id RETURNING t.next_attempt_at"
        )
    }

    /// `$1` id, `$2` token, `$3` reason, `$4` last error: a terminal failure, archived.
    fn fail_archive(&self) -> String {
        let (t, d) = (&self.t, &self.d);
        format!(
            "WITH cur AS (SELECT id, queue, payload, headers, timer_id, attempts_count, \
                                 deliveries_count, created_at, rearm_at IS NOT NULL AS rearm \
                          FROM {t} WHERE id = $1 AND acquired_token = $2 FOR UPDATE), \
             archived AS (INSERT INTO {d} (original_id, queue, payload, headers, timer_id, \
                            attempts_count, deliveries_count, created_at, failure_reason, last_error) \
                          SELECT id, queue, payload, headers, timer_id, attempts_count + 1, \
                                 deliveries_count, created_at, $3, $4 FROM cur), \
             deleted AS (DELETE FROM {t} t USING cur WHERE t.id = cur.id AND NOT cur.rearm), \
             rearmed AS (UPDATE {t} t SET {APPLY_REARM} FROM cur \
                         WHERE t.id = cur.id AND cur.rearm RETURNING t.next_attempt_at) \
             SELECT (SELECT count(*) FROM cur)"
        )
    }

    /// `$1` queue, `$2` timer id: the cancel's row lock.
    fn cancel_lock(&self) -> String {
        format!(
            "SELECT id, acquired_token, rearm_at IS NOT NULL FROM {} \
             WHERE queue = $1 AND timer_id = $2 FOR UPDATE",
            self.t
        )
    }

    /// `$1` id, `$2` token: the cancel of a running row (drops its rearm, nothing more).
    fn cancel_drop_rearm(&self) -> String {
        format!(
            "UPDATE {} SET rearm_at = NULL, rearm_payload = NULL, rearm_headers = NULL \
             WHERE id = $1 AND acquired_token = $2 AND rearm_at IS NOT NULL",
            self.t
        )
    }
}

const APPLY_REARM: &str =
    "next_attempt_at = t.rearm_at, payload = t.rearm_payload, headers = t.rearm_headers, \
     rearm_at = NULL, rearm_payload = NULL, rearm_headers = NULL, \
     acquired_token = NULL, acquired_at = NULL, \
     attempts_count = 0, first_attempt_at = NULL, last_attempt_at = NULL, deliveries_count = 0";

const QUEUE: &str = "presence";

struct Fixture {
    pool: PgPool,
    outbox: Outbox,
    store: PgStore,
    v1: V1,
    name: String,
}

impl Fixture {
    async fn new(prefix: &str) -> Fixture {
        let pool = pool().await;
        let name = unique_table(prefix);
        let outbox = Outbox::builder()
            .table(&name)
            .dead_letter(true)
            .build()
            .unwrap();
        outbox.migrate(&pool).await.unwrap();
        let v1 = V1 {
            t: outbox.table().to_owned(),
            d: outbox.dead_letter_table().to_owned(),
        };
        let store = PgStore::new(pool.clone(), outbox.clone());
        Fixture {
            pool,
            outbox,
            store,
            v1,
            name,
        }
    }

    async fn cleanup(self) {
        sqlx::raw_sql(AssertSqlSafe(format!(
            "DROP TABLE IF EXISTS {}, {}, {}, {}",
            self.outbox.table(),
            self.outbox.dead_letter_table(),
            self.outbox.migrations_table(),
            self.outbox.paused_table()
        )))
        .execute(&self.pool)
        .await
        .unwrap();
    }

    /// This version publishes the timer `key`, due now.
    async fn publish_timer(&self, key: &str) -> i64 {
        let mut conn = self.pool.acquire().await.unwrap();
        let m = Message::new(QUEUE, b"run 1").timer_id(key);
        match self.outbox.publish(&mut conn, m).await.unwrap() {
            Published::Inserted { id } => id,
            other => panic!("{other:?}"),
        }
    }

    /// A worker of the previous version claims; `lease_ttl` "0" reclaims expired leases.
    async fn v1_claim(&self, lease_ttl: &str) -> Vec<Lease> {
        let token = Uuid::new_v4();
        let ids: Vec<i64> = sqlx::query_scalar(AssertSqlSafe(self.v1.claim()))
            .bind(vec![QUEUE.to_owned()])
            .bind(10_i64)
            .bind(lease_ttl)
            .bind(token)
            .fetch_all(&self.pool)
            .await
            .unwrap();
        ids.into_iter().map(|id| Lease { id, token }).collect()
    }

    async fn claim(&self, lease_ttl: Duration) -> Vec<Lease> {
        let queues = [QUEUE.to_owned()];
        self.store
            .claim(ClaimRequest::new(&queues, 10, lease_ttl))
            .await
            .unwrap()
            .into_iter()
            .map(|d| d.lease)
            .collect()
    }

    async fn cancel(&self, key: &str) -> Cancelled {
        let mut conn = self.pool.acquire().await.unwrap();
        self.outbox.cancel(&mut conn, QUEUE, key).await.unwrap()
    }

    /// A publisher of the previous version extends `key` to `secs` from now.
    async fn v1_extend(&self, key: &str, secs: i64) {
        sqlx::query(AssertSqlSafe(self.v1.extend()))
            .bind(QUEUE)
            .bind(b"run 2".to_vec())
            .bind(chrono::Utc::now() + chrono::TimeDelta::seconds(secs))
            .bind(key)
            .execute(&self.pool)
            .await
            .unwrap();
    }

    /// `(leased, rearm queued, cancelled_at set)` of row `id`, or None once it is gone.
    async fn state(&self, id: i64) -> Option<(bool, bool, bool)> {
        sqlx::query(AssertSqlSafe(format!(
            "SELECT acquired_token IS NOT NULL, rearm_at IS NOT NULL, cancelled_at IS NOT NULL \
             FROM {} WHERE id = $1",
            self.outbox.table()
        )))
        .bind(id)
        .fetch_optional(&self.pool)
        .await
        .unwrap()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
    }

    /// The error a previous-version statement gets: a CHECK violation of `<t>_cancel_ck`.
    fn assert_cancel_check_violation(&self, e: sqlx::Error) {
        let db = e.as_database_error().expect("a database error");
        assert_eq!(db.code().as_deref(), Some("23514"), "{db}");
        assert_eq!(
            db.constraint(),
            Some(format!("{}_cancel_ck", self.name).as_str())
        );
    }
}

/// Where no cancel mark is involved, the previous version's publish, claim, success, retry,
/// terminal failure and extend work on this schema and mix with this version's.
#[tokio::test]
async fn previous_version_statements_work_on_the_new_schema() {
    let f = Fixture::new("dep_plain").await;
    // Old publish, old claim, old success.
    let id: i64 = sqlx::query_scalar(AssertSqlSafe(f.v1.publish()))
        .bind(QUEUE)
        .bind(b"plain".to_vec())
        .fetch_one(&f.pool)
        .await
        .unwrap();
    let leases = f.v1_claim("60 seconds").await;
    assert_eq!(
        leases,
        vec![Lease {
            id,
            token: leases[0].token
        }]
    );
    let deleted = sqlx::query(AssertSqlSafe(f.v1.ack_delete()))
        .bind(id)
        .bind(leases[0].token)
        .execute(&f.pool)
        .await
        .unwrap();
    assert_eq!(deleted.rows_affected(), 1);

    // New claim, old retry; old claim, new ack.
    let id = f.publish_timer("k1").await;
    let lease = f.claim(Duration::from_secs(60)).await[0];
    let rescheduled = sqlx::query(AssertSqlSafe(f.v1.retry()))
        .bind(id)
        .bind(lease.token)
        .bind("0 seconds")
        .execute(&f.pool)
        .await
        .unwrap();
    assert_eq!(rescheduled.rows_affected(), 1);
    assert_eq!(f.state(id).await, Some((false, false, false)));
    let lease = f.v1_claim("60 seconds").await[0];
    assert_eq!(f.store.ack(lease).await.unwrap(), Completion::Deleted);

    // Old extend of a running row queues a rearm that this version's success applies.
    let id = f.publish_timer("k2").await;
    let lease = f.claim(Duration::from_secs(60)).await[0];
    f.v1_extend("k2", 3600).await;
    assert_eq!(f.state(id).await, Some((true, true, false)));
    assert!(matches!(
        f.store.ack(lease).await.unwrap(),
        Completion::Rearmed { .. }
    ));

    // Old terminal failure archives into the new dead-letter table.
    let id: i64 = sqlx::query_scalar(AssertSqlSafe(f.v1.publish()))
        .bind(QUEUE)
        .bind(b"poison".to_vec())
        .fetch_one(&f.pool)
        .await
        .unwrap();
    let lease = f.v1_claim("60 seconds").await[0];
    assert_eq!(lease.id, id);
    let locked: i64 = sqlx::query_scalar(AssertSqlSafe(f.v1.fail_archive()))
        .bind(id)
        .bind(lease.token)
        .bind("rejected")
        .bind("old worker")
        .fetch_one(&f.pool)
        .await
        .unwrap();
    assert_eq!(locked, 1);
    assert_eq!(f.state(id).await, None);
    let letters = f
        .store
        .dead_letters(&DeadLetterFilter::new().queue(QUEUE), None, 10)
        .await
        .unwrap();
    assert_eq!(letters.len(), 1);
    assert_eq!(letters[0].original_id, id);
    f.cleanup().await;
}

/// "Deploy order": a previous-version worker's retry of a row this version's publisher
/// cancelled while it ran breaks `<t>_cancel_ck` (it clears the lease, not the mark), so
/// that completion fails and the row stays leased until its lease expires. Then this
/// version's claim deletes it; a previous-version claim runs it once more.
#[tokio::test]
async fn previous_version_retry_of_a_cancelled_row_fails_and_the_row_comes_back() {
    let f = Fixture::new("dep_retry").await;
    let a = f.publish_timer("a").await;
    let b = f.publish_timer("b").await;
    let leases = f.v1_claim("60 seconds").await;
    assert_eq!(leases.len(), 2);
    assert_eq!(f.cancel("a").await, Cancelled::Running { id: a });
    assert_eq!(f.cancel("b").await, Cancelled::Running { id: b });
    for lease in &leases {
        let err = sqlx::query(AssertSqlSafe(f.v1.retry()))
            .bind(lease.id)
            .bind(lease.token)
            .bind("5 seconds")
            .execute(&f.pool)
            .await
            .unwrap_err();
        f.assert_cancel_check_violation(err);
        assert_eq!(f.state(lease.id).await, Some((true, false, true)));
    }
    tokio::time::sleep(Duration::from_millis(50)).await;

    // This version's claim of an expired marked row deletes it: the cancel sticks.
    let queues = [QUEUE.to_owned()];
    let ids = [a];
    let only_a = ClaimRequest::new(&queues, 1, Duration::from_millis(10)).only(&ids);
    assert!(f.store.claim(only_a).await.unwrap().is_empty());
    assert_eq!(f.state(a).await, None);

    // The previous version's claim runs it once more; its success then deletes it.
    let again = f.v1_claim("0 seconds").await;
    assert_eq!(again.len(), 1);
    assert_eq!(again[0].id, b);
    let deleted = sqlx::query(AssertSqlSafe(f.v1.ack_delete()))
        .bind(b)
        .bind(again[0].token)
        .execute(&f.pool)
        .await
        .unwrap();
    assert_eq!(deleted.rows_affected(), 1);
    f.cleanup().await;
}

/// "Deploy order": a previous-version publisher's extend after this version's cancel queues
/// a rearm without clearing the mark. Where both are set the rearm wins: this version's
/// completion applies it (and clears the mark); a previous-version worker's success fails on
/// `<t>_cancel_ck` and the row comes back after its lease.
#[tokio::test]
async fn previous_version_extend_after_a_cancel_the_rearm_wins() {
    let f = Fixture::new("dep_extend").await;
    let a = f.publish_timer("a").await;
    let lease = f.claim(Duration::from_secs(60)).await[0];
    assert_eq!(f.cancel("a").await, Cancelled::Running { id: a });
    f.v1_extend("a", 3600).await;
    assert_eq!(f.state(a).await, Some((true, true, true)), "rearm and mark");
    match f.store.ack(lease).await.unwrap() {
        Completion::Rearmed { at } => assert!(at > chrono::Utc::now()),
        other => panic!("the rearm wins: {other:?}"),
    }
    assert_eq!(f.state(a).await, Some((false, false, false)));

    // The same with a previous-version worker running the row.
    let b = f.publish_timer("b").await;
    let old = f.v1_claim("60 seconds").await;
    assert_eq!(old.len(), 1);
    assert_eq!(f.cancel("b").await, Cancelled::Running { id: b });
    f.v1_extend("b", 3600).await;
    let deleted = sqlx::query(AssertSqlSafe(f.v1.ack_delete()))
        .bind(b)
        .bind(old[0].token)
        .execute(&f.pool)
        .await
        .unwrap();
    assert_eq!(deleted.rows_affected(), 0, "a queued rearm: no DELETE");
    let err = sqlx::query(AssertSqlSafe(f.v1.ack_settle()))
        .bind(b)
        .bind(old[0].token)
        .execute(&f.pool)
        .await
        .unwrap_err();
    f.assert_cancel_check_violation(err);
    assert_eq!(
        f.state(b).await,
        Some((true, true, true)),
        "nothing changed"
    );
    f.cleanup().await;
}

/// "Deploy order": a previous-version publisher's cancel of a running row only drops its
/// rearm; without the mark, the run's retry still reschedules the timer (the behaviour
/// before the mark existed).
#[tokio::test]
async fn previous_version_cancel_of_a_running_row_leaves_no_mark() {
    let f = Fixture::new("dep_cancel").await;
    let a = f.publish_timer("a").await;
    let lease = f.claim(Duration::from_secs(60)).await[0];
    let mut conn = f.pool.acquire().await.unwrap();
    let extended = f
        .outbox
        .publish(
            &mut conn,
            Message::new(QUEUE, b"run 2")
                .timer_id("a")
                .on_conflict(OnConflict::Extend)
                .schedule(chrono::Utc::now() + chrono::TimeDelta::hours(1)),
        )
        .await
        .unwrap();
    assert_eq!(extended, Published::RearmQueued { id: a });

    let mut tx = f.pool.begin().await.unwrap();
    let row = sqlx::query(AssertSqlSafe(f.v1.cancel_lock()))
        .bind(QUEUE)
        .bind("a")
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    let token: Option<Uuid> = row.get(1);
    let dropped = sqlx::query(AssertSqlSafe(f.v1.cancel_drop_rearm()))
        .bind(a)
        .bind(token)
        .execute(&mut *tx)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(dropped.rows_affected(), 1);
    assert_eq!(f.state(a).await, Some((true, false, false)), "no mark");

    match f.store.retry(lease, Duration::from_secs(30)).await.unwrap() {
        Completion::RetryScheduled { .. } => {}
        other => panic!("an unmarked row is retried: {other:?}"),
    }
    assert_eq!(f.state(a).await, Some((false, false, false)));
    f.cleanup().await;
}
