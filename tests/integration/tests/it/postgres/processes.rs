//! Several worker processes on one database (SPEC §7.6): four processes (not
//! tasks) serve one queue; `SKIP LOCKED` claims and token-fenced writes need no coordination.
//! Every row runs exactly once, and every process handles some. No throughput assertion: the
//! measured scaling is in docs/lab-notes/2026-11-30.md.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

use outbox::message::BatchItem;
use outbox_tests::{database_url, eventually, Fixture};
use sqlx::AssertSqlSafe;

const PROCESSES: i32 = 4;
const ROWS: usize = 2000;

struct Worker {
    child: Child,
    lines: BufReader<std::process::ChildStdout>,
}

impl Worker {
    fn start(table: &str, process: i32) -> Worker {
        let mut child = Command::new(env!("CARGO_BIN_EXE_worker_process"))
            .args([
                "--dsn",
                &database_url(),
                "--table",
                table,
                "--queue",
                "work",
            ])
            .args(["--concurrency", "2", "--work-ms", "5"])
            .args(["--record-as", &process.to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("worker process starts");
        let lines = BufReader::new(child.stdout.take().unwrap());
        Worker { child, lines }
    }

    fn line(&mut self) -> String {
        let mut l = String::new();
        self.lines
            .read_line(&mut l)
            .expect("reads the worker's output");
        l.trim().to_owned()
    }

    /// Closes its standard input (it shuts down) and returns what it printed last.
    fn stop(mut self) -> String {
        drop(self.child.stdin.take());
        let last = self.line();
        let status = self.child.wait().expect("worker process exits");
        assert!(status.success(), "worker process failed: {status}");
        last
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.child.kill();
    }
}

#[tokio::test]
async fn four_worker_processes_share_a_queue_without_a_duplicate() {
    let f = Fixture::new().await;
    let table = f.outbox.table().trim_matches('"').to_owned();
    let runs = format!("\"{table}_runs\"");
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE TABLE {runs} (row_id bigint NOT NULL, process int NOT NULL)"
    )))
    .execute(&f.pool)
    .await
    .unwrap();

    let mut workers: Vec<Worker> = (0..PROCESSES).map(|p| Worker::start(&table, p)).collect();
    for w in &mut workers {
        assert_eq!(w.line(), "ready");
    }
    let payloads: Vec<Vec<u8>> = (0..ROWS).map(|i| i.to_string().into_bytes()).collect();
    let mut conn = f.pool.acquire().await.unwrap();
    for chunk in payloads.chunks(100) {
        let items: Vec<BatchItem<'_>> = chunk.iter().map(|p| BatchItem::new(p)).collect();
        f.outbox
            .publish_batch(&mut conn, "work", &items, outbox::message::Schedule::now())
            .await
            .unwrap();
    }
    eventually(60, "every row handled and acked", || async {
        f.rows("work").await.is_empty()
    })
    .await;
    for w in workers {
        let last = w.stop();
        assert!(last.starts_with("handled "), "{last}");
    }

    let (total, distinct): (i64, i64) = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT count(*), count(DISTINCT row_id) FROM {runs}"
    )))
    .fetch_one(&f.pool)
    .await
    .unwrap();
    assert_eq!(
        (total, distinct),
        (ROWS as i64, ROWS as i64),
        "each row ran once"
    );
    let per_process: Vec<(i32, i64)> = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT process, count(*) FROM {runs} GROUP BY process ORDER BY process"
    )))
    .fetch_all(&f.pool)
    .await
    .unwrap();
    assert_eq!(
        per_process.iter().map(|(p, _)| *p).collect::<Vec<_>>(),
        (0..PROCESSES).collect::<Vec<_>>(),
        "every process handled work: {per_process:?}"
    );
    sqlx::raw_sql(AssertSqlSafe(format!("DROP TABLE {runs}")))
        .execute(&f.pool)
        .await
        .unwrap();
    f.cleanup().await;
}
