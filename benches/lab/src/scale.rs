//! Growth curves (SPEC §12 v2): how the claim, a consumer, an extend, `next_wakeup` and
//! publishing behave as the table, the number of queues or the number of publishing
//! connections grows.
//!
//! Backlogs are built with `INSERT … SELECT generate_series` straight into the scenario
//! table (a million rows through `publish_batch` would take minutes and measure nothing we
//! want here), then `VACUUM ANALYZE`d so every step starts from the same state: visibility
//! map set, statistics current, no dead index entries left by the previous step. What is
//! timed is always the product: [`PgStore`]'s claim and `next_wakeup` (the statements the
//! worker sends), a real [`Worker`], the `#[timer]`-generated `extend_body`, and
//! [`Outbox::publish`]. Not part of `check`: these runs take minutes and are noisy.

use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Args;
use outbox::{
    store::{ClaimRequest, Store},
    Context, Message, Outbox, PgStore, Published, Worker,
};
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};
use sqlx::postgres::{PgPool, PgPoolOptions};
use sqlx::AssertSqlSafe;

use outbox_bench::payload::{extend_body, Body};
use outbox_bench::probe::{tagged, WORK_APP};
use outbox_bench::recorder;
use outbox_bench::scenarios::Env;
use outbox_bench::BoxError;

#[derive(Args, Debug, Clone)]
pub struct ScaleArgs {
    /// Runs the growth curves (claim, consumer, extend, next_wakeup, publish) instead of
    /// the scenarios. Takes a while: 10^7 rows are several GB.
    #[arg(long)]
    pub scale: bool,
    /// Largest backlog (rows) of the claim and consumer curves, and largest number of live
    /// timers of the extend curve (capped at 10^6 there). 10^6 for a quick run.
    #[arg(long, default_value_t = 10_000_000, value_name = "ROWS")]
    pub scale_max: u64,
    /// Which curves to run, comma-separated: claim (claim latency and consumer msg/s),
    /// extend, wakeup, publish. Default: all.
    #[arg(long, value_delimiter = ',', value_name = "CURVES")]
    pub curves: Vec<String>,
}

/// The curves in run order.
const CURVES: &[&str] = &["claim", "extend", "wakeup", "publish"];

/// Claims timed per backlog step (limit 10 each, acked in between, untimed).
const CLAIMS: usize = 500;
/// The worker's default batch: what a claim asks for.
const CLAIM_LIMIT: usize = 10;
/// Messages the consumer handles per backlog step.
const CONSUMED: u64 = 5000;
/// Extends timed per live-timer step.
const EXTENDS: u64 = 2000;
/// `next_wakeup` calls timed per queue-count step.
const WAKEUPS: usize = 300;
/// Pending rows per queue of the `next_wakeup` curve.
const ROWS_PER_QUEUE: u64 = 100;
/// How long each publish step runs.
const PUBLISH_WINDOW: Duration = Duration::from_secs(3);
/// Rows inserted per transaction while building a backlog (progress is printed per chunk).
const CHUNK: u64 = 1_000_000;

/// One measured step of one curve (one JSON line with `"kind": "scale"`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Point {
    pub kind: String,
    /// `claim`, `consumer`, `extend`, `next_wakeup`, `publish`.
    pub curve: String,
    /// What was measured, e.g. `notify` or `no-notify` for publishes.
    pub series: String,
    /// Backlog rows, live timers, queues or connections.
    pub x: u64,
    /// Operations timed.
    pub ops: u64,
    pub seconds: f64,
    /// Operations (claims, messages, extends, calls, publishes) per second.
    pub per_s: f64,
    /// Latency of one operation, when each is timed on its own.
    pub p50_ms: Option<f64>,
    pub p99_ms: Option<f64>,
    /// Size of the table and its indexes when the step started.
    pub table_bytes: i64,
    pub index_bytes: i64,
}

impl Point {
    fn new(curve: &str, series: &str, x: u64, ops: u64, wall: Duration, sizes: (i64, i64)) -> Self {
        let seconds = wall.as_secs_f64();
        Point {
            kind: "scale".to_owned(),
            curve: curve.to_owned(),
            series: series.to_owned(),
            x,
            ops,
            seconds,
            per_s: ops as f64 / seconds,
            p50_ms: None,
            p99_ms: None,
            table_bytes: sizes.0,
            index_bytes: sizes.1,
        }
    }

