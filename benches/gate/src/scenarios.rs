//! The scenarios of SPEC §12 and how each one is measured.
//!
//! Every scenario gets a fresh table (`bench_<name>`), is seeded outside the measured
//! window, and then runs the real product: [`outbox::Worker`] over [`outbox::PgStore`] for
//! consumers, [`outbox::Outbox::publish`] / [`outbox::Outbox::publish_batch`] and the
//! `#[timer]`-generated `extend_body` ([`outbox::message::OnConflict::Extend`]) for producers and
//! extends. The shapes follow `shared/peer/peer_bench.py` so ratios against the Python
//! reference are like for like: 256-byte bodies stored as a JSON string with a
//! `content-type` header, autovacuum off on the table, `CHECKPOINT` after seeding a consumer
//! scenario, time from start to the last message handled.

use sqlx::AssertSqlSafe;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::Utc;
use outbox::{
    message::{BatchItem, Headers, Schedule},
    Context, Message, Outbox, PgStore, Published, Worker,
};
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};
use sqlx::postgres::{PgConnectOptions, PgConnection, PgPool, PgPoolOptions};
use tokio::sync::{mpsc, oneshot};

use crate::payload::{extend_body, publish_body, Body};
use crate::probe::{self, Statement, Tuples, Wal, WORK_APP};
use crate::recorder;
use crate::BoxError;

/// Messages per scenario unless stated (SPEC §12).
pub const MESSAGES: u64 = 5000;
/// Body length in bytes, as the reference's `PAYLOAD`.
const PAYLOAD: usize = 256;
/// Timers of `extend/pending` and `extend/rearm`.
const TIMERS: u64 = 500;
/// Timers of `timers/lateness`.
const LATENESS_TIMERS: u64 = 200;
/// Future timers of `idle/timers10k`, due an hour ahead.
const IDLE_TIMERS: u64 = 10_000;
/// How long `idle/timers10k` counts the idle worker's statements, after it settled.
const IDLE_WINDOW: Duration = Duration::from_secs(5);
/// The most statements per second a worker with nothing due may send (issue 27): it must
/// sleep until the earliest deadline, not poll. `check` fails a run above it.
pub const IDLE_STATEMENTS_PER_SECOND_MAX: f64 = 10.0;
/// Tuple counters `check` compares exactly, unless [`Scenario::gated_tuples`] says less.
pub const GATED_TUPLES: &[&str] = &["ins", "upd", "del", "hot_upd", "dead"];

/// What a scenario does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// N due rows, a worker with `workers` handlers claiming `batch` at a time and acking
    /// `ack_batch` per statement. With `tx`, each handler inserts its message into an
    /// application table in its own transaction and completes its row in it (SPEC §7.9).
    Consumer {
        workers: usize,
        batch: usize,
        ack_batch: usize,
        tx: bool,
    },
    /// N single publishes in one transaction.
    ProducerOneTx,
    /// N publishes as `publish_batch` calls of `batch` rows, in one transaction.
    ProducerBatch { batch: usize },
    /// N publishes, one transaction each: `BEGIN`, the publish, `COMMIT` on a connection
    /// taken from the pool for each; with `autocommit`, the publish alone on one connection
    /// held for the window, outside any transaction (Postgres runs the statement as its own
    /// transaction), which is what `limit/commit` does with a bare insert.
    ProducerPerTx { autocommit: bool },
    /// N one-row inserts, each its own transaction, on one connection: what one durable
    /// commit per message allows on this machine (the per-commit limit of issue 14).
    CommitLimit,
    /// `TIMERS` pending timers, then N extends, one transaction each (`autocommit` as for
    /// [`Kind::ProducerPerTx`]).
    ExtendPending { autocommit: bool },
    /// `TIMERS` due timers; while each one's handler runs, N / `TIMERS` extends land on it
    /// (rearm), each in its own transaction; the completion applies the rearm.
    ExtendRearm,
    /// `LATENESS_TIMERS` timers due 1–3 s ahead while a default worker is idle.
    Lateness,
    /// `IDLE_TIMERS` timers due an hour ahead and a default worker with nothing due: the
    /// statements it sends per second over `IDLE_WINDOW` (what an idle worker costs the
    /// database). Never gated by count; `check` bounds the rate.
    Idle,
    /// `held` due rows claimed at once by a worker with `lease_ttl` 300 ms whose first
    /// handler blocks for `RENEWAL_WINDOW` while the rest wait in its buffer: every lease is
    /// held (and renewed) for the whole window. Measures what renewal costs; never gated.
    Renewal { held: usize },
}

/// How long the renewal scenario holds its leases.
const RENEWAL_WINDOW: Duration = Duration::from_secs(3);
/// The renewal scenario's lease: renewed every 100 ms.
const RENEWAL_TTL: Duration = Duration::from_millis(300);

/// One named scenario.
#[derive(Debug, Clone, Copy)]
pub struct Scenario {
    pub name: &'static str,
    pub kind: Kind,
    /// The reference's name for the same workload, when it has one.
    pub peer: &'static [&'static str],
    /// `synchronous_commit = off` on the connections whose commits the scenario measures
    /// (the worker's, and the ones doing the extends): an informational variant, never
    /// gated, showing what the WAL flush of each commit costs.
    pub async_commit: bool,
}

impl Scenario {
    pub fn messages(&self) -> u64 {
        match self.kind {
            Kind::Lateness => LATENESS_TIMERS,
            Kind::Idle => IDLE_TIMERS,
            Kind::Renewal { held } => held as u64,
            _ => MESSAGES,
        }
    }

    /// The table this scenario runs on.
    pub fn table(&self) -> String {
        let mut t = String::from("bench_");
        for c in self.name.chars() {
            t.push(if c.is_ascii_alphanumeric() { c } else { '_' });
        }
        t
    }

