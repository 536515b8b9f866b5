//! Faults on a Citus cluster (SPEC §13, issue 28 req 6): a worker node down, a node restarted
//! with `-m immediate` while handlers run, a shard moved under a worker, and a whole
//! rebalance (`citus_rebalance_start`) under load, by `block_writes` and by Citus' default
//! (`auto`: logical replication, which needs `wal_level = logical` on the worker nodes; with
//! `.ci/citus`'s `replica` the job's first move fails with `logical decoding requires
//! wal_level >= logical` and is retried, the job staying `running`). Each checks that
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

/// One handler run of [`rebalance_under_load`]: the payload, which worker ran it, and when it
/// started and ended.
type Span = (String, usize, std::time::Instant, std::time::Instant);

/// The placements of `table`'s shards per worker node port.
async fn placements(pool: &PgPool, table: &str) -> std::collections::BTreeMap<i32, i64> {
    sqlx::query_as::<_, (i32, i64)>(AssertSqlSafe(format!(
        "SELECT n.nodeport, count(*) FROM pg_dist_shard s JOIN pg_dist_placement p USING (shardid) \
         JOIN pg_dist_node n USING (groupid) WHERE s.logicalrelid = '{}'::regclass GROUP BY 1",
        table.replace('\'', "''")
    )))
    .fetch_all(pool)
    .await
    .expect("read the placements")
    .into_iter()
    .collect()
}

/// Sets `wal_level = logical` on both worker nodes (restarting them with `-m fast` when it
/// was not), as a shard move by logical replication needs; `.ci/citus` leaves the default,
/// `replica`.
async fn logical_wal_on_the_workers() {
    for i in 0..2 {
        let url = outbox_tests::citus_workers()[i].clone();
        let mut conn = <sqlx::PgConnection as sqlx::Connection>::connect(&url)
            .await
            .expect("connect to a worker node");
        let level: String = sqlx::query_scalar("SHOW wal_level")
            .fetch_one(&mut conn)
            .await
            .unwrap();
        if level == "logical" {
            continue;
        }
        sqlx::query("ALTER SYSTEM SET wal_level = logical")
            .execute(&mut conn)
            .await
            .unwrap();
        drop(conn);
        let (_, data) = worker_node(i);
        pg_ctl(&[
            "-D",
            &data,
            "-m",
            "fast",
            "-w",
            "restart",
            "-l",
            &format!("{data}.log"),
        ]);
    }
}

