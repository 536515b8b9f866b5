//! Faults on a Citus cluster (SPEC §13, issue 28 req 6): a worker node down, a node restarted
//! with `-m immediate` while handlers run, a shard moved under a worker. Each checks that
//! nothing is lost and nothing runs twice at once.

use super::*;

/// Runs `pg_ctl` of the cluster's binaries on a node's data directory, as `postgres` when
/// the tests run as root (as `.ci/citus` starts the nodes).
fn pg_ctl(args: &[&str]) {
    let bin = std::env::var("PG_BIN").expect("PG_BIN (set by .ci/citus)");
    let pg_ctl = format!("{bin}/pg_ctl");
    let root = std::process::Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false);
    let status = if root {
        std::process::Command::new("runuser")
            .args(["-u", "postgres", "--", &pg_ctl])
            .args(args)
            .status()
    } else {
        std::process::Command::new(&pg_ctl).args(args).status()
    }
    .expect("run pg_ctl");
    assert!(status.success(), "pg_ctl {args:?}: {status}");
}

#[tokio::test]
#[ignore = "needs a Citus cluster: .ci/citus -- cargo nextest run --run-ignored only -E 'test(/citus/)'"]
async fn with_a_worker_node_down_the_other_nodes_rows_keep_running() {
    let f = cluster().await;
    let workers: Vec<String> = std::env::var("OUTBOX_CITUS_WORKERS")
        .expect("OUTBOX_CITUS_WORKERS")
        .split_whitespace()
        .map(str::to_owned)
        .collect();
    let data: Vec<String> = std::env::var("OUTBOX_CITUS_DATA")
        .expect("OUTBOX_CITUS_DATA")
        .split_whitespace()
        .map(str::to_owned)
        .collect();
    let down_port: i32 = workers[1]
        .rsplit(':')
        .next()
        .and_then(|p| p.split('/').next())
        .and_then(|p| p.parse().ok())
        .expect("a port in the second worker's URL");
    let mut conn = f.pool.acquire().await.unwrap();
    let mut on_live = 0;
    for i in 0..64 {
        let Published::Inserted { id } = f
            .outbox
            .publish(&mut conn, Message::new("down", format!("{i}").as_bytes()))
            .await
            .unwrap()
        else {
            panic!("inserted")
        };
        let port: i32 = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT n.nodeport FROM pg_dist_placement p JOIN pg_dist_node n USING (groupid) \
             WHERE p.shardid = get_shard_id_for_distribution_column('{}', $1::smallint)",
            f.outbox.table().replace('\'', "''")
        )))
        .bind((id % i64::from(CITUS_BUCKETS)) as i16)
        .fetch_one(&mut *conn)
        .await
        .unwrap();
        if port != down_port {
            on_live += 1;
        }
    }
    drop(conn);
    assert!(
        on_live > 0 && on_live < 64,
        "rows on both nodes: {on_live} of 64 on the live one"
    );

    pg_ctl(&["-D", &data[2], "-m", "fast", "-w", "stop"]);
    let runs = Arc::new(AtomicUsize::new(0));
    let worker = Worker::builder(f.store.clone())
        .concurrency(4)
        .queue("down", outbox_tests::count_runs::<Vec<u8>>(&runs))
        .build()
        .unwrap()
        .start();
    eventually(30, "the live node's rows run", || {
        let runs = runs.clone();
        async move { runs.load(Ordering::SeqCst) >= on_live }
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        runs.load(Ordering::SeqCst),
        on_live,
        "only the live node's rows ran while the other node was down"
    );
    pg_ctl(&[
        "-D",
        &data[2],
        "-l",
        &format!("{}.log", data[2]),
        "-w",
        "start",
    ]);
    eventually(60, "every row runs once the node is back", || {
        let runs = runs.clone();
        async move { runs.load(Ordering::SeqCst) >= 64 }
    })
    .await;
    let report = worker.shutdown().await;
    assert!(report.graceful, "{report:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 64, "each row once");
    f.cleanup().await;
}

/// The port of worker `i` (0-based) of the cluster, and its data directory.
fn worker_node(i: usize) -> (i32, String) {
    let url = std::env::var("OUTBOX_CITUS_WORKERS")
        .expect("OUTBOX_CITUS_WORKERS")
        .split_whitespace()
        .nth(i)
        .expect("a worker URL")
        .to_owned();
    let port = url
        .rsplit(':')
        .next()
        .and_then(|p| p.split('/').next())
        .and_then(|p| p.parse().ok())
        .expect("a port in the worker URL");
    let data = std::env::var("OUTBOX_CITUS_DATA")
        .expect("OUTBOX_CITUS_DATA")
        .split_whitespace()
        .nth(i + 1)
        .expect("a worker data directory")
        .to_owned();
    (port, data)
}

/// Runs per payload.
type Seen = Arc<Mutex<std::collections::HashMap<String, usize>>>;

/// A handler that counts its runs per payload in `seen`, sleeping `work` first.
fn counting(
    seen: &Seen,
    work: Duration,
) -> impl Fn(Vec<u8>, Context) -> CountedRun + Send + Sync + 'static {
    let seen = seen.clone();
    move |body: Vec<u8>, _: Context| -> CountedRun {
        let seen = seen.clone();
        Box::pin(async move {
            tokio::time::sleep(work).await;
            *seen
                .lock()
                .unwrap()
                .entry(String::from_utf8(body).unwrap())
                .or_default() += 1;
            Ok::<(), Error>(())
        })
    }
}

