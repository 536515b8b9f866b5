//! `outbox-bench`: the benchmark harness and regression gate of SPEC §12.
//!
//! ```text
//! cargo run --release -p outbox-bench -- run                    # every scenario, report
//! cargo run --release -p outbox-bench -- run --write-baseline   # re-record benches/baseline.json
//! cargo run --release -p outbox-bench -- check                  # gate against the baseline
//! cargo run --release -p outbox-bench -- run --vs-peer '/tmp/peer-venv/bin/python \
//!     shared/peer/peer_bench.py --dsn postgresql+asyncpg://postgres@127.0.0.1:{port}/postgres --only {only}'
//! cargo run --release -p outbox-bench -- faults                 # the fault matrix (docs/faults.md)
//! cargo run --release -p outbox-bench -- run --scale --json scale.jsonl   # growth curves
//! cargo run --release -p outbox-bench -- run --soak 3 --json soak.jsonl   # soak, 3 minutes
//! cargo run --release -p outbox-bench -- plot --scale scale.jsonl --soak soak.jsonl
//! cargo run --release -p outbox-bench -- stats --rows 1000000   # the cost of Outbox::stats
//! ```
//!
//! Without `--dsn` the harness starts a throwaway Postgres cluster with
//! `pg_stat_statements` preloaded (see [`cluster`]) and removes it afterwards. The figures,
//! which of them are gated, and how to read them are in `docs/benchmarks.md`.

mod cluster;
mod faults;
mod long;
#[cfg(feature = "opentelemetry")]
mod otel;
mod payload;
mod peer;
mod plot;
mod probe;
mod processes;
mod recorder;
mod report;
mod scale;
mod scenarios;
mod soak;
mod stats;

use sqlx::AssertSqlSafe;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};
use sqlx::postgres::PgConnectOptions;
use sqlx::ConnectOptions;

use crate::report::{Baseline, Machine};
use crate::scenarios::{Env, Measurement, Scenario};

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

#[derive(Parser)]
#[command(
    name = "outbox-bench",
    about = "Benchmark harness and regression gate for outbox (SPEC §12), and its fault matrix"
)]
struct Top {
    #[command(subcommand)]
    cmd: TopCmd,
}

#[derive(Subcommand)]
enum TopCmd {
    #[command(flatten)]
    Bench(Cmd),
    /// Runs the fault matrix: one fault per scenario while real workers consume, then
    /// accounts for every published row (docs/faults.md); exits 1 if a row is lost or
    /// an expectation of the scenario is not met.
    Faults(faults::FaultArgs),
    /// The worker process of the `kill-9` fault (started by `faults`).
    #[command(hide = true)]
    FaultWorker(faults::WorkerArgs),
    /// Draws the SVG plots of `run --scale` / `run --soak` from their `--json` lines.
    Plot(plot::PlotArgs),
    /// Consumer throughput with 1, 2, 4, … worker processes on one database
    /// (docs/benchmarks.md, "Several processes").
    Processes(processes::ProcessesArgs),
    /// A worker process of `processes` (started by it).
    #[command(hide = true)]
    ProcessWorker(processes::ChildArgs),
    /// The cost of the queue statistics (`Outbox::stats`, exact and estimate) at 10⁶ rows,
    /// in a database of its own created and dropped on `--server`.
    Stats(stats::StatsArgs),
}

struct Cli {
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Runs the scenarios and prints their figures (and a Markdown summary).
    Run(Box<RunArgs>),
    /// Runs the gated scenarios and compares them with the baseline; exits 1 on a regression.
    Check(CheckArgs),
}

#[derive(Args)]
struct Common {
    /// Use this server instead of a throwaway cluster. It must preload pg_stat_statements
    /// and should not be busy with anything else (server-wide WAL counters are read).
    #[arg(long)]
    dsn: Option<String>,
    /// The server whose settings the throwaway cluster copies (shared_buffers, fsync,
    /// synchronous_commit, …); ignored when it does not answer.
    #[arg(long, default_value = "postgres://postgres@127.0.0.1:5432/postgres")]
    mirror: String,
    /// Comma-separated scenario names (default: all for `run`, all with a gated figure for `check`).
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
    /// sqlx's `test_before_acquire` on the worker's pool. Off by default, as the `PgStore`
    /// docs recommend; `on` (sqlx's own default: one more round trip per pool checkout,
    /// invisible to pg_stat_statements) is a diagnostic, never for baselines.
    #[arg(long, default_value = "off", value_parser = ["on", "off"])]
    pool_ping: String,
    /// sqlx's `test_before_acquire` on the application's pool (publishes, extends, the
    /// caller's transactions). On by default, sqlx's default as an application has it;
    /// `off` is a diagnostic, never for baselines.
    #[arg(long, default_value = "on", value_parser = ["on", "off"])]
    app_pool_ping: String,
    /// Keep the scenario tables afterwards (for inspection).
    #[arg(long)]
    keep_tables: bool,
    /// Print every statement of every scenario.
    #[arg(short, long)]
    verbose: bool,
    /// Print `pg_waldump --stats=record` for each run (throwaway cluster only).
    #[arg(long)]
    waldump: bool,
    /// Extra `name=value` server setting for the throwaway cluster (repeatable), for
    /// diagnostics such as `--pg-set synchronous_commit=off`. Never for baselines.
    #[arg(long, value_name = "NAME=VALUE")]
    pg_set: Vec<String>,
    /// Extra storage parameter for each scenario table (repeatable), for diagnostics such
    /// as `--table-set fillfactor=70`. Never for baselines.
    #[arg(long, value_name = "NAME=VALUE")]
    table_set: Vec<String>,
    /// Baseline file.
    #[arg(long, default_value = default_baseline())]
    baseline: PathBuf,
}

