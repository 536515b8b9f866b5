//! The soak (SPEC §12 v2): a presence-like load held for minutes, to see whether
//! throughput, firing lateness, table and index size and dead tuples stay flat, and what
//! autovacuum does about the dead versions every extend leaves.
//!
//! The model: `timers` users, each with a keyed timer ("offline after a missed
//! heartbeat"). The driver sends heartbeats round-robin at `rate` extends/s, so each
//! user's timer is extended every `timers / rate` seconds to `now + period + grace`; a
//! `expire_share` of heartbeats is skipped (the user went away), so that timer fires
//! `grace` seconds later in a real [`Worker`], and the next heartbeat for it publishes it
//! again (the user came back). Each handler runs for `handler_ms`, and for a
//! `rearm_share` of the runs the driver extends the timer while its handler runs (the user
//! came back just as the expiry fired): those extends queue rearms (SPEC §5).
//!
//! The table is created by `Outbox::migrate` with no storage parameter of the harness's, so
//! the soak runs with whatever autovacuum settings the library's migrations give the table
//! (they are printed at the start), on a throwaway cluster with autovacuum on (the main
//! server of this machine runs with it off; `--autovacuum off` shows that failure mode).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use chrono::Utc;
use clap::Args;
use outbox::{Context, Outbox, PgStore, Published, Worker};
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};
use sqlx::postgres::PgPool;
use sqlx::AssertSqlSafe;
use tokio::sync::mpsc;

use crate::scale::{self, percentile, SQL_BODY, SQL_HEADERS};
use outbox_bench::payload::{extend_body, Body};
use outbox_bench::probe::tagged;
use outbox_bench::scenarios::Env;
use outbox_bench::BoxError;

#[derive(Args, Debug, Clone)]
pub struct SoakArgs {
    /// Runs the soak for this many minutes instead of the scenarios (a throwaway cluster
    /// with autovacuum on, unless --autovacuum off).
    #[arg(long, value_name = "MINUTES")]
    pub soak: Option<f64>,
    /// Live timers (users) at the start.
    #[arg(long, default_value_t = 100_000)]
    pub soak_timers: u64,
    /// Heartbeats (extends) per second the driver aims for; what it reaches is reported.
    #[arg(long, default_value_t = 800)]
    pub soak_rate: u64,
    /// Seconds after a missed heartbeat until the timer fires.
    #[arg(long, default_value_t = 20)]
    pub soak_grace: u64,
    /// Share of heartbeats skipped (each one makes a timer fire).
    #[arg(long, default_value_t = 0.05)]
    pub soak_expire_share: f64,
    /// Share of firing timers extended while their handler runs (each one queues a rearm).
    #[arg(long, default_value_t = 0.2)]
    pub soak_rearm_share: f64,
    /// How long each handler runs, in milliseconds.
    #[arg(long, default_value_t = 20)]
    pub soak_handler_ms: u64,
    /// Connections sending heartbeats (the rate is shared among them).
    #[arg(long, default_value_t = 4)]
    pub soak_connections: u32,
    /// `autovacuum` of the throwaway cluster for the soak (the main server's is copied
    /// otherwise). `off` shows what happens without it.
    #[arg(long, default_value = "on", value_parser = ["on", "off"])]
    pub autovacuum: String,
}

/// Seconds between samples.
const SAMPLE_EVERY: Duration = Duration::from_secs(10);
/// The worker's handlers: enough that runs of `handler_ms` never queue at the fire rates
/// the defaults give.
const CONCURRENCY: usize = 8;

/// One sample (a JSON line with `"kind": "soak"`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Sample {
    pub kind: String,
    pub t_s: f64,
    pub extends_per_s: f64,
    pub fires_per_s: f64,
    pub lateness_p99_ms: f64,
    pub table_bytes: i64,
    pub index_bytes: i64,
    pub dead_tuples: i64,
    pub live_tuples: i64,
    pub autovacuum_count: i64,
    pub autoanalyze_count: i64,
}