/// One run of [`counting`]'s handler.
type CountedRun = std::pin::Pin<Box<dyn std::future::Future<Output = Result<(), Error>> + Send>>;

#[tokio::test]
#[ignore = "needs a Citus cluster: .ci/citus -- cargo nextest run --run-ignored only -E 'test(/citus/)'"]
async fn a_worker_node_restarted_while_handlers_run_loses_nothing() {
    let f = cluster().await;
    let mut conn = f.pool.acquire().await.unwrap();
    for i in 0..40 {
        f.outbox
            .publish(
                &mut conn,
                Message::new("restart", format!("{i}").as_bytes()),
            )
            .await
            .unwrap();
    }
    drop(conn);
    let lease_ttl = Duration::from_secs(2);
    let seen = Seen::default();
    let handler = counting(&seen, Duration::from_millis(200));
    let worker = Worker::builder(f.store.clone())
        .concurrency(4)
        .lease_ttl(lease_ttl)
        .queue("restart", handler)
        .build()
        .unwrap()
        .start();
    // Handlers are running: restart the second worker node without a clean shutdown.
    eventually(10, "the first runs", || {
        let seen = seen.clone();
        async move { !seen.lock().unwrap().is_empty() }
    })
    .await;
    let (_, data) = worker_node(1);
    pg_ctl(&[
        "-D",
        &data,
        "-m",
        "immediate",
        "-w",
        "restart",
        "-l",
        &format!("{data}.log"),
    ]);
    // Leases on the restarted node expire (their completions could not commit) and the rows
    // run again: every row has run at least once and the table empties.
    eventually(60, "every row ran and the table is empty", || {
        let (seen, pool, table) = (seen.clone(), f.pool.clone(), f.outbox.table().to_owned());
        async move {
            let ran = seen.lock().unwrap().len() == 40;
            let left: i64 =
                sqlx::query_scalar(AssertSqlSafe(format!("SELECT count(*) FROM {table}")))
                    .fetch_one(&pool)
                    .await
                    .unwrap_or(-1);
            ran && left == 0
        }
    })
    .await;
    let report = worker.shutdown().await;
    assert!(report.graceful, "{report:?}");
    f.cleanup().await;
}

#[tokio::test]
#[ignore = "needs a Citus cluster: .ci/citus -- cargo nextest run --run-ignored only -E 'test(/citus/)'"]
async fn a_shard_moved_while_workers_run_loses_nothing_and_runs_nothing_twice() {
    let f = cluster().await;
    let mut conn = f.pool.acquire().await.unwrap();
    for i in 0..200 {
        f.outbox
            .publish(&mut conn, Message::new("move", format!("{i}").as_bytes()))
            .await
            .unwrap();
    }
    let seen = Seen::default();
    let handler = counting(&seen, Duration::from_millis(20));
    let worker = Worker::builder(f.store.clone())
        .concurrency(4)
        .queue("move", handler)
        .build()
        .unwrap()
        .start();
    eventually(10, "the first runs", || {
        let seen = seen.clone();
        async move { !seen.lock().unwrap().is_empty() }
    })
    .await;
    // Move one of the queue table's shards (with its co-located shards) from the first
    // worker node to the second while the worker claims and completes.
    let (from, _) = worker_node(0);
    let (to, _) = worker_node(1);
    let shard: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT s.shardid FROM pg_dist_shard s JOIN pg_dist_placement p USING (shardid) \
         JOIN pg_dist_node n USING (groupid) \
         WHERE s.logicalrelid = '{}'::regclass AND n.nodeport = $1 ORDER BY s.shardid LIMIT 1",
        f.outbox.table().replace('\'', "''")
    )))
    .bind(from)
    .fetch_one(&mut *conn)
    .await
    .unwrap();
    sqlx::query(
        "SELECT citus_move_shard_placement($1, '127.0.0.1', $2, '127.0.0.1', $3, \
         shard_transfer_mode => 'block_writes')",
    )
    .bind(shard)
    .bind(from)
    .bind(to)
    .execute(&mut *conn)
    .await
    .expect("move the shard");
    drop(conn);
    eventually(60, "every row ran", || {
        let seen = seen.clone();
        async move { seen.lock().unwrap().len() == 200 }
    })
    .await;
    let report = worker.shutdown().await;
    assert!(report.graceful, "{report:?}");
    let twice: Vec<_> = seen
        .lock()
        .unwrap()
        .iter()
        .filter(|(_, n)| **n > 1)
        .map(|(k, n)| (k.clone(), *n))
        .collect();
    assert!(twice.is_empty(), "rows run twice: {twice:?}");
    f.cleanup().await;
}
