//! One worker process of the several-processes test (`tests/it/postgres/processes.rs`): serves
//! queue `work` of the outbox table named by its arguments, records every run in
//! `<table>_runs` with its process number, prints `ready` once its worker runs, and shuts
//! down gracefully when its standard input closes, printing the runs it handled.
//!
//! `worker_process <database url> <table> <process number>`

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use outbox::{Context, Outbox, PgStore, Worker};
use sqlx::postgres::PgPoolOptions;
use sqlx::AssertSqlSafe;
use std::io::Read;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let args: Vec<String> = std::env::args().collect();
    let [_, url, table, process] = args.as_slice() else {
        return Err("usage: worker_process <database url> <table> <process number>".into());
    };
    let process: i32 = process.parse()?;
    let pool = PgPoolOptions::new().max_connections(6).connect(url).await?;
    let outbox = Outbox::builder().table(table.as_str()).build()?;
    let runs_table = format!("\"{}_runs\"", table);
    let insert = Arc::new(format!(
        "INSERT INTO {runs_table} (row_id, process) VALUES ($1, $2)"
    ));
    let handled = Arc::new(AtomicU64::new(0));
    let worker = Worker::builder(PgStore::new(pool.clone(), outbox))
        .concurrency(2)
        .queue("work", {
            let (pool, insert, handled) = (pool.clone(), insert.clone(), handled.clone());
            move |_: Vec<u8>, ctx: Context| {
                let (pool, insert, handled) = (pool.clone(), insert.clone(), handled.clone());
                async move {
                    sqlx::query(AssertSqlSafe(insert.as_str()))
                        .bind(ctx.id())
                        .bind(process)
                        .execute(&pool)
                        .await?;
                    // A little work, so every process gets a share.
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    handled.fetch_add(1, Ordering::Relaxed);
                    Ok::<(), sqlx::Error>(())
                }
            }
        })
        .build()?;
    let running = worker.start();
    println!("ready");
    // Until the parent closes our standard input.
    tokio::task::spawn_blocking(|| {
        let mut sink = Vec::new();
        std::io::stdin().read_to_end(&mut sink)
    })
    .await??;
    let report = running.shutdown().await;
    println!("handled {} {report:?}", handled.load(Ordering::Relaxed));
    Ok(())
}
