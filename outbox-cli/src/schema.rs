//! `outbox migrate` and `outbox validate`.

use std::collections::HashSet;
use std::time::Duration;

use outbox::schema::{MigrateOptions, SchemaProblem};
use outbox::{Error, Outbox};
use serde_json::json;
use sqlx::PgPool;

use crate::connect::{Failure, Target};
use crate::output;

pub async fn migrate(
    outbox: &Outbox,
    pool: &PgPool,
    target: &Target,
    lock_timeout: Option<Duration>,
    deadline: Option<Duration>,
    as_json: bool,
) -> Result<(), Failure> {
    let mut options = MigrateOptions::default();
    if let Some(t) = lock_timeout {
        options = options.lock_timeout(t);
    }
    if let Some(d) = deadline {
        options = options.deadline(d);
    }
    // What earlier runs recorded (none before the first: the library reads a missing
    // record table as empty), to tell this run's steps from theirs.
    let before: HashSet<i64> = outbox
        .applied_migrations(pool)
        .await?
        .iter()
        .map(|a| a.version)
        .collect();
    outbox.migrate_with(pool, options).await?;
    let applied = outbox.applied_migrations(pool).await?;
    let how = |a: &outbox::schema::AppliedMigration| {
        if a.found {
            "found applied"
        } else if before.contains(&a.version) {
            "applied earlier"
        } else {
            "applied now"
        }
    };
    let now = applied.iter().filter(|a| how(a) == "applied now").count();
    if as_json {
        let steps: Vec<_> = applied
            .iter()
            .map(|a| {
                json!({
                    "version": a.version,
                    "description": a.description,
                    "applied_at": output::time(a.applied_at),
                    "found": a.found,
                    "now": !before.contains(&a.version),
                })
            })
            .collect();
        let mut doc = target.json_names();
        doc.insert("steps".into(), steps.into());
        doc.insert("applied_now".into(), now.into());
        output::json(&serde_json::Value::Object(doc));
    } else {
        let mut t = output::table(&["version", "step", "applied at", "how"]);
        for a in &applied {
            t.add_row(vec![
                a.version.to_string(),
                a.description.clone(),
                output::time(a.applied_at),
                how(a).to_owned(),
            ]);
        }
        output::line(t);
        output::line(format!(
            "schema of {} is up to date; {now} step(s) applied now",
            target.table_name()
        ));
    }
    Ok(())
}

/// A problem in the CLI's words: what is wrong, and the command that fixes it when
/// `migrate` does.
fn describe(p: &SchemaProblem, target: &Target) -> (String, Option<String>) {
    let message = p
        .message
        .strip_suffix("; run the migrations")
        .unwrap_or(&p.message);
    let fixable = p.needs_upgrade || message.ends_with("is missing");
    (
        format!("{}: {message}", p.object),
        fixable.then(|| target.migrate()),
    )
}

/// Ok when the schema is current; every problem otherwise (and a failure, so the exit status
/// says so).
pub async fn validate(
    outbox: &Outbox,
    pool: &PgPool,
    target: &Target,
    as_json: bool,
) -> Result<(), Failure> {
    let problems = match outbox.validate_schema(pool).await {
        Ok(()) => Vec::new(),
        Err(Error::SchemaMismatch { problems }) => problems,
        Err(e) => return Err(e.into()),
    };
    let described: Vec<_> = problems.iter().map(|p| describe(p, target)).collect();
    if as_json {
        let list: Vec<_> = problems
            .iter()
            .zip(&described)
            .map(|(p, (_, fix))| {
                json!({
                    "object": p.object,
                    "message": p.message.strip_suffix("; run the migrations").unwrap_or(&p.message),
                    "needs_upgrade": p.needs_upgrade,
                    "fix": fix,
                })
            })
            .collect();
        output::json(&json!({ "ok": problems.is_empty(), "problems": list }));
    } else if problems.is_empty() {
        output::line(format!("schema of {} is valid", target.table_name()));
    } else {
        for (text, fix) in &described {
            match fix {
                Some(cmd) => output::line(format!("{text} (run `{cmd}`)")),
                None => output::line(text),
            }
        }
    }
    if problems.is_empty() {
        return Ok(());
    }
    let fix = if described.iter().any(|(_, f)| f.is_some()) {
        format!("; run `{}` to fix what it can", target.migrate())
    } else {
        String::new()
    };
    Err(Failure::failed(format!(
        "{} schema problem(s){fix}",
        problems.len()
    )))
}