/// What the soak started with (a JSON line with `"kind": "soak_start"`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Start {
    pub kind: String,
    pub table: String,
    /// `pg_class.reloptions` of the queue table after `migrate`.
    pub reloptions: Vec<String>,
    /// The server's `autovacuum` and the autovacuum settings that decide when it runs.
    pub server: Vec<(String, String)>,
    pub timers: u64,
    pub rate: u64,
    pub heartbeat_period_s: f64,
    pub grace_s: u64,
    pub expire_share: f64,
    pub rearm_share: f64,
    pub handler_ms: u64,
}

/// Counters shared by the driver, the handlers and the sampler.
#[derive(Default)]
struct Counts {
    extends: AtomicU64,
    fires: AtomicU64,
    inserted: AtomicU64,
    extended: AtomicU64,
    rearms: AtomicU64,
    other: AtomicU64,
    lateness_ms: Mutex<Vec<f64>>,
}

impl Counts {
    fn outcome(&self, out: &Published) {
        let c = match out {
            Published::Inserted { .. } => &self.inserted,
            Published::Extended { .. } => &self.extended,
            Published::RearmQueued { .. } => &self.rearms,
            _ => &self.other,
        };
        c.fetch_add(1, Ordering::Relaxed);
        self.extends.fetch_add(1, Ordering::Relaxed);
    }
}

/// The heartbeat deadline: `period + grace` from now, in whole milliseconds.
fn ttl(period: f64, grace: u64) -> Duration {
    Duration::from_millis(((period + grace as f64) * 1000.0) as u64)
}

async fn heartbeat(
    app: &PgPool,
    outbox: &Outbox,
    timer: u64,
    deadline: Duration,
    counts: &Counts,
) -> Result<(), BoxError> {
    let mut tx = app.begin().await?;
    let out = extend_body(
        outbox.on(&mut tx),
        &format!("p{timer}"),
        &Body(format!("{timer}:online")),
        deadline,
    )
    .await?;
    tx.commit().await?;
    counts.outcome(&out);
    Ok(())
}