    /// Statement kinds whose count depends on timing and so is gated as a range (see
    /// [`Scenario::statement_range`]), not exactly. `None` means none of this scenario's
    /// statement counts is gated.
    pub fn ungated_statements(&self) -> Option<&'static [&'static str]> {
        if self.async_commit {
            return None;
        }
        match self.kind {
            // How many successes the completer finds waiting when it writes depends on how
            // the handler and completer tasks interleave (SPEC §12 v2).
            Kind::Consumer { ack_batch, .. } if ack_batch > 1 => Some(&["DELETE"]),
            // The same for the completions of `extend/rearm`: each batch the completer writes
            // is one `DELETE` (matching no row: every run has a rearm) and one settle
            // (`WITH…SELECT`) that applies the rearms. Under load two completions can wait
            // for one write (found by CI on a busy machine: 499 of 500).
            Kind::ExtendRearm => Some(&["DELETE", "WITH…SELECT"]),
            // How many timers fall due per wake-up depends on the clock; how many renewals
            // fit in the window too.
            Kind::Lateness | Kind::Renewal { .. } | Kind::Idle => None,
            _ => Some(&[]),
        }
    }

    /// The range a timing-dependent statement count must lie in (SPEC §12 v2): a coalesced
    /// `DELETE` count lies in `[ceil(N / cap), N]`.
    pub fn statement_range(&self, kind: &str) -> Option<(i64, i64)> {
        if self.async_commit {
            return None;
        }
        match self.kind {
            Kind::Consumer { ack_batch, .. } if ack_batch > 1 && kind == "DELETE" => {
                let n = self.messages();
                Some(((n.div_ceil(ack_batch as u64)) as i64, n as i64))
            }
            // One `DELETE` and one settle per completion batch (at most the worker's default
            // `ack_batch_size` runs each); the settles add to one `WITH…SELECT` per extend.
            Kind::ExtendRearm if kind == "DELETE" || kind == "WITH…SELECT" => {
                let cap = outbox::worker::DEFAULT_ACK_BATCH_SIZE as u64;
                let extends = if kind == "DELETE" { 0 } else { MESSAGES };
                Some((
                    (extends + TIMERS.div_ceil(cap)) as i64,
                    (extends + TIMERS) as i64,
                ))
            }
            _ => None,
        }
    }

    /// Whether tuple and WAL figures are gated (not for the clock-driven lateness run, nor
    /// for the informational `synchronous_commit = off` variants, whose counts are their
    /// durable twin's).
    pub fn gates_tuples_and_wal(&self) -> bool {
        !matches!(
            self.kind,
            Kind::Lateness | Kind::Renewal { .. } | Kind::Idle
        ) && !self.async_commit
    }

    /// Whether `check` runs it: a gated count, or the idle worker's bounded load.
    pub fn checked(&self) -> bool {
        self.gates_tuples_and_wal() || self.kind == Kind::Idle
    }

    /// The tuple counters gated exactly. Inserted, updated and deleted tuples follow from
    /// the statements. HOT updates and dead tuples do too as long as every update changes
    /// an indexed column (no HOT: opportunistic pruning only turns dead versions into
    /// LP_DEAD stubs, which still count as dead). A rearm changes only unindexed columns,
    /// so its updates are HOT when the page has room, and pruning a HOT chain frees room
    /// and lowers the dead count — both depend on when pruning ran, so `extend/rearm`
    /// reports them without gating them.
    pub fn gated_tuples(&self) -> &'static [&'static str] {
        if self.async_commit {
            return &[];
        }
        match self.kind {
            Kind::Lateness | Kind::Renewal { .. } | Kind::Idle => &[],
            Kind::ExtendRearm => &GATED_TUPLES[..3],
            _ => GATED_TUPLES,
        }
    }

    /// Whether throughput is meaningful (the lateness run waits for deadlines).
    pub fn has_throughput(&self) -> bool {
        !matches!(
            self.kind,
            Kind::Lateness | Kind::Renewal { .. } | Kind::Idle
        )
    }

    /// Consumer-shaped runs are seeded and then checkpointed, as the reference does.
    fn checkpoint_after_seed(&self) -> bool {
        matches!(
            self.kind,
            Kind::Consumer { .. } | Kind::ExtendRearm | Kind::Renewal { .. }
        )
    }
}

/// The lease of the gated scenarios' workers. Renewal runs every third of `lease_ttl`: with
/// the default 60 s, a scenario that a loaded machine stretches past 20 s renews its leases,
/// and that UPDATE (a count that depends on wall time, not on the code) would fail the gate.
/// An hour keeps renewal out of every gated count; the `renewal/*` scenarios measure it.
const GATED_LEASE_TTL: Duration = Duration::from_secs(3600);

const fn consumer(
    name: &'static str,
    workers: usize,
    batch: usize,
    ack_batch: usize,
    peer: &'static [&'static str],
) -> Scenario {
    Scenario {
        name,
        kind: Kind::Consumer {
            workers,
            batch,
            ack_batch,
            tx: false,
        },
        peer,
        async_commit: false,
    }
}

/// A consumer whose handlers write their message to an application table and complete the
/// row in that transaction (SPEC §7.9, §12 `consumer/tx`).
const fn consumer_tx(
    name: &'static str,
    workers: usize,
    batch: usize,
    peer: &'static [&'static str],
) -> Scenario {
    Scenario {
        name,
        kind: Kind::Consumer {
            workers,
            batch,
            ack_batch: 1,
            tx: true,
        },
        peer,
        async_commit: false,
    }
}

/// The informational `synchronous_commit = off` variant of `base`, named `<base>/async`.
const fn async_commit(name: &'static str, base: Scenario) -> Scenario {
    Scenario {
        name,
        peer: &[],
        async_commit: true,
        ..base
    }
}

/// The consumers run with the default knobs: pipelined acks capped at
/// [`outbox::worker::DEFAULT_ACK_BATCH_SIZE`] per statement.
const ACK: usize = outbox::worker::DEFAULT_ACK_BATCH_SIZE;
const CONSUMER_W1_B10: Scenario = consumer("consumer/w1/b10", 1, 10, ACK, &["consumer/w1/b10"]);
const CONSUMER_W1_B100: Scenario = consumer("consumer/w1/b100", 1, 100, ACK, &["consumer/w1/b100"]);
const CONSUMER_W2_B10: Scenario = consumer("consumer/w2/b10", 2, 10, ACK, &["consumer/w2/b10"]);
const CONSUMER_W2_B100: Scenario = consumer("consumer/w2/b100", 2, 100, ACK, &[]);
const CONSUMER_W4_B10: Scenario = consumer("consumer/w4/b10", 4, 10, ACK, &[]);
const CONSUMER_W4_B100: Scenario = consumer("consumer/w4/b100", 4, 100, ACK, &["consumer/w4/b100"]);
/// `consumer/w1/b10` with `ack_batch_size(1)`: each handler task writes its own ack before
/// it takes the next row (the default before acks were pipelined).
const CONSUMER_W1_B10_ACK1: Scenario = consumer("consumer/w1/b10/ack1", 1, 10, 1, &[]);
const CONSUMER_TFBS100: Scenario = consumer(
    "consumer/w1/b100/tfbs100",
    1,
    100,
    100,
    &["consumer/w1/b100/tfbs100"],
);
const EXTEND_PENDING: Scenario = Scenario {
    name: "extend/pending",
    kind: Kind::ExtendPending { autocommit: false },
    peer: &["extend/pending"],
    async_commit: false,
};
const EXTEND_REARM: Scenario = Scenario {
    name: "extend/rearm",
    kind: Kind::ExtendRearm,
    peer: &[],
    async_commit: false,
};