/// Waits for rebalance job `job` (`citus_rebalance_start`) to finish, polling
/// `citus_rebalance_status()`; panics when it failed, was cancelled, or is still running
/// after `limit` (with the tasks' errors: a move that fails is retried, the job staying
/// `running`). Returns how many tasks (moves) it ran.
async fn rebalance_finished(pool: &PgPool, job: i64, limit: Duration) -> i64 {
    let end = std::time::Instant::now() + limit;
    loop {
        let (state, details): (String, serde_json::Value) = sqlx::query_as(
            "SELECT state::text, details FROM citus_rebalance_status() WHERE job_id = $1",
        )
        .bind(job)
        .fetch_one(pool)
        .await
        .expect("read citus_rebalance_status()");
        match state.as_str() {
            "finished" => return details["task_state_counts"]["done"].as_i64().unwrap_or(0),
            "failed" | "cancelled" | "failing" | "cancelling" => {
                panic!("rebalance job {job} {state}: {details}")
            }
            _ => {}
        }
        assert!(
            std::time::Instant::now() < end,
            "rebalance job {job} still {state} after {} s: {details}",
            limit.as_secs()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A whole rebalance under load. The queue table's shards are first all moved to the first
/// worker node (`block_writes`, before any worker runs), so the rebalancer has work; then
/// three workers (concurrency 4 each, `lease_ttl` 2 s) run the rows while a publisher adds
/// one every 20 ms and `citus_rebalance_start` moves shards back in the background with
/// `mode` (`None`: Citus' default, `auto`). Every handler run records its start and end:
/// every published row must run, no row's runs may overlap in time, and the shards must
/// end on both nodes. One row in 25 runs 6 s (3 × `lease_ttl`), so leases are renewed
/// across the moves.
async fn rebalance_under_load(mode: Option<&str>) {
    if mode.is_none() {
        logical_wal_on_the_workers().await;
    }
    let f = cluster().await;
    let table = f.outbox.table().to_owned();
    let (first, _) = worker_node(0);
    let (second, _) = worker_node(1);
    let mut conn = f.pool.acquire().await.unwrap();
    let moved: Vec<i64> = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT s.shardid FROM pg_dist_shard s JOIN pg_dist_placement p USING (shardid) \
         JOIN pg_dist_node n USING (groupid) \
         WHERE s.logicalrelid = '{}'::regclass AND n.nodeport = $1",
        table.replace('\'', "''")
    )))
    .bind(second)
    .fetch_all(&mut *conn)
    .await
    .unwrap();
    assert!(!moved.is_empty(), "the second node holds shards at first");
    for shard in &moved {
        sqlx::query(
            "SELECT citus_move_shard_placement($1, '127.0.0.1', $2, '127.0.0.1', $3, \
             shard_transfer_mode => 'block_writes')",
        )
        .bind(shard)
        .bind(second)
        .bind(first)
        .execute(&mut *conn)
        .await
        .expect("move a shard to the first node");
    }
    let before = placements(&f.pool, &table).await;
    assert_eq!(
        before.get(&second),
        None,
        "every shard on the first node before the rebalance: {before:?}"
    );
    let mut published = Vec::new();
    for i in 0..300 {
        let key = format!("a{i}");
        f.outbox
            .publish(&mut conn, Message::new("rebalance", key.as_bytes()))
            .await
            .unwrap();
        published.push(key);
    }
    drop(conn);

    let lease_ttl = Duration::from_secs(2);
    let slow = lease_ttl * 3;
    let spans: Arc<Mutex<Vec<Span>>> = Arc::default();
    let mut workers = Vec::new();
    for w in 0..3 {
        let spans = spans.clone();
        let handler = move |body: Vec<u8>, _: Context| {
            let spans = spans.clone();
            async move {
                let key = String::from_utf8(body).unwrap();
                let start = std::time::Instant::now();
                let n: usize = key[1..].parse().unwrap();
                let work = if n.is_multiple_of(25) {
                    slow
                } else {
                    Duration::from_millis(5 + (n as u64 * 7) % 40)
                };
                tokio::time::sleep(work).await;
                spans
                    .lock()
                    .unwrap()
                    .push((key, w, start, std::time::Instant::now()));
                Ok::<(), Error>(())
            }
        };
        // A pool of its own per worker, as separate processes would have.
        let store = PgStore::new(outbox_tests::pool_with(6).await, f.outbox.clone());
        workers.push(
            Worker::builder(store)
                .concurrency(4)
                .lease_ttl(lease_ttl)
                .queue("rebalance", handler)
                .build()
                .unwrap()
                .start(),
        );
    }
    eventually(10, "the first runs", || {
        let spans = spans.clone();
        async move { !spans.lock().unwrap().is_empty() }
    })
    .await;

    // A publisher adds a row every 20 ms until told to stop.
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let publisher = {
        let (pool, outbox, stop) = (f.pool.clone(), f.outbox.clone(), stop.clone());
        tokio::spawn(async move {
            let (mut keys, mut slowest) = (Vec::new(), Duration::ZERO);
            let mut i = 300;
            while !stop.load(Ordering::SeqCst) {
                let key = format!("b{i}");
                let mut conn = pool.acquire().await.unwrap();
                let t = std::time::Instant::now();
                outbox
                    .publish(&mut conn, Message::new("rebalance", key.as_bytes()))
                    .await
                    .unwrap();
                slowest = slowest.max(t.elapsed());
                keys.push(key);
                i += 1;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            (keys, slowest)
        })
    };

    let start = match mode {
        None => "SELECT citus_rebalance_start()".to_owned(),
        Some(m) => format!("SELECT citus_rebalance_start(shard_transfer_mode => '{m}')"),
    };
    let began = std::time::Instant::now();
    let job: Option<i64> = sqlx::query_scalar(AssertSqlSafe(start))
        .fetch_one(&f.pool)
        .await
        .expect("citus_rebalance_start");
    let job = job.expect("the rebalancer planned moves (a job id)");
    // Four moves take about 20 s by logical replication on the 2-core machine; 180 s.
    let tasks = rebalance_finished(&f.pool, job, Duration::from_secs(180)).await;
    let took = began.elapsed();
    let ran_during = spans
        .lock()
        .unwrap()
        .iter()
        .filter(|s| s.2 >= began && s.2 <= began + took)
        .count();
    assert!(ran_during > 0, "no run started while the rebalance ran");
    // Load after the moves too: the workers claim from the moved shards.
    tokio::time::sleep(Duration::from_secs(1)).await;
    stop.store(true, Ordering::SeqCst);
    let (added, slowest_publish) = publisher.await.unwrap();
    published.extend(added);
    let after = placements(&f.pool, &table).await;
    assert!(tasks > 0, "the rebalance job ran no task");
    assert!(
        after.get(&second).copied().unwrap_or(0) > 0 && after.get(&first).copied().unwrap_or(0) > 0,
        "shards on both nodes after the rebalance: {before:?} -> {after:?}"
    );

    let total = published.len();
    eventually(
        120,
        "every published row ran and the table is empty",
        || {
            let (spans, pool, table, published) = (
                spans.clone(),
                f.pool.clone(),
                table.clone(),
                published.clone(),
            );
            async move {
                let ran: HashSet<String> =
                    spans.lock().unwrap().iter().map(|s| s.0.clone()).collect();
                let left: i64 =
                    sqlx::query_scalar(AssertSqlSafe(format!("SELECT count(*) FROM {table}")))
                        .fetch_one(&pool)
                        .await
                        .unwrap_or(-1);
                published.iter().all(|k| ran.contains(k)) && left == 0
            }
        },
    )
    .await;
    for w in workers {
        let report = w.shutdown().await;
        assert!(report.graceful, "{report:?}");
    }

    let mut runs: std::collections::HashMap<String, Vec<Span>> = Default::default();
    for s in spans.lock().unwrap().iter() {
        runs.entry(s.0.clone()).or_default().push(s.clone());
    }
    let mut overlapping = Vec::new();
    let mut again = 0;
    for (key, mut r) in runs {
        r.sort_by_key(|s| s.2);
        again += r.len() - 1;
        for pair in r.windows(2) {
            if pair[1].2 < pair[0].3 {
                overlapping.push(format!(
                    "{key}: worker {} and worker {} at once",
                    pair[0].1, pair[1].1
                ));
            }
        }
    }
    assert!(
        overlapping.is_empty(),
        "rows run twice at once: {overlapping:?}"
    );
    eprintln!(
        "rebalance ({}): {} task(s), placements {before:?} -> {after:?}; {total} rows published, \
         {ran_during} runs started during the job's {:.1} s, {again} run(s) again after a finished run; \
         the slowest publish took {} ms",
        mode.unwrap_or("auto"),
        tasks,
        took.as_secs_f64(),
        slowest_publish.as_millis()
    );
    f.cleanup().await;
}

#[tokio::test]
#[ignore = "needs a Citus cluster: .ci/citus -- cargo nextest run --run-ignored only -E 'test(/citus/)'"]
async fn a_rebalance_with_block_writes_under_load_loses_nothing_and_runs_nothing_twice_at_once() {
    rebalance_under_load(Some("block_writes")).await;
}

#[tokio::test]
#[ignore = "needs a Citus cluster: .ci/citus -- cargo nextest run --run-ignored only -E 'test(/citus/)'"]
async fn a_rebalance_by_logical_replication_under_load_loses_nothing_and_runs_nothing_twice_at_once(
) {
    rebalance_under_load(None).await;
}
