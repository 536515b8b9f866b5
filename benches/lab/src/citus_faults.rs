//! The Citus faults of the matrix (`outbox-lab faults --citus`, `docs/faults.md`, "On a
//! Citus cluster"): the same rows, workers and tally as [`crate::faults`], on the cluster
//! `.ci/citus` starts (a coordinator and two worker nodes), with outboxes distributed over
//! `--buckets`. The faults act on the second worker node or on the shards' placements:
//!
//! - `citus-node-down`: the node stopped at 20 % (`pg_ctl stop -m fast`); the rows on the
//!   first node must all run while it is down; then it starts again and everything drains;
//! - `citus-node-restart`: the node restarted with `-m immediate` at 30 %;
//! - `citus-rebalance-block-writes`, `citus-rebalance-logical`: the queue table's shards all
//!   moved to the first node before the workers start, then at 20 % `citus_rebalance_start`
//!   moves them back while two workers run, by `block_writes` and by Citus' default (`auto`,
//!   logical replication, for which the worker nodes get `wal_level = logical`).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::os::unix::fs::MetadataExt;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use sqlx::postgres::PgConnectOptions;
use sqlx::{AssertSqlSafe, Connection, Row};

use outbox_bench::recorder;
use outbox_bench::report::Machine;
use outbox_bench::BoxError;

use crate::faults::{
    admin_pool, conclude, drain, overlaps, prepare, scenarios, select, simple, start_worker,
    stop_worker, tally, trigger_at, Behavior, Ctx, FaultArgs, Knobs, Ledger, Outcome, Recorder,
};

/// The Citus scenarios, in run order.
pub const SCENARIOS: &[&str] = &[
    "citus-node-down",
    "citus-node-restart",
    "citus-rebalance-block-writes",
    "citus-rebalance-logical",
];

/// The longest the rebalance job may take (four moves take about 20 s by logical
/// replication on the 2-core machine).
const REBALANCE_LIMIT: Duration = Duration::from_secs(180);
/// The longest the first node's rows may take to run while the second is down.
const DOWN_LIMIT: Duration = Duration::from_secs(60);

/// The cluster `.ci/citus` started, from its environment.
#[derive(Clone)]
struct Nodes {
    /// The worker nodes' URLs (database `test`).
    workers: Vec<String>,
    /// The data directories, coordinator first.
    data: Vec<String>,
    /// The server binaries.
    bin: String,
}

impl Nodes {
    fn from_env() -> Result<Nodes, BoxError> {
        let var = |name: &str| -> Result<String, BoxError> {
            std::env::var(name).map_err(|_| -> BoxError {
                format!(
                    "--citus runs on the cluster of .ci/citus, and {name} is not set: \
                     .ci/citus -- cargo run --release -p outbox-lab -- faults --citus"
                )
                .into()
            })
        };
        if var("OUTBOX_CITUS")? != "1" {
            return Err("--citus: OUTBOX_CITUS is not 1 (run under .ci/citus)".into());
        }
        let workers: Vec<String> = var("OUTBOX_CITUS_WORKERS")?
            .split_whitespace()
            .map(str::to_owned)
            .collect();
        let data: Vec<String> = var("OUTBOX_CITUS_DATA")?
            .split_whitespace()
            .map(str::to_owned)
            .collect();
        if workers.len() != 2 || data.len() != 3 {
            return Err(format!(
                "--citus needs a coordinator and two worker nodes; OUTBOX_CITUS_WORKERS names {} and \
                 OUTBOX_CITUS_DATA {} directories",
                workers.len(),
                data.len()
            )
            .into());
        }
        Ok(Nodes {
            workers,
            data,
            bin: var("PG_BIN")?,
        })
    }

    /// The port of worker node `i` (0-based).
    fn port(&self, i: usize) -> Result<i32, BoxError> {
        let opts: PgConnectOptions = self.workers[i].parse()?;
        Ok(i32::from(opts.get_port()))
    }