/// Every scenario, in run order. Each `…/async` variant runs right after its durable twin
/// (and the reference's run of it), so both see the machine in the same state.
pub const ALL: &[Scenario] = &[
    Scenario {
        name: "limit/commit",
        kind: Kind::CommitLimit,
        peer: &[],
        async_commit: false,
    },
    CONSUMER_W1_B10,
    async_commit("consumer/w1/b10/async", CONSUMER_W1_B10),
    CONSUMER_W1_B10_ACK1,
    CONSUMER_W1_B100,
    async_commit("consumer/w1/b100/async", CONSUMER_W1_B100),
    CONSUMER_W2_B10,
    async_commit("consumer/w2/b10/async", CONSUMER_W2_B10),
    CONSUMER_W2_B100,
    async_commit("consumer/w2/b100/async", CONSUMER_W2_B100),
    CONSUMER_W4_B10,
    async_commit("consumer/w4/b10/async", CONSUMER_W4_B10),
    CONSUMER_W4_B100,
    async_commit("consumer/w4/b100/async", CONSUMER_W4_B100),
    CONSUMER_TFBS100,
    async_commit("consumer/w1/b100/tfbs100/async", CONSUMER_TFBS100),
    consumer_tx("consumer/tx/w1/b10", 1, 10, &["consumer/tx/w1/b10"]),
    consumer_tx("consumer/tx/w4/b10", 4, 10, &["consumer/tx/w4/b10"]),
    Scenario {
        name: "producer/w1/b100",
        kind: Kind::ProducerOneTx,
        peer: &["producer/w1/b100"],
        async_commit: false,
    },
    Scenario {
        name: "producer/batch100",
        kind: Kind::ProducerBatch { batch: 100 },
        peer: &[],
        async_commit: false,
    },
    Scenario {
        name: "producer/ppt1",
        kind: Kind::ProducerPerTx { autocommit: false },
        peer: &["producer/ppt1"],
        async_commit: false,
    },
    Scenario {
        name: "producer/autocommit",
        kind: Kind::ProducerPerTx { autocommit: true },
        peer: &[],
        async_commit: false,
    },
    EXTEND_PENDING,
    async_commit("extend/pending/async", EXTEND_PENDING),
    Scenario {
        name: "extend/autocommit",
        kind: Kind::ExtendPending { autocommit: true },
        peer: &[],
        async_commit: false,
    },
    EXTEND_REARM,
    async_commit("extend/rearm/async", EXTEND_REARM),
    Scenario {
        name: "timers/lateness",
        kind: Kind::Lateness,
        peer: &["timers/lateness/poll1s", "timers/lateness/poll10s"],
        async_commit: false,
    },
    Scenario {
        name: "idle/timers10k",
        kind: Kind::Idle,
        peer: &[],
        async_commit: false,
    },
    Scenario {
        name: "renewal/held10",
        kind: Kind::Renewal { held: 10 },
        peer: &[],
        async_commit: false,
    },
    Scenario {
        name: "renewal/held1000",
        kind: Kind::Renewal { held: 1000 },
        peer: &[],
        async_commit: false,
    },
];

pub fn find(name: &str) -> Option<&'static Scenario> {
    ALL.iter().find(|s| s.name == name)
}

/// The `synchronous_commit = off` variant of the scenario named `name`, if it has one.
pub fn async_variant(name: &str) -> Option<&'static Scenario> {
    ALL.iter()
        .find(|s| s.async_commit && s.name.strip_suffix("/async") == Some(name))
}

/// Firing lateness of the lateness run, in milliseconds.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq)]
pub struct Lateness {
    /// Handler start − deadline.
    pub p50: f64,
    pub p99: f64,
    pub max: f64,
    /// Claim time (database clock) − deadline, p99.
    pub claim_p99: f64,
}

/// What an idle worker sent in the window of `idle/timers10k`.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq)]
pub struct IdleLoad {
    /// Statements of every connection but the harness's probe (`pg_stat_statements` calls,
    /// `BEGIN`/`COMMIT` and `LISTEN` included) per second of the window.
    pub statements_per_second: f64,
    pub window_seconds: f64,
}

/// WAL written in the window, totals.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq)]
pub struct WalTotals {
    pub records: i64,
    pub bytes: i64,
    pub fpi: i64,
}

/// What one scenario run measured (totals; per-message figures are derived).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Measurement {
    pub scenario: String,
    pub messages: u64,
    pub wall_seconds: f64,
    pub msgs_per_second: f64,
    /// Calls by statement kind (see [`probe::keyword`]).
    pub statements: BTreeMap<String, i64>,
    pub wal: WalTotals,
    pub tuples: Tuples,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub lateness_ms: Option<Lateness>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub idle: Option<IdleLoad>,
    /// CPU time of this process (every thread: the worker, the publishers, the harness)
    /// while the scenario ran, seeding included; `None` where `/proc/self/stat` is not
    /// readable. Informational, never gated: what the runtime costs on the client side
    /// (the telemetry comparison reads it), steadier than throughput on a shared machine.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub client_cpu_seconds: Option<f64>,
}

/// CPU time this process has used so far (user + system, every thread, exited ones
/// included), from `/proc/self/stat` in clock ticks of 10 ms (Linux's `USER_HZ`).
pub fn process_cpu_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the command name in parentheses: state is field 3, utime 14, stime 15.
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let ticks = |i: usize| fields.get(i)?.parse::<u64>().ok();
    Some((ticks(11)? + ticks(12)?) as f64 / 100.0)
}

impl Measurement {
    pub fn statements_total(&self) -> i64 {
        self.statements.values().sum()
    }
}

/// Connection settings shared by the scenarios.
pub struct Env {
    pub opts: PgConnectOptions,
    /// The harness's own connection: DDL, CHECKPOINT, statistics. Tagged statements only.
    pub probe: PgConnection,
    /// sqlx's `test_before_acquire` for the worker's pool: off by default, as the
    /// `PgStore` docs recommend (on: `--pool-ping on`, a diagnostic).
    pub worker_ping: bool,
    /// sqlx's `test_before_acquire` for the application's pool (publishes, extends): on by
    /// default, sqlx's default, as an application's pool has it (off: `--app-pool-ping off`).
    pub app_ping: bool,
    pub keep_tables: bool,
    pub verbose: bool,
    /// Storage parameters set on each scenario table after it is created (diagnostics,
    /// e.g. `fillfactor=70`); empty for baselines.
    pub table_set: Vec<String>,
}