/// Runs the soak for `minutes`; returns what it started with and its samples.
pub async fn run(
    env: &mut Env,
    args: &SoakArgs,
    minutes: f64,
) -> Result<(Start, Vec<Sample>), BoxError> {
    let mut samples = Vec::new();
    let timers = args.soak_timers.max(1);
    let rate = args.soak_rate.max(1);
    let period = timers as f64 / rate as f64;
    let deadline = ttl(period, args.soak_grace);

    let outbox = Outbox::builder().table("bench_soak").build()?;
    scale::drop_tables(env, &outbox).await?;
    let setup = scale::pool(env, 1, true).await?;
    outbox.migrate(&setup).await?;
    setup.close().await;
    let t = outbox.table().to_owned();
    // Timer i is first heard from at start + i / rate; its seeded deadline gives it the
    // same grace a heartbeat would, so the first round behaves like every later one.
    scale::insert_series(
        env,
        &t,
        0,
        timers,
        "queue, payload, headers, next_attempt_at, timer_id",
        &format!(
            "'bench', {SQL_BODY}, {SQL_HEADERS}, \
             now() + interval '{} seconds' + i * interval '{} microseconds', 'p' || i",
            args.soak_grace + 5,
            1_000_000 / rate
        ),
    )
    .await?;
    scale::exec(env, &format!("ANALYZE {t}")).await?;

    let reloptions: Option<Vec<String>> = sqlx::query_scalar(AssertSqlSafe(tagged(&format!(
        "SELECT reloptions FROM pg_class WHERE oid = '{}'::regclass",
        t.replace('\'', "''")
    ))))
    .fetch_one(&mut env.probe)
    .await?;
    let server: Vec<(String, String)> = sqlx::query_as(AssertSqlSafe(tagged(
        "SELECT name, setting FROM pg_settings WHERE name IN ('autovacuum', \
         'autovacuum_naptime', 'autovacuum_vacuum_scale_factor', 'autovacuum_vacuum_threshold', \
         'autovacuum_vacuum_cost_limit', 'autovacuum_vacuum_cost_delay', \
         'autovacuum_analyze_scale_factor') ORDER BY name",
    )))
    .fetch_all(&mut env.probe)
    .await?;
    let start = Start {
        kind: "soak_start".to_owned(),
        table: t.clone(),
        reloptions: reloptions.unwrap_or_default(),
        server,
        timers,
        rate,
        heartbeat_period_s: period,
        grace_s: args.soak_grace,
        expire_share: args.soak_expire_share,
        rearm_share: args.soak_rearm_share,
        handler_ms: args.soak_handler_ms,
    };
    println!(
        "soak: {timers} timers, {rate} heartbeats/s (each timer every {period:.0} s, deadline \
         now + {:.0} s), {:.0} % of heartbeats skipped (fire {} s later), {:.0} % of runs \
         extended while running (rearm), handlers {} ms, {minutes} min",
        deadline.as_secs_f64(),
        args.soak_expire_share * 100.0,
        args.soak_grace,
        args.soak_rearm_share * 100.0,
        args.soak_handler_ms
    );
    println!(
        "soak: table {t} reloptions {:?}; server {}",
        start.reloptions,
        start
            .server
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(" ")
    );

    let counts = Arc::new(Counts::default());
    let stop = Arc::new(AtomicBool::new(false));
    let wpool = scale::pool(env, CONCURRENCY as u32 + 3, env.worker_ping).await?;
    let app = scale::pool(env, args.soak_connections + 1, env.app_ping).await?;

    // Runs that the driver extends while they run: the handler offers its timer and keeps
    // running for `handler_ms`, so the extend lands on a leased row.
    let (offer, mut offered) = mpsc::channel::<u64>(1024);
    let (handler_counts, handler_ms, rearm_share) = (
        counts.clone(),
        Duration::from_millis(args.soak_handler_ms),
        args.soak_rearm_share,
    );
    let worker = Worker::builder(PgStore::new(wpool.clone(), outbox.clone()))
        .timer::<Body>(move |_b: Body, ctx: Context| {
            let (counts, offer) = (handler_counts.clone(), offer.clone());
            async move {
                let late = (Utc::now() - ctx.deadline())
                    .num_microseconds()
                    .unwrap_or(0) as f64
                    / 1000.0;
                counts
                    .lateness_ms
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push(late);
                let timer = ctx
                    .timer_id()
                    .and_then(|id| id.strip_prefix('p'))
                    .and_then(|n| n.parse::<u64>().ok());
                if let Some(timer) = timer {
                    if rand::random::<f64>() < rearm_share {
                        let _ = offer.try_send(timer);
                    }
                }
                tokio::time::sleep(handler_ms).await;
                counts.fires.fetch_add(1, Ordering::Relaxed);
            }
        })
        .concurrency(CONCURRENCY)
        .build()?;
    let running = worker.start();
    let t0 = Instant::now();

    let mut tasks = Vec::new();
    let conns = args.soak_connections.max(1) as u64;
    for k in 0..conns {
        let (app, outbox, counts, stop) =
            (app.clone(), outbox.clone(), counts.clone(), stop.clone());
        let skip = args.soak_expire_share;
        tasks.push(tokio::spawn(async move {
            let mut rng = rand::rngs::StdRng::seed_from_u64(100 + k);
            // Heartbeat j (j ≡ k mod conns) goes to timer j mod timers at t0 + j / rate;
            // a driver that falls behind sends as fast as it can until it has caught up.
            let mut j = k;
            while !stop.load(Ordering::Relaxed) {
                let at = t0 + Duration::from_secs_f64(j as f64 / rate as f64);
                tokio::time::sleep_until(at.into()).await;
                if rng.random::<f64>() >= skip {
                    heartbeat(&app, &outbox, j % timers, deadline, &counts).await?;
                }
                j += conns;
            }
            Ok::<(), BoxError>(())
        }));
    }
    {
        let (app, outbox, counts, stop) =
            (app.clone(), outbox.clone(), counts.clone(), stop.clone());
        tasks.push(tokio::spawn(async move {
            while let Some(timer) = offered.recv().await {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                heartbeat(&app, &outbox, timer, deadline, &counts).await?;
            }
            Ok(())
        }));
    }

    println!(
        "\n| t s | extends/s | fires/s | lateness p99 ms | table MB | indexes MB | dead | live | autovacuums | autoanalyzes |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    let end = t0 + Duration::from_secs_f64(minutes * 60.0);
    let mut last = (t0, 0u64, 0u64);
    let mut tick = t0;
    let result: Result<(), BoxError> = async {
        while tick + SAMPLE_EVERY <= end {
            tick += SAMPLE_EVERY;
            tokio::time::sleep_until(tick.into()).await;
            for task in &tasks {
                if task.is_finished() {
                    return Err("a soak driver stopped early".into());
                }
            }
            let now = Instant::now();
            let (ext, fires) = (
                counts.extends.load(Ordering::Relaxed),
                counts.fires.load(Ordering::Relaxed),
            );
            let secs = (now - last.0).as_secs_f64();
            let mut late =
                std::mem::take(&mut *counts.lateness_ms.lock().unwrap_or_else(|p| p.into_inner()));
            late.sort_by(f64::total_cmp);
            let stats = table_stats(env, &t).await?;
            let s = Sample {
                kind: "soak".to_owned(),
                t_s: (now - t0).as_secs_f64().round(),
                extends_per_s: (ext - last.1) as f64 / secs,
                fires_per_s: (fires - last.2) as f64 / secs,
                lateness_p99_ms: percentile(&late, 0.99),
                table_bytes: stats[0],
                index_bytes: stats[1],
                dead_tuples: stats[2],
                live_tuples: stats[3],
                autovacuum_count: stats[4],
                autoanalyze_count: stats[5],
            };
            println!(
                "| {:.0} | {:.0} | {:.1} | {:.1} | {:.1} | {:.1} | {} | {} | {} | {} |",
                s.t_s,
                s.extends_per_s,
                s.fires_per_s,
                s.lateness_p99_ms,
                s.table_bytes as f64 / 1e6,
                s.index_bytes as f64 / 1e6,
                s.dead_tuples,
                s.live_tuples,
                s.autovacuum_count,
                s.autoanalyze_count
            );
            samples.push(s);
            last = (now, ext, fires);
        }
        Ok(())
    }
    .await;

    stop.store(true, Ordering::Relaxed);
    let report = running.shutdown().await;
    for task in tasks {
        task.abort();
        if let Ok(Err(e)) = task.await {
            eprintln!("soak driver: {e}");
        }
    }
    result?;
    println!(
        "\nsoak: {} extends ({} extended, {} inserted again after firing, {} rearms queued on \
         running handlers, {} other), {} runs; worker shutdown graceful: {}",
        counts.extends.load(Ordering::Relaxed),
        counts.extended.load(Ordering::Relaxed),
        counts.inserted.load(Ordering::Relaxed),
        counts.rearms.load(Ordering::Relaxed),
        counts.other.load(Ordering::Relaxed),
        counts.fires.load(Ordering::Relaxed),
        report.graceful
    );
    wpool.close().await;
    app.close().await;
    if !env.keep_tables {
        scale::drop_tables(env, &outbox).await?;
    }
    Ok((start, samples))
}

/// Size, tuples and autovacuum counts of `table` (statistics flushed by the backends at
/// least once a second while they are busy, so they lag by up to that).
async fn table_stats(env: &mut Env, table: &str) -> Result<[i64; 6], BoxError> {
    let t = table.replace('\'', "''");
    let r: (i64, i64, i64, i64, i64, i64) = sqlx::query_as(AssertSqlSafe(tagged(&format!(
        "SELECT pg_table_size('{t}'), pg_indexes_size('{t}'), n_dead_tup, n_live_tup, \
         autovacuum_count, autoanalyze_count FROM pg_stat_user_tables \
         WHERE relid = '{t}'::regclass"
    ))))
    .fetch_one(&mut env.probe)
    .await?;
    Ok([r.0, r.1, r.2, r.3, r.4, r.5])
}