#[derive(Args)]
struct RunArgs {
    #[command(flatten)]
    common: Common,
    /// Runs each scenario this many times and reports the run with the median throughput;
    /// counts that differ between repeats are reported (they must not).
    #[arg(long, default_value_t = 1)]
    repeat: usize,
    /// Writes the results to the baseline file.
    #[arg(long)]
    write_baseline: bool,
    /// Also runs this command (the reference) per scenario on the same server; see `peer.rs`.
    #[arg(long, value_name = "CMD")]
    vs_peer: Option<String>,
    /// Writes every measurement as one JSON object per line to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    #[command(flatten)]
    scale: scale::ScaleArgs,
    #[command(flatten)]
    soak: soak::SoakArgs,
    #[command(flatten)]
    plots: plot::PlotDir,
}

#[derive(Args)]
struct CheckArgs {
    #[command(flatten)]
    common: Common,
}

fn shown(p: &std::path::Path) -> String {
    std::fs::canonicalize(p)
        .unwrap_or_else(|_| p.to_owned())
        .display()
        .to_string()
}

fn default_baseline() -> &'static str {
    concat!(env!("CARGO_MANIFEST_DIR"), "/../baseline.json")
}

#[tokio::main]
async fn main() -> ExitCode {
    let top = Top::parse();
    #[cfg(feature = "opentelemetry")]
    let otel = otel::install();
    // Dropping the future on Ctrl-C drops the cluster guard inside it, which stops and
    // removes the throwaway cluster.
    let work = async {
        match top.cmd {
            TopCmd::Bench(cmd) => run(Cli { cmd }).await,
            TopCmd::Faults(a) => faults::run(&a).await,
            TopCmd::FaultWorker(a) => faults::child(&a).await,
            TopCmd::Plot(a) => plot::run(&a).map(|()| ExitCode::SUCCESS),
            TopCmd::Processes(a) => processes::run(&a).await,
            TopCmd::ProcessWorker(a) => processes::child(&a).await,
            TopCmd::Stats(a) => stats::run(&a).await,
        }
    };
    let result = tokio::select! {
        r = work => r,
        _ = tokio::signal::ctrl_c() => Err("interrupted".into()),
    };
    #[cfg(feature = "opentelemetry")]
    otel.finish();
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("outbox-bench: {e}");
            ExitCode::from(2)
        }
    }
}

