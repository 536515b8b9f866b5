//! The helpers every statement family renders with: the one place rendered text becomes
//! an executable statement, and the wake-up notification expression. A leaf of `sql`.

use std::sync::Arc;

use sqlx::{AssertSqlSafe, SqlSafeStr, SqlStr};

use crate::names::Names;

/// The one place rendered text becomes an executable statement (sqlx 0.9 refuses a
/// `String` that was not asserted safe). Safe: the text holds only our own SQL and
/// identifiers quoted by [`crate::names`]; values are bound, never pasted. Kept as an
/// `Arc<str>`, so executing it clones a pointer, not the text.
pub(super) fn statement(text: &str) -> SqlStr {
    AssertSqlSafe(Arc::<str>::from(text)).into_sql_str()
}

/// A query rendered from a raw string that starts on its own line.
pub(super) fn query(text: String) -> SqlStr {
    statement(text.trim())
}

/// The NOTIFY payload, `<deadline as epoch milliseconds>:<queue>`, as an
/// expression over the row alias `row`. Never payload data. Without notifications
/// (`OutboxBuilder::notify(false)`) a NULL of the same type: the statements keep their
/// shape and their results, and their commits skip the notification queue's lock.
pub(super) fn notify(n: &Names, row: &str) -> String {
    if !n.notify {
        return "NULL::text".to_owned();
    }
    format!(
        "pg_notify({channel}, floor(extract(epoch FROM {row}.next_attempt_at) * 1000)::bigint::text || ':' || {row}.queue)::text",
        channel = crate::names::quote_literal(&n.channel)
    )
}

/// Distributed mode: ` AND <alias>bucket = $<param>::smallint`, the predicate that routes a
/// statement to the one shard of a bucket (its value travels as the statement's last
/// parameter); empty for a single node, whose statements take no such parameter.
pub(super) fn in_bucket(n: &Names, alias: &str, param: u32) -> String {
    match n.buckets {
        Some(_) => format!(" AND {alias}bucket = ${param}::smallint"),
        None => String::new(),
    }
}
