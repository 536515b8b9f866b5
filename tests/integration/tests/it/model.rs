//! Model-based test: random sequences of storage operations applied in lockstep
//! to Postgres and to the in-memory store, comparing every outcome and the whole observable
//! state (live rows, dead-letter rows, the clock) after every step.
//!
//! Both stores run on the frozen test clock of `outbox_tests::contract`, so timestamps are
//! compared exactly. Lease tokens are random in each store; they are compared through the
//! claim that issued them (the n-th claim of the case).
//!
//! Two rules keep the comparison about behaviour rather than about Postgres' physical row
//! order, the one thing the in-memory store does not model:
//! - after every operation both clocks move on by 1 ms, and absolute deadlines carry a
//!   per-timer microsecond, so two rows never share a deadline by accident;
//! - a claim whose `limit` would cut through expired leases taken by one earlier claim
//!   (they share `acquired_at`) takes them all instead: Postgres picks among such ties in
//!   index order, the in-memory store by id.
//!
//! Failing cases are kept in `proptest-regressions/model.txt` and replayed first.

use std::collections::HashMap;
use std::time::Duration;

use chrono::{DateTime, TimeDelta, Utc};
use outbox::{
    message::{BatchItem, Headers, OnConflict, Schedule},
    store::{
        ClaimRequest, Completion, DeadLetter, Delivery, Failure, FailureReason, Lease, Store,
        StoredRow,
    },
    Error, Message,
};
use outbox_tests::contract::{Harness, MemHarness, PgHarness};
use proptest::prelude::*;
use proptest::sample::Index;
use proptest::test_runner::{Config, FileFailurePersistence, TestCaseError, TestRunner};
use uuid::Uuid;

/// Queues 0 and 1 hold rows; 2 is never published to (claims may still name it).
const QUEUES: [&str; 3] = ["m.a", "m.b", "m.none"];
const KEYS: [&str; 3] = ["k0", "k1", "k2"];
const TTL: Duration = Duration::from_secs(30);
const TICK: Duration = Duration::from_millis(1);

#[derive(Debug, Clone)]
enum Sched {
    Now,
    /// Seconds from now.
    After(u8),
    /// Seconds from now (may be negative), as an absolute time.
    At(i8),
    /// A negative delay: rejected by both stores.
    Negative,
}

#[derive(Debug, Clone)]
enum Pick {
    /// A lease that still holds its row, if there is one (else as `Known`).
    Live(Index),
    /// A lease some claim returned (possibly long lost).
    Known(Index),
    /// A known row id with a token no claim issued.
    Forged(Index),
}

#[derive(Debug, Clone)]
enum Op {
    Publish {
        queue: usize,
        key: Option<usize>,
        payload: u8,
        headers: bool,
        sched: Sched,
        extend: bool,
    },
    Batch {
        queue: usize,
        n: u8,
        delay: u8,
    },
    /// Extend the timer of a leased row (picked at run time), to exercise rearms.
    ExtendLeased {
        which: Index,
        payload: u8,
        sched: Sched,
    },
    Cancel {
        queue: usize,
        key: usize,
    },
    Claim {
        queues: Vec<usize>,
        limit: usize,
    },
    Ack(Pick),
    AckBatch(Vec<Pick>),
    /// A batched ack of every lease that still holds, after a stale or forged one if `true`.
    AckLive(bool),
    Retry(Pick, u8),
    Fail(Pick, u8, bool),
    /// A lease renewal of the picked leases.
    Renew(Vec<Pick>),
    /// A release at shutdown of the picked leases, each started or not.
    Release(Vec<(Pick, bool)>),
    Advance(u8),
    /// Move the clock so that the next operation runs exactly at (or a microsecond before
    /// or after) a deadline or a lease expiry, picked at run time: the `<=` and `<` edges.
    AdvanceToEdge(Index, i8),
    /// What `AdvanceToEdge` resolves to.
    AdvanceBy(Duration),
    Wakeup(Vec<usize>),
}

fn sched() -> impl Strategy<Value = Sched> {
    prop_oneof![
        2 => Just(Sched::Now),
        4 => (0..20u8).prop_map(Sched::After),
        3 => (-5..20i8).prop_map(Sched::At),
        1 => Just(Sched::Negative),
    ]
}

fn pick() -> impl Strategy<Value = Pick> {
    prop_oneof![
        8 => any::<Index>().prop_map(Pick::Live),
        3 => any::<Index>().prop_map(Pick::Known),
        1 => any::<Index>().prop_map(Pick::Forged),
    ]
}

