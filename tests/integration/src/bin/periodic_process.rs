//! A worker process with one schedule, for the crash test of periodic timers
//! (`tests/it/worker/periodic.rs`): serves the queue `reports` of the outbox table named by
//! its arguments with the schedule `tick` every second and a 1 s lease, prints
//! `started <deadline>` (RFC 3339, microseconds) when a run starts, and then never finishes
//! that run: the test kills the process in the middle of it.
//!
//! `periodic_process <database url> <table>`

use std::io::Write;
use std::time::Duration;

use outbox::periodic::Recurrence;
use outbox::{Context, Outbox, PgStore, Worker};
use sqlx::postgres::PgPoolOptions;

/// The payload of the test's schedule (the same queue and shape as `tests/it/worker/periodic.rs`'s).
#[outbox::timer(queue = "reports", max_deliveries = 3)]
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct Report {
    kind: String,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let args: Vec<String> = std::env::args().collect();
    let [_, url, table] = args.as_slice() else {
        return Err("usage: periodic_process <database url> <table>".into());
    };
    let pool = PgPoolOptions::new().max_connections(4).connect(url).await?;
    let outbox = Outbox::builder().table(table.as_str()).build()?;
    let worker = Worker::builder(PgStore::new(pool, outbox))
        .lease_ttl(Duration::from_secs(1))
        .idle_poll(Duration::from_millis(200))
        .timer::<Report>(|_: Report, ctx: Context| async move {
            let deadline = ctx
                .deadline()
                .to_rfc3339_opts(chrono::SecondsFormat::Micros, true);
            {
                let mut out = std::io::stdout().lock();
                let _ = writeln!(out, "started {deadline}");
                let _ = out.flush();
            }
            // Until the test kills the process.
            std::future::pending::<()>().await;
        })
        .schedule(
            "tick",
            Recurrence::parse_every("1s")?,
            Report {
                kind: "tick".to_owned(),
            },
        )
        .build()?;
    let _running = worker.start();
    // Until the test kills the process.
    std::future::pending().await
}