/// Which pool: the worker's (claims, completions) or the application's (publishes,
/// extends), each with its own `test_before_acquire`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    Setup,
    Worker,
    App,
}

impl Env {
    /// A pool of `max` connections, opened before the window, as a long-running service has
    /// them. `async_commit` sets `synchronous_commit = off` on its connections (in the
    /// startup packet, as `PgConnectOptions::options` does for a user: no statement).
    async fn pool(&self, role: Role, max: u32, async_commit: bool) -> Result<PgPool, BoxError> {
        let (app, ping) = match role {
            Role::Setup => ("outbox-bench-setup", true),
            Role::Worker => (WORK_APP, self.worker_ping),
            Role::App => (WORK_APP, self.app_ping),
        };
        let mut opts = self.opts.clone().application_name(app);
        if async_commit {
            opts = opts.options([("synchronous_commit", "off")]);
        }
        let pool = PgPoolOptions::new()
            .max_connections(max)
            .test_before_acquire(ping)
            .acquire_timeout(Duration::from_secs(30))
            .connect_lazy_with(opts);
        // Open the connections before the window, as a long-running service has them.
        let mut held = Vec::new();
        for _ in 0..max.saturating_sub(1) {
            held.push(pool.acquire().await?);
        }
        drop(held);
        Ok(pool)
    }

    async fn exec(&mut self, sql: &str) -> Result<(), BoxError> {
        sqlx::raw_sql(AssertSqlSafe(probe::tagged(sql)))
            .execute(&mut self.probe)
            .await?;
        Ok(())
    }

    async fn count(&mut self, sql: &str) -> Result<i64, BoxError> {
        Ok(sqlx::query_scalar(AssertSqlSafe(probe::tagged(sql)))
            .fetch_one(&mut self.probe)
            .await?)
    }
}

/// The JSON-string body of message `i`, as the reference's `body(i)`.
fn body(i: u64) -> String {
    let mut s = format!("{i}:");
    while s.len() < PAYLOAD {
        s.push('x');
    }
    s
}

fn headers() -> Headers {
    Headers::from([("content-type".to_owned(), "application/json".to_owned())])
}

fn json(i: u64) -> Vec<u8> {
    serde_json::to_vec(&body(i)).expect("a string always encodes")
}

/// One run's figures, its statements, and where its WAL starts and ends.
pub struct Output {
    pub m: Measurement,
    pub statements: Vec<Statement>,
    pub lsn: (String, String),
}

/// Runs one scenario end to end.
pub async fn run(env: &mut Env, sc: &Scenario) -> Result<Output, BoxError> {
    let table = sc.table();
    let outbox = Outbox::builder().table(&table).build()?;
    drop_tables(env, &outbox).await?;

    // Set-up: create, seed, checkpoint; its connections are gone before the window opens.
    let setup = env.pool(Role::Setup, 2, false).await?;
    outbox.migrate(&setup).await?;
    let mut params = vec!["autovacuum_enabled = off".to_owned()];
    params.extend(env.table_set.iter().cloned());
    env.exec(&format!(
        "ALTER TABLE {} SET ({})",
        outbox.table(),
        params.join(", ")
    ))
    .await?;
    if !sc.checkpoint_after_seed() {
        env.exec("CHECKPOINT").await?;
    }
    seed(sc, &setup, &outbox).await?;
    setup.close().await;
    probe::wait_backends_gone(
        &mut env.probe,
        "application_name = 'outbox-bench-setup'",
        true,
    )
    .await?;
    if let Kind::Consumer { tx: true, .. } = sc.kind {
        // The application's table, as the reference's: one row per message.
        let effects = effects_table(&outbox);
        env.exec(&format!(
            "CREATE TABLE {effects} (msg text PRIMARY KEY) WITH (autovacuum_enabled = off)"
        ))
        .await?;
    }
    if sc.checkpoint_after_seed() {
        env.exec("CHECKPOINT").await?;
    }

    // The worker gets a pool of its own, sized as the `PgStore` docs say (concurrency + 2,
    // plus one spare); publishes and extends run on the application's pool. Only the pools a
    // scenario uses are opened.
    let workers = match sc.kind {
        Kind::Consumer { workers, .. } => Some(workers),
        Kind::ExtendRearm | Kind::Lateness | Kind::Renewal { .. } | Kind::Idle => Some(1),
        _ => None,
    };
    let worker_pool = match workers {
        Some(w) => Some(
            env.pool(Role::Worker, w as u32 + 3, sc.async_commit)
                .await?,
        ),
        None => None,
    };
    let app_pool = match sc.kind {
        Kind::Consumer { .. } | Kind::Renewal { .. } | Kind::Idle => None,
        _ => Some(env.pool(Role::App, 4, sc.async_commit).await?),
    };
    let wal0 = probe::wal(&mut env.probe).await?;
    let tup0 = probe::tuples(&mut env.probe, outbox.table()).await?;
    probe::reset_statements(&mut env.probe).await?;

    let pools = (worker_pool.as_ref(), app_pool.as_ref());
    let cpu0 = process_cpu_seconds();
    let ran = match (sc.kind, pools) {
        (
            Kind::Consumer {
                workers,
                batch,
                ack_batch,
                tx,
            },
            (Some(w), _),
        ) => {
            let shape = ConsumerShape {
                workers,
                batch,
                ack_batch,
                effects: tx.then(|| effects_table(&outbox)),
            };
            run_consumer(env, w, &outbox, shape).await?
        }
        (Kind::ProducerOneTx, (_, Some(a))) => run_producer_one_tx(a, &outbox).await?,
        (Kind::ProducerBatch { batch }, (_, Some(a))) => {
            run_producer_batch(a, &outbox, batch).await?
        }
        (Kind::ProducerPerTx { autocommit }, (_, Some(a))) => {
            run_producer_per_tx(a, &outbox, autocommit).await?
        }
        (Kind::CommitLimit, (_, Some(a))) => run_commit_limit(a, &outbox).await?,
        (Kind::ExtendPending { autocommit }, (_, Some(a))) => {
            run_extend_pending(a, &outbox, autocommit).await?
        }
        (Kind::ExtendRearm, (Some(w), Some(a))) => run_extend_rearm(env, w, a, &outbox).await?,
        (Kind::Lateness, (Some(w), Some(a))) => run_lateness(w, a, &outbox, env.verbose).await?,
        (Kind::Renewal { held }, (Some(w), _)) => run_renewal(env, w, &outbox, held).await?,
        (Kind::Idle, (Some(w), _)) => run_idle(env, w, &outbox).await?,
        _ => unreachable!("every kind gets the pools it uses"),
    };
    let client_cpu_seconds = process_cpu_seconds()
        .zip(cpu0)
        .map(|(after, before)| after - before);

    for pool in [worker_pool, app_pool].into_iter().flatten() {
        pool.close().await;
    }
    probe::wait_backends_gone(
        &mut env.probe,
        &format!("application_name = '{WORK_APP}'"),
        true,
    )
    .await?;
    let statements = probe::statements(&mut env.probe).await?;
    let wal1 = probe::wal(&mut env.probe).await?;
    let tup1 = probe::tuples(&mut env.probe, outbox.table()).await?;
    verify(env, sc, &outbox).await?;
    if !env.keep_tables {
        drop_tables(env, &outbox).await?;
    }

    let n = sc.messages();
    let m = Measurement {
        scenario: sc.name.to_owned(),
        messages: n,
        wall_seconds: ran.wall.as_secs_f64(),
        msgs_per_second: n as f64 / ran.wall.as_secs_f64(),
        statements: probe::by_keyword(&statements),
        wal: wal_diff(&wal0, &wal1),
        tuples: Tuples {
            ins: tup1.ins - tup0.ins,
            upd: tup1.upd - tup0.upd,
            del: tup1.del - tup0.del,
            hot_upd: tup1.hot_upd - tup0.hot_upd,
            dead: tup1.dead,
        },
        lateness_ms: ran.lateness,
        idle: ran.idle,
        client_cpu_seconds,
    };
    Ok(Output {
        m,
        statements,
        lsn: (wal0.lsn, wal1.lsn),
    })
}

