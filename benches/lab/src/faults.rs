//! The fault matrix (`outbox-lab faults`, `docs/faults.md`): real workers consume N
//! plain messages and M keyed timers on a throwaway cluster while one fault is applied per
//! scenario; afterwards every published row is accounted for.
//!
//! Each handler run that completes successfully records `(key, generation)`: in memory for
//! in-process workers, as an autocommit `INSERT` into a side table for the `kill-9` worker
//! processes (their memory dies with them). A key is a message's payload (`m<i>`, raw queue)
//! or a timer's id (`t<i>`, `#[outbox::timer]`); the generation is 0 as published and grows
//! with each extend of the `deadlock-storm` scenario, whose last committed extend is the
//! version that must run. Then, per key:
//!
//! - **handled**: a successful run of its last version was recorded;
//! - **dead-lettered**, **still pending**: a row for it is in the DLQ or still in the queue;
//! - **lost**: none of those (must be 0);
//! - **redelivered**: successful runs beyond the first of one version (duplicates that
//!   at-least-once delivery allows: a completion that did not land, a lease that expired).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::process::{ExitCode, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::Args;
use outbox::{
    message::{BatchItem, Schedule},
    Context, HandlerOptions, Outbox, PgStore, Published, RetryStrategy, RunningWorker,
    ShutdownReport, Worker,
};
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use sqlx::{AssertSqlSafe, Connection, Row};

use outbox_bench::cluster::{Cluster, Control};
use outbox_bench::recorder;
use outbox_bench::report::Machine;
use outbox_bench::BoxError;

use self::timer::{extend_fault_timer, publish_fault_timer, FaultTimer};

mod timer {
    // The macro generates `cancel_fault_timer` too; the matrix does not cancel.
    #![allow(dead_code)]
    use serde::{Deserialize, Serialize};

    /// The keyed timer of the matrix: its key again (so a run knows what it handles) and
    /// the generation its last extend installed.
    #[outbox::timer(queue = "fault.timers", max_deliveries = 10)]
    #[derive(Debug, Clone, Serialize, Deserialize)]
    pub struct FaultTimer {
        pub key: String,
        pub gen: u32,
    }
}

/// The raw queue of the plain messages.
const QUEUE: &str = "fault.messages";
/// The queue of [`FaultTimer`].
const TIMER_QUEUE: &str = <FaultTimer as outbox::Timer>::QUEUE;
/// `application_name` of the workers' connections: what `terminate-storm` terminates.
const WORKER_APP: &str = "outbox-fault-worker";
/// `application_name` of the harness's own connections (never terminated).
const ADMIN_APP: &str = "outbox-fault-admin";
/// `application_name` of the `deadlock-storm` application transactions.
const APP_APP: &str = "outbox-fault-app";
/// `application_name` of the `kill-9` worker processes' recording connections.
const RECORDER_APP: &str = "outbox-fault-recorder";
/// The side table the `kill-9` worker processes record their runs in.
const RUNS_TABLE: &str = "fault_runs";
/// Timers are due from publish time to this much later, spread evenly.
const TIMER_SPREAD: Duration = Duration::from_secs(3);
/// The longest a scenario waits for its fault's trigger point (a share of the runs done).
const TRIGGER_WAIT: Duration = Duration::from_secs(30);

/// Every scenario, in run order.
pub const SCENARIOS: &[&str] = &[
    "terminate-storm",
    "restart-fast",
    "restart-immediate",
    "kill-9",
    "poison-rows",
    "long-handlers",
    "hung-handlers",
    "shutdown-under-load",
    "deadlock-storm",
    "failover",
];

/// `outbox-lab faults`.
#[derive(Args, Debug)]
pub struct FaultArgs {
    /// Plain messages per scenario (raw queue `fault.messages`, due at once).
    #[arg(long, default_value_t = 2000)]
    pub(crate) messages: usize,
    /// Keyed timers per scenario (`#[outbox::timer]` queue `fault.timers`), due over 3 s.
    #[arg(long, default_value_t = 200)]
    pub(crate) timers: usize,
    /// Comma-separated scenario names (default: all).
    #[arg(long, value_delimiter = ',')]
    pub(crate) only: Vec<String>,
    /// The longest a scenario waits for its queue to drain after the fault.
    #[arg(long, default_value_t = 60)]
    pub(crate) drain_timeout_secs: u64,
    /// The server whose settings the throwaway cluster copies (as for `run`).
    #[arg(long, default_value = "postgres://postgres@127.0.0.1:5432/postgres")]
    mirror: String,
    /// Extra `name=value` server setting for the throwaway cluster (repeatable).
    #[arg(long, value_name = "NAME=VALUE")]
    pub(crate) pg_set: Vec<String>,
    /// Runs the Citus faults instead, on the cluster of `.ci/citus` (`.ci/citus -- cargo run
    /// --release -p outbox-lab -- faults --citus`): a worker node down, a worker node
    /// restarted with `-m immediate`, a rebalance by `block_writes` and by logical
    /// replication, each under load.
    #[arg(long)]
    pub(crate) citus: bool,
    /// With `--citus`: the outboxes' bucket count (`OutboxBuilder::distributed`).
    #[arg(long, default_value_t = 32, requires = "citus")]
    pub(crate) buckets: u16,
}

/// `outbox-lab fault-worker` (hidden): the worker process of the `kill-9` scenario. It
/// serves both queues of `--table`, records each successful run in `fault_runs`, and
/// shuts down gracefully when its standard input closes.
#[derive(Args, Debug)]
pub struct WorkerArgs {
    #[arg(long)]
    dsn: String,
    #[arg(long)]
    table: String,
    #[arg(long, default_value_t = 4)]
    concurrency: usize,
    #[arg(long, default_value_t = 2000)]
    lease_ttl_ms: u64,
    #[arg(long, default_value_t = 1)]
    pace_min_ms: u64,
    #[arg(long, default_value_t = 4)]
    pace_max_ms: u64,
}

// ---------------------------------------------------------------------------------------
// Handlers and what they record.

/// Successful runs per `(key, generation)`, in memory.
#[derive(Default)]
pub(crate) struct Ledger {
    runs: Mutex<HashMap<(String, u32), u32>>,
    total: AtomicU64,
    /// Runs under way per `(key, generation)`, and how many runs started while another run
    /// of the same version was under way.
    running: Mutex<HashMap<(String, u32), u32>>,
    overlaps: AtomicU64,
}

/// A run under way in a [`Ledger`]; ends when dropped (also when a timeout drops the run).
struct Running {
    ledger: Arc<Ledger>,
    version: (String, u32),
}

impl Drop for Running {
    fn drop(&mut self) {
        let mut running = self
            .ledger
            .running
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if let Some(n) = running.get_mut(&self.version) {
            *n -= 1;
            if *n == 0 {
                running.remove(&self.version);
            }
        }
    }
}

impl Ledger {
    fn start(self: &Arc<Self>, key: &str, gen: u32) -> Running {
        let version = (key.to_owned(), gen);
        let mut running = self.running.lock().unwrap_or_else(|p| p.into_inner());
        let n = running.entry(version.clone()).or_default();
        if *n > 0 {
            self.overlaps.fetch_add(1, Ordering::SeqCst);
        }
        *n += 1;
        Running {
            ledger: self.clone(),
            version,
        }
    }

    /// Runs that started while another run of the same row (and version) was under way.
    pub(crate) fn overlaps(&self) -> u64 {
        self.overlaps.load(Ordering::SeqCst)
    }

    fn record(&self, key: String, gen: u32) {
        *self
            .runs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry((key, gen))
            .or_default() += 1;
        self.total.fetch_add(1, Ordering::SeqCst);
    }

    pub(crate) fn total(&self) -> u64 {
        self.total.load(Ordering::SeqCst)
    }