fn claim() -> impl Strategy<Value = Op> {
    // Mostly served queues; now and then the unserved one, a repeated name, an empty list
    // or a zero limit.
    let queues = prop_oneof![
        12 => prop::collection::vec(prop::sample::select(vec![0usize, 0, 1, 1, 2]), 1..=3),
        1 => Just(Vec::new()),
    ];
    let limit = prop_oneof![12 => 1..5usize, 1 => Just(0usize)];
    (queues, limit).prop_map(|(queues, limit)| Op::Claim { queues, limit })
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        7 => (0..2usize, prop::option::weighted(0.85, 0..3usize), any::<u8>(), any::<bool>(), sched(), prop::bool::weighted(0.6))
            .prop_map(|(queue, key, payload, headers, sched, extend)| Op::Publish { queue, key, payload, headers, sched, extend }),
        1 => (0..2usize, 0..3u8, 0..20u8).prop_map(|(queue, n, delay)| Op::Batch { queue, n, delay }),
        1 => (0..2usize, 0..3usize).prop_map(|(queue, key)| Op::Cancel { queue, key }),
        2 => (any::<Index>(), any::<u8>(), sched()).prop_map(|(which, payload, sched)| Op::ExtendLeased { which, payload, sched }),
        6 => claim(),
        3 => pick().prop_map(Op::Ack),
        1 => prop::collection::vec(pick(), 0..4).prop_map(Op::AckBatch),
        1 => any::<bool>().prop_map(Op::AckLive),
        2 => (pick(), 0..40u8).prop_map(|(p, d)| Op::Retry(p, d)),
        2 => (pick(), 0..4u8, any::<bool>()).prop_map(|(p, r, e)| Op::Fail(p, r, e)),
        1 => prop::collection::vec(pick(), 0..4).prop_map(Op::Renew),
        1 => prop::collection::vec((pick(), any::<bool>()), 0..4).prop_map(Op::Release),
        3 => (1..=10u8).prop_map(Op::Advance),
        1 => (25..=40u8).prop_map(Op::Advance),
        2 => (any::<Index>(), -1..=1i8).prop_map(|(i, nudge)| Op::AdvanceToEdge(i, nudge)),
        1 => prop::collection::vec(0..3usize, 0..=2).prop_map(Op::Wakeup),
    ]
}

fn case() -> impl Strategy<Value = (bool, Vec<Op>)> {
    (
        prop::bool::weighted(0.7),
        prop::collection::vec(op(), 1..40),
    )
}

/// What an operation returned, with lease tokens replaced by the number of the claim that
/// issued them.
#[derive(Debug, PartialEq)]
enum Outcome {
    Published(Result<outbox::Published, String>),
    Batch(Result<Vec<i64>, String>),
    Cancelled(Result<outbox::Cancelled, String>),
    Claimed(Result<Vec<Delivery>, String>),
    Completed(Result<Completion, String>),
    Batched(Result<Vec<Completion>, String>),
    Renewed(Result<Vec<outbox::store::Renewal>, String>),
    Released(Result<Vec<outbox::store::Released>, String>),
    Wakeup(Result<outbox::store::NextWakeup, String>),
    Advanced,
}

/// Only argument errors are expected, and both stores must agree on the field.
fn err(e: Error) -> String {
    match e {
        Error::InvalidArgument { field, .. } => format!("invalid {field}"),
        other => panic!("unexpected error: {other:?}"),
    }
}

/// One store's side of the run: its harness and its claims' tokens.
struct Side<'h, H: Harness> {
    h: &'h H,
    tokens: HashMap<Uuid, u128>,
    claims: u128,
}

impl<'h, H: Harness> Side<'h, H> {
    fn new(h: &'h H) -> Self {
        Side {
            h,
            tokens: HashMap::new(),
            claims: 0,
        }
    }

    /// A token as "the n-th claim" (encoded as a UUID so rows keep their type).
    fn norm_token(&self, t: Uuid) -> Uuid {
        match self.tokens.get(&t) {
            Some(n) => Uuid::from_u128(*n),
            None => panic!("{}: token {t} was issued by no claim", H::NAME),
        }
    }

    fn norm_row(&self, mut r: StoredRow) -> StoredRow {
        r.acquired_token = r.acquired_token.map(|t| self.norm_token(t));
        r
    }