async fn run(cli: Cli) -> Result<ExitCode, BoxError> {
    // Install the metrics recorder before any worker exists.
    recorder::watch();
    let (common, checking) = match &cli.cmd {
        Cmd::Run(a) => (&a.common, false),
        Cmd::Check(a) => (&a.common, true),
    };
    let selected = select(&common.only, checking)?;
    let write_baseline = matches!(&cli.cmd, Cmd::Run(a) if a.write_baseline);
    if cfg!(feature = "opentelemetry") && (checking || write_baseline) {
        return Err("built with the feature `opentelemetry`: the gate and the baseline measure                     the runtime as shipped (feature off, no subscriber); build without it"
            .into());
    }
    if let Cmd::Run(a) = &cli.cmd {
        if a.write_baseline && !common.only.is_empty() {
            return Err("--write-baseline records every scenario; drop --only".into());
        }
    }
    let baseline = if checking {
        Some(Baseline::load(&common.baseline)?)
    } else {
        None
    };

    if let Cmd::Run(a) = &cli.cmd {
        let diagnostics = !common.pg_set.is_empty()
            || !common.table_set.is_empty()
            || common.pool_ping != "off"
            || common.app_pool_ping != "on";
        if a.write_baseline && diagnostics {
            return Err(
                "--write-baseline records the product as shipped and configured as \
                 documented; drop --pg-set/--table-set/--pool-ping/--app-pool-ping"
                    .into(),
            );
        }
    }
    // The soak needs autovacuum whatever the mirrored server says (see soak.rs).
    let mut pg_set = common.pg_set.clone();
    if let Cmd::Run(a) = &cli.cmd {
        if a.soak.soak.is_some() {
            pg_set.push(format!("autovacuum={}", a.soak.autovacuum));
        }
    }
    let mut cluster = None;
    let (dsn, server) = match &common.dsn {
        Some(d) => (d.clone(), "given server".to_owned()),
        None => {
            eprintln!("starting a throwaway Postgres cluster with pg_stat_statements …");
            let started = cluster::Cluster::start(Some(&common.mirror), &pg_set)
                .await
                .map_err(|e| {
                    format!(
                        "could not start the throwaway Postgres cluster (docs/benchmarks.md, \
                         \"The throwaway cluster\"): {e}"
                    )
                })?;
            let c = cluster.insert(started);
            let settings: Vec<String> = c
                .settings
                .iter()
                .filter(|(k, _)| {
                    !matches!(
                        k.as_str(),
                        "listen_addresses" | "port" | "unix_socket_directories"
                    )
                })
                .map(|(k, v)| format!("{k}={}", v.trim_matches('\'')))
                .collect();
            eprintln!("cluster on port {}: {}", c.port(), settings.join(" "));
            let server = if pg_set.is_empty() {
                "throwaway cluster".to_owned()
            } else {
                format!("throwaway cluster with {}", pg_set.join(" "))
            };
            (c.dsn(), server)
        }
    };
    let opts: PgConnectOptions = dsn.parse()?;
    let mut probe_conn = opts
        .clone()
        .application_name("outbox-bench-probe")
        .connect()
        .await?;
    if let Err(e) = sqlx::query(AssertSqlSafe(format!(
        "{} SELECT 1 FROM pg_stat_statements LIMIT 1",
        probe::TAG
    )))
    .execute(&mut probe_conn)
    .await
    {
        return Err(format!(
            "pg_stat_statements is not usable on {dsn}: {e} (it needs shared_preload_libraries; omit --dsn for a throwaway cluster)"
        )
        .into());
    }
    let version: String = sqlx::query_scalar("SELECT current_setting('server_version')")
        .fetch_one(&mut probe_conn)
        .await?;
    let machine = Machine::read(&format!("PostgreSQL {version}"), &server);
    println!("{}", machine.describe());
    println!(
        "pools: worker test_before_acquire({}){}, application test_before_acquire({}){}; \
         …/async scenarios: synchronous_commit=off on the worker's and the extending connections",
        common.pool_ping == "on",
        if common.pool_ping == "on" {
            " [diagnostic]"
        } else {
            ""
        },
        common.app_pool_ping == "on",
        if common.app_pool_ping == "on" {
            ""
        } else {
            " [diagnostic]"
        },
    );

    let mut env = Env {
        opts: opts.clone(),
        probe: probe_conn,
        worker_ping: common.pool_ping == "on",
        app_ping: common.app_pool_ping == "on",
        keep_tables: common.keep_tables,
        verbose: common.verbose,
        table_set: common.table_set.clone(),
    };
    let target = peer::Target {
        host: opts.get_host().to_owned(),
        port: opts.get_port(),
        dsn: dsn.clone(),
    };

    if let Cmd::Run(a) = &cli.cmd {
        if a.scale.scale || a.soak.soak.is_some() {
            if a.write_baseline || a.vs_peer.is_some() || !common.only.is_empty() {
                return Err(
                    "--scale and --soak run no scenario: drop --write-baseline, \
                            --vs-peer and --only"
                        .into(),
                );
            }
            let json = a.json.as_deref();
            return long::run(&mut env, &a.scale, &a.soak, &a.plots, json).await;
        }
    }

    let (repeat, vs_peer) = match &cli.cmd {
        Cmd::Run(a) => (a.repeat.max(1), a.vs_peer.clone()),
        Cmd::Check(_) => (1, None),
    };
    let per_scenario_peer = vs_peer.as_deref().filter(|c| c.contains("{only}"));
    let mut results: Vec<Measurement> = Vec::new();
    let mut peers = Vec::new();
    for sc in &selected {
        // Ours and the reference alternate, so a burst of load elsewhere on the machine
        // hits both sides alike; each side reports its median run.
        let mut runs = Vec::new();
        let mut peer_runs: Vec<Vec<peer::PeerResult>> = Vec::new();
        for r in 0..repeat {
            let out = scenarios::run(&mut env, sc).await?;
            if repeat > 1 {
                eprintln!("  {} run {}: {}", sc.name, r + 1, headline(&out.m));
            }
            if common.waldump {
                if let Some(c) = &cluster {
                    println!(
                        "{} run {}: {}",
                        sc.name,
                        r + 1,
                        c.waldump(&out.lsn.0, &out.lsn.1)?
                    );
                }
            }
            runs.push((out.m, out.statements));
            if let Some(cmd) = per_scenario_peer.filter(|_| !sc.peer.is_empty()) {
                let got = peer::run(&mut env, cmd, &target, Some(sc), common.verbose).await?;
                for p in &got {
                    eprintln!("  reference {} run {}: {}", p.scenario, r + 1, p.headline());
                }
                peer_runs.push(got);
            }
        }
        for (m, _) in &runs[1..] {
            let first = &runs[0].0;
            let differ = report::gated_counts_differ(sc, first, m);
            if !differ.is_empty() {
                println!(
                    "  note: {} gated counts differ between repeats (they must not): {}",
                    sc.name,
                    differ.join(", ")
                );
            }
        }
        runs.sort_by(|a, b| rank(&a.0).total_cmp(&rank(&b.0)));
        let (m, statements) = runs.swap_remove(runs.len() / 2);
        report::print_block(&m, &statements, env.verbose);
        results.push(m);
        for name in sc.peer {
            let mut same: Vec<peer::PeerResult> = peer_runs
                .iter()
                .flatten()
                .filter(|p| p.scenario == *name)
                .cloned()
                .collect();
            if same.is_empty() {
                continue;
            }
            same.sort_by(|a, b| a.rank().total_cmp(&b.rank()));
            let p = same.swap_remove(same.len() / 2);
            println!("  reference {}: {}", p.scenario, p.headline());
            peers.push(p);
        }
    }
    if let Some(cmd) = vs_peer.as_deref().filter(|c| !c.contains("{only}")) {
        peers = peer::run(&mut env, cmd, &target, None, common.verbose).await?;
    }

    println!();
    println!("{}", report::summary_table(&results));
    if let Some(line) = report::against_commit_limit(&results) {
        println!("{line}\n");
    }
    if !peers.is_empty() {
        println!("outbox vs reference (same server, same sitting):\n");
        println!("{}", report::peer_table(&results, &peers));
    }

    match &cli.cmd {
        Cmd::Run(a) => {
            if let Some(path) = &a.json {
                let mut text = String::new();
                for m in &results {
                    text.push_str(&serde_json::to_string(m)?);
                    text.push('\n');
                }
                std::fs::write(path, text)?;
            }
            if a.write_baseline {
                Baseline::new(machine, &results).save(&common.baseline)?;
                println!("baseline written to {}", shown(&common.baseline));
            }
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Check(_) => {
            let baseline = baseline.ok_or("no baseline")?;
            println!(
                "check against {} (recorded {})",
                shown(&common.baseline),
                baseline.machine.date
            );
            let regressions = report::compare(&baseline, &results);
            if regressions.is_empty() {
                println!("check: ok ({} scenarios)", results.len());
                Ok(ExitCode::SUCCESS)
            } else {
                for r in &regressions {
                    println!(
                        "REGRESSION {}: {}: baseline {}, current {} ({})",
                        r.scenario, r.metric, r.baseline, r.current, r.why
                    );
                }
                println!("check: {} regression(s)", regressions.len());
                Ok(ExitCode::FAILURE)
            }
        }
    }
}

/// What a run is ranked by when picking the median: throughput, or lateness p99.
fn rank(m: &Measurement) -> f64 {
    m.lateness_ms.map_or(m.msgs_per_second, |l| l.p99)
}

fn headline(m: &Measurement) -> String {
    match m.lateness_ms {
        Some(l) => format!(
            "lateness p50 {:.1} p99 {:.1} max {:.1} ms",
            l.p50, l.p99, l.max
        ),
        None => match m.client_cpu_seconds {
            Some(cpu) => format!(
                "{:.0} msg/s, client CPU {:.0} µs/msg",
                m.msgs_per_second,
                cpu * 1e6 / m.messages as f64
            ),
            None => format!("{:.0} msg/s", m.msgs_per_second),
        },
    }
}

/// The scenarios to run.
fn select(only: &[String], checking: bool) -> Result<Vec<Scenario>, BoxError> {
    if only.is_empty() {
        return Ok(scenarios::ALL
            .iter()
            .filter(|s| !checking || s.gates_tuples_and_wal())
            .copied()
            .collect());
    }
    only.iter()
        .map(|n| {
            scenarios::find(n).copied().ok_or_else(|| {
                let names: Vec<&str> = scenarios::ALL.iter().map(|s| s.name).collect();
                format!("unknown scenario `{n}`; known: {}", names.join(", ")).into()
            })
        })
        .collect()
}
