//! `outbox pending`, `pause`, `resume`, `cancel`, and the actions on one row: `run-now`,
//! `reschedule`, `delete`.

use std::time::Duration;

use chrono::{DateTime, Utc};
use outbox::admin::RowAction;
use outbox::{Cancelled, Outbox};
use serde_json::json;
use sqlx::PgPool;

use crate::connect::Failure;
use crate::output;

pub async fn pending(
    outbox: &Outbox,
    pool: &PgPool,
    queue: &str,
    limit: usize,
    as_json: bool,
) -> Result<(), Failure> {
    let mut conn = pool.acquire().await?;
    let rows = outbox.pending(&mut conn, queue, limit).await?;
    let limit_reached = rows.len() == limit;
    if as_json {
        let list: Vec<_> = rows
            .iter()
            .map(|r| {
                json!({
                    "id": r.id,
                    "queue": r.queue,
                    "timer_id": r.timer_id,
                    "state": if r.acquired_token.is_some() { "leased" } else { "pending" },
                    "next_attempt_at": output::time(r.next_attempt_at),
                    "acquired_at": r.acquired_at.map(output::time),
                    "attempts_count": r.attempts_count,
                    "deliveries_count": r.deliveries_count,
                    "created_at": output::time(r.created_at),
                    "rearm_at": r.rearm_at.map(output::time),
                    "cancelled_at": r.cancelled_at.map(output::time),
                    "headers": r.headers,
                    "payload": output::payload_json(&r.payload),
                    "payload_hex": output::payload_hex(&r.payload),
                    "payload_bytes": r.payload.len(),
                })
            })
            .collect();
        output::json(&json!({ "queue": queue, "rows": list, "limit_reached": limit_reached }));
        return Ok(());
    }
    let mut t = output::table(&[
        "id",
        "timer id",
        "state",
        "deadline",
        "attempts",
        "deliveries",
        "rearm at",
        "payload",
    ]);
    for r in &rows {
        let state = match (r.acquired_token.is_some(), r.cancelled_at.is_some()) {
            (false, _) => "pending",
            (true, false) => "leased",
            (true, true) => "leased, cancelled",
        };
        t.add_row(vec![
            r.id.to_string(),
            r.timer_id
                .as_deref()
                .map_or_else(|| "-".to_owned(), |k| output::name(k).into_owned()),
            state.to_owned(),
            output::time(r.next_attempt_at),
            r.attempts_count.to_string(),
            r.deliveries_count.to_string(),
            output::maybe_time(r.rearm_at),
            output::payload(&r.payload),
        ]);
    }
    output::line(t);
    output::line(format!("{} row(s) of {}", rows.len(), output::name(queue)));
    if limit_reached {
        output::line("(limit reached: more rows may exist; raise --limit)");
    }
    Ok(())
}

/// Cancels the timer keyed `timer_id` of `queue` (`Outbox::cancel`): a pending timer's row
/// is deleted; a running one's is marked and deleted however its run ends. Fails (exit 1)
/// when no live row holds the key.
pub async fn cancel(
    outbox: &Outbox,
    pool: &PgPool,
    queue: &str,
    timer_id: &str,
    as_json: bool,
) -> Result<(), Failure> {
    let mut conn = pool.acquire().await?;
    let cancelled = outbox.cancel(&mut conn, queue, timer_id).await?;
    drop(conn);
    let timer = format!(
        "timer {} of {}",
        output::name(timer_id),
        output::name(queue)
    );
    let (name, id, text) = match cancelled {
        Cancelled::Deleted { id } => (
            "deleted",
            Some(id),
            format!("{timer} cancelled: pending row {id} deleted"),
        ),
        Cancelled::Running { id } | Cancelled::RearmDropped { id } => (
            if matches!(cancelled, Cancelled::Running { .. }) {
                "running"
            } else {
                "rearm_dropped"
            },
            Some(id),
            format!(
                "{timer} cancelled: its row {id} is held by a worker, so it is marked \
                 cancelled and deleted however the run ends (no retry, no dead letter){}",
                if matches!(cancelled, Cancelled::RearmDropped { .. }) {
                    "; the rearm an extend had queued is dropped"
                } else {
                    ""
                }
            ),
        ),
        Cancelled::NotFound => (
            "not_found",
            None,
            format!("no live row holds {timer}: it ran, was cancelled, or never existed"),
        ),
        other => ("other", None, format!("{timer}: {other:?}")),
    };
    let doc = json!({ "queue": queue, "timer_id": timer_id, "result": name, "id": id });
    report(id.is_some(), text, doc, as_json)
}