    async fn state(&self) -> (DateTime<Utc>, Vec<Vec<StoredRow>>, Vec<Vec<DeadLetter>>) {
        let mut rows = Vec::new();
        let mut dlq = Vec::new();
        for q in QUEUES {
            let live = self.h.pending(q, 10_000).await.expect("pending");
            rows.push(live.into_iter().map(|r| self.norm_row(r)).collect());
            dlq.push(self.h.dead_letters(q, 10_000).await.expect("dead letters"));
        }
        (self.h.store().now().await.expect("now"), rows, dlq)
    }

    async fn apply(
        &mut self,
        op: &Op,
        leases: &[Lease],
        limit: usize,
        now: DateTime<Utc>,
    ) -> (Outcome, Vec<Lease>) {
        let s = self.h.store();
        let mut new_leases = Vec::new();
        let outcome = match op {
            Op::Publish {
                queue,
                key,
                payload,
                headers,
                sched,
                extend,
            } => {
                let body = [*payload];
                let hs: Headers = [("h".to_owned(), payload.to_string())]
                    .into_iter()
                    .collect();
                let mut m = Message::new(QUEUES[*queue], &body);
                if let Some(k) = key {
                    m = m.timer_id(KEYS[*k]);
                }
                if *headers {
                    m = m.headers(&hs);
                }
                if *extend {
                    m = m.on_conflict(OnConflict::Extend);
                }
                let m = match sched {
                    Sched::Now => m,
                    Sched::After(s) => m.schedule(Duration::from_secs(u64::from(*s))),
                    Sched::At(s) => {
                        // A microsecond of its own per timer: no accidental ties (module docs).
                        let own = 1 + 3 * (*queue as i64) + key.map_or(9, |k| k as i64);
                        let at = now
                            + TimeDelta::seconds(i64::from(*s))
                            + TimeDelta::milliseconds(999)
                            + TimeDelta::microseconds(own);
                        m.schedule(at)
                    }
                    Sched::Negative => m.schedule(TimeDelta::seconds(-1)),
                };
                Outcome::Published(self.h.publish(m).await.map_err(err))
            }
            Op::Batch { queue, n, delay } => {
                let bodies: Vec<[u8; 1]> = (0..*n).map(|i| [i]).collect();
                let items: Vec<BatchItem<'_>> = bodies.iter().map(|b| BatchItem::new(b)).collect();
                let schedule = Schedule::from(Duration::from_secs(u64::from(*delay)));
                Outcome::Batch(
                    self.h
                        .publish_batch(QUEUES[*queue], &items, schedule)
                        .await
                        .map_err(err),
                )
            }
            Op::Cancel { queue, key } => {
                Outcome::Cancelled(self.h.cancel(QUEUES[*queue], KEYS[*key]).await.map_err(err))
            }
            Op::Claim { queues, .. } => {
                let names: Vec<String> = queues.iter().map(|q| QUEUES[*q].to_owned()).collect();
                let got = s
                    .claim(ClaimRequest::new(&names, limit, TTL))
                    .await
                    .map_err(err);
                self.claims += 1;
                if let Ok(ds) = &got {
                    if let Some(first) = ds.first() {
                        assert!(
                            ds.iter().all(|d| d.lease.token == first.lease.token),
                            "one token per claim"
                        );
                        self.tokens.insert(first.lease.token, self.claims);
                    }
                    new_leases = ds.iter().map(|d| d.lease).collect();
                }
                Outcome::Claimed(got.map(|ds| {
                    ds.into_iter()
                        .map(|mut d| {
                            d.lease.token = self.norm_token(d.lease.token);
                            d
                        })
                        .collect()
                }))
            }
            Op::Ack(_) => Outcome::Completed(s.ack(leases[0]).await.map_err(err)),
            Op::AckBatch(_) | Op::AckLive(_) => {
                Outcome::Batched(s.ack_batch(leases).await.map_err(err))
            }
            Op::Retry(_, delay) => Outcome::Completed(
                s.retry(leases[0], Duration::from_secs(u64::from(*delay)))
                    .await
                    .map_err(err),
            ),
            Op::Fail(_, reason, with_error) => {
                let reason = match reason {
                    0 => FailureReason::MaxDeliveries,
                    1 => FailureReason::RetryExhausted,
                    2 => FailureReason::Rejected,
                    _ => FailureReason::DecodeError,
                };
                let failure = Failure {
                    reason,
                    last_error: with_error.then_some("bad\0input"),
                };
                Outcome::Completed(s.fail(leases[0], failure).await.map_err(err))
            }
            Op::Renew(_) => Outcome::Renewed(s.renew(leases).await.map_err(err)),
            Op::Release(picks) => {
                // A worker releases each lease it holds once; a lease named twice with both
                // flags has no defined outcome, so the model names each lease once.
                let mut seen = std::collections::HashSet::new();
                let items: Vec<outbox::store::Release> = leases
                    .iter()
                    .zip(picks)
                    .filter(|(lease, _)| seen.insert(**lease))
                    .map(|(&lease, (_, started))| outbox::store::Release {
                        lease,
                        started: *started,
                    })
                    .collect();
                Outcome::Released(s.release(&items).await.map_err(err))
            }
            Op::ExtendLeased { .. } => unreachable!("resolved to a publish"),
            Op::AdvanceToEdge(..) => unreachable!("resolved to an advance"),
            Op::AdvanceBy(by) => {
                self.h.advance(*by).await;
                Outcome::Advanced
            }
            Op::Advance(secs) => {
                self.h.advance(Duration::from_secs(u64::from(*secs))).await;
                Outcome::Advanced
            }
            Op::Wakeup(queues) => {
                let names: Vec<String> = queues.iter().map(|q| QUEUES[*q].to_owned()).collect();
                Outcome::Wakeup(
                    s.next_wakeup(ClaimRequest::new(&names, 0, TTL))
                        .await
                        .map_err(err),
                )
            }
        };
        self.h.advance(TICK).await;
        (outcome, new_leases)
    }
}

