//! The contract suite (SPEC §10): every storage scenario is written once, as a
//! function generic over [`Harness`], and runs against Postgres (`postgres::*`) and the
//! in-memory store (`memory::*`) with the same hand-written expected values.
//!
//! Both stores start at [`start`] (2030-01-01T00:00:00Z) and their clocks move only when a
//! scenario advances them, so expected timestamps are exact: `at(5)` is five seconds after
//! the start. See `outbox_tests::contract` for how Postgres gets such a clock.
//!
//! One file per concern (claim, fair, complete, publish, rearm, cancel, wakeup, read, dlq,
//! admin, stats, periodic); each ends with the `contract!` list of its scenarios. The helpers
//! shared by several concerns are here.

use std::time::Duration;

use chrono::{DateTime, TimeDelta, Utc};
use outbox::dlq::{DeadLetterFilter, Redrive, RedriveOutcome, RedriveResult, REDRIVEN_FROM_HEADER};
use outbox::store::MAX_LAST_ERROR_BYTES;
use outbox::{
    admin::RowAction,
    message::{BatchItem, Headers, OnConflict, Schedule, MAX_HEADERS_BYTES},
    stats::{Count, QueueStats, StatsMode, StatsRequest},
    store::{
        Armed, ClaimRequest, Completion, DeadLetter, Delivery, Failure, FailureReason, Lease,
        RegisterSchedule, Registered, Release, Released, Renewal, Store, StoredRow, Wakeup,
        SCHEDULE_HEADER,
    },
    Cancelled, Error, Message, Published,
};
use outbox_tests::contract::{start, Harness, MemHarness, PgHarness};
use uuid::Uuid;

/// Runs each scenario against both stores: `postgres::<name>` and `memory::<name>`.
macro_rules! contract {
    ($($name:ident(dead_letter = $dlq:expr);)*) => {
        mod postgres {
            use super::*;
            $(
                #[tokio::test]
                async fn $name() {
                    let h = PgHarness::new($dlq).await;
                    super::$name(&h).await;
                    h.finish().await;
                }
            )*
        }
        mod memory {
            use super::*;
            $(
                #[tokio::test]
                async fn $name() {
                    let h = MemHarness::new($dlq).await;
                    super::$name(&h).await;
                    h.finish().await;
                }
            )*
        }
    };
}

mod admin;
mod cancel;
mod claim;
mod complete;
mod dlq;
mod fair;
mod periodic;
mod publish;
mod read;
mod rearm;
mod stats;
mod wakeup;

const Q: &str = "q.main";
const Q2: &str = "q.other";
const Q3: &str = "q.third";
const TTL: Duration = Duration::from_secs(30);

/// `s` seconds after the start.
fn at(s: i64) -> DateTime<Utc> {
    start() + TimeDelta::seconds(s)
}

fn us(n: i64) -> TimeDelta {
    TimeDelta::microseconds(n)
}

fn secs(s: u64) -> Duration {
    Duration::from_secs(s)
}

/// A plain message on `Q`, due `delay_s` seconds from now.
fn plain(payload: &[u8], delay_s: u64) -> Message<'_> {
    Message::new(Q, payload).schedule(secs(delay_s))
}

/// `extend` of timer `key` on `Q` to `schedule`.
fn extend<'a>(key: &'a str, payload: &'a [u8], schedule: impl Into<Schedule>) -> Message<'a> {
    Message::new(Q, payload)
        .timer_id(key)
        .schedule(schedule)
        .on_conflict(OnConflict::Extend)
}

/// `publish` (Ignore) of timer `key` on `Q` to `schedule`.
fn schedule<'a>(key: &'a str, payload: &'a [u8], schedule: impl Into<Schedule>) -> Message<'a> {
    Message::new(Q, payload).timer_id(key).schedule(schedule)
}

/// The next `n` wake-up hints, each within 10 s.
async fn next_hints(hints: &mut tokio::sync::mpsc::Receiver<Wakeup>, n: usize) -> Vec<Wakeup> {
    let mut got = Vec::with_capacity(n);
    while got.len() < n {
        let next = tokio::time::timeout(secs(10), hints.recv()).await;
        got.push(
            next.expect("a hint within 10 s")
                .expect("the hint channel is open"),
        );
    }
    got
}

fn rejected(last_error: Option<&str>) -> Failure<'_> {
    Failure {
        reason: FailureReason::Rejected,
        last_error,
    }
}

