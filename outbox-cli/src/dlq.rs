//! `outbox dlq list | redrive | purge`.

use outbox::dlq::{DeadLetterFilter, Redrive, RedriveResult};
use outbox::store::FailureReason;
use outbox::Outbox;
use serde_json::{json, Value};
use sqlx::PgPool;

use crate::cli::{count, DlqCommand, DlqFilter};
use crate::connect::Failure;
use crate::output;

/// Every reason a dead letter can have, for parsing `--reason`.
const REASONS: [FailureReason; 6] = [
    FailureReason::MaxDeliveries,
    FailureReason::RetryExhausted,
    FailureReason::Rejected,
    FailureReason::DecodeError,
    FailureReason::Timeout,
    FailureReason::Aborted,
];

fn reason(s: &str) -> Result<FailureReason, Failure> {
    REASONS
        .into_iter()
        .find(|r| r.as_str() == s)
        .ok_or_else(|| {
            Failure::usage(format!(
                "unknown failure reason {s:?}: use one of {}",
                REASONS.map(FailureReason::as_str).join(", ")
            ))
        })
}

fn filter(f: &DlqFilter) -> Result<DeadLetterFilter, Failure> {
    // Checked here, in the options' own names (the library's error names its builder's
    // methods, failed_after and failed_before).
    if let (Some(since), Some(until)) = (f.since, f.until) {
        if since >= until {
            return Err(Failure::usage(format!(
                "--since ({since}) must be earlier than --until ({until})"
            )));
        }
    }
    let mut out = DeadLetterFilter::new().include_redriven(f.include_redriven);
    if let Some(q) = &f.queue {
        out = out.queue(q);
    }
    if let Some(r) = &f.reason {
        out = out.reason(reason(r)?);
    }
    if let Some(t) = f.since {
        out = out.failed_after(t);
    }
    if let Some(t) = f.until {
        out = out.failed_before(t);
    }
    Ok(out)
}

pub async fn run(
    outbox: &Outbox,
    pool: &PgPool,
    cmd: DlqCommand,
    as_json: bool,
) -> Result<(), Failure> {
    match cmd {
        DlqCommand::List {
            filter: f,
            limit,
            after,
        } => list(outbox, pool, &filter(&f)?, after, count(limit), as_json).await,
        DlqCommand::Redrive {
            ids,
            all,
            filter: f,
            limit,
        } => {
            // clap takes exactly one of --id and --all (the `which` group of `cli.rs`).
            let selection = if all {
                Redrive::matching(filter(&f.into())?, count(limit))
            } else {
                Redrive::ids(ids)
            };
            redrive(outbox, pool, &selection, as_json).await
        }
        DlqCommand::Purge {
            older_than,
            queue,
            batch_size,
        } => {
            let mut f = DeadLetterFilter::new()
                .older_than(older_than)
                .include_redriven(true);
            if let Some(q) = queue {
                f = f.queue(q);
            }
            let deleted = outbox
                .purge_dead_letters(pool, &f, count(batch_size))
                .await?;
            if as_json {
                output::json(&json!({ "deleted": deleted }));
            } else {
                output::line(format!(
                    "deleted {deleted} dead letter(s) older than {}",
                    humantime::format_duration(older_than)
                ));
            }
            Ok(())
        }
    }
}

async fn list(
    outbox: &Outbox,
    pool: &PgPool,
    filter: &DeadLetterFilter,
    after: Option<i64>,
    limit: usize,
    as_json: bool,
) -> Result<(), Failure> {
    let mut conn = pool.acquire().await?;
    let rows = outbox.dead_letters(&mut conn, filter, after, limit).await?;
    let next = if rows.len() == limit {
        rows.last().map(|d| d.id)
    } else {
        None
    };
    if as_json {
        let list: Vec<Value> = rows
            .iter()
            .map(|d| {
                json!({
                    "id": d.id,
                    "original_id": d.original_id,
                    "queue": d.queue,
                    "timer_id": d.timer_id,
                    "failure_reason": d.failure_reason,
                    "last_error": d.last_error,
                    "failed_at": output::time(d.failed_at),
                    "created_at": output::time(d.created_at),
                    "attempts_count": d.attempts_count,
                    "deliveries_count": d.deliveries_count,
                    "redriven_at": d.redriven_at.map(output::time),
                    "redriven_id": d.redriven_id,
                    "headers": d.headers,
                    "raw_headers": d.raw_headers,
                    "payload": output::payload_json(&d.payload),
                    "payload_hex": output::payload_hex(&d.payload),
                    "payload_bytes": d.payload.len(),
                })
            })
            .collect();
        output::json(&json!({ "dead_letters": list, "next_after": next }));
        return Ok(());
    }
    let mut t = output::table(&[
        "id",
        "original id",
        "queue",
        "timer id",
        "reason",
        "failed at",
        "last error",
        "redriven",
        "payload",
    ]);
    for d in &rows {
        t.add_row(vec![
            d.id.to_string(),
            d.original_id.to_string(),
            output::name(&d.queue).into_owned(),
            d.timer_id
                .as_deref()
                .map_or_else(|| "-".to_owned(), |k| output::name(k).into_owned()),
            d.failure_reason.clone(),
            output::time(d.failed_at),
            d.last_error
                .as_deref()
                .map_or_else(|| "-".to_owned(), output::one_line),
            d.redriven_id
                .map_or_else(|| "-".to_owned(), |id| format!("as row {id}")),
            output::payload(&d.payload),
        ]);
    }
    output::line(t);
    match next {
        Some(id) => output::line(format!(
            "{} dead letter(s); next page: --after {id}",
            rows.len()
        )),
        None => output::line(format!("{} dead letter(s)", rows.len())),
    }
    Ok(())
}

