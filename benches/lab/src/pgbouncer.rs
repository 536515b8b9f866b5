//! `outbox-lab pgbouncer`: what `OutboxBuilder::transaction_pooler(true)` costs (issue 26,
//! requirement 2). Three set-ups on the same server and tables:
//!
//! - `direct`: the default outbox on a direct pool (named statements, cached per
//!   connection);
//! - `direct, knob`: `transaction_pooler(true)` on the same direct pool (every statement
//!   unnamed, and a statement that would commit on its own wrapped in `BEGIN`/`COMMIT`):
//!   the knob's own cost;
//! - `pgbouncer, knob`: `transaction_pooler(true)` through a PgBouncer in transaction mode
//!   started with the deployment guide's settings (`outbox_bench::pgbouncer`): the knob
//!   plus the pooler's hop.
//!
//! Each set-up measures, `--repeat` times (the median is printed): **publish**, `--publishers`
//! tasks each publishing its share of `--publish-rows` in application transactions of one
//! message (`BEGIN`, publish, `COMMIT`); and **worker**, a poll-only worker (`listen(false)`,
//! `--concurrency` handler slots, no-op handler) draining `--worker-rows` due rows
//! published beforehand over the direct pool. The set-ups take turns in each repetition,
//! after a warm-up round that is not counted. Prints the machine, the versions and a
//! Markdown table for the lab notes. Never gated.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Args;
use outbox::message::{BatchItem, Schedule};
use outbox::{Context, Message, Outbox, PgStore, Worker};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{AssertSqlSafe, ConnectOptions, Connection, PgPool};

use outbox_bench::pgbouncer::PgBouncer;
use outbox_bench::BoxError;

const QUEUE: &str = "lab.pgbouncer";

#[derive(Args)]
pub struct PgBouncerArgs {
    /// The server (a database the user may create tables in).
    #[arg(long, default_value = "postgres://postgres@127.0.0.1:5432/test")]
    server: String,
    /// Rows published per repetition, over all publishers.
    #[arg(long, default_value_t = 4000)]
    publish_rows: usize,
    /// Concurrent publishers, each on a connection of its own.
    #[arg(long, default_value_t = 4)]
    publishers: usize,
    /// Rows the worker drains per repetition.
    #[arg(long, default_value_t = 10_000)]
    worker_rows: usize,
    /// The worker's handler slots.
    #[arg(long, default_value_t = 8)]
    concurrency: usize,
    /// Repetitions of each measurement (the median is printed).
    #[arg(long, default_value_t = 3)]
    repeat: usize,
}

#[derive(Clone, Copy)]
enum Setup {
    Direct,
    DirectKnob,
    Pooler,
}

impl Setup {
    fn label(self) -> &'static str {
        match self {
            Setup::Direct => "direct",
            Setup::DirectKnob => "direct, knob",
            Setup::Pooler => "pgbouncer, knob",
        }
    }
}

pub async fn run(a: &PgBouncerArgs) -> Result<ExitCode, BoxError> {
    if a.publish_rows == 0 || a.publishers == 0 || a.worker_rows == 0 || a.repeat == 0 {
        return Err(
            "--publish-rows, --publishers, --worker-rows and --repeat must be at least 1".into(),
        );
    }
    let bouncer = PgBouncer::start(&a.server);
    let direct = pool(&a.server, (a.publishers + a.concurrency + 4) as u32).await?;
    let table = format!("lab_pgb_{}", std::process::id());
    let plain = Outbox::builder().table(&table).build()?;
    plain.migrate(&direct).await?;
    let result = measure(a, &bouncer, &direct, &table).await;
    let drop = format!(
        "DROP TABLE IF EXISTS {}, {}, {}, {}",
        plain.table(),
        plain.dead_letter_table(),
        plain.migrations_table(),
        plain.paused_table()
    );
    sqlx::raw_sql(AssertSqlSafe(drop)).execute(&direct).await?;
    let rows = result?;
    print_report(a, &direct, &rows).await?;
    Ok(ExitCode::SUCCESS)
}

/// `(set-up, publish rows/s, worker rows/s)` of every counted round. The set-ups take turns within each
/// repetition, so a change of the machine's load during the run (it is shared) reaches
/// all three alike; a first round of all three warms the server and is not counted.
async fn measure(
    a: &PgBouncerArgs,
    bouncer: &PgBouncer,
    direct: &PgPool,
    table: &str,
) -> Result<Vec<(Setup, Vec<f64>, Vec<f64>)>, BoxError> {
    let setups = [Setup::Direct, Setup::DirectKnob, Setup::Pooler];
    let mut publish = vec![Vec::new(); setups.len()];
    let mut drain = vec![Vec::new(); setups.len()];
    for round in 0..=a.repeat {
        for (i, &setup) in setups.iter().enumerate() {
            let outbox = Outbox::builder()
                .table(table)
                .transaction_pooler(!matches!(setup, Setup::Direct))
                .build()?;
            let url = match setup {
                Setup::Pooler => bouncer.url().to_owned(),
                _ => a.server.clone(),
            };
            clear(direct, &outbox).await?;
            let pool = pool(&url, a.publishers as u32).await?;
            let p = publish_rate(a, &outbox, &pool).await?;
            pool.close().await;
            clear(direct, &outbox).await?;
            let w = worker_rate(a, &outbox, direct, &url).await?;
            eprintln!(
                "round {round}{}: {}: publish {p:.0} rows/s, worker {w:.0} rows/s",
                if round == 0 { " (warm-up)" } else { "" },
                setup.label(),
            );
            if round > 0 {
                publish[i].push(p);
                drain[i].push(w);
            }
        }
    }
    Ok(setups
        .iter()
        .zip(publish.into_iter().zip(drain))
        .map(|(&s, (p, w))| (s, p, w))
        .collect())
}

