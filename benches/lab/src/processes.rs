//! `outbox-lab processes`: consumer throughput with 1, 2, 4, … worker **processes** on one
//! database (SPEC §7.6, issue 14). Each process runs one `outbox::Worker` at default knobs
//! with a handler that does nothing, so the figure is what the database and the two sides'
//! CPU allow, not handler time. Not part of `check`; `docs/lab-notes/2026-11-30.md` ("Several
//! processes") reads it.
//!
//! Per step: a fresh table, `--messages` rows published in one transaction with a deadline
//! a few seconds ahead, a `CHECKPOINT`, then the processes start and sleep until that
//! deadline (every worker reads it before it sleeps), so they all begin together. The
//! window runs from the deadline to the moment the table is empty.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use clap::Args;
use outbox::message::{BatchItem, Schedule};
use outbox::Outbox;
use outbox_bench::cluster::Cluster;
use outbox_bench::probe::WORK_APP;
use outbox_bench::BoxError;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::AssertSqlSafe;

const QUEUE: &str = "bench";
const TABLE: &str = "bench_processes";
/// How far ahead the rows are due: long enough for every process to start and sleep.
const HEAD_START: Duration = Duration::from_secs(4);

#[derive(Args)]
pub struct ProcessesArgs {
    /// Worker processes per step, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
    processes: Vec<usize>,
    /// Messages per step.
    #[arg(long, default_value_t = 20_000)]
    messages: usize,
    /// `concurrency` of each process's worker (the other knobs keep their defaults).
    #[arg(long, default_value_t = 1)]
    concurrency: usize,
    /// The server whose settings the throwaway cluster copies (as for `run`).
    #[arg(long, default_value = "postgres://postgres@127.0.0.1:5432/postgres")]
    mirror: String,
}

pub async fn run(a: &ProcessesArgs) -> Result<ExitCode, BoxError> {
    if a.processes.is_empty() || a.processes.contains(&0) || a.messages == 0 {
        return Err("--processes needs counts of at least 1 and --messages at least 1".into());
    }
    eprintln!("starting a throwaway Postgres cluster …");
    let cluster = Cluster::start(Some(&a.mirror), &[]).await?;
    let dsn = cluster.dsn();
    let opts: PgConnectOptions = dsn.parse()?;
    let admin = PgPoolOptions::new()
        .max_connections(2)
        .connect_with(opts.clone().application_name("outbox-bench-setup"))
        .await?;
    let outbox = Outbox::builder().table(TABLE).build()?;
    let payloads: Vec<Vec<u8>> = (0..a.messages)
        .map(|i| format!("{i:0>256}").into_bytes())
        .collect();
    println!(
        "processes: {} messages per step, each process one worker (concurrency {}, other knobs default), handlers do nothing",
        a.messages, a.concurrency
    );
    println!("\n| processes | msg/s | seconds | per-process share |\n|---:|---:|---:|---|");
    let mut first: Option<f64> = None;
    for &k in &a.processes {
        sqlx::raw_sql(AssertSqlSafe(format!(
            "DROP TABLE IF EXISTS {t}, {t}_dlq, {t}_schema_migrations, {t}_paused",
            t = TABLE
        )))
        .execute(&admin)
        .await?;
        outbox.migrate(&admin).await?;
        sqlx::raw_sql(AssertSqlSafe(format!(
            "ALTER TABLE {TABLE} SET (autovacuum_enabled = off)"
        )))
        .execute(&admin)
        .await?;
        let due = chrono::Utc::now() + chrono::TimeDelta::from_std(HEAD_START)?;
        let mut tx = admin.begin().await?;
        for chunk in payloads.chunks(1000) {
            let items: Vec<BatchItem<'_>> = chunk.iter().map(|p| BatchItem::new(p)).collect();
            outbox
                .publish_batch(&mut tx, QUEUE, &items, Schedule::at(due))
                .await?;
        }
        tx.commit().await?;
        sqlx::raw_sql("CHECKPOINT").execute(&admin).await?;

        let mut children: Vec<(Child, BufReader<std::process::ChildStdout>)> = Vec::new();
        for _ in 0..k {
            // The same worker process as the integration test `processes` starts
            // (benches/worker-process), with a handler that does nothing.
            let mut child = Command::new(std::env::current_exe()?)
                .args([
                    "process-worker",
                    "--dsn",
                    &dsn,
                    "--table",
                    TABLE,
                    "--queue",
                    QUEUE,
                ])
                .args(["--concurrency", &a.concurrency.to_string()])
                .args(["--application-name", WORK_APP])
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .spawn()?;
            let out = BufReader::new(child.stdout.take().ok_or("no stdout")?);
            children.push((child, out));
        }
        for (_, out) in &mut children {
            let mut line = String::new();
            out.read_line(&mut line)?;
            if line.trim() != "ready" {
                return Err(format!("a worker process said {line:?} instead of ready").into());
            }
        }
        let wait = (due - chrono::Utc::now()).to_std().unwrap_or_default();
        tokio::time::sleep(wait).await;
        let t0 = Instant::now();
        let count = format!("SELECT count(*) FROM {TABLE}");
        loop {
            let left: i64 = sqlx::query_scalar(AssertSqlSafe(count.clone()))
                .fetch_one(&admin)
                .await?;
            if left == 0 {
                break;
            }
            if t0.elapsed() > Duration::from_secs(600) {
                return Err(format!("{left} rows left after 10 minutes").into());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let secs = t0.elapsed().as_secs_f64();
        let mut shares = Vec::new();
        for (mut child, mut out) in children {
            drop(child.stdin.take());
            let mut line = String::new();
            out.read_line(&mut line)?;
            let status = child.wait()?;
            if !status.success() {
                return Err(format!("a worker process failed: {status}").into());
            }
            shares.push(line.trim().trim_start_matches("handled ").to_owned());
        }
        let rate = a.messages as f64 / secs;
        let base = *first.get_or_insert(rate);
        println!(
            "| {k} | {rate:.0} ({:.2}× one process) | {secs:.2} | {} |",
            rate / base,
            shares.join(" / ")
        );
    }
    admin.close().await;
    drop(cluster);
    Ok(ExitCode::SUCCESS)
}