    pub(crate) fn snapshot(&self) -> HashMap<(String, u32), u32> {
        self.runs.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

/// Where a successful run is recorded.
#[derive(Clone)]
pub(crate) enum Recorder {
    Memory(Arc<Ledger>),
    /// An autocommit insert into [`RUNS_TABLE`] (the `kill-9` worker processes).
    Table(PgPool),
}

impl Recorder {
    async fn record(&self, key: String, gen: u32) -> Result<(), String> {
        match self {
            Recorder::Memory(l) => {
                l.record(key, gen);
                Ok(())
            }
            Recorder::Table(pool) => sqlx::query(AssertSqlSafe(format!(
                "INSERT INTO {RUNS_TABLE} (key, gen, pid) VALUES ($1, $2, $3)"
            )))
            .bind(key)
            .bind(i32::try_from(gen).unwrap_or(i32::MAX))
            .bind(i32::try_from(std::process::id()).unwrap_or(0))
            .execute(pool)
            .await
            .map(drop)
            .map_err(|e| format!("recording the run: {e}")),
        }
    }
}

/// What a handler run does before it records itself.
#[derive(Clone, Default)]
pub(crate) struct Behavior {
    /// Every run sleeps a random time in this range (ms), unless said otherwise below.
    pace_ms: (u64, u64),
    /// Timer runs sleep in this range instead, when set.
    timer_pace_ms: Option<(u64, u64)>,
    /// Keys whose every run sleeps `slow_ms`.
    slow: Arc<HashSet<String>>,
    slow_ms: u64,
    /// Keys whose runs never return.
    hung: Arc<HashSet<String>>,
}

impl Behavior {
    pub(crate) fn paced(min: u64, max: u64) -> Self {
        Behavior {
            pace_ms: (min, max),
            ..Behavior::default()
        }
    }

    async fn run(&self, rec: &Recorder, key: String, gen: u32, timer: bool) -> Result<(), String> {
        let _running = match rec {
            Recorder::Memory(l) => Some(l.start(&key, gen)),
            Recorder::Table(_) => None,
        };
        if self.hung.contains(&key) {
            std::future::pending::<()>().await;
        }
        let ms = if self.slow.contains(&key) {
            self.slow_ms
        } else {
            let (lo, hi) = match self.timer_pace_ms {
                Some(p) if timer => p,
                _ => self.pace_ms,
            };
            if hi > lo {
                rand::random_range(lo..=hi)
            } else {
                lo
            }
        };
        if ms > 0 {
            tokio::time::sleep(Duration::from_millis(ms)).await;
        }
        rec.record(key, gen).await
    }
}

/// Worker knobs of a scenario.
#[derive(Clone, Copy)]
pub(crate) struct Knobs {
    concurrency: usize,
    fetch: usize,
    ack_batch: usize,
    lease_ttl: Duration,
    graceful: Duration,
    timeout: Option<Duration>,
    retry: Option<RetryStrategy>,
    max_deliveries: Option<u32>,
}

impl Default for Knobs {
    fn default() -> Self {
        Knobs {
            concurrency: 4,
            fetch: 10,
            ack_batch: 1,
            // Short, so a row whose completion did not land comes back within the run.
            lease_ttl: Duration::from_secs(2),
            graceful: Duration::from_secs(2),
            timeout: None,
            retry: None,
            max_deliveries: None,
        }
    }
}

/// Starts a worker serving both queues, on a pool of its own whose connections carry
/// [`WORKER_APP`]. Returns the pool too, to close it after the shutdown.
pub(crate) fn start_worker(
    opts: &PgConnectOptions,
    outbox: &Outbox,
    knobs: Knobs,
    behavior: &Behavior,
    rec: &Recorder,
) -> Result<(RunningWorker, PgPool), BoxError> {
    let pool = PgPoolOptions::new()
        .max_connections(u32::try_from(knobs.concurrency + 2)?)
        // As the PgStore docs recommend: the worker retries what fails on a dead connection.
        .test_before_acquire(false)
        .acquire_timeout(Duration::from_secs(10))
        .connect_lazy_with(opts.clone().application_name(WORKER_APP));
    let mut options = HandlerOptions::new();
    if let Some(t) = knobs.timeout {
        options = options.timeout(t);
    }
    if let Some(r) = knobs.retry {
        options = options.retry(r);
    }
    if let Some(m) = knobs.max_deliveries {
        options = options.max_deliveries(m);
    }
    let raw = {
        let (b, rec) = (behavior.clone(), rec.clone());
        move |payload: Vec<u8>, _: Context| {
            let (b, rec) = (b.clone(), rec.clone());
            async move {
                let key = String::from_utf8_lossy(&payload).into_owned();
                b.run(&rec, key, 0, false).await
            }
        }
    };
    let typed = {
        let (b, rec) = (behavior.clone(), rec.clone());
        move |t: FaultTimer, _: Context| {
            let (b, rec) = (b.clone(), rec.clone());
            async move { b.run(&rec, t.key, t.gen, true).await }
        }
    };
    let worker = Worker::builder(PgStore::new(pool.clone(), outbox.clone()))
        .queue_with(QUEUE, raw, options)
        .timer_with::<FaultTimer>(typed, options)
        .concurrency(knobs.concurrency)
        .fetch_batch_size(knobs.fetch)
        .ack_batch_size(knobs.ack_batch)
        .lease_ttl(knobs.lease_ttl)
        .idle_poll(Duration::from_secs(1))
        .graceful_timeout(knobs.graceful)
        .build()?;
    Ok((worker.start(), pool))
}

pub(crate) async fn stop_worker(w: RunningWorker, pool: PgPool) -> ShutdownReport {
    let report = w.shutdown().await;
    pool.close().await;
    report
}

// ---------------------------------------------------------------------------------------
// The matrix.

/// What every scenario shares.
pub(crate) struct Ctx {
    /// Whose settings a throwaway cluster copies, and the extra settings (`failover`
    /// starts a primary and a standby of its own).
    pub(crate) mirror: String,
    pub(crate) pg_set: Vec<String>,
    pub(crate) dsn: String,
    pub(crate) opts: PgConnectOptions,
    /// The harness's pool (checks connections before use, so it survives restarts).
    pub(crate) admin: PgPool,
    /// The throwaway cluster's `pg_ctl` (none on a Citus cluster, whose nodes the Citus
    /// faults drive themselves).
    pub(crate) control: Option<Control>,
    /// `Some(buckets)`: the outboxes are distributed (a Citus coordinator).
    pub(crate) buckets: Option<u16>,
    pub(crate) messages: usize,
    pub(crate) timers: usize,
    pub(crate) drain_timeout: Duration,
}

/// One scenario's fresh tables and the keys published into them.
pub(crate) struct Prepared {
    pub(crate) outbox: Outbox,
    pub(crate) keys: Vec<String>,
}

impl Prepared {
    pub(crate) fn published(&self) -> usize {
        self.keys.len()
    }
}

/// One row of the final table.
pub(crate) struct Outcome {
    name: &'static str,
    published: usize,
    handled: usize,
    lost: usize,
    lost_keys: Vec<String>,
    redelivered: u64,
    dead: usize,
    pending: usize,
    wall: Duration,
    pub(crate) checks: Vec<(String, bool)>,
    pub(crate) notes: Vec<String>,
}

impl Outcome {
    fn failed(&self) -> Vec<&str> {
        self.checks
            .iter()
            .filter(|(_, ok)| !ok)
            .map(|(what, _)| what.as_str())
            .collect()
    }
}

/// `outbox-lab faults`.
pub async fn run(args: &FaultArgs) -> Result<ExitCode, BoxError> {
    let selected = select(&args.only, SCENARIOS)
        .map_err(|e| -> BoxError { format!("{e} (the Citus faults run with --citus)").into() })?;
    if args.messages == 0 && args.timers == 0 {
        return Err("nothing to publish: --messages and --timers are both 0".into());
    }
    let watch = recorder::watch();
    eprintln!("starting a throwaway Postgres cluster …");
    let cluster = Cluster::start(Some(&args.mirror), &args.pg_set)
        .await
        .map_err(|e| format!("could not start the throwaway Postgres cluster: {e}"))?;
    let dsn = cluster.dsn();
    let opts: PgConnectOptions = dsn.parse()?;
    let admin = admin_pool(&opts).await?;
    let version: String = sqlx::query_scalar("SELECT current_setting('server_version')")
        .fetch_one(&admin)
        .await?;
    let settings: Vec<String> = cluster
        .settings
        .iter()
        .filter(|(k, _)| {
            matches!(
                k.as_str(),
                "fsync" | "synchronous_commit" | "full_page_writes" | "shared_buffers"
            )
        })
        .map(|(k, v)| format!("{k}={}", v.trim_matches('\'')))
        .collect();
    let machine = Machine::read(
        &format!("PostgreSQL {version}"),
        &format!("throwaway cluster ({})", settings.join(" ")),
    );
    println!("{}", machine.describe());
    let ctx = Ctx {
        mirror: args.mirror.clone(),
        pg_set: args.pg_set.clone(),
        dsn,
        opts,
        admin,
        control: Some(cluster.control()),
        buckets: None,
        messages: args.messages,
        timers: args.timers,
        drain_timeout: Duration::from_secs(args.drain_timeout_secs),
    };
    let outcomes = scenarios(&watch, &selected, |name| {
        let ctx = &ctx;
        async move {
            match name {
                "terminate-storm" => terminate_storm(ctx).await,
                "restart-fast" => restart(ctx, "restart-fast", "fast").await,
                "restart-immediate" => restart(ctx, "restart-immediate", "immediate").await,
                "kill-9" => kill_9(ctx).await,
                "poison-rows" => poison_rows(ctx).await,
                "long-handlers" => long_handlers(ctx).await,
                "hung-handlers" => hung_handlers(ctx).await,
                "shutdown-under-load" => shutdown_under_load(ctx).await,
                "deadlock-storm" => deadlock_storm(ctx).await,
                "failover" => failover(ctx).await,
                other => Err(format!("no scenario `{other}`").into()),
            }
        }
    })
    .await?;
    ctx.admin.close().await;
    drop(cluster);
    Ok(conclude(&machine, args, &outcomes))
}

/// The scenarios of `only` (all of `known` when empty), in the order given.
pub(crate) fn select(only: &[String], known: &[&'static str]) -> Result<Vec<&'static str>, String> {
    if only.is_empty() {
        return Ok(known.to_vec());
    }
    only.iter()
        .map(|n| {
            known
                .iter()
                .copied()
                .find(|s| s == n)
                .ok_or_else(|| format!("unknown fault `{n}`; known: {}", known.join(", ")))
        })
        .collect()
}

/// The harness's pool on `opts` (application name [`ADMIN_APP`]).
pub(crate) async fn admin_pool(opts: &PgConnectOptions) -> Result<PgPool, BoxError> {
    Ok(PgPoolOptions::new()
        .max_connections(4)
        .acquire_timeout(Duration::from_secs(60))
        .connect_with(opts.clone().application_name(ADMIN_APP))
        .await?)
}

/// Runs each selected scenario with `scenario`, adds the worker counters that moved to its
/// notes (except `kill-9`'s, whose workers are other processes) and prints its block.
pub(crate) async fn scenarios<F, Fut>(
    watch: &recorder::Watch,
    selected: &[&'static str],
    mut scenario: F,
) -> Result<Vec<Outcome>, BoxError>
where
    F: FnMut(&'static str) -> Fut,
    Fut: std::future::Future<Output = Result<Outcome, BoxError>>,
{
    let mut outcomes = Vec::new();
    for &name in selected {
        eprintln!("── {name}");
        let before = watch.tracked();
        let mut o = scenario(name).await?;
        if name != "kill-9" {
            let counters: Vec<String> = watch
                .tracked()
                .iter()
                .filter_map(|(k, &now)| {
                    let was = before.get(k).copied().unwrap_or(0);
                    (now > was).then(|| {
                        format!(
                            "{} {}",
                            k.trim_start_matches("outbox_").replace("_total", ""),
                            now - was
                        )
                    })
                })
                .collect();
            if !counters.is_empty() {
                o.notes
                    .push(format!("worker metrics: {}", counters.join(", ")));
            }
        }
        print_outcome(&o);
        outcomes.push(o);
    }
    Ok(outcomes)
}

/// Prints the machine, the Markdown table and the verdict; the exit status.
pub(crate) fn conclude(machine: &Machine, args: &FaultArgs, outcomes: &[Outcome]) -> ExitCode {
    println!();
    println!("{}", machine.describe());
    println!(
        "{} messages + {} timers per fault; lease_ttl 2 s unless stated\n",
        args.messages, args.timers
    );
    println!("{}", markdown(outcomes));
    let lost: usize = outcomes.iter().map(|o| o.lost).sum();
    let broken: Vec<String> = outcomes
        .iter()
        .flat_map(|o| {
            o.failed()
                .into_iter()
                .map(move |f| format!("{}: {f}", o.name))
        })
        .collect();
    if lost > 0 {
        println!("FAULTS: {lost} row(s) lost");
    }
    for b in &broken {
        println!("FAULTS: expectation not met: {b}");
    }
    if lost > 0 || !broken.is_empty() {
        ExitCode::FAILURE
    } else {
        println!("faults: ok ({} scenarios, nothing lost)", outcomes.len());
        ExitCode::SUCCESS
    }
}

fn print_outcome(o: &Outcome) {
    println!(
        "{:<20} published {:>5}  handled {:>5}  lost {:>3}  redelivered {:>4}  dead-lettered {:>3}  pending {:>3}  {:>6.1} s  {}",
        o.name,
        o.published,
        o.handled,
        o.lost,
        o.redelivered,
        o.dead,
        o.pending,
        o.wall.as_secs_f64(),
        verdict(o)
    );
    for n in &o.notes {
        println!("    {n}");
    }
    for (what, ok) in &o.checks {
        println!("    [{}] {what}", if *ok { "ok" } else { "FAILED" });
    }
    if !o.lost_keys.is_empty() {
        let shown: Vec<&str> = o.lost_keys.iter().take(20).map(String::as_str).collect();
        println!("    LOST: {}", shown.join(", "));
    }
}

fn verdict(o: &Outcome) -> String {
    let failed = o.failed();
    if failed.is_empty() {
        "ok".to_owned()
    } else {
        format!("FAILED: {}", failed.join("; "))
    }
}

fn markdown(outcomes: &[Outcome]) -> String {
    let mut s = String::from(
        "| fault | published | handled | lost | redelivered | dead-lettered | still pending | wall (s) | result | notes |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|---|---|\n",
    );
    for o in outcomes {
        s.push_str(&format!(
            "| `{}` | {} | {} | {} | {} | {} | {} | {:.1} | {} | {} |\n",
            o.name,
            o.published,
            o.handled,
            o.lost,
            o.redelivered,
            o.dead,
            o.pending,
            o.wall.as_secs_f64(),
            verdict(o),
            o.notes.join("; ").replace('|', "/"),
        ));
    }
    s
}

// ---------------------------------------------------------------------------------------
// Shared steps.

/// Fresh tables `fault_<name>` (DLQ on), the messages and timers published in one
/// transaction. Distributed, a `publish_batch` lands in one bucket, so the messages go in
/// batches of at most N / (2 × buckets) rows, every bucket getting some.
pub(crate) async fn prepare(ctx: &Ctx, name: &str) -> Result<Prepared, BoxError> {
    let outbox = outbox_for(ctx, name)?;
    sqlx::raw_sql(AssertSqlSafe(format!(
        "DROP TABLE IF EXISTS {}, {}, {}, {}",
        outbox.table(),
        outbox.dead_letter_table(),
        outbox.migrations_table(),
        outbox.paused_table()
    )))
    .execute(&ctx.admin)
    .await?;
    outbox.migrate(&ctx.admin).await?;
    let messages: Vec<String> = (0..ctx.messages).map(|i| format!("m{i}")).collect();
    let timers: Vec<String> = (0..ctx.timers).map(|i| format!("t{i}")).collect();
    let mut tx = ctx.admin.begin().await?;
    let batch = match ctx.buckets {
        Some(b) => (messages.len() / (2 * usize::from(b))).clamp(1, 500),
        None => 500,
    };
    for chunk in messages.chunks(batch) {
        let items: Vec<BatchItem<'_>> =
            chunk.iter().map(|k| BatchItem::new(k.as_bytes())).collect();
        outbox
            .publish_batch(&mut tx, QUEUE, &items, Schedule::now())
            .await?;
    }
    for (i, key) in timers.iter().enumerate() {
        let due = TIMER_SPREAD.mul_f64(i as f64 / timers.len() as f64);
        let timer = FaultTimer {
            key: key.clone(),
            gen: 0,
        };
        publish_fault_timer(outbox.on(&mut tx), key, &timer, due).await?;
    }
    tx.commit().await?;
    let mut keys = messages;
    keys.extend(timers);
    Ok(Prepared { outbox, keys })
}

/// The tables of scenario `name`: `fault_<name>` and its DLQ, which is on; distributed
/// over `ctx.buckets` when set.
fn outbox_for(ctx: &Ctx, name: &str) -> Result<Outbox, BoxError> {
    let builder = Outbox::builder().table(table_for(name)).dead_letter(true);
    let builder = match ctx.buckets {
        Some(b) => builder.distributed(b),
        None => builder,
    };
    Ok(builder.build()?)
}

pub(crate) fn table_for(name: &str) -> String {
    format!("fault_{}", name.replace('-', "_"))
}

/// `k` keys spread evenly over `prefix0 … prefix(count-1)`.
fn pick(prefix: &str, count: usize, k: usize) -> Vec<String> {
    let k = k.min(count);
    (0..k)
        .map(|j| format!("{prefix}{}", j * count / k.max(1)))
        .collect()
}

/// Waits until `done()` reaches `share` of `published`, at most [`TRIGGER_WAIT`]; says
/// when it gave up.
pub(crate) async fn trigger_at<F, Fut>(
    name: &str,
    published: usize,
    share: f64,
    mut done: F,
) -> Option<String>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = u64>,
{
    if share <= 0.0 {
        return None;
    }
    let target = (published as f64 * share).ceil() as u64;
    let end = Instant::now() + TRIGGER_WAIT;
    loop {
        let now = done().await;
        if now >= target {
            eprintln!("   {name}: fault at {now} runs done");
            return None;
        }
        if Instant::now() > end {
            return Some(format!(
                "trigger point ({target} runs) not reached in {} s; fault applied at {now}",
                TRIGGER_WAIT.as_secs()
            ));
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Live rows of the scenario's table (every status), polled until there are none or the
/// drain timeout passes. Errors (a restarting server) count as "not drained yet".
pub(crate) async fn drain(ctx: &Ctx, outbox: &Outbox) -> bool {
    let end = Instant::now() + ctx.drain_timeout;
    let sql = format!("SELECT count(*) FROM {}", outbox.table());
    loop {
        let left: Result<i64, sqlx::Error> = sqlx::query_scalar(AssertSqlSafe(sql.clone()))
            .fetch_one(&ctx.admin)
            .await;
        if matches!(left, Ok(0)) {
            return true;
        }
        if Instant::now() > end {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The key and generation a stored payload of `queue` stands for.
pub(crate) fn key_of(queue: &str, timer_id: Option<&str>, payload: &[u8]) -> (String, u32) {
    if queue == QUEUE {
        return (String::from_utf8_lossy(payload).into_owned(), 0);
    }
    match serde_json::from_slice::<FaultTimer>(payload) {
        Ok(t) => (t.key, t.gen),
        Err(_) => (timer_id.unwrap_or_default().to_owned(), 0),
    }
}

/// Reads the queue and the DLQ and accounts for every published key.
pub(crate) async fn tally(
    ctx: &Ctx,
    name: &'static str,
    p: &Prepared,
    runs: &HashMap<(String, u32), u32>,
    last_gen: &HashMap<String, u32>,
    wall: Duration,
) -> Result<Outcome, BoxError> {
    let t = p.outbox.table();
    let live = sqlx::query(AssertSqlSafe(format!(
        "SELECT queue, timer_id, payload, rearm_payload FROM {t}"
    )))
    .fetch_all(&ctx.admin)
    .await?;
    let mut in_queue: HashSet<(String, u32)> = HashSet::new();
    for r in &live {
        let queue: String = r.try_get("queue")?;
        let timer_id: Option<String> = r.try_get("timer_id")?;
        let payload: Vec<u8> = r.try_get("payload")?;
        in_queue.insert(key_of(&queue, timer_id.as_deref(), &payload));
        if let Some(rearm) = r.try_get::<Option<Vec<u8>>, _>("rearm_payload")? {
            in_queue.insert(key_of(&queue, timer_id.as_deref(), &rearm));
        }
    }
    let dead = sqlx::query(AssertSqlSafe(format!(
        "SELECT queue, timer_id, payload, failure_reason FROM {}",
        p.outbox.dead_letter_table()
    )))
    .fetch_all(&ctx.admin)
    .await?;
    let mut in_dlq: HashSet<(String, u32)> = HashSet::new();
    let mut reasons: BTreeMap<String, usize> = BTreeMap::new();
    for r in &dead {
        let queue: String = r.try_get("queue")?;
        let timer_id: Option<String> = r.try_get("timer_id")?;
        let payload: Vec<u8> = r.try_get("payload")?;
        in_dlq.insert(key_of(&queue, timer_id.as_deref(), &payload));
        *reasons
            .entry(r.try_get::<String, _>("failure_reason")?)
            .or_default() += 1;
    }
    let Accounting {
        handled,
        lost_keys,
        redelivered,
    } = account(&p.keys, last_gen, runs, &in_queue, &in_dlq);
    let mut notes = Vec::new();
    if !reasons.is_empty() {
        let r: Vec<String> = reasons.iter().map(|(k, v)| format!("{k} {v}")).collect();
        notes.push(format!("DLQ: {}", r.join(", ")));
    }
    let mut o = Outcome {
        name,
        published: p.published(),
        handled,
        lost: lost_keys.len(),
        lost_keys,
        redelivered,
        dead: dead.len(),
        pending: live.len(),
        wall,
        checks: Vec::new(),
        notes,
    };
    o.checks.push(("nothing lost".to_owned(), o.lost == 0));
    o.checks.push((
        format!("drained within {} s", ctx.drain_timeout.as_secs()),
        o.pending == 0,
    ));
    Ok(o)
}

/// What became of the published keys.
#[derive(Debug, PartialEq)]
struct Accounting {
    /// Keys whose last version ran successfully.
    handled: usize,
    /// `key@version` of the keys whose last version neither ran nor is in the queue or
    /// the DLQ.
    lost_keys: Vec<String>,
    /// Successful runs beyond the first, over every version.
    redelivered: u64,
}

/// Accounts for every key: its last version is `last_gen[key]` (0 when absent).
fn account(
    keys: &[String],
    last_gen: &HashMap<String, u32>,
    runs: &HashMap<(String, u32), u32>,
    in_queue: &HashSet<(String, u32)>,
    in_dlq: &HashSet<(String, u32)>,
) -> Accounting {
    let mut handled = 0;
    let mut lost_keys = Vec::new();
    for key in keys {
        let version = (key.clone(), last_gen.get(key).copied().unwrap_or(0));
        if runs.get(&version).is_some_and(|&n| n > 0) {
            handled += 1;
        } else if !in_queue.contains(&version) && !in_dlq.contains(&version) {
            lost_keys.push(format!("{}@{}", version.0, version.1));
        }
    }
    let redelivered = runs.values().map(|&n| u64::from(n.saturating_sub(1))).sum();
    Accounting {
        handled,
        lost_keys,
        redelivered,
    }
}

/// DLQ rows by reason.
async fn dlq_reasons(ctx: &Ctx, outbox: &Outbox) -> Result<BTreeMap<String, i64>, BoxError> {
    let rows = sqlx::query(AssertSqlSafe(format!(
        "SELECT failure_reason, count(*) AS n FROM {} GROUP BY 1",
        outbox.dead_letter_table()
    )))
    .fetch_all(&ctx.admin)
    .await?;
    let mut out = BTreeMap::new();
    for r in rows {
        out.insert(r.try_get::<String, _>(0)?, r.try_get::<i64, _>(1)?);
    }
    Ok(out)
}

pub(crate) fn shutdown_note(label: &str, r: &ShutdownReport) -> String {
    format!(
        "{label}: graceful {}, abandoned {}, released {}, retried {}, aborted {}, unreleased {}",
        r.graceful, r.abandoned, r.released, r.retried, r.aborted, r.unreleased
    )
}

/// The common shape: one in-process worker, a fault applied by `fault` once `share` of the
/// rows ran, then drain and tally.
pub(crate) async fn simple<F, Fut>(
    ctx: &Ctx,
    name: &'static str,
    knobs: Knobs,
    behavior: Behavior,
    share: f64,
    fault: F,
) -> Result<Outcome, BoxError>
where
    F: FnOnce(Arc<Ledger>) -> Fut,
    Fut: std::future::Future<Output = Result<Vec<String>, BoxError>>,
{
    let p = prepare(ctx, name).await?;
    let ledger = Arc::new(Ledger::default());
    let rec = Recorder::Memory(ledger.clone());
    let started = Instant::now();
    let (w, pool) = start_worker(&ctx.opts, &p.outbox, knobs, &behavior, &rec)?;
    let mut notes = Vec::new();
    let done = || {
        let n = ledger.total();
        async move { n }
    };
    notes.extend(trigger_at(name, p.published(), share, done).await);
    notes.extend(fault(ledger.clone()).await?);
    drain(ctx, &p.outbox).await;
    let wall = started.elapsed();
    let report = stop_worker(w, pool).await;
    if !report.graceful {
        notes.push(shutdown_note("final shutdown", &report));
    }
    let mut o = tally(ctx, name, &p, &ledger.snapshot(), &HashMap::new(), wall).await?;
    o.notes.extend(notes);
    overlaps(&mut o, &ledger);
    Ok(o)
}

/// Notes the runs that started while another run of the same row was under way (none is
/// expected in any scenario: a lease is renewed while its run lasts).
pub(crate) fn overlaps(o: &mut Outcome, ledger: &Ledger) {
    let n = ledger.overlaps();
    if n > 0 {
        o.notes
            .push(format!("{n} run(s) started while the same row was running"));
    }
}

// ---------------------------------------------------------------------------------------
// The scenarios.

/// `pg_terminate_backend` on every worker backend, every 100 ms for 3 s.
async fn terminate_storm(ctx: &Ctx) -> Result<Outcome, BoxError> {
    let admin = ctx.admin.clone();
    simple(
        ctx,
        "terminate-storm",
        Knobs::default(),
        Behavior::paced(1, 4),
        0.2,
        |_| async move {
            let end = Instant::now() + Duration::from_secs(3);
            let (mut rounds, mut killed) = (0u32, 0i64);
            while Instant::now() < end {
                let n: i64 = sqlx::query_scalar(
                    "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity \
                     WHERE application_name = $1 AND pid <> pg_backend_pid()",
                )
                .bind(WORKER_APP)
                .fetch_one(&admin)
                .await?;
                rounds += 1;
                killed += n;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Ok(vec![format!(
                "{killed} worker backends terminated in {rounds} rounds over 3 s"
            )])
        },
    )
    .await
}

/// `pg_ctl restart -m <mode>` of the whole cluster once 30 % of the rows ran.
async fn restart(ctx: &Ctx, name: &'static str, mode: &'static str) -> Result<Outcome, BoxError> {
    let control = ctx
        .control
        .clone()
        .ok_or("restart needs the throwaway cluster's pg_ctl")?;
    simple(
        ctx,
        name,
        Knobs::default(),
        Behavior::paced(1, 4),
        0.3,
        |_| async move {
            let t = Instant::now();
            tokio::task::spawn_blocking(move || control.restart(mode)).await??;
            let took = t.elapsed();
            // The first completion written after pg_ctl returned: the worker is back.
            let watch = recorder::watch();
            let at = watch.acked();
            let back = Instant::now();
            let mut resumed = None;
            while back.elapsed() < Duration::from_secs(30) {
                if watch.acked() > at {
                    resumed = Some(back.elapsed());
                    break;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            Ok(vec![format!(
                "pg_ctl restart -m {mode} took {:.1} s; the worker's next ack landed {} after it returned",
                took.as_secs_f64(),
                resumed.map_or("not within 30 s".to_owned(), |d| format!(
                    "{:.0} ms",
                    d.as_secs_f64() * 1e3
                ))
            )])
        },
    )
    .await
}

/// A failover on a primary and a streaming standby of their own (the matrix's cluster keeps
/// serving the other scenarios): the rows are published on the primary and the worker runs
/// there; once 30 % ran, the primary stops (`pg_ctl stop -m fast`), the standby is promoted
/// and restarted on the primary's port, as a failover that moves the primary's address does.
/// The same worker, never restarted, finishes the rows on the promoted standby.
async fn failover(ctx: &Ctx) -> Result<Outcome, BoxError> {
    let name = "failover";
    let primary = Cluster::start(Some(&ctx.mirror), &ctx.pg_set).await?;
    let standby = primary.standby().await?;
    let port = primary.port();
    let opts: PgConnectOptions = primary.dsn().parse()?;
    let admin = admin_pool(&opts).await?;
    let pair = Ctx {
        mirror: ctx.mirror.clone(),
        pg_set: ctx.pg_set.clone(),
        dsn: primary.dsn(),
        opts,
        admin,
        control: Some(primary.control()),
        buckets: None,
        messages: ctx.messages,
        timers: ctx.timers,
        drain_timeout: ctx.drain_timeout,
    };
    let p = prepare(&pair, name).await?;
    let ledger = Arc::new(Ledger::default());
    let rec = Recorder::Memory(ledger.clone());
    let started = Instant::now();
    let (w, pool) = start_worker(
        &pair.opts,
        &p.outbox,
        Knobs::default(),
        &Behavior::paced(1, 4),
        &rec,
    )?;
    let mut notes = Vec::new();
    let done = || {
        let n = ledger.total();
        async move { n }
    };
    notes.extend(trigger_at(name, p.published(), 0.3, done).await);
    // How much WAL the standby had not replayed when the primary was told to stop: a
    // fast shutdown still sends it (its walsenders finish before it ends).
    let behind: Option<i64> = sqlx::query_scalar(
        "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), replay_lsn)::bigint FROM pg_stat_replication",
    )
    .fetch_optional(&pair.admin)
    .await?
    .flatten();
    let ran_before = ledger.total();
    let t = Instant::now();
    let (primary, standby) = tokio::task::spawn_blocking(move || -> Result<_, String> {
        let mut standby = standby;
        primary.stop("fast").map_err(|e| e.to_string())?;
        standby.promote().map_err(|e| e.to_string())?;
        standby.move_to_port(port).map_err(|e| e.to_string())?;
        Ok((primary, standby))
    })
    .await??;
    let took = t.elapsed();
    let watch = recorder::watch();
    let at = watch.acked();
    let back = Instant::now();
    let mut resumed = None;
    while back.elapsed() < Duration::from_secs(30) {
        if watch.acked() > at {
            resumed = Some(back.elapsed());
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    notes.push(format!(
        "{ran_before} runs before the switch; standby {} bytes behind then; stop + promote + restart on the primary's port took {:.1} s; the worker's next ack landed {} after",
        behind.map_or("?".to_owned(), |b| b.to_string()),
        took.as_secs_f64(),
        resumed.map_or("not within 30 s".to_owned(), |d| format!(
            "{:.0} ms",
            d.as_secs_f64() * 1e3
        ))
    ));
    drain(&pair, &p.outbox).await;
    let wall = started.elapsed();
    let report = stop_worker(w, pool).await;
    if !report.graceful {
        notes.push(shutdown_note("final shutdown", &report));
    }
    let mut o = tally(&pair, name, &p, &ledger.snapshot(), &HashMap::new(), wall).await?;
    o.checks.push((
        "the worker resumed on the promoted standby within 30 s".to_owned(),
        resumed.is_some(),
    ));
    o.notes.extend(notes);
    pair.admin.close().await;
    drop(standby);
    drop(primary);
    Ok(o)
}

/// Rows whose headers are not a string map (set by SQL) and rows whose lease a trigger
/// refuses: those end in the DLQ (`decode_error`, `max_deliveries`), the others run.
async fn poison_rows(ctx: &Ctx) -> Result<Outcome, BoxError> {
    let name = "poison-rows";
    let p = prepare(ctx, name).await?;
    let t = p.outbox.table().to_owned();
    let bad_headers = spread(ctx, 4, 2, 1);
    let bad_lease: Vec<String> = spread(ctx, 4, 2, 3)
        .into_iter()
        .filter(|k| !bad_headers.contains(k))
        .collect();
    let (hm, ht) = split_keys(&bad_headers);
    sqlx::query(AssertSqlSafe(format!(
        "UPDATE {t} SET headers = '{{\"n\": 1}}' \
         WHERE (queue = $1 AND convert_from(payload, 'UTF8') = ANY($2)) \
            OR (queue = $3 AND timer_id = ANY($4))"
    )))
    .bind(QUEUE)
    .bind(&hm)
    .bind(TIMER_QUEUE)
    .bind(&ht)
    .execute(&ctx.admin)
    .await?;
    let (lm, lt) = split_keys(&bad_lease);
    let fun = format!("{}_poison", t.trim_matches('"'));
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE FUNCTION {fun}() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN \
           IF NEW.acquired_token IS NOT NULL AND ( \
                (NEW.queue = '{QUEUE}' AND convert_from(NEW.payload, 'UTF8') = ANY(ARRAY[{}]::text[])) \
             OR (NEW.queue = '{}' AND NEW.timer_id = ANY(ARRAY[{}]::text[]))) THEN \
             RAISE EXCEPTION 'row % refuses a lease', NEW.id; END IF; \
           RETURN NEW; END $$; \
         CREATE TRIGGER poison BEFORE UPDATE ON {t} FOR EACH ROW EXECUTE FUNCTION {fun}()",
        sql_list(&lm),
        TIMER_QUEUE,
        sql_list(&lt),
    )))
    .execute(&ctx.admin)
    .await?;

    let ledger = Arc::new(Ledger::default());
    let rec = Recorder::Memory(ledger.clone());
    let knobs = Knobs {
        // Set aside 1 s, then 2 s; archived at the third observed failure.
        max_deliveries: Some(2),
        ..Knobs::default()
    };
    let started = Instant::now();
    let (w, pool) = start_worker(&ctx.opts, &p.outbox, knobs, &Behavior::paced(1, 4), &rec)?;
    drain(ctx, &p.outbox).await;
    let wall = started.elapsed();
    stop_worker(w, pool).await;
    let mut o = tally(ctx, name, &p, &ledger.snapshot(), &HashMap::new(), wall).await?;
    let reasons = dlq_reasons(ctx, &p.outbox).await?;
    let poison = bad_headers.len() + bad_lease.len();
    o.notes.insert(
        0,
        format!(
            "{} rows with headers {{\"n\": 1}}, {} rows whose lease a trigger refuses; max_deliveries 2",
            bad_headers.len(),
            bad_lease.len()
        ),
    );
    o.checks.push((
        format!("{} decode_error in the DLQ", bad_headers.len()),
        reasons.get("decode_error").copied().unwrap_or(0) == bad_headers.len() as i64,
    ));
    o.checks.push((
        format!("{} max_deliveries in the DLQ", bad_lease.len()),
        reasons.get("max_deliveries").copied().unwrap_or(0) == bad_lease.len() as i64,
    ));
    o.checks.push((
        "every other row handled".to_owned(),
        o.handled == p.published() - poison,
    ));
    sqlx::raw_sql(AssertSqlSafe(format!("DROP FUNCTION {fun}() CASCADE")))
        .execute(&ctx.admin)
        .await?;
    Ok(o)
}

/// `messages` message keys and `timers` timer keys spread evenly over the published ones,
/// each moved `offset` places on (dropped when that leaves the published range).
fn spread(ctx: &Ctx, messages: usize, timers: usize, offset: usize) -> Vec<String> {
    let shift = |prefix: &str, count: usize, k: usize| -> Vec<String> {
        pick(prefix, count, k)
            .iter()
            .map(|key| key_index(key) + offset)
            .filter(|&i| i < count)
            .map(|i| format!("{prefix}{i}"))
            .collect()
    };
    let mut keys = shift("m", ctx.messages, messages);
    keys.extend(shift("t", ctx.timers, timers));
    keys
}

/// Message keys and timer keys apart.
fn split_keys(keys: &[String]) -> (Vec<String>, Vec<String>) {
    keys.iter().cloned().partition(|k| k.starts_with('m'))
}

/// `'a', 'b'` for keys made of `[a-z0-9]` only.
fn sql_list(keys: &[String]) -> String {
    keys.iter()
        .filter(|k| k.chars().all(|c| c.is_ascii_alphanumeric()))
        .map(|k| format!("'{k}'"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Handlers that run 3 × `lease_ttl` (1 s), claimed first so they fill every slot and
/// the rows behind them wait in the buffer just as long: no run may happen twice.
async fn long_handlers(ctx: &Ctx) -> Result<Outcome, BoxError> {
    let slow: HashSet<String> = (0..6.min(ctx.messages))
        .map(|i| format!("m{i}"))
        .chain((0..2.min(ctx.timers)).map(|i| format!("t{i}")))
        .collect();
    let count = slow.len();
    let knobs = Knobs {
        concurrency: count.max(1),
        lease_ttl: Duration::from_secs(1),
        graceful: Duration::from_secs(5),
        ..Knobs::default()
    };
    let behavior = Behavior {
        pace_ms: (1, 4),
        slow: Arc::new(slow),
        slow_ms: 3000,
        ..Behavior::default()
    };
    let mut o = simple(ctx, "long-handlers", knobs, behavior, 0.0, |_| async {
        Ok(Vec::new())
    })
    .await?;
    o.notes.insert(
        0,
        format!(
            "{count} runs of 3 s with lease_ttl 1 s and concurrency {count}; the rows claimed behind them (fetch_batch_size 10) wait in the buffer as long"
        ),
    );
    o.checks.push((
        "no redelivery (leases renewed)".to_owned(),
        o.redelivered == 0,
    ));
    Ok(o)
}

/// A few handlers never return; `timeout` 500 ms stops each run, three attempts, then the
/// DLQ with reason `timeout`.
async fn hung_handlers(ctx: &Ctx) -> Result<Outcome, BoxError> {
    let hung: HashSet<String> = spread(ctx, 3, 2, 7).into_iter().collect();
    let count = hung.len();
    let knobs = Knobs {
        timeout: Some(Duration::from_millis(500)),
        retry: Some(RetryStrategy::constant(Duration::from_millis(100)).max_attempts(3)),
        ..Knobs::default()
    };
    let behavior = Behavior {
        pace_ms: (1, 4),
        hung: Arc::new(hung),
        ..Behavior::default()
    };
    let name = "hung-handlers";
    let mut o = simple(ctx, name, knobs, behavior, 0.0, |_| async {
        Ok(Vec::new())
    })
    .await?;
    o.notes.insert(
        0,
        format!("{count} handlers never return; timeout 500 ms, 3 attempts 100 ms apart"),
    );
    let reasons = dlq_reasons(ctx, &outbox_for(ctx, name)?).await?;
    o.checks.push((
        format!("{count} timeout in the DLQ"),
        reasons.get("timeout").copied().unwrap_or(0) == count as i64 && o.dead == count,
    ));
    o.checks.push((
        "every other row handled".to_owned(),
        o.handled == o.published - count,
    ));
    Ok(o)
}

fn key_index(key: &str) -> usize {
    key[1..].parse().unwrap_or(usize::MAX)
}

/// A worker shut down at 30 % with `graceful_timeout` 50 ms while some 400 ms handlers
/// run; a second worker finishes.
async fn shutdown_under_load(ctx: &Ctx) -> Result<Outcome, BoxError> {
    let name = "shutdown-under-load";
    let p = prepare(ctx, name).await?;
    let slow: HashSet<String> = (0..ctx.messages)
        .step_by(40)
        .map(|i| format!("m{i}"))
        .chain((0..ctx.timers).step_by(10).map(|i| format!("t{i}")))
        .collect();
    let behavior = Behavior {
        pace_ms: (1, 5),
        slow: Arc::new(slow),
        slow_ms: 400,
        ..Behavior::default()
    };
    let knobs = Knobs {
        concurrency: 8,
        ack_batch: 4,
        graceful: Duration::from_millis(50),
        ..Knobs::default()
    };
    let ledger = Arc::new(Ledger::default());
    let rec = Recorder::Memory(ledger.clone());
    let started = Instant::now();
    let (a, pool_a) = start_worker(&ctx.opts, &p.outbox, knobs, &behavior, &rec)?;
    let mut notes = Vec::new();
    let done = || {
        let n = ledger.total();
        async move { n }
    };
    notes.extend(trigger_at(name, p.published(), 0.3, done).await);
    let t = Instant::now();
    let report = stop_worker(a, pool_a).await;
    let took = t.elapsed();
    notes.push(shutdown_note(
        &format!(
            "first worker's shutdown ({:.0} ms)",
            took.as_secs_f64() * 1e3
        ),
        &report,
    ));
    let (b, pool_b) = start_worker(&ctx.opts, &p.outbox, knobs, &behavior, &rec)?;
    drain(ctx, &p.outbox).await;
    let wall = started.elapsed();
    stop_worker(b, pool_b).await;
    let mut o = tally(ctx, name, &p, &ledger.snapshot(), &HashMap::new(), wall).await?;
    o.notes.insert(
        0,
        "concurrency 8, ack_batch_size 4, graceful_timeout 50 ms; 1 row in 40 (timers: 1 in 10) takes 400 ms"
            .to_owned(),
    );
    o.notes.extend(notes);
    o.checks.push((
        "first shutdown within graceful_timeout + 250 ms (+ 250 ms slack)".to_owned(),
        took <= knobs.graceful + outbox::worker::SHUTDOWN_GRACE + Duration::from_millis(250),
    ));
    Ok(o)
}

/// SIGKILL of a worker process at 35 %, then a new process finishes; runs are recorded in
/// a side table by autocommit inserts.
async fn kill_9(ctx: &Ctx) -> Result<Outcome, BoxError> {
    let name = "kill-9";
    let p = prepare(ctx, name).await?;
    sqlx::raw_sql(AssertSqlSafe(format!(
        "DROP TABLE IF EXISTS {RUNS_TABLE}; \
         CREATE TABLE {RUNS_TABLE} (key text NOT NULL, gen int NOT NULL, pid int NOT NULL, \
                                    at timestamptz NOT NULL DEFAULT clock_timestamp())"
    )))
    .execute(&ctx.admin)
    .await?;
    let exe = std::env::current_exe()?;
    let table = table_for(name);
    let spawn = || -> Result<tokio::process::Child, BoxError> {
        Ok(tokio::process::Command::new(&exe)
            .args(["fault-worker", "--dsn", &ctx.dsn, "--table", &table])
            .args(["--pace-min-ms", "0", "--pace-max-ms", "1"])
            .stdin(Stdio::piped())
            .kill_on_drop(true)
            .spawn()?)
    };
    let count_runs = || async move {
        sqlx::query_scalar::<_, i64>(AssertSqlSafe(format!("SELECT count(*) FROM {RUNS_TABLE}")))
            .fetch_one(&ctx.admin)
            .await
            .map_or(0, |n| u64::try_from(n).unwrap_or(0))
    };
    let started = Instant::now();
    let mut first = spawn()?;
    let mut notes = Vec::new();
    notes.extend(trigger_at(name, p.published(), 0.35, count_runs).await);
    first.start_kill()?;
    let status = first.wait().await?;
    // The dead process's backends finish what they were executing (a statement already
    // sent still commits) and go; then its rows are the ones still leased.
    let gone = Instant::now() + Duration::from_secs(10);
    while Instant::now() < gone {
        let left: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name IN ($1, $2)",
        )
        .bind(WORKER_APP)
        .bind(RECORDER_APP)
        .fetch_one(&ctx.admin)
        .await?;
        if left == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let at_kill = count_runs().await;
    let (orphaned, ran): (i64, i64) = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT count(*), count(*) FILTER (WHERE EXISTS ( \
             SELECT 1 FROM {RUNS_TABLE} r WHERE r.key = coalesce(t.timer_id, convert_from(t.payload, 'UTF8')))) \
         FROM {} t WHERE acquired_token IS NOT NULL",
        p.outbox.table()
    )))
    .fetch_one(&ctx.admin)
    .await?;
    notes.push(format!(
        "worker process killed ({status}) after {at_kill} recorded runs; it left {orphaned} leased rows, \
         {ran} of them with their run already recorded (to be run again); a new process finished"
    ));
    let mut second = spawn()?;
    drain(ctx, &p.outbox).await;
    let wall = started.elapsed();
    // Closing its standard input shuts the second process down gracefully.
    drop(second.stdin.take());
    match tokio::time::timeout(Duration::from_secs(10), second.wait()).await {
        Ok(s) => {
            let s = s?;
            if !s.success() {
                notes.push(format!("second worker process exited with {s}"));
            }
        }
        Err(_) => {
            second.start_kill()?;
            second.wait().await?;
            notes.push("second worker process did not stop in 10 s; killed".to_owned());
        }
    }
    let rows = sqlx::query(AssertSqlSafe(format!(
        "SELECT key, gen, count(*) AS n FROM {RUNS_TABLE} GROUP BY 1, 2"
    )))
    .fetch_all(&ctx.admin)
    .await?;
    let mut runs = HashMap::new();
    for r in rows {
        let key: String = r.try_get(0)?;
        let gen: i32 = r.try_get(1)?;
        let n: i64 = r.try_get(2)?;
        runs.insert(
            (key, u32::try_from(gen).unwrap_or(0)),
            u32::try_from(n).unwrap_or(u32::MAX),
        );
    }
    let mut o = tally(ctx, name, &p, &runs, &HashMap::new(), wall).await?;
    o.notes.extend(notes);
    o.notes
        .push("worker metrics are in the killed processes (not shown)".to_owned());
    Ok(o)
}

/// `outbox-lab fault-worker`: the worker process of `kill-9`.
pub async fn child(a: &WorkerArgs) -> Result<ExitCode, BoxError> {
    let opts: PgConnectOptions = a.dsn.parse()?;
    let outbox = Outbox::builder()
        .table(&a.table)
        .dead_letter(true)
        .build()?;
    let recorder_pool = PgPoolOptions::new()
        .max_connections(u32::try_from(a.concurrency)?)
        .connect_lazy_with(opts.clone().application_name(RECORDER_APP));
    let rec = Recorder::Table(recorder_pool.clone());
    let knobs = Knobs {
        concurrency: a.concurrency,
        lease_ttl: Duration::from_millis(a.lease_ttl_ms),
        ..Knobs::default()
    };
    let (w, pool) = start_worker(
        &opts,
        &outbox,
        knobs,
        &Behavior::paced(a.pace_min_ms, a.pace_max_ms),
        &rec,
    )?;
    // Standard input closes when the parent says so, or when the parent dies; a read
    // error ends the wait too (the parent is unreachable either way).
    let _ = outbox_worker_process::stdin_closed().await;
    let report = stop_worker(w, pool).await;
    recorder_pool.close().await;
    if !report.graceful {
        eprintln!(
            "fault-worker {}: {}",
            std::process::id(),
            shutdown_note("shutdown", &report)
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// Application transactions extend random subsets of running timers, in random order,
/// holding each row lock for a while, against batched acks and renewals (lease_ttl 1 s):
/// no `40P01` may reach them, and each timer's last committed extend must run.
async fn deadlock_storm(ctx: &Ctx) -> Result<Outcome, BoxError> {
    const APPS: usize = 4;
    const STORM: Duration = Duration::from_secs(4);
    let name = "deadlock-storm";
    let p = prepare(ctx, name).await?;
    let ledger = Arc::new(Ledger::default());
    let rec = Recorder::Memory(ledger.clone());
    let knobs = Knobs {
        concurrency: 16,
        ack_batch: 8,
        lease_ttl: Duration::from_secs(1),
        ..Knobs::default()
    };
    let behavior = Behavior {
        pace_ms: (1, 3),
        // Timers run long enough for extends to land on them while they run.
        timer_pace_ms: Some((50, 250)),
        ..Behavior::default()
    };
    let app = PgPoolOptions::new()
        .max_connections(u32::try_from(APPS)?)
        .connect_with(ctx.opts.clone().application_name(APP_APP))
        .await?;
    // Generations: the next to install, and the last one committed, per key.
    let last_gen: Arc<Mutex<HashMap<String, u32>>> = Arc::default();
    let started = Instant::now();
    let (w, pool) = start_worker(&ctx.opts, &p.outbox, knobs, &behavior, &rec)?;
    let mut apps = Vec::new();
    for part in 0..APPS {
        let (app, outbox, last_gen) = (app.clone(), p.outbox.clone(), last_gen.clone());
        apps.push(tokio::spawn(async move {
            storm_app(app, outbox, part, APPS, STORM, last_gen).await
        }));
    }
    let mut stats = AppStats::default();
    for a in apps {
        let s = a.await??;
        stats.add(&s);
    }
    app.close().await;
    drain(ctx, &p.outbox).await;
    let wall = started.elapsed();
    stop_worker(w, pool).await;
    let last = last_gen.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let mut o = tally(ctx, name, &p, &ledger.snapshot(), &last, wall).await?;
    let errors: Vec<String> = stats
        .errors
        .iter()
        .map(|(code, n)| format!("{code} ×{n}"))
        .collect();
    o.notes.insert(
        0,
        format!(
            "{APPS} application tasks for {} s: {} transactions committed, {} extends ({} rearms queued on running timers), {} 40P01{}; worker concurrency 16, ack_batch_size 8, lease_ttl 1 s",
            STORM.as_secs(),
            stats.committed,
            stats.extends,
            stats.rearms,
            stats.deadlocks,
            if errors.is_empty() {
                String::new()
            } else {
                format!(", other errors: {}", errors.join(", "))
            }
        ),
    );
    o.checks.push((
        "no 40P01 in application transactions".to_owned(),
        stats.deadlocks == 0,
    ));
    o.checks.push((
        "every application transaction committed".to_owned(),
        stats.errors.is_empty() && stats.deadlocks == 0,
    ));
    Ok(o)
}

#[derive(Default)]
struct AppStats {
    committed: u64,
    extends: u64,
    rearms: u64,
    deadlocks: u64,
    errors: BTreeMap<String, u64>,
}

impl AppStats {
    fn add(&mut self, o: &AppStats) {
        self.committed += o.committed;
        self.extends += o.extends;
        self.rearms += o.rearms;
        self.deadlocks += o.deadlocks;
        for (k, v) in &o.errors {
            *self.errors.entry(k.clone()).or_default() += v;
        }
    }

    fn failed(&mut self, sqlstate: Option<String>, text: String) {
        match sqlstate.as_deref() {
            Some("40P01") => self.deadlocks += 1,
            Some(code) => *self.errors.entry(code.to_owned()).or_default() += 1,
            None => *self.errors.entry(text).or_default() += 1,
        }
    }
}

/// One application task of `deadlock-storm`: owns the timers whose number is `part`
/// modulo `parts` (so two tasks never extend the same timer and cannot deadlock with each
/// other), and until `storm` has passed, extends a random subset of those that are leased,
/// in random order, 25 ms apart, in one transaction.
async fn storm_app(
    app: PgPool,
    outbox: Outbox,
    part: usize,
    parts: usize,
    storm: Duration,
    last_gen: Arc<Mutex<HashMap<String, u32>>>,
) -> Result<AppStats, BoxError> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(0x5eed + part as u64);
    let mut stats = AppStats::default();
    let mut next_gen: HashMap<String, u32> = HashMap::new();
    let select = format!(
        "SELECT timer_id FROM {} WHERE queue = $1 AND acquired_token IS NOT NULL AND timer_id IS NOT NULL",
        outbox.table()
    );
    let end = Instant::now() + storm;
    while Instant::now() < end {
        let leased: Vec<String> = sqlx::query_scalar(AssertSqlSafe(select.clone()))
            .bind(TIMER_QUEUE)
            .fetch_all(&app)
            .await?;
        let mut mine: Vec<String> = leased
            .into_iter()
            .filter(|k| key_index(k) % parts == part)
            .collect();
        if mine.is_empty() {
            tokio::time::sleep(Duration::from_millis(20)).await;
            continue;
        }
        mine.shuffle(&mut rng);
        let take = rng.random_range(1..=mine.len().min(8));
        mine.truncate(take);
        let mut conn = app.acquire().await?;
        let mut tx = conn.begin().await?;
        let mut installed = Vec::new();
        let mut failed = false;
        for k in &mine {
            let gen = next_gen.entry(k.clone()).or_insert(1);
            let timer = FaultTimer {
                key: k.clone(),
                gen: *gen,
            };
            *gen += 1;
            match extend_fault_timer(outbox.on(&mut tx), k, &timer, Duration::from_millis(300))
                .await
            {
                Ok(done) => {
                    stats.extends += 1;
                    match done {
                        Published::RearmQueued { .. } => {
                            stats.rearms += 1;
                            installed.push((k.clone(), timer.gen));
                        }
                        Published::Inserted { .. } | Published::Extended { .. } => {
                            installed.push((k.clone(), timer.gen));
                        }
                        _ => {}
                    }
                }
                Err(e) => {
                    stats.failed(e.sqlstate(), e.to_string());
                    failed = true;
                    break;
                }
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        if failed {
            let _ = tx.rollback().await;
            continue;
        }
        match tx.commit().await {
            Ok(()) => {
                stats.committed += 1;
                let mut last = last_gen.lock().unwrap_or_else(|p| p.into_inner());
                for (k, g) in installed {
                    last.insert(k, g);
                }
            }
            Err(e) => {
                let code = e
                    .as_database_error()
                    .and_then(|d| d.code())
                    .map(|c| c.into_owned());
                stats.failed(code, e.to_string());
            }
        }
    }
    Ok(stats)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(v: &[&str]) -> Vec<String> {
        v.iter().map(|k| (*k).to_owned()).collect()
    }

    fn runs(v: &[(&str, u32, u32)]) -> HashMap<(String, u32), u32> {
        v.iter().map(|&(k, g, n)| ((k.to_owned(), g), n)).collect()
    }

    fn set(v: &[(&str, u32)]) -> HashSet<(String, u32)> {
        v.iter().map(|&(k, g)| (k.to_owned(), g)).collect()
    }

    #[test]
    fn every_key_handled_once() {
        let a = account(
            &keys(&["m0", "m1", "t0"]),
            &HashMap::new(),
            &runs(&[("m0", 0, 1), ("m1", 0, 1), ("t0", 0, 1)]),
            &HashSet::new(),
            &HashSet::new(),
        );
        assert_eq!(
            a,
            Accounting {
                handled: 3,
                lost_keys: vec![],
                redelivered: 0
            }
        );
    }

    #[test]
    fn duplicates_are_redeliveries_not_extra_rows() {
        let a = account(
            &keys(&["m0", "m1"]),
            &HashMap::new(),
            &runs(&[("m0", 0, 3), ("m1", 0, 1)]),
            &HashSet::new(),
            &HashSet::new(),
        );
        assert_eq!((a.handled, a.redelivered), (2, 2));
    }

    #[test]
    fn a_key_neither_run_nor_stored_is_lost_and_one_in_the_queue_or_dlq_is_not() {
        let a = account(
            &keys(&["m0", "m1", "m2", "m3"]),
            &HashMap::new(),
            &runs(&[("m0", 0, 1)]),
            &set(&[("m1", 0)]),
            &set(&[("m2", 0)]),
        );
        assert_eq!(a.handled, 1);
        assert_eq!(a.lost_keys, vec!["m3@0".to_owned()]);
    }

    #[test]
    fn only_the_last_committed_version_of_a_timer_counts() {
        let last: HashMap<String, u32> = [("t0".to_owned(), 2), ("t1".to_owned(), 2)].into();
        let a = account(
            &keys(&["t0", "t1", "t2"]),
            &last,
            // t0 ran versions 0, 1 and 2; t1 ran 0 and 1 but not its last extend (2), which
            // is nowhere else either; t2 was never extended.
            &runs(&[
                ("t0", 0, 1),
                ("t0", 1, 1),
                ("t0", 2, 1),
                ("t1", 0, 1),
                ("t1", 1, 1),
                ("t2", 0, 1),
            ]),
            &set(&[("t1", 1)]),
            &HashSet::new(),
        );
        assert_eq!(a.handled, 2);
        assert_eq!(a.lost_keys, vec!["t1@2".to_owned()]);
        assert_eq!(
            a.redelivered, 0,
            "runs of different versions are not duplicates"
        );
    }

    #[test]
    fn stored_payloads_map_to_their_key_and_version() {
        assert_eq!(key_of(QUEUE, None, b"m17"), ("m17".to_owned(), 0));
        let t = serde_json::to_vec(&FaultTimer {
            key: "t3".to_owned(),
            gen: 4,
        })
        .unwrap();
        assert_eq!(key_of(TIMER_QUEUE, Some("t3"), &t), ("t3".to_owned(), 4));
        assert_eq!(
            key_of(TIMER_QUEUE, Some("t3"), b"not json"),
            ("t3".to_owned(), 0)
        );
    }

    #[test]
    fn a_run_started_while_the_same_row_runs_is_an_overlap() {
        let ledger = Arc::new(Ledger::default());
        let first = ledger.start("m0", 0);
        let other_row = ledger.start("m1", 0);
        let other_version = ledger.start("m0", 1);
        assert_eq!(
            ledger.overlaps(),
            0,
            "other rows and versions do not overlap"
        );
        let second = ledger.start("m0", 0);
        assert_eq!(ledger.overlaps(), 1);
        drop((first, second, other_row, other_version));
        let _again = ledger.start("m0", 0);
        assert_eq!(
            ledger.overlaps(),
            1,
            "a run after the others ended is no overlap"
        );
    }

    #[test]
    fn selected_scenarios_keep_their_order_and_unknown_names_fail() {
        let known = &["a", "b", "c"];
        assert_eq!(select(&[], known).unwrap(), vec!["a", "b", "c"]);
        assert_eq!(select(&keys(&["c", "a"]), known).unwrap(), vec!["c", "a"]);
        let e = select(&keys(&["citus-node-down"]), known).unwrap_err();
        assert!(e.contains("unknown fault `citus-node-down`"), "{e}");
    }

    #[test]
    fn spread_keys_stay_in_range() {
        assert_eq!(pick("m", 10, 3), keys(&["m0", "m3", "m6"]));
        assert_eq!(pick("t", 0, 2), Vec::<String>::new());
        assert_eq!(pick("t", 2, 5), keys(&["t0", "t1"]));
    }
}