/// The leases an operation completes, for each store: the same claim's lease in both.
/// `rows` are the in-memory store's rows, to tell which leases still hold.
fn leases_for(op: &Op, known: &[(Lease, Lease)], rows: &[StoredRow]) -> (Vec<Lease>, Vec<Lease>) {
    let live: Vec<(Lease, Lease)> = known
        .iter()
        .copied()
        .filter(|(_, m)| {
            rows.iter()
                .any(|r| r.id == m.id && r.acquired_token == Some(m.token))
        })
        .collect();
    let resolve = |p: &Pick| -> (Lease, Lease) {
        if known.is_empty() {
            let l = Lease {
                id: 1,
                token: Uuid::nil(),
            };
            return (l, l);
        }
        match p {
            Pick::Live(i) if !live.is_empty() => live[i.index(live.len())],
            Pick::Live(i) | Pick::Known(i) => known[i.index(known.len())],
            Pick::Forged(i) => {
                let (pg, _) = known[i.index(known.len())];
                let l = Lease {
                    id: pg.id,
                    token: Uuid::new_v4(),
                };
                (l, l)
            }
        }
    };
    let picks: Vec<&Pick> = match op {
        Op::Ack(p) | Op::Retry(p, _) | Op::Fail(p, _, _) => vec![p],
        Op::AckBatch(ps) | Op::Renew(ps) => ps.iter().collect(),
        Op::Release(ps) => ps.iter().map(|(p, _)| p).collect(),
        Op::AckLive(stale_first) => {
            let mut out: Vec<(Lease, Lease)> = Vec::new();
            if *stale_first {
                // The first lease of the case: long lost, or still live and then acked twice.
                let nil = Lease {
                    id: 1,
                    token: Uuid::nil(),
                };
                out.push(known.first().copied().unwrap_or((nil, nil)));
            }
            out.extend(live.iter().copied());
            return out.into_iter().unzip();
        }
        _ => Vec::new(),
    };
    picks.into_iter().map(resolve).unzip()
}

/// `ExtendLeased` as the `Publish` it stands for, given the in-memory store's rows (the
/// same in both stores, or the case has failed already).
fn resolve_extend(op: &Op, rows: &[StoredRow]) -> Option<Op> {
    let Op::ExtendLeased {
        which,
        payload,
        sched,
    } = op
    else {
        return None;
    };
    let leased: Vec<(usize, usize)> = rows
        .iter()
        .filter(|r| r.acquired_token.is_some())
        .filter_map(|r| {
            let q = QUEUES.iter().position(|q| *q == r.queue)?;
            let k = KEYS
                .iter()
                .position(|k| Some(*k) == r.timer_id.as_deref())?;
            Some((q, k))
        })
        .collect();
    let (queue, key) = if leased.is_empty() {
        (0, 0)
    } else {
        leased[which.index(leased.len())]
    };
    Some(Op::Publish {
        queue,
        key: Some(key),
        payload: *payload,
        headers: payload % 2 == 0,
        sched: sched.clone(),
        extend: true,
    })
}

