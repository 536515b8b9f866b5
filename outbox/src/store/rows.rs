//! Decoding claimed rows (the columns of `sql::claim::DELIVERY_COLUMNS`, in order), one row
//! and one column at a time: a row whose stored fields do not decode becomes a delivery
//! with a `decode_error` instead of failing the whole claim, so one bad row never stalls
//! the rows beside it. The lease (id and token) and the queue always decode: they are
//! written by our own statements.

use chrono::{DateTime, Utc};
use sqlx::postgres::PgRow;
use sqlx::Row;

use super::{Delivery, Lease};
use crate::error::Result;
use crate::read::headers_lenient;

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
            crate::store::clean_error_text(&raw)
        ));
    }
    Ok(Delivery {
        lease: Lease {
            id: row.try_get(0)?,
            token: row.try_get(1)?,
        },
        queue: row.try_get(2)?,
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
