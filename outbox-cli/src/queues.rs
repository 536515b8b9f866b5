//! `outbox pending`, `outbox pause`, `outbox resume`.

use outbox::Outbox;
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
                    "payload_bytes": r.payload.len(),
                })
            })
            .collect();
        output::json(&json!({ "queue": queue, "rows": list }));
        return Ok(());
    }
    let mut t = output::table(&[
        "id",
        "timer id",
        "state",
        "due",
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
            r.timer_id.clone().unwrap_or_else(|| "-".to_owned()),
            state.to_owned(),
            output::time(r.next_attempt_at),
            r.attempts_count.to_string(),
            r.deliveries_count.to_string(),
            output::maybe_time(r.rearm_at),
            output::payload(&r.payload),
        ]);
    }
    println!("{t}");
    println!("{} row(s) of {queue}", rows.len());
    Ok(())
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
    let state = if on { "paused" } else { "running" };
    if as_json {
        output::json(&json!({ "queue": queue, "state": state, "changed": changed }));
    } else if changed {
        println!("{queue}: {state}");
    } else {
        println!("{queue}: already {state}");
    }
    Ok(())
}
