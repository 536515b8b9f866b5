//! `outbox-lab`: the benchmark lab, the runs that are never part of the gate. Its figures
//! are timings and take minutes; `docs/performance.md` and `docs/reliability.md` read them.
//!
//! ```text
//! cargo run --release -p outbox-lab -- run --repeat 3 --vs-peer '/tmp/peer-venv/bin/python \
//!     shared/peer/peer_bench.py --dsn postgresql+asyncpg://postgres@127.0.0.1:{port}/postgres --only {only}'
//! cargo run --release -p outbox-lab -- run --scale --json scale.jsonl   # growth curves
//! cargo run --release -p outbox-lab -- run --soak 3 --json soak.jsonl   # soak, 3 minutes
//! cargo run --release -p outbox-lab -- plot --scale scale.jsonl --soak soak.jsonl
//! cargo run --release -p outbox-lab -- faults                 # the fault matrix (docs/faults.md)
//! .ci/citus -- cargo run --release -p outbox-lab -- faults --citus   # its Citus faults
//! cargo run --release -p outbox-lab -- processes              # 1, 2, 4 worker processes
//! cargo run --release -p outbox-lab -- stats --rows 1000000   # the cost of Outbox::stats
//! cargo run --release -p outbox-lab -- pgbouncer              # transaction_pooler vs direct
//! cargo run --release -p outbox-lab --features opentelemetry -- run --only …   # with spans
//! ```
//!
//! `run` is the gate's `run` (`outbox-bench run`, the same scenarios and options) with the
//! lab's additions: the reference alongside (`--vs-peer`, see [`peer`]) or, instead of the
//! scenarios, the growth curves and the soak (`--scale`, `--soak`, see [`long`]).

mod citus_faults;
mod faults;
mod long;
#[cfg(feature = "opentelemetry")]
mod otel;
mod peer;
mod pgbouncer;
mod plot;
mod processes;
mod scale;
mod soak;
mod stats;

use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};
use outbox_bench::BoxError;

#[derive(Parser)]
#[command(
    name = "outbox-lab",
    about = "The benchmark lab of outbox: the reference comparison, growth curves, soak, \
             plots, the fault matrix, several processes, the statistics' cost"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Runs the scenarios as `outbox-bench run` does, with the reference alongside
    /// (`--vs-peer`), or the growth curves and the soak instead (`--scale`, `--soak`).
    Run(Box<LabRunArgs>),
    /// Runs the fault matrix: one fault per scenario while real workers consume, then
    /// accounts for every published row (docs/reliability.md); exits 1 if a row is lost or
    /// an expectation of the scenario is not met.
    Faults(faults::FaultArgs),
    /// The worker process of the `kill-9` fault (started by `faults`).
    #[command(hide = true)]
    FaultWorker(faults::WorkerArgs),
    /// Draws the SVG plots of `run --scale` / `run --soak` from their `--json` lines.
    Plot(plot::PlotArgs),
    /// Consumer throughput with 1, 2, 4, … worker processes on one database
    /// (docs/performance.md, "Several processes").
    Processes(processes::ProcessesArgs),
    /// A worker process of `processes` (started by it).
    #[command(hide = true)]
    ProcessWorker(outbox_worker_process::Options),
    /// The cost of the queue statistics (`Outbox::stats`, exact and estimate) at 10⁶ rows,
    /// in a database of its own created and dropped on `--server`.
    Stats(stats::StatsArgs),
    /// The cost of `transaction_pooler(true)`, direct and through PgBouncer: publish and
    /// worker rows/s (a Markdown table for the lab notes).
    Pgbouncer(pgbouncer::PgBouncerArgs),
}

/// `run`: the gate's options and the lab's.
#[derive(Args)]
struct LabRunArgs {
    #[command(flatten)]
    run: outbox_bench::run::RunArgs,
    /// Also runs this command (the reference) on the same server; see `peer.rs`.
    #[arg(long, value_name = "CMD")]
    vs_peer: Option<String>,
    #[command(flatten)]
    scale: scale::ScaleArgs,
    #[command(flatten)]
    soak: soak::SoakArgs,
    #[command(flatten)]
    plots: plot::PlotDir,
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    #[cfg(feature = "opentelemetry")]
    let otel = otel::install();
    // Dropping the future on Ctrl-C drops the cluster guard inside it, which stops and
    // removes the throwaway cluster.
    let work = async {
        match &cli.cmd {
            Cmd::Run(a) => run(a).await,
            Cmd::Faults(a) if a.citus => citus_faults::run(a).await,
            Cmd::Faults(a) => faults::run(a).await,
            Cmd::FaultWorker(a) => faults::child(a).await,
            Cmd::Plot(a) => plot::run(a).map(|()| ExitCode::SUCCESS),
            Cmd::Processes(a) => processes::run(a).await,
            Cmd::ProcessWorker(a) => outbox_worker_process::run(a)
                .await
                .map(|()| ExitCode::SUCCESS),
            Cmd::Stats(a) => stats::run(a).await,
            Cmd::Pgbouncer(a) => pgbouncer::run(a).await,
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
            eprintln!("outbox-lab: {e}");
            ExitCode::from(2)
        }
    }
}

async fn run(a: &LabRunArgs) -> Result<ExitCode, BoxError> {
    if cfg!(feature = "opentelemetry") && a.run.write_baseline {
        return Err(
            "built with the feature `opentelemetry`: the baseline measures the runtime \
                    as shipped (feature off, no subscriber); build without it"
                .into(),
        );
    }
    if a.scale.scale || a.soak.soak.is_some() {
        if a.run.write_baseline || a.vs_peer.is_some() || !a.run.common.only.is_empty() {
            return Err(
                "--scale and --soak run no scenario: drop --write-baseline, --vs-peer and --only"
                    .into(),
            );
        }
        let json = a.run.json.as_deref();
        return long::run(&a.run.common, &a.scale, &a.soak, &a.plots, json).await;
    }
    match &a.vs_peer {
        Some(cmd) => {
            let mut reference = peer::Reference::new(cmd, a.run.common.verbose);
            outbox_bench::run::run(&a.run, &mut reference).await
        }
        None => outbox_bench::run::run(&a.run, &mut ()).await,
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    /// Clap's own consistency checks (unique ids, valid defaults), which it otherwise makes
    /// only when a command is first parsed.
    #[test]
    fn the_command_line_is_consistent() {
        super::Cli::command().debug_assert();
    }
}