/// An action's outcome: `doc` with --json, else `text` when it was `done`; a failure
/// (exit status 1) saying `text` when it was not.
fn report(done: bool, text: String, doc: serde_json::Value, as_json: bool) -> Result<(), Failure> {
    if as_json {
        output::json(&doc);
    } else if done {
        output::line(&text);
    }
    if done {
        Ok(())
    } else {
        Err(Failure::failed(text))
    }
}

/// Pauses (`on`) or resumes `queue`.
pub async fn pause(
    outbox: &Outbox,
    pool: &PgPool,
    queue: &str,
    on: bool,
    as_json: bool,
) -> Result<(), Failure> {
    let mut conn = pool.acquire().await?;
    let changed = if on {
        outbox.pause_queue(&mut conn, queue).await?
    } else {
        outbox.resume_queue(&mut conn, queue).await?
    };
    // A pause of a misspelt queue succeeds and stops nothing: say when it has no rows now.
    let empty = on && outbox.pending(&mut conn, queue, 1).await?.is_empty();
    let state = if on { "paused" } else { "running" };
    if as_json {
        let mut doc = json!({ "queue": queue, "state": state, "changed": changed });
        if on {
            doc["rows_now"] = json!(!empty);
        }
        output::json(&doc);
        return Ok(());
    }
    let hint = if empty {
        " (no rows in it now: check the name)"
    } else {
        ""
    };
    let queue = output::name(queue);
    match (on, changed) {
        (true, true) => output::line(format!("{queue}: paused{hint}")),
        (true, false) => output::line(format!("{queue}: already paused{hint}")),
        (false, true) => output::line(format!("{queue}: running")),
        (false, false) => output::line(format!("{queue} was not paused: nothing to resume")),
    }
    Ok(())
}

/// An operator's action on one pending row.
#[derive(Debug, Clone, Copy)]
pub enum Action {
    RunNow,
    In(Duration),
    At(DateTime<Utc>),
    Delete,
}

/// Runs `action` on row `id` in its own transaction; a row a worker holds or no live row
/// is a failure (exit status 1) with the reason.
pub async fn act(
    outbox: &Outbox,
    pool: &PgPool,
    id: i64,
    action: Action,
    as_json: bool,
) -> Result<(), Failure> {
    let mut tx = pool.begin().await?;
    let result = match action {
        Action::RunNow => outbox.run_now(&mut tx, id).await?,
        Action::In(d) => outbox.reschedule(&mut tx, id, d).await?,
        Action::At(t) => outbox.reschedule(&mut tx, id, t).await?,
        Action::Delete => outbox.delete_pending(&mut tx, id).await?,
    };
    tx.commit().await?;
    let (name, text) = match result {
        RowAction::Rescheduled { next_attempt_at } => (
            "rescheduled",
            format!("row {id}: due at {}", output::time(next_attempt_at)),
        ),
        RowAction::Deleted => ("deleted", format!("row {id}: deleted; it will not run")),
        RowAction::Leased => (
            "leased",
            format!(
                "row {id} is leased: a worker holds it (its handler runs, or its lease has not \
                 expired yet), so nothing changed; try again later, or stop a keyed timer with \
                 `outbox cancel QUEUE TIMER_ID`, which handles a running one"
            ),
        ),
        RowAction::NotFound => (
            "not_found",
            format!(
                "no live row has id {id}: it completed, was cancelled or deleted, or never \
                 existed (`outbox pending Q` lists live rows)"
            ),
        ),
        other => ("other", format!("row {id}: {other:?}")),
    };
    let done = matches!(result, RowAction::Rescheduled { .. } | RowAction::Deleted);
    let mut doc = json!({ "id": id, "result": name });
    if let RowAction::Rescheduled { next_attempt_at } = result {
        doc["next_attempt_at"] = json!(output::time(next_attempt_at));
    }
    report(done, text, doc, as_json)
}