    fn latencies(mut self, mut ms: Vec<f64>) -> Self {
        ms.sort_by(f64::total_cmp);
        self.p50_ms = Some(percentile(&ms, 0.50));
        self.p99_ms = Some(percentile(&ms, 0.99));
        self
    }

    fn describe(&self) -> String {
        let lat = match (self.p50_ms, self.p99_ms) {
            (Some(a), Some(b)) => format!(", p50 {a:.3} ms, p99 {b:.3} ms"),
            _ => String::new(),
        };
        format!(
            "{} [{}] x={}: {:.0}/s ({} in {:.2} s){lat}; table {} MB, indexes {} MB",
            self.curve,
            self.series,
            self.x,
            self.per_s,
            self.ops,
            self.seconds,
            self.table_bytes / 1_000_000,
            self.index_bytes / 1_000_000
        )
    }
}

/// Nearest-rank percentile of sorted values.
pub fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// Powers of ten from 10^4 up to `max`.
fn steps(max: u64) -> Vec<u64> {
    let mut out = Vec::new();
    let mut n = 10_000;
    while n <= max {
        out.push(n);
        n *= 10;
    }
    out
}

/// A pool of `max` connections for the product (tagged as the scenarios' work), opened
/// before anything is timed. `ping` is sqlx's `test_before_acquire`.
pub async fn pool(env: &Env, max: u32, ping: bool) -> Result<PgPool, BoxError> {
    let pool = PgPoolOptions::new()
        .max_connections(max)
        .test_before_acquire(ping)
        .acquire_timeout(Duration::from_secs(60))
        .connect_lazy_with(env.opts.clone().application_name(WORK_APP));
    let mut held = Vec::new();
    for _ in 0..max {
        held.push(pool.acquire().await?);
    }
    drop(held);
    Ok(pool)
}

/// Runs the harness's own statement on the probe connection.
pub async fn exec(env: &mut Env, sql: &str) -> Result<(), BoxError> {
    sqlx::raw_sql(AssertSqlSafe(tagged(sql)))
        .execute(&mut env.probe)
        .await?;
    Ok(())
}

async fn scalar(env: &mut Env, sql: &str) -> Result<i64, BoxError> {
    Ok(sqlx::query_scalar(AssertSqlSafe(tagged(sql)))
        .fetch_one(&mut env.probe)
        .await?)
}

/// `pg_table_size` and `pg_indexes_size` of `table` (a quoted name).
pub async fn sizes(env: &mut Env, table: &str) -> Result<(i64, i64), BoxError> {
    let t = table.replace('\'', "''");
    Ok((
        scalar(env, &format!("SELECT pg_table_size('{t}')")).await?,
        scalar(env, &format!("SELECT pg_indexes_size('{t}')")).await?,
    ))
}

/// A fresh outbox table named `name`, created by the library's migrations, with autovacuum
/// off so that each step's state is the one the harness's `VACUUM ANALYZE` left.
async fn fresh(env: &mut Env, name: &str) -> Result<Outbox, BoxError> {
    let outbox = Outbox::builder().table(name).build()?;
    drop_tables(env, &outbox).await?;
    let setup = pool(env, 1, true).await?;
    outbox.migrate(&setup).await?;
    setup.close().await;
    exec(
        env,
        &format!(
            "ALTER TABLE {} SET (autovacuum_enabled = off)",
            outbox.table()
        ),
    )
    .await?;
    Ok(outbox)
}

pub async fn drop_tables(env: &mut Env, outbox: &Outbox) -> Result<(), BoxError> {
    exec(
        env,
        &format!(
            "DROP TABLE IF EXISTS {}, {}, {}, {}",
            outbox.table(),
            outbox.dead_letter_table(),
            outbox.migrations_table(),
            outbox.paused_table()
        ),
    )
    .await
}

/// The JSON body of message `i` in SQL: the scenarios' `"<i>:xxx…"`, 256 characters.
pub const SQL_BODY: &str =
    "convert_to(to_json(i::text || ':' || repeat('x', 255 - length(i::text)))::text, 'UTF8')";