async fn redrive(
    outbox: &Outbox,
    pool: &PgPool,
    selection: &Redrive,
    as_json: bool,
) -> Result<(), Failure> {
    // One transaction: the redrive's statement commits with it, and nothing else runs in it.
    let mut tx = pool.begin().await?;
    let outcomes = outbox.redrive_dead_letters(&mut tx, selection).await?;
    tx.commit().await?;
    let redriven = outcomes
        .iter()
        .filter(|o| matches!(o.result, RedriveResult::Redriven { .. }))
        .count();
    if as_json {
        let list: Vec<Value> = outcomes
            .iter()
            .map(|o| {
                let mut v =
                    json!({ "dead_letter_id": o.dead_letter_id, "result": result_name(o.result) });
                match o.result {
                    RedriveResult::Redriven { id } => v["id"] = json!(id),
                    RedriveResult::AlreadyRedriven { redriven_id } => {
                        v["redriven_id"] = json!(redriven_id)
                    }
                    RedriveResult::HeadersTooLarge { bytes } => v["bytes"] = json!(bytes),
                    _ => {}
                }
                v
            })
            .collect();
        output::json(&json!({ "redriven": redriven, "outcomes": list }));
    } else {
        let mut t = output::table(&["dead letter", "outcome"]);
        for o in &outcomes {
            t.add_row(vec![o.dead_letter_id.to_string(), describe(o.result)]);
        }
        output::line(t);
        output::line(format!("redriven {redriven} of {}", outcomes.len()));
    }
    // A redrive is idempotent: one already redriven counts as done; any other outcome left
    // its dead letter where it was.
    let undone: Vec<String> = outcomes
        .iter()
        .filter(|o| {
            !matches!(
                o.result,
                RedriveResult::Redriven { .. } | RedriveResult::AlreadyRedriven { .. }
            )
        })
        .map(|o| o.dead_letter_id.to_string())
        .collect();
    if undone.is_empty() {
        Ok(())
    } else {
        Err(Failure::failed(format!(
            "{} dead letter(s) not redriven ({}): see the outcome of each above",
            undone.len(),
            undone.join(", ")
        )))
    }
}

fn result_name(r: RedriveResult) -> &'static str {
    match r {
        RedriveResult::Redriven { .. } => "redriven",
        RedriveResult::AlreadyRedriven { .. } => "already_redriven",
        RedriveResult::NotFound => "not_found",
        RedriveResult::TimerKeyHeld => "timer_key_held",
        RedriveResult::HeadersNotAMap => "headers_not_a_map",
        RedriveResult::HeadersTooLarge { .. } => "headers_too_large",
        _ => "other",
    }
}

fn describe(r: RedriveResult) -> String {
    match r {
        RedriveResult::Redriven { id } => format!("redriven as row {id}"),
        RedriveResult::AlreadyRedriven {
            redriven_id: Some(id),
        } => format!("already redriven (row {id})"),
        RedriveResult::AlreadyRedriven { redriven_id: None } => "already redriven".to_owned(),
        RedriveResult::NotFound => "no such dead letter".to_owned(),
        RedriveResult::TimerKeyHeld => {
            "kept: a live row holds its timer key (cancel or wait for it, then redrive)".to_owned()
        }
        RedriveResult::HeadersNotAMap => "kept: its stored headers are not a string map".to_owned(),
        RedriveResult::HeadersTooLarge { bytes } => format!(
            "kept: its headers with the redrive header would be {bytes} bytes, over the limit"
        ),
        other => format!("{other:?}"),
    }
}
