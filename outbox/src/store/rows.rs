//! The rows a store reads, and their decoding: claimed rows into [`Delivery`] (the columns
//! of `sql::claim::DELIVERY_COLUMNS`), live rows into [`StoredRow`]
//! (`sql::read::ROW_COLUMNS`), dead letters into [`DeadLetter`]
//! (`sql::read::DEAD_LETTER_COLUMNS`), each in column order.
//!
//! A claimed row is decoded one column at a time: a row whose stored fields do not decode
//! becomes a delivery with a `decode_error` instead of failing the whole claim, so one bad
//! row never stalls the rows beside it. The lease (id and token) and the queue always
//! decode: they are written by our own statements.

use chrono::{DateTime, Utc};
use sqlx::postgres::PgRow;
use sqlx::types::Json;
use sqlx::Row;
use uuid::Uuid;

use super::{clean_error_text, Delivery, Lease};
use crate::error::{OutboxSql, Result};
use crate::message::Headers;

/// A live row of the queue table as stored, read without leasing it: pending
/// (`acquired_token` is `None`) or leased by a worker (`acquired_token` and `acquired_at`
/// set). A row that is gone (completed, cancelled while pending, archived) is not live.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredRow {
    /// Primary key.
    pub id: i64,
    /// Queue name.
    pub queue: String,
    /// Encoded message.
    pub payload: Vec<u8>,
    /// Headers.
    pub headers: Option<Headers>,
    /// Failed handler runs so far.
    pub attempts_count: i32,
    /// Claims so far.
    pub deliveries_count: i32,
    /// Publish time.
    pub created_at: DateTime<Utc>,
    /// The deadline.
    pub next_attempt_at: DateTime<Utc>,
    /// First failed run.
    pub first_attempt_at: Option<DateTime<Utc>>,
    /// Latest failed run.
    pub last_attempt_at: Option<DateTime<Utc>>,
    /// Lease start; `None` when pending.
    pub acquired_at: Option<DateTime<Utc>>,
    /// Lease token; `None` when pending.
    pub acquired_token: Option<Uuid>,
    /// Timer key.
    pub timer_id: Option<String>,
    /// Queued rearm deadline (only on a leased row).
    pub rearm_at: Option<DateTime<Utc>>,
    /// Payload the rearm will install.
    pub rearm_payload: Option<Vec<u8>>,
    /// Headers the rearm will install.
    pub rearm_headers: Option<Headers>,
    /// When a cancel reached the row while it was leased: the run's end deletes the row.
    pub cancelled_at: Option<DateTime<Utc>>,
    /// The stored `headers` as JSON text, when they are not a JSON object of strings (then
    /// `headers` is `None`). Only SQL of someone else's writes such headers; a worker that
    /// claims the row ends it as a terminal `decode_error`.
    pub raw_headers: Option<String>,
    /// The same for `rearm_headers`.
    pub raw_rearm_headers: Option<String>,
}

/// A row archived in the dead-letter table: the failed run's row as it was, why it failed and
/// when, and whether it was redriven since. There is no foreign key to the queue table:
/// `original_id` names the queue row the run came from, which is usually gone by now.
/// Listed, redriven and purged with the operations of [`crate::dlq`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeadLetter {
    /// The dead-letter row's own id.
    pub id: i64,
    /// The queue row's id.
    pub original_id: i64,
    /// Queue name.
    pub queue: String,
    /// The failed run's payload (the original bytes, even when they did not decode).
    pub payload: Vec<u8>,
    /// Headers.
    pub headers: Option<Headers>,
    /// The archived `headers` as JSON text, when they are not a JSON object of strings (then
    /// `headers` is `None`): a row archived as `decode_error` keeps its headers as stored.
    pub raw_headers: Option<String>,
    /// Timer key.
    pub timer_id: Option<String>,
    /// Failed handler runs, the last one included when the handler ran.
    pub attempts_count: i32,
    /// Claims.
    pub deliveries_count: i32,
    /// The original row's publish time.
    pub created_at: DateTime<Utc>,
    /// When it was archived.
    pub failed_at: DateTime<Utc>,
    /// One of `max_deliveries`, `retry_exhausted`, `rejected`, `decode_error`, `timeout`,
    /// `aborted` (the values of `FailureReason::as_str`).
    pub failure_reason: String,
    /// The last error text.
    pub last_error: Option<String>,
    /// When a redrive re-published this row (the redriving transaction's database time);
    /// `None` while it was never redriven. A row is redriven at most once.
    pub redriven_at: Option<DateTime<Utc>>,
    /// The queue row that redrive created (its id in the queue table; the row itself may
    /// be gone by now, once it ran).
    pub redriven_id: Option<i64>,
}