/// The scenarios' headers in SQL.
pub const SQL_HEADERS: &str = r#"'{"content-type": "application/json"}'::jsonb"#;

/// Inserts rows `from..to` (as `i`) with `columns`/`values` given in terms of `i`, in
/// chunks of [`CHUNK`] rows, printing progress for big ones.
pub async fn insert_series(
    env: &mut Env,
    table: &str,
    from: u64,
    to: u64,
    columns: &str,
    values: &str,
) -> Result<(), BoxError> {
    let mut at = from;
    while at < to {
        let end = (at + CHUNK).min(to);
        let t0 = Instant::now();
        exec(
            env,
            &format!(
                "INSERT INTO {table} ({columns}) SELECT {values} FROM generate_series({at}, {}) AS i",
                end - 1
            ),
        )
        .await?;
        // Hand this backend's insert counts to the statistics now: a later ANALYZE sets
        // n_live_tup absolutely, and counts flushed after it would be added on top.
        outbox_bench::probe::flush_own(&mut env.probe).await?;
        if to - from > CHUNK {
            eprintln!(
                "  {table}: rows {at}..{end} of this step inserted ({:.0} rows/s)",
                (end - at) as f64 / t0.elapsed().as_secs_f64()
            );
        }
        at = end;
    }
    Ok(())
}

/// `VACUUM ANALYZE`, then `CHECKPOINT`: building a big step writes gigabytes of WAL and
/// dirty pages (the insert, then vacuum setting hint bits and the visibility map), and
/// without the checkpoint the timed window would share the disk with the background
/// checkpoint writing them out, and pay a full-page image for every page it touches first.
async fn vacuum_analyze(env: &mut Env, table: &str) -> Result<(), BoxError> {
    exec(env, &format!("VACUUM ANALYZE {table}")).await?;
    exec(env, "CHECKPOINT").await
}

/// Runs the selected curves, printing each point as it is measured.
pub async fn run(env: &mut Env, args: &ScaleArgs) -> Result<Vec<Point>, BoxError> {
    for c in &args.curves {
        if !CURVES.contains(&c.as_str()) {
            return Err(format!("unknown curve `{c}`; known: {}", CURVES.join(", ")).into());
        }
    }
    let wanted = |c: &str| args.curves.is_empty() || args.curves.iter().any(|w| w == c);
    let mut points = Vec::new();
    if wanted("claim") {
        claim_curve(env, args.scale_max, &mut points).await?;
    }
    if wanted("extend") {
        extend_curve(env, args.scale_max.min(1_000_000), &mut points).await?;
    }
    if wanted("wakeup") {
        wakeup_curve(env, &mut points).await?;
    }
    if wanted("publish") {
        publish_curve(env, &mut points).await?;
    }
    Ok(points)
}

fn push(points: &mut Vec<Point>, p: Point) {
    eprintln!("  {}", p.describe());
    points.push(p);
}

/// Due rows of queue `bench` numbered `i`, deadlines in the past in `i` order.
const DUE_COLUMNS: &str = "queue, payload, headers, next_attempt_at";
fn due_values() -> String {
    format!(
        "'bench', {SQL_BODY}, {SQL_HEADERS}, \
         timestamptz '2026-01-01 00:00:00+00' + i * interval '1 microsecond'"
    )
}

/// Tops the backlog up to `n` due rows (new rows get later deadlines than the ones left),
/// then `VACUUM ANALYZE`. Returns the next free `i`.
async fn top_up(env: &mut Env, outbox: &Outbox, n: u64, next: u64) -> Result<u64, BoxError> {
    let t = outbox.table();
    let have = scalar(env, &format!("SELECT count(*) FROM {t}")).await? as u64;
    let add = n.saturating_sub(have);
    let t0 = Instant::now();
    insert_series(env, t, next, next + add, DUE_COLUMNS, &due_values()).await?;
    vacuum_analyze(env, t).await?;
    if add >= 100_000 {
        eprintln!(
            "  backlog topped up to {n} rows (+{add}) and vacuumed in {:.0} s",
            t0.elapsed().as_secs_f64()
        );
    }
    Ok(next + add)
}

