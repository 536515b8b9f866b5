//! `outbox`: the operator's command for outbox queues on Postgres. See `outbox --help`.
//!
//! Exit status: 0 on success, 1 when the operation failed (or found schema problems, or
//! left rows undone), 2 on a usage error (clap's own, and ours: a missing database URL, a
//! URL that is not Postgres, a missing selector, a bad `--reason`, and every argument or
//! name the library refuses before running SQL). With `--json`, an error is one JSON object
//! on stderr: `{"error": "...", "exit_code": N}`.

mod cli;
mod connect;
mod dlq;
mod output;
mod queues;
mod schema;
mod status;
mod ui;

use std::process::ExitCode;

use clap::Parser;
use outbox::Outbox;
use serde_json::json;

use crate::cli::{Cli, Command, Global};
use crate::connect::{Failure, Target};

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            // --help and --version are not errors: clap prints them and exits 0.
            let wants_json = std::env::args_os().skip(1).any(|a| a == "--json");
            if e.use_stderr() && wants_json {
                let text = e.render().to_string();
                report_json(text.trim_end().trim_start_matches("error: "), e.exit_code());
                return ExitCode::from(u8::try_from(e.exit_code()).unwrap_or(2));
            }
            e.exit();
        }
    };
    let target = target(&cli);
    let json = cli.global.json;
    match run(cli, &target).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(f) => {
            let code = f.exit_code();
            let text = f.render(&target);
            if json {
                report_json(&text, i32::from(code));
            } else {
                eprintln!("error: {text}");
            }
            ExitCode::from(code)
        }
    }
}

/// An error as one JSON object on stderr.
fn report_json(text: &str, code: i32) {
    eprintln!("{}", json!({ "error": text, "exit_code": code }));
}

/// The tables and settings the command runs on, as advice must repeat them.
fn target(cli: &Cli) -> Target {
    let g = &cli.global;
    Target {
        schema: g.schema.clone(),
        table: (g.table != "outbox").then(|| g.table.clone()),
        dead_letter_table: g.dead_letter_table.clone(),
        dead_letter: dead_letter(cli),
        distributed: g.distributed,
    }
}

/// The dead-letter commands work on the dead-letter table whatever the flag says.
fn dead_letter(cli: &Cli) -> bool {
    cli.global.dead_letter || matches!(cli.command, Command::Dlq(_))
}

/// The application's `Outbox`, from the global options (names are checked here, before any
/// connection).
fn outbox(g: &Global, dead_letter: bool) -> Result<Outbox, Failure> {
    let mut b = Outbox::builder()
        .table(&g.table)
        .dead_letter(dead_letter)
        .transaction_pooler(g.transaction_pooler);
    if let Some(s) = &g.schema {
        b = b.schema(s);
    }
    if let Some(d) = &g.dead_letter_table {
        b = b.dead_letter_table(d);
    }
    if let Some(buckets) = g.distributed {
        b = b.distributed(buckets);
    }
    Ok(b.build()?)
}

async fn run(cli: Cli, target: &Target) -> Result<(), Failure> {
    let g = &cli.global;
    let outbox = outbox(g, dead_letter(&cli))?;
    let url = g
        .database_url
        .clone()
        .or_else(|| std::env::var("DATABASE_URL").ok());
    let pool = connect::connect(url.as_deref()).await?;
    let json = g.json;
    match cli.command {
        Command::Migrate {
            lock_timeout,
            deadline,
        } => schema::migrate(&outbox, &pool, target, lock_timeout, deadline, json).await,
        Command::Validate => schema::validate(&outbox, &pool, target, json).await,
        Command::Status(args) => status::run(&outbox, &pool, target, &args, json).await,
        Command::Pending { queue, limit } => {
            queues::pending(&outbox, &pool, &queue, cli::count(limit), json).await
        }
        Command::Pause { queue } => queues::pause(&outbox, &pool, &queue, true, json).await,
        Command::Resume { queue } => queues::pause(&outbox, &pool, &queue, false, json).await,
        Command::Cancel { queue, timer_id } => {
            queues::cancel(&outbox, &pool, &queue, &timer_id, json).await
        }
        Command::RunNow { id } => {
            queues::act(&outbox, &pool, id, queues::Action::RunNow, json).await
        }
        Command::Reschedule { id, in_, at } => {
            let action = match (in_, at) {
                (Some(d), _) => queues::Action::In(d),
                (None, Some(t)) => queues::Action::At(t),
                (None, None) => return Err(Failure::usage("say when: --in 5m or --at <time>")),
            };
            queues::act(&outbox, &pool, id, action, json).await
        }
        Command::Delete { id } => {
            queues::act(&outbox, &pool, id, queues::Action::Delete, json).await
        }
        Command::Dlq(cmd) => dlq::run(&outbox, &pool, cmd, json).await,
        Command::Ui(args) => ui::run(outbox, pool, args).await,
    }
}