pub fn wal_diff(a: &Wal, b: &Wal) -> WalTotals {
    WalTotals {
        records: b.records - a.records,
        bytes: b.bytes - a.bytes,
        fpi: b.fpi - a.fpi,
    }
}

async fn drop_tables(env: &mut Env, outbox: &Outbox) -> Result<(), BoxError> {
    env.exec(&format!(
        "DROP TABLE IF EXISTS {}, {}, {}, {}, {}",
        outbox.table(),
        outbox.dead_letter_table(),
        outbox.migrations_table(),
        outbox.paused_table(),
        effects_table(outbox)
    ))
    .await
}

/// The application table of a `consumer/tx` scenario: `<table>_effects`.
fn effects_table(outbox: &Outbox) -> String {
    format!("\"{}_effects\"", outbox.table().trim_matches('"'))
}

/// Rows the scenario needs before its window opens.
async fn seed(sc: &Scenario, pool: &PgPool, outbox: &Outbox) -> Result<(), BoxError> {
    let mut tx = pool.begin().await?;
    match sc.kind {
        Kind::Consumer { .. } | Kind::Renewal { .. } | Kind::Idle => {
            // Due now, except the idle worker's timers: an hour ahead.
            let schedule = if sc.kind == Kind::Idle {
                Schedule::after(Duration::from_secs(3600))
            } else {
                Schedule::now()
            };
            let h = headers();
            let payloads: Vec<Vec<u8>> = (0..sc.messages()).map(json).collect();
            for chunk in payloads.chunks(1000) {
                let items: Vec<BatchItem<'_>> = chunk
                    .iter()
                    .map(|p| BatchItem {
                        payload: p,
                        headers: Some(&h),
                    })
                    .collect();
                outbox
                    .publish_batch(&mut tx, "bench", &items, schedule)
                    .await?;
            }
        }
        Kind::ExtendPending { .. } => {
            for t in 0..TIMERS {
                let p = publish_body(
                    outbox.on(&mut tx),
                    &format!("t{t}"),
                    &Body(body(t)),
                    Duration::from_secs(3600),
                )
                .await?;
                expect(matches!(p, Published::Inserted { .. }), "seed insert", p)?;
            }
        }
        Kind::ExtendRearm => {
            for t in 0..TIMERS {
                let p = publish_body(
                    outbox.on(&mut tx),
                    &format!("r{t}"),
                    &Body(body(t)),
                    Schedule::now(),
                )
                .await?;
                expect(matches!(p, Published::Inserted { .. }), "seed insert", p)?;
            }
        }
        _ => {}
    }
    tx.commit().await?;
    Ok(())
}

fn expect(ok: bool, what: &str, got: Published) -> Result<(), BoxError> {
    if ok {
        Ok(())
    } else {
        Err(format!("{what}: unexpected outcome {got:?}").into())
    }
}

/// Checks the table ended as the scenario says it must.
async fn verify(env: &mut Env, sc: &Scenario, outbox: &Outbox) -> Result<(), BoxError> {
    let t = outbox.table();
    let left = env.count(&format!("SELECT count(*) FROM {t}")).await?;
    let want = match sc.kind {
        Kind::Consumer { .. } | Kind::Lateness | Kind::Renewal { .. } => 0,
        Kind::ProducerOneTx
        | Kind::ProducerBatch { .. }
        | Kind::ProducerPerTx { .. }
        | Kind::CommitLimit => MESSAGES as i64,
        Kind::ExtendPending { .. } | Kind::ExtendRearm => TIMERS as i64,
        Kind::Idle => IDLE_TIMERS as i64,
    };
    if left != want {
        return Err(format!("{}: {left} rows left in {t}, expected {want}", sc.name).into());
    }
    if let Kind::Consumer { tx: true, .. } = sc.kind {
        // Exactly once: every message written once (the primary key refuses a second).
        let effects = effects_table(outbox);
        let written = env
            .count(&format!("SELECT count(*) FROM {effects}"))
            .await?;
        if written != MESSAGES as i64 {
            return Err(format!(
                "{}: {written} rows in {effects}, expected {MESSAGES}",
                sc.name
            )
            .into());
        }
    }
    if sc.kind == Kind::ExtendRearm {
        // Every run ended by applying its rearm: a fresh pending timer an hour ahead.
        let bad = env
            .count(&format!(
                "SELECT count(*) FROM {t} WHERE acquired_token IS NOT NULL OR rearm_at IS NOT NULL \
                 OR deliveries_count <> 0 OR next_attempt_at < now() + interval '50 minutes'"
            ))
            .await?;
        if bad != 0 {
            return Err(format!("{}: {bad} rows without their rearm applied", sc.name).into());
        }
    }
    Ok(())
}

/// The measured part of a run.
struct Ran {
    wall: Duration,
    lateness: Option<Lateness>,
    idle: Option<IdleLoad>,
}

/// Which bodies were handled, and how often.
struct Seen {
    marks: Vec<AtomicU8>,
    duplicates: AtomicU64,
}

