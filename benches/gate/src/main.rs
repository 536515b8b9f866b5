//! `outbox-bench`: the benchmark gate of SPEC §12 (what CI runs).
//!
//! ```text
//! cargo run --release -p outbox-bench -- run                    # every scenario, report
//! cargo run --release -p outbox-bench -- run --repeat 3 --write-baseline   # re-record benches/baseline.json
//! cargo run -p outbox-bench -- check                            # gate against the baseline
//! ```
//!
//! The lab's longer runs (the reference comparison, growth curves, soak, plots, the fault
//! matrix, several processes, the statistics' cost, OpenTelemetry) are `outbox-lab`'s
//! (`benches/lab`).

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use outbox_bench::run::{CheckArgs, RunArgs};
use outbox_bench::BoxError;

#[derive(Parser)]
#[command(
    name = "outbox-bench",
    about = "The benchmark gate of outbox (SPEC §12): the scenarios' counts against benches/baseline.json"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Runs the scenarios and prints their figures (and a Markdown summary).
    Run(Box<RunArgs>),
    /// Runs the gated scenarios and compares them with the baseline; exits 1 on a regression.
    Check(CheckArgs),
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    // Dropping the future on Ctrl-C drops the cluster guard inside it, which stops and
    // removes the throwaway cluster.
    let work = async {
        match &cli.cmd {
            Cmd::Run(a) => outbox_bench::run::run(a, &mut ()).await,
            Cmd::Check(a) => outbox_bench::run::check(a).await,
        }
    };
    let result: Result<ExitCode, BoxError> = tokio::select! {
        r = work => r,
        _ = tokio::signal::ctrl_c() => Err("interrupted".into()),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("outbox-bench: {e}");
            ExitCode::from(2)
        }
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
