//! `outbox`: the operator's command for outbox queues on Postgres. See `outbox --help`.

mod cli;
mod connect;
mod dlq;
mod output;
mod queues;
mod schema;
mod status;

use std::process::ExitCode;

use clap::Parser;
use outbox::Outbox;

use crate::cli::{Cli, Command, Global};
use crate::connect::Failure;

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The application's `Outbox`, from the global options (names are checked here, before any
/// connection).
fn outbox(g: &Global, dead_letter: bool) -> Result<Outbox, Failure> {
    let mut b = Outbox::builder().table(&g.table).dead_letter(dead_letter);
    if let Some(s) = &g.schema {
        b = b.schema(s);
    }
    if let Some(d) = &g.dead_letter_table {
        b = b.dead_letter_table(d);
    }
    Ok(b.build()?)
}

async fn run(cli: Cli) -> Result<(), Failure> {
    let g = &cli.global;
    // The dead-letter commands work on the dead-letter table whatever the flag says.
    let dead_letter = g.dead_letter || matches!(cli.command, Command::Dlq(_));
    let outbox = outbox(g, dead_letter)?;
    let pool = connect::connect(g.database_url.as_deref()).await?;
    let json = g.json;
    match cli.command {
        Command::Migrate {
            lock_timeout,
            deadline,
        } => schema::migrate(&outbox, &pool, lock_timeout, deadline, json).await,
        Command::Validate => schema::validate(&outbox, &pool, json).await,
        Command::Status(args) => status::run(&outbox, &pool, &args, json).await,
        Command::Pending { queue, limit } => {
            queues::pending(&outbox, &pool, &queue, limit, json).await
        }
        Command::Pause { queue } => queues::pause(&outbox, &pool, &queue, true, json).await,
        Command::Resume { queue } => queues::pause(&outbox, &pool, &queue, false, json).await,
        Command::Dlq(cmd) => dlq::run(&outbox, &pool, cmd, json).await,
    }
}