    /// `pg_ctl <args>` on worker node `i`'s data directory (its log beside it), as the
    /// `postgres` OS user when we are root, as `.ci/citus` starts the nodes.
    async fn pg_ctl(&self, i: usize, args: &'static [&'static str]) -> Result<(), BoxError> {
        let nodes = self.clone();
        tokio::task::spawn_blocking(move || nodes.pg_ctl_blocking(i, args)).await?
    }

    fn pg_ctl_blocking(&self, i: usize, args: &[&str]) -> Result<(), BoxError> {
        let data = &self.data[i + 1];
        let log = format!("{data}.log");
        let exe = format!("{}/pg_ctl", self.bin);
        let root = std::fs::metadata("/proc/self").map(|m| m.uid() == 0)?;
        let mut cmd = if root {
            let mut c = std::process::Command::new("runuser");
            c.args(["-u", "postgres", "--", &exe]);
            c
        } else {
            std::process::Command::new(&exe)
        };
        let out = cmd
            .args(["-D", data, "-l", &log, "-w", "-t", "60"])
            .args(args)
            .output()
            .map_err(|e| format!("running {exe}: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "pg_ctl {args:?} of {data} failed ({}): {}{}",
                out.status,
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            )
            .into());
        }
        Ok(())
    }
}

/// `outbox-lab faults --citus`.
pub async fn run(args: &FaultArgs) -> Result<ExitCode, BoxError> {
    let selected = select(&args.only, SCENARIOS)?;
    if args.messages == 0 && args.timers == 0 {
        return Err("nothing to publish: --messages and --timers are both 0".into());
    }
    if !args.pg_set.is_empty() {
        return Err(
            "--pg-set configures the throwaway cluster; --citus runs on .ci/citus's".into(),
        );
    }
    let nodes = Nodes::from_env()?;
    let dsn = std::env::var("DATABASE_URL")
        .map_err(|_| "--citus: DATABASE_URL (the coordinator) is not set; run under .ci/citus")?;
    let watch = recorder::watch();
    let opts: PgConnectOptions = dsn.parse()?;
    // Before any session of ours caches a connection to a worker node that this restarts.
    let wal_note = if selected.contains(&"citus-rebalance-logical") {
        logical_wal(&opts, &nodes).await?
    } else {
        None
    };
    // The harness's sessions keep no connection to a worker node past a transaction, so
    // none is stale after a node restarts.
    let admin = admin_pool(
        &opts
            .clone()
            .options([("citus.max_cached_conns_per_worker", "0")]),
    )
    .await?;
    let (version, citus, active): (String, String, i64) = sqlx::query_as(
        "SELECT current_setting('server_version'), \
                (regexp_match(citus_version(), 'Citus ([0-9.]+)'))[1], \
                (SELECT count(*) FROM citus_get_active_worker_nodes())",
    )
    .fetch_one(&admin)
    .await
    .map_err(|e| format!("--citus: DATABASE_URL is not a Citus coordinator: {e}"))?;
    if active != 2 {
        return Err(
            format!("--citus: the coordinator has {active} active worker nodes, not 2").into(),
        );
    }
    let machine = Machine::read(
        &format!("PostgreSQL {version}, Citus {citus}"),
        &format!(
            "Citus cluster of .ci/citus: a coordinator and 2 worker nodes on this machine, \
             outboxes distributed({})",
            args.buckets
        ),
    );
    println!("{}", machine.describe());
    let ctx = Ctx {
        mirror: String::new(),
        pg_set: Vec::new(),
        dsn,
        opts,
        admin,
        control: None,
        buckets: Some(args.buckets),
        messages: args.messages,
        timers: args.timers,
        drain_timeout: Duration::from_secs(args.drain_timeout_secs),
    };
    let outcomes = scenarios(&watch, &selected, |name| {
        let (ctx, nodes, wal_note) = (&ctx, &nodes, &wal_note);
        async move {
            match name {
                "citus-node-down" => node_down(ctx, nodes).await,
                "citus-node-restart" => node_restart(ctx, nodes).await,
                "citus-rebalance-block-writes" => {
                    rebalance(ctx, nodes, name, Some("block_writes")).await
                }
                "citus-rebalance-logical" => {
                    let mut o = rebalance(ctx, nodes, name, None).await?;
                    o.notes.extend(wal_note.clone());
                    Ok(o)
                }
                other => Err(format!("no Citus scenario `{other}`").into()),
            }
        }
    })
    .await?;
    ctx.admin.close().await;
    Ok(conclude(&machine, args, &outcomes))
}

/// The worker node port of each bucket of `table`.
async fn bucket_nodes(ctx: &Ctx, table: &str) -> Result<HashMap<i16, i32>, BoxError> {
    let buckets = ctx.buckets.unwrap_or(1);
    let mut out = HashMap::new();
    for b in 0..i16::try_from(buckets)? {
        let port: i32 = sqlx::query_scalar(
            "SELECT n.nodeport FROM pg_dist_placement p JOIN pg_dist_node n USING (groupid) \
             WHERE p.shardid = get_shard_id_for_distribution_column($1::regclass, $2::smallint)",
        )
        .bind(table)
        .bind(b)
        .fetch_one(&ctx.admin)
        .await?;
        out.insert(b, port);
    }
    Ok(out)
}

