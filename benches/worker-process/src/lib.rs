//! One outbox worker as a process of its own, on one raw queue of one table: what the
//! several-processes test (`tests/integration`, bin `worker_process`) and the throughput
//! benchmark `outbox-lab processes` start several of on one database, so `SKIP LOCKED`
//! claims and lease-fenced completions meet real processes rather than tasks.
//!
//! The protocol on the standard streams: the process prints `ready` once its worker runs;
//! when its standard input closes (the parent closed it, or the parent died) it shuts the
//! worker down gracefully and prints `handled N`, the runs its handler completed. A shutdown
//! that was not graceful is reported on standard error.

use std::io::Read;
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use outbox::{Context, Outbox, PgStore, Worker};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{AssertSqlSafe, ConnectOptions};

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// What the process serves and how.
#[derive(Parser, Debug, Clone)]
#[command(name = "worker-process", about = "One outbox worker as a process")]
pub struct Options {
    /// The database, as a `postgres://` URL.
    #[arg(long)]
    pub dsn: String,
    /// The outbox table (unquoted, as `OutboxBuilder::table` takes it).
    #[arg(long)]
    pub table: String,
    /// The raw queue the worker serves.
    #[arg(long)]
    pub queue: String,
    /// The worker's `concurrency`; every other knob keeps its default.
    #[arg(long, default_value_t = 1)]
    pub concurrency: usize,
    /// Records every run as `(row_id, process)` with this process number in the table
    /// `<table>_runs`, which the parent creates; without it the handler records nothing.
    #[arg(long, value_name = "PROCESS")]
    pub record_as: Option<i32>,
    /// Milliseconds each run sleeps before it returns (0: the handler does nothing).
    #[arg(long, default_value_t = 0)]
    pub work_ms: u64,
    /// `application_name` of the worker's connections.
    #[arg(long, default_value = "outbox-worker-process")]
    pub application_name: String,
}

/// The entry point of a binary that is only this process: parses the command line, runs,
/// and exits 2 with the error on standard error when something fails.
pub fn main() -> ExitCode {
    let options = Options::parse();
    let result = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(BoxError::from)
        .and_then(|rt| rt.block_on(run(&options)));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("worker-process: {e}");
            ExitCode::from(2)
        }
    }
}

/// Runs the worker until standard input closes (see the crate docs for what it prints).
pub async fn run(o: &Options) -> Result<(), BoxError> {
    let opts: PgConnectOptions = o.dsn.parse()?;
    // The worker's own connections (claim, completions, renewal) plus, when recording, one
    // per running handler for its insert.
    let handlers = if o.record_as.is_some() {
        o.concurrency
    } else {
        0
    };
    let pool = PgPoolOptions::new()
        .max_connections(u32::try_from(o.concurrency + 3 + handlers)?)
        // As the PgStore docs recommend: the worker retries what fails on a dead connection.
        .test_before_acquire(false)
        .connect_with(
            opts.application_name(&o.application_name)
                .disable_statement_logging(),
        )
        .await?;
    let outbox = Outbox::builder().table(o.table.as_str()).build()?;
    let insert: Option<Arc<str>> = o.record_as.map(|_| {
        format!(
            "INSERT INTO \"{}_runs\" (row_id, process) VALUES ($1, $2)",
            o.table
        )
        .into()
    });
    let (process, work) = (o.record_as.unwrap_or(0), Duration::from_millis(o.work_ms));
    let handled = Arc::new(AtomicU64::new(0));
    let worker = Worker::builder(PgStore::new(pool.clone(), outbox))
        .concurrency(o.concurrency)
        .queue(o.queue.as_str(), {
            let (pool, handled) = (pool.clone(), handled.clone());
            move |_: Vec<u8>, ctx: Context| {
                let (pool, insert, handled) = (pool.clone(), insert.clone(), handled.clone());
                async move {
                    if let Some(insert) = insert {
                        sqlx::query(AssertSqlSafe(&*insert))
                            .bind(ctx.id())
                            .bind(process)
                            .execute(&pool)
                            .await?;
                    }
                    if !work.is_zero() {
                        tokio::time::sleep(work).await;
                    }
                    handled.fetch_add(1, Ordering::Relaxed);
                    Ok::<(), sqlx::Error>(())
                }
            }
        })
        .build()?;
    let running = worker.start();
    println!("ready");
    stdin_closed().await?;
    let report = running.shutdown().await;
    pool.close().await;
    if !report.graceful {
        eprintln!(
            "worker-process {}: shutdown not graceful: {report:?}",
            std::process::id()
        );
    }
    println!("handled {}", handled.load(Ordering::Relaxed));
    Ok(())
}

/// Resolves when standard input reaches its end: the parent closed it, or died (its end
/// of the pipe closes with it). How a worker process is told to shut down.
pub async fn stdin_closed() -> std::io::Result<()> {
    tokio::task::spawn_blocking(|| {
        let mut buf = [0u8; 64];
        let mut stdin = std::io::stdin();
        loop {
            match stdin.read(&mut buf) {
                Ok(0) => return Ok(()),
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
    })
    .await
    .map_err(std::io::Error::other)?
}
