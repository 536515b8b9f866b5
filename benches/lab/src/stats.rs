//! `outbox-lab stats`: the cost of the queue statistics (`Outbox::stats`) at 10⁶ rows
//! (issue 16, requirement 2). Not part of `check`; the `stats` module docs quote its figures.
//!
//! In a database of its own (created on `--server`, dropped afterwards, also on failure):
//! `--rows` live rows spread evenly over `--queues` queues — half due (deadlines up to an
//! hour ago), half in the future (up to a day ahead), one in 97 leased (lease ages 0–119 s,
//! so about half expire under the 60 s TTL used), a rearm on every tenth leased row and a
//! cancel mark on another tenth — and `--dead-letters` dead letters, a tenth of each
//! queue's redriven. Then, twice — after
//! `ANALYZE` only (the visibility map unset, as on a table autovacuum has not reached yet)
//! and after `VACUUM ANALYZE` — each of exact and estimate mode, for every queue and for
//! one queue, runs `--repeat` times on one connection (min and median wall time through
//! `Outbox::stats`), and once under `EXPLAIN (ANALYZE, BUFFERS)`, whose scan nodes and JIT
//! time are printed. Throughput is never gated; this only reports.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Args;
use outbox::stats::{Count, QueueStats, StatsMode, StatsRequest};
use outbox::Outbox;
use serde_json::Value;
use sqlx::postgres::types::PgInterval;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{AssertSqlSafe, Connection, PgConnection, PgPool};

use outbox_bench::BoxError;

const TTL: Duration = Duration::from_secs(60);

#[derive(Args)]
pub struct StatsArgs {
    /// Live rows in the queue table.
    #[arg(long, default_value_t = 1_000_000)]
    rows: u64,
    /// Queues the rows are spread over (evenly).
    #[arg(long, default_value_t = 8)]
    queues: u64,
    /// Rows in the dead-letter table.
    #[arg(long, default_value_t = 100_000)]
    dead_letters: u64,
    /// Timed runs of each read.
    #[arg(long, default_value_t = 5)]
    repeat: usize,
    /// The server to create the throwaway database on (any database of it; the user needs
    /// CREATEDB).
    #[arg(long, default_value = "postgres://postgres@127.0.0.1:5432/postgres")]
    server: String,
}

pub async fn run(a: &StatsArgs) -> Result<ExitCode, BoxError> {
    if a.rows == 0 || a.queues == 0 || a.repeat == 0 {
        return Err("--rows, --queues and --repeat must be at least 1".into());
    }
    let admin_opts: PgConnectOptions = a.server.parse()?;
    let admin_opts = admin_opts.application_name("outbox-bench-stats");
    let mut admin = PgConnection::connect_with(&admin_opts).await?;
    let db = format!("outbox_bench_stats_{}", std::process::id());
    sqlx::raw_sql(AssertSqlSafe(format!("CREATE DATABASE {db}")))
        .execute(&mut admin)
        .await?;
    eprintln!("created database {db}");
    let opts = admin_opts.clone().database(&db);
    let result = measure(a, opts).await;
    // Dropped whatever happened (FORCE ends the sessions a failed run may have left).
    let dropped = sqlx::raw_sql(AssertSqlSafe(format!(
        "DROP DATABASE IF EXISTS {db} WITH (FORCE)"
    )))
    .execute(&mut admin)
    .await;
    match &dropped {
        Ok(_) => eprintln!("dropped database {db}"),
        Err(e) => eprintln!("could not drop database {db}: {e}; drop it by hand"),
    }
    result?;
    dropped?;
    Ok(ExitCode::SUCCESS)
}