/// The placements of `table`'s shards per worker node port.
async fn placements(ctx: &Ctx, table: &str) -> Result<BTreeMap<i32, i64>, BoxError> {
    Ok(sqlx::query_as::<_, (i32, i64)>(
        "SELECT n.nodeport, count(*) FROM pg_dist_shard s JOIN pg_dist_placement p USING (shardid) \
         JOIN pg_dist_node n USING (groupid) WHERE s.logicalrelid = $1::regclass GROUP BY 1",
    )
    .bind(table)
    .fetch_all(&ctx.admin)
    .await?
    .into_iter()
    .collect())
}

/// The second worker node stopped at 20 %: the first node's rows must all run while it is
/// down (the claim goes bucket by bucket when the read across the shards fails); then it
/// starts again and every row drains.
async fn node_down(ctx: &Ctx, nodes: &Nodes) -> Result<Outcome, BoxError> {
    let name = "citus-node-down";
    let (live, down) = (nodes.port(0)?, nodes.port(1)?);
    let table = crate::faults::table_for(name);
    let admin = ctx.admin.clone();
    let live_ran = &AtomicBool::new(false);
    let mut o = simple(
        ctx,
        name,
        Knobs::default(),
        Behavior::paced(1, 4),
        0.2,
        |ledger: Arc<Ledger>| async move {
            let of_bucket = bucket_nodes(ctx, &table).await?;
            // The first node's rows not run yet, by key and version, when the other stops.
            let rows = sqlx::query(AssertSqlSafe(format!(
                "SELECT bucket, queue, timer_id, payload FROM {table}"
            )))
            .fetch_all(&admin)
            .await?;
            let mut waiting: HashSet<(String, u32)> = HashSet::new();
            let mut on_down = 0;
            for r in &rows {
                let bucket: i16 = r.try_get("bucket")?;
                let queue: String = r.try_get("queue")?;
                let timer_id: Option<String> = r.try_get("timer_id")?;
                let payload: Vec<u8> = r.try_get("payload")?;
                if of_bucket.get(&bucket) == Some(&live) {
                    waiting.insert(crate::faults::key_of(&queue, timer_id.as_deref(), &payload));
                } else {
                    on_down += 1;
                }
            }
            let ran_before = ledger.total();
            let t = Instant::now();
            nodes.pg_ctl(1, &["-m", "fast", "stop"]).await?;
            let stopped = t.elapsed();
            let down_at = Instant::now();
            let mut all_ran = None;
            while down_at.elapsed() < DOWN_LIMIT {
                let runs = ledger.snapshot();
                if waiting.iter().all(|v| runs.get(v).is_some_and(|&n| n > 0)) {
                    all_ran = Some(down_at.elapsed());
                    break;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            let ran_while_down = ledger.total() - ran_before;
            live_ran.store(all_ran.is_some(), Ordering::SeqCst);
            nodes.pg_ctl(1, &["start"]).await?;
            Ok(vec![format!(
                    "node :{down} stopped (pg_ctl stop -m fast, {:.1} s) after {ran_before} runs, \
                     with {} rows left on node :{live} and {on_down} on it; {ran_while_down} runs while it was down; \
                     node :{live}'s rows {}",
                    stopped.as_secs_f64(),
                    waiting.len(),
                    all_ran.map_or(
                        format!("had not all run after {} s", DOWN_LIMIT.as_secs()),
                        |d| format!("all ran {:.1} s after the stop", d.as_secs_f64())
                    ),
                )])
        },
    )
    .await?;
    o.checks.push((
        format!(
            "the live node's rows all ran while the other was down (within {} s)",
            DOWN_LIMIT.as_secs()
        ),
        live_ran.load(Ordering::SeqCst),
    ));
    Ok(o)
}

/// The second worker node restarted with `-m immediate` at 30 %: leases of rows there
/// whose completion could not land expire and the rows run again.
async fn node_restart(ctx: &Ctx, nodes: &Nodes) -> Result<Outcome, BoxError> {
    let port = nodes.port(1)?;
    simple(
        ctx,
        "citus-node-restart",
        Knobs::default(),
        Behavior::paced(1, 4),
        0.3,
        |_| async move {
            let t = Instant::now();
            nodes.pg_ctl(1, &["-m", "immediate", "restart"]).await?;
            let took = t.elapsed();
            let watch = recorder::watch();
            let at = watch.acked();
            let back = Instant::now();
            let mut resumed = None;
            while back.elapsed() < Duration::from_secs(30) {
                if watch.acked() > at {
                    resumed = Some(back.elapsed());
                    break;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            Ok(vec![format!(
                "node :{port}: pg_ctl restart -m immediate took {:.1} s; the worker's next ack landed {} after it returned",
                took.as_secs_f64(),
                resumed.map_or("not within 30 s".to_owned(), |d| format!(
                    "{:.0} ms",
                    d.as_secs_f64() * 1e3
                ))
            )])
        },
    )
    .await
}

/// Sets `wal_level = logical` on both worker nodes, restarting (`-m fast`) those where it
/// was not: Citus moves a shard by logical replication only then, and `.ci/citus` leaves
/// the default, `replica`. Says what it changed. Runs before the matrix opens its pools:
/// a coordinator session that had cached a connection to a restarted node fails its next
/// statement there ("failure on connection marked as essential").
async fn logical_wal(opts: &PgConnectOptions, nodes: &Nodes) -> Result<Option<String>, BoxError> {
    let mut restarted = Vec::new();
    for (i, url) in nodes.workers.iter().enumerate() {
        let mut conn = sqlx::PgConnection::connect(url).await?;
        let level: String = sqlx::query_scalar("SHOW wal_level")
            .fetch_one(&mut conn)
            .await?;
        if level != "logical" {
            sqlx::query("ALTER SYSTEM SET wal_level = logical")
                .execute(&mut conn)
                .await?;
            drop(conn);
            nodes.pg_ctl(i, &["-m", "fast", "restart"]).await?;
            restarted.push(format!(":{}", nodes.port(i)?));
        }
    }
    if restarted.is_empty() {
        return Ok(None);
    }
    // Wait until the coordinator reaches both again.
    let end = Instant::now() + Duration::from_secs(30);
    loop {
        let mut coordinator = sqlx::PgConnection::connect_with(opts).await?;
        let ok: Result<i64, sqlx::Error> = sqlx::query_scalar(
            "SELECT count(*) FROM run_command_on_workers('SELECT 1') WHERE success",
        )
        .fetch_one(&mut coordinator)
        .await;
        drop(coordinator);
        if matches!(ok, Ok(2)) {
            break;
        }
        if Instant::now() > end {
            return Err(format!("the worker nodes do not answer after the restart: {ok:?}").into());
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Ok(Some(format!(
        "wal_level set to logical on {} (restarted before the first scenario)",
        restarted.join(", ")
    )))
}

/// The job of `citus_rebalance_start` until it finished, failed or `REBALANCE_LIMIT`
/// passed: its last state, its details (the tasks' errors when one failed), how many tasks
/// it ran, and how long into it the workers still had rows to run (fewer than `published`
/// rows had run).
async fn wait_for_job(
    ctx: &Ctx,
    job: i64,
    ledger: &Ledger,
    published: u64,
) -> Result<(String, String, i64, Duration), BoxError> {
    let began = Instant::now();
    let end = began + REBALANCE_LIMIT;
    let mut loaded = Duration::ZERO;
    loop {
        if (ledger.snapshot().len() as u64) < published {
            loaded = began.elapsed();
        }
        let (state, details): (String, serde_json::Value) = sqlx::query_as(
            "SELECT state::text, details FROM citus_rebalance_status() WHERE job_id = $1",
        )
        .bind(job)
        .fetch_one(&ctx.admin)
        .await?;
        let done = details["task_state_counts"]["done"].as_i64().unwrap_or(0);
        let over = matches!(state.as_str(), "finished" | "failed" | "cancelled");
        if over || Instant::now() > end {
            return Ok((state, details.to_string(), done, loaded));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Every shard of the queue table on the first worker node before the workers start; at
/// 20 %, `citus_rebalance_start` with `mode` (`None`: Citus' default) moves shards back
/// while two workers run.
async fn rebalance(
    ctx: &Ctx,
    nodes: &Nodes,
    name: &'static str,
    mode: Option<&str>,
) -> Result<Outcome, BoxError> {
    let mut notes = Vec::new();
    let (first, second) = (nodes.port(0)?, nodes.port(1)?);
    let p = prepare(ctx, name).await?;
    let table = crate::faults::table_for(name);
    let shards: Vec<i64> = sqlx::query_scalar(
        "SELECT s.shardid FROM pg_dist_shard s JOIN pg_dist_placement p USING (shardid) \
         JOIN pg_dist_node n USING (groupid) WHERE s.logicalrelid = $1::regclass AND n.nodeport = $2",
    )
    .bind(&table)
    .bind(second)
    .fetch_all(&ctx.admin)
    .await?;
    for shard in &shards {
        sqlx::query(
            "SELECT citus_move_shard_placement($1, '127.0.0.1', $2, '127.0.0.1', $3, \
             shard_transfer_mode => 'block_writes')",
        )
        .bind(shard)
        .bind(second)
        .bind(first)
        .execute(&ctx.admin)
        .await?;
    }
    let before = placements(ctx, &table).await?;

    let ledger = Arc::new(Ledger::default());
    let rec = Recorder::Memory(ledger.clone());
    let behavior = Behavior::paced(1, 4);
    let started = Instant::now();
    let mut workers = Vec::new();
    for _ in 0..2 {
        workers.push(start_worker(
            &ctx.opts,
            &p.outbox,
            Knobs::default(),
            &behavior,
            &rec,
        )?);
    }
    let done = || {
        let n = ledger.total();
        async move { n }
    };
    notes.extend(trigger_at(name, p.published(), 0.2, done).await);
    let sql = match mode {
        Some(m) => format!("SELECT citus_rebalance_start(shard_transfer_mode => '{m}')"),
        None => "SELECT citus_rebalance_start()".to_owned(),
    };
    let ran_before = ledger.total();
    let t = Instant::now();
    let job: Option<i64> = sqlx::query_scalar(AssertSqlSafe(sql))
        .fetch_one(&ctx.admin)
        .await?;
    let published = u64::try_from(p.published())?;
    let (state, details, tasks, loaded) = match job {
        Some(job) => wait_for_job(ctx, job, &ledger, published).await?,
        None => (
            "not started".to_owned(),
            "no moves planned".to_owned(),
            0,
            Duration::ZERO,
        ),
    };
    let took = t.elapsed();
    let during = ledger.total() - ran_before;
    if state != "finished" {
        // A move that fails is retried, the job staying `running`: stop it.
        sqlx::query("SELECT citus_rebalance_stop()")
            .execute(&ctx.admin)
            .await?;
        notes.push(format!(
            "job {state} after {:.0} s: {details}",
            took.as_secs_f64()
        ));
    }
    let after = placements(ctx, &table).await?;
    drain(ctx, &p.outbox).await;
    let wall = started.elapsed();
    for (w, pool) in workers {
        let report = stop_worker(w, pool).await;
        if !report.graceful {
            notes.push(crate::faults::shutdown_note("final shutdown", &report));
        }
    }
    let mut o = tally(ctx, name, &p, &ledger.snapshot(), &HashMap::new(), wall).await?;
    notes.insert(
        0,
        format!(
            "placements {} -> {}: citus_rebalance_start({}) ran {tasks} moves in {:.1} s, {ran_before} runs before it, {during} during it (rows left to run for its first {:.1} s); 2 workers",
            show(&before),
            show(&after),
            mode.map_or("default: auto".to_owned(), |m| format!("shard_transfer_mode => '{m}'")),
            took.as_secs_f64(),
            loaded.as_secs_f64()
        ),
    );
    o.notes.extend(notes);
    overlaps(&mut o, &ledger);
    o.checks.push((
        format!(
            "the job finished within {} s and moved shards to both nodes",
            REBALANCE_LIMIT.as_secs()
        ),
        state == "finished"
            && tasks > 0
            && after.get(&first).copied().unwrap_or(0) > 0
            && after.get(&second).copied().unwrap_or(0) > 0,
    ));
    o.checks
        .push(("rows ran during the moves".to_owned(), during > 0));
    o.checks.push((
        "no row ran twice at once".to_owned(),
        ledger.overlaps() == 0,
    ));
    Ok(o)
}

/// `:port n, :port m`.
fn show(placements: &BTreeMap<i32, i64>) -> String {
    let v: Vec<String> = placements
        .iter()
        .map(|(port, n)| format!(":{port} {n}"))
        .collect();
    format!("{{{}}}", v.join(", "))
}