impl Seen {
    fn new(n: u64) -> Arc<Seen> {
        Arc::new(Seen {
            marks: (0..n).map(|_| AtomicU8::new(0)).collect(),
            duplicates: AtomicU64::new(0),
        })
    }

    fn mark(&self, body: &str) {
        let i: usize = body
            .split_once(':')
            .and_then(|(i, _)| i.parse().ok())
            .unwrap_or(usize::MAX);
        match self.marks.get(i) {
            Some(m) if m.swap(1, Ordering::Relaxed) == 0 => {}
            _ => {
                self.duplicates.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    fn check(&self, what: &str) -> Result<(), BoxError> {
        let missing = self
            .marks
            .iter()
            .filter(|m| m.load(Ordering::Relaxed) == 0)
            .count();
        let dup = self.duplicates.load(Ordering::Relaxed);
        if missing != 0 || dup != 0 {
            return Err(
                format!("{what}: {missing} messages not handled, {dup} handled twice").into(),
            );
        }
        Ok(())
    }
}

const RUN_TIMEOUT: Duration = Duration::from_secs(600);

async fn within<F: std::future::Future>(what: &str, f: F) -> Result<F::Output, BoxError> {
    tokio::time::timeout(RUN_TIMEOUT, f)
        .await
        .map_err(|_| format!("{what}: not finished after {RUN_TIMEOUT:?}").into())
}

/// Waits until the claim loop has come back short (no more due rows) and the worker has
/// stopped issuing statements (it then sleeps until the idle ceiling, 30 s by default), so
/// the counted statements do not depend on when the run is stopped.
async fn wait_idle(env: &mut Env) -> Result<(), BoxError> {
    let watch = recorder::watch();
    let deadline = Instant::now() + Duration::from_secs(20);
    while watch.short_claims() == 0 {
        if Instant::now() > deadline {
            return Err("the worker never came back from a claim short of its limit".into());
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let mut last = probe::total_calls(&mut env.probe).await?;
    loop {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let now = probe::total_calls(&mut env.probe).await?;
        if now == last {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err("the worker did not go quiet".into());
        }
        last = now;
    }
}

/// How a consumer scenario's worker is set up.
struct ConsumerShape {
    workers: usize,
    batch: usize,
    ack_batch: usize,
    /// The application table each handler writes to in its own transaction, if any.
    effects: Option<String>,
}

async fn run_consumer(
    env: &mut Env,
    pool: &PgPool,
    outbox: &Outbox,
    shape: ConsumerShape,
) -> Result<Ran, BoxError> {
    let seen = Seen::new(MESSAGES);
    let watch = recorder::watch();
    watch.reset(shape.batch);
    let handler_seen = seen.clone();
    let builder = Worker::builder(PgStore::new(pool.clone(), outbox.clone()));
    let builder = match shape.effects {
        None => builder.timer::<Body>(move |b: Body, _ctx: Context| {
            let seen = handler_seen.clone();
            async move { seen.mark(&b.0) }
        }),
        Some(effects) => {
            let insert: Arc<str> = format!("INSERT INTO {effects} (msg) VALUES ($1)").into();
            builder.timer::<Body>(move |b: Body, ctx: Context| {
                let (seen, insert) = (handler_seen.clone(), insert.clone());
                async move {
                    let mut tx = ctx.begin().await?;
                    sqlx::query(AssertSqlSafe(&*insert))
                        .bind(&b.0)
                        .execute(&mut *tx)
                        .await?;
                    tx.commit().await?;
                    seen.mark(&b.0);
                    Ok::<(), outbox::Error>(())
                }
            })
        }
    };
    let worker = builder
        .lease_ttl(GATED_LEASE_TTL)
        .concurrency(shape.workers)
        .fetch_batch_size(shape.batch)
        .ack_batch_size(shape.ack_batch)
        .build()?;
    let t0 = Instant::now();
    let running = worker.start();
    within("consumer", watch.acked_at_least(MESSAGES)).await?;
    let wall = t0.elapsed();
    wait_idle(env).await?;
    let report = running.shutdown().await;
    if !report.graceful {
        return Err(format!("worker shutdown was not graceful: {report:?}").into());
    }
    seen.check("consumer")?;
    Ok(Ran {
        wall,
        lateness: None,
        idle: None,
    })
}

/// Holds `held` leases for `RENEWAL_WINDOW`: one worker, concurrency 1, `fetch_batch_size`
/// `held`, `lease_ttl` 300 ms; its first handler blocks for the window, the others wait in
/// the buffer, then everything runs and is acked. The renewal statements of the window
/// are the scenario's `UPDATE`s: one per renewal period (100 ms), whatever `held` is.
async fn run_renewal(
    env: &mut Env,
    pool: &PgPool,
    outbox: &Outbox,
    held: usize,
) -> Result<Ran, BoxError> {
    let seen = Seen::new(held as u64);
    let watch = recorder::watch();
    watch.reset(held);
    let gate = Arc::new(tokio::sync::Notify::new());
    let first = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let handler_seen = seen.clone();
    let (handler_gate, handler_first) = (gate.clone(), first.clone());
    let worker = Worker::builder(PgStore::new(pool.clone(), outbox.clone()))
        .timer::<Body>(move |b: Body, _ctx: Context| {
            let (seen, gate, first) = (
                handler_seen.clone(),
                handler_gate.clone(),
                handler_first.clone(),
            );
            async move {
                if first.swap(false, Ordering::SeqCst) {
                    gate.notified().await;
                }
                seen.mark(&b.0)
            }
        })
        .concurrency(1)
        .fetch_batch_size(held)
        .lease_ttl(RENEWAL_TTL)
        .build()?;
    let t0 = Instant::now();
    let running = worker.start();
    tokio::time::sleep(RENEWAL_WINDOW).await;
    gate.notify_one();
    within("renewal", watch.acked_at_least(held as u64)).await?;
    let wall = t0.elapsed();
    wait_idle(env).await?;
    let report = running.shutdown().await;
    if !report.graceful {
        return Err(format!("worker shutdown was not graceful: {report:?}").into());
    }
    seen.check("renewal")?;
    Ok(Ran {
        wall,
        lateness: None,
        idle: None,
    })
}

async fn run_producer_one_tx(pool: &PgPool, outbox: &Outbox) -> Result<Ran, BoxError> {
    let h = headers();
    let payloads: Vec<Vec<u8>> = (0..MESSAGES).map(json).collect();
    let t0 = Instant::now();
    let mut tx = pool.begin().await?;
    for p in &payloads {
        let out = outbox
            .publish(&mut tx, Message::new("bench", p).headers(&h))
            .await?;
        expect(matches!(out, Published::Inserted { .. }), "publish", out)?;
    }
    tx.commit().await?;
    Ok(Ran {
        wall: t0.elapsed(),
        lateness: None,
        idle: None,
    })
}

async fn run_producer_batch(pool: &PgPool, outbox: &Outbox, batch: usize) -> Result<Ran, BoxError> {
    let h = headers();
    let payloads: Vec<Vec<u8>> = (0..MESSAGES).map(json).collect();
    let t0 = Instant::now();
    let mut tx = pool.begin().await?;
    for chunk in payloads.chunks(batch) {
        let items: Vec<BatchItem<'_>> = chunk
            .iter()
            .map(|p| BatchItem {
                payload: p,
                headers: Some(&h),
            })
            .collect();
        let ids = outbox
            .publish_batch(&mut tx, "bench", &items, Schedule::now())
            .await?;
        if ids.len() != chunk.len() {
            return Err(format!(
                "publish_batch returned {} ids for {}",
                ids.len(),
                chunk.len()
            )
            .into());
        }
    }
    tx.commit().await?;
    Ok(Ran {
        wall: t0.elapsed(),
        lateness: None,
        idle: None,
    })
}

/// Where the one-message writes of a producer or extend scenario run.
enum Writes {
    /// On one connection held for the window, outside any transaction: Postgres runs each
    /// statement as its own transaction (the `…/autocommit` scenarios, as `limit/commit`).
    Held(sqlx::pool::PoolConnection<sqlx::Postgres>),
    /// Each in a transaction of its own (`BEGIN` … `COMMIT`) on a pooled connection.
    PerTransaction(PgPool),
}

impl Writes {
    async fn open(pool: &PgPool, autocommit: bool) -> Result<Self, BoxError> {
        Ok(if autocommit {
            Writes::Held(pool.acquire().await?)
        } else {
            Writes::PerTransaction(pool.clone())
        })
    }

    /// Runs one write, committing it when it has a transaction of its own.
    async fn run(
        &mut self,
        mut write: impl AsyncFnMut(&mut PgConnection) -> Result<Published, BoxError>,
    ) -> Result<Published, BoxError> {
        match self {
            Writes::Held(conn) => write(conn).await,
            Writes::PerTransaction(pool) => {
                let mut tx = pool.begin().await?;
                let out = write(&mut tx).await?;
                tx.commit().await?;
                Ok(out)
            }
        }
    }
}

async fn run_producer_per_tx(
    pool: &PgPool,
    outbox: &Outbox,
    autocommit: bool,
) -> Result<Ran, BoxError> {
    let h = headers();
    let payloads: Vec<Vec<u8>> = (0..MESSAGES).map(json).collect();
    let mut writes = Writes::open(pool, autocommit).await?;
    let t0 = Instant::now();
    for p in &payloads {
        let message = Message::new("bench", p).headers(&h);
        let out = writes
            .run(async |conn| Ok(outbox.publish(conn, message).await?))
            .await?;
        expect(matches!(out, Published::Inserted { .. }), "publish", out)?;
    }
    Ok(Ran {
        wall: t0.elapsed(),
        lateness: None,
        idle: None,
    })
}

/// The per-commit limit: a one-row insert per transaction (autocommit), on one connection
/// held for the whole window, durable as the server's commits are. No product code runs:
/// this is the yardstick a consumer that commits once per message cannot beat.
async fn run_commit_limit(pool: &PgPool, outbox: &Outbox) -> Result<Ran, BoxError> {
    let payloads: Vec<Vec<u8>> = (0..MESSAGES).map(json).collect();
    let insert = format!(
        "INSERT INTO {} (queue, payload, next_attempt_at) VALUES ('limit', $1, now())",
        outbox.table()
    );
    let mut conn = pool.acquire().await?;
    let t0 = Instant::now();
    for p in &payloads {
        sqlx::query(AssertSqlSafe(insert.clone()))
            .bind(p)
            .execute(&mut *conn)
            .await?;
    }
    Ok(Ran {
        wall: t0.elapsed(),
        lateness: None,
        idle: None,
    })
}

async fn run_extend_pending(
    pool: &PgPool,
    outbox: &Outbox,
    autocommit: bool,
) -> Result<Ran, BoxError> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let picks: Vec<u64> = (0..MESSAGES).map(|_| rng.random_range(0..TIMERS)).collect();
    let bodies: Vec<Body> = (0..MESSAGES).map(|i| Body(body(i))).collect();
    let mut writes = Writes::open(pool, autocommit).await?;
    let t0 = Instant::now();
    for (i, (t, b)) in picks.iter().zip(&bodies).enumerate() {
        let key = format!("t{t}");
        // Strictly later every time, so every extend moves its timer (SPEC §4).
        let delay = Duration::from_secs(3600 + i as u64);
        let out = writes
            .run(async |conn| Ok(extend_body(outbox.on(conn), &key, b, delay).await?))
            .await?;
        expect(matches!(out, Published::Extended { .. }), "extend", out)?;
    }
    Ok(Ran {
        wall: t0.elapsed(),
        lateness: None,
        idle: None,
    })
}

/// Each handler announces its timer and waits while the driver lands
/// `MESSAGES / TIMERS` extends on the running row, one transaction each; each must come
/// back `RearmQueued`, and the completion then applies the last one.
async fn run_extend_rearm(
    env: &mut Env,
    pool: &PgPool,
    app: &PgPool,
    outbox: &Outbox,
) -> Result<Ran, BoxError> {
    let per_run = MESSAGES / TIMERS;
    let watch = recorder::watch();
    let batch = 10;
    watch.reset(batch);
    let (to_driver, mut running_rx) = mpsc::channel::<(String, oneshot::Sender<()>)>(16);
    let worker = Worker::builder(PgStore::new(pool.clone(), outbox.clone()))
        .timer::<Body>(move |_b: Body, ctx: Context| {
            let to_driver = to_driver.clone();
            async move {
                let (done, wait) = oneshot::channel();
                let id = ctx.timer_id().unwrap_or_default().to_owned();
                if to_driver.send((id, done)).await.is_ok() {
                    let _ = wait.await;
                }
            }
        })
        .lease_ttl(GATED_LEASE_TTL)
        .fetch_batch_size(batch)
        .build()?;
    let driver_pool = app.clone();
    let driver_outbox = outbox.clone();
    let t0 = Instant::now();
    let running = worker.start();
    let driver = tokio::spawn(async move {
        let mut seq = 0u64;
        let mut runs = 0u64;
        while let Some((id, done)) = running_rx.recv().await {
            for _ in 0..per_run {
                seq += 1;
                let mut tx = driver_pool.begin().await?;
                let out = extend_body(
                    &mut driver_outbox.on(&mut tx),
                    &id,
                    &Body(body(seq)),
                    Duration::from_secs(3600 + seq),
                )
                .await?;
                expect(
                    matches!(out, Published::RearmQueued { .. }),
                    "extend of a running timer",
                    out,
                )?;
                tx.commit().await?;
            }
            let _ = done.send(());
            runs += 1;
            if runs == TIMERS {
                break;
            }
        }
        Ok::<u64, BoxError>(runs)
    });
    within("extend/rearm", watch.acked_at_least(TIMERS)).await?;
    let wall = t0.elapsed();
    let runs = driver.await??;
    if runs != TIMERS {
        return Err(format!("extend/rearm: {runs} runs, expected {TIMERS}").into());
    }
    wait_idle(env).await?;
    let report = running.shutdown().await;
    if !report.graceful {
        return Err(format!("worker shutdown was not graceful: {report:?}").into());
    }
    Ok(Ran {
        wall,
        lateness: None,
        idle: None,
    })
}

async fn run_lateness(
    pool: &PgPool,
    app: &PgPool,
    outbox: &Outbox,
    verbose: bool,
) -> Result<Ran, BoxError> {
    let watch = recorder::watch();
    watch.reset(10);
    let late = Arc::new(std::sync::Mutex::new(Vec::<(f64, f64)>::new()));
    let handler_late = late.clone();
    // Default knobs: concurrency 1, fetch_batch_size 10, idle ceiling 30 s.
    let worker = Worker::builder(PgStore::new(pool.clone(), outbox.clone()))
        .timer::<Body>(move |_b: Body, ctx: Context| {
            let late = handler_late.clone();
            async move {
                let now = Utc::now();
                let ms = |d: chrono::TimeDelta| d.num_microseconds().unwrap_or(0) as f64 / 1000.0;
                late.lock().unwrap_or_else(|p| p.into_inner()).push((
                    ms(now - ctx.deadline()),
                    ms(ctx.claimed_at() - ctx.deadline()),
                ));
            }
        })
        .lease_ttl(GATED_LEASE_TTL)
        .build()?;
    let running = worker.start();
    // Let the worker settle into its idle sleep first, as the reference does.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    let t0 = Instant::now();
    let mut tx = app.begin().await?;
    for i in 0..LATENESS_TIMERS {
        let due =
            Utc::now() + chrono::TimeDelta::microseconds(rng.random_range(1_000_000..=3_000_000));
        let out = publish_body(
            outbox.on(&mut tx),
            &format!("l{i}"),
            &Body(body(i)),
            Schedule::at(due),
        )
        .await?;
        expect(matches!(out, Published::Inserted { .. }), "publish", out)?;
    }
    tx.commit().await?;
    within("timers/lateness", watch.acked_at_least(LATENESS_TIMERS)).await?;
    let wall = t0.elapsed();
    running.shutdown().await;
    let mut v = late.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let mut claim: Vec<f64> = v.iter().map(|x| x.1).collect();
    v.sort_by(|a, b| a.0.total_cmp(&b.0));
    claim.sort_by(|a, b| a.total_cmp(b));
    let start: Vec<f64> = v.iter().map(|x| x.0).collect();
    if verbose {
        let deciles: Vec<String> = (1..10)
            .map(|d| format!("{:.1}", percentile(&start, d as f64 / 10.0)))
            .collect();
        let over = |ms: f64| start.iter().filter(|&&x| x > ms).count();
        println!(
            "  lateness deciles (ms): {}; over 5 ms: {}, over 10 ms: {}, over 20 ms: {}",
            deciles.join(" "),
            over(5.0),
            over(10.0),
            over(20.0)
        );
    }
    Ok(Ran {
        wall,
        lateness: Some(Lateness {
            p50: percentile(&start, 0.5),
            p99: percentile(&start, 0.99),
            max: start.last().copied().unwrap_or(0.0),
            claim_p99: percentile(&claim, 0.99),
        }),
        idle: None,
    })
}

/// An idle default worker over `IDLE_TIMERS` future timers: after it settled into its sleep
/// (its start-up statements are outside the window), the statements every connection but
/// the probe's sent during `IDLE_WINDOW`. The worker should sleep until the earliest deadline
/// (an hour ahead) or its idle ceiling, so the expected count is 0: any statement is a poll.
async fn run_idle(env: &mut Env, pool: &PgPool, outbox: &Outbox) -> Result<Ran, BoxError> {
    let worker = Worker::builder(PgStore::new(pool.clone(), outbox.clone()))
        .timer::<Body>(|_b: Body, _ctx: Context| async move {})
        .lease_ttl(GATED_LEASE_TTL)
        .build()?;
    let running = worker.start();
    let t0 = Instant::now();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let before = probe::total_calls(&mut env.probe).await?;
    let w0 = Instant::now();
    tokio::time::sleep(IDLE_WINDOW).await;
    let after = probe::total_calls(&mut env.probe).await?;
    let window = w0.elapsed();
    running.shutdown().await;
    Ok(Ran {
        wall: t0.elapsed(),
        lateness: None,
        idle: Some(IdleLoad {
            statements_per_second: (after - before) as f64 / window.as_secs_f64(),
            window_seconds: window.as_secs_f64(),
        }),
    })
}

/// The reference's percentile: the element at `q × (n − 1)` of the sorted values
/// (its p50 is the median, which is the same for these sizes up to interpolation).
fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    if q == 0.5 {
        let n = sorted.len();
        return if n % 2 == 1 {
            sorted[n / 2]
        } else {
            (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0
        };
    }
    sorted[(q * (sorted.len() - 1) as f64) as usize]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_async_variant_follows_its_durable_twin_and_is_not_gated() {
        for (i, sc) in ALL.iter().enumerate() {
            if !sc.async_commit {
                continue;
            }
            let twin = &ALL[i - 1];
            assert_eq!(sc.name, format!("{}/async", twin.name));
            assert_eq!(sc.kind, twin.kind);
            assert!(sc.peer.is_empty(), "{} runs no reference", sc.name);
            assert!(!sc.gates_tuples_and_wal() && sc.ungated_statements().is_none());
            assert!(sc.gated_tuples().is_empty());
            assert_eq!(async_variant(twin.name).map(|v| v.name), Some(sc.name));
            // Every name of an outbox table derived from the scenario's fits Postgres.
            Outbox::builder().table(sc.table()).build().expect(sc.name);
        }
        assert!(async_variant("producer/ppt1").is_none());
    }
}