async fn measure(a: &StatsArgs, opts: PgConnectOptions) -> Result<(), BoxError> {
    let pool = PgPoolOptions::new()
        .max_connections(2)
        .connect_with(opts)
        .await?;
    let outbox = Outbox::builder().dead_letter(true).build()?;
    outbox.migrate(&pool).await?;
    let version: String = sqlx::query_scalar("SELECT current_setting('server_version')")
        .fetch_one(&pool)
        .await?;
    let settings: Vec<(String, String)> = sqlx::query_as(
        "SELECT name, setting FROM pg_settings WHERE name IN \
         ('jit', 'max_parallel_workers_per_gather', 'shared_buffers', 'work_mem') ORDER BY name",
    )
    .fetch_all(&pool)
    .await?;
    println!(
        "stats: PostgreSQL {version}, {} cores; {}",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        settings
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(" ")
    );
    let fill = Instant::now();
    fill_tables(&pool, &outbox, a).await?;
    let size: String = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT pg_size_pretty(pg_total_relation_size('{}'))",
        outbox.table()
    )))
    .fetch_one(&pool)
    .await?;
    println!(
        "{} rows over {} queues ({size} with indexes), {} dead letters; filled in {:.1} s",
        a.rows,
        a.queues,
        a.dead_letters,
        fill.elapsed().as_secs_f64()
    );

    for (phase, prep) in [
        ("after ANALYZE (visibility map unset)", "ANALYZE"),
        ("after VACUUM ANALYZE", "VACUUM ANALYZE"),
    ] {
        for t in [outbox.table(), outbox.dead_letter_table()] {
            sqlx::raw_sql(AssertSqlSafe(format!("{prep} {t}")))
                .execute(&pool)
                .await?;
        }
        println!("\n### {phase}\n");
        println!("| read | min ms | median ms | plan (scans of the queue and dead-letter tables) | JIT ms |");
        println!("|---|---:|---:|---|---:|");
        let mut conn = pool.acquire().await?;
        let mut exact_all = Vec::new();
        let mut estimate_all = Vec::new();
        for (label, mode, queues) in [
            ("exact, every queue", StatsMode::Exact, None),
            ("exact, one queue", StatsMode::Exact, Some("q0")),
            ("estimate, every queue", StatsMode::Estimate, None),
            ("estimate, one queue", StatsMode::Estimate, Some("q0")),
        ] {
            let mut request = StatsRequest::new(TTL).mode(mode);
            if let Some(q) = queues {
                request = request.queues([q]);
            }
            let mut times = Vec::new();
            let mut last = Vec::new();
            for _ in 0..a.repeat {
                let t = Instant::now();
                last = outbox.stats(&mut conn, &request).await?;
                times.push(t.elapsed().as_secs_f64() * 1000.0);
            }
            times.sort_by(f64::total_cmp);
            let (plan, jit) = explain(&mut conn, &outbox, mode, queues).await?;
            println!(
                "| {label} | {:.1} | {:.1} | {plan} | {jit} |",
                times[0],
                times[times.len() / 2]
            );
            match (mode, queues) {
                (StatsMode::Exact, None) => exact_all = last,
                (StatsMode::Estimate, None) => estimate_all = last,
                _ => {}
            }
        }
        compare(&exact_all, &estimate_all);
    }
    pool.close().await;
    Ok(())
}

/// The rows the module docs describe, in a few statements.
async fn fill_tables(pool: &PgPool, outbox: &Outbox, a: &StatsArgs) -> Result<(), BoxError> {
    let (t, d) = (outbox.table(), outbox.dead_letter_table());
    let chunk = 250_000u64;
    let mut from = 1;
    while from <= a.rows {
        let to = (from + chunk - 1).min(a.rows);
        sqlx::raw_sql(AssertSqlSafe(format!(
            "INSERT INTO {t} (queue, payload, next_attempt_at, acquired_at, acquired_token, \
                              rearm_at, rearm_payload, cancelled_at) \
             SELECT 'q' || (i % {q}), convert_to(repeat('x', 100), 'UTF8'), \
                    CASE WHEN i % 2 = 0 THEN now() - (i % 3600) * interval '1 second' \
                         ELSE now() + (i % 86400) * interval '1 second' END, \
                    CASE WHEN i % 97 = 1 THEN now() - (i % 120) * interval '1 second' END, \
                    CASE WHEN i % 97 = 1 THEN gen_random_uuid() END, \
                    CASE WHEN i % 97 = 1 AND i / 97 % 10 = 0 THEN now() + interval '1 hour' END, \
                    CASE WHEN i % 97 = 1 AND i / 97 % 10 = 0 THEN 'r'::bytea END, \
                    CASE WHEN i % 97 = 1 AND i / 97 % 10 = 5 THEN now() END \
             FROM generate_series({from}, {to}) AS i",
            q = a.queues
        )))
        .execute(pool)
        .await?;
        from = to + 1;
    }
    if a.dead_letters > 0 {
        sqlx::raw_sql(AssertSqlSafe(format!(
            "INSERT INTO {d} (original_id, queue, payload, attempts_count, deliveries_count, \
                              created_at, failure_reason, last_error, redriven_at) \
             SELECT i, 'q' || (i % {q}), convert_to(repeat('x', 100), 'UTF8'), 3, 3, now(), \
                    'retry_exhausted', 'boom', CASE WHEN i / {q} % 10 = 0 THEN now() END \
             FROM generate_series(1, {n}) AS i",
            q = a.queues,
            n = a.dead_letters
        )))
        .execute(pool)
        .await?;
    }
    Ok(())
}

