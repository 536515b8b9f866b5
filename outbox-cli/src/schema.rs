//! `outbox migrate` and `outbox validate`.

use std::time::Duration;

use outbox::schema::MigrateOptions;
use outbox::{Error, Outbox};
use serde_json::json;
use sqlx::PgPool;

use crate::connect::Failure;
use crate::output;

pub async fn migrate(
    outbox: &Outbox,
    pool: &PgPool,
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
    outbox.migrate_with(pool, options).await?;
    let applied = outbox.applied_migrations(pool).await?;
    if as_json {
        let steps: Vec<_> = applied
            .iter()
            .map(|a| {
                json!({
                    "version": a.version,
                    "description": a.description,
                    "applied_at": output::time(a.applied_at),
                    "found": a.found,
                })
            })
            .collect();
        output::json(&json!({ "table": outbox.table(), "steps": steps }));
    } else {
        let mut t = output::table(&["version", "step", "applied at", "how"]);
        for a in &applied {
            t.add_row(vec![
                a.version.to_string(),
                a.description.clone(),
                output::time(a.applied_at),
                if a.found { "found applied" } else { "applied" }.to_owned(),
            ]);
        }
        println!("{t}");
        println!("schema of {} is up to date", outbox.table());
    }
    Ok(())
}

/// Ok when the schema is current; every problem otherwise (and a failure, so the exit status
/// says so).
pub async fn validate(outbox: &Outbox, pool: &PgPool, as_json: bool) -> Result<(), Failure> {
    let problems = match outbox.validate_schema(pool).await {
        Ok(()) => Vec::new(),
        Err(Error::SchemaMismatch { problems }) => problems,
        Err(e) => return Err(e.into()),
    };
    if as_json {
        let list: Vec<_> = problems
            .iter()
            .map(|p| {
                json!({
                    "object": p.object,
                    "message": p.message,
                    "needs_upgrade": p.needs_upgrade,
                })
            })
            .collect();
        output::json(&json!({ "ok": problems.is_empty(), "problems": list }));
    } else if problems.is_empty() {
        println!("schema of {} is valid", outbox.table());
    } else {
        for p in &problems {
            println!("{p}");
        }
    }
    if problems.is_empty() {
        Ok(())
    } else {
        let upgrade = problems.iter().any(|p| p.needs_upgrade);
        Err(Failure(format!(
            "{} schema problem(s){}",
            problems.len(),
            if upgrade {
                "; run `outbox migrate` to upgrade"
            } else {
                ""
            }
        )))
    }
}