/// Claim latency (the store's claim, limit 10, one at a time, each claim's rows acked in
/// one untimed `ack_batch`) and a default worker's msg/s, against backlogs of 10^4…`max`.
async fn claim_curve(env: &mut Env, max: u64, points: &mut Vec<Point>) -> Result<(), BoxError> {
    eprintln!("claim latency and consumer msg/s against the backlog …");
    let outbox = fresh(env, "bench_scale_claim").await?;
    let t = outbox.table().to_owned();
    let queues = vec!["bench".to_owned()];
    let mut next = 0;
    for n in steps(max) {
        next = top_up(env, &outbox, n, next).await?;
        let size = sizes(env, &t).await?;
        let wpool = pool(env, 4, env.worker_ping).await?;
        let store = PgStore::new(wpool.clone(), outbox.clone());
        let mut ms = Vec::with_capacity(CLAIMS);
        let mut timed = Duration::ZERO;
        for _ in 0..CLAIMS {
            let c0 = Instant::now();
            let got = store
                .claim(ClaimRequest::new(
                    &queues,
                    CLAIM_LIMIT,
                    Duration::from_secs(60),
                ))
                .await?;
            let took = c0.elapsed();
            timed += took;
            ms.push(took.as_secs_f64() * 1000.0);
            if got.len() != CLAIM_LIMIT {
                return Err(format!("claim: {} rows of a backlog of {n}", got.len()).into());
            }
            let leases: Vec<_> = got.into_iter().map(|d| d.lease).collect();
            store.ack_batch(&leases).await?;
        }
        push(
            points,
            Point::new(
                "claim",
                "store claim, limit 10",
                n,
                CLAIMS as u64,
                timed,
                size,
            )
            .latencies(ms),
        );

        next = top_up(env, &outbox, n, next).await?;
        let size = sizes(env, &t).await?;
        let wall = consume(&wpool, &outbox, CONSUMED).await?;
        push(
            points,
            Point::new(
                "consumer",
                "worker w1/b10 (defaults)",
                n,
                CONSUMED,
                wall,
                size,
            ),
        );
        wpool.close().await;
    }
    if !env.keep_tables {
        drop_tables(env, &outbox).await?;
    }
    Ok(())
}

/// A worker at default settings (concurrency 1, fetch 10, one `DELETE` per row) handles
/// `n` messages of the backlog; timed from its start to the `n`-th committed completion.
async fn consume(pool: &PgPool, outbox: &Outbox, n: u64) -> Result<Duration, BoxError> {
    let watch = recorder::watch();
    watch.reset(CLAIM_LIMIT);
    let worker = Worker::builder(PgStore::new(pool.clone(), outbox.clone()))
        .timer::<Body>(|_b: Body, _ctx: Context| async {})
        .build()?;
    let t0 = Instant::now();
    let running = worker.start();
    tokio::time::timeout(Duration::from_secs(600), watch.acked_at_least(n))
        .await
        .map_err(|_| "consumer: not finished after 600 s")?;
    let wall = t0.elapsed();
    let report = running.shutdown().await;
    if !report.graceful {
        return Err(format!("worker shutdown was not graceful: {report:?}").into());
    }
    Ok(wall)
}