/// `AdvanceToEdge` as the `AdvanceBy` it stands for.
fn resolve_edge(op: &Op, rows: &[StoredRow], now: DateTime<Utc>) -> Option<Op> {
    let Op::AdvanceToEdge(which, nudge) = op else {
        return None;
    };
    let ttl = TimeDelta::from_std(TTL).ok()?;
    let tick = TimeDelta::from_std(TICK).ok()?;
    let edges: Vec<DateTime<Utc>> = rows
        .iter()
        .map(|r| match r.acquired_at {
            Some(a) => a + ttl,
            None => r.next_attempt_at,
        })
        .map(|t| t + TimeDelta::microseconds(i64::from(*nudge)))
        .filter(|t| *t > now + tick)
        .collect();
    let by = if edges.is_empty() {
        Duration::from_secs(1)
    } else {
        (edges[which.index(edges.len())] - now - tick)
            .to_std()
            .ok()?
    };
    Some(Op::AdvanceBy(by))
}

/// The claim's limit, widened when it would cut through expired leases that share
/// `acquired_at` (or due rows that share a deadline) in one queue: see the module docs.
fn effective_limit(
    queues: &[usize],
    limit: usize,
    rows: &[StoredRow],
    now: DateTime<Utc>,
) -> usize {
    let Some(expired_before) = now.checked_sub_signed(TimeDelta::from_std(TTL).unwrap()) else {
        return limit;
    };
    for q in queues {
        let queue = QUEUES[*q];
        let mut due: Vec<DateTime<Utc>> = rows
            .iter()
            .filter(|r| r.queue == queue && r.acquired_token.is_none() && r.next_attempt_at <= now)
            .map(|r| r.next_attempt_at)
            .collect();
        let mut expired: Vec<DateTime<Utc>> = rows
            .iter()
            .filter(|r| {
                r.queue == queue
                    && r.acquired_at.is_some_and(|a| a < expired_before)
                    && r.next_attempt_at <= now
            })
            .filter_map(|r| r.acquired_at)
            .collect();
        due.sort();
        expired.sort();
        for branch in [due, expired] {
            if limit > 0 && branch.len() > limit && branch[limit - 1] == branch[limit] {
                return rows.len().max(limit);
            }
        }
    }
    limit
}

async fn run_case(pg: &PgHarness, ops: &[Op], dead_letter: bool) -> Result<(), TestCaseError> {
    let mem = MemHarness::new(dead_letter).await;
    let mut p = Side::new(pg);
    let mut m = Side::new(&mem);
    let mut known: Vec<(Lease, Lease)> = Vec::new();
    for (step, op) in ops.iter().enumerate() {
        let resolved = resolve_extend(op, &mem.store.rows())
            .or_else(|| resolve_edge(op, &mem.store.rows(), mem.store.time()));
        let op = resolved.as_ref().unwrap_or(op);
        let (pl, ml) = leases_for(op, &known, &mem.store.rows());
        let now = mem.store.time();
        let limit = match op {
            Op::Claim { queues, limit } => effective_limit(queues, *limit, &mem.store.rows(), now),
            _ => 0,
        };
        let (po, pnew) = p.apply(op, &pl, limit, now).await;
        let (mo, mnew) = m.apply(op, &ml, limit, now).await;
        prop_assert_eq!(
            &po,
            &mo,
            "step {}: {:?} returned different outcomes",
            step,
            op
        );
        prop_assert_eq!(pnew.len(), mnew.len());
        for (a, b) in pnew.into_iter().zip(mnew) {
            prop_assert_eq!(a.id, b.id);
            known.push((a, b));
        }
        let ps = p.state().await;
        let ms = m.state().await;
        prop_assert_eq!(ps, ms, "step {}: state differs after {:?}", step, op);
    }
    Ok(())
}

#[test]
fn both_stores_agree_on_random_operation_sequences() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let pg_dlq = rt.block_on(PgHarness::new(true));
    let pg_plain = rt.block_on(PgHarness::new(false));
    let config = Config {
        cases: 64,
        max_shrink_iters: 300,
        failure_persistence: Some(Box::new(FileFailurePersistence::Direct(
            "proptest-regressions/model.txt",
        ))),
        source_file: Some(file!()),
        ..Config::default()
    };
    let mut runner = TestRunner::new(config);
    let result = runner.run(&case(), |(dead_letter, ops)| {
        let pg = if dead_letter { &pg_dlq } else { &pg_plain };
        rt.block_on(async {
            pg.reset().await;
            run_case(pg, &ops, dead_letter).await
        })
    });
    rt.block_on(async {
        pg_dlq.finish().await;
        pg_plain.finish().await;
    });
    if let Err(e) = result {
        panic!("{e}");
    }
}