/// One `EXPLAIN (ANALYZE, BUFFERS)` of the statement `Outbox::stats` sends for this read:
/// its scans of the two tables (node type and index) and its JIT time.
async fn explain(
    conn: &mut PgConnection,
    outbox: &Outbox,
    mode: StatsMode,
    queue: Option<&str>,
) -> Result<(String, String), BoxError> {
    let name = match (mode, queue.is_some()) {
        (StatsMode::Exact, false) => "stats.exact",
        (StatsMode::Exact, true) => "stats.exact_queues",
        (_, false) => "stats.estimate",
        (_, true) => "stats.estimate_queues",
    };
    let statements = outbox.statements();
    let sql = &statements
        .iter()
        .find(|(n, _)| *n == name)
        .ok_or("no such statement")?
        .1;
    let ttl = PgInterval {
        months: 0,
        days: 0,
        microseconds: TTL.as_micros() as i64,
    };
    let mut q = sqlx::query_scalar::<_, Value>(AssertSqlSafe(format!(
        "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {sql}"
    )))
    .bind(ttl)
    .bind(Vec::<String>::new())
    .bind(Vec::<PgInterval>::new());
    if mode == StatsMode::Estimate {
        q = q.bind(true);
    }
    if let Some(queue) = queue {
        q = q.bind(vec![queue.to_owned()]);
    }
    let plan = q.fetch_one(&mut *conn).await?;
    let tables = [
        outbox.table().trim_matches('"').to_owned(),
        outbox.dead_letter_table().trim_matches('"').to_owned(),
    ];
    let mut scans = Vec::new();
    scans_of(&plan[0]["Plan"], &tables, &mut scans);
    let jit = plan[0]["JIT"]["Timing"]["Total"]
        .as_f64()
        .map_or("-".to_owned(), |ms| format!("{ms:.0}"));
    Ok((scans.join("; "), jit))
}

/// `Index Only Scan using outbox_pending_idx (1 000 000 rows, 3 210 heap fetches)`, …
fn scans_of(plan: &Value, tables: &[String], out: &mut Vec<String>) {
    let kind = plan["Node Type"].as_str().unwrap_or("");
    if let Some(rel) = plan.get("Relation Name").and_then(Value::as_str) {
        if tables.iter().any(|t| t == rel) {
            let index = plan
                .get("Index Name")
                .and_then(Value::as_str)
                .map_or(format!(" on {rel}"), |i| format!(" using {i}"));
            let rows = plan["Actual Rows"].as_f64().unwrap_or(0.0)
                * plan["Actual Loops"].as_f64().unwrap_or(1.0);
            let fetches = plan
                .get("Heap Fetches")
                .and_then(Value::as_f64)
                .map_or(String::new(), |f| format!(", {f:.0} heap fetches"));
            let workers = plan
                .get("Workers Launched")
                .and_then(Value::as_f64)
                .map_or(String::new(), |w| format!(", {w:.0} workers"));
            out.push(format!("{kind}{index} ({rows:.0} rows{fetches}{workers})"));
        }
    }
    for c in plan
        .get("Plans")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        scans_of(c, tables, out);
    }
}

/// Prints, per queue, pending and dead letters counted and estimated.
fn compare(exact: &[QueueStats], estimate: &[QueueStats]) {
    let n = |c: Count| c.value().map_or("-".to_owned(), |v| v.to_string());
    println!("\n| queue | pending (exact) | pending (estimate) | dead letters (exact) | dead letters (estimate) |");
    println!("|---|---:|---:|---:|---:|");
    for e in exact {
        let est = estimate.iter().find(|s| s.queue == e.queue);
        println!(
            "| {} | {} | {} | {} | {} |",
            e.queue,
            n(e.pending),
            est.map_or("(not listed)".to_owned(), |s| n(s.pending)),
            n(e.dead_letters),
            est.map_or("(not listed)".to_owned(), |s| n(s.dead_letters)),
        );
    }
}