/// Extend latency and throughput (one transaction per extend, one connection, as
/// `extend/pending`) against 10^4…`max` live timers due in an hour or more.
async fn extend_curve(env: &mut Env, max: u64, points: &mut Vec<Point>) -> Result<(), BoxError> {
    eprintln!("extend against live timers …");
    let outbox = fresh(env, "bench_scale_extend").await?;
    let t = outbox.table().to_owned();
    let mut have = 0;
    let mut seq = 0u64;
    let mut rng = rand::rngs::StdRng::seed_from_u64(17);
    for n in steps(max) {
        insert_series(
            env,
            &t,
            have,
            n,
            "queue, payload, headers, next_attempt_at, timer_id",
            &format!(
                "'bench', {SQL_BODY}, {SQL_HEADERS}, \
                 now() + interval '1 hour' + i * interval '1 millisecond', 't' || i"
            ),
        )
        .await?;
        have = n;
        vacuum_analyze(env, &t).await?;
        let size = sizes(env, &t).await?;
        let app = pool(env, 1, env.app_ping).await?;
        let mut ms = Vec::with_capacity(EXTENDS as usize);
        let t0 = Instant::now();
        for _ in 0..EXTENDS {
            seq += 1;
            let timer = rng.random_range(0..n);
            let body = Body(format!("{seq}:extended"));
            let e0 = Instant::now();
            let mut tx = app.begin().await?;
            // Every deadline is later than any seeded one (an hour + at most 10^6 ms)
            // and than the previous extend's, so each extend moves its timer.
            let out = extend_body(
                outbox.on(&mut tx),
                &format!("t{timer}"),
                &body,
                Duration::from_secs(2 * 86_400 + seq),
            )
            .await?;
            tx.commit().await?;
            ms.push(e0.elapsed().as_secs_f64() * 1000.0);
            if !matches!(out, Published::Extended { .. }) {
                return Err(format!("extend of t{timer}: unexpected {out:?}").into());
            }
        }
        let wall = t0.elapsed();
        app.close().await;
        push(
            points,
            Point::new(
                "extend",
                "extend_body, 1 connection, tx each",
                n,
                EXTENDS,
                wall,
                size,
            )
            .latencies(ms),
        );
    }
    if !env.keep_tables {
        drop_tables(env, &outbox).await?;
    }
    Ok(())
}

/// The store's `next_wakeup` (what an idle worker asks before it sleeps) for 1…1000
/// served queues, each with [`ROWS_PER_QUEUE`] pending rows due in the future.
async fn wakeup_curve(env: &mut Env, points: &mut Vec<Point>) -> Result<(), BoxError> {
    eprintln!("next_wakeup against served queues …");
    let outbox = fresh(env, "bench_scale_wakeup").await?;
    let t = outbox.table().to_owned();
    for q in [1u64, 10, 100, 1000] {
        exec(env, &format!("TRUNCATE {t}")).await?;
        insert_series(
            env,
            &t,
            0,
            q * ROWS_PER_QUEUE,
            DUE_COLUMNS,
            &format!(
                "'q' || (i % {q}), {SQL_BODY}, {SQL_HEADERS}, \
                 now() + interval '1 hour' + i * interval '1 millisecond'"
            ),
        )
        .await?;
        vacuum_analyze(env, &t).await?;
        let size = sizes(env, &t).await?;
        let queues: Vec<String> = (0..q).map(|i| format!("q{i}")).collect();
        let wpool = pool(env, 1, env.worker_ping).await?;
        let store = PgStore::new(wpool.clone(), outbox.clone());
        let mut ms = Vec::with_capacity(WAKEUPS);
        let t0 = Instant::now();
        for _ in 0..WAKEUPS {
            let c0 = Instant::now();
            let next = store
                .next_wakeup(ClaimRequest::new(
                    &queues,
                    CLAIM_LIMIT,
                    Duration::from_secs(60),
                ))
                .await?;
            ms.push(c0.elapsed().as_secs_f64() * 1000.0);
            if next.upcoming.is_none() {
                return Err("next_wakeup found no upcoming deadline".into());
            }
        }
        let wall = t0.elapsed();
        wpool.close().await;
        push(
            points,
            Point::new(
                "next_wakeup",
                "store next_wakeup",
                q,
                WAKEUPS as u64,
                wall,
                size,
            )
            .latencies(ms),
        );
    }
    if !env.keep_tables {
        drop_tables(env, &outbox).await?;
    }
    Ok(())
}

/// How a publish of the publish curve is sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PublishMode {
    /// `Outbox::publish`: the statement calls `pg_notify`, so the commit takes Postgres'
    /// database-wide notify lock (commits of notifying transactions are serialised).
    Notify,
    /// `Outbox::publish` of an outbox built with `notify(false)`: the same statement
    /// without `pg_notify`, so commits do not take the notify lock.
    NoNotify,
}