async fn pool(url: &str, max: u32) -> Result<PgPool, BoxError> {
    let opts: PgConnectOptions = url.parse()?;
    Ok(PgPoolOptions::new()
        .max_connections(max)
        .test_before_acquire(false)
        .acquire_timeout(Duration::from_secs(30))
        .connect_with(opts.disable_statement_logging())
        .await?)
}

async fn clear(direct: &PgPool, outbox: &Outbox) -> Result<(), BoxError> {
    sqlx::raw_sql(AssertSqlSafe(format!("TRUNCATE {}", outbox.table())))
        .execute(direct)
        .await?;
    Ok(())
}

/// Rows per second of `--publishers` tasks publishing one message per transaction.
async fn publish_rate(a: &PgBouncerArgs, outbox: &Outbox, pool: &PgPool) -> Result<f64, BoxError> {
    let per = a.publish_rows.div_ceil(a.publishers);
    let started = Instant::now();
    let tasks = (0..a.publishers).map(|_| {
        let (outbox, pool) = (outbox.clone(), pool.clone());
        tokio::spawn(async move {
            let mut conn = pool.acquire().await?;
            for _ in 0..per {
                let mut tx = conn.begin().await?;
                outbox
                    .publish(&mut tx, Message::new(QUEUE, b"payload"))
                    .await?;
                tx.commit().await?;
            }
            Ok::<_, BoxError>(())
        })
    });
    for t in futures_join(tasks).await {
        t??;
    }
    Ok((per * a.publishers) as f64 / started.elapsed().as_secs_f64())
}

async fn futures_join<T>(
    tasks: impl Iterator<Item = tokio::task::JoinHandle<T>>,
) -> Vec<Result<T, tokio::task::JoinError>> {
    let mut out = Vec::new();
    for t in tasks.collect::<Vec<_>>() {
        out.push(t.await);
    }
    out
}

/// Rows per second of a poll-only worker draining `--worker-rows` due rows.
async fn worker_rate(
    a: &PgBouncerArgs,
    outbox: &Outbox,
    direct: &PgPool,
    url: &str,
) -> Result<f64, BoxError> {
    // Published over the direct pool with the default outbox: the same rows for every set-up.
    let plain = Outbox::builder()
        .table(outbox.table().trim_matches('"'))
        .build()?;
    let mut conn = direct.acquire().await?;
    let items: Vec<BatchItem<'_>> = (0..1000).map(|_| BatchItem::new(b"payload")).collect();
    let mut left = a.worker_rows;
    while left > 0 {
        let n = left.min(items.len());
        plain
            .publish_batch(&mut conn, QUEUE, &items[..n], Schedule::now())
            .await?;
        left -= n;
    }
    drop(conn);
    let pool = pool(url, (a.concurrency + 3) as u32).await?;
    let store = PgStore::new(pool.clone(), outbox.clone());
    let started = Instant::now();
    let worker = Worker::builder(store)
        .listen(false)
        .idle_poll(Duration::from_millis(100))
        .concurrency(a.concurrency)
        .queue(QUEUE, |_: Vec<u8>, _ctx: Context| async {})
        .build()?
        .start();
    let count = format!("SELECT count(*) FROM {}", outbox.table());
    loop {
        let n: i64 = sqlx::query_scalar(AssertSqlSafe(count.clone()))
            .fetch_one(direct)
            .await?;
        if n == 0 {
            break;
        }
        if started.elapsed() > Duration::from_secs(600) {
            return Err(format!("the worker left {n} rows after 10 minutes").into());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let elapsed = started.elapsed();
    worker.shutdown().await;
    pool.close().await;
    Ok(a.worker_rows as f64 / elapsed.as_secs_f64())
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The median over rounds of `of[k] / base[k]`: each round's set-ups ran back to back, so
/// the ratio within a round is steadier than the ratio of medians on a shared machine.
fn ratio(of: &[f64], base: &[f64]) -> f64 {
    let r: Vec<f64> = of.iter().zip(base).map(|(a, b)| a / b).collect();
    median(&r)
}

async fn print_report(
    a: &PgBouncerArgs,
    direct: &PgPool,
    rows: &[(Setup, Vec<f64>, Vec<f64>)],
) -> Result<(), BoxError> {
    let version: String = sqlx::query_scalar("SELECT version()")
        .fetch_one(direct)
        .await?;
    let bouncer = std::process::Command::new("pgbouncer")
        .arg("--version")
        .output()
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .next()
                .unwrap_or("")
                .to_owned()
        })
        .unwrap_or_default();
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    println!(
        "machine: {cores} cores; {version}; {bouncer}; {}",
        chrono::Utc::now().format("%Y-%m-%d %H:%M UTC")
    );
    println!(
        "publish: {} rows by {} publishers, one per transaction; worker: {} due rows, \
         concurrency {}, listen(false); median of {}",
        a.publish_rows, a.publishers, a.worker_rows, a.concurrency, a.repeat
    );
    println!();
    println!(
        "| set-up | publish rows/s (median) | publish vs direct (median of rounds) \
         | worker rows/s (median) | worker vs direct (median of rounds) |"
    );
    println!("|---|---:|---:|---:|---:|");
    let (p0, w0) = (&rows[0].1, &rows[0].2);
    for (setup, p, w) in rows {
        println!(
            "| {} | {:.0} | {:+.0} % | {:.0} | {:+.0} % |",
            setup.label(),
            median(p),
            (ratio(p, p0) - 1.0) * 100.0,
            median(w),
            (ratio(w, w0) - 1.0) * 100.0
        );
    }
    Ok(())
}