/// The row a fresh publish at `at(0)` writes: pending, no history.
fn row(id: i64, queue: &str, payload: &[u8], due: DateTime<Utc>) -> StoredRow {
    StoredRow {
        id,
        queue: queue.to_owned(),
        payload: payload.to_vec(),
        headers: None,
        attempts_count: 0,
        deliveries_count: 0,
        created_at: at(0),
        next_attempt_at: due,
        first_attempt_at: None,
        last_attempt_at: None,
        acquired_at: None,
        acquired_token: None,
        timer_id: None,
        rearm_at: None,
        rearm_payload: None,
        rearm_headers: None,
        cancelled_at: None,
        raw_headers: None,
        raw_rearm_headers: None,
    }
}

/// `row` as a timer.
fn timer_row(id: i64, key: &str, payload: &[u8], due: DateTime<Utc>) -> StoredRow {
    StoredRow {
        timer_id: Some(key.to_owned()),
        ..row(id, Q, payload, due)
    }
}

/// `r` leased by `d` at `claimed`, after `deliveries` claims.
fn leased(r: StoredRow, d: &Delivery, claimed: DateTime<Utc>, deliveries: i32) -> StoredRow {
    StoredRow {
        acquired_token: Some(d.lease.token),
        acquired_at: Some(claimed),
        deliveries_count: deliveries,
        ..r
    }
}

fn with_rearm(r: StoredRow, rearm_at: DateTime<Utc>, payload: &[u8]) -> StoredRow {
    StoredRow {
        rearm_at: Some(rearm_at),
        rearm_payload: Some(payload.to_vec()),
        ..r
    }
}

fn headers(pairs: &[(&str, &str)]) -> Headers {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

async fn publish<H: Harness>(h: &H, m: Message<'_>) -> Published {
    h.publish(m).await.expect("publish")
}

async fn claim<H: Harness>(h: &H, queues: &[&str], limit: usize) -> Vec<Delivery> {
    let queues: Vec<String> = queues.iter().map(|q| (*q).to_owned()).collect();
    h.store()
        .claim(ClaimRequest::new(&queues, limit, TTL))
        .await
        .expect("claim")
}

async fn claim_one<H: Harness>(h: &H) -> Delivery {
    let mut got = claim(h, &[Q], 10).await;
    assert_eq!(
        got.len(),
        1,
        "{}: expected one claimable row: {got:#?}",
        H::NAME
    );
    got.remove(0)
}

fn ids(ds: &[Delivery]) -> Vec<i64> {
    ds.iter().map(|d| d.lease.id).collect()
}

async fn rows<H: Harness>(h: &H, queue: &str) -> Vec<StoredRow> {
    h.pending(queue, 1000).await.expect("pending")
}

async fn only_row<H: Harness>(h: &H) -> StoredRow {
    let mut rows = rows(h, Q).await;
    assert_eq!(
        rows.len(),
        1,
        "{}: expected exactly one row: {rows:#?}",
        H::NAME
    );
    rows.remove(0)
}

async fn dead_letters<H: Harness>(h: &H) -> Vec<DeadLetter> {
    h.dead_letters(Q, 1000).await.expect("dead letters")
}

fn wrong(lease: Lease) -> Lease {
    Lease {
        id: lease.id,
        token: Uuid::new_v4(),
    }
}

fn invalid_field(e: Error) -> &'static str {
    match e {
        Error::InvalidArgument { field, .. } => field,
        other => panic!("expected an invalid argument, got {other:?}"),
    }
}

/// Publishes `payload` on `queue` (timer `key` if given, with `hs` if given) due now, claims
/// it and fails it with `reason` (last error "e"): one dead letter archived at the current
/// clock. Returns the queue row's id.
async fn archive<H: Harness>(
    h: &H,
    queue: &str,
    key: Option<&str>,
    payload: &[u8],
    hs: Option<&Headers>,
    reason: FailureReason,
) -> i64 {
    let mut m = Message::new(queue, payload);
    if let Some(k) = key {
        m = m.timer_id(k);
    }
    if let Some(hs) = hs {
        m = m.headers(hs);
    }
    let id = publish(h, m).await.id().expect("a fresh row");
    let mut got = claim(h, &[queue], 10).await;
    assert_eq!(got.len(), 1, "{}: one row to fail", H::NAME);
    let d = got.remove(0);
    assert_eq!(d.lease.id, id);
    let failure = Failure {
        reason,
        last_error: Some("e"),
    };
    assert_eq!(
        h.store().fail(d.lease, failure).await.unwrap(),
        Completion::Deleted
    );
    id
}