/// Publishing throughput with 1…32 connections, each publishing one message per
/// transaction for [`PUBLISH_WINDOW`].
async fn publish_curve(env: &mut Env, points: &mut Vec<Point>) -> Result<(), BoxError> {
    eprintln!("publish against concurrent connections …");
    let outbox = fresh(env, "bench_scale_publish").await?;
    let t = outbox.table().to_owned();
    let quiet = Outbox::builder()
        .table(outbox.table().trim_matches('"'))
        .notify(false)
        .build()?;
    let modes = [PublishMode::Notify, PublishMode::NoNotify];
    for c in [1u32, 2, 4, 8, 16, 32] {
        for &mode in &modes {
            exec(env, &format!("TRUNCATE {t}")).await?;
            vacuum_analyze(env, &t).await?;
            let size = sizes(env, &t).await?;
            let app = pool(env, c, env.app_ping).await?;
            let start = Arc::new(tokio::sync::Barrier::new(c as usize + 1));
            let mut tasks = Vec::new();
            for k in 0..c {
                let outbox = match mode {
                    PublishMode::Notify => outbox.clone(),
                    PublishMode::NoNotify => quiet.clone(),
                };
                let (app, start) = (app.clone(), start.clone());
                tasks.push(tokio::spawn(async move {
                    let mut ms = Vec::new();
                    let h = outbox::message::Headers::from([(
                        "content-type".to_owned(),
                        "application/json".to_owned(),
                    )]);
                    start.wait().await;
                    let end = Instant::now() + PUBLISH_WINDOW;
                    let mut i = 0u64;
                    while Instant::now() < end {
                        i += 1;
                        let payload = serde_json::to_vec(&format!("{k}-{i}:{:x<240}", ""))?;
                        let p0 = Instant::now();
                        let mut tx = app.begin().await?;
                        outbox
                            .publish(&mut tx, Message::new("bench", &payload).headers(&h))
                            .await?;
                        tx.commit().await?;
                        ms.push(p0.elapsed().as_secs_f64() * 1000.0);
                    }
                    Ok::<Vec<f64>, BoxError>(ms)
                }));
            }
            start.wait().await;
            let t0 = Instant::now();
            let mut ms = Vec::new();
            for task in tasks {
                ms.extend(task.await??);
            }
            let wall = t0.elapsed();
            app.close().await;
            let series = match mode {
                PublishMode::Notify => "notify",
                PublishMode::NoNotify => "no-notify",
            };
            push(
                points,
                Point::new("publish", series, c as u64, ms.len() as u64, wall, size).latencies(ms),
            );
        }
    }
    if !env.keep_tables {
        drop_tables(env, &outbox).await?;
    }
    Ok(())
}

/// The curves as Markdown tables, one per curve.
pub fn tables(points: &[Point]) -> String {
    let mut out = String::new();
    let mut curves: Vec<&str> = Vec::new();
    for p in points {
        if !curves.contains(&p.curve.as_str()) {
            curves.push(&p.curve);
        }
    }
    for c in curves {
        let x = match c {
            "claim" | "consumer" => "backlog (due rows)",
            "extend" => "live timers",
            "next_wakeup" => "queues",
            "publish" => "connections",
            _ => "x",
        };
        out.push_str(&format!(
            "{c}\n\n| {x} | series | per s | p50 ms | p99 ms | table MB | indexes MB |\n|---:|---|---:|---:|---:|---:|---:|\n"
        ));
        for p in points.iter().filter(|p| p.curve == c) {
            let ms = |v: Option<f64>| v.map_or("–".to_owned(), |v| format!("{v:.3}"));
            out.push_str(&format!(
                "| {} | {} | {:.0} | {} | {} | {:.1} | {:.1} |\n",
                p.x,
                p.series,
                p.per_s,
                ms(p.p50_ms),
                ms(p.p99_ms),
                p.table_bytes as f64 / 1e6,
                p.index_bytes as f64 / 1e6
            ));
        }
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_are_powers_of_ten_up_to_the_cap() {
        assert_eq!(steps(1_000_000), vec![10_000, 100_000, 1_000_000]);
        assert_eq!(steps(9_999), Vec::<u64>::new());
        assert_eq!(steps(10_000_000).len(), 4);
    }

    #[test]
    fn percentile_is_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 0.5), 50.0);
        assert_eq!(percentile(&v, 0.99), 99.0);
        assert_eq!(percentile(&[3.0], 0.99), 3.0);
    }
}
