//! `outbox status`: the statistics of every queue, once or every interval.

use std::io::IsTerminal;
use std::time::Duration;

use chrono::Utc;
use outbox::stats::{Count, QueueStats, StatsMode, StatsRequest};
use outbox::Outbox;
use serde_json::{json, Value};
use sqlx::PgPool;

use crate::cli::StatusArgs;
use crate::connect::{Failure, Target};
use crate::output;

pub async fn run(
    outbox: &Outbox,
    pool: &PgPool,
    target: &Target,
    args: &StatusArgs,
    as_json: bool,
) -> Result<(), Failure> {
    let mode = if args.estimate {
        StatsMode::Estimate
    } else {
        StatsMode::Exact
    };
    let mut request = StatsRequest::new(args.lease_ttl).mode(mode);
    if !args.queues.is_empty() {
        request = request.queues(args.queues.iter().cloned());
    }
    let Some(every) = args.watch else {
        return once(outbox, pool, target, &request, as_json, false).await;
    };
    // Until interrupted (Ctrl-C ends the process); a failed refresh ends it too, with the
    // reason, rather than showing stale figures.
    let clear = !as_json && std::io::stdout().is_terminal();
    loop {
        once(outbox, pool, target, &request, as_json, clear).await?;
        // At least 100 ms by the option's parser.
        tokio::time::sleep(every).await;
    }
}

async fn once(
    outbox: &Outbox,
    pool: &PgPool,
    target: &Target,
    request: &StatsRequest,
    as_json: bool,
    clear: bool,
) -> Result<(), Failure> {
    let mut conn = pool.acquire().await?;
    let stats = outbox.stats(&mut conn, request).await?;
    let paused: Vec<String> = outbox
        .paused_queues(&mut conn)
        .await?
        .into_iter()
        .map(|p| p.queue)
        .collect();
    drop(conn);
    if as_json {
        let queues: Vec<Value> = stats
            .iter()
            .map(|s| queue_json(s, paused.contains(&s.queue)))
            .collect();
        let mut doc = target.json_names();
        doc.insert("at".into(), output::time(Utc::now()).into());
        doc.insert("queues".into(), queues.into());
        doc.insert("paused".into(), paused.into());
        output::json(&Value::Object(doc));
        return Ok(());
    }
    if clear {
        output::raw("\x1b[2J\x1b[H");
    }
    let mut t = output::table(&[
        "queue",
        "state",
        "pending",
        "due",
        "leased",
        "expired leases",
        "oldest due for",
        "rearms",
        "cancel marks",
        "dead letters",
    ]);
    for s in &stats {
        t.add_row(vec![
            output::name(&s.queue).into_owned(),
            state(paused.contains(&s.queue)).to_owned(),
            s.pending.to_string(),
            s.due.to_string(),
            s.leased.to_string(),
            s.expired_leases.to_string(),
            s.oldest_due_lateness
                .map_or_else(|| "-".to_owned(), lateness),
            s.rearms.to_string(),
            s.cancel_marks.to_string(),
            s.dead_letters.to_string(),
        ]);
    }
    output::line(format!(
        "{} at {}{}",
        target.table_name(),
        output::time(Utc::now()),
        if request.stats_mode() == StatsMode::Estimate {
            " (estimates: ~n is the planner's figure, - not measured)"
        } else {
            ""
        }
    ));
    output::line(t);
    // Estimates come from the planner's statistics: a table never analyzed has none (a
    // fresh-user trial saw only `-` and no reason).
    if request.stats_mode() == StatsMode::Estimate
        && stats.iter().any(|s| s.pending == Count::Unavailable)
    {
        output::line(format!(
            "- where the planner has no statistics yet: autovacuum's ANALYZE makes them, or \
             run ANALYZE {} (or drop --estimate for exact counts)",
            target.table_name()
        ));
    }
    let idle: Vec<&String> = paused
        .iter()
        .filter(|q| !stats.iter().any(|s| &s.queue == *q))
        .collect();
    if !idle.is_empty() {
        output::line(format!(
            "paused, without rows: {}",
            idle.iter()
                .map(|q| output::name(q))
                .collect::<Vec<_>>()
                .join(", ")
        ));
    }
    Ok(())
}

fn state(paused: bool) -> &'static str {
    if paused {
        "paused"
    } else {
        "running"
    }
}

/// A lateness to the second for people (`1h 2m 3s`), milliseconds under a second.
fn lateness(d: Duration) -> String {
    if d < Duration::from_secs(1) {
        return format!("{}ms", d.as_millis());
    }
    humantime::format_duration(Duration::from_secs(d.as_secs())).to_string()
}

fn count_json(c: Count) -> Value {
    match c {
        Count::Exact(n) => json!(n),
        Count::Estimate(n) => json!({ "estimate": n }),
        Count::Unavailable => Value::Null,
    }
}

fn queue_json(s: &QueueStats, paused: bool) -> Value {
    json!({
        "queue": s.queue,
        "paused": paused,
        "pending": count_json(s.pending),
        "due": count_json(s.due),
        "leased": count_json(s.leased),
        "expired_leases": count_json(s.expired_leases),
        "oldest_due_lateness_ms": s.oldest_due_lateness.map(|d| d.as_millis() as u64),
        "rearms": count_json(s.rearms),
        "cancel_marks": count_json(s.cancel_marks),
        "dead_letters": count_json(s.dead_letters),
    })
}