pub(crate) fn delivery_from_row(row: &PgRow) -> Result<Delivery> {
    let mut problems: Vec<String> = Vec::new();
    let mut column = |name: &str, e: sqlx::Error| problems.push(format!("column `{name}`: {e}"));
    let (headers, raw_headers) = match headers_lenient(row, 4) {
        Ok(h) => h,
        Err(e) => {
            column("headers", e);
            (None, None)
        }
    };
    let claimed_at: DateTime<Utc> = row.try_get(11).unwrap_or_else(|e| {
        column("acquired_at", e);
        DateTime::<Utc>::UNIX_EPOCH
    });
    let mut lenient = |idx: usize, name: &str| -> Option<DateTime<Utc>> {
        row.try_get::<DateTime<Utc>, _>(idx)
            .map_err(|e| column(name, e))
            .ok()
    };
    let created_at = lenient(8, "created_at").unwrap_or(claimed_at);
    let deadline = lenient(9, "next_attempt_at").unwrap_or(claimed_at);
    let first_attempt_at = row
        .try_get::<Option<DateTime<Utc>>, _>(10)
        .unwrap_or_else(|e| {
            column("first_attempt_at", e);
            None
        });
    let payload: Vec<u8> = row.try_get(3).unwrap_or_else(|e| {
        column("payload", e);
        Vec::new()
    });
    let timer_id: Option<String> = row.try_get(5).unwrap_or_else(|e| {
        column("timer_id", e);
        None
    });
    let attempts_count: i32 = row.try_get(6).unwrap_or_else(|e| {
        column("attempts_count", e);
        0
    });
    let deliveries_count: i32 = row.try_get(7).unwrap_or_else(|e| {
        column("deliveries_count", e);
        i32::MAX
    });
    if let Some(raw) = raw_headers {
        problems.push(format!(
            "column `headers`: not a JSON object of strings: {}",
            clean_error_text(&raw)
        ));
    }
    Ok(Delivery {
        lease: Lease {
            id: row.try_get(0).outbox_sql()?,
            token: row.try_get(1).outbox_sql()?,
        },
        queue: row.try_get(2).outbox_sql()?,
        payload,
        headers,
        timer_id,
        attempts_count,
        deliveries_count,
        created_at,
        deadline,
        first_attempt_at,
        claimed_at,
        decode_error: (!problems.is_empty()).then(|| problems.join("; ")),
    })
}

/// A `headers` column as `(string map, raw JSON text)`: the map when the stored JSON is an
/// object of strings, else the raw text (headers written by SQL of someone else's, or a
/// rearm's). NULL is `(None, None)`.
fn headers_lenient(
    row: &PgRow,
    idx: usize,
) -> std::result::Result<(Option<Headers>, Option<String>), sqlx::Error> {
    match row.try_get::<Option<Json<Headers>>, _>(idx) {
        Ok(h) => Ok((h.map(|j| j.0), None)),
        Err(_) => {
            let raw: Option<Json<serde_json::Value>> = row.try_get(idx)?;
            Ok((None, raw.map(|j| j.0.to_string())))
        }
    }
}

/// Decodes the columns of `sql::read::ROW_COLUMNS`, in order.
pub(crate) fn stored_from_row(row: &PgRow) -> Result<StoredRow> {
    let (headers, raw_headers) = headers_lenient(row, 3).outbox_sql()?;
    let (rearm_headers, raw_rearm_headers) = headers_lenient(row, 15).outbox_sql()?;
    Ok(StoredRow {
        id: row.try_get(0).outbox_sql()?,
        queue: row.try_get(1).outbox_sql()?,
        payload: row.try_get(2).outbox_sql()?,
        headers,
        attempts_count: row.try_get(4).outbox_sql()?,
        deliveries_count: row.try_get(5).outbox_sql()?,
        created_at: row.try_get(6).outbox_sql()?,
        next_attempt_at: row.try_get(7).outbox_sql()?,
        first_attempt_at: row.try_get(8).outbox_sql()?,
        last_attempt_at: row.try_get(9).outbox_sql()?,
        acquired_at: row.try_get(10).outbox_sql()?,
        acquired_token: row.try_get(11).outbox_sql()?,
        timer_id: row.try_get(12).outbox_sql()?,
        rearm_at: row.try_get(13).outbox_sql()?,
        rearm_payload: row.try_get(14).outbox_sql()?,
        rearm_headers,
        cancelled_at: row.try_get(16).outbox_sql()?,
        raw_headers,
        raw_rearm_headers,
    })
}

/// Decodes the columns of `sql::read::DEAD_LETTER_COLUMNS`, in order.
pub(crate) fn dead_letter_from_row(r: &PgRow) -> Result<DeadLetter> {
    let (headers, raw_headers) = headers_lenient(r, 4).outbox_sql()?;
    Ok(DeadLetter {
        id: r.try_get(0).outbox_sql()?,
        original_id: r.try_get(1).outbox_sql()?,
        queue: r.try_get(2).outbox_sql()?,
        payload: r.try_get(3).outbox_sql()?,
        headers,
        raw_headers,
        timer_id: r.try_get(5).outbox_sql()?,
        attempts_count: r.try_get(6).outbox_sql()?,
        deliveries_count: r.try_get(7).outbox_sql()?,
        created_at: r.try_get(8).outbox_sql()?,
        failed_at: r.try_get(9).outbox_sql()?,
        failure_reason: r.try_get(10).outbox_sql()?,
        last_error: r.try_get(11).outbox_sql()?,
        redriven_at: r.try_get(12).outbox_sql()?,
        redriven_id: r.try_get(13).outbox_sql()?,
    })
}
